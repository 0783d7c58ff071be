"""The conversations the Conversations API keeps (``conversations.py``: its endpoints; ``responses_routes``: the
turns that read and extend them): ``Conversation`` and ``ConversationStore``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hyla.server.errors import APIError
from hyla.server.lru_store import LRUStore
from hyla.server.protocol import DEFAULT_STORED_RESPONSE_BYTES, DEFAULT_STORED_RESPONSES, text_chars


@dataclass
class Conversation:
    id: str
    created_at: int
    metadata: dict[str, str]
    items: list[dict[str, Any]] = field(default_factory=list)  # in order, each as GET .../items lists it

    def card(self) -> dict[str, Any]:
        """The conversation object (OpenAI's: no items)."""
        return {"id": self.id, "object": "conversation", "created_at": self.created_at, "metadata": self.metadata}

    def size(self) -> int:
        """What it holds, as ``LRUStore`` counts it: the characters of its items' and metadata's strings and keys."""
        return text_chars(self.items, keys=True) + text_chars(self.metadata, keys=True)


class ConversationStore:
    """Conversations by id, in memory (``LRUStore``: at most ``capacity`` of them and ``max_bytes`` of their
    ``Conversation.size``, the least recently used dropped first). The event loop's."""

    def __init__(self, capacity: int = DEFAULT_STORED_RESPONSES, max_bytes: int = DEFAULT_STORED_RESPONSE_BYTES):
        self._store: LRUStore[Conversation] = LRUStore("ConversationStore", capacity, max_bytes)

    @property
    def capacity(self) -> int:
        return self._store.capacity

    def put(self, conversation: Conversation) -> None:
        self._store.put(conversation.id, conversation, conversation.size())

    def get(self, conversation_id: str, param: str = "conversation_id") -> Conversation:
        """The conversation, or a 404 naming ``param``."""
        found = self._store.get(conversation_id)
        if found is None:
            raise APIError(404, f"Conversation with id {conversation_id!r} not found.", type="not_found_error",
                           param=param, code="conversation_not_found")
        return found

    def extend(self, conversation_id: str, items: list[dict[str, Any]]) -> None:
        """Add ``items`` (as listed) at the end of the conversation, if it is still held (a response that ends
        after its conversation was deleted adds nothing). Measured by what it adds (a long conversation is not
        measured again at every turn)."""
        found = self._store.get(conversation_id)
        if found is not None:
            found.items.extend(items)
            self._grew(found, text_chars(items, keys=True))

    def delete(self, conversation_id: str) -> bool:
        return self._store.pop(conversation_id) is not None

    def remove_item(self, conversation: Conversation, index: int) -> None:
        """Its item at ``index`` is gone."""
        gone = conversation.items.pop(index)
        self._grew(conversation, -text_chars([gone], keys=True))

    def set_metadata(self, conversation: Conversation, metadata: dict[str, str]) -> None:
        before = text_chars(conversation.metadata, keys=True)
        conversation.metadata = metadata
        self._grew(conversation, text_chars(metadata, keys=True) - before)

    def _grew(self, conversation: Conversation, by: int) -> None:
        if conversation.id in self._store:
            self._store.resize(conversation.id, self._store.size(conversation.id) + by)

    def __len__(self) -> int:
        return len(self._store)
