"""LoRA adapters' update of a projection, each row by its own adapter slot: punica's shrink and expand.

A projection serving adapters holds ``S`` slots (``hyla/model/lora.py``, ``LinearLoRA``): ``A^T`` as
``at [in, S W]`` and ``B^T`` as ``bt [S W, out]``, slot ``k`` in columns (rows of ``bt``) ``[(k - 1) W,
(k - 1) W + r_k)``, ``r_k`` its adapter's rank there (``ranks [S + 1]`` int32 on the device, ``ranks[0] = 0``:
the base model). A CUDA graph's step (``LoRABatch.static``) mixes slots row by row. Its PyTorch form, the
CPU path and the oracle (``LinearLoRA.add_``), runs two GEMMs over every slot and zeroes each row's other
slots' columns between them: it reads every slot's weights, ``S W (in + out)`` elements per projection,
whichever adapters the step applies. Here, as in punica's SGMV kernels (vLLM's and SGLang's LoRA), each
row reads its own slot's first ``r_k`` columns only, and a row of the base model reads nothing:

* :func:`shrink` — ``xa [T, W] = x [T, in] @ A_k^T`` per row (fp32; zeros past ``r_k``): one program per
  row and ``BLOCK_W`` columns, looping over ``in``;
* :func:`expand_` — ``y [T, out] += xa @ B_k^T`` per row, in place: one program per row and ``BLOCK_N``
  outputs, looping over the rank.

Both are GEMVs on the CUDA cores (no ``tl.dot``): at a decode step's few rows the weights' traffic is the
cost. An extend of one sequence (every row one slot, up to ``cuda_graph_max_extend_tokens`` rows) reads its
slot once per row, from L2. The sums run in fp32 in another order than the GEMMs': within rounding of
``LinearLoRA.add_``, in the model's dtype once, as ``addmm_`` rounds.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hyla.model.ops.gpu import pdl

BLOCK_K = 64  # the input dim per step of a shrink program's loop
BLOCK_W = 32  # rank columns per shrink program
BLOCK_N = 128  # outputs per expand program
BLOCK_J = 16  # rank columns per step of an expand program's loop


@triton.jit
def _row_slot(slot_ptr, slot_stride, rank_ptr, W: tl.constexpr):
    """This program's row, its adapter's rank in this projection (0 for the base model's slot 0: every load
    masked off) and the first column of its slot (``LinearLoRA``'s layout: slot ``k`` at ``(k - 1) W``)."""
    row = tl.program_id(0)
    slot = tl.load(slot_ptr + row * slot_stride)
    return row, tl.load(rank_ptr + slot), (tl.maximum(slot, 1) - 1) * W


@triton.jit(do_not_specialize=["T"])
def _shrink_kernel(x_ptr, at_ptr, slot_ptr, slot_stride, rank_ptr, xa_ptr, T, K, x_stride, at_stride,
                   W: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_W: tl.constexpr, PDL: tl.constexpr):
    pdl.wait(PDL)  # (pdl.py)
    row, rank, first = _row_slot(slot_ptr, slot_stride, rank_ptr, W)
    cols = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    live = cols < rank
    acc = tl.zeros([BLOCK_W], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        kin = ks < K
        x = tl.load(x_ptr + row.to(tl.int64) * x_stride + ks, mask=kin, other=0.0).to(tl.float32)
        a = tl.load(at_ptr + ks[:, None].to(tl.int64) * at_stride + first + cols[None, :],
                    mask=kin[:, None] & live[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(x[:, None] * a, axis=0)
    tl.store(xa_ptr + row.to(tl.int64) * W + cols, acc, mask=cols < W)


@triton.jit(do_not_specialize=["T"])
def _expand_kernel(xa_ptr, bt_ptr, slot_ptr, slot_stride, rank_ptr, y_ptr, T, N, y_stride, bt_stride,
                   W: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_J: tl.constexpr, PDL: tl.constexpr):
    pdl.wait(PDL)  # (pdl.py)
    row, rank, first = _row_slot(slot_ptr, slot_stride, rank_ptr, W)
    ns = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nin = ns < N
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for j0 in range(0, W, BLOCK_J):  # (a loop of W / BLOCK_J steps: rows past the rank are masked off)
        js = j0 + tl.arange(0, BLOCK_J)
        live = js < rank
        xa = tl.load(xa_ptr + row.to(tl.int64) * W + js, mask=live, other=0.0)
        b = tl.load(bt_ptr + (first + js)[:, None].to(tl.int64) * bt_stride + ns[None, :],
                    mask=live[:, None] & nin[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(xa[:, None] * b, axis=0)
    out = y_ptr + row.to(tl.int64) * y_stride + ns
    y = tl.load(out, mask=nin, other=0.0)  # (a row of the base model: acc is 0, y stored as it was)
    tl.store(out, (y.to(tl.float32) + acc).to(y_ptr.dtype.element_ty), mask=nin)


def shrink(x: torch.Tensor, at: torch.Tensor, row_slot: torch.Tensor, ranks: torch.Tensor, width: int) -> torch.Tensor:
    """``x [T, in]``, ``at [in, S width]`` (contiguous), ``row_slot [T]`` (each row's slot, 0: none; any stride, an
    expanded one included), ``ranks [S + 1]`` int32 -> ``xa [T, width]`` fp32: each row's ``x @ A_k^T`` over its
    slot's first ``ranks[k]`` columns, zeros past them (and for slot 0)."""
    if x.stride(1) != 1:
        x = x.contiguous()
    t, k = x.shape
    xa = torch.empty(t, width, dtype=torch.float32, device=x.device)
    if t:
        _shrink_kernel[(t, triton.cdiv(width, BLOCK_W))](
            x, at, row_slot, row_slot.stride(0), ranks, xa, t, k, x.stride(0), at.stride(0), W=width,
            BLOCK_K=BLOCK_K, BLOCK_W=BLOCK_W, num_warps=4, **pdl.launch(x))
    return xa


def expand_(y: torch.Tensor, xa: torch.Tensor, bt: torch.Tensor, row_slot: torch.Tensor, ranks: torch.Tensor,
            width: int) -> torch.Tensor:
    """``y [T, out] += xa [T, width] @ B_k^T`` per row (``bt [S width, out]`` contiguous; :func:`shrink`'s ``xa``),
    in place (``y`` with unit stride along ``out``); rows of slot 0 untouched. Returns ``y``."""
    t, n = y.shape
    if t:
        _expand_kernel[(t, triton.cdiv(n, BLOCK_N))](
            xa, bt, row_slot, row_slot.stride(0), ranks, y, t, n, y.stride(0), bt.stride(0), W=width,
            BLOCK_N=BLOCK_N, BLOCK_J=BLOCK_J, num_warps=4, **pdl.launch(y))
    return y
