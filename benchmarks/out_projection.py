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
``BLOCK_K``) at the first ``--rows`` and prints the best per shape, to tune them (and the in
projections' ``gemv.LINEAR_TILE``, below).

Then the in projections at one row (Gated DeltaNet's, the MLP's gate + up, attention's qkv, 1024 ->
8224 / 7168 / 5120): cuBLAS against ``gemv.linear``, without and with programmatic dependent
launch (``pdl.py``: in a graph of 20 calls each call's weight loads overlap the call before), and a
part's seam as the decode step has it: the fused out projection followed by the next part's in
projection (cuBLAS, the GEMV, the GEMV with PDL). Writes ``## GPU decode: out projection, residual
add and norm``.

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
from unittest import mock

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPES = {  # name: (prologue, K, N, gated-norm head dim)
    "MLP down (SwiGLU)": ("silu_mul", 3584, 1024, 0),
    "GDN out_proj (gated norm)": ("gated_norm", 2048, 1024, 128),
    "attention o_proj": ("plain", 2048, 1024, 0),
}
TINY = {"MLP down (SwiGLU)": ("silu_mul", 256, 64, 0), "GDN out_proj (gated norm)": ("gated_norm", 128, 64, 32),
        "attention o_proj": ("plain", 128, 64, 0)}
IN_SHAPES = {"GDN in_proj": (1024, 8224), "MLP gate_up": (1024, 7168), "attention qkv_proj": (1024, 5120)}  # K, N
TINY_IN = {"GDN in_proj": (64, 200), "MLP gate_up": (64, 96), "attention qkv_proj": (64, 80)}


def in_projection_lines(dev: str, per_call_us, tiny: bool, sweep: bool) -> list[str]:
    """The in projections' table rows (module docstring): per call, µs, and GB/s of the weight; with
    ``sweep``, each projection's GEMV + PDL time at every ``gemv.LINEAR_TILE`` tried, printed."""
    import torch
    import torch.nn.functional as F

    from hyla.model.ops.gpu import gemv, pdl

    def timed(fn, with_pdl: bool) -> float:
        with mock.patch.object(pdl, "PDL", with_pdl):
            return per_call_us(fn)

    lines = []
    hidden = 64 if tiny else 1024
    g = torch.Generator(device=dev).manual_seed(1)
    down = (torch.randn(hidden, 4 * hidden, device=dev, generator=g) / (4 * hidden)**0.5).to(torch.bfloat16)
    h = torch.randn(1, 8 * hidden, device=dev, generator=g).to(torch.bfloat16)  # [gate | up] of the MLP before
    residual = torch.randn(1, hidden, device=dev, generator=g).to(torch.bfloat16)
    scale, ticket = torch.rand(hidden, device=dev, generator=g) + 0.5, torch.zeros(1, dtype=torch.int32, device=dev)
    for name, (k, n) in (TINY_IN if tiny else IN_SHAPES).items():
        weight = (torch.randn(n, k, device=dev, generator=g) / k**0.5).to(torch.bfloat16)
        x = torch.randn(1, k, device=dev, generator=g).to(torch.bfloat16)
        err = float((gemv.linear(x, weight).float() - F.linear(x, weight).float()).abs().max())
        t_gemm = timed(lambda: F.linear(x, weight), False)
        t_gemv, t_pdl = timed(lambda: gemv.linear(x, weight), False), timed(lambda: gemv.linear(x, weight), True)

        def seam(in_proj):  # the MLP's fused down projection + norm, then this in projection of its output
            y, _ = gemv.linear_add_rms_norm(h, down, residual, scale, 1e-6, ticket, "silu_mul")
            return in_proj(y)

        s_gemm = timed(lambda: seam(lambda y: F.linear(y, weight)), False)
        s_gemv = timed(lambda: seam(lambda y: gemv.linear(y, weight)), False)
        s_pdl = timed(lambda: seam(lambda y: gemv.linear(y, weight)), True)
        gb = weight.numel() * weight.element_size() / 1e9
        if sweep:
            tried = []
            for tile in itertools.product((4096, 8192, 16384), (2, 4, 8)):
                with mock.patch.object(gemv, "LINEAR_TILE", tile):
                    tried.append((timed(lambda: gemv.linear(x, weight), True), tile))
            print(f"  {name}: LINEAR_TILE (elements, warps) -> µs with PDL: "
                  + ", ".join(f"{t}: {us:.1f}" for us, t in sorted(tried)), flush=True)
        lines.append(f"| {name} | {t_gemm:.1f} ({gb / (t_gemm * 1e-6):.0f}) | {t_gemv:.1f} ({gb / (t_gemv * 1e-6):.0f}) "
                     f"| {t_pdl:.1f} ({gb / (t_pdl * 1e-6):.0f}) | {s_gemm:.1f} | {s_gemv:.1f} | {s_pdl:.1f} | "
                     f"**{s_gemm / s_pdl:.2f}x** | {err:.2g} |")
        print(lines[-1], flush=True)
    return lines


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
    in_lines = in_projection_lines(dev, per_call_us, dev != "cuda", args.sweep)
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
    body += ("\nIn projections, one row: µs per call (GB/s of the weight). cuBLAS: `F.linear`; GEMV: `gemv.linear`, "
             "launched without and with PDL. Seam: the MLP's fused down projection + norm "
             "(`linear_add_rms_norm`, 4096 -> 1024) followed by this projection of its output, as the decode step "
             "runs a part's end and the next part's start; the last column is cuBLAS's seam over the PDL one. "
             "Max diff: GEMV against cuBLAS (bf16, sums in another order).\n\n"
             "| projection | cuBLAS | GEMV | GEMV + PDL | seam, cuBLAS | seam, GEMV | seam, GEMV + PDL | "
             "cuBLAS / PDL seam | max diff |\n|---|---|---|---|---|---|---|---|---|\n" + "\n".join(in_lines) + "\n")
    write_section("GPU decode: out projection, residual add and norm", body)


if __name__ == "__main__":
    main()
