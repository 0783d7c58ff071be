"""Request and response bodies of OpenAI's Responses API (``POST /v1/responses``,
``GET /v1/responses/{id}``, ``POST /v1/responses/input_tokens``), as pydantic models, with ``protocol.py``'s
rules: strict types, unknown fields refused (400 naming the field), a lone UTF-16 surrogate refused,
``null`` for an optional field is its default, a rule over several fields names the field that breaks it
(``FieldError``).

Supported (docs/server.md): ``input`` as a string (one user message) or a list of items — messages
(``role`` user / system / developer / assistant, content a string or ``input_text`` /
``output_text`` parts), ``function_call``, ``function_call_output`` and ``reasoning`` items (what a
client copies back from an earlier response's ``output``), ``item_reference`` (such an item of a
stored response, by id) — ``instructions``,
``previous_response_id``, ``store``, ``max_output_tokens``, ``temperature``, ``top_p``, ``seed``
(hyla's extra), ``stream``, function ``tools``, ``tool_choice``, ``parallel_tool_calls``,
``text.format`` (text / json_object / json_schema), ``metadata``, ``user``, ``top_logprobs`` (0 to 20) with
``include: ["message.output_text.logprobs"]`` (the message text's logprobs), ``max_tool_calls`` (a bound on
built-in tool calls, of which hyla has none: echoed, no effect), ``reasoning`` (accepted,
no effect: a model thinks as its chat template says); what the Agents SDK and Codex send by default
is accepted and ignored (``include``'s other values, ``prompt_cache_key``, ``prompt_cache_retention``,
``safety_identifier``, ``service_tier``, ``text.verbosity``), and so are ``stream_options`` and a message's
``phase``. ``truncation: "auto"`` drops the conversation's oldest turns where the prompt does not fit.
``background: true`` runs the response on the server, not on the client's connection (it must be stored).
``conversation`` reads and extends a conversation of the Conversations API (conversations.py). Anything else
(other item or content types, other tool types...) is a 400 naming it.
"""

from __future__ import annotations

import json
import re
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from hyla.tokenizer.chat_template import check_nesting
from hyla.server.protocol import (
    MAX_SEED, FieldError, FunctionDefinition, _Request, _Strict, check_cache_salt, check_chat_nesting,
    check_stream_options, default_if_null, image_url_problem, text_content,
)

MAX_TOP_LOGPROBS = 20  # OpenAI's bound on top_logprobs (chat's too)
LOGPROBS_INCLUDE = "message.output_text.logprobs"  # the include value that asks for the message's logprobs
MAX_METADATA_KEYS = 16  # OpenAI's limits on metadata
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512
RESPONSES_NULL_MEANS_DEFAULT = ("stream", "store", "parallel_tool_calls", "background")


def check_metadata(value: dict[str, str] | None) -> dict[str, str] | None:
    """``metadata`` (a response's, a conversation's) within OpenAI's limits."""
    if value is not None:
        if len(value) > MAX_METADATA_KEYS:
            raise ValueError(f"metadata holds at most {MAX_METADATA_KEYS} keys")
        for k, v in value.items():
            if len(k) > MAX_METADATA_KEY_CHARS or len(v) > MAX_METADATA_VALUE_CHARS:
                raise ValueError(f"metadata keys hold at most {MAX_METADATA_KEY_CHARS} characters, values "
                                 f"{MAX_METADATA_VALUE_CHARS}")
    return value


# --------------------------------------------------------------------------------------------
# input items
# --------------------------------------------------------------------------------------------
class InputTextPart(_Strict):
    """A message's text part: ``input_text`` (what a user, system or developer wrote) or
    ``output_text`` (an earlier assistant answer copied back; its ``annotations`` and ``logprobs``
    are accepted and ignored)."""

    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class InputImagePart(_Strict):
    """A user message's image (``input_image``), for a vision-language model: ``image_url`` a data URL or an
    http(s) URL (fetched where the server allows its host: ``media.py``); the server holds no files (``file_id``
    is refused); ``detail`` accepted."""

    type: Literal["input_image"]
    image_url: str = Field(min_length=1)
    detail: Literal["auto", "low", "high"] | None = None


class MessageItem(_Strict):
    """``{"role", "content"}`` (``type: "message"`` optional; ``id`` / ``status`` of an output item
    copied back are accepted, and ``phase``, which the SDK's message types carry (``model_dump()`` of an
    output message copies it back as null): no effect)."""

    type: Literal["message"] | None = None
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[InputTextPart | InputImagePart]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None
    phase: Literal["commentary", "final_answer"] | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _known_parts_only(cls, content: Any) -> Any:
        if isinstance(content, list):
            for i, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind not in ("input_text", "output_text", "input_image"):
                    raise FieldError(f"{i}.type", f"only input_text, output_text and input_image content parts are "
                                                  f"supported, got {kind!r}")
                if kind == "input_image" and part.get("file_id") is not None:
                    raise FieldError(f"{i}.file_id", "this server holds no files: send the image as a data URL "
                                                     "(image_url)")
                url = part.get("image_url") if kind == "input_image" else None
                problem = image_url_problem(url) if isinstance(url, str) else None
                if problem is not None:
                    raise FieldError(f"{i}.image_url", problem)
        return content

    @model_validator(mode="after")
    def _images_from_others(self) -> "MessageItem":
        if self.role == "assistant" and isinstance(self.content, list) and any(
                isinstance(p, InputImagePart) for p in self.content):
            raise FieldError("content", "an assistant message holds no input_image (images come in user, system "
                                        "and developer messages)")
        return self

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(
            p.text for p in self.content if isinstance(p, InputTextPart))

    def chat_content(self) -> str | list[dict[str, Any]]:
        """The content as a chat message's: the text, or with images, text and ``image_url`` parts in order."""
        if isinstance(self.content, str):
            return self.content
        if not any(isinstance(p, InputImagePart) for p in self.content):
            return text_content([p.text for p in self.content if isinstance(p, InputTextPart)])
        return [{"type": "text", "text": p.text} if isinstance(p, InputTextPart)
                else {"type": "image_url", "image_url": {"url": p.image_url}} for p in self.content]


class FunctionCallItem(_Strict):
    """A function call the model made (an earlier response's output item, sent back)."""

    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallOutputItem(_Strict):
    """The result of the call ``call_id``: a string, or text parts."""

    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str | list[InputTextPart]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(p.text for p in self.output)


class ReasoningTextPart(_Strict):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(_Strict):
    """An earlier response's reasoning, sent back: its text goes to the next assistant turn as
    ``reasoning_content`` (the chat template decides whether it is rendered)."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[ReasoningTextPart] = Field(default_factory=list)
    content: list[ReasoningTextPart] | None = None
    encrypted_content: None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    def text(self) -> str:
        return "".join(p.text for p in self.content or ())


class ItemReference(_Strict):
    """An output item of a stored response, by its ``id`` (what a client that keeps the conversation
    sends instead of the item itself, as the Vercel AI SDK does with ``store``); the server puts the
    item in its place (``ResponsesRoutes.resolve``). ``type`` may be left out, as the SDK's type allows."""

    type: Literal["item_reference"] | None = None
    id: str = Field(min_length=1)


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem | ItemReference


def output_item_id(prefix: str, response_id: str, n: int | None = None) -> str:
    """An output item's id: its kind's ``prefix`` (``rs``, ``msg``, ``fc``) and its response's id's hex,
    and for the ``n``-th function call ``_<n>`` (``msg_<hex>``, ``fc_<hex>_1``): so the response, and the
    worker that stores it, can be found from an item (:func:`response_of_item`, which ``hyla route``
    reads to route an ``item_reference``)."""
    hex_part = response_id.removeprefix("resp_")
    return f"{prefix}_{hex_part}" + (f"_{n}" if n is not None else "")


_OUTPUT_ITEM_ID = re.compile(r"(?:rs|msg|fc)_([0-9a-f]{32})(?:_\d+)?")


def response_of_item(item_id: str) -> str | None:
    """The id of the response whose output item ``item_id`` is (:func:`output_item_id`), or None for an id of
    no such form."""
    m = _OUTPUT_ITEM_ID.fullmatch(item_id)
    return f"resp_{m.group(1)}" if m else None


def typed_event(kind: str, **fields: Any) -> str:
    """One event of a Responses stream as OpenAI sends it: an ``event: <type>`` line and a ``data:`` line
    whose JSON holds ``type`` and the fields (a worker's stream, and the end ``hyla route`` writes for one
    its worker cut)."""
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields}, ensure_ascii=False)}\n\n"


ITEM_TYPES: dict[str, type[_Strict]] = {"message": MessageItem, "function_call": FunctionCallItem,
                                        "function_call_output": FunctionCallOutputItem, "reasoning": ReasoningItem,
                                        "item_reference": ItemReference}


def item_type(value: dict[str, Any]) -> Any:
    """An input item's type: its ``type``; left out, ``item_reference`` for ``{"id"}`` alone (as the SDK's
    type allows), else ``message``."""
    return value.get("type") or ("item_reference" if set(value) - {"type"} == {"id"} else "message")


def _item(value: Any, index: int) -> InputItem:
    """One input item, validated by its ``type`` (a message may leave it out, and an item reference,
    ``{"id"}`` alone); a broken rule is a ``FieldError`` naming ``<index>.<field>``."""
    if not isinstance(value, dict):
        raise FieldError(str(index), "an input item must be an object")
    kind = item_type(value)
    model = ITEM_TYPES.get(kind) if isinstance(kind, str) else None
    if model is None:
        raise FieldError(f"{index}.type", f"unsupported input item type {kind!r}; supported: {', '.join(ITEM_TYPES)}")
    try:
        return model.model_validate(value)  # type: ignore[return-value]
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = [str(x) for x in first.get("loc", ())]
        cause = (first.get("ctx") or {}).get("error")
        if isinstance(cause, FieldError):
            loc.append(cause.param)
        msg = first.get("msg", "invalid value").removeprefix("Value error, ")
        raise FieldError(".".join([str(index), *loc]), f"input[{index}]: {msg}") from None


# --------------------------------------------------------------------------------------------
# tools, text format
# --------------------------------------------------------------------------------------------
class FunctionTool(FunctionDefinition):
    """A function tool (the Responses shape: chat's function definition at the top level, beside
    ``type``, not in a ``function`` object)."""

    type: Literal["function"]

    def chat_tool(self) -> dict[str, Any]:
        """The same tool as chat completions takes it."""
        return {"type": "function", "function": self.model_dump(exclude={"type"}, exclude_none=True)}


class FunctionToolChoice(_Strict):
    type: Literal["function"]
    name: str


class TextFormat(_Strict):
    """``text.format``: ``text`` (unconstrained), ``json_object`` (any JSON object) or ``json_schema``
    (``name`` and ``schema``: the output follows the schema; ``strict`` changes nothing, as in chat's
    ``response_format``)."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _check_fields(self) -> "TextFormat":
        if self.type == "json_schema":
            if self.name is None:
                raise FieldError("name", "text.format type json_schema needs a name")
            if self.schema_ is None:
                raise FieldError("schema", "text.format type json_schema needs a schema")
        else:
            for field in ("name", "description", "schema_", "strict"):
                if getattr(self, field) is not None:
                    raise FieldError(field.rstrip("_"), f"text.format type {self.type} takes no {field.rstrip('_')}")
        return self

    def response_format(self) -> dict[str, Any]:
        """The same constraint as chat's ``response_format``."""
        if self.type != "json_schema":
            return {"type": self.type}
        schema = {"name": self.name, "schema": self.schema_}
        if self.description is not None:
            schema["description"] = self.description
        if self.strict is not None:
            schema["strict"] = self.strict
        return {"type": "json_schema", "json_schema": schema}

    def echo(self) -> dict[str, Any]:
        return self.model_dump(by_alias=True, exclude_none=True)


class TextConfig(_Strict):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # accepted, no effect (Codex sends it)


class ReasoningConfig(_Strict):
    """Accepted, no effect (a model thinks as its chat template says): every value the SDK's
    ``Reasoning`` takes."""

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None
    context: Literal["auto", "current_turn", "all_turns"] | None = None
    mode: str | None = None  # (OpenAI's "standard" or "pro", an open set in the SDK)


class StreamOptions(_Strict):
    """``stream_options``: accepted, no effect (hyla's events carry no ``obfuscation`` field to leave out)."""

    include_obfuscation: bool | None = None


# --------------------------------------------------------------------------------------------
# the request
# --------------------------------------------------------------------------------------------
class ConversationRef(_Strict):
    """A Responses request's ``conversation`` as an object."""

    id: str = Field(min_length=1)


class ResponsesRequest(_Request):
    """``POST /v1/responses``."""

    model: str
    input: str | list[Any]
    instructions: str | None = None
    previous_response_id: str | None = Field(None, min_length=1)
    store: bool | None = True
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    # OpenAI's background mode: answered at once (status queued), run to its end whatever the client does,
    # polled with GET (or streamed, and streamed again from any event: GET ?stream=true&starting_after=N),
    # cancelled with POST .../cancel
    background: bool | None = False
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: bool | None = True
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    # vLLM's: the turn shares cached prefixes only with requests of the same salt (protocol.cache_namespace)
    cache_salt: str | None = None
    # what clients send by default and hyla accepts without acting on (the Agents SDK and Codex send
    # include; Codex prompt_cache_key, which the exact prefix cache needs no hint for)
    include: list[str] | None = None  # only LOGPROBS_INCLUDE acts (no encrypted reasoning, ...)
    prompt_cache_key: str | None = None  # (hyla route routes by it)
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    safety_identifier: str | None = None
    truncation: Literal["disabled", "auto"] | None = None  # auto: the oldest turns dropped to fit (_truncated)
    service_tier: str | None = None
    # logprobs of the message text: served with include ["message.output_text.logprobs"] (wants_logprobs)
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    max_tool_calls: int | None = Field(None, ge=1)  # OpenAI's bound on built-in tool calls: hyla has none (echoed)
    # OpenAI's Conversations API: the conversation's items go first, and this turn's input and output items are added
    # to it as the response ends (conversations.py); its id, or {"id": ...}
    conversation: str | ConversationRef | None = None

    _null_is_default = field_validator(*RESPONSES_NULL_MEANS_DEFAULT, mode="before")(default_if_null)
    _check_cache_salt = field_validator("cache_salt")(check_cache_salt)

    @field_validator("input", mode="before")
    @classmethod
    def _check_input(cls, value: Any) -> Any:
        if isinstance(value, str):
            return value
        if not isinstance(value, list):
            raise ValueError("input must be a string or a list of input items")
        if not value:
            raise ValueError("input must not be empty")
        for i, item in enumerate(value):  # each item as deep as a chat message may be
            check_nesting(item, f"input[{i}]")
        return [_item(v, i) for i, v in enumerate(value)]

    @field_validator("tools", mode="before")
    @classmethod
    def _function_tools_only(cls, value: Any) -> Any:
        if isinstance(value, list):
            check_chat_nesting(value, "tools")
            for i, tool in enumerate(value):
                kind = tool.get("type") if isinstance(tool, dict) else None
                if kind != "function":
                    raise FieldError(f"{i}.type", f"only function tools are supported, got {kind!r}")
                if "function" in tool:  # chat completions' shape
                    raise FieldError(f"{i}.function", "a Responses function tool has its name, description and "
                                                      "parameters at the top level, not in a function object")
        return value

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _function_choice_only(cls, value: Any) -> Any:
        """A message naming what is wrong (the union's own: "Input should be 'none', 'auto' or
        'required' (and 1 more error(s))"); the union checks the rest."""
        if isinstance(value, str) and value not in ("none", "auto", "required"):
            raise ValueError(f"tool_choice must be none, auto, required or {{\"type\": \"function\", \"name\": ...}}, "
                             f"got {value!r}")
        if isinstance(value, dict):
            if value.get("type") != "function":  # allowed_tools, hosted tools, custom, mcp
                raise FieldError("type", f"only function tool choices are supported, got {value.get('type')!r}")
            if "name" not in value:
                raise FieldError("name", "a function tool choice needs the function's name")
        return value

    _check_metadata = field_validator("metadata")(check_metadata)

    @model_validator(mode="after")
    def _check_tools(self) -> "ResponsesRequest":
        names = [t.name for t in self.tools or ()]
        if len(set(names)) != len(names):
            raise FieldError("tools", "tools name the same function twice")
        if isinstance(self.tool_choice, FunctionToolChoice) and self.tool_choice.name not in names:
            raise FieldError("tool_choice", f"tool_choice names the function {self.tool_choice.name!r}, which is "
                                            f"not in tools ({', '.join(names) or 'none given'})")
        if self.tool_choice in ("required",) and not names:
            raise FieldError("tool_choice", "tool_choice required needs tools")
        forced = self.tool_choice == "required" or isinstance(self.tool_choice, FunctionToolChoice)
        if forced and self.text_format().type != "text":
            raise FieldError("text.format", "text.format cannot be combined with tool_choice required or a named function")
        return self

    @model_validator(mode="after")
    def _check_stream_options(self) -> "ResponsesRequest":
        check_stream_options(self.stream_options, self.stream)
        if self.background and self.store is False:
            raise FieldError("background", "background responses must be stored: background needs store true")
        return self

    def conversation_id(self) -> str | None:
        """The id of the conversation the turn belongs to (``conversation``), or None."""
        return self.conversation.id if isinstance(self.conversation, ConversationRef) else self.conversation

    def items(self) -> list[InputItem]:
        """The input as items (a string is one user message)."""
        if isinstance(self.input, str):
            return [MessageItem(role="user", content=self.input)]
        return list(self.input)

    def wants_logprobs(self) -> bool:
        """Whether the message's ``output_text`` carries ``logprobs`` (``include`` asks for them; ``top_logprobs``
        alone only says how many alternatives, as OpenAI's)."""
        return LOGPROBS_INCLUDE in (self.include or ())

    def text_format(self) -> TextFormat:
        return self.text.format if self.text is not None and self.text.format is not None else TextFormat(type="text")

    def text_echo(self) -> dict[str, Any]:
        """``text`` as the response echoes it: the format, and the verbosity where one was given."""
        verbosity = self.text.verbosity if self.text is not None else None
        return {"format": self.text_format().echo(), **({"verbosity": verbosity} if verbosity is not None else {})}

    def tool_choice_echo(self) -> str | dict[str, Any]:
        if self.tool_choice is None:
            return "auto"
        return self.tool_choice if isinstance(self.tool_choice, str) else self.tool_choice.model_dump()


class InputTokensRequest(ResponsesRequest):
    """``POST /v1/responses/input_tokens``: a Responses request whose prompt is counted, not answered, checked by
    the same rules; ``model`` may be left out (the served model), as the SDK's type allows."""

    model: str | None = None


# --------------------------------------------------------------------------------------------
# the response
# --------------------------------------------------------------------------------------------
class InputTokensDetails(BaseModel):
    cached_tokens: int = 0
    cache_write_tokens: int = 0  # (the SDK's model requires it; nothing is billed here)


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int = 0
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int = 0
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int = 0


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseError(BaseModel):
    """A failed response's ``error`` (the SDK's ``ResponseError``: ``code`` one of OpenAI's, ``failure_code``)."""

    code: Literal["server_error", "rate_limit_exceeded", "invalid_prompt"]
    message: str


class ResponseObject(BaseModel):
    """A response, as returned, streamed in ``response.completed`` and stored. ``output`` holds
    plain dicts (the output items, docs/server.md)."""

    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    model: str
    status: Literal["queued", "in_progress", "completed", "incomplete", "cancelled", "failed"]
    incomplete_details: IncompleteDetails | None = None
    error: ResponseError | None = None
    instructions: str | None = None
    previous_response_id: str | None = None
    output: list[dict[str, Any]] = Field(default_factory=list)
    usage: ResponseUsage | None = None
    tools: list[dict[str, Any]] = Field(default_factory=list)
    tool_choice: str | dict[str, Any] = "auto"
    parallel_tool_calls: bool = True
    temperature: float | None = None
    top_p: float | None = None
    max_output_tokens: int | None = None
    max_tool_calls: int | None = None
    top_logprobs: int | None = None
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    reasoning: dict[str, Any] | None = None
    metadata: dict[str, str] = Field(default_factory=dict)
    store: bool = True
    background: bool = False
    truncation: Literal["disabled", "auto"] = "disabled"
    user: str | None = None
    conversation: dict[str, str] | None = None  # {"id": ...} of the conversation it belongs to


# --------------------------------------------------------------------------------------------
# conversations (OpenAI's Conversations API: conversations.py)
# --------------------------------------------------------------------------------------------
MAX_CONVERSATION_ITEMS = 20  # items one request may add (OpenAI's bound)


def _conversation_items(value: Any) -> Any:
    """A request's ``items``: a list of at most ``MAX_CONVERSATION_ITEMS`` input items, each validated as a
    Responses request's input item (an ``item_reference`` too: the server resolves it)."""
    if value is None:
        return None
    if not isinstance(value, list):
        raise ValueError("items must be a list of items")
    if len(value) > MAX_CONVERSATION_ITEMS:
        raise ValueError(f"at most {MAX_CONVERSATION_ITEMS} items may be added at a time, got {len(value)}")
    for i, item in enumerate(value):
        check_nesting(item, f"items[{i}]")
    return [_item(v, i) for i, v in enumerate(value)]


class ConversationCreateRequest(_Request):
    """``POST /v1/conversations``: its first items (up to 20) and metadata."""

    items: list[Any] | None = None
    metadata: dict[str, str] | None = None

    _check_items = field_validator("items", mode="before")(_conversation_items)
    _check_metadata = field_validator("metadata")(check_metadata)


class ConversationUpdateRequest(_Request):
    """``POST /v1/conversations/{id}``: its metadata, replaced."""

    metadata: dict[str, str]

    _check_metadata = field_validator("metadata")(check_metadata)


class ConversationItemsRequest(_Request):
    """``POST /v1/conversations/{id}/items``: items added at its end (1 to 20)."""

    items: list[Any] = Field(min_length=1)

    _check_items = field_validator("items", mode="before")(_conversation_items)
