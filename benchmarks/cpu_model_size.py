"""CPU serving at a real model's size, per thread count, against llama.cpp in the same run.

The built-in default model (7.4 M parameters, ``cpu_decode.py``) measures what a step costs beyond
its arithmetic: at its size that is most of it. This measures the other end: the GPU benchmark's
model (``gpu_decode.py``'s ``FULL``: a Qwen3.5-style dense model at Qwen3.5-0.8B dims, 24 layers = 18
Gated DeltaNet + 6 attention, vocab 151,936, tied embeddings, random weights; 0.65 B parameters),
in fp32 (2.6 GB, built once into ``--model-dir``), where a decode step is the weights streaming from
memory (every weight once per step) and a prefill is GEMMs.

For each thread count of ``--threads`` (a fresh engine per count: torch applies its thread count to
threads started after it), the sides interleaved repeat by repeat:

* **hyla**: ``Engine`` (eager, fp32, ``cpu_threads`` = the count);
* **hyla, unsplit**: the same engine with its few-row projections run as
  ``F.linear`` (``unsplit_projections`` around its calls): the engine before ``linear.split_linear``
  and the oneDNN LM head (``linear.few_row_linear``), in the same process;
* **hyla + compile_decode** (``--compile``): a second engine, its decode steps through
  ``torch.compile`` (its start-up, compilation included, is reported). Two engines in one process
  are two scheduler threads with an OpenMP team each, which slow each other's parallel regions at
  more than one thread (``hyla/engine/cpu_process.py``): compare it at 1 thread, or alone
  (``--sides compiled,llama.cpp``);
* **llama.cpp** (``--llama-cpp DIR``, built by ``scripts/build_llama_cpp.sh``): the same checkpoint
  as an fp32 GGUF (its ``qwen35`` architecture loads it as it is), ``llama-bench`` for the prompt and
  batch-1 rows, ``llama-server --parallel 8`` for the 8 requests (``benchmarks/llama_cpp.py``).

Rows: prefill tok/s of one 512-token prompt (hyla: ``512 / t(1 new token)``, its one decode step
and sampling included; llama.cpp: ``llama-bench -p 512``); decode tok/s of one request after a
512-token prompt (``N / (t(1 + N) - t(1))``, llama.cpp: ``llama-bench -d 512 -n N``); output tok/s of 8
concurrent 128 → 64 requests, prefill included (``--prompt`` / ``--batch-prompt`` / ``--batch-new``
change those lengths: the tests' quick run). Wall clock, medians of ``--repeats``. Prints a
markdown table and writes the ``## CPU serving at a 0.65 B model`` section of docs/benchmarks.md.

``--sides`` picks which of them run (``hyla``, ``unsplit``, ``compiled``, ``llama.cpp``; default: the
first two, ``compiled`` with ``--compile``, ``llama.cpp`` with ``--llama-cpp``): an engine left out is
not built, so ``--sides compiled,llama.cpp --llama-cpp DIR --threads 2`` measures the compiled engine
with no other engine's OpenMP team in the process.

    .venv/bin/python benchmarks/cpu_model_size.py [--threads 1,2] [--repeats 3] [--new-tokens 32]
        [--compile] [--llama-cpp ../llama.cpp] [--sides hyla,unsplit,compiled,llama.cpp]
        [--model-dir /tmp/hyla-qwen3.5-0.65b] [--no-write] [--tiny] [--prompt 512] [--batch-prompt 128] [--batch-new 64]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import shutil
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks"), str(ROOT / "tests")]

from cpu_decode import BATCH, NEW_8, PROMPT_1, PROMPT_8, concurrent_output, decode_after_prompt  # noqa: E402

COMPILED = "hyla + `compile_decode`"  # the side's name
SIDES = ("hyla", "unsplit", "compiled", "llama.cpp")  # --sides


def row_labels(prompt: int = PROMPT_1, batch_prompt: int = PROMPT_8, batch_new: int = NEW_8) -> dict[str, str]:
    """Each row's key and label, for the prompt and request lengths measured."""
    return {"p512": f"prefill tok/s, one {prompt}-token prompt",
            "d1": f"decode tok/s, batch 1, after a {prompt}-token prompt",
            "b8": f"output tok/s, {BATCH} concurrent {batch_prompt} → {batch_new} requests"}


ROWS = row_labels()  # key: label


def build_model(model_dir: Path, tiny: bool = False) -> Path:
    """The GPU benchmark's model in fp32 at ``model_dir`` (built once: ~1 minute, 2.6 GB), with the
    built-in model's tokenizer beside it (llama.cpp's converter wants one, and pads its 4,096 tokens
    to the model's vocabulary; every prompt here is token ids)."""
    import torch

    import gpu_decode
    from hyla.engine.engine import DEFAULT_MODEL_DIR

    if not (model_dir / "model.safetensors").exists():
        gpu_decode.build(model_dir, gpu_decode.TINY if tiny else gpu_decode.FULL, "cpu", torch.float32)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(Path(DEFAULT_MODEL_DIR) / name, model_dir / name)
    return model_dir


@contextlib.contextmanager
def unsplit_projections():
    """Few-row projections as ``F.linear`` while inside (``linear.few_row_linear`` off: no split,
    no oneDNN)."""
    from hyla.model import linear

    before = linear.SPLIT_MAX_ROWS, linear.ONEDNN_ROWS
    linear.SPLIT_MAX_ROWS, linear.ONEDNN_ROWS = 0, range(0)
    try:
        yield
    finally:
        linear.SPLIT_MAX_ROWS, linear.ONEDNN_ROWS = before


def hyla_side(engine, rng: random.Random, n: int, vocab: int, unsplit: bool = False, prompt: int = PROMPT_1,
              batch_prompt: int = PROMPT_8, batch_new: int = NEW_8) -> dict:
    """The three measurements of one engine; ``unsplit``: with ``linear.few_row_linear`` off."""
    mode = unsplit_projections if unsplit else contextlib.nullcontext

    def prompt_and_decode() -> tuple[float, float]:
        with mode():
            return decode_after_prompt(engine, rng, vocab, prompt, n)

    def batch8() -> float:
        with mode():
            return concurrent_output(engine, rng, vocab, batch_prompt, batch_new)

    return {"p512+d1": prompt_and_decode, "b8": batch8}


def llama_cpp_side(server, rng: random.Random, n: int, prompt: int = PROMPT_1, batch_prompt: int = PROMPT_8,
                   batch_new: int = NEW_8) -> dict:
    from benchmarks import llama_cpp

    def prompt_and_decode() -> tuple[float, float]:
        return (llama_cpp.prefill_tok_s(server.llama_dir, server.gguf, server.threads, prompt),
                llama_cpp.decode_tok_s(server.llama_dir, server.gguf, server.threads, prompt, n))

    return {"p512+d1": prompt_and_decode,
            "b8": lambda: llama_cpp.serve_output_tok_s(server, rng, BATCH, batch_prompt, batch_new)}


def measure(model_dir: Path, threads: int, args) -> dict[str, dict[str, float]]:
    """Medians per side of every row, at ``threads`` (and the compiled engine's ``startup_s``)."""
    from hyla import Engine

    rng = random.Random(threads)
    sizes = dict(dtype="float32", cpu_threads=threads, max_total_tokens=8192, max_state_slots=16)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    lengths = dict(prompt=args.prompt, batch_prompt=args.batch_prompt, batch_new=args.batch_new)
    with contextlib.ExitStack() as stack:
        sides = {}
        if {"hyla", "unsplit"} & args.sides:
            engine = Engine(str(model_dir), **sizes)
            stack.callback(engine.shutdown)
            if "hyla" in args.sides:
                sides["hyla"] = hyla_side(engine, rng, args.new_tokens, vocab, **lengths)
            if "unsplit" in args.sides:
                sides["hyla, unsplit"] = hyla_side(engine, rng, args.new_tokens, vocab, unsplit=True, **lengths)
        if "compiled" in args.sides:
            t0 = time.perf_counter()
            compiled = Engine(str(model_dir), compile_decode=True, **sizes)
            startup_s = time.perf_counter() - t0
            stack.callback(compiled.shutdown)
            sides[COMPILED] = hyla_side(compiled, rng, args.new_tokens, vocab, **lengths)
        if "llama.cpp" in args.sides:
            from benchmarks import llama_cpp

            gguf = llama_cpp.convert(model_dir, args.llama_cpp, args.llama_cpp / "models" / "hyla-qwen3.5-0.65b-f32.gguf")
            server = stack.enter_context(llama_cpp.LlamaServer(args.llama_cpp, gguf, threads))
            sides["llama.cpp"] = llama_cpp_side(server, rng, args.new_tokens, **lengths)
        for side in sides.values():  # warm-up
            side["p512+d1"](), side["b8"]()
        samples = {name: {k: [] for k in ROWS} for name in sides}
        for _ in range(args.repeats):
            for name, side in sides.items():
                p, d = side["p512+d1"]()
                samples[name]["p512"].append(p)
                samples[name]["d1"].append(d)
                samples[name]["b8"].append(side["b8"]())
                print(f"  {threads} thread(s), {name}: " + ", ".join(f"{k} {v[-1]:,.1f}" for k, v in samples[name].items()),
                      flush=True)
    result = {name: {k: statistics.median(v) for k, v in rows.items()} for name, rows in samples.items()}
    if "compiled" in args.sides:
        result[COMPILED]["startup_s"] = startup_s
    return result


def table(runs: dict[int, dict[str, dict[str, float]]], labels: dict[str, str] = ROWS) -> str:
    """One row per measurement and thread count; in parentheses each hyla side's ratio to llama.cpp."""
    present = {side for run in runs.values() for side in run}
    sides = [s for s in ("hyla", "hyla, unsplit", COMPILED, "llama.cpp") if s in present]
    lines = ["| measurement | threads | " + " | ".join(sides) + " |", "|---|---|" + "---|" * len(sides)]
    for key, label in labels.items():
        for threads, run in runs.items():
            peer = run.get("llama.cpp", {}).get(key)
            cells = []
            for side in sides:
                v = run.get(side, {}).get(key)
                ratio = f" ({v / peer:.2f}x)" if v is not None and peer and side != "llama.cpp" else ""
                cells.append("—" if v is None else f"{v:,.1f}{ratio}")
            lines.append(f"| {label} | {threads} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts, each side at each")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=32, help="N decode tokens timed at batch 1")
    ap.add_argument("--llama-cpp", type=Path, metavar="DIR", help="also measure llama.cpp, built in DIR")
    ap.add_argument("--compile", action="store_true", help="also measure Engine(compile_decode=True)")
    ap.add_argument("--model-dir", type=Path, default=Path("/tmp/hyla-qwen3.5-0.65b"),
                    help="where the fp32 model is built (once) and read")
    ap.add_argument("--sides", help="comma-separated sides to run, of " + ", ".join(SIDES) + " (default: hyla, "
                    "unsplit, and compiled with --compile, llama.cpp with --llama-cpp); an engine left out is not built")
    ap.add_argument("--tiny", action="store_true", help="gpu_decode.py's tiny dims, to test the script (implies --no-write)")
    ap.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    ap.add_argument("--prompt", type=int, default=PROMPT_1, help="the batch-1 rows' prompt tokens (default %(default)s)")
    ap.add_argument("--batch-prompt", type=int, default=PROMPT_8,
                    help=f"the {BATCH} concurrent requests' prompt tokens (default %(default)s)")
    ap.add_argument("--batch-new", type=int, default=NEW_8,
                    help=f"the {BATCH} concurrent requests' new tokens (default %(default)s)")
    args = ap.parse_args()
    if args.llama_cpp is not None:
        args.llama_cpp = args.llama_cpp.resolve()
    default_sides = {"hyla", "unsplit"} | ({"compiled"} if args.compile else set()) | ({"llama.cpp"} if args.llama_cpp else set())
    args.sides = default_sides if args.sides is None else {x.strip() for x in args.sides.split(",") if x.strip()}
    if not args.sides or args.sides - set(SIDES):
        ap.error(f"--sides: one or more of {', '.join(SIDES)}, got {sorted(args.sides)}")
    if "llama.cpp" in args.sides and args.llama_cpp is None:
        ap.error("--sides llama.cpp needs --llama-cpp DIR")
    model_dir = build_model(args.model_dir, args.tiny)
    t0 = time.perf_counter()
    runs = {t: measure(model_dir, t, args) for t in (int(x) for x in args.threads.split(","))}

    from benchmarks.report import machine

    cmd = (f".venv/bin/python benchmarks/cpu_model_size.py --threads {args.threads} --repeats {args.repeats} "
           f"--new-tokens {args.new_tokens}" + (" --compile" if args.compile else "")
           + (" --llama-cpp ../llama.cpp" if args.llama_cpp else "")
           + (f" --sides {','.join(s for s in SIDES if s in args.sides)}" if args.sides != default_sides else "")
           + "".join(f" --{flag} {value}" for flag, value, default in (
               ("prompt", args.prompt, PROMPT_1), ("batch-prompt", args.batch_prompt, PROMPT_8),
               ("batch-new", args.batch_new, NEW_8)) if value != default))
    startup = "".join(f" `compile_decode` start-up (engine construction, graphs compiled) at {t} thread(s): "
                      f"{run[COMPILED]['startup_s']:.0f} s." for t, run in runs.items() if COMPILED in run)
    described = {"hyla": " \"hyla\": the engine, eager (`cpu_threads` = the threads).",
                 "unsplit": " \"hyla, unsplit\": the same engine with few-row projections as `F.linear` (before "
                            "`linear.few_row_linear`: the split and the oneDNN LM head).",
                 "compiled": f" \"{COMPILED}\": an engine of its own with its decode steps through `torch.compile`."}
    sides_text = "".join(text for side, text in described.items() if side in args.sides)
    body = f"""`{cmd}` — {machine()}; the GPU benchmark's model (Qwen3.5-style, 24 layers: 18 Gated
DeltaNet + 6 attention, hidden 1,024, vocab 151,936, tied embeddings; 0.65 B parameters, random
weights) in fp32 (2.6 GB); wall clock, medians of {args.repeats} runs, sides interleaved; in parentheses
the ratio to llama.cpp at the same threads (the same checkpoint as an fp32 GGUF).{sides_text}{startup}

{table(runs, row_labels(args.prompt, args.batch_prompt, args.batch_new))}
"""
    print(body)
    print(f"(total {time.perf_counter() - t0:.0f} s)")
    if not args.no_write and not args.tiny:
        from benchmarks.report import write_section

        write_section("CPU serving at a 0.65 B model", body)


if __name__ == "__main__":
    main()
