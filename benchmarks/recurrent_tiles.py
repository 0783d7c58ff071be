"""hyla's recurrent kernels by tile: device time of each (block, warps) choice (GPU), and the chunked ones.

The Gated DeltaNet and Mamba2 kernels of ``hyla/model/ops/gpu`` (``gated_delta_decode``,
``mamba2_decode``) give each program a block of one head's fp32 state: ``[Dk, BV]`` value columns
(Gated DeltaNet) or ``[BP, N]`` rows (Mamba2), with some number of warps. Their defaults
(``DECODE_TILES``, ``SEGMENT_TILES``: 32 columns or rows, 4 warps) are reasoned, not measured. A
decode step at batch 1 is a few dozen programs, each a short chain of dependent reductions, and an
extend's segments kernel loops over a few hundred tokens that way (the cached prompt's new part):
both are bound by the latency of one token's step, which smaller blocks and fewer warps may cut
(a reduction within one warp needs no barrier) at the price of fewer programs per SM.

This times every choice per call for the GPU benchmark model's Gated DeltaNet (16 heads of
128x128), a NemotronH-sized Mamba2 (64 heads of 64x128, 8 groups), Jamba-1.5-Mini's Mamba1 (8,192
channels of 16 states, ``selective_scan``: blocks of channels) and Kimi-Linear-48B's KDA (32 heads of
128x128, ``kda_decode``): decode at batch 1, 8 and 64,
and one sequence's segments launch of 296 and 512 tokens (bf16 inputs, fp32 states), each call
captured 20 times in a CUDA graph (``report.graph_us``), medians of ``--repeats`` replays. Every
choice's output is checked against the default's (the same recurrence: equal up to the sums'
order). Prints the table and the best choice per row; writes ``## GPU recurrent kernels: tiles``.

Second table: the extend in chunks (``gated_delta_chunks``, ``mamba2_chunks``: ``CHUNK_TILES`` =
tokens per chunk, value columns or state rows per program, warps; ``HALF_DOT_PRECISION``; Gated DeltaNet
with and without its WY pre-pass, ``WY_PREPASS``), one sequence
of 64 to 4,096 tokens, beside the recurrent segments kernel at its default tiles (whose output and
state each choice is checked against, bf16 tolerance): which is faster from how many tokens on
(``CHUNKED_MIN_LEN``), and how the cached TTFT's 296-token extend and a 4,096-token prompt would
fare without fla.

    .venv/bin/python benchmarks/recurrent_tiles.py [--repeats 10] [--no-write]

Without a GPU (``--device cpu``) it runs Triton's interpreter on a few choices and short inputs, to
check the script (times meaningless; nothing written).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import os
import sys
from pathlib import Path
from unittest import mock

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DEV = "cuda"
BLOCKS = (8, 16, 32, 64)
WARPS = (1, 2, 4, 8)
BATCHES = (1, 8, 64)
LENGTHS = (296, 512)
CHUNK_CHOICES = tuple(itertools.product(((16, 16, 4), (16, 32, 4), (16, 64, 4), (16, 32, 8), (32, 32, 4)),
                                        ("tf32x3", "tf32")))
CHUNK_LENGTHS = (64, 296, 512, 4096)


def _bf16(*shape) -> torch.Tensor:
    return torch.randn(*shape, device=DEV).to(torch.bfloat16)


def gdn_cases(gdn):
    """``(row name, module attribute, call, the states it updates)`` for the Gated DeltaNet kernels."""
    hk, hv, d = 16, 16, 128
    width = 2 * hk * d + hv * d
    a_log, dt_bias = torch.randn(hv, device=DEV), torch.randn(hv, device=DEV)
    conv_w = _bf16(width, gdn.CONV_WIDTH)
    for b in BATCHES:  # the step the engine runs: with the conv in the kernel (FUSE_CONV) or not
        qkv, a, bb = _bf16(b, width), _bf16(b, hv), _bf16(b, hv)
        states = torch.zeros(b + 1, hv, d, d, device=DEV)
        conv = torch.zeros(b + 1, width, gdn.CONV_WIDTH - 1, device=DEV, dtype=torch.bfloat16)
        tickets = torch.zeros(b * hk, dtype=torch.int32, device=DEV)
        slots = torch.arange(1, b + 1, device=DEV)

        def decode(qkv=qkv, a=a, bb=bb, states=states, conv=conv, tickets=tickets, slots=slots):
            if gdn.FUSE_CONV:
                return gdn.gated_delta_conv_decode_fused(qkv, conv_w, conv, tickets, a, bb, a_log, dt_bias, states,
                                                         slots, hk, d)
            return gdn.gated_delta_decode_fused(qkv, a, bb, a_log, dt_bias, states, slots, hk, d)
        yield f"Gated DeltaNet decode{' (conv fused)' if gdn.FUSE_CONV else ''}, batch {b}", "DECODE_TILES", \
            decode, (states, conv)
    for t in LENGTHS:
        qkv, a, bb = _bf16(t, width), _bf16(t, hv), _bf16(t, hv)
        states = torch.zeros(2, hv, d, d, device=DEV)
        rows, starts, cu = (torch.tensor(v, device=DEV) for v in ([1], [0], [0, t]))
        out = torch.empty(t, hv, d, device=DEV, dtype=torch.bfloat16)

        def segments(qkv=qkv, a=a, bb=bb, states=states, rows=rows, starts=starts, cu=cu, out=out):
            gdn.gated_delta_segments_fused(qkv, a, bb, a_log, dt_bias, states, rows, starts, cu, out, hk, d)
            return out
        yield f"Gated DeltaNet segments, {t} tokens", "SEGMENT_TILES", segments, (states,)


def mamba2_cases(m2):
    """``(row name, module attribute, call, the states it updates)`` for the Mamba2 kernels."""
    h, p, g, n = 64, 64, 8, 128
    a, d, dt_bias = -torch.rand(h, device=DEV), torch.randn(h, device=DEV), torch.randn(h, device=DEV)
    for b in BATCHES:
        x, dt, bm, cm = _bf16(b, h * p), _bf16(b, h), _bf16(b, g * n), _bf16(b, g * n)
        states = torch.zeros(b + 1, h, p, n, device=DEV)
        slots = torch.arange(1, b + 1, device=DEV)
        yield f"Mamba2 decode, batch {b}", "DECODE_TILES", \
            lambda x=x, dt=dt, bm=bm, cm=cm, states=states, slots=slots: m2.mamba2_state_update_fused(
                x, dt, a, bm, cm, d, dt_bias, states, slots), (states,)
    for t in LENGTHS:
        x, dt, bm, cm = _bf16(t, h * p), _bf16(t, h), _bf16(t, g * n), _bf16(t, g * n)
        states = torch.zeros(2, h, p, n, device=DEV)
        rows, starts, cu = (torch.tensor(v, device=DEV) for v in ([1], [0], [0, t]))
        out = torch.empty(t, h, p, device=DEV, dtype=torch.bfloat16)

        def segments(x=x, dt=dt, bm=bm, cm=cm, states=states, rows=rows, starts=starts, cu=cu, out=out):
            m2.mamba2_segments_fused(x, dt, a, bm, cm, d, dt_bias, states, rows, starts, cu, out)
            return out
        yield f"Mamba2 segments, {t} tokens", "SEGMENT_TILES", segments, (states,)


def mamba1_cases(ss):
    """``(row name, module attribute, call, the states it updates)`` for Mamba1's kernels
    (``selective_scan``): Jamba-1.5-Mini's 8,192 channels of 16 states (256 without a GPU)."""
    i, n = (8192 if DEV == "cuda" else 256), 16
    a, d, dt_bias = -torch.rand(i, n, device=DEV), torch.randn(i, device=DEV), torch.randn(i, device=DEV)
    for b in BATCHES:
        x, z, dt, bc = _bf16(b, i), _bf16(b, i), _bf16(b, i), _bf16(b, 2 * n)
        states = torch.zeros(b + 1, i, n, device=DEV)
        slots = torch.arange(1, b + 1, device=DEV)
        yield f"Mamba1 decode (gated), batch {b}", "DECODE_TILES", \
            lambda x=x, z=z, dt=dt, bc=bc, states=states, slots=slots: ss.selective_state_update_fused(
                x, dt, a, bc[:, :n], bc[:, n:], d, dt_bias, states, slots, z), (states,)
    for t in LENGTHS:
        x, z, dt, bc = _bf16(t, i), _bf16(t, i), _bf16(t, i), _bf16(t, 2 * n)
        states = torch.zeros(2, i, n, device=DEV)
        rows, starts, cu = (torch.tensor(v, device=DEV) for v in ([1], [0], [0, t]))
        out = torch.empty(t, i, device=DEV, dtype=torch.bfloat16)

        def segments(x=x, z=z, dt=dt, bc=bc, states=states, rows=rows, starts=starts, cu=cu, out=out):
            ss.selective_scan_segments_fused(x, dt, a, bc[:, :n], bc[:, n:], d, dt_bias, states, rows, starts, cu,
                                             out, z)
            return out
        yield f"Mamba1 segments (gated), {t} tokens", "SEGMENT_TILES", segments, (states,)


def kda_cases(kd):
    """``(row name, module attribute, call, the states it updates)`` for Kimi Delta Attention's kernels
    (``kda_decode``): Kimi-Linear-48B's 32 heads of 128x128."""
    h, dk = 32, 128
    a_log, dt_bias = torch.randn(h, device=DEV), torch.randn(h * dk, device=DEV)
    for b in BATCHES:
        qkv, f, bb = _bf16(b, 3 * h * dk), _bf16(b, h * dk), _bf16(b, h)
        states = torch.zeros(b + 1, h, dk, dk, device=DEV)
        slots = torch.arange(1, b + 1, device=DEV)
        yield f"KDA decode, batch {b}", "DECODE_TILES", \
            lambda qkv=qkv, f=f, bb=bb, states=states, slots=slots: kd.kda_decode_fused(
                qkv, f, bb, a_log, dt_bias, states, slots), (states,)
    for t in LENGTHS:
        qkv, f, bb = _bf16(t, 3 * h * dk), _bf16(t, h * dk), _bf16(t, h)
        states = torch.zeros(2, h, dk, dk, device=DEV)
        rows, starts, cu = (torch.tensor(v, device=DEV) for v in ([1], [0], [0, t]))
        out = torch.empty(t, h, dk, device=DEV, dtype=torch.bfloat16)

        def segments(qkv=qkv, f=f, bb=bb, states=states, rows=rows, starts=starts, cu=cu, out=out):
            kd.kda_segments_fused(qkv, f, bb, a_log, dt_bias, states, rows, starts, cu, out)
            return out
        yield f"KDA segments, {t} tokens", "SEGMENT_TILES", segments, (states,)


def chunk_cases(gdc, gdn, m2c, m2):
    """``(layer, chunked module, recurrent call, chunked call, out, states)`` per layer and sequence
    length of the second table: one sequence of ``t`` tokens, bf16 inputs, from state row 1."""
    hk, hv, d = 16, 16, 128  # Gated DeltaNet
    width = 2 * hk * d + hv * d
    a_log, dt_bias = torch.randn(hv, device=DEV), torch.randn(hv, device=DEV)
    h, p, g, n = 64, 64, 8, 128  # Mamba2
    am, dm, dtb = -torch.rand(h, device=DEV), torch.randn(h, device=DEV), torch.randn(h, device=DEV)
    for t in CHUNK_LENGTHS:
        rows, starts, cu = (torch.tensor(v, device=DEV) for v in ([1], [0], [0, t]))
        qkv, a, bb = _bf16(t, width), _bf16(t, hv), _bf16(t, hv)
        states = torch.zeros(2, hv, d, d, device=DEV)
        out = torch.empty(t, hv, d, device=DEV, dtype=torch.bfloat16)
        gdn_call = lambda kernel, qkv=qkv, a=a, bb=bb, states=states, rows=rows, starts=starts, cu=cu, out=out: \
            kernel(qkv, a, bb, a_log, dt_bias, states, rows, starts, cu, out, hk, d)  # noqa: E731
        # the chunks without and with the WY pre-pass (gated_delta_chunks.WY_PREPASS), its warps (WY_WARPS)
        for wy, warps in ((False, gdc.WY_WARPS), (True, 1), (True, 4)):
            @mock.patch.multiple(gdc, WY_PREPASS=wy, WY_WARPS=warps)
            def chunked(c=gdn_call):
                c(functools.partial(gdc.gated_delta_chunks_fused, longest=t))
            yield "Gated DeltaNet" + (f", WY pre-pass ({warps} warp{'s' * (warps > 1)})" if wy else ""), gdc, \
                lambda c=gdn_call: c(gdn.gated_delta_segments_fused), chunked, out, states, t
        x, dt, bm, cm = _bf16(t, h * p), _bf16(t, h), _bf16(t, g * n), _bf16(t, g * n)
        mstates = torch.zeros(2, h, p, n, device=DEV)
        mout = torch.empty(t, h, p, device=DEV, dtype=torch.bfloat16)
        m2_call = lambda kernel, x=x, dt=dt, bm=bm, cm=cm, mstates=mstates, rows=rows, starts=starts, cu=cu, \
            mout=mout: kernel(x, dt, am, bm, cm, dm, dtb, mstates, rows, starts, cu, mout)  # noqa: E731
        yield "Mamba2", m2c, lambda c=m2_call: c(m2.mamba2_segments_fused), \
            lambda c=m2_call: c(m2c.mamba2_chunks_fused), mout, mstates, t


def chunk_lines(cases, per_call_us) -> list[str]:
    """The second table (the module docstring): µs per call of the recurrent segments kernel (default
    tiles) and of each ``(CHUNK_TILES, HALF_DOT_PRECISION)`` choice, per layer and sequence length."""
    names = [f"{bt}x{bv}/{w} {p}" for (bt, bv, w), p in CHUNK_CHOICES]
    head = "| layer | tokens | recurrent | " + " | ".join(names) + " | best |"
    lines = [head, "|---|---|---|" + "---|" * (len(CHUNK_CHOICES) + 1)]
    for layer, module, recurrent, chunked, out, states, t in cases:
        states.zero_()
        recurrent()
        ref = (out.float(), states.clone())
        cells = [f"{per_call_us(recurrent):.1f}"]
        best = None
        default = (module.CHUNK_TILES, module.HALF_DOT_PRECISION)  # the inputs are bf16
        for tiles, precision in CHUNK_CHOICES:
            module.CHUNK_TILES, module.HALF_DOT_PRECISION = tiles, precision
            try:
                states.zero_()
                chunked()
                for got, want in zip((out.float(), states), ref):
                    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
                us = per_call_us(chunked)
            except Exception as e:  # a tile the compiler refuses, or a wrong result: reported, skipped
                print(f"{layer} chunks, {t} tokens, {tiles} {precision}: {type(e).__name__}: {str(e)[:300]}",
                      flush=True)
                cells.append("—")
                continue
            finally:
                module.CHUNK_TILES, module.HALF_DOT_PRECISION = default
            cells.append(f"{us:.1f}")
            if best is None or us < best[0]:
                best = (us, tiles, precision)
        won = f"**{best[1][0]}x{best[1][1]}/{best[1][2]} {best[2]}: {best[0]:.1f}**" if best else "—"
        lines.append(f"| {layer} | {t:,} | " + " | ".join(cells) + f" | {won} |")
        print(lines[-1], flush=True)
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    global DEV, BLOCKS, WARPS, BATCHES, LENGTHS, CHUNK_CHOICES, CHUNK_LENGTHS
    DEV = args.device
    if DEV == "cpu":  # a check of the script: the interpreter, before the kernels are defined
        os.environ.setdefault("TRITON_INTERPRET", "1")
        BLOCKS, WARPS, BATCHES, LENGTHS, args.no_write = (16, 32), (4,), (1,), (5,), True
        CHUNK_CHOICES, CHUNK_LENGTHS = CHUNK_CHOICES[2:4], (20,)
    elif not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device (or --device cpu to check the script)")
    from benchmarks.report import graph_us, machine, write_section
    from hyla.model.ops.gpu import gated_delta_chunks as gdc
    from hyla.model.ops.gpu import gated_delta_decode as gdn
    from hyla.model.ops.gpu import mamba2_chunks as m2c
    from hyla.model.ops.gpu import kda_decode as kd
    from hyla.model.ops.gpu import mamba2_decode as m2
    from hyla.model.ops.gpu import selective_scan as ss

    def per_call_us(fn) -> float:
        return graph_us(fn, args.repeats, device=DEV)

    torch.manual_seed(0)
    choices = list(itertools.product(BLOCKS, WARPS))
    head = "| kernel | " + " | ".join(f"{b}/{w}" for b, w in choices) + " | best | default |"
    lines = [head, "|---|" + "---|" * (len(choices) + 2)]
    for module, cases in ((gdn, gdn_cases), (m2, mamba2_cases), (ss, mamba1_cases), (kd, kda_cases)):
        for name, attr, call, states in cases(module):
            default = getattr(module, attr)
            for t in states:
                t.zero_()
            ref = (call().float(), *(t.clone() for t in states))  # the default's output and states, from zero
            cells, best = [], None
            for choice in choices:
                setattr(module, attr, choice)
                try:
                    for t in states:
                        t.zero_()
                    out = call().float()
                    for got, want in zip((out, *states), ref):  # the same recurrence: equal up to the sums' order
                        torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
                    t = per_call_us(call)
                except Exception as e:  # a tile the compiler refuses, or a wrong result: reported, skipped
                    print(f"{name} {choice}: {type(e).__name__}: {str(e)[:300]}", flush=True)
                    cells.append("—")
                    continue
                finally:
                    setattr(module, attr, default)
                cells.append(f"{t:.1f}")
                if best is None or t < best[0]:
                    best = (t, choice)
            t_default = cells[choices.index(default)] if default in choices else "—"
            won = f"**{best[1][0]}/{best[1][1]}: {best[0]:.1f}**" if best else "—"
            lines.append(f"| {name} | " + " | ".join(cells) + f" | {won} | {t_default} |")
            print(lines[-1], flush=True)
    body = "\n".join([
        f"`.venv/bin/python benchmarks/recurrent_tiles.py --repeats {args.repeats}` — {machine()}; "
        "µs per call (CUDA graph of 20 calls, medians); columns: block (Gated DeltaNet and KDA value columns, "
        "Mamba2 state rows, Mamba1 channels) / warps per program.", "", *lines, "",
        "The extend in chunks (`gated_delta_chunks`, `mamba2_chunks`: `CHUNK_TILES` = tokens per chunk x "
        "value columns or state rows / warps; `HALF_DOT_PRECISION`, bf16 inputs) beside the recurrent segments kernel (default "
        "tiles), one sequence, µs per call:", "",
        *chunk_lines(chunk_cases(gdc, gdn, m2c, m2), per_call_us)])
    print(body)
    if not args.no_write:
        write_section("GPU recurrent kernels: tiles", body)


if __name__ == "__main__":
    main()
