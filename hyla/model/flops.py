"""The FLOP model of a ``ModelConfig``: forward FLOPs per token and per prefill.

2 FLOPs per multiply-add. A hybrid layer (Falcon-H1) costs its attention plus its Mamba2 mixer.
Attention layers cost their projections plus ``4 * Hq * D`` per context
token (QK^T and PV over the causal context); linear (GDN / Mamba2 / LFM2 short conv) layers cost a
constant per token (projections, conv, recurrent state update); MoE counts only the ``num_experts_per_tok`` active
experts (plus router, latent projections and shared expert). Norms, activations and RoPE are
ignored. Multi-head latent attention (Kimi-Linear) is counted as hyla runs it, in the latent space:
its projections plus ``Hq * (2 * kv_lora_rank + qk_rope_head_dim)`` per context token. ``ModelConfig.flops_per_token`` / ``prefill_flops`` call these functions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # config.py imports this module
    from hyla.model.config import ModelConfig


@dataclass(frozen=True)
class FlopCount:
    """Forward FLOPs (2 per multiply-add) of one token, split by layer kind."""

    attention: float  # projections + the quadratic QK^T / PV part of every attention layer
    linear: float  # GDN / Mamba2 projections, conv and recurrent state update
    mlp: float  # dense feed-forward layers
    moe: float  # router + active experts + shared expert
    lm_head: float  # final projection to the vocabulary

    @property
    def total(self) -> float:
        return self.attention + self.linear + self.mlp + self.moe + self.lm_head


def flops_per_token(cfg: ModelConfig, context_len: int) -> FlopCount:
    """FLOPs to run one token that attends to ``context_len`` tokens (itself included).

    Raises ``ValueError`` for ``context_len < 1``.
    """
    if context_len < 1:
        raise ValueError(f"context_len must be >= 1, got {context_len}")
    counts = {"attention": 0.0, "linear": 0.0, "mlp": 0.0, "moe": 0.0}
    for i, (mixer, ffn) in enumerate(zip(cfg.layer_types, cfg.ffn_types)):
        if mixer in ("attention", "hybrid"):  # a hybrid layer (Falcon-H1) runs attention and Mamba2 both
            window = cfg.attention_window(i)  # a sliding-window layer attends to its last `window` tokens
            counts["attention"] += _attention_flops(cfg, min(context_len, window) if window else context_len)
        if mixer in ("linear", "hybrid"):
            counts["linear"] += _linear_flops(cfg)
        if mixer == "hybrid" and cfg.shared_blocks:  # Zamba2: the shared block's MLP, its adapters, the layer's linear
            counts["mlp"] += _zamba2_block_flops(cfg)
        for kind in (mixer, ffn):
            if kind == "mlp":
                counts["mlp"] += _mlp_flops(cfg, cfg.intermediate_size)
            elif kind == "moe":
                counts["moe"] += _moe_flops(cfg)
    return FlopCount(lm_head=2.0 * cfg.hidden_size * cfg.vocab_size, **counts)


def prefill_flops(cfg: ModelConfig, extend_len: int, prefix_len: int = 0) -> float:
    """Total FLOPs to prefill ``extend_len`` tokens after ``prefix_len`` cached ones.

    Exact sum of ``flops_per_token(cfg, prefix_len + j + 1).total`` for ``j < extend_len`` (closed
    form: the per-token cost is affine in the context length, a sliding-window layer's in the context
    capped at its window). This is what a cached prefix of ``prefix_len`` tokens saves relative to
    recomputing it. Raises ``ValueError`` for negative lengths.
    """
    if extend_len < 0 or prefix_len < 0:
        raise ValueError("extend_len and prefix_len must be >= 0")
    if extend_len == 0:
        return 0.0
    first, last = prefix_len + 1, prefix_len + extend_len
    window = cfg.sliding_window
    per_key = _attention_flops(cfg, 2) - _attention_flops(cfg, 1) if cfg.num_attention_layers else 0.0
    windowed = per_key * len(cfg.sliding_layers)  # FLOPs per extra context token of the sliding-window layers
    base = flops_per_token(cfg, 1).total
    slope = flops_per_token(cfg, 2).total - base - (windowed if window > 1 else 0.0)  # of the other layers
    total = extend_len * (base - slope - windowed) + slope * context_sum(first, last)
    return total + windowed * context_sum(first, last, window) if windowed else total


def context_sum(first: int, last: int, cap: int = 0) -> float:
    """``sum(min(c, cap) for c in first..last)`` in closed form (``cap`` 0: no cap; 0 when ``last < first``):
    the context lengths a prefill's tokens attend to, a sliding-window layer's capped at its window."""
    def plain(a: int, b: int) -> float:
        return (a + b) * (b - a + 1) / 2.0 if b >= a else 0.0

    if not cap:
        return plain(first, last)
    return plain(first, min(last, cap)) + max(0, last - max(first, cap + 1) + 1) * cap


def _mlp_flops(cfg: ModelConfig, intermediate: int, hidden: int | None = None) -> float:
    hidden = cfg.hidden_size if hidden is None else hidden
    mats = 2 if cfg.hidden_act == "relu2" else 3  # gated (SwiGLU, GeGLU): gate, up, down; relu2: up, down
    return 2.0 * mats * hidden * intermediate


def _moe_flops(cfg: ModelConfig) -> float:
    h = cfg.hidden_size
    inner = cfg.moe_latent_size or h
    flops = 2.0 * h * cfg.num_experts  # router
    flops += cfg.num_experts_per_tok * _mlp_flops(cfg, cfg.moe_intermediate_size, inner)
    if cfg.moe_latent_size:
        flops += 2.0 * 2 * h * cfg.moe_latent_size
    if cfg.shared_expert_intermediate_size:
        flops += _mlp_flops(cfg, cfg.shared_expert_intermediate_size)
        flops += 2.0 * h if cfg.shared_expert_gate else 0.0
    return flops


def _attention_flops(cfg: ModelConfig, context_len: int) -> float:
    if cfg.mla_kv_lora_rank:
        return _mla_flops(cfg, context_len)
    h, d, hq, hkv = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_kv_heads
    q_out = hq * d * (2 if cfg.attn_output_gate else 1)
    h_in = 2 * h if cfg.shared_blocks else h  # Zamba2's shared attention reads [x | the embeddings]
    proj = 2.0 * h_in * (q_out + 2 * hkv * d) + 2.0 * hq * d * h
    if cfg.shared_attention_adapters:  # Zamba2: q, k and v low-rank adapters
        proj += 2.0 * 3 * cfg.shared_adapter_rank * (h_in + hq * d)
    return proj + 2.0 * 2 * hq * d * context_len  # QK^T and PV over the context


def _zamba2_block_flops(cfg: ModelConfig) -> float:
    """A Zamba2 hybrid layer's FLOPs besides its attention and Mamba2: the shared block's MLP, the layer's
    low-rank adapter on its in projection, the layer's ``linear`` (hidden -> hidden)."""
    h, i, r = cfg.hidden_size, cfg.intermediate_size, cfg.shared_adapter_rank
    return _mlp_flops(cfg, i) + 2.0 * r * (h + 2 * i) + 2.0 * h * h


def _mla_flops(cfg: ModelConfig, context_len: int) -> float:
    """MLA with the up-projections absorbed (hyla's ``kimi_linear.LatentAttention``): q (low-rank or
    not), the latent ``kv_a`` projection, q_nope into the latent space (``W_uk``), scores over the
    ``[c_kv | k_pe]`` latent and values in ``c_kv``, the result out of it (``W_uv``), ``o_proj``."""
    h, hq, r = cfg.hidden_size, cfg.num_attention_heads, cfg.mla_kv_lora_rank
    nope, rope, vd = cfg.mla_qk_nope_head_dim, cfg.mla_qk_rope_head_dim, cfg.mla_v_head_dim
    q_out = hq * (nope + rope)
    q = h * cfg.mla_q_lora_rank + cfg.mla_q_lora_rank * q_out if cfg.mla_q_lora_rank else h * q_out
    proj = 2.0 * (q + h * (r + rope) + hq * nope * r + hq * r * vd + hq * vd * h)
    proj += 2.0 * h * hq if cfg.mla_output_gate else 0.0  # Ling 3's per-head output gate
    return proj + 2.0 * hq * (2 * r + rope) * context_len  # scores over [c_kv | k_pe], values in c_kv


def _linear_flops(cfg: ModelConfig) -> float:
    h, k = cfg.hidden_size, cfg.conv_kernel
    if cfg.linear_kind == "gdn":
        hv, dk, dv = cfg.ssm_shape
        value_dim = hv * dv
        proj = 2.0 * h * (cfg.conv_dim + value_dim + 2 * hv) + 2.0 * value_dim * h
        state = 2.0 * 4 * hv * dk * dv  # decay, read (k^T S), write (k delta^T), output (q^T S)
        return proj + 2.0 * cfg.conv_dim * k + state
    if cfg.linear_kind == "kda":  # Kimi Delta Attention: q/k/v, the forget gate and output gate, beta, o
        hv, dk, dv = cfg.ssm_shape
        value_dim = hv * dv
        proj = 2.0 * h * (cfg.conv_dim + hv) + 2.0 * value_dim * h
        if cfg.kda_full_rank_gates:  # Ling 3's f_proj and g_proj
            gates = 2.0 * h * hv * dk + 2.0 * h * value_dim
        else:  # Kimi-Linear's f_a/f_b and g_a/g_b
            gates = 2.0 * (h * dk + dk * hv * dk) + 2.0 * (h * dv + dv * value_dim)
        state = 2.0 * 4 * hv * dk * dv  # per-channel decay, read (k^T S), write (k delta^T), output (q^T S)
        return proj + gates + 2.0 * cfg.conv_dim * k + state
    if cfg.linear_kind == "mamba2":
        inner = cfg.mamba_intermediate_size
        proj = 2.0 * h * (inner + cfg.conv_dim + cfg.mamba_num_heads) + 2.0 * inner * h
        state = 2.0 * 3 * math.prod(cfg.ssm_shape)  # decay + B x write, C read
        return proj + 2.0 * cfg.conv_dim * k + state
    if cfg.linear_kind == "mamba1":  # Jamba: in_proj to [x | z], x_proj to [dt | B | C], dt_proj, out_proj
        inner, rank, n = cfg.mamba1_inner_size, cfg.mamba1_dt_rank, cfg.ssm_state_size
        proj = 2.0 * h * 2 * inner + 2.0 * inner * (rank + 2 * n) + 2.0 * rank * inner + 2.0 * inner * h
        state = 2.0 * 3 * math.prod(cfg.ssm_shape)  # decay + B x write, C read
        return proj + 2.0 * cfg.conv_dim * k + state
    if cfg.linear_kind == "lightning":  # MiniMax: qkv_proj, output_gate, out_proj; no conv
        hv, dv, dk = cfg.ssm_shape
        value_dim = hv * dv
        return 2.0 * h * 4 * value_dim + 2.0 * value_dim * h + 2.0 * 3 * hv * dk * dv  # decay + k v^T write, q read
    if cfg.linear_kind == "short_conv":  # LFM2: in_proj to [B | C | x], depthwise conv of B*x, out_proj
        return 2.0 * h * 3 * h + 2.0 * h * h + 2.0 * cfg.conv_dim * k  # the B*x and C*y gates ignored
    return 0.0
