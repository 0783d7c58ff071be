"""The draft-model drafter: draft tokens from a separate small model with the same vocabulary.

``speculative_algorithm="draft"``, ``speculative_draft_model_path=PATH`` (SGLang's standalone
draft worker): any model hyla loads — another architecture than the target's too — whose
vocabulary is the target's. It has attention KV and recurrent states of its own, and they must
stay exactly in step with the target's through everything the engine does to a request's memory:
prefix-cache hits, chunked prefill, verify steps that keep only part of what they fed, trees,
retraction, eviction. The design:

* **Where the draft's memory lives: on the target's slots.** The draft model's K/V buffers and
  recurrent-state buffers are the pools' *companion* buffers (``CacheLayout.companion``,
  :func:`draft_cache_layout`: counted in the bytes per token and per state slot, so pool sizing
  stays right): KV slot ``t`` also holds the draft's K/V of the token in it, state slot ``s`` the
  draft's state after the same tokens as the target's state in ``s``. Every slot operation of the
  engine covers both (``KVPool.copy``, ``StatePool.alloc`` / ``copy`` / ``fork``): the checkpoint
  copied into a request's slot on a cache hit (copy-on-write), checkpoints forked into the tree,
  the verify commit (the accepted position's state copied into the live slot, rejected KV rolled
  back, a tree's accepted path moved to its positions' slots), pending grid checkpoints, release
  and retraction. Neither the cache manager nor the tree knows the draft exists.

* **When it is written: after every target forward, with the same metadata** (``observe``, called
  before the commit). The draft model runs over exactly the tokens the target was fed, into the
  same KV slots, from and into the same state slot per request, writing its state at the same
  checkpoints (a prefill's tree checkpoints, a verify step's per-token scratch slots) and over the
  same token tree. So whatever the commit keeps of the target's memory it keeps of the draft's:
  the draft's live state is the state after exactly ``kv_len`` committed tokens and its KV that of
  the committed tokens, always. After a cache hit of ``m`` tokens the draft reads its K/V of
  positions ``< m`` from the tree's slots and its state from the hit's checkpoint, computed from the
  same tokens: drafts are the same with the cache on or off, up to floating-point rounding (a
  prefix computed in other chunks), which can flip an argmax at a near-tie. Outputs never depend on
  the drafts: verification makes them exact.

* **Drafting** (``propose_batch``, each decode step): ``speculative_num_steps`` greedy decode steps
  of the draft model for all decoding requests at once. Each request's draft state is copied into
  a scratch state slot (the draft's buffers only), then step ``j`` feeds ``token[n + j]`` at
  position ``n + j`` (``n = kv_len``; ``token[n]`` is the last sampled token, then the drafts) with
  its K/V in scratch KV slots, and its argmax is the next draft. Both scratch kinds are reserved per
  batch row at start (``CacheManager.reserve_states`` / ``reserve_kv``), so drafting never touches
  a request's live state or committed slots: the verify step's ``observe`` computes the kept
  positions for real. The steps are decode steps of the draft model's runner on the requests' own
  rows: the scratch KV slots are written into each row after its committed ones (positions that
  hold nothing between steps, where the verify step then writes its own), so every decode path
  serves them as it serves the engine's decode steps — the graphs ``compile_decode`` compiled, the
  fused kernels and their CUDA graphs (``ModelRunner.forward_decode_rows``).

* **Trees** (``speculative_eagle_topk = k > 1``, ``propose_tree_batch``): the same loop as a beam
  search of width ``k`` — every beam a row of the step's batch, with its own scratch state slot (a
  sibling starts from a copy of its parent's) and its path's scratch KV slots; the candidates are
  ranked by path log-probability and the greedy chain plus the best others are verified
  (``_draft``). A request's beams cannot share its row: each reads a KV table of its own, the
  committed slots then its path's (``speculative.row_batch``: the compiled graphs serve it, the
  fused kernels do not). The verify step's tree goes through ``observe`` like any forward
  (``tree_parents``).

Cost per verify step: ``num_steps`` draft decode steps (of every beam) plus one draft forward over
the fed tokens (the drafts fed again, now into the request's own slots).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Sequence

import torch

from hyla.cache.layout import CacheLayout
from hyla.engine.model_runner import ModelRunner
from hyla.engine.request import Req
from hyla.engine.speculative import Beam, Candidate, Drafter, beam_kv_slots, expand_beams, row_batch, scratch_rows, tree_of
from hyla.model.config import ModelConfig

if TYPE_CHECKING:
    from hyla.tokenizer import Tokenizer


def draft_cache_layout(target: ModelConfig, draft: ModelConfig) -> CacheLayout:
    """The target's cache layout with the draft model's as its companion: each token slot also
    holds the draft's K/V, each state slot the draft's recurrent state (after the target's buffers)."""
    return dataclasses.replace(target.cache_layout, companion=draft.cache_layout)


def check_draft_model(target: ModelConfig, draft: ModelConfig, context_length: int,
                      target_tokenizer: Tokenizer | None = None, draft_tokenizer: Tokenizer | None = None) -> None:
    """``ValueError`` unless ``draft`` can draft for ``target``: the same vocabulary size, the same
    token for every id when both have a tokenizer (without tokenizer files only the sizes can be
    compared), and a context (``max_position_embeddings``) at least the engine's ``context_length``."""
    if draft.vocab_size != target.vocab_size:
        raise ValueError(f"the draft model's vocabulary ({draft.vocab_size} tokens) is not the model's "
                         f"({target.vocab_size}): a draft model must share the model's tokenizer")
    if target_tokenizer is not None and draft_tokenizer is not None:
        size = max(target_tokenizer.vocab_size, draft_tokenizer.vocab_size)
        differ = next((i for i in range(size)
                       if target_tokenizer.id_to_token(i) != draft_tokenizer.id_to_token(i)), None)
        if differ is not None:
            raise ValueError(f"the draft model's tokenizer differs from the model's (token id {differ}: "
                             f"{draft_tokenizer.id_to_token(differ)!r} vs {target_tokenizer.id_to_token(differ)!r}): "
                             "a draft model must share the model's tokenizer")
    if draft.max_position_embeddings < context_length:
        raise ValueError(f"the draft model's context ({draft.max_position_embeddings} tokens) is shorter than the "
                         f"engine's context length ({context_length}): set context_length <= "
                         f"{draft.max_position_embeddings}")


class DraftModelDrafter(Drafter):
    """Drafts from ``runner.model`` (a ``ModelRunner`` over the pools' companion buffers, on the
    engine's request table): chains of ``num_steps`` greedy drafts, or with ``topk > 1`` trees of
    depth ``num_steps`` and at most ``num_draft`` nodes. ``scratch_kv`` / ``scratch_states``:
    reserved slots, :meth:`scratch_per_row` of each per batch row."""

    def __init__(self, runner: ModelRunner, scratch_kv: list[int], scratch_states: list[int], num_draft: int,
                 num_steps: int | None = None, topk: int = 1):
        self.num_steps = num_draft if num_steps is None else num_steps
        kv_per_row, states_per_row = self.scratch_per_row(self.num_steps, topk)
        if num_draft < 1 or topk < 1 or len(scratch_kv) < kv_per_row or len(scratch_states) < states_per_row:
            raise ValueError(f"the draft-model drafter needs num_draft >= 1, topk >= 1 and scratch slots for a batch "
                             f"row ({kv_per_row} KV, {states_per_row} state), got num_draft={num_draft}, topk={topk}, "
                             f"{len(scratch_kv)} KV and {len(scratch_states)} state slots")
        self.runner = runner
        self.model = runner.model
        self.num_draft = num_draft
        self.topk = topk
        self.req_to_token = runner.req_to_token
        self.device = runner.device
        self.scratch_kv = scratch_rows(scratch_kv, kv_per_row)
        self.scratch_states = scratch_rows(scratch_states, states_per_row)
        # the draft's buffers (its runner's views of the pools' companion buffers) that hold something
        self._state_buffers = [b for b in (*runner.conv_states, *runner.ssm_states) if b.numel()]

    @property
    def late_compiles(self) -> int:
        """The draft model's steps that no graph compiled at start-up fitted (run eager)."""
        return self.runner.late_compiles

    @staticmethod
    def scratch_per_row(num_steps: int, topk: int) -> tuple[int, int]:
        """(KV slots, state slots) drafting takes per batch row: one KV slot per token it feeds
        (``speculative.beam_kv_slots``) and one state slot per beam."""
        return beam_kv_slots(num_steps, topk), topk

    # ------------------------------------------------------------------------------------------
    # after every target forward: the same forward on the draft model
    # ------------------------------------------------------------------------------------------
    def observe(self, reqs: list[Req], lens: list[int], ckpts: list[tuple[int, int, int]],
                hidden: torch.Tensor | None, chain_rows: list[list[int]] | None = None) -> None:
        """The target fed ``lens[i]`` tokens of ``reqs[i]`` after its ``kv_len`` (drafts included, not
        committed yet) into the KV slots of its row, from and into its state slot, with state
        checkpoints ``ckpts`` (as padded chains with checkpoint rows ``chain_rows``); run the draft
        model over the same, into its own buffers, as the target ran: a decode step as a decode step,
        padded chains as padded chains where the draft's runner runs them (the same width; its
        compiled graphs or CUDA graphs), anything else as an eager extend that computes no logits."""
        loc = torch.cat([self.req_to_token.read(r.req_pool_idx, r.kv_len, r.kv_len + n) for r, n in zip(reqs, lens)])
        if max(lens) == 1 and not ckpts:  # what the scheduler runs as a decode step (the fused kernels on CUDA)
            self.runner.forward_decode(reqs, loc)
            return
        trees = [r.fed_parents() for r in reqs] if any(r.draft_parents is not None for r in reqs) else None
        if chain_rows is not None and self.runner.verify_width == len(chain_rows[0]) + 1 \
                and (trees is None or self.runner.verify_trees):
            self.runner.forward_chains(reqs, lens, loc, chain_rows, tree_parents=trees)
            return
        self.runner.forward_extend(reqs, lens, loc, list(ckpts), logit_rows=[[] for _ in reqs], tree_parents=trees)

    # ------------------------------------------------------------------------------------------
    # drafting
    # ------------------------------------------------------------------------------------------
    def propose_batch(self, reqs: list[Req], limits: list[int]) -> list[list[int]]:
        """Up to ``min(limits[i], num_draft)`` greedy drafts of the draft model after each decoding
        request's last sampled token (a chain; a request with a grammar keeps its grammar-valid prefix)."""
        return [ids for ids, _ in self._draft(reqs, limits, [1] * len(reqs))]

    def propose_tree_batch(self, reqs: list[Req], limits: list[int]) -> list[tuple[list[int], list[int] | None]]:
        """A tree of at most ``min(limits[i], num_draft)`` drafts per decoding request (a request with
        a grammar: a chain, its masks follow one path): see :meth:`_draft`."""
        return self._draft(reqs, limits, [1 if r.grammar is not None else self.topk for r in reqs])

    @torch.inference_mode()
    def _draft(self, reqs: list[Req], limits: list[int], widths: list[int]) -> list[tuple[list[int], list[int] | None]]:
        """Beam search of width ``widths[i]`` over the draft model's log-probabilities, ``num_steps``
        deep, for all requests at once (one draft decode step per depth for every live beam; requests
        drop out at their depth, ``min(num_steps, budget)``): every child a beam expanded (its top
        ``width`` tokens) is a candidate scored by its path's log-probability (``expand_beams``), and
        the tree verified is the greedy chain plus the best other candidates up to ``budget =
        min(limit, num_draft)`` nodes (``speculative.tree_of``, EAGLE-2's reranking). Width 1 is the
        greedy chain. A request with a grammar keeps the grammar-valid prefix of its chain."""
        out: list[tuple[list[int], list[int] | None]] = [([], None) for _ in reqs]
        budget = [min(limit, self.num_draft) for limit in limits]
        live = [i for i, b in enumerate(budget) if b > 0]
        if not live:
            return out
        if len(reqs) > min(len(self.scratch_kv), len(self.scratch_states)):
            raise ValueError(f"{len(reqs)} decoding requests, drafting scratch for {len(self.scratch_states)} rows")
        depth = {i: min(self.num_steps, budget[i]) for i in live}
        nodes: dict[int, list[Candidate]] = {i: [] for i in live}
        self._copy_states([reqs[i].state_slot for i in live], [self.scratch_states[i][0] for i in live])
        if max(widths) == 1:  # chains: the draft steps are decode steps on the requests' own rows
            rows, starts = [reqs[i].req_pool_idx for i in live], [reqs[i].kv_len for i in live]
            self._paths_in_rows(rows, starts, [self.scratch_kv[i][:depth[i]] for i in live])
            self._search(reqs, live, depth, nodes, widths, in_rows=True)
        else:
            self._search(reqs, live, depth, nodes, widths, in_rows=False)
        for i in nodes:
            out[i] = tree_of(nodes[i], budget[i], reqs[i].grammar)
        return out

    def _search(self, reqs: list[Req], live: list[int], depth: dict[int, int], nodes: dict[int, list[Candidate]],
                widths: list[int], in_rows: bool) -> None:
        """:meth:`_draft`'s beam search, filling ``nodes``: one draft decode step per depth for every
        live beam of the requests ``live`` (``reqs[i]`` drops out after ``depth[i]`` steps), each
        beam's state in its scratch state slot (the first beam's already holds the request's), the
        fed tokens' K/V in the request's scratch KV slots. ``in_rows`` (chains, one beam each): the
        steps read the requests' own rows, where :meth:`_paths_in_rows` put those slots
        (``ModelRunner.forward_decode_rows``: every decode path, the fused kernels' CUDA graphs
        included); else a table per beam, the committed slots then its path's
        (``speculative.row_batch``, ``ModelRunner.forward_batch``)."""
        n = {i: reqs[i].kv_len for i in live}  # position of each last sampled token
        committed = {} if in_rows else {i: self.req_to_token.read(reqs[i].req_pool_idx, 0, n[i]) for i in live}
        beams = {i: [Beam(-1, reqs[i].output_ids[-1], 0.0, self.scratch_states[i][0], [], True)] for i in live}
        used_kv = {i: 0 for i in live}
        runner = self.runner
        for j in range(self.num_steps):
            live = [i for i in live if depth[i] > j]
            if not live:
                break
            fed = [(i, b) for i in live for b in beams[i]]
            for i, b in fed:  # the fed token's K/V go to the request's next scratch KV slot
                b.path = b.path + [self.scratch_kv[i][used_kv[i]]]
                used_kv[i] += 1
            ids, pos, states, kv_lens = ([b.token for _, b in fed], [n[i] + j for i, _ in fed],
                                         [b.state for _, b in fed], [n[i] + j + 1 for i, _ in fed])
            if in_rows:
                logits = runner.forward_decode_rows(ids, pos, states, [reqs[i].req_pool_idx for i, _ in fed], kv_lens,
                                                    torch.tensor([b.path[-1] for _, b in fed], dtype=torch.long))
            else:
                logits = runner.forward_batch(row_batch(
                    ids, pos, [b.path[-1] for _, b in fed],
                    [torch.cat([committed[i], torch.tensor(b.path, dtype=torch.long)]) for i, b in fed], kv_lens,
                    self.device, runner.k_buffers, runner.v_buffers, states, runner.conv_states, runner.ssm_states))
            nxt = expand_beams(logits, live, beams, nodes, widths, j + 1)  # a request's beams: consecutive rows
            if j + 1 < self.num_steps:
                copies = self._next_beams([i for i in live if depth[i] > j + 1], nodes, nxt, beams)
                if copies:
                    self._copy_states(*zip(*copies))

    def _paths_in_rows(self, rows: list[int], starts: list[int], paths: list[list[int]]) -> None:
        """Chains drafted on the requests' own rows: ``paths[i]`` (the scratch KV slots of its draft
        steps' fed tokens) written into request-table row ``rows[i]`` after its ``starts[i]``
        committed slots. Those positions hold nothing between steps (``kv_allocated == kv_len``:
        ``CacheManager``; past it a row holds stale slots), and the verify step writes its own
        slots there. The writes reach the device mirror with the draft step's sync."""
        self.req_to_token.write_batch(rows, starts, [len(p) for p in paths], [slot for p in paths for slot in p])

    def _next_beams(self, rows: list[int], nodes: dict[int, list[Candidate]], nxt: dict[int, list[tuple[int, int]]],
                    beams: dict[int, list[Beam]]) -> list[tuple[int, int]]:
        """Request ``i``'s next beams ``nxt[i]`` (:func:`expand_beams`). A child continues from its parent
        beam's state: the first child of a parent takes the parent's state slot as it is, another child
        a slot no beam keeps, into which the parent's state is copied. Returns those copies ``(src,
        dst)`` (sources and destinations disjoint)."""
        copies = []
        for i in rows:
            kept = {parent for _, parent in nxt[i]}
            in_use = {b.state for b in beams[i]}
            spare = [beams[i][k].state for k in range(len(beams[i])) if k not in kept] + \
                [s for s in self.scratch_states[i] if s not in in_use]
            taken: set[int] = set()
            new = []
            for node, parent in nxt[i]:
                src = beams[i][parent]
                if parent not in taken:
                    taken.add(parent)
                    state = src.state
                else:
                    state = spare.pop()
                    copies.append((src.state, state))
                new.append(src.child(node, nodes[i][node], state))
            beams[i] = new
        return copies

    def _copy_states(self, src: Sequence[int], dst: Sequence[int]) -> None:
        """The draft model's recurrent state of slots ``src[i]`` into ``dst[i]`` (the target's untouched)."""
        s = torch.tensor(list(src), dtype=torch.long, device=self.device)
        d = torch.tensor(list(dst), dtype=torch.long, device=self.device)
        for buf in self._state_buffers:
            buf.index_copy_(0, d, buf.index_select(0, s))

