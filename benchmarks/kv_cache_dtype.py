"""A float8 KV cache (``kv_cache_dtype="fp8_e4m3"``) against the KV cache in the model's dtype (``auto``).

One model (the built-in one, ``--gpu-model``: issue 10's, or ``--tiny``), two engines alternating
(``report.off_on``; off = auto, on = fp8):

* **KV bytes per token** (every attention layer's K and V) and so **tokens per GiB** of KV pool: what
  a memory budget holds (``Engine``'s pools sized from memory scale with it);
* **decode tok/s** at batch 1 and ``--batch`` after ``--context``-token prompts (each step reads the
  whole context's K/V): the requests stream their tokens, and the rate is the tokens that arrive
  between the moment every request has its first token and the moment the first one ends, over that
  time (differences of whole runs' times, t(1 + N new) - t(1 new), drowned in the prefill of thousands of
  tokens);
* **TTFT (ms)** of the ``--context``-token prompt.

And once, outside the timed rounds, what float8 rounding does to the outputs: ``--prompts`` greedy
requests of ``--new-tokens`` tokens after ``--context``-token prompts, float8 against auto: the share of
the tokens equal up to each request's first divergence, and the chosen tokens' |logprob difference|
(median and max) there. On a CPU a float8 K/V is widened by PyTorch in every step; on a GPU the Triton
kernels read the bytes (``ops/gpu/decode_attention.py``). Writes the ``## KV cache dtype: float8
against the model's`` section of docs/benchmarks.md.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/kv_cache_dtype.py [--repeats 5]
    PYTHONUNBUFFERED=1 .venv/bin/python benchmarks/kv_cache_dtype.py --device cuda --gpu-model --dtype bfloat16
    .venv/bin/python benchmarks/kv_cache_dtype.py --tiny --repeats 1 --context 64 --no-write   # smoke
"""

from __future__ import annotations

import argparse
import os
import random
import shlex
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.report import machine, off_on, off_on_rows, write_section  # noqa: E402
from benchmarks.startup import add_model_arguments, model_dir, resolve_dtype  # noqa: E402
from hyla import Engine  # noqa: E402

SECTION = "KV cache dtype: float8 against the model's"


def measure(engine: Engine, rng: random.Random, args: argparse.Namespace) -> dict[str, float]:
    vocab = engine.model_config.vocab_size
    fresh = lambda n: [rng.randrange(3, vocab) for _ in range(n)]  # noqa: E731

    per_token = engine.kv_pool.bytes_per_token
    out = {"KV bytes per token": per_token, "tokens per GiB of KV (K)": 2**30 / per_token / 1e3}
    for b in (1, args.batch):
        out[f"decode batch {b} after {args.context} tokens (tok/s)"] = decode_rate(
            engine, [fresh(args.context) for _ in range(b)], 1 + args.new_tokens)
    t0 = time.perf_counter()
    engine.generate(input_ids=fresh(args.context), sampling_params={"temperature": 0, "max_new_tokens": 1})
    out[f"TTFT of {args.context} tokens (ms)"] = 1e3 * (time.perf_counter() - t0)
    return out


def decode_rate(engine: Engine, prompts: list[list[int]], new: int) -> float:
    """Output tokens per second while every request decodes: the requests stream, each chunk stamped as it
    arrives; the tokens stamped after the last request's first token and up to the first request's last,
    over that time."""
    greedy = {"temperature": 0, "max_new_tokens": new, "ignore_eos": True}
    stamps: list[list[tuple[float, int]]] = [[] for _ in prompts]

    def consume(i: int, stream) -> None:
        for chunk in stream:
            stamps[i].append((time.perf_counter(), len(chunk["output_ids"])))

    threads = [threading.Thread(target=consume, args=(i, engine.generate(input_ids=p, sampling_params=greedy,
                                                                          stream=True)))
               for i, p in enumerate(prompts)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    t0, t1 = max(s[0][0] for s in stamps), min(s[-1][0] for s in stamps)
    if t1 <= t0:
        raise RuntimeError("no decode step ran with every request: raise --new-tokens")
    return sum(n for s in stamps for t, n in s if t0 < t <= t1) / (t1 - t0)


def agreement(engines: dict[str, Engine], args: argparse.Namespace) -> str:
    """Greedy outputs of float8 against auto: tokens equal up to each first divergence, and the chosen
    tokens' |logprob difference| there."""
    rng = random.Random(1)
    vocab = engines["off"].model_config.vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(args.context)] for _ in range(args.prompts)]
    greedy = {"temperature": 0, "max_new_tokens": args.new_tokens, "ignore_eos": True}
    outs = {mode: e.generate(input_ids=prompts, sampling_params=greedy, return_logprob=True)
            for mode, e in engines.items()}
    same, diffs = 0, []
    for a, b in zip(outs["off"], outs["on"]):
        for (la, ta, _), (lb, tb, _) in zip(a["meta_info"]["output_token_logprobs"],
                                            b["meta_info"]["output_token_logprobs"]):
            if ta != tb:
                break
            same += 1
            diffs.append(abs(la - lb))
    total = args.prompts * args.new_tokens
    return (f"Outputs, float8 against auto ({args.prompts} greedy requests of {args.new_tokens} tokens after "
            f"{args.context}-token prompts): {same} of {total} tokens ({same / total:.0%}) equal up to each "
            f"request's first divergence; there the chosen tokens' logprobs differ by {statistics.median(diffs):.1e} "
            f"(median) and {max(diffs):.1e} (max).")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(ap)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=2048, help="prompt tokens before the timed decode steps")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--prompts", type=int, default=8, help="requests of the output comparison")
    ap.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    args = ap.parse_args()
    resolve_dtype(args)

    with tempfile.TemporaryDirectory(prefix="hyla-kv-") as tmp:
        built, desc = model_dir(args, Path(tmp) / "built")
        opts = dict(device=args.device, dtype=args.dtype, max_running_requests=max(8, args.batch),
                    max_total_tokens=2 * (args.batch + 1) * (args.context + args.new_tokens + 8))
        engines = {"off": Engine(built, kv_cache_dtype="auto", **opts),
                   "on": Engine(built, kv_cache_dtype="fp8", **opts)}
        print(engines["on"].summary(), flush=True)
        outputs = agreement(engines, args)
        print(outputs, flush=True)
        rng = random.Random(0)
        med = off_on(engines, args.repeats, lambda mode, engine, rep: measure(engine, rng, args), "kv cache dtype")

    metrics = list(med["off"])
    threads = f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']} " if "OMP_NUM_THREADS" in os.environ else ""
    cmd = threads + shlex.join([".venv/bin/python", "benchmarks/kv_cache_dtype.py", *sys.argv[1:]])
    body = "\n".join([
        f"`{cmd}` — {machine()}; {desc}, {args.dtype}; medians of {args.repeats} rounds, the two engines "
        "alternating.",
        "",
        f"| measurement | KV in {args.dtype} (auto) | KV in float8 e4m3 | float8 / auto |",
        "|---|---|---|---|",
        off_on_rows(med, metrics, {"KV bytes per token": 0, "tokens per GiB of KV (K)": 1}),
        "",
        outputs,
        "",
        "On a CPU every step widens the float8 K/V it reads (a table of the 256 bytes' values, `attention.widened`), "
        "so decode is slower there and the gain is capacity alone; a GPU's kernels read the bytes (half of bf16's).",
    ]) + "\n"
    print(body)
    if not args.no_write:
        write_section(SECTION, body)


if __name__ == "__main__":
    main()
