"""A min-heap of eviction candidates with lazy invalidation: the radix tree's eviction orders.

The tree keeps one ``LazyHeap`` per eviction order (KV leaves, checkpoints). Nothing is ever
removed from the middle of the heap:

* ``push(node)`` enters ``node`` at its current priority if it is a candidate; the node's earlier
  entry, if any, goes stale (each node has at most one live entry: a node → sequence-number map).
* ``pop()`` skips stale entries and entries of nodes that are no longer candidates; an entry whose
  stored priority differs from the node's current one (the node was used since it was queued)
  goes back in at its current priority instead of being returned. Priorities must therefore
  never *decrease* without a ``push`` (recency only grows).
* Stale entries are dropped in one pass when the heap outgrows twice its live entries (plus a
  constant): a push costs O(log n) amortized, and a pop O(log n) per entry it skips.

Entries are ``(priority, sequence number, node)``: equal priorities pop first-in, first-out, and
nodes are never compared. Nodes must be hashable by identity.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Any, Callable, Hashable

COMPACT_SLACK = 1024  # stale entries tolerated beyond twice the live ones


class LazyHeap:
    """Candidates ordered by ``priority(node)`` (lowest first); ``is_candidate(node)`` decides,
    at push and at pop, whether a node belongs here at all."""

    __slots__ = ("_priority", "_is_candidate", "_heap", "_live", "_seq")

    def __init__(self, priority: Callable[[Any], float], is_candidate: Callable[[Any], bool]) -> None:
        self._priority = priority
        self._is_candidate = is_candidate
        self._heap: list[tuple[float, int, Hashable]] = []
        self._live: dict[Hashable, int] = {}  # node -> sequence number of its one live entry
        self._seq = itertools.count()

    def __len__(self) -> int:
        """Entries held, stale ones included (what compaction bounds)."""
        return len(self._heap)

    def __contains__(self, node: Hashable) -> bool:
        """Whether ``node`` has a live entry (it was pushed as a candidate and not popped since)."""
        return node in self._live

    def push(self, node: Hashable) -> None:
        """(Re-)queue ``node`` at its current priority if it is a candidate, else do nothing."""
        if not self._is_candidate(node):
            return
        seq = next(self._seq)
        self._live[node] = seq
        heapq.heappush(self._heap, (self._priority(node), seq, node))
        if len(self._heap) > 2 * len(self._live) + COMPACT_SLACK:
            self._compact()

    def pop(self) -> Any:
        """Remove and return the candidate of lowest current priority; None when none is left."""
        heap, live, priority = self._heap, self._live, self._priority
        while heap:
            stored, seq, node = heapq.heappop(heap)
            if live.get(node) != seq:
                continue  # superseded by a later push, or discarded
            if not self._is_candidate(node):
                del live[node]
                continue
            current = priority(node)
            if current != stored:  # used since it was queued: back in, at its new place
                seq = next(self._seq)
                live[node] = seq
                heapq.heappush(heap, (current, seq, node))
                continue
            del live[node]
            return node
        return None

    def discard(self, node: Hashable) -> None:
        """Forget ``node`` (it left the tree): its entry, if any, goes stale."""
        self._live.pop(node, None)

    def clear(self) -> None:
        self._heap.clear()
        self._live.clear()

    def _compact(self) -> None:
        """Keep only live entries of candidates; O(len), amortized over the pushes that made the rest stale."""
        live, is_candidate = self._live, self._is_candidate
        kept = []
        for entry in self._heap:
            node = entry[2]
            if live.get(node) == entry[1]:
                if is_candidate(node):
                    kept.append(entry)
                else:
                    del live[node]
        heapq.heapify(kept)
        self._heap = kept
