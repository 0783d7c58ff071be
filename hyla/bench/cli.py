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
import sys

import httpx

from hyla.bench.backends import BACKENDS
from hyla.bench.datasets import random_sessions, sharegpt_sessions
from hyla.bench.metrics import format_report, summarize
from hyla.bench.runner import run_benchmark


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:30000", help="server root URL")
    parser.add_argument("--backend", choices=BACKENDS, default="openai",
                        help="openai: /v1/completions; openai-chat: /v1/chat/completions; hyla: native /generate")
    parser.add_argument("--model", default=None,
                        help="model name sent in OpenAI requests (default: the first one the server's /v1/models lists)")
    parser.add_argument("--dataset", choices=("sharegpt", "random"), default="sharegpt")
    parser.add_argument("--num-prompts", type=int, default=100,
                        help="sessions (sharegpt) or requests (random)")
    parser.add_argument("--sharegpt-min-turns", type=int, default=1, help="only conversations with this many rounds")
    parser.add_argument("--sharegpt-max-turns", type=int, default=None, help="send at most this many turns per session")
    parser.add_argument("--sharegpt-output-len", type=int, default=None,
                        help="output tokens asked per turn (default: the recorded reply's word count)")
    parser.add_argument("--random-input-len", type=int, default=1024)
    parser.add_argument("--random-output-len", type=int, default=128)
    parser.add_argument("--random-range-ratio", type=float, default=1.0,
                        help="draw lengths uniformly from [ratio*len, len]")
    parser.add_argument("--shared-prefix-ratio", type=float, default=0.0,
                        help="fraction of each random prompt that is a shared prefix")
    parser.add_argument("--num-shared-prefixes", type=int, default=1)
    parser.add_argument("--request-rate", type=float, default=math.inf,
                        help="Poisson arrivals per second of sessions/requests (default inf: all at once)")
    parser.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=600.0, help="per-request timeout (s)")
    parser.add_argument("--output-file", default=None, help="write the summary and per-request records as JSON")
    parser.add_argument("--disable-tqdm", action="store_true")


def served_model(base_url: str, timeout: float) -> str:
    """The first model id a server lists at ``GET /v1/models`` (what OpenAI clients would pick)."""
    try:
        resp = httpx.get(base_url.rstrip("/") + "/v1/models", timeout=timeout)
        resp.raise_for_status()
        return resp.json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as e:
        raise ValueError(f"could not read the model name from {base_url}/v1/models ({e}); pass --model") from e


def run(args: argparse.Namespace) -> int:
    try:
        if args.dataset == "random":
            sessions = random_sessions(args.num_prompts, args.random_input_len, args.random_output_len,
                                       args.shared_prefix_ratio, args.num_shared_prefixes,
                                       args.random_range_ratio, args.seed)
        else:
            sessions = sharegpt_sessions(args.num_prompts, args.sharegpt_min_turns, args.sharegpt_max_turns,
                                         args.sharegpt_output_len)
        args.model = args.model or served_model(args.base_url, args.timeout)
        results, duration = asyncio.run(run_benchmark(
            args.base_url, sessions, args.backend, args.model, args.request_rate, args.max_concurrency,
            args.seed, not args.disable_tqdm, args.timeout))
    except ValueError as e:
        print(f"hyla bench: error: {e}", file=sys.stderr)
        return 2
    summary = summarize(results, duration)
    print(format_report(summary))
    if args.output_file:
        record = {
            "config": {k: (str(v) if isinstance(v, float) and math.isinf(v) else v) for k, v in vars(args).items()},
            "summary": summary,
            "requests": [
                {"session_id": r.session_id, "turn_id": r.turn_id, "success": r.success, "error": r.error,
                 "ttft_s": r.ttft, "latency_s": r.latency, "itl_s": r.itl, "prompt_tokens": r.prompt_tokens,
                 "completion_tokens": r.completion_tokens, "cached_tokens": r.cached_tokens}
                for r in results
            ],
        }
        with open(args.output_file, "w", encoding="utf-8") as f:
            json.dump(record, f, indent=1)
    return 0 if summary["completed"] else 1
