"""The KV radix tree: a path-compressed prefix tree over token ids whose nodes own KV slots.

Structure
---------
* Each non-root node owns an edge: ``key`` (a tuple of token ids, a positive multiple of
  ``page_size`` long) and ``value`` (the KV slots of those tokens, an ``int64`` numpy array of the
  same length, whole pages). ``depth`` is the number of tokens from the root through the node.
* Children are found by the first page of their edge: ``key[0]`` when ``page_size == 1``, else
  the tuple ``key[:page_size]``. Children of the root are keyed by ``(namespace, first page)`` so
  that different namespaces (LoRA id, cache salt) never share a node.
* Keys are rounded down to whole pages: ``match_prefix``/``insert`` ignore a partial last page;
  that tail stays private to the request.
* Splitting an edge makes a *new upper node*; the existing node keeps its identity, its suffix,
  its locks and (in the hybrid tree) its checkpoint, so a node handed to the engine never changes
  the position it ends at.

Locks and sizes
---------------
``inc_lock_ref(node)`` increments ``lock_ref`` of every node from ``node`` up to the root, so a
node's ``lock_ref`` is at least the sum of its children's. A node with ``lock_ref > 0`` is
*protected*; its tokens count in ``protected_size()``, the others in ``evictable_size()``; the two
add up to ``total_size()``. Only unlocked leaves are evicted.

Eviction
--------
``evict(n)`` pops unlocked leaves from a heap ordered by the pluggable ``EvictionPolicy`` (LRU by
default) until ``n`` tokens are freed; a parent that becomes an unlocked leaf joins the heap. A
node is pushed when it *becomes* a candidate (new leaf, last child evicted, lock released), not
on every access: an access only moves its timestamp, and a popped entry whose stored priority is
stale goes back in at its current priority (priorities never decrease on access). Entries of
nodes that changed since are dropped by a per-node version counter, and the heap is compacted
when it grows past twice the node count: a call costs O(k log n) amortized for k evicted leaves,
and a hit costs no heap operation at all.

Everything here is single-threaded: the scheduler is the only caller (as in SGLang).
"""

from __future__ import annotations

import heapq
import itertools
from typing import Any, Callable, Hashable, Iterable, Iterator, Sequence

import numpy as np
import torch

from hyla.cache.allocator import as_index_array
from hyla.cache.kv_pool import KVPool
from hyla.cache.policy import EvictionPolicy, LRUPolicy

_EMPTY = np.zeros(0, dtype=np.int64)


def _concat(values: list[np.ndarray]) -> torch.Tensor:
    """One fresh ``int64`` CPU tensor from per-node slot arrays (never a view of the tree's)."""
    if not values:
        return torch.zeros(0, dtype=torch.int64)
    if len(values) == 1:
        return torch.from_numpy(values[0].copy())
    return torch.from_numpy(np.concatenate(values))


class TreeNode:
    """One edge of the tree and the node it ends at. Fields are read by policies and tests;
    only the tree writes them."""

    __slots__ = (
        "id", "parent", "children", "child_key", "key", "value", "depth", "state",
        "lock_ref", "state_lock", "last_access", "state_access", "kv_version", "state_version",
        "removed", "policy_data",
    )

    def __init__(self, node_id: int, parent: "TreeNode | None", child_key: Hashable, key: tuple,
                 value: np.ndarray, depth: int, now: float) -> None:
        self.id = node_id
        self.parent = parent
        self.children: dict[Hashable, TreeNode] = {}
        self.child_key = child_key  # this node's key in parent.children
        self.key = key  # token ids of the edge
        self.value = value  # KV slots of the edge, int64 [len(key)]
        self.depth = depth  # tokens from the root through this node
        self.state: int | None = None  # checkpoint slot: the state after this node's last token
        self.lock_ref = 0  # KV locks on this node or below
        self.state_lock = 0  # locks on this node's checkpoint only
        self.last_access = now  # KV recency
        self.state_access = now  # checkpoint recency
        self.kv_version = 0  # bumped on every push into the KV heap (older entries are stale)
        self.state_version = 0  # same for the state heap
        self.removed = False
        self.policy_data: Any = None

    @property
    def num_tokens(self) -> int:
        return len(self.key)

    @property
    def num_children(self) -> int:
        return len(self.children)

    @property
    def is_leaf(self) -> bool:
        return not self.children

    @property
    def has_state(self) -> bool:
        return self.state is not None

    @property
    def start(self) -> int:
        """Tokens from the root to the start of this node's edge."""
        return self.depth - len(self.key)

    def __repr__(self) -> str:
        return (f"TreeNode(id={self.id}, tokens=[{self.start}:{self.depth}], children={len(self.children)}, "
                f"state={self.state}, lock_ref={self.lock_ref}, state_lock={self.state_lock})")


class MatchResult:
    """What ``match_prefix`` found. ``kv_indices``/``kv_only_indices`` are concatenated on first
    access (fresh tensors; the tree keeps its own arrays)."""

    __slots__ = ("prefix_len", "last_node", "state_slot", "kv_only_len", "kv_only_node",
                 "_values", "_num_usable", "_kv", "_kv_only")

    def __init__(self, prefix_len: int, last_node: TreeNode, state_slot: int | None, kv_only_len: int,
                 kv_only_node: TreeNode, values: list[np.ndarray], num_usable: int) -> None:
        self.prefix_len = prefix_len  # usable prefix: ends at last_node
        self.last_node = last_node  # root when prefix_len == 0
        self.state_slot = state_slot  # tree's checkpoint at last_node (hybrid), else None
        self.kv_only_len = kv_only_len  # how far the KV alone matched (>= prefix_len)
        self.kv_only_node = kv_only_node  # node ending exactly at kv_only_len
        self._values = values  # per-node slot arrays along the KV-only path
        self._num_usable = num_usable  # how many of them form the usable prefix
        self._kv: torch.Tensor | None = None
        self._kv_only: torch.Tensor | None = None

    @property
    def kv_indices(self) -> torch.Tensor:
        """KV slots of the usable prefix, ``[prefix_len]`` int64."""
        if self._kv is None:
            self._kv = _concat(self._values[: self._num_usable])
        return self._kv

    @property
    def kv_only_indices(self) -> torch.Tensor:
        """KV slots of the whole KV match, ``[kv_only_len]`` int64."""
        if self._kv_only is None:
            self._kv_only = _concat(self._values)
        return self._kv_only

    def __repr__(self) -> str:
        return (f"MatchResult(prefix_len={self.prefix_len}, state_slot={self.state_slot}, "
                f"kv_only_len={self.kv_only_len})")


class InsertResult:
    """What ``insert`` did. ``kv_indices`` are the tree's canonical slots for the inserted pages."""

    __slots__ = ("num_existing", "last_node", "num_new_checkpoints", "_values", "_kv")

    def __init__(self, num_existing: int, last_node: TreeNode, num_new_checkpoints: int,
                 values: list[np.ndarray]) -> None:
        self.num_existing = num_existing  # tokens of the key the tree already had
        self.last_node = last_node  # node ending at the (page-rounded) key length; root if 0
        self.num_new_checkpoints = num_new_checkpoints  # checkpoints adopted (not duplicates)
        self._values = values
        self._kv: torch.Tensor | None = None

    @property
    def kv_indices(self) -> torch.Tensor:
        """The tree's KV slots for the inserted whole pages, ``[last_node.depth]`` int64."""
        if self._kv is None:
            self._kv = _concat(self._values)
        return self._kv

    def __iter__(self) -> Iterator[Any]:  # allows ``num_existing, last_node = cache.insert(...)``
        return iter((self.num_existing, self.last_node))

    def __repr__(self) -> str:
        return (f"InsertResult(num_existing={self.num_existing}, last_node={self.last_node!r}, "
                f"num_new_checkpoints={self.num_new_checkpoints})")


class RadixCache:
    """KV-only radix tree over a ``KVPool`` (pure-attention models, and the base of the hybrid tree).

    Ownership: the tree owns the KV slots stored in its nodes and frees them to ``kv_pool`` when it
    evicts them (or on ``reset``). ``insert`` adopts the caller's slots for the new part of the key
    and frees the caller's slots that duplicate pages the tree already holds.
    """

    def __init__(
        self,
        kv_pool: KVPool,
        page_size: int | None = None,
        *,
        policy: EvictionPolicy | None = None,
        clock: Callable[[], float] | None = None,
    ) -> None:
        if page_size is not None and page_size != kv_pool.page_size:
            raise ValueError(f"page_size {page_size} disagrees with the KV pool's {kv_pool.page_size}")
        self.kv_pool = kv_pool
        self.page_size = kv_pool.page_size
        self.policy = policy if policy is not None else LRUPolicy()
        # hooks are called only when the policy overrides them (LRU reads the time stamps directly)
        self._on_access = _hook(self.policy, "on_access")
        self._on_create = _hook(self.policy, "on_create")
        self._on_remove = _hook(self.policy, "on_remove")
        self._clock = clock  # None: a logical clock that ticks once per match/insert
        self._tick = 0
        self._seq = itertools.count()  # heap tie-breaker: FIFO among equal priorities
        self._ids = itertools.count(1)
        self._init_tree()

    def _init_tree(self) -> None:
        self.root = TreeNode(0, None, None, (), _EMPTY, 0, 0.0)
        self._num_nodes = 0
        self._total = 0  # tokens in the tree
        self._evictable = 0  # tokens in nodes with lock_ref == 0
        self._protected = 0  # tokens in nodes with lock_ref > 0
        self._kv_heap: list[tuple[float, int, int, TreeNode]] = []
        self._state_heap: list[tuple[float, int, int, TreeNode]] = []

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
        return 0

    # ------------------------------------------------------------------------------------------
    # lookup
    # ------------------------------------------------------------------------------------------
    def match_prefix(self, token_ids: Sequence[int] | torch.Tensor, namespace: Hashable = None) -> MatchResult:
        """Longest cached usable prefix of ``token_ids`` (rounded down to whole pages).

        If the KV match ends inside an edge, the edge is split so that ``kv_only_node`` ends
        exactly there. Refreshes the recency of the usable path (KV) and, in the hybrid tree, of
        the one checkpoint the hit uses. Does not lock: call ``inc_lock_ref(res.last_node)``.
        """
        tokens, n = self._tokens(token_ids)
        path, off, child, k = self._descend(tokens, n, namespace)
        if child is not None:
            path.append(self._split(child, k))
            off += k
        num_usable = self._num_usable(path)
        now = self._now()
        for node in path[:num_usable]:
            node.last_access = now
        if self._on_access is not None:
            for node in path[:num_usable]:
                self._on_access(node, False)
        last = path[num_usable - 1] if num_usable else self.root
        state = self._on_hit(last, now) if num_usable else None
        return MatchResult(last.depth, last, state, off, path[-1] if path else self.root,
                           [node.value for node in path], num_usable)

    def match_kv(self, token_ids: Sequence[int] | torch.Tensor, namespace: Hashable = None) -> torch.Tensor:
        """KV slots of the longest KV match (whole pages), without splitting or refreshing anything.
        Right after ``insert(key, ...)`` this returns the tree's canonical slots for ``key``."""
        tokens, n = self._tokens(token_ids)
        path, _, child, k = self._descend(tokens, n, namespace)
        values = [node.value for node in path]
        if child is not None:
            values.append(child.value[:k])
        return _concat(values)

    def branch_point(self, token_ids: Sequence[int] | torch.Tensor, namespace: Hashable = None) -> int | None:
        """Dry-run insert (nothing changes): the length at which inserting ``token_ids`` would split
        an existing edge or add a second child to an existing node — where Marconi's speculative
        insertion wants a checkpoint. None when it would not branch (new key, extension of a leaf,
        key already present up to a node boundary), and in the hybrid tree also when the node
        there already holds a checkpoint."""
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
        ck: Hashable = (namespace, tokens[0] if ps == 1 else tokens[:ps])
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

    def _num_usable(self, path: list[TreeNode]) -> int:
        """How many nodes of a KV match form the usable prefix: all of them for KV-only."""
        return len(path)

    def _on_hit(self, node: TreeNode, now: float) -> int | None:
        """Hook for a hit ending at ``node``; returns the checkpoint slot the hit uses (none here)."""
        return None

    # ------------------------------------------------------------------------------------------
    # insert
    # ------------------------------------------------------------------------------------------
    def insert(
        self,
        token_ids: Sequence[int] | torch.Tensor,
        kv_indices: torch.Tensor | np.ndarray | Sequence[int],
        checkpoints: Iterable[tuple[int, int]] = (),
        namespace: Hashable = None,
    ) -> InsertResult:
        """Cache ``token_ids`` (rounded down to whole pages) with their KV slots ``kv_indices``.

        ``kv_indices[i]`` holds the KV of ``token_ids[i]``; the tail past the last whole page stays
        the caller's. Of the whole pages, the tree adopts the slots of the part it did not have and
        frees the caller's slots that duplicate what it has (slots equal to the tree's own, e.g. a
        matched prefix, are left alone). ``checkpoints`` are ``(length, state_slot)`` pairs — only
        the hybrid tree takes them. Raises ValueError (and changes nothing) on bad input.
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

    def _check_checkpoints(self, checkpoints: Iterable[tuple[int, int]], n: int) -> list[tuple[int, int]]:
        if list(checkpoints):
            raise ValueError("a KV-only RadixCache stores no state checkpoints (use HybridRadixCache)")
        return []

    def _attach_checkpoints(self, path: list[TreeNode], ckpts: list[tuple[int, int]], now: float) -> int:
        """Hook: the hybrid tree stores checkpoints; the KV-only tree has none to attach
        (``_check_checkpoints`` refused any), so it adopts nothing."""
        return 0

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
        ck = (namespace, first) if parent is self.root else first
        leaf = TreeNode(next(self._ids), parent, ck, key, value, parent.depth + len(key), now)
        parent.children[ck] = leaf
        self._num_nodes += 1
        self._total += len(key)
        self._evictable += len(key)
        if self._on_create is not None:
            self._on_create(leaf)
        self._requeue_kv(leaf)
        if self.policy.structural:
            self._requeue_state(parent)
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
            self._requeue_kv(child)
            self._requeue_state(child)
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
            node = node.parent
        self._requeue_kv(bottom)  # only the bottom node can be a leaf

    def inc_state_lock(self, node: TreeNode) -> None:
        raise ValueError("a KV-only RadixCache has no checkpoints to lock")

    def dec_state_lock(self, node: TreeNode) -> None:
        raise ValueError("a KV-only RadixCache has no checkpoints to unlock")

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
        heap = self._kv_heap
        kv_out: list[np.ndarray] = []
        state_out: list[int] = []
        freed = 0
        priority = self.policy.kv_priority
        while freed < num_tokens and heap:
            entry = heapq.heappop(heap)
            node = entry[3]
            if entry[2] != node.kv_version or not self._kv_candidate(node):
                continue  # stale: the node changed since this entry was pushed
            current = priority(node)
            if current != entry[0]:  # accessed since it was queued: back in, at its new place
                heapq.heappush(heap, (current, next(self._seq), entry[2], node))
                continue
            freed += self._remove_leaf(node, kv_out, state_out)
        self._release(kv_out, state_out)
        return freed

    def evict_state(self, num_slots: int) -> int:
        """Free checkpoint slots (none in a KV-only tree): returns 0."""
        if num_slots < 0:
            raise ValueError(f"num_slots must be >= 0, got {num_slots}")
        return 0

    def _kv_candidate(self, node: TreeNode) -> bool:
        return not (node.children or node.lock_ref or node.state_lock or node.removed or node is self.root)

    def _remove_leaf(self, node: TreeNode, kv_out: list[np.ndarray], state_out: list[int]) -> int:
        """Delete an unlocked leaf, its KV (and checkpoint) into the free lists; then its parent if
        that became an unlocked *garbage* leaf (hybrid: a tombstone), and so on up. A parent that
        became an unlocked leaf with a use joins the KV heap. Returns the tokens removed."""
        freed = 0
        root = self.root
        while True:
            parent = node.parent
            del parent.children[node.child_key]
            n = len(node.key)
            freed += n
            self._total -= n
            self._evictable -= n
            kv_out.append(node.value)
            if node.state is not None:
                state_out.append(self._take_state(node))
            node.removed = True
            self._num_nodes -= 1
            if self._on_remove is not None:
                self._on_remove(node)
            if parent is root:
                return freed
            if parent.children or parent.lock_ref or not self._is_garbage(parent):
                self._requeue_kv(parent)
                if self.policy.structural:
                    self._requeue_state(parent)
                return freed
            node = parent

    def _is_garbage(self, node: TreeNode) -> bool:
        """Whether an unlocked leaf is useless and goes with its last child (never, for KV-only)."""
        return False

    def _take_state(self, node: TreeNode) -> int:
        raise AssertionError("a KV-only tree holds no states")

    def _release(self, kv_out: list[np.ndarray], state_out: list[int]) -> None:
        """Return evicted slots to the pools in one call each. Tree pages are distinct by
        construction, so the pool skips its distinctness sort."""
        if kv_out:
            ps = self.page_size
            slots = kv_out[0] if len(kv_out) == 1 else np.concatenate(kv_out)
            self.kv_pool.free_pages(slots[::ps] // ps if ps > 1 else slots, known_unique=True)

    # ------------------------------------------------------------------------------------------
    # heaps (lazy invalidation)
    # ------------------------------------------------------------------------------------------
    def refresh_priority(self, node: TreeNode) -> None:
        """Re-queue ``node`` at the priority its policy gives it now, in the heaps it belongs to.
        For policies whose priorities change for reasons the tree cannot see (time, other nodes);
        the tree already re-queues on everything it tracks."""
        self._check_node(node)
        self._requeue_kv(node)
        self._requeue_state(node)

    def _requeue_kv(self, node: TreeNode) -> None:
        """(Re-)enter ``node`` into the KV heap with a fresh priority if it is a candidate."""
        if not self._kv_candidate(node):
            return
        node.kv_version += 1
        heapq.heappush(self._kv_heap, (self.policy.kv_priority(node), next(self._seq), node.kv_version, node))
        if len(self._kv_heap) > 2 * self._num_nodes + 1024:
            self._kv_heap = _compact(self._kv_heap, lambda e: e[2] == e[3].kv_version and self._kv_candidate(e[3]))

    def _requeue_state(self, node: TreeNode) -> None:
        """(Re-)enter ``node`` into the state heap if it holds an unlocked checkpoint."""
        if node.state is None or node.state_lock or node.removed:
            return
        node.state_version += 1
        heapq.heappush(self._state_heap,
                       (self.policy.state_priority(node), next(self._seq), node.state_version, node))
        if len(self._state_heap) > 2 * self._num_nodes + 1024:
            self._state_heap = _compact(
                self._state_heap,
                lambda e: e[2] == e[3].state_version and e[3].state is not None and not e[3].state_lock
                and not e[3].removed)

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

    def nodes(self) -> Iterator[TreeNode]:
        """All non-root nodes, parents before children (O(n); for tests, stats and reset)."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def reset(self) -> None:
        """Free every slot the tree holds and empty it. ValueError while any node is locked."""
        if self._protected or any(node.state_lock for node in self.nodes()):
            raise ValueError("reset() while requests hold locks on the tree")
        kv_out = [node.value for node in self.nodes()]
        state_out = [node.state for node in self.nodes() if node.state is not None]
        self._release(kv_out, state_out)
        self._init_tree()
        self._reset_states()

    def _reset_states(self) -> None:
        """Hook: the hybrid tree clears its checkpoint bookkeeping."""

    def check_integrity(self) -> None:
        """Assert every structural invariant (O(n)); tests call it after each operation."""
        ps = self.page_size
        total = evictable = protected = num_nodes = 0
        seen_pages: set[int] = set()
        kv_live = {e[3].id for e in self._kv_heap if e[2] == e[3].kv_version}
        state_live = {e[3].id for e in self._state_heap if e[2] == e[3].state_version}
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
                    assert child.id in kv_live, f"evictable leaf {child!r} missing from the KV heap"
                if child.state is not None and not child.state_lock:
                    assert child.id in state_live, f"checkpoint of {child!r} missing from the state heap"
                stack.append(child)
            if node is not self.root:
                assert node.lock_ref >= child_locks, f"lock_ref of {node!r} below its children's"
        assert (total, evictable, protected, num_nodes) == (self._total, self._evictable, self._protected,
                                                             self._num_nodes), "size counters drifted"
        assert evictable + protected == total
        if seen_pages:
            assert self.kv_pool.is_allocated(np.array(sorted(seen_pages)) * ps), "the tree holds free KV slots"
        self._check_states()

    def _check_states(self) -> None:
        for node in self.nodes():
            assert node.state is None, "a KV-only tree holds a state"

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(nodes={self._num_nodes}, tokens={self._total}, "
                f"evictable={self._evictable}, protected={self._protected}, page_size={self.page_size})")


def _hook(policy: EvictionPolicy, name: str) -> Callable[..., None] | None:
    """``policy.<name>`` if the policy overrides the no-op default, else None (not worth a call)."""
    return None if getattr(type(policy), name) is getattr(EvictionPolicy, name) else getattr(policy, name)


def _compact(heap: list, valid: Callable[[tuple], bool]) -> list:
    """Drop stale entries; O(len(heap)), amortized over the pushes that made them stale."""
    live = [entry for entry in heap if valid(entry)]
    heapq.heapify(live)
    return live


def _is_whole_pages(slots: np.ndarray, ps: int) -> bool:
    """Whether ``slots`` are whole pages, each filled in order (how the allocator hands them out)."""
    pages = slots.reshape(-1, ps)  # [num_pages, ps]
    return not ((pages[:, 0] % ps).any() or (pages - pages[:, :1] != np.arange(ps)).any())
