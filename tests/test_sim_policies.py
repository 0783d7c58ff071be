"""Admission rules and eviction policies on small hand-made traces whose hits are worked out by hand.

The toy model makes the arithmetic easy: 8 bytes of KV per token, 80 bytes per checkpoint (a
checkpoint costs 10 tokens of KV), 1 FLOP per token.
"""

from __future__ import annotations

import pytest
import torch

from hyla.cache.layout import CacheLayout
from hyla.sim.models import CostModel
from hyla.sim.policies import (
    block_admission,
    fed_len,
    hyla_admission,
    make_policy,
    marconi_admission,
)
from hyla.sim.simulator import SimConfig, Simulator, simulate
from hyla.sim.trace import TraceRequest as Req

TOY = CostModel("toy", CacheLayout(1, 1, 1, torch.float32, 1, (1, 4), torch.float32, (16,), torch.float32),
                1.0, 0.0, 0.0, 0.0)
BIG = 10**6  # bytes: nothing is ever evicted


def _hits(policy: str, trace: list[Req], cache_bytes: int = BIG, **options) -> list[int]:
    sim = Simulator(SimConfig(TOY, policy, cache_bytes, policy_options=tuple(options.items())))
    hits = [sim.serve(r).cached_tokens for r in trace]
    sim.tree.check_integrity()
    assert sim.used_bytes() <= cache_bytes
    return hits


def test_toy_model_sizes():
    assert (TOY.kv_bytes_per_token, TOY.state_bytes_per_slot) == (8, 80)
    assert TOY.prefill_flops(7, 3) == 7


# ---- admission rules ---------------------------------------------------------------------------
def test_admission_positions():
    r = Req(0, 0, 0.0, list(range(70)), list(range(30)), boundaries=(20, 70))
    assert fed_len(r) == 99  # the last output token is never fed
    b = block_admission(r, hit=0, branch=None)
    assert (b.prompt_len, b.prompt_checkpoints, b.final_len, b.final_checkpoints) == (64, (32, 64), 96, (96,))
    assert block_admission(r, hit=64, branch=None).prompt_checkpoints == ()
    m = marconi_admission(r, hit=0, branch=40)
    assert (m.prompt_checkpoints, m.final_checkpoints, m.optional) == ((40,), (99,), frozenset())
    assert marconi_admission(r, hit=50, branch=40).prompt_checkpoints == ()  # below the hit: useless
    h = hyla_admission(r, hit=10, branch=40)
    assert h.prompt_checkpoints == (20, 40, 69, 70) and h.final_checkpoints == (99,)
    assert h.optional == {20, 69, 70}  # speculative: only into free memory; the branch point is required
    assert h.num_required == 2 and h.without_optional().prompt_checkpoints == (40,)
    one = Req(0, 0, 0.0, [1, 2, 3], [4])  # a one-token answer: the state after the prompt is the last fed
    assert hyla_admission(one, 0, None).final_checkpoints == (3,)


# ---- hits with unlimited memory ----------------------------------------------------------------
P, O = list(range(1, 13)), [50, 51, 52, 53]
CHAT = [
    Req(0, 0, 0.0, P, O),  # 12-token prompt, 4-token answer: 15 tokens fed
    Req(0, 1, 1.0, P + O + [60, 61, 62, 63], [70, 71, 72]),  # next turn: history + 4 new tokens
    Req(1, 0, 2.0, P[:8] + [80, 81, 82, 83, 84, 85], [90, 91]),  # shares 8 tokens with the chat
    Req(2, 0, 3.0, P[:8] + [100, 101, 102, 103, 104], [110, 111]),  # shares the same 8
    Req(3, 0, 4.0, P[:8] + [80, 81, 82, 83, 84, 85], [120, 121]),  # repeats request 2's prompt
]


def test_hand_worked_hits_without_eviction():
    # lru / marconi: turn 2 hits the 15 tokens turn 1 fed; request 2 stores the branch point (8)
    # that request 3 then hits; the repeat of request 2 also stops at 8 (its own state is at 15,
    # past the 13 tokens a repeat may match)
    assert _hits("lru", CHAT) == [0, 15, 0, 8, 8]
    assert _hits("marconi", CHAT) == [0, 15, 0, 8, 8]
    # hyla also keeps the state at prompt end - 1: the repeat hits 13 of its 14 tokens
    assert _hits("hyla", CHAT) == [0, 15, 0, 8, 13]
    # block: nothing is 32 tokens long, nothing is cached
    assert _hits("block", CHAT) == [0, 0, 0, 0, 0]
    res = simulate(CHAT, SimConfig(TOY, "hyla", BIG))
    assert res.input_tokens == 12 + 20 + 14 + 13 + 14
    assert res.token_hit_rate == pytest.approx(36 / 73) and res.request_hit_rate == pytest.approx(3 / 5)
    assert res.flops_saved == 36  # 1 FLOP per token


L, LO = list(range(1000, 1070)), list(range(2000, 2030))
LONG = [
    Req(0, 0, 0.0, L, LO),  # 70-token prompt, 30-token answer: 99 fed
    Req(0, 1, 1.0, L + LO + list(range(3000, 3010)), [1, 2]),
    Req(1, 0, 2.0, L[:40] + list(range(4000, 4020)), [1]),  # shares 40 tokens
    Req(2, 0, 3.0, L[:40] + list(range(5000, 5020)), [1]),
]


def test_block_hits_round_down_to_whole_blocks():
    # block: states at 32, 64 (prompt) and 96 (output); the next turn hits 96 of the 99 fed; a
    # shared 40-token prefix hits 32 at once; the other policies store the branch point at 40
    assert _hits("block", LONG) == [0, 96, 32, 32]
    assert _hits("lru", LONG) == [0, 99, 0, 40]
    assert _hits("hyla", LONG) == [0, 99, 0, 40]


def test_boundaries_let_a_shared_system_prompt_hit_on_its_second_use():
    system = list(range(500, 530))
    a = Req(0, 0, 0.0, system + [1, 2, 3], [9, 9], boundaries=(30, 33))
    b = Req(1, 0, 1.0, system + [4, 5, 6, 7], [9], boundaries=(30, 34))
    assert _hits("hyla", [a, b]) == [0, 30]
    assert _hits("lru", [a, b]) == [0, 0]  # Marconi's admission needs a third use


# ---- eviction ----------------------------------------------------------------------------------
A, B = list(range(100, 113)), list(range(200, 213))
TWO_CHATS = [
    Req("A", 0, 0.0, A[:10], [A[10]]),  # each turn's input is the previous input + answer
    Req("B", 0, 1.0, B[:10], [B[10]]),
    Req("A", 1, 2.0, A[:11], [A[11]]),
    Req("A", 2, 3.0, A[:12], [A[12]]),
    Req("B", 1, 4.0, B[:11], [B[11]]),
]


def test_superseded_checkpoints_go_before_another_chat():
    """490 bytes. lru: the two chats and A's second turn take 160 + 160 + 88 = 408 bytes; A's
    third turn needs 88 more, and LRU takes B's checkpoint (the least recently used): B's next turn
    misses. hyla: checkpoints superseded by newer ones on their path go first — A@9 and B@9 (prompt
    end - 1), then A@10 — and B's next turn hits its 10 tokens."""
    assert _hits("lru", TWO_CHATS, 490) == [0, 0, 10, 11, 0]
    assert _hits("marconi", TWO_CHATS, 490) == [0, 0, 10, 11, 0]  # alpha 0 before tuning: recency
    # hyla: 240 + 240 (with the speculative A@9 / B@9); A's turn 2 evicts A@9; turn 3 evicts B@9, A@10
    assert _hits("hyla", TWO_CHATS, 490, alpha=0.0) == [0, 0, 10, 11, 10]
    assert _hits("hyla", TWO_CHATS, 490) == [0, 0, 10, 11, 10]


def test_a_speculative_checkpoint_takes_the_place_of_a_superseded_one_never_of_a_live_one():
    """520 bytes. The chat takes 328 (10 + 1 tokens of KV, its speculative A@9 and A@10, superseded
    by A@11, and A@11). Q's prompt needs 160 for its KV and final checkpoint, leaving 32 bytes: its
    speculative checkpoint at 9 does not fit into free memory, so it replaces the chat's oldest
    superseded checkpoint (A@9) — not the live A@11. A repeat of Q's prompt then hits 9 of its 10
    tokens, and the chat's next turn still hits its 11."""
    chat = [Req("A", 0, 0.0, A[:10], [A[10]]), Req("A", 1, 1.0, A[:11], [A[11]])]
    q = list(range(300, 311))
    trace = chat + [Req("Q", 0, 2.0, q[:10], [q[10]]), Req("R", 0, 3.0, q[:10], [7]),
                    Req("A", 2, 4.0, A[:12], [A[12]])]
    assert _hits("hyla", trace, 520, alpha=0.0) == [0, 10, 0, 9, 11]
    assert _hits("hyla", trace, 520) == [0, 10, 0, 9, 11]


def _checkpoints(sim: Simulator) -> dict[int, bool]:
    """depth -> speculative, of every checkpoint the tree holds."""
    return {n.depth: n.speculative for n in sim.tree.nodes() if n.state is not None}


def test_speculative_checkpoints_that_do_not_all_fit_keep_the_deepest_that_do():
    """640 bytes. X's turn takes 328: 11 tokens of KV, its speculative X@9 and X@10 and its final
    X@11. Y's turn needs 24 tokens of KV and its final checkpoint (272 bytes: 40 left free), and
    wants three speculative ones (Y@10, Y@19, Y@20: 240). Evicting the replaceable X@9 and X@10
    leaves room for two: as the engine (``CacheManager.alloc_checkpoints``), the deepest two are
    stored — not none, which would leave the room just freed empty. A repeat of Y's prompt then
    hits 19 of its 20 tokens."""
    x, y = list(range(100, 110)), list(range(200, 220))
    sim = Simulator(SimConfig(TOY, "hyla", 640, policy_options=(("alpha", 0.0),)))
    sim.serve(Req("X", 0, 0.0, x, [7, 8], boundaries=(10,)))
    assert _checkpoints(sim) == {9: True, 10: True, 11: False} and sim.used_bytes() == 328
    sim.serve(Req("Y", 0, 1.0, y, [9] * 5, boundaries=(10, 20)))
    assert sim.num_evicted_checkpoints == 2
    assert {d: s for d, s in _checkpoints(sim).items() if d != 11} == {19: True, 20: True, 24: False}
    assert sim.used_bytes() == 600  # 40 bytes free: half a checkpoint
    assert sim.serve(Req("Y2", 0, 2.0, y, [3])).cached_tokens == 19


def test_a_finished_turn_ends_on_an_ordinary_checkpoint_even_where_a_boundary_sits():
    """A one-token answer: the sequence fed ends at the prompt's end, where a message boundary put a
    speculative checkpoint. It ends a finished turn, so it is ordinary (the engine confirms it at
    the finish): in a 552-byte cache, Y's speculative checkpoints then take the place of X's
    superseded X@9 only, never of X@10, and X's next turn hits its 10 tokens."""
    x, y = list(range(100, 110)), list(range(200, 220))
    sim = Simulator(SimConfig(TOY, "hyla", 552, policy_options=(("alpha", 0.0),)))
    sim.serve(Req("X", 0, 0.0, x, [7], boundaries=(10,)))
    assert _checkpoints(sim) == {9: True, 10: False}
    sim.serve(Req("Y", 0, 1.0, y, [9] * 5, boundaries=(20,)))
    assert sim.serve(Req("X", 1, 2.0, x + [7, 5, 5, 5], [1, 2])).cached_tokens == 10


def _session_root(node) -> int:
    while node.parent.parent is not None:
        node = node.parent
    return node.key[0]


def test_superseded_detection():
    sim = Simulator(SimConfig(TOY, "hyla", BIG, policy_options=(("alpha", 0.0),)))
    for r in TWO_CHATS[:4]:
        sim.serve(r)
    live = {n.depth: n.superseded for n in sim.tree.nodes() if n.state is not None and _session_root(n) == A[0]}
    assert live == {9: True, 10: True, 11: True, 12: False}  # only A's newest checkpoint is live


LONG60, SHORT2, NEW20 = list(range(400, 461)), [300, 301, 302], list(range(600, 621))


def _sizes_round(off: int) -> list[Req]:
    """A 60-token chat, then a 2-token one, then a new 20-token request that forces one of the two
    chats out of an 800-byte cache, then the 60-token chat's next turn."""
    t = [off + x for x in LONG60]
    return [Req(f"L{off}", 0, 0.0, t[:60], t[60:61]), Req(f"S{off}", 0, 1.0, [off + x for x in SHORT2[:2]], [off]),
            Req(f"N{off}", 0, 2.0, [off + x for x in NEW20[:20]], [off]), Req(f"L{off}", 1, 3.0, t[:61], [off])]


@pytest.mark.parametrize("alpha, expected", [(0.0, [0, 0, 0, 0]), (1.0, [0, 0, 0, 60])])
def test_flop_awareness_keeps_the_longer_prefix(alpha, expected):
    """800 bytes. After the two chats (560 + 96 bytes, and the 60-token chat's speculative
    checkpoint at 59) the new request needs 240: the superseded checkpoint goes, then one live chat.
    LRU (alpha 0) evicts the older, 60-token chat: its next turn misses. alpha 1 evicts the chat
    with fewer FLOPs saved per byte-age: the 2-token one (2 FLOPs for 96 bytes, 1 tick old) rather
    than the 60-token one (60 FLOPs for 560 bytes, 4 ticks old)."""
    assert _hits("hyla", _sizes_round(0), 800, alpha=alpha) == expected


def test_a_request_larger_than_the_cache_is_cached_up_to_what_fits():
    # block, 400 bytes: 64 prompt tokens + 2 states need 672; only the first block (336) fits
    big = Req(0, 0, 0.0, list(range(70)), [1])
    again = Req(1, 0, 1.0, list(range(70)), [2])
    assert _hits("block", [big, again], 400) == [0, 32]
    assert _hits("lru", [big, again], 400) == [0, 0]  # its one checkpoint (after 70 tokens) cannot fit


def test_marconi_tunes_alpha_once_after_five_times_the_first_eviction():
    chats = [Req(i, 0, float(i), list(range(1000 * i, 1000 * i + 20)), [1, 2]) for i in range(1, 30)]
    sim = Simulator(SimConfig(TOY, "marconi", 700))  # ~2 chats fit: the first eviction comes early
    for r in chats:
        sim.serve(r)
    info = sim.policy.info()
    assert info["tuned"] and info["alpha"] in (0.0, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0)
    assert sim.policy.first_eviction_at == 3
    untuned = Simulator(SimConfig(TOY, "marconi", 700, policy_options=(("tune", False),)))
    for r in chats:
        untuned.serve(r)
    assert not untuned.policy.info()["tuned"]


def test_hyla_follows_the_best_ghost():
    """Rounds of the scenario above: the ghost with alpha > 0 hits more than the LRU-order ghost,
    and the adaptive policy switches to it."""
    trace = [r for k in range(8) for r in _sizes_round(10_000 * k)]
    lru_order = sum(_hits("hyla", trace, 800, alpha=0.0))
    flop_aware = sum(_hits("hyla", trace, 800, alpha=1.0))
    sim = Simulator(SimConfig(TOY, "hyla", 800))
    adaptive = sum(sim.serve(r).cached_tokens for r in trace)
    assert flop_aware > lru_order
    assert adaptive > lru_order
    assert sim.policy.info()["adaptive"] and sim.policy.eviction.alpha > 0


def test_bad_policy_options():
    with pytest.raises(ValueError, match="unknown policy"):
        SimConfig(TOY, "fifo", BIG)
    with pytest.raises(ValueError, match="bad options"):
        make_policy("lru", TOY, BIG, alpha=1.0)
    with pytest.raises(ValueError, match="non-negative"):
        make_policy("hyla", TOY, BIG, arms=(-1.0,))
    with pytest.raises(ValueError, match="cannot hold one"):
        SimConfig(TOY, "lru", 80)
