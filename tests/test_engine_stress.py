"""Randomized, seeded stress of the engine core: a schedule of submissions, aborts and steps drawn
from a seed, driven step by step on the scheduler thread, under tiny pools (eviction, retraction),
chunked prefill, pages and checkpoint grids, priority preemption, mixed chunked prefill, the overlap
schedule and speculative verify steps (an oracle drafter: full, partial and no acceptance, chains
and trees).

The workload mixes what the existing tests take one at a time: siblings (the same prompt submitted
together, as ``n > 1`` does), prompts that are exactly a cached prefix, one token past it or a prefix
of it, next turns, ``max_new_tokens=1``, stop tokens at the first output token, ``ignore_eos`` off,
streams. Aborts land on requests in every phase: waiting, retracted (waiting again), mid chunked
prefill, decoding, in the overlap schedule's step in flight, finished but not yet released.

Checked: after every action the pools', tree's and requests' accounting (``check_integrity``) and an
audit of ownership (:func:`audit`: every KV page and state slot in use has exactly one owner, every
tree lock a running request); no stall (the engine drains within a bound of steps); every request
delivers exactly one final output;
at the end every KV page, state slot and request row is free, cached or reserved, no tree lock is
left, and the cache empties (``flush_cache``); every request's greedy tokens (an aborted one's
partial output too) equal a cache-off, no-pressure run's up to its first floating-point tie, with
logprobs within 1e-4. The built-in model (it has a tokenizer) adds stop strings and grammars.

Below the stress, the failures it led to, pinned: an abort finishing a request whose text fails, an
abort or a shutdown finishing a failing step in flight — each killed the scheduler thread.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field

import pytest

from hyla import Engine
from hyla.engine.engine import DEFAULT_MODEL_DIR
from hyla.engine.request import Req
from test_engine_api import _generate_within
from test_engine_differential import assert_drained
from test_engine_speculative import OracleDrafter, OracleTreeDrafter

TOL = 1e-4
GRAMMAR = r"(yes|no), [a-z]{1,10}\."  # (text test: a regex some requests' outputs must match)
MAX_NEW = (0, 1, 1, 2, 4, 8, 16, 24, 40)
MAX_TOKENS = 150  # prompt + max_new_tokens of any request: what the smallest pool below holds
REF_OPTS = dict(enable_prefix_cache=False, max_total_tokens=8192, max_state_slots=48, max_running_requests=16,
                chunked_prefill_size=1024)

# the engines under stress: pools that force eviction and retraction (sizes drawn per seed), small chunks
BASE = dict(max_running_requests=4, chunked_prefill_size=32, debug_checks=True)
KV_SIZES, SPARE_STATES = (160, 224, 320), (2, 4, 8)  # state slots: one per running request and these
CONFIGS = {
    "pressure": dict(BASE, max_running_requests=6),
    "host-tier-paged": dict(BASE, page_size=2, enable_hierarchical_cache=True),
    "paged-grid-mixed-priority": dict(BASE, page_size=4, checkpoint_alignment=8, enable_mixed_chunk=True,
                                      enable_priority_scheduling=True, priority_scheduling_preemption_threshold=1,
                                      schedule_policy="fcfs"),
    "overlap": dict(BASE, page_size=2, overlap_schedule="on"),
    "overlap-priority-mixed-grid": dict(BASE, overlap_schedule="on", enable_priority_scheduling=True,
                                        priority_scheduling_preemption_threshold=0, enable_mixed_chunk=True,
                                        page_size=2, checkpoint_alignment=4),
    "spec-chain": dict(BASE, speculative_algorithm="ngram", speculative_num_draft_tokens=4),
    "spec-tree-paged": dict(BASE, page_size=2, speculative_algorithm="ngram", speculative_num_draft_tokens=5,
                            speculative_eagle_topk=2),
    # the model's own drafters (not the oracle): their scratch KV and states, observe after every forward
    "mtp": dict(BASE, speculative_algorithm="mtp", speculative_num_steps=3),
    "draft-tree": dict(BASE, page_size=2, speculative_algorithm="draft", speculative_num_steps=2,
                       speculative_num_draft_tokens=5, speculative_eagle_topk=2),
}
MODELS = {"mtp": "qwen3_5_short_mtp_path", "draft-tree": "qwen3_5_short_path"}  # else qwen3_next_short_path
DRAFT_MODELS = {"draft-tree": "qwen3_5_short_draft_path"}
SLOW = {"mtp", "draft-tree"}
PRIORITY = {name for name, opts in CONFIGS.items() if opts.get("enable_priority_scheduling")}


@dataclass
class Spec:
    """One request of the workload: its prompt and greedy sampling parameters (``extra``: stop
    token ids, stop strings, a grammar)."""

    ids: list[int]
    max_new: int
    ignore_eos: bool = True
    extra: dict = field(default_factory=dict)

    def params(self) -> dict:
        return {"temperature": 0, "max_new_tokens": self.max_new, "ignore_eos": self.ignore_eos, **self.extra}


def _workload(rng: random.Random, ref: Engine, text: bool = False) -> tuple[list[Spec], list[dict]]:
    """The seed's requests and each one's reference output. Wave 1: fresh prompts, prompts after
    shared system prompts; wave 2, from wave 1's prompts and outputs: exact repeats (siblings),
    prefixes, one token past, next turns. Then stop tokens (``text``: stop strings too) drawn from
    the outputs, at the first output token or mid-way; ``text``: some requests with a grammar."""
    vocab = ref.model_config.vocab_size
    tok = lambda n: [rng.randrange(3, vocab) for _ in range(n)]  # noqa: E731
    systems = [tok(rng.randrange(20, 48)) for _ in range(2)]

    def spec(ids: list[int], max_new: int) -> Spec:
        s = Spec(ids, max_new, ignore_eos=rng.random() < 0.8)
        if text and rng.random() < 0.2:
            s.extra["regex"] = GRAMMAR
        return s

    wave1 = [spec((rng.choice(systems) if rng.random() < 0.6 else []) + tok(rng.randrange(1, 40)), rng.choice(MAX_NEW))
             for _ in range(10)]
    out1 = _reference(ref, wave1)
    wave2 = []
    for _ in range(14):
        i = rng.randrange(len(wave1))
        base, out = wave1[i].ids, out1[i]["output_ids"]
        kind = rng.choice(("same", "prefix", "one-past", "turn", "turn-exact"))
        if kind == "same":
            ids = list(base)
        elif kind == "prefix":
            ids = base[:rng.randrange(1, len(base) + 1)]
        elif kind == "one-past":
            ids = base + tok(1)
        elif kind == "turn":
            ids = base + out + tok(rng.randrange(1, 12))
        else:  # exactly what the first turn cached (its prompt and fed output)
            ids = base + out[:-1] if len(out) > 1 else list(base)
        ids = ids[-(MAX_TOKENS - 1):]
        wave2.append(spec(ids, min(rng.choice(MAX_NEW), MAX_TOKENS - len(ids))))
    specs = wave1 + wave2
    for s, o in zip(specs, out1 + _reference(ref, wave2)):
        ids, chars = o["output_ids"], o["text"]
        if len(ids) > 1 and rng.random() < 0.4:
            s.extra["stop_token_ids"] = [ids[0] if rng.random() < 0.5 else rng.choice(ids)]
        if text and chars.strip() and rng.random() < 0.3:  # its first character (in the first token's text, if it
            k = 0 if rng.random() < 0.5 else rng.randrange(len(chars))  # has one) or a few from anywhere
            s.extra["stop"] = [chars[k:k + rng.randrange(1, 4)]]
    return specs, _reference(ref, specs)


def _reference(ref: Engine, specs: list[Spec]) -> list[dict]:
    return ref.generate(input_ids=[s.ids for s in specs], sampling_params=[s.params() for s in specs],
                        return_logprob=True)


def _phase(sched, req: Req) -> str:
    """Where ``req`` stands, for the record of what the aborts hit."""
    if req.finished:
        return "finished, not released" if req in sched.running else "finished"
    if sched.inflight is not None and req in sched.inflight[0].reqs:
        return "in flight"
    if req in sched.waiting:
        return "retracted" if req.admitted_once else "waiting"
    if req in sched.running:
        return "decoding" if req.is_decoding else "prefilling"
    return "unknown"


def audit(eng: Engine) -> None:
    """Between steps, every KV page and state slot in use has exactly one owner — the tree (a node's
    KV, a checkpoint), one running request (its own part of its row, its live state, its pending
    checkpoint) or the reservations (speculative scratch) — a waiting request owns nothing, and each
    tree node's own KV locks are the running requests that end there (no checkpoint lock is held)."""
    cache, sched, tree = eng.cache, eng.scheduler, eng.tree
    ps = eng.kv_pool.page_size
    pages: list[int] = []
    states: list[int] = []
    ends: dict[int, int] = {}  # id(node) -> running requests whose cached prefix ends there
    for r in sched.running:
        own = cache.req_to_token.read(r.req_pool_idx, r.cache_protected_len, r.kv_allocated).tolist()
        pages += sorted({s // ps for s in own})
        states += [r.state_slot] + ([r.pending_ckpt[1]] if r.pending_ckpt is not None else [])
        if r.last_node is not None:
            ends[id(r.last_node)] = ends.get(id(r.last_node), 0) + 1
    for r in sched.waiting:
        assert r.req_pool_idx is None and r.state_slot is None and r.pending_ckpt is None, f"waiting {r.rid} owns slots"
    if tree is not None:
        for node in tree.nodes():
            if node is tree.root:
                continue
            pages += sorted({int(s) // ps for s in node.value})
            if node.state is not None:
                states.append(node.state)
            own_locks = node.lock_ref - sum(c.lock_ref for c in node.children.values())
            want = ends.get(id(node), 0)
            assert own_locks == want, f"{own_locks} KV locks end at a node, {want} requests"
            assert node.state_lock == 0, "a checkpoint lock held between steps"
    assert len(pages) == len(set(pages)), "a KV page has two owners"
    assert len(states) == len(set(states)), "a state slot has two owners"
    assert eng.kv_pool._pages.allocated_mask()[pages].all() and eng.state_pool._slots.allocated_mask()[states].all(), \
        "a slot in use is free"
    kv_used, states_used = eng.kv_pool._pages.allocated_mask().sum(), eng.state_pool._slots.allocated_mask().sum()
    assert kv_used == len(pages) + cache.num_reserved_tokens // ps, "a KV page leaked"
    assert states_used == len(states) + cache.num_reserved_states, "a state slot leaked"
    assert cache.req_to_token.available_size() == eng.max_running_requests + 1 - len(sched.running), "a row leaked"


def _stress(eng: Engine, specs: list[Spec], seed: int, priorities: bool) -> tuple[dict[int, Req], dict, set[int]]:
    """Run the seed's schedule on ``eng``'s scheduler thread, one action at a time; returns the
    requests by spec index, the phases the aborts hit and the indices of the requests aborted."""
    rng = random.Random(seed * 7919 + 1)
    sched = eng.scheduler
    reqs: dict[int, Req] = {}
    finals: dict[str, int] = {}
    phases: dict[str, int] = {}
    aborted: set[int] = set()
    todo = list(range(len(specs)))

    def on_output(out: dict, done: bool) -> None:
        if done:
            finals[out["meta_info"]["id"]] = finals.get(out["meta_info"]["id"], 0) + 1

    def submit(i: int) -> None:
        s = specs[i]
        ckpts = sorted(rng.sample(range(1, len(s.ids) + 1), min(2, len(s.ids)))) if rng.random() < 0.2 else None
        start = rng.randrange(len(s.ids)) if rng.random() < 0.15 else -1  # prompt logprobs: a shorter hit
        (req,), _ = eng._make_requests(None, s.ids, s.params(), True, ckpts, f"r{i}", rng.choice((None, None, "ns")),
                                       start, rng.random() < 0.5)
        req.on_output, req.stream = on_output, rng.random() < 0.3
        if priorities:
            req.priority = rng.choice((0, 0, 5, 20))
        reqs[i] = req
        sched.add_request(req)

    def script() -> None:
        steps = 0
        while todo or sched.has_work():  # submissions, aborts (a third of the requests at most) and steps
            action = rng.random()
            may_abort = len(aborted) < len(specs) // 3 and action < (0.4 if todo else 0.3)
            if todo and action < 0.25:
                i = todo.pop(rng.randrange(len(todo)))
                submit(i)
                for j in [j for j in todo if specs[j].ids == specs[i].ids and rng.random() < 0.7]:
                    todo.remove(j)  # a sibling, submitted with it (as n > 1 does)
                    submit(j)
                while todo and rng.random() < 0.5:  # another request in the same step
                    submit(todo.pop(0))
            elif reqs and may_abort and action >= 0.25:  # a phase (rare ones as often as the rest), a request in it
                by_phase: dict[str, list[int]] = {}
                for i in sorted(reqs):
                    by_phase.setdefault(_phase(sched, reqs[i]), []).append(i)
                phase = rng.choice(sorted(by_phase))
                i = rng.choice(by_phase[phase])
                if sched.abort(f"r{i}"):
                    phases[phase] = phases.get(phase, 0) + 1
                    aborted.add(i)
            else:
                sched.step()
                steps += 1
                assert steps < 3000, "the engine stalled"
            sched.check_integrity()
            audit(eng)

    eng._on_scheduler_thread(script, timeout=600)
    for i, req in reqs.items():
        assert finals.get(req.rid) == 1, f"{req.rid}: {finals.get(req.rid, 0)} final outputs"
    return reqs, phases, aborted


def _compare(req: Req, want: dict, aborted: bool) -> int:
    """``req``'s greedy output against the reference ``want`` up to the first tie; an aborted
    request's partial output as a prefix. Returns the tokens compared."""
    got = list(zip(req.output_logprobs, req.output_ids))
    ref = [(lp, t) for lp, t, _ in want["meta_info"]["output_token_logprobs"]]
    for n, ((lpa, ta), (lpb, tb)) in enumerate(zip(got, ref)):
        assert abs(lpa - lpb) < TOL, f"{req.rid}: token {n}: {ta} ({lpa}) vs {tb} ({lpb}) without a tie"
        if ta != tb:
            return n  # a tie: both runs are right
    if aborted and req.finished_reason["type"] == "abort":
        assert len(got) <= len(ref), req.rid
    else:
        assert len(got) == len(ref), f"{req.rid}: {len(got)} tokens, the reference {len(ref)}"
        assert req.finished_reason == want["meta_info"]["finish_reason"], req.rid
        assert req.text == want["text"], req.rid
    return len(got)


def assert_empty(eng: Engine) -> None:
    """Drained, no tree lock left (KV or checkpoint), and the cache empties: every slot free or reserved."""
    assert_drained(eng)
    tree = eng.tree
    if tree is not None:
        assert tree.protected_size() == 0, "a KV lock on the tree outlived its request"
        assert not any(node.state_lock for node in tree.nodes()), "a checkpoint lock outlived its request"
    assert eng.flush_cache()
    assert eng.kv_pool.available_size() + eng.cache.num_reserved_tokens == eng.kv_pool.size
    assert eng.state_pool.available_size() + eng.cache.num_reserved_states == eng.state_pool.size


@pytest.fixture(scope="module")
def refs():
    """Cache-off, no-pressure reference engines, one per model path, made on first use."""
    engines: dict[str, Engine] = {}

    def get(path) -> Engine:
        if str(path) not in engines:
            engines[str(path)] = Engine(path, **REF_OPTS)
        return engines[str(path)]

    yield get
    for e in engines.values():
        e.shutdown()


# seed 0 of each config in the quick run (~35 s on one core), a second one with the slow tests;
# HYLA_STRESS_SEEDS=n: seeds 0..n-1, to explore (-m slow for all of them)
SEEDS = range(int(os.environ.get("HYLA_STRESS_SEEDS", "2")))


def _cases(configs, slow=()) -> list:
    return [pytest.param(c, s, marks=pytest.mark.slow) if s or c in slow else (c, s) for c in configs for s in SEEDS]


@pytest.mark.parametrize("config, seed", _cases(CONFIGS, SLOW))
def test_stress(request, refs, config, seed):
    path = request.getfixturevalue(MODELS.get(config, "qwen3_next_short_path"))
    draft = request.getfixturevalue(DRAFT_MODELS[config]) if config in DRAFT_MODELS else None
    _run(path, refs(path), config, seed, draft)


TEXT_CONFIGS = ("overlap", "spec-chain", "paged-grid-mixed-priority")


@pytest.mark.parametrize("config, seed", _cases(TEXT_CONFIGS, TEXT_CONFIGS[1:]))
def test_stress_text(refs, config, seed):
    """The built-in model, which has a tokenizer: stop strings (at the first output token too) and
    grammars besides the rest."""
    _run(DEFAULT_MODEL_DIR, refs(DEFAULT_MODEL_DIR), config, seed, text=True)


def _run(path, ref: Engine, config: str, seed: int, draft=None, text: bool = False) -> None:
    rng = random.Random(f"{config}:{seed}:{text}")
    specs, outs = _workload(rng, ref, text)
    opts = dict(CONFIGS[config], max_total_tokens=rng.choice(KV_SIZES))
    page = opts.get("page_size", 1)
    if rng.random() < 0.5:  # the knobs each config leaves free, drawn: tiny chunks, another policy, fewer slots
        opts.update(chunked_prefill_size=rng.choice((max(page, 4), 8, 32)), schedule_policy=rng.choice(("lpm", "fcfs")),
                    protect_waiting_prefixes=rng.random() < 0.5, max_running_requests=rng.choice((1, 2, 4, 6)))
    opts["max_state_slots"] = opts["max_running_requests"] + rng.choice(SPARE_STATES)
    if "speculative_algorithm" in opts:  # each running request's scratch: one state slot per draft token
        drafts = max(opts.get("speculative_num_draft_tokens", 4) - 1, opts.get("speculative_num_steps", 0))
        opts["max_state_slots"] += opts["max_running_requests"] * drafts * 2
    if draft is not None:
        opts["speculative_draft_model_path"] = draft
    with Engine(path, **opts) as eng:
        if opts.get("speculative_algorithm") == "ngram":  # drafts from the reference, some corrupted
            oracle = OracleTreeDrafter if eng.scheduler.drafter.topk > 1 else OracleDrafter
            longest: dict[tuple[int, ...], list[int]] = {}
            for s, o in zip(specs, outs):
                if len(o["output_ids"]) > len(longest.get(tuple(s.ids), ())):
                    longest[tuple(s.ids)] = o["output_ids"]
            eng.scheduler.drafter = oracle(longest, num_draft=eng.scheduler.drafter.num_draft)
        reqs, phases, aborted = _stress(eng, specs, seed, config in PRIORITY)
        assert_empty(eng)
        stats = eng.get_stats()
    compared = sum(_compare(reqs[i], outs[i], i in aborted) for i in reqs)
    assert compared > 0 and len(reqs) == len(specs)
    print(config, seed, {k: opts[k] for k in ("max_total_tokens", "max_state_slots", "max_running_requests",
                                              "chunked_prefill_size") if k in opts}, phases,
          {k: stats[k] for k in ("num_retractions", "num_preemptions") if k in stats}, compared)


# ----------------------------------------------------------------------------------------------
# what the stress found, pinned
# ----------------------------------------------------------------------------------------------
def _failing_detokenizer(rid: str):
    """A ``make_detokenizer`` that raises for request ``rid`` (its text cannot be made)."""
    def make(req):
        if req.rid == rid:
            raise TypeError("injected detokenizer failure")
        return None
    return make


def test_aborting_a_request_whose_text_fails_leaves_the_engine_serving(qwen3_next_short_path, monkeypatch):
    """A client's abort of a running request whose text cannot be made (its detokenizer raises when
    the abort finishes it: a request without a stream makes its text at its end) ends that request
    alone, aborted, its slots freed; the requests beside it and the engine go on. (Finishing it
    raised out of the scheduler's inbox, outside any step: the scheduler thread died, and every
    request, that one included, waited forever.)"""
    with Engine(qwen3_next_short_path, max_total_tokens=1024, max_state_slots=12, max_running_requests=4,
                debug_checks=True) as eng:
        monkeypatch.setattr(eng.scheduler.output, "make_detokenizer", _failing_detokenizer("bad"))
        runner = eng.scheduler.runner
        real, calls = runner.forward_decode, {"n": 0}

        def abort_mid_decode(reqs, out_cache_loc, **kw):
            calls["n"] += 1
            if calls["n"] == 3:  # "bad" has output: the abort is handled from the inbox after this step
                eng.abort("bad")
            return real(reqs, out_cache_loc, **kw)

        monkeypatch.setattr(runner, "forward_decode", abort_mid_decode)
        prompts = [[5 + i for i in range(12)], [40 + i for i in range(9)]]
        outs = _generate_within(eng, 60, input_ids=prompts, rid=["bad", "good"],
                                sampling_params={"temperature": 0, "max_new_tokens": 30, "ignore_eos": True})
        assert outs[0]["meta_info"]["finish_reason"]["type"] == "abort"
        assert "injected detokenizer failure" in outs[0]["meta_info"]["finish_reason"]["message"]
        assert 0 < len(outs[0]["output_ids"]) < 30
        assert outs[1]["meta_info"]["finish_reason"]["type"] == "length" and len(outs[1]["output_ids"]) == 30
        assert eng.is_alive
        monkeypatch.undo()
        again = eng.generate(input_ids=prompts[0], sampling_params={"temperature": 0, "max_new_tokens": 4})
        assert again["meta_info"]["finish_reason"]["type"] == "length"
        assert_empty(eng)


def test_an_abort_that_finishes_a_failing_step_in_flight_leaves_the_engine_serving(qwen3_next_short_path,
                                                                                   monkeypatch):
    """The overlap schedule: an abort first finishes the decode step in flight (``Scheduler.drain``).
    Should that step fail there (here its sampling, injected), it fails as a step does — its requests
    end aborted (cause ``internal``), their slots freed — and the engine serves on. (The abort ran
    from the scheduler's inbox, outside the net around steps: the scheduler thread died.)"""
    with Engine(qwen3_next_short_path, max_total_tokens=1024, max_state_slots=12, max_running_requests=4,
                overlap_schedule="on", debug_checks=True) as eng:
        sched = eng.scheduler
        real_decode, calls = sched.runner.forward_decode, {"n": 0}

        def abort_mid_decode(reqs, out_cache_loc, **kw):
            calls["n"] += 1
            if calls["n"] == 3:  # a step in flight: the abort drains it, and its sampling fails
                assert sched.inflight is None and kw.get("input_ids") is not None  # (launched by _step_overlapped)
                monkeypatch.setattr(sched.output, "draw", failing_draw)
                eng.abort("x")
            return real_decode(reqs, out_cache_loc, **kw)

        def failing_draw(reqs, logits):
            raise RuntimeError("injected sampling failure")

        monkeypatch.setattr(sched.runner, "forward_decode", abort_mid_decode)
        outs = _generate_within(eng, 60, input_ids=[[5 + i for i in range(12)], [40 + i for i in range(9)]],
                                rid=["x", "y"],
                                sampling_params={"temperature": 0, "max_new_tokens": 30, "ignore_eos": True})
        assert [o["meta_info"]["finish_reason"]["cause"] for o in outs] == ["internal", "internal"]
        assert eng.is_alive
        monkeypatch.undo()
        again = eng.generate(input_ids=[5, 6, 7], sampling_params={"temperature": 0, "max_new_tokens": 4})
        assert again["meta_info"]["finish_reason"]["type"] == "length"
        assert_empty(eng)


def test_a_shutdown_whose_first_abort_fails_still_ends_every_request(qwen3_next_short_path, monkeypatch):
    """Shutting down aborts every request left, the first abort finishing the overlap schedule's
    step in flight: should that step fail there, its requests end aborted (cause ``internal``) and the
    waiting ones as shut down — every caller is told. (The failure escaped the shutdown's loop: the
    requests after it never ended, and their callers waited forever.)"""
    eng = Engine(qwen3_next_short_path, max_total_tokens=1024, max_state_slots=12, max_running_requests=1,
                 overlap_schedule="on", debug_checks=True)
    sched = eng.scheduler
    real_decode, calls = sched.runner.forward_decode, {"n": 0}

    def shut_down_mid_decode(reqs, out_cache_loc, **kw):
        calls["n"] += 1
        if calls["n"] == 3:  # a step in flight, a request waiting (one runs at a time): the loop stops after it
            monkeypatch.setattr(sched.output, "draw", failing_draw)
            eng._stopped = True  # (what shutdown() sets; shutdown() itself joins this thread)
        return real_decode(reqs, out_cache_loc, **kw)

    def failing_draw(reqs, logits):
        raise RuntimeError("injected sampling failure")

    monkeypatch.setattr(sched.runner, "forward_decode", shut_down_mid_decode)
    try:
        outs = _generate_within(eng, 60, input_ids=[[5 + i for i in range(12)], [40 + i for i in range(9)]],
                                sampling_params={"temperature": 0, "max_new_tokens": 30, "ignore_eos": True})
    finally:
        eng.shutdown()
    assert [o["meta_info"]["finish_reason"]["cause"] for o in outs] == ["internal", "shutdown"]
    assert not sched.running and not sched.waiting
