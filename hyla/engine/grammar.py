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

Bad grammars are refused at submission with a ``ValueError``, never by a crash or mid-request:

* Compiling runs on a thread of its own with a 1 GiB stack (``COMPILE_STACK_BYTES``, address space:
  only the pages a compile touches are used, and they go with the thread): llguidance's compilers
  recurse once per link of a ``$ref`` chain (~9 kB of stack a link) or of a chain of Lark rules
  (~3 kB), and overflowing a stack kills the process (SIGSEGV) — an 8 MB stack did at ~930 links of
  a JSON schema and ~2,700 Lark rules. What bounds the depth: llguidance's own JSON-schema limit
  (50,000 schema nodes, "schema too large"; the deepest a schema gets under it needs ~170 MB) and,
  for ``regex`` / ``ebnf``, ``MAX_GRAMMAR_CHARS`` (1 MiB of grammar: at most ~115,000 rules in a
  chain, ~350 MB).
* Each compiled grammar is probed: its first mask, and the mask after one token. A grammar that
  matches nothing, or only the empty output (``[^\\s\\S]``, ``{"$ref": "#"}``, ``root ::= ""``),
  or that exceeds llguidance's parser limits from the start (one alternation of more than
  ``MAX_ITEMS_IN_ROW`` branches: an ``anyOf`` of 3,000 objects) is refused. A limit first met
  deeper in an output (a right-recursive rule repeated 1,000 times, an ``anyOf`` that large nested
  in a property) still ends that request with an abort (``GrammarMatcher.error``, one line).
* JSON-schema integer bounds that llguidance would enforce loosely (it keeps them as 64-bit floats,
  then saturates to 64-bit integers: ``minimum: 1e30`` became 9223372036854775807, ``minimum:
  2**53 + 1`` allowed 2**53) are refused, in an integer's schema or in a subschema it reaches by a
  local ``$ref``; a bound it only tightens (``maximum: 1e30``) is fine.
* GBNF is converted to Lark with llguidance's parser but a linear pass for its terminal rules
  (``llguidance.gbnf_to_lark``'s own is quadratic in a chain of rules, in Python, holding the GIL:
  ~9 s for 2,000 rules, ~150 s for 8,000); the Lark text it makes is the same.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence
from urllib.parse import unquote

import numpy as np
import torch

from hyla.cache.transfer import to_device

if TYPE_CHECKING:
    from hyla.tokenizer import Tokenizer

GRAMMAR_KINDS = ("json_schema", "regex", "ebnf")
"""The sampling parameters that constrain an output (SGLang's names); a request sets at most one."""

MAX_GRAMMAR_AFTER_CHARS = 64  # a grammar_after marker (a reasoning model's "</think>")
MAX_SPACE_AFTER = 8  # whitespace characters between a grammar_after marker and the grammar's answer

DEFAULT_CACHE_SIZE = 256  # compiled grammars kept (least recently used dropped first)

JSON_DEFAULTS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""How a JSON schema's output is laid out unless the schema says otherwise: ``{"a": 1, "b": [2, 3]}``
(Python's ``json.dumps`` layout, xgrammar's without ``any_whitespace``). Free whitespace lets a
model pad forever between tokens; a schema can still ask for it with llguidance's
``"x-guidance": {"whitespace_flexible": true}``."""


COMPILE_STACK_BYTES = 1 << 30
"""The stack of the thread that compiles a grammar (see the module's docstring for the measured
depths; 6x the deepest a JSON schema under llguidance's size limit needs, 3x the deepest a Lark
grammar under ``MAX_GRAMMAR_CHARS`` does)."""

MAX_GRAMMAR_CHARS = 1 << 20
"""The longest ``regex`` / ``ebnf`` accepted (characters). A JSON schema's size is bounded by
llguidance instead (50,000 schema nodes: "schema too large")."""

MAX_ITEMS_IN_ROW = 2_000
"""llguidance's ``max_items_in_row`` (its default, kept): the most Earley items one parser row may
hold. Raising it lets a right-recursive rule (``items ::= "a" ("," items)?``, two items a
repetition) cost more per token for every repetition: at 1,000 repetitions (this limit) a token
costs ~5 ms to consume and ~8 ms to mask on one core, at 5,000 (a limit of 10,000) ~60 ms and
~140 ms, stalling the batch. What exceeds it at once (one alternation of thousands of branches) is
refused at compile time by the probe."""

_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1
_INT_BOUNDS = {"minimum": (True, False), "exclusiveMinimum": (True, True),
               "maximum": (False, False), "exclusiveMaximum": (False, True)}  # key -> (lower, exclusive)
_NOT_SCHEMAS = ("const", "enum", "default", "examples")  # keywords whose values are data, not schemas
_SAME_VALUE = ("allOf", "anyOf", "oneOf", "not", "if", "then", "else")  # subschemas of the schema's own value


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
        return _first_lines(self._m.get_error())

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
        self.eos_token_ids = frozenset(eos_token_ids)
        self.limits = llguidance.LLParserLimits(max_items_in_row=MAX_ITEMS_IN_ROW, verbose_errors=False)
        self.cache_size = cache_size
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()  # (kind, source) -> pristine LLMatcher
        self._lock = threading.Lock()

    @property
    def num_cached(self) -> int:
        """Compiled grammars in the cache."""
        return len(self._cache)

    # --- compile ---------------------------------------------------------------------------------
    def matcher(self, kind: str, source: str, after: str | None = None,
                opener: str | None = None) -> GrammarMatcher:
        """A fresh matcher at the start of the grammar ``source`` (``kind`` in ``GRAMMAR_KINDS``;
        a JSON schema as JSON text); with ``after``, of free text up to the first ``after`` (and
        whitespace) and then ``source``; with ``opener`` too, that free text is optional and opens with
        ``opener`` (``after_text``). Raises ``ValueError`` naming the problem if it cannot compile."""
        key = (kind, source, after, opener)
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
        if compiled is None:
            compiled = self._compile(kind, source, after, opener)  # outside the lock: llguidance releases the GIL
            with self._lock:
                self._cache[key] = compiled
                self._cache.move_to_end(key)
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
        return GrammarMatcher(compiled.deep_copy(), kind)

    def _compile(self, kind: str, source: str, after: str | None = None, opener: str | None = None) -> Any:
        if kind not in GRAMMAR_KINDS:
            raise ValueError(f"unknown grammar kind {kind!r}; expected one of {GRAMMAR_KINDS}")
        if kind != "json_schema" and len(source) > MAX_GRAMMAR_CHARS:
            raise ValueError(f"{kind} cannot be compiled: grammar too large ({len(source)} characters; "
                             f"at most {MAX_GRAMMAR_CHARS})")
        if kind == "json_schema":
            _check_integer_bounds(source)
        return _on_large_stack(self._build, kind, source, after, opener)

    def _build(self, kind: str, source: str, after: str | None = None, opener: str | None = None) -> Any:
        """Compile and probe (on the compile thread: llguidance's compilers recurse)."""
        llg = self._llg
        try:
            if kind == "json_schema":
                grammar = llg.LLMatcher.grammar_from_json_schema(source, defaults=JSON_DEFAULTS)
            elif kind == "regex":
                grammar = llg.LLMatcher.grammar_from_regex(source)
            else:  # GBNF (``root ::= ...``, SGLang's) or Lark
                grammar = llg.LLMatcher.grammar_from_lark(ebnf_to_lark(source))
        except ValueError as e:
            raise ValueError(f"{kind} cannot be compiled: {e}") from None
        if after is not None:
            grammar = after_text(grammar, after, opener)
        matcher = llg.LLMatcher(self.tokenizer, grammar, log_level=0, limits=self.limits)
        if matcher.is_error():
            raise ValueError(f"{kind} cannot be compiled: {_first_lines(matcher.get_error())}")
        self._probe(kind, matcher)
        return matcher

    def _probe(self, kind: str, matcher: Any) -> None:
        """Refuse a grammar whose first mask allows nothing but EOS (it matches nothing, or only the
        empty output) or that llguidance cannot follow past its first token (a parser limit met at
        once: one alternation of thousands of branches). On a copy; the lowest allowed id is the
        probe's first token."""
        m = matcher.deep_copy()
        bitmask = torch.zeros((1, self.words), dtype=torch.int32)
        eos = np.fromiter(self.eos_token_ids, dtype=np.int64)
        for step in range(2):
            m.unsafe_compute_mask_ptr(bitmask.data_ptr(), self.words * 4)
            if m.is_error():
                error = _first_lines(m.get_error())
                if step == 0 and error.startswith("NoExtension"):  # llguidance: no output can start
                    raise ValueError(f"{kind} cannot be compiled: it matches no output")
                raise ValueError(f"{kind} cannot be compiled: too complex ({error})")
            allowed = unpack_bitmask(bitmask, self.words * 32)[0].numpy().nonzero()[0]
            tokens = allowed[~np.isin(allowed, eos)]
            if step == 0 and not len(tokens):
                raise ValueError(f"{kind} cannot be compiled: it matches "
                                 + ("only the empty output" if len(allowed) else "no output"))
            if not len(tokens) or m.is_stopped():
                return
            if not m.consume_token(int(tokens[0])):
                raise ValueError(f"{kind} cannot be compiled: too complex ({_first_lines(m.get_error())})")

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
            except RecursionError:
                raise ValueError("json_schema is nested too deeply") from None
        if not isinstance(value, dict):
            raise ValueError(f"json_schema must be a JSON object (or its text), got {type(value).__name__}")
        try:
            return json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise ValueError(f"json_schema is not JSON: {e}") from None
        except RecursionError:
            raise ValueError("json_schema is nested too deeply") from None
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
    lines = [ln for ln in text.strip().splitlines() if ln.strip() and ln.strip() != "<non-verbose/>"]
    return "\n".join(lines[:n])


_stack_size_lock = threading.Lock()


def _on_large_stack(fn: Any, *args: Any) -> Any:
    """``fn(*args)`` on a new thread with a ``COMPILE_STACK_BYTES`` stack; returns its result or
    raises its exception. ``threading.stack_size`` is process-wide: it is set only while this
    thread starts (under a lock) and restored at once; a thread another library starts meanwhile
    gets the large stack too, which costs it address space only."""
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["value"] = fn(*args)
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            result["error"] = e

    with _stack_size_lock:
        previous = threading.stack_size(COMPILE_STACK_BYTES)
        try:
            thread = threading.Thread(target=run, name="hyla-grammar-compile", daemon=True)
            thread.start()
        finally:
            threading.stack_size(previous)
    thread.join()
    if "error" in result:
        raise result.pop("error")
    return result["value"]


def _check_integer_bounds(source: str) -> None:
    """Refuse an integer bound (``minimum`` etc. that applies to an integer) that llguidance would
    enforce loosely. It reads a bound as a 64-bit float, rounds it to an integer (``x + 1`` for an
    exclusive one) and saturates it to 64 bits: ``minimum: 1e30`` became 2**63 - 1 (below the
    bound), ``minimum: 2**53 + 1`` became 2**53. A bound this makes tighter (``maximum: 1e30``) is
    fine: every output still satisfies it. A bound applies to an integer in a schema of ``"type":
    "integer"`` (or a list with it), and in the subschemas that constrain the same value
    (``allOf``, ``anyOf``, ``oneOf``, ``not``, ``if``/``then``/``else``, and the target of a local
    ``$ref``: ``#`` or a JSON pointer ``#/...`` into, as llguidance resolves it, the nearest
    enclosing schema with an ``$id``, else the root) of such a schema or beside one in an
    ``allOf``. A schema whose local ``$ref`` chain reaches a schema typed integer is an integer's
    too (``{"$ref": "#/$defs/int", "minimum": ...}``). Other ``$ref``s are left to llguidance.
    Walks the schema without recursion, each subschema at most once as an integer's and once not
    (``$ref`` cycles end), and each ``$ref`` chain once (:func:`_refers_to_integer`)."""
    try:
        schema = json.loads(source)
    except (ValueError, RecursionError):
        return  # llguidance names the problem
    # (node, its JSON pointer, an integer's, (the schema its local $refs point into, its pointer))
    todo: list[tuple[Any, str, bool, tuple[Any, str]]] = [(schema, "#", False, (schema, "#"))]
    walked: set[tuple[int, bool]] = set()  # (id(schema object), an integer's): a $ref reaches one again
    refers: dict[int, bool] = {}  # id(schema object) -> whether its $ref chain reaches an integer's type
    while todo:
        node, path, integer, base = todo.pop()
        if isinstance(node, list):
            todo.extend((v, f"{path}/{i}", False, base) for i, v in enumerate(node) if isinstance(v, (dict, list)))
            continue
        if not isinstance(node, dict):
            continue
        if isinstance(node.get("$id"), str):
            base = (node, path)
        typed = lambda s: _typed_integer(s) or _refers_to_integer(s, base[0], refers)  # noqa: E731
        integer = integer or typed(node) or (
            isinstance(node.get("allOf"), list) and any(isinstance(s, dict) and typed(s) for s in node["allOf"]))
        if (id(node), integer) in walked:
            continue
        walked.add((id(node), integer))
        if integer:
            target = _local_ref(base[0], node.get("$ref"))
            if target is not None:
                todo.append((target[0], base[1] + target[1], True, base))
        for k, v in node.items():
            if k in _NOT_SCHEMAS or not isinstance(v, (dict, list)):
                continue
            where = f"{path}/{k.replace('~', '~0').replace('/', '~1')}"
            if k in _SAME_VALUE and isinstance(v, list):
                todo.extend((s, f"{where}/{i}", integer, base) for i, s in enumerate(v))
            else:
                todo.append((v, where, integer and k in _SAME_VALUE, base))
        if not integer:
            continue
        for key, (lower, exclusive) in _INT_BOUNDS.items():
            bound = node.get(key)
            if isinstance(bound, bool) or not isinstance(bound, (int, float)):
                continue
            if not exclusive:  # draft 4: "exclusiveMinimum": true makes "minimum" exclusive
                exclusive = node.get("exclusive" + key.capitalize()) is True
            if _loosened(bound, lower, exclusive):
                raise ValueError(f"json_schema cannot be compiled: the integer bound {key} {bound} at "
                                 f"{path} cannot be enforced exactly (llguidance keeps integer bounds "
                                 f"as 64-bit numbers)")


def _local_ref(resource: Any, ref: Any) -> tuple[dict, str] | None:
    """The subschema of ``resource`` that a local JSON-pointer ``$ref`` names, and its pointer
    (``""`` for ``#``, ``resource`` itself): the URI fragment percent-decoded, then each part
    unescaped (``#/$defs/a~1b`` is the ``$defs`` entry ``a/b``; ``~1`` is ``/``, ``~0`` is ``~``).
    ``None`` for any other ``ref`` (another document, an anchor) or a pointer to no object."""
    if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
        return None
    pointer = unquote(ref[1:])
    node = resource
    for part in pointer.split("/")[1:]:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isascii() and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return (node, pointer) if isinstance(node, dict) else None


def _refers_to_integer(node: dict, resource: Any, memo: dict[int, bool]) -> bool:
    """Whether ``node``'s chain of local ``$ref``s (resolved in ``resource``, or in a target's own
    ``$id`` schema from there on) reaches a schema typed integer. Each schema of a chain is
    memoized in ``memo`` (by ``id``), so walking every schema of a long chain stays linear; a
    cycle without an integer is False."""
    chain: set[int] = set()
    result = False
    while True:
        key = id(node)
        if key in memo:
            result = memo[key]
            break
        if key in chain:  # a cycle: no schema on it is typed integer
            break
        chain.add(key)
        target = _local_ref(resource, node.get("$ref"))
        if target is None:
            break
        node = target[0]
        if isinstance(node.get("$id"), str):
            resource = node
        if _typed_integer(node):
            result = True
            break
    for key in chain:
        memo[key] = result
    return result


def _typed_integer(node: dict) -> bool:
    """A schema whose ``type`` is ``"integer"`` or a list with it."""
    kind = node.get("type")
    return kind == "integer" or (isinstance(kind, list) and "integer" in kind)


def _loosened(bound: float, lower: bool, exclusive: bool) -> bool:
    """llguidance's integer bound (``normalize_integer_bounds``) lets through a value ``bound``
    excludes."""
    try:
        f = float(bound)
    except OverflowError:
        return False  # beyond any float: llguidance refuses the schema itself
    if lower:
        rounded = f + 1.0 if exclusive and f.is_integer() else math.ceil(f)
    else:
        rounded = f - 1.0 if exclusive and f.is_integer() else math.floor(f)
    enforced = min(max(int(rounded), _INT64_MIN), _INT64_MAX)  # Rust's saturating `as i64`
    if lower:
        return enforced <= bound if exclusive else enforced < bound
    return enforced >= bound if exclusive else enforced > bound


def after_text(grammar: str, after: str, opener: str | None = None) -> str:
    """llguidance's ``grammar`` (its JSON, or Lark text) preceded by free text up to the first ``after``
    (included) and any whitespace: the grammar then starts. A reasoning model thinks up to ``</think>``,
    then answers in the grammar. With ``opener`` that text is optional, and is whitespace, ``opener`` and
    anything up to ``after``: a model that opens its own ``<think>`` block may think first, or answer at
    once. The text before is a lazy lexeme (it ends at the first ``after``), and ``grammar`` a nested
    grammar (``@name``), so a grammar of any kind composes."""
    top = json.loads(grammar) if grammar.lstrip().startswith("{") else {"grammars": [{"lark_grammar": grammar}]}
    inner = [dict(g) for g in top["grammars"]]
    name = inner[0].setdefault("name", "answer")
    if opener is None:
        before = f"start: before SPACE @{name}\nbefore[lazy]: TEXT {json.dumps(after)}\n"
    else:
        before = f"start: (before SPACE)? @{name}\nbefore[lazy]: SPACE {json.dumps(opener)} TEXT {json.dumps(after)}\n"
    space = f"/[ \\t\\r\\n]{{0,{MAX_SPACE_AFTER}}}/"  # bounded: a model must not loop on whitespace there
    wrapper = f"%llguidance {{}}\n{before}TEXT: /(.|\\n)*/\nSPACE: {space}\n"
    return json.dumps({**top, "grammars": [{"lark_grammar": wrapper}, *inner]})


def ebnf_to_lark(text: str) -> str:
    """An ``ebnf`` grammar as Lark: Lark text is returned as is; GBNF is converted as
    ``llguidance.gbnf_to_lark`` does (its parser and syntax tree, the same Lark out), except that
    the rules that are terminals are found in one pass over the references (a worklist) where
    llguidance re-scans every rule until nothing changes — once per link of a chain of rules,
    quadratic. Raises ``ValueError`` as ``llguidance.grammar_from`` does."""
    from llguidance import gbnf_to_lark as g2l

    if g2l.is_lark_syntax(text):
        return text
    if not all(hasattr(g2l, name) for name in ("GrammarParser", "RuleRefNode")):  # another llguidance: its own
        try:
            return g2l.any_to_lark(text)
        except Exception as e:  # noqa: BLE001 - as llguidance.grammar_from
            raise ValueError(f"Failed to convert the grammar from GBNF to Lark: {e}") from None
    try:
        rules = g2l.GrammarParser().parse(text)
        _resolve_gbnf(rules, g2l.RuleRefNode)
        out = ["%llguidance {}\n\n"]
        prev_nl = True
        for rule in sorted(rules.values(), key=lambda r: r.order):
            line = str(rule)
            if not prev_nl and "\n" in line:
                out.append("\n")
            out.append(line + "\n")
            prev_nl = "\n" in line
            if prev_nl:
                out.append("\n")
        return "".join(out)
    except Exception as e:  # noqa: BLE001 - as llguidance.grammar_from (RecursionError included)
        raise ValueError(f"Failed to convert the grammar from GBNF to Lark: {e}") from None


def _resolve_gbnf(rules: dict[str, Any], rule_ref: type) -> None:
    """``llguidance.gbnf_to_lark.resolve`` with a linear terminal-rule pass (same result: a rule
    other than ``start`` is a terminal when every rule it refers to is one)."""
    def rename(rule: Any, name: str) -> None:
        if name in rules:
            raise Exception(f"Rule '{name}' already exists")
        del rules[rule.name]
        rule.name = name
        rules[name] = rule

    for i, rule in enumerate(rules.values()):
        rule.order = i
        rule.alternatives = rule.alternatives.simplify()
    refers: dict[int, set[int]] = {}  # id(rule) -> ids of the rules it refers to
    users: dict[int, list[Any]] = {}  # id(rule) -> the rules that refer to it
    for rule in rules.values():
        targets: set[int] = set()
        todo = list(reversed(rule.children()))
        while todo:  # depth first, in order (llguidance's order: the first missing rule is named)
            node = todo.pop()
            todo.extend(reversed(node.children()))
            if isinstance(node, rule_ref):
                if node.name not in rules:
                    raise Exception(f"Rule '{node.name}' not found")
                node.target = rules[node.name]
                if id(node.target) not in targets:
                    targets.add(id(node.target))
                    users.setdefault(id(node.target), []).append(rule)
        refers[id(rule)] = targets
    if "root" not in rules:
        raise Exception("No 'root' rule found")
    rename(rules["root"], "start")

    pending = {key: len(targets) for key, targets in refers.items()}
    ready = [rule for rule in rules.values() if not pending[id(rule)] and rule.name != "start"]
    while ready:
        rule = ready.pop()
        rule.rule_is_terminal = True
        for user in users.get(id(rule), ()):
            pending[id(user)] -= 1
            if not pending[id(user)] and user.name != "start":
                ready.append(user)

    for rule in list(rules.values()):
        name = re.sub(r"([a-z])([A-Z])", r"\1_\2", rule.name.replace("-", "_")).lower()
        name = name.upper() if rule.rule_is_terminal else name
        if rule.name != name:
            rename(rule, name)
