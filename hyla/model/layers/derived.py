"""Tensors the layers compute from their parameters once, not in every step (``1 + w``, ``-exp(A_log)``)."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn


class DerivedWeight:
    """A tensor computed from parameters, cached until one of them changes (new storage, dtype,
    device, or an in-place write, which bumps its version counter): a decode step then skips
    recomputing e.g. ``1 + w`` or ``-exp(A_log)`` in every layer. A CUDA graph captured with it
    replays the cached tensor without asking: a weight update refreshes it in place
    (:func:`refresh_derived_weights_`)."""

    def __init__(self, fn: Callable[..., torch.Tensor]):
        self.fn = fn
        self.key: tuple | None = None
        self.value: torch.Tensor | None = None
        self.weights: tuple[torch.Tensor, ...] = ()  # what value was computed from

    def __call__(self, *weights: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():  # traced: the compiler fuses or folds it
            return self.fn(*weights)
        key = tuple((w.data_ptr(), w._version, w.dtype, w.device) for w in weights)
        if key != self.key or self.value is None:
            with torch.no_grad():
                self.value = self.fn(*(w.detach() for w in weights))
            self.key, self.weights = key, weights
        return self.value

    @torch.inference_mode()  # (a value computed in a forward is an inference tensor)
    def refresh_(self) -> None:
        """Recompute the cached tensor from its weights' current values into its own storage."""
        if self.value is not None:
            self.value.copy_(self.fn(*(w.detach() for w in self.weights)))
            self.key = tuple((w.data_ptr(), w._version, w.dtype, w.device) for w in self.weights)


def refresh_derived_weights_(module: nn.Module) -> int:
    """:meth:`DerivedWeight.refresh_` every derived weight of ``module``'s submodules (after their
    parameters were written in place: ``loader.copy_weights_``); returns how many were cached."""
    derived = [d for m in module.modules() for d in vars(m).values() if isinstance(d, DerivedWeight)]
    for d in derived:
        d.refresh_()
    return sum(d.value is not None for d in derived)
