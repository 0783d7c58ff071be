"""One Kimi Delta Attention decode step as one Triton kernel: the gates, q/k l2norm and the in-place
update of the fp32 state pool, with a state-slot index (Kimi-Linear's KDA layers on a GPU).

Reference: the layer's gating (``KimiDeltaAttention.forward``) followed by
:func:`hyla.model.ops.kda.recurrent_kda_update`. Gated DeltaNet's kernel
(``gated_delta_decode``) with the decay moved inside the key dimension: per sequence ``i`` and head
``h`` (Kimi-Linear has as many key heads as value heads), with ``S = ssm_states[slots[i], h]
[Dk, Dv]``::

    beta = sigmoid(b)  (rounded to b's dtype, as the layer computes it)
    g    = -exp(A_log[h]) * softplus(f + dt_bias)   [Dk]: one log-decay per key channel
         (ops.kda.DecayGate: with a lower bound lb < 0, Ling 3's lb * sigmoid(exp(A_log[h]) * (f + dt_bias));
         rounded to f's dtype for Ling 3)
    q    = l2norm(q) * Dk**-0.5,   k = l2norm(k),   e = exp(g)
    delta = beta * (v - (e k)^T S);   o = (e q)^T S + (q . k) delta;   S <- diag(e) S + k delta^T

Each program owns one ``(sequence, head, block of Dv columns)`` of the state. ``slots[i] == -1``:
zero state, no write, don't-care output. ``chain [W+1, S]`` (a speculative verify step): ``S``
sequences of ``W`` tokens (row ``i*W + j``) in one launch, the state kept in registers from token
to token and written after token ``j`` at ``chain[j+1, i]`` (``-1``: not written); ``chain[0, i]``
is read. The conv before it runs in the same kernel (:func:`kda_conv_decode_fused`, Gated DeltaNet's
``FUSE_CONV`` form: each program convolves its head's q and k channels and its block's v channels,
the head's last program to finish writes the q/k windows), or in ``conv1d_decode``'s kernel.

:func:`kda_segments_fused` runs an extend's segments through the same recurrence (``_kda_step``),
each program looping over its segment's tokens, checkpoints written on the way: a fused extend's one
sequence (the cached TTFT's graphs), and the short rounds of a GPU prefill, where fla's
``fused_recurrent_kda`` costs ~0.4 ms of host time a call (``fla_chunk.scan_in_rounds``); longer
rounds run fla's ``chunk_kda``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hyla.model.ops.gpu import chain_of, conv_kernel_size, pdl, segments_of
from hyla.model.ops.gpu.gated_delta_decode import (
    CONV_WIDTH,
    _chain_state,
    _conv4,
    _conv_weights,
    _gdn_gates,
    _last_writes_qk_windows,
    _store_chain_state,
    _store_window,
    _window,
)
from hyla.model.ops.gpu.segment_checkpoints import (
    INDEX_ARGS,
    SegmentCheckpoints,
    first_checkpoint,
    open_segment,
    segment_checkpoint_args,
    write_checkpoint,
)
from hyla.model.ops.kda import DecayGate

# (value columns of the state per program, warps): a program runs the recurrence on a [Dk, BV] block.
# Read at each launch; as Gated DeltaNet's decode (gated_delta_decode.DECODE_TILES, timed on an H100
# for 128x128 heads, Kimi-Linear's size). Not yet timed for KDA on a GPU.
DECODE_TILES = (32, 4)
FUSE_CONV = True  # the decode step's conv in the recurrence's kernel (kda_conv_decode_fused); read each step
SEGMENT_TILES = (16, 1)  # the segments kernel's: as gated_delta_decode.SEGMENT_TILES (a chain of one
# token's reductions, which one warp runs without barriers)


@triton.jit
def _kda_step(S, q, k, v, f, b, neg_a, dt_bias, scale, LOWER_BOUND: tl.constexpr, ROUND_DECAY: tl.constexpr):
    """One token on a ``[BK, BV]`` block of a head's fp32 state, from its loaded inputs: ``q, k [BK]``,
    ``v [BV]``, the raw decay input ``f [BK]`` and gate ``b``; ``neg_a = -exp(A_log[h])``, ``dt_bias
    [BK]`` fp32; ``LOWER_BOUND``, ``ROUND_DECAY``: the layer's ``DecayGate``. Returns ``(S, o [BV])``."""
    q = q.to(tl.float32)
    k = k.to(tl.float32)
    v = v.to(tl.float32)
    q = q * (tl.rsqrt(tl.sum(q * q, axis=0) + 1e-6) * scale)
    k = k * tl.rsqrt(tl.sum(k * k, axis=0) + 1e-6)
    if LOWER_BOUND < 0:  # Ling 3's bounded decay
        g = LOWER_BOUND * tl.sigmoid(-neg_a * (f.to(tl.float32) + dt_bias))
        beta = tl.sigmoid(b.to(tl.float32)).to(b.dtype).to(tl.float32)
    else:  # g [BK]: Gated DeltaNet's gate, per channel (Ling 3's softplus: F.softplus's log1p)
        g, beta = _gdn_gates(f, b, neg_a, dt_bias, ROUND_DECAY)
    if ROUND_DECAY:  # Ling 3: transformers' gate returns the decay in the model dtype
        g = g.to(f.dtype).to(tl.float32)
    e = tl.exp(g)
    kS = tl.sum((k * e)[:, None] * S, axis=0)  # [BV]: k^T diag(e) S
    qS = tl.sum((q * e)[:, None] * S, axis=0)
    delta = (v - kS) * beta
    o = qS + tl.sum(q * k, axis=0) * delta
    S = e[:, None] * S + k[:, None] * delta[None, :]
    return S, o


@triton.jit
def _kda_program(a_log_ptr, dt_bias_ptr, H: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr,
                 BV: tl.constexpr):
    """A program's share: sequence (a decode step's, a segment) ``i``, head ``h``, the state's rows
    ``dk`` and its block of value columns ``dv`` (and their masks), ``-exp(A_log[h])`` and the head's
    dt bias ``[BK]``, fp32."""
    pid = tl.program_id(0)
    i = pid // H
    h = pid % H
    dk = tl.arange(0, BK)
    mk = dk < DK
    dv = tl.program_id(1) * BV + tl.arange(0, BV)
    neg_a = -tl.exp(tl.load(a_log_ptr + h).to(tl.float32))
    dt_bias = tl.load(dt_bias_ptr + h * DK + dk, mask=mk, other=0.0).to(tl.float32)
    return i, h, dk, mk, dv, dv < DV, neg_a, dt_bias


@triton.jit
def _kda_load(row, f_row, b_ptr, h, dk, mk, dv, mv, H: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr):
    """A token's inputs as stored: ``q, k [BK]``, ``v [BV]`` from its ``[q | k | v]`` row, ``f [BK]``
    from its decay-input row, the gate ``b`` at ``b_ptr``."""
    q = tl.load(row + h * DK + dk, mask=mk, other=0.0)
    k = tl.load(row + H * DK + h * DK + dk, mask=mk, other=0.0)
    v = tl.load(row + 2 * H * DK + h * DV + dv, mask=mv, other=0.0)
    return q, k, v, tl.load(f_row + h * DK + dk, mask=mk, other=0.0), tl.load(b_ptr)


@triton.jit(do_not_specialize=["chain_stride"], do_not_specialize_on_alignment=["chain_ptr"])
def _kda_decode_kernel(qkv_ptr, qkv_stride, f_ptr, f_stride, b_ptr, b_stride, a_log_ptr, dt_bias_ptr,
                       state_ptr, chain_ptr, chain_stride, o_ptr, scale,
                       W: tl.constexpr, H: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                       BK: tl.constexpr, BV: tl.constexpr, LOWER_BOUND: tl.constexpr, ROUND_DECAY: tl.constexpr,
                       PDL: tl.constexpr):
    pdl.wait(PDL)  # (pdl.py)
    i, h, dk, mk, dv, mv, neg_a, dt_bias = _kda_program(a_log_ptr, dt_bias_ptr, H, DK, DV, BK, BV)
    offs = h * (DK * DV) + dk[:, None] * DV + dv[None, :]
    S = _chain_state(state_ptr, tl.load(chain_ptr + i).to(tl.int64), offs, mk, mv, H, DK, DV, BK, BV)  # fp32
    for j in tl.static_range(W):  # the sequence's tokens in order (a decode step: one)
        r = i * W + j
        q, k, v, f, b = _kda_load(qkv_ptr + r * qkv_stride, f_ptr + r * f_stride, b_ptr + r * b_stride + h, h, dk,
                                  mk, dv, mv, H, DK, DV)
        S, o = _kda_step(S, q, k, v, f, b, neg_a, dt_bias, scale, LOWER_BOUND, ROUND_DECAY)
        dst = tl.load(chain_ptr + (j + 1) * chain_stride + i).to(tl.int64)
        _store_chain_state(state_ptr, dst, S, offs, mk, mv, H, DK, DV, BK, BV)
        tl.store(o_ptr + (r * H + h) * DV + dv, o.to(o_ptr.dtype.element_ty), mask=mv)


@triton.jit(do_not_specialize=["chain_stride"], do_not_specialize_on_alignment=["chain_ptr"])
def _kda_conv_decode_kernel(x_ptr, x_stride, f_ptr, f_stride, b_ptr, b_stride, a_log_ptr, dt_bias_ptr,
                            cw_ptr, conv_ptr, ticket_ptr, state_ptr, chain_ptr, chain_stride, o_ptr, scale,
                            W: tl.constexpr, H: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                            BK: tl.constexpr, BV: tl.constexpr, GROUP: tl.constexpr, LOWER_BOUND: tl.constexpr,
                            ROUND_DECAY: tl.constexpr, PDL: tl.constexpr):
    # gated_delta_decode._gdn_conv_decode_kernel's conv, with one key head per head
    i, h, dk, mk, dv, mv, neg_a, dt_bias = _kda_program(a_log_ptr, dt_bias_ptr, H, DK, DV, BK, BV)
    C = 2 * H * DK + H * DV  # the conv's channels: [q | k | v]
    cq = h * DK + dk
    ck = H * DK + cq
    cv = 2 * H * DK + h * DV + dv
    cdt = conv_ptr.dtype.element_ty
    wq0, wq1, wq2, wq3 = _conv_weights(cw_ptr, cq, mk)
    wk0, wk1, wk2, wk3 = _conv_weights(cw_ptr, ck, mk)
    wv0, wv1, wv2, wv3 = _conv_weights(cw_ptr, cv, mv)
    pdl.wait(PDL)  # the parameters loaded: now the inputs, the windows and the state (pdl.py)

    slot = tl.load(chain_ptr + i).to(tl.int64)
    offs = h * (DK * DV) + dk[:, None] * DV + dv[None, :]
    S = _chain_state(state_ptr, slot, offs, mk, mv, H, DK, DV, BK, BV)  # [BK, BV] fp32
    lq = mk & ((tl.zeros([BK], dtype=tl.int64) + slot) >= 0)
    lv = mv & ((tl.zeros([BV], dtype=tl.int64) + slot) >= 0)
    win = conv_ptr + slot * (C * 3)
    q0, q1, q2 = _window(win, cq, lq)
    k0, k1, k2 = _window(win, ck, lq)
    v0, v1, v2 = _window(win, cv, lv)
    iq0, iq1, iq2, ik0, ik1, ik2 = q0, q1, q2, k0, k1, k2  # for the q/k windows' writer, at the end
    ydt = x_ptr.dtype.element_ty  # the conv's output dtype (the projection's), as conv1d_decode's
    for j in tl.static_range(W):  # the sequence's tokens in order (a decode step: one)
        r = i * W + j
        row = x_ptr + r * x_stride
        xq = tl.load(row + cq, mask=mk, other=0.0).to(cdt)
        xk = tl.load(row + ck, mask=mk, other=0.0).to(cdt)
        xv = tl.load(row + cv, mask=mv, other=0.0).to(cdt)
        q = _conv4(q0, q1, q2, xq, wq0, wq1, wq2, wq3, ydt)
        k = _conv4(k0, k1, k2, xk, wk0, wk1, wk2, wk3, ydt)
        v = _conv4(v0, v1, v2, xv, wv0, wv1, wv2, wv3, ydt)
        q0, q1, q2, k0, k1, k2, v0, v1, v2 = q1, q2, xq, k1, k2, xk, v1, v2, xv
        f = tl.load(f_ptr + r * f_stride + h * DK + dk, mask=mk, other=0.0)
        S, o = _kda_step(S, q, k, v, f, tl.load(b_ptr + r * b_stride + h), neg_a, dt_bias, scale, LOWER_BOUND,
                         ROUND_DECAY)
        dst = tl.load(chain_ptr + (j + 1) * chain_stride + i).to(tl.int64)
        _store_chain_state(state_ptr, dst, S, offs, mk, mv, H, DK, DV, BK, BV)
        tl.store(o_ptr + (r * H + h) * DV + dv, o.to(o_ptr.dtype.element_ty), mask=mv)
        _store_window(conv_ptr + dst * (C * 3), cv, v0, v1, v2, mv & ((tl.zeros([BV], dtype=tl.int64) + dst) >= 0))
    _last_writes_qk_windows(x_ptr, x_stride, conv_ptr, C, cq, ck, mk, iq0, iq1, iq2, ik0, ik1, ik2, chain_ptr,
                            chain_stride, ticket_ptr + i * H + h, i, W, GROUP, BK)


@triton.jit(do_not_specialize_on_alignment=INDEX_ARGS)
def _kda_segments_kernel(qkv_ptr, qkv_stride, f_ptr, f_stride, b_ptr, b_stride, a_log_ptr, dt_bias_ptr,
                         state_ptr, rows_ptr, starts_ptr, cu_ptr, o_ptr, o_stride, scale,
                         pool_ptr, ck_off_ptr, ck_pos_ptr, ck_slot_ptr,
                         H: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                         CKPT: tl.constexpr, LOWER_BOUND: tl.constexpr, ROUND_DECAY: tl.constexpr, PDL: tl.constexpr):
    pdl.wait(PDL)  # (pdl.py)
    # segment i: packed tokens starts[i] .. + (cu[i+1] - cu[i]), from state row rows[i]
    i, h, dk, mk, dv, mv, neg_a, dt_bias = _kda_program(a_log_ptr, dt_bias_ptr, H, DK, DV, BK, BV)
    inner = h * (DK * DV) + dk[:, None] * DV + dv[None, :]
    mask = mk[:, None] & mv[None, :]
    start, n, ptr, S = open_segment(state_ptr, rows_ptr, starts_ptr, cu_ptr, i, H * DK * DV, inner, mask)  # fp32
    if CKPT:  # the segment's checkpoints c .. c_end, the next one after nxt tokens (0: none left)
        c, c_end, nxt = first_checkpoint(ck_off_ptr, ck_pos_ptr, i)
    # the tokens in order, each one's inputs loaded a token ahead (the row ahead clamped to the last)
    last = tl.maximum(start + n - 1, 0)
    first = tl.minimum(start, last)
    nq, nk, nv, nf, nb = _kda_load(qkv_ptr + first * qkv_stride, f_ptr + first * f_stride,
                                   b_ptr + first * b_stride + h, h, dk, mk, dv, mv, H, DK, DV)
    for j in range(n):
        r = start + j
        q, k, v, f, b = nq, nk, nv, nf, nb
        ahead = tl.minimum(r + 1, last)
        nq, nk, nv, nf, nb = _kda_load(qkv_ptr + ahead * qkv_stride, f_ptr + ahead * f_stride,
                                       b_ptr + ahead * b_stride + h, h, dk, mk, dv, mv, H, DK, DV)
        S, o = _kda_step(S, q, k, v, f, b, neg_a, dt_bias, scale, LOWER_BOUND, ROUND_DECAY)
        tl.store(o_ptr + r * o_stride + h * DV + dv, o.to(o_ptr.dtype.element_ty), mask=mv)
        if CKPT:
            c, nxt = write_checkpoint(S, j, c, c_end, nxt, ck_pos_ptr, ck_slot_ptr, pool_ptr, H * DK * DV, inner, mask)
    tl.store(ptr, S, mask=mask)


def _check_inputs(qkv: torch.Tensor, f: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor,
                  states: torch.Tensor) -> tuple[int, int, int]:
    """The kernels' shared checks: ``qkv [R, H*(2*Dk + Dv)]``, ``f [R, H*Dk]``, ``b [R, H]`` (unit column
    stride, rows may be strided), ``a_log [H]``, ``dt_bias [H*Dk]`` against ``states [S, H, Dk, Dv]``
    fp32 contiguous. Returns ``(H, Dk, Dv)``."""
    rows = qkv.shape[0]
    if states.dim() != 4 or states.dtype != torch.float32 or not states.is_contiguous():
        raise ValueError(f"ssm_states must be a contiguous fp32 [S, H, Dk, Dv] tensor, got {list(states.shape)}")
    heads, dk, dv = states.shape[1:]
    if qkv.shape != (rows, heads * (2 * dk + dv)) or f.shape != (rows, heads * dk) or b.shape != (rows, heads):
        raise ValueError(f"qkv [R, {heads * (2 * dk + dv)}], f [R, {heads * dk}] and b [R, {heads}] must fit "
                         f"ssm_states {list(states.shape)}")
    if a_log.shape != (heads,) or dt_bias.shape != (heads * dk,):
        raise ValueError(f"a_log must be [{heads}] and dt_bias [{heads * dk}]")
    if any(t.stride(1) != 1 for t in (qkv, f, b)):
        raise ValueError("qkv, f and b need unit column stride")
    return heads, dk, dv


def kda_decode_fused(qkv: torch.Tensor, f: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor,
                     dt_bias: torch.Tensor, ssm_states: torch.Tensor, slots: torch.Tensor,
                     chain: torch.Tensor | None = None, gate: DecayGate = DecayGate()) -> torch.Tensor:
    """``qkv [B, 3*H*D]`` (the conv's output, ``[q | k | v]`` with heads contiguous; rows may be
    strided), the raw decay input ``f [B, H*Dk]`` (``f_b(f_a(x))`` or ``f_proj(x)``) and gate ``b [B, H]``
    (``b_proj(x)``), ``a_log [H]`` and ``dt_bias [H*Dk]``, the layer's decay ``gate`` (``ops.kda.DecayGate``);
    ``ssm_states [S, H, Dk, Dv]`` fp32 updated in place at ``slots [B]`` (or along ``chain [W+1, B/W]``:
    the module docstring) -> ``o [B, H, Dv]`` in qkv's dtype."""
    rows = qkv.shape[0]
    heads, dk, dv = _check_inputs(qkv, f, b, a_log, dt_bias, ssm_states)
    w, chain, seqs = chain_of(chain, slots, rows)
    o = torch.empty(rows, heads, dv, dtype=qkv.dtype, device=qkv.device)
    bv, warps = min(triton.next_power_of_2(dv), DECODE_TILES[0]), DECODE_TILES[1]
    _kda_decode_kernel[(seqs * heads, triton.cdiv(dv, bv))](
        qkv, qkv.stride(0), f, f.stride(0), b, b.stride(0), a_log, dt_bias, ssm_states, chain, chain.stride(0), o,
        dk**-0.5, W=w, H=heads, DK=dk, DV=dv, BK=triton.next_power_of_2(dk), BV=bv, **_gate_constants(gate),
        num_warps=warps, **pdl.launch(qkv))
    return o


def kda_conv_decode_fused(x: torch.Tensor, conv_weight: torch.Tensor, conv_states: torch.Tensor,
                          tickets: torch.Tensor, f: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor,
                          dt_bias: torch.Tensor, ssm_states: torch.Tensor, slots: torch.Tensor,
                          chain: torch.Tensor | None = None, gate: DecayGate = DecayGate()) -> torch.Tensor:
    """:func:`kda_decode_fused` with the conv before it in the same kernel, as
    ``gated_delta_decode.gated_delta_conv_decode_fused`` (its contract: ``x [B, 3*H*D]`` the raw
    projection, ``conv_weight [C, 4]`` without bias, silu, ``conv_states [S, C, 3]`` updated along the
    same slots or chain, ``tickets`` a zeroed int32 ``[>= sequences * H]`` left zeroed, a chain's
    intermediate slots other than ``chain[0]``, the parameters read before PDL's wait). Returns ``o [B,
    H, Dv]``, as the conv kernel followed by :func:`kda_decode_fused`."""
    rows = x.shape[0]
    heads, dk, dv = _check_inputs(x, f, b, a_log, dt_bias, ssm_states)
    if conv_kernel_size(x, conv_weight, None, conv_states, "silu") != CONV_WIDTH:
        raise ValueError(f"the fused conv is {CONV_WIDTH} wide, got {conv_weight.shape[1]}")
    w, chain, seqs = chain_of(chain, slots, rows)
    if tickets.dtype != torch.int32 or tickets.dim() != 1 or tickets.numel() < seqs * heads or tickets.device != x.device:
        raise ValueError(f"tickets must be an int32 [>= {seqs * heads}] on x's device")
    o = torch.empty(rows, heads, dv, dtype=x.dtype, device=x.device)
    bv, warps = min(triton.next_power_of_2(dv), DECODE_TILES[0]), DECODE_TILES[1]
    blocks = triton.cdiv(dv, bv)
    _kda_conv_decode_kernel[(seqs * heads, blocks)](
        x, x.stride(0), f, f.stride(0), b, b.stride(0), a_log, dt_bias, conv_weight, conv_states, tickets, ssm_states,
        chain, chain.stride(0), o, dk**-0.5, W=w, H=heads, DK=dk, DV=dv, BK=triton.next_power_of_2(dk), BV=bv,
        GROUP=blocks, **_gate_constants(gate), num_warps=warps, **pdl.launch(x))
    return o


def kda_segments_fused(qkv: torch.Tensor, f: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor,
                       dt_bias: torch.Tensor, states: torch.Tensor, rows: torch.Tensor, starts: torch.Tensor,
                       cu_seqlens: torch.Tensor, out: torch.Tensor, ckpts: SegmentCheckpoints | None = None,
                       gate: DecayGate = DecayGate()) -> None:
    """An extend's segments through the recurrence, one launch (``gated_delta_segments_fused``'s
    contract): segment ``i`` is the packed tokens ``starts[i] ..`` (``cu_seqlens[i+1] - cu_seqlens[i]``
    of them) of ``qkv``, ``f``, ``b`` (:func:`kda_decode_fused`'s inputs, ``[T, ...]``), run from
    ``states[rows[i]]`` (``[R, H, Dk, Dv]`` fp32, updated in place), its outputs written into those rows
    of ``out [T, H, Dv]``; with ``ckpts``, the states after given tokens written to pool rows on the way."""
    heads, dk, dv = _check_inputs(qkv, f, b, a_log, dt_bias, states)
    segments = segments_of(rows, starts, cu_seqlens, out, (qkv.shape[0], heads, dv))
    if qkv.shape[0] == 0:  # no token: nothing to run (the kernel reads a row ahead)
        return
    bv, warps = min(triton.next_power_of_2(dv), SEGMENT_TILES[0]), SEGMENT_TILES[1]
    _kda_segments_kernel[(segments * heads, triton.cdiv(dv, bv))](
        qkv, qkv.stride(0), f, f.stride(0), b, b.stride(0), a_log, dt_bias, states, rows, starts, cu_seqlens, out,
        out.stride(0), dk**-0.5, *segment_checkpoint_args(ckpts, states, rows, segments), H=heads, DK=dk, DV=dv,
        BK=triton.next_power_of_2(dk), BV=bv, CKPT=ckpts is not None, **_gate_constants(gate),
        num_warps=warps, **pdl.launch(qkv))


def segment_kernel(qkv: torch.Tensor, f: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor,
                   gate: DecayGate = DecayGate()):
    """The layer's own kernel for an extend's segments (``fla_chunk.SegmentKernel``: the fused extend's
    ``run_fused_extend_segments``, ``fla_chunk.scan_in_rounds``' short rounds), on its raw inputs."""
    def run(states, rows, starts, cu_seqlens, out, ckpts=None, *, longest: int) -> None:
        kda_segments_fused(qkv, f, b, a_log, dt_bias, states, rows, starts, cu_seqlens, out, ckpts, gate)
    return run


def _gate_constants(gate: DecayGate) -> dict:
    """The layer's ``DecayGate`` as the kernels' constexprs (``ValueError`` for a bound above 0)."""
    gate.check()
    return dict(LOWER_BOUND=float(gate.lower_bound), ROUND_DECAY=bool(gate.rounded))
