"""The error bodies clients read, OpenAI's and Anthropic's, for the server's and the router's answers.

Standard library only: the router, which imports no torch, answers with them too (``hyla.router.app``);
the server's error handling is ``errors.py``.
"""

from __future__ import annotations

from typing import Any

# Anthropic's Messages API (``anthropic_routes``): its errors have Anthropic's shape, whoever answers them
ANTHROPIC_PATH = "/v1/messages"
# an HTTP status -> Anthropic's error type
ANTHROPIC_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                         404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                         503: "overloaded_error"}


def openai_error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def anthropic_error_body(status: int, message: str) -> dict[str, Any]:
    """Anthropic's error body for ``status`` (another 4xx, such as a 405: ``invalid_request_error``)."""
    kind = ANTHROPIC_ERROR_TYPES.get(status, "invalid_request_error" if 400 <= status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def is_anthropic_path(path: str) -> bool:
    return path == ANTHROPIC_PATH or path.startswith(ANTHROPIC_PATH + "/")
