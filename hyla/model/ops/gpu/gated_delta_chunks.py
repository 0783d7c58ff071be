"""An extend's Gated DeltaNet segments in chunks of ``BT`` tokens, one Triton launch: the chunked
(WY) form of the recurrence, so that a program's tokens cost a few matrix products per chunk where
the recurrent kernel (``gated_delta_decode.gated_delta_segments_fused``) pays one token's chain of
reductions per token. Same contract as that kernel (segments, pool rows, checkpoints written on
the way), same gating (``gated_delta_decode._gdn_step``'s: l2norm'd q and k, ``beta = sigmoid(b)``,
``g = -exp(A_log) * softplus(a + dt_bias)``).

Per value head, with ``h [Dk, Dv]`` the state before a chunk and, inside it, ``G_t`` the cumulative
log-decay (``G_t = g_1 + ... + g_t``), the recurrence ``S_t = e_t S_{t-1} + k_t delta_t^T``,
``delta_t = beta_t (v_t - e_t S_{t-1}^T k_t)``, ``o_t = S_t^T q_t`` unrolls to (fla's naive chunk
reference, ``hyla.model.ops.gated_delta``'s)::

    A[t, s] = beta_t exp(G_t - G_s) (k_t . k_s)   for s < t, else 0      [BT, BT]
    delta   = (I + A)^-1 (beta * (V - exp(G) * (K h)))                   [BT, Dv]
    O       = exp(G) * (Q h) + (Q K^T * exp(G_t - G_s), s <= t) delta     [BT, Dv]
    S_t     = exp(G_t) h + sum_{s <= t} exp(G_t - G_s) k_s delta_s^T     (the state after token t)

``delta`` comes by forward substitution on the right-hand side, row by row (``A`` is strictly
lower triangular; a product formula for the inverse would lose digits to cancellation when many
keys repeat). ``exp(G_t - G_s)`` (``s <= t``, never above 1) is ``exp`` of the sum ``g_{s+1} + ..
+ g_t`` itself, not of a difference of running sums, in which one huge decay would cost the
later tokens their digits (``segment_checkpoints.chunk_decay``). A checkpoint inside a chunk is
the last line at its token; the state after the chunk is the same at its last token (the rows
past a segment's end are masked to zero keys, values and decays, and change nothing). A NaN in
one token's inputs reaches the chunk's earlier outputs too (masked products are ``0 * NaN``),
where the recurrence spreads it forward only; other segments are other programs.

Each program owns one ``(segment, value head, block of Dv columns)`` and runs its chunks in order.
What in a chunk does not depend on ``h`` need not wait for the chunks before it: with
``WY_PREPASS`` (fla's WY form), a first launch computes, for every chunk of every segment and head
at once, ``T = (I + A)^-1`` (forward substitution on the identity) and ``W = T (beta * exp(G) * K)
[BT, Dk]``, ``U = T (beta * V) [BT, Dv]`` into fp32 scratch, so that the chunk loop is left with
``delta = U - W h`` — two products on its sequential path instead of ``K K^T``, ``K h`` and
``BT - 1`` dependent substitution steps (each a reduction across the program's warps). Without it,
each program recomputes its head's ``A`` and the substitution itself (the head's other column
blocks do the same work; no program waits for another). The products run on ``tl.dot`` at ``DOT_PRECISION`` (``tf32x3``: fp32 accuracy from
tensor cores; Triton's interpreter computes them in fp32) for fp32 activations, ``HALF_DOT_PRECISION``
(``tf32``) for bf16/fp16 ones.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from hyla.model.ops.gpu import pdl, segments_of
from hyla.model.ops.gpu.fla_chunk import SegmentKernel
from hyla.model.ops.gpu.gated_delta_decode import (
    _beta,
    _check_inputs,
    _gdn_gates,
    _gdn_program,
    gated_delta_segments_fused,
)
from hyla.model.ops.gpu.segment_checkpoints import (
    INDEX_ARGS,
    SegmentCheckpoints,
    chunk_decay,
    chunk_state_at,
    first_checkpoint,
    open_segment,
    segment_checkpoint_args,
    write_chunk_checkpoints,
)

# (tokens per chunk, value columns of the state per program, warps). tl.dot needs each at least 16.
# benchmarks/recurrent_tiles.py on an H100: 16x32 with 4 warps was the fastest of ten choices from 64 to
# 4,096 tokens, and tf32 products took 94 µs for 296 tokens where tf32x3 took 208 (16 heads of 128x128).
CHUNK_TILES = (16, 32, 4)
DOT_PRECISION = "tf32x3"  # tl.dot's input_precision for fp32 activations: fp32 accuracy from tensor cores
HALF_DOT_PRECISION = "tf32"  # for bf16/fp16 ones: 10-bit products, finer than the activations' own
# 7- or 10-bit mantissas (fla's chunked kernels multiply in bf16); the states stay fp32
WY_PREPASS = True  # T, W and U of every chunk in a launch of their own (the module docstring); read each launch.
# Reasoned, not yet measured: benchmarks/recurrent_tiles.py times both ("Gated DeltaNet, WY pre-pass")
WY_WARPS = 1  # the pre-pass's warps (a program: one chunk of one head, all its Dk and Dv columns). Its
# substitution is a chain of reductions, like the recurrent segments kernel's (fastest at 1 warp): compiled for
# sm_90 at 16x128 heads (scripts/compile_gpu_kernels.py), 23 bar.sync in its PTX at 1 warp, 101 at 4; not timed
CHUNKED_MIN_LEN = 32  # a launch whose longest segment has at least this many tokens runs in chunks; read each
# launch. Set by reasoning, not measured: the recurrent kernel pays one token's chain of reductions a
# token, this one a few products and a 16-row substitution a chunk (benchmarks/fla_prefill.py times both)


@triton.jit
def _gdn_chunk_inputs(qkv_ptr, qkv_stride, a_ptr, a_stride, b_ptr, b_stride, r, live, hk, hv, dk, mk, vcol, mv,
                      neg_a, dt_bias, scale, HK: tl.constexpr, DK: tl.constexpr, BETA_SCALE: tl.constexpr = 1.0):
    """A chunk's inputs at packed rows ``r [BT]`` (``live``: within the segment): ``q`` (l2norm'd,
    scaled), ``k`` (l2norm'd) ``[BT, BK]``, ``v [BT, BV]`` (value columns ``vcol`` of all heads')
    and the gates ``g``, ``beta [BT]``, all fp32 and zero past the segment's end (no decay, no
    update there)."""
    row = qkv_ptr + r[:, None] * qkv_stride
    mq = live[:, None] & mk[None, :]
    q = tl.load(row + hk * DK + dk[None, :], mask=mq, other=0.0).to(tl.float32)  # [BT, BK]
    k = tl.load(row + HK * DK + hk * DK + dk[None, :], mask=mq, other=0.0).to(tl.float32)
    v = tl.load(row + 2 * HK * DK + vcol[None, :], mask=live[:, None] & mv[None, :], other=0.0).to(tl.float32)
    av = tl.load(a_ptr + r * a_stride + hv, mask=live, other=0.0)
    bv = tl.load(b_ptr + r * b_stride + hv, mask=live, other=0.0)
    q = q * (tl.rsqrt(tl.sum(q * q, axis=1) + 1e-6) * scale)[:, None]
    k = k * tl.rsqrt(tl.sum(k * k, axis=1) + 1e-6)[:, None]
    g, beta = _gdn_gates(av, bv, neg_a, dt_bias, True, BETA_SCALE)  # [BT] each
    return q, k, v, tl.where(live, g, 0.0), tl.where(live, beta, 0.0)


@triton.jit
def _chunk_a(k, beta, decay, t, PRECISION: tl.constexpr):
    """``A [BT, BT]``: ``beta_t exp(G_t - G_s) (k_t . k_s)`` below the diagonal (``s < t``), else 0."""
    kk = tl.dot(k, tl.trans(k), input_precision=PRECISION)
    return tl.where(t[:, None] > t[None, :], beta[:, None] * decay * kk, 0.0)


@triton.jit
def _substitute(A, rhs, t, BT: tl.constexpr):
    """``(I + A)^-1 rhs`` for a strictly lower triangular ``A [BT, BT]``, by forward substitution:
    row ``s`` = ``rhs_s - sum_{u < s} A[s, u] x_u``, row by row."""
    x = rhs
    for s in tl.static_range(1, BT):
        a_s = tl.sum(tl.where(t[:, None] == s, A, 0.0), axis=0)  # A[s, :]
        x = tl.where(t[:, None] == s, x - tl.sum(a_s[:, None] * x, axis=0)[None, :], x)
    return x


@triton.jit(do_not_specialize=["num_chunks"], do_not_specialize_on_alignment=INDEX_ARGS[1:3])
def _gdn_wy_kernel(qkv_ptr, qkv_stride, a_ptr, a_stride, b_ptr, b_stride, a_log_ptr, dt_bias_ptr,
                   starts_ptr, cu_ptr, w_ptr, u_ptr, num_chunks,
                   HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                   BK: tl.constexpr, BDV: tl.constexpr, BT: tl.constexpr, PRECISION: tl.constexpr,
                   BETA_SCALE: tl.constexpr, PDL: tl.constexpr):
    pdl.wait(PDL)  # (pdl.py)
    # program (segment i, its chunk j, value head hv): the chunk's W [BT, Dk] and U [BT, Dv] (module docstring)
    pid = tl.program_id(0)
    i = pid // num_chunks
    c0 = (pid % num_chunks) * BT
    hv = tl.program_id(1)
    hk = hv // (HV // HK)
    n = tl.load(cu_ptr + i + 1) - tl.load(cu_ptr + i)
    if c0 < n:
        t = tl.arange(0, BT)
        live = (c0 + t) < n
        r = tl.load(starts_ptr + i).to(tl.int64) + c0 + t
        dk = tl.arange(0, BK)
        mk = dk < DK
        dv = tl.arange(0, BDV)
        mv = dv < DV
        _, k, v, g, beta = _gdn_chunk_inputs(qkv_ptr, qkv_stride, a_ptr, a_stride, b_ptr, b_stride, r, live, hk,
                                             hv, dk, mk, hv * DV + dv, mv, -tl.exp(tl.load(a_log_ptr + hv)),
                                             tl.load(dt_bias_ptr + hv), 1.0, HK, DK, BETA_SCALE)
        decay = chunk_decay(g, t)  # [BT, BT]: exp(G_t - G_s), s <= t
        # T = (I + A)^-1: the substitution on the identity
        T = _substitute(_chunk_a(k, beta, decay, t, PRECISION), tl.where(t[:, None] == t[None, :], 1.0, 0.0), t, BT)
        gamma = tl.exp(tl.cumsum(g, axis=0))
        w = tl.dot(T, (beta * gamma)[:, None] * k, input_precision=PRECISION)  # [BT, BK]
        u = tl.dot(T, beta[:, None] * v, input_precision=PRECISION)  # [BT, BDV]
        tl.store(w_ptr + (r[:, None] * HV + hv) * DK + dk[None, :], w, mask=live[:, None] & mk[None, :])
        tl.store(u_ptr + (r[:, None] * HV + hv) * DV + dv[None, :], u, mask=live[:, None] & mv[None, :])


@triton.jit(do_not_specialize_on_alignment=INDEX_ARGS)
def _gdn_chunks_kernel(qkv_ptr, qkv_stride, a_ptr, a_stride, b_ptr, b_stride, a_log_ptr, dt_bias_ptr,
                       state_ptr, rows_ptr, starts_ptr, cu_ptr, o_ptr, o_stride, scale,
                       pool_ptr, ck_off_ptr, ck_pos_ptr, ck_slot_ptr, w_ptr, u_ptr,
                       HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                       BK: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr, CKPT: tl.constexpr,
                       WY: tl.constexpr, PRECISION: tl.constexpr, BETA_SCALE: tl.constexpr, PDL: tl.constexpr):
    pdl.wait(PDL)  # (pdl.py)
    # segment i: packed tokens starts[i] .. + (cu[i+1] - cu[i]), from state row rows[i]
    i, hv, hk, dk, mk, dv, mv, neg_a, dt_bias = _gdn_program(a_log_ptr, dt_bias_ptr, HK, HV, DK, DV, BK, BV)
    inner = hv * (DK * DV) + dk[:, None] * DV + dv[None, :]
    mask = mk[:, None] & mv[None, :]
    # h [BK, BV] fp32: the state before the chunk
    start, n, ptr, h = open_segment(state_ptr, rows_ptr, starts_ptr, cu_ptr, i, HV * DK * DV, inner, mask)
    if CKPT:  # the segment's checkpoints c .. c_end, the next one after nxt tokens (0: none left)
        c, c_end, nxt = first_checkpoint(ck_off_ptr, ck_pos_ptr, i)
    t = tl.arange(0, BT)
    for c0 in range(0, n, BT):
        live = (c0 + t) < n  # [BT]: the chunk's tokens (the last chunk's tail is masked)
        r = start + c0 + t
        q, k, v, g, beta = _gdn_chunk_inputs(qkv_ptr, qkv_stride, a_ptr, a_stride, b_ptr, b_stride, r, live, hk, hv,
                                             dk, mk, hv * DV + dv, mv, neg_a, dt_bias, scale, HK, DK, BETA_SCALE)
        G = tl.cumsum(g, axis=0)
        gamma = tl.exp(G)
        decay = chunk_decay(g, t)  # [BT, BT]: exp(G_t - G_s), s <= t
        if WY:  # delta = U - W h, T's work done by _gdn_wy_kernel
            wu = r[:, None] * HV + hv  # scratch rows [T, Hv, D]
            w = tl.load(w_ptr + wu * DK + dk[None, :], mask=live[:, None] & mk[None, :], other=0.0)
            u = tl.load(u_ptr + wu * DV + dv[None, :], mask=live[:, None] & mv[None, :], other=0.0)
            delta = u - tl.dot(w, h, input_precision=PRECISION)  # [BT, BV]
        else:  # (I + A) delta = beta * (v - gamma * K h)
            kh = tl.dot(k, h, input_precision=PRECISION)  # [BT, BV]
            delta = _substitute(_chunk_a(k, beta, decay, t, PRECISION), beta[:, None] * (v - gamma[:, None] * kh), t, BT)
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        o = gamma[:, None] * tl.dot(q, h, input_precision=PRECISION) \
            + tl.dot(qk * decay, delta, input_precision=PRECISION)  # [BT, BV]
        tl.store(o_ptr + r[:, None] * o_stride + hv * DV + dv[None, :], o.to(o_ptr.dtype.element_ty),
                 mask=live[:, None] & mv[None, :])
        if CKPT:  # the checkpoints inside this chunk
            c, nxt = write_chunk_checkpoints(h, k, delta, G, decay, t, c0, n, c, c_end, nxt, ck_pos_ptr, ck_slot_ptr,
                                             pool_ptr, HV * DK * DV, inner, mask, BT, PRECISION)
        h = chunk_state_at(h, k, delta, G, decay, BT - 1, t, PRECISION)  # the masked tail changes nothing
    tl.store(ptr, h, mask=mask)


def gated_delta_chunks_fused(qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor,
                             dt_bias: torch.Tensor, states: torch.Tensor, rows: torch.Tensor, starts: torch.Tensor,
                             cu_seqlens: torch.Tensor, out: torch.Tensor, num_k_heads: int, head_k_dim: int,
                             ckpts: SegmentCheckpoints | None = None, longest: int | None = None,
                             beta_scale: float = 1.0) -> None:
    """``gated_delta_decode.gated_delta_segments_fused``'s contract, in chunks (the module docstring):
    segment ``i`` is the packed tokens ``starts[i] ..`` (``cu_seqlens[i+1] - cu_seqlens[i]`` of them)
    of ``qkv [T, 2*Hk*Dk + Hv*Dv]`` (post-conv) and the raw gates ``a, b [T, Hv]``, run from
    ``states[rows[i]]`` (``[B, Hv, Dk, Dv]`` fp32, updated in place), its outputs written into those
    rows of ``out [T, Hv, Dv]``; with ``ckpts``, the states after given tokens written to pool rows;
    ``beta = beta_scale * sigmoid(b)``. ``longest``: a bound on the segments' tokens known on the host (default ``T``), which sizes the
    WY pre-pass's grid (its programs past a segment's end return at once)."""
    num_v_heads, dk, dv = _check_inputs(qkv, a, b, states, num_k_heads, head_k_dim)
    segments = segments_of(rows, starts, cu_seqlens, out, (qkv.shape[0], num_v_heads, dv))
    tokens = qkv.shape[0]
    if tokens == 0:
        return
    bt, bv, warps = CHUNK_TILES
    bk = max(16, triton.next_power_of_2(dk))
    bv = max(16, min(triton.next_power_of_2(dv), bv))
    precision = DOT_PRECISION if qkv.dtype == torch.float32 else HALF_DOT_PRECISION
    wy = WY_PREPASS
    if wy:  # W [T, Hv, Dk] and U [T, Hv, Dv], fp32, at the tokens' packed rows
        w = torch.empty(tokens, num_v_heads, dk, device=qkv.device, dtype=torch.float32)
        u = torch.empty(tokens, num_v_heads, dv, device=qkv.device, dtype=torch.float32)
        chunks = triton.cdiv(tokens if longest is None else min(tokens, longest), bt)
        _gdn_wy_kernel[(segments * chunks, num_v_heads)](
            qkv, qkv.stride(0), a, a.stride(0), b, b.stride(0), A_log, dt_bias, starts, cu_seqlens, w, u, chunks,
            HK=num_k_heads, HV=num_v_heads, DK=dk, DV=dv, BK=bk, BDV=max(16, triton.next_power_of_2(dv)), BT=bt,
            PRECISION=precision, BETA_SCALE=_beta(beta_scale), num_warps=WY_WARPS, **pdl.launch(qkv))
    else:
        w = u = out  # placeholders: WY=False reads neither
    _gdn_chunks_kernel[(segments * num_v_heads, triton.cdiv(dv, bv))](
        qkv, qkv.stride(0), a, a.stride(0), b, b.stride(0), A_log, dt_bias, states, rows, starts, cu_seqlens, out,
        out.stride(0), dk**-0.5, *segment_checkpoint_args(ckpts, states, rows, segments), w, u, HK=num_k_heads,
        HV=num_v_heads, DK=dk, DV=dv, BK=bk, BV=bv, BT=bt, CKPT=ckpts is not None, WY=wy, PRECISION=precision,
        BETA_SCALE=_beta(beta_scale), num_warps=warps, **pdl.launch(qkv))


def segment_kernel(qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                   num_k_heads: int, head_k_dim: int, beta_scale: float = 1.0) -> SegmentKernel:
    """The layer's own kernel for an extend's segments (``fla_chunk.scan_in_rounds``: its single pass
    and its short rounds), on its post-conv ``qkv [T, ...]`` and raw gates ``a, b [T, Hv]``: this
    module's chunks when the longest segment has at least ``CHUNKED_MIN_LEN`` tokens, else the
    recurrence token by token (``gated_delta_decode.gated_delta_segments_fused``)."""
    def run(states, rows, starts, cu_seqlens, out, ckpts=None, *, longest: int) -> None:
        kernel = functools.partial(gated_delta_chunks_fused, longest=longest) if longest >= CHUNKED_MIN_LEN \
            else gated_delta_segments_fused
        kernel(qkv, a, b, A_log, dt_bias, states, rows, starts, cu_seqlens, out, num_k_heads, head_k_dim, ckpts,
               beta_scale=beta_scale)
    return run
