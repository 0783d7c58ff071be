"""Drive a workload against a server: Poisson session arrivals or a concurrency cap.

Scheduling rules:

* Sessions start as a Poisson process of ``request_rate`` per second (``inf``: all at once);
  for one-turn workloads that is the request rate.
* Inside a session, turn ``k + 1`` is sent as soon as turn ``k`` has finished, and its history
  holds the server's actual reply to turn ``k`` (so the server can hit its cache on it). A failed
  turn ends its session.
* ``max_concurrency`` caps requests in flight across all sessions (a semaphore around each send).
* ``priorities`` (one per session, or None) are sent with every turn of their session
  (:func:`assign_priorities`).
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from typing import Sequence

import httpx
from tqdm.auto import tqdm

from hyla.bench.backends import RequestResult, send_request
from hyla.bench.datasets import BenchSession


def assign_priorities(num: int, share: float, priority: int, seed: int = 0) -> list[int | None]:
    """Per session: ``priority`` for a random ``share`` of the ``num`` sessions (``round(share * num)``
    of them, drawn with ``seed``), None (no priority field) for the rest."""
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"the priority share must be in [0, 1], got {share}")
    chosen = set(random.Random(seed).sample(range(num), round(share * num)))
    return [priority if i in chosen else None for i in range(num)]


def arrival_times(num: int, request_rate: float, seed: int = 0) -> list[float]:
    """Start offsets (s) of ``num`` sessions: exponential gaps of mean ``1 / rate``, first at 0."""
    if not request_rate > 0:
        raise ValueError(f"request rate must be positive (or inf), got {request_rate}")
    if math.isinf(request_rate):
        return [0.0] * num
    rng = random.Random(seed)
    times, t = [], 0.0
    for i in range(num):
        times.append(t)
        t += rng.expovariate(request_rate)
    return times


async def _run_session(
    client: httpx.AsyncClient,
    session: BenchSession,
    start_at: float,
    t0: float,
    backend: str,
    model: str,
    semaphore: asyncio.Semaphore | None,
    results: list[RequestResult],
    progress: tqdm | None,
    priority: int | None = None,
    timeout_s: float | None = None,
) -> None:
    await asyncio.sleep(max(0.0, t0 + start_at - time.perf_counter()))
    history: list[dict[str, str]] = []
    for k, turn in enumerate(session.turns):
        user = session.prefix + turn.user if k == 0 else turn.user
        messages = history + [{"role": "user", "content": user}]
        if semaphore is None:
            result = await send_request(client, backend, model, messages, turn.max_tokens, session.session_id, k,
                                        priority, timeout_s)
        else:
            async with semaphore:
                result = await send_request(client, backend, model, messages, turn.max_tokens, session.session_id,
                                            k, priority, timeout_s)
        results.append(result)
        if progress is not None:
            progress.update(1)
        if not result.success:
            if progress is not None:
                progress.update(session.num_turns - k - 1)
            return
        history = messages + [{"role": "assistant", "content": result.text}]


async def run_benchmark(
    base_url: str,
    sessions: Sequence[BenchSession],
    backend: str = "openai",
    model: str = "default",
    request_rate: float = math.inf,
    max_concurrency: int | None = None,
    seed: int = 0,
    show_progress: bool = True,
    timeout_s: float | None = 600.0,
    priorities: Sequence[int | None] | None = None,
) -> tuple[list[RequestResult], float]:
    """Run every session; returns the per-request results and the wall-clock duration (s).
    ``timeout_s`` limits each whole request, from its send (after any wait for a
    ``max_concurrency`` slot) to the end of its stream; a request past it counts as failed
    (None or inf: no limit)."""
    if timeout_s is not None and not timeout_s > 0:
        raise ValueError(f"the timeout must be positive, got {timeout_s}")
    if timeout_s is not None and math.isinf(timeout_s):
        timeout_s = None  # no limit
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
    priorities = list(priorities) if priorities is not None else [None] * len(sessions)
    if len(priorities) != len(sessions):
        raise ValueError(f"{len(priorities)} priorities for {len(sessions)} sessions")
    starts = arrival_times(len(sessions), request_rate, seed)
    semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    results: list[RequestResult] = []
    total = sum(s.num_turns for s in sessions)
    progress = tqdm(total=total, desc="requests", disable=not show_progress)
    limits = httpx.Limits(max_connections=max_concurrency or len(sessions) or 1)
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout_s, limits=limits) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(
            _run_session(client, s, start, t0, backend, model, semaphore, results, progress, prio, timeout_s)
            for s, start, prio in zip(sessions, starts, priorities)
        ))
        duration = time.perf_counter() - t0
    progress.close()
    results.sort(key=lambda r: (r.session_id, r.turn_id))
    return results, duration
