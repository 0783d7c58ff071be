"""The replay loop: hits against an independent oracle, invariants under memory pressure, metrics,
and agreement with the engine (the same cache code path)."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hyla.cache.layout import CacheLayout
from hyla.sim.latency import LatencyModel
from hyla.sim.models import CostModel, marconi_7b
from hyla.sim.policies import POLICIES, fed_len
from hyla.sim.simulator import SimConfig, Simulator, simulate, trace_tokens
from hyla.sim.trace import TraceRequest as Req

TOY = CostModel("toy", CacheLayout(1, 1, 1, torch.float32, 1, (1, 4), torch.float32, (16,), torch.float32),
                1.0, 0.0, 0.0, 0.0)


# ---- random traces with structure: new prompts, next turns, branches, repeats ------------------
@st.composite
def traces(draw, max_requests: int = 12) -> list[Req]:
    rng = random.Random(draw(st.integers(0, 2**32 - 1)))
    vocab = draw(st.sampled_from([6, 50, 10_000]))  # small vocabularies make accidental sharing likely
    reqs: list[Req] = []
    for i in range(draw(st.integers(1, max_requests))):
        kind = rng.choice(["new", "next", "branch", "repeat"]) if reqs else "new"
        if kind == "new":
            inp = [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]
        else:
            prev = rng.choice(reqs)
            if kind == "next":
                inp = list(prev.input_tokens) + list(prev.output_tokens) + [rng.randrange(vocab) for _ in range(rng.randint(0, 8))]
            elif kind == "branch":
                cut = rng.randint(1, len(prev.input_tokens))
                inp = list(prev.input_tokens[:cut]) + [rng.randrange(vocab) for _ in range(rng.randint(1, 10))]
            else:
                inp = list(prev.input_tokens)
        out = [rng.randrange(vocab) for _ in range(rng.randint(1, 4))]
        bounds = tuple(sorted(rng.sample(range(1, len(inp) + 1), k=min(2, len(inp)))))
        reqs.append(Req(i, 0, float(i), inp, out, boundaries=bounds))
    return reqs


def _lcp(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class Oracle:
    """Unlimited memory and no tree, from the cache's documented semantics: the token prefixes that
    hold a checkpoint, the sequences inserted, and the node boundaries the tree has (where a
    sequence ended or left another, where a match stopped, where a checkpoint was put)."""

    def __init__(self, admission: str) -> None:
        self.admission = admission
        self.ckpts: set[tuple] = set()
        self.seqs: list[tuple] = []
        self.bounds: set[tuple] = set()

    def _lcp(self, q: tuple) -> int:
        return max((_lcp(q, s) for s in self.seqs), default=0)

    def _goes_on(self, q: tuple, n: int) -> bool:
        return any(len(s) > n and _lcp(q, s) >= n for s in self.seqs)

    def branch_point(self, q: tuple) -> int | None:
        n, lcp = len(q), self._lcp(q)
        if lcp == 0:
            return None
        if q[:lcp] not in self.bounds:
            return lcp  # the insert would split an edge
        if lcp == n or not self._goes_on(q, lcp) or q[:lcp] in self.ckpts:
            return None  # present up to a node, an extension of a leaf, or a node with a checkpoint
        return lcp  # a second child of an existing node

    def _insert(self, q: tuple, ckpts: set[int]) -> None:
        lcp = self._lcp(q)
        self.bounds |= {q, *([q[:lcp]] if lcp else []), *(q[:p] for p in ckpts)}
        self.ckpts |= {q[:p] for p in ckpts}
        self.seqs.append(q)

    def serve(self, r: Req) -> int:
        inp = tuple(r.input_tokens)
        n = len(inp)
        hit = max((len(p) for p in self.ckpts if len(p) <= n - 1 and inp[: len(p)] == p), default=0)
        kv_match = min(self._lcp(inp), n - 1)
        if kv_match:
            self.bounds.add(inp[:kv_match])  # match_prefix splits the edge where the KV match stops
        branch = self.branch_point(inp)
        prompt = {branch} if branch is not None and hit < branch <= n else set()
        if self.admission == "hyla":
            prompt |= {p for p in (n - 1, *r.boundaries) if p > hit}
        self._insert(inp, prompt)
        fed = (inp + tuple(r.output_tokens))[: fed_len(r)]
        self._insert(fed, {len(fed)})
        return hit


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(traces())
def test_hits_match_an_unlimited_memory_oracle(trace):
    for policy, admission in (("lru", "marconi"), ("marconi", "marconi"), ("hyla", "hyla")):
        sim = Simulator(SimConfig(TOY, policy, 10**7))
        oracle = Oracle(admission)
        for r in trace:
            assert sim.serve(r).cached_tokens == oracle.serve(r), (policy, r)
        sim.tree.check_integrity()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(traces(max_requests=16), st.integers(120, 1500))
def test_invariants_under_memory_pressure(trace, budget):
    """Any budget, any policy: the tree stays consistent and within budget, and a hit never claims
    more than an earlier request computed (nor the prompt's last token)."""
    for policy in POLICIES:
        sim = Simulator(SimConfig(TOY, policy, budget, policy_options=(("arms", (0.0, 2.0)),) if policy == "hyla" else ()))
        computed: list[tuple] = []
        for r in trace:
            hit = sim.serve(r).cached_tokens
            inp = tuple(r.input_tokens)
            assert hit <= len(inp) - 1
            assert hit == 0 or any(_lcp(inp, c) >= hit for c in computed), (policy, r, hit)
            computed.append((inp + tuple(r.output_tokens))[: fed_len(r)])
            assert sim.used_bytes() <= budget
            assert sim.kv_pool.used_size() == sim.tree.total_size()  # no KV outside the tree between requests
            assert sim.state_pool.used_size() == sim.tree.num_checkpoints()
            assert not sim.tree.protected_size()  # every lock was released
        sim.tree.check_integrity()


def test_metrics_aggregate_the_per_request_outcomes():
    model = marconi_7b()
    lat = LatencyModel(effective_flops=1e14, overhead_s=0.002)
    a = Req(0, 0, 0.0, list(range(1000)), list(range(5000, 5100)))
    b = Req(0, 1, 5.0, list(range(1000)) + list(range(5000, 5100)) + list(range(7000, 7300)), [1, 2])
    res = simulate([b, a], SimConfig(model, "lru", 10**9, latency=lat))  # replayed in arrival order
    hits = [0, 1099]
    assert res.cached_tokens == sum(hits) and res.input_tokens == 1000 + 1400
    assert res.token_hit_rate == pytest.approx(1099 / 2400) and res.request_hit_rate == 0.5
    assert res.flops_saved == pytest.approx(model.prefill_flops(1099))
    assert res.flops_total == pytest.approx(model.prefill_flops(1000) + model.prefill_flops(1400))
    ttfts = [lat.ttft(model, 1000, 0), lat.ttft(model, 1400, 1099)]
    assert res.ttft_p50 == pytest.approx(sum(ttfts) / 2)
    assert res.ttft_p95 == pytest.approx(ttfts[1] + 0.95 * (ttfts[0] - ttfts[1]))  # numpy: linear interpolation
    # after a: 1099 tokens + 1 state; after b: 1401 tokens + 1 state (b's checkpoint supersedes a's: LRU keeps both)
    assert res.kv_bytes == pytest.approx((1099 + 1401) / 2 * model.kv_bytes_per_token)
    assert res.state_bytes_peak == 2 * model.state_bytes_per_slot
    assert res.to_json()["policy"] == "lru"


def test_engine_and_simulator_agree_on_hits(qwen3_next_dense_path):
    """The same request sequence through the engine (tiny Qwen3-Next, ample memory) and through the
    simulator: hyla's admission is the engine's, so every hit agrees; lru agrees wherever the two
    admissions store the same checkpoints (all but the boundary and prompt-end hits)."""
    from hyla import Engine

    rng = random.Random(0)

    def toks(n: int) -> list[int]:
        return [rng.randrange(3, 2000) for _ in range(n)]

    system = toks(40)
    plan = [  # (input, boundaries); later inputs continue earlier outputs
        ("s0", lambda o: system + toks(20)),
        ("s0", lambda o: o[0] + toks(15)),
        ("s1", lambda o: system + toks(25)),
        ("s2", lambda o: system + toks(10)),
        ("s1", lambda o: list(reqs[2].input_tokens)),  # the same prompt again
        ("s0", lambda o: o[1] + toks(12)),
    ]
    reqs: list[Req] = []
    engine_hits: list[int] = []
    fed_by_turn: list[list[int]] = []
    with Engine(str(qwen3_next_dense_path), chunked_prefill_size=512, max_total_tokens=8192,
                max_state_slots=64, max_running_requests=4) as engine:
        for i, (session, make) in enumerate(plan):
            inp = make(fed_by_turn)
            bounds = (40, len(inp)) if inp[:40] == system else (len(inp),)
            out = engine.generate(input_ids=inp, sampling_params={"temperature": 0, "max_new_tokens": 5,
                                                                  "ignore_eos": True},
                                  checkpoints=[b for b in bounds if b < len(inp)])
            engine_hits.append(out["meta_info"]["cached_tokens"])
            fed_by_turn.append(inp + out["output_ids"])
            reqs.append(Req(session, i, float(i), inp, out["output_ids"], boundaries=bounds))
    sim_hyla = Simulator(SimConfig(marconi_7b(), "hyla", 10**10))
    sim_lru = Simulator(SimConfig(marconi_7b(), "lru", 10**10))
    hyla_hits = [sim_hyla.serve(r).cached_tokens for r in reqs]
    lru_hits = [sim_lru.serve(r).cached_tokens for r in reqs]
    n2 = len(reqs[2].input_tokens)
    assert engine_hits == hyla_hits
    assert engine_hits == [0, 64, 40, 40, n2 - 1, 64 + 1 + 15 + 4]
    assert [lru_hits[i] for i in (0, 1, 3, 5)] == [engine_hits[i] for i in (0, 1, 3, 5)]
    assert (lru_hits[2], lru_hits[4]) == (0, 40)  # the boundary / prompt-end checkpoints lru lacks


@pytest.mark.parametrize("policy", list(POLICIES))
def test_a_budget_far_beyond_the_trace_costs_no_memory(policy):
    """A huge ``--cache-size`` (a hit-rate ceiling) runs as any budget the trace cannot fill, with the
    same results: the accounting pools' free lists hold ids for what the trace can fill, not one per
    token of the budget (1e18 bytes of marconi-7b's KV would be 1.5e13 ids, 100+ TiB of free list;
    hyla's ghost caches would need as much again each)."""
    model = marconi_7b()
    rng = random.Random(7)
    prompt = [rng.randrange(5000) for _ in range(300)]
    trace = [Req(0, 0, 0.0, prompt, [1, 2, 3]), Req(0, 1, 1.0, prompt + [1, 2, 3, 4], [5]),
             Req(1, 0, 2.0, prompt[:100] + [9] * 20, [])]
    ample, huge = (simulate(trace, SimConfig(model, policy, size)) for size in (10**10, 10**18))
    assert huge.cached_tokens == ample.cached_tokens > 0
    assert {**huge.to_json(), "cache_bytes": 0} == {**ample.to_json(), "cache_bytes": 0}
    kv, state = model.make_pools(10**18, max_tokens=trace_tokens(trace))
    assert kv.size == state.size == trace_tokens(trace) == 300 + 3 + 304 + 1 + 120 + 1
