"""Splitting one memory budget between the KV pool and the state pool.

SGLang sizes its two pools once at start-up with ``--mamba-full-memory-ratio``: the bytes of the
state (mamba) pool divided by the bytes of the full-attention KV pool. ``split_memory`` takes the
same ratio: ``state_bytes = total * r / (1 + r)``, ``kv_bytes = total / (1 + r)``. Each pool's
sentinel (one KV page, one state slot) is paid out of its own share, so the pools built from the
result occupy at most ``total_bytes``. A model without attention layers (Mamba, Mamba2) stores no KV:
its states take the whole budget, and its KV pool is token indices alone (the tree's and the
requests' positions, no memory on the device), ``INDEX_ONLY_KV_TOKENS`` of them.
"""

from __future__ import annotations

from dataclasses import dataclass

INDEX_ONLY_KV_TOKENS = 1 << 22  # a KV pool without KV bytes: ~32 MB of host-side free list at most


@dataclass(frozen=True)
class MemorySplit:
    num_kv_tokens: int  # KVPool(num_tokens=...): a multiple of page_size
    num_state_slots: int  # StatePool(num_slots=...)
    kv_bytes: int  # bytes the KV pool occupies, sentinel page included
    state_bytes: int  # bytes the state pool occupies, sentinel slot included


def split_memory(
    total_bytes: int,
    state_ratio: float,
    kv_bytes_per_token: int,
    state_bytes_per_slot: int,
    page_size: int = 1,
) -> MemorySplit:
    """Pool sizes for a budget of ``total_bytes`` with ``state_bytes / kv_bytes == state_ratio``.

    ``state_ratio`` is SGLang's ``mamba_full_memory_ratio`` (e.g. 0.9: the state pool gets 0.9/1.9
    of the budget). A pure-attention model passes ``state_bytes_per_slot=0`` and ``state_ratio=0``; a
    model without attention ``kv_bytes_per_token=0`` (the states take the whole budget, whatever the
    ratio; ``INDEX_ONLY_KV_TOKENS`` KV indices). Raises ValueError when the budget cannot hold one KV
    page (plus one state slot for a hybrid).
    """
    if total_bytes <= 0:
        raise ValueError(f"total_bytes must be > 0, got {total_bytes}")
    if state_ratio < 0:
        raise ValueError(f"state_ratio must be >= 0, got {state_ratio}")
    if kv_bytes_per_token < 0 or state_bytes_per_slot < 0 or page_size < 1 or \
            kv_bytes_per_token == state_bytes_per_slot == 0:
        raise ValueError("need kv_bytes_per_token >= 0, state_bytes_per_slot >= 0 (not both 0) and page_size >= 1")
    if kv_bytes_per_token == 0:  # no attention layer: the states take it all, the KV pool is indices alone
        num_slots = total_bytes // state_bytes_per_slot - 1
        if num_slots < 1:
            raise ValueError(f"{total_bytes} bytes cannot hold one state slot")
        pages = INDEX_ONLY_KV_TOKENS // page_size
        return MemorySplit(num_kv_tokens=pages * page_size, num_state_slots=num_slots, kv_bytes=0,
                           state_bytes=(num_slots + 1) * state_bytes_per_slot)
    if state_bytes_per_slot > 0 and state_ratio == 0:
        raise ValueError("a model with recurrent state needs state_ratio > 0")
    state_share = total_bytes * state_ratio / (1.0 + state_ratio) if state_bytes_per_slot else 0.0
    kv_share = total_bytes - state_share
    num_pages = int(kv_share // (kv_bytes_per_token * page_size)) - 1  # minus the sentinel page
    num_slots = int(state_share // state_bytes_per_slot) - 1 if state_bytes_per_slot else 0
    if num_pages < 1:
        raise ValueError(f"{total_bytes} bytes at ratio {state_ratio} cannot hold one KV page of {page_size} tokens")
    if state_bytes_per_slot and num_slots < 1:
        raise ValueError(f"{total_bytes} bytes at ratio {state_ratio} cannot hold one state slot")
    return MemorySplit(
        num_kv_tokens=num_pages * page_size,
        num_state_slots=num_slots,
        kv_bytes=(num_pages + 1) * page_size * kv_bytes_per_token,
        state_bytes=(num_slots + 1) * state_bytes_per_slot if state_bytes_per_slot else 0,
    )
