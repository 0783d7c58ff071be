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
  a request's live state or row: the verify step's ``observe`` computes the kept positions for real.

Cost per verify step: ``num_steps`` draft decode steps plus one draft forward over the ``1 +
num_steps`` fed tokens (the draft tokens fed again, now into the request's own slots). Trees
(``speculative_eagle_topk > 1``) are verified the same way by ``observe`` (``tree_parents``), but
this drafter proposes chains only.
"""

from __future__ import annotations

import dataclasses

import torch

from hyla.cache.layout import CacheLayout
from hyla.engine.model_runner import ModelRunner
from hyla.engine.request import Req
from hyla.engine.speculative import Drafter, drafter_batch
from hyla.model.config import ModelConfig


def draft_cache_layout(target: ModelConfig, draft: ModelConfig) -> CacheLayout:
    """The target's cache layout with the draft model's as its companion: each token slot also
    holds the draft's K/V, each state slot the draft's recurrent state (after the target's buffers)."""
    return dataclasses.replace(target.cache_layout, companion=draft.cache_layout)


def check_draft_model(target: ModelConfig, draft: ModelConfig, context_length: int) -> None:
    """``ValueError`` unless ``draft`` can draft for ``target``: the same vocabulary size, and a
    context (``max_position_embeddings``) at least the engine's ``context_length``."""
    if draft.vocab_size != target.vocab_size:
        raise ValueError(f"the draft model's vocabulary ({draft.vocab_size} tokens) is not the model's "
                         f"({target.vocab_size}): a draft model must share the model's tokenizer")
    if draft.max_position_embeddings < context_length:
        raise ValueError(f"the draft model's context ({draft.max_position_embeddings} tokens) is shorter than the "
                         f"engine's context length ({context_length}): set context_length <= "
                         f"{draft.max_position_embeddings}")


class DraftModelDrafter(Drafter):
    """Drafts from ``runner.model`` (a ``ModelRunner`` over the pools' companion buffers, on the
    engine's request table). ``scratch_kv``: reserved KV slots, ``num_draft`` per batch row;
    ``scratch_states``: reserved state slots, one per batch row."""

    def __init__(self, runner: ModelRunner, scratch_kv: list[int], scratch_states: list[int], num_draft: int):
        if num_draft < 1 or len(scratch_kv) < num_draft or not scratch_states:
            raise ValueError(f"the draft-model drafter needs num_draft >= 1 scratch KV slots and one scratch state "
                             f"slot per batch row, got num_draft={num_draft}")
        self.runner = runner
        self.model = runner.model
        self.num_draft = num_draft
        self.req_to_token = runner.req_to_token
        self.device = runner.device
        self.scratch_kv = [scratch_kv[i:i + num_draft] for i in range(0, len(scratch_kv) - num_draft + 1, num_draft)]
        self.scratch_states = list(scratch_states)
        # the draft's buffers (its runner's views of the pools' companion buffers) that hold something
        self._state_buffers = [b for b in (*runner.conv_states, *runner.ssm_states) if b.numel()]

    # ------------------------------------------------------------------------------------------
    # after every target forward: the same forward on the draft model
    # ------------------------------------------------------------------------------------------
    def observe(self, reqs: list[Req], lens: list[int], ckpts: list[tuple[int, int, int]],
                hidden: torch.Tensor | None) -> None:
        """The target fed ``lens[i]`` tokens of ``reqs[i]`` after its ``kv_len`` (drafts included, not
        committed yet) into the KV slots of its row, from and into its state slot, with state
        checkpoints ``ckpts``; run the draft model over the same, into its own buffers. Computes no
        logits (a one-token step computes one per request, as a decode step does)."""
        loc = torch.cat([self.req_to_token.read(r.req_pool_idx, r.kv_len, r.kv_len + n) for r, n in zip(reqs, lens)])
        if max(lens) == 1 and not ckpts:  # what the scheduler runs as a decode step (the fused kernels on CUDA)
            self.runner.forward_decode(reqs, loc)
            return
        trees = [r.fed_parents() for r in reqs] if any(r.draft_parents is not None for r in reqs) else None
        self.runner.forward_extend(reqs, lens, loc, list(ckpts), logit_rows=[[] for _ in reqs], tree_parents=trees)

    # ------------------------------------------------------------------------------------------
    # drafting
    # ------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def propose_batch(self, reqs: list[Req], limits: list[int]) -> list[list[int]]:
        """Up to ``min(limits[i], num_draft)`` greedy drafts of the draft model after each decoding
        request's last sampled token; one draft decode step per draft for the whole batch (requests
        whose limit is reached drop out). A request with a grammar keeps the grammar-valid prefix."""
        drafts: list[list[int]] = [[] for _ in reqs]
        want = [min(limit, self.num_draft) for limit in limits]
        rows = [i for i, k in enumerate(want) if k > 0]
        if not rows:
            return drafts
        if len(reqs) > min(len(self.scratch_kv), len(self.scratch_states)):
            raise ValueError(f"{len(reqs)} decoding requests, drafting scratch for {len(self.scratch_states)}")
        n = [reqs[i].kv_len for i in rows]  # position of each last sampled token
        tokens = [reqs[i].output_ids[-1] for i in rows]
        committed = [self.req_to_token.read(reqs[i].req_pool_idx, 0, m) for i, m in zip(rows, n)]  # positions 0..n-1
        self._copy_states([reqs[i].state_slot for i in rows], [self.scratch_states[i] for i in rows])
        runner = self.runner
        for j in range(max(want)):
            scratch = [torch.tensor(self.scratch_kv[i][:j + 1], dtype=torch.long) for i in rows]
            batch = drafter_batch(tokens, [m + j for m in n], [m + j for m in n], [1] * len(rows),
                                  [s[j:] for s in scratch], [torch.cat([c, s]) for c, s in zip(committed, scratch)],
                                  True, self.device, runner.k_buffers, runner.v_buffers,
                                  [self.scratch_states[i] for i in rows], runner.conv_states, runner.ssm_states)
            tokens = self.model.forward(batch).argmax(dim=-1).tolist()  # [B'] from [B', V]
            for i, t in zip(rows, tokens):
                drafts[i].append(t)
            keep = [k for k, i in enumerate(rows) if want[i] > j + 1]
            if len(keep) < len(rows):
                rows, n, committed = [rows[k] for k in keep], [n[k] for k in keep], [committed[k] for k in keep]
                tokens = [tokens[k] for k in keep]
            if not rows:
                break
        for r, d in zip(reqs, drafts):
            if r.grammar is not None and d:
                del d[r.grammar.valid_prefix(d):]
        return drafts

    def _copy_states(self, src: list[int], dst: list[int]) -> None:
        """The draft model's recurrent state of slots ``src[i]`` into ``dst[i]`` (the target's untouched)."""
        s = torch.tensor(src, dtype=torch.long, device=self.device)
        d = torch.tensor(dst, dtype=torch.long, device=self.device)
        for buf in self._state_buffers:
            buf.index_copy_(0, d, buf.index_select(0, s))
