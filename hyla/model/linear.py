"""Projections: :class:`Linear`, and the layouts and paths that make an fp32 CPU projection fast.

A decode step multiplies a few rows by each weight, and on a CPU that is a stream of the weight
through memory: how fast depends on which GEMM runs and on the weight's layout, not on arithmetic.
What this file chooses, and where (every rule measured; ``docs/benchmarks.md``, the "CPU few-row
projections" and "CPU serving at a 0.65 B model" sections):

* **at load** (:func:`relayout_weights_`): fp32 CPU weights column-major, where MKL's one-thread
  GEMM of a few rows is fastest; a tied LM head keeps the embedding's row-major storage;
* **eager steps of a few rows** (:func:`few_row_linear`): oneDNN's GEMM for a vocabulary-sized
  weight, else on more than one thread one ``bmm`` split across the threads (:func:`split_linear`),
  since MKL runs such a GEMM on one;
* **``compile_decode``'s graphs** (``hyla.engine.model_runner``): the batch-1 graph's dot products
  over row-major weights (:func:`keep_row_major_weights_`), the graph of more rows' oneDNN GEMM on
  weights packed once (:func:`pack_weights_`, :class:`PackedWeight`, the custom op
  ``hyla::packed_linear``) or, for smaller models, inductor's frozen C++ GEMMs.

Everything else (bf16, GPU weights, more rows) is ``F.linear``. Every path sums in another order
than ``F.linear``: the results agree within fp32 rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hyla.model.lora import LinearLoRA
from hyla.model.quantization import FP8, fp8_linear


class Linear(nn.Linear):
    """``nn.Linear``, plus a path for a compiled CPU decode step of one row and ones for eager steps
    of a few rows.

    MKL's GEMM with one row streams an fp32 weight at about half the memory bandwidth that a plain
    dot product per output row reaches: 25 MB of the default model's projections took ~1.7 vs
    ~0.9 ms on one core (llama.cpp's matmul is such a loop). Inside a ``torch.compile`` graph of one
    row, a ``Linear`` holding ``rows`` (its weight row-major, ``[out, in]``: the weight itself, or on
    one thread a copy, where a large weight holds none: :func:`keep_row_major_weights_`) is that dot
    product, ``(rows * x).sum(-1)``, which inductor compiles into one vectorised reduction streaming
    ``rows`` once. Eager, a few-row fp32 CPU projection may take :func:`few_row_linear`: oneDNN's GEMM for a
    vocabulary-sized row-major weight (rows in ``ONEDNN_ROWS``, any threads), else with more than one
    thread :func:`split_linear` (up to ``SPLIT_MAX_ROWS`` rows; MKL would run it on one thread).
    Everywhere else (more rows, one thread, GPU, no ``rows``) it is ``F.linear``; in the compiled CPU
    steps of more rows, oneDNN's GEMM on the weight packed once (``packed``, :func:`pack_weights_`,
    large weights) or inductor's C++ GEMM template on weights it packed at compile time
    (``ModelRunner``'s frozen graph). Sums in another order: within fp32 rounding.
    """

    rows: torch.Tensor | None = None
    packed: PackedWeight | None = None
    lora: LinearLoRA | None = None  # LoRA adapters' weights (lora.py): their update added to the rows they apply to
    lora_refused: str | None = None  # why no adapter may target this projection (lora.read_adapter says so)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.forward_base(x)
        return y if self.lora is None else self.lora.add_(y, x)

    def forward_base(self, x: torch.Tensor) -> torch.Tensor:
        """The projection by the weight itself (no adapter)."""
        if self.weight.dtype == FP8:  # a weight kept in FP8 with its scales (quantization.py)
            y = fp8_linear(x, self.weight, self.weight_scale, self.weight_block, self.bias)
            tail = getattr(self, "weight_tail", None)  # its last rows in the model's dtype
            if tail is not None:
                start = self.weight.shape[0] - tail.shape[0]
                y[..., start:] = F.linear(x, tail, None if self.bias is None else self.bias[start:])
            return y
        # the batch-1 graph: a static row count of 1 (the graph of more rows guards on its symbolic one not being 1)
        if self.rows is not None and x.dim() == 2 and type(x.shape[0]) is int and x.shape[0] == 1 \
                and torch.compiler.is_compiling():
            y = (self.rows * x).sum(-1, keepdim=True).view(1, -1)  # [out, in] * [1, in] -> [1, out]
            return y if self.bias is None else y + self.bias
        # the graph of more rows (it guards on its row count not being 1, which it never is)
        if self.packed is not None and x.dim() == 2 and torch.compiler.is_compiling() and x.shape[0] != 1:
            y = torch.ops.hyla.packed_linear(x, self.weight, self.packed)
            return y if self.bias is None else y + self.bias
        # eager only, and asked first: traced, the row-count test would guard the graph to that many rows
        if not torch.compiler.is_compiling() and x.dim() == 2 and mkl_weight(self.weight):
            y = few_row_linear(x, self.weight)
            if y is not None:
                return y if self.bias is None else y + self.bias
        return F.linear(x, self.weight, self.bias)


# A few rows (decode steps) through an fp32 CPU projection, with more than one thread: MKL runs
# such a GEMM on one thread, so a 0.65 B model's decode step streamed its weights at one core's
# rate (~20 GB/s) whatever the threads (docs/benchmarks.md, "CPU serving at a 0.65 B model").
SPLIT_MAX_ROWS = 16  # above, MKL's own threading is as good (prefill: hundreds of rows)
SPLIT_MIN_WEIGHT = 1 << 16  # elements: below, the split's fixed cost (a bmm, a sum) exceeds the gain
# 2-64 rows through a row-major weight of a vocabulary's size (a tied lm_head: the embedding's
# storage) take oneDNN's GEMM, 1.3-2x faster than MKL's or the split there; weights of a layer's size
# gain nothing (docs/benchmarks.md, "CPU few-row projections: what changed, what was tried").
ONEDNN_ROWS = range(2, 65)  # 1 row: the split is as fast; from 128 rows on, MKL is as fast at 1 thread or faster
ONEDNN_MIN_WEIGHT = 1 << 24  # elements (64 MB in fp32)
HAS_ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def few_row_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """``F.linear(x, weight)`` (``x [R, in]``, an fp32 CPU ``weight [out, in]``, no bias) where MKL's GEMM,
    which ``F.linear`` runs, is slow at a few rows, eager; ``None`` elsewhere (the caller runs ``F.linear``):

    * ``R`` in ``ONEDNN_ROWS`` through a row-major weight of at least ``ONEDNN_MIN_WEIGHT`` elements:
      :func:`onednn_linear`, on the weight as it is (no copy);
    * 1-``SPLIT_MAX_ROWS`` rows on more than one thread, a weight of at least ``SPLIT_MIN_WEIGHT``:
      :func:`split_linear` (MKL runs a few-row GEMM on one thread).
    """
    rows = x.shape[0]
    if rows in ONEDNN_ROWS and HAS_ONEDNN and weight.numel() >= ONEDNN_MIN_WEIGHT and weight.is_contiguous():
        return onednn_linear(x, weight)
    if 0 < rows <= SPLIT_MAX_ROWS and weight.numel() >= SPLIT_MIN_WEIGHT and (threads := torch.get_num_threads()) > 1:
        return split_linear(x, weight, 2 * threads)
    return None


def onednn_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, weight)`` (no bias) by oneDNN's GEMM (``torch.ops.mkldnn._linear_pointwise``, the
    op of inductor's oneDNN linear fusions) on the weight as it is (``[out, in]``)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")


class PackedWeight:
    """An fp32 projection weight packed once for oneDNN's GEMM (``mkldnn._reorder_linear_weight``, for
    ``PACK_ROWS`` rows; any row count runs on it), for ``compile_decode``'s graph of more rows
    (:func:`pack_weights_`, :func:`packed_linear`). An opaque object of torch's custom ops, of the
    value kind, hoisted: the compiled graph takes it as an input, not as a constant, so the graph holds
    no packed tensor and inductor's cache keeps it across processes (a frozen graph's packed constants
    cannot be pickled). Equal only to itself: every projection passes its own."""

    def __init__(self, weight: torch.Tensor, rows: int):
        self.tensor = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), rows)
        self.nbytes = weight.nbytes  # the packed copy is about the weight's size

    def __eq__(self, other: object) -> bool:
        return self is other

    def __hash__(self) -> int:
        return id(self)

    def __fx_repr__(self) -> tuple[str, dict[str, type]]:
        return "PackedWeight", {"PackedWeight": PackedWeight}


def packed_linear(x: torch.Tensor, weight: torch.Tensor, packed: PackedWeight) -> torch.Tensor:
    """``F.linear(x, weight)`` (``x [R, in]``, no bias) by oneDNN's GEMM on ``packed``, the weight
    packed (``weight`` itself: for the output's shape while a graph is traced). The custom op
    ``torch.ops.hyla.packed_linear``, where ``HAS_PACKED``."""
    return onednn_linear(x, packed.tensor)


def _register_packed_linear() -> bool:
    """Register :class:`PackedWeight` as an opaque type and :func:`packed_linear` as the custom op
    ``hyla::packed_linear``; False where this torch cannot (no oneDNN, no hoisted opaque objects):
    then nothing is packed and the frozen graph packs its own weights."""
    if not HAS_ONEDNN:
        return False
    try:
        from torch._library.opaque_object import register_opaque_type
        register_opaque_type(PackedWeight, typ="value", hoist=True)
        op = torch.library.custom_op("hyla::packed_linear", packed_linear, mutates_args=())
    except (ImportError, TypeError, ValueError, RuntimeError):  # an older torch's API
        return False
    op.register_fake(lambda x, weight, packed: x.new_empty(x.shape[0], weight.shape[0]))
    return True


HAS_PACKED = _register_packed_linear()


def split_linear(x: torch.Tensor, weight: torch.Tensor, blocks: int) -> torch.Tensor | None:
    """``F.linear(x, weight)`` (``x [R, in]``, ``weight [out, in]``, no bias) as one ``bmm`` over
    ``blocks`` contiguous blocks of the weight, which ATen runs on its threads block by block: each
    thread streams its own part of the weight. A column-major weight (``[in, out]`` contiguous: the
    layout of :func:`relayout_weights_`) is split along the input dim and the ``blocks`` partial
    products summed; a row-major one (a tied ``lm_head``, the embedding's storage) along the outputs.
    ``None`` where ``blocks`` divides neither (the caller runs ``F.linear``). Sums in another order:
    within fp32 rounding of ``F.linear``."""
    rows, k = x.shape
    n = weight.shape[0]
    wt = weight.t()
    if wt.is_contiguous() and k % blocks == 0:  # [blocks, in/blocks, out] slabs of [in, out]
        parts = torch.bmm(x.reshape(rows, blocks, k // blocks).transpose(0, 1), wt.view(blocks, k // blocks, n))
        return parts.sum(0)  # [blocks, R, out] -> [R, out]
    if weight.is_contiguous() and n % blocks == 0:  # [blocks, out/blocks, in] slabs of [out, in]
        y = torch.bmm(x.expand(blocks, rows, k), weight.view(blocks, n // blocks, k).transpose(1, 2))
        return y.transpose(0, 1).reshape(rows, n)  # [blocks, R, out/blocks] -> [R, out]
    return None


def mkl_weight(w: torch.Tensor) -> bool:
    """An fp32 CPU weight: MKL runs its GEMMs (bf16 goes to oneDNN, GPU weights to cuBLAS), so its
    layout is chosen for MKL (:func:`relayout_weights_`, :func:`keep_row_major_weights_`)."""
    return w.device.type == "cpu" and w.dtype == torch.float32


# compile_decode's one-row graph on one thread: a column-major weight of at least this many elements
# streams faster through MKL's one-row GEMM (F.linear in the graph) than through the dot products over a
# row-major copy, and keeps no copy. The 0.65 B model (every projection 2-8 M elements), a decode step
# of the one-row graph, 1 thread: 168 ms without the copies against 189 with them (eager: 182), and
# 2 GB less memory. On more threads the dot products run in parallel and MKL's one-row GEMM does not
# (2 threads: 102 ms with the copies, 142 without); the built-in model's weights (<= 1 M elements)
# gain from the dot products at 1 thread too (docs/benchmarks.md, "CPU serving at a 0.65 B model: what
# changed").
ROW_COPY_MAX_ELEMENTS_ONE_THREAD = 1 << 21


@torch.no_grad()
def keep_row_major_weights_(module: nn.Module, threads: int | None = None) -> int:
    """Give every fp32 CPU :class:`Linear` of ``module`` its ``rows``, a row-major weight for
    ``compile_decode``'s batch-1 graph (the weights are column-major for MKL: :func:`relayout_weights_`):

    * a row-major weight is its own ``rows``;
    * on more than one thread (``threads``, default torch's), a column-major weight is made row-major
      in place and is its own ``rows``: no copy. There every few-row eager projection is split across
      the threads (:func:`split_linear`), as fast on either layout, and prefill's GEMMs are too; the
      compiled graph of more rows packs its own (:func:`pack_weights_`, or ``ModelRunner``'s frozen graph);
    * on one thread, where MKL's few-row GEMM is faster column-major, a row-major copy, except for a
      weight of ``ROW_COPY_MAX_ELEMENTS_ONE_THREAD`` elements or more, which keeps none (its
      one-row step is MKL's GEMM).

    Returns the bytes copied."""
    threads = torch.get_num_threads() if threads is None else threads
    copied = 0
    for m in module.modules():
        if not isinstance(m, Linear) or not mkl_weight(m.weight):
            continue
        if threads > 1 and not m.weight.is_contiguous():
            m.weight.data = m.weight.data.contiguous()
        if m.weight.is_contiguous():
            m.rows = m.weight.detach()
        elif m.weight.numel() >= ROW_COPY_MAX_ELEMENTS_ONE_THREAD:
            m.rows = None
        else:
            m.rows = m.weight.detach().contiguous()
            copied += m.rows.nbytes
    return copied


# compile_decode's graph of more rows, on a model with an fp32 projection of at least PACK_MIN_WEIGHT
# elements: each such projection runs oneDNN's GEMM on its weight packed once at start-up (PackedWeight),
# in a graph compiled without freezing, which inductor's cache keeps, so a later start loads it. The
# 0.65 B model (projections of 2-8 M elements), 2 threads: an 8-row step 0.73-0.81x the eager one's
# time against the frozen graph's 0.76x; start-up 114 s with an empty cache, 39 s with the graph
# cached, against 212-249 s at every start frozen. A model whose weights are all smaller keeps the
# frozen graph, whose C++ GEMM template beats oneDNN's per-call cost on such weights one by one (an
# 8-row step of the built-in model's sizes 0.49x eager frozen, 0.54-0.57x packed) and whose start-up
# is a minute or so (docs/benchmarks.md, "CPU serving at a 0.65 B model: what changed"). The
# built-in model's LM head (4096 x 256) is at the threshold, so the built-in model runs packed: 8
# concurrent 128 -> 64 requests 370 output tok/s against 366 frozen (medians of 5, interleaved, 2
# threads, a loaded machine), start-up 19 s with inductor's cache against 100 s (2026-12-02).
PACK_MIN_WEIGHT = 1 << 20
PACK_ROWS = 8  # the row count the packing is laid out for


@torch.no_grad()
def pack_weights_(module: nn.Module, min_elements: int | None = None) -> int:
    """Give every fp32 CPU :class:`Linear` of ``module`` whose weight has at least ``min_elements``
    elements (default ``PACK_MIN_WEIGHT``) its ``packed`` weight (:class:`PackedWeight`), where torch
    has oneDNN and opaque objects (``HAS_PACKED``); the others get none. For ``compile_decode``'s
    graph of more rows; costs the packed weights' memory. Returns their bytes (0: none packed)."""
    min_elements = PACK_MIN_WEIGHT if min_elements is None else min_elements
    packed = 0
    for m in module.modules():
        if isinstance(m, Linear):
            m.packed = None
            if HAS_PACKED and mkl_weight(m.weight) and m.weight.numel() >= min_elements:
                m.packed = PackedWeight(m.weight, PACK_ROWS)
                packed += m.packed.nbytes
    return packed


@torch.no_grad()
def relayout_weights_(module: nn.Module, keep: torch.Tensor | None = None) -> None:
    """Store the fp32 CPU projection weights of ``module`` (``nn.Linear`` weights, and the stacked
    expert weights a module names in its ``stacked_weights``, ``[..., out, in]``) column-major: same shapes, same values. MKL's single-thread GEMM with few rows, i.e. decode, is
    1.3-2.4x faster on a ``[in, out]``-contiguous weight (``x @ W`` instead of ``x @ W^T``: 10 vs 17 us
    for a 1024x256 projection at batch 1, 184 vs 444 us for the 4096-row lm_head at batch 8); prefill
    GEMMs are unaffected, and bf16 (oneDNN) or GPU weights are left alone. A weight sharing storage
    with ``keep`` (the embedding of a tied lm_head) keeps its layout: no second copy."""
    keep_ptr = keep.data_ptr() if keep is not None else None
    for m in module.modules():
        params = [m.weight] if isinstance(m, nn.Linear) else [getattr(m, name) for name in m.stacked_weights] \
            if hasattr(m, "stacked_weights") else []
        for w in params:
            if not mkl_weight(w) or w.data_ptr() == keep_ptr:
                continue
            if w.transpose(-1, -2).is_contiguous():
                continue
            w.data = w.data.transpose(-1, -2).contiguous().transpose(-1, -2)
