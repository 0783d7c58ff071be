"""Host -> device copies that do not wait for the device.

A plain host-to-CUDA copy (``torch.tensor(values, device="cuda")``, ``t.to("cuda")``) synchronizes
the stream: the host waits for every kernel queued before it. On the decode path that would stall
the overlap schedule (``Scheduler._step_overlapped``), which queues the next step while the device
runs the current one; a pinned source copied ``non_blocking`` does not wait. The pools send their
slot indices this way, and so do the engine's sampler and grammar masks, and the model's ops the
index tensors they derive from a step's plan (``VarlenPlan.derive``): on an extend step a waiting
copy in every layer would keep the host from running ahead of the device at all. Knows nothing of
models or pools: the one module of ``hyla.cache`` that ``hyla.model`` imports besides the layout.
"""

from __future__ import annotations

import torch


def to_device(values, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """``values`` (a host tensor, a numpy array or nested lists of numbers) as a ``dtype`` tensor on
    ``device``, copied asynchronously to CUDA (the pinned staging copy outlives the transfer:
    PyTorch's pinned allocator holds it until the copy is done)."""
    t = torch.as_tensor(values, dtype=dtype)
    if torch.device(device).type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def to_device_packed(parts, device: torch.device | str) -> list[torch.Tensor]:
    """Several int64 host tensors (or lists of ints) on ``device`` in one :func:`to_device` copy:
    views of one buffer, each of its part's shape. On the CPU the parts themselves, uncopied."""
    host = [torch.as_tensor(p, dtype=torch.long) for p in parts]
    if torch.device(device).type == "cpu":
        return host
    flat = to_device(torch.cat([t.reshape(-1) for t in host]), torch.long, device)
    return [v.view(t.shape) for v, t in zip(flat.split([t.numel() for t in host]), host)]
