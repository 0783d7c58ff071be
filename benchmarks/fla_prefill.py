"""One layer's GPU prefill call: fla's chunked pipeline, a recurrent kernel (fla's, hyla's), hyla's chunked one.

``hyla/model/ops/gpu/fla_chunk.py`` runs a round of segments of at most ``RECURRENT_MAX_LEN``
tokens with a recurrent kernel — hyla's own for Gated DeltaNet and Mamba2 (one Triton launch),
fla's fused recurrent one otherwise — and longer ones with fla's chunked pipeline (ten or so
launches, each through fla's Python wrappers and Triton's autotuner). This measures where the
recurrent kernels stop paying: the wall time of one adapter call (host and device, synchronized
after each call; the host side is what a prefill of a few hundred tokens is bound by), one
sequence of T tokens, the state pool in fp32, activations in bf16, with ``RECURRENT_MAX_LEN`` forced
to 0 (chunked) and to infinity (recurrent: fla's, with hyla's kernel left out, and hyla's twice,
``gated_delta_chunks.CHUNKED_MIN_LEN`` / ``mamba2_chunks.CHUNKED_MIN_LEN`` forced to infinity (its
recurrent kernel) and to 0 (its chunked one); the 296-token row is the new part of the GPU
benchmark's cached-TTFT prompt, the 4,096-token one its cold prompt). Shapes: Gated DeltaNet of the
GPU benchmark's model (16 heads of 128x128) and a Mamba2 layer of NemotronH's size (64 heads, head
dim 64, state 128, 8 groups). Medians of ``--repeats`` calls after 3 warm-up calls; writes ``## GPU prefill: fla
chunked vs recurrent`` in docs/benchmarks.md.

    PYTHONUNBUFFERED=1 .venv/bin/python benchmarks/fla_prefill.py [--repeats 15] [--lengths 1,16,...] [--no-write]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.report import machine, write_section  # noqa: E402
from hyla.model.ops.gpu import fla_chunk  # noqa: E402
from hyla.model.ops.gpu import gated_delta_chunks, mamba2_chunks  # noqa: E402

DEV = "cuda"


def wall_us(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return 1e6 * statistics.median(times)


def gated_delta(t: int):
    from hyla.model.ops.gpu.gated_delta_chunks import segment_kernel

    h, d = 16, 128
    qkv = torch.randn(t, 3 * h * d, device=DEV, dtype=torch.bfloat16)  # the layer's post-conv projection
    q, k, v = (x.view(t, h, d) for x in qkv.split(h * d, 1))
    a, b = torch.randn(t, h, device=DEV, dtype=torch.bfloat16), torch.randn(t, h, device=DEV, dtype=torch.bfloat16)
    a_log, dt_bias = torch.randn(h, device=DEV), torch.randn(h, device=DEV)
    g = -torch.exp(a_log) * torch.nn.functional.softplus(a.float() + dt_bias)
    beta = torch.sigmoid(b)
    pool = torch.zeros(4, h, d, d, device=DEV)
    cu, slots = torch.tensor([0, t], device=DEV), torch.tensor([1], device=DEV)
    own = segment_kernel(qkv, a, b, a_log, dt_bias, h, d)
    return lambda hyla: fla_chunk.chunk_gated_delta_rule_fla(q, k, v, g, beta, cu, pool, slots,
                                                             segments=own if hyla else None)


def mamba2(t: int):
    h, p, groups, n = 64, 64, 8, 128
    x = torch.randn(t, h, p, device=DEV, dtype=torch.bfloat16)
    dt = torch.randn(t, h, device=DEV, dtype=torch.bfloat16)
    b, c = (torch.randn(t, groups, n, device=DEV, dtype=torch.bfloat16) for _ in range(2))
    a, d, dt_bias = -torch.rand(h, device=DEV), torch.randn(h, device=DEV), torch.randn(h, device=DEV)
    pool = torch.zeros(4, h, p, n, device=DEV)
    cu, slots = torch.tensor([0, t], device=DEV), torch.tensor([1], device=DEV)
    scan = fla_chunk.scan_in_rounds

    def call(hyla: bool):
        if not hyla:  # the adapter's own segments kernel left out: fla's recurrent kernel runs
            fla_chunk.scan_in_rounds = lambda *args: scan(*args[:6])
        try:
            return fla_chunk.mamba2_chunk_scan_fla(x, dt, a, b, c, d, dt_bias, cu, pool, slots)
        finally:
            fla_chunk.scan_in_rounds = scan
    return call


LAYERS = {"Gated DeltaNet, 16 heads of 128x128": gated_delta, "Mamba2, 64 heads of 64x128": mamba2}
CHUNKS = {"Gated DeltaNet, 16 heads of 128x128": gated_delta_chunks, "Mamba2, 64 heads of 64x128": mamba2_chunks}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--lengths", default="1,16,64,128,296,512,1024,2048,4096")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    if not torch.cuda.is_available() or not fla_chunk.HAS_FLA:
        raise SystemExit("needs a CUDA device and fla (pip install 'hyla[cuda]')")
    lengths = [int(x) for x in args.lengths.split(",")]
    rows = ["| layer | tokens | fla chunked (ms) | fla recurrent (ms) | hyla recurrent (ms) | hyla chunked (ms) "
            "| fla recurrent / chunked | hyla recurrent / fla recurrent | hyla chunked / fla chunked |",
            "|---|---|---|---|---|---|---|---|---|"]
    saved = fla_chunk.RECURRENT_MAX_LEN
    try:
        for name, make in LAYERS.items():
            chunks = CHUNKS[name]  # the module whose CHUNKED_MIN_LEN picks hyla's kernel
            saved_min = chunks.CHUNKED_MIN_LEN
            for t in lengths:
                fn = make(t)
                fla_chunk.RECURRENT_MAX_LEN = 0
                chunked = wall_us(lambda: fn(False), args.repeats)
                fla_chunk.RECURRENT_MAX_LEN = 1 << 62
                recurrent = wall_us(lambda: fn(False), args.repeats)
                try:
                    chunks.CHUNKED_MIN_LEN = 1 << 62
                    own = wall_us(lambda: fn(True), args.repeats)
                    chunks.CHUNKED_MIN_LEN = 0
                    own_chunked = wall_us(lambda: fn(True), args.repeats)
                finally:
                    chunks.CHUNKED_MIN_LEN = saved_min
                print(f"{name}: T={t}: chunked {chunked:.0f} us, fla recurrent {recurrent:.0f} us, "
                      f"hyla recurrent {own:.0f} us, hyla chunked {own_chunked:.0f} us", flush=True)
                rows.append(f"| {name} | {t:,} | {chunked / 1e3:.2f} | {recurrent / 1e3:.2f} | {own / 1e3:.2f} "
                            f"| {own_chunked / 1e3:.2f} | **{recurrent / chunked:.2f}x** | **{own / recurrent:.2f}x** "
                            f"| **{own_chunked / chunked:.2f}x** |")
    finally:
        fla_chunk.RECURRENT_MAX_LEN = saved
    body = "\n".join([
        f"`.venv/bin/python benchmarks/fla_prefill.py --repeats {args.repeats}` — {machine()}; "
        f"one adapter call of one sequence, wall time (synchronized), medians of {args.repeats}.",
        "",
        f"hyla runs rounds of segments up to `RECURRENT_MAX_LEN` = {saved} tokens with its own kernels "
        f"for these two layers (in chunks from `CHUNKED_MIN_LEN` = {gated_delta_chunks.CHUNKED_MIN_LEN} / "
        f"{mamba2_chunks.CHUNKED_MIN_LEN} tokens).",
        "", *rows])
    print(body)
    if not args.no_write:
        write_section("GPU prefill: fla chunked vs recurrent", body)


if __name__ == "__main__":
    main()
