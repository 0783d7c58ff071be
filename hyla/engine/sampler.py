"""Turn a batch of next-token logits into tokens: penalties → grammar mask → temperature →
top-k/top-p/min-p → draw.

A grammar's mask (``hyla.engine.grammar.TokenMask``) sets forbidden tokens to ``-inf`` after the
penalties, so greedy and random rows alike choose only among allowed tokens (top-k and top-p then
count allowed tokens only). Greedy rows take the argmax of the penalised, masked logits. Random
rows draw with their request's own ``torch.Generator`` (seeded from ``SamplingParams.seed`` or
from the engine seed), so a request's output does not depend on what else shares its batch.
Log-probabilities reported to the user are those of the model's raw distribution (``log_softmax``
of the unpenalised, unmasked fp32 logits), the same for greedy and random rows, which is what the
cache-on/cache-off differential tests compare. With a grammar, a token it forces may thus show a
very low logprob, and ``top_logprobs`` may list tokens it forbids.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hyla.engine.grammar import TokenMask, apply_token_mask
from hyla.engine.request import Req


@dataclass
class SampleOutput:
    token_ids: list[int]
    logprobs: list[float]  # raw-model logprob of each chosen token
    top_logprobs: list[list[tuple[float, int]]]  # per row, [] unless asked for


def sample(logits: torch.Tensor, reqs: list[Req], mask: TokenMask | None = None) -> SampleOutput:
    """logits: [B, V] fp32, one row per request in ``reqs``; ``mask``: the grammar masks of the
    constrained rows (``None``: no row is constrained)."""
    logits = logits.float()
    raw_logprobs = torch.log_softmax(logits, dim=-1)  # [B, V]
    processed = logits.clone()
    for i, req in enumerate(reqs):
        if req.sampling.has_penalties:
            processed[i] = apply_penalties(processed[i], req)
    apply_token_mask(processed, mask)

    greedy = torch.argmax(processed, dim=-1)  # [B]
    chosen = greedy.clone()
    for i, req in enumerate(reqs):
        if not req.sampling.is_greedy:
            chosen[i] = sample_row(processed[i], req)

    token_ids = chosen.tolist()
    lps = raw_logprobs.gather(1, chosen.unsqueeze(1)).squeeze(1).tolist()
    tops = [top_logprobs(raw_logprobs[i], req) for i, req in enumerate(reqs)]
    return SampleOutput(token_ids, lps, tops)


def top_logprobs(row_logprobs: torch.Tensor, req: Req) -> list[tuple[float, int]]:
    """The ``top_logprobs_num`` most likely ``(logprob, token id)`` of one raw logprob row ``[V]``
    ([] unless the request asked for them)."""
    k = req.sampling.top_logprobs_num if req.return_logprob else 0
    if not k:
        return []
    vals, idx = row_logprobs.topk(k)
    return list(zip(vals.tolist(), idx.tolist()))


def apply_penalties(row: torch.Tensor, req: Req) -> torch.Tensor:
    """Repetition penalty over prompt+output tokens (HF); frequency/presence over output (OpenAI)."""
    p = req.sampling
    row = row.clone()
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(req.fill_ids)), dtype=torch.long, device=row.device)
        vals = row[seen]
        row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if (p.frequency_penalty or p.presence_penalty) and req.output_ids:
        out = torch.tensor(req.output_ids, dtype=torch.long, device=row.device)
        counts = torch.bincount(out, minlength=row.numel()).to(row.dtype)  # [V]
        row = row - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).to(row.dtype)
    return row


def target_probs(row: torch.Tensor, req: Req) -> torch.Tensor:
    """The distribution a random row draws from: temperature, then top-k, top-p and min-p. ``[V]``."""
    p = req.sampling
    row = row / p.temperature
    if p.top_k > 0:
        kth = torch.topk(row, min(p.top_k, row.numel())).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    probs = torch.softmax(row, dim=-1)  # [V]
    if p.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        # keep the smallest prefix whose mass reaches top_p (always at least the top token)
        drop = sorted_probs.cumsum(0) - sorted_probs >= p.top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    if p.min_p > 0.0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    return probs / probs.sum()


def draw(probs: torch.Tensor, req: Req) -> int:
    """One token from ``probs`` ``[V]`` with the request's generator."""
    gen = req.generator
    if gen is not None and gen.device != probs.device:
        probs = probs.to(gen.device)
    return int(torch.multinomial(probs, 1, generator=gen))


def uniform(req: Req) -> float:
    """One U(0, 1) draw from the request's generator (speculative acceptance)."""
    gen = req.generator
    return float(torch.rand(1, generator=gen, device=gen.device if gen is not None else "cpu"))


def sample_row(row: torch.Tensor, req: Req) -> torch.Tensor:
    """Draw one token from a penalised logit row with the request's generator."""
    return torch.tensor(draw(target_probs(row, req), req), device=row.device)
