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

from typing import Any, Mapping

import torch

from hyla.model.config import (
    ModelConfig,
    hf_attention_fields,
    hf_common_fields,
    hf_layer_types,
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
    attention_specs,
    embedding_specs,
    linear_specs,
    mlp_specs,
    norm_spec,
    row_segments,
    squeeze_conv,
    stack_experts,
)


def regroup_qkvz_ba(config: ModelConfig):
    """Combine ``[in_proj_qkvz, in_proj_ba]`` (grouped per key head) into hyla's contiguous
    ``[q | k | v | z | b | a]`` rows (:func:`weight_specs.row_segments`: an FP8 checkpoint's
    projection stays float8 where the head sizes are whole blocks, ``b`` and ``a`` its tail)."""
    nk, dk, dv = config.linear_num_key_heads, config.linear_key_head_dim, config.linear_value_head_dim
    r = config.linear_num_value_heads // nk  # value heads per key head
    group = 2 * dk + 2 * r * dv  # a key head's rows of in_proj_qkvz: [q | k | v-group | z-group]

    def segments(shapes: list[tuple[int, ...]]) -> list[tuple[int, int, int]]:
        qkvz, ba = shapes
        if qkvz[0] != nk * group or ba[0] != nk * 2 * r:
            raise ValueError(
                f"in_proj_qkvz {qkvz} / in_proj_ba {ba} do not fit "
                f"{nk} key heads of dim {dk} and {nk * r} value heads of dim {dv}"
            )
        parts = [(0, first, rows) for first, rows in ((0, dk), (dk, dk), (2 * dk, r * dv), (2 * dk + r * dv, r * dv))]
        parts += [(1, 0, r), (1, r, r)]
        span = {0: group, 1: 2 * r}  # a key head's rows in each source
        return [(s, h * span[s] + first, rows) for s, first, rows in parts for h in range(nk)]

    return row_segments(segments)


def gdn_common_specs(target: str, source: str) -> list[WeightSpec]:
    """The GDN tensors whose layout Qwen3-Next and Qwen3.5 share (all but the input projections)."""
    return [
        WeightSpec(f"{target}.conv_weight", (f"{source}.conv1d.weight",), squeeze_conv),
        WeightSpec(f"{target}.dt_bias", (f"{source}.dt_bias",)),
        WeightSpec(f"{target}.A_log", (f"{source}.A_log",)),
        norm_spec(f"{target}.norm.weight", f"{source}.norm.weight"),
        *linear_specs(f"{target}.out_proj", [f"{source}.out_proj"], False),
    ]


def expert_specs(config: ModelConfig, target: str, source: str) -> list[WeightSpec]:
    """The stacked experts ``w_in [E, 2I, H]`` (``[gate | up]``) and ``w_out [E, H, I]`` from each
    expert's ``gate_proj`` / ``up_proj`` / ``down_proj`` (``{source}.experts.{e}.*``)."""
    experts = range(config.num_experts)
    gate_up = tuple(f"{source}.experts.{e}.{p}.weight" for e in experts for p in ("gate_proj", "up_proj"))
    down = tuple(f"{source}.experts.{e}.down_proj.weight" for e in experts)
    return [WeightSpec(f"{target}.w_in", gate_up, stack_experts(2)), WeightSpec(f"{target}.w_out", down, stack_experts(1))]


def moe_specs(config: ModelConfig, target: str, source: str) -> list[WeightSpec]:
    return [
        WeightSpec(f"{target}.router.weight", (f"{source}.gate.weight",)),
        *expert_specs(config, target, source),
        *mlp_specs(f"{target}.shared_expert", f"{source}.shared_expert"),
        *(linear_specs(f"{target}.shared_expert_gate", [f"{source}.shared_expert_gate"], False)
          if config.shared_expert_gate else []),  # Lara-4-Mini's shared expert has no gate
    ]


def qwen_specs(config: ModelConfig, gdn_in_proj, prefix: str = "model.") -> list[WeightSpec]:
    """All weight specs of a Qwen3-Next-style decoder; ``gdn_in_proj(target, source)`` gives the
    architecture-specific GDN input projection."""
    specs = embedding_specs(config, f"{prefix}embed_tokens.weight", f"{prefix}norm.weight")
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


class Qwen3NextForCausalLM(HybridForCausalLM):
    def build_layer(self, index: int) -> HybridLayer:
        return self.mixer_ffn_layer(index)  # GatedDeltaNet or gated Attention, then the MLP or MoE

    @classmethod
    def hf_weight_specs(cls, config: ModelConfig) -> list[WeightSpec]:
        def gdn_in_proj(target: str, source: str) -> WeightSpec:
            return WeightSpec(f"{target}.in_proj.weight",
                              (f"{source}.in_proj_qkvz.weight", f"{source}.in_proj_ba.weight"),
                              regroup_qkvz_ba(config))

        return qwen_specs(config, gdn_in_proj)


# ------------------------------------------------------------------------------------------------
# config.json parsing (``ModelConfig.from_hf`` through ``hyla.model.architectures``)
# ------------------------------------------------------------------------------------------------
def parse_hf_config(cfg: Mapping[str, Any], arch: str, dtype: str | torch.dtype | None) -> dict[str, Any]:
    """``ModelConfig`` fields of a Qwen3-Next ``config.json``: dense MLP or MoE per layer
    (``num_experts``, ``decoder_sparse_step``, ``mlp_only_layers``)."""
    return qwen_config_fields(cfg, arch, dtype, model_type="qwen3_next", moe=True)


def qwen_config_fields(
    cfg: Mapping[str, Any], arch: str, dtype: str | torch.dtype | None, *, model_type: str, moe: bool
) -> dict[str, Any]:
    """``ModelConfig`` fields of a Qwen3-Next-style decoder (Qwen3-Next, Qwen3.5's text model).

    Layers follow ``layer_types`` (or every ``full_attention_interval``-th is full attention); the
    FFN is MoE only when ``moe`` and the config has experts; ``intermediate_size`` (the dense MLP's)
    is required only when some layer has a dense MLP (Qwen3.5-MoE's config has none). Raises
    ``ValueError`` for a missing required key, a non-``silu`` activation, bad ``layer_types`` or a
    non-default RoPE.
    """
    common = hf_common_fields(cfg, arch, dtype)  # first: its required keys are checked first
    num_layers = int(hf_require(cfg, "num_hidden_layers"))
    attention = hf_attention_fields(cfg)
    num_experts = int(cfg.get("num_experts", 0) or 0) if moe else 0
    mlp_only = set(cfg.get("mlp_only_layers") or [])
    sparse_step = int(cfg.get("decoder_sparse_step", 1) or 1)
    ffn = tuple(
        "moe" if num_experts > 0 and i not in mlp_only and (i + 1) % sparse_step == 0 else "mlp"
        for i in range(num_layers)
    )
    hidden_act = hf_silu_only(cfg, arch)
    layer_types = _qwen_layer_types(cfg, num_layers)
    rope = hf_rope_parameters(cfg)
    factor = float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25)))
    return dict(
        **common,
        model_type=model_type,
        layer_types=layer_types,
        ffn_types=ffn,
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        zero_centered_norm=True,
        **attention,
        attention_bias=bool(cfg.get("attention_bias", False)),
        attn_output_gate=True,
        qk_norm=True,
        rope_theta=float(rope["rope_theta"]),
        rotary_dim=int(attention["head_dim"] * factor),
        linear_kind="gdn",
        conv_kernel=int(cfg.get("linear_conv_kernel_dim", 4)),
        linear_num_key_heads=int(cfg.get("linear_num_key_heads", 16)),
        linear_num_value_heads=int(cfg.get("linear_num_value_heads", 32)),
        linear_key_head_dim=int(cfg.get("linear_key_head_dim", 128)),
        linear_value_head_dim=int(cfg.get("linear_value_head_dim", 128)),
        intermediate_size=int(hf_require(cfg, "intermediate_size") if "mlp" in ffn
                              else cfg.get("intermediate_size") or 0),
        hidden_act=hidden_act,
        num_experts=num_experts,
        num_experts_per_tok=int(cfg.get("num_experts_per_tok", 0) or 0) if num_experts else 0,
        moe_intermediate_size=int(cfg.get("moe_intermediate_size", 0) or 0) if num_experts else 0,
        shared_expert_intermediate_size=(
            int(cfg.get("shared_expert_intermediate_size", 0) or 0) if num_experts else 0
        ),
        shared_expert_gate=num_experts > 0,
        norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
        router="softmax",
        mtp_num_hidden_layers=int(cfg.get("mtp_num_hidden_layers", cfg.get("num_nextn_predict_layers")) or 0),
    )


def _qwen_layer_types(cfg: Mapping[str, Any], num_layers: int) -> tuple[str, ...]:
    types = cfg.get("layer_types")
    if types is None:
        interval = int(cfg.get("full_attention_interval", 4))
        types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(num_layers)]
    return hf_layer_types(types, num_layers, "Qwen", "full_attention / linear_attention")
