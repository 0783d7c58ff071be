"""The MTP drafter: draft tokens from the checkpoint's own multi-token-prediction head.

``speculative_algorithm="mtp"``: the head of ``hyla/model/mtp.py`` reads pairs ``(token[p],
hidden[p-1])`` — a token and the model's final hidden state one position before it — and predicts
the token after ``token[p]``. Its attention layer needs the K/V of every earlier pair. The design:

* **Where the MTP KV lives.** One more attention layer in the KV pool (its last buffer:
  ``mtp_cache_layout`` counts it in the bytes per token), on the model's own slots: the pair
  ``(token[p], hidden[p-1])`` (RoPE position ``p - 1``) is stored in the KV slot of position ``p``,
  the slot of the token it embeds. Its value then depends on tokens ``0..p`` only, exactly what the
  tree keys that slot on. (Stored at ``p - 1``, as SGLang stores it, an entry would depend on the
  token *after* its slot, and a slot shared by two branches of the tree would hold the entry of
  whichever branch wrote it.) Position 0 has no pair; its slot's MTP entry is never read.

* **When it is written.** After every model forward (prefill chunk, verify step), before the
  commit (``observe``): the entries of the slots the forward fed, from the fed tokens and the
  forward's hidden states (for the first fed position, ``hidden[p-1]`` comes from the state slot,
  below). So the MTP KV is written into the same slots as the model's K/V at the same time, and
  enters the tree, is deduplicated, rolled back (rejected drafts: only the accepted positions'
  entries survive, and theirs come from the model's own hidden states) or freed together with it.

* **The hidden state travels with the recurrent state.** A state slot that holds the recurrent
  state after ``n`` tokens also holds ``hidden[n-1]`` (``StatePool.hidden_states``): ``observe``
  writes it into the request's live slot and into every checkpoint and verify scratch slot the
  forward filled, and everything that moves states moves it too — a prefix-cache hit's checkpoint
  copied into a request's slot, the commit of an accepted verify prefix, pending checkpoints, the
  release of a finished or retracted request. **After a cache hit** of ``m`` tokens the MTP reads
  the entries of slots ``1..m-1`` from the tree (computed from the same tokens) and computes slot
  ``m``'s from the checkpoint's ``hidden[m-1]``: it sees what it would see with the cache off, and a
  retracted request resumes with the same MTP context. Drafts are the same with the cache on or off
  (up to floating-point rounding, which can flip an argmax at a near-tie). Outputs never depend on
  the drafts: verification makes them exact.

* **Drafting** (``propose_batch``, each decode step; one MTP forward per draft step for all
  decoding requests): step ``j`` feeds ``(token[n+j], g)`` at RoPE position ``n - 1 + j``, where
  ``token[n]`` is the last sampled token (``n = kv_len``), ``g = hidden[n-1]`` from the request's
  state slot at ``j = 0`` and the MTP's own output hidden after that, and ``token[n+j+1]`` is the
  step's argmax (greedy drafts). These K/V go to scratch KV slots reserved per batch row
  (``CacheManager.reserve_kv``), never into a slot of the request's: they are guesses, and the
  verify step writes position ``n``'s real entry itself.

* **Trees** (``speculative_eagle_topk = k > 1``, ``propose_tree_batch``): the same steps as a beam
  search of width ``k`` (every beam a row with a table of its own: its request's pairs, then its
  path's scratch slots; a beam continues from its parent's output hidden state), the tree verified
  the greedy chain plus the likeliest other candidates (``speculative.tree_of``, shared with the
  draft model's trees). In the verify step's ``observe`` a tree's fed token ``f`` pairs with its
  parent's hidden state at RoPE position ``kv_len - 1 + depth(f)``, so the accepted path's entries,
  moved to their positions' slots by the commit, are the ones a chain would have written.

* **Its forwards are decode batches** (:meth:`MtpDrafter._rows`): every pair a row of one query
  with its own KV length, reading its request's slots from a table (a draft step's rows, and the
  pairs of a verify step's ``observe``, a few per request). The head's attention writes every row's
  K/V before any row reads, so a pair sees the pairs before it in the same batch. Such batches have
  shapes in the row count and the longest KV length only, so with ``compile_decode`` they run
  graphs compiled at start-up (:meth:`MtpDrafter.compile`: the head up to its LM head, one graph
  for a row and one for more; the LM head stays eager, and only a draft step needs it). A prefill's
  ``observe`` (a prompt's pairs) runs the eager extend: as rows its table would grow as the square
  of the prompt.

* **On a fused runner** (``fused``: the model's steps run the Triton kernels, on a GPU) the head's
  forwards over rows are fused decode batches too (:meth:`MtpDrafter._fused_batch`), on the
  request table's own rows: the device mirror from its second column is, row by row, the slots of
  the pairs ``1, 2, ...``, so a pair reads its request's pairs up to its own as a decode row reads
  its tokens. A draft writes its scratch slots into the request's row after the committed ones
  (positions that hold nothing between steps; the verify step writes its own slots there, as a
  draft model's steps do: ``draft_drafter.py``), and its steps keep the batch's shape (a request
  past its drafts pads), so on a GPU the whole draft of ``num_draft`` steps is one CUDA graph
  replay with one read of the drafts at the end, and a verify step's pairs another
  (``cuda_graph.CudaGraphMtp``).
"""

from __future__ import annotations

import torch

from hyla.cache.transfer import to_device_packed
from hyla.engine.cuda_graph import CudaGraphMtp
from hyla.engine.model_runner import (WARM_UP_BATCHES, WARM_UP_KV_ROWS, call_compiled, compile_step,
                                      fused_decode_batch, log_late_compile, prefix_sums, tree_positions,
                                      warm_up_config)
from hyla.engine.request import Req
from hyla.engine.speculative import (Beam, Candidate, Drafter, beam_kv_slots, drafter_batch, expand_beams, row_batch,
                                    scratch_rows, tree_of)
from hyla.model.forward_batch import ForwardBatch
from hyla.model.mtp import MtpHead


class MtpDrafter(Drafter):
    wants_hidden = True

    def __init__(self, head: MtpHead, kv_pool, state_pool, req_to_token, scratch_kv: list[int], num_draft: int,
                 fused: bool = False, cuda_graph_max_bs: int = 0, num_steps: int | None = None, topk: int = 1):
        """``kv_pool``'s last K/V buffers are the MTP layer's; ``state_pool`` must carry hidden
        states; ``scratch_kv``: reserved KV slots, ``beam_kv_slots(num_steps, topk)`` per batch row.
        Chains (``topk == 1``) of ``num_draft`` drafts (``num_steps`` is then ``num_draft``); with
        ``topk > 1`` trees of at most ``num_draft`` drafts, ``num_steps`` deep. ``fused``: the head's
        forwards over rows run the fused decode kernels (:meth:`_fused_batch`; the model's runner is
        fused), captured in CUDA graphs up to ``cuda_graph_max_bs`` requests on a GPU (0: never)."""
        if state_pool.hidden_states is None:
            raise ValueError("the MTP drafter needs a state pool with hidden states (mtp_cache_layout)")
        self.num_steps = num_draft if num_steps is None or topk == 1 else num_steps
        per_row = beam_kv_slots(self.num_steps, topk)
        if num_draft < 1 or self.num_steps < 1 or topk < 1 or len(scratch_kv) < per_row:
            raise ValueError(f"the MTP drafter needs num_draft >= 1, num_steps >= 1, topk >= 1 and {per_row} "
                             f"scratch KV slots per batch row, got num_draft={num_draft}, num_steps={self.num_steps}, "
                             f"topk={topk} and {len(scratch_kv)} slots")
        self.topk = topk
        self.head = head
        self.num_draft = num_draft
        self.k_buffer, self.v_buffer = kv_pool.k_buffers[-1], kv_pool.v_buffers[-1]  # [S, Hkv, D] each
        self.hidden_states = state_pool.hidden_states  # [num_slots + 1, H]
        self.req_to_token = req_to_token
        self.device = self.k_buffer.device
        self.scratch = scratch_rows(scratch_kv, per_row)
        self._compiled = None  # the head's graphs (compile)
        self.late_compiles = 0  # its forwards no graph of the start-up fitted: run eager
        self.fused = fused
        self.graphs: CudaGraphMtp | None = None
        if fused:
            # pair p's entry sits in the slot of position p (1, 2, ...): the request table's device
            # mirror from its second column lists a request's pairs in order, so row r of this view,
            # read up to kv_len p, is exactly the pairs 1..p (the row stride is the mirror's)
            self.table = req_to_token.add_mirror(self.device)[:, 1:]
            self.pad_row = req_to_token.padding_row  # never a request's: padding rows read and write it
            rows = max(cuda_graph_max_bs, 1) * (num_draft + 1)  # an observe's pairs: W per request
            self._arange = torch.arange(rows + 1, dtype=torch.long, device=self.device)
            self._no_state = torch.full((rows,), -1, dtype=torch.long, device=self.device)
            if cuda_graph_max_bs > 0 and self.device.type == "cuda":
                self.graphs = CudaGraphMtp(self, min(cuda_graph_max_bs, len(self.scratch)))

    @property
    def compiled(self) -> bool:
        """The head's forwards run graphs compiled at start-up (:meth:`compile`)."""
        return self._compiled is not None

    def compile(self) -> None:
        """``compile_decode``: the head's forwards up to its LM head through ``torch.compile``, its
        graphs (a row, more rows) compiled here on scratch buffers shaped like the real ones, with
        the sizes of ``ModelRunner``'s decode warm-up (distinct primes)."""
        self._compiled = None  # (until its graphs are made: eager, should making them fail)
        compiled = compile_step(self.head.hidden_states)
        h = self.hidden_states.shape[1]
        kb, vb = (torch.zeros(WARM_UP_KV_ROWS, *b.shape[1:], dtype=b.dtype, device=self.device)
                  for b in (self.k_buffer, self.v_buffer))
        with torch.inference_mode(), warm_up_config():
            for lens in WARM_UP_BATCHES:
                width = max(lens)
                tables = [torch.arange(1 + width * i, 1 + width * i + n) for i, n in enumerate(lens)]  # distinct slots
                batch = self._rows([3] * len(lens), [n - 1 for n in lens], [int(t[-1]) for t in tables], tables, lens,
                                   (kb, vb))
                compiled(batch, torch.zeros(len(lens), h, dtype=self.hidden_states.dtype, device=self.device))
        self._compiled = compiled

    def _hidden(self, batch: ForwardBatch, hidden: torch.Tensor) -> torch.Tensor:
        """The head up to its LM head over a batch of rows (:meth:`_rows`), ``g [T, H]``: through
        the compiled graphs when compiled, else eager."""
        if self._compiled is None:
            return self.head.hidden_states(batch, hidden)
        g, reason = call_compiled(self._compiled, self.head.hidden_states, batch, hidden)
        if reason is not None:
            self.late_compiles += 1
            log_late_compile(self.late_compiles, "MTP forward", reason)
        return g

    # ------------------------------------------------------------------------------------------
    # after every model forward: the MTP KV of the fed slots, the hidden state of each state slot
    # ------------------------------------------------------------------------------------------
    @torch.inference_mode()  # as the model's forwards (and the graphs compiled for the head: they guard on it)
    def observe(self, reqs: list[Req], lens: list[int], ckpts: list[tuple[int, int, int]],
                hidden: torch.Tensor | None, chain_rows: list[list[int]] | None = None) -> None:
        """``reqs[i]`` fed ``lens[i]`` tokens after its ``kv_len`` (not committed yet), whose final
        hidden states are ``hidden [sum(lens), H]``; the forward wrote the recurrent states of the
        requests' slots and of the checkpoint slots ``ckpts``. Writes the MTP entries of the fed
        slots, then the hidden state each of those state slots now follows."""
        if hidden is None:
            raise ValueError("the MTP drafter needs the model's hidden states")
        b = len(reqs)
        cu = prefix_sums(lens)
        slots = torch.tensor([r.state_slot for r in reqs], dtype=torch.long, device=self.device)
        before = self.hidden_states.index_select(0, slots)  # [B, H]: hidden[kv_len - 1] of each request
        ids, pos, src, prefix, extend, loc, kv = [], [], [], [], [], [], []
        for i, (r, n) in enumerate(zip(reqs, lens)):
            a = r.kv_len
            first = max(a, 1)  # position 0 has no pair
            if a + n <= first:
                continue
            row = self.req_to_token.read(r.req_pool_idx, 1, a + n)  # KV slots of positions 1 .. a+n-1
            ids += r.tokens(first, a + n)
            if r.draft_parents is None:
                pos += range(first - 1, a + n - 1)
                # hidden[p-1]: the state slot's for p == a, else this forward's row of position p - 1
                src += [i if p == a else b + cu[i] + p - 1 - a for p in range(first, a + n)]
            else:  # a verify step's tree (a >= 1): fed token f continues its parent's row, at a - 1 + its depth
                parents = r.fed_parents()
                pos += tree_positions(parents, a - 1)
                src += [i] + [b + cu[i] + q for q in parents[1:]]
            prefix.append(first - 1)
            extend.append(a + n - first)
            loc.append(row[first - 1:])
            kv.append(row)
        if ids:
            pairs = torch.cat([before, hidden.to(before.dtype)]).index_select(
                0, torch.tensor(src, dtype=torch.long, device=self.device))  # [T', H]
            # a verify step's: a row per pair, pair p seeing pairs 1..p (a tree's pair sees the fed pairs
            # before it, its ancestors and others: only the K/V are kept, and they depend on the pair alone)
            if max(extend) <= self.num_draft + 1:
                tables = [t for t, n in zip(kv, extend) for _ in range(n)]
                kv_lens = [p + 1 for q, n in zip(prefix, extend) for p in range(q, q + n)]
                loc = [int(t[k - 1]) for t, k in zip(tables, kv_lens)]
                # fused: on the request table's rows (a chain's forward synced its slots into their device
                # mirror; a tree's eager extend did not, so its pairs read stale slots there: harmless, as above)
                if self.fused:
                    rows = [r.req_pool_idx for r, n in zip(reqs, extend) for _ in range(n)]
                    self._pairs_fused(ids, pos, rows, kv_lens, loc, pairs)
                else:
                    self._hidden(self._rows(ids, pos, loc, tables, kv_lens), pairs)  # K/V only
            else:
                batch = self._batch(ids, pos, prefix, extend, loc, kv)
                self.head.hidden_states(batch, pairs)  # K/V only
        dst = [r.state_slot for r in reqs] + [slot for _, _, slot in ckpts]
        rows = [cu[i + 1] - 1 for i in range(b)] + [cu[i] + m - 1 for i, m, _ in ckpts]
        self.hidden_states.index_copy_(0, torch.tensor(dst, dtype=torch.long, device=self.device),
                                       hidden.index_select(0, torch.tensor(rows, device=hidden.device)).to(
                                           self.hidden_states.dtype))

    # ------------------------------------------------------------------------------------------
    # drafting
    # ------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def propose_batch(self, reqs: list[Req], limits: list[int]) -> list[list[int]]:
        """Up to ``min(limits[i], num_steps)`` greedy MTP drafts (a chain: ``num_steps`` is
        ``num_draft``) after each decoding request's last sampled token; one MTP forward per draft
        step for the whole batch (requests whose limit is reached drop out). A request with a
        grammar keeps the grammar-valid prefix of its drafts."""
        drafts: list[list[int]] = [[] for _ in reqs]
        want = [min(limit, self.num_steps) for limit in limits]
        rows = [i for i, k in enumerate(want) if k > 0]
        if not rows:
            return drafts
        if len(reqs) > len(self.scratch):
            raise ValueError(f"{len(reqs)} decoding requests, scratch KV for {len(self.scratch)}")
        if self.fused:
            self._draft_fused(reqs, want, drafts)
        else:
            self._draft_rows(reqs, rows, want, drafts)
        for r, d in zip(reqs, drafts):
            if r.grammar is not None and d:
                del d[r.grammar.valid_prefix(d):]
        return drafts

    @torch.inference_mode()
    def propose_tree_batch(self, reqs: list[Req], limits: list[int]) -> list[tuple[list[int], list[int] | None]]:
        """``topk > 1``: a tree of at most ``min(limits[i], num_draft)`` drafts per decoding request, from
        a beam search of width ``topk`` over the head's log-probabilities, ``num_steps`` deep (a request
        with a grammar: width 1, its grammar-valid chain). Every beam is a row of each step's batch
        (:meth:`_rows`) reading a table of its own: its request's pairs, then its path's scratch KV slots.
        The head keeps no recurrent state, so a beam continues from its parent's output hidden state
        (a row of the step's output, nothing copied). Candidates and the tree verified:
        ``speculative.expand_beams`` and ``tree_of`` (the greedy chain always in it)."""
        out: list[tuple[list[int], list[int] | None]] = [([], None) for _ in reqs]
        budget = [min(limit, self.num_draft) for limit in limits]
        live = [i for i, k in enumerate(budget) if k > 0]
        if not live:
            return out
        if len(reqs) > len(self.scratch):
            raise ValueError(f"{len(reqs)} decoding requests, scratch KV for {len(self.scratch)}")
        widths = [1 if r.grammar is not None else self.topk for r in reqs]
        depth = {i: min(self.num_steps, budget[i]) for i in live}
        n = {i: reqs[i].kv_len for i in live}  # position of each last sampled token
        committed = {i: self.req_to_token.read(reqs[i].req_pool_idx, 1, n[i]) for i in live}  # pairs 1..n-1
        # a beam's state: its row of g, the hidden state its next pair reads
        beams = {i: [Beam(-1, reqs[i].output_ids[-1], 0.0, k, [], True)] for k, i in enumerate(live)}
        g = self.hidden_states.index_select(0, torch.tensor([reqs[i].state_slot for i in live], device=self.device))
        nodes: dict[int, list[Candidate]] = {i: [] for i in live}
        used = {i: 0 for i in live}
        for j in range(self.num_steps):
            live = [i for i in live if depth[i] > j]
            if not live:
                break
            fed = [(i, b) for i in live for b in beams[i]]
            for i, b in fed:  # the pair's K/V go to the request's next scratch KV slot
                b.path = b.path + [self.scratch[i][used[i]]]
                used[i] += 1
            batch = self._rows([b.token for _, b in fed], [n[i] - 1 + j for i, _ in fed], [b.path[-1] for _, b in fed],
                               [torch.cat([committed[i], torch.tensor(b.path, dtype=torch.long)]) for i, b in fed],
                               [n[i] + j for i, _ in fed])
            g = self._hidden(batch, g.index_select(0, torch.tensor([b.state for _, b in fed], device=self.device)))
            nxt = expand_beams(self.head.target.lm_head(g), live, beams, nodes, widths, j + 1)
            row = 0  # a request's beams are consecutive rows of g: a child continues from its parent's row
            for i in live:
                first, row = row, row + len(beams[i])
                beams[i] = [beams[i][k].child(c, nodes[i][c], first + k) for c, k in nxt[i]]
        for i in nodes:
            out[i] = tree_of(nodes[i], budget[i], reqs[i].grammar)
        return out

    def _draft_rows(self, reqs: list[Req], rows: list[int], want: list[int], drafts: list[list[int]]) -> None:
        """:meth:`propose_batch`'s draft steps as batches of rows with tables of their own
        (:meth:`_rows`: the PyTorch ops, or the graphs ``compile_decode`` compiled), appended to
        ``drafts``; a request drops out of the batch once it has its ``want``."""
        n = [reqs[i].kv_len for i in rows]  # position of each last sampled token
        tokens = [reqs[i].output_ids[-1] for i in rows]
        # each row's table: its pairs' slots (positions 1..n-1), then its scratch slots
        tables = [torch.cat([self.req_to_token.read(reqs[i].req_pool_idx, 1, m),
                             torch.tensor(self.scratch[i][:self.num_steps], dtype=torch.long)]) for i, m in zip(rows, n)]
        g = self.hidden_states.index_select(0, torch.tensor([reqs[i].state_slot for i in rows], device=self.device))
        for j in range(max(want)):
            batch = self._rows(tokens, [m - 1 + j for m in n], [self.scratch[i][j] for i in rows], tables,
                               [m + j for m in n])
            g = self._hidden(batch, g)  # [B', H]
            tokens = self.head.target.lm_head(g).argmax(dim=-1).tolist()
            for i, t in zip(rows, tokens):
                drafts[i].append(t)
            keep = [k for k, i in enumerate(rows) if want[i] > j + 1]
            if len(keep) < len(rows):
                rows, n, tables = [rows[k] for k in keep], [n[k] for k in keep], [tables[k] for k in keep]
                tokens = [tokens[k] for k in keep]
                g = g[torch.tensor(keep, dtype=torch.long, device=g.device)]
            if not rows:
                break

    def _draft_fused(self, reqs: list[Req], want: list[int], drafts: list[list[int]]) -> None:
        """:meth:`propose_batch`'s draft steps through the fused decode kernels, on the requests' own
        rows: request ``i``'s scratch KV slots are written into its row after its ``n = kv_len``
        committed slots (positions that hold nothing between steps: ``kv_allocated == kv_len``, and
        the verify step writes its own slots there), so step ``j``'s pair (position ``n + j``) reads
        pairs ``1..n + j`` from the row. Every request takes every step, padded after its ``want``
        (a padding row: the spare request row, KV slot 0), so the steps have the batch's shape only:
        replayed from a CUDA graph of the whole loop on a GPU, one read of the drafts at the end."""
        b, k = len(reqs), max(want)
        live = [i for i in range(b) if want[i]]
        self.req_to_token.write_batch([reqs[i].req_pool_idx for i in live], [reqs[i].kv_len for i in live],
                                      [want[i] for i in live], [s for i in live for s in self.scratch[i][:want[i]]])
        self.req_to_token.sync_mirror()
        pad = (0, self.pad_row, 1, 0)

        def row(i: int, j: int) -> tuple[int, int, int, int]:  # step j's pair of request i (position n + j)
            r = reqs[i]
            return (r.kv_len - 1 + j, r.req_pool_idx, r.kv_len + j, self.scratch[i][j]) if j < want[i] else pad

        # [k, 4, B]: each step's RoPE positions, request rows, KV lengths (pairs read), KV slots
        cols = torch.tensor([list(zip(*(row(i, j) for i in range(b)))) for j in range(k)], dtype=torch.long)
        tokens = torch.tensor([r.output_ids[-1] for r in reqs], dtype=torch.long)
        slots = torch.tensor([r.state_slot for r in reqs], dtype=torch.long)
        if self.graphs is not None and self.graphs.can_run(b):
            out = self.graphs.draft(cols, tokens, slots)  # [num_draft, B]
        else:
            cols, tokens, slots = to_device_packed([cols, tokens, slots], self.device)
            out = self.draft_steps(cols, tokens, self.hidden_states.index_select(0, slots))  # [k, B]
        for i, column in enumerate(out[:k].T.tolist()):
            drafts[i] += column[:want[i]]

    @torch.no_grad()  # captured at start-up, outside inference mode
    def draft_steps(self, cols: torch.Tensor, tokens: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """``k`` fused draft steps of ``B`` rows on the device, no host read (what
        :class:`CudaGraphMtp` captures): ``cols [k, 4, B]`` each step's positions, request rows, KV
        lengths (pairs read) and KV slots, ``tokens [B]`` the first step's tokens, ``g [B, H]`` its
        hidden states; step ``j + 1`` feeds step ``j``'s argmax and output hidden state. Returns
        the drafts ``[k, B]``."""
        out = []
        for step in cols:
            g = self.head.hidden_states(self._fused_batch(tokens, *step), g)  # [B, H]
            tokens = self.head.target.lm_head(g).argmax(dim=-1)  # [B]
            out.append(tokens)
        return torch.stack(out)

    @torch.no_grad()  # captured at start-up, outside inference mode
    def pair_pass(self, cols: torch.Tensor, pairs: torch.Tensor) -> torch.Tensor:
        """The head over pairs as fused decode rows (K/V written; what :class:`CudaGraphMtp`
        captures): ``cols [5, T]`` tokens, positions, request rows, KV lengths, KV slots; ``pairs
        [T, H]`` their hidden states. Returns ``g [T, H]``."""
        return self.head.hidden_states(self._fused_batch(*cols), pairs)

    def _pairs_fused(self, ids: list[int], pos: list[int], rows: list[int], kv_lens: list[int], loc: list[int],
                     pairs: torch.Tensor) -> None:
        """:meth:`observe`'s pairs of a verify step through :meth:`pair_pass` (replayed from a CUDA
        graph on a GPU, padded to the smallest captured row count)."""
        cols = torch.tensor([ids, pos, rows, kv_lens, loc], dtype=torch.long)  # [5, T]
        if self.graphs is not None and self.graphs.can_run_pairs(len(ids)):
            self.graphs.pairs(cols, pairs)
        else:
            self.pair_pass(to_device_packed([cols], self.device)[0], pairs)

    def _fused_batch(self, input_ids: torch.Tensor, positions: torch.Tensor, req_rows: torch.Tensor,
                     kv_lens: torch.Tensor, out_cache_loc: torch.Tensor) -> ForwardBatch:
        """A fused decode batch of pairs over the MTP layer's KV buffer (``fused_decode_batch``), device
        tensors ``[B]`` each:
        row ``r`` feeds ``input_ids[r]`` at RoPE position ``positions[r]``, its K/V written at slot
        ``out_cache_loc[r]``, attending to the first ``kv_lens[r]`` pairs of request row
        ``req_rows[r]`` (:attr:`table`: its own last). No host value is read."""
        b = input_ids.shape[0]
        none = self._no_state[:b] if b <= self._no_state.numel() else torch.full((b,), -1, dtype=torch.long,
                                                                                 device=self.device)
        return fused_decode_batch(input_ids, positions, none, req_rows, kv_lens, out_cache_loc, self._arange,
                                  self.table, [self.k_buffer], [self.v_buffer], [], [])

    # ------------------------------------------------------------------------------------------
    def _rows(self, ids: list[int], pos: list[int], loc: list[int], tables: list[torch.Tensor], kv_lens: list[int],
              buffers: tuple[torch.Tensor, torch.Tensor] | None = None) -> ForwardBatch:
        """A decode batch over the MTP layer's KV buffer (``buffers``: others, for the warm-up): row
        ``r`` is the pair ``ids[r]`` at RoPE position ``pos[r]``, its K/V written at slot ``loc[r]``,
        attending to the pairs at the first ``kv_lens[r]`` slots of ``tables[r]`` (its own last)
        (:func:`row_batch`)."""
        kb, vb = buffers if buffers is not None else (self.k_buffer, self.v_buffer)
        return row_batch(ids, pos, loc, tables, kv_lens, self.device, [kb], [vb])

    def _batch(self, ids: list[int], pos: list[int], prefix_lens: list[int], extend_lens: list[int],
               loc: list[torch.Tensor], kv: list[torch.Tensor]) -> ForwardBatch:
        """An extend batch over the MTP layer's KV buffer only (a prefill's pairs): sequence ``i``
        writes ``extend_lens[i]`` pairs at slots ``loc[i]`` after ``prefix_lens[i]`` earlier pairs;
        ``kv[i]`` are all its pairs' slots."""
        return drafter_batch(ids, pos, prefix_lens, extend_lens, loc, kv, self.device, [self.k_buffer],
                             [self.v_buffer])
