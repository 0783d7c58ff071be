"""The engine's own scheduling and caching, replayed on a trace without a model.

``replay_engine(trace, layout, **engine_options)`` builds what ``hyla.Engine`` builds around its
model — accounting pools (``KVPool`` / ``StatePool`` with ``accounting=True``, any model size),
the radix tree, the ``CacheManager``, the ``Scheduler`` and its ``OutputProcessor`` — and hands
the scheduler a runner that computes nothing: each step it returns, for every request, logits
whose argmax is the request's next *traced* output token. Greedy sampling then reproduces the
trace's outputs, and everything else — admission order (LPM), chunked prefill, the decode reserve,
retraction, every checkpoint and eviction — is the engine's own code deciding. The per-request
cached tokens are what the engine would report for the same requests (``tests/
test_sim_engine_agreement.py`` checks it against a real engine).

Time: requests are submitted in arrival order, those with the same ``ts`` together (one
``generate`` call's batch), and the engine drains before the next ``ts``: a replay models waves of
requests (a turn of every session, or one request at a time), not step durations.

Unlike ``Simulator`` (Marconi's protocol: one byte budget shared by KV and checkpoints, exact
checkpoint positions, one request at a time, pluggable policies), this replays hyla's engine
exactly as configured: two pools, pages, the checkpoint grid, concurrency.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from typing import Any, Mapping, Sequence

import torch

from hyla.cache import CacheLayout, CacheLedger, HostCache, KVPool, RadixCache, ReqToTokenPool, StatePool
from hyla.engine.args import EngineArgs, check_state_slots, context_length_for, host_cache_sizes, kv_cache_torch_dtype
from hyla.engine.cache_manager import CacheManager
from hyla.engine.engine import MAX_RUNNING_REQUESTS, running_requests_for_slots
from hyla.engine.output_processor import OutputProcessor
from hyla.engine.request import Req
from hyla.engine.sampling_params import SamplingParams
from hyla.engine.scheduler import Scheduler, SchedulerConfig
from hyla.model.config import parse_dtype
from hyla.sim.trace import TraceRequest


class TraceRunner:
    """The model's stand-in (the scheduler's ``Runner``): logits ``[rows, V]`` that are zero but
    for a one at each request's next traced output token."""

    def __init__(self, outputs: dict[str, Sequence[int]], vocab_size: int) -> None:
        self.outputs = outputs  # rid -> the output tokens to reproduce
        self.vocab_size = vocab_size

    def _logits(self, reqs: list[Req], rows: list[int]) -> torch.Tensor:
        logits = torch.zeros(sum(rows), self.vocab_size)  # [rows, V]
        end = 0
        for r, n in zip(reqs, rows):
            end += n
            out = self.outputs[r.rid]
            logits[end - 1, out[min(len(r.output_ids), len(out) - 1)]] = 1.0  # a request's last row samples
        return logits

    def forward_extend(self, reqs: list[Req], extend_lens: list[int], out_cache_loc: torch.Tensor,
                       ckpts: list, all_logits: bool = False, logit_rows: list[list[int]] | None = None) -> torch.Tensor:
        rows = list(extend_lens) if all_logits else [len(r) for r in logit_rows] if logit_rows else [1] * len(reqs)
        return self._logits(reqs, rows)

    def forward_decode(self, reqs: list[Req], out_cache_loc: torch.Tensor) -> torch.Tensor:
        return self._logits(reqs, [1] * len(reqs))


@dataclass
class Replay:
    """A finished replay: per trace request (in trace order) its rid and cached tokens; the
    scheduler and cache manager, whose counters (retractions, evictions) are the engine's; the
    layout its pools were built with (``engine_layout``) and the context length it checked the
    requests against (``engine_context_length``)."""

    rids: list[str]
    cached_tokens: list[int]
    scheduler: Scheduler
    cache: CacheManager
    ledger: CacheLedger | None
    layout: CacheLayout
    context_length: int


# Without a model's vocabulary size (``vocab_size=None``) token ids must stay below this: the
# runner's logits have a column per id up to the largest.
MAX_UNKNOWN_VOCAB = 1 << 20

# State slots a running request holds in a replay: its own, and no scratch slots (a replay runs no
# speculative decoding): ``Engine._build_pools``'s ``per_req``
STATE_SLOTS_PER_REQUEST = 1


def _where(r: TraceRequest) -> str:
    return f"request (session {r.session_id!r}, turn {r.turn_id})"


def check_trace(trace: Sequence[TraceRequest], context_length: int, vocab_size: int | None = None,
                limit: str = "") -> None:
    """``ValueError`` naming the first request (in trace order) the engine would refuse: one
    without output tokens, a prompt of ``context_length`` tokens or more, a prompt + output
    longer than ``context_length`` (the engine's checks of a request, with ``max_new_tokens`` =
    its traced output), or a token id outside ``[0, vocab_size)`` (``vocab_size=None``:
    ``MAX_UNKNOWN_VOCAB``). ``limit`` names the limit in the message (default: the context length)."""
    vocab = MAX_UNKNOWN_VOCAB if vocab_size is None else vocab_size
    for r in trace:
        n_in, n_out = len(r.input_tokens), len(r.output_tokens)
        if not n_out:
            raise ValueError(f"{_where(r)}: a replay needs at least one output token")
        if n_in >= context_length or n_in + n_out > context_length:
            raise ValueError(f"{_where(r)}: prompt ({n_in} tokens) + output ({n_out} tokens) does not fit "
                             f"{limit or f'the context length {context_length}'}")
        for key, ids in (("input_tokens", r.input_tokens), ("output_tokens", r.output_tokens)):
            low, high = min(ids), max(ids)
            if low < 0 or high >= vocab:
                bad = low if low < 0 else high
                what = (f"the model's vocabulary [0, {vocab})" if vocab_size is not None else
                        f"[0, {vocab}) (the model gives no vocab_size: use a config.json that does)")
                raise ValueError(f"{_where(r)}: {key} has token id {bad}, outside {what}")


def engine_args(options: Mapping[str, Any]) -> EngineArgs:
    """The replayed engine's ``EngineArgs``: ``ValueError`` naming an option that is not one of
    ``Engine``'s (``EngineArgs.from_options``; ``replay_engine``'s own parameters are not), or
    ``model_path`` (a replay's model is the layout it is given)."""
    if "model_path" in options:
        raise ValueError("model_path: a replay's model is its layout (hyla sim --model), not an engine option")
    return EngineArgs.from_options(None, dict(options))


def engine_layout(layout: CacheLayout, args: EngineArgs) -> CacheLayout:
    """``layout`` as the engine's pools hold it: the engine loads the model in ``dtype`` (its
    default float32, whatever the checkpoint's), which is the K/V's and the conv window's dtype
    (``ModelConfig.cache_layout``; the SSM state keeps its own), and keeps the K/V in
    ``kv_cache_dtype`` where that is not ``auto``."""
    dtype = parse_dtype(args.dtype)
    return replace(layout, kv_dtype=dtype, conv_dtype=dtype).with_kv_dtype(kv_cache_torch_dtype(args.kv_cache_dtype))


def engine_running_requests(args: EngineArgs) -> int:
    """The engine's ``max_running_requests``: the one given, else (the state slots being explicit)
    as many as leave half the state slots to checkpoints, at most ``MAX_RUNNING_REQUESTS``
    (``Engine._build_pools``)."""
    return args.max_running_requests or running_requests_for_slots(args.max_state_slots, STATE_SLOTS_PER_REQUEST,
                                                                   MAX_RUNNING_REQUESTS)


def engine_context_length(args: EngineArgs, kv_tokens: int, layout: CacheLayout,
                          max_position_embeddings: int | None) -> tuple[int, str]:
    """The engine's context length (``context_length_for``: ``context_length`` if given, which must
    fit the KV pool of ``kv_tokens``; else the model's ``max_position_embeddings`` cut to the pool;
    None: the model gives none, the pool alone) and what it is, for ``check_trace``'s messages."""
    model_max = kv_tokens if max_position_embeddings is None else max_position_embeddings
    context = context_length_for(args.context_length, model_max, kv_tokens,
                                 attention=layout.num_attention_layers > 0)
    if args.context_length is not None:
        return context, f"context_length={args.context_length}: the engine would refuse it"
    if model_max < kv_tokens:
        return context, f"the model's max_position_embeddings ({model_max}): the engine would refuse it"
    return context, (f"the KV pool of {kv_tokens} tokens (max_total_tokens): the KV pool cannot hold a single such "
                     "request; raise max_total_tokens")


def waves(trace: Sequence[TraceRequest]) -> list[list[int]]:
    """The trace's requests (indices) grouped by arrival time, in arrival order (ties in trace
    order): each wave is submitted to the engine as one batch."""
    order = sorted(range(len(trace)), key=lambda i: trace[i].ts)
    return [list(wave) for _, wave in itertools.groupby(order, key=lambda i: trace[i].ts)]


def check_waves(trace: Sequence[TraceRequest], batches: Sequence[Sequence[int]], running: int,
                args: EngineArgs) -> None:
    """``ValueError`` naming the first wave larger than the engine holds at once — its running
    requests plus ``max_queued_requests`` (``Engine.max_live_requests``): the engine refuses such a
    batch whole, however long it would wait. (A replay submits a wave once the previous one has
    drained, so no smaller wave finds the queue full.)"""
    live = running + args.max_queued_requests
    for wave in batches:
        if len(wave) > live:
            raise ValueError(f"the {len(wave)} requests arriving at ts={trace[wave[0]].ts:g} (one batch) can "
                             f"never fit: the engine holds at most {live} at once (max_running_requests={running} + "
                             f"max_queued_requests={args.max_queued_requests})")


def replay_engine(trace: Sequence[TraceRequest], layout: CacheLayout, *, record: bool = False,
                  vocab_size: int | None = None, max_position_embeddings: int | None = None,
                  **options: Any) -> Replay:
    """Serve ``trace`` as ``Engine(model, **options)`` would, on accounting pools of ``layout``
    (at the engine's ``dtype`` and ``kv_cache_dtype``: ``engine_layout``). ``max_total_tokens``
    and ``max_state_slots`` must be given (there is no memory to size them from); the other engine
    options keep the engine's defaults (``max_running_requests``: ``engine_running_requests``).
    ``record``: attach a ``CacheLedger`` (``Replay.ledger``). ``vocab_size``: the model's, which
    token ids must stay below (None: ``MAX_UNKNOWN_VOCAB``). ``max_position_embeddings``: the
    model's, which bounds the context length as in the engine (None: no such bound).

    Options the engine would refuse (and keys that are not engine options), requests it would
    refuse (``check_trace``, against ``engine_context_length``) and batches it would refuse
    (``check_waves``) raise ``ValueError`` before the replay."""
    args = engine_args(options)
    if args.max_total_tokens is None or args.max_state_slots is None:
        raise ValueError("replay_engine needs max_total_tokens and max_state_slots")
    if args.speculative_algorithm is not None:
        raise ValueError("replay_engine replays no speculative decoding (its drafts depend on the outputs' timing)")
    if not trace:
        raise ValueError("replay_engine needs at least one request")
    prioritized = next((r for r in trace if r.priority), None)
    if prioritized is not None and not args.enable_priority_scheduling:
        raise ValueError(f"request (session {prioritized.session_id!r}, turn {prioritized.turn_id}) has priority "
                         f"{prioritized.priority}: replay with enable_priority_scheduling=True, or the priorities "
                         "would be ignored")
    ps = args.page_size
    running = engine_running_requests(args)
    check_state_slots(args.max_state_slots, running, STATE_SLOTS_PER_REQUEST)  # the engine's checks of its sizes
    kv_tokens = args.max_total_tokens - args.max_total_tokens % ps
    if kv_tokens < 1:
        raise ValueError(f"max_total_tokens ({args.max_total_tokens}) is less than one page ({ps} tokens)")
    context_length, limit = engine_context_length(args, kv_tokens, layout, max_position_embeddings)
    check_trace(trace, context_length, vocab_size, limit)
    batches = waves(trace)
    check_waves(trace, batches, running, args)
    context = max(len(r.input_tokens) + len(r.output_tokens) for r in trace)
    layout = engine_layout(layout, args)
    kv_pool = KVPool.from_layout(layout, kv_tokens, ps, accounting=True)
    state_pool = StatePool.from_layout(layout, args.max_state_slots, accounting=True)
    tree = None
    if args.enable_prefix_cache:
        tree = RadixCache(kv_pool, ps, state_pool=state_pool if layout.num_linear_layers else None)
    host = None  # enable_hierarchical_cache: the host tier, sized as the engine sizes it
    if args.enable_hierarchical_cache:
        host = HostCache.from_layout(layout, tree, *host_cache_sizes(args, kv_tokens, args.max_state_slots,
                                                                     layout.kv_bytes_per_token,
                                                                     layout.state_bytes_per_slot), accounting=True)
    cache = CacheManager(kv_pool, state_pool, ReqToTokenPool(running + 1, context + ps), tree,
                         checkpoint_alignment=args.checkpoint_alignment, host=host)
    ledger = CacheLedger() if record else None
    if ledger is not None:
        cache.record(ledger)
    config = SchedulerConfig.from_args(args, running, context)
    rids = [f"{r.session_id}/{r.turn_id}/{i}" for i, r in enumerate(trace)]
    outputs = dict(zip(rids, (r.output_tokens for r in trace)))
    vocab = 1 + max(max(itertools.chain(r.input_tokens, r.output_tokens)) for r in trace)  # ids checked above
    scheduler = Scheduler(config, cache, TraceRunner(outputs, vocab), OutputProcessor((), context))
    reqs: list[Req] = []
    for wave in batches:
        for i in wave:
            r = trace[i]
            req = Req(rid=rids[i], input_ids=list(r.input_tokens), checkpoints=tuple(r.boundaries),
                      speculative_checkpoints=True,  # message ends: the simulator's rule
                      sampling=SamplingParams(max_new_tokens=len(r.output_tokens), temperature=0.0, ignore_eos=True))
            req.priority = r.priority
            reqs.append(req)
            scheduler.add_request(req)
        while scheduler.step():
            pass
        if scheduler.has_work():
            raise RuntimeError("the replayed engine stalled")
    by_rid = {r.rid: r for r in reqs}
    return Replay(rids, [by_rid[rid].cached_tokens for rid in rids], scheduler, cache, ledger, layout, context_length)


__all__ = ["MAX_UNKNOWN_VOCAB", "Replay", "TraceRunner", "check_trace", "check_waves", "engine_args",
           "engine_context_length", "engine_layout", "engine_running_requests", "replay_engine", "waves"]
