"""Cache under pressure (issue: cache under pressure), written to ``## Cache under pressure``.

Concurrent multi-turn sessions on pools sized to force eviction and retraction. Turn ``t + 1`` of
a session is its turn-``t`` prompt + output + a new user message, so ideally it hits everything
the previous turn fed: ``prompt + output - 1`` tokens (the last output token is never fed),
rounded down to the checkpoint grid. Reported: cached tokens as a share of that ideal, summed
over every turn after the first, per configuration (page 1 / 16, alignment 1 / 64, two
architectures), and the lost share ``1 - cached / ideal``.

Outputs are checked too: every configuration's greedy tokens must equal a cache-off run's.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/cache_pressure.py [--compare-with /path/to/old/checkout]

``--compare-with`` runs the same workload on another checkout's ``hyla`` (a subprocess with that
tree first on ``sys.path``), e.g. a ``git worktree`` of the commit before a change: before/after
in one run.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

CONFIGS = [  # (name, engine options)
    ("page 1", dict(page_size=1)),
    ("page 16", dict(page_size=16)),
    ("page 1, alignment 64", dict(page_size=1, checkpoint_alignment=64)),
]
ARCHS = ("qwen3_next", "nemotron_h")
POOLS = dict(max_total_tokens=1536, max_state_slots=14, max_running_requests=6, chunked_prefill_size=256)


def workload(seed: int, num_sessions: int = 8, num_turns: int = 4) -> tuple[list[list[int]], list[list[list[int]]], list[int]]:
    rng = random.Random(seed)
    tok = lambda n: [rng.randrange(3, 2048) for _ in range(n)]  # noqa: E731
    system = tok(40)
    firsts = [system + tok(rng.randrange(20, 120)) for _ in range(num_sessions)]
    users = [[tok(rng.randrange(10, 60)) for _ in range(num_turns)] for _ in range(num_sessions)]
    max_new = [rng.randrange(8, 40) for _ in range(num_sessions)]
    return firsts, users, max_new


def run_sessions(engine, firsts, users, max_new, grid: int) -> tuple[int, int, list[list[int]]]:
    """All sessions' turn t submitted together; returns (cached, ideal, outputs)."""
    prompts = [list(p) for p in firsts]
    cached = ideal = 0
    outputs: list[list[int]] = []
    for t in range(len(users[0])):
        params = [{"temperature": 0, "max_new_tokens": m, "ignore_eos": True} for m in max_new]
        outs = engine.generate(input_ids=prompts, sampling_params=params)
        for i, o in enumerate(outs):
            outputs.append(o["output_ids"])
            if t > 0:
                cached += o["meta_info"]["cached_tokens"]
                ideal += prev_fed[i] - prev_fed[i] % grid
        prev_fed = [len(p) + len(o["output_ids"]) - 1 for p, o in zip(prompts, outs)]
        prompts = [p + o["output_ids"] + users[i][t] for i, (p, o) in enumerate(zip(prompts, outs))]
    return cached, ideal, outputs


def measure(ckpt_dir: Path) -> dict[str, dict[str, float]]:
    import math

    import checkpoints
    from hyla import Engine

    paths = {"qwen3_next": checkpoints.make_qwen3_next(ckpt_dir, moe=False),
             "nemotron_h": checkpoints.make_nemotron_h(ckpt_dir)}
    results: dict[str, dict[str, float]] = {}
    for arch in ARCHS:
        firsts, users, max_new = workload(seed=7)
        with Engine(paths[arch], enable_prefix_cache=False, **POOLS) as off:
            _, _, want = run_sessions(off, firsts, users, max_new, 1)
        for name, opts in CONFIGS:
            grid = math.lcm(opts.get("page_size", 1), opts.get("checkpoint_alignment", 1))
            with Engine(paths[arch], **POOLS, **opts) as eng:
                cached, ideal, got = run_sessions(eng, firsts, users, max_new, grid)
                stats = eng.get_stats()
            same = sum(a == b for a, b in zip(got, want)) / len(want)
            results[f"{arch}, {name}"] = {"cached": cached, "ideal": ideal, "share": cached / max(1, ideal),
                                          "same_outputs": same, "retractions": stats["num_retractions"],
                                          "evicted_states": stats["num_evicted_states"]}
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--compare-with", type=Path, help="another checkout's root: measure it too (before)")
    ap.add_argument("--json", action="store_true", help="print only the results as JSON (used by --compare-with)")
    ap.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    args = ap.parse_args()
    ckpt_dir = Path(tempfile.gettempdir()) / "hyla-bench-ckpts"
    after = measure(ckpt_dir)
    if args.json:
        print(json.dumps(after))
        return
    before = None
    if args.compare_with is not None:
        env = dict(os.environ, PYTHONPATH=str(args.compare_with.resolve()))
        out = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--json"], env=env, check=True,
                             capture_output=True, text=True, cwd=args.compare_with).stdout
        before = json.loads(out.strip().splitlines()[-1])
    sys.path.insert(0, str(ROOT))
    from benchmarks.report import machine, write_section

    head = "| configuration | cached / ideal (after) | lost (after) |"
    sep = "|---|---|---|"
    if before is not None:
        head += " cached / ideal (before) | lost (before) | lost share cut |"
        sep += "---|---|---|"
    rows = [head, sep]
    for key, r in after.items():
        row = f"| {key} | {r['cached']} / {r['ideal']} | {100 * (1 - r['share']):.1f}% |"
        if before is not None:
            b = before[key]
            lost_a, lost_b = 1 - r["share"], 1 - b["share"]
            cut = f"{lost_b / lost_a:.1f}x" if lost_a > 0 else "all"
            row += f" {b['cached']} / {b['ideal']} | {100 * lost_b:.1f}% | {cut} |"
        rows.append(row)
        if r["same_outputs"] != 1.0:
            raise SystemExit(f"{key}: outputs differ from the cache-off run ({r['same_outputs']:.2%} equal)")
    cmd = "OMP_NUM_THREADS=1 .venv/bin/python benchmarks/cache_pressure.py" + (
        " --compare-with <checkout of the commit before>" if before is not None else "")
    body = (f"`{cmd}` — {machine()}; tiny test checkpoints (fp32), 8 concurrent sessions × 4 turns, pools "
            f"{POOLS}. Ideal = each turn hits the previous turn's prompt + output − 1, rounded down to the grid. "
            "Every configuration's greedy outputs equal the cache-off run's.\n\n" + "\n".join(rows))
    print(body)
    if not args.no_write:
        write_section("Cache under pressure", body)


if __name__ == "__main__":
    main()
