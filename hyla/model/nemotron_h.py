"""NemotronH (``NemotronHForCausalLM``): Mamba2 + attention + MLP/MoE blocks.

Each block is ``x + mixer(norm(x))`` with exactly one of: a Mamba2 mixer (``M`` /
``linear_attention``), attention without RoPE (``*`` / ``full_attention``), a relu² MLP (``-`` /
``mlp``) or a MoE (``E`` / ``moe``: sigmoid router with score-correction bias, relu² experts, one
shared relu² expert, optional latent projection). The layout comes from ``layers_block_type`` or
the legacy ``hybrid_override_pattern``; norms are plain RMSNorm (``w``, not ``1 + w``).

Both Mamba2 paths (chunked extend and decode step) clamp ``softplus(dt + dt_bias)`` at
``time_step_min``; Hugging Face's decode does not, and hyla deliberately differs from it there so
that prefill and decode compute the same states (see docs/models.md).

Checkpoint names start with ``backbone.`` (``model.`` is accepted too) except ``lm_head.weight``,
which is always read (HF's NemotronH has no weight tying, whatever ``tie_word_embeddings`` says).
"""

from __future__ import annotations

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


class NemotronHForCausalLM(HybridForCausalLM):
    def build_layer(self, index: int) -> HybridLayer:
        kind = self.config.layer_types[index]
        if kind in ("attention", "linear"):
            return HybridLayer(mixer=self.build_mixer(index), mixer_norm=self.new_norm(), ffn=None, ffn_norm=None)
        return HybridLayer(mixer=None, mixer_norm=None, ffn=self.build_ffn(kind), ffn_norm=self.new_norm())

    @classmethod
    def normalize_hf_name(cls, name: str) -> str | None:
        if name.startswith("model."):
            return "backbone." + name.removeprefix("model.")
        return name

    @classmethod
    def hf_weight_specs(cls, config: ModelConfig) -> list[WeightSpec]:
        c = config
        specs = [
            WeightSpec("embed_tokens.weight", ("backbone.embeddings.weight",)),
            norm_spec("norm.weight", "backbone.norm_f.weight"),
            # HF's NemotronH never ties lm_head to the embedding, whatever tie_word_embeddings says
            WeightSpec("lm_head.weight", ("lm_head.weight",)),
        ]
        for i, kind in enumerate(c.layer_types):
            t, s = f"layers.{i}", f"backbone.layers.{i}"
            if kind in ("attention", "linear"):
                specs.append(norm_spec(f"{t}.mixer_norm.weight", f"{s}.norm.weight"))
                specs += _attention_specs(f"{t}.mixer", f"{s}.mixer") if kind == "attention" else \
                    _mamba_specs(c, f"{t}.mixer", f"{s}.mixer")
            else:
                specs.append(norm_spec(f"{t}.ffn_norm.weight", f"{s}.norm.weight"))
                specs += _mlp_specs(c, f"{t}.ffn", f"{s}.mixer") if kind == "mlp" else \
                    _moe_specs(c, f"{t}.ffn", f"{s}.mixer")
        return specs


def _attention_specs(target: str, source: str) -> list[WeightSpec]:
    return [
        *linear_specs(f"{target}.qkv_proj", [f"{source}.q_proj", f"{source}.k_proj", f"{source}.v_proj"], False),
        *linear_specs(f"{target}.o_proj", [f"{source}.o_proj"], False),
    ]


def _mamba_specs(c: ModelConfig, target: str, source: str) -> list[WeightSpec]:
    specs = [
        *linear_specs(f"{target}.in_proj", [f"{source}.in_proj"], c.mamba_proj_bias),
        WeightSpec(f"{target}.conv_weight", (f"{source}.conv1d.weight",), squeeze_conv),
        WeightSpec(f"{target}.dt_bias", (f"{source}.dt_bias",)),
        WeightSpec(f"{target}.A_log", (f"{source}.A_log",)),
        WeightSpec(f"{target}.D", (f"{source}.D",)),
        norm_spec(f"{target}.norm.weight", f"{source}.norm.weight"),
        *linear_specs(f"{target}.out_proj", [f"{source}.out_proj"], c.mamba_proj_bias),
    ]
    if c.mamba_conv_bias:
        specs.append(WeightSpec(f"{target}.conv_bias", (f"{source}.conv1d.bias",)))
    return specs


def _mlp_specs(c: ModelConfig, target: str, source: str) -> list[WeightSpec]:
    return [
        *linear_specs(f"{target}.in_proj", [f"{source}.up_proj"], c.mlp_bias),
        *linear_specs(f"{target}.out_proj", [f"{source}.down_proj"], c.mlp_bias),
    ]


def _moe_specs(c: ModelConfig, target: str, source: str) -> list[WeightSpec]:
    experts = range(c.num_experts)
    specs = [
        WeightSpec(f"{target}.router.weight", (f"{source}.gate.weight",)),
        WeightSpec(f"{target}.e_score_correction_bias", (f"{source}.gate.e_score_correction_bias",)),
        WeightSpec(f"{target}.w_in", tuple(f"{source}.experts.{e}.up_proj.weight" for e in experts), stack_experts(1)),
        WeightSpec(f"{target}.w_out", tuple(f"{source}.experts.{e}.down_proj.weight" for e in experts),
                   stack_experts(1)),
        *_mlp_specs(c, f"{target}.shared_expert", f"{source}.shared_experts"),
    ]
    if c.moe_latent_size:
        specs += linear_specs(f"{target}.latent_in", [f"{source}.fc1_latent_proj"], c.mlp_bias)
        specs += linear_specs(f"{target}.latent_out", [f"{source}.fc2_latent_proj"], c.mlp_bias)
    return specs
