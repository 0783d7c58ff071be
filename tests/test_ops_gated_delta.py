"""Gated delta rule ops: chunked packed varlen + checkpoints + recurrent decode step, against the
token-by-token reference and against Hugging Face's ``torch_chunk/recurrent_gated_delta_rule`` (fp32)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers.models.qwen3_next.modeling_qwen3_next as hf
from hypothesis import given, settings
from hypothesis import strategies as st

from hyla.model.ops import chunk_gated_delta_rule_varlen, gated_delta_rule_ref, recurrent_gated_delta_rule_update

HK, HV, DK, DV = 2, 4, 32, 16
TOL = dict(atol=1e-5, rtol=1e-5)


def make(lengths: list[int], num_slots: int = 12, seed: int = 0, dtype=torch.float32):
    """Random packed inputs with the layer's real ranges (g = -exp(A_log) * softplus(a + dt_bias) <= 0,
    beta = sigmoid(b)) and a pool whose every row holds a random state."""
    gen = torch.Generator().manual_seed(seed)
    t = sum(lengths)
    q = torch.randn(t, HK, DK, generator=gen).to(dtype)
    k = torch.randn(t, HK, DK, generator=gen).to(dtype)
    v = torch.randn(t, HV, DV, generator=gen).to(dtype)
    a_log = torch.rand(HV, generator=gen) * 2 - 1
    g = -a_log.exp() * F.softplus(torch.randn(t, HV, generator=gen) + 0.5)  # [T, Hv] fp32
    beta = torch.sigmoid(torch.randn(t, HV, generator=gen)).to(dtype)
    pool = torch.randn(num_slots, HV, DK, DV, generator=gen) * 0.5  # fp32
    cu = torch.tensor([0] + lengths).cumsum(0)
    return q, k, v, g, beta, cu, pool


def ref(inputs, pool, slot, i, n=None):
    """Reference for sequence ``i`` alone (its first ``n`` tokens), from the pool as it was."""
    q, k, v, g, beta, cu, _ = inputs
    a = int(cu[i])
    e = int(cu[i + 1]) if n is None else a + n
    state = pool[slot] if slot >= 0 else None
    return gated_delta_rule_ref(q[a:e], k[a:e], v[a:e], g[a:e], beta[a:e], state)


def run(inputs, pool, slots, **kw):
    q, k, v, g, beta, cu, _ = inputs
    return chunk_gated_delta_rule_varlen(q, k, v, g, beta, cu, pool, torch.tensor(slots), **kw)


LENGTHS = [1, 63, 64, 65, 130, 3, 2]


def test_chunked_matches_recurrent_reference_per_sequence():
    inputs = make(LENGTHS)
    pool = inputs[-1]
    before = pool.clone()
    slots = [4, 0, 7, -1, 2, 9, 5]
    o = run(inputs, pool, slots)
    cu = inputs[5]
    for i, slot in enumerate(slots):
        o_ref, state = ref(inputs, before, slot, i)
        if slot >= 0:  # padding rows are don't-care
            torch.testing.assert_close(o[cu[i] : cu[i + 1]], o_ref, **TOL)
            torch.testing.assert_close(pool[slot], state, **TOL)
    untouched = [s for s in range(pool.shape[0]) if s not in slots]
    assert torch.equal(pool[untouched], before[untouched])


def test_checkpoints_equal_runs_that_stop_there():
    inputs = make(LENGTHS, num_slots=24)
    pool = inputs[-1]
    before = pool.clone()
    slots = [4, 0, 7, 11, 2, 9, 5]
    ckpt_seq = [1, 2, 3, 3, 4, 4, 4, 4, 4, 0, 6]
    ckpt_len = [63, 64, 65, 1, 1, 63, 64, 65, 130, 1, 1]
    ckpt_slot = [12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]
    run(inputs, pool, slots, ckpt_seq=torch.tensor(ckpt_seq), ckpt_len=torch.tensor(ckpt_len),
        ckpt_slot=torch.tensor(ckpt_slot))
    for i, n, row in zip(ckpt_seq, ckpt_len, ckpt_slot):
        _, state = ref(inputs, before, slots[i], i, n)
        torch.testing.assert_close(pool[row], state, **TOL)
    # a checkpoint at the last token is the sequence's final state
    torch.testing.assert_close(pool[20], pool[slots[4]], atol=1e-6, rtol=1e-6)
    untouched = [s for s in range(pool.shape[0]) if s not in slots + ckpt_slot]
    assert torch.equal(pool[untouched], before[untouched])


def test_split_run_with_carried_state_equals_one_run():
    inputs = make([200])
    q, k, v, g, beta, _, pool = inputs
    whole = pool.clone()
    o_whole = chunk_gated_delta_rule_varlen(q, k, v, g, beta, torch.tensor([0, 200]), whole, torch.tensor([3]))
    outs = []
    for a, e in [(0, 1), (1, 64), (64, 65), (65, 137), (137, 200)]:
        outs.append(chunk_gated_delta_rule_varlen(
            q[a:e], k[a:e], v[a:e], g[a:e], beta[a:e], torch.tensor([0, e - a]), pool, torch.tensor([3])))
    torch.testing.assert_close(torch.cat(outs), o_whole, **TOL)
    torch.testing.assert_close(pool[3], whole[3], **TOL)


def test_packed_batch_equals_each_sequence_alone():
    inputs = make(LENGTHS)
    q, k, v, g, beta, cu, pool = inputs
    slots = [4, 0, 7, 1, 2, 9, 5]
    alone = pool.clone()
    o = run(inputs, pool, slots)
    for i, slot in enumerate(slots):
        a, e = int(cu[i]), int(cu[i + 1])
        o_i = chunk_gated_delta_rule_varlen(
            q[a:e], k[a:e], v[a:e], g[a:e], beta[a:e], torch.tensor([0, e - a]), alone, torch.tensor([slot]))
        torch.testing.assert_close(o[a:e], o_i, **TOL)
        torch.testing.assert_close(pool[slot], alone[slot], **TOL)


def test_zero_length_sequence_keeps_its_state():
    inputs = make([5, 0, 70])
    pool = inputs[-1]
    before = pool.clone()
    run(inputs, pool, [1, 2, 3])
    assert torch.equal(pool[2], before[2])
    assert not torch.equal(pool[1], before[1])


def test_empty_checkpoint_tensors_mean_no_checkpoints():
    """ForwardBatch's defaults are empty tensors, not None."""
    inputs = make([5, 3])
    pool = inputs[-1]
    expected = pool.clone()
    run(inputs, expected, [1, 2])
    empty = torch.zeros(0, dtype=torch.long)
    run(inputs, pool, [1, 2], ckpt_seq=empty, ckpt_len=empty, ckpt_slot=empty)
    assert torch.equal(pool, expected)


def test_batch_of_empty_sequences_is_a_no_op():
    q, k, v, g, beta, _, pool = make([0, 0])
    before = pool.clone()
    o = chunk_gated_delta_rule_varlen(q, k, v, g, beta, torch.tensor([0, 0, 0]), pool, torch.tensor([1, 2]))
    assert o.shape == (0, HV, DV) and torch.equal(pool, before)


def test_matches_hf_chunk_kernel_with_initial_state():
    q, k, v, g, beta, _, pool = make([150])
    o_hf, state_hf = hf.torch_chunk_gated_delta_rule(
        q[None], k[None], v[None], g[None], beta[None], chunk_size=64, initial_state=pool[5:6].clone(),
        output_final_state=True, use_qk_l2norm_in_kernel=True)
    o = chunk_gated_delta_rule_varlen(q, k, v, g, beta, torch.tensor([0, 150]), pool, torch.tensor([5]))
    torch.testing.assert_close(o, o_hf[0], **TOL)
    torch.testing.assert_close(pool[5], state_hf[0], **TOL)


@pytest.mark.parametrize("slots", [[2, -1, 7, 0, 4, 11], [3, 4, 5, 6, 7, 8]], ids=["scattered", "consecutive"])
def test_update_matches_reference_step_and_hf(slots):
    q, k, v, g, beta, _, pool = make([6])
    before = pool.clone()
    o = recurrent_gated_delta_rule_update(q, k, v, g, beta, pool, torch.tensor(slots))
    for i, slot in enumerate(slots):
        if slot < 0:
            continue
        s = slice(i, i + 1)
        o_ref, state = gated_delta_rule_ref(q[s], k[s], v[s], g[s], beta[s], before[slot])
        torch.testing.assert_close(o[s], o_ref, **TOL)
        torch.testing.assert_close(pool[slot], state, **TOL)
        o_hf, state_hf = hf.torch_recurrent_gated_delta_rule(
            q[None, s], k[None, s], v[None, s], g[None, s], beta[None, s], initial_state=before[slot][None],
            output_final_state=True, use_qk_l2norm_in_kernel=True)
        torch.testing.assert_close(o[s], o_hf[0], **TOL)
        torch.testing.assert_close(pool[slot], state_hf[0], **TOL)
    untouched = [s for s in range(pool.shape[0]) if s not in slots]
    assert torch.equal(pool[untouched], before[untouched])


def test_decode_steps_continue_a_prefill():
    q, k, v, g, beta, _, pool = make([40])
    prefill = pool.clone()
    o_all = chunk_gated_delta_rule_varlen(q, k, v, g, beta, torch.tensor([0, 40]), prefill, torch.tensor([6]))
    chunk_gated_delta_rule_varlen(q[:30], k[:30], v[:30], g[:30], beta[:30], torch.tensor([0, 30]), pool,
                                  torch.tensor([6]))
    outs = [recurrent_gated_delta_rule_update(q[t : t + 1], k[t : t + 1], v[t : t + 1], g[t : t + 1],
                                              beta[t : t + 1], pool, torch.tensor([6])) for t in range(30, 40)]
    torch.testing.assert_close(torch.cat(outs), o_all[30:], **TOL)
    torch.testing.assert_close(pool[6], prefill[6], **TOL)


def test_without_l2norm_and_other_chunk_size():
    inputs = make([50, 17], seed=3)
    q, k, v, g, beta, cu, pool = inputs
    q, k = q * 0.2, k * 0.2  # keep the un-normalised delta rule stable
    before = pool.clone()
    o = chunk_gated_delta_rule_varlen(q, k, v, g, beta, cu, pool, torch.tensor([1, 2]), chunk_size=16,
                                      use_qk_l2norm=False)
    o_ref, state = gated_delta_rule_ref(q[:50], k[:50], v[:50], g[:50], beta[:50], before[1], use_qk_l2norm=False)
    torch.testing.assert_close(o[:50], o_ref, **TOL)
    torch.testing.assert_close(pool[1], state, **TOL)


def test_bf16_inputs_keep_fp32_state():
    q, k, v, g, beta, cu, pool = make([20, 70], dtype=torch.bfloat16)
    before = pool.clone()
    o = chunk_gated_delta_rule_varlen(q, k, v, g, beta, cu, pool, torch.tensor([1, 2]))
    assert o.dtype == torch.bfloat16 and pool.dtype == torch.float32
    o_ref, state = gated_delta_rule_ref(q[:20], k[:20], v[:20], g[:20], beta[:20], before[1])
    torch.testing.assert_close(o[:20].float(), o_ref.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(pool[1], state, **TOL)  # the math is fp32 whatever the input dtype
    o1 = recurrent_gated_delta_rule_update(q[:2], k[:2], v[:2], g[:2], beta[:2], pool, torch.tensor([1, 2]))
    assert o1.dtype == torch.bfloat16


@settings(max_examples=12, deadline=None, derandomize=True)
@given(
    lengths=st.lists(st.integers(0, 140), min_size=1, max_size=4),
    data=st.data(),
)
def test_random_batches_and_checkpoints_match_reference(lengths, data):
    inputs = make(lengths, num_slots=16, seed=len(lengths) + sum(lengths))
    pool = inputs[-1]
    before = pool.clone()
    slots = list(range(len(lengths)))
    ckpts = [(i, data.draw(st.integers(1, n))) for i, n in enumerate(lengths) if n and data.draw(st.booleans())]
    ckpt_slot = list(range(8, 8 + len(ckpts)))
    kw = {}
    if ckpts:
        kw = dict(ckpt_seq=torch.tensor([i for i, _ in ckpts]), ckpt_len=torch.tensor([n for _, n in ckpts]),
                  ckpt_slot=torch.tensor(ckpt_slot))
    o = run(inputs, pool, slots, **kw)
    cu = inputs[5]
    for i in range(len(lengths)):
        o_ref, state = ref(inputs, before, slots[i], i)
        torch.testing.assert_close(o[cu[i] : cu[i + 1]], o_ref, **TOL)
        torch.testing.assert_close(pool[slots[i]], state, **TOL)
    for (i, n), row in zip(ckpts, ckpt_slot):
        torch.testing.assert_close(pool[row], ref(inputs, before, slots[i], i, n)[1], **TOL)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda a: a.update(k=a["k"][:, :1]), "q and k"),
        (lambda a: a.update(v=torch.randn(8, 3, DV)), "multiple of key heads"),
        (lambda a: a.update(g=a["g"][:, :2]), "g must be"),
        (lambda a: a.update(ssm_states=torch.zeros(12, HV, DK, DV + 1)), "ssm_states"),
        (lambda a: a.update(cu_seqlens=torch.tensor([0, 9])), "end at the number of tokens"),
        (lambda a: a.update(slots=torch.tensor([3, 3])), "repeats"),
        (lambda a: a.update(ckpt_seq=torch.tensor([1]), ckpt_len=torch.tensor([4]), ckpt_slot=torch.tensor([9])),
         "outside \\[1"),
        (lambda a: a.update(ckpt_seq=torch.tensor([0, 1]), ckpt_len=torch.tensor([1, 1]),
                            ckpt_slot=torch.tensor([9, 9])), "repeats"),
        (lambda a: a.update(chunk_size=0), "chunk_size"),
    ],
)
def test_bad_input_raises_value_error(change, message):
    q, k, v, g, beta, cu, pool = make([5, 3])
    args = dict(q=q, k=k, v=v, g=g, beta=beta, cu_seqlens=cu, ssm_states=pool, slots=torch.tensor([1, 2]))
    change(args)
    before = args["ssm_states"].clone()
    with pytest.raises(ValueError, match=message):
        chunk_gated_delta_rule_varlen(**args)
    assert torch.equal(args["ssm_states"], before), "a rejected call must not touch the pool"


def test_update_rejects_bad_input():
    q, k, v, g, beta, _, pool = make([3])
    with pytest.raises(ValueError, match="shape"):
        recurrent_gated_delta_rule_update(q, k, v, g, beta, pool, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="beta"):
        recurrent_gated_delta_rule_update(q, k, v, g, beta[:2], pool, torch.tensor([0, 1, 2]))


def test_short_extends_run_token_by_token_with_checkpoints():
    """Extends of at most SHORT_EXTEND tokens (a verify step) take the recurrent path: outputs,
    final states and every-token checkpoints equal the reference; a padding row and an empty
    sequence write nothing; and a verify-like extend equals the same tokens fed as decode steps
    bitwise (both run the decode step's math)."""
    from hyla.model.ops.tree import SHORT_EXTEND

    lengths = [SHORT_EXTEND, 3, 0, 1, 5]
    inputs = make(lengths, num_slots=20)
    pool = inputs[-1]
    before = pool.clone()
    slots = [2, 5, 9, -1, 11]
    ckpts = [(0, 1), (0, SHORT_EXTEND), (1, 2), (4, 1), (4, 4), (4, 5)]
    ckpt_slot = [12, 13, 14, 15, 16, 17]
    o = run(inputs, pool, slots, ckpt_seq=torch.tensor([i for i, _ in ckpts]),
            ckpt_len=torch.tensor([n for _, n in ckpts]), ckpt_slot=torch.tensor(ckpt_slot))
    cu = inputs[5]
    for i, slot in enumerate(slots):
        if slot < 0:
            continue
        o_ref, state = ref(inputs, before, slot, i)
        torch.testing.assert_close(o[cu[i]:cu[i + 1]], o_ref, **TOL)
        torch.testing.assert_close(pool[slot], state, **TOL)
    for (i, n), row in zip(ckpts, ckpt_slot):
        torch.testing.assert_close(pool[row], ref(inputs, before, slots[i], i, n)[1], **TOL)
    untouched = [r for r in range(20) if r not in slots + ckpt_slot]
    assert torch.equal(pool[untouched], before[untouched])

    q, k, v, g, beta, _, _ = make([5], num_slots=4, seed=3)
    pool_a = make([5], num_slots=4, seed=3)[-1]
    pool_b = pool_a.clone()
    o_ext = chunk_gated_delta_rule_varlen(q, k, v, g, beta, torch.tensor([0, 5]), pool_a, torch.tensor([1]))
    o_dec = torch.cat([recurrent_gated_delta_rule_update(q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1],
                                                         beta[t:t + 1], pool_b, torch.tensor([1])) for t in range(5)])
    assert torch.equal(o_ext, o_dec) and torch.equal(pool_a, pool_b)
