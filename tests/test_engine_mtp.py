"""MTP speculative decoding (``speculative_algorithm="mtp"``): exact, with the prefix cache on.

* Speculation on vs off (the differential rule of ``test_engine_differential.py``: same greedy
  tokens, logprobs within 1e-4 up to each request's first floating-point tie) on Qwen3-Next dense
  and MoE, Qwen3.5 and Qwen3.5-MoE checkpoints with random ``mtp.*`` heads, with the prefix cache on
  under eviction and retraction pressure, multi-turn; no slot leaks afterwards.
* The drafts themselves are the same with the cache on or off (the MTP sees the same context after a
  cache hit or a retraction: ``hyla/engine/mtp_drafter.py``).
* The drafter computes the MTP of the checkpoint: its drafts and logits match an independent
  computation over the whole sequence (transformers' Qwen3-Next model and decoder layer).
* The default model's trained head is accepted (accept length > 1.3), and stops land inside
  accepted runs.
"""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch

from hyla import Engine
from hyla.engine.args import EngineArgs
from hyla.engine.mtp_drafter import MtpDrafter
from test_engine_differential import assert_drained, compare_outputs, run
from test_engine_speculative import POOLS, _count_calls, _greedy, _ids, _watch_chains, spec_differential

MTP = dict(speculative_algorithm="mtp", speculative_num_steps=3)


def _run_differential(path, on_opts: dict, seed: int = 0, num_steps: int = 3) -> int:
    """The differential workload with MTP on vs a plain engine with the cache off; the tokens compared."""
    return spec_differential(path, dict(speculative_algorithm="mtp", speculative_num_steps=num_steps), on_opts,
                             seed)[0]


@pytest.mark.parametrize("arch", ["qwen3_next_dense_mtp_path", "qwen3_5_short_mtp_path",  # (2 layers: not about depth)
                                  "qwen3_5_moe_mtp_path"])
def test_mtp_is_exact_with_the_prefix_cache(arch, request):
    assert _run_differential(request.getfixturevalue(arch), POOLS) > 60


@pytest.mark.slow
def test_mtp_is_exact_on_qwen3_next_moe(qwen3_next_moe_mtp_path):
    assert _run_differential(qwen3_next_moe_mtp_path, POOLS) > 60


@pytest.mark.parametrize("opts", [
    dict(max_total_tokens=440, max_state_slots=40, max_running_requests=6, chunked_prefill_size=64),  # retraction
    dict(max_total_tokens=850, max_state_slots=40, max_running_requests=6, chunked_prefill_size=128,
         page_size=16),  # pages + grid: pending checkpoints from the per-token states
    dict(max_total_tokens=1000, max_state_slots=40, max_running_requests=6, chunked_prefill_size=128,
         checkpoint_alignment=8),
])
def test_mtp_is_exact_under_pressure(qwen3_next_dense_mtp_path, opts):
    assert _run_differential(qwen3_next_dense_mtp_path, opts, seed=1, num_steps=2) > 60


# --- the drafts do not depend on the cache ---------------------------------------------------------


class _Recorder:
    """Wraps a drafter's ``propose_batch`` (or ``propose_tree_batch``: ``trees``): drafts (trees: drafts
    and parents) per (prompt, output length)."""

    def __init__(self, drafter: MtpDrafter, trees: bool = False):
        self.method = "propose_tree_batch" if trees else "propose_batch"
        self.drafter, self.real = drafter, getattr(drafter, self.method)
        self.drafts: dict[tuple, list[int] | tuple[list[int], list[int] | None]] = {}
        setattr(drafter, self.method, self)

    def __call__(self, reqs, limits):
        out = self.real(reqs, limits)
        for r, d in zip(reqs, out):
            self.drafts[(tuple(r.input_ids), len(r.output_ids))] = d if isinstance(d, tuple) else list(d)
        return out


_CACHE_OFF_RUNS: list[tuple[dict, list]] = []  # the cache-off side of the test below: (drafts, outputs)


@pytest.mark.parametrize("mode", ["extend", "chains", "trees"])
def test_mtp_drafts_are_the_same_with_the_cache_on_or_off(default_mtp_path, mode, monkeypatch):
    """Multi-turn chats sharing system prompts on the default model (its trained head): every draft,
    keyed by request and output length, is the same with the cache off (large pools) and on (pools
    small enough for eviction and retraction). A retracted request resumes with one plain step
    (its re-prefill samples a token), so it proposes at output lengths the other run skips: only the
    proposals both runs made are compared, and they must be most of them. ``chains``: the cache-on
    engine runs with ``compile_decode``, its verify steps as padded chains that return the hidden
    states the MTP reads (``ModelRunner.forward_chains``), and so its decode steps through the graphs
    compiled for them, and the MTP head's forwards through its own (decode batches of a row per pair:
    ``MtpDrafter._rows``); ``torch.compile`` is replaced by the function itself (what is tested is the
    wiring and the chains' hidden states, not inductor). ``trees``: both engines draft trees
    (:data:`TREE`), the cache-on one with ``compile_decode`` (its beams' rows through the head's
    graphs; verify steps as padded trees, ``verify_trees``, whose hidden states the MTP reads along each
    accepted path), and every tree is the same."""
    chains, trees = mode == "chains", mode == "trees"
    if chains or trees:
        monkeypatch.setattr(torch, "compile", lambda fn, **options: fn)
    rng = random.Random(3)
    tok = lambda n: [rng.randrange(3, 4000) for _ in range(n)]  # noqa: E731
    systems = [tok(40), tok(70)]
    wave1 = [{"ids": systems[i % 2] + tok(rng.randrange(5, 60)), "max_new": 24, "ckpt": [40 if i % 2 == 0 else 70]}
             for i in range(10)]
    followups = [tok(5) for _ in wave1]
    drafts, outs, calls = {}, {}, {"n": 0}
    for cache, pool in ((False, 8192), (True, 360)):
        if not cache and not trees and _CACHE_OFF_RUNS:  # run by the other parameter: the same engine and workload
            drafts[cache], outs[cache] = _CACHE_OFF_RUNS[0]
            continue
        opts = dict(max_total_tokens=pool, max_state_slots=64 if trees else 30, max_running_requests=6,
                    chunked_prefill_size=64, **(TREE if trees else MTP))
        compiled = cache and mode != "extend"
        with Engine(default_mtp_path, enable_prefix_cache=cache, debug_checks=True, compile_decode=compiled,
                    **opts) as eng:
            runner = eng.scheduler.runner
            width = {"chains": 4, "trees": TREE["speculative_num_draft_tokens"]}.get(mode) if compiled else None
            assert (runner.compiled, runner.verify_width, runner.verify_trees, runner.return_hidden,
                    eng.scheduler.drafter.compiled) == (compiled, width, compiled and trees, True, compiled)
            _watch_chains(eng, calls, width=None)
            rec = _Recorder(eng.scheduler.drafter, trees=trees)
            out1 = run(eng, wave1)
            wave2 = [{"ids": w["ids"] + o["output_ids"] + f, "max_new": 16, "ckpt": []}
                     for w, o, f in zip(wave1, out1, followups)]
            out2 = run(eng, wave2)
            drafts[cache], outs[cache] = rec.drafts, out1 + out2
            stats = eng.get_stats()
            assert_drained(eng)
        if not cache and not trees:
            _CACHE_OFF_RUNS.append((drafts[cache], outs[cache]))
    assert stats["num_cached_tokens"] > 0.3 * stats["num_prompt_tokens"]
    assert stats["num_evicted_tokens"] > 0 and stats["num_retractions"] > 0
    assert (calls["n"] > 0) == (chains or trees) and (calls.get("trees", 0) > 0) == trees
    assert stats["spec_accept_length"] > 1.3
    compare_outputs(outs[True], outs[False])
    common = drafts[True].keys() & drafts[False].keys()
    assert len(common) > 0.7 * max(len(drafts[True]), len(drafts[False])) and len(common) > 100
    assert sum(len(drafts[True][k][0] if trees else drafts[True][k]) for k in common) > 200
    if trees:
        assert sum(drafts[True][k][1] is not None for k in common) > 50
    differ = [k for k in common if drafts[True][k] != drafts[False][k]]
    assert not differ, f"{len(differ)} of {len(common)} proposals differ, e.g. {differ[:2]}"


# --- the drafter computes the checkpoint's MTP ----------------------------------------------------


class _ReferenceMtp:
    """Independent of hyla: transformers' Qwen3-Next gives the model's final hidden states (after
    its final norm); transformers' decoder layer, RMSNorm and RoPE with the ``mtp.*`` weights run the
    MTP over the whole sequence of pairs ``(tokens[t+1], hidden[t])`` with a plain causal mask."""

    @torch.no_grad()
    def __init__(self, path):
        from safetensors.torch import load_file
        from transformers import AutoConfig, AutoModelForCausalLM
        from transformers.models.qwen3_next import modeling_qwen3_next as hf

        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        weights = {k: v.float() for k, v in load_file(path / "model.safetensors").items() if k.startswith("mtp.")}
        cfg = AutoConfig.from_pretrained(path)
        cfg.layer_types, cfg.num_hidden_layers, cfg._attn_implementation = ["full_attention"], 1, "eager"
        self.layer = hf.Qwen3NextDecoderLayer(cfg, 0).eval()
        self.layer.load_state_dict({k.removeprefix("mtp.layers.0."): v for k, v in weights.items()
                                    if k.startswith("mtp.layers.0.")})
        self.norms = {}
        for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
            self.norms[name] = hf.Qwen3NextRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
            self.norms[name].weight.copy_(weights[f"mtp.{name}.weight"])
        self.fc, self.rotary = weights["mtp.fc.weight"], hf.Qwen3NextRotaryEmbedding(cfg)

    @torch.no_grad()
    def logits(self, tokens: list[int], num_steps: int, forced: list[int] = ()) -> list[torch.Tensor]:
        """``tokens``: the prompt and the first sampled token. ``num_steps`` autoregressive steps, each
        appending ``(next token, the MTP's own last hidden)``, the next token the step's argmax or, while
        there are, the ``forced`` ones. Returns each step's logits ``[V]``."""
        embed, norms = self.model.model.embed_tokens, self.norms
        hidden = self.model.model(input_ids=torch.tensor([tokens[:-1]])).last_hidden_state  # [1, n, H]
        nxt = list(tokens[1:])  # the token of each pair
        out = []
        for step in range(num_steps):
            x = torch.cat([norms["pre_fc_norm_embedding"](embed(torch.tensor([nxt]))),
                           norms["pre_fc_norm_hidden"](hidden)], dim=-1) @ self.fc.t()  # [1, T, H]
            t = x.shape[1]
            pos = torch.arange(t)[None]
            mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
            g = norms["norm"](self.layer(x, position_embeddings=self.rotary(x, pos), attention_mask=mask,
                                         position_ids=pos))
            out.append(self.model.lm_head(g[0, -1]))
            nxt.append(forced[step] if step < len(forced) else int(out[-1].argmax()))
            hidden = torch.cat([hidden, g[:, -1:]], dim=1)
        return out


def _reference_mtp(path, tokens: list[int], num_steps: int) -> tuple[list[int], torch.Tensor]:
    """The drafts of ``num_steps`` greedy MTP steps after ``tokens`` (the prompt and the first
    sampled token) and the first step's logits (:class:`_ReferenceMtp`)."""
    logits = _ReferenceMtp(path).logits(tokens, num_steps)
    return [int(x.argmax()) for x in logits], logits[0]


@pytest.mark.parametrize("ckpt", ["qwen3_next_dense_mtp_path", "default_mtp_path"])
def test_mtp_drafts_match_an_independent_reference(ckpt, request):
    path = request.getfixturevalue(ckpt)
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    prompts = [[random.Random(s).randrange(3, vocab) for _ in range(n)] for s, n in ((1, 37), (2, 90))]
    with Engine(path, **MTP, **POOLS) as eng:
        drafter = eng.scheduler.drafter
        seen, real = [], drafter.head.hidden_states

        def head_hidden(batch, hidden):
            g = real(batch, hidden)
            if batch.is_decode:  # a draft step (or a verify step's pairs: after the first draft step)
                seen.append(drafter.head.target.lm_head(g).float())
            return g

        drafter.head.hidden_states = head_hidden
        for ids in prompts:
            seen.clear()
            rec = _Recorder(drafter)
            out = eng.generate(input_ids=ids, sampling_params=_greedy(5))  # 3 drafts at the first decode step
            setattr(drafter, rec.method, rec.real)
            first = out["output_ids"][0]
            drafts = rec.drafts[(tuple(ids), 1)]
            want, want_logits = _reference_mtp(path, ids + [first], 3)
            assert drafts == want
            torch.testing.assert_close(seen[0][0], want_logits, rtol=1e-3, atol=1e-3)


# --- trees (speculative_eagle_topk > 1) ----------------------------------------------------------

TREE = dict(speculative_algorithm="mtp", speculative_num_steps=3, speculative_eagle_topk=2,
            speculative_num_draft_tokens=7)  # beams of 2, at most 6 nodes, depth 3


@pytest.mark.parametrize("arch, opts", [
    ("default_mtp_path", POOLS),  # its trained head: trees accepted whole, in part, off the greedy chain
    ("qwen3_next_dense_mtp_path",
     dict(max_total_tokens=340, max_state_slots=64, max_running_requests=6, chunked_prefill_size=64)),  # retraction
    pytest.param("qwen3_5_moe_mtp_path", dict(max_total_tokens=850, max_state_slots=64, max_running_requests=6,
                                              chunked_prefill_size=128, page_size=16),  # pages: moves inside pages
                 marks=pytest.mark.slow),
])
def test_mtp_trees_are_exact(arch, opts, request):
    """MTP trees: the differential (speculation on, the prefix cache on under pressure, vs a plain
    engine with the cache off); trees with siblings were verified, and (the trained head) some
    accepted path left the greedy chain, so the commit moved its KV and MTP entries."""
    def setup(eng):
        return _Recorder(eng.scheduler.drafter, trees=True), _count_calls(eng.kv_pool, "copy")

    compared, stats, (rec, moves) = spec_differential(request.getfixturevalue(arch), TREE, opts, seed=2, setup=setup)
    assert compared > 60
    trees = [(ids, parents) for ids, parents in rec.drafts.values() if parents is not None]
    assert len(trees) > 10 and any(len(set(parents)) < len(parents) for _, parents in trees)  # siblings
    if arch == "default_mtp_path":
        assert stats["spec_accept_length"] > 1.3 and stats["verdicts"]["full"] > 0 and moves["n"] > 0


def test_mtp_trees_follow_the_head(qwen3_next_dense_mtp_path):
    """Every node of a tree is one of the MTP head's two likeliest tokens after the request's tokens
    and the node's ancestors, and the head's greedy continuation is a path from the root: checked
    against the independent reference (:class:`_ReferenceMtp`, over each node's path)."""
    path = qwen3_next_dense_mtp_path
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    prompts = [[random.Random(s).randrange(3, vocab) for _ in range(n)] for s, n in ((4, 41), (5, 23))]
    with Engine(path, **TREE, **POOLS) as eng:
        rec = _Recorder(eng.scheduler.drafter, trees=True)
        outs = eng.generate(input_ids=prompts, sampling_params=_greedy(12))
        assert_drained(eng)
    ref = _ReferenceMtp(path)
    for ids, out in zip(prompts, outs):
        drafts, parents = rec.drafts[(tuple(ids), 1)]  # the first decode step's tree
        assert len(drafts) == 6 and parents is not None
        tokens = ids + out["output_ids"][:1]
        paths = {0: []}  # node (0: the last sampled token) -> the drafts on its path
        for j, parent in enumerate(parents, start=1):
            paths[j] = paths[parent] + [drafts[j - 1]]
        logp = {}  # node -> the reference's log-probabilities after its path

        def after(node):
            if node not in logp:
                logp[node] = ref.logits(tokens, len(paths[node]) + 1, forced=paths[node])[-1].log_softmax(-1)
            return logp[node]

        for j, parent in enumerate(parents, start=1):
            second = after(parent).topk(2).values[-1]
            assert after(parent)[drafts[j - 1]] >= second - 1e-3, f"node {j} of {drafts}, {parents}"
        node = 0
        for _ in range(3):
            greedy = int(after(node).argmax())
            node = next((j for j, p in enumerate(parents, start=1) if p == node and drafts[j - 1] == greedy), None)
            assert node is not None, f"the head's greedy {greedy} is not in the tree {drafts}, {parents}"


def test_mtp_tree_verify_steps_write_the_entries_a_prefill_writes(default_mtp_path):
    """A verify step's tree leaves the MTP entries (and hidden state) of its accepted path exactly as
    a prefill of the same tokens does (``observe``: each fed token paired with its parent's hidden
    state at its depth's position): after every verify step of a greedy run with trees (some
    accepted paths leave the greedy chain), the next tree equals the one a fresh prefill of the
    prompt and the output so far drafts (cache off, fp32)."""
    opts = dict(enable_prefix_cache=False, max_total_tokens=4096, max_state_slots=64, max_running_requests=4)
    params = {"temperature": 0, "max_new_tokens": 48, "ignore_eos": True}
    with Engine(default_mtp_path, **opts, **TREE) as eng:
        prompt = _chat_prompts(eng)[1]
        drafter = eng.scheduler.drafter
        rec = _Recorder(drafter, trees=True)
        off_chain = {"n": 0}  # accepted paths that left the greedy chain (the first node of each depth)
        real_verified = drafter.verified

        def verified(reqs, verdicts):
            for r, v in zip(reqs, verdicts):
                depth = [0]
                for q in r.fed_parents()[1:]:
                    depth.append(depth[q] + 1)
                off_chain["n"] += any(depth.index(depth[j]) != j for j in v.path)
            return real_verified(reqs, verdicts)

        drafter.verified = verified
        out = eng.generate(input_ids=prompt, sampling_params=params)["output_ids"]
        during = {n: tree for (_, n), tree in rec.drafts.items()}
        assert off_chain["n"] > 0
        compared = 0
        for n, tree in during.items():
            if not 2 <= n <= params["max_new_tokens"] - 8:  # (near the end the run's budget shrinks)
                continue
            fresh = _Recorder(drafter, trees=True)
            eng.generate(input_ids=prompt + out[:n - 1], sampling_params=_greedy(8))
            setattr(drafter, fresh.method, fresh.real)
            assert fresh.drafts[(tuple(prompt + out[:n - 1]), 1)] == tree, f"after {n} output tokens"
            compared += 1
        assert compared > 10
        assert_drained(eng)


def test_mtp_trees_beside_a_grammar(default_mtp_path):
    """In one batch, a JSON-schema request drafts a chain (its masks follow one path), cut to its
    grammar-valid prefix, while an unconstrained one drafts trees; both outputs are exactly those
    of decoding without speculation."""
    from test_engine_grammar import GREEDY, PROMPTS, SCHEMA, check_schema  # (it imports the server: fastapi)

    params = [{**GREEDY, "json_schema": SCHEMA}, GREEDY]
    prompts = [PROMPTS[0], PROMPTS[1]]
    with Engine(default_mtp_path, enable_prefix_cache=False) as ref:
        want = ref.generate(prompts, params, return_logprob=True)
        assert ref.model.mtp_weights == {} and ref.mtp_head is None  # no MTP: no mtp.* tensor read
    with Engine(default_mtp_path, debug_checks=True, **TREE) as eng:
        rec = _Recorder(eng.scheduler.drafter, trees=True)
        got = eng.generate(prompts, params, return_logprob=True)
        assert_drained(eng)
    compare_outputs(got, want)
    check_schema(json.loads(got[0]["text"]), SCHEMA)
    shapes: dict[tuple, set] = {}  # each prompt's token ids -> the shapes of its drafts
    for (prompt, _), (ids, parents) in rec.drafts.items():
        if ids:
            shapes.setdefault(prompt, set()).add("chain" if parents is None else "tree")
    assert len(shapes) == 2 and sorted("tree" in s for s in shapes.values()) == [False, True]


def test_speculation_keeps_the_prefix_caches_hits(default_mtp_path):
    """Speculation costs no prefix-cache reuse (SGLang's EAGLE dropped it from 97% to 40-53%,
    #32459): multi-turn chats on the default model (its trained head: drafts accepted), each turn
    sent after the previous answers, find exactly the cached tokens per request with MTP chains, MTP
    trees and n-gram drafts that they find without speculation (pools large enough that nothing is
    evicted: the tree holds the same tokens and checkpoints either way)."""
    rng = random.Random(11)
    tok = lambda n: [rng.randrange(3, 4000) for _ in range(n)]  # noqa: E731
    system = tok(50)
    turn = [{"ids": system + tok(rng.randrange(5, 40)), "max_new": 20, "ckpt": []} for _ in range(5)]
    followups = [[tok(6) for _ in turn] for _ in range(2)]
    cached, outs = {}, {}
    for name, spec in (("off", {}), ("mtp", MTP), ("mtp trees", TREE),
                       ("ngram", dict(speculative_algorithm="ngram", speculative_num_draft_tokens=4))):
        with Engine(default_mtp_path, debug_checks=True, **POOLS, **spec) as eng:
            specs, out = turn, run(eng, turn)
            for more in followups:
                specs = [{"ids": s["ids"] + o["output_ids"] + f, "max_new": 20, "ckpt": []}
                         for s, o, f in zip(specs, out[-len(specs):], more)]
                out += run(eng, specs)
            assert eng.get_stats()["num_evicted_tokens"] == 0
            if spec:
                assert eng.get_stats()["spec_accept_length"] > 1.1, name
            assert_drained(eng)
        cached[name], outs[name] = [o["meta_info"]["cached_tokens"] for o in out], out
    assert sum(cached["off"]) > 0.5 * sum(len(s["ids"]) for s in turn)
    for name in cached:
        compare_outputs(outs[name], outs["off"])
        assert cached[name] == cached["off"], name


# --- the default model's trained head ------------------------------------------------------------


@pytest.fixture(scope="module")
def default_mtp_path():
    """The built-in default model (it carries a trained MTP head)."""
    from hyla.engine.engine import DEFAULT_MODEL_DIR

    return DEFAULT_MODEL_DIR


def _chat_prompts(eng: Engine) -> list[list[int]]:
    tok = eng.tokenizer
    questions = ["What is the capital of France?", "Can you give me some tips for writing a good cover letter?",
                 "Explain what a neural network is in simple terms.", "Write a short poem about the sea."]
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]), add_special_tokens=False)
            for q in questions]


def test_default_model_tensors_are_the_ones_the_head_was_trained_for(default_mtp_path):
    """``scripts/train_mtp_head.py`` left the model's own tensors bit-identical and recorded their
    SHA-256 in the model card: a retrained model without a retrained head fails here."""
    import hashlib
    import re

    from safetensors.torch import load_file

    tensors = {k: v for k, v in load_file(default_mtp_path / "model.safetensors").items() if not k.startswith("mtp.")}
    per_tensor = {k: hashlib.sha256(v.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
                  for k, v in tensors.items()}
    digest = hashlib.sha256("".join(per_tensor[k] for k in sorted(per_tensor)).encode()).hexdigest()
    recorded = re.search(r"SHA-256 over them `([0-9a-f]+)", (default_mtp_path / "README.md").read_text()).group(1)
    assert digest.startswith(recorded)
    assert any(k.startswith("mtp.") for k in load_file(default_mtp_path / "model.safetensors"))


def test_default_model_head_is_accepted():
    """``Engine(speculative_algorithm="mtp")`` on the built-in model: exact, and the trained head's
    drafts are accepted (a random head's accept length is 1.0)."""
    params = {"temperature": 0, "max_new_tokens": 48, "ignore_eos": True}
    with Engine(**MTP, debug_checks=True) as eng:
        prompts = _chat_prompts(eng)
        got = eng.generate(input_ids=prompts, sampling_params=params, return_logprob=True)
        accept = eng.get_stats()["spec_accept_length"]
        assert_drained(eng)
    with Engine(enable_prefix_cache=False) as ref:
        want = ref.generate(input_ids=prompts, sampling_params=params, return_logprob=True)
    compare_outputs(got, want)
    assert accept > 1.3, f"mean accept length {accept:.2f}"
    assert all(o["meta_info"]["spec_accept_length"] > 1.0 for o in got)


def test_stops_inside_an_accepted_mtp_run():
    """EOS, a stop token and max_new_tokens landing inside an accepted run of MTP drafts."""
    with Engine(enable_prefix_cache=False, **POOLS) as ref:
        prompt = _chat_prompts(ref)[0]
        full = ref.generate(input_ids=prompt, sampling_params=_greedy(40), return_logprob=True)["output_ids"]
    with Engine(speculative_algorithm="mtp", speculative_num_steps=4, debug_checks=True, **POOLS) as eng:
        rec = _Recorder(eng.scheduler.drafter)
        eng.generate(input_ids=prompt, sampling_params=_greedy(40))
        # positions whose token was an accepted draft, not the first of its verify step's run
        inside = [n for (p, n), d in rec.drafts.items() if d and full[n:n + 2] == d[:2]]
        assert inside, "no accepted run of two drafts"
        n = inside[0] + 1  # full[n] was the second draft of an accepted run
        stop_tok = full[n]
        out = eng.generate(input_ids=prompt, sampling_params=_greedy(40, stop_token_ids=[stop_tok]))
        assert out["output_ids"] == full[: full.index(stop_tok) + 1]
        if full.index(stop_tok) == n:
            assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_tok}
        out = eng.generate(input_ids=prompt, sampling_params=_greedy(n + 1))
        assert out["output_ids"] == full[: n + 1] and out["meta_info"]["finish_reason"]["type"] == "length"
        eos = full[n]
        eng.scheduler.output.eos_token_ids = {eos}
        out = eng.generate(input_ids=prompt, sampling_params={"temperature": 0, "max_new_tokens": 40})
        assert out["output_ids"] == full[: full.index(eos) + 1]
        eng.scheduler.output.eos_token_ids = set(eng.eos_token_ids)
        chunks = list(eng.generate(input_ids=prompt, sampling_params=_greedy(40), stream=True))
        assert [t for c in chunks for t in c["output_ids"]] == full
        assert any(len(c["output_ids"]) > 1 for c in chunks)  # several tokens per verify step
        assert_drained(eng)


def test_mtp_with_sampling_and_penalties(qwen3_next_dense_mtp_path):
    """Seeded sampling reproduces with MTP on; a request with penalties takes zero-draft verify steps."""
    ids = _ids(30, 8)
    params = {"temperature": 1.0, "top_p": 0.9, "max_new_tokens": 16, "seed": 7, "ignore_eos": True}
    outs = []
    for _ in range(2):
        with Engine(qwen3_next_dense_mtp_path, **MTP, **POOLS) as eng:
            outs.append(eng.generate(input_ids=[ids, ids], sampling_params=params, rid=["a", "b"]))
            pen = eng.generate(input_ids=ids, sampling_params=_greedy(8, repetition_penalty=1.3))
            assert pen["meta_info"]["spec_accept_length"] == 1.0
            assert_drained(eng)
    assert [o["output_ids"] for o in outs[0]] == [o["output_ids"] for o in outs[1]]


# --- configuration errors ----------------------------------------------------------------------


def test_mtp_needs_mtp_tensors(qwen3_next_dense_path, qwen3_next_dense_mtp_path, nemotron_h_path, tmp_path):
    with pytest.raises(ValueError, match=r"has no mtp\.\* tensors"):
        Engine(qwen3_next_dense_path, **MTP, **POOLS)
    with pytest.raises(ValueError, match="no mtp"):
        Engine(nemotron_h_path, **MTP, **POOLS)
    with pytest.raises(ValueError, match="mtp trees .* at least 2"):
        EngineArgs(speculative_algorithm="mtp", speculative_eagle_topk=2, speculative_num_draft_tokens=1)
    # the default 4 tokens fed: 3 drafts, all of them the greedy chain of speculative_num_steps=3
    with pytest.raises(ValueError, match=r"no room beyond the chain .* above 4 \(e\.g\. 7\)"):
        EngineArgs(speculative_algorithm="mtp", speculative_eagle_topk=2)
    with pytest.raises(ValueError, match="draft trees .* no room beyond the chain"):
        EngineArgs(speculative_algorithm="draft", speculative_draft_model_path="/x", speculative_eagle_topk=2,
                   speculative_num_steps=5, speculative_num_draft_tokens=6)
    # a missing and an unexpected mtp tensor are named
    from safetensors.torch import load_file, save_file

    bad = tmp_path / "bad"
    shutil.copytree(qwen3_next_dense_mtp_path, bad)
    tensors = load_file(bad / "model.safetensors")
    tensors["mtp.layers.0.extra.weight"] = tensors.pop("mtp.layers.0.self_attn.k_norm.weight")
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing: mtp\.layers\.0\.self_attn\.k_norm\.weight; "
                                         r"unexpected: mtp\.layers\.0\.extra\.weight"):
        Engine(bad, **MTP, **POOLS)


def test_serve_flags(capsys):
    """``hyla serve --speculative-algorithm mtp --speculative-num-steps N`` reaches the engine options;
    a bad combination exits 2 with the engine's message."""
    from hyla.server import cli
    from test_server_cli import _parse

    opts = cli.engine_options(_parse(["--speculative-algorithm", "mtp", "--speculative-num-steps", "2"]))
    args = EngineArgs(**opts)
    assert args.speculative_algorithm == "mtp" and args.num_draft_tokens == 2
    opts = cli.engine_options(_parse(["--speculative-algorithm", "mtp", "--speculative-eagle-topk", "2",
                                      "--speculative-num-draft-tokens", "6"]))
    assert EngineArgs(**opts).num_draft_tokens == 5  # a tree: speculative_num_draft_tokens - 1 drafts
    assert cli.run(_parse(["--speculative-algorithm", "mtp", "--speculative-eagle-topk", "2",
                           "--speculative-num-draft-tokens", "1"])) == 2
    assert "speculative_eagle_topk" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None, reason="torch.compile needs a C++ compiler")
def test_compiled_mtp_head_serves_every_forward_from_its_start_up_graphs(qwen3_next_dense_mtp_path):
    """``MtpDrafter.compile`` (what ``compile_decode`` adds for the MTP head), compiled for real on an
    engine whose model runs eager: every one of the head's decode batches (draft steps, a verify
    step's pairs) runs a graph compiled at start-up, none falls back to eager (a guard the warm-up's
    batches did not meet, e.g. tensors made outside inference mode, would), and the drafts and
    outputs are those of the eager head."""
    prompts = [[random.Random(s).randrange(3, 500) for _ in range(n)] for s, n in ((1, 29), (2, 45), (3, 8))]
    params = [_greedy(10), _greedy(14), _greedy(7)]
    drafts, outs = [], []
    for compiled in (False, True):
        with Engine(qwen3_next_dense_mtp_path, **MTP, **POOLS) as eng:
            drafter = eng.scheduler.drafter
            if compiled:
                drafter.compile()
            rec = _Recorder(drafter)
            outs.append([o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=params)])
            outs[-1] += [eng.generate(input_ids=prompts[0], sampling_params=_greedy(6))["output_ids"]]  # batch 1
            drafts.append(rec.drafts)
            assert drafter.compiled == compiled and drafter.late_compiles == 0
            assert_drained(eng)
    assert outs[1] == outs[0]  # (the eager side's are the plain engine's: the tests above)
    assert drafts[0] == drafts[1] and sum(map(len, drafts[0].values())) > 30
