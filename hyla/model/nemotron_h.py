"""NemotronH (``NemotronHForCausalLM``): Mamba2 + attention + MLP/MoE blocks.

Each block is ``x + mixer(norm(x))`` with exactly one of: a Mamba2 mixer (``M`` /
``linear_attention``), attention without RoPE (``*`` / ``full_attention``), a relu² MLP (``-`` /
``mlp``) or a MoE (``E`` / ``moe``: sigmoid router with score-correction bias, relu² experts, one
shared relu² expert, optional latent projection). The layout comes from ``layers_block_type`` or
the legacy ``hybrid_override_pattern``; norms are plain RMSNorm (``w``, not ``1 + w``).

Both Mamba2 paths (chunked extend and decode step) clamp ``softplus(dt + dt_bias)`` to
``time_step_limit`` (legacy ``mamba_dt_limit``; default ``(0, inf)``, which never binds), as
transformers >= 5.25 does (transformers <= 5.24 hard-coded ``(time_step_min, inf)``).
Hugging Face's decode step does not clamp; hyla deliberately differs from it there so that prefill
and decode compute the same states (see docs/models.md).

Checkpoint names start with ``backbone.`` (``model.`` is accepted too) except ``lm_head.weight``,
which is always read (HF's NemotronH has no weight tying, whatever ``tie_word_embeddings`` says).
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from hyla.model.config import HF_LAYER_TYPES, ModelConfig, hf_common_fields, hf_first, hf_time_step_limit
from hyla.model.layers import (
    HybridForCausalLM,
    HybridLayer,
)
from hyla.model.weight_specs import (
    WeightSpec,
    attention_specs,
    embedding_specs,
    linear_specs,
    mamba2_specs,
    mlp_specs,
    norm_spec,
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
        # HF's NemotronH never ties lm_head to the embedding, whatever tie_word_embeddings says
        specs = embedding_specs(c, "backbone.embeddings.weight", "backbone.norm_f.weight", tied=False)
        for i, kind in enumerate(c.layer_types):
            t, s = f"layers.{i}", f"backbone.layers.{i}"
            if kind in ("attention", "linear"):
                specs.append(norm_spec(f"{t}.mixer_norm.weight", f"{s}.norm.weight"))
                specs += attention_specs(c, f"{t}.mixer", f"{s}.mixer") if kind == "attention" else \
                    mamba2_specs(c, f"{t}.mixer", f"{s}.mixer")
            else:
                specs.append(norm_spec(f"{t}.ffn_norm.weight", f"{s}.norm.weight"))
                specs += _mlp_specs(c, f"{t}.ffn", f"{s}.mixer") if kind == "mlp" else \
                    _moe_specs(c, f"{t}.ffn", f"{s}.mixer")
        return specs


def _mlp_specs(c: ModelConfig, target: str, source: str) -> list[WeightSpec]:
    """relu² MLP: ``up_proj``, ``down_proj`` (no gate)."""
    return mlp_specs(target, source, c.mlp_bias, in_proj=("up_proj",))


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


# ------------------------------------------------------------------------------------------------
# config.json parsing (``ModelConfig.from_hf`` through ``hyla.model.architectures``)
# ------------------------------------------------------------------------------------------------
_PATTERN = {"M": "linear", "*": "attention", "-": "mlp", "E": "moe"}  # hybrid_override_pattern symbols


def parse_hf_config(cfg: Mapping[str, Any], arch: str, dtype: str | torch.dtype | None) -> dict[str, Any]:
    """``ModelConfig`` fields of a NemotronH ``config.json`` (current keys or the legacy
    ``mamba_*`` aliases and ``hybrid_override_pattern``). Raises ``ValueError`` for an unknown
    block type or an unsupported activation."""
    common = hf_common_fields(cfg, arch, dtype)  # first: its required keys are checked first
    types = _layer_types(cfg)
    heads = int(cfg.get("num_attention_heads", 32))
    act = cfg.get("mlp_hidden_act", "relu2")
    if act not in ("relu2", "silu"):
        raise ValueError(f"unsupported mlp_hidden_act {act!r} for NemotronH")
    if cfg.get("mamba_hidden_act", "silu") != "silu":
        raise ValueError("NemotronH mamba_hidden_act must be 'silu'")
    uses_moe = "moe" in types
    return dict(
        **common,
        model_type="nemotron_h",
        layer_types=types,
        ffn_types=("none",) * len(types),
        norm_eps=float(cfg.get("layer_norm_epsilon", 1e-5)),
        zero_centered_norm=False,
        num_attention_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        # transformers' NemotronHConfig: head_dim, 128 when absent (NVIDIA's remote code: attention_head_dim)
        head_dim=int(cfg.get("head_dim") or cfg.get("attention_head_dim") or 128),
        attention_bias=False,  # HF's NemotronHAttention has no bias whatever the config says
        rotary_dim=0,
        linear_kind="mamba2" if "linear" in types else "none",
        conv_kernel=int(hf_first(cfg, ("conv_kernel", "mamba_d_conv"), 4)),
        mamba_num_heads=int(cfg.get("mamba_num_heads", 128)),
        mamba_head_dim=int(cfg.get("mamba_head_dim", 64)),
        ssm_state_size=int(cfg.get("ssm_state_size", 128)),
        mamba_n_groups=int(hf_first(cfg, ("n_groups", "mamba_n_groups"), 8)),
        mamba_conv_bias=bool(hf_first(cfg, ("use_conv_bias", "mamba_conv_bias"), True)),
        mamba_proj_bias=bool(cfg.get("use_bias", False)),
        mamba_dt_limit=hf_time_step_limit(cfg, keys=("mamba_dt_limit", "time_step_limit")),
        intermediate_size=int(cfg.get("intermediate_size", 0)),
        hidden_act=act,
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        num_experts=int(cfg.get("n_routed_experts", 0)) if uses_moe else 0,
        num_experts_per_tok=int(cfg.get("num_experts_per_tok", 0)) if uses_moe else 0,
        moe_intermediate_size=int(cfg.get("moe_intermediate_size", 0)) if uses_moe else 0,
        # HF builds one shared MLP of this width whatever n_shared_experts says.
        shared_expert_intermediate_size=int(cfg.get("moe_shared_expert_intermediate_size", 0)) if uses_moe else 0,
        shared_expert_gate=False,
        norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
        router="sigmoid",
        router_num_groups=int(cfg.get("n_group", 1) or 1),
        router_topk_groups=int(cfg.get("topk_group", 1) or 1),
        routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0) or 1.0),
        moe_latent_size=int(cfg.get("moe_latent_size") or 0),
    )


def _layer_types(cfg: Mapping[str, Any]) -> tuple[str, ...]:
    types = cfg.get("layers_block_type") or cfg.get("layer_types")
    if types is None and cfg.get("hybrid_override_pattern"):
        pattern = cfg["hybrid_override_pattern"]
        bad = set(pattern) - set(_PATTERN)
        if bad:
            raise ValueError(f"hybrid_override_pattern has unknown symbols {sorted(bad)} (expected M * - E)")
        return tuple(_PATTERN[c] for c in pattern)
    if types is None:
        raise ValueError("NemotronH config needs layers_block_type or hybrid_override_pattern")
    bad = [t for t in types if t not in HF_LAYER_TYPES]
    if bad:
        raise ValueError(f"unknown NemotronH layer types {sorted(set(bad))}")
    return tuple(HF_LAYER_TYPES[t] for t in types)
