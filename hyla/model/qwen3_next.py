"""Qwen3-Next (``Qwen3NextForCausalLM``): Gated DeltaNet + gated full attention, dense or MoE FFN.

Every decoder layer is ``x + mixer(input_layernorm(x))`` then ``x + ffn(post_attention_layernorm(x))``;
the mixer is full attention or Gated DeltaNet per ``config.layer_types``, the FFN a dense SwiGLU
MLP or a sparse MoE (softmax router, shared expert with a sigmoid gate) per ``config.ffn_types``.
All norms are zero-centred (``1 + w``) except the GDN output norm.

Checkpoint layout differences handled here (see ``hf_weight_specs``):
* ``linear_attn.in_proj_qkvz`` / ``in_proj_ba`` are grouped per *key head*
  (``[q | k | v-group | z-group]`` for each of the ``Hk`` key heads); hyla's ``GatedDeltaNet``
  wants all of q, then k, v, z, b, a contiguous, so the rows are regrouped once at load time.
* ``q_proj``/``k_proj``/``v_proj`` are stacked into one ``qkv_proj``; ``gate_proj``/``up_proj`` into
  ``in_proj``; the per-expert tensors into stacked ``w_in [E, 2I, H]`` / ``w_out [E, H, I]``.
"""

from __future__ import annotations

import torch

from hyla.model.config import ModelConfig
from hyla.model.layers import (
    HybridForCausalLM,
    HybridLayer,
    WeightSpec,
    linear_specs,
    norm_spec,
    squeeze_conv,
    stack_experts,
)


def regroup_qkvz_ba(config: ModelConfig):
    """Combine ``[in_proj_qkvz, in_proj_ba]`` (grouped per key head) into hyla's contiguous
    ``[q | k | v | z | b | a]`` rows."""
    nk, dk, dv = config.linear_num_key_heads, config.linear_key_head_dim, config.linear_value_head_dim
    r = config.linear_num_value_heads // nk  # value heads per key head

    def combine(tensors: list[torch.Tensor]) -> torch.Tensor:
        qkvz, ba = tensors
        hidden = qkvz.shape[-1]
        if qkvz.shape[0] != nk * (2 * dk + 2 * r * dv) or ba.shape[0] != nk * 2 * r:
            raise ValueError(
                f"in_proj_qkvz {tuple(qkvz.shape)} / in_proj_ba {tuple(ba.shape)} do not fit "
                f"{nk} key heads of dim {dk} and {nk * r} value heads of dim {dv}"
            )
        g = qkvz.view(nk, 2 * dk + 2 * r * dv, hidden)  # per key head: [q | k | v-group | z-group]
        q, k, v, z = g.split([dk, dk, r * dv, r * dv], dim=1)
        b, a = ba.view(nk, 2 * r, hidden).split([r, r], dim=1)
        return torch.cat([part.reshape(-1, hidden) for part in (q, k, v, z, b, a)], dim=0)

    return combine


def attention_specs(config: ModelConfig, target: str, source: str) -> list[WeightSpec]:
    """Gated attention with per-head q/k norms (shared by Qwen3-Next and Qwen3.5)."""
    return [
        *linear_specs(f"{target}.qkv_proj", [f"{source}.q_proj", f"{source}.k_proj", f"{source}.v_proj"],
                      config.attention_bias),
        *linear_specs(f"{target}.o_proj", [f"{source}.o_proj"], config.attention_bias),
        norm_spec(f"{target}.q_norm.weight", f"{source}.q_norm.weight"),
        norm_spec(f"{target}.k_norm.weight", f"{source}.k_norm.weight"),
    ]


def gdn_common_specs(target: str, source: str) -> list[WeightSpec]:
    """The GDN tensors whose layout Qwen3-Next and Qwen3.5 share (all but the input projections)."""
    return [
        WeightSpec(f"{target}.conv_weight", (f"{source}.conv1d.weight",), squeeze_conv),
        WeightSpec(f"{target}.dt_bias", (f"{source}.dt_bias",)),
        WeightSpec(f"{target}.A_log", (f"{source}.A_log",)),
        norm_spec(f"{target}.norm.weight", f"{source}.norm.weight"),
        *linear_specs(f"{target}.out_proj", [f"{source}.out_proj"], False),
    ]


def mlp_specs(target: str, source: str) -> list[WeightSpec]:
    """SwiGLU MLP: ``in_proj = [gate_proj; up_proj]``, ``out_proj = down_proj``."""
    return [
        *linear_specs(f"{target}.in_proj", [f"{source}.gate_proj", f"{source}.up_proj"], False),
        *linear_specs(f"{target}.out_proj", [f"{source}.down_proj"], False),
    ]


def moe_specs(config: ModelConfig, target: str, source: str) -> list[WeightSpec]:
    experts = range(config.num_experts)
    gate_up = tuple(f"{source}.experts.{e}.{p}.weight" for e in experts for p in ("gate_proj", "up_proj"))
    down = tuple(f"{source}.experts.{e}.down_proj.weight" for e in experts)
    return [
        WeightSpec(f"{target}.router.weight", (f"{source}.gate.weight",)),
        WeightSpec(f"{target}.w_in", gate_up, stack_experts(2)),
        WeightSpec(f"{target}.w_out", down, stack_experts(1)),
        *mlp_specs(f"{target}.shared_expert", f"{source}.shared_expert"),
        *linear_specs(f"{target}.shared_expert_gate", [f"{source}.shared_expert_gate"], False),
    ]


def qwen_specs(config: ModelConfig, gdn_in_proj, prefix: str = "model.") -> list[WeightSpec]:
    """All weight specs of a Qwen3-Next-style decoder; ``gdn_in_proj(target, source)`` gives the
    architecture-specific GDN input projection."""
    specs = [
        WeightSpec("embed_tokens.weight", (f"{prefix}embed_tokens.weight",)),
        norm_spec("norm.weight", f"{prefix}norm.weight"),
        lm_head_spec(config, f"{prefix}embed_tokens.weight"),
    ]
    for i, (mixer, ffn) in enumerate(zip(config.layer_types, config.ffn_types)):
        t, s = f"layers.{i}", f"{prefix}layers.{i}"
        specs.append(norm_spec(f"{t}.mixer_norm.weight", f"{s}.input_layernorm.weight"))
        specs.append(norm_spec(f"{t}.ffn_norm.weight", f"{s}.post_attention_layernorm.weight"))
        if mixer == "attention":
            specs += attention_specs(config, f"{t}.mixer", f"{s}.self_attn")
        else:
            specs.append(gdn_in_proj(f"{t}.mixer", f"{s}.linear_attn"))
            specs += gdn_common_specs(f"{t}.mixer", f"{s}.linear_attn")
        if ffn == "moe":
            specs += moe_specs(config, f"{t}.ffn", f"{s}.mlp")
        else:
            specs += mlp_specs(f"{t}.ffn", f"{s}.mlp")
    return specs


def lm_head_spec(config: ModelConfig, embed_name: str) -> WeightSpec:
    """``lm_head.weight``, or the input embedding when the checkpoint ties them."""
    source = embed_name if config.tie_word_embeddings else "lm_head.weight"
    return WeightSpec("lm_head.weight", (source,))


class Qwen3NextForCausalLM(HybridForCausalLM):
    def build_layer(self, index: int) -> HybridLayer:
        return HybridLayer(
            mixer=self.build_mixer(index),
            mixer_norm=self.new_norm(),
            ffn=self.build_ffn(self.config.ffn_types[index]),
            ffn_norm=self.new_norm(),
        )

    @classmethod
    def hf_weight_specs(cls, config: ModelConfig) -> list[WeightSpec]:
        def gdn_in_proj(target: str, source: str) -> WeightSpec:
            return WeightSpec(f"{target}.in_proj.weight",
                              (f"{source}.in_proj_qkvz.weight", f"{source}.in_proj_ba.weight"),
                              regroup_qkvz_ba(config))

        return qwen_specs(config, gdn_in_proj)
