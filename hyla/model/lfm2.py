"""LFM2 (``Lfm2ForCausalLM``): gated short convolutions and GQA attention, each followed by a SwiGLU MLP.

Each layer is ``x + mixer(operator_norm(x))`` then ``x + mlp(ffn_norm(x))``; the mixer is, per
``layer_types`` (``conv`` / ``full_attention``, or the attention indices ``full_attn_idxs``):

* a gated short convolution (``Lfm2ShortConv``): ``in_proj`` to ``[B | C | x]`` (``H`` channels
  each), a depthwise causal conv of ``B * x`` over ``K = conv_L_cache`` inputs (no activation), gated
  by ``C``, then ``out_proj``. Its recurrent state is the conv window alone, ``[H, K-1]``: the
  layer kind has no SSM state (``ModelConfig.ssm_shape == (0,)``, an empty pool buffer the layer
  never touches), so a checkpoint is the conv windows of the conv layers, written by the conv op's
  checkpoint path (extend) or copied from the live slot (decode), as for GDN / Mamba2 layers;
* attention: Llama's GQA with full-head RoPE and per-head RMSNorm on q and k (plain weight, before
  RoPE), ``out_proj`` without bias.

Norms are plain RMSNorms (``w * norm(x)``); the final one is HF's ``embedding_norm`` (applied after
the last layer despite its name). Embeddings are tied by default. The MLP width is HF's
``block_auto_adjust_ff_dim`` rule applied to ``intermediate_size`` (``block_ff_dim``).
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import nn

from hyla.model.config import ModelConfig, hf_attention_fields, hf_common_fields, hf_require, hf_rope_parameters
from hyla.model.forward_batch import ForwardBatch
from hyla.model.layers import (
    HybridForCausalLM,
    HybridLayer,
    Rope,
    conv1d_extend,
    conv1d_fused_extend,
    copy_decode_checkpoints,
)
from hyla.model.layers.device import gpu
from hyla.model.linear import Linear
from hyla.model.ops.conv1d import causal_conv1d_chains, causal_conv1d_update
from hyla.model.weight_specs import (
    WeightSpec,
    attention_specs,
    embedding_specs,
    linear_specs,
    mlp_specs,
    norm_spec,
    squeeze_conv,
)


class Lfm2ShortConv(nn.Module):
    """LFM2's gated short convolution: ``out_proj(C * conv(B * x))`` with ``[B | C | x] = in_proj(h)``.

    The conv is depthwise and causal over the last ``K`` values of ``B * x`` (no activation), with a
    bias when ``short_conv_bias`` (HF's ``conv_bias``, which also puts biases on both projections).
    State: ``batch.conv_states[j]`` only (``j`` = the layer's linear ordinal).
    """

    fused_decode = True  # the conv window's Triton kernel (no activation); the gates stay elementwise
    fused_extend = True  # the conv's extend kernels on the fused extend's device indices
    chain_verify = True  # a verify step of padded chains: HybridForCausalLM.supports_chain_verify

    def __init__(self, config: ModelConfig, linear_ordinal: int):
        super().__init__()
        c = config
        self.state_index = linear_ordinal
        h = c.hidden_size
        self.in_proj = Linear(h, 3 * h, bias=c.short_conv_bias, dtype=c.dtype)
        self.conv_weight = nn.Parameter(torch.empty(h, c.conv_kernel, dtype=c.dtype))  # [H, K]
        self.conv_bias = nn.Parameter(torch.empty(h, dtype=c.dtype)) if c.short_conv_bias else None
        self.out_proj = Linear(h, h, bias=c.short_conv_bias, dtype=c.dtype)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, rope: Rope | None = None) -> torch.Tensor:
        b, c, xs = self.in_proj(x).chunk(3, dim=-1)  # [T, H] each
        bx = b * xs  # [T, H]: what the conv (and its window) sees
        conv_states = batch.conv_states[self.state_index]  # [S, H, K-1]
        if batch.fused_decode:
            y = gpu("conv1d_decode").causal_conv1d_update_fused(bx, self.conv_weight, self.conv_bias, conv_states,
                                                                 batch.state_slots, None, chain=batch.chain_slots)
        elif batch.fused_extend is not None:  # its windows (checkpoints', the final one) written on the way
            y = conv1d_fused_extend(bx, self.conv_weight, self.conv_bias, conv_states, batch, None)
        elif batch.is_decode:  # the slots as validated at batch construction: no host read here
            y = causal_conv1d_update(bx, self.conv_weight, self.conv_bias, conv_states, batch.state_slot_plan, None)
            copy_decode_checkpoints(conv_states, batch)
        elif batch.chains is not None:  # a verify step of padded chains (the compiled verify)
            y = causal_conv1d_chains(bx, self.conv_weight, self.conv_bias, conv_states, batch.state_slot_plan,
                                     batch.chains, None)
        else:
            y = conv1d_extend(bx, self.conv_weight, self.conv_bias, conv_states, batch, None)  # [T, H]
        return self.out_proj(c * y)


class Lfm2ForCausalLM(HybridForCausalLM):
    linear_mixer = Lfm2ShortConv
    # the checkpoint's names of attention's output projection and q / k norms (LFM3: Qwen3's)
    attention_names: dict[str, Any] = dict(o_proj="out_proj", qk_norms=("q_layernorm", "k_layernorm"))

    def build_layer(self, index: int) -> HybridLayer:
        return self.mixer_ffn_layer(index)  # the short convolution or Attention, then the MLP

    @classmethod
    def hf_weight_specs(cls, config: ModelConfig) -> list[WeightSpec]:
        c = config
        specs = embedding_specs(c, "model.embed_tokens.weight", "model.embedding_norm.weight")
        for i, kind in enumerate(c.layer_types):
            t, s = f"layers.{i}", f"model.layers.{i}"
            specs += [
                norm_spec(f"{t}.mixer_norm.weight", f"{s}.operator_norm.weight"),
                norm_spec(f"{t}.ffn_norm.weight", f"{s}.ffn_norm.weight"),
                *cls.ffn_specs(c, i, f"{t}.ffn", f"{s}.feed_forward"),
            ]
            if kind == "attention":
                specs += attention_specs(c, f"{t}.mixer", f"{s}.self_attn", **cls.attention_names)
            else:
                conv, bias = f"{s}.conv", c.short_conv_bias
                specs += [
                    *linear_specs(f"{t}.mixer.in_proj", [f"{conv}.in_proj"], bias),
                    WeightSpec(f"{t}.mixer.conv_weight", (f"{conv}.conv.weight",), squeeze_conv),  # [H, 1, K] -> [H, K]
                    *linear_specs(f"{t}.mixer.out_proj", [f"{conv}.out_proj"], bias),
                ]
                if bias:
                    specs.append(WeightSpec(f"{t}.mixer.conv_bias", (f"{conv}.conv.bias",)))
        return specs

    @classmethod
    def ffn_specs(cls, config: ModelConfig, index: int, target: str, source: str) -> list[WeightSpec]:
        """Layer ``index``'s feed-forward: the SwiGLU MLP's ``w1`` (gate) / ``w3`` (up) stacked into
        ``in_proj`` ``[gate | up]``, ``w2`` (down) as ``out_proj`` (LFM2-MoE's sparse layers differ)."""
        return mlp_specs(target, source, in_proj=("w1", "w3"), out_proj="w2")


# ------------------------------------------------------------------------------------------------
# config.json parsing (``ModelConfig.from_hf`` through ``hyla.model.architectures``)
# ------------------------------------------------------------------------------------------------
_LAYER_TYPES = {"conv": "linear", "full_attention": "attention"}


def parse_hf_config(cfg: Mapping[str, Any], arch: str, dtype: str | torch.dtype | None) -> dict[str, Any]:
    """``ModelConfig`` fields of an LFM2 ``config.json`` (HF ``Lfm2Config`` keys and defaults,
    including its legacy ``block_ff_dim`` and ``tie_embedding``, which win over ``intermediate_size``
    and ``tie_word_embeddings`` as in HF). Raises ``ValueError`` for unknown layer types, attention
    indices outside the stack, a non-default RoPE or a non-positive width."""
    fields, cfg = lfm2_backbone_fields(cfg, arch, dtype)
    num_layers = int(cfg["num_hidden_layers"])
    return dict(
        **fields,
        model_type="lfm2",
        layer_types=lfm2_layer_types(cfg, num_layers),
        ffn_types=("mlp",) * num_layers,
        intermediate_size=lfm2_mlp_width(cfg),
    )


def lfm2_backbone_fields(cfg: Mapping[str, Any], arch: str,
                         dtype: str | torch.dtype | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """The ``ModelConfig`` fields LFM2 and LFM2-MoE read alike (HF's defaults: tied embeddings, the
    legacy ``tie_embedding`` winning, 128k positions, 8 KV heads, RoPE theta 1e6; the short conv;
    q/k-normed GQA; SwiGLU), all but the layout, the feed-forward kinds and their widths; and the config as read
    (``tie_word_embeddings`` resolved). Raises ``ValueError`` for a missing required key, a
    non-default RoPE or ``conv_L_cache < 2``."""
    cfg = dict(cfg)
    if "tie_embedding" in cfg:
        cfg["tie_word_embeddings"] = cfg["tie_embedding"]
    cfg.setdefault("tie_word_embeddings", True)  # HF's LFM2 default
    common = hf_common_fields(cfg, arch, dtype)  # first: its required keys are checked first
    common["max_position_embeddings"] = int(cfg.get("max_position_embeddings", 128_000))  # HF's LFM2 default
    hf_require(cfg, "num_hidden_layers")
    # HF's Lfm2Config / Lfm2MoeConfig default to 8 KV heads, not to as many as the query heads
    attention = hf_attention_fields({**cfg, "num_key_value_heads": cfg.get("num_key_value_heads") or 8})
    rope = hf_rope_parameters(cfg, default_theta=1e6)  # HF's default_theta
    kernel = int(cfg.get("conv_L_cache", 3))
    if kernel < 2:
        raise ValueError(f"LFM2 conv_L_cache must be >= 2 (a causal conv window), got {kernel}")
    fields = dict(
        **common,
        norm_eps=float(cfg.get("norm_eps", 1e-5)),
        zero_centered_norm=False,
        **attention,
        attention_bias=False,
        qk_norm=True,
        rope_theta=float(rope["rope_theta"]),
        rotary_dim=attention["head_dim"],
        linear_kind="short_conv",
        conv_kernel=kernel,
        short_conv_bias=bool(cfg.get("conv_bias", False)),
        hidden_act="silu",
        mlp_bias=False,
    )
    return fields, cfg


def lfm2_mlp_width(cfg: Mapping[str, Any]) -> int:
    """HF's ``Lfm2MLP`` width: ``intermediate_size`` (``block_ff_dim`` wins), and with
    ``block_auto_adjust_ff_dim``: ``int(2/3 * it)``, then with a ``block_ffn_dim_multiplier``: times it,
    rounded up to a multiple of ``block_multiple_of`` (LFM2-1.2B: 12288 -> 8192)."""
    width = int(cfg.get("block_ff_dim", cfg.get("intermediate_size", 12288)))
    if cfg.get("block_auto_adjust_ff_dim", True):
        width = int(2 * width / 3)
        multiplier = cfg.get("block_ffn_dim_multiplier", 1.0)
        if multiplier is not None:
            multiple = int(cfg.get("block_multiple_of", 256))
            width = int(float(multiplier) * width)
            width = multiple * ((width + multiple - 1) // multiple)
    if width <= 0:
        raise ValueError(f"LFM2's MLP width must be positive, got {width}")
    return width


def lfm2_layer_types(cfg: Mapping[str, Any], num_layers: int) -> tuple[str, ...]:
    """hyla's layer kinds of an LFM2 config: ``layer_types`` (``conv`` / ``full_attention``), else
    attention at ``full_attn_idxs`` (every layer without them, as HF's ``Lfm2Config``)."""
    listed = cfg.get("layer_types")
    if listed is None:  # HF: attention at full_attn_idxs, every layer when that is absent too
        indices = cfg.get("full_attn_idxs")
        indices = set(range(num_layers)) if indices is None else {int(i) for i in indices}
        bad = sorted(i for i in indices if not 0 <= i < num_layers)
        if bad:
            raise ValueError(f"full_attn_idxs {bad} are outside the {num_layers} layers")
        return tuple("attention" if i in indices else "linear" for i in range(num_layers))
    if len(listed) != num_layers:
        raise ValueError(f"LFM2 layer_types has {len(listed)} entries, num_hidden_layers is {num_layers}")
    bad = sorted({t for t in listed if t not in _LAYER_TYPES})
    if bad:
        raise ValueError(f"LFM2 layer types must be 'conv' or 'full_attention', got {bad}")
    return tuple(_LAYER_TYPES[t] for t in listed)
