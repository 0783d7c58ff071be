"""Decode attention over the paged KV pool in Triton: one query per sequence, split-KV (flash-decoding).

Reference: :func:`hyla.model.ops.attention.decode_attention` (same result, fp32 softmax). Instead of a
``[B, L]`` table built on the host each step, the kernel reads each sequence's KV slots straight from
the request table on the device: sequence ``i`` owns row ``req_rows[i]`` of ``req_to_token`` and its
first ``seq_lens[i]`` entries (the new token's K/V already written). Both come from the device, so
the launch has a fixed shape for a batch size (CUDA-graph friendly).

With a sliding window ``W > 0`` (Hugging Face's ``sliding_window`` mask: the query at position ``p``
sees key ``k`` iff ``k <= p`` and ``p - k < W``) sequence ``i`` attends only to its last
``min(W, seq_lens[i])`` keys, ``[max(0, seq_lens[i] - W), seq_lens[i])``: its key range starts there,
so a long context costs only the window. ``W = 0``: no window (the kernel compiled without it).

Stage 1: program ``(i, kv_head, split)`` runs an online softmax over its share of the keys for the
``Hq/Hkv`` query heads of that KV head (padded to 16 rows for ``tl.dot``) and writes a partial
output with its log-sum-exp. Stage 2 merges the splits (empty splits, such as those past a short
window, carry ``lse = -inf``) and applies the output gate ``* sigmoid(gate)`` (Qwen3-Next / Qwen3.5)
when there is one.

Before them, :func:`decode_qk_prologue` turns the layer's projection into what they read, in one
kernel: per-head q/k RMSNorm, partial RoPE, and the new token's K/V written to the pool. Its
reference is the PyTorch sequence in ``Attention.forward`` (concatenation, ``rms_norm``,
``apply_rotary_``, ``write_rows_``), rounded where that rounds. The RoPE angles come from the
tokens' positions and the rotary's ``inv_freq`` in the kernel (``cos(position * inv_freq)`` in fp32
rounded to the model dtype, as ``RotaryEmbedding`` computes its tables), so a step builds no tables
(~9 small launches of PyTorch ops).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hyla.model.ops import attention
from hyla.model.ops.gpu import pdl
from hyla.model.ops.gpu.fp8 import store_rounded


@triton.jit
def _attend_split(q, table, k_ptr, v_ptr, kv_stride_s, start, end, lens, window, scale, d, md, R: tl.constexpr,
                  BD: tl.constexpr, BN: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr, IEEE: tl.constexpr):
    """The online softmax of query rows ``q [R, BD]`` over keys ``[start, end)`` of one request-table
    row ``table`` (``k_ptr`` / ``v_ptr`` at the KV head's first element) -> ``(acc [R, BD], m [R], l [R])``;
    with ``CAUSAL`` row ``r`` sees only keys below ``lens[r]``, with ``WINDOW`` only keys from ``lens[r] -
    window`` on (a row may see none in a block: no NaN from ``-inf - -inf``)."""
    m_i = tl.full([R], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([R], dtype=tl.float32)
    acc = tl.zeros([R, BD], dtype=tl.float32)
    for n0 in range(start, end, BN):
        n = n0 + tl.arange(0, BN)
        mn = n < end
        slot = tl.load(table + n, mask=mn, other=0).to(tl.int64)
        kv_off = slot[:, None] * kv_stride_s + d[None, :]
        kv_mask = mn[:, None] & md[None, :]
        keys = tl.load(k_ptr + kv_off, mask=kv_mask, other=0.0).to(q.dtype)  # [BN, BD] (float8 K/V widened)
        if IEEE:
            s = tl.dot(q, tl.trans(keys), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(keys))
        seen = mn[None, :]  # [1, BN]
        if CAUSAL:
            seen = seen & (n[None, :] < lens[:, None])  # [R, BN]: each row's own keys
        if WINDOW:
            seen = seen & (n[None, :] >= lens[:, None] - window)  # [R, BN]: and only its last `window`
        s = tl.where(seen, s.to(tl.float32) * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        values = tl.load(v_ptr + kv_off, mask=kv_mask, other=0.0).to(q.dtype)  # [BN, BD]
        if IEEE:
            pv = tl.dot(p, values.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(values.dtype), values)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _split_range(lo, length, split, SPLITS: tl.constexpr, BN: tl.constexpr):
    """Split ``split``'s share ``[start, end)`` of the keys ``[lo, length)``, in whole blocks of ``BN``."""
    per = tl.cdiv(tl.cdiv(length - lo, SPLITS), BN) * BN  # keys per split
    start = lo + split * per
    return start, tl.minimum(start + per, length)


@triton.jit
def _store_partials(part_o_ptr, part_lse_ptr, out, acc, m_i, l_i, mask, d, md, D: tl.constexpr):
    """A split's partial output and log-sum-exp at rows ``out`` of stage 2's layout (an empty
    split: ``lse = -inf``, which stage 2 weighs 0)."""
    empty = l_i == 0.0
    tl.store(part_o_ptr + out[:, None] * D + d[None, :], acc / tl.where(empty, 1.0, l_i)[:, None],
             mask=mask[:, None] & md[None, :])
    tl.store(part_lse_ptr + out, tl.where(empty, float("-inf"), m_i + tl.log(l_i)), mask=mask)


@triton.jit(do_not_specialize=["window"], do_not_specialize_on_alignment=["rows_ptr", "lens_ptr"])
def _stage1(q_ptr, q_stride, k_ptr, v_ptr, table_ptr, table_stride, rows_ptr, lens_ptr, part_o_ptr, part_lse_ptr, scale,
            kv_stride_s, window, HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BD: tl.constexpr,
            BH: tl.constexpr, BN: tl.constexpr, SPLITS: tl.constexpr, WINDOW: tl.constexpr, IEEE: tl.constexpr,
            PDL: tl.constexpr):
    pdl.wait(PDL)  # (pdl.py)
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
    lo = 0
    if WINDOW:  # only the window's keys [length - window, length) are split: every key there is seen (no mask)
        lo = tl.maximum(length - window, 0)
    start, end = _split_range(lo, length, split, SPLITS, BN)
    acc, m_i, l_i = _attend_split(q, table, k_ptr + kvh * D, v_ptr + kvh * D, kv_stride_s, start, end, length,
                                  window, scale, d, md, BH, BD, BN, False, False, IEEE)
    _store_partials(part_o_ptr, part_lse_ptr, (i * HQ + kvh * G + h) * SPLITS + split, acc, m_i, l_i, mh, d, md, D)


@triton.jit
def _stage2(part_o_ptr, part_lse_ptr, o_ptr, gate_ptr, gate_stride, HQ: tl.constexpr, D: tl.constexpr,
            BD: tl.constexpr, SPLITS: tl.constexpr, GATE: tl.constexpr, GATE_HEAD_STRIDE: tl.constexpr,
            PDL: tl.constexpr):
    pdl.wait(PDL)  # (pdl.py)
    # (sequence, query head): an extend's token and head too (merge_splits). int64: row * D, and the gate's
    # (row // HQ) * gate_stride (Qwen3-Next's projection: 9,216 wide), pass 2**31 elements past ~233K tokens
    row = tl.program_id(0).to(tl.int64)
    s = tl.arange(0, SPLITS)
    d = tl.arange(0, BD)
    md = d < D
    lse = tl.load(part_lse_ptr + row * SPLITS + s)  # [SPLITS]
    w = tl.exp(lse - tl.max(lse, axis=0))  # empty splits: exp(-inf) = 0
    parts = tl.load(part_o_ptr + (row * SPLITS + s[:, None]) * D + d[None, :], mask=md[None, :], other=0.0)
    o = (tl.sum(parts * w[:, None], axis=0) / tl.sum(w, axis=0)).to(o_ptr.dtype.element_ty)
    if GATE:  # o * sigmoid(gate), each rounded to the dtype as the layer's two ops round
        g = tl.load(gate_ptr + (row // HQ) * gate_stride + (row % HQ) * GATE_HEAD_STRIDE + d, mask=md, other=0.0)
        sig = tl.sigmoid(g.to(tl.float32)).to(o_ptr.dtype.element_ty)
        o = (o.to(tl.float32) * sig.to(tl.float32)).to(o_ptr.dtype.element_ty)
    tl.store(o_ptr + row * D + d, o, mask=md)


def num_splits(batch_size: int, num_kv_heads: int, num_sms: int = 132) -> int:
    """Splits per (sequence, KV head): enough programs to fill the GPU (~2 per SM), at most 32."""
    want = max(1, (2 * num_sms) // max(1, batch_size * num_kv_heads))
    return min(32, triton.next_power_of_2(want))


def paged_decode_attention(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                           req_to_token: torch.Tensor, req_rows: torch.Tensor, seq_lens: torch.Tensor,
                           scaling: float, splits: int | None = None, gate: torch.Tensor | None = None,
                           window: int = 0) -> torch.Tensor:
    """``q [B, Hq, D]`` (rows may be strided) over ``k_buffer / v_buffer [S, Hkv, D]``; sequence ``i`` attends to the slots
    ``req_to_token[req_rows[i], :seq_lens[i]]`` -> ``o [B, Hq, D]`` (dtype of q), times ``sigmoid(gate)``
    with a ``gate [B, Hq, D]`` (a strided view of the projection, unit stride along D). A sliding ``window
    > 0``: only the last ``window`` of those slots, ``[max(0, seq_lens[i] - window), seq_lens[i])``."""
    window = check_window(window)
    b, hq, d = q.shape
    hkv = k_buffer.shape[1]
    if hq % hkv or k_buffer.shape[2] != d or v_buffer.shape != k_buffer.shape:
        raise ValueError(f"q {list(q.shape)} does not fit the KV buffers {list(k_buffer.shape)}")
    if hq // hkv > 64 or q.stride(2) != 1 or q.stride(1) != d or not (k_buffer.is_contiguous() and v_buffer.is_contiguous()):
        raise ValueError("q rows [Hq, D] and the KV buffers must be contiguous, with at most 64 query heads per KV head")
    if req_rows.shape != (b,) or seq_lens.shape != (b,) or req_to_token.stride(1) != 1:
        raise ValueError("req_rows and seq_lens must be [B]; req_to_token rows contiguous")
    if gate is not None and (gate.shape != q.shape or gate.dtype != q.dtype or gate.stride(2) != 1):
        raise ValueError(f"gate must be [B, Hq, D] = {list(q.shape)} in {q.dtype} with unit stride along D")
    splits = splits or num_splits(b, hkv)
    part_o, part_lse = split_partials(q, splits)
    bd = triton.next_power_of_2(d)
    ieee = q.dtype == torch.float32
    _stage1[(b, hkv, splits)](
        q, q.stride(0), k_buffer, v_buffer, req_to_token, req_to_token.stride(0), req_rows, seq_lens, part_o, part_lse, scaling,
        k_buffer.stride(0), window, HQ=hq, HKV=hkv, D=d, BD=bd, BH=max(16, triton.next_power_of_2(hq // hkv)),
        BN=32 if ieee or bd > 128 else 64, SPLITS=splits, WINDOW=window > 0, IEEE=ieee, num_warps=4, **pdl.launch(q))
    return merge_splits(part_o, part_lse, q.dtype, gate)


def check_window(window: int) -> int:
    """A sliding window for the kernels (an int >= 0; 0: none) as their int32 argument: a larger one than
    2**31 - 1 becomes that, which masks no key of any sequence either."""
    attention.check_window(window)  # the ops' rule
    return min(window, 2**31 - 1)


def split_partials(q: torch.Tensor, splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Stage 1's outputs for queries ``q [N, Hq, D]``: ``part_o [N, Hq, splits, D]`` and
    ``part_lse [N, Hq, splits]``, fp32."""
    n, hq, d = q.shape
    return (torch.empty(n, hq, splits, d, dtype=torch.float32, device=q.device),
            torch.empty(n, hq, splits, dtype=torch.float32, device=q.device))


def merge_splits(part_o: torch.Tensor, part_lse: torch.Tensor, dtype: torch.dtype,
                 gate: torch.Tensor | None = None) -> torch.Tensor:
    """Stage 2: the splits of :func:`split_partials` merged -> ``o [N, Hq, D]`` in ``dtype``, times
    ``sigmoid(gate)`` with a ``gate [N, Hq, D]`` (unit stride along D)."""
    n, hq, splits, d = part_o.shape
    o = torch.empty(n, hq, d, dtype=dtype, device=part_o.device)
    if n:
        _stage2[(n * hq,)](part_o, part_lse, o, gate if gate is not None else o,
                           gate.stride(0) if gate is not None else 0, HQ=hq, D=d, BD=triton.next_power_of_2(d),
                           SPLITS=splits, GATE=gate is not None,
                           GATE_HEAD_STRIDE=gate.stride(1) if gate is not None else 0, **pdl.launch(part_o))
    return o


@triton.jit(do_not_specialize_on_alignment=["pos_ptr", "loc_ptr"])
def _qk_prologue_kernel(qkv_ptr, qkv_stride, scale_ptr, pos_ptr, inv_freq_ptr, loc_ptr, q_ptr,
                        k_ptr, v_ptr, kv_stride_s, eps, HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
                        Q_HEAD_STRIDE: tl.constexpr, Q_SIZE: tl.constexpr, ROT: tl.constexpr,
                        NORM: tl.constexpr, ROPE: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl.wait(PDL)  # (pdl.py)
    i = tl.program_id(0).to(tl.int64)  # a token (an extend's too): i * qkv_stride passes 2**31 elements past
    # ~233K tokens of Qwen3-Next's 9,216-wide projection
    h = tl.program_id(1)  # q heads, then k heads, then v heads
    d = tl.arange(0, BLOCK)
    md = d < D
    hs = tl.zeros([BLOCK], dtype=tl.int32) + h  # the head as a block (the interpreter rejects a scalar
    # condition broadcast into a mask)
    is_q = hs < HQ
    is_v = hs >= HQ + HKV
    j = tl.where(is_v, h - HQ - HKV, h - HQ)  # the K/V head
    src = qkv_ptr + i * qkv_stride + tl.where(is_q, h * Q_HEAD_STRIDE, Q_SIZE + tl.where(is_v, HKV * D, 0) + j * D)
    x = tl.load(src + d, mask=md, other=0.0)
    y = x
    if NORM:  # y = (x * rsqrt(mean(x^2) + eps) * scale[h]).to(dtype), as rms_norm_fused
        x32 = x.to(tl.float32)
        inv = tl.rsqrt(tl.sum(x32 * x32, axis=0) / D + eps)
        srow = scale_ptr + tl.where(is_v, 0, h) * D  # v is not normed (its scale row is never used)
        y = tl.where(is_v, x, (x32 * inv * tl.load(srow + d, mask=md, other=0.0)).to(x.dtype))
    if ROPE:  # apply_rotary_: y[:ROT] = y * cos + roll(y, ROT/2) * signed_sin, each product rounded
        half = ROT // 2
        p = tl.where(d < half, d + half, d - half)  # roll's source channel
        xp = tl.load(src + p, mask=d < ROT, other=0.0)
        yp = xp
        if NORM:
            xp32 = xp.to(tl.float32)
            yp = (xp32 * inv * tl.load(srow + p, mask=d < ROT, other=0.0)).to(x.dtype)
        # RotaryEmbedding's tables: angle = position * inv_freq[d mod ROT/2] in fp32, cos and sin
        # rounded to the dtype; signed_sin negates the first half
        angle = tl.load(pos_ptr + i).to(tl.float32) * tl.load(inv_freq_ptr + tl.where(d < half, d, d - half),
                                                               mask=d < ROT, other=0.0)
        c = tl.cos(angle).to(x.dtype).to(tl.float32)
        sn = tl.sin(angle).to(x.dtype).to(tl.float32)
        sn = tl.where(d < half, -sn, sn)
        rotated = (yp.to(tl.float32) * sn).to(x.dtype)
        rot = ((y.to(tl.float32) * c).to(x.dtype).to(tl.float32) + rotated.to(tl.float32)).to(x.dtype)
        y = tl.where((d < ROT) & (hs < HQ + HKV), rot, y)
    tl.store(q_ptr + (i * HQ + h) * D + d, y, mask=md & is_q)
    slot = tl.load(loc_ptr + i).to(tl.int64)
    kv = slot * kv_stride_s + j * D + d
    store_rounded(k_ptr + kv, y, md & ~is_q & ~is_v)  # (a float8 buffer: rounded as PyTorch rounds)
    store_rounded(v_ptr + kv, y, md & is_v)


def decode_qk_prologue(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int, output_gate: bool,
                       k_buffer: torch.Tensor, v_buffer: torch.Tensor, out_cache_loc: torch.Tensor,
                       qk_scale: torch.Tensor | None, eps: float, rope: tuple[torch.Tensor, torch.Tensor] | None
                       ) -> torch.Tensor:
    """An attention layer's decode step up to the attention itself, in one kernel.

    ``qkv [B, Q + 2 * Hkv * D]``: the projection, ``Q`` = ``Hq * D``, or ``Hq * 2D`` with an output
    gate (each head ``[q | gate]``). Per-head RMSNorm of q and k with ``qk_scale [Hq + Hkv, D]``
    (fp32; None: no norm), then RoPE on the first ``rotary_dim`` channels with ``rope = (positions
    [B] int64, inv_freq [rotary_dim / 2] fp32)`` (None: no RoPE); k and v go to ``k_buffer /
    v_buffer [S, Hkv, D]`` at ``out_cache_loc [B]``. Returns ``q [B, Hq, D]``."""
    b = qkv.shape[0]
    hq, hkv, d = num_heads, num_kv_heads, head_dim
    q_size = hq * d * (2 if output_gate else 1)
    if qkv.dim() != 2 or qkv.shape[1] != q_size + 2 * hkv * d or qkv.stride(1) != 1:
        raise ValueError(f"qkv must be [B, {q_size + 2 * hkv * d}] with unit column stride, got {list(qkv.shape)}")
    if k_buffer.shape[1:] != (hkv, d) or v_buffer.shape != k_buffer.shape or not (
            k_buffer.is_contiguous() and v_buffer.is_contiguous()):
        raise ValueError(f"the KV buffers must be contiguous [S, {hkv}, {d}], got {list(k_buffer.shape)}")
    if out_cache_loc.shape != (b,):
        raise ValueError(f"out_cache_loc must be [{b}]")
    if qk_scale is not None and (qk_scale.shape != (hq + hkv, d) or qk_scale.dtype != torch.float32
                                 or not qk_scale.is_contiguous()):
        raise ValueError(f"qk_scale must be a contiguous fp32 [{hq + hkv}, {d}] tensor")
    rot = 0
    if rope is not None:
        positions, inv_freq = rope
        rot = 2 * inv_freq.numel()
        if positions.shape != (b,) or positions.stride(0) != 1 or inv_freq.dim() != 1 \
                or inv_freq.dtype != torch.float32 or rot > d or not inv_freq.is_contiguous():
            raise ValueError(f"rope must be (positions [B={b}], a contiguous fp32 inv_freq [rotary_dim / 2 <= {d // 2}])")
    q = torch.empty(b, hq, d, dtype=qkv.dtype, device=qkv.device)
    _qk_prologue_kernel[(b, hq + 2 * hkv)](
        qkv, qkv.stride(0), qk_scale if qk_scale is not None else q, *(rope if rope is not None else (q, q)),
        out_cache_loc, q, k_buffer, v_buffer, k_buffer.stride(0), eps,
        HQ=hq, HKV=hkv, D=d, Q_HEAD_STRIDE=(2 if output_gate else 1) * d, Q_SIZE=q_size, ROT=max(rot, 2),
        NORM=qk_scale is not None, ROPE=rope is not None, BLOCK=triton.next_power_of_2(d), **pdl.launch(qkv))
    return q
