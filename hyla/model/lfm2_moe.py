"""LFM2-MoE (``Lfm2MoeForCausalLM``; LiquidAI/LFM2-8B-A1B): LFM2 with sparse MoE feed-forwards.

LFM2's decoder (``lfm2.py``): each layer is ``x + mixer(operator_norm(x))`` then
``x + ffn(ffn_norm(x))``, the mixer a gated short convolution or q/k-normed GQA attention per
``layer_types``. The feed-forward of the first ``num_dense_layers`` layers is LFM2's SwiGLU MLP of
width ``intermediate_size`` as given (HF's ``Lfm2MoeMLP``: no ``block_auto_adjust_ff_dim`` rule, the
``block_*`` keys are not read); every later layer's is a sparse MoE of ``num_experts`` SwiGLU experts
of width ``moe_intermediate_size`` and no shared expert (hyla's ``SparseMoE``, its sigmoid router)::

    s   = sigmoid(W_g x)                       [E]  (logits and sigmoid in the model dtype, as HF)
    top = top-k of (s + b) over the experts         (b = expert_bias, fp32; without use_expert_bias: of s)
    w_j = s_j / (sum_{i in top} s_i + 1e-6)         (norm_topk_prob; else w_j = s_j)
    y   = routed_scaling_factor * sum_{j in top} w_j * W2_j (silu(W1_j x) * W3_j x)

where ``W1`` / ``W3`` / ``W2`` are each expert's gate / up / down projections. The router options that
differ from NemotronH's / Kimi-Linear's (``ModelConfig.router_bias``, ``router_norm_eps = 1e-6`` where
theirs is 1e-20, ``router_fp32 = False``) are config fields of the shared router, honoured on every
path (the sigmoid router runs in PyTorch on a GPU too). In an fp32 model the dtype option changes
nothing; in bf16 the expert choice sees HF's rounded scores.

Checkpoint layouts (the loader keeps, per parameter, the first the checkpoint holds):

* the published one (LiquidAI's, and what transformers' ``save_pretrained`` writes through its
  conversion mapping): ``feed_forward.experts.{e}.w1/w3/w2.weight`` per expert, stacked here into
  ``w_in [E, 2I, H]`` (rows ``[gate (w1) | up (w3)]``) and ``w_out [E, H, I]``;
* transformers' in-memory names: ``feed_forward.experts.gate_up_proj [E, 2I, H]`` (``[gate | up]``) and
  ``feed_forward.experts.down_proj [E, H, I]``, already hyla's layout.

The router is ``feed_forward.gate.weight [E, H]``, its bias the block's ``feed_forward.expert_bias``
``[E]`` (fp32, kept fp32; only with ``use_expert_bias``); the dense layers' MLP is LFM2's
``feed_forward.w1/w3/w2``.

``config.json``: ``Lfm2MoeConfig``'s keys and defaults (those LFM2 shares read as ``lfm2.py`` does:
``tie_embedding`` wins, embeddings tied by default). Refused (``ValueError``): a config without
``layer_types`` (transformers' ``Lfm2MoeConfig`` derives none from ``full_attn_idxs`` and cannot build
such a model), LFM2's errors (layer types, ``conv_L_cache``, RoPE), no experts or a top-k outside
``1..num_experts`` where a layer is sparse, a non-positive width.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from hyla.model.config import ModelConfig, hf_float
from hyla.model.lfm2 import Lfm2ForCausalLM, lfm2_backbone_fields, lfm2_layer_types
from hyla.model.weight_specs import WeightSpec, stack_experts


class Lfm2MoeForCausalLM(Lfm2ForCausalLM):
    """LFM2's layers (``build_layer``: the mixer, then ``config.ffn_types[i]``'s MLP or ``SparseMoE``)."""

    @classmethod
    def ffn_specs(cls, config: ModelConfig, index: int, target: str, source: str) -> list[WeightSpec]:
        """LFM2's MLP in the dense layers; in the sparse ones the router, the expert bias and the
        experts, per expert (published) or fused (transformers' in-memory names)."""
        c = config
        if c.ffn_types[index] != "moe":
            return super().ffn_specs(c, index, target, source)
        experts = range(c.num_experts)
        gate_up = tuple(f"{source}.experts.{e}.{w}.weight" for e in experts for w in ("w1", "w3"))
        specs = [
            WeightSpec(f"{target}.router.weight", (f"{source}.gate.weight",)),
            WeightSpec(f"{target}.w_in", gate_up, stack_experts(2)),  # [E, 2I, H]: [gate (w1) | up (w3)]
            WeightSpec(f"{target}.w_in", (f"{source}.experts.gate_up_proj",)),  # transformers' fused layout
            WeightSpec(f"{target}.w_out", tuple(f"{source}.experts.{e}.w2.weight" for e in experts),
                       stack_experts(1)),  # [E, H, I]
            WeightSpec(f"{target}.w_out", (f"{source}.experts.down_proj",)),
        ]
        if c.router_bias:
            specs.append(WeightSpec(f"{target}.e_score_correction_bias", (f"{source}.expert_bias",)))
        return specs


# ------------------------------------------------------------------------------------------------
# config.json parsing (``ModelConfig.from_hf`` through ``hyla.model.architectures``)
# ------------------------------------------------------------------------------------------------
def parse_hf_config(cfg: Mapping[str, Any], arch: str, dtype: str | torch.dtype | None) -> dict[str, Any]:
    """``ModelConfig`` fields of an LFM2-MoE ``config.json`` (HF ``Lfm2MoeConfig`` keys and defaults:
    2 dense layers, 32 experts of width 1792, top-4, expert bias on, renormalised, scaling 1.0).
    Raises ``ValueError`` without ``layer_types``, for LFM2's errors, for no experts where a layer is
    sparse and for a non-positive width (the top-k range: ``ModelConfig``)."""
    fields, cfg = lfm2_backbone_fields(cfg, arch, dtype)
    num_layers = int(cfg["num_hidden_layers"])
    if cfg.get("layer_types") is None:
        raise ValueError("LFM2-MoE config.json needs layer_types (transformers' Lfm2MoeConfig derives none "
                         "from full_attn_idxs)")
    dense = int(cfg.get("num_dense_layers", 2))
    ffn_types = tuple("mlp" if i < dense else "moe" for i in range(num_layers))
    sparse = "moe" in ffn_types
    width = int(cfg.get("intermediate_size", 7168))
    num_experts = int(cfg.get("num_experts", 32) or 0)
    moe_width = int(cfg.get("moe_intermediate_size", 1792))
    if "mlp" in ffn_types and width <= 0:
        raise ValueError(f"LFM2-MoE intermediate_size must be positive, got {width}")
    if sparse and num_experts < 1:
        raise ValueError(f"LFM2-MoE sparse layers need num_experts >= 1, got {num_experts}")
    if sparse and moe_width <= 0:
        raise ValueError(f"LFM2-MoE moe_intermediate_size must be positive, got {moe_width}")
    return dict(
        **fields,
        model_type="lfm2_moe",
        layer_types=lfm2_layer_types(cfg, num_layers),
        ffn_types=ffn_types,
        intermediate_size=width,
        num_experts=num_experts if sparse else 0,
        num_experts_per_tok=int(cfg.get("num_experts_per_tok", 4)) if sparse else 0,
        moe_intermediate_size=moe_width if sparse else 0,
        shared_expert_intermediate_size=0,
        shared_expert_gate=False,
        norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
        router="sigmoid",
        router_bias=bool(cfg.get("use_expert_bias", True)),
        router_norm_eps=1e-6,  # HF's Lfm2MoeTopKRouter: w / (sum + 1e-6)
        router_fp32=False,  # HF's router: F.linear and sigmoid in the model dtype
        routed_scaling_factor=hf_float(cfg, "routed_scaling_factor", 1.0),
    )
