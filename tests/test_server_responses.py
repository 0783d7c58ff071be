"""OpenAI's Responses API (``/v1/responses``) through the official ``openai`` client and raw httpx.
Same server as ``test_server_openai`` (a tiny random model: its outputs are not language, so every
check compares a response with the chat completion underneath, with itself streamed, or with the
structure a grammar or the parsers guarantee)."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import openai
import pytest

from test_server_openai import MODEL, SYSTEM, client, engine, server  # noqa: F401  (fixtures)
from test_server_agentapi import SCRIPTED, SCRIPTED_CALL, opens_thinking_parser, script_engine
from hyla.server.responses_protocol import (FunctionCallItem, FunctionCallOutputItem, MessageItem, ReasoningItem,
                                           output_item_id, response_of_item)
from hyla.server.responses_routes import (ResponseStore, ResponsesRoutes, StoredResponse, items_to_messages,
                                         output_items, stored_size)
from hyla.server.tool_calls import ToolCall

INSTRUCTIONS = SYSTEM["content"]
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]},
                                                           "unit": {"enum": ["C", "F"]}},
                          "required": ["city", "unit"], "additionalProperties": False}}
# a schema the request's validation lets through (a pattern is a string) and the grammar compiler refuses
BAD_PATTERN = {"type": "function", "name": "lookup", "parameters": {
    "type": "object", "properties": {"code": {"type": "string", "pattern": "(["}}, "required": ["code"]}}
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]}},
          "required": ["ok", "color"], "additionalProperties": False}


def _post(server, body: dict) -> httpx.Response:
    return httpx.post(server.url + "/v1/responses", json={"model": MODEL, **body}, timeout=60)


def _stream_events(server, body: dict) -> list[tuple[str, dict]]:
    """``(event line's name, data)`` of each event of a streamed response."""
    events, name = [], None
    with httpx.stream("POST", server.url + "/v1/responses", json={"model": MODEL, "stream": True, **body},
                      timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: "):
                events.append((name, json.loads(line[len("data: "):])))
                name = None
    return events


def _without_ids(response: dict) -> dict:
    """A response with what differs between two runs of one request left out: ids, time, cache hits."""
    out = {k: v for k, v in response.items() if k not in ("id", "created_at")}
    out["output"] = [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in response["output"]]
    out["usage"] = {**response["usage"], "input_tokens_details": None}
    return out


# --------------------------------------------------------------------------------------------
# a response is the chat completion underneath
# --------------------------------------------------------------------------------------------
def test_response_is_the_chat_completion(client):
    r = client.responses.create(model=MODEL, input="What is the capital of France?", instructions=INSTRUCTIONS,
                                max_output_tokens=8, temperature=0)
    chat = client.chat.completions.create(model=MODEL, messages=[SYSTEM, {"role": "user", "content":
                                                                          "What is the capital of France?"}],
                                          max_tokens=8, temperature=0)
    assert r.id.startswith("resp_") and r.object == "response" and r.model == MODEL
    assert r.instructions == INSTRUCTIONS and r.previous_response_id is None and r.error is None
    (item,) = r.output
    assert item.type == "message" and item.role == "assistant" and item.id.startswith("msg_")
    assert [c.type for c in item.content] == ["output_text"] and item.content[0].annotations == []
    assert r.output_text == chat.choices[0].message.content  # (output_text: the SDK's join of the text parts)
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.usage.output_tokens_details.reasoning_tokens == 0
    assert r.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    assert r.max_output_tokens == 8 and r.temperature == 0 and r.tool_choice == "auto" and r.tools == []
    assert r.store is True and r.text.format.type == "text"


def test_max_output_tokens_is_incomplete(client, server):
    r = client.responses.create(model=MODEL, input="Tell me a long story.", max_output_tokens=3, temperature=0)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3 and r.output[0].status == "incomplete"
    events = _stream_events(server, {"input": "Tell me a long story.", "max_output_tokens": 3, "temperature": 0})
    assert events[-1][1]["type"] == "response.incomplete"
    assert _without_ids(events[-1][1]["response"]) == _without_ids(r.model_dump(exclude_unset=True))


# --------------------------------------------------------------------------------------------
# streaming
# --------------------------------------------------------------------------------------------
def test_streaming_final_response_is_the_non_streaming_one(server, client):
    body = {"input": "Tell me about rivers.", "instructions": INSTRUCTIONS, "max_output_tokens": 12,
            "temperature": 0, "metadata": {"k": "v"}}
    full = _post(server, body).json()
    events = _stream_events(server, body)
    names = [name for name, _ in events]
    data = [d for _, d in events]
    assert names == [d["type"] for d in data]  # an event: line names each event
    assert [d["sequence_number"] for d in data] == list(range(len(data)))
    types = [d["type"] for d in data]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed" if full["status"] == "completed" else "response.incomplete"]
    assert set(types[4:-4]) == {"response.output_text.delta"}
    assert data[0]["response"]["status"] == "in_progress" and data[0]["response"]["output"] == []
    final = data[-1]["response"]
    assert _without_ids(final) == _without_ids(full)
    deltas = "".join(d["delta"] for d in data if d["type"] == "response.output_text.delta")
    assert deltas == final["output"][0]["content"][0]["text"] == data[-4]["text"]
    msg_id = final["output"][0]["id"]
    assert all(d["item_id"] == msg_id for d in data if "item_id" in d)
    assert final["metadata"] == {"k": "v"}

    # the official client parses the same stream
    stream = client.responses.create(model=MODEL, stream=True, **body)
    parsed = list(stream)
    # (as many deltas as the server's chunks: a slow reader gets chunks merged, so the count may differ)
    def squash(ts: list[str]) -> list[str]:
        return [t for i, t in enumerate(ts) if not (i and t == ts[i - 1] == "response.output_text.delta")]

    assert squash([e.type for e in parsed]) == squash(types)
    assert "".join(e.delta for e in parsed if e.type == "response.output_text.delta") == deltas
    assert parsed[-1].response.output_text == full["output"][0]["content"][0]["text"]
    # ...and so does its stream helper, which rebuilds the output items from the events (its
    # get_final_response() needs a response.completed: this answer stops at max_output_tokens)
    with client.responses.stream(model=MODEL, **body) as helper:
        seen = list(helper)
    assert "".join(e.delta for e in seen if e.type == "response.output_text.delta") == deltas
    assert seen[-1].type == types[-1] and seen[-1].response.output_text == deltas



def test_streamed_reasoning_text_and_calls_are_the_response(server, engine, monkeypatch):
    """A scripted answer (reasoning, text, two calls, markers cut across chunks): each item's deltas
    joined are its ``.done`` text and the non-streamed response's, the events come in output order,
    and the final response is the non-streamed one."""
    from hyla.server.reasoning import ReasoningParser
    state = server.app.state.server
    script_engine(monkeypatch, engine, SCRIPTED)
    state.reasoning_parser = ReasoningParser("qwen3")
    body = {"input": "What is the weather in Paris?", "tools": [WEATHER]}
    try:
        full = _post(server, body).json()
        data = [d for _, d in _stream_events(server, body)]
    finally:
        state.reasoning_parser = None
    assert [o["type"] for o in full["output"]] == ["reasoning", "message", "function_call", "function_call"]
    assert _without_ids(data[-1]["response"]) == _without_ids(full)
    for kind, item, text in (("reasoning_text", full["output"][0], "hmm, Paris"),
                             ("output_text", full["output"][1], "Let me check.")):
        deltas = "".join(d["delta"] for d in data if d["type"] == f"response.{kind}.delta")
        (done,) = [d["text"] for d in data if d["type"] == f"response.{kind}.done"]
        assert deltas == done == item["content"][0]["text"] == text
    added = [d["output_index"] for d in data if d["type"] == "response.output_item.added"]
    assert added == [0, 1, 2, 3]
    args = [d["arguments"] for d in data if d["type"] == "response.function_call_arguments.done"]
    assert args == [o["arguments"] for o in full["output"][2:]]
    # the reasoning and the message are done before the first call opens; the items are done in output order
    done = [d["output_index"] for d in data if d["type"] == "response.output_item.done"]
    first_call = next(i for i, d in enumerate(data) if d["type"] == "response.output_item.added"
                      and d["item"]["type"] == "function_call")
    assert done == [0, 1, 2, 3]
    assert [d["output_index"] for d in data[:first_call] if d["type"] == "response.output_item.done"] == [0, 1]


def _streamed_calls(data: list[dict]) -> dict[int, str]:
    """Each call item's arguments deltas joined, by output index."""
    out: dict[int, str] = {}
    for d in data:
        if d["type"] == "response.function_call_arguments.delta":
            out[d["output_index"]] = out.get(d["output_index"], "") + d["delta"]
    return out


def test_a_call_streams_its_arguments_as_they_are_written(server, client, engine, monkeypatch):
    """A call written a few characters at a time: its item opens once its name is written, long before
    its block closes, and each chunk of its arguments goes out as it comes (joined, the ``.done``
    arguments and the whole response's); the official client's stream helper rebuilds the response."""
    call = '<tool_call>\n' + SCRIPTED_CALL + '\n</tool_call>'
    pieces = ["Checking.\n"] + [call[i:i + 4] for i in range(0, len(call), 4)]
    script_engine(monkeypatch, engine, pieces)
    body = {"input": "What is the weather in Paris?", "tools": [WEATHER]}
    full = _post(server, body).json()
    data = [d for _, d in _stream_events(server, body)]
    assert _without_ids(data[-1]["response"]) == _without_ids(full)
    assert [o["type"] for o in full["output"]] == ["message", "function_call"]
    types = [d["type"] for d in data]
    added = types.index("response.output_item.added", types.index("response.output_item.done"))
    assert data[added]["item"]["name"] == "get_weather" and data[added]["item"]["call_id"] == data[-1]["response"]["output"][1]["call_id"]
    deltas = [d["delta"] for d in data if d["type"] == "response.function_call_arguments.delta"]
    assert len(deltas) > 10  # (~70 characters of arguments in 4-character chunks)
    assert _streamed_calls(data) == {1: full["output"][1]["arguments"]}
    assert json.loads(full["output"][1]["arguments"])["city"] == 'Paris "Rive Gauche" é'
    with client.responses.stream(model=MODEL, **body) as helper:
        final = helper.get_final_response()
    assert [o.type for o in final.output] == ["message", "function_call"]
    assert final.output[1].arguments == full["output"][1]["arguments"] and final.output_text == "Checking."


def test_text_after_a_call_is_a_second_message(server, client, engine, monkeypatch):
    """Text the model writes after a call began cannot go in the message, which a stream finished when the
    call began: it is held to the end and sent as a second message after the calls, which the final and the
    stored response hold too, and so does the whole response (the same items as the stream's)."""
    script_engine(monkeypatch, engine, ["Let me check.\n<tool_call>\n", SCRIPTED_CALL, "\n</tool_call>\n",
                                        "Done", " for now."])
    body = {"input": "What is the weather in Paris?", "tools": [WEATHER]}
    full = _post(server, body).json()
    assert [o["type"] for o in full["output"]] == ["message", "function_call", "message"]
    assert [o["content"][0]["text"] for o in full["output"] if o["type"] == "message"] == ["Let me check.",
                                                                                            "Done for now."]
    data = [d for _, d in _stream_events(server, body)]
    final = data[-1]["response"]
    assert [o["type"] for o in final["output"]] == ["message", "function_call", "message"]
    assert [o["content"][0]["text"] for o in final["output"] if o["type"] == "message"] == ["Let me check.",
                                                                                             "Done for now."]
    assert final["output"][2]["id"] == final["output"][0]["id"] + "_1"
    assert _without_ids(final) == _without_ids(full)
    texts: dict[int, str] = {}
    for d in data:
        if d["type"] == "response.output_text.delta":
            texts[d["output_index"]] = texts.get(d["output_index"], "") + d["delta"]
    assert texts == {0: "Let me check.", 2: "Done for now."}  # (the second's leading whitespace is layout)
    assert [d["output_index"] for d in data if d["type"] == "response.output_item.done"] == [0, 1, 2]
    assert httpx.get(f"{server.url}/v1/responses/{final['id']}", timeout=30).json()["output"] == final["output"]
    with client.responses.stream(model=MODEL, **body) as helper:
        assert helper.get_final_response().output_text == "Let me check.Done for now."
    # the whole answer in one chunk (several tokens a step, as speculative decoding sends them): the same items
    script_engine(monkeypatch, engine, ["Let me check.\n<tool_call>\n" + SCRIPTED_CALL + "\n</tool_call>\nDone for now."])
    data = [d for _, d in _stream_events(server, body)]
    assert _without_ids(data[-1]["response"])["output"] == _without_ids(full)["output"]
    assert [(d["output_index"], d["delta"]) for d in data if d["type"] == "response.output_text.delta"] == \
        [(0, "Let me check."), (2, "Done for now.")]


def test_a_call_cut_off_in_its_arguments_stays_a_call_when_streamed(server, engine, monkeypatch):
    """``max_output_tokens`` cuts a call inside its arguments: the stream began the call and cannot take
    it back, so its response ends with that call, its arguments as sent (the whole response keeps the
    unfinished block as text, as a chat completion does)."""
    cut = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'
    script_engine(monkeypatch, engine, [cut[:20], cut[20:]], finish="length")
    body = {"input": "What is the weather in Paris?", "tools": [WEATHER]}
    full = _post(server, body).json()
    assert full["status"] == "incomplete" and [o["type"] for o in full["output"]] == ["message"]
    data = [d for _, d in _stream_events(server, body)]
    final = data[-1]
    assert final["type"] == "response.incomplete"
    (call,) = final["response"]["output"]
    assert call["type"] == "function_call" and call["name"] == "get_weather" and call["status"] == "incomplete"
    assert call["arguments"] == _streamed_calls(data)[0] == '{"city": "Par'
    assert full["output"][0]["status"] == "incomplete"  # (the whole response's text, where it was cut off)


def test_the_item_an_output_was_cut_off_in_is_the_incomplete_one(server, engine, monkeypatch):
    """Cut off by ``max_output_tokens`` after a whole call, in text: the message holding that text is
    incomplete, the call completed (the message after the call, whole and streamed)."""
    script_engine(monkeypatch, engine, ["<tool_call>\n" + SCRIPTED_CALL + "\n</tool_call>\n", "Done so"],
                  finish="length")
    body = {"input": "What is the weather in Paris?", "tools": [WEATHER]}
    full = _post(server, body).json()
    final = _stream_events(server, body)[-1][1]["response"]
    for response in (full, final):
        assert [(o["type"], o["status"]) for o in response["output"]] == [("function_call", "completed"),
                                                                          ("message", "incomplete")]


def test_without_parallel_tool_calls_a_stream_sends_the_first_call_alone(server, engine, monkeypatch):
    script_engine(monkeypatch, engine, SCRIPTED)
    body = {"input": "What is the weather in Paris?", "tools": [WEATHER], "parallel_tool_calls": False}
    full = _post(server, body).json()
    data = [d for _, d in _stream_events(server, body)]
    assert [o["type"] for o in full["output"]] == ["message", "function_call"]
    assert _without_ids(data[-1]["response"]) == _without_ids(full)
    assert _streamed_calls(data) == {1: full["output"][1]["arguments"]}
    assert "Oslo" not in json.dumps([d for d in data if "response" not in d])  # (the tools' enum has it)


def test_a_call_escaping_a_lone_surrogate_is_a_response(server, engine, monkeypatch):
    """A call whose JSON escapes a lone surrogate: a response whole and streamed (it was a 500, and a
    stream cut off mid-way: the answer could not be encoded)."""
    script_engine(monkeypatch, engine, ['<tool_call>\n{"name": "get_weather", "arguments": {"city": "\\ud800"}}',
                                        "\n</tool_call>"])
    body = {"input": "What is the weather in Paris?", "tools": [WEATHER]}
    r = _post(server, body)
    assert r.status_code == 200, r.text
    (call,) = r.json()["output"]
    assert json.loads(call["arguments"]) == {"city": "\ud800"}
    events = _stream_events(server, body)
    assert events[-1][1]["type"] == "response.completed"
    assert events[-1][1]["response"]["output"][0]["arguments"] == call["arguments"]

# --------------------------------------------------------------------------------------------
# previous_response_id, instructions, store, GET
# --------------------------------------------------------------------------------------------
def test_previous_response_id_continues_the_conversation_from_the_cache(client):
    instructions = "Conversation test R: you are terse."
    r1 = client.responses.create(model=MODEL, input="First question?", instructions=instructions,
                                 max_output_tokens=6, temperature=0)
    r2 = client.responses.create(model=MODEL, input="And a follow-up?", instructions=instructions,
                                 previous_response_id=r1.id, max_output_tokens=6, temperature=0)
    assert r2.previous_response_id == r1.id
    # the same conversation through chat completions: the same prompt, the same answer
    system = {"role": "system", "content": instructions}
    turn2 = [system, {"role": "user", "content": "First question?"}, {"role": "assistant", "content": r1.output_text},
             {"role": "user", "content": "And a follow-up?"}]
    chat = client.chat.completions.create(model=MODEL, messages=turn2, max_tokens=6, temperature=0)
    assert r2.usage.input_tokens == chat.usage.prompt_tokens
    assert r2.output_text == chat.choices[0].message.content
    # the second turn's prompt starts with the first turn's prompt and answer, token for token: the
    # cache holds all of it (but the last output token, which was sampled, never fed back)
    cached = r2.usage.input_tokens_details.cached_tokens
    assert r1.usage.input_tokens + r1.usage.output_tokens - 1 <= cached < r2.usage.input_tokens


def test_instructions_are_not_carried_over(client):
    r1 = client.responses.create(model=MODEL, input="Hello there.", instructions="Instructions test S.",
                                 max_output_tokens=4, temperature=0)
    r2 = client.responses.create(model=MODEL, input="Again.", previous_response_id=r1.id, max_output_tokens=4,
                                 temperature=0)
    assert r2.instructions is None
    without = [{"role": "user", "content": "Hello there."}, {"role": "assistant", "content": r1.output_text},
               {"role": "user", "content": "Again."}]
    chat = client.chat.completions.create(model=MODEL, messages=without, max_tokens=4, temperature=0)
    assert r2.usage.input_tokens == chat.usage.prompt_tokens
    assert r2.output_text == chat.choices[0].message.content


def test_get_a_stored_response_and_store_false(server, client):
    r = client.responses.create(model=MODEL, input="Remember me.", max_output_tokens=4, temperature=0)
    got = client.responses.retrieve(r.id)
    assert got.model_dump() == r.model_dump()
    raw = httpx.get(f"{server.url}/v1/responses/{r.id}")
    assert raw.status_code == 200 and raw.json()["id"] == r.id

    unstored = client.responses.create(model=MODEL, input="Forget me.", max_output_tokens=4, temperature=0,
                                       store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.retrieve(unstored.id)
    assert info.value.status_code == 404 and info.value.body["code"] == "response_not_found"
    missing = httpx.get(f"{server.url}/v1/responses/resp_nope")
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"
    # an unstored response cannot be continued (OpenAI: 400 previous_response_not_found)
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=MODEL, input="Go on.", previous_response_id=unstored.id, max_output_tokens=2)
    assert info.value.body["param"] == "previous_response_id"
    assert info.value.body["code"] == "previous_response_not_found"
    # a deleted response is gone: neither retrieved nor continued; a second delete is a 404
    deleted = httpx.delete(f"{server.url}/v1/responses/{r.id}")
    assert deleted.status_code == 200 and deleted.json() == {"id": r.id, "object": "response", "deleted": True}
    assert httpx.get(f"{server.url}/v1/responses/{r.id}").status_code == 404
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model=MODEL, input="Go on.", previous_response_id=r.id, max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(r.id)


def test_retrieving_a_response_as_a_stream_is_400(server, client):
    """The client's ``retrieve(id, stream=True)`` (OpenAI's, for a background response still running)
    got the JSON, which the client read as a stream of no events: a 400 naming ``stream``."""
    r = client.responses.create(model=MODEL, input="Stream me back.", max_output_tokens=2, temperature=0)
    with pytest.raises(openai.BadRequestError) as info:
        list(client.responses.retrieve(r.id, stream=True))
    assert info.value.body["param"] == "stream" and info.value.body["type"] == "invalid_request_error"
    assert httpx.get(f"{server.url}/v1/responses/{r.id}", params={"stream": "false"}).json()["id"] == r.id
    bad = httpx.get(f"{server.url}/v1/responses/{r.id}", params={"stream": "maybe"})
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error", bad.text


def test_item_references_are_the_stored_output_items(server, client, engine, monkeypatch):
    """An ``item_reference`` (the SDK's input item type; what the Vercel AI SDK sends with ``store`` in
    place of an earlier response's items) was a 400: it is the stored output item it names, the same
    prompt as the item copied back; ``type`` may be left out, as the SDK's type allows. One naming no
    stored item (unknown, or its response deleted) is a 400 naming ``input.<i>.id``."""
    from hyla.server.reasoning import ReasoningParser

    state = server.app.state.server
    with monkeypatch.context() as scripted:
        script_engine(scripted, engine, SCRIPTED)
        state.reasoning_parser = ReasoningParser("qwen3")
        try:
            first = client.responses.create(model=MODEL, input="What is the weather in Paris?", tools=[WEATHER])
        finally:
            state.reasoning_parser = None
    assert [o.type for o in first.output] == ["reasoning", "message", "function_call", "function_call"]
    ask = {"role": "user", "content": "What is the weather in Paris?"}
    answers = [_call_output(o.call_id) for o in first.output if o.type == "function_call"]
    common = {"model": MODEL, "tools": [WEATHER], "max_output_tokens": 4, "temperature": 0}
    copied = client.responses.create(input=[ask, *[o.model_dump(exclude_none=True) for o in first.output], *answers],
                                     **common)
    refs = [{"type": "item_reference", "id": o.id} for o in first.output]
    referenced = client.responses.create(input=[ask, *refs, *answers], **common)
    assert referenced.usage.input_tokens == copied.usage.input_tokens and referenced.output_text == copied.output_text
    untyped = client.responses.create(input=[ask, *[{"id": o.id} for o in first.output], *answers], **common)
    assert untyped.usage.input_tokens == copied.usage.input_tokens

    def refused(item_id: str) -> None:
        r = _post(server, {"input": [ask, {"type": "item_reference", "id": item_id}], "max_output_tokens": 2})
        assert r.status_code == 400, r.text
        assert r.json()["error"] == {"message": f"Item with id {item_id!r} not found.",
                                     "type": "invalid_request_error", "param": "input.1.id", "code": None}

    refused("msg_unknown")
    client.responses.delete(first.id)
    refused(first.output[1].id)


def test_response_store_finds_the_output_items_of_the_responses_it_holds():
    store = ResponseStore(capacity=2)
    for rid in ("a", "b"):
        store.put(StoredResponse({"id": rid, "output": [{"type": "message", "id": f"msg_{rid}"}]}, []))
    assert store.output_item("msg_a") == {"type": "message", "id": "msg_a"}
    store.put(StoredResponse({"id": "c", "output": [{"type": "message", "id": "msg_c"}]}, []))  # "a" is dropped
    assert store.output_item("msg_a") is None and store.output_item("msg_c") is not None
    assert store.delete("b") and store.output_item("msg_b") is None


def test_response_store_is_bounded_lru():
    store = ResponseStore(capacity=2)
    for rid in ("a", "b"):
        store.put(StoredResponse({"id": rid}, []))
    assert store.get("a") is not None  # "a" is now the most recently used
    store.put(StoredResponse({"id": "c"}, []))
    assert len(store) == 2 and store.get("b") is None and store.get("a") is not None and store.get("c") is not None


def _sized(rid: str, chars: int) -> StoredResponse:
    """A stored response whose ``stored_size`` is ``chars`` plus what its id and keys count."""
    return StoredResponse({"id": rid}, [{"role": "user", "content": "x" * chars}])


def test_response_store_is_bounded_in_bytes():
    """Beside the count, the store keeps at most ``max_bytes`` of responses (``stored_size``: the text
    of the response and its whole conversation), the least recently used dropped first; the one stored
    last stays even where it alone is larger; a delete gives its bytes back."""
    small = stored_size(_sized("a", 1000))
    store = ResponseStore(capacity=100, max_bytes=2 * small)
    for rid in ("a", "b"):
        store.put(_sized(rid, 1000))
    assert len(store) == 2 and store.bytes == 2 * small
    assert store.get("a") is not None  # "a" is now the most recently used
    store.put(_sized("c", 1000))  # over the bytes, not the count: "b" goes
    assert store.get("b") is None and store.get("a") is not None and store.get("c") is not None
    assert store.bytes == 2 * small
    store.put(_sized("huge", 10 * small))  # alone larger than the cap: kept, alone
    assert len(store) == 1 and store.get("huge") is not None and store.bytes == stored_size(_sized("huge", 10 * small))
    assert store.delete("huge") and store.bytes == 0 and len(store) == 0
    store.put(_sized("d", 1000))
    store.put(_sized("d", 1000))  # stored again under its id: counted once
    assert len(store) == 1 and store.bytes == small
    assert ResponsesRoutes(None, max_stored=7, max_stored_bytes=small).store.max_bytes == small


def test_the_store_limits_reach_the_server(tiny_ckpt_dir):
    """``create_app(max_stored_responses=..., max_stored_response_bytes=...)`` (``hyla serve
    --max-stored-responses``, ``--max-stored-response-bytes``) bound the server's store: with one kept,
    the first of two stored responses is gone and the second can be read and continued."""
    from hyla.server.app import create_app
    from hyla.server.launch import BackgroundServer
    from test_server_openai import make_chat_model

    app = create_app(make_chat_model(tiny_ckpt_dir), served_model_name=MODEL, max_total_tokens=4096,
                     max_state_slots=16, max_stored_responses=1, max_stored_response_bytes=10_000)
    with BackgroundServer(app) as srv:
        ids = [_post(srv, {"model": MODEL, "input": f"Turn {i}", "max_output_tokens": 2}).json()["id"] for i in range(2)]
        assert [httpx.get(f"{srv.url}/v1/responses/{rid}").status_code for rid in ids] == [404, 200]
        later = _post(srv, {"model": MODEL, "input": "Again", "previous_response_id": ids[1], "max_output_tokens": 2})
        assert later.status_code == 200


@pytest.mark.parametrize("limits", [{"capacity": -1}, {"max_bytes": -1}, {"max_bytes": 1.5}, {"capacity": True},
                                    {"max_bytes": "1"}])
def test_response_store_limits_are_checked(limits):
    with pytest.raises(ValueError, match="must be a non-negative integer"):
        ResponseStore(**limits)


# --------------------------------------------------------------------------------------------
# tools, text.format
# --------------------------------------------------------------------------------------------
def _check_call(item) -> None:
    assert item.type == "function_call" and item.id.startswith("fc_") and item.call_id.startswith("call_")
    assert item.name == "get_weather" and item.status == "completed"
    args = json.loads(item.arguments)
    assert args["city"] in ("Paris", "Oslo") and args["unit"] in ("C", "F")


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "name": "get_weather"}],
                         ids=["required", "named"])
def test_forced_function_call_and_its_output(server, client, tool_choice):
    ask = "What is the weather in Paris?"
    r = client.responses.create(model=MODEL, input=ask, instructions=INSTRUCTIONS, tools=[WEATHER],
                                tool_choice=tool_choice, parallel_tool_calls=False, max_output_tokens=64,
                                temperature=0)
    assert r.status == "completed"
    (call,) = r.output
    _check_call(call)
    # the same call through chat completions
    chat = client.chat.completions.create(
        model=MODEL, messages=[SYSTEM, {"role": "user", "content": ask}], max_tokens=64, temperature=0,
        tools=[{"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}],
        tool_choice="required", parallel_tool_calls=False)
    assert chat.choices[0].message.tool_calls[0].function.arguments == call.arguments
    assert r.usage.input_tokens == chat.usage.prompt_tokens

    # streamed: the call's events, and the same final response
    events = [d for _, d in _stream_events(server, {
        "input": ask, "instructions": INSTRUCTIONS, "tools": [WEATHER], "tool_choice": tool_choice,
        "parallel_tool_calls": False, "max_output_tokens": 64, "temperature": 0})]
    types = [d["type"] for d in events]
    deltas = types.count("response.function_call_arguments.delta")
    assert deltas > 1  # (the arguments as they are written)
    assert types == ["response.created", "response.in_progress", "response.output_item.added",
                     *["response.function_call_arguments.delta"] * deltas, "response.function_call_arguments.done",
                     "response.output_item.done", "response.completed"]
    assert events[2]["item"]["name"] == "get_weather" and events[2]["item"]["status"] == "in_progress"
    assert "".join(d["delta"] for d in events[3:-3]) == events[-3]["arguments"] == call.arguments
    assert events[-3]["name"] == "get_weather"
    assert _without_ids(events[-1]["response"]) == _without_ids(r.model_dump(exclude_unset=True))
    with client.responses.stream(model=MODEL, input=ask, instructions=INSTRUCTIONS, tools=[WEATHER],
                                 tool_choice=tool_choice, parallel_tool_calls=False, max_output_tokens=64,
                                 temperature=0) as helper:
        (streamed_call,) = helper.get_final_response().output
    assert streamed_call.arguments == call.arguments and streamed_call.name == call.name

    # the result, by previous_response_id: the call and its output render in the next turn
    result = {"type": "function_call_output", "call_id": call.call_id, "output": '{"temperature": 21}'}
    r2 = client.responses.create(model=MODEL, previous_response_id=r.id, input=[result], tools=[WEATHER],
                                 instructions=INSTRUCTIONS, max_output_tokens=8, temperature=0)
    assert r2.status in ("completed", "incomplete") and r2.usage.input_tokens > r.usage.input_tokens
    assert r2.usage.input_tokens_details.cached_tokens >= r.usage.input_tokens + r.usage.output_tokens - 1
    # ... and the same turn sent whole (the output items copied back, as clients do) is the same prompt
    again = client.responses.create(model=MODEL, input=[{"role": "user", "content": ask}, *[
        o.model_dump(exclude_none=True) for o in r.output], result], tools=[WEATHER], instructions=INSTRUCTIONS,
        max_output_tokens=8, temperature=0)
    assert again.usage.input_tokens == r2.usage.input_tokens and again.output_text == r2.output_text
    follow = client.chat.completions.create(
        model=MODEL, max_tokens=8, temperature=0,
        tools=[{"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}],
        messages=[SYSTEM, {"role": "user", "content": ask}, {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
            {"role": "tool", "tool_call_id": call.call_id, "content": '{"temperature": 21}'}])
    assert follow.usage.prompt_tokens == r2.usage.input_tokens


def _call_output(call_id: str) -> dict:
    return {"type": "function_call_output", "call_id": call_id, "output": '{"temperature": 21}'}


def _call(call_id: str) -> dict:
    return {"type": "function_call", "call_id": call_id, "name": "get_weather",
            "arguments": '{"city": "Paris", "unit": "C"}'}


def _no_tool_call(r: httpx.Response, call_id: str) -> None:
    """``r`` is OpenAI's 400 for a function call output answering no earlier call."""
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err == {"message": f"No tool call found for function call output with call_id {call_id}.",
                   "type": "invalid_request_error", "param": "input", "code": None}, err


def test_a_forced_call_after_a_prompt_that_opens_thinking_comes_after_the_thinking(server):
    """As chat's: after a prompt that opens ``<think>`` a forced call's grammar starts after the think
    block (``grammar_after``), so the model thinks first: the tiny model, never closing the block, gives a
    reasoning item and no call by ``max_output_tokens``, whole and streamed."""
    state = server.app.state.server
    state.reasoning_parser = opens_thinking_parser()
    body = {"input": "What is the weather in Paris?", "tools": [WEATHER], "tool_choice": "required",
            "parallel_tool_calls": False, "max_output_tokens": 6, "temperature": 0}
    try:
        full = _post(server, body).json()
        events = _stream_events(server, body)
    finally:
        state.reasoning_parser = None
    kinds = [o["type"] for o in full["output"]]
    assert kinds[0] == "reasoning" and "function_call" not in kinds and full["status"] == "incomplete", full
    assert _without_ids(events[-1][1]["response"]) == _without_ids(full)


def test_function_call_output_must_answer_an_earlier_call(server):
    """As OpenAI: a ``function_call_output`` whose ``call_id`` no earlier ``function_call`` made is a
    400 naming ``input`` (hyla rendered it silently, a tool response to nothing); a matched pair in
    the same input, and a call not answered yet, are fine."""
    ask = {"role": "user", "content": "What is the weather in Paris?"}
    base = {"tools": [WEATHER], "max_output_tokens": 2, "temperature": 0}
    _no_tool_call(_post(server, {**base, "input": [ask, _call_output("call_orphan")]}), "call_orphan")
    _no_tool_call(_post(server, {**base, "input": [ask, _call("call_a"), _call_output("call_b")]}), "call_b")
    _no_tool_call(_post(server, {**base, "input": [ask, _call_output("call_a"), _call("call_a")]}), "call_a")
    _no_tool_call(_post(server, {**base, "stream": True, "input": [ask, _call_output("call_s")]}), "call_s")
    paired = _post(server, {**base, "input": [ask, _call("call_a"), _call("call_b"), _call_output("call_b"),
                                              _call_output("call_a")]})
    assert paired.status_code == 200, paired.text
    unanswered = _post(server, {**base, "input": [ask, _call("call_a"), _call_output("call_a"), _call("call_c")]})
    assert unanswered.status_code == 200, unanswered.text


def test_function_call_output_answers_a_call_of_the_previous_response(server):
    """The call an output answers may be in the stored conversation of ``previous_response_id``
    (the previous response's output, or its input); a call id it does not hold is a 400."""
    first = _post(server, {"input": "What is the weather in Paris?", "tools": [WEATHER], "max_output_tokens": 64,
                           "tool_choice": {"type": "function", "name": "get_weather"},
                           "parallel_tool_calls": False, "temperature": 0}).json()
    (call,) = first["output"]
    assert call["type"] == "function_call"
    base = {"tools": [WEATHER], "max_output_tokens": 2, "temperature": 0, "previous_response_id": first["id"]}
    answered = _post(server, {**base, "input": [_call_output(call["call_id"])]})
    assert answered.status_code == 200, answered.text
    _no_tool_call(_post(server, {**base, "input": [_call_output("call_elsewhere")]}), "call_elsewhere")
    _no_tool_call(_post(server, {"tools": [WEATHER], "max_output_tokens": 2,  # (no chain: no call)
                                 "input": [_call_output(call["call_id"])]}), call["call_id"])
    # a call in an earlier request's input is in the conversation too, answered two turns on
    asked = _post(server, {"input": [{"role": "user", "content": "Weather?"}, _call("call_in_input")],
                           "tools": [WEATHER], "max_output_tokens": 2, "temperature": 0}).json()
    later = _post(server, {**base, "previous_response_id": asked["id"], "input": "Still there?"}).json()
    again = _post(server, {**base, "previous_response_id": later["id"], "input": [_call_output("call_in_input")]})
    assert again.status_code == 200, again.text


def test_text_format_json_schema(server, client):
    text = {"format": {"type": "json_schema", "name": "answer", "schema": SCHEMA, "strict": True}}
    r = client.responses.create(model=MODEL, input="Is the sky blue? Answer in JSON.", text=text,
                                max_output_tokens=64, temperature=0)
    assert r.status == "completed"
    value = json.loads(r.output_text)
    assert set(value) == {"ok", "color"} and isinstance(value["ok"], bool)
    assert r.text.format.type == "json_schema" and r.text.format.name == "answer"
    obj = _post(server, {"input": "JSON please.", "text": {"format": {"type": "json_object"}},
                         "max_output_tokens": 48, "temperature": 0}).json()
    assert obj["output"][0]["content"][0]["text"].startswith("{")


# --------------------------------------------------------------------------------------------
# errors
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("body, param", [
    pytest.param({"input": "hi", "frobnicate": 1}, "frobnicate", id="unknown-field"),
    pytest.param({"input": [{"type": "image_generation_call", "id": "x"}]}, "input.0.type", id="bad-item-type"),
    pytest.param({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "x"}]}]},
                 "input.0.content.0.type", id="file-part"),
    pytest.param({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "ftp://x/a.png"}]}]},
                 "input.0.content.0.image_url", id="image-url"),
    pytest.param({"input": [{"role": "tool", "content": "x"}]}, "input.0.role", id="bad-role"),
    pytest.param({"input": [{"type": "function_call_output", "output": "x"}]}, "input.0.call_id",
                 id="output-without-call-id"),
    pytest.param({"input": []}, "input", id="empty-input"),
    pytest.param({"input": 3}, "input", id="input-not-text"),
    pytest.param({"input": "hi", "tools": [{"type": "web_search"}]}, "tools.0.type", id="unsupported-tool"),
    pytest.param({"input": "hi", "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools.0.function",
                 id="chat-shaped-tool"),
    pytest.param({"input": "hi", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}},
                 "tool_choice", id="unknown-function"),
    pytest.param({"input": "hi", "tool_choice": "required"}, "tool_choice", id="required-without-tools"),
    pytest.param({"input": "hi", "tools": [WEATHER], "tool_choice": "required",
                  "text": {"format": {"type": "json_object"}}}, "text.format", id="forced-call-and-format"),
    pytest.param({"input": "hi", "text": {"format": {"type": "json_schema", "schema": SCHEMA}}}, "text.format.name",
                 id="schema-without-name"),
    pytest.param({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x",
                                                      "schema": {"type": "nonsense"}}}}, "text.format",
                 id="schema-does-not-compile"),
    # a forced call's grammar that does not compile: the function's parameters (one grammar holds several)
    pytest.param({"input": "hi", "tools": [WEATHER, BAD_PATTERN],
                  "tool_choice": {"type": "function", "name": "lookup"}}, "tools.1.parameters",
                 id="forced-function-does-not-compile"),
    pytest.param({"input": "hi", "tools": [WEATHER, BAD_PATTERN], "tool_choice": "required"}, "tools",
                 id="forced-tools-do-not-compile"),
    pytest.param({"input": "hi", "previous_response_id": "resp_unknown"}, "previous_response_id",
                 id="unknown-previous-response"),
    pytest.param({"input": "hi", "max_output_tokens": 0}, "max_output_tokens", id="zero-max-output-tokens"),
    pytest.param({"input": "hi", "max_output_tokens": 10 ** 7}, "max_output_tokens", id="past-the-context"),
    pytest.param({"input": "hi", "temperature": "0"}, "temperature", id="string-temperature"),
    # the field, not pydantic's name of the union member it tried (was "tool_choice.literal['none',...]")
    pytest.param({"input": "hi", "tools": [WEATHER], "tool_choice": "get_weather"}, "tool_choice",
                 id="tool-choice-a-bare-name"),
    pytest.param({"input": [{"role": "user", "content": None}]}, "input.0.content", id="null-content"),
    pytest.param({"input": "hi", "truncation": "middle"}, "truncation", id="truncation-middle"),
    pytest.param({"input": "hi", "stream_options": {"include_obfuscation": False}}, "stream_options",
                 id="stream-options-without-stream"),
    pytest.param({"input": [{"role": "assistant", "content": "a", "phase": "final"}]}, "input.0.phase", id="bad-phase"),
    # a tool choice the SDK types and hyla does not support: the field that says so, not the union's
    # "Input should be 'none', 'auto' or 'required' (and 4 more error(s))" naming tool_choice
    pytest.param({"input": "hi", "tools": [WEATHER], "tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": [
        {"type": "function", "name": "get_weather"}]}}, "tool_choice.type", id="tool-choice-allowed-tools"),
    pytest.param({"input": "hi", "tools": [WEATHER], "tool_choice": {"type": "function"}}, "tool_choice.name",
                 id="tool-choice-without-name"),
    pytest.param({"input": [{"role": "assistant", "content": "a"}, {"role": "system", "content": "late"}]},
                 "input", id="template-refuses-a-late-system-message"),
])
def test_bad_requests_are_400_naming_the_field(server, body, param):
    r = _post(server, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param, err


def test_what_agent_clients_send_by_default_is_accepted(server, client):
    """The OpenAI Agents SDK and Codex always send ``include`` (``[]``, or Codex's
    ``["reasoning.encrypted_content"]``), Codex ``prompt_cache_key``, ``text.verbosity``, and
    ``instructions`` beside developer items: each was a 400. The instructions and the leading
    developer and system items become one system message (chat templates take one, first), the same
    prompt every turn of a chain; the usage has the SDK's required ``cache_write_tokens``."""
    from openai.types.responses import Response

    body = {"input": [{"role": "developer", "content": "<permissions>read only</permissions>"},
                      {"role": "user", "content": "list the files"}],
            "instructions": "You are Codex.", "include": ["reasoning.encrypted_content"],
            "prompt_cache_key": "conv-1", "prompt_cache_retention": "24h", "safety_identifier": "user-7",
            "truncation": "disabled", "service_tier": "auto", "text": {"verbosity": "medium"}, "max_output_tokens": 4,
            "temperature": 0}
    r = _post(server, body)
    assert r.status_code == 200, r.text
    first = Response.model_validate(r.json())  # (strictly: every field the SDK requires)
    assert first.usage.input_tokens_details.cache_write_tokens == 0
    assert first.text.verbosity == "medium" and first.text.format.type == "text"  # (text echoed whole)
    merged = [{"role": "system", "content": "You are Codex.\n\n<permissions>read only</permissions>"},
              {"role": "user", "content": "list the files"}]
    chat = client.chat.completions.create(model=MODEL, messages=merged, max_tokens=4, temperature=0)
    assert first.usage.input_tokens == chat.usage.prompt_tokens and first.output_text == chat.choices[0].message.content
    again = _post(server, {**body, "input": "and the hidden ones", "previous_response_id": first.id, "include": []})
    assert again.status_code == 200, again.text
    cached = again.json()["usage"]["input_tokens_details"]["cached_tokens"]
    assert cached >= first.usage.input_tokens + first.usage.output_tokens - 1  # the same system message


def test_what_the_sdk_types_take_is_accepted_and_changes_nothing(server, client):
    """Fields of the openai SDK's request types were each a 400: ``stream_options`` (its
    ``include_obfuscation``; hyla's events carry no obfuscation), ``reasoning``'s ``effort: "max"``,
    ``context`` and ``mode``, and an input message's ``phase`` (the SDK's output messages carry it,
    ``model_dump()`` copies it back as ``None``). The answer is the one without them."""
    ask = [{"role": "user", "content": "Name a river."}, {"role": "assistant", "content": "The Seine."},
           {"role": "user", "content": "Another?"}]
    plain = client.responses.create(model=MODEL, input=ask, max_output_tokens=4, temperature=0)
    for phase in ("final_answer", "commentary", None):
        phased = [*ask[:1], {**ask[1], "type": "message", "phase": phase}, *ask[2:]]
        r = client.responses.create(model=MODEL, input=phased, max_output_tokens=4, temperature=0)
        assert r.usage.input_tokens == plain.usage.input_tokens and r.output_text == plain.output_text
    reasoning = {"effort": "max", "summary": "auto", "context": "all_turns", "mode": "pro"}
    r = client.responses.create(model=MODEL, input=ask, max_output_tokens=4, temperature=0, reasoning=reasoning)
    assert r.output_text == plain.output_text and r.reasoning.effort == "max" and r.reasoning.context == "all_turns"
    events = list(client.responses.create(model=MODEL, input=ask, max_output_tokens=4, temperature=0, stream=True,
                                          stream_options={"include_obfuscation": False}))
    assert events[-1].response.output_text == plain.output_text


def test_what_agent_clients_send_to_chat_is_accepted_and_changes_nothing(client):
    """The Agents SDK's chat-completions model settings (``prompt_cache_key``, ``prompt_cache_retention``,
    ``safety_identifier``, ``reasoning_effort``, ``verbosity``) were each a 400: they are accepted, and the
    answer is the one without them; a value outside OpenAI's enums is still a 400 naming the field."""
    messages = [SYSTEM, {"role": "user", "content": "What is a prefix cache?"}]
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0)
    hinted = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=6, temperature=0, prompt_cache_key="agent-1",
        prompt_cache_retention="in_memory", safety_identifier="user-7", reasoning_effort="max", verbosity="high")
    assert hinted.choices[0].message.content == plain.choices[0].message.content
    assert hinted.usage.prompt_tokens == plain.usage.prompt_tokens
    for field, value in (("prompt_cache_retention", "forever"), ("reasoning_effort", "maximal"), ("prompt_cache_key", 5)):
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, extra_body={field: value})
        assert refused.value.body["param"] == field


def test_null_is_the_default_and_unknown_model_is_404(server):
    r = _post(server, {"input": "hi", "max_output_tokens": 2, "stream": None, "store": None, "tools": None,
                       "tool_choice": None, "parallel_tool_calls": None, "text": None, "temperature": None,
                       "instructions": None, "previous_response_id": None, "metadata": None,
                       "reasoning": {"effort": "low"}})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["store"] is True and out["parallel_tool_calls"] is True and out["tool_choice"] == "auto"
    assert httpx.get(f"{server.url}/v1/responses/{out['id']}").status_code == 200  # stored by default
    bad = httpx.post(server.url + "/v1/responses", json={"model": "nope", "input": "hi"}, timeout=60)
    assert bad.status_code == 404 and bad.json()["error"]["param"] == "model"


# --------------------------------------------------------------------------------------------
# the mapping, unit
# --------------------------------------------------------------------------------------------
def test_items_become_chat_turns():
    items = [MessageItem(role="user", content="q"),
             ReasoningItem(type="reasoning", content=[{"type": "reasoning_text", "text": "hmm"}]),
             MessageItem(role="assistant", content=[{"type": "output_text", "text": "let me look", "annotations": []}]),
             FunctionCallItem(type="function_call", call_id="c1", name="f", arguments="{}"),
             FunctionCallItem(type="function_call", call_id="c2", name="g", arguments='{"a": 1}'),
             FunctionCallOutputItem(type="function_call_output", call_id="c1", output="r1"),
             FunctionCallOutputItem(type="function_call_output", call_id="c2", output=[{"type": "input_text",
                                                                                         "text": "r2"}]),
             MessageItem(role="assistant", content="done"),
             MessageItem(role="assistant", content="more")]
    # a response's text after its calls (its second message): the same assistant turn, as a chat client's
    after = [MessageItem(role="user", content="q"), FunctionCallItem(type="function_call", call_id="c1", name="f",
                                                                     arguments="{}"),
             MessageItem(role="assistant", content="sent"), MessageItem(role="assistant", content="more"),
             FunctionCallOutputItem(type="function_call_output", call_id="c1", output="r1")]
    assert items_to_messages(after) == [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "sent", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "assistant", "content": "more"}, {"role": "tool", "tool_call_id": "c1", "content": "r1"}]
    assert items_to_messages(items[:5] + [MessageItem(role="assistant", content="after")])[1]["content"] == \
        "let me look\n\nafter"
    assert items_to_messages(items) == [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "let me look", "reasoning_content": "hmm", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
            {"id": "c2", "type": "function", "function": {"name": "g", "arguments": '{"a": 1}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "r1"},
        {"role": "tool", "tool_call_id": "c2", "content": "r2"},
        {"role": "assistant", "content": "done"},
        {"role": "assistant", "content": "more"}]


def test_instructions_and_leading_system_messages_are_one_system_message():
    """``instructions`` and the leading system and developer messages: one system message, the messages apart
    by a blank line and a message's text parts a line each; with an image, its parts in order (it was dropped)."""
    from hyla.server.responses_routes import with_instructions
    user = {"role": "user", "content": "q"}
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    assert with_instructions("Be brief.", [{"role": "developer", "content": parts}, user]) == [
        {"role": "system", "content": "Be brief.\n\na\nb"}, user]
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    merged = with_instructions("Be brief.", [{"role": "system", "content": [parts[0], image]}, user])
    assert merged == [{"role": "system", "content": [{"type": "text", "text": "Be brief."},
                                                      {"type": "text", "text": "\n\n"}, parts[0], image]}, user]
    alone = [{"role": "developer", "content": parts}, user]
    assert with_instructions(None, alone) == alone  # (one such message stays itself)


def test_output_items_order_and_shape():
    rid = "resp_" + "0a" * 16
    ids = {"reasoning": "rs_1", "message": "msg_1", "response": rid}
    out = output_items("thinking", "", [ToolCall("f", "{}", id="call_1"), ToolCall("g", "{}", id="call_2")], True, ids)
    assert [o["type"] for o in out] == ["reasoning", "function_call", "function_call"]  # no text beside a call
    assert out[0] == {"type": "reasoning", "id": "rs_1", "summary": [],
                      "content": [{"type": "reasoning_text", "text": "thinking"}]}
    assert out[1]["call_id"] == "call_1" and [o["id"] for o in out[1:]] == ids["calls"]
    # an item's id names its response (what hyla route reads to route an item_reference), each its own
    assert ids["calls"] == [f"fc_{'0a' * 16}_0", f"fc_{'0a' * 16}_1"]
    assert {response_of_item(i) for i in ids["calls"]} == {rid} == {response_of_item(output_item_id(p, rid))
                                                                     for p in ("rs", "msg")}
    assert response_of_item("msg_1") is None and response_of_item("fc_" + "0a" * 16 + "_x") is None
    out = output_items(None, "", [], False, {"reasoning": "rs_2", "message": "msg_2"})
    assert out == [{"type": "message", "id": "msg_2", "role": "assistant", "status": "incomplete",
                    "content": [{"type": "output_text", "text": "", "annotations": []}]}]


def test_reasoning_parser_splits_a_reasoning_item(server, client):
    """With a reasoning parser the tiny model (which never writes ``<think>``) still answers with a
    message only; the reasoning item's shape is ``test_output_items_order_and_shape``'s."""
    from hyla.server.reasoning import ReasoningParser

    state = server.app.state.server
    state.reasoning_parser = ReasoningParser("qwen3")
    try:
        r = client.responses.create(model=MODEL, input="Think about it.", max_output_tokens=6, temperature=0)
        assert [o.type for o in r.output] == ["message"]
        events = _stream_events(server, {"input": "Think about it.", "max_output_tokens": 6, "temperature": 0})
        assert _without_ids(events[-1][1]["response"]) == _without_ids(r.model_dump(exclude_unset=True))
    finally:
        state.reasoning_parser = None


# --------------------------------------------------------------------------------------------
# GET /v1/responses/{id}/input_items
# --------------------------------------------------------------------------------------------
def _typed_item(raw: dict):
    """An input item as the SDK's ``ResponseItem`` member of its type, validated strictly (every field the
    SDK requires, each of its type)."""
    from openai.types.responses import (ResponseFunctionToolCallItem, ResponseFunctionToolCallOutputItem,
                                        ResponseInputMessageItem, ResponseOutputMessage, ResponseReasoningItem)
    kinds = {"function_call": ResponseFunctionToolCallItem, "function_call_output": ResponseFunctionToolCallOutputItem,
             "reasoning": ResponseReasoningItem}
    if raw["type"] == "message":
        return (ResponseOutputMessage if raw["role"] == "assistant" else ResponseInputMessageItem).model_validate(raw)
    return kinds[raw["type"]].model_validate(raw)


def test_input_items_are_the_inputs_of_the_chain(server, client):
    """OpenAI's ``GET /v1/responses/{id}/input_items`` (``client.responses.input_items.list``): the items the
    response was made from — the ``previous_response_id`` chain's inputs and outputs, then its own input —
    latest first by default, each with its ``id`` (its own, else a new ``msg_...``); pages of ``limit``,
    ``after`` the last id of a page (the SDK's auto-paging); each item parses as the SDK's type."""
    first_input = [{"role": "developer", "content": "Be brief."},
                   {"role": "user", "content": [{"type": "input_text", "text": "Weather"},
                                                {"type": "input_text", "text": " in Paris?"}], "id": "msg_mine"},
                   _call("call_a"), _call_output("call_a")]
    r1 = client.responses.create(model=MODEL, input=first_input, tools=[WEATHER], max_output_tokens=3, temperature=0)
    r2 = client.responses.create(model=MODEL, input="And Oslo?", previous_response_id=r1.id, tools=[WEATHER],
                                 max_output_tokens=3, temperature=0)
    asc = list(client.responses.input_items.list(r2.id, order="asc", limit=2))  # (3 pages, followed by the SDK)
    assert [(i.type, getattr(i, "role", None)) for i in asc] == [
        ("message", "developer"), ("message", "user"), ("function_call", None), ("function_call_output", None),
        *[(o.type, getattr(o, "role", None)) for o in r1.output], ("message", "user")]
    assert asc[1].id == "msg_mine" and asc[1].content[0].text == "Weather" and asc[1].content[1].text == " in Paris?"
    assert asc[0].id.startswith("msg_") and asc[-1].id.startswith("msg_") and len({i.id for i in asc}) == len(asc)
    assert asc[2].call_id == "call_a" and asc[3].output == '{"temperature": 21}' and asc[3].id.startswith("fco_")
    assert [i.id for i in asc[4:-1]] == [o.id for o in r1.output]  # the previous output, as it was returned
    assert asc[-1].content[0].type == "input_text" and asc[-1].content[0].text == "And Oslo?"
    default = list(client.responses.input_items.list(r2.id))
    assert [i.id for i in default] == [i.id for i in reversed(asc)]  # desc by default
    own = list(client.responses.input_items.list(r1.id, order="asc"))  # the first response: its own input only
    assert [i.id for i in own] == [i.id for i in asc[:4]]

    page = httpx.get(f"{server.url}/v1/responses/{r2.id}/input_items", params={"limit": 2}).json()
    assert page["object"] == "list" and page["has_more"] is True
    assert [i["id"] for i in page["data"]] == [page["first_id"], page["last_id"]] == [asc[-1].id, asc[-2].id]
    for raw in page["data"]:
        _typed_item(raw)
    nxt = httpx.get(f"{server.url}/v1/responses/{r2.id}/input_items",
                    params={"limit": 100, "after": page["last_id"]}).json()
    assert [i["id"] for i in nxt["data"]] == [i.id for i in reversed(asc[:-2])] and nxt["has_more"] is False
    for raw in nxt["data"]:
        _typed_item(raw)
    end = httpx.get(f"{server.url}/v1/responses/{r2.id}/input_items", params={"after": asc[0].id}).json()
    assert end == {"object": "list", "data": [], "first_id": None, "last_id": None, "has_more": False}


def test_input_items_of_a_reasoning_item_and_an_assistant_message_parse(server, client):
    """The items a client copies back (a reasoning item, an assistant message of parts, a function call
    output of parts) are listed as the SDK's types: ``summary_text`` / ``reasoning_text`` parts,
    ``output_text`` parts with ``annotations``, ``input_text`` output parts."""
    given = [{"role": "user", "content": "q"},
             {"type": "reasoning", "summary": [{"type": "summary_text", "text": "s"}],
              "content": [{"type": "reasoning_text", "text": "hmm"}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "a"}]},
             _call("call_p"),
             {"type": "function_call_output", "call_id": "call_p", "output": [{"type": "input_text", "text": "r"}]}]
    r = _post(server, {"input": given, "tools": [WEATHER], "max_output_tokens": 2})
    assert r.status_code == 200, r.text
    listed = httpx.get(f"{server.url}/v1/responses/{r.json()['id']}/input_items", params={"order": "asc"}).json()
    typed = [_typed_item(raw) for raw in listed["data"]]
    assert typed[1].id.startswith("rs_") and typed[1].summary[0].text == "s" and typed[1].content[0].text == "hmm"
    assert typed[2].role == "assistant" and typed[2].content[0].text == "a" and typed[2].status == "completed"
    assert typed[4].output[0].text == "r"


@pytest.mark.parametrize("params, param", [
    ({"limit": 0}, "limit"), ({"limit": 101}, "limit"), ({"limit": "ten"}, "limit"), ({"limit": -1}, "limit"),
    ({"order": "up"}, "order"), ({"after": "msg_elsewhere"}, "after"), ({"before": "msg_x"}, "before"),
])
def test_input_items_bad_parameters_are_400_naming_them(server, params, param):
    rid = _post(server, {"input": "Page me.", "max_output_tokens": 2}).json()["id"]
    r = httpx.get(f"{server.url}/v1/responses/{rid}/input_items", params=params)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and r.json()["error"]["type"] == "invalid_request_error"


def test_input_items_of_no_stored_response_are_404(server, client):
    unstored = _post(server, {"input": "Forget me.", "max_output_tokens": 2, "store": False}).json()["id"]
    for rid in (unstored, "resp_unknown"):
        with pytest.raises(openai.NotFoundError) as info:
            list(client.responses.input_items.list(rid))
        assert info.value.body["code"] == "response_not_found" and info.value.body["param"] == "response_id"


def test_the_stored_size_counts_the_input_items():
    """The store's byte accounting counts a response's listed input items too."""
    from hyla.server.protocol import text_chars

    items = [{"type": "message", "id": "msg_1", "role": "user", "content": [{"type": "input_text", "text": "x" * 500}]}]
    bare, full = StoredResponse({"id": "a"}, []), StoredResponse({"id": "a"}, [], items)
    assert stored_size(full) == stored_size(bare) + text_chars(items, keys=True)
    store = ResponseStore()
    store.put(full)
    assert store.bytes == stored_size(full)


# --------------------------------------------------------------------------------------------
# an item twice in the conversation
# --------------------------------------------------------------------------------------------
def _duplicate(r: httpx.Response, item_id: str) -> None:
    """``r`` is OpenAI's 400 for an item already in the conversation."""
    assert r.status_code == 400, r.text
    assert r.json()["error"] == {"message": f"Duplicate item found with id {item_id}. Remove duplicate items from "
                                            f"your input and try again.", "type": "invalid_request_error",
                                 "param": "input", "code": None}


def test_an_item_already_in_the_conversation_is_400(server):
    """As OpenAI: an input item whose id an item of the ``previous_response_id`` chain has (an item
    reference to the previous output, the output copied back, an input item sent again), or an earlier
    item of the same input, is a 400 (it rendered twice); new items beside the chain are fine."""
    ask = {"role": "user", "content": "Name a river.", "id": "msg_ask"}
    first = _post(server, {"input": [ask], "max_output_tokens": 3, "temperature": 0}).json()
    out = first["output"][0]
    base = {"previous_response_id": first["id"], "max_output_tokens": 2}
    _duplicate(_post(server, {**base, "input": [{"type": "item_reference", "id": out["id"]}]}), out["id"])
    _duplicate(_post(server, {**base, "input": [out]}), out["id"])
    _duplicate(_post(server, {**base, "input": [{"role": "user", "content": "Again", "id": "msg_ask"}]}), "msg_ask")
    _duplicate(_post(server, {"input": [ask, {"id": out["id"]}, {"type": "item_reference", "id": out["id"]}],
                              "max_output_tokens": 2}), out["id"])
    _duplicate(_post(server, {"input": [ask, {**ask, "content": "Twice"}], "max_output_tokens": 2}), "msg_ask")
    fine = _post(server, {**base, "input": [{"role": "user", "content": "Another?", "id": "msg_other"}]})
    assert fine.status_code == 200, fine.text
    again = _post(server, {"input": [ask, {"id": out["id"]}], "max_output_tokens": 2})  # (no chain: once each)
    assert again.status_code == 200, again.text


# --------------------------------------------------------------------------------------------
# logprobs, top_logprobs, max_tool_calls
# --------------------------------------------------------------------------------------------
LOGPROBS = ["message.output_text.logprobs"]


def _rounded(entries) -> list:
    """Logprob entries with their logprobs to 2 decimals (the same prompt's logits differ by a few ULPs
    between batches and cache hits)."""
    def r(e: dict) -> dict:
        return {**e, "logprob": round(e["logprob"], 2)}
    return [{**r(e), "top_logprobs": [r(t) for t in e["top_logprobs"]]} for e in entries]


def test_logprobs_are_the_chat_completions(server, client):
    """``include: ["message.output_text.logprobs"]`` with ``top_logprobs`` (was a 400): the message's
    ``output_text`` carries the chat completion's logprobs for the same conversation (the SDK's
    ``Logprob``: token, logprob, bytes, top_logprobs), whole and streamed: the deltas' logprobs joined are
    the ``.done`` event's and the final response's. ``top_logprobs`` is echoed; without the ``include``
    there are none."""
    from openai.types.responses import Response

    ask = "Tell me about rivers."
    r = client.responses.create(model=MODEL, input=ask, instructions=INSTRUCTIONS, max_output_tokens=8,
                                temperature=0, include=LOGPROBS, top_logprobs=2)
    chat = client.chat.completions.create(model=MODEL, messages=[SYSTEM, {"role": "user", "content": ask}],
                                          max_tokens=8, temperature=0, logprobs=True, top_logprobs=2)
    part = r.output[0].content[0]
    assert _rounded(lp.model_dump() for lp in part.logprobs) == \
        _rounded(c.model_dump() for c in chat.choices[0].logprobs.content)
    assert len(part.logprobs) == r.usage.output_tokens and all(len(lp.top_logprobs) == 2 for lp in part.logprobs)
    assert r.top_logprobs == 2
    body = {"input": ask, "instructions": INSTRUCTIONS, "max_output_tokens": 8, "temperature": 0,
            "include": LOGPROBS, "top_logprobs": 2}
    full = _post(server, body).json()
    Response.model_validate(full)  # (strictly: the logprobs' every field)
    data = [d for _, d in _stream_events(server, body)]
    streamed = [lp for d in data if d["type"] == "response.output_text.delta" for lp in d["logprobs"]]
    (done,) = [d["logprobs"] for d in data if d["type"] == "response.output_text.done"]
    final = data[-1]["response"]["output"][0]["content"][0]["logprobs"]
    shaped = [{"token": e["token"], "logprob": e["logprob"], "top_logprobs": [
        {"token": t["token"], "logprob": t["logprob"]} for t in e["top_logprobs"]]} for e in final]
    assert streamed == done == shaped  # (the delta events' shape: no bytes)
    # each delta carries its own tokens' logprobs, as they come
    assert all(d["logprobs"] for d in data if d["type"] == "response.output_text.delta" and d["delta"])
    assert _rounded(final) == _rounded(full["output"][0]["content"][0]["logprobs"])
    events = list(client.responses.create(model=MODEL, stream=True, **body))  # the SDK parses the stream
    assert [lp.token for e in events if e.type == "response.output_text.delta" for lp in e.logprobs] == \
        [e["token"] for e in shaped]
    plain = client.responses.create(model=MODEL, input=ask, max_output_tokens=4, temperature=0, top_logprobs=2)
    assert plain.output[0].content[0].logprobs is None and plain.top_logprobs == 2
    alone = client.responses.create(model=MODEL, input=ask, max_output_tokens=4, temperature=0, include=LOGPROBS)
    assert alone.top_logprobs is None and all(lp.top_logprobs == [] for lp in alone.output[0].content[0].logprobs)


# a thinking model's answer with text and a call, in ASCII, in chunks of several tokens (_script_tokens); the
# second chunk's text ends in the call marker's first characters (spelled in plain tokens)
SCRIPTED_TOKENS = ["<think>\nhmm, Paris\n</think>\n\n", "Let me", " check.\n<tool",
                   '_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n</tool_call>']


def _script_tokens(monkeypatch, engine, pieces: list[str], fail: BaseException | None = None,
                   abort: str | None = None) -> list[int]:
    """Make ``engine`` answer every request with ``pieces``, one chunk each (its tokens), the ``i``-th token of
    the answer with logprob ``-(i + 1) / 100`` and one alternative; ``fail``: raised after the text instead
    of finishing; ``abort``: the cause of an engine abort instead of the finish. The answer's ids."""
    tokenizer = engine.tokenizer
    chunks_ids = [tokenizer.encode(piece, add_special_tokens=False) for piece in pieces]

    async def generate(*args, rid=None, **kwargs):
        async def chunks():
            n = 0
            for k, (piece, ids) in enumerate(zip(pieces, chunks_ids)):
                last = k == len(pieces) - 1
                finish = None
                if last and abort is not None:
                    finish = {"type": "abort", "message": f"{abort}: gave up", "cause": abort}
                elif last and fail is None:
                    finish = {"type": "stop"}
                lps = [-(n + j + 1) / 100 for j in range(len(ids))]
                n += len(ids)
                yield {"text": piece, "output_ids": ids, "meta_info": {
                    "id": rid, "prompt_tokens": 5, "completion_tokens": n, "cached_tokens": 0,
                    "finish_reason": finish, "output_token_logprobs": [(lp, tid, None) for lp, tid in zip(lps, ids)],
                    "output_top_logprobs": [[(lp, tid), (-9.0, 0)] for lp, tid in zip(lps, ids)]}}
            if fail is not None:
                raise fail
        return _EngineStream(chunks())

    monkeypatch.setattr(engine, "async_generate", generate)
    return [tid for ids in chunks_ids for tid in ids]


class _EngineStream:
    """Chunks as the engine's stream gives them: iterated, and closed by a generation that ends first."""

    def __init__(self, chunks):
        self.chunks = chunks

    def __aiter__(self):
        return self.chunks

    def close(self) -> None:
        pass


def _starts(tokenizer, ids: list[int]) -> list[int]:
    """Where each token starts in the text of ``ids`` (ASCII: the length of the text before it)."""
    return [len(tokenizer.decode(ids[:i], skip_special_tokens=False)) for i in range(len(ids))]


def test_logprobs_are_the_message_texts_only(server, engine, monkeypatch):
    """A thinking model's answer with a call (scripted): the message's logprobs are those of the tokens
    from the end of the reasoning (``</think>``) to the first call's marker — not the reasoning's, not the
    call's — whole and streamed (the deltas' joined are the whole list, and the final response's; a delta
    sent while the text ends in a marker's start leaves out the tokens that could be the marker's)."""
    from hyla.server.reasoning import ReasoningParser

    state = server.app.state.server
    ids = _script_tokens(monkeypatch, engine, SCRIPTED_TOKENS)
    state.reasoning_parser = ReasoningParser("qwen3")
    body = {"input": "What is the weather in Paris?", "tools": [WEATHER], "include": LOGPROBS, "top_logprobs": 1}
    try:
        full = _post(server, body).json()
        data = [d for _, d in _stream_events(server, body)]
    finally:
        state.reasoning_parser = None
    assert [o["type"] for o in full["output"]] == ["reasoning", "message", "function_call"]
    text = "".join(SCRIPTED_TOKENS)
    start, end = text.index("</think>") + len("</think>"), text.index("<tool_call>")
    expected = [-(i + 1) / 100 for i, at in enumerate(_starts(engine.tokenizer, ids)) if start <= at < end]
    logprobs = full["output"][1]["content"][0]["logprobs"]
    assert [e["logprob"] for e in logprobs] == expected and expected
    assert "".join(e["token"] for e in logprobs).strip() == full["output"][1]["content"][0]["text"] == "Let me check."
    streamed = [lp["logprob"] for d in data if d["type"] == "response.output_text.delta" for lp in d["logprobs"]]
    assert streamed == expected
    assert data[-1]["response"]["output"][1]["content"][0]["logprobs"] == logprobs


@pytest.mark.parametrize("body, param", [
    pytest.param({"top_logprobs": 21}, "top_logprobs", id="top-logprobs-over-20"),
    pytest.param({"top_logprobs": -1}, "top_logprobs", id="negative-top-logprobs"),
    pytest.param({"max_tool_calls": 0}, "max_tool_calls", id="zero-max-tool-calls"),
    pytest.param({"max_tool_calls": "2"}, "max_tool_calls", id="string-max-tool-calls"),
])
def test_logprobs_and_max_tool_calls_bounds(server, body, param):
    r = _post(server, {"input": "hi", "max_output_tokens": 2, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_max_tool_calls_is_accepted_and_echoed(server, client):
    """``max_tool_calls`` bounds built-in tool calls at OpenAI; hyla has none: accepted, echoed, no effect."""
    body = {"input": "What is the weather in Paris?", "tools": [WEATHER], "tool_choice": "required",
            "parallel_tool_calls": False, "max_output_tokens": 64, "temperature": 0}
    plain = _post(server, body).json()
    bounded = client.responses.create(model=MODEL, max_tool_calls=1, **body)
    assert bounded.max_tool_calls == 1 and plain["max_tool_calls"] is None
    assert _without_ids(bounded.model_dump(exclude_unset=True)) == _without_ids({**plain, "max_tool_calls": 1})


# --------------------------------------------------------------------------------------------
# an error mid-stream
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("failure, code, failed_code", [
    pytest.param({"fail": RuntimeError("boom")}, "internal_error", "server_error", id="engine-failure"),
    pytest.param({"abort": "grammar"}, "grammar_error", "invalid_prompt", id="grammar-abort"),
])
def test_an_error_mid_stream_is_openais_error_and_failed_events(server, client, engine, monkeypatch, failure, code,
                                                                failed_code):
    """An engine failure after the stream started (was ``data: {"error": ...}`` and ``[DONE]``, chat's
    shape): OpenAI's ``error`` event (``code``, ``message``, ``param``, numbered) then ``response.failed``
    (the response, ``status`` failed, its ``error``), which the SDK parses as ``ResponseErrorEvent`` and
    ``ResponseFailedEvent``; the failed response is not stored. Chat's stream keeps its own shape."""
    from openai.types.responses import ResponseErrorEvent, ResponseFailedEvent

    _script_tokens(monkeypatch, engine, ["Let me", " check the weather."], **failure)
    body = {"input": "What is the weather in Paris?"}
    events = _stream_events(server, body)
    assert [name for name, _ in events] == [d["type"] for _, d in events]
    assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
    assert [d["type"] for _, d in events][-2:] == ["error", "response.failed"]
    error, failed = events[-2][1], events[-1][1]
    assert error["code"] == code and error["message"] and set(error) == {"type", "code", "message", "param",
                                                                        "sequence_number"}
    ResponseErrorEvent.model_validate(error)
    ResponseFailedEvent.model_validate(failed)
    assert failed["response"]["status"] == "failed" and failed["response"]["error"]["code"] == failed_code
    assert httpx.get(f"{server.url}/v1/responses/{failed['response']['id']}").status_code == 404

    parsed = list(client.responses.create(model=MODEL, stream=True, **body))
    assert isinstance(parsed[-2], ResponseErrorEvent) and parsed[-2].code == code
    assert isinstance(parsed[-1], ResponseFailedEvent) and parsed[-1].response.error.code == failed_code
    with client.responses.stream(model=MODEL, **body) as helper:
        assert [e.type for e in helper][-2:] == ["error", "response.failed"]

    with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=60, json={
            "model": MODEL, "stream": True, "messages": [{"role": "user", "content": "hi"}]}) as r:
        lines = [line for line in r.iter_lines() if line]
    assert json.loads(lines[-2].removeprefix("data: "))["error"]["code"] == code and lines[-1] == "data: [DONE]"


# --------------------------------------------------------------------------------------------
# POST /v1/responses/input_tokens
# --------------------------------------------------------------------------------------------
def _count(server, body: dict) -> httpx.Response:
    return httpx.post(server.url + "/v1/responses/input_tokens", json={"model": MODEL, **body}, timeout=60)


def test_input_tokens_are_the_responses_prompt(server, client):
    """OpenAI's ``POST /v1/responses/input_tokens`` (``client.responses.input_tokens.count``): the prompt
    tokens the same ``POST /v1/responses`` body renders to — instructions, tools, a previous response's
    conversation — without generating anything; ``model`` may be left out."""
    first = client.responses.create(model=MODEL, input="What is the weather in Paris?", instructions=INSTRUCTIONS,
                                    tools=[WEATHER], max_output_tokens=4, temperature=0)
    follow = {"input": [{"role": "user", "content": "And in Oslo?"}], "instructions": INSTRUCTIONS,
              "tools": [WEATHER], "previous_response_id": first.id}
    counted = client.responses.input_tokens.count(model=MODEL, **follow)
    assert counted.object == "response.input_tokens"
    made = client.responses.create(model=MODEL, max_output_tokens=2, temperature=0, **follow)
    assert counted.input_tokens == made.usage.input_tokens
    assert client.responses.input_tokens.count(input="hi").input_tokens == \
        client.responses.create(model=MODEL, input="hi", max_output_tokens=1).usage.input_tokens
    before = _count(server, {"input": "Count me."})
    assert before.status_code == 200 and before.json() == {"object": "response.input_tokens",
                                                           "input_tokens": before.json()["input_tokens"]}


@pytest.mark.parametrize("body, param", [
    pytest.param({"input": "hi", "frobnicate": 1}, "frobnicate", id="unknown-field"),
    pytest.param({"input": [{"type": "image_generation_call", "id": "x"}]}, "input.0.type", id="bad-item-type"),
    pytest.param({"input": "hi", "previous_response_id": "resp_unknown"}, "previous_response_id",
                 id="unknown-previous-response"),
    pytest.param({"input": [{"type": "item_reference", "id": "msg_unknown"}]}, "input.0.id", id="unknown-reference"),
    pytest.param({"input": [{"role": "user", "content": "a", "id": "msg_1"}, {"role": "user", "content": "b",
                                                                               "id": "msg_1"}]}, "input",
                 id="duplicate-item"),
    pytest.param({"input": [_call_output("call_orphan")]}, "input", id="orphan-call-output"),
    pytest.param({"input": "hi", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}},
                 "tool_choice", id="unknown-function"),
    pytest.param({"input": "hi", "model": "nope"}, "model", id="unknown-model"),
])
def test_input_tokens_refuse_what_responses_refuse(server, body, param):
    counted, made = _count(server, body), _post(server, body)
    assert counted.status_code == made.status_code and counted.status_code in (400, 404), counted.text
    assert counted.json() == made.json() and counted.json()["error"]["param"] == param


# --------------------------------------------------------------------------------------------
# background: true
# --------------------------------------------------------------------------------------------
class _Gate:
    """``engine`` answers every request with "Hello", then waits until ``release`` (" world.", the end), or
    until ``engine.abort`` of its id (it ends aborted by the client, as the engine's own abort does)."""

    def __init__(self, monkeypatch, engine):
        self.released, self.aborted, self.started = threading.Event(), set(), threading.Event()

        async def generate(*args, rid=None, **kwargs):
            async def chunks():
                def chunk(i, text, finish=None):
                    return {"text": text, "output_ids": [i], "meta_info": {
                        "id": rid, "prompt_tokens": 5, "completion_tokens": i + 1, "cached_tokens": 0,
                        "finish_reason": finish}}
                yield chunk(0, "Hello")
                self.started.set()
                while not self.released.is_set() and rid not in self.aborted:
                    await asyncio.sleep(0.01)
                if rid in self.aborted:
                    yield chunk(1, "", {"type": "abort", "cause": "client"})
                else:
                    yield chunk(1, " world.", {"type": "stop"})
            return _Stream(chunks(), lambda: self.aborted.add(rid))

        monkeypatch.setattr(engine, "async_generate", generate)
        monkeypatch.setattr(engine, "abort", self.aborted.add)

    def release(self) -> None:
        self.released.set()


class _Stream:
    """An engine request's stream as ``Engine.async_generate`` gives it: its chunks, and ``close`` (abort)."""

    def __init__(self, chunks, close):
        self.chunks, self.close = chunks, close

    def __aiter__(self):
        return self.chunks


def _until(server, response_id: str, status: str) -> dict:
    for _ in range(500):
        got = httpx.get(f"{server.url}/v1/responses/{response_id}", timeout=30).json()
        if got["status"] == status:
            return got
        time.sleep(0.01)
    raise AssertionError(f"{response_id} never reached {status}: {got}")


def test_a_background_response_is_queued_runs_on_and_is_polled(server, client, engine, monkeypatch):
    """``background: true`` answers at once (queued, no output), runs to its end on the server while GET
    says in_progress, and is then stored as any response (the official client's ``background=True``)."""
    gate = _Gate(monkeypatch, engine)
    r = client.responses.create(model=MODEL, input="Say hello.", background=True)
    assert r.status == "queued" and r.background is True and r.output == []
    assert gate.started.wait(10)
    running = client.responses.retrieve(r.id)
    assert running.status == "in_progress" and running.background is True
    gate.release()
    done = _until(server, r.id, "completed")
    assert done["background"] is True and done["output"][0]["content"][0]["text"] == "Hello world."
    # it continues as any stored response does
    follow = _post(server, {"input": "And?", "previous_response_id": r.id, "max_output_tokens": 2})
    assert follow.status_code == 200, follow.text


def test_a_background_response_is_cancelled_with_its_output_so_far(server, client, engine, monkeypatch):
    gate = _Gate(monkeypatch, engine)
    r = client.responses.create(model=MODEL, input="Say hello.", background=True)
    assert gate.started.wait(10)
    # a turn cannot continue from it while it runs; its input items are listed already
    early = _post(server, {"input": "And?", "previous_response_id": r.id})
    assert early.status_code == 400 and early.json()["error"]["param"] == "previous_response_id", early.text
    assert [i.type for i in client.responses.input_items.list(r.id).data] == ["message"]
    cancelled = client.responses.cancel(r.id)
    assert cancelled.status == "cancelled" and cancelled.output_text == "Hello"
    assert gate.aborted  # (the engine request itself was aborted)
    assert client.responses.retrieve(r.id).status == "cancelled"
    assert client.responses.cancel(r.id).status == "cancelled"  # (again: as it ended)
    gate.release()
    plain = client.responses.create(model=MODEL, input="Say hello.")
    with pytest.raises(openai.BadRequestError):
        client.responses.cancel(plain.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.cancel("resp_" + "0" * 32)


def test_a_background_stream_is_read_again_from_any_event(server, engine, monkeypatch):
    """A background stream's reader that goes away stops the reading, not the run: ``GET ?stream=true``
    with ``starting_after`` sends the events after that one, then the rest as they come."""
    gate = _Gate(monkeypatch, engine)
    body = {"model": MODEL, "input": "Say hello.", "background": True, "stream": True}
    first = []
    with httpx.stream("POST", server.url + "/v1/responses", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                first.append(json.loads(line[len("data: "):]))
                if first[-1]["type"] == "response.output_text.delta":
                    break  # (the client goes away)
    response_id = first[0]["response"]["id"]
    assert [(e["type"], e["response"]["status"]) for e in first[:2]] == [("response.created", "queued"),
                                                                          ("response.in_progress", "in_progress")]
    assert gate.started.wait(10) and not gate.aborted
    assert httpx.get(f"{server.url}/v1/responses/{response_id}", timeout=30).json()["status"] == "in_progress"

    def read(params: dict) -> list[dict]:
        with httpx.stream("GET", f"{server.url}/v1/responses/{response_id}", params={"stream": "true", **params},
                          timeout=60) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            gate.release()  # (while it runs: the rest comes as this reader reads)
            return [json.loads(line[len("data: "):]) for line in r.iter_lines() if line.startswith("data: ")]

    rest = read({"starting_after": first[-1]["sequence_number"]})
    events = first + rest
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[-1]["type"] == "response.completed"
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == "Hello world."
    assert _until(server, response_id, "completed")["output"] == events[-1]["response"]["output"]
    # once it has ended, from the store: all of it, or the events after one
    assert read({}) == events and read({"starting_after": 2}) == events[3:]
    plain = _post(server, {"input": "hi"}).json()
    again = httpx.get(f"{server.url}/v1/responses/{plain['id']}", params={"stream": "true"}, timeout=30)
    assert again.status_code == 400 and again.json()["error"]["param"] == "stream", again.text


def test_deleting_a_running_background_response_cancels_it(server, engine, monkeypatch):
    gate = _Gate(monkeypatch, engine)
    r = _post(server, {"input": "Say hello.", "background": True}).json()
    assert gate.started.wait(10)
    assert httpx.delete(f"{server.url}/v1/responses/{r['id']}", timeout=30).json()["deleted"] is True
    assert gate.aborted
    assert httpx.get(f"{server.url}/v1/responses/{r['id']}", timeout=30).status_code == 404


def test_a_background_response_needs_a_store_that_keeps_it(server):
    """With ``--max-stored-responses 0`` a background response would be dropped as it ends: a 400."""
    from hyla.server.errors import APIError
    from hyla.server.responses_protocol import ResponsesRequest

    routes = ResponsesRoutes(server.app.state.server, max_stored=0)
    with pytest.raises(APIError) as info:
        asyncio.run(routes.create(ResponsesRequest(model=MODEL, input="hi", background=True), request=None))
    assert info.value.status == 400 and info.value.param == "background"


def test_a_failed_background_response_is_stored_failed_and_not_continued(server, engine, monkeypatch):
    """An engine failure mid-run: the response is stored failed with its error (a client polls it), its
    input items listed, and a turn cannot continue from it (it has no answer)."""
    async def generate(*args, rid=None, **kwargs):
        async def chunks():
            yield {"text": "Hel", "output_ids": [0], "meta_info": {"id": rid, "prompt_tokens": 5,
                                                                   "completion_tokens": 1, "finish_reason": None}}
            raise RuntimeError("the engine broke")
        return _Stream(chunks(), lambda: None)

    monkeypatch.setattr(engine, "async_generate", generate)
    r = _post(server, {"input": "Say hello.", "background": True}).json()
    failed = _until(server, r["id"], "failed")
    assert failed["error"]["code"] == "server_error" and failed["output"] == []
    items = httpx.get(f"{server.url}/v1/responses/{r['id']}/input_items", timeout=30).json()["data"]
    assert [i["content"][0]["text"] for i in items] == ["Say hello."]
    again = _post(server, {"input": "And?", "previous_response_id": r["id"]})
    assert again.status_code == 400 and again.json()["error"]["param"] == "previous_response_id", again.text


@pytest.mark.parametrize("body, param", [
    pytest.param({"background": True, "store": False}, "background", id="background-not-stored"),
    pytest.param({"starting_after": 3}, "starting_after", id="starting-after-without-stream"),
])
def test_background_bad_requests_are_400_naming_the_field(server, client, body, param):
    if "starting_after" in body:
        stored = client.responses.create(model=MODEL, input="hi", max_output_tokens=2)
        r = httpx.get(f"{server.url}/v1/responses/{stored.id}", params=body, timeout=30)
    else:
        r = _post(server, {"input": "hi", **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_truncation_auto_drops_the_fewest_oldest_turns_that_make_room(server, client):
    """``truncation: "auto"``: a conversation longer than the context loses its oldest whole turns, the fewest
    that leave room for ``max_output_tokens``, the instructions kept (``disabled``, the default, is a 400);
    the prompt is that shorter conversation's, token for token."""
    context = server.app.state.server.engine.context_length
    turns = []
    for i in range(12):
        turns += [{"role": "user", "content": f"Question {i}: " + "apple " * 300},
                  {"role": "assistant", "content": f"Answer {i}: " + "pear " * 60}]
    turns.append({"role": "user", "content": "The last question."})
    body = {"input": turns, "instructions": INSTRUCTIONS, "max_output_tokens": 8}

    def count(b: dict) -> dict:
        return httpx.post(server.url + "/v1/responses/input_tokens", json={"model": MODEL, **b}, timeout=60).json()

    whole = _post(server, body)
    assert whole.status_code == 400 and whole.json()["error"]["code"] == "context_length_exceeded", whole.text
    auto = count({**body, "truncation": "auto"})["input_tokens"]
    fits = [k for k in range(13) if "input_tokens" in count({**body, "input": turns[2 * k:]})]
    assert fits and fits[0] > 1  # (several turns had to go)
    assert auto == count({**body, "input": turns[2 * fits[0]:]})["input_tokens"] and auto + 8 <= context
    r = client.responses.create(model=MODEL, truncation="auto", temperature=0, **body)
    assert r.status in ("completed", "incomplete") and r.truncation == "auto"
    assert r.usage.input_tokens == auto
    # a turn that continues it keeps the whole conversation, and is truncated anew
    again = client.responses.create(model=MODEL, previous_response_id=r.id, input="And then?", truncation="auto",
                                    instructions=INSTRUCTIONS, max_output_tokens=8)
    assert again.usage.input_tokens + 8 <= context
    # a last turn that does not fit by itself is the 400 it was
    alone = _post(server, {**body, "input": "pear " * (context + 10), "truncation": "auto"})
    assert alone.status_code == 400 and alone.json()["error"]["code"] == "context_length_exceeded", alone.text
