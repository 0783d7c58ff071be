"""What a sliding-window attention layer costs on the CPU's PyTorch path: its window, not its context.

A sliding layer (Lara-4-Mini's, LFM3's) attends over its last ``W`` positions. Its decode step reads each
sequence's last ``W`` keys alone (``ops.attention.window_kv_table``) and its extends the keys from
``prefix - W + 1`` on (``ops.attention._extend_attention``); before 2026-12-03 both gathered the whole
context and masked what lay outside the window. Both are timed in the same run, per layer (one attention
call; the K/V pool holds the context), at Lara-4-Mini's attention shape (16 query / 4 KV heads of 128
(its 32 / 4 halved), fp32) and window (512):

* decode: ``B`` sequences of ``context`` tokens, one query each — the window's keys
  (``window_kv_table`` + ``decode_attention``) against the whole table under ``window_mask`` (the old path, and
  the cost of a full-attention layer of the same shape);
* extend: ``E`` new tokens after ``prefix`` cached ones (a prefill chunk) — ``paged_attention(window=W)``
  against ``extend_sdpa`` over every key with the window's mask.

Medians of ``--repeats`` runs (after a warm-up), milliseconds per call.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/window_attention.py [--threads 2] [--repeats 7] [--no-write]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.report import machine, median_ms, write_section  # noqa: E402
from hyla.model.ops.attention import (  # noqa: E402
    decode_attention,
    decode_kv_rows,
    extend_sdpa,
    paged_attention,
    window_kv_table,
    window_mask,
)

HQ, HKV, D, WINDOW = 16, 4, 128, 512
DECODES = [(1, 4096), (1, 32768), (8, 4096), (8, 16384)]  # (batch, context)
EXTENDS = [(4096, 512), (16384, 512), (16384, 2048)]  # (prefix, new tokens)


def decode_case(batch: int, context: int, window: int, repeats: int) -> tuple[float, float]:
    """(the window's keys, the whole context masked) in ms, one decode call."""
    gen = torch.Generator().manual_seed(0)
    kb, vb = (torch.randn(batch * context + 1, HKV, D, generator=gen) for _ in range(2))
    table = torch.arange(batch * context).view(batch, context) + 1  # slot 0: the sentinel
    lens = torch.full((batch,), context)
    q = torch.randn(batch, HQ, D, generator=gen)

    def windowed():
        t, m = window_kv_table(table, lens, window)
        return decode_attention(q, kb, vb, t, m, D**-0.5, decode_kv_rows(t, HKV))

    mask, rows = window_mask(lens, context, window), decode_kv_rows(table, HKV)
    torch.testing.assert_close(windowed(), decode_attention(q, kb, vb, table, mask, D**-0.5, rows))
    return (median_ms(windowed, repeats),
            median_ms(lambda: decode_attention(q, kb, vb, table, mask, D**-0.5, rows), repeats))


def extend_case(prefix: int, new: int, window: int, repeats: int) -> tuple[float, float]:
    """(the window's keys, every key masked) in ms, one extend call of ``new`` tokens after ``prefix``."""
    gen = torch.Generator().manual_seed(1)
    kb, vb = (torch.randn(prefix + new + 1, HKV, D, generator=gen) for _ in range(2))
    q = torch.randn(new, HQ, D, generator=gen)
    k, v = (torch.randn(new, HKV, D, generator=gen) for _ in range(2))
    slots = torch.arange(1, prefix + new + 1)
    args = (slots[prefix:], slots, torch.tensor([0, prefix + new]), [prefix], [new], D**-0.5)

    def windowed():
        return paged_attention(q, k, v, kb, vb, *args, window=window)

    def whole():  # (the K/V of the new tokens are in the pool: windowed() wrote them)
        keys, values = kb[slots].transpose(0, 1), vb[slots].transpose(0, 1)
        return extend_sdpa(q.transpose(0, 1), keys, values, prefix, None, D**-0.5, window).transpose(0, 1)

    torch.testing.assert_close(windowed(), whole(), atol=1e-5, rtol=1e-5)
    return median_ms(windowed, repeats), median_ms(whole, repeats)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--window", type=int, default=WINDOW)
    ap.add_argument("--decodes", default=",".join(f"{b}x{c}" for b, c in DECODES),
                    help="batch x context pairs, e.g. 1x4096,8x16384")
    ap.add_argument("--extends", default=",".join(f"{p}+{e}" for p, e in EXTENDS),
                    help="prefix + new-token pairs, e.g. 4096+512")
    ap.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    w = args.window
    rows = ["| call | window's keys (ms) | whole context, masked (ms) | speed-up |", "|---|---|---|---|"]
    for pair in args.decodes.split(","):
        b, c = (int(x) for x in pair.split("x"))
        ours, whole = decode_case(b, c, w, args.repeats)
        rows.append(f"| decode, batch {b}, context {c:,} | {ours:.2f} | {whole:.2f} | {whole / ours:.1f}x |")
        print(rows[-1], flush=True)
    for pair in args.extends.split(","):
        p, e = (int(x) for x in pair.split("+"))
        ours, whole = extend_case(p, e, w, args.repeats)
        rows.append(f"| extend of {e:,} after {p:,} | {ours:.2f} | {whole:.2f} | {whole / ours:.1f}x |")
        print(rows[-1], flush=True)
    if not args.no_write:
        write_section("Sliding-window attention on the CPU", f"""`benchmarks/window_attention.py` — {machine()}; \
{args.threads} thread(s), one sliding layer of {HQ} query / {HKV} KV heads of {D} (fp32), window {w}, medians of \
{args.repeats}. The window's keys alone (`window_kv_table`, and extends from `prefix - W + 1`) against the whole \
context under the window's mask (the path before 2026-12-03, and what a full-attention layer of this shape costs).

""" + "\n".join(rows))


if __name__ == "__main__":
    main()
