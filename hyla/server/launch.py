"""Run the app with uvicorn: ``UvicornServer`` (what ``hyla serve`` runs), and ``BackgroundServer``,
the server inside this process on a background thread (tests, notebooks, benchmarks).

    with BackgroundServer(create_app(model_dir, max_total_tokens=20000)) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
        engine = server.app.state.server.engine   # the live Engine, for checks

The socket is bound before uvicorn starts (``port=0``: the OS picks a free port), so there is no
window in which another process can take the port. ``__enter__`` returns once the app's lifespan
has created the engine and the server accepts connections; ``__exit__`` stops uvicorn: the app
drains (``UvicornServer``), then the engine shuts down.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import signal
import socket
import threading
import time
from typing import Any, Iterator

import uvicorn

from hyla.server.front_door import FrontDoor

logger = logging.getLogger("uvicorn.error")


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Serve inside this: SIGTERM (a container's stop), like Ctrl-C, ends it quietly once uvicorn has shut down.
    uvicorn re-raises the signal that stopped it after its shutdown; SIGTERM's default action would then kill
    the process (status 143, or -15 to a parent: a stop that looks like a crash). Here it is a
    ``KeyboardInterrupt``, swallowed, and the command returns 0, as after Ctrl-C."""
    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)


class UvicornServer(uvicorn.Server):
    """``uvicorn.Server`` for a hyla app (``app.state.server``, a ``hyla.server.app.Server``):

    * the listening sockets are accepted by a ``FrontDoor`` each (a thread that answers health
      checks itself and hands every other connection to the event loop), not by the loop;
    * before its own shutdown, whatever asked for it (SIGTERM, Ctrl-C, ``should_exit``), the app
      drains (``Server.drain``): the front doors keep accepting, so that new requests get a 503 rather
      than a refused connection. A second signal (uvicorn's ``force_exit``) stops the waiting;
    * ``gc_freeze``: once the app has started (the engine, the model, every module loaded), move
      every object alive to the collector's permanent generation (``gc.freeze()``), so that a full
      collection does not walk them again. Without it, a collection triggered by a burst of requests
      walked the whole heap for 150-300 ms holding the GIL, stalling the event loop and the engine
      alike. For a process that serves one app for its life (``hyla serve``): frozen objects that
      become cyclic garbage are never collected, so a process that starts and stops servers
      (tests) leaves it off."""

    def __init__(self, config: uvicorn.Config, gc_freeze: bool = False):
        super().__init__(config)
        self.gc_freeze = gc_freeze
        self.front_doors: list[FrontDoor] = []
        self.listening = False  # the sockets listen and their front doors run (uvicorn's `started` comes first)
        self._bound: list[socket.socket] = []  # sockets bound here (none given): closed at shutdown

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        if sockets is None:
            sockets = self._bound = [self.config.bind_socket()]
        await super().startup(sockets=[])  # the lifespan (the engine starts); uvicorn itself listens on nothing
        if not self.started:
            return
        if self.gc_freeze:  # before listening: the collection walks the whole heap once (~0.3 s)
            gc.collect()
            gc.freeze()
            logger.info("gc.freeze: %d objects alive after start-up are out of the collector's way",
                        gc.get_freeze_count())
        server = self.config.app.state.server
        loop = asyncio.get_running_loop()

        def count(method: str, status: int) -> None:
            server.metrics.http_requests.labels("/health", method, str(status)).inc()

        for sock in sockets:
            sock.listen(self.config.backlog)  # as asyncio's create_server would; bound, not listening, until now
        self.front_doors = [FrontDoor(sock, loop, self._protocol, server.health, count, ssl=self.config.ssl).start()
                            for sock in sockets]
        self.listening = True
        for sock in sockets if not self._bound else ():  # config.bind_socket() said so already
            host, port = sock.getsockname()[:2]
            logger.info("Uvicorn running on %s://%s:%d (Press CTRL+C to quit)", "https" if self.config.ssl else "http",
                        f"[{host}]" if ":" in host else host, port)

    def handle_exit(self, sig: int, frame: Any) -> None:
        """A signal (SIGINT, SIGTERM) while the app still starts (its lifespan builds the engine: loading, compiling,
        capturing graphs, minutes with ``compile_decode``) exits the process at once, status 0: nothing listens or
        runs yet, so nothing drains, and uvicorn would look at its exit flag only after the start-up (one Ctrl-C
        waited out a 140 s compile; three ended in a traceback). Once started, uvicorn's own handling (the drain)."""
        if not self.started:
            os.write(2, f"hyla serve: stopped by signal {sig} while starting: exiting\n".encode())
            os._exit(0)
        super().handle_exit(sig, frame)

    def _protocol(self) -> asyncio.Protocol:
        """A connection's protocol, as uvicorn makes it for the connections it accepts itself."""
        return self.config.http_protocol_class(config=self.config, server_state=self.server_state,
                                               app_state=self.lifespan.state)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        server = self.config.app.state.server
        if not self.force_exit:
            await server.drain(give_up=lambda: self.force_exit)
        for door in self.front_doors:
            door.stop()
        await super().shutdown(sockets if sockets is not None else self._bound)


class BackgroundServer:
    """``app`` served by a ``UvicornServer`` on a thread of its own (tests, benchmarks); ``options``: more of
    ``uvicorn.Config``'s (``ssl_keyfile`` and ``ssl_certfile``: TLS, ``url`` https)."""

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning",
                 startup_timeout: float = 120.0, **options: Any):
        self.app = app
        self.host = host
        self.startup_timeout = startup_timeout
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self.port: int = self._sock.getsockname()[1]
        config = uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=5, **options)
        self.scheme = "https" if config.is_ssl else "http"
        self._server = UvicornServer(config)
        self._thread = threading.Thread(target=self._run, name=f"hyla-server-{self.port}", daemon=True)
        self._error: BaseException | None = None

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.host}:{self.port}"

    @property
    def uvicorn(self) -> UvicornServer:
        """The ``UvicornServer`` running the app (its ``front_doors``, for checks)."""
        return self._server

    def _run(self) -> None:
        try:
            self._server.run(sockets=[self._sock])
        except BaseException as exc:  # SystemExit on a failed start-up included
            self._error = exc

    def start(self) -> "BackgroundServer":
        self._thread.start()
        deadline = time.monotonic() + self.startup_timeout
        while not self._server.listening:  # (`started` is set before the sockets listen)
            if not self._thread.is_alive():
                raise RuntimeError(f"the server failed to start: {self._error!r}")
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"the server did not start within {self.startup_timeout} s")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=60)
        self._sock.close()

    def __enter__(self) -> "BackgroundServer":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
