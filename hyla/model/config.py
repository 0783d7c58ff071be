"""``ModelConfig``: a model's hyper-parameters, read once from its Hugging Face ``config.json``.

Everything else in hyla (layers, loader, engine, cache sizing, simulator) reads this frozen
dataclass, never the HF dict. ``ModelConfig.from_hf`` needs no weights and builds no torch model:
the simulator builds one from an 80B checkpoint's ``config.json`` alone. Each architecture's own
file parses its keys (``parse_hf_config``, found through ``hyla.model.architectures``) with the
shared helpers at the end of this module; the FLOP model is ``hyla.model.flops`` and the cache
layout (bytes per KV token / state slot) ``hyla.cache.layout.CacheLayout``.

Layer layout
------------
A hybrid model is a stack of ``num_hidden_layers`` residual layers. Each layer has a *token mixer*
and/or a *feed-forward* part:

* ``layer_types[i]`` is ``"attention"`` or ``"linear"`` when layer ``i`` has a token mixer (full
  attention, or a recurrent mixer: Gated DeltaNet / Mamba2 / LFM2's gated short convolution),
  ``"hybrid"`` when it runs both in parallel on the same input (Falcon-H1: attention + Mamba2 in
  every layer), and ``"mlp"`` or ``"moe"`` when the layer is a feed-forward block only (NemotronH's
  ``-`` and ``E`` blocks).
* ``ffn_types[i]`` is the feed-forward that follows the mixer *inside the same layer*: ``"mlp"``,
  ``"moe"``, or ``"none"``. Qwen3-Next / Qwen3.5 decoder layers are mixer + FFN
  (``layer_types[i] in {"attention", "linear"}``, ``ffn_types[i] in {"mlp", "moe"}``); NemotronH
  blocks hold exactly one thing, so their ``ffn_types`` are all ``"none"``.

So ``num_attention_layers`` (layers that are ``"attention"`` or ``"hybrid"``) is the number of
KV-cache layers and ``num_linear_layers`` (``"linear"`` or ``"hybrid"``) the number of
recurrent-state layers, for every architecture; a hybrid layer has one KV buffer *and* one state
slot. A layer ``i`` with attention uses KV buffer ``attention_ordinal(i)``; a layer with a
recurrent mixer uses state buffer ``linear_ordinal(i)``.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field, replace
from typing import Any, Mapping, Sequence

import torch

from hyla.cache.layout import CacheLayout
from hyla.model.flops import FlopCount, flops_per_token, prefill_flops
from hyla.model.vision import VisionConfig

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}

# layer kinds that hold a KV cache / a recurrent state ("hybrid": attention and Mamba2 in parallel)
ATTENTION_KINDS: tuple[str, ...] = ("attention", "hybrid")
LINEAR_KINDS: tuple[str, ...] = ("linear", "hybrid")
LAYER_KINDS: tuple[str, ...] = ("attention", "linear", "hybrid", "mlp", "moe")
LINEAR_MIXER_KINDS: tuple[str, ...] = ("gdn", "kda", "mamba2", "mamba1", "short_conv", "lightning")  # ModelConfig.linear_kind

# config.json layer type names (Qwen ``layer_types``, NemotronH ``layers_block_type``) -> hyla's
HF_LAYER_TYPES: dict[str, str] = {
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


def read_json(file: str | os.PathLike) -> Any:
    """The JSON value in ``file`` (a checkpoint's config or index); ``ValueError`` naming the file where it
    cannot be read, or is not UTF-8 JSON."""
    try:
        with open(file, encoding="utf-8") as f:
            return json.load(f)
    except OSError as exc:
        raise ValueError(f"{file} cannot be read ({exc.strerror or exc})") from None
    except ValueError as exc:  # (invalid JSON, or not UTF-8)
        raise ValueError(f"{file} is not valid UTF-8 JSON ({exc})") from None


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
    # "qwen3_next" | "qwen3_5" | "qwen3_5_moe" | "nemotron_h" | "falcon_h1" | "bamba" | "granitemoehybrid" | "lfm2"
    # | "lfm2_moe" | "kimi_linear" | "bailing_hybrid" | "olmo_hybrid" | "jamba" | "mamba" | "falcon_mamba" | "mamba2"
    # | "lara_mini" | "lfm3" | "zamba2" | "minimax"
    model_type: str
    vocab_size: int
    hidden_size: int
    layer_types: tuple[str, ...]  # per layer: "attention" | "linear" | "hybrid" | "mlp" | "moe"
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
    qk_norm_whole: bool = False  # OLMo-Hybrid: RMSNorm over all of q's heads at once, and over all of k's
    attn_head_gate: bool = False  # LFM3: each head's output * sigmoid(g_proj(x)), one gate a head (g_proj [Hq, hidden])
    rotary_dim: int = 0  # 0 = no RoPE (NemotronH)
    rope_theta: float = 10000.0
    # HF's "proportional" RoPE (LFM3's global layers): of the rotary_dim / 2 frequencies theta^(-2i / rotary_dim),
    # only the first rope_angles rotate, the rest are 0 (0 = all rotate: the default RoPE)
    rope_angles: int = 0
    # sliding-window attention (Lara-4-Mini, LFM3): the layers sliding_layers (indices into layer_types, plain
    # attention) attend to their last sliding_window positions (attention_window). Their RoPE, when it is not
    # the other attention layers': sliding_rope = (rotary_dim, theta) of a default RoPE (rotary_dim 0: none)
    sliding_window: int = 0
    sliding_layers: tuple[int, ...] = ()
    sliding_rope: tuple[int, float] | None = None
    # multi-head latent attention (Kimi-Linear's MLA, no RoPE; Ling 3's with RoPE on q_pe / k_pe where
    # rotary_dim = mla_qk_rope_head_dim; 0 = plain attention). The KV pool holds each token's latent
    # [c_kv (kv_lora_rank) | k_pe (qk_rope_head_dim)], split over K and V: num_kv_heads = 1,
    # head_dim = ceil((kv_lora_rank + qk_rope_head_dim) / 2) (see kimi_linear.py)
    mla_kv_lora_rank: int = 0
    mla_q_lora_rank: int = 0  # 0 = a full-rank q_proj
    mla_qk_nope_head_dim: int = 0
    mla_qk_rope_head_dim: int = 0
    mla_v_head_dim: int = 0
    mla_output_gate: bool = False  # Ling 3: each head's output * sigmoid(g_proj(x)) (one gate a head)

    # --- recurrent mixer ("linear" layers) ------------------------------------------------------
    # "gdn" | "kda" (Kimi Delta Attention: GDN with a per-channel decay) | "mamba2" | "mamba1" (Jamba, Mamba: a
    # selective scan whose decay is per channel and state) | "short_conv" (LFM2: a conv window, no SSM state)
    # | "lightning" (MiniMax: a linear attention with a fixed decay per head, no conv; its heads and head sizes
    # in the linear_* fields below) | "none"
    linear_kind: str = "none"
    conv_kernel: int = 4
    # Gated DeltaNet and Kimi Delta Attention (and lightning attention: as many key as value heads, of one size)
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    # Kimi Delta Attention's gates: Kimi-Linear's low-rank forget and output gate projections (f_a/f_b,
    # g_a/g_b) or Ling 3's full-rank ones (f_proj, g_proj); the decay -exp(A_log) * softplus(f + dt_bias)
    # (Kimi-Linear) or, with a lower bound < 0, Ling 3's bounded ("safe") lower_bound * sigmoid(exp(A_log) *
    # (f + dt_bias)), in [lower_bound, 0]
    kda_full_rank_gates: bool = False
    kda_gate_lower_bound: float = 0.0  # 0 = the softplus decay (checked by the layer's ops.kda.DecayGate)
    kda_decay_rounded: bool = False  # Ling 3: F.softplus, the decay rounded to the model dtype (ops.kda.DecayGate)
    # Gated DeltaNet's options: beta = scale * sigmoid(b) (OLMo-Hybrid's allow_neg_eigval: 2, beta in [0, 2]: the
    # transition I - beta k k^T may have negative eigenvalues); its output norm's eps, Mamba2's gated norm's too
    # (None: norm_eps)
    gdn_beta_scale: float = 1.0
    linear_norm_eps: float | None = None
    # Mamba2
    mamba_num_heads: int = 0
    mamba_head_dim: int = 0
    ssm_state_size: int = 0
    mamba_n_groups: int = 0
    mamba_conv_bias: bool = True
    mamba_proj_bias: bool = False
    mamba_out_proj_bias: bool | None = None  # Falcon-H1's projectors_bias; None = mamba_proj_bias
    # clamp of softplus(dt + dt_bias): NemotronH's chunked path only (as HF); Falcon-H1: every path
    mamba_dt_limit: tuple[float, float] = (0.0, math.inf)
    mamba_rms_norm: bool = True  # False (Falcon-H1 option): no output norm, y * silu(z)
    mamba_norm_before_gate: bool = False  # Falcon-H1 option: w * norm(y) * silu(z) instead of w * norm(y * silu(z))
    # Mamba1 (Jamba, Mamba, FalconMamba): ``ssm_state_size`` states per channel, ``mamba_conv_bias``,
    # ``mamba_proj_bias`` as above
    mamba1_inner_size: int = 0  # channels I (mamba_expand * hidden_size)
    mamba1_dt_rank: int = 0  # the rank of dt's projection
    mamba1_bcdt_norms: bool = False  # Jamba, FalconMamba: RMSNorms on dt, B and C before the scan
    mamba1_bcdt_norm_weights: bool = True  # False (FalconMamba): those norms have no weight (x * rsqrt(...))
    mamba1_bcdt_norm_eps: float | None = None  # their eps (FalconMamba's mixer_rms_eps); None: norm_eps
    # LFM2 gated short convolution
    short_conv_bias: bool = False  # LFM2's conv_bias: bias on its in_proj, conv and out_proj

    # --- feed-forward ---------------------------------------------------------------------------
    intermediate_size: int = 0
    hidden_act: str = "silu"  # "silu" -> gated SwiGLU MLP; "gelu" -> GeGLU (Zamba2); "relu2" -> non-gated relu(x)^2 MLP
    mlp_bias: bool = False
    sandwich_norm: bool = False  # LFM3: each part's output normed too: x + post_norm(part(norm(x)))
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0  # 0 = no shared expert
    shared_expert_gate: bool = False  # Qwen: shared expert output scaled by sigmoid(gate(x))
    norm_topk_prob: bool = True
    router: str = "softmax"  # "softmax" (Qwen) | "sigmoid" (NemotronH, with score-correction bias)
    # the sigmoid router's options: the choice adds e_score_correction_bias (False: LFM2-MoE's use_expert_bias
    # off, the top-k of the scores themselves); the renormalisation's w / (sum + eps) (NemotronH, Kimi-Linear:
    # 1e-20; LFM2-MoE: 1e-6); logits and sigmoid in fp32 (NemotronH, Kimi-Linear) or in the model dtype, then fp32
    # (LFM2-MoE, as transformers' Lfm2MoeTopKRouter: the choice sees the same rounded scores)
    router_bias: bool = True
    router_norm_eps: float = 1e-20
    router_fp32: bool = True
    router_logits_fp32: bool = False  # the softmax router's logits from fp32 input and weight (Lara-4-Mini)
    router_num_groups: int = 1
    router_topk_groups: int = 1
    routed_scaling_factor: float = 1.0
    moe_latent_size: int = 0  # NemotronH: experts run in a smaller latent space (0 = hidden_size)

    # --- MiniMax's scaled post-norm residuals (minimax.py) -----------------------------------------
    # per layer ((a_mix, b_mix), (a_ffn, b_ffn)): each part's output is a * norm(x) + b * part(norm(x)), the residual
    # stream the normed input. Only MiniMax's layers read it (() there: every factor 1, transformers' default)
    residual_factors: tuple[tuple[tuple[float, float], tuple[float, float]], ...] = ()

    # --- Zamba2's shared blocks -----------------------------------------------------------------
    # Its "hybrid" layers run one of shared_blocks weight-shared attention + MLP blocks (in turn) on [x | the
    # embeddings], each layer with its own KV and its own low-rank adapters (rank shared_adapter_rank) on the block's
    # MLP in projection, and on its q / k / v projections with shared_attention_adapters (zamba2.py). 0: none
    shared_blocks: int = 0
    shared_adapter_rank: int = 0
    shared_attention_adapters: bool = False

    # --- a vision tower (Qwen3.5 vision-language checkpoints; hyla/model/vision.py) -------------------
    # None: the text model alone (a text-only checkpoint, or a vision-language one's config without vision_config)
    vision: VisionConfig | None = None

    # --- multi-token prediction (Qwen3-Next / Qwen3.5 ``mtp.*`` tensors; hyla/model/mtp.py) ------------
    mtp_num_hidden_layers: int = 0  # config.json's mtp_num_hidden_layers (0: not given)

    # --- µP multipliers (Falcon-H1, Granite; folded into the weights at load time; 1.0 = none) ----
    embedding_multiplier: float = 1.0  # embeddings * m
    lm_head_multiplier: float = 1.0  # logits * m (Granite: 1 / logits_scaling)
    residual_multiplier: float = 1.0  # Granite: every mixer / FFN output * m before the residual add
    attention_multiplier: float | None = None  # Granite: softmax scale of QK^T (None: head_dim ** -0.5)
    key_multiplier: float = 1.0  # attention keys * m (before RoPE and the cache)
    attention_in_multiplier: float = 1.0  # attention input * m
    attention_out_multiplier: float = 1.0  # attention output * m
    ssm_in_multiplier: float = 1.0  # Mamba2 input * m
    ssm_out_multiplier: float = 1.0  # Mamba2 output * m
    ssm_multipliers: tuple[float, ...] = (1.0, 1.0, 1.0, 1.0, 1.0)  # Mamba2 in_proj segments z, x, B, C, dt
    mlp_multipliers: tuple[float, ...] = (1.0, 1.0)  # MLP gate projection, down projection

    extra: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    # ------------------------------------------------------------------------------------------
    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "max_position_embeddings"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not self.layer_types:
            raise ValueError("a model needs one layer at least")
        if len(self.layer_types) != len(self.ffn_types):
            raise ValueError("layer_types and ffn_types must have one entry per layer")
        bad = {t for t in self.layer_types} - set(LAYER_KINDS)
        if bad:
            raise ValueError(f"unknown layer types {sorted(bad)}")
        if self.num_linear_layers and self.linear_kind not in LINEAR_MIXER_KINDS:
            raise ValueError(f"layers with a recurrent mixer need a linear_kind in {LINEAR_MIXER_KINDS}, "
                             f"got {self.linear_kind!r}")
        if self.linear_kind == "mamba1" and min(self.mamba1_inner_size, self.mamba1_dt_rank, self.ssm_state_size) <= 0:
            raise ValueError("Mamba1 layers need mamba1_inner_size, mamba1_dt_rank and ssm_state_size > 0")
        if len(self.ssm_multipliers) != 5 or len(self.mlp_multipliers) != 2:
            raise ValueError("ssm_multipliers needs 5 entries (z, x, B, C, dt) and mlp_multipliers 2 (gate, down)")
        if self.num_attention_layers and min(self.num_attention_heads, self.num_kv_heads, self.head_dim) <= 0:
            raise ValueError("attention layers need num_attention_heads, num_key_value_heads and head_dim > 0")
        if self.num_attention_layers and self.num_attention_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_kv_heads}"
            )
        if self.linear_kind in ("gdn", "kda") and self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError("linear_num_value_heads must be a multiple of linear_num_key_heads")
        if not 0.0 < self.gdn_beta_scale <= 2.0:
            raise ValueError(f"gdn_beta_scale must be in (0, 2], got {self.gdn_beta_scale}")
        self._check_attention_positions()
        if self.qk_norm_whole and (self.qk_norm or self.attn_output_gate):
            raise ValueError("qk_norm_whole excludes the per-head qk_norm and the attention output gate")
        if self.attn_head_gate and self.attn_output_gate:
            raise ValueError("attn_head_gate (one gate a head) excludes attn_output_gate (one a channel)")
        if self.linear_kind == "mamba2" and self.mamba_num_heads % self.mamba_n_groups:
            raise ValueError("mamba_num_heads must be a multiple of n_groups")
        if self.linear_kind == "lightning" and (self.linear_num_key_heads != self.linear_num_value_heads
                                                or self.linear_key_head_dim != self.linear_value_head_dim
                                                or min(self.linear_num_value_heads, self.linear_value_head_dim) <= 0):
            raise ValueError("lightning attention needs as many key as value heads (> 0), of one size (> 0)")
        if self.residual_factors and len(self.residual_factors) != len(self.layer_types):
            raise ValueError(f"residual_factors needs one entry per layer ({len(self.layer_types)}), "
                             f"got {len(self.residual_factors)}")
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

    def _check_attention_positions(self) -> None:
        """``ValueError`` unless the RoPE and sliding-window fields describe this model's attention layers."""
        if self.rotary_dim < 0 or self.rotary_dim % 2 or not 0 <= self.rope_angles <= self.rotary_dim // 2:
            raise ValueError(f"rotary_dim must be an even number >= 0 and rope_angles in [0, rotary_dim / 2], got "
                             f"{self.rotary_dim} and {self.rope_angles}")
        layers = self.sliding_layers
        if list(layers) != sorted(set(layers)) or any(not 0 <= i < len(self.layer_types) for i in layers):
            raise ValueError(f"sliding_layers must be ascending layer indices, got {list(layers)}")
        if any(self.layer_types[i] != "attention" for i in layers) or (layers and self.mla_kv_lora_rank):
            raise ValueError("sliding_layers must be plain attention layers (not hybrid, not latent attention)")
        if bool(layers) != (self.sliding_window > 0) or self.sliding_window < 0:
            raise ValueError(f"sliding_window ({self.sliding_window}) must be > 0 exactly when sliding_layers "
                             f"({list(layers)}) name layers")
        if self.sliding_rope is not None:
            dim, theta = self.sliding_rope
            if not layers or dim < 0 or dim % 2 or dim > self.head_dim or not theta > 0:
                raise ValueError(f"sliding_rope must be (an even rotary_dim <= head_dim, theta > 0) of sliding "
                                 f"layers, got {self.sliding_rope}")

    # --- counts and ordinals --------------------------------------------------------------------
    @property
    def num_hidden_layers(self) -> int:
        return len(self.layer_types)

    @property
    def num_attention_layers(self) -> int:
        """Layers with a KV cache: ``"attention"`` and ``"hybrid"``."""
        return sum(t in ATTENTION_KINDS for t in self.layer_types)

    @property
    def num_linear_layers(self) -> int:
        """Layers with a recurrent state: ``"linear"`` and ``"hybrid"``."""
        return sum(t in LINEAR_KINDS for t in self.layer_types)

    def attention_ordinal(self, layer: int) -> int:
        """Index of layer ``layer`` among the layers with attention (its KV buffer)."""
        if self.layer_types[layer] not in ATTENTION_KINDS:
            raise ValueError(f"layer {layer} is {self.layer_types[layer]!r}, not attention")
        return sum(t in ATTENTION_KINDS for t in self.layer_types[:layer])

    def attention_window(self, layer: int) -> int:
        """Layer ``layer``'s sliding window (its attention sees its last so many positions); 0: full attention."""
        return self.sliding_window if layer in self.sliding_layers else 0

    def linear_ordinal(self, layer: int) -> int:
        """Index of layer ``layer`` among the layers with a recurrent mixer (its conv/ssm state buffer)."""
        if self.layer_types[layer] not in LINEAR_KINDS:
            raise ValueError(f"layer {layer} is {self.layer_types[layer]!r}, not linear")
        return sum(t in LINEAR_KINDS for t in self.layer_types[:layer])

    # --- state shapes ---------------------------------------------------------------------------
    @property
    def conv_dim(self) -> int:
        """Channels of the depthwise causal conv of a linear layer."""
        if self.linear_kind in ("gdn", "kda"):  # q, k, v (KDA convolves the three as well)
            key_dim = self.linear_num_key_heads * self.linear_key_head_dim
            return 2 * key_dim + self.linear_num_value_heads * self.linear_value_head_dim
        if self.linear_kind == "mamba2":
            return self.mamba_intermediate_size + 2 * self.mamba_n_groups * self.ssm_state_size
        if self.linear_kind == "mamba1":
            return self.mamba1_inner_size  # the scan's input x
        if self.linear_kind == "short_conv":
            return self.hidden_size  # LFM2 convolves B * x, one channel per hidden unit
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
    def ssm_shape(self) -> tuple[int, ...]:
        """Per-slot recurrent state: GDN and KDA ``[Hv, Dk, Dv]``; Mamba2 ``[H, P, N]``; Mamba1 ``[I, N]``; LFM2's short
        convolution has none: ``(0,)``, zero elements (its whole state is the conv window), so the
        pools keep one empty SSM buffer per linear layer and the layout counts 0 bytes for it; lightning
        attention ``[H, Dv, Dk]`` (and no conv window: ``conv_dim`` 0)."""
        if self.linear_kind in ("gdn", "kda"):
            return (self.linear_num_value_heads, self.linear_key_head_dim, self.linear_value_head_dim)
        if self.linear_kind == "mamba2":
            return (self.mamba_num_heads, self.mamba_head_dim, self.ssm_state_size)
        if self.linear_kind == "mamba1":
            return (self.mamba1_inner_size, self.ssm_state_size)
        if self.linear_kind == "short_conv":
            return (0,)
        if self.linear_kind == "lightning":  # Mamba2's SSD layout [H, P, N]: value channels, then key channels
            return (self.linear_num_value_heads, self.linear_value_head_dim, self.linear_key_head_dim)
        return (0, 0, 0)

    @property
    def ssm_dtype(self) -> torch.dtype:
        return torch.float32

    @property
    def cache_layout(self) -> CacheLayout:
        """What one cached token and one state slot hold: K/V and the conv window in ``dtype``, the
        SSM state in ``ssm_dtype`` (fp32). The pools, the engine's memory split and the simulator
        take their ``kv_bytes_per_token`` / ``state_bytes_per_slot`` from it."""
        return CacheLayout(
            num_attention_layers=self.num_attention_layers, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
            kv_dtype=self.dtype, num_linear_layers=self.num_linear_layers, conv_shape=self.conv_shape,
            conv_dtype=self.conv_dtype, ssm_shape=self.ssm_shape, ssm_dtype=self.ssm_dtype,
        )

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

        The architecture (``architectures``, else ``model_type``) picks the parser in
        ``hyla.model.architectures.ARCHITECTURES``; each architecture's file reads its own keys.
        ``dtype`` overrides the checkpoint's ``dtype`` / ``torch_dtype`` (default float32 when the
        config names none). Raises ``ValueError`` for an unsupported architecture or a bad config.
        """
        # imported here: the architecture files import this module (and the layers)
        from hyla.model.architectures import ARCHITECTURES, architecture_name

        cfg = decode_json_floats(dict(config))
        arch = architecture_name(cfg)
        return cls(**ARCHITECTURES[arch].parse_config(cfg, arch, dtype))


# --- helpers for the architectures' config.json parsers -----------------------------------------
def hf_require(cfg: Mapping[str, Any], key: str) -> Any:
    """``cfg[key]``; ``ValueError`` when it is missing or null."""
    if key not in cfg or cfg[key] is None:
        raise ValueError(f"config.json lacks required key {key!r}")
    return cfg[key]


def hf_common_fields(cfg: Mapping[str, Any], arch: str, dtype: str | torch.dtype | None) -> dict[str, Any]:
    """The ``ModelConfig`` fields every architecture reads the same way (vocabulary, hidden size,
    dtype, embeddings tying, context length, special token ids; ``extra["hf_config"]`` = ``cfg``).

    ``dtype`` overrides the config's ``dtype`` / ``torch_dtype`` (float32 when it names none).
    """
    if dtype is None:
        dtype = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
    return dict(
        architecture=arch,
        vocab_size=int(hf_require(cfg, "vocab_size")),
        hidden_size=int(hf_require(cfg, "hidden_size")),
        dtype=parse_dtype(dtype),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        eos_token_ids=_eos_ids(cfg.get("eos_token_id")),
        bos_token_id=cfg.get("bos_token_id"),
        pad_token_id=cfg.get("pad_token_id"),
        extra={"hf_config": cfg},
    )


def hf_attention_fields(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """GQA sizes as most configs give them: ``num_attention_heads`` (required), ``num_key_value_heads``
    (default: as many), ``head_dim`` (default ``hidden_size // heads``)."""
    heads = int(hf_require(cfg, "num_attention_heads"))
    return dict(
        num_attention_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads),
    )


def hf_rope_parameters(cfg: Mapping[str, Any], default_theta: float = 10000.0) -> dict[str, Any]:
    """``rope_parameters`` (or the legacy ``rope_scaling``) of a config, its ``rope_theta`` filled in from
    the top-level key or ``default_theta``; ``ValueError`` unless it is the default RoPE (the only kind
    hyla implements). The caller reads the partial rotary factor, whose default is the architecture's."""
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise ValueError(f"unsupported rope_type {rope_type!r}: hyla implements the default RoPE only")
    params.setdefault("rope_theta", cfg.get("rope_theta", default_theta))
    return params


def hf_layer_types(listed: Sequence[str], num_layers: int, name: str, expected: str) -> tuple[str, ...]:
    """A config's per-layer type names (``HF_LAYER_TYPES``: ``full_attention`` / ``attention`` and
    ``linear_attention`` / ``mamba``) as hyla's ``"attention"`` / ``"linear"``. ``ValueError`` when the list
    does not have ``num_layers`` entries or names another kind (``expected`` says which, for the message)."""
    if len(listed) != num_layers:
        raise ValueError(f"{name} layer_types has {len(listed)} entries, num_hidden_layers is {num_layers}")
    out = tuple(HF_LAYER_TYPES.get(t, t) for t in listed)
    bad = sorted(set(out) - {"attention", "linear"})
    if bad:
        raise ValueError(f"{name} layer types must be {expected}, got {bad}")
    return out


def hf_mamba2_fields(cfg: Mapping[str, Any], width_key: str | None = None) -> dict[str, Any]:
    """The Mamba2 fields of a config in the keys Bamba, Granite 4.0-H and Falcon-H1 share (``mamba_*``,
    ``time_step_limit``, with their HF defaults). Width: ``cfg[width_key]`` when given and set
    (Falcon-H1's ``mamba_d_ssm``), else ``mamba_expand * hidden_size``; head dim ``"auto"`` = width /
    heads; ``time_step_limit`` default ``(0, inf)``. ``ValueError`` when heads * head dim is not the
    width or the limit is not ``(lo, hi)`` with ``lo <= hi``."""
    if width_key is not None and cfg.get(width_key) is not None:
        inner, what = int(cfg[width_key]), width_key
    else:
        inner, what = int(cfg.get("mamba_expand", 2) * int(cfg["hidden_size"])), "mamba_expand * hidden_size"
    heads = int(cfg.get("mamba_n_heads", 128))
    d_head = cfg.get("mamba_d_head", "auto")
    d_head = inner // heads if d_head in (None, "auto") else int(d_head)
    if heads <= 0 or heads * d_head != inner:
        raise ValueError(f"mamba_n_heads ({heads}) * mamba_d_head ({d_head}) must equal the Mamba2 width "
                         f"{what} ({inner})")
    return dict(
        linear_kind="mamba2",
        conv_kernel=int(cfg.get("mamba_d_conv", 4)),
        mamba_num_heads=heads,
        mamba_head_dim=d_head,
        ssm_state_size=int(cfg.get("mamba_d_state", 256)),
        mamba_n_groups=int(cfg.get("mamba_n_groups", 1)),
        mamba_conv_bias=bool(cfg.get("mamba_conv_bias", True)),
        mamba_proj_bias=bool(cfg.get("mamba_proj_bias", False)),
        mamba_dt_limit=hf_time_step_limit(cfg),
    )


def hf_time_step_limit(cfg: Mapping[str, Any], keys: Sequence[str] = ("time_step_limit",)) -> tuple[float, float]:
    """``time_step_limit`` (the first of ``keys`` set, as ``hf_first``) as a Mamba2 ``mamba_dt_limit`` (Bamba,
    Granite 4.0-H, Falcon-H1, Mamba2, NemotronH): default (and null) ``(0, inf)``, which never binds;
    ``ValueError`` unless it is ``(lo, hi)`` with ``lo <= hi``."""
    raw = hf_first(cfg, keys, None)
    limit = (0.0, math.inf) if raw is None else tuple(float(v) for v in raw)
    if len(limit) != 2 or not limit[0] <= limit[1]:
        raise ValueError(f"time_step_limit must be (lo, hi) with lo <= hi, got {raw}")
    return limit


def hf_silu_only(cfg: Mapping[str, Any], name: str) -> str:
    """``hidden_act``, which must be ``silu`` (the only activation these architectures serve)."""
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"unsupported hidden_act {act!r} for {name} (expected 'silu')")
    return act


def hf_float(cfg: Mapping[str, Any], key: str, default: float = 1.0) -> float:
    """``float(cfg[key])``, ``default`` when the key is missing or null (the µP multipliers)."""
    value = cfg.get(key)
    return default if value is None else float(value)


def hf_first(cfg: Mapping[str, Any], keys: Sequence[str], default: Any) -> Any:
    """The value of the first of ``keys`` the config sets (not null): a current key, then its aliases."""
    for key in keys:
        if cfg.get(key) is not None:
            return cfg[key]
    return default


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)
