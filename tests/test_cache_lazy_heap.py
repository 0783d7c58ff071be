"""LazyHeap: the radix tree's eviction orders (push, drain in current-priority order, stale entries, compaction)."""

from __future__ import annotations

import random

from hyla.cache.lazy_heap import COMPACT_SLACK, NO_ENTRY, LazyHeap


class Item:
    """A stand-in for a tree node: a mutable priority and candidacy, and the mark a heap owns."""

    def __init__(self, name: str, priority: float, candidate: bool = True) -> None:
        self.name = name
        self.priority = priority
        self.candidate = candidate
        self.mark = NO_ENTRY

    def __repr__(self) -> str:
        return f"Item({self.name}, {self.priority})"


def make_heap(calls: list[str] | None = None, max_live: int = 10) -> LazyHeap:
    def priority(item: Item) -> float:
        if calls is not None:
            calls.append(item.name)
        return item.priority

    return LazyHeap(priority, lambda item: item.candidate, mark="mark", max_live=lambda: max_live)


def names(heap: LazyHeap, limit: int | None = None) -> list[str]:
    """Names of what ``drain`` yields (all, or the first ``limit``)."""
    out = []
    for item in heap.drain():
        out.append(item.name)
        if len(out) == limit:
            break
    return out


def test_drains_lowest_priority_first_and_fifo_among_equals() -> None:
    heap = make_heap()
    for name, p in [("a", 3), ("b", 1), ("c", 2), ("d", 1)]:
        heap.push(Item(name, p))
    assert names(heap) == ["b", "d", "c", "a"]
    assert names(heap) == [] and len(heap) == 0


def test_stopping_early_leaves_the_rest_queued() -> None:
    heap = make_heap()
    items = [Item(str(i), i) for i in range(5)]
    for item in items:
        heap.push(item)
    assert names(heap, limit=2) == ["0", "1"]
    assert heap.queued() == {id(item) for item in items[2:]}
    heap.push(Item("x", -1))  # pushes between two drains (the tree does it between two steps)
    assert names(heap) == ["x", "2", "3", "4"]


def test_non_candidates_are_not_pushed_and_are_dropped_when_reached() -> None:
    heap = make_heap()
    a, b = Item("a", 1), Item("b", 2, candidate=False)
    heap.push(a)
    heap.push(b)
    assert heap.queued() == {id(a)} and len(heap) == 1
    a.candidate = False  # e.g. a leaf that got a child, or an evicted node: no notice needed
    assert names(heap) == [] and heap.queued() == set()


def test_a_changed_priority_is_seen_at_pop_without_a_push() -> None:
    calls: list[str] = []
    heap = make_heap(calls)
    a, b, c = Item("a", 1), Item("b", 2), Item("c", 3)
    for item in (a, b, c):
        heap.push(item)
    a.priority = 10  # a was used: recency grew, nobody told the heap
    calls.clear()
    assert names(heap, limit=1) == ["b"]  # a went back in at 10 on the way
    assert calls == ["a", "b"]
    assert names(heap) == ["c", "a"]


def test_a_push_supersedes_the_earlier_entry() -> None:
    heap = make_heap()
    a, b = Item("a", 5), Item("b", 3)
    heap.push(a)
    heap.push(b)
    a.priority = 1  # a *lower* priority must be pushed to count (policies call refresh_priority)
    heap.push(a)
    assert len(heap) == 3  # the old entry of a is stale, not removed
    assert names(heap) == ["a", "b"]  # a once, at its new place


def test_churn_is_compacted_to_twice_the_live_bound() -> None:
    heap = make_heap(max_live=10)
    items = [Item(str(i), i) for i in range(10)]
    rng = random.Random(0)
    for step in range(20_000):
        item = rng.choice(items)
        item.priority = step
        heap.push(item)
        assert len(heap) <= 2 * 10 + COMPACT_SLACK
    assert sorted(names(heap), key=int) == [str(i) for i in range(10)]


def test_entries_of_departed_nodes_are_dropped_without_notice() -> None:
    """Nodes that leave (stop being candidates) while queued cost no call: their entries go at the
    next compaction, so the heap stays bounded by what can be live."""
    heap = make_heap(max_live=500)
    for wave in range(20):
        items = [Item(f"{wave}.{i}", i) for i in range(500)]
        for item in items:
            heap.push(item)
        for item in items:
            item.candidate = False  # e.g. evicted through another order
        assert len(heap) <= 2 * 500 + COMPACT_SLACK
    assert names(heap) == [] and len(heap) == 0


def test_a_growing_population_is_never_compacted() -> None:
    calls: list[str] = []
    live: list[Item] = []

    def is_candidate(item: Item) -> bool:
        calls.append("candidate")
        return True

    heap = LazyHeap(lambda item: item.priority, is_candidate, mark="mark", max_live=lambda: len(live))
    for i in range(5000):
        live.append(Item(str(i), i))
        heap.push(live[-1])
    assert calls.count("candidate") == 5000  # one test per push, no compaction pass
    assert len(heap) == 5000


def test_clear_empties_the_heap() -> None:
    heap = make_heap()
    a = Item("a", 1)
    heap.push(a)
    heap.clear()
    assert len(heap) == 0 and heap.queued() == set() and names(heap) == []
