"""The agent-facing OpenAI features through the official ``openai`` client: ``response_format``
(structured outputs), tools / ``tool_choice`` and reasoning content. Same server as
``test_server_openai`` (a tiny random model: its outputs are not language, so every check is about
structure the grammar or the parser guarantees)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from hyla.server.tool_calls import SYNTAXES
from test_server_openai import MODEL, SYSTEM, client, engine, server  # noqa: F401  (fixtures)

SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]}},
    "required": ["ok", "color"],
    "additionalProperties": False,
}
USER = [SYSTEM, {"role": "user", "content": "Is the sky blue? Answer in JSON."}]


def _check_schema_output(text: str) -> None:
    value = json.loads(text)
    assert set(value) == {"ok", "color"}
    assert isinstance(value["ok"], bool) and value["color"] in ("red", "green", "blue")


def _schema_format() -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}


# --------------------------------------------------------------------------------------------
# response_format
# --------------------------------------------------------------------------------------------
def test_response_format_json_schema_chat(client):
    r = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=64, temperature=0.0,
                                       response_format=_schema_format())
    assert r.choices[0].finish_reason == "stop"
    _check_schema_output(r.choices[0].message.content)


def test_response_format_json_schema_chat_stream(client):
    stream = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=64, temperature=0.8, seed=3,
                                            n=2, response_format=_schema_format(), stream=True)
    texts, finish = ["", ""], [None, None]
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            finish[c.index] = c.finish_reason or finish[c.index]
    assert finish == ["stop", "stop"]
    for text in texts:
        _check_schema_output(text)


def test_response_format_json_schema_completions(client):
    r = client.completions.create(model=MODEL, prompt="Answer in JSON:", max_tokens=64, temperature=0.0,
                                  extra_body={"response_format": _schema_format()})
    assert r.choices[0].finish_reason == "stop"
    _check_schema_output(r.choices[0].text)
    stream = client.completions.create(model=MODEL, prompt="Answer in JSON:", max_tokens=64, temperature=0.0,
                                       extra_body={"response_format": _schema_format()}, stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices) == r.choices[0].text


def test_response_format_json_object(client):
    r = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=48, temperature=0.0,
                                       response_format={"type": "json_object"})
    text = r.choices[0].message.content
    assert text.startswith("{")
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    stream = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=48, temperature=0.0,
                                            response_format={"type": "json_object"}, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == text


@pytest.mark.parametrize("response_format, message", [
    pytest.param({"type": "json_schema"}, "needs a json_schema", id="json-schema-missing"),
    pytest.param({"type": "json_object", "json_schema": {"name": "x", "schema": {}}}, "takes no json_schema",
                 id="json-object-with-schema"),
    pytest.param({"type": "yaml"}, None, id="unknown-type"),
    pytest.param({"type": "json_schema", "json_schema": {"schema": SCHEMA}}, None, id="no-name"),
    pytest.param({"type": "json_schema", "json_schema": {"name": "a b", "schema": SCHEMA}}, None, id="bad-name"),
    pytest.param({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}},
                 "cannot be compiled", id="schema-does-not-compile"),
])
def test_response_format_errors_are_400(client, response_format, message):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=USER, max_tokens=8, response_format=response_format)
    err = info.value.body
    assert info.value.status_code == 400 and err["type"] == "invalid_request_error"
    assert (err["param"] or "").startswith("response_format")
    assert message is None or message in err["message"]


# --------------------------------------------------------------------------------------------
# tools
# --------------------------------------------------------------------------------------------
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]},
                                                    "unit": {"enum": ["C", "F"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                                       "required": ["zone"], "additionalProperties": False}}}
ASK = [SYSTEM, {"role": "user", "content": "What is the weather in Paris?"}]


def joined_calls(deltas) -> list[dict]:
    """A stream's ``delta.tool_calls`` joined by index, as OpenAI clients join them (a call's first delta
    has its id, type and name, the others only more of its arguments): ``[{"id", "name", "arguments"}]``."""
    calls: dict[int, dict] = {}
    for d in deltas:
        if d.index not in calls:
            assert d.id and d.type == "function" and d.function.name, d
            calls[d.index] = {"id": d.id, "name": d.function.name, "arguments": ""}
        else:
            assert d.id is None and d.function.name is None, d
        calls[d.index]["arguments"] += d.function.arguments or ""
    assert sorted(calls) == list(range(len(calls)))
    return [calls[i] for i in sorted(calls)]


def _check_weather_call(call) -> None:
    assert call.id.startswith("call_") and call.type == "function"
    assert call.function.name == "get_weather"
    args = json.loads(call.function.arguments)
    assert args["city"] in ("Paris", "Oslo") and args["unit"] in ("C", "F")


@pytest.mark.parametrize("tool_choice", [
    {"type": "function", "function": {"name": "get_weather"}}, "required"], ids=["named", "required"])
def test_forced_tool_call(client, tool_choice):
    tools = [WEATHER] if tool_choice == "required" else [WEATHER, TIME]
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=tools, tool_choice=tool_choice,
                                       parallel_tool_calls=False, max_tokens=64, temperature=0.0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    assert len(choice.message.tool_calls) == 1
    _check_weather_call(choice.message.tool_calls[0])

    stream = client.chat.completions.create(model=MODEL, messages=ASK, tools=tools, tool_choice=tool_choice,
                                            parallel_tool_calls=False, max_tokens=64, temperature=0.0, stream=True)
    calls, finish, content = [], None, ""
    for chunk in stream:
        for c in chunk.choices:
            content += c.delta.content or ""
            calls += c.delta.tool_calls or []
            finish = c.finish_reason or finish
    # the call streams: its id and name first, then its arguments in pieces as the model writes them
    (streamed,) = joined_calls(calls)
    assert finish == "tool_calls" and content == "" and len(calls) > 2
    assert streamed["id"].startswith("call_") and streamed["name"] == "get_weather"
    assert streamed["arguments"] == choice.message.tool_calls[0].function.arguments

    # the call and its result render through the template in the next turn
    call = choice.message.tool_calls[0]
    follow = ASK + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                    {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'}]
    r2 = client.chat.completions.create(model=MODEL, messages=follow, tools=tools, max_tokens=8, temperature=0.0)
    assert r2.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert r2.usage.prompt_tokens > r.usage.prompt_tokens


def test_tools_render_through_template(client, engine):
    r_none = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="none",
                                            max_tokens=1, temperature=0.0)
    r_plain = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=1, temperature=0.0)
    r_auto = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=1, temperature=0.0)
    assert r_none.usage.prompt_tokens == r_plain.usage.prompt_tokens
    expected = engine.tokenizer.encode_chat(ASK, True, [WEATHER]).ids
    assert r_auto.usage.prompt_tokens == len(expected) > r_plain.usage.prompt_tokens


def _stream_in_pieces(parser, text: str, size: int) -> tuple[str, list]:
    """Feed ``text`` to a parser's stream ``size`` characters at a time: (content, calls)."""
    stream, out, got = parser.stream(), "", []
    pieces = [text[i:i + size] for i in range(0, len(text), size)]
    for i, piece in enumerate(pieces):
        content, new = stream.feed(piece, final=i == len(pieces) - 1)
        out += content
        got += new
    return out, got


def test_tool_call_parser():
    from hyla.server.tool_calls import ToolCallParser
    parser = ToolCallParser("qwen")
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>')
    content, calls = parser.parse(text)
    assert content == "Let me check." and [c.name for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0].arguments) == {"city": "Paris"}
    assert parser.parse("<tool_call>not json</tool_call>") == ("<tool_call>not json</tool_call>", [])
    for size in (1, 3, 7, 1000):
        out, got = _stream_in_pieces(parser, text, size)
        assert out.strip() == "Let me check." and [c.name for c in got] == ["get_weather", "get_time"]



def _cuts(text: str) -> list[list[str]]:
    """Ways a detokenizer may cut ``text`` into a stream's chunks: whole, one character at a time,
    and in two at every position."""
    return [[text], list(text)] + [[text[:i], text[i:]] for i in range(1, len(text))]


_CALL_BODIES = {  # one call of get_weather(city="Paris"): a block's body in each syntax (ToolCallParser.body)
    "object": '\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n',
    "list": '[{"name": "get_weather", "arguments": {"city": "Paris"}}]',
    "lines": '\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n',
    "xml": "\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n",
    "kimi": '<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|>',
    "python": '[get_weather(city="Paris")]',
}


def _call_block(parser) -> str:
    """One call of ``get_weather`` in ``parser``'s syntax."""
    return parser.start + _CALL_BODIES[parser.body] + parser.end


def _json_block(parser, name_json: str, args_json: str) -> str:
    """A block of one call in ``parser``'s syntax (not ``xml``) from the JSON texts of its name and
    arguments (``lfm2``'s: its JSON list)."""
    if parser.body == "kimi":
        call = f"functions.{json.loads(name_json)}:0"
        return f"{parser.start}<|tool_call_begin|>{call}<|tool_call_argument_begin|>{args_json}<|tool_call_end|>" \
            + parser.end
    call = f'{{"name": {name_json}, "arguments": {args_json}}}'
    return parser.start + (f"[{call}]" if parser.body in ("list", "python") else call) + parser.end


@pytest.mark.parametrize("name", SYNTAXES)
def test_tool_call_stream_is_the_whole_parse_however_the_text_is_cut(name):
    """The whitespace around calls is layout, the same rule whole and streamed: the content deltas
    joined are ``parse``'s content, and the calls its calls, at every cut (text before, after and
    between calls, a malformed block, a call cut off by the length limit or by a stop string). In order
    (``feed_in_order``), the stream's texts and calls are ``in_order``'s, at every cut."""
    from hyla.server.tool_calls import ToolCallParser
    parser = ToolCallParser(name)
    call, bad = _call_block(parser), f"{parser.start}bad{parser.end}"
    cases = [
        (f"Let me check.\n{call}\n", "Let me check.", 1),
        (f"\n\n{call}\n\n{call}", "", 2),
        (f"A\n{call}\n\n{call}\nB\n", "A\n\n\n\nB", 2),
        (f"{call} after", "after", 1),
        (f" x {call}", " x", 1),  # (the whitespace before the first text goes out before a call is known)
        ("\n\nno call\n", "\n\nno call\n", 0),
        (f"{bad}\n{call}", bad, 1),
        (f"Hi {call[:len(call) // 2]}", f"Hi {call[:len(call) // 2]}", 0),  # cut off by max_tokens
        (f"Hi\n{call[:-len(parser.end)]}", "Hi", 1),  # cut off by the stop string </tool_call>: a call
        (f"Hi {parser.start[:4]}", f"Hi {parser.start[:4]}", 0),
    ]
    for text, content, n_calls in cases:
        whole, calls = parser.parse(text)
        assert (whole, len(calls)) == (content, n_calls), text
        for pieces in _cuts(text):
            stream, out, got = parser.stream(), "", []
            for i, piece in enumerate(pieces):
                delta, new = stream.feed(piece, final=i == len(pieces) - 1)
                out, got = out + delta, got + new
            assert (out, [(c.name, c.arguments) for c in got]) == (whole, [(c.name, c.arguments) for c in calls]), \
                pieces
            stream, order = parser.stream(), []
            for i, piece in enumerate(pieces):
                for p in stream.feed_in_order(piece, final=i == len(pieces) - 1):
                    if isinstance(p, str) and order and isinstance(order[-1], str):
                        order[-1] += p
                    elif isinstance(p, str) or p.name is not None:
                        order.append(p if isinstance(p, str) else p.index)
            in_order = parser.in_order(text)
            assert "".join(p for p in in_order if isinstance(p, str)) == whole
            assert [p if isinstance(p, str) else (p.name, p.arguments) for p in in_order] == \
                [p if isinstance(p, str) else (stream.calls[p].name, stream.calls[p].arguments) for p in order], pieces


@pytest.mark.parametrize("name", [n for n in SYNTAXES if n not in ("qwen3_coder", "lfm2", "kimi_k2")])  # (JSON names)
def test_in_order_keeps_a_call_whose_name_is_empty(name):
    """A call named "" (which ``parse`` and a stream keep): ``in_order`` keeps it too (a whole answer lost it)."""
    from hyla.server.tool_calls import ToolCallParser
    parser = ToolCallParser(name)
    text = "A " + _json_block(parser, '""', '{"x": 1}') + " B"
    assert [p if isinstance(p, str) else p.name for p in parser.in_order(text)] == ["A", "", "  B"]  # (layout as parse)
    assert [c.name for c in parser.parse(text)[1]] == [""]


@pytest.mark.parametrize("name", SYNTAXES)
def test_a_lone_surrogate_a_call_escapes_stays_escaped(name):
    """JSON may escape a lone UTF-16 surrogate (``"\\ud800"``), which no UTF-8 answer can carry: the
    arguments keep it escaped (the same value); a name or a text of arguments holding one is no call."""
    from hyla.server.tool_calls import ToolCallParser
    parser = ToolCallParser(name)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"s": {"type": "array", "items": {"type": "string"}}}}}}]
    if parser.xml:
        text = '<tool_call>\n<function=f>\n<parameter=s>\n["\\ud800 é"]\n</parameter>\n</function>\n</tool_call>'
        not_calls = []
    else:
        text = _json_block(parser, '"f"', '{"s": ["\\ud800 é"]}')
        not_calls = [_json_block(parser, '"f\\udc00"', "{}"), _json_block(parser, '"f"', '"\\ud800"')]
    _, calls = parser.parse(text, tools)
    assert len(calls) == 1 and json.loads(calls[0].arguments.encode("utf-8")) == {"s": ["\ud800 é"]}
    for bad in not_calls:
        assert parser.parse(bad, tools) == (bad, [])



def test_nan_and_infinity_are_not_json_in_a_call():
    """Python's ``json`` reads ``NaN`` / ``Infinity``, no other client does (JSON has no such values):
    a block holding one is no call (it stays content), and a ``qwen3_coder`` value stays text, so
    ``arguments`` is always JSON."""
    from hyla.server.tool_calls import ToolCallParser
    for name in SYNTAXES:
        parser = ToolCallParser(name)
        for args in ('{"x": NaN}', '{"x": [1, -Infinity]}'):
            if not parser.xml:
                text = _json_block(parser, '"f"', args)
                assert parser.parse(text) == (text, [])
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "array"}}}}}]
    _, calls = ToolCallParser("qwen3_coder").parse(
        "<tool_call>\n<function=f>\n<parameter=x>\nNaN\n</parameter>\n<parameter=y>\n[1, Infinity]\n</parameter>\n"
        "</function>\n</tool_call>", tools)
    assert json.loads(calls[0].arguments, parse_constant=lambda c: pytest.fail(c)) == {"x": "NaN", "y": "[1, Infinity]"}


@pytest.mark.parametrize("arguments, sent", [
    ('"not json"', '"not json"'),  # (a string that is not JSON text: encoded)
    ('"{\\"city\\": \\"Oslo\\"}"', '{"city": "Oslo"}'),  # (JSON text in a string: kept)
    ('"NaN"', '"NaN"'),  # (not JSON either)
    ("[1, 2]", "[1, 2]"),
    ("null", "null"),
])
def test_a_calls_arguments_are_always_json_text(arguments, sent):
    """``function.arguments`` is JSON text however the model wrote them: a string that is not JSON is
    JSON-encoded (it passed through, and clients failed to parse it), JSON text in a string is kept."""
    from hyla.server.tool_calls import ToolCallParser
    parser = ToolCallParser("qwen")
    _, calls = parser.parse(parser.start + '{"name": "f", "arguments": ' + arguments + "}" + parser.end)
    assert [c.arguments for c in calls] == [sent]
    json.loads(calls[0].arguments)


def script_engine(monkeypatch, engine, pieces: list[str], finish: str = "stop") -> None:
    """Make ``engine`` answer every request with ``pieces``, its streamed text chunks, the last one
    finishing with ``finish`` (the tiny random model never writes a tool call or a think block)."""
    async def generate(*args, rid=None, **kwargs):
        async def chunks():
            for i, piece in enumerate(pieces):
                yield {"text": piece, "output_ids": [i], "meta_info": {
                    "id": rid, "prompt_tokens": 5, "completion_tokens": i + 1, "cached_tokens": 0,
                    "finish_reason": {"type": finish} if i == len(pieces) - 1 else None}}
        return chunks()

    monkeypatch.setattr(engine, "async_generate", generate)


SCRIPTED_CALL = '{"name": "get_weather", "arguments": {"city": "Paris \\"Rive Gauche\\" é", "unit": "C"}}'
# a thinking model's answer with text and two calls, its markers cut across chunks
SCRIPTED = ["<think>\nhm", "m, Paris\n</thi", "nk>\n\n", "Let me check.\n<tool_", "call>\n", SCRIPTED_CALL,
            "\n</tool_call>\n", "\n<tool_call>\n" + SCRIPTED_CALL.replace("Paris", "Oslo") + "\n</tool_call>\n"]


def test_streamed_reasoning_and_tool_calls_are_the_whole_answer(server, client, engine, monkeypatch):
    """Through the server (a scripted engine output), with the reasoning parser, n = 2: each
    streamed choice, accumulated as the openai client does (tool calls by index), is the
    non-streamed choice: content, reasoning_content, calls, finish_reason."""
    from hyla.server.reasoning import ReasoningParser
    state = server.app.state.server
    script_engine(monkeypatch, engine, SCRIPTED)
    state.reasoning_parser = ReasoningParser("qwen3")
    try:
        whole = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], n=2)
        with client.chat.completions.stream(model=MODEL, messages=ASK, tools=[WEATHER], n=2) as stream:
            streamed = stream.get_final_completion()
    finally:
        state.reasoning_parser = None
    for w, s in zip(whole.choices, streamed.choices, strict=True):
        assert w.message.content == s.message.content == "Let me check."
        assert w.message.model_extra["reasoning_content"] == s.message.model_extra["reasoning_content"] == "hmm, Paris"
        assert w.finish_reason == s.finish_reason == "tool_calls"
        for calls in (w.message.tool_calls, s.message.tool_calls):
            assert [json.loads(c.function.arguments)["city"] for c in calls] == ['Paris "Rive Gauche" é',
                                                                                 'Oslo "Rive Gauche" é']
        assert [c.function.arguments for c in w.message.tool_calls] == [c.function.arguments
                                                                         for c in s.message.tool_calls]


def test_a_call_escaping_a_lone_surrogate_is_answered(server, engine, monkeypatch):
    """A call whose JSON escapes a lone surrogate is answered, whole and streamed (it was a 500, and
    an error event mid-stream: the answer could not be encoded)."""
    script_engine(monkeypatch, engine, ['<tool_call>\n{"name": "get_weather", "arguments": {"city": "\\ud800"}}',
                                        "\n</tool_call>"])
    body = {"model": MODEL, "messages": ASK, "tools": [WEATHER]}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    (call,) = r.json()["choices"][0]["message"]["tool_calls"]
    assert json.loads(call["function"]["arguments"]) == {"city": "\ud800"}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=60) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    assert not any("error" in e for e in events), events
    streamed = [t for e in events for c in e["choices"] for t in c["delta"].get("tool_calls") or ()]
    assert [t["function"]["arguments"] for t in streamed] == [call["function"]["arguments"]]

def test_nemotron_json_tool_call_parser(engine):
    """NemotronH's syntax: one ``<TOOLCALL>`` block holding a JSON list of calls; parsed whole and
    streamed, and forced through its grammar (the tiny model then emits a valid call)."""
    from hyla.server.tool_calls import ToolCallParser
    parser = ToolCallParser("nemotron_json")
    text = ('Checking.<TOOLCALL>[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
            '{"name": "get_time", "arguments": {"zone": "UTC"}}]</TOOLCALL>')
    content, calls = parser.parse(text)
    assert content == "Checking." and [c.name for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[1].arguments) == {"zone": "UTC"}
    for bad in ("<TOOLCALL>{\"name\": \"f\"}</TOOLCALL>", "<TOOLCALL>[]</TOOLCALL>", "<TOOLCALL>[1]</TOOLCALL>"):
        assert parser.parse(bad) == (bad, [])  # not a list of calls: stays text
    for size in (1, 5, 1000):
        out, got = _stream_in_pieces(parser, text, size)
        assert out.strip() == "Checking." and [c.name for c in got] == ["get_weather", "get_time"]
    for parallel in (False, True):
        grammar = parser.forced_grammar([WEATHER["function"]], parallel)
        out = engine.generate(input_ids=[5, 6, 7], sampling_params={"ebnf": grammar, "max_new_tokens": 96,
                                                                    "temperature": 0.0})
        assert out["text"].startswith('<TOOLCALL>[{"name": "get_weather"'), out["text"]
        if not parallel:  # (a parallel list may run past max_new_tokens on this random model)
            _, forced = parser.parse(out["text"])
            assert [c.name for c in forced] == ["get_weather"], out["text"]


TWO_CALLS = {  # get_weather(city="Paris") and get_time(zone="UTC") after "Checking.", and blocks that hold no call
    "jamba": ('Checking.<tool_calls>[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
              '{"name": "get_time", "arguments": {"zone": "UTC"}}]</tool_calls>',
              ['<tool_calls>{"name": "f", "arguments": {}}</tool_calls>', "<tool_calls>[]</tool_calls>"]),
    "minimax": ('Checking.\n<tool_calls>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
                '{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_calls>',
                ["<tool_calls>\n</tool_calls>", '<tool_calls>\n{"name": "f"} x\n</tool_calls>',
                 '<tool_calls>[{"name": "f", "arguments": {}}]</tool_calls>']),
    "kimi_k2": ("Checking.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
                '<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|>\n<|tool_call_begin|>'
                ' functions.get_time:1 <|tool_call_argument_begin|> {"zone": "UTC"} <|tool_call_end|>'
                "<|tool_calls_section_end|>",
                ["<|tool_calls_section_begin|><|tool_calls_section_end|>",
                 "<|tool_calls_section_begin|><|tool_call_begin|>get_weather<|tool_call_argument_begin|>{}"
                 "<|tool_call_end|><|tool_calls_section_end|>",  # (no index)
                 "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{x}"
                 "<|tool_call_end|><|tool_calls_section_end|>",
                 "<|tool_calls_section_begin|>hm<|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{}"
                 "<|tool_call_end|><|tool_calls_section_end|>"]),
    "lfm2": ('Checking.<|tool_call_start|>[get_weather(city="Paris"), get_time(zone=\'UTC\')]<|tool_call_end|>',
             ["<|tool_call_start|>[get_weather('Paris')]<|tool_call_end|>",  # (positional)
              "<|tool_call_start|>[os.system(cmd='ls')]<|tool_call_end|>",
              "<|tool_call_start|>[f(x=open('/etc/passwd'))]<|tool_call_end|>",
              "<|tool_call_start|>[f(x=1e999)]<|tool_call_end|>", "<|tool_call_start|>[f(**kw)]<|tool_call_end|>",
              "<|tool_call_start|>[f(x=b'raw')]<|tool_call_end|>", "<|tool_call_start|>[f(]<|tool_call_end|>",
              "<|tool_call_start|>[]<|tool_call_end|>", "<|tool_call_start|>[f(x=" + "[" * 300 + "]" * 300 + ")]"
              "<|tool_call_end|>"]),
}


@pytest.mark.parametrize("name", sorted(TWO_CALLS))
def test_family_tool_call_parsers(name):
    """Jamba's JSON list, MiniMax's call per line, Kimi's tagged calls (each with the model's id) and
    LFM2's Python list of calls: parsed whole and streamed in pieces of any size; a block that holds
    no well-formed call stays text."""
    from hyla.server.tool_calls import ToolCallParser
    parser = ToolCallParser(name)
    text, bad_blocks = TWO_CALLS[name]
    content, calls = parser.parse(text)
    assert content == "Checking." and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {"zone": "UTC"})]
    if name == "kimi_k2":
        assert [c.id for c in calls] == ["functions.get_weather:0", "functions.get_time:1"]
    for bad in bad_blocks:
        assert parser.parse(bad) == (bad, []), bad
    for size in (1, 5, 1000):
        out, got = _stream_in_pieces(parser, text, size)
        assert out.strip() == "Checking." and [c.name for c in got] == ["get_weather", "get_time"]


def test_lfm2_calls_sent_back_are_written_as_the_model_wrote_them():
    """LFM2's template reads no ``tool_calls``: an earlier assistant turn's calls, sent back as OpenAI JSON,
    reach it after the turn's content as an ``lfm2`` block the parser reads back to the same calls (any JSON
    arguments: strings with quotes and escapes, booleans, null, nesting, a lone surrogate escaped); a template
    that reads ``tool_calls`` gets the messages as they are."""
    import random

    from hyla.server.tool_calls import ToolCallParser
    parser = ToolCallParser("lfm2")
    rng = random.Random(0)
    leaves = ["Paris", 'say "hi"\n\\', "é 🙂", "\ud800", 0, -3, 2.5, 1e-7, True, False, None, ""]

    def value(depth: int):
        kind = rng.randrange(4 if depth < 3 else 1)
        if kind == 1:
            return [value(depth + 1) for _ in range(rng.randrange(3))]
        if kind == 2:
            return {rng.choice(["a", "b c", "k"]): value(depth + 1) for _ in range(rng.randrange(3))}
        return rng.choice(leaves)

    for _ in range(300):
        calls = [{"id": f"call_{i}", "type": "function", "function": {"name": rng.choice(["f", "get_weather"]),
                  "arguments": json.dumps({k: value(0) for k in rng.sample(["x", "city", "n"], rng.randrange(4))})}}
                 for i in range(rng.randrange(1, 3))]
        turn = {"role": "assistant", "content": rng.choice([None, "", "Checking."]), "tool_calls": calls}
        (written,) = parser.for_template([turn], "{{ message['content'] }}")
        content, parsed = parser.parse(written["content"])
        assert content == (turn["content"] or "") and [(c.name, json.loads(c.arguments)) for c in parsed] == [
            (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls], written["content"]
        assert turn["content"] in (None, "", "Checking.")  # (the request's message is not modified)
    one = {"function": {"name": "f", "arguments": '{"ok": true, "x": null, "city": "Paris", "n": [1, 2.5]}'}}
    assert parser.for_template([{"role": "assistant", "tool_calls": [one]}], "")[0]["content"] == \
        '<|tool_call_start|>[f(ok=True, x=None, city="Paris", n=[1, 2.5])]<|tool_call_end|>'  # (as LFM2 writes)
    reads_calls = "{% for c in message.tool_calls %}{{ c }}{% endfor %}"
    assert parser.for_template([turn], reads_calls) == [turn] and parser.for_template([turn]) == [turn]
    # a content of parts (a chat message's: ChatMessage.for_template): the block on its last text part
    block = '<|tool_call_start|>[f(ok=True, x=None, city="Paris", n=[1, 2.5])]<|tool_call_end|>'
    parts = [{"type": "text", "text": "A"}, {"type": "text", "text": "Checking."}]
    assert parser.for_template([{"role": "assistant", "content": parts, "tool_calls": [one]}], "")[0]["content"] == \
        [parts[0], {"type": "text", "text": "Checking." + block}] and parts[1]["text"] == "Checking."
    image = [{"type": "image"}]
    assert parser.for_template([{"role": "assistant", "content": image, "tool_calls": [one]}], "")[0]["content"] == \
        [*image, {"type": "text", "text": block}]


def test_vllm_and_sglang_names_of_qwens_syntax():
    """``hermes`` (vLLM) and ``qwen25`` (SGLang) name Qwen's syntax; ``hyla serve`` takes them; an unknown name
    is a ValueError."""
    import argparse

    from hyla.server.cli import add_arguments
    from hyla.server.tool_calls import ToolCallParser
    flags = argparse.ArgumentParser()
    add_arguments(flags)
    for alias in ("hermes", "qwen25"):
        parser = ToolCallParser(alias)
        assert parser.name == "qwen" and parser.parse(_call_block(parser))[1][0].name == "get_weather"
        assert flags.parse_args(["--tool-call-parser", alias]).tool_call_parser == alias
    with pytest.raises(ValueError, match="unknown tool-call parser"):
        ToolCallParser("llama3_json")


@pytest.mark.parametrize("template, architecture, name", [
    ("{{ '<tool_call>\\n' }}{{ tool_call | tojson }}", "", "qwen"),
    ("<tool_call>\n<function={{ name }}>\n<parameter={{ key }}>", "Qwen3_5ForConditionalGeneration", "qwen3_coder"),
    ("<TOOLCALL>{{ calls | tojson }}</TOOLCALL>", "NemotronHForCausalLM", "nemotron_json"),
    ("<|tool_calls_section_begin|>{% for c in calls %}<|tool_call_begin|>", "KimiLinearForCausalLM", "kimi_k2"),
    ("<|tool_call_start|>[{{ calls }}]<|tool_call_end|>", "Lfm2ForCausalLM", "lfm2"),
    ("List of tools: <|tool_list_start|>[{{ tools }}]<|tool_list_end|>", "Lfm2ForCausalLM", "lfm2"),
    ("<tool_calls>{{ calls | tojson }}</tool_calls>", "JambaForCausalLM", "jamba"),
    ("<tool_calls>\n{% for c in calls %}{{ c | tojson }}\n{% endfor %}</tool_calls>", "MiniMaxText01ForCausalLM",
     "minimax"),
    ("{{ messages }}", "Qwen3NextForCausalLM", "qwen"),  # (no syntax: Qwen's)
    (None, "Qwen3NextForCausalLM", "qwen"),
])
def test_the_chat_templates_syntax_picks_the_parser(template, architecture, name):
    from hyla.server.tool_calls import detect_tool_call_parser
    assert detect_tool_call_parser(template, architecture) == name


def test_auto_is_the_servers_default_parser(tmp_path, monkeypatch):
    """``hyla serve`` without ``--tool-call-parser`` reads calls in the syntax the model's chat template
    writes: a model whose template writes LFM2's calls answers a chat with LFM2's calls parsed."""
    from hyla.server.app import create_app
    from hyla.server.launch import BackgroundServer
    from test_server_openai import make_chat_model
    path = make_chat_model(tmp_path)
    (path / "chat_template.jinja").write_text(
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if tools %}Call tools as <|tool_call_start|>[name(arg=value)]<|tool_call_end|>.{% endif %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    with BackgroundServer(create_app(path, served_model_name=MODEL, max_total_tokens=2048,
                                     max_state_slots=16)) as srv:
        state = srv.app.state.server
        assert state.tool_call_parser.name == "lfm2"
        assert httpx.get(srv.url + "/get_server_info", timeout=30).json()["tool_call_parser"] == "lfm2"
        script_engine(monkeypatch, state.engine, ["Checking.", '<|tool_call_start|>[get_weather(city="Paris", ',
                                                  'unit="C")]<|tool_call_end|>'])
        r = httpx.post(srv.url + "/v1/chat/completions", json={"model": MODEL, "messages": ASK, "tools": [WEATHER]},
                       timeout=60).json()
    message = r["choices"][0]["message"]
    assert message["content"] == "Checking." and r["choices"][0]["finish_reason"] == "tool_calls"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == [
        ("get_weather", {"city": "Paris", "unit": "C"})]


def test_lfm2_reads_python_literals_and_its_json_list():
    """LFM2's argument values are Python literals, read as their JSON values (never evaluated):
    ``True`` / ``None`` (and JSON's spellings), signs, tuples as lists, nested dicts; a JSON list of calls
    is read too (the syntax LFM2's forced grammar writes)."""
    from hyla.server.tool_calls import ToolCallParser
    parser = ToolCallParser("lfm2")
    _, calls = parser.parse("<|tool_call_start|>[f(a=True, b=None, c=-2.5, d=(1, +2), e={'k': [false, null]}, "
                            "g='é\\n')]<|tool_call_end|>")
    assert json.loads(calls[0].arguments) == {"a": True, "b": None, "c": -2.5, "d": [1, 2],
                                              "e": {"k": [False, None]}, "g": "é\n"}
    _, calls = parser.parse('<|tool_call_start|>f(x=1)<|tool_call_end|>')  # (one call, no list)
    assert [(c.name, c.arguments) for c in calls] == [("f", '{"x": 1}')]
    _, calls = parser.parse('<|tool_call_start|>[{"name": "f", "arguments": {"x": 1}}]<|tool_call_end|>')
    assert [(c.name, c.arguments) for c in calls] == [("f", '{"x": 1}')]


@pytest.mark.parametrize("name", [n for n in SYNTAXES if n != "qwen3_coder"])
def test_forced_grammar_makes_a_call_the_parser_reads(name, engine):
    """Each syntax's forced-call grammar: the tiny random model, forced, writes a call of the tool that
    the same parser reads back with arguments of the schema (one call; a parallel list may run past
    ``max_new_tokens`` on this random model, so its grammar is checked to accept two calls, which the
    parser reads)."""
    from hyla.server.tool_calls import ToolCallParser
    parser = ToolCallParser(name)
    out = engine.generate(input_ids=[5, 6, 7], sampling_params={
        "ebnf": parser.forced_grammar([WEATHER["function"]], parallel=False), "max_new_tokens": 128,
        "temperature": 0.0})
    content, calls = parser.parse(out["text"], [WEATHER])
    assert content == "" and [c.name for c in calls] == ["get_weather"], out["text"]
    assert json.loads(calls[0].arguments)["city"] in ("Paris", "Oslo")
    matcher = engine.grammars.matcher("ebnf", parser.forced_grammar([WEATHER["function"], TIME["function"]],
                                                                     parallel=True))
    two = _forced_calls_text(parser, [("get_weather", {"city": "Oslo", "unit": "C"}), ("get_time", {"zone": "UTC"})])
    assert all(matcher.accept(t) for t in engine.tokenizer.encode(two, add_special_tokens=False)), two
    assert matcher.accept(engine.eos_token_ids[0]), two  # (the grammar may end there)
    assert [c.name for c in parser.parse(two)[1]] == ["get_weather", "get_time"]


# parameters as pydantic writes a nested model (openai.pydantic_function_tool): "$defs" and a "$ref" into them
LOOKUP = {"name": "lookup", "parameters": {
    "$defs": {"Address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
                          "required": ["city"], "additionalProperties": False}},
    "type": "object", "properties": {"address": {"$ref": "#/$defs/Address"}}, "required": ["address"],
    "additionalProperties": False}}
# a recursive schema: "#" is the tool's parameters
TREE = {"name": "tree", "parameters": {"type": "object", "properties": {
    "child": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}}, "required": ["child"], "additionalProperties": False}}
# a schema used twice, as zod-to-json-schema writes it (MCP tools): the second use a "$ref" to the first
REUSED = {"name": "reused", "parameters": {"type": "object", "properties": {
    "src": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]},
    "dst": {"$ref": "#/properties/src"}}, "required": ["dst"], "additionalProperties": False}}


@pytest.mark.parametrize("name", SYNTAXES)
def test_forced_grammar_resolves_each_tools_references_in_its_own_schema(name, engine):
    """A forced call of a tool whose parameters hold "$defs" (a "$ref" to them) or refer to themselves ("#"):
    the grammar compiles, takes a call that follows the definitions, and refuses one that does not (it was a
    400, "Pointer '/$defs/Address' does not exist": the references resolved against the call's wrapper)."""
    from hyla.server.tool_calls import ToolCallParser
    parser = ToolCallParser(name)
    tools = [LOOKUP, WEATHER["function"], TREE, REUSED]
    grammar = parser.forced_grammar(tools, parallel=True)

    def takes(args: dict, tool: str = "lookup") -> bool:
        if parser.xml:
            (key, value), = args.items()
            text = f"<tool_call>\n<function={tool}>\n<parameter={key}>\n{json.dumps(value)}\n</parameter>\n" \
                   "</function>\n</tool_call>"
        else:
            text = _forced_calls_text(parser, [(tool, args)])
        matcher = engine.grammars.matcher("ebnf", grammar)
        return all(matcher.accept(t) for t in engine.tokenizer.encode(text, add_special_tokens=False)) \
            and matcher.accept(engine.eos_token_ids[0])

    assert takes({"address": {"city": "Oslo"}})
    assert not takes({"address": {"town": "Oslo"}}) and not takes({"address": {"city": "Oslo-Gardermoen"}})
    assert takes({"child": {"child": {"child": None}}}, "tree") and not takes({"child": {"leaf": 1}}, "tree")
    assert takes({"dst": {"x": 1}}, "reused") and not takes({"dst": {"x": "one"}}, "reused")
    if parser.xml:  # the parser reads a "$ref"'d object as JSON, not as text, whole and streamed
        text = '<tool_call>\n<function=lookup>\n<parameter=address>\n{"city": "Oslo"}\n</parameter>\n</function>\n</tool_call>'
        for calls in (parser.parse(text, [LOOKUP])[1], _streamed(parser.stream([LOOKUP], incremental=True), text)):
            assert [json.loads(c.arguments) for c in calls] == [{"address": {"city": "Oslo"}}]


def _streamed(stream, text: str) -> list:
    """The calls of ``text`` fed to ``stream`` a character at a time."""
    for i, ch in enumerate(text):
        stream.feed(ch, final=i == len(text) - 1)
    return stream.calls


def _forced_calls_text(parser, calls: list[tuple[str, dict]]) -> str:
    """``calls`` as a parallel forced grammar lays them out in ``parser``'s syntax (not ``xml``)."""
    objects = [json.dumps({"name": name, "arguments": args}) for name, args in calls]
    if parser.body in ("list", "python"):
        return f"{parser.start}[{', '.join(objects)}]{parser.end}"
    if parser.body == "lines":
        return parser.start + "\n" + "\n".join(objects) + "\n" + parser.end
    if parser.body == "kimi":
        return parser.start + "".join(f"<|tool_call_begin|>functions.{name}:{i}<|tool_call_argument_begin|>"
                                      f"{json.dumps(args)}<|tool_call_end|>" for i, (name, args) in enumerate(calls)) \
            + parser.end
    return "\n".join(f"{parser.start}\n{o}\n{parser.end}" for o in objects)


FORECAST = {"type": "function", "function": {
    "name": "get_forecast", "parameters": {"type": "object", "properties": {
        "city": {"enum": ["Paris", "Oslo"]}, "days": {"type": "integer", "enum": [1, 2, 3]},
        "metric": {"type": "boolean"}, "note": {"type": "string"}},
        "required": ["city", "days", "metric"], "additionalProperties": False}}}
# FORECAST without its free-text parameter: a random model forced through a free-text value may never
# close it (any text is allowed until the closing tag)
FORECAST_BOUNDED = {"type": "function", "function": {**FORECAST["function"], "parameters": {
    **FORECAST["function"]["parameters"],
    "properties": {k: v for k, v in FORECAST["function"]["parameters"]["properties"].items() if k != "note"}}}}
NOTE = {"type": "function", "function": {"name": "take_note", "parameters": {"type": "object", "properties": {
    "text": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}},
    "priority": {"type": ["integer", "null"]}, "meta": {"type": "object"}, "score": {"type": "number"}},
    "required": ["text"]}}}


def test_qwen3_coder_tool_call_parser():
    """The XML syntax (Qwen3.5, Qwen3-Coder, Nemotron-3): arguments typed by the tool's schema,
    text kept verbatim where the schema allows a string; malformed blocks stay text; streamed in
    pieces of any size, the same calls."""
    from hyla.server.tool_calls import ToolCallParser
    parser = ToolCallParser("qwen3_coder")
    text = ("Let me note that.\n<tool_call>\n<function=take_note>\n<parameter=text>\nline one <b>bold</b>\n"
            "line two: 42\n</parameter>\n<parameter=tags>\n[\"a\", \"b\"]\n</parameter>\n"
            "<parameter=priority>\nnull\n</parameter>\n<parameter=meta>\n{\"k\": 1}\n</parameter>\n"
            "<parameter=score>\n2.5\n</parameter>\n<parameter=extra>\n7\n</parameter>\n</function>\n"
            "</tool_call>\n<tool_call>\n<function=get_forecast>\n<parameter=city>\nOslo\n</parameter>\n"
            "<parameter=days>\n3\n</parameter>\n<parameter=metric>\nfalse\n</parameter>\n</function>\n"
            "</tool_call>")
    content, calls = parser.parse(text, [NOTE, FORECAST])
    assert content == "Let me note that." and [c.name for c in calls] == ["take_note", "get_forecast"]
    assert json.loads(calls[0].arguments) == {"text": "line one <b>bold</b>\nline two: 42", "tags": ["a", "b"],
                                              "priority": None, "meta": {"k": 1}, "score": 2.5, "extra": "7"}
    assert json.loads(calls[1].arguments) == {"city": "Oslo", "days": 3, "metric": False}
    _, untyped = parser.parse(text)  # no tools: every value is its text
    assert json.loads(untyped[1].arguments) == {"city": "Oslo", "days": "3", "metric": "false"}
    _, loose = parser.parse("<tool_call><function=take_note><parameter=score>high</parameter></function>"
                            "</tool_call>", [NOTE])
    assert json.loads(loose[0].arguments) == {"score": "high"}  # not a number: its text, as vLLM and SGLang
    for bad in ("<tool_call>\nhello\n</tool_call>", "<tool_call>\n<function=f>\nstray\n</function>\n</tool_call>",
                "<tool_call>\nx <function=f>\n</function>\n</tool_call>"):
        assert parser.parse(bad) == (bad, [])
    for size in (1, 4, 9, 1000):
        stream, out, got = parser.stream([NOTE, FORECAST]), "", []
        pieces = [text[i:i + size] for i in range(0, len(text), size)]
        for i, piece in enumerate(pieces):
            delta, new = stream.feed(piece, final=i == len(pieces) - 1)
            out, got = out + delta, got + new
        assert out.strip() == "Let me note that." and [c.arguments for c in got] == [c.arguments for c in calls]
    # an earlier call, sent back as OpenAI JSON text, reaches the template as an object
    turn = {"role": "assistant", "tool_calls": [calls[1].openai()]}
    rendered = parser.for_template([{"role": "user", "content": "hi"}, turn])
    assert rendered[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo", "days": 3, "metric": False}
    assert turn["tool_calls"][0]["function"]["arguments"] == calls[1].arguments  # the request is not modified
    assert ToolCallParser("qwen").for_template([turn]) == [turn]


def test_qwen3_coder_forced_grammar(engine):
    """The forced-call grammar in the XML syntax: the grammar accepts a well-formed call (free text
    with markup in a string value) and refuses one without a required parameter; the tiny model,
    forced, emits a call whose arguments parse to the schema's types."""
    from hyla.server.tool_calls import ToolCallParser
    parser = ToolCallParser("qwen3_coder")
    grammar = parser.forced_grammar([FORECAST["function"], NOTE["function"]], parallel=False)
    tok = engine.tokenizer

    def accepts(text: str) -> bool:
        matcher = engine.grammars.matcher("ebnf", grammar)
        ok = all(matcher.accept(t) for t in tok.encode(text, add_special_tokens=False))
        return ok and matcher.terminated and not matcher.error  # complete: nothing but EOS may follow

    good = ("<tool_call>\n<function=get_forecast>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n"
            "</parameter>\n<parameter=metric>\ntrue\n</parameter>\n<parameter=note>\nbring <an> umbrella\nor two\n"
            "</parameter>\n</function>\n</tool_call>")
    assert accepts(good)
    assert parser.parse(good, [FORECAST])[1][0].arguments == json.dumps(
        {"city": "Paris", "days": 2, "metric": True, "note": "bring <an> umbrella\nor two"})
    assert not accepts(good.replace("<parameter=metric>\ntrue\n</parameter>\n", ""))  # required
    assert not accepts(good.replace("\n2\n", "\n7\n"))  # not in the enum
    for parallel in (False, True):
        forced = parser.forced_grammar([FORECAST_BOUNDED["function"]], parallel)
        out = engine.generate(input_ids=[5, 6, 7], sampling_params={"ebnf": forced, "max_new_tokens": 160,
                                                                    "temperature": 0.0})
        _, calls = parser.parse(out["text"], [FORECAST])
        assert calls and (parallel or len(calls) == 1), out["text"]
        for call in calls:
            args = json.loads(call.arguments)
            assert args["city"] in ("Paris", "Oslo") and args["days"] in (1, 2, 3) and isinstance(args["metric"], bool)



def test_a_call_cut_off_by_its_end_marker_as_stop_string_is_a_call(client):
    """``stop: ["</tool_call>"]`` (clients that stop after one call) leaves the answer's last block
    open: it is still the call, with ``finish_reason: "tool_calls"``, whole and streamed."""
    forced = dict(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="required", stop=["</tool_call>"],
                  max_tokens=64, temperature=0.0)
    r = client.chat.completions.create(**forced)
    with client.chat.completions.stream(**forced) as stream:
        streamed = stream.get_final_completion()
    for choice in (r.choices[0], streamed.choices[0]):
        assert choice.finish_reason == "tool_calls" and not choice.message.content
        (call,) = choice.message.tool_calls
        _check_weather_call(call)

def test_qwen3_coder_through_the_server(server, client):
    """``--tool-call-parser qwen3_coder`` end to end: a forced call comes back as ``tool_calls``
    with typed arguments, whole and streamed."""
    from hyla.server.tool_calls import ToolCallParser
    state = server.app.state.server
    saved, state.tool_call_parser = state.tool_call_parser, ToolCallParser("qwen3_coder")
    tools = [FORECAST_BOUNDED]
    try:
        r = client.chat.completions.create(model=MODEL, messages=ASK, tools=tools, tool_choice="required",
                                           parallel_tool_calls=False, max_tokens=96, temperature=0.0)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and not choice.message.content
        args = json.loads(choice.message.tool_calls[0].function.arguments)
        assert args["city"] in ("Paris", "Oslo") and args["days"] in (1, 2, 3) and isinstance(args["metric"], bool)
        stream = client.chat.completions.create(model=MODEL, messages=ASK, tools=tools, tool_choice="required",
                                                parallel_tool_calls=False, max_tokens=96, temperature=0.0,
                                                stream=True)
        calls = joined_calls(t for chunk in stream for c in chunk.choices for t in c.delta.tool_calls or [])
        assert [c["arguments"] for c in calls] == [choice.message.tool_calls[0].function.arguments]
    finally:
        state.tool_call_parser = saved



def test_qwen3_coder_arguments_escaping_a_lone_surrogate_render(server, client):
    """An earlier call sent back with arguments escaping a lone surrogate (``"\\ud800"``: valid
    JSON text in a valid request) reaches the ``qwen3_coder`` template as its text, not decoded into a
    string the tokenizer cannot encode (it was a 500)."""
    from hyla.server.tool_calls import ToolCallParser
    parser = ToolCallParser("qwen3_coder")
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "\\ud800"}'}}
    turn = {"role": "assistant", "content": None, "tool_calls": [call]}
    assert parser.for_template([turn]) == [turn]
    state = server.app.state.server
    saved, state.tool_call_parser = state.tool_call_parser, parser
    try:
        r = client.chat.completions.create(model=MODEL, tools=[WEATHER], max_tokens=2, temperature=0.0, messages=ASK + [
            turn, {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}])
    finally:
        state.tool_call_parser = saved
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")

@pytest.mark.parametrize("extra, param", [
    pytest.param({"tool_choice": "auto"}, "tool_choice", id="tool-choice-without-tools"),
    pytest.param({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", id="unknown-tool-choice"),
    pytest.param({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
                 "tool_choice", id="unknown-function"),
    pytest.param({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
                 "response_format", id="forced-call-and-response-format"),
    pytest.param({"tools": [{"type": "retrieval"}]}, "tools", id="not-a-function"),
    pytest.param({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools", id="bad-name"),
    pytest.param({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls", id="string-parallel"),
    pytest.param({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}],
                  "tool_choice": "required"}, "tools.0.function.parameters", id="parameters-do-not-compile"),
])
def test_tool_errors_are_400(server, extra, param):
    r = httpx.post(server.url + "/v1/chat/completions",
                   json={"model": MODEL, "messages": ASK, "max_tokens": 8, **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error"
    assert param is None or (err["param"] or "").startswith(param), err


# a schema the request's validation lets through (a pattern is a string) and the grammar compiler refuses
BAD_PATTERN = {"type": "function", "function": {"name": "lookup", "parameters": {
    "type": "object", "properties": {"code": {"type": "string", "pattern": "(["}}, "required": ["code"]}}}


@pytest.mark.parametrize("tools, tool_choice, param", [
    pytest.param([WEATHER, BAD_PATTERN], {"type": "function", "function": {"name": "lookup"}},
                 "tools.1.function.parameters", id="named-function"),
    pytest.param([BAD_PATTERN], "required", "tools.0.function.parameters", id="required-one-tool"),
    # one grammar holds every function: which schema failed is not known
    pytest.param([WEATHER, BAD_PATTERN], "required", "tools", id="required-several-tools"),
])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_forced_call_whose_schema_does_not_compile_names_the_tools(server, tools, tool_choice, param, stream):
    """The grammar of a forced call is made of its functions' ``parameters``: when it does not compile,
    the 400 names the function's parameters (``tool_choice`` is fine), and the server goes on serving."""
    body = {"model": MODEL, "messages": ASK, "max_tokens": 8, "tools": tools, "tool_choice": tool_choice,
            "stream": stream}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param, err
    assert "cannot be compiled" in err["message"], err
    ok = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                    json={**body, "tools": [WEATHER], "tool_choice": "required", "stream": False})
    assert ok.status_code == 200, ok.text


# --------------------------------------------------------------------------------------------
# reasoning content
# --------------------------------------------------------------------------------------------
def test_reasoning_parser_unit():
    from hyla.server.reasoning import ReasoningParser
    parser = ReasoningParser("qwen3")
    assert parser.parse("<think>\nhmm, yes</think>\n\nYes.") == ("hmm, yes", "Yes.")
    assert parser.parse("hmm</think>Yes.", in_thinking=True) == ("hmm", "Yes.")
    assert parser.parse("Plain answer <think>") == (None, "Plain answer <think>")
    assert parser.parse("<think>never closed") == ("never closed", "")
    assert parser.prompt_opens_thinking("<|im_start|>assistant\n<think>\n")
    assert not parser.prompt_opens_thinking("<|im_start|>user\n<think><|im_end|>\n<|im_start|>assistant\n")
    text = "<think>\nstep one, step two</think>\n\nThe answer."
    for size in (1, 2, 5, 100):
        stream, thought, content = parser.stream(), "", ""
        pieces = [text[i:i + size] for i in range(0, len(text), size)]
        for i, piece in enumerate(pieces):
            r, c = stream.feed(piece, final=i == len(pieces) - 1)
            thought, content = thought + r, content + c
        assert thought.strip() == "step one, step two" and content == "The answer."



def test_reasoning_parsers_of_models_that_always_think():
    """``deepseek-r1`` (``deepseek_r1``, ``qwen3-thinking``): the answer is reasoning from its start whether or
    not it, or the prompt, opens the block, unless the prompt closed it; ``nano_v3`` reads as ``qwen3``."""
    from hyla.server.reasoning import REASONING_PARSERS, ReasoningParser
    user = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    for name in ("deepseek-r1", "deepseek_r1", "qwen3-thinking"):
        parser = ReasoningParser(name)
        assert parser.prompt_opens_thinking(user) and parser.prompt_opens_thinking(user + "<think>\n")
        assert not parser.prompt_opens_thinking(user + "<think>\n\n</think>\n\n")  # (enable_thinking false)
        assert parser.parse("hmm</think>Yes.", parser.prompt_opens_thinking(user)) == ("hmm", "Yes.")
        assert parser.parse("<think>hmm</think>Yes.", True) == ("hmm", "Yes.")  # (an opening marker dropped)
    nano, qwen = ReasoningParser("nano_v3"), ReasoningParser("qwen3")
    for prompt in (user, user + "<think>\n", user + "<think></think>"):
        assert nano.prompt_opens_thinking(prompt) == qwen.prompt_opens_thinking(prompt)
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        ReasoningParser("r1")
    assert set(REASONING_PARSERS) == {"qwen3", "nano_v3", "deepseek-r1", "deepseek_r1", "qwen3-thinking"}


def test_reasoning_stream_is_the_whole_parse_however_the_text_is_cut():
    """Reasoning and the content after it are each stripped of their surrounding whitespace, the
    same rule whole and streamed: the deltas joined are ``parse``'s fields at every cut (a think
    block cut off by the length limit, a prompt that opened it, an answer without one; an output that
    opens it again after a prompt that did: that ``<think>`` is dropped, as vLLM and SGLang drop it)."""
    from hyla.server.reasoning import ReasoningParser
    parser = ReasoningParser("qwen3")
    cases = [("<think>\nhmm, yes\n</think>\n\n Yes.\n", False, ("hmm, yes", "Yes.")),
             ("\nhmm \n\n</think>Yes. ", True, ("hmm", "Yes.")),
             ("<think>\nstill thinking\n", False, ("still thinking", "")),
             ("\n\n</think>\n\n", True, ("", "")),
             ("  no think \n", False, (None, "  no think \n")),
             ("<thin", False, (None, "<thin")),
             ("<think>\nagain\n</think>ok", True, ("again", "ok")),  # (a <think> the prompt opened already: dropped)
             ("\n<thi", True, ("<thi", "")),
             ("no end <think> inside", True, ("no end <think> inside", ""))]
    for text, in_thinking, expected in cases:
        assert parser.parse(text, in_thinking) == expected, text
        for pieces in _cuts(text):
            stream, thought, content = parser.stream(in_thinking), "", ""
            for i, piece in enumerate(pieces):
                r, c = stream.feed(piece, final=i == len(pieces) - 1)
                thought, content = thought + r, content + c
            assert ((thought if stream.seen_reasoning else None), content) == expected, pieces


def opens_thinking_parser(end: str = "</think>"):
    """The ``qwen3`` reasoning parser as it reads a chat template that writes ``<think>\\n`` into the
    generation prompt (Qwen3-Next-Thinking's; the test tokenizer's template does not). ``end``: its end
    marker (a one-token word, ``THINK_END``, that ``logit_bias`` makes the tiny model write at once)."""
    from hyla.server.reasoning import ReasoningParser

    class OpensThinking(ReasoningParser):
        def prompt_opens_thinking(self, prompt: str) -> bool:
            return True

    parser = OpensThinking("qwen3")
    parser.end = end
    return parser


THINK_END = (726, "usiness")  # a token of the test tokenizer, and its text: a think block's end in these tests


def test_a_forced_call_after_a_prompt_that_opens_thinking_comes_after_the_thinking(server, client):
    """After a prompt that opens ``<think>`` a forced call's grammar starts after the think block
    (``grammar_after``, the reasoning parser's end marker): the model thinks freely (the tiny model, never
    closing it, thinks to the length limit: no call), then calls, whole and streamed, as the grammar says
    (``logit_bias`` makes it close the block at once: here ``THINK_END``)."""
    state = server.app.state.server
    state.reasoning_parser = opens_thinking_parser(THINK_END[1])
    forced = dict(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False,
                  max_tokens=64, temperature=0.0)
    closing = {**forced, "logit_bias": {str(THINK_END[0]): 100}}
    try:
        thinking = client.chat.completions.create(**{**forced, "max_tokens": 6})
        r = client.chat.completions.create(**closing)
        with client.chat.completions.stream(**closing) as stream:
            streamed = stream.get_final_completion()
    finally:
        state.reasoning_parser = None
    assert thinking.choices[0].finish_reason == "length" and not thinking.choices[0].message.tool_calls
    assert thinking.choices[0].message.model_extra["reasoning_content"]
    for choice in (r.choices[0], streamed.choices[0]):
        assert choice.finish_reason == "tool_calls" and not choice.message.model_extra.get("reasoning_content")
        (call,) = choice.message.tool_calls
        _check_weather_call(call)


THINK_START = (3432, "Verse")  # a think block's start in the next test: a one-token word no other token starts


def test_a_forced_call_may_come_after_a_think_block_the_model_opens(server, client):
    """Where the prompt does not open a think block, a model may open one itself (Qwen3's templates): a
    forced call's grammar then lets the answer think first, from the parser's start marker to its end
    (``grammar_after_open``), or call at once (``test_a_grammar_after_an_optional_block_...``).
    ``logit_bias`` makes the tiny model open the block (the start marker, refused without the option:
    the call comes at once, with no reasoning) and close it at once (the end marker's bias is the
    larger); the call follows, whole and streamed."""
    from hyla.server.reasoning import ReasoningParser

    state = server.app.state.server
    parser = ReasoningParser("qwen3")
    parser.start, parser.end = THINK_START[1], THINK_END[1]
    state.reasoning_parser = parser
    forced = dict(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False,
                  max_tokens=64, temperature=0.0)
    thinking = {**forced, "logit_bias": {str(THINK_START[0]): 60, str(THINK_END[0]): 100}}
    try:
        r = client.chat.completions.create(**thinking)
        with client.chat.completions.stream(**thinking) as stream:
            streamed = stream.get_final_completion()
    finally:
        state.reasoning_parser = None
    # a block opened and closed at once (a stream sends no empty reasoning delta)
    assert r.choices[0].message.model_extra.get("reasoning_content") == ""
    for choice in (r.choices[0], streamed.choices[0]):
        assert choice.finish_reason == "tool_calls"
        (call,) = choice.message.tool_calls
        _check_weather_call(call)


def test_reasoning_content_through_server(server, client):
    from hyla.server.reasoning import ReasoningParser
    state = server.app.state.server
    state.reasoning_parser = ReasoningParser("qwen3")
    try:
        r = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=8, temperature=0.0,
                                           extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        # the tiny model never writes <think>: all content, no reasoning_content
        assert r.choices[0].message.model_extra.get("reasoning_content") is None
        stream = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=8, temperature=0.0,
                                                stream=True)
        deltas = [c.choices[0].delta for c in stream if c.choices]
        assert "".join(d.content or "" for d in deltas) == r.choices[0].message.content
        assert all(not (d.model_extra or {}).get("reasoning_content") for d in deltas)
    finally:
        state.reasoning_parser = None


def test_tool_call_markers_that_are_special_tokens_reach_the_parser(tmp_path):
    """Where the tool-call parser's markers are special tokens of the model's tokenizer (Llama-derived and
    Nemotron tokenizers have such), a chat with tools decodes with ``skip_special_tokens`` off: the markers
    reach the parser (they were dropped before it saw them, so no call could ever be parsed). A chat
    without tools still drops special tokens. The tiny model is made to write the marker by ``logit_bias``."""
    import shutil

    from tokenizers import AddedToken
    from tokenizers import Tokenizer as BackendTokenizer

    import checkpoints
    from hyla.engine.engine import DEFAULT_MODEL_DIR
    from hyla.server.app import create_app
    from hyla.server.launch import BackgroundServer
    from hyla.tokenizer import Tokenizer
    from test_server_openai import TOKENIZER_FILES

    backend = BackendTokenizer.from_file(str(DEFAULT_MODEL_DIR / "tokenizer.json"))
    backend.add_special_tokens([AddedToken("<tool_call>", special=True), AddedToken("</tool_call>", special=True)])
    vocab = backend.get_vocab_size()
    path = checkpoints.make_qwen3_next(tmp_path, moe=False, vocab_size=vocab, eos_token_id=backend.token_to_id(
        "<|im_end|>"))
    shutil.copy(DEFAULT_MODEL_DIR / TOKENIZER_FILES[1], path / TOKENIZER_FILES[1])
    backend.save(str(path / TOKENIZER_FILES[0]))
    tokenizer = Tokenizer.from_pretrained(path)
    marker = backend.token_to_id("<tool_call>")
    assert tokenizer.is_special_token("<tool_call>") and not tokenizer.is_special_token("hello")
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    body = {"model": MODEL, "messages": [{"role": "user", "content": "call f"}], "max_tokens": 3, "temperature": 0,
            "logit_bias": {str(marker): 100}}
    with BackgroundServer(create_app(path, served_model_name=MODEL, max_total_tokens=2048, max_state_slots=16)) as srv:
        with_tools = httpx.post(srv.url + "/v1/chat/completions", json={**body, "tools": tools}, timeout=60).json()
        without = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=60).json()
    assert with_tools["choices"][0]["message"]["content"] == "<tool_call>" * 3  # (three opening markers: no call)
    assert without["choices"][0]["message"]["content"] in ("", None)


def test_every_marker_of_a_syntax_keeps_special_tokens():
    """Kimi's calls hold markers of their own inside the section (``<|tool_call_argument_begin|>``, ...):
    where any of a syntax's markers is a special token, special tokens are kept in a chat with tools."""
    from types import SimpleNamespace

    from hyla.server.openai_routes import kept_markers
    from hyla.server.tool_calls import ToolCallParser
    tokenizer = SimpleNamespace(is_special_token={"<|tool_call_argument_begin|>"}.__contains__)
    server = SimpleNamespace(admit=lambda: SimpleNamespace(tokenizer=tokenizer), reasoning_parser=None,
                             tool_call_parser=ToolCallParser("kimi_k2"))
    assert kept_markers(server, SimpleNamespace(tool_choice_mode=lambda: "auto")) == {"skip_special_tokens": False}
    assert kept_markers(server, SimpleNamespace(tool_choice_mode=lambda: "none")) == {}
    server.tool_call_parser = ToolCallParser("qwen")
    assert kept_markers(server, SimpleNamespace(tool_choice_mode=lambda: "auto")) == {}


@pytest.mark.parametrize("name", SYNTAXES)
@pytest.mark.parametrize("size", [1, 2, 3, 5])
def test_a_streamed_call_comes_with_the_chunk_that_ends_it(name, size):
    """A held call block is searched for its end marker piece by piece (a long call costs linear time): the call
    comes with the chunk that completes its end marker, however small the chunks, even where the marker is cut
    across several of them; the text after it streams on."""
    from hyla.server.tool_calls import ToolCallParser
    parser = ToolCallParser(name)
    block = _call_block(parser)
    text = "Checking. " + block + " Done."
    stream, content, came = parser.stream(), "", None
    pieces = [text[i:i + size] for i in range(0, len(text), size)]
    for k, piece in enumerate(pieces):
        c, calls = stream.feed(piece, final=k == len(pieces) - 1)
        content += c
        if calls:
            came = k
    assert came == (text.index(block) + len(block) - 1) // size and content == "Checking.  Done."
