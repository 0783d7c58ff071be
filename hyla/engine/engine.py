"""``Engine``: the public API. Loads a model, builds pools + prefix tree + scheduler, and runs the
scheduler loop on its own thread; callers submit requests from any thread (``generate``) or from
an asyncio loop (``async_generate``).

    from hyla import Engine
    with Engine("path/to/model", max_total_tokens=20000) as engine:
        out = engine.generate("The capital of France is", {"max_new_tokens": 16, "temperature": 0})
        print(out["text"], out["meta_info"]["cached_tokens"])

Outputs follow SGLang's ``Engine`` conventions: ``{"text", "output_ids", "meta_info"}`` with
``meta_info = {"id", "prompt_tokens", "completion_tokens", "cached_tokens", "finish_reason",
["output_token_logprobs"]}``. ``stream=True`` yields incremental chunks: each chunk's ``text`` and
``output_ids`` hold only what is new since the previous chunk; the last chunk carries the
``finish_reason``.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import json
import logging
import operator
import os
import queue
import threading
import time
import uuid
import zlib
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Callable, NamedTuple, Sequence

import numpy as np
import torch

from hyla.cache import CacheLedger, CachedPrefix, HostCache, KVPool, RadixCache, ReqToTokenPool, StatePool, split_memory
from hyla.engine.args import (EngineArgs, check_state_slots, check_weight_version, context_length_for, host_cache_sizes,
                              kv_cache_torch_dtype)
from hyla.engine.cache_manager import NO_CACHE_TO_IMPORT_INTO, CacheManager, new_request_match_limit
from hyla.engine.errors import EngineOverloadedError, RequestError  # noqa: F401 (EngineOverloadedError: re-exported)
from hyla.engine.draft_drafter import DraftModelDrafter, check_draft_model, draft_cache_layout
from hyla.engine.grammar import GRAMMAR_KINDS, Grammars
from hyla.engine.lora_manager import Loaded, LoRAManager, check_lora_name, lora_namespace
from hyla.engine.cpu_process import keep_freed_memory, run_in_own_thread, set_cpu_threads
from hyla.engine.model_runner import ModelRunner
from hyla.engine.multimodal import EmbeddingCache, PromptImages, expand_images
from hyla.engine.mtp_drafter import MtpDrafter
from hyla.engine.output_processor import OutputProcessor, internal_error
from hyla.engine.request import Req, ReqStatus
from hyla.engine.sampling_params import SamplingParams
from hyla.engine.scheduler import Scheduler, SchedulerConfig
from hyla.engine.speculative import NgramDrafter, beam_kv_slots
from hyla.engine.streams import AsyncRequestStream, RequestStream
from hyla.engine.warmup import warm_up, warmup_enabled
from hyla.engine.weight_update import NewWeights, weights_digest
from hyla.model import load_model
from hyla.model.config import parse_dtype
from hyla.model.image_processing import (ImageProcessorConfig, ProcessedImage, image_tokens, load_image, open_image,
                                         process_image)
from hyla.model.loader import read_quantization
from hyla.model.lora import enable_lora_, lora_widths, read_adapter
from hyla.model.ops import gpu as gpu_ops
from hyla.model.quantization import is_fp8
from hyla.model.mtp import MtpHead, mtp_cache_layout

logger = logging.getLogger("hyla.engine")

DEFAULT_MODEL_DIR = Path(__file__).resolve().parent.parent / "assets" / "default-model"

MAX_RUNNING_REQUESTS = 256
"""Default ``max_running_requests`` on a GPU (and the most any default gives)."""
CPU_MAX_RUNNING_REQUESTS = 32
"""Default ``max_running_requests`` on CPU, where a larger decode batch adds little throughput (the
built-in model, one thread: 948 tokens/s at batch 32, 1106 at 64, 1225 at 128)."""
CHECKPOINTS_PER_RUNNING_REQUEST = 3
"""Pools sized from memory hold at most this many cached state checkpoints per running request."""
WEIGHT_UPDATE_SECONDS = 600.0
"""``update_weights_from_disk``'s default ``timeout``: how long an update may wait (for another update, for the
running requests) before a ``TimeoutError`` (the server's ``/update_weights_from_disk``: its turn too, then a 409)."""
WEIGHT_UPDATE_APPLY_SECONDS = 3600.0
"""How long ``update_weights_from_disk`` waits for the update itself once it has begun (with
``compile_decode`` it compiles then)."""


def default_max_running_requests(device: torch.device) -> int:
    """The running requests pools sized from memory are made for, when none are given."""
    return MAX_RUNNING_REQUESTS if device.type == "cuda" else CPU_MAX_RUNNING_REQUESTS


class Engine:
    def __init__(self, model_path: str | os.PathLike | None = None, **options: Any):
        self.args = EngineArgs.from_options(str(model_path) if model_path is not None else None, options)
        path = Path(self.args.model_path) if self.args.model_path else DEFAULT_MODEL_DIR
        if not (path / "config.json").is_file():
            raise ValueError(f"no config.json in model directory {str(path)!r}")
        self.model_path = path
        self.device = torch.device(self.args.device)
        self.dtype = parse_dtype(self.args.dtype)
        # on CPU the set-up's parallel torch work runs on a thread that ends before the scheduler's starts,
        # so that the scheduler's OpenMP team is the process's only one (cpu_process.run_in_own_thread)
        if self.device.type == "cpu":
            run_in_own_thread(self._build)
        else:
            self._build()
        self._rid_counter = itertools.count()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._inbox_lock = threading.Lock()
        # submitted and not finished, by id: abort(rid) must be unambiguous; priority scheduling may
        # displace a queued one (_displaceable)
        self._live: dict[str, Req] = {}
        self._displacing: set[str] = set()  # of those, the ones a displacement is finishing (not counted)
        self._wakeup = threading.Event()
        self._update_lock = threading.Lock()  # update_weights_from_disk: one at a time
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name="hyla-scheduler", daemon=True)
        self._thread.start()
        logger.info("%s", self.summary())
        self.warmup_stats: dict[str, Any] | None = None  # what the warm-up ran (warmup.warm_up); None: none
        if warmup_enabled(self.args.warmup, self.device.type):
            try:
                self.warmup_stats = warm_up(self)
            except BaseException:
                self.shutdown()
                raise

    # ------------------------------------------------------------------------------------------
    # set-up
    # ------------------------------------------------------------------------------------------
    def _build(self) -> None:
        """The model, pools, cache, runner and scheduler (every step of the set-up that runs torch)."""
        path = self.model_path
        torch.manual_seed(self.args.seed)
        self.cpu_threads = None  # torch's intra-op threads, for a CPU engine (cpu_process.py)
        if self.device.type == "cpu":
            keep_freed_memory()  # each forward's activations on pages already mapped
            self.cpu_threads = set_cpu_threads(self.args.cpu_threads)  # one per physical core unless set

        self.checkpoint_quantization = read_quantization(path)  # an FP8 checkpoint's scheme (or None)
        self._check_float8()
        mtp = self.args.speculative_algorithm == "mtp"  # (the mtp.* tensors read only for an MTP head)
        self.model = load_model(path, dtype=self.args.dtype, device=self.args.device, keep_fp8=self.keeps_fp8,
                                quantize_fp8=self.args.quantization == "fp8", mtp=mtp)
        self.model_config = self.model.config
        # a vision-language model's image preprocessing (its checkpoint's preprocessor_config.json); None: no images
        vision = self.model_config.vision
        if vision is None and (self.args.limit_mm_per_prompt or self.args.mm_processor_kwargs):
            raise ValueError(f"limit_mm_per_prompt and mm_processor_kwargs are for a model that takes images; "
                             f"{path} ({self.model_config.architecture}) takes none")
        # (mm_processor_kwargs: the preprocessing's bounds of an image's area, in place of the checkpoint's)
        self.image_processor = None if vision is None else ImageProcessorConfig.from_dir(
            path, patch_size=vision.patch_size, temporal_patch_size=vision.temporal_patch_size,
            merge_size=vision.spatial_merge_size).overridden(self.args.mm_processor_kwargs)
        self.max_images = (self.args.limit_mm_per_prompt or {}).get("image")  # a prompt's images at most (None: any)
        # speculative_algorithm="mtp": the checkpoint's MTP head (ValueError when it has none), holding its
        # weights alone
        self.mtp_head = MtpHead.from_model(self.model, take=True) if mtp else None
        # tokenizer_path: another directory's tokenizer; chat_template: a template replacing the tokenizer's
        tokenizer_dir = Path(self.args.tokenizer_path) if self.args.tokenizer_path is not None else path
        self.tokenizer = _load_tokenizer(tokenizer_dir, self.args.chat_template)
        # (kept by a weight update, as the tokenizer)
        self.tokenizer_path = tokenizer_dir if self.tokenizer is not None else None
        # speculative_algorithm="draft": a separate model with the same vocabulary (ValueError when it does not fit)
        self.draft_model = self._load_draft_model() if self.args.speculative_algorithm == "draft" else None
        # what a request gets for the sampling parameters it does not set (vLLM's --generation-config auto)
        # and the most new tokens an OpenAI-style request that sets none may get (vLLM's default max_tokens: the
        # file's max_new_tokens), None: up to the context length
        self.sampling_defaults, self.default_max_new_tokens = _generation_config(path) \
            if self.args.generation_config == "auto" else ({}, None)
        self.eos_token_ids = sorted(set(self.model_config.eos_token_ids) | set(
            self.tokenizer.eos_token_ids if self.tokenizer is not None else []))

        # structured outputs: compiled-grammar cache + batch mask filler (needs the tokenizer's vocabulary)
        self.grammars = Grammars(self.tokenizer, self.model_config.vocab_size, self.eos_token_ids) \
            if self.tokenizer is not None else None

        # LoRA adapters (enable_lora): max_loras slots in every projection an adapter may target, allocated
        # before the pools are sized from the memory left (the fused kernels and CUDA graphs apply them too)
        self.loras = LoRAManager(self.model, self.args.max_loras, self.args.max_cpu_loras or self.args.max_loras) \
            if self.args.enable_lora else None
        if self.loras is not None:
            enable_lora_(self.model, self.args.max_loras, lora_widths(self.model, path, self.args.max_lora_rank))
        self._build_pools()
        self.cache = CacheManager(self.kv_pool, self.state_pool, self.req_to_token, self.tree,
                                  checkpoint_alignment=self.args.checkpoint_alignment, host=self.host_cache)
        runner = ModelRunner(self.model, self.kv_pool, self.state_pool, self.req_to_token, self.device,
                             compile_decode=self.args.compile_decode,
                             cuda_graph=not self.args.disable_cuda_graph,
                             cuda_graph_max_bs=self.args.cuda_graph_max_bs or min(self.max_running_requests, 256),
                             fused_extend_max_tokens=self.args.cuda_graph_max_extend_tokens
                             if not self.args.disable_cuda_graph else 0,
                             # verify steps as padded chains (forward_chains) where decode is fused or compiled,
                             # through the same kernels or graphs; trees of drafts (topk > 1) as padded trees
                             # where it is compiled
                             verify_width=self.args.num_draft_tokens + 1
                             if self.args.speculative_algorithm is not None else None,
                             verify_trees=self.args.speculative_eagle_topk > 1,
                             # MTP drafts from the model's final hidden states: every step's graphs return them
                             return_hidden=self.args.speculative_algorithm == "mtp",
                             image_cache=EmbeddingCache(self.args.mm_embedding_cache_mb << 20)
                             if self.model_config.vision is not None else None)
        output = OutputProcessor(self.eos_token_ids, self.context_length,
                                 make_detokenizer=self._make_detokenizer if self.tokenizer is not None else None,
                                 grammars=self.grammars)
        sched_cfg = SchedulerConfig.from_args(
            self.args, self.max_running_requests, self.context_length,
            # auto: where a decode step is launched without reading the host (CUDA graphs)
            overlap=self.args.speculative_algorithm is None and (
                self.args.overlap_schedule == "on" or self.args.overlap_schedule == "auto"
                and runner.graphs is not None),
            # prompt logprobs: at most ~256 MiB of fp32 logits per step
            prompt_logits_chunk=max(self.args.page_size, (1 << 26) // self.model_config.vocab_size
                                    // self.args.page_size * self.args.page_size),
        )
        drafter = None
        if self.args.speculative_algorithm == "ngram":
            drafter = NgramDrafter(self.args.num_draft_tokens,
                                   self.args.speculative_ngram_min_match_window_size,
                                   self.args.speculative_ngram_max_match_window_size,
                                   self.args.speculative_eagle_topk,
                                   adaptive=self.args.speculative_ngram_adaptive)
        elif self.args.speculative_algorithm == "mtp":
            steps, topk = self.args.speculative_num_steps, self.args.speculative_eagle_topk
            # the drafts' KV, per batch row
            scratch = self.cache.reserve_kv(self.max_running_requests * beam_kv_slots(steps, topk))
            # on a fused runner the head's steps run the fused kernels too, from CUDA graphs beside the model's
            drafter = MtpDrafter(self.mtp_head, self.kv_pool, self.state_pool, self.req_to_token, scratch,
                                 self.args.num_draft_tokens, fused=runner.fused,
                                 cuda_graph_max_bs=runner.graphs.max_bs if runner.graphs else 0, num_steps=steps,
                                 topk=topk)
            if runner.compiled:  # the head's forwards too
                start = time.perf_counter()
                drafter.compile()
                logger.info("compile_decode: the MTP head's graphs compiled in %.0f s", time.perf_counter() - start)
        elif self.args.speculative_algorithm == "draft":
            steps, topk = self.args.speculative_num_steps, self.args.speculative_eagle_topk
            kv_per_row, states_per_row = DraftModelDrafter.scratch_per_row(steps, topk)
            scratch = self.cache.reserve_kv(self.max_running_requests * kv_per_row)  # the drafts' KV, per batch row
            states = self.cache.reserve_states(self.max_running_requests * states_per_row)  # the drafting beams' states
            cfg = self.model_config
            # the draft model's steps as the model's: compiled or fused (and graphed) alike, its pass over a
            # verify step's chains as padded chains where its layers allow (DraftModelDrafter.observe)
            draft_runner = ModelRunner(self.draft_model, self.kv_pool, self.state_pool, self.req_to_token, self.device,
                                       compile_decode=self.args.compile_decode,
                                       cuda_graph=not self.args.disable_cuda_graph,
                                       cuda_graph_max_bs=self.args.cuda_graph_max_bs or min(self.max_running_requests, 256),
                                       first_buffers=(cfg.num_attention_layers, cfg.num_linear_layers),
                                       verify_width=runner.verify_width, verify_trees=runner.verify_trees)
            drafter = DraftModelDrafter(draft_runner, scratch, states, self.args.num_draft_tokens, steps, topk)
        self.scheduler = Scheduler(sched_cfg, self.cache, runner, output, drafter=drafter, loras=self.loras)
        self._instance = uuid.uuid4().hex[:12]  # (cache_id)
        self._weights_digest: str | None = None  # (_served_weights_digest)
        self.scheduler.weight_version = self.args.weight_version
        if drafter is not None and (runner.graphs is not None or runner.compiled) and runner.verify_width is None:
            # verify steps (drafts fed) run the eager extend path while decode steps do not: docs/engine.md
            logger.warning("speculative decoding: plain decode steps run %s, verify steps the eager ops; "
                           "speculation gains only where drafts are accepted often enough to pay for that",
                           self._decode_mode())

    def _load_draft_model(self):
        """The draft model of ``speculative_draft_model_path``, in the model's dtype and device,
        checked against the model (``check_draft_model``)."""
        path = Path(self.args.speculative_draft_model_path)
        if not (path / "config.json").is_file():
            raise ValueError(f"no config.json in draft model directory {str(path)!r}")
        draft = load_model(path, dtype=self.args.dtype, device=self.args.device, keep_fp8=self.keeps_fp8, mtp=False)
        check_draft_model(self.model_config, draft.config,
                          self.args.context_length or self.model_config.max_position_embeddings,
                          self.tokenizer, _load_tokenizer(path))
        return draft

    def _build_pools(self) -> None:
        cfg, args = self.model_config, self.args
        # K/V and conv state in the model dtype (= self.dtype), SSM state fp32; with MTP one more
        # attention layer of KV and a hidden vector per state slot; with a draft model its KV and
        # states on the same slots (its layout as the companion)
        if self.mtp_head is not None:
            layout = mtp_cache_layout(cfg)
        elif self.draft_model is not None:
            layout = draft_cache_layout(cfg, self.draft_model.config)
        else:
            layout = cfg.cache_layout
        # float8 K/V with kv_cache_dtype (docs/engine.md: written rounded, read back widened)
        layout = layout.with_kv_dtype(kv_cache_torch_dtype(args.kv_cache_dtype))
        # each running request holds a state slot, plus one scratch slot per draft token with
        # speculation, plus (draft model) one per beam for the draft state while it drafts
        steps, topk = args.speculative_num_steps, args.speculative_eagle_topk
        drafting_kv, drafting_states = DraftModelDrafter.scratch_per_row(steps, topk) if self.draft_model is not None \
            else (beam_kv_slots(steps, topk) if self.mtp_head is not None else 0, 0)
        per_req = 1 + args.num_draft_tokens + drafting_states
        context = args.context_length or cfg.max_position_embeddings
        # Sizes not given explicitly come from one memory budget split by SGLang's ratio, capped by
        # what the engine can use (a CPU's RAM would otherwise give a 15 MB model 2 GB of pools): a
        # state slot (and scratch slots) per running request plus CHECKPOINTS_PER_RUNNING_REQUEST
        # checkpoints each, and KV for every running request at the full context length (the prefix
        # cache keeps what running requests leave). The running requests counted are
        # max_running_requests when given, else the device's default.
        running = args.max_running_requests or default_max_running_requests(self.device)
        if args.max_total_tokens is None or args.max_state_slots is None:
            budget = _cache_budget_bytes(self.device, args.mem_fraction)
            split = split_memory(max(budget, 0), args.state_memory_ratio,
                                 layout.kv_bytes_per_token, layout.state_bytes_per_slot, args.page_size)
        slot_cap = running * (per_req + CHECKPOINTS_PER_RUNNING_REQUEST)
        # at least 8 slots; with max_running_requests given, at least its state (and scratch) slots
        # plus a checkpoint each, the bytes past the split's state share taken from its KV share: what
        # was asked for runs unless the budget cannot hold even that beside a few pages of KV
        floor = max(8, args.max_running_requests * (per_req + 1) if args.max_running_requests else 0)
        num_slots = args.max_state_slots or min(max(split.num_state_slots, floor), slot_cap, max(4096, floor))
        kv_from_memory = None
        if args.max_total_tokens is None:  # (slots given: the KV keeps its share, as the slots are the user's)
            extra = max(0, num_slots - split.num_state_slots) * layout.state_bytes_per_slot \
                if args.max_state_slots is None else 0
            # (no attention: KV indices alone, no bytes to give)
            kv_from_memory = split.num_kv_tokens - (extra // layout.kv_bytes_per_token if layout.kv_bytes_per_token else 0)
            if args.max_state_slots is None and args.max_running_requests and kv_from_memory < 4 * args.page_size:
                raise ValueError(
                    f"max_running_requests ({args.max_running_requests}) needs at least {floor} state slots "
                    f"({(floor + 1) * layout.state_bytes_per_slot / 2**20:.1f} MiB), which leave no room for KV in the "
                    f"cache's memory budget ({budget / 2**20:.1f} MiB: mem_fraction of the {self.device.type}'s free "
                    "memory): lower max_running_requests, raise mem_fraction, or give max_state_slots and "
                    "max_total_tokens")
        # explicit slots: as many running requests as leave half the slots to checkpoints (at most 256);
        # slots from memory: the same, at most the device's default
        cap = MAX_RUNNING_REQUESTS if args.max_state_slots else default_max_running_requests(self.device)
        self.max_running_requests = args.max_running_requests or running_requests_for_slots(num_slots, per_req, cap)
        check_state_slots(num_slots, self.max_running_requests, per_req,
                          f"{' and one scratch slot per draft token' if per_req > 1 else ''}"
                          f"{f' (and {drafting_states} for the draft model while it drafts)' if self.draft_model is not None else ''}")
        kv_running = max(running, self.max_running_requests)
        kv_cap = -(-kv_running * context // args.page_size) * args.page_size  # whole pages
        num_tokens = args.max_total_tokens or min(max(kv_from_memory, 4 * args.page_size), kv_cap, 1 << 22)
        kv_how = _how_sized(args.max_total_tokens, num_tokens, kv_cap, f"{kv_running} requests x {context} tokens")
        state_how = _how_sized(args.max_state_slots, num_slots, slot_cap,
                               f"{running} requests x {per_req + CHECKPOINTS_PER_RUNNING_REQUEST} slots")
        self.pool_sizing = f"KV {kv_how}, state {state_how}"  # for summary()
        num_tokens -= num_tokens % args.page_size
        self.cache_layout = layout  # what a token's KV and a state slot hold (a CachedPrefix's pools too)
        self.kv_pool = KVPool.from_layout(layout, num_tokens, args.page_size, self.device)
        self.state_pool = StatePool.from_layout(layout, num_slots, self.device)
        # the MTP and draft-model drafters reserve KV for their drafts (CacheManager.reserve_kv): a
        # request must fit beside it
        reserved = -(-self.max_running_requests * drafting_kv // args.page_size) * args.page_size \
            if self.mtp_head is not None or self.draft_model is not None else 0
        if reserved >= num_tokens:
            raise ValueError(f"max_total_tokens ({num_tokens}) leaves nothing beside the drafts' {reserved} KV slots")
        self.context_length = context_length_for(args.context_length, cfg.max_position_embeddings, num_tokens - reserved,
                                                 attention=cfg.num_attention_layers > 0)
        self.req_to_token = ReqToTokenPool(self.max_running_requests + 1, self.context_length + args.page_size)
        if args.enable_prefix_cache:
            self.tree = RadixCache(kv_pool=self.kv_pool, page_size=args.page_size,
                                   state_pool=self.state_pool if cfg.num_linear_layers else None)
        else:
            self.tree = None
        self.host_cache = None  # the hierarchical cache's host tier
        if args.enable_hierarchical_cache:
            host_tokens, host_slots = host_cache_sizes(args, num_tokens, num_slots, layout.kv_bytes_per_token,
                                                       layout.state_bytes_per_slot)
            host_bytes = HostCache.planned_bytes(layout, self.tree, host_tokens, host_slots)
            if host_bytes > _available_ram():
                raise ValueError(f"the hierarchical cache's host pools (and their copies' pinned staging on a GPU) "
                                 f"need {host_bytes / 2**30:.1f} GiB, more than the "
                                 f"{_available_ram() / 2**30:.1f} GiB of RAM available: lower hicache_ratio or "
                                 "hicache_size")
            self.host_cache = HostCache.from_layout(layout, self.tree, host_tokens, host_slots)

    def _lora_mb(self) -> float:
        """The LoRA adapters' slots (``lora.LinearLoRA``), in MB."""
        return sum(m.lora.nbytes for m in self.model.modules() if getattr(m, "lora", None) is not None) / 1e6

    @property
    def max_live_requests(self) -> int:
        """Requests the engine accepts at once: running slots plus the waiting queue. A submission
        beyond it raises ``EngineOverloadedError`` (the server: 429, or 400 for a batch larger than
        this on its own)."""
        return self.max_running_requests + self.args.max_queued_requests

    def _host_summary(self) -> str:
        host = self.host_cache
        if host is None:
            return ""
        slots = f", {host.state_pool.size} state slots" if host.state_pool is not None else ""
        return f" (host tier: {host.kv_pool.size} tokens{slots}, {host.total_bytes / 2**20:.1f} MiB)"

    def summary(self) -> str:
        cfg = self.model_config
        kinds = ", ".join(f"{k}={v}" for k, v in _count_layer_kinds(cfg).items())
        kv_dtype = f", {str(self.kv_pool.dtype).split('.')[-1]}" if self.args.kv_cache_dtype != "auto" else ""
        return (f"hyla engine: model={self.model_path} ({cfg.architecture}, {kinds}), dtype={self.args.dtype}"
                f"{self._weights_summary()}, "
                f"device={self.device}{f' (intra-op threads: {self.cpu_threads})' if self.cpu_threads else ''}, KV pool={self.kv_pool.size} tokens "
                f"({self.kv_pool.size * self.kv_pool.bytes_per_token / 2**20:.1f} MiB"
                f"{kv_dtype}), "
                f"state pool={self.state_pool.size} slots "
                f"({self.state_pool.size * self.state_pool.bytes_per_slot / 2**20:.1f} MiB), "
                f"max_running_requests={self.max_running_requests}, context_length={self.context_length}, "
                f"prefix_cache={'on' if self.tree is not None else 'off'}{self._host_summary()}, "
                f"decode={self._decode_mode()}"
                f"{', overlap schedule' if self.scheduler.config.overlap else ''}, "
                f"{f'LoRA adapters (up to {self.loras.max_cpu_loras} loaded, {self.args.max_loras} per batch, rank <= {self.args.max_lora_rank}, {self._lora_mb():.1f} MB of slots), ' if self.loras else ''}"
                f"speculative={self.args.speculative_algorithm or 'off'}"
                f"{f' ({self.args.num_draft_tokens} drafts per step)' if self.args.speculative_algorithm else ''}"
                f"{f', draft model={self.args.speculative_draft_model_path} ({self.draft_model.config.architecture})' if self.draft_model is not None else ''}, "
                f"pool sizes: {self.pool_sizing}")

    @property
    def keeps_fp8(self) -> bool:
        """Whether an FP8 checkpoint's weights stay float8 (``fp8_weights``; auto: on a CUDA device whose kernels
        take float8 (compute capability 8.9 on), or ``quantization="fp8"``)."""
        mode = self.args.fp8_weights
        on_gpu = self.device.type == "cuda" and gpu_ops.float8_supported(self.device)
        return mode == "keep" or (mode == "auto" and (on_gpu or self.args.quantization == "fp8"))

    def _check_float8(self) -> None:
        """``ValueError`` for float8 a CUDA device's kernels cannot take (``gpu_ops.FLOAT8_MIN_CAPABILITY``:
        e4m3 from 8.9, e5m2 from 8.0): kept FP8 weights (``fp8_weights="keep"``, ``quantization="fp8"``: e4m3) or a
        float8 KV cache. ``fp8_weights="auto"`` dequantizes where e4m3 is missing instead."""
        kv = kv_cache_torch_dtype(self.args.kv_cache_dtype)
        asked = [(what, dtype) for what, dtype, on in (
            ("fp8_weights='keep'", torch.float8_e4m3fn, self.args.fp8_weights == "keep"),
            ("quantization='fp8'", torch.float8_e4m3fn, self.args.quantization == "fp8"),
            (f"kv_cache_dtype={self.args.kv_cache_dtype!r}", kv, kv is not None)) if on]
        missing = [(what, dtype) for what, dtype in asked if not gpu_ops.float8_supported(self.device, dtype)]
        if missing:
            major, minor = torch.cuda.get_device_capability(self.device)
            needs = "; ".join(f"{what} needs {'.'.join(map(str, gpu_ops.FLOAT8_MIN_CAPABILITY[dtype]))}"
                              for what, dtype in missing)
            raise ValueError(f"{self.device} (compute capability {major}.{minor}) has no Triton float8 kernels of "
                             f"that type: {needs} (fp8_e5m2 runs from 8.0, an A100 too)")

    def _weights_summary(self) -> str:
        q = self.checkpoint_quantization
        if q is None and self.args.quantization is None:
            return ""
        kept = sum(p.numel() for p in self.model.parameters() if is_fp8(p))
        total = sum(p.numel() for p in self.model.parameters())
        how = f"{kept / total:.0%} of the weights kept in float8" if self.keeps_fp8 \
            else f"weights dequantized to {self.args.dtype}"
        if q is None:
            return f" (quantized to FP8 at load: {how})"
        scales = "per tensor" if q.block is None else f"per {q.block[0]}x{q.block[1]} block"
        return f" (from an FP8 checkpoint, scales {scales}: {how})"

    def _decode_mode(self) -> str:
        runner = self.scheduler.runner
        if not runner.fused:
            if not runner.compiled:
                return "pytorch ops"
            trees = ", trees as padded trees" if runner.verify_trees else ""
            return "pytorch ops, torch.compile" + (f" (verify steps too{trees})" if runner.verify_width else "")
        chains = " (verify steps too, as padded chains)" if runner.verify_width else ""
        if runner.graphs is None:
            return "fused Triton kernels" + chains
        return f"fused Triton kernels{chains}, CUDA graphs up to batch {runner.graphs.max_bs}"

    # ------------------------------------------------------------------------------------------
    # public API
    # ------------------------------------------------------------------------------------------
    def generate(self, prompt: str | list[str] | None = None, sampling_params: dict | list[dict] | None = None,
                 input_ids: list[int] | list[list[int]] | None = None, return_logprob: bool = False,
                 stream: bool = False, checkpoints: Sequence[int] | Sequence[Sequence[int]] | None = None,
                 rid: str | list[str] | None = None, namespace: Any = None,
                 logprob_start_len: int | list[int] = -1, speculative_checkpoints: bool = False,
                 priority: int | list[int] | None = None, lora_name: str | list[str | None] | None = None,
                 image_data: Any = None) -> Any:
        """Generate for one request (returns a dict) or a list (returns a list of dicts).

        ``checkpoints``: extra token positions of the prompt (e.g. the end of a shared system
        prompt) where the engine caches the recurrent state, so a prefix ending there hits from its
        second use. They are kept like a finished turn's end: when the state pool is full, the least
        recently used unlocked checkpoint makes room. ``speculative_checkpoints=True`` marks them as
        guesses instead (what the chat API does with message ends): stored only in free slots or in
        place of other guesses and superseded checkpoints, never pushing out one that has served a
        hit or ends a finished turn (docs/cache.md).
        ``return_logprob`` with ``logprob_start_len=k >= 0`` (SGLang's) also returns the logprobs
        of prompt tokens ``k..`` (``meta_info["input_token_logprobs"]``; token 0 has none: None).
        A cached token has no logits, so such a request reuses the prefix cache only up to ``k - 1``.
        ``priority`` (an int, or one per request; with ``enable_priority_scheduling``, else 0 or
        None): waiting requests are admitted by priority first, and one may preempt running requests
        of a much lower one (docs/engine.md, "Priority scheduling").
        ``lora_name`` (a name, or one per request; with ``enable_lora``): the LoRA adapter loaded under that
        name (:meth:`load_lora_adapter`) applies to the request; None, the base model.
        ``image_data`` (a vision-language model's): the prompt's images in order, each an encoded file's
        bytes, a data URL, a local file's path, a PIL image (``image_processing.load_image``) or what
        :meth:`process_images` made of one; one request's
        list (or a single image), or one list per request. The prompt holds one image token (the chat
        template's ``<|image_pad|>``) where each goes; the engine repeats it to the image's token count
        (``prompt_tokens`` counts them all). ``checkpoints`` and ``logprob_start_len`` count the prompt's
        tokens as given: the engine moves them past the images before them.
        ``stream=True`` (one request) returns an iterator of incremental chunks (``RequestStream``):
        closing it, or dropping it before the request ends, aborts the request. A call interrupted
        while it waits (``KeyboardInterrupt``) aborts its requests too.
        """
        reqs, single = self._make_requests(prompt, input_ids, sampling_params, return_logprob, checkpoints, rid, namespace,
                                           logprob_start_len, speculative_checkpoints, priority, stream, lora_name,
                                           image_data=image_data)
        if stream:
            if not single:
                raise RequestError("stream=True takes a single request", "stream")
            return self._stream_sync(reqs[0])
        sinks = [queue.SimpleQueue() for _ in reqs]
        for req, sink in zip(reqs, sinks):
            req.on_output = lambda out, done, s=sink: s.put(out)
        self._submit(reqs)
        try:
            outs = [sink.get() for sink in sinks]
        except BaseException:  # interrupted while waiting: nobody will read these
            for req, sink in zip(reqs, sinks):
                if sink.empty():  # (by the request itself: it may end meanwhile, and its rid be reused)
                    self._abort_soon(req)
            raise
        return outs[0] if single else outs

    async def async_generate(self, prompt: str | list[str] | None = None, sampling_params: dict | list[dict] | None = None,
                             input_ids: list[int] | list[list[int]] | None = None, return_logprob: bool = False,
                             stream: bool = False, checkpoints: Sequence[int] | Sequence[Sequence[int]] | None = None,
                             rid: str | list[str] | None = None, namespace: Any = None,
                             logprob_start_len: int | list[int] = -1, speculative_checkpoints: bool = False,
                             priority: int | list[int] | None = None,
                             lora_name: str | list[str | None] | None = None, image_data: Any = None) -> Any:
        """asyncio variant of ``generate``; with ``stream=True`` returns an async iterator. A request
        with a grammar, long prompts or long lists in its sampling params (``WORKER_THREAD_PROMPT_SIZE``:
        stop token ids, logit biases) and one with images are made in a worker thread: compiling a grammar can
        take seconds (a large schema), tokenizing megabytes of text too, checking millions of ids half a second,
        decoding and resizing an image tens of milliseconds, and the event loop must not wait for any of them."""
        make = functools.partial(self._make_requests, prompt, input_ids, sampling_params, return_logprob, checkpoints,
                                 rid, namespace, logprob_start_len, speculative_checkpoints, priority, stream, lora_name,
                                 image_data=image_data)
        slow = _asks_for_grammar(sampling_params) or image_data is not None \
            or _prompt_size(prompt, input_ids) > WORKER_THREAD_PROMPT_SIZE \
            or _params_size(sampling_params) > WORKER_THREAD_PROMPT_SIZE
        reqs, single = await asyncio.to_thread(make) if slow else make()
        if stream:
            if not single:
                raise RequestError("stream=True takes a single request", "stream")
            return self._stream_async(reqs[0])
        loop = asyncio.get_running_loop()
        futures = [loop.create_future() for _ in reqs]
        for req, fut in zip(reqs, futures):
            req.on_output = lambda out, done, f=fut: loop.call_soon_threadsafe(lambda: f.done() or f.set_result(out))
        self._submit(reqs)
        try:
            outs = await asyncio.gather(*futures)
        except asyncio.CancelledError:
            for req in reqs:  # (each by itself: a finished one's abort finds nothing, though its rid be reused;
                self._abort_soon(req)  # gather has cancelled every future, so they cannot tell which finished)
            self._wakeup.set()
            raise
        return outs[0] if single else outs

    def check_requests(self, requests: Sequence[dict[str, Any]]) -> None:
        """``ValueError`` (``RequestError``) where ``generate`` would refuse one of ``requests`` (each a dict of
        its keyword arguments, ``stream`` aside) for what it asks, or all of them together as more than the
        engine ever holds at once; nothing is submitted. For a server that decides where a request runs
        before running it (prefill/decode disaggregation). A grammar is compiled as ``generate`` compiles it."""
        if not isinstance(requests, (list, tuple)) or not all(isinstance(kw, dict) for kw in requests):
            raise ValueError("check_requests takes a list of dicts of generate's keyword arguments")
        count = 0
        for kw in requests:
            unknown = set(kw) - _CHECKED_ARGUMENTS
            if unknown:
                raise ValueError(f"check_requests: unknown argument(s) {sorted(unknown, key=str)}")
            reqs, _ = self._make_requests(**{**dict.fromkeys(("prompt", "input_ids", "sampling_params", "checkpoints",
                                                              "rid", "namespace")), "return_logprob": False, **kw},
                                          counting_rids=False)
            count += len(reqs)
        if count > self.max_live_requests:
            raise ValueError(f"a batch of {count} requests can never fit: the engine holds at most "
                             f"{self.max_live_requests} at once")

    def abort(self, rid: str) -> None:
        """Abort a waiting or running request; it finishes with ``finish_reason.type == "abort"``.
        Nothing on an engine shut down; an id no live request has, nothing either (it finished)."""
        if not isinstance(rid, str):
            raise ValueError(f"rid must be a string, got {rid!r}")
        self._abort_soon(rid)
        self._wakeup.set()

    def abort_all(self) -> int:
        """``abort`` every live request (waiting, running, or submitted and not yet scheduled);
        returns how many were told to. Requests submitted after the call run."""
        with self._inbox_lock:
            reqs = list(self._live.values())
        for req in reqs:  # (each by itself: one that ends meanwhile may see its rid taken by a new request)
            self._abort_soon(req)
        self._wakeup.set()
        return len(reqs)

    def flush_cache(self, timeout: float = 60.0) -> bool:
        """Empty the prefix cache: every cached prefix's KV and state checkpoints go back to the
        pools, so that the next request computes its whole prompt (a cold measurement, a fresh start
        for a study); the images' embeddings kept (``mm_embedding_cache_mb``) go too. It runs on the scheduler thread between steps, and only while no request is
        waiting or running, those submitted before the call included (SGLang's ``flush_cache``):
        otherwise it returns False and changes nothing. The counters of ``get_stats`` go on.
        ``TimeoutError`` when the scheduler thread has not answered after ``timeout`` seconds."""
        _check_timeout(timeout)
        return self._on_scheduler_thread(self.scheduler.flush_cache, timeout)

    def export_prefix(self, input_ids: Sequence[int], namespace: Any = None, timeout: float = 60.0, *,
                      kv_from: int = 0, lora_name: str | None = None, image_data: Any = None) -> CachedPrefix | None:
        """A copy of what a request with prompt ``input_ids`` (in cache ``namespace``) would find cached:
        the longest cached prefix of all its tokens but the last, with its KV and the recurrent state
        after it (``hyla/cache/prefix_transfer.py``); None where nothing is cached. ``CachedPrefix.to_bytes``
        sends it elsewhere, where ``import_prefix`` puts it into another engine of the same model and
        cache layout (another server, a decode server after a prefill server), which then hits it as
        this one would. ``kv_from``: the KV of the positions from there on only (the last token's at least),
        for an engine that holds the KV before it (its ``cached_tokens(..., device_only=True)``); the
        state is whole. It runs on the scheduler thread between steps (a copy out of the device: on a
        GPU it waits for the step in flight). ``lora_name``: what a request applying that LoRA adapter would
        find (its own namespace within ``namespace``; the prefix carries it, so that the importing engine's
        requests of the same adapter's files hit it). ``image_data``: the prompt's images, as ``generate`` takes
        them (the prefix's keys name them: ``Req.fill_keys``). ``ValueError`` for bad token ids, namespace,
        ``kv_from``, ``lora_name`` or images."""
        _check_timeout(timeout)
        ids, _ = self._prefix_keys(input_ids, image_data, -1)
        namespace = self._cache_namespace(namespace, lora_name)
        if isinstance(kv_from, bool) or not isinstance(kv_from, int) or kv_from < 0:
            raise ValueError(f"kv_from must be a position (an int >= 0), got {kv_from!r}")

        def export() -> CachedPrefix | None:  # (with the name and digest of the weights that computed it, read between steps)
            prefix = self.cache.export_prefix(ids, namespace, self.cache_layout, kv_from)
            if prefix is not None:
                prefix.weight_version, prefix.weights_digest = self.weight_version, self._served_weights_digest()
            return prefix
        return self._on_scheduler_thread(export, timeout)

    def _cache_namespace(self, namespace: Any, lora_name: str | None) -> Any:
        """The prefix-cache namespace of a request in ``namespace`` applying the LoRA adapter ``lora_name``
        (None: none); ``RequestError`` for an unhashable namespace or an adapter not loaded."""
        _check_namespace(namespace)
        return lora_namespace(self._loras(lora_name, 1)[0], namespace)

    def _prefix_keys(self, input_ids: Any, image_data: Any, logprob_start_len: int) -> tuple[list[int], int]:
        """A prompt's keys in the prefix cache (``export_prefix``, ``cached_tokens``): ``input_ids`` checked as a
        prompt of this model's vocabulary, with ``image_data``'s tokens (as ``generate`` takes them) named by
        their images (``Req.fill_keys``); and the most a cache could serve of it (``new_request_match_limit``,
        ``logprob_start_len`` moved past the images before it)."""
        vocab = self.model_config.vocab_size
        if isinstance(input_ids, (str, bytes)) or not isinstance(input_ids, Sequence):
            raise RequestError("input_ids must be a list of token ids", "input_ids")
        ids = [_token_id(t, vocab) for t in input_ids]
        _check_logprob_start(logprob_start_len, len(ids))
        sources = [] if image_data is None else list(image_data) if isinstance(image_data, (list, tuple)) \
            else [image_data]
        if sources:  # (none: the prompt as text, as generate takes image_data=[])
            self.check_image_count(len(sources))
            expanded, images = self._expand_images(ids, sources)
            ids = images.key_ids(expanded)
            logprob_start_len = images.expanded(logprob_start_len)  # (-1 and 0 stay as they are)
        return ids, new_request_match_limit(len(ids), logprob_start_len) if ids else 0

    def cached_tokens(self, input_ids: Sequence[int], namespace: Any = None, timeout: float = 60.0, *,
                      device_only: bool = False, lora_name: str | None = None, image_data: Any = None) -> int:
        """How many tokens of prompt ``input_ids`` (in cache ``namespace``) a request would find cached now
        (the prefix ``export_prefix`` would copy; the host tier's too unless ``device_only``: what an
        import's ``kv_from`` may skip). A router asks it to decide where a prompt is computed. Runs on the
        scheduler thread between steps. ``lora_name``: for a request applying that LoRA adapter; ``image_data``: with
        the prompt's images (as ``generate`` takes them; the counts are of its tokens with the images'). ``ValueError``
        for bad token ids, namespace, ``lora_name`` or images."""
        cached = self.cached_tokens_by_tier(input_ids, namespace, timeout, lora_name=lora_name, image_data=image_data)
        return cached.device if device_only else cached.any_tier

    def cached_tokens_by_tier(self, input_ids: Sequence[int], namespace: Any = None, timeout: float = 60.0, *,
                              logprob_start_len: int = -1, lora_name: str | None = None,
                              image_data: Any = None) -> CachedTokens:
        """``cached_tokens`` both ways in one query of the scheduler thread, and the most any cache could
        serve of this prompt: ``CachedTokens(device_only, any_tier, limit)``. ``logprob_start_len`` as
        ``generate`` takes it (a request with prompt logprobs is served from a cache only up to the first
        position whose logits they need): the counts are for such a request; ``lora_name`` and ``image_data`` too."""
        _check_timeout(timeout)
        ids, limit = self._prefix_keys(input_ids, image_data, logprob_start_len)
        namespace = self._cache_namespace(namespace, lora_name)
        device, any_tier = self._on_scheduler_thread(lambda: self.cache.prompt_cached_lens(ids, namespace, limit),
                                                     timeout)
        return CachedTokens(device, any_tier, limit)

    def import_prefix(self, prefix: CachedPrefix | bytes, timeout: float = 60.0) -> int:
        """Put a cached prefix of another engine (``export_prefix``; its bytes or the object) into this
        engine's prefix cache, as if computed here: a request whose prompt extends it hits it. Returns
        how many of its tokens the cache holds now (all of them; or, where no room could be made
        without evicting what running requests hold, or where the prefix lacks KV the cache no longer
        holds either (``export_prefix``'s ``kv_from``), what it held before). ``ValueError`` for bytes
        that are not a prefix, a prefix of another model or cache layout (another KV dtype, draft
        model or MTP), token ids outside the vocabulary, NaN or infinite values
        (``CachedPrefix.check_values``), a length off the page grid, or the prefix cache off. The bytes
        are read, and the values checked, on the calling thread; the copy in runs on the scheduler
        thread between steps. A prefix computed by other weights (its ``weight_version`` not this engine's:
        one exported before a weight update, or by a server of another checkpoint) is a ``ValueError`` too.
        The prefix is trusted as computed by this model: import only from your own servers (the
        server's ``/import_prefix`` needs the API key)."""
        _check_timeout(timeout)
        if isinstance(prefix, (bytes, bytearray, memoryview)):
            prefix = self.read_prefix(prefix)
        elif isinstance(prefix, CachedPrefix):
            self._check_prefix(prefix)
        else:
            raise ValueError(f"import_prefix takes a CachedPrefix or its bytes, got {type(prefix).__name__}")
        prefix.check_values()  # (here, not in _check_prefix: a server's read_prefix, then this, reads them once)

        def copy_in() -> int:  # (its weights asked again between steps: an update may have come since)
            self._check_weights_of(prefix)
            if self.tree is not None:  # (another layout first: the likelier cause, which its message names)
                prefix.check_fits(self.kv_pool, self.tree.state_pool)
            if prefix.weights_digest is not None and prefix.weights_digest != self._served_weights_digest():
                raise ValueError("the prefix was computed by other weights than those served now (their values' "
                                 "digests differ, whatever their weight_version: exported before a weight update, or "
                                 "by a server of another checkpoint or quantization): its KV and state are not what "
                                 "these weights compute")
            return self.cache.import_prefix(prefix)
        return self._on_scheduler_thread(copy_in, timeout)

    def read_prefix(self, data: bytes | bytearray | memoryview) -> CachedPrefix:
        """``CachedPrefix.from_bytes`` for this engine's cache, checked as ``import_prefix`` checks it
        (``ValueError``), but for its values, which ``import_prefix`` checks."""
        if self.tree is None:
            raise ValueError(NO_CACHE_TO_IMPORT_INTO)
        prefix = CachedPrefix.from_bytes(bytes(data), self.cache_layout, self.tree.state_pool is not None)
        self._check_prefix(prefix)
        return prefix

    def _check_prefix(self, prefix: CachedPrefix) -> None:
        """What ``CacheManager.import_prefix`` cannot check: the prefix's token ids, length and namespace."""
        vocab = self.model_config.vocab_size
        low = -2**63 if self.image_processor is not None else 0  # (a model that takes images: its images' keys)
        bad = next((t for t in prefix.token_ids if isinstance(t, bool) or not isinstance(t, int)
                    or not low <= t < vocab), None) if prefix.token_ids else None
        if bad is not None:
            raise ValueError(f"the prefix's token id {bad!r} is outside the vocabulary [0, {vocab})"
                             f"{' (or an image key, negative)' if low else ''}")
        if len(prefix) >= self.context_length:
            raise ValueError(f"a prefix of {len(prefix)} tokens is longer than any prompt this engine takes (its "
                             f"context length is {self.context_length})")
        _check_namespace(prefix.namespace)
        self._check_weights_of(prefix)

    def _served_weights_digest(self) -> str:
        """``weights_digest`` of the weights served (the model's, the MTP head's, the draft model's: the prefix holds
        the draft's KV too), computed at its first use and after each update; on the scheduler thread only, between
        steps (an update's ``apply`` runs there too)."""
        if self._weights_digest is None:
            self._weights_digest = weights_digest(self.model, self.mtp_head, self.draft_model)
        return self._weights_digest

    def _check_weights_of(self, prefix: CachedPrefix) -> None:
        """``ValueError`` unless ``prefix`` was computed by the weights served now (by their name,
        ``weight_version``): another's KV and state would change what this model computes."""
        if prefix.weight_version != self.weight_version:
            raise ValueError(f"the prefix was computed by the weights {prefix.weight_version!r}, this engine serves "
                             f"{self.weight_version!r} (weight_version): its KV and state are not what these "
                             "weights compute")

    def update_weights_from_disk(self, model_path: str | os.PathLike, *, abort_all_requests: bool = False,
                                 weight_version: str | None = None, timeout: float = WEIGHT_UPDATE_SECONDS) -> dict[str, Any]:
        """Serve the weights of another checkpoint of the same model from now on (a trainer's latest,
        in reinforcement learning): SGLang's ``update_weights_from_disk``, without a restart.

        The checkpoint is checked first from its files' headers, on this thread while the engine
        serves on (no tensor data read); one that is no checkpoint of this model (another
        ``config.json``, a missing, unexpected, non-float or mis-shaped tensor) is a ``ValueError``
        and nothing changes. Then no request is admitted for the first time while those running
        finish on the old weights (new ones queue, as usual); with ``abort_all_requests`` every live
        request is aborted instead (its client gets its output so far, finish reason abort). Between
        two steps the weights are read and written in place one parameter at a time (host memory:
        one parameter's worth), the prefix cache is emptied (it was computed with the old weights),
        and the queue runs on the new ones: no request's output mixes two weights. With
        ``compile_decode`` the decode graphs are compiled again meanwhile (a minute or more on a
        small CPU). A read failing then (a file changed since the check): the old weights are read
        back from ``model_path`` and the error is a ``ValueError``; should that fail too, a
        ``RuntimeError`` says the weights are inconsistent. See ``hyla/engine/weight_update.py``.

        ``weight_version``: the new weights' name, in the ``meta_info`` of every request that runs
        on them (default: the current one). ``TimeoutError`` when the running requests have not
        finished after ``timeout`` seconds (``math.inf``: no limit): nothing changed, and the queue
        moves again (as when another update holds the engine for longer). Returns
        ``{"model_path", "weight_version", "num_aborted_requests", "seconds"}``."""
        if not isinstance(model_path, (str, os.PathLike)):
            raise ValueError(f"model_path must be a path, got {model_path!r}")
        if weight_version is not None:
            check_weight_version(weight_version)
        _check_timeout(timeout)
        start = time.monotonic()  # (the timeout counts from here: another update's turn, the read, the drain)
        if not self._update_lock.acquire(timeout=-1 if timeout >= NO_TIMEOUT_PAST else timeout):  # one at a time
            raise TimeoutError(f"another weight update still running after {timeout:g} s: the weights were not updated")
        try:
            read = functools.partial(NewWeights.read, model_path, self.model, self.mtp_head)
            new = run_in_own_thread(read) if self.device.type == "cpu" else read()  # (no OpenMP team kept here)
            version = weight_version or self.weight_version
            # (read by the scheduler at its next admission: one it is making now may still start, and is waited for)
            self.scheduler.admit_new = False
            try:
                aborted = self.abort_all() if abort_all_requests else 0
                deadline = start + timeout
                while not self._drained_before(deadline):
                    if time.monotonic() >= deadline:
                        raise TimeoutError(f"requests still running after {timeout:g} s: the weights were not updated")
                    time.sleep(0.005)

                def apply() -> None:  # (the weights served now came from model_path: read back should a read fail)
                    self._weights_digest = None  # (a failed apply reads the old weights back: computed again anyway)
                    new.apply(self.model, self.mtp_head, self.scheduler, self.model_path)
                    self.scheduler.weight_version = version
                    self.model_path = new.path
                # the update itself is not cut short: with compile_decode it compiles
                self._on_scheduler_thread(apply, WEIGHT_UPDATE_APPLY_SECONDS)
            finally:
                self.scheduler.admit_new = True
                self._wakeup.set()
        finally:
            self._update_lock.release()
        logger.info("weights updated from %s (version %s)", new.path, version)
        return {"model_path": str(new.path), "weight_version": version, "num_aborted_requests": aborted,
                "seconds": time.monotonic() - start}

    def _drained_before(self, deadline: float) -> bool:
        """``Scheduler.drained``, asked between two steps; False when no answer comes before ``deadline``
        (or within a minute: the caller asks again; a ``timeout`` of ``inf`` waits for ever)."""
        try:
            return self._on_scheduler_thread(self.scheduler.drained,
                                             min(60.0, max(0.001, deadline - time.monotonic())))
        except TimeoutError:
            return False

    def load_lora_adapter(self, name: str, path: str | os.PathLike, timeout: float = 60.0, *,
                          replace: bool = False) -> None:
        """Serve the PEFT LoRA adapter in directory ``path`` (``adapter_config.json``,
        ``adapter_model.safetensors``) as ``name``: requests with ``lora_name=name`` apply it from now on,
        mixed in one batch with other adapters' and the base model's. Read here, installed between steps
        (running requests go on); its weights go into a slot when a request applying it is admitted
        (``LoRAManager``). ``ValueError`` when the engine serves no adapters (``enable_lora``), for a name already
        loaded, ``max_cpu_loras`` loaded, and an adapter it cannot apply (``lora.read_adapter``: its rank above
        ``max_lora_rank``, shapes that do not fit, targets hyla does not adapt). ``replace``: one loaded as
        ``name`` is unloaded once this one is in (vLLM's ``load_inplace``; it stays where this one is refused)."""
        if self.loras is None:
            raise ValueError("this engine serves no LoRA adapters: start it with enable_lora=True "
                             "(hyla serve --enable-lora)")
        check_lora_name(name)
        _check_timeout(timeout)
        if not isinstance(replace, bool):
            raise ValueError(f"replace must be a bool, got {type(replace).__name__}")
        self.loras.check_room(name, replace)  # (before reading: a full engine answers at once)
        try:
            adapter = read_adapter(path, self.model, self.model_path, self.args.max_lora_rank)
        except OSError as exc:  # a file unreadable or vanished while read
            raise ValueError(f"{path}: {exc}") from None

        def load() -> None:
            with self._inbox_lock:  # (as unload: a replaced adapter's weights go when no live request applies them)
                self.loras.publish(name, adapter, self._live_lora_uids(), replace)
        self._on_scheduler_thread(load, timeout)

    def unload_lora_adapter(self, name: str, timeout: float = 60.0) -> None:
        """Stop serving the adapter loaded as ``name`` (``ValueError`` if none is): new requests naming it
        are refused; those running with it finish with it, and its weights go when the last ends."""
        if self.loras is None:
            raise ValueError("this engine serves no LoRA adapters (enable_lora)")
        check_lora_name(name)
        _check_timeout(timeout)

        def unload() -> None:
            with self._inbox_lock:  # (as _submit: a request made before, submitted after, is refused there)
                self.loras.unload(name, self._live_lora_uids())
        self._on_scheduler_thread(unload, timeout)

    def lora_adapters(self) -> dict[str, str]:
        """The LoRA adapters served: name -> the directory it was loaded from (empty without ``enable_lora``)."""
        return {} if self.loras is None else self.loras.adapters()

    def _live_lora_uids(self) -> set[int]:
        """The adapters the live requests apply (under the inbox lock)."""
        return {r.lora_uid for r in self._live.values() if r.lora_uid}

    @property
    def weight_version(self) -> str:
        """The name of the weights served (``weight_version``; changed by a weight update)."""
        return self.scheduler.weight_version

    def get_stats(self) -> dict[str, Any]:
        """Counters and gauges for logs and /metrics (read without locking: approximate)."""
        s, out, cache, host = self.scheduler, self.scheduler.output, self.cache, self.cache.host
        images = getattr(s.runner, "image_cache", None)
        tok_usage, state_usage = cache.usage()
        return {
            "num_prompt_tokens": s.num_prompt_tokens,
            "num_cached_tokens": s.num_cached_tokens,
            "num_generated_tokens": out.num_generated_tokens,
            "num_requests_finished": out.num_requests_finished,
            "num_retractions": s.num_retractions,
            "num_preemptions": s.num_preemptions,
            "num_overlapped_steps": s.num_overlapped_steps,
            "num_mixed_tokens": s.num_mixed_tokens,
            "num_evicted_tokens": cache.num_evicted_tokens,
            "num_evicted_states": cache.num_evicted_states,
            "num_host_hit_tokens": cache.num_host_hit_tokens,
            "num_host_saved_tokens": host.num_saved_tokens if host is not None else 0,
            "num_host_loaded_tokens": host.num_loaded_tokens if host is not None else 0,
            "host_token_usage": host.tree.total_size() / host.kv_pool.size if host is not None else None,
            "cache_hit_rate": s.num_cached_tokens / max(1, s.num_prompt_tokens),
            "token_usage": tok_usage,
            "state_usage": state_usage,
            "num_running_requests": s.num_running,
            "num_queued_requests": s.num_waiting,
            "gen_throughput": s.last_gen_throughput,
            "spec_accept_length": s.accept_length if s.drafter is not None else None,
            # a vision-language model's images: embedded by the tower, or from the embedding cache (None: a text model)
            "num_image_encodes": images.num_encoded if images is not None else None,
            "num_image_cache_hits": images.num_hits if images is not None else None,
            "num_lora_adapters": len(self.loras.adapters()) if self.loras is not None else None,
            "num_lora_requests": sum(1 for r in [*s.running, *s.waiting] if r.lora_uid)
            if self.loras is not None else None,
            "num_lora_slot_loads": self.loras.num_slot_loads if self.loras is not None else None,
            # vLLM's lora_requests_info: the adapters running and waiting requests apply (a LoRA-aware router sends
            # an adapter's requests where it is running already)
            "lora_requests_info": {"running": self.loras.names(r.lora_uid for r in list(s.running)),
                                   "waiting": self.loras.names(r.lora_uid for r in list(s.waiting)),
                                   "max_lora": self.args.max_loras} if self.loras is not None else None,
        }

    def record_cache_events(self) -> CacheLedger:
        """Start recording what the prefix cache evicts and why, which checkpoints find no room,
        and each request's cached prefix at admission: the returned ``CacheLedger`` explains a
        request's missing hit (``ledger.explain(rid, wanted)``, see ``hyla/cache/ledger.py``). For
        studies: the record grows with every event. Call it while the engine is idle."""
        ledger = CacheLedger()
        self.cache.record(ledger)
        return ledger

    def wait_idle(self, timeout: float = 60.0) -> None:
        """Block until every submitted request has finished, its rid free again (tests, benchmarks); at once
        on an engine shut down (nothing will run). ``TimeoutError`` after ``timeout`` seconds."""
        _check_timeout(timeout, zero_ok=True)
        deadline = time.monotonic() + min(timeout, NO_TIMEOUT_PAST)
        while True:
            if self._stopped or self._inbox.empty() and not self.scheduler.has_work() and not self._live:
                return
            if time.monotonic() >= deadline:
                raise TimeoutError("engine still busy")
            time.sleep(0.005)

    def check_integrity(self) -> None:
        """Pool/tree invariants; call only when idle (``wait_idle``)."""
        self.scheduler.check_integrity()

    def shutdown(self) -> None:
        with self._inbox_lock:
            if self._stopped:
                return
            self._stopped = True
        self._wakeup.set()
        self._thread.join(timeout=30)

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    # ------------------------------------------------------------------------------------------
    # requests
    # ------------------------------------------------------------------------------------------
    def _make_requests(self, prompt, input_ids, sampling_params, return_logprob, checkpoints, rid, namespace,
                       logprob_start_len=-1, speculative_checkpoints=False, priority=None, stream=False,
                       lora_name=None, counting_rids=True, image_data=None):
        for name, flag in (("speculative_checkpoints", speculative_checkpoints), ("return_logprob", return_logprob),
                           ("stream", stream)):
            if not isinstance(flag, bool):
                raise RequestError(f"{name} must be a bool, got {flag!r}", name)
        if (prompt is None) == (input_ids is None):
            raise ValueError("give exactly one of prompt or input_ids")
        _check_namespace(namespace)
        if prompt is not None:
            single = isinstance(prompt, str)
            prompts = [prompt] if single else list(prompt) if isinstance(prompt, (list, tuple)) else None
            if prompts is None or not all(isinstance(p, str) for p in prompts):
                raise RequestError("prompt must be a string or a list of strings", "prompt")
            if self.tokenizer is None:
                raise RequestError(f"model {self.model_path} has no tokenizer: pass input_ids instead of prompt", "prompt")
            try:
                id_lists = [self.tokenizer.encode(p) for p in prompts]
            except ValueError as exc:  # (a lone surrogate)
                raise RequestError(str(exc), "prompt") from None
        else:
            if not isinstance(input_ids, (list, tuple)):
                raise RequestError(f"input_ids must be a list of token ids or a list of such lists, got {input_ids!r}",
                                   "input_ids")
            single = len(input_ids) == 0 or not isinstance(input_ids[0], (list, tuple))
            if not single and not all(isinstance(x, (list, tuple)) for x in input_ids):
                raise RequestError("input_ids must be a list of token ids or a list of such lists, not a mix", "input_ids")
            id_lists = [list(input_ids)] if single else [list(x) for x in input_ids]
        n = len(id_lists)
        if n == 0:
            raise ValueError("no request given")
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * n
        if len(params) != n:
            raise RequestError(f"{len(params)} sampling_params for {n} requests", "sampling_params")
        ckpts = _per_request_checkpoints(checkpoints, n, single)
        rids = [rid] if isinstance(rid, str) else list(rid) if isinstance(rid, (list, tuple)) \
            else [None] * n if rid is None else None
        if rids is None or not all(isinstance(r, str) for r in rids if r is not None):
            raise RequestError(f"rid must be a string or a list of strings, got {rid!r}", "rid")
        if len(rids) != n or len(ckpts) != n:
            raise RequestError("rid and checkpoints must have one entry per request", "rid" if len(rids) != n else "checkpoints")
        starts = list(logprob_start_len) if isinstance(logprob_start_len, (list, tuple)) else [logprob_start_len] * n
        if len(starts) != n:
            raise RequestError(f"{len(starts)} logprob_start_len values for {n} requests", "logprob_start_len")
        priorities = self._priorities(priority, n)
        loras = self._loras(lora_name, n)
        images = self._image_lists(image_data, n, single)
        if not counting_rids:  # (``check_requests``: requests never submitted take no id from the counter)
            rids = [r if r is not None else "unsubmitted" for r in rids]
        reqs = [self._make_request(ids, p, return_logprob, c, r, namespace, k, speculative_checkpoints, i)
                for ids, p, c, r, k, i in zip(id_lists, params, ckpts, rids, starts, images)]
        for req, prio, lora in zip(reqs, priorities, loras):
            req.priority = prio
            if lora is not None:
                req.lora_uid, req.namespace = lora.uid, lora_namespace(lora, req.namespace)  # (its slot: at admission)
        return reqs, single

    def process_images(self, sources: Sequence[Any],
                       mm_processor_kwargs: dict[str, int] | None = None) -> list[ProcessedImage]:
        """Each image of ``sources`` (what ``image_data`` takes; a :class:`ProcessedImage` as it is) decoded and
        preprocessed for this model's vision tower: its patches and its token count (``num_tokens``), what a
        server reads to know a prompt's length before submitting it. ``mm_processor_kwargs`` (``min_pixels``,
        ``max_pixels``) override the engine's preprocessing for these images. ``RequestError`` (``image_data``)
        for more images than ``limit_mm_per_prompt`` allows, one that cannot be read, images whose tokens fill the
        context (known from each header, before its pixels are decoded), or a model without a vision tower;
        (``mm_processor_kwargs``) for an override it does not take. Decoding takes milliseconds an image: not on an
        event loop."""
        self.check_image_count(len(sources))
        config, count = self._image_config(mm_processor_kwargs), self._image_budget()
        out = []
        try:
            for src in sources:
                if not isinstance(src, ProcessedImage):  # (counted from its header, before its pixels are decoded)
                    src = process_image(load_image(src, check_size=lambda w, h: count(image_tokens(w, h, config))),
                                        config)
                else:
                    count(src.num_tokens)
                out.append(src)
        except ValueError as exc:
            raise RequestError(f"image_data: {exc}", "image_data") from None
        return out

    def prompt_ids(self, input_ids: Sequence[int], image_data: Sequence[Any]) -> list[int]:
        """``input_ids`` as a request with ``image_data`` feeds them: each image's placeholder repeated to its
        token count (``generate``'s ``image_data``), what ``prompt_tokens`` counts. ``RequestError``
        (``image_data``) as ``generate`` refuses the images."""
        return self._expand_images(list(input_ids), list(image_data))[0]

    def count_image_tokens(self, sources: Sequence[Any], mm_processor_kwargs: dict[str, int] | None = None, *,
                           one_prompt: bool = True) -> list[int]:
        """Each image's token count as :meth:`process_images` gives it, from its header alone (no pixel decoded):
        what counting a prompt's tokens needs. ``RequestError`` as ``process_images`` refuses (images that fill the
        context too), but for pixel data that is corrupt, which only decoding finds. ``one_prompt=False``: images
        of which a prompt will keep some (a conversation to truncate): their tokens together are not refused,
        only an image that fills the context alone (and more images than ``limit_mm_per_prompt``)."""
        self.check_image_count(len(sources))
        config, count = self._image_config(mm_processor_kwargs), self._image_budget()
        out = []
        try:
            for src in sources:
                out.append(src.num_tokens if isinstance(src, ProcessedImage)
                           else image_tokens(*open_image(src).size, config))
                (count if one_prompt else self._image_budget())(out[-1])  # (together, or each alone)
        except ValueError as exc:
            raise RequestError(f"image_data: {exc}", "image_data") from None
        return out

    def _image_budget(self) -> Callable[[int], None]:
        """A counter of one prompt's image tokens: ``ValueError`` once they fill the context."""
        total = 0

        def count(tokens: int) -> None:
            nonlocal total
            total += tokens
            if total >= self.context_length:
                raise ValueError(f"the images take {total} tokens or more; the context length is {self.context_length}")
        return count

    def _image_config(self, mm_processor_kwargs: dict[str, int] | None) -> ImageProcessorConfig:
        """The engine's image preprocessing with a request's ``mm_processor_kwargs``, within the engine's
        ``max_pixels`` (``RequestError`` naming them for one it does not take)."""
        try:
            return self.image_processor.overridden(mm_processor_kwargs, capped=True)
        except ValueError as exc:
            raise RequestError(str(exc), "mm_processor_kwargs") from None

    def check_image_count(self, n: int) -> None:
        """``RequestError`` (``image_data``) where a prompt of ``n`` images is refused before any is read: more than
        ``limit_mm_per_prompt`` allows, or any for a model without a vision tower."""
        self._check_takes_images()
        if self.max_images is not None and n > self.max_images:
            raise RequestError(f"image_data: {n} images; a prompt may hold at most {self.max_images} "
                               f"(limit_mm_per_prompt)", "image_data")

    def _check_takes_images(self) -> None:
        """``RequestError`` (``image_data``) for a model without a vision tower."""
        if self.image_processor is None:
            raise RequestError(f"image_data: model {self.model_path} ({self.model_config.architecture}) takes no "
                               "images (a vision-language checkpoint with a vision_config does)", "image_data")

    def _image_lists(self, image_data: Any, n: int, single: bool) -> list[list[Any] | None]:
        """``image_data`` (None; one request's image or list of images; or one list per request) as each
        request's list of images (None: none). ``RequestError`` for a model without a vision tower."""
        if image_data is None:
            return [None] * n
        self._check_takes_images()
        if single:
            return [list(image_data) if isinstance(image_data, (list, tuple)) else [image_data]]
        if not isinstance(image_data, (list, tuple)) or len(image_data) != n:
            raise RequestError(f"image_data: give one list of images per request ({n})", "image_data")
        return [None if x is None else list(x) if isinstance(x, (list, tuple)) else [x] for x in image_data]

    def _expand_images(self, ids: list[int], sources: list[Any]) -> tuple[list[int], PromptImages]:
        """The prompt ``ids`` with its images' tokens (``multimodal.expand_images``: each image loaded and
        preprocessed here) and their :class:`PromptImages`. ``RequestError`` for an image that cannot be read
        or a prompt whose placeholders do not match."""
        processed = self.process_images(sources)
        try:
            return expand_images(ids, processed, self.model_config.vision)
        except ValueError as exc:
            raise RequestError(f"image_data: {exc}", "image_data") from None

    def _loras(self, lora_name: Any, n: int) -> list[Loaded | None]:
        """``lora_name`` (None, a name, or one per request) as the adapter loaded under each name (or None)."""
        names = list(lora_name) if isinstance(lora_name, (list, tuple)) else [lora_name] * n
        if len(names) != n:
            raise RequestError(f"{len(names)} lora_name values for {n} requests", "lora_name")
        if self.loras is None:
            if any(name is not None for name in names):
                raise RequestError("lora_name: this engine serves no LoRA adapters (start it with enable_lora=True, "
                                   "hyla serve --enable-lora)", "lora_name")
            return [None] * n
        try:
            return [None if name is None else self.loras.resolve(check_lora_name(name)) for name in names]
        except ValueError as exc:
            raise RequestError(str(exc), "lora_name") from None

    def _priorities(self, priority: Any, n: int) -> list[int]:
        """``priority`` (None, an int, or one per request) as one int per request. A priority other
        than 0 needs ``enable_priority_scheduling``: without it, it would be silently ignored."""
        values = list(priority) if isinstance(priority, (list, tuple)) else [priority] * n
        if len(values) != n:
            raise RequestError(f"{len(values)} priorities for {n} requests", "priority")
        for v in values:
            if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
                raise RequestError(f"priority must be an integer, got {v!r}", "priority")
            if v and not self.args.enable_priority_scheduling:
                raise RequestError(f"priority={v}: priority scheduling is off (start the engine with "
                                   f"enable_priority_scheduling=True, hyla serve --enable-priority-scheduling)", "priority")
        return [v or 0 for v in values]

    def _make_request(self, ids: list[int], params: Any, return_logprob: bool, checkpoints: tuple,
                      rid: str | None, namespace: Any, logprob_start_len: int = -1,
                      speculative_checkpoints: bool = False, image_sources: list[Any] | None = None) -> Req:
        if self.sampling_defaults and (params is None or isinstance(params, dict)):
            params = {**self.sampling_defaults, **(params or {})}
        sp = SamplingParams.from_dict(params)
        if not ids:
            raise RequestError("the prompt is empty", "input_ids")
        if len(ids) >= self.context_length:  # before the O(prompt) walk below
            raise RequestError(f"the prompt has {len(ids)} tokens; the context length is {self.context_length}",
                               "input_ids")
        vocab = self.model_config.vocab_size
        # plain ints (what clients send) in C loops: a 4,096-token prompt in 0.35 ms, not 0.53 (measured here);
        # anything else (bools, int subclasses, floats, numpy scalars) gets the per-token check
        if not (set(map(type, ids)) == {int} and 0 <= min(ids) and max(ids) < vocab):
            ids = [_token_id(t, vocab) for t in ids]
        images = None
        if image_sources:  # (the prompt's ids checked above: the expansion adds only the image token)
            ids, images = self._expand_images(ids, image_sources)

            def moved(c: Any) -> Any:  # (past the images before it; anything but an int, as it is: checked below)
                return images.expanded(c) if isinstance(c, int) and not isinstance(c, bool) else c

            checkpoints = tuple(moved(c) for c in checkpoints)
            logprob_start_len = moved(logprob_start_len)
            if len(ids) >= self.context_length:
                raise RequestError(f"the prompt has {len(ids)} tokens with its images' tokens; the context length is "
                                   f"{self.context_length}", "image_data")
        for name, given in (("logit_bias", sp.logit_bias), ("stop_token_ids", sp.stop_token_ids)):
            if given and max(given) >= vocab:
                raise RequestError(f"{name}: token id {max(given)} is outside the vocabulary [0, {vocab})", name)
        if sp.min_new_tokens and len(sp.stop_token_ids) + len(self.eos_token_ids) >= vocab \
                and len(set(sp.ending_token_ids(self.eos_token_ids))) >= vocab:
            raise RequestError("min_new_tokens: the stop token ids and EOS cover the whole vocabulary, so no token "
                               "could be sampled before the minimum", "min_new_tokens")
        if len(ids) + sp.max_new_tokens > self.context_length:
            raise RequestError(
                f"prompt ({len(ids)} tokens) + max_new_tokens ({sp.max_new_tokens}) exceeds the context length "
                f"({self.context_length})", "max_new_tokens")
        if sp.stop and self.tokenizer is None:
            raise RequestError("stop strings need a tokenizer; this model has none (use stop_token_ids)", "stop")
        for c in checkpoints:
            if isinstance(c, bool) or not isinstance(c, int) or not 0 < c <= len(ids):
                raise RequestError(f"checkpoint position {c!r} is outside the prompt (1..{len(ids)})", "checkpoints")
        if sp.grammar is not None and self.grammars is None:
            raise RequestError(f"{sp.grammar[0]} needs a tokenizer; model {self.model_path} has none", sp.grammar[0])
        try:
            grammar = (self.grammars.matcher(*sp.grammar, after=sp.grammar_after, opener=sp.grammar_after_open)
                       if sp.grammar is not None else None)
        except ValueError as exc:  # it cannot be compiled
            raise RequestError(str(exc), sp.grammar[0]) from None
        rid = rid if rid is not None else f"req-{next(self._rid_counter)}"
        seed = sp.seed if sp.seed is not None else (self.args.seed * 1_000_003 + zlib.crc32(rid.encode())) % 2**63
        gen = torch.Generator(device=self.device).manual_seed(seed)
        _check_logprob_start(logprob_start_len, len(ids))
        if logprob_start_len >= 0 and not return_logprob:
            raise RequestError("logprob_start_len asks for prompt logprobs: set return_logprob too", "logprob_start_len")
        return Req(rid=rid, input_ids=list(ids), sampling=sp, checkpoints=checkpoints,
                   speculative_checkpoints=speculative_checkpoints, namespace=namespace, return_logprob=return_logprob,
                   logprob_start_len=logprob_start_len, generator=gen, grammar=grammar, images=images)

    @property
    def cache_id(self) -> str:
        """Names this engine's prefix cache as it is: it changes whenever the cache is emptied (a flush,
        a weight update) and differs between engines (a restarted server's). What another process knows
        of the cache (a router's table of the prompts it sent here) is stale once it changes."""
        return f"{self._instance}.{self.scheduler.num_flushes}"

    @property
    def instance_id(self) -> str:
        """Names this engine, one of its kind: a restarted server's is new (it serves its own start-up's
        weights and adapters, not those a router sent the one before it)."""
        return self._instance

    @property
    def is_alive(self) -> bool:
        """The engine serves: not shut down, and its scheduler thread runs (it survives any failed
        step; should it die all the same, requests are refused, not left waiting forever)."""
        return not self._stopped and self._thread.is_alive()

    def _submit(self, reqs: list[Req]) -> None:
        with self._inbox_lock:  # requests still in the inbox count as queued too
            if self._stopped:  # checked under the lock shutdown() sets it under: no request slips past
                raise RuntimeError("the engine has been shut down")
            if not self._thread.is_alive():
                raise RuntimeError("the engine's scheduler thread has died (see the log): restart the engine")
            unloaded = [r.rid for r in reqs if r.lora_uid and not self.loras.is_loaded(r.lora_uid)]
            if unloaded:  # (unloaded since the request was made: LoRAManager's docstring)
                raise RequestError(f"the LoRA adapter of request(s) {unloaded} has been unloaded", "lora_name")
            rids = [r.rid for r in reqs]
            clash = (set(rids) & self._live.keys()) | {r for r in rids if rids.count(r) > 1}
            if clash:
                raise RequestError(f"request id(s) {sorted(clash)} already in use: rids must be unique among live "
                                   "requests", "rid")
            if len(reqs) > self.max_live_requests:  # never fits, however long one waits: not an overload
                raise ValueError(f"a batch of {len(reqs)} requests can never fit: the engine holds at most "
                                 f"{self.max_live_requests} at once (max_running_requests={self.max_running_requests}"
                                 f" + max_queued_requests={self.args.max_queued_requests})")
            # live = running + waiting + in the inbox; a submission fits while the live requests stay
            # within the running slots plus the queue (an idle engine takes a batch of that size)
            live = len(self._live) - len(self._displacing)
            excess = live + len(reqs) - self.max_live_requests
            displaced = self._displaceable(reqs, excess) if excess > 0 else []
            if len(displaced) < excess:
                raise EngineOverloadedError(
                    f"{live} requests are live (max_running_requests={self.max_running_requests} + "
                    f"max_queued_requests={self.args.max_queued_requests})")
            for req in reqs:
                self._live[req.rid] = req
                req.on_output = self._forget_rid_when_done(req.on_output, req.lora_uid)
            for victim in displaced:  # finished by the scheduler (if still waiting: Scheduler.displace)
                self._displacing.add(victim.rid)
                self._inbox.put(("displace", victim.rid))
            self._inbox.put(("add", reqs))  # one message: a batch reaches the scheduler together
        self._wakeup.set()

    def _displaceable(self, reqs: list[Req], k: int) -> list[Req]:
        """Priority scheduling, a full queue: ``k`` queued requests that ``reqs`` may take the place
        of (SGLang's), or fewer when there are not as many: requests still waiting for their first
        admission (none that has produced output, retracted since), each less urgent than the new
        request it makes room for — the least urgent first, the youngest among equals. Called
        under the inbox lock; the statuses read may be a step old, so the scheduler displaces a
        request only if it still waits (``Scheduler.displace``; one admitted meanwhile runs on, and
        the queue is over its limit until a request finishes). A request being displaced no longer
        counts as live, nor can it be displaced again."""
        if not self.args.enable_priority_scheduling:
            return []
        rank = self.scheduler.rank
        queued = sorted((r for r in self._live.values()
                         if r.status is ReqStatus.WAITING and not r.admitted_once and r.rid not in self._displacing),
                        key=self.scheduler.give_way_order, reverse=True)
        displaced = []
        for new, victim in zip(sorted(reqs, key=rank), queued):
            if len(displaced) == k or rank(victim) <= rank(new):
                break
            displaced.append(victim)
        return displaced

    def _forget_rid_when_done(self, on_output, lora_uid: int = 0):
        def wrapped(out: dict[str, Any], done: bool) -> None:
            if done:
                with self._inbox_lock:
                    self._live.pop(out["meta_info"]["id"], None)
                    self._displacing.discard(out["meta_info"]["id"])
                    if lora_uid:  # (the scheduler thread: an unloaded adapter's weights may go now)
                        self.loras.release(lora_uid, self._live_lora_uids())
            if on_output is not None:
                on_output(out, done)
        return wrapped

    def _stream_sync(self, req: Req) -> RequestStream:
        """Submit now (so a full queue raises here, not at the first ``next``); iterate later."""
        return self._submit_streamed(req, RequestStream(req.rid, self._abort_soon, req))

    def _stream_async(self, req: Req) -> AsyncRequestStream:
        """Submit now (so a full queue raises in ``async_generate``); iterate later."""
        return self._submit_streamed(req, AsyncRequestStream(req.rid, self._abort_soon, req, asyncio.get_running_loop()))

    def _submit_streamed(self, req: Req, stream: Any) -> Any:
        """``req`` submitted with ``stream`` as its output; a refused submission leaves a stream that aborts
        nothing when dropped (its rid may be another live request's)."""
        req.stream = True
        req.on_output = stream.sink()
        try:
            self._submit([req])
        except BaseException:
            stream.never_submitted()
            raise
        return stream

    def _abort_soon(self, target: str | Req) -> None:
        """``abort`` for a stream's finalizer: only the inbox's ``put`` (reentrant: it may run while
        this thread holds any lock); the scheduler drains the inbox at its next step or idle wake-up.
        ``target``: a rid (the live request with it, ``abort``'s), or a request itself (it alone, if still
        live: the engine's own aborts, which may race the request's end and a new request taking its rid)."""
        if not self._stopped:
            self._inbox.put(("abort", target))

    def _make_detokenizer(self, req: Req):
        return self.tokenizer.detokenizer(prompt_ids=req.input_ids,
                                          skip_special_tokens=req.sampling.skip_special_tokens)

    # ------------------------------------------------------------------------------------------
    # the scheduler thread
    # ------------------------------------------------------------------------------------------
    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        while not self._stopped:
            self._drain_inbox()
            if not self.scheduler.has_work():
                self._wakeup.wait(timeout=0.05)
                self._wakeup.clear()
                continue
            try:
                progressed = self.scheduler.step()
            except Exception as exc:  # a bug must not kill the engine: fail the batch, keep serving
                logger.exception("scheduler step failed; aborting the %d running requests", self.scheduler.num_running)
                self.scheduler.fail_running(internal_error(exc))  # (never raises)
                progressed = True
            if not progressed:  # requests wait that nothing can admit now (a weight update's drain): no spinning
                self._wakeup.wait(timeout=0.05)
                self._wakeup.clear()
        # shutting down: finish whatever is left as aborted
        self._drain_inbox()
        for req in list(self.scheduler.waiting) + list(self.scheduler.running):
            self._abort(req, message="engine shut down", cause="shutdown")

    def _abort(self, target: str | Req, **reason: str) -> None:
        """``Scheduler.abort(target, **reason)`` between steps (the inbox's aborts, the shutdown's); never
        raises. An abort first finishes the overlap schedule's step in flight (``Scheduler.drain``), and
        that step may fail there, outside ``_loop``'s net around steps: it then fails as a step does (the
        running requests end aborted, cause ``internal``), and the abort is made again, with no step in
        flight (``target`` may be waiting: it ends too)."""
        for _ in range(2):
            try:
                self.scheduler.abort(target, **reason)
                return
            except Exception as exc:  # a bug must not kill the engine: fail the batch, keep serving
                logger.exception("aborting request %s failed; aborting the %d running requests",
                                 getattr(target, "rid", target), self.scheduler.num_running)
                self.scheduler.fail_running(internal_error(exc))  # (never raises)

    def _drain_inbox(self) -> None:
        """Hand the inbox's commands to the scheduler, in order."""
        while True:
            try:
                cmd, arg = self._inbox.get_nowait()
            except queue.Empty:
                return
            if cmd == "add":
                for req in arg:
                    self.scheduler.add_request(req)
            elif cmd == "abort":
                self._abort(arg)
            elif cmd == "displace":
                self.scheduler.displace(arg)
            elif cmd == "call":
                fn, result = arg
                if not result.set_running_or_notify_cancel():  # its caller gave up waiting
                    continue
                try:
                    result.set_result(fn())
                except Exception as exc:
                    result.set_exception(exc)

    def _on_scheduler_thread(self, fn: Callable[[], Any], timeout: float) -> Any:
        """``fn()`` run on the scheduler thread between steps, after everything submitted before
        (the inbox is one queue); its result, or its exception raised here. After ``timeout``
        seconds: ``TimeoutError``, and ``fn`` does not run unless it has begun."""
        result: Future = Future()
        with self._inbox_lock:
            if self._stopped:
                raise RuntimeError("the engine has been shut down")
            self._inbox.put(("call", (fn, result)))
        self._wakeup.set()
        try:
            return result.result(None if timeout >= NO_TIMEOUT_PAST else timeout)
        except TimeoutError:
            result.cancel()
            raise


_CHECKED_ARGUMENTS = frozenset(("prompt", "input_ids", "sampling_params", "return_logprob", "checkpoints", "rid",
                                "namespace", "logprob_start_len", "speculative_checkpoints", "priority", "lora_name",
                                "image_data"))
"""``Engine.check_requests``' keys: ``generate``'s keyword arguments, ``stream`` aside."""


NO_TIMEOUT_PAST = 1e7
"""A timeout of more seconds than this (``math.inf``) waits without a limit (past ~1e9, ``Future.result``
overflows the platform's time)."""


def _check_timeout(timeout: Any, zero_ok: bool = False) -> None:
    """``ValueError`` unless ``timeout`` is a positive number of seconds (``math.inf``: no limit), or 0 with
    ``zero_ok`` (``wait_idle``: whether it is idle now)."""
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not (timeout > 0 or zero_ok and timeout == 0):
        raise ValueError(f"timeout must be a {'' if zero_ok else 'positive '}number of seconds"
                         f"{' >= 0' if zero_ok else ''}, got {timeout!r}")


WORKER_THREAD_PROMPT_SIZE = 1 << 16
"""Prompts of more characters (or token ids) than this in all, and sampling params with more entries
(``_params_size``), make their requests in a worker thread in ``async_generate`` (tokenizing 64K
characters takes ~10 ms here; a 20 MB prompt, half a minute; checking 4M stop token ids, 0.5 s)."""


def _prompt_size(prompt: Any, input_ids: Any) -> int:
    """Characters of ``prompt``'s texts, or ``input_ids``' token ids, in all (malformed ones count
    nothing: ``_make_requests`` refuses them)."""
    if isinstance(prompt, str):
        return len(prompt)
    if isinstance(prompt, (list, tuple)):
        return sum(len(t) for t in prompt if isinstance(t, str))
    if isinstance(input_ids, (list, tuple)):
        return sum(len(x) if isinstance(x, (list, tuple)) else 1 for x in input_ids)
    return 0


def _params_size(sampling_params: Any) -> int:
    """Entries of ``generate``'s ``sampling_params`` (a dict, a ``SamplingParams`` or a list of them) that
    making the requests checks one by one: stop token ids, logit biases, stop strings' characters (malformed
    ones count nothing: ``SamplingParams`` refuses them)."""
    total = 0
    for p in sampling_params if isinstance(sampling_params, list) else [sampling_params]:
        for key in ("stop_token_ids", "logit_bias", "stop"):
            value = p.get(key) if isinstance(p, dict) else getattr(p, key, None)
            if isinstance(value, str):
                total += len(value)
            elif isinstance(value, (list, tuple, dict)):
                total += len(value) + (sum(len(v) for v in value if isinstance(v, str)) if key == "stop" else 0)
    return total


def _asks_for_grammar(sampling_params: Any) -> bool:
    """Whether any of ``generate``'s ``sampling_params`` (a dict, a ``SamplingParams`` or a list of
    them) sets a grammar (``GRAMMAR_KINDS``), which making its request compiles."""
    params = sampling_params if isinstance(sampling_params, list) else [sampling_params]
    return any((p.get(k) if isinstance(p, dict) else getattr(p, k, None)) is not None
               for p in params for k in GRAMMAR_KINDS)


def _check_namespace(namespace: Any) -> None:
    """``RequestError`` unless ``namespace`` is hashable: the prefix cache keys its trees on it (an
    unhashable one would fail every step's admission)."""
    try:
        hash(namespace)
    except TypeError:
        raise RequestError(f"namespace must be hashable (a str, an int, a tuple of them), got "
                           f"{type(namespace).__name__}", "namespace") from None


def _token_id(t: Any, vocab: int) -> int:
    """A prompt's token id as a plain int: an int, or an integer scalar of numpy or torch (``list(array)``'s
    items); not a bool, a float or a string (``RequestError``)."""
    try:
        i = None if isinstance(t, (bool, np.bool_)) else operator.index(t)
    except TypeError:
        i = None
    if i is None:
        raise RequestError(f"token id {t!r} is not an integer", "input_ids")
    if not 0 <= i < vocab:
        raise RequestError(f"token id {i} is outside the vocabulary [0, {vocab})", "input_ids")
    return i


def _per_request_checkpoints(checkpoints: Any, n: int, single: bool) -> list[tuple]:
    """``checkpoints`` as one tuple of positions per request: a flat list for one request, a list
    of lists for a batch (positions themselves are checked against each prompt later)."""
    if checkpoints is None or (isinstance(checkpoints, (list, tuple)) and len(checkpoints) == 0):
        return [()] * n
    if not isinstance(checkpoints, (list, tuple)):
        raise RequestError(f"checkpoints must be a list, got {type(checkpoints).__name__}", "checkpoints")
    nested = [isinstance(c, (list, tuple)) for c in checkpoints]
    if single:
        if any(nested):
            raise RequestError("checkpoints of a single request must be a flat list of positions", "checkpoints")
        return [tuple(checkpoints)]
    if not all(nested):
        raise RequestError("checkpoints of a batch must be a list with one list of positions per request", "checkpoints")
    return [tuple(c) for c in checkpoints]


GENERATION_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def _generation_config(path: Path) -> tuple[dict[str, Any], int | None]:
    """What a model's ``generation_config.json`` sets (read once; absent file or fields: none): the sampling
    fields, and ``max_new_tokens`` (a positive int), the default ``max_tokens`` of an OpenAI-style request."""
    file = path / "generation_config.json"
    if not file.is_file():
        return {}, None
    try:
        cfg = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read {file}: {exc}") from exc
    defaults = {k: cfg[k] for k in GENERATION_DEFAULT_KEYS if cfg.get(k) is not None}
    SamplingParams.from_dict(defaults)  # a bad value is the model's fault: say so at load time
    max_new = cfg.get("max_new_tokens")
    if max_new is not None and (isinstance(max_new, bool) or not isinstance(max_new, int) or max_new < 1):
        raise ValueError(f"{file}: max_new_tokens must be a positive integer, got {max_new!r}")
    return defaults, max_new


def _load_tokenizer(path: Path, chat_template: str | os.PathLike | None = None):
    """The tokenizer of directory ``path`` (``tokenizer.json``, or a tiktoken file), or None where it has none.
    ``chat_template`` (the engine option: a Jinja file or a template's text, ``read_chat_template``) replaces
    its chat template; with no tokenizer to render it for, it is a ``ValueError``."""
    from hyla.tokenizer.chat_template import read_chat_template
    from hyla.tokenizer.tokenizer import Tokenizer, has_tokenizer

    if not has_tokenizer(path):
        if chat_template is not None:
            raise ValueError(f"chat_template needs a tokenizer, and {str(path)!r} has none (tokenizer_path may name "
                             "another directory's)")
        return None
    template = read_chat_template(chat_template) if chat_template is not None else None
    return Tokenizer.from_pretrained(path, chat_template=template)


class CachedTokens(NamedTuple):
    """``Engine.cached_tokens_by_tier``'s answer for one prompt."""

    device: int  # the tokens the device cache holds (the KV an import need not carry: export_prefix's kv_from)
    any_tier: int  # the tokens a request would find cached now, the host tier's included
    limit: int  # the most any cache could serve: all but the last token, or up to the prompt logprobs' start


def _check_logprob_start(logprob_start_len: Any, num_tokens: int) -> None:
    """``logprob_start_len`` is -1 (no prompt logprobs) or a position of a prompt of ``num_tokens``."""
    if isinstance(logprob_start_len, bool) or not isinstance(logprob_start_len, int) \
            or not -1 <= logprob_start_len < num_tokens:
        raise RequestError(f"logprob_start_len must be -1 (no prompt logprobs) or a prompt position in "
                           f"[0, {num_tokens}), got {logprob_start_len!r}", "logprob_start_len")


def running_requests_for_slots(num_slots: int, per_req: int, cap: int) -> int:
    """The default ``max_running_requests`` for ``num_slots`` state slots of which each running request
    holds ``per_req``: as many as leave the other half of the slots (about) to checkpoints, 1 to ``cap``.
    (``hyla.sim.replay`` sizes its replayed engine by it too.)"""
    return max(1, min(cap, num_slots // (1 + per_req)))


def _cache_budget_bytes(device: torch.device, mem_fraction: float) -> int:
    """Bytes for the cache pools: a share of what is free now (after the weights were loaded)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * (mem_fraction or 0.85))
    return int(_available_ram() * (mem_fraction or 0.1))


def _available_ram() -> int:
    """Bytes of RAM available now: Linux's MemAvailable (free pages plus the page cache and other
    memory the kernel gives back on demand; the free pages alone, which a busy machine's page cache
    keeps low, sized the pools to a few MB), else the free pages, else 8 GiB; at most what the
    process's cgroup memory limit leaves (a container's: MemAvailable is the host's)."""
    available = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError, IndexError):
        pass
    if available is None:
        try:
            available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError):
            available = 8 << 30
    left = _cgroup_memory_left()
    return available if left is None else min(available, left)


def _cgroup_memory_left(sys_root: str = "/sys") -> int | None:
    """Bytes this process's cgroup may still take (its memory limit less its usage: cgroup v2's
    ``memory.max`` / ``memory.current``, else v1's ``memory.limit_in_bytes`` / ``memory.usage_in_bytes``);
    None without a limit."""
    for limit_file, usage_file in (("fs/cgroup/memory.max", "fs/cgroup/memory.current"),
                                   ("fs/cgroup/memory/memory.limit_in_bytes", "fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            with open(f"{sys_root}/{limit_file}") as f:
                limit = f.read().strip()
            with open(f"{sys_root}/{usage_file}") as f:
                usage = int(f.read().strip())
        except (OSError, ValueError):
            continue
        if limit == "max" or not limit.isdigit() or int(limit) >= 1 << 60:  # (v1's "no limit": near 2^63)
            return None
        return max(0, int(limit) - usage)
    return None


def _how_sized(given: int | None, size: int, cap: int, cap_text: str) -> str:
    """How one pool's size was chosen, for ``Engine.summary()``."""
    if given:
        return "given"
    return f"capped at {cap_text}" if size == cap else "from memory"


def _count_layer_kinds(cfg) -> dict[str, int]:
    counts: dict[str, int] = {}
    for kind in cfg.layer_types:
        counts[kind] = counts.get(kind, 0) + 1
    return counts
