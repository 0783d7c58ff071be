"""The front door: a thread that owns the listening socket and answers health checks itself.

Every request is served by one asyncio event loop. When hundreds of requests arrive at once, a
health check that waits its turn on that loop waits for all of them to be accepted and parsed (200
streaming chats on a 2-core machine: 230-370 ms), and a load balancer reads a slow health check as a
dead server. So the loop does not accept connections: the front door does, on its own thread, and
looks at the bytes waiting on each connection without consuming them (``MSG_PEEK``):

* while those bytes are exactly one complete ``GET /health`` or ``HEAD /health`` request (no query,
  no body, nothing after it — what load balancers and Kubernetes probes send), the front door
  consumes and answers it with ``health()``, and keeps the connection for the next one unless the
  client asked to close it (``Connection: close``, or HTTP/1.0 without ``keep-alive``);
* at any other request (or a request that has not arrived whole) the connection is handed to the
  event loop as it is, at a request boundary (``loop.connect_accepted_socket`` with uvicorn's
  protocol): the app sees it exactly as if the loop had accepted it, ``/health`` included;
* a new connection that has sent nothing after ``PEEK_SECONDS`` is handed over too (the loop's own
  timeouts deal with idle clients); a health checker's connection idle for ``KEEP_ALIVE_SECONDS``
  is closed, as uvicorn closes idle connections.

With TLS (``hyla serve --ssl-certfile``) the bytes are encrypted: the front door hands every connection
over at once, and the loop makes the TLS handshake (``ssl``); a health check is then the app's, on the loop.

The answer is truthful: ``health()`` is the app's own (``Server.health``: 503 while the engine is not
running or the server shuts down), and 503 ``event_loop_stalled`` when the loop has not run its
heartbeat for ``STALL_SECONDS``, so a wedged loop does not hide behind a healthy front door.

Cost for every other connection: one peek (the loop then reads the same bytes) and one wake-up of
the loop to hand it over. The thread needs the GIL only for those few calls, so a health check
waits for the GIL, never for the loop's queue of work.
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import selectors
import socket
import threading
import time
from dataclasses import dataclass
from ssl import SSLContext
from typing import Callable

from hyla.server.errors import APIError

logger = logging.getLogger("hyla.server")

PEEK_BYTES = 2048
"""A health request longer than this (many headers) goes to the loop."""
PEEK_SECONDS = 0.05
"""How long a new connection may take to send its first bytes before it is handed to the loop."""
KEEP_ALIVE_SECONDS = 5.0
"""A health checker's kept-alive connection idle this long is closed (uvicorn's default too)."""
STALL_SECONDS = 10.0
"""The loop has stalled when its heartbeat (every ``HEARTBEAT_SECONDS``) is older than this; a burst
of requests delays it by well under a second."""
HEARTBEAT_SECONDS = 0.5
ACCEPT_RETRY_SECONDS = 1.0
"""Out of file descriptors (EMFILE): stop accepting for this long, as asyncio does."""
HEALTH_PATH = b"/health"

Health = Callable[[], tuple[int, dict]]
"""``() -> (status, JSON body)`` of a health check."""


@dataclass(frozen=True)
class HealthRequest:
    method: str  # "GET" or "HEAD"
    keep_alive: bool


def parse_health_request(head: bytes) -> HealthRequest | None:
    """The health check that ``head`` is exactly (one complete ``GET|HEAD /health`` request with no
    body), else None: another path, a query, an incomplete head, a body, or bytes after the request."""
    end = head.find(b"\r\n\r\n")
    if end < 0 or end + 4 != len(head):
        return None
    line, _, header_block = head[:end].partition(b"\r\n")
    parts = line.split(b" ")
    if len(parts) != 3 or parts[0] not in (b"GET", b"HEAD") or parts[1] != HEALTH_PATH \
            or parts[2] not in (b"HTTP/1.0", b"HTTP/1.1"):
        return None
    headers = {}
    for field in header_block.split(b"\r\n") if header_block else ():
        name, colon, value = field.partition(b":")
        if not colon:
            return None
        headers[name.strip().lower()] = value.strip().lower()
    if b"content-length" in headers or b"transfer-encoding" in headers:
        return None
    connection = headers.get(b"connection", b"")
    keep_alive = b"keep-alive" in connection if parts[2] == b"HTTP/1.0" else b"close" not in connection
    return HealthRequest(parts[0].decode(), keep_alive)


def health_response(request: HealthRequest, status: int, body: dict) -> bytes:
    """The whole HTTP/1.1 response to a health check (a HEAD gets the head only)."""
    payload = json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()  # as JSONResponse
    reason = {200: b"OK", 503: b"Service Unavailable"}.get(status, b"")
    head = (b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\nconnection: %s\r\n\r\n"
            % (status, reason, len(payload), b"keep-alive" if request.keep_alive else b"close"))
    return head if request.method == "HEAD" else head + payload


@dataclass
class _Waiting:
    """A connection the front door holds: no request yet, or health checks only so far."""
    deadline: float  # hand it over (no request yet) or close it (idle after health checks)
    served: int = 0


class FrontDoor:
    """Accepts every connection on ``sock`` (a listening socket) on a thread of its own.

    ``health()`` answers the health checks it recognises (``parse_health_request``);
    ``on_health(method, status)`` is called after each (metrics); every other connection goes to
    ``loop`` with ``protocol_factory``. ``start()`` and ``stop()`` are called on the loop's thread;
    ``stop()`` stops accepting (the listening socket stays open: its owner closes it) and closes the
    connections it still holds. The thread touches the loop only through ``call_soon_threadsafe``."""

    def __init__(self, sock: socket.socket, loop: asyncio.AbstractEventLoop,
                 protocol_factory: Callable[[], asyncio.Protocol], health: Health,
                 on_health: Callable[[str, int], None] = lambda method, status: None,
                 ssl: SSLContext | None = None):
        self.sock, self.loop, self.ssl = sock, loop, ssl
        self.protocol_factory, self.health, self.on_health = protocol_factory, health, on_health
        self.heartbeat = time.monotonic()
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._held: dict[socket.socket, _Waiting] = {}
        self._stopping = False
        self._accepting_again_at: float | None = None
        self._beat: asyncio.TimerHandle | None = None
        self._connecting: set[asyncio.Task] = set()
        self._thread = threading.Thread(target=self._run, name="hyla-front-door", daemon=True)

    # --- the loop's side -------------------------------------------------------------------------
    def start(self) -> FrontDoor:
        self.sock.setblocking(False)
        self._selector.register(self.sock, selectors.EVENT_READ)
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._tick()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopping = True
        if self._beat is not None:
            self._beat.cancel()
        self._wake_w.send(b"x")
        self._thread.join(timeout=10)
        self._wake_r.close()
        self._wake_w.close()

    def _tick(self) -> None:
        self.heartbeat = time.monotonic()
        self._beat = self.loop.call_later(HEARTBEAT_SECONDS, self._tick)

    def _adopt(self, conn: socket.socket) -> None:
        task = self.loop.create_task(self._connect(conn))
        self._connecting.add(task)  # the loop keeps only a weak reference to a task
        task.add_done_callback(self._connecting.discard)

    async def _connect(self, conn: socket.socket) -> None:
        try:
            await self.loop.connect_accepted_socket(self.protocol_factory, conn, ssl=self.ssl)
        except Exception:  # the client may be gone already
            conn.close()

    # --- either side -----------------------------------------------------------------------------
    def answer(self) -> tuple[int, dict]:
        """``health()``, or 503 when the loop has not run its heartbeat for ``STALL_SECONDS``."""
        stalled = time.monotonic() - self.heartbeat
        if stalled > STALL_SECONDS:
            return 503, APIError(503, f"the event loop has not run for {stalled:.0f} s", type="service_unavailable",
                                 code="event_loop_stalled").body()
        return self.health()

    # --- the thread ------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stopping:
                deadlines = [w.deadline for w in self._held.values()]
                if self._accepting_again_at is not None:
                    deadlines.append(self._accepting_again_at)
                timeout = max(0.0, min(deadlines) - time.monotonic()) if deadlines else None
                for key, _ in self._selector.select(timeout):
                    if key.fileobj is self.sock:
                        self._accept()
                    elif key.fileobj is not self._wake_r:
                        self._serve(key.fileobj)  # type: ignore[arg-type]
                now = time.monotonic()
                for conn, waiting in list(self._held.items()):
                    if waiting.deadline <= now:
                        self._hand_over(conn) if waiting.served == 0 else self._close(conn)
                if self._accepting_again_at is not None and self._accepting_again_at <= now:
                    self._accepting_again_at = None
                    self._selector.register(self.sock, selectors.EVENT_READ)
        except Exception:
            logger.exception("the front door failed: no new connections are accepted")
        finally:
            for conn in list(self._held):
                self._close(conn)
            self._selector.close()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                return
            except OSError as exc:
                if exc.errno not in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    raise
                logger.error("cannot accept a connection (%s); trying again in %g s", exc, ACCEPT_RETRY_SECONDS)
                self._selector.unregister(self.sock)
                self._accepting_again_at = time.monotonic() + ACCEPT_RETRY_SECONDS
                return
            conn.setblocking(False)
            if conn.family in (socket.AF_INET, socket.AF_INET6):  # (asyncio sets it only where proto is TCP's)
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.ssl is not None:  # (no request can be read before the loop's handshake)
                self._give(conn)
                continue
            self._selector.register(conn, selectors.EVENT_READ)
            self._held[conn] = _Waiting(deadline=time.monotonic() + PEEK_SECONDS)

    def _serve(self, conn: socket.socket) -> None:
        """``conn`` has bytes (or was closed): answer the health check they are, or hand it over."""
        try:
            head = conn.recv(PEEK_BYTES, socket.MSG_PEEK)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:  # reset by the client
            head = b""
        if not head:
            self._close(conn)
            return
        request = parse_health_request(head)
        if request is None:
            self._hand_over(conn)
            return
        status, body = self.answer()
        response = health_response(request, status, body)
        try:
            conn.recv(len(head))  # consume the request (the next one starts after it)
            sent = conn.send(response)  # a few hundred bytes: the send buffer takes them, unless the client never reads
        except OSError:  # the client went away
            sent = -1
        if sent != len(response):
            self._close(conn)
            return
        self.on_health(request.method, status)
        waiting = self._held[conn]
        waiting.served += 1
        waiting.deadline = time.monotonic() + KEEP_ALIVE_SECONDS
        if not request.keep_alive:
            self._close(conn)

    def _hand_over(self, conn: socket.socket) -> None:
        self._release(conn)
        self._give(conn)

    def _give(self, conn: socket.socket) -> None:
        """``conn`` to the loop (``_adopt``), the front door holding it no more."""
        try:
            self.loop.call_soon_threadsafe(self._adopt, conn)
        except RuntimeError:  # the loop is closed
            conn.close()

    def _close(self, conn: socket.socket) -> None:
        self._release(conn)
        conn.close()

    def _release(self, conn: socket.socket) -> None:
        del self._held[conn]
        self._selector.unregister(conn)
