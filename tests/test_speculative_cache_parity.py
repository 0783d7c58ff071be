"""Speculative decoding caches what plain decoding caches: after a first turn of several conversations the
tree holds the same checkpoints (positions, speculative flags) and KV with speculation (n-gram and MTP
chains and trees) as without, the second turns find the same cached tokens, and the greedy tokens are equal.

Speculation's only cost to the cache is its scratch states (one per draft token per running request, taken
from the state pool for good: ``CacheManager.reserve_states``): with an explicit ``max_state_slots`` the tree
has that many fewer slots for checkpoints (docs/engine.md, "Speculative decoding"). The pools here are large
enough that no checkpoint is evicted.
"""
from __future__ import annotations

import random

import pytest

from hyla import Engine

N_NEW = 40
NGRAM = dict(speculative_algorithm="ngram", speculative_num_draft_tokens=4)  # 3 scratch slots per running request


def _workload(n: int) -> tuple[list[int], list[list[int]], list[list[int]]]:
    """A 48-token system prompt, ``n`` first turns (it and 10-29 tokens) and ``n`` follow-ups of 8 tokens."""
    rng = random.Random(1)

    def tokens(k: int) -> list[int]:
        return [rng.randrange(3, 4000) for _ in range(k)]
    system = tokens(48)
    return system, [system + tokens(rng.randrange(10, 30)) for _ in range(n)], [tokens(8) for _ in range(n)]


def _two_turns(opts: dict, n: int) -> dict:
    """Both turns of ``n`` conversations (a checkpoint asked at the system prompt's end): the tree's
    checkpoints and KV after the first, the second turns' cached tokens, every greedy token."""
    system, turn1, follow = _workload(n)
    sp = {"temperature": 0, "max_new_tokens": N_NEW, "ignore_eos": True}
    with Engine(warmup="off", debug_checks=True, **opts) as eng:
        out1 = eng.generate(input_ids=turn1, sampling_params=sp, checkpoints=[[len(system)]] * n)
        eng.wait_idle()
        eng.check_integrity()
        tree = eng.scheduler.cache.tree
        ckpts = sorted((nd.depth, bool(nd.speculative)) for nd in tree.nodes()
                       if nd is not tree.root and nd.state is not None)
        kv = tree.total_size()
        turn2 = [p + o["output_ids"] + f for p, o, f in zip(turn1, out1, follow)]
        out2 = eng.generate(input_ids=turn2, sampling_params=sp)
        accept = eng.get_stats().get("spec_accept_length")
    return dict(ckpts=ckpts, kv=kv, hits=[o["meta_info"]["cached_tokens"] for o in out2],
                tokens=[o["output_ids"] for o in out1 + out2], accept=accept)


@pytest.mark.parametrize("spec", [
    NGRAM,
    dict(speculative_algorithm="mtp", speculative_num_steps=3, speculative_eagle_topk=2,
         speculative_num_draft_tokens=7),
], ids=["ngram", "mtp-tree"])
@pytest.mark.parametrize("grid", [{}, dict(page_size=16, checkpoint_alignment=32)], ids=["exact", "page16-align32"])
def test_speculation_caches_what_plain_decoding_caches(spec, grid):
    off = _two_turns(dict(grid), 8)
    on = _two_turns(dict(grid, **spec), 8)
    assert on["accept"] > 1.5  # drafts were accepted: verify steps advanced several positions
    assert on["tokens"] == off["tokens"]
    assert on["ckpts"] == off["ckpts"] and on["kv"] == off["kv"]
    assert on["hits"] == off["hits"]
    assert sum(off["hits"]) > 0.9 * 8 * (48 + 10 + N_NEW)  # turn 2 reuses turn 1's whole conversation
