"""Memory pools: KV pool (paged allocator), state pool, request table, memory split, accounting mode."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hyla.cache import CacheLayout, KVPool, PoolExhaustedError, ReqToTokenPool, StatePool, split_memory
from hyla.cache.allocator import FreeList
from hyla.cache.state_pool import ROW_OPS_MAX_SLOTS


def kv_pool(num_tokens: int = 64, page_size: int = 1, accounting: bool = False) -> KVPool:
    return KVPool(num_tokens, page_size, num_layers=2, num_kv_heads=2, head_dim=4, dtype=torch.float32,
                  device="cpu", accounting=accounting)


# ----------------------------------------------------------------------------------------------
# free list
# ----------------------------------------------------------------------------------------------
def test_free_list_alloc_free_roundtrip_and_errors() -> None:
    fl = FreeList(5)
    a = fl.alloc(3)
    assert a.tolist() == [1, 2, 3] and fl.num_free() == 2
    fl.free(np.array([2]))
    assert fl.alloc(1).tolist() == [2]  # LIFO: the slot just freed comes back first
    with pytest.raises(PoolExhaustedError):
        fl.alloc(3)
    with pytest.raises(ValueError, match="double free"):
        fl.free(np.array([4, 5]))  # never allocated
    with pytest.raises(ValueError, match="more than once"):
        fl.free(np.array([1, 1]))
    with pytest.raises(ValueError, match="lie in"):
        fl.free(np.array([0]))  # the sentinel
    fl.check_integrity()
    assert fl.num_free() == 2


def test_free_list_cost_does_not_grow_with_capacity() -> None:
    """Freeing k ids writes k entries: the free list of a huge pool is never copied."""
    fl = FreeList(2_000_000)
    ids = fl.alloc(10)
    stack_before = fl._stack
    fl.free(ids)
    assert fl._stack is stack_before  # in place, no reallocation or copy of the stack
    assert fl.num_free() == 2_000_000


# ----------------------------------------------------------------------------------------------
# KV pool
# ----------------------------------------------------------------------------------------------
def test_kv_pool_buffers_sentinel_and_bytes() -> None:
    pool = kv_pool(64, page_size=4)
    assert len(pool.k_buffers) == len(pool.v_buffers) == 2
    assert pool.k_buffers[0].shape == (64 + 4, 2, 4)
    assert pool.bytes_per_token == 2 * 2 * 2 * 4 * 4  # K+V, layers, heads, dim, fp32
    slots = pool.alloc(64)
    assert slots.min() >= 4 and slots.max() < 68  # page 0 (slots 0..3) is never handed out
    assert pool.available_size() == 0 and not pool.can_alloc(1)
    with pytest.raises(PoolExhaustedError):
        pool.alloc(1)
    with pytest.raises(ValueError):
        pool.free(torch.tensor([0]))  # sentinel page


def test_kv_pool_page_size_one_uses_slots_1_to_n() -> None:
    pool = kv_pool(8, page_size=1)
    assert sorted(pool.alloc(8).tolist()) == list(range(1, 9))


def test_alloc_extend_continues_partial_page_then_takes_new_pages() -> None:
    pool = kv_pool(64, page_size=4)
    first = pool.alloc(6)  # pages 1, 2: slots 4..9 (10, 11 remain in page 2)
    assert first.tolist() == [4, 5, 6, 7, 8, 9]
    ext = pool.alloc_extend([6], [9], [7])  # 2 in page 2, then page 3 full, then 1 in page 4
    assert ext.tolist() == [10, 11, 12, 13, 14, 15, 16]
    assert pool.available_size() == 64 - 4 * 4


def test_alloc_extend_batch_packs_in_order_and_prefix_on_boundary_takes_new_page() -> None:
    pool = kv_pool(64, page_size=4)
    a = pool.alloc(4)  # exactly one page: a prefix ending on a boundary
    b = pool.alloc(3)
    out = pool.alloc_extend([4, 3], [int(a[-1]), int(b[-1])], [2, 2])
    first, second = out[:2].tolist(), out[2:].tolist()
    assert first == [12, 13]  # a's prefix fills page 1 exactly: a new page (page 3)
    assert second == [int(b[-1]) + 1, 16]  # the last slot of b's page 2, then a new page (page 4)
    assert pool.pages_needed([4, 3], [2, 2]) == 2


def test_alloc_extend_rejects_a_last_loc_that_cannot_hold_the_previous_token() -> None:
    pool = kv_pool(64, page_size=4)
    a = pool.alloc(3)
    with pytest.raises(ValueError, match="last_loc"):
        pool.alloc_extend([3], [int(a[-1]) + 1], [1])  # wrong offset within the page
    with pytest.raises(ValueError, match="last_loc"):
        pool.alloc_extend([3], [-1], [1])
    free_before = pool.available_size()
    with pytest.raises(PoolExhaustedError):
        pool.alloc_extend([3], [int(a[-1])], [10_000])
    assert pool.available_size() == free_before  # nothing taken on failure


def test_alloc_decode_new_page_only_when_current_is_full() -> None:
    pool = kv_pool(64, page_size=4)
    s = pool.alloc(3).tolist()  # positions 0..2 in page 1 (slots 4, 5, 6)
    pages_before = pool.available_size() // 4
    assert pool.alloc_decode([3], [s[-1]]).tolist() == [7]  # position 3 still fits in page 1
    assert pool.available_size() // 4 == pages_before
    nxt = pool.alloc_decode([4], [7]).tolist()[0]  # position 4 needs a new page
    assert nxt % 4 == 0 and pool.available_size() // 4 == pages_before - 1
    assert pool.can_alloc_decode([4, 5]) and not kv_pool(4, 4).can_alloc_decode([0, 0])


def test_free_releases_whole_pages_and_detects_double_free() -> None:
    pool = kv_pool(16, page_size=4)
    slots = pool.alloc(6)  # two pages, the second partly used
    pool.free(slots)
    assert pool.available_size() == 16
    with pytest.raises(ValueError, match="double free"):
        pool.free(slots[:1])
    pool.check_integrity()


def test_kv_pool_accounting_mode_allocates_like_the_real_pool_without_tensors() -> None:
    real, acct = kv_pool(32, 4), kv_pool(32, 4, accounting=True)
    assert acct.k_buffers == [] and acct.v_buffers == []
    assert acct.bytes_per_token == real.bytes_per_token
    for pool in (real, acct):
        a = pool.alloc(5)
        b = pool.alloc_extend([5], [int(a[-1])], [9])
        pool.free(a)
        pool.check_integrity()
    assert torch.equal(real.alloc(8), acct.alloc(8))
    big = KVPool(1 << 20, 16, 48, 2, 256, torch.bfloat16, accounting=True)  # 80B-class dims, no memory
    assert big.bytes_per_token == 2 * 48 * 2 * 256 * 2 and big.total_bytes > 1 << 30


def test_kv_pool_rejects_bad_sizes() -> None:
    with pytest.raises(ValueError):
        KVPool(10, 4, 1, 1, 1, torch.float32)
    with pytest.raises(ValueError):
        KVPool(16, 0, 1, 1, 1, torch.float32)


# ----------------------------------------------------------------------------------------------
# state pool
# ----------------------------------------------------------------------------------------------
def state_pool(num_slots: int = 6, accounting: bool = False) -> StatePool:
    return StatePool(num_slots, num_layers=2, conv_shape=(6, 3), conv_dtype=torch.bfloat16,
                     ssm_shape=(2, 4, 4), ssm_dtype=torch.float32, accounting=accounting)


def fill(pool: StatePool, slot: int, value: float) -> None:
    for buf in (*pool.conv_states, *pool.ssm_states):
        buf[slot] = value


def test_state_pool_shapes_bytes_and_zeroed_alloc() -> None:
    pool = state_pool()
    assert pool.conv_states[0].shape == (7, 6, 3) and pool.ssm_states[1].shape == (7, 2, 4, 4)
    assert pool.ssm_states[0].dtype == torch.float32 and pool.conv_states[0].dtype == torch.bfloat16
    assert pool.bytes_per_slot == 2 * (6 * 3 * 2 + 2 * 4 * 4 * 4)
    (s,) = pool.alloc(1).tolist()
    fill(pool, s, 3.0)
    pool.free([s])
    (again,) = pool.alloc(1).tolist()
    assert again == s  # reused ...
    assert all(buf[s].abs().sum() == 0 for buf in (*pool.conv_states, *pool.ssm_states))  # ... zeroed
    assert all(buf[0].abs().sum() == 0 for buf in pool.ssm_states)  # sentinel untouched


def test_state_pool_copy_and_fork_are_batched_deep_copies() -> None:
    pool = state_pool()
    a, b, c = pool.alloc(3).tolist()
    fill(pool, a, 1.0)
    fill(pool, b, 2.0)
    pool.copy(torch.tensor([a, b]), torch.tensor([c, pool.alloc(1).item()]))
    assert torch.all(pool.ssm_states[1][c] == 1.0)
    forked = pool.fork(torch.tensor([b])).tolist()
    fill(pool, b, 9.0)  # the live slot keeps changing ...
    assert torch.all(pool.conv_states[0][forked[0]] == 2.0)  # ... the fork does not
    with pytest.raises(ValueError, match="not allocated"):
        pool.copy([a], [6])
    with pytest.raises(ValueError, match="distinct"):
        pool.copy([a, b], [c, c])
    pool.check_integrity()


@pytest.mark.parametrize("n", [1, 3, ROW_OPS_MAX_SLOTS, ROW_OPS_MAX_SLOTS + 1, 2 * ROW_OPS_MAX_SLOTS + 1])
def test_state_pool_copy_and_alloc_agree_on_both_paths(n: int) -> None:
    """``copy`` and ``alloc``'s zeroing run as per-dtype foreach ops over row views up to
    ``ROW_OPS_MAX_SLOTS`` slots and as one indexed op per buffer past it: both move every buffer of
    every slot (bf16 conv windows, fp32 states, the MTP hidden vector, a companion's buffers of
    other shapes), each slot its own values, and touch no other row."""
    draft = CacheLayout(num_linear_layers=1, conv_shape=(5, 2), conv_dtype=torch.float16, ssm_shape=(3, 2, 2),
                        ssm_dtype=torch.float32)
    pool = StatePool(3 * n + 1, num_layers=2, conv_shape=(6, 3), conv_dtype=torch.bfloat16, ssm_shape=(2, 4, 4),
                     hidden_size=8, companion=draft)
    bufs = [*pool.conv_states, *pool.ssm_states, pool.hidden_states]
    assert len(bufs) == 7 and {b.dtype for b in bufs} == {torch.bfloat16, torch.float16, torch.float32}
    src, dst = pool.alloc(n).tolist(), pool.alloc(n).tolist()
    (bystander,) = pool.alloc(1).tolist()
    for k, buf in enumerate(bufs):
        buf.copy_(torch.arange(buf.numel(), dtype=torch.float32).view(buf.shape) % 61 + 100 * k)  # every row differs
    before = [buf.clone() for buf in bufs]
    pool.copy(src, dst)
    for buf, old in zip(bufs, before):
        assert torch.equal(buf[dst], old[src])  # pair by pair, every buffer
        keep = [r for r in range(buf.shape[0]) if r not in dst]
        assert torch.equal(buf[keep], old[keep])  # no other row written
    forked = pool.fork(src[:1]).tolist()
    assert all(torch.equal(buf[forked[0]], buf[src[0]]) for buf in bufs)
    pool.free(src)
    again = pool.alloc(n).tolist()
    assert sorted(again) == sorted(src)
    for buf, old in zip(bufs, before):
        assert buf[again].abs().sum() == 0  # zeroed ...
        assert torch.equal(buf[dst], old[src]) and torch.equal(buf[bystander], old[bystander])  # ... alone
    kept = [buf[dst].clone() for buf in bufs]
    pool.free(dst)
    raw = pool.alloc(n, zero=False).tolist()
    assert sorted(raw) == sorted(dst)
    assert all(torch.equal(buf[dst], k) for buf, k in zip(bufs, kept))  # ... unless the caller overwrites them


def test_state_pool_accounting_mode() -> None:
    pool = state_pool(4, accounting=True)
    assert pool.conv_states == [] and pool.bytes_per_slot == state_pool().bytes_per_slot
    slots = pool.alloc(2)
    forked = pool.fork(slots)
    assert pool.available_size() == 0 and set(forked.tolist()).isdisjoint(slots.tolist())
    with pytest.raises(PoolExhaustedError):
        pool.alloc(1)


def test_conv_only_state_pool() -> None:
    """LFM2's short-conv layers keep a conv window and no SSM state: ssm_shape (0,) gives empty SSM
    buffers (the per-layer lists stay aligned for the model) that hold no byte; alloc zeroes, copy
    and fork copy the conv windows alone, exactly as for a full state."""
    layout = CacheLayout(num_attention_layers=2, num_kv_heads=2, head_dim=4, num_linear_layers=3, conv_shape=(8, 2),
                         conv_dtype=torch.bfloat16, ssm_shape=(0,), ssm_dtype=torch.float32)
    assert layout.state_bytes_per_slot == 3 * 8 * 2 * 2  # conv windows only
    pool = StatePool.from_layout(layout, 4)
    assert pool.bytes_per_slot == layout.state_bytes_per_slot
    assert len(pool.conv_states) == len(pool.ssm_states) == 3
    assert all(b.shape == (5, 0) and b.numel() == 0 for b in pool.ssm_states)
    assert pool.conv_states[2].shape == (5, 8, 2)
    a, b = pool.alloc(2).tolist()
    for layer, buf in enumerate(pool.conv_states):
        buf[a] = layer + 1.0
    pool.copy([a], [b])
    assert all(torch.all(buf[b] == layer + 1.0) for layer, buf in enumerate(pool.conv_states))
    (forked,) = pool.fork([a]).tolist()
    pool.conv_states[0][a] = 7.0  # the live slot moves on; the fork keeps the window it had
    assert torch.all(pool.conv_states[0][forked] == 1.0) and torch.all(pool.conv_states[1][forked] == 2.0)
    pool.free([a])
    (again,) = pool.alloc(1).tolist()
    assert again == a and all(buf[a].abs().sum() == 0 for buf in pool.conv_states)  # reused slots come back zeroed
    pool.check_integrity()
    acct = StatePool.from_layout(layout, 4, accounting=True)
    assert acct.bytes_per_slot == pool.bytes_per_slot and acct.ssm_states == []
    with pytest.raises(ValueError, match="need a state"):  # a linear layer must hold something
        CacheLayout(num_linear_layers=1, conv_shape=(0, 3), ssm_shape=(0,))


def test_state_pool_without_linear_layers() -> None:
    pool = StatePool(4, 0, None, torch.float32, None, torch.float32)
    assert pool.bytes_per_slot == 0 and pool.alloc(2).tolist() == [1, 2]


# ----------------------------------------------------------------------------------------------
# cache layout: the one source of the byte sizes
# ----------------------------------------------------------------------------------------------
def test_cache_layout_bytes_and_pools_built_from_it() -> None:
    layout = CacheLayout(2, 2, 4, torch.float32, 2, (6, 3), torch.bfloat16, [2, 4, 4], torch.float32)
    assert layout.ssm_shape == (2, 4, 4)  # shapes are stored as tuples
    assert layout.kv_bytes_per_token == kv_pool().bytes_per_token == 2 * 2 * 2 * 4 * 4
    assert layout.state_bytes_per_slot == state_pool().bytes_per_slot == 2 * (6 * 3 * 2 + 2 * 4 * 4 * 4)
    kv = KVPool.from_layout(layout, 32, page_size=4)
    assert kv.bytes_per_token == layout.kv_bytes_per_token and kv.k_buffers[1].shape == (36, 2, 4)
    state = StatePool.from_layout(layout, 5, accounting=True)
    assert state.bytes_per_slot == layout.state_bytes_per_slot and state.conv_states == []
    assert (state.size, state.conv_shape, state.ssm_dtype) == (5, (6, 3), torch.float32)
    attention_only = CacheLayout(num_attention_layers=1, num_kv_heads=1, head_dim=8)
    assert attention_only.state_bytes_per_slot == 0 and StatePool.from_layout(attention_only, 2).bytes_per_slot == 0
    with pytest.raises(ValueError):
        CacheLayout(num_attention_layers=-1)
    with pytest.raises(ValueError):
        CacheLayout(num_linear_layers=2)  # linear layers without state shapes


def test_companion_layout_shares_the_slots_of_every_pool_operation() -> None:
    """A companion (a draft model's layout) adds its bytes to each token and slot, its buffers follow
    the pool's own in their own shapes and dtypes, and alloc (zeroing), copy and fork cover them."""
    draft = CacheLayout(1, 1, 8, torch.bfloat16, 1, (5, 2), torch.float32, (0,), torch.float32)  # conv-only states
    layout = CacheLayout(2, 2, 4, torch.float32, 2, (6, 3), torch.float32, (2, 4, 4), torch.float32, companion=draft)
    own = CacheLayout(2, 2, 4, torch.float32, 2, (6, 3), torch.float32, (2, 4, 4), torch.float32)
    assert layout.kv_bytes_per_token == own.kv_bytes_per_token + 2 * 1 * 8 * 2
    assert layout.state_bytes_per_slot == own.state_bytes_per_slot + 5 * 2 * 4
    kv = KVPool.from_layout(layout, 16, page_size=4)
    assert [tuple(b.shape) for b in kv.k_buffers] == [(20, 2, 4), (20, 2, 4), (20, 1, 8)]
    assert kv.k_buffers[2].dtype == torch.bfloat16 and kv.bytes_per_token == layout.kv_bytes_per_token
    slots = kv.alloc(8)
    for b in (*kv.k_buffers, *kv.v_buffers):
        b[slots[:4]] = 1.0 + torch.arange(4, dtype=b.dtype).view(-1, *[1] * (b.dim() - 1))
    kv.copy(slots[:4], slots[4:])
    assert all(torch.equal(b[slots[4:]], b[slots[:4]]) for b in (*kv.k_buffers, *kv.v_buffers))
    kv.check_integrity()
    st = StatePool.from_layout(layout, 6)
    assert [tuple(b.shape) for b in st.conv_states] == [(7, 6, 3), (7, 6, 3), (7, 5, 2)]
    assert [tuple(b.shape) for b in st.ssm_states] == [(7, 2, 4, 4), (7, 2, 4, 4), (7, 0)]
    a = st.alloc(1)
    for b in (*st.conv_states, *st.ssm_states):
        b[a] = 3.0
    (f,) = st.fork(a).tolist()
    assert all(torch.equal(b[f], b[int(a)]) for b in (*st.conv_states, *st.ssm_states))
    st.free(a)
    assert st.alloc(1).tolist() == a.tolist() and float(st.conv_states[2][a].abs().sum()) == 0.0  # zeroed
    st.check_integrity()
    assert StatePool.from_layout(layout, 6, accounting=True).bytes_per_slot == layout.state_bytes_per_slot
    with pytest.raises(ValueError, match="companion"):
        CacheLayout(companion=layout)


# ----------------------------------------------------------------------------------------------
# request table
# ----------------------------------------------------------------------------------------------
def test_req_to_token_pool_rows_and_slots() -> None:
    table = ReqToTokenPool(2, 8)
    r = table.alloc()
    table.write(r, 0, torch.tensor([5, 6, 7]))
    table.write(r, 3, torch.tensor([9]))
    assert table.read(r, 0, 4).tolist() == [5, 6, 7, 9]
    view = table.read(r, 0, 2)
    table.write(r, 0, torch.tensor([1, 1]))
    assert view.tolist() == [5, 6]  # read returns a copy
    r2 = table.alloc()
    with pytest.raises(PoolExhaustedError):
        table.alloc()
    table.free(r)
    assert table.available_size() == 1 and table.alloc() == r
    with pytest.raises(ValueError):
        table.write(r2, 6, torch.tensor([1, 2, 3]))  # past max_context_len
    table.free(r2)
    with pytest.raises(ValueError):
        table.read(r2, 0, 1)  # freed row


@pytest.mark.parametrize("numpy_view", [True, False])
def test_req_to_token_write_batch_equals_row_by_row_writes_and_checks_first(numpy_view) -> None:
    """A step's allocations in one scatter: the table and its (CPU) mirror end as after one
    ``write`` per row; a bad row or range writes nothing. Both ways of writing: through the CPU
    table's numpy view and a device table's ``index_put_`` (forced here on a CPU table)."""
    batched, single = ReqToTokenPool(4, 16), ReqToTokenPool(4, 16)
    if not numpy_view:
        batched._host = None
    for table in (batched, single):
        table.add_mirror("cpu")
    rows = [batched.alloc() for _ in range(3)]
    assert rows == [single.alloc() for _ in range(3)]
    for starts, lens, slots in (([0, 0, 0], [3, 1, 5], list(range(1, 10))),  # prefill-like
                                ([3, 1, 5], [1, 1, 1], [20, 21, 22])):  # decode-like
        batched.write_batch(rows, starts, lens, torch.tensor(slots))
        offset = 0
        for row, start, n in zip(rows, starts, lens):
            single.write(row, start, torch.tensor(slots[offset:offset + n]))
            offset += n
        batched.sync_mirror(), single.sync_mirror()
        assert torch.equal(batched.req_to_token, single.req_to_token)
        assert torch.equal(batched.mirror, single.mirror)
    before = batched.req_to_token.clone()
    for bad in (dict(rows=[rows[0], rows[0]], starts=[0, 1], lens=[1, 1]),  # a row twice
                dict(rows=[rows[0], 3], starts=[0, 0], lens=[1, 1]),  # a row never allocated
                dict(rows=rows[:2], starts=[0, 15], lens=[1, 2])):  # past max_context_len
        with pytest.raises(ValueError):
            batched.write_batch(bad["rows"], bad["starts"], bad["lens"], torch.arange(1, 1 + sum(bad["lens"])))
    assert torch.equal(batched.req_to_token, before)


@pytest.mark.parametrize("page_size", [1, 4])
def test_alloc_extend_of_one_token_each_continues_pages_or_takes_fresh_ones(page_size) -> None:
    """One token per sequence (a decode step; page size 1 always) has a fast path: a sequence
    inside a page continues it (its last slot + 1), one on a page boundary takes a fresh page's
    first slot, and only those take pages."""
    pool = kv_pool(64, page_size=page_size)
    prefix = [3, 4, 1, 8]
    held = [pool.alloc(n) for n in prefix]
    last = [int(h[-1]) for h in held]
    free = pool.available_size()
    got = pool.alloc_extend(prefix, last, [1, 1, 1, 1]).tolist()
    boundary = [p % page_size == 0 for p in prefix]
    for slot, loc, fresh in zip(got, last, boundary):
        assert slot % page_size == 0 if fresh else slot == loc + 1
    assert len(set(got)) == 4 and not set(got) & set(torch.cat(held).tolist())
    assert pool.available_size() == free - page_size * sum(boundary)


# ----------------------------------------------------------------------------------------------
# memory split
# ----------------------------------------------------------------------------------------------
def test_split_memory_follows_the_mamba_full_ratio_and_fits_the_budget() -> None:
    kv_bpt, st_bps = 64 * 1024, 26_800_000  # Marconi's 7B hybrid: 64 KiB/token, 26.8 MB/state
    total = 10 * 2**30
    split = split_memory(total, 0.9, kv_bpt, st_bps, page_size=16)
    assert split.num_kv_tokens % 16 == 0
    assert split.kv_bytes + split.state_bytes <= total
    assert split.state_bytes / split.kv_bytes == pytest.approx(0.9, rel=0.01)
    assert split.kv_bytes == (split.num_kv_tokens + 16) * kv_bpt  # sentinel page counted
    kv = KVPool(split.num_kv_tokens, 16, 4, 8, 128, torch.float16, accounting=True)
    assert kv.total_bytes <= split.kv_bytes


def test_split_memory_pure_attention_and_errors() -> None:
    split = split_memory(1 << 20, 0.0, 1024, 0, page_size=1)
    assert split.num_state_slots == 0 and split.num_kv_tokens == (1 << 20) // 1024 - 1
    with pytest.raises(ValueError):
        split_memory(1000, 0.5, 1024, 10)  # not even one page
    with pytest.raises(ValueError):
        split_memory(1 << 20, 0.0, 1024, 10)  # a hybrid needs a state share
    with pytest.raises(ValueError):
        split_memory(1 << 20, -1, 1024, 10)


def test_split_memory_without_attention_gives_the_states_everything() -> None:
    """A model without attention layers (Mamba) stores no KV: its states take the whole budget
    whatever the ratio, and its KV pool is indices alone."""
    from hyla.cache.memory import INDEX_ONLY_KV_TOKENS

    for ratio in (0.9, 0.0):
        split = split_memory(1 << 20, ratio, 0, 1000, page_size=16)
        assert split.num_state_slots == (1 << 20) // 1000 - 1 and split.kv_bytes == 0
        assert split.state_bytes <= 1 << 20 and split.num_kv_tokens == INDEX_ONLY_KV_TOKENS
    with pytest.raises(ValueError):
        split_memory(1500, 0.9, 0, 1000)  # not even one slot beside the sentinel
    with pytest.raises(ValueError):
        split_memory(1 << 20, 0.9, 0, 0)  # nothing to store at all


@pytest.mark.parametrize("numpy_view", [True, False])
def test_req_to_token_table_pads_each_row_past_its_length_with_slot_0(numpy_view) -> None:
    """``table(rows, lens)``: row ``i`` holds the first ``lens[i]`` slots of request row ``rows[i]``
    then zeros; ``packed`` the same slots in row order; the request table itself is unchanged."""
    pool = ReqToTokenPool(4, 16)
    if not numpy_view:
        pool._host = None  # a device table's path, on the CPU
    rows = [pool.alloc() for _ in range(3)]
    for i, row in enumerate(rows):
        pool.write(row, 0, torch.arange(100 * (i + 1), 100 * (i + 1) + 10))
    before = pool.req_to_token.clone()
    order, lens = [rows[2], rows[0], rows[1]], [4, 7, 2]
    table, packed = pool.table(order, lens)
    expected = torch.zeros(3, 7, dtype=torch.long)
    for i, (row, n) in enumerate(zip(order, lens)):
        expected[i, :n] = before[row, :n]
    assert torch.equal(table, expected)
    assert torch.equal(packed, torch.cat([before[row, :n] for row, n in zip(order, lens)]))
    table, packed = pool.table(order[:2], [5, 5])  # no padding
    assert torch.equal(table, torch.stack([before[order[0], :5], before[order[1], :5]]))
    assert torch.equal(packed, table.view(-1))
    assert torch.equal(pool.req_to_token, before)
