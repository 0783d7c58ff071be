"""The seed scenarios at small scale: exact-token hybrid prefix hits through the public Engine API.

chunked_prefill_size=512 (the seed used SGLang's defaults at larger scale). Each case asserts the
`cached_tokens` the engine reports *and* that the output equals a cache-off run's output.
"""

from __future__ import annotations

import random

import pytest

from hyla import Engine

CHUNK = 512


def _prompt(n: int, seed: int, vocab: int = 2048) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


def _gen(engine: Engine, ids: list[int], **kw) -> dict:
    params = {"temperature": 0, "max_new_tokens": kw.pop("max_new_tokens", 4), "ignore_eos": True}
    return engine.generate(input_ids=ids, sampling_params=params, return_logprob=True, **kw)


@pytest.fixture(scope="module")
def engine_factory(qwen3_next_dense_path):
    engines: list[Engine] = []

    def make(**kw) -> Engine:
        opts = dict(chunked_prefill_size=CHUNK, max_total_tokens=16384, max_state_slots=64,
                    max_running_requests=8, debug_checks=True)
        opts.update(kw)
        e = Engine(qwen3_next_dense_path, **opts)
        engines.append(e)
        return e

    yield make
    for e in engines:
        e.shutdown()


@pytest.fixture(scope="module")
def reference(engine_factory):
    """A cache-off engine: the outputs every cached run must reproduce."""
    return engine_factory(enable_prefix_cache=False)


def _same_output(a: dict, b: dict) -> None:
    assert a["output_ids"] == b["output_ids"]
    for (la, _, _), (lb, _, _) in zip(a["meta_info"]["output_token_logprobs"], b["meta_info"]["output_token_logprobs"]):
        assert abs(la - lb) < 1e-4


@pytest.mark.parametrize("n", [300, 1300])
def test_repeated_prompt_hits_all_but_one_token(engine_factory, reference, n):
    eng = engine_factory()
    ids = _prompt(n, seed=n)
    first = _gen(eng, ids)
    second = _gen(eng, ids)
    assert first["meta_info"]["cached_tokens"] == 0
    assert second["meta_info"]["cached_tokens"] == n - 1  # not 1024, not 0
    ref = _gen(reference, ids)
    _same_output(first, ref)
    _same_output(second, ref)
    eng.wait_idle()
    eng.check_integrity()


def test_second_turn_hits_whole_first_turn_but_last_token(engine_factory, reference):
    eng = engine_factory()
    turn1 = _prompt(300, seed=7)
    out1 = _gen(eng, turn1, max_new_tokens=6)
    turn2 = turn1 + out1["output_ids"] + _prompt(40, seed=8)
    out2 = _gen(eng, turn2)
    # everything the first request fed (prompt + all outputs but the last sampled one) is cached
    assert out2["meta_info"]["cached_tokens"] == len(turn1) + len(out1["output_ids"]) - 1
    _same_output(out2, _gen(reference, turn2))


def test_shared_prefix_hits_from_third_occurrence(engine_factory, reference):
    eng = engine_factory()
    prefix = _prompt(200, seed=11)
    outs = [_gen(eng, prefix + _prompt(30, seed=100 + i)) for i in range(4)]
    cached = [o["meta_info"]["cached_tokens"] for o in outs]
    # 1st: cold; 2nd: the tree has the prefix's KV but no state there -> it computes the state at
    # the branch point; 3rd and later: hit the 200 shared tokens exactly
    assert cached == [0, 0, 200, 200]
    for i, o in enumerate(outs):
        _same_output(o, _gen(reference, prefix + _prompt(30, seed=100 + i)))


def test_shared_prefix_with_caller_checkpoint_hits_from_second(engine_factory):
    eng = engine_factory()
    prefix = _prompt(200, seed=12)
    a = _gen(eng, prefix + _prompt(30, seed=1), checkpoints=[200])
    b = _gen(eng, prefix + _prompt(30, seed=2))
    assert [a["meta_info"]["cached_tokens"], b["meta_info"]["cached_tokens"]] == [0, 200]


def test_caller_checkpoint_is_kept_in_a_full_state_pool(engine_factory, reference):
    """A server's state pool is full of cached checkpoints once it has run a while. A checkpoint
    the caller asked for still gets a slot (the least recently used checkpoint makes room), so a
    shared prefix hits from its second use; one marked as a guess (``speculative_checkpoints``, a
    chat's message ends) does not push out finished turns: its prefix hits from the third use,
    through the branch point the second request stores."""
    eng = engine_factory(max_state_slots=16, max_running_requests=4)
    for speculative, want in [(False, [0, 200, 200]), (True, [0, 0, 200])]:
        for i in range(24):  # more finished turns than the pool has slots: every slot holds a checkpoint
            _gen(eng, _prompt(40, seed=5000 + i + 100 * speculative), max_new_tokens=2)
        eng.wait_idle()
        assert eng.state_pool.available_size() <= 1  # (one kept free for a running request)
        prefix = _prompt(200, seed=14 + speculative)
        outs = [_gen(eng, prefix + _prompt(30, seed=300 + i), checkpoints=[200] if i == 0 else None,
                     speculative_checkpoints=speculative) for i in range(3)]
        assert [o["meta_info"]["cached_tokens"] for o in outs] == want
        for i, o in enumerate(outs):
            _same_output(o, _gen(reference, prefix + _prompt(30, seed=300 + i)))
    eng.check_integrity()


def test_checkpoint_alignment_rounds_hits_down_to_grid(engine_factory, reference):
    eng = engine_factory(checkpoint_alignment=64)
    for n, want in [(300, 256), (1300, 1280)]:
        ids = _prompt(n, seed=1000 + n)
        _gen(eng, ids)
        out = _gen(eng, ids)
        assert out["meta_info"]["cached_tokens"] == want
        _same_output(out, _gen(reference, ids))
    prefix = _prompt(200, seed=13)
    cached = [_gen(eng, prefix + _prompt(30, seed=200 + i))["meta_info"]["cached_tokens"] for i in range(3)]
    # the largest multiple of 64 within the shared 200 tokens. On the grid the 2nd request already
    # hits: the 1st request's end-of-prompt checkpoint (229) rounds down to 192, inside the prefix.
    assert cached == [0, 192, 192]


def test_page_size_16_shares_whole_pages(qwen3_next_dense_path, reference):
    with Engine(qwen3_next_dense_path, page_size=16, chunked_prefill_size=CHUNK, max_total_tokens=16384,
                max_state_slots=64, max_running_requests=8, debug_checks=True) as eng:
        ids = _prompt(300, seed=21)
        _gen(eng, ids)
        out = _gen(eng, ids)
        assert out["meta_info"]["cached_tokens"] == 288  # 299 rounded down to whole pages
        _same_output(out, _gen(reference, ids))
        eng.wait_idle()
        eng.check_integrity()


def test_namespaces_never_share(engine_factory):
    eng = engine_factory()
    ids = _prompt(100, seed=31)
    _gen(eng, ids, namespace="tenant-a")
    assert _gen(eng, ids, namespace="tenant-b")["meta_info"]["cached_tokens"] == 0
    assert _gen(eng, ids, namespace="tenant-a")["meta_info"]["cached_tokens"] == 99


def test_lpm_in_batch_dedup_waits_only_for_its_own_namespace(qwen3_next_dense_path):
    """LPM defers a request for an admitted one sharing its new prefix only within its namespace:
    another tenant's cache is never its own, and waiting for it would let one cache salt's prompts
    delay another's."""
    from hyla.engine.request import Req
    from hyla.engine.sampling_params import SamplingParams

    with Engine(qwen3_next_dense_path, schedule_policy="lpm", max_total_tokens=4096, max_state_slots=16) as eng:
        prefix = _prompt(200, seed=47)
        def req(ns, seed: int) -> Req:
            return Req(f"r-{ns}-{seed}", prefix + _prompt(10, seed=seed), SamplingParams(), namespace=ns)

        deferred = eng.scheduler._deferred_for_in_batch_prefix
        a, b = ("cache_salt", "A"), ("cache_salt", "B")
        assert deferred(req(a, 48), [req(a, 49)])  # its own namespace: wait for the prefix
        assert not deferred(req(b, 48), [req(a, 49)])
        assert not deferred(req(True, 48), [req(1, 49)])  # equal in Python, two namespaces


def test_lpm_in_batch_dedup_does_not_wait_for_what_no_hit_may_serve(qwen3_next_dense_path, monkeypatch):
    """Prompts sharing a prefix whose logprobs start at 0 (``/v1/completions`` with ``echo`` and
    ``logprobs``, as lm-eval's loglikelihood requests come) take no hit, so waiting for a sharer's prefix
    buys nothing: they are prefilled in one step, not one per step."""
    with Engine(qwen3_next_dense_path, schedule_policy="lpm", chunked_prefill_size=2048, max_total_tokens=16384,
                max_state_slots=64, max_running_requests=8, debug_checks=True) as eng:
        prefix = _prompt(100, seed=43)
        batches: list[int] = []
        real = eng.scheduler.run
        monkeypatch.setattr(eng.scheduler, "run", lambda batch: batches.append(len(batch.reqs)) or real(batch))
        outs = eng.generate(input_ids=[prefix + _prompt(8, seed=70 + i) for i in range(8)], return_logprob=True,
                            logprob_start_len=0, sampling_params={"max_new_tokens": 0})
        assert batches == [8]  # (was [1] * 8)
        assert all(len(o["meta_info"]["input_token_logprobs"]) == 108 for o in outs)


def test_lpm_in_batch_dedup_lets_no_less_urgent_request_pass(qwen3_next_dense_path, monkeypatch):
    """Priority scheduling keeps the queue strict: a request LPM defers for a sharer's prefix keeps its place,
    where a less urgent request took the last running slot in its step (and it then waited for that request's
    whole answer, within the preemption threshold)."""
    with Engine(qwen3_next_dense_path, schedule_policy="lpm", max_total_tokens=4096, max_state_slots=16,
                max_running_requests=2, enable_priority_scheduling=True, debug_checks=True) as eng:
        admitted: list[str] = []
        real = eng.scheduler._on_admitted
        monkeypatch.setattr(eng.scheduler, "_on_admitted", lambda req: admitted.append(req.rid) or real(req))
        prefix = _prompt(64, seed=44)
        params = [{"temperature": 0, "max_new_tokens": n, "ignore_eos": True} for n in (30, 2, 30)]
        eng.generate(input_ids=[prefix + _prompt(8, seed=80), prefix + _prompt(8, seed=81), _prompt(40, seed=82)],
                     sampling_params=params, rid=["X", "U", "L"], priority=[5, 5, 0])
        assert admitted == ["X", "U", "L"]


@pytest.mark.parametrize("policy, want", [("lpm", 200), ("fcfs", 0)])
def test_lpm_in_batch_dedup_caches_a_new_shared_prefix_once(qwen3_next_dense_path, policy, want):
    """Three requests sharing a new 200-token prefix arrive together. LPM admits one and defers the
    others until it has cached the prefix; they then find the branch point and checkpoint it, so a
    fourth request hits. FCFS admits all three at once: none of them sees a branch point."""
    with Engine(qwen3_next_dense_path, schedule_policy=policy, chunked_prefill_size=1024,
                max_total_tokens=16384, max_state_slots=64, max_running_requests=8, debug_checks=True) as eng:
        prefix = _prompt(200, seed=41)
        params = {"temperature": 0, "max_new_tokens": 2, "ignore_eos": True}
        eng.generate(input_ids=[prefix + _prompt(20, seed=50 + i) for i in range(3)], sampling_params=params)
        late = eng.generate(input_ids=prefix + _prompt(20, seed=60), sampling_params=params)
        assert late["meta_info"]["cached_tokens"] == want
