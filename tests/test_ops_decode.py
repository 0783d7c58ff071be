"""Decode fast paths against the naive references: slot plans (validated once, no host read in the
op), in-place pool views vs gathered copies, padding rows, GQA/grouping shapes, the pool writer, and
the paged decode attention with its per-step KV table, mask and head-major rows."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from hyla.model.ops import (
    causal_conv1d_ref,
    causal_conv1d_update,
    gated_delta_rule_ref,
    mamba2_ssd_ref,
    mamba2_state_update,
    recurrent_gated_delta_rule_update,
)
from hyla.model.ops.attention import (
    decode_attention,
    decode_kv_mask,
    decode_kv_rows,
    decode_kv_table,
    paged_attention,
    paged_attention_decode,
    paged_attention_reference,
)
from hyla.model.ops.varlen import SlotPlan, open_state_rows, read_states, write_rows_, write_states

TOL = dict(atol=1e-5, rtol=1e-5)
SLOT_CASES = {
    "run": [3, 4, 5, 6],  # one ascending run: the ops update the pool rows through a view
    "scattered": [6, 0, 9, 2],  # gathered copy, written back
    "padding": [5, -1, 2, -1],  # -1 reads zeros, writes nothing
}


# --- the slot plan -----------------------------------------------------------------------------


def test_slot_plan_facts_and_validation():
    run = SlotPlan.build(torch.tensor([3, 4, 5]), num_slots=8)
    assert run.first == 3 and run.pad_rows is None and run.write_rows is None and run.batch_size == 3
    pad = SlotPlan.build(torch.tensor([2, -1, 7]), num_slots=8, host=[2, -1, 7])
    assert pad.first is None and pad.pad_rows.tolist() == [1]
    assert pad.write_rows.tolist() == [0, 2] and pad.write_index.tolist() == [2, 7]
    assert pad.read_index.tolist() == [2, 0, 7]
    with pytest.raises(ValueError, match="repeats"):
        SlotPlan.build(torch.tensor([1, 1]), num_slots=8)
    with pytest.raises(ValueError, match="outside"):
        SlotPlan.build(torch.tensor([1, 9]), num_slots=8, host=[1, 9])
    with pytest.raises(ValueError, match="shape"):
        SlotPlan.build(torch.tensor([1, 2]), num_slots=8, host=[1, 2, 3])
    with pytest.raises(ValueError, match="integer"):
        SlotPlan.build(torch.tensor([1.0]), num_slots=8, host=[1])


@pytest.mark.parametrize("slots", list(SLOT_CASES.values()), ids=list(SLOT_CASES))
def test_state_rows_read_write(slots):
    pool = torch.randn(10, 3, 2)
    before = pool.clone()
    plan = SlotPlan.build(torch.tensor(slots), num_slots=10)
    rows = read_states(pool, plan, torch.float64)
    for i, s in enumerate(slots):
        assert torch.equal(rows[i], before[s].double() if s >= 0 else torch.zeros(3, 2, dtype=torch.float64))
    opened, copied = open_state_rows(pool, plan, torch.float32)
    assert copied == (plan.first is None)
    opened.add_(1.0)
    if copied:
        write_states(pool, plan, opened)
    for i, s in enumerate(slots):
        if s >= 0:
            assert torch.equal(pool[s], before[s] + 1)
    untouched = [r for r in range(10) if r not in slots]
    assert torch.equal(pool[untouched], before[untouched])


def test_write_rows_is_index_copy():
    pool, values = torch.zeros(6, 2), torch.randn(2, 2)
    write_rows_(pool, torch.tensor([4, 1]), values)
    assert torch.equal(pool[4], values[0]) and torch.equal(pool[1], values[1]) and pool[[0, 2, 3, 5]].eq(0).all()


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None, reason="torch.compile needs a C++ compiler")
def test_write_rows_compiled_writes_the_pool_in_place():
    pool, values = torch.zeros(6, 2), torch.randn(2, 2)
    compiled = torch.compile(write_rows_, dynamic=True)
    compiled(pool, torch.tensor([0, 5]), values)
    assert torch.equal(pool[0], values[0]) and torch.equal(pool[5], values[1]) and pool[1:5].eq(0).all()


# --- linear-attention decode ops ---------------------------------------------------------------


@pytest.mark.parametrize("slots", list(SLOT_CASES.values()), ids=list(SLOT_CASES))
@pytest.mark.parametrize("bias", [True, False])
def test_conv_update_with_plan_matches_reference(slots, bias):
    gen = torch.Generator().manual_seed(1)
    b, c, k = len(slots), 20, 4
    x, weight = torch.randn(b, c, generator=gen), torch.randn(c, k, generator=gen)
    bias_t = torch.randn(c, generator=gen) if bias else None
    pool = torch.randn(10, c, k - 1, generator=gen)
    before = pool.clone()
    plan = SlotPlan.build(torch.tensor(slots), num_slots=10)
    y = causal_conv1d_update(x, weight, bias_t, pool, plan)
    for i, s in enumerate(slots):
        if s < 0:
            continue
        y_ref, window = causal_conv1d_ref(x[i : i + 1], weight, bias_t, before[s])
        torch.testing.assert_close(y[i : i + 1], y_ref, atol=1e-6, rtol=0)
        assert torch.equal(pool[s], window)
    untouched = [r for r in range(10) if r not in slots]
    assert torch.equal(pool[untouched], before[untouched])


@pytest.mark.parametrize("slots", list(SLOT_CASES.values()), ids=list(SLOT_CASES))
@pytest.mark.parametrize("heads", [(2, 4), (3, 3), (1, 4)], ids=["gqa2", "no-gqa", "gqa4"])
@pytest.mark.parametrize("l2norm", [True, False])
def test_gated_delta_update_with_plan_matches_reference(slots, heads, l2norm):
    gen = torch.Generator().manual_seed(2)
    (hk, hv), dk, dv, b = heads, 16, 8, len(slots)
    q, k = torch.randn(b, hk, dk, generator=gen), torch.randn(b, hk, dk, generator=gen)
    if not l2norm:
        q, k = q * 0.2, k * 0.2
    v = torch.randn(b, hv, dv, generator=gen)
    g = -F.softplus(torch.randn(b, hv, generator=gen))
    beta = torch.sigmoid(torch.randn(b, hv, generator=gen))
    pool = torch.randn(10, hv, dk, dv, generator=gen) * 0.5
    before = pool.clone()
    o = recurrent_gated_delta_rule_update(q, k, v, g, beta, pool, SlotPlan.build(torch.tensor(slots), 10),
                                          use_qk_l2norm=l2norm)
    for i, s in enumerate(slots):
        if s < 0:
            continue
        sl = slice(i, i + 1)
        o_ref, state = gated_delta_rule_ref(q[sl], k[sl], v[sl], g[sl], beta[sl], before[s], use_qk_l2norm=l2norm)
        torch.testing.assert_close(o[sl], o_ref, **TOL)
        torch.testing.assert_close(pool[s], state, **TOL)
    untouched = [r for r in range(10) if r not in slots]
    assert torch.equal(pool[untouched], before[untouched])


@pytest.mark.parametrize("slots", list(SLOT_CASES.values()), ids=list(SLOT_CASES))
@pytest.mark.parametrize("groups", [1, 2, 4])
@pytest.mark.parametrize("dt_limit", [None, (0.5, float("inf"))])
def test_mamba2_update_with_plan_matches_reference(slots, groups, dt_limit):
    gen = torch.Generator().manual_seed(3)
    h, p, n, b = 4, 8, 6, len(slots)
    x, dt = torch.randn(b, h, p, generator=gen), torch.randn(b, h, generator=gen)
    A = -torch.rand(h, generator=gen) - 0.5
    B, C = torch.randn(b, groups, n, generator=gen), torch.randn(b, groups, n, generator=gen)
    D, dt_bias = torch.randn(h, generator=gen), torch.randn(h, generator=gen)
    pool = torch.randn(10, h, p, n, generator=gen) * 0.5
    before = pool.clone()
    y = mamba2_state_update(x, dt, A, B, C, D, dt_bias, pool, SlotPlan.build(torch.tensor(slots), 10),
                            dt_limit=dt_limit)
    for i, s in enumerate(slots):
        if s < 0:
            continue
        sl = slice(i, i + 1)
        y_ref, state = mamba2_ssd_ref(x[sl], dt[sl], A, B[sl], C[sl], D, dt_bias, before[s], dt_limit=dt_limit)
        torch.testing.assert_close(y[sl], y_ref, **TOL)
        torch.testing.assert_close(pool[s], state, **TOL)
    untouched = [r for r in range(10) if r not in slots]
    assert torch.equal(pool[untouched], before[untouched])


def test_plan_of_the_wrong_batch_size_is_rejected():
    plan = SlotPlan.build(torch.tensor([1, 2, 3]), num_slots=8)
    x, weight, pool = torch.randn(2, 6), torch.randn(6, 4), torch.zeros(8, 6, 3)
    with pytest.raises(ValueError, match="shape"):
        causal_conv1d_update(x, weight, None, pool, plan)


def test_bf16_decode_keeps_dtypes_with_a_view_plan():
    gen = torch.Generator().manual_seed(4)
    plan = SlotPlan.build(torch.tensor([1, 2]), num_slots=4)
    x, weight = torch.randn(2, 6, generator=gen).bfloat16(), torch.randn(6, 4, generator=gen).bfloat16()
    conv_pool = torch.randn(4, 6, 3, generator=gen).bfloat16()
    before = conv_pool.clone()
    y = causal_conv1d_update(x, weight, None, conv_pool, plan)
    y_ref, window = causal_conv1d_ref(x[:1], weight, None, before[1])
    assert y.dtype == torch.bfloat16 and torch.equal(conv_pool[1], window.bfloat16())
    torch.testing.assert_close(y[:1].float(), y_ref.float(), atol=2e-2, rtol=2e-2)
    q, k = torch.randn(2, 1, 8, generator=gen).bfloat16(), torch.randn(2, 1, 8, generator=gen).bfloat16()
    v = torch.randn(2, 2, 4, generator=gen).bfloat16()
    g, beta = -torch.rand(2, 2, generator=gen), torch.rand(2, 2, generator=gen).bfloat16()
    ssm = torch.randn(4, 2, 8, 4, generator=gen)
    s_before = ssm.clone()
    o = recurrent_gated_delta_rule_update(q, k, v, g, beta, ssm, plan)
    assert o.dtype == torch.bfloat16 and ssm.dtype == torch.float32
    _, state = gated_delta_rule_ref(q[:1], k[:1], v[:1], g[:1], beta[:1], s_before[1])
    torch.testing.assert_close(ssm[1], state, **TOL)


# --- paged decode attention --------------------------------------------------------------------


def _decode_case(prefix_lens, hq=4, hkv=2, d=16, seed=0, num_slots=300):
    g = torch.Generator().manual_seed(seed)
    k_buf, v_buf = torch.randn(num_slots, hkv, d, generator=g), torch.randn(num_slots, hkv, d, generator=g)
    free = (torch.randperm(num_slots - 1, generator=g) + 1).tolist()
    kv_indices, indptr, out_loc = [], [0], []
    for p in prefix_lens:
        slots = [free.pop() for _ in range(p + 1)]
        kv_indices += slots
        out_loc.append(slots[-1])
        indptr.append(len(kv_indices))
    b = len(prefix_lens)
    q, k, v = (torch.randn(b, h, d, generator=g) for h in (hq, hkv, hkv))
    return q, k, v, k_buf, v_buf, torch.tensor(out_loc), torch.tensor(kv_indices), torch.tensor(indptr)


@settings(max_examples=20, deadline=None)
@given(st.lists(st.integers(0, 40), min_size=1, max_size=5), st.sampled_from([(4, 2), (4, 4), (6, 1)]),
       st.integers(0, 99))
def test_paged_attention_decode_matches_reference(prefix_lens, heads, seed):
    hq, hkv = heads
    q, k, v, k_buf, v_buf, out_loc, kv_indices, indptr = _decode_case(prefix_lens, hq, hkv, seed=seed)
    kr, vr = k_buf.clone(), v_buf.clone()
    seq_lens = [p + 1 for p in prefix_lens]
    table, mask = decode_kv_table(kv_indices, indptr, seq_lens)
    if len(seq_lens) > 1:
        mask = decode_kv_mask(seq_lens, "cpu", always=True)  # what ForwardBatch passes for B > 1
    got = paged_attention_decode(q, k, v, k_buf, v_buf, out_loc, table, mask, 0.25,
                                 kv_rows=decode_kv_rows(table, hkv))
    want = paged_attention_reference(q, k, v, kr, vr, out_loc, kv_indices, indptr, prefix_lens,
                                     [1] * len(prefix_lens), 0.25)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(k_buf, kr) and torch.equal(v_buf, vr)  # the new K/V landed in their slots


def test_decode_kv_table_pads_with_the_sentinel():
    kv_indices, indptr = torch.tensor([7, 8, 9, 4, 5]), torch.tensor([0, 3, 5])
    table, mask = decode_kv_table(kv_indices, indptr, [3, 2])
    assert table.tolist() == [[7, 8, 9], [4, 5, 0]]
    assert mask.tolist() == [[0, 0, 0], [0, 0, float("-inf")]]
    assert decode_kv_table(kv_indices[:3], indptr[:2], [3])[1] is None  # one full row: no mask
    assert decode_kv_rows(table, 2).tolist() == [[[14, 16, 18], [15, 17, 19]], [[8, 10, 0], [9, 11, 1]]]


def test_padded_rows_ignore_whatever_the_padding_slot_holds():
    q, k, v, k_buf, v_buf, out_loc, kv_indices, indptr = _decode_case([5, 1])
    table, mask = decode_kv_table(kv_indices, indptr, [6, 2])
    a = decode_attention(q, k_buf, v_buf, table, mask, 0.25)
    k_buf[0], v_buf[0] = 1e4, -1e4  # slot 0: the sentinel the short row is padded with
    b = decode_attention(q, k_buf, v_buf, table, mask, 0.25)
    assert torch.equal(a, b)


def test_paged_attention_decode_rejects_bad_input():
    q, k, v, k_buf, v_buf, out_loc, kv_indices, indptr = _decode_case([3, 2])
    table, mask = decode_kv_table(kv_indices, indptr, [4, 3])
    with pytest.raises(ValueError, match="batch size"):
        paged_attention_decode(q, k, v, k_buf, v_buf, out_loc[:1], table, mask, 0.25)
    with pytest.raises(ValueError, match="multiple"):
        paged_attention_decode(q[:, :3], k, v, k_buf, v_buf, out_loc, table, mask, 0.25)
    with pytest.raises(ValueError, match="fit the KV buffer"):
        paged_attention_decode(q, k[..., :8], v, k_buf, v_buf, out_loc, table, mask, 0.25)


def test_generic_paged_attention_decode_path_uses_the_same_kernel():
    """``paged_attention`` with all extend lengths 1 (no precomputed table) equals the fast path."""
    q, k, v, k_buf, v_buf, out_loc, kv_indices, indptr = _decode_case([9, 0, 4])
    kb2, vb2 = k_buf.clone(), v_buf.clone()
    a = paged_attention(q, k, v, k_buf, v_buf, out_loc, kv_indices, indptr, [9, 0, 4], [1, 1, 1], 0.25)
    table, mask = decode_kv_table(kv_indices, indptr, [10, 1, 5])
    b = paged_attention_decode(q, k, v, kb2, vb2, out_loc, table, mask, 0.25)
    assert torch.equal(a, b)
