"""``ModelConfig``: the one place that reads Hugging Face ``config.json`` attributes.

Everything else in hyla (layers, loader, engine, cache sizing, simulator) reads this frozen
dataclass, never the HF dict. ``ModelConfig.from_hf`` needs no weights and no torch model: the
simulator builds one from an 80B checkpoint's ``config.json`` alone.

Layer layout
------------
A hybrid model is a stack of ``num_hidden_layers`` residual layers. Each layer has a *token mixer*
and/or a *feed-forward* part:

* ``layer_types[i]`` is ``"attention"`` or ``"linear"`` when layer ``i`` has a token mixer (full
  attention, or a recurrent mixer: Gated DeltaNet / Mamba2), and ``"mlp"`` or ``"moe"`` when the
  layer is a feed-forward block only (NemotronH's ``-`` and ``E`` blocks).
* ``ffn_types[i]`` is the feed-forward that follows the mixer *inside the same layer*: ``"mlp"``,
  ``"moe"``, or ``"none"``. Qwen3-Next / Qwen3.5 decoder layers are mixer + FFN
  (``layer_types[i] in {"attention", "linear"}``, ``ffn_types[i] in {"mlp", "moe"}``); NemotronH
  blocks hold exactly one thing, so their ``ffn_types`` are all ``"none"``.

So ``num_attention_layers = layer_types.count("attention")`` is the number of KV-cache layers and
``num_linear_layers = layer_types.count("linear")`` the number of recurrent-state layers, for every
architecture. Attention layer ``i`` uses KV buffer ``attention_ordinal(i)``; linear layer ``i``
uses state buffer ``linear_ordinal(i)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Mapping

import torch

from hyla.model.flops import FlopCount, flops_per_token, prefill_flops

SUPPORTED_ARCHITECTURES: tuple[str, ...] = (
    "Qwen3NextForCausalLM",
    "Qwen3_5ForCausalLM",
    "Qwen3_5ForConditionalGeneration",
    "NemotronHForCausalLM",
)

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}

_NEMOTRON_PATTERN = {"M": "linear", "*": "attention", "-": "mlp", "E": "moe"}
_LAYER_TYPE_NAMES = {
    "linear_attention": "linear",
    "mamba": "linear",
    "full_attention": "attention",
    "attention": "attention",
    "mlp": "mlp",
    "moe": "moe",
}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """``"float32"`` / ``"bfloat16"`` / ``"float16"`` (or a torch dtype) -> torch dtype."""
    if isinstance(dtype, torch.dtype):
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"unsupported dtype {dtype}; use float32, bfloat16 or float16")
        return dtype
    key = str(dtype).removeprefix("torch.")
    if key not in _DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; use one of float32, bfloat16, float16")
    return _DTYPES[key]


def decode_json_floats(value: Any) -> Any:
    """Undo transformers v5's ``{"__float__": "Infinity"}`` encoding of non-finite floats, recursively."""
    if isinstance(value, dict):
        if set(value) == {"__float__"}:
            return float(value["__float__"])
        return {k: decode_json_floats(v) for k, v in value.items()}
    if isinstance(value, list):
        return [decode_json_floats(v) for v in value]
    return value


@dataclass(frozen=True)
class ModelConfig:
    """Architecture hyper-parameters of one hybrid model (see the module docstring for the layout)."""

    architecture: str  # HF architecture name, e.g. "Qwen3NextForCausalLM"
    model_type: str  # "qwen3_next" | "qwen3_5" | "nemotron_h"
    vocab_size: int
    hidden_size: int
    layer_types: tuple[str, ...]  # per layer: "attention" | "linear" | "mlp" | "moe"
    ffn_types: tuple[str, ...]  # per layer: "mlp" | "moe" | "none" (the FFN after the mixer)
    dtype: torch.dtype = torch.float32  # weight / activation / conv-state dtype
    norm_eps: float = 1e-6
    zero_centered_norm: bool = False  # Qwen: out = norm(x) * (1 + w); NemotronH: norm(x) * w
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    pad_token_id: int | None = None

    # --- full attention -------------------------------------------------------------------------
    num_attention_heads: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    attention_bias: bool = False
    attn_output_gate: bool = False  # Qwen: q_proj also emits a per-head sigmoid gate
    qk_norm: bool = False  # Qwen: per-head RMSNorm on q and k before RoPE
    rotary_dim: int = 0  # 0 = no RoPE (NemotronH)
    rope_theta: float = 10000.0

    # --- recurrent mixer ("linear" layers) ------------------------------------------------------
    linear_kind: str = "none"  # "gdn" | "mamba2" | "none"
    conv_kernel: int = 4
    linear_chunk_size: int = 64
    # Gated DeltaNet
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    # Mamba2
    mamba_num_heads: int = 0
    mamba_head_dim: int = 0
    ssm_state_size: int = 0
    mamba_n_groups: int = 0
    mamba_conv_bias: bool = True
    mamba_proj_bias: bool = False
    mamba_dt_limit: tuple[float, float] = (0.0, math.inf)  # clamp of softplus(dt) in the chunked path only

    # --- feed-forward ---------------------------------------------------------------------------
    intermediate_size: int = 0
    hidden_act: str = "silu"  # "silu" -> gated SwiGLU MLP; "relu2" -> non-gated relu(x)^2 MLP
    mlp_bias: bool = False
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0  # 0 = no shared expert
    shared_expert_gate: bool = False  # Qwen: shared expert output scaled by sigmoid(gate(x))
    norm_topk_prob: bool = True
    router: str = "softmax"  # "softmax" (Qwen) | "sigmoid" (NemotronH, with score-correction bias)
    router_num_groups: int = 1
    router_topk_groups: int = 1
    routed_scaling_factor: float = 1.0
    moe_latent_size: int = 0  # NemotronH: experts run in a smaller latent space (0 = hidden_size)

    extra: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    # ------------------------------------------------------------------------------------------
    def __post_init__(self) -> None:
        if len(self.layer_types) != len(self.ffn_types):
            raise ValueError("layer_types and ffn_types must have one entry per layer")
        bad = {t for t in self.layer_types} - {"attention", "linear", "mlp", "moe"}
        if bad:
            raise ValueError(f"unknown layer types {sorted(bad)}")
        if self.num_attention_layers and (self.num_attention_heads <= 0 or self.num_kv_heads <= 0):
            raise ValueError("attention layers need num_attention_heads and num_key_value_heads > 0")
        if self.num_attention_layers and self.num_attention_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_kv_heads}"
            )
        if self.linear_kind == "gdn" and self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError("linear_num_value_heads must be a multiple of linear_num_key_heads")
        if self.linear_kind == "mamba2" and self.mamba_num_heads % self.mamba_n_groups:
            raise ValueError("mamba_num_heads must be a multiple of n_groups")
        uses_moe = "moe" in self.layer_types or "moe" in self.ffn_types
        if uses_moe and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"MoE layers need 0 < num_experts_per_tok ({self.num_experts_per_tok}) <= "
                f"num_experts ({self.num_experts})"
            )
        if uses_moe and self.router == "sigmoid":
            groups = self.router_num_groups
            if self.num_experts % groups or self.num_experts // groups < 2:
                raise ValueError(
                    f"n_group={groups} must divide num_experts={self.num_experts} into groups of >= 2"
                )
            if not 0 < self.router_topk_groups <= groups:
                raise ValueError(f"topk_group={self.router_topk_groups} must be in [1, n_group={groups}]")

    # --- counts and ordinals --------------------------------------------------------------------
    @property
    def num_hidden_layers(self) -> int:
        return len(self.layer_types)

    @property
    def num_attention_layers(self) -> int:
        return self.layer_types.count("attention")

    @property
    def num_linear_layers(self) -> int:
        return self.layer_types.count("linear")

    def attention_ordinal(self, layer: int) -> int:
        """Index of attention layer ``layer`` among attention layers (its KV buffer)."""
        if self.layer_types[layer] != "attention":
            raise ValueError(f"layer {layer} is {self.layer_types[layer]!r}, not attention")
        return self.layer_types[:layer].count("attention")

    def linear_ordinal(self, layer: int) -> int:
        """Index of linear layer ``layer`` among linear layers (its conv/ssm state buffer)."""
        if self.layer_types[layer] != "linear":
            raise ValueError(f"layer {layer} is {self.layer_types[layer]!r}, not linear")
        return self.layer_types[:layer].count("linear")

    # --- state shapes ---------------------------------------------------------------------------
    @property
    def conv_dim(self) -> int:
        """Channels of the depthwise causal conv of a linear layer."""
        if self.linear_kind == "gdn":
            key_dim = self.linear_num_key_heads * self.linear_key_head_dim
            return 2 * key_dim + self.linear_num_value_heads * self.linear_value_head_dim
        if self.linear_kind == "mamba2":
            return self.mamba_intermediate_size + 2 * self.mamba_n_groups * self.ssm_state_size
        return 0

    @property
    def mamba_intermediate_size(self) -> int:
        return self.mamba_num_heads * self.mamba_head_dim

    @property
    def conv_shape(self) -> tuple[int, int]:
        """Per-slot conv state: the last ``K-1`` pre-conv inputs of every channel."""
        return (self.conv_dim, self.conv_kernel - 1)

    @property
    def conv_dtype(self) -> torch.dtype:
        return self.dtype

    @property
    def ssm_shape(self) -> tuple[int, int, int]:
        """Per-slot recurrent state: GDN ``[Hv, Dk, Dv]``; Mamba2 ``[H, P, N]``."""
        if self.linear_kind == "gdn":
            return (self.linear_num_value_heads, self.linear_key_head_dim, self.linear_value_head_dim)
        if self.linear_kind == "mamba2":
            return (self.mamba_num_heads, self.mamba_head_dim, self.ssm_state_size)
        return (0, 0, 0)

    @property
    def ssm_dtype(self) -> torch.dtype:
        return torch.float32

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """KV-cache bytes one token occupies across all attention layers (K and V)."""
        return self.num_attention_layers * 2 * self.num_kv_heads * self.head_dim * dtype_bytes

    def state_bytes_per_slot(self, dtype_bytes: int) -> int:
        """Bytes of one state slot across all linear layers: conv in ``dtype_bytes``, SSM in fp32."""
        conv = math.prod(self.conv_shape) * dtype_bytes
        ssm = math.prod(self.ssm_shape) * 4
        return self.num_linear_layers * (conv + ssm)

    # --- FLOP model (hyla/model/flops.py) -------------------------------------------------------
    def flops_per_token(self, context_len: int) -> FlopCount:
        """FLOPs to run one token that attends to ``context_len`` tokens: ``flops.flops_per_token``."""
        return flops_per_token(self, context_len)

    def prefill_flops(self, extend_len: int, prefix_len: int = 0) -> float:
        """FLOPs to prefill ``extend_len`` tokens after ``prefix_len`` cached ones: ``flops.prefill_flops``."""
        return prefill_flops(self, extend_len, prefix_len)

    def with_dtype(self, dtype: str | torch.dtype) -> "ModelConfig":
        return replace(self, dtype=parse_dtype(dtype))

    # --- construction from a Hugging Face config.json -------------------------------------------
    @classmethod
    def from_hf(cls, config: Mapping[str, Any], dtype: str | torch.dtype | None = None) -> "ModelConfig":
        """Build from a ``config.json`` dict (legacy keys and ``{"__float__": ...}`` accepted).

        ``dtype`` overrides the checkpoint's ``dtype`` / ``torch_dtype`` (default float32 when the
        config names none). Raises ``ValueError`` for an unsupported architecture.
        """
        cfg = decode_json_floats(dict(config))
        arch = _architecture(cfg)
        if arch == "Qwen3_5ForConditionalGeneration":
            text = dict(cfg.get("text_config") or {})
            if "tie_word_embeddings" in cfg:  # the vision-language model ties (or not) its lm_head
                text["tie_word_embeddings"] = cfg["tie_word_embeddings"]
            for key in ("eos_token_id", "bos_token_id", "pad_token_id"):
                if text.get(key) is None and key in cfg:
                    text[key] = cfg[key]
            for key in ("dtype", "torch_dtype"):
                text.setdefault(key, cfg.get(key))
            cfg = text
        if dtype is None:
            dtype = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
        common = _common_fields(cfg, arch, parse_dtype(dtype))
        if arch.startswith("Qwen3"):
            return cls(**common, **_qwen_fields(cfg, arch))
        return cls(**common, **_nemotron_h_fields(cfg))


def _architecture(cfg: Mapping[str, Any]) -> str:
    archs = cfg.get("architectures") or []
    for arch in archs:
        if arch in SUPPORTED_ARCHITECTURES:
            return arch
    model_type = cfg.get("model_type")
    by_type = {"qwen3_next": "Qwen3NextForCausalLM", "qwen3_5_text": "Qwen3_5ForCausalLM",
               "qwen3_5": "Qwen3_5ForConditionalGeneration", "nemotron_h": "NemotronHForCausalLM"}
    if not archs and model_type in by_type:
        return by_type[model_type]
    raise ValueError(
        f"unsupported architecture {archs or model_type!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _require(cfg: Mapping[str, Any], key: str) -> Any:
    if key not in cfg or cfg[key] is None:
        raise ValueError(f"config.json lacks required key {key!r}")
    return cfg[key]


def _common_fields(cfg: Mapping[str, Any], arch: str, dtype: torch.dtype) -> dict[str, Any]:
    return dict(
        architecture=arch,
        vocab_size=int(_require(cfg, "vocab_size")),
        hidden_size=int(_require(cfg, "hidden_size")),
        dtype=dtype,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        eos_token_ids=_eos_ids(cfg.get("eos_token_id")),
        bos_token_id=cfg.get("bos_token_id"),
        pad_token_id=cfg.get("pad_token_id"),
        extra={"hf_config": cfg},
    )


def _rope(cfg: Mapping[str, Any], head_dim: int) -> dict[str, Any]:
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise ValueError(f"unsupported rope_type {rope_type!r}: hyla implements the default RoPE only")
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    factor = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25))
    return dict(rope_theta=float(theta), rotary_dim=int(head_dim * float(factor)))


def _qwen_layer_types(cfg: Mapping[str, Any], num_layers: int) -> tuple[str, ...]:
    types = cfg.get("layer_types")
    if types is None:
        interval = int(cfg.get("full_attention_interval", 4))
        types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(num_layers)]
    if len(types) != num_layers:
        raise ValueError(f"layer_types has {len(types)} entries, num_hidden_layers is {num_layers}")
    out = tuple(_LAYER_TYPE_NAMES.get(t, t) for t in types)
    bad = set(out) - {"attention", "linear"}
    if bad:
        raise ValueError(f"Qwen layer_types must be full/linear attention, got {sorted(bad)}")
    return out


def _qwen_fields(cfg: Mapping[str, Any], arch: str) -> dict[str, Any]:
    num_layers = int(_require(cfg, "num_hidden_layers"))
    heads = int(_require(cfg, "num_attention_heads"))
    head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
    num_experts = int(cfg.get("num_experts", 0) or 0) if arch == "Qwen3NextForCausalLM" else 0
    mlp_only = set(cfg.get("mlp_only_layers") or [])
    sparse_step = int(cfg.get("decoder_sparse_step", 1) or 1)
    ffn = tuple(
        "moe" if num_experts > 0 and i not in mlp_only and (i + 1) % sparse_step == 0 else "mlp"
        for i in range(num_layers)
    )
    hidden_act = cfg.get("hidden_act", "silu")
    if hidden_act != "silu":
        raise ValueError(f"unsupported hidden_act {hidden_act!r} for {arch} (expected 'silu')")
    return dict(
        model_type="qwen3_next" if arch == "Qwen3NextForCausalLM" else "qwen3_5",
        layer_types=_qwen_layer_types(cfg, num_layers),
        ffn_types=ffn,
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        zero_centered_norm=True,
        num_attention_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=head_dim,
        attention_bias=bool(cfg.get("attention_bias", False)),
        attn_output_gate=True,
        qk_norm=True,
        **_rope(cfg, head_dim),
        linear_kind="gdn",
        conv_kernel=int(cfg.get("linear_conv_kernel_dim", 4)),
        linear_chunk_size=64,
        linear_num_key_heads=int(cfg.get("linear_num_key_heads", 16)),
        linear_num_value_heads=int(cfg.get("linear_num_value_heads", 32)),
        linear_key_head_dim=int(cfg.get("linear_key_head_dim", 128)),
        linear_value_head_dim=int(cfg.get("linear_value_head_dim", 128)),
        intermediate_size=int(_require(cfg, "intermediate_size")),
        hidden_act="silu",
        num_experts=num_experts,
        num_experts_per_tok=int(cfg.get("num_experts_per_tok", 0) or 0) if num_experts else 0,
        moe_intermediate_size=int(cfg.get("moe_intermediate_size", 0) or 0) if num_experts else 0,
        shared_expert_intermediate_size=(
            int(cfg.get("shared_expert_intermediate_size", 0) or 0) if num_experts else 0
        ),
        shared_expert_gate=num_experts > 0,
        norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
        router="softmax",
    )


def _nemotron_layer_types(cfg: Mapping[str, Any]) -> tuple[str, ...]:
    types = cfg.get("layers_block_type") or cfg.get("layer_types")
    if types is None and cfg.get("hybrid_override_pattern"):
        pattern = cfg["hybrid_override_pattern"]
        bad = set(pattern) - set(_NEMOTRON_PATTERN)
        if bad:
            raise ValueError(f"hybrid_override_pattern has unknown symbols {sorted(bad)} (expected M * - E)")
        return tuple(_NEMOTRON_PATTERN[c] for c in pattern)
    if types is None:
        raise ValueError("NemotronH config needs layers_block_type or hybrid_override_pattern")
    bad = [t for t in types if t not in _LAYER_TYPE_NAMES]
    if bad:
        raise ValueError(f"unknown NemotronH layer types {sorted(set(bad))}")
    return tuple(_LAYER_TYPE_NAMES[t] for t in types)


def _first(cfg: Mapping[str, Any], keys: tuple[str, ...], default: Any) -> Any:
    for key in keys:
        if cfg.get(key) is not None:
            return cfg[key]
    return default


def _nemotron_h_fields(cfg: Mapping[str, Any]) -> dict[str, Any]:
    types = _nemotron_layer_types(cfg)
    heads = int(cfg.get("num_attention_heads", 32))
    act = cfg.get("mlp_hidden_act", "relu2")
    if act not in ("relu2", "silu"):
        raise ValueError(f"unsupported mlp_hidden_act {act!r} for NemotronH")
    if cfg.get("mamba_hidden_act", "silu") != "silu":
        raise ValueError("NemotronH mamba_hidden_act must be 'silu'")
    uses_moe = "moe" in types
    time_step_min = float(_first(cfg, ("time_step_min", "mamba_dt_min"), 0.001))
    return dict(
        model_type="nemotron_h",
        layer_types=types,
        ffn_types=("none",) * len(types),
        norm_eps=float(cfg.get("layer_norm_epsilon", 1e-5)),
        zero_centered_norm=False,
        num_attention_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads),
        attention_bias=False,  # HF's NemotronHAttention has no bias whatever the config says
        rotary_dim=0,
        linear_kind="mamba2" if "linear" in types else "none",
        conv_kernel=int(_first(cfg, ("conv_kernel", "mamba_d_conv"), 4)),
        linear_chunk_size=int(_first(cfg, ("chunk_size", "mamba_chunk_size"), 128)),
        mamba_num_heads=int(cfg.get("mamba_num_heads", 128)),
        mamba_head_dim=int(cfg.get("mamba_head_dim", 64)),
        ssm_state_size=int(cfg.get("ssm_state_size", 128)),
        mamba_n_groups=int(_first(cfg, ("n_groups", "mamba_n_groups"), 8)),
        mamba_conv_bias=bool(_first(cfg, ("use_conv_bias", "mamba_conv_bias"), True)),
        mamba_proj_bias=bool(cfg.get("use_bias", False)),
        # HF hard-codes (time_step_min, inf) for NemotronH and ignores config.time_step_limit.
        mamba_dt_limit=(time_step_min, math.inf),
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
