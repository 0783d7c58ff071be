"""The last projection of a layer's part and the residual add + RMSNorm after it, in one kernel:
the fused decode step at batch 1 (``MAX_ROWS``; the kernel takes up to 16 rows).

At batch 1 a decode step is a chain of small kernels, and each costs its launch gap besides its
work. A part of a layer ends ``... -> prologue -> out projection -> residual add + next RMSNorm``:
SwiGLU's ``silu(gate) * up`` before the MLP's down projection, Gated DeltaNet's gated norm before
its ``out_proj``, nothing before attention's ``o_proj``. :func:`linear_add_rms_norm` runs all three
steps in one launch, the projection split along K so that a 1024-wide output still spreads over
the GPU: one row is a GEMV on the CUDA cores, more (a batch, a verify step's chains) go to the
tensor cores padded to 16 rows. Each program computes its prologue on the fly for its slice of K,
and stores its partial sums. The last program to finish (an atomic ticket) adds the partials in a
fixed order, then does the residual add and the norm for every row. The result does not depend on
which program finishes last.

The numbers are those of the separate kernels (``norms.py``) and a GEMM, rounded where they round:
the prologue's output in the model dtype, the projection's output in it, the residual add in it.
The GEMM's fp32 sums are added in another order than cuBLAS's, so bf16 outputs may differ from
the unfused step's in the last bit.

The ticket is an int32 that is zero between launches (the last program resets it): launches that
share one must not run at the same time (one stream, as the decode step). ``MAX_ROWS`` is how many
rows take this path; the layers read it at each step, so ``MAX_ROWS = 0`` turns it off.

The same steps run their in projections (a Gated DeltaNet's or attention's fused input projection,
the MLP's gate + up) through :func:`linear`: a GEMV that holds its whole ``[BLOCK_N, K]`` slice of the
weight in registers, loaded before it waits for its input (``pdl.py``), so that with PDL the
weight streams in while the kernel before it (the previous part's norm) finishes. cuBLAS's GEMM,
which it replaces there (``IN_PROJ``), does not take part in PDL: the kernel after a GEMM starts
only when it has ended.

FP8 weights (``float8_e4m3fn`` with fp32 block scales, ``hyla/model/quantization.py``) take
:func:`linear` and :func:`expert_linear` as they are (:func:`scale_args`: their arguments): a program
dequantizes the slice it holds (each element times its block's scale, rounded to the model dtype) and
goes on as with a weight in that dtype, having read a byte per weight instead of two. More rows take
``fp8.py``'s GEMM.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hyla.model.ops.gpu import pdl

# Measured on an H100 (benchmarks/out_projection.py, docs/benchmarks.md "GPU decode: out projection"):
# at one row the constants below make the fused kernel 1.15-1.19x faster than the separate kernels
# (5.8-7.4 µs a call); at 2-4 rows it was 0.46-0.87x as fast, so only batch-1 steps take it.
MAX_ROWS = 1  # decode steps of at most this many rows (tokens) run their out projections here
BLOCK_N = 16  # output columns per program (at least 16 with more than one row: tl.dot's minimum)
BLOCK_K = 256  # K per step of a program's loop (Gated DeltaNet's prologue: one head, whatever this says)
MIN_PROGRAMS = 528  # the K split is chosen to give at least this many programs (4 per SM on an H100: a
# program has two weight tiles in flight at a time, so the SMs need several each to keep HBM busy)
MAX_SPLIT_K = 16  # the last program reads MAX_SPLIT_K partial rows of N fp32 per row: a serial tail
NUM_WARPS = 2

PROLOGUES = ("plain", "silu_mul", "gated_norm")  # PROLOGUE in the kernel: the index

# the in projections of the same steps (linear). Not yet timed on a GPU: IN_PROJ = False gives them
# back to cuBLAS (benchmarks/gpu_decode.py --gemv-in 0|1; out_projection.py times both per projection)
IN_PROJ = True
LINEAR_TILE = (8192, 4)  # weight elements a program holds (its [BLOCK_N, K] slice: K padded to a power of
# two, BLOCK_N >= 2, so K <= 4,096), warps per program: 1,028 programs for the benchmark model's Gated
# DeltaNet in projection (8,224 x 1,024), 16 KB of bf16 each, all in flight before the wait


@triton.jit
def _linear_add_rms_norm_kernel(x_ptr, x_stride, z_ptr, z_stride, gw_ptr, g_eps, w_ptr, w_stride_n, w_stride_k,
                                part_ptr, ticket_ptr,
                                r_ptr, scale_ptr, y_ptr, s_ptr, M, N, K, eps,
                                PROLOGUE: tl.constexpr, ROUND: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr,
                                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_SPLIT: tl.constexpr,
                                SPLIT_K: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    m = tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    kk = tl.arange(0, BLOCK_K)
    m_mask = m < M
    n_mask = n < N
    dtype = r_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    # the weight tiles, each loaded one step ahead (the loop carries it), so that two are in flight:
    # Triton does not pipeline these loads itself, and HBM needs many bytes in flight per SM
    w_rows = w_ptr + n[:, None] * w_stride_n
    k = pid_k * K_SPLIT + kk
    w_next = tl.load(w_rows + k[None, :] * w_stride_k, mask=n_mask[:, None] & (k < K)[None, :], other=0.0)
    pdl.wait(PDL)  # the first weight tile is on its way: now the inputs (pdl.py)
    for i in range(0, K_SPLIT, BLOCK_K):
        k = pid_k * K_SPLIT + i + kk
        w = w_next
        ahead = k + BLOCK_K
        w_next = tl.load(w_rows + ahead[None, :] * w_stride_k,
                         mask=n_mask[:, None] & ((ahead < K) & (i + BLOCK_K < K_SPLIT))[None, :], other=0.0)
        mk = m_mask[:, None] & (k < K)[None, :]
        x = tl.load(x_ptr + m[:, None] * x_stride + k[None, :], mask=mk, other=0.0)
        if PROLOGUE == 1:  # SwiGLU: x holds [gate | up]; silu in the dtype, then the product in it
            up = tl.load(x_ptr + m[:, None] * x_stride + K + k[None, :], mask=mk, other=0.0)
            g = x.to(tl.float32)
            sg = (g * tl.sigmoid(g)).to(x.dtype)
            x = (sg.to(tl.float32) * up.to(tl.float32)).to(x.dtype)
        elif PROLOGUE == 2:  # Gated DeltaNet's (w * norm(x)) * silu(z), one head per step (BLOCK_K = head dim)
            x32 = x.to(tl.float32)
            z = tl.load(z_ptr + m[:, None] * z_stride + k[None, :], mask=mk, other=0.0).to(tl.float32)
            gw = tl.load(gw_ptr + kk)
            nx = x32 * tl.rsqrt(tl.sum(x32 * x32, axis=1) / BLOCK_K + g_eps)[:, None]
            if ROUND:  # as GatedRMSNorm: norm -> dtype, the weight times it in the dtype, then * silu(z) in fp32
                gy = (gw.to(tl.float32)[None, :] * nx.to(gw.dtype).to(tl.float32)).to(gw.dtype).to(tl.float32)
            else:
                gy = gw.to(tl.float32)[None, :] * nx
            x = (gy * (z * tl.sigmoid(z))).to(x.dtype)
        if BLOCK_M == 1:  # a GEMV
            acc += tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
        elif IEEE:  # rows padded to 16 and the dot in fp32: exact products (fp32 inputs: not tf32)
            acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        else:  # bf16/fp16 inputs are exact in tf32: the tensor cores, the same products (fp32 operands
            # also keep Triton's interpreter right, whose bf16 dot is not)
            acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="tf32")
    tl.store(part_ptr + pid_k * M * N + m[:, None] * N + n[None, :], acc, mask=m_mask[:, None] & n_mask[None, :])

    # the last program to get here: partials -> the projection's output, the residual add, the norm
    tl.debug_barrier()  # every thread's partial stores before the ticket's release
    ticket = tl.atomic_add(ticket_ptr, 1, sem="acq_rel")
    if ticket == tl.num_programs(0) * tl.num_programs(1) - 1:
        d = tl.arange(0, BLOCK_D)
        dm = d < N
        scale = tl.load(scale_ptr + d, mask=dm, other=0.0)
        for row in range(0, M):
            o = tl.zeros([BLOCK_D], dtype=tl.float32)
            for sk in tl.static_range(SPLIT_K):  # a fixed order: the same sums whoever finishes last
                o += tl.load(part_ptr + (sk * M + row) * N + d, mask=dm, other=0.0, cache_modifier=".cg")
            r = tl.load(r_ptr + row * N + d, mask=dm, other=0.0)
            s = (r.to(tl.float32) + o.to(dtype).to(tl.float32)).to(dtype)  # the residual add, rounded as x + r
            tl.store(s_ptr + row * N + d, s, mask=dm)
            s32 = s.to(tl.float32)
            inv = tl.rsqrt(tl.sum(s32 * s32, axis=0) / N + eps)
            tl.store(y_ptr + row * N + d, (s32 * inv * scale).to(dtype), mask=dm)
        tl.atomic_xchg(ticket_ptr, 0)  # zero for the next launch


@triton.jit
def _linear_kernel(x_ptr, x_stride, w_ptr, w_stride_n, w_stride_k, s_ptr, s_stride_n, s_stride_k, y_ptr, M, N, K,
                   FP8: tl.constexpr, QBLOCK_N: tl.constexpr, QBLOCK_K: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    n_mask, k_mask = n < N, k < K
    # the program's whole slice of the weight, before the wait: no kernel writes it (pdl.py)
    w = tl.load(w_ptr + n[:, None] * w_stride_n + k[None, :] * w_stride_k, mask=n_mask[:, None] & k_mask[None, :],
                other=0.0)  # [BLOCK_N, BLOCK_K]
    if FP8:  # each element times its block's scale (a parameter too), rounded to the model dtype as the model reads it
        s = tl.load(s_ptr + (n // QBLOCK_N)[:, None] * s_stride_n + (k // QBLOCK_K)[None, :] * s_stride_k,
                    mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        w = (w.to(tl.float32) * s).to(x_ptr.dtype.element_ty)
    pdl.wait(PDL)
    for row in range(0, M):
        x = tl.load(x_ptr + row * x_stride + k, mask=k_mask, other=0.0).to(tl.float32)  # [BLOCK_K]
        y = tl.sum(w.to(tl.float32) * x[None, :], axis=1)  # fp32 sums, rounded once to the output dtype (as cuBLAS)
        tl.store(y_ptr + row * N + n, y.to(y_ptr.dtype.element_ty), mask=n_mask)


def _tile(k: int) -> tuple[int, int]:
    """``(BLOCK_N, BLOCK_K)`` of :func:`linear`'s GEMV for a K: a program holds whole rows (K padded to
    a power of two), as many as ``LINEAR_TILE``'s elements take."""
    block_k = triton.next_power_of_2(k)
    return LINEAR_TILE[0] // block_k, block_k


def linear_fits(weight: torch.Tensor) -> bool:
    """Whether :func:`linear` takes ``weight [N, K]`` (in any dtype it takes): K at most
    ``LINEAR_TILE[0] / 2`` (a program holds two or more whole rows)."""
    return weight.dim() == 2 and 2 * triton.next_power_of_2(weight.shape[1]) <= LINEAR_TILE[0]


FP8_DTYPE = torch.float8_e4m3fn  # the weight-only FP8 projections' weights (hyla/model/quantization.py)
FP8_X_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # the model dtypes they compute in


def scale_args(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None,
               block: tuple[int, int] | None) -> tuple[torch.Tensor, tuple[int, ...], dict]:
    """The scale arguments of a projection kernel that takes FP8 weights (:func:`linear`,
    :func:`expert_linear`, ``moe.expert_gemm``, ``fp8.linear``): ``(scale, its strides, constexprs
    FP8, QBLOCK_N, QBLOCK_K)``. An FP8 ``weight [..., N, K]`` (float8_e4m3fn) needs ``block = (bn,
    bk)`` and its fp32 ``scale [..., ceil(N / bn), ceil(K / bk)]`` (any strides): element ``(n, k)``
    is ``weight[..., n, k] * scale[..., n // bn, k // bk]`` (``Fp8Scheme(block).dequantize``), which
    the kernels round to x's dtype before they multiply. A weight in x's dtype takes neither: the
    weight stands in for the pointer the kernel does not read. ``ValueError`` otherwise."""
    if weight.dtype != FP8_DTYPE:
        if scale is not None or block is not None:
            raise ValueError(f"scale and block go with a float8_e4m3fn weight, got a {weight.dtype} one")
        return weight, (0,) * weight.dim(), dict(FP8=False, QBLOCK_N=1, QBLOCK_K=1)
    if scale is None or block is None:
        raise ValueError("a float8_e4m3fn weight needs its scale and block")
    if (not isinstance(block, (tuple, list)) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise ValueError(f"block must be two positive ints (bn, bk), got {block!r}")
    bn, bk = block
    want = (*weight.shape[:-2], triton.cdiv(weight.shape[-2], bn), triton.cdiv(weight.shape[-1], bk))
    if scale.dtype != torch.float32 or tuple(scale.shape) != want or scale.device != weight.device:
        raise ValueError(f"the scale of a {list(weight.shape)} weight in blocks of {(bn, bk)} must be fp32 {list(want)} "
                         f"on its device, got {scale.dtype} {list(scale.shape)}")
    if x.dtype not in FP8_X_DTYPES:
        raise ValueError(f"FP8 weights compute in x's dtype, one of {FP8_X_DTYPES}, got {x.dtype}")
    return scale, scale.stride(), dict(FP8=True, QBLOCK_N=bn, QBLOCK_K=bk)


def linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None,
           block: tuple[int, int] | None = None) -> torch.Tensor:
    """``x @ weight.T`` for a few rows (``x [M, K]`` with unit column stride, ``weight [N, K]`` in x's
    dtype, any strides, no bias; :func:`linear_fits`) -> ``[M, N]``: each program holds a
    ``[BLOCK_N, K]`` slice of the weight and computes its columns for every row (the module
    docstring). fp32 sums in another order than cuBLAS's: bf16 outputs may differ in the last bit.
    An FP8 weight (float8_e4m3fn) comes with its ``scale`` and ``block`` (:func:`scale_args`): the
    slice dequantized and rounded to x's dtype, then the same, so the result is
    ``F.linear(x, Fp8Scheme(block).dequantize(weight, scale).to(x.dtype))``'s.
    Launched with PDL the kernel reads ``weight`` (and ``scale``) before it waits for the kernel before
    it (``pdl.py``): parameters as the module holds them, never values computed in the step."""
    if weight.dim() != 2 or x.dim() != 2 or x.shape[1] != weight.shape[1] or x.stride(1) != 1:
        raise ValueError(f"x must be [M, K] with unit column stride and weight [N, K], got {list(x.shape)} "
                         f"and {list(weight.shape)}")
    if weight.dtype not in (x.dtype, FP8_DTYPE) or not linear_fits(weight):
        raise ValueError(f"weight must be in x's dtype {x.dtype} (or float8_e4m3fn) with K <= {LINEAR_TILE[0] // 2}, "
                         f"got {weight.dtype} [{weight.shape[0]}, {weight.shape[1]}]")
    s, s_strides, fp8 = scale_args(x, weight, scale, block)
    (m, k), n = x.shape, weight.shape[0]
    block_n, block_k = _tile(k)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    _linear_kernel[(triton.cdiv(n, block_n),)](
        x, x.stride(0), weight, weight.stride(0), weight.stride(1), s, *s_strides, y, m, n, k, **fp8,
        BLOCK_N=block_n, BLOCK_K=block_k, num_warps=LINEAR_TILE[1], **pdl.launch(x))
    return y


@triton.jit
def _expert_linear_kernel(x_ptr, x_stride, e_ptr, w_ptr, w_stride_e, w_stride_n, w_stride_k,
                          s_ptr, s_stride_e, s_stride_n, s_stride_k, y_ptr, N, K,
                          FP8: tl.constexpr, QBLOCK_N: tl.constexpr, QBLOCK_K: tl.constexpr,
                          PER_ROW: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    a = tl.program_id(1)  # the assignment: its expert, and x's row a // PER_ROW
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    n_mask, k_mask = n < N, k < K
    pdl.wait(PDL)  # the expert ids come from the step (the router's top-k): nothing is read before
    e = tl.load(e_ptr + a).to(tl.int64)
    w = tl.load(w_ptr + e * w_stride_e + n[:, None] * w_stride_n + k[None, :] * w_stride_k,
                mask=n_mask[:, None] & k_mask[None, :], other=0.0)  # [BLOCK_N, BLOCK_K] of its expert
    if FP8:  # dequantized with its expert's scales, rounded to the model dtype (as linear)
        s = tl.load(s_ptr + e * s_stride_e + (n // QBLOCK_N)[:, None] * s_stride_n
                    + (k // QBLOCK_K)[None, :] * s_stride_k, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        w = (w.to(tl.float32) * s).to(x_ptr.dtype.element_ty)
    x = tl.load(x_ptr + (a // PER_ROW) * x_stride + k, mask=k_mask, other=0.0).to(tl.float32)  # [BLOCK_K]
    y = tl.sum(w.to(tl.float32) * x[None, :], axis=1)  # fp32 sums, rounded once to the output dtype
    tl.store(y_ptr + a * N + n, y.to(y_ptr.dtype.element_ty), mask=n_mask)


def expert_linear(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, per_row: int = 1,
                  scale: torch.Tensor | None = None, block: tuple[int, int] | None = None) -> torch.Tensor:
    """``x[a // per_row] @ weights[experts[a]].T`` for each assignment ``a`` of a MoE step (``x [A /
    per_row, K]`` with unit column stride: the tokens, ``per_row = k``, for the experts' in projection,
    each assignment reading its token's row; the assignments, ``per_row = 1``, for their out
    projection), stacked expert weights ``weights [E, N, K]`` in x's dtype with K as :func:`linear`
    takes it, any strides, ``experts [A]`` integer ids) -> ``[A, N]``: :func:`linear`'s GEMV with each
    program reading its assignment's expert in place (a batched GEMM would need the chosen experts'
    weights gathered into a copy first). FP8 weights (float8_e4m3fn) come with ``scale [E, ceil(N /
    bn), ceil(K / bk)]`` and ``block`` (:func:`scale_args`), each expert's slice dequantized and rounded
    to x's dtype as in :func:`linear`. The ids are the step's own (the router's top-k): launched
    with PDL the kernel waits before it reads anything (``pdl.py``)."""
    if weights.dim() != 3 or x.dim() != 2 or x.shape[1] != weights.shape[2] or x.stride(1) != 1 \
            or per_row < 1 or experts.shape != (x.shape[0] * per_row,):
        raise ValueError(f"x must be [A / per_row, K] with unit column stride, weights [E, N, K] and experts [A], "
                         f"got {list(x.shape)}, {list(weights.shape)} and {list(experts.shape)} (per_row {per_row})")
    if weights.dtype not in (x.dtype, FP8_DTYPE) or not linear_fits(weights[0]) \
            or experts.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"weights must be in x's dtype {x.dtype} (or float8_e4m3fn) with K <= {LINEAR_TILE[0] // 2}, "
                         f"and experts integer ids, got {weights.dtype} {list(weights.shape)}, {experts.dtype}")
    s, s_strides, fp8 = scale_args(x, weights, scale, block)
    m, k, n = experts.shape[0], x.shape[1], weights.shape[1]
    block_n, block_k = _tile(k)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m:
        _expert_linear_kernel[(triton.cdiv(n, block_n), m)](
            x, x.stride(0), experts, weights, weights.stride(0), weights.stride(1), weights.stride(2), s, *s_strides,
            y, n, k, **fp8, PER_ROW=per_row, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=LINEAR_TILE[1],
            **pdl.launch(x))
    return y


def split_k(n: int, k: int, block_n: int, block_k: int) -> tuple[int, int]:
    """``(splits, K per split)`` for an ``[N, K]`` projection in blocks of ``block_n`` columns:
    enough splits to give ``MIN_PROGRAMS`` programs, each a whole number of ``block_k`` steps."""
    steps = triton.cdiv(k, block_k)
    want = min(MAX_SPLIT_K, steps, max(1, triton.cdiv(MIN_PROGRAMS, triton.cdiv(n, block_n))))
    per = triton.cdiv(steps, want) * block_k
    return triton.cdiv(k, per), per


def linear_add_rms_norm(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, scale: torch.Tensor,
                        eps: float, ticket: torch.Tensor, prologue: str = "plain",
                        gate: tuple[torch.Tensor, torch.Tensor, float] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``s = residual + linear(p(x), weight)`` and ``y = rms_norm(s) * scale``; returns ``(y, s)``.

    ``p`` is the prologue: ``"plain"`` (``x [M, K]``), ``"silu_mul"`` (``x [M, 2K] = [gate | up]``:
    ``silu(gate) * up``, as ``norms.silu_mul_fused``) or ``"gated_norm"`` (``x [M, K]`` in heads of
    ``D``, ``gate = (z [M, K], w [D], gate_eps)``: ``(w * norm(x)) * silu(z)`` per head, as
    ``norms.gated_rms_norm_fused``). ``weight [N, K]`` (any strides: CPU weights are column-major), no bias; ``residual [M, N]``
    contiguous; ``scale`` fp32 ``[N]``; ``ticket`` a zeroed int32 ``[1]`` on the device (see the
    module docstring). Rows of ``x`` and ``z`` may be strided (splits of a projection). Launched with
    PDL the kernel reads its first tile of ``weight`` before its wait (``pdl.py``): a parameter as the
    module holds it, never a value computed in the step (``scale`` and the gate's ``w`` come after)."""
    if prologue not in PROLOGUES:
        raise ValueError(f"prologue must be one of {PROLOGUES}, got {prologue!r}")
    n, k = weight.shape
    m = residual.shape[0]
    width = 2 * k if prologue == "silu_mul" else k
    if x.dim() != 2 or x.shape != (m, width) or x.stride(1) != 1 or x.dtype != residual.dtype:
        raise ValueError(f"x must be [{m}, {width}] in {residual.dtype} with unit column stride, "
                         f"got {list(x.shape)} {x.dtype}")
    if weight.dtype != x.dtype or residual.shape != (m, n) or not residual.is_contiguous():
        raise ValueError(f"weight must be [N, K] in x's dtype and residual a contiguous [{m}, {n}]")
    if scale.dtype != torch.float32 or scale.shape != (n,) or not scale.is_contiguous():
        raise ValueError(f"scale must be a contiguous fp32 [{n}] tensor, got {list(scale.shape)} {scale.dtype}")
    if ticket.dtype != torch.int32 or ticket.numel() != 1 or ticket.device != x.device:
        raise ValueError("ticket must be an int32 [1] on x's device")
    block_k, z, gw, g_eps = BLOCK_K, x, scale, 0.0
    if prologue == "gated_norm":
        if gate is None:
            raise ValueError("the gated_norm prologue needs gate = (z, weight, eps)")
        z, gw, g_eps = gate
        block_k = gw.numel()
        if (z.shape != x.shape or z.stride(1) != 1 or gw.shape != (block_k,) or k % block_k
                or block_k & (block_k - 1)):
            raise ValueError(f"gated_norm: z must be x's shape {list(x.shape)} with unit column stride and "
                             f"the weight [D] with D a power of two dividing {k}, got {list(z.shape)}, {list(gw.shape)}")
    block_n = BLOCK_N if m == 1 else max(BLOCK_N, 16)
    splits, per = split_k(n, k, block_n, block_k)
    part = torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
    y, s = torch.empty_like(residual), torch.empty_like(residual)
    _linear_add_rms_norm_kernel[(triton.cdiv(n, block_n), splits)](
        x, x.stride(0), z, z.stride(0), gw, g_eps, weight, weight.stride(0), weight.stride(1), part, ticket, residual, scale, y, s, m, n, k, eps,
        PROLOGUE=PROLOGUES.index(prologue), ROUND=x.dtype != torch.float32, IEEE=x.dtype == torch.float32,
        BLOCK_M=1 if m == 1 else max(16, triton.next_power_of_2(m)),
        BLOCK_N=block_n, BLOCK_K=block_k, K_SPLIT=per, SPLIT_K=splits, BLOCK_D=triton.next_power_of_2(n),
        num_warps=NUM_WARPS, **pdl.launch(x))
    return y, s
