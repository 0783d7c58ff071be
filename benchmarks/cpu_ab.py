"""Interleaved A/B of two checkouts on CPU: the engine's decode speed, before vs after a change.

``cpu_decode.py --before DIR`` measures the other checkout in its own process first, minutes apart;
on this shared machine that moved the same checkout between 246 and 396 tok/s in two runs. Here
each checkout runs in a worker process of its own (its ``hyla`` on ``sys.path``; the built-in
default model unless ``--model-dir``, e.g. ``cpu_model_size.py``'s 0.65 B model; fp32, 1 thread
unless ``--threads``, ``compile_decode`` unless ``--eager``), both started before any
timing, and the driver asks them in turn, round by round (the order alternating), for one
measurement each:

* ``b1``: decode tok/s of one request after a 512-token prompt, ``N / (t(1 + N) - t(1))``
  (``N = --new-tokens``), as cpu_decode.py's batch-1 row;
* ``b8``: output tok/s of 8 concurrent 128 → 64 requests, as cpu_decode.py's 8-request row;
* ``p8``: prefill tok/s of the same 8 fresh 128-token prompts (one ``generate`` of one new token each),
  over the worker's process CPU time (the scheduler thread's included), which a busy machine
  inflates less than wall time; every intra-op thread's CPU time counts (spinning included), so it
  compares checkouts at one thread count, not thread counts (``--threads``: ``b1``, ``b8``).

Prints each side's runs and the per-round ratio after / before with its median (round 0 is a
warm-up, not counted). Nothing is written to docs/benchmarks.md: quote the ratios.

    git worktree add /tmp/cpu-base <rev>
    .venv/bin/python benchmarks/cpu_ab.py /tmp/cpu-base . [--rounds 25] [--eager] [--small] [--workloads b1,b8,p8]
        [--threads 1,1] [--model-dir DIR] [--new-tokens 128]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

WORKLOADS = ("b1", "b8", "p8")
NEW_1 = 128  # cpu_decode.py's default --new-tokens


def worker(root: Path, compiled: bool, small: bool = False, threads: int = 1, model_dir: str | None = None,
           new_1: int = NEW_1) -> None:
    """Serve measurements over stdin/stdout for the checkout at ``root`` (``small``: a smoke run's
    workloads, a tenth of the tokens). The workloads are cpu_decode.py's (its constants and helpers,
    from this checkout: imported before ``root`` goes on the path)."""
    from cpu_decode import (BATCH, NEW_8, PROMPT_1, PROMPT_8, concurrent_output, decode_after_prompt, fresh, greedy,
                            require_start_up_graphs, thread_option)

    sys.path.insert(0, str(root))
    import torch

    from hyla import Engine
    from hyla.engine.engine import DEFAULT_MODEL_DIR

    torch.set_num_threads(threads)
    engine = Engine(model_dir or DEFAULT_MODEL_DIR, dtype="float32", compile_decode=compiled, max_total_tokens=32768,
                    max_state_slots=64, **thread_option(threads))
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size
    scale = 10 if small else 1
    prompt_1, new_1, prompt_8, new_8 = PROMPT_1 // scale, new_1 // scale, PROMPT_8 // scale, NEW_8 // scale

    print("READY", flush=True)
    for line in sys.stdin:
        what = line.strip()
        if what == "b1":
            value = decode_after_prompt(engine, rng, vocab, prompt_1, new_1)[1]
        elif what == "b8":
            value = concurrent_output(engine, rng, vocab, prompt_8, new_8)
        elif what == "p8":
            prompts = [fresh(prompt_8, rng, vocab) for _ in range(BATCH)]
            t0 = time.process_time()
            engine.generate(input_ids=prompts, sampling_params=greedy(1))
            value = BATCH * prompt_8 / (time.process_time() - t0)
        else:
            break
        require_start_up_graphs(engine, what)
        print(json.dumps(value), flush=True)
    engine.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("before", type=Path, help="the checkout to compare against (e.g. a git worktree)")
    ap.add_argument("after", type=Path, help="the checkout with the change")
    ap.add_argument("--rounds", type=int, default=25)
    ap.add_argument("--eager", action="store_true", help="eager decode on both sides (default: compile_decode)")
    ap.add_argument("--small", action="store_true", help="a smoke run: a tenth of the tokens (numbers meaningless)")
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated, of %(default)s")
    ap.add_argument("--threads", default="1,1", help="torch intra-op threads of the before and after workers "
                                                     "(e.g. 2,1 with the same checkout twice: what a thread count buys)")
    ap.add_argument("--model-dir", help="the checkpoint both workers serve (default: the built-in model); e.g. "
                                        "cpu_model_size.py's 0.65 B model")
    ap.add_argument("--new-tokens", type=int, default=NEW_1, help="tokens decoded in b1 (default %(default)s)")
    ap.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--worker-threads", type=int, default=1, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker is not None:
        return worker(args.worker, not args.eager, args.small, args.worker_threads, args.model_dir, args.new_tokens)
    workloads = [w for w in args.workloads.split(",") if w]
    if not workloads or set(workloads) - set(WORKLOADS):
        ap.error(f"--workloads: a comma-separated list of {', '.join(WORKLOADS)}")
    threads = args.threads.split(",")
    if len(threads) != 2 or not all(t.isdigit() and int(t) > 0 for t in threads):
        ap.error("--threads: two positive integers, BEFORE,AFTER")
    cmd = [sys.executable, __file__, str(args.before), str(args.after)] + (["--eager"] if args.eager else []) \
        + (["--small"] if args.small else []) + ["--new-tokens", str(args.new_tokens)] \
        + (["--model-dir", str(Path(args.model_dir).resolve())] if args.model_dir else [])
    sides = {name: subprocess.Popen(cmd + ["--worker", str(root.resolve()), "--worker-threads", t],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                    text=True, env=dict(os.environ, OMP_NUM_THREADS=t))
             for name, root, t in (("before", args.before, threads[0]), ("after", args.after, threads[1]))}
    for p in sides.values():
        while (line := p.stdout.readline()) and line.strip() != "READY":
            pass
        if not line:
            raise SystemExit("a worker failed to start (run it alone: --worker ROOT)")
    runs = {(name, w): [] for name in sides for w in workloads}
    for r in range(args.rounds + 1):
        for w in workloads:
            for name in (list(sides) if r % 2 else list(sides)[::-1]):
                sides[name].stdin.write(w + "\n")
                sides[name].stdin.flush()
                value = json.loads(sides[name].stdout.readline())
                if r:
                    runs[(name, w)].append(value)
    for p in sides.values():
        p.stdin.write("quit\n")
        p.stdin.flush()
        p.wait()
    for w in workloads:
        a, b = runs[("before", w)], runs[("after", w)]
        ratios = [y / x for x, y in zip(a, b)]
        print(f"{w}: before {statistics.median(a):.0f} tok/s, after {statistics.median(b):.0f} tok/s; "
              f"after / before per round: median {statistics.median(ratios):.3f} "
              f"(range {min(ratios):.3f}-{max(ratios):.3f}, {len(ratios)} rounds)")


if __name__ == "__main__":
    main()
