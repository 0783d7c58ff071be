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
(``CacheManager.commit``): nothing of a rejected token survives. Requests whose logits the sampler
processes (``sampler.needs_processing``: penalties, a logit bias, output short of
``min_new_tokens``) get no drafts (their distribution at ``j`` depends on the drafts before it);
they still take the verify path with ``k = 0``, their one row processed as the sampler processes it
(``sampler.process_row``, before the grammar mask).

Structured outputs: a request with a grammar drafts only the grammar-valid prefix of its proposal,
and verification runs on the grammar-masked logits of every fed position (``mask``, one row per
position): the greedy target is the masked argmax and ``p`` the masked distribution, so the output
is exactly that of constrained decoding without speculation. The grammar itself advances only over
the tokens appended (``OutputProcessor.append``); computing the masks leaves it where it was.

Trees (``speculative_eagle_topk > 1``): the drafts need not form one chain. Draft ``j`` continues
fed token ``req.draft_parents[j]`` (0 = the last sampled token, ``i`` = draft ``i``); the model
computes each fed token from its own path (``hyla/model/ops/tree.py``). Verification walks down
from the root: at each node the target's token (greedy) or a draw (sampling) picks among the
node's children; sampling tries the children in order, accepting child ``c`` with probability
``p(c)`` and otherwise removing ``c`` from ``p`` (renormalised) before the next — with one-hot drafts
this is SpecInfer's multi-candidate rejection sampling, and every emitted token is again distributed
exactly as ``p``. A chain is the tree whose nodes each have one child, so both take one code path.
The accepted path's KV is moved to its positions' slots and its last node's state becomes the
live state (``CacheManager.commit(path=...)``).

Drafters (``Drafter``: what the scheduler asks of one): ``NgramDrafter`` (prompt/history lookup,
no weights: speculation for every model; with ``topk > 1`` a tree of the continuations of up to
``topk`` earlier occurrences; by default each request drafts within a ``DraftBudget`` that follows
how its drafts fared), ``MtpDrafter`` (``hyla/engine/mtp_drafter.py``: the checkpoint's
own multi-token-prediction head) and ``DraftModelDrafter`` (``hyla/engine/draft_drafter.py``: a
separate small model, its memory on the model's slots; trees from a beam search).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Collection

import torch

from hyla.cache.transfer import to_device_packed
from hyla.engine.grammar import GrammarMatcher, TokenMask
from hyla.engine.model_runner import decode_batch, host_long, prefix_sums
from hyla.engine.request import Req
from hyla.engine.sampler import (draw, needs_processing, process_logits, raw_distribution, target_probs, top_logprobs,
                                 uniform)
from hyla.model.forward_batch import ForwardBatch

@dataclass
class Verdict:
    """One request's outcome of a verify step."""

    tokens: list[int]  # the accepted drafts, then the bonus token: 1 + num_accepted tokens
    logprobs: list[float]  # raw-model logprob of each
    top_logprobs: list[list[tuple[float, int]]]  # per token, [] unless asked for
    num_accepted: int
    path: list[int]  # fed-token indices committed, in order: 0 (the last sampled token), then the accepted drafts'



class Drafter:
    """What the scheduler asks of a drafter, each decode step: ``propose_batch`` (drafts for every
    decoding request; ``propose_tree_batch`` when ``topk > 1``), after every target
    forward ``observe`` (for drafters that follow the model's hidden states), and after every
    verify step's acceptance ``verified`` (for drafters that adapt to it). ``num_draft``: the
    most drafts per request and step (the scheduler reserves that many scratch state slots per
    running request)."""

    num_draft: int
    topk: int = 1  # > 1: the scheduler asks for trees (propose_tree_batch)
    wants_hidden: bool = False  # observe() needs the final hidden states of the fed tokens

    def propose(self, req: Req, limit: int) -> list[int]:
        """At most ``min(limit, num_draft)`` draft tokens to follow ``req.fill_ids``."""
        raise NotImplementedError

    def propose_tree(self, req: Req, limit: int) -> tuple[list[int], list[int] | None]:
        """At most ``min(limit, num_draft)`` drafts and their parents (``Req.set_drafts``; None: a
        chain). By default the chain of :meth:`propose`."""
        return self.propose(req, limit), None

    def propose_batch(self, reqs: list[Req], limits: list[int]) -> list[list[int]]:
        """Drafts for each decoding request (at most ``limits[i]`` for ``reqs[i]``), one list each."""
        return [self.propose(r, limit) for r, limit in zip(reqs, limits)]

    def propose_tree_batch(self, reqs: list[Req], limits: list[int]) -> list[tuple[list[int], list[int] | None]]:
        """Trees for each decoding request (``topk > 1``): ``propose_tree`` of each, by default."""
        return [self.propose_tree(r, limit) for r, limit in zip(reqs, limits)]

    def observe(self, reqs: list[Req], lens: list[int], ckpts: list[tuple[int, int, int]],
                hidden: torch.Tensor | None, chain_rows: list[list[int]] | None = None) -> None:
        """Called after every target forward, before its commit: ``reqs[i]`` fed ``lens[i]`` tokens
        after its ``kv_len`` (drafts included), the forward wrote state checkpoints ``ckpts``
        (``(batch index, tokens of this step consumed, state slot)``), ``hidden [sum(lens), H]`` are
        the fed tokens' final hidden states (None unless ``wants_hidden``). A drafter that keeps
        data per state slot in step with the target's states (a draft model's own states, the MTP's
        hidden states) writes it for the requests' slots and ``ckpts``: every slot whose state the
        commit may take (in a verify step of padded chains, ``ModelRunner.forward_chains``, also a
        short chain's last fed token's, in a scratch slot). ``chain_rows``: the step ran as padded
        chains with these checkpoint rows (a draft model may run its own so). Nothing by default."""

    def verified(self, reqs: list[Req], verdicts: list[Verdict]) -> None:
        """Called after every verify step's acceptance, before anything is appended or committed:
        ``reqs[i]`` fed the drafts ``reqs[i].draft_ids`` (none when the step dropped them) and
        ``verdicts[i]`` says how many were accepted and which tokens the step emits. For drafters
        that adapt to their acceptance; nothing by default."""


def drafter_batch(ids: list[int], pos: list[int], prefix_lens: list[int], extend_lens: list[int],
                  loc: list[torch.Tensor], kv: list[torch.Tensor], device: torch.device,
                  k_buffers: list[torch.Tensor], v_buffers: list[torch.Tensor]) -> ForwardBatch:
    """An extend ``ForwardBatch`` over explicit KV slots and no recurrent state, for a drafter's
    forward over many tokens of a sequence (the MTP head's over a prompt's pairs): sequence ``i``
    feeds ``extend_lens[i]`` tokens (``ids``, at positions ``pos``, packed) whose K/V go to slots
    ``loc[i]``, after ``prefix_lens[i]`` earlier tokens; ``kv[i]`` are all its KV slots in order
    (``[prefix + extend]``). The buffers are the drafter's. Moved in one transfer."""
    n = len(extend_lens)
    host = host_long(ids, pos, prefix_sums(extend_lens), prefix_sums(k.numel() for k in kv), [-1] * n)
    t = to_device_packed(host + [torch.cat(loc).to(torch.long), torch.cat(kv).to(torch.long)], device)
    return ForwardBatch(
        is_decode=False, input_ids=t[0], positions=t[1], extend_lens=list(extend_lens),
        prefix_lens=list(prefix_lens), cu_seqlens=t[2], out_cache_loc=t[5], kv_indices=t[6], kv_indptr=t[3],
        k_buffers=k_buffers, v_buffers=v_buffers, state_slots=t[4], conv_states=[], ssm_states=[],
        state_slot_list=[-1] * n, max_token_id=max(ids),
    )


def row_batch(ids: list[int], pos: list[int], loc: list[int], tables: list[torch.Tensor], kv_lens: list[int],
              device: torch.device, k_buffers: list[torch.Tensor], v_buffers: list[torch.Tensor],
              state_slots: list[int] | None = None, conv_states: list[torch.Tensor] = (),
              ssm_states: list[torch.Tensor] = ()) -> ForwardBatch:
    """A decode ``ForwardBatch`` of one token per row over explicit slots, for a drafter's steps (its
    scratch KV and state slots, never a request's row): row ``r`` feeds ``ids[r]`` at position
    ``pos[r]``, its K/V written at slot ``loc[r]``, attending to the first ``kv_lens[r]`` slots of
    ``tables[r]`` (its own last), its recurrent state in slot ``state_slots[r]``, updated in place
    (None: no state, ``-1``). A decode step's batch (``model_runner.decode_batch``), so the graphs
    compiled for decode steps serve it."""
    b, width = len(ids), max(kv_lens)
    table = torch.zeros(b, width, dtype=torch.long)
    for r, (t, k) in enumerate(zip(tables, kv_lens)):
        table[r, :k] = t[:k]
    kv_indices = table[torch.arange(width) < torch.tensor(kv_lens)[:, None]]
    return decode_batch(ids, pos, state_slots if state_slots is not None else [-1] * b, kv_lens,
                        torch.tensor(loc, dtype=torch.long), table, kv_indices, device, k_buffers, v_buffers,
                        list(conv_states), list(ssm_states))


# ------------------------------------------------------------------------------------------------
# draft trees from a beam search (the MTP and draft-model drafters with speculative_eagle_topk > 1)
# ------------------------------------------------------------------------------------------------
@dataclass
class Candidate:
    """A candidate draft of a beam search: its token, parent (index among the request's
    candidates, -1 = the last sampled token), depth (1 = a child of the last sampled token), path
    log-probability, and whether it is on the greedy path (every token its parent's argmax)."""

    token: int
    parent: int
    depth: int
    score: float
    greedy: bool


@dataclass(eq=False)
class Beam:
    """A path being extended: its last candidate (-1: the last sampled token), the token to feed
    next, its log-probability, what the drafter continues it from (``state``: a scratch state slot
    for a draft model, a row of the last step's hidden states for the MTP head), the scratch KV
    slots of the path's fed tokens so far, and whether it is the greedy path."""

    node: int
    token: int
    score: float
    state: int
    path: list[int]
    greedy: bool

    def child(self, node: int, candidate: Candidate, state: int) -> Beam:
        """The beam that extends this one by ``candidate`` (index ``node``), continuing from ``state``."""
        return Beam(node, candidate.token, candidate.score, state, self.path, candidate.greedy)


def scratch_rows(slots: list[int], per_row: int) -> list[list[int]]:
    """Reserved scratch slots cut into batch rows of ``per_row`` each (a drafter's)."""
    return [slots[i:i + per_row] for i in range(0, len(slots) - per_row + 1, per_row)]


def beam_kv_slots(num_steps: int, topk: int) -> int:
    """Scratch KV slots a beam search takes per batch row: one per token it feeds (the last sampled
    token, then ``topk`` beams at each further step)."""
    return 1 + (num_steps - 1) * topk


def expand_beams(logits: torch.Tensor, live: list[int], beams: dict[int, list[Beam]],
                 nodes: dict[int, list[Candidate]], widths: list[int], depth: int) -> dict[int, list[tuple[int, int]]]:
    """One step of the beam searches of the requests ``live``: ``logits [F, V]`` are those of the
    beams fed this step (at ``depth - 1``), request ``i``'s ``beams[i]`` consecutive rows, in
    ``live``'s order. Each beam's ``widths[i]`` likeliest next tokens become candidates in
    ``nodes[i]``, scored by their path's log-probability; returns each request's next beams as
    ``(candidate, parent beam index)``: the greedy child, then the best ``width - 1`` other children."""
    logp = torch.log_softmax(logits.float(), dim=-1)  # [F, V]
    top, best = logp.topk(max(widths[i] for i in live), dim=-1)
    top, best = top.tolist(), best.tolist()
    nxt, row = {}, 0
    for i in live:
        children = []
        for k, b in enumerate(beams[i]):
            for c in range(widths[i]):
                children.append((len(nodes[i]), k))
                nodes[i].append(Candidate(best[row][c], b.node, depth, b.score + top[row][c], b.greedy and c == 0))
            row += 1
        nxt[i] = sorted(children, key=lambda c: (not nodes[i][c[0]].greedy, -nodes[i][c[0]].score))[:widths[i]]
    return nxt


def tree_of(nodes: list[Candidate], budget: int,
            grammar: GrammarMatcher | None = None) -> tuple[list[int], list[int] | None]:
    """The drafts to verify from a beam search's candidates: the greedy chain, then the best other
    candidates by score up to ``budget`` nodes (a child never scores above its parent, so every
    chosen node's ancestors are chosen: EAGLE-2's reranking), parents first. Returns the drafts and
    their parents (``Req.set_drafts``; None: a chain). With the chain inside it, a tree is accepted at
    least as far as the chain would be (greedy verification follows the target's argmax down it).
    A request with a ``grammar`` searched with width 1: its chain, cut where the grammar stops
    accepting it."""
    chain = [k for k, node in enumerate(nodes) if node.greedy]
    others = sorted((k for k, node in enumerate(nodes) if not node.greedy),
                    key=lambda k: (-nodes[k].score, nodes[k].depth, k))
    chosen = sorted((chain + others)[:budget], key=lambda k: (nodes[k].depth, not nodes[k].greedy, -nodes[k].score, k))
    at = {k: pos for pos, k in enumerate(chosen)}
    ids = [nodes[k].token for k in chosen]
    parents = [0 if nodes[k].parent < 0 else at[nodes[k].parent] + 1 for k in chosen]
    if grammar is not None:
        ids = ids[:grammar.valid_prefix(ids)]
        parents = parents[:len(ids)]
    return ids, (None if parents == list(range(len(ids))) else parents)


class NgramDrafter(Drafter):
    """Propose the continuation of the longest recent n-gram match in the request's own tokens.

    For ``n`` from ``max_n`` down to ``min_n``: if the last ``n`` tokens occurred earlier in the
    prompt or output, propose the (up to ``num_draft``) tokens that followed their most recent
    earlier occurrence — continued periodically where they reach the end of the history (a loop
    of period ``p`` is proposed in full, not cut at ``p`` tokens). The per-request index (n-gram → position after it) grows by the new tokens
    of each step, so a proposal costs O(new tokens · (max_n - min_n + 1)), not O(context).

    With ``adaptive`` (the default) each request drafts only as much as its drafts have been
    earning (:class:`DraftBudget`): a verify step's cost grows with the tokens it feeds, and a
    rejected draft is paid for and thrown away. The request's state (index and budget) lives in
    ``req.draft_state``, so it goes when the request does.
    """

    def __init__(self, num_draft: int, min_n: int = 1, max_n: int = 4, topk: int = 1, adaptive: bool = True) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min <= max, got {min_n} and {max_n}")
        if topk < 1:
            raise ValueError(f"topk must be >= 1, got {topk}")
        self.num_draft = num_draft
        self.min_n, self.max_n = min_n, max_n
        self.topk = topk
        self.adaptive = adaptive

    def propose(self, req: Req, limit: int) -> list[int]:
        conts, match = self._continuations(req, limit, 1)
        drafts = self._budgeted(req, conts[0] if conts else [], match)
        return drafts[:req.grammar.valid_prefix(drafts)] if req.grammar is not None and drafts else drafts

    def propose_tree(self, req: Req, limit: int) -> tuple[list[int], list[int] | None]:
        """Drafts and their parents (None: a chain): the continuations of the ``topk`` most recent
        matches (longest n first) merged into a trie, filled level by level (every candidate's first
        token, then every candidate's second, ...) up to ``limit`` nodes (and the request's draft
        budget). A request with a grammar gets a chain (its masks follow one path)."""
        if self.topk == 1 or req.grammar is not None:
            return self.propose(req, limit), None
        conts, match = self._continuations(req, limit, self.topk)
        limit = len(self._budgeted(req, conts[0] if conts else [], match))
        ids: list[int] = []
        parents: list[int] = []
        children: list[dict[int, int]] = [{}]  # per fed token (0 = the last sampled): token -> fed index
        at = [0] * len(conts)  # each candidate's node so far
        for depth in range(max((len(c) for c in conts), default=0)):
            for i, cont in enumerate(conts):
                if depth >= len(cont) or at[i] < 0:
                    continue
                node = children[at[i]].get(cont[depth])
                if node is None:
                    if len(ids) >= min(limit, self.num_draft):
                        at[i] = -1  # out of budget: this candidate stops here
                        continue
                    ids.append(cont[depth])
                    parents.append(at[i])
                    children.append({})
                    node = children[at[i]][cont[depth]] = len(ids)
                at[i] = node
        return ids, (None if parents == list(range(len(ids))) else parents)

    def verified(self, reqs: list[Req], verdicts: list[Verdict]) -> None:
        """Score each request's prediction of this step in its draft budget."""
        if not self.adaptive:
            return
        for req, v in zip(reqs, verdicts, strict=True):
            if req.draft_state is not None:
                req.draft_state.budget.score(req, v)

    def _budgeted(self, req: Req, drafts: list[int], match: int) -> list[int]:
        """The drafts of a match of ``match`` tokens that the request's budget lets it feed."""
        if not self.adaptive or req.draft_state is None:  # None: never asked for drafts yet
            return drafts
        return req.draft_state.budget.allow(drafts, match, len(req.output_ids))

    def _continuations(self, req: Req, limit: int, k: int) -> tuple[list[list[int]], int]:
        """Up to ``k`` continuations of ``limit`` tokens: after the longest suffix that occurred
        earlier, its most recent occurrences first (then shorter suffixes'), distinct positions;
        and the length of that longest matching suffix (0: none)."""
        limit = min(limit, self.num_draft)
        if limit <= 0:
            return [], 0
        tokens = req.fill_ids
        if req.draft_state is None:
            req.draft_state = _NgramState(_NgramIndex(self.topk), DraftBudget(self.num_draft))
        index = req.draft_state.index
        index.extend(tokens, self.min_n, self.max_n)
        out, seen, match = [], set(), 0
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            for pos in reversed(index.after.get(tuple(tokens[-n:]), ())):
                if pos in seen:
                    continue
                seen.add(pos)
                match = match or n  # the longest: n counts down
                # the match's continuation runs up to the end of the history; beyond it, a text
                # that repeats with period len - pos goes on repeating
                period = len(tokens) - pos
                out.append([tokens[pos + i % period] for i in range(limit)])
                if len(out) == k:
                    return out, match
        return out, match


class DraftBudget:
    """How many drafts one request may feed, from how its predictions fared (dynamic speculation,
    in the spirit of vLLM's and SGLang's: fewer drafts where they are rejected, none where they
    would only cost). Deterministic: it depends on the request's own tokens and verdicts only, not
    on the rest of the batch (but for a step short of KV, which drops every request's drafts
    unscored), so a seeded request stays reproducible; greedy outputs never change (verification is
    exact whatever is fed).

    * ``budget``: the most drafts to feed, ``0..num_draft``; it starts at ``num_draft``.
    * Each verify step *scores* the request's prediction: the drafts it fed, or — when it fed none
      although the drafter had a match (budget 0, or a weak match skipped) — the first token it
      would have proposed (a free guess: nothing is fed for it). All of them right (for a tree:
      accepted to its full depth): the budget grows by one. Otherwise it drops to the number that
      were right — so a rejection at the first draft stops drafting until a guess is right again.
    * A *weak* match (a suffix of at most ``WEAK_MATCH`` tokens, e.g. one token seen before) is
      drafted from only when the request's last scored prediction had a right token; otherwise
      its first token is only guessed.
    """

    WEAK_MATCH = 1  # suffix matches of at most this many tokens are weak

    def __init__(self, num_draft: int) -> None:
        self.num_draft = num_draft
        self.budget = num_draft
        self.last_right = False  # the last scored prediction had at least one right token
        # this step's unfed first draft, scored by the verdict, and the request's output length it follows (a
        # guess of a step that never verified, its request retracted in between, is not scored later)
        self.guess: int | None = None
        self.guess_at = -1

    def allow(self, drafts: list[int], match: int, at: int = -1) -> list[int]:
        """The drafts (of a suffix match of ``match`` tokens) to feed this step: its first
        ``budget``, or none (the first kept as this step's guess, after ``at`` output tokens)."""
        self.guess = None
        if not drafts:
            return []
        if self.budget == 0 or (match <= self.WEAK_MATCH and not self.last_right):
            self.guess, self.guess_at = drafts[0], at
            return []
        return drafts[:self.budget]

    def score(self, req: Req, verdict: Verdict) -> None:
        """``req`` fed ``req.draft_ids`` this step (none if the step dropped them); ``verdict`` is
        its outcome."""
        if req.draft_ids:
            predicted, right = _depth(req), verdict.num_accepted
        elif self.guess is not None and self.guess_at == len(req.output_ids):
            predicted, right = 1, int(verdict.tokens[0] == self.guess)
        else:
            return  # nothing predicted: no match, or drafts proposed and then dropped
        self.guess = None
        self.last_right = right > 0
        self.budget = min(self.num_draft, self.budget + 1) if right == predicted else right


def _depth(req: Req) -> int:
    """The longest path of fed drafts (a chain: all of them)."""
    if req.draft_parents is None:
        return len(req.draft_ids)
    depth = [0]
    for parent in req.draft_parents:
        depth.append(depth[parent] + 1)
    return max(depth)


class _NgramState:
    """The n-gram drafter's memory of one request (``req.draft_state``)."""

    def __init__(self, index: _NgramIndex, budget: DraftBudget) -> None:
        self.index = index
        self.budget = budget


class _NgramIndex:
    """n-gram (as a tuple) → the positions right after its ``keep`` most recent occurrences (oldest
    first), over every n-gram that ends before the last token (the current suffix must match an
    *earlier* one)."""

    def __init__(self, keep: int = 1) -> None:
        self.after: dict[tuple[int, ...], list[int]] = {}
        self.keep = keep
        self.num_indexed = 0  # n-grams ending at positions < num_indexed are in the index

    def extend(self, tokens: list[int], min_n: int, max_n: int) -> None:
        end = len(tokens) - 1
        for p in range(self.num_indexed, end):  # n-grams ending at position p
            for n in range(min_n, min(max_n, p + 1) + 1):
                seen = self.after.setdefault(tuple(tokens[p - n + 1:p + 1]), [])
                seen.append(p + 1)
                if len(seen) > self.keep:
                    del seen[0]
        self.num_indexed = max(self.num_indexed, end)


def verify(reqs: list[Req], lens: list[int], logits: torch.Tensor, mask: TokenMask | None = None,
           eos_token_ids: Collection[int] = ()) -> list[Verdict]:
    """Accept or reject each request's drafts. ``logits``: ``[sum(lens), V]`` fp32, request ``i``'s
    ``lens[i] = 1 + len(req.draft_ids)`` rows in order; ``mask``: grammar masks of those rows
    (``OutputProcessor.grammar_masks(reqs, drafts=True)``); ``eos_token_ids``: the model's EOS ids
    (``OutputProcessor.eos_token_ids``, for ``min_new_tokens``). A request whose logits are processed
    (``sampler.needs_processing``) has no drafts, and its one row is processed as the sampler does it,
    before the mask. Logprobs are the raw model's. The greedy targets (argmax of every row) and the
    emitted tokens' logprobs are read in one op each for the whole batch; only sampling and
    processing work row by row."""
    raw_logits = logits.float()  # [T, V]
    raw_argmax, raw_rows, lse = raw_distribution(raw_logits)  # [T], [T, V], [T]
    starts = prefix_sums(lens)
    processed = [i for i, r in enumerate(reqs) if needs_processing(r)]
    for i in processed:
        if reqs[i].draft_ids:
            raise ValueError(f"request {reqs[i].rid}: drafts for a request whose logits are processed "
                             f"(penalties, logit_bias or min_new_tokens)")
    # the one row of a processed request is its next token's: its first
    logits = process_logits(raw_logits, [starts[i] for i in processed], [reqs[i] for i in processed], mask,
                            eos_token_ids)  # [T, V]
    greedy = any(r.sampling.is_greedy for r in reqs)
    argmax = (raw_argmax if logits is raw_logits else logits.argmax(dim=-1)).tolist() if greedy else []  # [T]
    accepted: list[tuple[list[int], list[int]]] = []  # per request: (tokens, path)
    for req, n, offset in zip(reqs, lens, starts):
        drafts = req.draft_ids
        if len(drafts) != n - 1:
            raise ValueError(f"request {req.rid}: {len(drafts)} drafts for {n} fed tokens")
        children: list[list[int]] = [[] for _ in range(n)]  # fed index -> its children, in order
        for j, parent in enumerate(req.fed_parents()[1:], start=1):
            children[parent].append(j)
        if not req.sampling.is_greedy:
            accepted.append(_accept_sampled(logits[offset:offset + n], [-1] + drafts, children, req))
        else:
            accepted.append(_accept_greedy(argmax[offset:offset + n], [-1] + drafts, children))
    # raw logprob of token t at row r: raw_rows[r, t] - lse[r] (the sampler's raw_logprobs; only the
    # emitted tokens' are read)
    dev = raw_logits.device
    taken = torch.tensor([starts[i] + j for i, (_, path) in enumerate(accepted) for j in path], device=dev)  # [E]
    emitted = torch.tensor([t for tokens, _ in accepted for t in tokens], device=dev)  # [E]
    logprobs = (raw_rows[taken, emitted] - lse[taken]).tolist()
    out, k = [], 0
    for req, start, (tokens, path) in zip(reqs, starts, accepted):
        wants_top = req.return_logprob and req.sampling.top_logprobs_num
        tops = [top_logprobs(raw_rows[start + j], lse[start + j], req) if wants_top else [] for j in path]
        out.append(Verdict(tokens, logprobs[k:k + len(tokens)], tops, len(tokens) - 1, path))
        k += len(tokens)
    return out


def _accept_greedy(target: list[int], fed: list[int], children: list[list[int]]):
    """From the root, follow the child whose token is the target's argmax (``target[j]``: fed
    token ``j``'s); the argmax at the last node reached is the bonus. ``(tokens, path)``: the
    accepted drafts then the bonus, and the fed indices of the nodes whose rows gave them (0, then
    the accepted drafts')."""
    node, tokens, path = 0, [], [0]
    while True:
        nxt = next((c for c in children[node] if fed[c] == target[node]), None)
        tokens.append(target[node])
        if nxt is None:
            return tokens, path
        node = nxt
        path.append(node)


def _accept_sampled(rows: torch.Tensor, fed: list[int], children: list[list[int]], req: Req):
    """Speculative sampling down the tree: at each node try its children in order (accept child
    ``c`` with probability ``p(c)``, else remove ``c`` from ``p`` and renormalise); when none is
    accepted, draw the bonus from what is left of ``p``."""
    node, tokens, path = 0, [], [0]
    while True:
        p = target_probs(rows[node], req)
        for c in children[node]:
            if uniform(req) < float(p[fed[c]]):
                break
            p = p.clone()
            p[fed[c]] = 0.0  # max(p - one_hot(d), 0); its sum is 1 - p[d] > 0 after a rejection
            p = p / p.sum()
        else:
            tokens.append(draw(p, req))
            return tokens, path
        tokens.append(fed[c])
        node = c
        path.append(node)
