"""``POST /v1/messages`` and ``POST /v1/messages/count_tokens``: Anthropic's Messages API over the chat
pipeline, for Anthropic clients (Claude Code: ``ANTHROPIC_BASE_URL=http://host:port``).

A request becomes the chat completion underneath (``anthropic_protocol``), rendered, admitted and
generated as one; its answer is parsed by the same reasoning and tool-call parsers and written in
Anthropic's shape: whole (``message``), or streamed as Anthropic's events — ``message_start``, then per
content block ``content_block_start``, its deltas (``thinking_delta``, ``text_delta``, a call's
arguments as ``input_json_delta`` as the model writes them: ``tool_call_stream``'s incremental
stream), ``content_block_stop``; then ``message_delta`` (``stop_reason``, the usage) and
``message_stop``. The API key is ``x-api-key`` (Anthropic's header) or ``Authorization: Bearer``. Every
error, a body pydantic refuses included, has Anthropic's shape (``error_bodies.anthropic_error_body``: whoever answers, ``APIError.response``); after
a stream started, an ``error`` event.
"""

from __future__ import annotations

import json
import secrets
import time
import uuid
from typing import TYPE_CHECKING, Any, AsyncIterator

from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from hyla.server.anthropic_protocol import (CountTokensRequest, MessagesRequest, stop_reason, tool_input,
                                            usage)
from hyla.server.auth import bearer_key_matches
from hyla.server.disaggregation import disaggregation_answer
from hyla.server.error_bodies import anthropic_error_body
from hyla.server.errors import APIError, engine_error, validation_error
from hyla.server.generation import Generation, Job, json_answer
from hyla.server.openai_routes import (CHAT_CHECKPOINTS, REQUEST_ID_HEADER, AnswerStream, admit_chat,
                                       chat_image_tokens, chat_images, final_text, forced_tool_grammar, image_tokens,
                                       job_rids, kept_markers, opens_thinking, output_budget, render_chat,
                                       answer_in_order, thinking_first)
from hyla.server.protocol import ChatCompletionRequest
from hyla.tokenizer.tokenizer import ChatEncoding

if TYPE_CHECKING:
    from hyla.engine.engine import Engine
    from hyla.server.app import Server

ENDPOINT = "messages"


class AnthropicRoutes:
    def __init__(self, server: Server):
        self.server = server

    def router(self) -> APIRouter:
        router = APIRouter()
        router.post("/v1/messages")(self.messages)
        router.post("/v1/messages/count_tokens")(self.count_tokens)
        return router

    async def messages(self, request: Request) -> Response:
        arrival = time.monotonic()
        try:
            body = await self._body(request, MessagesRequest)
            engine, chat, encoding = await self._prompt(body)
            images = await chat_images(self.server, engine, chat.messages)
            max_new = output_budget(engine, len(encoding.ids) + image_tokens(images), body.max_tokens, "max_tokens",
                                    "messages")
            grammar = {**forced_tool_grammar(self.server, chat), **kept_markers(self.server, chat)}
            prefill = final_text(chat.messages) if chat.continue_final_message else None
            params = thinking_first(self.server, encoding.text, {**chat.sampling_params(max_new, 0, 0), **grammar},
                                    prefill=prefill)
            (rid,) = job_rids(None, request.headers.get(REQUEST_ID_HEADER), 1)
            job = Job(encoding.ids, params, checkpoints=list(encoding.boundaries), speculative_checkpoints=True,
                      rid=rid, image_data=images,
                      lora_name=self.server.check_model(body.model))  # (a LoRA adapter's name, or None)
            answer = await disaggregation_answer(self.server, ENDPOINT, [job], arrival, request)  # (behind a router)
            if answer is not None:
                return answer
            gen = await self.server.start_generation(ENDPOINT, [job], arrival)
        except APIError as exc:
            return _error(exc)
        turn = _Turn(self.server, chat, f"msg_{uuid.uuid4().hex[:24]}",
                     opens_thinking(self.server, encoding.text, prefill), len(encoding.ids))
        if body.stream:
            return gen.stream(turn.events(gen))
        try:
            (choice,) = await gen.collect(request)
        except APIError as exc:
            return _error(exc)
        return await json_answer(lambda: turn.message(choice.text, choice.meta))

    async def count_tokens(self, request: Request) -> Response:
        """``{"input_tokens": N}``: the tokens of the prompt ``POST /v1/messages`` would render."""
        try:
            body = await self._body(request, CountTokensRequest)
            engine, chat, encoding = await self._prompt(body)
            images = await chat_image_tokens(self.server, engine, chat.messages)  # (from the images' headers)
        except APIError as exc:
            return _error(exc)
        return JSONResponse({"input_tokens": len(encoding.ids) + images})

    async def _body(self, request: Request, model: type[CountTokensRequest]) -> Any:
        """The API key checked (``x-api-key`` or a bearer token), then the body read and validated: a 401 or a 400
        (naming the field) as an ``APIError``."""
        key = self.server.api_key
        if key is not None and not (secrets.compare_digest((request.headers.get("x-api-key") or "").encode(),
                                                           key.encode())
                                    or bearer_key_matches(request.headers.get("authorization"), key)):
            raise APIError(401, "missing or invalid API key (send 'x-api-key: <key>' or 'Authorization: Bearer <key>')",
                           type="authentication_error")
        try:
            raw = await request.json()
        except (ValueError, RecursionError):  # (not UTF-8, not JSON, or nested too deep for Python to read)
            raise APIError(400, "the body is not JSON (or is nested too deep)") from None
        try:
            return model.model_validate(raw)
        except ValidationError as exc:
            raise validation_error(RequestValidationError(exc.errors())) from None

    async def _prompt(self, body: CountTokensRequest) -> tuple[Engine, ChatCompletionRequest, ChatEncoding]:
        """The chat completion underneath, rendered and tokenized."""
        engine = admit_chat(self.server, body.model)
        try:
            chat = ChatCompletionRequest.model_validate(body.chat_payload())
        except ValidationError as exc:
            raise validation_error(RequestValidationError(exc.errors())) from None
        except ValueError as exc:  # (a FieldError of the conversion)
            raise APIError(400, str(exc), param=getattr(exc, "param", None)) from None
        encoding = await render_chat(self.server, engine.tokenizer, chat.messages, chat.template_tools(),
                                     chat.chat_template_kwargs, add_generation_prompt=chat.add_generation_prompt,
                                     continue_final_message=chat.continue_final_message,
                                     max_boundaries=CHAT_CHECKPOINTS)
        return engine, chat, encoding


def _error(exc: APIError) -> JSONResponse:
    """``exc`` in Anthropic's shape, its field named in the message (``APIError.anthropic_response``)."""
    return exc.anthropic_response()


def _event(kind: str, **fields: Any) -> str:
    """One of Anthropic's stream events: an ``event:`` line and a ``data:`` line with its ``type``."""
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields}, ensure_ascii=False)}\n\n"


class _Turn:
    """One answer: its chat request, id, whether it starts inside a think block, its prompt's length."""

    def __init__(self, server: Server, chat: ChatCompletionRequest, rid: str, in_thinking: bool, prompt_tokens: int):
        self.server, self.chat, self.rid = server, chat, rid
        self.in_thinking, self.prompt_tokens = in_thinking, prompt_tokens

    def message(self, output: str, meta: dict[str, Any]) -> dict[str, Any]:
        """The whole answer: a ``thinking`` block (with ``--reasoning-parser``), then a ``text`` block for each
        run of text and a ``tool_use`` block for each call, in the output's order (as its stream sends them:
        a text after a call without its leading whitespace, whitespace alone no block)."""
        thoughts, pieces = answer_in_order(self.server, self.chat, output, self.in_thinking)
        content: list[dict[str, Any]] = [{"type": "thinking", "thinking": thoughts, "signature": ""}] \
            if thoughts else []
        called = False
        for piece in pieces:
            if isinstance(piece, str):
                text = piece.lstrip() if called else piece
                content += [{"type": "text", "text": text}] if text.strip() else []
            else:
                called = True
                content.append({"type": "tool_use", "id": piece.id, "name": piece.name,
                                "input": tool_input(piece.arguments)})
        reason, sequence = stop_reason(meta.get("finish_reason"), called)
        return self._skeleton(content, reason, sequence, usage(meta))

    def _skeleton(self, content: list[dict[str, Any]], reason: str | None, sequence: str | None,
                  counts: dict[str, int]) -> dict[str, Any]:
        return {"id": self.rid, "type": "message", "role": "assistant", "model": self.chat.model,
                "content": content, "stop_reason": reason, "stop_sequence": sequence, "usage": counts}

    async def events(self, gen: Generation) -> AsyncIterator[str]:
        """The answer as Anthropic's stream; a failure after it started ends it with an ``error`` event."""
        try:
            async for line in self._events(gen):
                yield line
        except Exception as exc:
            error = exc if isinstance(exc, APIError) else engine_error(exc, ENDPOINT)
            yield _event("error", error=anthropic_error_body(error.status, error.message)["error"])

    async def _events(self, gen: Generation) -> AsyncIterator[str]:
        start = usage({"prompt_tokens": self.prompt_tokens})
        yield _event("message_start", message=self._skeleton([], None, None, start))
        answer = AnswerStream(self.server, self.chat, self.in_thinking)
        blocks = _Blocks()
        pending = ""
        choice = gen.choices[0]
        called = False  # (a call's block has opened)
        async for choice, chunk in gen.events():
            thought, pieces = answer.feed_in_order(chunk["text"], final=choice.finish_reason is not None)
            if thought:
                for line in blocks.delta("thinking", {"type": "thinking_delta", "thinking": thought}):
                    yield line
            for piece in pieces:  # (in the output's order: a chunk may hold text after a call)
                if isinstance(piece, str):
                    pending += piece  # (whitespace before the text's first character is held: a block opens for text)
                    if blocks.kind != "text" and called:  # (a text after a call: its leading whitespace is layout)
                        pending = pending.lstrip()
                    if pending.strip() or (pending and blocks.kind == "text"):
                        for line in blocks.delta("text", {"type": "text_delta", "text": pending}):
                            yield line
                        pending = ""
                    continue
                if piece.name is not None:
                    called = True
                    for line in blocks.open(("tool_use", piece.index), {"type": "tool_use", "id": piece.id,
                                                                        "name": piece.name, "input": {}}):
                        yield line
                for line in blocks.arguments(piece.arguments):
                    yield line
        for line in blocks.close():
            yield line
        reason, sequence = stop_reason(choice.finish_reason, bool(answer.calls))
        yield _event("message_delta", delta={"stop_reason": reason, "stop_sequence": sequence},
                     usage=usage(choice.meta))
        yield _event("message_stop")


class _Blocks:
    """The content blocks of a stream, one open at a time, numbered from 0 as they open."""

    def __init__(self) -> None:
        self.index, self.kind = -1, None  # the open block's index and kind (None: none open)
        # the open tool_use block's arguments: are they sent inside {"arguments": ...} (None: not known yet)
        self.wrapped: bool | None = None

    def open(self, kind: Any, block: dict[str, Any]) -> list[str]:
        lines = self.close()
        self.index, self.kind = self.index + 1, kind
        return lines + [_event("content_block_start", index=self.index, content_block=block)]

    def delta(self, kind: str, delta: dict[str, Any]) -> list[str]:
        """A ``text`` or ``thinking`` delta, in the open block of that kind, or in a new one."""
        lines = [] if self.kind == kind else self.open(kind, {"type": "thinking", "thinking": "", "signature": ""}
                                                       if kind == "thinking" else {"type": "text", "text": ""})
        return lines + [self.event(delta)]

    def event(self, delta: dict[str, Any]) -> str:
        return _event("content_block_delta", index=self.index, delta=delta)

    def arguments(self, text: str) -> list[str]:
        """More of the open tool_use block's arguments (JSON text), as ``input_json_delta`` s. Arguments that are
        no object (a list, a string) go inside ``{"arguments": ...}``, as the whole answer's ``tool_input`` puts
        them (``input`` is an object): known at their first character other than whitespace (the whitespace
        before it is not sent)."""
        if self.wrapped is None:
            text = text.lstrip()
            if not text:
                return []
            self.wrapped = not text.startswith("{")
            text = '{"arguments": ' + text if self.wrapped else text
        return [self.event({"type": "input_json_delta", "partial_json": text})] if text else []

    def close(self) -> list[str]:
        if self.kind is None:
            return []
        lines = [self.event({"type": "input_json_delta", "partial_json": "}"})] if self.wrapped else []
        self.kind, self.wrapped = None, None
        return lines + [_event("content_block_stop", index=self.index)]
