"""A float8 KV cache (``Engine(kv_cache_dtype="fp8_e4m3")``): K and V written rounded to e4m3, read back widened.

The oracle of each path is the same computation on a KV buffer in the model's dtype that holds the values
the float8 buffer holds: every write rounds as PyTorch's ``.to(torch.float8_e4m3fn)`` rounds (to nearest,
ties to even, saturating at +-448; the Triton kernels through ``ops/gpu/fp8.store_rounded``), and every
read widens before any arithmetic, so the attention outputs are those of the widened buffer to the bit.
The cache on/off differentials with a float8 KV cache are in ``test_engine_differential.py`` (``fp8_kv``,
with the tolerance a float8 KV cache needs there, and why). Without a GPU the kernels run interpreted.
"""

from __future__ import annotations

import os

import pytest
import torch

GPU = torch.cuda.is_available()
if not GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before hyla.model.ops.gpu defines its kernels
DEVICE = "cuda" if GPU else "cpu"

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from hyla import Engine  # noqa: E402
from hyla.cache import CacheLayout  # noqa: E402
from hyla.engine import engine as engine_module  # noqa: E402
from hyla.engine.args import EngineArgs  # noqa: E402
from hyla.model.ops.attention import paged_attention, paged_attention_decode  # noqa: E402
from hyla.model.ops.gpu.decode_attention import decode_qk_prologue, paged_decode_attention  # noqa: E402
from hyla.model.ops.gpu.extend_attention import paged_extend_attention  # noqa: E402
from hyla.model.ops.gpu.fp8 import store_rounded  # noqa: E402
from hyla.model.ops.gpu.latent_attention import (paged_latent_decode_attention,  # noqa: E402
                                                 paged_latent_extend_attention)

F8 = torch.float8_e4m3fn
FLOAT8 = pytest.mark.parametrize("f8", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])


@triton.jit
def _store_kernel(x_ptr, y_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    store_rounded(y_ptr + i, tl.load(x_ptr + i), i < N)


@FLOAT8
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_kernels_round_to_float8_as_pytorch(dtype, f8):
    """``store_rounded`` into a float8 buffer == PyTorch's cast, value for value: every e4m3 / e5m2 value, every
    midpoint between two (ties to even), both signs, subnormals, past the largest (e4m3 saturates at 448,
    e5m2 overflows to infinity from 61440), the infinities, NaN and -0, random values; into a buffer of another dtype a plain cast. (The
    interpreter's own cast to float8 differs from a GPU's and PyTorch's on about one value in five.)"""
    g = torch.Generator().manual_seed(0)
    grid = torch.arange(256, dtype=torch.uint8).view(f8).float()
    grid = grid[grid.isfinite()].sort().values
    mids = (grid[:-1] + grid[1:]) / 2
    x = torch.cat([grid, mids, -mids, torch.randn(1 << 13, generator=g) * 4, torch.randn(1 << 11, generator=g) / 64,
                   torch.randn(1 << 11, generator=g) * 3e4,
                   torch.tensor([449.0, 464.0, 465.0, 479.0, 480.0, 1e4, -1e4, 2.0**-10, 3 * 2.0**-11, 2.0**-11,
                                 57344.0, 60000.0, 61440.0, 1e6, 2.0**-16, 2.0**-17, 3 * 2.0**-18,
                                 float("inf"), -float("inf"), float("nan"), -0.0, -1e-9])])
    n = 1 << (x.numel() - 1).bit_length()
    x = torch.cat([x, torch.zeros(n - x.numel())]).to(dtype)
    ref = x.to(f8)
    if f8 == F8:
        assert ref.float().nan_to_num().abs().max() == 448  # (saturation is PyTorch's too)
    else:
        assert ref.float().isinf().sum() > 2  # (e5m2's overflow: PyTorch's too)
    y = torch.empty(n, dtype=f8, device=DEVICE)
    _store_kernel[(1,)](x.to(DEVICE), y, N=n)
    got, want = y.cpu().float(), ref.float()
    nan = want.isnan()  # (a NaN's sign is not kept: the kernel writes 0x7f)
    assert torch.equal(got.isnan(), nan) and torch.equal(got.signbit()[~nan], want.signbit()[~nan])
    assert torch.equal(got[~nan], want[~nan])
    same = torch.empty(n, dtype=dtype, device=DEVICE)
    _store_kernel[(1,)](x.to(DEVICE), same, N=n)
    torch.testing.assert_close(same.cpu(), x, atol=0, rtol=0, equal_nan=True)


def _pool(g: torch.Generator, rows: int, heads: int, dim: int, f8: torch.dtype = F8) -> torch.Tensor:
    """A float8 pool of values spread over its range (magnitudes 1/64 to ~50)."""
    return (torch.randn(rows, heads, dim, generator=g) * torch.exp2(torch.randint(-6, 6, (rows, heads, 1),
                                                                                   generator=g).float())).to(f8)


@FLOAT8
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_decode_and_extend_kernels_read_float8_as_its_widened_values(dtype, f8):
    """``paged_decode_attention`` and ``paged_extend_attention`` over float8 buffers == over buffers in q's
    dtype holding the widened values, to the bit (the kernels widen each key and value tile first)."""
    g = torch.Generator().manual_seed(1)
    hq, hkv, d = 4, 2, 16
    kb, vb = _pool(g, 150, hkv, d, f8), _pool(g, 150, hkv, d, f8)
    table = torch.zeros(4, 96, dtype=torch.int32)
    lens = [7, 70, 1]
    for r, n in zip((3, 0, 2), lens):
        table[r, :n] = (torch.randperm(149, generator=g)[:n] + 1).int()
    q = torch.randn(3, hq, d, generator=g).to(dtype)
    dev = lambda *ts: [t.to(DEVICE) for t in ts]  # noqa: E731
    rows, seq_lens = torch.tensor([3, 0, 2]), torch.tensor(lens)
    got = paged_decode_attention(*dev(q, kb, vb, table, rows, seq_lens), 0.3, splits=2)
    ref = paged_decode_attention(*dev(q, kb.to(dtype), vb.to(dtype), table, rows, seq_lens), 0.3,
                                 splits=2)
    assert torch.isfinite(got).all() and torch.equal(got, ref)
    qe = torch.randn(12, hq, d, generator=g).to(dtype)
    kv_lens = torch.tensor([59 + j for j in range(12)])
    got = paged_extend_attention(*dev(qe, kb, vb, table, torch.tensor([0]), kv_lens), 0.3, splits=2)
    ref = paged_extend_attention(*dev(qe, kb.to(dtype), vb.to(dtype), table, torch.tensor([0]), kv_lens),
                                 0.3, splits=2)
    assert torch.isfinite(got).all() and torch.equal(got, ref)


@FLOAT8
def test_latent_kernels_read_float8_as_its_widened_values(f8):
    """MLA's kernels (Kimi-Linear, Ling 3: the latent cached half in K, half in V) over float8 halves ==
    over fp32 halves holding the widened values, to the bit."""
    g = torch.Generator().manual_seed(2)
    heads, width, half, rank = 5, 20, 10, 12
    kb, vb = _pool(g, 90, 1, half, f8), _pool(g, 90, 1, half, f8)
    table = torch.zeros(3, 64, dtype=torch.int32)
    table[1, :40] = (torch.randperm(89, generator=g)[:40] + 1).int()
    table[2, :9] = (torch.randperm(89, generator=g)[:9] + 1).int()
    dev = lambda *ts: [t.to(DEVICE) for t in ts]  # noqa: E731
    wide = (kb.float(), vb.float())
    q = torch.randn(2, heads, width, generator=g)
    args = (torch.tensor([1, 2]), torch.tensor([40, 9]))
    got = paged_latent_decode_attention(*dev(q, kb, vb, table, *args), 0.2, rank, splits=2)
    assert torch.isfinite(got).all()
    assert torch.equal(got, paged_latent_decode_attention(*dev(q, *wide, table, *args), 0.2, rank, splits=2))
    qe = torch.randn(6, heads, width, generator=g)
    args = (torch.tensor([1]), torch.tensor([35 + j for j in range(6)]))
    got = paged_latent_extend_attention(*dev(qe, kb, vb, table, *args), 0.2, rank, splits=2)
    assert torch.equal(got, paged_latent_extend_attention(*dev(qe, *wide, table, *args), 0.2, rank, splits=2))


@FLOAT8
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_prologue_writes_float8_as_pytorch_rounds(dtype, f8):
    """``decode_qk_prologue`` (q/k norm, RoPE, the K/V writes) into float8 buffers: the K and V the kernel
    writes into a buffer of the model's dtype, rounded by PyTorch's cast; q unchanged."""
    g = torch.Generator().manual_seed(3)
    hq, hkv, d, b = 4, 2, 32, 5
    qkv = (torch.randn(b, (hq + 2 * hkv) * d, generator=g) * 30).to(dtype)  # some values past 448 after the norm
    scale = torch.rand(hq + hkv, d, generator=g) * 600
    loc = torch.tensor([3, 9, 1, 12, 7])
    rope = (torch.tensor([0, 5, 17, 2, 300]), 1.0 / 10000 ** (torch.arange(0, 16, 2).float() / 16))
    dev = lambda *ts: [t.to(DEVICE) for t in ts]  # noqa: E731
    outs = {}
    for kv_dtype in (dtype, f8):
        kb, vb = torch.zeros(16, hkv, d, dtype=kv_dtype, device=DEVICE), torch.zeros(16, hkv, d, dtype=kv_dtype,
                                                                                  device=DEVICE)
        q = decode_qk_prologue(*dev(qkv), hq, hkv, d, False, kb, vb, *dev(loc), scale.to(DEVICE), 1e-6,
                               tuple(dev(*rope)))
        outs[kv_dtype] = (q.cpu(), kb.cpu(), vb.cpu())
    (q, k, v), (q8, k8, v8) = outs[dtype], outs[f8]
    assert torch.equal(q, q8)
    assert k.abs().max() > 448  # (the saturation is exercised)
    torch.testing.assert_close(k8.float(), k.to(f8).float(), atol=0, rtol=0)
    torch.testing.assert_close(v8.float(), v.to(f8).float(), atol=0, rtol=0)


@FLOAT8
def test_pytorch_attention_over_float8_is_the_widened_buffers(f8):
    """The PyTorch ops (the CPU path, and a GPU's extends and verify steps): ``paged_attention`` (a prefill
    after a cached prefix, a tree verify, a sliding window) and ``paged_attention_decode`` write the new K/V
    rounded to float8 and attend over the widened pool: equal to the same op given the rounded K/V over an
    fp32 pool holding the widened values."""
    g = torch.Generator().manual_seed(4)
    hq, hkv, d = 4, 2, 8
    pool8 = [_pool(g, 64, hkv, d, f8) for _ in range(2)]
    pool32 = [p.float() for p in pool8]
    prefix, new = [9, 0, 20], [5, 7, 3]
    slots = torch.randperm(63, generator=g)[:sum(prefix) + sum(new)] + 1
    kv_indices, out_loc, start, indptr = [], [], 0, [0]
    for p, n in zip(prefix, new):
        seq = slots[start:start + p + n]
        kv_indices.append(seq)
        out_loc.append(seq[p:])
        start += p + n
        indptr.append(start)
    kv_indices, out_loc, indptr = torch.cat(kv_indices), torch.cat(out_loc), torch.tensor(indptr)
    t = sum(new)
    q = torch.randn(t, hq, d, generator=g)
    k, v = torch.randn(t, hkv, d, generator=g) * 20, torch.randn(t, hkv, d, generator=g)
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    for kw in (dict(), dict(window=4), dict(tree_masks=[None, None, tree])):
        a = paged_attention(q, k, v, *pool8, out_loc, kv_indices, indptr, prefix, new, 0.3, **kw)
        b = paged_attention(q, k.to(f8).float(), v.to(f8).float(), *pool32, out_loc, kv_indices, indptr, prefix,
                            new, 0.3, **kw)
        assert torch.equal(a, b)
        assert torch.equal(pool8[0].float(), pool32[0]) and torch.equal(pool8[1].float(), pool32[1])
    # a decode step: one new token each, over the table of its slots
    lens = [p + n for p, n in zip(prefix, new)]
    width = max(lens)
    table = torch.zeros(3, width, dtype=torch.long)
    for i, n in enumerate(lens):
        table[i, :n] = kv_indices[indptr[i]:indptr[i + 1]]
    last = table[torch.arange(3), torch.tensor(lens) - 1]
    mask = torch.zeros(3, width).masked_fill_(torch.arange(width) >= torch.tensor(lens)[:, None], float("-inf"))
    qd, kd, vd = q[:3], k[:3] * 3, v[:3]
    a = paged_attention_decode(qd, kd, vd, *pool8, last, table, mask, 0.3)
    b = paged_attention_decode(qd, kd.to(f8).float(), vd.to(f8).float(), *pool32, last, table, mask, 0.3)
    assert torch.equal(a, b)


def test_engine_kv_cache_dtype_halves_the_bytes_and_doubles_the_tokens(monkeypatch):
    """``kv_cache_dtype``: the pools' buffers are float8 (the MTP layer's and a draft model's too: the
    layout's companion), a token's KV takes a byte per element (a quarter of fp32's), and a KV pool sized
    from a memory budget holds that many more tokens; the summary says so. The default (auto) keeps the
    model's dtype; other values are a ValueError."""
    layout = CacheLayout(num_attention_layers=2, num_kv_heads=2, head_dim=8, kv_dtype=torch.bfloat16,
                         companion=CacheLayout(num_attention_layers=1, num_kv_heads=1, head_dim=4))
    f8 = layout.with_kv_dtype(F8)
    assert f8.kv_dtype == f8.companion.kv_dtype == F8 and f8.kv_bytes_per_token * 2 == layout.kv_bytes_per_token
    sizes = {}
    # the same free RAM for every engine (16 GiB: other processes' memory moves, and machines differ)
    monkeypatch.setattr(engine_module, "_available_ram", lambda: 16 << 30)
    kinds = {"auto": torch.float32, "fp8": F8, "fp8_e5m2": torch.float8_e5m2}
    for kv, kind in kinds.items():
        with Engine(kv_cache_dtype=kv, mem_fraction=1e-3, max_state_slots=64) as e:
            assert all(b.dtype == kind for b in e.kv_pool.k_buffers)
            sizes[kv] = (e.kv_pool.bytes_per_token, e.kv_pool.size)
            assert (f", {str(kind).split('.')[-1]})" in e.summary()) == (kv != "auto")
            out = e.generate(input_ids=[5, 6, 7, 8] * 10, sampling_params={"temperature": 0, "max_new_tokens": 4})
            assert len(out["output_ids"]) == 4
    assert sizes["auto"][0] == 4 * sizes["fp8"][0] == 4 * sizes["fp8_e5m2"][0]
    assert sizes["fp8"][1] >= 3.9 * sizes["auto"][1] and sizes["fp8_e5m2"][1] == sizes["fp8"][1]
    for bad in ("int8", "fp8_e4m3fn", "float8"):
        with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
            EngineArgs(kv_cache_dtype=bad)


def test_speculative_decoding_over_a_float8_kv_cache(qwen3_5_mtp_path):
    """MTP speculative decoding with a float8 KV cache (the MTP layer's KV float8 too): its verify steps
    and drafts write and read the same float8 pool; the greedy tokens are the plain decode's on the same
    float8 KV cache, up to the float8 tolerance of ``test_engine_differential`` (a verify step computes a
    token's K/V in another batch shape than a decode step)."""
    from test_engine_differential import FP8_KV_TOL, compare_outputs

    prompts = [[5 + i, 9, 11, 13] * (6 + 3 * i) for i in range(4)]
    greedy = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}
    outs = {}
    for spec in (None, "mtp"):
        with Engine(qwen3_5_mtp_path, kv_cache_dtype="fp8", max_total_tokens=2048, max_state_slots=64,
                    speculative_algorithm=spec) as e:
            assert all(b.dtype == F8 for b in e.kv_pool.k_buffers)
            outs[spec] = e.generate(input_ids=prompts, sampling_params=greedy, return_logprob=True)
            e.check_integrity()
    assert compare_outputs(outs["mtp"], outs[None], FP8_KV_TOL) > 0.9 * 16 * len(prompts)


def test_fused_decode_over_a_float8_kv_cache(qwen3_5_short_path, monkeypatch):
    """Qwen3.5 (Gated DeltaNet and gated attention) through the fused decode step (on a CPU interpreted:
    the prologue kernel writing float8 K/V, the attention kernels reading them) == the PyTorch decode over
    the same float8 KV cache, two turns (the second from the prefix cache), within the float8 tolerance."""
    from test_engine_differential import FP8_KV_TOL, compare_outputs
    from test_fused_decode import _two_turns

    from hyla.model.ops.gpu import decode_attention

    if not GPU:  # two splits of each sequence's keys at most (test_fused_decode's few_splits)
        splits = decode_attention.num_splits
        monkeypatch.setattr(decode_attention, "num_splits", lambda *a, **k: min(2, splits(*a, **k)))
    opts = dict(device=DEVICE, kv_cache_dtype="fp8", max_total_tokens=2048, max_state_slots=32,
                max_running_requests=8, warmup="off")
    with Engine(qwen3_5_short_path, **opts) as default:  # GPU: fused; CPU: PyTorch
        a = _two_turns(default, None, 3)
        assert default.scheduler.runner.fused == GPU
    with Engine(qwen3_5_short_path, **opts) as other:
        b = _two_turns(other, fused=not GPU, requests=3)
        assert all(buf.dtype == F8 for buf in other.kv_pool.k_buffers)
    assert compare_outputs(a, b, FP8_KV_TOL) > 0.9 * sum(len(o["output_ids"]) for o in a)


@FLOAT8
def test_widened_is_pytorchs_cast_of_every_byte(f8):
    """``attention.widened`` (the CPU's table of the 256 bytes' values) == PyTorch's cast, for every byte
    (the NaN codes too) and every dtype a pool is read in; other dtypes pass through ``.to``."""
    from hyla.model.ops.attention import widened

    every = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(f8).view(4, 4, 16)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        got, ref = widened(every, dtype), every.to(dtype)
        assert got.dtype == dtype and got.shape == ref.shape
        assert torch.equal(got.view(-1)[~ref.view(-1).isnan()], ref.view(-1)[~ref.view(-1).isnan()])
        assert torch.equal(got.isnan(), ref.isnan())
    x = torch.randn(3, 5)
    assert torch.equal(widened(x.bfloat16(), torch.float32), x.bfloat16().float())


def test_float8_needs_compute_capability_8_9_on_cuda(monkeypatch):
    """Triton has float8 e4m3 from compute capability 8.9 (Ada, Hopper), e5m2 from 8.0: on an older GPU a float8 KV
    cache, ``fp8_weights="keep"`` and ``quantization="fp8"`` are a ``ValueError`` at start-up naming them (not a
    compile error in the first step), and ``fp8_weights="auto"`` dequantizes an FP8 checkpoint instead."""
    from types import SimpleNamespace

    from hyla.model.ops import gpu as gpu_ops

    capability = {"value": (8, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability["value"])
    cuda = torch.device("cuda")
    assert not gpu_ops.float8_supported(cuda) and gpu_ops.float8_supported("cpu")
    for opts, named in ((dict(kv_cache_dtype="fp8"), "kv_cache_dtype='fp8'"),
                        (dict(fp8_weights="keep"), "fp8_weights='keep'"),
                        (dict(quantization="fp8"), "quantization='fp8'")):
        with pytest.raises(ValueError, match=f"compute capability 8.0.*{named} needs 8.9"):
            Engine._check_float8(SimpleNamespace(device=cuda, args=EngineArgs(**opts)))
    e5m2 = SimpleNamespace(device=cuda, args=EngineArgs(kv_cache_dtype="fp8_e5m2"))
    Engine._check_float8(e5m2)  # e5m2: from 8.0 (an A100)
    capability["value"] = (7, 5)
    with pytest.raises(ValueError, match="compute capability 7.5.*kv_cache_dtype='fp8_e5m2' needs 8.0"):
        Engine._check_float8(e5m2)
    capability["value"] = (8, 0)
    auto = SimpleNamespace(device=cuda, args=EngineArgs())
    Engine._check_float8(auto)
    assert not Engine.keeps_fp8.fget(auto)
    capability["value"] = (9, 0)
    assert Engine.keeps_fp8.fget(auto)
    Engine._check_float8(SimpleNamespace(device=cuda, args=EngineArgs(kv_cache_dtype="fp8", quantization="fp8")))


def test_draft_model_speculation_over_a_float8_kv_cache(qwen3_next_dense_path, qwen3_next_dense_draft_path):
    """A draft model's K/V live beside the target's on the same slots (the layout's companion): both float8,
    written by the draft's steps and the target's verify steps; the greedy tokens are the plain decode's over
    the same float8 KV cache, up to the float8 tolerance."""
    from test_engine_differential import FP8_KV_TOL, compare_outputs

    prompts = [[5 + i, 9, 11, 13, 7 + i] * (6 + 5 * i) for i in range(4)]
    greedy = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}
    outs = {}
    for spec in (None, "draft"):
        extra = dict(speculative_algorithm="draft", speculative_draft_model_path=str(qwen3_next_dense_draft_path),
                     speculative_num_steps=3) if spec else {}
        with Engine(qwen3_next_dense_path, kv_cache_dtype="fp8", max_total_tokens=4096, max_state_slots=96,
                    **extra) as e:
            assert all(b.dtype == F8 for b in (*e.kv_pool.k_buffers, *e.kv_pool.v_buffers))
            assert len(e.kv_pool.k_buffers) == e.model_config.num_attention_layers + (
                e.draft_model.config.num_attention_layers if spec else 0)
            outs[spec] = e.generate(input_ids=prompts, sampling_params=greedy, return_logprob=True)
            e.check_integrity()
    assert compare_outputs(outs["draft"], outs[None], FP8_KV_TOL) > 0.9 * 16 * len(prompts)
