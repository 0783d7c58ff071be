"""The radix tree: one path-compressed prefix tree over token ids for KV slots and, with a state
pool, recurrent-state checkpoints.

Structure
---------
* Each non-root node owns an edge: ``key`` (a tuple of token ids, a positive multiple of
  ``page_size`` long) and ``value`` (the KV slots of those tokens, an ``int64`` numpy array of the
  same length, whole pages). ``depth`` is the number of tokens from the root through the node.
* Children are found by the first page of their edge: ``key[0]`` when ``page_size == 1``, else
  the tuple ``key[:page_size]``. Children of the root are keyed by ``(namespace_key(namespace),
  first page)`` so that different namespaces (LoRA id, cache salt) never share a node.
* Keys are rounded down to whole pages: ``match_prefix``/``insert`` ignore a partial last page;
  that tail stays private to the request.
* Splitting an edge makes a *new upper node*; the existing node keeps its identity, its suffix,
  its locks and its checkpoint, so a node handed to the engine never changes the position it ends at.

Checkpoints (with a ``state_pool``)
-----------------------------------
A node may hold a *checkpoint* — a state-pool slot with the recurrent state after the node's last
token — or none (a *tombstone*: KV only). A prefix of a hybrid model is usable only where its state
is known, so ``match_prefix`` returns the longest matched prefix that ends at a checkpoint, and
separately how far the KV alone matched. A split leaves the checkpoint on the lower node, where
its position still is: a checkpoint is never lost by a split, and never returned for a shorter
prefix than the one it was taken at (seed bug two; SGLang #38815 the other way). Without a state
pool (``state_pool=None``: pure-attention models) every node is usable, no checkpoint is accepted
and ``evict_state`` frees nothing: the same tree with its checkpoint machinery idle.

Locks and sizes
---------------
``inc_lock_ref(node)`` increments ``lock_ref`` of every node from ``node`` up to the root, so a
node's ``lock_ref`` is at least the sum of its children's. A node with ``lock_ref > 0`` is
*protected*; its tokens count in ``protected_size()``, the others in ``evictable_size()``; the two
add up to ``total_size()``. ``inc_state_lock(node)`` protects one node's checkpoint only.

Eviction
--------
Three orders, each a ``LazyHeap`` ordered by the pluggable ``EvictionPolicy`` (LRU by default):
``evict(n)`` deletes unlocked leaves (their checkpoints go with them); ``evict_state(n)`` takes
unlocked checkpoints (a leaf goes with its KV, any other node becomes a tombstone), *replaceable*
ones first; ``evict_state(n, for_speculative=True)`` takes only replaceable ones — superseded (a
deeper checkpoint on its single-child path) or speculative (stored on a guess, no hit yet) with no
running request on its path. That is the rule for speculative checkpoints: they go only into free
memory or in place of replaceable ones, never pushing out one that has served a hit or ends a
finished turn (``confirm_checkpoint`` marks that one when its sequence finishes). With a state
pool, an unlocked tombstone leaf is deleted at once — when eviction leaves one, and when the last
lock on one goes (a turn's tail past its last checkpoint): no checkpoint at or below it, its KV can
never serve a hit. ``touch(node)`` refreshes a path's recency for a caller that knows the order in
which it will use prefixes (the engine's waiting queue). A node enters a heap when it *becomes* a
candidate (new leaf or checkpoint, last child evicted, lock released, a deeper checkpoint on its
single-child path), not on every access: a call costs O(k log n) amortized for k evictions, and a
hit costs no heap operation at all.

Everything here is single-threaded: the scheduler is the only caller (as in SGLang).
"""

from __future__ import annotations

import itertools
import logging
from typing import Callable, Hashable, Iterable, Iterator, Sequence

import numpy as np
import torch

from hyla.cache.allocator import as_index_array
from hyla.cache.kv_pool import KVPool
from hyla.cache.lazy_heap import LazyHeap
from hyla.cache.ledger import CacheLedger
from hyla.cache.policy import EvictionPolicy, LRUPolicy
from hyla.cache.radix_types import (
    EMPTY_SLOTS,
    Checkpoint,
    InsertResult,
    MatchResult,
    TreeNode,
    concat_slots,
    namespace_key,
)
from hyla.cache.state_pool import StatePool


logger = logging.getLogger("hyla.cache")

# how a node's KV or checkpoint left the tree (for the ledger)
KV_EVICTION = "KV eviction"
STATE_EVICTION = "checkpoint eviction"
CHECKPOINT_EVICTION = "superseded in advance"  # evict_checkpoint: the caller will store a deeper one
GARBAGE = CacheLedger.garbage  # an unlocked tombstone leaf, given back: no checkpoint at or below
# the evictions whose victims a lower tier may keep (``on_evict``): not a checkpoint the caller
# supersedes itself, nor garbage, nor a reset
_SPILLED = (KV_EVICTION, STATE_EVICTION)


class RadixCache:
    """Radix tree over a ``KVPool`` and, optionally, a ``StatePool``: KV per token, checkpoints per node.

    Ownership: the tree owns the KV slots and checkpoint slots stored in its nodes and frees them
    to their pools when it evicts them (or on ``reset``). ``insert`` adopts the caller's slots for
    the new part of the key and frees the caller's slots that duplicate what it already holds.
    ``state_pool=None`` makes a KV-only tree (every cached prefix is usable, no checkpoints).
    """

    def __init__(
        self,
        kv_pool: KVPool,
        page_size: int | None = None,
        *,
        state_pool: StatePool | None = None,
        policy: EvictionPolicy | None = None,
        clock: Callable[[], float] | None = None,
        ledger: CacheLedger | None = None,
    ) -> None:
        if page_size is not None and page_size != kv_pool.page_size:
            raise ValueError(f"page_size {page_size} disagrees with the KV pool's {kv_pool.page_size}")
        self.kv_pool = kv_pool
        self.state_pool = state_pool
        self.page_size = kv_pool.page_size
        self.policy = policy if policy is not None else LRUPolicy()
        self.ledger = ledger  # if set, told of every node whose KV or checkpoint leaves the tree
        # if set, called with each node whose checkpoint an eviction is about to free (without a state
        # pool: each leaf whose KV it frees), while the node, its path and their slots are intact: a
        # lower tier keeps a copy there (``HostCache.save``). It must not change this tree or its pools.
        self.on_evict: Callable[[TreeNode], None] | None = None
        # hooks are called only when the policy overrides them (LRU reads the time stamps directly)
        self._on_access = _hook(self.policy, "on_access")
        self._on_create = _hook(self.policy, "on_create")
        self._on_remove = _hook(self.policy, "on_remove")
        self._clock = clock  # None: a logical clock that ticks once per match/insert
        self._tick = 0
        self._ids = itertools.count(1)
        self._kv_heap = LazyHeap(self.policy.kv_priority, self._kv_candidate, "kv_mark", self.num_nodes)
        self._state_heap = LazyHeap(self.policy.state_priority, self._state_candidate, "state_mark", self.num_nodes)
        self._replaceable_heap = LazyHeap(self.policy.state_priority, self._replaceable_candidate,
                                          "replaceable_mark", self.num_nodes)
        self._init_tree()

    def _init_tree(self) -> None:
        self.root = TreeNode(0, None, None, (), EMPTY_SLOTS, 0, 0.0)
        self._num_nodes = 0
        self._total = 0  # tokens in the tree
        self._evictable = 0  # tokens in nodes with lock_ref == 0
        self._protected = 0  # tokens in nodes with lock_ref > 0
        self._slot_owner: dict[int, TreeNode] = {}  # checkpoint slot -> the node holding it
        self._evictable_states = 0  # checkpoints with state_lock == 0
        self.num_garbage_tokens = 0  # KV of unlocked tombstone leaves given back (dec_lock_ref)
        self._kv_heap.clear()
        self._state_heap.clear()
        self._replaceable_heap.clear()

    # ------------------------------------------------------------------------------------------
    # sizes
    # ------------------------------------------------------------------------------------------
    def total_size(self) -> int:
        """Tokens held by the tree."""
        return self._total

    def evictable_size(self) -> int:
        """Tokens in unlocked nodes (what ``evict`` can free, given time)."""
        return self._evictable

    def protected_size(self) -> int:
        """Tokens in nodes locked by a running request."""
        return self._protected

    def num_nodes(self) -> int:
        return self._num_nodes

    def num_checkpoints(self) -> int:
        """Checkpoints held (0 without a state pool)."""
        return len(self._slot_owner)

    def evictable_checkpoints(self) -> int:
        """Checkpoints without a state lock (what ``evict_state`` can free)."""
        return self._evictable_states

    # ------------------------------------------------------------------------------------------
    # lookup
    # ------------------------------------------------------------------------------------------
    def match_prefix(self, token_ids: Sequence[int] | torch.Tensor, namespace: Hashable = None) -> MatchResult:
        """Longest cached usable prefix of ``token_ids`` (rounded down to whole pages): without a
        state pool the whole KV match, with one the longest match that ends at a checkpoint.

        If the KV match ends inside an edge, the edge is split so that ``kv_only_node`` ends
        exactly there. Refreshes the KV recency of the usable path and the recency of the one
        checkpoint the hit uses. Does not lock: call ``inc_lock_ref(res.last_node)``.
        """
        tokens, n = self._tokens(token_ids)
        path, off, child, k = self._descend(tokens, n, namespace)
        if child is not None:
            path.append(self._split(child, k))
            off += k
        num_usable = len(path)
        if self.state_pool is not None:  # usable up to the deepest checkpoint of the match
            while num_usable and path[num_usable - 1].state is None:
                num_usable -= 1
        now = self._now()
        usable = path[:num_usable] if num_usable < len(path) else path
        for node in usable:
            node.last_access = now
        if self._on_access is not None:
            for node in usable:
                self._on_access(node, False)
        values = [node.value for node in path]
        kv_only_node = path[-1] if path else self.root
        if not num_usable:
            return MatchResult(0, self.root, None, off, kv_only_node, values, 0)
        last = usable[-1]
        if self.state_pool is not None:  # refresh the one checkpoint the hit uses, not those above it
            last.state_access = now  # its state-heap entry is re-placed lazily when popped
            last.speculative = False  # it served a hit: an ordinary checkpoint from now on
            if self._on_access is not None:
                self._on_access(last, True)
        return MatchResult(last.depth, last, last.state, off, kv_only_node, values, num_usable)

    def touch(self, node: TreeNode) -> None:
        """Refresh the recency of ``node``'s checkpoint (if any) and the KV recency of ``node`` and
        of the path above it, as a hit ending at ``node`` would (checkpoints above it are left
        alone). For a caller that knows which prefixes it will use soon: touched in the order of
        use, the one used last is the first LRU victim among them."""
        self._check_node(node)
        now = self._now()
        if node.state is not None:
            node.state_access = now
            if self._on_access is not None:
                self._on_access(node, True)
        root = self.root
        while node is not root:
            node.last_access = now
            if self._on_access is not None:
                self._on_access(node, False)
            node = node.parent

    def match_kv(self, token_ids: Sequence[int] | torch.Tensor, namespace: Hashable = None) -> torch.Tensor:
        """KV slots of the longest KV match (whole pages), without splitting or refreshing anything.
        Right after ``insert(key, ...)`` this returns the tree's canonical slots for ``key``."""
        tokens, n = self._tokens(token_ids)
        path, _, child, k = self._descend(tokens, n, namespace)
        values = [node.value for node in path]
        if child is not None:
            values.append(child.value[:k])
        return concat_slots(values)

    def usable_len(self, token_ids: Sequence[int] | torch.Tensor, namespace: Hashable = None) -> int:
        """``match_prefix(token_ids).prefix_len`` without its side effects (no split, no recency
        refresh): for ranking requests by what they would hit (a lower tier's, ``HostCache``)."""
        tokens, n = self._tokens(token_ids)
        path, off, _, k = self._descend(tokens, n, namespace)
        if self.state_pool is None:  # the whole KV match, into an edge too
            return off + k
        for node in reversed(path):  # a checkpoint ends a node: the deepest whole-edge node holding one
            if node.state is not None:
                return node.depth
        return 0

    def branch_point(self, token_ids: Sequence[int] | torch.Tensor, namespace: Hashable = None) -> int | None:
        """Dry-run insert (nothing changes): the length at which inserting ``token_ids`` would split
        an existing edge or add a second child to an existing node — where Marconi's speculative
        insertion wants a checkpoint. None when it would not branch (new key, extension of a leaf,
        key already present up to a node boundary), or when the node there already holds a
        checkpoint."""
        tokens, n = self._tokens(token_ids)
        path, off, child, k = self._descend(tokens, n, namespace)
        if child is not None:
            return off + k  # would split child's edge
        if off == n or not path or not path[-1].children:
            return None
        return None if path[-1].state is not None else off

    def _descend(self, tokens: tuple, n: int, namespace: Hashable) -> tuple[list[TreeNode], int, TreeNode | None, int]:
        """Follow ``tokens[:n]`` down whole edges from the root.

        Returns ``(path, off, child, k)``: ``path`` are the nodes whose whole edge matched, ``off``
        the tokens they cover; if the match ends inside the edge of ``child``, ``k`` (a positive
        multiple of page_size, less than the edge) is how much of it matched, else child is None.
        """
        path: list[TreeNode] = []
        if n == 0:
            return path, 0, None, 0
        ps = self.page_size
        node = self.root
        off = 0
        ck: Hashable = (namespace_key(namespace), tokens[0] if ps == 1 else tokens[:ps])
        try:
            hash(ck)
        except TypeError:
            raise ValueError(f"namespace must be hashable, got {type(namespace).__name__}") from None
        while True:
            child = node.children.get(ck)
            if child is None:
                return path, off, None, 0
            key = child.key
            m = len(key)
            if tokens[off : off + m] != key:  # the first page matches (it is the child key)
                return path, off, child, self._common_len(key, tokens, off, n)
            path.append(child)
            off += m
            if off >= n:
                return path, off, None, 0
            node = child
            ck = tokens[off] if ps == 1 else tokens[off : off + ps]

    def _common_len(self, key: tuple, tokens: tuple, off: int, n: int) -> int:
        """Matched length of edge ``key`` against ``tokens[off:n]``, in whole pages, knowing the
        first page matches and the whole edge does not. Binary search on slice equality: O(log m)
        C-level comparisons instead of a Python loop over tokens."""
        ps = self.page_size
        lo, hi = 1, min(len(key), n - off) // ps  # pages: lo known equal, answer in [lo, hi]
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if key[: mid * ps] == tokens[off : off + mid * ps]:
                lo = mid
            else:
                hi = mid - 1
        return lo * ps

    # ------------------------------------------------------------------------------------------
    # insert
    # ------------------------------------------------------------------------------------------
    def insert(
        self,
        token_ids: Sequence[int] | torch.Tensor,
        kv_indices: torch.Tensor | np.ndarray | Sequence[int],
        checkpoints: Iterable[Checkpoint | tuple[int, int]] = (),
        namespace: Hashable = None,
    ) -> InsertResult:
        """Cache ``token_ids`` (rounded down to whole pages) with their KV slots ``kv_indices``.

        ``kv_indices[i]`` holds the KV of ``token_ids[i]``; the tail past the last whole page stays
        the caller's. Of the whole pages, the tree adopts the slots of the part it did not have and
        frees the caller's slots that duplicate what it has (slots equal to the tree's own, e.g. a
        matched prefix, are left alone).

        ``checkpoints`` are ``Checkpoint(length, slot, speculative=False, requested=False)`` or
        plain ``(length, slot)`` pairs (a state pool is needed for any): each slot, freshly forked
        for the tree, goes on the node ending at ``length`` (splitting an edge there if needed); on
        a node that already holds one it is a duplicate and is freed (an ordinary duplicate makes a
        speculative checkpoint there ordinary, a requested one makes it requested), on a tombstone
        it revives the node. Raises ValueError (and changes nothing) on bad input.
        """
        tokens, n = self._tokens(token_ids)
        kv = as_index_array(kv_indices)
        if len(kv) != len(tokens):
            raise ValueError(f"got {len(tokens)} tokens but {len(kv)} KV indices")
        ckpts = self._check_checkpoints(checkpoints, n) if checkpoints else []
        path, off, child, k = self._descend(tokens, n, namespace)
        ps = self.page_size
        if ps > 1 and off + k < n and (kv[off + k] % ps or kv[n - 1] % ps != ps - 1):
            # the pages it would adopt must be whole pages: a cheap check of both ends here,
            # every page in check_integrity()
            raise ValueError(f"KV indices of whole pages must start and end on page boundaries "
                             f"(page_size={ps}); allocate them with KVPool.alloc_extend")
        if child is not None:  # nothing has changed so far: input errors leave the tree as it was
            path.append(self._split(child, k))
            off += k
        now = self._now()
        if off:
            self._free_duplicates(kv, path)
        for node in path:
            node.last_access = now
        if self._on_access is not None:
            for node in path:
                self._on_access(node, False)
        if off < n:
            parent = path[-1] if path else self.root
            path.append(self._add_leaf(parent, namespace, tokens[off:n], kv[off:n].copy(), now))
        num_new = self._attach_checkpoints(path, ckpts, now) if ckpts else 0
        last = path[-1] if path else self.root
        return InsertResult(off, last, num_new, [node.value for node in path])

    def _check_checkpoints(self, checkpoints: Iterable[Checkpoint | tuple[int, int]],
                           n: int) -> list[tuple[int, int, bool, bool]]:
        """Validate checkpoints against a key of ``n`` whole-page tokens: ``(length, slot,
        speculative, requested)`` tuples sorted by length."""
        ps = self.page_size
        out: list[tuple[int, int, bool, bool]] = []
        for item in checkpoints:
            if self.state_pool is None:
                raise ValueError("a RadixCache without a state_pool stores no state checkpoints")
            flags = [False, False]
            try:
                if len(item) in (3, 4):
                    length, slot, *given = item
                    if not all(isinstance(f, (bool, np.bool_)) for f in given):
                        raise ValueError(f"a checkpoint's speculative and requested flags must be bools, got {item!r}")
                    flags[:len(given)] = given
                else:
                    length, slot = item
                length, slot = int(length), int(slot)
            except (TypeError, ValueError):
                raise ValueError(f"a checkpoint is a (length, slot[, speculative[, requested]]) tuple, "
                                 f"got {item!r}") from None
            speculative, requested = flags
            if length % ps or not 1 <= length <= n:
                raise ValueError(
                    f"checkpoint length {length} must be a multiple of page_size={ps} within the key's "
                    f"{n} whole-page tokens")
            if slot in self._slot_owner:
                raise ValueError(f"state slot {slot} already belongs to the tree (pass a forked slot)")
            if not self.state_pool.is_allocated_slot(slot):
                raise ValueError(f"checkpoint slot {slot} is not an allocated state-pool slot")
            out.append((length, slot, bool(speculative), bool(requested)))  # np.bool_ -> bool
        if len(out) > 1:
            if len({c[0] for c in out}) != len(out) or len({c[1] for c in out}) != len(out):
                raise ValueError(f"checkpoint lengths and slots must be distinct: {out}")
            out.sort()
        return out

    def _attach_checkpoints(self, path: list[TreeNode], ckpts: list[tuple[int, int, bool, bool]], now: float) -> int:
        """Put each checkpoint on the path node ending at its length (splitting an edge there if
        needed). ``path`` covers the whole key from the root; it is updated in place by splits.
        Returns the number adopted; duplicates are freed."""
        duplicates: list[int] = []
        adopted = 0
        i = 0
        for length, slot, speculative, requested in ckpts:  # ascending, so i only moves forward
            while path[i].depth < length:
                i += 1
            node = path[i]
            if node.depth != length:  # inside node's edge
                node = self._split(node, length - node.start)
                path.insert(i, node)
            node.state_access = now
            if node.state is None:  # a new node or a tombstone: adopt (revive)
                node.state = slot
                node.speculative = speculative
                node.requested = requested
                self._slot_owner[slot] = node
                self._evictable_states += 1  # a tombstone has no state lock
                self._push_state(node)
                if len(node.parent.children) == 1:  # the checkpoint above may now be superseded
                    self._queue_superseded_from(node.parent)
                adopted += 1
            else:
                duplicates.append(slot)
                if not speculative:
                    node.speculative = False  # confirmed: an ordinary checkpoint wants it too
                node.requested |= requested  # (its replaceable-heap entry is dropped lazily)
            if self._on_access is not None:
                self._on_access(node, True)
        if duplicates:
            self.state_pool.free(np.array(duplicates, dtype=np.int64))
        return adopted

    def _free_duplicates(self, kv: np.ndarray, path: list[TreeNode]) -> None:
        """Free the caller's slots for the tokens the tree already holds (``path``), except those
        that are the tree's own (a matched prefix comes back as is). Compares node by node as
        bytes: the common all-equal case costs no numpy arithmetic."""
        start = 0
        for node in path:
            theirs = node.value
            end = start + len(theirs)
            mine = kv[start:end]
            if mine.tobytes() != theirs.tobytes():
                self.kv_pool.free(mine[mine != theirs])
            start = end

    def _add_leaf(self, parent: TreeNode, namespace: Hashable, key: tuple, value: np.ndarray,
                  now: float) -> TreeNode:
        ps = self.page_size
        first = key[0] if ps == 1 else key[:ps]
        ck = (namespace_key(namespace), first) if parent is self.root else first
        leaf = TreeNode(next(self._ids), parent, ck, key, value, parent.depth + len(key), now)
        parent.children[ck] = leaf
        self._num_nodes += 1
        self._total += len(key)
        self._evictable += len(key)
        if self._on_create is not None:
            self._on_create(leaf)
        self._kv_heap.push(leaf)
        if self.policy.structural:
            self._push_state(parent)
        return leaf

    def _split(self, child: TreeNode, k: int) -> TreeNode:
        """Cut ``child``'s edge after ``k`` tokens. A new node takes the first ``k`` tokens (and a
        copy of child's lock count: every lock through child passes through it) and becomes
        child's parent; child keeps its identity, the rest of its edge, its checkpoint and its
        locks. The new node holds no checkpoint: the state after its last token was never stored.
        Sizes are unchanged."""
        ps = self.page_size
        parent = child.parent
        upper = TreeNode(next(self._ids), parent, child.child_key, child.key[:k], child.value[:k],
                         child.depth - len(child.key) + k, child.last_access)
        upper.lock_ref = child.lock_ref
        upper.state_access = child.state_access
        parent.children[upper.child_key] = upper
        child.key = child.key[k:]
        child.value = child.value[k:]
        child.child_key = child.key[0] if ps == 1 else child.key[:ps]
        child.parent = upper
        upper.children[child.child_key] = child
        self._num_nodes += 1
        if self._on_create is not None:
            self._on_create(upper)
        if self.policy.structural:
            self._kv_heap.push(child)
            self._push_state(child)
        return upper

    # ------------------------------------------------------------------------------------------
    # locks
    # ------------------------------------------------------------------------------------------
    def inc_lock_ref(self, node: TreeNode) -> None:
        """KV-lock the path from ``node`` to the root: none of it can be evicted until unlocked."""
        self._check_node(node)
        root = self.root
        while node is not root:
            if node.lock_ref == 0:
                n = len(node.key)
                self._evictable -= n
                self._protected += n
            node.lock_ref += 1
            node = node.parent

    def dec_lock_ref(self, node: TreeNode) -> None:
        """Undo one ``inc_lock_ref(node)``. ValueError if ``node`` is not locked."""
        self._check_node(node)
        if node is self.root:
            return
        if node.lock_ref <= 0:
            raise ValueError(f"dec_lock_ref on an unlocked node: {node!r}")
        bottom, root = node, self.root
        while node is not root:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                n = len(node.key)
                self._protected -= n
                self._evictable += n
                if node.speculative:  # no running request extends it any more: replaceable now
                    self._replaceable_heap.push(node)
            node = node.parent
        if self.state_pool is not None and bottom.state is None and not bottom.children and not bottom.lock_ref:
            # an unlocked tombstone leaf (KV past the last checkpoint, e.g. a turn's tail off the
            # checkpoint grid) can never serve a hit: give its KV back now, not after useful KV
            kv_out: list[np.ndarray] = []
            state_out: list[int] = []
            self.num_garbage_tokens += self._remove_leaf(bottom, kv_out, state_out, GARBAGE)
            self._release(kv_out, state_out)
            return
        self._kv_heap.push(bottom)  # only the bottom node can be a leaf

    def inc_state_lock(self, node: TreeNode) -> None:
        """Protect ``node``'s checkpoint (only it) from ``evict_state`` and its leaf from ``evict``.
        ValueError on a node without a checkpoint (every node of a tree without a state pool)."""
        self._check_node(node)
        if node.state is None:
            raise ValueError(f"inc_state_lock on a node without a checkpoint: {node!r}")
        if node.state_lock == 0:
            self._evictable_states -= 1
        node.state_lock += 1

    def dec_state_lock(self, node: TreeNode) -> None:
        """Undo one ``inc_state_lock(node)``. ValueError if its checkpoint is not locked."""
        self._check_node(node)
        if node.state_lock <= 0:
            raise ValueError(f"dec_state_lock on a checkpoint that is not locked: {node!r}")
        node.state_lock -= 1
        if node.state_lock == 0:
            self._evictable_states += 1
            self._push_state(node)
            self._kv_heap.push(node)

    def _check_node(self, node: TreeNode) -> None:
        if not isinstance(node, TreeNode) or node.removed:
            raise ValueError(f"{node!r} is not a node of this tree (evicted?)")

    # ------------------------------------------------------------------------------------------
    # eviction
    # ------------------------------------------------------------------------------------------
    def evict(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` KV slots by deleting unlocked leaves in policy order (and
        their checkpoints); returns the tokens freed (less only when nothing is left to evict)."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        kv_out: list[np.ndarray] = []
        state_out: list[int] = []
        freed = 0
        if num_tokens > 0:
            for node in self._kv_heap.drain():
                freed += self._remove_leaf(node, kv_out, state_out, KV_EVICTION)
                if freed >= num_tokens:
                    break
        self._release(kv_out, state_out)
        return freed

    def evict_state(self, num_slots: int, *, for_speculative: bool = False) -> int:
        """Free up to ``num_slots`` checkpoint slots in policy order; returns how many were freed
        (0 without a state pool). An unlocked leaf is deleted with its KV; any other node —
        internal, or a leaf whose KV a request locks — becomes a tombstone.

        *Replaceable* checkpoints (``TreeNode.replaceable``: superseded by a deeper one on their
        single-child path, or speculative with no running request on their path) go first, then
        the others — unless the policy sets ``replaceable_first = False`` (it picks its victims
        itself). ``for_speculative=True``: make room for speculative checkpoints, which may
        replace only replaceable checkpoints; returns fewer than ``num_slots`` when those run out,
        and the caller stores fewer speculative checkpoints."""
        if num_slots < 0:
            raise ValueError(f"num_slots must be >= 0, got {num_slots}")
        if num_slots == 0:
            order: Iterable[TreeNode] = ()
        elif for_speculative:
            order = self._replaceable_heap.drain()
        elif self.policy.replaceable_first:
            order = itertools.chain(self._replaceable_heap.drain(), self._state_heap.drain())
        else:
            order = self._state_heap.drain()
        kv_out: list[np.ndarray] = []
        state_out: list[int] = []
        freed = 0
        for node in order:
            if not node.children and not node.lock_ref:
                self._remove_leaf(node, kv_out, state_out, STATE_EVICTION)
            else:
                state_out.append(self._take_state(node, STATE_EVICTION))
                if self.policy.structural:
                    self._kv_heap.push(node)
            freed += 1
            if freed >= num_slots:
                break
        self._release(kv_out, state_out)
        return freed

    def confirm_checkpoint(self, node: TreeNode) -> int:
        """A sequence ending at ``node`` has finished (a turn of a chat, a retracted request): the
        deepest checkpoint at or above ``node`` — the state its continuation starts from — becomes
        ordinary if it was speculative, so that no speculative checkpoint replaces it. Returns its
        length (0 if the path holds none)."""
        self._check_node(node)
        while node is not self.root and node.state is None:
            node = node.parent
        if node is self.root:
            return 0
        node.speculative = False  # its replaceable-heap entry is dropped lazily (no candidate now)
        return node.depth

    def evict_checkpoint(self, node: TreeNode) -> None:
        """Free ``node``'s checkpoint now (the caller decided it is superseded, e.g. by a state it is
        about to insert deeper on the same path): the node becomes a tombstone — an unlocked leaf
        goes with its KV. ValueError if ``node`` holds no checkpoint or it is state-locked."""
        self._check_node(node)
        if node.state is None or node.state_lock:
            raise ValueError(f"evict_checkpoint needs an unlocked checkpoint: {node!r}")
        kv_out: list[np.ndarray] = []
        state_out: list[int] = []
        if not node.children and not node.lock_ref:
            self._remove_leaf(node, kv_out, state_out, CHECKPOINT_EVICTION)
        else:
            state_out.append(self._take_state(node, CHECKPOINT_EVICTION))
            if self.policy.structural:
                self._kv_heap.push(node)
        self._release(kv_out, state_out)

    def _kv_candidate(self, node: TreeNode) -> bool:
        """An unlocked leaf (KV heap membership)."""
        return not (node.children or node.lock_ref or node.state_lock or node.removed or node is self.root)

    def _state_candidate(self, node: TreeNode) -> bool:
        """A node holding an unlocked checkpoint (state heap membership)."""
        return node.state is not None and not node.state_lock and not node.removed

    def _replaceable_candidate(self, node: TreeNode) -> bool:
        """A node holding an unlocked replaceable checkpoint (replaceable heap membership)."""
        return not node.state_lock and not node.removed and node.replaceable

    def _push_state(self, node: TreeNode) -> None:
        """(Re-)queue ``node``'s checkpoint in the checkpoint orders it belongs to."""
        self._state_heap.push(node)
        if node.speculative or len(node.children) == 1:  # else it cannot be replaceable: skip the test
            self._replaceable_heap.push(node)

    def _queue_superseded_from(self, node: TreeNode) -> None:
        """A checkpoint appeared below ``node``, or ``node`` was left with a single child: the
        nearest checkpoint at or above it whose single-child path leads here may have become
        superseded. Queue it (the heap checks). O(length of that single-child path)."""
        root = self.root
        while node is not root and len(node.children) == 1:
            if node.state is not None:
                self._replaceable_heap.push(node)
                return
            node = node.parent

    def _remove_leaf(self, node: TreeNode, kv_out: list[np.ndarray], state_out: list[int], how: str) -> int:
        """Delete an unlocked leaf, its KV and checkpoint into the free lists; then, with a state
        pool, its parent if that became an unlocked tombstone leaf, and so on up. A parent that
        became an unlocked leaf worth keeping joins the KV heap. Returns the tokens removed.
        ``how``: which operation, for the ledger."""
        freed = 0
        root = self.root
        while True:
            if self.ledger is not None:
                self.ledger.removed(node, kv=True, how=how)
            if self.on_evict is not None and how in _SPILLED and (node.state is not None or self.state_pool is None):
                self._tell_lower_tier(node)
            parent = node.parent
            del parent.children[node.child_key]
            n = len(node.key)
            freed += n
            self._total -= n
            self._evictable -= n
            kv_out.append(node.value)
            if node.state is not None:
                state_out.append(self._take_state(node, how, record=False))
            node.removed = True  # its heap entries are dropped lazily: it is no candidate any more
            self._num_nodes -= 1
            if self._on_remove is not None:
                self._on_remove(node)
            if parent is root:
                return freed
            if parent.children or parent.lock_ref or parent.state is not None or self.state_pool is None:
                if not parent.children:  # it became a leaf: a KV candidate if unlocked
                    self._kv_heap.push(parent)
                if self.policy.structural:
                    self._push_state(parent)
                if len(parent.children) == 1 and self.state_pool is not None:
                    self._queue_superseded_from(parent)  # a branch is gone: the path may now be single-child
                return freed
            node = parent  # an unlocked tombstone leaf: no hit can ever use its KV

    def _tell_lower_tier(self, node: TreeNode) -> None:
        """``on_evict(node)``; a lower tier's failure (a copy out of memory) is logged, and the
        eviction goes on: the prefix is then only not kept."""
        try:
            self.on_evict(node)
        except Exception:  # noqa: BLE001 (the eviction must finish: the tree's books depend on it)
            logger.exception("the lower cache tier failed to keep an evicted prefix; it is dropped")

    def _take_state(self, node: TreeNode, how: str, record: bool = True) -> int:
        """Detach ``node``'s (unlocked) checkpoint, making it a tombstone; returns the slot."""
        if record and self.ledger is not None:
            self.ledger.removed(node, kv=False, how=how)
        if record and self.on_evict is not None and how in _SPILLED:
            self._tell_lower_tier(node)
        slot = node.state
        del self._slot_owner[slot]
        node.state = None
        node.speculative = node.requested = False
        self._evictable_states -= 1
        return slot

    def _release(self, kv_out: list[np.ndarray], state_out: list[int]) -> None:
        """Return evicted slots to the pools in one call each. Tree pages are distinct by
        construction, so the pool skips its distinctness sort."""
        if kv_out:
            ps = self.page_size
            slots = kv_out[0] if len(kv_out) == 1 else np.concatenate(kv_out)
            self.kv_pool.free_pages(slots[::ps] // ps if ps > 1 else slots, known_unique=True)
        if state_out:
            self.state_pool.free(np.array(state_out, dtype=np.int64))

    def refresh_priority(self, node: TreeNode) -> None:
        """Re-queue ``node`` at the priority its policy gives it now, in the heaps it belongs to.
        For policies whose priorities change for reasons the tree cannot see (time, other nodes);
        the tree already re-queues on everything it tracks."""
        self._check_node(node)
        self._kv_heap.push(node)
        self._push_state(node)

    # ------------------------------------------------------------------------------------------
    # misc
    # ------------------------------------------------------------------------------------------
    def _now(self) -> float:
        if self._clock is not None:
            return self._clock()
        self._tick += 1
        return self._tick

    def _tokens(self, token_ids: Sequence[int] | torch.Tensor) -> tuple[tuple, int]:
        """Token ids as a tuple (one conversion per call; edges compare as tuple slices) and the
        length rounded down to whole pages."""
        if type(token_ids) is not tuple:
            if isinstance(token_ids, torch.Tensor):
                token_ids = token_ids.tolist()
            token_ids = tuple(token_ids)
        n = len(token_ids)
        return token_ids, n - n % self.page_size

    def path_of(self, node: TreeNode) -> tuple[Hashable, tuple, np.ndarray]:
        """``(namespace, token ids, KV slots)`` of the prefix that ends at ``node``: its path from the
        root (what a lower tier stores; for a node an eviction is about to free too: ``on_evict``)."""
        keys: list[tuple] = []
        values: list[np.ndarray] = []
        top = node
        while node is not self.root:
            keys.append(node.key)
            values.append(node.value)
            top, node = node, node.parent
        if not keys:
            return None, (), EMPTY_SLOTS
        namespace = top.child_key[0][0]  # a child of the root: (namespace_key(namespace), first page)
        return namespace, tuple(itertools.chain.from_iterable(reversed(keys))), np.concatenate(values[::-1])

    def nodes(self) -> Iterator[TreeNode]:
        """All non-root nodes, parents before children (O(n); for tests, stats and reset)."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def reset(self) -> None:
        """Free every slot the tree holds and empty it (a ledger records each node as removed, how
        "reset"). ValueError while any node is locked."""
        nodes = list(self.nodes())
        if self._protected or any(node.state_lock for node in nodes):
            raise ValueError("reset() while requests hold locks on the tree")
        if self.ledger is not None:
            for node in nodes:
                self.ledger.removed(node, kv=True, how="reset")
        kv_out = [node.value for node in nodes]
        state_out = [node.state for node in nodes if node.state is not None]
        self._release(kv_out, state_out)
        self._init_tree()

    def check_integrity(self) -> None:
        """Assert every structural invariant (O(n)); tests call it after each operation."""
        ps = self.page_size
        total = evictable = protected = num_nodes = evictable_states = 0
        seen_pages: set[int] = set()
        held: dict[int, TreeNode] = {}
        kv_queued, state_queued = self._kv_heap.queued(), self._state_heap.queued()
        replaceable_queued = self._replaceable_heap.queued()
        assert self.root.lock_ref == 0 and self.root.state is None and not self.root.key
        stack = [self.root]
        while stack:
            node = stack.pop()
            child_locks = 0
            for ck, child in node.children.items():
                n = len(child.key)
                assert child.parent is node and not child.removed, f"bad parent link at {child!r}"
                first = child.key[0] if ps == 1 else child.key[:ps]
                assert ck == child.child_key and ck == (first if node is not self.root else (ck[0], first)), \
                    f"child key of {child!r} does not match its edge"
                assert n > 0 and n % ps == 0 and len(child.value) == n, f"edge of {child!r} is not whole pages"
                assert child.depth == node.depth + n, f"depth of {child!r}"
                assert child.lock_ref >= 0 and child.state_lock >= 0, f"negative lock at {child!r}"
                assert child.state_lock == 0 or child.state is not None, f"state lock without state {child!r}"
                pages = (child.value[::ps] // ps).tolist() if ps > 1 else child.value.tolist()
                assert ps == 1 or _is_whole_pages(child.value, ps), f"KV of {child!r} is not whole pages"
                assert not seen_pages.intersection(pages), f"KV slots of {child!r} are held twice"
                seen_pages.update(pages)
                child_locks += child.lock_ref
                total += n
                num_nodes += 1
                if child.lock_ref:
                    protected += n
                else:
                    evictable += n
                if self._kv_candidate(child):
                    assert id(child) in kv_queued, f"evictable leaf {child!r} missing from the KV heap"
                assert child.state is not None or not (child.speculative or child.requested), \
                    f"speculative or requested tombstone {child!r}"
                if child.state is not None:
                    assert child.state not in held, f"state slot {child.state} is held twice"
                    held[child.state] = child
                    if not child.state_lock:
                        evictable_states += 1
                        assert id(child) in state_queued, f"checkpoint of {child!r} missing from the state heap"
                        assert id(child) in replaceable_queued or not child.replaceable, \
                            f"replaceable checkpoint of {child!r} missing from the replaceable heap"
                stack.append(child)
            if node is not self.root:
                assert node.lock_ref >= child_locks, f"lock_ref of {node!r} below its children's"
        assert (total, evictable, protected, num_nodes) == (self._total, self._evictable, self._protected,
                                                             self._num_nodes), "size counters drifted"
        assert evictable + protected == total
        if seen_pages:
            assert self.kv_pool.is_allocated(np.array(sorted(seen_pages)) * ps), "the tree holds free KV slots"
        assert held == self._slot_owner, "checkpoint owner map drifted"
        assert evictable_states == self._evictable_states, "evictable checkpoint counter drifted"
        if held:
            assert self.state_pool is not None, "a tree without a state pool holds a checkpoint"
            assert self.state_pool.is_allocated(np.array(sorted(held), dtype=np.int64)), \
                "the tree holds a free state slot"

    def __repr__(self) -> str:
        states = "" if self.state_pool is None else f", checkpoints={len(self._slot_owner)}"
        return (f"RadixCache(nodes={self._num_nodes}, tokens={self._total}, evictable={self._evictable}, "
                f"protected={self._protected}{states}, page_size={self.page_size})")


def _hook(policy: EvictionPolicy, name: str) -> Callable[..., None] | None:
    """``policy.<name>`` if the policy overrides the no-op default, else None (not worth a call)."""
    return None if getattr(type(policy), name) is getattr(EvictionPolicy, name) else getattr(policy, name)


def _is_whole_pages(slots: np.ndarray, ps: int) -> bool:
    """Whether ``slots`` are whole pages, each filled in order (how the allocator hands them out)."""
    pages = slots.reshape(-1, ps)  # [num_pages, ps]
    return not ((pages[:, 0] % ps).any() or (pages - pages[:, :1] != np.arange(ps)).any())


__all__ = ["Checkpoint", "InsertResult", "MatchResult", "RadixCache", "TreeNode"]
