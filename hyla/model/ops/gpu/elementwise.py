"""Element-wise functions the Triton kernels share, each as its PyTorch reference computes it."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def softplus(x, LOG1P: tl.constexpr):
    """fp32 ``softplus(x)`` with PyTorch's threshold (``x`` above 20). ``LOG1P``: ``log1p(exp(x))``
    to within a few ulps, as ``F.softplus`` (the references of Gated DeltaNet and Mamba); else
    ``log(1 + exp(x))``, transformers' Kimi-Linear form, whose ``1 + exp(x)`` rounds away up to ~1%
    of a small result (``x`` near -12). Triton has no portable ``log1p`` (libdevice's is CUDA-only,
    the interpreter has none), so the rounding is undone in Goldberg's form: ``u = 1 + y`` rounded,
    ``log(u) * y / (u - 1)`` (``y`` itself where ``u`` rounds to 1)."""
    y = tl.exp(x)
    u = 1.0 + y
    if LOG1P:
        sp = tl.where(u == 1.0, y, tl.log(u) * (y / (u - 1.0)))
    else:
        sp = tl.log(u)
    return tl.where(x > 20.0, x, sp)
