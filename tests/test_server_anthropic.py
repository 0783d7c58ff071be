"""Anthropic's Messages API (``POST /v1/messages``, ``.../count_tokens``) through the official ``anthropic``
client: the same chat pipeline as ``/v1/chat/completions``, in Anthropic's shapes, whole and streamed."""

from __future__ import annotations

import json

import anthropic
import httpx
import pytest

from hyla.server.app import create_app
from hyla.server.launch import BackgroundServer
from test_server_agentapi import SCRIPTED, SCRIPTED_CALL, script_engine
from test_server_openai import MODEL, client, engine, make_chat_model, server  # noqa: F401  (fixtures)

SYSTEM = "You are a helpful assistant. Answer in one short sentence."
USER = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER = {"name": "get_weather", "description": "The weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
                            "required": ["city"]}}
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def claude(server):
    with anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def _text(message) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


def test_a_message_is_the_chat_completion_underneath(claude, client):
    """The same conversation (system, turns) gives the chat completion's greedy answer, its usage split as
    Anthropic counts it (input tokens not read from the cache, and those read), whole and streamed."""
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "system", "content": SYSTEM}, *USER],
                                          max_tokens=8, temperature=0)
    whole = claude.messages.create(model=MODEL, max_tokens=8, system=SYSTEM, messages=USER, extra_body=GREEDY)
    assert whole.type == "message" and whole.role == "assistant" and whole.model == MODEL
    assert whole.id.startswith("msg_") and _text(whole) == chat.choices[0].message.content
    assert whole.stop_reason == "max_tokens" and whole.usage.output_tokens == 8
    assert whole.usage.input_tokens + whole.usage.cache_read_input_tokens == chat.usage.prompt_tokens
    with claude.messages.stream(model=MODEL, max_tokens=8, system=SYSTEM, messages=USER, extra_body=GREEDY) as stream:
        kinds = [event.type for event in stream]
        streamed = stream.get_final_message()
    assert _text(streamed) == _text(whole) and streamed.stop_reason == "max_tokens"
    assert streamed.usage.input_tokens + streamed.usage.cache_read_input_tokens == chat.usage.prompt_tokens
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "message_delta" in kinds
    assert kinds.count("content_block_start") == kinds.count("content_block_stop") == 1
    assert claude.messages.count_tokens(model=MODEL, system=SYSTEM, messages=USER).input_tokens == \
        chat.usage.prompt_tokens


def test_the_model_list_answers_anthropics_client_too(claude, client):
    (model,) = list(claude.models.list())
    assert (model.id, model.type, model.display_name) == (MODEL, "model", MODEL) and model.created_at.year >= 2025
    assert claude.models.retrieve(MODEL).id == MODEL and [m.id for m in client.models.list()] == [MODEL]


def test_a_stop_sequence_ends_the_answer(claude):
    whole = claude.messages.create(model=MODEL, max_tokens=16, messages=USER, extra_body=GREEDY)
    text = _text(whole)
    stop = text[3:5]
    cut = claude.messages.create(model=MODEL, max_tokens=16, messages=USER, stop_sequences=[stop], extra_body=GREEDY)
    assert (cut.stop_reason, cut.stop_sequence) == ("stop_sequence", stop)
    assert _text(cut) == text[:text.index(stop)]


def test_thinking_text_and_calls_whole_and_streamed(server, claude, engine, monkeypatch):
    """A thinking model's answer with text and two calls (a scripted engine output), with the reasoning parser:
    a thinking block, a text block and two tool_use blocks, the same whole and streamed (each call's input as
    the client accumulates its input_json_delta events, several of them); stop_reason tool_use."""
    from hyla.server.reasoning import ReasoningParser

    state = server.app.state.server
    pieces = [p for piece in SCRIPTED for p in (piece[:len(piece) // 2], piece[len(piece) // 2:]) if p]
    script_engine(monkeypatch, engine, pieces)
    state.reasoning_parser = ReasoningParser("qwen3")
    try:
        whole = claude.messages.create(model=MODEL, max_tokens=64, messages=USER, tools=[WEATHER])
        with claude.messages.stream(model=MODEL, max_tokens=64, messages=USER, tools=[WEATHER]) as stream:
            events = list(stream)
            streamed = stream.get_final_message()
    finally:
        state.reasoning_parser = None
    for message in (whole, streamed):
        assert [b.type for b in message.content] == ["thinking", "text", "tool_use", "tool_use"]
        assert message.content[0].thinking == "hmm, Paris" and message.content[1].text == "Let me check."
        assert [b.input for b in message.content[2:]] == [{"city": 'Paris "Rive Gauche" é', "unit": "C"},
                                                         {"city": 'Oslo "Rive Gauche" é', "unit": "C"}]
        assert message.stop_reason == "tool_use"
    assert [b.id for b in whole.content[2:]] != [b.id for b in streamed.content[2:]]  # (each call its own id)
    deltas = [e.delta.type for e in events if e.type == "content_block_delta"]
    assert deltas.count("input_json_delta") >= 3 and "thinking_delta" in deltas and "text_delta" in deltas


def test_text_between_and_after_calls_is_in_its_own_blocks_whole_and_streamed(claude, engine, monkeypatch):
    """Text before, between and after two calls: a text block for each run, in the output's order, the same
    whole and streamed (cut anywhere, here in and around the markers); the text after a call without its
    leading whitespace, whitespace alone no block. The calls' order among the texts is the output's."""
    call = "<tool_call>\n" + SCRIPTED_CALL + "\n</tool_call>"
    text = "Let me check.\n\n" + call + "\n\nAnd Oslo too. " + call.replace("Paris", "Oslo") + "\n \nDone for now.\n"
    for cut in (3, 7, len(text)):
        script_engine(monkeypatch, engine, [text[i:i + cut] for i in range(0, len(text), cut)])
        whole = claude.messages.create(model=MODEL, max_tokens=64, messages=USER, tools=[WEATHER])
        with claude.messages.stream(model=MODEL, max_tokens=64, messages=USER, tools=[WEATHER]) as stream:
            streamed = stream.get_final_message()
        for message in (whole, streamed):
            assert [b.type for b in message.content] == ["text", "tool_use", "text", "tool_use", "text"], cut
            assert [b.text for b in message.content if b.type == "text"] == ["Let me check.", "And Oslo too.",
                                                                              "Done for now."], cut
            assert [b.input["city"] for b in message.content if b.type == "tool_use"] == \
                ['Paris "Rive Gauche" é', 'Oslo "Rive Gauche" é']
            assert message.stop_reason == "tool_use"
    script_engine(monkeypatch, engine, [call, " \n "])  # (a call, then whitespace alone: no text block)
    assert [b.type for b in claude.messages.create(model=MODEL, max_tokens=64, messages=USER,
                                                   tools=[WEATHER]).content] == ["tool_use"]


def test_arguments_that_are_no_object_are_an_input_object_whole_and_streamed(claude, engine, monkeypatch):
    """A call whose arguments are a list or a string: ``input`` is an object, ``{"arguments": ...}``, whole and
    streamed (the stream sent the bare list, which the client took as the input)."""
    for args, value in (("[1, 2]", [1, 2]), ('"not json"', "not json"), (' {"city": "Oslo"}', None)):
        script_engine(monkeypatch, engine, ['<tool_call>\n{"name": "get_weather", "arguments": ', args[:3], args[3:],
                                            "}\n</tool_call>"])
        whole = claude.messages.create(model=MODEL, max_tokens=64, messages=USER, tools=[WEATHER])
        with claude.messages.stream(model=MODEL, max_tokens=64, messages=USER, tools=[WEATHER]) as stream:
            streamed = stream.get_final_message()
        for message in (whole, streamed):
            assert message.content[-1].input == ({"arguments": value} if value is not None else {"city": "Oslo"})


def test_a_conversation_with_calls_renders_as_the_chat_it_is(claude, client):
    """tool_use and tool_result blocks are the chat's tool_calls and tool messages: the same prompt tokens, and
    the same greedy answer, as the OpenAI conversation they are (tool_choice none: an answer in text)."""
    messages = [*USER, {"role": "assistant", "content": [
                    {"type": "text", "text": "Let me check."},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "21 C", "cache_control":
                        {"type": "ephemeral"}},
                    {"type": "text", "text": "And tomorrow?"}]}]
    counted = claude.messages.count_tokens(model=MODEL, messages=messages, tools=[WEATHER], system=SYSTEM,
                                           tool_choice={"type": "none"})
    chat = [{"role": "system", "content": SYSTEM}, *USER,
            {"role": "assistant", "content": "Let me check.", "tool_calls": [
                {"id": "toolu_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}]},
            {"role": "tool", "tool_call_id": "toolu_1", "content": "21 C"},
            {"role": "user", "content": "And tomorrow?"}]
    tools = [{"type": "function", "function": {"name": WEATHER["name"], "description": WEATHER["description"],
                                               "parameters": WEATHER["input_schema"]}}]
    answer = client.chat.completions.create(model=MODEL, messages=chat, tools=tools, max_tokens=8, temperature=0,
                                            tool_choice="none")
    assert counted.input_tokens == answer.usage.prompt_tokens
    message = claude.messages.create(model=MODEL, max_tokens=8, messages=messages, tools=[WEATHER], system=SYSTEM,
                                     tool_choice={"type": "none"}, extra_body=GREEDY)
    assert _text(message) == answer.choices[0].message.content  # (the same prompt: the same greedy answer)


def test_a_final_assistant_turn_is_a_prefill_the_model_continues(claude, client):
    """Anthropic's prefill: the answer continues the final assistant turn, as a chat completion with
    ``continue_final_message`` continues it (the same prompt and greedy answer)."""
    prefill = [*USER, {"role": "assistant", "content": "The capital is"}]
    message = claude.messages.create(model=MODEL, max_tokens=6, messages=prefill, extra_body=GREEDY)
    chat = client.chat.completions.create(model=MODEL, messages=prefill, max_tokens=6, temperature=0,
                                          extra_body={"continue_final_message": True, "add_generation_prompt": False})
    assert _text(message) == chat.choices[0].message.content
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == chat.usage.prompt_tokens
    opened = claude.messages.create(model=MODEL, max_tokens=6, messages=USER, extra_body=GREEDY)
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens != \
        opened.usage.input_tokens + opened.usage.cache_read_input_tokens


def test_a_forced_call_is_a_tool_use_block(claude):
    tool = {**WEATHER, "input_schema": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}},
                                        "required": ["city"], "additionalProperties": False}}
    for choice in ({"type": "any", "disable_parallel_tool_use": True},
                   {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}):
        message = claude.messages.create(model=MODEL, max_tokens=64, messages=USER, tools=[tool], tool_choice=choice,
                                         extra_body=GREEDY)
        (call,) = [b for b in message.content if b.type == "tool_use"]
        assert call.name == "get_weather" and call.input["city"] in ("Paris", "Oslo")
        assert message.stop_reason == "tool_use"


def test_output_config_format_constrains_the_answer(claude):
    schema = {"type": "object", "properties": {"answer": {"enum": ["Paris", "Lyon"]}}, "required": ["answer"],
              "additionalProperties": False}
    message = claude.messages.create(model=MODEL, max_tokens=64, messages=USER, extra_body={
        **GREEDY, "output_config": {"format": {"type": "json_schema", "schema": schema}}})
    assert json.loads(_text(message))["answer"] in ("Paris", "Lyon") and message.stop_reason == "end_turn"


@pytest.mark.parametrize("body, status, kind, words", [
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}, 400, "invalid_request_error",
     "messages.0.content: a content block of type 'document'"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "file", "file_id": "f"}}]}]},
     400, "invalid_request_error", "messages.0.content: an image source of type 'file' is not supported"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search", "input_schema": {}}]}, 400,
     "invalid_request_error", "tools.0.type"),
    ({"container": "c1"}, 400, "invalid_request_error", "container is not supported"),
    ({"mcp_servers": [{"type": "url", "url": "https://x", "name": "x"}]}, 400, "invalid_request_error",
     "mcp_servers is not supported"),
    ({"max_tokens": 0}, 400, "invalid_request_error", "max_tokens"),
    ({"model": "claude-sonnet"}, 404, "not_found_error", "claude-sonnet"),
    ({"tool_choice": {"type": "any"}}, 400, "invalid_request_error", "tool_choice needs tools"),
    # the engine's refusals name Anthropic's fields
    ({"stop_sequences": [""]}, 400, "invalid_request_error", "stop_sequences: stop strings must be non-empty"),
    ({"output_config": {"format": {"type": "json_schema", "schema": {"type": "nope"}}}}, 400,
     "invalid_request_error", "output_config.format: "),
    ({"tools": [{"name": "f", "input_schema": {"type": "object", "properties": {"a": {"type": "string", "pattern": "(("}}}}],
      "tool_choice": {"type": "tool", "name": "f"}}, 400, "invalid_request_error", "tools: "),
])
def test_errors_have_anthropics_shape(server, body, status, kind, words):
    payload = {"model": MODEL, "max_tokens": 4, "messages": USER, **body}
    r = httpx.post(server.url + "/v1/messages", json=payload, timeout=60)
    assert r.status_code == status, r.text
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == kind and words in r.json()["error"]["message"]


def test_errors_before_the_route_have_anthropics_shape_too(server):
    """A body nested too deep for Python to read (was a 500), a body over --max-request-bytes (its declared
    length: answered before the route), a method the path does not take: Anthropic's shape on its paths,
    OpenAI's elsewhere."""
    import socket

    deep = b'{"model": "m", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        r = httpx.post(server.url + path, content=deep, headers={"content-type": "application/json"}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
    assert httpx.get(server.url + "/v1/messages", timeout=60).json()["error"]["type"] == "invalid_request_error"
    host, port = server.url.removeprefix("http://").split(":")
    for path, shape in (("/v1/messages", "type"), ("/v1/chat/completions", "error")):
        with socket.create_connection((host, int(port)), timeout=60) as sock:
            sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         f"Content-Length: {10 ** 12}\r\n\r\n".encode())
            answer = b""
            while b"}" not in answer.rpartition(b"\r\n\r\n")[2]:
                answer += sock.recv(65536)
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 413"), head
        assert list(json.loads(body))[0] == shape and "larger than" in body.decode(), body


def test_unknown_fields_are_ignored_as_claude_code_sends_them(claude):
    """What a newer client sends and hyla does not know (cache_control on the request, a tool's strict...)
    changes nothing."""
    plain = claude.messages.create(model=MODEL, max_tokens=6, messages=USER, extra_body=GREEDY)
    extra = claude.messages.create(model=MODEL, max_tokens=6, messages=USER, metadata={"user_id": "u"},
                                   extra_body={**GREEDY, "cache_control": {"type": "ephemeral"}, "speed": "fast",
                                               "output_config": {"effort": "low"}})
    assert _text(extra) == _text(plain)


def test_a_request_shaped_as_claude_codes_is_served(server):
    """What Claude Code sends: the beta query, its headers, system blocks and content blocks with cache_control,
    tools whose schemas carry ``$schema``, thinking with a budget, metadata, a streamed answer."""
    tool = {"name": "Read", "description": "Read a file.", "input_schema": {
        "$schema": "http://json-schema.org/draft-07/schema#", "type": "object",
        "properties": {"file_path": {"type": "string"}}, "required": ["file_path"], "additionalProperties": False}}
    body = {"model": MODEL, "max_tokens": 8, "stream": True, "temperature": 1, "metadata": {"user_id": "user_x"},
            "system": [{"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}}],
            "messages": [{"role": "user", "content": [{"type": "text", "text": "Read a.py",
                                                       "cache_control": {"type": "ephemeral"}}]}],
            "tools": [tool], "thinking": {"type": "enabled", "budget_tokens": 1024}}
    headers = {"anthropic-version": "2023-06-01", "anthropic-beta": "interleaved-thinking-2025-05-14",
               "x-api-key": "unused"}
    with httpx.stream("POST", server.url + "/v1/messages?beta=true", json=body, headers=headers, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        kinds = [line.removeprefix("event: ") for line in r.iter_lines() if line.startswith("event: ")]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]


def test_the_api_key_is_anthropics_header_or_a_bearer_token(tiny_ckpt_dir):
    app = create_app(make_chat_model(tiny_ckpt_dir / "keyed"), served_model_name=MODEL, api_key="sekret",
                     max_total_tokens=2048, max_state_slots=8)
    body = {"model": MODEL, "max_tokens": 2, "messages": USER}
    with BackgroundServer(app) as srv:
        with anthropic.Anthropic(base_url=srv.url, api_key="sekret", max_retries=0) as good:
            assert good.messages.create(**body).usage.output_tokens == 2  # (x-api-key)
        assert httpx.post(srv.url + "/v1/messages", json=body, headers={"Authorization": "Bearer sekret"},
                          timeout=60).status_code == 200
        with anthropic.Anthropic(base_url=srv.url, api_key="wrong", max_retries=0) as bad:
            with pytest.raises(anthropic.AuthenticationError) as refused:
                bad.messages.create(**body)
        assert refused.value.body["error"]["type"] == "authentication_error"
