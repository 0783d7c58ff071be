"""Priority scheduling (``enable_priority_scheduling``): waiting requests are admitted by priority,
then by the schedule policy; a waiting request preempts running ones less urgent than it by more
than the threshold (for a running slot or for memory); the pool's retraction victim is the least
urgent; and none of it changes what the model computes (greedy tokens and logprobs within 1e-4 of
the plain engine's, the cache on or off)."""

from __future__ import annotations

import random
import threading

import httpx
import pytest

from hyla import Engine
from hyla.engine.args import EngineArgs
from hyla.server.app import create_app
from hyla.server.launch import BackgroundServer
from test_engine_differential import assert_drained, compare_outputs, hold_for_next_submission, make_workload

GREEDY = {"temperature": 0, "ignore_eos": True}
PRIORITY = dict(enable_priority_scheduling=True, debug_checks=True)


def _ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 2048) for _ in range(n)]


def _admissions(engine: Engine) -> list[tuple[str, int]]:
    """Record ``engine``'s admissions in order (re-admissions too): each request's id and the
    prefix the cache gave it."""
    order: list[tuple[str, int]] = []
    sched = engine.scheduler
    admitted = sched._on_admitted

    def recorded(req):
        order.append((req.rid, req.cache_protected_len))
        admitted(req)

    sched._on_admitted = recorded
    return order


def _generate(engine: Engine, ids: list[list[int]], max_new: list[int], **kw) -> list[dict]:
    return engine.generate(input_ids=ids, sampling_params=[{**GREEDY, "max_new_tokens": m} for m in max_new],
                           return_logprob=True, **kw)


# ----------------------------------------------------------------------------------------------
# options and bad input
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("threshold", [-1, 1.5, True, "10"])
def test_preemption_threshold_is_validated(threshold):
    with pytest.raises(ValueError, match="priority_scheduling_preemption_threshold"):
        EngineArgs(priority_scheduling_preemption_threshold=threshold)


def test_priority_is_validated(qwen3_next_dense_path):
    """A priority other than 0 without priority scheduling is refused (it would be silently
    ignored); a priority must be an int, one per request in a batch; nothing is left behind."""
    with Engine(qwen3_next_dense_path, max_total_tokens=2000, max_state_slots=16) as eng:
        with pytest.raises(ValueError, match="priority scheduling is off"):
            eng.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 2}, priority=3)
        for prio in (0, None, [0, None]):
            ids = [[5, 6, 7], [8, 9]] if isinstance(prio, list) else [5, 6, 7]
            eng.generate(input_ids=ids, sampling_params={"max_new_tokens": 2}, priority=prio)
    with Engine(qwen3_next_dense_path, max_total_tokens=2000, max_state_slots=16, **PRIORITY) as eng:
        for bad, match in ((True, "integer"), ("high", "integer"), (2.0, "integer"), ([1, 2, 3], "3 priorities")):
            with pytest.raises(ValueError, match=match):
                eng.generate(input_ids=[[5, 6, 7], [8, 9]], sampling_params={"max_new_tokens": 2}, priority=bad)
        outs = eng.generate(input_ids=[[5, 6, 7], [8, 9]], sampling_params={"max_new_tokens": 2}, priority=[-4, 2**70])
        assert [len(o["output_ids"]) for o in outs] == [2, 2]
        assert_drained(eng)


# ----------------------------------------------------------------------------------------------
# queue order
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("policy, low_first", [("lpm", False), ("fcfs", False), ("fcfs", True), ("lpm", True)])
def test_waiting_requests_are_admitted_by_priority(qwen3_next_dense_path, policy, low_first):
    """One running slot, six requests submitted together: admitted by priority (higher first, or
    lower with ``schedule_low_priority_values_first``), ties in the policy's order (LPM: the one
    whose prefix is cached first; FCFS: arrival)."""
    shared = _ids(1, 40)
    with Engine(qwen3_next_dense_path, max_total_tokens=2000, max_state_slots=24, max_running_requests=1,
                schedule_policy=policy, schedule_low_priority_values_first=low_first, **PRIORITY) as eng:
        eng.generate(input_ids=shared + [7], sampling_params={**GREEDY, "max_new_tokens": 1})  # caches `shared`
        order = _admissions(eng)
        prios = [0, 5, -3, 5, 0, 20]
        ids = [_ids(10 + i, 30) for i in range(6)]
        ids[4] = shared + [9, 9]  # a tie with request 0 (priority 0) whose prefix is cached
        rids = [f"r{i}" for i in range(6)]
        eng.generate(input_ids=ids, sampling_params={**GREEDY, "max_new_tokens": 2}, priority=prios, rid=rids)
    rank = (lambda i: prios[i]) if low_first else (lambda i: -prios[i])
    tie_first = {4: 0} if policy == "lpm" else {}  # LPM: r4 (cached prefix) before r0 in the same priority
    expected = sorted(range(6), key=lambda i: (rank(i), -1 if i in tie_first else 0, i))
    assert [rid for rid, _ in order] == [f"r{i}" for i in expected]


@pytest.mark.parametrize("high", [5, 0])
def test_a_more_urgent_request_goes_before_a_long_prompts_chunks(qwen3_next_dense_path, high):
    """A priority-0 prompt of 640 tokens is prefilled in 64-token steps; a 30-token request of
    priority 5 arriving after its first chunks is admitted at once, the long prompt's chunk taking
    what budget it leaves (34 tokens), so its first token does not wait for the long prefill. At
    priority 0 the long prompt's chunks go first, as without priority scheduling."""
    steps: list[dict[str, tuple[int, int]]] = []  # per prefill step: rid -> (start, tokens)
    with Engine(qwen3_next_dense_path, max_total_tokens=4000, max_state_slots=24, chunked_prefill_size=64,
                **PRIORITY) as eng:
        sched = eng.scheduler
        schedule_prefill = sched._schedule_prefill

        def recorded():
            batch = schedule_prefill()
            if batch is not None:
                steps.append({r.rid: (r.kv_len, n) for r, n in zip(batch.reqs, batch.lens)})
            return batch

        sched._schedule_prefill = recorded
        long, short = _then(
            eng, lambda: eng.generate(input_ids=_ids(50, 640), rid="long", sampling_params={**GREEDY, "max_new_tokens": 2}),
            lambda: eng.generate(input_ids=_ids(51, 30), rid="short", priority=high,
                                 sampling_params={**GREEDY, "max_new_tokens": 2}),
            when=lambda s: any(r.rid == "long" and 64 <= r.kv_len < 640 for r in s.running))
        assert_drained(eng)
    at = next(i for i, step in enumerate(steps) if "short" in step)
    assert steps[at]["short"] == (0, 30)
    start, n = steps[at].get("long", (640, 0))
    if high:  # the long prompt's next chunk, in the budget the admission left, far from its end
        assert n == 34 and start <= 192
    else:  # admitted with the long prompt's last chunk, or after it
        assert start + n == 640
    assert len(long["output_ids"]) == len(short["output_ids"]) == 2


def test_a_full_queue_gives_a_queued_requests_place_to_a_more_urgent_one(qwen3_next_dense_path):
    """One running slot and a queue of two, full: a request of priority 5 takes the place of the
    least urgent queued one (priority 0; never the running one), which ends as an abort of cause
    ``overloaded``; one of priority 4 then takes the place of the next (priority 3), not again of
    the one being displaced; a request no queued one is less urgent than is refused as before. The
    scheduler is held meanwhile, so every submission finds the others still queued. Nothing leaks."""
    from hyla.engine.engine import EngineOverloadedError

    with Engine(qwen3_next_dense_path, max_total_tokens=2000, max_state_slots=24, max_running_requests=1,
                max_queued_requests=2, **PRIORITY) as eng:
        gate, blocked = threading.Event(), threading.Event()
        step = eng.scheduler.step

        def gated():
            if not gate.is_set():
                blocked.set()
                assert gate.wait(60)
            return step()

        gate.set()
        eng.scheduler.step = gated

        def stream(rid, prio, n=4):
            return eng.generate(input_ids=_ids(sum(map(ord, rid)), 20), rid=rid, priority=prio, stream=True,
                                sampling_params={**GREEDY, "max_new_tokens": n})

        streams = {"running": stream("running", 0, n=40)}
        first = next(streams["running"])  # it runs
        gate.clear()
        try:
            assert blocked.wait(60)  # the scheduler waits before its next step (its inbox drained)
            for rid, prio in (("low", 0), ("mid", 3), ("urgent", 5), ("urgent2", 4)):
                streams[rid] = stream(rid, prio)
            with pytest.raises(EngineOverloadedError):
                stream("another", 0)  # nothing queued is less urgent
        finally:
            gate.set()
        ends = {rid: list(chunks)[-1]["meta_info"]["finish_reason"] for rid, chunks in streams.items()}
        assert first["meta_info"]["finish_reason"] is None
        for rid in ("low", "mid"):
            assert ends[rid]["type"] == "abort" and ends[rid]["cause"] == "overloaded", ends
        assert all(ends[rid]["type"] == "length" for rid in ("running", "urgent", "urgent2")), ends
        assert_drained(eng)
        assert not eng._live and not eng._displacing


# ----------------------------------------------------------------------------------------------
# preemption
# ----------------------------------------------------------------------------------------------
def _then(engine: Engine, first, then, when) -> tuple[list[dict], list[dict]]:
    """Call ``first()`` (a submission to ``engine``) on a thread; once ``when(engine.scheduler)``
    holds, the engine waits for ``then()``, called here. Returns both results."""
    reached = threading.Event()

    def armed(sched) -> bool:
        if when(sched):
            reached.set()
            return True
        return False

    hold_for_next_submission(engine, armed)
    outs: dict[str, list[dict]] = {}
    t = threading.Thread(target=lambda: outs.setdefault("first", first()))
    t.start()
    assert reached.wait(60), "the first submission never reached the condition"
    outs["then"] = then()
    t.join(60)
    return outs["first"], outs["then"]


def _start_then_submit(engine: Engine, first: tuple, then: tuple, when) -> tuple[list[dict], list[dict]]:
    """Submit ``first`` (ids, max_new, priorities); once ``when(scheduler)`` holds, ``then``."""
    return _then(engine, lambda: _generate(engine, first[0], first[1], priority=first[2]),
                 lambda: _generate(engine, then[0], then[1], priority=then[2]), when)


@pytest.mark.parametrize("high, preempts", [(11, True), (10, False)])
def test_a_more_urgent_request_preempts_for_a_running_slot(qwen3_next_dense_path, high, preempts):
    """Two running slots held by priority-0 requests decoding 40 tokens; a request of priority 11
    (more urgent by more than the default threshold of 10) preempts the youngest of them, finishes
    first, and the preempted one resumes from what it cached: every output as the plain engine's.
    At priority 10 (not more than the threshold) it waits for a slot instead."""
    low = ([_ids(20, 50), _ids(21, 50)], [40, 40], [0, 0])
    urgent = ([_ids(22, 30)], [6], [high])
    with Engine(qwen3_next_dense_path, max_total_tokens=2000, max_state_slots=24) as plain:
        want = _generate(plain, low[0] + urgent[0], low[1] + urgent[1])
    with Engine(qwen3_next_dense_path, max_total_tokens=2000, max_state_slots=24, max_running_requests=2,
                **PRIORITY) as eng:
        order = _admissions(eng)
        finished = []
        real = eng.scheduler.output.deliver
        eng.scheduler.output.deliver = lambda r: (r.finished and finished.append(r.rid), real(r))[1]
        lows, (hi,) = _start_then_submit(eng, low, urgent, when=lambda s: len(s.running) == 2
                                         and all(len(r.output_ids) >= 2 for r in s.running))
        stats = eng.get_stats()
        assert_drained(eng)
    compare_outputs(lows + [hi], want)
    assert [o["output_ids"] for o in lows + [hi]] == [o["output_ids"] for o in want]
    assert stats["num_preemptions"] == (1 if preempts else 0)
    low_rids = [o["meta_info"]["id"] for o in lows]
    if preempts:  # the youngest low one gave its slot, came back after the urgent one, which finished first
        assert [rid for rid, _ in order] == low_rids + [hi["meta_info"]["id"], low_rids[1]]
        assert finished[0] == hi["meta_info"]["id"]
        assert order[-1][1] > 50  # it resumed from the cache: its prompt and its output so far
    else:
        assert [rid for rid, _ in order] == low_rids + [hi["meta_info"]["id"]]
        assert finished[-1] == hi["meta_info"]["id"]


@pytest.mark.parametrize("cache", [True, False])
def test_a_more_urgent_request_preempts_for_memory(qwen3_next_dense_path, cache):
    """A 400-token KV pool held by three priority-0 requests; a priority-20 request of 150 tokens
    does not fit: the least urgent, youngest running requests are retracted until it does (not
    more), with the prefix cache on and off; outputs as the plain engine's."""
    low = ([_ids(30 + i, 70) for i in range(3)], [40, 40, 40], [0, 0, 0])
    urgent = ([_ids(33, 150)], [4], [20])
    with Engine(qwen3_next_dense_path, max_total_tokens=2000, max_state_slots=24) as plain:
        want = _generate(plain, low[0] + urgent[0], low[1] + urgent[1])
    with Engine(qwen3_next_dense_path, max_total_tokens=400, max_state_slots=24, max_running_requests=8,
                enable_prefix_cache=cache, **PRIORITY) as eng:
        lows, his = _start_then_submit(eng, low, urgent, when=lambda s: len(s.running) == 3
                                       and all(len(r.output_ids) >= 20 for r in s.running))
        stats = eng.get_stats()
        assert_drained(eng)
    compare_outputs(lows + his, want)
    # 3 x ~91 tokens held, ~127 free; the urgent one needs 150 + the others' decode reserve (~38):
    # one retraction makes the room (its ~91 tokens, ~13 of reserve)
    assert stats["num_preemptions"] == 1


def test_the_pool_retracts_the_least_urgent_first(qwen3_next_dense_path):
    """When decoding outgrows the KV pool, the request retracted is the least urgent one, not the
    youngest: here the oldest request, of priority 0, while the younger one has priority 5 (and
    a threshold of 100 rules out preemption at admission)."""
    ids, max_new = [_ids(40, 50), _ids(41, 50)], [150, 150]
    with Engine(qwen3_next_dense_path, max_total_tokens=2000, max_state_slots=24) as plain:
        want = _generate(plain, ids, max_new)
    with Engine(qwen3_next_dense_path, max_total_tokens=300, max_state_slots=24,
                priority_scheduling_preemption_threshold=100, **PRIORITY) as eng:
        victims = []
        retract = eng.scheduler.retract
        eng.scheduler.retract = lambda r, **kw: (victims.append(r.rid), retract(r, **kw))[1]
        outs = _generate(eng, ids, max_new, priority=[0, 5], rid=["old-low", "young-high"])
        stats = eng.get_stats()
    compare_outputs(outs, want)
    assert victims and set(victims) == {"old-low"}
    assert stats["num_preemptions"] == 0


# ----------------------------------------------------------------------------------------------
# the differential: priorities and preemption change no output
# ----------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("on", [{}, dict(enable_mixed_chunk=True), dict(speculative_algorithm="ngram", max_state_slots=48)],
                         ids=["plain", "mixed_chunk", "ngram"])
def test_priority_scheduling_is_exact_under_pressure(qwen3_next_dense_path, on):
    """The differential workload (chat sessions, shared documents, second turns) with random
    priorities and a threshold of 0, its first turns submitted in two halves (the second while the
    first runs), on small pools, against the plain engine with the cache off: the same greedy
    tokens and logprobs; preemptions and evictions happened. ``on``: with prefill steps that feed
    the decoding requests too (``enable_mixed_chunk``: not those preempted in the step), with
    n-gram speculation (preempted requests' drafts and states rolled back)."""
    wave1, followups = make_workload(seed=21, vocab=2048, num_sessions=16, num_shared=24, scale=0.5)
    rng = random.Random(21)
    prios = [rng.randrange(-5, 6) for _ in wave1]
    opts = dict(max_total_tokens=500, max_state_slots=16, max_running_requests=8, chunked_prefill_size=64)

    def submit(eng, specs, priority=None):
        return eng.generate(input_ids=[s["ids"] for s in specs], checkpoints=[s["ckpt"] for s in specs],
                            sampling_params=[{**GREEDY, "max_new_tokens": s["max_new"]} for s in specs],
                            return_logprob=True, priority=priority)

    with Engine(qwen3_next_dense_path, enable_prefix_cache=False, **opts) as off:
        out1_off = submit(off, wave1)
        wave2 = [{"ids": w["ids"] + o["output_ids"] + f, "max_new": 4, "ckpt": []}
                 for w, o, f in zip(wave1, out1_off, followups)]
        out2_off = submit(off, wave2)
    half = len(wave1) // 2
    with Engine(qwen3_next_dense_path, priority_scheduling_preemption_threshold=0, **{**opts, **on}, **PRIORITY) as eng:
        a, b = _then(eng, lambda: submit(eng, wave1[:half], prios[:half]),
                     lambda: submit(eng, wave1[half:], prios[half:]), when=lambda s: len(s.running) >= 4)
        out2_on = submit(eng, wave2, [rng.randrange(-5, 6) for _ in wave2])
        assert_drained(eng)
        stats = eng.get_stats()
    n = compare_outputs(a + b + out2_on, out1_off + out2_off)
    assert n > 0.9 * sum(s["max_new"] for s in wave1 + wave2)
    assert stats["num_preemptions"] > 0 and (stats["num_mixed_tokens"] > 0) == bool(on.get("enable_mixed_chunk"))
    assert (stats["spec_accept_length"] is not None) == bool(on.get("speculative_algorithm"))
    assert stats["num_evicted_tokens"] > 0 and stats["num_cached_tokens"] > 0.3 * stats["num_prompt_tokens"]


# ----------------------------------------------------------------------------------------------
# the server
# ----------------------------------------------------------------------------------------------
def test_server_passes_priorities(qwen3_next_dense_path):
    """``/generate`` takes a priority (one, or one per item); without priority scheduling a
    priority other than 0 is a 400 naming the option, and the engine serves on."""
    for enabled in (False, True):
        app = create_app(qwen3_next_dense_path, max_total_tokens=2000, max_state_slots=16,
                         enable_priority_scheduling=enabled, warmup="off")
        with BackgroundServer(app) as srv:
            body = {"input_ids": [[5, 6, 7], [8, 9, 10]], "sampling_params": {"max_new_tokens": 2},
                    "priority": [3, 0]}
            r = httpx.post(srv.url + "/generate", json=body, timeout=60)
            if enabled:
                assert r.status_code == 200, r.text
                assert [len(o["output_ids"]) for o in r.json()] == [2, 2]
            else:
                assert r.status_code == 400 and "enable-priority-scheduling" in r.json()["error"]["message"]
            r = httpx.post(srv.url + "/generate", json={**body, "priority": [1]}, timeout=60)
            assert r.status_code == 400 and "priority" in r.json()["error"]["message"]
            r = httpx.post(srv.url + "/generate", json={**body, "priority": "high"}, timeout=60)
            assert r.status_code == 400
            r = httpx.post(srv.url + "/generate", json={**body, "priority": 0}, timeout=60)
            assert r.status_code == 200, r.text
