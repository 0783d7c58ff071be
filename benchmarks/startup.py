"""Engine start-up and the first requests: what the warm-up (``EngineArgs.warmup``) buys.

Each repeat runs two fresh processes, one with ``warmup="off"`` and one with ``"on"`` (what a
process compiles stays in it; Triton's and torch's on-disk caches stay warm, as in a restart). Each
builds an ``Engine`` and times, in order:

* **build**: ``Engine(...)``, the warm-up included when on;
* **first cold / first cached**: the TTFT of the first request, a fresh ``--prompt``-token prompt
  with a checkpoint at ``--cached`` tokens, then of a prompt sharing those ``--cached`` tokens with
  another tail (a cached prefix, e.g. a shared system prompt: gpu_decode.py's cached TTFT);
* **steady cold / steady cached**: the same with fresh tokens, medians of ``STEADY`` more pairs
  (everything has run once).

The ratio to compare is first / steady, with the warm-up and without it (1.0: the first request
pays nothing extra). Prints a markdown table and writes the ``## Engine start-up: the warm-up``
section of docs/benchmarks.md.

    .venv/bin/python benchmarks/startup.py [--repeats 3] [--prompt 4096] [--cached 3800]   # built-in model, CPU
    PYTHONUNBUFFERED=1 .venv/bin/python benchmarks/startup.py --device cuda --gpu-model     # issue 10's model, bf16
    .venv/bin/python benchmarks/startup.py --tiny --repeats 1 --prompt 64 --cached 48 --no-write   # smoke test
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

STEADY = 3  # cold + cached pairs after the first, for the steady-state medians
PHASES = ("build", "first cold", "first cached", "steady cold", "steady cached")


def measure(path: str | None, device: str, dtype: str, mode: str, prompt: int, cached: int) -> dict[str, float]:
    """One process's measurements (seconds) of the model at ``path`` (None: the built-in one),
    ``mode`` the warm-up setting; what a child process prints."""
    import random

    import torch

    from hyla import Engine

    def sync() -> None:
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    t0 = time.perf_counter()
    engine = Engine(path, device=device, dtype=dtype, warmup=mode,
                    max_total_tokens=4 * prompt + 4096, max_state_slots=32, max_running_requests=4)
    sync()
    out = {"build": time.perf_counter() - t0}
    rng = random.Random(1)
    vocab = engine.model_config.vocab_size
    fresh = lambda n: [rng.randrange(3, vocab) for _ in range(n)]  # noqa: E731
    params = {"temperature": 0, "max_new_tokens": 1}

    def ttft(ids: list[int], checkpoints: list[int] | None = None) -> tuple[float, int]:
        t = time.perf_counter()
        res = engine.generate(input_ids=ids, checkpoints=checkpoints, sampling_params=params)
        sync()
        return time.perf_counter() - t, res["meta_info"]["cached_tokens"]

    pairs = []
    for _ in range(1 + STEADY):
        prefix = fresh(cached)
        cold_s, _ = ttft(prefix + fresh(prompt - cached), [cached])
        cached_s, hit = ttft(prefix + fresh(prompt - cached))
        if hit != cached:
            raise RuntimeError(f"the cached request hit {hit} tokens, not {cached}")
        pairs.append((cold_s, cached_s))
    engine.shutdown()
    out["first cold"], out["first cached"] = pairs[0]
    out["steady cold"] = statistics.median(p[0] for p in pairs[1:])
    out["steady cached"] = statistics.median(p[1] for p in pairs[1:])
    return out


def add_model_arguments(ap: argparse.ArgumentParser) -> None:
    """The options :func:`model_dir` reads: the device, the dtype, the model."""
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--gpu-model", action="store_true", help="issue 10's model (benchmarks/gpu_decode.py's FULL)")
    ap.add_argument("--tiny", action="store_true", help="gpu_decode.py's TINY model (a smoke test)")


def resolve_dtype(args: argparse.Namespace) -> None:
    """``--dtype``'s default, from the device: bfloat16 on CUDA, float32 elsewhere."""
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")


def model_flags(args: argparse.Namespace) -> str:
    """The model options of a section's command line."""
    return f"--device {args.device}" + (" --gpu-model" if args.gpu_model else " --tiny" if args.tiny else "")


def model_dir(args: argparse.Namespace, tmp: Path) -> tuple[str | None, str]:
    """The model's directory (None: the built-in model) and its description."""
    if args.gpu_model or args.tiny:
        import torch

        from benchmarks.gpu_decode import FULL, TINY, build

        kw = TINY if args.tiny else FULL
        build(tmp, kw, args.device, getattr(torch, args.dtype))
        return str(tmp), ("gpu_decode.py's model, --tiny" if args.tiny else
                          "issue 10's model (Qwen3.5 layers at 0.8B dims, random weights)")
    return None, "the built-in default model"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(ap)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompt", type=int, default=4096)
    ap.add_argument("--cached", type=int, default=3800)
    ap.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--mode", default="off", help=argparse.SUPPRESS)
    ap.add_argument("--path", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    resolve_dtype(args)
    if not 0 < args.cached < args.prompt:
        ap.error("--cached must be in (0, --prompt)")
    if args.child:
        print(json.dumps(measure(args.path, args.device, args.dtype, args.mode, args.prompt, args.cached)))
        return

    from benchmarks.report import machine, write_section

    with tempfile.TemporaryDirectory(prefix="hyla-startup-") as tmp:
        path, model = model_dir(args, Path(tmp))
        runs: dict[str, list[dict]] = {"off": [], "on": []}
        for rep in range(args.repeats):
            for mode in runs:
                cmd = [sys.executable, __file__, "--child", "--mode", mode, "--device", args.device, "--dtype",
                       args.dtype, "--prompt", str(args.prompt), "--cached", str(args.cached)]
                cmd += ["--path", path] if path else []
                res = subprocess.run(cmd, capture_output=True, text=True, check=False)
                if res.returncode:
                    sys.exit(f"the child process failed:\n{res.stderr[-4000:]}")
                runs[mode].append(json.loads(res.stdout.strip().splitlines()[-1]))
                print(f"repeat {rep + 1}, warmup {mode}: " + ", ".join(f"{k} {v * 1e3:.0f} ms"
                                                                        for k, v in runs[mode][-1].items()), flush=True)
    med = {mode: {k: statistics.median(r[k] for r in rs) for k in PHASES} for mode, rs in runs.items()}
    ratio = lambda m, kind: med[m][f"first {kind}"] / med[m][f"steady {kind}"]  # noqa: E731
    flags = model_flags(args)
    rows = "\n".join(f"| {k} | {med['off'][k] * 1e3:,.0f} | {med['on'][k] * 1e3:,.0f} |" for k in PHASES)
    body = f"""`.venv/bin/python benchmarks/startup.py {flags} --repeats {args.repeats} --prompt {args.prompt} --cached {args.cached}` — {machine()}; {model}, {args.dtype}; medians of {args.repeats} fresh processes per column (ms).

| phase | warmup off | warmup on |
|---|---|---|
{rows}
| **first cold / steady cold** | **{ratio('off', 'cold'):.2f}x** | **{ratio('on', 'cold'):.2f}x** |
| **first cached / steady cached** | **{ratio('off', 'cached'):.2f}x** | **{ratio('on', 'cached'):.2f}x** |
"""
    print(body)
    if not args.no_write:
        write_section("Engine start-up: the warm-up", body)


if __name__ == "__main__":
    main()
