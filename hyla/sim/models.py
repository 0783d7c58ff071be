"""What the simulator needs to know of a model: bytes per cached token and state, FLOPs per token.

``CostModel`` is the simulator's whole view of a model:

* ``layout``: the ``CacheLayout`` its accounting pools are built from, whose
  ``kv_bytes_per_token`` (KV-cache bytes of one token over all attention layers) and
  ``state_bytes_per_slot`` (bytes of one recurrent-state checkpoint over all linear layers) the
  model passes on;
* an affine FLOP model per token, split by layer kind: a token at context length ``c`` (itself
  included) costs ``attention + attention_context * c + linear + ffn`` FLOPs, so prefilling
  ``n`` tokens after ``p`` cached ones costs ``Σ_{c=p+1}^{p+n}`` of that (the attention part is
  quadratic in the sequence, everything else linear). The LM head is left out: a prefill runs it
  for one token whatever the cache holds.

Presets (``PRESETS``):

* ``marconi-7b``: the 7B Attention-Mamba2 hybrid Marconi models (24 SSM, 4 attention and 28 MLP
  layers, d=4096, N=128, fp16), with Marconi's own per-layer formulas: attention ``8·d²`` per token
  plus ``4·d`` per (token, context token) pair, MLP ``16·d²``, SSM ``12·d² + 16·d·N + 10·d``; KV
  ``4 layers × 2 × d × 2 B = 64 KiB`` per token, state ``24 × (d·N·2 + (2d + 2N)·4·2) B = 26.8 MB``.
  (Marconi counts the full ``L × L`` attention matrix, ``4·L²·d`` per layer; we count the causal
  half, the same convention as ``ModelConfig.flops_per_token``.)
* ``qwen3-next-80b-a3b``, ``nemotron-h-8b``, ``falcon-h1-7b``, ``granite-4.0-h-small``,
  ``qwen3.5-35b-a3b``, ``lfm2-1.2b``, ``lfm2-8b-a1b``, ``kimi-linear-48b-a3b``, ``jamba-1.5-mini``: the published ``config.json`` contents
  (``hyla/sim/presets.py``) through ``ModelConfig.from_hf``, at the checkpoint's dtype (bf16).
  Falcon-H1 runs attention and Mamba2 in every layer: 44 KV layers *and* 44 state layers. LFM2's
  state is its short convolutions' conv windows alone (80 KiB per checkpoint). Kimi-Linear's MLA
  layers cache the 576-wide latent per token (7 layers: 7.9 KiB per token). Jamba's Mamba1 states
  are ``[8192, 16]`` per layer (a decay per channel and state), 28 layers: 15.3 MiB per checkpoint.
* ``ling-3.0-flash``: transformers' ``BailingHybridConfig`` defaults (given there as Ling-3.0-Flash's):
  Kimi-Linear's cache shapes at 35 KDA layers, 72.5 MiB a checkpoint, 7 MLA layers of 576-wide latents.
* ``olmo-hybrid-7b``: transformers' ``OlmoHybridConfig`` defaults (given there as Olmo-Hybrid-7B's), NoPE:
  24 Gated DeltaNet layers (keys of 96, values of 192: 52.2 MiB a checkpoint), 8 attention layers of 30 KV heads.
* ``lara-4-mini``: transformers' ``LaraMiniConfig`` defaults (given there as Lara-4-Mini-Base's): 14 Gated DeltaNet
  layers (14.3 MiB a checkpoint), 13 sliding-window and 7 global attention layers of 4 KV heads, 40 KiB a token:
  hyla keeps the sliding layers' K/V whole (their window is a mask), so the accounting does too.
* ``zamba2-2.7b``: transformers' ``Zamba2Config`` defaults (a Zamba2-2.7B-style configuration): 54 Mamba2 layers
  (72.5 MB a checkpoint), 9 of them hybrid with a KV of 32 heads of 160 (180 KiB a token) over a shared block.
* ``minimax-text-01``: MiniMax-Text-01's published sizes: 70 lightning-attention layers, whose state is ``[64, 128,
  128]`` fp32 and no conv window (280 MiB a checkpoint, the largest of the presets), and 10 softmax attention layers
  of 8 KV heads (40 KiB a token): 7,168 tokens of KV per checkpoint.
* ``falcon-mamba-7b``, ``mamba-codestral-7b``: pure state-space models (64 Mamba1 / Mamba2 layers, no
  attention): no KV bytes at all, so a cache is checkpoints alone and a hit is one at the exact
  position (FalconMamba 35 MiB a checkpoint, Codestral 260 MiB).

Any other ``config.json`` path goes through the same parser.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Mapping

import torch

from hyla.cache.kv_pool import KVPool
from hyla.cache.layout import CacheLayout
from hyla.cache.memory import INDEX_ONLY_KV_TOKENS
from hyla.cache.state_pool import StatePool
from hyla.engine.args import kv_cache_torch_dtype
from hyla.model.flops import context_sum
from hyla.sim.presets import HF_CONFIGS


@dataclass(frozen=True)
class CostModel:
    """The cache layout (what the accounting pools are built with) and the per-token FLOP model."""

    name: str
    layout: CacheLayout
    # FLOPs
    attention_flops: float  # per token: projections of all attention layers
    attention_context_flops: float  # per token per context token: QK^T and PV of all attention layers
    linear_flops: float  # per token: all recurrent (SSM / Gated DeltaNet) layers
    ffn_flops: float  # per token: all MLP / MoE blocks (active experts only)
    window: int = 0  # sliding-window attention layers' window (0: none)
    window_context_flops: float = 0.0  # per token per context token up to the window: of the sliding-window layers
    vocab_size: int | None = None  # the config's; None: unknown (marconi-7b). The engine replay checks ids against it.
    # the config's; None: unknown (marconi-7b). The engine replay bounds its context length by it, as the engine.
    max_position_embeddings: int | None = None

    def __post_init__(self) -> None:
        if self.kv_bytes_per_token < 0 or self.state_bytes_per_slot <= 0:
            raise ValueError(
                f"{self.name}: the simulator needs a hybrid model with recurrent state ({self.state_bytes_per_slot} "
                f"B/slot; KV {self.kv_bytes_per_token} B/token, none for a pure state-space model)"
            )

    def with_kv_cache_dtype(self, kv_cache_dtype: str) -> CostModel:
        """This model with its KV in the engine's ``kv_cache_dtype`` (``auto``: as it is; ``fp8_e4m3``,
        ``fp8_e5m2``: a byte per element, named so)."""
        dtype = kv_cache_torch_dtype(kv_cache_dtype)
        if dtype is None:
            return self
        return replace(self, name=f"{self.name} (fp8 KV)", layout=self.layout.with_kv_dtype(dtype))

    @property
    def kv_bytes_per_token(self) -> int:
        return self.layout.kv_bytes_per_token

    @property
    def state_bytes_per_slot(self) -> int:
        return self.layout.state_bytes_per_slot

    @property
    def flops_per_token_base(self) -> float:
        """FLOPs of one token, not counting its attention over the context."""
        return self.attention_flops + self.linear_flops + self.ffn_flops

    def prefill_flops(self, extend_len: int, prefix_len: int = 0) -> float:
        """FLOPs to prefill ``extend_len`` tokens after ``prefix_len`` cached ones (closed form).

        ``prefill_flops(n, 0) - prefill_flops(n - p, p)`` is what a cached prefix of ``p`` saves.
        """
        if extend_len < 0 or prefix_len < 0:
            raise ValueError(f"extend_len and prefix_len must be >= 0, got {extend_len}, {prefix_len}")
        first, last = prefix_len + 1, prefix_len + extend_len  # the tokens' context lengths
        windowed = self.window_context_flops * context_sum(first, last, self.window) if self.window_context_flops else 0
        return extend_len * self.flops_per_token_base + self.attention_context_flops * context_sum(first, last) + windowed

    def state_to_kv_ratio(self) -> float:
        """How many tokens of KV one state checkpoint costs (~409 for marconi-7b; infinite for a pure
        state-space model, whose tokens cost nothing)."""
        return self.state_bytes_per_slot / self.kv_bytes_per_token if self.kv_bytes_per_token else math.inf

    def make_pools(self, cache_bytes: int, max_tokens: int | None = None) -> tuple[KVPool, StatePool]:
        """Accounting pools that could each hold the whole budget (the simulator enforces the sum); a
        pure state-space model's KV pool is token indices alone, as the engine's (``split_memory``).

        ``max_tokens``: the most tokens the caller will ever hold at once; neither pool gets more ids
        than that (a checkpoint ends a token of the tree, so there are never more checkpoints). The
        pools' free lists take host memory per id: without the bound, a budget far beyond what a trace
        can fill (``--cache-size 100TB``, to find the hit-rate ceiling) would allocate gigabytes."""
        num_tokens = cache_bytes // self.kv_bytes_per_token if self.kv_bytes_per_token else INDEX_ONLY_KV_TOKENS
        num_slots = cache_bytes // self.state_bytes_per_slot
        if num_tokens < 1 or num_slots < 1:
            raise ValueError(f"a cache of {cache_bytes} bytes cannot hold one state of {self.name} "
                             f"({self.state_bytes_per_slot} bytes)")
        if max_tokens is not None:
            if max_tokens < 1:
                raise ValueError(f"max_tokens must be positive, got {max_tokens}")
            num_tokens, num_slots = min(num_tokens, max_tokens), min(num_slots, max_tokens)
        return (KVPool.from_layout(self.layout, num_tokens, accounting=True),
                StatePool.from_layout(self.layout, num_slots, accounting=True))


def marconi_7b() -> CostModel:
    d, n = 4096, 128
    num_ssm, num_attn, num_mlp = 24, 4, 28
    return CostModel(
        name="marconi-7b",
        layout=CacheLayout(
            num_attention_layers=num_attn, num_kv_heads=32, head_dim=d // 32, kv_dtype=torch.float16,
            num_linear_layers=num_ssm, conv_shape=(2 * d + 2 * n, 4), conv_dtype=torch.float16,
            ssm_shape=(d, n), ssm_dtype=torch.float16,
        ),
        attention_flops=num_attn * 8.0 * d * d,
        attention_context_flops=num_attn * 4.0 * d,
        linear_flops=num_ssm * (12.0 * d * d + 16.0 * d * n + 10.0 * d),
        ffn_flops=num_mlp * 16.0 * d * d,
    )


def from_model_config(config: Any, name: str) -> CostModel:
    """A ``CostModel`` from a ``hyla.model.config.ModelConfig``: its ``cache_layout`` (KV and conv
    state at the config's dtype, SSM state fp32: the layout the engine's pools use) and FLOP model (a
    sliding-window layer's context cost capped at its window)."""
    one, two = config.flops_per_token(1), config.flops_per_token(2)
    window = config.sliding_window
    past = config.flops_per_token(window + 2).attention - config.flops_per_token(window + 1).attention
    attention_context = past if window else two.attention - one.attention  # per context token, past any window
    # (a window of 1: the sliding layers' context cost is a constant, in attention_flops)
    window_context = two.attention - one.attention - attention_context if window > 1 else 0.0
    return CostModel(
        name=name,
        layout=config.cache_layout,
        attention_flops=one.attention - attention_context - window_context,
        attention_context_flops=attention_context,
        window=window,
        window_context_flops=window_context,
        linear_flops=one.linear,
        ffn_flops=one.mlp + one.moe,
        vocab_size=config.vocab_size,
        max_position_embeddings=config.max_position_embeddings,
    )


def from_hf_config(config_json: Mapping[str, Any], name: str) -> CostModel:
    from hyla.model.config import ModelConfig

    return from_model_config(ModelConfig.from_hf(config_json), name)


def _preset_from_hf(name: str) -> CostModel:
    return from_hf_config(HF_CONFIGS[name], name)


PRESETS = ("marconi-7b", *HF_CONFIGS)


def resolve_model(spec: str, kv_cache_dtype: str = "auto") -> CostModel:
    """A preset name or a path to a ``config.json`` (or to a directory holding one), its KV in
    ``kv_cache_dtype`` (the engine's option: ``auto``, ``fp8_e4m3``)."""
    return _resolve_model(spec).with_kv_cache_dtype(kv_cache_dtype)


def _resolve_model(spec: str) -> CostModel:
    if spec == "marconi-7b":
        return marconi_7b()
    if spec in PRESETS:
        return _preset_from_hf(spec)
    path = Path(spec)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(f"unknown model {spec!r}: not a preset ({', '.join(PRESETS)}) nor a config.json path")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e.msg})") from None
    except RecursionError:  # (the decoder recurses once per level of nesting)
        raise ValueError(f"{path}: not valid JSON (nested too deeply)") from None
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not a text file") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}: a model config is a JSON object, got {type(config).__name__}")
    try:
        return from_hf_config(config, path.parent.name or str(path))
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    except (TypeError, LookupError, AttributeError, ArithmeticError) as e:  # a field of the wrong type or value
        raise ValueError(f"{path}: not a usable model config ({type(e).__name__}: {e})") from None
    except RecursionError:  # a value nested too deeply for the parser's recursive walks (decode_json_floats)
        raise ValueError(f"{path}: not a usable model config (a value nested too deeply)") from None
