"""Tiny random Hugging Face checkpoints for tests and benchmarks, and a minimal pool harness.

Builders (``make_qwen3_next``, ``make_qwen3_5``, ``make_qwen3_5_moe``, ``make_nemotron_h``, ``make_falcon_h1``,
``make_bamba``, ``make_granite_h``, ``make_lfm2``, ``make_lfm2_moe``, ``make_kimi_linear``, ``make_bailing_hybrid``,
``make_olmo_hybrid``, ``make_lara_mini``, ``make_lfm3``, ``make_zamba2``, ``make_jamba``, ``make_minimax``, ``make_mamba``, ``make_falcon_mamba``, ``make_mamba2``) construct a tiny model with
transformers (the configs of ``shared/notes/hf-reference.md``), add N(0, 0.1) noise to every
parameter that initialisation sets to a constant (norm weights, ``dt_bias``, ``D``, ``A_log``,
conv bias, router bias: otherwise the ``1 + w`` norms and biases are never exercised), scale
``lm_head`` so output distributions are peaked (argmax ties are rare), and ``save_pretrained`` into
``tmp_dir``. A checkpoint already built into ``tmp_dir`` with the same arguments is reused, so a
session-scoped directory caches them (see ``conftest.py``). ``mtp=True`` (Qwen3-Next / Qwen3.5 kinds)
adds a random multi-token-prediction head as the real checkpoints ship it (``add_mtp_tensors``).

``TinyRunner`` drives ``model.forward`` with plain-tensor KV/state pools (no ``hyla.cache``):
enough to prefill, chunk, fork from a checkpoint and decode in tests and benchmarks.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch

LM_HEAD_SCALE = 8.0

QWEN3_NEXT_KW: dict[str, Any] = dict(
    vocab_size=2048, hidden_size=256, intermediate_size=512, num_hidden_layers=8,
    num_attention_heads=4, num_key_value_heads=2, head_dim=64,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64,
    linear_conv_kernel_dim=4,
    layer_types=["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"],
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=False,
    num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128, shared_expert_intermediate_size=128,
    decoder_sparse_step=1, norm_topk_prob=True, mlp_only_layers=[], eos_token_id=2, bos_token_id=1,
)

QWEN3_5_KW: dict[str, Any] = {
    k: v for k, v in QWEN3_NEXT_KW.items()
    if k not in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
                 "decoder_sparse_step", "norm_topk_prob", "mlp_only_layers")
}

# Qwen3.5-MoE: Qwen3.5's decoder with a MoE (8 experts, top-2, shared expert) in every layer; HF's config
# has no dense intermediate_size.
QWEN3_5_MOE_KW: dict[str, Any] = {
    **{k: v for k, v in QWEN3_5_KW.items() if k != "intermediate_size"},
    "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 128, "shared_expert_intermediate_size": 128,
}

NEMOTRON_H_KW: dict[str, Any] = dict(
    vocab_size=2048, hidden_size=256,
    layers_block_type=["linear_attention", "mlp", "linear_attention", "full_attention", "mlp",
                       "linear_attention", "moe", "full_attention"],
    num_attention_heads=4, num_key_value_heads=2, head_dim=64, intermediate_size=512, mlp_hidden_act="relu2",
    mamba_num_heads=8, mamba_head_dim=32, ssm_state_size=32, n_groups=2, conv_kernel=4, chunk_size=64, expand=1,
    n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=128, moe_shared_expert_intermediate_size=128,
    n_shared_experts=1, max_position_embeddings=4096, layer_norm_epsilon=1e-5, tie_word_embeddings=False,
)


# Falcon-H1: attention and Mamba2 in parallel in every layer; the Mamba2 width (mamba_d_ssm = 12 x 32)
# differs from expand * hidden; every µP multiplier differs from 1 so folding each one is exercised.
FALCON_H1_KW: dict[str, Any] = dict(
    vocab_size=2048, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=64,
    mamba_d_ssm=384, mamba_n_heads=12, mamba_d_head=32, mamba_n_groups=2, mamba_d_state=32, mamba_d_conv=4,
    mamba_chunk_size=64, mamba_expand=2, mamba_rms_norm=True, mamba_norm_before_gate=False,
    rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    embedding_multiplier=3.0, lm_head_multiplier=1.3, key_multiplier=0.4, attention_in_multiplier=1.3,
    attention_out_multiplier=0.9, ssm_in_multiplier=1.25, ssm_out_multiplier=0.7,
    ssm_multipliers=[0.35, 0.8, 0.5, 1.4, 0.6], mlp_multipliers=[0.9, 0.6],
    max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=False, eos_token_id=2, bos_token_id=1,
)


# Bamba: Mamba2 with attention at layers 2 and 5 (RoPE on half of each head), SwiGLU MLP everywhere.
BAMBA_KW: dict[str, Any] = dict(
    vocab_size=2048, hidden_size=256, intermediate_size=512, num_hidden_layers=6, attn_layer_indices=[2, 5],
    num_attention_heads=4, num_key_value_heads=2, mamba_n_heads=8, mamba_d_head=64, mamba_n_groups=2,
    mamba_d_state=32, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=64,
    max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=False, eos_token_id=2, bos_token_id=1,
)

# Granite 4.0-H: Mamba2 / attention (no RoPE, as the published checkpoints), MoE (8 experts, top-2) beside
# a shared expert, every µP multiplier different from 1.
GRANITE_H_KW: dict[str, Any] = dict(
    vocab_size=2048, hidden_size=256, intermediate_size=128, shared_intermediate_size=256, num_hidden_layers=6,
    layer_types=["mamba", "mamba", "attention", "mamba", "mamba", "attention"],
    num_attention_heads=4, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2,
    mamba_n_heads=8, mamba_d_head=64, mamba_n_groups=2, mamba_d_state=32, mamba_d_conv=4, mamba_expand=2,
    mamba_chunk_size=64, position_embedding_type="nope",
    embedding_multiplier=6.0, logits_scaling=0.8, residual_multiplier=0.5, attention_multiplier=0.1,
    max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=False, eos_token_id=2, bos_token_id=1,
)


# Jamba: Mamba1 with attention at layers 1 and 4 (no RoPE); MoE of 4 experts (top-2) in the odd layers.
JAMBA_KW: dict[str, Any] = dict(
    vocab_size=2048, hidden_size=128, intermediate_size=256, num_hidden_layers=6, attn_layer_period=3,
    attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1, num_experts=4, num_experts_per_tok=2,
    num_attention_heads=4, num_key_value_heads=2, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=8,
    max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=False, eos_token_id=2, bos_token_id=1,
    pad_token_id=0,
)

# Mamba and FalconMamba: 4 Mamba1 layers (256 channels, 16 states, dt rank ceil(128 / 16) = 8), untied
# embeddings (tied, HF's default, a tiny model mostly repeats its input token; the parity variants tie them).
# initializer_range 0.05, not HF's 0.1 (nor the hybrids' 0.02): logits of std ~4.6 with lm_head's x8 (~9 at 0.1:
# fp32 errors ~4e-5, close to the 1e-4 tolerance), the mixers' part of the residual stream still large.
MAMBA_KW: dict[str, Any] = dict(
    vocab_size=2048, hidden_size=128, num_hidden_layers=4, state_size=16, conv_kernel=4, expand=2,
    time_step_rank="auto", layer_norm_epsilon=1e-5, initializer_range=0.05, tie_word_embeddings=False,
    eos_token_id=2, bos_token_id=1, pad_token_id=0,
)
FALCON_MAMBA_KW: dict[str, Any] = {**MAMBA_KW, "mixer_rms_eps": 1e-6}

# Mamba2: 4 layers of 8 heads of 32 (expand 2 x 128), 2 groups of 32 states, untied embeddings, initializer_range
# as Mamba's.
MAMBA2_KW: dict[str, Any] = dict(
    vocab_size=2048, hidden_size=128, num_hidden_layers=4, num_heads=8, head_dim=32, expand=2, state_size=32,
    n_groups=2, conv_kernel=4, chunk_size=64, layer_norm_epsilon=1e-5, initializer_range=0.05,
    tie_word_embeddings=False, eos_token_id=2, bos_token_id=1, pad_token_id=0,
)

# LFM2: gated short convolutions (conv_L_cache 3) with attention at layers 2 and 4, untied embeddings (tied,
# HF's default, this tiny model repeats its input token with probability ~1: no comparison of tokens or
# logprobs could tell a wrong path from a right one); intermediate_size 700 -> HF's auto-adjusted MLP width int(2/3 * 700) = 466, rounded up to 512.
LFM2_KW: dict[str, Any] = dict(
    vocab_size=2048, hidden_size=256, intermediate_size=700, num_hidden_layers=6,
    layer_types=["conv", "conv", "full_attention", "conv", "full_attention", "conv"],
    num_attention_heads=4, num_key_value_heads=2, conv_L_cache=3, block_multiple_of=256,
    rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    max_position_embeddings=4096, norm_eps=1e-5, tie_word_embeddings=False, eos_token_id=2, bos_token_id=1,
    pad_token_id=0,
)


# LFM2-MoE: LFM2's mixers (short convolutions, attention at layers 1 and 3) with layer 0 dense (a SwiGLU MLP of
# intermediate_size as given) and layers 1-3 sparse: 8 experts (top-2, sigmoid router, expert_bias perturbed away
# from HF's zeros by perturb_constants, renormalised, scaled by 1.7), no shared expert. Untied embeddings (as LFM2_KW).
LFM2_MOE_KW: dict[str, Any] = dict(
    vocab_size=2048, hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=4,
    layer_types=["conv", "full_attention", "conv", "full_attention"], num_dense_layers=1,
    num_attention_heads=4, num_key_value_heads=2, conv_L_cache=3, num_experts=8, num_experts_per_tok=2,
    use_expert_bias=True, norm_topk_prob=True, routed_scaling_factor=1.7,
    rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    max_position_embeddings=4096, norm_eps=1e-5, tie_word_embeddings=False, eos_token_id=2, bos_token_id=1,
    pad_token_id=0,
)


# Kimi-Linear: KDA (4 heads of 32, conv 4) with MLA at layers 2 and 5 (4 heads, kv_lora_rank 64, nope 32 /
# rope 32 / v 48: a 96-wide latent in the pool, 48 in K and 48 in V); layer 0 dense, then MoE of 8 experts
# (top-2, sigmoid router) + a shared expert.
KIMI_LINEAR_KW: dict[str, Any] = dict(
    vocab_size=2048, hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_hidden_layers=6,
    layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention", "linear_attention",
                 "full_attention"],
    num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=64, q_lora_rank=None, qk_nope_head_dim=32,
    qk_rope_head_dim=32, v_head_dim=48, linear_num_heads=4, linear_head_dim=32, linear_conv_kernel_dim=4,
    num_local_experts=8, num_experts_per_tok=2, n_shared_experts=1, routed_scaling_factor=2.446,
    max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=False, eos_token_id=2, bos_token_id=1,
    pad_token_id=0,
)


# Ling 3 (Bailing-Hybrid): KDA (4 heads of 32, conv 4, full-rank gates, the bounded decay at -5) with MLA at
# layers 2 and 5 (layer_group_size 3: 4 heads, kv_lora_rank 64, nope 32 / rope 16 / v 48, RoPE of theta 1e4
# on q_pe / k_pe, each head's output gated); layer 0 dense, then MoE of 8 experts in 2 groups (top-2 within the
# best group) + a shared expert; one MTP layer in config.json (transformers writes none of its tensors).
BAILING_HYBRID_KW: dict[str, Any] = dict(
    vocab_size=2048, hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_hidden_layers=6,
    layer_group_size=3, num_attention_heads=4, num_key_value_heads=4, head_dim=32, kv_lora_rank=64,
    q_lora_rank=None, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=48, short_conv_kernel_size=4,
    num_local_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
    routed_scaling_factor=2.5, first_k_dense_replace=1, rope_theta=10000.0, kda_safe_gate=True,
    kda_lower_bound=-5.0, num_mtp_layers=1, max_position_embeddings=4096, rms_norm_eps=1e-6,
    eos_token_id=2, bos_token_id=1, pad_token_id=0,
)


# OLMo-Hybrid: Gated DeltaNet (4 key and value heads: keys of 48, values of 64, beta = 2 sigmoid(b)) with OLMo-3's
# post-norm attention at layers 2 and 5 (4 heads of 64, q/k normalised over all heads, NoPE as the released
# checkpoints: rope_theta null), a SwiGLU MLP in each layer.
OLMO_HYBRID_KW: dict[str, Any] = dict(
    vocab_size=2048, hidden_size=256, intermediate_size=512, num_hidden_layers=6,
    layer_types=["linear_attention", "linear_attention", "full_attention"] * 2, num_attention_heads=4,
    num_key_value_heads=4, linear_num_key_heads=4, linear_num_value_heads=4, linear_key_head_dim=48,
    linear_value_head_dim=64, linear_conv_kernel_dim=4, linear_allow_neg_eigval=True,
    rope_parameters={"rope_type": "default", "rope_theta": None}, max_position_embeddings=4096, rms_norm_eps=1e-6,
    tie_word_embeddings=False, eos_token_id=2, bos_token_id=1, pad_token_id=0,
)

# Lara-4-Mini: the released layer pattern (linear, sliding, linear, full, sliding) and one more GDN layer; a
# window of 6 positions, so that the tests' prompts and decodes run past it (the sliding layers' masks bind)
LARA_MINI_KW: dict[str, Any] = dict(
    vocab_size=2048, hidden_size=256, num_hidden_layers=6,
    layer_types=["linear_attention", "sliding_attention", "linear_attention", "full_attention", "sliding_attention",
                 "linear_attention"],
    num_attention_heads=4, num_key_value_heads=2, head_dim=64, sliding_window=6,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64,
    linear_conv_kernel_dim=4, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128, shared_expert_intermediate_size=128,
    max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=False, eos_token_id=2, bos_token_id=1,
)

# LFM3: short convolutions (a window of 7), global attention at 2 (proportional RoPE over half the frequencies),
# sliding-window attention (a window of 6) at 4, sandwich norms, per-head attention gates
LFM3_KW: dict[str, Any] = dict(
    vocab_size=2048, hidden_size=256, intermediate_size=384, num_hidden_layers=6,
    layer_types=["conv", "conv", "full_attention", "conv", "sliding_attention", "conv"],
    num_attention_heads=4, num_key_value_heads=2, head_dim=64, sliding_window=6, conv_L_cache=7,
    max_position_embeddings=4096, norm_eps=1e-5, tie_word_embeddings=True, eos_token_id=2, bos_token_id=1,
    pad_token_id=0,
)

# Zamba2: Mamba2 layers and three hybrid ones over two shared blocks (the third runs the first block again, with
# adapters of its own), q/k/v adapters, RoPE; time_step_min low enough that the dt clamp (which transformers applies
# in its chunked scan only) never binds, so its decode steps are its full forward's
ZAMBA2_KW: dict[str, Any] = dict(
    vocab_size=2048, hidden_size=128, intermediate_size=256, num_hidden_layers=6,
    layers_block_type=["mamba", "hybrid", "mamba", "hybrid", "mamba", "hybrid"],
    num_attention_heads=4, num_key_value_heads=4, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, n_mamba_heads=8,
    mamba_ngroups=2, num_mem_blocks=2, use_shared_attention_adapter=True, adapter_rank=16, use_mem_rope=True,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, time_step_min=1e-6, hidden_act="gelu",
    max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=True, eos_token_id=2, bos_token_id=1,
    pad_token_id=0,
)

# MiniMax: lightning attention at 0, 1, 3 and 4, softmax attention (RoPE) at 2 and 5, every layer a MoE of 4 experts,
# top-2; the residual factors (1 in transformers' defaults, ~3.56 for alpha in MiniMax-Text-01's) set apart from 1,
# but the lightning layers' beta (and the softmax layers' alpha), so both kinds of fused step run (a part's out
# projection deferred to the next norm's kernel, or run and scaled); blocks of 16 tokens in transformers' prefill
MINIMAX_KW: dict[str, Any] = dict(
    vocab_size=2048, hidden_size=128, intermediate_size=256, num_hidden_layers=6,
    layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention", "linear_attention",
                 "full_attention"],
    num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_local_experts=4, num_experts_per_tok=2,
    block_size=16, full_attn_alpha_factor=1.0, full_attn_beta_factor=0.75, linear_attn_alpha_factor=1.5,
    linear_attn_beta_factor=1.0, mlp_alpha_factor=1.25, mlp_beta_factor=0.9,
    max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=False, eos_token_id=2, bos_token_id=1,
    pad_token_id=0,
)


def _checkpoint_dir(tmp_dir: str | Path, kind: str, seed: int, kw: dict[str, Any]) -> Path:
    key = hashlib.sha1(json.dumps(kw, sort_keys=True, default=str).encode()).hexdigest()[:10]
    return Path(tmp_dir) / f"{kind}-seed{seed}-{key}"


@torch.no_grad()
def perturb_constants(model: torch.nn.Module, std: float = 0.1, lm_head_scale: float = LM_HEAD_SCALE) -> None:
    """Add N(0, std) to every constant-initialised parameter or buffer; scale ``lm_head``."""
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if not tensor.is_floating_point() or tensor.numel() < 2 or "inv_freq" in name:
            continue
        if bool((tensor == tensor.flatten()[0]).all()):
            tensor.add_(torch.randn_like(tensor) * std)
    model.lm_head.weight.mul_(lm_head_scale)


@torch.no_grad()
def add_mtp_tensors(path: Path, seed: int = 0) -> None:
    """Add a random MTP head to the Qwen3-Next / Qwen3.5 checkpoint at ``path`` (in place): ``mtp.fc``
    ``[H, 2H]``, the ``pre_fc_norm_embedding`` / ``pre_fc_norm_hidden`` / ``norm`` weights and
    ``mtp.layers.0.*``: one full-attention decoder layer named like the checkpoint's first attention
    layer (its MLP or MoE, in the checkpoint's expert layout), every tensor freshly drawn — matrices
    N(0, std of the model tensor they mirror), norm weights N(0, 0.1) (zero-centred: scale 1 + w) —
    and ``mtp_num_hidden_layers: 1`` in ``config.json``."""
    from safetensors.torch import load_file, save_file

    config = json.loads((path / "config.json").read_text())
    tensors = load_file(path / "model.safetensors")
    first = config["layer_types"].index("full_attention")
    prefix = f"model.layers.{first}."
    gen = torch.Generator().manual_seed(seed + 1234)
    h = config["hidden_size"]

    def draw(shape, std: float, dtype: torch.dtype) -> torch.Tensor:
        return (torch.randn(shape, generator=gen) * std).to(dtype)

    dtype = tensors[prefix + "input_layernorm.weight"].dtype
    mtp = {name: draw((h,), 0.1, dtype)
           for name in ("mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.norm.weight")}
    mtp["mtp.fc.weight"] = draw((h, 2 * h), 0.05, dtype)
    for name, t in tensors.items():
        if name.startswith(prefix):
            std = 0.1 if t.dim() == 1 else float(t.float().std())
            mtp["mtp.layers.0." + name.removeprefix(prefix)] = draw(t.shape, std, t.dtype)
    save_file({**tensors, **mtp}, path / "model.safetensors", metadata={"format": "pt"})
    config["mtp_num_hidden_layers"] = 1
    (path / "config.json").write_text(json.dumps(config, indent=2))


def _build(kind: str, tmp_dir: str | Path, seed: int, kw: dict[str, Any], mtp: bool = False) -> Path:
    out = _checkpoint_dir(tmp_dir, kind + ("-mtp" if mtp else ""), seed, kw)
    if (out / "config.json").is_file():
        return out
    import transformers  # test-only dependency

    config_cls, model_cls = {
        "qwen3_next": (transformers.Qwen3NextConfig, transformers.Qwen3NextForCausalLM),
        "qwen3_5": (transformers.Qwen3_5TextConfig, transformers.Qwen3_5ForCausalLM),
        "qwen3_5_moe": (transformers.Qwen3_5MoeTextConfig, transformers.Qwen3_5MoeForCausalLM),
        "nemotron_h": (transformers.NemotronHConfig, transformers.NemotronHForCausalLM),
        "falcon_h1": (transformers.FalconH1Config, transformers.FalconH1ForCausalLM),
        "bamba": (transformers.BambaConfig, transformers.BambaForCausalLM),
        "granitemoehybrid": (transformers.GraniteMoeHybridConfig, transformers.GraniteMoeHybridForCausalLM),
        "lfm2": (transformers.Lfm2Config, transformers.Lfm2ForCausalLM),
        "lfm2_moe": (transformers.Lfm2MoeConfig, transformers.Lfm2MoeForCausalLM),
        "kimi_linear": (transformers.KimiLinearConfig, transformers.KimiLinearForCausalLM),
        "bailing_hybrid": (transformers.BailingHybridConfig, transformers.BailingHybridForCausalLM),
        "olmo_hybrid": (transformers.OlmoHybridConfig, transformers.OlmoHybridForCausalLM),
        "lara_mini": (transformers.LaraMiniConfig, transformers.LaraMiniForCausalLM),
        "lfm3": (transformers.Lfm3Config, transformers.Lfm3ForCausalLM),
        "zamba2": (transformers.Zamba2Config, transformers.Zamba2ForCausalLM),
        "jamba": (transformers.JambaConfig, transformers.JambaForCausalLM),
        "minimax": (transformers.MiniMaxConfig, transformers.MiniMaxForCausalLM),
        "mamba": (transformers.MambaConfig, transformers.MambaForCausalLM),
        "falcon_mamba": (transformers.FalconMambaConfig, transformers.FalconMambaForCausalLM),
        "mamba2": (transformers.Mamba2Config, transformers.Mamba2ForCausalLM),
    }[kind]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**kw)).eval()
    perturb_constants(model)
    tmp = out.with_name(out.name + ".partial")
    model.save_pretrained(tmp, safe_serialization=True)
    if mtp:
        add_mtp_tensors(tmp, seed)
    tmp.rename(out)
    return out


def make_qwen3_next(tmp_dir: str | Path, moe: bool = False, seed: int = 0, mtp: bool = False, **overrides: Any) -> Path:
    """Tiny ``Qwen3NextForCausalLM`` (8 layers, 2 attention; ``moe=True``: 8 experts, top-2)."""
    kw = {**QWEN3_NEXT_KW, **({} if moe else {"num_experts": 0}), **overrides}
    return _build("qwen3_next", tmp_dir, seed, kw, mtp)


def make_qwen3_5(tmp_dir: str | Path, seed: int = 0, mtp: bool = False, **overrides: Any) -> Path:
    """Tiny ``Qwen3_5ForCausalLM`` (text model, dense MLP, split GDN projections)."""
    return _build("qwen3_5", tmp_dir, seed, {**QWEN3_5_KW, **overrides}, mtp)


# A tiny Qwen3.5 vision-language checkpoint (``Qwen3_5ForConditionalGeneration``): QWEN3_5_KW's text model (its
# RoPE's 8 frequencies split 3/3/2 over time, height and width) and a 2-block vision tower of 8-pixel patches; the
# image tokens are ids of the text vocabulary's end
QWEN3_5_VL_TOKENS: dict[str, int] = dict(
    vision_start_token_id=2040, vision_end_token_id=2041, image_token_id=2042, video_token_id=2043)
QWEN3_5_VL_VISION_KW: dict[str, Any] = dict(
    depth=2, hidden_size=64, num_heads=4, intermediate_size=128, out_hidden_size=QWEN3_5_KW["hidden_size"],
    patch_size=8, temporal_patch_size=2, spatial_merge_size=2, in_channels=3, num_position_embeddings=64,
    hidden_act="gelu_pytorch_tanh")


def make_qwen3_5_vl(tmp_dir: str | Path, seed: int = 0, tokens: dict[str, int] | None = None, **overrides: Any) -> Path:
    """Tiny ``Qwen3_5ForConditionalGeneration`` (``QWEN3_5_VL_*``; ``tokens``: other image token ids, ``overrides``
    go to the text config), saved as transformers saves it (``model.language_model.*``, ``model.visual.*``), with
    a ``preprocessor_config.json`` for its 8-pixel patches (images of 16 x 16 to 64 x 64 pixels after resizing)."""
    text = {**QWEN3_5_KW, "rope_parameters": {**QWEN3_5_KW["rope_parameters"], "mrope_section": [3, 3, 2],
                                              "mrope_interleaved": True}, **overrides}
    kw = {"text": text, "vision": QWEN3_5_VL_VISION_KW, **(tokens or QWEN3_5_VL_TOKENS)}
    out = _checkpoint_dir(tmp_dir, "qwen3_5_vl", seed, kw)
    if (out / "config.json").is_file():
        return out
    import transformers  # test-only dependency

    config = transformers.Qwen3_5Config(text_config=text, vision_config=QWEN3_5_VL_VISION_KW,
                                        tie_word_embeddings=False, **(tokens or QWEN3_5_VL_TOKENS))
    torch.manual_seed(seed)
    model = transformers.Qwen3_5ForConditionalGeneration(config).eval()
    perturb_constants(model)
    tmp = out.with_name(out.name + ".partial")
    model.save_pretrained(tmp, safe_serialization=True)
    (tmp / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Qwen2VLImageProcessor", "patch_size": 8, "temporal_patch_size": 2, "merge_size": 2,
        "size": {"shortest_edge": 16 * 16, "longest_edge": 64 * 64},
        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}, indent=2))
    tmp.rename(out)
    return out


def make_qwen3_5_moe(tmp_dir: str | Path, seed: int = 0, mtp: bool = False, **overrides: Any) -> Path:
    """Tiny ``Qwen3_5MoeForCausalLM`` (8 layers, 2 attention; MoE of 8 experts, top-2, + shared expert
    in each), saved as transformers writes it (per-expert tensors)."""
    return _build("qwen3_5_moe", tmp_dir, seed, {**QWEN3_5_MOE_KW, **overrides}, mtp)


def make_nemotron_h(tmp_dir: str | Path, seed: int = 0, **overrides: Any) -> Path:
    """Tiny ``NemotronHForCausalLM`` (M - M * - M E *: 3 Mamba2, 2 attention, 2 MLP, 1 MoE)."""
    return _build("nemotron_h", tmp_dir, seed, {**NEMOTRON_H_KW, **overrides})


def make_falcon_h1(tmp_dir: str | Path, seed: int = 0, **overrides: Any) -> Path:
    """Tiny ``FalconH1ForCausalLM`` (4 layers, each attention + Mamba2 in parallel, gated Mamba norm)."""
    return _build("falcon_h1", tmp_dir, seed, {**FALCON_H1_KW, **overrides})


def make_bamba(tmp_dir: str | Path, seed: int = 0, **overrides: Any) -> Path:
    """Tiny ``BambaForCausalLM`` (6 layers: Mamba2, attention at 2 and 5, SwiGLU MLP in each)."""
    return _build("bamba", tmp_dir, seed, {**BAMBA_KW, **overrides})


def make_granite_h(tmp_dir: str | Path, seed: int = 0, **overrides: Any) -> Path:
    """Tiny ``GraniteMoeHybridForCausalLM`` (6 layers: Mamba2, attention at 2 and 5, MoE + shared expert)."""
    return _build("granitemoehybrid", tmp_dir, seed, {**GRANITE_H_KW, **overrides})


def make_lfm2(tmp_dir: str | Path, seed: int = 0, **overrides: Any) -> Path:
    """Tiny ``Lfm2ForCausalLM`` (6 layers: short convolutions, attention at 2 and 4, SwiGLU MLP in each)."""
    return _build("lfm2", tmp_dir, seed, {**LFM2_KW, **overrides})


def make_lfm2_moe(tmp_dir: str | Path, seed: int = 0, **overrides: Any) -> Path:
    """Tiny ``Lfm2MoeForCausalLM`` (4 layers: short convolutions, attention at 1 and 3; a SwiGLU MLP in layer 0,
    then MoE of 8 experts, top-2, with a nonzero expert bias), saved as transformers writes it (per-expert
    ``w1/w3/w2`` tensors, LiquidAI's layout)."""
    return _build("lfm2_moe", tmp_dir, seed, {**LFM2_MOE_KW, **overrides})


def make_kimi_linear(tmp_dir: str | Path, seed: int = 0, **overrides: Any) -> Path:
    """Tiny ``KimiLinearForCausalLM`` (6 layers: KDA, MLA at 2 and 5; dense MLP in layer 0, then MoE),
    saved as transformers writes it (Moonshot's tensor names)."""
    return _build("kimi_linear", tmp_dir, seed, {**KIMI_LINEAR_KW, **overrides})


def make_bailing_hybrid(tmp_dir: str | Path, seed: int = 0, **overrides: Any) -> Path:
    """Tiny ``BailingHybridForCausalLM`` (Ling 3; 6 layers: KDA, MLA with RoPE at 2 and 5; dense MLP in layer 0,
    then MoE), saved as transformers writes it (inclusionAI's tensor names)."""
    return _build("bailing_hybrid", tmp_dir, seed, {**BAILING_HYBRID_KW, **overrides})


def make_olmo_hybrid(tmp_dir: str | Path, seed: int = 0, **overrides: Any) -> Path:
    """Tiny ``OlmoHybridForCausalLM`` (6 layers: Gated DeltaNet, post-norm attention at 2 and 5, a SwiGLU MLP in
    each), saved as transformers writes it (OLMo-core's tensor names)."""
    return _build("olmo_hybrid", tmp_dir, seed, {**OLMO_HYBRID_KW, **overrides})


def make_lara_mini(tmp_dir: str | Path, seed: int = 0, **overrides: Any) -> Path:
    """Tiny ``LaraMiniForCausalLM`` (6 layers: Gated DeltaNet, sliding-window attention (a window of 6) at 1 and 4,
    global NoPE attention at 3; MoE of 8 experts, top-2, + an ungated shared expert in each), saved as transformers
    writes it (the published layout: fused GDN ``in_proj``, ``out_norm``)."""
    return _build("lara_mini", tmp_dir, seed, {**LARA_MINI_KW, **overrides})


def make_lfm3(tmp_dir: str | Path, seed: int = 0, **overrides: Any) -> Path:
    """Tiny ``Lfm3ForCausalLM`` (6 layers: short convolutions, global attention at 2, sliding-window attention (a
    window of 6) at 4; sandwich norms, per-head attention gates, a SwiGLU MLP in each), saved as transformers writes
    it (``self_attn.gate_proj``)."""
    return _build("lfm3", tmp_dir, seed, {**LFM3_KW, **overrides})


def make_zamba2(tmp_dir: str | Path, seed: int = 0, **overrides: Any) -> Path:
    """Tiny ``Zamba2ForCausalLM`` (6 layers: Mamba2, hybrid at 1, 3 and 5 over two shared attention + GeGLU blocks,
    q/k/v and MLP adapters, RoPE), saved as transformers writes it (each block at the first layer that runs it)."""
    return _build("zamba2", tmp_dir, seed, {**ZAMBA2_KW, **overrides})


def make_minimax(tmp_dir: str | Path, seed: int = 0, **overrides: Any) -> Path:
    """Tiny ``MiniMaxForCausalLM`` (6 layers: lightning attention, softmax attention at 2 and 5; a MoE of 4
    experts, top-2, in every layer), saved as transformers writes it (MiniMax's tensor names: ``block_sparse_moe``,
    each expert's ``w1`` / ``w2`` / ``w3``; the lightning layers' decay tables too)."""
    return _build("minimax", tmp_dir, seed, {**MINIMAX_KW, **overrides})


def make_jamba(tmp_dir: str | Path, seed: int = 0, **overrides: Any) -> Path:
    """Tiny ``JambaForCausalLM`` (6 layers: Mamba1, attention at 1 and 4; MoE of 4 experts, top-2, in the
    odd layers, SwiGLU MLPs in the even ones), saved as transformers writes it (AI21's tensor names)."""
    return _build("jamba", tmp_dir, seed, {**JAMBA_KW, **overrides})


def make_mamba(tmp_dir: str | Path, seed: int = 0, **overrides: Any) -> Path:
    """Tiny ``MambaForCausalLM`` (4 Mamba1 layers, no attention, no MLP)."""
    return _build("mamba", tmp_dir, seed, {**MAMBA_KW, **overrides})


def make_falcon_mamba(tmp_dir: str | Path, seed: int = 0, **overrides: Any) -> Path:
    """Tiny ``FalconMambaForCausalLM`` (4 Mamba1 layers with weightless RMSNorms on dt, B and C)."""
    return _build("falcon_mamba", tmp_dir, seed, {**FALCON_MAMBA_KW, **overrides})


def make_mamba2(tmp_dir: str | Path, seed: int = 0, **overrides: Any) -> Path:
    """Tiny ``Mamba2ForCausalLM`` (4 Mamba2 layers, no attention, no MLP)."""
    return _build("mamba2", tmp_dir, seed, {**MAMBA2_KW, **overrides})


@torch.no_grad()
def make_perturbed(tmp_dir: str | Path, base, std: float = 0.05, seed: int = 1, **kw: Any) -> Path:
    """A draft model for speculative-decoding tests: the checkpoint ``base(tmp_dir, **kw)`` builds,
    with N(0, (std x the tensor's std)^2) noise added to every matrix (seeded). It agrees with the
    original's greedy choice most of the time, not always: with 3 drafts per step the tiny
    Qwen3-Next accepts about 2.5 tokens per verify step at ``std=0.05`` (4 at 0, 1.6 at 0.1)."""
    import shutil

    from safetensors.torch import load_file, save_file

    src = base(tmp_dir, **kw)
    out = src.with_name(f"{src.name}-perturbed{std}-seed{seed}")
    if (out / "config.json").is_file():
        return out
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp)
    gen = torch.Generator().manual_seed(seed)
    tensors = load_file(tmp / "model.safetensors")
    for name, t in tensors.items():
        if t.dim() > 1 and t.is_floating_point():
            tensors[name] = t + (torch.randn(t.shape, generator=gen) * std * t.float().std()).to(t.dtype)
    save_file(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
    tmp.rename(out)
    return out


@torch.no_grad()
def make_lora_adapter(tmp_dir: str | Path, base_path: Path, target_modules: Sequence[str] | str = ("q_proj", "v_proj"),
                      r: int = 4, lora_alpha: float = 8.0, seed: int = 0, std: float = 0.2, use_rslora: bool = False,
                      merged: bool = False) -> Path:
    """A PEFT LoRA adapter for the checkpoint at ``base_path``, made by ``peft`` itself (``get_peft_model``,
    ``save_pretrained``: its ``adapter_config.json`` and ``adapter_model.safetensors``), every ``lora_A`` and
    ``lora_B`` drawn N(0, std^2) (seeded; peft starts ``lora_B`` at zero, which would change nothing).
    ``merged``: instead, the base checkpoint with that adapter merged into its weights by peft
    (``merge_and_unload``): the model the adapter must serve as, the differential tests' oracle."""
    import peft  # test-only dependency
    import transformers

    targets = target_modules if isinstance(target_modules, str) else list(target_modules)  # ("all-linear": PEFT's)
    kw = dict(base=base_path.name, target_modules=targets, r=r, lora_alpha=lora_alpha, std=std, use_rslora=use_rslora)
    adapter = _checkpoint_dir(tmp_dir, "lora", seed, kw)
    out = adapter.with_name(adapter.name + "-merged") if merged else adapter
    if (out / ("config.json" if merged else "adapter_config.json")).is_file():
        return out
    model = transformers.AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    config = peft.LoraConfig(r=r, lora_alpha=lora_alpha, target_modules=targets, lora_dropout=0.0,
                             use_rslora=use_rslora)
    wrapped = peft.get_peft_model(model, config)
    gen = torch.Generator().manual_seed(seed)
    for name, p in sorted(wrapped.named_parameters()):
        if ".lora_A." in name or ".lora_B." in name:
            p.copy_(torch.randn(p.shape, generator=gen) * std)
    tmp = out.with_name(out.name + ".partial")
    if merged:
        wrapped.merge_and_unload().save_pretrained(tmp, safe_serialization=True)
    else:
        wrapped.save_pretrained(tmp, safe_serialization=True)
    tmp.rename(out)
    return out


def quantized_tensor(name: str, tensor: torch.Tensor) -> bool:
    """Whether an FP8 checkpoint quantizes ``name``, as the published ones do: the matrices of the
    projections and experts (``mtp.*`` too), not embeddings, ``lm_head``, norms, convolutions or
    routers."""
    skipped = ("embed", "lm_head", "norm", "conv", ".gate.", "router", "A_log", "dt_bias")
    return tensor.dim() >= 2 and tensor.is_floating_point() and not any(s in name for s in skipped)


@torch.no_grad()
def quantize_checkpoint(src: Path, block: tuple[int, int] | None = (64, 64), dequantized: bool = False) -> Path:
    """An FP8 copy of the checkpoint ``src`` beside it: every :func:`quantized_tensor` as float8
    with its scales (``block``: per block, ``X_scale_inv``; ``None``: per tensor, ``X.weight_scale``
    and an ``input_scale`` per layer), ``quantization_config`` in ``config.json``. With
    ``dequantized``, the same values read back in fp32 and no ``quantization_config``: the
    unquantized checkpoint an FP8 one must load as."""
    from safetensors.torch import load_file, save_file

    from hyla.model.quantization import Fp8Scheme

    scheme = Fp8Scheme(block)
    tag = "pertensor" if block is None else f"{block[0]}x{block[1]}"
    out = src.with_name(f"{src.name}-fp8-{tag}{'-dequantized' if dequantized else ''}")
    if (out / "config.json").is_file():
        return out
    tmp = out.with_name(out.name + ".partial")
    tmp.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, t in load_file(src / "model.safetensors").items():
        if not quantized_tensor(name, t):
            tensors[name] = t
            continue
        q, scale = scheme.quantize(t)
        if dequantized:
            tensors[name] = scheme.dequantize(q, scale)
        else:
            tensors[name], tensors[name + scheme.scale_suffix] = q, scale
            if block is None and name.endswith(".weight"):
                tensors[name.removesuffix(".weight") + ".input_scale"] = torch.tensor(0.01)
    save_file(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    if not dequantized:
        config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                         **({} if block is None else {"weight_block_size": list(block)})}
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    tmp.rename(out)
    return out


# --- a minimal harness: plain-tensor pools and per-sequence bookkeeping ------------------------


@dataclass
class Seq:
    """One sequence as the harness tracks it: tokens already in the KV cache, their KV slots (in
    order) and the state slot holding the recurrent state after those tokens."""

    state_slot: int
    tokens: list[int] = field(default_factory=list)
    kv_slots: list[int] = field(default_factory=list)


class TinyRunner:
    """Plain-tensor KV and state pools for one model, with bump allocation (never freed).

    KV slot 0 and state slot 0 are sentinels, as in ``hyla.cache``.
    """

    def __init__(self, model: torch.nn.Module, max_tokens: int = 4096, max_states: int = 64):
        c = model.config
        self.model = model
        device = next(model.parameters()).device
        self.device = device
        kv_shape = (max_tokens + 1, c.num_kv_heads, c.head_dim)
        self.k_buffers = [torch.zeros(kv_shape, dtype=c.dtype, device=device) for _ in range(c.num_attention_layers)]
        self.v_buffers = [torch.zeros(kv_shape, dtype=c.dtype, device=device) for _ in range(c.num_attention_layers)]
        self.conv_states = [torch.zeros(max_states + 1, *c.conv_shape, dtype=c.conv_dtype, device=device)
                            for _ in range(c.num_linear_layers)]
        self.ssm_states = [torch.zeros(max_states + 1, *c.ssm_shape, dtype=torch.float32, device=device)
                           for _ in range(c.num_linear_layers)]
        self.max_tokens, self.max_states = max_tokens, max_states
        self._next_kv, self._next_state = 1, 1

    def new_state_slot(self) -> int:
        if self._next_state > self.max_states:
            raise RuntimeError("TinyRunner: out of state slots")
        self._next_state += 1
        return self._next_state - 1

    def new_seq(self) -> Seq:
        return Seq(state_slot=self.new_state_slot())

    def fork(self, seq: Seq, num_tokens: int, state_slot: int) -> Seq:
        """A sequence sharing ``seq``'s first ``num_tokens`` KV slots, whose state is ``state_slot``
        (a checkpoint taken after exactly those tokens)."""
        return Seq(state_slot=state_slot, tokens=seq.tokens[:num_tokens], kv_slots=seq.kv_slots[:num_tokens])

    def _alloc_kv(self, n: int) -> list[int]:
        if self._next_kv + n > self.max_tokens + 1:
            raise RuntimeError("TinyRunner: out of KV slots")
        self._next_kv += n
        return list(range(self._next_kv - n, self._next_kv))

    def make_batch(self, seqs: Sequence[Seq], new_tokens: Sequence[Sequence[int]], decode: bool | None = None,
                   checkpoints: Sequence[tuple[int, int, int]] = (), all_logits: bool = False,
                   tree_parents: Sequence[Sequence[int]] | None = None):
        """Build the ``ForwardBatch`` for one step and book the new tokens into ``seqs``.
        ``checkpoints``: ``(seq index, tokens consumed, state slot)`` triples. ``tree_parents``:
        a tree verify step (``hyla/model/ops/tree.py``); positions are then prefix + depth."""
        from hyla.model.forward_batch import ForwardBatch

        lens = [len(t) for t in new_tokens]
        decode = all(n == 1 for n in lens) if decode is None else decode
        new_slots = [self._alloc_kv(n) for n in lens]
        prefix = [len(s.kv_slots) for s in seqs]
        dev, long = self.device, torch.long
        kv_all = [s.kv_slots + ns for s, ns in zip(seqs, new_slots)]
        cu = [0]
        for n in lens:
            cu.append(cu[-1] + n)
        indptr = [0]
        for slots in kv_all:
            indptr.append(indptr[-1] + len(slots))
        offsets = [list(range(n)) for n in lens]
        if tree_parents is not None:  # a token's position is its depth below the sequence's first new token
            offsets = []
            for par in tree_parents:
                depth: list[int] = []
                for p in par:
                    depth.append(0 if p < 0 else depth[p] + 1)
                offsets.append(depth)
        batch = ForwardBatch(
            is_decode=decode,
            input_ids=torch.tensor([t for toks in new_tokens for t in toks], dtype=long, device=dev),
            positions=torch.tensor([p + j for p, offs in zip(prefix, offsets) for j in offs], dtype=long, device=dev),
            extend_lens=lens,
            prefix_lens=prefix,
            cu_seqlens=torch.tensor(cu, dtype=long, device=dev),
            out_cache_loc=torch.tensor([s for ns in new_slots for s in ns], dtype=long, device=dev),
            kv_indices=torch.tensor([s for slots in kv_all for s in slots], dtype=long, device=dev),
            kv_indptr=torch.tensor(indptr, dtype=long, device=dev),
            k_buffers=self.k_buffers,
            v_buffers=self.v_buffers,
            state_slots=torch.tensor([s.state_slot for s in seqs], dtype=long, device=dev),
            conv_states=self.conv_states,
            ssm_states=self.ssm_states,
            ckpt_seq=torch.tensor([c[0] for c in checkpoints], dtype=long, device=dev),
            ckpt_len=torch.tensor([c[1] for c in checkpoints], dtype=long, device=dev),
            ckpt_slot=torch.tensor([c[2] for c in checkpoints], dtype=long, device=dev),
            logits_indices=torch.arange(cu[-1], device=dev) if all_logits else None,
            tree_parents=tree_parents,
            state_slot_list=[s.state_slot for s in seqs], ckpt_list=list(checkpoints),  # host copies, as the engine's
        )
        for s, toks, ns in zip(seqs, new_tokens, new_slots):
            s.tokens += list(toks)
            s.kv_slots += ns
        return batch

    def step(self, seqs: Sequence[Seq], new_tokens: Sequence[Sequence[int]], decode: bool | None = None,
             checkpoints: Sequence[tuple[int, int, int]] = (), all_logits: bool = False,
             tree_parents: Sequence[Sequence[int]] | None = None) -> torch.Tensor:
        """One forward; returns fp32 logits (last token of each sequence, or every new token)."""
        batch = self.make_batch(seqs, new_tokens, decode, checkpoints, all_logits, tree_parents)
        return self.model(batch)
