"""Host -> device copies that do not wait for the device.

A plain host-to-CUDA copy (``torch.tensor(values, device="cuda")``, ``t.to("cuda")``) synchronizes
the stream: the host waits for every kernel queued before it. On the decode path that would stall
the overlap schedule (``Scheduler._step_overlapped``), which queues the next step while the device
runs the current one; a pinned source copied ``non_blocking`` does not wait. The pools send their
slot indices this way, and so do the engine's sampler and grammar masks, and the model's ops the
index tensors they derive from a step's plan (``VarlenPlan.derive``): on an extend step a waiting
copy in every layer would keep the host from running ahead of the device at all. ``copy_rows``
moves pool rows between a device and host memory (the host tier, ``HostCache``). Knows nothing of
models or pools: the one module of ``hyla.cache`` that ``hyla.model`` imports besides the layout.
"""

from __future__ import annotations

from typing import Sequence

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


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A float8 tensor (a ``kv_cache_dtype`` KV buffer) viewed as ``uint8``, for the row copies PyTorch has no
    float8 kernels of (``index_copy_`` on a CPU); any other tensor as it is."""
    return t.view(torch.uint8) if t.dtype.itemsize == 1 and t.dtype.is_floating_point else t


def put_rows_(dst: torch.Tensor, index: torch.Tensor, rows: torch.Tensor) -> None:
    """``dst[index[i]] = rows[i]`` in place (``index`` distinct, ``rows`` in ``dst``'s dtype): ``index_copy_``,
    a float8 ``dst`` as its bytes (:func:`as_bytes`)."""
    as_bytes(dst).index_copy_(0, index, as_bytes(rows))


# rows moved per transfer in ``copy_rows``: its staging buffers hold at most about this many bytes
COPY_BLOCK_BYTES = 64 << 20


def copy_rows(dst: Sequence[torch.Tensor], dst_rows, src: Sequence[torch.Tensor], src_rows) -> None:
    """``dst[i][dst_rows] = src[i][src_rows]`` for each buffer pair, the two sides on any devices
    (a cache's host and device tiers; the pairs agree in row shape and dtype). The rows are gathered
    where they are, moved one transfer per dtype and block of rows (``COPY_BLOCK_BYTES``: a long
    prefix's copy needs no buffer of its size) and scattered where they go. Each transfer is a
    plain copy, which waits for the device: the rows a move to the host reads are those the kernels
    queued before it wrote, and the host may read the copy at once."""
    # (a conv-only model's empty SSM buffers left out; float8 KV buffers moved as their bytes)
    pairs = [(as_bytes(d), as_bytes(s)) for d, s in zip(dst, src, strict=True) if s.numel()]
    n = len(src_rows)
    if not pairs or not n:
        return
    si = to_device(src_rows, torch.long, pairs[0][1].device)
    di = to_device(dst_rows, torch.long, pairs[0][0].device)
    for dtype in dict.fromkeys(s.dtype for _, s in pairs):
        group = [(d, s) for d, s in pairs if s.dtype == dtype]
        row_bytes = sum(s[0].numel() for _, s in group) * group[0][1].element_size()
        block = max(1, COPY_BLOCK_BYTES // row_bytes)
        for lo in range(0, n, block):
            sb, db = si[lo:lo + block], di[lo:lo + block]
            moved = torch.cat([s.index_select(0, sb).reshape(len(sb), -1) for _, s in group], dim=1).to(group[0][0].device)
            offset = 0
            for d, s in group:
                width = s[0].numel()
                d.index_copy_(0, db, moved[:, offset:offset + width].reshape(len(sb), *s.shape[1:]))
                offset += width
