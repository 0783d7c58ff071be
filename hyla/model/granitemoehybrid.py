"""Granite 4.0-H (``GraniteMoeHybridForCausalLM``): Bamba's Mamba2 / attention decoder with MoE
feed-forwards and µP multipliers.

Each layer is ``x + r * mixer(input_layernorm(x))`` then ``x + r * ffn(post_attention_layernorm(x))``
with ``r = residual_multiplier``. The mixer is a Mamba2 (``mamba`` / ``linear_attention``; HF's
``BambaMixer``, hyla's shared ``Mamba2Mixer``) or GQA attention (``attention`` /
``full_attention``) whose softmax scale is ``attention_multiplier`` and which has RoPE only when
``position_embedding_type == "rope"`` (Granite 4.0-H checkpoints use none). The feed-forward is a
MoE (softmax over the top-k router logits, SwiGLU experts) plus a shared SwiGLU expert, or, with
``num_local_experts == 0``, the shared expert alone. Embeddings are scaled by
``embedding_multiplier`` and logits divided by ``logits_scaling``.

All multipliers are folded into the weights at load time (fp32, before the cast): the embedding,
q (``attention_multiplier * sqrt(head_dim)``, so ``softmax(q k^T / sqrt(d))`` uses
``attention_multiplier``), every output projection that feeds the residual (``o_proj``, the Mamba2
``out_proj``, the experts' down projections, the shared expert's) and ``lm_head``.

Checkpoint names are the published layout (``block_sparse_moe.input_linear`` ``[E, 2I, H]``,
``block_sparse_moe.output_linear`` ``[E, H, I]``, ``block_sparse_moe.router.layer``,
``shared_mlp.input_linear`` ``[gate | up]``, ``shared_mlp.output_linear``); transformers v5's in-memory
names (``experts.gate_up_proj``, ``experts.down_proj``, ``router.weight``) are accepted too.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from hyla.model.bamba import MAMBA2_OR_ATTENTION, granite_attention_specs
from hyla.model.config import (
    ModelConfig,
    hf_attention_fields,
    hf_common_fields,
    hf_float,
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
    embedding_specs,
    mamba2_specs,
    mlp_specs,
    norm_spec,
    scaled_rows,
)

# transformers v5's in-memory names -> the published checkpoint's
_V5_NAMES = (
    (".block_sparse_moe.experts.gate_up_proj", ".block_sparse_moe.input_linear.weight"),
    (".block_sparse_moe.experts.down_proj", ".block_sparse_moe.output_linear.weight"),
    (".block_sparse_moe.router.weight", ".block_sparse_moe.router.layer.weight"),
)


class GraniteMoeHybridForCausalLM(HybridForCausalLM):
    def build_layer(self, index: int) -> HybridLayer:
        return self.mixer_ffn_layer(index)  # Mamba2Mixer or Attention, then the MoE (or the shared MLP alone)

    @classmethod
    def normalize_hf_name(cls, name: str) -> str | None:
        for v5, published in _V5_NAMES:
            if name.endswith(v5):
                return name.removesuffix(v5) + published
        return name

    @classmethod
    def hf_weight_specs(cls, config: ModelConfig) -> list[WeightSpec]:
        c = config
        r = c.residual_multiplier
        specs = embedding_specs(c, "model.embed_tokens.weight", "model.norm.weight",
                                embed_scale=c.embedding_multiplier, lm_head_scale=c.lm_head_multiplier)
        for i, (mixer, ffn) in enumerate(zip(c.layer_types, c.ffn_types)):
            t, s = f"layers.{i}", f"model.layers.{i}"
            specs += [
                norm_spec(f"{t}.mixer_norm.weight", f"{s}.input_layernorm.weight"),
                norm_spec(f"{t}.ffn_norm.weight", f"{s}.post_attention_layernorm.weight"),
                *(granite_attention_specs(c, f"{t}.mixer", f"{s}.self_attn", out_scale=r) if mixer == "attention"
                  else mamba2_specs(c, f"{t}.mixer", f"{s}.mamba", out_scale=r)),
            ]
            if ffn == "moe":
                moe = f"{s}.block_sparse_moe"
                specs += [
                    WeightSpec(f"{t}.ffn.router.weight", (f"{moe}.router.layer.weight",)),
                    WeightSpec(f"{t}.ffn.w_in", (f"{moe}.input_linear.weight",)),  # [E, 2I, H]: [gate | up]
                    WeightSpec(f"{t}.ffn.w_out", (f"{moe}.output_linear.weight",), scaled_rows(r)),  # [E, H, I]
                    *_shared_mlp_specs(f"{t}.ffn.shared_expert", f"{s}.shared_mlp", r),
                ]
            else:
                specs += _shared_mlp_specs(f"{t}.ffn", f"{s}.shared_mlp", r)
        return specs


def _shared_mlp_specs(target: str, source: str, out_scale: float) -> list[WeightSpec]:
    """HF's ``GraniteMoeHybridMLP``: ``input_linear`` rows ``[gate | up]`` (no bias), ``output_linear``."""
    return mlp_specs(target, source, in_proj=("input_linear",), out_proj="output_linear", out_scale=out_scale)


# ------------------------------------------------------------------------------------------------
# config.json parsing (``ModelConfig.from_hf`` through ``hyla.model.architectures``)
# ------------------------------------------------------------------------------------------------
def parse_hf_config(cfg: Mapping[str, Any], arch: str, dtype: str | torch.dtype | None) -> dict[str, Any]:
    """``ModelConfig`` fields of a Granite 4.0-H ``config.json`` (HF ``GraniteMoeHybridConfig`` keys
    and defaults; ``layer_types`` absent = every layer Mamba2, as HF). Raises ``ValueError`` for a
    non-``silu`` activation, a non-default RoPE, bad layer types, a Mamba2 width that
    ``mamba_n_heads * mamba_d_head`` does not make, ``num_experts_per_tok`` outside
    ``[1, num_local_experts]`` or a zero ``logits_scaling``."""
    common = hf_common_fields(cfg, arch, dtype)  # first: its required keys are checked first
    num_layers = int(hf_require(cfg, "num_hidden_layers"))
    listed = cfg.get("layer_types") or cfg.get("layers_block_type") or ["mamba"] * num_layers
    types = hf_layer_types(listed, num_layers, "Granite 4.0-H", MAMBA2_OR_ATTENTION)
    attention = hf_attention_fields(cfg)
    params = hf_rope_parameters(cfg)
    rope = cfg.get("position_embedding_type") == "rope"
    experts = int(cfg.get("num_local_experts", 8) or 0)
    shared = int(cfg.get("shared_intermediate_size", 1024))
    logits_scaling = hf_float(cfg, "logits_scaling")
    if logits_scaling == 0.0:
        raise ValueError("logits_scaling must be nonzero")
    return dict(
        **common,
        model_type="granitemoehybrid",
        layer_types=types,
        ffn_types=("moe" if experts else "mlp",) * num_layers,
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        zero_centered_norm=False,
        **attention,
        attention_bias=bool(cfg.get("attention_bias", False)),
        rope_theta=float(params["rope_theta"]),
        rotary_dim=attention["head_dim"] if rope else 0,
        **hf_mamba2_fields(cfg),
        # the dense feed-forward (no experts) is the shared MLP; with experts it runs beside them
        intermediate_size=shared,
        hidden_act=hf_silu_only(cfg, "Granite 4.0-H"),
        mlp_bias=False,  # HF's Granite MLPs have no bias
        num_experts=experts,
        num_experts_per_tok=int(cfg.get("num_experts_per_tok", 2) or 0) if experts else 0,
        moe_intermediate_size=int(hf_require(cfg, "intermediate_size")) if experts else 0,
        shared_expert_intermediate_size=shared if experts else 0,
        shared_expert_gate=False,
        norm_topk_prob=True,  # softmax over the top-k logits = the top-k probabilities renormalised
        router="softmax",
        embedding_multiplier=hf_float(cfg, "embedding_multiplier"),
        lm_head_multiplier=1.0 / logits_scaling,
        residual_multiplier=hf_float(cfg, "residual_multiplier"),
        attention_multiplier=hf_float(cfg, "attention_multiplier"),  # HF's softmax scale, 1.0 by default
    )
