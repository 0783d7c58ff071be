"""The front door (hyla/server/front_door.py): health checks are answered on its own thread, without
the event loop; every other connection reaches the app untouched, at a request boundary.

Who answered is visible in the response: uvicorn adds a ``server: uvicorn`` header, the front door
does not."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest

from hyla.server import front_door
from hyla.server.app import create_app
from hyla.server.front_door import HealthRequest, parse_health_request
from hyla.server.launch import BackgroundServer
from test_server_openai import MODEL, make_chat_model
from test_server_storm import _metric


@pytest.mark.parametrize("head, expected", [
    (b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n", HealthRequest("GET", keep_alive=True)),
    (b"HEAD /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", HealthRequest("HEAD", keep_alive=False)),
    (b"GET /health HTTP/1.0\r\n\r\n", HealthRequest("GET", keep_alive=False)),
    (b"GET /health HTTP/1.0\r\nConnection: Keep-Alive\r\n\r\n", HealthRequest("GET", keep_alive=True)),
    (b"GET /health HTTP/1.1\r\nHost: x\r\n", None),  # incomplete
    (b"GET /health?verbose=1 HTTP/1.1\r\n\r\n", None),  # a query: the app's route
    (b"GET /healthz HTTP/1.1\r\n\r\n", None),
    (b"POST /health HTTP/1.1\r\n\r\n", None),
    (b"GET /health HTTP/1.1\r\nContent-Length: 2\r\n\r\n", None),  # a body
    (b"GET /health HTTP/1.1\r\n\r\nGET /health HTTP/1.1\r\n\r\n", None),  # pipelined: the app's
    (b"GET /health HTTP/1.1\r\nnot a header\r\n\r\n", None),
    (b"GET /health HTTP/2\r\n\r\n", None),
])
def test_parse_health_request(head, expected):
    assert parse_health_request(head) == expected


@pytest.fixture(scope="module")
def model_dir(tiny_ckpt_dir):
    return make_chat_model(tiny_ckpt_dir)


@pytest.fixture(scope="module")
def server(model_dir):
    app = create_app(model_dir, served_model_name=MODEL, max_total_tokens=4096, max_state_slots=16)
    with BackgroundServer(app) as srv:
        yield srv


def _connect(server) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=10)


def _exchange(sock: socket.socket, request: bytes, head_only: bool = False) -> tuple[int, dict[str, str], bytes]:
    """Send ``request``, read one response: (status, headers, body)."""
    sock.sendall(request)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(4096)
        assert chunk, f"connection closed after {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *lines = head.decode().split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines)}
    length = 0 if head_only else int(headers.get("content-length", 0))
    while len(body) < length:
        body += sock.recv(4096)
    return int(status_line.split()[1]), headers, body


def _closed(sock: socket.socket) -> bool:
    return sock.recv(1) == b""


def test_a_fresh_health_check_is_answered_by_the_front_door(server):
    with _connect(server) as sock:
        status, headers, body = _exchange(sock, b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert status == 200 and json.loads(body) == server.app.state.server.health()[1]
        assert json.loads(body)["status"] == "ok" and "server" not in headers and headers["connection"] == "close" and headers["content-type"] == "application/json"
        assert _closed(sock)


def test_kept_alive_health_checks_then_the_app_on_the_same_connection(server):
    with _connect(server) as sock:
        for _ in range(2):
            status, headers, body = _exchange(sock, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert status == 200 and "server" not in headers and headers["connection"] == "keep-alive"
        status, headers, empty = _exchange(sock, b"HEAD /health HTTP/1.1\r\nHost: x\r\n\r\n", head_only=True)
        assert status == 200 and "server" not in headers and int(headers["content-length"]) == len(body)
        # another request: the connection goes to the loop as it is, and stays there
        status, headers, models = _exchange(sock, b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
        assert status == 200 and headers["server"] == "uvicorn" and json.loads(models)["data"][0]["id"] == MODEL
        status, headers, body = _exchange(sock, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert status == 200 and headers["server"] == "uvicorn" and json.loads(body)["status"] == "ok"


def test_what_the_front_door_does_not_recognise_reaches_the_app(server):
    with _connect(server) as sock:  # a query
        status, headers, _ = _exchange(sock, b"GET /health?verbose=1 HTTP/1.1\r\nHost: x\r\n\r\n")
        assert status == 200 and headers["server"] == "uvicorn"
    with _connect(server) as sock:  # a health check sent in pieces
        sock.sendall(b"GET /hea")
        time.sleep(0.1)
        status, headers, _ = _exchange(sock, b"lth HTTP/1.1\r\nHost: x\r\n\r\n")
        assert status == 200 and headers["server"] == "uvicorn"
    with _connect(server) as sock:  # silent past PEEK_SECONDS: handed over, served when it speaks
        time.sleep(front_door.PEEK_SECONDS * 4)
        status, headers, _ = _exchange(sock, b"POST /health HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
        assert status == 405 and headers["server"] == "uvicorn"
    with _connect(server):
        pass  # connected and closed without a byte: nothing breaks
    assert httpx.get(server.url + "/health").status_code == 200


def test_the_front_door_counts_its_answers(server):
    def count(method: str) -> float:
        return _metric(httpx.get(server.url + "/metrics").text, "hyla_http_requests_total", route="/health",
                       method=method, status="200")

    before = count("GET"), count("HEAD")
    with _connect(server) as sock:
        _exchange(sock, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        _exchange(sock, b"HEAD /health HTTP/1.1\r\nHost: x\r\n\r\n", head_only=True)
    assert (count("GET"), count("HEAD")) == (before[0] + 1, before[1] + 1)


def test_health_answers_while_the_loop_is_blocked_and_says_when_it_stalls(model_dir, monkeypatch):
    monkeypatch.setattr(front_door, "STALL_SECONDS", 2.0)  # > the heartbeat's period (0.5 s) + a slow first poll
    app = create_app(model_dir, served_model_name=MODEL, max_total_tokens=4096, max_state_slots=16)
    with BackgroundServer(app) as srv:
        door = srv.uvicorn.front_doors[0]
        release = threading.Event()
        door.loop.call_soon_threadsafe(release.wait)  # the loop's thread waits here (without the GIL)
        try:
            assert httpx.get(srv.url + "/health", timeout=10).status_code == 200  # before the stall shows
            with pytest.raises(httpx.ReadTimeout):  # the app cannot answer meanwhile
                httpx.get(srv.url + "/v1/models", timeout=0.5)
            deadline = time.monotonic() + 10
            while (resp := httpx.get(srv.url + "/health", timeout=10)).status_code == 200:
                assert time.monotonic() < deadline, "the stall was never reported"
                time.sleep(0.05)
            assert resp.status_code == 503 and resp.json()["error"]["code"] == "event_loop_stalled"
        finally:
            release.set()
        deadline = time.monotonic() + 10
        while httpx.get(srv.url + "/health", timeout=10).status_code != 200:
            assert time.monotonic() < deadline, "the loop's recovery was never reported"
            time.sleep(0.05)


def test_connections_reach_the_loop_with_nagle_off():
    """A connection handed to the loop has ``TCP_NODELAY`` set (asyncio sets it only on sockets whose
    ``proto`` is TCP's, and an accepted socket's is 0): otherwise an answer's body waits behind its head
    for the client's delayed ACK, 40 ms on Linux, on every request."""
    import asyncio

    async def main() -> int:
        loop = asyncio.get_running_loop()
        seen: asyncio.Future = loop.create_future()

        class Record(asyncio.Protocol):
            def connection_made(self, transport):
                sock = transport.get_extra_info("socket")
                seen.set_result(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
                transport.close()

        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)  # (proto 0, as hyla serve's own)
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        door = front_door.FrontDoor(listener, loop, Record, health=lambda: (200, {})).start()
        try:
            client = socket.create_connection(listener.getsockname(), timeout=10)
            client.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
            return await asyncio.wait_for(seen, 10)
        finally:
            client.close()
            door.stop()
            listener.close()

    assert asyncio.run(main()) != 0
