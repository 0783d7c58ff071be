"""Differential exactness: the same workload with the prefix cache on and off gives the same greedy
tokens and logprobs within 1e-4 — with pools so small that eviction and retraction happen — and
after the engine drains every KV and state slot is free or held by the tree.

Comparison rule (DEVELOPERS.md): each request is compared up to its first floating-point tie — a
position where the two runs chose different tokens whose logprobs are within 1e-4 of each other.
"""

from __future__ import annotations

import random

import pytest

from hyla import Engine

TOL = 1e-4


def join_stream(chunks: list[dict]) -> dict:
    """A streamed request's chunks as one output (``output_ids`` and ``output_token_logprobs``
    joined, its id), for :func:`compare_outputs`."""
    return {"output_ids": [t for c in chunks for t in c["output_ids"]],
            "meta_info": {"id": chunks[0]["meta_info"]["id"], "output_token_logprobs": [
                lp for c in chunks for lp in c["meta_info"]["output_token_logprobs"]]}}


def compare_outputs(on: list[dict], off: list[dict]) -> int:
    """Assert equality up to each request's first tie; returns the number of tokens compared."""
    compared = 0
    for a, b in zip(on, off, strict=True):
        la = a["meta_info"]["output_token_logprobs"]
        lb = b["meta_info"]["output_token_logprobs"]
        for (lpa, ta, _), (lpb, tb, _) in zip(la, lb):
            if ta != tb:
                assert abs(lpa - lpb) < TOL, f"{a['meta_info']['id']}: diverged ({ta} vs {tb}) without a tie"
                break
            assert abs(lpa - lpb) < TOL, f"{a['meta_info']['id']}: logprob {lpa} vs {lpb}"
            compared += 1
        else:
            assert len(la) == len(lb)
    return compared


def make_workload(seed: int, vocab: int, num_sessions: int, num_shared: int) -> tuple[list, list]:
    """Wave 1: first turns of chat sessions (each with a system prompt shared by a group) and
    shared-prefix requests; wave 2 (built from wave-1 outputs): second turns."""
    rng = random.Random(seed)
    tok = lambda n: [rng.randrange(3, vocab) for _ in range(n)]  # noqa: E731
    systems = [tok(rng.randrange(20, 90)) for _ in range(4)]
    docs = [tok(rng.randrange(60, 200)) for _ in range(3)]
    wave1 = []
    for i in range(num_sessions):
        sys_ids = systems[i % len(systems)]
        long_output = i % 8 == 0  # outlives the scheduler's decode reserve: forces retraction
        wave1.append({"ids": sys_ids + tok(rng.randrange(5, 120)),
                      "max_new": rng.randrange(30, 48) if long_output else rng.randrange(2, 12),
                      "ckpt": [len(sys_ids)] if i % 3 == 0 else []})
    for i in range(num_shared):
        doc = docs[i % len(docs)]
        wave1.append({"ids": doc + tok(rng.randrange(1, 40)), "max_new": rng.randrange(1, 10), "ckpt": []})
    followups = [tok(rng.randrange(3, 60)) for _ in range(num_sessions)]
    return wave1, followups


def run(engine: Engine, specs: list[dict]) -> list[dict]:
    return engine.generate(
        input_ids=[s["ids"] for s in specs],
        sampling_params=[{"temperature": 0, "max_new_tokens": s["max_new"], "ignore_eos": True} for s in specs],
        checkpoints=[s["ckpt"] for s in specs],
        return_logprob=True,
    )


def assert_drained(engine: Engine) -> None:
    engine.wait_idle()
    engine.check_integrity()
    kv, st = engine.kv_pool, engine.state_pool
    tree = engine.tree
    held_kv = tree.total_size() if tree is not None else 0
    held_states = tree.num_checkpoints() if tree is not None else 0
    assert kv.available_size() + held_kv == kv.size
    assert st.available_size() + held_states == st.size


def differential(path: str, seed: int, on: dict | None = None, **engine_kw) -> None:
    """``on``: options of the cached side only (a scheduling feature checked against the plain reference)."""
    opts = dict(max_total_tokens=1200, max_state_slots=20, max_running_requests=8,
                chunked_prefill_size=128, debug_checks=True)
    opts.update(engine_kw)
    vocab = 2048
    wave1, followups = make_workload(seed, vocab, num_sessions=48, num_shared=48)
    with Engine(path, enable_prefix_cache=False, **opts) as off:
        out1_off = run(off, wave1)
        wave2 = [{"ids": w["ids"] + o["output_ids"] + f, "max_new": 4, "ckpt": []}
                 for w, o, f in zip(wave1, out1_off, followups)]
        out2_off = run(off, wave2)
        assert_drained(off)
        retract_off = off.get_stats()["num_retractions"]
    with Engine(path, enable_prefix_cache=True, **{**opts, **(on or {})}) as engine:
        out1_on = run(engine, wave1)
        out2_on = run(engine, wave2)
        assert_drained(engine)
        stats = engine.get_stats()
    n = compare_outputs(out1_on + out2_on, out1_off + out2_off)
    assert n > 0.9 * sum(s["max_new"] for s in wave1 + wave2)  # ties are rare, not the rule
    # the workload really exercised the cache, eviction and retraction
    assert stats["num_cached_tokens"] > 0.3 * stats["num_prompt_tokens"]
    assert stats["num_retractions"] > 0 or retract_off > 0
    assert stats["num_evicted_tokens"] > 0 and stats["num_evicted_states"] > 0
    if (on or {}).get("enable_mixed_chunk"):
        assert stats["num_mixed_tokens"] > 0


# The differential on every architecture's tiny checkpoint: (checkpoint fixture, workload seed, engine options)
DIFFERENTIALS = [
    pytest.param("qwen3_next_dense", 1, {}, id="qwen3_next"),
    pytest.param("qwen3_next_dense", 2, dict(page_size=16, max_total_tokens=1280), id="qwen3_next_paged"),
    pytest.param("qwen3_next_dense", 4, dict(schedule_policy="fcfs", checkpoint_alignment=16), id="fcfs_aligned"),
    # decoding requests fed in prefill steps, through the extend kernels (against the unmixed, uncached run)
    pytest.param("qwen3_next_dense", 12, dict(on=dict(enable_mixed_chunk=True)), id="mixed_chunk"),
    pytest.param("nemotron_h", 3, {}, id="nemotron_h"),
    # every Falcon-H1 layer holds KV and a state: both pools and the tree's checkpoints per layer
    pytest.param("falcon_h1", 5, {}, id="falcon_h1"),
    pytest.param("bamba", 6, {}, id="bamba"),
    pytest.param("granite_h", 7, {}, id="granite_h"),
    pytest.param("qwen3_5_moe", 8, {}, id="qwen3_5_moe"),
    # conv-only states: checkpoints, forks and copies of the conv windows, empty SSM buffers
    pytest.param("lfm2", 9, {}, id="lfm2"),
    # KDA states (per-channel decay) checkpointed at any position; MLA's latent cached half in K, half in V
    pytest.param("kimi_linear", 10, {}, id="kimi_linear"),
]


@pytest.mark.slow
@pytest.mark.parametrize("checkpoint, seed, engine_kw", DIFFERENTIALS)
def test_differential(checkpoint, seed, engine_kw, request):
    differential(request.getfixturevalue(f"{checkpoint}_path"), seed=seed, **engine_kw)
