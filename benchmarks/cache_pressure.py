"""Cache under pressure (issue: cache under pressure), written to ``## Cache under pressure``.

Concurrent multi-turn sessions on pools sized to force eviction, over several workload seeds (one
run's figures swing with small changes of timing). Turn ``t + 1`` of a session is
its turn-``t`` prompt + output + a new user message, so ideally it hits everything the previous
turn fed: ``prompt + output - 1`` tokens (the last output token is never fed), rounded down to
the checkpoint grid. Reported per configuration (page 1 / 16, alignment 1 / 64, two
architectures), summed over every turn after the first:

* cached tokens as a share of that ideal, and the lost share ``1 - cached / ideal``;
* a capacity-aware bound: the most any eviction order could have kept, given this run's schedule
  (see ``capacity_bound``), and cached tokens as a share of it;
* where every lost token went (``hyla.cache.ledger``): the previous turn's KV evicted (and what
  needed the room), its KV there but the checkpoint evicted (which kind, and for what), no room
  for a checkpoint that was wanted, no checkpoint taken there, never cached;
* retractions, and the tokens re-admissions after them prefilled again (their own cost, not part
  of the lost share: the hit of a request is counted at its first admission);
* what the run cost: scheduler steps (fewer requests at once take more) and prompt tokens computed
  (``--timing ROUNDS`` instead times the cached runs with ``protect_waiting_prefixes`` on and off).

``--replay`` runs the same workload through the engine's scheduler and cache manager without a
model (``hyla.sim.replay``) and prints each configuration's lost share and steps in seconds, with
``--options`` (JSON) for more engine options: the quick loop for trying a rule or a pool size.

Every configuration is fed the same prompts — built from a cache-off run's outputs — and its
greedy outputs must equal the cache-off run's up to each request's first floating-point tie
(``tests/test_engine_differential.py: compare_outputs``).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/cache_pressure.py [--compare-with /path/to/old/checkout ...] [--seeds 1,2,3]
        [--kv-tokens 1536] [--max-running 6] [--archs qwen3_next,nemotron_h] [--timing ROUNDS | --replay [--options JSON]]
        [--sessions 8] [--turns 4]

``--kv-tokens`` / ``--max-running`` change the pools of ``POOLS``; a run with other pools writes its own
section (``Cache under pressure, 2048 KV tokens``). ``--sessions`` / ``--turns`` shrink the workload
(the tests' quick run, with a pool shrunk to match); another workload too writes its own section.

``--compare-with`` (repeatable) runs the same workload on another checkout's ``hyla`` (a
subprocess with that tree first on ``sys.path``), e.g. ``git worktree add /tmp/d59eaa7 d59eaa7``:
before/after in one run, labelled by the checkout's directory name (without a ledger there, the
decomposition and the bound are reported for this checkout only).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

CONFIGS = [  # (name, engine options)
    ("page 1", dict(page_size=1)),
    ("page 16", dict(page_size=16)),
    ("page 1, alignment 64", dict(page_size=1, checkpoint_alignment=64)),
]
ARCHS = ("qwen3_next", "nemotron_h")
POOLS = dict(max_total_tokens=1536, max_state_slots=14, max_running_requests=6, chunked_prefill_size=256)
POOL_FLAGS = (("kv-tokens", "max_total_tokens"), ("max-running", "max_running_requests"))  # settable per run
SYSTEM_PROMPT = 40  # tokens every session starts with
CATEGORIES = ("KV evicted", "checkpoint evicted", "no room for a checkpoint", "no checkpoint taken",
              "off the checkpoint grid", "never cached")
DEFAULT_SEEDS = [1, 2, 3, 4, 5, 6, 7]
SESSIONS, TURNS = 8, 4  # concurrent sessions, turns each (--sessions, --turns)


def workload(seed: int, num_sessions: int = SESSIONS, num_turns: int = TURNS) -> tuple[list[list[int]], list[list[list[int]]], list[int]]:
    """First prompts (a shared system prompt + a user message), later user messages, output lengths."""
    rng = random.Random(seed)
    tok = lambda n: [rng.randrange(3, 2048) for _ in range(n)]  # noqa: E731
    system = tok(SYSTEM_PROMPT)
    firsts = [system + tok(rng.randrange(20, 120)) for _ in range(num_sessions)]
    users = [[tok(rng.randrange(10, 60)) for _ in range(num_turns)] for _ in range(num_sessions)]
    max_new = [rng.randrange(8, 40) for _ in range(num_sessions)]
    return firsts, users, max_new


def run_turn(engine, prompts: list[list[int]], max_new: list[int]) -> list[dict]:
    """One turn: every session's request submitted together (greedy, fixed output lengths)."""
    params = [{"temperature": 0, "max_new_tokens": m, "ignore_eos": True} for m in max_new]
    return engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True)


def reference(engine, firsts, users, max_new) -> tuple[list[list[list[int]]], list[list[dict]]]:
    """The cache-off run: each turn's prompts (turn t + 1 = turn t's prompt + output + the next
    user message) and outputs. Every configuration is then fed these same prompts."""
    prompts, outputs = [list(map(list, firsts))], []
    for t in range(len(users[0])):
        outs = run_turn(engine, prompts[t], max_new)
        outputs.append(outs)
        if t + 1 < len(users[0]):
            prompts.append(next_turn(prompts[t], [o["output_ids"] for o in outs], users, t))
    return prompts, outputs


def next_turn(prompts: list[list[int]], outputs: list[list[int]], users: list[list[list[int]]], t: int) -> list[list[int]]:
    """Turn ``t + 1``'s prompts: each session's turn-``t`` prompt + its output + its next user message."""
    return [p + o + u[t] for p, o, u in zip(prompts, outputs, users)]


def as_trace(prompts: list[list[list[int]]], outputs: list[list[list[int]]]) -> list:
    """The run's requests as a ``hyla sim`` trace: turn ``t`` of session ``i`` at time ``t``."""
    from hyla.sim.trace import TraceRequest

    return [TraceRequest(session_id=i, turn_id=t, ts=float(t), input_tokens=p, output_tokens=o)
            for t, (ps, os_) in enumerate(zip(prompts, outputs)) for i, (p, o) in enumerate(zip(ps, os_))]


def wanted_hits(fed: list[list[int]], grid: int) -> list[list[int]]:
    """The ideal hit of every turn's request: none for the first turn, then the previous turn's
    fed tokens (prompt + output - 1) rounded down to the checkpoint grid."""
    return [[0] * len(fed[0])] + [[f - f % grid for f in fs] for fs in fed[:-1]]


def capacity_bound(ledger, kv_size: int, rids: list[list[str]], wanted: list[list[int]], shared: list[list[int]]) -> int:
    """The most cached tokens any eviction order could have served, given this run's schedule.

    Session ``i``'s turn ``t + 1`` can hit beyond the shared system prompt (``shared[t][i]``
    tokens, held once for all) only what the tree kept of its own previous turn from that turn's
    release to this turn's admission. Meanwhile the running requests hold ``held(τ)`` KV slots
    (ledger samples after every allocation), so what all waiting sessions keep at ``τ`` is at most
    ``kv_size - held(τ)`` (less the system prompt while nothing runs). Maximizing the kept tokens
    under those interval constraints, each session keeping any prefix of its history (as if a
    checkpoint were wherever needed; state slots ignored), is solved by earliest-admission-first
    greedy. A bound, not a policy: it knows the future and ignores the state pool and pages.
    """
    cap = {time: kv_size - held - (SYSTEM_PROMPT if running == 0 else 0) for time, held, running in ledger.usage}
    items = []  # (admission time, previous release, keepable tokens, shared tokens)
    for t in range(1, len(rids)):
        for i, rid in enumerate(rids[t]):
            items.append((ledger.admissions[rid][0].time, ledger.releases[rids[t - 1][i]][-1],
                          wanted[t][i] - shared[t][i], shared[t][i]))
    bound = 0
    for admitted, released, keepable, free in sorted(items):
        window = [time for time in cap if released < time < admitted]
        kept = max(0, min([keepable] + [cap[time] for time in window]))
        for time in window:
            cap[time] -= kept
        bound += free + kept
    return bound


def simulator_agrees(path: Path, prompts: list[list[list[int]]], got: list[list[dict]], opts: dict,
                     pools: dict) -> bool | None:
    """Whether ``hyla sim``'s engine replay (``hyla.sim.replay``) of this run's requests — the same
    prompts, outputs and options, on accounting pools — reports every request's cached tokens as the
    engine did. None where the checkout has no replay."""
    try:
        from hyla.sim.models import resolve_model
        from hyla.sim.replay import replay_engine
    except ImportError:
        return None
    trace = as_trace(prompts, [[o["output_ids"] for o in outs] for outs in got])
    replay = replay_engine(trace, resolve_model(str(path)).layout, **pools, **opts)
    return replay.cached_tokens == [o["meta_info"]["cached_tokens"] for outs in got for o in outs]


def measure(ckpt_dir: Path, seeds: list[int], pools: dict, archs: tuple[str, ...] = ARCHS, sessions: int = SESSIONS,
            turns: int = TURNS) -> dict[str, dict[str, Any]]:
    """Per configuration, summed over the workload seeds."""
    import checkpoints
    from test_engine_differential import compare_outputs

    from hyla import Engine

    paths = {"qwen3_next": checkpoints.make_qwen3_next(ckpt_dir, moe=False),
             "nemotron_h": checkpoints.make_nemotron_h(ckpt_dir)}
    results: dict[str, dict[str, Any]] = {}
    for arch in archs:
        for seed in seeds:
            firsts, users, max_new = workload(seed, sessions, turns)
            with Engine(paths[arch], enable_prefix_cache=False, **pools) as off:
                prompts, want = reference(off, firsts, users, max_new)
            fed = [[len(p) + len(o["output_ids"]) - 1 for p, o in zip(ps, outs)] for ps, outs in zip(prompts, want)]
            for name, opts in CONFIGS:
                grid = math.lcm(opts.get("page_size", 1), opts.get("checkpoint_alignment", 1))
                wanted = wanted_hits(fed, grid)
                shared = [[min(w, SYSTEM_PROMPT - SYSTEM_PROMPT % grid) for w in ws] for ws in wanted]
                with Engine(paths[arch], **pools, **opts) as eng:
                    ledger = eng.record_cache_events() if hasattr(eng, "record_cache_events") else None
                    got = [run_turn(eng, prompts[t], max_new) for t in range(len(prompts))]
                    stats = eng.get_stats()
                    kv_size = eng.kv_pool.size
                    steps = eng.scheduler.num_steps
                try:
                    compared = compare_outputs([o for outs in got for o in outs], [o for outs in want for o in outs])
                except AssertionError as e:
                    raise SystemExit(f"{arch}, {name}, seed {seed}: outputs differ from the cache-off run: {e}") from None
                cached = sum(o["meta_info"]["cached_tokens"] for outs in got[1:] for o in outs)
                ideal = sum(map(sum, wanted))
                r = results.setdefault(f"{arch}, {name}", {
                    "cached": 0, "ideal": 0, "lost_by_seed": [], "compared_tokens": 0, "retractions": 0,
                    "history_tokens": [], "kv_pool": kv_size, "steps": 0, "prefilled": 0})
                r["cached"] += cached
                r["ideal"] += ideal
                agrees = simulator_agrees(paths[arch], prompts, got, opts, pools)
                if agrees is not None:
                    r["sim_disagreements"] = r.get("sim_disagreements", 0) + (not agrees)
                r["lost_by_seed"].append(1 - cached / max(1, ideal))
                r["compared_tokens"] += compared
                r["retractions"] += stats["num_retractions"]
                r["steps"] += steps
                r["prefilled"] += stats["num_prompt_tokens"] - stats["num_cached_tokens"]  # at first admissions
                r["history_tokens"].append(max(sum(f) for f in fed[:-1]))  # what later turns want kept
                if ledger is not None:
                    rids = [[o["meta_info"]["id"] for o in outs] for outs in got]
                    lost = Counter({tuple(k): n for *k, n in r.get("lost", [])})
                    for t in range(1, len(got)):
                        for rid, w in zip(rids[t], wanted[t]):
                            lost.update(ledger.explain(rid, w, grid))
                    r["lost"] = [[cat, detail, n] for (cat, detail), n in lost.most_common()]
                    r["bound"] = r.get("bound", 0) + capacity_bound(ledger, kv_size, rids, wanted, shared)
                    r["recomputed"] = r.get("recomputed", 0) + sum(ledger.recomputed(k) for turn in rids for k in turn)
        for name, _ in CONFIGS:
            r = results[f"{arch}, {name}"]
            r["share"] = r["cached"] / max(1, r["ideal"])
            if "lost" in r:
                assert sum(n for *_, n in r["lost"]) == r["ideal"] - r["cached"], "the ledger's attribution must add up"
    return results


def timing(ckpt_dir: Path, seeds: list[int], pools: dict, rounds: int, sessions: int = SESSIONS,
           turns: int = TURNS) -> dict[bool, list[float]]:
    """Wall time of the cached runs (every turn of every seed; qwen3_next, page 1) with
    ``protect_waiting_prefixes`` on and off, the two interleaved round by round (the order
    alternating), each from a fresh engine; the prompts are the cache-off runs'."""
    import time

    import checkpoints

    from hyla import Engine

    path = checkpoints.make_qwen3_next(ckpt_dir, moe=False)
    workloads = []
    for seed in seeds:
        firsts, users, max_new = workload(seed, sessions, turns)
        with Engine(path, enable_prefix_cache=False, **pools) as off:
            workloads.append((reference(off, firsts, users, max_new)[0], max_new))
    times: dict[bool, list[float]] = {True: [], False: []}
    for i in range(rounds):
        for protect in (True, False) if i % 2 == 0 else (False, True):
            total = 0.0
            for prompts, max_new in workloads:
                with Engine(path, protect_waiting_prefixes=protect, **pools) as eng:
                    start = time.perf_counter()
                    for turn in prompts:
                        run_turn(eng, turn, max_new)
                    total += time.perf_counter() - start
            times[protect].append(total)
    return times


def replay(ckpt_dir: Path, seeds: list[int], pools: dict, options: dict, sessions: int = SESSIONS,
           turns: int = TURNS) -> dict[str, dict[str, float]]:
    """The workload replayed through the engine's own scheduler and cache manager without a model
    (``hyla.sim.replay``: what ``hyla sim --engine`` runs), in seconds: outputs of the workload's
    lengths made of random tokens (only lengths and distinct histories matter to the cache). Per
    configuration, summed over the seeds: the lost share and the scheduler steps, with the engine
    ``options`` given. One layout serves both architectures (the pools count tokens and slots).
    For trying rules and pool sizes; the section reports the engine's own runs."""
    import checkpoints

    from hyla.sim.models import resolve_model
    from hyla.sim.replay import replay_engine

    layout = resolve_model(str(checkpoints.make_qwen3_next(ckpt_dir, moe=False))).layout
    results = {}
    for name, opts in CONFIGS:
        grid = math.lcm(opts.get("page_size", 1), opts.get("checkpoint_alignment", 1))
        cached = ideal = steps = 0
        for seed in seeds:
            firsts, users, max_new = workload(seed, sessions, turns)
            rng = random.Random(-seed)
            prompts, outs = [list(map(list, firsts))], []
            for t in range(len(users[0])):
                outs.append([[rng.randrange(3, 2048) for _ in range(m)] for m in max_new])
                if t + 1 < len(users[0]):
                    prompts.append(next_turn(prompts[t], outs[t], users, t))
            rep = replay_engine(as_trace(prompts, outs), layout, **{**pools, **opts, **options})
            wanted = wanted_hits([[len(p) + len(o) - 1 for p, o in zip(ps, os_)] for ps, os_ in zip(prompts, outs)], grid)
            cached += sum(rep.cached_tokens[len(firsts):])
            ideal += sum(map(sum, wanted))
            steps += rep.scheduler.num_steps
        results[name] = {"lost": 1 - cached / max(1, ideal), "steps": steps}
    return results


def _agreement(after: dict[str, dict[str, Any]]) -> str:
    """The sentence on ``hyla sim``'s engine replay."""
    wrong = [f"{key} ({r['sim_disagreements']} of its runs)" for key, r in after.items() if r.get("sim_disagreements")]
    if wrong:
        return "`hyla sim --engine` (the engine replayed without a model) disagreed on cached tokens in: " + ", ".join(wrong) + "."
    return ("`hyla sim --engine` (the engine replayed without a model, `hyla/sim/replay.py`) reported every request's "
            "cached tokens exactly as the engine did, in every run.")


def _pct(part: float, whole: float) -> str:
    return f"{100 * part / max(1, whole):.1f}%"


def render(after: dict[str, dict[str, Any]], befores: list[tuple[str, dict[str, dict[str, Any]]]],
           seeds: list[int], pools: dict, archs: tuple[str, ...] = ARCHS, sessions: int = SESSIONS,
           turns: int = TURNS) -> str:
    from benchmarks.report import machine

    head = "| configuration | cached / ideal | lost (per seed) |"
    sep = "|---|---|---|"
    for label, _ in befores:
        head += f" lost at {label} | cut |"
        sep += "---|---|"
    head += " bound / ideal | cached / bound | retractions (tokens re-prefilled) |"
    sep += "---|---|---|"
    rows = [head, sep]
    for key, r in after.items():
        lost = 1 - r["share"]
        per_seed = ", ".join(f"{100 * x:.0f}" for x in r["lost_by_seed"])
        row = f"| {key} | {r['cached']} / {r['ideal']} | {100 * lost:.1f}% ({per_seed}) |"
        for _, before in befores:
            lost_b = 1 - before[key]["share"]
            cut = f"{lost_b / lost:.1f}x" if lost > 0 else "all"
            row += f" {100 * lost_b:.1f}% | {cut} |"
        row += (f" {_pct(r['bound'], r['ideal'])} | {_pct(r['cached'], r['bound'])} |"
                f" {r['retractions']} ({r['recomputed']}) |")
        rows.append(row)
    cost = ["| configuration | steps | prompt tokens computed |" + "".join(
        f" steps at {label} | computed at {label} |" for label, _ in befores),
        "|---|---|---|" + "---|---|" * len(befores)]
    for key, r in after.items():
        cost.append(f"| {key} | {r['steps']:,} | {r['prefilled']:,} |" + "".join(
            f" {before[key]['steps']:,} | {before[key]['prefilled']:,} |" if "steps" in before[key] else " — | — |"
            for _, before in befores))
    decomposition = ["| configuration | lost | " + " | ".join(CATEGORIES) + " |",
                     "|---|---|" + "---|" * len(CATEGORIES)]
    details = []
    for key, r in after.items():
        by_cat: Counter = Counter()
        for cat, _, n in r["lost"]:
            by_cat[cat] += n
        total = r["ideal"] - r["cached"]
        decomposition.append(f"| {key} | {total} ({_pct(total, r['ideal'])}) | " + " | ".join(
            f"{by_cat[c]} ({_pct(by_cat[c], r['ideal'])})" if by_cat[c] else "0" for c in CATEGORIES) + " |")
        parts = "; ".join(f"{cat}{' (' + detail + ')' if detail else ''}: {n}" for cat, detail, n in r["lost"])
        details.append(f"* {key}: {parts or 'nothing lost'}")
    some = next(iter(after.values()))
    seeds_arg = "" if seeds == DEFAULT_SEEDS else " --seeds " + ",".join(map(str, seeds))
    seeds_arg += "" if archs == ARCHS else " --archs " + ",".join(archs)
    pool_args = "".join(f" --{flag} {pools[key]}" for flag, key in POOL_FLAGS if pools[key] != POOLS[key])
    pool_args += workload_args(sessions, turns)
    cmd = "OMP_NUM_THREADS=1 .venv/bin/python benchmarks/cache_pressure.py" + "".join(
        f" --compare-with <checkout of {label}>" for label, _ in befores) + seeds_arg + pool_args
    most, kv = max(some["history_tokens"]), some["kv_pool"]
    running = f"the {pools['max_running_requests']} running requests' new tokens"
    fit = (f"they cannot all stay cached, and {running} need room besides" if most > kv
           else f"they fit, but not beside {running}")
    return (
        f"`{cmd}` — {machine()}; tiny test checkpoints (fp32); {sessions} concurrent sessions × {turns} turns, workload seeds "
        f"{', '.join(map(str, seeds))} (totals over the seeds; the lost share of each seed in parentheses); pools "
        f"{pools}. Ideal = each turn hits the previous turn's prompt + output − 1, rounded down to the grid. "
        "Every configuration is fed the cache-off run's prompts, and its greedy outputs equal the cache-off "
        f"run's (up to floating-point ties). The sessions' histories reach {min(some['history_tokens'])}–"
        f"{most} tokens before the last turn against a KV pool of {kv}: {fit}. The bound is "
        "the most any eviction order could have kept given each run's schedule (`capacity_bound` in the script: "
        "it knows the future, keeps any prefix of a history, ignores pages and the state pool). "
        + _agreement(after) + "\n\n"
        + "\n".join(rows)
        + "\n\nWhat the cached run cost (totals over the seeds): scheduler steps (prefill and decode batches: "
        "fewer requests at once take more of them) and prompt tokens computed at first admissions (a "
        "retraction's re-prefill is in the table above).\n\n"
        + "\n".join(cost)
        + "\n\nWhere the lost tokens went (`hyla.cache.ledger`; tokens, and share of the ideal): *KV evicted* — "
        "the previous turn's KV was evicted; *checkpoint evicted* — its KV was there, the state at the "
        "wanted position was evicted; *no room for a checkpoint* — the engine wanted one there and the state "
        "pool had no free or replaceable slot; *no checkpoint taken* — none was asked for; *off the checkpoint "
        "grid* — KV past the last grid position it reaches; *never cached* — tokens no removal explains.\n\n"
        + "\n".join(decomposition)
        + "\n\nIn detail (how the tree let go of it, and what needed the room):\n\n" + "\n".join(details))


def workload_args(sessions: int, turns: int) -> str:
    """``--sessions`` / ``--turns`` where they differ from the defaults (what old checkouts know without them)."""
    return (f" --sessions {sessions}" if sessions != SESSIONS else "") + (f" --turns {turns}" if turns != TURNS else "")


def section_title(pools: dict, sessions: int = SESSIONS, turns: int = TURNS) -> str:
    """``Cache under pressure``, or with the pool settings and workload that differ from the defaults."""
    changed = [f"{pools[key]} {'KV tokens' if key == 'max_total_tokens' else 'running requests'}"
               for _, key in POOL_FLAGS if pools[key] != POOLS[key]]
    changed += [f"{n} {what}" for n, default, what in ((sessions, SESSIONS, "sessions"), (turns, TURNS, "turns"))
                if n != default]
    return "Cache under pressure" + (", " + ", ".join(changed) if changed else "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--compare-with", type=Path, action="append", default=[],
                    help="another checkout's root (repeatable): measure it too; its directory name labels it")
    ap.add_argument("--seeds", default=",".join(map(str, DEFAULT_SEEDS)),
                    help="comma-separated workload seeds, summed (default %(default)s)")
    ap.add_argument("--kv-tokens", type=int, default=POOLS["max_total_tokens"],
                    help="the KV pool's size in tokens (default %(default)s); another size writes its own section")
    ap.add_argument("--max-running", type=int, default=POOLS["max_running_requests"],
                    help="requests decoding at once (default %(default)s); another number writes its own section")
    ap.add_argument("--archs", default=",".join(ARCHS),
                    help="comma-separated architectures to measure (default %(default)s)")
    ap.add_argument("--json", action="store_true", help="print only the results as JSON (used by --compare-with)")
    ap.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    ap.add_argument("--timing", type=int, default=0, metavar="ROUNDS",
                    help="instead: time the cached runs (qwen3_next, page 1) with protect_waiting_prefixes on "
                         "and off, interleaved, ROUNDS each; print the medians (writes nothing)")
    ap.add_argument("--replay", action="store_true",
                    help="instead: replay the workload without a model (hyla.sim.replay, seconds) and print each "
                         "configuration's lost share and steps (writes nothing)")
    ap.add_argument("--options", default="{}", metavar="JSON",
                    help="with --replay: more engine options, e.g. '{\"protect_waiting_prefixes\": false}'")
    ap.add_argument("--sessions", type=int, default=SESSIONS,
                    help="concurrent sessions (default %(default)s); another number writes its own section")
    ap.add_argument("--turns", type=int, default=TURNS,
                    help="turns of each session (default %(default)s); another number writes its own section")
    args = ap.parse_args()
    seeds = [int(x) for x in args.seeds.split(",")]
    ckpt_dir = Path(tempfile.gettempdir()) / "hyla-bench-ckpts"
    pools = dict(POOLS, max_total_tokens=args.kv_tokens, max_running_requests=args.max_running)
    if args.replay:
        options = json.loads(args.options)
        print(f"replayed without a model, seeds {args.seeds}, pools {pools}, options {options}:\n")
        print("| configuration | lost | steps |\n|---|---|---|")
        for name, r in replay(ckpt_dir, seeds, pools, options, args.sessions, args.turns).items():
            print(f"| {name} | {100 * r['lost']:.1f}% | {r['steps']:,} |")
        return
    if args.timing:
        import statistics

        times = timing(ckpt_dir, seeds, pools, args.timing, args.sessions, args.turns)
        on, off = (statistics.median(times[k]) for k in (True, False))
        print(f"cached runs' wall time, {pools}: protect_waiting_prefixes on {on:.2f} s "
              f"(runs {', '.join(f'{t:.2f}' for t in times[True])}), off {off:.2f} s "
              f"(runs {', '.join(f'{t:.2f}' for t in times[False])}): on / off {on / off:.3f}")
        return
    archs = tuple(a for a in args.archs.split(",") if a)
    if not archs or set(archs) - set(ARCHS):
        ap.error(f"--archs: a comma-separated subset of {','.join(ARCHS)}")
    after = measure(ckpt_dir, seeds, pools, archs, args.sessions, args.turns)
    if args.json:
        print(json.dumps(after))
        return
    befores = []
    for checkout in args.compare_with:
        env = dict(os.environ, PYTHONPATH=str(checkout.resolve()))
        out = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--json", "--seeds", args.seeds,
                              "--kv-tokens", str(args.kv_tokens), "--max-running", str(args.max_running),
                              *workload_args(args.sessions, args.turns).split()],
                             env=env, check=True, capture_output=True, text=True, cwd=checkout).stdout
        before = json.loads(out.strip().splitlines()[-1])
        for key, r in after.items():
            if before[key]["ideal"] != r["ideal"]:
                raise SystemExit(f"{key}: {checkout}'s cache-off runs fed different prompts")
        befores.append((checkout.resolve().name, before))
    sys.path.insert(0, str(ROOT))
    from benchmarks.report import write_section

    body = render(after, befores, seeds, pools, archs, args.sessions, args.turns)
    print(body)
    if not args.no_write:
        write_section(section_title(pools, args.sessions, args.turns), body)


if __name__ == "__main__":
    main()
