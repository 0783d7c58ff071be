"""Which worker serves a request: cache-aware routing over data-parallel replicas.

Each worker (a ``hyla serve`` process, one per GPU) has its own prefix cache. A conversation whose
turns land on different workers recomputes its whole history on each: the cache only pays when a
prompt goes where its prefix already is. The router cannot see the workers' trees, so it keeps its
own picture of them (SGLang's router does the same with an approximate radix tree per worker): the
prompts it sent to each, in blocks.

* A prompt's **routing key** is its text as the client sent it (a chat's ``tools`` and
  ``messages`` serialized, a completion's prompt, ``/generate``'s text or token ids). A later turn's
  key starts with the earlier turn's (a JSON list's serialization is prefix-preserving but for its
  closing bracket), so prefixes of keys stand for prefixes of prompts.
* A request naming a ``model`` routes in that model's **namespace** (``Namespaced``): a LoRA adapter's
  prompts are cached apart on the workers, so the same text sent under another adapter, or the base
  model, is no hit there and none here.
* The key is cut into **blocks** (``block_chars`` characters of text, ``block_tokens`` token ids),
  and block ``i`` is named by a hash chained over blocks ``0..i``: one name per prefix. Each worker
  has a ``PrefixTable`` of the names it was sent, least recently used first, bounded by
  ``max_blocks`` (what the worker's own cache has evicted long ago should not keep attracting
  requests).
* **Choice** (``Router.choose``; ``Router.record`` once a worker has taken the request, so that a
  worker that refused it does not keep its prefix): among the healthy workers, when the load
  (requests in flight) is unbalanced (``max - min > balance_abs`` and ``max > balance_rel * min``),
  the least loaded; otherwise the worker holding the longest prefix of the key, if it covers
  ``cache_threshold`` of the key or more (ties: the least loaded); otherwise the least loaded (ties:
  the smallest table, the worker with the most room, then in turn). A key shorter than one block has
  nothing to match: least loaded. A prefix every new conversation shares (a long system prompt, the
  tools) that covers ``cache_threshold`` of their keys sends them all to the worker that saw it
  first, until the balance check moves them: lower ``balance_abs`` for such traffic.

The policy is a heuristic for *where*; it never changes *what* a worker computes (each worker's cache
is exact). ``round_robin``, ``least_load`` and ``random`` are there to compare against.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

POLICIES = ("cache_aware", "round_robin", "least_load", "random")
DEFAULT_POLICY = "cache_aware"
# with prefill workers: a decode worker lacking no more of a prompt than this computes it itself (a short prompt, a
# conversation's next turn), a longer one is computed by a prefill worker and moved
DEFAULT_LOCAL_PREFILL_TOKENS = 512


# blocks of a key looked at, at most (a 512 Ki-character prefix): where a prompt goes is decided by its
# beginning, and a huge body does not hold the event loop hashing it
MAX_KEY_BLOCKS = 8192


@dataclass(frozen=True)
class Namespaced:
    """A routing key in a namespace of its own: the requests of a ``model`` (a LoRA adapter's, which the workers
    cache apart from the base model's and each other's) share prefixes only with requests of that model."""

    namespace: str
    key: str | Sequence[int]


def block_names(key: str | Sequence[int] | Namespaced, block_chars: int = 64, block_tokens: int = 16) -> list[int]:
    """The chained hashes of ``key``'s whole blocks (the first ``MAX_KEY_BLOCKS``): ``names[i]`` names
    the prefix of ``i + 1`` blocks (a :class:`Namespaced` key's chain starts from its namespace: the same
    text names other blocks in another namespace, and the blocks fall where they would without one)."""
    h = 0
    if isinstance(key, Namespaced):
        h, key = hash(("namespace", key.namespace)), key.key
    size = block_chars if isinstance(key, str) else block_tokens
    names = []
    for start in range(0, min(len(key) - size + 1, MAX_KEY_BLOCKS * size), size):
        chunk = key[start:start + size]
        h = hash((h, chunk if isinstance(chunk, str) else tuple(chunk)))
        names.append(h)
    return names


class PrefixTable:
    """The block names one worker was sent, least recently used first, at most ``max_blocks``."""

    def __init__(self, max_blocks: int) -> None:
        if max_blocks < 1:
            raise ValueError(f"max_blocks must be >= 1, got {max_blocks}")
        self.max_blocks = max_blocks
        self._names: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._names)

    def match(self, names: Sequence[int]) -> int:
        """How many leading blocks of ``names`` this worker holds (a binary search: the table holds every
        prefix of a name it holds, ``insert``)."""
        lo, hi = 0, len(names)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if names[mid - 1] in self._names:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def insert(self, names: Sequence[int]) -> None:
        """Record (or refresh) every block of a prompt sent here, dropping the least recently used past
        ``max_blocks``. The last block is refreshed first, so that a prompt's deeper blocks are always
        older than its shallower ones: the table drops a prompt from its end (as the worker's tree evicts
        leaves first) and holds every prefix of what it holds."""
        table = self._names
        for name in reversed(names):
            table[name] = None
            table.move_to_end(name)
        while len(table) > self.max_blocks:
            table.popitem(last=False)

    def clear(self) -> None:
        self._names.clear()


class Router:
    """The routing policy over ``num_workers`` workers (the module docstring). Not thread-safe: the
    router app calls it from its event loop only."""

    def __init__(self, num_workers: int, policy: str = DEFAULT_POLICY, cache_threshold: float = 0.3,
                 balance_abs: int = 64, balance_rel: float = 1.5, max_blocks: int = 1 << 18,
                 block_chars: int = 64, block_tokens: int = 16, seed: int = 0) -> None:
        if num_workers < 1:
            raise ValueError(f"the router needs a worker at least, got {num_workers}")
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        if not 0.0 <= cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold must be in [0, 1], got {cache_threshold}")
        if balance_abs < 0 or balance_rel < 1.0:
            raise ValueError(f"balance_abs must be >= 0 and balance_rel >= 1, got {balance_abs}, {balance_rel}")
        if block_chars < 1 or block_tokens < 1:
            raise ValueError(f"block sizes must be >= 1, got {block_chars}, {block_tokens}")
        self.policy = policy
        self.cache_threshold, self.balance_abs, self.balance_rel = cache_threshold, balance_abs, balance_rel
        self.block_chars, self.block_tokens = block_chars, block_tokens
        self.tables = [PrefixTable(max_blocks) for _ in range(num_workers)]
        self._next = 0  # round_robin's
        self._tie = 0  # where ties of load start, in turn
        self._rng = random.Random(seed)

    def choose(self, key: str | Sequence[int] | None, loads: Sequence[int], healthy: Sequence[bool],
               exclude: frozenset[int] = frozenset()) -> tuple[int, str]:
        """The worker for a request with routing ``key`` (None: no prompt to route by) -> ``(worker,
        why)``, ``why`` one of ``"cache"`` (its longest prefix is there), ``"load"`` (the least
        loaded), ``"balance"`` (the least loaded, the load being unbalanced), ``"round_robin"``,
        ``"random"``. Workers not ``healthy`` or in ``exclude`` (tried already) are never chosen;
        ``ValueError`` if that leaves none. Changes no table: the caller ``record``s the key where
        the request was served."""
        live = [w for w in range(len(self.tables)) if healthy[w] and w not in exclude]
        if not live:
            raise ValueError("no healthy worker")
        if self.policy == "round_robin":
            for _ in range(len(self.tables)):
                w, self._next = self._next, (self._next + 1) % len(self.tables)
                if w in live:
                    return w, "round_robin"
        if self.policy == "random":
            return self._rng.choice(live), "random"
        least = self.least_loaded(live, loads)
        if self.policy == "least_load":
            return least, "load"
        names = block_names(key, self.block_chars, self.block_tokens) if key is not None else []
        most = max(loads[w] for w in live)
        if most - loads[least] > self.balance_abs and most > self.balance_rel * loads[least]:
            return least, "balance"
        matched = {w: self.tables[w].match(names) for w in live}
        best = max(matched.values(), default=0)
        if names and best and best / len(names) >= self.cache_threshold:
            return self.least_loaded([w for w in live if matched[w] == best], loads), "cache"
        return least, "load"

    def least_loaded(self, workers: Sequence[int], loads: Sequence[int]) -> int:
        """The least loaded of ``workers``; among equals, the one with the smallest table (the most
        room, cache_aware), then the next in turn (so that equal workers share sequential traffic)."""
        n = len(self.tables)
        start, self._tie = self._tie, (self._tie + 1) % n
        return min(workers, key=lambda w: (loads[w], len(self.tables[w]) if self.policy == "cache_aware" else 0,
                                           (w - start) % n))

    def record(self, worker: int, key: str | Sequence[int] | None) -> None:
        """``key`` was served by ``worker`` (cache_aware: its blocks go into the worker's table)."""
        if self.policy == "cache_aware" and key is not None:
            self.tables[worker].insert(block_names(key, self.block_chars, self.block_tokens))

    def clear(self) -> None:
        """Forget every table (the workers' caches were flushed)."""
        for table in self.tables:
            table.clear()
