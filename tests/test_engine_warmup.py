"""The start-up warm-up (``hyla/engine/warmup.py``) and ``Engine.flush_cache``: a warmed engine
starts as empty as one without the warm-up and computes the same outputs (the differential's rule:
greedy tokens and logprobs within 1e-4 up to a tie; sampled tokens, whose seeds come from request
ids, equal); a flush drops every cached prefix, only between requests, and changes no output."""

from __future__ import annotations

import threading
import time

import pytest

from hyla import Engine
from hyla.engine.scheduler import Scheduler
from test_engine_differential import assert_drained, compare_outputs, make_workload, run

POOLS = dict(max_total_tokens=1200, max_state_slots=20, max_running_requests=8, chunked_prefill_size=128,
             debug_checks=True)
COUNTERS = ("num_prompt_tokens", "num_cached_tokens", "num_generated_tokens", "num_requests_finished",
            "num_retractions", "num_overlapped_steps", "num_mixed_tokens", "num_evicted_tokens", "num_evicted_states")


@pytest.fixture(scope="module")
def engines(qwen3_next_dense_path):
    with Engine(qwen3_next_dense_path, warmup="on", **POOLS) as warm, \
            Engine(qwen3_next_dense_path, warmup="off", **POOLS) as cold:
        yield warm, cold


def _workload(engine: Engine) -> list[dict]:
    """First turns and shared prefixes, their second turns (cached prefixes; the small pools evict),
    and two sampled requests without seeds of their own."""
    wave1, followups = make_workload(11, 2048, num_sessions=12, num_shared=8)
    out1 = run(engine, wave1)
    wave2 = [{"ids": w["ids"] + o["output_ids"] + f, "max_new": 4, "ckpt": []}
             for w, o, f in zip(wave1, out1, followups)]
    out2 = run(engine, wave2)
    sampled = engine.generate(input_ids=[w["ids"] for w in wave1[:2]], return_logprob=True,
                              sampling_params={"temperature": 1.0, "top_p": 0.9, "max_new_tokens": 6, "ignore_eos": True})
    return out1 + out2 + sampled


def test_a_warmed_engine_starts_empty(engines):
    warm, cold = engines
    assert cold.warmup_stats is None
    ran = warm.warmup_stats
    assert ran["requests"] == 6 and ran["prompt_tokens"] > 400, ran  # sized down to a 1,200-token pool
    stats = warm.get_stats()
    assert {k: stats[k] for k in COUNTERS} == dict.fromkeys(COUNTERS, 0)
    assert (stats["token_usage"], stats["state_usage"]) == (0.0, 0.0)
    assert warm.tree.total_size() == 0 and warm.tree.num_checkpoints() == 0
    assert warm.scheduler.new_token_ratio == Scheduler.INIT_NEW_TOKEN_RATIO
    warm.check_integrity()


def test_the_warm_up_changes_no_output(engines):
    warm, cold = engines
    before = [e.get_stats() for e in engines]
    outs = [_workload(e) for e in engines]
    for e in engines:
        assert_drained(e)
    n = compare_outputs(outs[0][:-2], outs[1][:-2])
    assert n > 0.9 * sum(len(o["output_ids"]) for o in outs[1][:-2])
    assert [o["output_ids"] for o in outs[0][-2:]] == [o["output_ids"] for o in outs[1][-2:]]
    after = [e.get_stats() for e in engines]
    assert after[0]["num_cached_tokens"] > 0 and after[0]["num_evicted_tokens"] > 0
    for key in COUNTERS:  # the same steps
        assert after[0][key] - before[0][key] == after[1][key] - before[1][key], key


def test_flush_cache_drops_every_prefix_only_between_requests(qwen3_next_dense_path):
    with Engine(qwen3_next_dense_path, **POOLS) as engine:
        _flush_cache(engine)


def _flush_cache(engine: Engine) -> None:
    ledger = engine.record_cache_events()
    prompt = list(range(100, 180))
    params = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}
    first = engine.generate(input_ids=prompt, sampling_params=params, return_logprob=True, rid="f0")
    again = engine.generate(input_ids=prompt, sampling_params=params, return_logprob=True)
    assert again["meta_info"]["cached_tokens"] > 0

    stream = engine.generate(input_ids=prompt[:40], stream=True, sampling_params={**params, "max_new_tokens": 200})
    next(stream)  # running: the flush is refused and nothing changes
    cached = engine.tree.total_size()
    assert engine.flush_cache() is False
    assert engine.tree.total_size() >= cached
    assert list(stream)[-1]["meta_info"]["finish_reason"]["type"] == "length"

    # a caller that gives up waiting (the scheduler thread busy: here, asleep) leaves the cache alone
    busy = threading.Thread(target=engine._on_scheduler_thread, args=(lambda: time.sleep(0.3), 5.0))
    busy.start()
    time.sleep(0.05)
    with pytest.raises(TimeoutError):
        engine.flush_cache(timeout=0.01)
    busy.join()
    engine.wait_idle()
    assert engine.tree.total_size() > 0

    assert engine.flush_cache() is True
    assert_drained(engine)
    assert engine.tree.total_size() == 0 and engine.kv_pool.available_size() == engine.kv_pool.size
    cold = engine.generate(input_ids=prompt, sampling_params=params, return_logprob=True, rid="f1")
    assert cold["meta_info"]["cached_tokens"] == 0
    compare_outputs([cold], [first])
    # a study sees the flush as what took the prefix
    assert ledger.explain("f1", len(prompt))[("KV evicted", "reset, for flush_cache")] > 0


def test_flush_cache_after_shutdown_raises(qwen3_next_dense_path):
    engine = Engine(qwen3_next_dense_path, max_total_tokens=512, max_state_slots=8, max_running_requests=2)
    engine.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        engine.flush_cache()


def test_a_failing_warm_up_fails_the_constructor_and_stops_the_engine(qwen3_next_dense_path, monkeypatch):
    """A warm-up step that fails (here: "out of memory" in any prefill of more than 100 tokens, the
    warm-up's first prompt) aborts its request, and the constructor raises instead of returning an
    engine whose first long prompt would fail the same way; the engine's thread stops."""
    original = Scheduler.run

    def run(self, batch, *args, **kwargs):
        if not batch.is_decode and sum(batch.lens) > 100:
            raise RuntimeError("CUDA out of memory (injected)")
        return original(self, batch, *args, **kwargs)

    monkeypatch.setattr(Scheduler, "run", run)
    alive = lambda: sum(t.name == "hyla-scheduler" and t.is_alive() for t in threading.enumerate())  # noqa: E731
    before = alive()
    with pytest.raises(RuntimeError, match="did not run to its length.*out of memory"):
        Engine(qwen3_next_dense_path, warmup="on", **POOLS)
    assert alive() == before
