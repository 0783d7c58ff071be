"""``CacheLayout``: what one cached token (KV) and one state slot hold, and so their byte sizes.

The one source of ``kv_bytes_per_token`` and ``state_bytes_per_slot``: ``ModelConfig.cache_layout``
produces it from a model, ``marconi_7b`` in the simulator writes one by hand, and ``KVPool`` /
``StatePool`` (``from_layout``), the engine's memory split and the simulator's byte budget read it.
Plain numbers and dtypes: the cache room still imports nothing from ``hyla.model``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch


@dataclass(frozen=True)
class CacheLayout:
    """KV: K and V of ``num_kv_heads x head_dim`` in ``kv_dtype`` per attention layer and token.
    State: a conv window ``conv_shape`` in ``conv_dtype`` and an SSM state ``ssm_shape`` in
    ``ssm_dtype`` per linear layer and slot. A side with no layers takes no bytes (its shapes are
    then ignored). A shape with a zero dimension holds nothing: LFM2's short-convolution layers keep
    a conv window and no SSM state (``ssm_shape=(0,)``, 0 bytes). ``hidden_size`` > 0 adds one
    vector of that many ``hidden_dtype`` elements per state slot (MTP speculative decoding keeps the
    model's last hidden state beside the recurrent state: ``hyla/model/mtp.py``).

    ``companion``: another model's layout kept on the *same* slots — speculative decoding's draft
    model (``hyla/engine/draft_drafter.py``): token slot ``t`` also holds the companion's K/V of
    that token, state slot ``s`` also holds the companion's state after the same tokens. Its bytes
    count in this layout's ``kv_bytes_per_token`` / ``state_bytes_per_slot``, and the pools
    (``from_layout``) hold its buffers after this layout's own, each in its own shape and dtype.
    A companion has no companion of its own.

    Raises ``ValueError`` for negative sizes, linear layers without shapes or whose state holds no
    element at all, or a companion with a companion."""

    num_attention_layers: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    kv_dtype: torch.dtype = torch.bfloat16
    num_linear_layers: int = 0
    conv_shape: tuple[int, ...] = ()
    conv_dtype: torch.dtype = torch.bfloat16
    ssm_shape: tuple[int, ...] = ()
    ssm_dtype: torch.dtype = torch.float32
    hidden_size: int = 0
    hidden_dtype: torch.dtype = torch.bfloat16
    companion: CacheLayout | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "conv_shape", tuple(int(d) for d in self.conv_shape))
        object.__setattr__(self, "ssm_shape", tuple(int(d) for d in self.ssm_shape))
        sizes = (self.num_attention_layers, self.num_kv_heads, self.head_dim, self.num_linear_layers,
                 *self.conv_shape, *self.ssm_shape, self.hidden_size)
        if min(sizes) < 0:
            raise ValueError(f"cache layout sizes must be >= 0: {self}")
        if self.num_linear_layers and not (self.conv_shape and self.ssm_shape):
            raise ValueError("linear layers need a conv_shape and an ssm_shape")
        if self.num_linear_layers and not (math.prod(self.conv_shape) or math.prod(self.ssm_shape)):
            raise ValueError(f"linear layers need a state: conv_shape {self.conv_shape} and ssm_shape "
                             f"{self.ssm_shape} are both empty")
        if self.companion is not None and self.companion.companion is not None:
            raise ValueError("a companion layout cannot have a companion of its own")

    def with_kv_dtype(self, dtype: torch.dtype | None) -> CacheLayout:
        """This layout with its K/V (and its companion's) kept in ``dtype`` (``kv_cache_dtype``); None: as it is."""
        if dtype is None:
            return self
        companion = self.companion.with_kv_dtype(dtype) if self.companion is not None else None
        return replace(self, kv_dtype=dtype, companion=companion)

    @property
    def kv_bytes_per_token(self) -> int:
        """KV bytes of one token over all attention layers (K and V), the companion's included."""
        own = 2 * self.num_attention_layers * self.num_kv_heads * self.head_dim * self.kv_dtype.itemsize
        return own + (self.companion.kv_bytes_per_token if self.companion is not None else 0)

    @property
    def state_bytes_per_slot(self) -> int:
        """Bytes of one state slot over all linear layers (conv window + SSM state), plus the hidden
        vector, plus the companion's."""
        total = self.hidden_size * self.hidden_dtype.itemsize
        if self.num_linear_layers:
            conv = math.prod(self.conv_shape) * self.conv_dtype.itemsize
            ssm = math.prod(self.ssm_shape) * self.ssm_dtype.itemsize
            total += self.num_linear_layers * (conv + ssm)
        return total + (self.companion.state_bytes_per_slot if self.companion is not None else 0)
