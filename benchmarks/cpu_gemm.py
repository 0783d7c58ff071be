"""A decode step's projections on CPU at a real model's size: the paths hyla can take, per row count.

A decode or verify step multiplies a few rows (one per request, or per draft token) by every weight
of the model, each streamed from memory. Which GEMM does that best depends on the weight's layout and
size, the row count and the threads: MKL (``F.linear``) packs the weight on every call and runs
a few rows on one thread; ``linear.split_linear`` spreads one call over the threads; oneDNN
(``linear.onednn_linear``) packs on the fly too, faster at some shapes. ``linear.few_row_linear``
picks among them with constants measured on one 2-core machine: this script measures the choice on
any other.

The weights are those of ``cpu_model_size.py``'s 0.65 B model (``gpu_decode.py``'s ``FULL``: 24
layers, hidden 1,024, vocab 151,936, tied embeddings) in fp32, shaped and laid out as hyla loads
them: the projections column-major (``linear.relayout_weights_``), the tied LM head row-major (the
embedding's storage). Each distinct weight is allocated in enough copies (random values) that a
pass over them streams at least ``--stream-mb`` from memory, as a step does. For each thread count
and row count, per path, the median over ``--repeats`` passes of the time per call; a step's
projections are the sum over the model's weights. Paths: **MKL** (``F.linear``), **split**
(``split_linear``, more than one thread, at most ``SPLIT_MAX_ROWS`` rows), **oneDNN**, and **hyla**
(``Linear``'s eager choice: ``few_row_linear``, else ``F.linear``). Thread CPU time would count
spinning workers, so this is wall clock: run it on an idle machine. Writes the ``## CPU few-row
projections`` section of docs/benchmarks.md.

    .venv/bin/python benchmarks/cpu_gemm.py [--threads 1,2] [--rows 1,2,4,8,16,64,128] [--repeats 5]
        [--stream-mb 256] [--no-write]
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks"), str(ROOT / "tests")]

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from hyla.model import linear  # noqa: E402

PATHS = ("MKL", "split", "oneDNN", "hyla")


def model_weights(dims: dict) -> Counter:
    """``(out, in, row_major) -> count`` of every projection of the model ``dims`` describes (a
    Qwen3.5 config), laid out as loading leaves them."""
    import checkpoints

    from hyla.model.architectures import ARCHITECTURES
    from hyla.model.config import ModelConfig

    config = ModelConfig.from_hf({**checkpoints.QWEN3_5_KW, **dims, "architectures": ["Qwen3_5ForCausalLM"]}, "float32")
    with torch.device("meta"):
        model = ARCHITECTURES[config.architecture].model_class(config)
    tied = model.lm_head.weight if config.tie_word_embeddings else None
    return Counter((*m.weight.shape, m.weight is tied) for m in model.modules() if isinstance(m, torch.nn.Linear))


def path_call(path: str, threads: int):
    """``f(x, w) -> y`` of one path; None where the path does not apply."""
    def split(x, w):
        return linear.split_linear(x, w, 2 * threads)

    def hyla(x, w):
        y = linear.few_row_linear(x, w)
        return F.linear(x, w) if y is None else y

    return {"MKL": F.linear, "split": split, "oneDNN": linear.onednn_linear, "hyla": hyla}[path]


def measure(shapes: Counter, threads: int, rows_list: list[int], repeats: int, stream_bytes: int) -> dict:
    """``{(out, in, row_major): {rows: {path: seconds per call}}}`` at ``threads``, paths interleaved."""
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    result = {}
    for out, inp, row_major in shapes:
        copies = max(1, math.ceil(stream_bytes / (out * inp * 4)))
        ws = [torch.randn(out, inp) * inp ** -0.5 for _ in range(copies)]
        if not row_major:
            ws = [w.t().contiguous().t() for w in ws]  # [out, in] over [in, out] storage
        per_rows = {}
        for rows in rows_list:
            x = torch.randn(rows, inp)
            paths = [p for p in PATHS if p != "split" or (threads > 1 and rows <= linear.SPLIT_MAX_ROWS
                                                          and linear.split_linear(x, ws[0], 2 * threads) is not None)]
            if not linear.HAS_ONEDNN:
                paths.remove("oneDNN")
            calls = {p: path_call(p, threads) for p in paths}
            times: dict[str, list[float]] = {p: [] for p in paths}
            with torch.inference_mode():
                for p in paths:  # warm-up (oneDNN builds its primitive on the first call)
                    calls[p](x, ws[0])
                for r in range(repeats):
                    for p in (paths if r % 2 == 0 else paths[::-1]):
                        t0 = time.perf_counter()
                        for w in ws:
                            calls[p](x, w)
                        times[p].append((time.perf_counter() - t0) / copies)
            per_rows[rows] = {p: statistics.median(v) for p, v in times.items()}
        result[(out, inp, row_major)] = per_rows
        del ws
    return result


def tables(shapes: Counter, runs: dict[int, dict], rows_list: list[int]) -> str:
    """A step's projections per thread and row count; then each weight's GB/s per path."""
    step = ["| threads | rows | " + " | ".join(f"{p} (ms)" for p in PATHS) + " | hyla / MKL |",
            "|---|---|" + "---|" * (len(PATHS) + 1)]
    for threads, run in runs.items():
        for rows in rows_list:
            total = {p: sum(n * run[s][rows][p] for s, n in shapes.items()) if all(p in run[s][rows] for s in shapes)
                     else None for p in PATHS}
            cells = ["—" if v is None else f"{v * 1e3:,.1f}" for v in total.values()]
            step.append(f"| {threads} | {rows} | " + " | ".join(cells) + f" | {total['hyla'] / total['MKL']:.2f} |")
    per = ["| weight (out x in, layout, per step) | threads | rows | " + " | ".join(f"{p} GB/s" for p in PATHS) + " |",
           "|---|---|---|" + "---|" * len(PATHS)]
    for s, n in shapes.items():
        out, inp, row_major = s
        name = f"{out:,} x {inp:,}, {'row' if row_major else 'column'}-major, x{n}"
        for threads, run in runs.items():
            for rows in rows_list:
                t = run[s][rows]
                cells = [f"{out * inp * 4 / t[p] / 1e9:.1f}" if p in t else "—" for p in PATHS]
                per.append(f"| {name} | {threads} | {rows} | " + " | ".join(cells) + " |")
    return "\n".join(step) + "\n\n" + "\n".join(per)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", default="1,2", help="comma-separated intra-op thread counts")
    ap.add_argument("--rows", default="1,2,4,8,16,64,128", help="comma-separated row counts")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--stream-mb", type=int, default=256, help="at least this much weight streamed per pass")
    ap.add_argument("--tiny", action="store_true", help="gpu_decode.py's tiny dims, to test the script (implies --no-write)")
    ap.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    args = ap.parse_args()

    import gpu_decode
    from benchmarks.report import machine

    shapes = model_weights(gpu_decode.TINY if args.tiny else gpu_decode.FULL)
    rows_list = [int(r) for r in args.rows.split(",")]
    runs = {t: measure(shapes, t, rows_list, args.repeats, args.stream_mb << 20)
            for t in (int(x) for x in args.threads.split(","))}
    cmd = (f".venv/bin/python benchmarks/cpu_gemm.py --threads {args.threads} --rows {args.rows} "
           f"--repeats {args.repeats} --stream-mb {args.stream_mb}")
    body = f"""`{cmd}` — {machine()}; the 0.65 B model's projections (`cpu_model_size.py`) in fp32, as
hyla lays them out, each streamed from memory (at least {args.stream_mb} MB a pass); wall clock, medians of
{args.repeats} passes, paths interleaved. MKL: `F.linear`; split: `linear.split_linear` over 2 x threads
blocks; oneDNN: `linear.onednn_linear`; hyla: `linear.few_row_linear`'s choice (else `F.linear`). A
step's projections: every weight of the model once, the sum of the times per call.

{tables(shapes, runs, rows_list)}
"""
    print(body)
    if not args.no_write and not args.tiny:
        from benchmarks.report import write_section

        write_section("CPU few-row projections", body)


if __name__ == "__main__":
    main()
