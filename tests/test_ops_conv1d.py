"""Causal conv1d ops: packed varlen + checkpoints + decode update, against the token-by-token
reference and against Hugging Face's ``causal_conv1d_fn/update`` (fp32)."""

from __future__ import annotations

import pytest
import torch
import transformers.models.qwen3_next.modeling_qwen3_next as hf

from hyla.model.ops import causal_conv1d_ref, causal_conv1d_update, causal_conv1d_varlen

C, K = 24, 4
ATOL = 1e-6


def make(lengths: list[int], num_slots: int = 12, seed: int = 0, dtype=torch.float32, bias: bool = True):
    """Random packed inputs, weights and a pool whose every row holds a random window."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(lengths), C, generator=gen).to(dtype)
    weight = torch.randn(C, K, generator=gen).to(dtype)
    b = torch.randn(C, generator=gen).to(dtype) if bias else None
    pool = torch.randn(num_slots, C, K - 1, generator=gen).to(dtype)
    cu = torch.tensor([0] + lengths).cumsum(0)
    return x, weight, b, cu, pool


def run_ref(x, weight, bias, cu, pool, slots, i, n=None):
    """Reference for sequence ``i`` alone (first ``n`` tokens), from the pool as it was."""
    a, e = int(cu[i]), int(cu[i + 1])
    e = e if n is None else a + n
    window = pool[slots[i]] if slots[i] >= 0 else torch.zeros(C, K - 1, dtype=pool.dtype)
    return causal_conv1d_ref(x[a:e], weight, bias, window)


LENGTHS = [1, 63, 64, 65, 130, 3, 2]
SLOTS = [4, 0, 7, -1, 2, 9, 5]


def test_varlen_matches_reference_and_writes_final_windows():
    x, weight, bias, cu, pool = make(LENGTHS)
    before = pool.clone()
    y = causal_conv1d_varlen(x, weight, bias, cu, pool, torch.tensor(SLOTS))
    for i, slot in enumerate(SLOTS):
        y_ref, window = run_ref(x, weight, bias, cu, before, SLOTS, i)
        if slot >= 0:  # padding rows are don't-care
            torch.testing.assert_close(y[cu[i] : cu[i + 1]], y_ref, atol=ATOL, rtol=0)
            torch.testing.assert_close(pool[slot], window, atol=0, rtol=0)
    untouched = [s for s in range(pool.shape[0]) if s not in SLOTS]
    assert torch.equal(pool[untouched], before[untouched])


def test_short_sequences_read_the_whole_window():
    """A 1- or 2-token extend shifts the old window rather than replacing it."""
    x, weight, bias, cu, pool = make([1, 2])
    before = pool.clone()
    causal_conv1d_varlen(x, weight, bias, cu, pool, torch.tensor([3, 5]))
    torch.testing.assert_close(pool[3], torch.cat([before[3][:, 1:], x[0:1].t()], dim=1), atol=0, rtol=0)
    torch.testing.assert_close(pool[5], torch.cat([before[5][:, 2:], x[1:3].t()], dim=1), atol=0, rtol=0)


def test_checkpoints_equal_runs_that_stop_there():
    x, weight, bias, cu, pool = make(LENGTHS, num_slots=24)
    before = pool.clone()
    ckpt_seq = torch.tensor([1, 2, 3, 4, 4, 4, 4, 0, 6])
    ckpt_len = torch.tensor([63, 64, 65, 1, 63, 64, 130, 1, 1])
    slots = [4, 0, 7, 11, 2, 9, 5]
    ckpt_slot = torch.tensor([12, 13, 14, 15, 16, 17, 18, 19, 20])
    causal_conv1d_varlen(x, weight, bias, cu, pool, torch.tensor(slots), "silu", ckpt_seq, ckpt_len, ckpt_slot)
    for i, n, row in zip(ckpt_seq.tolist(), ckpt_len.tolist(), ckpt_slot.tolist()):
        _, window = run_ref(x, weight, bias, cu, before, slots, i, n)
        torch.testing.assert_close(pool[row], window, atol=0, rtol=0)
    untouched = [s for s in range(pool.shape[0]) if s not in slots + ckpt_slot.tolist()]
    assert torch.equal(pool[untouched], before[untouched])


def test_split_run_with_carried_window_equals_one_run():
    x, weight, bias, _, pool = make([130])
    whole_pool = pool.clone()
    y_whole = causal_conv1d_varlen(x, weight, bias, torch.tensor([0, 130]), whole_pool, torch.tensor([1]))
    ys = []
    for a, e in [(0, 1), (1, 64), (64, 66), (66, 130)]:
        ys.append(causal_conv1d_varlen(x[a:e], weight, bias, torch.tensor([0, e - a]), pool, torch.tensor([1])))
    torch.testing.assert_close(torch.cat(ys), y_whole, atol=ATOL, rtol=0)
    torch.testing.assert_close(pool[1], whole_pool[1], atol=0, rtol=0)


def test_packed_batch_equals_each_sequence_alone():
    x, weight, bias, cu, pool = make(LENGTHS)
    slots = [4, 0, 7, 1, 2, 9, 5]
    alone = pool.clone()
    y = causal_conv1d_varlen(x, weight, bias, cu, pool, torch.tensor(slots))
    for i, slot in enumerate(slots):
        a, e = int(cu[i]), int(cu[i + 1])
        y_i = causal_conv1d_varlen(x[a:e], weight, bias, torch.tensor([0, e - a]), alone, torch.tensor([slot]))
        torch.testing.assert_close(y[a:e], y_i, atol=ATOL, rtol=0)
        torch.testing.assert_close(pool[slot], alone[slot], atol=0, rtol=0)


def test_zero_length_sequence_keeps_its_window():
    x, weight, bias, _, pool = make([5, 0, 3])
    before = pool.clone()
    cu = torch.tensor([0, 5, 5, 8])
    causal_conv1d_varlen(x, weight, bias, cu, pool, torch.tensor([1, 2, 3]))
    assert torch.equal(pool[2], before[2])
    assert not torch.equal(pool[1], before[1])


def test_batch_of_empty_sequences_is_a_no_op():
    _, weight, bias, _, pool = make([1])
    before = pool.clone()
    y = causal_conv1d_varlen(torch.zeros(0, C), weight, bias, torch.tensor([0, 0, 0]), pool, torch.tensor([1, 2]))
    assert y.shape == (0, C) and torch.equal(pool, before)


def test_matches_hf_causal_conv1d_fn_with_cached_window():
    """HF's chunked-prefill path: conv over ``cat(conv_state, x)`` keeping the last T outputs."""
    x, weight, bias, _, pool = make([70])
    hf_state = torch.cat([torch.randn(1, C, 1), pool[3:4]], dim=2)  # HF keeps K inputs, the oldest unused
    hf_in = torch.cat([hf_state, x.t().unsqueeze(0)], dim=2)  # [1, C, K + T]
    y_hf = hf.causal_conv1d_fn(hf_in, weight, bias, activation="silu")[0, :, -70:].t()
    y = causal_conv1d_varlen(x, weight, bias, torch.tensor([0, 70]), pool, torch.tensor([3]))
    torch.testing.assert_close(y, y_hf, atol=ATOL, rtol=1e-6)
    torch.testing.assert_close(pool[3], hf_in[0, :, -(K - 1) :], atol=0, rtol=0)


def test_update_matches_reference_step_and_hf():
    x, weight, bias, _, pool = make([5])
    before = pool.clone()
    slots = [2, -1, 7, 0, 4]
    y = causal_conv1d_update(x, weight, bias, pool, torch.tensor(slots))
    for i, slot in enumerate(slots):
        if slot < 0:
            continue
        y_ref, window = causal_conv1d_ref(x[i : i + 1], weight, bias, before[slot])
        torch.testing.assert_close(y[i : i + 1], y_ref, atol=ATOL, rtol=0)
        torch.testing.assert_close(pool[slot], window, atol=0, rtol=0)
        hf_state = torch.cat([torch.zeros(1, C, 1), before[slot : slot + 1]], dim=2)  # [1, C, K]
        y_hf = hf.causal_conv1d_update(x[i].view(1, C, 1), hf_state, weight, bias, "silu")
        torch.testing.assert_close(y[i], y_hf.view(C), atol=ATOL, rtol=1e-6)
        torch.testing.assert_close(pool[slot], hf_state[0, :, 1:], atol=0, rtol=0)
    untouched = [s for s in range(pool.shape[0]) if s not in slots]
    assert torch.equal(pool[untouched], before[untouched])


def test_update_repeated_equals_varlen_prefill():
    x, weight, bias, _, pool = make([9])
    prefill_pool = pool.clone()
    y_prefill = causal_conv1d_varlen(x, weight, bias, torch.tensor([0, 9]), prefill_pool, torch.tensor([6]))
    ys = [causal_conv1d_update(x[t : t + 1], weight, bias, pool, torch.tensor([6])) for t in range(9)]
    torch.testing.assert_close(torch.cat(ys), y_prefill, atol=ATOL, rtol=0)
    torch.testing.assert_close(pool[6], prefill_pool[6], atol=0, rtol=0)


def test_no_bias_and_no_activation():
    x, weight, _, cu, pool = make([10, 4], bias=False)
    before = pool.clone()
    y = causal_conv1d_varlen(x, weight, None, cu, pool, torch.tensor([0, 1]), activation=None)
    y_ref, _ = causal_conv1d_ref(x[:10], weight, None, before[0], activation=None)
    torch.testing.assert_close(y[:10], y_ref, atol=ATOL, rtol=0)


def test_bf16_keeps_dtypes():
    x, weight, bias, cu, pool = make([7, 3], dtype=torch.bfloat16)
    before = pool.clone()
    y = causal_conv1d_varlen(x, weight, bias, cu, pool, torch.tensor([1, 2]))
    assert y.dtype == torch.bfloat16 and pool.dtype == torch.bfloat16
    y_ref, window = causal_conv1d_ref(x[:7], weight, bias, before[1])
    torch.testing.assert_close(y[:7].float(), y_ref.float(), atol=2e-2, rtol=2e-2)
    assert torch.equal(pool[1], window.to(torch.bfloat16))
    y1 = causal_conv1d_update(x[:2], weight, bias, pool, torch.tensor([1, 2]))
    assert y1.dtype == torch.bfloat16


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(cu_seqlens=torch.tensor([0, 3, 9])), "end at the number of tokens"),
        (dict(cu_seqlens=torch.tensor([0, 6, 5, 8])), "non-decreasing"),
        (dict(cu_seqlens=torch.tensor([0.0, 5.0, 8.0])), "integer"),
        (dict(slots=torch.tensor([1.0, 2.0])), "integer"),
        (dict(slots=torch.tensor([1, 1])), "repeats a pool row"),
        (dict(slots=torch.tensor([1, 12])), "outside"),
        (dict(slots=torch.tensor([1])), "shape"),
        (dict(weight=torch.randn(C + 1, K)), "weight"),
        (dict(activation="gelu"), "activation"),
        (dict(ckpt_seq=torch.tensor([0]), ckpt_len=torch.tensor([6]), ckpt_slot=torch.tensor([9])), "outside \\[1"),
        (dict(ckpt_seq=torch.tensor([0]), ckpt_len=torch.tensor([0]), ckpt_slot=torch.tensor([9])), "outside \\[1"),
        (dict(ckpt_seq=torch.tensor([2]), ckpt_len=torch.tensor([1]), ckpt_slot=torch.tensor([9])), "not a sequence"),
        (dict(ckpt_seq=torch.tensor([0]), ckpt_len=torch.tensor([1]), ckpt_slot=torch.tensor([2])), "also a sequence"),
        (dict(ckpt_seq=torch.tensor([0]), ckpt_len=torch.tensor([1])), "together"),
        (dict(slots=torch.tensor([-1, 2]), ckpt_seq=torch.tensor([0]), ckpt_len=torch.tensor([1]),
              ckpt_slot=torch.tensor([9])), "padding"),
    ],
)
def test_bad_input_raises_value_error(kwargs, message):
    x, weight, bias, cu, pool = make([5, 3])
    args = dict(x=x, weight=weight, bias=bias, cu_seqlens=cu, conv_states=pool, slots=torch.tensor([1, 2]))
    args.update(kwargs)
    before = pool.clone()
    with pytest.raises(ValueError, match=message):
        causal_conv1d_varlen(**args)
    assert torch.equal(pool, before), "a rejected call must not touch the pool"


def test_update_rejects_bad_input():
    x, weight, bias, _, pool = make([3])
    with pytest.raises(ValueError, match="conv_states"):
        causal_conv1d_update(x, weight, bias, pool[:, :, :2], torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match="shape"):
        causal_conv1d_update(x, weight, bias, pool, torch.tensor([0, 1]))
