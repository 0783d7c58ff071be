"""The state pool: recurrent-state slots of the linear (Gated DeltaNet / Mamba2 / short conv) layers.

A slot holds, for every linear layer, a conv window ``conv_shape`` (e.g. ``[conv_dim, K-1]``) and
an SSM state ``ssm_shape`` (Gated DeltaNet ``[Hv, Dk, Dv]``, Mamba2 ``[H, P, N]``, fp32; LFM2's
short convolution has none: ``(0,)``, so its SSM buffers are empty ``[num_slots + 1, 0]`` tensors
that keep the per-layer lists aligned and that ``alloc`` / ``copy`` skip). With ``hidden_size``
> 0 a slot also holds one vector ``hidden_states[slot]`` (MTP speculative decoding: the model's
last hidden state, which belongs with the state after the same tokens), copied, forked and zeroed
with the rest. The buffers are
``[num_slots + 1, *shape]`` per layer; slot 0 is a zero sentinel that is never handed out. A
running request owns one slot that the model updates in place; the radix tree owns the checkpoint
slots. A request never hands its live slot to the tree: it ``fork``s it first.

With a ``companion`` layout (speculative decoding's draft model) a slot also holds the companion's
state after the same tokens: its conv / SSM buffers follow this pool's own in ``conv_states`` /
``ssm_states`` (their own shapes and dtypes), and ``alloc`` / ``copy`` / ``fork`` cover them, so a
checkpoint, a copy-on-write hit or a verify commit moves both models' states together.

Accounting mode (``accounting=True``) keeps the allocator and ``bytes_per_slot`` and allocates no
tensors (``copy``/``fork`` only check and count).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from hyla.cache.allocator import FreeList, IndexLike, PoolExhaustedError, as_index_array
from hyla.cache.layout import CacheLayout
from hyla.cache.transfer import Landing, copy_rows, to_device

# up to this many slots, ``alloc`` zeroes and ``copy`` copies them as row views, one foreach op
# per dtype (on CUDA one multi-tensor kernel: 2 launches instead of 1-2 per layer buffer, ~72 for
# an 18-layer model, in every prefix hit's restore); past it, one indexed op per buffer
ROW_OPS_MAX_SLOTS = 8


class StatePool:
    """Recurrent-state slots ``1..num_slots`` for ``num_layers`` linear layers."""

    def __init__(
        self,
        num_slots: int,
        num_layers: int,
        conv_shape: Sequence[int] | None,
        conv_dtype: torch.dtype,
        ssm_shape: Sequence[int] | None,
        ssm_dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        accounting: bool = False,
        hidden_size: int = 0,
        hidden_dtype: torch.dtype = torch.bfloat16,
        companion: CacheLayout | None = None,
    ) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        if num_layers < 0:
            raise ValueError(f"num_layers must be >= 0, got {num_layers}")
        if num_layers and (conv_shape is None or ssm_shape is None):
            raise ValueError("conv_shape and ssm_shape are required when num_layers > 0")
        self.size = num_slots
        self.num_layers = num_layers
        self.conv_shape = tuple(conv_shape) if num_layers else ()
        self.ssm_shape = tuple(ssm_shape) if num_layers else ()
        self.conv_dtype = conv_dtype
        self.ssm_dtype = ssm_dtype
        self.device = torch.device(device)
        self.accounting = accounting
        layout = CacheLayout(num_linear_layers=num_layers, conv_shape=self.conv_shape, conv_dtype=conv_dtype,
                             ssm_shape=self.ssm_shape, ssm_dtype=ssm_dtype, hidden_size=hidden_size,
                             hidden_dtype=hidden_dtype, companion=companion)
        self.bytes_per_slot = layout.state_bytes_per_slot
        self.companion = companion
        # (conv shape, conv dtype, SSM shape, SSM dtype) per linear layer: this pool's, then the companion's
        kinds = [(self.conv_shape, conv_dtype, self.ssm_shape, ssm_dtype)] * num_layers
        if companion is not None:
            kinds += [(companion.conv_shape, companion.conv_dtype, companion.ssm_shape, companion.ssm_dtype)] \
                * companion.num_linear_layers
        self.num_buffers = len(kinds)
        # what copy_from checks: the buffers' kinds, and the MTP hidden state's size and dtype
        self.buffer_kinds = (tuple(kinds), hidden_size, hidden_dtype if hidden_size else None)
        self._slots = FreeList(num_slots)
        self.conv_states: list[torch.Tensor] = []
        self.ssm_states: list[torch.Tensor] = []
        if not accounting:
            for conv, conv_dt, ssm, ssm_dt in kinds:
                self.conv_states.append(torch.zeros(num_slots + 1, *conv, dtype=conv_dt, device=self.device))  # [S+1, C, K-1]
                self.ssm_states.append(torch.zeros(num_slots + 1, *ssm, dtype=ssm_dt, device=self.device))  # [S+1, H, Dk, Dv]
        self.hidden_states: torch.Tensor | None = None  # [S+1, hidden_size] when hidden_size > 0
        if hidden_size and not accounting:
            self.hidden_states = torch.zeros(num_slots + 1, hidden_size, dtype=hidden_dtype, device=self.device)
        # the buffers that hold something (a conv-only model's SSM buffers hold no element)
        self._filled = [b for b in self.all_buffers() if b.numel()]
        # the same buffers grouped by dtype: a few slots are copied or zeroed as one foreach op per
        # group over their rows (one multi-tensor kernel on CUDA), not one or two ops per buffer
        self._by_dtype = [[b for b in self._filled if b.dtype == dt] for dt in dict.fromkeys(b.dtype for b in self._filled)]

    @classmethod
    def from_layout(
        cls, layout: CacheLayout, num_slots: int, device: torch.device | str = "cpu", accounting: bool = False
    ) -> "StatePool":
        """The state pool of ``layout`` (its linear layers, conv and SSM shapes and dtypes; then its
        companion's)."""
        return cls(num_slots, layout.num_linear_layers, layout.conv_shape, layout.conv_dtype, layout.ssm_shape,
                   layout.ssm_dtype, device, accounting, layout.hidden_size, layout.hidden_dtype, layout.companion)

    def available_size(self) -> int:
        return self._slots.num_free()

    def used_size(self) -> int:
        return self.size - self._slots.num_free()

    @property
    def total_bytes(self) -> int:
        return self.bytes_for(self.size, self.bytes_per_slot)

    @staticmethod
    def bytes_for(num_slots: int, bytes_per_slot: int) -> int:
        """Bytes of a pool of ``num_slots`` before it is built: the slots and the sentinel slot."""
        return (num_slots + 1) * bytes_per_slot

    def can_alloc(self, n: int) -> bool:
        return n <= self._slots.num_free()

    def alloc(self, n: int, zero: bool = True) -> torch.Tensor:
        """``n`` fresh slots, zeroed (a new sequence starts from the zero state); ``zero=False``:
        left as they are, for a caller that overwrites them right away (``copy`` into them).
        ``[n]`` int64."""
        array = self._slots.alloc(n)
        slots = torch.from_numpy(array)
        if n and zero and self._filled:
            if n <= ROW_OPS_MAX_SLOTS:
                rows = array.tolist()
                for bufs in self._by_dtype:
                    torch._foreach_zero_([buf[r] for r in rows for buf in bufs])
            else:
                idx = to_device(slots, torch.long, self.device)
                for buf in self._filled:
                    buf.index_fill_(0, idx, 0)
        return slots

    def free(self, slots: IndexLike) -> None:
        self._slots.free(as_index_array(slots))

    def copy(self, src: IndexLike, dst: IndexLike) -> None:
        """State of ``src[i]`` into ``dst[i]`` for every layer (batched). All slots must be
        allocated; ``dst`` must be distinct and disjoint from ``src``."""
        s, d = self._copy_slots(self, src, dst, disjoint=True)
        if s.size == 0 or self.accounting:
            return
        if s.size <= ROW_OPS_MAX_SLOTS:  # a prefix hit's restore, a fork: row views, one op per dtype
            pairs = list(zip(s.tolist(), d.tolist()))
            for bufs in self._by_dtype:
                torch._foreach_copy_([buf[j] for _, j in pairs for buf in bufs], [buf[i] for i, _ in pairs for buf in bufs])
            return
        si, di = to_device(s, torch.long, self.device), to_device(d, torch.long, self.device)
        for buf in self._filled:
            buf.index_copy_(0, di, buf.index_select(0, si))

    def copy_from(self, other: "StatePool", src: IndexLike, dst: IndexLike, defer: bool = False) -> Landing | None:
        """State of ``other``'s slot ``src[i]`` into this pool's slot ``dst[i]``, every layer (and the
        hidden state): a pool of the same layout on another device (the host tier, ``HostCache``).
        Slots must be allocated in their pools; ``dst`` distinct. No data moves where either pool is
        in accounting mode. With ``defer`` (this pool in host memory) the states arrive when the
        returned ``Landing`` lands (``transfer.copy_rows``)."""
        if other.buffer_kinds != self.buffer_kinds:
            raise ValueError("copy_from a state pool of another layout")
        s, d = self._copy_slots(other, src, dst, disjoint=False)
        if s.size and not (self.accounting or other.accounting):
            return copy_rows(self.all_buffers(), d, other.all_buffers(), s, defer)
        return None

    def _copy_slots(self, source: "StatePool", src: IndexLike, dst: IndexLike,
                    disjoint: bool) -> tuple[np.ndarray, np.ndarray]:
        """A copy's slots as arrays, checked: as many sources (allocated in ``source``) as destinations
        (allocated here, distinct, and with ``disjoint`` none of them a source: a copy within a pool)."""
        s, d = as_index_array(src), as_index_array(dst)
        if s.size != d.size:
            raise ValueError(f"copy needs as many sources as destinations, got {s.size} and {d.size}")
        if not (source.is_allocated(s) and self.is_allocated(d)):
            raise ValueError("copy between slots that are not allocated")
        if len(set(d.tolist())) != d.size or (disjoint and set(d.tolist()) & set(s.tolist())):
            raise ValueError("copy destinations must be distinct" + (" and disjoint from the sources" if disjoint else ""))
        return s, d

    def all_buffers(self) -> list[torch.Tensor]:
        """Every buffer, in one order for pools of one layout (``copy_from``, a ``CachedPrefix``'s bytes)."""
        extra = [self.hidden_states] if self.hidden_states is not None else []
        return [*self.conv_states, *self.ssm_states, *extra]

    def fork(self, slots: IndexLike) -> torch.Tensor:
        """Fresh slots holding a copy of ``slots`` (what a request hands to the tree). ``[n]`` int64."""
        src = as_index_array(slots)
        if not self._slots.is_allocated(src):
            raise ValueError("fork of a slot that is not allocated")
        new = self.alloc(src.size, zero=False)  # overwritten right away
        self.copy(src, new)
        return new

    def is_allocated(self, slots: IndexLike) -> bool:
        return self._slots.is_allocated(as_index_array(slots))

    def is_allocated_slot(self, slot: int) -> bool:
        return self._slots.is_allocated_id(slot)

    def allocated_slots(self) -> list[int]:
        """Sorted allocated slots (for tests and integrity checks; O(num_slots))."""
        return self._slots.allocated_mask().nonzero()[0].tolist()

    def check_integrity(self) -> None:
        self._slots.check_integrity()
        if not self.accounting:
            assert len(self.conv_states) == len(self.ssm_states) == self.num_buffers
            assert all(b.shape[0] == self.size + 1 for b in self.all_buffers()), "buffer rows"


__all__ = ["StatePool", "PoolExhaustedError"]
