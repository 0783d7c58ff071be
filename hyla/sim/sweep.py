"""Sweeps: many (rate, cache size, policy) configurations, run on worker processes, and their summary.

The ShareGPT protocol (``--sweep sharegpt``) is Marconi's: sessions per second in
``SHAREGPT_RATES`` x cache sizes in ``SHAREGPT_CACHE_GB`` = 36 configurations, each replayed under
every policy on the ``marconi-7b`` preset. The summary compares policies the way Marconi does:

* the mean over configurations of ``token_hit_rate(policy) / token_hit_rate(block)``;
* the P5 / P50 / P95 over configurations of the percentage win over ``lru``:
  ``100 * (token_hit_rate(policy) / token_hit_rate(lru) - 1)``.

A configuration where the baseline hits nothing has no finite ratio; it is left out of that
statistic and counted in ``*_undefined``.
"""

from __future__ import annotations

import multiprocessing as mp
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import numpy as np
from tqdm.auto import tqdm

from hyla.sim.models import resolve_model
from hyla.sim.sharegpt import Session, sessions_to_trace
from hyla.sim.simulator import SimConfig, SimResult, simulate

SHAREGPT_RATES: tuple[float, ...] = (0.25, 0.5, 1.0, 2.0, 5.0, 10.0)
SHAREGPT_CACHE_GB: tuple[float, ...] = (1.0, 2.0, 3.0, 4.0, 5.0, 10.0)
GB = 10**9  # Marconi sizes caches in decimal gigabytes


@dataclass(frozen=True)
class SweepPoint:
    rate: float | None  # sessions per second (None: a given trace)
    cache_gb: float
    result: SimResult


# ---- running ---------------------------------------------------------------------------------
_WORKER_SESSIONS: list[Session] = []


def _init_worker(sessions: list[Session]) -> None:
    global _WORKER_SESSIONS
    _WORKER_SESSIONS = sessions


def _run_task(task: tuple[float, str, str, tuple[float, ...], float, str]) -> list[SweepPoint]:
    """One rate and policy over all cache sizes (the trace is built once per task)."""
    rate, policy, model_spec, cache_gbs, wpm, kv_cache_dtype = task
    model = resolve_model(model_spec, kv_cache_dtype)
    trace = sessions_to_trace(_WORKER_SESSIONS, rate, wpm)
    return [
        SweepPoint(rate, gb, simulate(trace, SimConfig(model, policy, int(gb * GB))))
        for gb in cache_gbs
    ]


def run_sharegpt_sweep(
    sessions: list[Session],
    policies: Sequence[str],
    rates: Sequence[float] = SHAREGPT_RATES,
    cache_gbs: Sequence[float] = SHAREGPT_CACHE_GB,
    model_spec: str = "marconi-7b",
    words_per_minute: float = 90.0,
    workers: int = 2,
    show_progress: bool = True,
    kv_cache_dtype: str = "auto",
) -> list[SweepPoint]:
    """Every (rate, cache size, policy); ``workers > 1`` runs tasks on a process pool. ``kv_cache_dtype``: the
    model's KV as the engine's option keeps it (``resolve_model``)."""
    tasks = [(r, p, model_spec, tuple(cache_gbs), words_per_minute, kv_cache_dtype) for r in rates for p in policies]
    points: list[SweepPoint] = []
    progress = tqdm(total=len(tasks) * len(cache_gbs), desc="sweep", unit="config", disable=not show_progress)
    if workers <= 1:
        _init_worker(sessions)
        for task in tasks:
            points += _run_task(task)
            progress.update(len(cache_gbs))
    else:
        with mp.get_context("spawn").Pool(workers, initializer=_init_worker, initargs=(sessions,)) as pool:
            for batch in pool.imap_unordered(_run_task, tasks):
                points += batch
                progress.update(len(batch))
    progress.close()
    return sorted(points, key=lambda p: (p.rate, p.cache_gb, p.result.policy))


# ---- summarising -----------------------------------------------------------------------------
def hit_table(points: Iterable[SweepPoint]) -> dict[tuple[float, float], dict[str, float]]:
    """(rate, cache_gb) -> {policy: token hit rate}."""
    table: dict[tuple[float, float], dict[str, float]] = {}
    for p in points:
        table.setdefault((p.rate, p.cache_gb), {})[p.result.policy] = p.result.token_hit_rate
    return table


def summarize(points: Sequence[SweepPoint], base_ratio: str = "block", base_win: str = "lru") -> dict[str, Any]:
    """Per policy: mean hit-rate ratio over ``base_ratio`` and P5/P50/P95 % win over ``base_win``."""
    table = hit_table(points)
    policies = sorted({p.result.policy for p in points})
    out: dict[str, Any] = {"num_configs": len(table), "policies": {}}
    for policy in policies:
        stats: dict[str, Any] = {"mean_token_hit_rate": float(np.mean([row[policy] for row in table.values()]))}
        if all(base_ratio in row for row in table.values()):
            ratios = [row[policy] / row[base_ratio] for row in table.values() if row[base_ratio] > 0]
            stats[f"mean_ratio_over_{base_ratio}"] = float(np.mean(ratios)) if ratios else None
            stats[f"ratio_over_{base_ratio}_undefined"] = len(table) - len(ratios)
        if all(base_win in row for row in table.values()):
            wins = [100.0 * (row[policy] / row[base_win] - 1.0) for row in table.values() if row[base_win] > 0]
            for q in (5, 50, 95):
                stats[f"p{q}_win_over_{base_win}_pct"] = float(np.percentile(wins, q)) if wins else None
            stats[f"min_win_over_{base_win}_pct"] = float(min(wins)) if wins else None
            stats[f"win_over_{base_win}_undefined"] = len(table) - len(wins)
        out["policies"][policy] = stats
    return out


def format_table(points: Sequence[SweepPoint]) -> str:
    """Token hit rate (%) per configuration, one column per policy."""
    table = hit_table(points)
    policies = sorted({p.result.policy for p in points})
    head = f"{'rate':>6} {'cache':>6} " + " ".join(f"{p:>8}" for p in policies)
    lines = [head, "-" * len(head)]
    for (rate, gb), row in sorted(table.items()):
        lines.append(f"{rate:>6g} {gb:>5g}G " + " ".join(f"{100 * row[p]:>7.2f}%" for p in policies))
    return "\n".join(lines)


def format_summary(summary: dict[str, Any]) -> str:
    def fmt(v: Any, spec: str, unit: str) -> str:
        return format("n/a", ">" + spec.lstrip(">").split(".")[0]) + " " if v is None else format(v, spec) + unit

    lines = [f"{'policy':>8} {'mean hit':>9} {'x block':>8} {'P5 vs lru':>10} {'P50 vs lru':>11} "
             f"{'P95 vs lru':>11} {'min vs lru':>11}"]
    for policy, s in summary["policies"].items():
        lines.append(
            f"{policy:>8} {100 * s['mean_token_hit_rate']:>8.2f}% {fmt(s.get('mean_ratio_over_block'), '>7.2f', 'x')} "
            f"{fmt(s.get('p5_win_over_lru_pct'), '>9.1f', '%')} {fmt(s.get('p50_win_over_lru_pct'), '>10.1f', '%')} "
            f"{fmt(s.get('p95_win_over_lru_pct'), '>10.1f', '%')} {fmt(s.get('min_win_over_lru_pct'), '>10.1f', '%')}"
        )
    return "\n".join(lines)


def points_to_json(points: Sequence[SweepPoint]) -> list[dict[str, Any]]:
    return [{"rate": p.rate, "cache_gb": p.cache_gb, **p.result.to_json()} for p in points]
