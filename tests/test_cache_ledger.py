"""The cache ledger: what the tree gave back, and why a request missed tokens it wanted."""

from __future__ import annotations

import random

import torch

from hyla import Engine
from hyla.cache import CacheLedger, Checkpoint, KVPool, RadixCache, StatePool


def make() -> tuple[RadixCache, CacheLedger]:
    kv = KVPool(4096, 1, 1, 1, 1, torch.float32, accounting=True)
    states = StatePool(64, 1, (1, 1), torch.float32, (1,), torch.float32, accounting=True)
    ledger = CacheLedger()
    return RadixCache(kv, state_pool=states, ledger=ledger), ledger


def tokens_of(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000) for _ in range(n)]


def put(cache: RadixCache, tokens: list[int], lengths=(), namespace=None):
    slots = cache.state_pool.alloc(len(lengths)).tolist()
    return cache.insert(tokens, cache.kv_pool.alloc(len(tokens)), [Checkpoint(n, s) for n, s in zip(lengths, slots)],
                        namespace=namespace)


def admit(cache: RadixCache, ledger: CacheLedger, key: str, tokens: list[int], namespace=None) -> None:
    res = cache.match_prefix(tokens, namespace=namespace)
    ledger.admitted(key, tokens, res.prefix_len, res.kv_only_len, namespace)


def test_evicted_kv_is_explained_by_what_needed_the_room() -> None:
    cache, ledger = make()
    x = tokens_of(40, seed=1)
    put(cache, x[:32], [32])
    with ledger.because("the test's room"):
        assert cache.evict(1) == 32
    (r,) = ledger.removals
    assert (r.path, r.start, r.kv, r.checkpoint, r.how, r.cause) == \
        (tuple(x[:32]), 0, True, "ordinary", "KV eviction", "the test's room")
    admit(cache, ledger, "a", x)
    assert ledger.explain("a", 32) == {("KV evicted", "KV eviction, for the test's room"): 32}
    assert ledger.explain("a", 0) == {} and ledger.hit("a") == 0


def test_a_checkpoint_evicted_under_a_running_request_is_the_loss_not_its_kv() -> None:
    """The checkpoint at 32 goes while a request holds the KV; when that request ends, the KV past
    the last checkpoint is given back (garbage): the loss is the checkpoint's."""
    cache, ledger = make()
    y = tokens_of(40, seed=2)
    node = put(cache, y[:32], [16, 32]).last_node
    cache.inc_lock_ref(node)
    with ledger.because("an admission"):
        assert cache.evict_state(2) == 2  # 16 first (superseded), then 32 (tombstoned: KV locked)
    assert [(len(r.path), r.kv, r.checkpoint) for r in ledger.removals] == [(16, False, "superseded"),
                                                                             (32, False, "ordinary")]
    cache.dec_lock_ref(node)  # the tombstones go: no checkpoint left at or below
    assert cache.total_size() == 0 and all(r.how == CacheLedger.garbage for r in ledger.removals[2:])
    admit(cache, ledger, "b", y)
    assert ledger.explain("b", 32) == {("checkpoint evicted", "ordinary, checkpoint eviction, for an admission"): 32}


def test_dropped_and_never_taken_checkpoints_and_never_cached_tokens() -> None:
    cache, ledger = make()
    z = tokens_of(30, seed=3)
    put(cache, z[:24], [8])  # KV to 24, a checkpoint at 8 only
    ledger.dropped(z, 16, "a speculative checkpoint")  # wanted at 16, no room
    admit(cache, ledger, "c", z)
    assert ledger.explain("c", 28) == {("no room for a checkpoint", "a speculative checkpoint"): 8,
                                       ("no checkpoint taken", ""): 8, ("never cached", ""): 4}
    assert ledger.explain("c", 28, grid=16) == {("no room for a checkpoint", "a speculative checkpoint"): 8,
                                                ("off the checkpoint grid", ""): 8, ("never cached", ""): 4}
    # events in another namespace, or after the admission, explain nothing
    w, v = tokens_of(20, seed=4), tokens_of(8, seed=6)
    put(cache, w[:16], [16], namespace="other")
    with ledger.because("elsewhere"):
        cache.evict(16)
    put(cache, v)  # KV only, no checkpoint
    admit(cache, ledger, "d", w)
    admit(cache, ledger, "e", v + [1])
    cache.evict(cache.total_size())
    assert ledger.explain("d", 16) == {("never cached", ""): 16}
    assert ledger.explain("e", 8) == {("no checkpoint taken", ""): 8}
    admit(cache, ledger, "d", w)  # re-admitted (after a retraction): what it prefilled again
    assert ledger.recomputed("d") == 20 and ledger.recomputed("c") == 0


def test_the_engine_records_evictions_admissions_and_usage(qwen3_next_dense_path):
    """The waiting queue's scenario (tests/test_engine_cache_pressure.py): B's history goes to make
    room for the running request's decode; the ledger says so, token for token."""
    rng = random.Random(5)
    ids = lambda n: [rng.randrange(3, 2048) for _ in range(n)]  # noqa: E731
    greedy = lambda n: {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}  # noqa: E731
    z, a, b = ids(300), ids(150), ids(100)
    with Engine(qwen3_next_dense_path, max_total_tokens=600, max_state_slots=16, max_running_requests=1,
                chunked_prefill_size=512) as eng:
        ledger = eng.record_cache_events()
        outs = [eng.generate(input_ids=p, sampling_params=greedy(1)) for p in (z, a, b)]
        turn2 = [p + o["output_ids"] + ids(10) for p, o in zip((a, b, z), (outs[1], outs[2], outs[0]))]
        got = eng.generate(input_ids=turn2, sampling_params=[greedy(2), greedy(2), greedy(100)])
    a2, b2, r = (o["meta_info"]["id"] for o in got)
    assert [ledger.hit(k) for k in (a2, b2, r)] == [150, 0, 300]
    assert ledger.explain(a2, 150) == {} and ledger.explain(r, 300) == {}
    assert ledger.explain(b2, 100) == {("KV evicted", "KV eviction, for running requests' next tokens"): 100}
    assert all(len(ledger.releases[o["meta_info"]["id"]]) == 1 for o in outs + got)
    assert ledger.usage and max(held for _, held, _ in ledger.usage) <= 600
