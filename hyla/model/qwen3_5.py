"""Qwen3.5 (``Qwen3_5ForCausalLM`` and the text part of ``Qwen3_5ForConditionalGeneration``).

The decoder is Qwen3-Next's (Gated DeltaNet + gated attention, zero-centred norms) with a dense
SwiGLU MLP in every layer. Differences are in the checkpoint only:

* the GDN input projections are split and contiguous: ``in_proj_qkv`` (``[q | k | v]``),
  ``in_proj_z``, ``in_proj_b``, ``in_proj_a`` — stacked into hyla's ``in_proj`` as is;
* the vision-language checkpoint keeps the text model under ``model.language_model.`` and the
  vision tower under ``model.visual.`` (ignored: hyla serves text only);
* RoPE is multimodal (``mrope_section``), but with text-only positions all three sections get the
  same position, which is exactly the default RoPE hyla applies.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from hyla.model.config import ModelConfig
from hyla.model.qwen3_next import Qwen3NextForCausalLM, qwen_config_fields, qwen_specs
from hyla.model.weight_specs import WeightSpec, concat_rows


class Qwen3_5ForCausalLM(Qwen3NextForCausalLM):
    @classmethod
    def hf_weight_specs(cls, config: ModelConfig) -> list[WeightSpec]:
        def gdn_in_proj(target: str, source: str) -> WeightSpec:
            parts = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
            return WeightSpec(f"{target}.in_proj.weight", tuple(f"{source}.{p}.weight" for p in parts), concat_rows)

        return qwen_specs(config, gdn_in_proj)

    @classmethod
    def normalize_hf_name(cls, name: str) -> str | None:
        if name.startswith("model.visual.") or name.startswith("visual."):
            return None
        if name.startswith("model.language_model."):
            return "model." + name.removeprefix("model.language_model.")
        return name


# ------------------------------------------------------------------------------------------------
# config.json parsing (``ModelConfig.from_hf`` through ``hyla.model.architectures``)
# ------------------------------------------------------------------------------------------------
def parse_hf_config(cfg: Mapping[str, Any], arch: str, dtype: str | torch.dtype | None) -> dict[str, Any]:
    """``ModelConfig`` fields of a Qwen3.5 ``config.json``: Qwen3-Next's decoder with a dense MLP
    in every layer. The vision-language ``Qwen3_5ForConditionalGeneration`` keeps the text model
    in ``text_config`` (``vl_text_config``)."""
    if arch == "Qwen3_5ForConditionalGeneration":
        cfg = vl_text_config(cfg)
    return qwen_config_fields(cfg, arch, dtype, model_type="qwen3_5", moe=False)


def vl_text_config(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The text model's config of a Qwen3.5 (or Qwen3.5-MoE) vision-language ``config.json``: its
    ``text_config``, with the top-level ``tie_word_embeddings`` winning and the top-level token ids
    and dtype filling what the text config lacks."""
    text = dict(cfg.get("text_config") or {})
    if "tie_word_embeddings" in cfg:  # the vision-language model ties (or not) its lm_head
        text["tie_word_embeddings"] = cfg["tie_word_embeddings"]
    for key in ("eos_token_id", "bos_token_id", "pad_token_id"):
        if text.get(key) is None and key in cfg:
            text[key] = cfg[key]
    for key in ("dtype", "torch_dtype"):
        text.setdefault(key, cfg.get(key))
    return text
