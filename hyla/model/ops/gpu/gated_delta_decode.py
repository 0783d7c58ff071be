"""One Gated DeltaNet decode step as one Triton kernel: gating, q/k l2norm and the in-place update
of the fp32 state pool (SGLang's ``fused_sigmoid_gating_delta_rule_update``, with a state-slot index).

Reference: the layer's gating (``GatedDeltaNet.forward``) followed by
:func:`hyla.model.ops.gated_delta.recurrent_gated_delta_rule_update`. Per sequence ``i`` and value head
``h`` (key head ``h // (Hv/Hk)``), with ``S = ssm_states[slots[i], h]  [Dk, Dv]``::

    beta = sigmoid(b)  (rounded to b's dtype, as the layer computes it)
    g    = -exp(A_log) * softplus(a + dt_bias),  e = exp(g)
    q    = l2norm(q) * Dk**-0.5,   k = l2norm(k)
    delta = beta * (v - e k^T S);   o = e q^T S + (q . k) delta;   S <- e S + k delta^T

Each program owns one ``(sequence, value head, block of Dv columns)`` of the state: it reads its
columns once, updates them in registers and writes them back. ``slots[i] == -1``: zero state, no
write, don't-care output. ``chain [W+1, S]`` (a speculative verify step): ``S`` sequences of ``W``
tokens (row ``i*W + j``) in one launch, the state kept in registers from token to token and
written after token ``j`` at ``chain[j+1, i]`` (``-1``: not written); ``chain[0, i]`` is read.

With ``FUSE_CONV`` (:func:`gated_delta_conv_decode_fused`), the causal conv before it (a kernel
of width 4, ``conv1d_decode``'s math) runs in the same kernel: each program convolves the q and k
channels of its key head and the v channels of its block from the windows of ``chain[0]``, kept in
registers from token to token. It writes its v windows itself (no other program reads them); the
q and k windows, which every program of the key head reads, are written by the last of those
programs to finish (an atomic ticket per sequence and key head, reset by that program), so none is
overwritten before all have read it. One launch a layer fewer at every decode step (18 of ~160 at
batch 1 for the GPU benchmark model), the same numbers as the two kernels.

The same recurrence runs an extend's short segments (:func:`gated_delta_segments_fused`: the
rounds of ``fla_chunk.scan_in_rounds`` of at most ``RECURRENT_MAX_LEN`` tokens), each program
looping over its segment's tokens (a count read on the device), one launch per layer where fla's
fused recurrent kernel costs ~0.4 ms of host time a call, each token's inputs loaded while the
token before it is computed. Both kernels share the math (:func:`_gdn_step`). Longer segments take
the chunked form (``gated_delta_chunks``), which picks between the two (``segment_kernel``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hyla.model.ops.gpu import chain_of, conv_kernel_size, pdl, segments_of
from hyla.model.ops.gpu.elementwise import softplus
from hyla.model.ops.gpu.segment_checkpoints import (
    INDEX_ARGS,
    SegmentCheckpoints,
    first_checkpoint,
    open_segment,
    segment_checkpoint_args,
    write_checkpoint,
)

# (value columns of the state per program, warps) of the decode and the segments kernels: a program
# runs the recurrence on a [Dk, BV] block. Read at each launch. benchmarks/recurrent_tiles.py on an H100
# (16 heads of 128x128): decode at batch 1 was fastest at 32/4 (4.8 µs; 55.7 vs 61.6 µs at batch 64 with
# 64/2); the segments kernel, a chain of one token's reductions, at 16 columns and 1 warp (162 vs 260 µs
# for 296 tokens: a reduction within one warp needs no barrier).
DECODE_TILES = (32, 4)
SEGMENT_TILES = (16, 1)
FUSE_CONV = True  # the decode step's conv in the recurrence's kernel (gated_delta_conv_decode_fused); read each step
CONV_WIDTH = 4  # the conv kernel width it supports (Qwen3-Next's and Qwen3.5's)


@triton.jit
def _gdn_token(S, row, a_ptr, b_ptr, neg_a, dt_bias, hk, hv, dk, mk, dv, mv, scale,
               HK: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BETA_SCALE: tl.constexpr = 1.0):
    """One token on a ``[BK, BV]`` block of a value head's fp32 state: ``row`` points at its
    ``[q | k | v]`` projection, ``a_ptr`` / ``b_ptr`` at its raw gates. Returns ``(S, o [BV])``."""
    q, k, v, a, b = _gdn_load(row, a_ptr, b_ptr, hk, hv, dk, mk, dv, mv, HK, DK, DV)
    return _gdn_step(S, q, k, v, a, b, neg_a, dt_bias, scale, BETA_SCALE)


@triton.jit
def _gdn_load(row, a_ptr, b_ptr, hk, hv, dk, mk, dv, mv, HK: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr):
    """:func:`_gdn_token`'s loads: ``(q, k, v, a, b)`` as stored."""
    q = tl.load(row + hk * DK + dk, mask=mk, other=0.0)
    k = tl.load(row + HK * DK + hk * DK + dk, mask=mk, other=0.0)
    v = tl.load(row + 2 * HK * DK + hv * DV + dv, mask=mv, other=0.0)
    return q, k, v, tl.load(a_ptr), tl.load(b_ptr)


@triton.jit
def _gdn_gates(a, b, neg_a, dt_bias, LOG1P: tl.constexpr = True, BETA_SCALE: tl.constexpr = 1.0):
    """The raw gates ``a, b`` (any shape) -> ``(g, beta)`` in fp32: the log-decay ``-exp(A_log) *
    softplus(a + dt_bias)`` and ``sigmoid(b)`` rounded to b's dtype, times ``BETA_SCALE`` (OLMo-Hybrid's
    2: exact in any dtype), as the layer computes it. Shared with the chunked kernel
    (``gated_delta_chunks``) and KDA's (``LOG1P`` False: its softplus in transformers' form,
    ``elementwise.softplus``)."""
    x = a.to(tl.float32) + dt_bias
    g = neg_a * softplus(x, LOG1P)
    return g, tl.sigmoid(b.to(tl.float32)).to(b.dtype).to(tl.float32) * BETA_SCALE


@triton.jit
def _gdn_step(S, q, k, v, a, b, neg_a, dt_bias, scale, BETA_SCALE: tl.constexpr = 1.0):
    """:func:`_gdn_token`'s math on loaded inputs."""
    q = q.to(tl.float32)
    k = k.to(tl.float32)
    v = v.to(tl.float32)
    q = q * (tl.rsqrt(tl.sum(q * q, axis=0) + 1e-6) * scale)
    k = k * tl.rsqrt(tl.sum(k * k, axis=0) + 1e-6)
    g, beta = _gdn_gates(a, b, neg_a, dt_bias, True, BETA_SCALE)
    e = tl.exp(g)
    kS = tl.sum(k[:, None] * S, axis=0)  # [BV]
    qS = tl.sum(q[:, None] * S, axis=0)
    delta = (v - e * kS) * beta
    o = e * qS + tl.sum(q * k, axis=0) * delta
    S = e * S + k[:, None] * delta[None, :]
    return S, o


@triton.jit
def _gdn_program(a_log_ptr, dt_bias_ptr, HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                 BK: tl.constexpr, BV: tl.constexpr):
    """A program's share: sequence (a decode step's, a segment) ``i``, value head ``hv`` of key head
    ``hk``, the state's rows ``dk`` and its block of value columns ``dv`` (and their masks), the
    head's ``-exp(A_log)`` and dt bias."""
    pid = tl.program_id(0)
    i = pid // HV
    hv = pid % HV
    hk = hv // (HV // HK)
    dk = tl.arange(0, BK)
    dv = tl.program_id(1) * BV + tl.arange(0, BV)
    neg_a = -tl.exp(tl.load(a_log_ptr + hv))
    return i, hv, hk, dk, dk < DK, dv, dv < DV, neg_a, tl.load(dt_bias_ptr + hv)


@triton.jit
def _chain_state(state_ptr, slot, offs, mk, mv, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                 BK: tl.constexpr, BV: tl.constexpr):
    """The program's ``[BK, BV]`` block of the state at pool row ``slot`` (``-1``: zeros)."""
    live = mk[:, None] & mv[None, :] & ((tl.zeros([BK, BV], dtype=tl.int64) + slot) >= 0)  # a block mask
    return tl.load(state_ptr + slot * (HV * DK * DV) + offs, mask=live, other=0.0)


@triton.jit
def _store_chain_state(state_ptr, dst, S, offs, mk, mv, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                       BK: tl.constexpr, BV: tl.constexpr):
    """Store the block at pool row ``dst`` (``-1``: no write)."""
    live = mk[:, None] & mv[None, :] & ((tl.zeros([BK, BV], dtype=tl.int64) + dst) >= 0)
    tl.store(state_ptr + dst * (HV * DK * DV) + offs, S, mask=live)


@triton.jit(do_not_specialize=["chain_stride"], do_not_specialize_on_alignment=["chain_ptr"])
def _gdn_decode_kernel(qkv_ptr, qkv_stride, a_ptr, a_stride, b_ptr, b_stride, a_log_ptr, dt_bias_ptr,
                       state_ptr, chain_ptr, chain_stride, o_ptr, scale,
                       W: tl.constexpr, HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                       BK: tl.constexpr, BV: tl.constexpr, BETA_SCALE: tl.constexpr, PDL: tl.constexpr):
    i, hv, hk, dk, mk, dv, mv, neg_a, dt_bias = _gdn_program(a_log_ptr, dt_bias_ptr, HK, HV, DK, DV, BK, BV)
    pdl.wait(PDL)  # the head's weights loaded: now the inputs and the state (pdl.py)
    offs = hv * (DK * DV) + dk[:, None] * DV + dv[None, :]
    S = _chain_state(state_ptr, tl.load(chain_ptr + i).to(tl.int64), offs, mk, mv, HV, DK, DV, BK, BV)  # fp32
    for j in tl.static_range(W):  # the sequence's tokens in order (a decode step: one)
        r = i * W + j
        S, o = _gdn_token(S, qkv_ptr + r * qkv_stride, a_ptr + r * a_stride + hv, b_ptr + r * b_stride + hv, neg_a,
                          dt_bias, hk, hv, dk, mk, dv, mv, scale, HK, DK, DV, BETA_SCALE)
        dst = tl.load(chain_ptr + (j + 1) * chain_stride + i).to(tl.int64)
        _store_chain_state(state_ptr, dst, S, offs, mk, mv, HV, DK, DV, BK, BV)
        tl.store(o_ptr + (r * HV + hv) * DV + dv, o.to(o_ptr.dtype.element_ty), mask=mv)


@triton.jit
def _conv4(w0, w1, w2, x, c0, c1, c2, c3, y_dtype: tl.constexpr):
    """One token of a width-4 causal conv + silu on a block of channels: the window ``w0, w1, w2``
    (oldest first, the pool's dtype), the new input ``x`` (rounded to it) and the weights
    ``c0..c3``; the sums in fp32 in ``conv1d_decode``'s order. Returns the output in ``y_dtype``."""
    acc = tl.zeros(x.shape, dtype=tl.float32)
    acc += c0 * w0.to(tl.float32)
    acc += c1 * w1.to(tl.float32)
    acc += c2 * w2.to(tl.float32)
    acc += c3 * x.to(tl.float32)
    return (acc * tl.sigmoid(acc)).to(y_dtype)


@triton.jit
def _window(win, c, mask):
    """A block of channels' width-4 conv window ``(w0, w1, w2)``, oldest first, at ``win`` (a pool
    row ``[C, 3]``); masked-out channels read zeros."""
    return tl.load(win + c * 3, mask=mask, other=0.0), tl.load(win + c * 3 + 1, mask=mask, other=0.0), \
        tl.load(win + c * 3 + 2, mask=mask, other=0.0)


@triton.jit
def _store_window(win, c, w0, w1, w2, mask):
    tl.store(win + c * 3, w0, mask=mask)
    tl.store(win + c * 3 + 1, w1, mask=mask)
    tl.store(win + c * 3 + 2, w2, mask=mask)


@triton.jit
def _conv_weights(cw_ptr, c, mask):
    """A block of channels' four conv weights (``[C, 4]`` contiguous), in fp32."""
    return tl.load(cw_ptr + c * 4, mask=mask, other=0.0).to(tl.float32), \
        tl.load(cw_ptr + c * 4 + 1, mask=mask, other=0.0).to(tl.float32), \
        tl.load(cw_ptr + c * 4 + 2, mask=mask, other=0.0).to(tl.float32), \
        tl.load(cw_ptr + c * 4 + 3, mask=mask, other=0.0).to(tl.float32)


@triton.jit(do_not_specialize=["chain_stride"], do_not_specialize_on_alignment=["chain_ptr"])
def _gdn_conv_decode_kernel(x_ptr, x_stride, a_ptr, a_stride, b_ptr, b_stride, a_log_ptr, dt_bias_ptr,
                            cw_ptr, conv_ptr, ticket_ptr, state_ptr, chain_ptr, chain_stride, o_ptr, scale,
                            W: tl.constexpr, HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr,
                            DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, GROUP: tl.constexpr,
                            BETA_SCALE: tl.constexpr, PDL: tl.constexpr):
    i, hv, hk, dk, mk, dv, mv, neg_a, dt_bias = _gdn_program(a_log_ptr, dt_bias_ptr, HK, HV, DK, DV, BK, BV)
    C = 2 * HK * DK + HV * DV  # the conv's channels: [q | k | v]
    cq = hk * DK + dk
    ck = HK * DK + cq
    cv = 2 * HK * DK + hv * DV + dv
    cdt = conv_ptr.dtype.element_ty
    wq0, wq1, wq2, wq3 = _conv_weights(cw_ptr, cq, mk)
    wk0, wk1, wk2, wk3 = _conv_weights(cw_ptr, ck, mk)
    wv0, wv1, wv2, wv3 = _conv_weights(cw_ptr, cv, mv)
    pdl.wait(PDL)  # the weights loaded: now the inputs, the windows and the state (pdl.py)

    slot = tl.load(chain_ptr + i).to(tl.int64)
    offs = hv * (DK * DV) + dk[:, None] * DV + dv[None, :]
    S = _chain_state(state_ptr, slot, offs, mk, mv, HV, DK, DV, BK, BV)  # [BK, BV] fp32
    # the windows at chain[0] ([C, 3] per slot, oldest first), kept in registers from token to token
    lq = mk & ((tl.zeros([BK], dtype=tl.int64) + slot) >= 0)
    lv = mv & ((tl.zeros([BV], dtype=tl.int64) + slot) >= 0)
    win = conv_ptr + slot * (C * 3)
    q0, q1, q2 = _window(win, cq, lq)
    k0, k1, k2 = _window(win, ck, lq)
    v0, v1, v2 = _window(win, cv, lv)
    iq0, iq1, iq2, ik0, ik1, ik2 = q0, q1, q2, k0, k1, k2  # for the q/k windows' writer, at the end
    for j in tl.static_range(W):  # the sequence's tokens in order (a decode step: one)
        r = i * W + j
        row = x_ptr + r * x_stride
        xq = tl.load(row + cq, mask=mk, other=0.0)
        xk = tl.load(row + ck, mask=mk, other=0.0)
        xv = tl.load(row + cv, mask=mv, other=0.0)
        ydt = x_ptr.dtype.element_ty  # the conv's output dtype (the projection's), as conv1d_decode's
        xq, xk, xv = xq.to(cdt), xk.to(cdt), xv.to(cdt)
        q = _conv4(q0, q1, q2, xq, wq0, wq1, wq2, wq3, ydt)
        k = _conv4(k0, k1, k2, xk, wk0, wk1, wk2, wk3, ydt)
        v = _conv4(v0, v1, v2, xv, wv0, wv1, wv2, wv3, ydt)
        q0, q1, q2, k0, k1, k2, v0, v1, v2 = q1, q2, xq, k1, k2, xk, v1, v2, xv
        S, o = _gdn_step(S, q, k, v, tl.load(a_ptr + r * a_stride + hv), tl.load(b_ptr + r * b_stride + hv), neg_a,
                         dt_bias, scale, BETA_SCALE)
        dst = tl.load(chain_ptr + (j + 1) * chain_stride + i).to(tl.int64)
        _store_chain_state(state_ptr, dst, S, offs, mk, mv, HV, DK, DV, BK, BV)
        tl.store(o_ptr + (r * HV + hv) * DV + dv, o.to(o_ptr.dtype.element_ty), mask=mv)
        # this program's v windows: its own
        _store_window(conv_ptr + dst * (C * 3), cv, v0, v1, v2, mv & ((tl.zeros([BV], dtype=tl.int64) + dst) >= 0))
    _last_writes_qk_windows(x_ptr, x_stride, conv_ptr, C, cq, ck, mk, iq0, iq1, iq2, ik0, ik1, ik2, chain_ptr,
                            chain_stride, ticket_ptr + i * HK + hk, i, W, GROUP, BK)


@triton.jit
def _last_writes_qk_windows(x_ptr, x_stride, conv_ptr, C, cq, ck, mk, q0, q1, q2, k0, k1, k2, chain_ptr, chain_stride,
                            ticket, i, W: tl.constexpr, GROUP: tl.constexpr, BK: tl.constexpr):
    """The end of a conv decode kernel's program (this module's, ``kda_decode``'s): the q/k windows of
    its key head (``q0..k2`` as read from ``chain[0]``, which all ``GROUP`` programs of the key head
    read) are written along the chain by the last of them to get here, counted on ``ticket`` (zeroed
    again for the next launch)."""
    tl.debug_barrier()
    if tl.atomic_add(ticket, 1, sem="acq_rel") == GROUP - 1:
        cdt = conv_ptr.dtype.element_ty
        for j in tl.static_range(W):
            row = x_ptr + (i * W + j) * x_stride
            xq = tl.load(row + cq, mask=mk, other=0.0).to(cdt)
            xk = tl.load(row + ck, mask=mk, other=0.0).to(cdt)
            q0, q1, q2, k0, k1, k2 = q1, q2, xq, k1, k2, xk
            dst = tl.load(chain_ptr + (j + 1) * chain_stride + i).to(tl.int64)
            lq_dst = mk & ((tl.zeros([BK], dtype=tl.int64) + dst) >= 0)
            _store_window(conv_ptr + dst * (C * 3), cq, q0, q1, q2, lq_dst)
            _store_window(conv_ptr + dst * (C * 3), ck, k0, k1, k2, lq_dst)
        tl.atomic_xchg(ticket, 0)  # zero for the next launch


@triton.jit(do_not_specialize_on_alignment=INDEX_ARGS)
def _gdn_segments_kernel(qkv_ptr, qkv_stride, a_ptr, a_stride, b_ptr, b_stride, a_log_ptr, dt_bias_ptr,
                         state_ptr, rows_ptr, starts_ptr, cu_ptr, o_ptr, o_stride, scale,
                         pool_ptr, ck_off_ptr, ck_pos_ptr, ck_slot_ptr,
                         HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                         BK: tl.constexpr, BV: tl.constexpr, CKPT: tl.constexpr, BETA_SCALE: tl.constexpr,
                         PDL: tl.constexpr):
    pdl.wait(PDL)  # (pdl.py)
    # segment i: packed tokens starts[i] .. + (cu[i+1] - cu[i]), from state row rows[i]
    i, hv, hk, dk, mk, dv, mv, neg_a, dt_bias = _gdn_program(a_log_ptr, dt_bias_ptr, HK, HV, DK, DV, BK, BV)
    inner = hv * (DK * DV) + dk[:, None] * DV + dv[None, :]
    mask = mk[:, None] & mv[None, :]
    start, n, ptr, S = open_segment(state_ptr, rows_ptr, starts_ptr, cu_ptr, i, HV * DK * DV, inner, mask)  # fp32
    if CKPT:  # the segment's checkpoints c .. c_end, the next one after nxt tokens (0: none left)
        c, c_end, nxt = first_checkpoint(ck_off_ptr, ck_pos_ptr, i)
    # the segment's tokens in order, the state in registers; each token's inputs are loaded one
    # token ahead (the loop carries them), so that their latency hides behind the token before. The
    # row loaded ahead is clamped to the segment's last (an empty segment: the row before it; the
    # wrapper launches nothing for an empty batch)
    last = tl.maximum(start + n - 1, 0)
    first = tl.minimum(start, last)
    nq, nk, nv, na, nb = _gdn_load(qkv_ptr + first * qkv_stride, a_ptr + first * a_stride + hv,
                                   b_ptr + first * b_stride + hv, hk, hv, dk, mk, dv, mv, HK, DK, DV)
    for j in range(n):
        r = start + j
        q, k, v, av, bv = nq, nk, nv, na, nb
        ahead = tl.minimum(r + 1, last)
        nq, nk, nv, na, nb = _gdn_load(qkv_ptr + ahead * qkv_stride, a_ptr + ahead * a_stride + hv,
                                       b_ptr + ahead * b_stride + hv, hk, hv, dk, mk, dv, mv, HK, DK, DV)
        S, o = _gdn_step(S, q, k, v, av, bv, neg_a, dt_bias, scale, BETA_SCALE)
        tl.store(o_ptr + r * o_stride + hv * DV + dv, o.to(o_ptr.dtype.element_ty), mask=mv)
        if CKPT:
            c, nxt = write_checkpoint(S, j, c, c_end, nxt, ck_pos_ptr, ck_slot_ptr, pool_ptr, (HV * DK * DV), inner, mask)
    tl.store(ptr, S, mask=mask)


def _check_inputs(qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, states: torch.Tensor, num_k_heads: int,
                  head_k_dim: int) -> tuple[int, int, int]:
    """The kernels' shared checks: ``qkv [R, 2*Hk*Dk + Hv*Dv]``, ``a, b [R, Hv]`` (unit column
    stride, rows may be strided) against ``states [S, Hv, Dk, Dv]`` fp32 contiguous. Returns
    ``(Hv, Dk, Dv)``."""
    rows = qkv.shape[0]
    num_v_heads, dk, dv = states.shape[1:]
    if dk != head_k_dim or num_v_heads % num_k_heads or states.dtype != torch.float32 or not states.is_contiguous():
        raise ValueError(f"ssm_states must be a contiguous fp32 [S, Hv, {head_k_dim}, Dv] tensor with Hv a multiple "
                         f"of {num_k_heads}, got {list(states.shape)} {states.dtype}")
    if qkv.shape[1] != 2 * num_k_heads * dk + num_v_heads * dv or qkv.stride(1) != 1:
        raise ValueError(f"qkv must be [{rows}, {2 * num_k_heads * dk + num_v_heads * dv}] with unit column stride")
    if a.shape != (rows, num_v_heads) or b.shape != (rows, num_v_heads) or a.stride(1) != 1 or b.stride(1) != 1:
        raise ValueError(f"a and b must be [{rows}, Hv={num_v_heads}] with unit column stride")
    return num_v_heads, dk, dv


def gated_delta_decode_fused(qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor,
                             dt_bias: torch.Tensor, ssm_states: torch.Tensor, slots: torch.Tensor,
                             num_k_heads: int, head_k_dim: int, chain: torch.Tensor | None = None,
                             beta_scale: float = 1.0) -> torch.Tensor:
    """``qkv [B, 2*Hk*Dk + Hv*Dv]`` (post-conv), raw gates ``a, b [B, Hv]`` (rows may be strided;
    ``beta = beta_scale * sigmoid(b)``), ``A_log, dt_bias [Hv]`` fp32, ``ssm_states [S, Hv, Dk, Dv]`` fp32 updated in place at ``slots [B]``
    (or along ``chain [W+1, B/W]``: the module docstring) -> ``o [B, Hv, Dv]`` in qkv's dtype.
    Launched with PDL the kernel reads ``A_log`` and ``dt_bias`` before it waits for the kernel before
    it (``pdl.py``): pass the layer's parameters as it holds them, never a value computed in the step."""
    batch = qkv.shape[0]
    num_v_heads, dk, dv = _check_inputs(qkv, a, b, ssm_states, num_k_heads, head_k_dim)
    w, chain, seqs = chain_of(chain, slots, batch)
    o = torch.empty(batch, num_v_heads, dv, dtype=qkv.dtype, device=qkv.device)
    bk = triton.next_power_of_2(dk)
    bv, warps = min(triton.next_power_of_2(dv), DECODE_TILES[0]), DECODE_TILES[1]
    _gdn_decode_kernel[(seqs * num_v_heads, triton.cdiv(dv, bv))](
        qkv, qkv.stride(0), a, a.stride(0), b, b.stride(0), A_log, dt_bias, ssm_states, chain, chain.stride(0), o,
        dk**-0.5, W=w, HK=num_k_heads, HV=num_v_heads, DK=dk, DV=dv, BK=bk, BV=bv, BETA_SCALE=_beta(beta_scale),
        num_warps=warps, **pdl.launch(qkv))
    return o


def gated_delta_conv_decode_fused(x: torch.Tensor, conv_weight: torch.Tensor, conv_states: torch.Tensor,
                                  tickets: torch.Tensor, a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor,
                                  dt_bias: torch.Tensor, ssm_states: torch.Tensor, slots: torch.Tensor,
                                  num_k_heads: int, head_k_dim: int, chain: torch.Tensor | None = None,
                                  beta_scale: float = 1.0) -> torch.Tensor:
    """:func:`gated_delta_decode_fused` with the conv before it in the same kernel (the module
    docstring): ``x [B, 2*Hk*Dk + Hv*Dv]`` the raw projection (before the conv), ``conv_weight [C,
    4]`` (no bias, silu), ``conv_states [S, C, 3]`` updated in place along the same slots or chain,
    ``tickets`` a zeroed int32 ``[>= sequences * Hk]`` on the device that the kernel leaves zeroed
    (launches sharing it must not overlap: one stream). A chain's intermediate slots
    (``chain[1:W]``) must differ from ``chain[0]`` (as the engine's checkpoint rows do). Returns
    ``o [B, Hv, Dv]``, as the conv kernel followed by :func:`gated_delta_decode_fused`. Launched with
    PDL it reads ``conv_weight``, ``A_log`` and ``dt_bias`` before its wait (``pdl.py``): the layer's
    parameters as it holds them, never a value computed in the step."""
    batch = x.shape[0]
    num_v_heads, dk, dv = _check_inputs(x, a, b, ssm_states, num_k_heads, head_k_dim)
    if conv_kernel_size(x, conv_weight, None, conv_states, "silu") != CONV_WIDTH:
        raise ValueError(f"the fused conv is {CONV_WIDTH} wide, got {conv_weight.shape[1]}")
    w, chain, seqs = chain_of(chain, slots, batch)
    if tickets.dtype != torch.int32 or tickets.dim() != 1 or tickets.numel() < seqs * num_k_heads \
            or tickets.device != x.device:
        raise ValueError(f"tickets must be an int32 [>= {seqs * num_k_heads}] on x's device")
    o = torch.empty(batch, num_v_heads, dv, dtype=x.dtype, device=x.device)
    bk = triton.next_power_of_2(dk)
    bv, warps = min(triton.next_power_of_2(dv), DECODE_TILES[0]), DECODE_TILES[1]
    blocks = triton.cdiv(dv, bv)
    _gdn_conv_decode_kernel[(seqs * num_v_heads, blocks)](
        x, x.stride(0), a, a.stride(0), b, b.stride(0), A_log, dt_bias, conv_weight, conv_states, tickets, ssm_states,
        chain, chain.stride(0), o, dk**-0.5, W=w, HK=num_k_heads, HV=num_v_heads, DK=dk, DV=dv, BK=bk, BV=bv,
        GROUP=(num_v_heads // num_k_heads) * blocks, BETA_SCALE=_beta(beta_scale), num_warps=warps, **pdl.launch(x))
    return o


def gated_delta_segments_fused(qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor,
                               dt_bias: torch.Tensor, states: torch.Tensor, rows: torch.Tensor, starts: torch.Tensor,
                               cu_seqlens: torch.Tensor, out: torch.Tensor, num_k_heads: int, head_k_dim: int,
                               ckpts: SegmentCheckpoints | None = None, beta_scale: float = 1.0) -> None:
    """An extend's segments through the recurrence, one launch: segment ``i`` is the packed tokens
    ``starts[i] ..`` (``cu_seqlens[i+1] - cu_seqlens[i]`` of them) of ``qkv [T, ...]`` (post-conv)
    and the raw gates ``a, b [T, Hv]``, run from ``states[rows[i]]`` (``[B, Hv, Dk, Dv]`` fp32,
    updated in place), its outputs written into those rows of ``out [T, Hv, Dv]``; with ``ckpts``,
    the states after given tokens written to pool rows on the way."""
    num_v_heads, dk, dv = _check_inputs(qkv, a, b, states, num_k_heads, head_k_dim)
    segments = segments_of(rows, starts, cu_seqlens, out, (qkv.shape[0], num_v_heads, dv))
    if qkv.shape[0] == 0:  # no token: nothing to run (the kernel reads a row ahead)
        return
    bk = triton.next_power_of_2(dk)
    bv, warps = min(triton.next_power_of_2(dv), SEGMENT_TILES[0]), SEGMENT_TILES[1]
    _gdn_segments_kernel[(segments * num_v_heads, triton.cdiv(dv, bv))](
        qkv, qkv.stride(0), a, a.stride(0), b, b.stride(0), A_log, dt_bias, states, rows, starts, cu_seqlens, out,
        out.stride(0), dk**-0.5, *segment_checkpoint_args(ckpts, states, rows, segments), HK=num_k_heads,
        HV=num_v_heads, DK=dk, DV=dv, BK=bk, BV=bv, CKPT=ckpts is not None, BETA_SCALE=_beta(beta_scale),
        num_warps=warps, **pdl.launch(qkv))


def _beta(beta_scale: float) -> float:
    """``beta_scale`` as the kernels' constexpr: a float in ``(0, 2]`` (1: ``sigmoid(b)``; OLMo-Hybrid's 2)."""
    if not 0.0 < beta_scale <= 2.0:
        raise ValueError(f"beta_scale must be in (0, 2], got {beta_scale}")
    return float(beta_scale)
