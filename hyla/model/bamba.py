"""Bamba (``BambaForCausalLM``): Mamba2 or attention layers, each followed by a SwiGLU MLP.

Each layer is ``x + mixer(input_layernorm(x))`` then ``x + mlp(pre_ff_layernorm(x))``, the mixer
a Mamba2 (``linear_attention``; hyla's shared ``Mamba2Mixer``: in/out projection bias
``mamba_proj_bias``, gated RMSNorm per group with the gate applied first) or Llama-style GQA
attention (``full_attention``, at ``attn_layer_indices``) with RoPE on the first half of each head
(HF's Bamba fixes ``partial_rotary_factor = 0.5`` unless ``rope_parameters`` names one).

The dt clamp ``time_step_limit`` (default ``(0, inf)``, which never binds) is ``mamba_dt_limit``,
applied as ``Mamba2Mixer`` applies it (HF's Bamba: chunked path only; see docs/models.md).

``granite_attention_specs`` (attention with Granite's softmax scale folded in) is shared with
Granite 4.0-H (``granitemoehybrid.py``), which is this decoder with MoE feed-forwards and µP
multipliers; both read the Mamba2 keys with ``config.hf_mamba2_fields``, as Falcon-H1 does.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import torch

from hyla.model.config import (
    ModelConfig,
    hf_attention_fields,
    hf_common_fields,
    hf_layer_types,
    hf_mamba2_fields,
    hf_require,
    hf_rope_parameters,
    hf_silu_only,
)
from hyla.model.layers import (
    HybridForCausalLM,
    HybridLayer,
)
from hyla.model.weight_specs import (
    WeightSpec,
    attention_specs,
    embedding_specs,
    mamba2_specs,
    mlp_specs,
    norm_spec,
)


class BambaForCausalLM(HybridForCausalLM):
    def build_layer(self, index: int) -> HybridLayer:
        return self.mixer_ffn_layer(index)  # Mamba2Mixer or Attention, then the MLP

    @classmethod
    def hf_weight_specs(cls, config: ModelConfig) -> list[WeightSpec]:
        c = config
        specs = embedding_specs(c, "model.embed_tokens.weight", "model.final_layernorm.weight")
        for i, kind in enumerate(c.layer_types):
            t, s = f"layers.{i}", f"model.layers.{i}"
            specs += [
                norm_spec(f"{t}.mixer_norm.weight", f"{s}.input_layernorm.weight"),
                norm_spec(f"{t}.ffn_norm.weight", f"{s}.pre_ff_layernorm.weight"),
                *(granite_attention_specs(c, f"{t}.mixer", f"{s}.self_attn") if kind == "attention"
                  else mamba2_specs(c, f"{t}.mixer", f"{s}.mamba")),
                *mlp_specs(f"{t}.ffn", f"{s}.feed_forward", c.mlp_bias),
            ]
        return specs


def granite_attention_specs(c: ModelConfig, target: str, source: str, out_scale: float = 1.0) -> list[WeightSpec]:
    """Attention with ``o_proj`` times ``out_scale`` (shared with Granite 4.0-H). A softmax scale other
    than ``head_dim ** -0.5`` (Granite's ``attention_multiplier``) is folded into q (weight and bias)."""
    q = 1.0 if c.attention_multiplier is None else c.attention_multiplier * math.sqrt(c.head_dim)
    return attention_specs(c, target, source, qkv_scales=(q, 1.0, 1.0), bias_scales=(q, 1.0, 1.0), out_scale=out_scale)


# ------------------------------------------------------------------------------------------------
# config.json parsing (``ModelConfig.from_hf`` through ``hyla.model.architectures``)
# ------------------------------------------------------------------------------------------------
MAMBA2_OR_ATTENTION = "Mamba2 or attention (mamba / linear_attention, attention / full_attention)"


def parse_hf_config(cfg: Mapping[str, Any], arch: str, dtype: str | torch.dtype | None) -> dict[str, Any]:
    """``ModelConfig`` fields of a Bamba ``config.json`` (HF ``BambaConfig`` keys and defaults):
    attention at ``attn_layer_indices`` (or a ``layers_block_type`` / ``layer_types`` list), Mamba2
    elsewhere, a dense SwiGLU MLP in every layer. Raises ``ValueError`` for a non-``silu``
    activation, a non-default RoPE, attention indices outside the stack or a Mamba2 width that
    ``mamba_n_heads * mamba_d_head`` does not make."""
    common = hf_common_fields(cfg, arch, dtype)  # first: its required keys are checked first
    num_layers = int(hf_require(cfg, "num_hidden_layers"))
    types = _bamba_layer_types(cfg, num_layers)
    attention = hf_attention_fields(cfg)
    rope = hf_rope_parameters(cfg)
    factor = float(rope.get("partial_rotary_factor", 0.5))  # HF's Bamba hard-codes 0.5 otherwise
    return dict(
        **common,
        model_type="bamba",
        layer_types=types,
        ffn_types=("mlp",) * num_layers,
        norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
        zero_centered_norm=False,
        **attention,
        attention_bias=bool(cfg.get("attention_bias", False)),
        rope_theta=float(rope["rope_theta"]),
        rotary_dim=int(attention["head_dim"] * factor),
        **hf_mamba2_fields(cfg),
        intermediate_size=int(hf_require(cfg, "intermediate_size")),
        hidden_act=hf_silu_only(cfg, "Bamba"),
        mlp_bias=bool(cfg.get("mlp_bias", False)),
    )


def _bamba_layer_types(cfg: Mapping[str, Any], num_layers: int) -> tuple[str, ...]:
    listed = cfg.get("layers_block_type") or cfg.get("layer_types")
    if listed is not None:
        return hf_layer_types(listed, num_layers, "Bamba", MAMBA2_OR_ATTENTION)
    indices = set(cfg.get("attn_layer_indices") or ())
    bad = sorted(i for i in indices if not 0 <= int(i) < num_layers)
    if bad:
        raise ValueError(f"attn_layer_indices {bad} are outside the {num_layers} layers")
    return tuple("attention" if i in indices else "linear" for i in range(num_layers))
