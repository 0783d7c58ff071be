"""CUDA graphs for the fused decode step (and the fused verify step of chains): captured once per
batch size, replayed every step.

A decode step of a small model is a few hundred small kernels; launched one by one from Python the
GPU waits on the host (issue 10 measured ~2,300 launches and a host sync per op, 75 ms a step).
``ModelRunner.decode_fused_step`` has no host read and shapes that depend on the batch size only
(``ForwardBatch.fused_decode``), so it is captured here for a ladder of batch sizes, as SGLang's
``CudaGraphRunner`` does, and a step of ``B`` requests replays the smallest graph of at least ``B``.

Inputs live in one static ``[6, max_bs]`` int64 device buffer (token, position, state slot, request
row, KV length, KV slot); a step fills a pinned host copy and moves it in one transfer. Rows past
``B`` are padding with the sentinels the pools reserve: state slot ``-1`` (the recurrent kernels
neither read nor write it), KV slot 0 and a spare request-table row (written, never read for a real
request), KV length 1. Padded rows' logits are dropped.

With ``width=W > 1`` the graphs are a speculative verify step's (``ModelRunner.forward_chains`` on
the fused kernels): ``B`` requests of ``W`` rows each, and a second static buffer ``[W+1, max_bs]``
of the chains' state slots (``ForwardBatch.chain_slots``; ``-1`` for padded requests). Both sets
of graphs share one memory pool: they never run at the same time.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Sequence

import torch

if TYPE_CHECKING:
    from hyla.engine.model_runner import ModelRunner

logger = logging.getLogger("hyla.engine")

BATCH_SIZES = (1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384, 448, 512)
FIELDS = ("input_ids", "positions", "state_slots", "req_rows", "kv_lens", "out_cache_loc")
# verify steps of chains are captured up to this many requests (larger ones run the fused kernels
# eagerly): each graph keeps its logits, [B * W, vocab] fp32 (~300 MB up to 32 requests of 5 tokens
# with a 152k vocabulary), and speculation pays most in small batches
VERIFY_GRAPH_MAX_BS = 32


def capture_batch_sizes(max_bs: int) -> list[int]:
    """The ladder of captured batch sizes up to ``max_bs`` (which is always included)."""
    if max_bs < 1:
        raise ValueError(f"cuda_graph_max_bs must be >= 1, got {max_bs}")
    return sorted({bs for bs in BATCH_SIZES if bs < max_bs} | {max_bs})


class CudaGraphDecode:
    """One captured fused decode step per batch size in :func:`capture_batch_sizes` ``(max_bs)``;
    ``width > 1``: a verify step of chains of that many tokens per request (the module docstring).
    ``pool``: a graph memory pool to share (another instance's :attr:`pool`)."""

    def __init__(self, runner: "ModelRunner", max_bs: int, width: int = 1, pool=None):
        self.runner = runner
        self.width = width
        self.batch_sizes = capture_batch_sizes(max_bs)
        self.max_bs = self.batch_sizes[-1]
        dev, rows = runner.device, self.max_bs * width
        self.inputs = torch.zeros(len(FIELDS), rows, dtype=torch.long, device=dev)
        self.host = torch.zeros(len(FIELDS), rows, dtype=torch.long).pin_memory()
        self.padding = torch.tensor([0, 0, -1, runner.pad_row, 1, 0], dtype=torch.long)  # per field
        self.inputs.copy_(self.padding[:, None].expand(-1, rows))
        # a verify step's chain slots (padded requests: -1, no read, no write)
        self.chain = torch.full((width + 1, self.max_bs), -1, dtype=torch.long, device=dev) if width > 1 else None
        self.chain_host = torch.full((width + 1, self.max_bs), -1, dtype=torch.long).pin_memory() \
            if width > 1 else None
        self._copied = torch.cuda.Event()  # the last host -> device copy (the host buffer is reused)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = pool
        self._capture()

    def _capture(self) -> None:
        pool = self.pool
        stream = torch.cuda.Stream(self.runner.device)
        for bs in reversed(self.batch_sizes):  # largest first: the smaller graphs reuse its memory
            rows = bs * self.width
            batch = self.runner.fused_batch(*(self.inputs[j, :rows] for j in range(len(FIELDS))),
                                            chain_slots=self.chain[:, :bs] if self.chain is not None else None)
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):  # warm-up: Triton compiles, cuBLAS picks its kernels
                for _ in range(2):
                    self.runner.decode_fused_step(batch)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[bs] = self.runner.decode_fused_step(batch)
            pool = graph.pool()
            self.graphs[bs] = graph
        self.pool = pool
        torch.cuda.synchronize(self.runner.device)
        logger.info("CUDA graphs captured for %s batch sizes %s", "decode" if self.width == 1 else
                    f"verify ({self.width}-token chains)", self.batch_sizes)

    def can_run(self, batch_size: int) -> bool:
        return batch_size <= self.max_bs

    def replay(self, columns: Sequence[Sequence[int] | torch.Tensor], input_ids: torch.Tensor | None = None,
               chain: Sequence[Sequence[int]] | None = None) -> torch.Tensor:
        """``columns``: the six per-row fields of :data:`FIELDS`, each of length ``B * width`` ->
        logits ``[B * width, V]`` (a view of the graph's output: read it before the next step, in
        stream order). ``input_ids [B]`` on the device replace the first column (the overlap
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
        return self.outputs[bs][:n]
