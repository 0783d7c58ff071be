"""A min-heap of eviction candidates with lazy invalidation: the radix tree's eviction orders.

The tree keeps one ``LazyHeap`` per eviction order (KV leaves, checkpoints, replaceable
checkpoints). Nothing is ever removed from the middle of the heap:

* ``push(node)`` enters ``node`` at its current priority if it is a candidate. The node attribute
  named by the heap's ``mark`` keeps the sequence number of the node's latest entry, so a new push
  makes the older entry stale: each node has at most one live entry per heap.
* ``drain()`` pops candidates in order of current priority, lowest first, for as long as the
  caller iterates. It skips stale entries and entries of nodes that are no longer candidates (a
  node that left the tree needs no notice: it is no candidate any more); an entry whose stored
  priority differs from the node's current one (the node was used since it was queued) goes back
  in at its current priority instead. Priorities must therefore never *decrease* without a
  ``push`` (recency only grows).
* Dead entries are dropped in one pass when the heap outgrows twice ``max_live()`` (a bound on
  the candidates: the tree's node count), plus a constant. The bound is read only when the heap
  passes the size it allowed at the last look, so a growing tree costs no pass at all: a push
  costs O(log n) amortized, and drain O(log n) per entry it pops.

Entries are ``(priority, sequence number, node)``: equal priorities pop first-in, first-out, and
nodes are never compared.
"""

from __future__ import annotations

import heapq
import itertools
import operator
from typing import Any, Callable, Iterator

COMPACT_SLACK = 1024  # entries tolerated beyond twice max_live()
NO_ENTRY = -1  # initial mark: never a sequence number


class LazyHeap:
    """Candidates ordered by ``priority(node)`` (lowest first); ``is_candidate(node)`` decides, at
    push and at pop, whether a node belongs here at all. ``mark`` names the node attribute this
    heap owns (one per heap; nodes start with it set to ``NO_ENTRY``); ``max_live()`` bounds the
    number of candidates (it sizes compaction)."""

    __slots__ = ("_priority", "_is_candidate", "_mark", "_max_live", "_get_mark", "_heap", "_seq", "_limit")

    def __init__(self, priority: Callable[[Any], float], is_candidate: Callable[[Any], bool], mark: str,
                 max_live: Callable[[], int]) -> None:
        self._priority = priority
        self._is_candidate = is_candidate
        self._mark = mark
        self._max_live = max_live
        self._get_mark = operator.attrgetter(mark)
        self._heap: list[tuple[float, int, Any]] = []
        self._seq = itertools.count()
        self._limit = COMPACT_SLACK  # look at max_live() when the heap grows past this

    def __len__(self) -> int:
        """Entries held, dead ones included (what compaction bounds)."""
        return len(self._heap)

    def queued(self) -> set[int]:
        """``id`` of every node with a live entry (pushed as a candidate, not popped since); O(len)."""
        get_mark = self._get_mark
        return {id(node) for _, seq, node in self._heap if get_mark(node) == seq}

    def push(self, node: Any) -> None:
        """(Re-)queue ``node`` at its current priority if it is a candidate, else do nothing."""
        if not self._is_candidate(node):
            return
        seq = next(self._seq)
        setattr(node, self._mark, seq)
        heapq.heappush(self._heap, (self._priority(node), seq, node))
        if len(self._heap) > self._limit:
            self._limit = 2 * self._max_live() + COMPACT_SLACK
            if len(self._heap) > self._limit:
                self._compact()

    def drain(self) -> Iterator[Any]:
        """Pop and yield candidates, lowest current priority first, until the heap runs out or the
        caller stops iterating. The caller may push (and so compact) between two steps."""
        priority, get_mark, is_candidate = self._priority, self._get_mark, self._is_candidate
        while self._heap:
            heap = self._heap  # re-read: a push between two steps may have compacted it
            stored, seq, node = heapq.heappop(heap)
            if get_mark(node) != seq or not is_candidate(node):
                continue  # superseded by a later push, or no candidate any more
            current = priority(node)
            if current != stored:  # used since it was queued: back in, at its new place
                seq = next(self._seq)
                setattr(node, self._mark, seq)
                heapq.heappush(heap, (current, seq, node))
                continue
            yield node

    def clear(self) -> None:
        """Drop every entry."""
        self._heap = []
        self._limit = COMPACT_SLACK

    def _compact(self) -> None:
        """Keep only live entries of candidates; O(len), amortized over the (at least ``len / 2``)
        dead entries it drops."""
        get_mark, is_candidate = self._get_mark, self._is_candidate
        kept = [entry for entry in self._heap if get_mark(entry[2]) == entry[1] and is_candidate(entry[2])]
        heapq.heapify(kept)
        self._heap = kept
