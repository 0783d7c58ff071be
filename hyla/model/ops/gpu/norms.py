"""Row-wise Triton kernels for the small ops between the projections: RMSNorm (alone, or after the
residual add that precedes it), the gated RMSNorm of Gated DeltaNet, SwiGLU's ``silu(gate) * up``,
and attention's output gate ``o * sigmoid(gate)`` on an extend (a decode step's is in its
attention kernel). Each replaces a handful of PyTorch kernels (casts,
reductions, products) with one, and rounds where its PyTorch form rounds (``hyla/model/layers``), so
bf16 results match it to the last bit or one rounding step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hyla.model.ops.gpu import pdl


@triton.jit
def _rms_norm_kernel(x_ptr, x_stride, scale_ptr, y_ptr, D, eps, SCALE_ROWS: tl.constexpr, BLOCK: tl.constexpr,
                     PDL: tl.constexpr):
    pdl.wait(PDL)  # (pdl.py)
    # int64: a row per token, or per token and head (the q/k norms: Qwen3-Next's 18 heads of 256 pass 2**31
    # elements past ~466K tokens)
    row = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK)
    mask = d < D
    x = tl.load(x_ptr + row * x_stride + d, mask=mask, other=0.0).to(tl.float32)
    inv = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
    scale = tl.load(scale_ptr + (row % SCALE_ROWS) * D + d, mask=mask, other=0.0)
    tl.store(y_ptr + row * D + d, (x * inv * scale).to(y_ptr.dtype.element_ty), mask=mask)


def rms_norm_fused(x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """``F.rms_norm(x.float(), scale) -> x.dtype`` over the last dim of ``x [N, D]`` (rows may be
    strided); ``scale`` fp32 ``[D]``, or ``[R, D]`` with row ``n`` of ``x`` using scale row ``n % R``
    (per-head q/k norms). Returns a contiguous ``[N, D]``."""
    n, d = x.shape
    if x.stride(1) != 1:
        raise ValueError("x must have unit stride along its last dim")
    scale_rows = scale.numel() // d
    if scale.dtype != torch.float32 or scale.numel() != scale_rows * d or not scale.is_contiguous():
        raise ValueError(f"scale must be a contiguous fp32 [R, {d}] tensor, got {list(scale.shape)} {scale.dtype}")
    y = torch.empty(n, d, dtype=x.dtype, device=x.device)
    _rms_norm_kernel[(n,)](x, x.stride(0), scale, y, d, eps, SCALE_ROWS=scale_rows,
                           BLOCK=triton.next_power_of_2(d), num_warps=4 if d <= 2048 else 8, **pdl.launch(x))
    return y


@triton.jit
def _add_rms_norm_kernel(x_ptr, r_ptr, scale_ptr, y_ptr, s_ptr, D, eps, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl.wait(PDL)  # (pdl.py)
    row = tl.program_id(0).to(tl.int64)  # int64: row * D passes 2**31 elements past ~524K tokens at D = 4,096
    d = tl.arange(0, BLOCK)
    mask = d < D
    x = tl.load(x_ptr + row * D + d, mask=mask, other=0.0)
    r = tl.load(r_ptr + row * D + d, mask=mask, other=0.0)
    s = (r.to(tl.float32) + x.to(tl.float32)).to(s_ptr.dtype.element_ty)  # the residual add, rounded as x + r
    tl.store(s_ptr + row * D + d, s, mask=mask)
    s32 = s.to(tl.float32)
    inv = tl.rsqrt(tl.sum(s32 * s32, axis=0) / D + eps)
    scale = tl.load(scale_ptr + d, mask=mask, other=0.0)
    tl.store(y_ptr + row * D + d, (s32 * inv * scale).to(y_ptr.dtype.element_ty), mask=mask)


def add_rms_norm_fused(x: torch.Tensor, residual: torch.Tensor, scale: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add and the RMSNorm after it in one kernel: ``s = residual + x`` (in their dtype,
    as ``HybridLayer`` adds) and ``y = rms_norm_fused(s, scale)``; ``x, residual [N, D]`` contiguous,
    ``scale`` fp32 ``[D]``. Returns ``(y, s)``, both new ``[N, D]`` tensors."""
    if x.shape != residual.shape or x.dtype != residual.dtype or x.dim() != 2:
        raise ValueError(f"x and residual must be [N, D] of one dtype, got {list(x.shape)} {x.dtype} and "
                         f"{list(residual.shape)} {residual.dtype}")
    n, d = x.shape
    if not (x.is_contiguous() and residual.is_contiguous()):
        raise ValueError("x and residual must be contiguous")
    if scale.dtype != torch.float32 or scale.shape != (d,) or not scale.is_contiguous():
        raise ValueError(f"scale must be a contiguous fp32 [{d}] tensor, got {list(scale.shape)} {scale.dtype}")
    y, s = torch.empty_like(x), torch.empty_like(x)
    _add_rms_norm_kernel[(n,)](x, residual, scale, y, s, d, eps, BLOCK=triton.next_power_of_2(d),
                               num_warps=4 if d <= 2048 else 8, **pdl.launch(x))
    return y, s


@triton.jit
def _gated_rms_norm_kernel(x_ptr, x_stride, z_ptr, z_stride, w_ptr, y_ptr, D, eps,
                           H: tl.constexpr, ROUND: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl.wait(PDL)  # (pdl.py)
    # (token, head). int64: t * z_stride (z read in place from Qwen3-Next's 12,352-wide projection) passes 2**31
    # elements past ~174K tokens
    row = tl.program_id(0).to(tl.int64)
    t = row // H
    h = row % H
    d = tl.arange(0, BLOCK)
    mask = d < D
    x = tl.load(x_ptr + t * x_stride + h * D + d, mask=mask, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + t * z_stride + h * D + d, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + d, mask=mask, other=0.0)
    n = x * tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
    if ROUND:  # as GatedRMSNorm: norm -> dtype, weight * it in dtype, then * silu(z) in fp32
        y = (w.to(tl.float32) * n.to(w.dtype).to(tl.float32)).to(w.dtype).to(tl.float32)
    else:
        y = w.to(tl.float32) * n
    y = y * (z * tl.sigmoid(z))
    tl.store(y_ptr + t * (H * D) + h * D + d, y.to(y_ptr.dtype.element_ty), mask=mask)


def gated_rms_norm_fused(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float,
                         num_heads: int) -> torch.Tensor:
    """Gated DeltaNet's output norm ``(w * norm(x)) * silu(z)`` per head: ``x, z [T, H*D]`` (rows
    may be strided, e.g. a split of the projection) -> ``[T, H*D]`` in ``x``'s dtype."""
    t, width = x.shape
    d = width // num_heads
    if z.shape != x.shape or width != num_heads * d or weight.shape != (d,) or x.stride(1) != 1 or z.stride(1) != 1:
        raise ValueError(f"x and z must be [T, {num_heads} x D] with unit column stride, weight [D]")
    y = torch.empty(t, width, dtype=x.dtype, device=x.device)
    _gated_rms_norm_kernel[(t * num_heads,)](x, x.stride(0), z, z.stride(0), weight, y, d, eps, H=num_heads,
                                             ROUND=x.dtype != torch.float32, BLOCK=triton.next_power_of_2(d),
                                             **pdl.launch(x))
    return y


@triton.jit
def _silu_mul_kernel(h_ptr, h_stride, y_ptr, I, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl.wait(PDL)  # (pdl.py)
    # int64: t * h_stride passes 2**31 elements past ~210K tokens of Qwen3-Next's MoE (10 rows of 2 x 512 a
    # token), ~75K of Jamba-1.5-Mini's MLP (rows of 2 x 14,336)
    t = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = i < I
    gate = tl.load(h_ptr + t * h_stride + i, mask=mask, other=0.0)
    up = tl.load(h_ptr + t * h_stride + I + i, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    s = (g * tl.sigmoid(g)).to(gate.dtype)  # F.silu in the model dtype, then the product in it
    tl.store(y_ptr + t * I + i, (s.to(tl.float32) * up.to(tl.float32)).to(y_ptr.dtype.element_ty), mask=mask)


def silu_mul_fused(h: torch.Tensor) -> torch.Tensor:
    """``h [T, 2I] = [gate | up]`` -> ``silu(gate) * up  [T, I]`` (SwiGLU), in ``h``'s dtype."""
    t, width = h.shape
    if width % 2 or h.stride(1) != 1:
        raise ValueError("h must be [T, 2I] with unit column stride")
    inner = width // 2
    y = torch.empty(t, inner, dtype=h.dtype, device=h.device)
    block = 1024
    _silu_mul_kernel[(t, triton.cdiv(inner, block))](h, h.stride(0), y, inner, BLOCK=block, **pdl.launch(h))
    return y


@triton.jit
def _sigmoid_gate_kernel(o_ptr, o_stride_t, o_stride_h, g_ptr, g_stride_t, g_stride_h, y_ptr, HQ: tl.constexpr,
                         D: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl.wait(PDL)  # (pdl.py)
    t = tl.program_id(0).to(tl.int64)  # int64: t * g_stride_t (Qwen3-Next's 9,216-wide projection) passes 2**31
    # elements past ~233K tokens
    h = tl.program_id(1)
    d = tl.arange(0, BLOCK)
    mask = d < D
    o = tl.load(o_ptr + t * o_stride_t + h * o_stride_h + d, mask=mask, other=0.0)
    g = tl.load(g_ptr + t * g_stride_t + h * g_stride_h + d, mask=mask, other=0.0)
    sig = tl.sigmoid(g.to(tl.float32)).to(o.dtype)  # torch.sigmoid in the dtype, then the product in it
    tl.store(y_ptr + (t * HQ + h) * D + d, (o.to(tl.float32) * sig.to(tl.float32)).to(o.dtype), mask=mask)


def sigmoid_gate_fused(o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """``o * sigmoid(gate)`` -> ``[T, Hq * D]`` in ``o``'s dtype, as ``Attention.forward`` rounds it:
    ``o`` and ``gate [T, Hq, D]`` with unit stride along D (any other strides: attention's output,
    and a view of the projection, Qwen3-Next's per-head ``[q | gate]``)."""
    t, hq, d = o.shape
    if gate.shape != o.shape or gate.dtype != o.dtype or gate.stride(2) != 1 or o.stride(2) != 1:
        raise ValueError(f"o and gate must be [T, Hq, D] of one dtype with unit stride along D, got "
                         f"{list(o.shape)} {o.dtype} and {list(gate.shape)} {gate.dtype}")
    y = torch.empty(t, hq * d, dtype=o.dtype, device=o.device)
    if t:
        _sigmoid_gate_kernel[(t, hq)](o, o.stride(0), o.stride(1), gate, gate.stride(0), gate.stride(1), y, HQ=hq,
                                      D=d, BLOCK=triton.next_power_of_2(d), **pdl.launch(o))
    return y
