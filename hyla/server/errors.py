"""Errors as OpenAI answers them: ``{"error": {"message", "type", "param", "code"}}`` with a status.

Where each status comes from:

* ``APIError`` raised by the server itself (unknown model 404, bad API key 401, engine not running 503);
* a request body pydantic refuses (``RequestValidationError``) → 400, ``param`` naming the field (a
  rule over several fields, the one that broke it: ``protocol.FieldError``);
* what the engine raises at submission (``engine_error``): ``ValueError`` → 400 (a ``RequestError``
  names its field: ``param``, in the endpoint's words, ``api_param``; one naming ``lora_name``, an
  adapter unloaded since the server checked the request's ``model``: 404), ``EngineOverloadedError`` →
  429 with ``Retry-After``, anything else → 500;
* a request the engine aborted on its own (``abort_error``, by its cause): shut down → 503, its
  grammar → 400, displaced from a full queue by a more urgent request → 429, else 500;
* Starlette's 404 / 405 for unknown paths and methods; any other exception → 500.

``add_error_handlers(app)`` installs the handlers that turn each of these into a response. An
error after a stream started is not a status any more: the stream sends ``body()`` as an event.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from hyla.engine.errors import EngineOverloadedError, RequestError
from hyla.engine.sampling_params import SAMPLING_FIELDS
from hyla.server.error_bodies import anthropic_error_body, is_anthropic_path, openai_error_body
from hyla.server.protocol import FieldError

logger = logging.getLogger("hyla.server")

RETRY_AFTER_SECONDS = 1
UNPARSED_BODY = "There was an error parsing the body"  # FastAPI's 400 for a body json.loads failed on otherwise


class APIError(Exception):
    """An error answered with an OpenAI-style body and ``status`` (plus ``headers``, if any), or with
    Anthropic's on Anthropic's paths (``response(path)``)."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return openai_error_body(self.message, self.type, self.param, self.code)

    def response(self, path: str = "") -> JSONResponse:
        """The answer: OpenAI's body, or Anthropic's on its ``path`` s (``is_anthropic_path``)."""
        if is_anthropic_path(path):
            return self.anthropic_response()
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)

    def anthropic_response(self) -> JSONResponse:
        """The answer in Anthropic's shape, which has no ``param``: the field is named in the message (a body's
        field already is: its path first)."""
        named = not self.param or self.message.startswith(self.param.split(".")[0])
        message = self.message if named else f"{self.param}: {self.message}"
        return JSONResponse(anthropic_error_body(self.status, message), status_code=self.status, headers=self.headers)


class ClientDisconnected(Exception):
    """The client went away before its response was ready (answered 499, which nobody reads)."""


# the OpenAI endpoints' names of the engine's request fields where they differ (the engine's names are
# SGLang's); a chat's prompt is its messages
_OPENAI_PARAMS = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens", "json_schema": "response_format",
                  "regex": "response_format", "ebnf": "response_format", "input_ids": "prompt"}
_API_PARAMS = {"completions": {**_OPENAI_PARAMS, "top_logprobs_num": "logprobs"},
               "chat": {**_OPENAI_PARAMS, "input_ids": "messages", "prompt": "messages", "image_data": "messages",
                        "top_logprobs_num": "top_logprobs"},
               # Anthropic's Messages API: its grammars are a structured output's schema and a forced tool's
               "messages": {"max_new_tokens": "max_tokens", "stop": "stop_sequences", "json_schema": "output_config.format",
                            "ebnf": "tools", "input_ids": "messages", "prompt": "messages", "image_data": "messages"}}


def api_param(param: str | None, endpoint: str) -> str | None:
    """The field an ``endpoint`` (``Server.start_generation``'s names) calls the engine's request field
    ``param``: ``max_new_tokens`` is ``max_tokens`` at ``/v1/completions``, and
    ``sampling_params.max_new_tokens`` at ``/generate``, whose body nests the sampling fields."""
    if param is None:
        return None
    if param == "lora_name":  # (the request's model names its adapter; /generate's lora_path, SGLang's field)
        return "lora_path" if endpoint == "generate" else "model"
    if endpoint in _API_PARAMS:
        return _API_PARAMS[endpoint].get(param, param)
    return f"sampling_params.{param}" if param in SAMPLING_FIELDS else param


def engine_error(exc: BaseException, endpoint: str) -> APIError:
    """What the engine raised (at submission or mid-stream) as an HTTP error; a ``RequestError``'s
    field in ``endpoint``'s words."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, EngineOverloadedError):
        return _overloaded(f"the server is overloaded: {exc}")
    if isinstance(exc, RequestError) and exc.param == "lora_name":  # (unloaded after the request was checked)
        return APIError(404, str(exc), param=api_param(exc.param, endpoint), code="model_not_found")
    if isinstance(exc, RequestError):
        return APIError(400, str(exc), param=api_param(exc.param, endpoint))
    if isinstance(exc, ValueError):
        return APIError(400, str(exc))
    logger.error("request failed", exc_info=exc)
    return APIError(500, f"internal error: {exc}", type="internal_error", code="internal_error")


def _overloaded(message: str) -> APIError:
    return APIError(429, message, type="rate_limit_error", code="rate_limit_exceeded",
                    headers={"Retry-After": str(RETRY_AFTER_SECONDS)})


def abort_error(reason: dict[str, Any]) -> APIError:
    """The engine aborted a request the client did not abort; ``reason`` is the engine's
    ``finish_reason``, whose ``cause`` (``hyla.engine.request.ABORT_CAUSES``) decides the status."""
    message = str(reason.get("message", "aborted"))
    cause = reason.get("cause")
    if cause == "shutdown":
        return APIError(503, message, type="service_unavailable", code="engine_shutdown")
    if cause == "overloaded":  # displaced from the full queue by a more urgent request: as a 429 at submission
        return _overloaded(message)
    if cause == "grammar":  # the request's grammar could not follow its output (a parser limit met deep
        # in it, which no compile-time probe finds): the grammar's fault, not the server's
        return APIError(400, message, code="grammar_error")
    return APIError(500, message, type="internal_error", code="request_aborted")


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none", "bytes"})


def _union_member(part: object) -> bool:
    """Whether a part of pydantic's error location names the member of a union that was tried
    (``str``, ``literal['none','auto']``, ``function-after[...]``, a model's class name), not a
    field: the client's ``param`` is the field (``tool_choice``, ``input.0.content``)."""
    if not isinstance(part, str):
        return False
    return part in _TYPE_TAGS or not part.replace("_", "a").isalnum() or part[:1].isupper()


def validation_error(exc: RequestValidationError) -> APIError:
    """pydantic's first complaint about a request body as a 400 naming the field."""
    errors = exc.errors()
    if not errors:
        return APIError(400, "invalid request body")
    first = errors[0]
    loc = [str(x) for x in first.get("loc", ()) if x != "body" and not _union_member(x)]
    param = ".".join(loc) or None
    if first.get("type") == "json_invalid":
        ctx = first.get("ctx", {}).get("error", "")
        return APIError(400, f"the request body is not valid JSON: {ctx}".rstrip(": "), code="invalid_json")
    if not loc and first.get("type") in ("model_attributes_type", "dict_type", "model_type", "missing"):
        return APIError(400, "the request body must be a JSON object (Content-Type: application/json)",
                        code="invalid_json")
    msg = first.get("msg", "invalid value").removeprefix("Value error, ")  # (pydantic's, before a validator's own)
    more = f" (and {len(errors) - 1} more error(s))" if len(errors) > 1 else ""
    message = f"{param}: {msg}{more}" if param else f"{msg}{more}"
    cause = (first.get("ctx") or {}).get("error")
    if isinstance(cause, FieldError):  # a whole object's rule that one of its fields broke: that field
        param = ".".join([*loc, *(p for p in cause.param.split(".") if not _union_member(p))])
    return APIError(400, message, param=param)


def add_error_handlers(app: FastAPI) -> None:
    """Answer every error above with its OpenAI-style body (Anthropic's on Anthropic's paths)."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response(request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc).response(request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        code = "request_too_large" if exc.status_code == 413 else None  # a body over --max-request-bytes
        message = str(exc.detail)
        if exc.status_code == 400 and message == UNPARSED_BODY:  # FastAPI's, for what json.loads did not raise
            message, code = ("the request body could not be read as JSON: not UTF-8, compressed (no Content-Encoding "
                             "is supported), nested too deep, or an integer of more than 4,300 digits"), "invalid_json"
        return APIError(exc.status_code, message, type=kind, code=code, headers=exc.headers).response(request.url.path)

    @app.exception_handler(ClientDisconnected)
    async def _gone(request: Request, exc: ClientDisconnected) -> Response:
        return Response(status_code=499)  # nginx's "client closed request"; nobody reads it

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return APIError(500, f"internal server error: {type(exc).__name__}: {exc}", type="internal_error",
                        code="internal_error").response(request.url.path)
