"""Mixed chunked prefill (``enable_mixed_chunk``): what running streams see while a long prompt is
prefilled in chunks.

``--streams`` requests decode (short prompts, long outputs, greedy); once all of them stream, a
``--prompt``-token prompt arrives, prefilled in ``--chunk``-token steps. Measured on the streams'
tokens from that arrival until the long request's first token (the window its prefill blocks):

* **gap**: the longest time between two tokens of one stream (without mixing, every chunk's step
  runs while the streams wait: the stall);
* **tokens / stream**: how many each produced in the window;
* **long TTFT**: the long request's time to first token (a mixed step does the chunk plus one token
  per stream).

Off and on alternate in one process (two engines, the same prompts); medians of ``--repeats``.
Prints a markdown table and writes the ``## Mixed chunked prefill`` section of docs/benchmarks.md.

    .venv/bin/python benchmarks/mixed_chunk.py [--repeats 5] [--prompt 8192] [--chunk 2048] [--streams 8]
    PYTHONUNBUFFERED=1 .venv/bin/python benchmarks/mixed_chunk.py --device cuda --gpu-model   # issue 10's model
    .venv/bin/python benchmarks/mixed_chunk.py --tiny --repeats 1 --prompt 256 --chunk 64 --no-write   # smoke
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from benchmarks.report import machine, off_on, off_on_rows, write_section  # noqa: E402
from benchmarks.startup import add_model_arguments, model_dir, model_flags, resolve_dtype  # noqa: E402
from hyla import Engine  # noqa: E402

METRICS = ("max gap (ms)", "median gap (ms)", "tokens / stream", "long TTFT (ms)")


def window(engine: Engine, rng: random.Random, args: argparse.Namespace) -> dict[str, float]:
    """One measurement: the streams start, the long prompt arrives, the streams are aborted once it
    has its first token."""
    vocab = engine.model_config.vocab_size
    fresh = lambda n: [rng.randrange(3, vocab) for _ in range(n)]  # noqa: E731
    greedy = {"temperature": 0, "ignore_eos": True, "max_new_tokens": args.stream_tokens}
    stamps: list[list[float]] = [[] for _ in range(args.streams)]
    started = threading.Barrier(args.streams + 1)

    def consume(i: int, stream) -> None:
        for k, _ in enumerate(stream):
            stamps[i].append(time.perf_counter())
            if k == 0:
                started.wait()

    rids = [f"stream-{rng.random()}" for _ in range(args.streams)]
    threads = [threading.Thread(target=consume, daemon=True, args=(i, engine.generate(
        input_ids=fresh(32), sampling_params=greedy, stream=True, rid=rid))) for i, rid in enumerate(rids)]
    for t in threads:
        t.start()
    started.wait()
    time.sleep(0.05)  # a few decode steps at the streams' own pace
    t0 = time.perf_counter()
    engine.generate(input_ids=fresh(args.prompt), sampling_params={"temperature": 0, "max_new_tokens": 1})
    t1 = time.perf_counter()
    while any(not s or s[-1] <= t1 for s in stamps):  # each stream's first token after the window closes it
        time.sleep(0.001)
    for rid in rids:
        engine.abort(rid)
    for t in threads:
        t.join()
    engine.wait_idle()
    if any(len(s) >= args.stream_tokens for s in stamps):
        raise RuntimeError("a stream ran to its length inside the window: raise --stream-tokens")
    gaps, counts = [], []
    for s in stamps:  # from each stream's last token before the window to its first one after
        first = next(i for i, t in enumerate(s) if t > t0) - 1
        last = next(i for i, t in enumerate(s) if t > t1)
        gaps += [b - a for a, b in zip(s[first:last], s[first + 1:last + 1])]
        counts.append(last - first - 1)
    return {"max gap (ms)": 1e3 * max(gaps), "median gap (ms)": 1e3 * statistics.median(gaps),
            "tokens / stream": statistics.median(counts), "long TTFT (ms)": 1e3 * (t1 - t0)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(ap)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--prompt", type=int, default=8192, help="the long prompt's tokens")
    ap.add_argument("--chunk", type=int, default=2048, help="chunked_prefill_size")
    ap.add_argument("--streams", type=int, default=8, help="requests decoding when the long prompt arrives")
    ap.add_argument("--stream-tokens", type=int, default=512,
                    help="each stream's max_new_tokens (aborted once the window closes; it must outlive it)")
    ap.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    args = ap.parse_args()
    resolve_dtype(args)
    if args.prompt <= args.chunk:
        ap.error("--prompt must be longer than --chunk (the long prompt is prefilled in several steps)")

    with tempfile.TemporaryDirectory(prefix="hyla-mixed-") as tmp:
        path, model = model_dir(args, Path(tmp))
        opts = dict(device=args.device, dtype=args.dtype, chunked_prefill_size=args.chunk, warmup="off",
                    context_length=args.prompt + 4096, max_total_tokens=2 * args.prompt + 8192 * args.streams,
                    max_state_slots=4 * args.streams + 8, max_running_requests=args.streams + 1)
        engines = {mode: Engine(path, enable_mixed_chunk=mode == "on", **opts) for mode in ("off", "on")}
        med = off_on(engines, args.repeats, lambda mode, engine, rep: window(engine, random.Random(rep), args), "mixed")
    flags = model_flags(args)
    rows = off_on_rows(med, METRICS)
    body = f"""`.venv/bin/python benchmarks/mixed_chunk.py {flags} --repeats {args.repeats} --prompt {args.prompt} --chunk {args.chunk} --streams {args.streams}` — {machine()}; {model}, {args.dtype}; {args.streams} streams decoding while a {args.prompt:,}-token prompt is prefilled in {args.chunk:,}-token steps; medians of {args.repeats} windows (from the prompt's arrival to its first token).

| streams, in the window | mixed off | mixed on | on / off |
|---|---|---|---|
{rows}
"""
    print(body)
    if not args.no_write:
        write_section("Mixed chunked prefill", body)


if __name__ == "__main__":
    main()
