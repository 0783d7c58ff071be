"""Rotary position embedding: the tables of the PyTorch path, and the batch's :class:`Rope`."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn


class Rope(NamedTuple):
    """A batch's RoPE, shared by every attention layer (``HybridForCausalLM.rope``): the tokens'
    ``positions [T]`` and the rotary's fp32 ``inv_freq [rotary_dim / 2]``, which the q/k prologue
    kernel reads (it computes the angles itself), and the tables the PyTorch path reads, ``cos`` and
    :func:`signed_sin` ``[T, rotary_dim]`` (None where attention runs the kernel:
    :func:`runs_prologue_kernel`)."""

    positions: torch.Tensor
    inv_freq: torch.Tensor
    cos: torch.Tensor | None
    sin: torch.Tensor | None


class RotaryEmbedding(nn.Module):
    """Default (non-interleaved, "rotate half") RoPE on the first ``rotary_dim`` channels of a head.
    ``angles``: HF's "proportional" RoPE, where only the first ``angles`` of the ``rotary_dim / 2``
    frequencies rotate and the rest are 0 (their channels pass through: ``cos = 1``, ``sin = 0``)."""

    def __init__(self, rotary_dim: int, theta: float, angles: int | None = None):
        super().__init__()
        if rotary_dim <= 0 or rotary_dim % 2:
            raise ValueError(f"rotary_dim must be a positive even number, got {rotary_dim}")
        angles = rotary_dim // 2 if angles is None else angles
        if not 0 <= angles <= rotary_dim // 2:
            raise ValueError(f"angles must be in [0, rotary_dim / 2 = {rotary_dim // 2}], got {angles}")
        exponents = torch.arange(0, 2 * angles, 2, dtype=torch.float32, device="cpu") / rotary_dim
        inv_freq = torch.zeros(rotary_dim // 2, device="cpu")  # (not the meta device a model is built on)
        inv_freq[:angles] = 1.0 / (theta**exponents)
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # [rotary_dim/2]

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos, sin [T, rotary_dim]`` of ``positions [T]``, or of ``[rotary_dim/2, T]``: each frequency's
        own position of each token (the multimodal RoPE's, ``HybridForCausalLM.rope``)."""
        if positions.dim() == 2:
            freqs = positions.float().T * self.inv_freq[None, :]  # [T, rotary_dim/2]
        else:
            freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, rotary_dim/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, rotary_dim]
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``cos.shape[-1]`` channels of ``x [T, H, D]``; the rest pass through."""
    dim = cos.shape[-1]
    rot, rest = x[..., :dim], x[..., dim:]
    half = dim // 2
    rotated = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
    out = rot * cos[:, None, :] + rotated * sin[:, None, :]  # [T, H, rotary_dim]
    return torch.cat((out, rest), dim=-1)


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """``sin [T, rotary_dim]`` with its first half negated: ``rotate_half(x) * sin`` becomes
    ``roll(x, half) * signed_sin`` (bitwise equal: ``(-a) * b == a * (-b)``)."""
    out = sin.clone()
    out[:, : sin.shape[-1] // 2].neg_()
    return out


def apply_rotary_(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """In-place :func:`apply_rotary` on a tensor the caller owns (bitwise the same result):
    ``x [T, H, D]``, ``cos`` and :func:`signed_sin` ``[T, rotary_dim]``. Returns ``x``."""
    dim = cos.shape[-1]
    rot = x[..., :dim]  # [T, H, rotary_dim] view
    rotated = torch.roll(rot, dim // 2, dims=-1).mul_(sin_signed[:, None, :])  # rotate_half(rot) * sin
    rot.mul_(cos[:, None, :]).add_(rotated)
    return x
