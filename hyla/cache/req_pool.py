"""The request table: request row → the KV slot of each of its tokens.

Row ``r`` of ``req_to_token`` lists, position by position, the KV slots of the request in row
``r`` (its cached prefix, the tree's slots, followed by its private slots). Rows are handed out by
``alloc`` and returned by ``free``; the table never frees KV slots itself. (A request's own state
slot is kept by the request: the engine's ``Req.state_slot``.)

A device mirror (:meth:`add_mirror`, for the GPU decode step, which reads a sequence's KV slots on
the device) is an int32 copy with one spare last row for padded batch rows. The host table stays the
one source of truth: ``write`` records the range it changed, and ``sync_mirror`` (once per step,
before the forward) copies every range changed since the last sync in one transfer.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from hyla.cache.allocator import FreeList, IndexLike, PoolExhaustedError, as_index_array


class ReqToTokenPool:
    """``max_reqs`` rows of ``max_context_len`` KV slots each (int64, on ``device``)."""

    def __init__(self, max_reqs: int, max_context_len: int, device: torch.device | str = "cpu") -> None:
        if max_reqs < 1 or max_context_len < 1:
            raise ValueError(f"max_reqs and max_context_len must be >= 1, got {max_reqs} and {max_context_len}")
        self.size = max_reqs
        self.max_context_len = max_context_len
        self.device = torch.device(device)
        self.req_to_token = torch.zeros(max_reqs, max_context_len, dtype=torch.int64, device=self.device)  # [R, L]
        # on the CPU, writes go through a numpy view of the same memory: a step's few ints cost
        # ~1 µs there against several torch calls (each dearer still after a forward's weights
        # have flushed the caches)
        self._host = self.req_to_token.numpy() if self.device.type == "cpu" else None
        self._rows = FreeList(max_reqs)  # ids 1..max_reqs; row = id - 1
        self.mirror: torch.Tensor | None = None  # [R + 1, L] int32 (see add_mirror); row R = padding
        self._dirty: dict[int, tuple[int, int]] = {}  # row -> [start, end) written since the last sync

    def add_mirror(self, device: torch.device | str) -> torch.Tensor:
        """Keep an int32 copy on ``device`` from now on (every row as it is now, then kept in step
        by :meth:`sync_mirror`); returns it. A second call on the same device returns the same
        mirror (the target's and a draft model's runners share it); another device: ``ValueError``."""
        if self.mirror is not None:
            if self.mirror.device.type != torch.device(device).type:
                raise ValueError(f"the request table already has a mirror on {self.mirror.device}, not {device}")
            return self.mirror
        self.mirror = torch.zeros(self.size + 1, self.max_context_len, dtype=torch.int32, device=device)
        self.mirror[: self.size] = self.req_to_token.to(device=device, dtype=torch.int32)
        self._dirty.clear()
        return self.mirror

    @property
    def padding_row(self) -> int:
        """The mirror's spare row (never a request's): padded batch rows point there."""
        return self.size

    def available_size(self) -> int:
        return self._rows.num_free()

    def can_alloc(self, n: int = 1) -> bool:
        return n <= self._rows.num_free()

    def alloc(self) -> int:
        """A free row (raises PoolExhaustedError when none is left)."""
        return int(self._rows.alloc(1)[0]) - 1

    def free(self, row: int) -> None:
        self._check_row(row)
        self._rows.free(as_index_array([row + 1]))

    def write(self, row: int, start: int, kv_indices: IndexLike) -> None:
        """``req_to_token[row, start : start + n] = kv_indices``."""
        self._check_row(row)
        arr = as_index_array(kv_indices)
        end = start + arr.size
        if start < 0 or end > self.max_context_len:
            raise ValueError(f"positions [{start}, {end}) exceed max_context_len {self.max_context_len}")
        if self._host is not None:  # a prompt's 4,096 slots: ~3 µs, against ~60 through torch's indexing
            self._host[row, start:end] = arr
        else:
            self.req_to_token[row, start:end] = torch.from_numpy(arr).to(self.device)
        self._mark_dirty(row, start, end)

    def write_batch(self, rows: Sequence[int], starts: Sequence[int], lens: Sequence[int],
                    kv_indices: IndexLike) -> None:
        """:meth:`write` for several rows at once (a step's allocations): row ``rows[i]`` gets the
        next ``lens[i]`` entries of ``kv_indices`` at positions ``starts[i]`` on, in one scatter.
        The rows are distinct; every range is checked before anything is written."""
        arr = as_index_array(kv_indices)
        if not len(rows) == len(starts) == len(lens) or arr.size != sum(lens):
            raise ValueError(f"{len(rows)} rows, {len(starts)} starts and {len(lens)} lengths for "
                             f"{arr.size} slots")
        if len(set(rows)) != len(rows):
            raise ValueError(f"write_batch takes each row once, got {list(rows)}")
        for row, start, n in zip(rows, starts, lens):
            self._check_row(row)
            if n < 0 or start < 0 or start + n > self.max_context_len:
                raise ValueError(f"positions [{start}, {start + n}) exceed max_context_len {self.max_context_len}")
        if self._host is None:
            self._index_put(rows, starts, lens, torch.from_numpy(arr))
        elif all(n == 1 for n in lens):  # a decode step: one position per row
            self._host[list(rows), list(starts)] = arr
        else:
            first = 0
            for row, start, n in zip(rows, starts, lens):
                self._host[row, start:start + n] = arr[first:first + n]
                first += n
        for row, start, n in zip(rows, starts, lens):
            self._mark_dirty(row, start, start + n)

    def _index_put(self, rows: Sequence[int], starts: Sequence[int], lens: Sequence[int], idx: torch.Tensor) -> None:
        """:meth:`write_batch`'s scatter on a device table: one ``index_put_``."""
        if all(n == 1 for n in lens):
            row_idx, col_idx = torch.tensor(rows, dtype=torch.long), torch.tensor(starts, dtype=torch.long)
        else:
            lens_t = torch.tensor(lens, dtype=torch.long)
            row_idx = torch.repeat_interleave(torch.tensor(rows, dtype=torch.long), lens_t)
            first = torch.tensor(starts, dtype=torch.long) - (torch.cumsum(lens_t, 0) - lens_t)  # start - offset
            col_idx = torch.arange(idx.numel()) + torch.repeat_interleave(first, lens_t)
        self.req_to_token.index_put_((row_idx.to(self.device), col_idx.to(self.device)), idx.to(self.device))

    def table(self, rows: Sequence[int], lens: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(table [B, max(lens)], packed [sum(lens)])``: the first ``lens[i]`` slots of row
        ``rows[i]``, one request per table row padded with slot 0 (past its length a row holds
        stale slots), and the same slots packed in row order; fresh int64 tensors on the table's
        device (a decode step's KV table)."""
        width = max(lens)
        if self._host is not None:
            table = self._host[list(rows), :width]  # [B, width], a copy
            if all(n == width for n in lens):
                return (t := torch.from_numpy(table)), t.view(-1)
            past = np.arange(width) >= np.asarray(lens)[:, None]
            table[past] = 0
            return torch.from_numpy(table), torch.from_numpy(table[~past])
        table = self.req_to_token[:, :width].index_select(0, torch.tensor(list(rows), dtype=torch.long,
                                                                           device=self.device))
        if all(n == width for n in lens):
            return table, table.view(-1)
        past = torch.arange(width, device=self.device) >= torch.tensor(list(lens), device=self.device)[:, None]
        table.masked_fill_(past, 0)
        return table, table[~past]

    def _mark_dirty(self, row: int, start: int, end: int) -> None:
        """Record ``[start, end)`` of ``row`` for the next :meth:`sync_mirror` (merged with what the
        row already has pending; nothing without a mirror or for an empty range)."""
        if self.mirror is not None and end > start:
            old = self._dirty.get(row)
            self._dirty[row] = (start, end) if old is None else (min(old[0], start), max(old[1], end))

    def sync_mirror(self) -> None:
        """Copy every range written since the last sync to the device mirror: one host -> device
        transfer of ``(row, position, slot)`` triples and one scatter."""
        if self.mirror is None or not self._dirty:
            return
        rows = torch.tensor(list(self._dirty), dtype=torch.long)
        spans = torch.tensor(list(self._dirty.values()), dtype=torch.long)  # [n, 2]
        lens = spans[:, 1] - spans[:, 0]
        row_of = torch.repeat_interleave(rows, lens)
        first = torch.repeat_interleave(spans[:, 0] - (torch.cumsum(lens, 0) - lens), lens)
        cols = torch.arange(int(lens.sum())) + first  # position of each entry
        packed = torch.stack([row_of, cols, self.req_to_token[row_of, cols]])  # [3, N]
        if self.mirror.device.type == "cuda":
            packed = packed.pin_memory()
        packed = packed.to(self.mirror.device, non_blocking=True)
        self.mirror.index_put_((packed[0], packed[1]), packed[2].to(torch.int32))
        self._dirty.clear()

    def read(self, row: int, start: int, end: int) -> torch.Tensor:
        """A copy of ``req_to_token[row, start:end]`` (``[end - start]`` int64, CPU)."""
        self._check_row(row)
        if not 0 <= start <= end <= self.max_context_len:
            raise ValueError(f"bad range [{start}, {end}) for max_context_len {self.max_context_len}")
        if self._host is not None:
            return torch.from_numpy(self._host[row, start:end].copy())
        return self.req_to_token[row, start:end].to("cpu", copy=True)

    def _check_row(self, row: int) -> None:
        if not 0 <= row < self.size or not self._rows.is_allocated_id(row + 1):
            raise ValueError(f"row {row} is not an allocated request row")

    def check_integrity(self) -> None:
        self._rows.check_integrity()


__all__ = ["ReqToTokenPool", "PoolExhaustedError"]
