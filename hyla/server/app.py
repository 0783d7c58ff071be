"""The HTTP server: an OpenAI-compatible API and SGLang's native ``/generate`` over one ``Engine``.

    app = create_app("path/to/model", served_model_name="my-model", max_total_tokens=20000)
    uvicorn.run(app, host="127.0.0.1", port=30000)

Endpoints (details and fields in docs/server.md)::

    POST /v1/completions        POST /v1/chat/completions      GET /v1/models[/{model}]
    POST /generate              GET /health                    GET /metrics

How a request runs
------------------
Every endpoint turns its request into *jobs* (one engine request each: ``n`` choices of a prompt
are ``n`` jobs with the same tokens, so the prefix cache makes all but the first cheap) and runs
them as one ``Generation``: each job is an ``engine.async_generate(..., stream=True)`` iterator
drained by its own task into one queue, so a streaming response interleaves its choices as they
decode, and a non-streaming one is the same stream collected to the end.

Rules
-----
* The HTTP status is decided before the first byte is sent: bad input (pydantic, or the engine's
  ``ValueError``) → 400; unknown model → 404; missing/wrong API key → 401; a full queue
  (``EngineOverloadedError``) → 429 with ``Retry-After``. Every error body is OpenAI's
  ``{"error": {"message", "type", "param", "code"}}``; an error after a stream started is sent as a
  ``data: {"error": ...}`` event, followed by ``data: [DONE]``.
* A request never outlives its client: when the client disconnects (a stream is cancelled by
  Starlette; a non-streaming request is watched for ``http.disconnect``) every unfinished job is
  aborted, which frees its KV and state slots in the engine.
* The engine is created in the lifespan and shut down with the app; its scheduler runs on its own
  thread, the server's handlers only await queues.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from tokenizers import decoders

from hyla.engine.engine import DEFAULT_MODEL_DIR, Engine, EngineOverloadedError
from hyla.server.metrics import ServerMetrics
from hyla.server.protocol import (
    ChatChoice, ChatChoiceLogprobs, ChatChunkChoice, ChatCompletionChunk, ChatCompletionRequest,
    ChatCompletionResponse, ChatResponseMessage, ChatTokenLogprob, CompletionChoice, CompletionLogprobs,
    CompletionRequest, CompletionResponse, ErrorInfo, ErrorResponse, GenerateRequest, ModelCard, ModelList,
    PromptTokensDetails, TopLogprob, UsageInfo,
)

logger = logging.getLogger("hyla.server")

DEFAULT_MODEL_NAME = "hyla-default"
RETRY_AFTER_SECONDS = 1
RESERVED_TEMPLATE_VARIABLES = frozenset({"messages", "add_generation_prompt", "tools", "documents"})
ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/generate", "/health", "/metrics")


# --------------------------------------------------------------------------------------------
# errors
# --------------------------------------------------------------------------------------------
class APIError(Exception):
    """An error answered with an OpenAI-style body."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        info = ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)
        return ErrorResponse(error=info).model_dump()

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


class ClientDisconnected(Exception):
    """The client went away before its response was ready."""


def _engine_error(exc: BaseException) -> APIError:
    """Map what the engine raises to an HTTP error."""
    if isinstance(exc, EngineOverloadedError):
        return APIError(429, f"the server is overloaded: {exc}", type="rate_limit_error",
                        code="rate_limit_exceeded", headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
    if isinstance(exc, ValueError):
        return APIError(400, str(exc))
    if isinstance(exc, APIError):
        return exc
    logger.error("request failed", exc_info=exc)
    return APIError(500, f"internal error: {exc}", type="internal_error", code="internal_error")


def _abort_error(reason: dict[str, Any]) -> APIError:
    """The engine aborted a request the client did not abort (an internal error or a shutdown)."""
    message = str(reason.get("message", "aborted"))
    if "shut down" in message:
        return APIError(503, message, type="service_unavailable", code="engine_shutdown")
    return APIError(500, message, type="internal_error", code="request_aborted")


def _validation_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    if not errors:
        return APIError(400, "invalid request body")
    first = errors[0]
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    param = ".".join(loc) or None
    if first.get("type") == "json_invalid":
        ctx = first.get("ctx", {}).get("error", "")
        return APIError(400, f"the request body is not valid JSON: {ctx}".rstrip(": "), code="invalid_json")
    if not loc and first.get("type") in ("model_attributes_type", "dict_type", "model_type", "missing"):
        return APIError(400, "the request body must be a JSON object (Content-Type: application/json)",
                        code="invalid_json")
    msg = first.get("msg", "invalid value")
    more = f" (and {len(errors) - 1} more error(s))" if len(errors) > 1 else ""
    return APIError(400, f"{param}: {msg}{more}" if param else f"{msg}{more}", param=param)


# --------------------------------------------------------------------------------------------
# one generation: n engine requests run and aborted together
# --------------------------------------------------------------------------------------------
@dataclass
class Job:
    """One engine request: a prompt (text or token ids), its sampling params and checkpoints."""

    prompt: str | list[int]
    sampling_params: dict[str, Any]
    return_logprob: bool = False
    checkpoints: list[int] = field(default_factory=list)
    rid: str | None = None


@dataclass
class Choice:
    """What one job has produced so far (cumulative; ``num_sent_*`` track what a stream has sent)."""

    index: int
    rid: str
    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)
    first_token_time: float | None = None
    last_token_time: float | None = None
    num_sent_logprobs: int = 0

    @property
    def finish_reason(self) -> dict[str, Any] | None:
        return self.meta.get("finish_reason")

    @property
    def aborted(self) -> bool:
        return (self.finish_reason or {}).get("type") == "abort"

    def openai_finish_reason(self) -> str | None:
        reason = self.finish_reason
        return None if reason is None else reason["type"]

    def logprobs(self) -> list[tuple[float, int]]:
        return [(lp, tid) for lp, tid, _ in self.meta.get("output_token_logprobs", [])]

    def top_logprobs(self) -> list[list[tuple[float, int]]]:
        return self.meta.get("output_top_logprobs", [])

    def take_new_logprobs(self) -> tuple[list[tuple[float, int]], list[list[tuple[float, int]]]]:
        """Logprobs of tokens not sent yet (a stream sends each token's logprob once)."""
        lps, tops = self.logprobs(), self.top_logprobs()
        start, self.num_sent_logprobs = self.num_sent_logprobs, len(lps)
        return lps[start:], tops[start:len(lps)]


_END = object()


class Generation:
    """``n`` engine requests started together and merged into one event stream.

    Invariants: after ``start`` returns, every job is submitted; ``close`` (idempotent, synchronous
    so that it also runs inside a cancelled task) aborts every job that has not finished."""

    def __init__(self, engine: Engine, metrics: ServerMetrics, endpoint: str, arrival: float):
        self.engine, self.metrics, self.endpoint, self.arrival = engine, metrics, endpoint, arrival
        self.choices: list[Choice] = []
        self._queue: asyncio.Queue = asyncio.Queue()
        self._tasks: list[asyncio.Task] = []
        self._num_open = 0

    @classmethod
    async def start(cls, engine: Engine, metrics: ServerMetrics, endpoint: str, jobs: list[Job],
                    arrival: float) -> "Generation":
        """Submit every job. Raises the first submission error (the others are aborted)."""
        gen = cls(engine, metrics, endpoint, arrival)
        try:
            for i, job in enumerate(jobs):
                text, ids = (job.prompt, None) if isinstance(job.prompt, str) else (None, job.prompt)
                rid = job.rid or f"{endpoint}-{uuid.uuid4().hex}"
                stream = await engine.async_generate(
                    prompt=text, input_ids=ids, sampling_params=job.sampling_params, stream=True,
                    return_logprob=job.return_logprob, checkpoints=job.checkpoints or None, rid=rid)
                choice = Choice(index=i, rid=rid)
                gen.choices.append(choice)
                gen._tasks.append(asyncio.create_task(gen._pump(choice, stream)))
            gen._num_open = len(gen._tasks)
        except BaseException:  # e.g. EngineOverloadedError from a later job: abort the earlier ones
            gen.close()
            raise
        return gen

    async def _pump(self, choice: Choice, stream: AsyncIterator[dict[str, Any]]) -> None:
        try:
            async for chunk in stream:
                self._queue.put_nowait((choice, chunk))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # an engine failure mid-stream
            self._queue.put_nowait((choice, exc))
        finally:
            self._queue.put_nowait((choice, _END))

    async def events(self) -> AsyncIterator[tuple[Choice, dict[str, Any]]]:
        """``(choice, chunk)`` for every engine chunk, in arrival order, each already folded into
        ``choice``; ends when every job has finished. An engine error is raised."""
        while self._num_open:
            choice, item = await self._queue.get()
            if item is _END:
                self._num_open -= 1
                continue
            if isinstance(item, BaseException):
                raise item
            self._fold(choice, item)
            yield choice, item

    async def run_to_end(self) -> None:
        async for _ in self.events():
            pass

    def _fold(self, choice: Choice, chunk: dict[str, Any]) -> None:
        now = time.monotonic()
        if chunk["output_ids"]:
            choice.first_token_time = choice.first_token_time or now
            choice.last_token_time = now
        choice.text += chunk["text"]
        choice.output_ids.extend(chunk["output_ids"])
        meta = dict(chunk["meta_info"])
        for key in ("output_token_logprobs", "output_top_logprobs"):  # a chunk carries only its own
            if key in meta:
                acc = choice.meta.get(key, [])
                acc.extend(meta[key])
                meta[key] = acc
        choice.meta = meta
        if choice.finish_reason is not None:
            self.metrics.observe_request(self.endpoint, choice.finish_reason["type"], self.arrival,
                                         choice.first_token_time, choice.last_token_time, len(choice.output_ids))

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for choice in self.choices:
            if choice.finish_reason is None:
                self.engine.abort(choice.rid)

    def check_not_aborted(self) -> None:
        for choice in self.choices:
            if choice.aborted:
                raise _abort_error(choice.finish_reason)


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _unless_disconnected(request: Request, work: Awaitable[Any]) -> Any:
    """Await ``work``; if the client disconnects first, cancel it and raise ``ClientDisconnected``."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if task in done:
        return task.result()
    raise ClientDisconnected()


# --------------------------------------------------------------------------------------------
# token text for logprobs
# --------------------------------------------------------------------------------------------
@lru_cache(maxsize=1)
def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the character a byte-level BPE token uses → the byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = list(bs)
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


class TokenText:
    """Token id → (display string, exact bytes), as OpenAI's logprobs show tokens. A token that is
    not valid UTF-8 on its own (part of a multi-byte character) displays as ``bytes:\\xe4\\xbd``."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.byte_level = tokenizer is not None and isinstance(tokenizer.backend.decoder, decoders.ByteLevel)
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        if token_id not in self._cache:
            self._cache[token_id] = self._lookup(token_id)
        return self._cache[token_id]

    def _lookup(self, token_id: int) -> tuple[str, list[int]]:
        if self.tokenizer is None:
            return f"token_id:{token_id}", []
        raw = self.tokenizer.id_to_token(token_id) or ""
        table = _byte_level_decoder()
        if self.byte_level and raw and all(c in table for c in raw):
            data = bytes(table[c] for c in raw)
        else:
            data = self.tokenizer.decode([token_id], skip_special_tokens=False).encode("utf-8")
        try:
            return data.decode("utf-8"), list(data)
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in data), list(data)


def _completion_logprobs(token_text: TokenText, lps: list[tuple[float, int]],
                         tops: list[list[tuple[float, int]]], offset: int) -> CompletionLogprobs:
    out = CompletionLogprobs()
    for i, (lp, tid) in enumerate(lps):
        text, _ = token_text(tid)
        out.tokens.append(text)
        out.token_logprobs.append(lp)
        out.top_logprobs.append({token_text(t)[0]: v for v, t in tops[i]} if i < len(tops) and tops[i] else None)
        out.text_offset.append(offset)
        offset += len(text)
    return out


def _chat_logprobs(token_text: TokenText, lps: list[tuple[float, int]],
                   tops: list[list[tuple[float, int]]]) -> ChatChoiceLogprobs:
    content = []
    for i, (lp, tid) in enumerate(lps):
        text, data = token_text(tid)
        top = [TopLogprob(token=token_text(t)[0], logprob=v, bytes=token_text(t)[1])
               for v, t in (tops[i] if i < len(tops) else [])]
        content.append(ChatTokenLogprob(token=text, logprob=lp, bytes=data, top_logprobs=top))
    return ChatChoiceLogprobs(content=content)


# --------------------------------------------------------------------------------------------
# the server
# --------------------------------------------------------------------------------------------
def _sse(payload: Any) -> str:
    data = payload.model_dump_json() if hasattr(payload, "model_dump_json") else json.dumps(payload)
    return f"data: {data}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def _usage(choices: list[Choice], n: int) -> UsageInfo:
    """Usage of ``len(choices) // n`` prompts with ``n`` choices each: a prompt counts once, and its
    cached tokens are the fewest any of its choices had (what the prompt itself hit)."""
    prompt = cached = completion = 0
    for start in range(0, len(choices), n):
        group = choices[start:start + n]
        prompt += group[0].meta.get("prompt_tokens", 0)
        cached += min(c.meta.get("cached_tokens", 0) for c in group)
        completion += sum(c.meta.get("completion_tokens", 0) for c in group)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


class Server:
    """The endpoints, bound to one engine (set by the app's lifespan)."""

    def __init__(self, model_path: str | None, served_model_name: str | None, api_key: str | None,
                 engine_options: dict[str, Any]):
        self.model_path = model_path
        self.engine_options = engine_options
        self.api_key = api_key
        self.engine: Engine | None = None
        self.model_name = served_model_name or ""
        self.token_text: TokenText | None = None
        self.metrics = ServerMetrics(lambda: self.engine)

    # --- lifecycle ---------------------------------------------------------------------------
    def start_engine(self) -> None:
        engine = Engine(self.model_path, **self.engine_options)
        if not self.model_name:
            builtin = Path(engine.model_path).resolve() == DEFAULT_MODEL_DIR.resolve()
            self.model_name = DEFAULT_MODEL_NAME if builtin else Path(engine.model_path).name
        self.token_text = TokenText(engine.tokenizer)
        self.engine = engine
        logger.info("serving model %r from %s (context length %d)", self.model_name, engine.model_path,
                    engine.context_length)

    def stop_engine(self) -> None:
        engine, self.engine = self.engine, None
        if engine is not None:
            engine.shutdown()

    def _engine(self) -> Engine:
        if self.engine is None:
            raise APIError(503, "the engine is not running", type="service_unavailable", code="engine_not_ready")
        return self.engine

    # --- checks --------------------------------------------------------------------------------
    async def check_api_key(self, request: Request) -> None:
        """FastAPI dependency of the /v1 and /generate routes (``Authorization: Bearer KEY``); async so
        that FastAPI runs it on the event loop, not on a worker thread."""
        if self.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), self.api_key.encode()):
            raise APIError(401, "missing or invalid API key (send 'Authorization: Bearer <key>')",
                           type="authentication_error", code="invalid_api_key",
                           headers={"WWW-Authenticate": "Bearer"})

    def _check_model(self, model: str) -> None:
        if model != self.model_name:
            raise APIError(404, f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")

    # --- plain endpoints -----------------------------------------------------------------------
    async def health(self) -> JSONResponse:
        if self.engine is None:
            return APIError(503, "the engine is not running", type="service_unavailable").response()
        return JSONResponse({"status": "ok"})

    async def metrics_endpoint(self) -> Response:
        return Response(self.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    def _model_card(self) -> ModelCard:
        engine = self._engine()
        return ModelCard(id=self.model_name, root=str(engine.model_path), max_model_len=engine.context_length)

    async def list_models(self) -> ModelList:
        return ModelList(data=[self._model_card()])

    async def get_model(self, model: str) -> ModelCard:
        self._check_model(model)
        return self._model_card()

    # --- generation plumbing -------------------------------------------------------------------
    async def _start(self, endpoint: str, jobs: list[Job], arrival: float) -> Generation:
        try:
            return await Generation.start(self._engine(), self.metrics, endpoint, jobs, arrival)
        except Exception as exc:
            raise _engine_error(exc) from exc

    async def _collect(self, request: Request, gen: Generation) -> None:
        """Run ``gen`` to the end (aborting it if the client disconnects) and check its outcome."""
        try:
            await _unless_disconnected(request, gen.run_to_end())
        except (ClientDisconnected, asyncio.CancelledError):
            raise
        except Exception as exc:
            raise _engine_error(exc) from exc
        finally:
            gen.close()
        gen.check_not_aborted()

    def _stream(self, gen: Generation, events: AsyncIterator[str]) -> StreamingResponse:
        async def body() -> AsyncIterator[str]:
            try:
                async for line in events:
                    yield line
            except Exception as exc:  # after the headers: report in-band
                yield _sse(_engine_error(exc).body())
                yield SSE_DONE
            finally:
                gen.close()  # a disconnect cancels this generator: abort what is still running

        return StreamingResponse(body(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, list):
            return prompt
        tokenizer = self._engine().tokenizer
        if tokenizer is None:
            raise APIError(400, "this model has no tokenizer: send the prompt as token ids", param="prompt")
        return tokenizer.encode(prompt)

    def _max_new_tokens(self, requested: int | None, prompt_len: int) -> int:
        """None = up to the context length (the engine refuses a prompt that leaves no room)."""
        if requested is not None:
            return requested
        return max(0, self._engine().context_length - prompt_len)

    # --- /v1/completions -----------------------------------------------------------------------
    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        arrival = time.monotonic()
        self._check_model(body.model)
        top_k = body.logprobs or 0
        jobs = []
        for prompt in body.prompts():
            ids = self._prompt_ids(prompt)
            max_new = self._max_new_tokens(body.max_tokens, len(ids))
            jobs += [Job(ids, body.sampling_params(max_new, top_k, j), return_logprob=body.logprobs is not None)
                     for j in range(body.n)]
        gen = await self._start("completions", jobs, arrival)
        rid = f"cmpl-{uuid.uuid4().hex}"
        if body.stream:
            return self._stream(gen, self._completion_events(body, gen, rid))
        await self._collect(request, gen)
        choices = [
            CompletionChoice(
                index=c.index, text=c.text, finish_reason=c.openai_finish_reason(),
                logprobs=_completion_logprobs(self.token_text, c.logprobs(), c.top_logprobs(), 0)
                if body.logprobs is not None else None)
            for c in gen.choices]
        return JSONResponse(CompletionResponse(id=rid, model=self.model_name, choices=choices,
                                               usage=_usage(gen.choices, body.n)).model_dump())

    async def _completion_events(self, body: CompletionRequest, gen: Generation, rid: str) -> AsyncIterator[str]:
        created = int(time.time())
        offsets = [0] * len(gen.choices)
        async for choice, chunk in gen.events():
            if choice.aborted:
                raise _abort_error(choice.finish_reason)
            logprobs = None
            if body.logprobs is not None:
                lps, tops = choice.take_new_logprobs()
                logprobs = _completion_logprobs(self.token_text, lps, tops, offsets[choice.index])
                offsets[choice.index] += sum(len(t) for t in logprobs.tokens)
            finish = choice.openai_finish_reason()
            if chunk["text"] or finish or (logprobs and logprobs.tokens):
                out = CompletionResponse(id=rid, created=created, model=self.model_name, choices=[
                    CompletionChoice(index=choice.index, text=chunk["text"], logprobs=logprobs, finish_reason=finish)])
                yield _sse(out)
        if body.include_usage():
            yield _sse(CompletionResponse(id=rid, created=created, model=self.model_name, choices=[],
                                          usage=_usage(gen.choices, body.n)))
        yield SSE_DONE

    # --- /v1/chat/completions ------------------------------------------------------------------
    async def chat_completions(self, body: ChatCompletionRequest, request: Request) -> Response:
        arrival = time.monotonic()
        self._check_model(body.model)
        engine = self._engine()
        if engine.tokenizer is None:
            raise APIError(400, "this model has no tokenizer, so no chat template: use /v1/completions with token ids")
        messages = [m.for_template() for m in body.messages]
        reserved = sorted(set(body.chat_template_kwargs or {}) & RESERVED_TEMPLATE_VARIABLES)
        if reserved:
            raise APIError(400, f"chat_template_kwargs may not set {reserved}", param="chat_template_kwargs")
        try:
            encoding = engine.tokenizer.encode_chat(messages, add_generation_prompt=True,
                                                    **(body.chat_template_kwargs or {}))
        except ValueError as exc:
            raise APIError(400, str(exc), param="messages") from exc
        max_new = self._max_new_tokens(body.max_new_tokens(), len(encoding.ids))
        top_k = (body.top_logprobs or 0) if body.logprobs else 0
        jobs = [Job(encoding.ids, body.sampling_params(max_new, top_k, j), return_logprob=body.logprobs,
                    checkpoints=list(encoding.boundaries)) for j in range(body.n)]
        gen = await self._start("chat", jobs, arrival)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        if body.stream:
            return self._stream(gen, self._chat_events(body, gen, rid))
        await self._collect(request, gen)
        choices = [
            ChatChoice(index=c.index, message=ChatResponseMessage(content=c.text),
                       finish_reason=c.openai_finish_reason(),
                       logprobs=_chat_logprobs(self.token_text, c.logprobs(), c.top_logprobs()) if body.logprobs else None)
            for c in gen.choices]
        return JSONResponse(ChatCompletionResponse(id=rid, model=self.model_name, choices=choices,
                                                   usage=_usage(gen.choices, body.n)).model_dump())

    async def _chat_events(self, body: ChatCompletionRequest, gen: Generation, rid: str) -> AsyncIterator[str]:
        created = int(time.time())

        def chunk_of(choice: ChatChunkChoice) -> str:
            return _sse(ChatCompletionChunk(id=rid, created=created, model=self.model_name, choices=[choice]))

        for choice in gen.choices:
            yield chunk_of(ChatChunkChoice(index=choice.index, delta={"role": "assistant", "content": ""}))
        async for choice, chunk in gen.events():
            if choice.aborted:
                raise _abort_error(choice.finish_reason)
            logprobs = None
            if body.logprobs:
                lps, tops = choice.take_new_logprobs()
                logprobs = _chat_logprobs(self.token_text, lps, tops)
            finish = choice.openai_finish_reason()
            if chunk["text"] or finish or (logprobs and logprobs.content):
                delta = {"content": chunk["text"]} if chunk["text"] else {}
                yield chunk_of(ChatChunkChoice(index=choice.index, delta=delta, logprobs=logprobs,
                                               finish_reason=finish))
        if body.include_usage():
            yield _sse(ChatCompletionChunk(id=rid, created=created, model=self.model_name, choices=[],
                                           usage=_usage(gen.choices, body.n)))
        yield SSE_DONE

    # --- /generate (native) --------------------------------------------------------------------
    async def generate(self, body: GenerateRequest, request: Request) -> Response:
        arrival = time.monotonic()
        jobs = self._native_jobs(body)
        gen = await self._start("generate", jobs, arrival)
        if body.stream:
            return self._stream(gen, self._native_events(gen))
        await self._collect(request, gen)
        outs = [{"text": c.text, "output_ids": c.output_ids, "meta_info": c.meta} for c in gen.choices]
        return JSONResponse(outs[0] if body.is_single() else outs)

    def _native_jobs(self, body: GenerateRequest) -> list[Job]:
        prompts: list[str | list[int]]
        if body.text is not None:
            prompts = [body.text] if isinstance(body.text, str) else list(body.text)
        else:
            prompts = [body.input_ids] if body.is_single() else list(body.input_ids)
        n = len(prompts)
        if n == 0:
            raise APIError(400, "no request given: text or input_ids is an empty list")

        def per_item(value: Any, name: str, is_list: bool) -> list[Any]:
            if value is None or not is_list:
                return [value] * n
            if len(value) != n:
                raise APIError(400, f"{name} has {len(value)} entries for {n} requests", param=name)
            return list(value)

        params = per_item(body.sampling_params, "sampling_params", isinstance(body.sampling_params, list))
        rids = per_item(body.rid, "rid", isinstance(body.rid, list))
        single_ckpt = body.checkpoints is None or not body.checkpoints or isinstance(body.checkpoints[0], int)
        if body.checkpoints and n > 1 and single_ckpt:
            raise APIError(400, "checkpoints must be a list of lists for a batch", param="checkpoints")
        ckpts = [body.checkpoints or []] if single_ckpt else per_item(body.checkpoints, "checkpoints", True)
        ckpts = ckpts * n if len(ckpts) == 1 else ckpts
        jobs = []
        for prompt, p, rid, ck in zip(prompts, params, rids, ckpts):
            p = dict(p or {})
            if body.top_logprobs_num is not None:
                p.setdefault("top_logprobs_num", body.top_logprobs_num)
            jobs.append(Job(prompt, p, return_logprob=body.return_logprob, checkpoints=list(ck), rid=rid))
        return jobs

    async def _native_events(self, gen: Generation) -> AsyncIterator[str]:
        async for choice, _ in gen.events():
            if choice.aborted:
                raise _abort_error(choice.finish_reason)
            yield _sse({"text": choice.text, "output_ids": choice.output_ids, "meta_info": choice.meta})
        yield SSE_DONE


# --------------------------------------------------------------------------------------------
# the app
# --------------------------------------------------------------------------------------------
class _CountRequests:
    """Pure ASGI middleware counting HTTP requests by route and status (a BaseHTTPMiddleware would
    break disconnect detection)."""

    def __init__(self, app: Any, metrics: ServerMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500

        async def send_and_record(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_record)
        finally:
            path = scope.get("path", "")
            route = next((r for r in ROUTES if path == r or path.startswith(r + "/")), "other")
            self.metrics.http_requests.labels(route, scope.get("method", ""), str(status)).inc()


def create_app(model_path: str | None = None, *, served_model_name: str | None = None, api_key: str | None = None,
               **engine_options: Any) -> FastAPI:
    """A FastAPI app serving one ``Engine(model_path, **engine_options)``, created at start-up.

    ``app.state.server`` is the ``Server`` (``.engine`` once started). ``served_model_name`` is the
    name clients must send as ``model`` (default: the model directory's name, ``hyla-default`` for the
    built-in model). With ``api_key``, /v1/* and /generate need ``Authorization: Bearer <api_key>``;
    /health and /metrics stay open."""
    server = Server(model_path, served_model_name, api_key, dict(engine_options))

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await asyncio.to_thread(server.start_engine)
        try:
            yield
        finally:
            await asyncio.to_thread(server.stop_engine)

    app = FastAPI(title="hyla", version=_version(), lifespan=lifespan)
    app.state.server = server
    app.add_middleware(_CountRequests, metrics=server.metrics)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return APIError(exc.status_code, str(exc.detail), type=kind, headers=exc.headers).response()

    @app.exception_handler(ClientDisconnected)
    async def _gone(request: Request, exc: ClientDisconnected) -> Response:
        return Response(status_code=499)  # nginx's "client closed request"; nobody reads it

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return APIError(500, f"internal server error: {type(exc).__name__}: {exc}", type="internal_error",
                        code="internal_error").response()

    auth = [Depends(server.check_api_key)]
    app.get("/health")(server.health)
    app.get("/metrics")(server.metrics_endpoint)
    app.get("/v1/models", dependencies=auth, response_model=ModelList)(server.list_models)
    app.get("/v1/models/{model:path}", dependencies=auth, response_model=ModelCard)(server.get_model)
    app.post("/v1/completions", dependencies=auth)(server.completions)
    app.post("/v1/chat/completions", dependencies=auth)(server.chat_completions)
    app.post("/generate", dependencies=auth)(server.generate)
    return app


def _version() -> str:
    from hyla import __version__
    return __version__
