"""What only the Kimi Delta Attention op has (the contract it shares with Gated DeltaNet is
``test_ops_delta_rule.py``): a decay per key channel, exact under strong decays, any chunk size."""

from __future__ import annotations

import pytest
import torch
from test_ops_delta_rule import KDA, TOL

from hyla.model.ops import kda_ref


def test_reference_per_channel_decay_differs_from_a_per_head_one():
    """The oracle really decays per channel: averaging g over Dk (a GDN-style scalar) changes it."""
    q, k, v, g, beta, _, pool = KDA.make([20])
    o, _ = kda_ref(q, k, v, g, beta, pool[1])
    o_mean, _ = kda_ref(q, k, v, g.mean(-1, keepdim=True).expand_as(g), beta, pool[1])
    assert (o - o_mean).abs().max() > 1e-2


@pytest.mark.parametrize("chunk_size", [1, 16, 20, 48, 128])
def test_any_chunk_size_with_strong_decays(chunk_size):
    """Sub-chunks of 16 (chunk sizes that are multiples of 16) or the column loop alone (others)."""
    inputs = KDA.make([150, 33], decay_scale=10.0, seed=6)
    pool = inputs[-1]
    before = pool.clone()
    o = KDA.run(inputs, pool, [1, 2], ckpt_seq=torch.tensor([0, 1]), ckpt_len=torch.tensor([77, 33]),
                ckpt_slot=torch.tensor([5, 6]), chunk_size=chunk_size)
    for i, slot in enumerate((1, 2)):
        o_ref, state = KDA.ref(inputs, before, slot, i)
        torch.testing.assert_close(o[inputs[5][i] : inputs[5][i + 1]], o_ref, **TOL)
        torch.testing.assert_close(pool[slot], state, **TOL)
    torch.testing.assert_close(pool[5], KDA.ref(inputs, before, 1, 0, 77)[1], **TOL)
    torch.testing.assert_close(pool[6], pool[2], atol=1e-6, rtol=1e-6)
