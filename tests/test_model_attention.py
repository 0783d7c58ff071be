"""paged_attention against its naive per-token reference: prefix + causal extend, decode, GQA,
scattered slots, and that new K/V land in their pool slots."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hyla.model.ops.attention import paged_attention, paged_attention_reference

HQ, HKV, D = 4, 2, 16


def make_case(prefix_lens, extend_lens, seed=0, num_slots=400):
    """Random pools where each sequence's cached prefix already sits at scattered slots."""
    g = torch.Generator().manual_seed(seed)
    k_buf = torch.randn(num_slots, HKV, D, generator=g)
    v_buf = torch.randn(num_slots, HKV, D, generator=g)
    free = (torch.randperm(num_slots - 1, generator=g) + 1).tolist()  # never slot 0
    kv_indices, indptr, out_loc = [], [0], []
    for p, e in zip(prefix_lens, extend_lens):
        slots = [free.pop() for _ in range(p + e)]
        kv_indices += slots
        out_loc += slots[p:]
        indptr.append(len(kv_indices))
    t = sum(extend_lens)
    q, k, v = (torch.randn(t, h, D, generator=g) for h in (HQ, HKV, HKV))
    args = (torch.tensor(out_loc), torch.tensor(kv_indices, dtype=torch.long), torch.tensor(indptr),
            list(prefix_lens), list(extend_lens), D**-0.5)
    return q, k, v, k_buf, v_buf, args


def run_both(prefix_lens, extend_lens, seed=0):
    q, k, v, k_buf, v_buf, args = make_case(prefix_lens, extend_lens, seed)
    kr, vr = k_buf.clone(), v_buf.clone()
    got = paged_attention(q, k, v, k_buf, v_buf, *args)
    want = paged_attention_reference(q, k, v, kr, vr, *args)
    return got, want, (k_buf, v_buf, kr, vr, k, v, args[0])


@pytest.mark.parametrize(
    "prefix_lens, extend_lens",
    [([0], [7]), ([5, 0, 12], [3, 9, 1]), ([0, 30], [40, 2]), ([3, 8, 0, 21], [1, 1, 1, 1])],
)
def test_matches_reference(prefix_lens, extend_lens):
    got, want, (k_buf, v_buf, kr, vr, k, v, out_loc) = run_both(prefix_lens, extend_lens)
    assert torch.allclose(got, want, atol=1e-5)
    assert torch.equal(k_buf[out_loc], k) and torch.equal(v_buf[out_loc], v)
    assert torch.equal(k_buf, kr) and torch.equal(v_buf, vr)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 20), st.integers(1, 12)), min_size=1, max_size=4), st.integers(0, 99))
def test_matches_reference_property(seqs, seed):
    prefix_lens, extend_lens = zip(*seqs)
    got, want, _ = run_both(prefix_lens, extend_lens, seed)
    assert torch.allclose(got, want, atol=1e-5)


def test_first_token_attends_only_to_prefix_and_itself():
    """A new token must not see later new tokens of its own sequence (causality inside the extend)."""
    q, k, v, k_buf, v_buf, args = make_case([4], [6])
    base = paged_attention(q, k, v, k_buf.clone(), v_buf.clone(), *args)
    v2 = v.clone()
    v2[3:] += 100.0
    changed = paged_attention(q, k, v2, k_buf.clone(), v_buf.clone(), *args)
    assert torch.equal(base[:3], changed[:3]) and not torch.allclose(base[3:], changed[3:])


def test_decode_path_equals_extend_path():
    """All-ones extend lens take the batched decode path; it equals one-sequence-at-a-time."""
    q, k, v, k_buf, v_buf, args = make_case([3, 17, 0], [1, 1, 1])
    batched = paged_attention(q, k, v, k_buf.clone(), v_buf.clone(), *args)
    out_loc, kv_indices, indptr, prefix, extend, scale = args
    for i in range(3):
        sl = slice(int(indptr[i]), int(indptr[i + 1]))
        one = paged_attention(q[i : i + 1], k[i : i + 1], v[i : i + 1], k_buf.clone(), v_buf.clone(),
                              out_loc[i : i + 1], kv_indices[sl], torch.tensor([0, sl.stop - sl.start]),
                              [prefix[i]], [1], scale)
        assert torch.allclose(batched[i], one[0], atol=1e-6)


def test_bad_input_raises_value_error():
    q, k, v, k_buf, v_buf, (out_loc, kv_indices, indptr, prefix, extend, scale) = make_case([2], [3])
    with pytest.raises(ValueError, match="extend_lens"):
        paged_attention(q, k, v, k_buf, v_buf, out_loc, kv_indices, indptr, prefix, [2], scale)
    with pytest.raises(ValueError, match="kv_indptr"):
        paged_attention(q, k, v, k_buf, v_buf, out_loc, kv_indices, torch.tensor([0, 4]), prefix, extend, scale)
    with pytest.raises(ValueError, match="multiple"):
        paged_attention(q[:, :3], k, v, k_buf, v_buf, out_loc, kv_indices, indptr, prefix, extend, scale)


@pytest.mark.parametrize("prefix, tree", [(0, False), (37, False), (37, True)],
                         ids=["no prefix", "prefix", "prefix + token tree"])
def test_extend_attention_runs_a_fused_sdpa_kernel(prefix, tree):
    """A prefill's attention is one of SDPA's fused kernels, not its math path (which 3-D inputs
    take on CPU and CUDA alike: 10-18x slower for a 4,096-token CPU prefill). With only the flash
    backend allowed, the math path would raise; the result must still be the reference's."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from hyla.model.ops.attention import extend_mask, extend_sdpa

    extend, g = 9, torch.Generator().manual_seed(3)
    q = torch.randn(HQ, extend, D, generator=g)
    k, v = (torch.randn(HKV, prefix + extend, D, generator=g) for _ in range(2))
    masks = torch.ones(extend, extend, dtype=torch.bool).tril()
    masks[5:, 2:5] = False  # tokens 5.. branch off after token 1
    mask = masks if tree else None
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        got = extend_sdpa(q, k, v, prefix, mask, D**-0.5)
    visible = extend_mask(prefix, extend, mask, "cpu")  # [E, L]
    scores = (q @ k.repeat_interleave(HQ // HKV, 0).transpose(1, 2)) * D**-0.5
    want = scores.masked_fill(~visible, float("-inf")).softmax(-1) @ v.repeat_interleave(HQ // HKV, 0)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
