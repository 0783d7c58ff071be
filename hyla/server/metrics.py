"""Prometheus metrics for ``GET /metrics``, one ``CollectorRegistry`` per app.

Two sources:

* the engine's own counters and gauges (``Engine.get_stats()``), read at scrape time by
  ``EngineCollector`` — prompt / cached / generated tokens, finished requests, retractions, cache
  hit rate, KV and state pool usage, running and queued requests, decode throughput;
* what only the server sees, recorded by ``ServerMetrics`` as requests go by — HTTP requests by
  route and status, time to first token, time per output token, inter-token latency, end-to-end
  latency, time in the engine's queue (the engine's ``meta_info["queue_time"]``), and each request's
  prompt and output lengths.

A registry per app (not the global default) lets tests run several servers in one process.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

PREFIX = "hyla"

# (engine stats key, metric name, help) — monotonically increasing engine counters
ENGINE_COUNTERS = (
    ("num_prompt_tokens", "prompt_tokens", "Prompt tokens of admitted requests."),
    ("num_cached_tokens", "cached_tokens", "Prompt tokens served from the prefix cache."),
    ("num_generated_tokens", "generation_tokens", "Generated tokens."),
    ("num_requests_finished", "engine_requests_finished", "Requests the engine finished (any reason)."),
    ("num_retractions", "retractions", "Requests retracted (their work cached, requeued): to free KV memory, "
                                       "or preempted for a more urgent request."),
    ("num_preemptions", "preemptions", "Retractions that made room for a more urgent waiting request "
                                       "(--enable-priority-scheduling)."),
    ("num_overlapped_steps", "overlapped_decode_steps",
     "Decode steps launched before the previous step's tokens were read (the overlap schedule)."),
    ("num_mixed_tokens", "mixed_decode_tokens",
     "Decoding requests' tokens fed in prefill steps (--enable-mixed-chunk)."),
    ("num_host_hit_tokens", "host_cache_hit_tokens",
     "Cached prompt tokens the host tier added past the device's hits (--enable-hierarchical-cache)."),
    ("num_host_saved_tokens", "host_cache_saved_tokens", "KV tokens copied from the device into the host tier."),
    ("num_host_loaded_tokens", "host_cache_loaded_tokens", "KV tokens copied from the host tier back to the device."),
    ("num_image_encodes", "image_encodes", "Images the vision tower embedded (absent for a text model)."),
    ("num_image_cache_hits", "image_cache_hits",
     "Images embedded from the embedding cache, the tower not run (--mm-embedding-cache-mb; absent for a text "
     "model)."),
    ("num_lora_slot_loads", "lora_slot_loads",
     "LoRA adapters written into a device slot as a request applying one was admitted (absent without "
     "--enable-lora; more than the adapters loaded: they took turns in the --max-loras slots)."),
)
# (engine stats key, metric name, help) — gauges
ENGINE_GAUGES = (
    ("cache_hit_rate", "cache_hit_rate", "Cached prompt tokens / prompt tokens since start."),
    ("token_usage", "kv_pool_usage", "Share of the KV pool in use (requests + prefix tree)."),
    ("state_usage", "state_pool_usage", "Share of the recurrent-state pool in use (requests + checkpoints)."),
    ("host_token_usage", "host_cache_usage", "Share of the host tier's KV pool holding cached prefixes (absent when off)."),
    ("num_running_requests", "num_running_requests", "Requests admitted to the running batch."),
    ("num_queued_requests", "num_queued_requests", "Requests waiting for admission."),
    ("gen_throughput", "gen_throughput", "Decode throughput over the last log interval (tokens/s)."),
    ("spec_accept_length", "spec_accept_length",
     "Speculative decoding: mean output tokens per request per verify step (absent when off)."),
    ("num_lora_adapters", "num_lora_adapters", "LoRA adapters loaded (absent without --enable-lora)."),
    ("num_lora_requests", "num_lora_requests",
     "Running and waiting requests that apply a LoRA adapter (absent without --enable-lora)."),
)

TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)
QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
# request lengths in tokens: 1, 2, 5, 10, 20, 50 ... 500k (vLLM's 1-2-5 buckets)
TOKEN_BUCKETS = tuple(m * 10 ** e for e in range(6) for m in (1, 2, 5))


class EngineCollector(Collector):
    """Exposes ``get_stats()`` of the engine that ``get_engine()`` returns (None before start-up)."""

    def __init__(self, get_engine: Callable[[], Any]):
        self.get_engine = get_engine

    def collect(self) -> Iterator[Metric]:
        engine = self.get_engine()
        if engine is None:
            return
        stats = engine.get_stats()
        for key, name, help_text in ENGINE_COUNTERS:
            if stats.get(key) is None:  # (a feature that is off)
                continue
            counter = CounterMetricFamily(f"{PREFIX}_{name}", help_text)
            counter.add_metric([], float(stats[key]))
            yield counter
        for key, name, help_text in ENGINE_GAUGES:
            if stats.get(key) is not None:
                yield GaugeMetricFamily(f"{PREFIX}_{name}", help_text, value=float(stats[key]))
        info = stats.get("lora_requests_info")
        if info is not None:  # (vLLM's vllm:lora_requests_info: its labels, the time of the scrape as its value)
            gauge = GaugeMetricFamily(f"{PREFIX}_lora_requests_info", "The LoRA adapters running and waiting requests "
                                      "apply (comma-separated names) and the adapters one batch applies (max_lora); "
                                      "the value is the time of the scrape (absent without --enable-lora).",
                                      labels=["running_lora_adapters", "waiting_lora_adapters", "max_lora"])
            gauge.add_metric([",".join(info["running"]), ",".join(info["waiting"]), str(info["max_lora"])], time.time())
            yield gauge


class ServerMetrics:
    """The app's registry and the metrics the server records itself."""

    def __init__(self, get_engine: Callable[[], Any]):
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(get_engine))
        self.http_requests = Counter(
            f"{PREFIX}_http_requests", "HTTP requests by route, method and status code.",
            ["route", "method", "status"], registry=self.registry)
        self.finished = Counter(
            f"{PREFIX}_requests_finished", "Generation requests answered by the server, by endpoint and "
            "finish reason (stop, length, abort).", ["endpoint", "finish_reason"], registry=self.registry)
        self.ttft = Histogram(
            f"{PREFIX}_time_to_first_token_seconds", "Time from receiving a request to its first output token.",
            buckets=TTFT_BUCKETS, registry=self.registry)
        self.tpot = Histogram(
            f"{PREFIX}_time_per_output_token_seconds", "Mean time per output token after the first, per request.",
            buckets=TPOT_BUCKETS, registry=self.registry)
        self.e2e = Histogram(
            f"{PREFIX}_e2e_request_latency_seconds", "Time from receiving a request to its last output token.",
            buckets=E2E_BUCKETS, registry=self.registry)
        self.itl = Histogram(
            f"{PREFIX}_inter_token_latency_seconds", "Time between consecutive output tokens of a request (a "
            "chunk of n tokens: its wait since the previous chunk / n, n times).", buckets=TPOT_BUCKETS,
            registry=self.registry)
        self.queue_time = Histogram(
            f"{PREFIX}_request_queue_time_seconds", "Time a request waited in the engine's queue before its first "
            "admission to the batch.", buckets=QUEUE_BUCKETS, registry=self.registry)
        self.prompt_tokens = Histogram(
            f"{PREFIX}_request_prompt_tokens", "Prompt length of each finished request, in tokens.",
            buckets=TOKEN_BUCKETS, registry=self.registry)
        self.generation_tokens = Histogram(
            f"{PREFIX}_request_generation_tokens", "Output length of each finished request, in tokens.",
            buckets=TOKEN_BUCKETS, registry=self.registry)

    def observe_tokens(self, wait: float, num_tokens: int) -> None:
        """A request's chunk of ``num_tokens`` new tokens came ``wait`` seconds after its previous one."""
        for _ in range(num_tokens):
            self.itl.observe(wait / num_tokens)

    def observe_request(self, endpoint: str, finish_reason: str, arrival: float, first_token: float | None,
                        last_token: float | None, num_output_tokens: int, meta: dict[str, Any]) -> None:
        """Record one finished engine request (one choice); times are ``time.monotonic()`` values, ``meta``
        its last ``meta_info`` (``prompt_tokens``; ``queue_time`` once it was admitted)."""
        self.finished.labels(endpoint, finish_reason).inc()
        if meta.get("queue_time") is not None:
            self.queue_time.observe(meta["queue_time"])
        if meta.get("prompt_tokens") is not None:
            self.prompt_tokens.observe(meta["prompt_tokens"])
        self.generation_tokens.observe(num_output_tokens)
        if first_token is not None:
            self.ttft.observe(first_token - arrival)
        if last_token is not None:
            self.e2e.observe(last_token - arrival)
        if first_token is not None and last_token is not None and num_output_tokens > 1:
            self.tpot.observe((last_token - first_token) / (num_output_tokens - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)
