"""The trace replay: drive hyla's real ``RadixCache`` and pools, in accounting mode.

One request, in arrival order (an event-ordered replay: with no model to run, concurrency
matters only through what the cache holds when a request arrives):

1. ``match_prefix(input[:-1])`` — the last prompt token is always computed, its logits give the
   first output token. The hit is the usable prefix: it ends at a node holding a checkpoint.
2. KV-lock the matched KV path (the part the tree already holds is reused, not re-allocated),
   ask the tree for its ``branch_point`` (a dry-run insert) and the policy's admission rule for
   the checkpoint positions of the prompt and of the finished sequence.
3. "Prefill": make room (evict in policy order until the tree, plus what this request adds, fits
   the byte budget), allocate the new KV and checkpoint slots, ``insert`` the prompt. Speculative
   checkpoints (the admission's ``optional``) get room only from free memory or by replacing
   speculative or superseded checkpoints (the tree's rule: ``evict_state(n, for_speculative=True)``),
   and are inserted as speculative; where they do not all fit even so, the deepest that fit are
   kept, the others left out (the engine's rule, ``CacheManager.alloc_checkpoints``).
4. "Decode": the output tokens are allocated as the request's own KV; at the finish the sequence
   the engine holds — prompt + output minus the last sampled token, which is never fed — is
   inserted with an ordinary checkpoint at its end (never speculative: it ends a finished turn, as
   the engine's ``confirm_checkpoint`` makes it), so the next turn of a chat (whose input starts
   with this turn's input and output) continues from there. Unlock.

Memory model: one byte budget (``cache_bytes``) shared elastically by KV and checkpoints, as in
Marconi; each accounting pool is sized to hold the whole budget alone and the simulator enforces
the sum. A request whose additions cannot fit even after evicting everything unlocked is cached
only up to its deepest checkpoint that fits.

Metrics: token hit rate = Σ hit / Σ input tokens; request hit rate = share of requests with a hit;
FLOPs saved = Σ prefill FLOPs of the hit prefixes; KV / state bytes held after each request
(mean and peak); modelled TTFT (``LatencyModel``) P50 / P95.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Sequence

import numpy as np
import torch
from tqdm.auto import tqdm

from hyla.cache import Checkpoint, RadixCache
from hyla.sim.latency import LatencyModel
from hyla.sim.models import CostModel
from hyla.sim.policies import POLICIES, Admission, SimPolicy, Stage, make_policy
from hyla.sim.trace import TraceRequest

@dataclass(frozen=True)
class SimConfig:
    model: CostModel
    policy: str
    cache_bytes: int
    latency: LatencyModel = field(default_factory=LatencyModel)
    policy_options: tuple[tuple[str, Any], ...] = ()  # extra keyword arguments of the policy
    # the most tokens the run holds at once (``simulate``: ``trace_tokens`` of its trace), which bounds
    # the accounting pools' ids (``CostModel.make_pools``); None: as many as the budget would hold
    max_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}; choose from {', '.join(POLICIES)}")
        if self.cache_bytes <= self.model.state_bytes_per_slot:
            raise ValueError(f"a cache of {self.cache_bytes} bytes cannot hold one {self.model.name} "
                             f"checkpoint ({self.model.state_bytes_per_slot} bytes)")


@dataclass(frozen=True)
class SimResult:
    policy: str
    model: str
    cache_bytes: int
    num_requests: int
    input_tokens: int
    cached_tokens: int
    token_hit_rate: float
    request_hit_rate: float
    flops_total: float  # prefill FLOPs of all prompts with no cache
    flops_saved: float  # of which the hits saved
    kv_bytes: float  # mean over requests of the KV bytes the tree holds after each
    state_bytes: float  # same for checkpoint bytes
    kv_bytes_peak: int
    state_bytes_peak: int
    ttft_mean: float
    ttft_p50: float
    ttft_p95: float
    num_evicted_checkpoints: int
    policy_info: dict[str, Any] = field(default_factory=dict)  # e.g. the alpha a policy settled on

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class RequestOutcome:
    cached_tokens: int
    ttft: float


class LogicalClock:
    """The tree's clock: one tick per match or insert (deterministic recency, as in Marconi's sim)."""

    def __init__(self) -> None:
        self.now = 0

    def __call__(self) -> float:
        self.now += 1
        return self.now


class Simulator:
    """Replays requests one at a time through one tree; ``serve`` can be called step by step."""

    def __init__(self, config: SimConfig) -> None:
        self.config = config
        self.model = config.model
        self.kv_pool, self.state_pool = config.model.make_pools(config.cache_bytes, config.max_tokens)
        self.clock = LogicalClock()
        self.policy: SimPolicy = make_policy(config.policy, config.model, config.cache_bytes, config.max_tokens,
                                             **dict(config.policy_options))
        self.tree = RadixCache(self.kv_pool, state_pool=self.state_pool, policy=self.policy.eviction,
                               clock=self.clock)
        self.policy.attach(self.clock)
        self._kvb = self.kv_pool.bytes_per_token
        self._sb = self.state_pool.bytes_per_slot
        self.num_evicted_checkpoints = 0

    # ---- memory --------------------------------------------------------------------------------
    def kv_bytes(self) -> int:
        return self.kv_pool.used_size() * self._kvb

    def state_bytes(self) -> int:
        return self.state_pool.used_size() * self._sb

    def used_bytes(self) -> int:
        return self.kv_bytes() + self.state_bytes()

    def _fits(self, num_tokens: int, num_states: int) -> bool:
        """Within the budget, and within the KV pool's free token ids (what binds for a pure
        state-space model, whose tokens cost no bytes: its pool is indices alone)."""
        return (self.used_bytes() + num_tokens * self._kvb + num_states * self._sb <= self.config.cache_bytes
                and num_tokens <= self.kv_pool.available_size())

    def _make_room(self, num_tokens: int, num_states: int, for_speculative: bool = False) -> bool:
        """Evict in policy order until ``num_tokens`` KV + ``num_states`` checkpoints fit the budget;
        ``for_speculative``: only replaceable checkpoints (speculative or superseded)."""
        while not self._fits(num_tokens, num_states):
            before = self.state_pool.used_size()
            if not self.policy.evict_one(self.tree, for_speculative):
                return False
            self.num_evicted_checkpoints += before - self.state_pool.used_size()
        return True

    # ---- one request ---------------------------------------------------------------------------
    def serve(self, req: TraceRequest) -> RequestOutcome:
        tree = self.tree
        inp = list(req.input_tokens)
        fill = inp + list(req.output_tokens)
        match = tree.match_prefix(inp[:-1])
        hit = match.prefix_len
        self.policy.on_request(req, hit)
        node = match.kv_only_node  # the KV the tree already has for this prompt: reused, kept locked
        tree.inc_lock_ref(node)
        plan = self.policy.admission(req, hit, tree.branch_point(inp))
        if hit:
            tree.inc_state_lock(match.last_node)  # as the engine: the hit is protected until copied
        stages = self._admit(plan, node.depth)
        if hit:
            tree.dec_state_lock(match.last_node)
        for length, positions, speculative in stages:
            if length > node.depth or positions:
                node = self._insert(fill, length, positions, node, speculative)
        tree.dec_lock_ref(node)
        return RequestOutcome(hit, self.config.latency.ttft(self.model, len(inp), hit))

    def _admit(self, plan: Admission, have: int) -> list[Stage]:
        """Make room for ``plan`` — its KV past the ``have`` tokens the tree holds for it, and its
        checkpoints — and return the inserts that fit (``Admission.stages``), by the engine's rule
        (``CacheManager.alloc_checkpoints``):

        * the required checkpoints may evict any unlocked checkpoint; where even that leaves no room,
          the request is cached up to its deepest checkpoint that fits (``_trim``);
        * the speculative ones may then evict only replaceable checkpoints (speculative or
          superseded); where all of them still do not fit, the deepest that fit are kept, so the
          room the evictions freed holds what it was freed for."""
        new_tokens = max(0, plan.prompt_len - have, plan.final_len - have)
        if not self._make_room(new_tokens, plan.num_required):
            return [self._trim(plan.without_optional(), have)]
        wanted = plan.num_required + len(plan.optional)
        if plan.optional and not self._make_room(new_tokens, wanted, for_speculative=True):
            room = self._spare_states(new_tokens, plan.num_required)
            plan = plan.keeping_optional(sorted(plan.optional, reverse=True)[:room])
        return plan.stages()

    def _spare_states(self, num_tokens: int, num_states: int) -> int:
        """How many more checkpoints fit, without evicting, beside ``num_tokens`` KV and
        ``num_states`` checkpoints (that do fit)."""
        free = self.config.cache_bytes - self.used_bytes() - num_tokens * self._kvb - num_states * self._sb
        return max(0, min(free // self._sb, self.state_pool.available_size() - num_states))

    def _insert(self, fill: list[int], length: int, positions: Sequence[int], locked: Any,
                speculative: frozenset[int]) -> Any:
        """Insert ``fill[:length]`` with checkpoints at ``positions`` (fresh slots; those in
        ``speculative`` marked so), reusing the KV the tree holds up to the locked node; moves the
        lock to the node the insert ends at."""
        have = min(locked.depth, length)
        kv = self.tree.match_kv(fill[:have])
        new = self.kv_pool.alloc(length - have) if length > have else kv[:0]
        slots = self.state_pool.alloc(len(positions)).tolist()
        ckpts = [Checkpoint(p, s, p in speculative) for p, s in zip(positions, slots)]
        res = self.tree.insert(fill[:length], torch.cat([kv, new]), checkpoints=ckpts)
        self.tree.inc_lock_ref(res.last_node)
        self.tree.dec_lock_ref(locked)
        return res.last_node

    def _trim(self, plan: Admission, have: int) -> Stage:
        """One insert: up to the deepest checkpoint of ``plan`` (with those before it) that fits what
        is free now; none of them speculative (``plan`` has none left to store)."""
        free = self.config.cache_bytes - self.used_bytes()
        free_ids = self.kv_pool.available_size()
        positions = sorted({*plan.prompt_checkpoints, *plan.final_checkpoints})
        best: Stage = (0, (), frozenset())
        for i, p in enumerate(positions):
            if max(0, p - have) * self._kvb + (i + 1) * self._sb <= free and max(0, p - have) <= free_ids:
                best = (p, tuple(positions[: i + 1]), frozenset())
        return best


def trace_tokens(trace: Sequence[TraceRequest]) -> int:
    """A bound on the tokens (and checkpoints) a replay of ``trace`` holds at once: the tree holds at
    most every token the requests fed, and a request adds at most its own (+ 1: the checkpoint a
    request without output stores at its prompt's end, counted twice until the tree frees the copy)."""
    return sum(r.num_input_tokens + r.num_output_tokens for r in trace) + 1


def simulate(trace: Sequence[TraceRequest], config: SimConfig, show_progress: bool = False) -> SimResult:
    """Replay ``trace`` (in arrival order) under ``config`` and aggregate the metrics. The pools hold
    at most ``trace_tokens(trace)`` ids (unless ``config.max_tokens`` says otherwise): what the trace
    can fill, whatever the budget."""
    if config.max_tokens is None:
        config = replace(config, max_tokens=trace_tokens(trace))
    sim = Simulator(config)
    hits = np.zeros(len(trace), dtype=np.int64)
    ttft = np.zeros(len(trace))
    kv_bytes = np.zeros(len(trace))
    state_bytes = np.zeros(len(trace))
    order = sorted(range(len(trace)), key=lambda i: trace[i].ts)
    steps: Any = order
    if show_progress:  # (a disabled tqdm still takes a multiprocessing lock, which sweep workers would leak)
        steps = tqdm(order, desc=config.policy, unit="req")
    for j, i in enumerate(steps):
        out = sim.serve(trace[i])
        hits[j], ttft[j] = out.cached_tokens, out.ttft
        kv_bytes[j], state_bytes[j] = sim.kv_bytes(), sim.state_bytes()
    model = config.model
    inputs = np.array([trace[i].num_input_tokens for i in order], dtype=np.int64)
    return SimResult(
        policy=config.policy,
        model=model.name,
        cache_bytes=config.cache_bytes,
        num_requests=len(trace),
        input_tokens=int(inputs.sum()),
        cached_tokens=int(hits.sum()),
        token_hit_rate=float(hits.sum() / max(1, inputs.sum())),
        request_hit_rate=float((hits > 0).mean()) if len(trace) else 0.0,
        flops_total=float(sum(model.prefill_flops(int(n)) for n in inputs)),
        flops_saved=float(sum(model.prefill_flops(int(h)) for h in hits)),
        kv_bytes=float(kv_bytes.mean()) if len(trace) else 0.0,
        state_bytes=float(state_bytes.mean()) if len(trace) else 0.0,
        kv_bytes_peak=int(kv_bytes.max(initial=0)),
        state_bytes_peak=int(state_bytes.max(initial=0)),
        ttft_mean=float(ttft.mean()) if len(trace) else math.nan,
        ttft_p50=float(np.percentile(ttft, 50)) if len(trace) else math.nan,
        ttft_p95=float(np.percentile(ttft, 95)) if len(trace) else math.nan,
        num_evicted_checkpoints=sim.num_evicted_checkpoints,
        policy_info=sim.policy.info(),
    )
