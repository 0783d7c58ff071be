"""RMSNorm (with or without a weight), and the gated RMSNorm of the recurrent mixers' outputs: fp32 inside,
cast back."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hyla.model.layers import device
from hyla.model.layers.derived import DerivedWeight


class RMSNorm(nn.Module):
    """``x * rsqrt(mean(x^2) + eps) * w`` in fp32, cast back to the input dtype.

    ``zero_centered=True`` (Qwen3-Next / Qwen3.5) stores ``w - 1``: the scale is ``1 + weight``.
    """

    def __init__(self, dim: int, eps: float, zero_centered: bool = False, dtype: torch.dtype | None = None):
        super().__init__()
        self.eps = eps
        self.offset = 1.0 if zero_centered else 0.0
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype))
        offset = self.offset
        self._scale = DerivedWeight(lambda w: offset + w.float())  # [dim] fp32
        self._ticket: torch.Tensor | None = None

    def scale(self) -> torch.Tensor:
        """The fp32 multiplier ``offset + weight`` ([dim]), recomputed only when the weight changes."""
        return self._scale(self.weight)

    def ticket(self, device: torch.device) -> torch.Tensor:
        """The zeroed int32 that the kernel ending in this norm (an :class:`OutProjection` run by
        :func:`add_rms_norm`) counts its programs on, and resets. One per norm: a norm runs once
        per forward, and forwards run one after another on the device's stream."""
        if self._ticket is None or self._ticket.device != device:
            self._ticket = torch.zeros(1, dtype=torch.int32, device=device)
        return self._ticket

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.scale()
        if device.on_gpu(x):
            return device.gpu("norms").rms_norm_fused(x.reshape(-1, x.shape[-1]), scale, self.eps).view(x.shape)
        return F.rms_norm(x.float(), scale.shape, scale, self.eps).to(x.dtype)


class WeightlessRMSNorm(nn.Module):
    """``x * rsqrt(mean(x^2) + eps)`` in fp32, cast back to the input dtype: an RMSNorm without a
    weight (FalconMamba's norms of dt, B and C). No parameter, nothing for a checkpoint to hold; the
    same PyTorch ops on every device (a few elementwise kernels on rows of a few hundred values,
    which CUDA graphs capture as they are)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.dim, self.eps = dim, eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), (self.dim,), None, self.eps).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}"


class GatedRMSNorm(nn.Module):
    """RMSNorm combined with a ``silu(z)`` gate, over groups of ``group_size`` channels.

    ``norm_before_gate=True`` (Gated DeltaNet): ``(w * norm(x)) * silu(z)``.
    ``norm_before_gate=False`` (Mamba2): ``w * norm(x * silu(z))``, normalised per group.
    """

    def __init__(self, dim: int, eps: float, group_size: int | None = None, norm_before_gate: bool = True,
                 dtype: torch.dtype | None = None):
        super().__init__()
        self.eps = eps
        self.group_size = group_size or dim
        if dim % self.group_size:
            raise ValueError(f"group_size {self.group_size} does not divide {dim}")
        self.norm_before_gate = norm_before_gate
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype))

    def _norm(self, x32: torch.Tensor) -> torch.Tensor:
        groups = x32.view(*x32.shape[:-1], -1, self.group_size)  # [..., G, dim/G]
        return F.rms_norm(groups, (self.group_size,), eps=self.eps).view(x32.shape)

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if self.norm_before_gate:
            weight = self.weight
            if dtype == torch.float32 and weight.dtype == torch.float32 and self.group_size == x.shape[-1]:
                # one rms_norm with the weight folded in: w * norm(x), the same products
                return F.rms_norm(x, (self.group_size,), weight, self.eps).mul_(F.silu(z.float()))
            y = weight * self._norm(x.float()).to(dtype)
            return (y * F.silu(z.float())).to(dtype)
        y = self._norm(x.float() * F.silu(z.float()))
        return self.weight * y.to(dtype)
