"""The projections of a fused decode step at a few rows (a *GEMV step*): in projections as a GEMV,
out projections left for the next norm's kernel (:class:`OutProjection`, :func:`add_rms_norm`)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from hyla.model.forward_batch import ForwardBatch
from hyla.model.layers import device
from hyla.model.layers.norms import RMSNorm
from hyla.model.quantization import is_fp8


def is_gemv_step(batch: ForwardBatch, residual: torch.Tensor) -> bool:
    """A fused decode step of at most ``gemv.MAX_ROWS`` rows (:meth:`HybridLayer.forward_fused`)."""
    return batch.fused_decode and residual.shape[0] <= device.gpu("gemv").MAX_ROWS


def on_gemv_step(module: nn.Module, gemv_step: bool) -> Callable[..., torch.Tensor | OutProjection]:
    """``module``'s forward, told that this is a GEMV step (``gemv_step=True``) where it takes one."""
    return functools.partial(module, gemv_step=True) if gemv_step and getattr(module, "takes_gemv_step", False) \
        else module


@dataclass(frozen=True)
class OutProjection:
    """A part's output projection ``linear(prologue(x))``, left for the next :func:`add_rms_norm` to
    run in one kernel with the residual add and the norm (``ops/gpu/gemv.py``): the fused decode
    step at a few rows. ``prologue``: ``"plain"``, ``"silu_mul"`` (SwiGLU of ``x = [gate | up]``) or
    ``"gated_norm"`` (Gated DeltaNet's, ``gate = (z, weight, eps)``). The linear has no bias."""

    linear: nn.Linear
    x: torch.Tensor
    prologue: str = "plain"
    gate: tuple[torch.Tensor, torch.Tensor, float] | None = None

    def run(self) -> torch.Tensor:
        """The projection, run now (a GEMV where :func:`project` takes one): for a part whose output
        is summed with another's before the next norm (Falcon-H1's parallel mixers), or goes through a norm
        of its own (post-norm and sandwich layers). Plain and SwiGLU prologues (the latter in its own kernel
        first); Gated DeltaNet's gated norm is never run this way."""
        if self.prologue == "silu_mul":
            return project(device.gpu("norms").silu_mul_fused(self.x), self.linear.weight, True)
        if self.prologue != "plain":
            raise NotImplementedError(f"OutProjection.run with the {self.prologue!r} prologue")
        return project(self.x, self.linear.weight, True)


def materialized(out: torch.Tensor | OutProjection) -> torch.Tensor:
    """``out`` itself, or a deferred projection run now (:meth:`OutProjection.run`)."""
    return out.run() if isinstance(out, OutProjection) else out


def in_projection(linear: nn.Linear, x: torch.Tensor, gemv_step: bool) -> torch.Tensor:
    """``linear(x)``; on a GEMV step (no bias, ``gemv.IN_PROJ``, a weight ``gemv.linear`` takes) that
    kernel, which loads its weight before it waits for ``x`` (``ops/gpu/pdl.py``), then the LoRA adapters'
    update where the projection takes adapters (``Linear.lora``)."""
    if gemv_step and linear.bias is None and _gemv_takes(linear.weight):
        y = device.gpu("gemv").linear(x, linear.weight)
        return linear.lora.add_(y, x) if adapted(linear) else y
    return linear(x)


def project(x: torch.Tensor, weight: torch.Tensor, gemv_step: bool) -> torch.Tensor:
    """``F.linear(x, weight)`` (no bias), through :func:`in_projection`'s GEMV on a GEMV step."""
    return device.gpu("gemv").linear(x, weight) if gemv_step and _gemv_takes(weight) else F.linear(x, weight)


def _gemv_takes(weight: torch.Tensor) -> bool:
    """Whether a GEMV step runs a projection of ``weight`` through ``gemv.linear`` (``gemv.IN_PROJ``;
    a weight kept in FP8 goes through its ``Linear``, whose kernel is a GEMV at a few rows too)."""
    kernels = device.gpu("gemv")
    return kernels.IN_PROJ and not is_fp8(weight) and kernels.linear_fits(weight)


def deferrable(linear: nn.Linear) -> bool:
    """Whether a GEMV step may leave ``linear``'s projection to the next norm's kernel
    (:class:`OutProjection`): no bias, a weight in the model's dtype (one kept in FP8 runs its
    own kernel, ``Linear.forward``), and no LoRA adapters applied (:func:`adapted`: :func:`in_projection` runs them)."""
    return linear.bias is None and not is_fp8(linear.weight) and not adapted(linear)


def adapted(linear: nn.Linear) -> bool:
    """Whether ``linear`` applies LoRA adapters in the step being run (``Linear.lora``, bound to a step with
    adapters' rows: a step or CUDA graph of the base model alone runs none of their ops)."""
    lora = getattr(linear, "lora", None)
    return lora is not None and lora.scope.batch is not None


def out_projection(linear: nn.Linear, x: torch.Tensor, gemv_step: bool) -> torch.Tensor | OutProjection:
    """``linear(x)`` (on a GEMV step :func:`in_projection`'s), or with ``gemv_step`` (where :func:`deferrable`)
    the projection left as an :class:`OutProjection`."""
    return OutProjection(linear, x) if gemv_step and deferrable(linear) else in_projection(linear, x, gemv_step)


def add_rms_norm(out: torch.Tensor | OutProjection | None, residual: torch.Tensor,
                 norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
    """``s = residual + out`` and ``norm(s)`` in one Triton kernel (``out`` None: ``s = residual``;
    an :class:`OutProjection`: the projection too): returns ``(norm(s), s)``. The fused decode
    step's and CUDA extend steps'; it runs the kernels on any device."""
    if isinstance(out, OutProjection):
        return device.gpu("gemv").linear_add_rms_norm(out.x, out.linear.weight, residual, norm.scale(), norm.eps,
                                                       norm.ticket(residual.device), out.prologue, out.gate)
    kernels = device.gpu("norms")
    if out is None:
        return kernels.rms_norm_fused(residual, norm.scale(), norm.eps), residual
    return kernels.add_rms_norm_fused(out, residual, norm.scale(), norm.eps)
