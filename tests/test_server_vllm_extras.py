"""vLLM's request extras on /v1/chat/completions and /v1/completions: ``return_token_ids``,
``include_stop_str_in_output``, ``structured_outputs`` (and the older ``guided_*``),
``stream_options.continuous_usage_stats`` and ``truncate_prompt_tokens``; and their bad values,
each a 400 naming the field. Same server as ``test_server_openai`` (a tiny random model: every check
compares the server with the engine, with itself, or with what a grammar guarantees)."""

from __future__ import annotations

import json
import re

import httpx
import pytest

from test_server_openai import MODEL, client, engine, server  # noqa: F401  (fixtures)

SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]}},
    "required": ["ok", "color"],
    "additionalProperties": False,
}


def _messages(user: str) -> list[dict]:
    return [SYSTEM, {"role": "user", "content": user}]


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=120)


def _ok(server, path: str, body: dict) -> dict:
    r = _post(server, path, body)
    assert r.status_code == 200, r.text
    return r.json()


def _events(server, path: str, body: dict) -> list[dict]:
    """The JSON events of a streamed answer (``[DONE]`` last, left out)."""
    with httpx.stream("POST", server.url + path, json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        lines = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def _chat(max_tokens: int = 8, user: str = "Tell me something.", **extra) -> dict:
    return {"model": MODEL, "messages": _messages(user), "max_tokens": max_tokens, "temperature": 0, **extra}


def _completion(prompt, max_tokens: int = 8, **extra) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}


def _chat_ids(engine, user: str = "Tell me something.") -> list[int]:
    """The rendered prompt's ids, as the engine is fed them."""
    return engine.tokenizer.encode_chat(_messages(user), add_generation_prompt=True).ids


def _greedy(engine, ids: list[int], max_new_tokens: int, **extra) -> dict:
    return engine.generate(input_ids=ids, sampling_params={"max_new_tokens": max_new_tokens, "temperature": 0.0,
                                                           **extra})


def _error(server, path: str, body: dict, param: str, message: str | None = None) -> dict:
    r = _post(server, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param, err
    if not (message or "").startswith("Extra inputs"):  # (the field is known: its own rule refused it)
        assert "Extra inputs" not in err["message"], err
    assert message is None or message in err["message"], err
    return err


def _first_new_token(ids: list[int], start: int = 1) -> int:
    """A position ``i >= start`` whose id does not occur before it (a stop token id that ends there)."""
    return next(i for i in range(start, len(ids)) if ids[i] not in ids[:i])


# --------------------------------------------------------------------------------------------
# return_token_ids
# --------------------------------------------------------------------------------------------
def test_chat_return_token_ids(server, engine):
    ids = _chat_ids(engine)
    expected = _greedy(engine, ids, 8, ignore_eos=True)
    out = _ok(server, "/v1/chat/completions", _chat(ignore_eos=True, return_token_ids=True))
    assert out["prompt_token_ids"] == ids  # top level, as vLLM's
    (choice,) = out["choices"]
    assert choice["token_ids"] == expected["output_ids"] and len(choice["token_ids"]) == 8
    assert choice["message"]["content"] == expected["text"]
    plain = _ok(server, "/v1/chat/completions", _chat(ignore_eos=True))  # not asked for: OpenAI's shape
    assert "prompt_token_ids" not in plain and "token_ids" not in plain["choices"][0]
    nulled = _ok(server, "/v1/chat/completions", _chat(ignore_eos=True, return_token_ids=None))
    assert "prompt_token_ids" not in nulled  # null: the default


def test_return_token_ids_keep_the_stop_token_and_stop_string_tokens(server, engine):
    """The ids are what the engine produced: a stop token ends them (its text is not in the content),
    and the tokens that hold a stop string stay (the text is cut), as vLLM's."""
    ids = _chat_ids(engine, "Count for me.")
    out = _greedy(engine, ids, 12, ignore_eos=True)["output_ids"]
    i = _first_new_token(out, 2)
    r = _ok(server, "/v1/chat/completions", _chat(12, "Count for me.", stop_token_ids=[out[i]], return_token_ids=True,
                                                  ignore_eos=True))
    choice = r["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["token_ids"] == out[:i + 1]
    assert choice["message"]["content"] == _greedy(engine, ids, i, ignore_eos=True)["text"]
    assert r["usage"]["completion_tokens"] == i + 1
    text = _greedy(engine, ids, 12, ignore_eos=True)["text"]
    stop = text[len(text) // 2:len(text) // 2 + 2]
    r = _ok(server, "/v1/completions", _completion(ids, 12, stop=[stop], return_token_ids=True, ignore_eos=True))
    choice = r["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["text"] == text[:text.find(stop)]
    n = len(choice["token_ids"])
    assert choice["token_ids"] == out[:n] and stop in engine.tokenizer.decode(out[:n])


def test_chat_return_token_ids_streamed(server, engine):
    ids = _chat_ids(engine)
    expected = _greedy(engine, ids, 8, ignore_eos=True)["output_ids"]
    events = _events(server, "/v1/chat/completions", _chat(n=2, ignore_eos=True, return_token_ids=True))
    role_chunks = [e for e in events if e["choices"] and "role" in e["choices"][0]["delta"]]
    assert len(role_chunks) == 2 and all(e["prompt_token_ids"] == ids for e in role_chunks)
    assert all("prompt_token_ids" not in e for e in events if e not in role_chunks)
    streamed = {0: [], 1: []}
    for e in events:
        for c in e["choices"]:
            streamed[c["index"]] += c.get("token_ids") or []
    assert streamed[0] == streamed[1] == expected
    plain = _events(server, "/v1/chat/completions", _chat(ignore_eos=True))
    assert all("prompt_token_ids" not in e and all("token_ids" not in c for c in e["choices"]) for e in plain)


def test_completions_return_token_ids(server, engine):
    prompts = ["Once upon a time", "In the beginning"]
    out = _ok(server, "/v1/completions", _completion(prompts, 6, n=2, return_token_ids=True, ignore_eos=True))
    for choice in out["choices"]:
        prompt_ids = engine.tokenizer.encode(prompts[choice["index"] // 2])
        assert choice["prompt_token_ids"] == prompt_ids  # per choice, as vLLM's
        assert choice["token_ids"] == _greedy(engine, prompt_ids, 6, ignore_eos=True)["output_ids"]
    events = _events(server, "/v1/completions", _completion(prompts, 6, n=2, return_token_ids=True, ignore_eos=True))
    streamed = {i: [] for i in range(4)}
    firsts = {}
    for e in events:
        for c in e["choices"]:
            firsts.setdefault(c["index"], c)
            assert ("prompt_token_ids" in c) == (firsts[c["index"]] is c)  # a choice's first chunk only
            streamed[c["index"]] += c["token_ids"]
    for i in range(4):
        assert firsts[i]["prompt_token_ids"] == out["choices"][i]["prompt_token_ids"]
        assert streamed[i] == out["choices"][i]["token_ids"]
    plain = _ok(server, "/v1/completions", _completion(prompts, 2))
    assert all("prompt_token_ids" not in c and "token_ids" not in c for c in plain["choices"])


# --------------------------------------------------------------------------------------------
# include_stop_str_in_output
# --------------------------------------------------------------------------------------------
def _stop_in(text: str) -> tuple[str, int]:
    """A 3-character stop string first occurring at ``start >= 4`` in ``text``, and ``start``."""
    start = next(i for i in range(4, len(text) - 3) if text.find(text[i:i + 3]) == i)
    return text[start:start + 3], start


def test_include_stop_str_in_output(server, engine):
    ids = _chat_ids(engine, "Say something long.")
    text = _greedy(engine, ids, 24, ignore_eos=True)["text"]
    stop, start = _stop_in(text)
    body = _chat(24, "Say something long.", stop=[stop, "\u2603never"], ignore_eos=True,
                 include_stop_str_in_output=True)
    out = _ok(server, "/v1/chat/completions", body)["choices"][0]
    assert out["message"]["content"] == text[:start + 3] and out["message"]["content"].endswith(stop)
    assert out["finish_reason"] == "stop"
    events = _events(server, "/v1/chat/completions", body)
    assert "".join(c["delta"].get("content") or "" for e in events for c in e["choices"]) == text[:start + 3]
    cut = _ok(server, "/v1/chat/completions", {**body, "include_stop_str_in_output": False})["choices"][0]
    assert cut["message"]["content"] == text[:start]  # the default: cut before it
    completion = _completion(ids, 24, stop=stop, ignore_eos=True, include_stop_str_in_output=True)
    assert _ok(server, "/v1/completions", completion)["choices"][0]["text"] == text[:start + 3]
    assert "".join(c["text"] for e in _events(server, "/v1/completions", completion)
                   for c in e["choices"]) == text[:start + 3]


def test_include_stop_str_in_output_keeps_a_stop_tokens_text(server, engine):
    """vLLM's rule: a stop token's text (here an ordinary token given as a stop token id) stays too."""
    ids = _chat_ids(engine, "Count for me.")
    out = _greedy(engine, ids, 12, ignore_eos=True)["output_ids"]
    i = _first_new_token(out, 2)
    body = _chat(12, "Count for me.", stop_token_ids=[out[i]], ignore_eos=True, include_stop_str_in_output=True)
    kept = _ok(server, "/v1/chat/completions", body)["choices"][0]
    assert kept["finish_reason"] == "stop"
    assert kept["message"]["content"] == _greedy(engine, ids, i + 1, ignore_eos=True)["text"]
    streamed = _events(server, "/v1/chat/completions", body)
    assert "".join(c["delta"].get("content") or "" for e in streamed for c in e["choices"]) == \
        kept["message"]["content"]
    dropped = _ok(server, "/v1/chat/completions", {**body, "include_stop_str_in_output": False})["choices"][0]
    assert dropped["message"]["content"] == _greedy(engine, ids, i, ignore_eos=True)["text"]


def test_generate_takes_include_stop_str_in_output(server, engine):
    ids = engine.tokenizer.encode("The stop string stays:")
    text = _greedy(engine, ids, 24, ignore_eos=True)["text"]
    stop, start = _stop_in(text)
    params = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True, "stop": [stop],
              "include_stop_str_in_output": True}
    assert _ok(server, "/generate", {"input_ids": ids, "sampling_params": params})["text"] == text[:start + 3]
    _error(server, "/generate", {"input_ids": ids, "sampling_params": {**params, "include_stop_str_in_output": 1}},
           "sampling_params.include_stop_str_in_output", "must be a bool")


# --------------------------------------------------------------------------------------------
# structured outputs
# --------------------------------------------------------------------------------------------
def _check_schema(text: str) -> bool:
    value = json.loads(text)
    return (set(value) == {"ok", "color"} and isinstance(value["ok"], bool)
            and value["color"] in ("red", "green", "blue"))


CHOICES = ["red wine", "a.b*", "(x|y)"]


@pytest.mark.parametrize("extra, check", [
    pytest.param({"structured_outputs": {"json": SCHEMA}}, _check_schema, id="so-json"),
    pytest.param({"structured_outputs": {"json": json.dumps(SCHEMA), "disable_any_whitespace": True,
                                         "disable_fallback": True}}, _check_schema, id="so-json-text"),
    pytest.param({"structured_outputs": {"regex": "[a-c]{3}-[0-9]"}},
                 lambda t: re.fullmatch("[a-c]{3}-[0-9]", t), id="so-regex"),
    pytest.param({"structured_outputs": {"choice": CHOICES}}, lambda t: t in CHOICES, id="so-choice"),
    pytest.param({"structured_outputs": {"grammar": 'root ::= "yes" | "no"'}}, lambda t: t in ("yes", "no"),
                 id="so-gbnf"),
    pytest.param({"structured_outputs": {"grammar": 'start: "up" | "down"'}}, lambda t: t in ("up", "down"),
                 id="so-lark"),
    pytest.param({"guided_json": SCHEMA}, _check_schema, id="guided-json"),
    pytest.param({"guided_regex": "[xyz]{4}"}, lambda t: re.fullmatch("[xyz]{4}", t), id="guided-regex"),
    pytest.param({"guided_choice": CHOICES}, lambda t: t in CHOICES, id="guided-choice"),
    pytest.param({"guided_grammar": 'root ::= "left" | "right"'}, lambda t: t in ("left", "right"),
                 id="guided-grammar"),
    # vLLM's rule: response_format's schema replaces a json constraint
    pytest.param({"guided_json": {"type": "string"}, "structured_outputs": None,
                  "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}},
                 _check_schema, id="response-format-replaces-guided-json"),
    pytest.param({"structured_outputs": {"json": {"type": "integer"}},
                  "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}},
                 _check_schema, id="response-format-replaces-so-json"),
])
def test_structured_outputs(server, extra, check):
    chat = _ok(server, "/v1/chat/completions", _chat(64, "Answer.", **extra))["choices"][0]
    assert chat["finish_reason"] == "stop" and check(chat["message"]["content"]), chat
    streamed = _events(server, "/v1/chat/completions", _chat(64, "Answer.", **extra))
    assert "".join(c["delta"].get("content") or "" for e in streamed for c in e["choices"]) == \
        chat["message"]["content"]
    completion = _ok(server, "/v1/completions", _completion("Answer:", 64, **extra))["choices"][0]
    assert completion["finish_reason"] == "stop" and check(completion["text"]), completion


def test_structured_outputs_json_object(server):
    out = _ok(server, "/v1/chat/completions", _chat(48, "JSON please.", structured_outputs={"json_object": True}))
    text = out["choices"][0]["message"]["content"]
    assert text.startswith("{")
    if out["choices"][0]["finish_reason"] == "stop":
        assert isinstance(json.loads(text), dict)


def test_structured_outputs_choice_is_literal(server):
    """The alternatives are literal text: regex metacharacters in them match only themselves."""
    out = _ok(server, "/v1/completions", _completion("Pick:", 16, temperature=1.0, seed=1, n=8,
                                                     structured_outputs={"choice": ["a.b*", "c+"]}))
    assert {c["text"] for c in out["choices"]} <= {"a.b*", "c+"}


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris"]}}, "required": ["city"]}}}


@pytest.mark.parametrize("extra, param, message", [
    pytest.param({"structured_outputs": {"json": SCHEMA, "regex": "a"}}, "structured_outputs.regex",
                 "one constraint", id="two-in-structured-outputs"),
    pytest.param({"structured_outputs": {"regex": "a"}, "guided_regex": "b"}, "guided_regex", "one output constraint",
                 id="structured-outputs-and-guided"),
    pytest.param({"guided_json": SCHEMA, "guided_choice": ["a"]}, "guided_choice", "one output constraint",
                 id="two-guided"),
    pytest.param({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
                 "structured_outputs.regex", "one output constraint", id="response-format-and-regex"),
    pytest.param({"response_format": {"type": "json_object"}, "guided_json": SCHEMA}, "guided_json",
                 "one output constraint", id="json-object-and-guided-json"),
    pytest.param({"structured_outputs": {}}, "structured_outputs", "needs one constraint", id="none"),
    pytest.param({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "empty", id="empty-choice"),
    pytest.param({"guided_choice": []}, "guided_choice", "empty", id="empty-guided-choice"),
    pytest.param({"structured_outputs": {"json_object": False}}, "structured_outputs.json_object", "must be true",
                 id="json-object-false"),
    pytest.param({"structured_outputs": {"regex": "a", "whitespace_pattern": " "}},
                 "structured_outputs.whitespace_pattern", "not supported", id="whitespace-pattern"),
    pytest.param({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag",
                 "not supported", id="structural-tag"),
    pytest.param({"structured_outputs": {"json": SCHEMA, "disable_additional_properties": True}},
                 "structured_outputs.disable_additional_properties", "not supported", id="disable-additional"),
    pytest.param({"structured_outputs": {"regex": "a", "backend": "xgrammar"}}, "structured_outputs.backend",
                 "Extra inputs", id="unknown-key"),
    pytest.param({"structured_outputs": {"regex": 5}}, "structured_outputs.regex", None, id="regex-not-a-string"),
    pytest.param({"structured_outputs": {"regex": "("}}, "structured_outputs.regex", "cannot be compiled",
                 id="regex-does-not-compile"),
    pytest.param({"guided_grammar": "root ::= "}, "guided_grammar", None, id="grammar-does-not-compile"),
    pytest.param({"structured_outputs": {"json": {"type": "nonsense"}}}, "structured_outputs.json",
                 "cannot be compiled", id="schema-does-not-compile"),
    pytest.param({"guided_json": "{not json"}, "guided_json", "not valid JSON", id="guided-json-not-json"),
    pytest.param({"structured_outputs": {"regex": "a"}, "tools": [WEATHER], "tool_choice": "required"},
                 "structured_outputs.regex", "tool_choice", id="with-forced-tools"),
])
def test_structured_outputs_errors_are_400(server, extra, param, message):
    _error(server, "/v1/chat/completions", _chat(8, **extra), param, message)


def test_structured_outputs_errors_on_completions(server):
    _error(server, "/v1/completions", _completion("x", structured_outputs={"regex": "a", "choice": ["b"]}),
           "structured_outputs.choice")
    _error(server, "/v1/completions", _completion("x", guided_regex="("), "guided_regex", "cannot be compiled")


# --------------------------------------------------------------------------------------------
# stream_options.continuous_usage_stats
# --------------------------------------------------------------------------------------------
def test_chat_continuous_usage_stats(server, engine):
    ids = _chat_ids(engine)
    body = _chat(6, ignore_eos=True, return_token_ids=True,
                 stream_options={"include_usage": True, "continuous_usage_stats": True})
    events = _events(server, "/v1/chat/completions", body)
    assert all(e["usage"] is not None for e in events)
    *chunks, final = events
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == 6
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant" and chunks[0]["usage"]["completion_tokens"] == 0
    so_far = 0
    for e in chunks:
        so_far += len(e["choices"][0].get("token_ids") or [])
        usage = e["usage"]
        assert usage["prompt_tokens"] == len(ids) and usage["completion_tokens"] == so_far
        assert usage["total_tokens"] == len(ids) + so_far
    assert so_far == 6
    # without include_usage it does nothing (vLLM's rule)
    quiet = _events(server, "/v1/chat/completions", {**body, "stream_options": {"continuous_usage_stats": True}})
    assert all(e.get("usage") is None for e in quiet)


def test_completions_continuous_usage_stats(server, engine):
    prompt_ids = engine.tokenizer.encode("Usage grows:")
    body = _completion("Usage grows:", 5, n=2, ignore_eos=True, return_token_ids=True,
                       stream_options={"include_usage": True, "continuous_usage_stats": True})
    *chunks, final = _events(server, "/v1/completions", body)
    so_far = {0: 0, 1: 0}
    for e in chunks:
        (c,) = e["choices"]
        so_far[c["index"]] += len(c["token_ids"])
        assert e["usage"]["prompt_tokens"] == len(prompt_ids)
        assert e["usage"]["completion_tokens"] == so_far[c["index"]]  # that choice's tokens so far
    assert so_far == {0: 5, 1: 5}
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == 10


def test_continuous_usage_stats_must_be_a_bool(server):
    _error(server, "/v1/chat/completions",
           _chat(stream=True, stream_options={"include_usage": True, "continuous_usage_stats": "yes"}),
           "stream_options.continuous_usage_stats")


# --------------------------------------------------------------------------------------------
# truncate_prompt_tokens
# --------------------------------------------------------------------------------------------
def test_completions_truncate_prompt_tokens(server, engine):
    ids = engine.tokenizer.encode("A prompt long enough that keeping only its last tokens changes it.")
    out = _ok(server, "/v1/completions", _completion("A prompt long enough that keeping only its last tokens "
                                                     "changes it.", 6, truncate_prompt_tokens=5, return_token_ids=True,
                                                     ignore_eos=True))
    assert out["usage"]["prompt_tokens"] == 5 and out["choices"][0]["prompt_token_ids"] == ids[-5:]
    same = _ok(server, "/v1/completions", _completion(ids[-5:], 6, ignore_eos=True))
    assert out["choices"][0]["text"] == same["choices"][0]["text"]
    echoed = _ok(server, "/v1/completions", _completion(ids, 2, truncate_prompt_tokens=5, echo=True))
    assert echoed["choices"][0]["text"].startswith(engine.tokenizer.decode(ids[-5:]))  # what the engine was fed
    whole = _ok(server, "/v1/completions", _completion(ids, 2, truncate_prompt_tokens=len(ids) + 10))
    assert whole["usage"]["prompt_tokens"] == len(ids)  # a shorter prompt is kept whole


def test_chat_truncate_prompt_tokens(server, engine):
    ids = _chat_ids(engine, "Only the end of this conversation is read.")
    body = _chat(6, "Only the end of this conversation is read.", truncate_prompt_tokens=7, ignore_eos=True,
                 return_token_ids=True)
    out = _ok(server, "/v1/chat/completions", body)
    assert out["usage"]["prompt_tokens"] == 7 and out["prompt_token_ids"] == ids[-7:]
    assert out["choices"][0]["message"]["content"] == _greedy(engine, ids[-7:], 6, ignore_eos=True)["text"]
    streamed = _events(server, "/v1/chat/completions", body)
    assert streamed[0]["prompt_token_ids"] == ids[-7:]


def test_truncate_prompt_tokens_minus_one_keeps_what_the_context_allows(server, engine):
    context = engine.context_length
    ids = [engine.tokenizer.encode("a")[0]] * (context + 8)
    out = _ok(server, "/v1/completions", _completion(ids, 4, truncate_prompt_tokens=-1))
    assert out["usage"]["prompt_tokens"] == context - 4
    short = _ok(server, "/v1/completions", _completion("Short.", 4, truncate_prompt_tokens=-1))
    assert short["usage"]["prompt_tokens"] == len(engine.tokenizer.encode("Short."))


@pytest.mark.parametrize("value, message", [
    pytest.param(0, "at least 1", id="zero"),
    pytest.param(-2, None, id="below-minus-one"),
    pytest.param("5", None, id="a-string"),
    pytest.param(10**6, "at most the context length", id="more-than-the-context-leaves"),
])
def test_truncate_prompt_tokens_errors_are_400(server, value, message):
    _error(server, "/v1/completions", _completion("x", truncate_prompt_tokens=value), "truncate_prompt_tokens",
           message)
    _error(server, "/v1/chat/completions", _chat(truncate_prompt_tokens=value), "truncate_prompt_tokens", message)


@pytest.mark.parametrize("field, value", [
    ("return_token_ids", "yes"), ("include_stop_str_in_output", 1), ("guided_regex", ["a"]),
    ("guided_choice", "a"),
])
def test_bad_types_are_400(server, field, value):
    _error(server, "/v1/chat/completions", _chat(**{field: value}), field)
