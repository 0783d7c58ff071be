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
* Softmax is computed in fp32; the output has the dtype of ``q``.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F


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
) -> torch.Tensor:
    """Write the new K/V into their pool slots, then attend causally to prefix + new tokens.

    Returns ``o [T, Hq, D]``. Decode batches (every ``extend_len == 1``) run as one padded batched
    attention; other batches loop over sequences (each a single causal attention call).
    """
    _check_inputs(q, k, v, k_buffer, out_cache_loc, kv_indptr, prefix_lens, extend_lens)
    k_buffer.index_copy_(0, out_cache_loc, k.to(k_buffer.dtype))
    v_buffer.index_copy_(0, out_cache_loc, v.to(v_buffer.dtype))
    if all(n == 1 for n in extend_lens):
        return _decode_attention(q, k_buffer, v_buffer, kv_indices, kv_indptr, prefix_lens, scaling)
    return _extend_attention(q, k_buffer, v_buffer, kv_indices, kv_indptr, prefix_lens, extend_lens, scaling)


def _check_inputs(q, k, v, k_buffer, out_cache_loc, kv_indptr, prefix_lens, extend_lens) -> None:
    t = q.shape[0]
    if k.shape[0] != t or v.shape[0] != t or out_cache_loc.numel() != t:
        raise ValueError(f"q, k, v and out_cache_loc disagree on the token count ({t})")
    if sum(extend_lens) != t:
        raise ValueError(f"extend_lens sum to {sum(extend_lens)}, but there are {t} new tokens")
    if len(prefix_lens) != len(extend_lens) or kv_indptr.numel() != len(extend_lens) + 1:
        raise ValueError("prefix_lens, extend_lens and kv_indptr disagree on the batch size")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads is not a multiple of {k.shape[1]} KV heads")
    if k.shape[1:] != k_buffer.shape[1:]:
        raise ValueError(f"new keys {tuple(k.shape[1:])} do not fit the KV buffer {tuple(k_buffer.shape[1:])}")


def _extend_attention(q, k_buffer, v_buffer, kv_indices, kv_indptr, prefix_lens, extend_lens, scaling):
    out = torch.empty_like(q)  # [T, Hq, D]
    indptr = kv_indptr.tolist()
    start = 0
    for i, (prefix, extend) in enumerate(zip(prefix_lens, extend_lens)):
        if extend == 0:
            continue
        if indptr[i + 1] - indptr[i] != prefix + extend:
            raise ValueError(f"sequence {i}: kv_indptr gives {indptr[i + 1] - indptr[i]} slots, expected {prefix + extend}")
        slots = kv_indices[indptr[i] : indptr[i + 1]]
        qi = q[start : start + extend].transpose(0, 1)  # [Hq, E, D]
        ki = k_buffer.index_select(0, slots).transpose(0, 1).to(q.dtype)  # [Hkv, L, D]
        vi = v_buffer.index_select(0, slots).transpose(0, 1).to(q.dtype)  # [Hkv, L, D]
        # query j sees keys 0 .. prefix + j
        mask = torch.ones(extend, prefix + extend, dtype=torch.bool, device=q.device).tril(prefix)  # [E, L]
        oi = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=scaling, enable_gqa=True)
        out[start : start + extend] = oi.transpose(0, 1)
        start += extend
    return out


def _decode_attention(q, k_buffer, v_buffer, kv_indices, kv_indptr, prefix_lens, scaling):
    """One query per sequence: gather every sequence's keys into a ``[B, L_max]`` padded batch
    (padding reads slot 0 and is masked out) and run one batched attention."""
    b, hq, d = q.shape
    hkv = k_buffer.shape[1]
    max_len = max(prefix_lens) + 1
    offsets = torch.arange(max_len, device=q.device)  # [L]
    valid = offsets[None, :] < (kv_indptr[1:] - kv_indptr[:-1])[:, None]  # [B, L]
    pos = (kv_indptr[:-1, None] + offsets[None, :]).clamp(max=max(kv_indices.numel() - 1, 0))  # [B, L]
    slots = kv_indices.index_select(0, pos.flatten()).masked_fill_(~valid.flatten(), 0)  # [B*L]
    keys = k_buffer.index_select(0, slots).view(b, max_len, hkv, d).transpose(1, 2)  # [B, Hkv, L, D]
    values = v_buffer.index_select(0, slots).view(b, max_len, hkv, d).transpose(1, 2)  # [B, Hkv, L, D]
    out = F.scaled_dot_product_attention(
        q.view(b, 1, hq, d).transpose(1, 2), keys.to(q.dtype), values.to(q.dtype),
        attn_mask=valid[:, None, None, :], scale=scaling, enable_gqa=True,
    )  # [B, Hq, 1, D]
    return out.view(b, hq, d)


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
) -> torch.Tensor:
    """Naive per-token, per-head reference of :func:`paged_attention` (for tests; slow)."""
    k_buffer[out_cache_loc] = k.to(k_buffer.dtype)
    v_buffer[out_cache_loc] = v.to(v_buffer.dtype)
    group = q.shape[1] // k.shape[1]
    out = torch.zeros_like(q)
    token = 0
    for i, (prefix, extend) in enumerate(zip(prefix_lens, extend_lens)):
        slots = kv_indices[int(kv_indptr[i]) : int(kv_indptr[i + 1])]
        for j in range(extend):
            visible = slots[: prefix + j + 1]
            for h in range(q.shape[1]):
                keys = k_buffer[visible, h // group].float()  # [L, D]
                vals = v_buffer[visible, h // group].float()  # [L, D]
                weights = torch.softmax(keys @ q[token, h].float() * scaling, dim=0)  # [L]
                out[token, h] = (weights @ vals).to(q.dtype)
            token += 1
    return out
