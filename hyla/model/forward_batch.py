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
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch


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
    ckpt_seq: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))  # [M]
    ckpt_len: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))  # [M]
    ckpt_slot: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))  # [M]

    # --- what to return ----------------------------------------------------------------------
    logits_indices: torch.Tensor | None = None
    """[N] int64 indices into the packed tokens whose logits to return; None = last token of each sequence."""

    def __post_init__(self) -> None:
        b = len(self.extend_lens)
        if len(self.prefix_lens) != b or self.cu_seqlens.numel() != b + 1:
            raise ValueError("extend_lens, prefix_lens and cu_seqlens disagree on the batch size")
        if self.input_ids.numel() != sum(self.extend_lens):
            raise ValueError(f"input_ids has {self.input_ids.numel()} tokens, extend_lens sum to {sum(self.extend_lens)}")
        if self.is_decode and any(n != 1 for n in self.extend_lens):
            raise ValueError("a decode batch feeds exactly one token per sequence")

    @property
    def batch_size(self) -> int:
        return len(self.extend_lens)

    @property
    def num_checkpoints(self) -> int:
        return int(self.ckpt_slot.numel())

    def last_token_indices(self) -> torch.Tensor:
        return self.cu_seqlens[1:] - 1
