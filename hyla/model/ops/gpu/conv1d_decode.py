"""The causal depthwise conv1d decode step as one Triton kernel, in place on the conv-state pool.

Reference: :func:`hyla.model.ops.conv1d.causal_conv1d_update` (same contract). Per channel ``c``::

    y[c]      = act(bias[c] + sum_k w[c, k] * [window[c, :], x[c]][k])     (fp32 accumulation)
    window[c] = [window[c, 1:], x[c]]                                       (the pool row, in place)

``slots[i] == -1``: the row reads a zero window, writes nothing, and its output is don't-care.

``chain [W+1, S]`` (a speculative verify step: ``ForwardBatch.chain_slots``): the rows are ``S``
sequences of ``W`` tokens (row ``i*W + j``), run in order in one launch: token ``j`` of sequence
``i`` reads its window at ``chain[j, i]`` and writes the shifted one at ``chain[j+1, i]`` (``-1``:
no read / no write). A decode step is the chain ``[slots, slots]`` of one token, in place.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hyla.model.ops.gpu import chain_of, conv_kernel_size, pdl


@triton.jit(do_not_specialize=["chain_stride"], do_not_specialize_on_alignment=["chain_ptr"])
def _conv1d_update_kernel(x_ptr, x_stride, w_ptr, b_ptr, state_ptr, state_stride, chain_ptr, chain_stride, y_ptr, C,
                          W: tl.constexpr, K: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
                          BLOCK_C: tl.constexpr, PDL: tl.constexpr):
    pdl.wait(PDL)  # (pdl.py)
    i = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)  # [BLOCK_C] channels
    mask = c < C
    for j in tl.static_range(W):  # the sequence's tokens in order, each window where the last one left it
        r = i * W + j  # the token's row
        slot = tl.load(chain_ptr + j * chain_stride + i).to(tl.int64)
        dst = tl.load(chain_ptr + (j + 1) * chain_stride + i).to(tl.int64)
        live = mask & ((tl.zeros([BLOCK_C], dtype=tl.int64) + slot) >= 0)  # a block mask (the interpreter
        # rejects a scalar condition broadcast into one)
        live_dst = mask & ((tl.zeros([BLOCK_C], dtype=tl.int64) + dst) >= 0)
        x = tl.load(x_ptr + r * x_stride + c, mask=mask, other=0.0)
        acc = tl.zeros([BLOCK_C], dtype=tl.float32)
        if HAS_BIAS:
            acc += tl.load(b_ptr + c, mask=mask, other=0.0).to(tl.float32)
        row = state_ptr + slot * state_stride + c * (K - 1)  # the window [C, K-1], oldest input first
        out = state_ptr + dst * state_stride + c * (K - 1)
        for k in tl.static_range(K - 1):
            s = tl.load(row + k, mask=live, other=0.0)
            acc += tl.load(w_ptr + c * K + k, mask=mask, other=0.0).to(tl.float32) * s.to(tl.float32)
            if k > 0:
                tl.store(out + (k - 1), s, mask=live_dst)  # shift left (each program owns its channels)
        x_state = x.to(state_ptr.dtype.element_ty)
        acc += tl.load(w_ptr + c * K + (K - 1), mask=mask, other=0.0).to(tl.float32) * x_state.to(tl.float32)
        tl.store(out + (K - 2), x_state, mask=live_dst)
        if SILU:
            acc = acc * tl.sigmoid(acc)
        tl.store(y_ptr + r * C + c, acc.to(y_ptr.dtype.element_ty), mask=mask)
        if j + 1 < W:
            tl.debug_barrier()  # the window just written is the next token's, read by this program's threads


def causal_conv1d_update_fused(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                               conv_states: torch.Tensor, slots: torch.Tensor,
                               activation: str | None = "silu", chain: torch.Tensor | None = None) -> torch.Tensor:
    """``x [B, C]`` (rows may be strided, e.g. a split of a projection) -> ``y [B, C]`` (dtype of x);
    ``conv_states [S, C, K-1]`` updated in place at ``slots [B]`` (int64 on the device, -1 = padding),
    or along ``chain [W+1, B/W]`` (the module docstring; ``slots`` then unused). Shapes are checked
    here on the host; slot values are the batch builder's to validate."""
    b, c = x.shape
    k = conv_kernel_size(x, weight, bias, conv_states, activation)
    w, chain, seqs = chain_of(chain, slots, b)
    y = torch.empty(b, c, dtype=x.dtype, device=x.device)
    block = 256
    _conv1d_update_kernel[(seqs, triton.cdiv(c, block))](
        x, x.stride(0), weight, bias if bias is not None else weight, conv_states, conv_states.stride(0), chain,
        chain.stride(0), y, c, W=w, K=k, HAS_BIAS=bias is not None, SILU=activation is not None, BLOCK_C=block,
        **pdl.launch(x))
    return y

