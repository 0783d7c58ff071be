"""OpenAI's Conversations API (``hyla/server/conversations.py``), through the official ``openai`` client: a
conversation's turns render as a ``previous_response_id`` chain does (the same prompt, the same answer, the
cache's hit), its items as the client reads them back, and the endpoints' errors."""

from __future__ import annotations

import httpx
import openai
import pytest

from hyla.server.conversation_store import Conversation, ConversationStore
from test_server_openai import MODEL, client, engine, server  # noqa: F401  (fixtures)


def _ask(client, text: str, **kw):  # noqa: F811
    return client.responses.create(model=MODEL, input=text, max_output_tokens=6, temperature=0, **kw)


def test_a_conversations_turns_are_a_chain_of_responses(client):  # noqa: F811
    """Two turns in a conversation answer as two turns chained by ``previous_response_id``: the same prompt
    tokens and text, the second turn's prompt cached through the first's answer; the conversation then lists
    both turns' input and output items, in order, the outputs with the responses' own ids."""
    conversation = client.conversations.create(metadata={"topic": "chains"})
    assert conversation.id.startswith("conv_") and conversation.metadata == {"topic": "chains"}
    r1 = _ask(client, "Conversation test Q: first question?", conversation=conversation.id, instructions="Be terse.")
    counted = client.post("/responses/input_tokens", cast_to=object, body={
        "model": MODEL, "input": "And a follow-up?", "conversation": conversation.id, "instructions": "Be terse."})
    r2 = _ask(client, "And a follow-up?", conversation={"id": conversation.id}, instructions="Be terse.")
    assert r1.conversation.id == r2.conversation.id == conversation.id
    c1 = _ask(client, "Conversation test Q: first question?", instructions="Be terse.")
    c2 = _ask(client, "And a follow-up?", previous_response_id=c1.id, instructions="Be terse.")
    assert (r1.output_text, r2.output_text) == (c1.output_text, c2.output_text)
    assert r2.usage.input_tokens == c2.usage.input_tokens
    assert counted["input_tokens"] == r2.usage.input_tokens  # (the turn's prompt, counted before it ran)
    again = client.post("/responses/input_tokens", cast_to=object, body={
        "model": MODEL, "input": "And a follow-up?", "conversation": conversation.id, "instructions": "Be terse."})
    assert again["input_tokens"] > r2.usage.input_tokens  # (r2's question and answer in it now)
    assert r1.usage.input_tokens + r1.usage.output_tokens - 1 <= r2.usage.input_tokens_details.cached_tokens
    items = client.conversations.items.list(conversation.id, order="asc").data
    assert [(i.type, getattr(i, "role", None)) for i in items] == [("message", "user"), ("message", "assistant")] * 2
    assert [items[1].id, items[3].id] == [r1.output[0].id, r2.output[0].id]
    assert items[3].content[0].text == r2.output_text and items[2].content[0].text == "And a follow-up?"
    # a streamed turn adds its items as it ends
    events = list(client.responses.create(model=MODEL, input="A third, streamed.", conversation=conversation.id,
                                          max_output_tokens=6, temperature=0, stream=True))
    r3 = events[-1].response  # (response.completed, or response.incomplete: 6 tokens)
    latest = client.conversations.items.list(conversation.id, limit=2).data  # (the latest first)
    assert [latest[0].id, latest[1].content[0].text] == [r3.output[0].id, "A third, streamed."]


def test_conversation_endpoints(server, client):  # noqa: F811
    """Create with items (an ``item_reference`` resolved to a stored output item), add, list a page at a time,
    retrieve and delete an item, update the metadata, delete the conversation; each broken rule a 4xx naming its
    field, nothing changed."""
    stored = _ask(client, "Something to refer to.")
    conversation = client.conversations.create(items=[
        {"type": "message", "role": "user", "content": "Hello."},
        {"type": "item_reference", "id": stored.output[0].id}])
    added = client.conversations.items.create(conversation.id, items=[
        {"type": "message", "role": "user", "content": "More.", "id": "msg_mine"}]).data
    assert [a.id for a in added] == ["msg_mine"]
    page1 = client.conversations.items.list(conversation.id, order="asc", limit=2)
    page2 = client.conversations.items.list(conversation.id, order="asc", limit=2, after=page1.data[-1].id)
    listed = page1.data + page2.data
    assert [i.content[0].text for i in listed] == ["Hello.", stored.output_text, "More."]
    assert page1.has_more and not page2.has_more and listed[1].id == stored.output[0].id
    assert client.conversations.items.retrieve("msg_mine", conversation_id=conversation.id).id == "msg_mine"
    after = client.conversations.items.delete("msg_mine", conversation_id=conversation.id)
    assert after.id == conversation.id
    assert len(client.conversations.items.list(conversation.id).data) == 2
    updated = client.conversations.update(conversation.id, metadata={"k": "v"})
    assert updated.metadata == client.conversations.retrieve(conversation.id).metadata == {"k": "v"}

    url, cid = server.url + "/v1/conversations", conversation.id
    for method, path, body, status, param in [
            ("post", "", {"items": [{"type": "nope"}]}, 400, "items.0.type"),
            ("post", "", {"items": [{"role": "user", "content": "x"}] * 21}, 400, "items"),
            ("post", "", {"metadata": {"k" * 65: "v"}}, 400, "metadata"),
            ("post", "", {"items": [{"type": "item_reference", "id": "msg_gone"}]}, 400, "items.0.id"),
            ("post", f"/{cid}/items", {"items": [{"role": "user", "content": "x", "id": listed[0].id}]}, 400, "items"),
            ("post", f"/{cid}/items", {"items": []}, 400, "items"),
            ("get", f"/{cid}/items/msg_none", None, 404, "item_id"),
            ("get", f"/{cid}/items?limit=0", None, 400, "limit"),
            ("get", "/conv_none", None, 404, "conversation_id"),
            ("post", "/conv_none/items", {"items": [{"role": "user", "content": "x"}]}, 404, "conversation_id")]:
        answer = httpx.request(method, url + path, json=body, timeout=30)
        assert (answer.status_code, answer.json()["error"]["param"]) == (status, param), (path, answer.text)
    assert len(client.conversations.items.list(cid).data) == 2  # (nothing added by the refusals)
    with pytest.raises(openai.BadRequestError, match="cannot be used together"):
        _ask(client, "Both?", conversation=cid, previous_response_id=stored.id)
    page = httpx.get(f"{url}/{cid}/items?after=msg_none", timeout=30)
    assert page.status_code == 400 and "in this conversation" in page.json()["error"]["message"]
    assert client.conversations.delete(cid).deleted
    with pytest.raises(openai.NotFoundError):
        client.conversations.retrieve(cid)
    with pytest.raises(openai.NotFoundError, match="not found") as gone:
        _ask(client, "Gone?", conversation=cid)
    assert gone.value.body["param"] == "conversation"


def test_a_turn_that_fails_adds_nothing_and_an_incomplete_one_adds_its_items(server, client, engine):  # noqa: F811
    conversation = client.conversations.create()
    cut = client.responses.create(model=MODEL, input="Say a lot.", conversation=conversation.id, max_output_tokens=1,
                                  temperature=0)
    assert cut.status == "incomplete"
    assert len(client.conversations.items.list(conversation.id).data) == 2
    too_long = "word " * (engine.context_length + 10)
    with pytest.raises(openai.BadRequestError):
        _ask(client, too_long, conversation=conversation.id)
    assert len(client.conversations.items.list(conversation.id).data) == 2


def test_conversation_store_is_bounded_and_grows_with_its_items():
    store = ConversationStore(capacity=2, max_bytes=10_000)
    for i in range(3):
        store.put(Conversation(f"conv_{i}", 0, {}))
    assert len(store) == 2 and [c for c in ("conv_0", "conv_1", "conv_2") if c in store._store] == ["conv_1", "conv_2"]
    store.extend("conv_1", [{"id": "x", "text": "a" * 20_000}])  # (alone larger than the bound: kept, the other goes)
    assert len(store) == 1 and store.get("conv_1").items[0]["id"] == "x"
    store.extend("conv_9", [{"id": "y"}])  # (deleted meanwhile: nothing)
    held = store.get("conv_1")  # measured as it changes, as it would be measured whole
    store.extend("conv_1", [{"id": "y", "content": [{"text": "bb"}]}, {"id": "z", "n": 3}])
    store.set_metadata(held, {"key": "value"})
    store.remove_item(held, 0)
    assert store._store.size("conv_1") == held.size() == store._store.bytes
    assert store.delete("conv_1") and len(store) == 0 and store._store.bytes == 0
    with pytest.raises(ValueError, match="capacity must be a non-negative integer"):
        ConversationStore(capacity=-1)


def test_a_server_that_keeps_no_conversations_refuses_to_make_one():
    """``--max-stored-responses 0``: a new conversation would be dropped as it is made (its id a 404 at once)."""
    import asyncio

    from hyla.server.conversations import ConversationsRoutes
    from hyla.server.errors import APIError
    from hyla.server.responses_protocol import ConversationCreateRequest
    from hyla.server.responses_routes import ResponsesRoutes

    routes = ConversationsRoutes(ResponsesRoutes(None, max_stored=0))
    with pytest.raises(APIError, match="keeps no conversations"):
        asyncio.run(routes.create(ConversationCreateRequest()))
    assert len(routes.store) == 0
