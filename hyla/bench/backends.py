"""Streaming HTTP clients for one request each, timing every streamed chunk.

Backends (``--backend``):

* ``openai``: ``POST /v1/completions`` with ``stream=true`` and ``stream_options.include_usage``;
  the conversation is rendered as a plain-text transcript.
* ``openai-chat``: ``POST /v1/chat/completions``, same streaming format, ``messages`` as is.
* ``hyla``: hyla's (and SGLang's) native ``POST /generate`` with ``stream=true``: each event
  carries the cumulative ``text`` and ``meta_info`` (``prompt_tokens``, ``completion_tokens``,
  ``cached_tokens``).

All three speak server-sent events (``data: {...}`` lines, ``data: [DONE]`` at the end). The
server-reported prompt cache hit is read from ``usage.prompt_tokens_details.cached_tokens``
(OpenAI) or ``meta_info.cached_tokens`` (native). A request with a ``priority`` sends it as the
``priority`` field of each API (SGLang's and vLLM's; hyla's with ``--enable-priority-scheduling``).

A request fails (``success=False``, never an exception) on an HTTP error status, an error event
in the stream (``data: {"error": {...}}``: how hyla's, OpenAI's and vLLM's servers fail a started
stream; the server's message is kept), a malformed event, a stream that ends without ``[DONE]``,
a transport error, or its ``timeout_s`` (a limit on the whole request).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

import httpx

BACKENDS = ("openai", "openai-chat", "hyla")


@dataclass
class RequestResult:
    session_id: int
    turn_id: int
    priority: int | None = None  # sent with the request (None: no priority field)
    success: bool = False
    error: str = ""
    ttft: float = 0.0  # seconds from send to the first content chunk
    latency: float = 0.0  # seconds from send to the end of the stream
    itl: list[float] = field(default_factory=list)  # gaps between consecutive content chunks
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    text: str = ""

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first; None for single-token outputs."""
        if self.completion_tokens <= 1:
            return None
        return (self.latency - self.ttft) / (self.completion_tokens - 1)


def render_transcript(messages: list[dict[str, str]]) -> str:
    """A chat as plain text for the completions-style backends (stable, so turns share prefixes)."""
    lines = [f"{'User' if m['role'] == 'user' else 'Assistant'}: {m['content']}" for m in messages]
    return "\n".join(lines) + "\nAssistant:"


def build_payload(backend: str, model: str, messages: list[dict[str, str]], max_tokens: int,
                  priority: int | None = None) -> tuple[str, dict[str, Any]]:
    """(path, JSON body) of one streaming request."""
    extra = {} if priority is None else {"priority": priority}
    if backend == "openai-chat":
        return "/v1/chat/completions", {
            "model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True, **extra,
        }
    prompt = render_transcript(messages)
    if backend == "openai":
        return "/v1/completions", {
            "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True, **extra,
        }
    if backend == "hyla":
        return "/generate", {
            "text": prompt, "stream": True,
            "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}, **extra,
        }
    raise ValueError(f"unknown backend {backend!r}; choose from {', '.join(BACKENDS)}")


class StreamError(Exception):
    """A stream that went wrong after its headers: an error event, a malformed event, or an end
    without ``[DONE]``; the request counts as failed with this message."""


def _error_message(error: Any) -> str:
    """The server's error event (``{"error": {"message", "type", "code"}}``, OpenAI's and hyla's
    format; a bare string is accepted too) as one line."""
    if isinstance(error, dict):
        message = str(error.get("message") or json.dumps(error))
        kind = ", ".join(f"{k} {error[k]}" if k == "code" else str(error[k])
                         for k in ("type", "code") if error.get(k) not in (None, ""))
        return f"server error: {message}" + (f" ({kind})" if kind else "")
    return f"server error: {error}"


async def iter_sse(response: httpx.Response) -> AsyncIterator[dict[str, Any]]:
    """Decoded ``data:`` events of a server-sent-event stream, until ``[DONE]``.

    Raises ``StreamError`` on an error event (``{"error": ...}``, which servers send when a
    request fails after its stream started), on an event that is not a JSON object, and on a
    stream that ends without ``[DONE]`` (a broken stream: every backend ends with it)."""
    async for line in response.aiter_lines():
        line = line.strip()
        if not line.startswith("data:"):
            continue
        data = line[len("data:"):].strip()
        if data == "[DONE]":
            return
        try:
            event = json.loads(data)
        except json.JSONDecodeError:
            raise StreamError(f"malformed event (not JSON): {data[:200]}") from None
        if not isinstance(event, dict):
            raise StreamError(f"malformed event (not a JSON object): {data[:200]}")
        if "error" in event and event["error"] is not None:
            raise StreamError(_error_message(event["error"]))
        yield event
    raise StreamError("the stream ended without [DONE] (broken stream)")


def _delta_reasoning(backend: str, event: dict[str, Any]) -> str:
    """A chat stream's reasoning delta (``--reasoning-parser``'s ``reasoning_content``, vLLM's ``reasoning``): output
    the timings count,
    not the answer's text (a conversation's next turn takes the content only)."""
    if backend != "openai-chat":
        return ""
    choices = event.get("choices") or []
    delta = (choices[0].get("delta") or {}) if choices else {}
    return delta.get("reasoning_content") or delta.get("reasoning") or ""  # (vLLM's newer name: reasoning)


def _delta_text(backend: str, event: dict[str, Any], text_so_far: str) -> str:
    if backend == "hyla":
        return event.get("text", "")[len(text_so_far):]  # native events carry the cumulative text
    choices = event.get("choices") or []
    if not choices:
        return ""
    if backend == "openai-chat":
        return (choices[0].get("delta") or {}).get("content") or ""
    return choices[0].get("text") or ""


def _read_usage(backend: str, event: dict[str, Any], result: RequestResult) -> None:
    usage = event.get("meta_info") if backend == "hyla" else event.get("usage")
    if not usage:
        return
    result.prompt_tokens = int(usage.get("prompt_tokens", result.prompt_tokens) or 0)
    result.completion_tokens = int(usage.get("completion_tokens", result.completion_tokens) or 0)
    cached = usage.get("cached_tokens")
    if cached is None:
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    if cached is not None:
        result.cached_tokens = int(cached)


def _describe(exc: BaseException) -> str:
    """An exception as ``Type: message`` (httpx's timeouts and some transport errors have an
    empty message: then what the type means)."""
    if isinstance(exc, httpx.TimeoutException):
        what = {httpx.ConnectTimeout: "connecting", httpx.ReadTimeout: "waiting for data",
                httpx.WriteTimeout: "sending the request", httpx.PoolTimeout: "waiting for a connection"}
        detail = str(exc) or f"timed out {what.get(type(exc), 'on the connection')}"
        return f"{type(exc).__name__}: {detail}"
    return f"{type(exc).__name__}: {exc}" if str(exc) else f"{type(exc).__name__} (no message)"


async def send_request(
    client: httpx.AsyncClient,
    backend: str,
    model: str,
    messages: list[dict[str, str]],
    max_tokens: int,
    session_id: int = 0,
    turn_id: int = 0,
    priority: int | None = None,
    timeout_s: float | None = None,
) -> RequestResult:
    """Send one streaming request and time it; failures come back as ``success=False`` with the
    error: an HTTP error status, an error event in the stream, a malformed event, a stream that
    ends without ``[DONE]``, a transport error, or (``timeout_s``) a request that has not finished
    ``timeout_s`` seconds after it was sent."""
    result = RequestResult(session_id, turn_id, priority)
    path, payload = build_payload(backend, model, messages, max_tokens, priority)
    start = time.perf_counter()
    try:
        async with asyncio.timeout(timeout_s):
            await _stream(client, backend, path, payload, result, start)
    except TimeoutError:
        result.success = False
        result.error = f"timed out after {timeout_s:g} s (--timeout, the limit on a whole request)"
    except StreamError as e:
        result.success = False
        result.error = str(e)
    except httpx.HTTPError as e:
        result.success = False
        result.error = _describe(e)
    if not result.success:
        result.latency = time.perf_counter() - start
    return result


async def _stream(client: httpx.AsyncClient, backend: str, path: str, payload: dict[str, Any],
                  result: RequestResult, start: float) -> None:
    last = start
    num_chunks = 0
    async with client.stream("POST", path, json=payload) as response:
        if response.status_code != 200:
            body = (await response.aread()).decode(errors="replace")
            result.error = f"HTTP {response.status_code}: {body[:200]}"
            return
        async for event in iter_sse(response):
            try:
                delta = _delta_text(backend, event, result.text)
                thought = _delta_reasoning(backend, event)
                if not isinstance(delta, str) or not isinstance(thought, str):
                    raise TypeError(f"text of type {type(delta).__name__}")
                _read_usage(backend, event, result)
            except (AttributeError, TypeError, ValueError, KeyError, IndexError):
                raise StreamError(f"malformed event: {json.dumps(event)[:200]}") from None
            now = time.perf_counter()
            if delta or thought:  # (a thinking model's first token is its reasoning's)
                if num_chunks == 0:
                    result.ttft = now - start
                else:
                    result.itl.append(now - last)
                last = now
                num_chunks += 1
                result.text += delta
    result.latency = time.perf_counter() - start
    if result.completion_tokens == 0:
        result.completion_tokens = num_chunks  # the server sent no usage: one token per chunk
    result.success = num_chunks > 0
    if not result.success:
        result.error = "the stream carried no output"
