"""OpenAI's Conversations API: ``POST /v1/conversations``, ``GET``, ``POST`` and ``DELETE
/v1/conversations/{id}``, ``GET`` and ``POST /v1/conversations/{id}/items``, ``GET`` and ``DELETE
/v1/conversations/{id}/items/{item_id}``.

A conversation is a list of items (the Responses API's: messages, reasoning, function calls and their
outputs), with an id (``conv_<hex>``) and metadata. A Responses request that names it (``conversation``) is
rendered from its items, then the request's input (``ResponsesRoutes.prompt``), and when the response ends
(completed or incomplete) its input items and output items are added to it (``ConversationStore.extend``):
the next turn names the conversation alone, as ``previous_response_id`` names a response, and its prompt
renders the same token prefix, so the prefix cache hits it. Items are kept as ``GET .../items`` lists them
(``responses_routes.listed_item``; output items as the response gave them). Conversations are held in
memory (``conversation_store.ConversationStore``: the least recently used dropped first, bounded as the stored responses are,
``--max-stored-responses`` and ``--max-stored-response-bytes``, apart from them), on the worker that made
them (``hyla route`` sends what names one there).
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from hyla.server.conversation_store import Conversation
from hyla.server.errors import APIError
from hyla.server.responses_protocol import (ConversationCreateRequest, ConversationItemsRequest,
                                            ConversationUpdateRequest, InputItem)
from hyla.server.responses_routes import ResponsesRoutes, check_duplicates, item_page, listed_item, new_id


class ConversationsRoutes:
    """The Conversations endpoints, over the ``ResponsesRoutes`` whose turns read and extend the conversations
    (``ResponsesRoutes.conversations``) and whose stored output items an ``item_reference`` names."""

    def __init__(self, responses: ResponsesRoutes):
        self.responses = responses
        self.store = responses.conversations

    def router(self) -> APIRouter:
        router = APIRouter()
        router.post("/v1/conversations")(self.create)
        router.get("/v1/conversations/{conversation_id}")(self.retrieve)
        router.post("/v1/conversations/{conversation_id}")(self.update)
        router.delete("/v1/conversations/{conversation_id}")(self.delete)
        router.get("/v1/conversations/{conversation_id}/items")(self.list_items)
        router.post("/v1/conversations/{conversation_id}/items")(self.add_items)
        router.get("/v1/conversations/{conversation_id}/items/{item_id}")(self.retrieve_item)
        router.delete("/v1/conversations/{conversation_id}/items/{item_id}")(self.delete_item)
        return router

    async def create(self, body: ConversationCreateRequest) -> JSONResponse:
        """A new conversation, with ``items`` (references resolved; each given an id where it has none) and
        ``metadata``. A 400 on a server that keeps none (``--max-stored-responses 0``)."""
        if self.store.capacity == 0:
            raise APIError(400, "this server keeps no conversations (--max-stored-responses 0)")
        conversation = Conversation(new_id("conv"), int(time.time()), body.metadata or {})
        conversation.items = self._listed([], body.items or [])
        self.store.put(conversation)
        return JSONResponse(conversation.card())

    async def retrieve(self, conversation_id: str) -> JSONResponse:
        return JSONResponse(self.store.get(conversation_id).card())

    async def update(self, conversation_id: str, body: ConversationUpdateRequest) -> JSONResponse:
        """The conversation with ``metadata`` in place of its own."""
        conversation = self.store.get(conversation_id)
        self.store.set_metadata(conversation, body.metadata)
        return JSONResponse(conversation.card())

    async def delete(self, conversation_id: str) -> JSONResponse:
        """The conversation is gone (its items too; the responses made in it stay where they are stored)."""
        self.store.get(conversation_id)  # (a 404 where none is held)
        self.store.delete(conversation_id)
        return JSONResponse({"id": conversation_id, "object": "conversation.deleted", "deleted": True})

    async def list_items(self, conversation_id: str, request: Request) -> JSONResponse:
        """One page of its items (``responses_routes.item_page``: ``order``, the latest first by default;
        ``limit``; ``after``)."""
        return JSONResponse(item_page(self.store.get(conversation_id).items, request.query_params, "conversation"))

    async def add_items(self, conversation_id: str, body: ConversationItemsRequest) -> JSONResponse:
        """``items`` added at its end (an id already in it is a 400): the list of them as added."""
        conversation = self.store.get(conversation_id)
        added = self._listed(conversation.items, body.items)
        self.store.extend(conversation_id, added)
        return JSONResponse({"object": "list", "data": added, "first_id": added[0]["id"], "last_id": added[-1]["id"],
                             "has_more": False})

    async def retrieve_item(self, conversation_id: str, item_id: str) -> JSONResponse:
        conversation = self.store.get(conversation_id)
        return JSONResponse(conversation.items[self._index(conversation, item_id)])

    async def delete_item(self, conversation_id: str, item_id: str) -> JSONResponse:
        """The item is gone from the conversation: the conversation object."""
        conversation = self.store.get(conversation_id)
        self.store.remove_item(conversation, self._index(conversation, item_id))
        return JSONResponse(conversation.card())

    def _listed(self, held: list[dict[str, Any]], items: list[InputItem]) -> list[dict[str, Any]]:
        """``items`` to add after ``held``: references resolved (a stored response's output item), none whose
        id is held or given twice (a 400 naming ``items``), each as listed."""
        resolved = self.responses.resolve(items, "items")
        check_duplicates(held, resolved, "items")
        return [listed_item(item) for item in resolved]

    @staticmethod
    def _index(conversation: Conversation, item_id: str) -> int:
        for i, item in enumerate(conversation.items):
            if item["id"] == item_id:
                return i
        raise APIError(404, f"Item with id {item_id!r} not found.", type="not_found_error", param="item_id",
                       code="item_not_found")
