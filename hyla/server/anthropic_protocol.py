"""Anthropic's Messages API (``POST /v1/messages``, ``POST /v1/messages/count_tokens``): its bodies as
pydantic models, and the chat completion each request is underneath.

One idea: an Anthropic client (Claude Code, the ``anthropic`` SDK) talks to the same chat pipeline
as ``/v1/chat/completions``. A request becomes a chat completion request (``chat_payload``): ``system``
a system message; a user turn's ``tool_result`` blocks ``tool`` messages (before its text, as Anthropic
orders them); an assistant turn's ``tool_use`` blocks its ``tool_calls`` (the ``input`` object as the
arguments' JSON text), its ``thinking`` its ``reasoning_content``; ``tools`` (``input_schema``)
functions; ``tool_choice`` ``auto`` / ``any`` (required) / ``tool`` (a named function) / ``none``, its
``disable_parallel_tool_use`` the chat's ``parallel_tool_calls``; ``stop_sequences`` the stop strings;
``thinking.type`` the chat template's ``enable_thinking``; a final assistant turn is a prefill, which the
model continues (``continue_final_message``). The answer's reasoning (``--reasoning-parser``)
is a ``thinking`` block, its text a ``text`` block, its calls ``tool_use`` blocks (``message``).

Anthropic's API grows fields faster than a server can follow, and its clients send what their SDK
version knows: a field hyla does not know is ignored (``cache_control`` on any block, tool or the request:
hyla's prefix cache needs no marks, every prompt's prefix is cached; ``metadata``, ``service_tier``,
``speed``, ``output_config.effort``, a ``thinking`` block's ``signature``...), and ``redacted_thinking``
blocks are dropped (hyla has no signatures to check). What hyla cannot serve is a 400 naming it: a block
of another type (documents, server tool results; an image from a file), a tool of another type (``web_search``,
``bash``...: Anthropic's server tools), ``container``, ``mcp_servers``. ``output_config.format`` (a JSON
schema) constrains the answer as ``response_format`` does. Errors have Anthropic's shape:
``{"type": "error", "error": {"type", "message"}}`` (``error_bodies.anthropic_error_body``).
"""

from __future__ import annotations

import json
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator, model_validator
from typing_extensions import Annotated

from hyla.server.protocol import FieldError, _Request, check_chat_nesting, image_url_problem, text_content


class _Open(BaseModel):
    """Strict types and finite numbers, but fields hyla does not know ignored (the module's docstring)."""

    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


def _block_kind(value: Any) -> str:
    return value.get("type", "?") if isinstance(value, dict) else "?"


class TextBlock(_Open):
    type: Literal["text"]
    text: str


class ToolUseBlock(_Open):
    """An assistant turn's call, as an earlier answer gave it."""

    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(_Open):
    """A user turn's answer to a call: text, or text blocks (an image in it is a 400)."""

    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(b.text for b in self.content)


class ThinkingBlock(_Open):
    type: Literal["thinking"]
    thinking: str


class RedactedThinkingBlock(_Open):
    type: Literal["redacted_thinking"]


class Base64Source(_Open):
    """An image's bytes, base64 (Anthropic's ``{"type": "base64", "media_type", "data"}``)."""

    type: Literal["base64"]
    media_type: Literal["image/jpeg", "image/png", "image/gif", "image/webp"]
    data: str = Field(min_length=1)


class URLSource(_Open):
    """An image's http(s) URL (``{"type": "url", "url"}``), fetched where the server allows its host (``media.py``)."""

    type: Literal["url"]
    url: str = Field(min_length=1)


class ImageBlock(_Open):
    """A user turn's image, for a vision-language model (a ``file`` source is refused by Message: its 400 names it)."""

    type: Literal["image"]
    source: Annotated[Union[Annotated[Base64Source, Tag("base64")], Annotated[URLSource, Tag("url")]],
                      Discriminator(_block_kind)]

    def image_url(self) -> str:
        """The image as a chat's ``image_url``: a data URL, or the source's URL."""
        if isinstance(self.source, URLSource):
            return self.source.url
        return f"data:{self.source.media_type};base64,{self.source.data}"


Block = Annotated[Union[Annotated[TextBlock, Tag("text")], Annotated[ToolUseBlock, Tag("tool_use")],
                        Annotated[ToolResultBlock, Tag("tool_result")], Annotated[ThinkingBlock, Tag("thinking")],
                        Annotated[RedactedThinkingBlock, Tag("redacted_thinking")], Annotated[ImageBlock, Tag("image")]],
                  Discriminator(_block_kind)]


BLOCK_TYPES = ("text", "tool_use", "tool_result", "thinking", "redacted_thinking", "image")  # what a message may hold


class Message(_Open):
    role: Literal["user", "assistant"]
    content: str | list[Block]

    @field_validator("content", mode="before")
    @classmethod
    def _served_blocks(cls, content: Any) -> Any:
        if isinstance(content, list):
            for i, block in enumerate(content):
                kind = _block_kind(block)
                if kind not in BLOCK_TYPES:
                    raise FieldError(f"{i}.type", f"a content block of type {kind!r} is not supported (hyla "
                                                          f"serves {', '.join(BLOCK_TYPES)})")
                source = block.get("source") if kind == "image" else None
                if isinstance(source, dict) and source.get("type") not in ("base64", "url"):
                    raise FieldError(f"{i}.source.type", f"an image source of type {source.get('type')!r} is not "
                                                         "supported: the server holds no files (send base64 or a url)")
                url = source.get("url") if isinstance(source, dict) and source.get("type") == "url" else None
                problem = image_url_problem(url) if isinstance(url, str) else None
                if problem is not None:
                    raise FieldError(f"{i}.source.url", problem)
        return content

    @model_validator(mode="after")
    def _images_from_the_user(self) -> "Message":
        if self.role == "assistant" and any(isinstance(b, ImageBlock) for b in self.blocks()):
            raise FieldError("content", "an assistant turn holds no image (images come in user turns)")
        return self

    def blocks(self) -> list[Any]:
        return [TextBlock(type="text", text=self.content)] if isinstance(self.content, str) else self.content


class CustomTool(_Open):
    """A function the model may call (``input_schema``: its arguments' JSON Schema). Anthropic's server
    tools (``web_search_20250305``...) have other types: a 400."""

    type: str | None = None
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    input_schema: dict[str, Any]

    @field_validator("type")
    @classmethod
    def _custom(cls, value: str | None) -> str | None:
        if value not in (None, "custom"):
            raise ValueError(f"a tool of type {value!r} is not supported: hyla runs no server-side tools (a tool "
                             "is a function the client runs: type 'custom', or none)")
        return value

    def chat_tool(self) -> dict[str, Any]:
        fn: dict[str, Any] = {"name": self.name, "parameters": self.input_schema}
        if self.description is not None:
            fn["description"] = self.description
        return {"type": "function", "function": fn}


class ToolChoice(_Open):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None

    def chat_choice(self) -> Any:
        """The chat completion's ``tool_choice``."""
        if self.type == "tool":
            return {"type": "function", "function": {"name": self.name}}
        return {"auto": "auto", "any": "required", "none": "none"}[self.type]


class Thinking(_Open):
    """Whether the model thinks (the chat template's ``enable_thinking``): ``disabled`` no, the others
    (``enabled``, ``adaptive``...) yes; a budget is not enforced (``max_tokens`` bounds the answer)."""

    type: str


class OutputFormat(_Open):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Open):
    format: OutputFormat | None = None


class _Counted(_Request):
    """What a prompt is made of: ``messages``, ``system``, ``tools`` (``count_tokens`` takes these)."""

    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)

    model: str
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[CustomTool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None

    @field_validator("messages", "tools", mode="before")
    @classmethod
    def _check_nesting(cls, value: Any, info: Any) -> Any:
        return check_chat_nesting(value, str(info.field_name))

    @field_validator("tool_choice")
    @classmethod
    def _named(cls, value: ToolChoice | None) -> ToolChoice | None:
        if value is not None and (value.type == "tool") != (value.name is not None):
            raise ValueError("tool_choice type 'tool' names a tool (name), and only it")
        return value

    def chat_messages(self) -> list[dict[str, Any]]:
        """The conversation as chat completion messages (the module's docstring)."""
        out: list[dict[str, Any]] = []
        if self.system:
            out.append({"role": "system", "content": self.system if isinstance(self.system, str)
                        else text_content([b.text for b in self.system])})
        for m in self.messages:
            blocks = m.blocks()
            if m.role == "user":
                out += [{"role": "tool", "tool_call_id": b.tool_use_id, "content": b.text()}
                        for b in blocks if isinstance(b, ToolResultBlock)]
                text = [b.text for b in blocks if isinstance(b, TextBlock)]
                if any(isinstance(b, ImageBlock) for b in blocks):  # text and images, in order
                    out.append({"role": "user", "content": [
                        {"type": "text", "text": b.text} if isinstance(b, TextBlock) else
                        {"type": "image_url", "image_url": {"url": b.image_url()}}
                        for b in blocks if isinstance(b, (TextBlock, ImageBlock))]})
                elif text or not any(isinstance(b, ToolResultBlock) for b in blocks):
                    out.append({"role": "user", "content": text_content(text)})
                continue
            message: dict[str, Any] = {"role": "assistant",
                                       "content": "".join(b.text for b in blocks if isinstance(b, TextBlock))}
            thoughts = "".join(b.thinking for b in blocks if isinstance(b, ThinkingBlock))
            if thoughts:
                message["reasoning_content"] = thoughts
            calls = [{"id": b.id, "type": "function",
                      "function": {"name": b.name, "arguments": json.dumps(b.input, ensure_ascii=False)}}
                     for b in blocks if isinstance(b, ToolUseBlock)]
            if calls:
                message["tool_calls"] = calls
            out.append(message)
        return out

    def chat_payload(self) -> dict[str, Any]:
        """The chat completion request underneath (less the sampling fields: ``MessagesRequest``'s)."""
        payload: dict[str, Any] = {"model": self.model, "messages": self.chat_messages()}
        if self.messages[-1].role == "assistant":  # a prefill: the model continues the final assistant turn
            payload.update(add_generation_prompt=False, continue_final_message=True)
        if self.tools:
            payload["tools"] = [t.chat_tool() for t in self.tools]
            if self.tool_choice is not None:
                payload["tool_choice"] = self.tool_choice.chat_choice()
                payload["parallel_tool_calls"] = not self.tool_choice.disable_parallel_tool_use
        elif self.tool_choice is not None and self.tool_choice.type != "none":
            raise FieldError("tool_choice", "tool_choice needs tools")
        if self.thinking is not None:
            payload["chat_template_kwargs"] = {"enable_thinking": self.thinking.type != "disabled"}
        return payload


class CountTokensRequest(_Counted):
    """``POST /v1/messages/count_tokens``."""


class MessagesRequest(_Counted):
    """``POST /v1/messages``."""

    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    output_config: OutputConfig | None = None
    # Anthropic's server-side features hyla has none of: refused, never ignored (they change the answer)
    container: Any = None
    mcp_servers: Any = None

    @field_validator("container", "mcp_servers")
    @classmethod
    def _unsupported(cls, value: Any, info: Any) -> Any:
        if value is not None:
            raise ValueError(f"{info.field_name} is not supported: hyla runs no server-side tools")
        return value

    def chat_payload(self) -> dict[str, Any]:
        payload = super().chat_payload()
        payload["max_completion_tokens"] = self.max_tokens
        fmt = self.output_config.format if self.output_config is not None else None
        if fmt is not None:
            payload["response_format"] = {"type": "json_schema",
                                          "json_schema": {"name": "output", "schema": fmt.schema_}}
        for name, value in (("stop", self.stop_sequences), ("temperature", self.temperature), ("top_p", self.top_p),
                            ("top_k", self.top_k or None)):  # (top_k 0: no limit, as Anthropic reads it)
            if value is not None:
                payload[name] = value
        return payload


# --------------------------------------------------------------------------------------------
# answers
# --------------------------------------------------------------------------------------------
def stop_reason(finish: dict[str, Any] | None, called: bool) -> tuple[str, str | None]:
    """``(stop_reason, stop_sequence)`` of an answer that ended with the engine's ``finish`` reason
    (``called``: it has calls): ``tool_use``, ``stop_sequence`` (a stop string matched), ``max_tokens``, or
    ``end_turn`` (the model's end of turn)."""
    kind = (finish or {}).get("type")
    matched = (finish or {}).get("matched")
    if called and kind == "stop":
        return "tool_use", None
    if kind == "length":
        return "max_tokens", None
    if isinstance(matched, str):
        return "stop_sequence", matched
    return "end_turn", None


def tool_input(arguments: str) -> dict[str, Any]:
    """A call's ``input`` object from its arguments' JSON text (arguments that are no object: under
    ``arguments``, as no key of the tool's schema could hold them)."""
    try:
        value = json.loads(arguments)
    except ValueError:
        value = arguments
    return value if isinstance(value, dict) else {"arguments": value}


def usage(meta: dict[str, Any]) -> dict[str, int]:
    """Anthropic's usage: ``input_tokens`` are the prompt's tokens not read from the prefix cache
    (``cache_read_input_tokens``), as Anthropic counts them."""
    prompt, cached = meta.get("prompt_tokens", 0), meta.get("cached_tokens", 0)
    return {"input_tokens": prompt - cached, "output_tokens": meta.get("completion_tokens", 0),
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}

