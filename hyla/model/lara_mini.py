"""Lara-4-Mini (``LaraMiniForCausalLM``, Translated's Lara 4 Mini).

Qwen3.5-MoE's decoder with three changes to its attention and feed-forward, and plain norms:

* three layer kinds (``layer_types``): Qwen3.5's Gated DeltaNet, **sliding-window attention**
  (``sliding_attention``: each token over its last ``sliding_window`` positions, with the default RoPE
  over whole heads) and global attention (``full_attention``: no positional encoding at all). Both
  attentions are Qwen3's: per-head q/k RMSNorms, no output gate. The released pattern repeats
  ``[linear, sliding, linear, full, sliding]``;
* the MoE's shared expert is added in full (no sigmoid gate), and its softmax router computes its
  logits in fp32 (``router_logits_fp32``);
* every RMSNorm multiplies by its weight (``norm(x) * w``, not Qwen's ``norm(x) * (1 + w)``), in fp32
  before the cast, as transformers' ``LaraMiniRMSNorm`` does.

Checkpoint layouts (``hf_weight_specs``; the loader keeps, per parameter, the first layout the
checkpoint holds): the published one fuses each Gated DeltaNet's input projections into one
``linear_attn.in_proj`` whose rows ``[q | k | v | z | b | a]`` are hyla's, and names its gated norm
``linear_attn.out_norm`` (transformers' ``save_pretrained`` writes it back so); transformers' in-memory
names (``in_proj_qkv`` / ``in_proj_z`` / ``in_proj_b`` / ``in_proj_a``, ``norm``) load too. Experts are
fused per layer (``mlp.experts.gate_up_proj`` / ``down_proj``) or per expert, as Qwen3.5-MoE's.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from hyla.model.config import ModelConfig, hf_layer_types, hf_rope_parameters
from hyla.model.qwen3_5_moe import Qwen3_5MoeForCausalLM
from hyla.model.qwen3_next import qwen_config_fields
from hyla.model.weight_specs import WeightSpec

# transformers' LaraMiniConfig defaults for the keys a config.json may omit
_DEFAULTS: dict[str, Any] = {
    "vocab_size": 151936, "hidden_size": 1024, "num_hidden_layers": 34, "num_attention_heads": 16,
    "num_key_value_heads": 4, "head_dim": 128, "max_position_embeddings": 131072, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_num_key_heads": 8, "linear_num_value_heads": 16,
    "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512, "num_experts_per_tok": 4,
    "num_experts": 128, "norm_topk_prob": True, "eos_token_id": 151643, "sliding_window": 512,
}
_PATTERN = ("linear_attention", "sliding_attention", "linear_attention", "full_attention", "sliding_attention")


class LaraMiniForCausalLM(Qwen3_5MoeForCausalLM):
    @classmethod
    def hf_weight_specs(cls, config: ModelConfig) -> list[WeightSpec]:
        """Qwen3.5-MoE's specs (no shared-expert gate: ``config.shared_expert_gate`` is off), each Gated
        DeltaNet's split input projections preceded by the published fused ``in_proj``."""
        specs: list[WeightSpec] = []
        for spec in super().hf_weight_specs(config):
            if spec.target.endswith(".mixer.in_proj.weight"):  # sources: {layer}.linear_attn.in_proj_qkv.weight, ...
                specs.append(WeightSpec(spec.target, (spec.sources[0].replace(".in_proj_qkv.", ".in_proj."),)))
            specs.append(spec)
        return specs

    @classmethod
    def normalize_hf_name(cls, name: str) -> str | None:
        """The published checkpoint's ``linear_attn.out_norm`` is transformers' ``linear_attn.norm``."""
        name = super().normalize_hf_name(name)
        return None if name is None else name.replace(".linear_attn.out_norm.", ".linear_attn.norm.")


# ------------------------------------------------------------------------------------------------
# config.json parsing (``ModelConfig.from_hf`` through ``hyla.model.architectures``)
# ------------------------------------------------------------------------------------------------
def parse_hf_config(cfg: Mapping[str, Any], arch: str, dtype: str | torch.dtype | None) -> dict[str, Any]:
    """``ModelConfig`` fields of a Lara-4-Mini ``config.json`` (missing keys take transformers'
    ``LaraMiniConfig`` defaults). ``sliding_attention`` layers become attention layers of
    ``sliding_layers`` with the default RoPE over whole heads (transformers reads no partial rotary
    factor); ``full_attention`` layers have no RoPE. Raises ``ValueError`` for a bad ``layer_types``,
    a ``sliding_window`` < 1, a non-default RoPE or Qwen3-Next's errors."""
    given, cfg = cfg, {**_DEFAULTS, **cfg}
    num_layers = int(cfg["num_hidden_layers"])
    listed = cfg.get("layer_types") or [_PATTERN[i % len(_PATTERN)] for i in range(num_layers)]
    sliding = tuple(i for i, t in enumerate(listed) if t == "sliding_attention")
    types = ["full_attention" if t == "sliding_attention" else t for t in listed]
    hf_layer_types(types, num_layers, "Lara-4-Mini", "linear_attention / sliding_attention / full_attention")
    window = int(cfg["sliding_window"])
    if sliding and window < 1:
        raise ValueError(f"Lara-4-Mini's sliding_window must be >= 1, got {window}")
    # every layer has the MoE (transformers' config has no decoder_sparse_step / mlp_only_layers)
    cfg = {**cfg, "layer_types": types, "decoder_sparse_step": 1, "mlp_only_layers": []}
    fields = qwen_config_fields(cfg, arch, dtype, model_type="lara_mini", moe=True)
    head_dim = fields["head_dim"]
    return {
        **fields,
        "zero_centered_norm": False,
        "attn_output_gate": False,
        "rotary_dim": 0,  # the global layers: no positional encoding
        "sliding_window": window if sliding else 0,
        "sliding_layers": sliding,
        "sliding_rope": (head_dim, float(hf_rope_parameters(cfg)["rope_theta"])) if sliding else None,
        "shared_expert_gate": False,
        "router_logits_fp32": True,
        "mtp_num_hidden_layers": 0,
        "extra": {"hf_config": dict(given)},  # the config.json as given (sliding layers named so), not the rewrite
    }
