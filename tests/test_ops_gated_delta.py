"""Gated DeltaNet beyond the contract it shares with KDA (``test_ops_delta_rule.py``): short extends
run token by token with the decode step's math, bitwise (through ``ops/tree.py``; Mamba1 and Mamba2
within an ulp of their per-token terms; ``test_model_tree.py`` checks them all at model level)."""

from __future__ import annotations

import torch
from test_ops_delta_rule import GDN, TOL

from hyla.model.ops import chunk_gated_delta_rule_varlen, recurrent_gated_delta_rule_update
from hyla.model.ops.tree import SHORT_EXTEND


def test_short_extends_run_token_by_token_with_checkpoints():
    """Extends of at most SHORT_EXTEND tokens (a verify step) take the recurrent path: outputs,
    final states and every-token checkpoints equal the reference; a padding row and an empty
    sequence write nothing; and a verify-like extend equals the same tokens fed as decode steps
    bitwise (both run the decode step's math)."""
    lengths = [SHORT_EXTEND, 3, 0, 1, 5]
    inputs = GDN.make(lengths, num_slots=20)
    pool = inputs[-1]
    before = pool.clone()
    slots = [2, 5, 9, -1, 11]
    ckpts = [(0, 1), (0, SHORT_EXTEND), (1, 2), (4, 1), (4, 4), (4, 5)]
    ckpt_slot = [12, 13, 14, 15, 16, 17]
    o = GDN.run(inputs, pool, slots, ckpt_seq=torch.tensor([i for i, _ in ckpts]),
                ckpt_len=torch.tensor([n for _, n in ckpts]), ckpt_slot=torch.tensor(ckpt_slot))
    cu = inputs[5]
    for i, slot in enumerate(slots):
        if slot < 0:
            continue
        o_ref, state = GDN.ref(inputs, before, slot, i)
        torch.testing.assert_close(o[cu[i]:cu[i + 1]], o_ref, **TOL)
        torch.testing.assert_close(pool[slot], state, **TOL)
    for (i, n), row in zip(ckpts, ckpt_slot):
        torch.testing.assert_close(pool[row], GDN.ref(inputs, before, slots[i], i, n)[1], **TOL)
    untouched = [r for r in range(20) if r not in slots + ckpt_slot]
    assert torch.equal(pool[untouched], before[untouched])

    q, k, v, g, beta, _, _ = GDN.make([5], num_slots=4, seed=3)
    pool_a = GDN.make([5], num_slots=4, seed=3)[-1]
    pool_b = pool_a.clone()
    o_ext = chunk_gated_delta_rule_varlen(q, k, v, g, beta, torch.tensor([0, 5]), pool_a, torch.tensor([1]))
    o_dec = torch.cat([recurrent_gated_delta_rule_update(q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1],
                                                         beta[t:t + 1], pool_b, torch.tensor([1])) for t in range(5)])
    assert torch.equal(o_ext, o_dec) and torch.equal(pool_a, pool_b)
