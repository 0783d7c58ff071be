"""Token trees: a speculative verify step that feeds each sequence a *tree* of draft tokens.

Tree verification (speculative decoding with ``topk > 1`` drafts) feeds each sequence its last
sampled token followed by draft tokens that need not form one chain: new token ``j`` of a sequence
continues new token ``parents[j]`` of the same sequence (``parents[0] == -1``: the first token
continues the sequence's cached prefix). A token at depth ``d`` (``d`` steps below the first) has
position ``prefix_len + d``; every layer must compute, for each token, exactly what a plain run of
its *path* (the first token, ..., its parent, itself) would:

* attention: token ``j`` sees the prefix and its ancestors-or-self among the new tokens
  (:attr:`TokenTree.masks`, one ``[E, E]`` mask per sequence);
* recurrent layers (conv windows, SSM states): the state entering token ``j`` is the state its
  parent left. :func:`tree_scan` runs an op's *decode update* level by level (all tokens of depth
  ``d`` of every sequence in one call), so each token's output and state equal those of decode
  steps along its path, bitwise.

A chain is the tree ``parents = [-1, 0, 1, ...]``. Checkpoints keep their meaning ("the state after
``n`` new tokens" = after new token ``n - 1``, i.e. after its path), and a sequence's own slot
receives the state after its *last* new token, as on the chain path.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Callable, Sequence

import torch

from hyla.model.ops.varlen import Checkpoints, SlotPlan, gather_states, scatter_states


@dataclass(frozen=True)
class TreeLevel:
    tokens: torch.Tensor  # [N] packed indices of the new tokens at this depth (every sequence)
    parent_rows: torch.Tensor  # [N] scan-buffer rows of their parents (a sequence's row for depth 0)
    rows: SlotPlan  # their own scan-buffer rows: one ascending run (the ops update them in place)


@dataclass(frozen=True)
class TokenTree:
    """The validated trees of one batch (host facts and the index tensors every layer shares).

    The scan buffer of :func:`tree_scan` has ``B + T`` rows: row ``i < B`` holds sequence ``i``'s
    state entering the step, row ``B + r`` the state after the ``r``-th token in depth-major order
    (all depth-0 tokens, then all depth-1 tokens, ...), so each level is one contiguous run.
    """

    parents: tuple[tuple[int, ...], ...]  # per sequence, per new token: parent offset (-1: the prefix)
    depths: tuple[int, ...]  # [T] depth of each packed token
    row_of: tuple[int, ...]  # [T] scan-buffer row of each packed token
    starts: tuple[int, ...]  # [B+1] packed offset of each sequence's first new token
    levels: tuple[TreeLevel, ...]
    device: torch.device

    @cached_property
    def masks(self) -> tuple[torch.Tensor | None, ...]:
        """Per sequence: ``[E, E]`` bool, ``mask[j, a]`` iff new token ``a`` is ``j`` or one of its
        ancestors (what attention lets ``j`` see among the new tokens); None when ``E == 0``."""
        return tuple(_ancestor_mask(list(par), self.device) if par else None for par in self.parents)

    @property
    def is_chain(self) -> bool:
        return all(p == j - 1 for par in self.parents for j, p in enumerate(par))

    @property
    def batch_size(self) -> int:
        return len(self.parents)

    @property
    def num_tokens(self) -> int:
        return len(self.depths)

    @classmethod
    def build(cls, parents: Sequence[Sequence[int]], extend_lens: Sequence[int],
              device: torch.device | str) -> "TokenTree":
        """Validate ``parents`` (one list per sequence, ``extend_lens[i]`` entries: ``-1`` for the
        first, then each an earlier offset) and lay out the scan; ``ValueError`` on a bad tree."""
        if len(parents) != len(extend_lens):
            raise ValueError(f"tree_parents has {len(parents)} sequences, the batch {len(extend_lens)}")
        depths: list[int] = []
        starts = [0]
        for i, (par, n) in enumerate(zip(parents, extend_lens)):
            par = list(par)
            if len(par) != n:
                raise ValueError(f"sequence {i}: {len(par)} tree parents for {n} new tokens")
            for j, p in enumerate(par):
                if (j == 0) != (p == -1) or not -1 <= p < j:
                    raise ValueError(f"sequence {i}: token {j} has parent {p}; the first token's parent "
                                     "must be -1 and every other token's an earlier token")
            d: list[int] = []
            for p in par:
                d.append(0 if p < 0 else d[p] + 1)
            depths.extend(d)
            starts.append(starts[-1] + n)
        b, order = len(parents), sorted(range(len(depths)), key=lambda t: (depths[t], t))
        row_of = [0] * len(depths)
        for r, t in enumerate(order):
            row_of[t] = b + r
        seq_of = [i for i, n in enumerate(extend_lens) for _ in range(n)]
        long = dict(dtype=torch.long, device=device)
        levels, first = [], 0
        for depth in range(max(depths, default=-1) + 1):
            tokens = [t for t in order if depths[t] == depth]
            par_rows = [seq_of[t] if depth == 0 else row_of[starts[seq_of[t]] + parents[seq_of[t]][t - starts[seq_of[t]]]]
                        for t in tokens]
            rows = list(range(b + first, b + first + len(tokens)))
            first += len(tokens)
            levels.append(TreeLevel(torch.tensor(tokens, **long), torch.tensor(par_rows, **long),
                                    SlotPlan.build(torch.tensor(rows, **long), b + len(depths), host=rows)))
        return cls(tuple(tuple(p) for p in parents), tuple(depths), tuple(row_of), tuple(starts), tuple(levels),
                   torch.device(device))

    @classmethod
    def chains(cls, extend_lens: Sequence[int], device: torch.device | str) -> "TokenTree":
        """Every sequence's new tokens as one chain (a short extend run token by token)."""
        return cls.build([[j - 1 for j in range(n)] for n in extend_lens], extend_lens, device)

    def positions(self, prefix_lens: Sequence[int]) -> list[int]:
        """``[T]`` absolute position of each packed token: its sequence's prefix length + its depth."""
        return [prefix_lens[i] + self.depths[t] for i in range(self.batch_size)
                for t in range(self.starts[i], self.starts[i + 1])]


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


StepFn = Callable[..., torch.Tensor]
"""An op's decode update ``step(*per_token_inputs, pool, slots) -> out``: one token per row, reads
and writes ``pool[slots]`` in place (``slots`` a :class:`SlotPlan`)."""


def tree_scan(step: StepFn, inputs: Sequence[torch.Tensor], pool: torch.Tensor, slots: torch.Tensor,
              tree: TokenTree, ckpts: Checkpoints | None = None) -> torch.Tensor:
    """Run ``step`` over every token of ``tree``, each from its parent's state: ``inputs`` are
    per-token tensors ``[T, ...]``; returns ``step``'s outputs ``[T, ...]`` in packed order.

    Sequence ``i`` starts from ``pool[slots[i]]`` (zeros for ``-1``) and its slot receives the state
    after its last new token; checkpoint ``m`` receives the state after new token
    ``ckpts.num_tokens[m] - 1`` of sequence ``ckpts.seq[m]``. All reads precede all writes."""
    b = tree.batch_size
    buf = pool.new_empty(b + tree.num_tokens, *pool.shape[1:])  # the scan buffer (see TokenTree)
    buf[:b] = gather_states(pool, slots, pool.dtype)
    out = None
    for level in tree.levels:
        first = level.rows.first
        buf[first:first + level.tokens.numel()] = buf.index_select(0, level.parent_rows)
        o = step(*(x.index_select(0, level.tokens) for x in inputs), buf, level.rows)
        if out is None:
            out = o.new_empty(tree.num_tokens, *o.shape[1:])
        out.index_copy_(0, level.tokens, o)
    if out is None:  # no tokens at all
        raise ValueError("tree_scan needs at least one token")
    if ckpts is not None and ckpts.num_checkpoints:
        rows = [tree.row_of[tree.starts[i] + n - 1] for i, n in zip(ckpts.seq, ckpts.num_tokens)]
        scatter_states(pool, ckpts.slot, buf.index_select(0, torch.tensor(rows, device=buf.device)))
    last = [tree.row_of[tree.starts[i + 1] - 1] if tree.starts[i + 1] > tree.starts[i] else i for i in range(b)]
    scatter_states(pool, slots, buf.index_select(0, torch.tensor(last, device=buf.device)))
    return out


def check_tree(tree: TokenTree, lengths: Sequence[int]) -> None:
    """``tree`` must describe exactly these sequences' new tokens."""
    if [tree.starts[i + 1] - tree.starts[i] for i in range(tree.batch_size)] != list(lengths):
        raise ValueError(f"the token tree covers sequences of {[len(p) for p in tree.parents]} tokens, "
                         f"the batch has {list(lengths)}")


def short_extend_tree(tree: TokenTree | None, lengths: Sequence[int], device) -> TokenTree | None:
    """The tree an op scans: the given one (checked), or chains when every sequence feeds at most
    :data:`SHORT_EXTEND` tokens (a verify step, a short cached tail: token by token with the decode
    step's math is cheaper than padding each to a chunk, and equals decode steps bitwise), or None
    (the chunked path)."""
    if tree is not None:
        check_tree(tree, lengths)
        return tree
    if lengths and 0 < max(lengths) <= SHORT_EXTEND:
        return TokenTree.chains(lengths, device)
    return None


SHORT_EXTEND = 8
"""Extends of at most this many tokens per sequence run token by token (:func:`tree_scan`)."""
