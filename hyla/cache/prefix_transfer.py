"""A cached prefix taken out of one engine's cache and put into another's: its tokens, the KV of
every token in every attention layer, and the recurrent state after its last token.

A hybrid model's prefix is usable only with the state after it: external KV stores that bring KV
back without the SSM state garble outputs (LMCache #2845). A ``CachedPrefix`` carries both, so the
engine that receives it hits exactly where the sender would have (``Engine.export_prefix`` /
``import_prefix``; the server's ``/export_prefix`` and ``/import_prefix``): a conversation moved to
another server (a data-parallel worker that is less loaded, a replacement), or a prompt computed by
one server and decoded by another (prefill/decode disaggregation), resumes with the same tokens
and logits it would have had where it was computed.

A prefix may carry the KV of its positions from ``kv_start`` on only (``export_prefix(..., kv_from=)``,
``drop_kv_before``): for a receiver whose cache already holds the KV before (a decode server that served
a conversation's earlier turns), so that only what it lacks travels. The state is whole either way.

Its data sit in CPU pools of the cache's own layout (``KVPool`` of the prefix's tokens at page size
1, ``StatePool`` of one slot), so copies in and out are the pools' ``copy_from``, which checks that
the two layouts agree. ``to_bytes`` / ``from_bytes``: safetensors, the rows of every buffer in
position order and the tokens, namespace and sizes as metadata; ``from_bytes`` builds the pools of
the *receiving* cache's layout and refuses (``ValueError``) a buffer of another shape or dtype — a
prefix of another model, another KV dtype, another draft model; ``check_fits`` checks a prefix object's
layout the same way. ``check_values`` refuses NaN and infinite values in its KV rows or state (one
read of them: their minimum and maximum, a float8 buffer's byte counts; several times cheaper than
the copy in). ``weight_version``: the name of the weights that computed it, and ``weights_digest``: a
digest of their values (an update may leave the name as it was), which the receiver compares with its own
(``Engine.import_prefix``); both opaque here. Knows nothing of models.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from dataclasses import dataclass
from typing import Any, Hashable, Iterator, Sequence

import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from hyla.cache.kv_pool import KVPool
from hyla.cache.layout import CacheLayout
from hyla.cache.radix_types import SubNamespace
from hyla.cache.state_pool import StatePool
from hyla.cache.transfer import as_bytes, put_rows_

FORMAT = "hyla-cached-prefix-1"
CHECK_BLOCK_BYTES = 64 << 20  # rows gathered at a time to check them where they are not one run (``_row_blocks``)


@dataclass
class CachedPrefix:
    """``token_ids`` in ``namespace``, the KV of positions ``kv_start`` on (position ``i`` at
    ``kv_rows[i - kv_start]`` of ``kv``) and, for a cache with states, the state after the last token
    (``state_slot`` of ``state``), computed by the weights named ``weight_version`` (None: not named) whose values'
    digest is ``weights_digest`` (None: not known)."""

    token_ids: tuple[int, ...]
    namespace: Hashable
    kv: KVPool
    kv_rows: torch.Tensor
    state: StatePool | None
    state_slot: int | None
    kv_start: int = 0
    weight_version: str | None = None
    weights_digest: str | None = None

    def __len__(self) -> int:
        return len(self.token_ids)

    @classmethod
    def empty(cls, layout: CacheLayout, token_ids: Sequence[int], namespace: Hashable,
              with_state: bool, kv_start: int = 0) -> "CachedPrefix":
        """Pools for the KV of ``token_ids``' positions ``kv_start`` on (and a state slot), allocated and
        not filled yet."""
        _check_positions(len(token_ids), kv_start)
        n = len(token_ids) - kv_start
        kv = KVPool.from_layout(layout, n, 1, "cpu")
        state = StatePool.from_layout(layout, 1, "cpu") if with_state else None
        slot = int(state.alloc(1, zero=False)[0]) if state is not None else None
        return cls(tuple(int(t) for t in token_ids), namespace, kv, kv.alloc(n), state, slot, kv_start)

    @classmethod
    def gather(cls, layout: CacheLayout, token_ids: Sequence[int], namespace: Hashable, kv_pool: KVPool,
               kv_slots: torch.Tensor, state_pool: StatePool | None, state_slot: int | None,
               kv_start: int = 0) -> "CachedPrefix":
        """A copy of the KV of ``token_ids``' positions ``kv_start`` on, in ``kv_pool``'s slots
        ``kv_slots``, and of ``state_pool``'s slot ``state_slot`` (None: a cache without states)."""
        if len(kv_slots) != len(token_ids) - kv_start:
            raise ValueError(f"{len(token_ids) - kv_start} positions and {len(kv_slots)} KV slots")
        out = cls.empty(layout, token_ids, namespace, state_pool is not None, kv_start)
        out.kv.copy_from(kv_pool, kv_slots, out.kv_rows)
        if state_pool is not None:
            out.state.copy_from(state_pool, [state_slot], [out.state_slot])
        return out

    def check_values(self) -> None:
        """``ValueError`` unless the KV rows and the state this prefix carries hold only finite values
        (``_check_finite``): what ``Engine.import_prefix`` checks of any prefix, bytes or object, on the
        calling thread (one read of the rows, off the scheduler thread that copies them in)."""
        _check_finite(self._buffers())

    def check_fits(self, kv_pool: KVPool, state_pool: StatePool | None) -> None:
        """``ValueError`` unless this prefix can be copied into pools of ``kv_pool``'s and ``state_pool``'s
        layout (None: a cache without states) as it stands (a prefix object made elsewhere than by
        ``from_bytes``, which builds it in the receiver's layout): what ``CacheManager.import_prefix``
        checks before anything is allocated or evicted for it."""
        _check_positions(len(self), self.kv_start)
        if len(self.kv_rows) != len(self) - self.kv_start or not self.kv.is_allocated(self.kv_rows):
            raise ValueError(f"a cached prefix of {len(self)} tokens from position {self.kv_start} holds "
                             f"{len(self.kv_rows)} KV rows, not all of them allocated in its pool")
        if self.kv.buffer_shapes != kv_pool.buffer_shapes:
            raise ValueError("a cached prefix of another model or cache layout: its KV buffers are "
                             f"{self.kv.buffer_shapes}, this cache's {kv_pool.buffer_shapes}")
        _check_state_presence(self.state is not None, state_pool is not None)
        if self.state is not None and (self.state.buffer_kinds != state_pool.buffer_kinds
                                       or not self.state.is_allocated([self.state_slot])):
            raise ValueError("a cached prefix of another model or cache layout: its state is not one this cache "
                             "holds (or its slot is not allocated in its pool)")

    def drop_kv_before(self, position: int) -> "CachedPrefix":
        """This prefix without the KV of the positions before ``position`` (at most its last token's;
        the pools are shared: only what ``to_bytes`` writes shrinks)."""
        position = max(self.kv_start, min(position, len(self) - 1))
        return dataclasses.replace(self, kv_rows=self.kv_rows[position - self.kv_start:], kv_start=position)

    # ------------------------------------------------------------------------------------------
    # bytes
    # ------------------------------------------------------------------------------------------
    def _buffers(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Every buffer with the rows of this prefix in it, by name."""
        out = {}
        for i, (k, v) in enumerate(zip(self.kv.k_buffers, self.kv.v_buffers)):
            out[f"k.{i}"], out[f"v.{i}"] = (k, self.kv_rows), (v, self.kv_rows)
        if self.state is not None:
            rows = torch.tensor([self.state_slot])
            for i, buf in enumerate(self.state.all_buffers()):
                if buf.numel():
                    out[f"state.{i}"] = (buf, rows)
        return out

    def to_bytes(self) -> bytes:
        """The prefix as safetensors bytes (the module docstring)."""
        tensors = {name: buf.index_select(0, rows).contiguous() for name, (buf, rows) in self._buffers().items()}
        meta = {"format": FORMAT, "token_ids": json.dumps(list(self.token_ids)),
                "namespace": json.dumps(_namespace_to_json(self.namespace)),
                "has_state": json.dumps(self.state is not None), "kv_start": json.dumps(self.kv_start),
                "weight_version": json.dumps(self.weight_version), "weights_digest": json.dumps(self.weights_digest)}
        return save_tensors(tensors, metadata=meta)

    @classmethod
    def from_bytes(cls, data: bytes, layout: CacheLayout, with_state: bool) -> "CachedPrefix":
        """A prefix of ``to_bytes`` for a cache of ``layout`` (``with_state``: whose tree keeps states);
        ``ValueError`` for bytes that are not one, or one of another layout."""
        try:
            tensors = load_tensors(data)
            meta = _metadata(data)
            if meta.get("format") != FORMAT:
                raise ValueError(f"not a hyla cached prefix (format {meta.get('format')!r}, expected {FORMAT!r})")
            token_ids = json.loads(meta["token_ids"])
            namespace = _namespace_from_json(json.loads(meta["namespace"]))
            has_state = json.loads(meta["has_state"])
            kv_start = json.loads(meta.get("kv_start", "0"))
            weight_version = json.loads(meta.get("weight_version", "null"))
            weights_digest = json.loads(meta.get("weights_digest", "null"))
        except ValueError:
            raise
        except Exception as exc:  # safetensors' own errors, a missing key, bad JSON
            raise ValueError(f"not a hyla cached prefix: {exc}") from None
        if not isinstance(token_ids, list) or not token_ids or not all(
                isinstance(t, int) and not isinstance(t, bool) and -2**63 <= t < 2**63 for t in token_ids):
            # (the tree's keys: token ids, or negative ids naming a prompt's images, which the engine checks)
            raise ValueError("a cached prefix's token_ids must be a non-empty list of the cache's keys (64-bit ints)")
        if isinstance(kv_start, bool) or not isinstance(kv_start, int):
            raise ValueError(f"a cached prefix's kv_start must be a position, got {kv_start!r}")
        for field_name, value in (("weight_version", weight_version), ("weights_digest", weights_digest)):
            if value is not None and not isinstance(value, str):
                raise ValueError(f"a cached prefix's {field_name} must be a string, got {value!r}")
        if not isinstance(has_state, bool):
            raise ValueError(f"a cached prefix's has_state must be true or false, got {has_state!r}")
        _check_state_presence(has_state, with_state)
        _check_positions(len(token_ids), kv_start)
        rows = len(token_ids) - kv_start  # the KV rows its tensors must hold: checked before pools that size are made
        short = sorted(name for name, t in tensors.items()
                       if t.dim() == 0 or t.shape[0] != (rows if name.startswith(("k.", "v.")) else 1))
        if short:
            raise ValueError(f"the cached prefix's tensors {short[:4]} do not hold one row per position from kv_start "
                             f"({rows}; one state row)")
        out = cls.empty(layout, token_ids, namespace, has_state, kv_start)
        want = out._buffers()
        if set(tensors) != set(want):
            raise ValueError(f"the cached prefix's buffers {sorted(tensors)} are not this cache's {sorted(want)}: "
                             "a prefix of another model or cache layout")
        for name, (buf, rows) in want.items():
            t = tensors[name]
            if t.dtype != buf.dtype or tuple(t.shape) != (len(rows), *buf.shape[1:]):
                raise ValueError(f"the cached prefix's {name} is {tuple(t.shape)} {t.dtype}, this cache's "
                                 f"{(len(rows), *buf.shape[1:])} {buf.dtype}: a prefix of another model or cache layout")
            put_rows_(buf, rows, t)
        out.weight_version, out.weights_digest = weight_version, weights_digest
        return out


def _check_positions(num_tokens: int, kv_start: int) -> None:
    """``ValueError`` unless a prefix of ``num_tokens`` tokens carries KV from ``kv_start`` on, its last token's
    at least."""
    if not num_tokens:
        raise ValueError("a cached prefix has at least one token")
    if not 0 <= kv_start < num_tokens:
        raise ValueError(f"a cached prefix of {num_tokens} tokens carries the KV of its last one at least: "
                         f"kv_start {kv_start} is out of range")


def _check_finite(buffers: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
    """``ValueError`` naming the first of ``buffers`` (a prefix's, ``_buffers``) whose rows hold a NaN or an
    infinity: no model's cache holds one, and one imported would poison every request that hits it."""
    for name, (buf, rows) in buffers.items():
        if any(_holds_nonfinite(block) for block in _row_blocks(buf, rows)):
            raise ValueError(f"the cached prefix's {name} holds NaN or infinite values: not a prefix a model computed")


def _row_blocks(buf: torch.Tensor, rows: torch.Tensor) -> Iterator[torch.Tensor]:
    """Rows ``rows`` of ``buf``: one view where they are a run of consecutive rows (what ``from_bytes`` and
    ``gather`` allocate), else copies of at most ``CHECK_BLOCK_BYTES`` each."""
    n = len(rows)
    if not n:
        return
    first = int(rows[0])
    if n == 1 or (int(rows[-1]) - first == n - 1 and bool((rows.diff() == 1).all())):
        yield buf[first:first + n]
        return
    per_block = max(1, CHECK_BLOCK_BYTES // max(1, buf[0].numel() * buf.dtype.itemsize))
    for block in rows.split(per_block):
        yield as_bytes(buf).index_select(0, block).view(buf.dtype)


def _holds_nonfinite(t: torch.Tensor) -> bool:
    """Whether a tensor holds a NaN or an infinity, in one read of it without a tensor of its size: its
    minimum and maximum (a NaN is both, an infinity one of them); a float8 one by counting its bytes
    (no min/max kernels), those that are NaN or infinite in its format (``_nonfinite_bytes``)."""
    if not t.dtype.is_floating_point or not t.numel():
        return False
    if t.dtype.itemsize == 1:
        counts = torch.bincount(as_bytes(t).reshape(-1), minlength=256)
        return bool(counts[_nonfinite_bytes(t.dtype)].any())
    lo, hi = torch.aminmax(t)
    return not (math.isfinite(lo.item()) and math.isfinite(hi.item()))


@functools.lru_cache(maxsize=None)
def _nonfinite_bytes(dtype: torch.dtype) -> torch.Tensor:
    """Which of the 256 bytes are a NaN or an infinity as a one-byte float ``dtype`` (a 256-entry mask)."""
    return ~torch.isfinite(torch.arange(256, dtype=torch.uint8).view(dtype).float())


def _check_state_presence(has_state: bool, with_state: bool) -> None:
    """``ValueError`` unless a prefix holds a state (``has_state``) exactly where the receiving cache keeps them."""
    if has_state != with_state:
        raise ValueError("the cached prefix " + ("holds a state, which this cache keeps none of" if has_state else
                                                 "holds no state, which this cache needs"))


def _metadata(data: bytes) -> dict[str, str]:
    """The ``__metadata__`` of safetensors bytes (its 8-byte header length, then the JSON header)."""
    n = int.from_bytes(data[:8], "little")
    return json.loads(data[8:8 + n]).get("__metadata__") or {}


def _namespace_to_json(namespace: Hashable) -> Any:
    """A cache namespace (None, a str, an int, tuples of them, a ``SubNamespace`` of one) as JSON: a tuple as
    ``{"tuple": [...]}``, a ``SubNamespace`` as ``{"sub": [kind, key, namespace]}``."""
    if namespace is None or isinstance(namespace, (str, int)) and not isinstance(namespace, bool):
        return namespace
    if isinstance(namespace, tuple):
        return {"tuple": [_namespace_to_json(x) for x in namespace]}
    if isinstance(namespace, SubNamespace) and isinstance(namespace.kind, str) and isinstance(namespace.key, str):
        return {"sub": [namespace.kind, namespace.key, _namespace_to_json(namespace.namespace)]}
    raise ValueError(f"a cached prefix's namespace must be None, a str, an int, a tuple of them or a SubNamespace "
                     f"of one, got {type(namespace).__name__}")


def _namespace_from_json(value: Any) -> Hashable:
    if value is None or isinstance(value, (str, int)) and not isinstance(value, bool):
        return value
    if isinstance(value, dict) and set(value) == {"tuple"} and isinstance(value["tuple"], list):
        return tuple(_namespace_from_json(x) for x in value["tuple"])
    if isinstance(value, dict) and set(value) == {"sub"} and isinstance(value["sub"], list) and len(value["sub"]) == 3 \
            and all(isinstance(x, str) for x in value["sub"][:2]):
        kind, key, inner = value["sub"]
        return SubNamespace(kind, key, _namespace_from_json(inner))
    raise ValueError(f"a cached prefix's namespace is not one: {value!r}")


__all__ = ["CachedPrefix"]
