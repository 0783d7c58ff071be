"""Speculative checkpoints never push out better ones: ``Checkpoint(..., speculative=True)``,
``TreeNode.superseded`` / ``replaceable``, and ``evict_state(n, for_speculative=True)``."""

from __future__ import annotations

import random

import pytest
import torch

from hyla.cache import Checkpoint, KVPool, LRUPolicy, RadixCache, StatePool


def make(num_slots: int = 64, page_size: int = 1) -> RadixCache:
    kv = KVPool(4096, page_size, 1, 1, 1, torch.float32, accounting=True)
    states = StatePool(num_slots, 1, (1, 1), torch.float32, (1,), torch.float32, accounting=True)
    return RadixCache(kv, state_pool=states)


def put(cache: RadixCache, tokens: list[int], ordinary=(), speculative=()):
    """Engine flow: match, allocate the KV miss, fresh slots for the checkpoints, insert. Returns
    {length: node} for the checkpoints asked for."""
    res = cache.match_prefix(tokens)
    p = res.prefix_len
    new = cache.kv_pool.alloc_extend([p], [int(res.kv_indices[-1]) if p else -1], [len(tokens) - p])
    lengths = [(n, False) for n in ordinary] + [(n, True) for n in speculative]
    slots = cache.state_pool.alloc(len(lengths)).tolist()
    ckpts = [Checkpoint(n, s, spec) for (n, spec), s in zip(lengths, slots)]
    cache.insert(tokens, torch.cat([res.kv_indices, new]), ckpts)
    cache.check_integrity()
    return {n: node_at(cache, tokens, n) for n, _ in lengths}


def node_at(cache: RadixCache, tokens: list[int], length: int):
    res = cache.match_kv(tokens[:length])  # no refresh, no split
    assert len(res) == length
    for node in cache.nodes():
        if node.depth == length and tuple(tokens[node.start:length]) == node.key:
            return node
    raise AssertionError(f"no node ends at {length}")


def tokens_of(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000) for _ in range(n)]


def test_a_speculative_checkpoint_becomes_ordinary_when_it_serves_a_hit() -> None:
    cache = make()
    x = tokens_of(16, seed=0)
    nodes = put(cache, x, ordinary=[16], speculative=[8])
    assert nodes[8].speculative and nodes[8].replaceable and not nodes[16].speculative
    assert cache.match_prefix(x[:12]).last_node is nodes[8]  # the hit uses it
    assert not nodes[8].speculative
    assert nodes[8].replaceable  # ... but a deeper checkpoint on its single-child path supersedes it
    cache.check_integrity()


def test_for_speculative_takes_only_speculative_or_superseded_checkpoints() -> None:
    cache = make()
    a, b, c = tokens_of(16, seed=1), tokens_of(16, seed=2), tokens_of(16, seed=3)
    live_a = put(cache, a, ordinary=[16])[16]  # ends a finished turn
    live_b = put(cache, b, ordinary=[16])[16]
    guess = put(cache, c, speculative=[16])[16]  # e.g. a chunk boundary, never used
    assert [n.replaceable for n in (live_a, live_b, guess)] == [False, False, True]
    # plain LRU would take the oldest (a's); a speculative checkpoint may only replace the guess
    assert cache.evict_state(3, for_speculative=True) == 1
    assert guess.removed and cache.total_size() == 32  # an unlocked leaf goes with its KV
    assert live_a.state is not None and live_b.state is not None
    assert cache.evict_state(1, for_speculative=True) == 0  # nothing replaceable left
    assert cache.evict_state(1) == 1 and live_a.removed  # the ordinary order is unchanged
    cache.check_integrity()


def test_a_chat_turn_supersedes_the_previous_turns_checkpoint() -> None:
    cache = make()
    x = tokens_of(30, seed=4)
    turn1 = put(cache, x[:10], ordinary=[10])[10]
    assert not turn1.superseded  # a leaf: the next turn may continue from it
    turn2 = put(cache, x[:20], ordinary=[20])[20]
    assert turn1.superseded and not turn2.superseded
    other = put(cache, tokens_of(8, seed=5), ordinary=[8])[8]
    assert cache.evict_state(1, for_speculative=True) == 1
    assert turn1.state is None and not turn1.removed  # tombstoned, its KV serves turn 2
    assert turn2.state is not None and other.state is not None
    assert cache.match_prefix(x[:25]).prefix_len == 20
    cache.check_integrity()


def test_a_branch_point_with_two_live_branches_is_not_superseded_until_one_goes() -> None:
    cache = make()
    x = tokens_of(8, seed=6)
    a, b = x + tokens_of(8, seed=7), x + tokens_of(8, seed=8)
    nodes = put(cache, a, ordinary=[8, 16])
    put(cache, b)  # KV only: the branch at 8 now has two children
    branch = nodes[8]
    assert branch.num_children == 2 and not branch.superseded
    assert cache.evict_state(1, for_speculative=True) == 0
    cache.match_prefix(a)  # a is used: b's KV leaf is the oldest
    assert cache.evict(1) == 8  # b's branch goes: the path below 8 is single-child again
    assert branch.num_children == 1 and branch.superseded
    cache.check_integrity()  # it is queued as replaceable
    assert cache.evict_state(1, for_speculative=True) == 1 and branch.state is None
    assert nodes[16].state is not None


def test_an_ordinary_duplicate_confirms_a_speculative_checkpoint() -> None:
    cache = make()
    x = tokens_of(12, seed=9)
    node = put(cache, x, speculative=[12])[12]
    free = cache.state_pool.available_size()

    def again(speculative: bool) -> None:  # the same prefix and position from another request (no hit)
        cache.insert(x, cache.match_kv(x), [Checkpoint(12, int(cache.state_pool.alloc(1)), speculative)])

    again(speculative=True)  # a speculative duplicate changes nothing
    assert node.speculative and cache.state_pool.available_size() == free
    again(speculative=False)  # the same position wanted for sure: ordinary now
    assert not node.speculative and cache.state_pool.available_size() == free
    assert cache.evict_state(1, for_speculative=True) == 0
    cache.check_integrity()


def test_locked_replaceable_checkpoints_are_skipped_and_order_is_lru() -> None:
    cache = make()
    guesses = [put(cache, tokens_of(8, seed=10 + i), speculative=[8])[8] for i in range(3)]
    cache.inc_state_lock(guesses[0])  # being copied into a request
    cache.match_prefix(tokens_of(8, seed=11))  # guesses[1] serves a hit: ordinary now
    assert cache.evict_state(3, for_speculative=True) == 1 and guesses[2].removed
    assert guesses[0].state is not None and guesses[1].state is not None
    cache.dec_state_lock(guesses[0])
    cache.check_integrity()
    assert cache.evict_state(3, for_speculative=True) == 1 and guesses[0].removed


def test_a_full_pool_of_ordinary_checkpoints_admits_no_speculative_one() -> None:
    cache = make(num_slots=4)
    live = [put(cache, tokens_of(8, seed=20 + i), ordinary=[8])[8] for i in range(4)]
    assert cache.state_pool.available_size() == 0
    assert cache.evict_state(1, for_speculative=True) == 0  # the caller stores no speculative one
    assert all(n.state is not None for n in live)


def test_plain_pairs_are_ordinary_and_bad_flags_raise() -> None:
    cache = make(page_size=4)
    x = tokens_of(16, seed=30)
    (s,) = cache.state_pool.alloc(1).tolist()
    kv = cache.kv_pool.alloc(16)
    for bad in ([(8, s, "yes")], [(8, s, True, 1)], [(8,)], [Checkpoint(6, s, True)]):
        with pytest.raises(ValueError):
            cache.insert(x, kv, bad)
    assert cache.total_size() == 0 and cache.state_pool.is_allocated([s])
    cache.insert(x, kv, [(8, s)])
    assert not cache.match_prefix(x[:8]).last_node.speculative
    cache.check_integrity()


def test_without_a_state_pool_for_speculative_frees_nothing() -> None:
    cache = RadixCache(KVPool(64, 1, 1, 1, 1, torch.float32, accounting=True))
    cache.insert([1, 2, 3], cache.kv_pool.alloc(3))
    assert cache.evict_state(2, for_speculative=True) == 0 and cache.total_size() == 3


def test_a_speculative_checkpoint_a_running_request_extends_is_not_replaceable() -> None:
    """A request's speculative checkpoint (its prompt end, say) is its deepest state while it runs:
    its turn ends there unless it stores a deeper one. Other speculative checkpoints may not take it
    until the request is gone (the KV lock on its path is released)."""
    cache = make()
    x = tokens_of(16, seed=40)
    node = put(cache, x, speculative=[16])[16]
    cache.inc_lock_ref(node)  # the request that stored it is still running
    assert node.speculative and not node.replaceable
    assert cache.evict_state(1, for_speculative=True) == 0 and node.state is not None
    cache.dec_lock_ref(node)
    assert node.replaceable
    cache.check_integrity()  # queued as replaceable again when the lock went
    assert cache.evict_state(1, for_speculative=True) == 1 and node.removed


def test_a_superseded_checkpoint_stays_replaceable_under_a_lock() -> None:
    cache = make()
    x = tokens_of(24, seed=41)
    nodes = put(cache, x, ordinary=[24], speculative=[8])
    cache.inc_lock_ref(nodes[24])  # a request continues past 8: the checkpoint at 24 serves it
    assert nodes[8].replaceable  # superseded, locked or not
    assert cache.evict_state(1, for_speculative=True) == 1 and nodes[8].state is None
    cache.dec_lock_ref(nodes[24])
    cache.check_integrity()


def test_confirm_checkpoint_makes_a_finished_turns_end_ordinary() -> None:
    """A finished sequence ends past its deepest checkpoint (the tail off the checkpoint grid): that
    checkpoint, stored speculatively, is where the next turn continues. Confirmed, no speculative
    checkpoint may replace it."""
    cache = make()
    x = tokens_of(20, seed=42)
    nodes = put(cache, x[:16], speculative=[8, 16])
    res = cache.insert(x, cache.match_kv(x[:16]).tolist() + cache.kv_pool.alloc(4).tolist())  # the tail, no checkpoint
    assert cache.confirm_checkpoint(res.last_node) == 16
    assert not nodes[16].speculative and nodes[8].speculative  # only the deepest one
    assert cache.evict_state(2, for_speculative=True) == 1 and nodes[8].state is None  # 8: superseded anyway
    assert nodes[16].state is not None
    assert cache.confirm_checkpoint(res.last_node) == 16  # idempotent
    cache.check_integrity()
    bare = make()
    y = tokens_of(8, seed=44)
    assert bare.confirm_checkpoint(bare.insert(y, bare.kv_pool.alloc(8)).last_node) == 0  # no checkpoint on the path


def test_plain_eviction_takes_replaceable_checkpoints_first() -> None:
    """evict_state(n) takes superseded and unused speculative checkpoints before the others, each group
    least recently used first; LRUPolicy(replaceable_first=False) keeps SGLang's plain LRU."""
    for replaceable_first in (True, False):
        kv = KVPool(4096, 1, 1, 1, 1, torch.float32, accounting=True)
        states = StatePool(64, 1, (1, 1), torch.float32, (1,), torch.float32, accounting=True)
        cache = RadixCache(kv, state_pool=states, policy=LRUPolicy(replaceable_first=replaceable_first))
        b = put(cache, tokens_of(10, seed=45), ordinary=[10])[10]  # another chat's turn end: the oldest
        a = tokens_of(20, seed=46)
        a1 = put(cache, a[:10], ordinary=[10])[10]
        a2 = put(cache, a, ordinary=[20])[20]  # supersedes a1
        guess = put(cache, tokens_of(10, seed=47), speculative=[10])[10]  # never used
        assert cache.evict_state(1) == 1
        if replaceable_first:
            assert a1.state is None and not a1.removed and b.state is not None  # tombstoned: its KV serves a2
            assert cache.evict_state(1) == 1 and guess.removed
            assert cache.evict_state(1) == 1 and b.removed  # then plain LRU
        else:
            assert b.removed and a1.state is not None
        assert a2.state is not None
        cache.check_integrity()


def test_a_requested_checkpoint_is_never_superseded() -> None:
    """``Checkpoint(..., requested=True)`` (the caller's ``checkpoints``, e.g. the end of a shared
    system prompt): a deeper checkpoint on its single-child path does not make it replaceable, so
    neither speculative room nor replaceable-first eviction takes it before plain LRU order does;
    evicted or tombstoned, the flag goes with the state, and a requested duplicate marks an existing
    checkpoint requested."""
    cache = make()
    x, y = tokens_of(30, seed=60), tokens_of(30, seed=61)
    (s,) = cache.state_pool.alloc(1).tolist()
    cache.insert(x[:10], cache.kv_pool.alloc_extend([0], [-1], [10]), [Checkpoint(10, s, requested=True)])
    system = node_at(cache, x, 10)
    assert system.requested and not system.superseded
    put(cache, x[:20], ordinary=[20])  # a request passed it and stored a deeper checkpoint
    assert not system.superseded and not system.replaceable
    plain = put(cache, y[:10], ordinary=[10])[10]
    put(cache, y[:20], ordinary=[20])  # the same shape without the flag: superseded
    assert plain.superseded
    assert cache.evict_state(1, for_speculative=True) == 1 and plain.state is None and system.state is not None
    assert cache.evict_state(1, for_speculative=True) == 0  # nothing replaceable is left
    assert cache.match_prefix(x[:10] + [7]).prefix_len == 10  # the shared prefix still hits
    # a requested duplicate marks an existing ordinary checkpoint requested
    (t,) = cache.state_pool.alloc(1).tolist()
    end = node_at(cache, y, 20)
    cache.insert(y[:20], cache.match_prefix(y[:20]).kv_indices, [Checkpoint(20, t, requested=True)])
    assert end.requested and cache.state_pool.available_size() == cache.state_pool.size - cache.num_checkpoints()
    while cache.evict_state(1):  # plain LRU still takes it: requested is no lock
        pass
    assert system.state is None and not system.requested and not end.requested
    cache.check_integrity()
