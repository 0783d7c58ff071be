"""``hyla serve``: start the OpenAI-compatible HTTP server.

    hyla serve [--model PATH] [--host 127.0.0.1] [--port 30000] [--api-key KEY] [engine options]

Every engine option is a flag generated from ``EngineArgs.field_help()``: the field
``max_total_tokens`` is ``--max-total-tokens``, a bool field ``enable_prefix_cache`` is
``--enable-prefix-cache`` / ``--no-enable-prefix-cache``. So the CLI and ``Engine(**options)``
cannot drift apart.
"""

from __future__ import annotations

import argparse
import json
import logging
import socket
import sys
import types
import typing
from pathlib import Path
from typing import Any, Callable

from hyla.engine.args import EngineArgs
from hyla.server.cors import add_cors_arguments, cors_options
from hyla.server.lora_routes import parse_lora_module
from hyla.server.protocol import (DEFAULT_FETCH_TIMEOUT, DEFAULT_MAX_PREFIX_BYTES, DEFAULT_MAX_REQUEST_BYTES,
                                  DEFAULT_SHUTDOWN_TIMEOUT,
                                  DEFAULT_STORED_RESPONSE_BYTES, DEFAULT_STORED_RESPONSES, PROMPT_CHARS_PER_TOKEN)
from hyla.router.policy import DEFAULT_LOCAL_PREFILL_TOKENS, DEFAULT_POLICY, POLICIES
from hyla.server.reasoning import REASONING_PARSERS
from hyla.server.request_log import DEFAULT_LOG_REQUESTS_LEVEL, LOG_REQUESTS_LEVELS, PARTIAL_CHARS
from hyla.server.tls import add_tls_arguments, tls_error, tls_options
from hyla.server.tool_calls import AUTO, TOOL_CALL_PARSERS

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 30000
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# vLLM's names of engine flags (hyla's are SGLang's), where the option means the same: a vLLM command line runs
FLAG_ALIASES = {"tokenizer_path": ("--tokenizer",), "context_length": ("--max-model-len",),
                "max_running_requests": ("--max-num-seqs",), "disable_cuda_graph": ("--enforce-eager",)}


def _flag_type(annotation: Any) -> Callable[[str], Any]:
    """``int``, ``int | None`` → int; ``str | None`` → str; bool stays bool; ``dict | None`` → a JSON object."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) != 1:
            raise TypeError(f"cannot make a flag for {annotation}")
        annotation = args[0]
    return json_object if annotation is dict else annotation


def json_object(text: str) -> dict:
    """A flag's JSON object (vLLM's ``--limit-mm-per-prompt '{"image": 4}'``)."""
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object such as '{{\"image\": 4}}', got {text!r}")
    return value


def engine_flags() -> dict[str, tuple[str, type, Any, str]]:
    """field name → (flag, type, default, help) for every engine option except ``model_path``."""
    hints = typing.get_type_hints(EngineArgs)
    flags = {}
    for name, (default, help_text) in EngineArgs.field_help().items():
        if name == "model_path":
            continue
        flags[name] = ("--" + name.replace("_", "-"), _flag_type(hints[name]), default, help_text)
    return flags


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", "--model-path", dest="model_path", default=None, metavar="PATH",
                        help=EngineArgs.field_help()["model_path"][1])
    parser.add_argument("--host", default=DEFAULT_HOST,
                        help=f"Address to bind (default {DEFAULT_HOST}: this machine only; 0.0.0.0 for every interface).")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"Port to listen on (default {DEFAULT_PORT}).")
    parser.add_argument("--dp-size", type=int, default=1, metavar="N",
                        help="Data parallelism: N workers (each a hyla serve with these flags, on a GPU of its own "
                             "with --device cuda) behind a cache-aware router on --host/--port (hyla route; "
                             "docs/server.md, 'Data parallelism'). Default 1: one engine, no router.")
    parser.add_argument("--prefill-workers", type=int, default=0, metavar="M",
                        help="Prefill/decode disaggregation: M more workers that only compute prompts, the --dp-size "
                             "ones decoding, behind the router (hyla route --prefill-urls; docs/server.md, "
                             "'Prefill/decode disaggregation'). Default 0: every worker does both.")
    parser.add_argument("--local-prefill-tokens", type=int, default=DEFAULT_LOCAL_PREFILL_TOKENS, metavar="N",
                        help="With --prefill-workers: a decode worker computes a prompt with at most N tokens "
                             "uncached in its cache itself (a short prompt, a conversation's next turn); longer ones "
                             "move from a prefill worker (hyla route --local-prefill-tokens; default "
                             f"{DEFAULT_LOCAL_PREFILL_TOKENS}, 0: all move).")
    parser.add_argument("--router-policy", choices=POLICIES, default=DEFAULT_POLICY,
                        help="With --dp-size or --prefill-workers: how the router chooses a worker (hyla route "
                             f"--policy; default {DEFAULT_POLICY}).")
    parser.add_argument("--router-read-timeout", type=float, default=None, metavar="SECONDS",
                        help="With --dp-size or --prefill-workers: a worker silent this long on a request has failed "
                             "it (hyla route --read-timeout; default: no limit).")
    parser.add_argument("--api-key", default=None,
                        help="Require 'Authorization: Bearer KEY' on /v1/*, SGLang's native endpoints (/generate, "
                             "/flush_cache, /abort_request, /update_weights_from_disk, /get_*, /health_generate, /export_prefix, "
                             "/import_prefix), "
                             "/tokenize and /detokenize; /health and /metrics stay open (default: no key).")
    add_tls_arguments(parser)
    add_cors_arguments(parser)
    parser.add_argument("--served-model-name", default=None,
                        help="The model name clients send, not empty (default: the model directory's name; "
                             "'hyla-default' for the built-in model).")
    parser.add_argument("--lora-modules", nargs="+", type=parse_lora_module, default=None,
                        metavar="NAME=PATH",
                        help="LoRA adapters loaded at start-up (needs --enable-lora; vLLM's flag): each NAME=PATH (a "
                             "PEFT adapter directory: adapter_config.json, adapter_model.safetensors), or vLLM's JSON "
                             "'{\"name\": ..., \"path\": ..., \"base_model_name\": ...}'. A request's model names "
                             "one; /v1/load_lora_adapter and /v1/unload_lora_adapter change them while serving.")
    parser.add_argument("--allowed-media-domains", nargs="*", default=[], metavar="DOMAIN",
                        help="Hosts whose image URLs (image_url parts) the server fetches, their subdomains too; '*': "
                             "any host. Default: none (images come as data URLs). A fetch runs on the server's network: "
                             "list only hosts its clients may have it reach.")
    parser.add_argument("--media-fetch-timeout", type=float, default=DEFAULT_FETCH_TIMEOUT, metavar="SECONDS",
                        help=f"Seconds an image URL's fetch may take, > 0 (default {DEFAULT_FETCH_TIMEOUT:g}).")
    parser.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES, metavar="BYTES",
                        help=f"Refuse a request body larger than this with 413 (default {DEFAULT_MAX_REQUEST_BYTES}).")
    parser.add_argument("--max-prefix-bytes", type=int, default=DEFAULT_MAX_PREFIX_BYTES, metavar="BYTES",
                        help="Refuse an /import_prefix body (a cached prefix's KV and state) larger than this with "
                             f"413 (default {DEFAULT_MAX_PREFIX_BYTES}).")
    parser.add_argument("--max-stored-responses", type=int, default=DEFAULT_STORED_RESPONSES, metavar="N",
                        help="Responses (/v1/responses with store) kept for GET and previous_response_id, the least "
                             f"recently used dropped first (default {DEFAULT_STORED_RESPONSES}; 0: none kept).")
    parser.add_argument("--max-stored-response-bytes", type=int, default=DEFAULT_STORED_RESPONSE_BYTES,
                        metavar="BYTES", help="The text the stored responses may hold, each counted with its whole "
                                              f"conversation (default {DEFAULT_STORED_RESPONSE_BYTES}).")
    parser.add_argument("--max-prompt-chars", type=int, default=None, metavar="CHARS",
                        help="Refuse with 413, before tokenizing, a request whose prompt text (all prompts or "
                             f"messages) is longer (default: {PROMPT_CHARS_PER_TOKEN} x the context length).")
    parser.add_argument("--shutdown-timeout", type=float, default=DEFAULT_SHUTDOWN_TIMEOUT, metavar="SECONDS",
                        help="On SIGTERM or Ctrl-C: refuse new requests (503) at once, give running ones this long "
                             f"to finish, then abort them (default {DEFAULT_SHUTDOWN_TIMEOUT:g}).")
    parser.add_argument("--tool-call-parser", default=AUTO, choices=(AUTO, *TOOL_CALL_PARSERS),
                        help="The model family's tool-call syntax parsed into tool_calls: auto (default: the syntax "
                             "the model's chat template writes, else qwen), qwen (also hermes, qwen25: Qwen2.5, Qwen3, "
                             "Qwen3-Next, Granite 4.0-H, Falcon-H1), nemotron_json (NemotronH), qwen3_coder (the XML "
                             "syntax of Qwen3.5, Qwen3-Coder and Nemotron-3), jamba, minimax (MiniMax-Text-01, -M1), "
                             "kimi_k2 (Kimi-Linear) or lfm2.")
    parser.add_argument("--reasoning-parser", default=None, choices=list(REASONING_PARSERS),
                        help="Separate <think>...</think> into reasoning_content (SGLang's and vLLM's names; default "
                             "off): qwen3 or nano_v3 (the answer thinks where it or the prompt opens the block), "
                             "deepseek-r1, deepseek_r1 or qwen3-thinking (it thinks from its start, unless the prompt "
                             "closed the block).")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                        help="Log level of hyla and uvicorn (default info: start-up summary and per-step lines).")
    parser.add_argument("--log-requests", action="store_true",
                        help="A log line for each request as it ends (logger hyla.server.requests; SGLang's flag; "
                             "default off: prompts and outputs are the users' data).")
    parser.add_argument("--log-requests-level", type=int, default=DEFAULT_LOG_REQUESTS_LEVEL,
                        choices=LOG_REQUESTS_LEVELS,
                        help="With --log-requests, how much (SGLang's levels): 0 its id, endpoint, finish reason, "
                             "token counts and times; 1 and its sampling parameters; 2 and the first "
                             f"{PARTIAL_CHARS} characters of its prompt and output (default); 3 all of them.")
    group = parser.add_argument_group("engine options", "The fields of hyla.engine.args.EngineArgs.")
    for name, (flag, kind, default, help_text) in engine_flags().items():
        flags = (flag, *FLAG_ALIASES.get(name, ()))
        if kind is bool:
            group.add_argument(*flags, dest=name, action=argparse.BooleanOptionalAction, default=default,
                               help=f"{help_text} (default: {'on' if default else 'off'})")
        else:
            shown = "" if default is None else f" (default: {default})"  # None: the help says what happens
            group.add_argument(*flags, dest=name, type=kind, default=default, metavar="JSON" if kind is json_object else kind.__name__.upper(),
                               help=help_text + shown)
    group.add_argument("--skip-server-warmup", dest="warmup", action="store_const", const="off",
                       help="--warmup off (SGLang's flag).")  # after --warmup: its default is the dest's
    group.add_argument("--trust-remote-code", action="store_true",
                       help="Taken, and changes nothing (vLLM and SGLang need it for some of the hybrid models): hyla "
                            "runs no code from a checkpoint, each architecture is its own.")


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The ``Engine(**options)`` keyword arguments given on the command line."""
    return {name: getattr(args, name) for name in engine_flags()}


def run(args: argparse.Namespace) -> int:
    options = engine_options(args)
    try:
        EngineArgs(model_path=args.model_path, **options)  # fail fast, before uvicorn starts
    except ValueError as exc:
        print(f"hyla serve: error: {exc}", file=sys.stderr)
        return 2
    if args.model_path is not None and not (Path(args.model_path) / "config.json").is_file():
        print(f"hyla serve: error: no config.json in model directory {args.model_path!r}", file=sys.stderr)
        return 2
    lora_error = _lora_modules_error(args.lora_modules or [], options, args.served_model_name)
    if lora_error is not None:
        print(f"hyla serve: error: {lora_error}", file=sys.stderr)
        return 2
    draft = options.get("speculative_draft_model_path")
    if draft is not None and not (Path(draft) / "config.json").is_file():
        print(f"hyla serve: error: no config.json in draft model directory {draft!r}", file=sys.stderr)
        return 2
    if not 0 < args.port < 65536:
        print(f"hyla serve: error: --port must be in 1..65535, got {args.port}", file=sys.stderr)
        return 2
    for flag, value in (("--max-request-bytes", args.max_request_bytes), ("--max-prompt-chars", args.max_prompt_chars),
                        ("--max-prefix-bytes", args.max_prefix_bytes)):
        if value is not None and value < 1:
            print(f"hyla serve: error: {flag} must be at least 1, got {value}", file=sys.stderr)
            return 2
    for flag, value in (("--max-stored-responses", args.max_stored_responses),
                        ("--max-stored-response-bytes", args.max_stored_response_bytes)):
        if value < 0:
            print(f"hyla serve: error: {flag} must be at least 0, got {value}", file=sys.stderr)
            return 2
    if not args.shutdown_timeout >= 0:
        print(f"hyla serve: error: --shutdown-timeout must be >= 0, got {args.shutdown_timeout}", file=sys.stderr)
        return 2
    if not 0 < args.media_fetch_timeout < float("inf"):  # (also NaN)
        print(f"hyla serve: error: --media-fetch-timeout must be a finite number of seconds > 0, got "
              f"{args.media_fetch_timeout}", file=sys.stderr)
        return 2
    if args.served_model_name == "":  # (the rule of create_app; checked here before any worker starts)
        print("hyla serve: error: --served-model-name must not be empty (leave it out for the model directory's "
              "name)", file=sys.stderr)
        return 2

    if args.dp_size < 1:
        print(f"hyla serve: error: --dp-size must be at least 1, got {args.dp_size}", file=sys.stderr)
        return 2
    if args.prefill_workers < 0:
        print(f"hyla serve: error: --prefill-workers must be at least 0, got {args.prefill_workers}", file=sys.stderr)
        return 2
    if args.router_read_timeout is not None and not 0 < args.router_read_timeout < float("inf"):
        print(f"hyla serve: error: --router-read-timeout must be > 0 seconds, got {args.router_read_timeout}",
              file=sys.stderr)
        return 2
    if args.local_prefill_tokens < 0:
        print(f"hyla serve: error: --local-prefill-tokens must be at least 0, got {args.local_prefill_tokens}",
              file=sys.stderr)
        return 2
    ignored = _ignored_flags_error(args)
    if ignored is not None:
        print(f"hyla serve: error: {ignored}", file=sys.stderr)
        return 2
    tls = tls_error(args)
    if tls is not None:
        print(f"hyla serve: error: {tls}", file=sys.stderr)
        return 2
    if args.dp_size > 1 or args.prefill_workers:  # the workers and the router (hyla/router/launch.py), its port checked first
        try:
            bind_socket(args.host, args.port).close()
        except ValueError as exc:
            print(f"hyla serve: error: {exc}", file=sys.stderr)
            return 2
        from hyla.router.launch import serve_data_parallel

        logging.basicConfig(level=args.log_level.upper(), format=LOG_FORMAT)
        return serve_data_parallel(args, args.given_argv)

    try:  # before anything is loaded: a port in use is an error now, not after minutes of loading
        sock = bind_socket(args.host, args.port)
    except ValueError as exc:
        print(f"hyla serve: error: {exc}", file=sys.stderr)
        return 2

    import uvicorn

    from hyla.server.app import create_app
    from hyla.server.launch import UvicornServer, sigterm_as_interrupt

    logging.basicConfig(level=args.log_level.upper(), format=LOG_FORMAT)
    try:  # (the flags were checked above; the app's own checks are the last word, its error no traceback)
        app = create_app(args.model_path, served_model_name=args.served_model_name, api_key=args.api_key,
                         max_request_bytes=args.max_request_bytes, max_prompt_chars=args.max_prompt_chars,
                         max_prefix_bytes=args.max_prefix_bytes, max_stored_responses=args.max_stored_responses,
                         max_stored_response_bytes=args.max_stored_response_bytes,
                         shutdown_timeout=args.shutdown_timeout, tool_call_parser=args.tool_call_parser,
                         reasoning_parser=args.reasoning_parser,
                         log_requests_level=args.log_requests_level if args.log_requests else None,
                         lora_modules=args.lora_modules or (), allowed_media_domains=args.allowed_media_domains,
                         media_fetch_timeout=args.media_fetch_timeout, **cors_options(args), **options)
    except ValueError as exc:
        sock.close()
        print(f"hyla serve: error: {exc}", file=sys.stderr)
        return 2
    # log_config=None: uvicorn's loggers propagate to the root handler, one format for every line
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level, log_config=None,
                            workers=1, timeout_graceful_shutdown=5, **tls_options(args))
    server = UvicornServer(config, gc_freeze=True)  # this process serves one app for its life
    try:
        with sigterm_as_interrupt():  # (exit status 0 on SIGTERM, not 143)
            server.run(sockets=[sock])
    finally:
        sock.close()
    return 0 if server.started else 1


def _lora_modules_error(modules: list, options: dict[str, Any], served_model_name: str | None) -> str | None:
    """What is wrong with ``--lora-modules`` before anything loads (the adapters themselves the engine checks
    at start-up), or None."""
    if not modules:
        return None
    if not options.get("enable_lora"):
        return "--lora-modules needs --enable-lora"
    names = [m.name for m in modules]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        return f"--lora-modules names {', '.join(map(repr, twice))} more than once"
    if served_model_name is not None and served_model_name in names:
        return f"--lora-modules: the adapter name {served_model_name!r} is the --served-model-name"
    room = options.get("max_cpu_loras") or options["max_loras"]
    if len(modules) > room:
        return (f"--lora-modules gives {len(modules)} adapters; "
                f"{'--max-cpu-loras' if options.get('max_cpu_loras') else '--max-loras'} holds {room}")
    for m in modules:
        if not (Path(m.path) / "adapter_config.json").is_file():
            return f"--lora-modules {m.name}={m.path}: no adapter_config.json in that directory (a PEFT LoRA adapter)"
    return None


def _ignored_flags_error(args: argparse.Namespace) -> str | None:
    """The engine's rule (``EngineArgs``) for the server's own flags: a flag of a feature that is off would be
    ignored, more likely a mistake than a wish, so it is refused. The router's flags (``--router-policy``,
    ``--router-read-timeout``) need a router (``--dp-size`` above 1 or ``--prefill-workers``),
    ``--local-prefill-tokens`` prefill workers, ``--log-requests-level`` ``--log-requests``. A flag at its
    default counts as not given. The message, or None."""
    router = args.dp_size > 1 or args.prefill_workers > 0
    for flag, given, condition, on in (
            ("--router-policy", args.router_policy != DEFAULT_POLICY,
             "without --dp-size above 1 or --prefill-workers (no router)", router),
            ("--router-read-timeout", args.router_read_timeout is not None,
             "without --dp-size above 1 or --prefill-workers (no router)", router),
            ("--local-prefill-tokens", args.local_prefill_tokens != DEFAULT_LOCAL_PREFILL_TOKENS,
             "without --prefill-workers", args.prefill_workers > 0),
            ("--log-requests-level", args.log_requests_level != DEFAULT_LOG_REQUESTS_LEVEL,
             "without --log-requests", args.log_requests)):
        if given and not on:
            return f"{flag} set {condition}, which would ignore it"
    return None


def bind_socket(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port``, for uvicorn to listen on once the app has started (``hyla serve``; the
    router of ``hyla route`` and ``--dp-size`` closes it at once: a check, uvicorn.run binding the port itself).
    Bound first, so that a port in use (or an address not this machine's) is an error before anything loads: a
    ``ValueError`` saying which and why."""
    sock = None
    try:
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as exc:
        if sock is not None:
            sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sock
