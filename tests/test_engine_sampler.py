"""The sampler's batched random rows: each row's distribution as its own parameters define it, and
inverse-CDF draws that follow it (never a token of probability zero)."""

from __future__ import annotations

import torch

from hyla.engine.request import Req
from hyla.engine.sampler import inverse_cdf, target_probs_batch
from hyla.engine.sampling_params import SamplingParams


def _req(**params) -> Req:
    return Req(rid="r", input_ids=[1], sampling=SamplingParams(**params))


def _one_row(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The per-row definition: temperature, top-k, softmax, top-p (smallest prefix reaching it), min-p."""
    row = row / p.temperature
    if p.top_k > 0:
        row = row.masked_fill(row < torch.topk(row, min(p.top_k, row.numel())).values[-1], float("-inf"))
    probs = torch.softmax(row, dim=-1)
    if p.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        sorted_probs = sorted_probs.masked_fill(sorted_probs.cumsum(0) - sorted_probs >= p.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    if p.min_p > 0.0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    return probs / probs.sum()


def test_batched_distributions_match_each_row_alone():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 50, generator=g) * 3
    reqs = [_req(temperature=0.7), _req(temperature=1.0, top_k=5), _req(temperature=1.3, top_p=0.8),
            _req(temperature=1.0, min_p=0.05, top_k=20), _req(temperature=0.5, top_k=1)]
    probs = target_probs_batch(logits, reqs)
    for i, r in enumerate(reqs):
        torch.testing.assert_close(probs[i], _one_row(logits[i], r.sampling), atol=1e-6, rtol=1e-6)
    assert int((probs[4] > 0).sum()) == 1 and int((probs[1] > 0).sum()) == 5


def test_inverse_cdf_follows_the_distribution_and_skips_zeros():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.3, 0.2, 0.0]])
    edges = inverse_cdf(probs.expand(3, -1), torch.tensor([0.0, 0.5, 0.999999]))
    assert edges.tolist() == [1, 3, 4]  # u = 0 never lands on the zero-probability token 0
    u = torch.rand(20000, generator=torch.Generator().manual_seed(1))
    counts = torch.bincount(inverse_cdf(probs.expand(20000, -1), u), minlength=6).float() / 20000
    torch.testing.assert_close(counts, probs[0], atol=0.015, rtol=0)


def test_logprobs_only_when_a_request_asks_for_them():
    """A CPU batch where nobody asked for logprobs draws the same tokens without computing them
    (NaN); one request asking gives every row its raw logprob (the chosen token's log_softmax)."""
    from hyla.engine.sampler import sample

    g = torch.Generator().manual_seed(2)
    logits = torch.randn(3, 40, generator=g) * 4
    logits[0, 7] = 50.0  # a clear argmax in the greedy row

    def batch():  # greedy, random (its own generator, as the engine gives it), greedy with a penalty
        reqs = [_req(temperature=0.0), _req(temperature=0.8), _req(temperature=0.0, repetition_penalty=1.5)]
        reqs[1].generator = torch.Generator().manual_seed(1)
        return reqs

    quiet = sample(logits, batch())
    assert quiet.token_ids[0] == 7 and all(lp != lp for lp in quiet.logprobs)  # NaN: not computed
    reqs = batch()
    reqs[1].return_logprob = True
    loud = sample(logits, reqs)
    assert loud.token_ids == quiet.token_ids  # the same draws either way
    want = torch.log_softmax(logits, dim=-1)[torch.arange(3), torch.tensor(loud.token_ids)]
    torch.testing.assert_close(torch.tensor(loud.logprobs), want)


def test_top_logprobs_are_the_rows_most_likely_tokens():
    """A request asking for top logprobs gets its row's ``k`` most likely ``(logprob, id)`` pairs,
    most likely first; one asking for none gets ``[]`` (``Drawn``'s host copies: one path for CPU
    and CUDA, where a ``topk`` result read as a tuple once broke every request asking for them)."""
    from hyla.engine.sampler import sample

    logits = torch.randn(2, 40, generator=torch.Generator().manual_seed(3)) * 4
    reqs = [_req(temperature=0.0, top_logprobs_num=3), _req(temperature=0.0)]
    reqs[0].return_logprob = True
    out = sample(logits, reqs)
    want = torch.log_softmax(logits[0], dim=-1).topk(3)
    assert [i for _, i in out.top_logprobs[0]] == want.indices.tolist() and out.top_logprobs[1] == []
    torch.testing.assert_close(torch.tensor([lp for lp, _ in out.top_logprobs[0]]), want.values)
    assert out.token_ids[0] == want.indices[0]
