"""The Triton kernels' pointer offsets past 2**31 elements (``hyla/model/ops/gpu``).

Triton passes an integer argument that fits in int32 as an i32, and ``tl.program_id`` and
``tl.arange`` are i32: an offset such as ``token * row_stride`` wraps past 2**31 elements unless the
kernel casts the token index to int64 first (a 116K-token extend of Kimi-Linear's 32 x 576 latent
queries, a 105K-token MoE combine of Qwen3-Next's 10 x 2,048 expert outputs). Each test here gives
a kernel 3 rows :data:`ROW_STRIDE` elements apart (a stride Triton still passes as an i32), so that
the third row starts past 2**31 elements, and checks the result against the same kernel on the rows
made contiguous. The rows sit in a lazily mapped storage of 2**32 elements (16 GiB of address space,
a few pages of memory: Triton's interpreter runs on CPU tensors in place, its host copies of a CPU
storage being the storage itself); a kernel whose offset wraps reads (or writes) ``2**13`` elements
before the first row instead, zeros inside the same storage, and gives a wrong result rather than a
crash.

A kernel whose only index past 2**31 is an output it allocates contiguous (``[T, ...]`` written in
full: ``add_rms_norm_fused``, the conv's outputs) is not tested here: that needs 2**31 elements
written. Where a kernel has both, its index is cast once where it is computed, and the strided input
tests the cast. The last test guards the kernels that indexed their tokens in int64 already (an
extend's segments, the logits' rows, MoE's grouped GEMM).

Without a GPU the kernels run in Triton's interpreter on CPU tensors (``TRITON_INTERPRET=1``, set
before any kernel is defined, as ``test_fused_decode`` does), which wraps i32 arithmetic as a GPU
does (numpy's int32); on a GPU they run for real, on 16 GiB of device memory per far tensor.
"""

from __future__ import annotations

import mmap
import os
import sys

import pytest
import torch

GPU = torch.cuda.is_available()
if not GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before hyla.model.ops.gpu defines its kernels
DEVICE = "cuda" if GPU else "cpu"

pytest.importorskip("triton")

from hyla.model.ops.gpu import moe, norms  # noqa: E402
from hyla.model.ops.gpu.decode_attention import decode_qk_prologue, merge_splits  # noqa: E402
from hyla.model.ops.gpu.extend_attention import paged_extend_attention  # noqa: E402
from hyla.model.ops.gpu.latent_attention import paged_latent_extend_attention  # noqa: E402

ROW_STRIDE = 2**31 - 2**12  # an i32 argument; row 2 at 2**32 - 2**13 elements, which wraps to -2**13
PAD = 2**14  # elements before row 0: a wrapped row 2 reads zeros here
ROWS = 3
# Linux's MAP_NORESERVE (Python 3.11's mmap does not name it): no commit charge for the address
# space, so the 16 GiB map is refused by no overcommit heuristic on a machine with less memory
MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000 if sys.platform.startswith("linux") else 0)


def far_rows(values: torch.Tensor) -> torch.Tensor:
    """``values [3, ...]`` (contiguous) copied into a view of the same shape whose rows lie
    :data:`ROW_STRIDE` elements apart (inner dimensions contiguous), ``PAD`` zeros before row 0."""
    assert values.shape[0] == ROWS and values.is_contiguous()
    width = values[0].numel()
    numel = PAD + (ROWS - 1) * ROW_STRIDE + width
    try:
        if GPU:
            storage = torch.empty(numel, dtype=values.dtype, device=DEVICE)
        else:  # pages never touched cost no memory
            size = numel * values.element_size()
            buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE)
            storage = torch.frombuffer(buf, dtype=values.dtype, count=numel)
    except (OSError, RuntimeError) as e:  # no such address space (or device memory) here
        pytest.skip(f"cannot map {numel} elements: {e}")
    storage[:PAD].zero_()
    inner = values.stride()[1:]
    view = storage[PAD:].as_strided(values.shape, (ROW_STRIDE, *inner))
    for i in range(ROWS):
        view[i].copy_(values[i])
    return view


def _rand(g: torch.Generator, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=g).to(DEVICE, dtype)


def _same(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """The kernel on far rows == on the same rows contiguous: one computation (a wrapped offset's
    zeros are far off)."""
    torch.testing.assert_close(actual, expected, atol=1e-6, rtol=1e-6)


# --- attention -----------------------------------------------------------------------------------


def _paged_kv(g: torch.Generator, hkv: int, d: int, prefix: int):
    """A pool ``[64, hkv, d]`` twice (K and V) and a request table whose row 2 holds a sequence's
    ``prefix + 3`` scattered slots; ``kv_lens`` of its 3 new tokens (causal)."""
    kb, vb = _rand(g, 64, hkv, d), _rand(g, 64, hkv, d)
    table = torch.zeros(3, 64, dtype=torch.int32, device=DEVICE)
    table[2, :prefix + ROWS] = (torch.randperm(63, generator=g)[:prefix + ROWS] + 1).int().to(DEVICE)
    lens = torch.arange(prefix + 1, prefix + ROWS + 1, device=DEVICE)
    return kb, vb, table, torch.tensor([2], device=DEVICE), lens


@pytest.mark.parametrize("splits", [None, 1])
def test_latent_extend_attention_far_queries(splits):
    """MLA's extend (``_latent_extend_stage1``): ``tok * q_stride`` past 2**31 — a 116K-token
    extend of Kimi-Linear's 32 heads of 576-wide latent queries."""
    g = torch.Generator().manual_seed(1)
    heads, width, rank = 4, 49, 40
    kb, vb, table, row, lens = _paged_kv(g, 1, (width + 1) // 2, 5)
    q = _rand(g, ROWS, heads, width)
    want = paged_latent_extend_attention(q, kb, vb, table, row, lens, 0.2, rank, splits=splits)
    _same(paged_latent_extend_attention(far_rows(q), kb, vb, table, row, lens, 0.2, rank, splits=splits), want)


def test_extend_attention_far_queries():
    """The paged extend attention (``_extend_stage1``): ``tok * q_stride`` past 2**31."""
    g = torch.Generator().manual_seed(2)
    hq, hkv, d = 4, 2, 16
    kb, vb, table, row, lens = _paged_kv(g, hkv, d, 7)
    q = _rand(g, ROWS, hq, d)
    want = paged_extend_attention(q, kb, vb, table, row, lens, 0.3)
    _same(paged_extend_attention(far_rows(q), kb, vb, table, row, lens, 0.3), want)


def test_merge_splits_far_gate():
    """Stage 2 of the decode and extend attention (``_stage2``, one program per token and head): the
    output gate's ``token * gate_stride`` past 2**31, the gate a view of the projection's per-head
    ``[q | gate]``."""
    g = torch.Generator().manual_seed(3)
    hq, splits, d = 4, 2, 16
    part_o, part_lse = _rand(g, ROWS, hq, splits, d), _rand(g, ROWS, hq, splits)
    gate = _rand(g, ROWS, hq, 2 * d)
    want = merge_splits(part_o, part_lse, torch.float32, gate[:, :, d:])
    _same(merge_splits(part_o, part_lse, torch.float32, far_rows(gate)[:, :, d:]), want)


def test_qk_prologue_far_rows():
    """The attention prologue (``_qk_prologue_kernel``, also an extend's: any number of tokens):
    ``i * qkv_stride`` past 2**31; q out and the K/V pool writes."""
    g = torch.Generator().manual_seed(4)
    hq, hkv, d = 4, 2, 16
    qkv = _rand(g, ROWS, 2 * hq * d + 2 * hkv * d)
    scale, inv_freq = _rand(g, hq + hkv, d), torch.rand(4, generator=g).to(DEVICE)  # RoPE on 8 of 16 channels
    pos = torch.tensor([3, 17, 40], device=DEVICE)
    loc = torch.tensor([11, 2, 7], device=DEVICE)
    pools = [[_rand(g, 20, hkv, d) for _ in range(2)]]
    pools.append([p.clone() for p in pools[0]])
    want = decode_qk_prologue(qkv, hq, hkv, d, True, *pools[0], loc, scale, 1e-6, (pos, inv_freq))
    q = decode_qk_prologue(far_rows(qkv), hq, hkv, d, True, *pools[1], loc, scale, 1e-6, (pos, inv_freq))
    _same(q, want)
    _same(pools[1][0], pools[0][0])
    _same(pools[1][1], pools[0][1])


# --- the row-wise kernels ------------------------------------------------------------------------


@pytest.mark.parametrize("op", ["rms_norm", "gated_rms_norm", "silu_mul", "sigmoid_gate"])
def test_norm_kernels_far_rows(op):
    """``norms``' kernels, one program per row (or per row and head): ``row * x_stride`` past 2**31
    (a strided split of a projection: ``rms_norm_fused`` of per-head q/k runs ``T * heads`` rows)."""
    g = torch.Generator().manual_seed(5)
    if op == "rms_norm":
        x, scale = _rand(g, ROWS, 40), _rand(g, 40)
        run = lambda x: norms.rms_norm_fused(x, scale, 1e-6)  # noqa: E731
    elif op == "gated_rms_norm":
        x, weight = _rand(g, ROWS, 2 * 64), _rand(g, 16)
        run = lambda xz: norms.gated_rms_norm_fused(xz[:, :64], xz[:, 64:], weight, 1e-6, 4)  # noqa: E731
    elif op == "silu_mul":
        x = _rand(g, ROWS, 100)
        run = norms.silu_mul_fused
    else:
        x = _rand(g, ROWS, 3, 2 * 24)  # [q | gate] per head: o and the gate
        run = lambda x: norms.sigmoid_gate_fused(x[:, :, :24], x[:, :, 24:])  # noqa: E731
    _same(run(far_rows(x)), run(x))


def test_moe_router_far_logits():
    """MoE's router (``_softmax_topk_kernel``): ``t * stride`` of the logits past 2**31 (a view of a
    wider projection, as the layer's router + shared-expert gate)."""
    g = torch.Generator().manual_seed(6)
    logits = _rand(g, ROWS, 64)
    w, ids = moe.softmax_topk(logits, 8, True)
    far_w, far_ids = moe.softmax_topk(far_rows(logits), 8, True)
    assert torch.equal(far_ids, ids)
    _same(far_w, w)


def test_moe_combine_far_gate():
    """MoE's combine (``_combine_kernel``): the shared expert's gate ``[T, 1]``, a column of a
    projection, at ``t * gate_stride`` past 2**31."""
    g = torch.Generator().manual_seed(7)
    ys, weights, shared = _rand(g, ROWS * 2, 40), torch.rand(ROWS, 2, generator=g).to(DEVICE), _rand(g, ROWS, 40)
    gate = _rand(g, ROWS, 1)
    want = moe.combine(ys, weights, shared, gate)
    _same(moe.combine(ys, weights, shared, far_rows(gate)), want)


# --- kernels whose token index was int64 already: guards --------------------------------------


def _guarded(name: str, g: torch.Generator):
    """``(inputs [3, W], out, run)`` for kernel ``name``: ``run(inputs, out)`` launches it on the
    columns of ``inputs`` (rows strided as the layer's splits of a projection), writing into ``out``
    (None: the kernel allocates its output), and returns the tensors to compare."""
    from hyla.model.ops.gpu import gated_delta_chunks, gated_delta_decode, kda_decode, mamba2_chunks, \
        mamba2_decode, selective_scan
    from hyla.model.ops.gpu.conv1d_extend import ConvRows, causal_conv1d_rows_fused
    from hyla.model.ops.gpu.logits import argmax_logsumexp

    long = lambda *values: torch.tensor(values, device=DEVICE)  # noqa: E731
    # one segment of the 3 tokens, from state row 1; int32 indices (the engine's are int64), so that the token
    # index is int64 by the kernel's own cast, not by the segment's length it adds
    segment = tuple(torch.tensor(v, dtype=torch.int32, device=DEVICE) for v in ([1], [0], [0, ROWS]))
    if name in ("gated_delta_segments", "gated_delta_chunks"):  # Hk 1, Hv 2 of 16 x 16: [qkv | a | b]
        states, a_log, dt_bias = _rand(g, 2, 2, 16, 16), _rand(g, 2), _rand(g, 2)
        kernel = gated_delta_decode.gated_delta_segments_fused if name == "gated_delta_segments" else \
            gated_delta_chunks.gated_delta_chunks_fused

        def run(p, out):
            pool = states.clone()
            kernel(p[:, :64], p[:, 64:66], p[:, 66:], a_log, dt_bias, pool, *segment, out, 1, 16)
            return out, pool
        return _rand(g, ROWS, 68), torch.zeros(ROWS, 2, 16, device=DEVICE), run
    if name in ("mamba2_segments", "mamba2_chunks"):  # 2 heads of 16 x 16, one group: [x | dt | B | C]
        states, a, d, dt_bias = _rand(g, 2, 2, 16, 16), -torch.rand(2, generator=g).to(DEVICE), _rand(g, 2), _rand(g, 2)
        kernel = mamba2_decode.mamba2_segments_fused if name == "mamba2_segments" else mamba2_chunks.mamba2_chunks_fused

        def run(p, out):
            pool = states.clone()
            kernel(p[:, :32], p[:, 32:34], a, p[:, 34:50], p[:, 50:], d, dt_bias, pool, *segment, out)
            return out, pool
        return _rand(g, ROWS, 66), torch.zeros(ROWS, 2, 16, device=DEVICE), run
    if name == "kda_segments":  # 2 heads of 16 x 16: [qkv | f | b]
        states, a_log, dt_bias = _rand(g, 2, 2, 16, 16), _rand(g, 2), _rand(g, 32)

        def run(p, out):
            pool = states.clone()
            kda_decode.kda_segments_fused(p[:, :96], p[:, 96:128], p[:, 128:], a_log, dt_bias, pool, *segment, out)
            return out, pool
        return _rand(g, ROWS, 130), torch.zeros(ROWS, 2, 16, device=DEVICE), run
    if name == "selective_scan_segments":  # 16 channels of 8 states: [x | dt | z | B | C]
        states, a, d, dt_bias = _rand(g, 2, 16, 8), -torch.rand(16, 8, generator=g).to(DEVICE), _rand(g, 16), _rand(g, 16)

        def run(p, out):
            pool = states.clone()
            selective_scan.selective_scan_segments_fused(p[:, :16], p[:, 16:32], a, p[:, 48:56], p[:, 56:], d, dt_bias,
                                                         pool, *segment, out, z=p[:, 32:48])
            return out, pool
        return _rand(g, ROWS, 64), torch.zeros(ROWS, 16, device=DEVICE), run
    if name == "conv1d_extend":  # 40 channels, a window of 4: one sequence from pool row 1, its window to row 2
        weight, bias, states = _rand(g, 40, 4), _rand(g, 40), _rand(g, 4, 40, 3)
        rows = ConvRows(long(0, 0, 0), long(0), ((long(0), long(ROWS), long(2)),))

        def run(p, out):
            pool = states.clone()
            return causal_conv1d_rows_fused(p, weight, bias, pool, rows, long(1)), pool
        return _rand(g, ROWS, 40), None, run
    if name == "logits":
        return _rand(g, ROWS, 5000), None, lambda x, out: argmax_logsumexp(x)
    if name == "expert_gemm":  # 3 tokens to 2 of 4 experts each, an in projection of 32 -> 24
        experts = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(ROWS)]).to(DEVICE)
        weights, p = _rand(g, 4, 24, 32), moe.plan(experts, 4)
        return _rand(g, ROWS, 32), None, lambda x, out: (moe.expert_gemm(x, weights, p, per_row=2),)
    raise ValueError(name)


@pytest.mark.parametrize("name", ["gated_delta_segments", "gated_delta_chunks", "mamba2_segments", "mamba2_chunks",
                                  "kda_segments", "selective_scan_segments", "conv1d_extend", "logits", "expert_gemm"])
def test_int64_kernels_far_rows(name):
    """The kernels that already index tokens in int64 (an extend's segments, from a row loaded
    ``.to(tl.int64)``; the logits' rows; the grouped GEMM's pairs): their inputs' rows, and their
    outputs' where strided, past 2**31 elements — a guard on those casts."""
    g = torch.Generator().manual_seed(8)
    inputs, out, run = _guarded(name, g)
    want = run(inputs, out)
    got = run(far_rows(inputs), None if out is None else far_rows(out))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
