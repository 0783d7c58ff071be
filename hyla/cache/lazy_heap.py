"""A min-heap of eviction candidates with lazy invalidation: the radix tree's eviction orders.

The tree keeps one ``LazyHeap`` per eviction order (KV leaves, checkpoints, replaceable
checkpoints). Nothing is ever removed from the middle of the heap:

* ``push(node)`` enters ``node`` at its current priority if it is a candidate. Each node has at
  most one live entry per heap: the node's ``heap_marks[slot]`` holds the sequence number of that
  entry (-1: none), so a new push makes the older entry stale.
* ``pop()`` skips stale entries and entries of nodes that are no longer candidates (a node that
  left the tree needs no notice: it is no candidate any more); an entry whose stored priority
  differs from the node's current one (the node was used since it was queued) goes back in at its
  current priority instead of being returned. Priorities must therefore never *decrease* without
  a ``push`` (recency only grows).
* Dead entries are dropped in one pass when the heap has doubled (plus a constant) since its last
  pass: a push costs O(log n) amortized, a pop O(log n) per entry it skips, and the heap never
  holds more than twice what its last compaction kept, plus that constant.

Entries are ``(priority, sequence number, node)``: equal priorities pop first-in, first-out, and
nodes are never compared.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Any, Callable

COMPACT_SLACK = 1024  # entries tolerated beyond twice what the last compaction kept
NO_ENTRY = -1  # heap_marks value of a node without a live entry


class LazyHeap:
    """Candidates ordered by ``priority(node)`` (lowest first); ``is_candidate(node)`` decides, at
    push and at pop, whether a node belongs here at all. Nodes carry a ``heap_marks`` list; this
    heap owns its index ``slot``."""

    __slots__ = ("_priority", "_is_candidate", "_slot", "_heap", "_seq", "_limit")

    def __init__(self, priority: Callable[[Any], float], is_candidate: Callable[[Any], bool], slot: int) -> None:
        self._priority = priority
        self._is_candidate = is_candidate
        self._slot = slot
        self._heap: list[tuple[float, int, Any]] = []
        self._seq = itertools.count()
        self._limit = COMPACT_SLACK  # compact when the heap grows past this

    def __len__(self) -> int:
        """Entries held, dead ones included (what compaction bounds)."""
        return len(self._heap)

    def __contains__(self, node: Any) -> bool:
        """Whether ``node`` has a live entry (pushed as a candidate, not popped or dropped since)."""
        return node.heap_marks[self._slot] != NO_ENTRY

    def push(self, node: Any) -> None:
        """(Re-)queue ``node`` at its current priority if it is a candidate, else do nothing."""
        if not self._is_candidate(node):
            return
        seq = next(self._seq)
        node.heap_marks[self._slot] = seq
        heapq.heappush(self._heap, (self._priority(node), seq, node))
        if len(self._heap) > self._limit:
            self._compact()

    def pop(self) -> Any:
        """Remove and return the candidate of lowest current priority; None when none is left."""
        heap, priority, slot = self._heap, self._priority, self._slot
        while heap:
            stored, seq, node = heapq.heappop(heap)
            marks = node.heap_marks
            if marks[slot] != seq:
                continue  # superseded by a later push
            if not self._is_candidate(node):
                marks[slot] = NO_ENTRY
                continue
            current = priority(node)
            if current != stored:  # used since it was queued: back in, at its new place
                seq = next(self._seq)
                marks[slot] = seq
                heapq.heappush(heap, (current, seq, node))
                continue
            marks[slot] = NO_ENTRY
            return node
        return None

    def clear(self) -> None:
        """Drop every entry."""
        slot = self._slot
        for _, seq, node in self._heap:
            if node.heap_marks[slot] == seq:
                node.heap_marks[slot] = NO_ENTRY
        self._heap = []
        self._limit = COMPACT_SLACK

    def _compact(self) -> None:
        """Keep only live entries of candidates; O(len), amortized over the pushes since the last pass."""
        slot, is_candidate = self._slot, self._is_candidate
        kept = []
        for entry in self._heap:
            node = entry[2]
            if node.heap_marks[slot] == entry[1]:
                if is_candidate(node):
                    kept.append(entry)
                else:
                    node.heap_marks[slot] = NO_ENTRY
        heapq.heapify(kept)
        self._heap = kept
        self._limit = 2 * len(kept) + COMPACT_SLACK
