"""Write one benchmark's results into its own ``## <title>`` section of docs/benchmarks.md.

Every benchmark script calls ``write_section`` with a markdown body; the section is replaced in
place (or appended), other sections are left as they are. ``graph_us`` times a few GPU kernels per
call as a CUDA graph replays them (the launch gaps of a decode step's graph, not Python's).
``off_on`` runs an A/B of two engines (a feature off and on) in alternating rounds and
``off_on_rows`` makes its table. ``median_ms`` times a host call.
"""

from __future__ import annotations

import platform
import re
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

DOC = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"
HEADER = ("# Benchmarks\n\nEach section is written by the script it names; re-run the command to "
          "refresh it. Numbers are medians of repeated runs; comparisons are ratios against a peer "
          "measured in the same run (machines here are shared and noisy).\n")


def machine() -> str:
    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU ({platform.processor() or platform.machine()})"
    return f"{dev}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}"


def off_on(engines: dict[str, Any], repeats: int, measure: Callable[[str, Any, int], dict[str, float]],
           label: str) -> dict[str, dict[str, float]]:
    """``measure(mode, engine, round)`` of each engine (``{"off": ..., "on": ...}``) in turn, for a
    first round that warms them up (untimed) and ``repeats`` more, each printed; then shuts the
    engines down. Returns, per mode, each metric's median over the timed rounds."""
    runs: dict[str, list[dict[str, float]]] = {mode: [] for mode in engines}
    try:
        for rep in range(1 + repeats):
            for mode, engine in engines.items():
                res = measure(mode, engine, rep)
                if rep:
                    runs[mode].append(res)
                    print(f"repeat {rep}, {label} {mode}: " + ", ".join(f"{k} {v:,.1f}" for k, v in res.items()),
                          flush=True)
    finally:
        for engine in engines.values():
            engine.shutdown()
    return {mode: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for mode, rs in runs.items()}


def off_on_rows(med: dict[str, dict[str, float]], metrics: Sequence[str], digits: dict[str, int] | None = None) -> str:
    """Markdown rows ``| metric | off | on | on / off |`` of :func:`off_on`'s medians (1 decimal,
    or ``digits[metric]``)."""
    fmt = lambda k, v: f"{v:,.{(digits or {}).get(k, 1)}f}"  # noqa: E731
    ratio = lambda k: f"{med['on'][k] / med['off'][k]:.2f}x" if med["off"][k] else "—"  # noqa: E731
    return "\n".join(f"| {k} | {fmt(k, med['off'][k])} | {fmt(k, med['on'][k])} | {ratio(k)} |" for k in metrics)


def median_ms(fn: Callable[[], Any], repeats: int) -> float:
    """Wall time of one ``fn()`` on the host, in milliseconds: the median of ``repeats`` calls after a
    warm-up call."""
    fn()
    runs = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - t)
    return statistics.median(runs) * 1e3


def write_section(title: str, body: str, doc: Path = DOC) -> None:
    text = doc.read_text() if doc.exists() else HEADER
    section = f"## {title}\n\n{body.strip()}\n"
    pattern = re.compile(rf"^## {re.escape(title)}\n.*?(?=^## |\Z)", re.S | re.M)
    if pattern.search(text):
        text = pattern.sub(lambda _: section + "\n", text, count=1)
    else:
        text = text.rstrip() + "\n\n" + section
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(text.rstrip() + "\n")


def graph_us(fn, repeats: int, calls: int = 20, device: str = "cuda") -> float:
    """Device time of one ``fn()`` (CUDA): ``calls`` of it captured in one CUDA graph, median over
    ``repeats`` replays (CUDA events), divided by ``calls``; after warm-up calls (Triton compiles).
    On another ``device`` (a check of a script, Triton interpreted): one call's wall time."""
    if device != "cuda":
        t = time.perf_counter()
        fn()
        return 1e6 * (time.perf_counter() - t)
    for _ in range(3):
        fn()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / calls)
    return statistics.median(times)
