"""Turn a batch of next-token logits into tokens: processing (penalties, logit bias, min_new_tokens)
→ grammar mask → temperature → top-k/top-p/min-p → draw.

Processing (:func:`process_row`) changes the rows of the requests that need it
(:func:`needs_processing`: penalties, a ``logit_bias``, or output still short of
``min_new_tokens``, whose EOS and stop token ids it sets to ``-inf``), one row at a time; a batch in
which no request needs it skips the stage, Python loop included. The same predicate keeps such
requests from drafting, and speculative verification processes their one row with the same
function (``speculative.verify``).
A grammar's mask (``hyla.engine.grammar.TokenMask``) sets forbidden tokens to ``-inf`` after
processing, so greedy and random rows alike choose only among allowed tokens (top-k and top-p then
count allowed tokens only). Greedy rows take the argmax of the processed, masked logits. Random
rows are drawn together (their distributions as one ``[R, V]`` batch, each row with its own
temperature / top-k / top-p / min-p) and each draws by inverse CDF from one uniform number of its
request's own ``torch.Generator`` (seeded from ``SamplingParams.seed`` or from the engine seed),
so a request's output does not depend on what else shares its batch, and a step costs a few batched
kernels, not a softmax and a sort per request.
Log-probabilities reported to the user are those of the model's raw distribution (the unprocessed,
unmasked fp32 logits: no penalty, bias or ban shows in them), the same for greedy and random rows,
which is what the cache-on/cache-off differential tests compare: :func:`raw_distribution` gives rows
and a per-row ``lse`` whose difference they are (:func:`raw_logprobs`). On CUDA the rows are the
logits and ``lse`` their logsumexp, from one Triton pass that also gives the argmax
(``ops/gpu/logits.py``: PyTorch's ``log_softmax`` runs one block per row, 34 µs at batch 1 on an
H100); on CPU they are ``log_softmax``'s (PyTorch's fused CPU kernel is faster there than a
logsumexp) and ``lse`` is 0.
A CPU batch in which no request asked for logprobs skips them: the argmax alone (a CPU decode step
at batch 1 spent ~50 µs of ~2.2 ms on logprobs nobody read).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Collection

import torch

from hyla.cache.transfer import to_device
from hyla.engine.grammar import TokenMask, apply_token_mask, unpack_bitmask
from hyla.engine.request import Req
from hyla.model.ops import gpu as gpu_ops


@dataclass
class SampleOutput:
    token_ids: list[int]
    logprobs: list[float]  # raw-model logprob of each chosen token
    top_logprobs: list[list[tuple[float, int]]]  # per row, [] unless asked for


@dataclass
class Drawn:
    """A batch's tokens drawn on the logits' device, not yet read by the host: ``chosen [B]`` and the
    raw distribution's ``rows [B, V]`` and ``lse [B]`` (:func:`raw_distribution`). Their copies to
    the host are queued when it is made (:func:`draw_batch`), so that they come before anything
    queued after (the overlap schedule's next decode step, fed ``chosen`` on the device) and
    :meth:`collect` waits for them alone."""

    chosen: torch.Tensor
    rows: torch.Tensor | None  # None with lse: no logprobs (no request of the batch asked for them)
    lse: torch.Tensor | None
    reqs: list[Req]
    host: tuple = ()  # chosen, their logprobs (None: not computed), per row (top values, top ids) or None
    ready: object = None  # a CUDA event recorded after the copies (None: on the host already)

    def __post_init__(self) -> None:
        if self.rows is None:  # (CPU only) nobody reads them: NaN logprobs, no top logprobs
            self.host = (self.chosen, None, [None] * len(self.reqs))
            return
        lps = raw_logprobs(self.rows, self.lse, self.chosen)
        tops = [raw_top_logprobs(self.rows[i], self.lse[i], k) if (k := num_top_logprobs(r)) else None
                for i, r in enumerate(self.reqs)]
        cuda = self.chosen.device.type == "cuda"
        # one path for both devices (the CPU's runs the CUDA one's structure): on CUDA each tensor's
        # copy to pinned host memory is queued, the event recorded after them
        host = (lambda t: torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)) \
            if cuda else (lambda t: t)
        self.host = (host(self.chosen), host(lps), [None if t is None else (host(t[0]), host(t[1])) for t in tops])
        if cuda:
            self.ready = torch.cuda.Event()
            self.ready.record()

    def collect(self) -> SampleOutput:
        """Read the tokens and their logprobs (the step's one wait for the device)."""
        if self.ready is not None:
            self.ready.synchronize()
        chosen, lps, tops = self.host
        ids = chosen.tolist()
        return SampleOutput(ids, lps.tolist() if lps is not None else [float("nan")] * len(ids),
                            [[] if t is None else _pairs(*t) for t in tops])


def sample(logits: torch.Tensor, reqs: list[Req], mask: TokenMask | None = None,
           eos_token_ids: Collection[int] = ()) -> SampleOutput:
    """logits: [B, V] fp32, one row per request in ``reqs``; ``mask``: the grammar masks of the
    constrained rows (``None``: no row is constrained); ``eos_token_ids``: the model's EOS ids
    (``OutputProcessor.eos_token_ids``; a request short of its ``min_new_tokens`` cannot sample them)."""
    return draw_batch(logits, reqs, mask, eos_token_ids).collect()


def draw_batch(logits: torch.Tensor, reqs: list[Req], mask: TokenMask | None = None,
               eos_token_ids: Collection[int] = ()) -> Drawn:
    """:func:`sample` up to the host read: every kernel launched, nothing read back."""
    logits = logits.float()
    if any(r.return_logprob for r in reqs) or gpu_ops.available(logits.device):
        argmax, rows, lse = raw_distribution(logits)
    else:  # no logprobs to report (the module docstring): the argmax alone
        argmax, rows, lse = torch.argmax(logits, dim=-1), None, None
    processed_rows = [i for i, req in enumerate(reqs) if needs_processing(req)]
    processed = process_logits(logits, processed_rows, [reqs[i] for i in processed_rows], mask, eos_token_ids)
    chosen = argmax if processed is logits else torch.argmax(processed, dim=-1)  # [B]
    random = [i for i, req in enumerate(reqs) if not req.sampling.is_greedy]
    if random:  # all random rows at once: one batched distribution, one uniform draw per request
        rreqs = [reqs[i] for i in random]
        index = to_device(random, torch.long, processed.device)
        probs = target_probs_batch(processed.index_select(0, index), rreqs)  # [R, V]
        chosen.index_copy_(0, index, inverse_cdf(probs, torch.cat([uniform_draw(r, probs.device) for r in rreqs])))
    return Drawn(chosen, rows, lse, reqs)


def raw_distribution(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 ``logits [B, V]`` -> ``(argmax [B], rows [B, V], lse [B])``: each row's argmax (its first
    index of the largest logit), and rows whose difference with ``lse`` is the raw logprobs: on
    CUDA the logits themselves and their logsumexp, with the argmax from the same Triton pass;
    elsewhere ``log_softmax``'s rows and zeros (the module docstring)."""
    if gpu_ops.available(logits.device):
        from hyla.model.ops.gpu.logits import argmax_logsumexp

        argmax, lse = argmax_logsumexp(logits)
        return argmax, logits, lse
    return torch.argmax(logits, dim=-1), torch.log_softmax(logits, dim=-1), logits.new_zeros(logits.shape[0])


def raw_logprobs(rows: torch.Tensor, lse: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The raw model logprob of ``tokens [N]``: ``rows [N, V]`` and ``lse [N]`` of
    :func:`raw_distribution` (a logit minus the logsumexp, without writing ``[N, V]`` on CUDA)."""
    return rows.gather(1, tokens.unsqueeze(1)).squeeze(1) - lse


def raw_top_logprobs(row: torch.Tensor, lse: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` most likely tokens of one row ``[V]`` of :func:`raw_distribution` with its ``lse``:
    ``(logprobs [k], ids [k])``."""
    values, ids = row.topk(k)
    return values - lse, ids


def num_top_logprobs(req: Req) -> int:
    """How many top logprobs ``req`` wants per token (0 unless it asked for logprobs)."""
    return req.sampling.top_logprobs_num if req.return_logprob else 0


def top_logprobs(row: torch.Tensor, lse: torch.Tensor, req: Req) -> list[tuple[float, int]]:
    """The ``top_logprobs_num`` most likely ``(logprob, token id)`` of one row ``[V]`` of
    :func:`raw_distribution` with its ``lse`` ([] unless the request asked for them)."""
    k = num_top_logprobs(req)
    if not k:
        return []
    return _pairs(*raw_top_logprobs(row, lse, k))


def _pairs(values: torch.Tensor, ids: torch.Tensor) -> list[tuple[float, int]]:
    """Top logprobs as the outputs carry them: ``(logprob, token id)`` pairs."""
    return list(zip(values.tolist(), ids.tolist()))


def needs_processing(req: Req) -> bool:
    """Whether ``req``'s next-token logits change before the grammar mask (:func:`process_row`): it has
    penalties or a ``logit_bias``, or its output is still short of ``min_new_tokens``. Its row then
    depends on the tokens before it, so such a request gets no drafts (``Scheduler._draft_limit``):
    a draft's row would depend on that draft."""
    p = req.sampling
    return p.changes_logits or len(req.output_ids) < p.min_new_tokens


def process_logits(logits: torch.Tensor, rows: list[int], reqs: list[Req], mask: TokenMask | None,
                   eos_token_ids: Collection[int]) -> torch.Tensor:
    """The logits ``[N, V]`` tokens are chosen from: row ``rows[i]`` (the next-token row of ``reqs[i]``)
    processed (:func:`process_row`), then the grammar ``mask`` over every row. A new tensor (the raw
    logits stay as they are, for logprobs), or ``logits`` itself when there is nothing to do.
    ``min_new_tokens``' ban of the ending ids yields to a grammar that allows nothing else here (it
    must end): banning them would leave no token to choose (:func:`_grammar_needs_an_end`)."""
    if not rows and (mask is None or not mask.rows):
        return logits
    processed = logits.clone()
    masked = {r: i for i, r in enumerate(mask.rows)} if mask is not None else {}
    for row, req in zip(rows, reqs, strict=True):
        i = masked.get(row)
        ban = i is None or not _grammar_needs_an_end(mask.bitmask[i], req, eos_token_ids, logits.shape[-1])
        processed[row] = process_row(processed[row], req, eos_token_ids, ban_ends=ban)
    return apply_token_mask(processed, mask)


def _grammar_needs_an_end(bitmask: torch.Tensor, req: Req, eos_token_ids: Collection[int], vocab: int) -> bool:
    """Whether a grammar's allowed tokens (``bitmask [W]``, one row of a ``TokenMask``, on the host) are
    all ids that end ``req`` while its output is still short of ``min_new_tokens`` (a grammar complete
    here, its stop token ids or EOS the only way on)."""
    if len(req.output_ids) >= req.sampling.min_new_tokens:
        return False
    allowed = unpack_bitmask(bitmask[None], vocab)[0]  # [V] bool
    allowed[[t for t in req.sampling.ending_token_ids(eos_token_ids) if t < vocab]] = False
    return not bool(allowed.any())


def process_row(row: torch.Tensor, req: Req, eos_token_ids: Collection[int], ban_ends: bool = True) -> torch.Tensor:
    """``req``'s next-token logits ``[V]`` as it samples from them (a new tensor), in this order:

    1. penalties: repetition over prompt + output tokens (HF: divides a positive logit, multiplies
       a negative one); frequency and presence over output tokens (OpenAI: minus the penalty times
       the token's count, minus the penalty if it occurs);
    2. ``logit_bias``: each biased token's bias added to its logit (OpenAI; +100 all but forces it);
    3. ``min_new_tokens``: while the output is shorter, every id that would end the request
       (``SamplingParams.ending_token_ids``: its stop token ids, and ``eos_token_ids`` unless
       ``ignore_eos``) is ``-inf``, whatever its bias (ids beyond the row are none of its tokens);
       not with ``ban_ends=False`` (a grammar that must end here: :func:`process_logits`)."""
    p = req.sampling
    row = apply_penalties(row, req) if p.has_penalties else row.clone()
    if p.logit_bias is not None:
        ids = to_device(list(p.logit_bias), torch.long, row.device)
        row.index_add_(0, ids, to_device(list(p.logit_bias.values()), row.dtype, row.device))
    if ban_ends and len(req.output_ids) < p.min_new_tokens:
        vocab = row.shape[-1]
        banned = [t for t in p.ending_token_ids(eos_token_ids) if t < vocab]
        if banned:
            row.index_fill_(0, to_device(banned, torch.long, row.device), float("-inf"))
    return row


def apply_penalties(row: torch.Tensor, req: Req) -> torch.Tensor:
    """Repetition penalty over prompt+output tokens (HF); frequency/presence over output (OpenAI).
    A new tensor. (Part of :func:`process_row`.)"""
    p = req.sampling
    row = row.clone()
    if p.repetition_penalty != 1.0:
        seen = to_device(sorted(set(req.fill_ids)), torch.long, row.device)
        vals = row[seen]
        row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if (p.frequency_penalty or p.presence_penalty) and req.output_ids:
        out = to_device(req.output_ids, torch.long, row.device)
        # counts [V] (a bincount reads its extremes back to the host: on CUDA a stream sync)
        counts = torch.zeros(row.numel(), dtype=row.dtype, device=row.device).index_add_(
            0, out, torch.ones(out.numel(), dtype=row.dtype, device=row.device))
        row = row - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).to(row.dtype)
    # a tiny repetition penalty (1e-40) divides a logit into inf: the largest finite value instead (an
    # inf would make the softmax NaN and every draw the last token)
    return torch.nan_to_num(row, nan=float("-inf"), posinf=torch.finfo(row.dtype).max, neginf=float("-inf"))


def target_probs(row: torch.Tensor, req: Req) -> torch.Tensor:
    """The distribution a random row draws from: temperature, then top-k, top-p and min-p. ``[V]``."""
    return target_probs_batch(row.unsqueeze(0), [req])[0]


def target_probs_batch(rows: torch.Tensor, reqs: list[Req]) -> torch.Tensor:
    """:func:`target_probs` of every row ``[R, V]`` at once, each with its request's parameters."""
    dev = rows.device
    params = [r.sampling for r in reqs]
    rows = rows / to_device([[p.temperature] for p in params], rows.dtype, dev)
    # a logit apply_penalties left at the largest finite value, over a temperature below 1, is inf again:
    # the largest finite value once more (an inf makes the softmax NaN and every draw the last token)
    rows = rows.clamp_(max=torch.finfo(rows.dtype).max)
    top_k = [min(p.top_k, rows.shape[1]) if p.top_k > 0 else 0 for p in params]
    if any(top_k):  # each row's k-th largest logit (rows without top-k keep everything)
        kth = torch.topk(rows, max(top_k), dim=-1).values  # [R, max k]
        ks = to_device([max(k, 1) - 1 for k in top_k], torch.long, dev)
        cut = kth.gather(1, ks[:, None])  # [R, 1]
        cut = cut.masked_fill(to_device([[k == 0] for k in top_k], torch.bool, dev), float("-inf"))
        rows = rows.masked_fill(rows < cut, float("-inf"))
    probs = torch.softmax(rows, dim=-1)  # [R, V]
    top_p = [p.top_p for p in params]
    if any(t < 1.0 for t in top_p):
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p (always at least the top token)
        drop = sorted_probs.cumsum(-1) - sorted_probs >= to_device([[t] for t in top_p], torch.float32, dev)
        drop[:, 0] = False  # (a top_p that rounds to 0 in fp32, 1e-300, would drop the top token too)
        probs = torch.zeros_like(probs).scatter_(1, order, sorted_probs.masked_fill(drop, 0.0))
    min_p = [p.min_p for p in params]
    if any(m > 0.0 for m in min_p):
        floor = to_device([[m] for m in min_p], torch.float32, dev) * probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < floor, 0.0)
    return probs / probs.sum(dim=-1, keepdim=True)


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Row ``i``'s token for the uniform draw ``u[i]`` in ``[0, 1)``: the first token whose cumulative
    probability exceeds ``u[i]`` times the row's mass (never a zero-probability token). ``[R]``."""
    cdf = probs.cumsum(dim=-1)  # [R, V]
    idx = torch.searchsorted(cdf, (u.to(cdf.dtype) * cdf[:, -1]).unsqueeze(-1), right=True).squeeze(-1)
    return idx.clamp_(max=probs.shape[-1] - 1)


def uniform_draw(req: Req, device: torch.device) -> torch.Tensor:
    """``[1]``: one U(0, 1) draw from the request's generator (on its device), moved to ``device``."""
    gen = req.generator
    return torch.rand(1, generator=gen, device=gen.device if gen is not None else "cpu").to(device)


def draw(probs: torch.Tensor, req: Req) -> int:
    """One token from ``probs`` ``[V]`` with the request's generator (as :func:`sample` draws)."""
    return int(inverse_cdf(probs.unsqueeze(0), uniform_draw(req, probs.device))[0])


def uniform(req: Req) -> float:
    """One U(0, 1) draw from the request's generator, as a number (speculative acceptance)."""
    return float(uniform_draw(req, "cpu"))
