"""The single-threaded scheduler: schedule → run → postprocess, one step at a time.

A step is either a *prefill* (extend) batch — new requests and the next chunk of a chunked prompt,
under a token budget of ``chunked_prefill_size`` — or a *decode* batch of every running request.
Prefill goes first whenever there is something to admit, as in SGLang.

The hybrid cache flow for one request (see docs/engine.md):

1. ``match_prefix(fill_ids[:-1])`` → the longest prefix that ends at a node holding a state
   checkpoint; KV-lock that node; copy its checkpoint into the request's own state slot
   (copy-on-write: the tree's copy is never written by a running request).
2. Prefill only the uncached suffix, reading the cached KV, and ask the model for the recurrent
   state at every position the cache will want (``checkpoint_positions``): each chunk end, the end
   of the prompt minus one, the branch point of a dry-run insert, caller-given boundaries — rounded
   down to the checkpoint grid (``lcm(page_size, checkpoint_alignment)``, 1 by default: exact).
3. After every prefill forward insert the computed KV and those checkpoints (fresh slots, never the
   live one), pick up the tree's canonical KV indices, and move the lock to the new node.
4. When the request finishes (or is retracted, or aborted), fork its live state after the last fed
   token and insert it with the KV, so the next turn of a conversation continues from there.

With ``enable_prefix_cache=False`` the same scheduler runs with no tree: requests own all their KV
and state and free them when they finish (the reference side of the differential tests).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from hyla.engine.request import Req, ReqStatus
from hyla.engine.sampler import sample

logger = logging.getLogger("hyla.engine")

IN_BATCH_PREFIX_THRESHOLD = 32  # defer a request whose prefix an admitted request of this step will cache
LPM_MAX_QUEUE = 128  # past this many waiting requests, LPM falls back to FCFS (matching is O(queue))


class Runner(Protocol):
    def forward_extend(self, reqs: list[Req], extend_lens: list[int], out_cache_loc: torch.Tensor,
                       ckpts: list[tuple[int, int, int]]) -> torch.Tensor: ...

    def forward_decode(self, reqs: list[Req], out_cache_loc: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True)
class SchedulerConfig:
    page_size: int
    chunked_prefill_size: int
    max_running_requests: int
    max_context_len: int
    schedule_policy: str
    enable_prefix_cache: bool
    checkpoint_alignment: int
    log_interval: int = 40  # decode steps between log lines (prefill steps always log at INFO)
    debug_checks: bool = False  # run every check_integrity() after every step (tests)

    @property
    def checkpoint_grid(self) -> int:
        return math.lcm(self.page_size, self.checkpoint_alignment)


@dataclass
class Stats:
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_generated_tokens: int = 0
    num_requests_finished: int = 0
    num_retractions: int = 0
    num_evicted_tokens: int = 0
    num_evicted_states: int = 0
    num_steps: int = 0
    last_gen_throughput: float = 0.0
    _decode_tokens_since_log: int = 0
    _last_log_time: float = field(default_factory=time.monotonic)


class Scheduler:
    def __init__(self, config: SchedulerConfig, runner: Runner, kv_pool: Any, state_pool: Any,
                 req_to_token: Any, tree: Any | None, eos_token_ids: list[int],
                 make_detokenizer: Any | None = None):
        self.config = config
        self.runner = runner
        self.kv_pool = kv_pool
        self.state_pool = state_pool
        self.req_to_token = req_to_token
        self.tree = tree if config.enable_prefix_cache else None
        self.eos_token_ids = set(eos_token_ids)
        # callable(req) -> IncrementalDetokenizer, or None for a model without a tokenizer
        self.make_detokenizer = make_detokenizer
        self.waiting: list[Req] = []
        self.running: list[Req] = []  # admitted requests, in admission order (oldest first)
        self.stats = Stats()
        # SGLang's new-token ratio: the share of each running request's remaining max_new_tokens
        # reserved before admitting more prefill; decays while decoding goes well, jumps on retraction.
        self.new_token_ratio = self.INIT_NEW_TOKEN_RATIO

    INIT_NEW_TOKEN_RATIO = 0.7
    MIN_NEW_TOKEN_RATIO = 0.1
    NEW_TOKEN_RATIO_DECAY = 0.001

    # ------------------------------------------------------------------------------------------
    # public
    # ------------------------------------------------------------------------------------------
    def add_request(self, req: Req) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def step(self) -> bool:
        """Run one batch. Returns False when there was nothing to do."""
        batch = self.schedule_prefill()
        if batch is not None:
            self.run_prefill(batch)
        elif any(r.is_decoding for r in self.running):
            self.run_decode()
        elif self.running:
            self._unstall()  # chunked prefills wait for KV that only retraction can free
        else:
            return False
        self.stats.num_steps += 1
        if self.config.debug_checks:
            self.check_integrity()
        return True

    def abort(self, rid: str, message: str = "aborted by the client") -> bool:
        for req in self.waiting:
            if req.rid == rid:
                self.waiting.remove(req)
                self._finish(req, {"type": "abort", "message": message}, release=False)
                return True
        for req in self.running:
            if req.rid == rid:
                self._finish(req, {"type": "abort", "message": message})
                return True
        return False

    def fail_running(self, message: str) -> None:
        """After an internal error: finish every running request as aborted, releasing what it
        holds without inserting into the tree (which the error may have left inconsistent), and
        always telling its consumer — a caller must never wait forever."""
        for req in list(self.running):
            try:
                self._release(req, insert=False)
            except Exception:
                logger.exception("could not release request %s; dropping it", req.rid)
                if req in self.running:
                    self.running.remove(req)
            self._finish(req, {"type": "abort", "message": message}, release=False)

    # ------------------------------------------------------------------------------------------
    # prefill
    # ------------------------------------------------------------------------------------------
    def schedule_prefill(self) -> "PrefillBatch | None":
        """Pick the prefill batch: continue chunked prompts first, then admit waiting requests."""
        budget = self.config.chunked_prefill_size
        batch = PrefillBatch()
        # 1) admitted requests whose prompt is still being prefilled in chunks
        for req in self.running:
            if req.is_decoding or budget <= 0:
                continue
            n = self._chunk_len(req, budget)
            pos = self.checkpoint_positions(req, req.kv_len, req.kv_len + n)
            kv_need = self._pages_tokens(req.kv_len, n)
            if n == 0 or not self._ensure_kv(batch.kv_tokens + kv_need):
                break
            batch.add(req, n, pos, kv_need)
            budget -= n
        # 2) new admissions, in policy order
        if budget > 0 and self.waiting:
            for req in self._ordered_waiting():
                if budget <= 0 or len(self.running) >= self.config.max_running_requests:
                    break
                if self._deferred_for_in_batch_prefix(req, batch.reqs):
                    continue
                n = self._admit(req, budget, batch)
                if n is None:
                    break  # out of memory: keep queue order (no starvation of big requests)
                self.waiting.remove(req)
                batch.add(req, n, self.checkpoint_positions(req, req.kv_len, req.kv_len + n),
                          self._pages_tokens(req.kv_len, n))
                batch.num_cached += req.cache_protected_len
                budget -= n
        return batch if batch.reqs else None

    def _ordered_waiting(self) -> list[Req]:
        """Waiting requests in policy order. LPM: longest usable cached prefix first (FCFS among
        equals). Matches are recomputed at admission: an earlier admission may have evicted."""
        if self.config.schedule_policy != "lpm" or self.tree is None or len(self.waiting) > LPM_MAX_QUEUE:
            return list(self.waiting)
        hits = {id(r): self._match(r).prefix_len for r in self.waiting}
        return sorted(self.waiting, key=lambda r: -hits[id(r)])

    def _match(self, req: Req) -> Any:
        key = req.fill_ids[:-1]  # the last token is always computed: its logits give the next token
        return self.tree.match_prefix(key, namespace=req.namespace)

    def _deferred_for_in_batch_prefix(self, req: Req, admitted: list[Req]) -> bool:
        """LPM's in-batch deduplication: if a request admitted in this step shares a long prefix
        with ``req`` that the tree does not have yet, admit ``req`` later, once that prefix is cached."""
        if self.tree is None or self.config.schedule_policy != "lpm" or not admitted:
            return False
        fill = req.fill_ids
        shared = max(_common_prefix_len(fill, other.fill_ids) for other in admitted)
        if shared < IN_BATCH_PREFIX_THRESHOLD:
            return False
        return shared - self._match(req).kv_only_len >= IN_BATCH_PREFIX_THRESHOLD

    def _admit(self, req: Req, budget: int, batch: "PrefillBatch") -> int | None:
        """Give ``req`` a request-table row, its own state slot (the hit's checkpoint copied in),
        and room for its first chunk, on top of what ``batch`` already claimed. Returns the chunk
        length, or None if memory is short."""
        match = self._match(req) if self.tree is not None else None
        prefix_len = match.prefix_len if match is not None else 0
        if match is not None:
            # protect the hit (its KV path and its checkpoint) while we make room by evicting
            self.tree.inc_lock_ref(match.last_node)
            if prefix_len:
                self.tree.inc_state_lock(match.last_node)
            req.branch_point = self.tree.branch_point(req.fill_ids, namespace=req.namespace)
        req.kv_len = prefix_len
        n = self._chunk_len(req, budget)
        ok = (
            n > 0  # a budget too small for one page: admit next step
            and self.req_to_token.available_size() > 0
            and self._ensure_state(1)  # its own slot; checkpoints are best effort (run_prefill)
            and self._ensure_kv(batch.kv_tokens + self._pages_tokens(prefix_len, n) + self._decode_reserve())
        )
        if ok:
            req.req_pool_idx = self.req_to_token.alloc()
            (req.state_slot,) = self.state_pool.alloc(1).tolist()
            if prefix_len:
                self.req_to_token.write(req.req_pool_idx, 0, match.kv_indices)
                self.state_pool.copy(torch.tensor([match.state_slot]), torch.tensor([req.state_slot]))
        if match is not None and prefix_len:
            self.tree.dec_state_lock(match.last_node)  # the request now has its own copy
        if not ok:
            if match is not None:
                self.tree.dec_lock_ref(match.last_node)
            req.kv_len = 0
            req.branch_point = None
            return None
        req.last_node = match.last_node if match is not None else None
        req.cache_protected_len = prefix_len
        if not req.admitted_once:
            req.cached_tokens = prefix_len
            req.admitted_once = True
            self.stats.num_prompt_tokens += len(req.input_ids)
            self.stats.num_cached_tokens += prefix_len
        req.status = ReqStatus.RUNNING
        self.running.append(req)
        return n

    def _chunk_len(self, req: Req, budget: int) -> int:
        """Tokens of ``req`` to feed this step: all that remain, or a page-aligned chunk of the budget."""
        remaining = req.extend_target
        if remaining <= budget:
            return remaining
        end = req.kv_len + budget
        end -= end % self.config.page_size  # chunk ends on a page boundary so the tree can take it
        return max(0, end - req.kv_len)

    def checkpoint_positions(self, req: Req, start: int, end: int) -> list[int]:
        """Positions p in (start, end] whose state the cache wants, rounded down to the grid."""
        grid = self.config.checkpoint_grid
        if self.tree is None:
            return []
        wanted = set(req.checkpoints)
        if end < req.num_fill:
            wanted.add(end)  # (1) chunk boundary of a chunked prefill
        wanted.add(len(req.input_ids) - 1)  # (2) end of the prompt minus one
        if req.branch_point:
            wanted.add(req.branch_point)  # (3) where a future insert branches off the tree
        out = sorted({p - p % grid for p in wanted if 0 < p <= req.num_fill})
        return [p for p in out if start < p <= end]

    def _fit_checkpoints(self, ckpt_pos: list[list[int]]) -> list[list[int]]:
        """Keep the checkpoints the state pool can hold (evicting for them if needed). Checkpoints
        only make later hits possible; fewer of them never changes an output. When short, the
        positions furthest into each prompt are kept first (they skip the most compute)."""
        wanted = sum(len(p) for p in ckpt_pos)
        if not wanted or self._ensure_state(wanted):
            return ckpt_pos
        room = self.state_pool.available_size()
        ranked = sorted(((p, i) for i, positions in enumerate(ckpt_pos) for p in positions), reverse=True)
        keep = set(ranked[:room])
        return [[p for p in positions if (p, i) in keep] for i, positions in enumerate(ckpt_pos)]

    def run_prefill(self, batch: "PrefillBatch") -> None:
        reqs, lens, ckpt_pos = batch.reqs, batch.lens, batch.ckpt_pos
        # KV for the new tokens: continue each request's last partial page first
        out_cache_loc = self.kv_pool.alloc_extend(
            [r.kv_len for r in reqs], [self._last_loc(r) for r in reqs], lens)
        offset = 0
        for r, n in zip(reqs, lens):
            self.req_to_token.write(r.req_pool_idx, r.kv_len, out_cache_loc[offset:offset + n])
            offset += n
        # fresh state slots for the checkpoints (the tree takes ownership on insert)
        ckpts: list[tuple[int, int, int]] = []  # (batch index, tokens consumed in this extend, slot)
        ckpt_owner: list[tuple[Req, int, int]] = []  # (req, absolute length, slot)
        ckpt_pos = self._fit_checkpoints(ckpt_pos)
        num_ckpt = sum(len(p) for p in ckpt_pos)
        slots = self.state_pool.alloc(num_ckpt).tolist() if num_ckpt else []
        it = iter(slots)
        for i, (r, positions) in enumerate(zip(reqs, ckpt_pos)):
            for p in positions:
                slot = next(it)
                ckpts.append((i, p - r.kv_len, slot))
                ckpt_owner.append((r, p, slot))

        try:
            logits = self.runner.forward_extend(reqs, lens, out_cache_loc, ckpts)  # [B, V]
        except Exception:
            self._free_step_allocations(out_cache_loc, slots)
            raise

        for r, n in zip(reqs, lens):
            r.kv_len += n
        by_req: dict[int, list[tuple[int, int]]] = {}
        for r, p, slot in ckpt_owner:
            by_req.setdefault(id(r), []).append((p, slot))
        done_idx = [i for i, r in enumerate(reqs) if r.kv_len == r.num_fill]
        for r in reqs:
            self._cache_unfinished(r, by_req.get(id(r), []))
        if done_idx:
            done = [reqs[i] for i in done_idx]
            self._sample_and_append(done, logits[done_idx])
        self._log_prefill(len(reqs), sum(lens), batch.num_cached)

    # ------------------------------------------------------------------------------------------
    # decode
    # ------------------------------------------------------------------------------------------
    def run_decode(self) -> None:
        reqs = [r for r in self.running if r.is_decoding]
        if not reqs:
            return
        reqs = self._make_room_for_decode(reqs)
        if not reqs:
            return
        out_cache_loc = self.kv_pool.alloc_decode([r.kv_len for r in reqs], [self._last_loc(r) for r in reqs])
        for r, loc in zip(reqs, out_cache_loc.tolist()):
            self.req_to_token.write(r.req_pool_idx, r.kv_len, torch.tensor([loc], dtype=torch.long))
        try:
            logits = self.runner.forward_decode(reqs, out_cache_loc)  # [B, V]
        except Exception:
            self._free_step_allocations(out_cache_loc, [])
            raise
        grid = self.config.checkpoint_grid
        for r in reqs:
            r.kv_len += 1
            if self.tree is not None and grid > 1 and r.kv_len % grid == 0:
                self._set_pending_checkpoint(r)
        self._sample_and_append(reqs, logits)
        self.new_token_ratio = max(self.MIN_NEW_TOKEN_RATIO, self.new_token_ratio - self.NEW_TOKEN_RATIO_DECAY)
        self.stats._decode_tokens_since_log += len(reqs)
        if self.stats.num_steps % self.config.log_interval == 0:
            self._log_decode(len(reqs))

    def _free_step_allocations(self, out_cache_loc: torch.Tensor, ckpt_slots: list[int]) -> None:
        """A forward failed: return what this step allocated. Its KV slots sit past each request's
        ``kv_len``, where releasing the request would not find them. Only the pages this step took
        are freed: a slot at page offset 0 starts a new page; the others continue a request's own
        partial page, which the request still holds."""
        new_pages = out_cache_loc[out_cache_loc % self.config.page_size == 0]
        if new_pages.numel():
            self.kv_pool.free(new_pages)
        if ckpt_slots:
            self.state_pool.free(torch.tensor(ckpt_slots))

    def _make_room_for_decode(self, reqs: list[Req]) -> list[Req]:
        """Every decoding request needs a KV slot for its next token (a new page when its last one
        is full). Evict from the tree; if still short, retract the youngest running requests."""
        ps = self.config.page_size
        while reqs and not self._ensure_kv(sum(ps for r in reqs if r.kv_len % ps == 0)):
            victim = self._youngest()
            self.retract(victim)
            if victim in reqs:
                reqs.remove(victim)
        return reqs

    def _unstall(self) -> None:
        """Only chunked prefills are running and none could get KV: retract the youngest."""
        self.retract(self._youngest())

    def _youngest(self) -> Req:
        if len(self.running) == 1:
            # cannot happen for a validated request (prompt + max_new_tokens <= pool size)
            raise RuntimeError("the KV pool cannot hold a single request; raise max_total_tokens")
        return max(self.running, key=lambda r: (r.arrival_time, r.rid))

    def retract(self, req: Req) -> None:
        """Preempt ``req``: cache what it computed, free its slots, requeue it to recompute later.
        Its output so far is kept; it resumes by prefilling prompt + output (mostly cache hits)."""
        self._release(req, insert=True)
        req.status = ReqStatus.WAITING
        self.stats.num_retractions += 1
        self.waiting.insert(0, req)
        self.new_token_ratio = min(1.0, self.new_token_ratio + 0.3)
        logger.warning("retracted request %s (running=%d, queued=%d)", req.rid, len(self.running), len(self.waiting))

    # ------------------------------------------------------------------------------------------
    # sampling and finishing
    # ------------------------------------------------------------------------------------------
    def _sample_and_append(self, reqs: list[Req], logits: torch.Tensor) -> None:
        to_sample = [i for i, r in enumerate(reqs) if len(r.output_ids) < r.sampling.max_new_tokens]
        for i, r in enumerate(reqs):
            if i not in to_sample:  # max_new_tokens == 0: prefill only
                self._finish(r, {"type": "length", "length": r.sampling.max_new_tokens})
        if not to_sample:
            return
        sreqs = [reqs[i] for i in to_sample]
        out = sample(logits[to_sample], sreqs)
        for r, tok, lp, top in zip(sreqs, out.token_ids, out.logprobs, out.top_logprobs):
            r.output_ids.append(tok)
            text = r.text
            if self.make_detokenizer is not None:
                if r.detokenizer is None:
                    r.detokenizer = self.make_detokenizer(r)
                text += r.detokenizer.step(tok)
            if r.return_logprob:
                r.output_logprobs.append(lp)
                r.output_top_logprobs.append(top)
            self.stats.num_generated_tokens += 1
            reason = self._check_finished(r, text)
            if reason is not None:
                self._finish(r, reason)
            else:
                self._notify(r, False)

    def _notify(self, req: Req, done: bool) -> None:
        """Hand ``req``'s progress to its consumer. A consumer that fails (e.g. its asyncio loop is
        closed) loses its request, and only that: the request is aborted, the engine goes on."""
        if req.on_output is None:
            return
        try:
            req.on_output(req, done)
        except Exception:
            logger.warning("the consumer of request %s failed; aborting it", req.rid, exc_info=True)
            if not done:  # the abort notifies once more (done=True); a failure there is only logged
                self.abort(req.rid, message="the consumer of this request failed")

    def _check_finished(self, req: Req, text: str) -> dict[str, Any] | None:
        """Why ``req`` stops after its newest token, or None. ``text`` is the output text with that
        token; it becomes ``req.text`` here, cut before a stop string, so a stream reading
        ``req.text`` concurrently never sees any part of a stop string."""
        tok = req.output_ids[-1]
        p = req.sampling
        if tok in p.stop_token_ids:
            return {"type": "stop", "matched": tok}
        if not p.ignore_eos and tok in self.eos_token_ids:
            return {"type": "stop", "matched": tok}
        if p.stop and req.detokenizer is not None:
            # only the tail can hold a new match: the text before it was checked on earlier tokens
            start = max(0, req.num_checked_chars - max(len(s) for s in p.stop) + 1)
            hits = [(pos, s) for s in p.stop if (pos := text.find(s, start)) >= 0]
            req.num_checked_chars = len(text)
            if hits:
                pos, s = min(hits)
                req.text = text[:pos]
                return {"type": "stop", "matched": s}
        req.text = text
        if len(req.output_ids) >= p.max_new_tokens:
            return {"type": "length", "length": p.max_new_tokens}
        if req.num_fill >= self.config.max_context_len:
            return {"type": "length", "length": len(req.output_ids)}
        return None

    def _finish(self, req: Req, reason: dict[str, Any], release: bool = True) -> None:
        req.finished_reason = reason
        if req.detokenizer is not None and not isinstance(reason.get("matched"), str):
            req.text += req.detokenizer.flush()  # what was held back for an unfinished character
        if release:
            self._release(req, insert=True)
        req.status = ReqStatus.FINISHED
        self.stats.num_requests_finished += 1
        self._notify(req, True)

    # ------------------------------------------------------------------------------------------
    # cache flow
    # ------------------------------------------------------------------------------------------
    def _cache_unfinished(self, req: Req, ckpts: list[tuple[int, int]]) -> None:
        """After a prefill forward: hand the computed whole pages and the checkpoints to the tree."""
        if self.tree is None:
            return
        end = req.kv_len - req.kv_len % self.config.page_size
        self._insert_and_relock(req, end, ckpts)

    def _insert_and_relock(self, req: Req, end: int, ckpts: list[tuple[int, int]]) -> None:
        row = req.req_pool_idx
        kv = self.req_to_token.read(row, 0, end)
        res = self.tree.insert(req.fill_ids[:end], kv, checkpoints=ckpts, namespace=req.namespace)
        # the tree may have freed our duplicates: point the row at the tree's canonical slots
        self.req_to_token.write(row, 0, res.kv_indices)
        self.tree.inc_lock_ref(res.last_node)
        if req.last_node is not None:
            self.tree.dec_lock_ref(req.last_node)
        req.last_node = res.last_node
        req.cache_protected_len = end

    def _set_pending_checkpoint(self, req: Req) -> None:
        if not self._ensure_state(1):
            return
        (slot,) = self.state_pool.fork(torch.tensor([req.state_slot])).tolist()
        if req.pending_ckpt is not None:
            self.state_pool.free(torch.tensor([req.pending_ckpt[1]]))
        req.pending_ckpt = (req.kv_len, slot)

    def _release(self, req: Req, insert: bool) -> None:
        """Return everything ``req`` holds; with a tree, first insert what it computed (KV + a
        forked checkpoint of its live state) so that a later request can continue from it."""
        row = req.req_pool_idx
        if row is None:
            return
        if self.tree is not None:
            ckpts: list[tuple[int, int]] = []
            grid = self.config.checkpoint_grid
            end = req.kv_len - req.kv_len % self.config.page_size
            if insert and req.kv_len % grid == 0 and req.kv_len > 0 and self._ensure_state(1):
                (slot,) = self.state_pool.fork(torch.tensor([req.state_slot])).tolist()
                ckpts.append((req.kv_len, slot))  # (4) the live state after the last fed token
            elif insert and req.pending_ckpt is not None and req.pending_ckpt[0] <= end:
                ckpts.append(req.pending_ckpt)
                req.pending_ckpt = None
            if req.pending_ckpt is not None:
                self.state_pool.free(torch.tensor([req.pending_ckpt[1]]))
                req.pending_ckpt = None
            if insert and end > 0:
                self._insert_and_relock(req, end, ckpts)
            elif ckpts:
                self.state_pool.free(torch.tensor([s for _, s in ckpts]))
            tail = self.req_to_token.read(row, req.cache_protected_len, req.kv_len)
            if tail.numel():
                self.kv_pool.free(tail)
            if req.last_node is not None:
                self.tree.dec_lock_ref(req.last_node)
        else:
            kv = self.req_to_token.read(row, 0, req.kv_len)
            if kv.numel():
                self.kv_pool.free(kv)
        self.state_pool.free(torch.tensor([req.state_slot]))
        self.req_to_token.free(row)
        req.req_pool_idx = None
        req.state_slot = None
        req.last_node = None
        req.kv_len = 0
        req.cache_protected_len = 0
        if req in self.running:
            self.running.remove(req)

    # ------------------------------------------------------------------------------------------
    # memory
    # ------------------------------------------------------------------------------------------
    def _pages_tokens(self, kv_len: int, n: int) -> int:
        """KV slots an extend of n tokens after kv_len takes from the allocator (whole pages)."""
        ps = self.config.page_size
        return (math.ceil((kv_len + n) / ps) - math.ceil(kv_len / ps)) * ps

    def _last_loc(self, req: Req) -> int:
        if req.kv_len == 0:
            return -1
        return int(self.req_to_token.read(req.req_pool_idx, req.kv_len - 1, req.kv_len)[0])

    def _decode_reserve(self) -> int:
        remaining = sum(max(0, r.sampling.max_new_tokens - len(r.output_ids)) for r in self.running)
        return int(remaining * self.new_token_ratio)

    def _ensure_kv(self, num_tokens: int) -> bool:
        avail = self.kv_pool.available_size()
        if avail < num_tokens and self.tree is not None:
            self.stats.num_evicted_tokens += self.tree.evict(num_tokens - avail)
            avail = self.kv_pool.available_size()
        return avail >= num_tokens

    def _ensure_state(self, num_slots: int) -> bool:
        avail = self.state_pool.available_size()
        if avail < num_slots and self.tree is not None:
            self.stats.num_evicted_states += self.tree.evict_state(num_slots - avail)
            avail = self.state_pool.available_size()
        return avail >= num_slots

    def check_integrity(self) -> None:
        for r in self.running:
            r.check()
        self.kv_pool.check_integrity()
        self.state_pool.check_integrity()
        if self.tree is not None:
            self.tree.check_integrity()

    # ------------------------------------------------------------------------------------------
    # logging (the per-step line SGLang users know)
    # ------------------------------------------------------------------------------------------
    def usage(self) -> tuple[float, float]:
        kv_total = self.kv_pool.size
        st_total = self.state_pool.size
        kv_used = kv_total - self.kv_pool.available_size()
        st_used = st_total - self.state_pool.available_size()
        return kv_used / max(1, kv_total), st_used / max(1, st_total)

    def _log_prefill(self, num_seqs: int, new_tokens: int, cached: int) -> None:
        tok_usage, state_usage = self.usage()
        hit = self.stats.num_cached_tokens / max(1, self.stats.num_prompt_tokens)
        logger.info(
            "Prefill batch. #new-seq: %d, #new-token: %d, #cached-token: %d, cache hit rate: %.2f%%, "
            "token usage: %.2f, state usage: %.2f, #running-req: %d, #queue-req: %d",
            num_seqs, new_tokens, cached, 100 * hit, tok_usage, state_usage, len(self.running), len(self.waiting))

    def _log_decode(self, batch_size: int) -> None:
        now = time.monotonic()
        dt = now - self.stats._last_log_time
        self.stats.last_gen_throughput = self.stats._decode_tokens_since_log / max(dt, 1e-9)
        self.stats._decode_tokens_since_log = 0
        self.stats._last_log_time = now
        tok_usage, state_usage = self.usage()
        logger.info(
            "Decode batch. #running-req: %d, token usage: %.2f, state usage: %.2f, "
            "gen throughput (token/s): %.2f, #queue-req: %d",
            batch_size, tok_usage, state_usage, self.stats.last_gen_throughput, len(self.waiting))


@dataclass
class PrefillBatch:
    reqs: list[Req] = field(default_factory=list)
    lens: list[int] = field(default_factory=list)  # tokens fed per request this step
    ckpt_pos: list[list[int]] = field(default_factory=list)  # absolute checkpoint positions per request
    num_cached: int = 0  # prefix tokens served by the cache to requests admitted this step
    kv_tokens: int = 0  # KV slots this batch will allocate (claimed before run_prefill allocates)

    @property
    def num_ckpt(self) -> int:
        return sum(len(p) for p in self.ckpt_pos)

    def add(self, req: Req, n: int, ckpt_pos: list[int], kv_tokens: int) -> None:
        self.reqs.append(req)
        self.lens.append(n)
        self.ckpt_pos.append(ckpt_pos)
        self.kv_tokens += kv_tokens


def _common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
