"""``hyla route``: the router in front of data-parallel workers (``hyla serve`` on each GPU)."""

from __future__ import annotations

import argparse
import logging
import sys

from hyla.router.policy import DEFAULT_LOCAL_PREFILL_TOKENS, DEFAULT_POLICY, POLICIES
from hyla.server.cors import add_cors_arguments, cors_options
from hyla.server.tls import add_tls_arguments, tls_error, tls_options

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 30100
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--worker-urls", nargs="+", required=True, metavar="URL",
                        help="The workers' base URLs (each a `hyla serve` of the same model), e.g. http://gpu0:30000.")
    parser.add_argument("--prefill-urls", nargs="+", default=[], metavar="URL",
                        help="Prefill/decode disaggregation: these workers (hyla serve, the same model and cache "
                             "flags) compute prompts, and the --worker-urls decode; each prompt's KV and state move "
                             "to the decode worker (docs/server.md, 'Prefill/decode disaggregation'). Default: none, "
                             "every worker does both.")
    parser.add_argument("--local-prefill-tokens", type=int, default=DEFAULT_LOCAL_PREFILL_TOKENS,
                        help="With --prefill-urls: a decode worker serves a request whose prompt has at most this many "
                             "tokens uncached in its cache (a short prompt, a conversation's next turn) itself; "
                             "longer ones are computed by a prefill worker and moved (default 512; 0: every "
                             "request moves).")
    parser.add_argument("--host", default=DEFAULT_HOST, help=f"Address to listen on (default {DEFAULT_HOST}).")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"Port to listen on (default {DEFAULT_PORT}).")
    parser.add_argument("--policy", choices=POLICIES, default=DEFAULT_POLICY,
                        help="How a worker is chosen (default cache_aware: where the prompt's longest prefix went).")
    parser.add_argument("--cache-threshold", type=float, default=0.3,
                        help="cache_aware: the share of the prompt a worker's prefix must cover to win over the "
                             "least loaded worker (default 0.3).")
    parser.add_argument("--balance-abs-threshold", type=int, default=64,
                        help="cache_aware: the load is unbalanced (the least loaded worker is chosen) when the most "
                             "loaded has this many requests in flight more than the least (default 64) ...")
    parser.add_argument("--balance-rel-threshold", type=float, default=1.5,
                        help="... and more than this many times the least's (default 1.5).")
    parser.add_argument("--max-table-blocks", type=int, default=1 << 18,
                        help="cache_aware: prompt blocks remembered per worker, least recently used dropped "
                             "(default 262144: 16 Mi characters of 64).")
    parser.add_argument("--max-request-bytes", type=int, default=16 << 20,
                        help="A larger request body is refused with a 413 (default 16 MiB, as hyla serve's).")
    parser.add_argument("--api-key", default=None,
                        help="Clients must send 'Authorization: Bearer KEY', or Anthropic's 'x-api-key: KEY' (every "
                             "path but /health and /metrics); the header goes on to the workers, so start them with "
                             "the same key.")
    parser.add_argument("--health-interval", type=float, default=5.0,
                        help="Seconds between health checks of the workers (default 5).")
    parser.add_argument("--read-timeout", type=float, default=None, metavar="SECONDS",
                        help="A worker that sends nothing for this long on a request (before its answer, or between "
                             "two chunks of a stream: a hung worker) has failed it: marked unhealthy, the request "
                             "sent to another worker where it had not answered yet, a stream ended with an error "
                             "event. Longer than any queue wait or non-streamed generation you serve (default: no "
                             "limit).")
    add_tls_arguments(parser)
    add_cors_arguments(parser)
    parser.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))


def run(args: argparse.Namespace) -> int:
    """Serve the router; exit status 0 when it stops (SIGTERM, Ctrl-C), 2 for a bad option or an address it
    cannot listen on (both checked before it starts), 3 when it fails to start (uvicorn's status)."""
    import uvicorn

    from hyla.router.app import create_router_app
    from hyla.server.cli import bind_socket
    from hyla.server.launch import sigterm_as_interrupt

    if not 0 < args.port < 65536:
        print(f"hyla route: error: --port must be in 1..65535, got {args.port}", file=sys.stderr)
        return 2
    tls = tls_error(args)
    if tls is not None:
        print(f"hyla route: error: {tls}", file=sys.stderr)
        return 2
    if args.local_prefill_tokens != DEFAULT_LOCAL_PREFILL_TOKENS and not args.prefill_urls:
        print("hyla route: error: --local-prefill-tokens set without --prefill-urls, which would ignore it",
              file=sys.stderr)
        return 2
    try:
        app = create_router_app(args.worker_urls, args.policy, cache_threshold=args.cache_threshold,
                                balance_abs=args.balance_abs_threshold, balance_rel=args.balance_rel_threshold,
                                max_blocks=args.max_table_blocks, health_interval=args.health_interval,
                                max_request_bytes=args.max_request_bytes, api_key=args.api_key,
                                prefill_urls=args.prefill_urls, local_prefill_tokens=args.local_prefill_tokens,
                                read_timeout=args.read_timeout, **cors_options(args))
    except ValueError as exc:
        print(f"hyla route: error: {exc}", file=sys.stderr)
        return 2
    # a port in use (or an address not this machine's): this message and status 2 before uvicorn starts (its own
    # check is a log line and status 3); uvicorn binds the port again as it starts (uvicorn.run takes no socket)
    try:
        bind_socket(args.host, args.port).close()
    except ValueError as exc:
        print(f"hyla route: error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level.upper(), format=LOG_FORMAT)
    with sigterm_as_interrupt():  # (exit status 0 on SIGTERM, not 143)
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, log_config=None,
                    timeout_graceful_shutdown=5, **tls_options(args))
    return 0
