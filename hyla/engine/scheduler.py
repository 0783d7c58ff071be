"""The scheduler: one step at a time, schedule → run → process.

    def step(self):
        batch = self.schedule()                   # which requests, how many tokens each
        logits = self.run(batch)                  # the model (ModelRunner)
        self.process(batch, logits)               # commit to the cache, sample, finish

A step is either a *prefill* (extend) batch — the next chunk of prompts still being prefilled,
then new requests, under a token budget of ``chunked_prefill_size`` — or a *decode* batch of every
running request. Prefill goes first whenever there is something to admit, as in SGLang; with
``mixed_chunk`` a prefill step also feeds every decoding request its next token, so that a long
prompt does not stall the running streams for its chunks' duration. Memory
is the ``CacheManager``'s (admission, allocation, commit, release: see its contract); sampling,
stop conditions and delivery are the ``OutputProcessor``'s. What stays here is policy: queue
order (longest cached prefix first; with priority scheduling, requests' priorities first), chunking,
the decode reserve, retraction and preemption.

With the overlap schedule (``SchedulerConfig.overlap``; on by default where decode steps replay CUDA graphs) a
decode step's tokens are drawn on the device and not read at once: the next step samples them,
commits, launches the decode after (fed those tokens straight from the device), and only then
reads them and does the host's per-token work while the device runs — see ``_step_overlapped``.

The hybrid cache flow for one request (``docs/engine.md``): match the longest prefix that ends at
a state checkpoint and copy that checkpoint into the request's own slot; prefill only the rest,
asking the model for the states the tree wants (chunk ends, the prompt end minus one, the branch
point of a dry-run insert, caller-given boundaries); after each prefill step insert the computed
pages and those checkpoints; when the request ends, insert its KV and its live state, so the next
turn of a conversation continues from there. With ``enable_prefix_cache=False`` there is no tree:
requests own all their KV and state (the reference side of the differential tests).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from hyla.cache import MatchResult
from hyla.cache.radix_types import namespace_key
from hyla.cache.transfer import to_device
from hyla.engine.cache_manager import CacheManager, StepCheckpoint, StepCheckpoints, match_limit
from hyla.engine.output_processor import OutputProcessor, internal_error
from hyla.engine.request import Req, ReqStatus, abort_reason
from hyla.engine.sampler import needs_processing
from hyla.engine.speculative import Drafter, verify

if TYPE_CHECKING:
    from hyla.engine.args import EngineArgs
    from hyla.engine.lora_manager import LoRAManager

logger = logging.getLogger("hyla.engine")
CONSUMER_FAILED = "the consumer of this request failed"  # the abort message of a request whose stream broke

IN_BATCH_PREFIX_THRESHOLD = 32  # defer a request whose prefix an admitted request of this step will cache
LPM_MAX_QUEUE = 128  # past this many waiting requests, LPM falls back to FCFS (matching is O(queue))


class Runner(Protocol):
    def forward_extend(self, reqs: list[Req], extend_lens: list[int], out_cache_loc: torch.Tensor,
                       ckpts: list[StepCheckpoint], all_logits: bool = False,
                       logit_rows: list[list[int]] | None = None,
                       tree_parents: list[list[int]] | None = None,
                       return_hidden: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]: ...

    def forward_decode(self, reqs: list[Req], out_cache_loc: torch.Tensor,
                       return_hidden: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]: ...

    # set when verify steps run as padded chains (compiled): each request padded to this many tokens
    verify_width: int | None
    # optional: trees of drafts run as padded trees too (forward_chains with tree_parents)
    verify_trees: bool
    # optional: a mixed step's decoding requests run as a decode step of their own (ModelRunner.decodes_apart)
    decodes_apart: bool

    def forward_chains(self, reqs: list[Req], extend_lens: list[int], out_cache_loc: torch.Tensor,
                       ckpt_rows: list[list[int]], return_hidden: bool = False,
                       tree_parents: list[list[int]] | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]: ...


@dataclass(frozen=True)
class SchedulerConfig:
    page_size: int
    chunked_prefill_size: int
    max_running_requests: int
    schedule_policy: str
    max_context_len: int = 1 << 62
    log_interval: int = 40  # decode steps between log lines (prefill steps always log at INFO)
    debug_checks: bool = False  # run every check_integrity() after every step (tests)
    prompt_logits_chunk: int = 1 << 30  # max tokens per step of a request computing prompt logprobs
    draft_max_batch: int | None = None  # speculation: no drafts in a step of more decoding requests
    overlap: bool = False  # the overlap schedule (see the module docstring; decode without speculation)
    # SGLang's --enable-mixed-chunk: a prefill step also feeds every decoding request its next token
    # (without speculation), so that a long prompt's chunks do not stall the running streams
    mixed_chunk: bool = False
    # LPM: while a request runs, an admission may not evict another waiting request's hit
    # (_hold_waiting): it waits for room instead
    protect_waiting_prefixes: bool = True
    # priority scheduling (SGLang's): waiting requests in order of priority first; a waiting request
    # that does not fit preempts running ones less urgent than it by more than the threshold
    priority_scheduling: bool = False
    low_priority_values_first: bool = False  # vLLM's convention; SGLang's default: higher is more urgent
    preemption_threshold: int = 10

    @classmethod
    def from_args(cls, args: EngineArgs, max_running_requests: int, max_context_len: int,
                  **runtime: Any) -> SchedulerConfig:
        """The scheduler's settings from the engine options (what ``Engine`` and ``hyla sim
        --engine``'s replay both build: the one place that maps the options), with the sizes
        resolved and ``runtime`` settings (the overlap schedule, the prompt-logits chunk)."""
        return cls(page_size=args.page_size, chunked_prefill_size=args.chunked_prefill_size,
                   max_running_requests=max_running_requests, schedule_policy=args.schedule_policy,
                   max_context_len=max_context_len, log_interval=args.log_interval, debug_checks=args.debug_checks,
                   draft_max_batch=args.speculative_disable_by_batch_size, mixed_chunk=args.enable_mixed_chunk,
                   protect_waiting_prefixes=args.protect_waiting_prefixes,
                   priority_scheduling=args.enable_priority_scheduling,
                   low_priority_values_first=args.schedule_low_priority_values_first,
                   preemption_threshold=args.priority_scheduling_preemption_threshold, **runtime)


@dataclass
class Batch:
    """One step's work: ``lens[i]`` tokens of ``reqs[i]`` after its ``kv_len`` (KV allocated)."""

    is_decode: bool  # one step of every decoding request (a verify step with speculation on)
    reqs: list[Req] = field(default_factory=list)
    lens: list[int] = field(default_factory=list)
    # per request: (position, speculative, requested) of each checkpoint it wants this step
    ckpt_pos: list[list[tuple[int, bool, bool]]] = field(default_factory=list)
    ckpts: StepCheckpoints = field(default_factory=StepCheckpoints)  # their slots
    out_cache_loc: list[torch.Tensor] = field(default_factory=list)  # KV slots the step writes, per allocation
    verify: bool = False  # speculative: feeds 1 + len(draft_ids) tokens per request, logits of all
    scratch: list[list[int]] = field(default_factory=list)  # verify: per request, state slot after fed token j+1
    chain_width: int = 0  # verify run as padded chains (ModelRunner.forward_chains): the tokens each was padded to
    num_cached: int = 0  # prefix tokens served by the cache to requests admitted this step
    num_mixed: int = 0  # a prefill step's last ``num_mixed`` requests decode one token each (mixed_chunk)
    # prompt logprobs: the logits rows the step returns per request (its prompt-logprob positions,
    # then its last token), set by run(); None: one row per request (its last token)
    logit_rows: list[list[int]] | None = None
    prompt_rows: list[int] = field(default_factory=list)  # per request: how many of those are prompt positions

    def add(self, req: Req, n: int, loc: torch.Tensor, ckpt_pos: list[tuple[int, bool, bool]]) -> None:
        self.reqs.append(req)
        self.lens.append(n)
        self.out_cache_loc.append(loc)
        self.ckpt_pos.append(ckpt_pos)


class Scheduler:
    # SGLang's new-token ratio: the share of each running request's remaining max_new_tokens
    # reserved before admitting more prefill; decays while decoding goes well, jumps on retraction.
    INIT_NEW_TOKEN_RATIO = 0.7
    MIN_NEW_TOKEN_RATIO = 0.1
    NEW_TOKEN_RATIO_DECAY = 0.001

    def __init__(self, config: SchedulerConfig, cache: CacheManager, runner: Runner, output: OutputProcessor,
                 drafter: Drafter | None = None, loras: LoRAManager | None = None):
        self.config = config
        self.cache = cache
        self.runner = runner
        self.output = output
        self.drafter = drafter
        self.loras = loras  # LoRA adapters' slots, given to requests as they are admitted (_take_lora_slot)
        # the first request waiting for a LoRA slot, and since when (_slot_ready)
        self.slot_waiter: tuple[Req, float] | None = None
        self.scratch: list[list[int]] = []  # per decode-batch row: state slots for the draft positions
        if drafter is not None:
            k = drafter.num_draft
            slots = cache.reserve_states(config.max_running_requests * k) if k else []
            self.scratch = [slots[i * k:(i + 1) * k] for i in range(config.max_running_requests)]
        self.waiting: list[Req] = []
        self.running: list[Req] = []  # admitted requests, in admission order (oldest first)
        # False while a weight update waits for the running requests (Engine.update_weights_from_disk):
        # only requests admitted before (retracted since) are admitted, so none mixes two weights
        self.admit_new = True
        self.weight_version = "default"  # of the weights the requests admitted now run on (meta_info)
        # the overlap schedule: a decode step launched, its logits not yet sampled
        self.inflight: tuple[Batch, torch.Tensor] | None = None
        self.new_token_ratio = self.INIT_NEW_TOKEN_RATIO
        self.num_flushes = 0  # times the prefix cache was emptied (Engine.cache_id)
        self.reset_stats()

    def reset_stats(self) -> None:
        """Zero every counter ``Engine.get_stats`` reports: the scheduler's (set here), the output
        processor's and the cache manager's (the engine's warm-up is not the user's traffic)."""
        self.num_verify_steps = 0
        self.num_accepted_tokens = 0  # draft tokens accepted
        self.num_fed_tokens = 0  # tokens verify steps fed (last sampled + drafts), summed over requests
        self.num_prompt_tokens = 0
        self.num_cached_tokens = 0
        self.num_retractions = 0
        self.num_preemptions = 0  # retractions for a more urgent waiting request (priority scheduling)
        self.num_steps = 0
        self.num_overlapped_steps = 0  # decode steps launched before the previous step's tokens were read
        self.num_mixed_tokens = 0  # decoding requests' tokens fed in prefill steps (mixed_chunk)
        self.last_gen_throughput = 0.0
        self._decode_tokens_since_log = 0
        self._last_log_time = time.monotonic()
        self.output.num_generated_tokens = self.output.num_requests_finished = 0
        self.cache.num_evicted_tokens = self.cache.num_evicted_states = 0
        self.cache.num_host_hit_tokens = 0
        if self.cache.host is not None:
            self.cache.host.reset_counters()

    # ------------------------------------------------------------------------------------------
    # the step
    # ------------------------------------------------------------------------------------------
    def step(self) -> bool:
        """Run one batch. Returns False when there was nothing to do."""
        if self.inflight is not None:
            self._step_overlapped()
        else:
            retractions = self.num_retractions
            batch = self.schedule()
            if batch is None:  # a decode that retracted every decoding request made room: go again
                return self.num_retractions != retractions or self._unstall()
            logits = self.run(batch)
            self.cache.land_host_saves()  # while the device runs the step
            if self.config.overlap and batch.is_decode and not batch.verify:
                self.inflight = (batch, logits)  # the next step samples it (_step_overlapped)
            else:
                self.process(batch, logits)
        self.num_steps += 1
        if self.config.debug_checks:
            self.check_integrity()
        return True

    def schedule(self) -> Batch | None:
        """A prefill batch if any prompt needs tokens fed, else a decode batch, else None."""
        batch = self._schedule_prefill()
        if batch is None:
            batch = self._schedule_decode()
        return batch

    def run(self, batch: Batch, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """The model forward (then the drafter's ``observe``); on failure nothing of the step stays
        allocated. ``[B, V]`` logits. ``input_ids``: a decode step's tokens on the device (the overlap
        schedule's, not yet appended to the requests)."""
        loc = torch.cat(batch.out_cache_loc) if len(batch.out_cache_loc) > 1 else batch.out_cache_loc[0]
        extra = {"return_hidden": True} if self.drafter is not None and self.drafter.wants_hidden else {}
        chain_rows = None
        try:
            if batch.verify and max(batch.lens) > 1:
                trees = [r.fed_parents() for r in batch.reqs] \
                    if any(r.draft_parents is not None for r in batch.reqs) else None
                width = getattr(self.runner, "verify_width", None)
                # padded chains (or trees, on a runner that compiled graphs of them: verify_trees)
                chains = bool(width) and (trees is None or getattr(self.runner, "verify_trees", False))
                # fed token j's state goes to scratch slot j: every one's but the last (in the request's own
                # slot); as padded chains, every one's before position width - 1 (a short chain's last too)
                ckpts = [(i, j + 1, slots[j]) for i, (n, slots) in enumerate(zip(batch.lens, batch.scratch))
                         for j in range(min(n, width - 1) if chains else n - 1)]
                if chains:  # the compiled verify: every request padded to ``width`` inside the recurrent ops
                    chain_rows = [s[:width - 1] for s in batch.scratch]
                    out = self.runner.forward_chains(batch.reqs, batch.lens, loc, chain_rows, tree_parents=trees,
                                                     **extra)
                    batch.chain_width = width
                else:
                    out = self.runner.forward_extend(batch.reqs, batch.lens, loc, ckpts, all_logits=True,
                                                     tree_parents=trees, **extra)
            elif batch.is_decode:  # also a verify step with no drafts: one token each, the decode kernels
                ckpts = []
                if input_ids is not None:
                    extra = {**extra, "input_ids": input_ids}
                out = self.runner.forward_decode(batch.reqs, loc, **extra)
            else:
                ckpts = batch.ckpts.forward
                batch.logit_rows, batch.prompt_rows = _logit_rows(batch.reqs, batch.lens)
                if batch.num_mixed and getattr(self.runner, "decodes_apart", False):
                    out = self._run_mixed_apart(batch, ckpts)
                else:
                    out = self.runner.forward_extend(batch.reqs, batch.lens, loc, ckpts,
                                                     logit_rows=batch.logit_rows, **extra)
            if self.drafter is None:
                return out
            logits, hidden = out if extra else (out, None)  # [N, V], [sum(lens), H]
            self.drafter.observe(batch.reqs, batch.lens, ckpts, hidden, chain_rows)  # before the commit: see Drafter
            return logits
        except Exception:
            for r in batch.reqs:
                r.clear_drafts()
                self.cache.rollback(r)
            self.cache.free_checkpoints(batch.ckpts)
            raise

    def _run_mixed_apart(self, batch: Batch, ckpts: list[tuple[int, int, int]]) -> torch.Tensor:
        """A mixed step on a runner whose decode steps replay CUDA graphs (``decodes_apart``): the
        prompts' tokens as an extend, then the decoding requests (the batch's last ``num_mixed``, with
        the last KV allocation) as a decode step, one replay; their logits rows after the extend's.
        The extend's logits may be an extend graph's output, in the memory pool the decode graphs
        share, which the decode replay may overwrite: they are copied first (in stream order)."""
        k = len(batch.reqs) - batch.num_mixed
        loc = batch.out_cache_loc[:-1]
        head = self.runner.forward_extend(batch.reqs[:k], batch.lens[:k], torch.cat(loc) if len(loc) > 1 else loc[0],
                                          ckpts, logit_rows=None if batch.logit_rows is None else batch.logit_rows[:k])
        head = head.clone()
        return torch.cat([head, self.runner.forward_decode(batch.reqs[k:], batch.out_cache_loc[-1])])

    def process(self, batch: Batch, logits: torch.Tensor) -> None:
        """Commit what the model computed, then sample for every request that has fed all its tokens."""
        if batch.verify:
            return self._process_verify(batch, logits)
        if batch.logit_rows is not None:  # record prompt logprobs; keep each request's last row
            last, row = [], 0
            for r, offs, prompt in zip(batch.reqs, batch.logit_rows, batch.prompt_rows):
                if prompt:
                    self.output.record_prompt_logprobs(r, logits[row:row + prompt])
                row += len(offs)
                last.append(row - 1)
            logits = logits[last]
        k = len(batch.reqs) - batch.num_mixed  # a mixed step's decoding requests commit as a decode step's do
        self.cache.commit_batch(batch.reqs[:k], batch.lens[:k], batch.ckpts.per_req[:k] or None,
                                insert=not batch.is_decode)
        if batch.num_mixed:
            self.cache.commit_batch(batch.reqs[k:], batch.lens[k:], None, insert=False)
        if not batch.is_decode:  # (a decode step passes no image)
            for r in batch.reqs[:k]:
                if r.images is not None:  # the embeddings of the images its prefill has passed
                    r.images.release(r.kv_len)
        ready = [i for i, r in enumerate(batch.reqs) if r.kv_len == r.num_fill]
        if ready:
            rows = logits if len(ready) == len(batch.reqs) else logits[ready]
            reqs = [batch.reqs[i] for i in ready]
            draw = self.output.draw(reqs, rows)
            for r in reqs:  # finished by this token whatever it is: cached while the device still samples
                if self.output.ends_with_next_token(r):
                    self.cache.release(r, insert=True)  # still running: _finish delivers it (or an error does)
            finished, failed = self.output.complete(draw)
            for r in finished:
                self._finish(r)
            for r in failed:
                self.abort(r.rid, message=CONSUMER_FAILED, cause="consumer")
        if batch.is_decode:
            self._after_decode(len(batch.reqs), len(batch.reqs))
        else:
            self._decode_tokens_since_log += batch.num_mixed
            self.num_mixed_tokens += batch.num_mixed
            self._log_prefill(len(batch.reqs) - batch.num_mixed, sum(batch.lens) - batch.num_mixed, batch.num_cached)

    # ------------------------------------------------------------------------------------------
    # the overlap schedule
    # ------------------------------------------------------------------------------------------
    def _step_overlapped(self, launch_next: bool = True) -> None:
        """Finish the decode step in flight while the device runs the next one:

        1. draw its tokens on the device (sampling kernels, no host read);
        2. commit it; release the requests it fed one token past their end (below);
        3. launch the next decode step of the same requests (:meth:`_overlap_next`), fed the drawn
           tokens on the device;
        4. read the tokens (the one sync) and do the host's per-token work — append, detokenize,
           stop checks, streams — while the device runs step 3.

        A request that step 4 finds finished (EOS, a stop string: what the host cannot know before
        reading the token) was already fed its last token by step 3. It is released when that step
        commits: it then caches its whole output, the state after its last token included — as
        exact as any other checkpoint, one token longer than without overlap. Requests that finish
        for sure on this token (``max_new_tokens``, the context) are left out of step 3."""
        batch, logits = self.inflight
        self.inflight = None
        live = [i for i, r in enumerate(batch.reqs) if not r.finished]
        draw = self.output.draw([batch.reqs[i] for i in live], logits if len(live) == len(batch.reqs)
                                else logits.index_select(0, to_device(live, torch.long, logits.device)))
        self.cache.commit_batch(batch.reqs, batch.lens, None, insert=False)
        for r in batch.reqs:
            if r.finished:  # fed once more after its last token (step 4 of the step before)
                self._finish(r)
        nxt = self._overlap_next(draw) if launch_next else None
        if nxt is not None:
            tokens = draw.tokens
            if nxt.reqs != draw.reqs:  # some finish on this token: their rows are left out
                rows = {id(r): i for i, r in enumerate(draw.reqs)}
                index = to_device([rows[id(r)] for r in nxt.reqs], torch.long, tokens.device)
                tokens = tokens.index_select(0, index)
            self.inflight = (nxt, self.run(nxt, input_ids=tokens))
            self.num_overlapped_steps += 1
        # the saves queued before the next step's kernels (the releases below queue theirs after them: landing
        # those now would wait for that step)
        self.cache.land_host_saves()
        finished, failed = self.output.complete(draw)
        held = set(nxt.reqs) if nxt is not None else set()
        for r in finished:
            if r not in held:
                self._finish(r)
        for r in failed:
            if r in held:  # released after the step that holds it
                if not r.finished:
                    self.output.set_finished(r, abort_reason(CONSUMER_FAILED, "consumer"))
            else:
                self.abort(r.rid, message=CONSUMER_FAILED, cause="consumer")
        self._after_decode(len(batch.reqs), len(live))

    def _overlap_next(self, draw) -> Batch | None:
        """The decode step after the one being sampled, allocated before its tokens are read: its
        requests minus those this token finishes for sure. None — the next step is then scheduled
        the ordinary way — when a prefill may have to go first (a waiting request), with
        speculation, or when its KV does not fit without retracting."""
        if self.waiting or self.drafter is not None or len(draw.reqs) != len(self.running):
            return None
        reqs = [r for r in draw.reqs if not self.output.ends_with_next_token(r)]
        lens = [1] * len(reqs)
        if not reqs or not self.cache.can_allocate(reqs, lens):
            return None
        return Batch(is_decode=True, reqs=reqs, lens=lens, out_cache_loc=[self.cache.allocate(reqs, lens)])

    def drain(self) -> None:
        """Finish the decode step in flight (the overlap schedule), launching nothing after it:
        before anything outside a step touches a running request (an abort)."""
        while self.inflight is not None:
            self._step_overlapped(launch_next=False)

    def _after_decode(self, batch_size: int, num_tokens: int) -> None:
        self.new_token_ratio = max(self.MIN_NEW_TOKEN_RATIO, self.new_token_ratio - self.NEW_TOKEN_RATIO_DECAY)
        self._decode_tokens_since_log += num_tokens
        if self.num_steps % self.config.log_interval == 0:
            self._log_decode(batch_size)

    def _process_verify(self, batch: Batch, logits: torch.Tensor) -> None:
        """Accept drafts (and tell the drafter how its drafts fared), append the accepted run
        (stopping at a stop condition inside it), then commit exactly the fed tokens that are now
        part of each request, all requests at once: the rest is rolled back. Fed token ``j``'s
        state is in scratch slot ``j`` (the last one's in the request's own slot; padded chains:
        every real one's in its scratch slot but a full chain's last)."""
        finished, failed, num_tokens = [], [], 0
        verdicts = verify(batch.reqs, batch.lens, logits, self.output.grammar_masks(batch.reqs, drafts=True),
                          self.output.eos_token_ids)
        self.drafter.verified(batch.reqs, verdicts)
        ns, states, paths = [], [], []
        for r, fed, v, scratch in zip(batch.reqs, batch.lens, verdicts, batch.scratch, strict=True):
            before = len(r.output_ids)
            try:
                appended = self.output.append(r, v.tokens, v.logprobs, v.top_logprobs)
            except Exception as exc:  # its own host work failed: it alone is aborted, after what it appended
                logger.exception("request %s failed on its new tokens; aborting it", r.rid)
                self.output.fail(r, exc)
                appended = len(r.output_ids) - before  # (as a stop inside the run ends it there)
            n = 1 + min(v.num_accepted, appended)
            ns.append(n)
            paths.append(v.path[:n])
            last = (batch.chain_width or fed) - 1  # the fed (or padded) token whose state is in the own slot
            states.append([scratch[j] if j < last else r.state_slot for j in v.path[:n]])
            self.num_fed_tokens += fed
            r.spec_verify_ct += 1
            r.spec_num_tokens += appended
            num_tokens += appended
            self.num_verify_steps += 1
            self.num_accepted_tokens += min(v.num_accepted, appended)
        self.cache.commit_batch(batch.reqs, ns, insert=False, states=states, paths=paths)
        for r in batch.reqs:
            r.clear_drafts()
            if r.finished:
                finished.append(r)
            elif r.stream and not self.output.deliver(r):
                failed.append(r)
        for r in finished:
            self._finish(r)
        for r in failed:
            self.abort(r.rid, message=CONSUMER_FAILED, cause="consumer")
        self._after_decode(len(batch.reqs), num_tokens)

    # ------------------------------------------------------------------------------------------
    # requests in and out
    # ------------------------------------------------------------------------------------------
    def add_request(self, req: Req) -> None:
        req.weight_version = self.weight_version  # (its first admission sets it again: a weight update may come first)
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.inflight)

    def drained(self) -> bool:
        """No request runs, is in flight, or waits having run (retracted): the waiting ones, if any,
        hold nothing of the pools or the tree and have produced nothing."""
        return not self.running and self.inflight is None and not any(r.admitted_once for r in self.waiting)

    def flush_cache(self, with_waiting: bool = False) -> bool:
        """Drop every cached prefix (``CacheManager.flush``), the images' embeddings kept (the runner's
        ``image_cache``) and the admission heuristic's memory of
        past steps, only while no request is waiting, running or in flight (SGLang's
        ``flush_cache``), or with ``with_waiting`` while the scheduler is :meth:`drained` (a weight
        update: the waiting requests will compute their prompts on the new weights): False
        otherwise, and nothing changes."""
        idle = self.drained() if with_waiting else not self.has_work()
        if not idle:
            return False
        tokens, states = self.cache.flush()
        # the vision tower's outputs by image too: a weight update flushes, and they were the old weights'
        image_cache = getattr(self.runner, "image_cache", None)
        images = image_cache.clear() if image_cache is not None else 0
        self.new_token_ratio = self.INIT_NEW_TOKEN_RATIO
        self.num_flushes += 1
        logger.info("flush_cache: dropped %d cached KV tokens, %d state checkpoints and %d images' embeddings",
                    tokens, states, images)
        return True

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def abort(self, target: str | Req, message: str = "aborted by the client", cause: str = "client") -> bool:
        """Finish the waiting or running request ``target`` (a rid, or the request itself: then only if it is
        still here, not a new request that took its rid) as aborted; whether there was one."""
        self.drain()
        for queue in (self.waiting, self.running):
            for req in queue:
                if req is target or req.rid == target:
                    self._finish(req, abort_reason(message, cause))
                    return True
        return False

    def displace(self, rid: str) -> bool:
        """Priority scheduling, a full queue: finish ``rid`` as aborted (cause ``overloaded``) to make
        room for a more urgent submission (``Engine._displaceable``), if it still waits for its first
        admission; else (admitted since) leave it, and the queue is over its limit until a request
        finishes."""
        for req in self.waiting:
            if req.rid == rid and not req.admitted_once:
                self._finish(req, abort_reason("the queue is full and a more urgent request took this one's place",
                                               "overloaded"))
                return True
        return False

    def fail_running(self, message: str) -> None:
        """After an internal error: finish every running request as aborted, releasing what it
        holds without inserting into the tree (which the error may have left inconsistent), and
        always telling its consumer — a caller must never wait forever."""
        self.inflight = None  # released below with everything else (what it allocated included)
        for req in list(self.running):
            self._end_after_error(req, message)

    def _end_after_error(self, req: Req, message: str) -> None:
        """Finish ``req`` (running or waiting) as aborted with ``message`` (cause ``internal``) after an
        error: what it holds returned without inserting into the tree, its consumer always told."""
        try:
            self.cache.release(req, insert=False)  # (nothing if it holds no row)
        except Exception:
            logger.exception("could not release request %s; dropping it", req.rid)
        if req in self.running:
            self.running.remove(req)
        try:  # a request the overlap schedule holds finished already: it keeps its reason
            self._finish(req, None if req.finished else abort_reason(message, "internal"))
        except Exception:  # (its text, say, cannot be made): it ends all the same, told so
            logger.exception("could not finish request %s; delivering it as it is", req.rid)
            self.output.deliver(req)

    def _finish(self, req: Req, reason: dict | None = None) -> None:
        """Release ``req``'s memory (caching what it computed), then deliver its last output. (A
        request this token finishes whatever it is was released before the token was read, in
        :meth:`process`, while the device sampled: its release here is a no-op.)

        ``reason``: finish it so first (an abort, a displacement). Should its text fail then
        (``OutputProcessor.set_finished`` raises, the request finished all the same, aborted with that
        error), it still ends here — released, dequeued, delivered — and nothing is raised: an abort
        comes from the engine's inbox, between steps, where no caller could end it instead."""
        if reason is not None:
            try:
                self.output.set_finished(req, reason)
            except Exception:
                logger.exception("request %s: its text failed as it finished; it ends aborted with the error", req.rid)
        req.draft_state = None  # the drafter's memory of it (n-gram index, draft budget) goes with it
        if req in self.running:
            self.cache.release(req, insert=True)
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.output.deliver(req)  # a failing consumer of a finished request is only logged

    def retract(self, req: Req, preempted_for: Req | None = None) -> None:
        """Preempt ``req``: cache what it computed, free its slots, requeue it to recompute later.
        Its output so far is kept; it resumes by prefilling prompt + output (mostly cache hits).
        ``preempted_for``: the more urgent waiting request it makes room for (priority scheduling),
        else the pool is short."""
        self.cache.release(req, insert=True)
        self.running.remove(req)
        req.clear_drafts()
        req.lora_slot = 0  # (its adapter's slot may go to another adapter: it takes one again when admitted)
        req.status = ReqStatus.WAITING
        self.num_retractions += 1
        self.waiting.insert(0, req)
        if preempted_for is None:  # admitted too much: reserve more for decoding from now on
            self.new_token_ratio = min(1.0, self.new_token_ratio + 0.3)
            logger.warning("retracted request %s (running=%d, queued=%d)", req.rid, len(self.running), len(self.waiting))
        else:
            self.num_preemptions += 1
            logger.info("preempted request %s (priority %d) for request %s (priority %d)", req.rid, req.priority,
                        preempted_for.rid, preempted_for.priority)

    # ------------------------------------------------------------------------------------------
    # prefill
    # ------------------------------------------------------------------------------------------
    def _schedule_prefill(self) -> Batch | None:
        """Continue chunked prompts first, then admit waiting requests in policy order (with
        priority scheduling, a chunked prompt less urgent than a waiting request continues after
        the admissions, with the budget they leave)."""
        cache = self.cache
        budget = self.config.chunked_prefill_size
        mixed = [r for r in self.running if r.is_decoding] if self.config.mixed_chunk else []
        if mixed:  # their tokens share the step's budget (SGLang's mixed_with_decode_tokens), a page left at least
            budget = max(self.config.page_size, budget - len(mixed))
        batch = Batch(is_decode=False)
        # 1) admitted requests whose prompt is still being prefilled in chunks
        chunking = [r for r in self.running if not r.is_decoding]
        later: list[Req] = []  # priority scheduling: those less urgent than the most urgent waiting request
        if self.config.priority_scheduling and self.waiting:
            urgent = min(map(self.rank, self.waiting))
            later = [r for r in chunking if self.rank(r) > urgent]
        budget = self._continue_chunks(batch, [r for r in chunking if r not in later], budget)
        # 2) new admissions
        if self.slot_waiter is not None and self.slot_waiter[0] not in self.waiting:
            self.slot_waiter = None  # (admitted, or ended)
        if budget > 0 and self.waiting:
            order, hits = self._ordered_waiting()
            if not self.admit_new:  # a weight update waits: only requests that ran before (retracted since)
                kept = [i for i, r in enumerate(order) if r.admitted_once]
                order, hits = [order[i] for i in kept], None if hits is None else [hits[i] for i in kept]
            protect = hits is not None and self.config.protect_waiting_prefixes
            # while some request runs (and another may join it), the waiting requests' hits are held
            held = self._hold_waiting(hits) if protect and 0 < len(self.running) < self.config.max_running_requests \
                else []
            deferred: int | None = None  # the most urgent rank deferred this step (priority scheduling)
            try:
                for i, req in enumerate(order):  # a hold keeps a prefix from evictions, not from its own request
                    if budget <= 0:
                        break
                    if deferred is not None and self.rank(req) > deferred:
                        continue  # (the queue stays strict: no less urgent request passes one deferred)
                    if self._deferred_for_in_batch_prefix(req, batch.reqs):
                        if self.config.priority_scheduling:
                            deferred = min(self.rank(req), deferred if deferred is not None else self.rank(req))
                        continue
                    slot_victims = self._slot_ready(req, batch) if req.lora_uid else []
                    if slot_victims is None:
                        continue  # (its adapter waits for a slot)
                    if len(self.running) >= self.config.max_running_requests and not self._preempt_for(req, batch):
                        break
                    try:
                        loc, n = self._admit(req, budget, bool(held))
                        while loc is None and n > 0 and self._preempt_for(req, batch, tokens=n):
                            loc, n = self._admit(req, budget, bool(held))
                        if loc is not None:  # (its images' tower run here, out of the step: a failure ends it alone)
                            self._embed_images(req, n)
                        if loc is not None and req.lora_uid:  # (once it fits: preempted, or written, for nothing else)
                            for victim in slot_victims:
                                if victim in self.running:  # (not one retracted for its seat or memory already)
                                    self.retract(victim, preempted_for=req)
                            self._take_lora_slot(req)
                    except Exception as exc:  # this request's data broke admission: it alone ends
                        self._refuse(req, exc)
                        continue
                    if loc is None:
                        break  # out of memory: keep queue order (no starvation of big requests)
                    self._on_admitted(req)
                    batch.add(req, n, loc, cache.checkpoint_positions(req, req.kv_len, req.kv_len + n))
                    batch.num_cached += req.cache_protected_len
                    budget -= n
                    if protect and len(self.running) == 1:  # the first to run: now hold those behind it
                        rest = [cache.peek(r) for r in order[i + 1:]]
                        cache.touch(rest[::-1])  # the peeks refreshed them in queue order: restore LRU's
                        held += self._hold_waiting(rest)
            finally:
                for hit in held:
                    cache.unhold(hit)
        if later:  # 3) the less urgent chunked prompts (not those the admissions preempted)
            self._continue_chunks(batch, [r for r in later if r.status is ReqStatus.RUNNING], budget)
        if not batch.reqs:
            return None
        mixed = [r for r in mixed if r.status is ReqStatus.RUNNING]  # not those preempted meanwhile
        if mixed:
            self._mix_decodes(batch, mixed)
        # released before the admitted requests' checkpoints take slots: a turn's end may still push
        # out a waiting request's older checkpoint (holding it too lost 4-6 points at alignment 64)
        batch.ckpts = cache.alloc_checkpoints(batch.reqs, batch.ckpt_pos)
        return batch

    def _continue_chunks(self, batch: Batch, reqs: list[Req], budget: int) -> int:
        """Add the next chunk of each of these admitted prompts to ``batch``, in order, while the
        budget lasts and the KV fits; returns the budget left."""
        for req in reqs:
            if budget <= 0:
                break
            n = self._chunk_len(req, budget)
            if n == 0 or not self.cache.can_allocate([req], [n]):
                break
            try:
                self._embed_images(req, n)
            except Exception as exc:  # (its images' tower failed: it alone ends)
                logger.exception("request %s: the vision tower failed; aborting it", req.rid)
                self._end_after_error(req, internal_error(exc))
                continue
            batch.add(req, n, self.cache.allocate([req], [n]),
                      self.cache.checkpoint_positions(req, req.kv_len, req.kv_len + n))
            budget -= n
        return budget

    def _embed_images(self, req: Req, n: int) -> None:
        """Run the vision tower for the images ``req``'s next ``n`` tokens reach and it has not embedded
        (``multimodal.py``), before its chunk joins a step."""
        if req.images is not None and req.images.needs_encoding(req.kv_len, req.kv_len + n):
            encode = getattr(self.runner, "encode_images", None)
            if encode is not None:
                encode(req, req.kv_len, req.kv_len + n)

    def _refuse(self, req: Req, exc: Exception) -> None:
        """Admitting ``req`` raised: finish it as aborted (cause ``internal``), returning whatever the
        admission gave it, so that it does not stay first in the queue failing every step while
        nothing behind it is ever admitted (submission refuses each known cause, as an unhashable
        namespace; this is the net under the unknown ones). Locks a failed match took on the tree
        may stay (``check_integrity`` would say so): the engine keeps serving."""
        logger.exception("admitting request %s failed; aborting it", req.rid)
        self._end_after_error(req, internal_error(exc))

    def _admit(self, req: Req, budget: int, held: bool) -> tuple[torch.Tensor | None, int]:
        """Match ``req``'s prefix and admit it with its first chunk -> (its KV slots or None, the
        chunk's length)."""
        hit = self.cache.match(req)
        n = self._chunk_len(req, budget)  # a budget too small for one page: admit next step
        reserve = self._decode_reserve()
        if held:  # room for its later chunks too: they are allocated with nothing held
            reserve += req.extend_target - n
        return self.cache.admit(req, hit, n, kv_reserve=reserve), n

    # ------------------------------------------------------------------------------------------
    # LoRA adapters' slots
    # ------------------------------------------------------------------------------------------
    def _slot_ready(self, req: Req, batch: Batch) -> list[Req] | None:
        """Whether ``req``, applying a LoRA adapter, may take a slot now (``LoRAManager.slot_for``): its adapter
        is in one, or one is empty, or one holds an adapter no running request applies (``[]``); with priority
        scheduling, once the running requests holding one are retracted for it (those: :meth:`_slot_victims`,
        retracted once ``req`` is admitted); else it waits (None). The waiting request that goes first
        (``slot_waiter``: the most urgent, then the oldest) is recorded with when waiting began. Adapter requests
        queued after that wait for it too, unless more urgent than it, whatever order the policy puts them in:
        admitting them would keep their adapters' slots busy, and a steady stream of one adapter's requests would
        starve another's. Those queued before (a bounded set) may still take a slot: queued together, each
        adapter's requests run together, in its turn."""
        waiter = self.slot_waiter
        if waiter is not None and req is not waiter[0] and req.arrival_time > waiter[1] \
                and self.rank(req) >= self.rank(waiter[0]):
            return None
        if self.loras.slot_for(req.lora_uid, self._lora_pinned()) is not None:
            return []
        victims = self._slot_victims(req, batch)
        if victims:
            return victims
        if waiter is None:
            self.slot_waiter = (req, time.monotonic())
        elif req is not waiter[0] and (self.rank(req), req.arrival_time) < (self.rank(waiter[0]), waiter[0].arrival_time):
            self.slot_waiter = (req, waiter[1])  # (it goes first; those queued since the wait began still wait)
        return None

    def _take_lora_slot(self, req: Req) -> None:
        """Give ``req``, admitted, its LoRA adapter's slot (``LoRAManager.acquire``: the adapter written into it
        where it is not there yet)."""
        slot = self.loras.acquire(req.lora_uid, self._lora_pinned())
        if slot is None:  # (_slot_ready found one, and what ran since frees slots, never takes one)
            raise RuntimeError(f"request {req.rid}: no LoRA slot, though one was free when it was checked")
        req.lora_slot = slot

    def _lora_pinned(self) -> set[int]:
        """The adapters the running requests apply: their slots are not written over."""
        return {r.lora_uid for r in self.running if r.lora_uid}

    def _slot_victims(self, req: Req, batch: Batch) -> list[Req]:
        """Priority scheduling: the running requests to retract to free a LoRA slot for ``req`` — every one
        applying the adapter in a slot, where each is less urgent than ``req`` by more than the preemption
        threshold and none is fed by this step; of such slots, the one whose most urgent request is the least
        urgent, then the one with the fewest. Empty where none may be."""
        if not self.config.priority_scheduling:
            return []
        floor = self.rank(req) + self.config.preemption_threshold
        best: tuple[tuple, int, list[Req]] | None = None
        for uid in self.loras.slot_uids():
            holders = [r for r in self.running if r.lora_uid == uid]
            if holders and all(self.rank(r) > floor and r not in batch.reqs for r in holders):
                keep = min(map(self.give_way_order, holders))
                if best is None or (keep, -len(holders)) > best[:2]:
                    best = (keep, -len(holders), holders)
        return best[2] if best is not None else []

    # ------------------------------------------------------------------------------------------
    # priority scheduling
    # ------------------------------------------------------------------------------------------
    def rank(self, req: Req) -> int:
        """Where ``req`` stands under priority scheduling: lower goes first (0 for all without it)."""
        if not self.config.priority_scheduling:
            return 0
        return req.priority if self.config.low_priority_values_first else -req.priority

    def give_way_order(self, req: Req) -> tuple:
        """The order in which requests give way (retracted, preempted, displaced from a full queue):
        the largest first — the least urgent, then the youngest (the request id breaks ties)."""
        return self.rank(req), req.arrival_time, req.rid

    def _preempt_for(self, req: Req, batch: Batch, tokens: int | None = None) -> bool:
        """Priority scheduling: retract the running request least worth keeping for ``req``, which
        waits for a running slot (``tokens=None``) or for memory (its chunk of ``tokens`` did not fit).
        Only a request whose rank is worse than ``req``'s by more than the preemption threshold, and
        not one this step already feeds, is preempted: the least urgent first, then the youngest.
        For memory, none when retracting every such request could not make the room (its KV and its
        decode reserve, an upper bound on what retracting frees). Returns whether one was retracted.

        A preempted request is retracted as for a short pool: its KV and its live state go into the
        prefix cache and it waits again, to resume from them (or recompute what was evicted since)."""
        if not self.config.priority_scheduling:
            return False
        floor = self.rank(req) + self.config.preemption_threshold
        victims = [r for r in self.running if self.rank(r) > floor and r not in batch.reqs]
        if not victims:
            return False
        if tokens is not None:
            ratio = self.new_token_ratio
            room = sum(r.kv_allocated + max(0, r.sampling.max_new_tokens - len(r.output_ids)) * ratio for r in victims)
            if room + self.cache.kv_room() < tokens + self._decode_reserve():
                return False
        self.retract(max(victims, key=self.give_way_order), preempted_for=req)
        return True

    def _mix_decodes(self, batch: Batch, reqs: list[Req]) -> None:
        """Append the decoding requests to a prefill batch, one token each, no checkpoint asked: the
        tokens a decode step would feed them, through the extend kernels. Only when their KV fits
        (evicting from the tree if needed): a mixed step retracts nothing; a decode step does that."""
        lens = [1] * len(reqs)
        if not self.cache.can_allocate(reqs, lens):
            return
        batch.out_cache_loc.append(self.cache.allocate(reqs, lens))
        batch.reqs += reqs
        batch.lens += lens
        batch.ckpt_pos += [[] for _ in reqs]
        batch.num_mixed = len(reqs)

    def _on_admitted(self, req: Req) -> None:
        self.waiting.remove(req)
        self.running.append(req)
        req.status = ReqStatus.RUNNING
        if not req.admitted_once:
            req.admitted_once = True
            req.queue_time = time.monotonic() - req.arrival_time
            req.weight_version = self.weight_version
            req.cached_tokens = req.cache_protected_len
            self.num_prompt_tokens += len(req.input_ids)
            self.num_cached_tokens += req.cache_protected_len

    def _ordered_waiting(self) -> tuple[list[Req], list[MatchResult] | None]:
        """Waiting requests in policy order, and with LPM their current hits in that order. LPM:
        longest usable cached prefix first (a host tier's counts: ``match`` loads it), FCFS among
        equals, the hits touched in reverse order so that LRU evicts the one admitted last first.
        Matches are recomputed at admission: an earlier admission may have evicted."""
        if self.config.schedule_policy != "lpm" or self.cache.tree is None or len(self.waiting) > LPM_MAX_QUEUE \
                or len(self.waiting) == 1:  # one request: no order to find (its match refreshes its hit)
            # FCFS, within each priority with priority scheduling (sorted is stable)
            return sorted(self.waiting, key=self.rank) if self.config.priority_scheduling else list(self.waiting), None
        peeked = {id(r): self.cache.peek(r) for r in self.waiting}
        cached = {id(r): self.cache.cached_len(r, peeked[id(r)]) for r in self.waiting}  # (the host tier's too)
        order = sorted(self.waiting, key=lambda r: (self.rank(r), -cached[id(r)]))
        hits = [peeked[id(r)] for r in order]
        self.cache.touch(hits[::-1])  # evict the prefix admitted last first
        return order, hits

    def _hold_waiting(self, hits: list[MatchResult | None]) -> list[MatchResult]:
        """Hold (``CacheManager.hold``: KV path and checkpoint) these hits of waiting requests
        while others are admitted, so that an admission does not evict another waiting request's
        hit (LPM, while some request runs: ``protect_waiting_prefixes``). Admitting request ``A``
        by evicting the prefix of ``B``, which waits too, trades ``B``'s hit, which it will use as
        soon as it runs, for concurrency now: ``B`` then computes that prefix again (a long agent
        history: seconds of prefill). Held, ``A`` — its first chunk, the rest of its prompt and
        the decode reserve — waits until the running requests free room (their own prefixes, once
        they finish, are not held unless a waiting request matches them) or until nothing runs:
        the caller holds nothing then, so the first admission may evict anything and the queue
        always moves. Not held: the slots the admitted requests' checkpoints take, and decode
        steps' KV. Cost: fewer requests at once when the pool is full of queued hits
        (docs/benchmarks.md, "Cache under pressure"). Returns what is held."""
        return [h for h in map(self.cache.hold, hits) if h is not None]

    def _deferred_for_in_batch_prefix(self, req: Req, admitted: list[Req]) -> bool:
        """LPM's in-batch deduplication: if a request admitted in this step shares a long prefix
        with ``req`` that the tree does not have yet (and that a hit may serve ``req``: ``match_limit``),
        admit ``req`` later, once that prefix is cached. With priority scheduling no less urgent request is
        admitted in its place that step (``_schedule_prefill``).
        Only a request of its own namespace counts: another's cache is never ``req``'s, and waiting for
        it would let one tenant's prompts delay another's (a timing signal across cache salts)."""
        if self.cache.tree is None or self.config.schedule_policy != "lpm" or not admitted:
            return False
        fill, ns = req.fill_keys, namespace_key(req.namespace)
        shared = max((_common_prefix_len(fill, other.fill_keys) for other in admitted
                      if namespace_key(other.namespace) == ns), default=0)
        # what a hit may cover of it: none of a prompt whose logprobs start at 0, which waits for nothing
        shared = min(shared, match_limit(req.num_fill, req.prompt_logits_from))
        if shared < IN_BATCH_PREFIX_THRESHOLD:
            return False
        return shared - self.cache.peek(req).kv_only_len >= IN_BATCH_PREFIX_THRESHOLD

    def _chunk_len(self, req: Req, budget: int) -> int:
        """Tokens of ``req`` to feed this step: all that remain, or a page-aligned chunk of the budget."""
        remaining = req.extend_target
        if req.prompt_logits_from is not None:  # bounds the step's [tokens, vocab] logits
            budget = min(budget, self.config.prompt_logits_chunk)
        if remaining <= budget:
            return remaining
        end = req.kv_len + budget
        end -= end % self.config.page_size  # chunk ends on a page boundary so the tree can take it
        return max(0, end - req.kv_len)

    def _decode_reserve(self) -> int:
        remaining = sum(max(0, r.sampling.max_new_tokens - len(r.output_ids)) for r in self.running)
        return int(remaining * self.new_token_ratio)

    # ------------------------------------------------------------------------------------------
    # decode
    # ------------------------------------------------------------------------------------------
    def _schedule_decode(self) -> Batch | None:
        """Every decoding request feeds its last sampled token (and, with speculation, its draft
        tokens). When KV is short even after eviction, drafts are dropped first, then the youngest
        running requests are retracted until the rest fit."""
        reqs = [r for r in self.running if r.is_decoding]
        limit = self.config.draft_max_batch
        if self.drafter is not None and reqs and (limit is None or len(reqs) <= limit):
            limits = [self._draft_limit(r) for r in reqs]
            if self.drafter.topk > 1:  # trees
                for r, tree in zip(reqs, self.drafter.propose_tree_batch(reqs, limits), strict=True):
                    r.set_drafts(*tree)
            else:
                for r, d in zip(reqs, self.drafter.propose_batch(reqs, limits), strict=True):
                    r.set_drafts(d)
        lens = [1 + len(r.draft_ids) for r in reqs]
        if reqs and max(lens) > 1 and not self.cache.can_allocate(reqs, lens):
            for r in reqs:
                r.clear_drafts()
        while reqs and not self.cache.can_allocate(reqs, [1 + len(r.draft_ids) for r in reqs]):
            victim = self._victim()
            self.retract(victim)
            if victim in reqs:
                reqs.remove(victim)
        if not reqs:
            return None
        lens = [1 + len(r.draft_ids) for r in reqs]
        loc = self.cache.allocate(reqs, lens)
        return Batch(is_decode=True, reqs=reqs, lens=lens, out_cache_loc=[loc], verify=self.drafter is not None,
                     scratch=self.scratch[:len(reqs)])

    def _draft_limit(self, req: Req) -> int:
        """Drafts that could all be used: within max_new_tokens and the context; none while the
        sampler processes the request's logits (``sampler.needs_processing``: penalties, a logit
        bias, output short of min_new_tokens)."""
        if needs_processing(req):
            return 0
        return min(req.sampling.max_new_tokens - len(req.output_ids) - 1,
                   self.config.max_context_len - req.num_fill - 1)

    def _unstall(self) -> bool:
        """Nothing could be scheduled. If requests are running, they are chunked prefills that
        wait for KV only retraction can free: retract the youngest. False when idle."""
        if not self.running:
            return False
        self.retract(self._victim())
        return True

    def _victim(self) -> Req:
        """The running request to retract when the pool is short: the youngest (of the least
        urgent, with priority scheduling)."""
        if len(self.running) == 1:
            # cannot happen for a validated request (prompt + max_new_tokens <= pool size)
            raise RuntimeError("the KV pool cannot hold a single request; raise max_total_tokens")
        return max(self.running, key=self.give_way_order)

    # ------------------------------------------------------------------------------------------
    # checks and logs (the per-step lines SGLang users know)
    # ------------------------------------------------------------------------------------------
    def check_integrity(self) -> None:
        flying = set(self.inflight[0].reqs) if self.inflight is not None else set()
        for r in self.running:
            r.check(in_flight=1 if r in flying else 0)
            if r.lora_uid and not r.lora_slot == self.loras.slot_of(r.lora_uid) > 0:
                raise AssertionError(f"req {r.rid}: LoRA slot {r.lora_slot}, its adapter's is "
                                     f"{self.loras.slot_of(r.lora_uid)}")
        self.cache.check_integrity()

    def _log_prefill(self, num_seqs: int, new_tokens: int, cached: int) -> None:
        tok_usage, state_usage = self.cache.usage()
        hit = self.num_cached_tokens / max(1, self.num_prompt_tokens)
        logger.info(
            "Prefill batch. #new-seq: %d, #new-token: %d, #cached-token: %d, cache hit rate: %.2f%%, "
            "token usage: %.2f, state usage: %.2f, #running-req: %d, #queue-req: %d",
            num_seqs, new_tokens, cached, 100 * hit, tok_usage, state_usage, len(self.running), len(self.waiting))

    def _log_decode(self, batch_size: int) -> None:
        now = time.monotonic()
        self.last_gen_throughput = self._decode_tokens_since_log / max(now - self._last_log_time, 1e-9)
        self._decode_tokens_since_log = 0
        self._last_log_time = now
        tok_usage, state_usage = self.cache.usage()
        spec = f", accept len: {self.accept_length:.2f}" if self.drafter is not None else ""
        logger.info(
            "Decode batch. #running-req: %d, token usage: %.2f, state usage: %.2f, "
            "gen throughput (token/s): %.2f, #queue-req: %d%s",
            batch_size, tok_usage, state_usage, self.last_gen_throughput, len(self.waiting), spec)

    @property
    def accept_length(self) -> float:
        """Mean output tokens per request per verify step (1 + accepted drafts), since start."""
        return 1.0 + self.num_accepted_tokens / max(1, self.num_verify_steps)


def _common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _logit_rows(reqs: list[Req], lens: list[int]) -> tuple[list[list[int]] | None, list[int]]:
    """Per request, the offsets into its fed tokens whose logits a prefill step returns: the
    positions whose logits give prompt logprobs it still needs, then its last token; and how many of
    them are those prompt positions (they come first). ``(None, [])`` when no request needs prompt
    logprobs (the runner then returns each request's last row)."""
    rows, counts = [], []
    for r, n in zip(reqs, lens):
        first = r.prompt_logits_from
        offs: list[int] = []
        if first is not None:
            lo, hi = max(first, r.kv_len), min(r.kv_len + n, len(r.input_ids) - 1)
            offs = list(range(lo - r.kv_len, hi - r.kv_len))
        counts.append(len(offs))
        if not offs or offs[-1] != n - 1:
            offs.append(n - 1)
        rows.append(offs)
    return (rows, counts) if any(counts) else (None, [])

