"""The delta-rule ops' shared contract, for Gated DeltaNet (one decay per head, ``gated_delta.py``) and
Kimi Delta Attention (one decay per key channel, ``kda.py``): chunked packed varlen + checkpoints +
recurrent decode step, against each op's token-by-token reference and against transformers' torch
forms (fp32). What only one op has: ``test_ops_gated_delta.py`` (short extends), ``test_ops_kda.py``
(per-channel decays, strong decays, any chunk size)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import pytest
import torch
import torch.nn.functional as F
import transformers.models.kimi_linear.modeling_kimi_linear as hf_kda
import transformers.models.qwen3_next.modeling_qwen3_next as hf_gdn
from hypothesis import given, settings
from hypothesis import strategies as st

from hyla.model.ops import (
    chunk_gated_delta_rule_varlen,
    chunk_kda_varlen,
    gated_delta_rule_ref,
    kda_ref,
    recurrent_gated_delta_rule_update,
    recurrent_kda_update,
)

HK, HV, DK, DV = 2, 4, 32, 16
TOL = dict(atol=1e-5, rtol=1e-5)


@dataclass(frozen=True)
class DeltaRuleOp:
    """One delta-rule op under test: its chunked and decode entry points, its reference, transformers'
    chunked and recurrent forms (which take ``hf_key_heads`` key heads) and the shape of its decay."""

    name: str
    chunk: Callable[..., torch.Tensor]
    update: Callable[..., torch.Tensor]
    reference: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    hf_chunk: Callable
    hf_recurrent: Callable
    hf_key_heads: int
    per_channel_decay: bool

    def make(self, lengths: list[int], num_slots: int = 12, seed: int = 0, dtype=torch.float32, hk: int = HK,
             decay_scale: float = 1.0):
        """Random packed inputs with the layer's real ranges (log-decay ``g = -exp(A_log) * softplus(a +
        dt_bias) <= 0``, per head ``[T, Hv]`` or per channel ``[T, Hv, Dk]``; ``beta = sigmoid(b)``) and a
        pool whose every row holds a random state."""
        gen = torch.Generator().manual_seed(seed)
        t = sum(lengths)
        q = torch.randn(t, hk, DK, generator=gen).to(dtype)
        k = torch.randn(t, hk, DK, generator=gen).to(dtype)
        v = torch.randn(t, HV, DV, generator=gen).to(dtype)
        if self.per_channel_decay:
            a_log = torch.rand(HV, 1, generator=gen) * 2 - 1
            g = -a_log.exp() * F.softplus(torch.randn(t, HV, DK, generator=gen) + 0.5) * decay_scale  # fp32
        else:
            a_log = torch.rand(HV, generator=gen) * 2 - 1
            g = -a_log.exp() * F.softplus(torch.randn(t, HV, generator=gen) + 0.5) * decay_scale  # fp32
        beta = torch.sigmoid(torch.randn(t, HV, generator=gen)).to(dtype)
        pool = torch.randn(num_slots, HV, DK, DV, generator=gen) * 0.5  # fp32
        cu = torch.tensor([0] + lengths).cumsum(0)
        return q, k, v, g, beta, cu, pool

    def ref(self, inputs, pool, slot, i, n=None):
        """Reference for sequence ``i`` alone (its first ``n`` tokens), from the pool as it was."""
        q, k, v, g, beta, cu, _ = inputs
        a = int(cu[i])
        e = int(cu[i + 1]) if n is None else a + n
        state = pool[slot] if slot >= 0 else None
        return self.reference(q[a:e], k[a:e], v[a:e], g[a:e], beta[a:e], state)

    def run(self, inputs, pool, slots, **kw):
        q, k, v, g, beta, cu, _ = inputs
        return self.chunk(q, k, v, g, beta, cu, pool, torch.tensor(slots), **kw)


GDN = DeltaRuleOp("gated_delta", chunk_gated_delta_rule_varlen, recurrent_gated_delta_rule_update,
                  gated_delta_rule_ref, hf_gdn.torch_chunk_gated_delta_rule, hf_gdn.torch_recurrent_gated_delta_rule,
                  hf_key_heads=HK, per_channel_decay=False)
KDA = DeltaRuleOp("kda", chunk_kda_varlen, recurrent_kda_update, kda_ref, hf_kda.chunk_kimi_delta_attention,
                  hf_kda.recurrent_kimi_delta_attention, hf_key_heads=HV, per_channel_decay=True)
pytestmark = pytest.mark.parametrize("op", [GDN, KDA], ids=lambda op: op.name)

LENGTHS = [1, 63, 64, 65, 130, 3, 2]


def test_chunked_matches_recurrent_reference_per_sequence(op):
    inputs = op.make(LENGTHS)
    pool = inputs[-1]
    before = pool.clone()
    slots = [4, 0, 7, -1, 2, 9, 5]
    o = op.run(inputs, pool, slots)
    cu = inputs[5]
    for i, slot in enumerate(slots):
        o_ref, state = op.ref(inputs, before, slot, i)
        if slot >= 0:  # padding rows are don't-care
            torch.testing.assert_close(o[cu[i] : cu[i + 1]], o_ref, **TOL)
            torch.testing.assert_close(pool[slot], state, **TOL)
    untouched = [s for s in range(pool.shape[0]) if s not in slots]
    assert torch.equal(pool[untouched], before[untouched])


def test_decays_past_fp32_exp_range_stay_exact(op):
    """Log-decays of up to ~-60 per token: a chunk's cumulative decays reach -1000s, whose fp32
    ``exp`` would be denormal (``decay_exp`` drops factors under e^-40, exactly 0 in these sums)."""
    inputs = op.make([150, 20], decay_scale=30.0, seed=4)
    pool = inputs[-1]
    before = pool.clone()
    o = op.run(inputs, pool, [1, 2], ckpt_seq=torch.tensor([0, 0]), ckpt_len=torch.tensor([100, 128]),
               ckpt_slot=torch.tensor([5, 6]))
    assert torch.isfinite(o).all() and torch.isfinite(pool).all()
    o_ref, state = op.ref(inputs, before, 1, 0)
    torch.testing.assert_close(o[:150], o_ref, **TOL)
    torch.testing.assert_close(pool[1], state, **TOL)
    for row, n in ((5, 100), (6, 128)):
        torch.testing.assert_close(pool[row], op.ref(inputs, before, 1, 0, n)[1], **TOL)


def test_padding_sequence_starts_from_zeros(op):
    inputs = op.make([40, 70])
    pool = inputs[-1]
    before = pool.clone()
    o = op.run(inputs, pool, [-1, 3])
    o_ref, _ = op.ref(inputs, before, -1, 0)  # from a zero state
    torch.testing.assert_close(o[:40], o_ref, **TOL)
    assert torch.equal(pool[torch.arange(pool.shape[0]) != 3], before[torch.arange(pool.shape[0]) != 3])


def test_checkpoints_equal_runs_that_stop_there(op):
    inputs = op.make(LENGTHS, num_slots=24)
    pool = inputs[-1]
    before = pool.clone()
    slots = [4, 0, 7, 11, 2, 9, 5]
    ckpt_seq = [1, 2, 3, 3, 4, 4, 4, 4, 4, 0, 6, 4]
    ckpt_len = [63, 64, 65, 1, 1, 63, 64, 65, 130, 1, 1, 37]
    ckpt_slot = [12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23]
    op.run(inputs, pool, slots, ckpt_seq=torch.tensor(ckpt_seq), ckpt_len=torch.tensor(ckpt_len),
           ckpt_slot=torch.tensor(ckpt_slot))
    for i, n, row in zip(ckpt_seq, ckpt_len, ckpt_slot):
        _, state = op.ref(inputs, before, slots[i], i, n)
        torch.testing.assert_close(pool[row], state, **TOL)
    # a checkpoint at the last token is the sequence's final state
    torch.testing.assert_close(pool[20], pool[slots[4]], atol=1e-6, rtol=1e-6)
    untouched = [s for s in range(pool.shape[0]) if s not in slots + ckpt_slot]
    assert torch.equal(pool[untouched], before[untouched])


def test_split_run_with_carried_state_equals_one_run(op):
    q, k, v, g, beta, _, pool = op.make([200])
    whole = pool.clone()
    o_whole = op.chunk(q, k, v, g, beta, torch.tensor([0, 200]), whole, torch.tensor([3]))
    outs = []
    for a, e in [(0, 1), (1, 64), (64, 65), (65, 137), (137, 200)]:
        outs.append(op.chunk(q[a:e], k[a:e], v[a:e], g[a:e], beta[a:e], torch.tensor([0, e - a]), pool,
                             torch.tensor([3])))
    torch.testing.assert_close(torch.cat(outs), o_whole, **TOL)
    torch.testing.assert_close(pool[3], whole[3], **TOL)


def test_packed_batch_equals_each_sequence_alone(op):
    inputs = op.make(LENGTHS)
    q, k, v, g, beta, cu, pool = inputs
    slots = [4, 0, 7, 1, 2, 9, 5]
    alone = pool.clone()
    o = op.run(inputs, pool, slots)
    for i, slot in enumerate(slots):
        a, e = int(cu[i]), int(cu[i + 1])
        o_i = op.chunk(q[a:e], k[a:e], v[a:e], g[a:e], beta[a:e], torch.tensor([0, e - a]), alone,
                       torch.tensor([slot]))
        torch.testing.assert_close(o[a:e], o_i, **TOL)
        torch.testing.assert_close(pool[slot], alone[slot], **TOL)


def test_key_heads_shared_by_value_heads(op):
    inputs = op.make([70, 9], hk=1, seed=5)
    pool = inputs[-1]
    before = pool.clone()
    o = op.run(inputs, pool, [1, 2])
    o_ref, state = op.ref(inputs, before, 1, 0)
    torch.testing.assert_close(o[:70], o_ref, **TOL)
    torch.testing.assert_close(pool[1], state, **TOL)


def test_zero_length_sequence_keeps_its_state(op):
    inputs = op.make([5, 0, 70])
    pool = inputs[-1]
    before = pool.clone()
    op.run(inputs, pool, [1, 2, 3])
    assert torch.equal(pool[2], before[2])
    assert not torch.equal(pool[1], before[1])


def test_empty_checkpoint_tensors_mean_no_checkpoints(op):
    """ForwardBatch's defaults are empty tensors, not None."""
    inputs = op.make([5, 3])
    pool = inputs[-1]
    expected = pool.clone()
    op.run(inputs, expected, [1, 2])
    empty = torch.zeros(0, dtype=torch.long)
    op.run(inputs, pool, [1, 2], ckpt_seq=empty, ckpt_len=empty, ckpt_slot=empty)
    assert torch.equal(pool, expected)


def test_batch_of_empty_sequences_is_a_no_op(op):
    q, k, v, g, beta, _, pool = op.make([0, 0])
    before = pool.clone()
    o = op.chunk(q, k, v, g, beta, torch.tensor([0, 0, 0]), pool, torch.tensor([1, 2]))
    assert o.shape == (0, HV, DV) and torch.equal(pool, before)


def test_matches_hf_chunk_kernel_with_initial_state(op):
    q, k, v, g, beta, _, pool = op.make([150], hk=op.hf_key_heads)
    o_hf, state_hf = op.hf_chunk(
        q[None], k[None], v[None], g[None], beta[None], chunk_size=64, initial_state=pool[5:6].clone(),
        output_final_state=True, use_qk_l2norm_in_kernel=True)
    o = op.chunk(q, k, v, g, beta, torch.tensor([0, 150]), pool, torch.tensor([5]))
    torch.testing.assert_close(o, o_hf[0], **TOL)
    torch.testing.assert_close(pool[5], state_hf[0], **TOL)


@pytest.mark.parametrize("slots", [[2, -1, 7, 0, 4, 11], [3, 4, 5, 6, 7, 8]], ids=["scattered", "consecutive"])
def test_update_matches_reference_step_and_hf(op, slots):
    q, k, v, g, beta, _, pool = op.make([6], hk=op.hf_key_heads)
    before = pool.clone()
    o = op.update(q, k, v, g, beta, pool, torch.tensor(slots))
    for i, slot in enumerate(slots):
        if slot < 0:
            continue
        s = slice(i, i + 1)
        o_ref, state = op.reference(q[s], k[s], v[s], g[s], beta[s], before[slot])
        torch.testing.assert_close(o[s], o_ref, **TOL)
        torch.testing.assert_close(pool[slot], state, **TOL)
        o_hf, state_hf = op.hf_recurrent(
            q[None, s], k[None, s], v[None, s], g[None, s], beta[None, s], initial_state=before[slot][None],
            output_final_state=True, use_qk_l2norm_in_kernel=True)
        torch.testing.assert_close(o[s], o_hf[0], **TOL)
        torch.testing.assert_close(pool[slot], state_hf[0], **TOL)
    untouched = [s for s in range(pool.shape[0]) if s not in slots]
    assert torch.equal(pool[untouched], before[untouched])


def test_decode_steps_continue_a_prefill(op):
    q, k, v, g, beta, _, pool = op.make([40])
    prefill = pool.clone()
    o_all = op.chunk(q, k, v, g, beta, torch.tensor([0, 40]), prefill, torch.tensor([6]))
    op.chunk(q[:30], k[:30], v[:30], g[:30], beta[:30], torch.tensor([0, 30]), pool, torch.tensor([6]))
    outs = [op.update(q[t : t + 1], k[t : t + 1], v[t : t + 1], g[t : t + 1], beta[t : t + 1], pool,
                      torch.tensor([6])) for t in range(30, 40)]
    torch.testing.assert_close(torch.cat(outs), o_all[30:], **TOL)
    torch.testing.assert_close(pool[6], prefill[6], **TOL)


def test_without_l2norm_and_other_chunk_size(op):
    q, k, v, g, beta, cu, pool = op.make([50, 17], seed=3)
    q, k = q * 0.2, k * 0.2  # keep the un-normalised delta rule stable
    before = pool.clone()
    o = op.chunk(q, k, v, g, beta, cu, pool, torch.tensor([1, 2]), chunk_size=16, use_qk_l2norm=False)
    o_ref, state = op.reference(q[:50], k[:50], v[:50], g[:50], beta[:50], before[1], use_qk_l2norm=False)
    torch.testing.assert_close(o[:50], o_ref, **TOL)
    torch.testing.assert_close(pool[1], state, **TOL)


def test_bf16_inputs_keep_fp32_state(op):
    q, k, v, g, beta, cu, pool = op.make([20, 70], dtype=torch.bfloat16)
    before = pool.clone()
    o = op.chunk(q, k, v, g, beta, cu, pool, torch.tensor([1, 2]))
    assert o.dtype == torch.bfloat16 and pool.dtype == torch.float32
    o_ref, state = op.reference(q[:20], k[:20], v[:20], g[:20], beta[:20], before[1])
    torch.testing.assert_close(o[:20].float(), o_ref.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(pool[1], state, **TOL)  # the math is fp32 whatever the input dtype
    o1 = op.update(q[:2], k[:2], v[:2], g[:2], beta[:2], pool, torch.tensor([1, 2]))
    assert o1.dtype == torch.bfloat16


@settings(max_examples=12, deadline=None, derandomize=True)
@given(
    lengths=st.lists(st.integers(0, 140), min_size=1, max_size=4),
    data=st.data(),
)
def test_random_batches_and_checkpoints_match_reference(op, lengths, data):
    inputs = op.make(lengths, num_slots=16, seed=len(lengths) + sum(lengths))
    pool = inputs[-1]
    before = pool.clone()
    slots = list(range(len(lengths)))
    ckpts = [(i, data.draw(st.integers(1, n))) for i, n in enumerate(lengths) if n and data.draw(st.booleans())]
    ckpt_slot = list(range(8, 8 + len(ckpts)))
    kw = {}
    if ckpts:
        kw = dict(ckpt_seq=torch.tensor([i for i, _ in ckpts]), ckpt_len=torch.tensor([n for _, n in ckpts]),
                  ckpt_slot=torch.tensor(ckpt_slot))
    o = op.run(inputs, pool, slots, **kw)
    cu = inputs[5]
    for i in range(len(lengths)):
        o_ref, state = op.ref(inputs, before, slots[i], i)
        torch.testing.assert_close(o[cu[i] : cu[i + 1]], o_ref, **TOL)
        torch.testing.assert_close(pool[slots[i]], state, **TOL)
    for (i, n), row in zip(ckpts, ckpt_slot):
        torch.testing.assert_close(pool[row], op.ref(inputs, before, slots[i], i, n)[1], **TOL)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda a: a.update(k=a["k"][:, :1]), "q and k"),
        (lambda a: a.update(v=torch.randn(8, 3, DV)), "multiple of key heads"),
        (lambda a: a.update(g=a["g"][:, :2]), "g must be"),
        (lambda a: a.update(beta=a["beta"][:, :2]), "beta must be"),
        (lambda a: a.update(ssm_states=torch.zeros(12, HV, DK, DV + 1)), "ssm_states"),
        (lambda a: a.update(cu_seqlens=torch.tensor([0, 9])), "end at the number of tokens"),
        (lambda a: a.update(slots=torch.tensor([3, 3])), "repeats"),
        (lambda a: a.update(ckpt_seq=torch.tensor([1]), ckpt_len=torch.tensor([4]), ckpt_slot=torch.tensor([9])),
         "outside \\[1"),
        (lambda a: a.update(ckpt_seq=torch.tensor([0, 1]), ckpt_len=torch.tensor([1, 1]),
                            ckpt_slot=torch.tensor([9, 9])), "repeats"),
        (lambda a: a.update(ckpt_seq=torch.tensor([0]), ckpt_len=torch.tensor([1]), ckpt_slot=torch.tensor([2])),
         "also a sequence slot"),
        (lambda a: a.update(chunk_size=0), "chunk_size"),
    ],
)
def test_bad_input_raises_value_error(op, change, message):
    q, k, v, g, beta, cu, pool = op.make([5, 3])
    args = dict(q=q, k=k, v=v, g=g, beta=beta, cu_seqlens=cu, ssm_states=pool, slots=torch.tensor([1, 2]))
    change(args)
    before = args["ssm_states"].clone()
    with pytest.raises(ValueError, match=message):
        op.chunk(**args)
    assert torch.equal(args["ssm_states"], before), "a rejected call must not touch the pool"


def test_update_rejects_bad_input(op):
    q, k, v, g, beta, _, pool = op.make([3])
    with pytest.raises(ValueError, match="shape"):
        op.update(q, k, v, g, beta, pool, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="beta"):
        op.update(q, k, v, g, beta[:2], pool, torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match="g must be"):
        op.update(q, k, v, g[:, :2], beta, pool, torch.tensor([0, 1, 2]))
