"""Where cached tokens went: an opt-in record of what a ``RadixCache`` gave back and why, and the
attribution of a request's missing hit to it.

A study tool (``benchmarks/cache_pressure.py``; ``Engine.record_cache_events()``). The tree calls
``removed`` for every node whose KV or checkpoint leaves it; its user labels each eviction with
what needed the room (``because``) and reports the checkpoints it wanted but found no room for
(``dropped``), each admission's cached prefix (``admitted``), each release (``released``) and the
KV held by running requests after each allocation (``sample_usage``). Every record is kept, with
its token path: attach a ledger for a study, not to a long-running server.

``explain(key, wanted)`` splits the ``wanted - hit`` tokens a request's first admission missed
(``wanted``: what an ideal cache would have served, e.g. the previous turn of its chat) into
``(category, detail)`` counts:

* ``"KV evicted"`` — positions ``[KV match, wanted)`` whose KV had been in the tree, each labelled
  by the latest removal that covered it: how (a KV eviction, a checkpoint eviction that took its
  leaf, ...) and for what (an admission, running requests' growth, a checkpoint, ...);
* ``"checkpoint evicted"`` — the KV is there but the state is not: from the hit to the deepest
  checkpoint in between that was evicted (its class — speculative, superseded or ordinary — how
  and for what);
* ``"no room for a checkpoint"`` — from there to the deepest position in between where the user
  wanted a checkpoint and the state pool had no room (``dropped``: which kind);
* ``"no checkpoint taken"`` — the rest up to the last grid position the KV match reaches: no
  checkpoint was asked for there;
* ``"off the checkpoint grid"`` — KV past that grid position (e.g. a shared system prompt shorter
  than the grid): no checkpoint may end there;
* ``"never cached"`` — KV positions no removal explains (the tokens differ from what was cached,
  e.g. a previous turn's output that diverged at a floating-point tie).

Positions are token counts from the root, paths compare exactly (and by namespace), and an event
counts only if it happened before the admission. Nothing here touches a pool.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import dataclass
from typing import Hashable, Iterator, Sequence

from hyla.cache.radix_types import TreeNode, namespace_key


@dataclass(frozen=True)
class Removal:
    """A node's KV (and with it any checkpoint at its end) or only its checkpoint left the tree."""

    time: int
    namespace: tuple  # namespace_key(namespace), as the tree keys it
    path: tuple  # token ids from the root through the node's end
    start: int  # the node's edge is path[start:]
    kv: bool  # the edge's KV left (else only the checkpoint at its end)
    checkpoint: str | None  # class of the checkpoint that left: "speculative", "superseded", "ordinary"; None
    how: str  # which tree operation: see RadixCache
    cause: str  # what needed the room (the label in force, ``because``)


@dataclass(frozen=True)
class Drop:
    """A checkpoint the user wanted at ``position`` (the end of ``path``) and found no room for."""

    time: int
    namespace: tuple  # namespace_key
    path: tuple
    what: str


@dataclass(frozen=True)
class Admission:
    time: int
    namespace: tuple  # namespace_key
    tokens: tuple  # the request's tokens at admission (prompt, + output so far after a retraction)
    hit: int  # cached prefix served (ends at a checkpoint)
    kv_match: int  # how far the KV alone matched


class CacheLedger:
    """The record. ``time`` ticks once per record; ``cause`` is the label evictions get now."""

    garbage = "no checkpoint left at or below"  # the ``how`` of KV given back for want of a checkpoint

    def __init__(self) -> None:
        self.time = 0
        self.cause = "other"
        self.removals: list[Removal] = []
        self.drops: list[Drop] = []
        self.admissions: dict[Hashable, list[Admission]] = {}  # per request key, in order
        self.releases: dict[Hashable, list[int]] = {}  # per request key: times it released its memory
        self.usage: list[tuple[int, int, int]] = []  # (time, KV slots held by running requests, running requests)

    def _tick(self) -> int:
        self.time += 1
        return self.time

    @contextlib.contextmanager
    def because(self, cause: str) -> Iterator[None]:
        """Label the evictions made inside the block with what needed the room."""
        outer, self.cause = self.cause, cause
        try:
            yield
        finally:
            self.cause = outer

    # ---- records -------------------------------------------------------------------------------
    def removed(self, node: TreeNode, kv: bool, how: str) -> None:
        """Called by the tree before ``node``'s KV (``kv``) or only its checkpoint leaves it: the
        node is still linked to its ancestors."""
        keys = [node.key]
        top = node
        while top.parent.parent is not None:  # up to the root's child, whose key holds the namespace
            top = top.parent
            keys.append(top.key)
        path = tuple(t for key in reversed(keys) for t in key)
        ckpt = None
        if node.state is not None:
            ckpt = "superseded" if node.superseded else "speculative" if node.speculative else "ordinary"
        self.removals.append(Removal(self._tick(), top.child_key[0], path, node.depth - len(node.key), kv, ckpt,
                                     how, self.cause))

    def dropped(self, tokens: Sequence[int], position: int, what: str, namespace: Hashable = None) -> None:
        """The user wanted a checkpoint after ``tokens[:position]`` and the state pool had no room."""
        self.drops.append(Drop(self._tick(), namespace_key(namespace), tuple(tokens[:position]), what))

    def admitted(self, key: Hashable, tokens: Sequence[int], hit: int, kv_match: int,
                 namespace: Hashable = None) -> None:
        self.admissions.setdefault(key, []).append(
            Admission(self._tick(), namespace_key(namespace), tuple(tokens), hit, kv_match))

    def released(self, key: Hashable) -> None:
        self.releases.setdefault(key, []).append(self._tick())

    def sample_usage(self, held: int, running: int) -> None:
        """KV slots running requests hold (their locked tree paths and their own KV), after an allocation."""
        self.usage.append((self._tick(), held, running))

    # ---- attribution ---------------------------------------------------------------------------
    def hit(self, key: Hashable) -> int:
        """The cached prefix the first admission of ``key`` was served."""
        return self.admissions[key][0].hit

    def recomputed(self, key: Hashable) -> int:
        """Tokens the re-admissions of ``key`` (after retractions) prefilled: a retraction's own cost."""
        return sum(len(a.tokens) - a.hit for a in self.admissions.get(key, [])[1:])

    def explain(self, key: Hashable, wanted: int, grid: int = 1) -> Counter:
        """``(category, detail) -> tokens`` for the ``wanted - hit`` tokens the first admission of
        ``key`` missed (empty if it missed none); the counts add up to that difference. KV the tree
        gave back only because no checkpoint was left at or below it (``garbage``) counts as
        present: its loss is the missing checkpoint's. ``grid``: checkpoints are taken only at its
        multiples (the engine's page size and checkpoint alignment)."""
        adm = self.admissions[key][0]
        tokens, hit = adm.tokens, adm.hit
        wanted = min(wanted, len(tokens))
        out: Counter = Counter()
        if hit >= wanted:
            return out

        def on_path(ns: Hashable, path: tuple, time: int) -> bool:
            return time < adm.time and ns == adm.namespace and tokens[:len(path)] == path

        kv_end = max(hit, min(adm.kv_match, wanted))
        owner: list[Removal | None] = [None] * (wanted - kv_end)  # latest removal covering each position
        for r in self.removals:
            if r.kv and len(r.path) > kv_end and r.start < wanted and on_path(r.namespace, r.path, r.time):
                for p in range(max(r.start, kv_end), min(len(r.path), wanted)):
                    owner[p - kv_end] = r
        skip = 0
        while skip < len(owner) and owner[skip] is not None and owner[skip].how == self.garbage:
            skip += 1
        kv_end += skip
        for r in owner[skip:]:
            if r is None:
                out[("never cached", "")] += 1
            else:
                out[("KV evicted", r.how if r.how == self.garbage else f"{r.how}, for {r.cause}")] += 1
        reached = hit
        deepest: Removal | None = None
        for r in self.removals:
            if r.checkpoint and reached < len(r.path) <= kv_end and on_path(r.namespace, r.path, r.time):
                reached, deepest = len(r.path), r
        if deepest is not None:
            out[("checkpoint evicted", f"{deepest.checkpoint}, {deepest.how}, for {deepest.cause}")] += reached - hit
        deepest_drop: Drop | None = None
        for d in self.drops:
            if reached < len(d.path) <= kv_end and on_path(d.namespace, d.path, d.time) and \
                    (deepest_drop is None or len(d.path) > len(deepest_drop.path)):
                deepest_drop = d
        if deepest_drop is not None:
            out[("no room for a checkpoint", deepest_drop.what)] += len(deepest_drop.path) - reached
            reached = len(deepest_drop.path)
        on_grid = max(reached, kv_end - kv_end % grid)
        if on_grid > reached:
            out[("no checkpoint taken", "")] += on_grid - reached
        if kv_end > on_grid:  # KV past the last grid position it reaches: no checkpoint can end there
            out[("off the checkpoint grid", "")] += kv_end - on_grid
        return out


__all__ = ["Admission", "CacheLedger", "Drop", "Removal"]
