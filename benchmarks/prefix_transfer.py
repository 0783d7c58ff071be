"""Moving a cached prefix between engines: what it costs against computing the prompt again.

One engine prefills a prompt of ``--lengths`` tokens (one token generated); its prefix — the KV of
every attention layer and the recurrent state after it — is exported (``Engine.export_prefix``),
turned into bytes (``CachedPrefix.to_bytes``, what ``/export_prefix`` sends) and imported into a
second engine (``Engine.import_prefix`` of the bytes, what ``/import_prefix`` does), which then
answers the prompt from its cache. Per length, medians of ``--repeats`` rounds (after a warm-up
round) of:

* ``cold TTFT``: the second engine's time to first token with its cache flushed (the prompt computed);
* ``export``, ``to bytes``, ``import``: each step of the move, and the bytes it moves;
* ``TTFT after import``: the second engine's time to first token on the imported prefix;
* ``move + TTFT / cold``: the whole path against computing it again (below 1: moving pays, before any
  network time: the bytes over a link of B bytes/s add bytes / B).

The first token and its logprob after the import must be the cold run's (within 1e-4 in fp32): the
cache never changes what the model computes. The built-in default model in fp32 on the CPU by
default; ``--device cuda --gpu-model`` runs issue 10's model in bf16.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/prefix_transfer.py [--lengths 512,2048,4000] [--repeats 5]
        [--device cuda --gpu-model] [--no-write]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.report import machine, write_section  # noqa: E402
from benchmarks.startup import add_model_arguments, model_dir, model_flags, resolve_dtype  # noqa: E402
from hyla import Engine  # noqa: E402

TITLE = "Moving a cached prefix between engines"


def first_token(engine: Engine, prompt: list[int]) -> tuple[float, int, float]:
    """(seconds to the first token, the token, its logprob)."""
    start = time.perf_counter()
    out = engine.generate(input_ids=prompt, sampling_params={"temperature": 0, "max_new_tokens": 1},
                          return_logprob=True)
    elapsed = time.perf_counter() - start
    logprob, token, _ = out["meta_info"]["output_token_logprobs"][0]
    return elapsed, token, logprob


def timed(fn):
    start = time.perf_counter()
    value = fn()
    return time.perf_counter() - start, value


def measure(source: Engine, dest: Engine, prompt: list[int]) -> dict[str, float]:
    """One round: the prompt prefilled on ``source`` (its cache flushed first), then moved to ``dest``."""
    assert source.flush_cache() and dest.flush_cache()
    cold, token, logprob = first_token(dest, prompt)
    assert dest.flush_cache()
    first_token(source, prompt)
    t_export, prefix = timed(lambda: source.export_prefix(prompt))
    t_bytes, data = timed(prefix.to_bytes)
    t_import, cached = timed(lambda: dest.import_prefix(data))
    assert cached == len(prefix) == len(prompt) - 1, (cached, len(prefix))
    warm, token2, logprob2 = first_token(dest, prompt)
    assert token2 == token and abs(logprob2 - logprob) < 1e-4, (token, token2, logprob, logprob2)
    return {"cold": cold, "export": t_export, "bytes_s": t_bytes, "import": t_import, "warm": warm,
            "mib": len(data) / 2**20}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_arguments(ap)
    ap.add_argument("--lengths", default="512,2048,4000", help="prompt lengths in tokens, comma-separated")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--no-write", action="store_true", help="print, do not write docs/benchmarks.md")
    args = ap.parse_args()
    resolve_dtype(args)
    lengths = [int(x) for x in args.lengths.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        path, what = model_dir(args, Path(tmp))
        opts = dict(device=args.device, dtype=args.dtype, max_total_tokens=2 * max(lengths) + 256,
                    context_length=max(lengths) + 64, max_running_requests=4)
        rows = []
        with Engine(path, **opts) as source, Engine(path, **opts) as dest:
            vocab = source.model_config.vocab_size
            for n in lengths:
                prompt = [random.Random(n).randrange(3, vocab) for _ in range(n)]
                runs = [measure(source, dest, prompt) for _ in range(1 + args.repeats)][1:]
                med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
                move = med["export"] + med["bytes_s"] + med["import"]
                rows.append((n, med, move))
                print(f"{n} tokens: cold TTFT {med['cold'] * 1e3:.1f} ms; export {med['export'] * 1e3:.1f} ms, "
                      f"to bytes {med['bytes_s'] * 1e3:.1f} ms, import {med['import'] * 1e3:.1f} ms "
                      f"({med['mib']:.2f} MiB); TTFT after import {med['warm'] * 1e3:.1f} ms; "
                      f"move + TTFT / cold {(move + med['warm']) / med['cold']:.3f}", flush=True)
    cmd = (f"OMP_NUM_THREADS={torch_threads()} .venv/bin/python benchmarks/prefix_transfer.py {model_flags(args)} "
           f"--lengths {args.lengths} --repeats {args.repeats}")
    body = f"""`{cmd}` — {machine()}; {what}, {args.dtype}; medians of {args.repeats} rounds after a warm-up.

A prompt prefilled on one engine, its cached prefix (all of the prompt but its last token: KV and the
state after it) exported, turned into bytes and imported into a second engine (`Engine.export_prefix`,
`CachedPrefix.to_bytes`, `Engine.import_prefix`: what `/export_prefix` and `/import_prefix` do), which then
answers the prompt from its cache: the same first token and logprob (1e-4) as its cold run. Network time
not included (add the bytes over the link's rate).

| prompt tokens | cold TTFT (ms) | export (ms) | to bytes (ms) | import (ms) | bytes (MiB) | TTFT after import (ms) | move + TTFT / cold |
|---|---|---|---|---|---|---|---|
""" + "\n".join(f"| {n:,} | {m['cold'] * 1e3:.1f} | {m['export'] * 1e3:.2f} | {m['bytes_s'] * 1e3:.2f} | "
                f"{m['import'] * 1e3:.2f} | {m['mib']:.2f} | {m['warm'] * 1e3:.1f} | **{(mv + m['warm']) / m['cold']:.3f}** |"
                for n, m, mv in rows)
    print(body)
    if not args.no_write:
        write_section(TITLE, body)


def torch_threads() -> int:
    import torch

    return torch.get_num_threads()


if __name__ == "__main__":
    main()
