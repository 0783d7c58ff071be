"""`hyla sim`: replay a request trace through hyla's prefix cache in accounting mode.

    hyla sim TRACE.jsonl --model marconi-7b --policy hyla --cache-size 4GB [--json]
    hyla sim TRACE.jsonl --model path/to/config.json --policy lru,hyla --cache-size 1GB,2GB,4GB --plot hit.png
    hyla sim --sweep sharegpt [--workers 2] [--plot docs/simulator_sharegpt.png] [--output sweep.json]
    hyla sim TRACE.jsonl --model qwen3-next-80b-a3b --engine '{"max_total_tokens": 200000, "max_state_slots": 96, "page_size": 16}'

With ``--json`` the last line printed is one JSON object: a run's metrics for one configuration,
``{"results": [...]}`` for several, ``{"summary": ..., "results": [...]}`` for a sweep.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from hyla.cli import check_output_path
from hyla.engine.args import KV_CACHE_DTYPES
from hyla.sim.models import PRESETS, resolve_model
from hyla.sim.policies import POLICIES
from hyla.sim.simulator import SimConfig, SimResult, simulate
from hyla.sim.sweep import (
    GB,
    SHAREGPT_CACHE_GB,
    SHAREGPT_RATES,
    SweepPoint,
    format_summary,
    format_table,
    points_to_json,
    run_sharegpt_sweep,
    summarize,
)
from hyla.sim.trace import load_trace

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str) -> int:
    """``"4GB"`` -> 4e9 bytes (decimal units, as Marconi), ``"1.5GiB"``, ``"512MB"``, ``"1000"`` (bytes)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).upper() not in _UNITS:
        raise ValueError(f"bad size {text!r}: use e.g. 4GB, 512MB, 1.5GiB or a number of bytes")
    value = float(m.group(1)) * _UNITS[m.group(2).upper()]
    if not math.isfinite(value):
        raise ValueError(f"size {text!r} is too large")
    size = int(value)
    if size <= 0:
        raise ValueError(f"size must be positive, got {text!r}")
    return size


def format_size(num_bytes: float) -> str:
    """``num_bytes`` in the largest of ``parse_size``'s decimal units that keeps it at least 1, to 3
    significant digits (``4GB``, ``2.15GB``, ``100TB``), whole above 1000 TB (``1,000,000TB``): never
    in exponent notation."""
    for unit in ("TB", "GB", "MB", "KB"):
        if num_bytes >= _UNITS[unit]:
            value = num_bytes / _UNITS[unit]
            return f"{value:.3g}{unit}" if value < 1000 else f"{value:,.0f}{unit}"
    return f"{num_bytes:g}B"


def _sizes(text: str) -> list[int]:
    """``--cache-size``: comma-separated sizes (``parse_size``), each once (a size given twice would
    run the same configurations twice)."""
    sizes = [parse_size(s) for s in _csv(text)]
    return _unique(sizes, "--cache-size", lambda b: f"{format_size(b)} ({b:,} bytes)")


def _unique(items: list[Any], flag: str, show: Any = str) -> list[Any]:
    """``items``, refused (``ValueError`` naming ``flag``) where one is given twice."""
    twice = next((x for i, x in enumerate(items) if x in items[:i]), None)
    if twice is not None:
        raise ValueError(f"{flag} lists {show(twice)} more than once")
    return items


def _csv(text: str) -> list[str]:
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise ValueError(f"empty list {text!r}")
    return items


def _policies(text: str) -> list[str]:
    names = _csv(text)
    bad = [n for n in names if n not in POLICIES]
    if bad:
        raise ValueError(f"unknown policy {', '.join(bad)}; choose from {', '.join(POLICIES)}")
    return _unique(names, "--policy")


def _rates(text: str) -> list[float]:
    """``--rates``: positive, finite sessions per second."""
    rates = []
    for item in _csv(text):
        try:
            rate = float(item)
        except ValueError:
            rate = math.nan
        if not (rate > 0 and math.isfinite(rate)):
            raise ValueError(f"--rates: {item!r} is not a positive number of sessions per second")
        rates.append(rate)
    return _unique(rates, "--rates", lambda r: f"{r:g}")


# the sweep's own options (None: not given; they apply only with --sweep) and their defaults
SWEEP_DEFAULTS = {"sessions": 100, "workers": 2, "words_per_minute": 90.0}


def _sweep_option(args: argparse.Namespace, name: str) -> Any:
    """The sweep option ``name`` as given, else its default (``SWEEP_DEFAULTS``)."""
    value = getattr(args, name)
    return SWEEP_DEFAULTS[name] if value is None else value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("trace", nargs="?", help="JSON Lines trace (one request per line); omit with --sweep")
    parser.add_argument("--sweep", choices=("sharegpt",), help="run a built-in protocol instead of a trace")
    parser.add_argument("--model", default="marconi-7b",
                        help=f"a preset ({', '.join(PRESETS)}) or a config.json path (default marconi-7b)")
    parser.add_argument("--policy", default=None,
                        help=f"comma-separated policies from {', '.join(POLICIES)} (default: hyla; sweep: all; "
                             "not with --engine)")
    parser.add_argument("--cache-size", default=None,
                        help="comma-separated cache sizes, e.g. 1GB,4GB (default 4GB; sweep: 1,2,3,4,5,10 GB; "
                             "not with --engine)")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                        help="the model's KV as the engine's --kv-cache-dtype keeps it: auto (its dtype), fp8_e4m3 or "
                             "fp8_e5m2 (a byte per element: twice bf16's tokens in a cache size; not with --engine, "
                             "whose options take kv_cache_dtype)")
    parser.add_argument("--json", action="store_true", help="print the results as one JSON object, last")
    parser.add_argument("--output", default=None, help="also write the JSON results to this file")
    parser.add_argument("--plot", default=None, help="write a PNG of token hit rate vs cache size per policy "
                                                     "(not with --engine)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--engine", default=None, metavar="OPTIONS",
                        help="replay hyla's engine instead of a policy (hyla/sim/replay.py): a JSON object of Engine "
                             "options, max_total_tokens and max_state_slots required; the trace's requests must fit "
                             "its context length and token ids the model's vocabulary")
    sweep = parser.add_argument_group("sweep (--sweep sharegpt)")
    sweep.add_argument("--rates", default=None, help="sessions per second (default 0.25,0.5,1,2,5,10)")
    sweep.add_argument("--sessions", type=int, default=None,
                       help=f"ShareGPT sessions with >= 10 rounds (default {SWEEP_DEFAULTS['sessions']})")
    sweep.add_argument("--workers", type=int, default=None,
                       help=f"worker processes (default {SWEEP_DEFAULTS['workers']})")
    sweep.add_argument("--words-per-minute", type=float, default=None,
                       help=f"typing speed between turns (default {SWEEP_DEFAULTS['words_per_minute']:g})")


def _check_options(args: argparse.Namespace) -> None:
    """Options that cannot apply, and output paths, before anything runs."""
    if args.engine is not None:
        if args.sweep:
            raise ValueError("--engine replays a TRACE, not a --sweep")
        given = [flag for flag, value in (("--policy", args.policy), ("--cache-size", args.cache_size),
                                          ("--plot", args.plot), ("--rates", args.rates),
                                          ("--kv-cache-dtype", None if args.kv_cache_dtype == "auto" else 1))
                 if value is not None]
        if given:
            raise ValueError(f"{', '.join(given)} do{'es' if len(given) == 1 else ''} not apply with --engine (the "
                             "engine's own eviction and its max_total_tokens / max_state_slots replace the "
                             "policy and the cache size)")
    if args.sweep and args.trace:
        raise ValueError(f"give a TRACE or --sweep {args.sweep}, not both (the sweep builds its own traces)")
    if not args.sweep:
        given = [flag for flag, value in (("--rates", args.rates), ("--sessions", args.sessions),
                                          ("--workers", args.workers),
                                          ("--words-per-minute", args.words_per_minute)) if value is not None]
        if given:
            raise ValueError(f"{', '.join(given)} appl{'ies' if len(given) == 1 else 'y'} only with --sweep")
    wpm = _sweep_option(args, "words_per_minute")
    if not (wpm > 0 and math.isfinite(wpm)):
        raise ValueError(f"--words-per-minute must be a positive number, got {wpm}")
    workers = _sweep_option(args, "workers")
    if workers < 1:
        raise ValueError(f"--workers must be at least 1 (worker processes), got {workers}")
    for flag, value in (("--output", args.output), ("--plot", args.plot)):
        if value is not None:
            check_output_path(value, flag)
    if args.plot is not None and Path(args.plot).suffix.lower() != ".png":
        # (matplotlib would pick the format from the suffix, or add ".png" to a path without one)
        raise ValueError(f"--plot {args.plot}: the plot is a PNG, give a path ending in .png")


def run(args: argparse.Namespace) -> int:
    try:
        _check_options(args)
        if args.sweep:
            out = _run_sweep(args)
        elif args.trace and args.engine is not None:
            out = _run_engine_replay(args)
        elif args.trace:
            out = _run_trace(args)
        else:
            raise ValueError("give a TRACE file or --sweep sharegpt")
    except (ValueError, OSError) as e:
        print(f"hyla sim: error: {e}", file=sys.stderr)
        return 2
    text = json.dumps(out)
    if args.output:
        try:
            Path(args.output).write_text(json.dumps(out, indent=1) + "\n")
        except OSError as e:
            print(f"hyla sim: error: could not write --output {args.output}: {e}", file=sys.stderr)
            return 2
    if args.json:
        print(text)
    return 0


def _run_trace(args: argparse.Namespace) -> dict[str, Any]:
    trace = load_trace(args.trace)
    model = resolve_model(args.model, args.kv_cache_dtype)
    policies = _policies(args.policy or "hyla")
    sizes = _sizes(args.cache_size or "4GB")
    results: list[SimResult] = []
    for size in sizes:
        for policy in policies:
            results.append(simulate(trace, SimConfig(model, policy, size), show_progress=not args.no_progress))
    print(_results_table(results))
    if args.plot:
        from hyla.sim.plot import plot_hit_rates

        points = [SweepPoint(None, r.cache_bytes / GB, r) for r in results]
        print(f"plot: {plot_hit_rates(points, args.plot, title=f'{Path(args.trace).name} on {model.name}')}")
    rows = [r.to_json() for r in results]
    return rows[0] if len(rows) == 1 else {"results": rows}


def _run_engine_replay(args: argparse.Namespace) -> dict[str, Any]:
    from hyla.sim.replay import engine_args, replay_engine

    try:
        options = json.loads(args.engine)
    except json.JSONDecodeError as e:
        raise ValueError(f"--engine: not valid JSON ({e.msg})") from None
    if not isinstance(options, dict):
        raise ValueError("--engine: a JSON object of Engine options, e.g. '{\"max_total_tokens\": 4096, \"max_state_slots\": 32}'")
    trace = load_trace(args.trace)
    model = resolve_model(args.model)
    try:
        engine_args(options)  # every key an Engine option (not one of replay_engine's own parameters)
        replay = replay_engine(trace, model.layout, vocab_size=model.vocab_size,
                               max_position_embeddings=model.max_position_embeddings, **options)
    except (TypeError, ValueError) as e:
        raise ValueError(f"--engine: {e}") from None
    except MemoryError:  # the accounting pools keep a host-side free list per KV token and state slot
        raise ValueError("--engine: out of host memory for the accounting pools' free lists (one entry per "
                         "max_total_tokens token and max_state_slots slot): use smaller pools") from None
    inputs = sum(r.num_input_tokens for r in trace)
    cached = sum(replay.cached_tokens)
    out = {"model": model.name, "engine_options": options, "num_requests": len(trace), "input_tokens": inputs,
           "cached_tokens": cached, "token_hit_rate": cached / max(1, inputs),
           "request_hit_rate": sum(c > 0 for c in replay.cached_tokens) / len(trace),
           "num_retractions": replay.scheduler.num_retractions,
           "num_evicted_tokens": replay.cache.num_evicted_tokens,
           "num_evicted_states": replay.cache.num_evicted_states,
           "cached_tokens_per_request": replay.cached_tokens}
    host = replay.cache.host
    if host is not None:  # enable_hierarchical_cache: the host tier's books
        out.update(host_hit_tokens=replay.cache.num_host_hit_tokens, host_saved_tokens=host.num_saved_tokens,
                   host_loaded_tokens=host.num_loaded_tokens, host_kv_tokens=host.kv_pool.size)
    print(f"engine replay of {len(trace)} requests on {model.name}: token hit {100 * out['token_hit_rate']:.2f}%, "
          f"request hit {100 * out['request_hit_rate']:.1f}%, {out['num_retractions']} retractions, "
          f"{out['num_evicted_tokens']} tokens and {out['num_evicted_states']} checkpoints evicted"
          + (f"; host tier ({host.kv_pool.size} tokens): {out['host_hit_tokens']} hit tokens, "
             f"{out['host_saved_tokens']} saved, {out['host_loaded_tokens']} loaded" if host is not None else ""))
    return out


def _run_sweep(args: argparse.Namespace) -> dict[str, Any]:
    from hyla.sim.sharegpt import build_sessions

    rates = _rates(args.rates) if args.rates else list(SHAREGPT_RATES)
    sizes = [size / GB for size in _sizes(args.cache_size)] if args.cache_size else list(SHAREGPT_CACHE_GB)
    policies = _policies(args.policy or ",".join(POLICIES))
    resolve_model(args.model, args.kv_cache_dtype)  # fail early on a bad model
    sessions = build_sessions(num_sessions=_sweep_option(args, "sessions"))
    workers, wpm = _sweep_option(args, "workers"), _sweep_option(args, "words_per_minute")
    start = time.perf_counter()
    points = run_sharegpt_sweep(sessions, policies, rates, sizes, args.model, wpm, workers=workers,
                                show_progress=not args.no_progress, kv_cache_dtype=args.kv_cache_dtype)
    elapsed = time.perf_counter() - start
    summary = summarize(points)
    print(f"{len(rates) * len(sizes)} configurations x {len(policies)} policies, {len(sessions)} sessions, "
          f"{workers} worker(s): {elapsed:.0f} s")
    print(format_table(points))
    print()
    print(format_summary(summary))
    if args.plot:
        from hyla.sim.plot import plot_hit_rates

        title = f"ShareGPT, {len(sessions)} sessions, {args.model}"
        print(f"plot: {plot_hit_rates(points, args.plot, title=title)}")
    return {"summary": summary, "results": points_to_json(points)}


def _results_table(results: Sequence[SimResult]) -> str:
    head = (f"{'policy':>8} {'cache':>8} {'token hit':>10} {'req hit':>8} {'FLOPs saved':>12} "
            f"{'KV GB':>7} {'state GB':>8} {'TTFT p50':>9} {'TTFT p95':>9}")
    lines = [head, "-" * len(head)]
    for r in results:
        lines.append(
            f"{r.policy:>8} {format_size(r.cache_bytes):>8} {100 * r.token_hit_rate:>9.2f}% "
            f"{100 * r.request_hit_rate:>7.1f}% {r.flops_saved:>12.3e} {r.kv_bytes / GB:>7.3f} "
            f"{r.state_bytes / GB:>8.3f} {1000 * r.ttft_p50:>7.1f}ms {1000 * r.ttft_p95:>7.1f}ms"
        )
    return "\n".join(lines)
