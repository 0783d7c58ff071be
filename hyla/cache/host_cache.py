"""The host tier: prefixes the device's prefix cache evicts, kept in host memory for a later hit.

A hybrid model's prefix is usable only with the recurrent state after it. SGLang's hierarchical
cache (HiCache) demotes evicted KV to host memory but drops the states of hybrid models (#33713,
#40680), and external KV stores that bring KV back without the state garble outputs (LMCache
#2845). Here an evicted checkpoint goes down together with its path's KV, and a hit from the host
brings both back: the prefix resumes exactly where it was.

How it works:

* A second ``RadixCache`` over host pools (a ``KVPool`` and a ``StatePool`` of the device pools'
  layout, in CPU memory) holds the host's prefixes, with its own LRU; what it evicts is dropped.
* ``save(node)`` is the device tree's ``on_evict`` hook: before the device frees a checkpoint (or,
  in a tree without states, a leaf's KV), the prefix ending at that node — its path's KV and the
  checkpoint — is copied into the host tree. What the host already holds of the path (an earlier
  turn of the chat, a shared system prompt) is not copied again. Where the host cannot make room
  (its entries locked, or the prefix larger than its pools) the prefix is not kept.
* ``match(tokens, namespace)`` finds and locks the host's hit; the cache manager, when it is longer
  than the device's, takes device slots for the part the device lacks (evicting there, which may
  ``save`` into the host: the locked hit stays), has ``load`` copy the host's KV and checkpoint into
  them, inserts them into the device tree as it would a computed prefix, and ``unlock``s the hit.
* Inclusive: the host keeps its copy after a load, so when the device evicts that prefix again,
  ``save`` finds it there and copies nothing.
* No copy waits for the device (``transfer.copy_rows``): an eviction happens while the host
  schedules the next step, with the step before still running (the overlap schedule), and a
  waiting copy would stall the host until the device had finished it. A load reaches the device
  through pinned memory in the stream's order. A save (from a CUDA device: ``defer``) is gathered
  and copied into pinned staging memory on the stream, and its rows land in the host pools later
  (a ``Landing``), oldest first: all of them once the scheduler has launched a step (``land``: the
  host would wait for the device next anyway, and the copies were queued before the step's
  kernels), and whenever the host tier is entered, those whose copies are done. A load first lands
  every save (up to the last) that wrote a row it reads; a save that would take the staging memory
  past ``MAX_STAGED_BYTES`` lands the oldest first (one larger than that alone is copied a block at
  a time, waiting for each). Until its rows land, a saved prefix is in the host tree with
  rows that nothing reads.

Copies are exact (the same bytes), so a hit from the host changes no output: the engine's
differential tests run with the tier on. Ownership: the host tree owns the host slots and the
device tree never sees one. Single-threaded: the scheduler's cache manager is the only caller.
Knows nothing of models. In accounting mode (the simulator's replay) the pools hold no data and
the tier keeps only the books.
"""

from __future__ import annotations

from collections import deque
from typing import Hashable, NamedTuple, Sequence

import numpy as np
import torch

from hyla.cache.kv_pool import KVPool
from hyla.cache.layout import CacheLayout
from hyla.cache.prefix_transfer import CachedPrefix
from hyla.cache.radix_cache import RadixCache
from hyla.cache.radix_types import MatchResult, TreeNode
from hyla.cache.state_pool import StatePool
from hyla.cache.transfer import COPY_BLOCK_BYTES, Landing

# the staging memory (pinned host memory) the saves still in flight may hold; past it a save waits
# for the oldest to land
MAX_STAGED_BYTES = 1 << 30


class _Save(NamedTuple):
    """A save whose rows have not landed yet: its copies and the host rows they write."""
    landings: list[Landing]
    kv_rows: np.ndarray  # host KV slots
    state_slot: int | None  # host state slot


class HostCache:
    """The host tier under ``device_tree``: host pools of ``num_tokens`` KV slots and ``num_slots``
    state slots (none for a tree without a state pool) and a tree over them. ``defer``: saves land
    later (the module docstring); by default where the device pools are on a CUDA device (from CPU
    pools a deferred save's rows are staged at once and land only when they must: what tests of
    the order use)."""

    def __init__(self, device_tree: RadixCache, kv_pool: KVPool, state_pool: StatePool | None,
                 defer: bool | None = None) -> None:
        if kv_pool.page_size != device_tree.page_size:
            raise ValueError(f"the host KV pool's page size {kv_pool.page_size} differs from the device's "
                             f"{device_tree.page_size}")
        if (state_pool is None) != (device_tree.state_pool is None):
            raise ValueError("the host tier needs a state pool exactly when the device tree has one")
        if device_tree.on_evict is not None:
            raise ValueError("the device tree already has a lower tier")
        self.device_tree = device_tree
        self.kv_pool = kv_pool
        self.state_pool = state_pool
        self.tree = RadixCache(kv_pool, state_pool=state_pool)
        self.defer = device_tree.kv_pool.device.type == "cuda" if defer is None else defer
        self._in_flight: deque[_Save] = deque()  # saves not landed yet, oldest first
        self.reset_counters()
        device_tree.on_evict = self.save

    def reset_counters(self) -> None:
        self.num_saved_tokens = 0  # KV tokens copied into the host
        self.num_saved_checkpoints = 0  # checkpoints copied into the host
        self.num_unsaved = 0  # evicted prefixes the host had no room for
        self.num_loaded_tokens = 0  # KV tokens copied back to the device
        self.num_loaded_checkpoints = 0  # checkpoints copied back to the device

    @classmethod
    def from_layout(cls, layout: CacheLayout, device_tree: RadixCache, num_tokens: int, num_slots: int,
                    accounting: bool = False, defer: bool | None = None) -> "HostCache":
        """The host tier of ``layout`` under ``device_tree``: host pools of ``num_tokens`` KV slots
        (rounded down to whole pages) and ``num_slots`` state slots (unused without a state pool)."""
        ps = device_tree.page_size
        tokens, slots = cls._sizes(ps, num_tokens, num_slots)
        kv = KVPool.from_layout(layout, tokens, ps, "cpu", accounting)
        states = StatePool.from_layout(layout, slots, "cpu", accounting) if device_tree.state_pool is not None else None
        return cls(device_tree, kv, states, defer)

    @classmethod
    def planned_bytes(cls, layout: CacheLayout, device_tree: RadixCache, num_tokens: int, num_slots: int) -> int:
        """What :meth:`from_layout`'s host tier would occupy, computed before building it (the engine
        checks it against the RAM): the pools' own ``bytes_for`` at the sizes they would get, and
        under a CUDA device's tree the pinned memory its copies may hold (:meth:`staging_bytes`)."""
        ps = device_tree.page_size
        tokens, slots = cls._sizes(ps, num_tokens, num_slots)
        states = StatePool.bytes_for(slots, layout.state_bytes_per_slot) if device_tree.state_pool is not None else 0
        pools = KVPool.bytes_for(tokens, ps, layout.kv_bytes_per_token) + states
        return pools + (cls.staging_bytes(pools) if device_tree.kv_pool.device.type == "cuda" else 0)

    @staticmethod
    def staging_bytes(pool_bytes: int) -> int:
        """The pinned host memory a tier with pools of ``pool_bytes`` may hold besides them under a
        CUDA device, at most: its saves in flight (``MAX_STAGED_BYTES``, or the pools' size where
        smaller: a save fits in them) and a load's two blocks in flight (``COPY_BLOCK_BYTES`` each).
        PyTorch's pinned allocator keeps the blocks it has handed out for reuse, so the process holds
        this once a burst of evictions has used it (a block rounded up to a power of two)."""
        return min(MAX_STAGED_BYTES, pool_bytes) + 2 * COPY_BLOCK_BYTES

    @staticmethod
    def _sizes(page_size: int, num_tokens: int, num_slots: int) -> tuple[int, int]:
        """The host pools' sizes: KV rounded down to whole pages (a page at least), a state slot at least."""
        return max(page_size, num_tokens - num_tokens % page_size), max(1, num_slots)

    # ------------------------------------------------------------------------------------------
    # device -> host
    # ------------------------------------------------------------------------------------------
    def save(self, node: TreeNode) -> None:
        """Keep a copy of the prefix ending at ``node`` (of the device tree, about to be evicted):
        the KV of its path the host lacks, and ``node``'s checkpoint. Nothing when the host has it
        already or cannot make room."""
        self._land()
        device = self.device_tree
        namespace, tokens, slots = device.path_of(node)
        n = len(tokens)
        hit = self.tree.match_prefix(tokens, namespace)  # refreshes what the host has of it
        if hit.prefix_len == n:
            return
        have = hit.kv_only_len  # whole pages of the path's KV the host holds
        self.tree.inc_lock_ref(hit.kv_only_node)  # not evicted while room is made for the rest
        try:
            state = node.state if self.state_pool is not None else None
            if not self._make_room(n - have, 0 if state is None else 1):
                self.num_unsaved += 1
                return
            new = self.kv_pool.alloc(n - have) if n > have else torch.zeros(0, dtype=torch.int64)
            host_slot = self.state_pool.alloc(1, zero=False) if state is not None else None
            size = (n - have) * self.kv_pool.bytes_per_token + (self.state_pool.bytes_per_slot if state is not None else 0)
            defer = self.defer and size <= MAX_STAGED_BYTES  # (a larger save: copied a block at a time, waiting)
            while defer and self._in_flight and self.staged_bytes + size > MAX_STAGED_BYTES:
                self._land(1)
            if not defer:  # written now: an older save still in flight may write rows this one was given
                self._land(len(self._in_flight))  # (freed by the eviction above); it lands first, not over these
            try:
                landings = [self.kv_pool.copy_from(device.kv_pool, slots[have:], new, defer)]
                if host_slot is not None:
                    landings.append(self.state_pool.copy_from(device.state_pool, [state], host_slot, defer))
                ckpts = [(n, int(host_slot[0]))] if host_slot is not None else []
                self._stage([x for x in landings if x is not None], new, host_slot)
                self.tree.insert(tokens, torch.cat([hit.kv_only_indices, new]), ckpts, namespace)
            except BaseException:  # (a copy out of memory): nothing kept, nothing leaked
                self.kv_pool.free(new)
                if host_slot is not None:
                    self.state_pool.free(host_slot)
                raise
            self.num_saved_tokens += n - have
            self.num_saved_checkpoints += len(ckpts)
        finally:
            self.tree.dec_lock_ref(hit.kv_only_node)

    def _stage(self, landings: list[Landing], kv_rows: torch.Tensor, state_slot: torch.Tensor | None) -> None:
        """Keep a save's ``landings`` (none: its rows are in place) until they land."""
        if not landings:
            return
        self._in_flight.append(_Save(landings, kv_rows.numpy(), None if state_slot is None else int(state_slot[0])))

    def land(self) -> None:
        """Land every save in flight, waiting for their copies (the scheduler's call after it launched
        a step: the copies were queued before the step's kernels, and the host scatters their rows
        while the device runs the step)."""
        self._land(len(self._in_flight))

    def _land(self, at_least: int = 0) -> None:
        """Land the saves in flight whose copies are done, oldest first, and at least the oldest
        ``at_least`` of them (waiting for their copies)."""
        q = self._in_flight
        while q and (at_least > 0 or all(x.ready() for x in q[0].landings)):
            for x in q.popleft().landings:
                x.land()
            at_least -= 1

    @property
    def num_in_flight(self) -> int:
        """Saves whose rows have not landed in the host pools yet."""
        return len(self._in_flight)

    @property
    def staged_bytes(self) -> int:
        """The staging memory the saves in flight hold."""
        return sum(x.nbytes for save in self._in_flight for x in save.landings)

    def _free_slots(self) -> int:
        return self.state_pool.available_size() if self.state_pool is not None else 0

    def _make_room(self, num_tokens: int, num_slots: int) -> bool:
        """Free host KV for ``num_tokens`` and ``num_slots`` state slots, evicting the host's least
        recently used entries — none when even evicting every unlocked one could not do it."""
        kv_short = num_tokens - self.kv_pool.available_size()
        states_short = num_slots - self._free_slots()
        if kv_short > self.tree.evictable_size() or states_short > self.tree.evictable_checkpoints():
            return False
        if kv_short > 0:
            self.tree.evict(kv_short)
        states_short = num_slots - self._free_slots()  # (the KV's eviction may have freed checkpoints)
        if states_short > 0:
            self.tree.evict_state(states_short)
        return self.kv_pool.available_size() >= num_tokens and (
            not num_slots or self.state_pool.available_size() >= num_slots)

    # ------------------------------------------------------------------------------------------
    # host -> device
    # ------------------------------------------------------------------------------------------
    def match(self, token_ids: Sequence[int], namespace: Hashable = None) -> MatchResult | None:
        """The host's longest usable prefix of ``token_ids``, locked (its path's KV and its
        checkpoint) until ``unlock``; None when the host holds none."""
        self._land()
        hit = self.tree.match_prefix(token_ids, namespace)
        if not hit.prefix_len:
            return None
        self.tree.inc_lock_ref(hit.last_node)
        if hit.state_slot is not None:
            self.tree.inc_state_lock(hit.last_node)
        hit.kv_indices  # noqa: B018 (the slots as of now: later splits of its path do not move them)
        return hit

    def unlock(self, hit: MatchResult) -> None:
        """Undo ``match``'s locks on ``hit``."""
        if hit.state_slot is not None:
            self.tree.dec_state_lock(hit.last_node)
        self.tree.dec_lock_ref(hit.last_node)

    def load(self, hit: MatchResult, start: int, kv_slots: torch.Tensor, state_slot: int | None) -> None:
        """Copy a locked ``hit``'s KV of positions ``[start, hit.prefix_len)`` into the device KV slots
        ``kv_slots`` and its checkpoint into the device state slot ``state_slot`` (None: a tree
        without states)."""
        device = self.device_tree
        if len(kv_slots) != hit.prefix_len - start:
            raise ValueError(f"load of positions [{start}, {hit.prefix_len}) into {len(kv_slots)} KV slots")
        rows = hit.kv_indices[start:]
        self._land_writers(rows, hit.state_slot)
        device.kv_pool.copy_from(self.kv_pool, rows, kv_slots)
        self.num_loaded_tokens += len(kv_slots)
        if hit.state_slot is not None:
            device.state_pool.copy_from(self.state_pool, [hit.state_slot], [state_slot])
            self.num_loaded_checkpoints += 1

    def gather(self, hit: MatchResult, layout: CacheLayout, tokens: Sequence[int], namespace: Hashable) -> CachedPrefix:
        """A copy of a locked ``hit`` (of ``tokens``, its whole prefix) out of the host pools
        (``CacheManager.export_prefix``)."""
        self._land_writers(hit.kv_indices, hit.state_slot)
        return CachedPrefix.gather(layout, tokens, namespace, self.kv_pool, hit.kv_indices, self.state_pool,
                                   hit.state_slot)

    def _land_writers(self, kv_rows: torch.Tensor, state_slot: int | None) -> None:
        """Land every save in flight (up to the last) that writes one of ``kv_rows`` or ``state_slot``:
        what a copy out of them reads is then in place."""
        writers = [i for i, save in enumerate(self._in_flight)
                   if (state_slot is not None and save.state_slot == state_slot)
                   or np.isin(save.kv_rows, kv_rows.numpy()).any()]
        self._land(writers[-1] + 1 if writers else 0)

    # ------------------------------------------------------------------------------------------
    # misc
    # ------------------------------------------------------------------------------------------
    def reset(self) -> None:
        """Drop everything the host holds (a flush of the cache: new weights, ``flush_cache``), the saves
        in flight too (their staging memory is freed once their copies are done)."""
        self._in_flight.clear()
        self.tree.reset()

    @property
    def total_bytes(self) -> int:
        """Bytes of the host pools."""
        return self.kv_pool.total_bytes + (self.state_pool.total_bytes if self.state_pool is not None else 0)

    def check_integrity(self) -> None:
        self.kv_pool.check_integrity()
        if self.state_pool is not None:
            self.state_pool.check_integrity()
        self.tree.check_integrity()

    def __repr__(self) -> str:
        return (f"HostCache(tokens={self.tree.total_size()}/{self.kv_pool.size}, "
                f"checkpoints={self.tree.num_checkpoints()}/{self.state_pool.size if self.state_pool else 0})")


__all__ = ["HostCache"]
