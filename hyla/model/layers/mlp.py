"""The dense feed-forward (SwiGLU, GeGLU or relu²)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hyla.model.layers import device
from hyla.model.layers.projections import OutProjection, deferrable, in_projection
from hyla.model.linear import Linear


def relu2(x: torch.Tensor) -> torch.Tensor:
    return torch.square(F.relu(x))


def gated_act(h: torch.Tensor, act: str) -> torch.Tensor:
    """``act(gate) * up`` of ``h = [gate (I) | up (I)]`` in PyTorch: ``"silu"`` (SwiGLU) or ``"gelu"``
    (GeGLU, the exact erf GELU: Hugging Face's ``"gelu"``)."""
    gate, up = h.chunk(2, dim=-1)
    return (F.silu(gate) if act == "silu" else F.gelu(gate)) * up


class MLP(nn.Module):
    """Dense feed-forward. ``act="silu"``: gated SwiGLU, ``in_proj`` rows ``[gate (I) | up (I)]``;
    ``act="gelu"``: the same rows, GeGLU (Zamba2); ``act="relu2"``: ``down(relu(up(x))^2)``, ``in_proj``
    rows ``[up (I)]``."""

    takes_gemv_step = True  # forward(gemv_step=True): see HybridLayer.forward_fused

    def __init__(self, hidden: int, intermediate: int, act: str, bias: bool = False, dtype: torch.dtype | None = None):
        super().__init__()
        if act not in ("silu", "gelu", "relu2"):
            raise ValueError(f"unsupported activation {act!r}")
        self.act = act
        self.gated = act != "relu2"
        self.in_proj = Linear(hidden, intermediate * (2 if self.gated else 1), bias=bias, dtype=dtype)
        self.out_proj = Linear(intermediate, hidden, bias=bias, dtype=dtype)

    def forward(self, x: torch.Tensor, gemv_step: bool = False) -> torch.Tensor | OutProjection:
        h = in_projection(self.in_proj, x, gemv_step)
        if gemv_step and deferrable(self.out_proj):  # SwiGLU in the down projection's kernel (the others before it)
            if self.act == "silu":
                return OutProjection(self.out_proj, h, "silu_mul")
            return OutProjection(self.out_proj, gated_act(h, self.act) if self.gated else relu2(h))
        return self.down(h, gemv_step)

    def down(self, h: torch.Tensor, gemv_step: bool = False) -> torch.Tensor:
        """The activation and the out projection of the in projection's output ``h [..., I or 2I]``
        (on a GEMV step, :func:`in_projection`'s GEMV)."""
        if self.act == "silu" and device.on_gpu(h):
            a = device.gpu("norms").silu_mul_fused(h.reshape(-1, h.shape[-1])).view(*h.shape[:-1], -1)
        elif self.gated:
            a = gated_act(h, self.act)
        else:
            a = relu2(h)
        return in_projection(self.out_proj, a, gemv_step)
