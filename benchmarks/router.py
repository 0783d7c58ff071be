"""Data parallelism: ``hyla route`` in front of ``hyla serve`` workers, cache-aware routing against
round robin (what a load balancer that does not know the caches does) and least load.

``--workers`` workers (``hyla serve`` processes of the built-in default model, ``--cpu-threads``
each: on a CPU machine, one core each) and one router per policy (``hyla route`` processes) start
once. Each round flushes the workers' caches, then runs the same multi-turn workload through one
router: ``--sessions`` ShareGPT conversations of at least ``--turns`` rounds (their first
``--turns``), all sessions at once through `/v1/chat/completions`, each sending its next turn (the history, the recorded replies
replaced by the model's) when the last one has answered, ``--output-len`` tokens per reply
(``hyla.bench``). Measured per round:

* **cache hit rate**: prompt tokens the workers served from their prefix caches / all prompt tokens
  (each response's ``usage.prompt_tokens_details.cached_tokens``);
* **TTFT**, median and P90 over the requests, and the workload's **duration**.

A last column sends everything to the first worker alone (a router over it): the hit rate no
routing can beat, at one worker's throughput.

The policies alternate in rounds (a first untimed round warms every worker up); medians of
``--repeats``; in parentheses each policy's ratio to round robin's. Prints a markdown table and
writes the ``## Data parallelism: cache-aware routing`` section of docs/benchmarks.md.

    .venv/bin/python benchmarks/router.py [--workers 2] [--sessions 32] [--turns 4] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.report import machine, write_section  # noqa: E402
from hyla.bench.datasets import sharegpt_sessions  # noqa: E402
from hyla.bench.metrics import summarize  # noqa: E402
from hyla.bench.runner import run_benchmark  # noqa: E402
from hyla.router.launch import free_port  # noqa: E402

POLICIES = ("round_robin", "cache_aware", "least_load")
ONE = "one worker"
METRICS = ("cache hit rate (%)", "TTFT median (ms)", "TTFT P90 (ms)", "duration (s)")


def start(args: list[str], log: Path) -> tuple[subprocess.Popen, str]:
    """``hyla <args> --port P`` in a process of its own -> (the process, its URL), once it is healthy."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "hyla.cli", *args, "--port", str(port), "--log-level", "warning"],
                            stdout=log.open("w"), stderr=subprocess.STDOUT, cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"hyla {args[0]} exited: see {log}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise TimeoutError(f"hyla {args[0]} did not start: see {log}")
        time.sleep(0.2)


def stop(procs: list[subprocess.Popen]) -> None:
    """Stop the processes ``start`` started (SIGTERM: each drains; killed after 30 s)."""
    for proc in procs:
        proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def one_round(router: str, workers: list[str], sessions, model: str) -> dict[str, float]:
    for w in workers:
        httpx.post(w + "/flush_cache", timeout=60).raise_for_status()
    results, duration = asyncio.run(run_benchmark(router, sessions, backend="openai-chat", model=model, show_progress=False))
    s = summarize(results, duration)
    if s["failed"]:
        raise RuntimeError(f"{s['failed']} requests failed: {s['errors']}")
    return {"cache hit rate (%)": 100 * s["cache_hit_rate"], "TTFT median (ms)": s["ttft_ms"]["p50"],
            "TTFT P90 (ms)": s["ttft_ms"]["p90"], "duration (s)": duration}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--cpu-threads", type=int, default=1, help="each worker's intra-op threads")
    ap.add_argument("--sessions", type=int, default=32)
    ap.add_argument("--turns", type=int, default=4, help="rounds per conversation (those with fewer are skipped)")
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--log-dir", type=Path, default=Path("/tmp/hyla-router-bench"))
    ap.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    args = ap.parse_args()
    policies = [p for p in args.policies.split(",") if p]
    if "round_robin" not in policies:
        ap.error("--policies must include round_robin: the others are reported against it")
    args.log_dir.mkdir(parents=True, exist_ok=True)
    sessions = sharegpt_sessions(args.sessions, min_turns=args.turns, max_turns=args.turns, output_len=args.output_len)
    procs: list[subprocess.Popen] = []
    try:
        workers = []
        for i in range(args.workers):
            proc, url = start(["serve", "--cpu-threads", str(args.cpu_threads)], args.log_dir / f"worker{i}.log")
            procs.append(proc)
            workers.append(url)
        routers = {}
        for policy in policies:
            proc, url = start(["route", "--worker-urls", *workers, "--policy", policy], args.log_dir / f"{policy}.log")
            procs.append(proc)
            routers[policy] = url
        # every request to one worker: the hit rate's bound (no conversation ever leaves its cache), at the
        # throughput of one worker
        proc, routers[ONE] = start(["route", "--worker-urls", workers[0]], args.log_dir / "one_worker.log")
        procs.append(proc)
        policies = policies + [ONE]
        model = httpx.get(workers[0] + "/v1/models").json()["data"][0]["id"]
        runs: dict[str, list[dict[str, float]]] = {p: [] for p in policies}
        for rep in range(1 + args.repeats):
            for policy in policies:
                res = one_round(routers[policy], workers, sessions, model)
                if rep:
                    runs[policy].append(res)
                    print(f"repeat {rep}, {policy}: " + ", ".join(f"{k} {v:,.1f}" for k, v in res.items()), flush=True)
    finally:
        stop(procs)
    med = {p: {k: statistics.median(r[k] for r in rs) for k in METRICS} for p, rs in runs.items()}
    base = med["round_robin"]
    rows = []
    for k in METRICS:
        cells = [f"{med[p][k]:,.1f}" + ("" if p == "round_robin" or not base[k] else f" ({med[p][k] / base[k]:.2f}x)")
                 for p in policies]
        rows.append(f"| {k} | " + " | ".join(cells) + " |")
    command = (f".venv/bin/python benchmarks/router.py --workers {args.workers} --cpu-threads {args.cpu_threads} "
               f"--sessions {args.sessions} --turns {args.turns} --output-len {args.output_len} --repeats {args.repeats}")
    body = "\n".join([
        f"`{command}` — {machine()}; {args.workers} `hyla serve` workers of the built-in default model "
        f"({args.cpu_threads} intra-op thread(s) each) behind `hyla route`, one router per policy; "
        f"{len(sessions)} ShareGPT conversations of {args.turns} turns, all at once, each turn sent when the one "
        f"before has answered, {args.output_len} tokens per reply; the workers' caches flushed before each round; "
        f"medians of {args.repeats} rounds, the policies interleaved; in parentheses the ratio to round robin.",
        "",
        "| measurement | " + " | ".join(policies) + " |",
        "|---" * (1 + len(policies)) + "|",
        *rows,
    ])
    print(body)
    if not args.no_write:
        write_section("Data parallelism: cache-aware routing", body)


if __name__ == "__main__":
    main()
