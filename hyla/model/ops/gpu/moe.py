"""A MoE layer on a GPU with no host read: its experts as grouped GEMMs (decode batches over
``sparse_moe.GATHER_MAX_ASSIGNMENTS`` (token, expert) pairs, extends), and the router and the combine
around them as one kernel each; so CUDA graphs capture MoE steps at any batch size and extend length.

A step of ``T`` tokens routed to ``k`` experts each has ``A = T * k`` pairs. The CPU path
(``sparse_moe.run_experts_sorted``) sorts them by expert and runs one GEMM pair per expert that received
some: each chosen expert's weight is read once, but the groups' sizes are read on the host, so the
step's launches depend on its routing. A small GPU step (``gemv.expert_linear``) reads one expert per
pair, which reads a repeated expert's weight once per pair: at decode batch 32 of a top-8 model with
64 experts, 256 pairs read ~63 experts ~4 times each. Here, as in vLLM's and SGLang's fused MoE
(``moe_align_block_size`` and ``fused_moe_kernel``; written again, small):

1. :func:`plan` groups the pairs by expert on the device (three small kernels: an atomic count per
   expert, the groups' layout, each pair's row) and pads each expert's group to whole blocks of
   ``BLOCK_M`` rows: ``rows [R]``, the pair in each padded row (``A``: a padding row), and
   ``block_expert [R / BLOCK_M]``, each block's expert (``E`` past the last used block). ``R`` is the
   most the padding can take, ``A + min(A, E) * (BLOCK_M - 1)`` rounded up to a block, so every
   shape depends on ``A`` alone. :func:`plan_reference` is the same in PyTorch ops, the oracle.
2. :func:`expert_gemm` runs one program per (block, ``BLOCK_N`` output columns). A program reads its
   block's expert and rows, ends at once past the last used block, and multiplies its rows by its
   expert's weight on the tensor cores, tile by tile along K: each used expert's weight is read once
   per block of its rows (once, unless an expert gets more than ``BLOCK_M`` pairs).

Around them, :func:`softmax_topk` is a softmax router (fp32 softmax, top-k, renormalisation) and
:func:`combine` the layer's output (the experts' weighted sum, the gated shared expert).

The routing is the step's own (the router's top-k), so under PDL every kernel here waits before it
reads anything (``pdl.py``). fp32 inputs multiply in IEEE fp32 (the tests' fp32 models, within 1e-4
of the sorted path); bf16/fp16 on the tensor cores with fp32 sums, rounded once to the output dtype.
FP8 experts (``float8_e4m3fn`` with block scales, ``gemv.scale_args``) have each weight tile
dequantized and rounded to x's dtype before its dot: the same numbers as their dequantized weights.
Not yet timed on a GPU: ``SMALL_TILES`` and ``LARGE_TILES`` are vLLM's defaults for bf16
(``get_default_config``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from hyla.model.ops.gpu import gemv, pdl

# (BLOCK_M, BLOCK_N, BLOCK_K, warps) by the pairs an expert gets on average: few (decode) or many
# (extends). BLOCK_M >= 16 (tl.dot's minimum).
SMALL_TILES = (16, 32, 64, 4)
LARGE_TILES = (64, 64, 32, 4)
LARGE_FROM = 16  # mean pairs per expert from which a step takes LARGE_TILES


class Plan(NamedTuple):
    """A step's pairs grouped by expert and padded to blocks (:func:`plan`): ``rows [R]`` int32 (the
    pair ``t * k + j`` of each padded row, ``pairs`` for padding), ``block_expert [R / block_m]``
    int32 (``num_experts`` past the last used block)."""

    rows: torch.Tensor
    block_expert: torch.Tensor
    pairs: int
    num_experts: int
    tiles: tuple[int, int, int, int]


PLAN_CHUNK = 1024  # pairs (and padded rows) per program of the plan's kernels


def _check_experts(experts: torch.Tensor) -> None:
    if experts.dim() != 2 or experts.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"experts must be [T, k] integer ids, got {list(experts.shape)} {experts.dtype}")


def _tiles(pairs: int, num_experts: int) -> tuple[int, int, int, int]:
    return LARGE_TILES if pairs >= LARGE_FROM * num_experts else SMALL_TILES


def _padded_rows(pairs: int, num_experts: int, block_m: int) -> int:
    """The most rows the padding can take (``R``): each used expert's group rounds up by < a block."""
    return triton.cdiv(pairs + min(pairs, num_experts) * (block_m - 1), block_m) * block_m


@triton.jit(do_not_specialize=["A", "R"])
def _count_kernel(e_ptr, counts_ptr, rank_ptr, rows_ptr, A, R, E, CHUNK: tl.constexpr, PDL: tl.constexpr):
    """Each pair's rank in its expert's group (an atomic count), and the padded rows' sentinel."""
    pdl.wait(PDL)  # the ids are the step's own
    i = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
    tl.store(rows_ptr + i, A, mask=i < R)
    e = tl.load(e_ptr + i, mask=i < A, other=E).to(tl.int32)
    ok = (e >= 0) & (e < E)  # an id out of range (never the router's) gets no row: its pair's output is left unset
    rank = tl.atomic_add(counts_ptr + e, 1, mask=ok)
    tl.store(rank_ptr + i, rank, mask=ok)


@triton.jit(do_not_specialize=["NUM_BLOCKS"])
def _layout_kernel(counts_ptr, starts_ptr, block_expert_ptr, E, NUM_BLOCKS, BLOCK_M: tl.constexpr,
                   BLOCK_E: tl.constexpr, BLOCKS: tl.constexpr, PDL: tl.constexpr):
    """One program: the experts' padded groups (``BLOCK_E`` >= E of them) laid end to end, each
    group's first row, and the expert of every block."""
    pdl.wait(PDL)
    ex = tl.arange(0, BLOCK_E)
    padded = (tl.load(counts_ptr + ex, mask=ex < E, other=0) + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)  # [BLOCK_E] the end of each expert's rows
    tl.store(starts_ptr + ex, ends - padded, mask=ex < E)
    for first in range(0, NUM_BLOCKS, BLOCKS):
        b = first + tl.arange(0, BLOCKS)
        owner = tl.sum(((ends[None, :] <= (b * BLOCK_M)[:, None]) & (ex < E)[None, :]).to(tl.int32), axis=1)
        tl.store(block_expert_ptr + b, owner, mask=b < NUM_BLOCKS)  # E past the last used block


@triton.jit(do_not_specialize=["A"])
def _place_kernel(e_ptr, rank_ptr, starts_ptr, rows_ptr, A, E, CHUNK: tl.constexpr, PDL: tl.constexpr):
    """Each pair into its row: its expert's first row plus its rank."""
    pdl.wait(PDL)
    i = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
    e = tl.load(e_ptr + i, mask=i < A, other=E).to(tl.int32)
    ok = (e >= 0) & (e < E)
    row = tl.load(starts_ptr + e, mask=ok, other=0) + tl.load(rank_ptr + i, mask=ok, other=0)
    tl.store(rows_ptr + row, i, mask=ok)


def plan(experts: torch.Tensor, num_experts: int) -> Plan:
    """``experts [T, k]`` (the router's top-k ids, each < ``num_experts``) -> the step's :class:`Plan`,
    in four launches (a zeroed count per expert, then :func:`_count_kernel`, :func:`_layout_kernel`,
    :func:`_place_kernel`) whose shapes depend on ``T * k`` alone: no host read, a CUDA graph holds
    them. A pair's place in its expert's group follows the order its atomic count came in: the GEMM's
    rows are independent, so the order changes no number. :func:`plan_reference` is the oracle (a
    stable sort in PyTorch ops)."""
    _check_experts(experts)
    flat = experts.flatten()  # [A]
    a, dev = flat.numel(), flat.device
    tiles = _tiles(a, num_experts)
    r = _padded_rows(a, num_experts, tiles[0])
    counts = torch.zeros(num_experts, dtype=torch.int32, device=dev)
    rank, starts = torch.empty(a, dtype=torch.int32, device=dev), torch.empty_like(counts)
    rows = torch.empty(r, dtype=torch.int32, device=dev)
    block_expert = torch.empty(r // tiles[0], dtype=torch.int32, device=dev)
    if a:
        launch = pdl.launch(flat)
        _count_kernel[(triton.cdiv(r, PLAN_CHUNK),)](flat, counts, rank, rows, a, r, num_experts, CHUNK=PLAN_CHUNK,
                                                     **launch)
        block_e = triton.next_power_of_2(num_experts)
        _layout_kernel[(1,)](counts, starts, block_expert, num_experts, block_expert.numel(), BLOCK_M=tiles[0],
                             BLOCK_E=block_e, BLOCKS=max(1, 8192 // block_e), **launch)
        _place_kernel[(triton.cdiv(a, PLAN_CHUNK),)](flat, rank, starts, rows, a, num_experts, CHUNK=PLAN_CHUNK,
                                                     **launch)
    return Plan(rows, block_expert, a, num_experts, tiles)


def plan_reference(experts: torch.Tensor, num_experts: int) -> Plan:
    """:func:`plan` in PyTorch ops (~25 launches, no host read): pairs sorted by expert, stably."""
    _check_experts(experts)
    flat = experts.flatten().long()  # [A]
    a, dev = flat.numel(), flat.device
    tiles = _tiles(a, num_experts)
    bm = tiles[0]
    counts = torch.zeros(num_experts, dtype=torch.long, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + bm - 1) // bm * bm  # [E] each expert's rows, whole blocks
    ends = padded.cumsum(0)  # [E]
    order = torch.argsort(flat, stable=True)  # [A] the pairs by expert
    chosen = flat[order]  # [A] the expert of each sorted pair
    rank = torch.arange(a, device=dev) - (counts.cumsum(0) - counts)[chosen]  # its place in its expert's group
    r = _padded_rows(a, num_experts, bm)
    rows = torch.full((r,), a, dtype=torch.int32, device=dev).scatter_(0, (ends - padded)[chosen] + rank, order.int())
    block_expert = torch.searchsorted(ends, torch.arange(0, r, bm, device=dev), right=True).int()  # [R / bm]
    return Plan(rows, block_expert, a, num_experts, tiles)


@triton.jit(do_not_specialize=["A"])
def _expert_gemm_kernel(x_ptr, x_stride, rows_ptr, block_expert_ptr, w_ptr, w_stride_e, w_stride_n, w_stride_k,
                        s_ptr, s_stride_e, s_stride_n, s_stride_k, y_ptr, A, N, K, E,
                        FP8: tl.constexpr, QBLOCK_N: tl.constexpr, QBLOCK_K: tl.constexpr,
                        PER_ROW: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr):
    pdl.wait(PDL)  # the plan comes from the step's routing: nothing is read before
    block = tl.program_id(0)
    e = tl.load(block_expert_ptr + block)
    if e >= E:  # past the last used block
        return
    pairs = tl.load(rows_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))  # [BLOCK_M]
    valid = pairs < A
    src = (pairs // PER_ROW).to(tl.int64)  # x's row of each pair: its token (in projection), itself (out)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + src[:, None] * x_stride + k[None, :]  # [BLOCK_M, BLOCK_K]
    w_ptrs = w_ptr + e.to(tl.int64) * w_stride_e + n[None, :] * w_stride_n + k[:, None] * w_stride_k  # [BLOCK_K, BLOCK_N]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = k0 + k < K
        xs = tl.load(x_ptrs, mask=valid[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_mask[:, None] & (n < N)[None, :], other=0.0)
        if FP8:  # the tile dequantized with its expert's scales, rounded to x's dtype, then the same dot
            s_cols = s_ptr + e.to(tl.int64) * s_stride_e + (n // QBLOCK_N)[None, :] * s_stride_n  # [1, BLOCK_N]
            if QBLOCK_K % BLOCK_K == 0:  # the tile inside one block along K (128 x 128 blocks): a scale per column
                s = tl.load(s_cols + (k0 // QBLOCK_K) * s_stride_k, mask=(n < N)[None, :], other=0.0)
            else:  # blocks narrower than the tile or across it: each element's own
                s = tl.load(s_cols + ((k0 + k) // QBLOCK_K)[:, None] * s_stride_k,
                            mask=k_mask[:, None] & (n < N)[None, :], other=0.0)
            w = (w.to(tl.float32) * s).to(xs.dtype)
        acc = tl.dot(xs, w, acc, input_precision=PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * w_stride_k
    out = y_ptr + pairs.to(tl.int64)[:, None] * N + n[None, :]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=valid[:, None] & (n < N)[None, :])


def expert_gemm(x: torch.Tensor, weights: torch.Tensor, p: Plan, per_row: int, scale: torch.Tensor | None = None,
                block: tuple[int, int] | None = None) -> torch.Tensor:
    """``x[a // per_row] @ weights[e(a)].T`` for each pair ``a`` of :func:`plan`'s step, ``e(a)`` its
    expert -> ``[A, N]`` in x's dtype, by pair. ``x [rows, K]`` with unit column stride: the tokens
    (``per_row = k``: a pair reads its token's row, an in projection) or the pairs (``per_row = 1``,
    an out projection); ``weights [E, N, K]`` stacked in x's dtype, any strides. FP8 weights
    (float8_e4m3fn) come with ``scale [E, ceil(N / bn), ceil(K / bk)]`` and ``block = (bn, bk)``
    (``gemv.scale_args``): each weight tile is dequantized and rounded to x's dtype before its dot,
    so the result is ``F.linear`` of the dequantized weight in x's dtype, as for a weight in it."""
    if weights.dim() != 3 or x.dim() != 2 or x.shape[1] != weights.shape[2] or x.stride(1) != 1 \
            or weights.dtype not in (x.dtype, gemv.FP8_DTYPE) or weights.shape[0] != p.num_experts:
        raise ValueError(f"x must be [rows, K] with unit column stride and weights [{p.num_experts}, N, K] in x's "
                         f"dtype (or float8_e4m3fn), got {list(x.shape)} {x.dtype} and {list(weights.shape)} "
                         f"{weights.dtype}")
    if per_row < 1 or x.shape[0] * per_row != p.pairs:
        raise ValueError(f"x's {x.shape[0]} rows x per_row {per_row} must be the plan's {p.pairs} pairs")
    s, s_strides, fp8 = gemv.scale_args(x, weights, scale, block)
    n, k = weights.shape[1], weights.shape[2]
    bm, bn, bk, warps = p.tiles
    y = torch.empty(p.pairs, n, dtype=x.dtype, device=x.device)
    if p.pairs:
        _expert_gemm_kernel[(p.block_expert.numel(), triton.cdiv(n, bn))](
            x, x.stride(0), p.rows, p.block_expert, weights, weights.stride(0), weights.stride(1), weights.stride(2),
            s, *s_strides, y, p.pairs, n, k, p.num_experts, **fp8, PER_ROW=per_row, BLOCK_M=bm, BLOCK_N=bn,
            BLOCK_K=bk, PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_warps=warps, **pdl.launch(x))
    return y


# --- the router and the combine around the experts: one kernel each ------------------------------


@triton.jit
def _softmax_topk_kernel(logits_ptr, stride, w_ptr, e_ptr, E, K: tl.constexpr, RENORM: tl.constexpr,
                         BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    pdl.wait(PDL)
    t = tl.program_id(0).to(tl.int64)  # int64: t * stride (the logits may be a view of a wider projection)
    ex = tl.arange(0, BLOCK_E)
    x = tl.load(logits_ptr + t * stride + ex, mask=ex < E, other=float("-inf")).to(tl.float32)
    p = tl.exp(x - tl.max(x, axis=0))
    probs = tl.where(ex < E, p / tl.sum(p, axis=0), -1.0)  # fp32 softmax; -1 below any probability
    kk = tl.arange(0, BLOCK_K)
    weights = tl.zeros((BLOCK_K,), dtype=tl.float32)
    experts = tl.zeros((BLOCK_K,), dtype=tl.int64)
    for j in tl.static_range(K):  # the largest first; a tie to the lower index (torch.topk's order is unspecified)
        best, idx = tl.max(probs, axis=0, return_indices=True, return_indices_tie_break_left=True)
        weights = tl.where(kk == j, best, weights)
        experts = tl.where(kk == j, idx.to(tl.int64), experts)
        probs = tl.where(ex == idx, -1.0, probs)
    if RENORM:
        weights = weights / tl.sum(weights, axis=0)
    tl.store(w_ptr + t * K + kk, weights.to(w_ptr.dtype.element_ty), mask=kk < K)
    tl.store(e_ptr + t * K + kk, experts, mask=kk < K)


def softmax_topk(logits: torch.Tensor, k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A softmax router in one kernel: ``logits [T, E]`` -> ``(weights [T, k]`` in the logits' dtype,
    ``experts [T, k]`` int64``)``: the fp32 softmax's ``k`` largest probabilities, largest first (a tie
    to the lower index), renormalised to sum to one where ``renormalize``; the PyTorch ops'
    (``layers.SparseMoE.route``) within fp32 rounding, before the cast."""
    if logits.dim() != 2 or logits.stride(1) != 1 or not 0 < k <= logits.shape[1]:
        raise ValueError(f"logits must be [T, E] with unit column stride and 0 < k <= E, got "
                         f"{list(logits.shape)} and k={k}")
    t, e = logits.shape
    weights = torch.empty(t, k, dtype=logits.dtype, device=logits.device)
    experts = torch.empty(t, k, dtype=torch.long, device=logits.device)
    if t:
        _softmax_topk_kernel[(t,)](logits, logits.stride(0), weights, experts, e, K=k, RENORM=renormalize,
                                   BLOCK_E=triton.next_power_of_2(e), BLOCK_K=triton.next_power_of_2(k),
                                   **pdl.launch(logits))
    return weights, experts


@triton.jit
def _combine_kernel(ys_ptr, w_ptr, shared_ptr, gate_ptr, gate_stride, out_ptr, H, K: tl.constexpr,
                    SHARED: tl.constexpr, GATE: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr):
    pdl.wait(PDL)
    # int64: the experts' outputs at (t * K + j) * H pass 2**31 elements past ~105K tokens of Qwen3-Next's
    # (10 a token of 2,048), ~117K of Kimi-Linear's (8 of 2,304)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = h < H
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for j in tl.static_range(K):  # the token's experts in choice order
        w = tl.load(w_ptr + t * K + j).to(tl.float32)
        acc += w * tl.load(ys_ptr + (t * K + j) * H + h, mask=mask, other=0.0).to(tl.float32)
    if SHARED:
        shared = tl.load(shared_ptr + t * H + h, mask=mask, other=0.0).to(tl.float32)
        if GATE:
            shared = shared * tl.sigmoid(tl.load(gate_ptr + t * gate_stride).to(tl.float32))
        acc += shared
    tl.store(out_ptr + t * H + h, acc.to(out_ptr.dtype.element_ty), mask=mask)


def combine(ys: torch.Tensor, weights: torch.Tensor, shared: torch.Tensor | None = None,
            gate: torch.Tensor | None = None) -> torch.Tensor:
    """A MoE layer's output in one kernel: ``sum_j weights[t, j] * ys[t * k + j]`` (+ ``shared[t]``,
    times ``sigmoid(gate[t])`` where given) -> ``[T, H]`` in ``ys``' dtype: ``ys [T * k, H]`` the
    experts' outputs by (token, choice), ``weights [T, k]``, ``shared [T, H]`` the shared expert's
    output, ``gate [T, 1]`` its gate's logit. Summed in fp32 and rounded once (the PyTorch ops round
    each product and sum in the model dtype: bf16 results may differ in the last bit)."""
    t, k = weights.shape
    h = ys.shape[-1]
    if ys.shape != (t * k, h) or not ys.is_contiguous() or not weights.is_contiguous():
        raise ValueError(f"ys must be a contiguous [{t * k}, H] and weights a contiguous [T, k], got "
                         f"{list(ys.shape)} and {list(weights.shape)}")
    if shared is not None and (shared.shape != (t, h) or not shared.is_contiguous()):
        raise ValueError(f"shared must be a contiguous [{t}, {h}], got {list(shared.shape)}")
    if gate is not None and (shared is None or gate.shape != (t, 1)):
        raise ValueError(f"gate must be [{t}, 1], with shared")
    out = torch.empty(t, h, dtype=ys.dtype, device=ys.device)
    if t:
        block = min(1024, triton.next_power_of_2(h))
        _combine_kernel[(t, triton.cdiv(h, block))](
            ys, weights, ys if shared is None else shared, ys if gate is None else gate,
            1 if gate is None else gate.stride(0), out, h, K=k, SHARED=shared is not None, GATE=gate is not None,
            BLOCK_H=block, **pdl.launch(ys))
    return out
