"""Prefill/decode disaggregation: two workers behind ``hyla route``, each doing both (colocated) against
one prefilling and one decoding (``--prefill-urls``), on a workload where long prompts arrive while
other requests decode.

Two ``hyla serve`` processes of the built-in default model (``--cpu-threads`` each: on a CPU machine,
one core each) start once, and two routers over them: ``colocated`` (``--worker-urls A B``: either
worker prefills and decodes) and ``disaggregated`` (``--worker-urls A --prefill-urls B``: B computes
every prompt, its KV and state move to A, A decodes). Each round flushes both caches and runs, through
one router, at the same time:

* ``--decoders`` streams of short prompts (``--decode-prompt`` words) each decoding ``--decode-len``
  tokens, all sent at once: what a long prompt's prefill interrupts;
* ``--long-prompts`` requests of ``--long-len`` words and ``--long-out`` tokens, arriving at
  ``--long-rate`` per second (Poisson, the same seed every round).

Measured per round: the decoding streams' **ITL** (every gap between streamed chunks: P50, P99, the
longest, and how many gaps were longer than 100 ms: the stalls a prefill causes) and **TPOT** median; the long prompts' **TTFT** (median and P90); the round's **duration** and output
tokens per second. Rounds alternate between the routers (a first untimed round of each warms up);
medians of ``--repeats``; in parentheses the ratio to colocated.

Then an agent's conversation through the disaggregated router: ``--agent-turns`` turns, each adding the
model's reply and a tool result of ``--tool-words`` words. Every turn's new part is longer than
``--local-prefill-tokens``, so every turn moves; measured per turn: the bytes the router moved (its
``hyla_router_prefix_bytes_total``) against the bytes of the whole prefix (the prefill worker's
``/export_prefix`` of the same prompt): only the KV the decode worker lacks travels.

Prints markdown tables and writes the ``## Prefill/decode disaggregation`` section of docs/benchmarks.md.

    .venv/bin/python benchmarks/disaggregation.py [--decoders 4] [--long-prompts 8] [--long-rate 1] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.report import machine, write_section  # noqa: E402
from benchmarks.router import start, stop  # noqa: E402
from hyla.bench.datasets import random_sessions, random_text  # noqa: E402
from hyla.bench.metrics import latency_stats_ms, summarize  # noqa: E402
from hyla.bench.runner import run_benchmark  # noqa: E402

SETUPS = ("colocated", "disaggregated")
METRICS = ("decode ITL P50 (ms)", "decode ITL P99 (ms)", "decode ITL max (ms)", "decode stalls > 100 ms",
           "decode TPOT median (ms)", "long-prompt TTFT median (ms)",
           "long-prompt TTFT P90 (ms)", "output tok/s", "duration (s)")


async def _both(router: str, decoders, longs, model: str, rate: float):
    return await asyncio.gather(
        run_benchmark(router, decoders, backend="openai-chat", model=model, show_progress=False),
        run_benchmark(router, longs, backend="openai-chat", model=model, request_rate=rate, show_progress=False))


def one_round(router: str, workers: list[str], decoders, longs, model: str, rate: float) -> dict[str, float]:
    for w in workers:
        httpx.post(w + "/flush_cache", timeout=60).raise_for_status()
    t0 = time.perf_counter()
    (dec, _), (long, _) = asyncio.run(_both(router, decoders, longs, model, rate))
    duration = time.perf_counter() - t0
    d, g = summarize(dec, duration), summarize(long, duration)
    if d["failed"] or g["failed"]:
        raise RuntimeError(f"requests failed: {d['errors'] + g['errors']}")
    tpots = [r.tpot for r in dec if r.tpot is not None]
    gaps = [x for r in dec for x in r.itl]
    itl = latency_stats_ms(gaps)
    return {"decode ITL P50 (ms)": itl["p50"], "decode ITL P99 (ms)": itl["p99"], "decode ITL max (ms)": 1000 * max(gaps),
            "decode stalls > 100 ms": sum(g > 0.1 for g in gaps),
            "decode TPOT median (ms)": 1000 * statistics.median(tpots), "long-prompt TTFT median (ms)": g["ttft_ms"]["p50"],
            "long-prompt TTFT P90 (ms)": g["ttft_ms"]["p90"],
            "output tok/s": (d["total_output_tokens"] + g["total_output_tokens"]) / duration, "duration (s)": duration}


def _moved_bytes(router: str) -> float:
    for line in httpx.get(router + "/metrics").text.splitlines():
        if line.startswith("hyla_router_prefix_bytes_total"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def agent_turns(router: str, workers: list[str], model: str, turns: int, tool_words: int) -> list[str]:
    """One agent conversation through the disaggregated router (the module docstring): a table row per turn."""
    for w in workers:
        httpx.post(w + "/flush_cache", timeout=60).raise_for_status()
    rng = random.Random(3)
    messages = [{"role": "system", "content": "You are an agent. Read the tool results and act."},
                {"role": "user", "content": "Task: " + random_text(rng, tool_words)}]
    rows = []
    for turn in range(1, turns + 1):
        before = _moved_bytes(router)
        answer = httpx.post(router + "/v1/chat/completions", timeout=600, json={
            "model": model, "messages": messages, "max_tokens": 16, "temperature": 0}).json()
        moved = _moved_bytes(router) - before
        ids = httpx.post(workers[1] + "/tokenize", json={"messages": messages}).json()["tokens"]
        whole = len(httpx.post(workers[1] + "/export_prefix", json={"input_ids": ids}, timeout=600).content)
        usage = answer["usage"]
        rows.append(f"| {turn} | {usage['prompt_tokens']:,} | {usage['prompt_tokens_details']['cached_tokens']:,} | "
                    f"{moved / 2**20:.2f} | {whole / 2**20:.2f} | {moved / whole:.2f}x |")
        messages += [{"role": "assistant", "content": answer["choices"][0]["message"]["content"]},
                     {"role": "user", "content": "Tool result: " + random_text(rng, tool_words)}]
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu-threads", type=int, default=1, help="each worker's intra-op threads")
    ap.add_argument("--decoders", type=int, default=4)
    ap.add_argument("--decode-prompt", type=int, default=32, help="words")
    ap.add_argument("--decode-len", type=int, default=768, help="tokens")
    ap.add_argument("--long-prompts", type=int, default=8)
    ap.add_argument("--long-len", type=int, default=1500, help="words")
    ap.add_argument("--long-out", type=int, default=8, help="tokens")
    ap.add_argument("--long-rate", type=float, default=1.0, help="long prompts per second")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--agent-turns", type=int, default=4)
    ap.add_argument("--tool-words", type=int, default=500, help="words of each agent turn's tool result")
    ap.add_argument("--log-dir", type=Path, default=Path("/tmp/hyla-disagg-bench"))
    ap.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    args = ap.parse_args()
    args.log_dir.mkdir(parents=True, exist_ok=True)
    decoders = random_sessions(args.decoders, args.decode_prompt, args.decode_len, seed=1)
    longs = random_sessions(args.long_prompts, args.long_len, args.long_out, seed=2)
    procs: list[subprocess.Popen] = []
    try:
        workers = []
        for i in range(2):
            proc, url = start(["serve", "--cpu-threads", str(args.cpu_threads)], args.log_dir / f"worker{i}.log")
            procs.append(proc)
            workers.append(url)
        routers = {}
        for setup, extra in (("colocated", ["--worker-urls", *workers]),
                             ("disaggregated", ["--worker-urls", workers[0], "--prefill-urls", workers[1]])):
            proc, routers[setup] = start(["route", *extra], args.log_dir / f"{setup}.log")
            procs.append(proc)
        model = httpx.get(workers[0] + "/v1/models").json()["data"][0]["id"]
        runs: dict[str, list[dict[str, float]]] = {s: [] for s in SETUPS}
        for rep in range(1 + args.repeats):
            for setup in SETUPS:
                res = one_round(routers[setup], workers, decoders, longs, model, args.long_rate)
                if rep:
                    runs[setup].append(res)
                    print(f"repeat {rep}, {setup}: " + ", ".join(f"{k} {v:,.1f}" for k, v in res.items()), flush=True)
        agent = agent_turns(routers["disaggregated"], workers, model, args.agent_turns, args.tool_words)
    finally:
        stop(procs)
    med = {s: {k: statistics.median(r[k] for r in rs) for k in METRICS} for s, rs in runs.items()}
    base = med["colocated"]
    rows = [f"| {k} | {base[k]:,.1f} | {med['disaggregated'][k]:,.1f}" + (f" ({med['disaggregated'][k] / base[k]:.2f}x) |" if base[k] else " |")
            for k in METRICS]
    command = (f".venv/bin/python benchmarks/disaggregation.py --cpu-threads {args.cpu_threads} --decoders "
               f"{args.decoders} --decode-prompt {args.decode_prompt} --decode-len {args.decode_len} --long-prompts "
               f"{args.long_prompts} --long-len {args.long_len} --long-out {args.long_out} --long-rate {args.long_rate} "
               f"--repeats {args.repeats} --agent-turns {args.agent_turns} --tool-words {args.tool_words}")
    body = "\n".join([
        f"`{command}` — {machine()}; two `hyla serve` workers of the built-in default model ({args.cpu_threads} "
        f"intra-op thread(s) each) behind `hyla route`: colocated (either worker prefills and decodes) against "
        f"disaggregated (one prefills, `--prefill-urls`, the other decodes). Each round: {args.decoders} streams of "
        f"~{args.decode_prompt}-word prompts decoding {args.decode_len} tokens, sent at once, while "
        f"{args.long_prompts} prompts of ~{args.long_len} words ({args.long_out} tokens out) arrive at "
        f"{args.long_rate:g}/s; caches flushed before each round; medians of {args.repeats} rounds, the setups "
        "interleaved; in parentheses the ratio to colocated.",
        "",
        "| measurement | colocated | disaggregated |",
        "|---|---|---|",
        *rows,
        "",
        f"An agent's conversation through the disaggregated router: each turn adds the model's reply (16 tokens) "
        f"and a tool result of ~{args.tool_words} words, so each moves from the prefill worker; the prefix's bytes "
        "the router moved, against the whole prefix's (the prefill worker's `/export_prefix` of the same prompt).",
        "",
        "| turn | prompt tokens | cached on the decode worker | MiB moved | MiB of the whole prefix | moved / whole |",
        "|---|---|---|---|---|---|",
        *agent,
    ])
    print(body)
    if not args.no_write:
        write_section("Prefill/decode disaggregation", body)


if __name__ == "__main__":
    main()
