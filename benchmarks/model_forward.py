"""Model forward throughput: hyla vs Hugging Face transformers on the same tiny checkpoint.

For each tiny checkpoint (Qwen3-Next dense, Qwen3-Next MoE, NemotronH, or those ``--models`` names; built as in
the tests):
* prefill: tokens/s for one fresh prompt of 512 and of 4,096 tokens (HF: one forward with a fresh cache);
* decode: ms per step for a batch of B sequences (B = 1, 8, 32), each with a 64-token prompt
  already prefilled (HF: one batched forward of B tokens with its cache).
Numbers are medians over repeated runs (hyla and HF interleaved), in fp32, in one process. Prints a markdown table (the
``## Model forward`` section of docs/benchmarks.md).

    .venv/bin/python benchmarks/model_forward.py [--repeats 5] [--steps 8] [--threads 1] [--cpu-time] [--prefill-tokens 512,4096]
        [--models "qwen3_next dense,qwen3_next MoE,nemotron_h"] (also: jamba)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

import checkpoints  # noqa: E402  (tests/checkpoints.py: builders + TinyRunner)

from hyla.model import load_model  # noqa: E402

PREFILL_TOKENS = (512, 4096)
DECODE_PROMPT = 64
BATCHES = (1, 8, 32)


CLOCK = time.perf_counter  # --cpu-time switches to time.process_time

BUILDERS = {
    "qwen3_next dense": lambda d: checkpoints.make_qwen3_next(d, moe=False),
    "qwen3_next MoE": lambda d: checkpoints.make_qwen3_next(d, moe=True),
    "nemotron_h": lambda d: checkpoints.make_nemotron_h(d),
    "jamba": lambda d: checkpoints.make_jamba(d),
}
DEFAULT_MODELS = ("qwen3_next dense", "qwen3_next MoE", "nemotron_h")


def timed(fn) -> float:
    t0 = CLOCK()
    fn()
    return CLOCK() - t0


def paired_medians(ours, ref, repeats: int) -> tuple[float, float]:
    """Median seconds of ``ours()`` and ``ref()``, runs interleaved (ours, ref, ours, ...) so that
    load from other processes on a shared machine hits both sides alike. One warm-up each."""
    ours(), ref()
    a, b = [], []
    for _ in range(repeats):
        a.append(timed(ours))
        b.append(timed(ref))
    return statistics.median(a), statistics.median(b)


def random_ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 2048, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def prefill_pair(model, hf, num_tokens: int):
    """(hyla, HF) callables prefilling one fresh ``num_tokens``-token prompt."""
    ids = random_ids(num_tokens, 0)

    def ours():
        runner = checkpoints.TinyRunner(model, max_tokens=num_tokens, max_states=1)
        runner.step([runner.new_seq()], [ids])

    @torch.no_grad()
    def ref():
        hf(torch.tensor([ids]), use_cache=True)

    return ours, ref


def decode_pair(model, hf, batch: int, steps: int, repeats: int):
    """(hyla, HF) callables running ``steps`` decode steps of ``batch`` sequences, each with a
    ``DECODE_PROMPT``-token prompt prefilled beforehand."""
    prompts = [random_ids(DECODE_PROMPT, i) for i in range(batch)]
    runner = checkpoints.TinyRunner(model, max_tokens=batch * (DECODE_PROMPT + (repeats + 2) * steps + 1),
                                    max_states=batch)
    seqs = [runner.new_seq() for _ in range(batch)]
    runner.step(seqs, prompts)
    # fresh tokens every step: one token fed over and over drives the recurrent states' unexcited
    # directions into denormal floats, which slows both sides by an order of magnitude
    tokens = torch.tensor(random_ids(steps * batch, 1000 + batch)).view(steps, batch)
    with torch.no_grad():
        cache = hf(torch.tensor(prompts), use_cache=True).past_key_values

    def ours():
        for i in range(steps):
            runner.step(seqs, [[t] for t in tokens[i].tolist()], decode=True)

    @torch.no_grad()
    def ref():
        nonlocal cache
        for i in range(steps):
            cache = hf(tokens[i][:, None], past_key_values=cache, use_cache=True).past_key_values

    return ours, ref


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=8, help="decode steps per timed run")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    parser.add_argument("--prefill-tokens", default=",".join(map(str, PREFILL_TOKENS)),
                        help="comma-separated prompt lengths of the prefill rows (default %(default)s)")
    parser.add_argument("--models", default=",".join(DEFAULT_MODELS),
                        help=f"comma-separated checkpoints, of {', '.join(BUILDERS)} (default %(default)s)")
    parser.add_argument("--cpu-time", action="store_true",
                        help="measure process CPU time instead of wall time (robust on a shared, loaded "
                             "machine; meaningful with --threads 1)")
    args = parser.parse_args()
    global CLOCK
    if args.cpu_time:
        CLOCK = time.process_time
    torch.set_num_threads(args.threads)
    import transformers  # the reference; test/benchmark-only dependency

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    names = args.models.split(",")
    unknown = sorted(set(names) - set(BUILDERS))
    if unknown:
        parser.error(f"unknown --models {unknown}; choose from {', '.join(BUILDERS)}")
    builders = {name: BUILDERS[name] for name in names}
    clock = "process CPU time" if args.cpu_time else "wall time"
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, {torch.get_num_threads()} "
          f"thread(s), fp32, {clock}, medians of {args.repeats} interleaved runs\n")
    print("| checkpoint | metric | hyla | transformers | hyla / transformers |")
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for name, build in builders.items():
            path = build(tmp)
            model = load_model(path, dtype="float32")
            hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            for n in map(int, args.prefill_tokens.split(",")):
                ours, ref = paired_medians(*prefill_pair(model, hf, n), args.repeats)
                print(f"| {name} | prefill {n} tok (tok/s) | {n / ours:,.0f} | {n / ref:,.0f} | {ref / ours:.2f}x |",
                      flush=True)
            for batch in BATCHES:
                ours, ref = paired_medians(*decode_pair(model, hf, batch, args.steps, args.repeats), args.repeats)
                ours, ref = 1000 * ours / args.steps, 1000 * ref / args.steps
                print(f"| {name} | decode batch {batch} (ms/step) | {ours:.2f} | {ref:.2f} | "
                      f"{ref / ours:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
