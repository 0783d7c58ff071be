"""Bamba (``BambaForCausalLM``): Mamba2 or attention layers, each followed by a SwiGLU MLP.

Each layer is ``x + mixer(input_layernorm(x))`` then ``x + mlp(pre_ff_layernorm(x))``, the mixer
a Mamba2 (``linear_attention``; hyla's shared ``Mamba2Mixer``: in/out projection bias
``mamba_proj_bias``, gated RMSNorm per group with the gate applied first) or Llama-style GQA
attention (``full_attention``, at ``attn_layer_indices``) with RoPE on the first half of each head
(HF's Bamba fixes ``partial_rotary_factor = 0.5`` unless ``rope_parameters`` names one).

The dt clamp ``time_step_limit`` (default ``(0, inf)``, which never binds) is ``mamba_dt_limit``,
applied as ``Mamba2Mixer`` applies it (HF's Bamba: chunked path only; see docs/models.md).

The helpers below (the attention specs with Granite's softmax scale folded in, the Mamba2 fields of
a ``config.json``) are shared with Granite 4.0-H (``granitemoehybrid.py``), which is this decoder
with MoE feed-forwards and µP multipliers.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import torch

from hyla.model.config import HF_LAYER_TYPES, ModelConfig, hf_common_fields, hf_require
from hyla.model.layers import (
    HybridForCausalLM,
    HybridLayer,
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
def parse_hf_config(cfg: Mapping[str, Any], arch: str, dtype: str | torch.dtype | None) -> dict[str, Any]:
    """``ModelConfig`` fields of a Bamba ``config.json`` (HF ``BambaConfig`` keys and defaults):
    attention at ``attn_layer_indices`` (or a ``layers_block_type`` / ``layer_types`` list), Mamba2
    elsewhere, a dense SwiGLU MLP in every layer. Raises ``ValueError`` for a non-``silu``
    activation, a non-default RoPE, attention indices outside the stack or a Mamba2 width that
    ``mamba_n_heads * mamba_d_head`` does not make."""
    common = hf_common_fields(cfg, arch, dtype)  # first: its required keys are checked first
    num_layers = int(hf_require(cfg, "num_hidden_layers"))
    types = _bamba_layer_types(cfg, num_layers)
    heads = int(hf_require(cfg, "num_attention_heads"))
    head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
    params = rope_parameters(cfg)
    factor = float(params.get("partial_rotary_factor", 0.5))  # HF's Bamba hard-codes 0.5 otherwise
    return dict(
        **common,
        model_type="bamba",
        layer_types=types,
        ffn_types=("mlp",) * num_layers,
        norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
        zero_centered_norm=False,
        num_attention_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=head_dim,
        attention_bias=bool(cfg.get("attention_bias", False)),
        rope_theta=float(params.get("rope_theta", cfg.get("rope_theta", 10000.0))),
        rotary_dim=int(head_dim * factor),
        **mamba_config_fields(cfg),
        intermediate_size=int(hf_require(cfg, "intermediate_size")),
        hidden_act=silu_only(cfg, "Bamba"),
        mlp_bias=bool(cfg.get("mlp_bias", False)),
    )


def silu_only(cfg: Mapping[str, Any], name: str) -> str:
    """HF uses ``hidden_act`` for the MLPs and the Mamba2 conv alike: only ``silu`` is served."""
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"unsupported hidden_act {act!r} for {name} (expected 'silu')")
    return act


def mamba_config_fields(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The Mamba2 fields of a Bamba / Granite 4.0-H ``config.json`` (width ``mamba_expand *
    hidden_size``, head dim ``"auto"`` = width / heads, ``time_step_limit`` default ``(0, inf)``)."""
    inner = int(cfg.get("mamba_expand", 2) * int(cfg["hidden_size"]))
    heads = int(cfg.get("mamba_n_heads", 128))
    d_head = cfg.get("mamba_d_head", "auto")
    d_head = inner // heads if d_head in (None, "auto") else int(d_head)
    if heads <= 0 or heads * d_head != inner:
        raise ValueError(f"mamba_n_heads ({heads}) * mamba_d_head ({d_head}) must equal mamba_expand * "
                         f"hidden_size ({inner})")
    limit = cfg.get("time_step_limit", (0.0, math.inf))
    limit = (0.0, math.inf) if limit is None else tuple(float(v) for v in limit)
    if len(limit) != 2 or not limit[0] <= limit[1]:
        raise ValueError(f"time_step_limit must be (lo, hi) with lo <= hi, got {cfg.get('time_step_limit')}")
    return dict(
        linear_kind="mamba2",
        conv_kernel=int(cfg.get("mamba_d_conv", 4)),
        linear_chunk_size=int(cfg.get("mamba_chunk_size", 256)),
        mamba_num_heads=heads,
        mamba_head_dim=d_head,
        ssm_state_size=int(cfg.get("mamba_d_state", 256)),
        mamba_n_groups=int(cfg.get("mamba_n_groups", 1)),
        mamba_conv_bias=bool(cfg.get("mamba_conv_bias", True)),
        mamba_proj_bias=bool(cfg.get("mamba_proj_bias", False)),
        mamba_dt_limit=limit,
    )


def layer_types_from_list(types: Sequence[str], num_layers: int, name: str) -> tuple[str, ...]:
    """HF layer type names (``mamba`` / ``linear_attention``, ``attention`` / ``full_attention``)."""
    if len(types) != num_layers:
        raise ValueError(f"{name} layer types have {len(types)} entries, num_hidden_layers is {num_layers}")
    out = tuple(HF_LAYER_TYPES.get(t, t) for t in types)
    bad = sorted(set(out) - {"attention", "linear"})
    if bad:
        raise ValueError(f"{name} layers must be Mamba2 or attention, got {bad}")
    return out


def _bamba_layer_types(cfg: Mapping[str, Any], num_layers: int) -> tuple[str, ...]:
    listed = cfg.get("layers_block_type") or cfg.get("layer_types")
    if listed is not None:
        return layer_types_from_list(listed, num_layers, "Bamba")
    indices = set(cfg.get("attn_layer_indices") or ())
    bad = sorted(i for i in indices if not 0 <= int(i) < num_layers)
    if bad:
        raise ValueError(f"attn_layer_indices {bad} are outside the {num_layers} layers")
    return tuple("attention" if i in indices else "linear" for i in range(num_layers))


def rope_parameters(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """``rope_parameters`` (or the legacy ``rope_scaling``) of a config; ``ValueError`` unless default RoPE."""
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise ValueError(f"unsupported rope_type {rope_type!r}: hyla implements the default RoPE only")
    return params
