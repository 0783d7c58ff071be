"""A free list of integer ids whose alloc/free cost is proportional to what is allocated or freed.

Every pool in ``hyla.cache`` (KV pages, state slots, request rows) hands out ids ``1..capacity``
from one of these; id 0 is reserved for the pool's sentinel and is never handed out. The free ids
live in a preallocated stack (numpy ``int64``) with a top pointer, and a boolean mask records which
ids are free so that a double free or a free of a never-allocated id is caught in O(k) instead of
silently corrupting the pool (SGLang's CPU allocator copies its whole free list on every free; we
never touch more than the ids in the call).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch


class PoolExhaustedError(RuntimeError):
    """Raised by ``alloc`` when the pool has fewer free ids than asked for (check ``can_alloc`` first)."""


IndexLike = torch.Tensor | np.ndarray | Sequence[int]


def as_index_array(indices: IndexLike) -> np.ndarray:
    """Any 1-D collection of integer ids as a 1-D ``int64`` numpy array (no copy when possible:
    an ``int64`` CPU tensor or array comes back as a view of the same memory)."""
    if type(indices) is torch.Tensor and indices.dtype is torch.int64 and indices.device.type == "cpu" \
            and indices.dim() == 1:
        return indices.numpy()  # the hot path: what the engine and the trees pass around
    if isinstance(indices, torch.Tensor):
        if indices.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8):
            raise ValueError(f"indices must be an integer tensor, got {indices.dtype}")
        arr = indices.detach().to("cpu", torch.int64).numpy()
    else:
        arr = np.asarray(indices)
        if arr.size == 0:
            arr = arr.astype(np.int64)
        if arr.dtype.kind not in "iu":
            raise ValueError(f"indices must be integers, got dtype {arr.dtype}")
        arr = arr.astype(np.int64, copy=False)
    if arr.ndim != 1:
        raise ValueError(f"indices must be 1-D, got shape {tuple(arr.shape)}")
    return arr


class FreeList:
    """LIFO free list over ids ``1..capacity``.

    Invariants (checked by ``check_integrity``): ``stack[:top]`` holds every free id exactly once,
    ``is_free[i]`` is True iff ``i`` is in ``stack[:top]``, and id 0 is never free.
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        # reversed so that the first allocations return 1, 2, 3, ... (readable tests and traces)
        self._stack = np.arange(capacity, 0, -1, dtype=np.int64)  # [capacity]
        self._top = capacity
        self._is_free = np.ones(capacity + 1, dtype=bool)  # [capacity + 1]
        self._is_free[0] = False

    def num_free(self) -> int:
        return self._top

    def alloc(self, k: int) -> np.ndarray:
        """Pop ``k`` free ids (a fresh array). Raises PoolExhaustedError if fewer are free."""
        if k < 0:
            raise ValueError(f"cannot allocate a negative number of ids ({k})")
        if k > self._top:
            raise PoolExhaustedError(f"asked for {k} ids, only {self._top} of {self.capacity} are free")
        ids = self._stack[self._top - k : self._top][::-1].copy()  # [k]
        self._top -= k
        self._is_free[ids] = False
        return ids

    def free(self, ids: np.ndarray, *, known_unique: bool = False) -> None:
        """Push ``ids`` back. They must be distinct, in range and currently allocated; the check
        for distinctness sorts (O(k log k)) unless the caller already knows (``known_unique``)."""
        k = ids.size
        if k == 0:
            return
        if ids.min() < 1 or ids.max() > self.capacity:
            raise ValueError(f"ids must lie in [1, {self.capacity}], got range [{ids.min()}, {ids.max()}]")
        already = self._is_free[ids]
        if already.any():
            raise ValueError(f"double free: ids {ids[already][:8].tolist()} are already free")
        if not known_unique and k > 1 and np.unique(ids).size != k:
            raise ValueError("the same id appears more than once in one free() call")
        self._is_free[ids] = True
        self._stack[self._top : self._top + k] = ids
        self._top += k

    def is_allocated_id(self, i: int) -> bool:
        """``is_allocated`` for one id, without numpy overhead."""
        return 0 < i <= self.capacity and not self._is_free[i]

    def is_allocated(self, ids: np.ndarray) -> bool:
        """True iff every id is in range and currently allocated."""
        if ids.size == 0:
            return True
        if ids.min() < 1 or ids.max() > self.capacity:
            return False
        return not self._is_free[ids].any()

    def allocated_mask(self) -> np.ndarray:
        """``[capacity + 1]`` bool, True for allocated ids (index 0, the sentinel, is False)."""
        mask = ~self._is_free
        mask[0] = False
        return mask

    def check_integrity(self) -> None:
        free = self._stack[: self._top]
        assert 0 <= self._top <= self.capacity, "top pointer out of range"
        assert free.size == 0 or (free.min() >= 1 and free.max() <= self.capacity), "free id out of range"
        assert np.unique(free).size == free.size, "an id is on the free list twice"
        mask = np.zeros(self.capacity + 1, dtype=bool)
        mask[free] = True
        assert np.array_equal(mask, self._is_free), "free mask disagrees with the free list"
