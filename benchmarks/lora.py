"""What serving LoRA adapters costs (``enable_lora``): decode and prefill with adapters against the base model.

One model (the built-in one, ``--gpu-model``: issue 10's, or ``--tiny``), two engines alternating: the base
model's (the peer: a model with an adapter merged into its weights runs at its speed), and one with
``enable_lora`` serving ``--adapters`` adapters of rank ``--rank`` on every projection an adapter may target
(made here in PEFT's format, random, ``synthetic_adapter``). The LoRA engine runs three mixes of requests:
none with an adapter (the price of being able to serve them), all with one adapter, and the batch spread over
every adapter. Measured per mix:

* **decode tok/s** at batch 1 and ``--batch`` after ``--context``-token prompts (``kv_cache_dtype.decode_rate``:
  the tokens that arrive while every request decodes, over that time);
* **TTFT (ms)** of one ``--prefill``-token prompt.

Then adapters taking turns in fewer slots (``max_cpu_loras``): ``--batch`` requests spread over every adapter,
submitted at once, served by the LoRA engine (a slot per adapter) and by one with a single slot
(``max_loras=1``: each adapter's requests run in their turn), against the base model serving them all; output
tokens per second over the whole workload.

Writes the ``## LoRA adapters: their cost`` section of docs/benchmarks.md (``... on a GPU`` with ``--device cuda``).

    .venv/bin/python benchmarks/lora.py [--repeats 5]
    PYTHONUNBUFFERED=1 .venv/bin/python benchmarks/lora.py --device cuda --gpu-model --dtype bfloat16
    .venv/bin/python benchmarks/lora.py --tiny --repeats 1 --context 32 --prefill 64 --no-write   # smoke
"""

from __future__ import annotations

import argparse
import json
import random
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.kv_cache_dtype import decode_rate  # noqa: E402
from benchmarks.report import machine, write_section  # noqa: E402
from benchmarks.startup import add_model_arguments, model_dir, resolve_dtype  # noqa: E402
from hyla import Engine  # noqa: E402

SECTION = "LoRA adapters: their cost"
MIXES = ("no adapter", "one adapter", "every adapter")


def synthetic_adapter(engine: Engine, out: Path, rank: int, seed: int) -> int:
    """A random PEFT LoRA adapter of rank ``rank`` on every projection of ``engine``'s model an adapter may
    target (its checkpoint tensors built into a ``Linear`` by moving rows, not the LM head), written to
    ``out``; returns how many checkpoint projections it adapts."""
    from safetensors.torch import save_file

    from hyla.model.linear import Linear
    from hyla.model.loader import _checkpoint_specs, _index_checkpoint

    model, path = engine.model, Path(engine.model_path)
    reader, _ = _index_checkpoint(path, type(model), model.config)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for spec in _checkpoint_specs(path, type(model), model.config, set(reader.files)):
        name = spec.target.removesuffix(".weight")
        module = model.get_submodule(name) if spec.target.endswith(".weight") else None
        if not isinstance(module, Linear) or module.lora_refused or not spec.moves_rows_only:
            continue
        for source in spec.sources:
            hf = "base_model.model." + reader.original.get(source, source).removesuffix(".weight")
            rows = reader.meta(source).shape[0]
            scale = module.in_features ** -0.5
            tensors[hf + ".lora_A.weight"] = torch.randn(rank, module.in_features, generator=gen) * scale
            tensors[hf + ".lora_B.weight"] = torch.randn(rows, rank, generator=gen) * 0.01
    out.mkdir(parents=True)
    save_file(tensors, out / "adapter_model.safetensors")
    (out / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                                                         "target_modules": "all-linear"}))
    return len(tensors) // 2


def measure(engine: Engine, names: list[str | None], rng: random.Random, args: argparse.Namespace) -> dict[str, float]:
    """Decode rates and TTFT with request ``i`` applying ``names[i % len(names)]``."""
    vocab = engine.model_config.vocab_size
    fresh = lambda n: [rng.randrange(3, vocab) for _ in range(n)]  # noqa: E731
    out = {}
    for b in (1, args.batch):
        lora = [names[i % len(names)] for i in range(b)]
        out[f"decode batch {b} (tok/s)"] = decode_rate(_Named(engine, lora), [fresh(args.context) for _ in range(b)],
                                                       1 + args.new_tokens)
    t0 = time.perf_counter()
    engine.generate(input_ids=fresh(args.prefill), sampling_params={"temperature": 0, "max_new_tokens": 1},
                    lora_name=names[0])
    out[f"TTFT of {args.prefill} tokens (ms)"] = 1e3 * (time.perf_counter() - t0)
    return out


def workload_rate(engine: Engine, names: list[str | None], rng: random.Random, args: argparse.Namespace) -> float:
    """Output tokens per second of ``--batch`` requests (request ``i`` applying ``names[i % len(names)]``),
    submitted at once, from submission to the last token."""
    vocab = engine.model_config.vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(args.context)] for _ in range(args.batch)]
    t0 = time.perf_counter()
    outs = engine.generate(input_ids=prompts, sampling_params={"temperature": 0, "max_new_tokens": args.new_tokens,
                                                               "ignore_eos": True},
                           lora_name=[names[i % len(names)] for i in range(args.batch)])
    return sum(len(o["output_ids"]) for o in outs) / (time.perf_counter() - t0)


class _Named:
    """``engine`` whose ``generate`` calls apply ``names`` in turn (``decode_rate`` makes one per prompt)."""

    def __init__(self, engine: Engine, names: list[str | None]):
        self.engine, self.names, self.calls = engine, names, 0

    def generate(self, **kw):
        name = self.names[self.calls % len(self.names)]
        self.calls += 1
        return self.engine.generate(**kw, lora_name=name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(ap)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=256, help="prompt tokens before the timed decode steps")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--prefill", type=int, default=1024, help="the TTFT prompt's tokens")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    args = ap.parse_args()
    resolve_dtype(args)

    with tempfile.TemporaryDirectory(prefix="hyla-lora-") as tmp:
        built, desc = model_dir(args, Path(tmp) / "built")
        opts = dict(device=args.device, dtype=args.dtype, max_running_requests=max(8, args.batch),
                    max_total_tokens=2 * (args.batch + 1) * (args.context + args.new_tokens + 8) + args.prefill,
                    enable_prefix_cache=False)
        base = Engine(built, **opts)
        lora = Engine(built, enable_lora=True, max_loras=args.adapters, max_lora_rank=args.rank, **opts)
        turns = Engine(built, enable_lora=True, max_loras=1, max_cpu_loras=args.adapters, max_lora_rank=args.rank,
                       **opts)
        names = [f"adapter-{i}" for i in range(args.adapters)]
        for i, name in enumerate(names):
            adapted = synthetic_adapter(lora, Path(tmp) / name, args.rank, seed=i)
            lora.load_lora_adapter(name, Path(tmp) / name)
            turns.load_lora_adapter(name, Path(tmp) / name)
        print(lora.summary(), f"\n{args.adapters} adapters of rank {args.rank} on {adapted} projections", flush=True)
        runs: dict[str, list[dict[str, float]]] = {mode: [] for mode in ("base", *MIXES)}
        served = {"base model": (base, [None]), "a slot per adapter": (lora, names), "one slot": (turns, names)}
        workloads: dict[str, list[float]] = {k: [] for k in served}
        rng = random.Random(0)
        try:
            modes = list(runs)
            for rep in range(1 + args.repeats):
                for mode in modes[rep % len(modes):] + modes[:rep % len(modes)]:  # (each round another first)
                    engine = base if mode == "base" else lora
                    mix = {"base": [None], "no adapter": [None], "one adapter": names[:1], "every adapter": names}[mode]
                    res = measure(engine, mix, rng, args)
                    if rep:
                        runs[mode].append(res)
                        print(f"repeat {rep}, {mode}: " + ", ".join(f"{k} {v:,.1f}" for k, v in res.items()),
                              flush=True)
                keys = list(served)
                for key in keys[rep % len(keys):] + keys[:rep % len(keys)]:
                    rate = workload_rate(*served[key], rng, args)
                    if rep:
                        workloads[key].append(rate)
                        print(f"repeat {rep}, {args.batch} requests over every adapter, {key}: {rate:,.1f} tok/s",
                              flush=True)
            slot_loads = turns.get_stats()["num_lora_slot_loads"]
        finally:
            base.shutdown()
            lora.shutdown()
            turns.shutdown()
    med = {mode: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for mode, rs in runs.items()}
    metrics = list(med["base"])
    rows = [f"| {k} | {med['base'][k]:,.1f} | " + " | ".join(
        f"{med[m][k]:,.1f} ({med[m][k] / med['base'][k]:.2f}x)" for m in MIXES) + " |" for k in metrics]
    wl = {k: statistics.median(v) for k, v in workloads.items()}
    cmd = shlex.join([".venv/bin/python", "benchmarks/lora.py", *sys.argv[1:]])
    body = "\n".join([
        f"`{cmd}` — {machine()}; {desc}, {args.dtype}; {args.adapters} random adapters of rank {args.rank} on "
        f"every projection an adapter may target ({adapted} checkpoint projections); medians of {args.repeats} "
        "rounds, the engines alternating (each round begun by another mix). The base model's engine is the peer "
        "(a model with an adapter merged into its weights runs at its speed); the LoRA engine (`enable_lora`) "
        "serves requests with no adapter, "
        "all with one, and the batch spread over every adapter (ratios against the base model).",
        "",
        "| measurement | base model | LoRA engine, no adapter | one adapter | every adapter |",
        "|---|---|---|---|---|",
        *rows,
        "",
        f"Adapters taking turns (`max_cpu_loras`): {args.batch} requests of {args.context} prompt and "
        f"{args.new_tokens} new tokens, spread over the {args.adapters} adapters and submitted at once; output tok/s "
        "from submission to the last token (ratios against the base model serving them all):",
        "",
        "| base model | LoRA engine, a slot per adapter | one slot (`max_loras=1`) |",
        "|---|---|---|",
        f"| {wl['base model']:,.1f} | {wl['a slot per adapter']:,.1f} "
        f"({wl['a slot per adapter'] / wl['base model']:.2f}x) | {wl['one slot']:,.1f} "
        f"({wl['one slot'] / wl['base model']:.2f}x) |",
        "",
        f"With one slot each adapter's queued requests run together in its turn (the others wait: "
        f"`Scheduler._slot_ready`), so each step runs one adapter's requests, and the adapters were written into the "
        f"slot {slot_loads} times "
        f"over the {1 + args.repeats} rounds.",
        "",
        "An adapter's update runs apart from the weight, `B (A x)`, from `max_loras` slots per projection written in "
        "place (`lora.LinearLoRA`): a step of one adapter runs two small GEMMs on a contiguous copy of its slot "
        "(`addmm_(mm(x, A^T), B^T)`), a step mixing adapters the same two GEMMs over the slots, each row's other "
        "columns zeroed. "
        "No merged copy per adapter: adapters load while serving and mix in one batch. `F.linear` twice and an "
        "add, the first version, cost one adapter at batch 8 0.65x of the base model's decode rate, and a batch "
        "over 4 adapters (then one pair of GEMMs per adapter, on its rows gathered) 0.62x (2026-12-07, this "
        "machine). On a GPU the fused decode step and its CUDA graphs apply the slots too: steps with no adapter's "
        "rows replay graphs without LoRA ops, the others graphs running punica's shrink and expand kernels "
        "(`ops/gpu/lora.py`: each row its own slot).",
    ])
    print(body)
    if not args.no_write:
        write_section(SECTION if args.device == "cpu" else f"{SECTION} on a GPU", body)  # (each keeps its own)


if __name__ == "__main__":
    main()
