"""Priority scheduling (``enable_priority_scheduling``): interactive requests arriving while a batch
job fills the engine.

``--batch`` requests (priority 0; ``--batch-prompt`` fresh tokens, ``--batch-tokens`` greedy new
tokens each) are submitted together on an engine of ``--running`` running slots, so most of them
queue. Once all the slots decode, ``--interactive`` requests (priority ``--priority``;
``--prompt`` tokens, ``--new-tokens`` new) arrive one every ``--interval`` ms. Measured:

* **interactive TTFT** and **interactive latency** (arrival to last token), medians over the
  interactive requests: without priority scheduling they queue behind the batch (the policy's
  order); with it they are admitted first, preempting batch requests when no slot is free;
* **batch time**: from the batch's submission until its last request finishes (what the
  preemptions cost it: its preempted requests resume from the prefix cache);
* **preemptions** (``get_stats()["num_preemptions"]``).

Priority scheduling off and on alternate in one process (two engines, the same prompts); medians of
``--repeats``. Prints a markdown table and writes the ``## Priority scheduling`` section of
docs/benchmarks.md.

    .venv/bin/python benchmarks/priority.py [--repeats 5] [--batch 64] [--running 16] [--interactive 8]
    .venv/bin/python benchmarks/priority.py --tiny --repeats 1 --batch 8 --running 4 --no-write   # smoke
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.report import machine, off_on, off_on_rows, write_section  # noqa: E402
from benchmarks.startup import add_model_arguments, model_dir, model_flags, resolve_dtype  # noqa: E402
from hyla import Engine  # noqa: E402

METRICS = ("interactive TTFT (ms)", "interactive latency (ms)", "batch time (s)", "preemptions")
DIGITS = {"batch time (s)": 2}  # decimals in the table (else 1)


def measure(engine: Engine, rng: random.Random, args: argparse.Namespace, priority: int) -> dict[str, float]:
    """One round on ``engine``: the batch, then the interactive requests at ``priority`` (0 on an
    engine without priority scheduling) once every running slot decodes."""
    vocab = engine.model_config.vocab_size
    fresh = lambda n: [rng.randrange(3, vocab) for _ in range(n)]  # noqa: E731
    before = engine.get_stats()["num_preemptions"]
    batch_done: list[float] = []

    def run_batch() -> None:
        engine.generate(input_ids=[fresh(args.batch_prompt) for _ in range(args.batch)],
                        sampling_params={"temperature": 0, "ignore_eos": True, "max_new_tokens": args.batch_tokens})
        batch_done.append(time.perf_counter())

    prompts = [fresh(args.prompt) for _ in range(args.interactive)]
    t_batch = time.perf_counter()
    batch = threading.Thread(target=run_batch)
    batch.start()
    sched = engine.scheduler
    while not (len(sched.running) == args.running and all(r.output_ids for r in list(sched.running))):
        if not batch.is_alive():
            raise RuntimeError("the batch finished before it filled the running slots: raise --batch-tokens")
        time.sleep(0.001)
    ttfts, latencies = [], []
    lock = threading.Lock()

    def interactive(ids: list[int]) -> None:
        t0 = time.perf_counter()
        first = None
        for _ in engine.generate(input_ids=ids, stream=True, priority=priority,
                                 sampling_params={"temperature": 0, "ignore_eos": True, "max_new_tokens": args.new_tokens}):
            first = first or time.perf_counter()
        with lock:
            ttfts.append(first - t0)
            latencies.append(time.perf_counter() - t0)

    threads = []
    for ids in prompts:
        threads.append(threading.Thread(target=interactive, args=(ids,)))
        threads[-1].start()
        time.sleep(args.interval / 1e3)
    for t in threads:
        t.join()
    batch.join()
    if not batch_done:
        raise RuntimeError("the batch did not finish")
    if len(ttfts) != args.interactive:
        raise RuntimeError("an interactive request failed")
    return {"interactive TTFT (ms)": 1e3 * statistics.median(ttfts),
            "interactive latency (ms)": 1e3 * statistics.median(latencies),
            "batch time (s)": batch_done[0] - t_batch,
            "preemptions": engine.get_stats()["num_preemptions"] - before}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(ap)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--batch", type=int, default=64, help="batch requests (priority 0), submitted together")
    ap.add_argument("--batch-prompt", type=int, default=256)
    ap.add_argument("--batch-tokens", type=int, default=128, help="each batch request's new tokens")
    ap.add_argument("--running", type=int, default=16, help="max_running_requests")
    ap.add_argument("--interactive", type=int, default=8, help="interactive requests, one every --interval ms")
    ap.add_argument("--interval", type=float, default=50.0)
    ap.add_argument("--prompt", type=int, default=256, help="an interactive request's prompt tokens")
    ap.add_argument("--new-tokens", type=int, default=32, help="an interactive request's new tokens")
    ap.add_argument("--priority", type=int, default=20, help="the interactive requests' priority (the batch's: 0)")
    ap.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    args = ap.parse_args()
    resolve_dtype(args)
    if args.batch <= args.running:
        ap.error("--batch must exceed --running (the batch fills the slots and queues)")

    with tempfile.TemporaryDirectory(prefix="hyla-priority-") as tmp:
        path, model = model_dir(args, Path(tmp))
        tokens = args.batch * (args.batch_prompt + args.batch_tokens) + args.interactive * (args.prompt + args.new_tokens)
        opts = dict(device=args.device, dtype=args.dtype, warmup="off", max_running_requests=args.running,
                    max_total_tokens=tokens + 4096, max_state_slots=4 * (args.batch + args.interactive),
                    context_length=max(args.batch_prompt + args.batch_tokens, args.prompt + args.new_tokens) + 64)
        engines = {mode: Engine(path, enable_priority_scheduling=mode == "on", **opts) for mode in ("off", "on")}

        def round_(mode: str, engine: Engine, rep: int) -> dict[str, float]:
            res = measure(engine, random.Random(rep), args, args.priority if mode == "on" else 0)
            engine.wait_idle()
            engine.flush_cache()  # each round starts cold: the same work on both engines
            return res

        med = off_on(engines, args.repeats, round_, "priority scheduling")
    rows = off_on_rows(med, METRICS, DIGITS)
    body = f"""`.venv/bin/python benchmarks/priority.py {model_flags(args)} --repeats {args.repeats} --batch {args.batch} --running {args.running} --interactive {args.interactive} --interval {args.interval:g}` — {machine()}; {model}, {args.dtype}; a batch of {args.batch} requests ({args.batch_prompt} prompt tokens, {args.batch_tokens} new, priority 0) on {args.running} running slots, then {args.interactive} interactive requests ({args.prompt} prompt tokens, {args.new_tokens} new; priority {args.priority} with priority scheduling on) one every {args.interval:g} ms once every slot decodes; medians of {args.repeats} rounds (interactive: the median request of each round), greedy.

| | priority scheduling off | on | on / off |
|---|---|---|---|
{rows}
"""
    print(body)
    if not args.no_write:
        write_section("Priority scheduling", body)


if __name__ == "__main__":
    main()
