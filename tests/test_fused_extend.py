"""The fused extend (``ForwardBatch.fused_extend``: one sequence's extend with every index on the
device, what ``CudaGraphExtend`` captures per token count) against the PyTorch extend.

Whole engines, prefix cache on: sequential requests (each prefill one sequence's extend), fresh and
with a cached prefix (restored from a checkpoint, the extend writing its end - 1 checkpoint), short
(the recurrent segment kernel) and long (the chunked one), padded to the token counts captured on a
GPU; the same greedy tokens and logprobs within 1e-4 in fp32. Without a GPU the kernels run in
Triton's interpreter on CPU tensors; on a GPU the ``gpu``-marked test replays the graphs.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

GPU = torch.cuda.is_available()
if not GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before hyla.model.ops.gpu defines its kernels
DEVICE = "cuda" if GPU else "cpu"

pytest.importorskip("triton")

from hyla import Engine  # noqa: E402
from hyla.engine.cuda_graph import CudaGraphExtend  # noqa: E402
from hyla.engine.model_runner import ModelRunner  # noqa: E402
from hyla.model.ops.attention import extend_sdpa  # noqa: E402
from hyla.model.ops.gpu.extend_attention import paged_extend_attention  # noqa: E402
from compile_keys import CompileKeys, record_compile_keys  # noqa: E402
from emulated_cuda_graphs import attach_graphs, emulate_cuda_graphs  # noqa: E402
from test_engine_differential import compare_outputs, join_stream  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16] if GPU else [torch.float32])
@pytest.mark.parametrize("hq, hkv, d, prefix, n, splits", [(8, 2, 32, 37, 21, None), (8, 2, 32, 0, 5, 4),
                                                           (4, 4, 16, 100, 70, 2), (16, 2, 64, 3, 40, None)])
def test_paged_extend_attention_kernel(dtype, hq, hkv, d, prefix, n, splits):
    """One sequence's new tokens over its prefix and themselves (causal), its slots scattered over
    the pool in row 2 of the request table; 6 padding tokens after them (one key each) that must
    stay finite; the output gate a strided view, as the layer passes it."""
    _check_extend_attention(dtype, hq, hkv, d, prefix, n, splits)


@pytest.mark.parametrize("tiles", [(128, 16, 4), (32, 64, 8), (16, 32, 2)])
def test_paged_extend_attention_tiles(tiles, monkeypatch):
    """Every tile the benchmark tries (``attention_tiles.py``: query rows, keys per step, warps)
    computes the same attention: a block of tokens shorter than the query heads, blocks of many."""
    from hyla.model.ops.gpu import extend_attention

    for name, value in zip(("TILE_ROWS", "TILE_KEYS", "NUM_WARPS"), tiles):
        monkeypatch.setattr(extend_attention, name, value)
    _check_extend_attention(torch.float32, 8, 2, 32, 37, 21, None)


def _check_extend_attention(dtype, hq, hkv, d, prefix, n, splits):
    g = torch.Generator().manual_seed(prefix + n)
    kb = torch.randn(300, hkv, d, generator=g).to(DEVICE, dtype)
    vb = torch.randn(300, hkv, d, generator=g).to(DEVICE, dtype)
    slots = torch.randperm(299, generator=g)[:prefix + n] + 1
    table = torch.zeros(4, 256, dtype=torch.int32)
    table[2, :prefix + n] = slots.int()
    q = torch.randn(n + 6, hq, d, generator=g).to(DEVICE, dtype)
    gate = torch.randn(n + 6, hq, 2 * d, generator=g).to(DEVICE, dtype)[:, :, d:]
    lens = torch.tensor([prefix + j + 1 for j in range(n)] + [1] * 6, device=DEVICE)
    o = paged_extend_attention(q, kb, vb, table.to(DEVICE), torch.tensor([2], device=DEVICE), lens, 0.3,
                               splits=splits, gate=gate)
    k, v = kb[slots.to(DEVICE)].transpose(0, 1), vb[slots.to(DEVICE)].transpose(0, 1)
    ref = extend_sdpa(q[:n].transpose(0, 1).float(), k.float(), v.float(), prefix, None, 0.3).transpose(0, 1)
    ref = ref * torch.sigmoid(gate[:n].float())
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(o[:n].float(), ref, atol=tol, rtol=tol)
    assert torch.isfinite(o).all()


def test_paged_extend_attention_refuses_bad_shapes():
    q = torch.zeros(5, 8, 16, device=DEVICE)
    kb = torch.zeros(10, 2, 16, device=DEVICE)
    table, row = torch.zeros(2, 8, dtype=torch.int32, device=DEVICE), torch.tensor([1], device=DEVICE)
    with pytest.raises(ValueError, match="kv_lens"):
        paged_extend_attention(q, kb, kb, table, row, torch.ones(4, dtype=torch.long, device=DEVICE), 1.0)
    with pytest.raises(ValueError, match="power of 2"):
        paged_extend_attention(q, kb, kb, table, row, torch.ones(5, dtype=torch.long, device=DEVICE), 1.0, splits=3)


def _turns(engine: Engine, seed: int, requests: int, fused_extend: int | None = None,
           keys: CompileKeys | None = None) -> list[dict]:
    """Two turns of ``requests`` requests, one request at a time (each prefill one sequence's
    extend): prompts of 3-70 tokens, half after a shared 37-token system prompt; turn 2 repeats each
    prompt, then extends each turn-1 conversation. ``fused_extend``: first swap in a fused runner whose single-sequence extends
    of up to that many tokens run as fused extends (CPU: interpreted, no graphs). ``keys``: turn 2
    compiles nothing turn 1 did not (``compile_keys``)."""
    if fused_extend is not None:
        _fused_runner(engine, fused_extend)
    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size
    system = [rng.randrange(3, vocab) for _ in range(37)]
    wave = [(system if i % 2 else []) + [rng.randrange(3, vocab) for _ in range(rng.randrange(3, 70))]
            for i in range(requests)]
    params = {"temperature": 0, "max_new_tokens": 1, "ignore_eos": True}  # extends only: no decode step
    outs = [engine.generate(input_ids=ids, return_logprob=True, sampling_params=params) for ids in wave]
    if keys is not None:
        keys.mark()
    # turn 2: each prompt again (its prefill's end - 1 checkpoint hit: a 1-token extend from it), then
    # the conversation continued (the finished turn's state hit)
    for ids, first in zip(wave, list(outs)):
        for again in (ids, ids + first["output_ids"] + [5, 6, 7]):
            outs.append(engine.generate(input_ids=again, return_logprob=True, sampling_params=params))
    engine.wait_idle()
    engine.check_integrity()
    if keys is not None:
        keys.assert_no_new_variants()
    return outs


@pytest.fixture
def few_splits(monkeypatch):
    """Interpreted (no GPU), attention splits each block's keys 2 ways at most, not the 32 that
    fill an H100 for one block of tokens, and MoE's grouped GEMM takes 128 columns a program (the
    interpreter runs the programs one by one; the kernel tests check the defaults)."""
    if not GPU:
        from hyla.model.ops.gpu import decode_attention, extend_attention, moe

        default = decode_attention.num_splits
        few = lambda *args, **kw: min(2, default(*args, **kw))  # noqa: E731
        monkeypatch.setattr(decode_attention, "num_splits", few)
        monkeypatch.setattr(extend_attention, "num_splits", few)
        monkeypatch.setattr(moe, "SMALL_TILES", (16, 128, 128, 4))
        monkeypatch.setattr(moe, "LARGE_TILES", (64, 128, 128, 4))


@pytest.mark.slow
# Interpreted in CI: Gated DeltaNet, Mamba2, and KDA + MLA beside MoE layers (their experts grouped as on a GPU).
# On a GPU only (CI's time: 20-35 s each interpreted): Qwen3.5-MoE (its experts: Kimi-Linear's grouped path here),
# Jamba (its Mamba1 segments kernel: test_jamba_extends_run_the_segments_kernel), LFM2 and LFM2-MoE (the short
# conv's extend kernels: test_conv1d_extend_kernel; the router runs in PyTorch on every path), Ling 3 (Kimi-Linear's
# kernels: the bounded decay checked kernel by kernel, MLA's RoPE in test_engine_fused_decode_matches_pytorch),
# OLMo-Hybrid (Qwen3.5's kernels: beta's scale checked kernel by kernel, its post-norm layers in
# test_engine_fused_decode_matches_pytorch), Lara-4-Mini (~10 s; the windowed extend kernel: LFM3's here, ~10 s),
# Zamba2 (~25 s; Bamba's kernels, its shared blocks in test_engine_fused_decode_matches_pytorch)
@pytest.mark.parametrize("arch", ["qwen3_5", "bamba", "kimi_linear", "lfm3", "minimax",
                                  *(pytest.param(a, marks=pytest.mark.gpu) for a in (
                                      "qwen3_5_moe", "jamba", "lfm2", "lfm2_moe", "bailing_hybrid", "olmo_hybrid",
                                      "lara_mini", "zamba2"))])
def test_engine_fused_extend_matches_pytorch(arch, request, monkeypatch, few_splits):
    """fp32, prefix cache on: single-sequence extends as fused extends (padded to the captured
    token counts, checkpoints written by the segment kernels, attention over the request table)
    == the PyTorch extend, token for token, logprobs within 1e-4 (Gated DeltaNet with attention:
    Qwen3.5; Mamba2 with attention: Bamba; Qwen3.5 with MoE layers, whose experts run grouped as on
    a GPU, ``moe.expert_gemm``: the CPU's PyTorch side sorts them by expert; Mamba1 with attention
    and MoE layers: Jamba; KDA and MLA: Kimi-Linear; LFM2's gated short conv; LFM2-MoE's, beside MoE
    layers whose sigmoid router runs in the model dtype, biased, renormalised with +1e-6), and the fused
    extends did run."""
    from hyla.model.layers import SparseMoE

    path = request.getfixturevalue(f"{arch}_path" if GPU else f"{arch}_short_path")
    # interpreted, 2 requests (~4 s an extend, its experts grouped): a fresh prompt of 21 tokens (chunked)
    # and one of 96, past the fused extends' 64 (the eager extend), then each again (a 1-token extend from
    # its end - 1 checkpoint) and continued (4 tokens from its cached turn): the short ones recurrent
    requests = 3 if GPU else 2
    # (no warm-up on a GPU: its extends would count as the test's)
    opts = dict(device=DEVICE, max_total_tokens=2048, max_state_slots=32, max_running_requests=4, warmup="off")
    with monkeypatch.context() as m, Engine(path, **opts) as plain:
        if GPU:  # the PyTorch extend: no fused runner, MoE experts sorted by expert (as on the CPU)
            plain.scheduler.runner = ModelRunner(plain.model, plain.kv_pool, plain.state_pool, plain.req_to_token,
                                                 plain.device, cuda_graph=False, fused_decode=False)
            m.setattr(SparseMoE, "path", lambda self, x: "sorted")
        a = _turns(plain, 0, requests)
    ran = []
    original = ModelRunner._forward_extend_fused
    monkeypatch.setattr(ModelRunner, "_forward_extend_fused",
                        lambda self, req, n, *args: ran.append(n) or original(self, req, n, *args))
    if not GPU:
        monkeypatch.setattr(SparseMoE, "path", lambda self, x: "grouped")
    with Engine(path, **opts) as fused:
        b = _turns(fused, 0, requests, fused_extend=64, keys=None if GPU else record_compile_keys(monkeypatch))
    assert len(ran) >= 2 * requests and min(ran) < 16 < max(ran)  # the recurrent and the chunked segment kernels
    n = compare_outputs(a, b)
    assert n > 0.9 * sum(len(o["output_ids"]) for o in a)


def _fused_runner(engine: Engine, fused_extend: int, graphs: bool = False, decode_graphs: int = 0) -> None:
    """Swap in a fused runner whose single-sequence extends of up to ``fused_extend`` tokens run as
    fused extends: eager, or replaying CUDA graphs (``graphs``; emulated on the CPU:
    ``emulate_cuda_graphs`` first), with decode steps of up to ``decode_graphs`` requests replaying
    theirs (the extend graphs in their memory pool, as a GPU runner's)."""
    engine.scheduler.runner = ModelRunner(engine.model, engine.kv_pool, engine.state_pool, engine.req_to_token,
                                          engine.device, cuda_graph=False, fused_decode=True,
                                          fused_extend_max_tokens=fused_extend)
    if graphs:
        attach_graphs(engine.scheduler.runner, decode_max_bs=decode_graphs, extends=True)


def _concurrent_turns(engine: Engine, fused_extend: int | None = None, graphs: bool = False) -> list[dict]:
    """Two turns of three conversations, each turn one ``generate`` of the three (one prefill batch
    of three sequences): fresh prompts, then each conversation continued from its cached turn."""
    if fused_extend is not None:
        _fused_runner(engine, fused_extend, graphs)
    rng = random.Random(3)
    vocab = engine.model_config.vocab_size
    wave = [[rng.randrange(3, vocab) for _ in range(n)] for n in (9, 30, 23)]
    params = {"temperature": 0, "max_new_tokens": 1, "ignore_eos": True}
    outs = engine.generate(input_ids=wave, return_logprob=True, sampling_params=params)
    nxt = [ids + o["output_ids"] + [5, 6, 7] for ids, o in zip(wave, outs)]
    outs += engine.generate(input_ids=nxt, return_logprob=True, sampling_params=params)
    engine.wait_idle()
    engine.check_integrity()
    assert [o["meta_info"]["cached_tokens"] for o in outs[3:]] == [len(ids) for ids in wave]  # turn 2 hit turn 1
    return outs


@pytest.mark.slow
def test_engine_fused_extends_of_a_batch_match_pytorch(qwen3_5_short_path, monkeypatch, few_splits):
    """A prefill batch of a few sequences (concurrent turns) runs as one fused extend per sequence,
    each with its own checkpoints, each a graph replay (on the CPU emulated CUDA graphs: the logits
    of all but the last copied before the next replay; a GPU runs them eager here): == the PyTorch
    extend of the whole batch, token for token, logprobs within 1e-4. Out of the fused path: more
    sequences than ``EXTEND_MAX_SEQS``."""
    from hyla.engine import model_runner

    path = qwen3_5_short_path
    # no warm-up (a GPU's default): its extends would count as the test's batches
    opts = dict(device=DEVICE, max_total_tokens=2048, max_state_slots=32, max_running_requests=4, warmup="off")
    with Engine(path, **opts) as plain:
        if GPU:
            plain.scheduler.runner = ModelRunner(plain.model, plain.kv_pool, plain.state_pool, plain.req_to_token,
                                                 plain.device, cuda_graph=False, fused_decode=False)
        a = _concurrent_turns(plain)
    batches = []
    original = ModelRunner._forward_extends_fused
    monkeypatch.setattr(ModelRunner, "_forward_extends_fused",
                        lambda self, reqs, lens, *args: batches.append(list(lens)) or original(self, reqs, lens, *args))
    replays = []
    monkeypatch.setattr(CudaGraphExtend, "replay",
                        lambda self, bucket, run=CudaGraphExtend.replay: replays.append(bucket) or run(self, bucket))
    if not GPU:  # each sequence's fused extend replays an emulated CUDA graph, one after the other in a step
        emulate_cuda_graphs(monkeypatch)
    with Engine(path, **opts) as fused:  # up to 32 tokens: the graphs of 16 and 32
        b = _concurrent_turns(fused, fused_extend=32, graphs=not GPU)
    assert len(batches) == 2 and all(len(lens) == 3 for lens in batches)
    buckets = sorted(16 if n <= 16 else 32 for lens in batches for n in lens)
    assert sorted(replays) == (buckets if not GPU else [])
    n = compare_outputs(a, b)
    assert n == sum(len(o["output_ids"]) for o in a)
    batches.clear()  # a batch of more sequences than the bound: the eager extend
    monkeypatch.setattr(model_runner, "EXTEND_MAX_SEQS", 2)
    with Engine(path, **opts) as fused:
        c = _concurrent_turns(fused, fused_extend=32)
    assert batches == []
    assert compare_outputs(a, c) == sum(len(o["output_ids"]) for o in a)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["qwen3_5_path", "qwen3_5_moe_path"])
def test_engine_bf16_extend_graphs_match_eager(arch, request, monkeypatch):
    """bf16 on the GPU: extends replayed from their CUDA graphs == the same fused extends launched
    eagerly (padded alike), token for token, and the graphs did replay (padding tokens must not
    leak into real ones: the same kernels on the same inputs) — also a batch of three sequences,
    one replay each (a replay's logits buffer is the next same-size replay's: copied before it).
    With MoE layers too, their experts grouped on the device (``moe.plan`` and ``moe.expert_gemm``
    captured: each replay plans its own routing)."""
    path = request.getfixturevalue(arch)
    from hyla.engine.cuda_graph import CudaGraphExtend

    replays = []
    original = CudaGraphExtend.replay
    monkeypatch.setattr(CudaGraphExtend, "replay", lambda self, bucket: replays.append(bucket) or original(self, bucket))
    opts = dict(device="cuda", dtype="bfloat16", max_total_tokens=2048, max_state_slots=32, max_running_requests=4,
                warmup="off")  # its replays would count as the test's
    with Engine(path, **opts) as graphs:
        assert graphs.scheduler.runner.extend_graphs is not None
        a = _turns(graphs, 0, 3) + _concurrent_turns(graphs)
    assert len(replays) >= 12
    with Engine(path, **opts) as eager:
        b = _turns(eager, 0, 3, fused_extend=1024) + _concurrent_turns(eager)
    assert [o["output_ids"] for o in a] == [o["output_ids"] for o in b]
    for x, y in zip(a, b):
        torch.testing.assert_close([lp for lp, _, _ in x["meta_info"]["output_token_logprobs"]],
                                   [lp for lp, _, _ in y["meta_info"]["output_token_logprobs"]], atol=0, rtol=0)


def test_extend_buckets_and_their_option():
    from hyla.engine.args import EngineArgs
    from hyla.engine.cuda_graph import extend_buckets

    assert extend_buckets(100) == [16, 32, 48, 64, 96, 100]
    assert extend_buckets(16) == [16] and extend_buckets(5) == [5]
    with pytest.raises(ValueError, match=">= 1"):
        extend_buckets(0)
    assert EngineArgs(cuda_graph_max_extend_tokens=0).cuda_graph_max_extend_tokens == 0  # off
    for bad in (-1, 2.5, True):
        with pytest.raises(ValueError, match="cuda_graph_max_extend_tokens"):
            EngineArgs(cuda_graph_max_extend_tokens=bad)


def _arrivals_while_streams_decode(engine: Engine, mixed_steps: list | None = None) -> list[dict]:
    """Two streams decode; meanwhile two short prompts arrive one after the other (each admitted in a
    prefill step of its own, which with ``enable_mixed_chunk`` also feeds the streams a token). Returns
    the streams' outputs (their chunks joined), then the two prompts'."""
    rng = random.Random(5)
    vocab = engine.model_config.vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in (7, 12, 9, 14)]
    greedy = {"temperature": 0, "ignore_eos": True}
    streams = [engine.generate(input_ids=p, sampling_params=dict(greedy, max_new_tokens=12), return_logprob=True,
                               stream=True) for p in prompts[:2]]
    firsts = [next(s) for s in streams]  # both decoding now
    arrivals = [engine.generate(input_ids=p, sampling_params=dict(greedy, max_new_tokens=2), return_logprob=True)
                for p in prompts[2:]]
    outs = [join_stream([first, *stream]) for first, stream in zip(firsts, streams)]
    engine.wait_idle()
    engine.check_integrity()
    return outs + arrivals


@pytest.mark.slow
def test_mixed_steps_replay_the_extend_and_decode_graphs(qwen3_5_short_path, monkeypatch, few_splits):
    """Mixed chunked prefill (``enable_mixed_chunk``) on a runner with graphs (``decodes_apart``): a
    prompt admitted while two streams decode runs as a fused extend, its graph replayed, and the
    streams as a decode step after it, their graph replayed. The two graphs share a memory pool, so
    the decode replay may overwrite the extend graph's output (emulated on the CPU, it does: the
    prompt's logits must have been copied before it). fp32: tokens and logprobs == the plain
    engine's (no mixed steps; on the CPU the PyTorch ops)."""
    from hyla.engine.scheduler import Scheduler

    path = qwen3_5_short_path
    opts = dict(device=DEVICE, dtype="float32", max_total_tokens=2048, max_state_slots=32, max_running_requests=4)
    with Engine(path, **opts) as plain:
        a = _arrivals_while_streams_decode(plain)
    apart = []
    monkeypatch.setattr(Scheduler, "_run_mixed_apart", lambda self, batch, ckpts, run=Scheduler._run_mixed_apart:
                        apart.append(batch.num_mixed) or run(self, batch, ckpts))
    replays = []
    monkeypatch.setattr(CudaGraphExtend, "replay",
                        lambda self, bucket, run=CudaGraphExtend.replay: replays.append(bucket) or run(self, bucket))
    if not GPU:
        emulate_cuda_graphs(monkeypatch)
    with Engine(path, enable_mixed_chunk=True, **opts) as mixed:
        if not GPU:  # the graphs a GPU runner captures: extends of up to 16 tokens (one graph: an interpreted
            # capture costs ~10 s), decode steps of 1 and 2
            _fused_runner(mixed, 16, graphs=True, decode_graphs=2)
        b = _arrivals_while_streams_decode(mixed)
    assert apart.count(2) == 2 and len(replays) >= 2  # each arrival's step: its extend replayed, the streams apart
    assert compare_outputs(a, b) == sum(len(o["output_ids"]) for o in a)
