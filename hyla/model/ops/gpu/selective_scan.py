"""Mamba1's selective scan (Jamba's SSM layers) as Triton kernels: the decode step (and a verify
step's chains) and an extend's segments, in place on the fp32 state pool, the layer's gate fused in.

Reference: :mod:`hyla.model.ops.selective_scan` (``selective_state_update``,
``selective_scan_varlen``; the same contracts). Per channel ``d`` with state ``h_d [N]`` and a
decay per channel and state ``A [I, N]``::

    dt  = softplus(dt + dt_bias)                                   (fp32)
    h_d <- exp(dt_d A_d) * h_d + dt_d x_d B_t;    y_d = h_d . C_t + D_d x_d
    out = y * silu(z)          (with the gate z: y rounded to x's dtype first, as the layer rounds it)

Each program owns one ``(sequence or segment, block of BD channels)`` of the state, ``[BD, N]`` in
registers, and runs its tokens in order (``_mamba1_step``, shared by both kernels: a state is the
same whether its tokens came as decode steps or an extend, bitwise). A decay per state column
leaves no matrix form to chunk (as Mamba2's SSD has, ``mamba2_chunks``): the extend kernel is the
recurrence token by token, as mamba-ssm's ``selective_scan`` runs it per thread, each token's inputs
loaded while the token before it is computed.

* :func:`selective_state_update_fused` — a decode step; ``chain [W+1, S]`` (a speculative verify
  step, ``ForwardBatch.chain_slots``): ``S`` sequences of ``W`` tokens (row ``i*W + j``), the state
  written after token ``j`` at ``chain[j+1, i]`` (``-1``: not written), ``chain[0, i]`` read;
  ``slots[i] == -1``: a zero state, nothing written, the row's output don't-care.
* :func:`selective_scan_segments_fused` — an extend's segments from pool rows, checkpoints written
  on the way (``segment_checkpoints``); :func:`segment_kernel` wraps it for ``fla_chunk``'s
  ``scan_in_rounds`` and the fused extend; :func:`selective_scan_extend_fused` runs a whole batch
  (its ``VarlenPlan``) in one launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hyla.model.ops.gpu import chain_of, pdl, segments_of
from hyla.model.ops.gpu.fla_chunk import scan_in_rounds
from hyla.model.ops.gpu.mamba2_decode import _mamba2_dt
from hyla.model.ops.gpu.segment_checkpoints import (
    INDEX_ARGS,
    SegmentCheckpoints,
    first_checkpoint,
    open_segment,
    segment_checkpoint_args,
    write_checkpoint,
)
from hyla.model.ops.selective_scan import check_inputs
from hyla.model.ops.varlen import VarlenPlan

# (channels per program, warps) of the decode and the segments kernels: a program runs the
# recurrence on a [BD, N] block (Jamba: N = 16). Read at each launch. Not yet timed on a GPU: the
# decode kernel's blocks give Jamba-1.5-Mini's 8,192 channels 128 programs a sequence; the segments
# kernel's smaller ones twice as many, for a prefill's one sequence (each token a chain of dependent
# steps, which more programs run side by side).
DECODE_TILES = (64, 4)
SEGMENT_TILES = (32, 2)


@triton.jit
def _mamba1_load(x_row, dt_row, z_row, b_row, c_row, d, md, n, mn, HAS_Z: tl.constexpr):
    """A token's inputs as stored: ``x, dt, z [BD]`` (``z`` = ``x`` without the gate), ``B, C [BN]``."""
    x = tl.load(x_row + d, mask=md, other=0.0)
    dt = tl.load(dt_row + d, mask=md, other=0.0)
    z = tl.load(z_row + d, mask=md, other=0.0) if HAS_Z else x
    return x, dt, z, tl.load(b_row + n, mask=mn, other=0.0), tl.load(c_row + n, mask=mn, other=0.0)


@triton.jit
def _mamba1_step(S, x, dt, z, bv, cv, a, dskip, dt_bias, out_ty: tl.constexpr, HAS_D: tl.constexpr,
                 HAS_BIAS: tl.constexpr, HAS_Z: tl.constexpr):
    """One token on a ``[BD, BN]`` block of the fp32 state with the loaded inputs (``a [BD, BN]`` =
    A, ``dskip, dt_bias [BD]`` fp32). Returns ``(S, out [BD])``, ``out`` in ``out_ty``."""
    x = x.to(tl.float32)
    dt = _mamba2_dt(dt, dt_bias, float("-inf"), float("inf"), HAS_BIAS)  # softplus(dt + dt_bias), no clamp
    S = S * tl.exp(dt[:, None] * a) + (dt * x)[:, None] * bv.to(tl.float32)[None, :]
    y = tl.sum(S * cv.to(tl.float32)[None, :], axis=1)
    if HAS_D:
        y += dskip * x
    if HAS_Z:  # the layer's gate on y as it rounds it: (y in x's dtype) * silu(z), in fp32
        zf = z.to(tl.float32)
        y = y.to(out_ty).to(tl.float32) * (zf * tl.sigmoid(zf))
    return S, y.to(out_ty)


@triton.jit
def _mamba1_program(a_ptr, d_ptr, dt_bias_ptr, I: tl.constexpr, N: tl.constexpr, BD: tl.constexpr,
                    BN: tl.constexpr):
    """A program's share: sequence (or segment) ``i``, its channels ``d`` and the state columns ``n``
    (and their masks), ``A [BD, BN]``, D and the dt bias ``[BD]`` in fp32 (the wrappers pass A's
    pointer for a missing D or dt bias), and the block's offsets in a state row."""
    i = tl.program_id(0)
    d = tl.program_id(1) * BD + tl.arange(0, BD)
    n = tl.arange(0, BN)
    md, mn = d < I, n < N
    inner = d[:, None] * N + n[None, :]
    mask = md[:, None] & mn[None, :]
    a = tl.load(a_ptr + inner, mask=mask, other=0.0).to(tl.float32)
    dskip = tl.load(d_ptr + d, mask=md, other=0.0).to(tl.float32)
    dt_bias = tl.load(dt_bias_ptr + d, mask=md, other=0.0).to(tl.float32)
    return i, d, md, n, mn, inner, mask, a, dskip, dt_bias


@triton.jit(do_not_specialize=["chain_stride"], do_not_specialize_on_alignment=["chain_ptr"])
def _mamba1_decode_kernel(x_ptr, x_stride, dt_ptr, dt_stride, z_ptr, z_stride, a_ptr, b_ptr, b_stride, c_ptr,
                          c_stride, d_ptr, dt_bias_ptr, state_ptr, chain_ptr, chain_stride, y_ptr,
                          W: tl.constexpr, I: tl.constexpr, N: tl.constexpr, BD: tl.constexpr, BN: tl.constexpr,
                          HAS_D: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_Z: tl.constexpr, PDL: tl.constexpr):
    pdl.wait(PDL)  # (pdl.py) before _mamba1_program: A is -exp(A_log), derived in the step, not a parameter
    i, d, md, n, mn, inner, mask, a, dskip, dt_bias = _mamba1_program(a_ptr, d_ptr, dt_bias_ptr, I, N, BD, BN)
    slot = tl.load(chain_ptr + i).to(tl.int64)
    live = mask & ((tl.zeros([BD, BN], dtype=tl.int64) + slot) >= 0)  # a block mask
    S = tl.load(state_ptr + slot * (I * N) + inner, mask=live, other=0.0)  # [BD, BN] fp32
    for j in tl.static_range(W):  # the sequence's tokens in order (a decode step: one)
        r = i * W + j
        x, dt, z, bv, cv = _mamba1_load(x_ptr + r * x_stride, dt_ptr + r * dt_stride, z_ptr + r * z_stride,
                                        b_ptr + r * b_stride, c_ptr + r * c_stride, d, md, n, mn, HAS_Z)
        S, y = _mamba1_step(S, x, dt, z, bv, cv, a, dskip, dt_bias, y_ptr.dtype.element_ty, HAS_D, HAS_BIAS, HAS_Z)
        dst = tl.load(chain_ptr + (j + 1) * chain_stride + i).to(tl.int64)
        live_dst = mask & ((tl.zeros([BD, BN], dtype=tl.int64) + dst) >= 0)
        tl.store(state_ptr + dst * (I * N) + inner, S, mask=live_dst)
        tl.store(y_ptr + r * I + d, y, mask=md)


@triton.jit(do_not_specialize_on_alignment=INDEX_ARGS)
def _mamba1_segments_kernel(x_ptr, x_stride, dt_ptr, dt_stride, z_ptr, z_stride, a_ptr, b_ptr, b_stride, c_ptr,
                            c_stride, d_ptr, dt_bias_ptr, state_ptr, rows_ptr, starts_ptr, cu_ptr, y_ptr, y_stride,
                            pool_ptr, ck_off_ptr, ck_pos_ptr, ck_slot_ptr,
                            I: tl.constexpr, N: tl.constexpr, BD: tl.constexpr, BN: tl.constexpr,
                            HAS_D: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_Z: tl.constexpr, CKPT: tl.constexpr,
                            PDL: tl.constexpr):
    pdl.wait(PDL)  # (pdl.py)
    # segment i: packed tokens starts[i] .. + (cu[i+1] - cu[i]), from state row rows[i]
    i, d, md, n, mn, inner, mask, a, dskip, dt_bias = _mamba1_program(a_ptr, d_ptr, dt_bias_ptr, I, N, BD, BN)
    start, count, ptr, S = open_segment(state_ptr, rows_ptr, starts_ptr, cu_ptr, i, I * N, inner, mask)  # fp32
    if CKPT:  # the segment's checkpoints c .. c_end, the next one after nxt tokens (0: none left)
        c, c_end, nxt = first_checkpoint(ck_off_ptr, ck_pos_ptr, i)
    # the tokens in order, each one's inputs loaded a token ahead (the row ahead clamped to the last)
    last = tl.maximum(start + count - 1, 0)
    first = tl.minimum(start, last)
    nx, ndt, nz, nb, nc = _mamba1_load(x_ptr + first * x_stride, dt_ptr + first * dt_stride, z_ptr + first * z_stride,
                                       b_ptr + first * b_stride, c_ptr + first * c_stride, d, md, n, mn, HAS_Z)
    for j in range(count):
        r = start + j
        x, dt, z, bv, cv = nx, ndt, nz, nb, nc
        ahead = tl.minimum(r + 1, last)
        nx, ndt, nz, nb, nc = _mamba1_load(x_ptr + ahead * x_stride, dt_ptr + ahead * dt_stride,
                                           z_ptr + ahead * z_stride, b_ptr + ahead * b_stride,
                                           c_ptr + ahead * c_stride, d, md, n, mn, HAS_Z)
        S, y = _mamba1_step(S, x, dt, z, bv, cv, a, dskip, dt_bias, y_ptr.dtype.element_ty, HAS_D, HAS_BIAS, HAS_Z)
        tl.store(y_ptr + r * y_stride + d, y, mask=md)
        if CKPT:
            c, nxt = write_checkpoint(S, j, c, c_end, nxt, ck_pos_ptr, ck_slot_ptr, pool_ptr, I * N, inner, mask)
    tl.store(ptr, S, mask=mask)


def _checked(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
             D: torch.Tensor | None, dt_bias: torch.Tensor | None, z: torch.Tensor | None,
             states: torch.Tensor) -> tuple[int, int]:
    """The kernels' shared checks (the reference's shapes, ``ops.selective_scan.check_inputs``, and
    what the kernels read): ``x``, ``dt``, ``z [R, I]`` and ``B, C [R, N]`` with unit column stride
    (rows may be strided: splits of a projection), ``A [I, N]`` and ``states [S, I, N]`` contiguous
    fp32. Returns ``(I, N)``."""
    check_inputs(x, dt, A, B, C, D, dt_bias, states)
    if z is not None and z.shape != x.shape:
        raise ValueError(f"z must be shaped as x {list(x.shape)}, got {list(z.shape)}")
    if states.dtype != torch.float32 or not states.is_contiguous() or A.dtype != torch.float32 \
            or not A.is_contiguous():
        raise ValueError("ssm_states and A must be contiguous fp32 tensors")
    if any(v.stride(1) != 1 for v in (x, dt, B, C, *(() if z is None else (z,)))):
        raise ValueError("x, dt, z, B and C need unit column stride")
    return A.shape


def _launch_args(x, dt, z, A, B, C, D, dt_bias) -> tuple:
    """``x, dt, z, A, B, C, D, dt bias`` with their row strides as the kernels take them (``z``: x's
    pointer without a gate; D and the dt bias: A's without them)."""
    z = x if z is None else z
    return (x, x.stride(0), dt, dt.stride(0), z, z.stride(0), A, B, B.stride(0), C, C.stride(0),
            D if D is not None else A, dt_bias if dt_bias is not None else A)


def selective_state_update_fused(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                                 D: torch.Tensor | None, dt_bias: torch.Tensor | None, ssm_states: torch.Tensor,
                                 slots: torch.Tensor, z: torch.Tensor | None = None,
                                 chain: torch.Tensor | None = None) -> torch.Tensor:
    """``x``, raw ``dt [B, I]``, ``B, C [B, N]``, ``A [I, N]`` and ``D, dt_bias [I]`` fp32;
    ``ssm_states [S, I, N]`` fp32 updated in place at ``slots [B]`` (or along ``chain [W+1, B/W]``:
    the module docstring) -> ``y [B, I]`` in x's dtype, or with the gate ``z [B, I]``, ``y *
    silu(z)``."""
    rows = x.shape[0]
    channels, n = _checked(x, dt, A, B, C, D, dt_bias, z, ssm_states)
    w, chain, seqs = chain_of(chain, slots, rows)
    y = torch.empty(rows, channels, dtype=x.dtype, device=x.device)
    bd, warps = min(triton.next_power_of_2(channels), DECODE_TILES[0]), DECODE_TILES[1]
    _mamba1_decode_kernel[(seqs, triton.cdiv(channels, bd))](
        *_launch_args(x, dt, z, A, B, C, D, dt_bias), ssm_states, chain, chain.stride(0), y,
        W=w, I=channels, N=n, BD=bd, BN=triton.next_power_of_2(n), HAS_D=D is not None,
        HAS_BIAS=dt_bias is not None, HAS_Z=z is not None, num_warps=warps, **pdl.launch(x))
    return y


def selective_scan_segments_fused(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                                  C: torch.Tensor, D: torch.Tensor | None, dt_bias: torch.Tensor | None,
                                  states: torch.Tensor, rows: torch.Tensor, starts: torch.Tensor,
                                  cu_seqlens: torch.Tensor, out: torch.Tensor, z: torch.Tensor | None = None,
                                  ckpts: SegmentCheckpoints | None = None) -> None:
    """An extend's segments through the recurrence, one launch (``mamba2_decode.mamba2_segments_fused``'s
    contract): segment ``i`` is the packed tokens ``starts[i] ..`` (``cu_seqlens[i+1] - cu_seqlens[i]``
    of them) of ``x``, raw ``dt [T, I]``, ``B, C [T, N]``, run from ``states[rows[i]]`` (``[R, I, N]``
    fp32, updated in place), its outputs (gated by ``z [T, I]`` where given) written into those rows
    of ``out [T, I]`` (dense rows, which may be strided); with ``ckpts``, the states after given
    tokens written to pool rows on the way."""
    channels, n = _checked(x, dt, A, B, C, D, dt_bias, z, states)
    if out.dim() != 2:
        raise ValueError(f"out must be [T, I], got {list(out.shape)}")
    segments = segments_of(rows, starts, cu_seqlens, out.unsqueeze(1), (x.shape[0], 1, channels))
    if x.shape[0] == 0:  # no token: nothing to run (the kernel reads a row ahead)
        return
    bd, warps = min(triton.next_power_of_2(channels), SEGMENT_TILES[0]), SEGMENT_TILES[1]
    _mamba1_segments_kernel[(segments, triton.cdiv(channels, bd))](
        *_launch_args(x, dt, z, A, B, C, D, dt_bias), states, rows, starts, cu_seqlens, out, out.stride(0),
        *segment_checkpoint_args(ckpts, states, rows, segments), I=channels, N=n, BD=bd,
        BN=triton.next_power_of_2(n), HAS_D=D is not None, HAS_BIAS=dt_bias is not None, HAS_Z=z is not None,
        CKPT=ckpts is not None, num_warps=warps, **pdl.launch(x))


def segment_kernel(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                   D: torch.Tensor | None, dt_bias: torch.Tensor | None, z: torch.Tensor | None = None):
    """The layer's kernel for an extend's segments (``fla_chunk.SegmentKernel``: the fused extend's
    ``run_fused_extend_segments``, ``fla_chunk.scan_in_rounds``), on its raw per-token inputs: the
    recurrence at any length (no chunked form: the module docstring)."""
    def run(states, rows, starts, cu_seqlens, out, ckpts=None, *, longest: int) -> None:
        selective_scan_segments_fused(x, dt, A, B, C, D, dt_bias, states, rows, starts, cu_seqlens, out, z, ckpts)
    return run


def selective_scan_extend_fused(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                                D: torch.Tensor | None, dt_bias: torch.Tensor | None, ssm_states: torch.Tensor,
                                varlen: VarlenPlan, z: torch.Tensor | None = None) -> torch.Tensor:
    """An extend step's scan over its packed sequences (``ops.selective_scan.selective_scan_varlen``'s
    contract, the sequences and checkpoints as the batch's ``varlen`` plan holds them; chains only):
    ``y [T, I]`` in x's dtype (gated by ``z`` where given). Every sequence in one launch where the
    plan allows (``fla_chunk.single_pass``), else in rounds cut at the checkpoints; no device read."""
    out = torch.empty(x.shape[0], A.shape[0], dtype=x.dtype, device=x.device)
    return scan_in_rounds(None, None, (), out, ssm_states, varlen, segment_kernel(x, dt, A, B, C, D, dt_bias, z))
