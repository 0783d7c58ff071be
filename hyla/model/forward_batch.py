"""The explicit forward context: everything one model forward needs, and nothing of the tree.

The engine (``hyla/engine/model_runner.py``) builds one ``ForwardBatch`` per step from its
requests, the request table and the pools; the model reads pool tensors and slot indices from it
and never sees the radix tree. There is no module-global context: the batch is an argument.

Conventions
-----------
* Tokens of all sequences are *packed*: sequence ``i`` owns ``input_ids[cu_seqlens[i]:cu_seqlens[i+1]]``.
* KV pool slot 0 and state pool slot 0 are reserved sentinels (padding writes land there).
  A state slot of ``-1`` in ``state_slots`` means "padding: read nothing, write nothing".
* A sequence's recurrent state is read from and written back to ``state_slots[i]`` in place. A new
  sequence with no cached prefix simply owns a zeroed slot (the pool zeroes slots on ``alloc``).
* Checkpoints: entry ``j`` asks for the recurrent state (conv window and SSM state of every linear
  layer) after sequence ``ckpt_seq[j]`` has consumed ``ckpt_len[j]`` of *this step's* new tokens
  (``1 <= ckpt_len[j] <= extend_len``), written into state slot ``ckpt_slot[j]``. The result must
  equal a run that stopped there (fp32, 1e-5).

Per-step metadata (built once here, at construction, and shared by every layer)
-------------------------------------------------------------------------------
Validation happens here, once per step, not inside the layers or ops: the state slots are checked
against the pool (``slot_plan``), a decode batch's checkpoints and KV layout are checked, and the
largest token id is read once. A decode forward then runs with no ``.tolist()`` / ``.item()`` and
no data-dependent shape: the ops get host facts (``slot_plan``, ``seq_lens``) and precomputed
index tensors (``kv_table`` / ``kv_rows`` / ``kv_mask``, one gather per step for all attention
layers). The runner passes host copies it already has (``state_slot_list``, ``max_token_id``,
``kv_table``) so that constructing the batch reads nothing back from the device either.

A speculative verify step (a token tree, or any extend of at most ``SHORT_EXTEND`` tokens per
sequence) gets the same treatment: its checkpoints are validated here and laid out with the tree
once (``tree_scan``, shared by every recurrent layer), and its attention metadata (``short_extend``:
the KV rows of every sequence and one mask) is built once for all attention layers. A verify step
of *padded chains* (``chain_ckpt_rows``, what a compiled verify step runs) has metadata whose shapes
depend on the batch size, the width and the token count only: ``chains`` (``ops.PaddedChains``) lays
the fed tokens out padded to the width for the recurrent ops, the attention layout pads to the same
width. Padded *trees* (``chain_tree_parents``) add each padded position's parent (``chains.parents``),
which the recurrent ops and the attention layout follow.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Sequence

import torch

from hyla.model.lora import LoRABatch
from hyla.model.ops.attention import (
    ShortExtendLayout,
    decode_kv_mask,
    decode_kv_rows,
    decode_kv_table,
    padding_mask,
    window_kv_table,
)
from hyla.model.ops.tree import SHORT_EXTEND, TokenTree, TreeScan
from hyla.model.ops.varlen import (
    Checkpoints,
    PaddedChains,
    SlotPlan,
    VarlenPlan,
    check_checkpoint_values,
    check_checkpoints,
    check_slot_values,
)


def _empty_long() -> torch.Tensor:
    return torch.zeros(0, dtype=torch.long)


@dataclass(frozen=True)
class FusedExtend:
    """One sequence's extend with every index on the device, in shapes fixed by its token count
    ``T`` (its ``n`` real tokens first, then padding) and its room for ``M`` checkpoints: its forward
    reads no host value, so a CUDA graph can capture it once per ``T`` and replay it for any ``n <=
    T`` (``engine/cuda_graph.py``, ``CudaGraphExtend``). The layers run the Triton kernels the
    single-pass GPU extend runs (the conv on ``ConvRows``, the recurrent layers' segment kernels
    on the pool rows, writing the checkpoints on their way) and attention over the request table
    (``gpu/extend_attention.py``). A padding token writes its K/V to the sentinel slot 0 and
    computes a don't-care row; its recurrent outputs are zeros."""

    cu_seqlens: torch.Tensor  # [2]: 0, n
    kv_lens: torch.Tensor  # [T]: the keys token j attends to, prefix + j + 1 (padding: 1)
    req_row: torch.Tensor  # [1]: the sequence's row of the request table
    ckpt_offsets: torch.Tensor  # [2]: 0, m (the first m entries below are checkpoints)
    ckpt_pos: torch.Tensor  # [M]: tokens each checkpoint follows, ascending in 1..n (unused: 1)
    ckpt_slot: torch.Tensor  # [M]: their state rows (unused: 0, the sentinel)
    tok_seq: torch.Tensor  # [max(T, M)] zeros: every token's sequence (and the checkpoint windows')
    longest: int  # T, as the host knows it: the segment kernels pick their chunked form by it


@dataclass
class ForwardBatch:
    # --- what to compute ---------------------------------------------------------------------
    is_decode: bool
    """Decode: every sequence feeds exactly one token (``extend_lens`` all 1)."""
    input_ids: torch.Tensor  # [T] int64, packed new tokens
    positions: torch.Tensor  # [T] int64, absolute position of each new token
    extend_lens: list[int]  # [B] new tokens per sequence (host-side)
    prefix_lens: list[int]  # [B] tokens already in the KV cache before this step (host-side)
    cu_seqlens: torch.Tensor  # [B+1] int64, cumulative extend_lens (on device)

    # --- KV cache (attention layers) ---------------------------------------------------------
    out_cache_loc: torch.Tensor  # [T] int64, KV slot where each new token's K/V is written
    kv_indices: torch.Tensor  # [sum(prefix+extend)] int64, all KV slots of each sequence, in order
    kv_indptr: torch.Tensor  # [B+1] int64, sequence i's slots are kv_indices[kv_indptr[i]:kv_indptr[i+1]]
    k_buffers: Sequence[torch.Tensor]  # per attention layer: [num_kv_slots, Hkv, D]
    v_buffers: Sequence[torch.Tensor]  # per attention layer: [num_kv_slots, Hkv, D]

    # --- recurrent state (linear layers) -----------------------------------------------------
    state_slots: torch.Tensor  # [B] int64, each sequence's own state slot (-1 = padding)
    conv_states: Sequence[torch.Tensor]  # per linear layer: [num_state_slots, *conv_shape]
    ssm_states: Sequence[torch.Tensor]  # per linear layer: [num_state_slots, *ssm_shape] (fp32)
    ckpt_seq: torch.Tensor = field(default_factory=_empty_long)  # [M]
    ckpt_len: torch.Tensor = field(default_factory=_empty_long)  # [M]
    ckpt_slot: torch.Tensor = field(default_factory=_empty_long)  # [M]

    tree_parents: Sequence[Sequence[int]] | None = None
    """Tree verification (``ops/tree.py``): per sequence, per new token, the offset of the new token
    it continues (``-1`` for the first); ``positions`` must be ``prefix_len + depth``. None: each
    sequence's new tokens are one chain (the usual case)."""

    chain_ckpt_rows: torch.Tensor | None = None
    """A verify step of *padded chains* (what ``ModelRunner`` compiles): each sequence's new tokens
    are one chain of ``1..W`` tokens, padded to ``W`` inside the recurrent ops and attention only
    (the projections run on the real tokens), and ``[B, W-1]`` int64 state slots receive the state
    after each padded position but the last (the last goes to its own slot: after padding, if any).
    The batch's metadata then has shapes in ``B``, ``W`` and the token count only, every new token's
    logits are returned, and the ``ckpt_*`` checkpoints must be empty. Needs
    :attr:`chain_ckpt_list`, its host copy."""
    chain_ckpt_list: Sequence[Sequence[int]] | None = None
    """Host copy of ``chain_ckpt_rows`` (validated at construction, no device read)."""
    chain_tree_parents: Sequence[Sequence[int]] | None = None
    """Padded *trees* (with ``chain_ckpt_rows``): each sequence's new tokens form a token tree, as
    ``tree_parents`` (``-1`` for the first, then each an earlier offset; ``positions`` then
    ``prefix_len + depth``), padded to ``W`` like chains; token ``j``'s state still goes to
    ``chain_ckpt_rows[:, j]`` (the last padded position's to its own slot). Kept apart from
    ``tree_parents`` (a compiled graph guards on that list; this one is read here only, into
    ``chains.parents``)."""

    # --- what to return ----------------------------------------------------------------------
    logits_indices: torch.Tensor | None = None
    """[N] int64 indices into the packed tokens whose logits to return; None = last token of each sequence."""
    return_hidden: bool = False
    """Also return the final hidden state of every fed token (after the final norm: what the LM head
    reads): ``forward`` then returns ``(logits [N, vocab], hidden [T, hidden])`` (the MTP drafter's
    input, ``hyla/engine/mtp_drafter.py``); a fused decode step's (and its chains') too, one per row."""

    lora: LoRABatch | None = None
    """LoRA adapters (``hyla/model/lora.py``): the step's token rows grouped by the adapter they apply,
    built once per step by the runner; None where no row has one (the base model's rows only)."""

    # --- images (a vision-language model: hyla/model/vision.py) -------------------------------
    mm_rows: torch.Tensor | None = None
    """[K] int64 rows of the packed tokens (image placeholders) whose input embedding is ``mm_embeds``'
    rows instead of their token's; None: none (every row embeds its token)."""
    mm_embeds: torch.Tensor | None = None
    """[K, hidden]: those rows' embeddings (the vision tower's output), in the model dtype."""
    mrope_positions: torch.Tensor | None = None
    """[3, T] int64: each token's (time, height, width) positions for the multimodal RoPE, where a
    token of this step is an image's (``positions`` is then the time row); None: ``positions``
    for all three. Such a step runs attention's PyTorch path (the tables of these positions)."""

    # --- optional host copies / precomputed metadata (derived below when not given) ----------
    state_slot_list: Sequence[int] | None = None
    """Host copy of ``state_slots`` (spares a device read at construction)."""
    ckpt_list: Sequence[tuple[int, int, int]] | None = None
    """Host copy of the checkpoints, ``(ckpt_seq, ckpt_len, ckpt_slot)`` per entry (spares device reads)."""
    max_token_id: int | None = None
    """Largest id in ``input_ids`` (-1 when empty), if the caller knows it on the host."""
    kv_table: torch.Tensor | None = None
    """Decode and short extends (a ``tree``): ``[B, max(seq_lens)]`` int64, row ``i`` = sequence
    ``i``'s KV slots (prefix, then its new tokens') padded with slot 0; built from ``kv_indices`` /
    ``kv_indptr`` when not given."""
    kv_lens: torch.Tensor | None = None
    """Decode only: ``[B]`` int64 ``seq_lens`` already on the device (the mask is then built there)."""

    # --- the fused (Triton) decode step: everything read on the device, fixed shapes -----------
    fused_decode: bool = False
    """Decode with the Triton kernels of ``hyla/model/ops/gpu`` (CUDA): attention reads each
    sequence's KV slots from ``req_to_token`` rows ``req_pool_indices`` up to ``kv_lens``; the
    recurrent layers update ``state_slots`` in place (``-1`` = padding). Nothing is derived from host
    values, so the forward can be captured in a CUDA graph. Checkpoints are not taken in such a
    step (the caller copies state rows afterwards)."""
    req_to_token: torch.Tensor | None = None
    """Fused decode and fused extend: ``[R, C]`` int32 device request table (row = request, entry = KV slot)."""
    req_pool_indices: torch.Tensor | None = None
    """Fused decode: ``[B]`` int64 each sequence's row of ``req_to_token``."""
    fused_extend: FusedExtend | None = None
    """An extend whose indices all live on the device (:class:`FusedExtend`; with ``req_to_token``):
    ``extend_lens`` is then ``[T]`` (the padded token count) and ``prefix_lens`` ``[0]``,
    placeholders; the returned logits are at ``logits_indices``."""
    chain_slots: torch.Tensor | None = None
    """A fused verify step of chains (``ModelRunner.forward_chains`` on CUDA): ``[W+1, S]`` int64. The
    batch's ``B = S*W`` rows are ``S`` sequences of ``W`` consecutive tokens (row ``i*W + j``), each
    row a decode row of its own (its position, KV length, request row and KV slot); the recurrent
    layers' kernels run each sequence's ``W`` tokens in order in one launch, token ``j`` reading its
    states at ``chain_slots[j]`` and writing them at ``chain_slots[j + 1]``. None: one token per
    sequence, in place at ``state_slots``."""

    # --- derived once per step (not arguments) -----------------------------------------------
    seq_lens: list[int] = field(init=False, repr=False)
    """[B] ``prefix_lens + extend_lens`` (host): each sequence's KV length after this step."""
    kv_starts: list[int] = field(init=False, repr=False)
    """[B+1] ``kv_indptr`` on the host (the cumulative ``seq_lens``, which it must equal)."""
    slot_plan: SlotPlan | None = field(init=False, repr=False, default=None)
    """The validated state slots with their host facts (None when there are no linear layers)."""
    varlen: VarlenPlan | None = field(init=False, repr=False, default=None)
    """An extend on the chunked paths (no ``tree``, or chains: fla's kernels run those as plain
    sequences) with linear layers: its lengths, slots and checkpoints validated once, so the
    recurrent layers' ops read nothing back from the device."""
    kv_mask: torch.Tensor | None = field(init=False, repr=False, default=None)
    kv_rows: torch.Tensor | None = field(init=False, repr=False, default=None)
    """Decode: what :meth:`decode_kv_layout` returns, once it has been asked for (eager)."""
    window_layouts: dict = field(init=False, repr=False, default_factory=dict)
    """Sliding-window attention's masks of this step, per window, once asked for (eager):
    :meth:`decode_kv_layout`'s and :meth:`short_extend_layout`'s."""
    decode_ckpt_src: torch.Tensor | None = field(init=False, repr=False, default=None)
    decode_ckpt_dst: torch.Tensor | None = field(init=False, repr=False, default=None)
    """Decode checkpoints (each is the sequence's final state): copy state rows ``src`` to ``dst``."""
    tree: TokenTree | None = field(init=False, repr=False, default=None)
    """Extend: the token trees the recurrent ops scan token by token (from ``tree_parents``, or
    chains when every sequence feeds at most ``SHORT_EXTEND`` tokens); None: the chunked paths."""
    tree_scan: TreeScan | None = field(init=False, repr=False, default=None)
    """With a ``tree`` and linear layers: its scan laid out for the state slots and checkpoints (the
    checkpoints validated here, once), shared by every recurrent layer (``ops/tree.py``)."""
    chains: PaddedChains | None = field(init=False, repr=False, default=None)
    """A verify step of padded chains (``chain_ckpt_rows``): the layout every recurrent op's padded
    chains take — the checkpoint rows, each packed token's row ``i * W + j`` in the padded layout and,
    for padded trees (``chain_tree_parents``), each padded position's parent (``-1`` for the first; a
    padding position continues the one before it)."""
    short_extend: ShortExtendLayout | None = field(init=False, repr=False, default=None)
    """With a ``tree`` and attention layers: the batched attention's KV rows and mask, shared by
    every attention layer (``ops/attention.py``, ``paged_attention_short_extend``)."""

    def __post_init__(self) -> None:
        b = len(self.extend_lens)
        if len(self.prefix_lens) != b or self.cu_seqlens.numel() != b + 1:
            raise ValueError("extend_lens, prefix_lens and cu_seqlens disagree on the batch size")
        num_tokens = sum(self.extend_lens)
        if self.input_ids.numel() != num_tokens:
            raise ValueError(f"input_ids has {self.input_ids.numel()} tokens, extend_lens sum to {num_tokens}")
        if self.positions.numel() != num_tokens:
            raise ValueError("positions and input_ids disagree on the number of tokens")
        if self.is_decode and any(n != 1 for n in self.extend_lens):
            raise ValueError("a decode batch feeds exactly one token per sequence")
        if self.chain_tree_parents is not None and self.chain_ckpt_rows is None:
            raise ValueError("chain_tree_parents is for a verify step of padded chains (chain_ckpt_rows)")
        if (self.mm_rows is None) != (self.mm_embeds is None) or (
                self.mm_rows is not None and (self.mm_rows.dim() != 1 or self.mm_embeds.dim() != 2
                                              or self.mm_rows.shape[0] != self.mm_embeds.shape[0])):
            raise ValueError("mm_rows [K] and mm_embeds [K, hidden] come together, one embedding a row")
        if self.mrope_positions is not None and (self.mrope_positions.shape != (3, num_tokens)
                                                 or self.fused_decode or self.fused_extend is not None):
            raise ValueError(f"mrope_positions must be [3, {num_tokens}] (one column a token), on an unfused step")
        if self.fused_decode:
            self._check_fused()
        if self.fused_extend is not None:
            self._check_fused_extend()
        if self.max_token_id is None:
            self.max_token_id = int(self.input_ids.max()) if num_tokens else -1
        self.seq_lens = [p + n for p, n in zip(self.prefix_lens, self.extend_lens)]
        self.kv_starts = list(itertools.accumulate(self.seq_lens, initial=0))
        # every derived field is set on the instance (a compiled graph guards on which ones exist)
        self.slot_plan = self.kv_mask = self.kv_rows = self.decode_ckpt_src = self.decode_ckpt_dst = None
        self.window_layouts = {}
        self.tree = self.tree_scan = self.short_extend = self.varlen = self.chains = None
        if self.fused_extend is not None:  # everything on the device, checked by its builder
            return
        if self.chain_ckpt_rows is not None:
            self._check_chains()
        elif self.tree_parents is not None:
            if self.is_decode:
                raise ValueError("tree_parents is for extend batches (a verify step)")
            self.tree = TokenTree.build(self.tree_parents, self.extend_lens, self.input_ids.device)
        elif not self.is_decode and num_tokens and max(self.extend_lens) <= SHORT_EXTEND:
            self.tree = TokenTree.chains(self.extend_lens, self.input_ids.device)
        if self.conv_states and not self.fused_decode:
            self.slot_plan = SlotPlan.build(self.state_slots, self.conv_states[0].shape[0],
                                            self.conv_states[0].device, host=self.state_slot_list, batch_size=b,
                                            name="state_slots")
        if self.is_decode and b and not self.fused_decode:
            self._decode_metadata()
        elif self.chain_ckpt_rows is not None:
            self._short_extend_layout(self.chain_tree_parents, width=self.chain_ckpt_rows.shape[1] + 1)
        elif self.tree is not None:
            self._short_extend_metadata()
        elif not self.is_decode:
            if self.k_buffers and self.kv_indices.numel() != self.kv_starts[-1]:
                raise ValueError(f"kv_indices has {self.kv_indices.numel()} slots, the sequences hold "
                                 f"{self.kv_starts[-1]} tokens")
            if self.slot_plan is not None:
                self.varlen = VarlenPlan.build(self.extend_lens, self.slot_plan, self._checkpoints(self.extend_lens))

    def _checkpoints(self, lengths: Sequence[int]) -> Checkpoints:
        """The batch's checkpoints validated against ``lengths`` and the state slots, from the host
        copy ``ckpt_list`` when given (no device read), else from the tensors."""
        pool_rows = self.conv_states[0].shape[0]
        device = self.slot_plan.index.device
        if self.ckpt_list is None or not self.num_checkpoints:
            given = self.num_checkpoints > 0
            return check_checkpoints(self.ckpt_seq if given else None, self.ckpt_len if given else None,
                                     self.ckpt_slot if given else None, list(lengths), list(self.slot_plan.host),
                                     pool_rows, device)
        if len(self.ckpt_list) != self.num_checkpoints or self.ckpt_seq.numel() != self.num_checkpoints \
                or self.ckpt_len.numel() != self.num_checkpoints:
            raise ValueError(f"ckpt_list has {len(self.ckpt_list)} entries, the checkpoint tensors "
                             f"{self.ckpt_seq.numel()}, {self.ckpt_len.numel()} and {self.num_checkpoints}")
        seqs, lens, rows = (list(col) for col in zip(*self.ckpt_list))
        check_slot_values(rows, pool_rows, "ckpt_slot")
        return check_checkpoint_values(seqs, lens, rows, self.ckpt_slot.to(device=device, dtype=torch.long),
                                       list(lengths), list(self.slot_plan.host), device)

    def _check_fused(self) -> None:
        """Host-side checks of a fused decode batch (its values are the builder's to validate)."""
        b = self.batch_size
        if not self.is_decode:
            raise ValueError("fused_decode is for decode batches")
        if self.req_to_token is None or self.req_pool_indices is None or self.kv_lens is None:
            raise ValueError("a fused decode batch needs req_to_token, req_pool_indices and kv_lens")
        if self.req_pool_indices.shape != (b,) or self.kv_lens.shape != (b,) or self.state_slots.shape != (b,):
            raise ValueError(f"req_pool_indices, kv_lens and state_slots must be [{b}]")
        if self.num_checkpoints:
            raise ValueError("a fused decode batch takes no checkpoints (copy the final states instead)")
        if self.chain_slots is not None:
            w = self.chain_slots.shape[0] - 1
            if self.chain_slots.dim() != 2 or w < 1 or b % w or self.chain_slots.shape[1] != b // w:
                raise ValueError(f"chain_slots must be [W+1, B/W] for the batch's {b} rows, "
                                 f"got {list(self.chain_slots.shape)}")

    def _check_fused_extend(self) -> None:
        """Host-side checks of a fused extend's shapes (its values are the builder's to validate)."""
        fe, t = self.fused_extend, self.input_ids.shape[0]
        if self.is_decode or self.fused_decode or self.tree_parents is not None or self.chain_ckpt_rows is not None:
            raise ValueError("fused_extend is for an extend of one chain (no decode, tree or padded chains)")
        if self.req_to_token is None or self.logits_indices is None or self.return_hidden or self.num_checkpoints:
            raise ValueError("a fused extend needs req_to_token and logits_indices, and takes no ckpt_* tensors "
                             "(its checkpoints are in fused_extend) and returns no hidden states")
        if self.extend_lens != [t] or self.state_slots.shape != (1,) or self.max_token_id is None:
            raise ValueError(f"a fused extend is one sequence of {t} tokens (extend_lens [{t}], state_slots [1]) "
                             "with max_token_id given")
        m = fe.ckpt_pos.shape[0]
        if fe.cu_seqlens.shape != (2,) or fe.kv_lens.shape != (t,) or fe.req_row.shape != (1,) \
                or fe.ckpt_offsets.shape != (2,) or fe.ckpt_slot.shape != (m,) or fe.tok_seq.shape[0] < max(t, m) \
                or fe.longest != t:
            raise ValueError(f"fused_extend's tensors do not fit {t} tokens and {m} checkpoints")

    def _decode_metadata(self) -> None:
        if self.num_checkpoints:
            if self.slot_plan is None:
                raise ValueError("checkpoints need linear layers (the batch has no state pools)")
            ckpts = self._checkpoints([1] * self.batch_size)
            self.decode_ckpt_src = self.slot_plan.index[torch.tensor(ckpts.seq, device=self.slot_plan.index.device)]
            self.decode_ckpt_dst = ckpts.slot
        if not self.k_buffers:
            return
        if self.kv_indices.numel() != sum(self.seq_lens):
            raise ValueError(f"kv_indices has {self.kv_indices.numel()} slots, the sequences hold "
                             f"{sum(self.seq_lens)} tokens")
        if self.kv_table is None:
            self.kv_table, _ = decode_kv_table(self.kv_indices, self.kv_indptr, self.seq_lens)
        elif tuple(self.kv_table.shape) != (self.batch_size, max(self.seq_lens)):
            raise ValueError(f"kv_table must be [{self.batch_size}, {max(self.seq_lens)}], "
                             f"got {list(self.kv_table.shape)}")
        if self.kv_lens is not None and tuple(self.kv_lens.shape) != (self.batch_size,):
            raise ValueError(f"kv_lens must be [{self.batch_size}], got {list(self.kv_lens.shape)}")

    def decode_kv_layout(self, window: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Decode: what every attention layer reads, ``(kv_rows [B, Hkv, L], kv_mask [B, L] or
        None)`` with ``L = max(seq_lens)``: the rows of ``k_buffer.view(-1, D)`` of each sequence's
        slots, head-major (one gather yields the keys laid out ``[B, Hkv, L, D]``), and the additive
        fp32 mask, -inf past each sequence's length (None at batch size 1; at any larger size a
        tensor, even all zeros, so that one compiled graph serves every ``B > 1``).

        Made on first use and kept, so an eager step makes them once for all its attention layers.
        Inside a compiled decode graph they are traced, not kept: a few index ops that fuse into
        the gathers, and none of them is paid when the batch is built (from ``kv_lens``, then).

        ``window``: the layout of sliding-window attention layers (``ops.attention.window_kv_table``: the
        rows of each sequence's last ``window`` keys alone, ``L = min(window, max(seq_lens))``, and a mask, a
        tensor at every batch size, over the rows of sequences shorter than that)."""
        if window:
            return self._windowed(("decode", window), lambda: self._decode_window_layout(window))
        if self.kv_rows is not None:
            return self.kv_rows, self.kv_mask
        rows = decode_kv_rows(self.kv_table, self.k_buffers[0].shape[1])
        mask = None
        if rows.shape[0] > 1:  # a shape, not len(extend_lens): symbolic when traced (one graph for every B > 1)
            if self.kv_lens is not None:  # on the device already: the width is the table's (symbolic when traced)
                mask = padding_mask(self.kv_lens, self.kv_table.shape[1])
            else:
                mask = decode_kv_mask(self.seq_lens, self.kv_table.device, always=True)
        if not torch.compiler.is_compiling():
            self.kv_rows, self.kv_mask = rows, mask
        return rows, mask

    def _decode_window_layout(self, window: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows and mask of each sequence's last ``window`` keys (``window_kv_table``): a sliding
        layer's decode reads its window, whatever the context."""
        lens = self.kv_lens if self.kv_lens is not None else torch.tensor(
            self.seq_lens, dtype=torch.long, device=self.kv_table.device)
        table, mask = window_kv_table(self.kv_table, lens, window)
        return decode_kv_rows(table, self.k_buffers[0].shape[1]), mask

    def short_extend_layout(self, window: int = 0) -> ShortExtendLayout:
        """A verify step's attention layout (``short_extend``), for sliding-window attention layers
        with their ``window`` (:meth:`ShortExtendLayout.windowed`)."""
        if not window:
            return self.short_extend
        return self._windowed(("short_extend", window), lambda: self.short_extend.windowed(window))

    def _windowed(self, key, build):
        """``window_layouts[key]``, built on first use and kept (not while compiling: traced)."""
        if key in self.window_layouts:
            return self.window_layouts[key]
        made = build()
        if not torch.compiler.is_compiling():
            self.window_layouts[key] = made
        return made

    def _check_chains(self) -> None:
        """A verify step of padded chains: ``ValueError`` unless it is one (see ``chain_ckpt_rows``);
        then its ``chains``."""
        b = self.batch_size
        if self.is_decode or self.tree_parents is not None or self.num_checkpoints:
            raise ValueError("chain_ckpt_rows is for an extend of chains with no other checkpoints")
        if self.chain_ckpt_rows.dim() != 2 or self.chain_ckpt_rows.shape[0] != b or self.chain_ckpt_list is None:
            raise ValueError(f"chain_ckpt_rows must be [{b}, W - 1] with its host copy chain_ckpt_list")
        width = self.chain_ckpt_rows.shape[1] + 1
        if [len(r) for r in self.chain_ckpt_list] != [width - 1] * b:
            raise ValueError(f"chain_ckpt_list must hold {width - 1} slots per sequence, as chain_ckpt_rows")
        if not b or not all(1 <= n <= width for n in self.extend_lens):
            raise ValueError(f"padded chains of width {width}: every sequence feeds 1..{width} tokens, "
                             f"got {self.extend_lens}")
        if not self.conv_states:
            raise ValueError("chain_ckpt_rows needs linear layers (the batch has no state pools)")
        rows = [int(s) for r in self.chain_ckpt_list for s in r]
        check_slot_values(rows, self.conv_states[0].shape[0], "chain_ckpt_rows")  # in the pool, no repeats
        own = [s for s in (self.state_slot_list or self.state_slots.tolist()) if s >= 0]
        if min(rows, default=0) < 0 or set(rows) & set(own):
            raise ValueError("chain_ckpt_rows must be state slots (no padding), none of them a sequence's own")
        packed = torch.tensor([i * width + j for i, n in enumerate(self.extend_lens) for j in range(n)],
                              dtype=torch.long, device=self.input_ids.device)  # [T]
        parents = None
        if self.chain_tree_parents is not None:
            TokenTree.build(self.chain_tree_parents, self.extend_lens, "cpu")  # ValueError on a bad tree
            parents = torch.tensor([list(par) + list(range(len(par) - 1, width - 1)) for par in self.chain_tree_parents],
                                   dtype=torch.long, device=self.input_ids.device)  # [B, W]
        self.chains = PaddedChains(self.chain_ckpt_rows, packed, parents)

    def _short_extend_metadata(self) -> None:
        """A tree (or short) extend: the recurrent ops' scan and the attention's layout, once."""
        if self.slot_plan is not None:
            ckpts = self._checkpoints(self.extend_lens)
            self.tree_scan = self.tree.plan(self.slot_plan, ckpts)
            if self.tree.is_chain:  # fla's kernels (GPU prefill) run chains as plain sequences: their plan too
                self.varlen = VarlenPlan.build(self.extend_lens, self.slot_plan, ckpts)
        self._short_extend_layout(None if self.tree.is_chain else self.tree.parents)

    def _short_extend_layout(self, parents, width: int | None = None) -> None:
        """The batched short-extend attention's layout (causal, or over the trees ``parents``;
        ``width``: every extend padded to it)."""
        if not self.k_buffers:
            return
        length = max(self.seq_lens)
        if self.kv_table is None:
            if self.kv_indices.numel() != sum(self.seq_lens):
                raise ValueError(f"kv_indices has {self.kv_indices.numel()} slots, the sequences hold "
                                 f"{sum(self.seq_lens)} tokens")
            self.kv_table, _ = decode_kv_table(self.kv_indices, self.kv_indptr, self.seq_lens)
        elif tuple(self.kv_table.shape) != (self.batch_size, length):
            raise ValueError(f"kv_table must be [{self.batch_size}, {length}], got {list(self.kv_table.shape)}")
        self.short_extend = ShortExtendLayout.build(self.kv_table, self.prefix_lens, self.extend_lens,
                                                    self.k_buffers[0].shape[1], parents, width)

    @property
    def batch_size(self) -> int:
        return len(self.extend_lens)

    @property
    def state_slot_plan(self) -> "SlotPlan | torch.Tensor":
        """The state slots as the recurrent ops take them: the plan validated at construction where
        there is one (no host read inside the forward, nor a graph break under ``torch.compile``),
        else ``state_slots`` itself (the ops validate it)."""
        return self.slot_plan if self.slot_plan is not None else self.state_slots

    @property
    def on_device(self) -> bool:
        """A fused decode step or a fused extend: every index is on the device and the forward reads
        no host value (the Triton kernels' paths, capturable in a CUDA graph)."""
        return self.fused_decode or self.fused_extend is not None

    @property
    def num_checkpoints(self) -> int:
        return int(self.ckpt_slot.numel())

    def last_token_indices(self) -> torch.Tensor:
        return self.cu_seqlens[1:] - 1
