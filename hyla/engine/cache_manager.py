"""The cache manager: the one owner of the KV pool, the state pool, the request table and the tree.

The scheduler decides *which* requests run and how many tokens each feeds; this class does every
memory operation that decision implies, at request level, and is the only engine code that calls
the pools or the tree (nano-vllm's ``can_allocate`` / ``allocate`` pairs; mini-sglang's
``CacheManager``). One request's life::

    hit = cache.match(req)                 # longest cached prefix; KV lock + state lock on it
    loc = cache.admit(req, hit, n, reserve)  # own row + own state slot (checkpoint copied) + KV for n;
                                             # None: the locks are dropped, nothing is held
    slots = cache.alloc_checkpoints(...)   # best effort: fresh slots for the states the tree wants
    # ... the model runs: it reads/writes the request's row, its state slot, the checkpoint slots
    cache.commit(req, n, ckpts, insert)    # kv_len += n; computed pages + checkpoints into the tree;
                                           # fed but not committed (rejected drafts): rolled back
                                           # (commit_batch: a whole step's requests, copies batched)
    cache.allocate([req], [k])             # the next step: KV for k more tokens (decode: k = 1)
    cache.rollback(req)                    # a failed step: free KV allocated past kv_len
    cache.release(req, insert=True)        # finish / retract; abort of a running request too

Ownership and locks — the whole contract:

* A running request owns one request-table row (``req.req_pool_idx``), one state slot
  (``req.state_slot``: the recurrent state after exactly ``req.kv_len`` tokens; the model updates
  it in place) and the KV slots of its row at positions ``[req.cache_protected_len,
  req.kv_allocated)`` together with the rest of the last page they touch.
* The tree owns the row's first ``req.cache_protected_len`` KV slots (always whole pages) and
  every checkpoint slot it was given. The request holds a KV lock on ``req.last_node``, the node
  ending at ``cache_protected_len``: nothing on its path to the root can be evicted. A state lock
  is held on a hit's checkpoint only from ``match`` until ``admit`` has copied it (copy-on-write:
  the tree's slots are never written by a running request).
* ``hold`` locks a *waiting* request's hit (the KV of its path and its checkpoint, as ``match``
  does) while the scheduler admits others and takes their checkpoints' slots; it ``unhold``s
  every hit at the end of that step's scheduling: between steps nothing is held. A held hit still
  serves its own request's ``match`` (locks count).
* Checkpoint slots the tree is given are always *forked* (fresh copies), never a live slot.
  ``insert`` adopts them or frees them as duplicates; either way the caller stops owning them.
* ``req.pending_ckpt`` (grid > 1 only): a forked copy of the live state at the last position on
  the checkpoint grid that a request passed while decoding, held outside the tree until release.
* Between steps ``kv_allocated == kv_len``: a step's allocations are committed or rolled back.
* ``reserve_states`` / ``reserve_kv`` take slots for good (speculative decoding's scratch states,
  the MTP and draft-model drafters' scratch KV and drafting states): neither the tree nor any
  request owns them.
* With a host tier (``host``, a ``HostCache``), what the tree evicts is copied into host memory
  first (the tree's ``on_evict`` hook), and ``match`` loads a longer prefix the host holds into
  fresh device slots and the tree before it locks the hit: the host's slots are never a request's.
* Eviction happens only here, only of unlocked tree entries, and only when an allocation needs
  the room (``_ensure_kv`` / ``_ensure_state``; KV and admissions evict nothing when even
  evicting everything unlocked could not make the room, checkpoints are best effort and keep what
  fits; ``_evict_superseded_by`` for a checkpoint the request's own new one supersedes); with the
  prefix cache off there is no tree, every slot is the request's own and is freed on release.
"""

from __future__ import annotations

import contextlib
import logging
import math
from dataclasses import dataclass, field
from typing import ContextManager, Sequence

import torch

from hyla.cache import (CacheLayout, CacheLedger, CachedPrefix, Checkpoint, HostCache, KVPool, MatchResult, RadixCache,
                        ReqToTokenPool, StatePool)
from hyla.engine.request import Req, prompt_logits_start

logger = logging.getLogger("hyla.engine")

StepCheckpoint = tuple[int, int, int]  # (batch index, tokens of this step consumed, state slot)

# what an eviction made room for, and which checkpoints found no room (the ledger's labels)
ADMISSION_KV = "an admission's KV"
ADMISSION_STATE = "an admission's own state"
GROWTH = "running requests' next tokens"
BRANCH_CHECKPOINT = "a branch-point checkpoint"
SPECULATIVE_CHECKPOINT = "a speculative checkpoint"
PENDING_CHECKPOINT = "a pending decode checkpoint"
FINISH_CHECKPOINT = "a finish checkpoint"
HOST_LOAD = "a prefix loaded from the host tier"
IMPORT = "an imported prefix (import_prefix)"
NO_CACHE_TO_IMPORT_INTO = "the prefix cache is off (enable_prefix_cache=False): there is no cache to import into"


@dataclass
class StepCheckpoints:
    """Checkpoint slots for one step: the model's form (``forward``) and the owner of each."""

    forward: list[StepCheckpoint] = field(default_factory=list)
    per_req: list[list[Checkpoint]] = field(default_factory=list)  # per request: (length, slot, speculative)

    @property
    def slots(self) -> list[int]:
        return [s for _, _, s in self.forward]


def match_limit(num_tokens: int, logits_from: int | None) -> int:
    """How many of a prompt's ``num_tokens`` a cache hit may cover: the last token is always computed
    (its logits give the next token); a request that wants prompt logprobs recomputes from
    ``logits_from``, the first position whose logits it needs (``request.prompt_logits_start``)."""
    return num_tokens - 1 if logits_from is None else min(num_tokens - 1, logits_from)


def new_request_match_limit(num_tokens: int, logprob_start_len: int = -1) -> int:
    """``match_limit`` of a request not started yet: a prompt of ``num_tokens`` (at least 1), prompt logprobs
    from ``logprob_start_len`` (-1: none), as ``Engine.generate`` takes them."""
    return max(match_limit(num_tokens, prompt_logits_start(num_tokens, logprob_start_len)), 0)


class CacheManager:
    def __init__(self, kv_pool: KVPool, state_pool: StatePool, req_to_token: ReqToTokenPool,
                 tree: RadixCache | None, checkpoint_alignment: int = 1, host: HostCache | None = None) -> None:
        if host is not None and (tree is None or host.device_tree is not tree):
            raise ValueError("a host tier needs the prefix cache: the tree it keeps evicted prefixes of")
        self.kv_pool = kv_pool
        self.state_pool = state_pool
        self.req_to_token = req_to_token
        self.tree = tree
        # whether the tree keeps state checkpoints: not for a model with no linear layer (KV alone, every prefix
        # usable; its requests' state slots hold nothing)
        self.checkpoints = tree is not None and tree.state_pool is not None
        self.host = host  # the host tier under the tree (hierarchical cache), or None
        self.page_size = kv_pool.page_size
        # checkpoints only at multiples of the grid: the tree shares whole pages only
        self.grid = math.lcm(self.page_size, checkpoint_alignment)
        self.num_evicted_tokens = 0
        self.num_evicted_states = 0
        # prompt tokens the host tier added past the device's hits, at first admissions (a subset of the
        # scheduler's num_cached_tokens: a re-admission after a retraction counts in neither)
        self.num_host_hit_tokens = 0
        self._host_hits: dict[int, int] = {}  # id(req) -> what its match loaded, until its admission
        self.num_reserved_states = 0  # slots held for good (reserve_states)
        self.num_reserved_tokens = 0  # KV slots held for good, whole pages (reserve_kv)
        self.ledger: CacheLedger | None = None  # see record()
        self._holds: dict[int, tuple[MatchResult, bool]] = {}  # id -> a hit held (hold), its checkpoint locked too

    def record(self, ledger: CacheLedger) -> None:
        """From now on tell ``ledger`` (and have the tree tell it) every eviction and what it made
        room for, every checkpoint dropped for want of room, every admission's hit and every
        release (``hyla.cache.ledger``: what explains a lost hit)."""
        self.ledger = ledger
        if self.tree is not None:
            self.tree.ledger = ledger

    def _because(self, cause: str) -> ContextManager[None]:
        return self.ledger.because(cause) if self.ledger is not None else contextlib.nullcontext()

    def _dropped(self, req: Req, position: int, what: str) -> None:
        if self.ledger is not None:
            self.ledger.dropped(req.fill_keys, position, what, req.namespace)

    # ------------------------------------------------------------------------------------------
    # admission
    # ------------------------------------------------------------------------------------------
    def touch(self, hits: Sequence[MatchResult | None]) -> None:
        """The waiting queue will use these prefixes in this order: refresh their recency (KV path
        and checkpoint) so that under LRU the one needed last is evicted first (``RadixCache.touch``)."""
        if self.tree is not None:
            for hit in hits:
                if hit is not None and hit.prefix_len:
                    self.tree.touch(hit.last_node)

    def hold(self, hit: MatchResult | None) -> MatchResult | None:
        """Lock ``hit`` — a waiting request's cached prefix: the KV of its path and the checkpoint
        it ends at — so that no eviction takes it until ``unhold(hit)``: what the scheduler does to
        the waiting requests' hits while it admits others (``SchedulerConfig.protect_waiting_prefixes``).
        Returns the hit held, or None where there is nothing to hold (no hit, or an empty one)."""
        if self.tree is None or hit is None or not hit.prefix_len:
            return None
        self.tree.inc_lock_ref(hit.last_node)
        state = hit.last_node.state is not None  # the checkpoint the hit restores (a tree with a state pool)
        if state:
            self.tree.inc_state_lock(hit.last_node)
        self._holds[id(hit)] = (hit, state)
        return hit

    def unhold(self, hit: MatchResult | None) -> None:
        """Undo ``hold(hit)`` (None: nothing was held)."""
        if hit is not None:
            _, state = self._holds.pop(id(hit))
            if state:
                self.tree.dec_state_lock(hit.last_node)
            self.tree.dec_lock_ref(hit.last_node)

    def _held_only(self) -> int:
        """KV tokens in the tree that only holds lock (waiting requests' prefixes, no running
        request's path): cached, not running requests' (the ledger's usage samples)."""
        cover: dict[int, list] = {}  # id(node) -> [node, holds covering it]
        for hit, _ in self._holds.values():
            node = hit.last_node
            while node is not self.tree.root:
                cover.setdefault(id(node), [node, 0])[1] += 1
                node = node.parent
        return sum(len(node.key) for node, n in cover.values() if node.lock_ref == n)

    def peek(self, req: Req) -> MatchResult | None:
        """The current hit for ``req`` without locking anything (for ordering the queue)."""
        if self.tree is None:
            return None
        return self.tree.match_prefix(req.fill_keys[:self._match_limit(req)], namespace=req.namespace)

    def cached_len(self, req: Req, hit: MatchResult | None) -> int:
        """The prefix ``req`` would find cached, given its device ``hit`` (``peek``): the longer of
        that and the host tier's (which ``match`` would load), changing nothing. For ranking the
        waiting queue (LPM)."""
        device = hit.prefix_len if hit is not None else 0
        if self.host is None:
            return device
        return max(device, self.host.tree.usable_len(req.fill_keys[:self._match_limit(req)], req.namespace))

    @staticmethod
    def _match_limit(req: Req) -> int:
        """How many of ``req``'s tokens a hit may cover (``match_limit``)."""
        return match_limit(req.num_fill, req.prompt_logits_from)

    def match(self, req: Req) -> MatchResult | None:
        """Find ``req``'s cached prefix and protect it (KV lock on the path, state lock on the
        checkpoint) until ``admit``. Sets ``req.kv_len`` to the hit and ``req.branch_point``. With
        a host tier, a longer prefix there is loaded into the device tree first (``_load_from_host``)."""
        hit = self.peek(req)
        if self.host is not None:
            self._host_hits.pop(id(req), None)  # (a match that was never admitted)
            hit = self._load_from_host(req, hit)
        req.kv_len = req.kv_allocated = hit.prefix_len if hit is not None else 0
        if hit is not None:
            self.tree.inc_lock_ref(hit.last_node)
            if hit.prefix_len and self.checkpoints:
                self.tree.inc_state_lock(hit.last_node)
            req.branch_point = self.tree.branch_point(req.fill_keys, namespace=req.namespace)
        return hit

    def admit(self, req: Req, hit: MatchResult | None, n: int, kv_reserve: int = 0) -> torch.Tensor | None:
        """Give ``req`` a request-table row, its own state slot holding the hit's checkpoint, and
        KV for its first ``n`` tokens, keeping ``kv_reserve`` more KV slots free (evicting if
        needed); returns those ``n`` KV slots. On failure (None) nothing is held and the hit's
        locks are dropped."""
        prefix_len = hit.prefix_len if hit is not None else 0
        kv_needed = self._kv_tokens([prefix_len], [n]) + kv_reserve
        ok = (
            n > 0
            and self.req_to_token.can_alloc(1)
            and self._could_free(kv_needed, 1)  # evict nothing for an admission that cannot happen
            and self._ensure_state(1, cause=ADMISSION_STATE)  # its own slot; checkpoints are best effort
            and self._ensure_kv(kv_needed, cause=ADMISSION_KV)
        )
        if ok:
            req.req_pool_idx = self.req_to_token.alloc()
            (req.state_slot,) = self.state_pool.alloc(1, zero=not prefix_len).tolist()  # a hit copies into it
            if prefix_len:
                self.req_to_token.write(req.req_pool_idx, 0, hit.kv_indices)
                if self.checkpoints:
                    self.state_pool.copy(torch.tensor([hit.state_slot]), torch.tensor([req.state_slot]))
        loaded = self._host_hits.pop(id(req), 0)
        if ok and not req.admitted_once:  # a prompt's first admission, as ``cached_tokens`` counts it
            self.num_host_hit_tokens += loaded
        if hit is not None and prefix_len and self.checkpoints:
            self.tree.dec_state_lock(hit.last_node)  # the request has its own copy now
        if not ok:
            if hit is not None:
                self.tree.dec_lock_ref(hit.last_node)
            req.kv_len = req.kv_allocated = 0
            req.branch_point = None
            return None
        req.last_node = hit.last_node if hit is not None else None
        req.cache_protected_len = prefix_len
        if self.ledger is not None:
            self.ledger.admitted(req.rid, req.fill_keys, prefix_len, hit.kv_only_len if hit is not None else 0,
                                 req.namespace)
        return self.allocate([req], [n])

    def _load_from_host(self, req: Req, hit: MatchResult) -> MatchResult:
        """Where the host tier holds a longer usable prefix of ``req`` than the device tree's ``hit``,
        copy what the device lacks of it — the KV past the device's KV match, and the checkpoint —
        into fresh device slots (evicting unlocked device entries for them, as an admission does) and
        insert them into the device tree; returns the device's hit then. Where the device cannot
        make the room, the host's prefix is not used."""
        tokens = req.fill_keys[:self._match_limit(req)]
        host_hit = self.host.match(tokens, req.namespace)
        if host_hit is None:
            return hit
        end = host_hit.prefix_len
        if end <= hit.prefix_len:
            self.host.unlock(host_hit)
            return hit
        try:
            if self._adopt(tokens[:end], req.namespace, hit, lambda start, kv, slot: self.host.load(
                    host_hit, start, kv, slot), cause=HOST_LOAD):
                self._host_hits[id(req)] = end - hit.prefix_len  # counted if the admission succeeds
        except Exception:  # (a copy out of memory): nothing leaked (_adopt), the device's own hit stands
            logger.exception("loading request %s's prefix from the host tier failed; it runs on the device's hit",
                             req.rid)
        finally:
            self.host.unlock(host_hit)
        return self.peek(req)

    def _adopt(self, tokens: Sequence[int], namespace, hit: MatchResult, fill, cause: str) -> bool:
        """Put the prefix ``tokens`` (page-aligned, with its state at its end) into the tree, where the
        tree's ``hit`` on it is shorter: fresh slots for the KV past the tree's KV match and for the
        checkpoint (evicting unlocked entries for them, as an admission does), written by ``fill(start,
        kv_slots, state_slot)`` — the prefix's KV of positions ``[start, len(tokens))`` and its state —
        then inserted. False (nothing changed) where the room cannot be made."""
        end = len(tokens)
        start = min(hit.kv_only_len, end)  # the tree holds the prefix's KV up to here
        device_kv = hit.kv_only_indices[:start]
        states = 1 if self.tree.state_pool is not None else 0
        self.tree.inc_lock_ref(hit.kv_only_node)  # the tree's part stays while room is made
        try:
            if not (self._ensure_kv(end - start, cause=cause) and (not states or self._ensure_state(1, cause=cause))):
                return False
            kv = self.kv_pool.alloc(end - start) if end > start else torch.zeros(0, dtype=torch.int64)
            slot = int(self.state_pool.alloc(1, zero=False)[0]) if states else None
            try:
                fill(start, kv, slot)
            except BaseException:  # (a copy out of memory): the tree's own hit stands, nothing leaked
                self.kv_pool.free(kv)
                if slot is not None:
                    self.state_pool.free([slot])
                raise
            self.tree.insert(tokens, torch.cat([device_kv, kv]), [(end, slot)] if states else [], namespace=namespace)
            return True
        finally:
            self.tree.dec_lock_ref(hit.kv_only_node)

    # ------------------------------------------------------------------------------------------
    # prefixes moved between engines (hyla/cache/prefix_transfer.py)
    # ------------------------------------------------------------------------------------------
    def export_prefix(self, tokens: Sequence[int], namespace, layout: CacheLayout,
                      kv_from: int = 0) -> CachedPrefix | None:
        """A copy of the cached prefix a request for ``tokens`` would hit — the longest usable prefix of
        all of them but the last (whose logits a request computes), the device tree's or, longer, the
        host tier's — or None where nothing is cached; its KV from position ``kv_from`` on only (the
        last token's at least: ``CachedPrefix.drop_kv_before``). ``layout``: the pools' (the copy's CPU
        pools')."""
        if self.tree is None or len(tokens) < 2:
            return None
        tokens = list(tokens[:-1])
        hit = self.tree.match_prefix(tokens, namespace)
        if self.host is not None:
            host_hit = self.host.match(tokens, namespace)
            if host_hit is not None:
                try:
                    if host_hit.prefix_len > hit.prefix_len:
                        prefix = self.host.gather(host_hit, layout, tokens[:host_hit.prefix_len], namespace)
                        return prefix.drop_kv_before(kv_from)
                finally:
                    self.host.unlock(host_hit)
        if not hit.prefix_len:
            return None
        kv_from = max(0, min(kv_from, hit.prefix_len - 1))
        return CachedPrefix.gather(layout, tokens[:hit.prefix_len], namespace, self.kv_pool, hit.kv_indices[kv_from:],
                                   self.tree.state_pool, hit.state_slot, kv_from)

    def prompt_cached_lens(self, tokens: Sequence[int], namespace, limit: int) -> tuple[int, int]:
        """How many of prompt ``tokens`` a request for them would find cached now (``limit`` at most: its
        ``new_request_match_limit``), changing nothing: ``(device, any_tier)``, the device tree's, and the
        longer of it and the host tier's (the device's where there is no host tier)."""
        if self.tree is None or limit < 1:
            return 0, 0
        tokens = list(tokens[:limit])
        device = self.tree.usable_len(tokens, namespace)
        host = self.host.tree.usable_len(tokens, namespace) if self.host is not None else 0
        return device, max(device, host)

    def import_prefix(self, prefix: CachedPrefix) -> int:
        """Put ``prefix`` (another cache's, ``export_prefix``) into the tree where it lacks it, as a
        computed prefix (evictable, saved to the host tier when evicted); returns the length of it the
        tree holds now: all of it, or where the room could not be made, what it held before.
        ``ValueError`` for a prefix this cache cannot hold (the prefix cache off, a length off the
        page grid, another layout: ``CachedPrefix.check_fits``), before anything is evicted."""
        if self.tree is None:
            raise ValueError(NO_CACHE_TO_IMPORT_INTO)
        if len(prefix) % self.page_size:
            raise ValueError(f"a prefix of {len(prefix)} tokens is not on this cache's page grid (page_size "
                             f"{self.page_size})")
        prefix.check_fits(self.kv_pool, self.tree.state_pool)
        tokens = list(prefix.token_ids)
        hit = self.tree.match_prefix(tokens, prefix.namespace)
        if hit.prefix_len >= len(tokens):
            return len(tokens)
        if min(hit.kv_only_len, len(tokens)) < prefix.kv_start:  # (the KV it does not carry: evicted here since)
            return hit.prefix_len

        def fill(start: int, kv: torch.Tensor, slot: int | None) -> None:
            self.kv_pool.copy_from(prefix.kv, prefix.kv_rows[start - prefix.kv_start:], kv)
            if slot is not None:
                self.state_pool.copy_from(prefix.state, [prefix.state_slot], [slot])
        return len(tokens) if self._adopt(tokens, prefix.namespace, hit, fill, cause=IMPORT) else hit.prefix_len

    def land_host_saves(self) -> None:
        """Land the host tier's saves in flight (``HostCache.land``): for the scheduler, once it has
        launched a step and before it waits for the device."""
        if self.host is not None:
            self.host.land()

    # ------------------------------------------------------------------------------------------
    # one step
    # ------------------------------------------------------------------------------------------
    def can_allocate(self, reqs: Sequence[Req], lens: Sequence[int], kv_reserve: int = 0) -> bool:
        """Whether KV for ``lens[i]`` more tokens of each request fits (evicting from the tree if
        needed), with ``kv_reserve`` slots to spare."""
        return self._ensure_kv(self._kv_tokens([r.kv_allocated for r in reqs], lens) + kv_reserve, cause=GROWTH)

    def allocate(self, reqs: Sequence[Req], lens: Sequence[int]) -> torch.Tensor:
        """KV slots for positions ``[kv_allocated, kv_allocated + lens[i])`` of each request (any
        ``lens[i] >= 1``; a request's last partial page is continued first), written into its
        row; returns them packed ``[sum(lens)]``. Call ``can_allocate`` first: a short pool
        raises ``PoolExhaustedError``."""
        starts = [r.kv_allocated for r in reqs]
        loc = self.kv_pool.alloc_extend(starts, [self._last_loc(r) for r in reqs], lens)
        self.req_to_token.write_batch([r.req_pool_idx for r in reqs], starts, lens, loc)
        for r, n in zip(reqs, lens):
            r.kv_allocated += n
        if self.ledger is not None:
            held = self.kv_pool.size - self.kv_pool.available_size() - (
                self.tree.evictable_size() + self._held_only() if self.tree else 0)
            self.ledger.sample_usage(held, self.req_to_token.size - self.req_to_token.available_size())
        return loc

    def checkpoint_positions(self, req: Req, start: int, end: int) -> list[tuple[int, bool, bool]]:
        """``(position, speculative, requested)`` for each p in (start, end] whose state the tree
        wants, rounded down to the grid (``requested``: the caller asked for it, the tree's
        ``Checkpoint.requested``). The rule the simulator measured best (``hyla_admission``): the
        branch point and the positions the caller asked for are required; chunk boundaries, the
        prompt end minus one and the caller's guesses (``req.speculative_checkpoints``: a chat's
        message ends) are *speculative* — they may never be used, so they get room only from free
        slots or in place of other speculative or superseded checkpoints. None without a tree, nor
        for a model with no recurrent state (no linear layer: its tree holds KV alone, every prefix usable)."""
        if not self.checkpoints:
            return []
        grid = self.grid
        speculative = {len(req.input_ids) - 1}  # (1) end of the prompt minus one
        if end < req.num_fill:
            speculative.add(end)  # (2) chunk boundary of a chunked prefill
        requested = set() if req.speculative_checkpoints else set(req.checkpoints)  # (3) the caller asked
        if req.speculative_checkpoints:
            speculative.update(req.checkpoints)  # ... or guessed (message ends)
        required = requested | ({req.branch_point} if req.branch_point else set())  # (4) a future insert branches here
        out: dict[int, tuple[bool, bool]] = {}
        for p in speculative | required:
            q = p - p % grid
            if start < q <= end and 0 < q <= req.num_fill:
                spec, asked = out.get(q, (True, False))
                out[q] = (spec and p not in required, asked or p in requested)
        return [(q, spec, asked) for q, (spec, asked) in sorted(out.items())]

    def alloc_checkpoints(self, reqs: Sequence[Req],
                          positions: Sequence[list[tuple[int, bool, bool]]]) -> StepCheckpoints:
        """Fresh state slots for the checkpoints at ``positions[i]`` (``(absolute position,
        speculative, requested)``, inside this step of request i). Best effort: checkpoints only make later
        hits possible, fewer of them never change an output. Required ones may evict any unlocked
        checkpoint; speculative ones only replaceable ones, or the request's own deepest checkpoint
        that they will supersede (``_evict_superseded_by``). When short, the positions furthest
        into each prompt are kept."""
        keep: set[tuple[int, int]] = set()
        for spec in (False, True):
            ranked = sorted(((p, i) for i, ps in enumerate(positions) for p, s, _ in ps if s == spec), reverse=True)
            what = SPECULATIVE_CHECKPOINT if spec else BRANCH_CHECKPOINT
            if ranked and not self._ensure_state(len(keep) + len(ranked), for_speculative=spec, cause=what):
                fit = max(0, self.state_pool.available_size() - len(keep))
                ranked, rest = ranked[:fit], ranked[fit:]
                moved: set[int] = set()  # requests whose own superseded checkpoint made room
                for p, i in rest:  # a request's deepest first
                    if spec and i not in moved and self._evict_superseded_by(reqs[i], p, what):
                        moved.add(i)
                        ranked.append((p, i))
                    else:
                        self._dropped(reqs[i], p, what)
            keep.update(ranked)
        slots = iter(self.state_pool.alloc(len(keep)).tolist() if keep else [])
        out = StepCheckpoints()
        for i, (r, ps) in enumerate(zip(reqs, positions)):
            mine = []
            for p, spec, requested in ps:
                if (p, i) in keep:
                    slot = next(slots)
                    out.forward.append((i, p - r.kv_len, slot))
                    mine.append(Checkpoint(p, slot, spec, requested))
            out.per_req.append(mine)
        return out

    def commit(self, req: Req, n: int, ckpts: Sequence[Checkpoint] = (), insert: bool = True,
               states: Sequence[int] = (), path: Sequence[int] | None = None) -> None:
        """The model has fed ``n`` tokens of ``req`` past ``kv_len``: advance ``kv_len`` by ``n``;
        with ``insert`` (prefill steps) hand the computed whole pages and the checkpoints to the
        tree and take its canonical slots back.

        A verify step may have fed more tokens than it commits (rejected drafts): ``states[j]``
        then holds the state after ``kv_len + j + 1`` tokens; the live slot is reset to the state
        after ``n`` (also when all were accepted but the step ran past them: a verify step of padded
        chains) and the KV past it is rolled back. A tree verify step commits the fed tokens
        ``path`` (offsets past ``kv_len``, ``path[j] >= j``): their KV first moves to positions
        ``kv_len .. kv_len + n - 1``. With a grid > 1, the last grid position
        passed while decoding (or a prefill ending on the grid) is kept as a pending checkpoint,
        so that its state is not lost when the output stops between grid points."""
        self.commit_batch([req], [n], [ckpts], insert, [states], [path])

    def commit_batch(self, reqs: Sequence[Req], ns: Sequence[int], ckpts: Sequence[Sequence[Checkpoint]] | None = None,
                     insert: bool = True, states: Sequence[Sequence[int]] | None = None,
                     paths: Sequence[Sequence[int] | None] | None = None) -> None:
        """``commit(reqs[i], ns[i], ckpts[i], insert, states[i], paths[i])`` for every request of one
        step, with the pools' copies batched: one KV copy for every tree path moved, one state copy
        for every live state reset, one free for every rejected token's KV (a verify step). Every
        request is checked before anything changes: a bad one raises ``ValueError`` and commits none."""
        ckpts, states, paths = ckpts or [()] * len(reqs), states or [()] * len(reqs), paths or [None] * len(reqs)
        kv_src: list[torch.Tensor] = []
        kv_dst: list[torch.Tensor] = []
        state_src: list[int] = []
        state_dst: list[int] = []
        for req, n, st, path in zip(reqs, ns, states, paths, strict=True):
            if n < 1:
                raise ValueError(f"request {req.rid}: a step commits at least one token, got {n}")
            fed = req.kv_allocated - req.kv_len
            if n > fed:
                raise ValueError(f"request {req.rid}: committed {n} tokens but only {fed} were fed")
            if n < fed and len(st) < n:
                raise ValueError(f"request {req.rid}: the state after {n} of {fed} fed tokens is missing")
            if path is not None:
                moves = self._path_moves(req, list(path[:n]), fed)
                if moves is not None:
                    kv_src.append(moves[0])
                    kv_dst.append(moves[1])
            if len(st) >= n and st[n - 1] != req.state_slot:  # a rejection, or fed tokens padded past n
                state_src.append(st[n - 1])
                state_dst.append(req.state_slot)
        if kv_src:
            self.kv_pool.copy(torch.cat(kv_src), torch.cat(kv_dst))
        if state_src:
            self.state_pool.copy(torch.tensor(state_src), torch.tensor(state_dst))
        olds = [r.kv_len for r in reqs]
        for req, n in zip(reqs, ns):
            req.kv_len += n
        rejected = [kv for kv in map(self._rollback_slots, reqs) if kv is not None]
        if rejected:
            self.kv_pool.free(torch.cat(rejected) if len(rejected) > 1 else rejected[0])
        if self.tree is None:
            return
        for req, old, ck, st in zip(reqs, olds, ckpts, states):
            if insert:
                self._insert_and_relock(req, req.kv_len - req.kv_len % self.page_size, list(ck))
            if self.grid > 1 and self.checkpoints and (not insert or req.kv_len == req.num_fill):
                g = req.kv_len - req.kv_len % self.grid  # the last grid position this step reached
                if g == req.kv_len:
                    self._set_pending_checkpoint(req, g, req.state_slot)
                elif g > old and not insert:
                    self._set_pending_checkpoint(req, g, st[g - old - 1])

    def _path_moves(self, req: Req, path: list[int], fed: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A tree verify step's accepted nodes ``path`` (fed offsets) become positions ``0..n-1``
        past ``kv_len``: the KV slots to copy from and to (None: the path is its first nodes).
        ``KVPool.copy`` reads all sources before writing any destination."""
        if len(path) > fed or any(not j <= node < fed for j, node in enumerate(path)) or path[:1] != [0]:
            raise ValueError(f"request {req.rid}: {path} is not a path of {fed} fed tokens")
        moves = [(j, node) for j, node in enumerate(path) if node != j]
        if not moves:
            return None
        slots = self.req_to_token.read(req.req_pool_idx, req.kv_len, req.kv_len + fed)
        return slots[[node for _, node in moves]], slots[[j for j, _ in moves]]

    def rollback(self, req: Req) -> None:
        """Forget what ``req`` was allocated past its committed ``kv_len`` (a failed step, or the
        rejected draft tokens of a speculative one): free the KV pages that hold only positions
        past it; the rest of a partial page stays the request's, to be overwritten."""
        slots = self._rollback_slots(req)
        if slots is not None:
            self.kv_pool.free(slots)

    def _rollback_slots(self, req: Req) -> torch.Tensor | None:
        """``rollback`` without the free: set ``kv_allocated = kv_len``, return the slots to free."""
        keep = -(-req.kv_len // self.page_size) * self.page_size  # the page holding kv_len - 1 stays
        slots = self.req_to_token.read(req.req_pool_idx, keep, req.kv_allocated) if keep < req.kv_allocated else None
        req.kv_allocated = req.kv_len
        return slots

    def reserve_states(self, n: int) -> list[int]:
        """``n`` state slots taken for good (speculative decoding's per-token scratch states)."""
        if not self._ensure_state(n, cause="speculative-decoding scratch"):
            raise ValueError(f"the state pool cannot spare {n} slots (size {self.state_pool.size}): "
                             "raise max_state_slots or lower max_running_requests")
        slots = self.state_pool.alloc(n).tolist()
        self.num_reserved_states += n
        return slots

    def reserve_kv(self, n: int) -> list[int]:
        """``n`` KV slots taken for good, on whole pages (the MTP and draft-model drafters' scratch:
        the KV of their draft tokens, which never enter a request's row)."""
        tokens = -(-n // self.page_size) * self.page_size
        if not self._ensure_kv(tokens, cause="speculative-decoding scratch"):
            raise ValueError(f"the KV pool cannot spare {n} slots (size {self.kv_pool.size}): "
                             "raise max_total_tokens or lower max_running_requests")
        slots = self.kv_pool.alloc(n).tolist()
        self.num_reserved_tokens += tokens
        return slots

    def flush(self) -> tuple[int, int]:
        """Empty the tree: every cached prefix's KV slots and state checkpoints back to their pools
        (a ledger records them as removed, "reset", for "flush_cache"), and the host tier. Between requests only: no
        waiting request's hit held, no node locked (ValueError otherwise). Returns the KV tokens and
        the checkpoints dropped."""
        if self._holds:
            raise ValueError(f"flush() while {len(self._holds)} waiting requests' hits are held")
        if self.tree is None:
            return 0, 0
        dropped = self.tree.total_size(), self.tree.num_checkpoints()
        with self._because("flush_cache"):
            self.tree.reset()
        if self.host is not None:
            self.host.reset()
        return dropped

    def free_checkpoints(self, ckpts: StepCheckpoints) -> None:
        """A failed step: return checkpoint slots the tree never received."""
        if ckpts.forward:
            self.state_pool.free(torch.tensor(ckpts.slots))

    # ------------------------------------------------------------------------------------------
    # release
    # ------------------------------------------------------------------------------------------
    def release(self, req: Req, insert: bool) -> None:
        """Return everything ``req`` holds. With a tree and ``insert``, first cache what it
        computed — its KV and a forked checkpoint of its live state after the last fed token — so
        that a later request (the next turn of a conversation) continues from there. A request
        released already (no row) is left alone."""
        row = req.req_pool_idx
        if row is None:
            return
        self.rollback(req)  # a step that never committed leaves nothing behind
        if self.tree is not None:
            ckpts: list[tuple[int, int]] = []
            end = req.kv_len - req.kv_len % self.page_size
            on_grid = insert and self.checkpoints and req.kv_len > 0 and req.kv_len % self.grid == 0
            if on_grid and self._ensure_state(1, cause=FINISH_CHECKPOINT):
                (slot,) = self.state_pool.fork(torch.tensor([req.state_slot])).tolist()
                ckpts.append((req.kv_len, slot))  # (4) the live state after the last fed token
            elif on_grid:
                self._dropped(req, req.kv_len, FINISH_CHECKPOINT)
            if not ckpts and insert and req.pending_ckpt is not None and req.pending_ckpt[0] <= end:
                ckpts.append(req.pending_ckpt)
                req.pending_ckpt = None
            if req.pending_ckpt is not None:
                self.state_pool.free(torch.tensor([req.pending_ckpt[1]]))
                req.pending_ckpt = None
            if insert and end > 0:
                self._insert_and_relock(req, end, ckpts)
                # its deepest checkpoint ends a finished turn (or is where a retracted request
                # resumes): no speculative checkpoint may replace it any more
                self.tree.confirm_checkpoint(req.last_node)
            elif ckpts:
                self.state_pool.free(torch.tensor([s for _, s in ckpts]))
            tail = self.req_to_token.read(row, req.cache_protected_len, req.kv_allocated)
            if tail.numel():
                self.kv_pool.free(tail)
            if req.last_node is not None:
                self.tree.dec_lock_ref(req.last_node)
        else:
            kv = self.req_to_token.read(row, 0, req.kv_allocated)
            if kv.numel():
                self.kv_pool.free(kv)
        self.state_pool.free(torch.tensor([req.state_slot]))
        self.req_to_token.free(row)
        if self.ledger is not None:
            self.ledger.released(req.rid)
        req.req_pool_idx = None
        req.state_slot = None
        req.last_node = None
        req.kv_len = req.kv_allocated = req.cache_protected_len = 0

    # ------------------------------------------------------------------------------------------
    # tree flow
    # ------------------------------------------------------------------------------------------
    def _insert_and_relock(self, req: Req, end: int, ckpts: list[tuple[int, int]]) -> None:
        row = req.req_pool_idx
        kv = self.req_to_token.read(row, 0, end)
        res = self.tree.insert(req.fill_keys[:end], kv, checkpoints=ckpts, namespace=req.namespace)
        # the tree may have freed our duplicates: point the row at the tree's canonical slots
        self.req_to_token.write(row, 0, res.kv_indices)
        self.tree.inc_lock_ref(res.last_node)
        if req.last_node is not None:
            self.tree.dec_lock_ref(req.last_node)
        req.last_node = res.last_node
        req.cache_protected_len = end

    def _set_pending_checkpoint(self, req: Req, length: int, src: int) -> None:
        """Keep a copy of the state after ``length`` tokens (in slot ``src``): into the pending
        slot the request already holds (no allocation, so no eviction), else into a fresh one:
        a free slot, the slot of the checkpoint this one will supersede (the request's own
        deepest, on a path only it continues), or a replaceable checkpoint's — never a better one's.

        Unless ``length`` is the last grid position the request can reach
        (:meth:`_last_grid_position`): whatever stops it then, its turn ends there, so this state
        is its finish checkpoint taken early, and may evict as a finish checkpoint does."""
        if req.pending_ckpt is not None:
            slot = req.pending_ckpt[1]
            self.state_pool.copy(torch.tensor([src]), torch.tensor([slot]))
        elif self.state_pool.available_size() or self._evict_superseded_by(req, length, PENDING_CHECKPOINT) \
                or (self._ensure_state(1, cause=FINISH_CHECKPOINT) if length >= self._last_grid_position(req)
                    else self._ensure_state(1, for_speculative=True, cause=PENDING_CHECKPOINT)):
            (slot,) = self.state_pool.fork(torch.tensor([src])).tolist()
        else:
            self._dropped(req, length, PENDING_CHECKPOINT)
            return
        req.pending_ckpt = (length, slot)

    def _last_grid_position(self, req: Req) -> int:
        """The deepest grid position ``req`` can feed up to: it stops after ``max_new_tokens``
        outputs at most, and the last output is never fed (a context limit only stops it sooner)."""
        most = len(req.input_ids) + req.sampling.max_new_tokens - 1
        return most - most % self.grid

    def _evict_superseded_by(self, req: Req, length: int, cause: str) -> bool:
        """Free the checkpoint that a state of ``req`` after ``length`` tokens will supersede once
        inserted: the deepest checkpoint on ``req``'s path, if it lies above ``length``, nothing
        branches off between it and the request's end, no other request holds it, no request is
        copying it, and no caller asked for it. Returns whether a slot was freed. ``cause``: the
        ledger's label."""
        node, root = req.last_node, self.tree.root
        if node is None or node is root or node.children:
            return False
        while node.state is None:  # up to the deepest checkpoint, through single-child nodes only
            node = node.parent
            if node is root or len(node.children) != 1:
                return False
        if node.depth >= length or node.lock_ref != 1 or node.state_lock or node.requested:
            return False
        with self._because(cause):
            self.tree.evict_checkpoint(node)
        self.num_evicted_states += 1
        return True

    # ------------------------------------------------------------------------------------------
    # memory
    # ------------------------------------------------------------------------------------------
    def _kv_tokens(self, starts: Sequence[int], lens: Sequence[int]) -> int:
        """KV slots an allocation takes from the pool (whole pages)."""
        return self.kv_pool.pages_needed(starts, lens) * self.page_size

    def _last_loc(self, req: Req) -> int:
        """The KV slot of ``req``'s last allocated token; -1 when its KV ends on a page boundary
        (then ``alloc_extend`` starts a fresh page and ignores it: always, at page size 1)."""
        if req.kv_allocated % self.page_size == 0:
            return -1
        return int(self.req_to_token.read(req.req_pool_idx, req.kv_allocated - 1, req.kv_allocated)[0])

    def kv_room(self) -> int:
        """KV slots an allocation could have now: the free ones and every unlocked tree entry's (an
        upper bound: a state-locked leaf holds its KV too)."""
        return self.kv_pool.available_size() + (self.tree.evictable_size() if self.tree is not None else 0)

    def _could_free(self, num_tokens: int, num_slots: int) -> bool:
        """Whether ``num_tokens`` KV slots and ``num_slots`` state slots could be had, evicting every
        unlocked tree entry if need be (:meth:`kv_room`)."""
        states = self.state_pool.available_size()
        if self.tree is not None:
            states += self.tree.evictable_checkpoints()
        return self.kv_room() >= num_tokens and states >= num_slots

    def _ensure_kv(self, num_tokens: int, cause: str) -> bool:
        """Free KV slots for ``num_tokens``, evicting tree entries if needed — none when even
        evicting all of them could not make room. ``cause``: what the room is for (the ledger's label)."""
        avail = self.kv_pool.available_size()
        if avail < num_tokens and self.tree is not None and self._could_free(num_tokens, 0):
            with self._because(cause):
                self.num_evicted_tokens += self.tree.evict(num_tokens - avail)
            avail = self.kv_pool.available_size()
        return avail >= num_tokens

    def _ensure_state(self, num_slots: int, for_speculative: bool = False, *, cause: str) -> bool:
        """Free state slots for ``num_slots``, evicting tree checkpoints if needed — for a
        speculative use, only replaceable ones (speculative or superseded)."""
        avail = self.state_pool.available_size()
        if avail < num_slots and self.tree is not None:
            with self._because(cause):
                self.num_evicted_states += self.tree.evict_state(num_slots - avail, for_speculative=for_speculative)
            avail = self.state_pool.available_size()
        return avail >= num_slots

    def usage(self) -> tuple[float, float]:
        """Share of the KV pool and of the state pool in use by requests and the tree, of what they can
        use: the slots reserved for good (speculative decoding's scratch: ``reserve_states``,
        ``reserve_kv``) count on neither side, so an idle engine reads 0 with speculation on too."""
        kv, st = self.kv_pool, self.state_pool
        kv_room, st_room = kv.size - self.num_reserved_tokens, st.size - self.num_reserved_states
        return ((kv_room - kv.available_size()) / max(1, kv_room), (st_room - st.available_size()) / max(1, st_room))

    def check_integrity(self) -> None:
        assert not self._holds, f"{len(self._holds)} waiting requests' hits still held between steps"
        self.kv_pool.check_integrity()
        self.state_pool.check_integrity()
        if self.tree is not None:
            self.tree.check_integrity()
        if self.host is not None:
            self.host.check_integrity()
            assert not self.host.tree.protected_size(), "a host hit is still locked between steps"
