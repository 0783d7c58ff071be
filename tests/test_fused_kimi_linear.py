"""Kimi-Linear's decode kernels (``hyla/model/ops/gpu/kda_decode.py``: Kimi Delta Attention's step;
``latent_attention.py``: MLA over the latents in the pool) against the PyTorch ops they replace
(``ops/kda.py``'s ``recurrent_kda_update`` with the layer's gates; ``kimi_linear.latent_paged_attention``).
The engine runs them in ``test_fused_decode`` (the fused decode step and verify chains).

Without a GPU the kernels run in Triton's interpreter on CPU tensors (``TRITON_INTERPRET=1``, set
before any kernel is defined, as ``test_fused_decode`` does); on a GPU they run for real, bf16 too.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

GPU = torch.cuda.is_available()
if not GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before hyla.model.ops.gpu defines its kernels
DEVICE = "cuda" if GPU else "cpu"

pytest.importorskip("triton")

from hyla.model.kimi_linear import latent_paged_attention, write_latents  # noqa: E402
from hyla.model.ops.gpu import kda_decode  # noqa: E402
from hyla.model.ops.gpu.latent_attention import paged_latent_decode_attention  # noqa: E402
from hyla.model.ops.kda import DecayGate, recurrent_kda_update  # noqa: E402
from test_fused_decode import _chain_reference, _tol  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16] if GPU else [torch.float32]
H, D = 3, 16  # KDA heads of D x D


def _kda_inputs(g: torch.Generator, rows: int, dtype: torch.dtype):
    """A KDA layer's decode inputs as it passes them: the conv output ``qkv [R, 3HD]`` (strided rows),
    the raw decay input ``f [R, HD]`` and gate ``b [R, H]``; ``a_log [H]``, ``dt_bias [HD]`` fp32."""
    rnd = lambda *shape: torch.randn(*shape, generator=g).to(DEVICE)  # noqa: E731
    qkv = rnd(rows, 3 * H * D + 5).to(dtype)[:, :3 * H * D]
    return qkv, rnd(rows, H * D).to(dtype), rnd(rows, H).to(dtype), rnd(H), rnd(H * D)


def _kda_reference(qkv, f, b, a_log, dt_bias, pool, slots, gate=DecayGate()):
    """The layer's PyTorch decode: its gates (``KimiDeltaAttention.forward``: the layer's ``DecayGate``,
    Kimi-Linear's softplus decay or Ling 3's), then ``recurrent_kda_update``."""
    rows = qkv.shape[0]
    q, k, v = (t.reshape(rows, H, D) for t in qkv.split(H * D, dim=-1))
    return recurrent_kda_update(q, k, v, gate(f, a_log, dt_bias, H), torch.sigmoid(b), pool, slots)


# Kimi-Linear's decay; Ling 3's bounded one and its softplus form (F.softplus; both rounded to the model dtype)
GATES = [pytest.param(DecayGate(), id="kimi"), pytest.param(DecayGate(-5.0, True), id="ling-bounded"),
         pytest.param(DecayGate(0.0, True), id="ling-softplus")]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gate", GATES)
def test_kda_decode_kernel(dtype, gate, monkeypatch):
    """A decode step == the layer's gates (Kimi-Linear's softplus decay; Ling 3's bounded one) and
    ``recurrent_kda_update``: outputs and the pool updated in place at the slots (two blocks of value
    columns a head); a padding row (slot -1) writes nothing. Run twice: the second step continues from
    the first's states. Bad shapes and a positive bound are refused."""
    monkeypatch.setattr(kda_decode, "DECODE_TILES", (8, 4))  # two blocks of the 16 value columns
    g = torch.Generator().manual_seed(2)
    pool = torch.randn(6, H, D, D, generator=g).to(DEVICE)
    ref_pool = pool.clone()
    slots = torch.tensor([4, -1, 1], device=DEVICE)
    for _ in range(2):
        qkv, f, b, a_log, dt_bias = _kda_inputs(g, 3, dtype)
        o = kda_decode.kda_decode_fused(qkv, f, b, a_log, dt_bias, pool, slots, gate=gate)
        ref = _kda_reference(qkv, f, b, a_log, dt_bias, ref_pool, slots, gate)
        assert o.shape == (3, H, D) and o.dtype == dtype
        torch.testing.assert_close(o[[0, 2]].float(), ref[[0, 2]].float(), atol=_tol(dtype), rtol=_tol(dtype))
        torch.testing.assert_close(pool, ref_pool, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="must fit"):
        kda_decode.kda_decode_fused(qkv, f[:, :-1], b, a_log, dt_bias, pool, slots)
    with pytest.raises(ValueError, match="unit column stride"):
        kda_decode.kda_decode_fused(qkv, f.t().contiguous().t(), b, a_log, dt_bias, pool, slots)
    with pytest.raises(ValueError, match="lower bound must be finite and <= 0"):
        kda_decode.kda_decode_fused(qkv, f, b, a_log, dt_bias, pool, slots, gate=DecayGate(1.0))


@pytest.mark.parametrize("dtype", DTYPES)
def test_kda_decode_kernel_runs_chains(dtype):
    """A verify step's chains in one launch (``chain [W+1, S]``: token ``j`` of sequence ``i`` reads its
    state at ``chain[j, i]`` and writes it at ``chain[j + 1, i]``) == the reference token by token; a
    padded sequence (-1 throughout) reads and writes nothing."""
    g = torch.Generator().manual_seed(4)
    seqs, w = 2, 3
    chain = torch.tensor([[2, -1], [5, -1], [1, -1], [2, -1]], device=DEVICE)  # own row 2, scratch 5, 1
    qkv, f, b, a_log, dt_bias = _kda_inputs(g, seqs * w, dtype)
    pool = torch.randn(6, H, D, D, generator=g).to(DEVICE)
    ref_pool = pool.clone()
    o = kda_decode.kda_decode_fused(qkv, f, b, a_log, dt_bias, pool, chain[0], chain=chain)
    col = lambda t, j: t.view(seqs, w, *t.shape[1:])[:, j]  # noqa: E731  (column j's rows, strided)
    ref = _chain_reference(ref_pool, chain, lambda j, slots: _kda_reference(
        col(qkv, j), col(f, j), col(b, j), a_log, dt_bias, ref_pool, slots))
    torch.testing.assert_close(o.view(seqs, w, H, D)[0].float(), ref[0].float(), atol=_tol(dtype), rtol=_tol(dtype))
    torch.testing.assert_close(pool, ref_pool, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [1, 3])
def test_kda_conv_decode_kernel(dtype, width, monkeypatch):
    """The conv and the KDA step in one kernel (``kda_conv_decode_fused``) == the conv kernel then
    ``kda_decode_fused``, bitwise (outputs, SSM states, conv windows): a decode step (``width`` 1, in
    place; one padding sequence) and a verify step's chains of 3 tokens. Two blocks of value columns a
    head: two programs read each head's q/k windows, the last writes them. Run twice: the tickets come
    back zeroed, the second step continues from the first's states. The chains run Ling 3's bounded decay."""
    from hyla.model.ops.gpu.conv1d_decode import causal_conv1d_update_fused

    monkeypatch.setattr(kda_decode, "DECODE_TILES", (8, 4))  # two blocks of the 16 value columns
    g = torch.Generator().manual_seed(12)
    seqs, c = 3, 3 * H * D
    if width == 1:
        chain = torch.tensor([[2, -1, 4], [2, -1, 4]], device=DEVICE)  # in place; the second a padding row
    else:
        chain = torch.tensor([[2, -1, 4], [5, -1, 6], [1, -1, 3], [2, -1, 4]], device=DEVICE)
    chained = chain if width > 1 else None
    x, f, b, a_log, dt_bias = _kda_inputs(g, seqs * width, dtype)  # x: the raw projection, strided rows
    wt = torch.randn(c, 4, generator=g).to(DEVICE, dtype)
    conv, ssm = torch.randn(8, c, 3, generator=g).to(DEVICE, dtype), torch.randn(8, H, D, D, generator=g).to(DEVICE)
    ref_conv, ref_ssm = conv.clone(), ssm.clone()
    tickets = torch.zeros(seqs * H, dtype=torch.int32, device=DEVICE)
    live = [r for r in range(seqs * width) if r // width != 1]
    gate = DecayGate(-5.0, True) if width > 1 else DecayGate()
    for step in range(2):
        o = kda_decode.kda_conv_decode_fused(x, wt, conv, tickets, f, b, a_log, dt_bias, ssm, chain[0], chain=chained,
                                             gate=gate)
        mixed = causal_conv1d_update_fused(x, wt, None, ref_conv, chain[0], "silu", chain=chained)
        ref = kda_decode.kda_decode_fused(mixed, f, b, a_log, dt_bias, ref_ssm, chain[0], chain=chained, gate=gate)
        assert torch.equal(o[live], ref[live]), f"step {step}"
        assert torch.equal(ssm, ref_ssm) and torch.equal(conv, ref_conv), f"step {step}"
        assert not tickets.any()
    with pytest.raises(ValueError, match="4 wide"):
        kda_decode.kda_conv_decode_fused(x, wt[:, :3].contiguous(), conv[:, :, :2].contiguous(), tickets, f, b, a_log,
                                         dt_bias, ssm, chain[0], chain=chained)
    with pytest.raises(ValueError, match="tickets"):
        kda_decode.kda_conv_decode_fused(x, wt, conv, tickets[:1], f, b, a_log, dt_bias, ssm, chain[0], chain=chained)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("splits", [None, 1, 4])
def test_latent_decode_attention_kernel(dtype, splits):
    """MLA's decode attention over the request table == ``latent_paged_attention``'s decode path:
    20 heads (two blocks of 16, the second partial), an odd latent of 49 (halves of 25, the V half
    zero-padded), values spanning both halves (40 channels), contexts of 1, 5, 21 and 40 tokens over
    scattered slots, the new tokens' latents written first (``write_latents``, as the layer does)."""
    g = torch.Generator().manual_seed(8)
    heads, rank, rope = 20, 40, 9
    width, half = rank + rope, (rank + rope + 1) // 2
    prefix = [0, 4, 20, 39]
    b, slots_total = len(prefix), 96
    rnd = lambda *shape: torch.randn(*shape, generator=g).to(DEVICE)  # noqa: E731
    kb, vb = rnd(slots_total, 1, half).to(dtype), rnd(slots_total, 1, half).to(dtype)
    write_latents(rnd(slots_total, width).to(dtype), kb, vb, torch.arange(slots_total, device=DEVICE))  # the cache
    perm = torch.randperm(slots_total - 1, generator=g).to(DEVICE) + 1  # (slot 0: the padding sentinel)
    table = torch.zeros(b + 2, 64, dtype=torch.long, device=DEVICE)
    seqs, used = [], 0
    for i, n in enumerate(prefix):
        seqs.append(perm[used:used + n + 1])  # its cached tokens' slots, then the new token's
        table[i + 2, :n + 1] = seqs[-1]
        used += n + 1
    q = rnd(b, heads, width + 3).to(dtype)[:, :, :width].contiguous()
    latent = rnd(b, width).to(dtype)  # the new tokens'
    loc = torch.stack([s[-1] for s in seqs])
    ref_k, ref_v = kb.clone(), vb.clone()
    indptr = torch.tensor([0, *torch.tensor([n + 1 for n in prefix]).cumsum(0).tolist()], device=DEVICE)
    ref = latent_paged_attention(q, latent, ref_k, ref_v, loc, torch.cat(seqs), indptr, prefix, [1] * b, 0.2, rank)
    write_latents(latent, kb, vb, loc)
    out = paged_latent_decode_attention(q, kb, vb, table, torch.arange(2, b + 2, device=DEVICE),
                                        torch.tensor([n + 1 for n in prefix], device=DEVICE), 0.2, rank, splits=splits)
    assert out.shape == (b, heads, rank) and torch.equal(kb, ref_k) and torch.equal(vb, ref_v)
    torch.testing.assert_close(out.float(), ref.float(), atol=_tol(dtype), rtol=_tol(dtype))
    with pytest.raises(ValueError, match="do not fit"):
        paged_latent_decode_attention(q, kb[:, :, :20].contiguous(), vb[:, :, :20].contiguous(), table,
                                      torch.arange(2, b + 2, device=DEVICE), loc, 0.2, rank)


def test_latent_decode_attention_is_not_the_other_half():
    """The kernel's scores use both halves of the latent and its values both halves too: zeroing the
    pool's V half (the latent's second half) changes the output (a kernel reading only the K buffer
    would pass the test above only by chance: this guards the two accumulators)."""
    g = torch.Generator().manual_seed(1)
    heads, width, half = 16, 40, 20
    kb = torch.randn(8, 1, half, generator=g).to(DEVICE)
    vb = torch.randn(8, 1, half, generator=g).to(DEVICE)
    table = torch.arange(8, device=DEVICE).view(1, 8)
    q = torch.randn(1, heads, width, generator=g).to(DEVICE)
    args = (table, torch.zeros(1, dtype=torch.long, device=DEVICE), torch.tensor([8], device=DEVICE), 0.3, width)
    full = paged_latent_decode_attention(q, kb, vb, *args)
    keys = torch.cat([kb, vb], dim=-1)[:, 0]  # [8, 40]
    torch.testing.assert_close(full[0], F.softmax(0.3 * q[0] @ keys.T, dim=-1) @ keys, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(full, paged_latent_decode_attention(q, kb, torch.zeros_like(vb), *args))


LENGTHS = [0, 1, 6, 19]  # an empty segment, a one-token one, two longer
MARKS = {1: [(1, 6)], 2: [(2, 7), (6, 8)], 3: [(1, 9), (11, 10), (19, 11)]}  # (tokens, pool row) per segment


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gate", GATES[:2])
def test_kda_segments_kernel(dtype, gate):
    """An extend's segments in one launch (``kda_segments_fused``) == the layer's decode step token by
    token: outputs, final states in their rows (given in another order than the segments'), and the
    checkpoints written on the way (after a segment's first token, inside, at its end); the softplus and
    the bounded decay."""
    from hyla.model.ops.gpu.segment_checkpoints import SegmentCheckpoints

    g = torch.Generator().manual_seed(6)
    t = sum(LENGTHS)
    qkv, f, b, a_log, dt_bias = _kda_inputs(g, t, dtype)
    rows = [3, 0, 4, 1]
    marks = [MARKS.get(i, []) for i in range(len(LENGTHS))]
    cu = [0, *torch.tensor(LENGTHS).cumsum(0).tolist()]
    pool = torch.randn(13, H, D, D, generator=g).to(DEVICE)
    ref_pool, ref_out = pool.clone(), []
    for i, (start, n) in enumerate(zip(cu, LENGTHS)):  # the reference: decode steps, checkpoints copied
        slot = torch.tensor([rows[i]], device=DEVICE)
        for j in range(start, start + n):
            ref_out.append(_kda_reference(qkv[j:j + 1], f[j:j + 1], b[j:j + 1], a_log, dt_bias, ref_pool, slot,
                                          gate)[0])
            for pos, row in marks[i]:
                if j - start + 1 == pos:
                    ref_pool[row] = ref_pool[rows[i]]
    out = torch.full((t, H, D), float("nan"), dtype=dtype, device=DEVICE)
    long = lambda v: torch.tensor(v, device=DEVICE)  # noqa: E731
    ckpts = SegmentCheckpoints(pool, long([0, *torch.tensor([len(m) for m in marks]).cumsum(0).tolist()]),
                               long([q for m in marks for q, _ in m]), long([r for m in marks for _, r in m]))
    kda_decode.kda_segments_fused(qkv, f, b, a_log, dt_bias, pool, long(rows), long(cu[:-1]), long(cu), out, ckpts,
                                  gate=gate)
    torch.testing.assert_close(out.float(), torch.stack(ref_out).float(), atol=_tol(dtype), rtol=_tol(dtype))
    torch.testing.assert_close(pool, ref_pool, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads, splits", [(4, None), (20, None), (4, 1)])
def test_latent_extend_attention_kernel(dtype, heads, splits):
    """MLA's causal extend attention of one sequence's new tokens over the request table (a fused
    extend's) == ``latent_paged_attention``'s extend path: 7 new tokens after a 23-token cached prefix,
    an odd latent (49: halves of 25), values spanning both halves; 4 heads (a tile of 4 tokens, each
    seeing only its own keys) or 20 (blocks of 16 heads, a token a tile); split keys merged by stage 2,
    or one split writing the output directly."""
    from hyla.model.ops.gpu.latent_attention import paged_latent_extend_attention

    g = torch.Generator().manual_seed(12)
    rank, rope = 40, 9
    width, half = rank + rope, (rank + rope + 1) // 2
    prefix, new = 23, 7
    rnd = lambda *shape: torch.randn(*shape, generator=g).to(DEVICE)  # noqa: E731
    kb, vb = rnd(64, 1, half).to(dtype), rnd(64, 1, half).to(dtype)
    write_latents(rnd(64, width).to(dtype), kb, vb, torch.arange(64, device=DEVICE))
    slots = (torch.randperm(63, generator=g) + 1)[:prefix + new].to(DEVICE)
    table = torch.zeros(3, 48, dtype=torch.long, device=DEVICE)
    table[2, :prefix + new] = slots
    q = rnd(new, heads, width).to(dtype)
    latent = rnd(new, width).to(dtype)
    loc = slots[prefix:]
    ref_k, ref_v = kb.clone(), vb.clone()
    ref = latent_paged_attention(q, latent, ref_k, ref_v, loc, slots, torch.tensor([0, prefix + new], device=DEVICE),
                                 [prefix], [new], 0.2, rank)
    write_latents(latent, kb, vb, loc)
    lens = torch.arange(prefix + 1, prefix + new + 1, device=DEVICE)
    out = paged_latent_extend_attention(q, kb, vb, table, torch.tensor([2], device=DEVICE), lens, 0.2, rank,
                                        splits=splits)
    torch.testing.assert_close(out.float(), ref.float(), atol=_tol(dtype), rtol=_tol(dtype))
    with pytest.raises(ValueError, match="kv_lens"):
        paged_latent_extend_attention(q, kb, vb, table, torch.tensor([2], device=DEVICE), lens[:3], 0.2, rank)


def test_kimi_extends_run_the_latent_extend_kernel(kimi_linear_short_path, monkeypatch):
    """A CUDA extend's MLA (``kimi_linear.latent_extend_by_sequence``: the causal latent kernel, one
    launch a sequence, over its slots in ``kv_indices``; here interpreted, the rest on the PyTorch ops)
    == the PyTorch extend (gathered latents, SDPA): fp32, prefix cache on, greedy tokens and logprobs
    within 1e-4 up to a tie, over batched prompts, then their conversations continued from cached
    prefixes (the kernel reads cached latents). The second turn compiles no kernel variant the first
    did not (the sequences' offsets and lengths are data, not compile keys)."""
    from hyla import Engine
    from hyla.model import kimi_linear
    from hyla.model.ops.gpu import latent_attention
    from compile_keys import record_compile_keys
    from test_engine_differential import compare_outputs
    from test_fused_decode import _two_turns

    opts = dict(device=DEVICE, max_total_tokens=2048, max_state_slots=32, max_running_requests=8, warmup="off")
    with Engine(kimi_linear_short_path, **opts) as plain:
        ref = _two_turns(plain, None, requests=3)
    launches = []
    run = latent_attention.paged_latent_extend_attention
    monkeypatch.setattr(latent_attention, "paged_latent_extend_attention",
                        lambda q, kb, vb, table, row, lens, *a: launches.append((q.shape[0], int(lens.max())))
                        or run(q, kb, vb, table, row, lens, *a))
    monkeypatch.setattr(kimi_linear, "on_gpu", lambda x: True)  # MLA's CUDA extend (its only kernel here)
    with Engine(kimi_linear_short_path, **opts) as eng:
        out = _two_turns(eng, None, requests=3, keys=record_compile_keys(monkeypatch))
    assert any(keys > new for new, keys in launches)  # extends after a cached prefix
    assert compare_outputs(out, ref) > 0.9 * sum(len(o["output_ids"]) for o in ref)


def test_latent_extend_by_sequence_compiles_one_variant(monkeypatch):
    """``latent_extend_by_sequence``'s launches for one batch and then another, whose sequences start at
    other offsets of ``kv_indices`` and have other lengths (5 and 19 slots, then 1, 16 and 16: lengths a
    GPU launch specialises on), would compile nothing new on a
    GPU: the table is the whole ``kv_indices`` and the offsets are data (a table sliced per sequence
    specialised on its alignment and its length); and the outputs equal the PyTorch path's."""
    import itertools
    from types import SimpleNamespace

    from hyla.model import kimi_linear
    from compile_keys import record_compile_keys

    g = torch.Generator().manual_seed(3)
    heads, rank, width, half = 4, 24, 33, 17
    kb, vb = torch.randn(80, 1, half, generator=g).to(DEVICE), torch.randn(80, 1, half, generator=g).to(DEVICE)
    keys = record_compile_keys(monkeypatch)
    for prefix, extend in (([0, 3], [5, 16]), ([0, 1, 2], [1, 15, 14])):  # sequences of 5, 19; then 1, 16, 16
        starts = [0, *itertools.accumulate(p + n for p, n in zip(prefix, extend))]
        batch = SimpleNamespace(extend_lens=extend, prefix_lens=prefix, kv_starts=starts,
                                kv_indices=(torch.randperm(79, generator=g)[:starts[-1]] + 1).to(DEVICE))
        q = torch.randn(sum(extend), heads, width, generator=g).to(DEVICE)
        out = kimi_linear.latent_extend_by_sequence(q, kb, vb, batch, 0.3, rank)
        ref = kimi_linear.latent_paged_attention(  # (rewrites the new tokens' latents as they are)
            q, torch.cat([kb, vb], dim=-1)[batch.kv_indices, 0][[s for p, n, st in zip(prefix, extend, starts)
                                                                  for s in range(st + p, st + p + n)], :width],
            kb.clone(), vb.clone(), torch.cat([batch.kv_indices[st + p:st + p + n]
                                               for p, n, st in zip(prefix, extend, starts)]),
            batch.kv_indices, torch.tensor(starts, device=DEVICE), prefix, extend, 0.3, rank)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
        if keys.before is None:
            keys.mark()
    keys.assert_no_new_variants()
