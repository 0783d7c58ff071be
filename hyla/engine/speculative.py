"""Speculative decoding: cheap drafts, verified by the target model in one step, exactly.

A verify step feeds each decoding request its last sampled token followed by its draft tokens
``d_1..d_k`` (``req.draft_ids``; ``k = 0`` goes through the same path), and asks the model for the
logits at every fed position and for the recurrent state after each of the first ``k`` positions
(into scratch state slots the engine reserved at start). Position ``j`` predicts the token after
``d_j`` (``d_0`` = the last sampled token). Then, per request:

* **greedy**: accept drafts while ``d_{j+1} == argmax(logits_j)``; after ``a`` accepted drafts the
  target's own token ``argmax(logits_a)`` is the bonus. The output equals plain greedy decoding.
* **sampling** (temperature > 0): speculative sampling (Leviathan et al., Chen et al.) with a
  deterministic draft ``q = one-hot(d)``: accept ``d_{j+1}`` with probability ``p_j(d_{j+1})``;
  on rejection draw from ``p_j`` with ``d_{j+1}`` removed, renormalised (``norm(max(p - q, 0))``);
  after ``k`` acceptances draw the bonus from ``p_k``. Every emitted token is distributed exactly
  as ``p``, the target's temperature/top-k/top-p/min-p distribution. Draws use the request's own
  generator, so a seeded request is reproducible.

The accepted prefix's state becomes the live state and the KV of rejected tokens is freed
(``CacheManager.commit``): nothing of a rejected token survives. Requests with repetition,
frequency or presence penalties get no drafts (their distribution at ``j`` depends on the drafts
before it); they still take the verify path with ``k = 0``.

Structured outputs: a request with a grammar drafts only the grammar-valid prefix of its proposal,
and verification runs on the grammar-masked logits of every fed position (``mask``, one row per
position): the greedy target is the masked argmax and ``p`` the masked distribution, so the output
is exactly that of constrained decoding without speculation. The grammar itself advances only over
the tokens appended (``OutputProcessor.append``); computing the masks leaves it where it was.

Drafters (``Drafter``: what the scheduler asks of one): ``NgramDrafter`` (prompt/history lookup,
no weights: speculation for every model) and ``MtpDrafter`` (``hyla/engine/mtp_drafter.py``: the
checkpoint's own multi-token-prediction head).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hyla.engine.grammar import TokenMask, apply_token_mask
from hyla.engine.request import Req
from hyla.engine.sampler import apply_penalties, draw, target_probs, top_logprobs, uniform

@dataclass
class Verdict:
    """One request's outcome of a verify step."""

    tokens: list[int]  # the accepted drafts, then the bonus token: 1 + num_accepted tokens
    logprobs: list[float]  # raw-model logprob of each
    top_logprobs: list[list[tuple[float, int]]]  # per token, [] unless asked for
    num_accepted: int


class Drafter:
    """What the scheduler asks of a drafter, each decode step: ``propose_batch`` (drafts for every
    decoding request), and after every target forward ``observe`` (for drafters that follow the
    model's hidden states). ``num_draft``: the most drafts per request and step (the scheduler
    reserves that many scratch state slots per running request)."""

    num_draft: int
    wants_hidden: bool = False  # observe() needs the final hidden states of the fed tokens

    def propose(self, req: Req, limit: int) -> list[int]:
        """At most ``min(limit, num_draft)`` draft tokens to follow ``req.fill_ids``."""
        raise NotImplementedError

    def propose_batch(self, reqs: list[Req], limits: list[int]) -> list[list[int]]:
        """Drafts for each decoding request (at most ``limits[i]`` for ``reqs[i]``), one list each."""
        return [self.propose(r, limit) for r, limit in zip(reqs, limits)]

    def observe(self, reqs: list[Req], lens: list[int], ckpts: list[tuple[int, int, int]],
                hidden: torch.Tensor | None) -> None:
        """Called after every target forward, before its commit: ``reqs[i]`` fed ``lens[i]`` tokens
        after its ``kv_len`` (drafts included), the forward wrote state checkpoints ``ckpts``
        (``(batch index, tokens of this step consumed, state slot)``), ``hidden [sum(lens), H]`` are
        the fed tokens' final hidden states (None unless ``wants_hidden``). Nothing by default."""


class NgramDrafter(Drafter):
    """Propose the continuation of the longest recent n-gram match in the request's own tokens.

    For ``n`` from ``max_n`` down to ``min_n``: if the last ``n`` tokens occurred earlier in the
    prompt or output, propose the (up to ``num_draft``) tokens that followed their most recent
    earlier occurrence — continued periodically where they reach the end of the history (a loop
    of period ``p`` is proposed in full, not cut at ``p`` tokens). The per-request index (n-gram → position after it) grows by the new tokens
    of each step, so a proposal costs O(new tokens · (max_n - min_n + 1)), not O(context).
    """

    def __init__(self, num_draft: int, min_n: int = 1, max_n: int = 4) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min <= max, got {min_n} and {max_n}")
        self.num_draft = num_draft
        self.min_n, self.max_n = min_n, max_n

    def propose(self, req: Req, limit: int) -> list[int]:
        limit = min(limit, self.num_draft)
        if limit <= 0:
            return []
        tokens = req.fill_ids
        if req.draft_state is None:
            req.draft_state = _NgramIndex()
        index = req.draft_state
        index.extend(tokens, self.min_n, self.max_n)
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            pos = index.after.get(tuple(tokens[-n:]))
            if pos is not None:
                # the match's continuation runs up to the end of the history; beyond it, a text
                # that repeats with period len - pos goes on repeating
                period = len(tokens) - pos
                drafts = [tokens[pos + i % period] for i in range(limit)]
                return drafts[:req.grammar.valid_prefix(drafts)] if req.grammar is not None else drafts
        return []


class _NgramIndex:
    """n-gram (as a tuple) → the position right after its most recent occurrence, over every
    n-gram that ends before the last token (the current suffix must match an *earlier* one)."""

    def __init__(self) -> None:
        self.after: dict[tuple[int, ...], int] = {}
        self.num_indexed = 0  # n-grams ending at positions < num_indexed are in the index

    def extend(self, tokens: list[int], min_n: int, max_n: int) -> None:
        end = len(tokens) - 1
        for p in range(self.num_indexed, end):  # n-grams ending at position p
            for n in range(min_n, min(max_n, p + 1) + 1):
                self.after[tuple(tokens[p - n + 1:p + 1])] = p + 1
        self.num_indexed = max(self.num_indexed, end)


def verify(reqs: list[Req], lens: list[int], logits: torch.Tensor, mask: TokenMask | None = None) -> list[Verdict]:
    """Accept or reject each request's drafts. ``logits``: ``[sum(lens), V]`` fp32, request ``i``'s
    ``lens[i] = 1 + len(req.draft_ids)`` rows in order; ``mask``: grammar masks of those rows
    (``OutputProcessor.grammar_masks(reqs, drafts=True)``). Logprobs are the raw model's."""
    raw = torch.log_softmax(logits.float(), dim=-1)  # [T, V]
    if mask is not None:
        logits = apply_token_mask(logits.float().clone(), mask)
    out = []
    offset = 0
    for req, n in zip(reqs, lens):
        rows, lps = logits[offset:offset + n].float(), raw[offset:offset + n]
        offset += n
        drafts = req.draft_ids
        if len(drafts) != n - 1:
            raise ValueError(f"request {req.rid}: {len(drafts)} drafts for {n} fed tokens")
        if req.sampling.has_penalties:
            if drafts:
                raise ValueError(f"request {req.rid}: drafts for a request with penalties")
            rows = apply_penalties(rows[0], req).unsqueeze(0)  # the one row: the next token's
        tokens = _accept_greedy(rows, drafts) if req.sampling.is_greedy else _accept_sampled(rows, drafts, req)
        logprobs = [float(lps[j, t]) for j, t in enumerate(tokens)]
        tops = [top_logprobs(lps[j], req) for j in range(len(tokens))]
        out.append(Verdict(tokens, logprobs, tops, len(tokens) - 1))
    return out


def _accept_greedy(rows: torch.Tensor, drafts: list[int]) -> list[int]:
    target = rows.argmax(dim=-1).tolist()
    a = 0
    while a < len(drafts) and drafts[a] == target[a]:
        a += 1
    return drafts[:a] + [target[a]]


def _accept_sampled(rows: torch.Tensor, drafts: list[int], req: Req) -> list[int]:
    for j, d in enumerate(drafts):
        p = target_probs(rows[j], req)
        if uniform(req) < float(p[d]):
            continue
        residual = p.clone()
        residual[d] = 0.0  # max(p - one_hot(d), 0); its sum is 1 - p[d] > 0 after a rejection
        return drafts[:j] + [draw(residual / residual.sum(), req)]
    return drafts + [draw(target_probs(rows[len(drafts)], req), req)]
