"""An extend's Mamba2 segments in chunks of ``BT`` tokens, one Triton launch: the SSD's chunked form
(a linear attention with one scalar decay per head and token), so that a program's tokens cost a
few matrix products per chunk where the recurrent kernel (``mamba2_decode.mamba2_segments_fused``)
pays one token's reduction per token. Same contract as that kernel (segments, pool rows,
checkpoints written on the way), same discretization (``mamba2_decode._mamba2_step``'s:
``dt = clamp(softplus(dt + dt_bias), *dt_limit)``, decay ``exp(dt A)``).

Per head, with ``h [P, N]`` the state before a chunk and, inside it, ``G_t = dt_1 A + ... + dt_t A``
the cumulative log-decay and ``X = x * dt`` ``[BT, P]``, the recurrence
``S_t = exp(dt_t A) S_{t-1} + X_t B_t^T``, ``y_t = S_t C_t + D x_t`` unrolls to (the PyTorch
reference's chunk scan, ``hyla.model.ops.ssd``)::

    Y   = exp(G) * (C h^T) + (C B^T * exp(G_t - G_s), s <= t) X + D x    [BT, P]
    S_t = exp(G_t) h + sum_{s <= t} exp(G_t - G_s) X_s B_s^T               (the state after token t)

``exp(G_t - G_s)`` (``s <= t``) is ``exp`` of the sum of the decays between them itself
(``segment_checkpoints.chunk_decay``, as for Gated DeltaNet). A checkpoint inside a chunk is the
second line at its token; rows past a segment's end are masked to zero
inputs and decays. Each program owns one ``(segment, head, block of P rows)``; the products run on
``tl.dot`` at ``DOT_PRECISION``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from typing import TYPE_CHECKING

from hyla.model.ops.gpu import pdl, segments_of
from hyla.model.ops.gpu.mamba2_decode import _check_inputs, _mamba2_dt, _mamba2_program, mamba2_segments_fused
from hyla.model.ops.gpu.segment_checkpoints import (
    INDEX_ARGS,
    SegmentCheckpoints,
    chunk_decay,
    chunk_state_at,
    first_checkpoint,
    open_segment,
    segment_checkpoint_args,
    write_chunk_checkpoints,
)

if TYPE_CHECKING:  # fla_chunk imports this module
    from hyla.model.ops.gpu.fla_chunk import SegmentKernel

# (tokens per chunk, rows of the state's P per program, warps). tl.dot needs each at least 16.
# benchmarks/recurrent_tiles.py on an H100 (64 heads of 64x128): 16x32 with 8 warps was the fastest
# from 64 to 4,096 tokens (78.5 µs for 296 tokens, 92.3 with 4 warps). tf32 products missed the
# bf16 tolerance against the recurrence there, so both dtypes keep tf32x3.
CHUNK_TILES = (16, 32, 8)
DOT_PRECISION = "tf32x3"  # tl.dot's input_precision for fp32 activations (as gated_delta_chunks')
HALF_DOT_PRECISION = "tf32x3"  # and for bf16/fp16 ones
CHUNKED_MIN_LEN = 32  # a launch whose longest segment has at least this many tokens runs in chunks; read
# each launch (as gated_delta_chunks.CHUNKED_MIN_LEN; benchmarks/fla_prefill.py times both kernels)


@triton.jit(do_not_specialize_on_alignment=INDEX_ARGS)
def _mamba2_chunks_kernel(x_ptr, x_stride, dt_ptr, dt_stride, a_ptr, b_ptr, c_ptr, bc_stride, d_ptr, dt_bias_ptr,
                          state_ptr, rows_ptr, starts_ptr, cu_ptr, y_ptr, y_stride, dt_min, dt_max,
                          pool_ptr, ck_off_ptr, ck_pos_ptr, ck_slot_ptr,
                          H: tl.constexpr, G: tl.constexpr, P: tl.constexpr, N: tl.constexpr, BP: tl.constexpr,
                          BN: tl.constexpr, BT: tl.constexpr, HAS_D: tl.constexpr, HAS_BIAS: tl.constexpr,
                          CKPT: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr):
    pdl.wait(PDL)  # (pdl.py)
    # segment i: packed tokens starts[i] .. + (cu[i+1] - cu[i]), from state row rows[i]
    i, h, g, p, mp, n, mn, a, d, dt_bias = _mamba2_program(a_ptr, d_ptr, dt_bias_ptr, H, G, BP, BN, P, N)
    inner = h * (P * N) + p[:, None] * N + n[None, :]
    mask = mp[:, None] & mn[None, :]
    # state [BP, BN] fp32: the state before the chunk
    start, count, ptr, state = open_segment(state_ptr, rows_ptr, starts_ptr, cu_ptr, i, H * P * N, inner, mask)
    if CKPT:  # the segment's checkpoints c .. c_end, the next one after nxt tokens (0: none left)
        c, c_end, nxt = first_checkpoint(ck_off_ptr, ck_pos_ptr, i)
    t = tl.arange(0, BT)
    for c0 in range(0, count, BT):
        live = (c0 + t) < count  # [BT]: the chunk's tokens (the last chunk's tail is masked)
        r = start + c0 + t
        x = tl.load(x_ptr + r[:, None] * x_stride + h * P + p[None, :], mask=live[:, None] & mp[None, :],
                    other=0.0).to(tl.float32)  # [BT, BP]
        bc = live[:, None] & mn[None, :]
        bm = tl.load(b_ptr + r[:, None] * bc_stride + g * N + n[None, :], mask=bc, other=0.0).to(tl.float32)
        cm = tl.load(c_ptr + r[:, None] * bc_stride + g * N + n[None, :], mask=bc, other=0.0).to(tl.float32)
        dt = tl.load(dt_ptr + r * dt_stride + h, mask=live, other=0.0)  # [BT]
        dt = tl.where(live, _mamba2_dt(dt, dt_bias, dt_min, dt_max, HAS_BIAS), 0.0)
        log_decay = dt * a
        cum = tl.cumsum(log_decay, axis=0)  # [BT] G_t
        decay = chunk_decay(log_decay, t)  # [BT, BT]: exp(G_t - G_s), s <= t
        xdt = x * dt[:, None]

        cb = tl.dot(cm, tl.trans(bm), input_precision=PRECISION)  # [BT, BT]
        y = tl.exp(cum)[:, None] * tl.dot(cm, tl.trans(state), input_precision=PRECISION) \
            + tl.dot(cb * decay, xdt, input_precision=PRECISION)  # [BT, BP]
        if HAS_D:
            y += d * x
        tl.store(y_ptr + r[:, None] * y_stride + h * P + p[None, :], y.to(y_ptr.dtype.element_ty),
                 mask=live[:, None] & mp[None, :])
        if CKPT:  # the checkpoints inside this chunk
            c, nxt = write_chunk_checkpoints(state, xdt, bm, cum, decay, t, c0, count, c, c_end, nxt, ck_pos_ptr,
                                             ck_slot_ptr, pool_ptr, H * P * N, inner, mask, BT, PRECISION)
        state = chunk_state_at(state, xdt, bm, cum, decay, BT - 1, t, PRECISION)  # the masked tail changes nothing
    tl.store(ptr, state, mask=mask)


def mamba2_chunks_fused(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                        D: torch.Tensor | None, dt_bias: torch.Tensor | None, states: torch.Tensor,
                        rows: torch.Tensor, starts: torch.Tensor, cu_seqlens: torch.Tensor, out: torch.Tensor,
                        dt_limit: tuple[float, float] | None = None, ckpts: SegmentCheckpoints | None = None) -> None:
    """``mamba2_decode.mamba2_segments_fused``'s contract, in chunks (the module docstring): segment
    ``i`` is the packed tokens ``starts[i] ..`` (``cu_seqlens[i+1] - cu_seqlens[i]`` of them) of
    ``x [T, H*P]``, raw ``dt [T, H]``, ``B, C [T, G*N]``, run from ``states[rows[i]]`` (``[B, H, P,
    N]`` fp32, updated in place), its outputs written into those rows of ``out [T, H, P]``; with
    ``ckpts``, the states after given tokens written to pool rows on the way."""
    num_heads, head_dim, n, groups = _check_inputs(x, dt, B, C, states)
    segments = segments_of(rows, starts, cu_seqlens, out, (x.shape[0], num_heads, head_dim))
    if x.shape[0] == 0:
        return
    lo, hi = dt_limit if dt_limit is not None else (float("-inf"), float("inf"))
    bt, bp, warps = CHUNK_TILES
    bp = max(16, min(triton.next_power_of_2(head_dim), bp))
    _mamba2_chunks_kernel[(segments * num_heads, triton.cdiv(head_dim, bp))](
        x, x.stride(0), dt, dt.stride(0), A, B, C, B.stride(0), D if D is not None else A,
        dt_bias if dt_bias is not None else A, states, rows, starts, cu_seqlens, out, out.stride(0), float(lo),
        float(hi), *segment_checkpoint_args(ckpts, states, rows, segments), H=num_heads, G=groups, P=head_dim, N=n,
        BP=bp, BN=max(16, triton.next_power_of_2(n)), BT=bt, HAS_D=D is not None, HAS_BIAS=dt_bias is not None,
        CKPT=ckpts is not None,
        PRECISION=DOT_PRECISION if x.dtype == torch.float32 else HALF_DOT_PRECISION, num_warps=warps, **pdl.launch(x))


def segment_kernel(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                   D: torch.Tensor | None, dt_bias: torch.Tensor | None,
                   dt_limit: tuple[float, float] | None) -> SegmentKernel:
    """The layer's own kernel for an extend's segments (``fla_chunk.scan_in_rounds``), on its raw
    ``x [T, H*P]``, ``dt [T, H]``, ``B, C [T, G*N]``: this module's chunks when the longest segment
    has at least ``CHUNKED_MIN_LEN`` tokens, else the recurrence token by token
    (``mamba2_decode.mamba2_segments_fused``)."""
    def run(states, rows, starts, cu_seqlens, out, ckpts=None, *, longest: int) -> None:
        kernel = mamba2_chunks_fused if longest >= CHUNKED_MIN_LEN else mamba2_segments_fused
        kernel(x, dt, A, B, C, D, dt_bias, states, rows, starts, cu_seqlens, out, dt_limit, ckpts)
    return run
