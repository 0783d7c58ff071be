"""A decode step's out projections at batch 1-4: one fused kernel vs the separate ones (GPU).

At a few rows, each part of a layer ends ``prologue -> out projection -> residual add + RMSNorm``.
The fused decode step runs that as separate launches (a ``norms.py`` kernel, a cuBLAS GEMM,
``add_rms_norm_fused``) or, at most ``gemv.MAX_ROWS`` rows, as one (``gemv.linear_add_rms_norm``:
split-K, the prologue on the fly, the last program adding the partials and doing the add and the
norm). This times both per call for the GPU benchmark model's three shapes (the MLP's down
projection after SwiGLU, 3584 -> 1024; Gated DeltaNet's ``out_proj`` after its gated norm, 2048 ->
1024; attention's ``o_proj``, 2048 -> 1024), bf16: each variant captured 20 times in one CUDA
graph, median of ``--repeats`` replays, so launch gaps count as in the decode step's graph. Also
the GEMM alone (cuBLAS) and the fused kernel's weight bandwidth. ``--sweep`` also tries the
kernel's tile constants (``BLOCK_N``, ``MIN_PROGRAMS``, ``MAX_SPLIT_K``, ``NUM_WARPS``,
``BLOCK_K``) at the first ``--rows`` and prints the best per shape, to tune them. Writes ``## GPU decode: out projection, residual add and norm``.

    .venv/bin/python benchmarks/out_projection.py [--rows 1,2,4] [--repeats 15] [--sweep] [--no-write]

Without a GPU (``--device cpu``) it runs Triton's interpreter on small shapes, to check the script
(times meaningless; nothing written).
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPES = {  # name: (prologue, K, N, gated-norm head dim)
    "MLP down (SwiGLU)": ("silu_mul", 3584, 1024, 0),
    "GDN out_proj (gated norm)": ("gated_norm", 2048, 1024, 128),
    "attention o_proj": ("plain", 2048, 1024, 0),
}
TINY = {"MLP down (SwiGLU)": ("silu_mul", 256, 64, 0), "GDN out_proj (gated norm)": ("gated_norm", 128, 64, 32),
        "attention o_proj": ("plain", 128, 64, 0)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--rows", default="1,2,4")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--sweep", action="store_true", help="also try the kernel's tile constants")
    ap.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    args = ap.parse_args()
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are defined
    import torch
    import torch.nn.functional as F

    from benchmarks.report import graph_us, machine, write_section
    from hyla.model.ops.gpu import gemv, norms

    dev, dtype = args.device, torch.bfloat16
    shapes = SHAPES if dev == "cuda" else TINY

    def per_call_us(fn) -> float:
        return graph_us(fn, args.repeats, device=dev)

    rows_list = [int(r) for r in args.rows.split(",")]
    lines, sweeps = [], []
    for name, (prologue, k, n, head) in shapes.items():
        g = torch.Generator(device=dev).manual_seed(0)
        weight = (torch.randn(n, k, device=dev, generator=g) / k**0.5).to(dtype)
        scale = torch.rand(n, device=dev, generator=g) + 0.5
        gw = torch.rand(max(head, 1), device=dev, generator=g).to(dtype)
        ticket = torch.zeros(1, dtype=torch.int32, device=dev)
        for m in rows_list:
            residual = torch.randn(m, n, device=dev, generator=g).to(dtype)
            proj = torch.randn(m, 2 * k, device=dev, generator=g).to(dtype)
            x = proj if prologue == "silu_mul" else proj[:, :k]
            gate = (proj[:, k:], gw, 1e-6) if prologue == "gated_norm" else None

            def unfused():
                p = x
                if prologue == "silu_mul":
                    p = norms.silu_mul_fused(x)
                elif prologue == "gated_norm":
                    p = norms.gated_rms_norm_fused(x, gate[0], gw, 1e-6, k // head)
                return norms.add_rms_norm_fused(F.linear(p, weight), residual, scale, 1e-6)

            def fused():
                return gemv.linear_add_rms_norm(x, weight, residual, scale, 1e-6, ticket, prologue, gate)

            y_ref, s_ref = unfused()
            y, s = fused()
            err = max(float((y.float() - y_ref.float()).abs().max()), float((s.float() - s_ref.float()).abs().max()))
            p_in = x[:, :k].contiguous()
            t_gemm = per_call_us(lambda: F.linear(p_in, weight))
            t_unfused, t_fused = per_call_us(unfused), per_call_us(fused)
            gbs = weight.numel() * weight.element_size() / (t_fused * 1e-6) / 1e9
            splits, _ = gemv.split_k(n, k, gemv.BLOCK_N if m == 1 else max(gemv.BLOCK_N, 16), head or gemv.BLOCK_K)
            lines.append(f"| {name} | {m} | {t_gemm:.1f} | {t_unfused:.1f} | {t_fused:.1f} | "
                         f"**{t_unfused / t_fused:.2f}x** | {gbs:.0f} | {splits} | {err:.2g} |")
            print(lines[-1], flush=True)
            if args.sweep and m == rows_list[0]:
                names = ("BLOCK_N", "MIN_PROGRAMS", "MAX_SPLIT_K", "NUM_WARPS", "BLOCK_K")
                saved = {c: getattr(gemv, c) for c in names}
                best = None  # BLOCK_K: the gated norm's is its head dim whatever the constant
                for config in itertools.product((8, 16, 32), (264, 528, 1056), (16,), (2, 4),
                                                (128,) if head else (128, 256)):
                    for c, v in zip(names, config):
                        setattr(gemv, c, v)
                    try:
                        t = per_call_us(fused)
                    except Exception as e:  # a tile the compiler refuses: skip it
                        print(f"  {dict(zip(names, config))}: {type(e).__name__}")
                        continue
                    if best is None or t < best[0]:
                        best = (t, config)
                for c, v in saved.items():
                    setattr(gemv, c, v)
                if best is not None:
                    sweeps.append(f"| {name} | {m} | {t_fused:.1f} | {best[0]:.1f} | "
                                  + ", ".join(f"{c}={v}" for c, v in zip(names, best[1])) + " |")
                    print(sweeps[-1], flush=True)
    if dev != "cuda" or args.no_write:
        return
    body = (f"`.venv/bin/python benchmarks/out_projection.py --rows {args.rows} --repeats {args.repeats}"
            f"{' --sweep' if args.sweep else ''}` — {machine()}; bf16; µs per call, each variant 20 times in "
            f"one CUDA graph, median of {args.repeats} replays.\n\n"
            "Separate: the prologue's kernel (`silu_mul_fused`, `gated_rms_norm_fused`, or none), the cuBLAS GEMM, "
            "`add_rms_norm_fused`. Fused: `gemv.linear_add_rms_norm`, one launch. GB/s: the weight's bytes over the "
            "fused time. Max diff: the largest gap between the two's outputs (bf16; the GEMM's sums in another "
            "order).\n\n"
            "| projection | rows | GEMM alone (µs) | separate (µs) | fused (µs) | separate / fused | fused GB/s | "
            "K splits | max diff |\n|---|---|---|---|---|---|---|---|---|\n" + "\n".join(lines) + "\n")
    if sweeps:
        body += ("\nTile constants (`--sweep`): the fused kernel with the defaults and at the best of "
                 "BLOCK_N x MIN_PROGRAMS x MAX_SPLIT_K x NUM_WARPS x BLOCK_K, at the first row count.\n\n| projection | rows | defaults (µs) | best (µs) "
                 "| best constants |\n|---|---|---|---|---|\n" + "\n".join(sweeps) + "\n")
    write_section("GPU decode: out projection, residual add and norm", body)


if __name__ == "__main__":
    main()
