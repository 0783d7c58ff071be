"""LFM3 (``Lfm3ForCausalLM``, Liquid AI's LFM3): LFM2's short convolutions beside sliding-window and global attention.

What LFM3 changes in LFM2 (``lfm2.py``):

* three layer kinds (``layer_types``): LFM2's gated short convolution (``conv``), **sliding-window
  attention** (``sliding_attention``: each token over its last ``sliding_window`` positions) and global
  attention (``full_attention``). The default pattern puts global attention at every 4th layer from 2
  and sliding attention at every 4th from 4;
* each attention kind has its own RoPE (``rope_parameters`` per layer type): the sliding layers' is the
  default RoPE over whole heads (theta 1e4), the global layers' HF's *proportional* RoPE (theta 1e6):
  of the ``head_dim / 2`` frequencies ``theta^(-2i / head_dim)`` only the first ``partial_rotary_factor``
  of them rotate, the rest are 0 (``ModelConfig.rope_angles``; rotate-half over the whole head);
* attention is Qwen3's (``q_norm`` / ``k_norm``, ``o_proj``), each head's output times
  ``sigmoid(g_proj(x))``, one gate a head (``use_attention_gate``: ``attn_head_gate``);
* sandwich norms (``use_sandwich_norm``): each part's output is normed before the residual add,
  ``x + post_operator_norm(op(operator_norm(x)))``, then ``x + post_ffn_norm(mlp(ffn_norm(x)))``
  (:class:`~hyla.model.layers.SandwichLayer`);
* the MLP's width is ``intermediate_size`` itself (no ``block_auto_adjust_ff_dim``), the conv window 7.

Checkpoint layout: LFM2's names, Qwen3's attention, the head gate as ``self_attn.gate_proj`` (what
transformers' ``save_pretrained`` writes; its in-memory ``g_proj`` loads too), the sandwich norms as
``post_operator_norm`` / ``post_ffn_norm``.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from hyla.model.config import ModelConfig
from hyla.model.layers import HybridLayer, SandwichLayer
from hyla.model.lfm2 import Lfm2ForCausalLM, lfm2_backbone_fields
from hyla.model.weight_specs import WeightSpec, norm_spec

# transformers' Lfm3Config defaults for the keys a config.json may omit
_DEFAULTS: dict[str, Any] = {
    "vocab_size": 128_000, "hidden_size": 2048, "intermediate_size": 7680, "num_hidden_layers": 24,
    "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 128, "pad_token_id": 124_893,
    "bos_token_id": 124_894, "eos_token_id": 124_900, "conv_L_cache": 7, "sliding_window": 256,
    "use_sandwich_norm": True, "use_attention_gate": True, "norm_eps": 1e-5, "max_position_embeddings": 128_000,
}
_ROPE_DEFAULTS: dict[str, dict[str, Any]] = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    "full_attention": {"rope_type": "proportional", "rope_theta": 1_000_000.0, "partial_rotary_factor": 0.5},
}
_LAYER_TYPES = {"conv": "linear", "full_attention": "attention", "sliding_attention": "attention"}


class Lfm3ForCausalLM(Lfm2ForCausalLM):
    attention_names = dict(o_proj="o_proj", qk_norms=("q_norm", "k_norm"))

    def build_layer(self, index: int) -> HybridLayer:
        """LFM2's layer, with each part's output normed too when ``config.sandwich_norm``."""
        if not self.config.sandwich_norm:
            return self.mixer_ffn_layer(index)
        c = self.config
        return SandwichLayer(mixer=self.build_mixer(index), mixer_norm=self.new_norm(),
                             ffn=self.build_ffn(c.ffn_types[index]), ffn_norm=self.new_norm(),
                             post_mixer_norm=self.new_norm(), post_ffn_norm=self.new_norm())

    @classmethod
    def hf_weight_specs(cls, config: ModelConfig) -> list[WeightSpec]:
        """LFM2's specs (Qwen3's attention names), with the attention layers' head gates and the sandwich norms."""
        specs = super().hf_weight_specs(config)
        for i, kind in enumerate(config.layer_types):
            t, s = f"layers.{i}", f"model.layers.{i}"
            if kind == "attention" and config.attn_head_gate:
                specs.append(WeightSpec(f"{t}.mixer.head_gate.weight", (f"{s}.self_attn.gate_proj.weight",)))
            if config.sandwich_norm:
                specs += [norm_spec(f"{t}.post_mixer_norm.weight", f"{s}.post_operator_norm.weight"),
                          norm_spec(f"{t}.post_ffn_norm.weight", f"{s}.post_ffn_norm.weight")]
        return specs

    @classmethod
    def normalize_hf_name(cls, name: str) -> str | None:
        """transformers' in-memory ``self_attn.g_proj`` is the published ``self_attn.gate_proj``."""
        return name.replace(".self_attn.g_proj.", ".self_attn.gate_proj.")


# ------------------------------------------------------------------------------------------------
# config.json parsing (``ModelConfig.from_hf`` through ``hyla.model.architectures``)
# ------------------------------------------------------------------------------------------------
def parse_hf_config(cfg: Mapping[str, Any], arch: str, dtype: str | torch.dtype | None) -> dict[str, Any]:
    """``ModelConfig`` fields of an LFM3 ``config.json`` (missing keys take transformers' ``Lfm3Config``
    defaults). Raises ``ValueError`` for unknown layer types, a ``sliding_window`` < 1 with sliding
    layers, a RoPE other than the default and proportional ones (or a proportional one with a
    ``factor``) or LFM2's errors."""
    given, cfg = cfg, {**_DEFAULTS, **cfg}
    num_layers = int(cfg["num_hidden_layers"])
    listed = cfg.get("layer_types") or [
        "full_attention" if i % 4 == 2 else "sliding_attention" if i % 4 == 0 and i > 0 else "conv"
        for i in range(num_layers)]
    if len(listed) != num_layers:
        raise ValueError(f"LFM3 layer_types has {len(listed)} entries, num_hidden_layers is {num_layers}")
    bad = sorted({t for t in listed if t not in _LAYER_TYPES})
    if bad:
        raise ValueError(f"LFM3 layer types must be conv / sliding_attention / full_attention, got {bad}")
    sliding = tuple(i for i, t in enumerate(listed) if t == "sliding_attention")
    window = cfg.get("sliding_window")
    if sliding and (window is None or int(window) < 1):
        raise ValueError(f"LFM3's sliding_window must be >= 1 with sliding layers, got {window}")
    # the backbone reads no RoPE here: each attention kind's is below
    fields, cfg = lfm2_backbone_fields({**cfg, "rope_parameters": None, "rope_scaling": None}, arch, dtype)
    head_dim = fields["head_dim"]
    rope = _layer_ropes(given.get("rope_parameters"))
    global_dim, global_theta, angles = _rope(rope["full_attention"], head_dim)
    sliding_dim, sliding_theta, sliding_angles = _rope(rope["sliding_attention"], head_dim)
    if sliding and sliding_angles != sliding_dim // 2:
        raise ValueError("LFM3's sliding layers take the default RoPE (a proportional one is the global layers')")
    return {
        **fields,
        "extra": {"hf_config": dict(given)},  # the config.json as given
        "model_type": "lfm3",
        "layer_types": tuple(_LAYER_TYPES[t] for t in listed),
        "ffn_types": ("mlp",) * num_layers,
        "intermediate_size": int(cfg["intermediate_size"]),
        "rotary_dim": global_dim if angles else 0,  # (no frequency rotates: no RoPE)
        "rope_theta": global_theta,
        "rope_angles": angles if angles != global_dim // 2 else 0,  # 0: all rotate
        "sliding_window": int(window) if sliding else 0,
        "sliding_layers": sliding,
        "sliding_rope": (sliding_dim, sliding_theta) if sliding else None,
        "attn_head_gate": bool(cfg["use_attention_gate"]),
        "sandwich_norm": bool(cfg["use_sandwich_norm"]),
    }


def _layer_ropes(params: Mapping[str, Any] | None) -> dict[str, Mapping[str, Any]]:
    """``rope_parameters`` per attention kind, as transformers' LFM3 reads them: a dict per layer type
    (a kind it omits takes ``Lfm3Config``'s default). ``ValueError`` for one dict of both (transformers
    fails on it)."""
    params = params or {}
    if set(params) - set(_ROPE_DEFAULTS):
        raise ValueError(f"LFM3's rope_parameters must hold one RoPE per layer type ({', '.join(_ROPE_DEFAULTS)}), "
                         f"got {dict(params)}")
    return {kind: params.get(kind) or default for kind, default in _ROPE_DEFAULTS.items()}


def _rope(params: Mapping[str, Any], head_dim: int) -> tuple[int, float, int]:
    """``(rotary_dim, theta, angles)`` of one attention kind's RoPE over whole heads: the default one
    (every frequency rotates: transformers' LFM3 reads no partial factor for it) or the proportional
    one (the first ``int(partial_rotary_factor * head_dim // 2)`` frequencies rotate)."""
    kind = params.get("rope_type", params.get("type", "default"))
    theta = float(params.get("rope_theta") or 1_000_000.0)
    if kind == "default":
        return head_dim, theta, head_dim // 2
    if kind == "proportional" and float(params.get("factor", 1.0)) == 1.0:
        return head_dim, theta, int(float(params.get("partial_rotary_factor", 1.0)) * head_dim // 2)
    raise ValueError(f"unsupported LFM3 RoPE {dict(params)}: hyla implements the default and proportional "
                     "(factor 1) RoPE")
