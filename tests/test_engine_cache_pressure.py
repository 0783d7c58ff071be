"""Which cached entries the engine keeps when memory is short (issue: cache under pressure).

Each test pins one rule of the eviction policy; each fails on the engine without that rule:

* a finished turn's end state, stored speculatively (its prompt end on a grid the output never
  reaches past), is confirmed at release: later speculative checkpoints do not replace it;
* a decode passing a grid point on a full state pool keeps its pending checkpoint in the slot of
  the checkpoint it supersedes (the request's own prompt-end one); so does a prompt-end checkpoint
  (in the slot of the request's hit); at the last grid position the request can reach, the
  pending checkpoint is its turn's end and evicts as a finish checkpoint does;
* the waiting queue's prefixes age in the order the queue will use them, so LRU evicts the one
  admitted last;
* an admission that cannot fit evicts nothing;
* while requests run, an admission does not evict the prefix of a request still waiting, nor its
  checkpoint, nor with the later chunks of its prompt.
"""

from __future__ import annotations

import random
import threading
import time

import torch

from hyla import Engine
from hyla.cache import Checkpoint, KVPool, RadixCache, ReqToTokenPool, StatePool
from hyla.engine.cache_manager import CacheManager
from hyla.engine.request import Req
from hyla.engine.sampling_params import SamplingParams
from test_engine_differential import compare_outputs, hold_for_next_submission


def _ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 2048) for _ in range(n)]


def _greedy(n: int) -> dict:
    return {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}


def test_a_turn_ending_on_a_speculative_checkpoint_keeps_it(qwen3_next_dense_path):
    """Page 16, prompt 133, output 6: the turn's deepest grid state is the prefill's prompt-end
    checkpoint at 128 (speculative when stored; decode never reaches 144). Three slots: after A
    and B, C's speculative checkpoint finds no free slot; it may replace only replaceable ones —
    not A's turn end, confirmed when A finished."""
    a = _ids(133, 1)
    with Engine(qwen3_next_dense_path, page_size=16, max_total_tokens=4096, max_state_slots=3,
                max_running_requests=1, debug_checks=True) as eng:
        first = eng.generate(input_ids=a, sampling_params=_greedy(6))
        for seed in (2, 3):  # each stores a speculative checkpoint at 48 and ends there
            eng.generate(input_ids=_ids(50, seed), sampling_params=_greedy(2))
        turn2 = a + first["output_ids"] + _ids(20, 4)
        out = eng.generate(input_ids=turn2, sampling_params=_greedy(2))
        assert out["meta_info"]["cached_tokens"] == 128


def test_a_pending_checkpoint_on_a_full_pool_takes_the_slot_it_supersedes(qwen3_next_dense_path):
    """Page 16, four slots: two finished turns' ends, the running request's own slot and its
    prompt-end checkpoint at 32 (speculative, but its request still runs: not replaceable). Its
    decode passes 48 and 64 with no free slot: the pending checkpoint takes the slot of the one at
    32, which it supersedes, and the next turn hits 64 instead of 32."""
    a = _ids(40, 5)
    with Engine(qwen3_next_dense_path, page_size=16, max_total_tokens=4096, max_state_slots=4,
                max_running_requests=1, debug_checks=True) as eng:
        for seed in (6, 7):
            eng.generate(input_ids=_ids(40, seed), sampling_params=_greedy(1))  # turn ends at 32
        first = eng.generate(input_ids=a, sampling_params=_greedy(30))  # 69 tokens fed
        turn2 = a + first["output_ids"] + _ids(10, 8)
        assert eng.generate(input_ids=turn2, sampling_params=_greedy(1))["meta_info"]["cached_tokens"] == 64


def test_a_pending_checkpoint_at_the_last_grid_position_evicts_as_a_finish_checkpoint(qwen3_next_dense_path):
    """Page 16, three slots: B's and C's finished turns (ends at 32, ordinary) and A's live state.
    A (20 + 30 tokens) has no checkpoint of its own to supersede and none is replaceable, so its
    prompt-end checkpoint at 16 and its pending one at 32 find no slot. At 48 it cannot pass
    another grid position before max_new_tokens: its turn ends there whatever stops it, so the
    pending checkpoint is its finish checkpoint taken early and evicts the least recently used
    turn end (B's) as a finish checkpoint would. A's next turn hits 48, not 0."""
    a = _ids(20, 30)
    with Engine(qwen3_next_dense_path, page_size=16, max_total_tokens=4096, max_state_slots=3,
                max_running_requests=1, debug_checks=True) as eng:
        b, c = _ids(40, 31), _ids(40, 32)
        b1 = eng.generate(input_ids=b, sampling_params=_greedy(1))
        c1 = eng.generate(input_ids=c, sampling_params=_greedy(1))
        a1 = eng.generate(input_ids=a, sampling_params=_greedy(30))  # 49 tokens fed
        a2 = eng.generate(input_ids=a + a1["output_ids"] + _ids(5, 33), sampling_params=_greedy(1))
        c2 = eng.generate(input_ids=c + c1["output_ids"] + _ids(5, 34), sampling_params=_greedy(1))
        b2 = eng.generate(input_ids=b + b1["output_ids"] + _ids(5, 35), sampling_params=_greedy(1))
        assert [a2["meta_info"]["cached_tokens"], c2["meta_info"]["cached_tokens"],
                b2["meta_info"]["cached_tokens"]] == [48, 32, 0]


def test_a_prompt_checkpoint_on_a_full_pool_takes_the_slot_of_the_one_it_supersedes(qwen3_next_dense_path):
    """Page 16, three slots. A's and B's first turns end at 32 (ordinary once they finish). A's
    second turn hits 32 and wants its prompt-end checkpoint at 64 — where this turn ends — with no
    free slot and none replaceable: it takes the slot of A's own checkpoint at 32, which it
    supersedes, rather than dropping (A's third turn would hit 32) or evicting B's."""
    a, b = _ids(40, 20), _ids(40, 21)
    with Engine(qwen3_next_dense_path, page_size=16, max_total_tokens=4096, max_state_slots=3,
                max_running_requests=1, debug_checks=True) as eng:
        a1 = eng.generate(input_ids=a, sampling_params=_greedy(1))
        b1 = eng.generate(input_ids=b, sampling_params=_greedy(1))
        a2_ids = a + a1["output_ids"] + _ids(30, 22)  # 71 tokens
        a2 = eng.generate(input_ids=a2_ids, sampling_params=_greedy(1))
        assert a2["meta_info"]["cached_tokens"] == 32
        a3 = eng.generate(input_ids=a2_ids + a2["output_ids"] + _ids(5, 23), sampling_params=_greedy(1))
        b2 = eng.generate(input_ids=b + b1["output_ids"] + _ids(5, 24), sampling_params=_greedy(1))
        assert [a3["meta_info"]["cached_tokens"], b2["meta_info"]["cached_tokens"]] == [64, 32]


def test_the_waiting_queue_keeps_the_prefix_it_admits_first(qwen3_next_dense_path):
    """One request at a time. R (longest hit) runs first and its decode needs room while A2 and B2
    wait: one of their histories must go. LPM admits A2 (150 cached) before B2 (100 cached), so
    B's history is the one to lose — though A2 comes first in the queue, whose matches used to
    refresh A's history first, making it the LRU victim."""
    z, a, b = _ids(300, 9), _ids(150, 10), _ids(100, 11)
    with Engine(qwen3_next_dense_path, max_total_tokens=600, max_state_slots=16, max_running_requests=1,
                chunked_prefill_size=512, debug_checks=True) as eng:
        outs = [eng.generate(input_ids=p, sampling_params=_greedy(1)) for p in (z, a, b)]
        a2 = a + outs[1]["output_ids"] + _ids(10, 12)
        b2 = b + outs[2]["output_ids"] + _ids(10, 13)
        r = z + outs[0]["output_ids"] + _ids(10, 14)
        got = eng.generate(input_ids=[a2, b2, r], sampling_params=[_greedy(2), _greedy(2), _greedy(50)])
        assert eng.get_stats()["num_evicted_tokens"] > 0
        assert [o["meta_info"]["cached_tokens"] for o in got] == [150, 0, 300]


def test_an_admission_that_cannot_fit_evicts_nothing():
    """A running request holds most of the KV and one of two state slots; a request needing more
    KV than is free plus everything evictable cannot be admitted — and must not evict the cached
    history (KV or checkpoint) on its way to failing."""
    kv = KVPool(64, 1, 1, 1, 1, torch.float32, accounting=True)
    states = StatePool(2, 1, (1, 1), torch.float32, (1,), torch.float32, accounting=True)
    tree = RadixCache(kv, state_pool=states)
    cache = CacheManager(kv, states, ReqToTokenPool(4, 128), tree)
    history = _ids(16, 15)
    tree.insert(history, kv.alloc(16), [Checkpoint(16, int(states.alloc(1)[0]))])
    held_kv, held_state = kv.alloc(40), states.alloc(1)  # a running request's  # noqa: F841
    req = Req(rid="x", input_ids=_ids(31, 16), sampling=SamplingParams(max_new_tokens=1))
    hit = cache.match(req)
    assert cache.admit(req, hit, 31) is None  # 8 free + 16 evictable < 31
    assert tree.total_size() == 16 and tree.num_checkpoints() == 1
    assert cache.num_evicted_tokens == cache.num_evicted_states == 0
    assert tree.match_prefix(history).prefix_len == 16
    tree.check_integrity()


def test_an_admission_does_not_evict_a_waiting_requests_prefix(qwen3_next_dense_path):
    """Two at a time, a 700-token pool holding three finished histories (z 300, b 150, c 100). R
    (z's next turn, 30 new tokens) runs first; B2 (b's, 130 new) comes next in LPM order, but
    its 131 tokens and R's decode reserve fit only if something cached goes — and the only
    unlocked candidates are b's own history and c's, which C2, waiting behind B2, is about to
    hit. With ``protect_waiting_prefixes`` B2 waits for R to finish (R's history, which no
    waiting request matches, makes the room) and C2 hits all of c; without it B2 evicts c. Either
    way the outputs are the cache-off engine's."""
    z, b, c = _ids(300, 30), _ids(150, 31), _ids(100, 32)
    hits, outputs = {}, {}
    for protect in (True, False, None):  # None: the prefix cache off (the reference)
        with Engine(qwen3_next_dense_path, max_total_tokens=700, max_state_slots=16, max_running_requests=2,
                    chunked_prefill_size=512, protect_waiting_prefixes=bool(protect),
                    enable_prefix_cache=protect is not None, debug_checks=True) as eng:
            outs = [eng.generate(input_ids=p, sampling_params=_greedy(1)) for p in (z, b, c)]
            r = z + outs[0]["output_ids"] + _ids(10, 33)
            b2 = b + outs[1]["output_ids"] + _ids(130, 34)
            c2 = c + outs[2]["output_ids"] + _ids(10, 35)
            got = eng.generate(input_ids=[r, b2, c2], sampling_params=[_greedy(30), _greedy(2), _greedy(2)],
                               return_logprob=True)
            hits[protect] = [o["meta_info"]["cached_tokens"] for o in got]
            outputs[protect] = outs + got
    assert hits[True] == [300, 150, 100]
    assert hits[False][:2] == [300, 150] and hits[False][2] < 100  # the rule is what keeps c
    for protect in (True, False):
        compare_outputs(outputs[protect][3:], outputs[None][3:])  # same tokens, logprobs within 1e-4
        assert [o["output_ids"] for o in outputs[protect][:3]] == [o["output_ids"] for o in outputs[None][:3]]


def _while_running(eng: Engine, prompts: list[list[int]], max_new: int, then):
    """``then()`` once every request of ``prompts`` (decoding ``max_new`` tokens) is running: the
    engine waits for what ``then`` submits, so that it arrives one decode step later whatever the
    machine's speed (the requests need decode only a few tokens more)."""
    hold_for_next_submission(eng, lambda sched: len(sched.running) == len(prompts)
                             and all(r.output_ids for r in sched.running))
    runners = threading.Thread(target=eng.generate, kwargs=dict(input_ids=prompts, sampling_params=_greedy(max_new)))
    runners.start()
    deadline = time.monotonic() + 60
    while eng.get_stats()["num_running_requests"] < len(prompts) and time.monotonic() < deadline:
        time.sleep(0.001)
    try:
        return then()
    finally:
        runners.join()


def test_an_admission_in_chunks_counts_its_whole_prompt(qwen3_next_dense_path):
    """In chunks of 64 on a 600-token pool: X runs; A2 (a's next turn: 128 cached, 401 new) comes
    first in LPM order, and its first chunk with X's decode reserve fits — but its later chunks
    would evict W's history, which W2, waiting behind it, is about to hit. Held, the admission
    counts A2's whole prompt and waits for X; W2 keeps its 64 tokens."""
    a, w = _ids(128, 50), _ids(64, 51)
    with Engine(qwen3_next_dense_path, checkpoint_alignment=64, max_total_tokens=600, max_state_slots=16,
                max_running_requests=2, chunked_prefill_size=64, debug_checks=True) as eng:
        outs = [eng.generate(input_ids=p, sampling_params=_greedy(1)) for p in (a, w)]
        got = _while_running(eng, [_ids(20, 52)], 16, lambda: eng.generate(
            input_ids=[a + outs[0]["output_ids"] + _ids(400, 53), w + outs[1]["output_ids"] + _ids(10, 54)],
            sampling_params=_greedy(1)))
    assert [o["meta_info"]["cached_tokens"] for o in got] == [128, 64]


def test_an_admission_does_not_evict_a_waiting_requests_checkpoint(qwen3_next_dense_path):
    """Four state slots on a 256-token grid: two finished turns' ends (a and w, at 256) and two
    running requests' own states (X and Y: 20-token prompts decoding 16 tokens, never reaching
    the grid). A2 and W2 then arrive: A2's own state slot could come only from a checkpoint, and
    the one not its own is W2's hit. Held (``protect_waiting_prefixes``), it stays: A2 waits
    for X and Y to finish and both hit 256; without the hold A2 takes W2's checkpoint."""
    a, w = _ids(256, 40), _ids(256, 41)
    hits = {}
    for protect in (True, False):
        with Engine(qwen3_next_dense_path, checkpoint_alignment=256, max_total_tokens=4096, max_state_slots=4,
                    max_running_requests=3, protect_waiting_prefixes=protect, debug_checks=True) as eng:
            outs = [eng.generate(input_ids=p, sampling_params=_greedy(1)) for p in (a, w)]
            got = _while_running(eng, [_ids(20, 42), _ids(20, 43)], 16, lambda: eng.generate(
                input_ids=[a + outs[0]["output_ids"] + _ids(10, 44), w + outs[1]["output_ids"] + _ids(10, 45)],
                sampling_params=_greedy(2)))
            hits[protect] = [o["meta_info"]["cached_tokens"] for o in got]
    assert hits[True] == [256, 256]
    assert hits[False] == [256, 0]  # the hold is what keeps W2's checkpoint
