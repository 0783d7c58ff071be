"""``LRUStore``: what the server keeps in memory for clients by id (stored responses, conversations), bounded
in number and in size, the least recently used dropped first."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class LRUStore(Generic[T]):
    """Values by id, at most ``capacity`` of them and ``max_bytes`` of their sizes (each value's, as its owner
    measures it), the least recently used dropped first; the one put or resized last is kept even where it alone
    is larger. ``ValueError`` for a limit that is not a non-negative integer. The event loop's (no lock)."""

    def __init__(self, what: str, capacity: int, max_bytes: int):
        for name, value in (("capacity", capacity), ("max_bytes", max_bytes)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{what} {name} must be a non-negative integer, got {value!r}")
        self.capacity, self.max_bytes = capacity, max_bytes
        self.bytes = 0  # the sizes of the values held
        self._items: OrderedDict[str, tuple[T, int]] = OrderedDict()

    def put(self, key: str, value: T, size: int) -> list[T]:
        """Keep ``value`` under ``key`` (in place of one there), the most recently used; returns what was
        dropped to make room (the one replaced is not among them)."""
        self.pop(key)
        self._items[key] = (value, size)
        self.bytes += size
        return self._shrink()

    def resize(self, key: str, size: int) -> list[T]:
        """``key``'s value grew (or shrank) to ``size``; it is the most recently used. Returns what was dropped."""
        value, old = self._items[key]
        self._items[key] = (value, size)
        self._items.move_to_end(key)
        self.bytes += size - old
        return self._shrink()

    def get(self, key: str) -> T | None:
        """``key``'s value (now the most recently used), or None."""
        entry = self._items.get(key)
        if entry is None:
            return None
        self._items.move_to_end(key)
        return entry[0]

    def size(self, key: str) -> int:
        """``key``'s size, as last put or resized."""
        return self._items[key][1]

    def pop(self, key: str) -> T | None:
        """Forget ``key``: its value, or None where none was kept."""
        entry = self._items.pop(key, None)
        if entry is None:
            return None
        self.bytes -= entry[1]
        return entry[0]

    def __contains__(self, key: Any) -> bool:
        return key in self._items

    def __len__(self) -> int:
        return len(self._items)

    def _shrink(self) -> list[T]:
        dropped = []
        while self._items and (len(self._items) > self.capacity or (self.bytes > self.max_bytes and len(self._items) > 1)):
            key = next(iter(self._items))
            dropped.append(self.pop(key))
        return dropped
