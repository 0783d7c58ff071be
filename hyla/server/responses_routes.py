"""OpenAI's Responses API: ``POST /v1/responses``, ``GET`` and ``DELETE /v1/responses/{response_id}``,
``GET /v1/responses/{response_id}/input_items`` and ``POST /v1/responses/input_tokens``.

A response is a chat completion underneath. A request, top-down (``ResponsesRoutes.prompt``): check the
model; the conversation is the stored conversation of ``previous_response_id`` (its input and output,
without its ``instructions``), then this request's ``input`` items (an ``item_reference`` replaced by the
stored output item it names: ``resolve``; an item whose id the conversation already holds is a 400:
``check_duplicates``) as chat messages (``items_to_messages``;
a ``function_call_output`` must answer an earlier ``function_call``: ``input_conversation``);
``instructions`` goes first as a system message; the whole is validated as a
``ChatCompletionRequest`` (one choice) and rendered with ``render_chat``, with the same message-end
checkpoints as a chat completion, so a chained turn renders the previous turn's prompt and answer as
the same token prefix and the prefix cache hits it (``input_tokens`` stops here and counts the tokens);
one ``Job``; the output is split as a chat completion's (reasoning parser, then tool-call parser) into
output items (``output_items``): reasoning, message (with ``include: ["message.output_text.logprobs"]``
its text's logprobs: chat's entries of the tokens between the reasoning and the first call,
``_Turn.message_logprobs``), function calls. With ``store`` (the default) the response, its conversation
and its input items as listed (``listed_item``: the chain's, then its own, each with an id) are kept in
memory (``ResponseStore``, LRU, bounded in number and size) for ``GET``, ``input_items`` (``item_page``)
and ``previous_response_id``.

Streaming sends OpenAI's typed events (``event: <type>`` + ``data: {...}`` with a
``sequence_number``): ``response.created``, ``response.in_progress``, the output items as they
grow, then ``response.completed`` / ``response.incomplete`` with the whole response, the object a
non-streaming request returns. A function call's item opens as soon as its name is written and its
arguments stream as the model writes them (``_Turn._events``); the stream decides the final response
(``StreamedAnswer``): text after a call is a second message, and a call cut off inside its arguments
stays a call. A failure after the stream started ends it with OpenAI's ``error`` event and ``response.failed``
(``_Turn.failed``), not chat's ``data: {"error": ...}``.
Fields and semantics: docs/server.md.
"""

from __future__ import annotations

import asyncio
import math
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, AsyncIterator, Mapping

from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from hyla.server.conversation_store import ConversationStore
from hyla.server.disaggregation import disaggregation_answer
from hyla.server.errors import APIError, engine_error, validation_error
from hyla.server.generation import Choice, Generation, Job, chunk_logprobs, json_answer, sse_stream
from hyla.server.lru_store import LRUStore
from hyla.server.openai_routes import (CHAT_CHECKPOINTS, AnswerStream, TextOffsets, admit_chat, chat_image_urls,
                                      chat_logprobs, choice_logprobs, forced_tool_grammar, image_sources,
                                      kept_markers, on_images, opens_thinking, output_budget, render_chat,
                                      answer_in_order, thinking_first)
from hyla.server.protocol import (DEFAULT_STORED_RESPONSE_BYTES, DEFAULT_STORED_RESPONSES, ChatCompletionRequest,
                                  FieldError, cache_namespace, text_chars)
from hyla.server.responses_protocol import (
    FunctionCallItem, FunctionCallOutputItem, FunctionToolChoice, IncompleteDetails, InputImagePart, InputItem,
    InputTokensDetails,
    InputTokensRequest, ItemReference, MessageItem, OutputTokensDetails, ReasoningItem, ResponseError, ResponseObject,
    ResponsesRequest, ResponseUsage, _item, output_item_id, typed_event,
)
from hyla.server.tool_call_stream import ToolCallDelta
from hyla.server.tool_calls import ToolCall
from hyla.tokenizer import ChatEncoding

if TYPE_CHECKING:
    from hyla.engine.engine import Engine
    from hyla.server.app import Server

ENDPOINT = "responses"
# a field of the chat request (or the engine's request) underneath, as the Responses API names it
_PARAMS = {"messages": "input", "prompt": "input", "input_ids": "input", "response_format": "text.format",
           "json_schema": "text.format", "regex": "text.format", "ebnf": "text.format",
           "max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens",
           "max_new_tokens": "max_output_tokens", "chat_template_kwargs": "input"}
_CHAT_TOOL_FUNCTION = re.compile(r"^tools\.(\d+)\.function(?=\.|$)")  # a chat tool's function: a Responses tool
DEFAULT_LIST_LIMIT, MAX_LIST_LIMIT = 20, 100  # GET .../input_items's page size: OpenAI's default and bound
# the prefix of a new id for an input item sent without one (as listed by GET .../input_items)
_INPUT_ITEM_PREFIXES = {MessageItem: "msg", FunctionCallItem: "fc", FunctionCallOutputItem: "fco", ReasoningItem: "rs"}


def _not_found(response_id: str) -> APIError:
    return APIError(404, f"Response with id {response_id!r} not found.", type="not_found_error",
                    param="response_id", code="response_not_found")


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass
class StoredResponse:
    response: dict[str, Any]  # the response object, as returned
    conversation: list[dict[str, Any]]  # chat messages: the chain's inputs and outputs (no instructions)
    # the input items as GET .../input_items lists them (``listed_item``): the chain's (its inputs and outputs),
    # then this request's, in order
    items: list[dict[str, Any]] = field(default_factory=list)
    events: list[str] | None = None  # a background response's stream, each event's line (GET ?stream=true)


_Kept = tuple[StoredResponse, int]  # a response to store, and its stored_size


class ResponseStore:
    """Stored responses by id, in memory, at most ``capacity`` of them and ``max_bytes`` of their
    ``stored_size`` (``LRUStore``: the least recently used dropped first; the one stored last is kept even
    where it alone is larger), and their output items by item id (``output_item``). ``ValueError`` for a
    limit that is not a non-negative integer."""

    def __init__(self, capacity: int = DEFAULT_STORED_RESPONSES, max_bytes: int = DEFAULT_STORED_RESPONSE_BYTES):
        self._store: LRUStore[StoredResponse] = LRUStore("ResponseStore", capacity, max_bytes)
        self._output_items: dict[str, dict[str, Any]] = {}  # output item id -> the item, of a response held

    @property
    def bytes(self) -> int:
        """The ``stored_size`` of the responses held."""
        return self._store.bytes

    @property
    def capacity(self) -> int:
        return self._store.capacity

    @property
    def max_bytes(self) -> int:
        return self._store.max_bytes

    def put(self, stored: StoredResponse, size: int | None = None) -> None:
        """Store ``stored`` (``size``: its ``stored_size``, where the caller measured it already)."""
        self.delete(stored.response["id"])
        dropped = self._store.put(stored.response["id"], stored, stored_size(stored) if size is None else size)
        self._output_items.update((item["id"], item) for item in stored.response.get("output", ()) if "id" in item)
        for gone in dropped:
            self._forget_outputs(gone)

    def get(self, response_id: str) -> StoredResponse | None:
        return self._store.get(response_id)

    def output_item(self, item_id: str) -> dict[str, Any] | None:
        """The output item ``item_id`` of a stored response (what an ``item_reference`` names)."""
        return self._output_items.get(item_id)

    def delete(self, response_id: str) -> bool:
        """Forget a stored response, and its output items; whether there was one."""
        gone = self._store.pop(response_id)
        if gone is not None:
            self._forget_outputs(gone)
        return gone is not None

    def _forget_outputs(self, stored: StoredResponse) -> None:
        for item in stored.response.get("output", ()):
            self._output_items.pop(item.get("id"), None)

    def __len__(self) -> int:
        return len(self._store)


def stored_size(stored: StoredResponse) -> int:
    """What a stored response holds, in bytes as ``ResponseStore.max_bytes`` counts them: the characters
    of every string and key of the response, of its whole conversation and of its input items
    (``text_chars``; a message or item shared with the responses that continue it counts in each) and of a
    background response's events, one for any other value. An estimate (Python holds a character in 1 to
    4 bytes, the objects around them aside), made without serializing anything."""
    return (text_chars(stored.response, keys=True) + text_chars(stored.conversation, keys=True)
            + text_chars(stored.items, keys=True) + text_chars(stored.events or []))


# --------------------------------------------------------------------------------------------
# items <-> chat messages
# --------------------------------------------------------------------------------------------
def items_to_messages(items: list[InputItem]) -> list[dict[str, Any]]:
    """Input (or output) items as chat messages, as a chat completion's client would send them:
    an assistant message, the reasoning before it (``reasoning_content``) and the function calls
    after it make one assistant turn (``tool_calls``), and so does an assistant message right after the
    calls (a response's text after its calls: its text joined to the turn's content, as a chat completion's
    whole answer joins them); a ``function_call_output`` is a ``tool`` message; every other message is
    itself (its text parts joined)."""
    out: list[dict[str, Any]] = []
    turn: dict[str, Any] | None = None  # the assistant turn being built

    def flush() -> None:
        nonlocal turn
        if turn is not None:
            turn.pop("text_after", None)
            if turn.get("content") is None and not turn.get("tool_calls"):
                turn["content"] = ""
            out.append(turn)
        turn = None

    for item in items:
        if isinstance(item, ReasoningItem):
            flush()
            turn = {"role": "assistant", "content": None, "reasoning_content": item.text()}
        elif isinstance(item, MessageItem) and item.role == "assistant":
            if turn is not None and turn.get("tool_calls") and not turn.get("text_after"):
                # the text the model wrote after its calls (a response's second message): the same turn, its
                # texts joined as a chat completion's content joins them (a template's turns alternate)
                turn["content"] = "\n\n".join(t for t in (turn.get("content"), item.text()) if t)
                turn["text_after"] = True
                continue
            if turn is None or turn.get("content") is not None or turn.get("tool_calls"):
                flush()
                turn = {"role": "assistant", "content": None}
            turn["content"] = item.text()
        elif isinstance(item, FunctionCallItem):
            if turn is None:
                turn = {"role": "assistant", "content": None}
            turn.setdefault("tool_calls", []).append(
                {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}})
        elif isinstance(item, FunctionCallOutputItem):
            flush()
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
        else:
            flush()
            out.append({"role": item.role, "content": item.chat_content()})  # type: ignore[union-attr]
    flush()
    return out


def input_conversation(history: list[dict[str, Any]], items: list[InputItem]) -> list[dict[str, Any]]:
    """A request's conversation: the stored ``history`` (``previous_response_id``'s, else empty),
    then its input ``items`` as chat messages (``items_to_messages``). As OpenAI, a
    ``function_call_output`` must answer a ``function_call`` with its ``call_id`` earlier in the
    conversation (in ``history`` or before it in ``items``): one that does not is a 400 naming
    ``input``. A call not answered yet is fine (the client answers it in a later request), and a
    ``call_id`` made twice is not refused."""
    messages = items_to_messages(items)
    calls = {call["id"] for message in history for call in message.get("tool_calls") or ()}
    for message in messages:
        calls.update(call["id"] for call in message.get("tool_calls") or ())
        if message["role"] == "tool" and message["tool_call_id"] not in calls:
            raise APIError(400, f"No tool call found for function call output with call_id "
                                f"{message['tool_call_id']}.", param="input")
    return history + messages


def listed_item(item: InputItem) -> dict[str, Any]:
    """An input item as ``GET /v1/responses/{id}/input_items`` lists it (the SDK's ``ResponseItem``): its own
    ``id``, else a new one (``msg_<hex>``, ``fc_``, ``fco_``, ``rs_``); ``status`` as sent, else completed;
    a message's content as parts (``input_text``; an assistant's ``output_text``); a reasoning item's
    ``summary`` as ``summary_text`` parts and ``content`` as ``reasoning_text`` ones. ``item`` is resolved
    (no ``item_reference``: ``ResponsesRoutes.resolve``)."""
    item_id = item.id or new_id(_INPUT_ITEM_PREFIXES[type(item)])
    status = item.status or "completed"
    if isinstance(item, MessageItem):
        return {"type": "message", "id": item_id, "role": item.role, "status": status,
                "content": _listed_parts(item.role, item.content)}
    if isinstance(item, FunctionCallItem):
        return {"type": "function_call", "id": item_id, "call_id": item.call_id, "name": item.name,
                "arguments": item.arguments, "status": status}
    if isinstance(item, FunctionCallOutputItem):
        output = item.output if isinstance(item.output, str) else _listed_parts("tool", item.output)
        return {"type": "function_call_output", "id": item_id, "call_id": item.call_id, "output": output,
                "status": status}
    out: dict[str, Any] = {"type": "reasoning", "id": item_id, "status": status,
                           "summary": [{"type": "summary_text", "text": p.text} for p in item.summary]}
    if item.content is not None:
        out["content"] = [{"type": "reasoning_text", "text": p.text} for p in item.content]
    return out


def _listed_parts(role: str, content: str | list[Any]) -> list[dict[str, Any]]:
    parts = [content] if isinstance(content, str) else content
    if role == "assistant":
        return [{"type": "output_text", "text": p if isinstance(p, str) else p.text, "annotations": []} for p in parts]
    return [{"type": "input_text", "text": p} if isinstance(p, str) else
            {"type": "input_image", "image_url": p.image_url, "detail": p.detail or "auto"}
            if isinstance(p, InputImagePart) else {"type": "input_text", "text": p.text} for p in parts]


def check_duplicates(chain: list[dict[str, Any]], items: list[InputItem], param: str = "input") -> None:
    """As OpenAI: an input item whose ``id`` is already in the conversation — an item of the
    ``previous_response_id`` chain or of the ``conversation`` (``chain``: its items), or an earlier one of this
    input; an ``item_reference`` is the item it names — is a 400 naming ``param``, OpenAI's message."""
    seen = {item["id"] for item in chain}
    for item in items:
        if not item.id:  # (an empty id is none: listed_item gives it one)
            continue
        if item.id in seen:
            raise APIError(400, f"Duplicate item found with id {item.id}. Remove duplicate items from your input and "
                                f"try again.", param=param)
        seen.add(item.id)


def item_page(items: list[dict[str, Any]], query: Mapping[str, str], holder: str = "response") -> dict[str, Any]:
    """One page of ``items`` as ``GET /v1/responses/{id}/input_items`` answers it (OpenAI's list: ``data``,
    ``first_id``, ``last_id``, ``has_more``). ``query``: ``order`` (``desc``, the default: the latest item
    first; or ``asc``), ``limit`` (1 to 100, default 20), ``after`` (an item id of the list: the page starts
    after it). A bad value is a 400 naming its parameter; so is ``before`` (the SDK pages with ``after``)."""
    if "before" in query:
        raise APIError(400, "before is not supported: page with after", param="before")
    limit = _list_limit(query.get("limit"))
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise APIError(400, f"order must be 'asc' or 'desc', got {order!r}", param="order")
    ordered = items if order == "asc" else items[::-1]
    start = 0
    after = query.get("after")
    if after is not None:
        ids = [item["id"] for item in ordered]
        if after not in ids:
            raise APIError(400, f"No item with id {after!r} in this {holder}.", param="after")
        start = ids.index(after) + 1
    data = ordered[start:start + limit]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": start + limit < len(ordered)}


def _list_limit(raw: str | None) -> int:
    if raw is None:
        return DEFAULT_LIST_LIMIT
    if not re.fullmatch(r"[0-9]{1,4}", raw) or not 1 <= int(raw) <= MAX_LIST_LIMIT:
        raise APIError(400, f"limit must be an integer from 1 to {MAX_LIST_LIMIT}, got {raw!r}", param="limit")
    return int(raw)


def _conversation_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A conversation's items (as listed) as chat messages (``items_to_messages``)."""
    try:
        return items_to_messages([_item(item, i) for i, item in enumerate(items)])
    except FieldError as exc:  # (an item stored as listed is an input item: never, short of a bug)
        raise APIError(500, f"the conversation's item {exc.param} cannot be read back: {exc}") from None


def with_instructions(instructions: str | None, conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The chat messages of a turn: ``instructions`` and the conversation's leading system and
    developer messages as one system message (chat templates take one system message, first;
    OpenAI takes instructions beside developer items, as Codex sends them), then the rest."""
    lead = 0
    while lead < len(conversation) and conversation[lead]["role"] in ("system", "developer"):
        lead += 1
    if instructions is None and lead <= 1:
        return conversation  # (one developer or system message stays itself: the template's own handling)
    pieces = ([[{"type": "text", "text": instructions}]] if instructions is not None else []) + [
        [{"type": "text", "text": m["content"]}] if isinstance(m["content"], str) else list(m["content"])
        for m in conversation[:lead]]
    if all(p["type"] == "text" for piece in pieces for p in piece):  # (text parts a line each, as a template's)
        content: Any = "\n\n".join("\n".join(p["text"] for p in piece) for piece in pieces)
    else:  # (with an image: the parts in order, the messages apart)
        content = [p for k, piece in enumerate(pieces) for p in ([{"type": "text", "text": "\n\n"}] if k else [])
                   + piece]
    return [{"role": "system", "content": content}, *conversation[lead:]]


def output_items(thoughts: str | None, text: str, calls: list[ToolCall], complete: bool, ids: dict[str, Any],
                 logprobs: list[dict[str, Any]] | None = None, text_after: str = "", cut_in_call: bool = False
                 ) -> list[dict[str, Any]]:
    """A response's output items: the reasoning (when the reasoning parser found some), the message
    (when there is text, or no call; its text's ``logprobs`` where given), one function call per call,
    then a second message of ``text_after`` where it is not empty (a stream's text after its first call
    began: ``StreamedAnswer``; its ``logprobs`` are empty, as the first message's stop at the first call).
    An output that did not complete (``complete`` false) leaves the item it was cut off in
    ``incomplete``: the last call where ``cut_in_call`` (its block never closed), else the last message;
    the others are ``completed``. ``ids``: ``reasoning``, ``message`` (item ids), ``calls`` (one item id
    per call, made here when missing) and ``response`` (the response's id, which the items' ids hold:
    ``output_item_id``)."""
    out: list[dict[str, Any]] = []
    cut_call = not complete and cut_in_call and bool(calls)
    cut_text = not complete and not cut_call
    if thoughts is not None:
        out.append({"type": "reasoning", "id": ids["reasoning"], "summary": [],
                    "content": [{"type": "reasoning_text", "text": thoughts}]})
    if text or not calls:  # (the text after the calls is in it, unless a message of its own follows them)
        cut = cut_text and not (calls and text_after)
        out.append(message_item(ids["message"], text, "incomplete" if cut else "completed", logprobs))
    for k, (call, fc_id) in enumerate(zip(calls, call_item_ids(ids, len(calls)))):
        cut = cut_call and k == len(calls) - 1
        out.append({"type": "function_call", "id": fc_id, "call_id": call.id, "name": call.name,
                    "arguments": call.arguments, "status": "incomplete" if cut else "completed"})
    if text_after:
        out.append(message_item(ids["message_after"], text_after, "incomplete" if cut_text else "completed",
                                [] if logprobs is not None else None))
    return out


def call_item_ids(ids: dict[str, Any], n: int) -> list[str]:
    """The item ids of a response's first ``n`` function calls (``ids["calls"]``, made as needed)."""
    fc_ids = ids.setdefault("calls", [])
    while len(fc_ids) < n:
        fc_ids.append(output_item_id("fc", ids["response"], len(fc_ids)))
    return fc_ids[:n]


@dataclass
class StreamedAnswer:
    """What a Responses stream sent of its answer's content, which its final response holds (the stream
    decides): the message's ``text`` (the content before the first call began), the ``calls`` (those it
    sent, whole: ``ToolCallStream.calls``), and ``text_after``, the content after the first call began
    (held to the end, then sent as a second message after the calls)."""
    text: str
    calls: list[ToolCall]
    text_after: str = ""


def message_item(item_id: str, text: str | None, status: str, logprobs: list[dict[str, Any]] | None = None
                 ) -> dict[str, Any]:
    """The assistant message: no content while ``text`` is None (a stream's item added), else one
    ``output_text`` part, with ``logprobs`` where given (``include: ["message.output_text.logprobs"]``)."""
    part: dict[str, Any] = {"type": "output_text", "text": text, "annotations": []}
    if logprobs is not None:
        part["logprobs"] = logprobs
    content = [] if text is None else [part]
    return {"type": "message", "id": item_id, "role": "assistant", "status": status, "content": content}


def delta_logprobs(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The message's logprobs as a text event carries them (the SDK's ``ResponseTextDeltaEvent.Logprob``:
    ``token``, ``logprob``, ``top_logprobs`` of ``token`` and ``logprob``, no bytes)."""
    return [{"token": e["token"], "logprob": e["logprob"],
             "top_logprobs": [{"token": t["token"], "logprob": t["logprob"]} for t in e["top_logprobs"]]}
            for e in entries]


def failure_code(error: APIError) -> str:
    """A failed response's ``error.code``, one of OpenAI's (``ResponseError``): by the error's status."""
    return {429: "rate_limit_exceeded", 400: "invalid_prompt"}.get(error.status, "server_error")


def _remap(exc: APIError, body: ResponsesRequest, chat: ChatCompletionRequest | None = None) -> APIError:
    """An error of the chat request ``chat`` (or the engine's) underneath, naming the Responses field: a
    grammar error without ``text.format`` is the forced call's (``ChatCompletionRequest.forced_tool_field``),
    and a chat tool's ``tools.<i>.function.<field>`` is the Responses tool's ``tools.<i>.<field>`` (the
    chat's tools are the request's, in order)."""
    if exc.param:
        param = exc.param.removeprefix("sampling_params.")
        head, dot, rest = param.partition(".")
        if head in ("response_format", "json_schema", "regex", "ebnf") and body.text_format().type == "text":
            param = (chat.forced_tool_field() if chat is not None else None) or "tools"  # the grammar the tools made
            head, dot, rest = param.partition(".")
        if head == "tools":
            exc.param = _CHAT_TOOL_FUNCTION.sub(r"tools.\1", param)
        else:
            exc.param = _PARAMS.get(head, head) + (dot + rest if head not in _PARAMS else "")
    return exc


# --------------------------------------------------------------------------------------------
# routes
# --------------------------------------------------------------------------------------------
@dataclass
class _Prompt:
    """A request's turn, rendered: what ``POST /v1/responses`` generates from and ``POST
    /v1/responses/input_tokens`` counts."""

    engine: Engine
    chat: ChatCompletionRequest  # the chat completion underneath
    conversation: list[dict[str, Any]]  # chat messages: the chain's and this input's (no instructions)
    items: list[dict[str, Any]]  # the input items as listed (StoredResponse.items): the chain's, then its own
    own: int  # where its own begin in ``items`` (what a ``conversation`` gets added)
    encoding: ChatEncoding
    max_new: int  # the engine's max_new_tokens
    grammar: dict[str, Any]  # a forced call's grammar, kept markers (sampling params)
    images: list[Any] | None = None  # the prompt's images, processed (Engine.process_images); None: none (or counted only)
    image_tokens: int = 0  # the tokens its images add beyond their placeholders

    @property
    def num_tokens(self) -> int:
        """The prompt's tokens as the engine counts them: its images' included."""
        return len(self.encoding.ids) + self.image_tokens


class ResponsesRoutes:
    """The Responses endpoints of one ``Server``, and the responses they stored."""

    def __init__(self, server: Server, max_stored: int = DEFAULT_STORED_RESPONSES,
                 max_stored_bytes: int = DEFAULT_STORED_RESPONSE_BYTES):
        self.server = server
        self.store = ResponseStore(max_stored, max_stored_bytes)
        # the Conversations API's (conversations.py): bounded as the stored responses are, apart from them
        self.conversations = ConversationStore(max_stored, max_stored_bytes)
        self.running: dict[str, _Background] = {}  # the background responses still running, by id

    def router(self) -> APIRouter:
        router = APIRouter()
        router.post("/v1/responses")(self.create)
        router.post("/v1/responses/input_tokens")(self.input_tokens)
        router.get("/v1/responses/{response_id}")(self.retrieve)
        router.get("/v1/responses/{response_id}/input_items")(self.input_items)
        router.delete("/v1/responses/{response_id}")(self.delete)
        router.post("/v1/responses/{response_id}/cancel")(self.cancel)
        return router

    async def retrieve(self, response_id: str, stream: bool = False, starting_after: int | None = None) -> Response:
        """A stored response, or a background response still running (``status: "in_progress"``, no output
        yet). ``?stream=true`` (the openai client's ``retrieve(id, stream=True)``) streams a background
        response, running or stored: its events from the first, or from the one after ``starting_after`` (a
        sequence number), then, while it runs, each as it comes. Any other response cannot be streamed: a
        400 (answered with the JSON, a client would read it as an empty stream)."""
        after = -1 if starting_after is None else starting_after
        if starting_after is not None and (starting_after < -1 or not stream):
            raise APIError(400, "starting_after is a sequence number (-1 or more) of a streamed retrieve (stream=true)",
                           param="starting_after")
        run = self.running.get(response_id)
        if run is not None:
            if stream:
                return sse_stream(run.follow(after), ENDPOINT)
            return JSONResponse(run.turn.skeleton("in_progress").model_dump())
        stored = self._stored(response_id)
        if stream:
            if stored.events is None:
                raise APIError(400, "only a background response can be streamed again: retrieve this one without "
                                    "stream", param="stream")
            return sse_stream(_replayed(stored.events[after + 1:]), ENDPOINT)
        return JSONResponse(stored.response)

    async def cancel(self, response_id: str) -> JSONResponse:
        """OpenAI's ``POST /v1/responses/{id}/cancel``: a background response still running is aborted and
        answered as it ended (``status: "cancelled"``, its output so far, stored); one that has ended is
        answered as it is. A response that was not made in the background is a 400; none stored, a 404."""
        run = self.running.get(response_id)
        if run is not None:
            return JSONResponse(await run.cancel())
        stored = self._stored(response_id)
        if not stored.response.get("background"):
            raise APIError(400, "Cannot cancel a synchronous response.", param="response_id")
        return JSONResponse(stored.response)

    async def input_items(self, response_id: str, request: Request) -> JSONResponse:
        """OpenAI's ``GET /v1/responses/{id}/input_items``: the input items of a stored response (the chain's
        and its own: ``StoredResponse.items``; a background response's while it runs), one page (``item_page``); a
        404 where none is stored."""
        run = self.running.get(response_id)
        items = run.turn.prompt.items if run is not None else self._stored(response_id).items
        return JSONResponse(item_page(items, request.query_params))

    def _stored(self, response_id: str) -> StoredResponse:
        stored = self.store.get(response_id)
        if stored is None:
            raise _not_found(response_id)
        return stored

    async def delete(self, response_id: str) -> JSONResponse:
        """OpenAI's ``DELETE /v1/responses/{id}``: the stored response is gone (neither retrieved nor continued
        with ``previous_response_id`` after this; a background response still running is cancelled first); a
        404 where none is stored."""
        run = self.running.get(response_id)
        if run is not None:
            await run.cancel()
        if not self.store.delete(response_id):
            raise _not_found(response_id)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    async def input_tokens(self, body: InputTokensRequest) -> JSONResponse:
        """OpenAI's ``POST /v1/responses/input_tokens``: the prompt tokens ``POST /v1/responses`` would feed
        the engine for this body (the same checks, the same rendering: ``prompt``); nothing generated or
        stored. ``model`` left out is the served model."""
        prompt = await self.prompt(body.model_copy(update={"model": body.model or self.server.model_name}),
                                   count_only=True)  # (its images counted from their headers, none decoded)
        return JSONResponse({"object": "response.input_tokens", "input_tokens": prompt.num_tokens})

    async def create(self, body: ResponsesRequest, request: Request) -> Response:
        arrival = time.monotonic()
        if body.background and self.store.capacity == 0:  # (it would be dropped as it ends: nothing to poll)
            raise APIError(400, "background responses must be stored, and this server stores none "
                                "(--max-stored-responses 0)", param="background")
        prompt = await self.prompt(body)
        top_k = (body.top_logprobs or 0) if body.wants_logprobs() else 0
        params = thinking_first(self.server, prompt.encoding.text,
                                {**prompt.chat.sampling_params(prompt.max_new, top_k, 0), **prompt.grammar})
        job = Job(prompt.encoding.ids, params, return_logprob=body.wants_logprobs(),
                  checkpoints=list(prompt.encoding.boundaries), speculative_checkpoints=True,
                  namespace=cache_namespace(body.cache_salt), image_data=prompt.images,
                  lora_name=self.server.check_model(body.model))  # (a LoRA adapter's name, or None)
        try:
            answer = await disaggregation_answer(self.server, ENDPOINT, [job], arrival, request)
            if answer is not None:
                return answer
            gen = await self.server.start_generation(ENDPOINT, [job], arrival)
        except APIError as exc:
            raise _remap(exc, body, prompt.chat) from None
        turn = _Turn(self, body, prompt, new_id("resp"), params.get("skip_special_tokens", True))
        if body.background:
            run = self.running[turn.rid] = _Background(self, turn, gen)
            if body.stream:
                return sse_stream(run.follow(), ENDPOINT)  # (a disconnect stops this reader, not the run)
            return JSONResponse(turn.skeleton("queued").model_dump())
        if body.stream:
            return gen.stream(turn.events(gen))
        (choice,) = await gen.collect(request)
        out, kept = await asyncio.to_thread(turn.finished, choice)
        turn.keep(kept)
        return await json_answer(lambda: out)

    async def prompt(self, body: ResponsesRequest, count_only: bool = False) -> _Prompt:
        """The turn ``body`` asks for, rendered as a chat completion's prompt: the stored conversation of
        ``previous_response_id`` (a 400 naming it where none is stored), then the input items (references
        resolved, no item twice: ``check_duplicates``), ``instructions`` first; each rule broken a 400
        naming the Responses field. Its images are counted from their headers (``truncation: "auto"`` drops
        turns by those counts), then those the prompt keeps processed, unless ``count_only``."""
        engine = admit_chat(self.server, body.model)
        history: list[dict[str, Any]] = []
        chain: list[dict[str, Any]] = []
        if body.conversation is not None:
            if body.previous_response_id is not None:
                raise APIError(400, "previous_response_id and conversation cannot be used together: a turn continues "
                                    "one or the other", param="conversation")
            chain = list(self.conversations.get(body.conversation_id(), "conversation").items)  # (as of now)
            history = await asyncio.to_thread(_conversation_messages, chain)  # (a long one: off the event loop)
        if body.previous_response_id is not None:
            previous = self.store.get(body.previous_response_id)
            if previous is None and body.previous_response_id in self.running:
                raise APIError(400, f"Previous response with id {body.previous_response_id!r} is still in progress "
                                    "(a background response): continue from it once it has ended.",
                               param="previous_response_id")
            if previous is None:
                raise APIError(400, f"Previous response with id {body.previous_response_id!r} not found.",
                               param="previous_response_id", code="previous_response_not_found")
            if previous.response["status"] == "failed":
                raise APIError(400, f"Previous response with id {body.previous_response_id!r} failed: it has no "
                                    "answer to continue from.", param="previous_response_id")
            history, chain = previous.conversation, previous.items + previous.response["output"]
        items = self.resolve(body.items())
        check_duplicates(chain, items)
        conversation = input_conversation(history, items)
        chat = self._chat_request(body, with_instructions(body.instructions, conversation))
        try:
            encoding = await self._render(engine, chat)
            truncating = body.truncation == "auto"
            # each image URL fetched once and counted from its header (what truncation weighs turns by), then those
            # the prompt keeps processed
            sources = await image_sources(self.server, engine, chat.messages) or []
            counts = await on_images(engine.count_image_tokens, sources, None, one_prompt=not truncating) \
                if sources else []
            by_url = dict(zip(chat_image_urls(chat.messages), zip(sources, counts)))
            if truncating:
                chat, encoding = await self._truncated(body, engine, conversation, chat, encoding,
                                                       {url: n - 1 for url, (_, n) in by_url.items()})
            kept = [by_url[url] for url in chat_image_urls(chat.messages)]
            images, extra = None, sum(n - 1 for _, n in kept)
            if kept and not count_only:
                images = await on_images(engine.process_images, [src for src, _ in kept], None)
            elif kept and truncating:  # (as process_images would: the kept images' number and tokens together)
                await on_images(engine.count_image_tokens, [src for src, _ in kept], None)
            max_new = output_budget(engine, len(encoding.ids) + extra, body.max_output_tokens,
                                    "max_output_tokens", "input")
            grammar = {**forced_tool_grammar(self.server, chat), **kept_markers(self.server, chat)}
        except APIError as exc:
            raise _remap(exc, body, chat) from None
        return _Prompt(engine, chat, conversation, chain + [listed_item(item) for item in items], len(chain), encoding,
                       max_new, grammar, images, extra)

    async def _render(self, engine: Engine, chat: ChatCompletionRequest) -> ChatEncoding:
        return await render_chat(self.server, engine.tokenizer, chat.messages, chat.template_tools(), None,
                                 max_boundaries=CHAT_CHECKPOINTS)

    async def _truncated(self, body: ResponsesRequest, engine: Engine, conversation: list[dict[str, Any]],
                         chat: ChatCompletionRequest, encoding: ChatEncoding, extra_tokens: dict[str, int]
                         ) -> tuple[ChatCompletionRequest, ChatEncoding]:
        """``truncation: "auto"``: where the prompt leaves no room for ``max_output_tokens`` (one token where
        not given), the fewest of the conversation's oldest turns dropped that make room — whole turns, each
        from a user message to the next, after its leading system and developer messages (and
        ``instructions``), so a call's output never loses its call; the last turn is always kept (a prompt
        that does not fit even so is the 400 it would be without truncation). The stored conversation stays
        whole: each turn that continues it is truncated anew. Found by bisection, a render per step. A prompt's
        length counts its images' tokens (``extra_tokens``: each image URL's beyond its placeholder)."""
        need, context = body.max_output_tokens or 1, engine.context_length

        def length(c: ChatCompletionRequest, e: ChatEncoding) -> int:
            return len(e.ids) + sum(extra_tokens[url] for url in chat_image_urls(c.messages))

        if length(chat, encoding) + need <= context:
            return chat, encoding
        lead = 0
        while lead < len(conversation) and conversation[lead]["role"] in ("system", "developer"):
            lead += 1
        turns = [i for i in range(lead, len(conversation)) if conversation[i]["role"] == "user"]
        best, lo, hi = (chat, encoding), 1, len(turns) - 1  # (turns dropped: the first `k` of them)
        while lo <= hi:
            k = (lo + hi) // 2
            kept = conversation[:lead] + conversation[turns[k]:]
            shorter = self._chat_request(body, with_instructions(body.instructions, kept))
            rendered = await self._render(engine, shorter)
            if length(shorter, rendered) + need <= context:
                best, hi = (shorter, rendered), k - 1
            else:
                lo = k + 1
        return best

    def resolve(self, items: list[InputItem], param: str = "input") -> list[InputItem]:
        """The input items, each ``item_reference`` replaced by the stored output item it names; one
        that names none (its response never stored, dropped or deleted) is a 400 naming ``<param>.<i>.id``."""
        out: list[InputItem] = []
        for i, item in enumerate(items):
            if isinstance(item, ItemReference):
                found = self.store.output_item(item.id)
                if found is None:
                    raise APIError(400, f"Item with id {item.id!r} not found.", param=f"{param}.{i}.id")
                item = _item(found, i)
            out.append(item)
        return out

    def _chat_request(self, body: ResponsesRequest, messages: list[dict[str, Any]]) -> ChatCompletionRequest:
        """The chat completion underneath (one choice; logprobs are the job's: ``create``); a rule it breaks
        is a 400 naming the Responses field."""
        payload: dict[str, Any] = {"model": body.model, "messages": messages,
                                   "parallel_tool_calls": body.parallel_tool_calls}
        for name, value in (("max_completion_tokens", body.max_output_tokens), ("temperature", body.temperature),
                            ("top_p", body.top_p), ("seed", body.seed)):
            if value is not None:
                payload[name] = value
        if body.tools:
            payload["tools"] = [t.chat_tool() for t in body.tools]
            if isinstance(body.tool_choice, FunctionToolChoice):
                payload["tool_choice"] = {"type": "function", "function": {"name": body.tool_choice.name}}
            elif body.tool_choice is not None:
                payload["tool_choice"] = body.tool_choice
        fmt = body.text_format()
        if fmt.type != "text":
            payload["response_format"] = fmt.response_format()
        try:
            return ChatCompletionRequest.model_validate(payload)
        except ValidationError as exc:
            raise _remap(validation_error(RequestValidationError(exc.errors())), body) from None


class _EventWriter:
    """A stream's events as OpenAI sends them: an ``event: <type>`` line and a ``data:`` line whose JSON
    holds ``type``, the fields and the ``sequence_number`` (0, 1, 2, ...)."""

    def __init__(self) -> None:
        self.sequence_number = 0

    def __call__(self, kind: str, **fields: Any) -> str:
        self.sequence_number += 1
        return typed_event(kind, **fields, sequence_number=self.sequence_number - 1)


class _Turn:
    """One response being made: its request, its rendered prompt, its ids; ``finish`` builds (and
    stores) the response object, ``events`` streams it."""

    def __init__(self, routes: ResponsesRoutes, body: ResponsesRequest, prompt: _Prompt, rid: str,
                 skip_special_tokens: bool):
        self.routes, self.server = routes, routes.server
        self.body, self.chat, self.prompt = body, prompt.chat, prompt
        self.rid, self.in_thinking = rid, opens_thinking(routes.server, prompt.encoding.text)
        self.skip_special_tokens = skip_special_tokens
        self.created_at = int(time.time())
        self.ids: dict[str, Any] = {"reasoning": output_item_id("rs", rid), "message": output_item_id("msg", rid),
                                    "message_after": output_item_id("msg", rid, 1), "calls": [], "response": rid}
        self.stored_size: int | None = None  # where its end stored it (``keep``): its stored_size
        self.final: dict[str, Any] | None = None  # the response as it ended (``finished``, ``failed``)

    def skeleton(self, status: str = "in_progress") -> ResponseObject:
        """The response object without its output and usage (what ``response.created`` sends)."""
        b = self.body
        return ResponseObject(
            id=self.rid, created_at=self.created_at, model=b.model, status=status,
            instructions=b.instructions, previous_response_id=b.previous_response_id,
            tools=[t.model_dump() for t in b.tools or ()], tool_choice=b.tool_choice_echo(),
            parallel_tool_calls=bool(b.parallel_tool_calls), temperature=b.temperature, top_p=b.top_p,
            max_output_tokens=b.max_output_tokens, max_tool_calls=b.max_tool_calls, top_logprobs=b.top_logprobs,
            text=b.text_echo(), reasoning=b.reasoning.model_dump() if b.reasoning is not None else None,
            metadata=b.metadata or {}, store=bool(b.store), background=bool(b.background),
            truncation=b.truncation or "disabled", user=b.user,
            conversation={"id": b.conversation_id()} if b.conversation is not None else None)

    def thoughts(self, text: str) -> str | None:
        """The reasoning of the output ``text`` (so far), or None (no reasoning parser, or no think block)."""
        reasoning = self.server.reasoning_parser
        return reasoning.parse(text, self.in_thinking)[0] if reasoning is not None else None

    # --- the message's logprobs: the tokens of the raw output between the reasoning and the first call ---
    def content_start(self, text: str) -> int | None:
        """Where the content starts in the raw output ``text`` (after ``</think>`` where the output is
        reasoning first; 0 where it has none), or None while it is all reasoning. As the reasoning parser
        splits ``text`` (``ReasoningStream``), for a whole output, or a stream's once it has sent content."""
        reasoning = self.server.reasoning_parser
        if reasoning is None or not (self.in_thinking or text.lstrip().startswith(reasoning.start)):
            return 0
        end = text.find(reasoning.end)
        return None if end < 0 else end + len(reasoning.end)

    def message_span(self, text: str, calls: bool, final: bool) -> tuple[int, float]:
        """``[start, end)``: the characters of the raw output ``text`` whose tokens' logprobs are the
        message's — from the content's start (``content_start``) to the first call's marker where the
        output has calls (``calls``). Not ``final`` (a stream so far): where no marker is whole yet, up
        to where one could still begin, so that a stream sends no token the whole output leaves out."""
        start = self.content_start(text)
        if start is None:
            return 0, 0
        if self.chat.tool_choice_mode() == "none" or (final and not calls):
            return start, math.inf if final else len(text)
        marker = self.server.tool_call_parser.start
        end = text.find(marker, start)
        if end >= 0:
            return start, end
        return start, math.inf if final else max(start, len(text) - len(marker) + 1)

    def offsets(self) -> TextOffsets:
        """Where the output's tokens start in its text."""
        return TextOffsets(self.prompt.engine.tokenizer, self.prompt.encoding.ids, self.skip_special_tokens)

    def message_logprobs(self, choice: Choice, calls: bool) -> list[dict[str, Any]]:
        """The logprobs (chat's entries: ``token``, ``logprob``, ``bytes``, ``top_logprobs``) of the tokens
        that start in the message's span of the whole output (``message_span``)."""
        lps, tops = choice_logprobs(choice)
        starts = self.offsets().advance(tid for _, tid in lps)
        start, end = self.message_span(choice.text, calls, final=True)
        entries = chat_logprobs(self.prompt.engine.tokenizer, lps, tops).content or []
        return [e.model_dump() for e, at in zip(entries, starts) if start <= at < end]

    def finish(self, choice: Choice, streamed: StreamedAnswer | None = None) -> dict[str, Any]:
        """The finished response object (``finished`` adds what storing it keeps, with its conversation and
        input items, when ``store``). ``streamed``: what a stream sent of the content and calls (where a
        call's block was cut off or malformed the stream's call stands, which the whole parse would keep
        as text; text after a call is a second message)."""
        if streamed is None:  # (as a stream sends it: the text after the first call a second message)
            thoughts, pieces = answer_in_order(self.server, self.chat, choice.text, self.in_thinking)
            first = next((k for k, p in enumerate(pieces) if isinstance(p, ToolCall)), len(pieces))
            text = "".join(p for p in pieces[:first] if isinstance(p, str))
            calls = [p for p in pieces if isinstance(p, ToolCall)]
            text_after = "".join(p for p in pieces[first:] if isinstance(p, str)).lstrip()
        else:  # (the calls and the text as sent: only the reasoning is parsed here)
            thoughts = self.thoughts(choice.text)
            text, calls, text_after = streamed.text, streamed.calls, streamed.text_after
        finish = choice.openai_finish_reason()
        status = {"length": "incomplete", "abort": "cancelled"}.get(finish or "", "completed")
        response = self.skeleton(status)
        response.incomplete_details = IncompleteDetails(reason="max_output_tokens") if finish == "length" else None
        logprobs = self.message_logprobs(choice, bool(calls)) if self.body.wants_logprobs() else None
        parser = self.server.tool_call_parser  # (cut off in a call: its block's start is after the last end)
        cut_in_call = choice.text.rfind(parser.start) > choice.text.rfind(parser.end)
        response.output = output_items(thoughts, text, calls, status == "completed", self.ids, logprobs, text_after,
                                       cut_in_call)
        prompt = choice.meta.get("prompt_tokens", 0)
        completion = choice.meta.get("completion_tokens", 0)
        reasoning_tokens = 0
        if thoughts:
            tokenizer = self.server.engine.tokenizer if self.server.engine is not None else None
            reasoning_tokens = min(completion, len(tokenizer.encode(thoughts, add_special_tokens=False))) \
                if tokenizer is not None else 0
        cached = InputTokensDetails(cached_tokens=choice.meta.get("cached_tokens", 0))
        response.usage = ResponseUsage(
            input_tokens=prompt, input_tokens_details=cached,
            output_tokens=completion, output_tokens_details=OutputTokensDetails(reasoning_tokens=reasoning_tokens),
            total_tokens=prompt + completion)
        return response.model_dump()

    def finished(self, choice: Choice, streamed: StreamedAnswer | None = None
                 ) -> tuple[dict[str, Any], _Kept | None]:
        """``finish``'s response, and what storing it keeps (``store``; None without): all the Python work of
        a finished turn, which runs on a worker thread (a long answer's logprobs would stall the event loop);
        ``keep`` stores it, on the event loop (the store is the loop's)."""
        out = self.final = self.finish(choice, streamed)
        if not self.body.store:
            return out, None
        outputs = [_item(o, i) for i, o in enumerate(out["output"])]
        stored = StoredResponse(out, self.prompt.conversation + items_to_messages(outputs), self.prompt.items)
        return out, (stored, stored_size(stored))

    def keep(self, kept: _Kept | None) -> None:
        """Store what ``finished`` made (``kept``; None without ``store``), and add the turn's input and output
        items to its ``conversation`` (where it has one, and its response completed or was cut at
        ``max_output_tokens``). On the event loop, whose the stores are."""
        if kept is not None:
            self.routes.store.put(*kept)
            self.stored_size = kept[1]
        conversation = self.body.conversation_id()
        if conversation is not None and self.final is not None and self.final["status"] in ("completed", "incomplete"):
            self.routes.conversations.extend(conversation, self.prompt.items[self.prompt.own:] + self.final["output"])

    def failed(self, event: _EventWriter, error: APIError) -> list[str]:
        """What a stream sends when it fails after it started (an engine error, an abort): OpenAI's ``error``
        event (``code``, ``message``, ``param``), then ``response.failed`` with the response, ``status``
        failed, its ``error`` (``failure_code``) and no output. A failed response is not stored (but for a
        background one, which is polled: ``_Background``)."""
        response = self.skeleton("failed")
        response.error = ResponseError(code=failure_code(error), message=error.message)
        self.final = response.model_dump()
        return [event("error", code=error.code, message=error.message, param=error.param),
                event("response.failed", response=self.final)]

    async def events(self, gen: Generation) -> AsyncIterator[str]:
        """The response's stream (``_events``); a failure after it started ends it with ``failed``'s events."""
        event = _EventWriter()
        try:
            async for line in self._events(gen, event):
                yield line
        except Exception as exc:
            for line in self.failed(event, engine_error(exc, ENDPOINT)):
                yield line

    async def _events(self, gen: Generation, event: _EventWriter) -> AsyncIterator[str]:
        """The items in output order, each opened (``output_item.added``) as its first text comes: the
        reasoning, the message, each function call as soon as its name is written (its arguments as the
        model writes them: ``ToolCallStream``'s incremental stream, as chat completions), then, where the
        model wrote text after a call, a second message. The reasoning and the message are done when the
        first call begins, the calls at the end; the final response holds what the stream sent
        (``StreamedAnswer``)."""
        # (a background response is created queued, as its POST answered it)
        yield event("response.created", response=self.skeleton("queued" if self.body.background else "in_progress")
                    .model_dump())
        yield event("response.in_progress", response=self.skeleton().model_dump())
        answer = AnswerStream(self.server, self.chat, self.in_thinking)
        logprobs = _StreamedLogprobs(self) if self.body.wants_logprobs() else None
        next_index = 0
        rs_index = msg_index = None  # output indices of the items opened
        rs_open = msg_open = False
        pending = ""  # whitespace held until text follows (around a call it is layout)
        sent: list[str] = []  # the message's text deltas
        after: list[str] = []  # the content after the first call began (held to the end)
        calls: list[dict[str, Any]] = []  # the call items opened: output_index, id, arguments sent
        rs_id, msg_id = self.ids["reasoning"], self.ids["message"]

        def open_reasoning() -> list[str]:
            nonlocal rs_index, rs_open, next_index
            rs_index, rs_open, next_index = next_index, True, next_index + 1
            item = {"type": "reasoning", "id": rs_id, "summary": [], "content": []}
            return [event("response.output_item.added", output_index=rs_index, item=item),
                    event("response.content_part.added", item_id=rs_id, output_index=rs_index, content_index=0,
                          part={"type": "reasoning_text", "text": ""})]

        def close_reasoning(text: str) -> list[str]:
            nonlocal rs_open
            rs_open = False
            part = {"type": "reasoning_text", "text": text}
            item = {"type": "reasoning", "id": rs_id, "summary": [], "content": [part]}
            return [event("response.reasoning_text.done", item_id=rs_id, output_index=rs_index, content_index=0,
                          text=text),
                    event("response.content_part.done", item_id=rs_id, output_index=rs_index, content_index=0,
                          part=part),
                    event("response.output_item.done", output_index=rs_index, item=item)]

        def open_message(item_id: str) -> list[str]:
            nonlocal msg_index, msg_open, next_index
            msg_index, msg_open, next_index = next_index, True, next_index + 1
            part = {"type": "output_text", "text": "", "annotations": []}
            if logprobs is not None:
                part["logprobs"] = []
            return [event("response.output_item.added", output_index=msg_index,
                          item=message_item(item_id, None, "in_progress")),
                    event("response.content_part.added", item_id=item_id, output_index=msg_index, content_index=0,
                          part=part)]

        def text_delta(item_id: str, delta: str, entries: list[dict[str, Any]]) -> str:
            return event("response.output_text.delta", item_id=item_id, output_index=msg_index, content_index=0,
                         delta=delta, logprobs=delta_logprobs(entries))

        def close_message(item: dict[str, Any], rest: list[dict[str, Any]]) -> list[str]:
            """The message's done events; ``rest``: its logprobs the stream held until now (they go out first)."""
            nonlocal msg_open
            msg_open = False
            part = item["content"][0]
            lines = [text_delta(item["id"], "", rest)] if rest else []
            return lines + [
                event("response.output_text.done", item_id=item["id"], output_index=msg_index, content_index=0,
                      text=part["text"], logprobs=delta_logprobs(part.get("logprobs", []))),
                event("response.content_part.done", item_id=item["id"], output_index=msg_index, content_index=0,
                      part=part),
                event("response.output_item.done", output_index=msg_index, item=item)]

        def open_call(call: ToolCall | ToolCallDelta) -> list[str]:
            nonlocal next_index
            (fc_id,) = call_item_ids(self.ids, len(calls) + 1)[-1:]
            calls.append({"index": next_index, "id": fc_id, "sent": ""})
            next_index += 1
            item = {"type": "function_call", "id": fc_id, "call_id": call.id, "name": call.name, "arguments": "",
                    "status": "in_progress"}
            return [event("response.output_item.added", output_index=calls[-1]["index"], item=item)]

        def arguments_delta(k: int, delta: str) -> str:
            calls[k]["sent"] += delta
            return event("response.function_call_arguments.delta", item_id=calls[k]["id"],
                         output_index=calls[k]["index"], delta=delta)

        choice = gen.choices[0]
        async for choice, chunk in gen.events():
            final = choice.finish_reason is not None
            if logprobs is not None:
                logprobs.feed(chunk)
            thought, pieces = answer.feed_in_order(chunk["text"], final=final)
            if answer.seen_reasoning and rs_index is None:
                for line in open_reasoning():
                    yield line
            if thought:
                yield event("response.reasoning_text.delta", item_id=rs_id, output_index=rs_index,
                            content_index=0, delta=thought)
            for d in pieces:  # (in the output's order: a chunk may hold text after a call)
                if isinstance(d, str) and calls:  # (text after a call began: the second message's)
                    after.append(d)  # (layout around the calls is already dropped: ContentLayout)
                    continue
                if isinstance(d, str):
                    pending += d
                    if msg_open or pending.strip():
                        if rs_open:
                            for line in close_reasoning(self.thoughts(choice.text) or ""):
                                yield line
                        if not msg_open:
                            for line in open_message(msg_id):
                                yield line
                        sent.append(pending)
                        yield text_delta(msg_id, pending, logprobs.take(choice.text) if logprobs is not None else [])
                        pending = ""
                    continue
                if d.name is not None:
                    if rs_open:
                        for line in close_reasoning(self.thoughts(choice.text) or ""):
                            yield line
                    if msg_open:  # (its logprobs: those of the tokens before the call's marker)
                        rest = logprobs.take(choice.text) if logprobs is not None else []
                        item = message_item(msg_id, "".join(sent), "completed",
                                            logprobs.entries if logprobs is not None else None)
                        for line in close_message(item, rest):
                            yield line
                    for line in open_call(d):
                        yield line
                if d.arguments:
                    yield arguments_delta(d.index, d.arguments)
        streamed = None
        if answer.tools is not None:  # (whitespace alone, held, is the text of an answer without calls)
            streamed = StreamedAnswer("".join(sent) + ("" if calls else pending), answer.calls,
                                      "".join(after).lstrip())  # (a message of its own: no leading layout)
        response, kept = await asyncio.to_thread(self.finished, choice, streamed)
        self.keep(kept)
        output = response["output"]
        items = {item["id"]: item for item in output}
        if rs_open:
            reasoning_item = items.get(rs_id)
            for line in close_reasoning(reasoning_item["content"][0]["text"] if reasoning_item is not None else ""):
                yield line
        if msg_id in items and not calls:  # (where a call began, the message was done then)
            if not msg_open:
                for line in open_message(msg_id):
                    yield line
                if pending:
                    yield text_delta(msg_id, pending, logprobs.take(choice.text) if logprobs is not None else [])
            done = items[msg_id]["content"][0].get("logprobs")
            for line in close_message(items[msg_id], done[logprobs.sent:] if logprobs is not None and done else []):
                yield line
        for k, item in enumerate(o for o in output if o["type"] == "function_call"):
            if k >= len(calls):
                for line in open_call(ToolCall(item["name"], "", item["call_id"])):
                    yield line
            if item["arguments"][len(calls[k]["sent"]):]:
                yield arguments_delta(k, item["arguments"][len(calls[k]["sent"]):])
            yield event("response.function_call_arguments.done", item_id=item["id"], output_index=calls[k]["index"],
                        name=item["name"], arguments=item["arguments"])
            yield event("response.output_item.done", output_index=calls[k]["index"], item=item)
        after_id = self.ids["message_after"]
        if after_id in items:
            for line in open_message(after_id):
                yield line
            yield text_delta(after_id, items[after_id]["content"][0]["text"], [])
            for line in close_message(items[after_id], []):
                yield line
        # (a cancelled response, aborted by /abort_request, did not complete either)
        yield event("response.completed" if response["status"] == "completed" else "response.incomplete",
                    response=response)


class _Background:
    """A background response running (``background: true``): its turn's events (``_Turn.events``) made by a
    task of its own, not by a client's connection, each line kept while it runs, so that any number of
    readers stream it from any event (``follow``: the POST's own stream, ``GET ?stream=true``); a reader
    that goes away stops reading, not the run. ``cancel`` aborts it: it ends as an aborted response
    does (``cancelled``, its output so far). It ends stored, as any response (one that failed too, so
    that a client polling it finds it), with its events (``StoredResponse.events``:
    streamed again from the store), and leaves ``ResponsesRoutes.running``."""

    def __init__(self, routes: ResponsesRoutes, turn: _Turn, gen: Generation):
        self.routes, self.turn, self.gen = routes, turn, gen
        self.lines: list[str] = []  # the events so far (each one line: its index is its sequence number)
        self.done = False
        self._changed = asyncio.Event()  # set (and replaced) at each new line and at the end
        self.task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        try:
            async for line in self.turn.events(self.gen):
                self.lines.append(line)
                self._wake()
        finally:
            try:
                self._store()
            finally:  # (whatever happened: the run has ended, for its readers and for GET)
                self.routes.running.pop(self.turn.rid, None)
                self.done = True
                self._wake()
                self.gen.close()

    def _store(self) -> None:
        """The response as it ended, with its events, in the store (a failed one too, without its answer's
        conversation), its size the one measured at its end (off the loop) and its events'."""
        turn, store = self.turn, self.routes.store
        stored, size = store.get(turn.rid) if turn.stored_size is not None else None, turn.stored_size
        if stored is None and turn.final is not None and turn.final["status"] == "failed":
            stored = StoredResponse(turn.final, turn.prompt.conversation, turn.prompt.items)
            size = stored_size(stored)
        if stored is not None:
            stored.events = self.lines
            store.put(stored, size + text_chars(self.lines))

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def follow(self, after: int = -1) -> AsyncIterator[str]:
        """The events after sequence number ``after``, those made so far, then each as it is made, to the end."""
        i = after + 1
        while True:
            changed = self._changed
            while i < len(self.lines):
                yield self.lines[i]
                i += 1
            if self.done:
                return
            await changed.wait()

    async def cancel(self) -> dict[str, Any]:
        """Abort the run (its engine requests, as ``POST /abort_request`` does) and wait for its end: the
        response as it ended."""
        for choice in self.gen.choices:
            if choice.finish_reason is None:
                self.gen.engine.abort(choice.rid)
        await asyncio.shield(self.task)
        return self.turn.final or self.turn.skeleton("cancelled").model_dump()


async def _replayed(lines: list[str]) -> AsyncIterator[str]:
    for line in lines:
        yield line


class _StreamedLogprobs:
    """The message's logprobs as a stream sends them with its text deltas: each chunk's tokens held
    (``feed``) until a delta goes out, which takes those that start in the message's span of the output
    so far (``take``: ``_Turn.message_span``, not final). What a stream takes is the start of the whole
    response's list (``_Turn.message_logprobs``); the rest goes out at the end."""

    def __init__(self, turn: _Turn):
        self.turn, self.offsets = turn, turn.offsets()
        self.held: list[tuple[int, dict[str, Any]]] = []  # (where the token starts, its entry)
        self.entries: list[dict[str, Any]] = []  # those taken so far

    def feed(self, chunk: dict[str, Any]) -> None:
        lps, tops = chunk_logprobs(chunk)
        starts = self.offsets.advance(tid for _, tid in lps)
        entries = chat_logprobs(self.turn.prompt.engine.tokenizer, lps, tops).content or []
        self.held += [(at, e.model_dump()) for at, e in zip(starts, entries)]

    def take(self, text: str) -> list[dict[str, Any]]:
        """The held entries of the message's tokens the raw output ``text`` so far has shown; those
        before the span (the reasoning's) dropped."""
        start, end = self.turn.message_span(text, calls=False, final=False)
        taken = [e for at, e in self.held if start <= at < end]
        self.held = [(at, e) for at, e in self.held if at >= end]
        self.entries += taken
        return taken

    @property
    def sent(self) -> int:
        return len(self.entries)
