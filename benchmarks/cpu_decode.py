"""CPU decode throughput of the whole engine on the built-in default model, against transformers.

Measured, fp32, in one process, hyla and transformers interleaved (the machine is shared):

* **batch 1**: decode tok/s of one request after a 512-token prompt. Each side runs the same
  fresh prompt twice, with 1 and with ``1 + N`` new tokens (greedy, EOS ignored); decode tok/s =
  ``N / (t(1 + N) - t(1))``, so prefill and start-up cancel out (llama.cpp's ``tg`` after ``pp512``).
  hyla: ``Engine.generate``; transformers: ``generate``.
* **batch 8**: output tok/s of 8 concurrent 128 → 64 requests (greedy, EOS ignored): 512 output
  tokens / wall time of the whole batch, prefill included (hyla: one ``Engine.generate`` call with
  8 requests; transformers: one batched ``generate``).
* **forward only**: ms per decode step of the bare model forward (no scheduler, no sampling) at
  batch 1 (512 cached tokens) and 8 (128 cached tokens), hyla ``model.forward`` vs one HF forward
  of B tokens with its cache.

Fresh random prompts every repeat (the prefix cache stays on, as served, and never hits).
Prints a markdown table and writes the ``## CPU decode`` section of docs/benchmarks.md.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/cpu_decode.py [--repeats 5] [--threads 1]
        [--new-tokens 128] [--compile] [--hyla-root DIR] [--no-write]

``--hyla-root DIR`` imports hyla from another checkout (e.g. a ``git worktree`` of an older commit)
to measure before/after with the same script; ``--compile`` turns on the engine's
``compile_decode`` option (when that checkout has it).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _setup_path(hyla_root: Path) -> None:
    sys.path.insert(0, str(ROOT))  # benchmarks.report
    sys.path.insert(0, str(hyla_root / "tests"))  # checkpoints.TinyRunner of that checkout
    sys.path.insert(0, str(hyla_root))  # hyla itself


PROMPT_1 = 512
PROMPT_8, NEW_8, BATCH = 128, 64, 8


def fresh(n: int, rng: random.Random, vocab: int) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(n)]


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads, both sides")
    ap.add_argument("--new-tokens", type=int, default=128, help="N decode tokens timed at batch 1")
    ap.add_argument("--steps", type=int, default=50, help="forward-only: decode steps per timed run")
    ap.add_argument("--compile", action="store_true", help="Engine(compile_decode=True)")
    ap.add_argument("--hyla-root", type=Path, default=ROOT, help="checkout to import hyla from")
    ap.add_argument("--json", action="store_true", help="also print the medians as one JSON line")
    ap.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    args = ap.parse_args()
    _setup_path(args.hyla_root.resolve())

    import torch
    import transformers

    import checkpoints  # noqa: F401  (the checkout's tests/checkpoints.py)
    from benchmarks.report import machine, write_section
    from hyla import Engine
    from hyla.engine.engine import DEFAULT_MODEL_DIR

    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    path = DEFAULT_MODEL_DIR
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    vocab = hf.config.vocab_size
    rng = random.Random(0)
    options = dict(compile_decode=True) if args.compile else {}
    n = args.new_tokens

    def greedy(max_new: int) -> dict:
        return {"temperature": 0, "max_new_tokens": max_new, "ignore_eos": True}

    @torch.no_grad()
    def hf_generate(ids: torch.Tensor, max_new: int) -> None:
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                          min_new_tokens=max_new, do_sample=False, pad_token_id=0)
        assert out.shape[1] == ids.shape[1] + max_new

    t_start = time.perf_counter()
    with Engine(path, dtype="float32", **options) as engine:
        model = engine.model
        # warm-up (and, with --compile, compilation) of both sides and both batch shapes
        t0 = time.perf_counter()
        engine.generate(input_ids=fresh(PROMPT_1, rng, vocab), sampling_params=greedy(8))
        engine.generate(input_ids=[fresh(PROMPT_8, rng, vocab) for _ in range(BATCH)], sampling_params=greedy(8))
        warmup_s = time.perf_counter() - t0
        hf_generate(torch.tensor([fresh(PROMPT_1, rng, vocab)]), 8)
        hf_generate(torch.tensor([fresh(PROMPT_8, rng, vocab) for _ in range(BATCH)]), 8)

        d1_ours, d1_ref, b8_ours, b8_ref = [], [], [], []
        for _ in range(args.repeats):
            # batch 1: decode tok/s = n / (t(1 + n) - t(1)), same prompt length, fresh prompts
            short = timed(lambda: engine.generate(input_ids=fresh(PROMPT_1, rng, vocab), sampling_params=greedy(1)))
            long = timed(lambda: engine.generate(input_ids=fresh(PROMPT_1, rng, vocab),
                                                 sampling_params=greedy(1 + n)))
            d1_ours.append(n / max(long - short, 1e-9))
            p = torch.tensor([fresh(PROMPT_1, rng, vocab)])
            short = timed(lambda: hf_generate(p, 1))
            long = timed(lambda: hf_generate(p, 1 + n))
            d1_ref.append(n / max(long - short, 1e-9))
            # batch 8: 8 concurrent 128 -> 64 requests, output tok/s including prefill
            prompts = [fresh(PROMPT_8, rng, vocab) for _ in range(BATCH)]
            b8_ours.append(BATCH * NEW_8 / timed(lambda: engine.generate(input_ids=prompts,
                                                                         sampling_params=greedy(NEW_8))))
            b8_ref.append(BATCH * NEW_8 / timed(lambda: hf_generate(torch.tensor(prompts), NEW_8)))

        fwd = {b: forward_only(model, hf, b, args.steps, args.repeats, rng, vocab) for b in (1, BATCH)}
    wall_s = time.perf_counter() - t_start

    med = statistics.median
    r = dict(d1=med(d1_ours), d1_hf=med(d1_ref), b8=med(b8_ours), b8_hf=med(b8_ref),
             f1=fwd[1][0], f1_hf=fwd[1][1], f8=fwd[BATCH][0], f8_hf=fwd[BATCH][1], warmup_s=warmup_s)
    mode = " + `compile_decode`" if args.compile else ""
    cmd = (f"OMP_NUM_THREADS={args.threads} .venv/bin/python benchmarks/cpu_decode.py --repeats {args.repeats} "
           f"--threads {args.threads} --new-tokens {n}" + (" --compile" if args.compile else ""))
    body = f"""`{cmd}` — {machine()}, transformers {transformers.__version__}; built-in default model
(Qwen3-Next, 8 layers: 6 Gated DeltaNet + 2 attention, hidden 256, vocab 4096), fp32,
{args.threads} thread(s), hyla engine{mode} (prefix cache on, fresh prompts), medians of {args.repeats}
interleaved runs; engine warm-up {warmup_s:.1f} s.

| measurement | hyla | transformers | hyla / transformers | target |
|---|---|---|---|---|
| decode tok/s, batch 1, after a 512-token prompt | {r['d1']:,.0f} | {r['d1_hf']:,.0f} | **{r['d1'] / r['d1_hf']:.2f}x** | ≥ 412 (0.5x llama.cpp's 823) |
| output tok/s, 8 concurrent 128 → 64 requests | {r['b8']:,.0f} | {r['b8_hf']:,.0f} | **{r['b8'] / r['b8_hf']:.2f}x** | ≥ 1,025 and ≥ 2x transformers |
| forward only: ms per decode step, batch 1 (512 cached) | {r['f1']:.3f} | {r['f1_hf']:.3f} | {r['f1_hf'] / r['f1']:.2f}x faster | |
| forward only: ms per decode step, batch 8 (128 cached) | {r['f8']:.3f} | {r['f8_hf']:.3f} | {r['f8_hf'] / r['f8']:.2f}x faster | |
"""
    print(body)
    if args.json:
        print(json.dumps({k: round(v, 4) for k, v in r.items()}))
    print(f"(total {wall_s:.0f} s)")
    if not args.no_write:
        write_section("CPU decode", body)


def forward_only(model, hf, batch: int, steps: int, repeats: int, rng: random.Random, vocab: int):
    """ms per decode step of the bare forwards: hyla ``model.forward`` on one prebuilt decode batch
    (re-run: same cost as a fresh one), HF one forward of ``batch`` tokens with its cache."""
    import torch

    import checkpoints

    prompt = PROMPT_1 if batch == 1 else PROMPT_8
    prompts = [fresh(prompt, rng, vocab) for _ in range(batch)]
    runner = checkpoints.TinyRunner(model, max_tokens=batch * (prompt + 2) + 1, max_states=batch)
    seqs = [runner.new_seq() for _ in range(batch)]
    with torch.inference_mode():
        runner.step(seqs, prompts)
        step_batch = runner.make_batch(seqs, [[5]] * batch, decode=True)
        cache = hf(torch.tensor(prompts), use_cache=True).past_key_values
    token = torch.full((batch, 1), 5)
    crop = cache.get_seq_length()

    @torch.inference_mode()
    def ours() -> None:
        for _ in range(steps):
            model(step_batch)

    @torch.inference_mode()
    def ref() -> None:
        for _ in range(steps):
            hf(token, past_key_values=cache, use_cache=True)
            for layer in cache.layers:  # keep the attention cache at the prompt length
                if getattr(layer, "keys", None) is not None and layer.keys.dim() == 4:
                    layer.keys, layer.values = layer.keys[:, :, :crop], layer.values[:, :, :crop]

    ours(), ref()
    a, b = [], []
    for _ in range(repeats):
        a.append(timed(ours))
        b.append(timed(ref))
    return 1e3 * statistics.median(a) / steps, 1e3 * statistics.median(b) / steps


if __name__ == "__main__":
    main()
