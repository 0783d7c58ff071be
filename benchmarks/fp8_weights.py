"""FP8 weights: one FP8 checkpoint served with its projections and experts kept in float8
(``fp8_weights="keep"``) against the same checkpoint dequantized at load (``"dequantize"``).

The model (the built-in one, ``--gpu-model``: issue 10's, or ``--tiny``) is quantized per 128 x 128
block into an FP8 checkpoint as Qwen's FP8 releases are (``tests/checkpoints.quantize_checkpoint``),
then two engines serve it, in alternating rounds (``report.off_on``; off = dequantize, on = keep):

* **weights (MB)**: the bytes the model's parameters and scales take (a shared tensor once);
* **decode tok/s** at batch 1 and ``--batch``: ``--new-tokens`` greedy tokens per request after a
  short prompt, prefill subtracted (t(1 + N new) - t(1 new));
* **TTFT (ms)** of one ``--prompt``-token prompt.

On a CPU a kept weight is dequantized by PyTorch in every step (the reference path), which is why
``fp8_weights="auto"`` dequantizes at load there; on a GPU the Triton kernels read the float8
bytes (``ops/gpu/fp8.py``). Writes the ``## FP8 weights: kept against dequantized`` section of
docs/benchmarks.md.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/fp8_weights.py [--repeats 5]
    PYTHONUNBUFFERED=1 .venv/bin/python benchmarks/fp8_weights.py --device cuda --gpu-model
    .venv/bin/python benchmarks/fp8_weights.py --tiny --repeats 1 --no-write   # smoke
"""

from __future__ import annotations

import argparse
import random
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from benchmarks.report import machine, off_on, off_on_rows, write_section  # noqa: E402
from benchmarks.startup import add_model_arguments, model_dir, resolve_dtype  # noqa: E402
from hyla import Engine  # noqa: E402

SECTION = "FP8 weights: kept against dequantized"


def weight_bytes(model) -> float:
    """MB of ``model``'s parameters and float8 scales, a shared tensor once."""
    seen, total = set(), 0
    tensors = [*model.parameters(), *(b for name, b in model.named_buffers() if name.endswith("_scale"))]
    for t in tensors:
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total / 1e6


def measure(engine: Engine, rng: random.Random, args: argparse.Namespace) -> dict[str, float]:
    vocab = engine.model_config.vocab_size
    fresh = lambda n: [rng.randrange(3, vocab) for _ in range(n)]  # noqa: E731

    def timed(batch: int, new: int) -> float:
        prompts = [fresh(32) for _ in range(batch)]
        t0 = time.perf_counter()
        engine.generate(input_ids=prompts, sampling_params={"temperature": 0, "max_new_tokens": new,
                                                            "ignore_eos": True})
        return time.perf_counter() - t0

    out = {"weights (MB)": weight_bytes(engine.model)}
    for b in (1, args.batch):
        steps = timed(b, 1 + args.new_tokens) - timed(b, 1)
        out[f"decode batch {b} (tok/s)"] = b * args.new_tokens / steps
    t0 = time.perf_counter()
    engine.generate(input_ids=fresh(args.prompt), sampling_params={"temperature": 0, "max_new_tokens": 1})
    out["TTFT (ms)"] = 1e3 * (time.perf_counter() - t0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(ap)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    args = ap.parse_args()
    resolve_dtype(args)

    import checkpoints
    from hyla.engine.engine import DEFAULT_MODEL_DIR

    with tempfile.TemporaryDirectory(prefix="hyla-fp8-") as tmp:
        built, desc = model_dir(args, Path(tmp) / "built")
        src = Path(tmp) / "model"
        shutil.copytree(built or DEFAULT_MODEL_DIR, src)  # (quantized beside it: in tmp)
        fp8 = checkpoints.quantize_checkpoint(src, block=(128, 128))
        opts = dict(device=args.device, dtype=args.dtype, max_running_requests=max(8, args.batch),
                    max_total_tokens=4 * (args.prompt + args.batch * (args.new_tokens + 40)))
        engines = {"off": Engine(fp8, fp8_weights="dequantize", **opts), "on": Engine(fp8, fp8_weights="keep", **opts)}
        print(engines["on"].summary(), flush=True)
        rng = random.Random(0)
        med = off_on(engines, args.repeats, lambda mode, engine, rep: measure(engine, rng, args), "fp8 weights")

    metrics = ["weights (MB)", "decode batch 1 (tok/s)", f"decode batch {args.batch} (tok/s)", "TTFT (ms)"]
    cmd = shlex.join([".venv/bin/python", "benchmarks/fp8_weights.py", *sys.argv[1:]])
    body = "\n".join([
        f"`{cmd}` — {machine()}; {desc}, {args.dtype}, quantized per 128 x 128 block into an FP8 checkpoint; "
        f"medians of {args.repeats} rounds, the two engines alternating.",
        "",
        "| measurement | dequantized at load | kept in float8 | kept / dequantized |",
        "|---|---|---|---|",
        off_on_rows(med, metrics, {"weights (MB)": 1, "TTFT (ms)": 1}),
    ]) + "\n"
    print(body)
    if not args.no_write:
        write_section(SECTION, body)


if __name__ == "__main__":
    main()
