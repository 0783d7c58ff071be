"""The request table: request row → the KV slot of each of its tokens.

Row ``r`` of ``req_to_token`` lists, position by position, the KV slots of the request in row
``r`` (its cached prefix, the tree's slots, followed by its private slots). Rows are handed out by
``alloc`` and returned by ``free``; the table never frees KV slots itself. (A request's own state
slot is kept by the request: the engine's ``Req.state_slot``.)
"""

from __future__ import annotations

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
        self._rows = FreeList(max_reqs)  # ids 1..max_reqs; row = id - 1

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
        idx = torch.as_tensor(as_index_array(kv_indices))
        end = start + idx.numel()
        if start < 0 or end > self.max_context_len:
            raise ValueError(f"positions [{start}, {end}) exceed max_context_len {self.max_context_len}")
        self.req_to_token[row, start:end] = idx.to(self.device)

    def read(self, row: int, start: int, end: int) -> torch.Tensor:
        """A copy of ``req_to_token[row, start:end]`` (``[end - start]`` int64, CPU)."""
        self._check_row(row)
        if not 0 <= start <= end <= self.max_context_len:
            raise ValueError(f"bad range [{start}, {end}) for max_context_len {self.max_context_len}")
        return self.req_to_token[row, start:end].to("cpu", copy=True)

    def _check_row(self, row: int) -> None:
        if not 0 <= row < self.size or not self._rows.is_allocated(as_index_array([row + 1])):
            raise ValueError(f"row {row} is not an allocated request row")

    def check_integrity(self) -> None:
        self._rows.check_integrity()


__all__ = ["ReqToTokenPool", "PoolExhaustedError"]
