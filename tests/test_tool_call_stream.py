"""Tool calls streamed incrementally (``hyla.server.tool_call_stream``): a call's id and name as soon as
they are written, its arguments as the model writes them; joined, the deltas are the whole parse."""

import json
import random

import pytest

from hyla.server.tool_calls import SYNTAXES, ToolCallParser

NOTE_TOOL = {"type": "function", "function": {"name": "write", "parameters": {"type": "object", "properties": {
    "path": {"type": "string"}, "content": {"type": "string"}, "lines": {"type": "array"},
    "mode": {"type": ["integer", "null"]}}}}}
# arguments a model may write: brackets and quotes inside strings, escapes, nesting, non-ASCII, no spaces
TRICKY = ['{"path": "a/b.py", "content": "def f():\\n    return \\"}]\\" + \'\\\\\\\\\' # {[\\n", "n": [1, {"x": null}]}',
          '{"q":"é ✓ \\u00e9 \\ud83d\\ude00","deep":[[[]],{}],"t":true}', "{}", '[1, "two", {"3": [4]}]']
# an XML call's body: string values with newlines, a partial closing tag and a trailing blank line in them, a
# value read as JSON, a parameter written twice (the first kept), a function with no parameters
XML_BODY = ("<function=write>\n<parameter=path>\na/b.py\n</parameter>\n<parameter=content>\nline 1\n\n"
            "x </param y <parameter=z>\n\n\n</parameter>\n<parameter=lines>\n[1, \"a\"]\n</parameter>\n"
            "<parameter=path>\nagain\n</parameter>\n<parameter=mode>\n7\n</parameter>\n</function>\n"
            "<function=write>\n</function>\n")


def blocks(parser: ToolCallParser) -> list[str]:
    """Blocks of one or more calls in ``parser``'s syntax, their arguments ``TRICKY``'s."""
    s, e = parser.start, parser.end
    objects = [f'{{"name": "write", "arguments": {a}}}' for a in TRICKY]
    if parser.body == "object":
        return [f"{s}\n{o}\n{e}" for o in objects] + [f'{s}{{ "name" : "f" , "parameters" :{TRICKY[1]}, "x": 1}}{e}']
    if parser.body == "list":
        return [f"{s}[{', '.join(objects)}]{e}", f"{s}\n[ {objects[0]} ]\n{e}"]
    if parser.body == "lines":
        return [f"{s}\n" + "\n".join(objects) + f"\n{e}"]
    if parser.body == "kimi":
        calls = "".join(f"<|tool_call_begin|>functions.write:{i}<|tool_call_argument_begin|>{a}<|tool_call_end|>"
                        for i, a in enumerate(TRICKY))
        return [f"{s}{calls}{e}", f"{s}\n<|tool_call_begin|> functions.f:7 <|tool_call_argument_begin|> {{}} "
                                  f"<|tool_call_end|>\n{e}"]
    if parser.body == "xml":
        return [f"{s}\n{XML_BODY}{e}"]
    return [f'{s}[write(path="a/b.py", lines=[1, 2]), f()]{e}']


def feed(stream, pieces: list[str]) -> tuple[str, list[dict], list]:
    """``pieces`` through ``stream``: (its content, its call deltas joined by index, the deltas)."""
    content, deltas = "", []
    for i, piece in enumerate(pieces):
        c, d = stream.feed(piece, final=i == len(pieces) - 1)
        assert len({x.index for x in d}) == len(d), d  # (a chunk carries a call once: its deltas merged)
        content, deltas = content + c, deltas + d
    calls: dict[int, dict] = {}
    for d in deltas:
        if d.index not in calls:
            assert d.id is not None and d.name is not None, d
            calls[d.index] = {"id": d.id, "name": d.name, "arguments": ""}
        else:
            assert d.id is None and d.name is None, d
        calls[d.index]["arguments"] += d.arguments
    assert sorted(calls) == list(range(len(calls)))
    return content, [calls[i] for i in sorted(calls)], deltas


def cuts(text: str) -> list[list[str]]:
    """Whole, a character at a time, in two at every position, and in random pieces."""
    rng = random.Random(len(text))
    ragged = []
    at = 0
    while at < len(text):
        n = rng.randint(1, 6)
        ragged.append(text[at:at + n])
        at += n
    return [[text], list(text), ragged] + [[text[:i], text[i:]] for i in range(1, len(text))]


@pytest.mark.parametrize("name", SYNTAXES)
def test_an_incremental_stream_is_the_whole_parse_however_the_text_is_cut(name):
    """Joined by index, the call deltas are ``parse``'s calls (names, arguments; ids: the model's where it
    writes them), the content deltas its content, at every cut; and the calls really stream: fed a character
    at a time, each call's name goes out before its block ends and its arguments in several deltas (but
    ``lfm2``'s, which are sent whole)."""
    parser = ToolCallParser(name)
    tools = [NOTE_TOOL]
    for block in blocks(parser):
        for text in (f"Let me write it.\n{block}\n", f"{block}{block} done", f"{block}"):
            content, calls = parser.parse(text, tools)
            assert calls, text
            expected = (content, [(c.name, c.arguments) for c in calls])
            for pieces in cuts(text):
                stream = parser.stream(tools, incremental=True)
                got, joined, deltas = feed(stream, pieces)
                assert (got, [(c["name"], c["arguments"]) for c in joined]) == expected, pieces
                assert [c["id"] for c in joined] == [c.id for c in stream.calls]
                if parser.body == "kimi":
                    assert [c.id for c in stream.calls] == [c.id for c in calls]  # (functions.NAME:IDX)
            if parser.body == "python":
                continue
            # a character at a time: the first call begins before its block's end marker has come
            stream, sent, seen = parser.stream(tools, incremental=True), [], ""
            for ch in text:
                seen += ch
                sent += [(len(seen), d) for d in stream.feed(ch)[1]]
            stream.feed("", final=True)
            block_end = text.index(parser.end) + len(parser.end)
            first = [at for at, d in sent if d.index == 0]
            assert first[0] < block_end - len(parser.end) and len(first) >= 2, text


@pytest.mark.parametrize("name", [n for n in SYNTAXES if SYNTAXES[n][2] != "python"])
def test_a_call_begun_then_cut_off_ends_with_the_arguments_sent(name):
    """A block cut off inside its arguments (``max_tokens``) after its call began: the call cannot be taken
    back; it ends with the arguments sent, and the rest of the block is not content (OpenAI's stream ends
    the same way). Whole, the block stays content. A block that began no call stays content, streamed too."""
    parser = ToolCallParser(name)
    block = blocks(parser)[0]
    cut = block[:block.index("a/b.py") + 3]  # inside the first call's arguments
    text = "Hi " + cut
    assert parser.parse(text, [NOTE_TOOL]) == (text, [])
    for pieces in cuts(text)[:3]:
        stream = parser.stream([NOTE_TOOL], incremental=True)
        content, joined, _ = feed(stream, pieces)
        assert content == "Hi" and [c["name"] for c in joined] == ["write"], pieces
        assert joined[0]["arguments"] and cut.replace("\n", "").endswith(joined[0]["arguments"][-3:])
        assert [(c.name, c.arguments) for c in stream.calls] == [(j["name"], j["arguments"]) for j in joined]
    # the end marker coming inside the arguments ends the block there: the echo never sends what may be the
    # start of the end marker (at every cut, the same arguments)
    ended = "Hi " + cut + parser.end
    sent = {json.dumps([c["arguments"] for c in feed(parser.stream([NOTE_TOOL], incremental=True), pieces)[1]])
            for pieces in cuts(ended)}
    assert len(sent) == 1 and parser.end[:2] not in sent.pop()
    # no call begun: content, streamed too (a block that holds no call; a name longer than an echo waits for)
    long_name = parser.start + cut.replace("write", "w" * 1100)[len(parser.start):]
    for bad in (f"Hi {parser.start}bad{parser.end}", f"Hi {long_name}"):
        assert parser.parse(bad) == (bad, [])
        for pieces in cuts(bad)[:3]:
            assert feed(parser.stream(incremental=True), pieces)[:2] == (bad, []), pieces


@pytest.mark.parametrize("name", SYNTAXES)
def test_calls_the_echo_cannot_follow_are_sent_whole(name):
    """A call whose name does not come first (or a Python call) is sent whole when its block closes, with the
    calls before it streamed: the same calls as the whole parse."""
    parser = ToolCallParser(name)
    s, e = parser.start, parser.end
    text = {"object": f'{s}{{"arguments": {{"a": 1}}, "name": "f"}}{e}',
            "list": f'{s}[{{"name": "f", "arguments": {{"a": 1}}}}, {{"arguments": [2], "name": "g"}}]{e}',
            "lines": f'{s}{{"name": "f", "arguments": {{"a": 1}}}}\n{{"arguments": {{}}, "name": "g"}}{e}',
            "kimi": f'{s}<|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>"text"<|tool_call_end|>{e}',
            "xml": f"{s}<function=f>\n<parameter=a>\n1\n</parameter>\n</function>{e}",
            "python": f"{s}[f(a=1)]{e}"}[parser.body]
    _, calls = parser.parse(text)
    for pieces in cuts(text)[:3]:
        _, joined, _ = feed(parser.stream(incremental=True), pieces)
        assert [(c["name"], c["arguments"]) for c in joined] == [(c.name, c.arguments) for c in calls], pieces


def test_json_arguments_are_the_models_text():
    """An object or a list of arguments is sent as the model wrote it (its spacing and escapes kept: the text
    a stream sends while it comes), whole and streamed alike; a lone surrogate the JSON escapes stays escaped."""
    parser = ToolCallParser("qwen")
    args = '{"a":1,  "s": "\\ud800 \\u00e9"}'
    text = f'<tool_call>{{"name": "f", "arguments": {args}}}</tool_call>'
    _, calls = parser.parse(text)
    assert [c.arguments for c in calls] == [args] and json.loads(args) == json.loads(calls[0].arguments)
    calls[0].arguments.encode("utf-8")
