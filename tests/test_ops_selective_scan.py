"""Mamba1's selective scan (Jamba): the packed varlen scan with its checkpoints and the decode update,
against the token-by-token reference written as the formula and against Hugging Face's
``mamba_selective_scan`` / ``mamba_selective_state_update`` (fp32)."""

from __future__ import annotations

import pytest
import torch
import transformers.models.jamba.modeling_jamba as hf

from hyla.model.ops.selective_scan import selective_scan_ref, selective_scan_varlen, selective_state_update

I, N = 24, 8
TOL = dict(atol=1e-5, rtol=1e-5)


class Inputs:
    """Random packed inputs in Jamba's parameter ranges (A = -exp(A_log), A_log = log(1..N) per
    channel; dt_bias, D ~ 1) and a pool whose every row holds a random state."""

    def __init__(self, lengths: list[int], num_slots: int = 12, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        t = sum(lengths)
        self.x = torch.randn(t, I, generator=gen)
        self.dt = torch.randn(t, I, generator=gen)
        self.A = -(torch.arange(1, N + 1).float().log()[None, :] + 0.1 * torch.randn(I, N, generator=gen)).exp()
        self.B = torch.randn(t, N, generator=gen)
        self.C = torch.randn(t, N, generator=gen)
        self.D = 1 + 0.1 * torch.randn(I, generator=gen)
        self.dt_bias = 1 + 0.1 * torch.randn(I, generator=gen)
        self.pool = torch.randn(num_slots, I, N, generator=gen) * 0.5
        self.cu = torch.tensor([0] + lengths).cumsum(0)

    def params(self, a: int = 0, e: int | None = None) -> tuple:
        s = slice(a, e)
        return self.x[s], self.dt[s], self.A, self.B[s], self.C[s], self.D, self.dt_bias

    def ref(self, pool, slot, i, n=None):
        a = int(self.cu[i])
        e = int(self.cu[i + 1]) if n is None else a + n
        return selective_scan_ref(*self.params(a, e), pool[slot] if slot >= 0 else None)


def test_reference_is_hugging_faces_scan_and_update():
    inp = Inputs([40])
    y, state = selective_scan_ref(*inp.params(), None)
    x, dt, A, B, C, D, dt_bias = inp.params()
    y_hf, state_hf = hf.mamba_selective_scan(x.T[None], dt.T[None], A, B.T[None], C.T[None], D=D, delta_bias=dt_bias,
                                             delta_softplus=True, return_last_state=True, use_associative_scan=False)
    torch.testing.assert_close(y, y_hf[0].T, **TOL)
    torch.testing.assert_close(state, state_hf[0], **TOL)
    h = state_hf.clone()
    out = hf.mamba_selective_state_update(h, x[:1], dt[:1], A, B[:1], C[:1], D, dt_bias=dt_bias, dt_softplus=True)
    y1, h1 = selective_scan_ref(x[:1], dt[:1], A, B[:1], C[:1], D, dt_bias, state_hf[0])
    torch.testing.assert_close(out, y1, **TOL)
    torch.testing.assert_close(h[0], h1, **TOL)


@pytest.mark.parametrize("short", [False, True])
def test_varlen_scan_with_checkpoints_matches_the_reference_per_sequence(short):
    # the chunked path (chunks of 16): padded last chunks, a sequence of one token; checkpoints inside
    # chunks and at a chunk's end. ``short``: every sequence within SHORT_EXTEND, the token-by-token path
    lengths, ckpt_len = ([1, 8, 5, 3, 7], [7, 8, 1, 2, 6]) if short else ([1, 20, 9, 3, 33], [7, 20, 1, 2, 32])
    ckpt_seq, ckpt_slot = [1, 1, 4, 3, 4], [10, 11, 6, 7, 8]
    inp = Inputs(lengths)
    before = inp.pool.clone()
    slots = [4, 0, -1, 2, 9]
    y = selective_scan_varlen(*inp.params(), inp.cu, inp.pool, torch.tensor(slots), torch.tensor(ckpt_seq),
                              torch.tensor(ckpt_len), torch.tensor(ckpt_slot))
    for i, slot in enumerate(slots):
        y_ref, state = inp.ref(before, slot, i)
        if slot >= 0:  # padding rows are don't-care and write nothing
            torch.testing.assert_close(y[inp.cu[i]:inp.cu[i + 1]], y_ref, **TOL)
            torch.testing.assert_close(inp.pool[slot], state, **TOL)
    for seq, n, row in zip(ckpt_seq, ckpt_len, ckpt_slot):
        torch.testing.assert_close(inp.pool[row], inp.ref(before, slots[seq], seq, n)[1], **TOL)
    untouched = [s for s in range(inp.pool.shape[0]) if s not in slots + ckpt_slot]
    assert torch.equal(inp.pool[untouched], before[untouched])


@pytest.mark.parametrize("length", [6, 40])
def test_decode_steps_equal_the_scan(length):
    """A decode step per token gives the scan's outputs and states, up to fp32 rounding: on a short extend
    (the token-by-token path: the decode step's arithmetic, but each token's softplus and exp computed once
    for all the extend's tokens, where a vector's tail may round by an ulp otherwise than a decode batch's
    body) and on a long one (the chunked path, 3 chunks of 16)."""
    inp = Inputs([length, length], seed=1)
    pool = inp.pool.clone()
    y_scan = selective_scan_varlen(*inp.params(), inp.cu, pool, torch.tensor([3, 5]))
    steps = inp.pool.clone()
    x, dt, A, B, C, D, dt_bias = inp.params()
    ys = []
    for t in range(length):
        rows = [t, length + t]
        ys.append(selective_state_update(x[rows], dt[rows], A, B[rows], C[rows], D, dt_bias, steps,
                                         torch.tensor([3, 5])))
    y_steps = torch.stack(ys, 1).flatten(0, 1)  # [2 * length, I] in packed order
    torch.testing.assert_close(y_steps, y_scan, **TOL)
    torch.testing.assert_close(steps, pool, **TOL)


def test_bad_shapes_are_value_errors():
    inp = Inputs([4])
    x, dt, A, B, C, D, dt_bias = inp.params()
    with pytest.raises(ValueError, match="A must be"):
        selective_state_update(x, dt, A[:5], B, C, D, dt_bias, inp.pool, torch.tensor([0, 1, 2, 3]))
    with pytest.raises(ValueError, match="ssm_states must be"):
        selective_state_update(x, dt, A, B, C, D, dt_bias, inp.pool[:, :5], torch.tensor([0, 1, 2, 3]))
    with pytest.raises(ValueError, match="B and C"):
        selective_scan_varlen(x, dt, A, B[:, :2], C, D, dt_bias, inp.cu, inp.pool, torch.tensor([0]))
