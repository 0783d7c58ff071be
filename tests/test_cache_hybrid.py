"""The radix tree with a state pool: checkpoints, tombstones, the seed bugs, two eviction orders, locks, policies."""

from __future__ import annotations

import random

import pytest
import torch

from hyla.cache import EvictionPolicy, KVPool, LRUPolicy, RadixCache, StatePool, TreeNode


def make(page_size: int = 1, num_slots: int = 64, real_states: bool = False, **kw) -> RadixCache:
    kv = KVPool(4096, page_size, 1, 1, 1, torch.float32, accounting=True)
    states = StatePool(num_slots, 2, (4, 3), torch.float32, (2, 3, 3), torch.float32, accounting=not real_states)
    return RadixCache(kv, state_pool=states, **kw)


def put(cache: RadixCache, tokens: list[int], ckpt_lengths=(), namespace=None):
    """Engine flow: match, allocate the KV miss, fresh slots for the checkpoints, insert."""
    res = cache.match_prefix(tokens, namespace=namespace)
    p = res.prefix_len
    new = cache.kv_pool.alloc_extend([p], [int(res.kv_indices[-1]) if p else -1], [len(tokens) - p])
    kv = torch.cat([res.kv_indices, new])
    slots = cache.state_pool.alloc(len(ckpt_lengths)).tolist()
    out = cache.insert(tokens, kv, list(zip(ckpt_lengths, slots)), namespace=namespace)
    cache.check_integrity()
    return out, kv, slots


def tokens_of(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000) for _ in range(n)]


# ----------------------------------------------------------------------------------------------
# matching
# ----------------------------------------------------------------------------------------------
def test_match_returns_the_longest_prefix_ending_at_a_checkpoint() -> None:
    cache = make()
    x = tokens_of(10)
    _, kv, (s4, s10) = put(cache, x, [4, 10])
    res = cache.match_prefix(x[:8] + [-1])
    assert (res.prefix_len, res.state_slot, res.kv_only_len) == (4, s4, 8)
    assert torch.equal(res.kv_indices, kv[:4]) and torch.equal(res.kv_only_indices, kv[:8])
    assert res.last_node.depth == 4 and res.kv_only_node.depth == 8
    full = cache.match_prefix(x)
    assert (full.prefix_len, full.state_slot) == (10, s10)
    none = cache.match_prefix(x[:3])
    assert (none.prefix_len, none.state_slot, none.kv_only_len) == (0, None, 3)
    assert none.last_node is cache.root and none.kv_indices.numel() == 0
    cache.check_integrity()


def test_seed_bug_two_a_split_never_loses_a_usable_checkpoint() -> None:
    """SGLang's no_buffer split a 1008-token node for a 1007-token lookup, then lost the state.
    Here the lookup gets no checkpoint it must not have (the state at 1008 is not the state at
    1007, SGLang #38815), and the split leaves the 1008 checkpoint where a later lookup finds it."""
    cache = make()
    x = tokens_of(1008)
    _, _, (slot,) = put(cache, x, [1008])
    res = cache.match_prefix(x[:1007])
    assert res.prefix_len == 0 and res.state_slot is None and res.kv_only_len == 1007
    assert cache.num_nodes() == 2  # split at 1007
    again = cache.match_prefix(x)
    assert (again.prefix_len, again.state_slot) == (1008, slot)


def test_seed_bug_two_every_checkpoint_covering_a_matched_prefix_survives_splits() -> None:
    cache = make()
    x = tokens_of(300, seed=1)
    _, _, slots = put(cache, x, [100, 200, 300])
    ckpt = dict(zip([100, 200, 300], slots))
    rng = random.Random(0)
    for cut in [150, 250, 120, 299, 201, 99, 1, 280]:  # lookups that end inside edges split them
        cache.match_prefix(x[:cut] + [-7])
        for length in [1, 99, 100, 101, 150, 199, 200, 250, 299, 300] + [rng.randrange(1, 301) for _ in range(5)]:
            res = cache.match_prefix(x[:length])
            want = max((c for c in ckpt if c <= length), default=0)
            assert res.prefix_len == want and res.state_slot == ckpt.get(want)
        cache.check_integrity()
    assert cache.num_checkpoints() == 3


def test_seed_bug_one_a_forked_checkpoint_survives_reuse_of_the_requests_slot() -> None:
    """The request's live slot is freed at finish and reused by another request; the tree holds
    a fork, so a later hit still restores the original state bit for bit."""
    cache = make(real_states=True)
    pool = cache.state_pool
    x = tokens_of(64, seed=2)
    live = pool.alloc(1)
    gen = torch.Generator().manual_seed(0)
    for buf in (*pool.conv_states, *pool.ssm_states):
        buf[live] = torch.randn(buf[live].shape, generator=gen)
    original = [buf[int(live)].clone() for buf in (*pool.conv_states, *pool.ssm_states)]
    fork = pool.fork(live)  # what the engine hands to the tree
    cache.insert(x, cache.kv_pool.alloc(64), [(64, int(fork))])
    with pytest.raises(ValueError, match="forked"):
        cache.insert(x, cache.match_kv(x), [(32, int(fork))])  # a slot the tree already owns
    pool.free(live)
    other = pool.alloc(1)
    assert int(other) == int(live)  # the slot is reused ...
    for buf in (*pool.conv_states, *pool.ssm_states):
        buf[other] = 7.0  # ... and overwritten by another request
    res = cache.match_prefix(x)
    mine = pool.alloc(1)
    pool.copy(torch.tensor([res.state_slot]), mine)  # copy-on-write into the new request's slot
    restored = [buf[int(mine)] for buf in (*pool.conv_states, *pool.ssm_states)]
    assert all(torch.equal(a, b) for a, b in zip(restored, original))


def test_a_hit_copies_the_checkpoint_and_the_tree_slot_is_never_written() -> None:
    cache = make(real_states=True)
    pool = cache.state_pool
    x = tokens_of(16, seed=3)
    (slot,) = put(cache, x, [16])[2]
    pool.ssm_states[0][slot] = 1.5
    for _ in range(2):  # two requests hit, each gets its own copy and runs on it
        res = cache.match_prefix(x)
        cache.inc_lock_ref(res.last_node)
        own = pool.alloc(1)
        pool.copy(torch.tensor([res.state_slot]), own)
        pool.ssm_states[0][own] += 10.0  # the model updates the request's slot in place
        assert torch.all(pool.ssm_states[0][slot] == 1.5)
        cache.dec_lock_ref(res.last_node)
        pool.free(own)


def test_seed_bug_three_checkpoints_at_unaligned_positions_are_found() -> None:
    """A state at token 999 of a 1,000-token prompt (the engine's "prompt minus one") is found by
    a later match of that prompt; any position works, chunk alignment is the model's concern."""
    cache = make()
    x = tokens_of(1000, seed=4)
    _, _, (s37, s999) = put(cache, x, [37, 999])
    assert (cache.match_prefix(x[:-1]).prefix_len, cache.match_prefix(x[:-1]).state_slot) == (999, s999)
    assert cache.match_prefix(x).prefix_len == 999
    assert cache.match_prefix(x[:500]).state_slot == s37
    paged = make(page_size=16)
    _, _, (s992,) = put(paged, x, [992])  # with pages: any page multiple
    assert paged.match_prefix(x[:999]).prefix_len == 992


# ----------------------------------------------------------------------------------------------
# insert
# ----------------------------------------------------------------------------------------------
def test_insert_frees_a_duplicate_checkpoint_and_revives_a_tombstone() -> None:
    cache = make()
    x = tokens_of(16, seed=5)
    put(cache, x, [16])
    free_slots = cache.state_pool.available_size()
    out, _, _ = put(cache, x, [16])  # the same state again: the new slot is a duplicate
    assert out.num_new_checkpoints == 0 and cache.state_pool.available_size() == free_slots
    put(cache, x[:8] + tokens_of(8, seed=6), [16])  # branches at 8: the node there is a tombstone
    assert cache.match_prefix(x[:12]).prefix_len == 0
    out, _, (s8,) = put(cache, x[:8], [8])
    assert out.num_new_checkpoints == 1 and cache.num_checkpoints() == 3
    assert (cache.match_prefix(x[:12]).prefix_len, cache.match_prefix(x[:12]).state_slot) == (8, s8)
    cache.evict_state(cache.num_checkpoints())
    assert cache.num_checkpoints() == 0 and cache.total_size() == 0  # all gone, KV with it


def test_checkpoints_split_edges_anywhere_on_the_key() -> None:
    cache = make(page_size=4)
    x = tokens_of(32, seed=7)
    put(cache, x)  # KV only
    out, _, (a, b) = put(cache, x, [12, 20])  # both inside the existing edge
    assert out.num_new_checkpoints == 2 and cache.num_nodes() == 3
    assert cache.match_prefix(x[:19]).state_slot == a and cache.match_prefix(x).state_slot == b


def test_bad_checkpoints_raise_and_change_nothing() -> None:
    cache = make(page_size=4)
    x = tokens_of(16, seed=8)
    put(cache, x, [16])
    kv = cache.match_kv(x)
    before = (cache.num_nodes(), cache.num_checkpoints(), cache.state_pool.available_size())
    (s,) = cache.state_pool.alloc(1).tolist()
    for bad in ([(6, s)], [(20, s)], [(0, s)], [(8, s), (8, s + 1)], [(4, s), (8, s)], [(8, 63)], [("x", s)]):
        with pytest.raises(ValueError):
            cache.insert(x, kv, bad)
    cache.check_integrity()
    assert (cache.num_nodes(), cache.num_checkpoints(), cache.state_pool.available_size() + 1) == before
    assert cache.state_pool.is_allocated([s])  # still the caller's


# ----------------------------------------------------------------------------------------------
# Marconi's speculative insertion
# ----------------------------------------------------------------------------------------------
def test_branch_point_checkpoint_makes_a_shared_prefix_hit_from_its_third_occurrence() -> None:
    cache = make()
    shared = tokens_of(32, seed=9)
    reqs = [shared + tokens_of(16, seed=10 + i) for i in range(4)]
    hits = []
    for x in reqs:
        res = cache.match_prefix(x)
        hits.append(res.prefix_len)
        bp = cache.branch_point(x)
        put(cache, x, sorted({length for length in (bp, len(x)) if length and length > res.prefix_len}))
    assert hits == [0, 0, 32, 32]
    assert cache.branch_point(shared + [5, 5]) is None  # the node at 32 already holds a checkpoint
    assert cache.branch_point(shared[:20] + [5]) == 20  # inside an edge


# ----------------------------------------------------------------------------------------------
# eviction
# ----------------------------------------------------------------------------------------------
def test_kv_eviction_frees_leaf_states_and_tombstoned_parents() -> None:
    cache = make()
    x, y = tokens_of(8, seed=11), tokens_of(8, seed=12)
    put(cache, x + y, [16])
    put(cache, x + x, [16])  # node at 8 is a tombstone with two children
    slots_free = cache.state_pool.available_size()
    assert cache.evict(1) == 8 and cache.num_nodes() == 2  # the older leaf and its checkpoint
    assert cache.state_pool.available_size() == slots_free + 1
    assert cache.evict(1) == 16  # the last leaf, then the tombstone parent it leaves behind
    assert cache.total_size() == 0 and cache.kv_pool.available_size() == cache.kv_pool.size
    # a parent that still holds a checkpoint stays (it is a usable prefix)
    put(cache, x + y, [8, 16])
    assert cache.evict(1) == 8 and cache.match_prefix(x + y).prefix_len == 8
    cache.check_integrity()


def test_state_eviction_tombstones_internal_nodes_and_deletes_unlocked_leaves() -> None:
    cache = make()
    x = tokens_of(16, seed=13)
    put(cache, x, [8, 16])
    assert cache.evict_state(1) == 1  # oldest first: the internal checkpoint at 8 ...
    assert cache.total_size() == 16 and cache.num_checkpoints() == 1  # ... its KV stays
    assert cache.match_prefix(x[:12]).prefix_len == 0 and cache.match_prefix(x).prefix_len == 16
    assert cache.evict_state(1) == 1  # the leaf: deleted with its KV, then the tombstone above it
    assert cache.total_size() == 0 and cache.num_nodes() == 0
    assert cache.evict_state(5) == 0
    cache.check_integrity()


def test_state_eviction_keeps_kv_a_request_locks_and_skips_state_locks() -> None:
    cache = make()
    x, y = tokens_of(16, seed=14), tokens_of(16, seed=15)
    a, _, _ = put(cache, x, [16])
    b, _, _ = put(cache, y, [16])
    cache.inc_lock_ref(a.last_node)  # a running request reads x's KV
    cache.inc_state_lock(b.last_node)  # and y's checkpoint is about to be copied
    assert cache.evictable_checkpoints() == 1
    assert cache.evict_state(2) == 1
    assert a.last_node.state is None and not a.last_node.removed  # tombstoned, KV kept
    assert cache.total_size() == 32 and b.last_node.state is not None
    assert cache.evict(100) == 0  # x is KV-locked, y is state-locked
    cache.dec_state_lock(b.last_node)
    cache.dec_lock_ref(a.last_node)  # x's tombstone leaf, unlocked, can serve no hit: given back at once
    assert a.last_node.removed and cache.total_size() == 16 and cache.num_garbage_tokens == 16
    assert cache.evict(100) == 16
    cache.check_integrity()


def test_state_locks_are_per_node_and_validated() -> None:
    cache = make()
    x = tokens_of(16, seed=16)
    put(cache, x[:8] + tokens_of(8, seed=17), [16])
    out, _, _ = put(cache, x, [16])
    tomb = out.last_node.parent  # the branch node at 8 holds no checkpoint
    with pytest.raises(ValueError, match="without a checkpoint"):
        cache.inc_state_lock(tomb)
    with pytest.raises(ValueError, match="not locked"):
        cache.dec_state_lock(out.last_node)
    cache.inc_state_lock(out.last_node)
    assert tomb.lock_ref == 0 and tomb.state_lock == 0  # a state lock does not climb the path
    cache.dec_state_lock(out.last_node)


def test_a_hit_refreshes_the_path_kv_but_only_the_checkpoint_it_uses() -> None:
    cache = make(policy=LRUPolicy(replaceable_first=False))  # recency alone (superseded ones go first otherwise)
    x = tokens_of(16, seed=18)
    out, _, _ = put(cache, x, [4, 8, 16])
    n16 = out.last_node
    n8 = n16.parent
    n4 = n8.parent
    put(cache, tokens_of(8, seed=19), [8])  # something newer elsewhere
    res = cache.match_prefix(x[:12])  # uses the checkpoint at 8
    assert res.last_node is n8
    assert n4.last_access == n8.last_access  # the KV path is refreshed ...
    assert n8.state_access > n4.state_access  # ... but only the used checkpoint
    assert n8.state_access > n16.state_access
    assert cache.evict_state(2) == 2  # the stale checkpoints at 4 and 16 go, 8 stays
    assert cache.match_prefix(x).prefix_len == 8 and n8.state is not None and n4.state is None
    cache.check_integrity()


# ----------------------------------------------------------------------------------------------
# pluggable policy
# ----------------------------------------------------------------------------------------------
class FewestChildrenFirst(EvictionPolicy):
    """A structural test policy: checkpoints on nodes with fewer children go first; KV by recency.
    Records the hooks it sees."""

    structural = True

    def __init__(self) -> None:
        self.events: list[tuple[str, int, bool]] = []

    def kv_priority(self, node: TreeNode) -> float:
        return node.last_access

    def state_priority(self, node: TreeNode) -> float:
        return node.num_children

    def on_create(self, node: TreeNode) -> None:
        self.events.append(("create", node.depth, False))

    def on_access(self, node: TreeNode, state_used: bool) -> None:
        self.events.append(("access", node.depth, state_used))

    def on_remove(self, node: TreeNode) -> None:
        self.events.append(("remove", node.depth, False))


def test_pluggable_policy_hooks_and_structural_requeue() -> None:
    policy = FewestChildrenFirst()
    cache = make(policy=policy)
    x = tokens_of(16, seed=20)
    a, b, c = (tokens_of(4, seed=s) for s in (21, 22, 23))
    put(cache, x + a)
    put(cache, x + b)  # node at 16: two children
    put(cache, x[:8] + c)  # node at 8: two children
    assert ("create", 8, False) in policy.events and ("create", 16, False) in policy.events
    put(cache, x, [8, 16])  # checkpoints on both, queued with 2 children each (8 first)
    policy.events.clear()
    cache.match_prefix(x[:10])
    assert ("access", 8, True) in policy.events and ("access", 16, False) not in policy.events
    policy.events.clear()
    assert cache.evict(1) == 4  # the oldest leaf, x + a: the node at 16 is down to one child
    assert policy.events[0] == ("remove", 20, False)
    assert cache.evict_state(1) == 1
    # the policy's priority for the node at 16 *dropped*; a structural policy is re-queued on
    # the change, so it goes before the node at 8 that was queued ahead of it
    assert cache.match_prefix(x).prefix_len == 8
    cache.check_integrity()


def test_engine_keyword_construction_and_sizes() -> None:
    kv = KVPool(256, 16, 1, 1, 1, torch.float32, accounting=True)
    states = StatePool(8, 1, (2, 2), torch.float32, (1, 1, 1), torch.float32, accounting=True)
    cache = RadixCache(kv_pool=kv, page_size=16, state_pool=states)
    put(cache, tokens_of(40, seed=23), [32])
    assert cache.total_size() == 32 and cache.num_checkpoints() == cache.evictable_checkpoints() == 1
    assert "checkpoints=1" in repr(cache)
    cache.reset()
    assert states.available_size() == 8 and kv.available_size() == 256 - 16  # the tail page is the caller's


class ExternalScore(EvictionPolicy):
    """Priorities from outside the tree (e.g. a simulator's utility over all candidates)."""

    structural = False
    replaceable_first = False  # the outside score alone decides

    def __init__(self) -> None:
        self.score: dict[int, float] = {}

    def kv_priority(self, node: TreeNode) -> float:
        return node.last_access

    def state_priority(self, node: TreeNode) -> float:
        return self.score.get(node.depth, 0.0)


def test_refresh_priority_reorders_after_an_outside_change() -> None:
    policy = ExternalScore()
    policy.score = {8: 1.0, 16: 5.0}
    cache = make(policy=policy)
    x = tokens_of(16, seed=24)
    put(cache, x, [8, 16])  # queued: 8 at 1.0, 16 at 5.0
    policy.score[16] = 0.5  # the policy now ranks 16 lowest; the tree cannot know ...
    n16 = cache.match_prefix(x).last_node
    cache.refresh_priority(n16)  # ... until told
    assert cache.evict_state(1) == 1 and n16.removed
    assert cache.match_prefix(x[:8]).prefix_len == 8
    with pytest.raises(ValueError):
        cache.refresh_priority(n16)  # deleted with its KV (an unlocked leaf)


# ----------------------------------------------------------------------------------------------
# KV that can serve no hit, touch, evicting one checkpoint
# ----------------------------------------------------------------------------------------------
def test_an_unlocked_tombstone_leaf_is_given_back_at_once() -> None:
    """A finished sequence's tail past its last checkpoint (a turn ending off the checkpoint grid)
    can serve no hit: when its last lock goes, its KV goes back to the pool — and the tombstone
    edges above it, up to the checkpoint — instead of waiting in LRU order beside useful KV."""
    cache = make()
    x = tokens_of(30, seed=50)
    out, _, _ = put(cache, x[:10], [10])
    res = cache.insert(x, cache.match_kv(x[:10]).tolist() + cache.kv_pool.alloc(20).tolist())
    cache.inc_lock_ref(res.last_node)  # the request that computed the tail is still running
    free = cache.kv_pool.available_size()
    mid = cache.match_prefix(x[:20] + [-1])  # splits the tail at 20: two tombstone edges
    assert mid.kv_only_len == 20 and cache.kv_pool.available_size() == free
    cache.dec_lock_ref(res.last_node)
    assert res.last_node.removed and mid.kv_only_node.removed and not out.last_node.removed
    assert cache.kv_pool.available_size() == free + 20 and cache.num_garbage_tokens == 20
    assert cache.total_size() == 10 and cache.match_prefix(x).prefix_len == 10
    cache.check_integrity()
    # without a state pool every prefix is usable: nothing is garbage
    kv_only = RadixCache(KVPool(64, 1, 1, 1, 1, torch.float32, accounting=True))
    node = kv_only.insert(x[:8], kv_only.kv_pool.alloc(8)).last_node
    kv_only.inc_lock_ref(node)
    kv_only.dec_lock_ref(node)
    assert not node.removed and kv_only.total_size() == 8


def test_touch_orders_lru_victims_by_when_they_will_be_used() -> None:
    cache = make()
    a, b = tokens_of(8, seed=51), tokens_of(8, seed=52)
    na, nb = put(cache, a, [8])[0].last_node, put(cache, b, [8])[0].last_node
    cache.touch(nb)  # the queue uses b first, a last: touched in that order, b is now the older
    cache.touch(na)
    assert cache.evict(1) == 8 and nb.removed and not na.removed
    assert na.state_access == na.last_access  # as a hit: the checkpoint it ends at is refreshed too
    x = tokens_of(16, seed=54)
    n16 = put(cache, x, [8, 16])[0].last_node
    cache.touch(n16)
    assert n16.parent.state_access < n16.state_access  # ... not those above it
    cache.check_integrity()
    with pytest.raises(ValueError):
        cache.touch(nb)


def test_evict_checkpoint_frees_one_named_checkpoint() -> None:
    cache = make()
    x = tokens_of(16, seed=53)
    out, _, (s8, s16) = put(cache, x, [8, 16])
    n16 = out.last_node
    n8 = n16.parent
    cache.inc_lock_ref(n16)
    cache.evict_checkpoint(n16)  # locked leaf: tombstoned, its KV stays for the running request
    assert n16.state is None and not n16.removed and not cache.state_pool.is_allocated_slot(s16)
    cache.inc_state_lock(n8)
    with pytest.raises(ValueError):
        cache.evict_checkpoint(n8)  # being copied
    with pytest.raises(ValueError):
        cache.evict_checkpoint(n16)  # holds none
    cache.dec_state_lock(n8)
    cache.dec_lock_ref(n16)  # the tombstone leaf goes at once
    assert n16.removed
    cache.evict_checkpoint(n8)  # an unlocked leaf now: deleted with its KV
    assert n8.removed and cache.total_size() == 0 and cache.state_pool.available_size() == cache.state_pool.size
    cache.check_integrity()
