"""The decode step at model level: no host reads once the batch is built, validation at batch
construction, the per-step metadata, cached derived weights, the in-place RoPE, the column-major
weight layout, and the compiled decode graph (``compile_decode``) against eager."""

from __future__ import annotations

import contextlib
import random
import shutil

import pytest
import torch
from checkpoints import TinyRunner, make_nemotron_h
from torch.overrides import TorchFunctionMode, _pop_mode_temporarily

from hyla.model import linear, load_model
from hyla.model.forward_batch import ForwardBatch
from hyla.model.layers import RMSNorm, RotaryEmbedding, SparseMoE, apply_rotary, apply_rotary_, signed_sin, sparse_moe
from hyla.model.linear import Linear, keep_row_major_weights_

HOST_READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy")


class NoHostReads(TorchFunctionMode):
    """Fails on any call that copies tensor data to the host (a device sync on a GPU)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in HOST_READS:
            raise AssertionError(f"host read in the forward: {func.__name__}")
        return func(*args, **(kwargs or {}))


needs_cxx = pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                               reason="torch.compile needs a C++ compiler")


@pytest.fixture(scope="module")
def nemotron_h_dense_path(tiny_ckpt_dir):
    """NemotronH without its MoE block."""
    return make_nemotron_h(tiny_ckpt_dir, layers_block_type=[
        "linear_attention", "mlp", "linear_attention", "full_attention", "mlp", "linear_attention", "full_attention"])


def run_experts_as_a_gpu(monkeypatch, path: str, max_rows: int | None = None) -> None:
    """MoE layers run their experts as a GPU step does (``SparseMoE.path``): ``"gathered"`` (a few
    rows) or ``"grouped"`` (more; ``ops/gpu/moe.py``, whose Triton kernels the interpreter runs here on
    the host: each launch runs outside :class:`NoHostReads`, where a GPU only launches it); ``""``: as
    they would.
    ``max_rows``: steps of more tokens (the prefills before a checked step) sort by expert, as on the
    CPU: interpreted, a grouped prefill costs seconds a layer."""
    if path:
        monkeypatch.setattr(SparseMoE, "path",
                            lambda self, x: path if max_rows is None or x.shape[0] <= max_rows else "sorted")
    if path == "grouped":  # every interpreted launch (the wrappers' own PyTorch ops stay checked)
        from triton.runtime.interpreter import InterpretedFunction

        from hyla.model.ops.gpu import moe

        monkeypatch.setattr(moe, "SMALL_TILES", (16, 128, 128, 4))  # fewer programs to interpret

        def run(self, *args, original=InterpretedFunction.run, **kw):
            with _pop_mode_temporarily() if torch._C._len_torch_function_stack() else contextlib.nullcontext():
                return original(self, *args, **kw)

        monkeypatch.setattr(InterpretedFunction, "run", run)


@pytest.mark.parametrize("ckpt", ["qwen3_next_dense_path", "qwen3_5_path", "nemotron_h_dense_path",
                                  "qwen3_next_moe_path:gathered", "nemotron_h_path:gathered",
                                  "qwen3_next_moe_path:grouped", "kimi_linear_path:gathered",
                                  "lfm2_moe_short_path:grouped"])
@torch.no_grad()
def test_decode_forward_reads_nothing_back_from_the_device(ckpt, request, monkeypatch):
    """Models with MoE layers too, whose experts run as on a GPU, gathered or grouped
    (``SparseMoE.path``; what CUDA graphs of their decode steps capture)."""
    ckpt, _, path = ckpt.partition(":")
    run_experts_as_a_gpu(monkeypatch, path, max_rows=3)
    model = load_model(request.getfixturevalue(ckpt))
    runner = TinyRunner(model)
    seqs = [runner.new_seq() for _ in range(3)]
    runner.step(seqs, [list(range(3, 3 + n)) for n in (20, 7, 33)])
    for step in range(2):  # a batch of 3 (a padded KV table), then of 1
        batch = runner.make_batch(seqs, [[5 + step]] * len(seqs), decode=True)
        with NoHostReads():
            logits = model(batch)
        assert logits.shape == (len(seqs), model.config.vocab_size)
        seqs = seqs[:1]


@pytest.mark.parametrize("ckpt", ["qwen3_next_dense_path", "qwen3_5_path", "nemotron_h_dense_path",
                                  "nemotron_h_path:grouped", "kimi_linear_path:gathered"])
@torch.no_grad()
def test_extend_forward_reads_nothing_back_from_the_device(ckpt, request, monkeypatch):
    """A prefill step (the chunked recurrent paths, attention over a cached prefix, checkpoints
    inside and at the end of a chunk): the batch validated its lengths, slots and checkpoints once
    (``ForwardBatch.varlen``), so no layer reads anything back (on a GPU: no sync per layer). MoE
    layers too, their experts run as on a GPU (Kimi Linear's gathered: fast without the interpreter,
    and its MoE is the others'; what it adds is its latent attention)."""
    ckpt, _, path = ckpt.partition(":")
    run_experts_as_a_gpu(monkeypatch, path)
    model = load_model(request.getfixturevalue(ckpt))
    runner = TinyRunner(model, max_states=12)
    seqs = [runner.new_seq() for _ in range(3)]
    runner.step(seqs, [list(range(3, 3 + n)) for n in (20, 7, 33)])  # a cached prefix for the next step
    batch = runner.make_batch(seqs, [list(range(5, 5 + n)) for n in (70, 9, 130)],
                              checkpoints=[(0, 64, 9), (2, 100, 10), (2, 130, 11)])
    assert batch.varlen is not None
    with NoHostReads():
        logits = model(batch)
    assert logits.shape == (len(seqs), model.config.vocab_size)


@pytest.mark.parametrize("ckpt", ["qwen3_next_dense_path", "nemotron_h_dense_path"])
@torch.no_grad()
def test_extend_forward_sends_its_indices_once_per_step(ckpt, request, monkeypatch):
    """On a GPU a plain host -> device copy (``torch.tensor(..., device=...)``) waits for the
    stream, and one in every layer keeps the host from ever running ahead of the device. The ops
    derive their index tensors from the step's plan once (``VarlenPlan.derive``) and send them
    with ``to_device`` (pinned, not waiting): no copy of the plain kind in the forward, and the same
    number of copies with the first 4 layers as with all 8."""
    model = load_model(request.getfixturevalue(ckpt))
    plain, sent = [], []
    tensor, as_tensor = torch.tensor, torch.as_tensor

    def count(factory, calls):
        def wrapped(*args, **kwargs):
            calls.append(kwargs.get("device"))
            return factory(*args, **kwargs)
        return wrapped

    from hyla.model.ops import varlen

    def copies_in_forward() -> int:
        runner = TinyRunner(model, max_states=12)
        seqs = [runner.new_seq() for _ in range(3)]
        runner.step(seqs, [list(range(3, 3 + n)) for n in (20, 7, 33)])
        batch = runner.make_batch(seqs, [list(range(5, 5 + n)) for n in (70, 9, 130)],
                                  checkpoints=[(0, 64, 9), (2, 100, 10), (2, 130, 11)])
        varlen._chunk_layout.cache_clear()  # memoised across steps by lengths (other tests run these too)
        plain.clear(), sent.clear()
        with monkeypatch.context() as m:
            m.setattr(torch, "tensor", count(tensor, plain))  # to_device builds with as_tensor, no device
            m.setattr(torch, "as_tensor", count(as_tensor, sent))
            model(batch)
        assert [d for d in plain if d is not None] == [], "a plain host -> device copy in the forward"
        return len(sent)

    every_layer = copies_in_forward()
    assert every_layer > 0  # the counting sees the ops' copies
    monkeypatch.setattr(model, "layers", torch.nn.ModuleList(list(model.layers)[:4]))  # both mixer kinds
    assert copies_in_forward() == every_layer


def _init_fields(batch):
    return [f for f in batch.__dataclass_fields__ if batch.__dataclass_fields__[f].init]


def test_batch_is_validated_when_built(qwen3_next_dense_path):
    model = load_model(qwen3_next_dense_path)
    runner = TinyRunner(model, max_states=4)
    seqs = [runner.new_seq(), runner.new_seq()]
    runner.step(seqs, [[1, 2, 3], [4, 5]])
    good = runner.make_batch(seqs, [[6], [7]], decode=True)
    fields = {f: getattr(good, f) for f in _init_fields(good)}

    def build(**changes):
        return ForwardBatch(**{**fields, **changes})

    rows, mask = good.decode_kv_layout()
    assert good.seq_lens == [4, 3] and good.kv_table.shape == (2, 4) and rows.shape == (2, 2, 4)
    assert torch.equal(rows, good.kv_table[:, None] * 2 + torch.arange(2)[:, None])  # head-major rows
    assert mask.tolist() == [[0, 0, 0, 0], [0, 0, 0, float("-inf")]]
    assert good.decode_kv_layout()[0] is rows  # made once, for every attention layer
    on_device = build(kv_lens=torch.tensor([4, 3]))  # the mask from the lengths on the device: the same
    assert torch.equal(on_device.decode_kv_layout()[1], mask)
    assert good.max_token_id == 7 and good.slot_plan.first == 1
    with pytest.raises(ValueError, match="repeats"):
        build(state_slots=torch.tensor([1, 1]), state_slot_list=None)
    with pytest.raises(ValueError, match="outside"):
        build(state_slots=torch.tensor([1, 9]), state_slot_list=None)
    for host in (None, [(0, 2, 3)]):  # from the tensors, or from their host copy
        with pytest.raises(ValueError, match="ckpt_len"):
            build(ckpt_seq=torch.tensor([0]), ckpt_len=torch.tensor([2]), ckpt_slot=torch.tensor([3]), ckpt_list=host)
    with pytest.raises(ValueError, match="also a sequence slot"):
        build(ckpt_seq=torch.tensor([0]), ckpt_len=torch.tensor([1]), ckpt_slot=torch.tensor([2]), ckpt_list=None)
    with pytest.raises(ValueError, match="ckpt_list has 0 entries"):  # a host copy that disagrees
        build(ckpt_seq=torch.tensor([0]), ckpt_len=torch.tensor([1]), ckpt_slot=torch.tensor([3]))
    with pytest.raises(ValueError, match="kv_table"):
        build(kv_table=good.kv_table[:, :3])
    with pytest.raises(ValueError, match="kv_indices"):
        build(kv_indices=good.kv_indices[:-1])
    with pytest.raises(ValueError, match="positions"):
        build(positions=good.positions[:1])
    with pytest.raises(ValueError, match="exactly one token"):
        build(extend_lens=[2, 0])


def test_runner_kv_table_equals_the_derived_one(qwen3_next_dense_path):
    """A batch given its KV table (as the engine's runner builds it) computes what a batch that
    derives it from the packed ``kv_indices`` computes."""
    model = load_model(qwen3_next_dense_path)
    runner = TinyRunner(model)
    seqs = [runner.new_seq() for _ in range(2)]
    runner.step(seqs, [list(range(3, 30)), list(range(40, 50))])
    batch = runner.make_batch(seqs, [[5], [6]], decode=True)
    fields = {f: getattr(batch, f) for f in _init_fields(batch)}
    snapshot = [t.clone() for t in (*runner.k_buffers, *runner.v_buffers, *runner.conv_states, *runner.ssm_states)]
    a = model(ForwardBatch(**fields))
    for t, s in zip((*runner.k_buffers, *runner.v_buffers, *runner.conv_states, *runner.ssm_states), snapshot):
        t.copy_(s)
    b = model(ForwardBatch(**{**fields, "kv_table": batch.kv_table.clone()}))
    assert torch.equal(a, b)


def test_derived_weights_follow_in_place_updates():
    norm = RMSNorm(8, 1e-6, zero_centered=True)
    with torch.no_grad():
        norm.weight.zero_()
        x = torch.randn(3, 8)
        a = norm(x)
        norm.weight.fill_(1.0)  # an in-place write bumps the version: the cached 1 + w is rebuilt
        b = norm(x)
        norm.weight.data = torch.full((8,), 3.0)  # new storage
        c = norm(x)
    torch.testing.assert_close(b, 2 * a)
    torch.testing.assert_close(c, 4 * a)


def test_in_place_rotary_is_bitwise_the_reference():
    rotary = RotaryEmbedding(16, 10000.0)
    cos, sin = rotary(torch.tensor([0, 3, 77, 4000]), torch.float32)
    x = torch.randn(4, 6, 64)
    want = apply_rotary(x, cos, sin)
    got = apply_rotary_(x.clone(), cos, signed_sin(sin))
    assert torch.equal(got, want)


def test_fp32_cpu_projection_weights_are_column_major_with_the_same_values(qwen3_next_moe_path):
    model = load_model(qwen3_next_moe_path)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(m.weight.t().is_contiguous() for m in linears)
    moe = model.layers[0].ffn
    assert moe.w_in.transpose(1, 2).is_contiguous() and moe.w_out.transpose(1, 2).is_contiguous()
    from safetensors.torch import load_file
    ref = load_file(qwen3_next_moe_path / "model.safetensors")
    assert torch.equal(model.lm_head.weight, ref["lm_head.weight"].float())
    assert torch.equal(model.layers[3].mixer.o_proj.weight, ref["model.layers.3.self_attn.o_proj.weight"].float())
    bf16 = load_model(qwen3_next_moe_path, dtype="bfloat16")  # oneDNN: no gain, left alone
    assert all(m.weight.is_contiguous() for m in bf16.modules() if isinstance(m, torch.nn.Linear))


def test_one_thread_gives_row_major_copies_of_the_weights(qwen3_next_moe_path):
    """``compile_decode``'s batch-1 projections read ``Linear.rows``: the weight's values, row-major.
    On one thread the column-major weights stay (MKL's few-row GEMMs) and ``rows`` is a copy; a
    weight that is row-major already is shared, not copied; bf16 (oneDNN) models get none."""
    model = load_model(qwen3_next_moe_path)
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    copied = keep_row_major_weights_(model, threads=1)
    assert linears and all(m.rows.is_contiguous() and torch.equal(m.rows, m.weight) for m in linears)
    assert copied == sum(m.weight.nbytes for m in linears if not m.weight.is_contiguous()) > 0
    model.lm_head.weight.data = model.lm_head.weight.data.contiguous()  # row-major: shared
    assert keep_row_major_weights_(model, threads=1) == copied - model.lm_head.weight.nbytes
    assert model.lm_head.rows.data_ptr() == model.lm_head.weight.data_ptr()
    bf16 = load_model(qwen3_next_moe_path, dtype="bfloat16")
    assert keep_row_major_weights_(bf16, threads=1) == 0
    assert all(m.rows is None for m in bf16.modules() if isinstance(m, Linear))


def test_more_threads_make_the_weights_row_major_in_place(qwen3_next_moe_path):
    """On more than one thread every fp32 projection weight is made row-major in place (same values)
    and is its own ``rows``: no copy. The eager model computes what it did column-major, within fp32
    rounding (prefill's GEMMs and the few-row split read either layout)."""
    model = load_model(qwen3_next_moe_path)
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    before = {m: m.weight.detach().clone() for m in linears}
    assert any(not m.weight.is_contiguous() for m in linears)

    def prefill_and_decode() -> list[torch.Tensor]:
        runner = TinyRunner(model)
        seqs = [runner.new_seq(), runner.new_seq()]
        return [runner.step(seqs, [[3, 14, 15, 92, 65, 35], [27, 18, 28]]), runner.step(seqs, [[5], [6]])]

    column_major = prefill_and_decode()
    assert keep_row_major_weights_(model, threads=2) == 0
    assert all(m.weight.is_contiguous() and m.rows.data_ptr() == m.weight.data_ptr()
               and torch.equal(m.weight, before[m]) for m in linears)
    for a, b in zip(prefill_and_decode(), column_major):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_one_thread_keeps_no_row_major_copy_of_a_large_weight(qwen3_next_moe_path, monkeypatch):
    """On one thread a column-major weight of ``ROW_COPY_MAX_ELEMENTS_ONE_THREAD`` elements or more
    keeps no copy (its one-row step is MKL's GEMM); a row-major weight (shared, no copy) and smaller
    weights keep theirs."""
    model = load_model(qwen3_next_moe_path)
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    everything = keep_row_major_weights_(model, threads=1)  # this model's weights are small
    big = model.layers[3].mixer.o_proj
    monkeypatch.setattr(linear, "ROW_COPY_MAX_ELEMENTS_ONE_THREAD", big.weight.numel())
    model.lm_head.weight.data = model.lm_head.weight.data.contiguous()  # row-major: shared, kept at any size
    copied = keep_row_major_weights_(model, threads=1)
    large = [m for m in linears if not m.weight.is_contiguous() and m.weight.numel() >= big.weight.numel()]
    assert big in large and all(m.rows is None for m in large)
    assert all(m.rows is not None and torch.equal(m.rows, m.weight) for m in linears if m not in large)
    assert model.lm_head.rows.data_ptr() == model.lm_head.weight.data_ptr()
    assert copied == everything - model.lm_head.weight.nbytes - sum(m.weight.nbytes for m in large)


@pytest.mark.skipif(not linear.HAS_PACKED, reason="this torch has no oneDNN or no opaque objects")
def test_packed_weights_are_the_large_projections_own(qwen3_next_moe_path):
    """``pack_weights_`` packs the fp32 projections of at least ``min_elements`` (no other), each its own
    :class:`PackedWeight` (equal only to itself: a compiled graph takes each as its own input), and
    ``packed_linear`` on it is ``F.linear`` (fp32 rounding); bf16 models get none."""
    model = load_model(qwen3_next_moe_path)
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    cut = sorted(m.weight.numel() for m in linears)[len(linears) // 2]
    nbytes = linear.pack_weights_(model, min_elements=cut)
    large = [m for m in linears if m.weight.numel() >= cut]
    assert 0 < len(large) < len(linears) and nbytes == sum(m.weight.nbytes for m in large)
    assert all((m.packed is not None) == (m in large) for m in linears)
    a, b = large[0].packed, large[1].packed
    assert a == a and a != b and len({a, b}) == 2
    x = torch.randn(5, large[0].weight.shape[1])
    torch.testing.assert_close(torch.ops.hyla.packed_linear(x, large[0].weight, a), x @ large[0].weight.t(),
                               atol=1e-4, rtol=1e-4)
    assert linear.pack_weights_(model, min_elements=1 << 40) == 0 and all(m.packed is None for m in linears)
    bf16 = load_model(qwen3_next_moe_path, dtype="bfloat16")
    assert linear.pack_weights_(bf16, min_elements=1) == 0


@needs_cxx
def test_one_row_linear_reads_its_rows_only_when_compiled():
    """A compiled call of one row (a static count) is the dot product over ``rows``; eager calls,
    more rows (a symbolic count) and a ``Linear`` without ``rows`` are ``F.linear`` (a ``rows`` that
    differs from the weight shows which one ran)."""
    torch.manual_seed(0)
    proj = Linear(64, 48, bias=True)
    proj.rows = 2 * proj.weight.detach().contiguous()  # not the weight: tells the paths apart
    one, few, many = (torch.randn(n, 64) for n in (1, 3, 17))
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(proj, dynamic=False, fullgraph=True)(one),
                                   one @ proj.rows.t() + proj.bias)
        call = torch.compile(proj, dynamic=True, fullgraph=True)
        for x in (few, many):
            torch.testing.assert_close(call(x), x @ proj.weight.t() + proj.bias)
        torch.testing.assert_close(proj(one), one @ proj.weight.t() + proj.bias)
        torch.testing.assert_close(proj(few), few @ proj.weight.t() + proj.bias)
        # no rows (one thread, a large column-major weight): the one-row graph's projection is F.linear
        proj.rows = None
        linear.relayout_weights_(proj)
        assert not proj.weight.is_contiguous()
        torch.testing.assert_close(torch.compile(proj, dynamic=False, fullgraph=True)(one),
                                   one @ proj.weight.t() + proj.bias)


@pytest.fixture
def two_threads():
    """torch's intra-op threads at 2 for the test (restored after: the setting is the worker's)."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def split_calls(monkeypatch):
    """The projections that ran split across threads (``linear.split_linear`` returning a result)."""
    calls = []
    real = linear.split_linear

    def spy(x, weight, blocks):
        y = real(x, weight, blocks)
        if y is not None:
            calls.append((x.shape[0], blocks))
        return y

    monkeypatch.setattr(linear, "split_linear", spy)
    return calls


def test_few_row_linear_splits_its_weight_across_threads(two_threads, split_calls):
    """With 2 threads an fp32 CPU projection of 1-16 rows is one bmm over 4 contiguous blocks of
    its weight (split along the inputs for a column-major weight, along the outputs for a row-major
    one), equal to ``F.linear`` within fp32 rounding; more rows, one thread, a small weight or a
    weight no block count divides run ``F.linear`` itself."""
    torch.manual_seed(0)
    col = Linear(256, 384, bias=True)
    linear.relayout_weights_(col)  # column-major, as loaded
    row = Linear(256, 384, bias=False)  # row-major: a tied lm_head's layout
    assert col.weight.t().is_contiguous() and row.weight.is_contiguous()
    with torch.inference_mode():
        for proj in (col, row):
            for n in (1, 5, 16):
                x = torch.randn(n, 256)
                torch.testing.assert_close(proj(x), torch.nn.functional.linear(x, proj.weight, proj.bias),
                                           rtol=1e-5, atol=1e-5)
        assert split_calls == [(n, 4) for n in (1, 5, 16)] * 2
        split_calls.clear()
        col(torch.randn(17, 256))  # more rows: MKL threads those itself
        odd = Linear(255, 386)  # 4 divides neither dim (row-major and column-major alike)
        odd(torch.randn(3, 255))
        linear.relayout_weights_(odd)
        odd(torch.randn(3, 255))
        Linear(64, 48)(torch.randn(3, 64))  # a small weight: the split's fixed cost would dominate
        torch.set_num_threads(1)
        col(torch.randn(3, 256))
    assert split_calls == []


def test_compiled_projections_are_not_split(two_threads, split_calls):
    """A compiled graph's projections stay ``F.linear`` (the graph of more rows packs them for
    inductor's GEMM template): the split is for eager steps only, and its row-count test is not
    traced (it would guard a graph of more rows to at most ``SPLIT_MAX_ROWS`` rows)."""
    from torch._dynamo.testing import CompileCounter

    proj = Linear(256, 384)
    linear.relayout_weights_(proj)
    counter = CompileCounter()
    call = torch.compile(proj, backend=counter, dynamic=True, fullgraph=True)
    with torch.inference_mode():
        for n in (3, 5, linear.SPLIT_MAX_ROWS + 7):
            call(torch.randn(n, 256))
    assert split_calls == [] and counter.frame_count == 1


@pytest.mark.parametrize("arch", ["qwen3_next_dense_path", "nemotron_h_path", "kimi_linear_path"])
def test_split_projections_decode_as_unsplit(arch, request, two_threads, split_calls, monkeypatch):
    """A model's decode steps with every projection split across threads give the logits of the
    unsplit ones within the fp32 parity tolerance (1e-4) and the same greedy tokens. Few-row calls
    only: decode steps, and in a prefill the experts' groups of a few tokens (MoE layers)."""
    path = request.getfixturevalue(arch)
    model = load_model(path, dtype="float32")
    prompt = [random.Random(7).randrange(3, 500) for _ in range(40)]

    def run(split: bool) -> list[torch.Tensor]:
        monkeypatch.setattr(linear, "SPLIT_MIN_WEIGHT", 1 if split else 1 << 62)
        runner = TinyRunner(model)
        seq = runner.new_seq()
        with torch.inference_mode():
            out = [runner.step([seq], [prompt])]
            for _ in range(12):
                out.append(runner.step([seq], [[int(out[-1].argmax())]], decode=True))
        return out

    plain = run(split=False)
    assert split_calls == []
    split = run(split=True)
    assert (1, 4) in split_calls and all(n <= linear.SPLIT_MAX_ROWS for n, _ in split_calls)
    for a, b in zip(split, plain):
        assert (a - b).abs().max().item() <= 1e-4
        assert int(a.argmax()) == int(b.argmax())


@pytest.fixture
def onednn_calls(monkeypatch):
    """The row counts of the projections that ran on oneDNN's GEMM (``linear.onednn_linear``)."""
    calls = []
    real = linear.onednn_linear

    def spy(x, weight):
        calls.append(x.shape[0])
        return real(x, weight)

    monkeypatch.setattr(linear, "onednn_linear", spy)
    return calls


needs_onednn = pytest.mark.skipif(not linear.HAS_ONEDNN, reason="this torch has no oneDNN")


@needs_onednn
@pytest.mark.parametrize("threads", [1, 2])
def test_few_row_linear_runs_onednn_on_a_large_row_major_weight(threads, onednn_calls, split_calls, monkeypatch):
    """An fp32 CPU projection of 2-64 rows through a row-major weight of at least
    ``ONEDNN_MIN_WEIGHT`` elements (a tied lm_head) is oneDNN's GEMM, at any thread count, equal to
    ``F.linear`` within fp32 rounding; one row, more rows, a column-major or a smaller weight do not
    take it, nor does a compiled graph."""
    from torch._dynamo.testing import CompileCounter

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    monkeypatch.setattr(linear, "ONEDNN_MIN_WEIGHT", 256 * 384)
    torch.manual_seed(0)
    row = Linear(256, 384, bias=True)  # row-major: the tied lm_head's layout
    col = Linear(256, 384)
    linear.relayout_weights_(col)
    try:
        with torch.inference_mode():
            for n in (2, 9, 64):
                x = torch.randn(n, 256)
                torch.testing.assert_close(row(x), torch.nn.functional.linear(x, row.weight, row.bias),
                                           rtol=1e-5, atol=1e-5)
            assert onednn_calls == [2, 9, 64]
            onednn_calls.clear()
            row(torch.randn(1, 256))  # one row: the split (threads > 1) or MKL
            row(torch.randn(65, 256))  # past ONEDNN_ROWS
            col(torch.randn(8, 256))
            Linear(256, 383)(torch.randn(8, 256))  # one element short of the threshold
            counter = CompileCounter()
            call = torch.compile(row, backend=counter, dynamic=True, fullgraph=True)
            for n in (3, 5):
                call(torch.randn(n, 256))
        assert onednn_calls == [] and counter.frame_count == 1
        assert split_calls == ([(1, 4), (8, 4)] if threads > 1 else [])  # the row-major one row, the column-major 8
    finally:
        torch.set_num_threads(before)


@needs_onednn
@pytest.mark.parametrize("arch", ["qwen3_next_dense_path", "nemotron_h_path", "kimi_linear_path"])
def test_onednn_projections_decode_as_mkl(arch, request, onednn_calls, monkeypatch):
    """A model's steps with every few-row projection on oneDNN's GEMM (each weight made row-major,
    the threshold lowered to take them all) give the logits of ``F.linear`` within the fp32 parity
    tolerance (1e-4) and the same greedy tokens: 4 prompts prefilled together, then 10 decode steps
    of all 4 (4-row projections)."""
    model = load_model(request.getfixturevalue(arch), dtype="float32")
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.Linear):
                m.weight.data = m.weight.data.contiguous()
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (9, 23, 5, 17)]

    def run(onednn: bool) -> list[torch.Tensor]:
        monkeypatch.setattr(linear, "ONEDNN_MIN_WEIGHT", 1 if onednn else 1 << 62)
        runner = TinyRunner(model)
        seqs = [runner.new_seq() for _ in prompts]
        with torch.inference_mode():
            out = [runner.step(seqs, prompts)]
            for _ in range(10):
                out.append(runner.step(seqs, [[int(t)] for t in out[-1].argmax(-1)], decode=True))
        return out

    plain = run(onednn=False)
    assert onednn_calls == []
    fast = run(onednn=True)
    assert onednn_calls and set(onednn_calls) <= {4, 54}  # decode steps' rows; the prefill's 54 tokens
    for a, b in zip(fast, plain):
        assert (a - b).abs().max().item() <= 1e-4
        assert torch.equal(a.argmax(-1), b.argmax(-1))


@pytest.mark.slow
@needs_cxx
def test_compiled_decode_equals_eager(qwen3_next_short_path, monkeypatch):
    """``Engine(compile_decode=True)``: same greedy tokens and logprobs (1e-4) as eager, batch 1 and
    a changing larger batch (from 20 requests down to 1: both graphs, the one-row graph's dot
    products and the GEMMs of the graph of more rows, frozen), with no compilation after start-up;
    a batch that no graph fits then runs eager rather than compiling. The same on the weights
    ``pack_weights_`` packed, as for a model with large projections (the graph of more rows not
    frozen, its GEMMs oneDNN's): ``test_compiled_verify_is_exact_and_compiles_nothing_after_start_up``
    (test_engine_speculative.py), whose engine compiles those same decode graphs and runs this workload
    on them before its verify steps (compiling them again here, as a ``packed`` case, cost 27 s cold
    after this one)."""
    import torch._dynamo

    from hyla import Engine

    onednn_calls = []

    rng = random.Random(0)
    lens, new = [30, 90, 7, 64] + list(range(5, 21)), [12, 20, 8, 16] + [3 + i % 7 for i in range(16)]
    prompts = [[rng.randrange(3, 2048) for _ in range(n)] for n in lens]
    params = [{"temperature": 0, "max_new_tokens": n, "ignore_eos": True} for n in new]

    def run(**options):
        before = torch._dynamo.utils.counters["inductor"]["mkldnn_linear_weight_pack_matcher_count"]
        with Engine(qwen3_next_short_path, max_total_tokens=4096, max_state_slots=48, **options) as engine:
            runner, seen = engine.scheduler.runner, []
            if options:  # the graph of more rows was compiled frozen (its weights packed)
                assert runner._freeze_rows
                assert torch._dynamo.utils.counters["inductor"]["mkldnn_linear_weight_pack_matcher_count"] > before
                assert not torch._inductor.config.freezing  # and freezing was set for that compile only
            if options:  # record the compiled steps' batches
                real = runner._compiled_decode
                runner._compiled_decode = lambda batch: seen.append(batch) or real(batch)
            frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
            with monkeypatch.context() as patch:
                if options:  # oneDNN's GEMM: what the packed weights' op calls (and nothing else at these sizes)
                    real_onednn = torch.ops.mkldnn._linear_pointwise
                    patch.setattr(torch.ops.mkldnn, "_linear_pointwise",
                                  lambda x, *args: onednn_calls.append(x.shape[0]) or real_onednn(x, *args))
                outs = engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True)
                outs.append(engine.generate(input_ids=prompts[1], sampling_params=params[1], return_logprob=True))
            if options:
                assert runner.late_compiles == 0  # every step ran a graph of the warm-up, none fell back to eager
                assert not onednn_calls  # (the op of weights packed at start-up: none here)
                # a batch no graph fits (int32 token ids: a dtype guard fails), through the real dynamo: it
                # raises instead of compiling and the step runs eager (it rewrites the last step's slots:
                # the engine serves nothing after this)
                batch = seen[-1]
                batch.input_ids = batch.input_ids.to(torch.int32)
                with torch.inference_mode():
                    runner._run_compiled(batch)
                assert runner.late_compiles == 1
            return outs, torch._dynamo.utils.counters["stats"]["unique_graphs"] - frames

    eager, _ = run()
    compiled, new_graphs = run(compile_decode=True)
    assert new_graphs == 0, "a decode step compiled after start-up"
    for a, b in zip(eager, compiled):
        assert a["output_ids"] == b["output_ids"]
        la = [x[0] for x in a["meta_info"]["output_token_logprobs"]]
        lb = [x[0] for x in b["meta_info"]["output_token_logprobs"]]
        assert max(abs(x - y) for x, y in zip(la, lb)) <= 1e-4  # the project fp32 tolerance (fused kernels reorder sums)


@pytest.mark.slow
@needs_cxx
def test_compiled_decode_runs_moe_layers_as_one_op(qwen3_next_moe_one_layer_path, monkeypatch):
    """A model with MoE layers compiles its decode steps too: each graph calls the experts as one op
    (``sparse_moe.moe_experts``, whose host read does not break the graph), with the same greedy tokens
    and logprobs (1e-4) as the eager engine and nothing compiled after start-up. One layer (attention and
    its MoE): what is tested is the experts' op in the graphs, not depth (two layers, Gated DeltaNet's
    too, cost ~15 s more of inductor's time, cold; the compiled Gated DeltaNet is
    ``test_compiled_decode_equals_eager``'s). The graph of more
    rows runs its projections on packed weights, as a large model's do: not frozen, so inductor's
    cache keeps it and a later run loads it (a frozen graph's packed constants are never cached:
    ~30 s more of this test each run), and without a GEMM to autotune (what is tested is the MoE
    layers; ``test_compiled_decode_equals_eager`` covers the frozen GEMMs, the packed ones
    ``test_compiled_verify_is_exact_and_compiles_nothing_after_start_up``)."""
    import torch._dynamo

    from hyla import Engine
    from hyla.engine import model_runner

    monkeypatch.setattr(linear, "PACK_MIN_WEIGHT", 1)  # the graph of more rows on packed weights (inductor caches it)
    monkeypatch.setattr(model_runner, "ROWS_OPTIONS", {"realize_opcount_threshold": 4})  # or frozen, not autotuned
    calls = []  # the sorted path's, eager or as the compiled graphs' op
    real = sparse_moe.run_experts_sorted
    monkeypatch.setattr(sparse_moe, "run_experts_sorted", lambda x, *a: calls.append(torch.compiler.is_compiling())
                        or real(x, *a))
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 2048) for _ in range(n)] for n in (30, 9, 64, 5, 17)]
    params = [{"temperature": 0, "max_new_tokens": n, "ignore_eos": True} for n in (10, 14, 6, 12, 8)]

    def run(**options):
        with Engine(qwen3_next_moe_one_layer_path, max_total_tokens=2048, max_state_slots=24, **options) as engine:
            frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
            outs = engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True)
            outs.append(engine.generate(input_ids=prompts[0], sampling_params=params[0], return_logprob=True))
            assert engine.scheduler.runner.late_compiles == 0
            return outs, torch._dynamo.utils.counters["stats"]["unique_graphs"] - frames

    eager, _ = run()
    calls.clear()
    compiled, new_graphs = run(compile_decode=True)
    assert new_graphs == 0, "a decode step compiled after start-up"
    assert calls and not any(calls)  # run by the op, never traced into a graph
    for a, b in zip(eager, compiled):
        assert a["output_ids"] == b["output_ids"]
        la = [x[0] for x in a["meta_info"]["output_token_logprobs"]]
        lb = [x[0] for x in b["meta_info"]["output_token_logprobs"]]
        assert max(abs(x - y) for x, y in zip(la, lb)) <= 1e-4


def test_compiled_decode_compiles_each_runners_own_frame(qwen3_next_short_path, monkeypatch):
    """What each runner hands ``torch.compile`` is a frame dynamo compiles itself, with a code
    object of its own per runner: not one dynamo enters through its shared wrapper frame (as it
    does for a function decorated in torch's files, such as ``torch.no_grad``'s wrapper), where
    every runner's graphs would count against one recompile limit (8) and the second runner with
    verify graphs would fall back to eager. ``torch.compile`` is replaced by a recorder (the warm-up
    then runs eager)."""
    from torch._dynamo import trace_rules

    from hyla import Engine

    handed = []
    monkeypatch.setattr(torch, "compile", lambda fn, **options: handed.append(fn) or fn)
    for _ in range(2):
        with Engine(qwen3_next_short_path, max_total_tokens=1024, max_state_slots=8, compile_decode=True):
            pass
    assert len(handed) == 4  # the one-row graph and the graph of more rows, per engine
    assert not any(trace_rules.check(fn) for fn in handed)  # dynamo would wrap a skipped function
    assert len({id(fn.__func__.__code__) for fn in handed}) == 4  # dynamo keeps graphs per code object


def _dynamo_only(monkeypatch) -> None:
    """``torch.compile`` as the runner calls it, dynamo alone: backend ``eager`` (the graph dynamo
    captured, run by PyTorch: seconds, not inductor's minutes), with the runner's ``fullgraph``,
    ``dynamic`` and guard filter (the model's modules unguarded)."""
    real = torch.compile

    def compile(fn, *, dynamic, fullgraph, options):
        return real(fn, backend="eager", dynamic=dynamic, fullgraph=fullgraph,
                    options={"guard_filter_fn": options["guard_filter_fn"]})

    monkeypatch.setattr(torch, "compile", compile)


# the 2-layer variants where there is one (a layer of each kind): dynamo's trace time grows with the layers.
# Granite 4.0-H's layers are Bamba's and Qwen3.5-MoE's kinds (its µP factors are folded into the weights);
# Kimi-Linear's are Ling 3's (which adds MLA's RoPE and KDA's bounded decay). Jamba and Zamba2: their
# compiled speculative engine checks the same (test_engine_speculative.py::test_every_mixers_chains_trace_to_one_graph,
# whose start-up traces their decode graphs as well as the verify graphs: tracing them again here cost ~16 s)
@pytest.mark.parametrize("arch", ["qwen3_next_short_path", "qwen3_5_short_path", "falcon_h1_short_path",
                                  "bamba_short_path", "lfm2_short_path", "nemotron_h_small_path",
                                  "qwen3_5_moe_short_path", "bailing_hybrid_short_path",
                                  "olmo_hybrid_short_path", "lara_mini_short_path", "lfm3_short_path",
                                  "falcon_mamba_short_path", "minimax_short_path"])
def test_compiled_decode_is_one_graph_per_step(arch, request, monkeypatch):
    """Every architecture ``compile_decode`` compiles (MoE layers as one op each) traces a decode step
    as one graph (the verify graphs of chains: the slow compiled-verify test, fullgraph too): no host
    read inside the forward (what a graph break would be; LFM2's conv once validated its slots there).
    The runner compiles with ``fullgraph=True``, so a break would fail start-up; here dynamo traces
    alone (backend ``eager``), which is quick (what inductor makes of the graphs: the slow tests).
    Then a batch no graph fits goes through real dynamo and runs eager."""
    from hyla import Engine

    path = request.getfixturevalue(arch)
    _dynamo_only(monkeypatch)
    prompts = [[5, 6, 7, 8] * 4, [9, 10, 11] * 3]
    params = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
    with Engine(path, max_total_tokens=1024, max_state_slots=32, compile_decode=True) as engine:
        runner = engine.scheduler.runner
        assert runner.compiled
        compiled, seen = runner._compiled_decode, []
        runner._compiled_decode = lambda batch: seen.append(batch) or compiled(batch)
        assert all(len(o["output_ids"]) == 6 for o in engine.generate(input_ids=prompts, sampling_params=params))
        assert runner.late_compiles == 0 and seen
        # a batch no graph fits (int32 token ids: a dtype guard fails): dynamo raises rather than compile,
        # and the step runs eager (it rewrites the last step's slots: the engine serves nothing after this)
        batch = seen[-1]
        batch.input_ids = batch.input_ids.to(torch.int32)
        with torch.inference_mode():
            runner._run_compiled(batch)
        assert runner.late_compiles == 1


def test_compiled_decode_runs_eager_where_no_graph_fits(qwen3_next_short_path, monkeypatch, caplog):
    """A step that no graph compiled at start-up fits is never compiled while serving: dynamo,
    asked to recompile, raises (``error_on_recompile``, set around each compiled call), and the
    step runs eager: the same tokens as an eager engine, one warning, ``late_compiles`` counting.
    ``torch.compile`` is replaced (the warm-up runs eager), and after start-up by a function that
    raises what dynamo raises, for batches of more rows only."""
    import logging

    from hyla import Engine

    prompts = [[5, 6, 7, 8, 9] * 3, [11, 12, 13] * 4]
    params = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
    with Engine(qwen3_next_short_path, max_total_tokens=1024, max_state_slots=8) as plain:
        expected = [o["output_ids"] for o in plain.generate(input_ids=prompts, sampling_params=params)]
    monkeypatch.setattr(torch, "compile", lambda fn, **options: fn)
    armed = []

    def no_graph(batch):
        armed.append(torch._dynamo.config.error_on_recompile)
        if batch.input_ids.shape[0] == 1:
            return runner.model.forward_unchecked(batch)
        raise torch._dynamo.exc.RecompileError("Recompiling function forward_unchecked: tensor 'batch.input_ids' ...")

    with caplog.at_level(logging.WARNING, logger="hyla.engine"):
        with Engine(qwen3_next_short_path, max_total_tokens=1024, max_state_slots=8, compile_decode=True) as engine:
            runner = engine.scheduler.runner
            runner._compiled_decode = no_graph
            extend, unarmed = runner.forward_extend, []  # the setting seen by prefills, on the scheduler thread

            def watched_extend(*args, **kwargs):
                unarmed.append(not torch._dynamo.config.error_on_recompile)
                return extend(*args, **kwargs)

            runner.forward_extend = watched_extend
            assert [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=params)] == expected
            assert runner.late_compiles > 0 and all(armed)
            engine.generate(input_ids=[3, 4, 5], sampling_params=params)  # a prefill after the fallbacks
            assert len(unarmed) >= 2 and all(unarmed)  # set around the compiled call only
    assert len([r for r in caplog.records if "no graph compiled at start-up fits" in r.getMessage()]) == 1


def test_compiled_decode_graphs_belong_to_their_model(tiny_ckpt_dir, qwen3_next_short_path, monkeypatch):
    """Two compiled engines in one process whose models differ only in a float constant (the RMSNorm
    eps): each runs its own graphs, equal to its own eager decode. The graphs bake such constants in
    and leave the modules unguarded, so a graph shared between the two would run the wrong eps.
    Which graph runs is dynamo's choice (its cache per code object, its guards): dynamo traces alone
    here (backend ``eager``), which bakes the constants in as inductor's graphs do, in seconds."""
    import json

    from checkpoints import make_qwen3_next

    from hyla import Engine

    config = json.loads((qwen3_next_short_path / "config.json").read_text())
    other = make_qwen3_next(tiny_ckpt_dir, moe=False, num_hidden_layers=2, rms_norm_eps=0.5,
                            layer_types=config["layer_types"])
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 2048) for _ in range(n)] for n in (9, 21)]
    params = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}

    def logprobs(path, **options):
        with Engine(path, max_total_tokens=1024, max_state_slots=8, **options) as engine:
            outs = engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True)  # batch 2
            outs.append(engine.generate(input_ids=prompts[0], sampling_params=params, return_logprob=True))
        return [[x[0] for x in out["meta_info"]["output_token_logprobs"]] for out in outs]

    _dynamo_only(monkeypatch)
    first = logprobs(qwen3_next_short_path, compile_decode=True)
    second = logprobs(other, compile_decode=True)
    for eager, compiled in ((logprobs(qwen3_next_short_path), first), (logprobs(other), second)):
        for a, b in zip(eager, compiled):
            assert max(abs(x - y) for x, y in zip(a, b)) <= 1e-4
