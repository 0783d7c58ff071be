"""Adversarial engine tests: aborts at every stage (mid chunked prefill, waiting, retracted, unknown,
twice), retraction beside a chunked prefill, pages + checkpoint grids, degenerate lengths, in-batch
duplicates, stop conditions at the first token, tiny pools, namespaces, top logprobs and streams
closed early. Each case compares to a cache-off engine (greedy tokens equal, logprobs within 1e-4 up
to the first floating-point tie) and checks that after draining every KV page, state slot and
request-table row is free or held by the tree."""

from __future__ import annotations

import asyncio
import threading
import random

import pytest

from hyla import Engine
from test_engine_differential import assert_drained

TOL = 1e-4


def _ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 2048) for _ in range(n)]


def _greedy(max_new: int, **kw) -> dict:
    return {"temperature": 0, "max_new_tokens": max_new, "ignore_eos": True, **kw}


def _same(a: dict, b: dict) -> None:
    """Equal greedy tokens and logprobs within TOL, up to the first floating-point tie."""
    la, lb = a["meta_info"]["output_token_logprobs"], b["meta_info"]["output_token_logprobs"]
    for (pa, ta, _), (pb, tb, _) in zip(la, lb):
        assert abs(pa - pb) < TOL, f"{a['meta_info']['id']}: logprob {pa} vs {pb} (tokens {ta}, {tb})"
        if ta != tb:
            return  # a tie: both runs are right
    assert a["output_ids"] == b["output_ids"]
    assert a["meta_info"]["finish_reason"] == b["meta_info"]["finish_reason"]


@pytest.fixture(scope="module")
def ref(qwen3_next_dense_path):
    """Cache-off reference: what every cached run must reproduce."""
    with Engine(qwen3_next_dense_path, enable_prefix_cache=False, max_total_tokens=8192, max_state_slots=32,
                max_running_requests=8, chunked_prefill_size=512) as e:
        yield e


def _ref(ref: Engine, prompts: list[list[int]], params: list[dict] | dict, **kw) -> list[dict]:
    return ref.generate(input_ids=prompts, sampling_params=params, return_logprob=True, **kw)


def test_abort_mid_chunked_prefill_waiting_unknown_and_twice(qwen3_next_dense_path, ref):
    long, queued, other = _ids(150, 1), _ids(40, 2), _ids(30, 3)
    with Engine(qwen3_next_dense_path, max_total_tokens=2048, max_state_slots=8, max_running_requests=1,
                chunked_prefill_size=32, debug_checks=True) as eng:
        runner = eng.scheduler.runner
        real = runner.forward_extend
        calls = {"n": 0}

        def hooked(reqs, lens, loc, ckpts, **kw):
            calls["n"] += 1
            if calls["n"] == 2:  # "long" is between its chunks; "queued" and "other" wait
                assert [r.rid for r in reqs] == ["long"] and reqs[0].kv_len == 32
                for rid in ("long", "queued", "no-such-rid", "long", "queued"):
                    eng.abort(rid)
            return real(reqs, lens, loc, ckpts, **kw)

        runner.forward_extend = hooked
        outs = eng.generate(input_ids=[long, queued, other], sampling_params=_greedy(6), return_logprob=True,
                            rid=["long", "queued", "other"])
        runner.forward_extend = real
        assert outs[0]["meta_info"]["finish_reason"]["type"] == "abort" and outs[0]["output_ids"] == []
        assert outs[1]["meta_info"]["finish_reason"]["type"] == "abort" and outs[1]["output_ids"] == []
        assert_drained(eng)
        want = _ref(ref, [long, other], _greedy(6))
        _same(outs[2], want[1])
        # the aborted prefill left its computed chunks (and a chunk-boundary checkpoint) in the tree
        again = eng.generate(input_ids=long, sampling_params=_greedy(6), return_logprob=True)
        assert again["meta_info"]["cached_tokens"] == 64
        _same(again, want[0])
        assert_drained(eng)


def test_abort_of_a_retracted_request(qwen3_next_dense_path, ref):
    prompts = [_ids(40, 10 + i) for i in range(3)]
    with Engine(qwen3_next_dense_path, max_total_tokens=240, max_state_slots=12, max_running_requests=3,
                chunked_prefill_size=128, debug_checks=True) as eng:
        sched = eng.scheduler
        real = sched.retract
        victims: list[str] = []

        def hooked(req):
            real(req)
            if not victims:
                victims.append(req.rid)
                eng.abort(req.rid)  # handled at the next step: the request is back in the queue
                eng.abort(req.rid)

        sched.retract = hooked
        outs = eng.generate(input_ids=prompts, sampling_params=_greedy(60), return_logprob=True)
        del sched.retract
        assert victims, "the pool was meant to force a retraction"
        want = _ref(ref, prompts, _greedy(60))
        for o, w in zip(outs, want):
            if o["meta_info"]["id"] == victims[0]:
                assert o["meta_info"]["finish_reason"]["type"] == "abort"
                assert o["output_ids"] == w["output_ids"][: len(o["output_ids"])]
            else:
                _same(o, w)
        assert_drained(eng)


@pytest.mark.parametrize("order", [("A", "B", "L"), ("L", "A", "B")])
def test_retraction_beside_a_chunked_prefill(qwen3_next_dense_path, ref, order):
    """A and B hit the cache, so LPM admits them before the long prompt L, which is then prefilled
    in chunks until the KV pool runs dry; A and B decode and someone is retracted: L in the middle
    of its chunked prefill (L youngest), or the decoding B and A while L is mid-prefill (L oldest)."""
    A, B, L = _ids(40, 20), _ids(40, 21), _ids(240, 22)
    spec = {"A": (A, _greedy(60)), "B": (B, _greedy(60)), "L": (L, _greedy(4))}
    prompts, params = [spec[k][0] for k in order], [spec[k][1] for k in order]
    with Engine(qwen3_next_dense_path, max_total_tokens=256, max_state_slots=12, max_running_requests=3,
                chunked_prefill_size=64, debug_checks=True) as eng:
        eng.generate(input_ids=[A, B], sampling_params=_greedy(1))
        sched = eng.scheduler
        real, retracted = sched.retract, []

        def hooked(req):
            retracted.append((req.rid, req.is_decoding, {r.rid: r.is_decoding for r in sched.running}))
            real(req)

        sched.retract = hooked
        outs = eng.generate(input_ids=prompts, sampling_params=params, return_logprob=True, rid=list(order))
        del sched.retract
        assert retracted
        rid, decoding, running = retracted[0]
        if order[-1] == "L":
            assert (rid, decoding) == ("L", False)
        else:
            assert rid == "B" and decoding and running["L"] is False
        for o, w in zip(outs, _ref(ref, prompts, params)):
            _same(o, w)
        assert_drained(eng)


@pytest.mark.parametrize("page_size, alignment", [(16, 1), (16, 48), (4, 6)])
def test_pages_grid_chunks_retraction_and_second_turns(qwen3_next_dense_path, ref, page_size, alignment):
    prompts = [_ids(n, 30 + n) for n in (17, 33, 70, 130)]
    params = [_greedy(m) for m in (40, 30, 9, 5)]
    want1 = _ref(ref, prompts, params)
    turn2 = [p + w["output_ids"] + _ids(5, 40 + i) for i, (p, w) in enumerate(zip(prompts, want1))]
    want2 = _ref(ref, turn2, _greedy(4))
    with Engine(qwen3_next_dense_path, page_size=page_size, checkpoint_alignment=alignment,
                max_total_tokens=352, max_state_slots=10, max_running_requests=4, chunked_prefill_size=64,
                debug_checks=True) as eng:
        outs1 = eng.generate(input_ids=prompts, sampling_params=params, return_logprob=True)
        outs2 = eng.generate(input_ids=turn2, sampling_params=_greedy(4), return_logprob=True)
        for o, w in zip(outs1 + outs2, want1 + want2):
            _same(o, w)
        assert sum(o["meta_info"]["cached_tokens"] for o in outs2) > 0
        assert_drained(eng)


def test_degenerate_lengths_and_in_batch_duplicates(qwen3_next_dense_path, ref):
    base = _ids(50, 50)
    prompts = [[7], [7, 9], base, base, base[:20], base[:40] + [5], [7], _ids(3, 51)]
    params = [_greedy(m) for m in (0, 1, 3, 3, 1, 0, 2, 5)]
    want = _ref(ref, prompts, params)
    with Engine(qwen3_next_dense_path, max_total_tokens=1024, max_state_slots=24, max_running_requests=8,
                chunked_prefill_size=512, debug_checks=True) as eng:
        for _ in range(2):  # cold, then everything hits the cache
            outs = eng.generate(input_ids=prompts, sampling_params=params, return_logprob=True)
            for o, w in zip(outs, want):
                _same(o, w)
            assert [len(o["output_ids"]) for o in outs] == [0, 1, 3, 3, 1, 0, 2, 5]
            assert_drained(eng)
        assert outs[2]["meta_info"]["cached_tokens"] == 49
    with Engine(qwen3_next_dense_path, page_size=16, max_total_tokens=1024, max_state_slots=24,
                max_running_requests=8, chunked_prefill_size=32, debug_checks=True) as eng:
        for _ in range(2):
            for o, w in zip(eng.generate(input_ids=prompts, sampling_params=params, return_logprob=True), want):
                _same(o, w)
            assert_drained(eng)


def test_stop_at_first_token_and_eos(qwen3_next_dense_path, ref):
    ids = _ids(25, 60)
    full = ref.generate(input_ids=ids, sampling_params=_greedy(10), return_logprob=True)["output_ids"]
    with Engine(qwen3_next_dense_path, max_total_tokens=1024, max_state_slots=16, max_running_requests=4,
                chunked_prefill_size=512, debug_checks=True) as eng:
        first = eng.generate(input_ids=[ids, ids], sampling_params=_greedy(10, stop_token_ids=[full[0]]))
        for o in first:
            assert o["output_ids"] == full[:1]
            assert o["meta_info"]["finish_reason"] == {"type": "stop", "matched": full[0]}
        eos = full[4]
        eng.scheduler.output.eos_token_ids = {eos}  # as if the model's eos were this token
        stopped = eng.generate(input_ids=ids, sampling_params={"temperature": 0, "max_new_tokens": 10})
        assert stopped["output_ids"] == full[: full.index(eos) + 1]
        assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": eos}
        ignored = eng.generate(input_ids=ids, sampling_params=_greedy(10))
        assert ignored["output_ids"] == full
        assert_drained(eng)


def test_tiny_pools_serialize_without_deadlock(qwen3_next_dense_path, ref):
    """KV pool barely above one request; state pool = max_running_requests + 1."""
    prefix = _ids(40, 70)
    prompts = [prefix + _ids(20, 71), prefix + _ids(20, 72), _ids(60, 73), prefix + _ids(20, 71)]
    params = _greedy(20)
    want = _ref(ref, prompts, params)
    with Engine(qwen3_next_dense_path, max_total_tokens=96, max_state_slots=3, max_running_requests=2,
                chunked_prefill_size=32, debug_checks=True) as eng:
        for _ in range(2):
            for o, w in zip(eng.generate(input_ids=prompts, sampling_params=params, return_logprob=True), want):
                _same(o, w)
            assert_drained(eng)


def test_namespaces_and_top_logprobs(qwen3_next_dense_path, ref):
    ids = _ids(60, 80)
    params = _greedy(5, top_logprobs_num=3)
    want = ref.generate(input_ids=ids, sampling_params=params, return_logprob=True)
    with Engine(qwen3_next_dense_path, max_total_tokens=1024, max_state_slots=16, max_running_requests=4,
                chunked_prefill_size=512, debug_checks=True) as eng:
        seen = []
        for ns in ("a", "b", "a", None, ("t", 1), "b"):
            out = eng.generate(input_ids=ids, sampling_params=params, return_logprob=True, namespace=ns)
            _same(out, want)
            for got, exp in zip(out["meta_info"]["output_top_logprobs"], want["meta_info"]["output_top_logprobs"]):
                assert [t for _, t in got] == [t for _, t in exp]
                assert all(abs(x - y) < TOL for (x, _), (y, _) in zip(got, exp))
            seen.append(out["meta_info"]["cached_tokens"])
        assert seen == [0, 0, 59, 0, 0, 59]
        assert_drained(eng)


def test_stream_closed_early_aborts_and_frees(qwen3_next_dense_path):
    with Engine(qwen3_next_dense_path, max_total_tokens=2048, max_state_slots=16, max_running_requests=4,
                chunked_prefill_size=64, debug_checks=True) as eng:
        stream = eng.generate(input_ids=_ids(100, 90), sampling_params=_greedy(1000), stream=True)
        assert next(stream)["output_ids"]
        stream.close()
        assert_drained(eng)
        assert eng.get_stats()["num_generated_tokens"] < 1000

        async def main():
            s = await eng.async_generate(input_ids=_ids(100, 91), sampling_params=_greedy(1000), stream=True)
            async for chunk in s:
                assert chunk["output_ids"]
                break
            await s.aclose()
            # keep the loop alive until the engine has handled the abort (it calls back into it)
            while not eng._inbox.empty() or eng.scheduler.has_work():
                await asyncio.sleep(0.01)

        asyncio.run(main())
        assert_drained(eng)
        assert eng._thread.is_alive()
        assert eng.get_stats()["num_generated_tokens"] < 2000


# --- regressions for bugs this file found ------------------------------------------------------


def test_checkpoints_beyond_the_state_pool_do_not_block_admission(qwen3_next_dense_path):
    """More checkpoints than state slots: checkpoints are best effort, admission must not wait for
    them (it used to require one slot per checkpoint and blocked the queue forever)."""
    with Engine(qwen3_next_dense_path, max_total_tokens=2048, max_state_slots=4, max_running_requests=2,
                chunked_prefill_size=512, debug_checks=True) as eng:
        done: dict = {}
        th = threading.Thread(daemon=True, target=lambda: done.setdefault("outs", eng.generate(
            input_ids=[_ids(60, 1), _ids(30, 2)], sampling_params=_greedy(4), checkpoints=[[10, 20, 30, 40], []])))
        th.start()
        th.join(timeout=30)
        assert "outs" in done, f"requests never admitted: {eng.get_stats()}"
        assert [o["meta_info"]["finish_reason"]["type"] for o in done["outs"]] == ["length", "length"]
        assert_drained(eng)


def test_a_consumer_on_a_closed_event_loop_loses_only_its_request(qwen3_next_dense_path):
    """A stream's asyncio loop closes before its request ends: delivering to it fails. That must
    abort that request only; the scheduler thread lives on and serves the next request."""
    with Engine(qwen3_next_dense_path, max_total_tokens=2048, max_state_slots=16, max_running_requests=4,
                debug_checks=True) as eng:
        runner = eng.scheduler.runner
        real, gate = runner.forward_decode, threading.Event()
        runner.forward_decode = lambda reqs, loc: (gate.wait(10), real(reqs, loc))[1]
        loop = asyncio.new_event_loop()
        stream = loop.run_until_complete(eng.async_generate(
            input_ids=_ids(20, 3), sampling_params=_greedy(500), stream=True))
        loop.run_until_complete(stream.__anext__())
        loop.run_until_complete(stream.aclose())
        loop.close()
        gate.set()
        runner.forward_decode = real
        out = eng.generate(input_ids=_ids(20, 4), sampling_params=_greedy(4))
        assert eng._thread.is_alive()
        assert out["meta_info"]["finish_reason"]["type"] == "length"
        assert_drained(eng)
