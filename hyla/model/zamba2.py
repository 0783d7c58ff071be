"""Zamba2 (``Zamba2ForCausalLM``, Zyphra): Mamba2 layers and a few weight-shared attention blocks.

Most layers are ``x + mamba(norm(x))`` (``linear``). A ``hybrid`` layer first runs one of the model's
``shared_blocks`` transformer blocks (the ``k``-th hybrid layer block ``k % shared_blocks``) on the
concatenation of its input and the token embeddings ``e``, then its own Mamba2 on the sum::

    a = attention(in_norm([x | e]))          # [T, 2 hidden] in, hidden out; this layer's KV
    t = linear(mlp(ff_norm(a)))              # GeGLU MLP; linear: the layer's own hidden -> hidden
    x = x + mamba(mamba_norm(x + t))         # the residual skips t

The block's weights (its norms, q/k/v/o and MLP projections) are shared by every layer that runs it;
each layer adds its own low-rank adapters (rank ``shared_adapter_rank``): ``gate_up(h) + B(A h)`` on the
MLP's in projection always, and on q, k and v with ``shared_attention_adapters``. The layer's attention
(:class:`Zamba2Attention`) holds its KV index and adapters and borrows the block's projections
(``Attention(projections=...)``), so a hybrid layer has a KV buffer and a state slot of its own, as a
Falcon-H1 layer does (``layer_types`` ``"hybrid"``). Heads are ``2 hidden / heads`` wide and the softmax
scale is ``(head_dim / 2) ** -0.5``; RoPE over whole heads with ``use_mem_rope``, none without.

The Mamba2 mixer is hyla's shared one; its gated norm's eps is 1e-5 (``linear_norm_eps``, transformers'
constant). Its dt clamp ``time_step_limit = (time_step_min, inf)`` is applied in both the extend and the
decode path (transformers' Zamba2, as mamba-ssm's Mamba2, clamps in its chunked scan only: where the clamp
binds, its own decode differs from its full forward; hyla follows the full forward, so that a state does
not depend on how its tokens were fed — as for Falcon-H1, docs/models.md).

Checkpoint layout (transformers'): ``model.layers.{i}.mamba.*`` and ``.input_layernorm`` (Mamba2 layers),
``model.layers.{i}.mamba_decoder.{mamba, input_layernorm}``, ``.linear`` and ``.shared_transformer.*``
(hybrid layers). transformers ties each block's weights to the first layer that runs it and saves them
there only; a checkpoint that repeats them at the other layers loads too (the copies are not read).
The adapters of the ``k``-th hybrid layer are ``...adapter_list.{k}.{0,1}`` in its block.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import nn

from hyla.model.config import (
    ModelConfig,
    hf_common_fields,
    hf_mamba2_fields,
    hf_rope_parameters,
)
from hyla.model.forward_batch import ForwardBatch
from hyla.model.layers import (
    Attention,
    HybridForCausalLM,
    HybridLayer,
    Mamba2Mixer,
    OutProjection,
    RMSNorm,
    Rope,
    add_rms_norm,
    in_projection,
    is_gemv_step,
    materialized,
    on_gemv_step,
)
from hyla.model.layers.mlp import gated_act
from hyla.model.linear import Linear
from hyla.model.weight_specs import WeightSpec, embedding_specs, linear_specs, mamba2_specs, norm_spec


class LowRank(nn.Module):
    """A low-rank adapter ``up(down(x))`` (no bias): transformers' ``Sequential(Linear(in, r), Linear(r, out))``."""

    def __init__(self, in_features: int, rank: int, out_features: int, dtype: torch.dtype):
        super().__init__()
        self.down = Linear(in_features, rank, bias=False, dtype=dtype)
        self.up = Linear(rank, out_features, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.up(self.down(x))


class SharedBlock(nn.Module):
    """The weights of one shared transformer block: ``in_norm`` over ``[x | e]`` (2 hidden), q/k/v
    stacked (``qkv_proj``, 2 hidden in) and ``o_proj`` (hidden out), ``ff_norm``, the GeGLU MLP's
    ``gate_up`` (rows ``[gate | up]``) and ``down`` (biases with ``add_bias_linear``: ``mlp_bias``). The layers
    that run it hold what is theirs."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        c = config
        h2, d = 2 * c.hidden_size, c.head_dim
        self.in_norm = RMSNorm(h2, c.norm_eps, False, c.dtype)
        self.qkv_proj = Linear(h2, (c.num_attention_heads + 2 * c.num_kv_heads) * d, bias=False, dtype=c.dtype)
        self.o_proj = Linear(c.num_attention_heads * d, c.hidden_size, bias=False, dtype=c.dtype)
        self.ff_norm = RMSNorm(c.hidden_size, c.norm_eps, False, c.dtype)
        self.gate_up = Linear(c.hidden_size, 2 * c.intermediate_size, bias=c.mlp_bias, dtype=c.dtype)
        self.down = Linear(c.intermediate_size, c.hidden_size, bias=c.mlp_bias, dtype=c.dtype)


class Zamba2Attention(Attention):
    """A hybrid layer's attention: its own KV buffer (``kv_index``) and, with
    ``shared_attention_adapters``, its q / k / v adapters; the projections are its block's."""

    def __init__(self, config: ModelConfig, attention_ordinal: int, block: SharedBlock):
        super().__init__(config, attention_ordinal, projections=(block.qkv_proj, block.o_proj))
        c = config
        self.scaling = (self.head_dim / 2) ** -0.5  # transformers' Zamba2: the heads are [x | e] wide
        h2, r = 2 * c.hidden_size, c.shared_adapter_rank
        self.adapters = nn.ModuleList([LowRank(h2, r, size, c.dtype) for size in (self.q_size, self.kv_size,
                                                                                   self.kv_size)]) \
            if c.shared_attention_adapters else None

    def project_qkv(self, x: torch.Tensor, gemv_step: bool = False) -> torch.Tensor:
        qkv = super().project_qkv(x, gemv_step)  # [T, q + 2 kv]
        if self.adapters is None:
            return qkv
        return qkv + torch.cat([adapter(x) for adapter in self.adapters], dim=-1)


class Zamba2MambaLayer(HybridLayer):
    """``x + mamba(norm(x))`` (the embeddings unread)."""

    def forward(self, x: torch.Tensor, batch: ForwardBatch, rope: Rope | None,
                embeds: torch.Tensor | None = None) -> torch.Tensor:
        return super().forward(x, batch, rope)

    def forward_fused(self, out: torch.Tensor | OutProjection | None, residual: torch.Tensor, batch: ForwardBatch,
                      rope: Rope | None, embeds: torch.Tensor | None = None):
        return super().forward_fused(out, residual, batch, rope)


class Zamba2HybridLayer(HybridLayer):
    """A shared block's attention and GeGLU MLP on ``[x | e]``, this layer's ``linear``, then its Mamba2
    (see the module docstring). ``mixer_norm`` is the Mamba2's input norm; the block is borrowed (a
    plain attribute: its parameters are named once, as the model's ``blocks``)."""

    def __init__(self, config: ModelConfig, index: int, block: SharedBlock):
        c = config
        super().__init__(mixer=None, mixer_norm=RMSNorm(c.hidden_size, c.norm_eps, False, c.dtype), ffn=None,
                         ffn_norm=None)
        object.__setattr__(self, "block", block)
        self.attn = Zamba2Attention(c, c.attention_ordinal(index), block)
        self.mlp_adapter = LowRank(c.hidden_size, c.shared_adapter_rank, 2 * c.intermediate_size, c.dtype)
        self.linear = Linear(c.hidden_size, c.hidden_size, bias=False, dtype=c.dtype)
        self.mamba = Mamba2Mixer(c, c.linear_ordinal(index))
        self.act = c.hidden_act

    def mixers(self) -> list[nn.Module]:
        return [self.attn, self.mamba]

    def transformer(self, x: torch.Tensor, embeds: torch.Tensor, batch: ForwardBatch,
                    rope: Rope | None, gemv_step: bool = False) -> torch.Tensor:
        """``t = linear(mlp(ff_norm(attention(in_norm([x | e])))))`` ``[T, hidden]``: what the layer adds
        to the Mamba2's input. On a GEMV step (the fused decode at a few rows) every projection of the
        block and the layer's ``linear`` is a GEMV (the adapters, of a few ranks, are not)."""
        b = self.block
        a = on_gemv_step(self.attn, gemv_step)(b.in_norm(torch.cat([x, embeds], dim=-1)), batch, rope)
        a = b.ff_norm(materialized(a))  # [T, hidden]
        h = in_projection(b.gate_up, a, gemv_step) + self.mlp_adapter(a)  # [T, 2I]
        return in_projection(self.linear, in_projection(b.down, gated_act(h, self.act), gemv_step), gemv_step)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, rope: Rope | None,
                embeds: torch.Tensor | None = None) -> torch.Tensor:
        t = self.transformer(x, embeds, batch, rope)
        return x + self.mamba(self.mixer_norm(x + t), batch)

    def forward_fused(self, out: torch.Tensor | OutProjection | None, residual: torch.Tensor, batch: ForwardBatch,
                      rope: Rope | None, embeds: torch.Tensor | None = None) -> tuple[torch.Tensor | OutProjection,
                                                                                        torch.Tensor]:
        """:meth:`forward` in :meth:`HybridLayer.forward_fused`'s contract: the input ``x = residual + out``
        from the add-norm kernel (its norm unused), the block (its projections GEMVs on a GEMV step), ``x + t``
        and the Mamba2's norm in one kernel (``x`` stays the residual), the Mamba2's output left to the next
        layer's kernel."""
        gemv_step = is_gemv_step(batch, residual)
        x = residual if out is None else add_rms_norm(out, residual, self.mixer_norm)[1]
        t = self.transformer(x, embeds, batch, rope, gemv_step)
        h, _ = add_rms_norm(t, x, self.mixer_norm)  # norm(x + t)
        return on_gemv_step(self.mamba, gemv_step)(h, batch), x


class Zamba2ForCausalLM(HybridForCausalLM):
    layers_read_embeddings = True

    def build_shared(self) -> None:
        self.blocks = nn.ModuleList([SharedBlock(self.config) for _ in range(self.config.shared_blocks)])

    def build_layer(self, index: int) -> HybridLayer:
        c = self.config
        if c.layer_types[index] == "linear":
            return Zamba2MambaLayer(mixer=Mamba2Mixer(c, c.linear_ordinal(index)), mixer_norm=self.new_norm(),
                                    ffn=None, ffn_norm=None)
        if c.layer_types[index] != "hybrid":
            raise ValueError(f"Zamba2 layers are linear or hybrid, layer {index} is {c.layer_types[index]!r}")
        return Zamba2HybridLayer(c, index, self.blocks[hybrid_layers(c).index(index) % c.shared_blocks])

    @classmethod
    def hf_weight_specs(cls, config: ModelConfig) -> list[WeightSpec]:
        c = config
        specs = embedding_specs(c, "model.embed_tokens.weight", "model.final_layernorm.weight")
        hybrid = hybrid_layers(c)
        for k, layer in enumerate(hybrid[:c.shared_blocks]):  # each block where transformers saves it
            t, s = f"blocks.{k}", f"model.layers.{layer}.shared_transformer"
            specs += [
                norm_spec(f"{t}.in_norm.weight", f"{s}.input_layernorm.weight"),
                *linear_specs(f"{t}.qkv_proj", [f"{s}.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj")], False),
                *linear_specs(f"{t}.o_proj", [f"{s}.self_attn.o_proj"], False),
                norm_spec(f"{t}.ff_norm.weight", f"{s}.pre_ff_layernorm.weight"),
                *linear_specs(f"{t}.gate_up", [f"{s}.feed_forward.gate_up_proj"], c.mlp_bias),
                *linear_specs(f"{t}.down", [f"{s}.feed_forward.down_proj"], c.mlp_bias),
            ]
        for i, kind in enumerate(c.layer_types):
            t, s = f"layers.{i}", f"model.layers.{i}"
            if kind == "linear":
                specs += [norm_spec(f"{t}.mixer_norm.weight", f"{s}.input_layernorm.weight"),
                          *mamba2_specs(c, f"{t}.mixer", f"{s}.mamba")]
                continue
            k = hybrid.index(i)
            block = f"model.layers.{hybrid[k % c.shared_blocks]}.shared_transformer"
            specs += [norm_spec(f"{t}.mixer_norm.weight", f"{s}.mamba_decoder.input_layernorm.weight"),
                      *mamba2_specs(c, f"{t}.mamba", f"{s}.mamba_decoder.mamba"),
                      *linear_specs(f"{t}.linear", [f"{s}.linear"], False),
                      *_low_rank(f"{t}.mlp_adapter", f"{block}.feed_forward.gate_up_proj_adapter_list.{k}")]
            if c.shared_attention_adapters:
                for j, p in enumerate("qkv"):
                    specs += _low_rank(f"{t}.attn.adapters.{j}", f"{block}.self_attn.linear_{p}_adapter_list.{k}")
        return specs

    @classmethod
    def ignores_hf_name(cls, config: ModelConfig, name: str) -> bool:
        """A block's weights repeated at a later layer that runs it (older checkpoints hold every layer's copy;
        transformers ties them to the first), and the adapters a block holds for layers that do not run it
        (an untied checkpoint's: transformers builds them in every copy)."""
        parts = name.split(".")
        if len(parts) < 5 or parts[:2] != ["model", "layers"] or parts[3] != "shared_transformer" \
                or not parts[2].isdigit():
            return False
        hybrid = hybrid_layers(config)
        layer = int(parts[2])
        if layer not in hybrid[:config.shared_blocks]:
            return True
        for i, part in enumerate(parts[:-1]):
            if part.endswith("_adapter_list") and parts[i + 1].isdigit():
                k = int(parts[i + 1])
                return k >= len(hybrid) or hybrid[k % config.shared_blocks] != layer
        return False


def _low_rank(target: str, source: str) -> list[WeightSpec]:
    """:class:`LowRank` from transformers' ``Sequential(Linear, Linear)`` (``.0`` down, ``.1`` up)."""
    return [WeightSpec(f"{target}.down.weight", (f"{source}.0.weight",)),
            WeightSpec(f"{target}.up.weight", (f"{source}.1.weight",))]


def hybrid_layers(config: ModelConfig) -> list[int]:
    """The hybrid layers' indices: the ``k``-th runs block ``k % shared_blocks``, with its block's adapters ``k``."""
    return [i for i, kind in enumerate(config.layer_types) if kind == "hybrid"]


# ------------------------------------------------------------------------------------------------
# config.json parsing (``ModelConfig.from_hf`` through ``hyla.model.architectures``)
# ------------------------------------------------------------------------------------------------
_LAYER_TYPES = "Mamba2 or hybrid (mamba / linear_attention, hybrid)"
# transformers' Zamba2Config defaults for the keys a config.json may omit (Zamba2-2.7B's)
_DEFAULTS: dict[str, Any] = {
    "vocab_size": 32_000, "hidden_size": 2560, "num_hidden_layers": 54, "num_attention_heads": 32,
    "max_position_embeddings": 4096, "tie_word_embeddings": True, "pad_token_id": 0, "bos_token_id": 1,
    "eos_token_id": 2, "rope_theta": 10_000.0,
    "layers_block_type": ["mamba"] + (["mamba"] * 5 + ["hybrid"]) * 7 + ["mamba"] * 4 + ["hybrid"] + ["mamba"] * 3
    + ["hybrid"] + ["mamba"] * 2,
}


def parse_hf_config(cfg: Mapping[str, Any], arch: str, dtype: str | torch.dtype | None) -> dict[str, Any]:
    """``ModelConfig`` fields of a Zamba2 ``config.json`` (transformers' ``Zamba2Config`` keys and defaults). The
    hybrid layers share ``num_mem_blocks`` blocks when ``tie_word_embeddings`` (the default, and every published
    checkpoint's); otherwise each has its own, as transformers loads such a checkpoint.
    Raises ``ValueError`` for layer types other than Mamba2 and hybrid, an activation other than ``gelu``,
    a non-default RoPE with ``use_mem_rope``, attention adapters with fewer KV than query heads (transformers adds
    a full-width adapter to k and v), or no shared block with hybrid layers. ``use_long_context`` sets the
    context length to 16,384 (all transformers 5.24 does with it); ``use_conv_bias`` is not read (transformers'
    mixer always has a conv bias)."""
    given, cfg = cfg, {**_DEFAULTS, **{k: v for k, v in cfg.items() if v is not None or k not in _DEFAULTS}}
    common = hf_common_fields(cfg, arch, dtype)
    common["extra"] = {"hf_config": dict(given)}  # the config.json as given
    hidden = common["hidden_size"]
    num_layers = int(cfg["num_hidden_layers"])
    listed = given.get("layers_block_type") or given.get("layer_types") or cfg["layers_block_type"]
    types = _zamba2_layer_types(list(listed), num_layers)
    heads = int(cfg["num_attention_heads"])
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    act = cfg.get("hidden_act", "gelu")
    if act != "gelu":
        raise ValueError(f"unsupported hidden_act {act!r} for Zamba2 (expected 'gelu')")
    blocks = int(cfg.get("num_mem_blocks", 1))
    if "hybrid" in types and blocks < 1:
        raise ValueError(f"Zamba2's hybrid layers need num_mem_blocks >= 1, got {blocks}")
    if not common["tie_word_embeddings"]:  # transformers ties the blocks only with the embeddings (its
        blocks = types.count("hybrid")  # _tied_weights_keys): untied, every hybrid layer has a block of its own
    blocks = min(blocks, types.count("hybrid"))  # (a block no layer runs is not built, by transformers either)
    adapters = bool(cfg.get("use_shared_attention_adapter", False))
    if adapters and kv_heads != heads:
        raise ValueError(f"use_shared_attention_adapter needs as many KV heads as heads (transformers adds a "
                         f"{2 * hidden}-wide adapter to k and v), got {kv_heads} and {heads}")
    if (2 * hidden) % heads:
        raise ValueError(f"2 * hidden_size ({2 * hidden}) must be a multiple of num_attention_heads ({heads})")
    head_dim = 2 * hidden // heads
    rope_on = bool(cfg.get("use_mem_rope", False))
    rope = hf_rope_parameters(cfg) if rope_on else {"rope_theta": float(cfg.get("rope_theta") or 10_000.0)}
    if cfg.get("use_long_context"):  # transformers 5.24: the context length only (its RoPE unchanged)
        common["max_position_embeddings"] = 16_384
    mamba = hf_mamba2_fields({
        "hidden_size": hidden, "mamba_expand": cfg.get("mamba_expand", 2), "mamba_n_heads": cfg.get("n_mamba_heads", 8),
        "mamba_d_state": cfg.get("mamba_d_state", 64), "mamba_d_conv": cfg.get("mamba_d_conv", 4),
        # transformers' Zamba2 mixer always has (and applies) a conv bias: use_conv_bias is never read
        "mamba_n_groups": cfg.get("mamba_ngroups", 1), "mamba_conv_bias": True,
        "mamba_proj_bias": cfg.get("add_bias_linear", False),
        "time_step_limit": (float(cfg.get("time_step_min", 0.001)), float("inf"))})
    return dict(
        **common,
        model_type="zamba2",
        layer_types=types,
        ffn_types=("none",) * num_layers,
        norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
        zero_centered_norm=False,
        num_attention_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rope_theta=float(rope["rope_theta"]),
        rotary_dim=head_dim if rope_on else 0,
        **mamba,
        linear_norm_eps=1e-5,  # transformers' Zamba2RMSNormGated(eps=1e-5), whatever rms_norm_eps says
        intermediate_size=int(cfg.get("intermediate_size") or 4 * hidden),
        hidden_act="gelu",
        mlp_bias=bool(cfg.get("add_bias_linear", False)),  # the shared MLP's, as the Mamba2 projections
        shared_blocks=blocks,  # (0 without hybrid layers: min above)
        shared_adapter_rank=int(cfg.get("adapter_rank", 128)),
        shared_attention_adapters=adapters,
    )


def _zamba2_layer_types(listed: list[str], num_layers: int) -> tuple[str, ...]:
    """``layers_block_type`` as hyla's kinds: ``mamba`` / ``linear_attention`` -> ``linear``, ``hybrid`` -> ``hybrid``."""
    if len(listed) != num_layers:
        raise ValueError(f"Zamba2's layers_block_type has {len(listed)} entries, num_hidden_layers is {num_layers}")
    kinds = {"mamba": "linear", "linear_attention": "linear", "hybrid": "hybrid"}
    bad = sorted({t for t in listed if t not in kinds})
    if bad:
        raise ValueError(f"Zamba2 layer types must be {_LAYER_TYPES}, got {bad}")
    return tuple(kinds[t] for t in listed)
