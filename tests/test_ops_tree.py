"""The verify step's fast paths (``ops/tree.py``, ``ops/attention.py``) against their reference paths:

* ``TreeScan`` (lanes: in place on the pool rows, or a gathered buffer with forks) runs the Gated
  DeltaNet and Mamba2 decode updates over token trees: every token's output, every checkpoint and
  every final state equal decode steps along the token's path (bitwise for Gated DeltaNet; Mamba2's
  batched per-token terms within fp32 rounding);
* the padded chains (the compiled verify step's ops) equal the tree path, bitwise, for every mixer;
* the conv op's tree path (every token at once from its ancestors' inputs) equals decode updates
  along each path, bitwise;
* ``paged_attention_short_extend`` (one padded attention with one mask for the batch) equals the
  per-sequence ``paged_attention`` (SDPA) within 1e-5, for chains and trees, padding rows and empty
  sequences;

each with padding slots (-1), empty sequences, scattered or contiguous slots and checkpoints."""

from __future__ import annotations

import shutil

import pytest
import torch

from hyla.model.ops import (
    causal_conv1d_update,
    causal_conv1d_varlen,
    chunk_gated_delta_rule_varlen,
    mamba2_chunk_scan_varlen,
    mamba2_state_update,
    recurrent_gated_delta_rule_update,
)
from hyla.model.ops.attention import ShortExtendLayout, paged_attention, paged_attention_short_extend
from hyla.model.ops.tree import TokenTree, TreeScan, plan_scan
from hyla.model.ops.varlen import PaddedChains, SlotPlan, check_checkpoints

HK, HV, DK, DV, K = 2, 4, 16, 8, 4
C = 32  # conv channels: a multiple of 32, so silu runs vectorized on any number of rows (bitwise alike)

# (parents per sequence, slots): chains in one ascending run of slots (the lanes are the pool rows),
# scattered chains of unequal lengths with a padding sequence and an empty one, and trees with forks
CASES = {
    "chains, ascending slots": ([[-1, 0, 1, 2], [-1, 0, 1], [-1]], [3, 4, 5]),
    "chains, scattered, padding, empty": ([[-1, 0], [-1, 0, 1, 2, 3], [], [-1, 0, 1], [-1]], [9, 2, -1, 6, 11]),
    "trees": ([[-1, 0, 0, 1, 1, 2, 4, 3], [-1, 0, 0], [-1], [-1, 0, 1, 1]], [7, 3, -1, 12]),
}


def _paths(parents: list[int]) -> list[list[int]]:
    out = []
    for j in range(len(parents)):
        path, a = [], j
        while a >= 0:
            path.append(a)
            a = parents[a]
        out.append(path[::-1])
    return out


def _ckpts(trees, slots, first_free: int):
    """A checkpoint after every token but each sequence's last (as the scheduler asks), into fresh rows."""
    entries = [(i, j + 1) for i, par in enumerate(trees) if slots[i] >= 0 for j in range(len(par) - 1)]
    rows = list(range(first_free, first_free + len(entries)))
    return entries, rows


def _scan(trees, slots, entries, rows, num_slots):
    lens = [len(p) for p in trees]
    long = dict(dtype=torch.long)
    ck = check_checkpoints(torch.tensor([i for i, _ in entries], **long), torch.tensor([n for _, n in entries], **long),
                           torch.tensor(rows, **long), lens, slots, num_slots, torch.device("cpu"))
    return TokenTree.build(trees, lens, "cpu").plan(SlotPlan.build(torch.tensor(slots), num_slots), ck)


def _check_against_paths(run_step, inputs, pool, trees, slots, entries, rows, out, exact: bool = True):
    """Replay every token's path with decode steps from the pool as it was; compare bitwise
    (``exact=False``: within fp32 rounding, 1e-5)."""
    same = torch.equal if exact else \
        (lambda a, b: torch.allclose(a, b, atol=1e-5, rtol=1e-5))
    starts = [0]
    for par in trees:
        starts.append(starts[-1] + len(par))
    scratch, before = pool.shape[0] - 1, inputs[-1]  # a spare row the replay runs in; the pool as it was
    for i, par in enumerate(trees):
        if slots[i] < 0:
            continue
        for j, path in enumerate(_paths(par)):
            ref = before.clone()
            ref[scratch] = before[slots[i]]
            for a in path:
                o = run_step([x[starts[i] + a:starts[i] + a + 1] for x in inputs[:-1]], ref, scratch)
            assert same(out[starts[i] + j], o[0]), f"sequence {i} token {j}"
            if j == len(par) - 1:
                assert same(pool[slots[i]], ref[scratch]), f"sequence {i}: final state"
            else:
                row = rows[entries.index((i, j + 1))]
                assert same(pool[row], ref[scratch]), f"sequence {i}: checkpoint after token {j}"


@pytest.mark.parametrize("case", list(CASES))
def test_gated_delta_tree_scan_equals_decode_steps_along_each_path(case):
    trees, slots = CASES[case]
    gen = torch.Generator().manual_seed(0)
    t, num_slots = sum(map(len, trees)), 40
    q, k = torch.randn(t, HK, DK, generator=gen), torch.randn(t, HK, DK, generator=gen)
    v = torch.randn(t, HV, DV, generator=gen)
    g, beta = -torch.rand(t, HV, generator=gen), torch.rand(t, HV, generator=gen)
    pool = torch.randn(num_slots, HV, DK, DV, generator=gen)
    before = pool.clone()
    entries, rows = _ckpts(trees, slots, 20)
    scan = _scan(trees, slots, entries, rows, num_slots)
    assert scan.in_place == (case == "chains, ascending slots")
    cu = torch.tensor([0] + [len(p) for p in trees]).cumsum(0)
    out = chunk_gated_delta_rule_varlen(q, k, v, g, beta, cu, pool, torch.tensor(slots), tree=scan)

    def step(xs, ref, row):
        return recurrent_gated_delta_rule_update(*xs, ref, torch.tensor([row]))

    _check_against_paths(step, (q, k, v, g, beta, before), pool, trees, slots, entries, rows, out)
    untouched = [r for r in range(num_slots) if r not in slots and r not in rows]
    assert torch.equal(pool[untouched], before[untouched])


@pytest.mark.parametrize("case", list(CASES))
def test_mamba2_tree_scan_equals_decode_steps_along_each_path(case):
    trees, slots = CASES[case]
    gen = torch.Generator().manual_seed(1)
    t, num_slots, heads, p, groups, n = sum(map(len, trees)), 40, 4, 8, 2, 6
    x, dt = torch.randn(t, heads, p, generator=gen), torch.randn(t, heads, generator=gen)
    B, Cm = torch.randn(t, groups, n, generator=gen), torch.randn(t, groups, n, generator=gen)
    A, D, dt_bias = -torch.rand(heads, generator=gen), torch.randn(heads, generator=gen), torch.randn(heads, generator=gen)
    pool = torch.randn(num_slots, heads, p, n, generator=gen)
    before = pool.clone()
    entries, rows = _ckpts(trees, slots, 20)
    scan = _scan(trees, slots, entries, rows, num_slots)
    cu = torch.tensor([0] + [len(par) for par in trees]).cumsum(0)
    out = mamba2_chunk_scan_varlen(x, dt, A, B, Cm, D, dt_bias, cu, pool, torch.tensor(slots), tree=scan)

    def step(xs, ref, row):
        return mamba2_state_update(xs[0], xs[1], A, xs[2], xs[3], D, dt_bias, ref, torch.tensor([row]))

    # within fp32 rounding, not bitwise: on an AMD EPYC the trees' batched products round differently
    # from one decode step's (|diff| <= 6e-6 on outputs of magnitude ~10; bitwise elsewhere)
    _check_against_paths(step, (x, dt, B, Cm, before), pool, trees, slots, entries, rows, out, exact=False)
    untouched = [r for r in range(num_slots) if r not in slots and r not in rows]
    assert torch.equal(pool[untouched], before[untouched])


@pytest.mark.parametrize("case", list(CASES))
def test_conv_tree_path_equals_decode_updates_along_each_path(case):
    trees, slots = CASES[case]
    gen = torch.Generator().manual_seed(2)
    t, num_slots = sum(map(len, trees)), 40
    x, w, bias = torch.randn(t, C, generator=gen), torch.randn(C, K, generator=gen), torch.randn(C, generator=gen)
    pool = torch.randn(num_slots, C, K - 1, generator=gen)
    before = pool.clone()
    entries, rows = _ckpts(trees, slots, 20)
    scan = _scan(trees, slots, entries, rows, num_slots)
    cu = torch.tensor([0] + [len(par) for par in trees]).cumsum(0)
    out = causal_conv1d_varlen(x, w, bias, cu, pool, torch.tensor(slots), "silu", tree=scan)

    def step(xs, ref, row):
        return causal_conv1d_update(xs[0], w, bias, ref, torch.tensor([row]), "silu")

    _check_against_paths(step, (x, before), pool, trees, slots, entries, rows, out)
    untouched = [r for r in range(num_slots) if r not in slots and r not in rows]
    assert torch.equal(pool[untouched], before[untouched])


def test_a_tree_scan_carries_its_checkpoints():
    trees, slots = CASES["trees"]
    entries, rows = _ckpts(trees, slots, 20)
    scan = _scan(trees, slots, entries, rows, 40)
    cu = torch.tensor([0] + [len(par) for par in trees]).cumsum(0)
    pool = torch.zeros(40, 1)
    with pytest.raises(ValueError, match="carries its checkpoints"):
        plan_scan(scan, cu, scan.num_tokens, torch.tensor(slots), pool, torch.tensor([0]), torch.tensor([1]),
                  torch.tensor([30]), torch.device("cpu"))
    with pytest.raises(ValueError, match="covers"):
        plan_scan(scan, cu, scan.num_tokens + 1, torch.tensor(slots), pool, None, None, None, torch.device("cpu"))
    assert isinstance(scan, TreeScan) and plan_scan(scan, cu, scan.num_tokens, torch.tensor(slots), pool, None, None,
                                                    None, torch.device("cpu"))[0] is scan


@pytest.mark.parametrize("prefix_lens, trees", [
    ([5], [[-1, 0, 1, 2]]),  # batch 1, a chain
    ([0], [[-1, 0, 1]]),  # no prefix
    ([7, 0, 30, 4], [[-1, 0], [-1, 0, 1, 2], [-1], [-1, 0, 1]]),  # chains of unequal lengths: padding rows
    ([6, 3, 9], [[-1, 0, 0, 1, 1, 2], [], [-1, 0, 0]]),  # trees and an empty sequence
])
def test_short_extend_attention_matches_per_sequence_attention(prefix_lens, trees):
    hq, hkv, d = 4, 2, 16
    gen = torch.Generator().manual_seed(3)
    extend_lens = [len(p) for p in trees]
    free = (torch.randperm(299, generator=gen) + 1).tolist()
    rows, out_loc = [], []
    for p, e in zip(prefix_lens, extend_lens):
        rows.append([free.pop() for _ in range(p + e)])
        out_loc += rows[-1][p:]
    width = max(map(len, rows))
    table = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    kv_indices = torch.tensor([s for r in rows for s in r])
    indptr = torch.tensor([0] + [len(r) for r in rows]).cumsum(0)
    t = sum(extend_lens)
    q, k, v = (torch.randn(t, h, d, generator=gen) for h in (hq, hkv, hkv))
    k_buf, v_buf = torch.randn(300, hkv, d, generator=gen), torch.randn(300, hkv, d, generator=gen)
    chain = all(p == list(range(-1, len(p) - 1)) for p in trees)
    tree = TokenTree.build(trees, extend_lens, "cpu")
    layout = ShortExtendLayout.build(table, prefix_lens, extend_lens, hkv, None if chain else trees)
    kb, vb = k_buf.clone(), v_buf.clone()
    got = paged_attention_short_extend(q, k, v, kb, vb, torch.tensor(out_loc), layout, d**-0.5)
    want = paged_attention(q, k, v, k_buf, v_buf, torch.tensor(out_loc), kv_indices, indptr, prefix_lens, extend_lens,
                           d**-0.5, tree_masks=None if chain else tree.masks)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(kb, k_buf) and torch.equal(vb, v_buf)  # the new K/V landed where the reference put them

    # MLA (Kimi Linear, Ling 3): a latent per token, its halves in the K and V buffers; keys the whole latent,
    # values its first value_dim channels; the same layout (one KV head), the latents written first
    from hyla.model.kimi_linear import latent_paged_attention, latent_short_extend_attention, write_latents

    heads, width, value_dim = 3, 20, 12
    half = (width + 1) // 2
    q_lat, latent = torch.randn(t, heads, width, generator=gen), torch.randn(t, width, generator=gen)
    k_lat, v_lat = torch.randn(300, 1, half, generator=gen), torch.randn(300, 1, half, generator=gen)
    layout = ShortExtendLayout.build(table, prefix_lens, extend_lens, 1, None if chain else trees)
    kb, vb = k_lat.clone(), v_lat.clone()
    write_latents(latent, kb, vb, torch.tensor(out_loc))
    got = latent_short_extend_attention(q_lat, kb, vb, layout, width**-0.5, value_dim)
    want = latent_paged_attention(q_lat, latent, k_lat, v_lat, torch.tensor(out_loc), kv_indices, indptr, prefix_lens,
                                  extend_lens, width**-0.5, value_dim, tree_masks=None if chain else tree.masks)
    assert got.shape == (t, heads, value_dim)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(kb, k_lat) and torch.equal(vb, v_lat)


CHAIN_LENS = [[1, 1, 1], [2, 2, 2], [4, 4, 4], [2, 4, 1]]
PADDED_TREES = [[[-1, 0, 0, 1], [-1, 0, 0], [-1]],  # forks; a full tree, a short one, a root alone
                [[-1, 0, 1, 0], [-1], [-1, 0, 0, 2]]]


@pytest.mark.parametrize("trees, as_trees", [
    *(pytest.param([list(range(-1, n - 1)) for n in lens], False, id=f"chains {lens}") for lens in CHAIN_LENS),
    pytest.param([list(range(-1, n - 1)) for n in CHAIN_LENS[3]], True, id=f"chains {CHAIN_LENS[3]} as trees"),
    *(pytest.param(trees, True, id=f"trees {k}") for k, trees in enumerate(PADDED_TREES))])
def test_padded_chains_equal_the_tree_path_bitwise(trees, as_trees):
    """``gated_delta_rule_chains`` / ``causal_conv1d_chains`` / ``mamba2_chains`` / ``selective_scan_chains`` /
    ``kda_chains`` (the compiled verify step's ops:
    chains padded to a width of 4 inside the op, fixed shapes) compute what the tree path computes
    for the same chains, bitwise: outputs, each checkpoint state, each final state, and no other
    pool row; a chain shorter than the width leaves the state after its last token in its
    checkpoint row (its own slot then holds the state after the padding). The same for padded
    *trees* (``parents``: each token from its parent's state and its path's conv window) and for
    chains given as trees."""
    from hyla.model.ops import causal_conv1d_chains, gated_delta_rule_chains

    width = 4
    lens = [len(par) for par in trees]
    gen = torch.Generator().manual_seed(sum(lens) + 100 * as_trees)
    slots, num_slots = [7, 2, 30], 40
    b, t = len(slots), sum(lens)
    ckpt = [[10 + 3 * i + j for j in range(width - 1)] for i in range(b)]
    ckpt_rows = torch.tensor(ckpt, dtype=torch.long)
    rows = torch.tensor([i * width + j for i, n in enumerate(lens) for j in range(n)])
    # (padding positions continue the one before, as ForwardBatch.chains.parents)
    parents = torch.tensor([par + list(range(len(par) - 1, width - 1)) for par in trees]) if as_trees else None
    chains = PaddedChains(ckpt_rows, rows, parents)
    # the tree path: checkpoints after every token but the last; a full chain's last state in its own slot
    entries = [(i, j + 1) for i, n in enumerate(lens) for j in range(n - 1)]
    flat = [ckpt[i][j] for i, n in enumerate(lens) for j in range(n - 1)]
    scan = _scan(trees, slots, entries, flat, num_slots)
    plan = SlotPlan.build(torch.tensor(slots), num_slots, host=slots)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    # where each sequence's state after its last token is: its own slot when full, else its checkpoint row
    last = [slots[i] if n == width else ckpt[i][n - 1] for i, n in enumerate(lens)]

    def check(pool_chains, pool_tree, before):
        for i, n in enumerate(lens):
            assert torch.equal(pool_chains[last[i]], pool_tree[slots[i]])
            for j in range(n - 1):
                assert torch.equal(pool_chains[ckpt[i][j]], pool_tree[ckpt[i][j]])
        used = set(slots) | {r for row in ckpt for r in row}
        others = [r for r in range(num_slots) if r not in used]
        assert torch.equal(pool_chains[others], before[others])

    q, k = torch.randn(t, HK, DK, generator=gen), torch.randn(t, HK, DK, generator=gen)
    v, g, beta = torch.randn(t, HV, DV, generator=gen), -torch.rand(t, HV, generator=gen), torch.rand(t, HV, generator=gen)
    for dtype in (torch.float32, torch.bfloat16):  # (a pool of bf16 states: rounded after every token on both paths)
        pool = torch.randn(num_slots, HV, DK, DV, generator=gen).to(dtype)
        a, c = pool.clone(), pool.clone()
        out = gated_delta_rule_chains(q, k, v, g, beta, a, plan, chains)
        want = chunk_gated_delta_rule_varlen(q, k, v, g, beta, cu, c, torch.tensor(slots), tree=scan)
        assert torch.equal(out, want)
        check(a, c, pool)

    x, w, bias = torch.randn(t, C, generator=gen), torch.randn(C, K, generator=gen), torch.randn(C, generator=gen)
    for b_, act in ((bias, "silu"), (None, None)):  # (KDA's conv has no bias, LFM2's no activation)
        pool = torch.randn(num_slots, C, K - 1, generator=gen)
        a, c = pool.clone(), pool.clone()
        out = causal_conv1d_chains(x, w, b_, a, plan, chains, act)
        want = causal_conv1d_varlen(x, w, b_, cu, c, torch.tensor(slots), act, tree=scan)
        assert torch.equal(out, want)
        check(a, c, pool)
    with pytest.raises(ValueError, match="chains"):  # more tokens than the padded layout holds
        causal_conv1d_chains(x, w, bias, a, plan, PaddedChains(ckpt_rows, torch.arange(t + 1)), "silu")
    with pytest.raises(ValueError, match="parents must be"):  # parents not [B, W]
        causal_conv1d_chains(x, w, bias, a, plan, PaddedChains(ckpt_rows, rows, torch.zeros(b, width - 1, dtype=torch.long)),
                             "silu")

    # Mamba2's SSD (lightning attention's too: dt held at 1 by its clamp), 2 groups of B/C over 4 heads, with D
    from hyla.model.ops import mamba2_chains

    x, dt, A = torch.randn(t, HV, DV, generator=gen), torch.randn(t, HV, generator=gen), -torch.rand(HV, generator=gen)
    Bm, Cm, D = torch.randn(t, 2, DK, generator=gen), torch.randn(t, 2, DK, generator=gen), torch.randn(HV, generator=gen)
    dt_bias = torch.randn(HV, generator=gen)
    for limit in (None, (1.0, 1.0)):
        pool = torch.randn(num_slots, HV, DV, DK, generator=gen)
        a, c = pool.clone(), pool.clone()
        out = mamba2_chains(x, dt, A, Bm, Cm, D, dt_bias, a, plan, chains, dt_limit=limit)
        want = mamba2_chunk_scan_varlen(x, dt, A, Bm, Cm, D, dt_bias, cu, c, torch.tensor(slots), tree=scan,
                                        dt_limit=limit)
        assert torch.equal(out, want)
        check(a, c, pool)

    # Mamba1's selective scan (a decay per channel and state), with D
    from hyla.model.ops import chunk_kda_varlen, kda_chains, selective_scan_chains, selective_scan_varlen

    inner, n = 100, 6  # (I >= 64: where a batched matmul of one row rounded otherwise than of several)
    x, dt = torch.randn(t, inner, generator=gen), torch.randn(t, inner, generator=gen)
    A, D, dt_bias = -torch.rand(inner, n, generator=gen), torch.randn(inner, generator=gen), torch.randn(inner, generator=gen)
    Bm, Cm = torch.randn(t, n, generator=gen), torch.randn(t, n, generator=gen)
    pool = torch.randn(num_slots, inner, n, generator=gen)
    a, c = pool.clone(), pool.clone()
    out = selective_scan_chains(x, dt, A, Bm, Cm, D, dt_bias, a, plan, chains)
    want = selective_scan_varlen(x, dt, A, Bm, Cm, D, dt_bias, cu, c, torch.tensor(slots), tree=scan)
    assert torch.equal(out, want)
    check(a, c, pool)

    # KDA: Gated DeltaNet's rule with a decay per key channel
    g = -torch.rand(t, HV, DK, generator=gen)
    pool = torch.randn(num_slots, HV, DK, DV, generator=gen)
    a, c = pool.clone(), pool.clone()
    out = kda_chains(q, k, v, g, beta, a, plan, chains)
    want = chunk_kda_varlen(q, k, v, g, beta, cu, c, torch.tensor(slots), tree=scan)
    assert torch.equal(out, want)
    check(a, c, pool)


def test_a_batch_of_chains_is_validated_when_built():
    """``ForwardBatch.chain_ckpt_rows``: chains of 1..W tokens only, checkpoint rows of the right shape that
    are distinct state slots and none a sequence's own (a model with a mixer that runs no chains refuses
    it: ``test_engine_speculative.test_padded_chain_verify_is_exact_on_every_mixer``)."""
    from hyla.model.forward_batch import ForwardBatch

    long = dict(dtype=torch.long)
    conv, ssm = [torch.zeros(20, C, K - 1)], [torch.zeros(20, HV, DK, DV)]

    def batch(lens, rows, slots=(1, 2), trees=None, chains=True):
        t = sum(lens)
        return ForwardBatch(
            is_decode=False, input_ids=torch.zeros(t, **long), positions=torch.zeros(t, **long), extend_lens=lens,
            prefix_lens=[0] * len(lens), cu_seqlens=torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()]),
            out_cache_loc=torch.zeros(t, **long), kv_indices=torch.zeros(0, **long), kv_indptr=torch.zeros(3, **long),
            k_buffers=[], v_buffers=[], state_slots=torch.tensor(slots), conv_states=conv, ssm_states=ssm,
            state_slot_list=list(slots), chain_ckpt_rows=torch.tensor(rows, **long).view(len(lens), -1) if chains
            else None, chain_ckpt_list=rows if chains else None, chain_tree_parents=trees)

    ok = batch([3, 1], [[5, 6], [7, 8]])
    assert ok.short_extend is None and ok.chains.rows.tolist() == [0, 1, 2, 3]  # (no attention layers)
    assert ok.chains.parents is None and ok.chains.ckpt_rows is ok.chain_ckpt_rows
    # padded trees: each position's parent, a padding position continuing the one before
    trees = batch([3, 1], [[5, 6], [7, 8]], trees=[[-1, 0, 0], [-1]])
    assert trees.chains.parents.tolist() == [[-1, 0, 0], [-1, 0, 1]]
    with pytest.raises(ValueError, match="earlier token"):
        batch([3, 1], [[5, 6], [7, 8]], trees=[[-1, 0, 2], [-1]])
    with pytest.raises(ValueError, match="tree parents for"):
        batch([3, 1], [[5, 6], [7, 8]], trees=[[-1, 0], [-1]])
    with pytest.raises(ValueError, match="chain_tree_parents is for a verify step of padded chains"):
        batch([3, 1], [[5, 6], [7, 8]], trees=[[-1, 0, 0], [-1]], chains=False)
    for lens, rows, slots, match in [([4, 2], [[5, 6], [7, 8]], (1, 2), "1..3 tokens"),
                                     ([3, 3], [[5], [7]], (1, 2), "1..2 tokens"),
                                     ([3, 3], [[5, 6], [6, 8]], (1, 2), "repeats"),
                                     ([3, 3], [[5, 6], [2, 8]], (1, 2), "own"),
                                     ([3, 3], [[5, 6], [7, 99]], (1, 2), "chain_ckpt_rows")]:
        with pytest.raises(ValueError, match=match):
            batch(lens, rows, slots)


@pytest.mark.slow  # inductor compiles: ~40 s of a loaded 2-core run
@pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None, reason="torch.compile needs a C++ compiler")
def test_padded_trees_compile_to_what_they_compute_eagerly():
    """Padded trees through inductor with the options of ``ModelRunner``'s graph of more rows
    (``realize_opcount_threshold`` 4, dynamic shapes) and its warm-up's settings (``warm_up_config``: no duck
    shaping, so the batch-1 graph is general in the token count, as the engine's is, and the second batch-1 case
    runs it rather than a graph of its own: two compiles, not three, ~20% of the test cold) — a conv (its windows
    along each path) and Mamba1's scan (``varlen.scan_padded_chains``, every recurrent op's loop) in one graph:
    the outputs and pool rows of eager, at batch 1 (3 tokens, then 2) and 2. Column ``j`` once
    read its parent's state back from the checkpoint row the parent had written in the same graph; inductor's
    code for that read the wrong values at batch size 1 (Mamba1's outputs off by ~10)."""
    from hyla.engine.model_runner import warm_up_config
    from hyla.model.ops import causal_conv1d_chains, selective_scan_chains

    width, num_slots, inner, n = 5, 40, 16, 6
    gen = torch.Generator().manual_seed(0)
    A, D, dt_bias = -torch.rand(inner, n, generator=gen), torch.randn(inner, generator=gen), torch.randn(inner, generator=gen)
    w, bias = torch.randn(C, K, generator=gen), torch.randn(C, generator=gen)

    def scan(pools, x, dt, b_, c_, plan, chains):
        xc = causal_conv1d_chains(x.repeat(1, C // inner), w, bias, pools[1], plan, chains, "silu")
        y = selective_scan_chains(xc[:, :inner], dt, A, b_, c_, D, dt_bias, pools[0], plan, chains)
        return y, xc

    compiled = torch.compile(scan, fullgraph=True, dynamic=True,
                             options={"realize_opcount_threshold": 4, "cpp_wrapper": False})
    for trees, slots in [([[-1, 0, 0]], [3]), ([[-1, 0]], [25]), ([[-1, 0, 1, 1], [-1, 0]], [7, 9])]:
        lens = [len(p) for p in trees]
        t, b = sum(lens), len(trees)
        ckpt_rows = torch.tensor([[10 + 4 * i + j for j in range(width - 1)] for i in range(b)])
        rows = torch.tensor([i * width + j for i, m in enumerate(lens) for j in range(m)])
        parents = torch.tensor([p + list(range(len(p) - 1, width - 1)) for p in trees])
        plan = SlotPlan.build(torch.tensor(slots), num_slots, host=slots)
        inputs = [torch.randn(t, inner, generator=gen), torch.randn(t, inner, generator=gen),
                  torch.randn(t, n, generator=gen), torch.randn(t, n, generator=gen)]
        pools = [torch.randn(num_slots, inner, n, generator=gen), torch.randn(num_slots, C, K - 1, generator=gen)]
        a, c = [p.clone() for p in pools], [p.clone() for p in pools]
        with torch.inference_mode(), warm_up_config():
            want = scan(a, *inputs, plan, PaddedChains(ckpt_rows, rows, parents))
            got = compiled(c, *inputs, plan, PaddedChains(ckpt_rows, rows, parents))
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(c, a, atol=1e-5, rtol=1e-5)
