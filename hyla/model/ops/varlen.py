"""Packed variable-length batches for the linear-attention ops: validation, state gather/scatter,
checkpoint plans, the chunk layout and running a chunked scan on the state pool.

Conventions shared by ``conv1d``, ``gated_delta``, ``kda`` and ``ssd`` (see docs/architecture.md, "ops"):

* Tokens of all sequences are packed: sequence ``i`` owns rows ``cu_seqlens[i]:cu_seqlens[i+1]``.
* ``slots[i]`` is the state-pool row sequence ``i`` reads its initial state from and writes its
  final state back to, in place. ``-1`` means padding: the sequence starts from zeros, its outputs
  are don't-care, and nothing is written. A fresh sequence simply owns a zeroed slot.
* Checkpoint ``j``: after sequence ``ckpt_seq[j]`` consumed ``ckpt_len[j]`` (``1..extend_len``) of its
  new tokens, its state is written into pool row ``ckpt_slot[j]``.
* Every read of the pool happens before any write, and the rows written (sequence slots and
  checkpoint slots) must all be distinct, so the result never depends on write order.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass, field
from typing import Callable, Sequence, TypeVar

import torch

from hyla.cache.transfer import put_rows_, to_device, to_device_packed

T = TypeVar("T")


# --- validation ------------------------------------------------------------------------------


def check_slots(slots: torch.Tensor, batch_size: int, num_slots: int, name: str = "slots") -> list[int]:
    """Validate ``slots [B]`` against a pool of ``num_slots`` rows; return them as host ints.

    Each entry is ``-1`` (padding) or a row in ``[0, num_slots)``; the non-negative ones are distinct
    (two sequences writing one row would race).
    """
    if slots.dim() != 1 or slots.numel() != batch_size:
        raise ValueError(f"{name} must have shape [{batch_size}], got {list(slots.shape)}")
    if slots.dtype.is_floating_point or slots.dtype == torch.bool:
        raise ValueError(f"{name} must be an integer tensor, got {slots.dtype}")
    values = slots.tolist()
    check_slot_values(values, num_slots, name)
    return values


def check_slot_values(values: list[int], num_slots: int, name: str) -> None:
    bad = [s for s in values if s < -1 or s >= num_slots]
    if bad:
        raise ValueError(f"{name} has entries {bad} outside [-1, {num_slots}) (the pool has {num_slots} rows)")
    used = [s for s in values if s >= 0]
    if len(set(used)) != len(used):
        raise ValueError(f"{name} repeats a pool row: {values}")


def check_varlen(cu_seqlens: torch.Tensor, num_tokens: int) -> list[int]:
    """Validate ``cu_seqlens [B+1]`` for ``num_tokens`` packed tokens; return the lengths (host ints)."""
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must have shape [B+1] with B >= 1, got {list(cu_seqlens.shape)}")
    if cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype == torch.bool:
        raise ValueError(f"cu_seqlens must be an integer tensor, got {cu_seqlens.dtype}")
    cu = cu_seqlens.tolist()
    if cu[0] != 0 or cu[-1] != num_tokens:
        raise ValueError(f"cu_seqlens must start at 0 and end at the number of tokens {num_tokens}, got {cu}")
    lengths = [b - a for a, b in zip(cu, cu[1:])]
    if any(n < 0 for n in lengths):
        raise ValueError(f"cu_seqlens must be non-decreasing, got {cu}")
    return lengths


@dataclass(frozen=True)
class Checkpoints:
    """A validated checkpoint request: entry ``j`` wants the state of sequence ``seq[j]`` after
    ``num_tokens[j]`` of its new tokens, written into pool row ``slot[j]``."""

    seq: list[int]
    num_tokens: list[int]
    slot: torch.Tensor  # [M] int64 on the pool's device
    slot_list: tuple[int, ...] = ()  # the same rows on the host

    @property
    def num_checkpoints(self) -> int:
        return len(self.seq)


def check_checkpoints(
    ckpt_seq: torch.Tensor | None,
    ckpt_len: torch.Tensor | None,
    ckpt_slot: torch.Tensor | None,
    lengths: list[int],
    slots: list[int],
    num_slots: int,
    device: torch.device,
) -> Checkpoints:
    """Validate a checkpoint request against the batch (``lengths``, host ``slots``) and the pool.

    Rules: the three tensors are all given or all ``None`` and have one shape ``[M]``; each names a
    real sequence (not a ``-1`` padding one) and ``1 <= ckpt_len <= its length``; checkpoint rows are
    distinct, inside the pool, and none of them is a row some sequence of the batch reads or writes.
    """
    given = [t is not None for t in (ckpt_seq, ckpt_len, ckpt_slot)]
    if not any(given):
        return Checkpoints([], [], torch.zeros(0, dtype=torch.long, device=device))
    if not all(given):
        raise ValueError("ckpt_seq, ckpt_len and ckpt_slot must be given together")
    assert ckpt_seq is not None and ckpt_len is not None and ckpt_slot is not None
    if not (ckpt_seq.dim() == ckpt_len.dim() == ckpt_slot.dim() == 1) or not (
        ckpt_seq.numel() == ckpt_len.numel() == ckpt_slot.numel()
    ):
        raise ValueError(
            f"ckpt_seq, ckpt_len and ckpt_slot must be 1-D of one length, got "
            f"{list(ckpt_seq.shape)}, {list(ckpt_len.shape)}, {list(ckpt_slot.shape)}"
        )
    seqs, lens = ckpt_seq.tolist(), ckpt_len.tolist()
    rows = check_slots(ckpt_slot, len(seqs), num_slots, name="ckpt_slot")
    return check_checkpoint_values(seqs, lens, rows, ckpt_slot, lengths, slots, device)


def check_checkpoint_values(seqs: Sequence[int], lens: Sequence[int], rows: Sequence[int], ckpt_slot: torch.Tensor,
                            lengths: Sequence[int], slots: Sequence[int], device: torch.device) -> Checkpoints:
    """:func:`check_checkpoints` on host copies of the request (``rows`` already checked against the
    pool and distinct, as :func:`check_slots` does); ``ckpt_slot`` holds the same rows."""
    seqs, lens = list(seqs), list(lens)
    for j, (i, n, row) in enumerate(zip(seqs, lens, rows)):
        if not 0 <= i < len(lengths):
            raise ValueError(f"checkpoint {j}: ckpt_seq={i} is not a sequence of this batch of {len(lengths)}")
        if slots[i] < 0:
            raise ValueError(f"checkpoint {j}: sequence {i} is padding (slot -1) and writes nothing")
        if not 1 <= n <= lengths[i]:
            raise ValueError(f"checkpoint {j}: ckpt_len={n} is outside [1, {lengths[i]}] for sequence {i}")
        if row < 0:
            raise ValueError(f"checkpoint {j}: ckpt_slot must be a pool row, got -1")
        if row in slots:
            raise ValueError(f"checkpoint {j}: ckpt_slot={row} is also a sequence slot of this batch")
    return Checkpoints(seqs, lens, ckpt_slot.to(device=device, dtype=torch.long), tuple(rows))


@dataclass(frozen=True)
class VarlenPlan:
    """A packed extend batch validated once, with the host facts a chunked op needs: the sequence
    lengths and offsets, the state slots as a :class:`SlotPlan` and the checkpoints. ``ForwardBatch``
    builds one per step (``varlen``) from host copies, so the layers' ops read nothing back from the
    device; an op given plain tensors builds its own (:meth:`from_tensors`, a few host reads)."""

    lengths: tuple[int, ...]
    starts: tuple[int, ...]  # [B+1] cu_seqlens on the host
    slots: "SlotPlan"
    ckpts: Checkpoints
    # what an op derives from the plan, built by the first layer and reused by the others this step
    # (:meth:`derive`: the conv's window rows, a chunked scan's layout and checkpoint plan, fla's rounds)
    derived: dict = field(default_factory=dict, compare=False, repr=False)

    def derive(self, key, build: Callable[[], "T"]) -> "T":
        """``build()``, once per plan: what an op derives from it (index tensors on the device, a
        chunk layout), built by the step's first layer and reused by the others."""
        if key not in self.derived:
            self.derived[key] = build()
        return self.derived[key]

    @classmethod
    def build(cls, lengths: Sequence[int], slots: "SlotPlan", ckpts: Checkpoints) -> "VarlenPlan":
        return cls(tuple(lengths), tuple(itertools.accumulate(lengths, initial=0)), slots, ckpts)

    @classmethod
    def from_tensors(cls, cu_seqlens: torch.Tensor, num_tokens: int, slots: torch.Tensor, pool: torch.Tensor,
                     ckpt_seq: torch.Tensor | None, ckpt_len: torch.Tensor | None, ckpt_slot: torch.Tensor | None,
                     device: torch.device) -> "VarlenPlan":
        """Validate a packed batch of ``num_tokens`` tokens against the state ``pool`` it reads and
        writes: ``cu_seqlens`` (:func:`check_varlen`), ``slots`` (as :func:`check_slots`) and the
        checkpoint request (:func:`check_checkpoints`), reading each tensor once."""
        lengths = check_varlen(cu_seqlens, num_tokens)
        plan = SlotPlan.build(slots, pool.shape[0], device, batch_size=len(lengths))
        ckpts = check_checkpoints(ckpt_seq, ckpt_len, ckpt_slot, lengths, list(plan.host), pool.shape[0], device)
        return cls.build(lengths, plan, ckpts)

    def check(self, cu_seqlens: torch.Tensor, num_tokens: int, *ckpt_tensors: torch.Tensor | None) -> None:
        """Host-side checks that a prebuilt plan fits the op's arguments (no device read)."""
        if cu_seqlens.numel() != len(self.lengths) + 1 or self.starts[-1] != num_tokens:
            raise ValueError(f"the varlen plan covers {len(self.lengths)} sequences and {self.starts[-1]} tokens, "
                             f"the batch has {cu_seqlens.numel() - 1} and {num_tokens}")
        if any(t is not None for t in ckpt_tensors):
            raise ValueError("a VarlenPlan carries its checkpoints: pass ckpt_seq, ckpt_len and ckpt_slot as None")


# --- the state pool --------------------------------------------------------------------------


@dataclass(frozen=True)
class SlotPlan:
    """A batch's state slots, validated once, with the host facts the decode ops need to read and
    write the pool without a device sync.

    ``ForwardBatch`` builds one per step from the host slot list (validation happens there, at
    batch construction); an op handed a plain ``slots`` tensor builds its own (one host read).
    """

    index: torch.Tensor  # [B] int64 on the pool's device; -1 = padding
    host: tuple[int, ...]  # the same values, on the host
    first: int | None  # the slots are first, first+1, ..., first+B-1 (no padding): pool rows are a view
    read_index: torch.Tensor  # [B] the slots with -1 replaced by row 0 (rows zeroed after reading)
    pad_rows: torch.Tensor | None  # [P] batch rows whose slot is -1; None when there are none
    write_rows: torch.Tensor | None  # [W] batch rows that write back (slot >= 0); None when all do
    write_index: torch.Tensor  # [W] the pool rows they write

    @property
    def batch_size(self) -> int:
        return self.index.shape[0]  # a shape, not len(host): symbolic under torch.compile

    @classmethod
    def build(cls, slots: torch.Tensor, num_slots: int, device: torch.device | None = None,
              host: Sequence[int] | None = None, batch_size: int | None = None,
              name: str = "slots") -> "SlotPlan":
        """Validate ``slots [B]`` (``B = batch_size`` when given) against a pool of ``num_slots``
        rows, as :func:`check_slots` does. ``host``: the same values already on the host (spares
        the device read; they are trusted to equal ``slots``)."""
        if batch_size is None:
            batch_size = len(host) if host is not None else (slots.numel() if slots.dim() == 1 else -1)
        if host is None:
            values = check_slots(slots, batch_size, num_slots, name)
        else:
            values = [int(s) for s in host]
            if slots.dim() != 1 or slots.numel() != batch_size or len(values) != batch_size:
                raise ValueError(f"{name} must have shape [{batch_size}], got {list(slots.shape)}")
            if slots.dtype.is_floating_point or slots.dtype == torch.bool:
                raise ValueError(f"{name} must be an integer tensor, got {slots.dtype}")
            check_slot_values(values, num_slots, name)
        device = slots.device if device is None else torch.device(device)
        index = slots.to(device=device, dtype=torch.long)
        b = len(values)
        first = values[0] if b and values[0] >= 0 and values == list(range(values[0], values[0] + b)) else None
        pads = [i for i, s in enumerate(values) if s < 0]
        if not pads:
            return cls(index, tuple(values), first, index, None, None, index)
        keep = [i for i, s in enumerate(values) if s >= 0]
        pad_rows, write_rows, write_index = to_device_packed([pads, keep, [values[i] for i in keep]], device)
        return cls(index, tuple(values), None, index.clamp(min=0), pad_rows, write_rows, write_index)

    @classmethod
    def rows(cls, values: Sequence[int], device: torch.device) -> "SlotPlan":
        """A plan over rows the caller computed itself (distinct, ``>= 0``; a tree scan's lanes):
        trusted, not validated."""
        values = tuple(values)
        index = to_device(values, torch.long, device)
        b = len(values)
        first = values[0] if b and values == tuple(range(values[0], values[0] + b)) else None
        return cls(index, values, first, index, None, None, index)


def as_slot_plan(slots: "torch.Tensor | SlotPlan", pool: torch.Tensor, batch_size: int) -> SlotPlan:
    """``slots`` as a :class:`SlotPlan` for ``pool`` and a batch of ``batch_size``: a plan was
    validated at batch construction (only its size is checked, on the host); a tensor is
    validated here (one host read)."""
    if isinstance(slots, SlotPlan):
        if slots.batch_size != batch_size:
            raise ValueError(f"slots must have shape [{batch_size}], the slot plan has {slots.batch_size}")
        return slots
    return SlotPlan.build(slots, pool.shape[0], pool.device, batch_size=batch_size)


def read_states(pool: torch.Tensor, plan: SlotPlan, dtype: torch.dtype) -> torch.Tensor:
    """``pool`` rows of ``plan`` as a fresh ``dtype`` tensor ``[B, *state]`` (zeros for padding);
    never aliases the pool. No device sync."""
    rows = pool.index_select(0, plan.read_index)  # [B, *state], a copy
    if rows.dtype != dtype:
        rows = rows.to(dtype)
    if plan.pad_rows is not None:
        rows.index_fill_(0, plan.pad_rows, 0)
    return rows


def write_states(pool: torch.Tensor, plan: SlotPlan, values: torch.Tensor) -> None:
    """``pool[slot_i] = values[i]`` (cast to the pool dtype) for every non-padding row; in place."""
    if plan.write_rows is not None:
        values = values.index_select(0, plan.write_rows)
    write_rows_(pool, plan.write_index, values.to(pool.dtype))


def open_state_rows(pool: torch.Tensor, plan: SlotPlan, dtype: torch.dtype) -> tuple[torch.Tensor, bool]:
    """States ``[B, *state]`` of ``plan`` to update in place, and whether they must be written back
    with :func:`write_states` afterwards: a view of the pool rows when the slots are one ascending
    run and the pool already has ``dtype``, else :func:`read_states`' copy (always the copy under
    ``torch.compile``, which would otherwise functionalise the view's writes into a pool copy)."""
    if not torch.compiler.is_compiling() and plan.first is not None and pool.dtype == dtype:
        return pool[plan.first : plan.first + plan.batch_size], False
    return read_states(pool, plan, dtype), True


def update_on_pool(update_: Callable[..., torch.Tensor], terms: Sequence[torch.Tensor], pool: torch.Tensor,
                   plan: "SlotPlan") -> torch.Tensor:
    """``update_(S, *terms) -> out`` on fp32 states ``S`` of the pool rows of ``plan``, updated in place:
    the rows themselves where :func:`open_state_rows` allows, else a copy written back. How every recurrent
    op's decode step (and so its tree scan's step) meets the pool."""
    S, copied = open_state_rows(pool, plan, torch.float32)
    out = update_(S, *terms)
    if copied:
        write_states(pool, plan, S)
    return out


@dataclass(frozen=True)
class PaddedChains:
    """The layout of a verify step of *padded chains*, what a compiled verify step runs: ``B``
    sequences whose new tokens (``1..W`` each) are laid out padded to one width ``W`` inside the
    recurrent ops, so that every shape depends on ``B``, ``W`` and the token count alone.

    * ``ckpt_rows [B, W-1]``: the state slots the states after columns ``0..W-2`` go to (a sequence's
      own slot gets the state after the last column, padding included: the caller takes the state
      after a chain's last real token from its checkpoint row).
    * ``rows [T]``: the padded row ``i * W + j`` of each of the ``T`` packed tokens; None: the tokens
      come padded already (``T = B * W``).
    * ``parents [B, W]`` int64: padded *trees*, column ``j > 0`` continuing column ``parents[:, j]``, an
      earlier one (column 0 the slot's state; padding continues the column before it); None: chains.

    ``ForwardBatch`` builds it and validates the values (slots, trees) on the host; the ops check the
    shapes (:meth:`check`)."""

    ckpt_rows: torch.Tensor
    rows: torch.Tensor | None = None
    parents: torch.Tensor | None = None

    def check(self, num_tokens: int, slots: "SlotPlan") -> tuple[int, int]:
        """``(B, W)``, the layout's shapes checked against ``num_tokens`` packed tokens and ``B`` state
        slots; ``ValueError`` else."""
        batch, width = self.ckpt_rows.shape[0], self.ckpt_rows.shape[1] + 1
        if num_tokens != (batch * width if self.rows is None else self.rows.shape[0]) or slots.batch_size != batch:
            raise ValueError(f"{num_tokens} tokens, {slots.batch_size} state slots and checkpoint rows "
                             f"{list(self.ckpt_rows.shape)} are not {batch} chains of at most {width}")
        p = self.parents
        if p is not None and (p.dim() != 2 or p.shape[0] != batch or p.shape[1] != width or p.dtype != torch.long):
            raise ValueError(f"parents must be int64 [{batch}, {width}] (padded trees), got {p.dtype} {list(p.shape)}")
        return batch, width


def scatter_rows(x: torch.Tensor, rows: torch.Tensor, num_rows: int) -> torch.Tensor:
    """``[num_rows, *x.shape[1:]]`` zeros with ``x[i]`` at row ``rows[i]`` (packed tokens laid out
    in a padded batch; a padding row's zeros are finite inputs whose outputs are dropped)."""
    return x.new_zeros(num_rows, *x.shape[1:]).index_copy_(0, rows, x)


def scan_padded_chains(update_: Callable[..., torch.Tensor], terms: Sequence[torch.Tensor],
                       ssm_states: torch.Tensor, slots: "SlotPlan", chains: PaddedChains) -> torch.Tensor:
    """The loop of every recurrent op's padded chains (``gated_delta.gated_delta_rule_chains``' contract,
    ``chains`` checked by ``PaddedChains.check``: ``ValueError`` before any pool write): the packed per-token ``terms [T, ...]`` (the op's decode
    factors, computed once for all the tokens as its tree path computes them) laid out padded (``chains.rows``;
    padding rows all zeros), then ``update_(S, *terms of column j) -> out_j`` on fp32 copies ``S`` of
    ``ssm_states[slots]``, column by column: the state after column ``j < W - 1`` goes to
    ``ssm_states[chains.ckpt_rows[:, j]]``, after the last to the slots. A pool of another dtype than fp32 has
    ``S`` rounded to it after every token, as the tree scan's lanes (pool rows) and decode steps are.
    -> fp32 ``[T, ...]`` (packed again). Fixed shapes, no host read: one graph under ``torch.compile``.

    *Padded trees* (``chains.parents``: column ``j > 0`` continues column ``parents[:, j]``, an
    earlier one; column 0 the slot's state): column ``j`` starts from a copy of its parent's state,
    gathered from a buffer of the states after the columns before it (the values their checkpoint
    rows hold), not read back from the pool: inductor's code (``realize_opcount_threshold`` 4, the
    runner's graph of more rows) read such rows wrong at batch size 1. One gather and one copy per
    column. Chains are the trees whose parents are ``j - 1``."""
    batch, width = chains.check(terms[0].shape[0], slots)
    ckpt_rows, rows, parents = chains.ckpt_rows, chains.rows, chains.parents
    if rows is not None:
        terms = [scatter_rows(t, rows, batch * width) for t in terms]
    terms = [t.view(batch, width, *t.shape[1:]) for t in terms]
    S = read_states(ssm_states, slots, torch.float32)  # a copy
    if parents is not None:  # padded trees: the state after each column but the last, [W-1, B, ...]
        after = S.new_empty(width - 1, *S.shape)
        seqs = torch.arange(batch, device=parents.device)
    outs = []
    for j in range(width):
        if parents is not None and j > 0:  # [B, ...] a copy of each row's parent's state
            S = after[parents[:, j], seqs]
        outs.append(update_(S, *(t[:, j] for t in terms)))
        if ssm_states.dtype != torch.float32:
            S.copy_(S.to(ssm_states.dtype))
        if parents is not None and j < width - 1:
            after[j] = S
        if j < width - 1:
            write_rows_(ssm_states, ckpt_rows[:, j], S.to(ssm_states.dtype))
    write_states(ssm_states, slots, S)
    out = torch.stack(outs, dim=1).view(batch * width, *outs[0].shape[1:])  # [B*W, ...]
    return out if rows is None else out.index_select(0, rows)


def write_rows_(pool: torch.Tensor, index: torch.Tensor, values: torch.Tensor) -> None:
    """``pool[index[i]] = values[i]`` in place (``index`` distinct): how every op writes a pool.

    Eager: ``index_copy_`` (into a float8 KV buffer as bytes: ``transfer.put_rows_``). Under
    ``torch.compile``: ``index_put_``, which the compiler keeps in
    place on the pool (and fuses into the kernel computing ``values``); an ``index_copy_`` into a
    graph input would be functionalised into a copy of the whole pool every step."""
    if torch.compiler.is_compiling():
        pool.index_put_((index,), values)
    else:
        put_rows_(pool, index, values)


# --- chunk math ------------------------------------------------------------------------------

CHUNK_SIZE = 32
"""Tokens per chunk of the PyTorch chunked scans (Gated DeltaNet, KDA, Mamba2's SSD) on CPU: an execution
choice, not the model's (a checkpoint's ``chunk_size`` is its own kernels'; the result is the same
up to rounding). Per token, a chunk of ``Q`` costs ``O(Q)`` inside it (the ``Q x Q`` decay, score and
triangular-solve work) against a fixed ``O(D^2)`` state update, plus a step per chunk; on CPU 32
was the fastest of 16-256 in nearly every case timed (1 thread, 8 x 128 / 1 x 296 / 1 x 1,024-4,096
tokens): against 64, Gated DeltaNet 0.79 / 0.94 / 0.86x the time, KDA 0.78 / 0.92 / 0.92x, SSD
1.06 / 0.83 / 0.83x; SSD against the 128 and 256 of NemotronH's and Falcon-H1's checkpoints,
0.70 and 0.16x at 8 x 128 tokens, 0.53 and 0.29x at 4,096."""


def chunk_size_for(chunk_size: int | None, device: torch.device, accelerator: int) -> int:
    """A chunked scan's chunk size: ``chunk_size`` if given (``ValueError`` below 1), else
    :data:`CHUNK_SIZE` on CPU and ``accelerator`` elsewhere, each op's size from before the CPU was
    tuned (64 for Gated DeltaNet and KDA, 128 for the SSD): there each chunk step is a few kernel
    launches, so chunks are longer, and these scans are only the fallback behind fla's and hyla's
    Triton kernels (not timed on a GPU since)."""
    if chunk_size is None:
        return CHUNK_SIZE if torch.device(device).type == "cpu" else accelerator
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    return chunk_size


DECAY_FLOOR = -40.0
"""Log-decays below this are taken as ``exp = 0`` by :func:`decay_exp` (``exp(-40) ~ 4e-18``)."""


def decay_exp(log_decay: torch.Tensor) -> torch.Tensor:
    """``exp(log_decay)`` for the cumulative log-decays of a chunked scan (``<= 0``, ``-inf`` where
    masked), with every factor below ``exp(DECAY_FLOOR)`` set to exactly 0.

    Why: a strongly decaying head drives ``cum`` far below -87, where fp32 ``exp`` returns
    denormals; on x86 CPUs every later multiply, matmul and triangular solve touching them runs
    5-50x slower (the default model's 8 x 128-token prefill: 0.30 s of CPU with them, 0.21 s
    without), and ``exp`` of ``-inf`` is slow too. The dropped factors are below ``4e-18``: far under fp32's resolution
    of the sums they enter (each also holds a term with factor 1, the token's own).
    """
    return log_decay.clamp(min=DECAY_FLOOR).exp_().masked_fill_(log_decay < DECAY_FLOOR, 0.0)


# --- the chunk layout ------------------------------------------------------------------------


@dataclass(frozen=True)
class ChunkLayout:
    """Packed sequences cut into fixed-size chunks, stored step-major so the inter-chunk scan
    needs slices only.

    Each sequence's chunks start at its own first token (chunking is per sequence) and its last
    chunk is zero-padded. Sequences are *ranked* by chunk count, descending (stable). Chunk ``j``
    of the sequence of rank ``r`` sits at flat chunk index ``step_start[j] + r``. At scan step ``j``
    exactly the ranks ``0 .. num_active[j]-1`` still have a chunk, so a per-sequence state kept in
    rank order is updated as ``state[:num_active[j]]`` from chunks
    ``step_start[j] : step_start[j] + num_active[j]``. A zero-length sequence has no chunk.
    """

    chunk_size: int
    num_tokens: int
    order: torch.Tensor  # [B] int64, the sequence of each rank
    order_host: tuple[int, ...]  # the same, on the host
    rank: tuple[int, ...]  # [B] the rank of each sequence
    num_active: tuple[int, ...]  # [J] sequences that still have a chunk at step j
    step_start: tuple[int, ...]  # [J+1] flat index of step j's first chunk
    token_index: torch.Tensor  # [NC, Q] int64 packed token at each chunk position; num_tokens = padding
    flat_index: torch.Tensor  # [T] int64 position of each packed token in the flattened [NC*Q] chunks

    @property
    def num_chunks(self) -> int:
        return self.step_start[-1]

    def steps(self) -> list[tuple[int, int]]:
        """``(first_chunk, num_active)`` for each scan step, in order."""
        return list(zip(self.step_start[:-1], self.num_active))

    def chunk(self, x: torch.Tensor) -> torch.Tensor:
        """Packed ``x [T, ...]`` -> ``[NC, Q, ...]``, zeros at padding positions."""
        padded = torch.cat([x, x.new_zeros(1, *x.shape[1:])])  # [T+1, ...]; row T is the zero pad
        return padded[self.token_index]  # [NC, Q, ...]

    def chunk_heads_first(self, x: torch.Tensor) -> torch.Tensor:
        """Packed ``x [T, H, ...]`` -> contiguous ``[NC, H, Q, ...]`` (the layout the chunk math uses)."""
        return self.chunk(x).transpose(1, 2).contiguous()

    def unchunk(self, y: torch.Tensor) -> torch.Tensor:
        """``y [NC, Q, ...]`` -> packed ``[T, ...]`` (padding positions dropped)."""
        return y.flatten(0, 1)[self.flat_index]

    def locate(self, seq: int, num_tokens: int) -> tuple[int, int, int]:
        """Where the state after ``num_tokens >= 1`` tokens of sequence ``seq`` is: ``(step, flat
        chunk, tokens of that chunk consumed)``, the last in ``1..Q``."""
        step, within = divmod(num_tokens - 1, self.chunk_size)
        return step, self.step_start[step] + self.rank[seq], within + 1


def chunk_layout(lengths: list[int], chunk_size: int, device: torch.device) -> ChunkLayout:
    """The :class:`ChunkLayout` of a packed batch (memoised for the last few batches: every layer of
    a forward asks again)."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    return _chunk_layout(tuple(lengths), chunk_size, torch.device(device))


@functools.lru_cache(maxsize=8)
def _chunk_layout(lengths: tuple[int, ...], chunk_size: int, device: torch.device) -> ChunkLayout:
    num_tokens = sum(lengths)
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    num_chunks = [-(-n // chunk_size) for n in lengths]
    order = sorted(range(len(lengths)), key=lambda i: -num_chunks[i])
    rank = [0] * len(lengths)
    for r, i in enumerate(order):
        rank[i] = r
    max_steps = num_chunks[order[0]] if order else 0
    num_active = [sum(1 for n in num_chunks if n > j) for j in range(max_steps)]
    step_start = [0]
    for a in num_active:
        step_start.append(step_start[-1] + a)

    chunk_first = []  # packed index of each flat chunk's first position
    chunk_end = []  # end (exclusive) of the sequence owning each flat chunk
    for j, a in enumerate(num_active):
        for i in order[:a]:
            chunk_first.append(starts[i] + j * chunk_size)
            chunk_end.append(starts[i + 1])
    first = torch.tensor(chunk_first, dtype=torch.long).view(-1, 1)  # [NC, 1]
    end = torch.tensor(chunk_end, dtype=torch.long).view(-1, 1)  # [NC, 1]
    pos = first + torch.arange(chunk_size).view(1, -1)  # [NC, Q]
    token_index = torch.where(pos < end, pos, num_tokens)  # [NC, Q]
    valid = (token_index < num_tokens).flatten()  # [NC*Q]
    flat_index = torch.empty(num_tokens, dtype=torch.long)
    flat_index[token_index.flatten()[valid]] = torch.arange(valid.numel())[valid]
    order_d, token_index_d, flat_index_d = to_device_packed([order, token_index, flat_index], device)
    return ChunkLayout(
        chunk_size=chunk_size,
        num_tokens=num_tokens,
        order=order_d,
        order_host=tuple(order),
        rank=tuple(rank),
        num_active=tuple(num_active),
        step_start=tuple(step_start),
        token_index=token_index_d,
        flat_index=flat_index_d,
    )


@dataclass(frozen=True)
class CheckpointPlan:
    """Checkpoints placed on a :class:`ChunkLayout`: entry ``j`` is the state after ``within[j]``
    tokens (``1..Q``) of flat chunk ``chunk[j]``, whose sequence has rank ``rank[j]`` and whose
    chunk is scanned at ``step[j]``. ``at_step(s)`` lists, for one scan step, the checkpoint
    entries there and the ranks to read the entering state of."""

    chunk: torch.Tensor  # [M] int64
    within: torch.Tensor  # [M] int64
    step: tuple[int, ...]
    rank: tuple[int, ...]
    slot: torch.Tensor  # [M] int64
    # scan step -> (checkpoint entries there [E], the ranks to read their entering state of [E])
    by_step: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict, compare=False, repr=False)

    @property
    def num_checkpoints(self) -> int:
        return len(self.step)

    def at_step(self, step: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        return self.by_step.get(step)


ChunkScan = Callable[[ChunkLayout, CheckpointPlan, torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
"""``scan(layout, plan, state) -> (out, final state, checkpoint states)``: an op's chunked core, on
fp32 states ``[B, ...]`` in rank order (``ChunkLayout``) and a :class:`CheckpointPlan` of ``M`` entries."""


def chunk_scan_on_pool(scan: ChunkScan, varlen: VarlenPlan, chunk_size: int, pool: torch.Tensor,
                       device: torch.device) -> torch.Tensor:
    """Run a chunked scan over a packed batch whose states live in ``pool``: lay the batch out in chunks
    of ``chunk_size``, place the checkpoints on them, read each sequence's state from its slot (fp32,
    in rank order, zeros for ``-1``), run ``scan``, then write the checkpoint states into their rows and
    the final states back into the slots (none for ``-1``). Returns ``scan``'s output. Reads nothing
    back from the device (the plan holds the host facts); the layout, the checkpoint plan and the
    slots in rank order are built once per step (``VarlenPlan.derive``) and shared by every layer."""

    def build() -> tuple[ChunkLayout, CheckpointPlan, SlotPlan]:
        layout = chunk_layout(list(varlen.lengths), chunk_size, device)
        host = varlen.slots.host
        rank_host = [host[i] for i in layout.order_host]
        ranks = SlotPlan.build(varlen.slots.index[layout.order], pool.shape[0], device, host=rank_host)
        return layout, plan_checkpoints(layout, varlen.ckpts), ranks

    layout, plan, ranks = varlen.derive(("chunk_scan", chunk_size, torch.device(device), pool.shape[0]), build)
    state = read_states(pool, ranks, torch.float32)  # [B, *state] in rank order
    out, state, ckpt_states = scan(layout, plan, state)
    if plan.num_checkpoints:
        write_rows_(pool, plan.slot, ckpt_states.to(pool.dtype))
    write_states(pool, ranks, state)
    return out


def plan_checkpoints(layout: ChunkLayout, ckpts: Checkpoints) -> CheckpointPlan:
    """Place validated checkpoints on the chunk layout."""
    located = [layout.locate(i, n) for i, n in zip(ckpts.seq, ckpts.num_tokens)]
    step = tuple(s for s, _, _ in located)
    rank = tuple(layout.rank[i] for i in ckpts.seq)
    entries = {s: [m for m, sm in enumerate(step) if sm == s] for s in sorted(set(step))}
    # one asynchronous copy: chunk, within, then per scan step its entries and their ranks
    parts = to_device_packed([[c for _, c, _ in located], [w for _, _, w in located]]
                             + [x for es in entries.values() for x in (es, [rank[m] for m in es])],
                             layout.token_index.device)
    by_step = {s: (parts[2 + 2 * j], parts[3 + 2 * j]) for j, s in enumerate(entries)}
    return CheckpointPlan(chunk=parts[0], within=parts[1], step=step, rank=rank, slot=ckpts.slot, by_step=by_step)
