"""CPU decode of a model with MoE layers: hyla eager and with ``compile_decode``, against transformers.

The model: Qwen3.5-MoE's architecture at a size a CPU serves (random weights, fp32): hidden 1,024,
8 layers (6 Gated DeltaNet + 2 attention, the heads of ``gpu_decode.py``'s model), in every layer a
MoE of 32 experts (top-8, each 512 wide) and a shared expert of 512, vocabulary 4,096 (the built-in
tokenizer's); 0.5 B parameters (2 GB), ~0.15 B of them read per token. Built once into
``--model-dir``.

Measured as ``cpu_decode.py`` measures the built-in model, every side interleaved repeat by repeat:
decode tok/s at batch 1 after a 512-token prompt (``t(1 + N) - t(1)``: prefill cancels out), and
output tok/s of 8 concurrent 128 → 64 requests (prefill included). hyla's MoE layers run sorted by
expert in both engines: eager as PyTorch ops, compiled as one op of the graph (``sparse_moe.moe_experts``).
Prints a markdown table and writes the ``## CPU decode: a model with MoE layers`` section of
docs/benchmarks.md. ``--prompt`` / ``--batch-prompt`` / ``--batch-new`` change those lengths (the tests'
quick run).

    .venv/bin/python benchmarks/cpu_moe.py [--threads 1] [--repeats 3] [--new-tokens 32] [--no-write]
        [--prompt 512] [--batch-prompt 128] [--batch-new 64]
"""

from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks"), str(ROOT / "tests")]

from cpu_decode import BATCH, NEW_8, PROMPT_1, PROMPT_8, concurrent_output, decode_after_prompt, hf_side  # noqa: E402

MOE = dict(hidden_size=1024, num_hidden_layers=8, layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 2,
           num_attention_heads=8, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
           linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128, vocab_size=4096,
           num_experts=32, num_experts_per_tok=8, moe_intermediate_size=512, shared_expert_intermediate_size=512,
           max_position_embeddings=4096)
TINY = dict(MOE, hidden_size=64, num_hidden_layers=4, layer_types=MOE["layer_types"][:4], num_attention_heads=2,
            head_dim=32, linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=32,
            linear_value_head_dim=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
            shared_expert_intermediate_size=32)
SIDES = {"hyla": "hyla", "compiled": "hyla + `compile_decode`", "hf": "transformers"}


def build_model(model_dir: Path, tiny: bool) -> Path:
    """The checkpoint (transformers' ``Qwen3_5MoeForCausalLM``, saved as it writes it), built once."""
    import checkpoints

    return checkpoints.make_qwen3_5_moe(model_dir, **(TINY if tiny else MOE))


def measure(path: Path, args) -> dict[str, dict[str, float]]:
    """Medians per side of ``d1`` (decode tok/s, batch 1) and ``b8`` (output tok/s, 8 requests), and
    the compiled engine's ``startup_s``."""
    import torch
    import transformers

    from hyla import Engine

    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    vocab, rng, n = hf.config.vocab_size, random.Random(0), args.new_tokens
    prompt, batch_prompt, batch_new = args.prompt, args.batch_prompt, args.batch_new
    sizes = dict(dtype="float32", max_total_tokens=8192, max_state_slots=32, cpu_threads=args.threads)
    engines, startup = {}, None
    if "hyla" in args.sides:
        engines["hyla"] = Engine(str(path), **sizes)
    if "compiled" in args.sides:
        t0 = time.perf_counter()
        engines["compiled"] = Engine(str(path), compile_decode=True, **sizes)
        startup = time.perf_counter() - t0
    with contextlib.ExitStack() as stack:
        stack.callback(lambda: [e.shutdown() for e in engines.values()])
        sides = {name: (lambda e=e: decode_after_prompt(e, rng, vocab, prompt, n)[1],
                        lambda e=e: concurrent_output(e, rng, vocab, batch_prompt, batch_new))
                 for name, e in engines.items()}
        if "hf" in args.sides:
            sides["hf"] = hf_side(hf, rng, vocab, n, prompt, batch_prompt, batch_new)
        for d1, b8 in sides.values():  # warm-up
            d1(), b8()
        samples = {s: {"d1": [], "b8": []} for s in sides}
        for _ in range(args.repeats):
            for name, (d1, b8) in sides.items():
                samples[name]["d1"].append(d1())
                samples[name]["b8"].append(b8())
    result = {name: {k: statistics.median(v) for k, v in m.items()} for name, m in samples.items()}
    if startup is not None:
        result["compiled"]["startup_s"] = startup
    return result


def table(r: dict[str, dict[str, float]], prompt: int = PROMPT_1, batch_prompt: int = PROMPT_8,
          batch_new: int = NEW_8) -> str:
    sides = [s for s in SIDES if s in r]
    rows = [f"| measurement | {' | '.join(SIDES[s] for s in sides)} |", "|---" * (len(sides) + 1) + "|"]
    for key, label in (("d1", f"decode tok/s, batch 1, after a {prompt}-token prompt"),
                       ("b8", f"output tok/s, {BATCH} concurrent {batch_prompt} → {batch_new} requests")):
        cells = [f"{r[s][key]:.1f}" + ("" if s == "hf" or "hf" not in r else f" (**{r[s][key] / r['hf'][key]:.2f}x**)")
                 for s in sides]
        rows.append(f"| {label} | {' | '.join(cells)} |")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads, every side")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=32, help="N decode tokens timed at batch 1")
    ap.add_argument("--model-dir", type=Path, default=Path("/tmp/hyla-moe-bench"), help="where the model is built once")
    ap.add_argument("--sides", default=",".join(SIDES), help="comma-separated, of " + ", ".join(SIDES) + " (default: all)")
    ap.add_argument("--tiny", action="store_true", help="tiny dims, to test the script (implies --no-write)")
    ap.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    ap.add_argument("--prompt", type=int, default=PROMPT_1, help="the batch-1 row's prompt tokens (default %(default)s)")
    ap.add_argument("--batch-prompt", type=int, default=PROMPT_8,
                    help=f"the {BATCH} concurrent requests' prompt tokens (default %(default)s)")
    ap.add_argument("--batch-new", type=int, default=NEW_8,
                    help=f"the {BATCH} concurrent requests' new tokens (default %(default)s)")
    args = ap.parse_args()
    args.sides = {x.strip() for x in args.sides.split(",") if x.strip()}
    if not args.sides or args.sides - set(SIDES):
        ap.error(f"--sides: one or more of {', '.join(SIDES)}")
    t0 = time.perf_counter()
    result = measure(build_model(args.model_dir, args.tiny), args)

    from benchmarks.report import machine

    cmd = (f".venv/bin/python benchmarks/cpu_moe.py --threads {args.threads} --repeats {args.repeats} "
           f"--new-tokens {args.new_tokens}" + "".join(f" --{flag} {value}" for flag, value, default in (
               ("prompt", args.prompt, PROMPT_1), ("batch-prompt", args.batch_prompt, PROMPT_8),
               ("batch-new", args.batch_new, NEW_8)) if value != default))
    startup = "" if "compiled" not in result else \
        f" `compile_decode` start-up (engine construction, graphs compiled): {result['compiled']['startup_s']:.0f} s."
    body = f"""`{cmd}` — {machine()}; Qwen3.5-MoE's architecture (hidden 1,024, 8 layers: 6 Gated DeltaNet +
2 attention; a MoE of 32 experts, top-8, 512 wide, and a shared expert in every layer; vocabulary
4,096; random weights) in fp32, 0.5 B parameters; wall clock, medians of {args.repeats} runs, sides
interleaved; in parentheses the ratio to transformers in the same run.{startup}

{table(result, args.prompt, args.batch_prompt, args.batch_new)}
"""
    print(body)
    print(f"(total {time.perf_counter() - t0:.0f} s)")
    if not args.no_write and not args.tiny and args.sides == set(SIDES):
        from benchmarks.report import write_section

        write_section("CPU decode: a model with MoE layers", body)


if __name__ == "__main__":
    main()
