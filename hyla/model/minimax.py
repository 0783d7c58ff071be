"""MiniMax-01 (``MiniMaxForCausalLM``: MiniMax-Text-01, MiniMax-M1): lightning attention and softmax
attention, each layer followed by a mixture of experts, with scaled post-norm residuals.

Each layer is (transformers' ``MiniMaxDecoderLayer``; ``a`` / ``b`` the config's factors, per mixer kind
and for the FFN; the residual stream is the *normed* input)::

    h = input_layernorm(x);          x = a_mix * h + b_mix * mixer(h)
    h = post_attention_layernorm(x); x = a_ffn * h + b_ffn * moe(h)

* **Lightning attention** (:class:`LightningAttention`, transformers' ``MiniMaxLightningAttention``):
  a linear attention with one fixed decay per head, no normalisation of q or k and no scale::

      [q | k | v] = silu(qkv_proj(h))                  # [T, H, D] each
      S_t = exp(-s_h) S_{t-1} + k_t v_t^T               # S [H, D, D], fp32
      o_t = q_t S_t
      out = out_proj(sigmoid(output_gate(h)) * norm(o))  # one RMSNorm over all H*D channels (eps 1e-6)

  ``s_h = 2^(-8 (h+1) / H) * (1 - l / (L - 1 + 1e-5) + 1e-5)`` for head ``h`` of layer ``l`` of ``L``
  (transformers' ``get_slope_rate``: layers near the top forget slowly). This is Mamba2's SSD
  (``ops/ssd.py``) with ``x = v``, ``B = k``, ``C = q``, one group a head, ``A = -s`` and ``dt`` held
  at exactly 1 by its clamp (``dt_limit = (1, 1)``: ``clamp(softplus(0), 1, 1) = 1``), no ``D``: so
  every path of Mamba2 runs it unchanged — the PyTorch chunked scan and decode step (the CPU path
  and the oracle), token trees, fla's simple GLA for bf16 prefill, and the Triton decode, segments
  and chunk kernels (a fused decode step, CUDA graphs, fused extends). The state per sequence is
  ``[H, D, D]`` fp32; there is no conv window (``conv_shape`` has no channels). The checkpoint's
  ``slope_rate`` / ``*_decay`` buffers are transformers' tables of the same slopes: not read.
* **Softmax attention**: GQA with RoPE over ``rotary_dim`` channels (MiniMax's key; transformers'
  ``MiniMaxConfig`` has none and rotates whole heads, the default here), no bias; a ``sliding_window``
  applies to every attention layer, as in transformers.
* **MoE**: Mixtral's — a softmax router (fp32) over ``num_local_experts``, the top
  ``num_experts_per_tok`` renormalised, SwiGLU experts of ``intermediate_size``; checkpoints hold
  ``block_sparse_moe.gate`` and each expert's ``w1`` (gate), ``w3`` (up), ``w2`` (down).

Layer kinds: ``layer_types`` (``full_attention`` / ``linear_attention``), else MiniMax's
``attn_type_list`` (1 softmax, 0 lightning), else transformers' default (softmax at even layers). The
residual factors: transformers' names (``full_attn_alpha_factor``, ...) or MiniMax's
(``layernorm_full_attention_alpha``, ...). MiniMax's ``postnorm: false`` (pre-norm residuals) and
shared experts (``shared_intermediate_size`` > 0) are refused: transformers has neither.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from hyla.model.config import ModelConfig, hf_attention_fields, hf_common_fields, hf_layer_types, hf_require
from hyla.model.config import hf_rope_parameters
from hyla.model.forward_batch import ForwardBatch
from hyla.model.layers import (
    HybridForCausalLM,
    HybridLayer,
    OutProjection,
    RMSNorm,
    Rope,
    add_rms_norm,
    ckpt_kwargs,
    copy_decode_checkpoints,
    in_projection,
    is_gemv_step,
    materialized,
    on_gemv_step,
    out_projection,
    run_fused_extend_segments,
)
from hyla.model.layers import device
from hyla.model.linear import Linear
from hyla.model.ops.ssd import mamba2_chains, mamba2_chunk_scan_varlen, mamba2_state_update
from hyla.model.weight_specs import (
    WeightSpec,
    attention_specs,
    embedding_specs,
    linear_specs,
    norm_spec,
    row_segments,
    stack_experts,
)

DT_ONE = (1.0, 1.0)  # the SSD's dt clamp that holds dt at exactly 1 (see the module docstring)
NORM_EPS = 1e-6  # the lightning output norm's eps: transformers' MiniMaxRMSNorm default, not rms_norm_eps


def lightning_slopes(num_heads: int, layer: int, num_layers: int) -> torch.Tensor:
    """Each head's decay rate ``s_h`` ``[H]`` fp32 for decoder layer ``layer``, computed as transformers'
    ``MiniMaxLightningAttention.get_slope_rate`` does (the same ops, so the same bits)."""
    base = 1 / (2 ** (8 / num_heads))
    exponent = torch.arange(num_heads, device="cpu") + 1  # (not the meta device a model is built on)
    factor = 1 - layer / (num_layers - 1 + 1e-5) + 1e-5
    return (base ** exponent * factor).float()


class LightningAttention(nn.Module):
    """MiniMax's lightning attention (the module docstring) on the SSD ops and kernels. State:
    ``batch.ssm_states[j]`` ``[S, H, D, D]`` fp32 (the SSD's ``[H, P, N]``: value channel first), ``j``
    the layer's linear ordinal; ``qkv_proj``'s rows are regrouped at load from transformers' per-head
    ``[q_h | k_h | v_h]`` to ``[q | k | v]`` (:func:`regroup_qkv`), so q, k and v are column blocks."""

    fused_decode = True
    fused_extend = True
    chain_verify = True  # a verify step of padded chains: HybridForCausalLM.supports_chain_verify
    takes_gemv_step = True  # forward(gemv_step=True): see HybridLayer.forward_fused

    def __init__(self, config: ModelConfig, linear_ordinal: int, layer: int):
        super().__init__()
        c = config
        self.state_index = linear_ordinal
        self.num_heads, self.head_dim = c.linear_num_value_heads, c.linear_value_head_dim
        self.inner = self.num_heads * self.head_dim
        self.qkv_proj = Linear(c.hidden_size, 3 * self.inner, bias=False, dtype=c.dtype)
        self.output_gate = Linear(c.hidden_size, self.inner, bias=False, dtype=c.dtype)
        self.norm = RMSNorm(self.inner, c.norm_eps if c.linear_norm_eps is None else c.linear_norm_eps, dtype=c.dtype)
        self.out_proj = Linear(self.inner, c.hidden_size, bias=False, dtype=c.dtype)
        # A = -s [H] fp32: a function of the layer's place, not a weight
        self.register_buffer("neg_slope", -lightning_slopes(self.num_heads, layer, c.num_hidden_layers),
                             persistent=False)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, rope: Rope | None = None,
                gemv_step: bool = False) -> torch.Tensor | OutProjection:
        t, h, d = x.shape[0], self.num_heads, self.head_dim
        q, k, v = F.silu(in_projection(self.qkv_proj, x, gemv_step)).split(self.inner, dim=-1)  # [T, H*D] each
        gate = in_projection(self.output_gate, x, gemv_step)
        states, A = batch.ssm_states[self.state_index], self.neg_slope.to(x.device)
        dt = x.new_zeros(t, h)  # raw dt: clamp(softplus(0), 1, 1) = 1
        if batch.fused_decode:  # one Triton launch (a verify step of chains: each request's tokens in order)
            y = device.gpu("mamba2_decode").mamba2_state_update_fused(
                v, dt, A, k, q, None, None, states, batch.state_slots, DT_ONE, chain=batch.chain_slots)
        elif batch.fused_extend is not None:  # the segments / chunk kernel over the one sequence (padding rows: 0)
            y = torch.zeros(t, h, d, dtype=x.dtype, device=x.device)
            run_fused_extend_segments(device.gpu("mamba2_chunks").segment_kernel(v, dt, A, k, q, None, None, DT_ONE),
                                      y, states, batch)
        else:
            vs, ks, qs = (u.reshape(t, h, d) for u in (v, k, q))  # [T, H, D]: x, B and C of the SSD
            if batch.is_decode:
                y = mamba2_state_update(vs, dt, A, ks, qs, None, None, states, batch.state_slot_plan, dt_limit=DT_ONE)
                copy_decode_checkpoints(states, batch)
            elif batch.chains is not None:  # a verify step of padded chains (the compiled verify)
                y = mamba2_chains(vs, dt, A, ks, qs, None, None, states, batch.state_slot_plan, batch.chains,
                                  dt_limit=DT_ONE)
            elif device.fla_prefill(vs, batch):  # fla's simple GLA
                y = device.gpu("fla_chunk").mamba2_chunk_scan_fla(
                    vs, dt, A, ks, qs, None, None, batch.cu_seqlens, states, batch.state_slots,
                    **ckpt_kwargs(batch, scan=False), dt_limit=DT_ONE)
            else:
                y = mamba2_chunk_scan_varlen(vs, dt, A, ks, qs, None, None, batch.cu_seqlens, states,
                                             batch.state_slots, **ckpt_kwargs(batch), dt_limit=DT_ONE)
        y = self.norm(y.reshape(t, self.inner).to(x.dtype))  # [T, H*D]
        return out_projection(self.out_proj, torch.sigmoid(gate) * y, gemv_step)


class MiniMaxLayer(HybridLayer):
    """transformers' ``MiniMaxDecoderLayer``: each part's residual is its *normed* input, both terms
    scaled — ``x = a * norm(x) + b * part(norm(x))`` (the module docstring); ``factors`` are ``(a, b)``
    for the mixer, then for the FFN. A factor of 1 multiplies nothing (``x * 1`` is ``x``), so the
    fused path may leave a part's out projection to the next norm's kernel."""

    def __init__(self, mixer: nn.Module, mixer_norm: RMSNorm, ffn: nn.Module, ffn_norm: RMSNorm,
                 factors: tuple[tuple[float, float], tuple[float, float]]):
        super().__init__(mixer, mixer_norm, ffn, ffn_norm)
        self.factors = factors

    def forward(self, x: torch.Tensor, batch: ForwardBatch, rope: Rope | None) -> torch.Tensor:
        (a_mix, b_mix), (a_ffn, b_ffn) = self.factors
        h = self.mixer_norm(x)
        x = h * a_mix + self.mixer(h, batch, rope) * b_mix
        h = self.ffn_norm(x)
        return h * a_ffn + self.ffn(h) * b_ffn

    def forward_fused(self, out: torch.Tensor | OutProjection | None, residual: torch.Tensor, batch: ForwardBatch,
                      rope: Rope | None) -> tuple[torch.Tensor | OutProjection, torch.Tensor]:
        """:meth:`forward` in :meth:`HybridLayer.forward_fused`'s contract: the layer's input is
        ``residual + out``; it returns ``(b_ffn * ffn(h), a_ffn * h)``, the add left to the next kernel."""
        gemv_step = is_gemv_step(batch, residual)
        h, _ = add_rms_norm(out, residual, self.mixer_norm)
        h, _ = add_rms_norm(*_scaled(on_gemv_step(self.mixer, gemv_step)(h, batch, rope), h, self.factors[0]),
                            self.ffn_norm)
        return _scaled(on_gemv_step(self.ffn, gemv_step)(h), h, self.factors[1])


def _scaled(out: torch.Tensor | OutProjection, h: torch.Tensor,
            factors: tuple[float, float]) -> tuple[torch.Tensor | OutProjection, torch.Tensor]:
    """``(b * out, a * h)``, each product only where its factor is not 1."""
    a, b = factors
    return (out if b == 1 else materialized(out) * b), (h if a == 1 else h * a)


class MiniMaxForCausalLM(HybridForCausalLM):
    def build_mixer(self, index: int) -> nn.Module:
        c = self.config
        if c.layer_types[index] == "linear":
            return LightningAttention(c, c.linear_ordinal(index), index)
        return super().build_mixer(index)

    def build_layer(self, index: int) -> HybridLayer:
        c = self.config
        factors = c.residual_factors[index] if c.residual_factors else ((1.0, 1.0), (1.0, 1.0))  # (transformers')
        return MiniMaxLayer(self.build_mixer(index), self.new_norm(), self.build_ffn(c.ffn_types[index]),
                            self.new_norm(), factors)

    @classmethod
    def hf_weight_specs(cls, config: ModelConfig) -> list[WeightSpec]:
        c = config
        specs = embedding_specs(c, "model.embed_tokens.weight", "model.norm.weight")
        experts = range(c.num_experts)
        for i, kind in enumerate(c.layer_types):
            t, s = f"layers.{i}", f"model.layers.{i}"
            specs += [norm_spec(f"{t}.mixer_norm.weight", f"{s}.input_layernorm.weight"),
                      norm_spec(f"{t}.ffn_norm.weight", f"{s}.post_attention_layernorm.weight")]
            a = f"{s}.self_attn"
            if kind == "attention":
                specs += attention_specs(c, f"{t}.mixer", a)
            else:
                specs += [WeightSpec(f"{t}.mixer.qkv_proj.weight", (f"{a}.qkv_proj.weight",), regroup_qkv(c)),
                          *linear_specs(f"{t}.mixer.output_gate", [f"{a}.output_gate"], False),
                          norm_spec(f"{t}.mixer.norm.weight", f"{a}.norm.weight"),
                          *linear_specs(f"{t}.mixer.out_proj", [f"{a}.out_proj"], False)]
            m = f"{s}.block_sparse_moe"
            specs += [
                WeightSpec(f"{t}.ffn.router.weight", (f"{m}.gate.weight",)),
                WeightSpec(f"{t}.ffn.w_in", tuple(f"{m}.experts.{e}.{w}.weight" for e in experts for w in ("w1", "w3")),
                           stack_experts(2)),
                WeightSpec(f"{t}.ffn.w_out", tuple(f"{m}.experts.{e}.w2.weight" for e in experts), stack_experts(1)),
            ]
        return specs

    @classmethod
    def normalize_hf_name(cls, name: str) -> str | None:
        """transformers' lightning tables (``slope_rate``, ``query_decay``, ``key_decay``,
        ``diagonal_decay``: saved as persistent buffers) are not weights: ignored."""
        return None if name.rsplit(".", 1)[-1] in _DECAY_TABLES else name


_DECAY_TABLES = frozenset({"slope_rate", "query_decay", "key_decay", "diagonal_decay"})


def regroup_qkv(config: ModelConfig):
    """``qkv_proj.weight`` from transformers' per-head rows ``[H, (q|k|v), D]`` to ``[(q|k|v), H, D]``
    (:func:`weight_specs.row_segments`: float8 where ``D`` is whole blocks of rows)."""
    heads, dim = config.linear_num_value_heads, config.linear_value_head_dim

    def segments(shapes: list[tuple[int, ...]]) -> list[tuple[int, int, int]]:
        if shapes[0][0] != 3 * heads * dim:
            raise ValueError(f"qkv_proj {shapes[0]} does not fit {heads} heads of q, k and v of dim {dim}")
        return [(0, (h * 3 + j) * dim, dim) for j in range(3) for h in range(heads)]

    return row_segments(segments)


# ------------------------------------------------------------------------------------------------
# config.json parsing (``ModelConfig.from_hf`` through ``hyla.model.architectures``)
# ------------------------------------------------------------------------------------------------
_FACTOR_KEYS = {  # ModelConfig.residual_factors' parts: (transformers' key, MiniMax's key), alpha then beta
    "attention": (("full_attn_alpha_factor", "layernorm_full_attention_alpha"),
                  ("full_attn_beta_factor", "layernorm_full_attention_beta")),
    "linear": (("linear_attn_alpha_factor", "layernorm_linear_attention_alpha"),
               ("linear_attn_beta_factor", "layernorm_linear_attention_beta")),
    "ffn": (("mlp_alpha_factor", "layernorm_mlp_alpha"), ("mlp_beta_factor", "layernorm_mlp_beta")),
}


def _factors(cfg: Mapping[str, Any], part: str) -> tuple[float, float]:
    out = []
    for keys in _FACTOR_KEYS[part]:
        value = next((cfg[k] for k in keys if cfg.get(k) is not None), 1.0)
        out.append(float(value))
    return out[0], out[1]


def _whole(value: Any, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"MiniMax {key} must be an integer, got {value!r}")
    return value


def parse_hf_config(cfg: Mapping[str, Any], arch: str, dtype: str | torch.dtype | None) -> dict[str, Any]:
    """``ModelConfig`` fields of a MiniMax ``config.json`` (transformers' ``MiniMaxConfig`` keys and
    defaults, or MiniMax's own: ``attn_type_list``, ``layernorm_*_alpha`` / ``_beta``, ``rotary_dim``).
    Raises ``ValueError`` for a bad layer list, pre-norm residuals, shared experts, an activation other
    than SiLU or a non-default RoPE."""
    common = hf_common_fields(cfg, arch, dtype)
    common["max_position_embeddings"] = int(cfg.get("max_position_embeddings", 4096 * 32))
    num_layers = int(hf_require(cfg, "num_hidden_layers"))
    if cfg.get("layer_types") is not None:
        listed = list(cfg["layer_types"])
    elif cfg.get("attn_type_list") is not None:
        kinds = {0: "linear_attention", 1: "full_attention"}
        if any(a not in kinds for a in cfg["attn_type_list"]):
            raise ValueError(f"MiniMax attn_type_list entries must be 0 (lightning) or 1 (softmax), got "
                             f"{cfg['attn_type_list']!r}")
        listed = [kinds[a] for a in cfg["attn_type_list"]]
    else:  # transformers' default: softmax attention at the even layers
        listed = ["full_attention" if (i + 1) % 2 else "linear_attention" for i in range(num_layers)]
    layer_types = hf_layer_types(listed, num_layers, "MiniMax", "full_attention / linear_attention")
    # (transformers' MiniMax is post-norm and has no such key; MiniMax's own code reads a missing one as false)
    if not cfg.get("postnorm", arch == "MiniMaxForCausalLM"):
        raise ValueError("MiniMax with postnorm false or absent (pre-norm residuals) is not supported: "
                         "transformers' MiniMax has post-norm residuals only")
    shared = cfg.get("shared_intermediate_size") or 0
    if any(_whole(v, "shared_intermediate_size") > 0 for v in (shared if isinstance(shared, list) else [shared])):
        raise ValueError("MiniMax shared experts (shared_intermediate_size > 0) are not supported: "
                         "transformers' MiniMax has none")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"MiniMax hidden_act must be 'silu', got {cfg.get('hidden_act')!r}")
    attention = hf_attention_fields(cfg)
    heads, head_dim = attention["num_attention_heads"], attention["head_dim"]
    rotary_dim = int(cfg.get("rotary_dim") or head_dim)
    if not 0 < rotary_dim <= head_dim or rotary_dim % 2:
        raise ValueError(f"MiniMax rotary_dim must be even and in (0, head_dim={head_dim}], got {rotary_dim}")
    window = cfg.get("sliding_window")
    attention_layers = tuple(i for i, kind in enumerate(layer_types) if kind == "attention")
    if window is not None and int(window) < 1:
        raise ValueError(f"MiniMax sliding_window must be >= 1 or null, got {window}")
    intermediate = int(cfg.get("intermediate_size", 14336))
    parts = {kind: _factors(cfg, kind) for kind in ("attention", "linear")}
    ffn = _factors(cfg, "ffn")
    return dict(
        **common,
        model_type="minimax",
        layer_types=layer_types,
        ffn_types=("moe",) * num_layers,
        norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
        zero_centered_norm=False,
        **attention,
        attention_bias=False,
        rotary_dim=rotary_dim,
        rope_theta=float(hf_rope_parameters(cfg, default_theta=1e6)["rope_theta"]),
        sliding_window=int(window) if window is not None and attention_layers else 0,
        sliding_layers=attention_layers if window is not None else (),
        linear_kind="lightning",
        linear_num_key_heads=heads,
        linear_num_value_heads=heads,
        linear_key_head_dim=head_dim,
        linear_value_head_dim=head_dim,
        linear_norm_eps=NORM_EPS,
        intermediate_size=intermediate,
        hidden_act="silu",
        num_experts=_whole(cfg.get("num_local_experts", cfg.get("num_experts", 8)), "num_local_experts"),
        num_experts_per_tok=_whole(cfg.get("num_experts_per_tok", 2), "num_experts_per_tok"),
        moe_intermediate_size=intermediate,
        norm_topk_prob=True,
        router="softmax",
        residual_factors=tuple((parts[kind], ffn) for kind in layer_types),
    )
