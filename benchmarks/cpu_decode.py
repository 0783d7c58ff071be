"""CPU decode throughput of the whole engine on the built-in default model, against transformers.

Measured, fp32, in one process, every side interleaved repeat by repeat (the machine is shared):

* **batch 1**: decode tok/s of one request after a 512-token prompt. Each side runs a fresh prompt
  with 1 and with ``1 + N`` new tokens (greedy, EOS ignored); decode tok/s = ``N / (t(1 + N) - t(1))``,
  so prefill and start-up cancel out (llama.cpp's ``tg`` after ``pp512``). hyla:
  ``Engine.generate``; transformers: ``generate``.
* **batch 8**: output tok/s of 8 concurrent 128 → 64 requests (greedy, EOS ignored): 512 output
  tokens / wall time of the whole batch, prefill included (hyla: one ``Engine.generate`` call with
  8 requests; transformers: one batched ``generate``).
* **forward only**: ms per decode step of the bare model forward (no scheduler, no sampling) at
  batch 1 (512 cached tokens) and 8 (128 cached tokens): hyla's decode forward on one prebuilt batch
  (fresh random tokens every step) vs one HF forward of B tokens with its cache; thread CPU time
  (1 thread), so a busy machine inflates it less than wall time. And the prefill of the 8-request
  workload's prompts (8 128-token prompts into empty states, the forward alone) vs one
  batched HF forward with a fresh cache, in thread CPU time too.

Sides: hyla (eager), hyla with ``compile_decode`` (``--compile``; its start-up, compilation
included, is reported), transformers, and llama.cpp with ``--llama-cpp DIR`` (a tree built by
``scripts/build_llama_cpp.sh``: the same checkpoint converted to an fp32 GGUF, its batch-1 number
from ``llama-bench``, its 8-request number from ``llama-server``; ``benchmarks/llama_cpp.py`` says
how each matches hyla's metric; no forward-only rows). The issue's targets are ratios to llama.cpp:
with it in the run they are read off its numbers here, without it off the issue's (823 / 1,025,
another day on this machine). ``--before DIR`` first runs this same script against another
checkout (e.g. ``git worktree add /tmp/cpu-base 2ed1d04``) in a subprocess and adds its numbers
(each run is compared with the transformers it measured itself). Fresh random prompts every repeat
(the prefix cache stays on, as served, and never hits). Prints a markdown table and writes the
``## CPU decode`` section of docs/benchmarks.md.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/cpu_decode.py [--repeats 5] [--threads 1]
        [--new-tokens 128] [--compile] [--llama-cpp DIR] [--before DIR] [--hyla-root DIR] [--json] [--no-write]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPT_1 = 512
PROMPT_8, NEW_8, BATCH = 128, 64, 8
METRICS = ("d1", "b8", "f1", "f8", "p8")  # decode tok/s b1, output tok/s b8, forward ms/step b1, b8, ms/prefill
ISSUE_LLAMA_CPP = {"d1": 823.0, "b8": 1025.0}  # the issue's llama.cpp numbers (1 thread, another day)


def fresh(n: int, rng: random.Random, vocab: int) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(n)]


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def thread_option(threads: int) -> dict:
    """``cpu_threads=threads`` for ``Engine(...)`` where the imported hyla has that option (an older
    checkout measured with ``--before`` has not: it runs with the threads torch was set to)."""
    from hyla.engine.args import EngineArgs

    return {"cpu_threads": threads} if "cpu_threads" in EngineArgs.field_help() else {}


def greedy(max_new: int) -> dict:
    return {"temperature": 0, "max_new_tokens": max_new, "ignore_eos": True}


def decode_after_prompt(engine, rng: random.Random, vocab: int, prompt: int, new: int) -> tuple[float, float]:
    """One request through ``engine.generate``: ``(prefill tok/s, decode tok/s)``. A fresh
    ``prompt``-token prompt with 1 new token takes ``t(1)``, another with ``1 + new`` takes
    ``t(1 + new)``; prefill = ``prompt / t(1)`` (its one decode step included), decode =
    ``new / (t(1 + new) - t(1))``, in which prefill and start-up cancel (llama.cpp's ``tg`` after ``pp``)."""
    short = timed(lambda: engine.generate(input_ids=fresh(prompt, rng, vocab), sampling_params=greedy(1)))
    long = timed(lambda: engine.generate(input_ids=fresh(prompt, rng, vocab), sampling_params=greedy(1 + new)))
    return prompt / short, new / max(long - short, 1e-9)


def concurrent_output(engine, rng: random.Random, vocab: int, prompt: int, new: int) -> float:
    """Output tok/s of ``BATCH`` concurrent fresh ``prompt`` → ``new`` requests, one ``engine.generate``
    call, prefill included."""
    prompts = [fresh(prompt, rng, vocab) for _ in range(BATCH)]
    return BATCH * new / timed(lambda: engine.generate(input_ids=prompts, sampling_params=greedy(new)))


def hf_side(hf, rng: random.Random, vocab: int, n: int, prompt: int = PROMPT_1, batch_prompt: int = PROMPT_8,
            batch_new: int = NEW_8):
    """transformers' ``generate`` (greedy, ``n`` tokens forced): ``(decode tok/s at batch 1 after a
    ``prompt``-token prompt, output tok/s of ``BATCH`` ``batch_prompt`` → ``batch_new`` requests)`` as two
    callables, measured as hyla's are."""
    import torch

    @torch.no_grad()
    def hf_generate(ids: torch.Tensor, max_new: int) -> None:
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                          min_new_tokens=max_new, do_sample=False, pad_token_id=0)
        assert out.shape[1] == ids.shape[1] + max_new

    def decode_b1() -> float:
        p = torch.tensor([fresh(prompt, rng, vocab)])
        short = timed(lambda: hf_generate(p, 1))
        return n / max(timed(lambda: hf_generate(p, 1 + n)) - short, 1e-9)

    def batch8() -> float:
        return BATCH * batch_new / timed(lambda: hf_generate(torch.tensor([fresh(batch_prompt, rng, vocab)
                                                                           for _ in range(BATCH)]), batch_new))

    return decode_b1, batch8


def measure(args) -> dict[str, dict[str, float]]:
    """Medians per side (``hyla``, optionally ``compiled``, ``hf``, optionally ``llama.cpp``) of every
    metric (llama.cpp: ``d1`` and ``b8`` only)."""
    sys.path.insert(0, str(args.hyla_root / "tests"))  # that checkout's TinyRunner
    sys.path.insert(0, str(args.hyla_root))
    import torch
    import transformers

    from hyla import Engine
    from hyla.engine.engine import DEFAULT_MODEL_DIR

    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    path = DEFAULT_MODEL_DIR
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    vocab = hf.config.vocab_size
    rng = random.Random(0)
    n = args.new_tokens
    sizes = dict(max_total_tokens=32768, max_state_slots=64, **thread_option(args.threads))

    def hyla_side(engine):
        return (lambda: decode_after_prompt(engine, rng, vocab, PROMPT_1, n)[1],
                lambda: concurrent_output(engine, rng, vocab, PROMPT_8, NEW_8))

    def llama_cpp_side(server):
        from benchmarks import llama_cpp

        return (lambda: llama_cpp.decode_tok_s(server.llama_dir, server.gguf, server.threads, PROMPT_1, n),
                lambda: llama_cpp.serve_output_tok_s(server, rng, BATCH, PROMPT_8, NEW_8))

    engines = {"hyla": Engine(path, dtype="float32", **sizes)}
    startup = {}
    if args.compile:
        t0 = time.perf_counter()
        engines["compiled"] = Engine(path, dtype="float32", compile_decode=True, **sizes)
        startup["compiled"] = time.perf_counter() - t0
    with contextlib.ExitStack() as stack:
        stack.callback(lambda: [e.shutdown() for e in engines.values()])
        sides = {name: hyla_side(e) for name, e in engines.items()}
        sides["hf"] = hf_side(hf, rng, vocab, n)
        if args.llama_cpp is not None:
            sides["llama.cpp"] = llama_cpp_side(stack.enter_context(start_llama_server(args, path)))
        for decode_b1, batch8 in sides.values():  # warm-up
            decode_b1(), batch8()
        samples: dict[str, dict[str, list[float]]] = {s: {"d1": [], "b8": []} for s in sides}
        for _ in range(args.repeats):
            for name, (decode_b1, batch8) in sides.items():
                samples[name]["d1"].append(decode_b1())
                samples[name]["b8"].append(batch8())
        result = {name: {k: statistics.median(v) for k, v in m.items()} for name, m in samples.items()}
        for b in (1, BATCH):
            fwd = forward_only(engines, hf, b, args.steps, args.repeats, rng, vocab)
            for name, ms in fwd.items():
                result[name][f"f{b}"] = ms
        for name, ms in prefill_only(engines, hf, args.repeats, rng, vocab).items():
            result[name]["p8"] = ms
        for name, s in startup.items():
            result[name]["startup_s"] = s
        return result


def start_llama_server(args, model_dir: Path):
    """llama.cpp's server on the default model, converted (cached) into ``--llama-cpp``'s models/."""
    from benchmarks import llama_cpp

    gguf = llama_cpp.convert(model_dir, args.llama_cpp, llama_cpp.default_gguf(args.llama_cpp, model_dir))
    return llama_cpp.LlamaServer(args.llama_cpp, gguf, args.threads)


def forward_only(engines, hf, batch: int, steps: int, repeats: int, rng: random.Random, vocab: int):
    """ms per decode step of the bare forwards on one prebuilt batch (fresh tokens every step)."""
    import torch

    import checkpoints

    prompt = PROMPT_1 if batch == 1 else PROMPT_8
    prompts = [fresh(prompt, rng, vocab) for _ in range(batch)]
    toks = torch.tensor([fresh(batch, rng, vocab) for _ in range(steps)])  # [steps, B]
    fns = {}
    for name, engine in engines.items():
        runner = checkpoints.TinyRunner(engine.model, max_tokens=batch * (prompt + 2) + 1, max_states=batch)
        seqs = [runner.new_seq() for _ in range(batch)]
        with torch.inference_mode():
            runner.step(seqs, prompts)
            step_batch = runner.make_batch(seqs, [[5]] * batch, decode=True)
            # with the KV lengths on the device, as the engine's decode batches: the graphs compiled
            # at start-up are for those (without, no graph would fit and the step would run eager)
            step_batch = dataclasses.replace(
                step_batch, kv_lens=torch.tensor(step_batch.seq_lens, device=step_batch.input_ids.device))
        run = getattr(engine.scheduler.runner, "_run_decode", engine.model.forward)  # compiled if so configured

        @torch.inference_mode()
        def ours(run=run, step_batch=step_batch) -> None:
            for i in range(steps):
                step_batch.input_ids.copy_(toks[i])
                run(step_batch)

        fns[name] = ours
    with torch.inference_mode():
        cache = hf(torch.tensor(prompts), use_cache=True).past_key_values
    crop = cache.get_seq_length()

    @torch.inference_mode()
    def ref() -> None:
        for i in range(steps):
            hf(toks[i][:, None], past_key_values=cache, use_cache=True)
            for layer in cache.layers:  # keep the attention cache at the prompt length
                if getattr(layer, "keys", None) is not None and layer.keys.dim() == 4:
                    layer.keys, layer.values = layer.keys[:, :, :crop], layer.values[:, :, :crop]

    fns["hf"] = ref
    times = {name: ms / steps for name, ms in thread_ms(fns, repeats).items()}
    for name, engine in engines.items():
        require_start_up_graphs(engine, name)
    return times


def require_start_up_graphs(engine, name: str) -> None:
    """A compiled engine's timed steps ran the graphs compiled at start-up, none an eager fallback
    (``ModelRunner.late_compiles``; a checkout from before it has none to count)."""
    if getattr(engine.scheduler.runner, "late_compiles", 0):
        raise RuntimeError(f"{name}: a timed step fitted no graph compiled at start-up and ran eager")


def thread_ms(fns: dict, repeats: int) -> dict[str, float]:
    """Median thread CPU ms of each function (single-threaded: robust to a busy machine), after one
    warm-up call each, the functions interleaved repeat by repeat."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.thread_time()
            fn()
            times[name].append(time.thread_time() - t0)
    return {name: 1e3 * statistics.median(t) for name, t in times.items()}


def prefill_only(engines, hf, repeats: int, rng: random.Random, vocab: int) -> dict[str, float]:
    """CPU ms of the bare forward prefilling the 8-request workload's prompts (``BATCH``
    ``PROMPT_8``-token prompts into empty pools; HF: one batched forward with a fresh cache)."""
    import torch

    import checkpoints

    prompts = [fresh(PROMPT_8, rng, vocab) for _ in range(BATCH)]  # the same every call: nothing is cached
    fns = {}
    for name, engine in engines.items():
        @torch.inference_mode()
        def ours(model=engine.model) -> None:
            runner = checkpoints.TinyRunner(model, max_tokens=BATCH * PROMPT_8 + 1, max_states=BATCH)  # empty pools
            runner.step([runner.new_seq() for _ in range(BATCH)], prompts)

        fns[name] = ours

    @torch.inference_mode()
    def ref() -> None:
        hf(torch.tensor(prompts), use_cache=True)

    fns["hf"] = ref
    return thread_ms(fns, repeats)


def table(runs: dict[str, dict[str, dict[str, float]]], before_rev: str = "") -> str:
    """Markdown: one row per metric, one column per side; in parentheses each hyla side's ratio
    to the transformers of its own run (> 1: hyla faster). ``before_rev``: the before checkout's commit."""
    cols = []  # (header, run, side)
    if "before" in runs:
        cols.append((f"hyla before ({before_rev})" if before_rev else "hyla before", "before", "hyla"))
    cols.append(("hyla after" if "before" in runs else "hyla", "after", "hyla"))
    if "compiled" in runs.get("before", {}):
        cols.append((f"hyla + `compile_decode` before ({before_rev})" if before_rev
                     else "hyla + `compile_decode` before", "before", "compiled"))
    if "compiled" in runs["after"]:
        cols.append(("hyla + `compile_decode`", "after", "compiled"))
    peer = runs["after"].get("llama.cpp")
    goal = targets(runs["after"])
    whose = "llama.cpp" if peer else "the issue's llama.cpp"
    rows = [  # key, label, lower is better, target
        ("d1", "decode tok/s, batch 1, after a 512-token prompt", False, f"≥ {goal['d1']:,.0f} (0.5x {whose})"),
        ("b8", "output tok/s, 8 concurrent 128 → 64 requests", False,
         f"≥ {goal['b8']:,.0f} (1x {whose}) and ≥ 2x transformers"),
        ("f1", "forward only, CPU ms per decode step, batch 1 (512 cached)", True, ""),
        ("f8", "forward only, CPU ms per decode step, batch 8 (128 cached)", True, ""),
        ("p8", "forward only, CPU ms per prefill of 8 128-token prompts into empty states", True, ""),
    ]
    lines = ["| measurement | " + " | ".join(h for h, _, _ in cols) + " | transformers |"
             + (" llama.cpp |" if peer else "") + " target |",
             "|---" * (len(cols) + 3 + bool(peer)) + "|"]
    for key, label, lower, target in rows:
        cells = []
        for _, run, side in cols:
            v, ref = runs[run][side][key], runs[run]["hf"][key]
            cells.append(f"{v:.3f} ({ref / v:.2f}x)" if lower else f"{v:,.0f} (**{v / ref:.2f}x**)")
        ref = runs["after"]["hf"][key]
        cells.append(f"{ref:.3f}" if lower else f"{ref:,.0f}")
        if peer:
            cells.append(f"{peer[key]:,.0f}" if key in peer else "—")
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {target} |")
    return "\n".join(lines)


def targets(after: dict[str, dict[str, float]]) -> dict[str, float]:
    """The issue's CPU targets: batch 1 at 0.5x llama.cpp's decode, 8 requests at 1x its server;
    llama.cpp's numbers from this run where it ran, else the issue's."""
    peer = after.get("llama.cpp", ISSUE_LLAMA_CPP)
    return {"d1": 0.5 * peer["d1"], "b8": peer["b8"]}


def verdict(runs: dict[str, dict[str, dict[str, float]]]) -> str:
    """The targets, read off this run."""
    after = runs["after"]
    goal, peer = targets(after), after.get("llama.cpp", ISSUE_LLAMA_CPP)
    whose = "this run's llama.cpp" if "llama.cpp" in after else "the issue's llama.cpp"

    def meets(ok: bool) -> str:
        return "meets" if ok else "misses"

    lines = []
    for side, name in (("hyla", "eager"), ("compiled", "`compile_decode`")):
        if side not in after:
            continue
        r, hf = after[side], after["hf"]
        lines.append(f"* {name}: batch 1 {r['d1']:,.0f} tok/s = {r['d1'] / peer['d1']:.2f}x {whose} "
                     f"({meets(r['d1'] >= goal['d1'])} ≥ 0.5x); 8 concurrent {r['b8']:,.0f} tok/s = "
                     f"{r['b8'] / peer['b8']:.2f}x {whose} ({meets(r['b8'] >= goal['b8'])} ≥ 1x) and "
                     f"{r['b8'] / hf['b8']:.2f}x transformers ({meets(r['b8'] >= 2 * hf['b8'])} ≥ 2x).")
    if "compiled" in after:
        c, e = after["compiled"], after["hyla"]
        lines.append(f"* `compile_decode` vs eager in this run: forward {e['f1'] / c['f1']:.2f}x at batch 1, "
                     f"{e['f8'] / c['f8']:.2f}x at batch 8; engine {c['d1'] / e['d1']:.2f}x at batch 1, "
                     f"{c['b8'] / e['b8']:.2f}x on the 8-request workload (its prefill stays eager).")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads, every side")
    ap.add_argument("--new-tokens", type=int, default=128, help="N decode tokens timed at batch 1")
    ap.add_argument("--steps", type=int, default=50, help="forward only: decode steps per timed run")
    ap.add_argument("--compile", action="store_true", help="also measure Engine(compile_decode=True)")
    ap.add_argument("--llama-cpp", type=Path, metavar="DIR",
                    help="also measure llama.cpp, built in DIR by scripts/build_llama_cpp.sh")
    ap.add_argument("--before", type=Path, help="checkout to measure first, in a subprocess, for before/after")
    ap.add_argument("--hyla-root", type=Path, default=ROOT, help="checkout to import hyla from")
    ap.add_argument("--json", action="store_true", help="print the medians as one JSON line (last line)")
    ap.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    args = ap.parse_args()
    args.hyla_root = args.hyla_root.resolve()
    if args.llama_cpp is not None:
        args.llama_cpp = args.llama_cpp.resolve()
    sys.path.insert(0, str(ROOT))

    runs, before_rev = {}, ""
    if args.before is not None:
        cmd = [sys.executable, __file__, "--hyla-root", str(args.before.resolve()), "--json", "--no-write",
               "--repeats", str(args.repeats), "--threads", str(args.threads), "--new-tokens", str(args.new_tokens),
               "--steps", str(args.steps)] + (["--compile"] if args.compile else [])
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        runs["before"] = json.loads(out.strip().splitlines()[-1])
        before_rev = subprocess.run(["git", "-C", str(args.before), "rev-parse", "--short", "HEAD"],
                                    capture_output=True, text=True).stdout.strip()
    t0 = time.perf_counter()
    runs["after"] = measure(args)
    wall = time.perf_counter() - t0

    import torch
    import transformers

    from benchmarks.report import machine

    cmd = (f"OMP_NUM_THREADS={args.threads} .venv/bin/python benchmarks/cpu_decode.py --repeats {args.repeats} "
           f"--threads {args.threads} --new-tokens {args.new_tokens}" + (" --compile" if args.compile else "")
           + (" --llama-cpp ../llama.cpp" if args.llama_cpp else "")
           + (" --before /tmp/cpu-base" if args.before else ""))
    startup = runs["after"].get("compiled", {}).get("startup_s")
    llama_line = "" if args.llama_cpp is None else (
        "\nllama.cpp: the same checkpoint as an fp32 GGUF (`benchmarks/llama_cpp.py`), batch 1 from\n"
        f"`llama-bench -d 512 -n {args.new_tokens}`, 8 requests through `llama-server --parallel 8`, "
        "interleaved with the others.")
    body = f"""`{cmd}` — {machine()}, transformers {transformers.__version__}, {args.threads} thread(s);
built-in default model (Qwen3-Next, 8 layers: 6 Gated DeltaNet + 2 attention, hidden 256,
vocab 4096), fp32; medians of {args.repeats} runs, every side interleaved; in parentheses each hyla
column's ratio to the transformers measured in the same run. Engine rows are wall clock on a shared
2-core machine (compare ratios, not absolute numbers, across runs; the before column ran first, in
its own process); forward rows are thread CPU time.{llama_line}
{"" if startup is None else f"`compile_decode` start-up (engine construction, both graphs compiled): {startup:.0f} s."}

{table(runs, before_rev)}

{verdict(runs)}
"""
    print(body)
    print(f"(total {wall:.0f} s, torch {torch.__version__})")
    if args.json:
        print(json.dumps(runs["after"]))
    if not args.no_write:
        from benchmarks.report import write_section

        write_section("CPU decode", body)


if __name__ == "__main__":
    main()
