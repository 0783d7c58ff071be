"""Mamba1's Triton kernels (``hyla/model/ops/gpu/selective_scan.py``: Jamba's SSM layers on a GPU)
against the PyTorch ops they replace (``hyla/model/ops/selective_scan.py``), and Jamba's layer
through them.

Without a GPU the kernels run in Triton's interpreter on CPU tensors (``TRITON_INTERPRET=1``, set
before any kernel is defined, as ``test_fused_decode`` does); on a GPU they run for real, bf16 too.
"""

from __future__ import annotations

import itertools
import os

import pytest
import torch
import torch.nn.functional as F

GPU = torch.cuda.is_available()
if not GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before hyla.model.ops.gpu defines its kernels
DEVICE = "cuda" if GPU else "cpu"

pytest.importorskip("triton")

from hyla.model.ops.gpu import selective_scan as kernels  # noqa: E402
from hyla.model.ops.gpu.segment_checkpoints import SegmentCheckpoints  # noqa: E402
from hyla.model.ops.selective_scan import selective_scan_varlen, selective_state_update  # noqa: E402
from hyla.model.ops.gpu import fla_chunk  # noqa: E402
from hyla.model.ops.varlen import VarlenPlan  # noqa: E402
from test_fused_decode import _chain_reference, _tol  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16] if GPU else [torch.float32]
I, N = 40, 16  # channels (two blocks of the decode kernel's 32 below, the second partial), state size


def _inputs(g: torch.Generator, rows: int, dtype: torch.dtype):
    """A Mamba1 layer's scan inputs as it passes them: ``x`` and the gate ``z`` strided splits of one
    projection, raw ``dt``, ``B`` and ``C`` splits of another; fp32 ``A [I, N] < 0``, ``D``, dt bias."""
    rnd = lambda *shape: torch.randn(*shape, generator=g).to(DEVICE)  # noqa: E731
    proj = rnd(rows, 2 * I + 3).to(dtype)
    bc = rnd(rows, 2 * N + 5).to(dtype)
    x, z, B, C = proj[:, :I], proj[:, I:2 * I], bc[:, :N], bc[:, N:2 * N]
    dt = (rnd(rows, I) - 1).to(dtype)
    A = -torch.exp(rnd(I, N) * 0.5)
    return x, dt, z, B, C, A, rnd(I), rnd(I)


def _gated(y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """The layer's gate on the reference's output, as ``Mamba1Mixer`` applies it."""
    return (y.float() * F.silu(z.float())).to(y.dtype)


@pytest.fixture
def small_tiles(monkeypatch):
    """Blocks of 32 channels: two programs a sequence over the 40 channels, the second partial."""
    monkeypatch.setattr(kernels, "DECODE_TILES", (32, 4))
    monkeypatch.setattr(kernels, "SEGMENT_TILES", (32, 2))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gate", [True, False])
def test_decode_kernel(dtype, gate, small_tiles):
    """A decode step == ``selective_state_update`` (then the layer's gate): outputs, the pool updated
    in place at the slots; a padding row (slot -1) writes nothing. Run twice: the second step
    continues from the first's states."""
    g = torch.Generator().manual_seed(3)
    pool = torch.randn(6, I, N, generator=g).to(DEVICE)
    ref_pool = pool.clone()
    slots = torch.tensor([2, -1, 4], device=DEVICE)
    for _ in range(2):
        x, dt, z, B, C, A, D, dt_bias = _inputs(g, 3, dtype)
        y = kernels.selective_state_update_fused(x, dt, A, B, C, D, dt_bias, pool, slots, z if gate else None)
        ref = selective_state_update(x, dt, A, B, C, D, dt_bias, ref_pool, slots)
        ref = _gated(ref, z) if gate else ref
        assert y.dtype == dtype and y.shape == (3, I)
        torch.testing.assert_close(y[[0, 2]].float(), ref[[0, 2]].float(), atol=_tol(dtype), rtol=_tol(dtype))
        torch.testing.assert_close(pool, ref_pool, atol=1e-5, rtol=1e-5)
    assert not torch.equal(pool[2], torch.randn(6, I, N, generator=torch.Generator().manual_seed(3))[2].to(DEVICE))


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_kernel_runs_chains(dtype, small_tiles):
    """A verify step's chains in one launch (``chain [W+1, S]``: token ``j`` of sequence ``i`` reads
    its state at ``chain[j, i]`` and writes it at ``chain[j + 1, i]``) == the reference token by
    token; a padded sequence (-1 throughout) reads and writes nothing."""
    g = torch.Generator().manual_seed(5)
    seqs, w = 2, 3
    chain = torch.tensor([[2, -1], [5, -1], [1, -1], [2, -1]], device=DEVICE)  # own row 2, scratch 5, 1
    x, dt, z, B, C, A, D, dt_bias = _inputs(g, seqs * w, dtype)
    pool = torch.randn(6, I, N, generator=g).to(DEVICE)
    ref_pool = pool.clone()
    y = kernels.selective_state_update_fused(x, dt, A, B, C, D, dt_bias, pool, chain[0], z, chain=chain)
    col = lambda t, j: t.view(seqs, w, *t.shape[1:])[:, j]  # noqa: E731  (column j's rows, strided)
    ref = _chain_reference(ref_pool, chain, lambda j, slots: _gated(selective_state_update(
        col(x, j), col(dt, j), A, col(B, j), col(C, j), D, dt_bias, ref_pool, slots), col(z, j)))
    torch.testing.assert_close(y.view(seqs, w, I)[0].float(), ref[0].float(), atol=_tol(dtype), rtol=_tol(dtype))
    torch.testing.assert_close(pool, ref_pool, atol=1e-5, rtol=1e-5)


LENGTHS = [0, 1, 5, 23]  # an empty segment, a one-token one, two longer
# checkpoints per segment (tokens, pool row): after the first token, inside, at the end
MARKS = {1: [(1, 6)], 2: [(2, 7), (5, 8)], 3: [(1, 9), (11, 10), (23, 11)]}


@pytest.mark.parametrize("dtype", DTYPES)
def test_segments_kernel(dtype, small_tiles):
    """An extend's segments in one launch == ``selective_scan_varlen`` (the PyTorch op, in chunks of
    16 tokens and token by token) on the same sequences: outputs (gated), final states in their rows
    (given in another order than the segments'), and the checkpoints written on the way."""
    g = torch.Generator().manual_seed(9)
    t = sum(LENGTHS)
    x, dt, z, B, C, A, D, dt_bias = _inputs(g, t, dtype)
    cu = torch.tensor([0, *itertools.accumulate(LENGTHS)], device=DEVICE)
    rows = torch.tensor([3, 0, 4, 1], device=DEVICE)
    marks = [MARKS.get(i, []) for i in range(len(LENGTHS))]
    offsets = torch.tensor(list(itertools.accumulate(map(len, marks), initial=0)), device=DEVICE)
    pos = torch.tensor([q for m in marks for q, _ in m], device=DEVICE)
    slot = torch.tensor([r for m in marks for _, r in m], device=DEVICE)
    pool = torch.randn(13, I, N, generator=g).to(DEVICE)
    ref_pool = pool.clone()
    out = torch.full((t, I), float("nan"), dtype=dtype, device=DEVICE)
    kernels.selective_scan_segments_fused(x, dt, A, B, C, D, dt_bias, pool, rows, cu[:-1], cu, out, z,
                                          SegmentCheckpoints(pool, offsets, pos, slot))
    seq = torch.tensor([i for i, m in enumerate(marks) for _ in m], device=DEVICE)
    ref = selective_scan_varlen(x, dt, A, B, C, D, dt_bias, cu, ref_pool, rows, ckpt_seq=seq, ckpt_len=pos,
                                ckpt_slot=slot)
    torch.testing.assert_close(out.float(), _gated(ref, z).float(), atol=_tol(dtype), rtol=_tol(dtype))
    torch.testing.assert_close(pool, ref_pool, atol=1e-5, rtol=1e-5)
    assert not torch.equal(pool[6:12], torch.randn(13, I, N, generator=torch.Generator().manual_seed(9))[6:12])
    with pytest.raises(ValueError, match="out must be"):
        kernels.selective_scan_segments_fused(x, dt, A, B, C, D, dt_bias, pool, rows, cu[:-1], cu, out[:, :4], z)
    with pytest.raises(ValueError, match="unit column stride"):
        kernels.selective_state_update_fused(x.t().contiguous().t(), dt, A, B, C, D, dt_bias, pool, rows[:0], z)


@pytest.mark.parametrize("shared", [False, True])
def test_extend_of_a_batch(shared, small_tiles):
    """A GPU extend step's scan (``selective_scan_extend_fused``, on the batch's ``VarlenPlan``) ==
    the PyTorch op: sequences from their slots (one from zeros, slot -1), checkpoints inside them,
    fp32. Whole sequences in one launch; with two checkpoints of a sequence at one position
    (``shared``) the plan has no single pass, and the segments run in rounds cut at the checkpoints."""
    g = torch.Generator().manual_seed(13)
    lengths = [7, 20, 3]
    t = sum(lengths)
    x, dt, z, B, C, A, D, dt_bias = _inputs(g, t, torch.float32)
    slots = [4, 2, -1]
    ckpts = [(0, 3, 6), (1, 9, 7), (1, 20, 8)] + ([(1, 9, 9)] if shared else [])  # (sequence, tokens, row)
    pool = torch.randn(10, I, N, generator=g).to(DEVICE)
    ref_pool = pool.clone()
    seq, num, row = (torch.tensor(v, device=DEVICE) for v in zip(*ckpts))
    cu = torch.tensor([0, *itertools.accumulate(lengths)], device=DEVICE)
    slots = torch.tensor(slots, device=DEVICE)
    varlen = VarlenPlan.from_tensors(cu, t, slots, pool, seq, num, row, pool.device)

    assert (fla_chunk.single_pass(varlen, pool.device, bounded=False) is None) == shared
    y = kernels.selective_scan_extend_fused(x, dt, A, B, C, D, dt_bias, pool, varlen, z)
    ref = selective_scan_varlen(x, dt, A, B, C, D, dt_bias, cu, ref_pool, slots, ckpt_seq=seq, ckpt_len=num,
                                ckpt_slot=row)
    torch.testing.assert_close(y, _gated(ref, z), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pool, ref_pool, atol=1e-5, rtol=1e-5)


def test_jamba_extends_run_the_segments_kernel(jamba_short_path, monkeypatch):
    """Jamba's extend steps as a GPU runs their scan (``Mamba1Mixer``: the segments kernel over the
    batch's sequences, whole sequences in one launch, checkpoints written on the way; here
    interpreted, the rest of the model on the PyTorch ops) == the PyTorch extend: fp32, prefix cache
    on, greedy tokens and logprobs within 1e-4 up to a tie. Three waves: fresh prompts (half of them
    after a shared system prompt), then each prompt again (a hit at the checkpoint its prefill wrote,
    one token before its end) with the first wave's requests continued (their finished states) in one
    batch, then the continued conversations again."""
    from hyla import Engine
    from hyla.model import jamba
    from test_engine_differential import compare_outputs
    from test_fused_decode import _generate, _workload

    def waves(engine: Engine) -> list[dict]:
        wave = _workload(0, engine.model_config.vocab_size, requests=4)
        out = _generate(engine, wave)
        again = [dict(w, max_new=2) for w in wave] + [{"ids": w["ids"] + o["output_ids"] + [5, 6, 7], "max_new": 2}
                                                       for w, o in zip(wave, out)]
        out += _generate(engine, again)
        out += _generate(engine, [dict(w, max_new=1) for w in again[4:]])
        engine.wait_idle()
        engine.check_integrity()
        return out

    opts = dict(device=DEVICE, max_total_tokens=2048, max_state_slots=32, max_running_requests=8, warmup="off")
    with Engine(jamba_short_path, **opts) as plain:
        ref = waves(plain)
    launches = []
    run = kernels.selective_scan_segments_fused
    monkeypatch.setattr(kernels, "selective_scan_segments_fused",
                        lambda *args, **kw: launches.append((args[8].shape[0], args[13])) or run(*args, **kw))
    monkeypatch.setattr(jamba, "on_gpu", lambda x: True)  # the scan's GPU path (the layer's only kernel here)
    with Engine(jamba_short_path, **opts) as eng:
        out = waves(eng)
        assert sum(o["meta_info"]["cached_tokens"] for o in out[4:8]) > 0  # the prompts again: checkpoint hits
    assert max(n for n, _ in launches) > 1  # batches of several sequences in one launch
    assert any(ckpts is not None and ckpts.pos.numel() for _, ckpts in launches)  # checkpoints on the way
    assert compare_outputs(out, ref) > 0.9 * sum(len(o["output_ids"]) for o in ref)


def test_segments_kernels_never_specialize_on_their_index_offsets(monkeypatch):
    """The recurrent segments kernels (Gated DeltaNet's, Mamba2's, Mamba1's, KDA's) launched with their
    index tensors (rows, starts, cu_seqlens, the checkpoints') as views at odd offsets of one buffer —
    what a GPU's packed host-to-device copy hands them, at offsets that follow the batch — compile
    nothing a launch with fresh tensors did not (``segment_checkpoints.INDEX_ARGS``)."""
    from compile_keys import record_compile_keys
    from hyla.model.ops.gpu import gated_delta_decode, kda_decode, mamba2_decode

    g = torch.Generator().manual_seed(1)
    rnd = lambda *shape: torch.randn(*shape, generator=g).to(DEVICE)  # noqa: E731
    t, h, d = 6, 2, 16
    pool = rnd(6, h, d, d)
    calls = {  # name -> run(rows, starts, cu, ckpts)
        "gated_delta": lambda *ix: gated_delta_decode.gated_delta_segments_fused(
            rnd(t, 3 * h * d), rnd(t, h), rnd(t, h), rnd(h), rnd(h), pool, *ix[:3], torch.empty(t, h, d), h, d,
            SegmentCheckpoints(pool, *ix[3:])),
        "mamba2": lambda *ix: mamba2_decode.mamba2_segments_fused(
            rnd(t, h * d), rnd(t, h), -torch.rand(h, generator=g), rnd(t, 16), rnd(t, 16), rnd(h), rnd(h),
            pool.view(6, h, d, d)[:, :, :, :16].contiguous(), *ix[:3], torch.empty(t, h, d), None, None),
        "mamba1": lambda *ix: kernels.selective_scan_segments_fused(
            *_inputs(g, t, torch.float32)[:2], -torch.rand(I, N, generator=g), rnd(t, N), rnd(t, N), rnd(I), rnd(I),
            rnd(6, I, N), *ix[:3], torch.empty(t, I), None, SegmentCheckpoints(rnd(6, I, N), *ix[3:])),
        "kda": lambda *ix: kda_decode.kda_segments_fused(
            rnd(t, 3 * h * d), rnd(t, h * d), rnd(t, h), rnd(h), rnd(h * d), pool, *ix[:3], torch.empty(t, h, d),
            SegmentCheckpoints(pool, *ix[3:])),
    }
    values = ([1, 2], [0, 2], [0, 2, 6], [0, 1, 1], [1], [4])  # rows, starts, cu, ckpt offsets, pos, slot
    keys = record_compile_keys(monkeypatch)
    for run in calls.values():
        run(*(torch.tensor(v, device=DEVICE) for v in values))
    keys.mark()
    for run in calls.values():  # each index tensor 1 element into a buffer of its own (8 bytes: unaligned)
        run(*(torch.tensor([0, *v], device=DEVICE)[1:] for v in values))
    keys.assert_no_new_variants()
