"""The extend attention's tiles: device time of each choice against PyTorch's fused attention (GPU).

A cached prompt's new part (the cached TTFT: 296 new tokens after 3,800 cached, padded to the
320-token extend graph) attends over the whole prefix in each attention layer. hyla's kernel
(``extend_attention.paged_extend_attention``) reads the keys through the request table, a block
of ``TILE_ROWS`` query rows (tokens x the query heads of a KV head) per program, ``TILE_KEYS`` keys
per step, ``NUM_WARPS`` warps; split over the keys, then merged (with the output gate) by the
decode kernel's second stage. Its defaults are reasoned, not measured: on an H200 the layer took
~124 µs (section "GPU decode", the cached TTFT's profile), ~0.74 ms of that extend's 4.2 ms.

This times every tile for the GPU benchmark model's attention (8 query / 2 KV heads of 256, bf16)
at the cached TTFT's shape and at 1,024 new tokens after 3,072, each call captured 20 times in a
CUDA graph (``report.graph_us``), medians of ``--repeats`` replays, beside PyTorch's
``scaled_dot_product_attention`` over the same keys already gathered into contiguous tensors (its
flash or memory-efficient kernel, the causal mask aligned to the end: the peer, which neither
gathers nor merges splits). Every choice's output is checked against the default's. Writes
``## GPU prefill: extend attention tiles``.

    .venv/bin/python benchmarks/attention_tiles.py [--repeats 10] [--no-write] [--splits N]

Without a GPU (``--device cpu``) it runs Triton's interpreter on a few choices and a small shape,
to check the script (times meaningless; nothing written). ``--splits N`` splits each call's keys N
ways instead of the kernel's choice (``num_splits``: 32 at the small shape, most of them empty, each
an interpreted program): the tests' quick run.
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

HEADS = (8, 2, 256)  # query heads, KV heads, head dim
SHAPES = ((320, 3800), (1024, 3072))  # (new tokens as the graph runs them, cached tokens)
TILES = tuple(itertools.product((32, 64, 128), (16, 32, 64), (4, 8)))  # TILE_ROWS, TILE_KEYS, NUM_WARPS
TINY = dict(heads=(4, 2, 32), shapes=((24, 40),), tiles=((64, 0, 8), (32, 16, 4), (128, 32, 4)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    ap.add_argument("--splits", type=int, default=None,
                    help="split each call's keys this many ways (a power of 2; default: the kernel's num_splits)")
    args = ap.parse_args()
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are defined
    import torch
    import torch.nn.functional as F
    from torch.nn.attention.bias import causal_lower_right

    from benchmarks.report import graph_us, machine, write_section
    from hyla.model.ops.gpu import extend_attention as ea

    dev = args.device
    tiny = dev != "cuda"
    (hq, hkv, d), shapes = (TINY["heads"], TINY["shapes"]) if tiny else (HEADS, SHAPES)
    tiles = TINY["tiles"] if tiny else ((ea.TILE_ROWS, ea.TILE_KEYS, ea.NUM_WARPS),) + TILES
    dtype = torch.float32 if tiny else torch.bfloat16
    names = ("TILE_ROWS", "TILE_KEYS", "NUM_WARPS")
    rows, best_rows = [], []
    for new, cached in shapes:
        total = new + cached
        g = torch.Generator(device=dev).manual_seed(new)
        kb = torch.randn(total + 1, hkv, d, device=dev, generator=g).to(dtype)  # slot 0: the sentinel
        vb = torch.randn(total + 1, hkv, d, device=dev, generator=g).to(dtype)
        slots = torch.randperm(total, device=dev, generator=g) + 1  # the sequence's slots, scattered
        table = torch.zeros(2, total, dtype=torch.int32, device=dev)
        table[1] = slots.int()
        row = torch.ones(1, dtype=torch.long, device=dev)
        q = torch.randn(new, hq, d, device=dev, generator=g).to(dtype)
        lens = torch.arange(cached + 1, total + 1, device=dev)
        scale = d**-0.5

        def ours():
            return ea.paged_extend_attention(q, kb, vb, table, row, lens, scale, splits=args.splits)

        k, v = kb[slots].transpose(0, 1)[None], vb[slots].transpose(0, 1)[None]  # [1, Hkv, S, D], gathered
        mask = causal_lower_right(new, total)

        def sdpa():
            return F.scaled_dot_product_attention(q.transpose(0, 1)[None], k, v, attn_mask=mask, scale=scale,
                                                  enable_gqa=True)

        ref = ours().float()
        peer = sdpa()[0].transpose(0, 1).float()
        gap = float((ref - peer).abs().max())
        t_peer = graph_us(sdpa, args.repeats, device=dev)
        times = []
        for tile in tiles:
            try:
                with mock.patch.multiple(ea, **dict(zip(names, tile))):
                    err = float((ours().float() - ref).abs().max())
                    times.append((graph_us(ours, args.repeats, device=dev), tile, err))
            except Exception as e:  # a tile the compiler refuses (shared memory, registers): skip it
                print(f"  {dict(zip(names, tile))}: {type(e).__name__}: {str(e)[:120]}", flush=True)
        default_us = times[0][0]
        fmt = lambda t: f"{t[1][0]}/{t[1][1] or 'auto'}/{t[1][2]}"  # noqa: E731
        for us, tile, err in times[1:] if not tiny else times:
            rows.append(f"| {new} after {cached:,} | {fmt((us, tile))} | {us:.1f} | {us / t_peer:.2f}x | {err:.2g} |")
            print(rows[-1], flush=True)
        fastest = min(times)
        best_rows.append(f"| {new} after {cached:,} | {t_peer:.1f} | {default_us:.1f} ({default_us / t_peer:.2f}x) | "
                         f"**{fmt(fastest)}: {fastest[0]:.1f}** ({fastest[0] / t_peer:.2f}x) | {gap:.2g} |")
        print(best_rows[-1], flush=True)
    if tiny or args.no_write:
        return
    splits_arg = f" --splits {args.splits}" if args.splits else ""
    body = (f"`.venv/bin/python benchmarks/attention_tiles.py --repeats {args.repeats}{splits_arg}` — {machine()}; bf16, "
            f"{hq} query / {hkv} KV heads of {d}; µs per call, 20 calls in one CUDA graph, median of "
            f"{args.repeats} replays. hyla: `paged_extend_attention` (stage 1 over the request table + the merge); "
            "SDPA: `F.scaled_dot_product_attention` on the keys gathered beforehand (not timed), the causal mask "
            "aligned to the end.\n\n"
            "| new tokens | SDPA (µs) | hyla, defaults (µs, / SDPA) | hyla, best tile (rows/keys/warps) | "
            "max diff, defaults vs SDPA |\n|---|---|---|---|---|\n" + "\n".join(best_rows)
            + "\n\nEvery tile (TILE_ROWS / TILE_KEYS / NUM_WARPS; auto: 32 keys for these 256-wide heads), "
            "time over SDPA's, largest gap to the defaults' output:\n\n"
            "| new tokens | tile | µs | / SDPA | max diff |\n|---|---|---|---|---|\n" + "\n".join(rows) + "\n")
    write_section("GPU prefill: extend attention tiles", body)


if __name__ == "__main__":
    main()
