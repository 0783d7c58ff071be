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
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from hyla.cache import CacheLayout, CacheLedger, HostCache, KVPool, RadixCache, ReqToTokenPool, StatePool
from hyla.engine.args import EngineArgs, check_state_slots, context_length_for, host_cache_sizes, kv_cache_torch_dtype
from hyla.engine.cache_manager import CacheManager
from hyla.engine.output_processor import OutputProcessor
from hyla.engine.request import Req
from hyla.engine.sampling_params import SamplingParams
from hyla.engine.scheduler import Scheduler, SchedulerConfig
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
    scheduler and cache manager, whose counters (retractions, evictions) are the engine's."""

    rids: list[str]
    cached_tokens: list[int]
    scheduler: Scheduler
    cache: CacheManager
    ledger: CacheLedger | None


# Without a model's vocabulary size (``vocab_size=None``) token ids must stay below this: the
# runner's logits have a column per id up to the largest.
MAX_UNKNOWN_VOCAB = 1 << 20


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


def replay_engine(trace: Sequence[TraceRequest], layout: CacheLayout, *, record: bool = False,
                  vocab_size: int | None = None, **options: Any) -> Replay:
    """Serve ``trace`` as ``Engine(model, **options)`` would, on accounting pools of ``layout``.
    ``max_total_tokens`` and ``max_state_slots`` must be given (there is no memory to size them
    from); the other engine options keep their defaults (``max_running_requests``: half the state
    slots, at most 32, as on CPU). ``record``: attach a ``CacheLedger`` (``Replay.ledger``).
    ``vocab_size``: the model's, which token ids must stay below (None: ``MAX_UNKNOWN_VOCAB``).

    Options the engine would refuse, and requests it would refuse (``check_trace``; the context
    length is ``context_length``, else the KV pool), raise ``ValueError`` before the replay."""
    args = EngineArgs(**options)
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
    running = args.max_running_requests or max(1, min(args.max_state_slots // 2, 32))
    check_state_slots(args.max_state_slots, running)  # the engine's checks of its sizes
    kv_tokens = args.max_total_tokens - args.max_total_tokens % ps
    if kv_tokens < 1:
        raise ValueError(f"max_total_tokens ({args.max_total_tokens}) is less than one page ({ps} tokens)")
    context_length_for(args.context_length, kv_tokens, kv_tokens)  # (no model: no position limit to warn of)
    if args.context_length is not None:
        check_trace(trace, args.context_length, vocab_size,
                    f"context_length={args.context_length}: the engine would refuse it")
    else:  # the engine's context length is then cut to the KV pool
        check_trace(trace, kv_tokens, vocab_size, f"the KV pool of {kv_tokens} tokens (max_total_tokens): the KV "
                                                  "pool cannot hold a single such request; raise max_total_tokens")
    context = max(len(r.input_tokens) + len(r.output_tokens) for r in trace)
    layout = layout.with_kv_dtype(kv_cache_torch_dtype(args.kv_cache_dtype))  # (float8 KV: what a GiB holds)
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
    order = sorted(range(len(trace)), key=lambda i: trace[i].ts)  # stable: ties keep trace order
    for _, wave in itertools.groupby(order, key=lambda i: trace[i].ts):
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
    return Replay(rids, [by_rid[rid].cached_tokens for rid in rids], scheduler, cache, ledger)


__all__ = ["MAX_UNKNOWN_VOCAB", "Replay", "TraceRunner", "check_trace", "replay_engine"]
