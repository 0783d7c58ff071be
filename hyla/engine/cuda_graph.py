"""CUDA graphs for the fused decode step (and the fused verify step of chains): captured once per
batch size, replayed every step.

A decode step of a small model is a few hundred small kernels; launched one by one from Python the
GPU waits on the host (issue 10 measured ~2,300 launches and a host sync per op, 75 ms a step).
``ModelRunner.decode_fused_step`` has no host read and shapes that depend on the batch size only
(``ForwardBatch.fused_decode``), so it is captured here for a ladder of batch sizes, as SGLang's
``CudaGraphRunner`` does, and a step of ``B`` requests replays the smallest graph of at least ``B``.

Inputs live in one static ``[6, max_bs]`` int64 device buffer (token, position, state slot, request
row, KV length, KV slot; and a seventh row, each row's LoRA adapter slot, in the graphs of steps that apply
adapters: ``lora=True``); a step fills a pinned host copy and moves it in one transfer. Rows past
``B`` are padding with the sentinels the pools reserve: state slot ``-1`` (the recurrent kernels
neither read nor write it), KV slot 0 and a spare request-table row (written, never read for a real
request), KV length 1, no adapter. Padded rows' logits are dropped. On a runner that returns hidden states
(``ModelRunner.return_hidden``: MTP) each graph's output is ``(logits, hidden)``.

With ``width=W > 1`` the graphs are a speculative verify step's (``ModelRunner.forward_chains`` on
the fused kernels): ``B`` requests of ``W`` rows each, and a second static buffer ``[W+1, max_bs]``
of the chains' state slots (``ForwardBatch.chain_slots``; ``-1`` for padded requests). Both sets
of graphs share one memory pool: they never run at the same time.

:class:`CudaGraphExtend` does the same for an extend of one sequence (a cached prompt's new part,
an agent's turn: ``ForwardBatch.fused_extend``), captured per token count on a ladder up to
``cuda_graph_max_extend_tokens`` and padded to the smallest that fits; its static inputs
(:class:`ExtendInputs`) are one int64 buffer moved in one transfer, and it shares the decode
graphs' memory pool too.

:class:`CudaGraphMtp` captures the MTP head's forwards (its drafts of ``num_draft`` steps, and its
pass over a verify step's pairs), in a memory pool of their own.
"""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING, Sequence

import torch

from hyla.model.forward_batch import ForwardBatch, FusedExtend
from hyla.model.lora import LoRABatch

if TYPE_CHECKING:
    from hyla.engine.model_runner import ModelRunner

logger = logging.getLogger("hyla.engine")

BATCH_SIZES = (1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384, 448, 512)
FIELDS = ("input_ids", "positions", "state_slots", "req_rows", "kv_lens", "out_cache_loc")
LORA_FIELD = "lora_slots"  # a seventh, on a runner serving LoRA adapters
# verify steps of chains are captured up to this many requests (larger ones run the fused kernels
# eagerly): each graph keeps its logits, [B * W, vocab] fp32 (~300 MB up to 32 requests of 5 tokens
# with a 152k vocabulary), and speculation pays most in small batches
VERIFY_GRAPH_MAX_BS = 32


def capture_batch_sizes(max_bs: int) -> list[int]:
    """The ladder of captured batch sizes up to ``max_bs`` (which is always included)."""
    if max_bs < 1:
        raise ValueError(f"cuda_graph_max_bs must be >= 1, got {max_bs}")
    return sorted({bs for bs in BATCH_SIZES if bs < max_bs} | {max_bs})


def host_buffer(*shape: int, device: torch.device) -> torch.Tensor:
    """A zeroed int64 host buffer for a graph's inputs: pinned for ``device`` on CUDA (a copy from it is
    asynchronous)."""
    t = torch.zeros(*shape, dtype=torch.long)
    return t.pin_memory() if device.type == "cuda" else t


def capture(fn, stream: torch.cuda.Stream, pool=None) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """``fn()`` run twice on ``stream`` (Triton compiles, cuBLAS picks its kernels), then captured
    in a CUDA graph in memory ``pool`` -> ``(graph, the output its replays write)``. ``fn`` has its
    inputs bound (``functools.partial``), never a loop variable's latest value: the CPU tests'
    emulated graphs run it again at every replay (``tests/emulated_cuda_graphs.py``)."""
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = fn()
    return graph, out


class CudaGraphDecode:
    """One captured fused decode step per batch size in :func:`capture_batch_sizes` ``(max_bs)``;
    ``width > 1``: a verify step of chains of that many tokens per request (the module docstring).
    ``pool``: a graph memory pool to share (another instance's :attr:`pool`). ``lora``: steps applying LoRA
    adapters (a runner serving them has a second set: ``ModelRunner.lora_graphs``), each row's adapter slot
    an input; the other set is a step of the base model alone, no adapter's op in it."""

    def __init__(self, runner: "ModelRunner", max_bs: int, width: int = 1, pool=None, lora: bool = False):
        self.runner = runner
        self.width = width
        self.batch_sizes = capture_batch_sizes(max_bs)
        self.max_bs = self.batch_sizes[-1]
        dev, rows = runner.device, self.max_bs * width
        self.fields = FIELDS + ((LORA_FIELD,) if lora else ())
        self.inputs = torch.zeros(len(self.fields), rows, dtype=torch.long, device=dev)
        self.host = host_buffer(len(self.fields), rows, device=dev)
        self.padding = torch.tensor([0, 0, -1, runner.pad_row, 1, 0, 0][:len(self.fields)], dtype=torch.long)
        self.inputs.copy_(self.padding[:, None].expand(-1, rows))
        # a verify step's chain slots (padded requests: -1, no read, no write)
        self.chain = torch.full((width + 1, self.max_bs), -1, dtype=torch.long, device=dev) if width > 1 else None
        self.chain_host = host_buffer(width + 1, self.max_bs, device=dev).fill_(-1) if width > 1 else None
        self._copied = torch.cuda.Event()  # the last host -> device copy (the host buffer is reused)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor | tuple[torch.Tensor, torch.Tensor]] = {}
        self.pool = pool
        self._capture()

    def _capture(self) -> None:
        pool = self.pool
        stream = torch.cuda.Stream(self.runner.device)
        for bs in reversed(self.batch_sizes):  # largest first: the smaller graphs reuse its memory
            rows = bs * self.width
            batch = self.runner.fused_batch(*(self.inputs[j, :rows] for j in range(len(self.fields))),
                                            chain_slots=self.chain[:, :bs] if self.chain is not None else None,
                                            return_hidden=self.runner.return_hidden)
            graph, self.outputs[bs] = capture(functools.partial(self.runner.decode_fused_step, batch), stream, pool)
            pool = graph.pool()
            self.graphs[bs] = graph
        self.pool = pool
        torch.cuda.synchronize(self.runner.device)
        logger.info("CUDA graphs captured for %s batch sizes %s", ("LoRA decode" if len(self.fields) > len(FIELDS)
                    else "decode") if self.width == 1 else f"verify ({self.width}-token chains)", self.batch_sizes)

    def can_run(self, batch_size: int) -> bool:
        return batch_size <= self.max_bs

    def replay(self, columns: Sequence[Sequence[int] | torch.Tensor], input_ids: torch.Tensor | None = None,
               chain: Sequence[Sequence[int]] | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``columns``: the per-row fields (``fields``: :data:`FIELDS`, and the LoRA slots on a runner serving
        adapters), each of length ``B * width`` ->
        logits ``[B * width, V]`` (a view of the graph's output: read it before the next step, in
        stream order), and the hidden states ``[B * width, H]`` too on a runner that returns them
        (``ModelRunner.return_hidden``). ``input_ids [B]`` on the device replace the first column (the overlap
        schedule's tokens, drawn by the previous step and not read by the host). ``chain``: a
        verify step's ``[width + 1][B]`` state slots."""
        w, n = self.width, len(columns[0])
        b = n // w
        bs = next(s for s in self.batch_sizes if s >= b)
        host = self.host
        self._copied.synchronize()
        for j, col in enumerate(columns):
            host[j, :n] = col if isinstance(col, torch.Tensor) else torch.as_tensor(col, dtype=torch.long)
        if bs > b:
            host[:, n:bs * w] = self.padding[:, None]
        # whole buffers: a contiguous pinned source is one asynchronous copy (a [:, :n] slice is not
        # contiguous, and would go through a pageable staging copy); rows past bs are not read
        self.inputs.copy_(host, non_blocking=True)
        if self.chain is not None:
            self.chain_host[:, :b] = torch.as_tensor(chain, dtype=torch.long)
            self.chain_host[:, b:bs] = -1
            self.chain.copy_(self.chain_host, non_blocking=True)
        self._copied.record()
        if input_ids is not None:
            self.inputs[0, :b].copy_(input_ids)
        self.graphs[bs].replay()
        out = self.outputs[bs]
        return tuple(t[:n] for t in out) if isinstance(out, tuple) else out[:n]


# --- extends -------------------------------------------------------------------------------------

# token counts an extend of one sequence is captured at (ModelRunner.forward_extend pads to the
# smallest that fits): steps of at most 1.33x near the top, where padding costs device time
EXTEND_TOKENS = (16, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 448, 512, 640, 768, 896, 1024, 1280, 1536,
                 1792, 2048)
EXTEND_CHECKPOINTS = 4  # checkpoints a captured extend writes at most (a prompt's end - 1 and grid points)
# sequences a prefill batch may have to run as fused extends, one replay each (concurrent agent turns):
# a replay costs ~1 ms of device time however short (~300 kernels, the weights read once), an eager
# batched extend ~25 ms of host time (~1,000 launches: the H200's fused-extend-bypassed row). Reasoned,
# not measured
EXTEND_MAX_SEQS = 8


def extend_buckets(max_tokens: int) -> list[int]:
    """The token counts captured for extends of up to ``max_tokens`` tokens (which is always one)."""
    if max_tokens < 1:
        raise ValueError(f"cuda_graph_max_extend_tokens must be >= 1 (0 turns them off), got {max_tokens}")
    return sorted({t for t in EXTEND_TOKENS if t < max_tokens} | {max_tokens})


class ExtendInputs:
    """The static inputs of fused extends (``ForwardBatch.fused_extend``) of one sequence, up to
    ``tokens`` tokens and :data:`EXTEND_CHECKPOINTS` checkpoints: one int64 device buffer, filled
    from a host copy (pinned on CUDA) in one transfer per step. Per token (``[tokens]`` each): id,
    position, KV slot, KV length; then the sequence's ``cu_seqlens [2]``, state slot, request row,
    checkpoint offsets ``[2]``, positions and slots ``[M]``, its last token's index and its LoRA adapter
    slot (read by the batches made with ``lora``). An extend
    of ``n`` tokens run at ``T >= n`` takes the first ``T`` of each per-token field: the rest is
    padding (token 0 at position 0, written to KV slot 0, attending to one key)."""

    def __init__(self, runner: "ModelRunner", tokens: int):
        self.runner, self.tokens, m = runner, tokens, EXTEND_CHECKPOINTS
        dev = runner.device
        self.size = 4 * tokens + 8 + 2 * m
        self.inputs = torch.zeros(self.size, dtype=torch.long, device=dev)
        self.host = host_buffer(self.size, device=dev)
        self.zeros = torch.zeros(max(tokens, m), dtype=torch.long, device=dev)  # every token's sequence
        self._copied = torch.cuda.Event() if dev.type == "cuda" else None  # the host buffer is reused

    def fill(self, ids: Sequence[int], positions: Sequence[int], out_cache_loc: torch.Tensor, bucket: int, slot: int,
             req_row: int, marks: Sequence[tuple[int, int]], lora_slot: int = 0, *, cached: int) -> None:
        """One sequence's extend of ``n = len(ids)`` tokens after ``cached`` ones, at RoPE ``positions`` (not
        always ``cached + i``: a prompt's images shift them), at ``bucket >= n`` tokens, from state row ``slot``,
        request row ``req_row``, with checkpoints ``marks``: ``(tokens it follows, state row)``, ascending, at
        most :data:`EXTEND_CHECKPOINTS`; applying the LoRA adapter in ``lora_slot`` (0: none)."""
        n, t, m = len(ids), self.tokens, EXTEND_CHECKPOINTS
        if self._copied is not None:
            self._copied.synchronize()
        host = self.host
        start = cached
        host[:4 * t].view(4, t)[:, n:bucket] = torch.tensor([0, 0, 0, 1])[:, None]
        host[0:n] = torch.as_tensor(ids, dtype=torch.long)
        host[t:t + n] = torch.as_tensor(positions, dtype=torch.long)
        host[2 * t:2 * t + n] = out_cache_loc.to(torch.long).cpu()
        host[3 * t:3 * t + n] = torch.arange(start + 1, start + n + 1)
        k = len(marks)
        tail = [0, n, slot, req_row, 0, k] + [p for p, _ in marks] + [1] * (m - k) + [s for _, s in marks] \
            + [0] * (m - k) + [n - 1, lora_slot]
        host[4 * t:] = torch.tensor(tail, dtype=torch.long)
        self.inputs.copy_(host, non_blocking=True)
        if self._copied is not None:
            self._copied.record()

    def batch(self, bucket: int, lora: bool = False) -> ForwardBatch:
        """The fused extend of ``bucket`` tokens over the static inputs (views; nothing is read); ``lora``:
        applying the LoRA adapter in the sequence's slot."""
        runner, t, m, x = self.runner, self.tokens, EXTEND_CHECKPOINTS, self.inputs
        tail = 4 * t
        fe = FusedExtend(cu_seqlens=x[tail:tail + 2], kv_lens=x[3 * t:3 * t + bucket], req_row=x[tail + 3:tail + 4],
                         ckpt_offsets=x[tail + 4:tail + 6], ckpt_pos=x[tail + 6:tail + 6 + m],
                         ckpt_slot=x[tail + 6 + m:tail + 6 + 2 * m], tok_seq=self.zeros[:max(bucket, m)],
                         longest=bucket)
        return ForwardBatch(
            is_decode=False, input_ids=x[:bucket], positions=x[t:t + bucket], extend_lens=[bucket], prefix_lens=[0],
            cu_seqlens=fe.cu_seqlens, out_cache_loc=x[2 * t:2 * t + bucket], kv_indices=fe.cu_seqlens[:0],
            kv_indptr=fe.cu_seqlens, k_buffers=runner.k_buffers, v_buffers=runner.v_buffers,
            state_slots=x[tail + 2:tail + 3], conv_states=runner.conv_states, ssm_states=runner.ssm_states,
            max_token_id=0, req_to_token=runner.table, fused_extend=fe, logits_indices=x[self.size - 2:self.size - 1],
            # every token's adapter slot: the sequence's (an expanded view of its one entry)
            lora=LoRABatch.static(x[self.size - 1:].expand(bucket)) if lora else None,
        )


class CudaGraphExtend:
    """One captured fused extend of one sequence per token count in ``buckets`` (ascending, from
    :func:`extend_buckets`): an extend of ``n`` tokens replays the smallest graph of at least ``n``
    (the module's decode graphs, for an extend: a cached prompt's new part is ~1,000 launches, each
    paid on the host when launched one by one). ``pool``: a graph memory pool to share; ``inputs``: the
    static inputs to read (another set's: the LoRA set shares the base set's); ``lora``: extends applying
    the sequence's LoRA adapter (``CudaGraphDecode``'s ``lora``)."""

    def __init__(self, runner: "ModelRunner", buckets: Sequence[int], pool=None, inputs: ExtendInputs | None = None,
                 lora: bool = False):
        self.runner = runner
        self.buckets = list(buckets)
        self.lora = lora
        self.inputs = ExtendInputs(runner, self.buckets[-1]) if inputs is None else inputs
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = pool
        self._capture()

    def _capture(self) -> None:
        pool, runner = self.pool, self.runner
        stream = torch.cuda.Stream(runner.device)
        for bucket in reversed(self.buckets):  # largest first: the smaller graphs reuse its memory
            # the sentinels: state row 0, the spare request row, KV slot 0 (no request's)
            self.inputs.fill([0] * bucket, range(bucket), torch.zeros(bucket, dtype=torch.long), bucket, 0,
                             runner.pad_row, [], cached=0)
            batch = self.inputs.batch(bucket, self.lora)
            graph, self.outputs[bucket] = capture(functools.partial(runner.model.forward_unchecked, batch), stream, pool)
            pool = graph.pool()
            self.graphs[bucket] = graph
        self.pool = pool
        torch.cuda.synchronize(runner.device)
        logger.info("CUDA graphs captured for %sextends of %s tokens", "LoRA " if self.lora else "", self.buckets)

    def replay(self, bucket: int) -> torch.Tensor:
        """The captured extend of ``bucket`` tokens on the inputs :attr:`inputs` holds (filled for
        it) -> its last real token's logits ``[1, V]`` (a view: read or copy it, in stream order, before
        any other graph of its memory pool replays, a decode step's included: that replay may
        overwrite it)."""
        self.graphs[bucket].replay()
        return self.outputs[bucket]


# --- the MTP head --------------------------------------------------------------------------------


class CudaGraphMtp:
    """The MTP head's forwards on a fused runner (``MtpDrafter`` with ``fused``), captured in CUDA
    graphs that share no memory with the model's (a draft runs between the model's steps):

    * **a draft** per batch size of :func:`capture_batch_sizes` ``(max_bs)``: the whole loop of
      ``num_draft`` steps (``MtpDrafter.draft_steps``), each step's tokens the argmax of the step
      before, on the device. Static inputs: each step's positions, request rows, KV lengths and KV
      slots ``[num_draft, 4, bs]`` and the first tokens ``[bs]`` in one int64 buffer, moved in one
      transfer; the first hidden states gathered from the state slots on the device. Output: the
      drafts ``[num_draft, bs]``. A draft of fewer steps pads the rest (its outputs are dropped).
    * **a pass over a verify step's pairs** (``MtpDrafter.pair_pass``, K/V writes) per row count
      ``bs * W`` (``W = num_draft + 1`` pairs per request at most), for the batch sizes up to
      :data:`VERIFY_GRAPH_MAX_BS`: tokens, positions, request rows, KV lengths, KV slots ``[5, rows]``
      and the pairs' hidden states ``[rows, H]``.

    Padding rows are the sentinels: the spare request row, KV length 1, KV slot 0."""

    def __init__(self, drafter, max_bs: int):
        self.drafter = drafter
        self.steps = drafter.num_draft
        self.width = drafter.num_draft + 1
        self.batch_sizes = capture_batch_sizes(max_bs)
        self.max_bs = self.batch_sizes[-1]
        self.row_counts = [bs * self.width for bs in self.batch_sizes if bs <= VERIFY_GRAPH_MAX_BS]
        # the batch sizes a draft is captured for: none for trees (topk > 1: the head's eager rows draft them)
        self.draft_batch_sizes = self.batch_sizes if drafter.topk == 1 else []
        dev, k, rows = drafter.device, self.steps, self.row_counts[-1]
        self.pad_step = torch.tensor([0, drafter.pad_row, 1, 0], dtype=torch.long)  # position, row, KV length, slot
        self.pad_pair = torch.tensor([0, 0, drafter.pad_row, 1, 0], dtype=torch.long)  # token first
        # the draft's inputs: [k, 4, max_bs] step columns, then [max_bs] first tokens, then [max_bs] state slots
        self.draft_size = (4 * k + 2) * self.max_bs
        self.draft_in = torch.zeros(self.draft_size, dtype=torch.long, device=dev)
        self.draft_host = host_buffer(self.draft_size, device=dev)
        self.draft_hidden = torch.zeros(self.max_bs, drafter.hidden_states.shape[1], dtype=drafter.hidden_states.dtype,
                                        device=dev)
        self.pair_in = torch.zeros(5, rows, dtype=torch.long, device=dev)
        self.pair_host = host_buffer(5, rows, device=dev)
        self.pair_hidden = torch.zeros(rows, drafter.hidden_states.shape[1], dtype=drafter.hidden_states.dtype,
                                       device=dev)
        self._fill_draft_padding(0)
        self.draft_in.copy_(self.draft_host)
        self.pair_in.copy_(self.pad_pair[:, None].expand(-1, rows))
        self._copied = torch.cuda.Event()  # the last host -> device copy (the host buffers are reused)
        self.graphs: dict[tuple[str, int], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[str, int], torch.Tensor] = {}
        self.pool = None
        self._capture()

    def _draft_views(self, buf: torch.Tensor, bs: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(steps [k, 4, bs], tokens [bs], state slots [bs])`` of a draft's input buffer."""
        k, m = self.steps, self.max_bs
        steps = buf[:4 * k * m].view(k, 4, m)[:, :, :bs]
        return steps, buf[4 * k * m:4 * k * m + bs], buf[(4 * k + 1) * m:(4 * k + 1) * m + bs]

    def _fill_draft_padding(self, b: int) -> None:
        steps, tokens, slots = self._draft_views(self.draft_host, self.max_bs)
        steps[:, :, b:] = self.pad_step[None, :, None]
        tokens[b:] = 0
        slots[b:] = 0  # state slot 0: a real row to gather a hidden state from (the pool's sentinel)

    def _capture(self) -> None:
        d, pool = self.drafter, None
        stream = torch.cuda.Stream(d.device)
        for bs in reversed(self.draft_batch_sizes):  # largest first: the smaller graphs reuse its memory
            steps, tokens, _ = self._draft_views(self.draft_in, bs)
            hidden = self.draft_hidden[:bs]
            graph, self.outputs["draft", bs] = capture(functools.partial(d.draft_steps, steps, tokens, hidden), stream,
                                                       pool)
            pool = graph.pool()
            self.graphs["draft", bs] = graph
        for rows in reversed(self.row_counts):
            cols, hidden = self.pair_in[:, :rows], self.pair_hidden[:rows]
            graph, self.outputs["pairs", rows] = capture(functools.partial(d.pair_pass, cols, hidden), stream, pool)
            pool = graph.pool()
            self.graphs["pairs", rows] = graph
        self.pool = pool
        torch.cuda.synchronize(d.device)
        logger.info("CUDA graphs captured for the MTP head: drafts of %d steps for batch sizes %s, verify pairs "
                    "for row counts %s", self.steps, self.draft_batch_sizes, self.row_counts)

    def can_run(self, batch_size: int) -> bool:
        return batch_size <= max(self.draft_batch_sizes, default=0)

    def can_run_pairs(self, rows: int) -> bool:
        return rows <= self.row_counts[-1]

    def draft(self, steps: torch.Tensor, tokens: torch.Tensor, state_slots: torch.Tensor) -> torch.Tensor:
        """A draft of ``B`` rows: ``steps [k, 4, B]`` (``k <= num_draft``), ``tokens [B]`` and
        ``state_slots [B]`` on the host (the first hidden states are those slots') -> the drafts
        ``[num_draft, B]`` (a view of the graph's output: read it before the next draft)."""
        k, b = steps.shape[0], steps.shape[2]
        bs = next(s for s in self.batch_sizes if s >= b)
        self._copied.synchronize()
        self._fill_draft_padding(b)
        host_steps, host_tokens, host_slots = self._draft_views(self.draft_host, self.max_bs)
        host_steps[:k, :, :b] = steps
        host_steps[k:] = self.pad_step[None, :, None]
        host_tokens[:b], host_slots[:b] = tokens, state_slots
        self.draft_in.copy_(self.draft_host, non_blocking=True)
        self._copied.record()
        slots = self._draft_views(self.draft_in, bs)[2]
        torch.index_select(self.drafter.hidden_states, 0, slots, out=self.draft_hidden[:bs])
        self.graphs["draft", bs].replay()
        return self.outputs["draft", bs][:, :b]

    def pairs(self, cols: torch.Tensor, hidden: torch.Tensor) -> None:
        """The pass over ``T`` pairs: ``cols [5, T]`` on the host, ``hidden [T, H]`` on the device."""
        t = cols.shape[1]
        rows = next(r for r in self.row_counts if r >= t)
        self._copied.synchronize()
        self.pair_host[:, :t] = cols
        self.pair_host[:, t:rows] = self.pad_pair[:, None]
        self.pair_in.copy_(self.pair_host, non_blocking=True)
        self._copied.record()
        self.pair_hidden[:t].copy_(hidden)
        self.graphs["pairs", rows].replay()
