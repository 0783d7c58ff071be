"""Speculative decoding benchmark (issue 11), written to the ``## Speculative decoding`` (n-gram,
workload (a)), ``## Speculative decoding: MTP`` (workload (b)) and ``## Speculative decoding: draft
model`` sections of docs/benchmarks.md.

Output tokens/s and accept length with n-gram speculation on vs off, at batch 1 (the 8 prompts one
after the other) and batch 8 (all at once), greedy, on the built-in default model (``Engine()``:
the tiny Qwen3-Next trained on ShareGPT) in fp32 on CPU:

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/speculative.py [--repeats 5] [--new-tokens 128]

Workloads (8 prompts each, ``max_new_tokens`` tokens each, ``ignore_eos`` so both sides do the
same work):

* ``grounded`` — the issue's input-grounded workload: the chat template around "Repeat the
  following text exactly:" + an assistant message of ShareGPT (500–900 characters). An n-gram
  drafter wins here only if the model copies its prompt (the default model was fine-tuned to, by
  ``scripts/train_copy.py``, on other passages: these are held out); the script measures how much
  it does (share of output tokens whose 4-gram occurs in the passage).
* ``repetitive`` — synthetic: raw-text prompts that already repeat a phrase or a list several
  times, which the drafter predicts from the prompt and from the request's own output (they send a
  small model's greedy decoding into loops within a few tokens).

Speculation: ``speculative_algorithm="ngram"``, 4 draft tokens per step by default (``--draft-tokens``; at most 3 drafts + the last
token), match windows 1..12, adaptive drafting (the default) — and, as its peer in the same run, the
same with ``speculative_ngram_adaptive=False`` (*fixed*: every match drafted in full). Every engine
keeps the prefix cache on (the default); a warm-up run caches every prompt, so the timed runs
prefill one token each and tokens/s is generation speed. Runs of the engines are interleaved (per
prompt at batch 1, order rotating); medians of ``--repeats``. Every run checks that speculation on
and off give identical greedy token ids (exit status 1 if not). Besides tokens/s and the accept
length, the tokens fed per request and verify step (the last sampled token + the drafts).

Workload (b), ``--part mtp``: the default model with its MTP head (``speculative_algorithm="mtp"``,
``speculative_num_steps`` drafts per step; ``scripts/train_mtp_head.py``) on 8 chat prompts (the
first user message of ShareGPT conversations, chat template), greedy, spec on vs off at batch 1 and
8 — tokens/s, accept length, and where a verify step's time goes (model forward, the MTP's
``observe`` and drafting).

``--part draft``: the same chat workload with a separate draft model (``speculative_algorithm="draft"``,
``speculative_num_steps`` drafts per step): the default model as its own draft (every draft is the
model's own greedy token: the accept-length ceiling, at the cost of a second copy of the model), its
first four layers with its final norm and LM head (an early-exit draft built by this script, no
training: half the model's layers), the same with trees (``speculative_eagle_topk=2``), and
``--draft-model-path PATH`` if given.

``--part draft-compiled``: that workload, the early-exit draft (chains), every engine with
``compile_decode=True``: the model's verify steps as padded chains through the compiled graph and the
draft model's steps through its own compiled graphs, against the same engine with the draft model's
steps eager and the compiled plain engine; written to
``## Speculative decoding: draft model with compile_decode``.

``--part mtp-compiled``: the MTP workload, every engine with ``compile_decode`` (MTP's steps through
the graphs compiled to return the hidden states, its verify steps as padded chains), against the
same with eager verify steps and the compiled plain engine; written to
``## Speculative decoding: MTP with compile_decode``.

``--part compiled``: workload (a) with ``compile_decode=True`` on both sides (decode steps and, with
n-gram chains, verify steps through ``torch.compile``), the eager pair as the peer in the same run,
and the compiled decode vs verify step at the model runner.

``--part tree-compiled``: workload (a) with n-gram *trees* (``speculative_eagle_topk=2``), every engine with
``compile_decode=True``: the trees' verify steps as padded trees through the compiled graphs
(``verify_trees``), against the same engine with its verify steps on the eager ops (what trees ran before
2026-12-04), the n-gram chains through the compiled graphs, and the compiled plain engine; written to
``## Speculative decoding: n-gram trees with compile_decode``.

``--part gpu`` (on a GPU): workload (a) on the default model in fp32 on CUDA, n-gram speculation on
vs off, both engines' decode steps replayed from CUDA graphs and the speculative one's verify steps
too (fused verify chains: docs/engine.md); written to ``## Speculative decoding: GPU``. A tiny model
on a GPU is launch-bound: a step costs what its kernels' launches do, whatever the tokens it feeds,
which is where a verify step of several tokens pays most.

``--part mtp-gpu`` (on a GPU): workload (b), the MTP head on vs off in fp32 on CUDA; the model's
decode and verify steps and the head's drafts and verify passes replayed from CUDA graphs
(``cuda_graph.CudaGraphMtp``); written to ``## Speculative decoding: MTP on a GPU``.

Then (n-gram) a profile of one verify step vs one plain decode step (CPU time of the scheduler thread per
step, by wrapping the functions the model layers call; exact with ``OMP_NUM_THREADS=1``) and a
micro-benchmark of the gated-delta-rule layer on a verify-shaped input: the chunked kernel the
verify step uses today vs a per-token recurrent loop with the same outputs and per-token states.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.report import machine, write_section  # noqa: E402
from hyla import Engine  # noqa: E402

NUM_PROMPTS = 8
SPEC = dict(speculative_algorithm="ngram", speculative_num_draft_tokens=4,
            speculative_ngram_min_match_window_size=1, speculative_ngram_max_match_window_size=12)
FIXED = dict(SPEC, speculative_ngram_adaptive=False)  # every match drafted in full: the peer of adaptive drafting
PROFILE_SIDES = {"off": {}, "on": SPEC, "fixed": FIXED}
PROFILE_HEADS = {"off": "decode", "on": "verify", "fixed": "verify, fixed"}
POOLS = dict(max_total_tokens=32768, max_state_slots=160, max_running_requests=NUM_PROMPTS)
SGLANG_ACCEPT = "2.7–4.2 (SGLang, MTP on Qwen3-Next)"
MTP_STEPS = 3
MTP_SPEC = dict(speculative_algorithm="mtp", speculative_num_steps=MTP_STEPS)
DRAFT_STEPS = 3
DRAFT_TREE = dict(speculative_eagle_topk=2, speculative_num_draft_tokens=7)  # beams of 2, at most 6 nodes
MTP_TREE = dict(MTP_SPEC, **DRAFT_TREE)  # the MTP head's trees: depth MTP_STEPS
TREE_LABEL = f"tree (top-2, {DRAFT_TREE['speculative_num_draft_tokens'] - 1} nodes)"
EARLY_EXIT_LAYERS = 4  # the early-exit draft: the default model's first layers (3 Gated DeltaNet + 1 attention)

REPETITIVE = [
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,",
    "1. apples\n2. oranges\n3. bananas\n4. grapes\n5. pears\n\n1. apples\n2. oranges\n3. bananas\n4. grapes\n"
    "5. pears\n\n1. apples\n2.",
    "Monday, Tuesday, Wednesday, Thursday, Friday. Monday, Tuesday, Wednesday, Thursday, Friday. Monday,",
    "the cat sat on the mat. " * 6,
    "I want you to act as a teacher. I want you to act as a teacher. I want you to act as a",
    "- Item one\n- Item two\n- Item three\n- Item one\n- Item two\n- Item three\n-",
    "Step 1: open the door. Step 2: open the window. Step 3: open the box. Step 4:",
    "Q: What is your name?\nA: My name is Bob.\nQ: What is your name?\nA: My name is Bob.\nQ:",
]


# ------------------------------------------------------------------------------------------------
# workloads
# ------------------------------------------------------------------------------------------------
def sharegpt_passages(n: int) -> list[str]:
    """The first ``n`` ShareGPT conversations' first assistant message of 500–900 ASCII characters
    without code blocks (deterministic: file order)."""
    from hyla.data.sharegpt import load_conversations

    out = []
    for conv in load_conversations():
        for msg in conv.get("conversations") or []:
            text = msg.get("value") or ""
            if msg.get("from") == "gpt" and 500 <= len(text) <= 900 and text.isascii() and "```" not in text:
                out.append(text)
                break
        if len(out) == n:
            return out
    raise RuntimeError(f"only {len(out)} ShareGPT passages qualify")


def chat_prompts(tok, n: int = NUM_PROMPTS) -> list[list[int]]:
    """The first user message (20–400 ASCII characters, no code) of the first ``n`` qualifying
    ShareGPT conversations, in the chat template (deterministic: file order)."""
    from hyla.data.sharegpt import load_conversations

    out = []
    for conv in load_conversations():
        turns = conv.get("conversations") or []
        text = (turns[0].get("value") or "") if turns and turns[0].get("from") == "human" else ""
        if 20 <= len(text) <= 400 and text.isascii() and "```" not in text:
            out.append(tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]), add_special_tokens=False))
        if len(out) == n:
            return out
    raise RuntimeError(f"only {len(out)} ShareGPT questions qualify")


def workloads(tok) -> dict[str, tuple[list[list[int]], list[list[int]]]]:
    """name -> (prompts, the text each prompt asks to copy, as tokens: the passage, or the whole
    prompt for *repetitive*)."""
    passages = sharegpt_passages(NUM_PROMPTS)
    grounded = [tok.encode(tok.apply_chat_template(
        [{"role": "user", "content": "Repeat the following text exactly:\n\n" + p}]), add_special_tokens=False)
        for p in passages]
    repetitive = [tok.encode(p, add_special_tokens=False) for p in REPETITIVE[:NUM_PROMPTS]]
    return {"grounded": (grounded, [tok.encode(p, add_special_tokens=False) for p in passages]),
            "repetitive": (repetitive, repetitive)}


def matched_grams(prompt: list[int], output: list[int], source: list[int], n: int = 4) -> collections.Counter:
    """The output's n-grams (ending at an output token) that occur in ``source``, counted."""
    in_source = {tuple(source[i:i + n]) for i in range(len(source) - n + 1)}
    full, base = prompt + output, len(prompt)
    grams = (tuple(full[base + i - n + 1:base + i + 1]) for i in range(len(output)))
    return collections.Counter(g for g in grams if g in in_source)


def copy_shares(prompt: list[int], output: list[int], source: list[int], n: int = 4) -> tuple[float, float]:
    """(share of output tokens whose n-gram ending there occurs in ``source`` (the part of the prompt
    to copy, e.g. the passage without the chat template), share whose n-gram occurred earlier in the
    output): copying the input vs repeating itself."""
    in_prompt = {tuple(source[i:i + n]) for i in range(len(source) - n + 1)}
    full, base = prompt + output, len(prompt)
    seen: set[tuple[int, ...]] = set()
    from_prompt = from_self = 0
    for i in range(len(output)):
        gram = tuple(full[base + i - n + 1:base + i + 1])
        from_prompt += gram in in_prompt
        if i >= n - 1:
            from_self += gram in seen
            seen.add(gram)
    return from_prompt / len(output), from_self / len(output)


def probe_copying(engine: Engine, passage: str, new_tokens: int = 64) -> list[tuple[str, float]]:
    """Does the model copy from its prompt at all? Greedy output of several prompt forms that invite
    copying; per form the share of output tokens whose 4-gram occurs in the text to copy."""
    tok = engine.tokenizer
    sentence = "Every evening the keeper climbed the narrow stairs to light the lamp."
    items = "1. apples\n2. oranges\n3. bananas\n4. grapes\n5. pears\n\n"

    def chat(messages: list[dict]) -> str:
        return tok.apply_chat_template(messages)

    def user(text: str) -> dict:
        return {"role": "user", "content": text}

    forms: dict[str, tuple[str, str]] = {  # name -> (prompt, the text to copy)
        'chat: "Repeat the following text exactly:" + passage':
            (chat([user("Repeat the following text exactly:\n\n" + passage)]), passage),
        'chat: "Rewrite the following text:" + passage': (chat([user("Rewrite the following text:\n\n" + passage)]), passage),
        "chat: repeat request, the answer already started (first 100 characters)":
            (chat([user("Repeat the following text exactly:\n\n" + passage)]) + passage[:100], passage),
        "chat: two earlier turns echo a sentence, then the same request":
            (chat([user("Say: " + sentence), {"role": "assistant", "content": sentence}] * 2 + [user("Say: " + sentence)]),
             sentence),
        'raw text: "Repeat the following text exactly:" + passage':
            ("Repeat the following text exactly:\n\n" + passage + "\n\n", passage),
        "raw text: the passage twice, then its first 100 characters": ((passage + "\n\n") * 2 + passage[:100], passage),
        "raw text: a sentence 16 times, then its first half": ((sentence + " ") * 16 + sentence[:34], sentence + " " + sentence),
        "raw text: a 5-item list 3 times, then its first item": (items * 3 + "1. apples\n", items * 2),
    }
    params = {"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True}
    out = []
    for name, (text, source) in forms.items():
        ids = tok.encode(text, add_special_tokens=False)
        res = engine.generate(input_ids=ids, sampling_params=params)
        out.append((name, copy_shares(ids, res["output_ids"], tok.encode(source, add_special_tokens=False))[0]))
        print(f"[copy probe] {name}: {out[-1][1]:.0%} of output 4-grams from the text to copy; {res['text'][:80]!r}", flush=True)
    return out


# ------------------------------------------------------------------------------------------------
# timing
# ------------------------------------------------------------------------------------------------
def run_once(engine: Engine, prompts: list[list[int]], batch: int, params: dict) -> tuple[float, float, list[dict]]:
    """Generate for every prompt, ``batch`` at a time; (wall s, process CPU s, outputs in prompt order)."""
    outs: list[dict] = []
    w0, c0 = time.perf_counter(), time.process_time()
    for i in range(0, len(prompts), batch):
        chunk = prompts[i:i + batch]
        res = engine.generate(input_ids=chunk, sampling_params=params)
        outs.extend(res)
    return time.perf_counter() - w0, time.process_time() - c0, outs


def check_identical(name: str, off: list[dict], on: list[dict]) -> None:
    for i, (a, b) in enumerate(zip(off, on, strict=True)):
        x, y = a["output_ids"], b["output_ids"]
        if x != y:
            pos = next((j for j, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
            raise SystemExit(f"FAIL [{name}] prompt {i}: speculation changed the greedy output at token {pos} "
                             f"(off {x[pos:pos + 5]} vs on {y[pos:pos + 5]}; lengths {len(x)} / {len(y)})")


def accept_length(outs: list[dict]) -> tuple[float, int]:
    """(output tokens per verify step over all requests, verify steps); (1.0, 0) without speculation."""
    if not all("spec_verify_ct" in o["meta_info"] for o in outs):
        return 1.0, 0
    steps = sum(o["meta_info"]["spec_verify_ct"] for o in outs)
    toks = sum(o["meta_info"]["spec_accept_length"] * o["meta_info"]["spec_verify_ct"] for o in outs)
    return toks / steps, steps


def bench(engines: dict[str, Engine], prompts: list[list[int]], sources: list[list[int]], name: str, repeats: int,
          new_tokens: int) -> list[dict]:
    """Every engine of ``engines`` ("off": the plain one, then one or more speculative ones) on the
    prompts, at batch 1 and 8: one row per batch size. The row's top-level keys are the "on"
    engine's; ``row["sides"][side]`` has every speculative engine's (tok/s, ratios to "off",
    accept length, verify steps, tokens fed per request and verify step)."""
    params = {"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True}
    sides = list(engines)
    rows = []
    for batch in (1, NUM_PROMPTS):
        wall: dict[str, list[float]] = {side: [] for side in sides}
        cpu: dict[str, list[float]] = {side: [] for side in sides}
        last: dict[str, list[dict]] = {}
        counters0 = {side: _spec_counters(e) for side, e in engines.items()}
        for rep in range(repeats):
            # interleaved per group of `batch` prompts (order rotating), summed per side per repeat
            w_sum, c_sum = dict.fromkeys(sides, 0.0), dict.fromkeys(sides, 0.0)
            outs_all: dict[str, list[dict]] = {side: [] for side in sides}
            for i in range(0, len(prompts), batch):
                k = (rep + i // batch) % len(sides)
                for side in sides[k:] + sides[:k]:
                    w, c, outs = run_once(engines[side], prompts[i:i + batch], batch, params)
                    w_sum[side] += w
                    c_sum[side] += c
                    outs_all[side] += outs
            for side in sides:
                wall[side].append(w_sum[side])
                cpu[side].append(c_sum[side])
                last[side] = outs_all[side]
                if side != "off":
                    check_identical(f"{name} ({side}), batch {batch}, repeat {rep}", last["off"], last[side])
        toks = len(prompts) * new_tokens
        off_tps = toks / statistics.median(wall["off"])
        per_side = {}
        for side in sides[1:]:
            acc, steps = accept_length(last[side])
            fed, verified = (a - b for a, b in zip(_spec_counters(engines[side]), counters0[side]))
            tps = toks / statistics.median(wall[side])
            per_side[side] = dict(tps=tps, ratio=tps / off_tps,
                                  cpu_ratio=statistics.median(cpu["off"]) / statistics.median(cpu[side]),
                                  accept=acc, steps=steps, fed=fed / max(1, verified))
        on = per_side["on"]
        shares = [copy_shares(p, o["output_ids"], src) for p, o, src in zip(prompts, last["off"], sources)]
        row = dict(workload=name, batch=batch, tokens=toks, off=off_tps, on=on["tps"], ratio=on["ratio"],
                   cpu_ratio=on["cpu_ratio"], accept=on["accept"], steps=on["steps"], fed=on["fed"], sides=per_side,
                   from_prompt=statistics.mean(s[0] for s in shares), from_self=statistics.mean(s[1] for s in shares))
        matches = sum((matched_grams(p, o["output_ids"], src) for p, o, src in zip(prompts, last["off"], sources)),
                      collections.Counter())
        if matches:
            gram, count = matches.most_common(1)[0]
            row["top_match"] = (engines["off"].tokenizer.decode(list(gram)), count, sum(matches.values()))
        row["prompt_tokens"] = sum(map(len, prompts))
        row["cached_total"] = sum(o["meta_info"]["cached_tokens"] for o in last["on"])
        rows.append(row)
        for side, r in per_side.items():
            print(f"[{name}] batch {batch}: off {off_tps:.1f} tok/s, {side} {r['tps']:.1f} tok/s, ratio {r['ratio']:.2f}x "
                  f"(CPU time {r['cpu_ratio']:.2f}x), accept length {r['accept']:.2f} over {r['steps']} verify steps, "
                  f"{r['fed']:.2f} tokens fed per request and verify step", flush=True)
        print(f"[{name}] batch {batch}: output from prompt {row['from_prompt']:.0%} / repeats itself "
              f"{row['from_self']:.0%}; identical greedy ids: OK", flush=True)
    return rows


def warm_and_bench(engines: dict[str, Engine], loads: dict, args) -> list[dict]:
    """A warm-up run of every workload on every engine (it caches every prompt, and every engine's
    greedy ids must equal the "off" engine's), then :func:`bench` of each workload."""
    params = {"temperature": 0, "max_new_tokens": args.new_tokens, "ignore_eos": True}
    for name, (prompts, _) in loads.items():
        outs = {side: run_once(e, prompts, NUM_PROMPTS, params)[2] for side, e in engines.items()}
        for side in engines:
            check_identical(f"{name} ({side}), warm-up", outs["off"], outs[side])
    rows = []
    for name, (prompts, sources) in loads.items():
        rows += bench(engines, prompts, sources, name, args.repeats, args.new_tokens)
    return rows


def warm_bench_shutdown(engines: dict[str, Engine], args) -> list[dict]:
    """:func:`warm_and_bench` of workload (a) on ``engines``, which are shut down afterwards (also on failure)."""
    try:
        return warm_and_bench(engines, workloads(engines["off"].tokenizer), args)
    finally:
        for e in engines.values():
            e.shutdown()


def _spec_counters(engine: Engine) -> tuple[int, int]:
    """(tokens fed by verify steps, request-verify steps) so far: summed over requests."""
    s = engine.scheduler
    return s.num_fed_tokens, s.num_verify_steps


# ------------------------------------------------------------------------------------------------
# profile: one verify step vs one plain decode step
# ------------------------------------------------------------------------------------------------
LAYER_FUNCS = {  # (hyla.model.layers module, the name it calls) -> row label
    ("gated_deltanet", "recurrent_gated_delta_rule_update"): "gated delta rule",
    ("gated_deltanet", "chunk_gated_delta_rule_varlen"): "gated delta rule",
    ("gated_deltanet", "causal_conv1d_update"): "causal conv1d",
    ("recurrent", "causal_conv1d_varlen"): "causal conv1d",
    ("attention", "paged_attention"): "attention (paged)",
    ("attention", "paged_attention_short_extend"): "attention (paged)",
}


class StepProfiler:
    """Per-step CPU time of the scheduler thread, split by the functions the layers call. Patches
    module attributes of this process only (nothing on disk changes)."""

    def __init__(self) -> None:
        import hyla.engine.scheduler as sched_mod
        import hyla.engine.speculative as spec_mod
        import importlib

        self.clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
        self.acc: dict[str, float] = collections.defaultdict(float)
        self.steps: list[dict[str, float]] = []
        self.patches: list[tuple[Any, str, Any]] = []
        for (module, fn), label in LAYER_FUNCS.items():
            self._wrap(importlib.import_module(f"hyla.model.layers.{module}"), fn, label)
        self._wrap(sched_mod, "verify", "verify(): acceptance, logprobs")
        self._wrap(spec_mod.NgramDrafter, "propose", "n-gram drafter (propose)")
        self._wrap(torch.nn.Linear, "forward", "linear layers + LM head")

    def _wrap(self, owner: Any, name: str, label: str) -> None:
        orig = getattr(owner, name)
        clock, acc = self.clock, self.acc

        def timed(*a, **k):
            t0 = clock()
            try:
                return orig(*a, **k)
            finally:
                acc[label] += clock() - t0

        self.patches.append((owner, name, orig))
        setattr(owner, name, timed)

    def attach(self, engine: Engine) -> None:
        s, clock, acc = engine.scheduler, self.clock, self.acc
        orig_schedule, orig_run, orig_process = s.schedule, s.run, s.process
        box: dict[str, Any] = {}

        def schedule():
            acc.clear()
            t0 = clock()
            batch = orig_schedule()
            box["schedule"] = clock() - t0
            return batch

        def run(batch):
            t0 = clock()
            out = orig_run(batch)
            box["forward"] = clock() - t0
            return out

        def process(batch, logits):
            t0 = clock()
            out = orig_process(batch, logits)
            if batch.is_decode:
                self.steps.append(dict(acc, schedule=box["schedule"], forward=box["forward"],
                                       process=clock() - t0, fed=sum(batch.lens), batch=len(batch.reqs)))
            return out

        s.schedule, s.run, s.process = schedule, run, process

    def restore(self) -> None:
        for owner, name, orig in reversed(self.patches):
            setattr(owner, name, orig)

    def summary(self) -> dict[str, float]:
        """Median ms per step of every component (a component a step lacks counts 0)."""
        keys = {k for st in self.steps for k in st}
        med = {k: statistics.median(st.get(k, 0.0) for st in self.steps) for k in keys}
        return {k: (v if k in ("fed", "batch") else 1e3 * v) for k, v in med.items()}

    def by_fed(self) -> dict[int, tuple[float, int, float]]:
        """Tokens fed per step -> (median ms per step, number of steps, median gated-delta ms)."""
        groups: dict[int, list[dict[str, float]]] = collections.defaultdict(list)
        for st in self.steps:
            groups[int(st["fed"])].append(st)
        return {n: (1e3 * statistics.median(x["schedule"] + x["forward"] + x["process"] for x in v), len(v),
                    1e3 * statistics.median(x.get("gated delta rule", 0.0) for x in v)) for n, v in sorted(groups.items())}


def profile(prompts: list[list[int]], new_tokens: int) -> tuple[dict, dict]:
    """({batch: {side: median ms per step}}, {side: batch 1's step time by tokens fed}); sides: "off"
    (plain decode), "on" (adaptive drafting), "fixed" (every match drafted in full)."""
    prof_all: dict[int, dict[str, dict[str, float]]] = {}
    by_fed: dict[str, dict[int, tuple[float, int]]] = {}
    params = {"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True}
    for batch in (1, NUM_PROMPTS):
        prof_all[batch] = {}
        for side, opts in PROFILE_SIDES.items():
            with Engine(dtype="float32", device="cpu", **POOLS, **opts) as engine:
                run_once(engine, prompts[:batch], batch, params)  # warm-up, caches the prompts
                prof = StepProfiler()
                try:
                    prof.attach(engine)
                    run_once(engine, prompts[:batch], batch, params)
                finally:
                    prof.restore()
                prof_all[batch][side] = prof.summary()
                if batch == 1:
                    by_fed[side] = prof.by_fed()
    return prof_all, by_fed


def gdn_micro(cfg, batches=(1, NUM_PROMPTS), fed: int = 4, repeats: int = 40) -> list[dict]:
    """One gated-delta-rule layer (the default model's shapes) on a verify-shaped input: ``fed``
    tokens per sequence and the states after each of the first ``fed - 1`` of them. The engine's
    chunked kernel (chunks of 64) vs a per-token recurrent loop on the gathered states with the
    same outputs and states (checked), and a plain 1-token decode step for reference; CPU ms."""
    from hyla.model.ops.gated_delta import chunk_gated_delta_rule_varlen, prepare_qk, recurrent_gated_delta_rule_update

    g_ = torch.Generator().manual_seed(0)
    hk, dk = cfg.linear_num_key_heads, cfg.linear_key_head_dim
    hv, dv = cfg.linear_num_value_heads, cfg.linear_value_head_dim
    clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter

    def med(f: Callable[[], Any]) -> float:
        f()
        ts = []
        for _ in range(repeats):
            t0 = clock()
            f()
            ts.append(clock() - t0)
        return 1e3 * statistics.median(ts)

    rows = []
    with torch.inference_mode():
        for b in batches:
            t = b * fed
            q, k = torch.randn(t, hk, dk, generator=g_), torch.randn(t, hk, dk, generator=g_)
            v = torch.randn(t, hv, dv, generator=g_)
            g = -0.1 * torch.rand(t, hv, generator=g_)
            beta = torch.rand(t, hv, generator=g_)
            pool = 0.1 * torch.randn(b * fed + 1, hv, dk, dv, generator=g_)
            base = pool.clone()
            slots = torch.arange(b)
            cu = torch.arange(0, t + 1, fed)
            ck_seq = torch.arange(b).repeat_interleave(fed - 1)
            ck_len = torch.arange(1, fed).repeat(b)
            ck_slot = b + torch.arange(b * (fed - 1))

            def chunked():
                return chunk_gated_delta_rule_varlen(q, k, v, g, beta, cu, pool, slots, ck_seq, ck_len, ck_slot)

            def token_loop():
                qf, kf = prepare_qk(q, k, hv, True)
                qf, kf = qf.view(b, fed, hv, dk), kf.view(b, fed, hv, dk)
                vs, gs, bs = v.view(b, fed, hv, dv), g.view(b, fed, hv), beta.view(b, fed, hv)
                state = pool.index_select(0, slots)
                per_token, outs = [], []
                for j in range(fed):
                    state.mul_(gs[:, j].exp()[..., None, None])
                    delta = (vs[:, j] - (kf[:, j].unsqueeze(-2) @ state).squeeze(-2)) * bs[:, j].unsqueeze(-1)
                    state.view(-1, dk, dv).baddbmm_(kf[:, j].reshape(-1, dk, 1), delta.reshape(-1, 1, dv))
                    outs.append((qf[:, j].unsqueeze(-2) @ state).squeeze(-2))
                    if j < fed - 1:
                        per_token.append(state.clone())
                pool.index_copy_(0, slots, state)
                pool.index_copy_(0, ck_slot.view(b, fed - 1).t().reshape(-1), torch.cat(per_token))
                return torch.stack(outs, 1).reshape(t, hv, dv)

            def decode():
                return recurrent_gated_delta_rule_update(q[:b], k[:b], v[:b], g[:b], beta[:b], pool, slots)

            def one_token_chunked():
                return chunk_gated_delta_rule_varlen(q[:b], k[:b], v[:b], g[:b], beta[:b], torch.arange(b + 1), pool, slots)

            pool.copy_(base)
            ref_o = chunked()
            ref_states = pool.clone()
            pool.copy_(base)
            loop_o = token_loop()
            if not (torch.allclose(ref_o, loop_o, atol=1e-4) and torch.allclose(ref_states, pool, atol=1e-4)):
                raise SystemExit("FAIL: the token-loop prototype disagrees with the chunked kernel")
            rows.append(dict(batch=b, fed=fed, chunked=med(chunked), loop=med(token_loop), decode=med(decode),
                             one_token_chunked=med(one_token_chunked)))
            print(f"[gated delta rule, 1 layer] batch {b}, {fed} tokens/seq + {fed - 1} states/seq: chunked "
                  f"{rows[-1]['chunked']:.2f} ms, token loop {rows[-1]['loop']:.2f} ms; 1 token/seq: chunked "
                  f"{rows[-1]['one_token_chunked']:.2f} ms, decode kernel {rows[-1]['decode']:.2f} ms", flush=True)
    return rows


# ------------------------------------------------------------------------------------------------
# report
# ------------------------------------------------------------------------------------------------
def profile_table(prof: dict[int, dict[str, dict[str, float]]], num_linear: int, num_attention: int) -> str:
    labels = ["n-gram drafter (propose)", "schedule", "forward", "gated delta rule", "causal conv1d",
              "attention (paged)", "linear layers + LM head", "rest of the forward", "verify(): acceptance, logprobs",
              "process"]
    names = {"schedule": "schedule (incl. drafter)", "forward": "**model forward**",
             "rest of the forward": "  other ops of the forward", "process": "process (verify + commit + output)",
             "gated delta rule": f"  gated delta rule ({num_linear} layers)",
             "causal conv1d": f"  causal conv1d ({num_linear} layers)", "attention (paged)": f"  attention ({num_attention} layers)", "linear layers + LM head": "  linear layers + LM head"}
    head = "| ms per step (median) | " + " | ".join(
        f"batch {b} {PROFILE_HEADS[s]}" for b in prof for s in PROFILE_SIDES) + " |"
    lines = [head, "|---|" + "---|" * (len(PROFILE_SIDES) * len(prof))]
    for key in labels:
        cells = []
        for b in prof:
            for s in PROFILE_SIDES:
                m = prof[b][s]
                if key == "rest of the forward":
                    val = m["forward"] - sum(m.get(x, 0.0) for x in
                                             ("gated delta rule", "causal conv1d", "attention (paged)", "linear layers + LM head"))
                else:
                    val = m.get(key, 0.0)
                cells.append(f"{val:.2f}" if key in m or key == "rest of the forward" else "–")
        lines.append(f"| {names.get(key, key)} | " + " | ".join(cells) + " |")
    cells = []
    for b in prof:
        for s in PROFILE_SIDES:
            m = prof[b][s]
            cells.append(f"{m['schedule'] + m['forward'] + m['process']:.2f}")
    lines.append("| **step total** | " + " | ".join(f"**{c}**" for c in cells) + " |")
    lines.append("| tokens fed per step (median) | " + " | ".join(
        f"{prof[b][s]['fed']:.0f}" for b in prof for s in PROFILE_SIDES) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--draft-tokens", type=int, default=4,
                    help="n-gram parts: speculative_num_draft_tokens (the last token + at most this - 1 drafts)")
    ap.add_argument("--no-profile", action="store_true", help="skip the per-step profile and the kernel micro-benchmark")
    ap.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    ap.add_argument("--part", choices=("all", "ngram", "mtp", "mtp-compiled", "draft", "draft-compiled", "compiled",
                                       "tree-compiled", "gpu", "mtp-gpu"),
                    default="all",
                    help="ngram: workload (a) and its profile; mtp: workload (b), the default model's MTP head; "
                         "mtp-compiled: that with compile_decode; "
                         "draft: workload (b) with separate draft models; draft-compiled: workload (b), the early-exit "
                         "draft, compile_decode; compiled: workload (a) with compile_decode; tree-compiled: "
                         "workload (a), n-gram trees with compile_decode; "
                         "gpu: workload (a) on CUDA, decode and verify steps from CUDA graphs (not in 'all'); "
                         "mtp-gpu: workload (b) on CUDA, the MTP head's drafts from CUDA graphs too (not in 'all')")
    ap.add_argument("--device", default="cuda", help="gpu: the device (cpu: a smoke test of the script)")
    ap.add_argument("--draft-model-path", default=None,
                    help="draft: one more draft model to measure (same vocabulary as the default model)")
    args = ap.parse_args()
    if args.draft_tokens < 2:
        raise SystemExit("--draft-tokens must be at least 2 (the last token + one draft)")
    for spec in (SPEC, FIXED):  # the n-gram parts' engines read these
        spec["speculative_num_draft_tokens"] = args.draft_tokens
    threads = torch.get_num_threads()
    torch.set_grad_enabled(False)
    if args.part in ("all", "mtp"):
        mtp_main(args, threads)
    if args.part in ("all", "mtp-compiled"):
        mtp_compiled_main(args, threads)
    if args.part in ("all", "draft"):
        draft_main(args, threads)
    if args.part in ("all", "draft-compiled"):
        draft_compiled_main(args, threads)
    if args.part in ("all", "ngram"):
        ngram_main(args, threads)
    if args.part in ("all", "compiled"):
        compiled_main(args, threads)
    if args.part in ("all", "tree-compiled"):
        tree_compiled_main(args, threads)
    if args.part == "gpu":
        gpu_main(args)
    if args.part == "mtp-gpu":
        mtp_gpu_main(args)


def drafts_suffix(args) -> str:
    """The n-gram sections' title suffix and command flag: none at the default 4 draft tokens."""
    return "" if args.draft_tokens == 4 else f", {args.draft_tokens} draft tokens"


def drafts_flag(args) -> str:
    return "" if args.draft_tokens == 4 else f" --draft-tokens {args.draft_tokens}"


CHAIN_STEPS = 50


def chain_costs(width: int) -> dict[int, tuple[float, float]]:
    """Batch size -> (ms of a compiled decode step, ms of a compiled verify step of chains padded to
    ``width``), thread CPU time at the model runner (``verify_step.Bench``, 256 cached tokens)."""
    from benchmarks.verify_step import Bench
    from hyla.engine.engine import DEFAULT_MODEL_DIR
    from hyla.model import load_model

    model = load_model(DEFAULT_MODEL_DIR, dtype="float32")
    graphs = lambda: torch._dynamo.utils.counters["stats"]["unique_graphs"]  # noqa: E731
    out = {}
    for b in (1, NUM_PROMPTS):
        start = graphs()
        bench = Bench(model, b, 256, width, compile_decode=True, verify_width=width)
        built = graphs() - start
        times: dict[str, list[float]] = {"decode": [], "chains": []}
        with torch.inference_mode():
            for i in range(5 + CHAIN_STEPS):
                for name, fn in (("decode", lambda: bench.step(1, False)), ("chains", lambda: bench.chains(2))):
                    t0 = time.thread_time()
                    fn()
                    if i >= 5:
                        times[name].append(time.thread_time() - t0)
        if built == 0 or graphs() != start + built or bench.runner.late_compiles:  # what was timed must be the
            raise RuntimeError(f"batch {b}: {built} graphs compiled at start-up, {graphs() - start - built} after, "
                               f"{bench.runner.late_compiles} steps fitted none and ran eager")  # warm-up's graphs
        out[b] = (1e3 * statistics.median(times["decode"]), 1e3 * statistics.median(times["chains"]))
    return out


def compiled_main(args, threads: int) -> None:
    """Workload (a) with ``compile_decode``: decode steps and (n-gram chains) verify steps through
    ``torch.compile``, against the compiled plain engine; the eager pair of the n-gram section in the
    same run, as the peer."""
    kw = dict(dtype="float32", device="cpu", **POOLS)
    engines = {"off": Engine(**kw, compile_decode=True), "on": Engine(**kw, **SPEC, compile_decode=True),
               "eager off": Engine(**kw), "eager on": Engine(**kw, **SPEC)}
    rows = warm_bench_shutdown(engines, args)
    width = SPEC["speculative_num_draft_tokens"]
    steps = chain_costs(width)
    costs = [f"  * batch {b}: decode {d:.2f} ms; chains of width {width} {c:.2f} ms ({c / d:.1f}x)" for b, (d, c) in steps.items()]
    c1, c8 = (steps[b][1] / steps[b][0] for b in (1, NUM_PROMPTS))
    cmd = (f"OMP_NUM_THREADS={threads} .venv/bin/python benchmarks/speculative.py --part compiled --repeats {args.repeats} "
           f"--new-tokens {args.new_tokens}{drafts_flag(args)}")
    table = ["| workload | batch | compiled off tok/s | compiled on tok/s | on / off (wall) | on / off (CPU time) "
             "| accept length | eager off, eager on: tok/s (CPU time vs compiled off) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        eo, en = r["sides"]["eager off"], r["sides"]["eager on"]
        table.append(f"| {r['workload']} | {r['batch']} | {r['off']:.1f} | {r['on']:.1f} | **{r['ratio']:.2f}x** "
                     f"| {r['cpu_ratio']:.2f}x | {r['accept']:.2f} | {eo['tps']:.1f} ({eo['cpu_ratio']:.2f}x), "
                     f"{en['tps']:.1f} ({en['cpu_ratio']:.2f}x) |")
    by = {(r["workload"], r["batch"]): r for r in rows}
    g1, g8 = by[("grounded", 1)], by[("grounded", NUM_PROMPTS)]
    body = f"""`{cmd}` — {machine()}, {threads} thread(s); built-in default model (tiny Qwen3-Next, 8 layers, fp32), greedy.

The n-gram section's workloads and speculation settings, every engine with `compile_decode=True`:
decode steps through `torch.compile`, and (new) verify steps too. With n-gram speculation the engine
gives the runner `verify_width` = `speculative_num_draft_tokens` ({SPEC['speculative_num_draft_tokens']}): a
verify step runs as padded chains (`ModelRunner.forward_chains`, `ForwardBatch.chain_ckpt_rows`: the
projections on the fed tokens, the recurrent ops and attention with every request padded to the width),
so its shapes depend on the batch size and the token count only and it runs graphs compiled at
start-up. Steps with no drafts run the compiled decode graph. (Before, verify steps ran the eager
extend path beside the compiled decode steps.) Runs of the four engines
interleaved, medians of {args.repeats}; every engine gave **identical greedy token ids** (checked by the script).
The last column is the eager pair of the n-gram section, measured in the same run, as tok/s (wall) and CPU-time ratio to compiled off.

{chr(10).join(table)}

* *grounded*: speculation with `compile_decode` {g1['cpu_ratio']:.2f}x the compiled plain engine at batch 1,
  {g8['cpu_ratio']:.2f}x at batch {NUM_PROMPTS} (CPU time).
* Where it goes: one step at the model runner (`benchmarks/verify_step.py`'s requests, 256 cached
  tokens each, thread CPU time, medians of {CHAIN_STEPS} steps), the compiled decode step vs the compiled
  verify step of padded chains (request 0 feeds 2 tokens, the others 1, all padded to the width):
{chr(10).join(costs)}
  The padded recurrent update runs `width` times over every request of the step, whatever its
  drafts, and the projections run a few more rows. Speculation gains where the accept length (output tokens per
  request and verify step) is above what a verify step costs in decode steps: at batch 1
  {g1['accept']:.2f} vs {c1:.1f}, at batch {NUM_PROMPTS} {g8['accept']:.2f} vs {c8:.1f} (and with adaptive drafting many steps
  have no drafts and run the decode graph).
"""
    print(body)
    if not args.no_write:
        write_section("Speculative decoding: n-gram with compile_decode" + drafts_suffix(args), body)


def tree_compiled_main(args, threads: int) -> None:
    """Workload (a) with n-gram trees and ``compile_decode``: verify steps as padded trees through the
    compiled graphs ("on") against the same engine verifying on the eager ops ("eager verify": its runner's
    ``verify_width`` taken away, as trees were verified before padded trees), the compiled n-gram chains
    and the compiled plain engine ("off")."""
    kw = dict(dtype="float32", device="cpu", compile_decode=True, **POOLS)
    trees = dict(SPEC, speculative_eagle_topk=2)
    engines = {"off": Engine(**kw), "on": Engine(**kw, **trees), "eager verify": Engine(**kw, **trees),
               "chains": Engine(**kw, **SPEC)}
    if not engines["on"].scheduler.runner.verify_trees:
        raise SystemExit("the tree engine's runner runs no padded trees (verify_trees)")
    engines["eager verify"].scheduler.runner.verify_width = None  # every verify step on the eager ops
    rows = warm_bench_shutdown(engines, args)
    cmd = (f"OMP_NUM_THREADS={threads} .venv/bin/python benchmarks/speculative.py --part tree-compiled "
           f"--repeats {args.repeats} --new-tokens {args.new_tokens}{drafts_flag(args)}")
    table = ["| workload | batch | compiled off tok/s | trees, padded: tok/s (CPU time vs off) | trees, eager verify "
             "| chains, compiled | accept length: trees / chains | tokens fed: trees / chains |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        on, ev, ch = (r["sides"][k] for k in ("on", "eager verify", "chains"))
        table.append(f"| {r['workload']} | {r['batch']} | {r['off']:.1f} | **{on['tps']:.1f}** ({on['cpu_ratio']:.2f}x) "
                     f"| {ev['tps']:.1f} ({ev['cpu_ratio']:.2f}x) | {ch['tps']:.1f} ({ch['cpu_ratio']:.2f}x) "
                     f"| {on['accept']:.2f} / {ch['accept']:.2f} | {on['fed']:.2f} / {ch['fed']:.2f} |")
    gain = [r["sides"]["on"]["tps"] / r["sides"]["eager verify"]["tps"] for r in rows]
    body = f"""`{cmd}` — {machine()}, {threads} thread(s); built-in default model (tiny Qwen3-Next, 8 layers, fp32), greedy.

The n-gram section's workloads, every engine with `compile_decode=True`. *Trees*: n-gram drafts with
`speculative_eagle_topk=2` (the continuations of the two most recent matches merged into a trie), at most
{SPEC['speculative_num_draft_tokens']} tokens fed per request and step; verified as **padded trees** through
the compiled graphs (`verify_trees`: `ModelRunner.forward_chains` with `tree_parents`), or on the eager ops
(the same engine with its runner's `verify_width` taken away: how trees were verified before 2026-12-04).
*Chains*: the same drafter with `speculative_eagle_topk=1`, verified as padded chains. Runs of the four
engines interleaved, medians of {args.repeats}; every engine gave **identical greedy token ids** (checked by
the script). In parentheses: CPU time of the plain compiled engine / the engine's.

{chr(10).join(table)}

* Padded trees against the same trees verified on the eager ops: {min(gain):.2f}-{max(gain):.2f}x the tokens/s.
* Where trees trail chains, it is the drafts (this drafter's trees split the step's budget between two
  continuations: the accept length above) and the verify step (padded trees gather each column's state
  from the states after the columns before it, and a tree runner runs chains as trees too).
"""
    print(body)
    if not args.no_write:
        write_section("Speculative decoding: n-gram trees with compile_decode" + drafts_suffix(args), body)


def gpu_engines(args, part: str, spec: dict, tree: dict | None = None) -> dict[str, Engine]:
    """A GPU part's engines on ``args.device``, fp32: the plain one ("off"), the speculative one
    ("on") and, given ``tree``, one with those options ("tree")."""
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit(f"--part {part} needs a CUDA device (--device cpu: a smoke test of the script)")
    kw = dict(dtype="float32", device=args.device, **POOLS)
    return {"off": Engine(**kw), "on": Engine(**kw, **spec), **({"tree": Engine(**kw, **tree)} if tree else {})}


def gpu_main(args) -> None:
    """Workload (a) on CUDA: the default model (fp32) with and without n-gram speculation, decode
    and verify steps replayed from CUDA graphs."""
    engines = gpu_engines(args, "gpu", SPEC)
    modes = {side: e._decode_mode() for side, e in engines.items()}
    rows = warm_bench_shutdown(engines, args)
    cmd = (f".venv/bin/python benchmarks/speculative.py --part gpu --device {args.device} --repeats {args.repeats} "
           f"--new-tokens {args.new_tokens}{drafts_flag(args)}")
    table = ["| workload | batch | off tok/s | on tok/s | on / off | accept length | tokens fed per verify step "
             "| verify steps |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        table.append(f"| {r['workload']} | {r['batch']} | {r['off']:.1f} | {r['on']:.1f} | **{r['ratio']:.2f}x** "
                     f"| {r['accept']:.2f} | {r['fed']:.2f} | {r['steps']} |")
    body = f"""`{cmd}` — {machine()}; built-in default model (tiny Qwen3-Next, 8 layers, fp32), greedy; workload (a)
(the *Speculative decoding* section above: {NUM_PROMPTS} prompts, {args.new_tokens} new tokens each, prompts cached by a
warm-up run), n-gram drafts ({SPEC['speculative_num_draft_tokens']} tokens fed per verify step at most). Decode: {modes['off']};
speculative engine: {modes['on']}. Runs interleaved, medians of {args.repeats}; speculation on and off gave
identical greedy token ids (checked by the script).

{chr(10).join(table)}
"""
    print(body, flush=True)
    if not args.no_write:
        write_section("Speculative decoding: GPU" + drafts_suffix(args), body)


def mtp_gpu_main(args) -> None:
    """Workload (b) on CUDA: the default model (fp32) with and without its MTP head, every step
    replayed from CUDA graphs (the head's drafts and verify passes too)."""
    engines = gpu_engines(args, "mtp-gpu", MTP_SPEC, MTP_TREE)
    try:
        modes = {side: e._decode_mode() for side, e in engines.items()}
        drafter = engines["on"].scheduler.drafter
        head = "replayed from CUDA graphs" if drafter.graphs is not None else \
            "through the fused kernels, launched eagerly" if drafter.fused else "through the PyTorch ops"
        prompts = chat_prompts(engines["off"].tokenizer)
        params = {"temperature": 0, "max_new_tokens": args.new_tokens, "ignore_eos": True}
        outs = {side: run_once(e, prompts, NUM_PROMPTS, params)[2] for side, e in engines.items()}  # warm-up
        check_identical("mtp-gpu, warm-up", outs["off"], outs["on"])
        check_identical("mtp-gpu trees, warm-up", outs["off"], outs["tree"])
        rows = bench(engines, prompts, prompts, "mtp-gpu", args.repeats, args.new_tokens)
    finally:
        for e in engines.values():
            e.shutdown()
    cmd = (f".venv/bin/python benchmarks/speculative.py --part mtp-gpu --device {args.device} --repeats {args.repeats} "
           f"--new-tokens {args.new_tokens}")
    table = ["| batch | drafts | off tok/s | on tok/s | on / off | accept length | tokens fed per request and step | "
             "verify steps |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        for side, label in (("on", f"chain of {MTP_STEPS}"), ("tree", TREE_LABEL)):
            t = r["sides"][side]
            table.append(f"| {r['batch']} | {label} | {r['off']:.1f} | {t['tps']:.1f} | **{t['ratio']:.2f}x** | "
                         f"{t['accept']:.2f} | {t['fed']:.2f} | {t['steps']} |")
    body = f"""`{cmd}` — {machine()}; built-in default model (tiny Qwen3-Next, 8 layers, fp32) with its MTP head
(`scripts/train_mtp_head.py`), greedy; workload (b) (the *Speculative decoding: MTP* section: {NUM_PROMPTS} chat prompts,
{args.new_tokens} new tokens each, prompts cached by a warm-up run), `speculative_num_steps={MTP_STEPS}`. Decode: {modes['off']};
MTP engine: {modes['on']}, the head's drafts and verify passes {head}; MTP trees
(`speculative_eagle_topk=2`, `speculative_num_draft_tokens={DRAFT_TREE['speculative_num_draft_tokens']}`): {modes['tree']}, their
verify steps the eager extend and the beams the head's eager rows.
Runs interleaved, medians of {args.repeats}; MTP (chains and trees) and plain decoding gave identical greedy token ids
(checked by the script).

{chr(10).join(table)}
"""
    print(body, flush=True)
    if not args.no_write:
        write_section("Speculative decoding: MTP on a GPU", body)


def draft_compiled_main(args, threads: int) -> None:
    """Workload (b) with the early-exit draft model and ``compile_decode`` (:func:`compiled_spec_main`)."""
    import tempfile

    early = early_exit_draft(Path(tempfile.mkdtemp(prefix="hyla-draft-")) / "early-exit")
    spec = dict(speculative_algorithm="draft", speculative_draft_model_path=str(early), speculative_num_steps=DRAFT_STEPS)
    about = f"""drafted by its first {EARLY_EXIT_LAYERS} layers (the early-exit draft of the section above: its
final norm and LM head, no training), {DRAFT_STEPS} drafts per step (chains), on the chat workload; greedy.

Draft-model chains verify as padded chains (`ModelRunner.forward_chains`), with `compile_decode`
through the graph compiled at start-up. The draft model now runs as the model does: its draft steps
(decode steps on the requests' own rows, their scratch KV slots after the committed ones:
`ModelRunner.forward_decode_rows`) and decode steps through its own runner's compiled graphs, its
pass over a verify step's chains as padded chains through them too (on a GPU: its fused kernels and
CUDA graphs). *on, eager draft* is the same engine with the draft model's runner eager
(`_compiled_decode` and `verify_width` unset), as every draft model ran before."""

    def eager_draft(engine: Engine) -> None:
        runner = engine.scheduler.drafter.runner
        runner._compiled_decode, runner.verify_width = None, None

    compiled_spec_main(args, threads, "draft-compiled", spec, "draft", "draft model", about,
                       "Speculative decoding: draft model with compile_decode", ("eager draft", eager_draft))


def mtp_compiled_main(args, threads: int) -> None:
    """Workload (b) with the default model's MTP head and ``compile_decode`` (:func:`compiled_spec_main`)."""
    about = f"""its MTP head (`scripts/train_mtp_head.py`), {MTP_STEPS} drafts per step, on the chat workload; greedy.

MTP's decode and verify steps now run the graphs compiled at start-up (on a GPU: the fused kernels and
their CUDA graphs), which return the final hidden states the MTP head reads (`ModelRunner(return_hidden=True)`);
its verify steps as padded chains (`ModelRunner.forward_chains`). Before, `compile_decode` with MTP
compiled nothing. *on, eager verify* is the same engine with its verify steps through the eager
extend path (`runner.verify_width = None`). The MTP head's forwards over a verify step's pairs and
its draft steps run graphs compiled at start-up too, in both (`MtpDrafter.compile`: the head up to its
LM head, as decode batches of a row per pair)."""
    compiled_spec_main(args, threads, "mtp-compiled", MTP_SPEC, "MTP", "MTP head", about,
                       "Speculative decoding: MTP with compile_decode", ("eager verify", eager_verify))


def eager_verify(engine: Engine) -> None:
    """The model's verify steps through the eager extend path instead of the compiled chains."""
    engine.scheduler.runner.verify_width = None


def compiled_spec_main(args, threads: int, part: str, spec: dict, drafter_name: str, drafter_label: str, about: str,
                       section: str, peer: tuple[str, Callable[[Engine], None]]) -> None:
    """Workload (b), every engine with ``compile_decode``, speculation ``spec`` (chains): its verify
    steps as padded chains through the compiled graph ("on"), against the same engine with a part
    made eager by ``peer = (what, make_eager)`` ("on, <what>"), and the compiled plain engine
    ("off")."""
    kw = dict(dtype="float32", device="cpu", **POOLS, compile_decode=True)
    what, make_eager = peer
    side_b = f"on, {what}"
    t0 = time.perf_counter()
    engines = {"off": Engine(**kw), "on": Engine(**kw, **spec), side_b: Engine(**kw, **spec)}
    start_up = time.perf_counter() - t0
    make_eager(engines[side_b])
    parts: dict[str, dict[int, dict[str, float]]] = {}
    try:
        prompts = chat_prompts(engines["off"].tokenizer)
        params = {"temperature": 0, "max_new_tokens": args.new_tokens, "ignore_eos": True}
        base = run_once(engines["off"], prompts, NUM_PROMPTS, params)[2]  # warm-up: caches the prompts
        for side in ("on", side_b):
            check_identical(f"{part} ({side}), warm-up", base, run_once(engines[side], prompts, NUM_PROMPTS, params)[2])
        rows = bench(engines, prompts, prompts, part, args.repeats, args.new_tokens)
        for side, eng in engines.items():
            parts[side] = {}
            for batch in (1, NUM_PROMPTS):
                parts[side][batch] = ms_per_step(eng, prompts, batch, params, drafter_name)
        late = {side: e.scheduler.runner.late_compiles + getattr(e.scheduler.drafter, "late_compiles", 0)
                for side, e in engines.items()}
    finally:
        for e in engines.values():
            e.shutdown()
    cmd = (f"OMP_NUM_THREADS={threads} .venv/bin/python benchmarks/speculative.py --part {part} "
           f"--repeats {args.repeats} --new-tokens {args.new_tokens}")
    table = [f"| batch | compiled off tok/s | on tok/s | on / off (wall) | on / off (CPU time) | {side_b} tok/s "
             f"| {what} / off (CPU time) | on / {what} (CPU time) | accept length (on, {what}) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        on, ev = r["sides"]["on"], r["sides"][side_b]
        table.append(f"| {r['batch']} | {r['off']:.1f} | {on['tps']:.1f} | {on['ratio']:.2f}x | {on['cpu_ratio']:.2f}x "
                     f"| {ev['tps']:.1f} | {ev['cpu_ratio']:.2f}x | **{on['cpu_ratio'] / ev['cpu_ratio']:.2f}x** "
                     f"| {on['accept']:.2f}, {ev['accept']:.2f} |")
    split = ["| ms per step | " + " | ".join(f"batch {b}" for b in (1, NUM_PROMPTS)) + " |", "|---|---|---|"]
    steps = spec["speculative_num_steps"]
    for side in engines:
        keys = (("step", "step"),) if side == "off" else (
            ("step", "verify step"), ("model forward", "model forward over the fed tokens"),
            (f"{drafter_name} observe", f"{drafter_label} over the fed tokens"),
            (f"{drafter_name} drafting", f"{drafter_label}, {steps} draft steps"))
        for key, label in keys:
            split.append(f"| {side}: {label} | " + " | ".join(f"{parts[side][b].get(key, 0.0):.2f}"
                                                             for b in (1, NUM_PROMPTS)) + " |")
    body = f"""`{cmd}` — {machine()}, {threads} thread(s); built-in default model (tiny Qwen3-Next, 8 layers, fp32) with
compile_decode, {about} Runs of the three engines interleaved, medians of
{args.repeats}; every engine gave **identical greedy token ids** (checked by the script). Start-up of the
three engines, each compiling its graphs: {start_up:.0f} s; steps that ran eager for want of a graph
(`late_compiles`): {late}.

{chr(10).join(table)}

Where a step's time goes (thread CPU time per step, one more run of each engine after the timed ones):

{chr(10).join(split)}
"""
    print(body)
    if not args.no_write:
        write_section(section, body)


def mtp_timers(engine: Engine, drafter_name: str = "MTP") -> dict[str, float]:
    """Wrap the model forward and the drafter's two calls of ``engine`` with timers (thread CPU
    time with one thread, else wall): seconds so far, by part ("<drafter_name> observe", ...)."""
    clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    acc: dict[str, float] = collections.defaultdict(float)
    s, drafter = engine.scheduler, engine.scheduler.drafter

    def wrap(owner: Any, name: str, label: str) -> None:
        orig = getattr(owner, name)

        def timed(*a, **k):
            t0 = clock()
            try:
                return orig(*a, **k)
            finally:
                acc[label] += clock() - t0
        setattr(owner, name, timed)

    for owner, name, label in ((s.runner, "forward_extend", "model forward"), (s.runner, "forward_decode", "model forward"),
                               (s.runner, "forward_chains", "model forward"),
                               (drafter, "observe", f"{drafter_name} observe"),
                               (drafter, "propose_batch", f"{drafter_name} drafting"),
                               (drafter, "propose_tree_batch", f"{drafter_name} drafting"),
                               (s, "step", "step")):
        if owner is not None:
            wrap(owner, name, label)
    return acc


def ms_per_step(engine: Engine, prompts: list[list[int]], batch: int, params: dict,
                drafter_name: str = "MTP") -> dict[str, float]:
    """One more run of ``engine`` on ``prompts``, ``batch`` at a time, timed by part
    (:func:`mtp_timers`): ms per scheduler step of each part."""
    timers = mtp_timers(engine, drafter_name)
    steps0 = engine.scheduler.num_steps
    try:
        run_once(engine, prompts, batch, params)
    finally:
        unwrap(engine)
    n = max(1, engine.scheduler.num_steps - steps0)
    return {k: 1e3 * v / n for k, v in timers.items()}


def unwrap(engine: Engine) -> None:
    """Undo ``mtp_timers``: back to the class's methods."""
    s = engine.scheduler
    for owner in (s.runner, s.drafter, s):
        for name in ("forward_extend", "forward_decode", "forward_chains", "observe", "propose_batch",
                     "propose_tree_batch", "step"):
            if owner is not None:
                owner.__dict__.pop(name, None)


def mtp_main(args, threads: int) -> None:
    """Workload (b): the default model with its MTP head, spec on vs off, batch 1 and 8."""
    engines = {"off": Engine(dtype="float32", device="cpu", **POOLS),
               "on": Engine(dtype="float32", device="cpu", **POOLS, **MTP_SPEC),
               "tree": Engine(dtype="float32", device="cpu", **POOLS, **MTP_TREE)}
    try:
        prompts = chat_prompts(engines["off"].tokenizer)
        params = {"temperature": 0, "max_new_tokens": args.new_tokens, "ignore_eos": True}
        outs = {side: run_once(e, prompts, NUM_PROMPTS, params)[2] for side, e in engines.items()}  # warm-up
        check_identical("mtp, warm-up", outs["off"], outs["on"])
        check_identical("mtp trees, warm-up", outs["off"], outs["tree"])
        rows = bench(engines, prompts, prompts, "mtp", args.repeats, args.new_tokens)
        parts: dict[str, dict[int, dict[str, float]]] = {side: {} for side in engines}
        for batch in (1, NUM_PROMPTS):  # where a step's time goes (one more run per side and batch size)
            for side, engine in engines.items():
                parts[side][batch] = ms_per_step(engine, prompts, batch, params)
                print(f"[mtp] {side}, batch {batch}: ms per step: "
                      + ", ".join(f"{k} {v:.2f}" for k, v in parts[side][batch].items()), flush=True)
    finally:
        for e in engines.values():
            e.shutdown()
    by = {r["batch"]: r for r in rows}
    cmd = (f"OMP_NUM_THREADS={threads} .venv/bin/python benchmarks/speculative.py --part mtp --repeats {args.repeats} "
           f"--new-tokens {args.new_tokens}")
    table = ["| batch | drafts | off tok/s | on tok/s | on / off (wall) | on / off (CPU time) | accept length | "
             "verify steps | tokens fed per request and step |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        for side, label in (("on", f"chain of {MTP_STEPS}"), ("tree", TREE_LABEL)):
            t = r["sides"][side]
            table.append(f"| {r['batch']} | {label} | {r['off']:.1f} | {t['tps']:.1f} | **{t['ratio']:.2f}x** | "
                         f"{t['cpu_ratio']:.2f}x | **{t['accept']:.2f}** | {t['steps']} | {t['fed']:.2f} |")
    split = [f"| ms per step | batch 1 decode | batch 1 verify | batch 1 verify, tree | batch {NUM_PROMPTS} decode | "
             f"batch {NUM_PROMPTS} verify | batch {NUM_PROMPTS} verify, tree |", "|---|---|---|---|---|---|---|"]
    for key in ("step", "model forward", "MTP observe", "MTP drafting"):
        cells = [parts[side][b].get(key) for b in (1, NUM_PROMPTS) for side in ("off", "on", "tree")]
        split.append(f"| {key} | " + " | ".join("–" if c is None else f"{c:.2f}" for c in cells) + " |")
    decode_ms = parts["off"][1]["step"]
    on1, tr1, tree1 = parts["on"][1], parts["tree"][1], by[1]["sides"]["tree"]
    plen = (min(map(len, prompts)), max(map(len, prompts)))
    body = f"""`{cmd}` — {machine()}, {threads} thread(s); built-in default model (tiny Qwen3-Next, 8 layers, fp32) with
its MTP head (`scripts/train_mtp_head.py`), greedy.

Workload (b): {NUM_PROMPTS} chat prompts (the first user message of ShareGPT conversations in the chat template,
{plen[0]}–{plen[1]} tokens), {args.new_tokens} new tokens each (`ignore_eos`); batch 1 = one after the other, batch
{NUM_PROMPTS} = all at once. Speculation: `speculative_algorithm="mtp"`, `speculative_num_steps={MTP_STEPS}` (3 greedy
MTP drafts per verify step), and the same with trees. Prefix cache on, prompts cached by a warm-up run; runs of
the three engines interleaved, medians of {args.repeats}; the CPU-time column is the same ratio in process CPU time (this shared
2-core machine is noisy: trust it where the two disagree). Speculation on (both) and off gave **identical greedy
token ids** in every run (checked by the script).

{chr(10).join(table)}

Accept length (output tokens per verify step) **{by[1]['accept']:.2f}** at batch 1 and **{by[NUM_PROMPTS]['accept']:.2f}** at batch
{NUM_PROMPTS} with chains, **{by[1]['sides']['tree']['accept']:.2f}** and **{by[NUM_PROMPTS]['sides']['tree']['accept']:.2f}** with
trees (`speculative_eagle_topk=2`, `speculative_num_draft_tokens={DRAFT_TREE['speculative_num_draft_tokens']}`: a beam
search of width 2 and depth {MTP_STEPS} over the head, its greedy chain and the best other candidates up to
{DRAFT_TREE['speculative_num_draft_tokens'] - 1} nodes verified), vs {SGLANG_ACCEPT} — a 0.8M-parameter head trained for minutes on CPU in front of a 7.4M-parameter
model, against Qwen's own heads on an 80B model. Where a verify step's time goes (one more run per batch
size and side, wrapped in-process, {"thread CPU time" if threads == 1 else "wall time"}; mean ms per step over the run, the few prefill
steps of the cached prompts included):

{chr(10).join(split)}

* **{"Speculation is slower than plain decoding here" if by[1]['cpu_ratio'] < 1 else "Speculation pays at batch 1"}.** At batch 1 a plain decode step takes
  {decode_ms:.2f} ms; a verify step {on1['step']:.2f} ms: the model forward over the last token
  and {MTP_STEPS} drafts {on1['model forward']:.2f} ms ({on1['model forward'] / decode_ms:.1f}x a decode step), the MTP
  {on1['MTP observe'] + on1['MTP drafting']:.2f} ms (its KV over the fed tokens {on1['MTP observe']:.2f}, {MTP_STEPS} draft steps
  {on1['MTP drafting']:.2f}). Break-even is an accept length of {on1['step'] / decode_ms:.1f} ({on1['model forward'] / decode_ms:.1f} with a
  free drafter): on this CPU the verify forward of the tiny model costs {on1['model forward'] / decode_ms:.1f} decode steps (costs
  that grow with the tokens fed: "Speculative verify step" below), so {"even a free drafter at this accept length would not gain"
  if on1['model forward'] / decode_ms >= by[1]['accept'] else f"a free drafter at this accept length would gain {by[1]['accept'] * decode_ms / on1['model forward']:.2f}x; the MTP's own forwards cost {(on1['MTP observe'] + on1['MTP drafting']) / decode_ms:.1f} decode steps per verify step"}.
  Speculation pays where a verify step costs about one decode step
  (large models on GPUs, where SGLang's accept lengths were measured); not measured here (no GPU).
* **Trees** accept {tree1['accept'] / by[1]['accept']:.2f}x as many tokens per verify step as chains for
  {tree1['fed'] / by[1]['fed']:.2f}x the tokens fed: at batch 1 their verify step costs {tr1['step']:.2f} ms (model forward
  {tr1['model forward']:.2f}, the MTP {tr1['MTP observe'] + tr1['MTP drafting']:.2f}: its beams are rows of their own, the head's
  eager ops), {tr1['step'] / on1['step']:.2f}x a chain's. On this CPU, where every fed token costs, that loses
  ({tree1['ratio']:.2f}x plain decoding against the chains' {by[1]['ratio']:.2f}x); trees are for GPUs, where a verify
  step of {DRAFT_TREE['speculative_num_draft_tokens']} tokens costs about what one of {MTP_STEPS + 1} does.
"""
    print(body)
    if not args.no_write:
        write_section("Speculative decoding: MTP", body)


def early_exit_draft(out_dir: Path, num_layers: int = EARLY_EXIT_LAYERS) -> Path:
    """A draft model made of the default model's first ``num_layers`` layers, its embedding, final
    norm and LM head (no training; the MTP head dropped): what the model predicts when it exits
    early. Written to ``out_dir`` (bf16 tensors as in the checkpoint)."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from hyla.engine.engine import DEFAULT_MODEL_DIR

    shutil.rmtree(out_dir, ignore_errors=True)
    shutil.copytree(DEFAULT_MODEL_DIR, out_dir)
    cfg = json.loads((out_dir / "config.json").read_text())
    cfg["layer_types"], cfg["num_hidden_layers"] = cfg["layer_types"][:num_layers], num_layers
    cfg.pop("mtp_num_hidden_layers", None)
    tensors = {}
    for name, t in load_file(out_dir / "model.safetensors").items():
        layer = int(name.split(".")[2]) if name.startswith("model.layers.") else -1
        if not name.startswith("mtp.") and layer < num_layers:
            tensors[name] = t
    save_file(tensors, out_dir / "model.safetensors", metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2))
    return out_dir


def draft_main(args, threads: int) -> None:
    """Workload (b) with separate draft models: spec on vs off, batch 1 and 8, per draft model."""
    import tempfile

    from hyla.engine.engine import DEFAULT_MODEL_DIR

    tmp = Path(tempfile.mkdtemp(prefix="hyla-draft-"))
    early = early_exit_draft(tmp / "early-exit")
    chain = dict(speculative_num_steps=DRAFT_STEPS)
    drafts = {  # name -> (draft model, speculative options)
        "the model itself": (DEFAULT_MODEL_DIR, chain),
        f"its first {EARLY_EXIT_LAYERS} layers (early exit)": (early, chain),
        f"its first {EARLY_EXIT_LAYERS} layers, trees": (early, dict(chain, **DRAFT_TREE)),
    }
    if args.draft_model_path:
        drafts[f"`{args.draft_model_path}`"] = (Path(args.draft_model_path), chain)
    off = Engine(dtype="float32", device="cpu", **POOLS)
    rows, parts, sizes = [], {}, {}
    try:
        prompts = chat_prompts(off.tokenizer)
        params = {"temperature": 0, "max_new_tokens": args.new_tokens, "ignore_eos": True}
        base = run_once(off, prompts, NUM_PROMPTS, params)[2]  # warm-up: caches the prompts
        parts["off"] = {}
        for batch in (1, NUM_PROMPTS):
            parts["off"][batch] = ms_per_step(off, prompts, batch, params)
        for name, (path, opts) in drafts.items():
            spec = dict(speculative_algorithm="draft", speculative_draft_model_path=str(path), **opts)
            with Engine(dtype="float32", device="cpu", **POOLS, **spec) as on:
                sizes[name] = sum(p.numel() for p in on.scheduler.drafter.model.parameters())
                check_identical(f"draft ({name}), warm-up", base, run_once(on, prompts, NUM_PROMPTS, params)[2])
                for r in bench({"off": off, "on": on}, prompts, prompts, f"draft: {name}", args.repeats, args.new_tokens):
                    rows.append(dict(r, draft=name))
                parts[name] = {}
                for batch in (1, NUM_PROMPTS):
                    parts[name][batch] = ms_per_step(on, prompts, batch, params, "draft")
                    print(f"[draft: {name}] batch {batch}: ms per step: "
                          + ", ".join(f"{k} {v:.2f}" for k, v in parts[name][batch].items()), flush=True)
    finally:
        off.shutdown()
    model_size = sum(p.numel() for p in off.model.parameters())
    cmd = (f"OMP_NUM_THREADS={threads} .venv/bin/python benchmarks/speculative.py --part draft --repeats {args.repeats} "
           f"--new-tokens {args.new_tokens}" + (f" --draft-model-path {args.draft_model_path}" if args.draft_model_path else ""))
    table = ["| draft model | parameters | batch | off tok/s | on tok/s | on / off (wall) | on / off (CPU time) "
             "| accept length | verify steps |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        table.append(f"| {r['draft']} | {sizes[r['draft']] / 1e6:.1f}M | {r['batch']} | {r['off']:.1f} | {r['on']:.1f} "
                     f"| **{r['ratio']:.2f}x** | {r['cpu_ratio']:.2f}x | **{r['accept']:.2f}** | {r['steps']} |")
    split = ["| ms per step | " + " | ".join(f"batch {b}" for b in (1, NUM_PROMPTS)) + " |", "|---|---|---|"]
    split.append("| plain decode step (off) | " + " | ".join(f"{parts['off'][b]['step']:.2f}" for b in (1, NUM_PROMPTS)) + " |")
    for name in drafts:
        for key, label in (("step", "verify step"), ("model forward", "model forward over the fed tokens"),
                           ("draft observe", "draft model over the fed tokens"),
                           ("draft drafting", f"draft model, {DRAFT_STEPS} draft steps (all beams)")):
            split.append(f"| {name}: {label} | " + " | ".join(f"{parts[name][b].get(key, 0.0):.2f}"
                                                               for b in (1, NUM_PROMPTS)) + " |")
    by = {(r["draft"], r["batch"]): r for r in rows}
    decode1 = parts["off"][1]["step"]
    notes = []
    for name in drafts:
        p1, r1, r8 = parts[name][1], by[(name, 1)], by[(name, NUM_PROMPTS)]
        notes.append(f"* **{name}**: accept length {r1['accept']:.2f} / {r8['accept']:.2f} (batch 1 / {NUM_PROMPTS}), "
                     f"{r1['cpu_ratio']:.2f}x / {r8['cpu_ratio']:.2f}x the tokens/s of plain decoding (CPU time). "
                     f"A verify step costs {p1['step'] / decode1:.1f} plain decode steps at batch 1: the model's "
                     f"forward over the fed tokens {p1.get('model forward', 0.0) / decode1:.1f}, the draft model "
                     f"{(p1.get('draft observe', 0.0) + p1.get('draft drafting', 0.0)) / decode1:.1f} (its {DRAFT_STEPS} draft "
                     f"steps {p1.get('draft drafting', 0.0) / decode1:.1f}, its forward over the fed tokens "
                     f"{p1.get('draft observe', 0.0) / decode1:.1f}); break-even accept length "
                     f"{p1['step'] / decode1:.1f}.")
    plen = (min(map(len, prompts)), max(map(len, prompts)))
    body = f"""`{cmd}` — {machine()}, {threads} thread(s); built-in default model (tiny Qwen3-Next, 8 layers,
{model_size / 1e6:.1f}M parameters, fp32) as the target, greedy.

Workload (b) of the MTP section: {NUM_PROMPTS} chat prompts ({plen[0]}–{plen[1]} tokens), {args.new_tokens} new tokens
each (`ignore_eos`); batch 1 = one after the other, batch {NUM_PROMPTS} = all at once. Speculation:
`speculative_algorithm="draft"`, `speculative_num_steps={DRAFT_STEPS}` ({DRAFT_STEPS} greedy drafts of the draft model per
verify step; *trees*: `speculative_eagle_topk={DRAFT_TREE['speculative_eagle_topk']}`,
`speculative_num_draft_tokens={DRAFT_TREE['speculative_num_draft_tokens']}`, a beam search of width {DRAFT_TREE['speculative_eagle_topk']} and depth {DRAFT_STEPS}
whose best {DRAFT_TREE['speculative_num_draft_tokens'] - 1} candidates, the greedy chain among them, are verified as a tree). Draft models:
*the model itself* (every draft is the model's own greedy token, so the accept length is the ceiling,
{DRAFT_STEPS + 1}, and the draft costs a whole second model) and *its first {EARLY_EXIT_LAYERS} layers* (3 Gated DeltaNet + 1
attention, with the model's embedding, final norm and LM head: an early-exit draft built by the script,
no training). Prefix cache on, prompts cached by a warm-up run;
runs interleaved with the plain engine, medians of {args.repeats}; the CPU-time column is the same ratio in
process CPU time (this shared 2-core machine is noisy: trust it where the two disagree). Speculation on
and off gave **identical greedy token ids** in every run (checked by the script).

{chr(10).join(table)}

Where a step's time goes (one more run per draft and batch size, wrapped in-process, {"thread CPU time" if threads == 1 else "wall time"};
mean ms per step over the run, the few prefill steps of the cached prompts included):

{chr(10).join(split)}

{chr(10).join(notes)}
* On this CPU a verify forward of the tiny model over 4 tokens costs more than 2 decode steps (see the
  MTP and n-gram sections), so a drafter must reach an accept length above that before anything
  else; the draft model adds its own {DRAFT_STEPS} decode steps and a forward over the fed tokens. Draft-model
  speculation pays where a verify step costs about one decode step and the draft is a small fraction
  of the model (large models on GPUs); not measured here (no GPU).
"""
    print(body)
    if not args.no_write:
        write_section("Speculative decoding: draft model", body)


def ngram_main(args, threads: int) -> None:
    """Workload (a), n-gram drafts, with its profile and kernel micro-benchmark."""
    engines = {"off": Engine(dtype="float32", device="cpu", **POOLS),
               "on": Engine(dtype="float32", device="cpu", **POOLS, **SPEC),
               "fixed": Engine(dtype="float32", device="cpu", **POOLS, **FIXED)}
    try:
        loads = workloads(engines["off"].tokenizer)
        cfg = engines["off"].model_config
        slot_bytes = engines["off"].state_pool.bytes_per_slot
        probe = probe_copying(engines["off"], sharegpt_passages(1)[0])
        rows = warm_and_bench(engines, loads, args)
    finally:
        for e in engines.values():
            e.shutdown()

    prof = micro = None
    if not args.no_profile:
        prof, by_fed = profile(loads["grounded"][0], args.new_tokens)
        print(f"[profile] batch 1 step time by tokens fed: {by_fed}", flush=True)
        for b in prof:
            for s in PROFILE_SIDES:
                m = prof[b][s]
                print(f"[profile] batch {b} {PROFILE_HEADS[s]}: "
                      + ", ".join(f"{k} {v:.2f}" for k, v in sorted(m.items())), flush=True)
        micro = gdn_micro(cfg)

    plen = {name: (min(map(len, p)), max(map(len, p))) for name, (p, _) in loads.items()}
    cmd = (f"OMP_NUM_THREADS={threads} .venv/bin/python benchmarks/speculative.py --part ngram --repeats {args.repeats} "
           f"--new-tokens {args.new_tokens}{drafts_flag(args)}")
    table = ["| workload | batch | off tok/s | on tok/s | on / off (wall) | on / off (CPU time) | accept length "
             "| tokens fed per verify step | verify steps | fixed: on / off (wall, CPU time) | fixed: accept length, "
             "tokens fed | output tokens from the prompt / repeating itself |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        f = r["sides"]["fixed"]
        table.append(f"| {r['workload']} | {r['batch']} | {r['off']:.1f} | {r['on']:.1f} | **{r['ratio']:.2f}x** "
                     f"| {r['cpu_ratio']:.2f}x | {r['accept']:.2f} | {r['fed']:.2f} | {r['steps']} "
                     f"| {f['ratio']:.2f}x, {f['cpu_ratio']:.2f}x | {f['accept']:.2f}, {f['fed']:.2f} "
                     f"| {r['from_prompt']:.0%} / {r['from_self']:.0%} |")
    by = {(r["workload"], r["batch"]): r for r in rows}
    g1, g8 = by[("grounded", 1)], by[("grounded", NUM_PROMPTS)]
    r1, r8 = by[("repetitive", 1)], by[("repetitive", NUM_PROMPTS)]
    met1 = g1["ratio"] >= 2.0 and g1["cpu_ratio"] >= 2.0
    met8 = g8["ratio"] >= 1.3 and g8["cpu_ratio"] >= 1.3
    best_probe = max(share for _, share in probe)
    probe_list = "; ".join(f"{name} {share:.0%}" for name, share in probe)
    top = ""
    if "top_match" in g1:
        text, count, total = g1["top_match"]
        top = f" ({'all' if count == total else f'{count} of'} {total} matches are the 4-gram {text!r})"
    if best_probe < 0.2:
        copy_bullet = f"""* **The default model does not copy from its prompt.** Its greedy output on *grounded* shares
  {g1['from_prompt']:.0%} of its 4-grams with the passage it was asked to repeat{top}, and no prompt form that
  invites copying makes it copy (share of output 4-grams found in the text to copy, 64 greedy tokens: {probe_list}).
  A model trained on 1.5M tokens has no working induction. What the drafter hits is the model's
  own greedy loops ({g1['from_self']:.0%} of the output's 4-grams repeat earlier output), hence accept lengths
  of {g1['accept']:.2f} / {g8['accept']:.2f} on *grounded* and {r1['accept']:.2f} / {r8['accept']:.2f} on *repetitive*
  (batch 1 / {NUM_PROMPTS}), vs {SGLANG_ACCEPT}. This workload cannot show what n-gram drafting gives
  on a model that copies its input; *repetitive* stands in for one with a higher accept length."""
    else:
        copy_bullet = f"""* **The default model copies from its prompt** (`scripts/train_copy.py` taught it to, on other
  passages than these). Share of output 4-grams found in the text to copy, 64 greedy tokens, by prompt
  form: {probe_list}. On *grounded* {g1['from_prompt']:.0%} of its output 4-grams come from the passage (and
  {g1['from_self']:.0%} repeat earlier output). Accept lengths {g1['accept']:.2f} / {g8['accept']:.2f} on *grounded*,
  {r1['accept']:.2f} / {r8['accept']:.2f} on *repetitive* (batch 1 / {NUM_PROMPTS}), vs {SGLANG_ACCEPT}."""
    slower = [r for r in rows if r["cpu_ratio"] < 1.0]
    faster = [r for r in rows if r["cpu_ratio"] >= 1.0]
    cases = "; ".join(f"*{r['workload']}* batch {r['batch']}: {r['cpu_ratio']:.2f}x at accept length {r['accept']:.2f}"
                      for r in rows)
    if slower:
        speed_bullet = f"""* **Speculation is slower than plain decoding in {len(slower)} of {len(rows)} cases** (CPU-time ratios: {cases}).
  {"It gains only where the accept length is high and the batch is 1. " if faster else ""}A verify step costs more than
  accept length × a decode step, and far more so at batch {NUM_PROMPTS}. Where its time goes is below."""
    else:
        speed_bullet = f"""* Speculation is faster than plain decoding in every case here (CPU-time ratios: {cases})."""
    body = f"""`{cmd}` — {machine()}, {threads} thread(s); built-in default model (tiny Qwen3-Next, 8 layers, fp32), greedy.

Speculation (*on*): `speculative_algorithm="ngram"`, `speculative_num_draft_tokens={args.draft_tokens}` (at most {args.draft_tokens - 1} drafts per
verify step), match windows 1..12, adaptive drafting (`speculative_ngram_adaptive=True`, the default: each
request's draft budget follows how its drafts fared, and 1-token matches are drafted only after a right
prediction; docs/engine.md). *fixed*: the same with `speculative_ngram_adaptive=False` (every match
drafted in full), run in the same session as its peer. {NUM_PROMPTS} prompts per workload, {args.new_tokens} new tokens each (`ignore_eos`);
batch 1 = the prompts one after the other, batch {NUM_PROMPTS} = all at once. Prefix cache on; prompts
cached by a warm-up run, so the timed runs are generation ({sum(r['cached_total'] for r in rows)} of {sum(r['prompt_tokens'] for r in rows)} prompt tokens hit).
Runs of the three engines interleaved (per prompt at batch 1, order rotating), medians of {args.repeats}. tok/s = output tokens / wall
time; the CPU-time column is the same ratio in process CPU time (1 thread: the work itself, not what the
other jobs on this shared 2-core machine leave of it; trust it where the two disagree). Accept length = output
tokens per verify step (accepted drafts + the bonus token); tokens fed = the last sampled token + the drafts,
per request and verify step. *grounded*: chat template around
"Repeat the following text exactly:" + a ShareGPT assistant message ({plen['grounded'][0]}–{plen['grounded'][1]}
prompt tokens). *repetitive* (synthetic): raw-text prompts that already repeat a phrase or list
({plen['repetitive'][0]}–{plen['repetitive'][1]} tokens). Last column: share of the (greedy) output tokens whose
4-gram occurs in the text to copy (the passage without the template; the whole prompt for *repetitive*)
/ earlier in the output. Speculation on, fixed and off gave **identical greedy token
ids** in every run (checked by the script).

{chr(10).join(table)}

**Targets (grounded workload: ≥ 2x tokens/s at batch 1, ≥ 1.3x at batch {NUM_PROMPTS}): {"met" if met1 else "not met"}
at batch 1 ({g1['ratio']:.2f}x wall, {g1['cpu_ratio']:.2f}x CPU time), {"met" if met8 else "not met"} at batch {NUM_PROMPTS}
({g8['ratio']:.2f}x wall, {g8['cpu_ratio']:.2f}x CPU time).**

{copy_bullet}
{speed_bullet}
"""
    if prof is not None:
        p1, p8 = prof[1], prof[NUM_PROMPTS]
        tot = {(b, s): prof[b][s]["schedule"] + prof[b][s]["forward"] + prof[b][s]["process"] for b in prof for s in PROFILE_SIDES}
        gdn = {(b, s): prof[b][s].get("gated delta rule", 0.0) for b in prof for s in PROFILE_SIDES}
        mrow = {m["batch"]: m for m in micro}
        body += f"""
Where the time goes: one verify step (speculation on: adaptive; *fixed*: every match drafted in full)
vs one plain decode step (off), *grounded* prompts, CPU time of the scheduler thread by component
(functions the layers call, wrapped in-process; medians over all steps of one run; the verify steps'
tokens fed include zero-draft steps, which with adaptive drafting are most of them).

{profile_table(prof, cfg.num_linear_layers, cfg.num_hidden_layers - cfg.num_linear_layers)}

Batch 1, whole step by tokens fed (median ms, steps): plain decode {by_fed['off'][1][0]:.2f} ms;
verify {", ".join(f"{n} token{'s' if n > 1 else ''} {ms:.2f} ms ({c})" for n, (ms, c, _) in by_fed['on'].items())}.
A verify step that feeds only the last token (no draft) costs {by_fed['on'].get(1, (float('nan'), 0))[0] / by_fed['off'][1][0]:.1f}x a
decode step; break-even needs accept length ≥ verify / decode step time.

* **The gated delta rule in the verify step** (fixed drafting): {gdn[(1, 'fixed')]:.1f} ms of {tot[(1, 'fixed')]:.1f} ms at batch 1
  and {gdn[(NUM_PROMPTS, 'fixed')]:.1f} ms of {tot[(NUM_PROMPTS, 'fixed')]:.1f} ms at batch {NUM_PROMPTS}, vs {gdn[(1, 'off')]:.1f} / {gdn[(NUM_PROMPTS, 'off')]:.1f} ms
  in a decode step. The verify step runs through `forward_extend`; `chunk_gated_delta_rule_varlen`
  runs extends of at most `SHORT_EXTEND` = 8 tokens per request token by token with the decode
  step's math (`tree_scan`: one state per request updated in place, the per-token states written
  to the checkpoints asked for) instead of padding them to a 64-token chunk. Kernel micro-benchmark, one layer, 4 tokens and 3 per-token states per
  request: the op as the verify step calls it {mrow[1]['chunked']:.2f} ms (batch 1) / {mrow[NUM_PROMPTS]['chunked']:.2f} ms (batch {NUM_PROMPTS});
  this script's own per-token loop on the gathered states (same outputs and states, checked)
  {mrow[1]['loop']:.2f} / {mrow[NUM_PROMPTS]['loop']:.2f} ms; the plain decode kernel {mrow[1]['decode']:.2f} / {mrow[NUM_PROMPTS]['decode']:.2f} ms; one token per request
  through the op {mrow[1]['one_token_chunked']:.2f} / {mrow[NUM_PROMPTS]['one_token_chunked']:.2f} ms.
* The n-gram drafter and the acceptance are not the problem: propose {p1['on'].get('n-gram drafter (propose)', 0):.2f} /
  {p8['on'].get('n-gram drafter (propose)', 0):.2f} ms per step, `verify()` {p1['on'].get('verify(): acceptance, logprobs', 0):.2f} / {p8['on'].get('verify(): acceptance, logprobs', 0):.2f} ms.
* Done so far: the token-by-token path above (an earlier run of this script, chunked: 0.75x / 0.38x
  on *grounded*, 1.05x / 0.54x on *repetitive*); a verify step where no request has drafts runs as
  a plain decode forward ({by_fed['on'].get(1, (float('nan'), 0))[0] / by_fed['off'][1][0]:.1f}x a decode step here); the model side of a verify step
  made lean (one batched attention, tree scans on lanes, the conv windows of all tokens at once:
  "Speculative verify step" below, with before/after); a match that runs into the end of the history
  continues periodically. **Adaptive drafting** (*on* vs *fixed* above): on *grounded* it feeds
  {g1['fed']:.2f} / {g8['fed']:.2f} tokens per request and verify step (batch 1 / {NUM_PROMPTS}) where fixed drafting feeds
  {g1['sides']['fixed']['fed']:.2f} / {g8['sides']['fixed']['fed']:.2f}, for {g1['cpu_ratio'] / g1['sides']['fixed']['cpu_ratio']:.2f}x / {g8['cpu_ratio'] / g8['sides']['fixed']['cpu_ratio']:.2f}x its tokens/s (CPU time; *repetitive*:
  {r1['cpu_ratio'] / r1['sides']['fixed']['cpu_ratio']:.2f}x / {r8['cpu_ratio'] / r8['sides']['fixed']['cpu_ratio']:.2f}x). **A verify step's requests are committed at once** (`CacheManager.commit_batch`: one
  state copy, one KV copy and one free per step instead of one each per request; `verify()` takes every
  greedy argmax and emitted-token logprob in one op): process {p8['fixed']['process']:.2f} ms per verify step at batch {NUM_PROMPTS}
  with fixed drafting ({p8['fixed']['fed']:.0f} tokens fed) vs {p8['off']['process']:.2f} ms for decode (an earlier run of this script, committing
  request by request: 1.18 vs 0.34 ms at 20 tokens fed).
  What a verify step still pays over a decode step: projection GEMMs with one row per fed token (MKL's
  few-row GEMM on weights streamed from memory costs about twice its one-row GEMV), one recurrent
  update per fed token and layer, and the per-token state checkpoints written to the pool.
* What is left (engine side): a verify step's extra cost is mostly *fixed* — a step that feeds one
  draft already runs the extend path of the whole model (at batch 1, 2 tokens fed
  {by_fed['on'].get(2, (float('nan'), 0))[0]:.2f} ms, 4 tokens {by_fed['on'].get(4, (float('nan'), 0))[0]:.2f} ms, plain decode {by_fed['off'][1][0]:.2f} ms), so a request that drafts
  makes the whole batch's step an extend: a decode-kernel path for short chains would make small
  drafts pay. The live state after a rejection is still copied (one batched copy of every rejecting
  request's state, {slot_bytes / 2**20:.2f} MiB a slot here: memory-bound, so batching the copies saved little of
  it); handing the scratch slot to the request instead (swapping slot ids) would remove it, at the
  price of a cache-manager contract where reserved slots change owners.
"""
    print(body)
    if not args.no_write:
        write_section("Speculative decoding" + drafts_suffix(args), body)


if __name__ == "__main__":
    main()
