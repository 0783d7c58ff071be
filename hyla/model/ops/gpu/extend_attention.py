"""Extend attention over the paged KV pool in Triton: one sequence's new tokens, causal, split-KV.

Reference: :func:`hyla.model.ops.attention.extend_sdpa` (causal, fp32 softmax), as the PyTorch
extend path runs it after gathering the sequence's keys. Here nothing is gathered and nothing is
read on the host: the sequence owns row ``req_row`` of the request table ``req_to_token``, and new
token ``j`` attends to its first ``kv_lens[j]`` entries (its prefix and the new tokens up to itself,
their K/V already written by the attention prologue, ``decode_attention.decode_qk_prologue``). The
shapes depend on the token count only, so an extend can be captured in a CUDA graph
(``engine/cuda_graph.py``'s ``CudaGraphExtend``, padded to a bucket: a padding token's
``kv_lens`` entry is 1, its output don't-care).

It is the decode kernel's flash-decoding (the same online-softmax loop, ``decode_attention._attend_split``,
causal here), with ``BM`` consecutive tokens per program instead of one:
program ``(block, kv_head, split)`` runs an online softmax over its share of the block's keys for
the block's ``BM`` tokens times the ``Hq/Hkv`` query heads of that KV head (one ``[BM * BH, D]``
tile for ``tl.dot``), so each key tile is read once for ``BM`` tokens, where one program per token
would read the whole prefix once per token. Keys past a token's length are masked (the causal
mask, and the end of a shorter block-mate's keys). The splits are merged, and the output gate
applied, by the decode kernel's second stage.

With a sliding window ``W > 0`` (Hugging Face's ``sliding_window`` mask: the query at position ``p``
sees key ``k`` iff ``k <= p`` and ``p - k < W``) token ``j`` attends only to the last ``min(W,
kv_lens[j])`` of its keys, ``[max(0, kv_lens[j] - W), kv_lens[j])``: keys below a row's window are
masked too, and a program's key range starts at its block's shortest length minus ``W`` (clamped to
0; the keys below it no row of the block sees), so a long prefix costs only the window (but for the
block holding a graph's padding tokens: their length 1 starts it at 0). ``W = 0``: no window (the
kernel compiled without it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hyla.model.ops.gpu import pdl
from hyla.model.ops.gpu.decode_attention import _attend_split, _split_range, _store_partials, check_window, \
    merge_splits, num_splits, split_partials

# A program's tile, read at each launch (benchmarks/attention_tiles.py times every choice; not yet on a GPU):
TILE_ROWS = 64  # query rows: BM tokens x the query heads of one KV head (padded to a power of 2)
TILE_KEYS = 0  # keys per step of its loop; 0: 32 in fp32 or for heads over 128 wide (registers), else 64
NUM_WARPS = 8


@triton.jit(do_not_specialize=["T", "window"], do_not_specialize_on_alignment=["row_ptr", "lens_ptr"])
def _extend_stage1(q_ptr, q_stride, k_ptr, v_ptr, table_ptr, table_stride, row_ptr, lens_ptr, part_o_ptr,
                   part_lse_ptr, scale, kv_stride_s, T, window, HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
                   BD: tl.constexpr, BH: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, SPLITS: tl.constexpr,
                   WINDOW: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr):
    pdl.wait(PDL)  # (pdl.py)
    blk = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    G: tl.constexpr = HQ // HKV
    r = tl.arange(0, BM * BH)  # the tile's rows: token blk * BM + r // BH, query head kvh * G + r % BH
    # int64: tok * q_stride and the partials' rows (tok * Hq * D) pass 2**31 elements past ~524K tokens of
    # 16 query heads of 256 (Qwen3-Next)
    tok = (blk * BM + r // BH).to(tl.int64)
    h = r % BH
    mr = (tok < T) & (h < G)
    d = tl.arange(0, BD)
    md = d < D
    q = tl.load(q_ptr + tok[:, None] * q_stride + (kvh * G + h[:, None]) * D + d[None, :],
                mask=mr[:, None] & md[None, :], other=0.0)  # [M, BD]
    lens = tl.load(lens_ptr + tok, mask=tok < T, other=0).to(tl.int32)  # [M] each row's keys
    length = tl.max(lens, axis=0)  # the block's longest
    table = table_ptr + tl.load(row_ptr).to(tl.int64) * table_stride  # the sequence's request-table row
    lo = 0
    if WINDOW:  # no row sees a key below the block's shortest length - window: split only the keys from there
        shortest = tl.min(tl.where(tok < T, lens, length), axis=0)  # (the rows past T: none of the block's)
        lo = tl.maximum(shortest - window, 0)
    start, end = _split_range(lo, length, split, SPLITS, BN)
    acc, m_i, l_i = _attend_split(q, table, k_ptr + kvh * D, v_ptr + kvh * D, kv_stride_s, start, end, lens, window,
                                  scale, d, md, BM * BH, BD, BN, True, WINDOW, IEEE)
    # the decode kernel's partial layout
    _store_partials(part_o_ptr, part_lse_ptr, (tok * HQ + kvh * G + h) * SPLITS + split, acc, m_i, l_i, mr, d, md, D)


def paged_extend_attention(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                           req_to_token: torch.Tensor, req_row: torch.Tensor, kv_lens: torch.Tensor, scaling: float,
                           splits: int | None = None, gate: torch.Tensor | None = None,
                           window: int = 0) -> torch.Tensor:
    """``q [T, Hq, D]`` (contiguous heads; rows may be strided): one sequence's new tokens over
    ``k_buffer / v_buffer [S, Hkv, D]``; token ``j`` attends to the slots ``req_to_token[req_row,
    :kv_lens[j]]`` (``req_row [1]``, ``kv_lens [T]`` on the device) -> ``o [T, Hq, D]`` (dtype of
    q), times ``sigmoid(gate)`` with a ``gate [T, Hq, D]`` (unit stride along D). A sliding ``window >
    0``: only the last ``window`` of those slots, ``[max(0, kv_lens[j] - window), kv_lens[j])``."""
    window = check_window(window)
    t, hq, d = q.shape
    hkv = k_buffer.shape[1]
    if hq % hkv or k_buffer.shape[2] != d or v_buffer.shape != k_buffer.shape:
        raise ValueError(f"q {list(q.shape)} does not fit the KV buffers {list(k_buffer.shape)}")
    if hq // hkv > TILE_ROWS or q.stride(2) != 1 or q.stride(1) != d \
            or not (k_buffer.is_contiguous() and v_buffer.is_contiguous()):
        raise ValueError(f"q rows [Hq, D] and the KV buffers must be contiguous, with at most {TILE_ROWS} query "
                         "heads per KV head")
    if req_row.shape != (1,) or kv_lens.shape != (t,) or req_to_token.stride(1) != 1:
        raise ValueError(f"req_row must be [1] and kv_lens [{t}]; req_to_token rows contiguous")
    if gate is not None and (gate.shape != q.shape or gate.dtype != q.dtype or gate.stride(2) != 1):
        raise ValueError(f"gate must be [T, Hq, D] = {list(q.shape)} in {q.dtype} with unit stride along D")
    bh = triton.next_power_of_2(hq // hkv)
    bm = max(1, TILE_ROWS // bh)
    bd = triton.next_power_of_2(d)
    ieee = q.dtype == torch.float32
    bn = TILE_KEYS or (32 if ieee or bd > 128 else 64)
    blocks = triton.cdiv(t, bm)
    splits = splits or num_splits(blocks, hkv)
    if splits & (splits - 1):
        raise ValueError(f"splits must be a power of 2, got {splits}")
    part_o, part_lse = split_partials(q, splits)
    if t:
        _extend_stage1[(blocks, hkv, splits)](
            q, q.stride(0), k_buffer, v_buffer, req_to_token, req_to_token.stride(0), req_row, kv_lens, part_o,
            part_lse, scaling, k_buffer.stride(0), t, window, HQ=hq, HKV=hkv, D=d, BD=bd, BH=bh, BM=bm,
            BN=bn, SPLITS=splits, WINDOW=window > 0, IEEE=ieee, num_warps=NUM_WARPS, **pdl.launch(q))
    return merge_splits(part_o, part_lse, q.dtype, gate)
