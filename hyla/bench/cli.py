"""`hyla bench`: benchmark a running hyla (or any OpenAI-compatible) server.

    hyla bench --base-url http://127.0.0.1:30000 --dataset sharegpt --num-prompts 50 --request-rate 2
    hyla bench --dataset random --num-prompts 200 --random-input-len 1024 --random-output-len 128 \\
               --shared-prefix-ratio 0.5 --num-shared-prefixes 4 --max-concurrency 16 --output-file out.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys

import httpx

from hyla.bench.backends import BACKENDS
from hyla.bench.datasets import random_sessions, sharegpt_sessions
from hyla.bench.metrics import format_report, summarize
from hyla.bench.runner import assign_priorities, run_benchmark
from hyla.cli import check_output_path

INTERRUPTED = 130  # the exit status of a command stopped by Ctrl-C (128 + SIGINT), as a shell reports it


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Every option says what it does and its default (``hyla bench --help``)."""
    server = parser.add_argument_group("server")
    server.add_argument("--base-url", default="http://127.0.0.1:30000", metavar="URL",
                        help="Root URL of the server under test (default: %(default)s).")
    server.add_argument("--backend", choices=BACKENDS, default="openai",
                        help="Which API to drive: openai = /v1/completions, openai-chat = /v1/chat/completions, "
                             "hyla = the native /generate (default: %(default)s).")
    server.add_argument("--api-key", default=None, metavar="KEY",
                        help="The server's API key (hyla serve --api-key), sent as 'Authorization: Bearer KEY' "
                             "(default: the OPENAI_API_KEY environment variable, if set; never written to "
                             "--output-file).")
    server.add_argument("--model", default=None,
                        help="Model name sent in OpenAI requests (default: the first one the server's /v1/models "
                             "lists).")
    server.add_argument("--timeout", type=float, default=600.0, metavar="SECONDS",
                        help="Limit on each whole request, from its send to the end of its stream; a request past "
                             "it counts as failed ('timed out after ...'); must be positive, inf for no limit "
                             "(default: %(default)s).")
    server.add_argument("--flush-cache", action="store_true",
                        help="POST /flush_cache before the run (hyla's and SGLang's servers), so that it starts "
                             "from an empty prefix cache: a second run of a workload would otherwise hit the "
                             "first run's prefixes (default: off).")

    data = parser.add_argument_group("workload")
    data.add_argument("--dataset", choices=("sharegpt", "random"), default="sharegpt",
                      help="sharegpt = ShareGPT conversations as multi-turn chat sessions; random = one-turn "
                           "prompts of random words (default: %(default)s).")
    data.add_argument("--num-prompts", type=int, default=100, metavar="N",
                      help="Sessions (sharegpt) or requests (random) to send (default: %(default)s).")
    data.add_argument("--sharegpt-min-turns", type=int, default=1, metavar="N",
                      help="sharegpt: only conversations with at least this many rounds (default: %(default)s).")
    data.add_argument("--sharegpt-max-turns", type=int, default=None, metavar="N",
                      help="sharegpt: send at most this many turns per session (default: every turn).")
    data.add_argument("--sharegpt-output-len", type=int, default=None, metavar="TOKENS",
                      help="sharegpt: output tokens asked per turn, >= 1 (default: the recorded reply's word count).")
    data.add_argument("--random-input-len", type=int, default=1024, metavar="WORDS",
                      help="random: prompt length in words, about a token each (default: %(default)s).")
    data.add_argument("--random-output-len", type=int, default=128, metavar="TOKENS",
                      help="random: output tokens asked per request (default: %(default)s).")
    data.add_argument("--random-range-ratio", type=float, default=1.0, metavar="R",
                      help="random: draw input and output lengths uniformly from [R x len, len] "
                           "(default: %(default)s, fixed lengths).")
    data.add_argument("--shared-prefix-ratio", type=float, default=0.0, metavar="R",
                      help="random: fraction of each prompt that is a shared prefix (default: %(default)s, none).")
    data.add_argument("--num-shared-prefixes", type=int, default=1, metavar="N",
                      help="random: distinct shared prefixes; request i gets prefix i mod N (default: %(default)s).")

    load = parser.add_argument_group("load")
    load.add_argument("--request-rate", type=float, default=math.inf, metavar="PER_SECOND",
                      help="Poisson arrivals per second of sessions (sharegpt) or requests (random) "
                           "(default: %(default)s, all at once).")
    load.add_argument("--max-concurrency", type=int, default=None, metavar="N",
                      help="At most this many requests in flight (default: no cap).")
    load.add_argument("--priority-share", type=float, default=0.0, metavar="F",
                      help="Send --priority with every request of this share of the sessions (random, seeded); "
                           "the report adds TTFT and latency per priority class (default: %(default)s, no "
                           "priority field).")
    load.add_argument("--priority", type=int, default=20, metavar="P",
                      help="The priority those sessions send (hyla and SGLang: higher is more urgent unless the "
                           "server schedules low values first; hyla: --enable-priority-scheduling) "
                           "(default: %(default)s).")
    load.add_argument("--warmup-requests", type=int, default=0, metavar="N",
                      help="Send N short requests (random words, unrelated to the workload) before the run and "
                           "leave them out of every metric; a failed one stops the bench with exit status 2 "
                           "(default: %(default)s).")
    load.add_argument("--seed", type=int, default=0,
                      help="Seed of the arrival times and the random prompts (default: %(default)s).")

    out = parser.add_argument_group("output")
    out.add_argument("--output-file", default=None, metavar="PATH",
                     help="Also write the summary and one record per request as JSON (default: none).")
    out.add_argument("--disable-tqdm", action="store_true",
                     help="No progress bar (default: a progress bar on stderr).")


def check_base_url(base_url: str) -> None:
    """``ValueError`` unless ``base_url`` is an absolute http(s) URL with a host (``127.0.0.1:30000``
    without a scheme would otherwise fail every request of the run, one by one)."""
    try:
        url = httpx.URL(base_url)
    except httpx.InvalidURL as e:
        raise ValueError(f"--base-url {base_url!r} is not a URL ({e})") from e
    if url.scheme not in ("http", "https") or not url.host:
        raise ValueError(f"--base-url must be an http:// or https:// URL with a host, got {base_url!r}")


def auth_headers(api_key: str | None) -> dict[str, str]:
    """The headers that send ``api_key`` (else the ``OPENAI_API_KEY`` environment variable's), as the
    openai client sends it; none without a key."""
    key = api_key if api_key is not None else os.environ.get("OPENAI_API_KEY")
    return {"Authorization": f"Bearer {key}"} if key else {}


def served_model(base_url: str, timeout: float | None, headers: dict[str, str] | None = None) -> str:
    """The first model id a server lists at ``GET /v1/models`` (what OpenAI clients would pick);
    ``ValueError`` when the server does not answer with such a list."""
    try:
        resp = httpx.get(base_url.rstrip("/") + "/v1/models", timeout=timeout, headers=headers)
        resp.raise_for_status()
        return str(resp.json()["data"][0]["id"])
    except (httpx.HTTPError, KeyError, IndexError, TypeError, ValueError) as e:
        raise ValueError(f"could not read the model name from {base_url}/v1/models ({e}); pass --model") from e


def flush_cache(base_url: str, timeout: float | None, headers: dict[str, str] | None = None) -> None:
    """Empty the server's prefix cache (``POST /flush_cache``); ValueError if it does not."""
    try:
        resp = httpx.post(base_url.rstrip("/") + "/flush_cache", timeout=timeout, headers=headers)
    except httpx.HTTPError as e:
        raise ValueError(f"could not flush the cache at {base_url}/flush_cache ({e})") from e
    if resp.status_code != 200:
        raise ValueError(f"the server did not flush its cache: {resp.status_code} {resp.text[:300]}")


def run(args: argparse.Namespace) -> int:
    """Run the benchmark; exit status 0 when any request completed, 1 when none did, 2 for a
    bad option or a server that cannot be asked for its model or to flush its cache, and 130 when
    interrupted (Ctrl-C: a line on stderr, no traceback, no report). Every option is checked before
    anything is sent to the server."""
    try:
        check_base_url(args.base_url)
        if not args.timeout > 0:  # also NaN
            raise ValueError(f"--timeout must be positive (inf: no limit), got {args.timeout}")
        if not args.request_rate > 0:  # also NaN
            raise ValueError(f"--request-rate must be positive (inf: all at once), got {args.request_rate}")
        if args.max_concurrency is not None and args.max_concurrency < 1:
            raise ValueError(f"--max-concurrency must be >= 1 (omit it for no cap), got {args.max_concurrency}")
        if args.warmup_requests < 0:
            raise ValueError(f"--warmup-requests must be >= 0, got {args.warmup_requests}")
        if not 0.0 <= args.priority_share <= 1.0:
            raise ValueError(f"--priority-share must be in [0, 1], got {args.priority_share}")
        if args.sharegpt_output_len is not None and args.sharegpt_output_len < 1:
            raise ValueError(f"--sharegpt-output-len must be >= 1 (omit it for the recorded replies' lengths), "
                             f"got {args.sharegpt_output_len}")
        if args.output_file:
            check_output_path(args.output_file, "--output-file")
        if args.dataset == "random":
            sessions = random_sessions(args.num_prompts, args.random_input_len, args.random_output_len,
                                       args.shared_prefix_ratio, args.num_shared_prefixes,
                                       args.random_range_ratio, args.seed)
        else:
            sessions = sharegpt_sessions(args.num_prompts, args.sharegpt_min_turns, args.sharegpt_max_turns,
                                         args.sharegpt_output_len)
        priorities = assign_priorities(len(sessions), args.priority_share, args.priority, args.seed)
        # the first requests to the server: every option has been checked above
        http_timeout = None if math.isinf(args.timeout) else args.timeout
        headers = auth_headers(args.api_key)
        args.model = args.model or served_model(args.base_url, http_timeout, headers)
        if args.flush_cache:
            flush_cache(args.base_url, http_timeout, headers)
        results, duration = asyncio.run(run_benchmark(
            args.base_url, sessions, args.backend, args.model, args.request_rate, args.max_concurrency,
            args.seed, not args.disable_tqdm, args.timeout, priorities, args.warmup_requests, headers))
    except ValueError as e:
        print(f"hyla bench: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("hyla bench: interrupted", file=sys.stderr)
        return INTERRUPTED
    summary = summarize(results, duration)
    print(format_report(summary))
    if args.output_file:
        record = {
            "config": {k: (str(v) if isinstance(v, float) and math.isinf(v) else v) for k, v in vars(args).items()
                       if k not in ("api_key", "given_argv")},  # (the key is a secret: never written, nor the argv)
            "summary": summary,
            "requests": [
                {"session_id": r.session_id, "turn_id": r.turn_id, "priority": r.priority, "success": r.success,
                 "error": r.error,
                 "ttft_s": r.ttft, "latency_s": r.latency, "itl_s": r.itl, "prompt_tokens": r.prompt_tokens,
                 "completion_tokens": r.completion_tokens, "cached_tokens": r.cached_tokens}
                for r in results
            ],
        }
        try:
            with open(args.output_file, "w", encoding="utf-8") as f:
                json.dump(record, f, indent=1)
        except OSError as e:
            print(f"hyla bench: error: could not write --output-file {args.output_file}: {e}", file=sys.stderr)
            return 2
    return 0 if summary["completed"] else 1
