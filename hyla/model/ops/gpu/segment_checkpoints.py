"""What an extend's segments launches share (``gated_delta_decode.gated_delta_segments_fused``,
``mamba2_decode.mamba2_segments_fused`` and their chunked forms ``gated_delta_chunks``,
``mamba2_chunks``, run by ``fla_chunk``): each segment's rows (:func:`open_segment`), and the
checkpoints a launch writes itself on its way (``fla_chunk.single_pass``) — the request, its launch
arguments, and the jit helpers the kernels call around their token loop (:func:`write_checkpoint`)
or chunk loop (:func:`write_chunk_checkpoints`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


INDEX_ARGS = ["rows_ptr", "starts_ptr", "cu_ptr", "ck_off_ptr", "ck_pos_ptr", "ck_slot_ptr"]
"""A segments kernel's index arguments (``@triton.jit(do_not_specialize_on_alignment=INDEX_ARGS)``):
on a GPU they are views of one packed host-to-device copy (``fla_chunk``'s plans,
``cache.transfer.to_device_packed``) at offsets that follow the batch, so their alignment must not be
a compile key (a new one would compile the kernel again mid-serving: ``ops/gpu/__init__.py``)."""


@dataclass(frozen=True)
class SegmentCheckpoints:
    """The checkpoints a segments launch writes itself (``gated_delta_segments_fused``,
    ``mamba2_segments_fused``): after ``pos[c]`` tokens of segment ``i``, for ``c`` in ``offsets[i] ..
    offsets[i+1]`` (positions strictly ascending within a segment, each at least 1), the running state
    goes to ``pool[slot[c]]`` (rows no segment reads or writes). Integer tensors on the device."""

    pool: torch.Tensor  # [S, *state] fp32: the layer's state pool
    offsets: torch.Tensor  # [n+1]
    pos: torch.Tensor  # [M]
    slot: torch.Tensor  # [M]

    def kernel_args(self, states: torch.Tensor, segments: int) -> tuple:
        """``(pool, offsets, pos, slot)`` for a launch over ``segments`` segments of ``states``."""
        m = self.pos.shape[0]
        if self.pool.dtype != states.dtype or self.pool.shape[1:] != states.shape[1:] or not self.pool.is_contiguous():
            raise ValueError(f"the checkpoint pool must be a contiguous {states.dtype} [S, {list(states.shape[1:])}]")
        if self.offsets.shape != (segments + 1,) or self.pos.dim() != 1 or self.slot.shape != (m,):
            raise ValueError(f"checkpoint offsets must be [{segments + 1}], pos and slot [M] alike")
        return self.pool, self.offsets, self.pos, self.slot


def segment_checkpoint_args(ckpts: SegmentCheckpoints | None, states: torch.Tensor, rows: torch.Tensor,
                            segments: int) -> tuple:
    """A segments launch's checkpoint arguments: ``ckpts.kernel_args``, or placeholders (``states``,
    ``rows``) for a launch that writes none (its ``CKPT=False``)."""
    return (states, rows, rows, rows) if ckpts is None else ckpts.kernel_args(states, segments)


@triton.jit
def first_checkpoint(ck_off_ptr, ck_pos_ptr, i):
    """Segment ``i``'s checkpoints ``c .. c_end`` and the first one's position ``nxt`` (0: none)."""
    c = tl.load(ck_off_ptr + i)
    c_end = tl.load(ck_off_ptr + i + 1)
    return c, c_end, tl.load(ck_pos_ptr + c, mask=c < c_end, other=0)


@triton.jit
def write_checkpoint(S, j, c, c_end, nxt, ck_pos_ptr, ck_slot_ptr, pool_ptr, row_size, inner, mask):
    """After the segment's token ``j``: the state block ``S`` (at ``inner`` within a pool row of
    ``row_size``) to its checkpoint's row if one is due there; returns the next ``(c, nxt)``."""
    if nxt == j + 1:
        slot = tl.load(ck_slot_ptr + c).to(tl.int64)
        tl.store(pool_ptr + slot * row_size + inner, S, mask=mask)
        c += 1
        nxt = tl.load(ck_pos_ptr + c, mask=c < c_end, other=0)
    return c, nxt


@triton.jit
def open_segment(state_ptr, rows_ptr, starts_ptr, cu_ptr, i, row_size, inner, mask):
    """Segment ``i`` of a segments launch: its first packed token, its token count, the pointer to
    the program's block of its running state (pool row ``rows[i]`` of ``row_size`` elements, at
    ``inner``) and that block, loaded."""
    start = tl.load(starts_ptr + i).to(tl.int64)
    count = tl.load(cu_ptr + i + 1) - tl.load(cu_ptr + i)
    ptr = state_ptr + tl.load(rows_ptr + i).to(tl.int64) * row_size + inner
    return start, count, ptr, tl.load(ptr, mask=mask, other=0.0)


@triton.jit
def chunk_decay(g, t):
    """A chunk's decays from token ``s`` to token ``t``, ``exp(g_{s+1} + .. + g_t)`` for ``s <= t``
    (1 on the diagonal, 0 above it), from its tokens' log-decays ``g [BT]`` (``t = arange(BT)``):
    sums of the gates themselves, not differences of their running sum, in which one large decay
    would cost the later tokens their digits. ``[BT, BT]``."""
    causal = t[:, None] >= t[None, :]
    span = tl.cumsum(tl.where(t[:, None] > t[None, :], g[:, None], 0.0), axis=0)  # [t, s]: g_{s+1} + .. + g_t
    return tl.where(causal, tl.exp(tl.where(causal, span, 0.0)), 0.0)


@triton.jit
def chunk_state_at(h, left, right, cum, decay, p, t, PRECISION: tl.constexpr):
    """A chunked kernel's state after the chunk's token ``p`` (0-based; ``t = arange(BT)``), from the
    state ``h [R, C]`` before the chunk: ``exp(G_p) h + sum_{s <= p} decay[p, s] left_s right_s^T``,
    with ``cum`` = G ``[BT]`` the cumulative log-decay from the chunk's start, ``decay``
    (:func:`chunk_decay`), ``left [BT, R]``, ``right [BT, C]`` (Gated DeltaNet: keys and deltas;
    Mamba2: ``dt * x`` and B)."""
    g_p = tl.sum(tl.where(t == p, cum, 0.0), axis=0)
    w = tl.sum(tl.where(t[:, None] == p, decay, 0.0), axis=0)  # decay[p, :] ([BT], 0 past p)
    return tl.exp(g_p) * h + tl.dot(tl.trans(left * w[:, None]), right, input_precision=PRECISION)


@triton.jit
def write_chunk_checkpoints(h, left, right, cum, decay, t, c0, count, c, c_end, nxt, ck_pos_ptr, ck_slot_ptr,
                            pool_ptr, row_size, inner, mask, BT: tl.constexpr, PRECISION: tl.constexpr):
    """In the chunk of the segment's tokens ``c0 .. c0 + BT`` (of ``count``): each checkpoint due
    there, the state at its token (:func:`chunk_state_at`), to its pool row (none past the segment's
    end, as the recurrent kernels). Returns the next ``(c, nxt)``, as :func:`write_checkpoint`."""
    while (nxt > c0) & (nxt <= c0 + BT) & (nxt <= count):
        slot = tl.load(ck_slot_ptr + c).to(tl.int64)
        state = chunk_state_at(h, left, right, cum, decay, nxt - c0 - 1, t, PRECISION)
        tl.store(pool_ptr + slot * row_size + inner, state, mask=mask)
        c += 1
        nxt = tl.load(ck_pos_ptr + c, mask=c < c_end, other=0)
    return c, nxt
