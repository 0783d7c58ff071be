"""OLMo-Hybrid (``OlmoHybridForCausalLM``, AI2's Olmo-Hybrid-7B): Gated DeltaNet layers and OLMo-3's
post-norm attention layers, a SwiGLU MLP in each.

* **Linear layers** are pre-norm, as Qwen3-Next's: ``x + gdn(norm(x))`` then ``x + mlp(norm(x))``
  (``attention_layer_norm`` / ``feedforward_layer_norm`` in the checkpoint). The Gated DeltaNet has
  separate ``q/k/v`` projections (their short convs concatenated, no bias), ``a_proj`` / ``b_proj``
  for the gates, ``g_proj`` for the output gate ``z`` (stacked into hyla's ``in_proj`` rows ``[q | k |
  v | z | b | a]``), ``beta = 2 * sigmoid(b)`` with ``linear_allow_neg_eigval`` (the default: the
  transition ``I - beta k k^T`` may have negative eigenvalues; ``config.gdn_beta_scale``), and an
  output RMSNorm of eps 1e-5 whatever ``rms_norm_eps`` says (fla's ``FusedRMSNormGated`` default,
  which transformers copies: ``config.linear_norm_eps``). As many key as value heads by default, the
  value heads twice as wide.
* **Attention layers** are OLMo-3's, post-norm (:class:`~hyla.model.layers.PostNormLayer`):
  ``x + norm(attn(x))`` then ``x + norm(mlp(x))``; q and k are RMS-normalised over all their heads at
  once (``q_norm [Hq·D]``, ``k_norm [Hkv·D]``: ``config.qk_norm_whole``), then the default RoPE, or no
  RoPE at all when ``rope_parameters.rope_theta`` is null (NoPE: the released checkpoints), no
  output gate.

Plain RMSNorms (``w · norm(x)`` in fp32, eps ``rms_norm_eps``); ``lm_head`` tied only with
``tie_word_embeddings``. Checkpoint layout: OLMo-core's names, which transformers' ``save_pretrained``
writes (``attention_layer_norm``, ``feedforward_layer_norm``, ``q/k/v_conv1d``: concatenated, so only their sum
of channels matters; transformers' save cuts the fused conv into near-equal thirds), or transformers' in-memory
names (``input_layernorm``, ``post_attention_layernorm``, the fused ``conv1d``).
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
from hyla.model.layers import Attention, HybridForCausalLM, HybridLayer, MLP, PostNormLayer
from hyla.model.weight_specs import (
    WeightSpec,
    concat_convs,
    embedding_specs,
    linear_specs,
    mlp_specs,
    norm_spec,
    renamed,
    squeeze_conv,
)

# transformers' in-memory names -> OLMo-core's (the names hf_weight_specs reads)
_IN_MEMORY_NAMES = ((".input_layernorm.", ".attention_layer_norm."),
                    (".post_attention_layernorm.", ".feedforward_layer_norm."))
GDN_NORM_EPS = 1e-5  # transformers' OlmoHybridGatedDeltaNet output norm, whatever rms_norm_eps is


class OlmoHybridForCausalLM(HybridForCausalLM):
    def build_layer(self, index: int) -> HybridLayer:
        c = self.config
        if c.layer_types[index] == "attention":  # OLMo-3's post-norm layer
            return PostNormLayer(mixer=Attention(c, c.attention_ordinal(index)), mixer_norm=self.new_norm(),
                                 ffn=MLP(c.hidden_size, c.intermediate_size, c.hidden_act, False, c.dtype),
                                 ffn_norm=self.new_norm())
        return self.mixer_ffn_layer(index)  # Gated DeltaNet (pre-norm), then the MLP

    @classmethod
    def normalize_hf_name(cls, name: str) -> str | None:
        return renamed(name, _IN_MEMORY_NAMES)

    @classmethod
    def hf_weight_specs(cls, config: ModelConfig) -> list[WeightSpec]:
        c = config
        specs = embedding_specs(c, "model.embed_tokens.weight", "model.norm.weight")
        for i, mixer in enumerate(c.layer_types):
            t, s = f"layers.{i}", f"model.layers.{i}"
            if mixer == "attention":  # feedforward_layer_norm: the norm after attention (transformers'
                # post_attention_layernorm, renamed alike in every layer), post_feedforward_layernorm: after the MLP
                a = f"{s}.self_attn"
                specs += [
                    *linear_specs(f"{t}.mixer.qkv_proj", [f"{a}.q_proj", f"{a}.k_proj", f"{a}.v_proj"],
                                  c.attention_bias),
                    *linear_specs(f"{t}.mixer.o_proj", [f"{a}.o_proj"], c.attention_bias),
                    norm_spec(f"{t}.mixer.q_whole_norm.weight", f"{a}.q_norm.weight"),
                    norm_spec(f"{t}.mixer.k_whole_norm.weight", f"{a}.k_norm.weight"),
                    norm_spec(f"{t}.mixer_norm.weight", f"{s}.feedforward_layer_norm.weight"),
                    norm_spec(f"{t}.ffn_norm.weight", f"{s}.post_feedforward_layernorm.weight"),
                ]
            else:
                g = f"{s}.linear_attn"
                specs += [
                    norm_spec(f"{t}.mixer_norm.weight", f"{s}.attention_layer_norm.weight"),
                    norm_spec(f"{t}.ffn_norm.weight", f"{s}.feedforward_layer_norm.weight"),
                    *linear_specs(f"{t}.mixer.in_proj", [f"{g}.{p}" for p in ("q_proj", "k_proj", "v_proj", "g_proj",
                                                                               "b_proj", "a_proj")], False),
                    WeightSpec(f"{t}.mixer.conv_weight", tuple(f"{g}.{p}_conv1d.weight" for p in "qkv"),
                               concat_convs),
                    WeightSpec(f"{t}.mixer.conv_weight", (f"{g}.conv1d.weight",), squeeze_conv),  # transformers'
                    WeightSpec(f"{t}.mixer.dt_bias", (f"{g}.dt_bias",)),
                    WeightSpec(f"{t}.mixer.A_log", (f"{g}.A_log",)),
                    norm_spec(f"{t}.mixer.norm.weight", f"{g}.o_norm.weight"),
                    *linear_specs(f"{t}.mixer.out_proj", [f"{g}.o_proj"], False),
                ]
            specs += mlp_specs(f"{t}.ffn", f"{s}.mlp")
        return specs


# ------------------------------------------------------------------------------------------------
# config.json parsing (``ModelConfig.from_hf`` through ``hyla.model.architectures``)
# ------------------------------------------------------------------------------------------------
def parse_hf_config(cfg: Mapping[str, Any], arch: str, dtype: str | torch.dtype | None) -> dict[str, Any]:
    """``ModelConfig`` fields of an OLMo-Hybrid ``config.json`` with ``OlmoHybridConfig``'s defaults
    (``layer_types``: full attention at every 4th layer from 3; linear heads: the attention heads, key
    dim ``0.75 · hidden / heads``, value dim twice that). Raises ``ValueError`` for a non-``silu``
    activation, a RoPE other than the default, a model without linear or without attention layers,
    and inconsistent layer lists."""
    # OlmoHybridConfig's context length and token ids where the config gives none
    cfg = {"max_position_embeddings": 65536, "eos_token_id": 100257, "pad_token_id": 100277, **cfg}
    common = hf_common_fields(cfg, arch, dtype)  # first: its required keys are checked first
    num_layers = int(hf_require(cfg, "num_hidden_layers"))
    hf_silu_only(cfg, arch)
    attention = hf_attention_fields(cfg)
    heads = attention["num_attention_heads"]
    listed = cfg.get("layer_types")
    if listed is None:
        layer_types = tuple("attention" if i % 4 == 3 else "linear" for i in range(num_layers))
        if "attention" not in layer_types:
            layer_types = layer_types[:-1] + ("attention",)
    else:
        layer_types = hf_layer_types(listed, num_layers, "OLMo-Hybrid", "full_attention / linear_attention")
    if "attention" not in layer_types or "linear" not in layer_types:
        raise ValueError("OLMo-Hybrid needs at least one linear_attention and one full_attention layer "
                         f"(transformers' OlmoHybridConfig), got {list(layer_types)}")
    key_heads = int(cfg.get("linear_num_key_heads") or heads)
    value_heads = int(cfg.get("linear_num_value_heads") or heads)
    key_dim = int(cfg.get("linear_key_head_dim") or int(0.75 * int(cfg["hidden_size"]) / key_heads))
    value_dim = int(cfg.get("linear_value_head_dim") or 2 * key_dim)
    kernel = int(cfg.get("linear_conv_kernel_dim", 4))
    if kernel < 2:
        raise ValueError(f"OLMo-Hybrid linear_conv_kernel_dim must be >= 2, got {kernel}")
    rotary_dim, theta = _rope(cfg, attention["head_dim"])
    return dict(
        **common,
        model_type="olmo_hybrid",
        layer_types=layer_types,
        ffn_types=("mlp",) * num_layers,
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        zero_centered_norm=False,
        **attention,
        attention_bias=bool(cfg.get("attention_bias", False)),
        qk_norm_whole=True,
        rotary_dim=rotary_dim,
        rope_theta=theta,
        linear_kind="gdn",
        conv_kernel=kernel,
        linear_num_key_heads=key_heads,
        linear_num_value_heads=value_heads,
        linear_key_head_dim=key_dim,
        linear_value_head_dim=value_dim,
        gdn_beta_scale=2.0 if cfg.get("linear_allow_neg_eigval", True) else 1.0,
        linear_norm_eps=GDN_NORM_EPS,
        intermediate_size=int(cfg.get("intermediate_size", 11008)),
        hidden_act="silu",
    )


def _rope(cfg: Mapping[str, Any], head_dim: int) -> tuple[int, float]:
    """``(rotary_dim, theta)``: the default RoPE over whole heads, or ``rotary_dim`` 0 (NoPE) when
    ``rope_parameters.rope_theta`` is null, as transformers builds no rotary embedding then (a missing
    ``rope_parameters`` is transformers' default, RoPE of theta 10000). ``ValueError`` for another RoPE type."""
    theta = hf_rope_parameters(cfg)["rope_theta"]
    return (0, 10000.0) if theta is None else (head_dim, float(theta))
