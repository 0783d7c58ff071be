"""Cost of the state pool's slot operations: what a prefix hit, a fork and a new request pay.

Each hybrid request that hits the cache copies its checkpoint into its own slot (``StatePool.copy``
of one slot), a finished turn forks its live slot into the tree (``fork``), and a new request or a
checkpoint gets fresh zeroed slots (``alloc``). Each touches every linear layer's conv and SSM
buffers. Up to ``state_pool.ROW_OPS_MAX_SLOTS`` slots they run as one foreach op per dtype over row
views (on CUDA: one multi-tensor kernel per dtype); past it, and before 2026-11-25 always, as one
or two indexed ops per buffer (72 launches for a one-slot copy on the GPU benchmark's 18 Gated
DeltaNet layers). Both paths are timed in the same run (the indexed one by setting the threshold
to 0), on two layouts: the built-in default model (6 Gated DeltaNet layers, fp32) and the GPU
benchmark's model (``gpu_decode.py``: 18 layers, conv ``[6144, 3]`` bf16, state ``[16, 128, 128]``
fp32, 1 MB a layer). Medians of ``--repeats`` runs of ``--calls`` calls, wall time per call (on
CUDA synchronised after the calls: host and device time together).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/state_ops.py [--device cpu|cuda] [--repeats 7] [--no-write]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.report import machine, write_section  # noqa: E402
from hyla.cache import state_pool as state_pool_module  # noqa: E402
from hyla.cache.state_pool import StatePool  # noqa: E402

LAYOUTS = {  # name: (linear layers, conv shape, conv dtype, SSM shape)
    "default model (6 GDN layers, fp32)": (6, (512, 3), torch.float32, (4, 64, 64)),
    "GPU benchmark model (18 GDN layers, bf16 conv)": (18, (6144, 3), torch.bfloat16, (16, 128, 128)),
}


def per_call_us(fn, device: torch.device, calls: int, repeats: int) -> float:
    fn()  # warm-up
    runs = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        runs.append((time.perf_counter() - t) / calls * 1e6)
    return statistics.median(runs)


def measure(layout: tuple, device: torch.device, calls: int, repeats: int) -> dict[str, float]:
    layers, conv, conv_dtype, ssm = layout
    pool = StatePool(64, layers, conv, conv_dtype, ssm, device=device)
    src, dst = pool.alloc(16).tolist(), pool.alloc(16).tolist()

    def alloc_one():
        pool.free(pool.alloc(1))

    def fork_one():
        pool.free(pool.fork(src[:1]))

    ops = {"copy 1 slot": lambda: pool.copy(src[:1], dst[:1]), "copy 4 slots": lambda: pool.copy(src[:4], dst[:4]),
           "fork 1 slot": fork_one, "alloc 1 slot (zeroed)": alloc_one}
    return {name: per_call_us(fn, device, calls, repeats) for name, fn in ops.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    args = ap.parse_args()
    device = torch.device(args.device)
    rows = ["| layout | operation | indexed ops per buffer (µs) | foreach over row views (µs) | speed-up |",
            "|---|---|---|---|---|"]
    threshold = state_pool_module.ROW_OPS_MAX_SLOTS
    for name, layout in LAYOUTS.items():
        try:
            state_pool_module.ROW_OPS_MAX_SLOTS = 0
            before = measure(layout, device, args.calls, args.repeats)
        finally:
            state_pool_module.ROW_OPS_MAX_SLOTS = threshold
        after = measure(layout, device, args.calls, args.repeats)
        for op in before:
            rows.append(f"| {name} | {op} | {before[op]:,.1f} | {after[op]:,.1f} | {before[op] / after[op]:.2f}x |")
    table = "\n".join(rows)
    print(table)
    if not args.no_write:
        write_section("State pool operations", f"""`benchmarks/state_ops.py` — {machine()}; {device.type}, 1 thread,
medians of {args.repeats} runs of {args.calls} calls (wall time per call{", synchronised" if device.type == "cuda" else ""}).
What a prefix hit (copy its checkpoint into the request's slot), a finished turn (fork its slot into the
tree) and a new request or checkpoint (fresh zeroed slots) pay in the state pool: up to
`ROW_OPS_MAX_SLOTS` = {threshold} slots as one foreach op per dtype over row views, against one or two
indexed ops per layer buffer (what every call did before, still the path for more slots), in the same run.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/state_ops.py

{table}
""")


if __name__ == "__main__":
    main()
