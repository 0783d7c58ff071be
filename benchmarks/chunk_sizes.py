"""Chunk size of the PyTorch chunked scans on this CPU: Gated DeltaNet, KDA and Mamba2's SSD.

``hyla.model.ops.varlen.CHUNK_SIZE`` (the chunk length these scans use on CPU) is an execution
choice, not the model's: this script times each scan (``chunk_gated_delta_rule_varlen``,
``chunk_kda_varlen``, ``mamba2_chunk_scan_varlen``, with their state pools) at every chunk size of
``--sizes`` on packed batches of the given shapes, all sizes interleaved round by round, thread CPU
time (1 thread: robust to a busy machine), medians. Each cell is the time relative to the current
``CHUNK_SIZE`` (< 1: faster); its largest output difference from that run is checked to stay at
fp32 rounding (1e-3, relative to the output's scale). Head shapes: the built-in model's Gated
DeltaNet (4 value heads of 64 x 64, 2 key heads), KDA with 4 heads of 64, Mamba2 with 16 heads
of 64 x 64 in 2 groups. Writes the ``## CPU chunked scans: chunk size`` section of docs/benchmarks.md.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/chunk_sizes.py [--sizes 16,32,64,128,256]
        [--shapes 8x128,1x296,1x1024,1x4096] [--repeats 5] [--no-write]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.report import machine, write_section  # noqa: E402
from hyla.model.ops import chunk_gated_delta_rule_varlen, chunk_kda_varlen, mamba2_chunk_scan_varlen  # noqa: E402
from hyla.model.ops.varlen import CHUNK_SIZE  # noqa: E402


def scans(batch: int, length: int) -> dict:
    """``{name: fn(chunk_size) -> output}`` on one packed batch of ``batch`` x ``length`` tokens."""
    g = torch.Generator().manual_seed(0)
    n = batch * length
    cu, slots = torch.arange(batch + 1) * length, torch.arange(1, batch + 1)

    def rand(*shape):
        return torch.randn(*shape, generator=g)

    q, k, v = rand(n, 2, 64), rand(n, 2, 64), rand(n, 4, 64)
    gdn_g, gdn_b = -F.softplus(rand(n, 4) * 2), torch.rand(n, 4, generator=g)
    gdn_pool = rand(batch + 1, 4, 64, 64) * 0.1
    kq, kk, kv = rand(n, 4, 64), rand(n, 4, 64), rand(n, 4, 64)
    kda_g, kda_b = -F.softplus(rand(n, 4, 64)), torch.rand(n, 4, generator=g)
    x, dt, B, C = rand(n, 16, 64), rand(n, 16), rand(n, 2, 64), rand(n, 2, 64)
    A, D, dt_bias = -torch.rand(16, generator=g) * 4, rand(16), rand(16)
    ssd_pool = rand(batch + 1, 16, 64, 64) * 0.1
    return {
        "Gated DeltaNet": lambda q_: chunk_gated_delta_rule_varlen(q, k, v, gdn_g, gdn_b, cu, gdn_pool.clone(), slots,
                                                                   chunk_size=q_),
        "KDA": lambda q_: chunk_kda_varlen(kq, kk, kv, kda_g, kda_b, cu, gdn_pool.clone(), slots, chunk_size=q_),
        "Mamba2 SSD": lambda q_: mamba2_chunk_scan_varlen(x, dt, A, B, C, D, dt_bias, cu, ssd_pool.clone(), slots,
                                                          chunk_size=q_),
    }


def measure(shapes: list[tuple[int, int]], sizes: list[int], repeats: int) -> dict:
    """``{(scan, shape): {size: median seconds}}``, and asserts every size's output is within
    fp32 rounding of the current ``CHUNK_SIZE``'s."""
    out = {}
    for batch, length in shapes:
        for name, fn in scans(batch, length).items():
            ref = fn(CHUNK_SIZE)
            scale = ref.abs().max().item()
            for s in sizes:
                diff = (fn(s) - ref).abs().max().item()
                if diff > 1e-3 * max(scale, 1.0):
                    raise AssertionError(f"{name} {batch}x{length}: chunk {s} differs from {CHUNK_SIZE} by {diff}")
            times = {s: [] for s in sizes}
            for r in range(repeats):
                for s in sizes if r % 2 else sizes[::-1]:
                    t0 = time.thread_time()
                    fn(s)
                    times[s].append(time.thread_time() - t0)
            out[(name, (batch, length))] = {s: statistics.median(t) for s, t in times.items()}
    return out


def table(results: dict, sizes: list[int]) -> str:
    lines = ["| scan | tokens | " + " | ".join(f"{s}" for s in sizes) + " | best |",
             "|---" * (len(sizes) + 3) + "|"]
    for (name, (batch, length)), t in results.items():
        base = t.get(CHUNK_SIZE) or min(t.values())
        best = min(t, key=t.get)
        cells = [f"{t[s] / base:.2f}x" if s != CHUNK_SIZE else f"**{1e3 * t[s]:.1f} ms**" for s in sizes]
        lines.append(f"| {name} | {batch} x {length:,} | " + " | ".join(cells) + f" | {best} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="16,32,64,128,256")
    ap.add_argument("--shapes", default="8x128,1x296,1x1024,1x4096", help="BATCHxLENGTH, comma-separated")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    sizes = sorted({int(s) for s in args.sizes.split(",")} | {CHUNK_SIZE})
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    results = measure(shapes, sizes, args.repeats)
    body = (f"`OMP_NUM_THREADS=1 .venv/bin/python benchmarks/chunk_sizes.py --sizes {args.sizes} --shapes "
            f"{args.shapes} --repeats {args.repeats}` — {machine()}; 1 thread, thread CPU time, medians of "
            f"{args.repeats}, every size interleaved.\n\n"
            f"Each scan with its state pool on one packed batch (batch x tokens), at each chunk size: the "
            f"time of the current `CHUNK_SIZE` = {CHUNK_SIZE} in bold, the others relative to it (< 1: "
            f"faster). Outputs of every size are checked within fp32 rounding of {CHUNK_SIZE}'s.\n\n"
            + table(results, sizes))
    print(body)
    if not args.no_write:
        write_section("CPU chunked scans: chunk size", body)


if __name__ == "__main__":
    main()
