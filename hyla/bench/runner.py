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
* ``warmup_requests`` short requests go first, all at once, and are left out of the results and
  of the duration; their prompt is random words unrelated to the workload (so they do not warm
  the prefix cache for it). A failed warm-up stops the run (``WarmupError``) before the workload:
  a wrong model name or endpoint fails there once, not on every request of a long run.
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
from hyla.bench.datasets import BenchSession, random_text

WARMUP_WORDS = 16  # prompt length of a warm-up request
WARMUP_TOKENS = 8  # output tokens asked of a warm-up request


class WarmupError(ValueError):
    """A warm-up request failed; the run did not start."""


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
    warmup_requests: int = 0,
    headers: dict[str, str] | None = None,
) -> tuple[list[RequestResult], float]:
    """Run every session; returns the per-request results and the wall-clock duration (s), both
    without the ``warmup_requests`` warm-ups (``WarmupError`` when one fails).
    ``timeout_s`` limits each whole request, from its send (after any wait for a
    ``max_concurrency`` slot) to the end of its stream; a request past it counts as failed
    (None or inf: no limit). ``headers``: sent with every request (an API key's ``Authorization``)."""
    if timeout_s is not None and not timeout_s > 0:
        raise ValueError(f"the timeout must be positive, got {timeout_s}")
    if timeout_s is not None and math.isinf(timeout_s):
        timeout_s = None  # no limit
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
    if warmup_requests < 0:
        raise ValueError(f"warmup_requests must be >= 0, got {warmup_requests}")
    priorities = list(priorities) if priorities is not None else [None] * len(sessions)
    if len(priorities) != len(sessions):
        raise ValueError(f"{len(priorities)} priorities for {len(sessions)} sessions")
    starts = arrival_times(len(sessions), request_rate, seed)
    semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    results: list[RequestResult] = []
    total = sum(s.num_turns for s in sessions)
    progress = tqdm(total=total, desc="requests", disable=not show_progress)
    limits = httpx.Limits(max_connections=max_concurrency or max(len(sessions), warmup_requests, 1))
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout_s, limits=limits, headers=headers) as client:
        if warmup_requests:
            rng = random.Random(f"warmup-{seed}")
            warmups = await asyncio.gather(*(
                send_request(client, backend, model, [{"role": "user", "content": random_text(rng, WARMUP_WORDS)}],
                             WARMUP_TOKENS, -1, i, None, timeout_s)
                for i in range(warmup_requests)))
            failed = [w for w in warmups if not w.success]
            if failed:
                progress.close()
                raise WarmupError(f"{len(failed)} of {warmup_requests} warm-up requests failed, the run did not "
                                  f"start: {failed[0].error}")
        t0 = time.perf_counter()
        await asyncio.gather(*(
            _run_session(client, s, start, t0, backend, model, semaphore, results, progress, prio, timeout_s)
            for s, start, prio in zip(sessions, starts, priorities)
        ))
        duration = time.perf_counter() - t0
    progress.close()
    results.sort(key=lambda r: (r.session_id, r.turn_id))
    return results, duration
