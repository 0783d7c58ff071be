"""Ling 3 (``BailingHybridForCausalLM``, inclusionAI's Ling-3.0 / Ring-3.0): Kimi Delta Attention and
multi-head latent attention with RoPE, DeepSeek-V3's MoE.

Kimi-Linear's decoder (``kimi_linear.py``: the same pre-norm layers, KDA and MLA mixers, the sigmoid
router with expert groups and shared experts), with what transformers' ``bailing_hybrid`` changes:

* **KDA**: full-rank gate projections, ``f = f_proj(x)`` and the output gate ``sigmoid(g_proj(x))``
  (``[H·D, hidden]`` each, where Kimi-Linear has rank-``D`` pairs), and, with ``kda_safe_gate``
  (the default), a bounded decay ``g = kda_lower_bound * sigmoid(exp(A_log) * (f + dt_bias))`` in
  ``[lower_bound, 0]`` (else ``-exp(A_log) * F.softplus(f + dt_bias)``), rounded to the model dtype as
  transformers' forget gate returns it (``ops.kda.DecayGate``, ``rounded``).
* **MLA**: RoPE on ``q_pe`` and ``k_pe`` (``qk_rope_head_dim`` channels, default RoPE of
  ``rope_theta``; ``k_pe`` is rotated before it enters the pool, so the pool's latent is what
  transformers caches), and each head's output times ``sigmoid(g_proj(x))`` (one gate a head) before
  ``o_proj``. DeepSeek's interleaved RoPE pairs are de-interleaved at load
  (``kimi_linear.deinterleave_rope_rows``), so the rotate-half RoPE computes transformers'
  ``apply_rotary_pos_emb_interleave`` exactly.
* Layers: ``layer_types``, else full attention at every ``layer_group_size``-th layer (``(i + 1) %
  size == 0``); FFN: ``mlp_layer_types``, else dense in the first ``first_k_dense_replace`` (2).
  ``lm_head`` is never tied (transformers ties nothing).

The checkpoint's multi-token-prediction layers (``num_nextn_predict_layers``, numbered after the
decoder: ``model.layers.{N}...``) are not read (transformers ignores them too). Checkpoint layout:
inclusionAI's (what transformers' ``save_pretrained`` writes): ``model.word_embeddings``,
``model.layers.{i}.attention.*`` (``dense`` the output projection; separate ``{q,k,v}_conv1d``),
``mlp.gate.expert_bias``, ``mlp.experts.{e}.{gate,up,down}_proj``; transformers' in-memory names
(``embed_tokens``, ``self_attn``, ``forget_gate.*``, ``o_proj``, the fused ``conv1d`` and experts,
``e_score_correction_bias``) are read as well.
"""

from __future__ import annotations

import re
from typing import Any, Mapping

import torch

from hyla.model.config import ModelConfig, hf_common_fields, hf_first, hf_layer_types, hf_require, hf_rope_parameters
from hyla.model.config import hf_silu_only
from hyla.model.kimi_linear import (
    KimiLinearForCausalLM,
    ffn_layer_types,
    kda_fields,
    kda_specs,
    latent_attention_fields,
    mla_specs,
    moe_fields,
    moe_specs,
)
from hyla.model.ops.kda import DecayGate
from hyla.model.weight_specs import WeightSpec, embedding_specs, mlp_specs, norm_spec, renamed

# transformers' in-memory names -> inclusionAI's (the names hf_weight_specs reads), in this order
_IN_MEMORY_NAMES = (
    ("model.embed_tokens.", "model.word_embeddings."),
    (".self_attn.forget_gate.", ".attention."),
    (".self_attn.o_proj.", ".attention.dense."),
    (".self_attn.", ".attention."),
    (".mlp.gate.e_score_correction_bias", ".mlp.gate.expert_bias"),
)
_LAYER = re.compile(r"model\.layers\.(\d+)\.")


class BailingHybridForCausalLM(KimiLinearForCausalLM):
    """Kimi-Linear's model with Ling 3's options set in its config (see the module docstring)."""

    @classmethod
    def normalize_hf_name(cls, name: str) -> str | None:
        return renamed(name, _IN_MEMORY_NAMES)

    @classmethod
    def ignores_hf_name(cls, config: ModelConfig, name: str) -> bool:
        """The multi-token-prediction layers after the decoder's (``config.mtp_num_hidden_layers`` of them)."""
        layer = _LAYER.match(name)
        n = config.num_hidden_layers
        return layer is not None and n <= int(layer.group(1)) < n + config.mtp_num_hidden_layers

    @classmethod
    def hf_weight_specs(cls, config: ModelConfig) -> list[WeightSpec]:
        c = config
        specs = embedding_specs(c, "model.word_embeddings.weight", "model.norm.weight", tied=False)
        for i, (mixer, ffn) in enumerate(zip(c.layer_types, c.ffn_types)):
            t, s = f"layers.{i}", f"model.layers.{i}"
            specs += [
                norm_spec(f"{t}.mixer_norm.weight", f"{s}.input_layernorm.weight"),
                norm_spec(f"{t}.ffn_norm.weight", f"{s}.post_attention_layernorm.weight"),
            ]
            if mixer == "attention":
                specs += mla_specs(c, f"{t}.mixer", f"{s}.attention", out="dense", interleaved_rope=True)
            else:
                specs += kda_specs(c, f"{t}.mixer", f"{s}.attention", out="dense")
            if ffn == "moe":
                specs += moe_specs(c, f"{t}.ffn", f"{s}.mlp", ("gate_proj", "up_proj", "down_proj"), "expert_bias")
            else:
                specs += mlp_specs(f"{t}.ffn", f"{s}.mlp")
        return specs


# ------------------------------------------------------------------------------------------------
# config.json parsing (``ModelConfig.from_hf`` through ``hyla.model.architectures``)
# ------------------------------------------------------------------------------------------------
def parse_hf_config(cfg: Mapping[str, Any], arch: str, dtype: str | torch.dtype | None) -> dict[str, Any]:
    """``ModelConfig`` fields of a Ling 3 ``config.json``: inclusionAI's keys (``num_experts``,
    ``num_experts_per_token``, ``num_shared_experts``, ``moe_renormalize``, ``num_expert_group``,
    ``model_max_length``, ``num_nextn_predict_layers``, ``linear_head_dim`` / ``head_dim``,
    ``linear_num_heads``) or transformers' names for them, with ``BailingHybridConfig``'s defaults.
    Raises ``ValueError`` for a non-``silu`` activation, a RoPE other than the default, a bound
    ``kda_lower_bound > 0`` and inconsistent layer lists."""
    cfg = {"eos_token_id": 156895, "pad_token_id": 156892, **cfg}  # BailingHybridConfig's token ids
    cfg["max_position_embeddings"] = hf_first(cfg, ("model_max_length", "max_position_embeddings"), 262144)
    common = hf_common_fields(cfg, arch, dtype)  # first: its required keys are checked first
    common["tie_word_embeddings"] = False  # transformers' BailingHybridForCausalLM ties nothing
    num_layers = int(hf_require(cfg, "num_hidden_layers"))
    hf_silu_only(cfg, arch)
    _refuse_other_variants(cfg)
    mla = latent_attention_fields(cfg, "Ling 3")
    # transformers: the linear heads are the attention heads, of the config's head_dim (before DeepSeek-V3's
    # config rewrites head_dim to qk_rope_head_dim: a saved config.json keeps linear_head_dim)
    linear_heads = int(hf_first(cfg, ("linear_num_heads",), mla["num_attention_heads"]))
    linear_dim = int(hf_first(cfg, ("linear_head_dim", "head_dim"), 128))
    kernel = int(hf_first(cfg, ("linear_conv_kernel_dim", "short_conv_kernel_size"), 4))
    bound = float(hf_first(cfg, ("kda_lower_bound",), -5.0)) if cfg.get("kda_safe_gate", True) else 0.0
    DecayGate(bound).check("Ling 3 kda_lower_bound")
    if cfg.get("kda_safe_gate", True) and bound == 0:
        raise ValueError("Ling 3 kda_safe_gate with kda_lower_bound 0 is a zero decay (every state erased each "
                         "token); set a negative bound or kda_safe_gate false")
    rope = hf_rope_parameters(cfg, default_theta=6_000_000.0)
    ffn_types = ffn_layer_types(cfg, num_layers, "Ling 3", first_dense=2)
    return dict(
        **common,
        model_type="bailing_hybrid",
        layer_types=_layer_types(cfg, num_layers),
        ffn_types=ffn_types,
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        zero_centered_norm=False,
        **kda_fields(linear_heads, linear_dim, kernel, "Ling 3"),
        kda_full_rank_gates=True,
        kda_gate_lower_bound=bound,
        kda_decay_rounded=True,
        **mla,
        mla_output_gate=True,
        rotary_dim=mla["mla_qk_rope_head_dim"],
        rope_theta=float(rope["rope_theta"]),
        **moe_fields(cfg, ffn_types, "Ling 3", intermediate=6144, num_experts=512, moe_width=768,
                     routed_scaling=2.5, groups=8, topk_groups=4),
        mtp_num_hidden_layers=int(hf_first(cfg, ("num_nextn_predict_layers", "num_mtp_layers"), 1)),
    )


def _refuse_other_variants(cfg: Mapping[str, Any]) -> None:
    """``ValueError`` for the keys of inclusionAI's own (remote-code) Ling configs that would name
    something transformers' ``bailing_hybrid`` does not compute: MLA without RoPE, RoPE not interleaved,
    a router other than sigmoid, MoE on a layer period."""
    if cfg.get("use_mla_nope"):
        raise ValueError("Ling 3 use_mla_nope (MLA without RoPE) is not supported: transformers' bailing_hybrid "
                         "rotates q_pe and k_pe")
    if cfg.get("rope_interleave") is False:
        raise ValueError("Ling 3 rope_interleave: false is not supported (DeepSeek's interleaved rope rows expected)")
    for key in ("score_function", "scoring_func", "moe_router_activation_func"):
        if cfg.get(key, "sigmoid") != "sigmoid":
            raise ValueError(f"Ling 3 {key}={cfg[key]!r} is not supported (expected 'sigmoid')")
    if int(cfg.get("moe_layer_freq", 1) or 1) != 1:
        raise ValueError("Ling 3 moe_layer_freq != 1 is not supported (transformers reads first_k_dense_replace)")


def _layer_types(cfg: Mapping[str, Any], num_layers: int) -> tuple[str, ...]:
    """``layer_types``, else full attention closing every group of ``layer_group_size`` layers."""
    listed = cfg.get("layer_types")
    if listed is not None:
        return hf_layer_types(listed, num_layers, "Ling 3", "full_attention / linear_attention")
    size = int(hf_first(cfg, ("layer_group_size",), 6))
    if size < 1:
        raise ValueError(f"Ling 3 layer_group_size must be >= 1, got {size}")
    return tuple("attention" if (i + 1) % size == 0 else "linear" for i in range(num_layers))
