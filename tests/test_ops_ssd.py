"""Mamba2 SSD ops: chunked packed varlen scan + checkpoints + decode update, against the
token-by-token reference and against Hugging Face's ``mamba2_chunk_scan`` /
``mamba2_selective_state_update`` (fp32), including NemotronH's dt-clamp asymmetry."""

from __future__ import annotations

import pytest
import torch
import transformers.models.nemotron_h.modeling_nemotron_h as hf
from hypothesis import given, settings
from hypothesis import strategies as st

from hyla.model.ops import mamba2_chunk_scan_varlen, mamba2_ssd_ref, mamba2_state_update
from hyla.model.ops.varlen import DECAY_FLOOR, decay_exp

H, P, G, N = 8, 16, 2, 16
Q = 64
TOL = dict(atol=1e-5, rtol=1e-5)


class Inputs:
    """Random packed inputs with NemotronH's parameter ranges (A = -exp(A_log), A_log ~ log(1..H);
    dt_bias, D ~ 1) and a pool whose every row holds a random state."""

    def __init__(self, lengths: list[int], num_slots: int = 12, seed: int = 0, dtype=torch.float32):
        gen = torch.Generator().manual_seed(seed)
        t = sum(lengths)
        self.x = torch.randn(t, H, P, generator=gen).to(dtype)
        self.dt = torch.randn(t, H, generator=gen).to(dtype)
        self.A = -(torch.arange(1, H + 1).float().log() + 0.1 * torch.randn(H, generator=gen)).exp()
        self.B = torch.randn(t, G, N, generator=gen).to(dtype)
        self.C = torch.randn(t, G, N, generator=gen).to(dtype)
        self.D = 1 + 0.1 * torch.randn(H, generator=gen)
        self.dt_bias = 1 + 0.1 * torch.randn(H, generator=gen)
        self.pool = torch.randn(num_slots, H, P, N, generator=gen) * 0.5  # fp32
        self.cu = torch.tensor([0] + lengths).cumsum(0)

    def params(self, a: int = 0, e: int | None = None) -> tuple:
        s = slice(a, e)
        return self.x[s], self.dt[s], self.A, self.B[s], self.C[s], self.D, self.dt_bias

    def ref(self, pool, slot, i, n=None, dt_limit=None):
        """Reference for sequence ``i`` alone (its first ``n`` tokens), from ``pool`` as it was."""
        a = int(self.cu[i])
        e = int(self.cu[i + 1]) if n is None else a + n
        return mamba2_ssd_ref(*self.params(a, e), pool[slot] if slot >= 0 else None, dt_limit=dt_limit)

    def run(self, slots, **kw):
        kw.setdefault("chunk_size", Q)
        return mamba2_chunk_scan_varlen(*self.params(), self.cu, self.pool, torch.tensor(slots), **kw)


LENGTHS = [1, 63, 64, 65, 130, 3, 2]


def test_chunked_matches_recurrent_reference_per_sequence():
    inp = Inputs(LENGTHS)
    before = inp.pool.clone()
    slots = [4, 0, 7, -1, 2, 9, 5]
    y = inp.run(slots)
    for i, slot in enumerate(slots):
        y_ref, state = inp.ref(before, slot, i)
        if slot >= 0:  # padding rows are don't-care
            torch.testing.assert_close(y[inp.cu[i] : inp.cu[i + 1]], y_ref, **TOL)
            torch.testing.assert_close(inp.pool[slot], state, **TOL)
    untouched = [s for s in range(inp.pool.shape[0]) if s not in slots]
    assert torch.equal(inp.pool[untouched], before[untouched])


def test_decay_exp_drops_factors_below_the_floor():
    x = torch.tensor([0.0, -1.0, DECAY_FLOOR + 0.5, DECAY_FLOOR - 0.5, -200.0, float("-inf")])
    y = decay_exp(x)
    assert torch.equal(y[:3], x[:3].exp()) and torch.equal(y[3:], torch.zeros(3))
    assert not ((y != 0) & (y.abs() < torch.finfo(torch.float32).tiny)).any()  # no denormals


def test_strong_decays_stay_exact():
    """dt ~ 10 on heads with A down to -8: cumulative log-decays reach -10^3 inside a chunk (outputs
    grow with dt: fp32 tolerance relative to them)."""
    inp = Inputs([150, 20], seed=3)
    inp.dt = inp.dt.abs() * 10
    before = inp.pool.clone()
    y = inp.run([1, 2], ckpt_seq=torch.tensor([0]), ckpt_len=torch.tensor([100]), ckpt_slot=torch.tensor([5]))
    y_ref, state = inp.ref(before, 1, 0)
    torch.testing.assert_close(y[:150], y_ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(inp.pool[1], state, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(inp.pool[5], inp.ref(before, 1, 0, 100)[1], atol=1e-4, rtol=1e-4)


def test_checkpoints_equal_runs_that_stop_there():
    inp = Inputs(LENGTHS, num_slots=24)
    before = inp.pool.clone()
    slots = [4, 0, 7, 11, 2, 9, 5]
    ckpt_seq = [1, 2, 3, 3, 4, 4, 4, 4, 4, 0, 6]
    ckpt_len = [63, 64, 65, 1, 1, 63, 64, 65, 130, 1, 1]
    ckpt_slot = [12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]
    limit = (1e-3, float("inf"))
    inp.run(slots, dt_limit=limit, ckpt_seq=torch.tensor(ckpt_seq), ckpt_len=torch.tensor(ckpt_len),
            ckpt_slot=torch.tensor(ckpt_slot))
    for i, n, row in zip(ckpt_seq, ckpt_len, ckpt_slot):
        _, state = inp.ref(before, slots[i], i, n, dt_limit=limit)
        torch.testing.assert_close(inp.pool[row], state, **TOL)
    torch.testing.assert_close(inp.pool[20], inp.pool[slots[4]], atol=1e-6, rtol=1e-6)
    untouched = [s for s in range(inp.pool.shape[0]) if s not in slots + ckpt_slot]
    assert torch.equal(inp.pool[untouched], before[untouched])


def test_split_run_with_carried_state_equals_one_run():
    inp = Inputs([200])
    whole = inp.pool.clone()
    y_whole = mamba2_chunk_scan_varlen(*inp.params(), inp.cu, whole, torch.tensor([3]), chunk_size=Q)
    ys = []
    for a, e in [(0, 1), (1, 64), (64, 65), (65, 137), (137, 200)]:
        ys.append(mamba2_chunk_scan_varlen(*inp.params(a, e), torch.tensor([0, e - a]), inp.pool, torch.tensor([3]),
                                           chunk_size=Q))
    torch.testing.assert_close(torch.cat(ys), y_whole, **TOL)
    torch.testing.assert_close(inp.pool[3], whole[3], **TOL)


def test_packed_batch_equals_each_sequence_alone():
    inp = Inputs(LENGTHS)
    slots = [4, 0, 7, 1, 2, 9, 5]
    alone = inp.pool.clone()
    y = inp.run(slots)
    for i, slot in enumerate(slots):
        a, e = int(inp.cu[i]), int(inp.cu[i + 1])
        y_i = mamba2_chunk_scan_varlen(*inp.params(a, e), torch.tensor([0, e - a]), alone, torch.tensor([slot]),
                                       chunk_size=Q)
        torch.testing.assert_close(y[a:e], y_i, **TOL)
        torch.testing.assert_close(inp.pool[slot], alone[slot], **TOL)


def test_zero_length_sequence_keeps_its_state():
    inp = Inputs([5, 0, 70])
    before = inp.pool.clone()
    inp.run([1, 2, 3])
    assert torch.equal(inp.pool[2], before[2])
    assert not torch.equal(inp.pool[1], before[1])


def test_batch_of_empty_sequences_is_a_no_op():
    inp = Inputs([0, 0])
    before = inp.pool.clone()
    y = inp.run([1, 2])
    assert y.shape == (0, H, P) and torch.equal(inp.pool, before)


@pytest.mark.parametrize("chunk_size, length", [(64, 150), (128, 300)])
def test_matches_hf_chunk_scan_with_initial_state_and_dt_limit(chunk_size, length):
    inp = Inputs([length])
    limit = (0.5, float("inf"))  # high enough that the clamp bites on some tokens
    x, dt, A, B, C, D, dt_bias = inp.params()
    y_hf, state_hf = hf.mamba2_chunk_scan(
        x[None], dt[None], A, B[None], C[None], chunk_size, D=D, dt_bias=dt_bias,
        initial_states=inp.pool[5:6].clone(), dt_softplus=True, dt_limit=limit, return_final_states=True)
    y = inp.run([5], chunk_size=chunk_size, dt_limit=limit)
    torch.testing.assert_close(y, y_hf[0], **TOL)
    torch.testing.assert_close(inp.pool[5], state_hf[0], **TOL)
    unclamped = Inputs([length]).run([5], chunk_size=chunk_size)
    assert (unclamped - y).abs().max() > 1e-3, "the dt clamp must change the result here"


@pytest.mark.parametrize("slots", [[2, -1, 7, 0, 4, 11], [3, 4, 5, 6, 7, 8]], ids=["scattered", "consecutive"])
def test_update_matches_reference_step_and_hf_without_clamp(slots):
    inp = Inputs([6])
    before = inp.pool.clone()
    x, dt, A, B, C, D, dt_bias = inp.params()
    y = mamba2_state_update(x, dt, A, B, C, D, dt_bias, inp.pool, torch.tensor(slots))
    for i, slot in enumerate(slots):
        if slot < 0:
            continue
        y_ref, state = mamba2_ssd_ref(*inp.params(i, i + 1), before[slot])
        torch.testing.assert_close(y[i : i + 1], y_ref, **TOL)
        torch.testing.assert_close(inp.pool[slot], state, **TOL)
        hf_state = before[slot : slot + 1].clone()
        y_hf = hf.mamba2_selective_state_update(  # the NemotronH mixer's call: per-(head, P) expanded params
            hf_state, x[i : i + 1], dt[i : i + 1, :, None].expand(-1, -1, P), A[:, None, None].expand(-1, P, N),
            B[i : i + 1], C[i : i + 1], D[:, None].expand(-1, P), dt_bias=dt_bias[:, None].expand(-1, P),
            dt_softplus=True)
        torch.testing.assert_close(y[i], y_hf[0], **TOL)
        torch.testing.assert_close(inp.pool[slot], hf_state[0], **TOL)
    untouched = [s for s in range(inp.pool.shape[0]) if s not in slots]
    assert torch.equal(inp.pool[untouched], before[untouched])


def test_update_dt_limit_clamps():
    inp = Inputs([4])
    x, dt, A, B, C, D, dt_bias = inp.params()
    pool = inp.pool.clone()
    y = mamba2_state_update(x, dt, A, B, C, D, dt_bias, pool, torch.arange(4), dt_limit=(0.5, 2.0))
    for i in range(4):
        y_ref, state = mamba2_ssd_ref(*inp.params(i, i + 1), inp.pool[i], dt_limit=(0.5, 2.0))
        torch.testing.assert_close(y[i : i + 1], y_ref, **TOL)
        torch.testing.assert_close(pool[i], state, **TOL)


def test_decode_steps_continue_a_prefill():
    inp = Inputs([40])
    prefill = inp.pool.clone()
    y_all = mamba2_chunk_scan_varlen(*inp.params(), inp.cu, prefill, torch.tensor([6]), chunk_size=Q)
    mamba2_chunk_scan_varlen(*inp.params(0, 30), torch.tensor([0, 30]), inp.pool, torch.tensor([6]), chunk_size=Q)
    ys = [mamba2_state_update(*inp.params(t, t + 1), inp.pool, torch.tensor([6])) for t in range(30, 40)]
    torch.testing.assert_close(torch.cat(ys), y_all[30:], **TOL)
    torch.testing.assert_close(inp.pool[6], prefill[6], **TOL)


def test_without_D_and_dt_bias():
    inp = Inputs([70, 9], seed=2)
    before = inp.pool.clone()
    x, dt, A, B, C, _, _ = inp.params()
    y = mamba2_chunk_scan_varlen(x, dt, A, B, C, None, None, inp.cu, inp.pool, torch.tensor([1, 2]), chunk_size=Q)
    y_ref, state = mamba2_ssd_ref(x[:70], dt[:70], A, B[:70], C[:70], None, None, before[1])
    torch.testing.assert_close(y[:70], y_ref, **TOL)
    torch.testing.assert_close(inp.pool[1], state, **TOL)


def test_bf16_inputs_keep_fp32_state():
    inp = Inputs([20, 70], dtype=torch.bfloat16)
    before = inp.pool.clone()
    y = inp.run([1, 2])
    assert y.dtype == torch.bfloat16 and inp.pool.dtype == torch.float32
    y_ref, state = inp.ref(before, 1, 0)
    torch.testing.assert_close(y[:20].float(), y_ref.float(), atol=3e-2, rtol=2e-2)
    torch.testing.assert_close(inp.pool[1], state, **TOL)  # the math is fp32 whatever the input dtype
    y1 = mamba2_state_update(*inp.params(0, 2), inp.pool, torch.tensor([1, 2]))
    assert y1.dtype == torch.bfloat16


@settings(max_examples=12, deadline=None, derandomize=True)
@given(lengths=st.lists(st.integers(0, 140), min_size=1, max_size=4), data=st.data())
def test_random_batches_and_checkpoints_match_reference(lengths, data):
    inp = Inputs(lengths, num_slots=16, seed=len(lengths) + sum(lengths))
    before = inp.pool.clone()
    slots = list(range(len(lengths)))
    ckpts = [(i, data.draw(st.integers(1, n))) for i, n in enumerate(lengths) if n and data.draw(st.booleans())]
    ckpt_slot = list(range(8, 8 + len(ckpts)))
    kw = {}
    if ckpts:
        kw = dict(ckpt_seq=torch.tensor([i for i, _ in ckpts]), ckpt_len=torch.tensor([n for _, n in ckpts]),
                  ckpt_slot=torch.tensor(ckpt_slot))
    y = inp.run(slots, **kw)
    for i in range(len(lengths)):
        y_ref, state = inp.ref(before, slots[i], i)
        torch.testing.assert_close(y[inp.cu[i] : inp.cu[i + 1]], y_ref, **TOL)
        torch.testing.assert_close(inp.pool[slots[i]], state, **TOL)
    for (i, n), row in zip(ckpts, ckpt_slot):
        torch.testing.assert_close(inp.pool[row], inp.ref(before, slots[i], i, n)[1], **TOL)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda a: a.update(dt=a["dt"][:, :2]), "dt must be"),
        (lambda a: a.update(A=torch.ones(H + 1)), "A must be"),
        (lambda a: a.update(C=a["C"][:, :1]), "B and C"),
        (lambda a: a.update(B=torch.randn(8, 3, N), C=torch.randn(8, 3, N)), "multiple of groups"),
        (lambda a: a.update(ssm_states=torch.zeros(12, H, N, P + 1)), "ssm_states"),
        (lambda a: a.update(dt_limit=(1.0, 0.5)), "dt_limit"),
        (lambda a: a.update(cu_seqlens=torch.tensor([0, 4, 2, 8])), "non-decreasing"),
        (lambda a: a.update(slots=torch.tensor([-2, 1])), "outside"),
        (lambda a: a.update(ckpt_seq=torch.tensor([0]), ckpt_len=torch.tensor([1]), ckpt_slot=torch.tensor([12])),
         "outside"),
    ],
)
def test_bad_input_raises_value_error(change, message):
    inp = Inputs([5, 3])
    x, dt, A, B, C, D, dt_bias = inp.params()
    args = dict(x=x, dt=dt, A=A, B=B, C=C, D=D, dt_bias=dt_bias, cu_seqlens=inp.cu, ssm_states=inp.pool,
                slots=torch.tensor([1, 2]))
    change(args)
    before = args["ssm_states"].clone()
    with pytest.raises(ValueError, match=message):
        mamba2_chunk_scan_varlen(**args)
    assert torch.equal(args["ssm_states"], before), "a rejected call must not touch the pool"
