"""After the forward: sample, detokenize, check stop conditions, hand output to consumers.

Runs on the scheduler thread, which alone writes a request's output fields. Consumers never read
a ``Req`` concurrently: each gets *chunks* built here, once —

    {"text": new text, "output_ids": new ids,
     "meta_info": {"id", "prompt_tokens", "completion_tokens", "cached_tokens", "finish_reason",
                   ["output_token_logprobs", "output_top_logprobs"] of the new ids only}}

A streaming request (``req.stream``) gets one chunk per step that produced something visible, and
a last one with the ``finish_reason``; text that may still turn into a stop string is held back
until it cannot (none with ``include_stop_str_in_output``, vLLM's: the text keeps a matched stop
string, cut at its end, and a stop token's text). Any other request gets one chunk when it
finishes, holding its whole output; if it has no stop strings (and no grammar) its text is only
made then, in one detokenizer step over all its tokens, not one step per token on every decode
step (~25 µs a request a step on a CPU).

``min_new_tokens``: before a request has that many output tokens, nothing but its length limits
ends it — the sampler keeps it from sampling the ids that would (``SamplingParams.ending_token_ids``:
its stop token ids, and ``eos_token_ids`` unless ``ignore_eos``), and its stop strings are not
looked for. A complete grammar (below) still ends it.

Structured outputs (``req.grammar``): the grammar's token mask constrains sampling (``grammar_masks``
fills it for the batch), every appended token advances the grammar, and a request whose grammar is
complete (nothing but EOS could follow) finishes at once with ``{"type": "stop", "matched": <its last
token id>}`` — before ``max_new_tokens`` is looked at, so a complete output is never a ``length``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch

from hyla.engine.grammar import Grammars, TokenMask
from hyla.engine.request import Req, ReqStatus, abort_reason
from hyla.engine.sampler import Drawn, draw_batch, raw_distribution, raw_logprobs, top_logprobs

logger = logging.getLogger("hyla.engine")


def internal_error(exc: Exception) -> str:
    """The abort message of a request that an error inside the engine ended."""
    return f"internal error: {type(exc).__name__}: {exc}"


@dataclass
class Draw:
    """One step's tokens drawn on the device (``OutputProcessor.draw``), awaiting ``complete``."""

    reqs: list[Req]  # the requests sampled, in row order of ``drawn``
    drawn: Drawn | None  # None: no request had a token to sample
    finished: list[Req]  # requests finished without sampling (max_new_tokens == 0)

    @property
    def tokens(self) -> torch.Tensor:
        """The drawn tokens on the device, one per request of ``reqs``, in their order."""
        return self.drawn.chosen


class OutputProcessor:
    def __init__(self, eos_token_ids: Iterable[int], max_context_len: int,
                 make_detokenizer: Callable[[Req], Any] | None = None, grammars: Grammars | None = None) -> None:
        self.eos_token_ids = set(eos_token_ids)
        self.max_context_len = max_context_len
        # callable(req) -> an incremental detokenizer (.step(id) -> str, .flush() -> str), or None
        # for a model without a tokenizer
        self.make_detokenizer = make_detokenizer
        self.grammars = grammars  # None: no request can carry a grammar (a model without a tokenizer)
        self.num_generated_tokens = 0
        self.num_requests_finished = 0

    def process(self, reqs: list[Req], logits: torch.Tensor) -> tuple[list[Req], list[Req]]:
        """Sample the next token of each request from its logits row ``[B, V]``, append it, and
        tell streams. Returns the requests that are finished now (``finished_reason`` set, not yet
        delivered: the scheduler releases their memory first) and those whose consumer failed."""
        return self.complete(self.draw(reqs, logits))

    def draw(self, reqs: list[Req], logits: torch.Tensor) -> "Draw":
        """:meth:`process` up to the host read: the tokens drawn on the device (``Draw.tokens``, one
        per request that samples; one with nothing to sample is finished here and has no row)."""
        finished: list[Req] = []
        to_sample = []
        for i, r in enumerate(reqs):
            if len(r.output_ids) < r.sampling.max_new_tokens:
                to_sample.append(i)
            else:  # max_new_tokens == 0: prefill only
                self.set_finished(r, {"type": "length", "length": r.sampling.max_new_tokens})
                finished.append(r)
        sreqs = [reqs[i] for i in to_sample]
        rows = logits if len(to_sample) == len(reqs) else logits[to_sample]
        drawn = draw_batch(rows, sreqs, self.grammar_masks(sreqs), self.eos_token_ids) if sreqs else None
        return Draw(sreqs, drawn, finished)

    def complete(self, draw: "Draw") -> tuple[list[Req], list[Req]]:
        """Read a :meth:`draw`'s tokens, append them and tell streams (:meth:`process`'s return)."""
        finished, failed = list(draw.finished), []
        if draw.drawn is None:
            return finished, failed
        sreqs = draw.reqs
        out = draw.drawn.collect()
        for r, tok, lp, top in zip(sreqs, out.token_ids, out.logprobs, out.top_logprobs):
            try:
                self.append(r, [tok], [lp], [top])
            except Exception as exc:  # its own host work (its text, its grammar) failed: it alone is aborted
                logger.exception("request %s failed on its new token; aborting it", r.rid)
                self.fail(r, exc)
            if r.finished:
                finished.append(r)
            elif r.stream and not self.deliver(r):
                failed.append(r)
        return finished, failed

    def record_prompt_logprobs(self, req: Req, logits: torch.Tensor) -> None:
        """Prompt logprobs from consecutive logits rows ``[N, V]``: row ``j`` is the position before
        the next prompt token still missing one (``req.prompt_logits_from + j``), and gives its
        logprob (raw model distribution, as output logprobs) and, if asked, its top logprobs."""
        first = req.logprob_start_len + len(req.input_logprobs)  # the token row 0 predicts
        targets = torch.tensor(req.input_ids[first:first + logits.shape[0]], dtype=torch.long, device=logits.device)
        _, rows, lse = raw_distribution(logits[:targets.numel()].float())  # [N, V], [N]
        req.input_logprobs.extend(raw_logprobs(rows, lse, targets).tolist())
        req.input_top_logprobs.extend(top_logprobs(row, row_lse, req) for row, row_lse in zip(rows, lse))

    def grammar_masks(self, reqs: list[Req], drafts: bool = False) -> TokenMask | None:
        """The token masks of ``reqs``' constrained rows (``None`` if none has a grammar): one row
        per request, or with ``drafts`` (a verify step) ``1 + len(req.draft_ids)`` rows each."""
        if self.grammars is None or all(r.grammar is None for r in reqs):
            return None
        return self.grammars.fill([r.grammar for r in reqs], [r.draft_ids for r in reqs] if drafts else None)

    def append(self, req: Req, tokens: list[int], logprobs: list[float],
               top_logprobs: list[list[tuple[float, int]]]) -> int:
        """Append ``tokens`` (one sampled token, or a speculative step's accepted run) one at a
        time, stopping at the first that finishes ``req``. Returns how many were appended."""
        for i, tok in enumerate(tokens):
            req.output_ids.append(tok)
            if req.return_logprob:
                req.output_logprobs.append(logprobs[i])
                req.output_top_logprobs.append(top_logprobs[i])
            self.num_generated_tokens += 1
            if req.grammar is not None and not req.grammar.accept(tok):
                # only if the mask was bypassed: never silently return output the grammar refuses
                self.set_finished(req, abort_reason(f"grammar: {req.grammar.error}", "grammar"))
                return i + 1
            # a stop token whose text is left out never reaches the detokenizer: the text held back
            # before it (an unfinished character) is then flushed as the end of the output
            stop_token = self._is_stop_token(req)
            per_token = self._text_per_token(req) and (req.sampling.include_stop_str_in_output or not stop_token)
            reason = self._check_finished(req, self._detokenize(req, tok) if per_token else req.text, stop_token)
            if reason is not None:
                self.set_finished(req, reason)
                return i + 1
        return len(tokens)

    def set_finished(self, req: Req, reason: dict[str, Any]) -> None:
        """Finish ``req`` with ``reason``, its text completed. If the text raises, ``req`` is finished
        all the same, aborted with that error (and the error raised: the step fails)."""
        req.finished_reason = reason
        try:
            matched = reason.get("matched")
            if not isinstance(matched, str):  # (a stop string's match cut the text already)
                # a stop token's own text is left out (unless include_stop_str_in_output), as
                # _check_finished leaves it out token by token
                self._catch_up_text(req, stop_token=isinstance(matched, int)
                                    and not req.sampling.include_stop_str_in_output)
                if req.detokenizer is not None:
                    req.text += req.detokenizer.flush()  # what was held back for an unfinished character
        except Exception as exc:
            req.finished_reason = abort_reason(internal_error(exc), "internal")
            raise
        finally:
            req.status = ReqStatus.FINISHED
            self.num_requests_finished += 1

    def fail(self, req: Req, exc: Exception) -> None:
        """Finish ``req`` as aborted by ``exc`` (an error of its own), its text as it is (unless
        :meth:`set_finished` already did, its text failing)."""
        if not req.finished:
            req.finished_reason = abort_reason(internal_error(exc), "internal")
            req.status = ReqStatus.FINISHED
            self.num_requests_finished += 1

    def deliver(self, req: Req) -> bool:
        """Hand ``req``'s new output to its consumer (everything, once it is finished). Returns
        False if the consumer failed (e.g. its asyncio loop is closed): the caller aborts it."""
        if req.on_output is None:
            return True
        done = req.finished
        chunk = self._chunk(req, done) if req.stream else self._final(req)
        if chunk is None:
            return True
        try:
            req.on_output(chunk, done)
        except Exception:
            logger.warning("the consumer of request %s failed", req.rid, exc_info=True)
            return False
        return True

    # ------------------------------------------------------------------------------------------
    @staticmethod
    def _text_per_token(req: Req) -> bool:
        """Whether ``req``'s text must follow each token: a stream sends it, stop strings search
        it. Any other request gets its text once, when it finishes (``_catch_up_text``): one
        detokenizer step over all its tokens instead of one per token on every decode step (the
        text is the same: the detokenizer's chunks add up to the decode of the ids either way)."""
        return req.stream or bool(req.sampling.stop) or req.grammar is not None

    def _catch_up_text(self, req: Req, stop_token: bool = False) -> None:
        """Detokenize the output ids not in ``req.text`` yet (a request whose text waits for its
        end); ``stop_token``: the last one ended the request, and its text is not output."""
        detokenizer = self._detokenizer(req) if req.output_ids else None
        if detokenizer is None:
            return
        pending = req.output_ids[len(detokenizer.output_ids):]
        if not pending:
            return
        if stop_token:
            pending = pending[:-1]  # not detokenized (as token by token): ``flush`` ends the text before it
        if pending:
            req.text += detokenizer.step(pending)

    def _detokenize(self, req: Req, tok: int) -> str:
        """The output text with ``tok`` (not stored yet: ``_check_finished`` cuts stop strings)."""
        detokenizer = self._detokenizer(req)
        return req.text if detokenizer is None else req.text + detokenizer.step(tok)

    def _detokenizer(self, req: Req):
        """``req``'s incremental detokenizer, made on first use (None: the engine has no tokenizer)."""
        if req.detokenizer is None and self.make_detokenizer is not None:
            req.detokenizer = self.make_detokenizer(req)
        return req.detokenizer

    def ends_with_next_token(self, req: Req) -> bool:
        """Whether the next token appended to ``req`` finishes it whatever it is (the length limits
        of :meth:`_check_finished`; the overlap schedule feeds no further token to such a request)."""
        return len(req.output_ids) + 1 >= req.sampling.max_new_tokens or req.num_fill + 1 >= self.max_context_len

    def _is_stop_token(self, req: Req) -> bool:
        """Whether ``req``'s newest token is a stop token that ends it (EOS unless ``ignore_eos``, or
        one of its ``stop_token_ids``, once it has ``min_new_tokens`` output tokens)."""
        p = req.sampling
        return req.output_ids[-1] in p.ending_token_ids(self.eos_token_ids) and len(req.output_ids) >= p.min_new_tokens

    def _check_finished(self, req: Req, text: str, stop_token: bool) -> dict[str, Any] | None:
        """Why ``req`` stops after its newest token, or None. ``text`` is the output text with that
        token; it becomes ``req.text`` here, cut before a stop string (after it, and with a stop
        token's text, with ``include_stop_str_in_output``: vLLM's rule). ``stop_token``: that token
        is a stop token that ends it (``_is_stop_token``).

        Before ``min_new_tokens`` output tokens no stop token and no stop string ends it (vLLM's
        and SGLang's rule; the sampler does not let it sample those tokens then): a stop string
        counts only if it ends in the text of token ``min_new_tokens`` or a later one (it may start
        before)."""
        tok = req.output_ids[-1]
        p = req.sampling
        if stop_token:
            if p.include_stop_str_in_output:
                req.text = text  # the stop token's text too (else ``text`` is ``req.text``: see append)
            return {"type": "stop", "matched": tok}
        if p.stop and req.detokenizer is not None:
            # only the tail can hold a new match: a stop string ending in text checked on earlier
            # tokens (or before the minimum) does not count
            checked, req.num_checked_chars = req.num_checked_chars, len(text)
            if len(req.output_ids) >= p.min_new_tokens:
                hits = [(pos, s) for s in p.stop if (pos := text.find(s, max(0, checked - len(s) + 1))) >= 0]
                if hits:
                    pos, s = min(hits)
                    req.text = text[:pos + len(s)] if p.include_stop_str_in_output else text[:pos]
                    return {"type": "stop", "matched": s}
        req.text = text
        if req.grammar is not None and req.grammar.terminated:
            return {"type": "stop", "matched": tok}
        if len(req.output_ids) >= p.max_new_tokens:
            return {"type": "length", "length": p.max_new_tokens}
        if req.num_fill >= self.max_context_len:
            return {"type": "length", "length": len(req.output_ids)}
        return None

    def _chunk(self, req: Req, done: bool) -> dict[str, Any] | None:
        """What is new since the last chunk; before the end, text that may still become a stop
        string is held back (unless ``include_stop_str_in_output``: a match stays in the text)."""
        text_end = len(req.text)
        if not done and not req.sampling.include_stop_str_in_output:  # (a match is kept: nothing to hold)
            hold = max((len(s) - 1 for s in req.sampling.stop), default=0)
            text_end = max(req.num_sent_chars, text_end - hold)
        start, end = req.num_sent_ids, len(req.output_ids)
        new_text = req.text[req.num_sent_chars:text_end]
        if start == end and not new_text and not done:
            return None
        req.num_sent_ids, req.num_sent_chars = end, text_end
        return {"text": new_text, "output_ids": req.output_ids[start:end], "meta_info": req.meta_info(start, end)}

    @staticmethod
    def _final(req: Req) -> dict[str, Any] | None:
        if not req.finished:
            return None
        return {"text": req.text, "output_ids": list(req.output_ids), "meta_info": req.meta_info()}
