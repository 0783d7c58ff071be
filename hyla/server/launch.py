"""Run the server inside this process, on a background thread (tests, notebooks, benchmarks).

    with BackgroundServer(create_app(model_dir, max_total_tokens=20000)) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
        engine = server.app.state.server.engine   # the live Engine, for checks

The socket is bound before uvicorn starts (``port=0``: the OS picks a free port), so there is no
window in which another process can take the port. ``__enter__`` returns once the app's lifespan
has created the engine and the server accepts connections; ``__exit__`` stops uvicorn: the app
drains (``UvicornServer``), then the engine shuts down.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from typing import Any

import uvicorn

logger = logging.getLogger("uvicorn.error")


class UvicornServer(uvicorn.Server):
    """``uvicorn.Server`` that drains a hyla app (``app.state.server.drain()``) before its own
    shutdown, whatever asked for it (SIGTERM, Ctrl-C, ``should_exit``): while the app drains, the
    listening socket stays open so that new requests get a 503 rather than a refused connection. A
    second signal (uvicorn's ``force_exit``) stops the waiting."""

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if sockets and self.started:  # uvicorn names the address only for sockets it bound itself
            host, port = sockets[0].getsockname()[:2]
            logger.info("Uvicorn running on http://%s:%d (Press CTRL+C to quit)",
                        f"[{host}]" if ":" in host else host, port)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        server = getattr(getattr(self.config.app, "state", None), "server", None)
        if server is not None and not self.force_exit:
            await server.drain(give_up=lambda: self.force_exit)
        await super().shutdown(sockets)


class BackgroundServer:
    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning",
                 startup_timeout: float = 120.0):
        self.app = app
        self.host = host
        self.startup_timeout = startup_timeout
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self.port: int = self._sock.getsockname()[1]
        config = uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=5)
        self._server = UvicornServer(config)
        self._thread = threading.Thread(target=self._run, name=f"hyla-server-{self.port}", daemon=True)
        self._error: BaseException | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def _run(self) -> None:
        try:
            self._server.run(sockets=[self._sock])
        except BaseException as exc:  # SystemExit on a failed start-up included
            self._error = exc

    def start(self) -> "BackgroundServer":
        self._thread.start()
        deadline = time.monotonic() + self.startup_timeout
        while not self._server.started:
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
