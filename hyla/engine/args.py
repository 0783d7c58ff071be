"""Engine options: one frozen dataclass, validated on construction.

``Engine(model_path, **options)`` and ``hyla serve --option value`` are generated from the same
fields (each field's ``help`` metadata is the flag's help text), so the two never drift apart.
The rules that tie the sizes the engine settles on together (``check_state_slots``,
``context_length_for``) are here too, for the engine and for the simulator's engine replay.
"""

from __future__ import annotations

import difflib
import logging
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

DTYPES = ("float32", "bfloat16", "float16")
POLICIES = ("lpm", "fcfs")
OVERLAP_MODES = ("auto", "on", "off")
FP8_WEIGHT_MODES = ("auto", "keep", "dequantize")
QUANTIZATIONS = ("fp8",)
KV_CACHE_DTYPES = ("auto", "fp8_e4m3", "fp8", "fp8_e5m2")  # fp8 = fp8_e4m3, as vLLM's
WARMUP_MODES = ("auto", "on", "off")
SPECULATIVE_ALGORITHMS = ("ngram", "mtp", "draft")
MAX_OPTION_INT = 1 << 40  # the largest size or count an option takes (token pools, slots, steps)

logger = logging.getLogger("hyla.engine")


MAX_WEIGHT_VERSION_CHARS = 256


def check_weight_version(value: Any) -> None:
    """A weight version (``EngineArgs.weight_version``, a weight update's) is a name: a non-empty string of
    printable characters (it is logged, and in every output's ``meta_info``), at most
    ``MAX_WEIGHT_VERSION_CHARS`` long."""
    if not isinstance(value, str) or not value or not value.isprintable() or len(value) > MAX_WEIGHT_VERSION_CHARS:
        raise ValueError(f"weight_version must be a non-empty string of printable characters, at most "
                         f"{MAX_WEIGHT_VERSION_CHARS} long, got {value!r:.80}")


def check_kv_cache_dtype(name: Any) -> None:
    """``ValueError`` unless ``name`` is one of ``KV_CACHE_DTYPES``."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {name!r}")


def kv_cache_torch_dtype(name: str):
    """The KV buffers' dtype of ``kv_cache_dtype`` ``name``: None for ``auto`` (the model's),
    ``torch.float8_e4m3fn`` for ``fp8_e4m3`` / ``fp8``, ``torch.float8_e5m2`` for ``fp8_e5m2``; ``ValueError`` for
    a name not in ``KV_CACHE_DTYPES``."""
    check_kv_cache_dtype(name)
    import torch  # (here: the CLI imports this module for its flags, and --help must not wait for torch)

    return {"auto": None, "fp8_e5m2": torch.float8_e5m2}.get(name, torch.float8_e4m3fn)


def _opt(default: Any, help: str) -> Any:
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class EngineArgs:
    model_path: str | None = _opt(None, "Model directory (HF format). Default: the built-in default model.")
    dtype: str = _opt("float32", f"Weights and activations dtype, one of {DTYPES}.")
    device: str = _opt("cpu", "Torch device: cpu, cuda, cuda:1, ...")
    fp8_weights: str = _opt(
        "auto", f"An FP8 checkpoint's weights, one of {FP8_WEIGHT_MODES}: keep = projections and experts stay float8 "
                "with their scales (half of bf16's memory; Triton kernels dequantize them as they read them on a "
                "GPU, PyTorch per step elsewhere), dequantize = every weight converted to dtype at load; auto = keep "
                "on CUDA of compute capability 8.9 or more (and with quantization='fp8'), dequantize elsewhere.")
    quantization: str | None = _opt(
        None, "fp8: quantize an unquantized checkpoint's projections and experts to float8 at load (per 128x128 "
              "block, kept as fp8_weights=keep keeps an FP8 checkpoint's; SGLang's and vLLM's --quantization fp8). "
              "Outputs then differ from the unquantized model's by float8's rounding.")
    kv_cache_dtype: str = _opt(
        "auto", f"The attention layers' KV cache, one of {KV_CACHE_DTYPES}: auto = dtype; fp8_e4m3 (or fp8) = "
                "float8 e4m3, half of bf16's bytes per token, so twice the tokens in the same memory (SGLang's and "
                "vLLM's --kv-cache-dtype; scale 1, values saturate at +-448; CUDA: compute capability 8.9 on); "
                "fp8_e5m2 = float8 e5m2 (2 mantissa bits, coarser; range to 57344; CUDA: 8.0 on, an A100 too). "
                "Outputs then differ from a KV cache in dtype by float8's rounding; the prefix cache still never "
                "changes them.")
    cpu_threads: int | None = _opt(
        None, "Torch intra-op threads of a CPU engine (set from the engine's constructor, for its scheduler thread). "
              "Default: the physical cores this process may use (within its CPU quota); OMP_NUM_THREADS in the "
              "environment wins; 0 = leave torch's setting.")
    page_size: int = _opt(1, "KV cache page size in tokens; the prefix cache shares whole pages only.")
    chunked_prefill_size: int = _opt(8192, "Max tokens per prefill step; longer prompts are prefilled in chunks.")
    max_running_requests: int | None = _opt(
        None, "Max requests decoding at once. Default: the state slots over (2 + the scratch slots a request "
              "takes: speculative draft tokens), at most 256 on a GPU and 32 on CPU.")
    max_total_tokens: int | None = _opt(
        None, "KV pool size in tokens. Default: from available memory, at most enough for every running request "
              "at the full context length.")
    max_state_slots: int | None = _opt(
        None, "State pool size in slots (running states, speculative decoding's scratch slots: one per draft "
              "token per running request, taken for good, and cached checkpoints). Default: from available "
              "memory, at most one state (+ scratch slots) and 3 checkpoints per running request.")
    state_memory_ratio: float = _opt(0.9, "State-pool bytes per KV-pool byte when sizes come from memory (SGLang's --mamba-full-memory-ratio).")
    mem_fraction: float = _opt(0.0, "Share of free device memory for the cache pools; 0 = 0.85 on GPU, 0.1 of RAM on CPU.")
    context_length: int | None = _opt(None, "Max prompt + output tokens. Default: the model's max_position_embeddings.")
    schedule_policy: str = _opt("lpm", f"Waiting-queue order, one of {POLICIES} (lpm = longest cached prefix first).")
    enable_prefix_cache: bool = _opt(True, "Reuse cached prefixes (KV + recurrent-state checkpoints) across requests.")
    protect_waiting_prefixes: bool = _opt(True, "lpm: while requests run, admitting another may not evict the cached "
                                                "prefix of a request still waiting; it waits for room instead "
                                                "(more hits, fewer requests at once when the pool is full; "
                                                "docs/engine.md). Off: admissions evict any unlocked prefix.")
    enable_hierarchical_cache: bool = _opt(False, "Keep what the prefix cache evicts in host memory and load it back "
                                                  "on a later hit: a prefix's KV and its recurrent-state checkpoint "
                                                  "together (SGLang's --enable-hierarchical-cache, whose hybrid "
                                                  "version drops the states; docs/cache.md). Needs "
                                                  "enable_prefix_cache.")
    hicache_ratio: float = _opt(2.0, "Hierarchical cache: host pools this many times the device's (KV tokens and "
                                     "state slots; SGLang's default, 2).")
    hicache_size: float = _opt(0.0, "Hierarchical cache: host pools of this many GiB, split between KV and states "
                                    "as the device's are (state_memory_ratio); overrides hicache_ratio. 0: use "
                                    "hicache_ratio.")
    enable_priority_scheduling: bool = _opt(False, "Admit waiting requests by their priority (a request's `priority`, "
                                                   "default 0), then by schedule_policy; a waiting request that does not "
                                                   "fit may preempt running requests of a priority lower by more than "
                                                   "priority_scheduling_preemption_threshold (SGLang's flag; "
                                                   "docs/engine.md). Off: a request's priority must be 0 or unset.")
    schedule_low_priority_values_first: bool = _opt(False, "Priority scheduling: a lower priority value is more urgent "
                                                           "(vLLM's convention). Default: a higher one is (SGLang's).")
    priority_scheduling_preemption_threshold: int = _opt(10, "Priority scheduling: a waiting request preempts (retracts, "
                                                             "its work cached) running requests only when its priority "
                                                             "is more urgent than theirs by more than this (SGLang's "
                                                             "default: 10).")
    mm_embedding_cache_mb: int = _opt(100, "A vision-language model: MiB of the vision tower's outputs kept by image "
                                           "content across requests, so that the same image (n choices, a cache hit "
                                           "ending inside it, another prompt) runs the tower once (SGLang's "
                                           "SGLANG_VLM_CACHE_SIZE_MB; on the model's device). 0: none kept.")
    limit_mm_per_prompt: dict | None = _opt(None, "A vision-language model: the most images one prompt may hold, as "
                                                 "vLLM's JSON {\"image\": N} (a prompt with more is refused before "
                                                 "any is decoded). None: as many as the context holds.")
    mm_processor_kwargs: dict | None = _opt(None, "A vision-language model: the checkpoint's image preprocessing "
                                                  "overridden, vLLM's JSON {\"min_pixels\": N, \"max_pixels\": N} "
                                                  "(the bounds of a resized image's area, so of its tokens: a lower "
                                                  "max_pixels gives fewer tokens per image). A request may override "
                                                  "them again.")
    checkpoint_alignment: int = _opt(1, "Take state checkpoints only at multiples of this many tokens (1 = exact positions).")
    speculative_algorithm: str | None = _opt(None, "Speculative decoding: 'ngram' (drafts from the request's own "
                                                   "prompt and output), 'mtp' (the checkpoint's multi-token-prediction "
                                                   "head, Qwen3-Next / Qwen3.5), 'draft' (a separate small model with "
                                                   "the same vocabulary: speculative_draft_model_path), or none.")
    speculative_draft_model_path: str | None = _opt(None, "draft: the draft model's directory (HF format, any "
                                                          "architectures hyla loads, the model's vocabulary).")
    speculative_num_draft_tokens: int = _opt(4, "ngram, mtp and draft trees: tokens fed per verify step: the last "
                                                "sampled token + this minus one drafts.")
    speculative_num_steps: int = _opt(3, "mtp, draft: draft tokens per verify step (drafter steps; a chain feeds this "
                                         "plus one tokens; mtp and draft trees: their depth).")
    speculative_eagle_topk: int = _opt(1, "Draft branches: > 1 verifies a tree of drafts per step (ngram: the "
                                          "continuations of up to this many earlier matches, merged into a trie; "
                                          "draft: a beam search of this width over the draft model, its best "
                                          "speculative_num_draft_tokens - 1 candidates; mtp: the same over the "
                                          "MTP head).")
    speculative_ngram_min_match_window_size: int = _opt(1, "ngram: shortest suffix matched against earlier tokens.")
    speculative_ngram_max_match_window_size: int = _opt(12, "ngram: longest suffix matched against earlier tokens.")
    speculative_ngram_adaptive: bool = _opt(True, "ngram: adapt each request's drafts to how they fare: fewer after "
                                                  "rejections (down to none), more after acceptances, none from a "
                                                  "1-token match unless its last prediction was right "
                                                  "(docs/engine.md). Off: always the whole continuation.")
    speculative_disable_by_batch_size: int | None = _opt(None, "Draft nothing in a step with more than this many "
                                                         "decoding requests (vLLM's name): under load the verify "
                                                         "step can cost more than its drafts save. Seeded sampled "
                                                         "outputs then depend on the load. Default: always draft.")
    max_queued_requests: int = _opt(4096, "Max requests waiting for admission; more are refused (HTTP 429 at the server).")
    generation_config: str = _opt("auto", "Sampling defaults for requests that do not set them: 'auto' = the model's generation_config.json (temperature, top_p, top_k, min_p, repetition_penalty; its max_new_tokens caps an OpenAI-style request's default max_tokens, as vLLM's), 'none' = hyla's.")
    tokenizer_path: str | None = _opt(
        None, "The directory whose tokenizer is read (tokenizer.json or a tiktoken file, with its "
              "tokenizer_config.json, chat_template.jinja and the end of sequence ids of its "
              "generation_config.json) instead of the model directory's (SGLang's tokenizer_path, vLLM's "
              "tokenizer); it must hold one. It stays across weight updates. Default: the model directory.")
    chat_template: str | None = _opt(
        None, "The chat template of every chat request (chat completions, the Responses API, /tokenize of "
              "messages), instead of the tokenizer's (tokenizer_config.json's chat_template, chat_template.jinja; "
              "its tool_use template too): the path of a Jinja file, read as UTF-8, or else the template's text "
              "itself where the value holds Jinja markup (the chat_template of vLLM and SGLang). The tool call "
              "parser's auto detection reads it.")
    seed: int = _opt(0, "Seed for sampling of requests that give no seed of their own.")
    log_interval: int = _opt(40, "Decode steps between per-step log lines.")
    debug_checks: bool = _opt(False, "Check every pool and tree invariant after every step (slow; for tests).")
    disable_cuda_graph: bool = _opt(False, "CUDA: run fused decode steps eagerly instead of replaying CUDA graphs.")
    cuda_graph_max_bs: int | None = _opt(None, "CUDA: largest decode batch captured in a CUDA graph (larger ones run "
                                               "eagerly). Default: max_running_requests, at most 256.")
    cuda_graph_max_extend_tokens: int = _opt(1024, "CUDA: an extend of one request of up to this many tokens (a cached "
                                                   "prompt's new part, a turn; up to 8 requests prefilled together, "
                                                   "one replay each) replays a CUDA graph captured per "
                                                   "token count; 0 = extends run eagerly. Not with "
                                                   "--disable-cuda-graph (every extend runs eagerly there).")
    overlap_schedule: str = _opt("auto", "Launch each decode step before reading the previous step's tokens, so "
                                         "the host's per-step work runs while the device computes (SGLang's "
                                         "overlap scheduler; off there with --disable-overlap-schedule). 'auto' = "
                                         "on where decode steps replay CUDA graphs, without speculation; 'on', 'off'.")
    enable_mixed_chunk: bool = _opt(False, "A prefill step also feeds every decoding request its next token (SGLang's "
                                           "--enable-mixed-chunk), within chunked_prefill_size: running streams "
                                           "keep producing tokens while a long prompt is prefilled in chunks, "
                                           "instead of waiting for all of them (docs/engine.md). Not with "
                                           "speculative decoding.")
    warmup: str = _opt("auto", "Before serving, run a few requests through the engine (a long cold prompt, its "
                               "cached next turn, a batch of short prompts with every sampler path), then empty "
                               "the cache and zero the counters, so that the first user request does not pay for "
                               "compiles and autotuning (SGLang's server warm-up). 'auto' = on a GPU; 'on', 'off' "
                               "(docs/engine.md).")
    weight_version: str = _opt("default", "A name for the weights served, in every output's meta_info and in "
                                          "/get_model_info; a weight update may give the new ones another "
                                          "(SGLang's --weight-version). Printable characters, at most 256.")
    compile_decode: bool = _opt(False, "Run decode steps through torch.compile: CPU decode steps 2-3x faster on "
                                       "the built-in model (docs/benchmarks.md), after compiling at start-up: "
                                       "minutes the first time, ~30-40 s on 2 cores once inductor's on-disk cache "
                                       "holds its graphs; "
                                       "with chains of drafts (n-gram, MTP, a draft model's) their verify steps too, "
                                       "and a draft model's or MTP head's own steps (docs/engine.md).")
    enable_lora: bool = _opt(False, "Serve LoRA adapters (PEFT checkpoints) beside the base model: loaded with "
                                    "Engine.load_lora_adapter (hyla serve --lora-modules, /v1/load_lora_adapter), "
                                    "chosen per request (a request's model is the adapter's name); one batch mixes "
                                    "them, in the fused kernels, CUDA graphs and speculative decoding's verify "
                                    "steps too (max_loras slots in every projection, allocated at start-up); not with "
                                    "compile_decode (docs/engine.md, \"LoRA adapters\").")
    max_loras: int = _opt(4, "With enable_lora: how many adapters one batch applies (the slots every adapted "
                             "projection holds on the device); requests of more wait for a slot.")
    max_cpu_loras: int | None = _opt(None, "With enable_lora: how many adapters may be loaded at once, kept on the "
                                           "host and written into a slot when a request applying one is "
                                           "admitted (vLLM's --max-cpu-loras); at least max_loras (None: "
                                           "max_loras).")
    max_lora_rank: int = _opt(64, "With enable_lora: the largest rank of an adapter's projection.")

    def __post_init__(self) -> None:
        def pos_int(name: str, allow_none: bool = False) -> None:
            v = getattr(self, name)
            if v is None and allow_none:
                return
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
            if v > MAX_OPTION_INT:  # (a size that large would fail deep inside torch, naming nothing)
                raise ValueError(f"{name} must be at most 2**40, got {v!r}")

        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.fp8_weights not in FP8_WEIGHT_MODES:
            raise ValueError(f"fp8_weights must be one of {FP8_WEIGHT_MODES}, got {self.fp8_weights!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS} or None, got {self.quantization!r}")
        if self.quantization == "fp8" and self.fp8_weights == "dequantize":
            raise ValueError("quantization='fp8' keeps weights in float8: it contradicts fp8_weights='dequantize'")
        check_kv_cache_dtype(self.kv_cache_dtype)
        if self.generation_config not in ("auto", "none"):
            raise ValueError(f"generation_config must be 'auto' or 'none', got {self.generation_config!r}")
        if self.overlap_schedule not in OVERLAP_MODES:
            raise ValueError(f"overlap_schedule must be one of {OVERLAP_MODES}, got {self.overlap_schedule!r}")
        if self.warmup not in WARMUP_MODES:
            raise ValueError(f"warmup must be one of {WARMUP_MODES}, got {self.warmup!r}")
        if self.schedule_policy not in POLICIES:
            raise ValueError(f"schedule_policy must be one of {POLICIES}, got {self.schedule_policy!r}")
        if self.speculative_algorithm not in (None, *SPECULATIVE_ALGORITHMS):
            raise ValueError(f"speculative_algorithm must be one of {SPECULATIVE_ALGORITHMS} or None, "
                             f"got {self.speculative_algorithm!r}")
        for name in ("page_size", "chunked_prefill_size", "checkpoint_alignment", "max_queued_requests", "log_interval",
                     "speculative_num_draft_tokens", "speculative_num_steps", "speculative_eagle_topk",
                     "speculative_ngram_min_match_window_size",
                     "speculative_ngram_max_match_window_size"):
            pos_int(name)
        for name in ("max_running_requests", "max_total_tokens", "max_state_slots", "context_length", "cuda_graph_max_bs",
                     "speculative_disable_by_batch_size"):
            pos_int(name, allow_none=True)
        if self.speculative_eagle_topk != 1 and self.speculative_algorithm in ("mtp", "draft"):
            algorithm, n, steps = self.speculative_algorithm, self.speculative_num_draft_tokens, self.speculative_num_steps
            if n < 2:
                raise ValueError(f"{algorithm} trees (speculative_eagle_topk > 1) verify speculative_num_draft_tokens "
                                 "tokens per step: it must be at least 2 (the last sampled token and one draft)")
            if n - 1 <= steps:  # the tree keeps the greedy chain of `steps` drafts first: no room for another node
                raise ValueError(f"{algorithm} trees (speculative_eagle_topk > 1) verify the greedy chain of "
                                 f"speculative_num_steps={steps} drafts and then the likeliest other candidates, up to "
                                 f"speculative_num_draft_tokens - 1 = {n - 1} drafts: that leaves no room beyond the "
                                 f"chain (a chain at a beam search's cost); set speculative_num_draft_tokens above "
                                 f"{steps + 1} (e.g. {2 * steps + 1}), or speculative_eagle_topk=1")
        if self.speculative_algorithm == "draft" and not self.speculative_draft_model_path:
            raise ValueError("speculative_algorithm='draft' needs speculative_draft_model_path (the draft model's "
                             "directory)")
        if self.speculative_draft_model_path is not None and self.speculative_algorithm != "draft":
            raise ValueError(f"speculative_draft_model_path is for speculative_algorithm='draft', not "
                             f"{self.speculative_algorithm!r}")
        if self.speculative_ngram_min_match_window_size > self.speculative_ngram_max_match_window_size:
            raise ValueError("speculative_ngram_min_match_window_size must be <= speculative_ngram_max_match_window_size")
        if isinstance(self.cuda_graph_max_extend_tokens, bool) or not isinstance(self.cuda_graph_max_extend_tokens, int) \
                or self.cuda_graph_max_extend_tokens < 0:
            raise ValueError(f"cuda_graph_max_extend_tokens must be an integer >= 0 (0: off), got "
                             f"{self.cuda_graph_max_extend_tokens!r}")
        if self.chunked_prefill_size < self.page_size:
            raise ValueError(f"chunked_prefill_size ({self.chunked_prefill_size}) must be >= page_size ({self.page_size})")
        if isinstance(self.state_memory_ratio, bool) or not isinstance(self.state_memory_ratio, (int, float)) \
                or not 0.0 < self.state_memory_ratio <= 100.0:
            raise ValueError(f"state_memory_ratio must be in (0, 100], got {self.state_memory_ratio!r}")
        if isinstance(self.mem_fraction, bool) or not isinstance(self.mem_fraction, (int, float)) \
                or not 0.0 <= self.mem_fraction < 1.0:
            raise ValueError(f"mem_fraction must be in [0, 1), got {self.mem_fraction!r}")
        for name, high, zero in (("hicache_ratio", 1000.0, False), ("hicache_size", float(1 << 20), True)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (0 < v <= high or (zero and v == 0)):
                raise ValueError(f"{name} must be a number in (0, {high:g}]"
                                 f"{' or 0 (use hicache_ratio)' if zero else ''}, got {v!r}")
        if self.enable_hierarchical_cache is True and not self.enable_prefix_cache:
            raise ValueError("enable_hierarchical_cache keeps what the prefix cache evicts: it needs enable_prefix_cache")
        self._check_device()
        self._check_tokenizer_options()
        check_weight_version(self.weight_version)
        if self.cpu_threads is not None and (isinstance(self.cpu_threads, bool)
                                             or not isinstance(self.cpu_threads, int) or self.cpu_threads < 0):
            raise ValueError(f"cpu_threads must be a non-negative integer or None, got {self.cpu_threads!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be an integer in [0, 2**63), got {self.seed!r}")
        if isinstance(self.priority_scheduling_preemption_threshold, bool) \
                or not isinstance(self.priority_scheduling_preemption_threshold, int) \
                or self.priority_scheduling_preemption_threshold < 0:
            raise ValueError(f"priority_scheduling_preemption_threshold must be an integer >= 0 (requests of equal "
                             f"priority never preempt each other), got {self.priority_scheduling_preemption_threshold!r}")
        for name in ("enable_prefix_cache", "enable_hierarchical_cache", "protect_waiting_prefixes", "debug_checks",
                     "compile_decode",
                     "disable_cuda_graph", "speculative_ngram_adaptive", "enable_mixed_chunk",
                     "enable_priority_scheduling", "schedule_low_priority_values_first", "enable_lora"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")

        # an option of a feature that is off would be ignored: more likely a mistake than a wish, so it is refused
        # (an option at its default counts as not set). Each row: the condition under which the feature is off, as
        # the message says it, whether the feature is on, and its options
        defaults = {f.name: f.default for f in fields(self)}
        for condition, on, names in (
                ("without speculative_algorithm", self.speculative_algorithm is not None,
                 ("speculative_num_draft_tokens", "speculative_num_steps", "speculative_eagle_topk",
                  "speculative_disable_by_batch_size")),
                ("without speculative_algorithm='ngram'", self.speculative_algorithm == "ngram",
                 ("speculative_ngram_min_match_window_size", "speculative_ngram_max_match_window_size",
                  "speculative_ngram_adaptive")),
                ("with disable_cuda_graph",  # (0, extends run eagerly, agrees with disable_cuda_graph)
                 not self.disable_cuda_graph or self.cuda_graph_max_extend_tokens == 0,
                 ("cuda_graph_max_extend_tokens",)),
                ("without enable_hierarchical_cache", self.enable_hierarchical_cache,
                 ("hicache_ratio", "hicache_size")),
                ("without enable_priority_scheduling", self.enable_priority_scheduling,
                 ("schedule_low_priority_values_first", "priority_scheduling_preemption_threshold")),
                ("without enable_lora", self.enable_lora, ("max_loras", "max_cpu_loras", "max_lora_rank"))):
            changed = [name for name in names if getattr(self, name) != defaults[name]]
            if changed and not on:
                raise ValueError(f"{', '.join(changed)} set {condition}, which would ignore "
                                 f"{'them' if len(changed) > 1 else 'it'}")

        for name in ("limit_mm_per_prompt", "mm_processor_kwargs"):  # (copies: the caller's dicts may change later)
            if isinstance(getattr(self, name), dict):
                object.__setattr__(self, name, dict(getattr(self, name)))
        check_mm_limits(self.limit_mm_per_prompt)
        from hyla.model.image_processing import check_processor_kwargs  # (here: --help must not wait for torch)
        check_processor_kwargs(self.mm_processor_kwargs)
        v = self.mm_embedding_cache_mb
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= 1 << 20:
            raise ValueError(f"mm_embedding_cache_mb must be an integer in [0, 2**20], got {v!r}")
        pos_int("max_loras")
        pos_int("max_cpu_loras", allow_none=True)
        pos_int("max_lora_rank")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras ({self.max_loras}): "
                             f"the slots hold loaded adapters")
        if self.enable_lora and self.compile_decode:
            raise ValueError("enable_lora is not supported with compile_decode (its graphs freeze or pack the "
                             "weights); turn one of them off")
        if self.enable_mixed_chunk and self.speculative_algorithm is not None:
            raise ValueError("enable_mixed_chunk is not supported with speculative decoding (a decoding request's "
                             "step is a verify step of its drafts); turn one of them off")

    def _check_device(self) -> None:
        """``device``: ``cpu``, or ``cuda`` / ``cuda:N`` of a GPU this machine has."""
        import torch  # (here: the CLI imports this module for its flags, and --help must not wait for torch)

        try:
            device = torch.device(self.device) if isinstance(self.device, str) else None
        except RuntimeError:
            device = None
        if device is None or device.type not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        if device.type == "cuda" and (not torch.cuda.is_available() or (device.index or 0) >= torch.cuda.device_count()):
            raise ValueError(f"device {self.device!r}: " + ("this machine has no CUDA device (or this torch has no CUDA)"
                             if not torch.cuda.is_available() else f"there are {torch.cuda.device_count()} CUDA devices"))

    def _check_tokenizer_options(self) -> None:
        """``tokenizer_path``: a directory holding a tokenizer; ``chat_template``: a Jinja file, or a
        template's text, that compiles (``read_chat_template``)."""
        # (imported here: the CLI imports this module for its flags, and --help must not wait for them)
        from hyla.tokenizer.chat_template import read_chat_template
        from hyla.tokenizer.tokenizer import has_tokenizer

        if self.tokenizer_path is not None:
            name = os.fspath(self.tokenizer_path) if isinstance(self.tokenizer_path, (str, os.PathLike)) else None
            if not isinstance(name, str) or not name:
                raise ValueError(f"tokenizer_path must be a directory's path, got {self.tokenizer_path!r:.80}")
            if not os.path.isdir(name):
                raise ValueError(f"tokenizer_path {name!r}: no such directory")
            if not has_tokenizer(Path(name)):
                raise ValueError(f"tokenizer_path {name!r} holds no tokenizer (tokenizer.json, or a tiktoken file)")
        if self.chat_template is not None:
            read_chat_template(self.chat_template)

    @classmethod
    def from_options(cls, model_path: str | None, options: dict[str, Any]) -> "EngineArgs":
        """``EngineArgs(model_path=..., **options)``, an unknown option a ``ValueError`` naming the
        closest known one (a dataclass's own error is a ``TypeError``)."""
        known = {f.name for f in fields(cls)}
        for name in options:
            if name not in known:
                close = difflib.get_close_matches(name, known, n=1)
                raise ValueError(f"unknown engine option {name!r}" + (f"; did you mean {close[0]!r}?" if close else ""))
        return cls(model_path=model_path, **options)

    @property
    def num_draft_tokens(self) -> int:
        """Draft tokens per request and verify step: ``speculative_num_steps`` for mtp and draft
        chains, ``speculative_num_draft_tokens - 1`` for ngram and for mtp and draft trees, 0 without speculation."""
        if self.speculative_algorithm is None:
            return 0
        if self.speculative_algorithm in ("mtp", "draft") and self.speculative_eagle_topk == 1:
            return self.speculative_num_steps
        return self.speculative_num_draft_tokens - 1

    @classmethod
    def field_help(cls) -> dict[str, tuple[Any, str]]:
        """name -> (default, help) for every option: the CLI builds its flags from this."""
        return {f.name: (f.default, f.metadata.get("help", "")) for f in fields(cls)}


def check_state_slots(num_slots: int, running: int, per_req: int = 1, holds: str = "") -> None:
    """``ValueError`` unless ``num_slots`` state slots hold ``running`` requests of ``per_req`` slots
    each with room left for checkpoints (``holds``: what else a request holds, for the message).
    The engine's rule; ``hyla.sim.replay`` checks its pools with it too."""
    if num_slots < 2:
        raise ValueError("max_state_slots must be at least 2 (one running state + one checkpoint)")
    if running * per_req >= num_slots:
        raise ValueError(f"max_running_requests ({running}) x {per_req} state slots each must be below "
                         f"max_state_slots ({num_slots}): each running request holds one state slot{holds}, "
                         "and checkpoints need more")


def context_length_for(asked: int | None, model_max: int, kv_room: int, attention: bool = True) -> int:
    """The context length: the one ``asked`` (``context_length``), which must fit the KV pool beside
    the drafts' reserve (``kv_room``; before, a longer one was silently cut to it, as vLLM refuses
    it too). Past the model's ``max_position_embeddings`` it is allowed, with a warning where the
    model has ``attention`` layers: they then see positions they were not trained on (the linear
    layers have none; a pure state-space model's configs give no such limit). Not asked: the
    model's, cut to the pool."""
    if asked is None:
        return min(model_max, kv_room)
    if asked > kv_room:
        raise ValueError(f"context_length={asked} does not fit the KV pool ({kv_room} tokens for one request): raise "
                         f"max_total_tokens (or mem_fraction), or lower context_length")
    if asked > model_max and attention:
        logger.warning("context_length=%d is longer than the model's max_position_embeddings (%d): attention will "
                       "see positions it was not trained on", asked, model_max)
    return asked


def check_mm_limits(limits: Any) -> None:
    """``limit_mm_per_prompt``: None or vLLM's ``{"image": N}`` (N >= 0; ``"video": 0`` is taken too, hyla
    serving no videos); ``ValueError`` otherwise."""
    if limits is None:
        return
    if not isinstance(limits, dict):
        raise ValueError(f"limit_mm_per_prompt must be an object such as {{\"image\": 4}}, got {limits!r}")
    for key, value in limits.items():
        if key not in ("image", "video"):
            raise ValueError(f"limit_mm_per_prompt: {key!r} is not a modality hyla serves (image)")
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"limit_mm_per_prompt: {key} must be an integer >= 0, got {value!r}")
        if key == "video" and value:
            raise ValueError("limit_mm_per_prompt: hyla serves no videos (video must be 0)")


def host_cache_sizes(args: EngineArgs, num_tokens: int, num_slots: int, kv_bytes_per_token: int,
                     state_bytes_per_slot: int) -> tuple[int, int]:
    """The host tier's KV tokens and state slots (``enable_hierarchical_cache``): ``hicache_size``
    GiB split as the device's pools are (``state_memory_ratio``), else ``hicache_ratio`` times the
    device's ``num_tokens`` and ``num_slots``. The engine's rule; ``hyla.sim.replay`` sizes its tier
    with it too."""
    from hyla.cache.memory import INDEX_ONLY_KV_TOKENS, split_memory  # (here: --help must not wait for torch)

    if args.hicache_size:
        try:
            split = split_memory(int(args.hicache_size * 2**30), args.state_memory_ratio, kv_bytes_per_token,
                                 state_bytes_per_slot, args.page_size)
        except ValueError as exc:
            raise ValueError(f"hicache_size={args.hicache_size} GiB is too small: {exc}") from None
        return split.num_kv_tokens, max(1, split.num_state_slots)
    tokens = int(num_tokens * args.hicache_ratio)
    if not kv_bytes_per_token:  # a model without attention: KV indices alone
        tokens = min(tokens, INDEX_ONLY_KV_TOKENS)
    return max(args.page_size, tokens - tokens % args.page_size), max(1, int(num_slots * args.hicache_ratio))
