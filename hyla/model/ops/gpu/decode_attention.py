"""Decode attention over the paged KV pool in Triton: one query per sequence, split-KV (flash-decoding).

Reference: :func:`hyla.model.ops.attention.decode_attention` (same result, fp32 softmax). Instead of a
``[B, L]`` table built on the host each step, the kernel reads each sequence's KV slots straight from
the request table on the device: sequence ``i`` owns row ``req_rows[i]`` of ``req_to_token`` and its
first ``seq_lens[i]`` entries (the new token's K/V already written). Both come from the device, so
the launch has a fixed shape for a batch size (CUDA-graph friendly).

Stage 1: program ``(i, kv_head, split)`` runs an online softmax over its share of the keys for the
``Hq/Hkv`` query heads of that KV head (padded to 16 rows for ``tl.dot``) and writes a partial
output with its log-sum-exp. Stage 2 merges the splits (empty splits carry ``lse = -inf``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _stage1(q_ptr, q_stride, k_ptr, v_ptr, table_ptr, table_stride, rows_ptr, lens_ptr, part_o_ptr, part_lse_ptr, scale,
            kv_stride_s, HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BD: tl.constexpr,
            BH: tl.constexpr, BN: tl.constexpr, SPLITS: tl.constexpr, IEEE: tl.constexpr):
    i = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    G: tl.constexpr = HQ // HKV
    h = tl.arange(0, BH)
    mh = h < G
    d = tl.arange(0, BD)
    md = d < D
    q = tl.load(q_ptr + i * q_stride + (kvh * G + h[:, None]) * D + d[None, :], mask=mh[:, None] & md[None, :], other=0.0)

    length = tl.load(lens_ptr + i).to(tl.int32)
    table = table_ptr + tl.load(rows_ptr + i).to(tl.int64) * table_stride
    per = tl.cdiv(tl.cdiv(length, SPLITS), BN) * BN  # keys per split, whole blocks
    start = split * per
    end = tl.minimum(start + per, length)

    m_i = tl.full([BH], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BH], dtype=tl.float32)
    acc = tl.zeros([BH, BD], dtype=tl.float32)
    for n0 in range(start, end, BN):
        n = n0 + tl.arange(0, BN)
        mn = n < end
        slot = tl.load(table + n, mask=mn, other=0).to(tl.int64)
        kv_off = slot[:, None] * kv_stride_s + kvh * D + d[None, :]
        kv_mask = mn[:, None] & md[None, :]
        keys = tl.load(k_ptr + kv_off, mask=kv_mask, other=0.0)  # [BN, BD]
        if IEEE:
            s = tl.dot(q, tl.trans(keys), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(keys))
        s = tl.where(mn[None, :], s.to(tl.float32) * scale, float("-inf"))  # [BH, BN]
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        values = tl.load(v_ptr + kv_off, mask=kv_mask, other=0.0)  # [BN, BD]
        if IEEE:
            pv = tl.dot(p, values.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(values.dtype), values)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    out = (i * HQ + kvh * G + h) * SPLITS + split  # [BH]
    empty = l_i == 0.0
    tl.store(part_o_ptr + out[:, None] * D + d[None, :], acc / tl.where(empty, 1.0, l_i)[:, None],
             mask=mh[:, None] & md[None, :])
    tl.store(part_lse_ptr + out, tl.where(empty, float("-inf"), m_i + tl.log(l_i)), mask=mh)


@triton.jit
def _stage2(part_o_ptr, part_lse_ptr, o_ptr, D: tl.constexpr, BD: tl.constexpr, SPLITS: tl.constexpr):
    row = tl.program_id(0)  # (sequence, query head)
    s = tl.arange(0, SPLITS)
    d = tl.arange(0, BD)
    md = d < D
    lse = tl.load(part_lse_ptr + row * SPLITS + s)  # [SPLITS]
    w = tl.exp(lse - tl.max(lse, axis=0))  # empty splits: exp(-inf) = 0
    parts = tl.load(part_o_ptr + (row * SPLITS + s[:, None]) * D + d[None, :], mask=md[None, :], other=0.0)
    o = tl.sum(parts * w[:, None], axis=0) / tl.sum(w, axis=0)
    tl.store(o_ptr + row * D + d, o.to(o_ptr.dtype.element_ty), mask=md)


def num_splits(batch_size: int, num_kv_heads: int, num_sms: int = 132) -> int:
    """Splits per (sequence, KV head): enough programs to fill the GPU (~2 per SM), at most 32."""
    want = max(1, (2 * num_sms) // max(1, batch_size * num_kv_heads))
    return min(32, triton.next_power_of_2(want))


def paged_decode_attention(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                           req_to_token: torch.Tensor, req_rows: torch.Tensor, seq_lens: torch.Tensor,
                           scaling: float, splits: int | None = None) -> torch.Tensor:
    """``q [B, Hq, D]`` (rows may be strided) over ``k_buffer / v_buffer [S, Hkv, D]``; sequence ``i`` attends to the slots
    ``req_to_token[req_rows[i], :seq_lens[i]]`` -> ``o [B, Hq, D]`` (dtype of q)."""
    b, hq, d = q.shape
    hkv = k_buffer.shape[1]
    if hq % hkv or k_buffer.shape[2] != d or v_buffer.shape != k_buffer.shape:
        raise ValueError(f"q {list(q.shape)} does not fit the KV buffers {list(k_buffer.shape)}")
    if hq // hkv > 64 or q.stride(2) != 1 or q.stride(1) != d or not (k_buffer.is_contiguous() and v_buffer.is_contiguous()):
        raise ValueError("q rows [Hq, D] and the KV buffers must be contiguous, with at most 64 query heads per KV head")
    if req_rows.shape != (b,) or seq_lens.shape != (b,) or req_to_token.stride(1) != 1:
        raise ValueError("req_rows and seq_lens must be [B]; req_to_token rows contiguous")
    splits = splits or num_splits(b, hkv)
    part_o = torch.empty(b, hq, splits, d, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(b, hq, splits, dtype=torch.float32, device=q.device)
    bd = triton.next_power_of_2(d)
    ieee = q.dtype == torch.float32
    _stage1[(b, hkv, splits)](
        q, q.stride(0), k_buffer, v_buffer, req_to_token, req_to_token.stride(0), req_rows, seq_lens, part_o, part_lse, scaling,
        k_buffer.stride(0), HQ=hq, HKV=hkv, D=d, BD=bd, BH=max(16, triton.next_power_of_2(hq // hkv)),
        BN=32 if ieee or bd > 128 else 64, SPLITS=splits, IEEE=ieee, num_warps=4)
    o = torch.empty(b, hq, d, dtype=q.dtype, device=q.device)
    _stage2[(b * hq,)](part_o, part_lse, o, D=d, BD=bd, SPLITS=splits)
    return o
