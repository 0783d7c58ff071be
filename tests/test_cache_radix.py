"""The radix tree without a state pool (KV only): match/insert/split, pages, namespaces, locks, sizes, LRU eviction."""

from __future__ import annotations

import pytest
import torch

from hyla.cache import KVPool, LRUPolicy, RadixCache, TreeNode


def make(page_size: int = 1, num_tokens: int = 4096, **kw) -> RadixCache:
    pool = KVPool(num_tokens, page_size, 1, 1, 1, torch.float32, accounting=True)
    return RadixCache(pool, **kw)


def put(cache: RadixCache, tokens: list[int], namespace=None, check: bool = True):
    """The engine's flow: match, allocate the miss after the hit, insert; returns (result, kv)."""
    res = cache.match_prefix(tokens, namespace=namespace)
    prefix = res.kv_indices
    last = int(prefix[-1]) if res.prefix_len else -1
    new = cache.kv_pool.alloc_extend([res.prefix_len], [last], [len(tokens) - res.prefix_len])
    kv = torch.cat([prefix, new])
    out = cache.insert(tokens, kv, namespace=namespace)
    if check:
        cache.check_integrity()
    return out, kv


def test_insert_then_match_returns_the_same_slots() -> None:
    cache = make()
    out, kv = put(cache, list(range(10)))
    assert out.num_existing == 0 and out.last_node.depth == 10
    assert torch.equal(out.kv_indices, kv)
    res = cache.match_prefix(list(range(10)) + [99])
    assert res.prefix_len == res.kv_only_len == 10 and res.state_slot is None
    assert torch.equal(res.kv_indices, kv) and res.last_node is out.last_node
    assert cache.total_size() == 10 and cache.num_checkpoints() == 0


def test_match_inside_an_edge_splits_it_so_the_node_ends_there() -> None:
    cache = make()
    out, kv = put(cache, list(range(10)))
    leaf = out.last_node
    res = cache.match_prefix([0, 1, 2, 3, 7])
    assert res.prefix_len == 4 and res.last_node.depth == 4 and torch.equal(res.kv_indices, kv[:4])
    assert cache.num_nodes() == 2 and leaf.parent is res.last_node  # the existing node keeps its identity
    assert leaf.start == 4 and leaf.depth == 10 and leaf.value.tolist() == kv[4:].tolist()
    assert torch.equal(cache.match_prefix(list(range(10))).kv_indices, kv)
    cache.check_integrity()


def test_branching_inserts_share_the_common_prefix() -> None:
    cache = make()
    _, kv_a = put(cache, [1, 2, 3, 4, 5, 6])
    out_b, kv_b = put(cache, [1, 2, 3, 9, 9])
    assert out_b.num_existing == 3
    assert torch.equal(kv_b[:3], kv_a[:3])  # the tree's slots
    assert cache.total_size() == 8 and cache.num_nodes() == 3
    assert torch.equal(cache.match_prefix([1, 2, 3, 9, 9]).kv_indices, kv_b)


def test_keys_are_rounded_down_to_whole_pages_and_the_tail_stays_private() -> None:
    cache = make(page_size=4)
    tokens = list(range(10))
    kv = cache.kv_pool.alloc(10)
    out = cache.insert(tokens, kv)
    assert out.last_node.depth == 8 and cache.total_size() == 8
    assert cache.kv_pool.is_allocated(kv[8:])  # tail page still allocated: the caller's
    res = cache.match_prefix(tokens)
    assert res.prefix_len == 8 and torch.equal(res.kv_indices, kv[:8])
    assert cache.match_prefix(tokens[:7]).prefix_len == 4  # partial pages never match
    assert cache.match_prefix([0, 1, 2, 9]).prefix_len == 0  # pages compare whole
    cache.kv_pool.free(kv[8:])
    cache.check_integrity()


def test_namespaces_never_share() -> None:
    cache = make()
    put(cache, [1, 2, 3, 4], namespace="lora-a")
    assert cache.match_prefix([1, 2, 3, 4]).prefix_len == 0
    assert cache.match_prefix([1, 2, 3, 4], namespace="lora-b").prefix_len == 0
    assert cache.match_prefix([1, 2, 3, 4], namespace="lora-a").prefix_len == 4
    out, _ = put(cache, [1, 2, 3, 4], namespace=7)
    assert out.num_existing == 0 and cache.total_size() == 8
    assert cache.branch_point([1, 2, 3, 4, 5], namespace="lora-b") is None
    with pytest.raises(ValueError, match="hashable"):
        cache.match_prefix([1, 2], namespace=["unhashable"])


@pytest.mark.parametrize("page_size", [1, 2])
def test_namespaces_equal_in_python_are_still_distinct(page_size: int) -> None:
    """1, 1.0 and True are one dict key in Python; as namespaces they are three tenants."""
    cache = make(page_size)
    put(cache, [1, 2, 3, 4], namespace=1)
    for other in (1.0, True, (1,), "1"):
        assert cache.match_prefix([1, 2, 3, 4], namespace=other).prefix_len == 0, other
    put(cache, [1, 2, 3, 4], namespace=(1, "a"))
    assert cache.match_prefix([1, 2, 3, 4], namespace=(True, "a")).prefix_len == 0
    assert cache.match_prefix([1, 2, 3, 4], namespace=(1, "a")).prefix_len == 4
    assert cache.match_prefix([1, 2, 3, 4], namespace=1).prefix_len == 4


def test_insert_frees_only_the_callers_duplicates() -> None:
    cache = make(num_tokens=64)
    _, kv = put(cache, [1, 2, 3, 4])
    free0 = cache.kv_pool.available_size()
    dup = cache.kv_pool.alloc(4)
    out = cache.insert([1, 2, 3, 4], dup)
    assert out.num_existing == 4 and cache.kv_pool.available_size() == free0  # dup freed
    assert torch.equal(out.kv_indices, kv)  # canonical slots are the tree's
    # a matched prefix passed back as is is not freed; only the duplicated rest is
    mine = torch.cat([kv[:2], cache.kv_pool.alloc(4)])
    out = cache.insert([1, 2, 3, 4, 5, 6], mine)
    assert out.num_existing == 4
    assert cache.kv_pool.is_allocated(kv) and cache.kv_pool.is_allocated(mine[4:])
    assert cache.kv_pool.available_size() == free0 - 2
    assert torch.equal(cache.match_kv([1, 2, 3, 4, 5, 6]), torch.cat([kv, mine[4:]]))
    cache.check_integrity()


def test_match_kv_neither_splits_nor_refreshes() -> None:
    cache = make()
    _, kv = put(cache, list(range(8)))
    leaf = next(iter(cache.root.children.values()))
    stamp = leaf.last_access
    assert torch.equal(cache.match_kv(list(range(5)) + [0]), kv[:5])
    assert cache.num_nodes() == 1 and leaf.last_access == stamp


def test_locks_protect_the_path_and_sizes_add_up() -> None:
    cache = make()
    out_a, _ = put(cache, [1, 2, 3, 4, 5])
    out_b, _ = put(cache, [1, 2, 3, 8, 8, 8])
    cache.inc_lock_ref(out_b.last_node)
    shared = out_b.last_node.parent
    assert shared.lock_ref == 1 and out_a.last_node.lock_ref == 0
    assert cache.protected_size() == 6 and cache.evictable_size() == 2
    assert cache.evictable_size() + cache.protected_size() == cache.total_size()
    assert cache.evict(100) == 2  # only the unlocked leaf [4, 5]
    assert cache.total_size() == 6 and cache.evictable_size() == 0
    cache.dec_lock_ref(out_b.last_node)
    assert cache.protected_size() == 0 and cache.evictable_size() == 6
    with pytest.raises(ValueError, match="unlocked"):
        cache.dec_lock_ref(out_b.last_node)
    assert cache.evict(1) == 3  # stops once enough is freed: the leaf [8, 8, 8] only
    assert cache.evict(1) == 3  # its parent became a leaf and is next
    assert cache.total_size() == 0 and cache.kv_pool.available_size() == cache.kv_pool.size
    with pytest.raises(ValueError, match="not a node"):
        cache.inc_lock_ref(out_b.last_node)  # evicted
    cache.check_integrity()


def test_lru_eviction_order_follows_hits() -> None:
    cache = make()
    leaves = [put(cache, [t, t, t, t])[0].last_node for t in range(4)]  # inserted 0, 1, 2, 3
    cache.match_prefix([0, 0, 0, 0])  # refresh 0: now 1 is the oldest
    cache.match_prefix([2, 2, 2, 2])
    order = []
    while cache.total_size():
        cache.evict(1)
        order.append(next(i for i, leaf in enumerate(leaves) if leaf.removed and i not in order))
    assert order == [1, 3, 0, 2]


def test_eviction_reaches_parents_that_become_leaves() -> None:
    cache = make()
    put(cache, [1, 2, 3, 4])
    put(cache, [1, 2, 5, 6])
    cache.match_prefix([1, 2, 3, 4])
    cache.match_prefix([1, 2, 5, 6])  # both leaves newer than nothing else: parent [1, 2] goes last
    assert cache.evict(2) == 2 and cache.num_nodes() == 2  # the older leaf [3, 4]
    assert cache.evict(3) == 4  # the other leaf, then its parent, which became a leaf
    assert cache.total_size() == 0
    cache.check_integrity()


class CountingLRU(LRUPolicy):
    def __init__(self) -> None:
        self.calls = 0

    def kv_priority(self, node: TreeNode) -> float:
        self.calls += 1
        return super().kv_priority(node)


def test_evict_cost_is_per_evicted_leaf_not_per_tree_node() -> None:
    """Evicting one leaf of a 2,000-leaf tree looks at O(1) heap entries, not at every leaf."""
    policy = CountingLRU()
    cache = make(num_tokens=1 << 14, policy=policy)
    for i in range(2000):
        put(cache, [i // 50, i % 50, 7, 7], check=False)  # 40 subtrees of 50 leaves of 3 tokens
    for i in range(0, 2000, 3):
        cache.match_prefix([i // 50, i % 50, 7, 7])  # hits move timestamps but push nothing
    policy.calls = 0
    assert cache.evict(1) == 3
    assert policy.calls <= 10  # a few stale entries re-placed at most
    policy.calls = 0
    freed = cache.evict(2000)
    assert freed >= 2000 and policy.calls <= 4 * freed
    cache.check_integrity()


def test_heap_stays_bounded_under_lock_churn() -> None:
    cache = make()
    out, _ = put(cache, [1, 2, 3])
    for _ in range(5000):
        cache.inc_lock_ref(out.last_node)
        cache.dec_lock_ref(out.last_node)
    assert len(cache._kv_heap) <= 2 * cache.num_nodes() + 1024
    cache.check_integrity()
    assert cache.evict(3) == 3


def test_branch_point_is_a_dry_run() -> None:
    cache = make()
    assert cache.branch_point([1, 2, 3]) is None  # empty tree
    put(cache, [1, 2, 3, 4, 5, 6])
    assert cache.branch_point([1, 2, 3, 4, 5, 6, 7, 8]) is None  # extends the leaf
    assert cache.branch_point([1, 2, 3, 9]) == 3  # would split the edge after 3
    assert cache.branch_point([1, 2, 3, 4]) == 4  # ends inside the edge: split there
    assert cache.branch_point([1, 2, 3, 4, 5, 6]) is None  # already cached to a node boundary
    assert cache.branch_point([7, 7]) is None  # a new branch of the root
    assert cache.num_nodes() == 1  # nothing changed
    put(cache, [1, 2, 3, 9])
    assert cache.branch_point([1, 2, 3, 7, 7]) == 3  # a third child of the node ending at 3


def test_bad_inputs_raise_value_error_and_change_nothing() -> None:
    cache = make(page_size=4, num_tokens=64)
    put(cache, list(range(8)))
    before = (cache.num_nodes(), cache.total_size(), cache.kv_pool.available_size())
    with pytest.raises(ValueError, match="KV indices"):
        cache.insert(list(range(8)), torch.arange(4, 10))
    with pytest.raises(ValueError, match="checkpoints"):
        cache.insert(list(range(8)), cache.match_kv(list(range(8))), checkpoints=[(4, 1)])
    misaligned = cache.kv_pool.alloc(8) + 1  # slots shifted off their pages
    with pytest.raises(ValueError, match="page boundaries"):
        cache.insert(list(range(4)) + [50, 51, 52, 53], torch.cat([cache.match_kv(list(range(4))), misaligned[:4]]))
    cache.kv_pool.free(misaligned - 1)
    with pytest.raises(ValueError):
        cache.evict(-1)
    with pytest.raises(ValueError):
        cache.inc_state_lock(cache.root)
    with pytest.raises(ValueError):
        RadixCache(cache.kv_pool, page_size=16)
    assert (cache.num_nodes(), cache.total_size(), cache.kv_pool.available_size()) == before
    cache.check_integrity()


def test_reset_frees_everything_but_not_under_locks() -> None:
    cache = make(page_size=2, num_tokens=64)
    out, _ = put(cache, list(range(10)))
    put(cache, list(range(4)) + [7, 7])
    cache.inc_lock_ref(out.last_node)
    with pytest.raises(ValueError, match="locks"):
        cache.reset()
    cache.dec_lock_ref(out.last_node)
    cache.reset()
    assert cache.total_size() == 0 and cache.num_nodes() == 0
    assert cache.kv_pool.available_size() == 64
    cache.check_integrity()
    put(cache, list(range(6)))
    assert cache.match_prefix(list(range(6))).prefix_len == 6


def test_tensor_inputs_and_tuple_inputs_agree() -> None:
    cache = make(page_size=2)
    out, kv = put(cache, list(range(6)))
    a = cache.match_prefix(torch.arange(6))
    b = cache.match_prefix(tuple(range(6)))
    assert a.prefix_len == b.prefix_len == 6 and torch.equal(a.kv_indices, b.kv_indices)
    a.kv_indices[0] = -5  # results are copies: the tree is untouched
    assert torch.equal(cache.match_kv(list(range(6))), kv)
    num_existing, last = out  # InsertResult unpacks like a pair
    assert num_existing == 0 and last.depth == 6


def test_without_a_state_pool_the_checkpoint_machinery_is_idle() -> None:
    """The KV-only tree is the hybrid tree with no state pool: every prefix is usable, an empty
    checkpoint iterable is accepted, evict_state frees nothing, no node can be state-locked."""
    cache = make(page_size=2)
    assert cache.state_pool is None
    out = cache.insert([1, 2, 3, 4], cache.kv_pool.alloc(4), checkpoints=iter(()))
    res = cache.match_prefix([1, 2, 3, 4, 5])
    assert (res.prefix_len, res.state_slot, res.last_node) == (4, None, out.last_node)
    assert cache.evict_state(5) == 0 and cache.total_size() == 4
    assert cache.num_checkpoints() == cache.evictable_checkpoints() == 0
    with pytest.raises(ValueError, match="without a checkpoint"):
        cache.inc_state_lock(out.last_node)
    assert "checkpoints" not in repr(cache)
    cache.check_integrity()
