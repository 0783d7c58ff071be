"""The causal depthwise conv1d of an extend step (packed sequences) in Triton, on the conv-state pool.

Reference: :func:`hyla.model.ops.conv1d.causal_conv1d_varlen` (same contract, its chunked path:
no token trees). Token ``t`` at position ``p`` of sequence ``i`` (slot ``s_i``) reads its ``K``
inputs ``p-K+1 .. p``, each a packed token of its own sequence or, before its first new token, a
column of the sequence's window ``conv_states[s_i] [C, K-1]`` (zeros for ``s_i == -1``)::

    y[t, c] = act(sum_k w[c, k] * input_k + bias[c])     (fp32, the taps in order, then the bias)

Where PyTorch lays every window in front of its tokens in a new buffer (a concatenation, a
multiply and an add per tap, casts, gathers: ~16 launches per layer), this is two launches:

* :func:`_conv1d_extend_kernel`: every output, program ``(block of tokens, block of channels)``,
  the window columns read straight from the pool;
* :func:`_conv1d_windows_kernel`: the windows after the checkpoints' positions, into their rows,
  and each sequence's final window into its own row, after the outputs have read the old one. A
  window after ``n`` tokens is the ``K-1`` inputs ending at the ``n``-th, each program loading all
  of them before it stores. A checkpoint within a sequence's first ``K-2`` tokens reads that old
  window too: then the checkpoints' windows get a launch of their own, before the final ones.

The per-step index tensors (each token's sequence, the windows to write) are built on the host
once per step (``VarlenPlan.derive``) and sent in one copy, so the step reads nothing back.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from hyla.cache.transfer import to_device_packed
from hyla.model.ops.gpu import conv_kernel_size, pdl
from hyla.model.ops.varlen import VarlenPlan


@triton.jit(do_not_specialize=["T"])
def _conv1d_extend_kernel(x_ptr, x_stride, w_ptr, b_ptr, state_ptr, state_stride, tok_seq_ptr, starts_ptr, slots_ptr,
                          y_ptr, T, C, K: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
                          BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, PDL: tl.constexpr):
    pdl.wait(PDL)  # (pdl.py)
    # [BT] packed tokens. int64: the output's t * C passes 2**31 elements past ~262K tokens of Qwen3-Next's
    # 8,192 channels (~210K of NemotronH-8B's 10,240)
    t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)  # [BC] channels
    mt = t < T
    mc = c < C
    seq = tl.load(tok_seq_ptr + t, mask=mt, other=0)
    start = tl.load(starts_ptr + seq, mask=mt, other=0).to(tl.int64)  # the sequence's first packed token
    slot = tl.load(slots_ptr + seq, mask=mt, other=-1).to(tl.int64)  # its window's row (-1: zeros)
    pos = t - start  # the token's position among its sequence's new tokens
    acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    for k in tl.static_range(K):
        j = pos - (K - 1) + k  # the input's position: >= 0 a new token, < 0 a window column
        in_x = (j >= 0) & mt
        in_w = (j < 0) & mt & (slot >= 0)
        xv = tl.load(x_ptr + (start + tl.maximum(j, 0))[:, None] * x_stride + c[None, :],
                     mask=in_x[:, None] & mc[None, :], other=0.0)
        col = tl.maximum(j + (K - 1), 0)
        wv = tl.load(state_ptr + tl.maximum(slot, 0)[:, None] * state_stride + c[None, :] * (K - 1) + col[:, None],
                     mask=in_w[:, None] & mc[None, :], other=0.0)
        v = tl.where(in_x[:, None], xv.to(tl.float32), wv.to(x_ptr.dtype.element_ty).to(tl.float32))
        acc += v * tl.load(w_ptr + c * K + k, mask=mc, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + c, mask=mc, other=0.0).to(tl.float32)[None, :]
    if SILU:
        acc = acc * tl.sigmoid(acc)
    tl.store(y_ptr + t[:, None] * C + c[None, :], acc.to(y_ptr.dtype.element_ty), mask=mt[:, None] & mc[None, :])


@triton.jit(do_not_specialize_on_alignment=["win_seq_ptr", "win_len_ptr", "win_dst_ptr"])
def _conv1d_windows_kernel(x_ptr, x_stride, state_ptr, state_stride, win_seq_ptr, win_len_ptr, win_dst_ptr,
                           starts_ptr, slots_ptr, C, K: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_C: tl.constexpr,
                           PDL: tl.constexpr):
    pdl.wait(PDL)  # (pdl.py)
    m = tl.program_id(0)  # the window: sequence win_seq[m] after win_len[m] of its tokens, into row win_dst[m]
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mc = c < C
    w = tl.arange(0, BLOCK_W)
    mw = w < K - 1
    seq = tl.load(win_seq_ptr + m)
    n = tl.load(win_len_ptr + m).to(tl.int64)
    dst = tl.load(win_dst_ptr + m).to(tl.int64)
    start = tl.load(starts_ptr + seq).to(tl.int64)
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    j = n - (K - 1) + w  # [BW] the inputs' positions, oldest first
    in_x = (j >= 0) & mw
    in_w = (j < 0) & mw & ((tl.zeros([BLOCK_W], dtype=tl.int64) + slot) >= 0)  # a block mask (the interpreter
    # rejects a scalar condition broadcast into one)
    xv = tl.load(x_ptr + (start + tl.maximum(j, 0))[None, :] * x_stride + c[:, None],
                 mask=mc[:, None] & in_x[None, :], other=0.0)  # [BC, BW]
    col = tl.maximum(j + (K - 1), 0)
    pv = tl.load(state_ptr + tl.maximum(slot, 0) * state_stride + c[:, None] * (K - 1) + col[None, :],
                 mask=mc[:, None] & in_w[None, :], other=0.0)
    v = tl.where(in_x[None, :], xv.to(state_ptr.dtype.element_ty), pv)
    tl.store(state_ptr + dst * state_stride + c[:, None] * (K - 1) + w[None, :], v, mask=mc[:, None] & mw[None, :])


@dataclass(frozen=True)
class ConvRows:
    """An extend's index tensors on the device (built once per step, shared by its conv layers; a
    captured extend's are views of its static inputs: ``forward_batch.FusedExtend``). A token of
    ``tok_seq`` past its sequence's end (padding) computes a don't-care output row and nothing else."""

    tok_seq: torch.Tensor  # [T] each packed token's sequence
    starts: torch.Tensor  # [B] each sequence's first packed token
    # the windows to write, one launch each, in order: (sequence, tokens it follows, destination row) [W] each
    windows: tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], ...]


def _extend_rows(varlen: VarlenPlan, kernel: int, device: torch.device) -> ConvRows:
    def build() -> ConvRows:
        lengths, ckpts, slots = varlen.lengths, varlen.ckpts, varlen.slots.host
        live = [i for i, s in enumerate(slots) if s >= 0]  # the sequences that write a final window
        ckpt_windows = (list(ckpts.seq), list(ckpts.num_tokens), list(ckpts.slot_list))
        final_windows = (live, [lengths[i] for i in live], [slots[i] for i in live])
        if any(n < kernel - 1 for n in ckpts.num_tokens):  # a checkpoint's window reaches into its sequence's
            # old window, which the final windows replace: the checkpoints' launch first, then the final one
            groups = [ckpt_windows, final_windows]
        else:  # one launch
            groups = [tuple(c + f for c, f in zip(ckpt_windows, final_windows))]
        groups = [g for g in groups if g[0]]
        long = lambda values: torch.tensor(values, dtype=torch.long)  # noqa: E731
        host = [torch.repeat_interleave(torch.arange(len(lengths)), long(lengths)), long(varlen.starts[:-1])]
        parts = to_device_packed(host + [long(column) for g in groups for column in g], device)
        return ConvRows(parts[0], parts[1], tuple(tuple(parts[2 + 3 * i: 5 + 3 * i]) for i in range(len(groups))))

    return varlen.derive(("conv1d_extend", kernel, device), build)


def causal_conv1d_varlen_fused(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                               conv_states: torch.Tensor, varlen: VarlenPlan,
                               activation: str | None = "silu") -> torch.Tensor:
    """``x [T, C]`` (rows may be strided: a split of the projection) -> ``y [T, C]`` (dtype of x):
    the step's sequences ``varlen`` (its slots and checkpoints) start from their windows in
    ``conv_states [S, C, K-1]``; each final window goes back to its row and each checkpoint's
    window to the checkpoint's row, as :func:`~hyla.model.ops.conv1d.causal_conv1d_varlen` does."""
    t = x.shape[0]
    k = conv_kernel_size(x, weight, bias, conv_states, activation)
    if varlen.starts[-1] != t:
        raise ValueError(f"x has {t} tokens, the varlen plan {varlen.starts[-1]}")
    return causal_conv1d_rows_fused(x, weight, bias, conv_states, _extend_rows(varlen, k, x.device),
                                    varlen.slots.index, activation)


def causal_conv1d_rows_fused(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                             conv_states: torch.Tensor, rows: ConvRows, slots: torch.Tensor,
                             activation: str | None = "silu") -> torch.Tensor:
    """:func:`causal_conv1d_varlen_fused` on index tensors already on the device (no host value is
    read: a CUDA graph can capture it): ``rows`` lays out the tokens and the windows to write,
    ``slots [B]`` are the sequences' own rows of ``conv_states`` (their old windows)."""
    t, c = x.shape
    k = conv_kernel_size(x, weight, bias, conv_states, activation)
    if rows.tok_seq.shape != (t,) or slots.shape != rows.starts.shape:
        raise ValueError(f"the conv's rows must lay out {t} tokens and slots its {rows.starts.shape[0]} sequences")
    y = torch.empty(t, c, dtype=x.dtype, device=x.device)
    block_t, block_c = 16, 128
    if t:
        _conv1d_extend_kernel[(triton.cdiv(t, block_t), triton.cdiv(c, block_c))](
            x, x.stride(0), weight, bias if bias is not None else weight, conv_states, conv_states.stride(0),
            rows.tok_seq, rows.starts, slots, y, t, c, K=k, HAS_BIAS=bias is not None, SILU=activation is not None,
            BLOCK_T=block_t, BLOCK_C=block_c, **pdl.launch(x))
    for seq, n, dst in rows.windows:  # after the outputs, which read the old windows
        _conv1d_windows_kernel[(seq.shape[0], triton.cdiv(c, block_c))](
            x, x.stride(0), conv_states, conv_states.stride(0), seq, n, dst, rows.starts, slots, c, K=k,
            BLOCK_W=triton.next_power_of_2(k - 1), BLOCK_C=block_c, **pdl.launch(x))
    return y
