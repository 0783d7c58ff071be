"""A request as the engine sees it: tokens, progress through the KV/state pools, and output.

Length invariants (checked by ``check()``, which the scheduler calls after every step in debug
mode and tests call freely)::

    0 <= cache_protected_len <= kv_len <= kv_allocated
    between steps:  kv_allocated == kv_len <= len(fill_ids)
    decoding  =>  kv_len == len(fill_ids) - 1     (every token but the last sampled one is fed)

* ``fill_ids`` = prompt + output so far: the tokens whose KV/state the request must hold before it
  can sample its next token. A request re-admitted after retraction prefills all of them again
  (less whatever the prefix cache still has).
* ``kv_len``: committed tokens — those of ``fill_ids`` whose KV sits in the request's row of the
  request table and whose recurrent state is in ``state_slot`` (the state after exactly
  ``kv_len`` tokens). A step may feed any number of tokens; it advances ``kv_len`` by what it
  commits (several tokens for a prefill chunk or an accepted speculative run).
* ``kv_allocated``: positions of the row that have KV slots. A step allocates past ``kv_len``
  first, then commits; what it does not commit (a failed forward, rejected draft tokens) is
  rolled back (``CacheManager.rollback``), so between steps both are equal.
* ``cache_protected_len``: the leading part of that row owned by the prefix tree and protected by
  the KV lock on ``last_node``; the rest of the row is the request's own and freed by it.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable

import torch

from hyla.engine.sampling_params import SamplingParams


# Why the engine aborted a request: the "cause" of its ``finish_reason`` (``abort_reason``), what a
# caller branches on (the server's HTTP status: hyla/server/errors.py); the message is for people
ABORT_CAUSES = (
    "client",  # Engine.abort: the caller asked (a client's hang-up at the server)
    "shutdown",  # the engine stopped before the request finished
    "grammar",  # its grammar could not follow its output (a parser limit met deep in it)
    "consumer",  # its stream's consumer failed (a callback raised, a queue was closed)
    "internal",  # an error inside the engine (a failed step, or the request's own host work)
    "overloaded",  # priority scheduling: the queue was full and a more urgent request took its place
)


def abort_reason(message: str, cause: str) -> dict[str, Any]:
    """An aborted request's ``finish_reason``: ``{"type": "abort", "message", "cause"}``."""
    if cause not in ABORT_CAUSES:
        raise ValueError(f"unknown abort cause {cause!r}; one of {ABORT_CAUSES}")
    return {"type": "abort", "message": message, "cause": cause}


class ReqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Req:
    rid: str
    input_ids: list[int]
    sampling: SamplingParams
    checkpoints: tuple[int, ...] = ()  # caller-given positions (token counts into the prompt)
    # True: ``checkpoints`` are guesses (a chat's message ends), stored only in free or replaceable
    # slots; False: the caller asked for them, stored like a finished turn's end (docs/cache.md)
    speculative_checkpoints: bool = False
    namespace: Hashable | None = None  # cache salt (with a LoRA adapter's digest): different namespaces never share
    lora_uid: int = 0  # the LoRA adapter it applies (LoRAManager's uid of one load; 0: none, the base model)
    lora_slot: int = 0  # that adapter's slot in the projections (lora.LinearLoRA; 0: none)
    images: Any = None  # a vision-language prompt's images (multimodal.PromptImages; input_ids already expanded)
    return_logprob: bool = False
    logprob_start_len: int = -1  # with return_logprob: prompt logprobs from this position (-1: none)
    # priority scheduling (SchedulerConfig.priority_scheduling): which waiting request goes first, which
    # running one a more urgent request may preempt (higher = more urgent unless low_priority_values_first)
    priority: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    stream: bool = False  # deliver each step's new output (else only the final output)
    # called on the scheduler thread with an output chunk (see OutputProcessor) and whether it is the last
    on_output: Callable[[dict[str, Any], bool], None] | None = None

    # --- progress --------------------------------------------------------------------------
    status: ReqStatus = ReqStatus.WAITING
    output_ids: list[int] = field(default_factory=list)
    kv_len: int = 0
    kv_allocated: int = 0
    cache_protected_len: int = 0
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (first admission)
    admitted_once: bool = False
    weight_version: str | None = None  # of the weights it runs on (set at its first admission)
    queue_time: float | None = None  # seconds from arrival_time to its first admission (None: still waiting)
    req_pool_idx: int | None = None
    state_slot: int | None = None
    last_node: Any = None
    branch_point: int | None = None  # where inserting fill_ids would branch off the tree (dry run)
    pending_ckpt: tuple[int, int] | None = None  # (length, forked slot) awaiting insert at finish
    draft_ids: list[int] = field(default_factory=list)  # speculative tokens fed after fill_ids this step
    draft_parents: list[int] | None = None  # a tree: draft j continues fed token draft_parents[j] (None: a chain)
    draft_state: Any = None  # the drafter's per-request memory (e.g. its n-gram index)
    spec_verify_ct: int = 0  # speculative verify steps this request took
    spec_num_tokens: int = 0  # output tokens those steps produced (accepted drafts + bonus tokens)
    finished_reason: dict[str, Any] | None = None
    generator: torch.Generator | None = None
    grammar: Any = None  # a hyla.engine.grammar.GrammarMatcher when sampling.grammar is set

    # --- output ----------------------------------------------------------------------------
    # prompt logprobs of positions logprob_start_len, logprob_start_len + 1, ... (position 0 has none:
    # None); filled as prefill chunks compute them, complete before the first output token
    input_logprobs: list[float | None] = field(default_factory=list)
    input_top_logprobs: list[list[tuple[float, int]] | None] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    text: str = ""  # output text so far (built by the scheduler thread, cut before a stop string)
    detokenizer: Any = None
    num_checked_chars: int = 0  # text already searched for stop strings
    num_sent_ids: int = 0  # output ids already handed to a stream consumer
    num_sent_chars: int = 0

    def __post_init__(self) -> None:
        if not self.input_ids:
            raise ValueError(f"request {self.rid}: the prompt is empty")
        if self.return_logprob and self.logprob_start_len == 0:  # the first token has no logprob
            self.input_logprobs.append(None)
            self.input_top_logprobs.append(None)

    @property
    def prompt_logits_from(self) -> int | None:
        """The first position whose logits this request still needs for its prompt logprobs (the
        logits at position ``q`` give the logprob of prompt token ``q + 1``); None when it needs none.
        Its cached prefix must end there: a cached token has no logits."""
        if not self.return_logprob:
            return None
        return prompt_logits_start(len(self.input_ids), self.logprob_start_len, len(self.input_logprobs))

    def set_drafts(self, ids: list[int], parents: list[int] | None = None) -> None:
        """This step's drafts. ``parents``: a tree (speculative.py), draft ``j`` continuing fed token
        ``parents[j]`` — 0 is the last sampled token, ``i >= 1`` is draft ``i - 1`` — so each parent
        precedes its child; None: a chain."""
        if parents is not None:
            if len(parents) != len(ids) or any(not 0 <= p <= j for j, p in enumerate(parents)):
                raise ValueError(f"request {self.rid}: draft parents {parents} do not form a tree over {len(ids)} drafts")
            if parents == list(range(len(ids))):
                parents = None
        self.draft_ids, self.draft_parents = list(ids), parents

    def clear_drafts(self) -> None:
        self.draft_ids, self.draft_parents = [], None

    def fed_parents(self) -> list[int]:
        """The parent of each token a verify step feeds (its last sampled token, then its drafts),
        as ``ForwardBatch.tree_parents`` wants it: ``-1`` for the first."""
        if self.draft_parents is None:
            return list(range(-1, len(self.draft_ids)))
        return [-1] + self.draft_parents

    @property
    def fill_ids(self) -> list[int]:
        return self.input_ids + self.output_ids

    @property
    def fill_keys(self) -> list[int]:
        """``fill_ids`` as the prefix cache keys them: each image's tokens its own id (``multimodal.py``)."""
        if self.images is None:
            return self.fill_ids
        return self.images.key_ids(self.input_ids) + self.output_ids

    def tokens(self, start: int, end: int) -> list[int]:
        """Positions ``[start, end)`` of ``fill_ids`` followed by ``draft_ids`` (what a step feeds)."""
        n_in = len(self.input_ids)
        out = self.input_ids[start:min(end, n_in)] if start < n_in else []
        if end > n_in:
            out = out + (self.output_ids + self.draft_ids)[max(0, start - n_in):end - n_in]
        return out

    @property
    def num_fill(self) -> int:
        return len(self.input_ids) + len(self.output_ids)

    @property
    def extend_target(self) -> int:
        """Tokens still to feed before the next token can be sampled."""
        return self.num_fill - self.kv_len

    @property
    def is_decoding(self) -> bool:
        return self.status is ReqStatus.RUNNING and self.kv_len == self.num_fill - 1 and bool(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.finished_reason is not None

    def check(self, in_flight: int = 0) -> None:
        """The length invariants; ``in_flight``: tokens of a launched step not committed yet (the
        overlap schedule's), allocated past ``kv_len``."""
        if not 0 <= self.cache_protected_len <= self.kv_len == self.kv_allocated - in_flight <= self.num_fill:
            raise AssertionError(
                f"req {self.rid}: broken lengths protected={self.cache_protected_len} kv={self.kv_len} "
                f"allocated={self.kv_allocated} fill={self.num_fill}"
            )

    def meta_info(self, start: int = 0, end: int | None = None) -> dict[str, Any]:
        """SGLang's ``meta_info``, with the logprobs of output tokens ``[start, end)`` (a stream
        chunk carries only its own tokens' logprobs; the final output all of them)."""
        info: dict[str, Any] = {
            "id": self.rid,
            "prompt_tokens": len(self.input_ids),
            "completion_tokens": len(self.output_ids),
            "cached_tokens": self.cached_tokens,
            "finish_reason": self.finished_reason,
        }
        if self.weight_version is not None:
            info["weight_version"] = self.weight_version
        if self.queue_time is not None:
            info["queue_time"] = self.queue_time
        if self.spec_verify_ct:
            info["spec_verify_ct"] = self.spec_verify_ct
            info["spec_accept_length"] = self.spec_num_tokens / self.spec_verify_ct
        if self.return_logprob and self.logprob_start_len >= 0 and start == 0:
            first = self.logprob_start_len
            info["input_token_logprobs"] = [
                (lp, tid, None) for lp, tid in zip(self.input_logprobs, self.input_ids[first:])]
            if self.sampling.top_logprobs_num:
                info["input_top_logprobs"] = [list(t) if t is not None else None for t in self.input_top_logprobs]
        if self.return_logprob:
            end = len(self.output_logprobs) if end is None else end
            info["output_token_logprobs"] = [
                (lp, tid, None) for lp, tid in zip(self.output_logprobs[start:end], self.output_ids[start:end])]
            if self.sampling.top_logprobs_num:
                info["output_top_logprobs"] = [list(t) for t in self.output_top_logprobs[start:end]]
        return info


def prompt_logits_start(num_tokens: int, logprob_start_len: int, num_done: int = 0) -> int | None:
    """The first position whose logits a prompt of ``num_tokens`` still needs for its logprobs from
    ``logprob_start_len`` (-1: none), ``num_done`` of them computed (position 0 has none: it counts as
    done): the logits at position ``q`` give the logprob of prompt token ``q + 1``. None when it needs
    none. A cached prefix of the prompt must end there (``cache_manager.match_limit``)."""
    if logprob_start_len < 0:
        return None
    target = max(logprob_start_len + num_done, 1)  # the next prompt token without a logprob
    return target - 1 if target < num_tokens else None
