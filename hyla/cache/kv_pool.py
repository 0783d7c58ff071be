"""The KV pool: per attention layer K and V buffers over token slots, and a paged allocator.

Slot layout (see docs/architecture.md): page ``p`` covers slots ``[p*page_size, (p+1)*page_size)``;
page 0 is the sentinel page (padding writes land in slot 0) and is never handed out, so the usable
slots are ``page_size .. num_tokens + page_size - 1`` and each buffer has ``num_tokens + page_size``
rows. With ``page_size == 1`` that is exactly slots ``1..num_tokens``.

Allocation is by whole pages; a sequence's token at position ``i`` always sits at an offset
``i % page_size`` inside its page, so the pages of a sequence are exactly the tree's pages.
``free`` releases every page that contains one of the given slots: a caller frees a page by
passing the slots it used in it (e.g. a request's private tail page).

A pool may also hold a *companion* model's K/V on the same slots (``companion``, a
``CacheLayout``: speculative decoding's draft model): its buffers follow this pool's own in
``k_buffers`` / ``v_buffers``, in their own head count, head dim and dtype. Every slot operation
(allocation, ``free``, ``copy``) covers them, so what happens to a token's slot happens to both
models' K/V of that token.

Accounting mode (``accounting=True``) keeps the allocator and the byte counts and allocates no
tensors, so a simulator can drive the real trees at the size of an 80B model.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from hyla.cache.allocator import FreeList, IndexLike, PoolExhaustedError, as_index_array
from hyla.cache.layout import CacheLayout
from hyla.cache.transfer import Landing, as_bytes, copy_rows, to_device


class KVPool:
    """Token KV slots for every attention layer, allocated by pages.

    ``alloc*`` raise ``PoolExhaustedError`` when short of pages; check with the matching
    ``can_alloc*`` first (or evict from the tree). All returned indices are 1-D ``int64`` CPU tensors.
    """

    def __init__(
        self,
        num_tokens: int,
        page_size: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cpu",
        accounting: bool = False,
        companion: CacheLayout | None = None,
    ) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if num_tokens < page_size or num_tokens % page_size:
            raise ValueError(f"num_tokens ({num_tokens}) must be a positive multiple of page_size ({page_size})")
        self.size = num_tokens
        self.page_size = page_size
        self.num_pages = num_tokens // page_size
        self.num_layers = num_layers
        self.dtype = dtype
        self.device = torch.device(device)
        self.accounting = accounting
        layout = CacheLayout(num_attention_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim,
                             kv_dtype=dtype, companion=companion)
        self.bytes_per_token = layout.kv_bytes_per_token  # K and V of every layer, the companion's too
        self.companion = companion
        # (heads, head dim, dtype) of each buffer pair: this pool's layers, then the companion's
        shapes = [(num_kv_heads, head_dim, dtype)] * num_layers
        if companion is not None:
            shapes += [(companion.num_kv_heads, companion.head_dim, companion.kv_dtype)] * companion.num_attention_layers
        self.num_buffers = len(shapes)
        self.buffer_shapes = tuple(shapes)  # (heads, head dim, dtype) per buffer pair: what copy_from checks
        self._pages = FreeList(self.num_pages)
        self.k_buffers: list[torch.Tensor] = []
        self.v_buffers: list[torch.Tensor] = []
        if not accounting:
            rows = num_tokens + page_size
            for h, d, dt in shapes:
                self.k_buffers.append(torch.zeros(rows, h, d, dtype=dt, device=self.device))  # [S, Hkv, D]
                self.v_buffers.append(torch.zeros(rows, h, d, dtype=dt, device=self.device))  # [S, Hkv, D]

    @classmethod
    def from_layout(
        cls,
        layout: CacheLayout,
        num_tokens: int,
        page_size: int = 1,
        device: torch.device | str = "cpu",
        accounting: bool = False,
    ) -> "KVPool":
        """The KV pool of ``layout`` (its attention layers, KV heads, head dim and KV dtype; then its
        companion's)."""
        return cls(num_tokens, page_size, layout.num_attention_layers, layout.num_kv_heads, layout.head_dim,
                   layout.kv_dtype, device, accounting, layout.companion)

    # ------------------------------------------------------------------------------------------
    # sizes
    # ------------------------------------------------------------------------------------------
    def available_size(self) -> int:
        """Free token slots (free pages x page_size)."""
        return self._pages.num_free() * self.page_size

    def used_size(self) -> int:
        return self.size - self.available_size()

    @property
    def total_bytes(self) -> int:
        """Bytes the K/V buffers occupy (or would, in accounting mode), sentinel page included."""
        return self.bytes_for(self.size, self.page_size, self.bytes_per_token)

    @staticmethod
    def bytes_for(num_tokens: int, page_size: int, bytes_per_token: int) -> int:
        """Bytes of a pool of ``num_tokens`` slots (whole pages) before it is built: its buffers'
        rows are the slots and the sentinel page."""
        return (num_tokens + page_size) * bytes_per_token

    # ------------------------------------------------------------------------------------------
    # allocation
    # ------------------------------------------------------------------------------------------
    def can_alloc(self, num_tokens: int) -> bool:
        return -(-num_tokens // self.page_size) <= self._pages.num_free()

    def alloc(self, num_tokens: int) -> torch.Tensor:
        """Slots for ``num_tokens`` tokens of a new sequence, on fresh pages (the unused rest of the
        last page belongs to the caller too: continue it with ``alloc_extend``)."""
        return self.alloc_extend([0], [-1], [num_tokens])

    def pages_needed(self, prefix_lens: Sequence[int], extend_lens: Sequence[int]) -> int:
        """New pages an extend takes: a sequence's last partial page is continued first."""
        ps = self.page_size
        return sum(-(-(p + e) // ps) - -(-p // ps) for p, e in zip(prefix_lens, extend_lens))

    def can_alloc_extend(self, prefix_lens: Sequence[int], extend_lens: Sequence[int]) -> bool:
        return self.pages_needed(prefix_lens, extend_lens) <= self._pages.num_free()

    def alloc_extend(
        self, prefix_lens: Sequence[int], last_locs: Sequence[int], extend_lens: Sequence[int]
    ) -> torch.Tensor:
        """Slots for ``extend_lens[i]`` new tokens of sequence i, which already has ``prefix_lens[i]``
        tokens, the last of them in slot ``last_locs[i]`` (ignored when the prefix ends on a page
        boundary; -1 by convention). Fills the rest of the last partial page first, then fresh pages.

        Returns the packed slots ``[sum(extend_lens)]`` in sequence order.
        """
        prefix_lens, last_locs, extend_lens = _as_lists(prefix_lens, last_locs, extend_lens)
        ps = self.page_size
        new_pages = 0
        for p, loc, e in zip(prefix_lens, last_locs, extend_lens):
            if p < 0 or e < 0:
                raise ValueError(f"prefix and extend lengths must be >= 0, got {p} and {e}")
            if p % ps and e:
                self._check_last_loc(p, loc)
            new_pages += -(-(p + e) // ps) - -(-p // ps)
        pages = self._pages.alloc(new_pages)  # raises PoolExhaustedError before any change
        if ps == 1:  # every token a page of its own, in sequence order
            return torch.from_numpy(pages.astype(np.int64, copy=False))
        if all(e == 1 for e in extend_lens):  # a decode step: continue the last page, or start a fresh one
            fresh = np.array([p % ps == 0 for p in prefix_lens])
            out_decode = np.array(last_locs, dtype=np.int64) + 1
            out_decode[fresh] = pages * ps
            return torch.from_numpy(out_decode)
        out: list[np.ndarray] = []
        used = 0
        for p, loc, e in zip(prefix_lens, last_locs, extend_lens):
            part1 = min(e, -p % ps)  # rest of the last partial page
            if part1:
                out.append(np.arange(loc + 1, loc + 1 + part1, dtype=np.int64))
            rest = e - part1
            k = -(-rest // ps)
            if k:
                slots = (pages[used : used + k, None] * ps + np.arange(ps, dtype=np.int64)).ravel()  # [k*ps]
                out.append(slots[:rest])
                used += k
        if not out:
            return torch.zeros(0, dtype=torch.int64)
        return torch.from_numpy(np.concatenate(out))

    def can_alloc_decode(self, seq_lens: Sequence[int]) -> bool:
        ps = self.page_size
        return sum(1 for n in _as_lists(seq_lens)[0] if n % ps == 0) <= self._pages.num_free()

    def alloc_decode(self, seq_lens: Sequence[int], last_locs: Sequence[int]) -> torch.Tensor:
        """One slot per sequence for the token at position ``seq_lens[i]`` (the number of tokens
        already cached); ``last_locs[i]`` is the slot of the token before it. A new page is taken
        only when the current one is full (``seq_lens[i] % page_size == 0``). Returns ``[B]``."""
        seq_lens, last_locs = _as_lists(seq_lens, last_locs)
        ps = self.page_size
        for n, loc in zip(seq_lens, last_locs):
            if n < 0:
                raise ValueError(f"sequence lengths must be >= 0, got {n}")
            if n % ps:
                self._check_last_loc(n, loc)
        pages = iter(self._pages.alloc(sum(1 for n in seq_lens if n % ps == 0)).tolist())
        out = [next(pages) * ps if n % ps == 0 else loc + 1 for n, loc in zip(seq_lens, last_locs)]
        return torch.tensor(out, dtype=torch.int64)

    def _check_last_loc(self, prefix_len: int, loc: int) -> None:
        """The slot of token ``prefix_len - 1`` must sit at offset ``(prefix_len - 1) % ps`` of an allocated page."""
        ps = self.page_size
        page = loc // ps if loc >= 0 else -1
        if loc < 0 or loc % ps != (prefix_len - 1) % ps or not self._pages.is_allocated(np.array([page])):
            raise ValueError(
                f"last_loc {loc} cannot hold token {prefix_len - 1} of a sequence: it must lie at offset "
                f"{(prefix_len - 1) % ps} of an allocated page (page_size={ps})"
            )

    def free(self, indices: IndexLike) -> None:
        """Release every page containing one of ``indices`` (slots of the sentinel page are rejected)."""
        idx = as_index_array(indices)
        if idx.size == 0:
            return
        if self.page_size == 1:
            self._pages.free(idx)
        else:
            self._pages.free(np.unique(idx // self.page_size), known_unique=True)

    def free_pages(self, page_ids: IndexLike, *, known_unique: bool = False) -> None:
        """Release whole pages by page id (what the tree does when it evicts: its pages are
        distinct by construction, so it passes ``known_unique`` and the pool skips its sort)."""
        self._pages.free(as_index_array(page_ids), known_unique=known_unique)

    def copy(self, src: IndexLike, dst: IndexLike) -> None:
        """K and V of slot ``src[i]`` into slot ``dst[i]``, every layer (a tree verify step moves its
        accepted tokens' KV to their positions' slots). All sources are read before any destination
        is written, so the two may overlap; ``dst`` must be distinct, and every slot allocated."""
        s, d = self._copy_slots(self, src, dst)
        if s.size == 0 or self.accounting:
            return
        si, di = to_device(s, torch.long, self.device), to_device(d, torch.long, self.device)
        for buf in map(as_bytes, (*self.k_buffers, *self.v_buffers)):  # (float8 buffers as their bytes)
            buf.index_copy_(0, di, buf.index_select(0, si))

    def copy_from(self, other: "KVPool", src: IndexLike, dst: IndexLike, defer: bool = False) -> Landing | None:
        """K and V of ``other``'s slot ``src[i]`` into this pool's slot ``dst[i]``, every layer: a pool of
        the same layout on another device (the host tier, ``HostCache``). Slots must be allocated in
        their pools; ``dst`` distinct. No data moves where either pool is in accounting mode. With
        ``defer`` (this pool in host memory) the rows arrive when the returned ``Landing`` lands
        (``transfer.copy_rows``)."""
        if other.buffer_shapes != self.buffer_shapes:
            raise ValueError(f"copy_from a KV pool of another layout: {other.buffer_shapes} vs {self.buffer_shapes}")
        s, d = self._copy_slots(other, src, dst)
        if s.size and not (self.accounting or other.accounting):
            return copy_rows((*self.k_buffers, *self.v_buffers), d, (*other.k_buffers, *other.v_buffers), s, defer)
        return None

    def _copy_slots(self, source: "KVPool", src: IndexLike, dst: IndexLike) -> tuple[np.ndarray, np.ndarray]:
        """A copy's slots as arrays, checked: as many sources (allocated in ``source``) as destinations
        (distinct, allocated here)."""
        s, d = as_index_array(src), as_index_array(dst)
        if s.size != d.size:
            raise ValueError(f"copy needs as many sources as destinations, got {s.size} and {d.size}")
        if len(set(d.tolist())) != d.size:
            raise ValueError("copy destinations must be distinct")
        if s.size and not (source.is_allocated(s) and self.is_allocated(d)):
            raise ValueError("copy between slots that are not allocated")
        return s, d

    def is_allocated(self, indices: IndexLike) -> bool:
        """True iff every slot lies on an allocated page."""
        idx = as_index_array(indices)
        return self._pages.is_allocated(idx // self.page_size if self.page_size > 1 else idx)

    def allocated_pages(self) -> np.ndarray:
        """Sorted ids of the allocated pages (for tests and integrity checks; O(num_pages))."""
        return np.flatnonzero(self._pages.allocated_mask())

    def check_integrity(self) -> None:
        self._pages.check_integrity()
        if not self.accounting:
            rows = self.size + self.page_size
            assert len(self.k_buffers) == len(self.v_buffers) == self.num_buffers
            assert all(b.shape[0] == rows for b in (*self.k_buffers, *self.v_buffers)), "buffer rows"


def _as_lists(*seqs: Sequence[int] | torch.Tensor) -> list[list[int]]:
    out = [s.tolist() if isinstance(s, (torch.Tensor, np.ndarray)) else list(s) for s in seqs]
    if len({len(s) for s in out}) > 1:
        raise ValueError(f"per-sequence arguments disagree on the batch size: {[len(s) for s in out]}")
    return out


__all__ = ["KVPool", "PoolExhaustedError"]
