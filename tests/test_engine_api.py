"""The public Engine API: outputs, streaming, async, abort, sampling, validation, robustness."""

from __future__ import annotations

import asyncio
import gc
import logging
import math
import random
import time

import numpy as np
import pytest
import torch

from hyla import Engine
from hyla.engine.sampling_params import SamplingParams


def _ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 2048) for _ in range(n)]


@pytest.fixture(scope="module")
def engine(qwen3_next_dense_path):
    with Engine(qwen3_next_dense_path, max_total_tokens=8192, max_state_slots=48, max_running_requests=8,
                chunked_prefill_size=256, debug_checks=True) as e:
        yield e


GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}


def test_output_format(engine):
    out = engine.generate(input_ids=_ids(20, 0), sampling_params=GREEDY, return_logprob=True)
    assert set(out) == {"text", "output_ids", "meta_info"}
    m = out["meta_info"]
    assert m["prompt_tokens"] == 20 and m["completion_tokens"] == 8 == len(out["output_ids"])
    assert m["finish_reason"] == {"type": "length", "length": 8}
    lps = m["output_token_logprobs"]
    assert [t for _, t, _ in lps] == out["output_ids"] and all(lp <= 0 for lp, _, _ in lps)


def test_batch_equals_single_requests(engine):
    prompts = [_ids(n, 100 + n) for n in (5, 37, 64, 65, 130)]
    batched = engine.generate(input_ids=prompts, sampling_params=GREEDY)
    for p, b in zip(prompts, batched):
        assert engine.generate(input_ids=p, sampling_params=GREEDY)["output_ids"] == b["output_ids"]


def test_stream_yields_increments_that_add_up(engine):
    ids = _ids(30, 1)
    full = engine.generate(input_ids=ids, sampling_params=GREEDY)
    chunks = list(engine.generate(input_ids=ids, sampling_params=GREEDY, stream=True))
    assert len(chunks) >= 2
    assert sum((c["output_ids"] for c in chunks), []) == full["output_ids"]
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])


def test_async_generate_and_stream(engine):
    ids = _ids(25, 2)
    full = engine.generate(input_ids=ids, sampling_params=GREEDY)

    async def main():
        outs = await asyncio.gather(*[engine.async_generate(input_ids=ids, sampling_params=GREEDY) for _ in range(3)])
        stream = await engine.async_generate(input_ids=ids, sampling_params=GREEDY, stream=True)
        got = [c async for c in stream]
        return outs, got

    outs, got = asyncio.run(main())
    assert all(o["output_ids"] == full["output_ids"] for o in outs)
    assert sum((c["output_ids"] for c in got), []) == full["output_ids"]


def test_abort_running_request_frees_everything(engine):
    stream = engine.generate(input_ids=_ids(40, 3), rid="to-abort", stream=True,
                             sampling_params={"temperature": 0, "max_new_tokens": 500, "ignore_eos": True})
    first = next(stream)
    assert first["output_ids"]
    engine.abort("to-abort")
    last = list(stream)[-1]
    assert last["meta_info"]["finish_reason"]["type"] == "abort"
    assert last["meta_info"]["finish_reason"]["cause"] == "client"
    engine.wait_idle()
    engine.check_integrity()


LONG = {"temperature": 0, "max_new_tokens": 1500, "ignore_eos": True}


def _generated_while(engine, fn) -> int:
    """Tokens the engine generated from ``fn()`` until it was idle again."""
    engine.wait_idle()
    before = engine.get_stats()["num_generated_tokens"]
    fn()
    engine.wait_idle()
    return engine.get_stats()["num_generated_tokens"] - before


@pytest.mark.parametrize("how", ["dropped before its first chunk", "dropped after one", "closed", "break"])
def test_a_stream_nobody_reads_aborts_its_request(engine, how):
    """An abandoned stream must not run its request to the end (1,500 tokens here): dropping it —
    also before its first chunk, which a generator function cannot notice — closing it, or
    breaking out of its loop aborts the request, and nothing leaks."""
    def abandon():
        stream = engine.generate(input_ids=_ids(20, 40), sampling_params=LONG, stream=True)
        if how == "break":
            for _ in stream:
                break
            return  # (the loop's stream goes with the frame)
        if how != "dropped before its first chunk":
            assert next(stream)["output_ids"]
        if how == "closed":
            stream.close()
            stream.close()  # idempotent
            assert list(stream) == []
        del stream

    assert _generated_while(engine, abandon) < 1000
    engine.check_integrity()


def test_an_async_stream_nobody_reads_aborts_its_request(engine):
    async def abandon():
        dropped = await engine.async_generate(input_ids=_ids(20, 41), sampling_params=LONG, stream=True)
        del dropped
        closed = await engine.async_generate(input_ids=_ids(20, 42), sampling_params=LONG, stream=True)
        assert (await closed.__anext__())["output_ids"]
        await closed.aclose()
        waiting = await engine.async_generate(input_ids=_ids(20, 43), sampling_params=LONG, stream=True)
        task = asyncio.ensure_future(waiting.__anext__())
        await asyncio.sleep(0)
        task.cancel()  # its consumer cancelled while it waits for a chunk
        with pytest.raises(asyncio.CancelledError):
            await task

    assert _generated_while(engine, lambda: asyncio.run(abandon())) < 1000
    engine.check_integrity()


def test_a_slow_async_consumer_gets_merged_chunks_with_nothing_lost(engine):
    """An async stream read only after its request ended gets its chunks merged into one: the same
    text, ids and output logprobs, and the prompt logprobs only the first chunk carried (they were
    dropped by the merge: an echo with logprobs under load came back without its prompt)."""
    ids = _ids(20, 50)
    kw = dict(input_ids=ids, sampling_params={**GREEDY, "top_logprobs_num": 2}, return_logprob=True,
              logprob_start_len=0)
    full = engine.generate(**kw)

    async def read_late():
        stream = await engine.async_generate(stream=True, **kw)
        await asyncio.to_thread(engine.wait_idle)  # every chunk is queued, unread
        return [c async for c in stream]

    chunks = asyncio.run(read_late())
    assert len(chunks) == 1
    meta, want = chunks[0]["meta_info"], full["meta_info"]
    assert chunks[0]["output_ids"] == full["output_ids"] and chunks[0]["text"] == full["text"]
    for key in ("input_token_logprobs", "input_top_logprobs", "output_token_logprobs", "output_top_logprobs",
                "finish_reason", "completion_tokens"):
        assert meta[key] == want[key], key


def test_a_request_whose_admission_fails_ends_alone(engine, monkeypatch):
    """A request whose admission raises (an injected error in its prefix match: a cause submission
    does not refuse) is aborted alone: it does not stay first in the queue failing every step, the
    requests queued behind it are admitted, and a running stream is untouched."""
    cache = engine.scheduler.cache
    match = cache.match
    monkeypatch.setattr(cache, "match", lambda req: 1 / 0 if req.rid == "poison" else match(req))
    running = engine.generate(input_ids=_ids(30, 46), stream=True,
                              sampling_params={"temperature": 0, "max_new_tokens": 30, "ignore_eos": True})
    next(running)
    bad = engine.generate(input_ids=_ids(20, 47), rid="poison", sampling_params=GREEDY, stream=True)
    behind = [engine.generate(input_ids=_ids(20 + i, 48 + i), sampling_params=GREEDY, stream=True) for i in range(2)]
    engine.wait_idle(timeout=60)  # (before the fix, it never was: TimeoutError)
    assert [list(s)[-1]["meta_info"]["finish_reason"]["type"] for s in behind] == ["length", "length"]
    reason = list(bad)[-1]["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and reason["cause"] == "internal" and "ZeroDivisionError" in reason["message"]
    assert list(running)[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 30}
    engine.wait_idle()
    engine.check_integrity()


def test_a_finished_stream_dropped_unread_aborts_nothing(engine):
    """A stream dropped after its request ended, its last chunk unread, aborts nothing: its request
    id may already name a new request."""
    old = engine.generate(input_ids=_ids(20, 44), rid="reused", sampling_params=GREEDY, stream=True)
    engine.wait_idle()  # the request has ended; its chunks wait unread
    new = engine.generate(input_ids=_ids(20, 45), rid="reused", sampling_params={**GREEDY, "max_new_tokens": 40},
                          stream=True)
    del old
    last = list(new)[-1]
    assert last["meta_info"]["finish_reason"] == {"type": "length", "length": 40}


def test_stop_token_ids_and_max_new_tokens_zero(engine):
    ids = _ids(20, 4)
    ref = engine.generate(input_ids=ids, sampling_params=GREEDY)["output_ids"]
    stop_at = ref[3]
    out = engine.generate(input_ids=ids, sampling_params={**GREEDY, "stop_token_ids": [stop_at]})
    assert out["output_ids"] == ref[: ref.index(stop_at) + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_at}
    zero = engine.generate(input_ids=ids, sampling_params={**GREEDY, "max_new_tokens": 0})
    assert zero["output_ids"] == [] and zero["meta_info"]["finish_reason"]["type"] == "length"


def test_seeded_sampling_is_reproducible_and_batch_independent(engine):
    ids = _ids(15, 5)
    p = {"temperature": 1.0, "top_p": 0.9, "top_k": 50, "min_p": 0.01, "max_new_tokens": 12, "seed": 1234,
         "ignore_eos": True}
    a = engine.generate(input_ids=ids, sampling_params=p)["output_ids"]
    b = engine.generate(input_ids=[ids, _ids(50, 6)], sampling_params=[p, {**p, "seed": 9}])[0]["output_ids"]
    assert a == b
    c = engine.generate(input_ids=ids, sampling_params={**p, "seed": 4321})["output_ids"]
    assert c != a


def test_penalties_change_greedy_choice():
    req = _FakeReq([5, 6, 7], [7, 7])
    logits = torch.zeros(10)
    logits[7] = 2.0
    logits[1] = 1.5
    from hyla.engine.sampler import apply_penalties
    req.sampling = SamplingParams(repetition_penalty=2.0)
    assert apply_penalties(logits, req).argmax().item() == 1  # 2.0 / 2 < 1.5
    req.sampling = SamplingParams(frequency_penalty=0.5)
    assert apply_penalties(logits, req)[7].item() == pytest.approx(1.0)  # 2 - 0.5 * 2
    req.sampling = SamplingParams(presence_penalty=1.0)
    assert apply_penalties(logits, req)[7].item() == pytest.approx(1.0)


class _FakeReq:
    def __init__(self, prompt, output):
        self.input_ids, self.output_ids = prompt, output

    @property
    def fill_ids(self):
        return self.input_ids + self.output_ids


@pytest.mark.parametrize("kwargs, match", [
    (dict(input_ids=[]), "empty"),
    (dict(input_ids=[1, 2, 99999]), "outside the vocabulary"),
    (dict(input_ids=[1, -3]), "outside the vocabulary"),
    (dict(input_ids=[1, True, 2]), "token id True is not an integer"),  # bools are not token ids
    (dict(input_ids=[1, np.bool_(True)]), "token id np.True_ is not an integer"),
    (dict(input_ids=[1, 2.0]), "token id 2.0 is not an integer"),
    (dict(input_ids=[1, "3"]), "token id '3' is not an integer"),
    (dict(input_ids=[1, np.int64(99999)]), r"token id 99999 is outside the vocabulary"),
    (dict(input_ids=[1] * 9000), "context length"),
    (dict(input_ids=[1, 2], sampling_params={"temperature": -1}), "temperature"),
    (dict(input_ids=[1, 2], sampling_params={"top_p": 0}), "top_p"),
    (dict(input_ids=[1, 2], sampling_params={"max_new_tokens": -5}), "max_new_tokens"),
    (dict(input_ids=[1, 2], sampling_params={"bogus": 1}), "unknown sampling parameter"),
    (dict(input_ids=[1, 2], sampling_params={"stop": ["x"]}), "tokenizer"),
    (dict(input_ids=[1, 2], checkpoints=[5]), "checkpoint"),
    (dict(prompt="hello"), "no tokenizer"),
    (dict(), "exactly one"),
    # wrong types: a ValueError naming the argument, never a TypeError from deep inside
    (dict(prompt=5), "prompt must be"),
    (dict(input_ids=5), "input_ids must be"),
    (dict(input_ids=[[1, 2], 3]), "not a mix"),
    (dict(input_ids=[1, 2], rid=5), "rid must be"),
    (dict(input_ids=[1, 2], rid=[5]), "rid must be"),
    (dict(input_ids=[1, 2], return_logprob="yes"), "return_logprob must be a bool"),
    (dict(input_ids=[1, 2], stream=1), "stream must be a bool"),
    (dict(input_ids=[1, 2], sampling_params={"stop": 5}), "stop must be a list"),
    (dict(input_ids=[1, 2], sampling_params={"stop_token_ids": 5}), "stop_token_ids must be a list"),
    (dict(input_ids=[1, 2], sampling_params={"skip_special_tokens": "no"}), "skip_special_tokens must be a bool"),
    (dict(input_ids=[1, 2], sampling_params={"ignore_eos": None}), "ignore_eos must be a bool"),
    (dict(input_ids=[1, 2], sampling_params={"temperature": float("inf")}), "temperature must be a finite"),
    (dict(input_ids=[1, 2], sampling_params={"repetition_penalty": float("inf")}), "repetition_penalty"),
    # found fuzzing the library: an unhashable namespace failed every later step's admission (the queue
    # stalled), a huge int in a float field failed the sampler, an out-of-vocabulary stop id was kept
    (dict(input_ids=[1, 2], namespace=[1]), "namespace must be hashable"),
    (dict(input_ids=[1, 2], namespace=(1, [2])), "namespace must be hashable"),
    (dict(input_ids=[1, 2], sampling_params={"temperature": 10**400}), "temperature must be a finite"),
    (dict(input_ids=[1, 2], sampling_params={"stop_token_ids": [10**6]}), "stop_token_ids: token id"),
    (dict(input_ids=[1, 2], sampling_params={"min_new_tokens": 2, "stop_token_ids": list(range(2048))}),
     "cover the whole vocabulary"),
])
def test_bad_requests_raise_and_leave_others_untouched(engine, kwargs, match):
    stream = engine.generate(input_ids=_ids(30, 8), stream=True,
                             sampling_params={"temperature": 0, "max_new_tokens": 30, "ignore_eos": True})
    next(stream)
    with pytest.raises(ValueError, match=match):
        engine.generate(**kwargs)
    rest = list(stream)
    assert rest[-1]["meta_info"]["finish_reason"]["type"] == "length"
    engine.wait_idle()
    engine.check_integrity()


def test_integer_scalars_of_numpy_and_torch_are_token_ids(engine):
    """``list(array)`` and ``list(tensor)`` give a prompt of integer scalars: they are its token ids, and the
    request is the one of plain ints (the tree keys on plain ints)."""
    ids = _ids(16, 5)
    greedy = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}
    want = engine.generate(input_ids=ids, sampling_params=greedy)["output_ids"]
    for given in (list(np.array(ids)), list(np.array(ids, dtype=np.int32)), list(torch.tensor(ids))):
        assert engine.generate(input_ids=given, sampling_params=greedy)["output_ids"] == want
    engine.wait_idle()
    engine.check_integrity()


def test_bad_calls_of_the_other_methods_are_value_errors(engine):
    """``abort``, ``flush_cache``: a ``ValueError`` naming the argument (an ``abort(123)`` was a silent
    no-op, a ``flush_cache(timeout="1")`` a ``TypeError`` from a ``Future``)."""
    for rid in (123, ["x"], None):
        with pytest.raises(ValueError, match="rid must be a string"):
            engine.abort(rid)
    for timeout in ("1", 0, -1, True, float("nan")):
        with pytest.raises(ValueError, match="timeout must be a positive number"):
            engine.flush_cache(timeout=timeout)
    engine.abort("no-such-request")  # an id no live request has: nothing (it may have just finished)
    assert engine.flush_cache(timeout=30)
    engine.check_integrity()


def test_duplicate_live_rid_is_refused_and_reusable_after_finish(engine):
    """A request refused for its rid (streamed too: its stream, dropped, aborts nothing) leaves the live request
    with that rid running to its end."""
    stream = engine.generate(input_ids=_ids(10, 12), rid="dup", stream=True,
                             sampling_params={"temperature": 0, "max_new_tokens": 200, "ignore_eos": True})
    next(stream)
    with pytest.raises(ValueError, match="already in use"):
        engine.generate(input_ids=_ids(10, 13), rid="dup", sampling_params=GREEDY)
    with pytest.raises(ValueError, match="already in use"):
        engine.generate(input_ids=_ids(10, 13), rid="dup", sampling_params=GREEDY, stream=True)
    with pytest.raises(ValueError, match="already in use"):
        asyncio.run(engine.async_generate(input_ids=_ids(10, 13), rid="dup", sampling_params=GREEDY, stream=True))
    with pytest.raises(ValueError, match="already in use"):
        engine.generate(input_ids=[_ids(5, 1), _ids(5, 2)], rid=["x", "x"], sampling_params=GREEDY)
    gc.collect()
    chunks = list(stream)
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert chunks[-1]["meta_info"]["completion_tokens"] == 200
    assert engine.generate(input_ids=_ids(10, 13), rid="dup", sampling_params=GREEDY)["meta_info"]["id"] == "dup"


@pytest.mark.parametrize("opts, match", [
    (dict(page_size=0), "page_size"),
    (dict(dtype="float64"), "dtype"),
    (dict(schedule_policy="random"), "schedule_policy"),
    (dict(warmup="yes"), "warmup"),
    (dict(state_memory_ratio=0), "state_memory_ratio"),
    (dict(max_state_slots=4, max_running_requests=4), "max_running_requests"),
    (dict(chunked_prefill_size=8, page_size=16), "chunked_prefill_size"),
    (dict(bogus_option=1), "bogus_option"),
    (dict(max_running_request=4), "did you mean 'max_running_requests'"),
    (dict(speculative_algorithm="ngram", speculative_ngram_adaptive="yes"), "speculative_ngram_adaptive"),
    (dict(device="bogus"), "device must be"),
    (dict(device=None), "device must be"),
    (dict(device="meta"), "device must be"),
    pytest.param(dict(device="cuda"), "no CUDA device", marks=pytest.mark.skipif(
        torch.cuda.is_available(), reason="a machine with CUDA")),
    (dict(mem_fraction="0.5"), "mem_fraction"),
    (dict(speculative_num_steps=5), "speculative_num_steps set without speculative_algorithm"),
    (dict(priority_scheduling_preemption_threshold=3), "set without enable_priority_scheduling"),
    (dict(seed=2**64), r"seed must be an integer in \[0, 2\*\*63\)"),
    (dict(max_state_slots=10**30), r"max_state_slots must be at most 2\*\*40"),
    (dict(max_total_tokens=10**30), r"max_total_tokens must be at most 2\*\*40"),
    (dict(hicache_ratio=4.0), "hicache_ratio set without enable_hierarchical_cache"),
    (dict(speculative_ngram_adaptive=False), "speculative_ngram_adaptive set without speculative_algorithm='ngram'"),
    (dict(speculative_algorithm="mtp", speculative_ngram_min_match_window_size=2, speculative_ngram_adaptive=False),
     "speculative_ngram_min_match_window_size, speculative_ngram_adaptive set without speculative_algorithm='ngram', "
     "which would ignore them"),
    (dict(disable_cuda_graph=True, cuda_graph_max_extend_tokens=64),
     "cuda_graph_max_extend_tokens set with disable_cuda_graph, which would ignore it"),
    (dict(enable_hierarchical_cache=True, enable_prefix_cache=False), "needs enable_prefix_cache"),
    (dict(enable_hierarchical_cache=True, hicache_ratio=0), "hicache_ratio must be a number"),
    (dict(enable_hierarchical_cache=True, hicache_size=-1), "hicache_size must be a number"),
    (dict(enable_hierarchical_cache=True, hicache_size=1e-9), "hicache_size=1e-09 GiB is too small"),
    (dict(enable_hierarchical_cache=True, hicache_size=10**6), "host pools .* need .* GiB, more than"),
])
def test_bad_engine_options(qwen3_next_dense_path, opts, match):
    with pytest.raises(ValueError, match=match):
        Engine(qwen3_next_dense_path, **opts)


def test_options_of_a_feature_that_is_off_are_taken_at_their_default():
    """The rule that refuses an option its feature would ignore counts an option at its default as not set (and
    ``cuda_graph_max_extend_tokens=0``, extends run eagerly, as agreeing with ``disable_cuda_graph``)."""
    from hyla.engine.args import EngineArgs

    EngineArgs(speculative_ngram_adaptive=True, speculative_ngram_min_match_window_size=1,
               speculative_ngram_max_match_window_size=12)
    EngineArgs(speculative_algorithm="ngram", speculative_ngram_adaptive=False, speculative_ngram_max_match_window_size=4)
    EngineArgs(disable_cuda_graph=True, cuda_graph_max_extend_tokens=1024)
    EngineArgs(disable_cuda_graph=True, cuda_graph_max_extend_tokens=0)
    EngineArgs(cuda_graph_max_extend_tokens=64)


def test_missing_model_dir_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="config.json"):
        Engine(tmp_path)


def test_log_line(engine, caplog):
    with caplog.at_level(logging.INFO, logger="hyla.engine"):
        engine.generate(input_ids=_ids(20, 9), sampling_params=GREEDY)
    text = caplog.text
    assert "Prefill batch. #new-seq: 1, #new-token:" in text and "cache hit rate" in text
    assert "token usage" in text and "state usage" in text and "#queue-req" in text


@pytest.fixture(scope="module")
def paged_engine(qwen3_next_dense_path):
    with Engine(qwen3_next_dense_path, page_size=16, max_total_tokens=8192, max_state_slots=48,
                max_running_requests=8, chunked_prefill_size=256, debug_checks=True) as e:
        yield e


@pytest.mark.parametrize("which", ["engine", "paged_engine"])
def test_internal_error_aborts_the_batch_and_engine_keeps_serving(which, request, monkeypatch):
    engine = request.getfixturevalue(which)
    runner = engine.scheduler.runner
    real = runner.forward_decode
    calls = {"n": 0}

    def flaky(reqs, out_cache_loc, **kw):  # kw: the overlap schedule's device tokens
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected failure")
        return real(reqs, out_cache_loc, **kw)

    monkeypatch.setattr(runner, "forward_decode", flaky)
    out = engine.generate(input_ids=_ids(20, 10), sampling_params=GREEDY)
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert out["meta_info"]["finish_reason"]["cause"] == "internal"
    assert "injected failure" in out["meta_info"]["finish_reason"]["message"]
    monkeypatch.setattr(runner, "forward_decode", real)
    again = engine.generate(input_ids=_ids(20, 11), sampling_params=GREEDY)
    assert again["meta_info"]["finish_reason"]["type"] == "length"
    engine.wait_idle()
    engine.check_integrity()
    kv, st, tree = engine.kv_pool, engine.state_pool, engine.tree
    assert kv.available_size() + tree.total_size() == kv.size
    assert st.available_size() + tree.num_checkpoints() == st.size


def test_a_temperature_too_small_to_divide_by_samples_greedily(engine):
    """1e-45 is 0 in fp32: dividing the logits by it made every probability NaN (and the token the
    last of the vocabulary). Below ``GREEDY_TEMPERATURE`` a request samples greedily."""
    ids = _ids(12, 21)
    want = engine.generate(input_ids=ids, sampling_params=GREEDY)
    for t in (1e-45, 1e-300, 1e-6):
        got = engine.generate(input_ids=ids, sampling_params=dict(GREEDY, temperature=t), return_logprob=True)
        assert got["output_ids"] == want["output_ids"], t


def _generate_within(engine, seconds: float, **kwargs) -> dict:
    """``engine.generate(**kwargs)``, failing the test after ``seconds`` (a dead scheduler thread
    leaves it waiting forever) instead of hanging it."""
    import concurrent.futures

    pool = concurrent.futures.ThreadPoolExecutor(1)
    try:
        return pool.submit(engine.generate, **kwargs).result(seconds)
    finally:
        pool.shutdown(wait=False)


def _failing_detokenizer(rid: str | None):
    """A ``make_detokenizer`` that raises for request ``rid`` (None: for every request)."""
    def make(req):
        if rid is None or req.rid == rid:
            raise TypeError("injected detokenizer failure")
        return None
    return make


def test_a_request_whose_text_fails_is_aborted_alone(engine, monkeypatch):
    """A request whose own host work raises (its detokenizer, at its end) is aborted with the error;
    the requests beside it in its steps go on (a stream here), and the engine serves on. (Such an
    error failed the whole step once, and finishing the request raised again and killed the
    scheduler thread: every later request waited forever.)"""
    monkeypatch.setattr(engine.scheduler.output, "make_detokenizer", _failing_detokenizer("bad-text"))
    stream = engine.generate(input_ids=_ids(12, 24), stream=True, sampling_params=dict(GREEDY, max_new_tokens=20))
    next(stream)
    out = _generate_within(engine, 60, input_ids=_ids(12, 22), rid="bad-text", sampling_params=GREEDY)
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert out["meta_info"]["finish_reason"]["cause"] == "internal"
    assert "injected detokenizer failure" in out["meta_info"]["finish_reason"]["message"]
    assert list(stream)[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert engine.is_alive
    engine.wait_idle()
    engine.check_integrity()


def test_a_failed_step_whose_requests_cannot_finish_cleanly_leaves_the_engine_serving(engine, monkeypatch):
    """A step fails (an injected runner error), and finishing its requests as aborted raises too
    (their text): each is delivered all the same, aborted, and the scheduler thread lives on."""
    runner = engine.scheduler.runner
    real, calls = runner.forward_decode, {"n": 0}

    def flaky(reqs, out_cache_loc, **kw):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected failure")
        return real(reqs, out_cache_loc, **kw)

    monkeypatch.setattr(runner, "forward_decode", flaky)
    monkeypatch.setattr(engine.scheduler.output, "make_detokenizer", _failing_detokenizer(None))
    out = _generate_within(engine, 60, input_ids=_ids(12, 25), sampling_params=GREEDY)
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert engine.is_alive
    monkeypatch.undo()
    again = engine.generate(input_ids=_ids(12, 23), sampling_params=GREEDY)
    assert again["meta_info"]["finish_reason"]["type"] == "length"
    engine.wait_idle()
    engine.check_integrity()


def test_long_lists_in_sampling_params_are_checked_off_the_event_loop(engine, monkeypatch):
    """Sampling params whose lists ``_make_requests`` walks one by one (millions of stop token ids or logit
    biases: ~0.5 s per 4M) are checked in a worker thread, as long prompts are; short ones on the loop."""
    import threading

    from hyla.engine.engine import WORKER_THREAD_PROMPT_SIZE, _params_size

    many = list(range(3, 103)) * (WORKER_THREAD_PROMPT_SIZE // 100 + 1)
    assert _params_size({"stop_token_ids": many}) == len(many) and _params_size([None, {"stop": ["ab", "c"]}]) == 5
    assert _params_size(SamplingParams(logit_bias={5: 1.0})) == 1 and _params_size({"stop": 7}) == 0
    threads, real = [], engine._make_requests

    def recorded(*a, **k):
        threads.append(threading.current_thread())
        return real(*a, **k)

    monkeypatch.setattr(engine, "_make_requests", recorded)
    for params in ({"stop_token_ids": many}, {"stop_token_ids": many[:10]}):
        out = asyncio.run(engine.async_generate(input_ids=_ids(8, 3), sampling_params={**GREEDY, **params}))
        assert out["meta_info"]["finish_reason"] is not None
    assert threads[0] is not threading.main_thread() and threads[1] is threading.main_thread()


def test_a_grammar_compiles_off_the_event_loop(monkeypatch):
    """``async_generate`` makes a request with a grammar in a worker thread: while a (slow) grammar
    compiles, the event loop runs its other tasks."""
    from hyla.engine.engine import _asks_for_grammar
    from hyla.engine.grammar import Grammars
    from hyla.engine.sampling_params import SamplingParams

    assert _asks_for_grammar({"regex": "a+"}) and _asks_for_grammar([None, SamplingParams(json_schema={})])
    assert not _asks_for_grammar(None) and not _asks_for_grammar([{"temperature": 0}])

    def slow_compile(self, kind, source, after=None, opener=None):
        time.sleep(1.0)
        raise ValueError("slow grammar refused")

    monkeypatch.setattr(Grammars, "_compile", slow_compile)
    with Engine(max_total_tokens=2048, max_state_slots=16, max_running_requests=4) as eng:  # (a tokenizer)

        async def main():
            ticks = []

            async def tick():
                while True:
                    ticks.append(time.perf_counter())
                    await asyncio.sleep(0.05)

            ticker = asyncio.create_task(tick())
            with pytest.raises(ValueError, match="slow grammar refused"):
                await eng.async_generate("hi", {"regex": "a+", "max_new_tokens": 2})
            ticker.cancel()
            return ticks

        ticks = asyncio.run(main())
        assert len(ticks) >= 10  # the loop ran on through the second of the compile
        assert max(b - a for a, b in zip(ticks, ticks[1:])) < 0.5
        assert eng.generate("hi", {"max_new_tokens": 2})["meta_info"]["finish_reason"]["type"] == "length"


def test_queue_limit_counts_requests_not_yet_scheduled_and_streams_submit_eagerly(qwen3_next_dense_path):
    from hyla.engine.engine import EngineOverloadedError

    with Engine(qwen3_next_dense_path, max_total_tokens=4096, max_state_slots=16, max_running_requests=2,
                max_queued_requests=3) as eng:
        with eng._inbox_lock:  # as if five submitted requests had not reached the scheduler yet
            eng._live.update(dict.fromkeys(f"pending-{i}" for i in range(5)))
        with pytest.raises(EngineOverloadedError):
            eng.generate(input_ids=[1, 2, 3], sampling_params=GREEDY, stream=True)  # raises before iteration

        async def main():
            with pytest.raises(EngineOverloadedError):
                await eng.async_generate(input_ids=[1, 2, 3], sampling_params=GREEDY, stream=True)

        asyncio.run(main())
        with eng._inbox_lock:
            for i in range(5):
                del eng._live[f"pending-{i}"]
        assert eng.generate(input_ids=[1, 2, 3], sampling_params=GREEDY)["meta_info"]["completion_tokens"] == 8


def test_an_idle_engine_takes_a_batch_of_running_plus_queued_slots(qwen3_next_dense_path):
    with Engine(qwen3_next_dense_path, max_total_tokens=4096, max_state_slots=16, max_running_requests=2,
                max_queued_requests=3) as eng:
        assert eng.max_live_requests == 5
        outs = eng.generate(input_ids=[[1, 2, 3 + i] for i in range(5)], sampling_params=GREEDY)
        assert [o["meta_info"]["finish_reason"]["type"] for o in outs] == ["length"] * 5
        with pytest.raises(ValueError, match="a batch of 6 requests can never fit"):  # not a 'retry later'
            eng.generate(input_ids=[[1, 2, 3 + i] for i in range(6)], sampling_params=GREEDY)
        with pytest.raises(ValueError, match="seed"):
            eng.generate(input_ids=[1, 2, 3], sampling_params={"seed": 2**70})
        eng.wait_idle()
        assert not eng._live


def test_generation_config_defaults_fill_unset_sampling_params():
    """The built-in model's generation_config.json sets temperature 0.7 and top_p 0.9: a request
    that sets neither samples with them; an explicit value wins; 'none' keeps hyla's defaults."""
    ids = list(range(5, 25))
    with Engine() as eng:
        assert eng.sampling_defaults == {"temperature": 0.7, "top_p": 0.9}
        assert eng.default_max_new_tokens == 256  # (the file's max_new_tokens: the server's default max_tokens)
        implicit = eng.generate(input_ids=ids, sampling_params={"seed": 3, "max_new_tokens": 24})
        explicit = eng.generate(input_ids=ids, sampling_params={"seed": 3, "max_new_tokens": 24,
                                                                "temperature": 0.7, "top_p": 0.9})
        hot = eng.generate(input_ids=ids, sampling_params={"seed": 3, "max_new_tokens": 24,
                                                           "temperature": 1.0, "top_p": 1.0})
        assert implicit["output_ids"] == explicit["output_ids"] != hot["output_ids"]
    with Engine(generation_config="none") as eng:
        assert eng.sampling_defaults == {} and eng.default_max_new_tokens is None
        plain = eng.generate(input_ids=ids, sampling_params={"seed": 3, "max_new_tokens": 24})
        assert plain["output_ids"] == hot["output_ids"]


def test_a_request_its_token_ends_is_cached_before_the_token_is_read(qwen3_next_dense_path):
    """A prefill whose sampled token finishes the request whatever it is (``max_new_tokens`` 1) is
    released to the cache while the device samples, before the host reads the token (on a GPU its
    release then costs the TTFT nothing); one that goes on is not. If reading the token then fails,
    the released request is still told (aborted), and nothing leaks: the next turn hits the prompt."""
    from test_engine_differential import assert_drained

    prompt = _ids(40, 12)
    with Engine(qwen3_next_dense_path, max_total_tokens=1024, max_state_slots=16, debug_checks=True) as engine:
        sched = engine.scheduler
        complete, seen = sched.output.complete, []

        def watch(draw):
            seen.extend((r.sampling.max_new_tokens, r.req_pool_idx is None) for r in draw.reqs)
            return complete(draw)

        sched.output.complete = watch
        one, more = engine.generate(input_ids=[prompt, _ids(30, 13)], sampling_params=[
            {"max_new_tokens": 1, "temperature": 0}, {"max_new_tokens": 3, "temperature": 0}])
        assert seen[:2] == [(1, True), (3, False)]  # the prefill's read: only the finished one released
        assert one["meta_info"]["finish_reason"]["type"] == "length" and len(one["output_ids"]) == 1
        assert len(more["output_ids"]) == 3
        assert_drained(engine)

        def fail(draw):
            raise RuntimeError("injected read failure")

        sched.output.complete = fail
        out = engine.generate(input_ids=prompt + [7], sampling_params={"max_new_tokens": 1, "temperature": 0})
        assert out["meta_info"]["finish_reason"]["type"] == "abort"
        assert "injected read failure" in out["meta_info"]["finish_reason"]["message"]
        sched.output.complete = complete
        assert_drained(engine)
        again = engine.generate(input_ids=prompt + [7, 8], sampling_params={"max_new_tokens": 1, "temperature": 0})
        assert again["meta_info"]["cached_tokens"] == 41  # the failed turn's release cached its prompt
        assert_drained(engine)


def test_extreme_sampling_values_found_fuzzing(engine):
    """What fuzzing the library found, each now sound: a ``SamplingParams`` object changed after it
    was made is checked again at submission (its bad field failed the whole batch's step); a
    ``top_p`` that rounds to 0 in fp32 keeps the top token, and a repetition penalty small enough to
    divide a logit into inf samples a real token (both drew the last token of the vocabulary,
    through a NaN distribution)."""
    sp = SamplingParams(max_new_tokens=3)
    sp.top_k = "x"
    with pytest.raises(ValueError, match="top_k"):
        engine.generate(input_ids=[1, 2, 3], sampling_params=sp)
    ids = _ids(20, 3)
    greedy = engine.generate(input_ids=ids, sampling_params={**GREEDY, "max_new_tokens": 6})["output_ids"]
    tiny_p = engine.generate(input_ids=ids, sampling_params={"temperature": 1.0, "top_p": 1e-300, "max_new_tokens": 6,
                                                             "ignore_eos": True})["output_ids"]
    assert tiny_p == greedy  # only the top token is left: greedy
    vocab = engine.model_config.vocab_size
    for temperature in (1.0, 0.7):  # below 1 the temperature made the largest finite logit inf again
        out = engine.generate(input_ids=ids, sampling_params={"temperature": temperature, "repetition_penalty": 1e-40,
                                                              "max_new_tokens": 6, "ignore_eos": True, "seed": 1})
        assert out["output_ids"] != [vocab - 1] * 6
        seen = list(ids)  # the penalty boosts the tokens already seen (with a positive logit): only they are drawn
        for t in out["output_ids"]:
            assert t in seen, (temperature, out["output_ids"])
            seen.append(t)
    engine.wait_idle()
    engine.check_integrity()


def test_a_lone_surrogate_in_a_prompt_is_a_value_error():
    from hyla.engine.engine import DEFAULT_MODEL_DIR
    from hyla.tokenizer import Tokenizer

    tok = Tokenizer.from_pretrained(DEFAULT_MODEL_DIR)
    with pytest.raises(ValueError, match="lone UTF-16 surrogate at character 2"):
        tok.encode("ab\ud800c")
    assert tok.encode("ab\U0001F600c")  # a character beyond the BMP is text


def test_an_engine_shut_down_refuses_work_and_waits_for_nothing(qwen3_next_dense_path):
    eng = Engine(qwen3_next_dense_path, max_total_tokens=1024, max_state_slots=8, max_running_requests=2)
    eng.generate(input_ids=[1, 2, 3], sampling_params=GREEDY)
    eng.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        eng.generate(input_ids=[1, 2, 3], sampling_params=GREEDY)
    eng.abort("nobody")  # nothing to abort: no message left in an inbox nobody reads
    start = time.monotonic()
    eng.wait_idle(timeout=30)  # returns at once (it waited out its timeout, then raised TimeoutError)
    assert time.monotonic() - start < 5


def test_cancelling_a_batch_aborts_only_its_unfinished_requests(engine):
    """A batch's ``async_generate`` cancelled after one of its requests finished aborts the others (the long one
    stops: it generates far fewer than its 2,000 tokens), not the finished one's rid, which a new request may hold
    by then."""
    generated = engine.get_stats()["num_generated_tokens"]

    async def main():
        batch = asyncio.create_task(engine.async_generate(
            input_ids=[_ids(6, 1), _ids(6, 2)], rid=["first", "second"],
            sampling_params=[{**GREEDY, "max_new_tokens": 1}, {**GREEDY, "max_new_tokens": 2000}]))
        deadline = time.monotonic() + 60
        while "first" in engine._live or "second" not in engine._live:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.005)
        again = asyncio.create_task(engine.async_generate(input_ids=_ids(6, 3), rid="first",
                                                          sampling_params={**GREEDY, "max_new_tokens": 20}))
        await asyncio.sleep(0.05)
        batch.cancel()
        with pytest.raises(asyncio.CancelledError):
            await batch
        return await asyncio.wait_for(again, 60)

    out = asyncio.run(main())
    assert out["meta_info"]["finish_reason"]["type"] == "length" and out["meta_info"]["completion_tokens"] == 20
    engine.wait_idle()
    assert engine.get_stats()["num_generated_tokens"] - generated < 1000
    engine.check_integrity()


def test_timeouts_without_a_limit_and_check_requests_input(engine):
    """``math.inf`` (no limit) waits as long as it takes, where ``Future.result`` overflowed; ``wait_idle(0)`` on
    an idle engine returns; ``check_requests`` refuses what is not a list of dicts with a ValueError, and takes no
    request id from the counter (an unseeded request's sampling seed derives from its id)."""
    engine.wait_idle(0)
    assert engine.flush_cache(timeout=math.inf) and engine.cached_tokens(_ids(5, 1), timeout=1e300) == 0
    for bad in (None, [None], [[("input_ids", [1])]], "x"):
        with pytest.raises(ValueError, match="list of dicts"):
            engine.check_requests(bad)
    for timeout in (-1, "x", True):
        with pytest.raises(ValueError, match="timeout"):
            engine.wait_idle(timeout)
    before = engine.generate(input_ids=_ids(5, 2), sampling_params={"max_new_tokens": 1})["meta_info"]["id"]
    engine.check_requests([{"input_ids": _ids(5, 2)}])
    after = engine.generate(input_ids=_ids(5, 2), sampling_params={"max_new_tokens": 1})["meta_info"]["id"]
    assert int(after.removeprefix("req-")) == int(before.removeprefix("req-")) + 1


def test_an_abort_that_loses_the_race_with_its_requests_end_reaches_no_other_request(engine):
    """The engine's own aborts (a stream closed, an interrupted ``generate``, ``abort_all``) name the request itself,
    not its rid: one that arrives after its request ended finds nothing, though a new request holds the rid by then.
    (The race is simulated: the stream is made to close as if it had read "not ended" just before the end.)"""
    first = engine.generate(input_ids=_ids(6, 4), rid="raced", stream=True, sampling_params={**GREEDY, "max_new_tokens": 1})
    assert list(first)[-1]["meta_info"]["finish_reason"]["type"] == "length"
    again = engine.generate(input_ids=_ids(6, 5), rid="raced", stream=True,
                            sampling_params={**GREEDY, "max_new_tokens": 200})
    next(again)
    first._done, first._ending.ended = False, False
    first.close()  # (its abort is queued now, after its request has ended)
    chunks = list(again)
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert chunks[-1]["meta_info"]["completion_tokens"] == 200
    engine.wait_idle()
    assert engine.abort_all() == 0


def test_cached_tokens_by_tier_counts_what_a_request_with_prompt_logprobs_could_hit(engine):
    """``cached_tokens_by_tier`` answers ``(device, any_tier, limit)``: the limit is all but the last token, or,
    for a request with prompt logprobs from ``logprob_start_len`` (``generate``'s), the first position whose
    logits they need (the cache's own rule, ``match_limit``); the counts are what such a request would hit.
    After one request the hybrid model's tree holds one checkpoint, at the prompt's end: a request with prompt
    logprobs from position 10 could hit nothing of it, and a generate of that request agrees."""
    engine.flush_cache()
    prompt = _ids(40, 7)
    engine.generate(input_ids=prompt, sampling_params=GREEDY)
    assert engine.cached_tokens_by_tier(prompt) == (39, 39, 39)
    assert engine.cached_tokens_by_tier(prompt, logprob_start_len=10) == (0, 0, 9)
    assert engine.cached_tokens_by_tier(prompt, logprob_start_len=0) == (0, 0, 0)
    assert engine.cached_tokens_by_tier(prompt[:1]) == (0, 0, 0)
    out = engine.generate(input_ids=prompt, sampling_params=GREEDY, return_logprob=True, logprob_start_len=10)
    assert out["meta_info"]["cached_tokens"] == 0
    assert engine.generate(input_ids=prompt, sampling_params=GREEDY)["meta_info"]["cached_tokens"] == 39
    for bad in (-2, 40, True, "1"):
        with pytest.raises(ValueError, match="logprob_start_len"):
            engine.cached_tokens_by_tier(prompt, logprob_start_len=bad)


def test_queue_time_is_the_wait_before_the_first_admission(qwen3_next_dense_path):
    """``meta_info["queue_time"]``: seconds from submission to the first admission to the batch. With one running
    request at a time the second of two waits out the first's whole generation; a stream's every chunk says the
    same wait."""
    with Engine(qwen3_next_dense_path, max_total_tokens=4096, max_state_slots=8, max_running_requests=1) as e:
        start = time.monotonic()
        first, second = e.generate(input_ids=[_ids(20, 1), _ids(20, 2)],
                                   sampling_params={**GREEDY, "max_new_tokens": 40})
        elapsed = time.monotonic() - start
        waits = [first["meta_info"]["queue_time"], second["meta_info"]["queue_time"]]
        assert 0 <= waits[0] < waits[1] < elapsed and waits[1] > 5 * waits[0], waits
        chunks = list(e.generate(input_ids=_ids(20, 3), sampling_params=GREEDY, stream=True))
        assert len({c["meta_info"]["queue_time"] for c in chunks}) == 1 and len(chunks) > 1
