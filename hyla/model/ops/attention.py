"""Causal attention over a paged KV pool (prefill with a cached prefix, and decode).

Layout: ``k_buffer`` / ``v_buffer`` are ``[num_slots, Hkv, D]``; a sequence's keys live at the
slots ``kv_indices[kv_indptr[i]:kv_indptr[i+1]]`` in token order: first its ``prefix_lens[i]``
cached tokens, then its ``extend_lens[i]`` new ones (whose slots are ``out_cache_loc``).

Invariants
----------
* The new K/V are written into ``out_cache_loc`` *before* attending, so the new tokens read their
  own K/V back from the pool exactly like cached ones (slot 0 is the padding sentinel: writes there
  are harmless, nobody reads slot 0 as a real token).
* New token ``j`` of sequence ``i`` (absolute position ``prefix_lens[i] + j``) attends to the
  sequence's keys ``0 .. prefix_lens[i] + j`` inclusive: causal over prefix + itself.
* Sliding-window attention (``window = W > 0``, Hugging Face's ``sliding_window``): a query at
  position ``p`` sees only the keys at positions ``p - W < k <= p``, its last ``W`` tokens. Every
  token's K/V stays in the pool; the window is a mask (``window_mask``, ``extend_mask``).
* Softmax is computed in fp32; the output has the dtype of ``q``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Sequence

import torch
import torch.nn.functional as F

from hyla.model.ops.varlen import write_rows_


def paged_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    k_buffer: torch.Tensor,  # [S, Hkv, D]
    v_buffer: torch.Tensor,  # [S, Hkv, D]
    out_cache_loc: torch.Tensor,  # [T] int64
    kv_indices: torch.Tensor,  # [sum(prefix + extend)] int64
    kv_indptr: torch.Tensor,  # [B+1] int64
    prefix_lens: Sequence[int],
    extend_lens: Sequence[int],
    scaling: float,
    tree_masks: Sequence[torch.Tensor | None] | None = None,
    kv_starts: Sequence[int] | None = None,
    window: int = 0,
) -> torch.Tensor:
    """Write the new K/V into their pool slots, then attend causally to prefix + new tokens.

    Returns ``o [T, Hq, D]``. Decode batches (every ``extend_len == 1``) run as one padded batched
    attention; other batches loop over sequences (each a single causal attention call).
    ``tree_masks``: a tree verify step (``ops/tree.py``): new token ``j`` of sequence ``i`` sees the
    prefix and the new tokens ``a`` with ``tree_masks[i][j, a]`` (its ancestors and itself).
    ``kv_starts``: ``kv_indptr`` on the host (``ForwardBatch.kv_starts``), so nothing is read back.
    ``window``: sliding-window attention over the last ``window`` positions (0: none).
    """
    _check_inputs(q, k, v, k_buffer, out_cache_loc, kv_indptr, prefix_lens, extend_lens)
    check_window(window)
    write_rows_(k_buffer, out_cache_loc, k.to(k_buffer.dtype))
    write_rows_(v_buffer, out_cache_loc, v.to(v_buffer.dtype))
    return _attend(q, k_buffer, v_buffer, kv_indices, kv_indptr, prefix_lens, extend_lens, scaling, tree_masks,
                   kv_starts, window)


def paged_attention_written(
    q: torch.Tensor,  # [T, Hq, D]
    k_buffer: torch.Tensor,  # [S, Hkv, D], the new tokens' K already written
    v_buffer: torch.Tensor,  # [S, Hkv, D], the new tokens' V already written
    kv_indices: torch.Tensor,
    kv_indptr: torch.Tensor,
    prefix_lens: Sequence[int],
    extend_lens: Sequence[int],
    scaling: float,
    tree_masks: Sequence[torch.Tensor | None] | None = None,
    kv_starts: Sequence[int] | None = None,
    window: int = 0,
) -> torch.Tensor:
    """:func:`paged_attention` once the new tokens' K/V are in the pool (on CUDA the attention
    layer's prologue kernel writes them: ``gpu.decode_attention.decode_qk_prologue``)."""
    _check_batch(q.shape[0], kv_indptr, prefix_lens, extend_lens)
    check_window(window)
    return _attend(q, k_buffer, v_buffer, kv_indices, kv_indptr, prefix_lens, extend_lens, scaling, tree_masks,
                   kv_starts, window)


def widened(kv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """K/V rows read from a pool, in ``dtype`` for the arithmetic: ``kv.to(dtype)``. A float8 KV cache's rows
    (``kv_cache_dtype``) on a CPU go through a table of the 256 bytes' values (that cast's, so the same
    values): PyTorch's CPU cast from float8 takes ~4 ns an element, the table ~1 (2048 x 2 x 128 values:
    2.1 ms against 0.45). Compiled graphs cast (inductor generates the conversion)."""
    if kv.dtype not in FLOAT8 or kv.device.type != "cpu" or torch.compiler.is_compiling():
        return kv.to(dtype)
    return _float8_values(kv.dtype, dtype).index_select(0, kv.reshape(-1).view(torch.uint8).int()).view(kv.shape)


FLOAT8 = (torch.float8_e4m3fn, torch.float8_e5m2)  # a float8 KV cache's dtypes (engine.args.KV_CACHE_DTYPES)


@functools.cache
def _float8_values(float8: torch.dtype, dtype: torch.dtype) -> torch.Tensor:
    """``[256]``: the value of each ``float8`` byte in ``dtype`` (a constant table, built once per pair)."""
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(float8).to(dtype)


def check_window(window: int) -> None:
    """``ValueError`` unless ``window`` is a sliding window (an int > 0) or 0 (none)."""
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise ValueError(f"window must be an int >= 0 (0: no sliding window), got {window!r}")


def _attend(q, k_buffer, v_buffer, kv_indices, kv_indptr, prefix_lens, extend_lens, scaling, tree_masks, kv_starts,
            window):
    """Both entry points' attention over the pool, their inputs checked."""
    if tree_masks is None and all(n == 1 for n in extend_lens):
        return _decode_attention(q, k_buffer, v_buffer, kv_indices, kv_indptr, prefix_lens, scaling, window)
    return _extend_attention(q, k_buffer, v_buffer, kv_indices, kv_indptr, prefix_lens, extend_lens, scaling,
                             tree_masks, kv_starts, window)


def _check_batch(num_tokens: int, kv_indptr: torch.Tensor, prefix_lens: Sequence[int],
                 extend_lens: Sequence[int]) -> None:
    if sum(extend_lens) != num_tokens:
        raise ValueError(f"extend_lens sum to {sum(extend_lens)}, but there are {num_tokens} new tokens")
    if len(prefix_lens) != len(extend_lens) or kv_indptr.numel() != len(extend_lens) + 1:
        raise ValueError("prefix_lens, extend_lens and kv_indptr disagree on the batch size")


def _check_inputs(q, k, v, k_buffer, out_cache_loc, kv_indptr, prefix_lens, extend_lens) -> None:
    t = q.shape[0]
    if k.shape[0] != t or v.shape[0] != t or out_cache_loc.numel() != t:
        raise ValueError(f"q, k, v and out_cache_loc disagree on the token count ({t})")
    _check_batch(t, kv_indptr, prefix_lens, extend_lens)
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads is not a multiple of {k.shape[1]} KV heads")
    if k.shape[1:] != k_buffer.shape[1:]:
        raise ValueError(f"new keys {tuple(k.shape[1:])} do not fit the KV buffer {tuple(k_buffer.shape[1:])}")


def _extend_attention(q, k_buffer, v_buffer, kv_indices, kv_indptr, prefix_lens, extend_lens, scaling,
                      tree_masks=None, kv_starts=None, window=0):
    out = torch.empty_like(q)  # [T, Hq, D]
    indptr = list(kv_starts) if kv_starts is not None else kv_indptr.tolist()
    start = 0
    for i, (prefix, extend) in enumerate(zip(prefix_lens, extend_lens)):
        if extend == 0:
            continue
        if indptr[i + 1] - indptr[i] != prefix + extend:
            raise ValueError(f"sequence {i}: kv_indptr gives {indptr[i + 1] - indptr[i]} slots, expected {prefix + extend}")
        slots = kv_indices[indptr[i] : indptr[i + 1]]
        if window and prefix >= window:  # no new token sees the keys before prefix - window + 1 (a tree's neither:
            lo = prefix - window + 1  # its tokens sit at prefix + depth): a sliding layer reads its window only
            slots, prefix = slots[lo:], prefix - lo
        qi = q[start : start + extend].transpose(0, 1)  # [Hq, E, D]
        ki = widened(k_buffer.index_select(0, slots), q.dtype).transpose(0, 1)  # [Hkv, L, D]
        vi = widened(v_buffer.index_select(0, slots), q.dtype).transpose(0, 1)  # [Hkv, L, D]
        tree = tree_masks[i] if tree_masks is not None else None
        out[start : start + extend] = extend_sdpa(qi, ki, vi, prefix, tree, scaling, window).transpose(0, 1)
        start += extend
    return out


def extend_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix: int, tree: torch.Tensor | None,
                scaling: float, window: int = 0) -> torch.Tensor:
    """One sequence's new tokens over its keys: ``q [Hq, E, D]``, ``k [Hkv, prefix + E, D]``,
    ``v [Hkv, prefix + E, Dv]`` -> ``[Hq, E, Dv]``; causal (token ``j`` sees keys ``0 .. prefix + j``),
    or with a token tree's ``[E, E]`` mask over the new tokens (``extend_mask``); with a sliding
    ``window``, only the keys within it (an explicit mask, ``extend_mask``).

    The inputs go to SDPA as 4-D tensors: with 3-D ones it takes its math path on CPU and CUDA alike
    (a CPU prefill of 4,096 tokens: 10-18x slower). No prefix: ``is_causal``. A prefix: on CUDA a
    lower-right causal bias, which the flash kernel runs without a mask tensor; on CPU the mask that
    bias would make there (``extend_mask``: the same call, without importing ``torch.nn.attention.bias``,
    whose import of ``torch._dynamo`` costs every process ~2 s at start-up). A tree: an explicit
    mask, with the K/V heads repeated on CUDA, whose fused kernels take a mask only without
    grouped-query heads.
    """
    q, k, v = q[None], k[None], v[None]  # [1, H, L, D]
    extend, length = q.shape[2], k.shape[2]
    if tree is None and window and window < length:  # (a window over the whole sequence masks nothing)
        mask = extend_mask(prefix, extend, None, q.device, window)  # [E, L]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling, enable_gqa=True)[0]
    if tree is None:
        if prefix == 0:
            causal = {"is_causal": True}
        elif q.is_cuda:
            from torch.nn.attention.bias import causal_lower_right

            causal = {"attn_mask": causal_lower_right(extend, length)}
        else:
            causal = {"attn_mask": extend_mask(prefix, extend, None, q.device)}
        return F.scaled_dot_product_attention(q, k, v, scale=scaling, enable_gqa=True, **causal)[0]
    groups = q.shape[1] // k.shape[1]
    if q.is_cuda and groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    mask = extend_mask(prefix, extend, tree, q.device, window)  # [E, L]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling, enable_gqa=True)[0]


def extend_mask(prefix: int, extend: int, tree: torch.Tensor | None, device, window: int = 0) -> torch.Tensor:
    """``[E, prefix + E]`` bool: which keys each new token sees. Causal: token ``j`` sees keys
    ``0 .. prefix + j``; with a token tree's ``[E, E]`` mask: the prefix and its ancestors-or-self.
    A sliding ``window`` keeps of those the keys less than ``window`` positions back (a tree token's
    position is ``prefix + depth``, its depth the number of its ancestors)."""
    ones = torch.ones(extend, prefix + extend, dtype=torch.bool, device=device)
    if tree is None:
        seen = ones.tril(prefix)
        return seen & ~ones.tril(prefix - window) if window else seen
    seen = torch.cat([ones[:, :prefix], tree], dim=1)
    if not window:
        return seen
    depth = tree.sum(dim=1) - 1  # [E]
    key_pos = torch.cat([torch.arange(prefix, device=device), prefix + depth])  # [prefix + E]
    return seen & (key_pos[None, :] > (prefix + depth)[:, None] - window)


def _decode_attention(q, k_buffer, v_buffer, kv_indices, kv_indptr, prefix_lens, scaling, window=0):
    """One query per sequence: lay every sequence's slots out as a padded ``[B, L_max]`` table
    and run :func:`decode_attention` (the K/V are already in the pool)."""
    seq_lens = [p + 1 for p in prefix_lens]
    table, mask = decode_kv_table(kv_indices, kv_indptr, seq_lens)
    if window:
        table, mask = window_kv_table(table, torch.tensor(seq_lens, dtype=torch.long, device=q.device), window)
    return decode_attention(q, k_buffer, v_buffer, table, mask, scaling)


# --- decode ----------------------------------------------------------------------------------


def decode_kv_table(kv_indices: torch.Tensor, kv_indptr: torch.Tensor,
                    seq_lens: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Packed KV slots -> ``(table [B, L], mask)``, ``L = max(seq_lens)``: row ``i`` holds sequence
    ``i``'s ``seq_lens[i]`` slots, then slot 0 (the sentinel). ``mask`` is ``[B, L]`` fp32, 0 where a
    key is real and ``-inf`` on padding, or ``None`` when no row is padded. Shapes come from the
    host ``seq_lens``: no device read."""
    b, max_len = len(seq_lens), max(seq_lens)
    dev = kv_indices.device
    offsets = torch.arange(max_len, device=dev)  # [L]
    lens = torch.tensor(list(seq_lens), dtype=torch.long, device=dev)
    valid = offsets < lens[:, None]  # [B, L]
    pos = (kv_indptr[:-1, None] + offsets).clamp_(max=max(kv_indices.numel() - 1, 0))  # [B, L]
    table = kv_indices.index_select(0, pos.flatten()).view(b, max_len).masked_fill_(~valid, 0)  # [B, L]
    return table, decode_kv_mask(seq_lens, dev)


def decode_kv_mask(seq_lens: Sequence[int], device: torch.device | str, always: bool = False) -> torch.Tensor | None:
    """Additive fp32 mask ``[B, L]`` (``-inf`` past each sequence's length) from host lengths; None
    when no row is padded, unless ``always``. Lengths already on the device: :func:`padding_mask`."""
    max_len = max(seq_lens)
    if not always and all(n == max_len for n in seq_lens):
        return None
    return padding_mask(torch.tensor(list(seq_lens), dtype=torch.long, device=device), max_len)


def additive_mask(hidden: torch.Tensor) -> torch.Tensor:
    """The additive fp32 mask of a bool ``hidden`` (same shape and device): 0 where a key is seen, ``-inf`` where
    ``hidden``."""
    return torch.zeros(hidden.shape, device=hidden.device).masked_fill_(hidden, float("-inf"))


def padding_mask(lens: torch.Tensor, width: int) -> torch.Tensor:
    """``[B, width]`` additive fp32 mask from the lengths ``lens [B]`` (on their device): 0 where a
    key is real, ``-inf`` at offsets ``>= lens[b]``. Reads nothing back (traceable: ``width`` may be
    a symbolic size)."""
    return additive_mask(torch.arange(width, device=lens.device) >= lens[:, None])  # [B, width]


def window_mask(lens: torch.Tensor, width: int, window: int) -> torch.Tensor:
    """A decode step's :func:`padding_mask` for sliding-window attention: ``[B, width]`` additive
    fp32, also ``-inf`` at offsets ``< lens[b] - window`` (the query, at position ``lens[b] - 1``,
    sees its last ``window`` keys). Reads nothing back (traceable). The decode paths read the window's
    columns alone (:func:`window_kv_table`); this is their reference."""
    offsets = torch.arange(width, device=lens.device)
    return additive_mask((offsets >= lens[:, None]) | (offsets < lens[:, None] - window))  # [B, width]


def window_kv_table(kv_table: torch.Tensor, lens: torch.Tensor, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A decode step's keys for sliding-window attention: of each row of ``kv_table [B, L]`` (``lens [B]`` slots)
    the last ``w = min(window, L)`` slots, ``[B, w]``, and the additive fp32 mask ``[B, w]`` that hides the
    columns past a row shorter than ``w`` (left-aligned; slot 0 there). What :func:`window_mask` keeps of the
    whole table, so a sliding layer's decode reads its window, not its context. Reads nothing back (traceable:
    ``L`` may be symbolic)."""
    width = kv_table.shape[1]
    w = torch.sym_min(window, width)
    offsets = (lens - w).clamp(min=0)[:, None] + torch.arange(w, device=lens.device)  # [B, w]
    table = kv_table.gather(1, offsets.clamp(max=width - 1))
    return table, additive_mask(offsets >= lens[:, None])


def decode_kv_rows(kv_table: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """``[B, L]`` slots -> ``[B, Hkv, L]`` row indices into ``k_buffer.view(-1, D)``, head-major, so
    one ``index_select`` yields keys already laid out ``[B, Hkv, L, D]`` (no transposing copy)."""
    heads = torch.arange(num_kv_heads, device=kv_table.device)
    return kv_table.unsqueeze(1) * num_kv_heads + heads[:, None]  # [B, Hkv, L]


def decode_attention(
    q: torch.Tensor,  # [B, Hq, D]
    k_buffer: torch.Tensor,  # [S, Hkv, D]
    v_buffer: torch.Tensor,  # [S, Hkv, D]
    kv_table: torch.Tensor,  # [B, L] int64
    kv_mask: torch.Tensor | None,  # [B, L] additive fp32, or None
    scaling: float,
    kv_rows: torch.Tensor | None = None,  # [B, Hkv, L], decode_kv_rows(kv_table, Hkv) if given
) -> torch.Tensor:
    """One query per sequence over its slots ``kv_table[i]`` (K/V already in the pool): ``o [B, Hq, D]``.

    Keys are gathered head-major in one ``index_select`` each for K and V, scores are one batched
    matmul per GQA group, softmax in fp32. ``kv_table``, ``kv_mask`` and ``kv_rows`` are per-step
    metadata (``ForwardBatch`` builds them once for all attention layers).
    """
    b, hq, d = q.shape
    hkv = k_buffer.shape[1]
    if kv_rows is None:
        kv_rows = decode_kv_rows(kv_table, hkv)
    length = kv_rows.shape[-1]
    flat = kv_rows.view(-1)
    keys = k_buffer.view(-1, d).index_select(0, flat).view(b, hkv, length, d)  # [B, Hkv, L, D]
    values = v_buffer.view(-1, d).index_select(0, flat).view(b, hkv, length, d)  # [B, Hkv, L, D]
    qg = q.view(b, hkv, hq // hkv, d).float() * scaling  # [B, Hkv, G, D]
    scores = torch.matmul(qg, widened(keys, torch.float32).transpose(-1, -2))  # [B, Hkv, G, L]
    if kv_mask is not None:
        scores += kv_mask.view(b, 1, 1, length)
    probs = torch.softmax(scores, dim=-1)  # fp32
    return torch.matmul(probs, widened(values, torch.float32)).view(b, hq, d).to(q.dtype)  # [B, Hq, D]


def paged_attention_decode(
    q: torch.Tensor,  # [B, Hq, D]
    k: torch.Tensor,  # [B, Hkv, D]
    v: torch.Tensor,  # [B, Hkv, D]
    k_buffer: torch.Tensor,  # [S, Hkv, D]
    v_buffer: torch.Tensor,  # [S, Hkv, D]
    out_cache_loc: torch.Tensor,  # [B] int64
    kv_table: torch.Tensor,  # [B, L] int64, each row ends with (or is padded after) the new token's slot
    kv_mask: torch.Tensor | None,  # [B, L] additive fp32, or None
    scaling: float,
    kv_rows: torch.Tensor | None = None,  # [B, Hkv, L]
) -> torch.Tensor:
    """Decode fast path of :func:`paged_attention`: write the new K/V into ``out_cache_loc``, then
    :func:`decode_attention`. Per-step metadata comes precomputed; only host-side shape checks
    here (no device read). Returns ``o [B, Hq, D]``."""
    b = q.shape[0]
    if k.shape[0] != b or v.shape[0] != b or out_cache_loc.numel() != b or kv_table.shape[0] != b:
        raise ValueError(f"q, k, v, out_cache_loc and kv_table disagree on the batch size ({b})")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads is not a multiple of {k.shape[1]} KV heads")
    if k.shape[1:] != k_buffer.shape[1:]:
        raise ValueError(f"new keys {tuple(k.shape[1:])} do not fit the KV buffer {tuple(k_buffer.shape[1:])}")
    write_rows_(k_buffer, out_cache_loc, k.to(k_buffer.dtype))
    write_rows_(v_buffer, out_cache_loc, v.to(v_buffer.dtype))
    return decode_attention(q, k_buffer, v_buffer, kv_table, kv_mask, scaling, kv_rows)


# --- short extends (speculative verify steps): one padded batched attention --------------------


@dataclass(frozen=True)
class ShortExtendLayout:
    """Per-step metadata of :func:`paged_attention_short_extend`, built once by ``ForwardBatch`` and
    shared by every attention layer: each sequence's KV slots head-major (``kv_rows``, as a decode
    step's), its new tokens padded to the longest extend ``E``, and one additive mask for all."""

    batch_size: int
    width: int  # E: the longest extend of the batch
    kv_rows: torch.Tensor  # [B, Hkv, L] rows of k_buffer.view(-1, D), L = max(prefix + extend)
    mask: torch.Tensor  # [B, 1, 1, E, L] additive fp32: 0 where query (b, e) sees key l, else -inf
    q_rows: torch.Tensor | None  # [B*E] packed query of each padded row (None: every extend has E tokens)
    out_rows: torch.Tensor | None  # [T] padded row of each packed token
    key_pos: torch.Tensor  # [B, 1, L] int64 each key's position (a tree token's: prefix + its depth)
    query_pos: torch.Tensor  # [B, E, 1] int64 each query's position (a padding row's: 0, it sees key 0)

    def windowed(self, window: int) -> "ShortExtendLayout":
        """This layout for sliding-window attention: each query also blind to the keys ``window`` or
        more positions back, and the keys narrowed to the ``w = min(L, window - 1 + E)`` columns from each
        sequence's ``prefix - window + 1`` (no query sees earlier ones: its first query, at ``prefix``, is the
        earliest), so a sliding layer's verify step reads its window, not its context. Columns past ``L``
        are masked; a padding row, which then may see nothing, sees its first column (its output is
        dropped). Reads nothing back (traceable: a compiled verify step builds it inside)."""
        b, e, length = self.mask.shape[0], self.width, self.mask.shape[-1]
        w = torch.sym_min(length, window - 1 + e)
        start = (self.query_pos[:, 0, 0] - window + 1).clamp(min=0)  # [B] (row 0: each sequence's first query)
        cols = start[:, None] + torch.arange(w, device=start.device)  # [B, w]
        idx = cols.clamp(max=length - 1)[:, None, :]  # [B, 1, w]
        kv_rows = self.kv_rows.gather(2, idx.expand(b, self.kv_rows.shape[1], w))  # [B, Hkv, w]
        key_pos = self.key_pos.gather(2, idx)  # [B, 1, w]
        hidden = (key_pos <= self.query_pos - window) | (cols >= length)[:, None, :]  # [B, E, w]
        mask = self.mask.view(b, e, length).gather(2, idx.expand(b, e, w)).masked_fill(hidden, float("-inf"))
        dead = (mask == float("-inf")).all(dim=-1, keepdim=True)  # [B, E, 1]: padding rows only
        mask = torch.cat([mask[..., :1].masked_fill(dead, 0.0), mask[..., 1:]], dim=-1)
        return replace(self, kv_rows=kv_rows, mask=mask.view(b, 1, 1, e, w), key_pos=key_pos)

    @classmethod
    def build(cls, kv_table: torch.Tensor, prefix_lens: Sequence[int], extend_lens: Sequence[int],
              num_kv_heads: int, parents: Sequence[Sequence[int]] | None = None,
              width: int | None = None) -> "ShortExtendLayout":
        """From the batch's ``kv_table [B, L]`` (each row: the sequence's prefix slots, then its new
        tokens'; padding after). Causal over prefix + new tokens, or with ``parents`` (a token tree,
        ``ops/tree.py``) each new token sees the prefix and its ancestors-or-self. A padding query
        row sees key 0 only (its output is dropped; a row that sees nothing would be NaN).
        ``width``: pad every extend to this many rows (``>= max(extend_lens)``; a compiled verify
        step's fixed width), with ``q_rows`` / ``out_rows`` always built."""
        b, length = kv_table.shape
        if len(prefix_lens) != b or len(extend_lens) != b:
            raise ValueError(f"kv_table has {b} rows, the batch {len(extend_lens)} sequences")
        fixed = width is not None
        if fixed and width < max(extend_lens, default=0):
            raise ValueError(f"width {width} is less than the longest extend ({max(extend_lens)})")
        width = width if fixed else max(extend_lens)
        dev = kv_table.device
        long = dict(dtype=torch.long, device=dev)
        prefix = torch.tensor(list(prefix_lens), **long)
        cols = torch.arange(length, device=dev)
        offset = (cols - prefix[:, None]).unsqueeze(1)  # [B, 1, L] a key's offset among the new tokens
        queries = torch.arange(width, device=dev)[None, :, None]  # [1, E, 1]
        key_pos, query_pos = cols.expand(b, 1, length), prefix[:, None, None] + queries  # [B, 1, L], [B, E, 1]
        if parents is None:
            seen = offset <= queries  # [B, E, L]: the prefix and new tokens up to the query (incl.)
        else:
            rows = [[[False] * width for _ in range(width)] for _ in range(b)]  # [B, E, E] ancestors-or-self
            for i, par in enumerate(parents):
                for j in range(len(par)):
                    a = j
                    while a >= 0:
                        rows[i][j][a] = True
                        a = par[a]
            anc = torch.tensor(rows, dtype=torch.bool, device=dev)
            new = anc.gather(2, offset.clamp(0, width - 1).expand(b, width, length))  # [B, E, L]
            seen = (offset < 0) | (new & (offset < width))
            depth = anc.sum(dim=2) - 1  # [B, E] each new token's depth (a padding row's: -1, unused)
            query_pos = prefix[:, None, None] + depth[:, :, None]
            new_pos = prefix[:, None] + depth.gather(1, offset[:, 0].clamp(0, width - 1))  # [B, L]
            key_pos = torch.where(offset[:, 0] < 0, cols, new_pos).unsqueeze(1)
        q_rows = out_rows = None
        if fixed or any(n != width for n in extend_lens):
            pad = queries.view(1, width) >= torch.tensor(list(extend_lens), **long)[:, None]  # [B, E] padding rows
            seen = seen & ~pad[:, :, None]
            seen[:, :, 0] |= pad
            query_pos = query_pos.masked_fill(pad[:, :, None], 0)
            starts = [0]
            for n in extend_lens:
                starts.append(starts[-1] + n)
            q_rows = torch.tensor([starts[i] + e if e < n else 0 for i, n in enumerate(extend_lens)
                                   for e in range(width)], **long)
            out_rows = torch.tensor([i * width + e for i, n in enumerate(extend_lens) for e in range(n)], **long)
        mask = additive_mask(~seen)
        return cls(b, width, decode_kv_rows(kv_table, num_kv_heads), mask.view(b, 1, 1, width, length), q_rows,
                   out_rows, key_pos.contiguous(), query_pos.expand(b, width, 1).contiguous())


def paged_attention_short_extend(
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    k_buffer: torch.Tensor,  # [S, Hkv, D]
    v_buffer: torch.Tensor,  # [S, Hkv, D]
    out_cache_loc: torch.Tensor,  # [T] int64
    layout: ShortExtendLayout,
    scaling: float,
) -> torch.Tensor:
    """:func:`paged_attention` for a batch of short extends (a verify step: a few new tokens per
    sequence, a chain or a token tree): write the new K/V, then one padded attention over all
    sequences, ``[B, Hkv, G*E, L]`` scores, the decode step's math (:func:`decode_attention`) with
    ``E`` queries per sequence. Returns ``o [T, Hq, D]``."""
    t, hq, d = q.shape
    hkv = k_buffer.shape[1]
    if k.shape[0] != t or v.shape[0] != t or out_cache_loc.numel() != t:
        raise ValueError(f"q, k, v and out_cache_loc disagree on the token count ({t})")
    if hq % hkv or k.shape[1:] != k_buffer.shape[1:]:
        raise ValueError(f"{hq} query heads and new keys {tuple(k.shape[1:])} do not fit the KV buffer "
                         f"{tuple(k_buffer.shape[1:])}")
    write_rows_(k_buffer, out_cache_loc, k.to(k_buffer.dtype))
    write_rows_(v_buffer, out_cache_loc, v.to(v_buffer.dtype))
    return short_extend_attention(q, k_buffer, v_buffer, layout, scaling)


def short_extend_attention(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                           layout: ShortExtendLayout, scaling: float) -> torch.Tensor:
    """:func:`paged_attention_short_extend` once the new tokens' K/V are in the pool (as
    :func:`paged_attention_written`): ``q [T, Hq, D]`` -> ``o [T, Hq, D]``."""
    t, hq, d = q.shape
    hkv = k_buffer.shape[1]
    if hq % hkv:
        raise ValueError(f"{hq} query heads do not fit {hkv} KV heads")
    b, e, g = layout.kv_rows.shape[0], layout.width, hq // hkv  # b: a shape (symbolic under torch.compile)
    length = layout.kv_rows.shape[-1]
    flat = layout.kv_rows.view(-1)
    keys = k_buffer.view(-1, d).index_select(0, flat).view(b, hkv, length, d)  # [B, Hkv, L, D]
    values = v_buffer.view(-1, d).index_select(0, flat).view(b, hkv, length, d)  # [B, Hkv, L, D]
    qp = q if layout.q_rows is None else q.index_select(0, layout.q_rows)  # [B*E, Hq, D]
    qg = (qp.view(b, e, hkv, g, d).float() * scaling).permute(0, 2, 3, 1, 4).reshape(b, hkv, g * e, d)
    scores = torch.matmul(qg, widened(keys, torch.float32).transpose(-1, -2))  # [B, Hkv, G*E, L]
    scores.view(b, hkv, g, e, length).add_(layout.mask)
    probs = torch.softmax(scores, dim=-1)  # fp32
    out = torch.matmul(probs, widened(values, torch.float32))  # [B, Hkv, G*E, D]
    out = out.view(b, hkv, g, e, d).permute(0, 3, 1, 2, 4).reshape(b * e, hq, d)  # [B*E, Hq, D]
    if layout.out_rows is not None:
        out = out.index_select(0, layout.out_rows)
    return out.to(q.dtype)  # [T, Hq, D]


def paged_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    out_cache_loc: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_indptr: torch.Tensor,
    prefix_lens: Sequence[int],
    extend_lens: Sequence[int],
    scaling: float,
    window: int = 0,
) -> torch.Tensor:
    """Naive per-token, per-head reference of :func:`paged_attention` (for tests; slow), causal;
    with a sliding ``window``, each token over its last ``window`` keys."""
    k_buffer[out_cache_loc] = k.to(k_buffer.dtype)
    v_buffer[out_cache_loc] = v.to(v_buffer.dtype)
    group = q.shape[1] // k.shape[1]
    out = torch.zeros_like(q)
    token = 0
    for i, (prefix, extend) in enumerate(zip(prefix_lens, extend_lens)):
        slots = kv_indices[int(kv_indptr[i]) : int(kv_indptr[i + 1])]
        for j in range(extend):
            visible = slots[max(0, prefix + j + 1 - window) if window else 0 : prefix + j + 1]
            for h in range(q.shape[1]):
                keys = k_buffer[visible, h // group].float()  # [L, D]
                vals = v_buffer[visible, h // group].float()  # [L, D]
                weights = torch.softmax(keys @ q[token, h].float() * scaling, dim=0)  # [L]
                out[token, h] = (weights @ vals).to(q.dtype)
            token += 1
    return out
