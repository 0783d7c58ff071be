"""Where the engine's time goes, phase by phase, on the GPU benchmark's model (issue 10).

``benchmarks/gpu_decode.py`` says how fast; this says why. On the same Qwen3.5-style model (built
the same way, ``--tiny`` to try it on CPU) it runs, after one untimed warm-up of each:

* ``prefill_cold``: one fresh ``--prefill-tokens`` prompt, one new token;
* ``prefill_cached``: the same length with the first ``--cached-tokens`` cached (a checkpoint
  there, as gpu_decode's cached TTFT);
* ``decode step, batch B`` for B in ``--batches``: B fresh ``--prompt-tokens`` prompts, per decode
  step (below).

For each phase it prints and writes to ``--out`` (one markdown file and, on a GPU, a Chrome trace):

* wall time, and the device's busy time (the union of kernel intervals in the trace): their gap
  is host time the device spent waiting (wall time under both profilers: slower than
  gpu_decode's, Python-heavy phases most);
* kernels launched, host->device / device->host copies, and stream or device synchronizations
  (CUDA runtime calls in the trace);
* the top kernels by total time;
* the scheduler thread's Python profile per phase (``cProfile`` around ``Scheduler.step``, the
  thread that runs the model): where host time goes, including waits inside torch calls (a
  ``.tolist()`` that waits for the device shows up as its caller's time). ``--batches ""`` profiles
  the two prefill phases only.

Decode phases are measured as a difference: ``generate`` of ``1 + N`` new tokens is profiled, and
the per-step figures are divided by N after subtracting a profiled ``generate`` of 1 token (the
prefill). Nothing is written to docs/benchmarks.md: profiles are for reading, not for keeping.

    PYTHONUNBUFFERED=1 .venv/bin/python benchmarks/gpu_profile.py --out /tmp/profile [--batches 1,64]
        [--prefill-tokens 4096] [--cached-tokens 3800] [--decode-steps 16] [--overlap-schedule on|off|auto]
    .venv/bin/python benchmarks/gpu_profile.py --device cpu --tiny --out /tmp/profile --prefill-tokens 64 \\
        --cached-tokens 48 --batches 1,2 --decode-steps 4                                  # CPU smoke test
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import functools
import io
import pstats
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_decode  # noqa: E402
from report import machine  # noqa: E402

# CUDA runtime calls that move data or wait (names as the profiler records them)
COPIES = ("cudaMemcpyAsync", "cudaMemcpy")
SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def _busy_us(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of ``(start, end)`` intervals (µs)."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total


class PhaseProfile:
    """Profiled calls: for each, the torch.profiler trace (kernels, runtime calls) and the
    scheduler thread's cProfile (``python_top``)."""

    def __init__(self, engine, device: str):
        self.engine, self.device = engine, device

    def run(self, fn, trace: Path | None = None) -> dict:
        from torch.profiler import ProfilerActivity, profile

        sched = self.engine.scheduler
        step, py = sched.step, cProfile.Profile()

        def profiled_step(*a, **k):  # the scheduler thread runs the model: profile it there
            py.enable()
            try:
                return step(*a, **k)
            finally:
                py.disable()

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.startswith("cuda") else [])
        gpu_decode.sync(self.device)
        sched.step = profiled_step
        try:
            with profile(activities=acts) as prof:
                wall = gpu_decode.timed(fn, self.device)
        finally:
            del sched.step  # back to the class's method
        if trace is not None and self.device.startswith("cuda"):
            prof.export_chrome_trace(str(trace))
        kernels: collections.Counter = collections.Counter()
        kernel_us: collections.Counter = collections.Counter()
        intervals, runtime = [], collections.Counter()
        for ev in prof.events():
            if ev.device_type == torch.autograd.DeviceType.CUDA:
                kernels[ev.name[:80]] += 1
                kernel_us[ev.name[:80]] += ev.time_range.elapsed_us()
                intervals.append((ev.time_range.start, ev.time_range.end))
            elif ev.name in COPIES + SYNCS or ev.name.startswith("cudaLaunch"):
                runtime[ev.name] += 1
        return dict(wall_ms=1e3 * wall, busy_ms=_busy_us(intervals) / 1e3, kernels=sum(kernels.values()),
                    launches=sum(v for k, v in runtime.items() if k.startswith("cudaLaunch")),
                    copies=sum(runtime[k] for k in COPIES), syncs=sum(runtime[k] for k in SYNCS),
                    top_kernels=[(k, kernels[k], kernel_us[k] / 1e3) for k, _ in kernel_us.most_common(15)],
                    python=py)

    @staticmethod
    def python_top(py: cProfile.Profile, n: int = 30) -> str:
        out = io.StringIO()
        stats = pstats.Stats(py, stream=out)
        stats.sort_stats("tottime").print_stats(n)
        out.write("\n--- by cumulative time ---\n")
        stats.sort_stats("cumulative").print_stats(n)
        return out.getvalue()


class Timeline:
    """Where the wall time of an unprofiled call goes, on the clock: when each of a few engine
    methods on a request's path starts and ends, in ms after the call began (medians over calls).
    Without profilers it shows what they hide: the host's gaps around the device's work (a
    prefill's forward is launched at "forward launched" and waited for inside "tokens read")."""

    MARKS = (("engine", "_make_requests", "requests validated and built"),
             ("scheduler", "schedule", "scheduled: prefix matched, admitted, state restored"),
             ("scheduler", "run", "forward launched"),
             ("cache", "commit_batch", "prompt committed to the tree"),
             ("cache", "release", "request released to the cache (before the read when the token ends it)"),
             ("output", "complete", "tokens read (waits for the device), appended"),
             ("scheduler", "_finish", "request delivered"))

    def __init__(self, engine):
        s = engine.scheduler
        self.objects = {"engine": engine, "scheduler": s, "cache": s.cache, "output": s.output}
        self.marks: list[tuple[str, float, float]] = []

    def run(self, make, repeats: int) -> list[tuple[str, float, float]]:
        """``make()`` -> the call to time, ``repeats`` times -> ``(label, start, end)`` medians
        (ms after the call began) for each mark that ran, in order."""
        wrapped = []
        for key, name, label in self.MARKS:
            obj = self.objects[key]
            fn = getattr(obj, name)

            def timed_method(*a, _fn=fn, _label=label, **k):
                t = time.perf_counter()
                try:
                    return _fn(*a, **k)
                finally:
                    self.marks.append((_label, t, time.perf_counter()))
            setattr(obj, name, timed_method)
            wrapped.append((obj, name))
        runs = []
        try:
            for _ in range(repeats):
                fn = make()
                self.marks = []
                t0 = time.perf_counter()
                fn()
                returned = time.perf_counter()
                # the scheduler thread marks the delivery's end after the output it delivered woke the
                # caller: wait for that mark, or a busy machine's run misses it (and the table its rows)
                last, deadline = self.MARKS[-1][2], time.monotonic() + 10
                while not any(m[0] == last for m in self.marks) and time.monotonic() < deadline:
                    time.sleep(0.001)
                once = {}  # a method called twice in one call (a release that finds nothing left): the first call
                for label, a, b in self.marks:
                    once.setdefault(label, (a, b))
                runs.append([(label, 1e3 * (a - t0), 1e3 * (b - t0)) for label, (a, b) in once.items()]
                            + [("call returned",) + (1e3 * (returned - t0),) * 2])
        finally:
            for obj, name in wrapped:
                delattr(obj, name)  # back to the class's method
        first = runs[0]
        return [(label, statistics.median(r[i][1] for r in runs), statistics.median(r[i][2] for r in runs))
                for i, (label, _, _) in enumerate(first) if all(len(r) == len(first) for r in runs)]


def _minus(a: dict, b: dict, n: int) -> dict:
    """Per decode step: ``(a - b) / n`` of the counts and times (``b``: the prefill alone)."""
    keys = ("wall_ms", "busy_ms", "kernels", "launches", "copies", "syncs")
    return {k: (a[k] - b[k]) / n for k in keys} | {"top_kernels": a["top_kernels"], "python": a["python"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), help="default: bf16 on GPU, fp32 on CPU")
    ap.add_argument("--tiny", action="store_true", help="gpu_decode's tiny model (to try it on CPU)")
    ap.add_argument("--out", type=Path, required=True, help="directory for the summary and the traces")
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--decode-steps", type=int, default=16)
    ap.add_argument("--prefill-tokens", type=int, default=4096)
    ap.add_argument("--cached-tokens", type=int, default=3800)
    ap.add_argument("--overlap-schedule", default="auto")
    ap.add_argument("--no-traces", action="store_true", help="no Chrome trace files (they can be large)")
    ap.add_argument("--timeline-repeats", type=int, default=7, help="unprofiled calls of each prefill phase timed "
                    "on the clock (section 'Prefill phases on the clock')")
    args = ap.parse_args()
    dev = args.device
    dtype_name = args.dtype or ("float32" if dev == "cpu" else "bfloat16")
    batches = [int(b) for b in args.batches.split(",") if b.strip()]  # "": the prefill phases only
    if not 0 < args.cached_tokens < args.prefill_tokens:
        ap.error("--cached-tokens must be in (0, --prefill-tokens)")
    args.out.mkdir(parents=True, exist_ok=True)

    from hyla import Engine

    kw = gpu_decode.TINY if args.tiny else gpu_decode.FULL
    tmp = tempfile.TemporaryDirectory(prefix="hyla-gpu-profile-")
    gpu_decode.build(Path(tmp.name), kw, dev, getattr(torch, dtype_name))
    p, n, pt, ct = args.prompt_tokens, args.decode_steps, args.prefill_tokens, args.cached_tokens
    most = max(batches, default=1)
    engine = Engine(tmp.name, device=dev, dtype=dtype_name, overlap_schedule=args.overlap_schedule,
                    max_running_requests=most, max_state_slots=2 * most + 16,
                    max_total_tokens=2 * max(most * (p + n + 2), 2 * (pt + 2)) + 4096)
    rng = random.Random(0)
    fresh = lambda k: [rng.randrange(3, kw["vocab_size"]) for _ in range(k)]  # noqa: E731
    greedy = gpu_decode.greedy
    prof = PhaseProfile(engine, dev)

    def cached_prompt() -> list[int]:  # a prompt whose first ct tokens are cached, a checkpoint there
        prefix = fresh(ct)
        engine.generate(input_ids=prefix + fresh(pt - ct), checkpoints=[ct], sampling_params=greedy(1))
        return prefix + fresh(pt - ct)

    def prefill(ids: list[int]):
        return lambda: engine.generate(input_ids=ids, sampling_params=greedy(1))

    def decode(b: int, new: int):
        ids = [fresh(p) for _ in range(b)]
        return lambda: engine.generate(input_ids=ids, sampling_params=greedy(new))

    # each phase: a function that prepares (outside the profile) and returns what to profile
    phases = {"prefill_cold": lambda: prefill(fresh(pt)), "prefill_cached": lambda: prefill(cached_prompt())}
    for b in batches:
        for new in (1, 1 + n):
            phases[f"decode_{b}_{new}"] = functools.partial(decode, b, new)
    results = {}
    for name, make in phases.items():
        make()()  # warm-up (Triton compiles, graphs, autotuning)
        fn = make()
        results[name] = prof.run(fn, None if args.no_traces else args.out / f"{name}.json")
        r = results[name]
        print(f"{name}: wall {r['wall_ms']:.1f} ms, device busy {r['busy_ms']:.1f} ms, {r['kernels']} kernels, "
              f"{r['copies']} copies, {r['syncs']} syncs", flush=True)
    timeline = {name: Timeline(engine).run(phases[name], args.timeline_repeats)
                for name in ("prefill_cold", "prefill_cached")}
    engine.shutdown()

    lines = [f"# Engine profile: {machine()}, {dtype_name}, model {'tiny' if args.tiny else 'Qwen3.5-0.8B dims'}",
             "", f"`{' '.join(sys.argv)}`", "",
             "| phase | wall ms | device busy ms | kernels | launches | H2D/D2H copies | syncs |", "|---|---|---|---|---|---|---|"]
    rows = {"prefill_cold": results["prefill_cold"], "prefill_cached": results["prefill_cached"]}
    for b in batches:
        rows[f"decode step, batch {b} (per step)"] = _minus(results[f"decode_{b}_{1 + n}"], results[f"decode_{b}_1"], n)
    for name, r in rows.items():
        lines.append(f"| {name} | {r['wall_ms']:.2f} | {r['busy_ms']:.2f} | {r['kernels']:.0f} | {r['launches']:.0f} | "
                     f"{r['copies']:.0f} | {r['syncs']:.0f} |")
    lines += ["", f"## Prefill phases on the clock (ms after generate() was called, medians of {args.timeline_repeats} "
              "unprofiled calls; `Timeline`)", "", "| mark | " + " | ".join(f"{n}: start | end" for n in timeline) + " |",
              "|---|" + "---|---|" * len(timeline)]
    labels = [m[0] for m in timeline["prefill_cached"]]
    for label in labels:
        cells = []
        for marks in timeline.values():
            hit = next((m for m in marks if m[0] == label), None)
            cells += [f"{hit[1]:.2f}", f"{hit[2]:.2f}"] if hit else ["—", "—"]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    for name, r in rows.items():
        if r["top_kernels"]:
            lines += ["", f"## {name}: top kernels (whole call)", "", "| kernel | count | ms |", "|---|---|---|"]
            lines += [f"| `{k}` | {c} | {ms:.3f} |" for k, c, ms in r["top_kernels"]]
    for name, r in rows.items():  # a decode phase's: the whole call of 1 + N tokens (its prefill too)
        lines += ["", f"## {name}: the scheduler thread's Python profile", "", "```",
                  PhaseProfile.python_top(r["python"]), "```"]
    (args.out / "profile.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[:len(rows) + 6]))
    start = lines.index(next(x for x in lines if x.startswith("## Prefill phases on the clock")))
    print("\n".join(lines[start:start + 4 + len(labels)]))
    print(f"written: {args.out / 'profile.md'}" + ("" if args.no_traces or dev == "cpu" else " and one trace per phase"))


if __name__ == "__main__":
    main()
