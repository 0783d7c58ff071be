"""What streaming a long tool call costs the server's event loop: linear in the call's length.

A coding agent's tool call can carry a whole file in its arguments (tens of KB). The server parses a
streamed answer as its text arrives (``hyla.server.tool_call_stream.ToolCallStream``), a few characters
a chunk. Sent whole (the Responses API's stream), a call block is held until its end marker comes;
sent incrementally (chat completions, since 2026-12-07), the call's name goes out as soon as it is
written and its arguments as they come, an echo of the syntax following the open block. Before
2026-12-06 the held block was one string, extended and searched again from its start at every chunk:
quadratic in the call's length (0.305 s of the event loop for a 70 KB call in 4-character chunks). It
is now kept as its pieces, each searched for the end marker alone. Timed in the same run: the stream
fed chunk by chunk, whole and incremental, against the whole answer parsed at once
(``ToolCallParser.parse``, the floor: the same parse with no chunks), for calls of growing size, each
checked to give the same content and calls; and the chunk whose deltas first carry the call (the
client sees it coming). Medians of ``--repeats`` runs.

    .venv/bin/python benchmarks/tool_call_stream.py [--chunk 4] [--repeats 5] [--sizes 1000,10000] [--no-write]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.report import machine, median_ms, write_section  # noqa: E402
from hyla.server.tool_calls import ToolCallParser  # noqa: E402

SIZES = [1_000, 10_000, 70_000, 300_000]  # characters of the call's arguments (a file's content)


def answer(parser: ToolCallParser, size: int) -> str:
    """A chat answer: a sentence, then one call writing a file of ``size`` characters, then a sentence."""
    content = ("x = 1\n" * (size // 6 + 1))[:size]
    call = json.dumps({"name": "write_file", "arguments": {"path": "a.py", "content": content}})
    return f"Writing the file.\n{parser.start}\n{call}\n{parser.end}\nDone."


def streamed(parser: ToolCallParser, text: str, chunk: int, incremental: bool = False) -> tuple[str, list, int]:
    """The answer fed to a stream ``chunk`` characters at a time: its content deltas joined, its calls, and
    the chunk whose deltas first carried a call (1-based)."""
    stream, content, first = parser.stream(incremental=incremental), [], 0
    pieces = [text[i:i + chunk] for i in range(0, len(text), chunk)]
    for k, piece in enumerate(pieces):
        c, deltas = stream.feed(piece, final=k == len(pieces) - 1)
        content.append(c)
        first = first or (k + 1 if deltas else 0)
    return "".join(content), stream.calls, first


def _same(parsed: tuple[str, list]) -> tuple[str, list[tuple[str, str]]]:
    """A parse's content and calls, the calls without their ids (each call gets a new one)."""
    return parsed[0], [(c.name, c.arguments) for c in parsed[1]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--chunk", type=int, default=4, help="characters per streamed chunk (a token is ~4)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)), help="characters of each call's arguments")
    ap.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    args = ap.parse_args()
    parser = ToolCallParser("qwen")
    rows = ["| arguments (chars) | chunks | whole parse (ms) | streamed whole (ms) | µs per KB | call first seen "
            "at chunk | streamed incremental (ms) | µs per KB | call first seen at chunk |",
            "|---|---|---|---|---|---|---|---|---|"]
    for size in (int(x) for x in args.sizes.split(",")):
        text = answer(parser, size)
        cells = []
        for incremental in (False, True):
            content, calls, first = streamed(parser, text, args.chunk, incremental)
            if _same((content, calls)) != _same(parser.parse(text)):
                raise SystemExit(f"the stream and the whole parse differ at {size} characters")
            ms = median_ms(lambda: streamed(parser, text, args.chunk, incremental), args.repeats)
            cells.append(f"{ms:.2f} | {ms * 1e3 / (len(text) / 1024):.0f} | {first:,}")
        w = median_ms(lambda: parser.parse(text), args.repeats)
        rows.append(f"| {size:,} | {-(-len(text) // args.chunk):,} | {w:.2f} | {cells[0]} | {cells[1]} |")
        print(rows[-1], flush=True)
    body = (f"`benchmarks/tool_call_stream.py` — {machine()}; one `qwen` tool call writing a file, "
            f"streamed {args.chunk} characters a chunk, medians of {args.repeats}. The stream's cost per KB stays "
            "flat as the call grows (linear), whole or incremental; the whole parse is the same parser fed the "
            "answer at once. Incremental, the call is seen a few chunks after its block opens; whole, at its "
            "end.\n\n" + "\n".join(rows))
    print(body)
    if not args.no_write:
        write_section("Streaming a long tool call", body)


if __name__ == "__main__":
    main()
