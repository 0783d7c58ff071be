"""Multi-head latent attention (MLA, Kimi-Linear's full-attention layers) for a decode step in
Triton: one query per sequence over the latents in the paged pool, split-KV, read through the
request table on the device (so a step has no host read and a fixed shape per batch size: CUDA
graphs capture it).

Reference: the decode path of :func:`hyla.model.kimi_linear.latent_paged_attention` (same result,
fp32 softmax). The pool holds each token's latent ``[c_kv | k_pe]`` (width ``L``), its first half in
the layer's K buffer, the second in its V buffer (``[S, 1, half]``, zero-padded past ``L``); with the
up-projections absorbed, every head attends with the latent as its key and the latent's first
``value_dim`` channels as its value::

    o[h] = softmax_s(scale * q[h] . latent_s) @ latent_s[:value_dim]        q [H, L]

Stage 1: program ``(sequence, block of BH heads, split)`` runs an online softmax over its share of
the keys, the scores ``q[:half] . K + q[half:] . V`` and the two halves of the output accumulated
apart, and writes a partial output ``[2*half]`` with its log-sum-exp per head; stage 2 is
``decode_attention``'s merge of the splits (``merge_splits``). A launch of one split (large batches,
long extends) writes the output itself: no partials (an 8,192-token extend's would be 600 MB of fp32),
no stage 2. The new token's latent is in the
pool before (the layer writes it). Verify steps' chains need nothing more: each row of the step is
a query with its own request row and length.

:func:`paged_latent_extend_attention` is the same for one sequence's new tokens, causal (a fused
extend's, ``extend_attention``'s contract): program ``(block of tokens, block of heads, split)``,
``BM`` tokens times ``BH`` heads a tile, token ``j`` seeing its first ``kv_lens[j]`` keys.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hyla.model.ops.gpu import pdl
from hyla.model.ops.gpu.decode_attention import _store_partials, merge_splits, num_splits

# (query rows per program: heads in a decode step, tokens x heads in an extend; keys per block; warps). Read
# at each launch. Not yet timed on a GPU: Kimi-Linear's 32 heads over a 576-wide latent (halves of 288,
# padded to 512 in registers) hold two [16, 512] fp32 accumulators a program at 16 rows.
TILES = (16, 16, 4)
MAX_SPLITS = 8  # stage 2 merges a [splits, 2*half] fp32 tile a row (1,024 wide for Kimi's latent): at most 8
# keeps it in registers. A launch of one split writes its output directly (no partials, no stage 2).


@triton.jit
def _attend_latent(q1, q2, table, k_ptr, v_ptr, kv_stride_s, start, end, lens, scale, d, md, R: tl.constexpr,
                   BD: tl.constexpr, BN: tl.constexpr, CAUSAL: tl.constexpr, IEEE: tl.constexpr):
    """The online softmax of query rows ``q1, q2 [R, BD]`` (each head's latent query, first and second
    half) over keys ``[start, end)`` of one request-table row ``table`` -> ``(acc1, acc2 [R, BD], m [R],
    l [R])``: the value's two halves accumulated apart (``decode_attention._attend_split``'s loop); with
    ``CAUSAL`` row ``r`` sees only keys below ``lens[r]``."""
    m_i = tl.full([R], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([R], dtype=tl.float32)
    acc1 = tl.zeros([R, BD], dtype=tl.float32)
    acc2 = tl.zeros([R, BD], dtype=tl.float32)
    for n0 in range(start, end, BN):
        n = n0 + tl.arange(0, BN)
        mn = n < end
        slot = tl.load(table + n, mask=mn, other=0).to(tl.int64)
        off = slot[:, None] * kv_stride_s + d[None, :]
        mask = mn[:, None] & md[None, :]
        k1 = tl.load(k_ptr + off, mask=mask, other=0.0).to(q1.dtype)  # [BN, BD]: the latents' first halves
        k2 = tl.load(v_ptr + off, mask=mask, other=0.0).to(q1.dtype)  # and their second (float8: widened)
        if IEEE:
            s = tl.dot(q1, tl.trans(k1), input_precision="ieee") + tl.dot(q2, tl.trans(k2), input_precision="ieee")
        else:
            s = tl.dot(q1, tl.trans(k1)) + tl.dot(q2, tl.trans(k2))
        seen = mn[None, :]  # [1, BN]
        if CAUSAL:
            seen = seen & (n[None, :] < lens[:, None])  # [R, BN]: each row's own keys
        s = tl.where(seen, s.to(tl.float32) * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if IEEE:
            pv1 = tl.dot(p, k1.to(tl.float32), input_precision="ieee")
            pv2 = tl.dot(p, k2.to(tl.float32), input_precision="ieee")
        else:
            pv1 = tl.dot(p.to(k1.dtype), k1)
            pv2 = tl.dot(p.to(k2.dtype), k2)
        acc1 = acc1 * alpha[:, None] + pv1
        acc2 = acc2 * alpha[:, None] + pv2
        m_i = m_new
    return acc1, acc2, m_i, l_i


@triton.jit
def _latent_tile(row, mask, table, lens, length, k_ptr, v_ptr, kv_stride_s, part_o_ptr, part_lse_ptr, out, split,
                 scale, L: tl.constexpr, HALF: tl.constexpr, VALUE: tl.constexpr, BD: tl.constexpr, R: tl.constexpr,
                 BN: tl.constexpr, SPLITS: tl.constexpr, CAUSAL: tl.constexpr, IEEE: tl.constexpr):
    """A tile's work (both stage-1 kernels): its ``R`` query rows (``row``: each row's latent query,
    ``mask``: the live ones) loaded in two halves, the online softmax over its split of the first
    ``length`` keys of the request-table row ``table`` (with ``CAUSAL``, row ``r`` sees ``lens[r]``),
    and the partial outputs and log-sum-exps stored at stage 2's rows ``out`` — with one split, the
    output's first ``VALUE`` channels themselves."""
    d = tl.arange(0, BD)
    md = d < HALF
    q1 = tl.load(row + d[None, :], mask=mask[:, None] & (md & (d < L))[None, :], other=0.0)
    q2 = tl.load(row + HALF + d[None, :], mask=mask[:, None] & (md & (HALF + d < L))[None, :], other=0.0)
    per = tl.cdiv(tl.cdiv(length, SPLITS), BN) * BN  # keys per split, whole blocks
    start = split * per
    end = tl.minimum(start + per, length)
    acc1, acc2, m_i, l_i = _attend_latent(q1, q2, table, k_ptr, v_ptr, kv_stride_s, start, end, lens, scale, d, md,
                                          R, BD, BN, CAUSAL, IEEE)
    if SPLITS == 1:  # the output itself, [N, H, VALUE] in its dtype: part_o_ptr is the output's (rows out)
        inv = 1.0 / tl.where(l_i == 0.0, 1.0, l_i)
        o = part_o_ptr + out[:, None] * VALUE + d[None, :]
        tl.store(o, (acc1 * inv[:, None]).to(part_o_ptr.dtype.element_ty),
                 mask=mask[:, None] & (md & (d < VALUE))[None, :])
        tl.store(o + HALF, (acc2 * inv[:, None]).to(part_o_ptr.dtype.element_ty),
                 mask=mask[:, None] & (md & (HALF + d < VALUE))[None, :])
    else:
        _store_partials(part_o_ptr, part_lse_ptr, out, acc1, m_i, l_i, mask, d, md, 2 * HALF)
        _store_partials(part_o_ptr + HALF, part_lse_ptr, out, acc2, m_i, l_i, mask, d, md, 2 * HALF)


@triton.jit(do_not_specialize_on_alignment=["rows_ptr", "lens_ptr"])
def _latent_stage1(q_ptr, q_stride, k_ptr, v_ptr, table_ptr, table_stride, rows_ptr, lens_ptr, part_o_ptr,
                   part_lse_ptr, scale, kv_stride_s, H: tl.constexpr, L: tl.constexpr, HALF: tl.constexpr,
                   VALUE: tl.constexpr, BD: tl.constexpr, BH: tl.constexpr, BN: tl.constexpr, SPLITS: tl.constexpr,
                   IEEE: tl.constexpr, PDL: tl.constexpr):
    pdl.wait(PDL)  # (pdl.py)
    i = tl.program_id(0)
    h = tl.program_id(1) * BH + tl.arange(0, BH)
    split = tl.program_id(2)
    mh = h < H
    length = tl.load(lens_ptr + i).to(tl.int32)
    table = table_ptr + tl.load(rows_ptr + i).to(tl.int64) * table_stride
    _latent_tile(q_ptr + i * q_stride + h[:, None] * L, mh, table, length, length, k_ptr, v_ptr, kv_stride_s,
                 part_o_ptr, part_lse_ptr, (i * H + h) * SPLITS + split, split, scale, L, HALF, VALUE, BD, BH, BN,
                 SPLITS, False, IEEE)


def paged_latent_decode_attention(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                                  req_to_token: torch.Tensor, req_rows: torch.Tensor, seq_lens: torch.Tensor,
                                  scaling: float, value_dim: int, splits: int | None = None) -> torch.Tensor:
    """``q [B, H, L]`` (each head's latent query: ``[q_nope W_uk | q_pe]``; rows may be strided) over
    the latents in ``k_buffer / v_buffer [S, 1, half]`` (first and second half, ``L <= 2*half``);
    sequence ``i`` attends to the slots ``req_to_token[req_rows[i], :seq_lens[i]]`` -> ``o [B, H,
    value_dim]`` (dtype of q): the softmax-weighted sum of the latents' first ``value_dim`` channels."""
    b, heads, width = _check(q, k_buffer, v_buffer, req_to_token, value_dim)
    if req_rows.shape != (b,) or seq_lens.shape != (b,):
        raise ValueError("req_rows and seq_lens must be [B]")
    half = k_buffer.shape[-1]
    splits = _splits(splits or min(MAX_SPLITS, num_splits(b, 1)))
    out, part_o, part_lse = _outputs(q, half, value_dim, splits)
    rows, bn, warps = TILES
    bh = max(16, min(rows, triton.next_power_of_2(heads)))
    _latent_stage1[(b, triton.cdiv(heads, bh), splits)](
        q, q.stride(0), k_buffer, v_buffer, req_to_token, req_to_token.stride(0), req_rows, seq_lens, part_o,
        part_lse, scaling, k_buffer.stride(0), H=heads, L=width, HALF=half, VALUE=value_dim, BD=_block(half), BH=bh,
        BN=bn, SPLITS=splits, IEEE=q.dtype == torch.float32, num_warps=warps, **pdl.launch(q))
    return out if splits == 1 else merge_splits(part_o, part_lse, q.dtype)[:, :, :value_dim]


@triton.jit(do_not_specialize=["T"], do_not_specialize_on_alignment=["row_ptr", "lens_ptr"])
def _latent_extend_stage1(q_ptr, q_stride, k_ptr, v_ptr, table_ptr, table_stride, row_ptr, lens_ptr, part_o_ptr,
                          part_lse_ptr, scale, kv_stride_s, T, H: tl.constexpr, L: tl.constexpr, HALF: tl.constexpr,
                          VALUE: tl.constexpr, BD: tl.constexpr, BH: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                          SPLITS: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr):
    pdl.wait(PDL)  # (pdl.py)
    r = tl.arange(0, BM * BH)  # the tile's rows: token blk * BM + r // BH, head hb * BH + r % BH
    # int64: the query rows (tok * H*L) and the output rows (tok * H * VALUE) pass 2**31 elements past
    # ~116K tokens of Kimi-Linear's 32 heads of 576-wide latents
    tok = (tl.program_id(0) * BM + r // BH).to(tl.int64)
    h = tl.program_id(1) * BH + r % BH
    split = tl.program_id(2)
    lens = tl.load(lens_ptr + tok, mask=tok < T, other=0).to(tl.int32)  # [M] each row's keys
    table = table_ptr + tl.load(row_ptr).to(tl.int64) * table_stride  # the sequence's request-table row
    _latent_tile(q_ptr + tok[:, None] * q_stride + h[:, None] * L, (tok < T) & (h < H), table, lens,
                 tl.max(lens, axis=0), k_ptr, v_ptr, kv_stride_s, part_o_ptr, part_lse_ptr,
                 (tok * H + h) * SPLITS + split, split, scale, L, HALF, VALUE, BD, BM * BH, BN, SPLITS, True, IEEE)


def paged_latent_extend_attention(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                                  req_to_token: torch.Tensor, req_row: torch.Tensor, kv_lens: torch.Tensor,
                                  scaling: float, value_dim: int, splits: int | None = None) -> torch.Tensor:
    """``q [T, H, L]``: one sequence's new tokens' latent queries over the latents in ``k_buffer /
    v_buffer [S, 1, half]``; token ``j`` attends to the slots ``req_to_token[req_row, :kv_lens[j]]``
    (``req_row [1]``, ``kv_lens [T]`` on the device; the new tokens' latents written first) -> ``o [T,
    H, value_dim]`` (dtype of q)."""
    t, heads, width = _check(q, k_buffer, v_buffer, req_to_token, value_dim)
    if req_row.shape != (1,) or kv_lens.shape != (t,):
        raise ValueError(f"req_row must be [1] and kv_lens [{t}]")
    half = k_buffer.shape[-1]
    rows, bn, warps = TILES
    bh = min(rows, triton.next_power_of_2(heads))
    bm = max(1, rows // bh)
    blocks = triton.cdiv(t, bm)
    splits = _splits(splits or min(MAX_SPLITS, num_splits(blocks * triton.cdiv(heads, bh), 1)))
    out, part_o, part_lse = _outputs(q, half, value_dim, splits)
    if t:
        _latent_extend_stage1[(blocks, triton.cdiv(heads, bh), splits)](
            q, q.stride(0), k_buffer, v_buffer, req_to_token, req_to_token.stride(0), req_row, kv_lens, part_o,
            part_lse, scaling, k_buffer.stride(0), t, H=heads, L=width, HALF=half, VALUE=value_dim, BD=_block(half),
            BH=bh, BM=bm, BN=bn, SPLITS=splits, IEEE=q.dtype == torch.float32, num_warps=warps, **pdl.launch(q))
    return out if splits == 1 else merge_splits(part_o, part_lse, q.dtype)[:, :, :value_dim]


def _check(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, req_to_token: torch.Tensor,
           value_dim: int) -> tuple[int, int, int]:
    """Both kernels' checks: ``q [N, H, L]`` with contiguous rows, the K and V buffers ``[S, 1, half]``
    contiguous with ``L <= 2*half``, ``0 < value_dim <= L``, request-table rows contiguous. Returns
    ``q``'s shape."""
    n, heads, width = q.shape
    half = k_buffer.shape[-1]
    if k_buffer.shape[1:] != (1, half) or v_buffer.shape != k_buffer.shape or not width <= 2 * half \
            or not 0 < value_dim <= width:
        raise ValueError(f"q {list(q.shape)} and value_dim {value_dim} do not fit the KV buffers "
                         f"{list(k_buffer.shape)}, {list(v_buffer.shape)} (two halves of the latent)")
    if q.stride(2) != 1 or q.stride(1) != width or not (k_buffer.is_contiguous() and v_buffer.is_contiguous()):
        raise ValueError("q rows [H, L] and the KV buffers must be contiguous")
    if req_to_token.stride(1) != 1:
        raise ValueError("req_to_token rows must be contiguous")
    return n, heads, width


def _outputs(q: torch.Tensor, half: int, value_dim: int, splits: int) -> tuple:
    """``(out, part_o, part_lse)`` for a launch of ``splits`` splits over queries ``q [N, H, L]``: with
    one split the output ``[N, H, value_dim]`` itself, which stage 1 writes (``part_o`` is it,
    ``part_lse`` unused), else stage 2's partials ``[N, H, splits, 2*half]`` and ``[N, H, splits]`` fp32."""
    n, heads = q.shape[:2]
    if splits == 1:
        out = torch.empty(n, heads, value_dim, dtype=q.dtype, device=q.device)
        return out, out, out
    return None, torch.empty(n, heads, splits, 2 * half, dtype=torch.float32, device=q.device), \
        torch.empty(n, heads, splits, dtype=torch.float32, device=q.device)


def _block(half: int) -> int:
    """The register width of a latent half: a power of two, at least ``tl.dot``'s 16."""
    return max(16, triton.next_power_of_2(half))


def _splits(splits: int) -> int:
    if splits & (splits - 1):
        raise ValueError(f"splits must be a power of two, got {splits}")
    return splits
