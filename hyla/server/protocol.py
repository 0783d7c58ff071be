"""Request and response bodies of the HTTP API (pydantic models).

The OpenAI models follow https://platform.openai.com/docs/api-reference (completions, chat
completions, models) plus the sampling extras SGLang and vLLM accept (``top_k``, ``min_p``,
``repetition_penalty``, ``stop_token_ids``, ``ignore_eos``, ``min_tokens``, ``skip_special_tokens``,
``chat_template_kwargs``) and vLLM's (``cache_salt``, ``return_token_ids``, ``include_stop_str_in_output``,
``structured_outputs`` and the older ``guided_*``, ``truncate_prompt_tokens``,
``stream_options.continuous_usage_stats``). ``GenerateRequest`` is the native SGLang-style ``POST /generate``.

Validation rules (a broken rule is an HTTP 400 with an OpenAI-style error body):

* Types are strict: ``"16"`` is not an integer, ``1`` is not a bool; numbers are finite.
* Unknown fields are refused (``extra="forbid"``), so an unsupported OpenAI feature such as
  ``prediction`` fails loudly instead of being silently ignored. The few fields that change
  nothing about the output (``user``, ``metadata``, ``store``, ``service_tier``; a chat's
  ``prompt_cache_key``, ``prompt_cache_retention``, ``safety_identifier``, ``reasoning_effort``,
  ``verbosity``) are accepted and ignored.
* Strings are Unicode text: a lone UTF-16 surrogate anywhere in a body is refused.
* ``null`` is the default in the fields OpenAI lets be null that have one (``NULL_MEANS_DEFAULT``:
  ``n``, ``stream``, ``echo``, ``logprobs``, ``parallel_tool_calls``; and vLLM's ``return_token_ids``),
  as the other optional fields take it for "unset".
* A rule over several fields that one of them breaks names that field (``FieldError``).
* Ranges are OpenAI's where the engine has no stricter rule; the engine validates the sampling
  parameters once more (``SamplingParams``) and its ``ValueError`` is a 400 too.
* Chat messages, tools and ``chat_template_kwargs`` nest lists and objects at most
  ``MAX_NESTING_DEPTH`` levels deep (the chat template's bound), and a tool's ``parameters`` is
  shaped as a JSON Schema where the server reads it (``check_function_parameters``).

The size caps (``DEFAULT_MAX_REQUEST_BYTES``, ``PROMPT_CHARS_PER_TOKEN``) and the shutdown timeout
live here too, so that ``hyla serve --help`` shows them without importing the server.
"""

from __future__ import annotations

import re
import time
from typing import Annotated, Any, ClassVar, Literal, Union

from pydantic import (
    BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationInfo, field_validator, model_serializer,
    model_validator,
)

from hyla.engine.args import check_weight_version
from hyla.tokenizer.chat_template import JSON_SCALARS, check_nesting

MAX_N = 16  # choices per request: each is one engine request
MAX_STOP = 16  # stop strings per request (OpenAI allows 4; SGLang/vLLM more)
MAX_SEED = 2**63 - 1  # seeds are signed 64-bit integers
DEFAULT_MAX_REQUEST_BYTES = 16 << 20  # a larger body is a 413 (hyla serve --max-request-bytes)
DEFAULT_MAX_PREFIX_BYTES = 4 << 30  # an /import_prefix body (a cached prefix's KV and state): --max-prefix-bytes

DEFAULT_STORED_RESPONSES = 4096
"""(``hyla serve --max-stored-responses``) Responses kept for ``GET`` and ``previous_response_id`` (the least recently used is dropped
first). Each holds its conversation as a list of message dicts, shared with the responses that
continue it, so the memory is about the text of the conversations kept."""

DEFAULT_STORED_RESPONSE_BYTES = 1 << 30
"""(``--max-stored-response-bytes``) The size of the responses kept (``stored_size``: their text, each with its whole conversation),
beside ``DEFAULT_STORED_RESPONSES``: the least recently used are dropped first to stay within it, so
that a few huge responses (a 16 MiB request each, ``--max-request-bytes``) do not hold 4096 times that."""

DEFAULT_SHUTDOWN_TIMEOUT = 30.0  # seconds running requests get to finish at shutdown (--shutdown-timeout)
PROMPT_CHARS_PER_TOKEN = 16
"""The default prompt cap (``--max-prompt-chars``) is this many characters per token of context: a
longer prompt cannot fit the context (a token is rarely longer than a few characters), so it is
refused with 413 before it is tokenized."""
DEFAULT_FETCH_TIMEOUT = 10.0
"""Seconds the server's fetch of an image URL may take (``--media-fetch-timeout``; ``media.MediaFetcher``)."""


class _Strict(BaseModel):
    """Request bodies: strict types, finite numbers (no NaN), unknown fields refused."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def _split(values: Any) -> tuple[list[str], list[Any], int]:
    """The strings, the lists and objects, and the count of other values among ``values`` (a list or
    an object's values). A list of numbers costs a few passes in C (``set(map(type, ...))``), not
    a Python step each: a body of millions of them must not hold the event loop for seconds."""
    kinds = set(map(type, values))
    strings = [v for v in values if type(v) is str] if str in kinds else []
    nested = [] if kinds <= JSON_SCALARS else [v for v in values if isinstance(v, (dict, list))]
    return strings, nested, len(values) - len(strings) - len(nested)


def _strings_hold_a_surrogate(data: Any) -> bool:
    """Whether a string (or an object key) in parsed JSON holds a lone UTF-16 surrogate: one search
    over each list's or object's strings joined (joining makes no pair: a Python string holds code
    points). Iterative."""
    search = _LONE_SURROGATE.search
    stack = [data]
    while stack:
        value = stack.pop()
        if type(value) is str:
            if search(value):
                return True
            continue
        if isinstance(value, dict):
            if search("".join(k for k in value if type(k) is str)):
                return True
            value = value.values()
        elif not isinstance(value, list):
            continue
        strings, nested, _ = _split(value)
        if strings and search("".join(strings)):
            return True
        stack.extend(nested)
    return False


def _lone_surrogate_at(data: Any) -> str | None:
    """Where (``messages.0.content``) a string in parsed JSON holds a lone UTF-16 surrogate, or None.
    json.loads joins each escaped pair (``\\ud83d\\ude00``) into one character, so any surrogate
    left is unpaired. Iterative: bodies may nest deeply. The path is looked for only once a cheap
    pass found one (:func:`_strings_hold_a_surrogate`)."""
    if not _strings_hold_a_surrogate(data):
        return None
    stack: list[tuple[Any, str]] = [(data, "")]
    while stack:
        value, path = stack.pop()
        if isinstance(value, str):
            if _LONE_SURROGATE.search(value):
                return path or "body"
        elif isinstance(value, dict):
            stack.extend((v, f"{path}.{k}" if path else str(k)) for k, v in value.items())
            stack.extend((k, path or "body") for k in value if isinstance(k, str))
        elif isinstance(value, list):
            stack.extend((v, f"{path}.{i}" if path else str(i)) for i, v in enumerate(value))
    return None


def text_chars(value: Any, keys: bool = False) -> int:
    """What rendering a JSON value into a prompt costs, in characters (the prompt cap's measure):
    every string's characters, with ``keys`` every object key's too (tools: a template writes their
    JSON), and one for any other value (a number, a bool, a null renders as one character at least;
    one a template leaves out is still work to walk and copy). Iterative, a few C passes per list or
    object (:func:`_split`)."""
    total, stack = 0, [value]
    while stack:
        v = stack.pop()
        if type(v) is str:
            total += len(v)
            continue
        if isinstance(v, dict):
            if keys:
                total += sum(len(k) if type(k) is str else 1 for k in v)
            v = v.values()
        elif not isinstance(v, list):
            total += 1
            continue
        strings, nested, others = _split(v)
        total += sum(map(len, strings)) + others
        stack.extend(nested)
    return total


def _prompt_shape(value: Any) -> str:
    """The shape of a prompt-like field, from its first item: ``text``, ``texts``, ``ids`` or
    ``batches`` (of ids). Only that shape's validator then runs: pydantic's smart union tries every
    member, and a million ids failing as strings first cost ~0.4 µs each (1.3 s of the event loop for
    the 3 million a 16 MiB body holds)."""
    if not isinstance(value, list):
        return "text"
    first = value[0] if value else 0
    return "texts" if isinstance(first, str) else "batches" if isinstance(first, list) else "ids"


_TEXT, _TEXTS = Annotated[str, Tag("text")], Annotated[list[str], Tag("texts")]
_IDS, _BATCHES = Annotated[list[int], Tag("ids")], Annotated[list[list[int]], Tag("batches")]
Texts = Annotated[Union[_TEXT, _TEXTS], Discriminator(_prompt_shape)]
TokenIds = Annotated[Union[_IDS, _BATCHES], Discriminator(_prompt_shape)]
Prompt = Annotated[Union[_TEXT, _TEXTS, _IDS, _BATCHES], Discriminator(_prompt_shape)]
"""A completion's prompt: a text, texts, token ids, or lists of token ids."""


class FieldError(ValueError):
    """A rule of a whole request (a model validator's) that one field breaks: its 400 names ``param``
    (``hyla.server.errors.validation_error``), as a field's own rule does. Raised inside a nested
    object, ``param`` is that object's location followed by this field."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


class _Request(_Strict):
    """A top-level request body. A lone UTF-16 surrogate (``"\\ud800"``, what a JavaScript client
    sends after cutting a string inside an emoji) is not Unicode text: 400, as OpenAI answers."""

    @model_validator(mode="before")
    @classmethod
    def _check_unicode(cls, data: Any) -> Any:
        where = _lone_surrogate_at(data)
        if where is not None:
            raise FieldError(where, f"{where} holds a lone UTF-16 surrogate (half of a surrogate pair): not valid "
                                    "Unicode text")
        return data


# --------------------------------------------------------------------------------------------
# requests
# --------------------------------------------------------------------------------------------
class StreamOptions(_Strict):
    include_usage: bool = False
    # vLLM's: with include_usage, every chunk carries the usage so far (without it: no effect, as vLLM)
    continuous_usage_stats: bool = False


class JSONSchemaFormat(_Strict):
    """``response_format.json_schema``: OpenAI's named schema. ``strict`` changes nothing: the
    output always follows the schema (llguidance enforces every keyword it supports and refuses a
    schema it cannot enforce)."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, populate_by_name=True)

    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    """``text`` (unconstrained), ``json_object`` (any JSON object) or ``json_schema`` (the output
    follows ``json_schema.schema``; no schema: any JSON value)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _check_schema(self) -> "ResponseFormat":
        if self.type == "json_schema" and self.json_schema is None:
            raise FieldError("json_schema", "response_format type json_schema needs a json_schema object")
        if self.type != "json_schema" and self.json_schema is not None:
            raise FieldError("json_schema", f"response_format type {self.type} takes no json_schema")
        return self

    def grammar(self) -> dict[str, Any]:
        """The engine's sampling parameter constraining the output (empty for ``text``)."""
        if self.type == "json_object":
            return {"json_schema": {"type": "object"}}
        if self.type == "json_schema":
            schema = self.json_schema.schema_ if self.json_schema is not None else None
            return {"json_schema": schema if schema is not None else {}}
        return {}


def choice_regex(choices: list[str]) -> str:
    """A regex (llguidance's syntax) matching exactly one of the ``choices``, literally: every character
    but an ASCII letter or digit is written ``\\x{hex}``, which stands for that character alone."""
    def literal(text: str) -> str:
        return "".join(c if c.isascii() and c.isalnum() else f"\\x{{{ord(c):x}}}" for c in text)

    return "(" + "|".join(literal(c) for c in choices) + ")"


STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")
"""``structured_outputs``' constraints (vLLM's names), one per request."""


class StructuredOutputs(_Strict):
    """vLLM's ``structured_outputs`` (``StructuredOutputsParams``): exactly one constraint, mapped onto
    the engine's grammar (``grammar_params()``): ``json`` (a JSON schema, an object or its text) and
    ``json_object: true`` (any JSON object) a ``json_schema``, ``regex`` a ``regex``, ``choice`` (one of
    these strings, literally) a ``regex`` over the escaped alternatives, ``grammar`` (GBNF or Lark, as
    vLLM's backends take it) an ``ebnf``. ``disable_fallback`` and ``disable_any_whitespace`` change
    nothing here (one grammar backend, which never falls back; a JSON output never has free
    whitespace); what hyla cannot enforce as vLLM means it is refused: ``whitespace_pattern``,
    ``structural_tag``, ``disable_additional_properties: true``."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, populate_by_name=True)

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None

    @model_validator(mode="after")
    def _check_one(self) -> "StructuredOutputs":
        for name in ("whitespace_pattern", "structural_tag"):
            if getattr(self, name) is not None:
                raise FieldError(name, f"structured_outputs.{name} is not supported")
        if self.disable_additional_properties:
            raise FieldError("disable_additional_properties", "structured_outputs.disable_additional_properties is "
                             "not supported: write additionalProperties: false in the schema")
        if self.json_object is False:  # vLLM's rule
            raise FieldError("json_object", "structured_outputs.json_object must be true if set")
        if self.choice is not None and not self.choice:
            raise FieldError("choice", "structured_outputs.choice must not be an empty list")
        given = self.kinds()
        if len(given) > 1:
            raise FieldError(given[1], f"structured_outputs takes one constraint ({', '.join(STRUCTURED_KINDS)}), "
                                       f"got {' and '.join(given)}")
        if not given:
            raise ValueError(f"structured_outputs needs one constraint: {', '.join(STRUCTURED_KINDS)}")
        return self

    def given(self) -> dict[str, Any]:
        """The constraints given, by their vLLM names (in ``STRUCTURED_KINDS``' order), with their values."""
        values = {"json": self.json_, "regex": self.regex, "choice": self.choice, "grammar": self.grammar,
                  "json_object": self.json_object}
        return {k: values[k] for k in STRUCTURED_KINDS if values[k] is not None}

    def kinds(self) -> list[str]:
        """The constraints given, by their vLLM names."""
        return list(self.given())

    def grammar_params(self) -> dict[str, Any]:
        """The engine's sampling parameter constraining the output."""
        kind, value = next(iter(self.given().items()))
        return constraint_params(kind, value)


def constraint_params(kind: str, value: Any) -> dict[str, Any]:
    """The engine's grammar sampling parameter for one vLLM constraint, by its ``structured_outputs``
    name (``STRUCTURED_KINDS``; the ``guided_*`` fields name the same kinds: ``GUIDED_FIELDS``)."""
    if kind == "json":
        return {"json_schema": value}
    if kind == "json_object":
        return {"json_schema": {"type": "object"}}
    if kind == "choice":
        return {"regex": choice_regex(value)}
    return {"regex": value} if kind == "regex" else {"ebnf": value}


GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}
"""vLLM's older constraint fields (deprecated by vLLM for ``structured_outputs``, still sent by clients)
and the ``structured_outputs`` kind each is (``constraint_params``)."""


def default_if_null(cls: type[BaseModel], value: Any, info: ValidationInfo) -> Any:
    """A ``mode="before"`` field validator: null is the field's default, so that later code never sees
    None (``n`` stays a number, ``stream`` a bool): OpenAI's (and vLLM's) nullable fields that have a
    default, what the openai client sends for a ``None``."""
    return cls.model_fields[str(info.field_name)].default if value is None else value


CACHE_SALT_ERROR = "Parameter 'cache_salt' must be a non-empty string if provided."  # vLLM's words


def check_stream_options(stream_options: Any, stream: bool | None) -> None:
    """``stream_options`` only with ``stream`` (OpenAI's rule, at chat completions, completions and
    responses): a ``FieldError`` naming it otherwise."""
    if stream_options is not None and not stream:
        raise FieldError("stream_options", "stream_options is only allowed when stream is true")


def check_cache_salt(cls: type[BaseModel], value: str | None) -> str | None:
    """A ``cache_salt`` field validator: a salt is a non-empty string (vLLM's rule), or absent/null."""
    if value is not None and not value:
        raise ValueError(CACHE_SALT_ERROR)
    return value


def cache_namespace(salt: str | None) -> tuple[str, str] | None:
    """The engine's prefix-cache ``namespace`` for a request's ``cache_salt`` (None: unsalted, the
    shared partition). Tagged, so no salt can name another partition (the health check's
    ``"hyla-health-generate"``, the unsalted ``None``): the radix cache shares a prefix only between
    requests of the same namespace (by value and type, ``hyla.cache.radix_types.namespace_key``)."""
    return None if salt is None else ("cache_salt", salt)


NULL_MEANS_DEFAULT = ("n", "stream", "echo", "parallel_tool_calls", "logprobs", "return_token_ids")
"""Fields of the OpenAI endpoints that take null for their default (not every endpoint has them all:
a completion's ``logprobs`` defaults to null, a chat's to false)."""


class _SamplingFields(_Request):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str
    # null (what the openai client sends for a None) is the default: _null_is_default
    n: int | None = Field(1, ge=1, le=MAX_N)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    # token id (a decimal string: a JSON key) -> bias in [-100, 100], added to its logit
    logit_bias: dict[str, float] | None = None
    # SGLang / vLLM extras
    rid: str | list[str] | None = None  # SGLang's: the engine request ids (openai_routes.job_rids)
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int | None = Field(None, ge=0)  # vLLM's: the engine's min_new_tokens (at most the max tokens)
    skip_special_tokens: bool = True
    # vLLM's: spaces between special tokens in the text, which a fast tokenizer's decode (hyla's) never adds
    # either way: accepted, no effect
    spaces_between_special_tokens: bool = True
    response_format: ResponseFormat | None = None
    # vLLM's structured outputs (at most one constraint per request, response_format's included:
    # constraints()), the current form and the older guided_* fields
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # vLLM's: a matched stop string (and a stop token's text) stays at the end of the text
    include_stop_str_in_output: bool = False
    # vLLM's: the response carries the prompt's token ids and each choice's output token ids
    return_token_ids: bool | None = False
    # vLLM's: keep only the last N prompt tokens (-1: as many as the context leaves for the output)
    truncate_prompt_tokens: int | None = Field(None, ge=-1, le=MAX_SEED)
    # SGLang / vLLM: with --enable-priority-scheduling (else 0 or absent); which is more urgent: docs/engine.md
    priority: int | None = Field(None, ge=-MAX_SEED - 1, le=MAX_SEED)
    # vLLM's: requests share cached prefixes only with requests of the same salt (cache_namespace)
    cache_salt: str | None = None
    # accepted, no effect on the output
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None

    _null_is_default = field_validator(*NULL_MEANS_DEFAULT, mode="before", check_fields=False)(default_if_null)
    _check_cache_salt = field_validator("cache_salt")(check_cache_salt)

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        # the engine's rule (keys decimal token ids, biases in [-100, 100]); imported here: it imports
        # torch, which `hyla serve --help` (importing this module for its defaults) must not wait for
        from hyla.engine.sampling_params import check_logit_bias

        check_logit_bias(value)
        return value

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _check_truncate(cls, value: int | None) -> int | None:
        if value == 0:
            raise ValueError("truncate_prompt_tokens must be at least 1 (or -1: as many as the context allows)")
        return value

    @field_validator("guided_choice")
    @classmethod
    def _check_guided_choice(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and not value:
            raise ValueError("guided_choice must not be an empty list")
        return value

    @model_validator(mode="after")
    def _check_common(self) -> "_SamplingFields":
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        if len(stops) > MAX_STOP:
            raise FieldError("stop", f"at most {MAX_STOP} stop strings are supported, got {len(stops)}")
        check_stream_options(self.stream_options, self.stream)
        given = self.constraints()
        if len(given) > 1:
            raise FieldError(given[1][0], f"a request takes one output constraint, got {given[0][0]} and {given[1][0]}")
        return self

    def constraints(self) -> list[tuple[str, dict[str, Any]]]:
        """The output constraints the request gives, each as ``(the field, the engine's sampling
        parameter)``: ``response_format`` (other than ``text``), ``structured_outputs``, ``guided_*``.
        vLLM's rule: a ``json_schema`` response format replaces the schema of ``structured_outputs.json``
        or ``guided_json``; any other two are two constraints (a 400: ``_check_common``)."""
        found: list[tuple[str, dict[str, Any]]] = []
        if self.response_format is not None and self.response_format.type != "text":
            found.append(("response_format", self.response_format.grammar()))
        so = self.structured_outputs
        if so is not None:
            found.append((f"structured_outputs.{so.kinds()[0]}", so.grammar_params()))
        for name, kind in GUIDED_FIELDS.items():
            value = getattr(self, name)
            if value is not None:
                found.append((name, constraint_params(kind, value)))
        if self.response_format is not None and self.response_format.type == "json_schema":
            found = [f for f in found if f[0] not in ("structured_outputs.json", "guided_json")]
        return found

    def constraint_field(self) -> str | None:
        """The field the request's output constraint comes from (what a grammar error names), or None."""
        given = self.constraints()
        return given[0][0] if given else None

    def grammar_field(self) -> str | None:
        """The field a grammar error names (a chat's forced tool call adds its own: ``ChatCompletionRequest``)."""
        return self.constraint_field()

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def continuous_usage(self) -> bool:
        """Every streamed chunk carries the usage so far (vLLM's: only with ``include_usage``)."""
        return self.include_usage() and self.stream_options.continuous_usage_stats  # type: ignore[union-attr]

    def sampling_params(self, max_new_tokens: int, top_logprobs_num: int, choice: int) -> dict[str, Any]:
        """The engine's ``sampling_params`` for choice number ``choice`` (0-based) of this request.

        With a ``seed``, choice ``i`` draws with ``seed + i``: the ``n`` choices differ from each other
        and the whole response is reproducible."""
        params: dict[str, Any] = {
            "max_new_tokens": max_new_tokens,
            "stop": self.stop_list(),
            "ignore_eos": self.ignore_eos,
            "skip_special_tokens": self.skip_special_tokens,
            "top_logprobs_num": top_logprobs_num,
        }
        optional = {  # unset: the engine's defaults (the model's generation_config.json, else OpenAI's)
            "temperature": self.temperature, "top_p": self.top_p,
            "frequency_penalty": self.frequency_penalty, "presence_penalty": self.presence_penalty,
            "top_k": self.top_k, "min_p": self.min_p, "repetition_penalty": self.repetition_penalty,
            "stop_token_ids": self.stop_token_ids, "logit_bias": self.logit_bias, "min_new_tokens": self.min_tokens,
        }
        params.update({k: v for k, v in optional.items() if v is not None})
        if self.seed is not None:
            params["seed"] = (self.seed + choice) % (MAX_SEED + 1)
        if self.include_stop_str_in_output:
            params["include_stop_str_in_output"] = True
        for _, grammar in self.constraints()[:1]:
            params.update(grammar)
        return params


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``. ``prompt``: a string, a list of strings, a list of token ids, or a
    list of token-id lists; a list gives ``n`` choices per prompt, indexed ``prompt * n + j``."""

    prompt: Prompt
    max_tokens: int | None = Field(16, ge=0)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool | None = False  # the prompt before the completion, with its logprobs when logprobs is set

    @model_validator(mode="after")
    def _check_prompt(self) -> "CompletionRequest":
        if isinstance(self.prompt, list) and len(self.prompt) == 0:
            raise FieldError("prompt", "prompt must not be empty")
        if self.max_tokens == 0 and not self.echo:  # 0: only the prompt's logprobs (evaluation harnesses)
            raise FieldError("max_tokens", "max_tokens must be at least 1 (0 only with echo)")
        return self

    def prompts(self) -> list[str | list[int]]:
        """The prompts, each a string or a list of token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)


class _ContentPart(_Strict):
    # Anthropic's prompt-caching mark, which OpenAI-format clients in front of several providers (LiteLLM,
    # OpenRouter) put on parts: accepted and ignored, as /v1/messages does (every prompt's prefix is cached)
    cache_control: dict[str, Any] | None = None


class TextContentPart(_ContentPart):
    type: Literal["text"]
    text: str


def text_content(texts: list[str]) -> str | list[dict[str, Any]]:
    """A message's texts (Anthropic's text blocks, a Responses message's text parts) as a chat message's
    content: none ``""``, one its text, several text parts (a template that does not loop over parts gets them
    a line each: ``ChatTemplate.render``, as vLLM passes them)."""
    if len(texts) == 1:
        return texts[0]
    return [{"type": "text", "text": t} for t in texts] if texts else ""


def is_fetched(url: str) -> bool:
    """Whether the image ``url`` is one the server fetches (http or https: ``media.MediaFetcher``), not a data URL
    carrying its image."""
    return url[:8].lower().startswith(("http://", "https://"))


def image_url_problem(url: str) -> str | None:
    """Why ``url`` cannot name an image (a scheme other than ``data:``, ``http:``, ``https:``), or None. A data
    URL carries its image; an http(s) one is fetched where the server allows its host (:func:`is_fetched`)."""
    if url[:5].lower() == "data:" or is_fetched(url):
        return None
    return "an image must be a data URL (data:image/png;base64,...) or an http(s) URL"


class ImageURL(_Strict):
    url: str = Field(min_length=1)  # a data URL (``data:image/png;base64,...``), or an http(s) URL (media.py)
    detail: Literal["auto", "low", "high"] | None = None  # (accepted; the model's processor decides the size)


class ImageContentPart(_ContentPart):
    """An image (OpenAI's ``image_url`` part), for a vision-language model."""

    type: Literal["image_url"]
    image_url: ImageURL


CONTENT_PART_TYPES = ("text", "image_url")


class ChatMessage(BaseModel):
    """A chat message. Extra keys (``tool_calls``, ``name``, ``reasoning_content``...) are passed to
    the chat template unchanged; ``content`` may be a string or a list of text and image parts, and only
    an assistant message may go without it (one that carries ``tool_calls``)."""

    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart | ImageContentPart] | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _known_parts_only(cls, content: Any) -> Any:
        if isinstance(content, list):
            kinds = sorted({str(p.get("type")) for p in content if isinstance(p, dict)} - set(CONTENT_PART_TYPES))
            if kinds:
                raise ValueError(f"only text and image_url content parts are supported, got {', '.join(kinds)}")
            for i, part in enumerate(content):
                image = part.get("image_url") if isinstance(part, dict) and part.get("type") == "image_url" else None
                url = image.get("url") if isinstance(image, dict) else None
                problem = image_url_problem(url) if isinstance(url, str) else None
                if problem is not None:
                    raise FieldError(f"{i}.image_url.url", problem)
        return content

    def image_urls(self) -> list[str]:
        """The message's images (data or http(s) URLs), in order."""
        if not isinstance(self.content, list):
            return []
        return [p.image_url.url for p in self.content if isinstance(p, ImageContentPart)]

    @model_validator(mode="after")
    def _check_content(self) -> "ChatMessage":
        if self.content is None and self.role != "assistant":
            raise FieldError("content", f"a {self.role} message needs content")
        return self

    def for_template(self) -> dict[str, Any]:
        """The message as the chat template reads it: a content of parts a list of ``{"type": "text", "text"}``
        and ``{"type": "image"}`` parts in order (a vision-language template writes its image placeholder for
        each of the latter; a template that does not loop over parts gets text parts joined a line each:
        ``ChatTemplate.render``)."""
        msg = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            msg["content"] = [{"type": "text", "text": p.text} if isinstance(p, TextContentPart)
                              else {"type": "image"} for p in self.content]
        return msg


def check_function_parameters(name: str, parameters: Any) -> None:
    """``ValueError`` naming the function and the keyword when a tool's ``parameters`` is not shaped
    as a JSON Schema where the server reads it (the chat template, the tool-call parsers, the
    forced-call grammar): ``parameters`` is an object; a schema in it an object or a boolean, with
    ``properties`` an object of schemas, ``required`` a list of strings, ``enum`` a list, ``type`` a
    string or a non-empty list of strings, ``anyOf`` / ``oneOf`` non-empty lists of schemas. What
    the keywords say (an unknown type name, an empty enum) is left to the grammar compiler, which
    refuses a schema it cannot enforce. Iterative: nesting is bounded elsewhere."""
    if parameters is None:
        return
    if not isinstance(parameters, dict):
        raise ValueError(f"function {name!r}: parameters must be a JSON Schema (an object), "
                         f"got {_json_type(parameters)}")
    stack: list[tuple[Any, str]] = [(parameters, "parameters")]
    while stack:
        schema, where = stack.pop()
        if isinstance(schema, bool):
            continue
        if not isinstance(schema, dict):
            raise ValueError(f"function {name!r}: {where} must be a JSON Schema (an object), got {_json_type(schema)}")
        problem = _schema_keyword_problem(schema)
        if problem is not None:
            keyword, expected = problem
            raise ValueError(f"function {name!r}: {where}.{keyword} must be {expected}, "
                             f"got {_json_type(schema[keyword])}")
        stack.extend((v, f"{where}.properties.{k}") for k, v in (schema.get("properties") or {}).items())
        for keyword in ("anyOf", "oneOf"):
            stack.extend((b, f"{where}.{keyword}[{i}]") for i, b in enumerate(schema.get(keyword) or ()))


def _schema_keyword_problem(schema: dict[str, Any]) -> tuple[str, str] | None:
    """``(keyword, what it must be)`` for the first of a schema's keywords the server reads that is
    malformed, or None."""
    properties, required, kind = schema.get("properties"), schema.get("required"), schema.get("type")
    if properties is not None and not isinstance(properties, dict):
        return "properties", "an object mapping each parameter to its schema"
    if required is not None and not (isinstance(required, list) and all(isinstance(r, str) for r in required)):
        return "required", "a list of property names"
    if "enum" in schema and not isinstance(schema["enum"], list):
        return "enum", "a list of values"
    if kind is not None and not (isinstance(kind, str) or
                                 (isinstance(kind, list) and kind and all(isinstance(t, str) for t in kind))):
        return "type", "a type name or a non-empty list of them"
    for keyword in ("anyOf", "oneOf"):
        branches = schema.get(keyword)
        if branches is not None and not (isinstance(branches, list) and branches):
            return keyword, "a non-empty list of schemas"
    return None


def _json_type(value: Any) -> str:
    """``value``'s JSON type, as an error message names it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    return {dict: "an object", list: "a list", str: "a string", int: "a number", float: "a number"}.get(
        type(value), type(value).__name__)


class FunctionDefinition(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @model_validator(mode="after")
    def _check_parameters(self) -> "FunctionDefinition":
        check_function_parameters(self.name, self.parameters)
        return self


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``."""

    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = True

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's: documents for a retrieval-augmented template (Granite's), its `documents` variable
    documents: list[dict[str, Any]] | None = None
    # vLLM's: the images' preprocessing for this request (min_pixels / max_pixels; Engine.process_images)
    mm_processor_kwargs: dict[str, Any] | None = None
    # vLLM's: the template's generation prompt (the new assistant turn's header), or, instead, the final
    # (assistant) message left open for the model to continue (a prefill): prefill_error
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # what agent clients send (the Agents SDK's model settings) and hyla accepts without acting on: the
    # prompt-cache hints (the exact prefix cache needs none; ``hyla route`` routes by prompt_cache_key),
    # user's successor, and the reasoning controls (a model thinks as its chat template says:
    # chat_template_kwargs, e.g. {"enable_thinking": false})
    prompt_cache_key: str | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    safety_identifier: str | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    verbosity: Literal["low", "medium", "high"] | None = None

    @field_validator("messages", "tools", "chat_template_kwargs", "documents", mode="before")
    @classmethod
    def _check_nesting(cls, value: Any, info: ValidationInfo) -> Any:
        return check_chat_nesting(value, str(info.field_name))

    @model_validator(mode="after")
    def _check_logprobs(self) -> "ChatCompletionRequest":
        if self.top_logprobs is not None and not self.logprobs:
            raise FieldError("top_logprobs", "top_logprobs requires logprobs to be true")
        problem = prefill_error(self.messages, self.add_generation_prompt, self.continue_final_message)
        if problem is not None:
            raise FieldError(*problem)
        if self.tool_choice is not None and not self.tools:
            raise FieldError("tool_choice", "tool_choice is only allowed when tools are specified")
        if isinstance(self.tool_choice, NamedToolChoice):
            names = [t.function.name for t in self.tools or ()]
            if self.tool_choice.function.name not in names:
                raise FieldError("tool_choice", f"tool_choice names the function {self.tool_choice.function.name!r}, "
                                                f"which is not in tools ({', '.join(names)})")
        constraint = self.constraint_field()
        if self.forced_tools() and constraint is not None:
            raise FieldError(constraint, f"{constraint.partition('.')[0]} cannot be combined with tool_choice required "
                                         "or a named function")
        return self

    def tool_choice_mode(self) -> str:
        """``none`` (no tools rendered or parsed), ``auto``, ``required`` or ``named``."""
        if not self.tools or self.tool_choice == "none":
            return "none"
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return self.tool_choice or "auto"

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools as the chat template sees them (None: render none)."""
        if self.tool_choice_mode() == "none":
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools or ()]

    def forced_tools(self) -> list[dict[str, Any]]:
        """The functions a grammar must force a call of (empty: none forced)."""
        return [self.tools[i].function.model_dump(exclude_none=True) for i in self.forced_tool_indices()]

    def forced_tool_indices(self) -> list[int]:
        """Where in ``tools`` the functions a grammar must force a call of are (empty: none forced)."""
        mode = self.tool_choice_mode()
        if mode == "required":
            return list(range(len(self.tools or ())))
        if mode == "named":
            name = self.tool_choice.function.name  # type: ignore[union-attr]
            return [i for i, t in enumerate(self.tools or ()) if t.function.name == name]
        return []

    def forced_tool_field(self) -> str | None:
        """The field an error of the forced-call grammar names: the ``parameters`` of the function it
        forces (``tools.<i>.function.parameters``), or ``tools`` where it forces a call of one of several
        (the grammar is compiled as one: which schema failed is not known); None when no call is forced."""
        indices = self.forced_tool_indices()
        if not indices:
            return None
        return f"tools.{indices[0]}.function.parameters" if len(indices) == 1 else "tools"

    def grammar_field(self) -> str | None:
        """The field a grammar error names: the output constraint's, else the forced call's
        (``forced_tool_field``)."""
        return self.constraint_field() or self.forced_tool_field()

    def max_new_tokens(self) -> int | None:
        """``max_completion_tokens`` wins over the deprecated ``max_tokens``; None = up to the context."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def max_new_tokens_field(self) -> str:
        """The field ``max_new_tokens()`` comes from (what an error about it names)."""
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"


class GenerateRequest(_Request):
    """Native ``POST /generate`` (SGLang's): exactly one of ``text`` / ``input_ids``; a list of
    them is a batch (one output per item; no streaming)."""

    text: Texts | None = None
    input_ids: TokenIds | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    return_logprob: bool = False
    logprob_start_len: int | list[int] = -1  # with return_logprob: prompt logprobs from this position
    top_logprobs_num: int | None = Field(None, ge=0, le=20)
    stream: bool = False
    rid: str | list[str] | None = None
    checkpoints: list[int] | list[list[int]] | None = None
    speculative_checkpoints: bool = False  # the checkpoints are guesses (Engine.generate's docstring)
    priority: int | list[int] | None = None  # one, or one per item (--enable-priority-scheduling; docs/engine.md)
    cache_salt: str | None = None  # the whole batch's (vLLM's field: cache_namespace)
    # SGLang's: the LoRA adapter's name (a loaded adapter's, as SGLang takes it; null: the model), one or one per item
    lora_path: str | list[str | None] | None = None

    _check_cache_salt = field_validator("cache_salt")(check_cache_salt)

    @model_validator(mode="after")
    def _check_input(self) -> "GenerateRequest":
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("give exactly one of text or input_ids")
        if self.stream and not self.is_single():
            raise FieldError("stream", "stream=true takes a single request (text: str or input_ids: list[int])")
        return self

    def is_single(self) -> bool:
        if self.text is not None:
            return isinstance(self.text, str)
        return not (self.input_ids and isinstance(self.input_ids[0], list))


def prefill_error(messages: list[ChatMessage] | None, add_generation_prompt: bool,
                  continue_final_message: bool) -> tuple[str, str] | None:
    """``(field, message)`` where a chat's ``continue_final_message`` breaks its rules (vLLM's, and one
    more): it excludes ``add_generation_prompt`` (which defaults to true: a prefill sends it false),
    and the message it continues must be the assistant's (vLLM would render another role's open
    too; a prefill is the start of the answer). None when they hold."""
    if not continue_final_message:
        return None
    if add_generation_prompt:
        return "continue_final_message", ("continue_final_message and add_generation_prompt cannot both be true: "
                                          "set add_generation_prompt to false to continue the final message")
    if messages and messages[-1].role != "assistant":
        return "messages", (f"continue_final_message continues the final message, which must be the assistant's "
                            f"(the start of its answer), not a {messages[-1].role} message")
    return None


def check_chat_nesting(value: Any, field_name: str) -> Any:
    """A chat field (``messages``, ``tools``, ``chat_template_kwargs``, ``documents``) of at most
    ``MAX_NESTING_DEPTH`` levels of lists and objects (checked before anything walks it), counted
    as the chat template counts them: from each message, from the tools list. Returns ``value``."""
    if field_name == "messages" and isinstance(value, list):
        for i, message in enumerate(value):
            check_nesting(message, f"messages[{i}]")
    else:
        check_nesting(value, field_name)
    return value


class TokenizeRequest(_Request):
    """``POST /tokenize`` (vLLM's; SGLang serves the same shape): exactly one of ``prompt``, a text
    tokenized as /v1/completions tokenizes it, and ``messages``, a chat rendered and tokenized as
    /v1/chat/completions renders it. ``model`` may be left out (the served model is meant).

    With ``prompt``: ``add_special_tokens`` (default true: the tokenizer's post-processor, e.g. a
    BOS). With ``messages``: ``add_generation_prompt`` (default true) and ``continue_final_message``
    (default false; with it, add_generation_prompt false and a final assistant message:
    ``prefill_error``), as a chat completion takes them, ``chat_template_kwargs``, ``tools``
    (rendered as a chat completion with the default ``tool_choice`` renders them);
    ``add_special_tokens`` may only be false (vLLM's default: a chat completion adds nothing to the
    template's markup). ``form_error`` says which field breaks these rules."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool | None = None  # default: true with prompt, false with messages
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's: documents for a retrieval-augmented template (Granite's), its `documents` variable
    documents: list[dict[str, Any]] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None  # the images' preprocessing, as a chat completion's
    tools: list[Tool] | None = None
    return_token_strs: bool | None = False  # also answer each token's vocabulary string

    @field_validator("messages", "tools", "chat_template_kwargs", "documents", mode="before")
    @classmethod
    def _check_nesting(cls, value: Any, info: ValidationInfo) -> Any:
        return check_chat_nesting(value, str(info.field_name))

    def form_error(self) -> tuple[str, str] | None:
        """``(field, message)`` for the first field that does not fit the request's form (a
        ``prompt`` or ``messages``), or None when the request is one of the two."""
        if self.prompt is None and self.messages is None:
            return "prompt", "give prompt (a text) or messages (a chat) to tokenize"
        if self.prompt is not None and self.messages is not None:
            return "messages", "give prompt or messages, not both"
        if self.prompt is not None:
            for name in ("add_generation_prompt", "continue_final_message", "chat_template_kwargs", "tools", "documents"):
                if name in self.model_fields_set:
                    return name, f"{name} goes with messages, not with prompt"
            return None
        if self.add_special_tokens:
            return "add_special_tokens", ("add_special_tokens must be false with messages: the chat template "
                                          "writes the special tokens, and a chat completion adds none of its own")
        return prefill_error(self.messages, self.add_generation_prompt, self.continue_final_message)

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools as the chat template sees them (None: render none), as a chat completion with
        the default ``tool_choice`` passes them."""
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None


class AbortRequest(_Request):
    """``POST /abort_request`` (SGLang's): the request ``rid`` (as given to ``/generate``), or every
    live request with ``abort_all``."""

    rid: str = ""
    abort_all: bool = False

    @model_validator(mode="after")
    def _one_target(self) -> "AbortRequest":
        if bool(self.rid) == self.abort_all:
            raise ValueError("give exactly one of rid (a request id) and abort_all: true")
        return self


class ExportPrefixRequest(_Request):
    """``POST /export_prefix``: the cached prefix a request with this prompt would hit
    (``Engine.export_prefix``): exactly one of ``text`` (tokenized as ``/generate`` does) and
    ``input_ids`` (a chat's are its ``prompt_token_ids``: ``return_token_ids``), in the partition of
    ``cache_salt``; ``lora_path``: of a request applying that LoRA adapter (its name, as ``/generate``
    takes it). ``kv_from``: the KV of the positions from there on only (for a server that holds the KV
    before it: its ``cached_tokens``), the state whole."""

    text: str | None = None
    input_ids: list[int] | None = None
    cache_salt: str | None = None
    lora_path: str | None = None
    kv_from: int = Field(0, ge=0)

    _check_cache_salt = field_validator("cache_salt")(check_cache_salt)

    @model_validator(mode="after")
    def _one_prompt(self) -> "ExportPrefixRequest":
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("give exactly one of text or input_ids")
        return self


class UpdateWeightsFromDiskRequest(_Request):
    """``POST /update_weights_from_disk`` (SGLang's): serve the checkpoint at ``model_path`` (the same
    model's) from now on; ``Engine.update_weights_from_disk``. ``load_format``: the checkpoint's,
    safetensors (the only one hyla reads). ``flush_cache`` cannot be false: the prefix cache holds
    what the old weights computed, and the cache never changes what the model computes."""

    model_path: str = Field(min_length=1)
    abort_all_requests: bool = False
    weight_version: str | None = None
    load_format: Literal["auto", "safetensors"] | None = None
    flush_cache: Literal[True] = True

    @field_validator("weight_version")
    @classmethod
    def _check_weight_version(cls, value: str | None) -> str | None:
        if value is not None:
            check_weight_version(value)  # (the engine's rule: a 400 naming weight_version, not the checkpoint)
        return value


class LoadLoRAAdapterRequest(_Request):
    """``POST /v1/load_lora_adapter`` (vLLM's): load the PEFT LoRA adapter in the directory ``lora_path``
    under the name ``lora_name`` (``Engine.load_lora_adapter``); ``load_inplace``: an adapter already
    loaded under that name is replaced (unloaded first), else that is a 400."""

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)
    load_inplace: bool = False


class UnloadLoRAAdapterRequest(_Request):
    """``POST /v1/unload_lora_adapter`` (vLLM's): unload the adapter ``lora_name``
    (``Engine.unload_lora_adapter``). vLLM's ``lora_int_id`` is taken and not used: hyla names adapters."""

    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None


class DetokenizeRequest(_Request):
    """``POST /detokenize`` (vLLM's): ``tokens``, each in the model's vocabulary, back to text.
    ``model`` may be left out (the served model is meant)."""

    model: str | None = None
    tokens: list[int]


# --------------------------------------------------------------------------------------------
# responses
# --------------------------------------------------------------------------------------------
class _OmitsNone(BaseModel):
    """A response part whose ``OMITTED_IF_NONE`` fields (vLLM's extras, set only when asked for:
    ``return_token_ids``) are left out of the JSON while None, so an answer that did not ask for them
    is OpenAI's shape."""

    OMITTED_IF_NONE: ClassVar[tuple[str, ...]] = ()

    @model_serializer(mode="wrap")
    def _omit_none(self, handler: Any) -> Any:
        data = handler(self)
        for name in self.OMITTED_IF_NONE:
            if name in data and data[name] is None:
                del data[name]
        return data


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)

    def extend(self, other: "CompletionLogprobs") -> "CompletionLogprobs":
        """This one followed by ``other`` (``echo``: the prompt's, then the completion's); returns self."""
        self.tokens += other.tokens
        self.token_logprobs += other.token_logprobs
        self.top_logprobs += other.top_logprobs
        self.text_offset += other.text_offset
        return self


class CompletionChoice(_OmitsNone):
    OMITTED_IF_NONE = ("prompt_token_ids", "token_ids")

    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length", "abort"] | None = None  # abort: POST /abort_request
    # return_token_ids (vLLM's): the prompt's ids (streamed: in a choice's first chunk), the output's
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(_OmitsNone):
    OMITTED_IF_NONE = ("token_ids",)

    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls", "abort"] | None = None
    token_ids: list[int] | None = None  # return_token_ids (vLLM's): the output's ids


class ChatCompletionResponse(_OmitsNone):
    OMITTED_IF_NONE = ("prompt_token_ids",)

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_token_ids: list[int] | None = None  # return_token_ids (vLLM's): the rendered prompt's ids


class ChatChunkChoice(_OmitsNone):
    OMITTED_IF_NONE = ("token_ids",)

    index: int
    delta: dict[str, Any]  # {"role": "assistant", "content": ""} first, then {"content": ...}, {} last
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls", "abort"] | None = None
    token_ids: list[int] | None = None  # return_token_ids: the ids this chunk adds


class ChatCompletionChunk(_OmitsNone):
    OMITTED_IF_NONE = ("prompt_token_ids",)

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None  # return_token_ids: in each choice's first (role) chunk


class ModelCard(BaseModel):
    """OpenAI's model object (vLLM's ``root``, ``parent`` and ``max_model_len`` too), which is also Anthropic's
    (``type``, ``display_name``, ``created_at``): ``GET /v1/models`` answers both APIs' clients."""

    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "hyla"
    root: str
    parent: str | None = None  # a LoRA adapter's: the served model's name (vLLM's); the model's own: null
    max_model_len: int
    type: Literal["model"] = "model"
    display_name: str = ""
    created_at: str = ""

    @model_validator(mode="after")
    def _anthropics_fields(self) -> "ModelCard":
        self.display_name = self.display_name or self.id
        self.created_at = self.created_at or time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.created))
        return self


class ModelList(BaseModel):
    """OpenAI's list, with Anthropic's paging fields (one page: ``has_more`` false)."""

    object: Literal["list"] = "list"
    data: list[ModelCard]
    has_more: bool = False
    first_id: str | None = None
    last_id: str | None = None

    @model_validator(mode="after")
    def _page(self) -> "ModelList":
        if self.data:
            self.first_id, self.last_id = self.data[0].id, self.data[-1].id
        return self


class TokenizeResponse(BaseModel):
    """``/tokenize``'s answer: the ids, their number, the context length they must fit (prompt and
    answer together), and with ``return_token_strs`` each id's vocabulary string (else null)."""

    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str


