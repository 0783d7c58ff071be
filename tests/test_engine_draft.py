"""Draft-model speculative decoding (``speculative_algorithm="draft"``): exact, with the prefix cache on.

* Speculation on vs off (the differential rule of ``test_engine_differential.py``: same greedy
  tokens, logprobs within 1e-4 up to each request's first floating-point tie) for Qwen3-Next dense
  and MoE, Qwen3.5 and NemotronH targets, each drafted by a perturbed copy of itself (it agrees
  with the target most of the time: full, partial and zero acceptance mix in every run), and across
  architectures (a small NemotronH — Mamba2 states — drafting for Qwen3-Next — Gated DeltaNet
  states); with the prefix cache on under eviction and retraction pressure, pages of 16, a
  checkpoint grid, multi-turn; no slot leaks afterwards.
* The draft model's memory is kept in step with the target's through all of it: every proposal
  equals the draft model's own greedy continuation of the request's tokens, computed by a plain
  engine running the draft model alone; a draft model identical to the target is (nearly) always
  accepted in full.
* Stops, EOS and ``max_new_tokens`` inside accepted runs, aborts mid-verify, zero-draft steps,
  grammars; configuration errors; the serve flags.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from hyla import Engine
from hyla.engine.args import EngineArgs
from hyla.engine.draft_drafter import DraftModelDrafter
from test_engine_differential import assert_drained, compare_outputs
from test_engine_speculative import (POOLS, WORKLOAD, _greedy, _ids, _watch_chains, abort_at_verify,
                                     spec_differential, stops_inside_accepted_runs)


def _draft(path, num_steps: int = 3) -> dict:
    return dict(speculative_algorithm="draft", speculative_draft_model_path=str(path), speculative_num_steps=num_steps)


class _Recorder:
    """Wraps a drafter's ``propose_batch`` (chains) and ``propose_tree_batch`` (trees): drafts per
    (prompt + output so far), as ``(ids, parents)`` (parents None: a chain)."""

    def __init__(self, drafter: DraftModelDrafter):
        self.drafts: dict[tuple[int, ...], tuple[list[int], list[int] | None]] = {}
        for name in ("propose_batch", "propose_tree_batch"):
            setattr(drafter, name, self._wrap(getattr(drafter, name)))

    def _wrap(self, real):
        def proposed(reqs, limits):
            out = real(reqs, limits)
            for r, d in zip(reqs, out):
                self.drafts[tuple(r.fill_ids)] = (list(d), None) if isinstance(d, list) else (list(d[0]), d[1])
            return out
        return proposed


def _run_differential(target, draft, on_opts: dict, seed: int = 0, num_steps: int = 3, workload: dict | None = None,
                      **spec) -> tuple[int, dict, dict]:
    """The differential workload (shared prefixes, checkpoints, second turns) with the draft model on
    vs a plain engine with the cache off. Returns (tokens compared, the spec engine's stats, its
    proposals keyed by the tokens they follow)."""
    compared, stats, rec = spec_differential(target, {**_draft(draft, num_steps), **spec}, on_opts, seed,
                                             setup=lambda eng: _Recorder(eng.scheduler.drafter), workload=workload)
    return compared, stats, rec.drafts


def _accepted_whole_and_in_part(stats: dict) -> bool:
    """Some verify steps accepted all their drafts, some only a part (and some none: ``spec_differential``)."""
    return stats["verdicts"]["full"] > 0 and stats["verdicts"]["partial"] > 0


@pytest.mark.parametrize("target, draft", [
    ("qwen3_next_dense_path", "qwen3_next_dense_draft_path"),
    ("qwen3_5_short_path", "qwen3_5_short_draft_path"),  # (2 layers, a layer of each kind: not about depth)
    ("nemotron_h_path", "nemotron_h_draft_path"),
])
def test_draft_is_exact_with_the_prefix_cache(target, draft, request):
    compared, stats, _ = _run_differential(request.getfixturevalue(target), request.getfixturevalue(draft), POOLS)
    assert compared > 60
    assert 1.5 < stats["spec_accept_length"] < 3.9  # accepted in full, in part and not at all
    assert _accepted_whole_and_in_part(stats)


@pytest.mark.slow
def test_draft_is_exact_on_moe(qwen3_next_moe_path, qwen3_next_moe_draft_path):
    # prompts of the differential tests' full lengths: the perturbed MoE draft (its routing flips)
    # agrees with its target less often over the shorter ones (accept length ~1.4)
    compared, stats, _ = _run_differential(qwen3_next_moe_path, qwen3_next_moe_draft_path, POOLS,
                                           workload=dict(WORKLOAD, scale=1.0))
    assert compared > 60 and stats["spec_accept_length"] > 1.5 and _accepted_whole_and_in_part(stats)


@pytest.mark.parametrize("opts", [
    dict(max_total_tokens=480, max_state_slots=40, max_running_requests=6, chunked_prefill_size=64),  # retraction
    dict(max_total_tokens=850, max_state_slots=40, max_running_requests=6, chunked_prefill_size=128,
         page_size=16),  # pages + grid: pending checkpoints from the per-token states
    dict(max_total_tokens=1000, max_state_slots=40, max_running_requests=6, chunked_prefill_size=128,
         checkpoint_alignment=8),
])
def test_draft_is_exact_under_pressure(qwen3_next_dense_path, qwen3_next_dense_draft_path, opts):
    compared, stats, _ = _run_differential(qwen3_next_dense_path, qwen3_next_dense_draft_path, opts, seed=1,
                                           num_steps=2)
    assert compared > 60 and stats["spec_accept_length"] > 1.3 and _accepted_whole_and_in_part(stats)


# --- the draft model's memory stays in step with the target's ------------------------------------


def _draft_model_continuations(draft, contexts: list[tuple[int, ...]], k: int,
                               **opts) -> dict[tuple[int, ...], list[int]]:
    """The draft model's own greedy ``k`` tokens after each context: a plain engine, no cache
    (``opts``: its options, ``POOLS`` by default)."""
    with Engine(draft, enable_prefix_cache=False, **(opts or POOLS)) as alone:
        outs = alone.generate(input_ids=[list(c) for c in contexts], sampling_params=_greedy(k))
    return {c: o["output_ids"] for c, o in zip(contexts, outs)}


@pytest.mark.parametrize("draft, opts", [
    ("nemotron_h_small_path", POOLS),
    ("nemotron_h_small_path", dict(max_total_tokens=700, max_state_slots=40, max_running_requests=6,
                                   chunked_prefill_size=128, page_size=16)),
    ("lfm2_path", POOLS),  # short convolutions: a conv window and no SSM state per slot
])
def test_proposals_are_the_draft_models_own_continuations(qwen3_next_dense_path, draft, opts, request):
    """A small NemotronH (or an LFM2) drafting for Qwen3-Next — another architecture: Mamba2 states
    beside Gated DeltaNet ones, KV of another shape: after prefix-cache hits, chunked prefills and
    partly accepted verify steps, every proposal is exactly what the draft model alone continues the
    request's tokens with — its KV and state followed every commit and rollback. (Under retraction
    and re-admission: ``test_draft_chains_verify_as_padded_chains_in_step_with_the_draft``, the same
    draft and workload, the model's verify steps as padded chains.)"""
    draft = request.getfixturevalue(draft)
    compared, stats, drafts = _run_differential(qwen3_next_dense_path, draft, opts, seed=2)
    assert compared > 60
    # hits happened, so the draft's memory was restored from the cache too (page 16 on this tight pool:
    # ~20% of the prompt tokens, the caller's checkpoints taking slots as finished turns do)
    assert stats["num_cached_tokens"] > 0.15 * stats["num_prompt_tokens"]
    proposals = {c: ids for c, (ids, _) in drafts.items() if ids}
    assert len(proposals) > 50
    want = _draft_model_continuations(draft, list(proposals), 3)
    differ = [c for c, d in proposals.items() if d != want[c][:len(d)]]
    assert not differ, f"{len(differ)} of {len(proposals)} proposals differ, e.g. {[proposals[c] for c in differ[:3]]} " \
                       f"vs {[want[c] for c in differ[:3]]}"


@pytest.mark.parametrize("draft, opts, draft_chains, accepted, trees", [
    ("qwen3_next_dense_draft_path", POOLS, True, True, False),
    # retraction; Mamba2's chains (the small NemotronH's drafts are all rejected)
    ("nemotron_h_small_path", dict(max_total_tokens=600, max_state_slots=36, max_running_requests=6,
                                   chunked_prefill_size=64), True, False, False),
    ("jamba_short_path", POOLS, False, False, False),  # its Mamba1 mixer told to run no chains (a new mixer's default)
    ("qwen3_next_dense_draft_path", POOLS, True, True, True),  # trees: padded trees, the draft model's too
])
def test_draft_chains_verify_as_padded_chains_in_step_with_the_draft(qwen3_next_dense_path, draft, opts, draft_chains,
                                                                    accepted, trees, request, monkeypatch):
    """With ``compile_decode`` (or fused decode kernels) a draft model's chains are verified as
    padded chains (``ModelRunner.forward_chains``, the compiled graph or CUDA graphs), as n-gram
    chains are, and the draft model runs as the model does: its draft steps (rows over its scratch
    slots, ``speculative.row_batch``) and decode steps through its own compiled graphs, its pass over
    a verify step's chains as padded chains too where its layers allow (every mixer hyla has; a draft
    with a mixer that does not say ``chain_verify`` runs that pass as an eager extend). Exact, and the draft model's states stay in step
    through all of it — a chain shorter than the width leaves its last fed token's state in a
    scratch slot, where the draft model must write its own too (every proposal is the draft model's
    own continuation). ``trees`` (:data:`TREE`): verify steps as padded trees (``verify_trees``), the draft
    model's pass over them too, so each tree's greedy path is the draft model's own continuation.
    ``torch.compile`` is replaced by the function itself: what is tested is the
    engine's wiring and the chains, not inductor
    (``test_compiled_verify_is_exact_and_compiles_nothing_after_start_up``)."""
    monkeypatch.setattr(torch, "compile", lambda fn, **options: fn)
    if not draft_chains:
        from hyla.model.jamba import Mamba1Mixer

        monkeypatch.setattr(Mamba1Mixer, "chain_verify", False)
    draft = request.getfixturevalue(draft)
    calls, draft_calls, compiled_rows = {"n": 0}, {"n": 0}, {"n": 0}

    def setup(eng):
        runner, draft_runner = eng.scheduler.runner, eng.scheduler.drafter.runner
        width = TREE["speculative_num_draft_tokens"] if trees else 4  # drafts per step + the last sampled token
        assert runner.compiled and runner.verify_width == width and runner.verify_trees == trees
        assert draft_runner.compiled and draft_runner.verify_width == (width if draft_chains else None)
        assert draft_runner.verify_trees == (trees and draft_chains)
        _watch_chains(eng, calls, width=None)
        real_chains, real_compiled = draft_runner.forward_chains, draft_runner._run_compiled

        def chains(*args, **kw):
            draft_calls["n"] += 1
            return real_chains(*args, **kw)

        def compiled(batch):
            compiled_rows["n"] += batch.kv_table is not None and batch.state_slot_list[0] in drafting
            return real_compiled(batch)

        drafting = {s for row in eng.scheduler.drafter.scratch_states for s in row}  # the drafting beams' slots
        draft_runner.forward_chains, draft_runner._run_compiled = chains, compiled
        return _Recorder(eng.scheduler.drafter)

    compared, stats, rec = spec_differential(qwen3_next_dense_path, {**_draft(draft), "compile_decode": True,
                                                                     **(TREE if trees else {})}, opts,
                                             seed=2, setup=setup)
    assert compared > 60 and calls["n"] > 0 and compiled_rows["n"] > 0
    assert (calls.get("trees", 0) > 0) == trees
    assert (draft_calls["n"] == calls["n"]) if draft_chains else draft_calls["n"] == 0
    if accepted:
        assert _accepted_whole_and_in_part(stats)
    proposals = {c: _greedy_path(ids, parents) for c, (ids, parents) in rec.drafts.items() if ids}
    want = _draft_model_continuations(draft, list(proposals), 3)
    differ = [c for c, d in proposals.items() if d != want[c][:len(d)]]
    assert not differ, f"{len(differ)} of {len(proposals)} proposals differ"


def _greedy_path(ids: list[int], parents: list[int] | None) -> list[int]:
    """A proposal's greedy chain: a chain's drafts; a tree's first node at each depth while each continues the
    one before (``speculative.tree_of`` puts the greedy node first at its depth; parents: 0 the root)."""
    if parents is None:
        return ids
    path, node = [], 0
    for j, parent in enumerate(parents):
        if parent == node:
            path.append(ids[j])
            node = j + 1
    return path


TREE = dict(speculative_eagle_topk=2, speculative_num_draft_tokens=7)  # beams of 2, 6 nodes, depth 3


@pytest.mark.slow
@pytest.mark.parametrize("opts", [
    POOLS,
    dict(max_total_tokens=560, max_state_slots=64, max_running_requests=6, chunked_prefill_size=64),  # retraction
    dict(max_total_tokens=700, max_state_slots=64, max_running_requests=6, chunked_prefill_size=128,
         page_size=16),  # the accepted path's KV (both models') moves inside pages
])
def test_draft_trees_are_exact_and_follow_the_draft_model(qwen3_next_dense_path, qwen3_next_dense_draft_path, opts):
    """Trees (``speculative_eagle_topk=2``): exact; every tree holds the draft model's own greedy
    continuation as a path from its root, and every node is one of the draft model's two likeliest
    tokens after the request's tokens and the node's ancestors (each beam drafted from its own
    path's state and KV, siblings from copies of their parent's state)."""
    compared, stats, drafts = _run_differential(qwen3_next_dense_path, qwen3_next_dense_draft_path, opts, seed=3,
                                                **TREE)
    assert compared > 60 and stats["spec_accept_length"] > 1.5 and _accepted_whole_and_in_part(stats)
    trees = {c: (ids, parents) for c, (ids, parents) in drafts.items() if parents is not None}
    assert len(trees) > 30 and any(len(ids) == 6 for ids, _ in trees.values())
    assert any(len(set(parents)) < len(parents) for _, parents in trees.values())  # siblings
    # The draft model alone, one request per root-to-leaf path of each tree (prompt: the tree's
    # context and the path; prompt logprobs from the path's first node): its two likeliest tokens
    # after the context and after every node of the path, the leaf's from the output token. Every
    # node is on such a path: all of them are checked.
    leaves, prompts = [], []
    for context, (ids, parents) in trees.items():
        for leaf in set(range(1, len(ids) + 1)) - set(parents):
            path, p = [], leaf
            while p:
                path.append(p)
                p = parents[p - 1]
            leaves.append((context, path[::-1]))
            prompts.append(list(context) + [ids[p - 1] for p in reversed(path)])
    with Engine(qwen3_next_dense_draft_path, enable_prefix_cache=False, **POOLS) as alone:
        outs = alone.generate(input_ids=prompts, return_logprob=True, sampling_params=_greedy(1, top_logprobs_num=2),
                              logprob_start_len=[len(c) for c, _ in leaves])
    top2: dict[tuple, list] = {}  # (context, node): the (logprob, token)s after its path (node 0: the root)
    for (context, path), out in zip(leaves, outs):
        rows = out["meta_info"]["input_top_logprobs"] + out["meta_info"]["output_top_logprobs"]
        for node, row in zip([0, *path], rows, strict=True):
            top2[context, node] = row
    for context, (ids, parents) in trees.items():
        children: dict[int, dict[int, int]] = {}
        for j, parent in enumerate(parents):
            children.setdefault(parent, {})[ids[j]] = j + 1
            assert ids[j] in [t for _, t in top2[context, parent]], \
                f"node {j + 1} of the tree {ids}, {parents}: the draft model's top 2 are {top2[context, parent]}"
        node = 0
        for _ in range(min(3, len(ids))):  # the draft model's greedy continuation: a path from the root
            greedy = max(top2[context, node])[1]
            assert greedy in children.get(node, {}), \
                f"the draft model's greedy {greedy} after node {node} is not in the tree {ids}, {parents}"
            node = children[node][greedy]


def test_the_target_as_its_own_draft_is_accepted_in_full(qwen3_next_dense_path):
    """Drafting with the target itself (prefix cache off: the draft's memory is then the requests'
    own slots): every draft is the target's own greedy token, so a verify step accepts all
    ``num_steps`` drafts and adds its bonus token (up to a near-tie between the draft's decode steps
    and the verify step's extend)."""
    prompts = [_ids(n, s) for s, n in ((11, 30), (12, 75), (13, 140), (14, 52))]
    with Engine(qwen3_next_dense_path, enable_prefix_cache=False, **POOLS) as ref:
        want = ref.generate(input_ids=prompts, sampling_params=_greedy(41), return_logprob=True)
    with Engine(qwen3_next_dense_path, debug_checks=True, enable_prefix_cache=False, **_draft(qwen3_next_dense_path, 4),
                **POOLS) as eng:
        got = eng.generate(input_ids=prompts, sampling_params=_greedy(41), return_logprob=True)
        accept = eng.get_stats()["spec_accept_length"]
        assert_drained(eng)
        # the draft's KV and states live on the same slots: each token and state slot holds both models'
        layout = eng.model_config.cache_layout
        assert eng.kv_pool.bytes_per_token == 2 * layout.kv_bytes_per_token
        assert eng.state_pool.bytes_per_slot == 2 * layout.state_bytes_per_slot
        assert len(eng.kv_pool.k_buffers) == 2 * eng.model_config.num_attention_layers
    compare_outputs(got, want)
    assert accept > 4.8, f"accept length {accept:.2f} of at most 5"  # 40 tokens after the first: 8 steps of 5
    assert all(o["meta_info"]["spec_verify_ct"] <= 9 for o in got)


# --- stops, aborts, zero drafts, grammars -----------------------------------------------------------


def test_stops_inside_an_accepted_draft_run(qwen3_next_dense_path):
    """EOS, a stop token and max_new_tokens landing inside a fully accepted run (the target as its
    own draft: every run is accepted in full)."""
    ids = _ids(30, 5)
    with Engine(qwen3_next_dense_path, enable_prefix_cache=False, **POOLS) as ref:
        full = ref.generate(input_ids=ids, sampling_params=_greedy(24))["output_ids"]
    with Engine(qwen3_next_dense_path, debug_checks=True, **_draft(qwen3_next_dense_path, 8), **POOLS) as eng:
        chunks = stops_inside_accepted_runs(eng, ids, full, stop_at=6, eos_at=11)  # 6: the first step's 6th draft
        assert max(len(c["output_ids"]) for c in chunks) == 9  # 8 drafts and the bonus in one step
        assert_drained(eng)


def test_abort_mid_verify_zero_drafts_and_penalties(qwen3_next_dense_path, qwen3_next_dense_draft_path):
    ids = _ids(40, 6)
    with Engine(qwen3_next_dense_path, enable_prefix_cache=False, **POOLS) as ref:
        want = ref.generate(input_ids=ids, sampling_params=_greedy(30), return_logprob=True)
        pen = ref.generate(input_ids=ids, sampling_params=_greedy(12, repetition_penalty=1.3), return_logprob=True)
    with Engine(qwen3_next_dense_path, debug_checks=True, **_draft(qwen3_next_dense_draft_path), **POOLS) as eng:
        abort_at_verify(eng, "victim")
        outs = eng.generate(input_ids=[ids, ids], sampling_params=_greedy(30), return_logprob=True,
                            rid=["victim", "other"])
        assert outs[0]["meta_info"]["finish_reason"]["type"] == "abort"
        assert outs[0]["output_ids"] == want["output_ids"][: len(outs[0]["output_ids"])]
        compare_outputs([outs[1]], [want])
        # penalties: zero-draft verify steps all the way (the draft model still follows every token)
        got = eng.generate(input_ids=ids, sampling_params=_greedy(12, repetition_penalty=1.3), return_logprob=True)
        compare_outputs([got], [pen])
        assert got["meta_info"]["spec_accept_length"] == 1.0 and got["meta_info"]["spec_verify_ct"] == 11
        # a max_new_tokens of 2 leaves room for no draft at its one verify step
        two = eng.generate(input_ids=ids, sampling_params=_greedy(2))
        assert two["output_ids"] == want["output_ids"][:2] and two["meta_info"]["spec_accept_length"] == 1.0
        assert_drained(eng)


def test_draft_with_a_grammar_on_the_default_model():
    """A JSON-schema request with the default model as its own draft: drafts cut to their
    grammar-valid prefix, output exactly that of constrained decoding without speculation, and
    what the grammar accepts."""
    from hyla.engine.engine import DEFAULT_MODEL_DIR
    from test_engine_grammar import GREEDY, PROMPTS, SCHEMA, check_schema  # (it imports the server: fastapi)

    params = {**GREEDY, "json_schema": SCHEMA}
    with Engine(enable_prefix_cache=False) as ref:
        want = ref.generate(PROMPTS[0], params, return_logprob=True)
    with Engine(debug_checks=True, **_draft(DEFAULT_MODEL_DIR)) as eng:
        got = eng.generate(PROMPTS[0], params, return_logprob=True)
        assert_drained(eng)
    compare_outputs([got], [want])
    check_schema(json.loads(got["text"]), SCHEMA)
    # the draft model drafts unconstrained: where the grammar forces another token than its argmax,
    # the draft is cut there (or rejected), so even the target as its own draft is not always accepted
    assert got["meta_info"]["spec_accept_length"] > 1.2


# --- configuration errors ----------------------------------------------------------------------


def test_draft_configuration_errors(qwen3_next_dense_path, tiny_ckpt_dir, tmp_path):
    import checkpoints

    with pytest.raises(ValueError, match="needs speculative_draft_model_path"):
        EngineArgs(speculative_algorithm="draft")
    with pytest.raises(ValueError, match="is for speculative_algorithm='draft'"):
        EngineArgs(speculative_algorithm="ngram", speculative_draft_model_path="/x")
    with pytest.raises(ValueError, match="at least 2"):
        EngineArgs(speculative_algorithm="draft", speculative_draft_model_path="/x", speculative_eagle_topk=2,
                   speculative_num_draft_tokens=1)
    with pytest.raises(ValueError, match="no config.json in draft model directory"):
        Engine(qwen3_next_dense_path, **_draft(tmp_path / "missing"), **POOLS)
    small_vocab = checkpoints.make_qwen3_next(tiny_ckpt_dir, vocab_size=1024, num_hidden_layers=4,
                                              layer_types=["linear_attention"] * 3 + ["full_attention"])
    with pytest.raises(ValueError, match=r"vocabulary \(1024 tokens\) is not the model's \(2048\)"):
        Engine(qwen3_next_dense_path, **_draft(small_vocab), **POOLS)
    short = checkpoints.make_qwen3_next(tiny_ckpt_dir, max_position_embeddings=1024, num_hidden_layers=4,
                                        layer_types=["linear_attention"] * 3 + ["full_attention"])
    with pytest.raises(ValueError, match=r"context \(1024 tokens\) is shorter than the engine's context length "
                                         r"\(4096\): set context_length <= 1024"):
        Engine(qwen3_next_dense_path, **_draft(short), **POOLS)
    with Engine(qwen3_next_dense_path, context_length=1024, **_draft(short), **POOLS) as eng:  # as the message says
        assert eng.generate(input_ids=_ids(20, 1), sampling_params=_greedy(4))["meta_info"]["completion_tokens"] == 4


def test_a_draft_with_another_tokenizer_is_refused(tmp_path):
    """Same vocabulary size, different tokens: the default model against a copy of itself whose
    tokenizer has two tokens swapped."""
    from hyla.engine.engine import DEFAULT_MODEL_DIR

    other = tmp_path / "other"
    shutil.copytree(DEFAULT_MODEL_DIR, other)
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = [t for t, i in vocab.items() if i in (300, 301)]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (other / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(ValueError, match="tokenizer differs from the model's .token id 300"):
        Engine(**_draft(other), **POOLS)


def test_serve_flags(capsys, qwen3_next_dense_path, tmp_path):
    """``hyla serve --speculative-algorithm draft --speculative-draft-model-path PATH`` reaches the
    engine options; a bad combination or a missing draft directory exits 2 with a message."""
    from hyla.server import cli
    from test_server_cli import _parse

    opts = cli.engine_options(_parse(["--speculative-algorithm", "draft", "--speculative-draft-model-path",
                                      str(qwen3_next_dense_path), "--speculative-num-steps", "2"]))
    args = EngineArgs(**opts)
    assert args.speculative_algorithm == "draft" and args.num_draft_tokens == 2
    assert args.speculative_draft_model_path == str(qwen3_next_dense_path)
    assert cli.run(_parse(["--speculative-algorithm", "draft"])) == 2
    assert "needs speculative_draft_model_path" in capsys.readouterr().err
    assert cli.run(_parse(["--speculative-algorithm", "draft", "--speculative-draft-model-path",
                           str(tmp_path / "missing")])) == 2
    assert "no config.json in draft model directory" in capsys.readouterr().err
