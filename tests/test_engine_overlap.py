"""The overlap schedule (``overlap_schedule``): a decode step is launched before the previous step's
tokens are read, fed those tokens on the device. It must change no output: the same workload with it
on and off gives the same tokens and logprobs (within 1e-4, up to each request's first floating-point
tie), across admissions, stop-token finishes it can only see one step late, seeded sampling with
penalties, aborts, eviction and retraction — and with the prefix cache on against off. On CPU the
device is synchronous, so nothing overlaps in time; the schedule's bookkeeping is what is tested.
"""

from __future__ import annotations

import random

import pytest

from hyla import Engine
from test_engine_differential import SHORT, assert_drained, assert_exercised, compare_outputs, differential

OPTS = dict(max_total_tokens=1536, max_state_slots=24, max_running_requests=5, chunked_prefill_size=128,
            debug_checks=True)


def _workload(seed: int, vocab: int) -> list[dict]:
    """10 requests, half of them after a shared system prompt, of up to 15 new tokens."""
    rng = random.Random(seed)
    system = [rng.randrange(3, vocab) for _ in range(30)]
    specs = []
    for i in range(10):
        sp = {"max_new_tokens": rng.randrange(1, 16), "temperature": 0, "ignore_eos": True}
        if i % 4 == 1:  # seeded sampling with penalties: the draw reads output_ids up to the last token
            sp.update(temperature=0.8, top_p=0.9, seed=1000 + i, repetition_penalty=1.3, frequency_penalty=0.2)
        specs.append({"ids": (system if i % 2 else []) + [rng.randrange(3, vocab) for _ in range(rng.randrange(2, 50))],
                      "sp": sp})
    return specs


def _generate(engine: Engine, specs: list[dict]) -> list[dict]:
    return engine.generate(input_ids=[s["ids"] for s in specs], sampling_params=[s["sp"] for s in specs],
                           return_logprob=True)


def _with_stops(specs: list[dict], outs: list[dict]) -> list[dict]:
    """Every other request stops at a token it produced mid-way (a stop-token finish, which the
    overlap schedule only sees after it has fed that token)."""
    new = []
    for i, (s, o) in enumerate(zip(specs, outs)):
        ids = o["output_ids"]
        sp = dict(s["sp"])
        if i % 2 == 0 and len(ids) >= 3 and sp["temperature"] == 0:
            sp["stop_token_ids"] = [ids[len(ids) // 2]]
        new.append({"ids": s["ids"], "sp": sp})
    return new


def _two_turns(path, overlap: str, specs: list[dict], **kw) -> tuple[list[dict], list[dict], Engine]:
    with Engine(path, overlap_schedule=overlap, **{**OPTS, **kw}) as engine:
        assert engine.scheduler.config.overlap == (overlap == "on")
        out1 = _generate(engine, specs)
        turn2 = [{"ids": s["ids"] + o["output_ids"] + [5, 6, 7], "sp": {"max_new_tokens": 4, "temperature": 0}}
                 for s, o in zip(specs, out1)]
        out2 = _generate(engine, turn2)
        assert_drained(engine)
        assert (engine.get_stats()["num_overlapped_steps"] > 0) == (overlap == "on")
    return out1, out2, engine


@pytest.mark.parametrize("arch", ["qwen3_next_dense", "nemotron_h"])
def test_overlap_schedule_changes_no_output(arch, request):
    path = request.getfixturevalue(f"{arch}_path")
    base = _workload(3, 2048)
    with Engine(path, overlap_schedule="off", **OPTS) as probe:
        specs = _with_stops(base, _generate(probe, base))
    off1, off2, _ = _two_turns(path, "off", specs)
    on1, on2, _ = _two_turns(path, "on", specs)
    n = compare_outputs(on1 + on2, off1 + off2)
    assert n > 0.9 * sum(len(o["output_ids"]) for o in off1 + off2)
    for a, b in zip(on1, off1):  # seeded rows too (compare_outputs stops at a tie; they have none here)
        assert a["output_ids"] == b["output_ids"] and a["meta_info"]["finish_reason"] == b["meta_info"]["finish_reason"]
    stopped = [i for i, o in enumerate(off1) if o["meta_info"]["finish_reason"]["type"] == "stop"]
    assert len(stopped) >= 3
    # a stop-token finish met while the next step was already launched had its last token fed: the
    # next turn hits the whole first turn (prompt + output), one token more than without the overlap
    # (which pauses while requests wait for admission); length finishes are never fed past their end
    whole = 0
    for i, (s, o) in enumerate(zip(specs, off1)):
        full = len(s["ids"]) + len(o["output_ids"])
        assert off2[i]["meta_info"]["cached_tokens"] == full - 1
        hit = on2[i]["meta_info"]["cached_tokens"]
        assert hit == full - 1 or (hit == full and i in stopped), (i, hit, full)
        whole += hit == full
    assert whole >= 1


@pytest.mark.slow
@pytest.mark.parametrize("seed, kw", [(4, {}), (2, dict(page_size=16, max_total_tokens=544)),
                                      (5, dict(on=dict(enable_hierarchical_cache=True)))],
                         ids=["page1", "page16", "host_tier"])
def test_overlap_schedule_cache_differential_under_pressure(qwen3_next_dense_path, seed, kw):
    """The cache on/off differential (eviction and retraction; with pages of 16, decode checkpoints
    forked at commit; with the host tier, prefixes saved and loaded while steps are in flight) with the
    overlap schedule on both sides (``SHORT``'s workload and pools)."""
    opts = {**SHORT, **kw}
    done = differential(qwen3_next_dense_path, seed=seed, overlap_schedule="on", **opts)
    assert_exercised(done, opts["chunked_prefill_size"])
    assert done["stats"]["num_overlapped_steps"] > 0


@pytest.mark.gpu
def test_host_tier_cache_differential_on_cuda(qwen3_next_dense_path):
    """On CUDA (CUDA graphs, the overlap schedule): the host tier's copies between device and host
    pools, in the stream's order, change no output under pressure."""
    done = differential(qwen3_next_dense_path, seed=6, on=dict(enable_hierarchical_cache=True), device="cuda",
                        overlap_schedule="on", **SHORT)
    assert done["stats"]["num_host_loaded_tokens"] > 0 and done["stats"]["num_overlapped_steps"] > 0


def test_overlap_schedule_abort_in_flight(qwen3_next_dense_path):
    """Aborts arriving while a step is in flight: the aborted requests end with an abort reason, the
    others finish as without them, and nothing leaks."""
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 2048) for _ in range(rng.randrange(5, 40))] for _ in range(8)]
    sp = {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True}
    with Engine(qwen3_next_dense_path, overlap_schedule="off", **OPTS) as engine:
        ref = engine.generate(input_ids=prompts, sampling_params=sp, return_logprob=True)
    aborted = (1, 4)
    with Engine(qwen3_next_dense_path, overlap_schedule="on", **OPTS) as engine:
        streams = [engine.generate(input_ids=p, sampling_params=sp, stream=True, rid=f"req-{i}", return_logprob=True)
                   for i, p in enumerate(prompts)]
        firsts = {}
        for i in aborted:  # abort while the other requests decode (a step in flight)
            firsts[i] = next(streams[i])
            engine.abort(f"req-{i}")
        outs = []
        for i, it in enumerate(streams):
            chunks = ([firsts[i]] if i in firsts else []) + list(it)
            outs.append({"output_ids": sum((c["output_ids"] for c in chunks), []),
                         "finish_reason": chunks[-1]["meta_info"]["finish_reason"]})
        assert_drained(engine)
    for i, (o, r) in enumerate(zip(outs, ref)):
        if i in aborted:
            assert o["finish_reason"]["type"] == "abort"
            assert 0 < len(o["output_ids"]) < 40 and o["output_ids"] == r["output_ids"][:len(o["output_ids"])]
        else:
            assert o["output_ids"] == r["output_ids"]


def test_overlap_schedule_option(qwen3_next_dense_path):
    with pytest.raises(ValueError, match="overlap_schedule"):
        Engine(qwen3_next_dense_path, overlap_schedule="yes")
    with Engine(qwen3_next_dense_path, max_total_tokens=512) as engine:  # auto: CUDA fused decode only
        assert engine.scheduler.config.overlap is False
        assert "overlap" not in engine.summary()
    with Engine(qwen3_next_dense_path, max_total_tokens=512, overlap_schedule="on",
                speculative_algorithm="ngram") as engine:  # speculation keeps the ordinary schedule
        assert engine.scheduler.config.overlap is False


def test_overlap_schedule_internal_error_keeps_finished_outputs(qwen3_next_dense_path):
    """An internal error while a finished request waits for the step that fed its last token: it is
    delivered as it finished (its stop reason), the others are aborted, and nothing leaks."""
    rng = random.Random(8)
    prompts = [[rng.randrange(3, 2048) for _ in range(rng.randrange(5, 30))] for _ in range(4)]
    sp = {"max_new_tokens": 30, "temperature": 0, "ignore_eos": True}
    with Engine(qwen3_next_dense_path, overlap_schedule="off", **OPTS) as engine:
        ref = engine.generate(input_ids=prompts, sampling_params=sp)
    stop = ref[0]["output_ids"][5]
    sps = [{**sp, "stop_token_ids": [stop]}] + [sp] * 3
    with Engine(qwen3_next_dense_path, overlap_schedule="on", **OPTS) as engine:
        sched = engine.scheduler
        draw = sched.output.draw
        failed = []

        def flaky(reqs, logits):
            if any(r.finished for r in sched.running) and not failed:  # one is held: fail this step
                failed.append(True)
                raise RuntimeError("injected")
            return draw(reqs, logits)

        sched.output.draw = flaky
        outs = engine.generate(input_ids=prompts, sampling_params=sps)
        assert_drained(engine)
    assert failed
    assert outs[0]["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert outs[0]["output_ids"] == ref[0]["output_ids"][:ref[0]["output_ids"].index(stop) + 1]
    assert all(o["meta_info"]["finish_reason"]["type"] == "abort" for o in outs[1:])


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["qwen3_5_path", "qwen3_5_moe_path"])
def test_overlapped_step_never_waits_for_the_device(arch, request, monkeypatch):
    """On CUDA, nothing between drawing a step's tokens and launching the next step may synchronize
    the stream (else the host waits for the step it meant to overlap): the overlapped steps run with
    PyTorch's sync debug mode set to raise, except while the tokens are read (``complete``). With
    MoE layers too, in the graphs: decode steps of 1 request run their experts gathered, larger ones
    grouped (``SparseMoE.path``, at a gather cap of 4 pairs here)."""
    from hyla.model.layers import sparse_moe

    monkeypatch.setattr(sparse_moe, "GATHER_MAX_ASSIGNMENTS", 4)
    opts = dict(device="cuda", dtype="bfloat16", max_total_tokens=2048, max_state_slots=32, max_running_requests=8)
    with Engine(request.getfixturevalue(arch), **opts) as engine:
        sched = engine.scheduler
        assert sched.config.overlap and sched.runner.graphs is not None
        _strict_overlapped_steps(sched, monkeypatch)
        rng = random.Random(2)
        prompts = [[rng.randrange(3, 2048) for _ in range(rng.randrange(5, 40))] for _ in range(6)]
        sps = [{"max_new_tokens": 24, "temperature": 0.0 if i % 2 else 0.7, "seed": i, "top_p": 0.9,
                "ignore_eos": True} for i in range(6)]
        outs = engine.generate(input_ids=prompts, sampling_params=sps)
        assert all(len(o["output_ids"]) == 24 for o in outs)
        assert engine.get_stats()["num_overlapped_steps"] > 10


@pytest.mark.gpu
def test_host_tier_saves_never_wait_for_the_device(qwen3_5_path, monkeypatch):
    """On CUDA, an overlapped decode step that evicts cached prefixes saves them into the host tier
    without synchronizing the stream (the saves' rows land later, ``HostCache``): the decode steps of
    4 long requests on a KV pool that 12 finished ones filled evict them, under the sync debug mode
    of :func:`_strict_overlapped_steps`; the prefixes then come back from the host (exactly:
    ``test_host_tier_cache_differential_on_cuda``)."""
    opts = dict(device="cuda", dtype="bfloat16", max_total_tokens=1024, max_state_slots=32, max_running_requests=4,
                enable_hierarchical_cache=True)
    with Engine(qwen3_5_path, **opts) as engine:
        sched, host = engine.scheduler, engine.scheduler.cache.host
        assert sched.config.overlap and host.defer
        strict = _strict_overlapped_steps(sched, monkeypatch)
        saves, failures = [], []

        def save(node):  # (the tree's hook: it logs what a save raises and goes on, so the failure is kept here)
            saves.append(strict[0])
            try:
                host.save(node)
            except Exception as e:
                failures.append(e)
                raise

        monkeypatch.setattr(host.device_tree, "on_evict", save)
        rng = random.Random(3)
        first = [[rng.randrange(3, 2048) for _ in range(60)] for _ in range(12)]
        greedy = {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True}
        engine.generate(input_ids=first, sampling_params=greedy)
        long = [[rng.randrange(3, 2048) for _ in range(20)] for _ in range(4)]
        engine.generate(input_ids=long, sampling_params={**greedy, "max_new_tokens": 100})
        assert any(saves), "no save ran inside an overlapped step"
        assert not failures, failures[0]
        again = engine.generate(input_ids=first, sampling_params=greedy)
        assert engine.get_stats()["num_host_hit_tokens"] > 0 and all(len(o["output_ids"]) == 4 for o in again)


def _strict_overlapped_steps(sched, monkeypatch) -> list[bool]:
    """Run ``sched``'s overlapped steps with PyTorch's sync debug mode set to raise, except where a step
    means to wait: while it reads its tokens (``complete``) and lands the host tier's saves after it
    launched the next step (``land_host_saves``). Returns a flag list whose one item says whether the
    strict mode is on now."""
    import torch

    on = [False]

    def strict(fn, mode: str):
        def run(*a, **k):
            before = on[0]
            torch.cuda.set_sync_debug_mode(mode)
            on[0] = mode == "error"
            try:
                return fn(*a, **k)
            finally:
                torch.cuda.set_sync_debug_mode("error" if before else "default")
                on[0] = before
        return run

    monkeypatch.setattr(sched, "_step_overlapped", strict(sched._step_overlapped, "error"))
    monkeypatch.setattr(sched.output, "complete", strict(sched.output.complete, "default"))
    monkeypatch.setattr(sched.cache, "land_host_saves", strict(sched.cache.land_host_saves, "default"))
    return on
