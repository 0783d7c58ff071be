"""One HTTP request's generation: its ``n`` (or batch of) engine requests, run and aborted together.

Every endpoint turns its request into ``Job``s — one engine request each: ``n`` choices of a prompt
are ``n`` jobs with the same tokens, so the prefix cache computes the prompt once — and runs them
as one ``Generation``: each job is an ``engine.async_generate(..., stream=True)`` iterator drained
by its own task into one queue. ``events()`` yields every engine chunk as it arrives, so a
streaming response interleaves its choices as they decode; ``collect()`` is the same stream run to
the end for a non-streaming response.

Each engine chunk carries only what is new (text, ids, and the logprobs of those ids). It is folded
into its ``Choice`` once (appended: linear in the output length) and handed on unchanged, so a
stream sends each chunk's own text and logprobs, and a full answer reads the ``Choice``.

Rules: a request never outlives its client (a disconnect, a stream closed early, an error: every
unfinished job is aborted, which frees its KV and state slots); an engine error before the
first byte is an HTTP status (``hyla.server.errors``), after it an error event then ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from hyla.engine.engine import Engine
from hyla.server.errors import APIError, ClientDisconnected, abort_error, engine_error
from hyla.server.metrics import ServerMetrics
from hyla.server.request_log import RequestLog

SSE_DONE = "data: [DONE]\n\n"


async def json_answer(build: Callable[[], Any]) -> JSONResponse:
    """A whole (not streamed) answer, ``build()``'s JSON value, built and encoded on a worker thread: a long
    answer's logprobs are much Python work (8,192 tokens with 20 alternatives each: ~2.6 s of pydantic models
    and JSON), which on the event loop would stall every other request meanwhile (their streams, their
    admission). ``build`` reads the finished choices and shared read-only state only."""
    return await asyncio.to_thread(lambda: JSONResponse(build()))


def sse(payload: Any) -> str:
    """One server-sent event holding ``payload`` (a pydantic model or a JSON value)."""
    data = payload.model_dump_json() if hasattr(payload, "model_dump_json") else json.dumps(payload)
    return f"data: {data}\n\n"


@dataclass
class Job:
    """One engine request: a prompt (text or token ids), its sampling params and checkpoints."""

    prompt: str | list[int]
    sampling_params: dict[str, Any]
    return_logprob: bool = False
    checkpoints: list[int] = field(default_factory=list)
    speculative_checkpoints: bool = False  # the checkpoints are guesses (a chat's message ends)
    rid: str | None = None
    logprob_start_len: int = -1  # prompt logprobs from this position (-1: none)
    priority: int | None = None  # priority scheduling (Engine.generate's docstring)
    namespace: Any = None  # the prefix cache's partition (a cache_salt's: protocol.cache_namespace)
    aborted: bool = False  # aborted before it reached this server (disaggregation.ABORTED_HEADER): aborted at once
    lora_name: str | None = None  # its LoRA adapter (a request's model names one: Server.check_model); None: the model
    image_data: list[Any] | None = None  # the prompt's images (Engine.generate's image_data; data URLs), in order


def job_request(job: Job) -> dict[str, Any]:
    """``job`` as the keyword arguments of ``Engine.generate`` (but its ``rid``)."""
    text, ids = (job.prompt, None) if isinstance(job.prompt, str) else (None, job.prompt)
    return dict(prompt=text, input_ids=ids, sampling_params=job.sampling_params, return_logprob=job.return_logprob,
                checkpoints=job.checkpoints or None, logprob_start_len=job.logprob_start_len,
                speculative_checkpoints=job.speculative_checkpoints, priority=job.priority, namespace=job.namespace,
                lora_name=job.lora_name, image_data=job.image_data)


@dataclass
class Choice:
    """What one job has produced so far: the text pieces, ids and logprobs of every chunk appended,
    and the latest ``meta`` (the engine's ``meta_info`` less the logprob lists: counts, finish_reason)."""

    index: int
    rid: str
    output_ids: list[int] = field(default_factory=list)
    token_logprobs: list[tuple[float, int, None]] | None = None
    """The engine's ``output_token_logprobs`` of every token so far (None: not asked for)."""
    top_logprobs: list[list[tuple[float, int]]] | None = None
    """The engine's ``output_top_logprobs`` of every token so far (None: not asked for)."""
    input_logprobs: list[tuple[float | None, int, None]] | None = None
    """The engine's ``input_token_logprobs`` (prompt logprobs; None: not asked for)."""
    input_top_logprobs: list[list[tuple[float, int]] | None] | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    first_token_time: float | None = None
    last_token_time: float | None = None
    _pieces: list[str] = field(default_factory=list)

    @property
    def text(self) -> str:
        if len(self._pieces) > 1:
            self._pieces[:] = ["".join(self._pieces)]  # joined once per read, not per chunk
        return self._pieces[0] if self._pieces else ""

    @property
    def finish_reason(self) -> dict[str, Any] | None:
        """The engine's finish_reason (``{"type": "stop" | "length" | "abort", ...}``), None while running."""
        return self.meta.get("finish_reason")

    def openai_finish_reason(self) -> str | None:
        reason = self.finish_reason
        return None if reason is None else reason["type"]

    def meta_info(self) -> dict[str, Any]:
        """The engine's ``meta_info`` for everything so far (the native API's cumulative view)."""
        info = dict(self.meta)
        if self.input_logprobs is not None:
            info["input_token_logprobs"] = self.input_logprobs
        if self.input_top_logprobs is not None:
            info["input_top_logprobs"] = self.input_top_logprobs
        if self.token_logprobs is not None:
            info["output_token_logprobs"] = self.token_logprobs
        if self.top_logprobs is not None:
            info["output_top_logprobs"] = self.top_logprobs
        return info

    def fold(self, chunk: dict[str, Any], now: float) -> None:
        """Append one engine chunk (``{"text", "output_ids", "meta_info"}``, only what is new)."""
        if chunk["output_ids"]:
            self.first_token_time = self.first_token_time or now
            self.last_token_time = now
        self._pieces.append(chunk["text"])
        self.output_ids.extend(chunk["output_ids"])
        meta = dict(chunk["meta_info"])
        lps, tops = meta.pop("output_token_logprobs", None), meta.pop("output_top_logprobs", None)
        inputs, input_tops = meta.pop("input_token_logprobs", None), meta.pop("input_top_logprobs", None)
        if inputs is not None and self.input_logprobs is None:  # the first chunk (and the final output) carry them
            self.input_logprobs, self.input_top_logprobs = inputs, input_tops
        if lps is not None:
            self.token_logprobs = self.token_logprobs if self.token_logprobs is not None else []
            self.token_logprobs.extend(lps)
        if tops is not None:
            self.top_logprobs = self.top_logprobs if self.top_logprobs is not None else []
            self.top_logprobs.extend(tops)
        self.meta = meta


def chunk_logprobs(chunk: dict[str, Any]) -> tuple[list[tuple[float, int]], list[list[tuple[float, int]]]]:
    """A chunk's own tokens' ``(logprob, token_id)`` and top alternatives (empty if not asked for)."""
    meta = chunk["meta_info"]
    return [(lp, tid) for lp, tid, _ in meta.get("output_token_logprobs", ())], meta.get("output_top_logprobs", [])


_END = object()


class Generation:
    """``n`` engine requests started together and merged into one event stream.

    Invariants: after ``submit`` returns, every job is submitted; ``close`` (idempotent, synchronous
    so that it also runs inside a cancelled task) aborts every job that has not finished and calls
    ``on_close(self)`` once."""

    def __init__(self, engine: Engine, metrics: ServerMetrics, endpoint: str, arrival: float,
                 on_close: Callable[[Generation], None] | None = None, request_log: RequestLog | None = None):
        self.engine, self.metrics, self.endpoint, self.arrival = engine, metrics, endpoint, arrival
        self.request_log = request_log
        self.choices: list[Choice] = []
        self.jobs: list[Job] = []  # each choice's job
        self._on_close = on_close
        self._queue: asyncio.Queue = asyncio.Queue()
        self._tasks: list[asyncio.Task] = []
        self._streams: list[Any] = []  # each job's engine stream (``AsyncRequestStream``), in choice order
        self._num_open = 0
        self._abort_error: APIError | None = None
        self._closed = False

    async def submit(self, jobs: list[Job]) -> None:
        """Submit every job. Raises the first submission error as an ``APIError`` (the jobs already
        submitted are aborted, and the generation is closed)."""
        try:
            for i, job in enumerate(jobs):
                rid = job.rid or f"{self.endpoint}-{uuid.uuid4().hex}"
                stream = await self.engine.async_generate(**job_request(job), stream=True, rid=rid)
                if job.aborted:  # (its output: nothing, finish_reason abort, cause client: as POST /abort_request's)
                    self.engine.abort(rid)
                choice = Choice(index=i, rid=rid)
                self.choices.append(choice)
                self.jobs.append(job)
                self._streams.append(stream)
                self._tasks.append(asyncio.create_task(self._pump(choice, stream)))
            self._num_open = len(self._tasks)
        except BaseException as exc:  # e.g. EngineOverloadedError from a later job: abort the earlier ones
            self.close()
            if isinstance(exc, Exception):
                raise engine_error(exc, self.endpoint) from exc
            raise

    def abort(self, error: APIError) -> None:
        """Abort every unfinished job on the server's behalf (a shutdown): ``events()`` raises ``error``."""
        self._abort_error = error
        for choice in self.choices:
            if choice.finish_reason is None:
                self.engine.abort(choice.rid)

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

    def _ended(self, choice: Choice, reason: str) -> None:
        """``choice``'s request ended (``reason``: its finish_reason's type): counted, and logged (``--log-requests``)."""
        self.metrics.observe_request(self.endpoint, reason, self.arrival, choice.first_token_time,
                                     choice.last_token_time, len(choice.output_ids), choice.meta)
        if self.request_log is not None:
            job = self.jobs[choice.index]
            self.request_log.ended(self.endpoint, choice.rid, job.prompt, job.sampling_params, choice.meta,
                                   choice.text, self.arrival, choice.first_token_time, time.monotonic(),
                                   self.engine.tokenizer)

    async def events(self) -> AsyncIterator[tuple[Choice, dict[str, Any]]]:
        """``(choice, chunk)`` for every engine chunk, in arrival order, the chunk already folded
        into ``choice``; ends when every job has finished. A request the engine aborted on its own
        (a shutdown, an internal error...) raises ``abort_error``, an engine failure ``engine_error``
        (both ``APIError``s); one a client aborted (``POST /abort_request``: cause ``client``) ends
        with what it produced and ``finish_reason`` abort, as SGLang's."""
        while self._num_open:
            choice, item = await self._queue.get()
            if item is _END:
                self._num_open -= 1
                continue
            if isinstance(item, BaseException):
                raise engine_error(item, self.endpoint) from item
            now, previous = time.monotonic(), choice.last_token_time
            choice.fold(item, now)
            if previous is not None and item["output_ids"]:
                self.metrics.observe_tokens(now - previous, len(item["output_ids"]))
            reason = choice.finish_reason
            if reason is not None:
                self._ended(choice, reason["type"])
                if reason["type"] == "abort" and (self._abort_error is not None or reason.get("cause") != "client"):
                    raise self._abort_error or abort_error(reason)  # (a client's abort: its output so far)
            yield choice, item

    async def collect(self, request: Request) -> list[Choice]:
        """Run to the end and return the choices; if the client disconnects first, abort everything
        and raise ``ClientDisconnected``."""
        try:
            await _unless_disconnected(request, self._run_to_end())
        finally:
            self.close()
        return self.choices

    async def _run_to_end(self) -> None:
        async for _ in self.events():
            pass

    def stream(self, lines: AsyncIterator[str]) -> StreamingResponse:
        """A server-sent-event response of ``lines`` (``sse_stream``); its end, a disconnect included
        (which cancels the body), closes the generation: what is still running is aborted."""
        return sse_stream(lines, self.endpoint, self.close)

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        if self._closed:
            return
        self._closed = True
        for choice, stream in zip(self.choices, self._streams):
            if choice.finish_reason is None:  # the client went away (or a failure): abort, and count it
                stream.close()  # (the request itself, unless it has ended: its rid may be a new request's by then)
                self._ended(choice, "abort")
        if self._on_close is not None:
            self._on_close(self)


def sse_stream(lines: AsyncIterator[str], endpoint: str, on_end: Callable[[], None] | None = None
               ) -> StreamingResponse:
    """A server-sent-event response of ``lines`` (which end with ``[DONE]``, or an API's own last
    event). An error after the headers is sent as an error event followed by ``[DONE]``; ``on_end``
    runs when the body ends, however it ends."""

    async def body() -> AsyncIterator[bytes]:
        try:
            async for line in lines:
                yield _utf8(line)  # (here: a line that cannot be sent is an error event, not a dropped stream)
        except Exception as exc:
            yield sse(engine_error(exc, endpoint).body()).encode()
            yield SSE_DONE.encode()
        finally:
            if on_end is not None:
                on_end()

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _utf8(line: str) -> bytes:
    """A stream's line as the UTF-8 it is sent as; one that is not Unicode text (a lone surrogate) is an
    internal error (``APIError`` 500): every field the server writes should have been made text before."""
    try:
        return line.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise APIError(500, f"internal error: an event that is not UTF-8 text ({exc.reason} at {exc.start})",
                       type="internal_error", code="internal_error") from exc


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
