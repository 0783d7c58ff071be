"""A projection whose weight stays FP8 on the GPU: ``float8_e4m3fn`` with fp32 block scales, the
format of the FP8 checkpoints (``hyla/model/quantization.py``), dequantized inside the kernels.

:func:`linear` computes ``F.linear(x, Fp8Scheme(block).dequantize(weight, scale).to(x.dtype))``
for any number of rows: each weight element times its block's scale in fp32, rounded to x's
dtype (bf16, fp16 or fp32: the model's), then products of those with x summed in fp32 and rounded
once to x's dtype; a bias is added after, in x's dtype (``y + bias``). This is weight-only
quantization (w8a16): the weights cost a byte each in memory and in every read, the arithmetic is
the model dtype's, as for an unquantized model (no FP8 tensor cores, no activation scales).

* up to ``GEMV_ROWS`` rows (decode steps), where reading the weight is the cost, it is
  ``gemv.linear``: each program holds a dequantized slice of the weight and passes every row
  over it;
* more rows (an extend), or a K past the GEMV's, take :func:`_linear_kernel`: a tiled GEMM whose
  weight tiles are dequantized to x's dtype before each ``tl.dot`` (tensor cores, fp32 sums; fp32
  inputs in IEEE fp32, as ``moe.py``).

The sums run in another order than cuBLAS's on the dequantized weight: bf16 outputs may differ in
the last bit. Not yet timed on a GPU: ``GEMV_ROWS`` and ``TILES`` are a first choice, not measured.

:func:`store_rounded` is how a kernel writes a KV buffer that may be float8 (``kv_cache_dtype``):
the value PyTorch's cast gives, so a kernel's writes and the PyTorch ops' agree to the bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hyla.model.ops.gpu import gemv, pdl


@triton.jit
def fp8_round(x, MANT: tl.constexpr, MIN_EXP: tl.constexpr, MAX: tl.constexpr, SATURATE: tl.constexpr):
    """fp32 ``x`` rounded to the nearest value of a float8 format with ``MANT`` mantissa bits, least normal
    binade ``2^MIN_EXP`` and largest value ``MAX`` (ties to even; -0 stays -0), in fp32: what PyTorch's cast
    gives. Past ``MAX``: ``MAX`` with ``SATURATE`` (e4m3, which has no infinity), else infinity (e5m2).
    Computed in exact fp32 steps (power-of-two scales, a floor), so the cast that follows is exact:
    Triton's interpreter casts to float8 otherwise than a GPU does. NaN: :func:`store_rounded`."""
    a = tl.abs(x)
    e = tl.maximum((a.to(tl.int32, bitcast=True) >> 23) - 127, MIN_EXP)  # the binade; subnormals: the least normal's
    v = a * ((127 + MANT - e) << 23).to(tl.float32, bitcast=True)  # a / 2^(e - MANT): MANT bits above the point
    f = tl.floor(v)
    up = (v - f > 0.5) | ((v - f == 0.5) & ((f.to(tl.int32) & 1) == 1))
    r = tl.where(up, f + 1.0, f) * ((127 - MANT + e) << 23).to(tl.float32, bitcast=True)  # times 2^(e - MANT)
    if SATURATE:
        r = tl.minimum(r, MAX)
    else:
        r = tl.where(r > MAX, float("inf"), r)
    return tl.where(x.to(tl.int32, bitcast=True) < 0, -r, r)  # the sign bit: -0 too


@triton.jit
def store_rounded(ptr, x, mask):
    """``tl.store(ptr, x.to(element type), mask)``; into a float8 buffer (e4m3 or e5m2: a ``kv_cache_dtype``
    KV cache) rounded as PyTorch's cast rounds (:func:`fp8_round`), NaN kept NaN."""
    ty: tl.constexpr = ptr.dtype.element_ty
    if ty == tl.float8e4nv or ty == tl.float8e5:
        x32 = x.to(tl.float32)
        if ty == tl.float8e4nv:
            r = fp8_round(x32, 3, -6, 448.0, True)
        else:
            r = fp8_round(x32, 2, -14, 57344.0, False)
        nan = tl.full(x.shape, 0x7F, tl.uint8).to(ty, bitcast=True)  # (the interpreter casts NaN to a number)
        tl.store(ptr, tl.where(x32 != x32, nan, r.to(ty)), mask=mask)
    else:
        tl.store(ptr, x.to(ty), mask=mask)


GEMV_ROWS = 16  # at most this many rows take gemv.linear (its loop re-reads x per row; the weight once)
# the GEMM's (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages): BLOCK_K divides 128 (a 128 x 128 block's tiles
# take one scale per column), and two stages of tiles fit the 99 KB of shared memory of sm_86/89 (sm_90:
# 41-90 KB compiled, bf16 to fp32, one scale per column to one per element)
TILES = (64, 128, 64, 4, 2)


@triton.jit(do_not_specialize=["M"])
def _linear_kernel(x_ptr, x_stride, w_ptr, w_stride_n, w_stride_k, s_ptr, s_stride_n, s_stride_k, b_ptr, y_ptr,
                   M, N, K, QBLOCK_N: tl.constexpr, QBLOCK_K: tl.constexpr, BIAS: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
                   PDL: tl.constexpr):
    pdl.wait(PDL)  # x is the step's; nothing is read before (the weight could be: pdl.py, not done here)
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)  # int64: rows * N may pass 2**31
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    m_mask, n_mask = rows < M, n < N
    dtype = x_ptr.dtype.element_ty
    x_ptrs = x_ptr + rows[:, None] * x_stride + k[None, :]  # [BLOCK_M, BLOCK_K]
    w_ptrs = w_ptr + n[None, :] * w_stride_n + k[:, None] * w_stride_k  # [BLOCK_K, BLOCK_N]
    s_cols = s_ptr + (n // QBLOCK_N)[None, :] * s_stride_n  # [1, BLOCK_N]: the scales' row of each column
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = k0 + k < K
        xs = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if QBLOCK_K % BLOCK_K == 0:  # the tile inside one block along K (128 x 128 blocks): a scale per column
            s = tl.load(s_cols + (k0 // QBLOCK_K) * s_stride_k, mask=n_mask[None, :], other=0.0)
        else:  # blocks narrower than the tile or across it: each element's own
            s = tl.load(s_cols + ((k0 + k) // QBLOCK_K)[:, None] * s_stride_k, mask=k_mask[:, None] & n_mask[None, :],
                        other=0.0)
        acc = tl.dot(xs, (w.to(tl.float32) * s).to(dtype), acc, input_precision=PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * w_stride_k
    y = acc.to(dtype)
    if BIAS:  # after the rounding, in x's dtype: y + bias
        y = (y.to(tl.float32) + tl.load(b_ptr + n, mask=n_mask, other=0.0).to(tl.float32)[None, :]).to(dtype)
    tl.store(y_ptr + rows[:, None] * N + n[None, :], y, mask=m_mask[:, None] & n_mask[None, :])


def linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, dequantize(weight, scale).to(x.dtype)) (+ bias)`` -> ``[M, N]`` in x's dtype:
    ``x [M, K]`` with unit column stride (bf16, fp16 or fp32), ``weight [N, K]`` float8_e4m3fn (any
    strides) with its fp32 ``scale [ceil(N / bn), ceil(K / bk)]`` and ``block = (bn, bk)``
    (``gemv.scale_args``), ``bias [N]`` in x's dtype or None. The rounding is the module
    docstring's. Launched with PDL the GEMV reads ``weight`` and ``scale`` before it waits
    (``pdl.py``): parameters as the module holds them, never values computed in the step."""
    if weight.dim() != 2 or x.dim() != 2 or x.shape[1] != weight.shape[1] or x.stride(1) != 1:
        raise ValueError(f"x must be [M, K] with unit column stride and weight [N, K], got {list(x.shape)} "
                         f"and {list(weight.shape)}")
    if weight.dtype != gemv.FP8_DTYPE:
        raise ValueError(f"weight must be float8_e4m3fn, got {weight.dtype}")
    (m, k), n = x.shape, weight.shape[0]
    if bias is not None and (bias.shape != (n,) or bias.dtype != x.dtype):
        raise ValueError(f"bias must be [{n}] in x's dtype {x.dtype}, got {list(bias.shape)} {bias.dtype}")
    s, s_strides, fp8 = gemv.scale_args(x, weight, scale, block)
    if m <= GEMV_ROWS and gemv.linear_fits(weight):
        y = gemv.linear(x, weight, s, block)
        return y if bias is None else y + bias
    bm, bn, bk, warps, stages = TILES
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m:
        _linear_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn))](
            x, x.stride(0), weight, weight.stride(0), weight.stride(1), s, *s_strides, x if bias is None else bias, y,
            m, n, k, QBLOCK_N=fp8["QBLOCK_N"], QBLOCK_K=fp8["QBLOCK_K"], BIAS=bias is not None, BLOCK_M=bm,
            BLOCK_N=bn, BLOCK_K=bk, PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_warps=warps,
            num_stages=stages, **pdl.launch(x))
    return y
