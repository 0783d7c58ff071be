"""``hyla sim --engine`` and the engine agree on hits for the same trace, under pressure.

``hyla.sim.replay.replay_engine`` replays the engine's own scheduler and cache manager on
accounting pools, with a runner that only reproduces the trace's outputs. With small pools, pages
of 16 or a 64-token checkpoint grid, concurrent sessions, chunked prefill, eviction and
retraction, every request's cached tokens — and the eviction and retraction counters — must equal
a real engine's.

(``hyla.sim.Simulator`` follows Marconi's protocol instead — one byte budget shared by KV and
states, exact positions, one request at a time, room made for a whole request at once, pluggable
eviction orders — so it agrees with the engine only without eviction, on a sequential trace at
page 1: ``tests/test_sim_simulator.py::test_engine_and_simulator_agree_on_hits``.)
"""

from __future__ import annotations

import random

import pytest

from hyla import Engine
from hyla.sim.models import resolve_model
from hyla.sim.replay import replay_engine
from hyla.sim.trace import TraceRequest


def _turns(engine: Engine, seed: int, num_sessions: int, num_turns: int, max_new: list[int],
           priorities: list[int] | None = None) -> list[list[dict]]:
    """Concurrent chat sessions (a shared system prompt): each turn, every session's next prompt is
    its last prompt + output + a new user message, all submitted together (with ``priorities``, one
    per session). Returns per turn the (prompt, output, cached) of each session."""
    rng = random.Random(seed)
    ids = lambda n: [rng.randrange(3, 2048) for _ in range(n)]  # noqa: E731
    system = ids(40)
    prompts = [system + ids(rng.randrange(20, 110)) for _ in range(num_sessions)]
    turns = []
    for _ in range(num_turns):
        outs = engine.generate(input_ids=prompts, sampling_params=[
            {"temperature": 0, "max_new_tokens": m, "ignore_eos": True} for m in max_new], priority=priorities)
        turns.append([{"prompt": p, "output": o["output_ids"], "cached": o["meta_info"]["cached_tokens"]}
                      for p, o in zip(prompts, outs)])
        prompts = [p + o["output_ids"] + ids(rng.randrange(10, 50)) for p, o in zip(prompts, outs)]
    return turns


def _trace(turns: list[list[dict]], priorities: list[int] | None = None) -> list[TraceRequest]:
    return [TraceRequest(session_id=i, turn_id=t, ts=float(t), input_tokens=r["prompt"], output_tokens=r["output"],
                         priority=priorities[i] if priorities else 0)
            for t, turn in enumerate(turns) for i, r in enumerate(turn)]


@pytest.mark.parametrize("opts", [dict(page_size=1), dict(page_size=16), dict(page_size=1, checkpoint_alignment=64),
                                  dict(page_size=1, enable_mixed_chunk=True),
                                  # a KV pool too small to keep every session: prefixes come back from the host
                                  dict(page_size=1, enable_hierarchical_cache=True, max_total_tokens=640)],
                         ids=["page1", "page16", "align64", "mixed_chunk", "hierarchical"])
def test_the_engine_replay_reproduces_every_hit_under_pressure(qwen3_next_dense_path, opts):
    pools = {**dict(max_total_tokens=1024, max_state_slots=12, max_running_requests=5, chunked_prefill_size=128), **opts}
    max_new = [30, 8, 25, 12, 40, 16]
    with Engine(qwen3_next_dense_path, **pools) as eng:
        turns = _turns(eng, seed=3, num_sessions=6, num_turns=3, max_new=max_new)
        stats = eng.get_stats()
    assert stats["num_evicted_tokens"] > 0 and stats["num_evicted_states"] > 0  # the pools were under pressure
    replay = replay_engine(_trace(turns), resolve_model(str(qwen3_next_dense_path)).layout, **pools)
    assert replay.cached_tokens == [r["cached"] for turn in turns for r in turn]
    assert replay.scheduler.num_retractions == stats["num_retractions"]
    assert (replay.cache.num_evicted_tokens, replay.cache.num_evicted_states) == \
        (stats["num_evicted_tokens"], stats["num_evicted_states"])
    assert sum(replay.cached_tokens) > 0
    if pools.get("enable_mixed_chunk"):  # the engine's mixed steps, replayed as such
        assert stats["num_mixed_tokens"] > 0 and replay.scheduler.num_mixed_tokens == stats["num_mixed_tokens"]
    if pools.get("enable_hierarchical_cache"):  # the host tier's books, kept by the replay as by the engine
        host = replay.cache.host
        assert stats["num_host_hit_tokens"] > 0 and replay.cache.num_host_hit_tokens == stats["num_host_hit_tokens"]
        assert (host.num_saved_tokens, host.num_loaded_tokens) == \
            (stats["num_host_saved_tokens"], stats["num_host_loaded_tokens"])


def test_the_engine_replay_reproduces_priority_scheduling(qwen3_next_dense_path):
    """A trace's priorities replay as the engine's: each wave's urgent sessions admitted first, so
    the same hits and evictions (different ones than the trace without its priorities gives). (A
    replay drains each wave before the next arrives: a request preempted for one that arrived while
    it ran is not replayed.)"""
    pools = dict(max_total_tokens=1024, max_state_slots=12, max_running_requests=3, chunked_prefill_size=128,
                 enable_priority_scheduling=True)
    max_new, priorities = [30, 8, 25, 12, 40, 16], [0, 5, 0, 9, 0, 5]
    with Engine(qwen3_next_dense_path, **pools) as eng:
        turns = _turns(eng, seed=5, num_sessions=6, num_turns=3, max_new=max_new, priorities=priorities)
        stats = eng.get_stats()
    layout = resolve_model(str(qwen3_next_dense_path)).layout
    replay = replay_engine(_trace(turns, priorities), layout, **pools)
    assert replay.cached_tokens == [r["cached"] for turn in turns for r in turn]
    assert (replay.scheduler.num_retractions, replay.scheduler.num_preemptions) == \
        (stats["num_retractions"], stats["num_preemptions"])
    assert (replay.cache.num_evicted_tokens, replay.cache.num_evicted_states) == \
        (stats["num_evicted_tokens"], stats["num_evicted_states"])
    plain = replay_engine(_trace(turns), layout, **pools)  # the same trace without its priorities
    assert plain.cached_tokens != replay.cached_tokens  # (so the priorities were replayed, not ignored)
    with pytest.raises(ValueError, match="enable_priority_scheduling"):
        replay_engine(_trace(turns, priorities), layout, **{**pools, "enable_priority_scheduling": False})


@pytest.mark.parametrize("opts", [
    # max_running_requests from explicit slots (half of them, at most 256); the context length is the
    # model's max_position_embeddings (4096), below the KV pool
    dict(max_total_tokens=8192, max_state_slots=100),
    # the pools' layout follows dtype (K/V and conv window; the default float32 whatever the
    # checkpoint's), and with it a host tier given in GiB
    dict(max_total_tokens=2048, max_state_slots=8, enable_hierarchical_cache=True, hicache_size=0.01,
         dtype="bfloat16"),
    dict(max_total_tokens=2048, max_state_slots=8, enable_hierarchical_cache=True, hicache_size=0.01,
         dtype="float16", kv_cache_dtype="fp8_e4m3"),
], ids=["running-from-slots", "bfloat16-host-tier", "float16-fp8-kv"])
def test_the_engine_replay_sizes_what_the_engine_sizes(qwen3_next_dense_path, opts):
    """The sizes the replay derives from the options — running requests, context length, the pools'
    layout and the host tier — are the engine's own for the same options."""
    with Engine(qwen3_next_dense_path, **opts) as eng:
        running, context, layout = eng.max_running_requests, eng.context_length, eng.cache_layout
        host = eng.host_cache
        host_sizes = None if host is None else (host.kv_pool.size, host.state_pool.size)
    model = resolve_model(str(qwen3_next_dense_path))
    replay = replay_engine([TraceRequest(0, 0, 0.0, [5, 6, 7], [8, 9])], model.layout,
                           max_position_embeddings=model.max_position_embeddings, **opts)
    assert replay.scheduler.config.max_running_requests == running
    assert replay.context_length == context
    assert replay.layout == layout
    rhost = replay.cache.host
    assert (None if rhost is None else (rhost.kv_pool.size, rhost.state_pool.size)) == host_sizes


def test_the_engine_replay_refuses_the_batches_and_requests_the_engine_refuses(qwen3_next_dense_path):
    """A wave larger than the running requests plus max_queued_requests, and a request longer than
    the model's max_position_embeddings: the engine refuses them, and so does the replay (before
    replaying anything)."""
    from hyla.engine.errors import RequestError

    opts = dict(max_total_tokens=8192, max_state_slots=8, max_running_requests=2, max_queued_requests=1)
    sampling = {"max_new_tokens": 2, "temperature": 0, "ignore_eos": True}
    model = resolve_model(str(qwen3_next_dense_path))
    wave = [TraceRequest(i, 0, 0.0, [5 + i, 6, 7], [8, 9]) for i in range(4)]
    long = [TraceRequest(0, 0, 0.0, [5] * 4096, [8, 9])]
    with Engine(qwen3_next_dense_path, **opts) as eng:
        with pytest.raises(ValueError, match="can never fit") as engine_says:
            eng.generate(input_ids=[list(r.input_tokens) for r in wave], sampling_params=sampling)
        with pytest.raises(RequestError, match="the context length is 4096"):
            eng.generate(input_ids=list(long[0].input_tokens), sampling_params=sampling)
        assert len(eng.generate(input_ids=[list(r.input_tokens) for r in wave[:3]], sampling_params=sampling)) == 3
    with pytest.raises(ValueError, match="can never fit: the engine holds at most 3 at once") as replay_says:
        replay_engine(wave, model.layout, **opts)
    assert "(max_running_requests=2 + max_queued_requests=1)" in str(engine_says.value) and \
        "(max_running_requests=2 + max_queued_requests=1)" in str(replay_says.value)
    with pytest.raises(ValueError, match=r"does not fit the model's max_position_embeddings \(4096\)"):
        replay_engine(long, model.layout, max_position_embeddings=model.max_position_embeddings, **opts)
    assert replay_engine(wave[:3], model.layout, **opts).cached_tokens == [0, 0, 0]
