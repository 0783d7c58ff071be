"""What the radix tree is made of, takes and hands out: ``TreeNode``, ``Checkpoint``,
``MatchResult``, ``InsertResult``, and the namespaces that partition it (``namespace_key``, ``SubNamespace``).

Only ``RadixCache`` writes nodes and results; the engine, the simulator, eviction policies and
tests read them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Hashable, Iterator, NamedTuple

import numpy as np
import torch

from hyla.cache.lazy_heap import NO_ENTRY

EMPTY_SLOTS = np.zeros(0, dtype=np.int64)


def concat_slots(values: list[np.ndarray]) -> torch.Tensor:
    """One fresh ``int64`` CPU tensor from per-node slot arrays (never a view of the tree's)."""
    if not values:
        return torch.zeros(0, dtype=torch.int64)
    if len(values) == 1:
        return torch.from_numpy(values[0].copy())
    return torch.from_numpy(np.concatenate(values))


def namespace_key(namespace: Hashable) -> tuple:
    """The tree's key for a namespace: ``(namespace, its type signature)``.

    Python's equality makes ``1``, ``1.0`` and ``True`` (and ``(1,)``, ``(True,)``) one dict key;
    as namespaces (two tenants' cache salts, a LoRA id) they are distinct partitions, so the key
    carries the types too, item by item inside a tuple.
    """
    return namespace, _signature(namespace)


@dataclass(frozen=True)
class SubNamespace:
    """A namespace partitioned by what the cache does not know: ``kind`` says what (``"lora"``), ``key`` which
    (a LoRA adapter's content digest: the engine's ``lora_manager.lora_namespace``), ``namespace`` the request's
    own. A type of its own, so that no namespace a request's caller passes (a tuple, a string: the server's
    ``cache_salt`` is a string) equals one (``namespace_key`` compares types too): a base request never reads an
    adapter's K/V. ``prefix_transfer`` carries it from one engine to another, so an imported prefix may be in
    one: ``import_prefix`` trusts what it imports (the server's ``/import_prefix`` needs the API key)."""

    kind: str
    key: str
    namespace: Hashable


def _signature(value: Hashable) -> Hashable:
    if isinstance(value, tuple):
        return type(value), tuple(_signature(v) for v in value)
    if isinstance(value, SubNamespace):  # (the request's own namespace inside, item by item too)
        return type(value), _signature(value.kind), _signature(value.key), _signature(value.namespace)
    return type(value)


class Checkpoint(NamedTuple):
    """A checkpoint handed to ``RadixCache.insert``: the state after ``length`` tokens, in state-pool
    ``slot`` (a fresh fork the tree adopts). A plain ``(length, slot)`` pair means ``speculative=False``.

    ``speculative``: it may never be used (a chunk boundary, a pending decode position, a branch
    point or message end not yet confirmed). The tree remembers it until the checkpoint serves a
    hit or the same position is inserted again as an ordinary checkpoint (then it is ordinary), and
    makes room for speculative checkpoints only at the expense of other speculative or superseded
    ones: ``evict_state(n, for_speculative=True)``.

    ``requested``: the caller asked for it (a position it expects other requests to branch off
    at, e.g. the end of a shared system prompt): it is never *superseded* (``TreeNode.superseded``)
    by deeper checkpoints of the requests that have passed it so far.
    """

    length: int
    slot: int
    speculative: bool = False
    requested: bool = False


class TreeNode:
    """One edge of the tree and the node it ends at. Fields are read by policies and tests;
    only the tree writes them."""

    __slots__ = (
        "id", "parent", "children", "child_key", "key", "value", "depth", "state", "speculative",
        "requested", "lock_ref", "state_lock", "last_access", "state_access", "removed", "policy_data",
        "kv_mark", "state_mark", "replaceable_mark",
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
        self.speculative = False  # the checkpoint was stored speculatively and has served no hit yet
        self.requested = False  # the caller asked for the checkpoint: never superseded
        self.lock_ref = 0  # KV locks on this node or below
        self.state_lock = 0  # locks on this node's checkpoint only
        self.last_access = now  # KV recency
        self.state_access = now  # checkpoint recency
        self.removed = False
        self.policy_data: Any = None
        # its latest entry in each of the tree's eviction orders (LazyHeap marks)
        self.kv_mark = self.state_mark = self.replaceable_mark = NO_ENTRY

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
    def superseded(self) -> bool:
        """The node holds a checkpoint, has exactly one child, and a deeper checkpoint lies on that
        single-child path: every request that continues past it uses the deeper one, so it serves
        only a request that branches off in between (in a chat, each turn supersedes the last).
        Never a checkpoint the caller asked for (``requested``): it expects those branches."""
        if self.state is None or self.requested:
            return False
        node = self
        while len(node.children) == 1:
            (node,) = node.children.values()
            if node.state is not None:
                return True
        return False

    @property
    def replaceable(self) -> bool:
        """The node holds a checkpoint that a speculative one may push out, and that every eviction
        takes before the others: superseded, or speculative and not on the path of a running
        request (``lock_ref == 0``). A speculative checkpoint a running request is still extending
        is that request's deepest state so far — its turn ends there unless it stores a deeper one
        (which supersedes it) — so it waits for the request to end."""
        return self.state is not None and ((self.speculative and not self.lock_ref) or self.superseded)

    @property
    def start(self) -> int:
        """Tokens from the root to the start of this node's edge."""
        return self.depth - len(self.key)

    def __repr__(self) -> str:
        return (f"TreeNode(id={self.id}, tokens=[{self.start}:{self.depth}], children={len(self.children)}, "
                f"state={self.state}{' (speculative)' if self.speculative else ''}, lock_ref={self.lock_ref}, "
                f"state_lock={self.state_lock})")


class MatchResult:
    """What ``match_prefix`` found. ``kv_indices``/``kv_only_indices`` are concatenated on first
    access (fresh tensors; the tree keeps its own arrays)."""

    __slots__ = ("prefix_len", "last_node", "state_slot", "kv_only_len", "kv_only_node",
                 "_values", "_num_usable", "_kv", "_kv_only")

    def __init__(self, prefix_len: int, last_node: TreeNode, state_slot: int | None, kv_only_len: int,
                 kv_only_node: TreeNode, values: list[np.ndarray], num_usable: int) -> None:
        self.prefix_len = prefix_len  # usable prefix: ends at last_node
        self.last_node = last_node  # root when prefix_len == 0
        self.state_slot = state_slot  # the tree's checkpoint at last_node (with a state pool), else None
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
            self._kv = concat_slots(self._values[: self._num_usable])
        return self._kv

    @property
    def kv_only_indices(self) -> torch.Tensor:
        """KV slots of the whole KV match, ``[kv_only_len]`` int64."""
        if self._kv_only is None:
            self._kv_only = concat_slots(self._values)
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
            self._kv = concat_slots(self._values)
        return self._kv

    def __iter__(self) -> Iterator[Any]:  # allows ``num_existing, last_node = cache.insert(...)``
        return iter((self.num_existing, self.last_node))

    def __repr__(self) -> str:
        return (f"InsertResult(num_existing={self.num_existing}, last_node={self.last_node!r}, "
                f"num_new_checkpoints={self.num_new_checkpoints})")
