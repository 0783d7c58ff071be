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
"""

from __future__ import annotations

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


async def iter_sse(response: httpx.Response) -> AsyncIterator[dict[str, Any]]:
    """Decoded ``data:`` events of a server-sent-event stream, until ``[DONE]``."""
    async for line in response.aiter_lines():
        line = line.strip()
        if not line.startswith("data:"):
            continue
        data = line[len("data:"):].strip()
        if data == "[DONE]":
            return
        yield json.loads(data)


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


async def send_request(
    client: httpx.AsyncClient,
    backend: str,
    model: str,
    messages: list[dict[str, str]],
    max_tokens: int,
    session_id: int = 0,
    turn_id: int = 0,
    priority: int | None = None,
) -> RequestResult:
    """Send one streaming request and time it; failures come back as ``success=False`` with the error."""
    result = RequestResult(session_id, turn_id, priority)
    path, payload = build_payload(backend, model, messages, max_tokens, priority)
    start = time.perf_counter()
    last = start
    num_chunks = 0
    try:
        async with client.stream("POST", path, json=payload) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")
                result.error = f"HTTP {response.status_code}: {body[:200]}"
                return result
            async for event in iter_sse(response):
                delta = _delta_text(backend, event, result.text)
                now = time.perf_counter()
                if delta:
                    if num_chunks == 0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                    num_chunks += 1
                    result.text += delta
                _read_usage(backend, event, result)
        result.latency = time.perf_counter() - start
        if result.completion_tokens == 0:
            result.completion_tokens = num_chunks  # the server sent no usage: one token per chunk
        result.success = num_chunks > 0
        if not result.success:
            result.error = "the stream carried no output"
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        result.error = f"{type(e).__name__}: {e}"
    return result
