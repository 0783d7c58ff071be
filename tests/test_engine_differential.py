"""Differential exactness: the same workload with the prefix cache on and off gives the same greedy
tokens and logprobs within 1e-4 — with pools so small that eviction and retraction happen — and
after the engine drains every KV and state slot is free or held by the tree.

Comparison rule (DEVELOPERS.md): each request is compared up to its first floating-point tie — a
position where the two runs chose different tokens whose logprobs are within 1e-4 of each other.

A float8 KV cache (``kv_cache_dtype``) is compared within ``FP8_KV_TOL``: rounding K and V to e4m3 (a
step of 1/8 to 1/16 of a value) turns fp32's batch-dependent last bits into a whole step wherever a value
lies near a rounding boundary. The engine with the cache *off* shows it by itself: the same workload
run with one request at a time against eight differs in the chosen tokens' logprobs by up to 2.3e-3
(Qwen3-Next; in fp32 KV 6.9e-6) and 8.7e-3 (Lara-4-Mini, 5.3e-6), and cache on against off by the same
2.3e-3 and 8.7e-3 (``docs/engine.md``, KV cache dtype).
"""

from __future__ import annotations

import random
import time
from typing import Callable

import pytest

from hyla import Engine
from hyla.engine.scheduler import Scheduler

TOL = 1e-4
FP8_KV_TOL = 3e-2  # a float8 KV cache's batch-dependent rounding: up to 8.7e-3 with the cache off alone


def join_stream(chunks: list[dict]) -> dict:
    """A streamed request's chunks as one output (``output_ids`` and ``output_token_logprobs``
    joined, its id), for :func:`compare_outputs`."""
    return {"output_ids": [t for c in chunks for t in c["output_ids"]],
            "meta_info": {"id": chunks[0]["meta_info"]["id"], "output_token_logprobs": [
                lp for c in chunks for lp in c["meta_info"]["output_token_logprobs"]]}}


def compare_outputs(on: list[dict], off: list[dict], tol: float = TOL) -> int:
    """Assert equality up to each request's first tie (chosen-token logprobs within ``tol``: fp32's
    1e-4 by default); returns the number of tokens compared."""
    compared = 0
    for a, b in zip(on, off, strict=True):
        la = a["meta_info"]["output_token_logprobs"]
        lb = b["meta_info"]["output_token_logprobs"]
        for (lpa, ta, _), (lpb, tb, _) in zip(la, lb):
            if ta != tb:
                assert abs(lpa - lpb) < tol, f"{a['meta_info']['id']}: diverged ({ta} vs {tb}) without a tie"
                break
            assert abs(lpa - lpb) < tol, f"{a['meta_info']['id']}: logprob {lpa} vs {lpb}"
            compared += 1
        else:
            assert len(la) == len(lb)
    return compared


def make_workload(seed: int, vocab: int, num_sessions: int, num_shared: int,
                  scale: float = 1.0) -> tuple[list, list]:
    """Wave 1: first turns of chat sessions (each with a system prompt shared by a group) and
    shared-prefix requests; wave 2 (built from wave-1 outputs): second turns. ``scale``: every
    prompt part's length range scaled by it (1: the same workload as ever for a seed)."""
    rng = random.Random(seed)
    tok = lambda n: [rng.randrange(3, vocab) for _ in range(n)]  # noqa: E731
    length = lambda lo, hi: rng.randrange(max(1, round(lo * scale)), max(2, round(hi * scale)))  # noqa: E731
    systems = [tok(length(20, 90)) for _ in range(4)]
    docs = [tok(length(60, 200)) for _ in range(3)]
    wave1 = []
    for i in range(num_sessions):
        sys_ids = systems[i % len(systems)]
        long_output = i % 8 == 0  # outlives the scheduler's decode reserve: forces retraction
        wave1.append({"ids": sys_ids + tok(length(5, 120)),
                      "max_new": rng.randrange(30, 48) if long_output else rng.randrange(2, 12),
                      "ckpt": [len(sys_ids)] if i % 3 == 0 else []})
    for i in range(num_shared):
        doc = docs[i % len(docs)]
        wave1.append({"ids": doc + tok(length(1, 40)), "max_new": rng.randrange(1, 10), "ckpt": []})
    followups = [tok(length(3, 60)) for _ in range(num_sessions)]
    return wave1, followups


def run(engine: Engine, specs: list[dict]) -> list[dict]:
    return engine.generate(
        input_ids=[s["ids"] for s in specs],
        sampling_params=[{"temperature": 0, "max_new_tokens": s["max_new"], "ignore_eos": True} for s in specs],
        checkpoints=[s["ckpt"] for s in specs],
        return_logprob=True,
    )


def assert_drained(engine: Engine, timeout: float = 60) -> None:
    """Idle, consistent, and every slot free, cached in the tree or reserved for speculation."""
    engine.wait_idle(timeout=timeout)
    engine.check_integrity()
    kv, st, tree = engine.kv_pool, engine.state_pool, engine.tree
    cached_kv, cached_states = (tree.total_size(), tree.num_checkpoints()) if tree is not None else (0, 0)
    assert kv.available_size() + cached_kv + engine.cache.num_reserved_tokens == kv.size
    assert st.available_size() + cached_states + engine.cache.num_reserved_states == st.size
    assert engine.req_to_token.available_size() == engine.max_running_requests + 1
    assert not engine.scheduler.running and not engine.scheduler.waiting


def hold_for_next_submission(engine: Engine, when: Callable[[Scheduler], bool]) -> None:
    """The first step before which ``when(engine.scheduler)`` holds waits (up to 60 s) for the next
    submission to ``engine``: what the test thread submits then is admitted right after that one
    step, however slowly the thread runs (so requests meant to be running then need decode only a
    few tokens more, not enough to outlive any delay). Once only."""
    sched = engine.scheduler
    step = sched.step
    armed = [True]

    def held():
        if armed[0] and when(sched):
            armed[0] = False
            deadline = time.monotonic() + 60
            # (submitted: in the engine's inbox, or already taken from it into the waiting queue)
            while engine._inbox.empty() and not sched.waiting and time.monotonic() < deadline:
                time.sleep(0.001)
        return step()

    sched.step = held


def count_prefill_chunks(engine: Engine) -> dict[str, int]:
    """Start recording how many prefill steps (chunks) each of ``engine``'s requests took to feed
    its prompt: the returned dict maps a request id to its most chunks in one admission (a
    retracted request is prefilled again; a mixed step's decoding requests are not counted)."""
    most: dict[str, int] = {}
    current: dict[str, tuple[int, int]] = {}  # per request: (chunks so far, where the last one ended)
    sched = engine.scheduler
    schedule_prefill = sched._schedule_prefill

    def counted():
        batch = schedule_prefill()
        if batch is not None:
            for r, n in zip(batch.reqs[:len(batch.reqs) - batch.num_mixed], batch.lens):
                k, end = current.get(r.rid, (0, -1))
                k = k + 1 if end == r.kv_len else 1  # r.kv_len: where this chunk starts
                current[r.rid] = (k, r.kv_len + n)
                most[r.rid] = max(most.get(r.rid, 0), k)
        return batch

    sched._schedule_prefill = counted
    return most


def differential(path: str, seed: int, on: dict | None = None, *, num_sessions: int = 48, num_shared: int = 48,
                 scale: float = 1.0, **engine_kw) -> dict:
    """``on``: options of the cached side only (a scheduling feature checked against the plain reference).
    ``num_sessions``, ``num_shared``, ``scale``: the workload's (:func:`make_workload`). Returns what
    the cached side did, for the caller to check the conditions it is about: ``stats``
    (``get_stats``), the cached tokens of each wave's requests (``hits1``, ``hits2``), the wave-1
    prompts' lengths (``prompt_lens``) and the chunks each request's prefill took (``prefill_chunks``)."""
    opts = dict(max_total_tokens=1200, max_state_slots=20, max_running_requests=8,
                chunked_prefill_size=128, debug_checks=True)
    opts.update(engine_kw)
    vocab = 2048
    wave1, followups = make_workload(seed, vocab, num_sessions=num_sessions, num_shared=num_shared, scale=scale)
    with Engine(path, enable_prefix_cache=False, **opts) as off:
        out1_off = run(off, wave1)
        wave2 = [{"ids": w["ids"] + o["output_ids"] + f, "max_new": 4, "ckpt": []}
                 for w, o, f in zip(wave1, out1_off, followups)]
        out2_off = run(off, wave2)
        assert_drained(off)
        retract_off = off.get_stats()["num_retractions"]
    with Engine(path, enable_prefix_cache=True, **{**opts, **(on or {})}) as engine:
        prefill_chunks = count_prefill_chunks(engine)
        out1_on = run(engine, wave1)
        out2_on = run(engine, wave2)
        assert_drained(engine)
        stats = engine.get_stats()
        stateful = engine.model_config.num_linear_layers > 0  # (a model with no linear layer caches KV alone)
    tol = FP8_KV_TOL if opts.get("kv_cache_dtype", "auto") != "auto" else TOL
    n = compare_outputs(out1_on + out2_on, out1_off + out2_off, tol)
    assert n > 0.9 * sum(s["max_new"] for s in wave1 + wave2)  # ties are rare, not the rule
    # the workload really exercised the cache, eviction and retraction
    assert stats["num_cached_tokens"] > 0.3 * stats["num_prompt_tokens"]
    assert stats["num_retractions"] > 0 or retract_off > 0
    assert stats["num_evicted_tokens"] > 0 and (stats["num_evicted_states"] > 0 or not stateful)
    if (on or {}).get("enable_mixed_chunk"):
        assert stats["num_mixed_tokens"] > 0
    if (on or {}).get("enable_hierarchical_cache"):  # prefixes came back from host memory
        assert stats["num_host_hit_tokens"] > 0 and stats["num_host_loaded_tokens"] > 0
    return {"stats": stats, "hits1": [o["meta_info"]["cached_tokens"] for o in out1_on],
            "hits2": [o["meta_info"]["cached_tokens"] for o in out2_on],
            "prompt_lens": [len(w["ids"]) for w in wave1], "prefill_chunks": prefill_chunks}


def assert_exercised(done: dict, chunk: int) -> None:
    """What a shortened :func:`differential` must still have done (``done``: its result; ``chunk``:
    the engine's ``chunked_prefill_size``): a first turn hit a checkpoint taken inside a prefill
    chunk (a system prompt's end, a branch point: not a chunk boundary), a second turn continued
    from its whole first turn (multi-turn reuse), and prompts were prefilled in 3 chunks or more."""
    assert any(h % chunk for h in done["hits1"] if h), done["hits1"]
    assert any(h >= n for h, n in zip(done["hits2"], done["prompt_lens"])), done["hits2"]
    assert max(done["prefill_chunks"].values()) >= 3


# The workload and pools of the tests' differentials: 40 first turns (16 chat sessions, 24 requests
# sharing 3 documents; prompts of up to ~120 tokens) and 16 second turns (up to ~150), prefilled
# in chunks of 64 on a 500-token KV pool with 16 state slots — enough for hits inside chunks, second
# turns continuing their first, prompts of 3 chunks, KV and checkpoint evictions and retraction
# (``differential`` and ``assert_exercised`` check that they happened).
SHORT = dict(num_sessions=16, num_shared=24, scale=0.5, max_total_tokens=500, max_state_slots=16,
             chunked_prefill_size=64)

# The differential on every architecture's tiny checkpoint: (checkpoint fixture, workload seed, engine options)
DIFFERENTIALS = [
    pytest.param("qwen3_next_dense", 1, {}, id="qwen3_next"),
    pytest.param("qwen3_next_dense", 2, dict(page_size=16, max_total_tokens=544), id="qwen3_next_paged"),
    pytest.param("qwen3_next_dense", 4, dict(schedule_policy="fcfs", checkpoint_alignment=16), id="fcfs_aligned"),
    # decoding requests fed in prefill steps, through the extend kernels (against the unmixed, uncached run)
    pytest.param("qwen3_next_dense", 12, dict(on=dict(enable_mixed_chunk=True)), id="mixed_chunk"),
    # the host tier: evicted prefixes (KV and checkpoints) saved to host memory and loaded back on a hit
    pytest.param("qwen3_next_dense", 24, dict(on=dict(enable_hierarchical_cache=True)), id="hierarchical"),
    pytest.param("qwen3_next_dense", 25, dict(page_size=16, max_total_tokens=544,
                                              on=dict(enable_hierarchical_cache=True, hicache_ratio=0.5)),
                 id="hierarchical_paged_small_host"),
    pytest.param("nemotron_h", 3, {}, id="nemotron_h"),
    # every Falcon-H1 layer holds KV and a state: both pools and the tree's checkpoints per layer
    pytest.param("falcon_h1", 5, {}, id="falcon_h1"),
    pytest.param("bamba", 6, {}, id="bamba"),
    pytest.param("granite_h", 7, {}, id="granite_h"),
    pytest.param("qwen3_5_moe", 8, {}, id="qwen3_5_moe"),
    # conv-only states: checkpoints, forks and copies of the conv windows, empty SSM buffers
    pytest.param("lfm2", 9, {}, id="lfm2"),
    # LFM2's conv windows with sigmoid-routed MoE layers (expert bias, renormalised, scaled)
    pytest.param("lfm2_moe", 17, {}, id="lfm2_moe"),
    # KDA states (per-channel decay) checkpointed at any position; MLA's latent cached half in K, half in V
    pytest.param("kimi_linear", 10, dict(max_total_tokens=450), id="kimi_linear"),  # (at 500 it retracts nothing)
    # Ling 3: KDA's bounded decay, MLA's RoPE'd k_pe in the cached latent
    pytest.param("bailing_hybrid", 18, dict(max_total_tokens=450), id="bailing_hybrid"),
    # OLMo-Hybrid: Gated DeltaNet with beta up to 2, post-norm NoPE attention
    pytest.param("olmo_hybrid", 20, {}, id="olmo_hybrid"),
    # Lara-4-Mini: sliding-window attention (a window of 6: every request runs past it) beside global NoPE attention
    pytest.param("lara_mini", 21, {}, id="lara_mini"),
    # LFM3: conv windows, sliding-window attention and global attention with proportional RoPE, sandwich norms
    pytest.param("lfm3", 22, {}, id="lfm3"),
    # Zamba2: hybrid layers (KV and a state each) running weight-shared attention blocks on [x | embeddings]
    pytest.param("zamba2", 23, dict(max_total_tokens=450), id="zamba2"),  # (at 500 it retracts nothing)
    # Mamba1 states (a decay per channel and state) checkpointed at any position; attention without RoPE
    pytest.param("jamba", 13, {}, id="jamba"),
    # MiniMax: lightning attention (a fixed decay per head, no conv window) beside RoPE attention, scaled post-norm
    # residuals, a MoE in every layer
    pytest.param("minimax", 32, dict(max_total_tokens=450), id="minimax"),
    # a model with no linear layer (a hybrid architecture's layout of attention alone): its tree holds KV alone, every
    # prefix usable; pages of 16 and the host tier
    pytest.param("qwen3_next_attention", 33, dict(page_size=16, max_total_tokens=448,
                                                  on=dict(enable_hierarchical_cache=True)), id="attention_only"),
    # pure state-space models: no KV at all (the tree's pages hold token ids only), every hit a state checkpoint
    pytest.param("mamba", 14, {}, id="mamba"),
    pytest.param("falcon_mamba", 15, {}, id="falcon_mamba"),
    pytest.param("mamba2", 16, {}, id="mamba2"),
    pytest.param("mamba2", 26, dict(on=dict(enable_hierarchical_cache=True)), id="mamba2_hierarchical"),
    # float8 KV (kv_cache_dtype) on both sides: written rounded, read widened, so a hit reads what a prefill wrote;
    # moved to the host tier and back as bytes (pages of 16); MLA's latent halves; sliding-window layers; e5m2
    pytest.param("qwen3_next_dense", 28, dict(kv_cache_dtype="fp8", page_size=16, max_total_tokens=544,
                                              on=dict(enable_hierarchical_cache=True)), id="fp8_kv_hierarchical_paged"),
    pytest.param("kimi_linear", 29, dict(kv_cache_dtype="fp8", max_total_tokens=450), id="kimi_linear_fp8_kv"),
    pytest.param("lara_mini", 21, dict(kv_cache_dtype="fp8"), id="lara_mini_fp8_kv"),
    pytest.param("qwen3_next_dense", 31, dict(kv_cache_dtype="fp8_e5m2"), id="fp8_e5m2_kv"),
]


@pytest.mark.slow
@pytest.mark.parametrize("checkpoint, seed, engine_kw", DIFFERENTIALS)
def test_differential(checkpoint, seed, engine_kw, request):
    opts = {**SHORT, **engine_kw}
    done = differential(request.getfixturevalue(f"{checkpoint}_path"), seed=seed, **opts)
    assert_exercised(done, opts["chunked_prefill_size"])


@pytest.mark.slow
@pytest.mark.parametrize("seed, engine_kw, host_kw, each_step", [
    (26, {}, {}, True), (27, dict(page_size=16, max_total_tokens=544), dict(hicache_ratio=0.5), False)],
    ids=["tokens", "paged_small_host_landing_late"])
def test_hierarchical_differential_with_saves_in_flight(qwen3_next_dense_path, seed, engine_kw, host_kw, each_step,
                                                        monkeypatch):
    """The host tier's saves deferred, as from a CUDA device (``HostCache(defer=True)``): landing after
    each step is launched, or (``each_step`` off) only when a load reads their rows — a CPU's copies
    are never done by themselves — so that the host reuses rows of saves still in flight and loads
    land what they read first; under the differential's pressure."""
    from hyla.cache import HostCache
    from hyla.engine.cache_manager import CacheManager

    build, stage, most = HostCache.from_layout.__func__, HostCache._stage, [0]

    def staging(self, *a):
        stage(self, *a)
        most[0] = max(most[0], self.num_in_flight)

    monkeypatch.setattr(HostCache, "from_layout", classmethod(lambda cls, *a, **k: build(cls, *a, **k, defer=True)))
    monkeypatch.setattr(HostCache, "_stage", staging)
    if not each_step:
        monkeypatch.setattr(CacheManager, "land_host_saves", lambda self: None)
    done = differential(qwen3_next_dense_path, seed=seed, on=dict(enable_hierarchical_cache=True, **host_kw),
                        **{**SHORT, **engine_kw})
    assert_exercised(done, SHORT["chunked_prefill_size"])
    assert most[0] > (3 if each_step else 10)  # saves were in flight together
