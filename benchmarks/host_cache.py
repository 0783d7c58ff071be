"""The hierarchical cache's host tier: hits and time to first token when sessions outgrow the device pool.

Agentic sessions interleaved: ``--sessions`` sessions share a system prompt; each turn appends the
model's reply and a tool output to the session's context, and the sessions take turns round-robin,
one request at a time (so a request's time to first token is its prefill). The device KV pool
(``--kv-tokens``) holds a few sessions' contexts: by the time a session comes back, its prefix has
been evicted. Three configurations in the same run, on the same prompts:

* ``prefix cache only`` — the device tree alone (what the evicted sessions recompute);
* ``host tier xR`` — ``enable_hierarchical_cache`` with host pools R times the device's
  (``--ratios``): the evicted prefixes (KV and checkpoints) come back from host memory;
* with ``--waiting-saves`` (on a CUDA device), ``host tier xR, saves waiting`` for the last ratio:
  each save copied to the host before the eviction goes on, as before saves were deferred
  (``HostCache.defer`` off: the host waits for the copy and scatters the rows before it launches
  the prefill the eviction made room for).

Reported per configuration, over every turn after each session's first: cached prompt tokens as a
share of the prompt tokens, the prompt tokens computed, the host tier's saved and loaded tokens,
and the time to first token: its median, and the TTFTs summed (the prefill time of the workload),
each a median over ``--repeats`` runs of the whole workload, the configurations' runs interleaved
(one engine each) after a warm-up round. Each configuration's greedy outputs must equal the first
one's up to each request's first floating-point tie (``tests/test_engine_differential.py``:
``compare_outputs``). The model is the built-in default, fp32, on the CPU; ``--device cuda
--gpu-model`` runs issue 10's model (Qwen3.5 layers at 0.8B dims, random weights) in bf16.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/host_cache.py [--sessions 16] [--turns 4] [--kv-tokens 4096]
        [--ratios 2,8] [--repeats 3] [--device cuda --gpu-model [--waiting-saves]] [--no-write]

``--replay MODEL`` (a simulator preset, e.g. ``qwen3-next-80b-a3b``) runs no model: the same kind of
workload at that model's size (an 8K-token system prompt, tool outputs of up to 4K tokens) through the
engine's scheduler and cache manager on accounting pools (``hyla.sim.replay``), for each host ratio, and
reports the cached share, the modelled prefill time (``hyla.sim.latency``) and the bytes the tier copies
(and their time over PCIe) — its own section:

    .venv/bin/python benchmarks/host_cache.py --replay qwen3-next-80b-a3b --sessions 32 --turns 6 \
        --kv-tokens 131072 --state-slots 48 --ratios 1,2,4,8
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
from test_engine_differential import compare_outputs, join_stream  # noqa: E402

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
            out = join_stream(chunks)
            outputs.append(out)
            if t:
                ttfts.append(first)
                prompt += len(contexts[s])
                cached += chunks[-1]["meta_info"]["cached_tokens"]
            contexts[s] = contexts[s] + out["output_ids"] + tools[s][t]
    return {"outputs": outputs, "ttfts": ttfts, "prompt": prompt, "cached": cached}


# the replay study (--replay MODEL): agentic sessions at a real model's size, on the engine's scheduler and cache
# manager with accounting pools (hyla.sim.replay): a shared system prompt, a first message, tool outputs, replies
R_SYSTEM, R_FIRST, R_TOOL, R_REPLY = 8192, (1024, 4096), (512, 4096), 64
PCIE_BYTES_PER_S = 25e9  # host <-> device, pinned, PCIe 4 x16 / a loaded Gen5 link


def replay_trace(seed: int, sessions: int, turns: int, vocab: int) -> list:
    """Agentic sessions served round-robin, one request at a time (each its own arrival)."""
    from hyla.sim.trace import TraceRequest

    rng = random.Random(seed)
    tok = lambda n: [rng.randrange(3, vocab) for _ in range(n)]  # noqa: E731
    system = tok(R_SYSTEM)
    contexts = [system + tok(rng.randrange(*R_FIRST)) for _ in range(sessions)]
    trace = []
    for t in range(turns):
        for s in range(sessions):
            reply = tok(R_REPLY)
            trace.append(TraceRequest(s, t, float(len(trace)), list(contexts[s]), reply))
            contexts[s] = contexts[s] + reply + tok(rng.randrange(*R_TOOL))
    return trace


def replay_study(args) -> None:
    """``--replay MODEL``: the host tier's hits and copies at a real model's size (accounting pools), with
    the modelled prefill time (``hyla.sim.latency``: one H100 at 40%) and the copies' time over PCIe."""
    from hyla.sim.latency import LatencyModel
    from hyla.sim.models import resolve_model
    from hyla.sim.replay import replay_engine

    model = resolve_model(args.replay)
    layout, latency = model.layout, LatencyModel()
    trace = replay_trace(args.seed, args.sessions, args.turns, min(model.vocab_size or 32000, 32000))
    # (the engine at the checkpoint's dtype, as the layout's bytes below are: the replay sizes its pools at the
    # engine's dtype, float32 by default)
    pools = dict(max_total_tokens=args.kv_tokens, max_state_slots=args.state_slots, max_running_requests=8,
                 chunked_prefill_size=8192, page_size=args.page_size,
                 dtype=str(layout.kv_dtype).removeprefix("torch."))
    later = [i for i, r in enumerate(trace) if r.turn_id]  # turns after each session's first
    prompt = sum(len(trace[i].input_tokens) for i in later)
    rows = []
    for ratio in [0.0] + [float(r) for r in args.ratios.split(",")]:
        options = dict(pools, **(dict(enable_hierarchical_cache=True, hicache_ratio=ratio) if ratio else {}))
        start = time.perf_counter()
        replay = replay_engine(trace, layout, vocab_size=model.vocab_size, **options)
        took = time.perf_counter() - start
        cached = sum(replay.cached_tokens[i] for i in later)
        prefill = sum(latency.ttft(model, len(trace[i].input_tokens), replay.cached_tokens[i]) for i in later)
        host = replay.cache.host
        moved = {"saved": 0.0, "loaded": 0.0}
        if host is not None:
            moved = {"saved": host.num_saved_tokens * layout.kv_bytes_per_token
                     + host.num_saved_checkpoints * layout.state_bytes_per_slot,
                     "loaded": host.num_loaded_tokens * layout.kv_bytes_per_token
                     + host.num_loaded_checkpoints * layout.state_bytes_per_slot}
        rows.append((f"x{ratio:g}" if ratio else "prefix cache only", host.total_bytes / 2**30 if host else 0.0,
                     cached / prompt, prefill, moved["saved"] / 2**30, moved["loaded"] / 2**30,
                     (moved["saved"] + moved["loaded"]) / PCIE_BYTES_PER_S))
        print(f"{rows[-1][0]}: hit {cached / prompt:.1%}, modelled prefill {prefill:.1f} s, host copies "
              f"{rows[-1][4]:.1f} GiB saved / {rows[-1][5]:.1f} GiB loaded ({took:.0f} s to replay)", flush=True)
    base = rows[0][3]
    table = "\n".join(f"| {name} | {gib:.0f} | {hit:.1%} | {prefill:.1f} | {saved:.1f} | {loaded:.1f} | {pcie:.1f} | "
                      f"{base / (prefill + pcie):.2f}x |" for name, gib, hit, prefill, saved, loaded, pcie in rows)
    device_gib = (args.kv_tokens * layout.kv_bytes_per_token + args.state_slots * layout.state_bytes_per_slot) / 2**30
    body = f"""`benchmarks/host_cache.py --replay {args.replay} --sessions {args.sessions} --turns {args.turns} --kv-tokens \
{args.kv_tokens} --state-slots {args.state_slots} --page-size {args.page_size} --ratios {args.ratios}` ({machine()}): the
engine's scheduler and cache manager replayed on accounting pools (`hyla.sim.replay`) at {model.name}'s size — device
pools of {args.kv_tokens:,} KV tokens and {args.state_slots} state slots ({device_gib:.1f} GiB; a state slot is
{layout.state_bytes_per_slot / 2**20:.0f} MiB, a token's KV {layout.kv_bytes_per_token / 2**10:.0f} KiB). {args.sessions}
agentic sessions share a {R_SYSTEM:,}-token system prompt; each of {args.turns} turns appends a {R_REPLY}-token reply and a
{R_TOOL[0]:,}-{R_TOOL[1]:,}-token tool output; the sessions come round-robin, one request at a time. Over the turns after
the first ({prompt:,} prompt tokens): cached share, the modelled prefill time summed (`hyla.sim.latency`: 5 ms + the
uncached part's FLOPs at 40% of an H100), the host tier's copies (KV and checkpoints) and their time at
{PCIE_BYTES_PER_S / 1e9:.0f} GB/s, and the speed-up of prefill + copies over the device alone.

| host tier | host pools (GiB) | cached share | modelled prefill (s) | saved to host (GiB) | loaded from host (GiB) | copies at {PCIE_BYTES_PER_S / 1e9:.0f} GB/s (s) | vs prefix cache only |
|---|---|---|---|---|---|---|---|
""" + table
    print(body)
    if not args.no_write:
        write_section(f"Hierarchical cache: the host tier at {model.name}'s size (engine replay)", body)


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
    p.add_argument("--replay", default=None, metavar="MODEL",
                   help="the replay study at a simulator model's size (e.g. qwen3-next-80b-a3b): no model runs")
    p.add_argument("--state-slots", type=int, default=64, help="--replay: device state slots")
    p.add_argument("--page-size", type=int, default=1, help="--replay: page size")
    p.add_argument("--waiting-saves", action="store_true",
                   help="also the last ratio with saves that wait for their copies (CUDA: deferred saves' A/B)")
    args = p.parse_args()
    if args.replay:
        return replay_study(args)
    resolve_dtype(args)
    configs = [("prefix cache only", {})] + [(f"host tier x{r:g}", dict(enable_hierarchical_cache=True, hicache_ratio=r))
                                              for r in map(float, args.ratios.split(","))]
    if args.waiting_saves:
        if args.device != "cuda":
            p.error("--waiting-saves compares deferred saves, which only a CUDA device makes")
        configs.append((configs[-1][0] + ", saves waiting", dict(configs[-1][1])))
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        path, model = model_dir(args, Path(tmp))
        engines = [stack.enter_context(Engine(path, device=args.device, dtype=args.dtype,
                                              max_total_tokens=args.kv_tokens, max_running_requests=4,
                                              warmup="off", **options)) for _, options in configs]
        if args.waiting_saves:
            engines[-1].cache.host.defer = False
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
