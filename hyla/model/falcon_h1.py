"""Falcon-H1 (``FalconH1ForCausalLM``): attention and Mamba2 in parallel in every layer.

Every layer is ``"hybrid"`` (``ModelConfig.layer_types``): it holds one KV buffer *and* one state
slot. With ``h = norm(x)``::

    x = x + (ssm_out * mamba(ssm_in * h)  +  attn_out * attention(attn_in * h))
    x = x + mlp(ffn_norm(x))        # down_mult * down(silu(gate_mult * gate(x)) * up(x))

Attention is Llama's (GQA, full-head RoPE, no q/k norm) with keys scaled by ``key_multiplier``.
The Mamba2 mixer (hyla's shared ``Mamba2Mixer``) has its ``in_proj`` output scaled per segment
``[z | x | B | C | dt]`` by ``ssm_multipliers`` (HF's ``mup_vector``); its width is ``mamba_d_ssm``
(= heads * head dim); its output is ``norm(y, z)`` (gated RMSNorm per group, gate before or after the norm per
``mamba_norm_before_gate``) when ``mamba_rms_norm``, else ``y * silu(z)``. Embeddings are scaled by
``embedding_multiplier`` and logits by ``lm_head_multiplier``.

Every µP multiplier is linear in a weight, so all of them are folded into the weights at load time
(``hf_weight_specs``, in fp32 before the cast to the model dtype); the forward pass has none. In
fp32 this matches HF within rounding (docs/models.md).

dt clamp: ``time_step_limit`` (default ``(0, inf)``) clamps ``softplus(dt + dt_bias)`` in *both* the
chunked (extend) and the decode path. HF's FalconH1 clamps in its chunked scan only (its
``selective_state_update`` gets no ``dt_limit``), so with a limit that binds, HF's own decode differs
from its full forward; hyla follows the full forward in both paths, so a token's state does not
depend on whether it was fed as a decode step or inside an extend. With the default limit (every
published Falcon-H1 config) the clamp never binds and both paths equal HF's.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch
from torch import nn

from hyla.model.config import (
    ModelConfig,
    hf_attention_fields,
    hf_common_fields,
    hf_float,
    hf_mamba2_fields,
    hf_require,
    hf_rope_parameters,
    hf_silu_only,
)
from hyla.model.forward_batch import ForwardBatch
from hyla.model.layers import (
    MLP,
    Attention,
    HybridForCausalLM,
    HybridLayer,
    Mamba2Mixer,
    OutProjection,
    Rope,
    add_rms_norm,
    is_gemv_step,
    materialized,
    on_gemv_step,
)
from hyla.model.weight_specs import (
    WeightSpec,
    attention_specs,
    embedding_specs,
    mamba2_specs,
    mlp_specs,
    norm_spec,
)


class FalconH1Layer(HybridLayer):
    """``x + (mamba(h) + attention(h))`` with ``h = mixer_norm(x)``, then ``x + ffn(ffn_norm(x))``.

    The two mixers are hyla's shared ``Attention`` and ``Mamba2Mixer`` (the latter configured by
    ``mamba_rms_norm``, ``mamba_norm_before_gate`` and ``mamba_out_proj_bias`` = HF's ``projectors_bias``);
    both have fused decode kernels, so the fused GPU decode step covers Falcon-H1 (:meth:`forward_fused`)."""

    def __init__(self, config: ModelConfig, index: int, new_norm: Callable[[], nn.Module]):
        c = config
        ffn = MLP(c.hidden_size, c.intermediate_size, c.hidden_act, c.mlp_bias, c.dtype)
        super().__init__(mixer=None, mixer_norm=new_norm(), ffn=ffn, ffn_norm=new_norm())
        self.attn = Attention(c, c.attention_ordinal(index))
        self.mamba = Mamba2Mixer(c, c.linear_ordinal(index))

    def mixers(self) -> list[nn.Module]:
        return [self.attn, self.mamba]

    def forward(self, x: torch.Tensor, batch: ForwardBatch, rope: Rope | None) -> torch.Tensor:
        h = self.mixer_norm(x)  # [T, hidden]
        x = x + (self.mamba(h, batch) + self.attn(h, batch, rope))  # HF's order: (mamba + attention) + residual
        return x + self.ffn(self.ffn_norm(x))

    def forward_fused(self, out: torch.Tensor | OutProjection | None, residual: torch.Tensor, batch: ForwardBatch,
                      rope: Rope | None) -> tuple[torch.Tensor | OutProjection, torch.Tensor]:
        """:meth:`forward` as :meth:`HybridLayer.forward_fused` runs a layer: each residual add in
        the next norm's kernel, and on a GEMV step every projection a GEMV. The two mixers' outputs
        are summed before the residual add (HF's order), so their out projections run here
        (:meth:`OutProjection.run`); the MLP's is left to the next layer's norm."""
        gemv_step = is_gemv_step(batch, residual)
        h, residual = add_rms_norm(out, residual, self.mixer_norm)  # [T, hidden] each
        mamba = on_gemv_step(self.mamba, gemv_step)(h, batch)
        attn = on_gemv_step(self.attn, gemv_step)(h, batch, rope)
        mixed = materialized(mamba) + materialized(attn)  # [T, hidden]
        h, residual = add_rms_norm(mixed, residual, self.ffn_norm)
        return on_gemv_step(self.ffn, gemv_step)(h), residual


class FalconH1ForCausalLM(HybridForCausalLM):
    def build_layer(self, index: int) -> HybridLayer:
        if self.config.layer_types[index] != "hybrid":
            raise ValueError(f"Falcon-H1 layers are all hybrid, layer {index} is {self.config.layer_types[index]!r}")
        return FalconH1Layer(self.config, index, self.new_norm)

    @classmethod
    def hf_weight_specs(cls, config: ModelConfig) -> list[WeightSpec]:
        """HF's tensors with every µP multiplier folded in (see the module docstring)."""
        c = config
        m_in, m_k, m_out = c.attention_in_multiplier, c.key_multiplier, c.attention_out_multiplier
        mup = mup_vector(c)  # the Mamba2 in_proj(ssm_in * h) * mup
        gate, down = c.mlp_multipliers  # up(x) * silu(gate * gate_proj(x)), then down * down_proj
        specs = embedding_specs(c, "model.embed_tokens.weight", "model.final_layernorm.weight",
                                embed_scale=c.embedding_multiplier, lm_head_scale=c.lm_head_multiplier)
        for i in range(c.num_hidden_layers):
            t, s = f"layers.{i}", f"model.layers.{i}"
            specs += [
                norm_spec(f"{t}.mixer_norm.weight", f"{s}.input_layernorm.weight"),
                norm_spec(f"{t}.ffn_norm.weight", f"{s}.pre_ff_layernorm.weight"),
                # q, k, v see attn_in * h (bias unscaled); k (bias included) is then scaled by key_multiplier
                *attention_specs(c, f"{t}.attn", f"{s}.self_attn", qkv_scales=(m_in, m_in * m_k, m_in),
                                 bias_scales=(1.0, m_k, 1.0), out_scale=m_out),
                *mamba2_specs(c, f"{t}.mamba", f"{s}.mamba", in_scale=mup * c.ssm_in_multiplier, in_bias_scale=mup,
                              out_scale=c.ssm_out_multiplier),
                *mlp_specs(f"{t}.ffn", f"{s}.feed_forward", c.mlp_bias, in_scales=(gate, 1.0), out_scale=down),
            ]
        return specs


def mup_vector(c: ModelConfig) -> torch.Tensor:
    """HF's ``compute_mup_vector``: one factor per ``in_proj`` row, ``ssm_multipliers`` over the
    segments ``[z (I) | x (I) | B (G*N) | C (G*N) | dt (H)]`` -> ``[2I + 2GN + H]`` fp32."""
    inner, gn = c.mamba_intermediate_size, c.mamba_n_groups * c.ssm_state_size
    sizes = (inner, inner, gn, gn, c.mamba_num_heads)
    return torch.cat([torch.full((n,), float(m)) for n, m in zip(sizes, c.ssm_multipliers)])


# ------------------------------------------------------------------------------------------------
# config.json parsing (``ModelConfig.from_hf`` through ``hyla.model.architectures``)
# ------------------------------------------------------------------------------------------------
def parse_hf_config(cfg: Mapping[str, Any], arch: str, dtype: str | torch.dtype | None) -> dict[str, Any]:
    """``ModelConfig`` fields of a Falcon-H1 ``config.json`` (HF ``FalconH1Config`` keys and defaults).

    Raises ``ValueError`` for a non-``silu`` activation, a non-default RoPE, a Mamba2 width that
    ``mamba_n_heads * mamba_d_head`` does not make, heads not divisible by groups, or malformed
    multiplier lists.
    """
    common = hf_common_fields(cfg, arch, dtype)  # first: its required keys are checked first
    num_layers = int(hf_require(cfg, "num_hidden_layers"))
    attention = hf_attention_fields(cfg)
    act = hf_silu_only(cfg, "Falcon-H1")
    mamba = hf_mamba2_fields(cfg, width_key="mamba_d_ssm")  # the width: mamba_d_ssm, else expand * hidden
    rope = hf_rope_parameters(cfg)  # over the whole head: HF's Falcon-H1 ignores any partial rotary factor
    return dict(
        **common,
        model_type="falcon_h1",
        layer_types=("hybrid",) * num_layers,
        ffn_types=("mlp",) * num_layers,
        norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
        zero_centered_norm=False,
        **attention,
        attention_bias=bool(cfg.get("attention_bias", False)),
        rope_theta=float(rope["rope_theta"]),
        rotary_dim=attention["head_dim"],
        **mamba,
        mamba_out_proj_bias=bool(cfg.get("projectors_bias", False)),
        mamba_rms_norm=bool(cfg.get("mamba_rms_norm", False)),
        mamba_norm_before_gate=bool(cfg.get("mamba_norm_before_gate", True)),
        intermediate_size=int(hf_require(cfg, "intermediate_size")),
        hidden_act=act,
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        embedding_multiplier=hf_float(cfg, "embedding_multiplier"),
        lm_head_multiplier=hf_float(cfg, "lm_head_multiplier"),
        key_multiplier=hf_float(cfg, "key_multiplier"),
        attention_in_multiplier=hf_float(cfg, "attention_in_multiplier"),
        attention_out_multiplier=hf_float(cfg, "attention_out_multiplier"),
        ssm_in_multiplier=hf_float(cfg, "ssm_in_multiplier"),
        ssm_out_multiplier=hf_float(cfg, "ssm_out_multiplier"),
        ssm_multipliers=_vector(cfg, "ssm_multipliers", 5),
        mlp_multipliers=_vector(cfg, "mlp_multipliers", 2),
    )


def _vector(cfg: Mapping[str, Any], key: str, n: int) -> tuple[float, ...]:
    value = cfg.get(key)
    if value is None:
        return (1.0,) * n
    if not isinstance(value, (list, tuple)) or len(value) != n:
        raise ValueError(f"Falcon-H1 {key} must be a list of {n} numbers, got {value!r}")
    return tuple(float(v) for v in value)
