"""CORS for the server and the router: the flags (vLLM's), and the middleware they set. Torch-free: the router
(``hyla route``) takes them from here."""

from __future__ import annotations

import argparse
import json
from typing import Any, Sequence

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

ANY = ("*",)


def add_cors_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--allowed-origins", type=_json_strings, default=list(ANY), metavar="JSON",
                        help='CORS: the origins whose browser pages may call the API, a JSON list (vLLM\'s flag; '
                             'default ["*"]: any, as vLLM and SGLang; [] sends no CORS headers, so browsers refuse '
                             'every other origin).')
    parser.add_argument("--allowed-methods", type=_json_strings, default=list(ANY), metavar="JSON",
                        help='CORS: the methods allowed, a JSON list (default ["*"]).')
    parser.add_argument("--allowed-headers", type=_json_strings, default=list(ANY), metavar="JSON",
                        help='CORS: the request headers allowed, a JSON list (default ["*"]).')
    parser.add_argument("--allow-credentials", action="store_true",
                        help="CORS: allow credentials (cookies, HTTP authentication) in cross-origin requests.")


def cors_options(args: argparse.Namespace) -> dict[str, Any]:
    """The ``add_cors`` keyword arguments of the flags above."""
    return dict(allowed_origins=args.allowed_origins, allowed_methods=args.allowed_methods,
                allowed_headers=args.allowed_headers, allow_credentials=args.allow_credentials)


def add_cors(app: FastAPI, allowed_origins: Sequence[str] = ANY, allowed_methods: Sequence[str] = ANY,
             allowed_headers: Sequence[str] = ANY, allow_credentials: bool = False) -> None:
    """CORS headers on every answer of ``app`` (added last: outermost, so a browser reads every answer, errors
    too, and preflights need no API key); none with no ``allowed_origins``."""
    if allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=list(allowed_methods),
                           allow_headers=list(allowed_headers), allow_credentials=allow_credentials)


def _json_strings(text: str) -> list[str]:
    """A flag's JSON list of strings (``'["https://a.example"]'``)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings, got {text}")
    return value
