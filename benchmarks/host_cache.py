"""The hierarchical cache's host tier: hits and time to first token when sessions outgrow the device pool.

Agentic sessions interleaved: ``--sessions`` sessions share a system prompt; each turn appends the
model's reply and a tool output to the session's context, and the sessions take turns round-robin,
one request at a time (so a request's time to first token is its prefill). The device KV pool
(``--kv-tokens``) holds a few sessions' contexts: by the time a session comes back, its prefix has
been evicted. Three configurations in the same run, on the same prompts:

* ``prefix cache only`` — the device tree alone (what the evicted sessions recompute);
* ``host tier xR`` — ``enable_hierarchical_cache`` with host pools R times the device's
  (``--ratios``): the evicted prefixes (KV and checkpoints) come back from host memory.

Reported per configuration, over every turn after each session's first: cached prompt tokens as a
share of the prompt tokens, the prompt tokens computed, the host tier's saved and loaded tokens,
and the time to first token: its median, and the TTFTs summed (the prefill time of the workload),
each a median over ``--repeats`` runs of the whole workload, the configurations' runs interleaved
(one engine each) after a warm-up round. Each configuration's greedy outputs must equal the first
one's up to each request's first floating-point tie (``tests/test_engine_differential.py``:
``compare_outputs``). The model is the built-in default, fp32, on the CPU; ``--device cuda
--gpu-model`` runs issue 10's model (Qwen3.5 layers at 0.8B dims, random weights) in bf16.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/host_cache.py [--sessions 16] [--turns 4] [--kv-tokens 4096]
        [--ratios 2,8] [--repeats 3] [--device cuda --gpu-model] [--no-write]
"""

from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from benchmarks.report import machine, write_section  # noqa: E402
from benchmarks.startup import add_model_arguments, model_dir, model_flags, resolve_dtype  # noqa: E402
from hyla import Engine  # noqa: E402
from test_engine_differential import compare_outputs  # noqa: E402

SYSTEM, FIRST, TOOL, REPLY = 256, (200, 400), (100, 300), 16  # tokens: system prompt, first user message, tool outputs, replies


def run_workload(engine: Engine, seed: int, sessions: int, turns: int, vocab: int) -> dict:
    """Serve the interleaved sessions on ``engine``; returns its outputs, per-request TTFTs (turns
    after the first) and the token counts of those turns."""
    rng = random.Random(seed)
    tok = lambda n: [rng.randrange(3, vocab) for _ in range(n)]  # noqa: E731
    system = tok(SYSTEM)
    contexts = [system + tok(rng.randrange(*FIRST)) for _ in range(sessions)]
    tools = [[tok(rng.randrange(*TOOL)) for _ in range(turns)] for _ in range(sessions)]
    outputs, ttfts, prompt, cached = [], [], 0, 0
    for t in range(turns):
        for s in range(sessions):
            start = time.perf_counter()
            chunks = []
            for chunk in engine.generate(input_ids=contexts[s], stream=True, return_logprob=True,
                                         sampling_params={"temperature": 0, "max_new_tokens": REPLY, "ignore_eos": True}):
                if not chunks:
                    first = time.perf_counter() - start
                chunks.append(chunk)
            out = {"output_ids": [i for c in chunks for i in c["output_ids"]],
                   "meta_info": {"id": f"{s}/{t}", "output_token_logprobs": [
                       lp for c in chunks for lp in c["meta_info"]["output_token_logprobs"]]}}
            outputs.append(out)
            if t:
                ttfts.append(first)
                prompt += len(contexts[s])
                cached += chunks[-1]["meta_info"]["cached_tokens"]
            contexts[s] = contexts[s] + out["output_ids"] + tools[s][t]
    return {"outputs": outputs, "ttfts": ttfts, "prompt": prompt, "cached": cached}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(p)
    p.add_argument("--sessions", type=int, default=16)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--kv-tokens", type=int, default=4096)
    p.add_argument("--ratios", default="2,8")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args()
    resolve_dtype(args)
    configs = [("prefix cache only", {})] + [(f"host tier x{r:g}", dict(enable_hierarchical_cache=True, hicache_ratio=r))
                                              for r in map(float, args.ratios.split(","))]
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        path, model = model_dir(args, Path(tmp))
        engines = [stack.enter_context(Engine(path, device=args.device, dtype=args.dtype,
                                              max_total_tokens=args.kv_tokens, max_running_requests=4,
                                              warmup="off", **options)) for _, options in configs]
        vocab = min(engines[0].model_config.vocab_size, 32000)
        runs: list[list[dict]] = [[] for _ in configs]
        for _ in range(args.repeats + 1):  # the first round: a warm-up. Rounds interleave the configurations
            for engine, mine in zip(engines, runs):
                engine.flush_cache()
                engine.scheduler.reset_stats()  # (the engine is idle: its stats are this run's)
                mine.append(run_workload(engine, args.seed, args.sessions, args.turns, vocab))
                mine[-1]["stats"] = engine.get_stats()
        results = []
        for (name, _), engine, mine in zip(configs, engines, runs):
            last, host = mine[-1], engine.cache.host
            compare_outputs(last["outputs"], runs[0][-1]["outputs"])
            results.append({"name": name, "hit": last["cached"] / last["prompt"], "prompt": last["prompt"],
                            "computed": last["prompt"] - last["cached"],
                            "ttft_ms": statistics.median(statistics.median(r["ttfts"]) for r in mine[1:]) * 1e3,
                            "total_s": statistics.median(sum(r["ttfts"]) for r in mine[1:]),
                            "saved": last["stats"]["num_host_saved_tokens"],
                            "loaded": last["stats"]["num_host_loaded_tokens"],
                            "host_tokens": host.kv_pool.size if host is not None else 0})
            r = results[-1]
            print(f"{name}: hit {r['hit']:.1%}, computed {r['computed']} of {r['prompt']} prompt tokens, "
                  f"median TTFT {r['ttft_ms']:.1f} ms, TTFTs summed {r['total_s']:.2f} s, "
                  f"host saved {r['saved']} / loaded {r['loaded']} tokens", flush=True)
    base = results[0]
    rows = [f"| {r['name']} | {r['host_tokens'] or '-'} | {r['hit']:.1%} | {r['computed']:,} | {r['saved']:,} | "
            f"{r['loaded']:,} | {r['ttft_ms']:.1f} | {r['total_s']:.2f} | {base['total_s'] / r['total_s']:.2f}x |"
            for r in results]
    command = " ".join(["benchmarks/host_cache.py", model_flags(args)] + [a for a in sys.argv[1:] if a not in (
        "--no-write", "--gpu-model", "--tiny") and not a.startswith("--device")])
    body = f"""`{command}` ({machine()}; {model}, {args.dtype}).
{args.sessions} agentic sessions sharing a {SYSTEM}-token system prompt, {args.turns} turns each ({REPLY}-token replies,
{TOOL[0]}-{TOOL[1]}-token tool outputs appended), served round-robin one request at a time on a {args.kv_tokens}-token
device KV pool; figures over the turns after the first ({base['prompt']:,} prompt tokens); times: medians of
{args.repeats} runs, the configurations interleaved. Greedy outputs equal the first configuration's (up to
floating-point ties).

| configuration | host KV tokens | cached share | prompt tokens computed | host saved | host loaded | median TTFT (ms) | TTFTs summed (s) | vs prefix cache only |
|---|---|---|---|---|---|---|---|---|
""" + "\n".join(rows)
    print(body)
    if not args.no_write:
        write_section("Hierarchical cache: the host tier", body)


if __name__ == "__main__":
    main()
