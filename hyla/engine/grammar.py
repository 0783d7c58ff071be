"""Structured outputs: a request's output constrained by a JSON schema, a regex or an EBNF grammar.

One idea, four pieces, all on top of llguidance (chosen by measurement: ``benchmarks/grammar.py``,
``docs/benchmarks.md`` "Structured outputs"):

* ``Grammars`` — one per engine: the tokenizer as llguidance sees it, the compiled-grammar cache
  (keyed by ``(kind, source)``, bounded, shared by every thread that submits requests) and, on
  machines with more than 2 CPUs, llguidance's pool that fills a big batch's masks in parallel
  (llguidance releases the GIL either way). ``Grammars.matcher(kind,
  source)`` compiles (or finds) the grammar and returns a fresh per-request ``GrammarMatcher``; a
  grammar that cannot compile raises ``ValueError`` naming the problem, at submission.
* ``GrammarMatcher`` — one request's position in its grammar: ``accept`` each appended token,
  ``terminated`` once nothing but end-of-sequence can follow, ``valid_prefix`` / ``rollback`` for a
  run of speculative tokens.
* ``Grammars.fill`` — the token bitmask (``TokenMask``) of every constrained row of a batch, for the
  next position of each request and, with speculation, for each draft position after it.
* ``apply_token_mask`` — ``-inf`` on the logits of every token a row's grammar forbids.

Contracts:

* Vocabulary: ids are the model's (``vocab_size`` = the LM head's rows). Ids the tokenizer does not
  have (a padded LM head) are always masked; special tokens are never produced by a grammar.
* End of sequence: the engine's EOS ids are allowed exactly where the grammar may end (an
  accepting state); a grammar that can no longer extend (``terminated``) allows EOS only.
* A matcher is used by one thread at a time (the scheduler's, after submission); ``Grammars`` is
  safe to call from any thread.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
import torch

from hyla.cache.transfer import to_device

if TYPE_CHECKING:
    from hyla.tokenizer import Tokenizer

GRAMMAR_KINDS = ("json_schema", "regex", "ebnf")
"""The sampling parameters that constrain an output (SGLang's names); a request sets at most one."""

DEFAULT_CACHE_SIZE = 256  # compiled grammars kept (least recently used dropped first)

JSON_DEFAULTS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""How a JSON schema's output is laid out unless the schema says otherwise: ``{"a": 1, "b": [2, 3]}``
(Python's ``json.dumps`` layout, xgrammar's without ``any_whitespace``). Free whitespace lets a
model pad forever between tokens; a schema can still ask for it with llguidance's
``"x-guidance": {"whitespace_flexible": true}``."""


class GrammarMatcher:
    """One request's grammar state. Wraps an ``llguidance.LLMatcher``, which never raises for a
    grammar-level problem but enters an error state; ``accept`` reports it as ``False``."""

    def __init__(self, matcher: Any, kind: str):
        self._m = matcher
        self.kind = kind

    def accept(self, token: int) -> bool:
        """Advance past ``token``. False if the grammar forbids it (the matcher is then in an error
        state for good: ``error`` says why, and only EOS is allowed from then on)."""
        return bool(self._m.consume_token(token))

    @property
    def terminated(self) -> bool:
        """Nothing but end-of-sequence can follow (the output is complete), or in an error state."""
        return bool(self._m.is_stopped())

    @property
    def error(self) -> str:
        return self._m.get_error()

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many leading ``tokens`` the grammar accepts from here (the state is unchanged)."""
        return int(self._m.validate_tokens(list(tokens))) if tokens else 0

    def rollback(self, n: int) -> None:
        """Undo the last ``n`` accepted tokens."""
        if n and not self._m.rollback(n):
            raise ValueError(f"cannot roll the grammar back by {n} tokens: {self._m.get_error()}")


@dataclass
class TokenMask:
    """Allowed tokens of some logits rows: ``bitmask[i]`` (bit ``t % 32`` of int32 word ``t // 32``
    set = token ``t`` allowed) constrains logits row ``rows[i]``; rows not listed are free."""

    rows: list[int]
    bitmask: torch.Tensor  # [len(rows), ceil(vocab / 32)] int32, CPU


class Grammars:
    """The engine's grammar backend: tokenizer, compiled-grammar cache, batch mask filler."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: Sequence[int],
                 cache_size: int = DEFAULT_CACHE_SIZE, num_threads: int | None = None, min_parallel: int = 8):
        """``vocab_size``: the LM head's rows (masks cover them all); ``eos_token_ids``: the ids that
        end a request, allowed where the grammar may end. Masks of a batch with at least
        ``min_parallel`` constrained requests are filled by a pool of ``num_threads`` threads
        (default: half the CPUs up to 8; none on a machine with 2 CPUs or fewer), smaller ones — or
        all, with ``num_threads=0`` — on the calling thread (``benchmarks/grammar.py``: waking a
        pool thread costs more than it saves on few cores or few rows)."""
        import llguidance

        self._llg = llguidance
        self.vocab_size = vocab_size
        n_vocab = max(vocab_size, tokenizer.vocab_size)
        self.tokenizer = llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=n_vocab,
                                                eos_token=list(eos_token_ids))
        self.words = (n_vocab + 31) // 32  # int32 words per bitmask row
        if num_threads is None:
            num_threads = min(8, (os.cpu_count() or 1) // 2) if (os.cpu_count() or 1) > 2 else 0
        self.executor = llguidance.LLExecutor(num_threads=num_threads) if num_threads > 0 else None
        self.min_parallel = min_parallel
        self.cache_size = cache_size
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()  # (kind, source) -> pristine LLMatcher
        self._lock = threading.Lock()

    @property
    def num_cached(self) -> int:
        """Compiled grammars in the cache."""
        return len(self._cache)

    # --- compile ---------------------------------------------------------------------------------
    def matcher(self, kind: str, source: str) -> GrammarMatcher:
        """A fresh matcher at the start of the grammar ``source`` (``kind`` in ``GRAMMAR_KINDS``;
        a JSON schema as JSON text). Raises ``ValueError`` naming the problem if it cannot compile."""
        key = (kind, source)
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
        if compiled is None:
            compiled = self._compile(kind, source)  # outside the lock: llguidance releases the GIL
            with self._lock:
                self._cache[key] = compiled
                self._cache.move_to_end(key)
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
        return GrammarMatcher(compiled.deep_copy(), kind)

    def _compile(self, kind: str, source: str) -> Any:
        llg = self._llg
        try:
            if kind == "json_schema":
                grammar = llg.LLMatcher.grammar_from_json_schema(source, defaults=JSON_DEFAULTS)
            elif kind == "regex":
                grammar = llg.LLMatcher.grammar_from_regex(source)
            elif kind == "ebnf":
                grammar = llg.grammar_from("ebnf", source)  # GBNF (``root ::= ...``, SGLang's) or Lark
            else:
                raise ValueError(f"unknown grammar kind {kind!r}; expected one of {GRAMMAR_KINDS}")
        except ValueError as e:
            raise ValueError(f"{kind} cannot be compiled: {e}") from None
        matcher = llg.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"{kind} cannot be compiled: {_first_lines(matcher.get_error())}")
        return matcher

    # --- masks -----------------------------------------------------------------------------------
    def fill(self, matchers: Sequence[GrammarMatcher | None], drafts: Sequence[Sequence[int]] | None = None,
             ) -> TokenMask | None:
        """The masks of a batch whose row ``i`` belongs to ``matchers[i]`` (``None``: unconstrained),
        or ``None`` when no row is constrained. With ``drafts`` (speculative verify), request ``i``
        owns ``1 + len(drafts[i])`` consecutive logits rows — its next position, then one after each
        draft token — and each gets the mask of that position (a position after a draft the grammar
        refuses keeps the last valid position's mask; acceptance never reaches it). Matcher states
        are unchanged."""
        lens = [1 + len(d) for d in drafts] if drafts is not None else [1] * len(matchers)
        starts = np.cumsum([0] + lens[:-1]).tolist()
        rows = [s + j for m, s, n in zip(matchers, starts, lens) if m is not None for j in range(n)]
        if not rows:
            return None
        bitmask = torch.zeros((len(rows), self.words), dtype=torch.int32)
        ptr, row_bytes = bitmask.data_ptr(), self.words * 4
        jobs, k = [], 0  # (matcher, its first mask row, its drafts)
        for i, (m, n) in enumerate(zip(matchers, lens)):
            if m is not None:
                jobs.append((m._m, k, list(drafts[i]) if drafts is not None else []))
                k += n
        if self.executor is not None and len(jobs) >= self.min_parallel:
            plain = [(m, r) for m, r, d in jobs if not d]
            if plain:
                self.executor.unsafe_compute_mask_ptr(plain, ptr, row_bytes, len(rows))
            spec = [job for job in jobs if job[2]]
            if spec:
                self.executor.unsafe_compute_mask_ptr_with_draft_token(spec, ptr, row_bytes, len(rows))
        else:  # on this thread: no hand-off to a pool thread that must first be woken up
            for m, r, d in jobs:
                m.unsafe_compute_mask_ptr(ptr + r * row_bytes, row_bytes)
                ok = m.validate_tokens(d) if d else 0
                for j in range(ok):
                    m.consume_token(d[j])
                    m.unsafe_compute_mask_ptr(ptr + (r + j + 1) * row_bytes, row_bytes)
                if ok:
                    m.rollback(ok)
        _carry_forward(bitmask, [(r, len(d)) for _, r, d in jobs if d])
        return TokenMask(rows, bitmask)


def apply_token_mask(logits: torch.Tensor, mask: TokenMask | None) -> torch.Tensor:
    """Set the logits of forbidden tokens to ``-inf`` in place (``logits``: ``[N, V]``, any
    device); returns ``logits``. Columns past the mask's width are forbidden."""
    if mask is None or not mask.rows:
        return logits
    vocab = logits.shape[-1]
    allowed = unpack_bitmask(mask.bitmask, vocab, logits.device)  # [R, V] bool
    idx = to_device(mask.rows, torch.long, logits.device)
    logits[idx] = logits[idx].masked_fill(~allowed, float("-inf"))
    return logits


def unpack_bitmask(bitmask: torch.Tensor, vocab: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """``[R, W]`` int32 bitmask → ``[R, vocab]`` bool (columns past ``32 W`` False)."""
    rows, words = bitmask.shape
    if torch.device(device).type == "cpu" and sys.byteorder == "little":
        bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")  # [R, 32 W]
        allowed = torch.from_numpy(bits[:, :vocab]).bool()
    else:
        shifts = torch.arange(32, dtype=torch.int32, device=device)
        allowed = ((to_device(bitmask, torch.int32, device).unsqueeze(-1) >> shifts) & 1).bool().reshape(
            rows, words * 32)[:, :vocab]
    if allowed.shape[1] < vocab:
        allowed = torch.cat([allowed, allowed.new_zeros(rows, vocab - allowed.shape[1])], dim=1)
    return allowed


def grammar_source(kind: str, value: Any) -> str:
    """The canonical text of a grammar parameter (the compile cache's key). A JSON schema may be
    an object or JSON text (re-serialized compactly, key order kept: it orders the output's
    fields); regex and ebnf are non-empty strings. Raises ``ValueError`` naming the parameter."""
    if kind == "json_schema":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"json_schema is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"json_schema must be a JSON object (or its text), got {type(value).__name__}")
        try:
            return json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise ValueError(f"json_schema is not JSON: {e}") from None
    if kind not in GRAMMAR_KINDS:
        raise ValueError(f"unknown grammar kind {kind!r}; expected one of {GRAMMAR_KINDS}")
    if not isinstance(value, str) or not value:
        raise ValueError(f"{kind} must be a non-empty string, got {value!r}")
    return value


def _carry_forward(bitmask: torch.Tensor, runs: list[tuple[int, int]]) -> None:
    """llguidance leaves the rows after a refused draft unwritten (zeros here): give them the mask
    of the last written row, so that every row allows at least EOS."""
    for start, n in runs:
        for r in range(start + 1, start + 1 + n):
            if not bool(bitmask[r].any()):
                bitmask[r] = bitmask[r - 1]


def _first_lines(text: str, n: int = 6) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return "\n".join(lines[:n])
