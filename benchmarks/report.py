"""Write one benchmark's results into its own ``## <title>`` section of docs/benchmarks.md.

Every benchmark script calls ``write_section`` with a markdown body; the section is replaced in
place (or appended), other sections are left as they are. ``graph_us`` times a few GPU kernels per
call as a CUDA graph replays them (the launch gaps of a decode step's graph, not Python's).
"""

from __future__ import annotations

import platform
import re
import statistics
import time
from pathlib import Path

import torch

DOC = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"
HEADER = ("# Benchmarks\n\nEach section is written by the script it names; re-run the command to "
          "refresh it. Numbers are medians of repeated runs; comparisons are ratios against a peer "
          "measured in the same run (machines here are shared and noisy).\n")


def machine() -> str:
    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU ({platform.processor() or platform.machine()})"
    return f"{dev}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}"


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
