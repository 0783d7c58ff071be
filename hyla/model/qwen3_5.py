"""Qwen3.5 (``Qwen3_5ForCausalLM`` and the text part of ``Qwen3_5ForConditionalGeneration``).

The decoder is Qwen3-Next's (Gated DeltaNet + gated attention, zero-centred norms) with a dense
SwiGLU MLP in every layer. Differences are in the checkpoint only:

* the GDN input projections are split and contiguous: ``in_proj_qkv`` (``[q | k | v]``),
  ``in_proj_z``, ``in_proj_b``, ``in_proj_a`` — stacked into hyla's ``in_proj`` as is;
* the vision-language checkpoint keeps the text model under ``model.language_model.`` and the
  vision tower under ``model.visual.``: built (``vision.py``) when its ``config.json`` has a
  ``vision_config``, its tensors then required; ignored otherwise (the text model alone);
* RoPE is multimodal (``mrope_section``): with text-only positions all three sections get the
  same position, which is exactly the default RoPE hyla applies; an image's tokens get their own
  (``ForwardBatch.mrope_positions``, ``vision.image_positions``).
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from hyla.model.config import ModelConfig
from hyla.model.qwen3_next import Qwen3NextForCausalLM, qwen_config_fields, qwen_specs
from hyla.model.vision import VisionConfig, VisionTower
from hyla.model.weight_specs import WeightSpec, concat_rows, linear_specs


class Qwen3_5ForCausalLM(Qwen3NextForCausalLM):
    def build_shared(self) -> None:
        c = self.config
        self.visual = VisionTower(c.vision, c.dtype) if c.vision is not None else None

    @classmethod
    def hf_weight_specs(cls, config: ModelConfig) -> list[WeightSpec]:
        def gdn_in_proj(target: str, source: str) -> WeightSpec:
            parts = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
            return WeightSpec(f"{target}.in_proj.weight", tuple(f"{source}.{p}.weight" for p in parts), concat_rows)

        specs = qwen_specs(config, gdn_in_proj)
        return specs if config.vision is None else specs + vision_weight_specs(config.vision)

    @classmethod
    def ignores_hf_name(cls, config: ModelConfig, name: str) -> bool:
        return config.vision is None and (name.startswith("model.visual.") or name.startswith("visual."))

    @classmethod
    def normalize_hf_name(cls, name: str) -> str | None:
        if name.startswith("model.visual."):
            return name.removeprefix("model.")
        if name.startswith("model.language_model."):
            return "model." + name.removeprefix("model.language_model.")
        return name


def vision_weight_specs(config: VisionConfig, source: str = "visual.", target: str = "visual.") -> list[WeightSpec]:
    """Every tensor of the tower in a checkpoint (names under ``source``, HF's) and the parameter it builds."""

    def linear(t: str, s: str) -> list[WeightSpec]:  # (a LayerNorm's weight and bias too)
        return linear_specs(target + t, [source + s], bias=True)

    specs = [WeightSpec(target + "patch_embed.weight", (source + "patch_embed.proj.weight",), _flatten_conv),
             WeightSpec(target + "patch_embed.bias", (source + "patch_embed.proj.bias",)),
             WeightSpec(target + "pos_embed.weight", (source + "pos_embed.weight",))]
    for i in range(config.depth):
        b = f"blocks.{i}"
        for part in ("norm1", "norm2"):
            specs += linear(f"{b}.{part}", f"{b}.{part}")
        specs += linear(f"{b}.qkv", f"{b}.attn.qkv") + linear(f"{b}.proj", f"{b}.attn.proj")
        specs += linear(f"{b}.fc1", f"{b}.mlp.linear_fc1") + linear(f"{b}.fc2", f"{b}.mlp.linear_fc2")
    specs += linear("merger_norm", "merger.norm") + linear("merger_fc1", "merger.linear_fc1")
    specs += linear("merger_fc2", "merger.linear_fc2")
    return specs


def _flatten_conv(tensors: list[torch.Tensor]) -> torch.Tensor:
    """HF's patch ``Conv3d.weight [D, C, Tp, p, p]`` as the linear map it is on one patch: ``[D, C*Tp*p*p]``."""
    return tensors[0].reshape(tensors[0].shape[0], -1)


# ------------------------------------------------------------------------------------------------
# config.json parsing (``ModelConfig.from_hf`` through ``hyla.model.architectures``)
# ------------------------------------------------------------------------------------------------
def parse_hf_config(cfg: Mapping[str, Any], arch: str, dtype: str | torch.dtype | None) -> dict[str, Any]:
    """``ModelConfig`` fields of a Qwen3.5 ``config.json``: Qwen3-Next's decoder with a dense MLP
    in every layer. The vision-language ``Qwen3_5ForConditionalGeneration`` keeps the text model
    in ``text_config`` (``vl_text_config``)."""
    if arch != "Qwen3_5ForConditionalGeneration":
        return qwen_config_fields(cfg, arch, dtype, model_type="qwen3_5", moe=False)
    fields = qwen_config_fields(vl_text_config(cfg), arch, dtype, model_type="qwen3_5", moe=False)
    return {**fields, "vision": VisionConfig.from_hf(cfg, fields["hidden_size"])}


def vl_text_config(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The text model's config of a Qwen3.5 (or Qwen3.5-MoE) vision-language ``config.json``: its
    ``text_config``, with the top-level ``tie_word_embeddings`` deciding (False where absent, as transformers'
    ``Qwen3_5Config`` reads it: the text config's flag does not tie the vision-language model's lm_head) and
    the top-level token ids and dtype filling what the text config lacks."""
    text = dict(cfg.get("text_config") or {})
    text["tie_word_embeddings"] = bool(cfg.get("tie_word_embeddings", False))  # the model's lm_head, tied or not
    for key in ("eos_token_id", "bos_token_id", "pad_token_id"):
        if text.get(key) is None and key in cfg:
            text[key] = cfg[key]
    for key in ("dtype", "torch_dtype"):
        text.setdefault(key, cfg.get(key))
    return text
