"""Speculative decoding: exact with the prefix cache on, under pressure, for every architecture.

The differential rule is the cache's: speculation on vs off gives the same greedy tokens and
logprobs within 1e-4 up to each request's first floating-point tie. A random tiny model rarely
repeats itself, so besides the real n-gram drafter the engine tests plug an *oracle* drafter that
proposes the reference continuation with deterministic corruptions: every verify step then mixes
full acceptance, partial acceptance, rejection at the first draft and zero-draft steps.
"""

from __future__ import annotations

import math
import random
import shutil

import pytest
import torch

from hyla import Engine
from hyla.cache import KVPool, ReqToTokenPool, StatePool
from hyla.engine.cache_manager import CacheManager
from hyla.engine.request import Req
from hyla.engine.sampling_params import SamplingParams
from hyla.engine.speculative import Drafter, NgramDrafter, Verdict, verify
from hyla.model import load_model
from test_engine_differential import assert_drained, compare_outputs, make_workload, run

POOLS = dict(max_total_tokens=8192, max_state_slots=96, max_running_requests=8, chunked_prefill_size=256)


def _ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 2048) for _ in range(n)]


def _greedy(n: int, **kw) -> dict:
    return {"temperature": 0, "max_new_tokens": n, "ignore_eos": True, **kw}


class OracleDrafter(Drafter):
    """Proposes the reference output's next tokens, corrupting some (seeded by request and step)."""

    topk = 1

    def __init__(self, reference: dict[tuple[int, ...], list[int]], num_draft: int, error_rate: float = 0.3):
        self.reference, self.num_draft, self.error_rate = reference, num_draft, error_rate
        self.num_proposed = 0

    def propose(self, req: Req, limit: int) -> list[int]:
        ref = self.reference.get(tuple(req.input_ids), [])
        n = len(req.output_ids)
        rng = random.Random(f"{req.rid}:{n}")
        k = rng.randrange(0, min(limit, self.num_draft) + 1) if limit > 0 else 0
        drafts = list(ref[n:n + k])
        for i in range(len(drafts)):
            if rng.random() < self.error_rate:
                drafts[i] = (drafts[i] + 1 + rng.randrange(100)) % 2048
        self.num_proposed += len(drafts)
        return drafts


class OracleTreeDrafter(OracleDrafter):
    """Trees: the reference path (corrupted at some depths, so it is rejected there) with a wrong
    sibling beside some of its nodes, the right one first or second; some trees are chains."""

    topk = 2

    def propose_tree(self, req: Req, limit: int) -> tuple[list[int], list[int] | None]:
        ref = self.reference.get(tuple(req.input_ids), [])
        n = len(req.output_ids)
        rng = random.Random(f"tree:{req.rid}:{n}")
        budget = min(limit, self.num_draft, rng.randrange(0, self.num_draft + 1))
        ids: list[int] = []
        parents: list[int] = []
        node = 0
        for depth in range(budget):
            if len(ids) >= budget or n + depth >= len(ref):
                break
            true = ref[n + depth]
            main = (true + 1 + rng.randrange(100)) % 2048 if rng.random() < self.error_rate else true
            options = [main]
            if len(ids) + 2 <= budget and rng.random() < 0.6:
                options.append((main + 1 + rng.randrange(100)) % 2048)
                rng.shuffle(options)
            for t in options:
                ids.append(t)
                parents.append(node)
            node = len(ids) - len(options) + options.index(main) + 1
        self.num_proposed += len(ids)
        return ids, parents


def _count_calls(obj, name: str) -> dict:
    real, calls = getattr(obj, name), {"n": 0}

    def counted(*args, **kw):
        calls["n"] += 1
        return real(*args, **kw)

    setattr(obj, name, counted)
    return calls


# The differential workload of these tests (``make_workload``): 9 chat sessions (two of them with
# long outputs: they outlive the scheduler's decode reserve) and 4 shared-document requests, prompts
# at 0.6 of the differential tests' lengths, then 9 second turns.
WORKLOAD = dict(num_sessions=9, num_shared=4, scale=0.6)
_REFERENCES: dict[tuple, tuple[list[dict], list[dict], list[dict], list[dict]]] = {}


def reference_waves(path, seed: int,
                    workload: dict | None = None) -> tuple[list[dict], list[dict], list[dict], list[dict]]:
    """The differential workload (shared prefixes, checkpoints, second turns that quote the first
    turn's output; ``make_workload``'s arguments ``workload``, :data:`WORKLOAD` by default) and its
    outputs with no prefix cache and no speculation: ``(wave1, wave2, off1, off2)``. Computed once
    per checkpoint, seed and workload (a plain engine's greedy outputs are a function of them): the
    tests that share a workload share its reference run. Read only."""
    workload = workload or WORKLOAD
    key = (str(path), seed, tuple(sorted(workload.items())))
    if key not in _REFERENCES:
        wave1, followups = make_workload(seed, 2048, **workload)
        with Engine(path, enable_prefix_cache=False, **POOLS) as off:
            off1 = run(off, wave1)
            wave2 = [{"ids": w["ids"] + o["output_ids"] + f, "max_new": 6, "ckpt": []}
                     for w, o, f in zip(wave1, off1, followups)]
            off2 = run(off, wave2)
        _REFERENCES[key] = wave1, wave2, off1, off2
    return _REFERENCES[key]


def _count_verdicts(eng: Engine) -> dict:
    """Count the requests of ``eng``'s verify steps that fed drafts, by how many were accepted:
    ``full`` (the deepest draft), ``partial`` (some, not the deepest) and ``none``. Wraps the
    drafter the engine has now."""
    counts, drafter = {"full": 0, "partial": 0, "none": 0}, eng.scheduler.drafter
    real = drafter.verified

    def verified(reqs, verdicts):
        for r, v in zip(reqs, verdicts):
            if r.draft_ids:
                depths = [0]  # of each fed token: the last sampled one's is 0, draft j's is depths[j + 1]
                for parent in r.draft_parents or range(len(r.draft_ids)):
                    depths.append(depths[parent] + 1)
                depth = max(depths)
                counts["full" if v.num_accepted == depth else "partial" if v.num_accepted else "none"] += 1
        return real(reqs, verdicts)

    drafter.verified = verified
    return counts


def spec_differential(path, spec: dict, on_opts: dict, seed: int = 0, setup=None,
                      workload: dict | None = None) -> tuple[int, dict, object]:
    """The differential workload (:func:`reference_waves`) with speculation ``spec`` on (pools
    ``on_opts``) vs a plain engine with the cache off. Prefix hits must have happened; a pool smaller
    than ``POOLS``' must have evicted, and one under 650 tokens (the retraction pools: those of pages
    and grids are larger) must have retracted too. ``setup(engine)`` runs before the workload (e.g.
    to watch or replace the drafter). Returns ``(tokens compared, the speculating engine's stats,
    what setup returned)``; the stats hold ``verdicts`` too (:func:`_count_verdicts`) and each
    request's ``request_accept_lengths``."""
    wave1, wave2, off1, off2 = reference_waves(path, seed, workload)
    with Engine(path, debug_checks=True, **spec, **on_opts) as eng:
        watched = setup(eng) if setup is not None else None
        verdicts = _count_verdicts(eng)
        on1 = run(eng, wave1)
        on2 = run(eng, wave2)
        assert_drained(eng)
        assert eng.scheduler.num_verify_steps > 0
        stats = dict(eng.get_stats(), verdicts=verdicts,
                     request_accept_lengths=[o["meta_info"].get("spec_accept_length", 1) for o in on1 + on2])
    pool = on_opts.get("max_total_tokens", POOLS["max_total_tokens"])
    if pool < POOLS["max_total_tokens"]:
        assert stats["num_evicted_tokens"] > 0
    if pool < 650:
        assert stats["num_retractions"] > 0
    assert stats["num_cached_tokens"] > 0
    assert verdicts["none"] > 0  # every drafter here proposes drafts the target rejects
    return compare_outputs(on1 + on2, off1 + off2), stats, watched


def abort_at_verify(eng: Engine, rid: str, step: int = 3) -> None:
    """Abort request ``rid`` from inside the ``step``-th verify forward of ``eng`` (mid-verify)."""
    runner = eng.scheduler.runner
    real, calls = runner.forward_extend, {"n": 0}

    def hooked(reqs, lens, loc, ckpts, all_logits=False, **kw):
        if all_logits:
            calls["n"] += 1
            if calls["n"] == step:
                eng.abort(rid)
        return real(reqs, lens, loc, ckpts, all_logits=all_logits, **kw)

    runner.forward_extend = hooked


def _run_differential(path, on_opts: dict, seed: int = 0, drafter=OracleDrafter, setup=None) -> int:
    """The differential workload (shared prefixes, checkpoints, second turns) with an oracle drafter:
    drafts accepted whole, in part and not at all; ``setup(engine)`` runs first."""
    wave1, wave2, off1, off2 = reference_waves(path, seed)
    reference = {tuple(s["ids"]): o["output_ids"] for s, o in zip(wave1 + wave2, off1 + off2)}

    def install(eng):
        if setup is not None:
            setup(eng)
        eng.scheduler.drafter = oracle = drafter(reference, num_draft=4)
        moves = _count_calls(eng.kv_pool, "copy")  # a tree step whose accepted path is not its first nodes
        return oracle, moves, eng.scheduler

    compared, stats, (oracle, moves, scheduler) = spec_differential(
        path, dict(speculative_algorithm="ngram", speculative_num_draft_tokens=5), on_opts, seed, setup=install)
    assert oracle.num_proposed > 0 and scheduler.num_accepted_tokens > 0
    assert stats["verdicts"]["full"] > 0 and stats["verdicts"]["partial"] > 0
    assert (moves["n"] > 0) == (oracle.topk > 1)
    assert any(length > 1 for length in stats["request_accept_lengths"])
    return compared


# The architectures' 2-layer variants (a layer of each kind) where the suite has one: what these
# tests are about is each architecture's states and KV, not depth.
@pytest.mark.parametrize("arch", ["qwen3_next_dense_path", "qwen3_5_short_path", "qwen3_5_moe_short_path",
                                  "nemotron_h_path", "falcon_h1_path", "bamba_short_path", "granite_h_path",
                                  "lfm2_short_path", "lfm2_moe_short_path", "kimi_linear_path",
                                  "bailing_hybrid_short_path", "olmo_hybrid_short_path", "lara_mini_short_path",
                                  "lfm3_short_path", "zamba2_short_path", "jamba_path", "minimax_short_path", "mamba_path",
                                  "falcon_mamba_path", "mamba2_path"])
def test_speculation_is_exact_with_the_prefix_cache(arch, request):
    compared = _run_differential(request.getfixturevalue(arch), POOLS)
    assert compared > 60


@pytest.mark.slow
def test_speculation_is_exact_on_moe(qwen3_next_moe_short_path):
    assert _run_differential(qwen3_next_moe_short_path, POOLS) > 60


@pytest.mark.parametrize("opts", [
    dict(max_total_tokens=520, max_state_slots=40, max_running_requests=6, chunked_prefill_size=64),  # retraction
    dict(max_total_tokens=850, max_state_slots=40, max_running_requests=6, chunked_prefill_size=128,
         page_size=16),  # pages + grid: pending checkpoints from the per-token states
    dict(max_total_tokens=1000, max_state_slots=40, max_running_requests=6, chunked_prefill_size=128,
         checkpoint_alignment=8),
])
def test_speculation_is_exact_under_pressure(qwen3_next_dense_path, opts):
    assert _run_differential(qwen3_next_dense_path, opts, seed=1) > 60


def _watch_chains(eng: Engine, calls: dict, width: int | None = 5, trees: bool = False) -> None:
    """Count the verify steps run as padded chains (``ModelRunner.forward_chains``; ``calls["trees"]``: those
    with a tree in them); ``width``: turn them on without compiling (the engine does with ``compile_decode``),
    ``trees``: padded trees too (``verify_trees``, as the engine's with ``speculative_eagle_topk > 1``)."""
    runner = eng.scheduler.runner
    if width is not None:
        runner.verify_width = width
        runner.verify_trees = trees
    real = runner.forward_chains

    def counted(*args, **kw):
        calls["n"] += 1
        parents = kw.get("tree_parents")
        calls["trees"] = calls.get("trees", 0) + (parents is not None and any(
            par != list(range(-1, len(par) - 1)) for par in parents))
        return real(*args, **kw)

    runner.forward_chains = counted


@pytest.mark.parametrize("arch", ["bamba_short_path", "nemotron_h_path", "falcon_h1_path", "minimax_short_path",
                                  "mamba2_path", "jamba_path", "falcon_mamba_path", "kimi_linear_path",
                                  "bailing_hybrid_short_path", "lfm2_short_path", "lfm3_short_path",
                                  "zamba2_short_path", "lara_mini_short_path"])
def test_padded_chain_verify_is_exact_on_every_mixer(arch, request, monkeypatch):
    """The padded chains of verify steps through every other mixer: Mamba2 (``ops.ssd.mamba2_chains``, the conv's
    chains) beside attention (Bamba; NemotronH with its MoE; Falcon-H1's parallel layers), MiniMax's lightning
    attention (dt held at 1), a pure Mamba2 model; Mamba1 (``selective_scan_chains``: Jamba beside attention,
    FalconMamba alone); KDA and MLA (``kda_chains``, ``latent_short_extend_attention``: Kimi Linear, Ling 3 with
    its RoPE); LFM2's short convolution (LFM2, LFM3 with sliding-window attention); Zamba2's shared attention
    blocks; Gated DeltaNet beside sliding-window attention (Lara-4-Mini) — exact against a plain engine, under
    retraction. And each of the model's mixer classes is asked: one that says ``chain_verify = False`` makes
    the model refuse a batch of padded chains (``check_batch``)."""
    path = request.getfixturevalue(arch)
    assert load_model(path).supports_chain_verify()
    calls, seen = {"n": 0}, {}

    def setup(eng):
        _watch_chains(eng, calls)
        model, check = eng.scheduler.runner.model, eng.scheduler.runner.model.check_batch
        seen["model"] = model

        def record(batch):
            if batch.chain_ckpt_rows is not None:
                seen["batch"] = batch
            check(batch)

        model.check_batch = record

    opts = dict(max_total_tokens=520, max_state_slots=40, max_running_requests=6, chunked_prefill_size=64)
    assert _run_differential(path, opts, seed=1, setup=setup) > 60
    assert calls["n"] > 0
    model, batch = seen["model"], seen["batch"]
    del model.check_batch  # the class's again
    model.check_batch(batch)
    for cls in {type(mixer) for layer in model.layers for mixer in layer.mixers()}:
        with monkeypatch.context() as m:
            m.setattr(cls, "chain_verify", False)
            with pytest.raises(ValueError, match="padded chains needs mixers that run them"):
                model.check_batch(batch)


# one model per mixer (the padded trees' code is shared: varlen.scan_padded_chains, conv1d.tree_windows and the
# attention layout): Gated DeltaNet + gated attention, Mamba2 + attention, lightning attention, Mamba1 + MoE,
# KDA + MLA, LFM2's short conv, Zamba2's shared attention, sliding-window attention
@pytest.mark.parametrize("arch", ["qwen3_5_short_path", "bamba_short_path", "minimax_short_path", "jamba_path",
                                  "kimi_linear_path", "lfm2_short_path", "zamba2_short_path", "lara_mini_short_path"])
def test_padded_tree_verify_is_exact_on_every_mixer(arch, request):
    """Verify steps of token trees padded to the width (``verify_trees``: what ``compile_decode`` compiles with
    ``speculative_eagle_topk > 1``; ``ForwardBatch.chain_tree_parents``) through every mixer: each token from
    its parent's state (a copy of the state after its parent's column) and its path's
    conv window, attention over its ancestors — exact against a plain engine with the cache off, under
    retraction, with trees accepted down a sibling (the accepted path's KV moved) and chains among them."""
    calls = {"n": 0}
    opts = dict(max_total_tokens=520, max_state_slots=40, max_running_requests=6, chunked_prefill_size=64)
    assert _run_differential(request.getfixturevalue(arch), opts, seed=1, drafter=OracleTreeDrafter,
                             setup=lambda e: _watch_chains(e, calls, trees=True)) > 60
    assert calls["n"] > 0 and calls["trees"] > 0


def test_padded_tree_verify_is_exact_with_pages(qwen3_5_short_path):
    """Padded trees on a page grid of 16: the accepted path's KV moved inside pages, grid checkpoints taken
    from the tree nodes' scratch slots (the commit's pending checkpoints) — exact against a plain engine."""
    calls = {"n": 0}
    opts = dict(max_total_tokens=700, max_state_slots=40, max_running_requests=6, chunked_prefill_size=128,
                page_size=16)
    assert _run_differential(qwen3_5_short_path, opts, seed=1, drafter=OracleTreeDrafter,
                             setup=lambda e: _watch_chains(e, calls, trees=True)) > 60
    assert calls["n"] > 0 and calls["trees"] > 0


@pytest.mark.parametrize("opts", [POOLS, dict(max_total_tokens=520, max_state_slots=40, max_running_requests=6,
                                              chunked_prefill_size=64),  # retraction
                                  dict(max_total_tokens=850, max_state_slots=40, max_running_requests=6,
                                       chunked_prefill_size=128, page_size=16)],  # a grid: pending checkpoints
                         ids=["pools", "retraction", "page-16"])
def test_padded_chain_verify_is_exact(qwen3_next_dense_path, opts):
    """Verify steps as chains padded to the width (what ``compile_decode`` compiles), run eagerly:
    the same greedy tokens and logprobs as a plain engine with the cache off, with drafts accepted
    whole (the live state then comes from a scratch slot) and in part, under pressure."""
    calls = {"n": 0}
    assert _run_differential(qwen3_next_dense_path, opts, seed=1, setup=lambda e: _watch_chains(e, calls)) > 60
    assert calls["n"] > 0


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None, reason="torch.compile needs a C++ compiler")
def test_compiled_verify_is_exact_and_compiles_nothing_after_start_up(qwen3_next_short_path, monkeypatch):
    """``compile_decode`` with n-gram speculation: verify steps run the compiled graph (padded
    chains) and decode steps theirs; exact, and no graph is compiled after start-up. The graphs of
    more rows run their projections on packed weights, as a large model's do: not frozen, so
    inductor's cache keeps them and a later run loads them (a frozen graph's packed constants are
    never cached: ~60 s more of this test each run), and without a GEMM to autotune (what is tested
    is the verify steps' graphs: ``test_compiled_decode_equals_eager`` covers the frozen GEMMs).

    Its decode graphs are those of ``compile_decode`` on packed weights (``linear.pack_weights_``, as for
    a model with large projections), so before the differential workload the same engine, drafting
    nothing, runs that case of ``test_compiled_decode_equals_eager`` (compiling them again there, cold,
    cost 27 s after its frozen case, 64 s alone): every projection packed and the graph not frozen
    (inductor packed nothing itself), the same greedy
    tokens and logprobs (1e-4) as eager, batch 1 and a changing larger batch (from 20 requests down to 1:
    both graphs, the one-row graph's dot products and the packed weights' oneDNN GEMMs, called for
    batches of more rows only), nothing compiled, no step run eager."""
    import torch._dynamo

    from hyla.engine import model_runner
    from hyla.model import linear
    from hyla.model.linear import Linear

    monkeypatch.setattr(linear, "PACK_MIN_WEIGHT", 1)  # graphs of more rows on packed weights (inductor caches them)
    monkeypatch.setattr(model_runner, "ROWS_OPTIONS", {"realize_opcount_threshold": 4})  # or frozen, not autotuned

    rng = random.Random(0)
    lens, new = [30, 90, 7, 64] + list(range(5, 21)), [12, 20, 8, 16] + [3 + i % 7 for i in range(16)]
    prompts = [[rng.randrange(3, 2048) for _ in range(n)] for n in lens]
    params = [{"temperature": 0, "max_new_tokens": n, "ignore_eos": True} for n in new]

    def decode_workload(engine):
        outs = engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True)
        return outs + [engine.generate(input_ids=prompts[1], sampling_params=params[1], return_logprob=True)]

    with Engine(qwen3_next_short_path, max_total_tokens=4096, max_state_slots=48) as plain:
        eager = decode_workload(plain)

    calls, graphs, onednn_calls, decoded = {"n": 0}, {}, [], {}

    def setup(eng):
        _watch_chains(eng, calls, width=None)
        graphs["start"] = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        graphs["runner"] = runner = eng.scheduler.runner
        if linear.HAS_PACKED:  # the projections' own packed weights, not frozen
            assert all(m.packed is not None for m in eng.model.modules() if isinstance(m, Linear))
            assert not runner._freeze_rows
            assert torch._dynamo.utils.counters["inductor"]["mkldnn_linear_weight_pack_matcher_count"] == packs
        # decode steps only (a drafter that drafts nothing); rows through oneDNN's GEMM, what the packed
        # weights' op calls
        drafter, eng.scheduler.drafter = eng.scheduler.drafter, OracleDrafter({}, num_draft=0)
        with monkeypatch.context() as patch:
            real_onednn = torch.ops.mkldnn._linear_pointwise
            patch.setattr(torch.ops.mkldnn, "_linear_pointwise",
                          lambda x, *args: onednn_calls.append(x.shape[0]) or real_onednn(x, *args))
            decoded["outs"] = decode_workload(eng)
        eng.scheduler.drafter = drafter
        assert runner.late_compiles == 0 and eng.scheduler.num_fed_tokens == eng.scheduler.num_verify_steps  # no drafts
        assert bool(onednn_calls) == linear.HAS_PACKED and 1 not in onednn_calls  # batches of more rows only

    packs = torch._dynamo.utils.counters["inductor"]["mkldnn_linear_weight_pack_matcher_count"]
    # room for the decode workload's 20 requests at once (and their verify steps' scratch slots)
    on_opts = dict(POOLS, compile_decode=True, max_running_requests=20, max_state_slots=160)
    assert _run_differential(qwen3_next_short_path, on_opts, setup=setup) > 60
    assert calls["n"] > 0
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs["start"], "compiled after start-up"
    assert graphs["runner"].late_compiles == 0, "a step no graph of the warm-up fitted ran eager"
    for a, b in zip(eager, decoded["outs"], strict=True):
        assert a["output_ids"] == b["output_ids"]
        la = [x[0] for x in a["meta_info"]["output_token_logprobs"]]
        lb = [x[0] for x in b["meta_info"]["output_token_logprobs"]]
        assert max(abs(x - y) for x, y in zip(la, lb)) <= 1e-4  # the project fp32 tolerance


def _trace_only(monkeypatch) -> None:
    """``torch.compile`` with dynamo's ``eager`` backend: the graphs traced (``fullgraph`` as asked), not compiled."""
    real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: real(fn, backend="eager", dynamic=kw.get("dynamic"),
                                                                 fullgraph=kw.get("fullgraph", False)))


@pytest.mark.parametrize("arch", ["kimi_linear_short_path", "jamba_short_path", "zamba2_short_path"])
def test_every_mixers_chains_trace_to_one_graph(arch, request, monkeypatch):
    """``compile_decode`` with n-gram drafts on the mixers whose chains are not Qwen3-Next's (KDA + MLA, Mamba1 +
    MoE, Mamba2 + Zamba2's shared attention; LFM2's short convolution runs Gated DeltaNet's conv chains): dynamo traces every start-up graph whole
    (``fullgraph``) and serves every verify step from them — no graph traced after start-up, no late compile —
    with the plain engine's tokens. Dynamo's ``eager`` backend instead of inductor: the trace is what is tested
    here (inductor's code for the same graphs: ``test_compiled_verify_is_exact_and_compiles_nothing_after_start_up``
    on Qwen3-Next, the others checked by hand, docs/engine.md). The same engine's decode graphs (traced whole at
    its start-up too) then serve two requests past ``speculative_disable_by_batch_size`` (decode steps of two rows),
    and a batch no graph fits goes through real dynamo and runs eager: for Jamba and Zamba2 this is
    ``test_compiled_decode_is_one_graph_per_step``'s check (tracing their decode graphs again there cost ~16 s)."""
    import torch._dynamo

    path = request.getfixturevalue(arch)
    _trace_only(monkeypatch)
    prompt, params = [5, 6, 7, 8] * 6, {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}
    pair, pair_params = [[5, 6, 7, 8] * 4, [9, 10, 11] * 3], dict(params, max_new_tokens=6)
    with Engine(path, **POOLS) as plain:
        first = plain.generate(input_ids=prompt, sampling_params=params)["output_ids"]
        prompt = prompt + first + prompt + first[:6]  # what follows has been seen: n-gram drafts
        expected = plain.generate(input_ids=prompt, sampling_params=params)["output_ids"]
        expected_pair = [o["output_ids"] for o in plain.generate(input_ids=pair, sampling_params=pair_params)]
    calls = {"n": 0}
    with Engine(path, speculative_algorithm="ngram", speculative_num_draft_tokens=4, compile_decode=True,
                speculative_disable_by_batch_size=1, **dict(POOLS, max_running_requests=2)) as eng:
        runner = eng.scheduler.runner
        assert runner.compiled and runner.verify_width == 4 and not runner.verify_trees
        _watch_chains(eng, calls, width=None)
        compiled, seen = runner._compiled_decode, []
        runner._compiled_decode = lambda batch: seen.append(batch) or compiled(batch)
        start = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        assert eng.generate(input_ids=prompt, sampling_params=params)["output_ids"] == expected
        assert calls["n"] > 0 and runner.late_compiles == 0
        # two requests, above speculative_disable_by_batch_size: fed no drafts, decode steps of two rows
        assert [o["output_ids"] for o in eng.generate(input_ids=pair, sampling_params=pair_params)] == expected_pair
        decodes = [b for b in seen if b.is_decode and b.input_ids.shape[0] == 2]
        assert decodes and runner.late_compiles == 0
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == start, "traced after start-up"
        # a batch no graph fits (int32 token ids: a dtype guard fails): dynamo raises rather than trace,
        # and the step runs eager (it rewrites the last step's slots: the engine serves nothing after this)
        batch = decodes[-1]
        batch.input_ids = batch.input_ids.to(torch.int32)
        with torch.inference_mode():
            runner._run_compiled(batch)
        assert runner.late_compiles == 1


def test_compiled_tree_verify_traces_to_one_graph(kimi_linear_short_path, monkeypatch):
    """``compile_decode`` with trees of drafts (``speculative_eagle_topk=2``): the runner compiles its verify graphs
    for padded trees (``verify_trees``) and serves every verify step from them, trees and chains alike — traced whole
    (``fullgraph``, dynamo's ``eager`` backend as above), nothing traced after start-up, no late compile — with
    the plain engine's tokens under retraction (the differential workload, trees accepted down siblings). KDA + MLA
    and their convolution (every mixer's padded trees: ``test_padded_tree_verify_is_exact_on_every_mixer``; inductor's
    code for them was checked by hand: docs/engine.md)."""
    import torch._dynamo

    _trace_only(monkeypatch)
    calls, seen = {"n": 0}, {}

    def setup(eng):
        runner = eng.scheduler.runner
        assert runner.compiled and runner.verify_width == 5 and runner.verify_trees
        _watch_chains(eng, calls, width=None)
        seen["start"], seen["runner"] = torch._dynamo.utils.counters["stats"]["unique_graphs"], runner

    opts = dict(max_total_tokens=520, max_state_slots=40, max_running_requests=6, chunked_prefill_size=64,
                compile_decode=True, speculative_eagle_topk=2)
    assert _run_differential(kimi_linear_short_path, opts, seed=1, drafter=OracleTreeDrafter, setup=setup) > 60
    assert calls["n"] > 0 and calls["trees"] > 0 and seen["runner"].late_compiles == 0
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == seen["start"], "traced after start-up"


def test_compile_decode_warm_up_fits_wide_verify_steps(qwen3_next_short_path, monkeypatch):
    """``compile_decode`` with verify steps of 90 tokens: the warm-up's batch of 13 chains (up to 61
    cached + 90 fed tokens each) needs more scratch KV rows than the 1,201 that decode's warm-up
    takes, so the runner sizes them from the width. ``torch.compile`` is replaced by the function
    itself: what is tested is the warm-up's batches on its scratch pools, not inductor (a compile
    at this width takes minutes); then the engine serves as the eager one does."""
    monkeypatch.setattr(torch, "compile", lambda fn, **options: fn)
    prompt = [5, 6, 7, 8] * 6
    params = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
    with Engine(qwen3_next_short_path, **POOLS) as plain:
        expected = plain.generate(input_ids=prompt, sampling_params=params)["output_ids"]
    with Engine(qwen3_next_short_path, speculative_algorithm="ngram", speculative_num_draft_tokens=90,
                compile_decode=True, **dict(POOLS, max_running_requests=2, max_state_slots=200)) as eng:
        assert eng.scheduler.runner.compiled and eng.scheduler.runner.verify_width == 90
        assert eng.generate(input_ids=prompt, sampling_params=params)["output_ids"] == expected


@pytest.mark.parametrize("arch", ["qwen3_next_dense_path", "qwen3_5_short_path", "nemotron_h_path", "falcon_h1_path",
                                  "lfm2_short_path", "kimi_linear_path", "jamba_path", "minimax_short_path", "mamba_path",
                                  "falcon_mamba_path", "mamba2_path"])  # (2-layer variants: as above)
def test_tree_speculation_is_exact_with_the_prefix_cache(arch, request):
    """Tree verification: siblings, rejections at any depth, chains and zero-draft steps in one run."""
    assert _run_differential(request.getfixturevalue(arch), POOLS, drafter=OracleTreeDrafter) > 60


@pytest.mark.parametrize("opts", [
    dict(max_total_tokens=440, max_state_slots=40, max_running_requests=6, chunked_prefill_size=64),  # retraction
    dict(max_total_tokens=700, max_state_slots=40, max_running_requests=6, chunked_prefill_size=128,
         page_size=16),  # the accepted path's KV moves inside pages; grid checkpoints from its states
])
def test_tree_speculation_is_exact_under_pressure(qwen3_next_dense_path, opts):
    assert _run_differential(qwen3_next_dense_path, opts, seed=2, drafter=OracleTreeDrafter) > 60


def test_stops_inside_an_accepted_run(qwen3_next_dense_path):
    """EOS, a stop token and max_new_tokens landing inside a fully accepted run."""
    ids = _ids(30, 5)
    with Engine(qwen3_next_dense_path, enable_prefix_cache=False, **POOLS) as ref:
        full = ref.generate(input_ids=ids, sampling_params=_greedy(24), return_logprob=True)["output_ids"]
    with Engine(qwen3_next_dense_path, speculative_algorithm="ngram", speculative_num_draft_tokens=9,
                debug_checks=True, **POOLS) as eng:
        eng.scheduler.drafter = OracleDrafter({tuple(ids): full}, num_draft=8, error_rate=0.0)
        chunks = stops_inside_accepted_runs(eng, ids, full, stop_at=6, eos_at=10)
        assert any(len(c["output_ids"]) > 1 for c in chunks)  # several tokens per verify step
        assert_drained(eng)


def stops_inside_accepted_runs(eng: Engine, ids: list[int], full: list[int], stop_at: int,
                               eos_at: int) -> list[dict]:
    """A stop token (``full[stop_at]``), ``max_new_tokens`` (5) and EOS (``full[eos_at]``) landing
    inside accepted runs of ``eng``, whose drafts reproduce ``full`` (the greedy output of ``ids``):
    each ends the output exactly there. Returns the chunks of a streamed run of all of ``full``
    (with no EOS set)."""
    stop_tok = full[stop_at]
    out = eng.generate(input_ids=ids, sampling_params=_greedy(24, stop_token_ids=[stop_tok]))
    assert out["output_ids"] == full[: full.index(stop_tok) + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_tok}
    out = eng.generate(input_ids=ids, sampling_params=_greedy(5))
    assert out["output_ids"] == full[:5] and out["meta_info"]["finish_reason"]["type"] == "length"
    eos = full[eos_at]
    eng.scheduler.output.eos_token_ids = {eos}
    out = eng.generate(input_ids=ids, sampling_params={"temperature": 0, "max_new_tokens": 24})
    assert out["output_ids"] == full[: full.index(eos) + 1]
    eng.scheduler.output.eos_token_ids = set()
    chunks = list(eng.generate(input_ids=ids, sampling_params=_greedy(24), stream=True))
    assert [t for c in chunks for t in c["output_ids"]] == full
    return chunks


def test_abort_mid_verify_and_zero_draft_steps(qwen3_next_dense_path):
    ids = _ids(40, 6)
    with Engine(qwen3_next_dense_path, enable_prefix_cache=False, **POOLS) as ref:
        want = ref.generate(input_ids=ids, sampling_params=_greedy(30), return_logprob=True)
    # one token per verify step: every step is a zero-draft verify, through the same path
    with Engine(qwen3_next_dense_path, speculative_algorithm="ngram", speculative_num_draft_tokens=1,
                debug_checks=True, **POOLS) as eng:
        got = eng.generate(input_ids=ids, sampling_params=_greedy(30), return_logprob=True)
        compare_outputs([got], [want])
        assert got["meta_info"]["spec_verify_ct"] == 29 and got["meta_info"]["spec_accept_length"] == 1.0
        assert_drained(eng)
    with Engine(qwen3_next_dense_path, speculative_algorithm="ngram", speculative_num_draft_tokens=5,
                debug_checks=True, **POOLS) as eng:
        eng.scheduler.drafter = OracleDrafter({tuple(ids): want["output_ids"]}, num_draft=4)
        abort_at_verify(eng, "victim")
        outs = eng.generate(input_ids=[ids, ids], sampling_params=_greedy(30), return_logprob=True,
                            rid=["victim", "other"])
        assert outs[0]["meta_info"]["finish_reason"]["type"] == "abort"
        assert outs[0]["output_ids"] == want["output_ids"][: len(outs[0]["output_ids"])]
        compare_outputs([outs[1]], [want])
        assert_drained(eng)
        # the verify steps' scratch states are reserved for good: an emptied engine still reads no usage
        assert eng.flush_cache() and eng.cache.num_reserved_states > 0
        stats = eng.get_stats()
        assert (stats["token_usage"], stats["state_usage"]) == (0.0, 0.0)


def test_ngram_drafter_on_a_repetitive_prompt(qwen3_next_dense_path):
    """The real drafter: a prompt that repeats a phrase, the output asked to continue it. (The
    lookup itself: adaptive=False, so that weak matches are proposed too.)"""
    phrase = _ids(12, 7)
    prompt = phrase * 4 + phrase[:5]
    d = NgramDrafter(num_draft=4, min_n=1, max_n=4, adaptive=False)
    req = Req(rid="r", input_ids=prompt, sampling=SamplingParams.from_dict(_greedy(8)))
    assert d.propose(req, 8) == phrase[5:9]
    req.output_ids += phrase[5:7]  # the index grows incrementally
    assert d.propose(req, 2) == phrase[7:9]
    assert d.propose(Req(rid="s", input_ids=[1, 2, 3], sampling=req.sampling), 4) == []
    loop = Req(rid="loop", input_ids=[7, 1, 2, 3, 1, 2, 3, 1, 2], sampling=req.sampling)
    assert d.propose(loop, 4) == [3, 1, 2, 3]  # a period-3 loop proposed past the end of the history
    # trees: "1 2" was followed by 3 and (more recently) by 4; both continuations, level by level
    tree = NgramDrafter(num_draft=5, min_n=1, max_n=4, topk=2, adaptive=False)
    branchy = Req(rid="b", input_ids=[1, 2, 3, 9, 1, 2, 4, 8, 1, 2], sampling=req.sampling)
    ids, parents = tree.propose_tree(branchy, 5)
    assert (ids, parents) == ([4, 3, 8, 9, 1], [0, 0, 1, 2, 3])  # 4 -> 8 -> 1 and 3 -> 9
    assert tree.propose_tree(Req(rid="c", input_ids=[5, 6, 5], sampling=req.sampling), 3) == ([6, 5, 6], None)
    with Engine(qwen3_next_dense_path, enable_prefix_cache=False, **POOLS) as ref, \
            Engine(qwen3_next_dense_path, speculative_algorithm="ngram", debug_checks=True, **POOLS) as eng:
        want = ref.generate(input_ids=prompt, sampling_params=_greedy(40), return_logprob=True)
        got = eng.generate(input_ids=prompt, sampling_params=_greedy(40), return_logprob=True)
        compare_outputs([got], [want])
        assert eng.scheduler.num_verify_steps > 0
        assert eng.get_stats()["spec_accept_length"] >= 1.0
        assert_drained(eng)


def test_no_drafts_above_the_batch_size_limit(qwen3_next_dense_path):
    """``speculative_disable_by_batch_size``: a step with more decoding requests than the limit
    feeds no drafts (the outputs stay exact); at or below it, drafts are fed."""
    phrase = _ids(12, 7)
    prompts = [phrase * 4 + phrase[:5], phrase[3:] * 4 + phrase[3:6]]  # both continue a loop: drafts match
    params = [_greedy(24), _greedy(24)]
    with Engine(qwen3_next_dense_path, enable_prefix_cache=False, **POOLS) as ref:
        want = ref.generate(input_ids=prompts, sampling_params=params, return_logprob=True)
    for limit, drafts_fed in ((1, False), (2, True)):
        with Engine(qwen3_next_dense_path, speculative_algorithm="ngram", speculative_disable_by_batch_size=limit,
                    speculative_ngram_adaptive=False, debug_checks=True, **POOLS) as eng:
            got = eng.generate(input_ids=prompts, sampling_params=params, return_logprob=True)
            compare_outputs(got, want)
            s = eng.scheduler
            assert (s.num_fed_tokens > s.num_verify_steps) == drafts_fed, (limit, s.num_fed_tokens, s.num_verify_steps)
    with pytest.raises(ValueError, match="speculative_disable_by_batch_size"):
        Engine(qwen3_next_dense_path, speculative_algorithm="ngram", speculative_disable_by_batch_size=0)


def test_eager_speculation_warns_of_nothing(qwen3_next_dense_path, caplog):
    """The warning about eager verify steps beside a compiled or CUDA-graph decode is for those
    engines only: an eager engine with speculation logs none, and its runner is not compiled."""
    import logging

    with caplog.at_level(logging.WARNING, logger="hyla.engine"):
        with Engine(qwen3_next_dense_path, speculative_algorithm="ngram", **POOLS) as eng:
            assert eng.scheduler.runner.compiled is False and eng.scheduler.runner.verify_width is None
    assert not [r for r in caplog.records if "verify steps the eager ops" in r.getMessage()]


def _verdict(tokens: list[int], num_accepted: int) -> Verdict:
    return Verdict(tokens, [0.0] * len(tokens), [[] for _ in tokens], num_accepted, list(range(num_accepted + 1)))


def _step(d: NgramDrafter, req: Req, limit: int, tokens: list[int], num_accepted: int) -> list[int]:
    """One verify step of ``req`` with drafter ``d``: propose, feed, score with a verdict of
    ``num_accepted`` drafts and emitted ``tokens`` (the history is left as it is: the budget reads
    only the verdict). Returns what was fed."""
    drafts = d.propose(req, limit)
    req.set_drafts(drafts)
    d.verified([req], [_verdict(tokens, num_accepted)])
    req.clear_drafts()
    return drafts


def test_adaptive_ngram_drafts_fewer_after_rejections_and_more_after_acceptances():
    """DraftBudget: a rejection cuts the next step's drafts to those accepted (0 stops drafting,
    the first token is still guessed for free), an all-accepted step or a right guess grows them
    by one; the same drafter with adaptive=False always proposes the whole continuation."""
    phrase = _ids(12, 9)
    d, fixed = NgramDrafter(num_draft=4, min_n=1, max_n=4), NgramDrafter(num_draft=4, min_n=1, max_n=4, adaptive=False)
    req = Req(rid="r", input_ids=phrase * 3 + phrase[:4], sampling=SamplingParams.from_dict(_greedy(64)))
    full = phrase[4:8]
    other = (phrase[4] + 1) % 2048
    assert _step(d, req, 8, [phrase[4], other], 1) == full  # 1 of 4 accepted
    assert _step(d, req, 8, [phrase[4], phrase[5]], 1) == full[:1]  # budget 1: all accepted
    assert _step(d, req, 8, [phrase[4], phrase[5], phrase[6]], 2) == full[:2]  # budget 2: all accepted
    assert _step(d, req, 8, [other], 0) == full[:3]  # budget 3: rejected at the first draft
    assert _step(d, req, 8, [other], 0) == []  # budget 0: nothing fed; its guess (phrase[4]) was wrong
    assert req.draft_state.budget.budget == 0
    assert _step(d, req, 8, [phrase[4]], 0) == []  # budget 0 again; this time the guess is right ...
    assert d.propose(req, 8) == full[:1]  # ... so one draft next
    assert d.propose(req, 2) == full[:1] and d.propose(req, 0) == []  # the scheduler's limit still applies
    assert req.draft_state.budget.guess is None  # nothing to guess without room for drafts
    assert fixed.propose(req, 8) == full  # adaptive=False: the whole continuation, always
    # a guess whose step never verified (its request retracted, then a step that drafts nothing: drafting off
    # by batch size) is not scored against a later token
    assert _step(d, req, 8, [other], 0) == full[:1] and req.draft_state.budget.budget == 0
    assert d.propose(req, 8) == [] and req.draft_state.budget.guess == phrase[4]  # guessed, never verified
    req.output_ids.append(phrase[4])  # (the step that verified came later, the request one token on)
    d.verified([req], [_verdict([phrase[4]], 0)])  # a right token for the old guess's position, not this one's
    assert req.draft_state.budget.budget == 0 and not req.draft_state.budget.last_right


def test_adaptive_ngram_skips_weak_matches_until_a_prediction_is_right():
    """A 1-token match is guessed, not drafted, until the request's last prediction was right."""
    sampling = SamplingParams.from_dict(_greedy(64))
    d, fixed = NgramDrafter(num_draft=3, min_n=1, max_n=4), NgramDrafter(num_draft=3, min_n=1, max_n=4, adaptive=False)
    weak = [5, 9, 8, 7, 6, 9]  # only the last token, 9, occurred before: a 1-token match
    assert fixed.propose(Req(rid="f", input_ids=weak, sampling=sampling), 3) == [8, 7, 6]
    req = Req(rid="w", input_ids=weak, sampling=sampling)
    assert _step(d, req, 3, [8], 0) == []  # skipped; its guess 8 is right
    assert req.draft_state.budget.last_right
    assert d.propose(req, 3) == [8, 7, 6]  # the same weak match, drafted now
    req.output_ids.append(8)
    assert d.propose(req, 3) == [7, 6, 9]  # "9 8" matches: 2 tokens, not weak
    again = Req(rid="a", input_ids=[5, 9, 8, 7, 6, 9, 8, 1], sampling=sampling)  # "1" unseen: no match
    assert d.propose(again, 3) == [] and again.draft_state.budget.guess is None
    again.output_ids.append(9)  # "1 9": only "9" matched, and nothing was right yet
    assert _step(d, again, 3, [4], 0) == [] and not again.draft_state.budget.last_right
    tree = NgramDrafter(num_draft=3, min_n=1, max_n=4, topk=2)
    assert tree.propose_tree(Req(rid="t", input_ids=weak, sampling=sampling), 3) == ([], None)


def test_adaptive_ngram_is_exact_feeds_less_and_forgets_finished_requests(qwen3_next_dense_path):
    """The adaptive n-gram drafter on vs off (and on with trees): the same greedy tokens as plain
    decoding, fewer tokens fed on a random model (whose drafts are mostly rejected), and no
    request's drafter memory left once it finished."""
    phrase = _ids(12, 7)
    prompts = [phrase * 4 + phrase[:5], _ids(60, 10) * 2, _ids(50, 11)]
    with Engine(qwen3_next_dense_path, enable_prefix_cache=False, **POOLS) as ref:
        want = ref.generate(input_ids=prompts, sampling_params=_greedy(40), return_logprob=True)
    fed = {}
    tree_opts = dict(speculative_eagle_topk=2, speculative_num_draft_tokens=6)
    for adaptive, trees in ((True, {}), (False, {}), (True, tree_opts)):
        with Engine(qwen3_next_dense_path, speculative_algorithm="ngram", speculative_ngram_adaptive=adaptive,
                    debug_checks=True, **trees, **POOLS) as eng:
            seen: list[Req] = []
            drafter = eng.scheduler.drafter
            name = "propose_tree_batch" if trees else "propose_batch"
            real = getattr(drafter, name)
            setattr(drafter, name, lambda reqs, limits, real=real: (seen.extend(reqs), real(reqs, limits))[1])
            got = eng.generate(input_ids=prompts, sampling_params=_greedy(40), return_logprob=True)
            compare_outputs(got, want)
            fed.setdefault(adaptive, eng.scheduler.num_fed_tokens)
            assert drafter.adaptive == adaptive and eng.scheduler.num_verify_steps > 0
            assert_drained(eng)
            assert seen and all(r.draft_state is None for r in seen)
    assert fed[True] < fed[False]


def _verify_step_pools(page_size: int):
    """A cache manager (no tree) with three requests mid-verify-step: 5 prompt tokens committed,
    then 4 fed tokens each (the last sampled + 3 drafts) with per-token scratch states; every
    buffer holds seeded random values. ``(cache, reqs, scratch)``."""
    kv = KVPool(96, page_size, 1, 1, 2, torch.float32)
    states = StatePool(16, 1, (2, 2), torch.float32, (1, 2, 2), torch.float32)
    cache = CacheManager(kv, states, ReqToTokenPool(4, 32), None)
    reqs = [Req(rid=f"r{i}", input_ids=_ids(5, i), sampling=SamplingParams.from_dict(_greedy(8))) for i in range(3)]
    for r in reqs:
        cache.commit(r, 5, insert=False) if cache.admit(r, None, 5) is not None else pytest.fail("no room")
    cache.allocate(reqs, [4, 4, 4])
    scratch = [states.alloc(3).tolist() for _ in reqs]
    gen = torch.Generator().manual_seed(page_size)
    for buf in (*kv.k_buffers, *kv.v_buffers, *states.conv_states, *states.ssm_states):
        buf.copy_(torch.rand(buf.shape, generator=gen))
    return cache, reqs, scratch


def test_batched_verify_commit_equals_request_by_request_commits():
    """``CacheManager.commit_batch`` (one KV copy, one state copy, one free for the step) leaves
    pools and requests exactly as ``commit`` request by request: a chain rejected after one
    draft, a tree path (KV moved) rejected after two, a chain all accepted; pages of 1 and 2."""
    ns = [2, 3, 4]
    paths = [[0, 1], [0, 2, 3], [0, 1, 2, 3]]
    for page_size in (1, 2):
        (one, reqs_one, scratch), (many, reqs_many, _) = _verify_step_pools(page_size), _verify_step_pools(page_size)
        # fed token j's state: scratch slot j for a draft, the live slot for the last fed token
        states = [[slots[j] if j < 3 else r.state_slot for j in path]
                  for r, slots, path in zip(reqs_one, scratch, paths)]
        kv0, ssm0 = many.kv_pool.k_buffers[0].clone(), many.state_pool.ssm_states[0].clone()
        fed_kv = [many.req_to_token.read(r.req_pool_idx, 5, 9) for r in reqs_many]
        copies = _count_calls(many.state_pool, "copy")
        for r, n, st, path in zip(reqs_one, ns, states, paths):
            one.commit(r, n, insert=False, states=st, path=path)
        many.commit_batch(reqs_many, ns, insert=False, states=states, paths=paths)
        assert copies["n"] == 1  # two live states reset, one copy
        for r, n, st, path, fed in zip(reqs_many, ns, states, paths, fed_kv):  # what each should hold now
            assert torch.equal(many.state_pool.ssm_states[0][r.state_slot], ssm0[st[-1]])
            assert torch.equal(many.kv_pool.k_buffers[0][many.req_to_token.read(r.req_pool_idx, 5, 5 + n)],
                               kv0[fed[path]])
        for a, b, n in zip(reqs_one, reqs_many, ns):
            assert (a.kv_len, a.kv_allocated, a.state_slot) == (b.kv_len, b.kv_allocated, b.state_slot)
            assert a.kv_len == a.kv_allocated == 5 + n
            assert torch.equal(one.req_to_token.read(a.req_pool_idx, 0, a.kv_len),
                               many.req_to_token.read(b.req_pool_idx, 0, b.kv_len))
        assert one.kv_pool.available_size() == many.kv_pool.available_size()
        assert one.state_pool.available_size() == many.state_pool.available_size()
        for pools in ((one.kv_pool, many.kv_pool), (one.state_pool, many.state_pool)):
            bufs = [(*p.k_buffers, *p.v_buffers) if isinstance(p, KVPool) else (*p.conv_states, *p.ssm_states)
                    for p in pools]
            assert all(torch.equal(x, y) for x, y in zip(*bufs, strict=True))
        one.check_integrity()
        many.check_integrity()
    # a bad request anywhere in the batch: ValueError, and nothing committed
    cache, reqs, scratch = _verify_step_pools(1)
    with pytest.raises(ValueError, match="missing"):
        cache.commit_batch(reqs, [2, 2, 4], insert=False, states=[scratch[0][:1], [], []])
    assert [(r.kv_len, r.kv_allocated) for r in reqs] == [(5, 9)] * 3


def test_seeded_sampling_with_speculation_is_reproducible(qwen3_next_dense_path):
    ids = _ids(30, 8)
    params = {"temperature": 1.0, "top_p": 0.9, "max_new_tokens": 20, "seed": 123, "ignore_eos": True}
    with Engine(qwen3_next_dense_path, enable_prefix_cache=False, **POOLS) as ref:
        guide = ref.generate(input_ids=ids, sampling_params=params)["output_ids"]
    outs = []
    for _ in range(2):
        with Engine(qwen3_next_dense_path, speculative_algorithm="ngram", speculative_num_draft_tokens=4,
                    **POOLS) as eng:
            ngram, eng.scheduler.drafter = eng.scheduler.drafter, OracleDrafter({tuple(ids): guide}, num_draft=3)
            outs.append(eng.generate(input_ids=[ids, ids], sampling_params=params, rid=["a", "b"]))
            eng.scheduler.drafter = ngram
            real = eng.generate(input_ids=[ids, ids], sampling_params=params)  # the n-gram drafter
            assert real[0]["output_ids"] == real[1]["output_ids"]  # drafts depend on the tokens only
    assert [o["output_ids"] for o in outs[0]] == [o["output_ids"] for o in outs[1]]


# --- speculative sampling preserves the target distribution ------------------------------------


def _sampling_req(seed: int, drafts: list[int]) -> Req:
    req = Req(rid=f"s{seed}", input_ids=[1], sampling=SamplingParams.from_dict({"temperature": 1.0}))
    req.generator = torch.Generator().manual_seed(seed)
    req.draft_ids = list(drafts)
    return req


def test_tree_sampling_matches_the_target_distribution():
    """Two candidate children at the root, then a grandchild under the second: the first emitted
    token is distributed as p_0 whatever the candidates, and the second (given the second child was
    accepted) as that child's row."""
    vocab = 6
    logits = torch.tensor([[1.0, 0.2, -0.5, 0.7, 0.0, -1.0],   # root
                           [0.1, 1.2, 0.3, -0.2, 0.9, 0.0],    # child 1 (token 3)
                           [0.0, 0.0, 0.5, 0.5, -0.5, 1.0],    # child 2 (token 0)
                           [0.3, 0.0, 0.2, 0.1, 0.0, 0.4]])    # grandchild (token 5), under child 2
    p = torch.softmax(logits, dim=-1)
    n = 6000
    first, second = [0] * vocab, [0] * vocab
    for i in range(n):
        req = _sampling_req(i, [3, 0, 5])
        req.set_drafts([3, 0, 5], [0, 0, 2])
        (v,) = verify([req], [4], logits)
        first[v.tokens[0]] += 1
        if v.tokens[0] == 0:
            assert v.path[:2] == [0, 2]
            second[v.tokens[1]] += 1
    assert _chi_square(first, p[0].tolist()) < 20.5
    assert _chi_square(second, p[2].tolist()) < 20.5


def test_tree_greedy_acceptance_follows_the_argmax_path():
    logits = torch.full((5, 8), -5.0)
    logits[0, 4] = logits[2, 6] = logits[4, 1] = 5.0  # root -> 4 (node 2) -> 6 (node 4) -> bonus 1
    req = Req(rid="g", input_ids=[1], sampling=SamplingParams.from_dict({"temperature": 0}))
    req.set_drafts([3, 4, 6, 6], [0, 0, 1, 2])  # node 3 (token 6) hangs under the rejected node 1
    (v,) = verify([req], [5], logits)
    assert (v.tokens, v.path, v.num_accepted) == ([4, 6, 1], [0, 2, 4], 2)
    with pytest.raises(ValueError, match="do not form a tree"):
        req.set_drafts([3, 4], [0, 2])


def _chi_square(counts: list[int], probs: list[float]) -> float:
    n = sum(counts)
    return sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, probs) if p > 0)


def test_speculative_sampling_matches_the_target_distribution():
    """First and second emitted tokens, over many draws, against p_0 and p_1 (drafts fixed at the
    second-likeliest token of each, so both acceptance and the residual draw are exercised)."""
    torch.manual_seed(0)
    vocab = 6
    logits = torch.tensor([[1.0, 0.2, -0.5, 0.7, 0.0, -1.0],
                           [0.1, 1.2, 0.3, -0.2, 0.9, 0.0],
                           [0.0, 0.0, 0.5, 0.5, -0.5, 1.0]])  # [3 positions, V]
    p = torch.softmax(logits, dim=-1)
    drafts = [3, 4]  # second-likeliest at positions 0 and 1
    n = 6000
    first = [0] * vocab
    second = [0] * vocab  # conditioned on the first draft being accepted
    for i in range(n):
        req = _sampling_req(i, drafts)
        (v,) = verify([req], [3], logits)
        first[v.tokens[0]] += 1
        if v.tokens[0] == drafts[0]:
            second[v.tokens[1]] += 1
    # chi-square with 5 degrees of freedom: P(X > 20.5) ~ 0.001
    assert _chi_square(first, p[0].tolist()) < 20.5
    assert _chi_square(second, p[1].tolist()) < 20.5
    # the acceptance rule matters: a biased rule (always accept the draft) would be far off
    assert abs(first[3] / n - float(p[0, 3])) < 4 * math.sqrt(float(p[0, 3]) * (1 - float(p[0, 3])) / n)
