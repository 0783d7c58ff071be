"""Build a ``ForwardBatch`` from scheduled requests and the pools, run the model, return logits.

The runner is the only engine piece that touches device tensors: it builds each step's metadata on
the host (token ids, positions, state slots, the decode KV table gathered from the request table
in one ``index_select``) and moves it to the model's device in one transfer. The batch gets the host
copies it needs for validation (``state_slot_list``, ``max_token_id``), so neither building it nor
the decode forward reads anything back from the device. It never sees the tree.

On CUDA, for models whose mixers all have Triton decode kernels (``HybridForCausalLM.
supports_fused_decode``), decode steps run fused (``ForwardBatch.fused_decode``): attention reads
the KV slots from the request table's device mirror (synced before each decode step), so a decode
step sends six ints per request and reads nothing back; it is replayed from CUDA graphs
(``cuda_graph.py``) unless ``cuda_graph=False``. A model's MoE layers read nothing back either
(their experts gathered or grouped on the device: ``SparseMoE.path``), at any batch size. An extend
of one sequence that wants its last logits only (a cached prompt's new part) runs as a fused extend
alike (``ForwardBatch.fused_extend``, ``fused_extend_max_tokens``), replayed from graphs captured per
token count; a prefill batch of a few such sequences (concurrent agent turns), as one replay per
sequence.

``compile_decode=True`` runs decode steps through ``torch.compile`` (extend steps stay eager). The
compiled graph is dynamic in the batch size and the KV length; batch size 1 is its own variant, of
its own compilation with other inductor options (``ONE_ROW_OPTIONS``, ``ROWS_OPTIONS``). Both are
compiled at construction on scratch pools (a minute or more on a small CPU), so serving never
stalls on a compile; a step that no graph of the warm-up fits runs eager rather than compiling one
(:meth:`_run_compiled`). A model's MoE layers run in the graphs as one opaque op each
(``sparse_moe.moe_experts``: their routing reads the experts' group sizes on the host). In the one-row graph each fp32 projection is a dot product per output row
over its weight in row-major order (``linear.Linear``), not MKL's GEMM, which streams the weights at
about half the speed with one row: on more than one thread the weights themselves, made row-major in
place; on one thread a copy, costing the projections' memory once more
(``linear.keep_row_major_weights_``). The graph
of more rows (batches, verify steps) is compiled frozen: the weights are constants, which inductor
packs once at compile time for its C++ GEMM template (another copy of the projections), where MKL's
GEMM repacks the weight on every call with so few rows. On a model with large projections
(``linear.PACK_MIN_WEIGHT`` elements) those run oneDNN's GEMM on weights packed once at start-up
instead (``linear.pack_weights_``), in a graph compiled unfrozen, which inductor's cache keeps: a later
start loads it (a 0.65 B model: 39 s against about four minutes).
The graphs take the model's float constants as constants and leave its modules unguarded (their
weights and attributes never change after loading); each runner compiles its own copy of the
forward's code, so its graphs serve its own model only (``_own_code``).
See docs/benchmarks.md ("CPU decode") for what it buys.

With ``verify_width=W`` as well (speculative decoding with ``W - 1`` drafts per step; the engine
passes it with ``compile_decode``), the same compiled function runs verify steps as padded chains
(:meth:`forward_chains`, ``ForwardBatch.chain_ckpt_rows``): the recurrent ops and attention pad
every request to ``W`` tokens, so a verify step's shapes depend on the batch size and the token
count only, and its variants (batch 1, larger batches) are compiled at construction too. With
``verify_trees`` (trees of drafts) they are padded *trees* (``ForwardBatch.chain_tree_parents``), chains
among them, from graphs compiled for trees.
``return_hidden=True`` (MTP speculation) makes every graph, compiled or CUDA, of decode and verify
steps return the final hidden states beside the logits (what the MTP head reads).

A draft model's runner (``speculative_algorithm="draft"``) is built the same way over the pools'
companion buffers; its drafting steps are decode steps over explicit columns on the requests' own
rows (:meth:`forward_decode_rows`), so every path above serves them, or, for a tree's beams, decode
batches over KV tables of their own (:meth:`forward_batch`: the eager ops or the compiled graphs).
"""

from __future__ import annotations

import collections
import contextlib
import inspect
import logging
import math
import time
import types
from typing import Any, Callable

import numpy as np
import torch

from hyla.cache.transfer import to_device_packed
from hyla.engine.cuda_graph import (EXTEND_CHECKPOINTS, EXTEND_MAX_SEQS, VERIFY_GRAPH_MAX_BS, CudaGraphDecode,
                                    CudaGraphExtend, ExtendInputs, extend_buckets)
from hyla.engine.request import Req
from hyla.engine.multimodal import EmbeddingCache
from hyla.model.forward_batch import ForwardBatch
from hyla.model.linear import keep_row_major_weights_, pack_weights_
from hyla.model.lora import LoRABatch
from hyla.model.ops.tree import SHORT_EXTEND
from hyla.model.ops import gpu as gpu_ops
from hyla.model.ops.varlen import check_slot_values

logger = logging.getLogger("hyla.engine")


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv_pool, state_pool, req_to_token, device: torch.device,
                 compile_decode: bool = False, cuda_graph: bool = True, cuda_graph_max_bs: int = 256,
                 fused_decode: bool | None = None, first_buffers: tuple[int, int] = (0, 0),
                 verify_width: int | None = None, fused_extend_max_tokens: int = 0, return_hidden: bool = False,
                 verify_trees: bool = False, image_cache: EmbeddingCache | None = None):
        """``first_buffers``: the pools' first K/V buffer and first state buffer that are this
        model's (a draft model's follow the target's: ``CacheLayout.companion``). ``verify_width``:
        verify steps may run as chains padded to that many tokens per request (:meth:`forward_chains`:
        the fused kernels when decode runs fused, else models of full attention and Gated DeltaNet
        layers, compiled with ``compile_decode``). ``fused_extend_max_tokens``: on a fused runner
        whose model supports it, an extend of one sequence of up to that many tokens runs as a fused
        extend (:meth:`forward_extend`), replayed from CUDA graphs with ``cuda_graph`` (0: never).
        ``return_hidden``: decode and verify steps also return the final hidden states (the MTP
        drafter reads them): the compiled graphs and the decode and verify CUDA graphs are made so.
        ``verify_trees``: verify steps are token trees (``speculative_eagle_topk > 1``): the compiled
        graphs run them as padded trees (:meth:`forward_chains` with ``tree_parents``; chains too, as
        trees); a fused runner verifies trees on the eager ops, as before, and takes no ``verify_width``.
        ``image_cache``: where a model with a vision tower keeps its outputs across requests (a rebuilt runner
        shares it)."""
        self._options = dict(compile_decode=compile_decode, cuda_graph=cuda_graph, cuda_graph_max_bs=cuda_graph_max_bs,
                             fused_decode=fused_decode, first_buffers=first_buffers, verify_width=verify_width,
                             fused_extend_max_tokens=fused_extend_max_tokens, return_hidden=return_hidden,
                             verify_trees=verify_trees, image_cache=image_cache)
        self.model = model
        # a vision-language model reads a prompt's images and their positions; another (a text-only draft model
        # running the target's requests) reads the placeholder tokens as text, at their indices
        self.reads_images = getattr(model, "visual", None) is not None
        self.image_cache = image_cache if self.reads_images else None
        self.kv_pool = kv_pool
        self.state_pool = state_pool
        self.req_to_token = req_to_token
        self.device = torch.device(device)
        # the model's buffers: the pools may hold more layers after them (the MTP head's KV, last; a
        # draft model's KV and states) or before them (the target's, for a draft model's runner)
        (a, s), n, m = first_buffers, model.config.num_attention_layers, model.config.num_linear_layers
        self.k_buffers, self.v_buffers = kv_pool.k_buffers[a:a + n], kv_pool.v_buffers[a:a + n]
        self.conv_states, self.ssm_states = state_pool.conv_states[s:s + m], state_pool.ssm_states[s:s + m]
        self._compiled_decode: Callable[[ForwardBatch], torch.Tensor] | None = None
        self.late_compiles = 0  # compiled steps no graph of the warm-up fitted: run eager (_run_compiled)
        self.compile_failed = False  # compile_decode's graphs failed to compile again (weight_update): runs eager
        self.return_hidden = return_hidden  # what the compiled and CUDA graphs of steps return: logits (and hidden)
        self.graphs = self.verify_graphs = self.extend_graphs = None
        self.lora_graphs = self.lora_verify_graphs = self.lora_extend_graphs = None  # steps applying LoRA adapters
        self.extend_inputs = None  # cuda_graph.ExtendInputs: fused extends run (fused_extend_max_tokens)
        c = model.config
        # LoRA adapters (lora.enable_lora_): every step's rows by adapter slot (ForwardBatch.lora); a second set of
        # CUDA graphs takes each row's slot as an input (steps of the base model alone replay the first set, which
        # runs no adapter's op; verify steps of chains too). Compiled graphs do not apply them
        self.serves_lora = model.lora_scope is not None
        if self.serves_lora and compile_decode:
            raise ValueError("a runner serving LoRA adapters does not run compile_decode")
        if fused_decode and not model.supports_fused_decode():
            raise ValueError(f"{c.architecture} has layers without a fused decode kernel")
        # None: on CUDA when every layer has one (True elsewhere: the tests, under TRITON_INTERPRET=1)
        self.fused = model.supports_fused_decode() and gpu_ops.available(self.device) \
            if fused_decode is None else fused_decode
        # verify steps as padded chains (forward_chains): through the fused kernels, or the PyTorch
        # ops' models of the layers that run them (HybridForCausalLM.supports_chain_verify; compiled with compile_decode)
        chains = not verify_trees if self.fused else compile_decode and model.supports_chain_verify()
        self.verify_width: int | None = verify_width if verify_width is not None and verify_width > 1 \
            and chains else None
        # trees as padded trees through the compiled graphs (a fused runner has no verify_width with trees:
        # its kernels run chains only)
        self.verify_trees = verify_trees and self.verify_width is not None
        if self.fused:
            if self.device.type == "cuda":  # MoE layers: the projections of their input as one GEMM
                model.fuse_moe_inputs_()
            self.table = req_to_token.add_mirror(self.device)  # what the attention kernel reads
            self.pad_row = req_to_token.padding_row
            rows = max(cuda_graph_max_bs, 1) * (self.verify_width or 1)  # a verify step's rows: W per request
            self._arange = torch.arange(rows + 1, dtype=torch.long, device=self.device)
            if cuda_graph and self.device.type == "cuda" and cuda_graph_max_bs > 0:
                self.graphs = CudaGraphDecode(self, cuda_graph_max_bs)
                if self.serves_lora:
                    self.lora_graphs = CudaGraphDecode(self, cuda_graph_max_bs, pool=self.graphs.pool, lora=True)
                if self.verify_width is not None:  # verify steps of chains too, sharing the graphs' memory
                    self.verify_graphs = CudaGraphDecode(self, min(cuda_graph_max_bs, VERIFY_GRAPH_MAX_BS),
                                                         width=self.verify_width, pool=self.graphs.pool)
                    if self.serves_lora:
                        self.lora_verify_graphs = CudaGraphDecode(self, self.verify_graphs.max_bs, width=self.verify_width,
                                                                  pool=self.graphs.pool, lora=True)
            # extends of one sequence (a cached prompt's new part, an agent's turn) as fused extends: graphs
            # per token count, or eager (no graphs: the tests' interpreted kernels on CPU)
            extend_tokens = min(fused_extend_max_tokens, self.table.shape[1])
            if extend_tokens > 0 and model.supports_fused_extend():
                self._extend_buckets = extend_buckets(extend_tokens)
                if self.graphs is not None:
                    self.extend_graphs = CudaGraphExtend(self, self._extend_buckets, pool=self.graphs.pool)
                    self.extend_inputs = self.extend_graphs.inputs
                    if self.serves_lora:
                        self.lora_extend_graphs = CudaGraphExtend(self, self._extend_buckets, pool=self.graphs.pool,
                                                                  inputs=self.extend_inputs, lora=True)
                else:
                    self.extend_inputs = ExtendInputs(self, self._extend_buckets[-1])
        elif self.device.type == "cuda":
            logger.info("%s: no fused decode kernels for its layers; decode runs the PyTorch ops", c.architecture)
        if self.fused and compile_decode:
            logger.warning("compile_decode: decode runs the fused kernels on %s; not compiled", self.device)
        elif compile_decode:
            # two graphs of the forward (_compile: the batch's tensors and sizes guarded, the modules not);
            # the one-row graph's dot products read row-major weights (linear.Linear): on more than one
            # thread the weights themselves, relaid in place; on one, copies (the engine's threads are set)
            copied = keep_row_major_weights_(model)
            logger.info("compile_decode: %.1f MB of row-major weight copies for one-row steps", copied / 1e6)
            # the graph of more rows: large projections on weights packed here (linear.pack_weights_), in
            # a graph inductor caches; else compiled frozen, its GEMMs on weights it packs itself
            packed = pack_weights_(model)
            self._freeze_rows = packed == 0
            if packed:
                logger.info("compile_decode: %.1f MB of weights packed for steps of more rows", packed / 1e6)
            one_row = _compile(model.forward_unchecked, ONE_ROW_OPTIONS)
            rows = _compile(model.forward_unchecked, ROWS_OPTIONS if self._freeze_rows else PACKED_ROWS_OPTIONS)
            self._compiled_decode = _by_row_count(one_row, rows)
            logger.info("compile_decode: compiling the decode graphs%s (a minute or more on a small CPU)",
                        " and verify graphs" if self.verify_width is not None else "")
            start = time.perf_counter()
            with warm_up_config():  # (no batch field is a float)
                self._warm_up_compiled_decode()
            logger.info("compile_decode: compiled in %.0f s", time.perf_counter() - start)

    def rebuilt(self, **changes: Any) -> "ModelRunner":
        """A new runner of the same model, pools and options (but ``changes``, e.g. ``compile_decode``),
        its graphs captured (or compiled) anew: what the weights and the kernels' module switches say
        now goes into them (a weight update; ``benchmarks/gpu_decode.py --variants`` times several in
        one engine, swapping ``Scheduler.runner`` while it is idle)."""
        return ModelRunner(self.model, self.kv_pool, self.state_pool, self.req_to_token, self.device,
                           **{**self._options, **changes})

    @property
    def compiled(self) -> bool:
        """Decode steps run through ``torch.compile`` (``compile_decode``)."""
        return self._compiled_decode is not None

    @property
    def decodes_apart(self) -> bool:
        """A mixed prefill step (``enable_mixed_chunk``) runs its decoding requests as a decode step
        of their own (``Scheduler.run``): where decode steps replay CUDA graphs, one replay through
        the decode kernels. In the extend they would be fused extends replayed one per sequence (each
        replay a pass over the weights) or rows of the eager extend. Elsewhere they ride along in the
        extend, at no cost of their own."""
        return self.graphs is not None

    @torch.inference_mode()
    def forward_extend(self, reqs: list[Req], extend_lens: list[int], out_cache_loc: torch.Tensor,
                       ckpts: list[tuple[int, int, int]], all_logits: bool = False,
                       logit_rows: list[list[int]] | None = None,
                       tree_parents: list[list[int]] | None = None,
                       return_hidden: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Feed ``extend_lens[i]`` tokens of request i after its ``kv_len`` (its draft tokens
        included); logits of each last token ``[B, V]``, of every token ``[sum(extend_lens), V]``
        with ``all_logits`` (speculative verification), or of the tokens at offsets
        ``logit_rows[i]`` of each request, in order (prompt logprobs). ``tree_parents``: a tree
        verify step (``ForwardBatch.tree_parents``); a token's position is then its depth.
        ``return_hidden``: also the final hidden state of every fed token, ``(logits, hidden
        [sum(extend_lens), H])`` (MTP).

        On a fused runner (``fused_extend_max_tokens``), an extend that asks for last logits only,
        of up to ``EXTEND_MAX_SEQS`` sequences, each of up to that many tokens, runs as fused extends,
        one per sequence (:meth:`_forward_extends_fused`)."""
        starts = [r.kv_len for r in reqs]
        images = [self.reads_images and r.images is not None and r.images.touches_image(s, s + n)
                  for r, s, n in zip(reqs, starts, extend_lens)]
        if self.extend_inputs is not None and 1 <= len(reqs) <= EXTEND_MAX_SEQS and tree_parents is None \
                and not all_logits and logit_rows is None and not return_hidden and not any(images) \
                and all(1 <= n <= self._extend_buckets[-1] for n in extend_lens) \
                and all(r.state_slot >= 0 for r in reqs) and _checkpoints_fit(ckpts, len(reqs)):
            return self._forward_extends_fused(reqs, extend_lens, out_cache_loc, ckpts)
        ids: list[int] = []
        pos: list[int] = []
        for i, (r, start, n) in enumerate(zip(reqs, starts, extend_lens)):
            ids.extend(r.tokens(start, start + n))
            if not images[i]:
                pos.extend(self._positions(r, start, n, None if tree_parents is None else tree_parents[i]))
            elif tree_parents is not None:
                raise ValueError(f"request {r.rid}: a token tree feeds no image token")
            else:
                pos.extend(r.images.rope_positions(start, n)[0].tolist())
        mm = self._image_inputs(reqs, starts, extend_lens, images, pos) if any(images) else {}
        seq_lens = [p + n for p, n in zip(starts, extend_lens)]
        table = None
        if tree_parents is not None or max(extend_lens, default=0) <= SHORT_EXTEND:
            # a verify step: the KV table of the batched short-extend attention (as a decode step's)
            table, kv_indices = self._kv_table(reqs, seq_lens)
        else:
            kv_indices = torch.cat([self.req_to_token.read(r.req_pool_idx, 0, n) for r, n in zip(reqs, seq_lens)])
        slots = [r.state_slot for r in reqs]
        cu = prefix_sums(extend_lens)
        host = host_long(ids, pos, cu, prefix_sums(seq_lens), slots, [c[0] for c in ckpts], [c[1] for c in ckpts],
                          [c[2] for c in ckpts])
        extra = [] if table is None else [table.to(torch.long)]
        t = self._to_device(*host, out_cache_loc.to(torch.long), kv_indices.to(torch.long), *extra)
        batch = ForwardBatch(
            is_decode=False, input_ids=t[0], positions=t[1], extend_lens=list(extend_lens),
            prefix_lens=starts, cu_seqlens=t[2], out_cache_loc=t[8], kv_indices=t[9],
            kv_indptr=t[3], k_buffers=self.k_buffers, v_buffers=self.v_buffers,
            state_slots=t[4], conv_states=self.conv_states, ssm_states=self.ssm_states,
            ckpt_seq=t[5], ckpt_len=t[6], ckpt_slot=t[7],
            state_slot_list=slots, ckpt_list=list(ckpts), max_token_id=max(ids, default=-1), tree_parents=tree_parents,
            return_hidden=return_hidden, kv_table=t[10] if extra else None,
            lora=LoRABatch.of(self._lora_slots(reqs), extend_lens, self.device), **mm,
        )
        if all_logits:
            batch.logits_indices = torch.arange(len(ids), dtype=torch.long, device=self.device)
        elif logit_rows is not None:
            rows = [cu[i] + o for i, offs in enumerate(logit_rows) for o in offs]
            batch.logits_indices = torch.tensor(rows, dtype=torch.long).to(self.device)
        return self.model.forward(batch)

    def encode_images(self, req: Req, start: int, end: int) -> None:
        """Run the vision tower for the images ``req``'s tokens ``[start, end)`` reach that it has not embedded
        (``multimodal.PromptImages.encode``): what the scheduler does as it adds a prefill chunk to a step."""
        if self.reads_images and req.images is not None:
            req.images.encode(start, end, self.model.visual, self.image_cache)

    def _shift(self, req: Req, start: int) -> int:
        """How far the RoPE positions of ``req``'s tokens from ``start`` (up to its next image) lie from their
        indices: a prompt's images shift them (``multimodal.PromptImages.shift``), on a model that reads them."""
        images = getattr(req, "images", None) if self.reads_images else None  # (a test's stand-in may lack one)
        return images.shift(start) if images is not None else 0

    def _positions(self, req: Req, start: int, n: int, parents: list[int] | None) -> range | list[int]:
        """:func:`fed_positions` of ``req``'s ``n`` tokens from ``start`` (no image token among them), shifted."""
        return fed_positions(start + self._shift(req, start), n, parents)

    def _image_inputs(self, reqs: list[Req], starts: list[int], extend_lens: list[int], images: list[bool],
                      pos: list[int]) -> dict[str, torch.Tensor]:
        """An extend's image rows (``ForwardBatch.mm_rows`` / ``mm_embeds``, the vision tower run for the
        images not embedded yet) and its multimodal positions (``mrope_positions``; ``pos``: every fed
        token's, the time axis of an image's), for the requests whose tokens touch an image (``images``)."""
        rows: list[int] = []
        embeds: list[torch.Tensor] = []
        columns: list[torch.Tensor] = []
        first = 0
        for r, start, n, touches in zip(reqs, starts, extend_lens, images):
            if touches:
                offsets, part = r.images.embeddings(start, start + n, self.model.visual, self.image_cache)
                rows.extend(first + o for o in offsets)
                embeds.append(part)
                columns.append(r.images.rope_positions(start, n))
            else:
                columns.append(torch.tensor(pos[first:first + n], dtype=torch.long).expand(3, n))
            first += n
        rows_t, mrope = self._to_device(torch.tensor(rows, dtype=torch.long), torch.cat(columns, dim=1))
        return {"mm_rows": rows_t, "mm_embeds": torch.cat(embeds).to(self.device), "mrope_positions": mrope}

    @torch.inference_mode()
    def forward_decode(self, reqs: list[Req], out_cache_loc: torch.Tensor, return_hidden: bool = False,
                       input_ids: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Feed each request's last sampled token (position ``kv_len``); ``[B, V]`` logits, with
        ``return_hidden`` also the final hidden states ``[B, H]`` (from the graphs only on a runner
        built with ``return_hidden``). ``input_ids [B]``: those tokens as drawn on the device, not
        yet in ``output_ids`` (the overlap schedule); the fused step reads them there, the PyTorch
        decode reads them back."""
        pos = [r.kv_len + self._shift(r, r.kv_len) for r in reqs]  # (a prompt's images shift the positions after them)
        ids = [_token_at(r, r.kv_len) for r in reqs] if input_ids is None else None
        return self._decode(ids, pos, [r.state_slot for r in reqs], [r.req_pool_idx for r in reqs],
                            [r.kv_len + 1 for r in reqs], out_cache_loc, return_hidden, input_ids,
                            self._lora_slots(reqs))

    @torch.inference_mode()
    def forward_decode_rows(self, ids: list[int], positions: list[int], state_slots: list[int], req_rows: list[int],
                            kv_lens: list[int], out_cache_loc: torch.Tensor) -> torch.Tensor:
        """A decode step over explicit columns, for a drafter's own steps (a draft model's chains):
        row ``b`` feeds ``ids[b]`` at ``positions[b]``, its K/V written at slot ``out_cache_loc[b]``,
        attending to the first ``kv_lens[b]`` slots of request-table row ``req_rows[b]`` (which must
        list ``out_cache_loc[b]`` last), from and into state slot ``state_slots[b]``. Every decode path
        serves it as it serves :meth:`forward_decode`: the eager ops, the graphs compiled at start-up,
        the fused kernels and their CUDA graphs. ``[B, V]`` logits."""
        return self._decode(ids, positions, state_slots, req_rows, kv_lens, out_cache_loc)

    def _decode(self, ids: list[int] | None, pos: list[int], slots: list[int], rows: list[int], kv_lens: list[int],
                out_cache_loc: torch.Tensor, return_hidden: bool = False, input_ids: torch.Tensor | None = None,
                lora: list[int] | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """A decode step's columns (``ids`` None: ``input_ids`` on the device) -> its outputs. ``lora``: each
        row's LoRA adapter slot (``Req.lora_slot``; None: none has one)."""
        if self.fused:
            return self._decode_fused(ids, pos, slots, rows, kv_lens, out_cache_loc, input_ids, return_hidden, lora)
        if ids is None:
            ids = input_ids.tolist()
        table, kv_indices = self.req_to_token.table(rows, kv_lens)  # every row's slots in one gather
        batch = decode_batch(ids, pos, slots, kv_lens, out_cache_loc, table, kv_indices, self.device,
                             self.k_buffers, self.v_buffers, self.conv_states, self.ssm_states, return_hidden)
        batch.lora = LoRABatch.of(lora, [1] * len(pos), self.device)
        return self._run_decode(batch)  # [B, V] (and [B, H])

    @torch.inference_mode()
    def forward_chains(self, reqs: list[Req], extend_lens: list[int], out_cache_loc: torch.Tensor,
                       ckpt_rows: list[list[int]], return_hidden: bool = False,
                       tree_parents: list[list[int]] | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """A verify step of padded chains (``verify_width`` set; through the compiled graph with
        ``compile_decode``): request ``i`` feeds ``extend_lens[i] <= verify_width`` tokens after its
        ``kv_len`` (``out_cache_loc``: their KV slots, packed), as ``forward_extend`` would, but the
        recurrent ops and attention lay each request out padded to ``verify_width``
        (``ForwardBatch.chain_ckpt_rows``), so the step's shapes depend on the batch size and the
        token count only. The state after its padded position ``j < verify_width - 1`` goes to
        ``ckpt_rows[i][j]`` (so the state after its last fed token is there, unless it fed
        ``verify_width``), after the last padded position to its own slot. Returns the fed tokens'
        logits ``[sum(extend_lens), V]``, as ``forward_extend`` with ``all_logits`` (and, with
        ``return_hidden``, their final hidden states ``[sum(extend_lens), H]``).

        ``tree_parents`` (a runner built with ``verify_trees``): each request's fed tokens form a token
        tree (``ForwardBatch.tree_parents``), padded like chains (``ForwardBatch.chain_tree_parents``):
        fed token ``j``'s state goes to ``ckpt_rows[i][j]`` all the same. On such a runner chains run as
        trees too (one set of graphs)."""
        w = self.verify_width
        if w is None:
            raise ValueError("forward_chains needs a runner built with verify_width (a model whose layers run "
                             "padded chains: HybridForCausalLM.supports_chain_verify)")
        if tree_parents is not None and not self.verify_trees:
            raise ValueError("forward_chains takes tree_parents on a runner built with verify_trees "
                             "(compiled, not fused)")
        if self.verify_trees and tree_parents is None:
            tree_parents = [list(range(-1, n - 1)) for n in extend_lens]
        if [len(r) for r in ckpt_rows] != [w - 1] * len(reqs):
            raise ValueError(f"a verify step of chains takes {w - 1} checkpoint slots per request")
        if any(not 1 <= n <= w for n in extend_lens):
            raise ValueError(f"a verify step of chains feeds 1 to {w} tokens per request, got {list(extend_lens)}")
        if self.fused:
            return self._forward_chains_fused(reqs, extend_lens, out_cache_loc, ckpt_rows, return_hidden)
        ids: list[int] = []
        pos: list[int] = []
        starts = [r.kv_len for r in reqs]
        for i, (r, start, n) in enumerate(zip(reqs, starts, extend_lens)):
            ids.extend(r.tokens(start, start + n))
            pos.extend(self._positions(r, start, n, None if tree_parents is None else tree_parents[i]))
        seq_lens = [p + n for p, n in zip(starts, extend_lens)]
        table, kv_indices = self._kv_table(reqs, seq_lens)
        slots = [r.state_slot for r in reqs]
        host = host_long(ids, pos, prefix_sums(extend_lens), prefix_sums(seq_lens), slots)
        t = self._to_device(*host, _dense(out_cache_loc), kv_indices.to(torch.long),
                            table.to(torch.long), torch.tensor(ckpt_rows, dtype=torch.long).view(len(reqs), w - 1))
        batch = ForwardBatch(
            is_decode=False, input_ids=t[0], positions=t[1], extend_lens=list(extend_lens), prefix_lens=starts,
            cu_seqlens=t[2], out_cache_loc=t[5], kv_indices=t[6], kv_indptr=t[3],
            k_buffers=self.k_buffers, v_buffers=self.v_buffers, state_slots=t[4],
            conv_states=self.conv_states, ssm_states=self.ssm_states, state_slot_list=slots,
            max_token_id=max(ids), kv_table=t[7], chain_ckpt_rows=t[8], chain_ckpt_list=ckpt_rows,
            chain_tree_parents=tree_parents, return_hidden=return_hidden,
        )
        self.model.check_batch(batch)
        run = self._run_compiled if self._compiled_for(batch) else self.model.forward_unchecked
        return run(batch)  # [T, V] (and [T, H])

    @torch.inference_mode()
    def forward_batch(self, batch: ForwardBatch) -> torch.Tensor:
        """A decode batch a drafter built over its scratch slots (:func:`speculative.row_batch`: a
        token per row, each with its own KV table and state slot; a draft model's trees) on this
        runner's buffers, through the path of :meth:`forward_decode`'s PyTorch steps: the graphs
        compiled at start-up with ``compile_decode``, else the eager ops (on a fused runner too: its
        kernels read the request table's rows). ``[B, V]`` logits."""
        if not batch.is_decode or batch.fused_decode or batch.return_hidden:
            raise ValueError("forward_batch takes a decode batch of rows (speculative.row_batch), logits only")
        return self._run_decode(batch)

    def _kv_table(self, reqs: list[Req], seq_lens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(table [B, max(seq_lens)], kv_indices [sum(seq_lens)])``: every request's row of the
        request table in one gather, padded with slot 0, and the same slots packed."""
        return self.req_to_token.table([r.req_pool_idx for r in reqs], seq_lens)

    # --- the fused decode step (CUDA) ---------------------------------------------------------
    def _decode_fused(self, ids: list[int] | None, pos: list[int], slots: list[int], rows: list[int],
                      kv_lens: list[int], out_cache_loc: torch.Tensor, input_ids: torch.Tensor | None = None,
                      return_hidden: bool = False,
                      lora: list[int] | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if self.model.config.num_linear_layers:  # what the batch constructor checks on other paths
            check_slot_values(slots, self.conv_states[0].shape[0], "state_slots")
        if ids is not None:
            if max(ids) >= self.model.config.vocab_size:
                raise ValueError(f"token id {max(ids)} is outside the vocabulary ({self.model.config.vocab_size})")
        else:  # drawn from this model's logits (input_ids): inside the vocabulary
            ids = [0] * len(rows)
        columns = (ids, pos, slots, rows, kv_lens, out_cache_loc)
        self.req_to_token.sync_mirror()  # this step's new slots (and any rows the cache rewrote)
        graphs = self.graphs if lora is None else self.lora_graphs  # (each row's adapter slot: an input of the latter)
        if graphs is not None and graphs.can_run(len(rows)) and self._graphed(return_hidden):
            return _outputs(graphs.replay(columns if lora is None else (*columns, lora), input_ids), return_hidden)
        host = host_long(*columns[:5]) + [out_cache_loc.to(torch.long)]
        dev = self._to_device(*host)
        if input_ids is not None:
            dev[0] = input_ids.to(self.device, torch.long)
        batch = self.fused_batch(*dev, return_hidden=return_hidden)
        batch.lora = LoRABatch.of(lora, [1] * len(rows), self.device)
        return self.decode_fused_step(batch)

    def _forward_chains_fused(self, reqs: list[Req], extend_lens: list[int], out_cache_loc: torch.Tensor,
                              ckpt_rows: list[list[int]],
                              return_hidden: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """:meth:`forward_chains` through the fused decode kernels: request ``i``'s ``W`` padded
        tokens are ``W`` decode rows (``ForwardBatch.chain_slots``), each with its own position, KV
        length and KV slot; attention reads the request table, as in a decode step, so each row sees
        the tokens before it. A padding row repeats the request's last fed token at its position
        (writing its K/V to the sentinel slot 0): what it leaves in the later state rows is what
        the contract leaves there, don't-care."""
        w, b = self.verify_width, len(reqs)
        ids, pos, rows, kv_lens, fed = [], [], [], [], []
        for i, (r, n) in enumerate(zip(reqs, extend_lens)):
            start = r.kv_len
            tokens = r.tokens(start, start + n)
            for j in range(w):
                k = min(j, n - 1)
                ids.append(tokens[k])
                pos.append(start + k + self._shift(r, start))
                kv_lens.append(start + k + 1)
                rows.append(r.req_pool_idx)
            fed.extend(range(i * w, i * w + n))
        if max(ids) >= self.model.config.vocab_size:
            raise ValueError(f"token id {max(ids)} is outside the vocabulary ({self.model.config.vocab_size})")
        own = [r.state_slot for r in reqs]
        chain = [own] + [[ckpt_rows[i][j] for i in range(b)] for j in range(w - 1)] + [own]  # [W+1, B]
        if self.model.config.num_linear_layers:
            used = own + [s for col in chain[1:-1] for s in col]
            check_slot_values(used, self.conv_states[0].shape[0], "the chains' state slots")
            if min(used) < 0:  # -1 would drop a state mid-chain
                raise ValueError("a verify step of chains needs a real state slot for every request and position")
        loc = torch.zeros(b * w, dtype=torch.long)  # padding rows write their K/V to the sentinel slot 0
        loc[fed] = out_cache_loc.to(torch.long).cpu()
        columns = (ids, pos, [s for s in own for _ in range(w)], rows, kv_lens, loc)
        lora = self._lora_slots(reqs)  # (each request's W rows its adapter's slot)
        self.req_to_token.sync_mirror()  # the fed tokens' KV slots, read by attention
        graphs = self.verify_graphs if lora is None else self.lora_verify_graphs
        if graphs is not None and graphs.can_run(b) and self._graphed(return_hidden):
            if lora is not None:
                columns += ([s for s in lora for _ in range(w)],)
            out = _outputs(graphs.replay(columns, chain=chain), return_hidden)  # [B*W, V] (and [B*W, H])
            return _rows(out, self._to_device(torch.tensor(fed, dtype=torch.long))[0])
        dev = self._to_device(*host_long(*columns[:5]), loc, torch.tensor(chain, dtype=torch.long),
                              torch.tensor(fed, dtype=torch.long))
        batch = self.fused_batch(*dev[:6], chain_slots=dev[6], return_hidden=return_hidden)
        batch.lora = LoRABatch.of(lora, [w] * b, self.device)
        return _rows(self.decode_fused_step(batch), dev[7])  # [sum(extend_lens), V] (and [.., H])

    def _forward_extends_fused(self, reqs: list[Req], extend_lens: list[int], out_cache_loc: torch.Tensor,
                               ckpts: list[tuple[int, int, int]]) -> torch.Tensor:
        """:meth:`forward_extend` of each sequence as a fused extend of its own, in order (each
        computes from its own state slot and request row, so one after another equals one batch):
        their last logits ``[B, V]``. A replay's logits are the graph's output buffer, which the
        next replay of any graph of its pool may overwrite: all but the last are copied, in stream order
        (the caller reads or copies the last before another replay: ``Scheduler._run_mixed_apart``)."""
        if out_cache_loc.shape != (sum(extend_lens),):
            raise ValueError(f"out_cache_loc must be [{sum(extend_lens)}], got {list(out_cache_loc.shape)}")
        slots = [r.state_slot for r in reqs] + [slot for _, _, slot in ckpts]
        if len(set(slots)) != len(slots):  # (each extend checks its own; one batch's must not meet either)
            raise ValueError(f"the extends' state and checkpoint slots {slots} must be distinct")
        rows, first = [], 0
        for i, (req, n) in enumerate(zip(reqs, extend_lens)):
            mine = [(0, length, slot) for seq, length, slot in ckpts if seq == i]
            logits = self._forward_extend_fused(req, n, out_cache_loc[first:first + n], mine)
            rows.append(logits if i == len(reqs) - 1 else logits.clone())
            first += n
        return rows[0] if len(rows) == 1 else torch.cat(rows)

    def _forward_extend_fused(self, req: Req, n: int, out_cache_loc: torch.Tensor,
                              ckpts: list[tuple[int, int, int]]) -> torch.Tensor:
        """:meth:`forward_extend` of one sequence's ``n`` tokens as a fused extend
        (``ForwardBatch.fused_extend``), padded to the smallest captured token count: its inputs
        validated here (what the batch constructor checks on the other paths), written to the
        static inputs in one transfer, then the graph replayed (or, without graphs, the forward
        run on them). Returns the last token's logits ``[1, V]``."""
        start = req.kv_len
        ids = req.tokens(start, start + n)
        if max(ids) >= self.model.config.vocab_size:
            raise ValueError(f"token id {max(ids)} is outside the vocabulary ({self.model.config.vocab_size})")
        if out_cache_loc.shape != (n,):
            raise ValueError(f"out_cache_loc must be [{n}], got {list(out_cache_loc.shape)}")
        marks = sorted((length, slot) for _, length, slot in ckpts)
        if self.model.config.num_linear_layers:
            check_slot_values([req.state_slot] + [s for _, s in marks], self.conv_states[0].shape[0],
                              "the extend's state slots")
        if any(seq != 0 for seq, _, _ in ckpts) or any(not 1 <= p <= n for p, _ in marks) \
                or len({p for p, _ in marks}) != len(marks) or any(s < 0 for _, s in marks):
            raise ValueError(f"checkpoints {ckpts} must follow 1..{n} distinct tokens of sequence 0, into state slots")
        bucket = next(t for t in self._extend_buckets if t >= n)
        self.req_to_token.sync_mirror()  # the sequence's slots, the new tokens' included, read by attention
        inputs = self.extend_inputs
        lora_slot = req.lora_slot if self.serves_lora else 0
        shift = self._shift(req, start)  # (no image token here: forward_extend)
        inputs.fill(ids, range(start + shift, start + shift + n), out_cache_loc, bucket, req.state_slot, req.req_pool_idx, marks,
                    lora_slot, cached=start)
        graphs = self.extend_graphs if not lora_slot else self.lora_extend_graphs
        if graphs is not None:
            return graphs.replay(bucket)
        return self.model.forward_unchecked(inputs.batch(bucket, lora=bool(lora_slot)))

    def _lora_slots(self, reqs: list[Req]) -> list[int] | None:
        """Each request's LoRA adapter slot (``Req.lora_slot``), on a runner serving adapters where any has one;
        else None (a draft model's runner, given the target's requests, applies none)."""
        return [r.lora_slot for r in reqs] if self.serves_lora and any(r.lora_slot for r in reqs) else None

    def fused_batch(self, input_ids, positions, state_slots, req_rows, kv_lens, out_cache_loc, lora_slots=None,
                    chain_slots: torch.Tensor | None = None, return_hidden: bool = False) -> ForwardBatch:
        """A fused decode batch over device tensors ``[B]`` each (no host value is read: the host
        lists a ``ForwardBatch`` carries are placeholders, the kernels use the device tensors);
        ``lora_slots``: each row's LoRA adapter slot, a CUDA graph's input (``LoRABatch.static``);
        ``chain_slots``: a verify step of chains (``ForwardBatch.chain_slots``); ``return_hidden``:
        the final hidden states too."""
        batch = fused_decode_batch(input_ids, positions, state_slots, req_rows, kv_lens, out_cache_loc, self._arange,
                                   self.table, self.k_buffers, self.v_buffers, self.conv_states, self.ssm_states,
                                   chain_slots, return_hidden)
        if lora_slots is not None:
            batch.lora = LoRABatch.static(lora_slots)
        return batch

    def decode_fused_step(self, batch: ForwardBatch) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The forward of a fused decode batch: ``[B, V]`` logits (and ``[B, H]`` hidden states with
        ``batch.return_hidden``). What the CUDA graphs capture."""
        return self.model.forward_unchecked(batch)

    def _graphed(self, return_hidden: bool) -> bool:
        """Whether the CUDA graphs' outputs serve a step that wants ``return_hidden`` (graphs made
        for hidden states serve a step that wants logits only too, which drops them)."""
        return self.return_hidden or not return_hidden

    def _compiled_for(self, batch: ForwardBatch) -> bool:
        """Whether the graphs compiled at start-up are for such a batch: those of a runner built with
        ``return_hidden`` return the hidden states, the others do not (dynamo would compile anew)."""
        return self._compiled_decode is not None and batch.return_hidden == self.return_hidden

    def _run_decode(self, batch: ForwardBatch) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if not self._compiled_for(batch):
            return self.model.forward(batch)
        self.model.check_batch(batch)  # eager: it reads host ints the graph must not specialise on
        return self._run_compiled(batch)

    def _run_compiled(self, batch: ForwardBatch) -> torch.Tensor:
        """A checked step through the graphs compiled at start-up (:func:`call_compiled`: eager
        where none fits, ``late_compiles`` counting such steps)."""
        out, reason = call_compiled(self._compiled_decode, self.model.forward_unchecked, batch)
        if reason is not None:
            self.late_compiles += 1
            log_late_compile(self.late_compiles, "step", reason)
        return out

    def _to_device(self, *tensors: torch.Tensor) -> list[torch.Tensor]:
        """Host int64 tensors -> the model's device in one transfer (views of one packed buffer)."""
        return to_device_packed(tensors, self.device)

    def _warm_up_compiled_decode(self) -> None:
        """Compile the decode graph for batch size 1 and for larger batches, on scratch pools shaped
        like the real ones. Every size that varies in serving (batch, KV width, pool rows) is given a
        distinct prime here, unequal to any model dimension: the compiler would otherwise merge equal
        sizes into one symbol (or into a constant) and compile again when they differ."""
        c = self.model.config
        dev = self.device
        kv_rows, state_rows = WARM_UP_KV_ROWS, 67  # room for the batch of 13
        if self.verify_width is not None:  # room for 13 chains' KV (prefix + fed) and their checkpoint slots
            kv_rows = _prime_above(max(1200, len(WARM_UP_LENS) * (max(WARM_UP_LENS) + self.verify_width)),
                                   avoid=set(WARM_UP_LENS))
            state_rows = _prime_above(len(WARM_UP_LENS) * self.verify_width + 1, avoid={*WARM_UP_LENS, kv_rows})
        pool = lambda rows, shape, dtype: torch.zeros(rows, *shape, dtype=dtype, device=dev)  # noqa: E731
        # the real buffers' rows and dtype (a float8 kv_cache_dtype: the graphs guard on it)
        k = [pool(kv_rows, buf.shape[1:], buf.dtype) for buf in self.k_buffers]
        v = [pool(kv_rows, buf.shape[1:], buf.dtype) for buf in self.v_buffers]
        conv = [pool(state_rows, c.conv_shape, c.conv_dtype) for _ in range(c.num_linear_layers)]
        ssm = [pool(state_rows, c.ssm_shape, torch.float32) for _ in range(c.num_linear_layers)]
        # the pools above are ordinary tensors like the engine's; the batches are built under
        # inference mode like forward_decode's (the compiled graph guards on both)
        with torch.inference_mode():
            self._warm_up_batches(k, v, conv, ssm)

    def _warm_up_batches(self, k, v, conv, ssm) -> None:
        dev = self.device
        long = dict(dtype=torch.long, device=dev)
        # one row (dot products over the row-major weights); more (frozen, C++ GEMM template; or packed weights)
        for lens in WARM_UP_BATCHES:
            b, width = len(lens), max(lens)
            table = torch.tensor([[1 + width * i + j if j < n else 0 for j in range(width)]
                                  for i, n in enumerate(lens)], **long)  # [B, width], distinct slots
            last = torch.tensor([n - 1 for n in lens], **long)
            batch = ForwardBatch(
                is_decode=True, input_ids=torch.full((b,), 3, **long), positions=last, extend_lens=[1] * b,
                prefix_lens=last.tolist(), cu_seqlens=torch.arange(b + 1, **long),
                out_cache_loc=table[torch.arange(b, device=dev), last], kv_indices=table[table > 0],
                kv_indptr=torch.tensor(prefix_sums(lens), **long), k_buffers=k, v_buffers=v,
                state_slots=torch.arange(1, b + 1, **long), conv_states=conv, ssm_states=ssm,
                state_slot_list=list(range(1, b + 1)), max_token_id=3, kv_table=table,
                kv_lens=torch.tensor(lens, **long),  # as forward_decode's: the mask is made in the graph
                return_hidden=self.return_hidden,
            )
            self.model.check_batch(batch)
            with _frozen(self._freeze_rows and not _one_row(batch)):
                self._compiled_decode(batch)
        if self.verify_width is not None:
            with _frozen(self._freeze_rows):  # every verify step runs the graph of more rows
                self._warm_up_chains(k, v, conv, ssm)

    def _warm_up_chains(self, k, v, conv, ssm) -> None:
        """The verify graph's variants, as :meth:`forward_chains` builds them: batch 1 and larger
        batches; sizes as distinct primes, as for decode. Batch 1 runs twice, with two token counts:
        the second call runs the first one's graph (a check that it is general in the token count;
        with duck shaping a token count equal to the conv's window had made it specialise there,
        and the second call compiled a graph again: :func:`warm_up_config`)."""
        dev, w = self.device, self.verify_width
        long = dict(dtype=torch.long, device=dev)
        one = [[min(w, 3)], [2]] if w > 2 else [[2]]  # batch 1: tokens fed
        many = [2 + (i * 7) % (w - 1) for i in range(len(WARM_UP_LENS))]  # 13 requests, 2..w tokens each
        for prefix, fed in [([37], f) for f in one] + [(WARM_UP_LENS, many)]:
            b = len(prefix)
            lens = [p + n for p, n in zip(prefix, fed)]
            width = max(lens)
            table = torch.tensor([[1 + width * i + j if j < n else 0 for j in range(width)]
                                  for i, n in enumerate(lens)], **long)  # [B, width], distinct slots
            ckpt = [[1 + b + (w - 1) * i + j for j in range(w - 1)] for i in range(b)]
            # trees (verify_trees): binary ones, token j continuing token (j - 1) // 2
            trees = [[-1] + [(j - 1) // 2 for j in range(1, n)] for n in fed] if self.verify_trees else None
            batch = ForwardBatch(
                is_decode=False, input_ids=torch.full((sum(fed),), 3, **long),
                positions=torch.tensor([q for i, (p, n) in enumerate(zip(prefix, fed))
                                        for q in fed_positions(p, n, None if trees is None else trees[i])], **long),
                extend_lens=fed, prefix_lens=prefix, cu_seqlens=torch.tensor(prefix_sums(fed), **long),
                out_cache_loc=torch.cat([table[i, p:p + n] for i, (p, n) in enumerate(zip(prefix, fed))]),
                kv_indices=table[table > 0], kv_indptr=torch.tensor(prefix_sums(lens), **long), k_buffers=k,
                v_buffers=v, state_slots=torch.arange(1, b + 1, **long), conv_states=conv, ssm_states=ssm,
                state_slot_list=list(range(1, b + 1)), max_token_id=3, kv_table=table,
                chain_ckpt_rows=torch.tensor(ckpt, **long), chain_ckpt_list=ckpt, chain_tree_parents=trees,
                return_hidden=self.return_hidden,
            )
            self.model.check_batch(batch)
            self._compiled_decode(batch)


# The warm-up's batch of more rows: 13 requests' KV lengths (decode) or cached prefixes (verify steps),
# distinct primes (_warm_up_compiled_decode)
WARM_UP_LENS = [61, 59, 53, 47, 43, 41, 37, 31, 29, 23, 19, 17, 11]
WARM_UP_BATCHES = ([37], WARM_UP_LENS)  # the decode warm-up's KV lengths: a batch of one row, then of more
WARM_UP_KV_ROWS = 1201  # the scratch KV rows of that warm-up (a prime): room for the batch of 13

# Inductor options of the two compiled decode graphs. realize_opcount_threshold: an intermediate of
# more than that many ops is stored, not inlined into its consumers. Inlined, a projection's input
# (a norm's output, silu(gate) * up) was recomputed inside the one-row graph's dot-product loop for
# every output row (an exp per weight in the MLP's down projection); stored, that loop is a load and
# a multiply-add per weight: 1 took the batch-1 graph's call from 1.67 to 1.19 ms (CPU, default
# model; 3: 1.29); the graph of more rows takes 4 (8 / 16 rows: 0.98x / 0.89x the time of
# inductor's default). That graph picks each projection's kernel by benchmarking (max_autotune)
# inductor's C++ GEMM template, which needs the weights as constants (the graph is compiled frozen,
# :func:`_frozen`: it packs them once, at compile time), against ATen's (MKL's GEMM repacks the
# weight on every call with so few rows). An 8-row step of the default model, in one process: 4.5 ms
# against 6.7 with the dot products over the row-major copies that such steps used before; 16 rows
# 8.4 against 13.5 (docs/benchmarks.md, "CPU decode: the frozen graph of more rows").
ONE_ROW_OPTIONS = {"realize_opcount_threshold": 1}
ROWS_OPTIONS = {"realize_opcount_threshold": 4, "max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN"}
# The graph of more rows on packed weights (linear.pack_weights_): not frozen, so nothing for the C++
# template to autotune against; Python's wrapper, as the C++ one cannot pass the packed weights (opaque
# objects) to their op
PACKED_ROWS_OPTIONS = {"realize_opcount_threshold": 4, "cpp_wrapper": False}


def compile_step(method: Callable) -> Callable:
    """``method`` (a bound method of a module whose weights never change) through :func:`_compile`
    with the one-row options, its module's projections given row-major weights
    (``linear.keep_row_major_weights_``): what ``compile_decode`` compiles of a drafter (the MTP
    head's steps), one graph for a row and one for more. The graphs are made by calling it at
    start-up under :func:`warm_up_config`, and served through :func:`call_compiled`."""
    keep_row_major_weights_(method.__self__)
    return _compile(method, ONE_ROW_OPTIONS)


def _compile(method: Callable, options: dict) -> Callable:
    """``method`` through ``torch.compile`` with inductor ``options``: dynamic in every size; one
    graph per call (``fullgraph``: a graph break is an error at start-up, so a call that no graph
    fits fails before anything runs and can run eager instead, :func:`call_compiled`); driven from
    C++ (``cpp_wrapper``: ~10% of a decode step); the module unguarded (its weights and attributes
    never change after loading, and checking every parameter before each call cost more than the
    rest of dynamo's per-call work); a code object of its own (:func:`_own_code`)."""
    return torch.compile(_own_code(method), dynamic=True, fullgraph=True,
                         options={"cpp_wrapper": True, "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe,
                                  **options})


@contextlib.contextmanager
def warm_up_config():
    """The settings a start-up compile runs under (per thread): Python floats (norm eps, scales:
    module constants) baked into the graph, not turned into a 0-d tensor per float per call (~0.1 ms
    a step at batch 1); compiles allowed whatever the calling thread set (:func:`call_compiled`); no
    duck shaping: a size that happens to equal another (a verify step's 3 tokens and the conv's
    3-token window) gets a symbol of its own instead of sharing one that a check of the other then
    specialises (the warm-up's sizes are distinct primes for the same reason; its one size that
    cannot be, a verify step's token count, cost a whole compile more: 5 graphs at start-up, now 4)."""
    with torch._dynamo.config.patch(specialize_float=True, error_on_recompile=False), \
            torch.fx.experimental._config.patch(use_duck_shape=False):
        yield


def call_compiled(compiled: Callable, eager: Callable, *args) -> tuple[object, str | None]:
    """``compiled(*args)`` through the graphs compiled at start-up, never compiling another:
    ``(its output, None)``; where no graph's guards pass (a batch the warm-up did not foresee),
    dynamo would stall the engine for a compile (a minute or more on a small CPU), so ``eager(*args)``
    runs instead: ``(its output, dynamo's reason)``. Dynamo's config is per thread, so another
    thread's compiles (another runner's warm-up) are untouched."""
    cfg = torch._dynamo.config
    before, cfg.error_on_recompile = cfg.error_on_recompile, True
    try:
        return compiled(*args), None
    except torch._dynamo.exc.RecompileError as e:  # raised before the graph runs: nothing written yet
        reason = str(e)
    finally:
        cfg.error_on_recompile = before
    return eager(*args), reason


def log_late_compile(count: int, what: str, reason: str) -> None:
    """Warn of the first ``what`` that no graph compiled at start-up fitted (it ran eager, and so
    will every such one), then of the 10th, 100th, ...: a fallback that persists shows."""
    if count == 1:
        logger.warning("compile_decode: no graph compiled at start-up fits this %s, which runs eager "
                       "(and so will every such %s: nothing is compiled while serving): %s", what, what, reason)
    elif math.log10(count).is_integer():
        logger.warning("compile_decode: %d %ss ran eager (no graph compiled at start-up fits them)", count, what)


def _frozen(on: bool):
    """Inductor's freezing while a graph of more rows compiles (``on``): the module's parameters
    become constants of the graph. A config setting (per thread in torch 2.13) that dynamo reads
    while it traces, so it is set around the warm-up call that compiles the graph: passed as a
    ``torch.compile`` option it freezes nothing."""
    return torch._inductor.config.patch(freezing=True) if on else contextlib.nullcontext()


def _by_row_count(one_row: Callable[[ForwardBatch], torch.Tensor],
                  rows: Callable[[ForwardBatch], torch.Tensor]) -> Callable[[ForwardBatch], torch.Tensor]:
    """The compiled decode: a decode step of one row through ``one_row``, every other batch (more
    requests, verify steps) through ``rows`` (two compilations of the forward with different
    inductor options)."""
    def run(batch: ForwardBatch) -> torch.Tensor:
        return (one_row if _one_row(batch) else rows)(batch)
    return run


def _one_row(batch: ForwardBatch) -> bool:
    """A decode step of one request: what the one-row graph runs; every other batch runs the
    graph of more rows (compiled frozen in the warm-up unless the weights are packed: :func:`_frozen`)."""
    return batch.is_decode and batch.input_ids.shape[0] == 1


def _own_code(method: Callable) -> Callable:
    """``method`` bound to a copy of its function with a code object of its own. Dynamo keeps
    compiled graphs per code object, and with the modules unguarded a graph compiled for one
    runner's model would serve any other model of the same class whose batches look alike (a
    different eps, activation or RoPE base included); each runner's graphs are its own this way,
    and one runner's variants never count against another's recompile limit. The copy is of the
    undecorated function (past ``torch.no_grad``'s wrapper; the runner calls it in inference mode):
    dynamo enters a function whose code lives in torch's files, as that wrapper's does, through a
    wrapper frame shared by every such call, which would put every runner's graphs on one code object."""
    f = inspect.unwrap(method.__func__)
    code = f.__code__.replace(co_name=f"{f.__name__}_{id(method.__self__):x}")
    own = types.FunctionType(code, f.__globals__, f.__name__, f.__defaults__, f.__closure__)
    own.__kwdefaults__, own.__qualname__ = f.__kwdefaults__, f.__qualname__
    return types.MethodType(own, method.__self__)


def _prime_above(n: int, avoid: set[int]) -> int:
    """The smallest prime ``> n`` not in ``avoid`` (a warm-up size the compiler cannot merge)."""
    p = n + 1
    while p in avoid or any(p % d == 0 for d in range(2, int(p ** 0.5) + 1)):
        p += 1
    return p


def _token_at(req: Req, i: int) -> int:
    """``req.fill_ids[i]`` without building the prompt + output list."""
    n = len(req.input_ids)
    return req.input_ids[i] if i < n else req.output_ids[i - n]


def fed_positions(start: int, n: int, parents: list[int] | None) -> range | list[int]:
    """Positions of ``n`` tokens fed after ``start``: a chain's (``parents`` None) one after another, a
    tree's at ``start`` + each node's depth (:func:`tree_positions`)."""
    return range(start, start + n) if parents is None else tree_positions(parents, start)


def tree_positions(parents: list[int], start: int) -> list[int]:
    """Positions of a token tree's nodes: ``start`` + each node's depth (``parents[0] == -1``)."""
    out: list[int] = []
    for p in parents:
        out.append(start if p < 0 else out[p] + 1)
    return out


def _checkpoints_fit(ckpts: list[tuple[int, int, int]], num_seqs: int) -> bool:
    """Whether ``(sequence, length, slot)`` checkpoints name sequences of the batch, at most
    ``EXTEND_CHECKPOINTS`` each (what a fused extend writes; else the eager extend validates them)."""
    per_seq = collections.Counter(seq for seq, _, _ in ckpts)
    return all(0 <= seq < num_seqs for seq in per_seq) and max(per_seq.values(), default=0) <= EXTEND_CHECKPOINTS


def _outputs(out: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
             return_hidden: bool) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """A graph's outputs as a step asked for them: ``(logits, hidden)``, or the logits alone."""
    return out if return_hidden or not isinstance(out, tuple) else out[0]


def _rows(out: torch.Tensor | tuple[torch.Tensor, ...], index: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """Rows ``index`` of a step's output, or of each of its outputs."""
    return tuple(t.index_select(0, index) for t in out) if isinstance(out, tuple) else out.index_select(0, index)


def decode_batch(ids: list[int], pos: list[int], slots: list[int], kv_lens: list[int], out_cache_loc: torch.Tensor,
                 table: torch.Tensor, kv_indices: torch.Tensor, device: torch.device, k_buffers: list[torch.Tensor],
                 v_buffers: list[torch.Tensor], conv_states: list[torch.Tensor], ssm_states: list[torch.Tensor],
                 return_hidden: bool = False) -> ForwardBatch:
    """A PyTorch decode step's batch: row ``b`` feeds ``ids[b]`` at ``pos[b]`` from and into state
    slot ``slots[b]`` (-1: none), its K/V written at ``out_cache_loc[b]``, attending to the first
    ``kv_lens[b]`` slots of ``table [B, max(kv_lens)]`` (padded with slot 0; ``kv_indices``: the same
    slots packed). Built on the host, moved in one transfer; its shapes are the row count and the
    longest KV length only, so the graphs ``compile_decode`` compiled serve it
    (:meth:`ModelRunner.forward_decode`, a drafter's rows: ``speculative.row_batch``)."""
    b = len(ids)
    host = host_long(ids, pos, range(b + 1), prefix_sums(kv_lens), slots, kv_lens)
    # copies made here (inference mode), like every other tensor of the batch: a compiled
    # graph guards on that, and the scheduler's out_cache_loc is an ordinary tensor (and on its
    # strides: a caller's view of a wider table would compile a graph of its own)
    t = to_device_packed([*host, _dense(out_cache_loc), table.to(torch.long), kv_indices.to(torch.long)], device)
    return ForwardBatch(
        is_decode=True, input_ids=t[0], positions=t[1], extend_lens=[1] * b, prefix_lens=[k - 1 for k in kv_lens],
        cu_seqlens=t[2], out_cache_loc=t[6], kv_indices=t[8], kv_indptr=t[3], k_buffers=k_buffers,
        v_buffers=v_buffers, state_slots=t[4], conv_states=conv_states, ssm_states=ssm_states,
        state_slot_list=list(slots), max_token_id=max(ids), kv_table=t[7], kv_lens=t[5], return_hidden=return_hidden,
    )


def fused_decode_batch(input_ids: torch.Tensor, positions: torch.Tensor, state_slots: torch.Tensor,
                       req_rows: torch.Tensor, kv_lens: torch.Tensor, out_cache_loc: torch.Tensor,
                       arange: torch.Tensor, req_to_token: torch.Tensor, k_buffers: list[torch.Tensor],
                       v_buffers: list[torch.Tensor], conv_states: list[torch.Tensor], ssm_states: list[torch.Tensor],
                       chain_slots: torch.Tensor | None = None, return_hidden: bool = False) -> ForwardBatch:
    """A fused decode batch over device tensors ``[B]`` each, reading request table ``req_to_token``
    (no host value is read: the host lists a ``ForwardBatch`` carries are placeholders, the kernels
    use the device tensors): :meth:`ModelRunner.fused_batch`'s, and the MTP head's rows
    (``MtpDrafter``). ``arange``: a device ``arange`` of more than ``B`` entries, whose first
    ``B + 1`` are the batch's ``cu_seqlens`` (a longer batch makes its own)."""
    b = input_ids.shape[0]
    cu = arange[:b + 1] if b < arange.numel() else torch.arange(b + 1, device=input_ids.device)
    return ForwardBatch(
        is_decode=True, input_ids=input_ids, positions=positions, extend_lens=[1] * b, prefix_lens=[0] * b,
        cu_seqlens=cu, out_cache_loc=out_cache_loc, kv_indices=cu[:0], kv_indptr=cu,
        k_buffers=k_buffers, v_buffers=v_buffers, state_slots=state_slots, conv_states=conv_states,
        ssm_states=ssm_states, max_token_id=0, fused_decode=True, req_to_token=req_to_token,
        req_pool_indices=req_rows, kv_lens=kv_lens, chain_slots=chain_slots, return_hidden=return_hidden,
    )


def _dense(out_cache_loc: torch.Tensor) -> torch.Tensor:
    """A step's KV slots as the compiled graphs take them: an int64 copy made here (in inference
    mode), contiguous whatever the caller passed (the graphs guard on both)."""
    return out_cache_loc.to(torch.long, copy=True, memory_format=torch.contiguous_format)


def prefix_sums(values) -> list[int]:
    """``[0, v0, v0 + v1, ...]``: each sequence's offset into packed tokens, and the total."""
    out = [0]
    for v in values:
        out.append(out[-1] + v)
    return out


def host_long(*lists) -> list[torch.Tensor]:
    """int64 host tensors of ``lists`` (of ints): through numpy, a third of ``torch.tensor``'s cost
    (6 lists: 6 vs 17 µs, a CPU decode step's batch)."""
    return [torch.from_numpy(np.fromiter(x, np.int64)) for x in lists]
