"""The app factory: ``create_app`` builds the FastAPI app serving one ``Engine``.

    app = create_app("path/to/model", served_model_name="my-model", max_total_tokens=20000)
    uvicorn.run(app, host="127.0.0.1", port=30000)

The engine is created in the app's lifespan (on a worker thread) and shut down with the app; its
scheduler runs on its own thread, the handlers only await queues. This file wires the pieces:
``Server`` (what every route shares), the error handlers (``errors.py``), the request counter, the
routes (``openai_routes.py``, ``responses_routes.py``, ``conversations.py``, ``native_routes.py``, ``lora_routes.py``) behind the
API key, and the open ``/health`` and ``/metrics``. Endpoints and fields: docs/server.md.
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Sequence

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from hyla.engine.engine import DEFAULT_MODEL_DIR, Engine
from hyla.server.anthropic_routes import AnthropicRoutes
from hyla.server.auth import API_KEY_MESSAGE, bearer_key_matches
from hyla.server.cors import add_cors
from hyla.server.errors import APIError, add_error_handlers
from hyla.server.generation import Generation, Job
from hyla.server.lora_routes import LoraModule, LoraRoutes
from hyla.server.metrics import ServerMetrics
from hyla.server.media import MediaFetcher
from hyla.server.native_routes import NativeRoutes
from hyla.server.openai_routes import REQUEST_ID_HEADER, OpenAIRoutes
from hyla.server.reasoning import ReasoningParser
from hyla.server.request_log import RequestLog
from hyla.server.conversations import ConversationsRoutes
from hyla.server.responses_routes import ResponsesRoutes
from hyla.server.token_routes import TokenRoutes
from hyla.server.tool_calls import AUTO, DEFAULT_TOOL_CALL_PARSER, ToolCallParser, detect_tool_call_parser
from hyla.server.protocol import (DEFAULT_FETCH_TIMEOUT, DEFAULT_MAX_PREFIX_BYTES, DEFAULT_MAX_REQUEST_BYTES,
                                  DEFAULT_SHUTDOWN_TIMEOUT,
                                  DEFAULT_STORED_RESPONSE_BYTES, DEFAULT_STORED_RESPONSES, PROMPT_CHARS_PER_TOKEN)

logger = logging.getLogger("hyla.server")

DEFAULT_MODEL_NAME = "hyla-default"
ABORT_GRACE_SECONDS = 5.0  # then, for the aborted ones to send their last event
ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/conversations", "/v1/messages", "/v1/models",
          "/generate",
          "/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/flush_cache", "/tokenize", "/detokenize",
          "/export_prefix", "/import_prefix", "/health", "/metrics")
LARGE_BODY_PATHS = ("/import_prefix",)  # bodies up to max_prefix_bytes: a cached prefix's KV and state
METHODS = ("GET", "POST", "HEAD", "OPTIONS", "PUT", "PATCH", "DELETE")
"""HTTP methods counted by name; any other is counted as "other" (a label value per made-up method
would grow /metrics without bound)."""


class Server:
    """What every route shares: the engine (``None`` until the lifespan starts it and after it
    stops), the served model name, the metrics, the API key, the prompt cap (more than
    ``max_prompt_chars`` characters of prompt text in a request, default ``PROMPT_CHARS_PER_TOKEN``
    x the context length: 413), and the live generations.

    Shutdown (``drain``): from its first moment every new request gets a 503 and /health says 503;
    running generations get ``shutdown_timeout`` seconds to finish; then they are aborted (a stream
    ends with an error event and ``[DONE]``, a waiting request gets a 503).

    LoRA adapters (``enable_lora``): ``lora_modules`` are loaded as the engine starts (``--lora-modules``;
    one that fails fails the start-up); a request's ``model`` names the served model or a loaded adapter
    (``check_model``), and ``lora_parents`` holds each adapter's ``parent`` on ``/v1/models`` where it is
    not the served model's name (vLLM's ``base_model_name``)."""

    def __init__(self, model_path: str | None, served_model_name: str | None, api_key: str | None,
                 engine_options: dict[str, Any], max_prompt_chars: int | None = None,
                 shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT, lora_modules: Sequence[LoraModule] = ()):
        self.model_path = model_path
        self.engine_options = engine_options
        self.api_key = api_key
        self.max_prompt_chars = max_prompt_chars
        self.shutdown_timeout = shutdown_timeout
        self.engine: Engine | None = None
        if served_model_name is not None and (not isinstance(served_model_name, str) or not served_model_name):
            raise ValueError(f"served_model_name must be a non-empty string (None: the model directory's name), "
                             f"got {served_model_name!r:.80}")
        self.model_name = served_model_name or ""  # "": the engine's model, named at start-up (start_engine)
        self.metrics = ServerMetrics(lambda: self.engine)
        self.draining = False
        self.generations: set[Generation] = set()
        self.tool_call_parser = ToolCallParser()
        self.tool_call_parser_choice = DEFAULT_TOOL_CALL_PARSER  # a parser's name, or AUTO: the chat template's
        self.reasoning_parser: ReasoningParser | None = None
        self.media = MediaFetcher()  # image URLs fetched for requests (none: create_app's allowed_media_domains)
        self.request_log: RequestLog | None = None  # --log-requests
        self.lora_modules = list(lora_modules)
        self.lora_parents: dict[str, str] = {}  # adapter name -> its base_model_name (--lora-modules' JSON form)

    def start_engine(self) -> None:
        engine = Engine(self.model_path, **self.engine_options)
        if not self.model_name:
            builtin = Path(engine.model_path).resolve() == DEFAULT_MODEL_DIR.resolve()
            self.model_name = DEFAULT_MODEL_NAME if builtin else Path(engine.model_path).name
        try:
            self._load_lora_modules(engine)
        except BaseException:
            engine.shutdown()
            raise
        if self.tool_call_parser_choice == AUTO:
            template = engine.tokenizer.chat_template_for(tools=True) if engine.tokenizer is not None else None
            self.tool_call_parser = ToolCallParser(detect_tool_call_parser(template, engine.model_config.architecture))
            logger.info("tool-call parser: %s (the chat template's syntax; --tool-call-parser names another)",
                        self.tool_call_parser.name)
        self.engine = engine
        logger.info("serving model %r from %s (context length %d)", self.model_name, engine.model_path,
                    engine.context_length)

    def _load_lora_modules(self, engine: Engine) -> None:
        """Load ``lora_modules`` (``--lora-modules``) into ``engine``; the first that fails raises
        ``ValueError`` naming it (the start-up fails)."""
        for module in self.lora_modules:
            if module.name == self.model_name:
                raise ValueError(f"--lora-modules {module.name}={module.path}: the adapter's name is the served "
                                 "model's (--served-model-name): give it another")
            try:
                engine.load_lora_adapter(module.name, module.path)
            except ValueError as exc:
                raise ValueError(f"--lora-modules {module.name}={module.path}: {exc}") from None
            if module.base_model_name:
                self.lora_parents[module.name] = module.base_model_name
            logger.info("LoRA adapter %r loaded from %s", module.name, module.path)

    def stop_engine(self) -> None:
        engine, self.engine = self.engine, None
        if engine is not None:
            engine.shutdown()

    def health(self) -> tuple[int, dict]:
        """``/health``'s status and body: 200 ``{"status": "ok", "cache_id": ..., "instance_id": ..., "model": ...}``
        while the engine runs and the server admits requests (``cache_id``: ``Engine.cache_id``, which a router
        reads to forget what it knew of this cache once it was emptied or the server restarted; ``instance_id``:
        ``Engine.instance_id``, new after a restart, when a router sends again the weight update and adapters it
        broadcast; ``model``: the served model's name, which a router routes as no adapter), else ``admit``'s 503.
        Safe to call from any thread (the front door's)."""
        try:
            engine = self.admit()
        except APIError as exc:
            return exc.status, exc.body()
        return 200, {"status": "ok", "cache_id": engine.cache_id, "instance_id": engine.instance_id,
                     "model": self.model_name}

    def admit(self) -> Engine:
        """The engine, for a new request; a 503 while it is not running or the server shuts down."""
        if self.draining:
            raise APIError(503, "the server is shutting down", type="service_unavailable", code="server_shutting_down")
        if self.engine is None:
            raise APIError(503, "the engine is not running", type="service_unavailable", code="engine_not_ready")
        if not self.engine.is_alive:
            raise APIError(503, "the engine has stopped (see the server's log)", type="service_unavailable",
                           code="engine_dead")
        return self.engine

    async def start_generation(self, endpoint: str, jobs: list[Job], arrival: float) -> Generation:
        """Submit ``jobs`` as one ``Generation``, live until it closes. More jobs than the engine can
        ever hold at once (its running batch plus its waiting queue) are a 400: retrying cannot help."""
        engine = self.admit()
        capacity = engine.max_live_requests
        if len(jobs) > capacity:
            raise APIError(400, f"this request needs {len(jobs)} engine requests (prompts x n); the server holds "
                                f"at most {capacity} at once (max_running_requests + max_queued_requests)",
                           code="batch_too_large")
        gen = Generation(engine, self.metrics, endpoint, arrival, on_close=self.generations.discard,
                         request_log=self.request_log)
        self.generations.add(gen)
        await gen.submit(jobs)
        return gen

    async def drain(self, give_up: Callable[[], bool] = lambda: False) -> None:
        """Stop admitting, give the running generations ``shutdown_timeout`` seconds, abort the rest
        and wait (briefly) for their responses to end. ``give_up()`` true: stop waiting at once."""
        self.draining = True
        if self.generations:
            logger.info("shutting down: refusing new requests; waiting up to %g s for %d running",
                        self.shutdown_timeout, len(self.generations))
        deadline = time.monotonic() + self.shutdown_timeout
        while self.generations and time.monotonic() < deadline and not give_up():
            await asyncio.sleep(0.05)
        if not self.generations:
            return
        logger.warning("shutting down: aborting %d requests still running", len(self.generations))
        error = APIError(503, "the server is shutting down", type="service_unavailable", code="server_shutting_down")
        for gen in list(self.generations):
            gen.abort(error)
        deadline = time.monotonic() + ABORT_GRACE_SECONDS
        while self.generations and time.monotonic() < deadline and not give_up():
            await asyncio.sleep(0.05)

    def check_prompt_chars(self, chars: int, param: str) -> None:
        """413 when a request asks to tokenize more than the prompt cap (checked before tokenizing)."""
        limit = self.max_prompt_chars or PROMPT_CHARS_PER_TOKEN * self.admit().context_length
        if chars > limit:
            raise APIError(413, f"the prompt text has {chars} characters; this server takes at most {limit} "
                                "(--max-prompt-chars)", param=param, code="prompt_too_large")

    async def encode_texts(self, tokenizer, texts: list[str], param: str, add_special_tokens: bool = True
                           ) -> list[list[int]]:
        """Each text's token ids, as a prompt is tokenized at every endpoint: the prompt cap first
        (``param`` names the field in its 413), then the tokenizer on a worker thread (a long prompt
        does not stall the event loop)."""
        self.check_prompt_chars(sum(map(len, texts)), param)
        return await asyncio.to_thread(lambda: [tokenizer.encode(t, add_special_tokens=add_special_tokens)
                                                for t in texts])

    def lora_adapters(self) -> dict[str, str]:
        """The loaded LoRA adapters, name -> path (``Engine.lora_adapters``; none while the engine is not
        running)."""
        engine = self.engine
        return engine.lora_adapters() if engine is not None else {}

    def check_model(self, model: str) -> str | None:
        """The LoRA adapter a request's ``model`` names (``Engine.generate``'s ``lora_name``), None for
        the served model; a 404 for any other name, listing what is served."""
        if model == self.model_name:
            return None
        adapters = self.lora_adapters()
        if model in adapters:
            return model
        served = repr(self.model_name)
        if adapters:
            served += " and the LoRA adapters " + ", ".join(map(repr, sorted(adapters)))
        raise APIError(404, f"the model {model!r} does not exist; this server serves {served}",
                       param="model", code="model_not_found")

    async def check_api_key(self, request: Request) -> None:
        """FastAPI dependency of the /v1, the native (/generate, /flush_cache, ...), /tokenize and /detokenize routes
        (``Authorization: Bearer KEY``); async so that FastAPI runs it on the event loop, not on a
        worker thread."""
        if self.api_key is None:
            return
        if not bearer_key_matches(request.headers.get("authorization"), self.api_key):
            raise APIError(401, API_KEY_MESSAGE,
                           type="authentication_error", code="invalid_api_key",
                           headers={"WWW-Authenticate": "Bearer"})


class _CountRequests:
    """Pure ASGI middleware counting HTTP requests by route, method and status (a BaseHTTPMiddleware
    would break disconnect detection). Every label takes a bounded set of values: ``ROUTES`` or
    "other", ``METHODS`` or "other", a status code."""

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
            method = scope.get("method", "")
            self.metrics.http_requests.labels(route, method if method in METHODS else "other", str(status)).inc()


_REQUEST_ID = REQUEST_ID_HEADER.encode()  # (ASGI header names are bytes)


class _EchoRequestId:
    """Pure ASGI middleware: a request's ``X-Request-Id`` (vLLM's tracing header; a chat's or completion's
    engine request id where the body names none: ``openai_routes.job_rids``) comes back on its answer,
    errors included."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        value = next((v for k, v in scope.get("headers", ()) if k == _REQUEST_ID), None) \
            if scope["type"] == "http" else None
        if value is None:
            await self.app(scope, receive, send)
            return

        async def send_with_id(message: dict) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", ()) if k.lower() != _REQUEST_ID]
                message = {**message, "headers": [*headers, (_REQUEST_ID, value)]}
            await send(message)

        await self.app(scope, receive, send_with_id)


class _LimitBody:
    """Pure ASGI middleware: a request body over ``max_bytes`` (``max_large_bytes`` on ``LARGE_BODY_PATHS``)
    is a 413, answered at once when its Content-Length says so, else as soon as the bytes received pass
    the cap (nothing more is read)."""

    def __init__(self, app: Any, max_bytes: int, max_large_bytes: int):
        self.app, self.max_bytes, self.max_large_bytes = app, max_bytes, max_large_bytes

    @staticmethod
    def _error(cap: int, flag: str) -> APIError:
        return APIError(413, f"the request body is larger than {cap} bytes ({flag})", code="request_too_large")

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        large = scope.get("path") in LARGE_BODY_PATHS
        cap, flag = (self.max_large_bytes, "--max-prefix-bytes") if large else (self.max_bytes, "--max-request-bytes")
        declared = dict(scope.get("headers", ())).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > cap:
            await self._error(cap, flag).response(scope.get("path", ""))(scope, receive, send)
            return
        received = 0

        async def receive_at_most() -> dict:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > cap:  # FastAPI re-raises an HTTPException met reading the body
                    raise StarletteHTTPException(413, self._error(cap, flag).message)
            return message

        await self.app(scope, receive_at_most, send)


def create_app(model_path: str | None = None, *, served_model_name: str | None = None, api_key: str | None = None,
               max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, max_prompt_chars: int | None = None,
               max_prefix_bytes: int = DEFAULT_MAX_PREFIX_BYTES, max_stored_responses: int = DEFAULT_STORED_RESPONSES,
               max_stored_response_bytes: int = DEFAULT_STORED_RESPONSE_BYTES,
               shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT, tool_call_parser: str = AUTO,
               reasoning_parser: str | None = None, log_requests_level: int | None = None,
               allowed_origins: Sequence[str] = ("*",),
               allowed_methods: Sequence[str] = ("*",), allowed_headers: Sequence[str] = ("*",),
               allow_credentials: bool = False, lora_modules: Sequence[LoraModule] = (),
               allowed_media_domains: Sequence[str] = (), media_fetch_timeout: float = DEFAULT_FETCH_TIMEOUT,
               **engine_options: Any) -> FastAPI:
    """A FastAPI app serving one ``Engine(model_path, **engine_options)``, created at start-up.

    ``app.state.server`` is the ``Server`` (``.engine`` once started). ``served_model_name`` is the
    name clients must send as ``model`` (default: the model directory's name, ``hyla-default`` for the
    built-in model). With ``api_key``, /v1/*, the native endpoints (/generate, /flush_cache, ...), /tokenize and /detokenize
    need ``Authorization: Bearer <api_key>`` (the scheme's case does not matter, RFC 7235), /docs
    and /openapi.json are off; /health and /metrics stay open. A body over ``max_request_bytes`` is a 413 (an
    ``/import_prefix`` body: over ``max_prefix_bytes``). ``max_stored_responses`` / ``_bytes``: how many stored
    responses the Responses API keeps, and how much text (``ResponseStore``). ``max_prompt_chars``
    and ``shutdown_timeout``: see ``Server`` (run the app with ``hyla.server.launch.UvicornServer``
    for the graceful shutdown). ``tool_call_parser`` / ``reasoning_parser``: the model family's
    tool-call syntax (``auto``: the one its chat template writes) and think markers
    (``hyla.server.tool_calls``, ``hyla.server.reasoning``). ``log_requests_level``: a log line for each
    request as it ends, at that level (``hyla.server.request_log``; None: none).
    ``allowed_origins`` / ``_methods`` / ``_headers`` / ``allow_credentials``: CORS, as vLLM's flags
    (default: any origin, as vLLM and SGLang; empty ``allowed_origins``: no CORS headers, so browsers
    refuse other origins' pages). ``lora_modules``: LoRA adapters (``LoraModule``) loaded as the engine starts
    (``enable_lora``; ``--lora-modules``); a request's ``model`` may name one (``lora_routes.py``).
    ``allowed_media_domains`` / ``media_fetch_timeout``: the hosts whose image URLs the server fetches (``*``:
    any; none by default) and how long a fetch may take (``media.py``)."""
    server = Server(model_path, served_model_name, api_key, dict(engine_options), max_prompt_chars, shutdown_timeout,
                    lora_modules)
    server.media = MediaFetcher(allowed_media_domains, media_fetch_timeout)
    server.tool_call_parser_choice = tool_call_parser
    if tool_call_parser != AUTO:  # (else the engine's chat template picks it, at start-up)
        server.tool_call_parser = ToolCallParser(tool_call_parser)
    server.reasoning_parser = ReasoningParser(reasoning_parser) if reasoning_parser else None
    server.request_log = RequestLog(log_requests_level) if log_requests_level is not None else None

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await asyncio.to_thread(server.start_engine)
        try:
            yield
        finally:
            await asyncio.to_thread(server.stop_engine)

    docs = {} if api_key is None else {"docs_url": None, "redoc_url": None, "openapi_url": None}  # no open schema
    app = FastAPI(title="hyla", version=_version(), lifespan=lifespan, **docs)
    app.state.server = server
    app.add_middleware(_LimitBody, max_bytes=max_request_bytes, max_large_bytes=max_prefix_bytes)
    app.add_middleware(_CountRequests, metrics=server.metrics)  # counts the 413s too
    app.add_middleware(_EchoRequestId)  # (outermost: on every answer, a 413 included)
    add_cors(app, allowed_origins, allowed_methods, allowed_headers, allow_credentials)
    add_error_handlers(app)

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> JSONResponse:  # most health checks never get here: the front door answers them
        status, body = server.health()
        return JSONResponse(body, status_code=status)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(server.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    auth = [Depends(server.check_api_key)]
    app.include_router(OpenAIRoutes(server).router(), dependencies=auth)
    responses = ResponsesRoutes(server, max_stored_responses, max_stored_response_bytes)
    app.include_router(responses.router(), dependencies=auth)
    app.include_router(ConversationsRoutes(responses).router(), dependencies=auth)
    app.include_router(NativeRoutes(server).router(), dependencies=auth)
    app.include_router(TokenRoutes(server).router(), dependencies=auth)
    app.include_router(LoraRoutes(server).router(), dependencies=auth)
    app.include_router(AnthropicRoutes(server).router())  # (its own API key check: Anthropic's header and errors)
    return app


def _version() -> str:
    from hyla import __version__
    return __version__
