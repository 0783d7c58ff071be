"""Chat inputs the chat template and the tool-call parsers cannot take are a 400 with an OpenAI-style
error body, never a 500, and the server keeps serving: malformed ``tool_calls`` in the history, a
template failing on the values it is given, lists and objects nested past ``MAX_NESTING_DEPTH``,
tool ``parameters`` not shaped as a JSON Schema (the ``qwen3_coder`` parser reads them), and JSON
nested past Python's recursion limit where a parser reads JSON."""

from __future__ import annotations

import json
from contextlib import contextmanager

import httpx
import pytest

from hyla.server.app import create_app
from hyla.server.launch import BackgroundServer
from hyla.server.tool_calls import SYNTAXES, ToolCallParser
from hyla.tokenizer.chat_template import MAX_NESTING_DEPTH
from test_server_openai import MODEL, make_chat_model

USER = {"role": "user", "content": "What is the weather in Paris?"}
CHAT = {"model": MODEL, "messages": [USER], "max_tokens": 2}


@pytest.fixture(scope="module")
def server(tiny_ckpt_dir):
    app = create_app(make_chat_model(tiny_ckpt_dir), served_model_name=MODEL, max_total_tokens=16384,
                     max_state_slots=64, context_length=4096)
    with BackgroundServer(app) as srv:
        yield srv


def _deep(levels: int) -> object:
    """A string inside ``levels`` nested lists."""
    value: object = "x"
    for _ in range(levels):
        value = [value]
    return value


def _post(server, body: dict, deep: int = 0) -> httpx.Response:
    """POST ``body``; with ``deep``, its string ``"DEEP"`` becomes a string inside ``deep`` nested
    lists (written here: json.dumps itself stops at Python's recursion limit)."""
    text = json.dumps(body)
    if deep:
        text = text.replace('"DEEP"', "[" * deep + '"x"' + "]" * deep)
    return httpx.post(server.url + "/v1/chat/completions", content=text.encode(), timeout=60,
                      headers={"content-type": "application/json"})


def _assert_400_then_serves(server, body: dict, param: str | None = None, *fragments: str, deep: int = 0) -> dict:
    """``body`` (``_post``) is a 400 with an OpenAI-style body (``param`` starting with ``param``,
    the message holding each fragment), and a good request right after it is served."""
    r = _post(server, body, deep)
    assert r.status_code == 400, r.text
    assert set(r.json()) == {"error"}
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert param is None or (err["param"] or "").startswith(param), err
    for fragment in fragments:
        assert fragment in err["message"], err
    ok = _post(server, CHAT)
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] in ("stop", "length"), ok.text
    return err


@contextmanager
def _parser(server, name: str):
    """The server's tool-call parser set to ``name`` for a while (``--tool-call-parser``)."""
    state = server.app.state.server
    saved, state.tool_call_parser = state.tool_call_parser, ToolCallParser(name)
    try:
        yield
    finally:
        state.tool_call_parser = saved


# --------------------------------------------------------------------------------------------
# tool_calls in the history
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("tool_calls, fragment", [
    pytest.param([{"function": {"name": 5, "arguments": "{}"}}], "tool_calls[0].function.name", id="name-number"),
    pytest.param(5, "tool_calls must be a list", id="not-a-list"),
    pytest.param([{"function": {"name": "f"}}], "tool_calls[0].function.arguments", id="no-arguments"),
    pytest.param([{"function": {"name": "f", "arguments": 5}}], "tool_calls[0].function.arguments",
                 id="arguments-number"),
    pytest.param([{"type": "retrieval", "function": {"name": "f", "arguments": "{}"}}], "tool_calls[0].type",
                 id="not-a-function-call"),
])
def test_malformed_tool_calls_in_the_history_are_400(server, tool_calls, fragment):
    messages = [USER, {"role": "assistant", "content": None, "tool_calls": tool_calls}, USER]
    _assert_400_then_serves(server, {**CHAT, "messages": messages}, "messages", "messages[1]." + fragment)


def test_well_formed_tool_calls_in_the_history_are_served(server):
    calls = [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}},
             {"function": {"name": "g", "arguments": {"b": [1, 2]}}}]  # arguments as an object (transformers)
    r = _post(server, {**CHAT, "messages": [USER, {"role": "assistant", "content": None, "tool_calls": calls},
                                            {"role": "tool", "content": "sunny"}]})
    assert r.status_code == 200, r.text
    # a kwarg may not shadow the template's own helpers (raise_exception, which it calls for a late
    # system message: a TypeError inside the template once)
    body = {**CHAT, "messages": [USER, {"role": "system", "content": "late"}],
            "chat_template_kwargs": {"raise_exception": "not callable"}}
    _assert_400_then_serves(server, body, "chat_template_kwargs", "may not set", "raise_exception")


def test_an_error_of_the_templates_own_code_is_a_value_error():
    """A template that fails on the values it is given (a TypeError, adding a number to a string) is
    a ValueError, which the server answers with a 400."""
    from hyla.tokenizer.chat_template import render_chat_template

    with pytest.raises(ValueError, match=r"could not render the messages \(TypeError"):
        render_chat_template("{{ messages[0]['content'] + 1 }}", [USER])


# --------------------------------------------------------------------------------------------
# nesting
# --------------------------------------------------------------------------------------------
def test_the_template_refuses_values_nested_past_the_bound():
    """The library's own bound (the copy the template gets), whatever reaches it past the server's
    request check: a message counts one level, each list inside it one more."""
    from hyla.tokenizer.chat_template import render_chat_template

    def message(levels: int) -> dict:
        value: object = "x"
        for _ in range(levels - 1):
            value = [value]
        return {**USER, "x": value}

    assert render_chat_template("{{ messages[0]['content'] }}", [message(MAX_NESTING_DEPTH)])
    for levels in (MAX_NESTING_DEPTH + 1, 5000):
        with pytest.raises(ValueError, match=rf"messages\[0\] nests lists and objects more than {MAX_NESTING_DEPTH}"):
            render_chat_template("{{ messages[0]['content'] }}", [message(levels)])


@pytest.mark.parametrize("where", ["message", "chat_template_kwargs", "tools"])
def test_deep_nesting_is_400(server, where):
    # "DEEP" is where _post nests lists (levels counted from the message, the tools list, the kwargs)
    if where == "message":
        body, above = {**CHAT, "messages": [{**USER, "x": "DEEP"}]}, 1
    elif where == "chat_template_kwargs":
        body, above = {**CHAT, "chat_template_kwargs": {"x": "DEEP"}}, 1
    else:
        body, above = {**CHAT, "tools": _tools({"type": "object", "x": "DEEP"})}, 4
    param = {"message": "messages"}.get(where, where)
    for levels in (MAX_NESTING_DEPTH + 1 - above, 700, 950):  # deeper: the JSON body parser refuses it
        _assert_400_then_serves(server, body, param, f"more than {MAX_NESTING_DEPTH} levels deep", deep=levels)
    r = _post(server, body, deep=MAX_NESTING_DEPTH - above)  # at the bound: served
    assert r.status_code == 200, r.text


# --------------------------------------------------------------------------------------------
# tool schemas and the qwen3_coder parser
# --------------------------------------------------------------------------------------------
CALL_TEXT = "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n</function>\n</tool_call>"


def _tools(parameters: dict) -> list[dict]:
    return [{"type": "function", "function": {"name": "f", "parameters": parameters}}]


@pytest.mark.parametrize("parameters, extra, keyword", [
    pytest.param({"type": "object", "properties": ["a"]}, {"tool_choice": "required"}, "properties",
                 id="properties-list"),
    pytest.param({"type": "object", "properties": {"a": {"type": "string"}}, "required": 5},
                 {"tool_choice": "required"}, "required", id="required-number"),
    pytest.param({"type": "object", "properties": {"a": {"enum": 5}}}, {"tool_choice": "required"}, "a.enum",
                 id="enum-number"),
    pytest.param({"type": "object", "properties": {"a": {"anyOf": 5}}}, {"tool_choice": "required"}, "a.anyOf",
                 id="anyof-number"),
    pytest.param({"type": "object", "properties": ["a"]},  # auto, and the output holds a call block
                 {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
                     "const": CALL_TEXT}}}, "max_tokens": 64}, "properties", id="properties-list-auto-output"),
])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_qwen3_coder_malformed_tool_schemas_are_400(server, parameters, extra, keyword, stream):
    with _parser(server, "qwen3_coder"):
        body = {**CHAT, "tools": _tools(parameters), **extra, "stream": stream}
        _assert_400_then_serves(server, body, "tools", "function 'f'", keyword)


def test_qwen3_coder_deeply_nested_arguments_in_the_history(server):
    """``qwen3_coder`` reads a call's ``arguments`` text in the history as JSON: text nested past
    Python's recursion limit stays text (the template takes it), and JSON nested past the bound is
    a 400."""
    with _parser(server, "qwen3_coder"):
        def history(arguments: str) -> dict:
            call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": arguments}}
            return {**CHAT, "messages": [USER, {"role": "assistant", "content": None, "tool_calls": [call]}, USER]}

        r = _post(server, history("[" * 1100 + "]" * 1100))
        assert r.status_code == 200, r.text
        _assert_400_then_serves(server, history(json.dumps({"a": _deep(100)})), "messages", "levels deep")


# --------------------------------------------------------------------------------------------
# the parsers themselves: any text, any schema
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", SYNTAXES)
def test_parsers_take_json_nested_past_the_recursion_limit(name):
    """A block whose JSON (or ``lfm2``'s Python literal) Python cannot read stays content; a
    ``qwen3_coder`` parameter value it cannot read stays text (its fallback for any value that is not
    JSON)."""
    parser = ToolCallParser(name)
    deep = "[" * 5000 + "]" * 5000
    call = f'{{"name": "f", "arguments": {deep}}}'
    body = {"xml": f"<function=f>\n<parameter=a>\n{deep}\n</parameter>\n</function>",
            "kimi": f"<|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{deep}<|tool_call_end|>",
            "python": f"[f(a={deep})]", "list": f"[{call}]"}.get(parser.body, call)
    text = f"{parser.start}{body}{parser.end}"
    tools = _tools({"type": "object", "properties": {"a": {"type": "array"}}})
    for content, calls in (parser.parse(text, tools), parser.stream(tools).feed(text, final=True)):
        if name == "qwen3_coder":
            assert content == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"a": deep})]
        else:
            assert (content, calls) == (text, [])


def _xml_calls_by_regex(body: str) -> list[tuple[str, dict]] | None:
    """The XML calls as a regex reads them (the parser's rule, written the plain way; quadratic where
    opening tags have no closing ones): the oracle of ``xml_calls``."""
    import re
    from hyla.server.tool_calls import xml_argument
    calls, pos = [], 0
    for fn in re.finditer(r"<function=([^>\n]+)>(.*?)</function>", body, re.S):
        if body[pos:fn.start()].strip():
            return None
        args, at, inner = {}, 0, fn.group(2)
        for p in re.finditer(r"<parameter=([^>\n]+)>(.*?)</parameter>", inner, re.S):
            if inner[at:p.start()].strip():
                return None
            args.setdefault(p.group(1).strip(), xml_argument(p.group(2), None))  # (the first of a key written twice)
            at = p.end()
        if inner[at:].strip():
            return None
        calls.append((fn.group(1).strip(), args))
        pos = fn.end()
    return calls if calls and not body[pos:].strip() else None


def test_xml_calls_are_the_regexs_on_any_text():
    """The XML parser reads tags in one pass (linear: a regex searched again from every opening tag took
    seconds on an output of thousands of unclosed tags); on random tag soup it finds what the regex
    finds."""
    import random
    from hyla.server.tool_calls import xml_calls
    rng = random.Random(0)
    pieces = ["<function=", "</function>", "<parameter=", "</parameter>", "f", " g", ">", "\n", " ", "x", "1",
              "<function=f>\n", "<parameter=k>\n", "\n</parameter>\n", "</function>\n", "<", "=", "/"]
    for _ in range(4000):
        body = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 14)))
        got = xml_calls(body, None)
        assert (None if got is None else [(c.name, json.loads(c.arguments)) for c in got]) == \
            _xml_calls_by_regex(body), body


def test_kimi_calls_are_read_in_one_pass():
    """Kimi's sections split at their markers: the same calls, and on random marker soup, a result that is
    either None or exactly the calls written."""
    import random
    parser = ToolCallParser("kimi_k2")
    rng, found = random.Random(1), 0
    call = '<|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{"a": 1}<|tool_call_end|>'
    pieces = [call, call, call.replace("f:0", "g:1"), "<|tool_call_begin|>", "<|tool_call_argument_begin|>",
              "<|tool_call_end|>", "functions.f:0", "{}", " ", "x", ":"]
    for _ in range(4000):
        body = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 10)))
        calls = parser.calls_of(body)
        found += calls is not None
        if calls is not None:
            rebuilt = "".join(f"<|tool_call_begin|>{c.id}<|tool_call_argument_begin|>{c.arguments}<|tool_call_end|>"
                              for c in calls)
            assert rebuilt.replace(" ", "") == body.replace(" ", ""), body
    assert found > 100  # (the soup holds calls often enough)


def test_qwen3_coder_parse_takes_any_schema_shape():
    """Output parsing never raises on a tool schema, whatever the caller let through."""
    parser = ToolCallParser("qwen3_coder")
    for parameters in ({"properties": ["a"]}, {"properties": {"a": {"enum": 5}}}, {"properties": {"a": {"anyOf": 5}}},
                       {"properties": {"a": {"anyOf": [{"anyOf": [{"type": "integer"}]}, True]}}},
                       {"properties": {"a": {"anyOf": [{"enum": [2, 3]}, {"type": ["null", "integer"]}]}}}):
        _, calls = parser.parse(CALL_TEXT, _tools(parameters))
        assert [c.name for c in calls] == ["f"]
        assert json.loads(calls[0].arguments)["a"] in ("1", 1)


@pytest.mark.parametrize("parameters, keyword", [
    ({"properties": ["a"]}, "properties"), ({"required": 5}, "required"),
    ({"properties": {"a": {"enum": 5}}}, "enum"), ({"properties": {"a": {"anyOf": 5}}}, "anyOf"),
])
@pytest.mark.parametrize("name", SYNTAXES)
def test_forced_grammar_refuses_malformed_parameters(name, parameters, keyword):
    with pytest.raises(ValueError, match=f"function 'f': parameters.*{keyword}"):
        ToolCallParser(name).forced_grammar([{"name": "f", "parameters": parameters}], parallel=False)
