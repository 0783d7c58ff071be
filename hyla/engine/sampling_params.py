"""Per-request sampling parameters, validated once on construction (SGLang/vLLM names)."""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field, fields
from typing import Any, Collection

from hyla.engine.errors import RequestError
from hyla.engine.grammar import GRAMMAR_KINDS, MAX_GRAMMAR_AFTER_CHARS, grammar_source

# A temperature below this samples greedily (vLLM's and SGLang's rule): dividing the logits by it
# would overflow them (1e-45 is 0 in fp32: every probability NaN)
GREEDY_TEMPERATURE = 1e-5

# A logit bias is at most this much either way (OpenAI's range): +100 all but forces a token, -100
# all but bans it
MAX_LOGIT_BIAS = 100.0


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0 = disabled
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # HF semantics: divides positive / multiplies negative logits of seen tokens
    frequency_penalty: float = 0.0  # OpenAI semantics: - penalty * count(token in output)
    presence_penalty: float = 0.0  # OpenAI semantics: - penalty * [token in output]
    # OpenAI's: token id -> a number in [-100, 100] added to its logit (keys ints or decimal strings,
    # as JSON sends them; stored as ints, an empty dict as None)
    logit_bias: dict[int, float] | None = None
    # SGLang's (vLLM's min_tokens): before this many output tokens nothing ends the request but its
    # length limits (or a complete grammar) — no EOS or stop token id is sampled, no stop string counts
    min_new_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    # vLLM's: the text that ended the request stays in it — a matched stop string (the text is cut at its
    # end instead of its start, and a stream holds nothing back for it), and the text of a stop token
    # (EOS or a stop token id; a special token's is "" with skip_special_tokens)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    seed: int | None = None
    skip_special_tokens: bool = True
    top_logprobs_num: int = 0
    # structured outputs (SGLang's names; at most one): the output must match this grammar
    json_schema: str | dict | None = None  # a JSON schema, as an object or as JSON text
    regex: str | None = None
    ebnf: str | None = None  # GBNF (``root ::= ...``) or Lark
    # the grammar starts after this text first appears in the output, free text before it: a reasoning
    # model's "</think>", so that it thinks, then answers as the grammar says (SGLang's and vLLM's
    # reasoning-aware structured outputs); None: from the first token
    grammar_after: str | None = None
    # with grammar_after: the text before it is optional, and opens with this (after whitespace): a model
    # that writes its own "<think>" thinks first, or answers at once, in the grammar either way
    grammar_after_open: str | None = None
    # set from the three above: (kind, canonical text) — a JSON schema object becomes compact JSON
    # text, the key of the engine's compile cache
    grammar: tuple[str, str] | None = field(default=None, init=False, repr=False, compare=False)
    # set from the fields above: penalties or a logit bias, which change every logits row of the
    # request (sampler.needs_processing reads it for every request of every step: one attribute read,
    # not the comparisons of has_penalties)
    changes_logits: bool = field(default=False, init=False, repr=False, compare=False)

    @classmethod
    def from_dict(cls, params: dict[str, Any] | "SamplingParams" | None) -> "SamplingParams":
        if params is None:
            return cls()
        if isinstance(params, SamplingParams):  # checked again (a field may have been set since), as a copy
            return dataclasses.replace(params)
        if not isinstance(params, dict):
            raise RequestError(f"sampling_params must be a dict or SamplingParams, got {type(params).__name__}",
                               "sampling_params")
        unknown = sorted(set(params) - SAMPLING_FIELDS, key=str)
        if unknown:
            raise RequestError(f"unknown sampling parameter(s) {unknown}; known: {sorted(SAMPLING_FIELDS)}",
                               "sampling_params")
        return cls(**params)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = _check_list("stop", self.stop)
        self.stop_token_ids = _check_list("stop_token_ids", self.stop_token_ids)
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise RequestError(f"{name} must be a bool, got {getattr(self, name)!r}", name)
        _check_int("max_new_tokens", self.max_new_tokens, lo=0)
        _check_int("min_new_tokens", self.min_new_tokens, lo=0)
        if self.min_new_tokens > self.max_new_tokens:
            raise RequestError(f"min_new_tokens ({self.min_new_tokens}) must be at most max_new_tokens "
                               f"({self.max_new_tokens})", "min_new_tokens")
        self.temperature = _check_num("temperature", self.temperature, lo=0.0)
        self.top_p = _check_num("top_p", self.top_p, lo=0.0, hi=1.0, lo_open=True)
        _check_int("top_k", self.top_k, lo=-1)
        self.min_p = _check_num("min_p", self.min_p, lo=0.0, hi=1.0)
        self.repetition_penalty = _check_num("repetition_penalty", self.repetition_penalty, lo=0.0, lo_open=True)
        self.frequency_penalty = _check_num("frequency_penalty", self.frequency_penalty, lo=-2.0, hi=2.0)
        self.presence_penalty = _check_num("presence_penalty", self.presence_penalty, lo=-2.0, hi=2.0)
        _check_int("top_logprobs_num", self.top_logprobs_num, lo=0, hi=20)
        if self.seed is not None:
            _check_int("seed", self.seed, lo=0, hi=2**63 - 1)  # a torch.Generator seed
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise RequestError(f"stop strings must be non-empty strings, got {s!r}", "stop")
        for t in self.stop_token_ids:
            _check_int("stop_token_ids[]", t, lo=0)
        self.logit_bias = check_logit_bias(self.logit_bias)
        self.changes_logits = self.has_penalties or self.logit_bias is not None
        given = [k for k in GRAMMAR_KINDS if getattr(self, k) is not None]
        if len(given) > 1:
            raise RequestError(f"at most one of json_schema, regex and ebnf may be given, got {given}", given[1])
        try:
            self.grammar = (given[0], grammar_source(given[0], getattr(self, given[0]))) if given else None
        except ValueError as exc:
            raise RequestError(str(exc), given[0]) from None
        for name in ("grammar_after", "grammar_after_open"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not 0 < len(value) <= MAX_GRAMMAR_AFTER_CHARS):
                raise RequestError(f"{name} must be a string of 1 to {MAX_GRAMMAR_AFTER_CHARS} characters, "
                                   f"got {value!r}", name)
        if self.grammar_after is not None and self.grammar is None:
            raise RequestError("grammar_after needs a grammar (json_schema, regex or ebnf)", "grammar_after")
        if self.grammar_after_open is not None and self.grammar_after is None:
            raise RequestError("grammar_after_open needs grammar_after", "grammar_after_open")

    @property
    def is_greedy(self) -> bool:
        """Argmax sampling: temperature 0 (or below ``GREEDY_TEMPERATURE``, which divided into the
        logits would overflow them), or top-k 1."""
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    def ending_token_ids(self, eos_token_ids: Collection[int]) -> Collection[int]:
        """The token ids whose sampling ends a request with these parameters: its ``stop_token_ids``,
        and the model's EOS ids ``eos_token_ids`` unless ``ignore_eos``. The one statement of the
        rule: ``OutputProcessor`` ends a request on them, and the sampler makes them unsampleable
        before ``min_new_tokens`` (``sampler.process_row``). May be one of the given collections
        (no copy in the common case): read it, never change it."""
        if self.ignore_eos or not eos_token_ids:
            return self.stop_token_ids
        if not self.stop_token_ids:
            return eos_token_ids
        return [*self.stop_token_ids, *eos_token_ids]


SAMPLING_FIELDS = frozenset(f.name for f in fields(SamplingParams) if f.init)
"""The names ``sampling_params`` takes."""

_DECIMAL = re.compile(r"[0-9]+")


def check_logit_bias(value: Any) -> dict[int, float] | None:
    """A ``logit_bias`` as ``{token id: bias}``, or None for none (None or an empty dict). Keys are
    token ids: non-negative ints, or the same as decimal strings (``"50256"``: JSON object keys, what
    OpenAI clients and ``/generate`` send); values finite numbers in [-100, 100]. Whether an id is in
    the model's vocabulary is the engine's check (at submission). ``ValueError`` naming
    ``logit_bias`` otherwise."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise RequestError(f"logit_bias must be an object mapping token ids to biases, got {type(value).__name__}",
                           "logit_bias")
    out: dict[int, float] = {}
    for key, bias in value.items():
        if isinstance(key, str) and _DECIMAL.fullmatch(key):
            token = int(key)
        elif isinstance(key, int) and not isinstance(key, bool) and key >= 0:
            token = key
        else:
            raise RequestError(f"logit_bias keys must be token ids (non-negative integers, or their decimal "
                               f"strings), got {key!r:.40}", "logit_bias")
        bias = _check_num(f"logit_bias[{key!r:.40}]", bias, lo=-MAX_LOGIT_BIAS, hi=MAX_LOGIT_BIAS)
        if token in out:
            raise RequestError(f"logit_bias gives token id {token} twice", "logit_bias")
        out[token] = bias
    return out or None


def _field(name: str) -> str:
    """The field a checked value belongs to: ``logit_bias['5']`` and ``stop_token_ids[]`` are items."""
    return name.split("[", 1)[0]


def _check_list(name: str, value: Any) -> list:
    if value is None:
        return []
    if not isinstance(value, (list, tuple)):
        raise RequestError(f"{name} must be a list, got {value!r}", _field(name))
    return list(value)


def _check_int(name: str, value: Any, lo: int | None = None, hi: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(f"{name} must be an integer, got {value!r}", _field(name))
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise RequestError(f"{name} must be in [{lo}, {hi if hi is not None else 'inf'}], got {value}", _field(name))


def _check_num(name: str, value: Any, lo: float, hi: float | None = None, lo_open: bool = False) -> float:
    """``value`` as a float, checked: finite, in range. An int (``/generate``'s JSON passes ``10**30``
    through as one) becomes a float here, not in the sampler's arithmetic, where it failed the step
    of every request batched with it; one too large for a float (``10**400``) is refused."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RequestError(f"{name} must be a finite number, got {value!r:.40}", _field(name))
    try:
        number = float(value)
    except OverflowError:
        raise RequestError(f"{name} must be a finite number, got an integer too large for a float",
                           _field(name)) from None
    if not math.isfinite(number):
        raise RequestError(f"{name} must be a finite number, got {value!r}", _field(name))
    if number < lo or (lo_open and number == lo) or (hi is not None and number > hi):
        bracket = "(" if lo_open else "["
        raise RequestError(f"{name} must be in {bracket}{lo}, {hi if hi is not None else 'inf'}], got {number}",
                           _field(name))
    return number
