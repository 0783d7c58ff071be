"""Layers against the Hugging Face modules they reimplement (MoE routers incl. NemotronH's grouped
routing and latent projection and LFM2-MoE's model-dtype router, Ling 3's KDA decay, norms, partial RoPE),
and model-level batch rules."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch
import transformers
from checkpoints import BAILING_HYBRID_KW, LFM2_MOE_KW, NEMOTRON_H_KW, QWEN3_NEXT_KW, Seq, TinyRunner
from transformers.models.lfm2_moe import modeling_lfm2_moe as hf_lfm2_moe
from transformers.models.nemotron_h import modeling_nemotron_h as hf_nemotron
from transformers.models.qwen3_next import modeling_qwen3_next as hf_qwen

from hyla.model import load_model
from hyla.model.config import ModelConfig
from hyla.model.layers import GatedRMSNorm, RMSNorm, RotaryEmbedding, SparseMoE, apply_rotary


def config_pair(cls, kw, arch):
    hf_cfg = cls(**kw)
    d = json.loads(hf_cfg.to_json_string())
    d["architectures"] = [arch]
    return hf_cfg, ModelConfig.from_hf(d)


def randomize(module: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            tensor.copy_(torch.randn(tensor.shape, generator=g) * 0.2)


@torch.no_grad()
def test_qwen3_next_moe_matches_hf():
    hf_cfg, cfg = config_pair(transformers.Qwen3NextConfig, QWEN3_NEXT_KW, "Qwen3NextForCausalLM")
    ref = hf_qwen.Qwen3NextSparseMoeBlock(hf_cfg).eval()
    randomize(ref, 0)
    moe = SparseMoE(cfg)
    moe.router.weight.copy_(ref.gate.weight)
    moe.w_in.copy_(ref.experts.gate_up_proj)  # [E, 2I, H]: gate rows then up rows
    moe.w_out.copy_(ref.experts.down_proj)
    moe.shared_expert.in_proj.weight.copy_(torch.cat([ref.shared_expert.gate_proj.weight,
                                                      ref.shared_expert.up_proj.weight]))
    moe.shared_expert.out_proj.weight.copy_(ref.shared_expert.down_proj.weight)
    moe.shared_expert_gate.weight.copy_(ref.shared_expert_gate.weight)
    x = torch.randn(37, 256)
    # random relu² experts give outputs of magnitude ~10²-10³ that partly cancel: bound the error
    # relative to the output's scale (fp32 rounding of the summands), not absolutely
    got, want = moe(x), ref(x[None])[0]
    assert (got - want).abs().max() <= 2e-6 * want.abs().max()


@torch.no_grad()
def test_nemotron_h_grouped_router_and_latent_moe_match_hf():
    kw = {**NEMOTRON_H_KW, "n_routed_experts": 8, "n_group": 4, "topk_group": 2, "num_experts_per_tok": 3,
          "moe_latent_size": 64, "routed_scaling_factor": 2.5}
    hf_cfg, cfg = config_pair(transformers.NemotronHConfig, kw, "NemotronHForCausalLM")
    ref = hf_nemotron.NemotronHMoE(hf_cfg).eval()
    randomize(ref, 1)
    moe = SparseMoE(cfg)
    moe.router.weight.copy_(ref.gate.weight)
    moe.e_score_correction_bias.copy_(ref.gate.e_score_correction_bias)
    moe.w_in.copy_(ref.experts.up_proj)
    moe.w_out.copy_(ref.experts.down_proj)
    moe.latent_in.weight.copy_(ref.fc1_latent_proj.weight)
    moe.latent_out.weight.copy_(ref.fc2_latent_proj.weight)
    moe.shared_expert.in_proj.weight.copy_(ref.shared_experts.up_proj.weight)
    moe.shared_expert.out_proj.weight.copy_(ref.shared_experts.down_proj.weight)
    x = torch.randn(41, 256, generator=torch.Generator().manual_seed(0))
    weights, experts = moe.route(x)
    _, ref_weights, ref_experts = ref.gate(x)
    order, ref_order = experts.argsort(-1), ref_experts.argsort(-1)
    assert torch.equal(experts.gather(1, order), ref_experts.gather(1, ref_order))
    assert torch.allclose(weights.gather(1, order), ref_weights.gather(1, ref_order), atol=1e-6)
    # random relu² experts give outputs of magnitude ~10²-10³ that partly cancel: bound the error
    # relative to the output's scale (fp32 rounding of the summands), not absolutely
    got, want = moe(x), ref(x[None])[0]
    assert (got - want).abs().max() <= 2e-6 * want.abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias, renormalise", [(True, True), (False, False)])
@torch.no_grad()
def test_lfm2_moe_block_matches_hf(dtype, bias, renormalise):
    """LFM2-MoE's sparse block: sigmoid router (logits and sigmoid in the model dtype), top-k on the
    scores plus the fp32 ``expert_bias`` (or on the scores alone), ``w / (sum + 1e-6)`` where
    renormalised, times ``routed_scaling_factor``; SwiGLU experts from HF's fused ``gate_up_proj``. The
    same experts as HF's router and the same weights (bf16: within its rounding, HF normalising in bf16),
    the same output. In bf16 with the bias, HF's rounded scores choose other experts than fp32 scores would
    for some tokens (what ``router_fp32 = False`` is for)."""
    kw = {**LFM2_MOE_KW, "use_expert_bias": bias, "norm_topk_prob": renormalise}
    hf_cfg, cfg = config_pair(transformers.Lfm2MoeConfig, kw, "Lfm2MoeForCausalLM")
    ref = hf_lfm2_moe.Lfm2MoeSparseMoeBlock(hf_cfg).eval()
    randomize(ref, 5)
    expert_bias = ref.expert_bias.clone() if bias else None  # fp32, as HF keeps it in a bf16 model
    ref.to(dtype)
    moe = SparseMoE(cfg.with_dtype(dtype))
    assert (moe.e_score_correction_bias is None) == (not bias) and not moe.router_fp32 and moe.norm_eps == 1e-6
    moe.router.weight.copy_(ref.gate.weight)
    moe.w_in.copy_(ref.experts.gate_up_proj)  # [E, 2I, H]: gate rows then up rows
    moe.w_out.copy_(ref.experts.down_proj)
    if bias:
        ref.expert_bias = expert_bias
        moe.e_score_correction_bias.copy_(expert_bias)
    x = torch.randn(256, 128, generator=torch.Generator().manual_seed(0)).to(dtype)
    weights, experts = moe.route(x)
    _, ref_weights, ref_experts = ref.gate(x, expert_bias)
    order, ref_order = experts.argsort(-1), ref_experts.argsort(-1)
    # bf16 without the bias: scores rounded to bf16 tie now and then, and a tie may go either way
    ties = dtype == torch.bfloat16 and not bias
    same = (experts.gather(1, order) == ref_experts.gather(1, ref_order)).all(-1)  # [T]
    assert bool(same.all()) or (ties and same.float().mean() > 0.9)
    atol = 1e-6 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(weights.gather(1, order)[same], ref_weights.gather(1, ref_order)[same].float(),
                               rtol=0, atol=atol)
    got, want = moe(x).float(), ref(x[None])[0].float()
    tol = 2e-6 if dtype == torch.float32 else 2e-2
    assert (got - want)[same].abs().max() <= tol * want.abs().max()
    if dtype == torch.bfloat16 and bias:  # the same router with fp32 logits and sigmoid: other experts somewhere
        moe.router_fp32 = True
        assert not torch.equal(moe.route(x)[1].sort(-1).values, ref_experts.sort(-1).values)
        moe.router_fp32 = False
    # logits ~ -19: every score ~5e-9, far below the renormalisation's eps 1e-6, which then dominates (as in HF)
    far = -0.15 + 0.01 * torch.randn(ref.gate.weight.shape, generator=torch.Generator().manual_seed(1))
    ref.gate.weight.copy_(far)
    moe.router.weight.copy_(ref.gate.weight)
    ones = torch.ones(4, 128, dtype=dtype)
    weights, experts = moe.route(ones)
    _, ref_weights, ref_experts = ref.gate(ones, expert_bias)
    assert torch.equal(experts.sort(-1).values, ref_experts.sort(-1).values)
    torch.testing.assert_close(weights.sort(-1).values, ref_weights.float().sort(-1).values, rtol=2e-2, atol=0)
    assert float(weights.sum(-1).max()) < 0.1  # 1.7 with an eps of 1e-20, where renormalised


@pytest.mark.parametrize("arch", ["qwen3_next", "nemotron_h"])
def test_expert_paths_equal_the_per_token_loop(arch):
    """Sorted by expert (eager, and as the op a compiled graph calls), gathered per assignment (a
    batched GEMV, as on a GPU) and grouped (the GPU's grouped GEMM, ``ops/gpu/moe.py``, interpreted):
    each token's weighted sum of its experts, SwiGLU and relu² alike."""
    if arch == "qwen3_next":
        _, cfg = config_pair(transformers.Qwen3NextConfig, QWEN3_NEXT_KW, "Qwen3NextForCausalLM")
    else:
        kw = {**NEMOTRON_H_KW, "n_routed_experts": 8, "n_group": 4, "topk_group": 2, "num_experts_per_tok": 3}
        _, cfg = config_pair(transformers.NemotronHConfig, kw, "NemotronHForCausalLM")
    moe = SparseMoE(cfg)
    randomize(moe, 2)
    x = torch.randn(9, 256)
    weights, experts = moe.route(x)
    with torch.no_grad():
        want = torch.zeros(9, 256)
        for t in range(9):
            for w, e in zip(weights[t], experts[t]):
                h = x[t] @ moe.w_in[e].t()
                if moe.gated:
                    gate, up = h.chunk(2)
                    h = torch.nn.functional.silu(gate) * up
                else:
                    h = torch.relu(h) ** 2
                want[t] += w * (h @ moe.w_out[e].t())
        traced = torch.compile(moe.run_experts, backend="eager", fullgraph=True)  # one graph: the op is opaque
        paths = [moe.run_experts, moe.run_experts_gathered, traced]
        if importlib.util.find_spec("triton") is not None and os.environ.get("TRITON_INTERPRET") == "1":
            paths.append(moe.run_experts_grouped)  # on CPU tensors: interpreted (a GPU's engine tests run it)
        for run in paths:
            got = run(x, weights, experts)
            assert got.dtype == weights.dtype
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-4)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None or os.environ.get("TRITON_INTERPRET") != "1",
                    reason="the GPU code path on CPU tensors needs Triton's interpreter")
@pytest.mark.parametrize("arch", ["qwen3_next", "nemotron_h", "lfm2_moe"])
@pytest.mark.parametrize("gather_max, fused", [(64, False), (0, False), (64, True), (0, True)])
def test_moe_layer_on_the_gpu_path_equals_the_cpu_path(arch, gather_max, fused, monkeypatch):
    """The whole layer as a GPU runs it (``device.on_gpu``; the kernels interpreted): the softmax
    router in one kernel (``moe.softmax_topk``), the experts gathered or grouped, and the weighted sum
    with the shared expert and its gate in one (``moe.combine``); NemotronH's sigmoid router and latent
    projections around the experts keep their PyTorch ops, as LFM2-MoE's router (model-dtype logits, no
    shared expert: the combine kernel's weighted sum alone). With the input projections fused as a GPU
    runner fuses them (``SparseMoE.fuse_inputs_``: Qwen3-Next's router, gate and shared in projection
    one weight, theirs views of it; the state dict unchanged) too, and on a one-row GEMV step. ==
    the CPU's layer within fp32 rounding."""
    from hyla.model.layers import device, sparse_moe

    if arch == "qwen3_next":
        _, cfg = config_pair(transformers.Qwen3NextConfig, QWEN3_NEXT_KW, "Qwen3NextForCausalLM")
    elif arch == "lfm2_moe":
        _, cfg = config_pair(transformers.Lfm2MoeConfig, LFM2_MOE_KW, "Lfm2MoeForCausalLM")
    else:
        kw = {**NEMOTRON_H_KW, "n_routed_experts": 8, "n_group": 4, "topk_group": 2, "num_experts_per_tok": 3,
              "moe_latent_size": 64}
        _, cfg = config_pair(transformers.NemotronHConfig, kw, "NemotronHForCausalLM")
    moe = SparseMoE(cfg)
    randomize(moe, 4)
    x = torch.randn(9, cfg.hidden_size)
    with torch.no_grad():
        want = moe(x)
        if fused:
            before = {k: v.clone() for k, v in moe.state_dict().items()}
            assert moe.fuse_inputs_() == (arch == "qwen3_next") and moe.fuse_inputs_() == (arch == "qwen3_next")
            after = moe.state_dict()
            assert after.keys() == before.keys() and all(torch.equal(after[k], v) for k, v in before.items())
            if arch == "qwen3_next":
                assert moe.router.weight.data_ptr() == moe.fused_inputs.data_ptr()
        monkeypatch.setattr(device, "on_gpu", lambda t: True)
        monkeypatch.setattr(sparse_moe, "GATHER_MAX_ASSIGNMENTS", gather_max)
        assert moe.path(x) == ("gathered" if gather_max else "grouped")
        got = moe(x)
        if fused:  # a decode step of one row: its projections through the GEMV kernel
            torch.testing.assert_close(moe(x[:1], gemv_step=True), want[:1], rtol=1e-5,
                                       atol=1e-5 * want.abs().max().item())
    assert got.dtype == want.dtype
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_moe_sorts_on_the_cpu_only_and_compiles_its_sorted_path_as_one_op():
    """CPU steps sort by expert (a host read costs nothing there), compiled or not: a compiled graph
    calls the sorted path as the op ``hyla::moe_experts``."""
    _, cfg = config_pair(transformers.Qwen3NextConfig, QWEN3_NEXT_KW, "Qwen3NextForCausalLM")
    moe = SparseMoE(cfg)
    randomize(moe, 3)
    x = torch.randn(3, 256)
    assert moe.path(x) == "sorted"
    ops = []

    def backend(gm, example_inputs):
        ops.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm

    with torch.no_grad():
        torch.testing.assert_close(torch.compile(moe, backend=backend, fullgraph=True)(x), moe(x))
    assert "hyla.moe_experts" in ops


@pytest.mark.parametrize("safe", [True, False], ids=["bounded", "softplus"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.no_grad()
def test_ling_decay_gate_matches_hf(dtype, safe):
    """Ling 3's KDA decay (``ops.kda.DecayGate``, the layer's and the kernels' one definition) == transformers'
    ``BailingHybridForgetGate``, bitwise: the bounded form and the softplus one, each rounded to the model
    dtype as transformers' gate returns it (bf16: the decay of a channel differs by up to ~1.6% otherwise)."""
    from transformers.models.bailing_hybrid import modeling_bailing_hybrid as hf_ling

    from hyla.model.ops.kda import DecayGate

    kw = dict(BAILING_HYBRID_KW, kda_safe_gate=safe)
    hf = hf_ling.BailingHybridForgetGate(transformers.BailingHybridConfig(**kw))
    hf.f_proj.to(dtype)  # A_log and dt_bias stay fp32, as transformers loads them (_keep_in_fp32_modules_strict)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        hf.A_log.copy_(torch.rand(hf.A_log.shape, generator=g) * 2.7)  # exp: 1..15, as its init
        hf.dt_bias.copy_(torch.randn(hf.dt_bias.shape, generator=g) * 3)
        hf.f_proj.weight.copy_(torch.randn(hf.f_proj.weight.shape, generator=g).to(dtype) * 0.5)
    x = torch.randn(1, 37, kw["hidden_size"], generator=g).to(dtype)
    want = hf(x)[0]  # [T, H, D]
    gate = DecayGate(kw["kda_lower_bound"] if safe else 0.0, True)
    got = gate(hf.f_proj(x)[0], hf.A_log, hf.dt_bias, kw["num_attention_heads"])
    assert want.dtype == dtype and torch.equal(got, want.float())


@torch.no_grad()
def test_norms_match_hf():
    x, z = torch.randn(6, 64), torch.randn(6, 64)
    ref = hf_qwen.Qwen3NextRMSNorm(64, eps=1e-6)
    ref.weight.normal_()
    ours = RMSNorm(64, 1e-6, zero_centered=True)
    ours.weight.copy_(ref.weight)
    assert torch.equal(ours(x), ref(x))
    ref_gated = hf_qwen.Qwen3NextRMSNormGated(64, eps=1e-6)
    ref_gated.weight.normal_()
    ours_gated = GatedRMSNorm(64, 1e-6, norm_before_gate=True)
    ours_gated.weight.copy_(ref_gated.weight)
    assert torch.allclose(ours_gated(x, z), ref_gated(x, z), atol=1e-6)
    ref_group = hf_nemotron.NemotronHRMSNormGated(64, group_size=16, eps=1e-5)
    ref_group.weight.normal_()
    ours_group = GatedRMSNorm(64, 1e-5, group_size=16, norm_before_gate=False)
    ours_group.weight.copy_(ref_group.weight)
    assert torch.allclose(ours_group(x, z), ref_group(x, z), atol=1e-6)


def test_partial_rotary_matches_hf():
    hf_cfg = transformers.Qwen3NextConfig(**QWEN3_NEXT_KW)
    rotary = hf_qwen.Qwen3NextRotaryEmbedding(hf_cfg)
    positions = torch.tensor([0, 1, 5, 900, 4000])
    q, k = torch.randn(5, 4, 64), torch.randn(5, 2, 64)
    cos, sin = rotary(q, positions[None])
    ref_q, ref_k = hf_qwen.apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    ours = RotaryEmbedding(16, 10000.0)
    c, s = ours(positions, torch.float32)
    assert torch.equal(apply_rotary(q, c, s), ref_q[0].transpose(0, 1))
    assert torch.equal(apply_rotary(k, c, s), ref_k[0].transpose(0, 1))
    assert torch.equal(apply_rotary(q, c, s)[..., 16:], q[..., 16:])  # 75% of the head passes through


def test_decode_checkpoint_is_the_final_state(qwen3_next_dense_path):
    model = load_model(qwen3_next_dense_path)
    runner = TinyRunner(model)
    seq = runner.new_seq()
    runner.step([seq], [list(range(10, 50))])
    slot = runner.new_state_slot()
    runner.step([seq], [[7]], decode=True, checkpoints=[(0, 1, slot)])
    for pool in (*runner.conv_states, *runner.ssm_states):
        assert torch.equal(pool[slot], pool[seq.state_slot])
    branch = runner.fork(seq, len(seq.tokens), slot)
    a = runner.step([branch], [[9]], decode=True)
    b = runner.step([seq], [[9]], decode=True)
    assert torch.equal(a, b)


def test_batch_that_does_not_fit_the_model_is_rejected(qwen3_next_dense_path, nemotron_h_path):
    qwen, nemotron = load_model(qwen3_next_dense_path), load_model(nemotron_h_path)
    runner = TinyRunner(nemotron)  # 3 linear layers; Qwen has 6
    batch = runner.make_batch([runner.new_seq()], [[1, 2, 3]])
    with pytest.raises(ValueError, match="linear layers"):
        qwen(batch)
    batch = TinyRunner(qwen).make_batch([runner.new_seq()], [[5000]])
    with pytest.raises(ValueError, match="vocabulary"):
        qwen(batch)


def test_padding_sequence_reads_and_writes_nothing(nemotron_h_path):
    """A state slot of -1 marks a padding sequence: the other sequences' logits and states are as
    without it, and no state row is written for it. The real sequences' rows match within fp32
    rounding (a 3-row projection may round differently from a 2-row one: MKL picks its kernel by
    shape); every other row, the sentinel and the last (what index -1 would hit) included, is
    bit-for-bit untouched."""
    model = load_model(nemotron_h_path)
    runner = TinyRunner(model)
    seqs = [runner.new_seq() for _ in range(2)]
    runner.step(seqs, [list(range(20, 60)), list(range(30, 45))])
    snapshot = [p.clone() for p in (*runner.conv_states, *runner.ssm_states)]
    alone = runner.step(seqs, [[7], [8]], decode=True)
    after_alone = [p.clone() for p in (*runner.conv_states, *runner.ssm_states)]
    for pool, saved in zip((*runner.conv_states, *runner.ssm_states), snapshot):
        pool.copy_(saved)
    for s in seqs:  # rewind the two sequences by one token
        s.tokens.pop()
        s.kv_slots.pop()
    pad = Seq(state_slot=-1)
    batch = runner.make_batch([seqs[0], pad, seqs[1]], [[7], [3], [8]], decode=True)
    got = model(batch)
    assert torch.allclose(got[[0, 2]], alone, atol=1e-6)
    live = [s.state_slot for s in seqs]
    for pool, want in zip((*runner.conv_states, *runner.ssm_states), after_alone):
        rest = torch.ones(pool.shape[0], dtype=torch.bool)
        rest[live] = False
        assert torch.equal(pool[rest], want[rest])
        torch.testing.assert_close(pool[live], want[live], atol=1e-6, rtol=1e-5)
