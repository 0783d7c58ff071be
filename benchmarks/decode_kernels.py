"""Kernels one fused decode step launches, by kind, on the GPU benchmark's model shape.

A decode step of a small model on a GPU costs a few microseconds per kernel even when replayed from
a CUDA graph, so the count is a cost in itself (issue 10). This counts the fused decode step
(``ForwardBatch.fused_decode``) of ``benchmarks/gpu_decode.py``'s Qwen3.5-style model (24 layers:
18 Gated DeltaNet + 6 attention; the vocabulary cut to 4,096 to keep the run short, which changes no
count) at batch ``--batch``:

* on a GPU: the CUDA kernels ``torch.profiler`` records for one eager fused step (no graph);
* without one: the CUDA code path run on CPU tensors (``layers._on_gpu`` answers yes, Triton in its
  interpreter), counting every ATen op that computes (views and allocations excluded: on CUDA they
  launch nothing) and every Triton launch. Elementwise ops that are no-ops at the CPU run's dtype
  (a ``.to`` of a tensor already in it) are counted only when they copy.

    .venv/bin/python benchmarks/decode_kernels.py [--batch 1] [--dtype bfloat16] [--no-write]
        [--compare-with <a checkout of an earlier commit>] [--verify W]

``--verify W``: a speculative verify step of ``W``-token chains through the fused kernels instead
(``ModelRunner.forward_chains`` on a fused runner: ``W`` decode rows per request, the recurrent
layers run column by column), written to its own section.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

GPU = torch.cuda.is_available()
if not GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel is defined

ROOT = Path(__file__).resolve().parents[1]
if "--root" in sys.argv:  # count another checkout's step (--compare-with runs this script so)
    ROOT = Path(sys.argv[sys.argv.index("--root") + 1]).resolve()
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))

import gpu_decode  # noqa: E402
from report import machine, write_section  # noqa: E402

# ATen ops that launch no kernel on CUDA (views, metadata, allocation)
NO_KERNEL = {"view", "_unsafe_view", "reshape", "expand", "slice", "select", "split", "split_with_sizes",
             "unsqueeze", "squeeze", "transpose", "t", "permute", "as_strided", "alias", "detach", "unbind",
             "narrow", "chunk", "_reshape_alias", "view_as", "lift_fresh", "empty", "empty_like",
             "empty_strided", "new_empty", "diagonal", "unflatten", "flatten", "movedim", "set_", "lift_fresh_copy"}


def count_cpu(runner, batch) -> collections.Counter:
    from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
    import triton.runtime.interpreter as interp

    counts: collections.Counter = collections.Counter()

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            name = func.overloadpacket.__name__
            copies = not (name in ("to", "_to_copy") and isinstance(out, torch.Tensor) and args
                          and isinstance(args[0], torch.Tensor) and out.data_ptr() == args[0].data_ptr())
            if name not in NO_KERNEL and copies:
                counts[f"aten.{name}"] += 1
            return out

    launch = interp.InterpretedFunction.run

    def run(self, *a, **k):  # a Triton launch; the interpreter's own tensor work is not counted
        counts[f"triton.{self.fn.__name__}"] += 1
        with _disable_current_modes():
            return launch(self, *a, **k)

    interp.InterpretedFunction.run = run
    try:
        with Count():
            runner.decode_fused_step(batch)
    finally:
        interp.InterpretedFunction.run = launch
    return counts


def count_gpu(runner, batch) -> collections.Counter:
    from torch.profiler import ProfilerActivity, profile

    runner.decode_fused_step(batch)  # Triton compiles, cuBLAS picks its kernels
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        runner.decode_fused_step(batch)
        torch.cuda.synchronize()
    counts: collections.Counter = collections.Counter()
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            counts[ev.name[:60]] += 1
    return counts


def _gemms(counts: collections.Counter) -> int:
    return sum(v for k, v in counts.items() if k in ("aten.linear", "aten.mm", "aten.addmm") or "gemv" in k
               or "gemm" in k.lower() or "cutlass" in k or "sm90" in k)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    ap.add_argument("--compare-with", type=Path, help="a checkout of an earlier commit: its count beside this one")
    ap.add_argument("--verify", type=int, default=0, metavar="W",
                    help="count a verify step of W-token chains (fused) instead of a decode step")
    ap.add_argument("--root", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    device = "cuda" if GPU else "cpu"
    kw = dict(gpu_decode.FULL, vocab_size=4096)

    from hyla import Engine
    from hyla.engine.model_runner import ModelRunner
    import hyla.model.layers as layers

    path = Path(tempfile.mkdtemp())
    gpu_decode.build(path, kw, device, dtype)
    w = args.verify
    engine = Engine(path, device=device, dtype=args.dtype, max_running_requests=max(args.batch, 2),
                    max_state_slots=(max(w, 1) + 3) * args.batch + 8, max_total_tokens=64 * args.batch + 512)
    runner = ModelRunner(engine.model, engine.kv_pool, engine.state_pool, engine.req_to_token, engine.device,
                         cuda_graph=False, fused_decode=True, verify_width=w or None)
    engine.scheduler.runner = runner
    captured = []
    step = runner.decode_fused_step
    runner.decode_fused_step = lambda batch: captured.append(batch) or step(batch)
    on_gpu = layers._on_gpu
    if not GPU:
        layers._on_gpu = lambda x: True  # the CUDA code path on CPU tensors
    try:
        engine.generate(input_ids=[[5 + i, 6, 7, 8] for i in range(args.batch)],
                        sampling_params={"max_new_tokens": 2, "temperature": 0, "ignore_eos": True})
        if w:  # a verify step of chains: W tokens per request, its states through W - 1 scratch slots each
            from types import SimpleNamespace

            b = args.batch
            reqs = [SimpleNamespace(kv_len=8, tokens=lambda a, e: [5] * (e - a), req_pool_idx=i, state_slot=1 + i)
                    for i in range(b)]
            scratch = [[1 + b + i * (w - 1) + j for j in range(w - 1)] for i in range(b)]
            runner.forward_chains(reqs, [w] * b, torch.arange(1, 1 + w * b), scratch)
        runner.decode_fused_step = step
        counts = (count_gpu if GPU else count_cpu)(runner, captured[-1])
    finally:
        layers._on_gpu = on_gpu
        engine.shutdown()
    if args.json:
        print(json.dumps(dict(counts)))
        return
    before = None
    if args.compare_with is not None:
        cmd = [sys.executable, __file__, "--root", str(args.compare_with), "--json", "--batch", str(args.batch),
               "--dtype", args.dtype] + (["--verify", str(w)] if w else [])
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
        before = collections.Counter(json.loads(out))
        rev = subprocess.run(["git", "-C", str(args.compare_with), "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True).stdout.strip() or str(args.compare_with)
    total, gemm = sum(counts.values()), _gemms(counts)
    lines = [f"{v:5d}  {k}" for k, v in counts.most_common()]
    print("\n".join(lines))
    step_name = f"verify step ({w}-token chains)" if w else "decode step"
    print(f"total {total} kernels per {step_name} at batch {args.batch}, {gemm} of them GEMMs")
    how = ("CUDA kernels recorded by torch.profiler in one eager fused step" if GPU else
           "the CUDA code path on CPU tensors (Triton interpreted): ATen ops that compute + Triton launches")
    cmp = f" --compare-with <checkout of {rev}>" if before is not None else ""
    flag = f" --verify {w}" if w else ""
    body = (f"`.venv/bin/python benchmarks/decode_kernels.py --batch {args.batch} --dtype {args.dtype}{flag}{cmp}` — "
            f"{machine()}; {how}.\n\n"
            f"The fused {step_name} of the GPU decode benchmark's model (24 layers: 18 Gated DeltaNet + 6 "
            f"attention; vocabulary cut to 4,096) at batch {args.batch}, {args.dtype}: **{total} kernels**, "
            f"{gemm} of them GEMMs"
            + (f" ({sum(before.values())} and {_gemms(before)} at {rev})" if before is not None else "") + ".\n\n")
    if before is None:
        body += "| kernels | what |\n|---|---|\n" + "\n".join(f"| {v} | `{k}` |" for k, v in counts.most_common())
    else:
        names = sorted(set(counts) | set(before), key=lambda k: (-counts.get(k, 0), -before.get(k, 0), k))
        body += f"| what | {rev} | now |\n|---|---|---|\n" + "\n".join(
            f"| `{k}` | {before.get(k, 0)} | {counts.get(k, 0)} |" for k in names)
        body += f"\n| **total** | **{sum(before.values())}** | **{total}** |"
    body += "\n"
    if not args.no_write:
        write_section("GPU decode: kernels per verify step" if w else "GPU decode: kernels per step", body)


if __name__ == "__main__":
    main()
