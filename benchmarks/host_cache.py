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
and the median time to first token (medians over ``--repeats`` runs of the whole workload; the
first run of each configuration is a warm-up). Each configuration's greedy outputs must equal the
first one's up to each request's first floating-point tie (``tests/test_engine_differential.py``:
``compare_outputs``). The model is the built-in default (``--model`` for another), fp32, on the CPU
unless ``--device cuda``.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/host_cache.py [--sessions 16] [--turns 4] [--kv-tokens 4096]
        [--ratios 2,8] [--repeats 3] [--device cpu] [--model PATH] [--no-write]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from benchmarks.report import machine, write_section  # noqa: E402
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


def measure(name: str, options: dict, args, base: list | None) -> dict:
    with Engine(args.model, device=args.device, dtype="float32", max_total_tokens=args.kv_tokens,
                max_running_requests=4, warmup="off", **options) as engine:
        vocab = min(engine.model_config.vocab_size, 32000)
        runs = []
        for _ in range(args.repeats + 1):  # the first: a warm-up
            engine.flush_cache()
            engine.scheduler.reset_stats()  # (the engine is idle: the stats below are the last run's)
            runs.append(run_workload(engine, args.seed, args.sessions, args.turns, vocab))
        stats = engine.get_stats()
        host = engine.cache.host
    last = runs[-1]
    if base is not None:
        compare_outputs(last["outputs"], base)
    return {"name": name, "outputs": last["outputs"], "hit": last["cached"] / last["prompt"],
            "computed": last["prompt"] - last["cached"], "prompt": last["prompt"],
            "ttft_ms": statistics.median(statistics.median(r["ttfts"]) for r in runs[1:]) * 1e3,
            "saved": stats["num_host_saved_tokens"], "loaded": stats["num_host_loaded_tokens"],
            "host_tokens": host.kv_pool.size if host is not None else 0}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sessions", type=int, default=16)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--kv-tokens", type=int, default=4096)
    p.add_argument("--ratios", default="2,8")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--model", default=None)
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args()
    configs = [("prefix cache only", {})] + [(f"host tier x{r:g}", dict(enable_hierarchical_cache=True, hicache_ratio=r))
                                              for r in map(float, args.ratios.split(","))]
    results = []
    for name, options in configs:
        results.append(measure(name, options, args, results[0]["outputs"] if results else None))
        r = results[-1]
        print(f"{name}: hit {r['hit']:.1%}, computed {r['computed']} of {r['prompt']} prompt tokens, "
              f"TTFT {r['ttft_ms']:.1f} ms, host saved {r['saved']} / loaded {r['loaded']} tokens", flush=True)
    base = results[0]
    rows = [f"| {r['name']} | {r['host_tokens'] or '-'} | {r['hit']:.1%} | {r['computed']:,} | {r['saved']:,} | "
            f"{r['loaded']:,} | {r['ttft_ms']:.1f} | {base['ttft_ms'] / r['ttft_ms']:.2f}x |" for r in results]
    body = f"""`{' '.join(['OMP_NUM_THREADS=2 .venv/bin/python benchmarks/host_cache.py'] + sys.argv[1:])}` ({machine()};
model: {args.model or 'the built-in default'}, fp32, {args.device}). {args.sessions} agentic sessions sharing a
{SYSTEM}-token system prompt, {args.turns} turns each ({REPLY}-token replies, {TOOL[0]}-{TOOL[1]}-token tool outputs
appended), served round-robin one request at a time on a {args.kv_tokens}-token device KV pool; figures over the
turns after the first ({base['prompt']:,} prompt tokens); TTFT: medians of {args.repeats} runs. Greedy outputs equal
the first configuration's (up to floating-point ties).

| configuration | host KV tokens | cached share | prompt tokens computed | host saved | host loaded | median TTFT (ms) | TTFT vs prefix cache only |
|---|---|---|---|---|---|---|---|
""" + "\n".join(rows)
    print(body)
    if not args.no_write:
        write_section("Hierarchical cache: the host tier", body)


if __name__ == "__main__":
    main()
