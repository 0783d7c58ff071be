"""Qwen3.5-MoE (``Qwen3_5MoeForCausalLM`` and the text part of ``Qwen3_5MoeForConditionalGeneration``).

Qwen3.5's decoder (Gated DeltaNet with split input projections + gated attention, zero-centred
norms) with Qwen3-Next's sparse MoE as the feed-forward of *every* layer: a softmax router over
``num_experts`` (top-``num_experts_per_tok``, always renormalised: HF's router reads no
``norm_topk_prob``), SwiGLU experts, and a shared expert scaled by ``sigmoid(shared_expert_gate(x))``.
HF's config has no ``decoder_sparse_step`` / ``mlp_only_layers`` and no dense ``intermediate_size``.

Checkpoint layouts (``hf_weight_specs``; the loader keeps, per parameter, the first layout whose
tensors the checkpoint holds):

* the published one: experts fused per layer, ``mlp.experts.gate_up_proj [E, 2I, H]`` (rows
  ``[gate | up]`` per expert, as HF's in-memory ``Qwen3_5MoeExperts``) and ``mlp.experts.down_proj
  [E, H, I]`` -- already hyla's stacked ``w_in`` / ``w_out``;
* per expert, ``mlp.experts.{e}.gate_proj/up_proj/down_proj.weight``: what transformers'
  ``save_pretrained`` writes (its conversion mapping splits the fused tensors on save);
* the vision-language checkpoint's ``model.language_model.`` prefix and ``model.visual.`` tower, as
  Qwen3.5 (``Qwen3_5ForCausalLM.normalize_hf_name``); ``mtp.*`` set aside by the loader.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from hyla.model.config import ModelConfig
from hyla.model.qwen3_5 import Qwen3_5ForCausalLM, vl_text_config
from hyla.model.qwen3_next import qwen_config_fields
from hyla.model.vision import VisionConfig
from hyla.model.weight_specs import WeightSpec

# HF's Qwen3_5MoeTextConfig defaults for the MoE keys (used when config.json omits one)
_MOE_DEFAULTS: dict[str, Any] = {
    "num_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
}


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):
    @classmethod
    def hf_weight_specs(cls, config: ModelConfig) -> list[WeightSpec]:
        """Qwen3.5's specs with per-expert MoE tensors, each layer's ``w_in`` / ``w_out`` preceded by
        its fused (published) alternative."""
        fused: dict[str, WeightSpec] = {}
        for i, ffn in enumerate(config.ffn_types):
            if ffn != "moe":
                raise ValueError(f"internal: Qwen3.5-MoE layer {i} has feed-forward {ffn!r}, not 'moe'")
            t, s = f"layers.{i}.ffn", f"model.layers.{i}.mlp.experts"
            fused[f"{t}.w_in"] = WeightSpec(f"{t}.w_in", (f"{s}.gate_up_proj",))  # [E, 2I, H]: [gate | up]
            fused[f"{t}.w_out"] = WeightSpec(f"{t}.w_out", (f"{s}.down_proj",))  # [E, H, I]
        specs: list[WeightSpec] = []
        for spec in super().hf_weight_specs(config):
            if spec.target in fused:
                specs.append(fused[spec.target])
            specs.append(spec)
        return specs


# ------------------------------------------------------------------------------------------------
# config.json parsing (``ModelConfig.from_hf`` through ``hyla.model.architectures``)
# ------------------------------------------------------------------------------------------------
def parse_hf_config(cfg: Mapping[str, Any], arch: str, dtype: str | torch.dtype | None) -> dict[str, Any]:
    """``ModelConfig`` fields of a Qwen3.5-MoE ``config.json`` (the vision-language
    ``Qwen3_5MoeForConditionalGeneration`` keeps the text model in ``text_config``, read as
    Qwen3.5's). A MoE in every layer, top-k renormalised; missing MoE keys take HF's defaults.
    Raises ``ValueError`` for fewer than one expert or Qwen3-Next's errors (missing key, activation,
    layer types, RoPE)."""
    vl = cfg if arch == "Qwen3_5MoeForConditionalGeneration" else None
    if vl is not None:
        cfg = vl_text_config(cfg)
    # HF's Qwen3.5-MoE reads neither key: every layer is MoE
    cfg = {**_MOE_DEFAULTS, **cfg, "decoder_sparse_step": 1, "mlp_only_layers": []}
    if int(cfg["num_experts"] or 0) < 1:
        raise ValueError(f"Qwen3.5-MoE needs num_experts >= 1, got {cfg['num_experts']!r}")
    fields = qwen_config_fields(cfg, arch, dtype, model_type="qwen3_5_moe", moe=True)
    vision = VisionConfig.from_hf(vl, fields["hidden_size"]) if vl is not None else None
    return {**fields, "norm_topk_prob": True, "vision": vision}
