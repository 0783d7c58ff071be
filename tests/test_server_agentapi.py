"""The agent-facing OpenAI features through the official ``openai`` client: ``response_format``
(structured outputs), tools / ``tool_choice`` and reasoning content. Same server as
``test_server_openai`` (a tiny random model: its outputs are not language, so every check is about
structure the grammar or the parser guarantees)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

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
