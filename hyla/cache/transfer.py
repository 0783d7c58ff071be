"""Copies between host and device that do not wait for the device.

A plain host-to-CUDA copy (``torch.tensor(values, device="cuda")``, ``t.to("cuda")``) synchronizes
the stream: the host waits for every kernel queued before it. On the decode path that would stall
the overlap schedule (``Scheduler._step_overlapped``), which queues the next step while the device
runs the current one; a pinned source copied ``non_blocking`` does not wait. The pools send their
slot indices this way, and so do the engine's sampler and grammar masks, and the model's ops the
index tensors they derive from a step's plan (``VarlenPlan.derive``): on an extend step a waiting
copy in every layer would keep the host from running ahead of the device at all. ``copy_rows``
moves pool rows between a device and host memory (the host tier, ``HostCache``), also without
waiting: into host memory as a ``Landing`` the host scatters once the copy is done. Knows nothing of
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


class Landing:
    """Rows on their way from a device into host buffers: a ``copy_rows(..., defer=True)``. They were
    gathered on the device and copied, without the host waiting, into staging memory (pinned, so
    the copy runs on the stream after the kernels queued before it); :meth:`land` waits for that
    copy alone (an event, not the stream) and scatters the rows into their buffers. Until then the
    destination rows hold what they held before: the caller must land a copy before anything reads
    its rows (``HostCache.load``), and land copies in the order they were made (a later copy may
    write rows an earlier one does)."""

    def __init__(self, blocks: list[tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]],
                 event: "torch.cuda.Event | None") -> None:
        self._blocks = blocks  # (destination buffers, their rows, the staged rows [rows, widths summed])
        self._event = event  # recorded after the staging copies (None: a host source, staged at once)
        self.nbytes = sum(t.numel() * t.element_size() for _, _, t in blocks)  # the staging memory held

    def ready(self) -> bool:
        """True once :meth:`land` would not wait: the staging copies are done. A copy from host
        memory (staged at once, no event) is never ready by itself: it lands when it must."""
        return self._event is not None and self._event.query()

    def land(self) -> None:
        """Wait for the staging copies and scatter the rows into the destination buffers; idempotent."""
        if self._event is not None:
            self._event.synchronize()
        for dst, rows, staged in self._blocks:
            _scatter(dst, rows, staged)
        self._blocks = []
        self.nbytes = 0


def _scatter(dst: Sequence[torch.Tensor], rows: torch.Tensor, moved: torch.Tensor) -> None:
    """``dst[i][rows] = `` the ``i``-th of the row slices ``moved`` concatenates ([rows, widths summed],
    on the buffers' device)."""
    offset = 0
    for d in dst:
        width = d[0].numel()
        d.index_copy_(0, rows, moved[:, offset:offset + width].reshape(len(rows), *d.shape[1:]))
        offset += width


def copy_rows(dst: Sequence[torch.Tensor], dst_rows, src: Sequence[torch.Tensor], src_rows,
              defer: bool = False) -> Landing | None:
    """``dst[i][dst_rows] = src[i][src_rows]`` for each buffer pair, the two sides on any devices
    (a cache's host and device tiers; the pairs agree in row shape and dtype). The rows are gathered
    where they are, moved one transfer per dtype and block of rows (``COPY_BLOCK_BYTES``: a long
    prefix's copy needs no device buffer of its size) and scattered where they go.

    No transfer waits for the device. Every copy runs on the stream in its order: it reads the rows
    the kernels queued before it wrote, and the kernels queued after it (which may reuse the source
    rows) run after it. Into a device, the host's rows go through pinned memory. Into host memory,
    the rows land in pinned staging memory first, and only the host can scatter them from there:
    with ``defer`` the copy returns that :class:`Landing` for the caller to land when it must (the
    host tier's saves: their staging memory is the whole copy's); without, each block lands at once
    (the host waits for its copy, and so for the kernels queued before it). ``defer`` needs host
    destinations; from host memory a deferred copy stages the rows at once and lands them when told.
    Into a device, at most two blocks' pinned memory is in flight: the third waits for the first's copy."""
    # (a conv-only model's empty SSM buffers left out; float8 KV buffers moved as their bytes)
    pairs = [(as_bytes(d), as_bytes(s)) for d, s in zip(dst, src, strict=True) if s.numel()]
    n = len(src_rows)
    if not pairs or not n:
        return None
    src_device, dst_device = pairs[0][1].device, pairs[0][0].device
    to_host = dst_device.type == "cpu"
    if defer and not to_host:
        raise ValueError(f"a deferred copy lands in host memory, not on {dst_device}")
    si = to_device(src_rows, torch.long, src_device)
    di = to_device(dst_rows, torch.long, dst_device)
    staged_blocks = []
    loads: list[torch.cuda.Event] = []  # into a device: the copies of the blocks in flight
    for dtype in dict.fromkeys(s.dtype for _, s in pairs):
        group = [(d, s) for d, s in pairs if s.dtype == dtype]
        row_bytes = sum(s[0].numel() for _, s in group) * group[0][1].element_size()
        block = max(1, COPY_BLOCK_BYTES // row_bytes)
        for lo in range(0, n, block):
            sb, db = si[lo:lo + block], di[lo:lo + block]
            moved = torch.cat([s.index_select(0, sb).reshape(len(sb), -1) for _, s in group], dim=1)
            dsts = [d for d, _ in group]
            if to_host and (defer or src_device.type != "cpu"):
                staged = (dsts, db, _stage_on_host(moved))
                if defer:
                    staged_blocks.append(staged)
                else:  # one block of staging memory at a time
                    Landing([staged], _recorded(src_device)).land()
                continue
            if moved.device.type == "cpu" and dst_device.type == "cuda":  # through pinned memory
                if len(loads) == 2:  # at most two blocks' pinned memory in flight
                    loads.pop(0).synchronize()
                moved = to_device(moved, moved.dtype, dst_device)
                loads.append(_recorded(dst_device))
            _scatter(dsts, db, moved.to(dst_device))
    if not staged_blocks:
        return None
    return Landing(staged_blocks, _recorded(src_device))


def _stage_on_host(moved: torch.Tensor) -> torch.Tensor:
    """Rows gathered on a device copied, without waiting, into pinned host memory (a host tensor as it is)."""
    if moved.device.type != "cuda":
        return moved
    staged = torch.empty(moved.shape, dtype=moved.dtype, pin_memory=True)
    return staged.copy_(moved, non_blocking=True)


def _recorded(device: torch.device) -> "torch.cuda.Event | None":
    """An event recorded on ``device``'s current stream, after what is queued there (None off CUDA)."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event
