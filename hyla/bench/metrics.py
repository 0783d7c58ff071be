"""Aggregate per-request results into the serving metrics `hyla bench` reports.

* throughput: completed requests, input (prompt) tokens and output tokens per second of wall time;
* TTFT (time to first token), TPOT (time per output token after the first, per request), ITL
  (every gap between streamed chunks) and E2E latency (send to the end of the stream, per
  request): mean, P50, P90, P99 in milliseconds, over the completed requests only;
* cache hit rate: Σ server-reported cached prompt tokens / Σ prompt tokens;
* with priorities sent (``--priority-share``): TTFT and latency per priority class.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from hyla.bench.backends import RequestResult

PERCENTILES = (50, 90, 99)


def latency_stats_ms(values: Sequence[float]) -> dict[str, float]:
    """Mean and P50/P90/P99 of seconds, in milliseconds (zeros for an empty list)."""
    if len(values) == 0:
        return {"mean": 0.0, **{f"p{p}": 0.0 for p in PERCENTILES}}
    arr = np.asarray(values, dtype=np.float64) * 1000.0
    return {"mean": float(arr.mean()), **{f"p{p}": float(np.percentile(arr, p)) for p in PERCENTILES}}


def summarize(results: Sequence[RequestResult], duration_s: float) -> dict[str, Any]:
    """The run's metrics (module docstring) as a JSON-ready dict. Failed requests count in
    ``num_requests`` and ``failed`` and list their errors, but add nothing to the token counts,
    throughputs and latency statistics. ``ValueError`` unless ``duration_s`` is positive."""
    if duration_s <= 0:
        raise ValueError(f"duration must be positive, got {duration_s}")
    ok = [r for r in results if r.success]
    classes = sorted({r.priority for r in results}, key=lambda p: (p is not None, p or 0))
    input_tokens = sum(r.prompt_tokens for r in ok)
    output_tokens = sum(r.completion_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    return {
        "duration_s": duration_s,
        "num_requests": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "request_throughput": len(ok) / duration_s,
        "input_throughput": input_tokens / duration_s,
        "output_throughput": output_tokens / duration_s,
        "total_token_throughput": (input_tokens + output_tokens) / duration_s,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "cached_tokens": cached,
        "cache_hit_rate": cached / input_tokens if input_tokens else 0.0,
        "ttft_ms": latency_stats_ms([r.ttft for r in ok]),
        "tpot_ms": latency_stats_ms([t for r in ok if (t := r.tpot) is not None]),
        "itl_ms": latency_stats_ms([g for r in ok for g in r.itl]),
        "e2e_latency_ms": latency_stats_ms([r.latency for r in ok]),
        "errors": sorted({r.error for r in results if not r.success})[:10],
        # per priority sent ("none": no priority field), when any request had one
        "by_priority": {} if classes == [None] else {
            "none" if p is None else str(p): {
                "num_requests": sum(r.priority == p for r in results),
                "completed": sum(r.priority == p for r in ok),
                "ttft_ms": latency_stats_ms([r.ttft for r in ok if r.priority == p]),
                "latency_ms": latency_stats_ms([r.latency for r in ok if r.priority == p]),
            } for p in classes},
    }


def format_report(summary: dict[str, Any]) -> str:
    """A fixed-width table of the summary, like SGLang's bench_serving prints."""
    lines = [
        "=" * 20 + " Serving Benchmark Result " + "=" * 20,
        f"{'Successful requests:':<40}{summary['completed']:>12}",
        f"{'Failed requests:':<40}{summary['failed']:>12}",
        f"{'Benchmark duration (s):':<40}{summary['duration_s']:>12.2f}",
        f"{'Total input tokens:':<40}{summary['total_input_tokens']:>12}",
        f"{'Total generated tokens:':<40}{summary['total_output_tokens']:>12}",
        f"{'Request throughput (req/s):':<40}{summary['request_throughput']:>12.2f}",
        f"{'Input token throughput (tok/s):':<40}{summary['input_throughput']:>12.2f}",
        f"{'Output token throughput (tok/s):':<40}{summary['output_throughput']:>12.2f}",
        f"{'Total token throughput (tok/s):':<40}{summary['total_token_throughput']:>12.2f}",
        f"{'Server cache hit rate:':<40}{summary['cache_hit_rate']:>12.2%}",
    ]
    for key, title in (("ttft_ms", "Time to First Token"), ("tpot_ms", "Time per Output Token (excl. 1st token)"),
                       ("itl_ms", "Inter-token Latency"), ("e2e_latency_ms", "End-to-End Latency")):
        lines.append("-" * 15 + f" {title} " + "-" * 15)
        for stat in ("mean", *[f"p{p}" for p in PERCENTILES]):
            label = f"{stat.capitalize() if stat == 'mean' else stat.upper()} {key.split('_')[0].upper()} (ms):"
            lines.append(f"{label:<40}{summary[key][stat]:>12.2f}")
    if summary["by_priority"]:
        lines.append("-" * 15 + " By priority (TTFT / latency P50, P99 ms) " + "-" * 15)
        for p, c in summary["by_priority"].items():
            label = f"priority {p} ({c['completed']}/{c['num_requests']}):"
            lines.append(f"{label:<28}{c['ttft_ms']['p50']:>9.1f}{c['ttft_ms']['p99']:>9.1f}"
                         f"{c['latency_ms']['p50']:>10.1f}{c['latency_ms']['p99']:>10.1f}")
    for err in summary["errors"]:
        lines.append(f"error: {err}")
    lines.append("=" * 66)
    return "\n".join(lines)
