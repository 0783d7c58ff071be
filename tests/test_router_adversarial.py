"""``hyla route`` under what production traffic does to a router: workers failing mid-event, a last worker
draining, clients leaving in crowds, races between a client leaving and a worker answering, and large bodies
the router must not read on its event loop. Fake workers (FastAPI apps on threads: ``test_router._Uvicorn``)
show each failure on demand; nothing here needs a model.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
import time

import httpx
import openai
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from hyla.router import app as router_app
from hyla.router.app import Move, RouterApp, create_router_app
from hyla.router.policy import Router
from test_router import _closed_port_url, _Uvicorn


def _wait_for(condition, what: str, seconds: float = 30.0) -> None:
    """Poll ``condition`` until it holds (generous: a slow shared machine), else fail naming ``what``."""
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def _workers_info(url: str) -> list[dict]:
    return httpx.get(url + "/workers", timeout=30).json()["workers"]


def _cutting_worker():
    """A worker whose streams: ``/v1/completions`` sends an event, then half of one, then dies; ``/generate``
    sends an event split across two writes and ends normally, its last event without a blank line;
    ``/v1/responses`` sends ``response.created`` and ``response.in_progress``, then half an event, then dies."""
    app = FastAPI()
    app.get("/health")(lambda: JSONResponse({}))

    @app.post("/v1/completions")
    async def cut():
        async def events():
            yield b'data: {"choices": [{"index": 0, "text": "a"}]}\n\n'
            yield b'data: {"choices": [{"ind'
            await asyncio.sleep(0.2)
            raise RuntimeError("the worker died mid-event")
        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/generate")
    async def split():
        async def events():
            yield b'data: {"text": "a"}\n\ndata: {"te'
            await asyncio.sleep(0.2)
            yield b'xt": "b"}\n\ndata: [DONE]'
        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/messages")
    async def messages():
        message = {"id": "msg_1", "type": "message", "role": "assistant", "model": "m", "content": [],
                   "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": 3, "output_tokens": 0}}

        def event(kind: str, **fields) -> bytes:
            return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields})}\n\n".encode()

        async def events():
            yield event("message_start", message=message)
            yield event("content_block_start", index=0, content_block={"type": "text", "text": ""})
            yield event("content_block_delta", index=0, delta={"type": "text_delta", "text": "Hello"})
            yield b'event: content_block_delta\ndata: {"type": "content_bl'
            await asyncio.sleep(0.2)
            raise RuntimeError("the worker died mid-event")
        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/responses")
    async def responses():
        response = {"id": "resp_0a1b", "object": "response", "created_at": 1, "status": "in_progress", "model": "m",
                    "output": [], "parallel_tool_calls": True, "tool_choice": "auto", "tools": []}

        def event(kind: str, seq: int) -> bytes:
            return f"event: {kind}\ndata: {json.dumps({'type': kind, 'response': response, 'sequence_number': seq})}" \
                   "\n\n".encode()

        async def events():
            yield event("response.created", 0)
            yield event("response.in_progress", 1)
            yield b"event: response.output_item.added\ndata: {\"type\": \"resp"
            await asyncio.sleep(0.2)
            raise RuntimeError("the worker died mid-event")
        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def test_a_worker_dying_mid_event_leaves_the_client_no_half_event():
    """A worker that dies in the middle of an event: the client gets the events before it whole, then the
    error event and ``[DONE]`` — never the half event (an SDK would fail parsing its JSON instead of reporting
    the worker's failure). An event split across the worker's writes still arrives whole, and a stream that
    ends without a blank line ends as it came."""
    with _Uvicorn(_cutting_worker()) as fake, _Uvicorn(create_router_app([fake.url], health_interval=3600)) as r:
        with httpx.stream("POST", r.url + "/v1/completions", json={"prompt": "x", "stream": True}, timeout=30) as s:
            text = s.read().decode()
        events = [e for e in text.split("\n\n") if e.strip()]
        assert events[0] == 'data: {"choices": [{"index": 0, "text": "a"}]}' and events[-1] == "data: [DONE]"
        assert json.loads(events[1].removeprefix("data: "))["error"]["code"] == "worker_failed"
        assert len(events) == 3 and text.endswith("\n\n")
        client = openai.OpenAI(base_url=r.url + "/v1", api_key="unused", max_retries=0, timeout=30)
        _wait_for(lambda: httpx.get(r.url + "/health").status_code == 503, "the failed worker stays healthy")
        r.server.config.app.state.router.workers[0].healthy = True  # (as if its health check had passed)
        texts = []
        try:
            for chunk in client.completions.create(model="m", prompt="x", stream=True):
                texts.append(chunk.choices[0].text)
            raise AssertionError("the stream ended as if complete")
        except openai.APIError as exc:  # (not a JSONDecodeError of half an event)
            assert "failed mid-stream" in str(exc) and texts == ["a"]
        r.server.config.app.state.router.workers[0].healthy = True
        with httpx.stream("POST", r.url + "/generate", json={"text": "x", "stream": True}, timeout=30) as s:
            assert s.read() == b'data: {"text": "a"}\n\ndata: {"text": "b"}\n\ndata: [DONE]'
        assert _workers_info(r.url)[0]["in_flight"] == 0


def test_an_anthropic_stream_cut_by_its_worker_ends_with_its_error_event():
    """An Anthropic stream (``/v1/messages``) whose worker dies ends as a worker's own failed one does: an
    ``error`` event, which Anthropic's SDK raises (chat's unnamed ``data: {"error"}`` and ``[DONE]`` it skipped:
    the client saw a message cut short and no error)."""
    import anthropic

    body = {"model": "m", "max_tokens": 9, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    with _Uvicorn(_cutting_worker()) as fake, _Uvicorn(create_router_app([fake.url], health_interval=3600)) as r:
        with httpx.stream("POST", r.url + "/v1/messages", json=body, timeout=30) as s:
            text = s.read().decode()
        events = [e.split("\n") for e in text.split("\n\n") if e.strip()]
        assert [e[0] for e in events] == ["event: message_start", "event: content_block_start",
                                          "event: content_block_delta", "event: error"], text
        error = json.loads(events[-1][1].removeprefix("data: "))
        assert error["type"] == "error" and "failed mid-stream" in error["error"]["message"]
        r.server.config.app.state.router.workers[0].healthy = True  # (as if its health check had passed)
        client = anthropic.Anthropic(base_url=r.url, api_key="x", max_retries=0, timeout=30)
        with pytest.raises(anthropic.APIError, match="failed mid-stream"):
            for _ in client.messages.create(**body):
                pass


def test_a_responses_stream_cut_by_its_worker_ends_with_openais_failure_events():
    """A Responses stream whose worker dies ends as a worker's own failed Responses stream does: OpenAI's
    ``error`` event, then ``response.failed`` with the response (``status`` failed), numbered on from the
    last event — not chat's ``data: {"error"}`` and ``[DONE]``, which the SDK reads as another kind of
    failure."""
    with _Uvicorn(_cutting_worker()) as fake, _Uvicorn(create_router_app([fake.url], health_interval=3600)) as r:
        with httpx.stream("POST", r.url + "/v1/responses", json={"input": "x", "stream": True}, timeout=30) as s:
            text = s.read().decode()
        events = [e.split("\n") for e in text.split("\n\n") if e.strip()]
        assert [e[0] for e in events] == ["event: response.created", "event: response.in_progress", "event: error",
                                          "event: response.failed"]
        error, failed = (json.loads(e[1].removeprefix("data: ")) for e in events[2:])
        assert error["type"] == "error" and error["code"] == "worker_failed" and error["sequence_number"] == 2
        assert failed["type"] == "response.failed" and failed["sequence_number"] == 3
        assert failed["response"]["id"] == "resp_0a1b" and failed["response"]["status"] == "failed"
        assert failed["response"]["error"]["code"] == "server_error"
        r.server.config.app.state.router.workers[0].healthy = True
        client = openai.OpenAI(base_url=r.url + "/v1", api_key="unused", max_retries=0, timeout=30)
        kinds = [event.type for event in client.responses.create(model="m", input="x", stream=True)]
        assert kinds == ["response.created", "response.in_progress", "error", "response.failed"]


def test_the_last_workers_503_is_the_clients_answer():
    """A worker answering 503 (draining) sends the request to another worker; where no other is healthy, the
    client gets that worker's own 503 (its code, its ``Retry-After``), not a router 503 that hides why."""
    draining = FastAPI()
    draining.get("/health")(lambda: JSONResponse({}))

    @draining.post("/v1/completions")
    async def refuse():
        return JSONResponse({"error": {"message": "the server is shutting down", "type": "service_unavailable",
                                       "param": None, "code": "server_shutting_down"}},
                            status_code=503, headers={"Retry-After": "7"})

    with _Uvicorn(draining) as fake, \
            _Uvicorn(create_router_app([_closed_port_url(), fake.url], health_interval=3600)) as r:
        assert [w["healthy"] for w in _workers_info(r.url)] == [False, True]  # (the first: down at start-up)
        answer = httpx.post(r.url + "/v1/completions", json={"prompt": "p"}, timeout=30)
        assert answer.status_code == 503 and answer.headers["retry-after"] == "7"
        assert answer.json()["error"]["code"] == "server_shutting_down"
        assert [w["in_flight"] for w in _workers_info(r.url)] == [0, 0]


def test_an_answer_that_comes_as_the_client_leaves_is_closed_not_leaked():
    """The worker's answer can arrive while the router checks whether the client has gone: that answer's
    connection is closed (the worker aborts the request), not left open in the pool for ever."""
    async def scenario() -> bool:
        state = RouterApp(["http://127.0.0.1:1"], Router(1))
        arrived = asyncio.Event()

        class Answer:
            closed = False

            async def aclose(self) -> None:
                self.closed = True

        answer = Answer()

        class Client:
            async def send(self, request, stream: bool):
                await arrived.wait()
                return answer

        class LeavingRequest:
            async def is_disconnected(self) -> bool:
                arrived.set()  # (the answer comes in while this check is under way)
                for _ in range(5):
                    await asyncio.sleep(0)
                return True

        state.client = Client()
        assert await state._send(LeavingRequest(), None) is None
        return answer.closed

    assert asyncio.run(scenario())


def test_an_abort_body_is_read_only_while_a_prompt_moves_and_off_the_loop_when_large(monkeypatch):
    """``/abort_request``'s body matters to the router only while a prompt moves; a large one is parsed on a
    thread (a 16 MiB body of JSON takes the event loop for a noticeable time), as ``forward``'s is."""
    read_on: list[int] = []
    real = router_app._abort_target

    def spy(raw: bytes):
        read_on.append(threading.get_ident())
        return real(raw)

    monkeypatch.setattr(router_app, "_abort_target", spy)

    async def scenario() -> None:
        state = RouterApp(["http://127.0.0.1:1"], Router(1))
        loop_thread = threading.get_ident()
        await state.note_abort(b'{"abort_all": true}')
        assert read_on == []  # (nothing moves: nothing to read)
        move = Move(frozenset({"r1"}))
        state.moves.add(move)
        await state.note_abort(b'{"rid": "r2"}')
        assert read_on == [loop_thread] and not move.aborted.is_set()
        big = json.dumps({"rid": "r1", "pad": [0] * (router_app.PARSE_IN_THREAD_BYTES // 2)}).encode()
        await state.note_abort(big)
        assert read_on[1] != loop_thread and move.aborted.is_set()

    asyncio.run(scenario())


def test_crowds_of_clients_leaving_leave_no_load_behind():
    """Many clients at once leaving streams (the worker then silent) and whole answers: every request that
    reached a worker is closed there (the worker sees its client go) and the router's load counts come back
    to zero."""
    app, seen = FastAPI(), {"came": 0, "left": 0}
    app.get("/health")(lambda: JSONResponse({}))
    lock = threading.Lock()

    def count(what: str) -> None:
        with lock:
            seen[what] += 1

    @app.post("/v1/chat/completions")
    async def silent_stream():
        count("came")

        async def events():
            try:
                yield b'data: {"x": 1}\n\n'
                await asyncio.sleep(3600)
            finally:
                count("left")
        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def slow(request: Request):
        count("came")
        while not await request.is_disconnected():
            await asyncio.sleep(0.05)
        count("left")
        return JSONResponse({})

    async def crowd(url: str, n: int) -> None:
        async with httpx.AsyncClient(timeout=httpx.Timeout(60, read=2)) as client:
            async def stream() -> None:
                try:
                    async with client.stream("POST", url + "/v1/chat/completions", json={"messages": []}) as s:
                        async for line in s.aiter_lines():
                            if line:
                                return
                except httpx.ReadTimeout:  # (a slow machine: the client leaves before the first event)
                    pass

            async def whole() -> None:
                try:
                    await client.post(url + "/v1/completions", json={"prompt": "x"})
                except httpx.ReadTimeout:
                    pass
            await asyncio.gather(*(stream() for _ in range(n)), *(whole() for _ in range(n)))

    with _Uvicorn(app) as a, _Uvicorn(app) as b, \
            _Uvicorn(create_router_app([a.url, b.url], health_interval=3600)) as r:
        asyncio.run(crowd(r.url, 40))
        _wait_for(lambda: all(w["in_flight"] == 0 for w in _workers_info(r.url)), "load was left behind")
        _wait_for(lambda: seen["left"] == seen["came"], f"the workers saw {seen} clients come and leave")
        assert seen["came"] > 0 and all(w["healthy"] for w in _workers_info(r.url))


def test_a_client_leaving_mid_body_is_no_error_and_reaches_no_worker():
    """A client that sends half its body and leaves: nothing reaches a worker, and the router logs no
    "Exception in ASGI application" (an error and a traceback per such client would bury the real ones)."""
    app = FastAPI()
    app.get("/health")(lambda: JSONResponse({}))
    errors: list[logging.LogRecord] = []

    class Errors(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            errors.append(record)

    handler = Errors(level=logging.ERROR)
    with _Uvicorn(app) as fake, _Uvicorn(create_router_app([fake.url], health_interval=3600)) as r:
        logging.getLogger("uvicorn.error").addHandler(handler)
        try:
            host, port = r.url.removeprefix("http://").split(":")
            with socket.create_connection((host, int(port)), timeout=30) as s:
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\n"
                          b"Content-Length: 1000\r\n\r\n{\"prompt\": \"half")
                time.sleep(0.5)  # (the router is reading the body)
            # the connection is closed; a request after it is answered (the router read its leaving first)
            assert httpx.get(r.url + "/workers", timeout=30).status_code == 200
            _wait_for(lambda: r.server.server_state.connections == set(), "the half request's connection stays")
        finally:
            logging.getLogger("uvicorn.error").removeHandler(handler)
        assert _workers_info(r.url)[0]["routed"] == 0
    assert not [e.getMessage() for e in errors]


def _silent_worker(released: threading.Event) -> FastAPI:
    """A hung worker: ``/v1/chat/completions`` streams one event, then nothing; ``/v1/completions`` never
    answers (until ``released``, or a minute)."""
    app = FastAPI()
    app.get("/health")(lambda: JSONResponse({}))

    async def silence() -> None:
        deadline = time.monotonic() + 60
        while not released.is_set() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    @app.post("/v1/chat/completions")
    async def stream():
        async def events():
            yield b'data: {"choices": [{"index": 0, "delta": {"content": "a"}}]}\n\n'
            await silence()
        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def whole():
        await silence()
        return JSONResponse({"choices": []})

    return app


def test_a_silent_worker_fails_its_requests_after_the_read_timeout():
    """With ``read_timeout``, a worker that sends nothing for that long has failed the request: a stream ends
    with the error event and ``[DONE]``, a request it never answered goes to the other worker, and it is
    marked unhealthy (no new requests until a health check passes). Without one, the router waits."""
    released = threading.Event()
    answering = FastAPI()
    answering.get("/health")(lambda: JSONResponse({}))
    answering.post("/v1/completions")(lambda: JSONResponse({"choices": [{"text": "from the other"}]}))
    try:
        with _Uvicorn(_silent_worker(released)) as silent, _Uvicorn(answering) as other:
            with _Uvicorn(create_router_app([silent.url, other.url], policy="round_robin", health_interval=3600,
                                            read_timeout=1.0)) as r:
                whole = httpx.post(r.url + "/v1/completions", json={}, timeout=60)  # (round robin: the silent first)
                assert whole.status_code == 200 and whole.json()["choices"][0]["text"] == "from the other"
                assert [w["healthy"] for w in _workers_info(r.url)] == [False, True]
            with _Uvicorn(create_router_app([silent.url], health_interval=3600, read_timeout=1.0)) as r:
                with httpx.stream("POST", r.url + "/v1/chat/completions", json={"stream": True}, timeout=60) as s:
                    lines = [line for line in s.iter_lines() if line.startswith("data: ")]
                assert lines[0].startswith('data: {"choices"') and lines[-1] == "data: [DONE]", lines
                assert json.loads(lines[-2][6:])["error"]["code"] == "worker_failed"
                assert not _workers_info(r.url)[0]["healthy"]
        with _Uvicorn(_silent_worker(released)) as silent, \
                _Uvicorn(create_router_app([silent.url], health_interval=3600)) as r:
            waiting = threading.Thread(target=lambda: httpx.post(r.url + "/v1/completions", json={}, timeout=60))
            waiting.start()
            time.sleep(2.5)  # (well past the other router's timeout: this one, without, still waits)
            assert waiting.is_alive() and _workers_info(r.url)[0]["healthy"]
            released.set()
            waiting.join(timeout=30)
    finally:
        released.set()


def test_the_read_timeout_is_checked():
    import pytest
    for bad in (0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="read_timeout"):
            create_router_app(["http://127.0.0.1:1"], read_timeout=bad)
