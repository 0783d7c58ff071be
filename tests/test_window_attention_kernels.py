"""Sliding-window attention in the paged Triton kernels (``paged_decode_attention`` and
``paged_extend_attention``, ``window=W``) against a plain PyTorch reference.

Hugging Face's ``sliding_window`` mask: the query at position ``p`` sees key ``k`` iff ``k <= p``
and ``p - k < W``; a query with ``len`` keys sees ``[max(0, len - W), len)``. The reference is a
softmax over exactly those keys in fp32. Without a GPU the kernels run in Triton's interpreter
(``TRITON_INTERPRET=1``, set before any kernel is defined), so the shapes are small. The keys no
program should read (below every window) are NaN in the pool: a kernel that read them, even masked,
would give NaN (``0 * NaN`` in the ``p @ v`` dot).

Half precision: fp16 everywhere; bf16 only on a GPU, since the interpreter's ``tl.dot`` multiplies
bf16 operands' bit patterns (triton-lang/triton#11584; the other kernel tests run bf16 on a GPU only).
"""

from __future__ import annotations

import os

import pytest
import torch

GPU = torch.cuda.is_available()
if not GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before hyla.model.ops.gpu defines its kernels
DEVICE = "cuda" if GPU else "cpu"

pytest.importorskip("triton")

from hyla.model.ops.gpu import extend_attention  # noqa: E402
from hyla.model.ops.gpu.decode_attention import paged_decode_attention  # noqa: E402
from hyla.model.ops.gpu.extend_attention import paged_extend_attention  # noqa: E402

HQ, HKV, D = 4, 2, 16  # GQA: 2 query heads per KV head
SCALE = 0.3


BF16 = pytest.param(torch.bfloat16, marks=pytest.mark.skipif(not GPU, reason="the interpreter's bf16 tl.dot"))


def _tol(dtype: torch.dtype) -> dict:
    return dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)


def _reference(q: torch.Tensor, kb: torch.Tensor, vb: torch.Tensor, slots: list[torch.Tensor],
               gate: torch.Tensor | None) -> torch.Tensor:
    """``q [N, Hq, D]``, query ``i`` over the pool slots ``slots[i]`` (exactly the keys it sees) -> ``[N, Hq, D]``
    fp32, times ``sigmoid(gate)`` with a gate."""
    out = []
    for qi, s in zip(q.float(), slots):
        k = kb[s].float().repeat_interleave(HQ // HKV, dim=1)  # [n, Hq, D]
        v = vb[s].float().repeat_interleave(HQ // HKV, dim=1)
        p = torch.softmax(torch.einsum("hd,nhd->hn", qi, k) * SCALE, dim=-1)
        out.append(torch.einsum("hn,nhd->hd", p, v))
    o = torch.stack(out)
    return o * torch.sigmoid(gate.float()) if gate is not None else o


def _visible(length: int, window: int) -> slice:
    return slice(max(0, length - window) if window else 0, length)


def _decode_inputs(dtype: torch.dtype, lens: list[int], gated: bool, seed: int = 0):
    """Sequences of ``lens`` keys in rows 3, 0, 4, ... of the request table, their slots scattered
    over the pool; q rows strided, the gate a strided view (as the layer passes them)."""
    g = torch.Generator().manual_seed(seed)
    rows = [3, 0, 4, 1][:len(lens)]
    kb = torch.randn(120, HKV, D, generator=g).to(dtype)
    vb = torch.randn(120, HKV, D, generator=g).to(dtype)
    table = torch.zeros(5, 128, dtype=torch.int32)
    for r, n in zip(rows, lens):
        table[r, :n] = (torch.randperm(119, generator=g)[:n] + 1).int()
    q = torch.randn(len(lens), HQ + HKV, D, generator=g).to(dtype)[:, :HQ]
    gate = torch.randn(len(lens), HQ, 2 * D, generator=g).to(dtype)[:, :, D:] if gated else None
    return q, kb, vb, table, rows, gate


def _decode(q, kb, vb, table, rows, lens, gate, splits, **window) -> torch.Tensor:
    return paged_decode_attention(q.to(DEVICE), kb.to(DEVICE), vb.to(DEVICE), table.to(DEVICE),
                                  torch.tensor(rows, device=DEVICE), torch.tensor(lens, device=DEVICE), SCALE,
                                  splits=splits, gate=gate.to(DEVICE) if gate is not None else None, **window).cpu()


# fp32: window 1; windows shorter than the longer sequences (5: one split seen, the others empty;
# 40: a window over two splits of 32-key blocks, starting off a block's edge, two splits empty); a
# window longer than every sequence (== no window). Half precision (64-key blocks): 5 and 40
@pytest.mark.parametrize("window, splits, gated", [(1, 4, False), (5, 4, True), (40, 4, False), (40, 1, True),
                                                   (100, None, True)])
def test_window_decode_attention(window, splits, gated):
    _check_decode(torch.float32, window, splits, gated)


@pytest.mark.parametrize("dtype", [torch.float16, BF16])
@pytest.mark.parametrize("window, splits", [(5, 2), (40, 4)])
def test_window_decode_attention_half(dtype, window, splits):
    _check_decode(dtype, window, splits, True)


def _check_decode(dtype, window, splits, gated):
    lens = [7, 70, 1, 45]
    q, kb, vb, table, rows, gate = _decode_inputs(dtype, lens, gated)
    seen = [table[r, _visible(n, window)].long() for r, n in zip(rows, lens)]
    hidden = set(torch.cat([table[r, :n] for r, n in zip(rows, lens)]).tolist()) - set(torch.cat(seen).tolist())
    poisoned_k, poisoned_v = kb.clone(), vb.clone()
    poisoned_k[list(hidden)] = float("nan")  # never read: decode's key range starts at len - window
    poisoned_v[list(hidden)] = float("nan")
    o = _decode(q, poisoned_k, poisoned_v, table, rows, lens, gate, splits, window=window)
    assert o.dtype == dtype and torch.isfinite(o).all()
    torch.testing.assert_close(o.float(), _reference(q, kb, vb, seen, gate), **_tol(dtype))
    if window >= max(lens):  # the same keys in the same splits: the same bits as without a window
        assert torch.equal(o, _decode(q, kb, vb, table, rows, lens, gate, splits))


def _extend_inputs(dtype: torch.dtype, prefix: int, n: int, pad: int, seed: int = 0):
    """One sequence's ``n`` new tokens after ``prefix`` cached ones, its slots scattered over the
    pool in row 2 of the request table; ``pad`` padding tokens after them (one key each)."""
    g = torch.Generator().manual_seed(seed)
    kb = torch.randn(200, HKV, D, generator=g).to(dtype)
    vb = torch.randn(200, HKV, D, generator=g).to(dtype)
    slots = torch.randperm(199, generator=g)[:prefix + n] + 1
    table = torch.zeros(4, 128, dtype=torch.int32)
    table[2, :prefix + n] = slots.int()
    q = torch.randn(n + pad, HQ, D, generator=g).to(dtype)
    gate = torch.randn(n + pad, HQ, 2 * D, generator=g).to(dtype)[:, :, D:]
    lens = [prefix + j + 1 for j in range(n)] + [1] * pad
    return q, kb, vb, table, slots, gate, lens


def _extend(q, kb, vb, table, lens, gate, splits, **window) -> torch.Tensor:
    return paged_extend_attention(q.to(DEVICE), kb.to(DEVICE), vb.to(DEVICE), table.to(DEVICE),
                                  torch.tensor([2], device=DEVICE), torch.tensor(lens, device=DEVICE), SCALE,
                                  splits=splits, gate=gate.to(DEVICE) if gate is not None else None, **window).cpu()


# Tiles of 16 rows (8 tokens x 2 heads): several blocks, each starting its keys at its own shortest
# length - window (a block's range: window + 7 keys). fp32: window 1; 8 < the context (a 15-key range:
# one 32-key split seen, 3 empty); 30 (37 keys: 2 splits seen, 2 empty); a fresh prompt (no prefix)
# under a window; padding tokens (kv_lens 1: their block starts at key 0); a window longer than the
# context (== no window). Half precision (64-key blocks): 8 and 30
@pytest.mark.parametrize("prefix, n, pad, window, splits, gated", [
    (37, 12, 0, 1, 2, False),
    (37, 21, 0, 8, 4, True),
    (37, 21, 0, 30, 4, False),
    (0, 20, 0, 6, 2, False),
    (30, 13, 3, 8, 2, True),
    (30, 13, 3, 100, 4, True),
])
def test_window_extend_attention(prefix, n, pad, window, splits, gated, monkeypatch):
    _check_extend(torch.float32, prefix, n, pad, window, splits, gated, monkeypatch)


@pytest.mark.parametrize("dtype", [torch.float16, BF16])
@pytest.mark.parametrize("window, splits", [(8, 4), (30, 2)])
def test_window_extend_attention_half(dtype, window, splits, monkeypatch):
    _check_extend(dtype, 37, 21, 3, window, splits, True, monkeypatch)


def _check_extend(dtype, prefix, n, pad, window, splits, gated, monkeypatch):
    monkeypatch.setattr(extend_attention, "TILE_ROWS", 16)
    q, kb, vb, table, slots, gate, lens = _extend_inputs(dtype, prefix, n, pad)
    gate = gate if gated else None
    seen = [table[2, _visible(length, window)].long() for length in lens]
    poisoned_k, poisoned_v = kb.clone(), vb.clone()
    if not pad:  # keys below the first token's window: below every block's range
        poisoned_k[slots[:max(0, prefix + 1 - window)]] = float("nan")
        poisoned_v[slots[:max(0, prefix + 1 - window)]] = float("nan")
    o = _extend(q, poisoned_k, poisoned_v, table, lens, gate, splits, window=window)
    assert o.dtype == dtype and torch.isfinite(o).all()
    torch.testing.assert_close(o.float(), _reference(q, kb, vb, seen, gate), **_tol(dtype))
    if window >= max(lens):  # the same bits as without a window
        assert torch.equal(o, _extend(q, kb, vb, table, lens, gate, splits))


def test_window_zero_is_no_window():
    """``window=0`` (the default) is the kernels without a window: the same bits."""
    lens = [7, 45]
    q, kb, vb, table, rows, gate = _decode_inputs(torch.float32, lens, True, seed=1)
    assert torch.equal(_decode(q, kb, vb, table, rows, lens, gate, 2, window=0),
                       _decode(q, kb, vb, table, rows, lens, gate, 2))
    q, kb, vb, table, _, gate, lens = _extend_inputs(torch.float32, 9, 6, 2, seed=1)
    assert torch.equal(_extend(q, kb, vb, table, lens, gate, 2, window=0), _extend(q, kb, vb, table, lens, gate, 2))


@pytest.mark.parametrize("window", [-1, 2.0, True, None])
def test_window_must_be_a_non_negative_int(window):
    q, kb, vb, table, rows, gate = _decode_inputs(torch.float32, [3], False)
    with pytest.raises(ValueError, match="window"):
        _decode(q, kb, vb, table, rows, [3], gate, 1, window=window)
    q, kb, vb, table, _, gate, lens = _extend_inputs(torch.float32, 2, 3, 0)
    with pytest.raises(ValueError, match="window"):
        _extend(q, kb, vb, table, lens, gate, 1, window=window)
