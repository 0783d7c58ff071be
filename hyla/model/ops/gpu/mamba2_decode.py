"""One Mamba2 decode step as one Triton kernel: dt discretization and the in-place update of the
fp32 state pool (mamba-ssm's ``selective_state_update``, with a state-slot index).

Reference: :func:`hyla.model.ops.ssd.mamba2_state_update` (same contract). Per sequence ``i`` and
head ``h`` (group ``g = h // (H/G)``), with ``S = ssm_states[slots[i], h]  [P, N]``::

    dt = clamp(softplus(dt + dt_bias), *dt_limit)
    S <- exp(dt A) S + dt x B^T;     y = S C + D x

Each program owns one ``(sequence, head, block of P rows)`` of the state. ``slots[i] == -1``: zero
state, no write, don't-care output. ``chain [W+1, S]`` (a speculative verify step): ``S`` sequences
of ``W`` tokens (row ``i*W + j``) in one launch, the state kept in registers from token to token and
written after token ``j`` at ``chain[j+1, i]`` (``-1``: not written); ``chain[0, i]`` is read.
:func:`mamba2_segments_fused` runs an extend's short segments through the same recurrence
(``_mamba2_load`` and ``_mamba2_step``, each token's inputs loaded while the token before it is
computed), as ``gated_delta_decode`` does for Gated DeltaNet.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hyla.model.ops.gpu import chain_of, pdl, segments_of
from hyla.model.ops.gpu.elementwise import softplus
from hyla.model.ops.gpu.segment_checkpoints import (
    INDEX_ARGS,
    SegmentCheckpoints,
    first_checkpoint,
    open_segment,
    segment_checkpoint_args,
    write_checkpoint,
)

# (rows of the state's P per program, warps) of the decode and the segments kernels: a program runs
# the recurrence on a [BP, N] block. Read at each launch. benchmarks/recurrent_tiles.py on an H100 (64
# heads of 64x128): decode within noise of the best at 32/4 (batch 1 to 64); the segments kernel at 8
# rows and 2 warps (115 vs 158 µs for 296 tokens).
DECODE_TILES = (32, 4)
SEGMENT_TILES = (8, 2)


@triton.jit
def _mamba2_token(S, x_row, dt_ptr, b_row, c_row, a, d, dt_bias, dt_min, dt_max, g, h, p, mp, n, mn,
                  P: tl.constexpr, N: tl.constexpr, HAS_D: tl.constexpr, HAS_BIAS: tl.constexpr):
    """One token on a ``[BP, BN]`` block of a head's fp32 state: ``x_row``, ``b_row``, ``c_row`` point
    at the token's x, B and C, ``dt_ptr`` at its raw dt. Returns ``(S, y [BP])``."""
    x, dt, bv, cv = _mamba2_load(x_row, dt_ptr, b_row, c_row, g, h, p, mp, n, mn, P, N)
    return _mamba2_step(S, x, dt, bv, cv, a, d, dt_bias, dt_min, dt_max, HAS_D, HAS_BIAS)


@triton.jit
def _mamba2_load(x_row, dt_ptr, b_row, c_row, g, h, p, mp, n, mn, P: tl.constexpr, N: tl.constexpr):
    """:func:`_mamba2_token`'s loads: ``(x, dt, B, C)`` as stored."""
    x = tl.load(x_row + h * P + p, mask=mp, other=0.0)
    bv = tl.load(b_row + g * N + n, mask=mn, other=0.0)
    cv = tl.load(c_row + g * N + n, mask=mn, other=0.0)
    return x, tl.load(dt_ptr), bv, cv


@triton.jit
def _mamba2_dt(dt, dt_bias, dt_min, dt_max, HAS_BIAS: tl.constexpr):
    """The raw ``dt`` (any shape) discretized in fp32: ``clamp(softplus(dt + dt_bias), dt_min,
    dt_max)``. Shared with the chunked kernel (``mamba2_chunks``)."""
    dt = dt.to(tl.float32)
    if HAS_BIAS:
        dt += dt_bias
    return tl.minimum(tl.maximum(softplus(dt, True), dt_min), dt_max)


@triton.jit
def _mamba2_step(S, x, dt, bv, cv, a, d, dt_bias, dt_min, dt_max, HAS_D: tl.constexpr, HAS_BIAS: tl.constexpr):
    """:func:`_mamba2_token`'s math on loaded inputs."""
    x = x.to(tl.float32)
    dt = _mamba2_dt(dt, dt_bias, dt_min, dt_max, HAS_BIAS)
    decay = tl.exp(dt * a)
    bv = bv.to(tl.float32)
    cv = cv.to(tl.float32)
    S = S * decay + (x * dt)[:, None] * bv[None, :]
    y = tl.sum(S * cv[None, :], axis=1)
    if HAS_D:
        y += d * x
    return S, y


@triton.jit
def _mamba2_program(a_ptr, d_ptr, dt_bias_ptr, H: tl.constexpr, G: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr,
                    P: tl.constexpr, N: tl.constexpr):
    """A program's share: sequence (a decode step's, a segment) ``i``, head ``h`` of group ``g``, its
    block of state rows ``p`` and the state columns ``n`` (and their masks), the head's A, D and dt
    bias in fp32 (the wrappers pass A for a missing D or dt_bias)."""
    pid = tl.program_id(0)
    i = pid // H
    h = pid % H
    p = tl.program_id(1) * BP + tl.arange(0, BP)
    n = tl.arange(0, BN)
    return i, h, h // (H // G), p, p < P, n, n < N, tl.load(a_ptr + h).to(tl.float32), \
        tl.load(d_ptr + h).to(tl.float32), tl.load(dt_bias_ptr + h).to(tl.float32)


@triton.jit(do_not_specialize=["chain_stride"], do_not_specialize_on_alignment=["chain_ptr"])
def _mamba2_decode_kernel(x_ptr, x_stride, dt_ptr, dt_stride, a_ptr, b_ptr, c_ptr, bc_stride, d_ptr, dt_bias_ptr,
                          state_ptr, chain_ptr, chain_stride, y_ptr, dt_min, dt_max,
                          W: tl.constexpr, H: tl.constexpr, G: tl.constexpr, P: tl.constexpr, N: tl.constexpr,
                          BP: tl.constexpr, BN: tl.constexpr, HAS_D: tl.constexpr, HAS_BIAS: tl.constexpr,
                          PDL: tl.constexpr):
    pdl.wait(PDL)  # (pdl.py) before _mamba2_program: A is -exp(A_log), derived in the step, not a parameter
    i, h, g, p, mp, n, mn, a, d, dt_bias = _mamba2_program(a_ptr, d_ptr, dt_bias_ptr, H, G, BP, BN, P, N)
    slot = tl.load(chain_ptr + i).to(tl.int64)
    offs = h * (P * N) + p[:, None] * N + n[None, :]
    live = mp[:, None] & mn[None, :] & ((tl.zeros([BP, BN], dtype=tl.int64) + slot) >= 0)  # a block mask
    S = tl.load(state_ptr + slot * (H * P * N) + offs, mask=live, other=0.0)  # [BP, BN] fp32
    for j in tl.static_range(W):  # the sequence's tokens in order (a decode step: one)
        r = i * W + j
        S, y = _mamba2_token(S, x_ptr + r * x_stride, dt_ptr + r * dt_stride + h, b_ptr + r * bc_stride,
                             c_ptr + r * bc_stride, a, d, dt_bias, dt_min, dt_max, g, h, p, mp, n, mn, P, N, HAS_D,
                             HAS_BIAS)
        dst = tl.load(chain_ptr + (j + 1) * chain_stride + i).to(tl.int64)
        live_dst = mp[:, None] & mn[None, :] & ((tl.zeros([BP, BN], dtype=tl.int64) + dst) >= 0)
        tl.store(state_ptr + dst * (H * P * N) + offs, S, mask=live_dst)
        tl.store(y_ptr + (r * H + h) * P + p, y.to(y_ptr.dtype.element_ty), mask=mp)


@triton.jit(do_not_specialize_on_alignment=INDEX_ARGS)
def _mamba2_segments_kernel(x_ptr, x_stride, dt_ptr, dt_stride, a_ptr, b_ptr, c_ptr, bc_stride, d_ptr, dt_bias_ptr,
                            state_ptr, rows_ptr, starts_ptr, cu_ptr, y_ptr, y_stride, dt_min, dt_max,
                            pool_ptr, ck_off_ptr, ck_pos_ptr, ck_slot_ptr,
                            H: tl.constexpr, G: tl.constexpr, P: tl.constexpr, N: tl.constexpr, BP: tl.constexpr,
                            BN: tl.constexpr, HAS_D: tl.constexpr, HAS_BIAS: tl.constexpr, CKPT: tl.constexpr,
                            PDL: tl.constexpr):
    pdl.wait(PDL)  # (pdl.py)
    # segment i: packed tokens starts[i] .. + (cu[i+1] - cu[i]), from state row rows[i]
    i, h, g, p, mp, n, mn, a, d, dt_bias = _mamba2_program(a_ptr, d_ptr, dt_bias_ptr, H, G, BP, BN, P, N)
    inner = h * (P * N) + p[:, None] * N + n[None, :]
    mask = mp[:, None] & mn[None, :]
    start, count, ptr, S = open_segment(state_ptr, rows_ptr, starts_ptr, cu_ptr, i, H * P * N, inner, mask)  # fp32
    if CKPT:  # the segment's checkpoints c .. c_end, the next one after nxt tokens (0: none left)
        c, c_end, nxt = first_checkpoint(ck_off_ptr, ck_pos_ptr, i)
    # the segment's tokens in order, the state in registers, each token's inputs loaded one token
    # ahead (as gated_delta_decode's segments kernel: the row ahead clamped to the segment's last)
    last = tl.maximum(start + count - 1, 0)
    first = tl.minimum(start, last)
    nx, ndt, nb, nc = _mamba2_load(x_ptr + first * x_stride, dt_ptr + first * dt_stride + h, b_ptr + first * bc_stride,
                                   c_ptr + first * bc_stride, g, h, p, mp, n, mn, P, N)
    for j in range(count):
        r = start + j
        xv, dtv, bv, cv = nx, ndt, nb, nc
        ahead = tl.minimum(r + 1, last)
        nx, ndt, nb, nc = _mamba2_load(x_ptr + ahead * x_stride, dt_ptr + ahead * dt_stride + h,
                                       b_ptr + ahead * bc_stride, c_ptr + ahead * bc_stride, g, h, p, mp, n, mn, P, N)
        S, y = _mamba2_step(S, xv, dtv, bv, cv, a, d, dt_bias, dt_min, dt_max, HAS_D, HAS_BIAS)
        tl.store(y_ptr + r * y_stride + h * P + p, y.to(y_ptr.dtype.element_ty), mask=mp)
        if CKPT:
            c, nxt = write_checkpoint(S, j, c, c_end, nxt, ck_pos_ptr, ck_slot_ptr, pool_ptr, (H * P * N), inner, mask)
    tl.store(ptr, S, mask=mask)


def _check_inputs(x: torch.Tensor, dt: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                  states: torch.Tensor) -> tuple[int, int, int, int]:
    """The kernels' shared checks: ``x [R, H*P]``, ``dt [R, H]``, ``B, C [R, G*N]`` (unit column
    stride; B and C one row stride) against ``states [S, H, P, N]`` fp32 contiguous. Returns
    ``(H, P, N, G)``."""
    rows = x.shape[0]
    num_heads, head_dim, n = states.shape[1:]
    groups = B.shape[1] // n
    if states.dtype != torch.float32 or not states.is_contiguous() or num_heads % max(groups, 1):
        raise ValueError(f"ssm_states must be a contiguous fp32 [S, H, P, N] tensor, got {list(states.shape)}")
    if x.shape != (rows, num_heads * head_dim) or dt.shape != (rows, num_heads) \
            or B.shape != (rows, groups * n) or C.shape != B.shape or C.stride(0) != B.stride(0):
        raise ValueError("x [R, H*P], dt [R, H], B and C [R, G*N] (one row stride) must fit ssm_states")
    if any(v.stride(1) != 1 for v in (x, dt, B, C)):
        raise ValueError("x, dt, B and C need unit column stride")
    return num_heads, head_dim, n, groups


def mamba2_state_update_fused(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                              D: torch.Tensor | None, dt_bias: torch.Tensor | None, ssm_states: torch.Tensor,
                              slots: torch.Tensor, dt_limit: tuple[float, float] | None = None,
                              chain: torch.Tensor | None = None) -> torch.Tensor:
    """``x [B, H*P]``, raw ``dt [B, H]``, ``B, C [B, G*N]`` (rows may be strided: splits of the conv
    output and the projection), ``A, D, dt_bias [H]`` fp32; ``ssm_states [S, H, P, N]`` fp32 updated in
    place at ``slots [B]`` (or along ``chain [W+1, B/W]``: the module docstring) -> ``y [B, H, P]``
    in x's dtype."""
    batch = x.shape[0]
    num_heads, head_dim, n, groups = _check_inputs(x, dt, B, C, ssm_states)
    w, chain, seqs = chain_of(chain, slots, batch)
    lo, hi = dt_limit if dt_limit is not None else (float("-inf"), float("inf"))
    y = torch.empty(batch, num_heads, head_dim, dtype=x.dtype, device=x.device)
    bp, warps = min(triton.next_power_of_2(head_dim), DECODE_TILES[0]), DECODE_TILES[1]
    _mamba2_decode_kernel[(seqs * num_heads, triton.cdiv(head_dim, bp))](
        x, x.stride(0), dt, dt.stride(0), A, B, C, B.stride(0), D if D is not None else A,
        dt_bias if dt_bias is not None else A, ssm_states, chain, chain.stride(0), y, float(lo), float(hi),
        W=w, H=num_heads, G=groups, P=head_dim, N=n, BP=bp, BN=triton.next_power_of_2(n),
        HAS_D=D is not None, HAS_BIAS=dt_bias is not None, num_warps=warps, **pdl.launch(x))
    return y


def mamba2_segments_fused(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                          D: torch.Tensor | None, dt_bias: torch.Tensor | None, states: torch.Tensor,
                          rows: torch.Tensor, starts: torch.Tensor, cu_seqlens: torch.Tensor, out: torch.Tensor,
                          dt_limit: tuple[float, float] | None = None, ckpts: SegmentCheckpoints | None = None) -> None:
    """An extend's segments through the recurrence, one launch (as ``gated_delta_decode``'s
    :func:`~hyla.model.ops.gpu.gated_delta_decode.gated_delta_segments_fused`): segment ``i`` is the
    packed tokens ``starts[i] ..`` (``cu_seqlens[i+1] - cu_seqlens[i]`` of them) of ``x [T, H*P]``,
    raw ``dt [T, H]``, ``B, C [T, G*N]``, run from ``states[rows[i]]`` (``[B, H, P, N]`` fp32,
    updated in place), its outputs written into those rows of ``out [T, H, P]``; with ``ckpts``, the
    states after given tokens written to pool rows on the way."""
    num_heads, head_dim, n, groups = _check_inputs(x, dt, B, C, states)
    segments = segments_of(rows, starts, cu_seqlens, out, (x.shape[0], num_heads, head_dim))
    if x.shape[0] == 0:  # no token: nothing to run (the kernel reads a row ahead)
        return
    lo, hi = dt_limit if dt_limit is not None else (float("-inf"), float("inf"))
    bp, warps = min(triton.next_power_of_2(head_dim), SEGMENT_TILES[0]), SEGMENT_TILES[1]
    _mamba2_segments_kernel[(segments * num_heads, triton.cdiv(head_dim, bp))](
        x, x.stride(0), dt, dt.stride(0), A, B, C, B.stride(0), D if D is not None else A,
        dt_bias if dt_bias is not None else A, states, rows, starts, cu_seqlens, out, out.stride(0), float(lo),
        float(hi), *segment_checkpoint_args(ckpts, states, rows, segments), H=num_heads, G=groups, P=head_dim, N=n,
        BP=bp, BN=triton.next_power_of_2(n), HAS_D=D is not None, HAS_BIAS=dt_bias is not None, CKPT=ckpts is not None,
        num_warps=warps, **pdl.launch(x))
