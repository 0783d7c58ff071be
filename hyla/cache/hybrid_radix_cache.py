"""The hybrid radix tree: one prefix tree for KV slots and recurrent-state checkpoints.

A node may hold a *checkpoint* — a state-pool slot with the recurrent state (conv windows and SSM
states of every linear layer) after the node's last token — or none (a *tombstone*: KV only). A
prefix of a hybrid model is usable only where its state is known, so:

* ``match_prefix`` returns the longest matched prefix that ends at a node holding a checkpoint
  (``prefix_len``, ``last_node``, ``state_slot``) and, separately, how far the KV alone matched
  (``kv_only_len``, ``kv_only_node``). A split inside an edge leaves the checkpoint on the lower
  node, where its position still is; the upper node is a tombstone. A checkpoint is therefore
  never lost by a split, and never returned for a shorter prefix than the one it was taken at
  (seed bug two, and SGLang #38815 in the other direction).
* The engine copies ``state_slot`` into the request's own slot (copy-on-write): the tree's slot is
  never written by a running request. To protect it until the copy, hold a state lock.
* ``insert(..., checkpoints=[(length, slot), ...])`` adopts each ``slot`` — a slot the caller
  *forked* for the tree, never a request's live slot (seed bug one) — at the node ending at
  ``length`` (splitting an edge there if needed). If that node already holds a checkpoint, the
  passed slot is a duplicate and is freed; on a tombstone it revives the node. Lengths may be any
  page multiple: chunk alignment of the linear-attention kernel is the model's business (seed bug
  three), not a restriction of the tree.

Locks: ``inc_lock_ref`` KV-locks the path to the root; ``inc_state_lock`` locks one node's
checkpoint only. Eviction, two orders, both policy-ordered heaps:

* ``evict(n)`` (KV): delete unlocked leaves (their checkpoint goes with them); a parent left as
  an unlocked *tombstone* leaf is deleted too (no checkpoint at or below it: its KV can never
  serve a hybrid hit), a parent left as a leaf with a checkpoint joins the KV heap.
* ``evict_state(n)``: take unlocked checkpoints in policy order; an unlocked leaf is deleted
  (with its KV, then tombstone parents as above), any other node — internal, or a leaf whose KV
  a request still locks — becomes a tombstone.
"""

from __future__ import annotations

import heapq
from typing import Callable, Hashable, Iterable

import numpy as np

from hyla.cache.kv_pool import KVPool
from hyla.cache.policy import EvictionPolicy
from hyla.cache.radix_cache import RadixCache, TreeNode
from hyla.cache.state_pool import StatePool


class HybridRadixCache(RadixCache):
    """Radix tree over a ``KVPool`` and a ``StatePool``: KV per token, checkpoints per node."""

    def __init__(
        self,
        kv_pool: KVPool,
        state_pool: StatePool,
        page_size: int | None = None,
        *,
        policy: EvictionPolicy | None = None,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.state_pool = state_pool
        self._reset_states()
        super().__init__(kv_pool, page_size, policy=policy, clock=clock)

    def _reset_states(self) -> None:
        self._slot_owner: dict[int, TreeNode] = {}  # checkpoint slot -> the node holding it
        self._evictable_states = 0  # checkpoints with state_lock == 0

    # ------------------------------------------------------------------------------------------
    # sizes
    # ------------------------------------------------------------------------------------------
    def num_checkpoints(self) -> int:
        return len(self._slot_owner)

    def evictable_checkpoints(self) -> int:
        """Checkpoints without a state lock (what ``evict_state`` can free)."""
        return self._evictable_states

    # ------------------------------------------------------------------------------------------
    # lookup
    # ------------------------------------------------------------------------------------------
    def _num_usable(self, path: list[TreeNode]) -> int:
        """The usable prefix ends at the deepest node of the match that holds a checkpoint."""
        for i in range(len(path) - 1, -1, -1):
            if path[i].state is not None:
                return i + 1
        return 0

    def _on_hit(self, node: TreeNode, now: float) -> int | None:
        """Refresh the recency of the one checkpoint the hit uses (not those above it)."""
        node.state_access = now  # its state-heap entry is re-placed lazily when popped
        if self._on_access is not None:
            self._on_access(node, True)
        return node.state

    # ------------------------------------------------------------------------------------------
    # insert
    # ------------------------------------------------------------------------------------------
    def _check_checkpoints(self, checkpoints: Iterable[tuple[int, int]], n: int) -> list[tuple[int, int]]:
        """Validate ``(length, slot)`` pairs against a key of ``n`` whole-page tokens; sorted by length."""
        ps = self.page_size
        out: list[tuple[int, int]] = []
        for item in checkpoints:
            try:
                length, slot = map(int, item)
            except (TypeError, ValueError):
                raise ValueError(f"a checkpoint is a (length, slot) pair of ints, got {item!r}") from None
            if length % ps or not 1 <= length <= n:
                raise ValueError(
                    f"checkpoint length {length} must be a multiple of page_size={ps} within the key's "
                    f"{n} whole-page tokens")
            if slot in self._slot_owner:
                raise ValueError(f"state slot {slot} already belongs to the tree (pass a forked slot)")
            if not self.state_pool.is_allocated_slot(slot):
                raise ValueError(f"checkpoint slot {slot} is not an allocated state-pool slot")
            out.append((length, slot))
        if len(out) > 1:
            if len({length for length, _ in out}) != len(out) or len({slot for _, slot in out}) != len(out):
                raise ValueError(f"checkpoint lengths and slots must be distinct: {out}")
            out.sort()
        return out

    def _attach_checkpoints(self, path: list[TreeNode], ckpts: list[tuple[int, int]], now: float) -> int:
        """Put each checkpoint on the path node ending at its length (splitting an edge there if
        needed). ``path`` covers the whole key from the root; it is updated in place by splits.
        Returns the number adopted; duplicates are freed."""
        duplicates: list[int] = []
        adopted = 0
        i = 0
        for length, slot in ckpts:  # ascending, so i only moves forward
            while path[i].depth < length:
                i += 1
            node = path[i]
            if node.depth != length:  # inside node's edge
                node = self._split(node, length - node.start)
                path.insert(i, node)
            node.state_access = now
            if node.state is None:  # a new node or a tombstone: adopt (revive)
                node.state = slot
                self._slot_owner[slot] = node
                self._evictable_states += 1  # a tombstone has no state lock
                self._requeue_state(node)
                adopted += 1
            else:
                duplicates.append(slot)
            if self._on_access is not None:
                self._on_access(node, True)
        if duplicates:
            self.state_pool.free(np.array(duplicates, dtype=np.int64))
        return adopted

    # ------------------------------------------------------------------------------------------
    # state locks
    # ------------------------------------------------------------------------------------------
    def inc_state_lock(self, node: TreeNode) -> None:
        """Protect ``node``'s checkpoint (only it) from ``evict_state`` and its leaf from ``evict``."""
        self._check_node(node)
        if node.state is None:
            raise ValueError(f"inc_state_lock on a node without a checkpoint: {node!r}")
        if node.state_lock == 0:
            self._evictable_states -= 1
        node.state_lock += 1

    def dec_state_lock(self, node: TreeNode) -> None:
        self._check_node(node)
        if node.state_lock <= 0:
            raise ValueError(f"dec_state_lock on a checkpoint that is not locked: {node!r}")
        node.state_lock -= 1
        if node.state_lock == 0:
            self._evictable_states += 1
            self._requeue_state(node)
            self._requeue_kv(node)

    # ------------------------------------------------------------------------------------------
    # eviction
    # ------------------------------------------------------------------------------------------
    def evict_state(self, num_slots: int) -> int:
        """Free up to ``num_slots`` checkpoint slots in policy order; returns how many were freed.
        An unlocked leaf is deleted with its KV; any other node becomes a tombstone."""
        if num_slots < 0:
            raise ValueError(f"num_slots must be >= 0, got {num_slots}")
        heap = self._state_heap
        kv_out: list[np.ndarray] = []
        state_out: list[int] = []
        freed = 0
        priority = self.policy.state_priority
        while freed < num_slots and heap:
            entry = heapq.heappop(heap)
            node = entry[3]
            if entry[2] != node.state_version or node.state is None or node.state_lock or node.removed:
                continue  # stale
            current = priority(node)
            if current != entry[0]:  # used since it was queued: back in, at its new place
                heapq.heappush(heap, (current, next(self._seq), entry[2], node))
                continue
            if not node.children and not node.lock_ref:
                self._remove_leaf(node, kv_out, state_out)
            else:
                state_out.append(self._take_state(node))
                if self.policy.structural:
                    self._requeue_kv(node)
            freed += 1
        self._release(kv_out, state_out)
        return freed

    def _is_garbage(self, node: TreeNode) -> bool:
        """An unlocked tombstone leaf: no checkpoint at or below it, so no hybrid hit can use it."""
        return node.state is None

    def _take_state(self, node: TreeNode) -> int:
        """Detach ``node``'s (unlocked) checkpoint, making it a tombstone; returns the slot."""
        slot = node.state
        del self._slot_owner[slot]
        node.state = None
        self._evictable_states -= 1
        return slot

    def _release(self, kv_out: list[np.ndarray], state_out: list[int]) -> None:
        super()._release(kv_out, state_out)
        if state_out:
            self.state_pool.free(np.array(state_out, dtype=np.int64))

    # ------------------------------------------------------------------------------------------
    # integrity
    # ------------------------------------------------------------------------------------------
    def _check_states(self) -> None:
        held = {}
        evictable = 0
        for node in self.nodes():
            if node.state is not None:
                assert node.state not in held, f"state slot {node.state} is held twice"
                held[node.state] = node
                evictable += node.state_lock == 0
        assert held == self._slot_owner, "checkpoint owner map drifted"
        assert evictable == self._evictable_states, "evictable checkpoint counter drifted"
        if held:
            assert self.state_pool.is_allocated(np.array(sorted(held), dtype=np.int64)), \
                "the tree holds a free state slot"

    def __repr__(self) -> str:
        return (f"HybridRadixCache(nodes={self._num_nodes}, tokens={self._total}, "
                f"evictable={self._evictable}, protected={self._protected}, "
                f"checkpoints={len(self._slot_owner)}, page_size={self.page_size})")


__all__ = ["HybridRadixCache"]
