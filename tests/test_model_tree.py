"""Tree verification at model level (``hyla/model/ops/tree.py``): a step that feeds each sequence a
tree of draft tokens computes, for every token, what a plain run of its path computes — its
logits, and (as checkpoints) the conv windows and SSM states after it — for every architecture."""

from __future__ import annotations

import pytest
import torch
from checkpoints import TinyRunner

from hyla.model import load_model
from hyla.model.ops.tree import TokenTree, tree_scan

# a tree of 8 tokens per sequence, depth 3: 0 -> {1, 2}, 1 -> {3, 4}, 2 -> {5}, 4 -> {6}, 3 -> {7}
PARENTS = [-1, 0, 0, 1, 1, 2, 4, 3]
SHORT = [-1, 0, 0]  # the second sequence: a root and two alternatives
ARCHS = ["qwen3_next_dense_path", "qwen3_next_moe_path", "qwen3_5_path", "nemotron_h_path", "falcon_h1_path",
         "bamba_path", "lfm2_path", "kimi_linear_path", "bailing_hybrid_path", "olmo_hybrid_path",
         "lara_mini_path", "lfm3_path", "zamba2_path", "jamba_path", "minimax_path"]


def _path(parents: list[int], j: int) -> list[int]:
    path = []
    while j >= 0:
        path.append(j)
        j = parents[j]
    return path[::-1]


def _states(runner: TinyRunner, slot: int) -> list[torch.Tensor]:
    return [p[slot].clone() for p in runner.conv_states + runner.ssm_states]


@pytest.mark.parametrize("ckpt", ARCHS)
@torch.no_grad()
def test_tree_step_equals_each_path_run_alone(ckpt, request):
    model = load_model(request.getfixturevalue(ckpt))
    runner = TinyRunner(model)
    gen = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    prompts = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (13, 6)]
    seqs = [runner.new_seq() for _ in prompts]
    runner.step(seqs, prompts)
    saved = [_states(runner, s.state_slot) for s in seqs]  # the states after each prompt
    trees = [PARENTS, SHORT]
    drafts = [torch.randint(3, vocab, (len(p),), generator=gen).tolist() for p in trees]
    # every token but a sequence's last leaves its state in a checkpoint slot; the last, in its own slot
    ckpts = [(i, j + 1, runner.new_state_slot()) for i, par in enumerate(trees) for j in range(len(par) - 1)]
    logits = runner.step(seqs, drafts, checkpoints=ckpts, all_logits=True, tree_parents=trees)  # [8 + 3, V]

    row = 0
    for i, (par, toks) in enumerate(zip(trees, drafts)):
        for j in range(len(par)):
            ref_seq = runner.fork(seqs[i], len(prompts[i]), runner.new_state_slot())
            for pool, state in zip(runner.conv_states + runner.ssm_states, saved[i]):
                pool[ref_seq.state_slot] = state
            path = _path(par, j)
            ref = runner.step([ref_seq], [[toks[a] for a in path]], decode=False)  # [1, V] after the path
            # the project's fp32 logit tolerance (1e-4): LFM3's post-norms scale a part's rounding up to ~2.3e-5
            torch.testing.assert_close(logits[row + j], ref[0], atol=1e-4, rtol=1e-5)
            slot = seqs[i].state_slot if j == len(par) - 1 else next(
                s for q, n, s in ckpts if q == i and n == j + 1)
            for got, want in zip(_states(runner, slot), _states(runner, ref_seq.state_slot)):
                torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
        row += len(par)


def test_bad_trees_are_refused():
    for parents, message in [([[0, 0]], "first token"), ([[-1, 1]], "earlier token"), ([[-1, -1]], "first token"),
                             ([[-1, 0]], "2 tree parents for 3")]:
        with pytest.raises(ValueError, match=message):
            TokenTree.build(parents, [3] if "for 3" in message else [2], "cpu")


def test_tree_scan_runs_each_token_from_its_parents_state():
    """The scan with a running sum as the 'op': each token's output is the sum along its path."""
    tree = TokenTree.build([[-1, 0, 0, 1], [-1]], [4, 1], "cpu")
    pool = torch.tensor([[0.0], [100.0], [1000.0], [0.0], [0.0]])  # rows 1, 2: the sequences' states

    def step(x, buf, rows):  # state += x; out = state
        buf[rows.index] += x
        return buf[rows.index].clone()

    x = torch.tensor([[1.0], [2.0], [4.0], [8.0], [5.0]])
    out = tree_scan(step, (x,), pool, torch.tensor([1, 2]), tree)
    assert out.flatten().tolist() == [101, 103, 105, 111, 1005]
    assert pool.flatten().tolist() == [0, 111, 1005, 0, 0]  # each sequence's last token's state
