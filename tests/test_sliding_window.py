"""Sliding-window attention (Lara-4-Mini's and LFM3's ``sliding_attention`` layers): every path of the
PyTorch ops against the naive per-token reference (each token over its last ``window`` keys), the
per-step layouts ``ForwardBatch`` builds once for such layers, the config's checks, and the FLOP
model. The Triton kernels' windows: ``test_window_attention_kernels.py``; the models: the parity,
differential, speculative and generate tests (``lara_mini``)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_model_attention import D, HKV, HQ, make_case

from hyla.model.config import ModelConfig
from hyla.model.ops.attention import (
    ShortExtendLayout,
    decode_attention,
    decode_kv_rows,
    decode_kv_table,
    extend_mask,
    paged_attention,
    paged_attention_reference,
    paged_attention_short_extend,
    window_kv_table,
    window_mask,
)
from hyla.model.ops.tree import TokenTree


def _both(prefix_lens, extend_lens, window, seed=0):
    q, k, v, k_buf, v_buf, args = make_case(prefix_lens, extend_lens, seed)
    kr, vr = k_buf.clone(), v_buf.clone()
    got = paged_attention(q, k, v, k_buf, v_buf, *args, window=window)
    want = paged_attention_reference(q, k, v, kr, vr, *args, window=window)
    return got, want


@pytest.mark.parametrize("prefix_lens, extend_lens", [([0], [9]), ([5, 0, 12], [3, 9, 1]), ([3, 8, 0, 21], [1] * 4)])
@pytest.mark.parametrize("window", [1, 2, 5, 64])
def test_paged_attention_window_matches_reference(prefix_lens, extend_lens, window):
    """Extends (with and without a prefix) and decode batches (every extend 1: the padded decode path)."""
    got, want = _both(prefix_lens, extend_lens, window)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@settings(max_examples=20, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 20), st.integers(1, 12)), min_size=1, max_size=3), st.integers(1, 10),
       st.integers(0, 99))
def test_paged_attention_window_property(seqs, window, seed):
    prefix_lens, extend_lens = zip(*seqs)
    got, want = _both(prefix_lens, extend_lens, window, seed)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_window_changes_the_result_and_covers_the_whole_sequence_as_full_attention():
    got, full = _both([10], [6], 4)[0], _both([10], [6], 0)[0]
    assert (got - full).abs().max() > 1e-2  # the mask binds
    torch.testing.assert_close(_both([10], [6], 16)[0], full, atol=0, rtol=0)  # a window over all 16 keys: none


@pytest.mark.parametrize("window", [1, 4, 12, 30])
def test_decode_reads_the_window_alone(window):
    """A decode step over sequences of different lengths: ``window_kv_table`` keeps of each row the last ``window``
    slots (fewer where a sequence is shorter, masked), what the decode paths (``ForwardBatch``, the padded decode)
    read; the decode over them, and over the whole table under ``window_mask``, == the per-token reference."""
    prefix = [0, 3, 9, 20]
    q, k, v, k_buf, v_buf, (out_loc, kv_indices, indptr, *_), = make_case(prefix, [1] * 4)
    k_buf[out_loc], v_buf[out_loc] = k, v
    seq_lens = torch.tensor([p + 1 for p in prefix])
    full, _ = decode_kv_table(kv_indices, indptr, seq_lens.tolist())
    table, mask = window_kv_table(full, seq_lens, window)
    assert table.shape == (4, min(window, 21)) and mask.shape == table.shape
    for b, n in enumerate(seq_lens.tolist()):  # each row: its last min(window, n) slots, left-aligned
        kept = min(window, n)
        assert torch.equal(table[b, :kept], full[b, n - kept : n]) and bool((mask[b, kept:] == float("-inf")).all())
    want = paged_attention_reference(q, k, v, k_buf.clone(), v_buf.clone(), out_loc, kv_indices, indptr, prefix,
                                     [1] * 4, D**-0.5, window=window)
    got = decode_attention(q, k_buf, v_buf, table, mask, D**-0.5, decode_kv_rows(table, HKV))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # the whole table under window_mask (the masks' reference) gives the same
    whole = decode_attention(q, k_buf, v_buf, full, window_mask(seq_lens, full.shape[1], window), D**-0.5,
                             decode_kv_rows(full, HKV))
    torch.testing.assert_close(whole, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("prefix, window", [(40, 8), (40, 41), (7, 8), (64, 1)])
def test_extend_reads_the_window_alone(prefix, window, monkeypatch):
    """An extend over a long prefix: a sliding layer gathers the keys from ``prefix - window + 1`` on (no new token
    sees the earlier ones), == the reference over the whole sequence."""
    from hyla.model.ops import attention

    seen = []
    run = attention.extend_sdpa
    monkeypatch.setattr(attention, "extend_sdpa", lambda q, k, *a, **kw: seen.append(k.shape[1]) or run(q, k, *a, **kw))
    got, want = _both([prefix], [5], window)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert seen == [min(prefix, window - 1) + 5]


def _tree_reference(q, k_buf, v_buf, slots, prefix, parents, window):
    """One sequence's tree tokens, each over its prefix keys and ancestors-or-self within ``window``
    positions (a tree token's position: prefix + depth)."""
    depth = [0 if p < 0 else None for p in parents]
    for j, p in enumerate(parents):
        depth[j] = 0 if p < 0 else depth[p] + 1
    out = torch.zeros_like(q)
    group = HQ // HKV
    for j in range(len(parents)):
        pos = prefix + depth[j]
        keys = [s for s in range(prefix) if pos - s < window]
        a = j
        while a >= 0:
            if pos - (prefix + depth[a]) < window:
                keys.append(prefix + a)
            a = parents[a]
        rows = slots[keys]
        for h in range(HQ):
            w = torch.softmax(k_buf[rows, h // group] @ q[j, h] * D**-0.5, dim=0)
            out[j, h] = w @ v_buf[rows, h // group]
    return out


@pytest.mark.parametrize("window", [1, 2, 3, 6, 40])
@pytest.mark.parametrize("prefix_lens", [[7, 2], [30, 2], [2, 41]])
def test_short_extend_window_over_chains_and_trees(window, prefix_lens):
    """A verify step's layout (``ShortExtendLayout.windowed``): chains padded to a fixed width, and a
    token tree whose tokens' positions are their depths; against the per-token reference. Its keys are
    narrowed to the window's columns (``window - 1 + E`` at most) where the context is longer."""
    parents = [[-1, 0, 0, 1, 3], [-1, 0, 1]]
    extend_lens = [len(p) for p in parents]
    q, k, v, k_buf, v_buf, (out_loc, kv_indices, indptr, *_), = make_case(prefix_lens, extend_lens)
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    table, _ = decode_kv_table(kv_indices, indptr, seq_lens)
    for tree, width in ((parents, None), (None, 6)):
        layout = ShortExtendLayout.build(table, prefix_lens, extend_lens, HKV, tree, width).windowed(window)
        e = width or max(extend_lens)
        assert layout.kv_rows.shape[-1] == min(table.shape[1], window - 1 + e) == layout.mask.shape[-1]
        got = paged_attention_short_extend(q, k, v, k_buf.clone(), v_buf.clone(), out_loc, layout, D**-0.5)
        kb, vb = k_buf.clone(), v_buf.clone()
        kb[out_loc], vb[out_loc] = k, v
        start = 0
        for i, (prefix, n) in enumerate(zip(prefix_lens, extend_lens)):
            chain = [j - 1 for j in range(n)]
            slots = kv_indices[indptr[i]:indptr[i + 1]]
            want = _tree_reference(q[start:start + n], kb, vb, slots, prefix, tree[i] if tree else chain, window)
            torch.testing.assert_close(got[start:start + n], want, atol=1e-5, rtol=1e-5)
            start += n


def test_extend_mask_window_over_a_tree_uses_depths():
    tree = TokenTree.build([[-1, 0, 1, 0]], [4], "cpu").masks[0]  # depths 0, 1, 2, 1
    mask = extend_mask(3, 4, tree, "cpu", window=2)  # positions: keys 0 1 2 | 3 4 5 4
    want = torch.tensor([[0, 0, 1, 1, 0, 0, 0],  # position 3: key 2 and itself
                         [0, 0, 0, 1, 1, 0, 0],  # position 4: its parent and itself
                         [0, 0, 0, 0, 1, 1, 0],
                         [0, 0, 0, 1, 0, 0, 1]], dtype=torch.bool)
    assert torch.equal(mask, want)


def test_bad_windows_are_refused():
    q, k, v, k_buf, v_buf, args = make_case([2], [3])
    for bad in (-1, 2.5, True):
        with pytest.raises(ValueError, match="window"):
            paged_attention(q, k, v, k_buf, v_buf, *args, window=bad)


def _config(**kw) -> ModelConfig:
    base = dict(architecture="LaraMiniForCausalLM", model_type="lara_mini", vocab_size=16, hidden_size=8,
                layer_types=("linear", "attention", "attention"), ffn_types=("mlp",) * 3, linear_kind="gdn",
                linear_num_key_heads=1, linear_num_value_heads=1, linear_key_head_dim=4, linear_value_head_dim=4,
                num_attention_heads=2, num_kv_heads=1, head_dim=4, intermediate_size=8)
    return ModelConfig(**{**base, **kw})


def test_config_checks_sliding_layers():
    assert _config(sliding_window=4, sliding_layers=(1,)).attention_window(1) == 4
    assert _config(sliding_window=4, sliding_layers=(1,)).attention_window(2) == 0
    for kw, message in [(dict(sliding_window=4, sliding_layers=(0,)), "plain attention"),
                        (dict(sliding_window=4, sliding_layers=(2, 1)), "ascending"),
                        (dict(sliding_window=4, sliding_layers=(3,)), "ascending"),
                        (dict(sliding_window=0, sliding_layers=(1,)), "exactly when"),
                        (dict(sliding_window=4), "exactly when"),
                        (dict(sliding_window=4, sliding_layers=(1,), sliding_rope=(6, 1e4)), "sliding_rope"),
                        (dict(sliding_window=4, sliding_layers=(1,), sliding_rope=(4, 0.0)), "sliding_rope"),
                        (dict(rotary_dim=4, rope_angles=3), "rope_angles")]:
        with pytest.raises(ValueError, match=message):
            _config(**kw)


def test_flops_cap_the_sliding_layers_context_and_prefill_sums_them():
    cfg = _config(sliding_window=5, sliding_layers=(1,))
    full = _config()
    assert cfg.flops_per_token(3).total == full.flops_per_token(3).total  # inside the window: the same
    assert cfg.flops_per_token(50).total == pytest.approx(
        full.flops_per_token(50).total - (full.flops_per_token(50).attention - full.flops_per_token(5).attention) / 2)
    for extend, prefix in ((1, 0), (4, 0), (9, 0), (3, 2), (6, 3), (7, 20)):
        want = sum(cfg.flops_per_token(prefix + j + 1).total for j in range(extend))
        assert cfg.prefill_flops(extend, prefix) == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("window", [1, 2, 5])
def test_simulator_cost_model_caps_the_sliding_layers_context(window):
    """``hyla.sim``'s closed form (``from_model_config``) is the FLOP model's, less the LM head."""
    from hyla.sim.models import from_model_config

    cfg = _config(sliding_window=window, sliding_layers=(1,))
    model = from_model_config(cfg, "tiny")
    head = cfg.flops_per_token(1).lm_head
    for extend, prefix in ((1, 0), (4, 0), (9, 0), (3, 2), (7, 20)):
        assert model.prefill_flops(extend, prefix) == pytest.approx(cfg.prefill_flops(extend, prefix) - extend * head,
                                                                    rel=1e-12)
