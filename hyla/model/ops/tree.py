"""Token trees: a speculative verify step that feeds each sequence a *tree* of draft tokens.

Tree verification (speculative decoding with ``topk > 1`` drafts) feeds each sequence its last
sampled token followed by draft tokens that need not form one chain: new token ``j`` of a sequence
continues new token ``parents[j]`` of the same sequence (``parents[0] == -1``: the first token
continues the sequence's cached prefix). A token at depth ``d`` (``d`` steps below the first) has
position ``prefix_len + d``; every layer must compute, for each token, exactly what a plain run of
its *path* (the first token, ..., its parent, itself) would:

* attention: token ``j`` sees the prefix and its ancestors-or-self among the new tokens
  (:attr:`TokenTree.masks`, one ``[E, E]`` mask per sequence; the batched short-extend attention
  builds one mask for the whole batch, ``ops/attention.py``);
* recurrent layers (conv windows, SSM states): the state entering token ``j`` is the state its
  parent left. :func:`tree_scan` runs an op's *decode update* level by level (all tokens of depth
  ``d`` of every sequence in one call), so each token's output and state equal those of decode
  steps along its path: bitwise where the op computes its per-token terms as a decode step does
  (Gated DeltaNet, KDA, the conv), within an ulp of those terms where it computes them once for all
  the tokens (Mamba1's and Mamba2's softplus and ``exp``, as their padded chains do). The conv op needs no scan: a token's window is its ``K - 1``
  nearest ancestors (:meth:`TreeScan.conv_rows`).

A chain is the tree ``parents = [-1, 0, 1, ...]``. Checkpoints keep their meaning ("the state after
``n`` new tokens" = after new token ``n - 1``, i.e. after its path), and a sequence's own slot
receives the state after its *last* new token, as on the chain path.

The scan on *lanes*
-------------------
:class:`TreeScan` lays a batch's trees out once per step (``ForwardBatch`` builds it; every
recurrent layer of the forward shares it). A *lane* is one row of a working state buffer: each
sequence starts on its own lane holding its state, a token's first child continues on its parent's
lane (updated in place), and every further child forks a new lane (a copy of the parent's state,
taken before the level runs). A chain therefore never copies a state: sequence ``i`` lives on one
lane from its first token to its last, and the step only writes the checkpoint states it was asked
for plus each sequence's final state. When every sequence is a chain and their slots are one
ascending run, the lanes *are* the pool rows (no gather, no scatter: what a decode step does).
Sequences are ranked longest first, so the lanes of the tokens at any depth are one run of rows
starting at 0 in the chain case (the op updates a view of them).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Callable, Sequence

import torch

from hyla.model.ops.varlen import Checkpoints, SlotPlan, VarlenPlan, as_slot_plan, write_rows_


@dataclass(frozen=True)
class TokenTree:
    """The validated trees of one batch (host facts only; :meth:`plan` lays out the scan)."""

    parents: tuple[tuple[int, ...], ...]  # per sequence, per new token: parent offset (-1: the prefix)
    depths: tuple[int, ...]  # [T] depth of each packed token
    starts: tuple[int, ...]  # [B+1] packed offset of each sequence's first new token
    device: torch.device
    is_chain: bool = False  # every sequence's new tokens form one chain

    @cached_property
    def masks(self) -> tuple[torch.Tensor | None, ...]:
        """Per sequence: ``[E, E]`` bool, ``mask[j, a]`` iff new token ``a`` is ``j`` or one of its
        ancestors (what attention lets ``j`` see among the new tokens); None when ``E == 0``."""
        return tuple(_ancestor_mask(list(par), self.device) if par else None for par in self.parents)

    @property
    def batch_size(self) -> int:
        return len(self.parents)

    @property
    def num_tokens(self) -> int:
        return len(self.depths)

    @property
    def lengths(self) -> list[int]:
        return [self.starts[i + 1] - self.starts[i] for i in range(self.batch_size)]

    @classmethod
    def build(cls, parents: Sequence[Sequence[int]], extend_lens: Sequence[int],
              device: torch.device | str) -> "TokenTree":
        """Validate ``parents`` (one list per sequence, ``extend_lens[i]`` entries: ``-1`` for the
        first, then each an earlier offset); ``ValueError`` on a bad tree."""
        if len(parents) != len(extend_lens):
            raise ValueError(f"tree_parents has {len(parents)} sequences, the batch {len(extend_lens)}")
        depths: list[int] = []
        starts = [0]
        chain = True
        for i, (par, n) in enumerate(zip(parents, extend_lens)):
            par = list(par)
            if len(par) != n:
                raise ValueError(f"sequence {i}: {len(par)} tree parents for {n} new tokens")
            d: list[int] = []
            for j, p in enumerate(par):
                if (j == 0) != (p == -1) or not -1 <= p < j:
                    raise ValueError(f"sequence {i}: token {j} has parent {p}; the first token's parent "
                                     "must be -1 and every other token's an earlier token")
                d.append(0 if p < 0 else d[p] + 1)
                chain = chain and p == j - 1
            depths.extend(d)
            starts.append(starts[-1] + n)
        return cls(tuple(tuple(p) for p in parents), tuple(depths), tuple(starts), torch.device(device), chain)

    @classmethod
    def chains(cls, extend_lens: Sequence[int], device: torch.device | str) -> "TokenTree":
        """Every sequence's new tokens as one chain (a short extend run token by token)."""
        starts = [0]
        for n in extend_lens:
            starts.append(starts[-1] + n)
        return cls(tuple(tuple(range(-1, n - 1)) for n in extend_lens),
                   tuple(j for n in extend_lens for j in range(n)), tuple(starts), torch.device(device), True)

    def positions(self, prefix_lens: Sequence[int]) -> list[int]:
        """``[T]`` absolute position of each packed token: its sequence's prefix length + its depth."""
        return [prefix_lens[i] + self.depths[t] for i in range(self.batch_size)
                for t in range(self.starts[i], self.starts[i + 1])]

    def plan(self, slots: SlotPlan, ckpts: Checkpoints) -> "TreeScan":
        """Lay the scan out for these (validated) state slots and checkpoints."""
        return TreeScan.build(self, slots, ckpts)


def _ancestor_mask(parents: list[int], device) -> torch.Tensor:
    """``[E, E]`` bool: ``mask[j, a]`` iff ``a`` is ``j`` or an ancestor of ``j``."""
    n = len(parents)
    rows = []
    for j in range(n):
        row = [False] * n
        a = j
        while a >= 0:
            row[a] = True
            a = parents[a]
        rows.append(row)
    return torch.tensor(rows, dtype=torch.bool, device=device)


@dataclass(frozen=True)
class ScanLevel:
    """The tokens of one depth, the next ``size`` in scan order (the inputs are permuted into scan
    order once): their lanes, the forks to take before they run and the checkpoints to write after."""

    size: int
    lanes: SlotPlan  # [size] the lane of each token (rows of the lane buffer)
    forks: tuple[torch.Tensor, torch.Tensor] | None  # (parent lanes, new lanes): copies before the step
    ckpt: "_RowCopy | None"  # lanes holding a checkpoint's state after the step -> their pool rows


@dataclass(frozen=True)
class TreeScan:
    """A batch's token trees laid out for its state slots and checkpoints, once per step (see the
    module docstring): what :func:`tree_scan` and the conv op's tree path run on, pool-agnostic (the
    conv and SSM pools of every linear layer share it)."""

    tree: TokenTree
    slots: SlotPlan  # [B] each sequence's own slot (validated)
    num_lanes: int
    in_place: bool  # the lanes are the pool rows slots.first .. + B (chains in ascending slots)
    lane_init: SlotPlan  # [B] the slot each sequence's lane starts from (rank order)
    levels: tuple[ScanLevel, ...]
    scan_index: torch.Tensor | None  # [T] packed token at each scan position (None: the same order)
    unscan_index: torch.Tensor | None  # [T] scan position of each packed token
    final: "_RowCopy | None"  # lanes of the sequences' last tokens -> their own slots (buffered scan)
    # the states a step leaves, by packed token (the conv op's tree path): each checkpoint's token,
    # then the last token of each sequence that writes its own slot -> the pool rows they go to
    write_tokens: torch.Tensor | None  # [M + W]
    write_slots: torch.Tensor | None  # [M + W]
    _conv_rows: dict[int, torch.Tensor] = field(default_factory=dict, repr=False, compare=False)

    @property
    def batch_size(self) -> int:
        return self.tree.batch_size

    @property
    def num_tokens(self) -> int:
        return self.tree.num_tokens

    @cached_property
    def level_sizes(self) -> list[int]:
        return [lv.size for lv in self.levels]

    @classmethod
    def build(cls, tree: TokenTree, slots: SlotPlan, ckpts: Checkpoints) -> "TreeScan":
        b, starts, dev = tree.batch_size, tree.starts, tree.device
        lengths = tree.lengths
        if slots.batch_size != b:
            raise ValueError(f"the token tree has {b} sequences, the state slots {slots.batch_size}")
        host = slots.host
        order = sorted(range(b), key=lambda i: -lengths[i])  # rank -> sequence, longest first (stable)
        rank = [0] * b
        for r, i in enumerate(order):
            rank[i] = r
        seq_of = [i for i in range(b) for _ in range(lengths[i])]
        by_depth: list[list[int]] = [[] for _ in range(max(tree.depths, default=-1) + 1)]
        for t, d in enumerate(tree.depths):
            by_depth[d].append(t)
        lane_of = [0] * tree.num_tokens
        continued = [False] * tree.num_tokens  # a token whose lane a child already continues
        num_lanes = b
        ckpt_at: dict[int, list[int]] = {}  # token -> the checkpoints taken after it
        for m, (i, n) in enumerate(zip(ckpts.seq, ckpts.num_tokens)):
            ckpt_at.setdefault(starts[i] + n - 1, []).append(m)
        levels, scan_order = [], []
        for d, tokens in enumerate(by_depth):
            forks_src, forks_dst = [], []
            for t in tokens:
                i = seq_of[t]
                if d == 0:
                    lane_of[t] = rank[i]
                    continue
                p = starts[i] + tree.parents[i][t - starts[i]]
                if not continued[p]:
                    lane_of[t], continued[p] = lane_of[p], True
                else:
                    lane_of[t] = num_lanes
                    forks_src.append(lane_of[p])
                    forks_dst.append(num_lanes)
                    num_lanes += 1
            tokens = sorted(tokens, key=lambda t: lane_of[t])
            ck = [(lane_of[t], m) for t in tokens for m in ckpt_at.get(t, ())]
            levels.append(ScanLevel(
                size=len(tokens), lanes=SlotPlan.rows([lane_of[t] for t in tokens], dev),
                forks=(_long(forks_src, dev), _long(forks_dst, dev)) if forks_src else None,
                ckpt=_RowCopy.build([lane for lane, _ in ck], _pick(ckpts, [m for _, m in ck]), dev)
                if ck else None))
            scan_order.extend(tokens)
        identity = scan_order == list(range(tree.num_tokens))
        unscan = [0] * len(scan_order)
        for pos, t in enumerate(scan_order):
            unscan[t] = pos
        writers = [i for i in range(b) if lengths[i] and host[i] >= 0]
        last = [starts[i + 1] - 1 for i in writers]
        in_place = tree.is_chain and slots.first is not None and order == list(range(b))
        if order == list(range(b)):
            lane_init = slots
        else:  # the same (validated) slots in rank order
            ranked = [host[i] for i in order]
            lane_init = SlotPlan.build(slots.index.index_select(0, _long(order, slots.index.device)),
                                       max(ranked) + 1, host=ranked)
        return cls(
            tree=tree, slots=slots, num_lanes=num_lanes, in_place=in_place, lane_init=lane_init, levels=tuple(levels),
            scan_index=None if identity else _long(scan_order, dev),
            unscan_index=None if identity else _long(unscan, dev),
            final=_RowCopy.build([lane_of[t] for t in last], [host[i] for i in writers], dev)
            if writers and not in_place else None,
            write_tokens=_long([starts[i] + n - 1 for i, n in zip(ckpts.seq, ckpts.num_tokens)] + last, dev)
            if ckpts.num_checkpoints or writers else None,
            write_slots=_long(_pick(ckpts, list(range(ckpts.num_checkpoints))) + [host[i] for i in writers], dev)
            if ckpts.num_checkpoints or writers else None,
        )

    def conv_rows(self, kernel: int) -> torch.Tensor:
        """``[T, K]`` rows of the conv op's extended input (each sequence's ``K - 1`` window entries,
        sequence by sequence, then the ``T`` packed tokens): token ``t``'s receptive field, oldest
        first — its ``K - 1`` nearest ancestors, continued into its sequence's window, then itself."""
        if kernel not in self._conv_rows:
            tree, w = self.tree, kernel - 1
            base = self.batch_size * w
            rows = []
            for i in range(self.batch_size):
                par = tree.parents[i]
                for j in range(len(par)):
                    field_rows = [base + tree.starts[i] + j]
                    a, depth = j, tree.depths[tree.starts[i] + j]
                    for m in range(1, kernel):
                        if m <= depth:
                            a = par[a]
                            field_rows.append(base + tree.starts[i] + a)
                        else:  # before the first new token: the window, newest entry first
                            field_rows.append(i * w + w - (m - depth))
                    rows.append(field_rows[::-1])
            self._conv_rows[kernel] = torch.tensor(rows, dtype=torch.long, device=self.tree.device).view(-1, kernel)
        return self._conv_rows[kernel]

    def run(self, step: "StepFn", inputs: Sequence[torch.Tensor], pool: torch.Tensor) -> torch.Tensor:
        """:func:`tree_scan` on this layout."""
        if self.scan_index is not None:
            inputs = [x.index_select(0, self.scan_index) for x in inputs]
        if self.in_place:  # the lanes are the pool rows themselves
            first = self.slots.first
            lanes = pool[first:first + self.batch_size]
        else:
            lanes = pool.new_empty(self.num_lanes, *pool.shape[1:])  # [lanes, *state]
            init = lanes[:self.batch_size]  # each sequence's state, gathered straight into its lane
            torch.index_select(pool, 0, self.lane_init.read_index, out=init)
            if self.lane_init.pad_rows is not None:  # padding starts from zeros
                init.index_fill_(0, self.lane_init.pad_rows, 0)
        outs = []
        per_level = [x.split(self.level_sizes) for x in inputs] if len(self.levels) > 1 else [[x] for x in inputs]
        for d, lv in enumerate(self.levels):
            if lv.forks is not None:
                lanes.index_copy_(0, lv.forks[1], lanes.index_select(0, lv.forks[0]))
            outs.append(step(*(x[d] for x in per_level), lanes, lv.lanes))
            if lv.ckpt is not None:
                lv.ckpt.run(lanes, pool, self.in_place)
        if self.final is not None:
            self.final.run(lanes, pool, False)
        if not outs:
            raise ValueError("tree_scan needs at least one token")
        out = torch.cat(outs) if len(outs) > 1 else outs[0]
        return out if self.unscan_index is None else out.index_select(0, self.unscan_index)


def _long(values: Sequence[int], device) -> torch.Tensor:
    return torch.tensor(list(values), dtype=torch.long, device=device)


@dataclass(frozen=True)
class _RowCopy:
    """Copy lane rows into pool rows, ``pool[dst[i]] = lanes[src[i]]``: one slice copy when both are
    ascending runs (the usual chain case), else a gather and ``index_copy_``."""

    src: slice | torch.Tensor
    dst: torch.Tensor
    dst_run: slice | None  # ``dst`` as a slice when it is an ascending run

    @classmethod
    def build(cls, src: list[int], dst: list[int], device) -> "_RowCopy":
        run = _rows(dst, device)
        return cls(_rows(src, device), _long(dst, device), run if isinstance(run, slice) else None)

    def run(self, lanes: torch.Tensor, pool: torch.Tensor, lanes_in_pool: bool) -> None:
        if isinstance(self.src, slice) and self.dst_run is not None:
            pool[self.dst_run].copy_(lanes[self.src])  # distinct rows, even when the lanes are pool rows
        elif isinstance(self.src, slice):  # index_copy_ must not read the tensor it writes: copy first
            write_rows_(pool, self.dst, lanes[self.src].clone() if lanes_in_pool else lanes[self.src])
        else:
            write_rows_(pool, self.dst, lanes.index_select(0, self.src))


def _rows(values: list[int], device) -> slice | torch.Tensor:
    """Rows as a slice when they are one ascending run (a view, no gather), else an index."""
    if values == list(range(values[0], values[0] + len(values))):
        return slice(values[0], values[0] + len(values))
    return _long(values, device)


def _pick(ckpts: Checkpoints, entries: list[int]) -> list[int]:
    """The pool rows of checkpoint ``entries`` (host values)."""
    slots = ckpts.slot_list or tuple(ckpts.slot.tolist())
    return [slots[m] for m in entries]


StepFn = Callable[..., torch.Tensor]
"""An op's decode update ``step(*per_token_inputs, pool, slots) -> out``: one token per row, reads
and writes ``pool[slots]`` in place (``slots`` a :class:`SlotPlan`)."""


def tree_scan(step: StepFn, inputs: Sequence[torch.Tensor], pool: torch.Tensor, slots: torch.Tensor | SlotPlan,
              tree: "TokenTree | TreeScan", ckpts: Checkpoints | None = None) -> torch.Tensor:
    """Run ``step`` over every token of ``tree``, each from its parent's state: ``inputs`` are
    per-token tensors ``[T, ...]``; returns ``step``'s outputs ``[T, ...]`` in packed order.

    Sequence ``i`` starts from ``pool[slots[i]]`` (zeros for ``-1``) and its slot receives the state
    after its last new token; checkpoint ``m`` receives the state after new token
    ``ckpts.num_tokens[m] - 1`` of sequence ``ckpts.seq[m]``. All reads precede all writes to rows
    a sequence reads. ``tree`` may be a :class:`TreeScan` built for these slots and checkpoints
    (then ``slots`` and ``ckpts`` are not looked at)."""
    if not isinstance(tree, TreeScan):
        plan = as_slot_plan(slots, pool, tree.batch_size)
        tree = tree.plan(plan, ckpts if ckpts is not None else Checkpoints([], [], plan.index[:0]))
    return tree.run(step, inputs, pool)


def check_tree(tree: TokenTree, lengths: Sequence[int]) -> None:
    """``tree`` must describe exactly these sequences' new tokens."""
    if tree.lengths != list(lengths):
        raise ValueError(f"the token tree covers sequences of {tree.lengths} tokens, the batch has {list(lengths)}")


def short_extend_tree(tree: TokenTree | None, lengths: Sequence[int], device) -> TokenTree | None:
    """The tree an op scans: the given one (checked), or chains when every sequence feeds at most
    :data:`SHORT_EXTEND` tokens (a verify step, a short cached tail: token by token with the decode
    step's math is cheaper than padding each to a chunk, and equals decode steps: module docstring), or None
    (the chunked path)."""
    if tree is not None:
        check_tree(tree, lengths)
        return tree
    if lengths and 0 < max(lengths) <= SHORT_EXTEND:
        return TokenTree.chains(lengths, device)
    return None


def plan_scan(tree: "TokenTree | TreeScan | None", cu_seqlens: torch.Tensor, num_tokens: int,
              slots: torch.Tensor, pool: torch.Tensor, ckpt_seq: torch.Tensor | None,
              ckpt_len: torch.Tensor | None, ckpt_slot: torch.Tensor | None,
              device: torch.device, varlen: VarlenPlan | None = None) -> tuple["TreeScan | None", VarlenPlan | None]:
    """What a recurrent extend op runs: ``(scan, None)`` for a tree or short extend, else ``(None,
    plan)`` for its chunked path. Prebuilt plans (``ForwardBatch`` validated its slots and
    checkpoints once) are used as they are and carry the checkpoints, so ``ckpt_*`` must be None: a
    :class:`TreeScan`, or ``varlen`` (a :class:`VarlenPlan`); otherwise the tensors are validated here."""
    if isinstance(tree, TreeScan):
        if ckpt_seq is not None or ckpt_len is not None or ckpt_slot is not None:
            raise ValueError("a TreeScan carries its checkpoints: pass ckpt_seq, ckpt_len and ckpt_slot as None")
        if tree.num_tokens != num_tokens or cu_seqlens.numel() != tree.batch_size + 1:
            raise ValueError(f"the tree scan covers {tree.batch_size} sequences and {tree.num_tokens} tokens, the "
                             f"batch has {cu_seqlens.numel() - 1} and {num_tokens}")
        return tree, None
    if varlen is not None:
        varlen.check(cu_seqlens, num_tokens, ckpt_seq, ckpt_len, ckpt_slot)
    else:
        varlen = VarlenPlan.from_tensors(cu_seqlens, num_tokens, slots, pool, ckpt_seq, ckpt_len, ckpt_slot, device)
    tree = short_extend_tree(tree, list(varlen.lengths), device)
    if tree is None:
        return None, varlen
    return tree.plan(varlen.slots, varlen.ckpts), None


SHORT_EXTEND = 8
"""Extends of at most this many tokens per sequence run token by token (:func:`tree_scan`)."""
