"""A speculative verify step vs a decode step, at the model runner (issues 10 and 11).

Speculation pays only if a verify step (the last sampled token plus the drafts, every token's
logits, a state checkpoint after every draft) costs little more than a decode step. This script
times both on the built-in default model (fp32) with the engine's own pools and
``ModelRunner`` (no scheduler, no drafter):

* batch 1 and 8, requests with ``--prefix`` cached tokens;
* a decode step (``forward_decode``, 1 token per request) vs verify steps (``forward_extend`` with
  ``all_logits``, as the scheduler calls it) feeding 4 and 8 tokens per request, as a chain
  (``speculative_eagle_topk=1``) and as a tree (a root, two alternatives, then a chain below each);
  every fed token but the last takes a checkpoint into a scratch state slot, as the scheduler asks;
* thread CPU time (1 thread) of the whole runner call (host-side batch construction included) and
  of ``model.forward`` alone; medians of ``--repeats`` steps per round, all cases interleaved.

``--before DIR``: the same measurement on another checkout (e.g. ``mkdir DIR && git archive <commit> |
tar -x -C DIR``; ``--before-label`` names it, e.g. the commit), run in subprocesses alternating with
this one (``--rounds`` each) so that both see the same machine; the table then shows before and
after side by side. ``--profile``: ``torch.profiler``
tables (self CPU time by op and input shape) of a batch-1 decode step and a 4-token chain verify step.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/verify_step.py [--repeats 100] [--rounds 3]
        [--prefix 256] [--before DIR [--before-label NAME]] [--profile] [--json] [--no-write]

Writes the ``## Speculative verify step`` section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BATCHES = (1, 8)
FED = (4, 8)
CASES = [("decode", 1, False)] + [(f"{kind} {fed}", fed, kind == "tree") for fed in FED for kind in ("chain", "tree")]


def tree_parents(fed: int) -> list[int]:
    """``draft_parents`` of a ``fed``-token tree: drafts 0 and 1 both continue the last sampled
    token (two alternatives), then each further draft continues the one two before it."""
    return ([0, 0] + [j - 1 for j in range(2, fed - 1)])[:fed - 1]


class Bench:
    """The engine's pools and runner around ``model``, with ``batch`` requests of ``prefix`` cached
    tokens each (their state slots scattered through the pool, as in a running engine)."""

    def __init__(self, model, batch: int, prefix: int, max_fed: int, **runner_options):
        import torch

        from hyla.cache import KVPool, ReqToTokenPool, StatePool
        from hyla.engine.model_runner import ModelRunner
        from hyla.engine.request import Req
        from hyla.engine.sampling_params import SamplingParams

        c = model.config
        layout = c.cache_layout
        self.kv_pool = KVPool.from_layout(layout, batch * (prefix + max_fed) + 16, 1, "cpu")
        self.state_pool = StatePool.from_layout(layout, batch * (2 + max_fed) + 4, "cpu")
        self.req_to_token = ReqToTokenPool(batch + 1, prefix + max_fed + 1)
        self.runner = ModelRunner(model, self.kv_pool, self.state_pool, self.req_to_token, torch.device("cpu"),
                                  **runner_options)
        self.gen = torch.Generator().manual_seed(batch)
        self.vocab = c.vocab_size
        self.reqs = []
        own = self.state_pool.alloc(2 * batch)[::2].tolist()  # scattered, as after some churn in the engine
        for i in range(batch):
            r = Req(rid=str(i), input_ids=torch.randint(3, c.vocab_size, (prefix + 1,), generator=self.gen).tolist(),
                    sampling=SamplingParams(temperature=0, max_new_tokens=max_fed))
            r.req_pool_idx = self.req_to_token.alloc()
            r.state_slot = own[i]
            self.reqs.append(r)
        with torch.inference_mode():  # prefill every prompt but its last token (what a step feeds)
            slots = self.kv_pool.alloc(batch * prefix)
            for i, r in enumerate(self.reqs):
                self.req_to_token.write(r.req_pool_idx, 0, slots[i * prefix:(i + 1) * prefix])
            self.runner.forward_extend(self.reqs, [prefix] * batch, slots, [])
        for r in self.reqs:
            r.kv_len = prefix
        # the step's KV slots (every step writes the same ones: nothing is committed) and scratch slots
        self.step_slots = self.kv_pool.alloc(batch * max_fed).view(batch, max_fed)
        for r, row in zip(self.reqs, self.step_slots):
            self.req_to_token.write(r.req_pool_idx, prefix, row)
        self.scratch = self.state_pool.alloc(batch * (max_fed - 1)).view(batch, max_fed - 1).tolist()

    def set_drafts(self, fed: int, tree: bool) -> None:
        import torch

        for r in self.reqs:
            r.set_drafts(torch.randint(3, self.vocab, (fed - 1,), generator=self.gen).tolist(),
                         tree_parents(fed) if tree else None)

    def chains(self, fed: int):
        """A verify step of padded chains (``ModelRunner.forward_chains``; the runner has a
        ``verify_width``): request 0 feeds ``fed`` tokens, the others 1 each."""
        import torch

        lens = [fed] + [1] * (len(self.reqs) - 1)
        for r, n in zip(self.reqs, lens):
            r.set_drafts([5] * (n - 1))
        loc = torch.cat([self.step_slots[i, :n] for i, n in enumerate(lens)])
        width = self.runner.verify_width
        return self.runner.forward_chains(self.reqs, lens, loc, [s[:width - 1] for s in self.scratch])

    def step(self, fed: int, tree: bool):
        """One step as the scheduler runs it (a decode step when ``fed == 1``)."""
        if fed == 1:
            for r in self.reqs:
                r.clear_drafts()
            return self.runner.forward_decode(self.reqs, self.step_slots[:, 0].contiguous())
        loc = self.step_slots[:, :fed].reshape(-1)
        ckpts = [(i, j + 1, slot) for i, (r, slots) in enumerate(zip(self.reqs, self.scratch))
                 for j, slot in enumerate(slots[:len(r.draft_ids)])]
        trees = [r.fed_parents() for r in self.reqs] if tree else None
        return self.runner.forward_extend(self.reqs, [fed] * len(self.reqs), loc, ckpts, all_logits=True,
                                          tree_parents=trees)


def measure(model, prefix: int, repeats: int) -> dict[str, list[float]]:
    """``"batch|case" -> [median ms of the runner call, median ms of model.forward]``."""
    import torch

    out = {}
    for b in BATCHES:
        bench = Bench(model, b, prefix, max(FED))
        inner: list[float] = []
        orig = model.forward

        def timed_forward(batch, _orig=orig):
            t0 = time.thread_time()
            try:
                return _orig(batch)
            finally:
                inner.append(time.thread_time() - t0)

        samples: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name, _, _ in CASES}
        model.forward = timed_forward
        try:
            with torch.inference_mode():
                for _ in range(3):  # warm-up
                    for name, fed, tree in CASES:
                        bench.set_drafts(fed, tree)
                        bench.step(fed, tree)
                for _ in range(repeats):
                    for name, fed, tree in CASES:
                        if fed > 1:
                            bench.set_drafts(fed, tree)
                        inner.clear()
                        t0 = time.thread_time()
                        bench.step(fed, tree)
                        samples[name][0].append(time.thread_time() - t0)
                        samples[name][1].append(inner[0])
        finally:
            del model.forward
        for name, (whole, fwd) in samples.items():
            out[f"{b}|{name}"] = [1e3 * statistics.median(whole), 1e3 * statistics.median(fwd)]
    return out


def profile(model, prefix: int, fed: int, tree: bool, rows: int = 30) -> str:
    """``torch.profiler`` table (self CPU time by op and input shape) of 50 steps at batch 1."""
    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    bench = Bench(model, 1, prefix, max(FED))
    with torch.inference_mode():
        bench.set_drafts(fed, tree)
        for _ in range(5):
            bench.step(fed, tree)
        with torch_profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            for _ in range(50):
                bench.step(fed, tree)
    calls = sum(e.count for e in prof.key_averages()) / 50
    return (f"{calls:.0f} torch ops per step\n"
            + prof.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total", row_limit=rows))


def run_here(args) -> dict[str, list[float]]:
    sys.path.insert(0, str(args.hyla_root))
    import torch

    from hyla.engine.engine import DEFAULT_MODEL_DIR
    from hyla.model import load_model

    model = load_model(DEFAULT_MODEL_DIR, dtype="float32")
    res = measure(model, args.prefix, args.repeats)
    if args.profile:
        for fed, tree in ((1, False), (4, False)):
            print(f"\n[profile] batch 1, {'decode' if fed == 1 else 'chain'} {fed}:\n" + profile(model, args.prefix, fed, tree))
    res["threads"] = [torch.get_num_threads()]
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=100, help="steps per case per round")
    ap.add_argument("--rounds", type=int, default=3, help="with --before: alternating rounds per side")
    ap.add_argument("--prefix", type=int, default=256, help="cached tokens per request")
    ap.add_argument("--before", type=Path, help="another checkout to measure alternately, for before/after")
    ap.add_argument("--before-label", help="what --before is, for the table (default: its directory)")
    ap.add_argument("--hyla-root", type=Path, default=ROOT, help="the checkout to import hyla from")
    ap.add_argument("--profile", action="store_true", help="also print torch.profiler tables")
    ap.add_argument("--json", action="store_true", help="print the medians as one JSON line (and write nothing)")
    ap.add_argument("--no-write", action="store_true", help="do not write docs/benchmarks.md")
    args = ap.parse_args()
    if args.json:
        print(json.dumps(run_here(args)))
        return
    sides = {"after": ROOT} if args.before is None else {"before": args.before.resolve(), "after": ROOT}
    rounds: dict[str, list[dict[str, list[float]]]] = {side: [] for side in sides}
    for _ in range(args.rounds if args.before is not None else 1):
        for side, root in sides.items():
            cmd = [sys.executable, __file__, "--json", "--hyla-root", str(root), "--repeats", str(args.repeats),
                   "--prefix", str(args.prefix)]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            rounds[side].append(json.loads(out.strip().splitlines()[-1]))
            print(f"[{side}] round {len(rounds[side])} done", flush=True)
    res = {side: {k: [statistics.median(r[k][i] for r in runs) for i in range(len(runs[0][k]))]
                  for k in runs[0]} for side, runs in rounds.items()}
    threads = int(res["after"].pop("threads")[0])
    names = [name for name, _, _ in CASES]
    lines = ["| ms per step (thread CPU time) | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for b in BATCHES:
        for col, what in ((0, "runner call"), (1, "model forward")):
            for side in sides:
                dec = res[side][f"{b}|decode"][col]
                cells = [f"{res[side][f'{b}|{n}'][col]:.2f}" + ("" if n == "decode" else
                                                                 f" ({res[side][f'{b}|{n}'][col] / dec:.2f}x)")
                         for n in names]
                label = f"{what}, batch {b}" + (f", {side}" if len(sides) > 1 else "")
                lines.append(f"| {label} | " + " | ".join(cells) + " |")
    table = "\n".join(lines)
    print(table)
    if args.profile:
        run_here(argparse.Namespace(**{**vars(args), "hyla_root": ROOT, "repeats": 1}))
    label = args.before_label or (args.before.name if args.before is not None else "")
    before = f" --before DIR --before-label {label}" if args.before is not None else ""
    cmd = (f"OMP_NUM_THREADS={threads} .venv/bin/python benchmarks/verify_step.py --repeats {args.repeats} "
           f"--rounds {args.rounds} --prefix {args.prefix}{before}")
    sys.path.insert(0, str(ROOT))
    from benchmarks.report import machine, write_section

    how = (f"before (DIR = {label}, the code before the lean verify step) and after, in alternating "
           f"subprocesses, {args.rounds} rounds each; medians over rounds of the per-round medians of "
           f"{args.repeats} steps" if args.before is not None else f"medians of {args.repeats} steps")
    body = f"""`{cmd}` — {machine()}, {threads} thread(s); built-in default model (tiny Qwen3-Next, 8 layers, fp32).

One step at the model runner, no scheduler and no drafter: `forward_decode` (1 token per request) vs
`forward_extend` of a verify step feeding 4 or 8 tokens per request (the last sampled token and its
drafts) as a chain or as a tree (a root, two alternatives, a chain below each), a checkpoint into a
scratch state slot after every fed token but the last, all logits returned — as the scheduler calls
it. Requests have {args.prefix} cached tokens. Thread CPU time; {how}. "runner call" includes the
host-side batch construction, "model forward" is `model.forward` alone. In parentheses: the ratio to
the decode step of the same batch size and side.

{table}

What the verify step does now (`hyla/model/ops/tree.py`, `ops/attention.py`, docs/architecture.md):
its batch metadata is built once per step in `ForwardBatch` — the tree laid out on lanes with the
checkpoints validated (`TreeScan`), and one KV table and one mask for every attention layer
(`ShortExtendLayout`). Attention is one padded batched attention (the decode step's math with `E`
queries per sequence) instead of one SDPA call per sequence with a mask built per layer; a Gated
DeltaNet layer computes its per-token terms once and runs one state update per depth on a single
state per request (in place on the pool rows when the slots allow, forks only for a tree's
siblings), writing only the checkpoint states; the conv layers compute every token at once from
their ancestors' inputs. Outputs and states equal decode steps along each token's path bitwise
(`tests/test_ops_tree.py`). What remains over a decode step: the projection GEMMs run one row per
fed token (MKL's few-row GEMM on weights streamed from memory costs about twice its one-row GEMV on
this machine), one recurrent update per fed token and layer, and the per-token checkpoint states
written to the pool (at batch {BATCHES[-1]}: {FED[0] - 1} states of every request in every linear layer).
"""
    if not args.no_write:
        write_section("Speculative verify step", body)


if __name__ == "__main__":
    main()
