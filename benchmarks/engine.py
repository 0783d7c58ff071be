"""Engine benchmarks (issue: engine), written to the ``## Engine`` section of docs/benchmarks.md.

(a) TTFT of a 2,000-token prompt cold vs. with a 1,800-token cached prefix (the prefix was seen
    once before with a checkpoint at its end, e.g. a shared system prompt). Target: cached ≤ 20%.
(b) Output tokens/s with 32 concurrent requests (64-token prompts, 64 new tokens, greedy) against
    transformers' batched ``generate`` on the same checkpoint. Target ≥ 3x.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/engine.py [--repeats 5] [--device cpu]

Checkpoint: the tiny Qwen3-Next of the tests (``tests/checkpoints.py``, dense, 8 layers, 3:1
linear:attention, hidden 256), fp32.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

import checkpoints  # noqa: E402

from benchmarks.report import machine, write_section  # noqa: E402
from hyla import Engine  # noqa: E402


def ids(n: int, rng: random.Random) -> list[int]:
    return [rng.randrange(3, 2048) for _ in range(n)]


def ttft(engine: Engine, prompt: list[int]) -> float:
    t0 = time.perf_counter()
    engine.generate(input_ids=prompt, sampling_params={"temperature": 0, "max_new_tokens": 1})
    return time.perf_counter() - t0


def bench_ttft(path: Path, device: str, repeats: int) -> tuple[float, float, int]:
    rng = random.Random(0)
    with Engine(path, device=device, max_total_tokens=65536, max_state_slots=64) as engine:
        ttft(engine, ids(2000, rng))  # warm-up
        cold, cached, hits = [], [], []
        for _ in range(repeats):
            cold.append(ttft(engine, ids(2000, rng)))  # unique prompt: nothing to hit
            prefix = ids(1800, rng)
            engine.generate(input_ids=prefix + ids(50, rng), checkpoints=[1800],
                            sampling_params={"temperature": 0, "max_new_tokens": 1})
            prompt = prefix + ids(200, rng)
            t0 = time.perf_counter()
            out = engine.generate(input_ids=prompt, sampling_params={"temperature": 0, "max_new_tokens": 1})
            cached.append(time.perf_counter() - t0)
            hits.append(out["meta_info"]["cached_tokens"])
    return statistics.median(cold), statistics.median(cached), min(hits)


def bench_throughput(path: Path, device: str, repeats: int, batch: int = 32, prompt_len: int = 64,
                     new_tokens: int = 64) -> tuple[float, float]:
    import transformers

    rng = random.Random(1)
    prompts = [ids(prompt_len, rng) for _ in range(batch)]
    params = {"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True}
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
    hf_input = torch.tensor(prompts, device=device)

    def run_hf() -> None:
        with torch.no_grad():
            hf.generate(hf_input, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                        pad_token_id=0)

    ours, ref = [], []
    with Engine(path, device=device, max_total_tokens=65536, max_state_slots=96, max_running_requests=batch,
                enable_prefix_cache=False) as engine:
        engine.generate(input_ids=prompts[:2], sampling_params=params)  # warm-up
        run_hf()
        for _ in range(repeats):  # interleaved, so machine load hits both alike
            t0 = time.perf_counter()
            engine.generate(input_ids=prompts, sampling_params=params)
            ours.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            run_hf()
            ref.append(time.perf_counter() - t0)
    toks = batch * new_tokens
    return toks / statistics.median(ours), toks / statistics.median(ref)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    args = ap.parse_args()
    path = checkpoints.make_qwen3_next(Path(tempfile.gettempdir()) / "hyla-bench-ckpts", moe=False)

    cold, cached, hit = bench_ttft(path, args.device, args.repeats)
    ours, ref = bench_throughput(path, args.device, args.repeats)
    body = f"""`OMP_NUM_THREADS=2 .venv/bin/python benchmarks/engine.py --repeats {args.repeats} --device {args.device}` — {machine()}; tiny Qwen3-Next (dense, fp32).

| measurement | hyla | reference | ratio | target |
|---|---|---|---|---|
| TTFT, 2,000-token prompt: cold vs 1,800-token cached prefix ({hit} tokens hit) | cached {cached * 1e3:.1f} ms | cold {cold * 1e3:.1f} ms | **{100 * cached / cold:.1f}%** of cold | ≤ 20% (SGLang: 57.63% on H200) |
| output tokens/s, 32 concurrent requests × 64 new tokens | {ours:.0f} tok/s | transformers `generate` {ref:.0f} tok/s | **{ours / ref:.2f}x** | ≥ 3x |
"""
    print(body)
    if not args.no_write:
        write_section("Engine", body)


if __name__ == "__main__":
    main()
