"""Cost of the prefix-cache operations, and the token hit rate, on a shared-prefix workload.

Workload (issue 2): N requests of 512 tokens = a 32-token system prompt shared by all + 224 tokens
shared within one of 100 groups + 256 unique tokens, groups in random order. Per request, the
engine's cache flow without a model:

    match_prefix -> allocate the miss (alloc_extend) -> [hybrid: branch_point, fresh checkpoint
    slots at the branch point and at the end] -> insert

then N lookups (a follow-up request per group: system + group prefix + 256 new tokens), then
``evict`` half of the tree's KV, then ``evict_state`` half of its checkpoints. Both trees run on
pools in accounting mode (the same allocator, no tensors), at page sizes 1 and 16.

Two hybrid admissions:
* ``hybrid``: Marconi's — a checkpoint at the dry-run branch point and one at the end of each
  request, nothing else. A prefix shared by a group gets its checkpoint from its second occurrence
  and hits from its third; the KV-only tree hits from the second.
* ``hybrid+b``: the engine's admission with message boundaries — also a checkpoint at the end of
  the system prompt and of the group's shared context (what the engine does for the message ends
  of a chat, or ``generate(..., checkpoints=[...])``). A shared prefix then hits from its second
  occurrence, as in the KV-only tree.
"from 3rd" is the hit rate over requests that are at least the third of their group.

    python benchmarks/cache_ops.py                # 10,000 requests, page sizes 1 and 16
    python benchmarks/cache_ops.py --num-requests 2000 --page-sizes 16
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time

import numpy as np
import torch

from hyla.cache import KVPool, RadixCache, StatePool

SYSTEM_LEN, GROUP_LEN, UNIQUE_LEN, NUM_GROUPS, VOCAB = 32, 224, 256, 100, 32_000


def make_requests(num: int, rng: random.Random) -> tuple[list[tuple[int, ...]], list[int], list[tuple[int, ...]]]:
    """``num`` prompts (tuples of token ids), the group of each, and one fresh prompt per request
    for the lookup phase (same system + group prefix, new unique part)."""
    system = [rng.randrange(VOCAB) for _ in range(SYSTEM_LEN)]
    groups = [[rng.randrange(VOCAB) for _ in range(GROUP_LEN)] for _ in range(NUM_GROUPS)]
    order = [i % NUM_GROUPS for i in range(num)]
    rng.shuffle(order)

    def prompt(g: int) -> tuple[int, ...]:
        ids = system + groups[g] + [rng.randrange(VOCAB) for _ in range(UNIQUE_LEN)]
        # fresh int objects per request, as a tokenizer produces them: comparing the same objects
        # would let tuple comparison skip the value check and flatter the tree
        return tuple(np.array(ids, dtype=np.int64).tolist())

    return [prompt(g) for g in order], order, [prompt(g) for g in order]


def build(page_size: int, hybrid: bool, num_requests: int) -> RadixCache:
    per_req = SYSTEM_LEN + GROUP_LEN + UNIQUE_LEN
    num_tokens = page_size * (num_requests * per_req // page_size + 1024)
    # dimensions of a 7B-class hybrid (4 attention layers, 24 linear layers); accounting only
    kv = KVPool(num_tokens, page_size, 4, 8, 128, torch.bfloat16, accounting=True)
    if not hybrid:
        return RadixCache(kv)
    states = StatePool(3 * num_requests + 16, 24, (8192, 3), torch.bfloat16, (32, 128, 128), torch.float32,
                       accounting=True)
    return RadixCache(kv, state_pool=states)


def run(page_size: int, hybrid: bool, num_requests: int, seed: int, boundaries: bool = False) -> dict[str, float]:
    prompts, groups, lookups = make_requests(num_requests, random.Random(seed))
    seen: dict[int, int] = {}
    occurrence = []  # 1 for a group's first request, 2 for its second, ...
    for g in groups:
        seen[g] = seen.get(g, 0) + 1
        occurrence.append(seen[g])
    cache = build(page_size, hybrid, num_requests)
    kv_pool = cache.kv_pool
    t_match, t_insert, t_branch, t_lookup = [], [], [], []
    hit = total = steady_hit = steady_total = 0
    clock = time.perf_counter_ns
    gc.collect()
    for tokens, occ in zip(prompts, occurrence):
        t0 = clock()
        res = cache.match_prefix(tokens)
        prefix = res.kv_indices  # the engine always reads them: part of the cost
        t1 = clock()
        t_match.append(t1 - t0)
        p = res.prefix_len
        hit += p
        total += len(tokens)
        if occ >= 3:  # the group's prefix has been seen twice: both trees can have it by now
            steady_hit += p
            steady_total += len(tokens)
        last_loc = int(prefix[-1]) if p else -1
        new = kv_pool.alloc_extend([p], [last_loc], [len(tokens) - p])
        kv = torch.cat([prefix, new])
        ckpts = []
        if hybrid:
            t2 = clock()
            branch = cache.branch_point(tokens)
            t_branch.append(clock() - t2)
            wanted = [branch, len(tokens)]
            if boundaries:
                wanted += [SYSTEM_LEN, SYSTEM_LEN + GROUP_LEN]  # the message ends
            want = sorted({q - q % page_size for q in wanted if q} - {0})
            want = [q for q in want if q > p]
            slots = cache.state_pool.alloc(len(want)).tolist()  # stands for the model's checkpoint states
            ckpts = list(zip(want, slots))
        t2 = clock()
        cache.insert(tokens, kv, ckpts)
        t_insert.append(clock() - t2)
    lookup_hit = 0
    for tokens in lookups:
        t0 = clock()
        res = cache.match_prefix(tokens)
        res.kv_indices
        t_lookup.append(clock() - t0)
        lookup_hit += res.prefix_len
    cache.check_integrity()
    size_before = cache.total_size()
    t0 = clock()
    evicted = cache.evict(size_before // 2)
    t_evict = clock() - t0
    out = {
        "match_us": statistics.median(t_match) / 1e3,
        "insert_us": statistics.median(t_insert) / 1e3,
        "lookup_us": statistics.median(t_lookup) / 1e3,
        "evict_kv_ms": t_evict / 1e6,
        "evicted_tokens": evicted,
        "hit_rate": hit / total,
        "steady_hit_rate": steady_hit / max(1, steady_total),
        "lookup_hit_rate": lookup_hit / sum(len(t) for t in lookups),
        "tree_tokens": size_before,
    }
    if hybrid:
        out["branch_us"] = statistics.median(t_branch) / 1e3
        num_ckpt = cache.num_checkpoints()
        t0 = clock()
        out["evicted_states"] = cache.evict_state(num_ckpt // 2)
        out["evict_state_ms"] = (clock() - t0) / 1e6
        out["checkpoints"] = num_ckpt
    cache.check_integrity()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-requests", type=int, default=10_000)
    ap.add_argument("--page-sizes", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    print(f"{args.num_requests} requests x 512 tokens (32 system + 224 group-shared of {NUM_GROUPS} + 256 unique)")
    print(f"{'tree':<8}{'page':>5}{'match µs':>10}{'insert µs':>11}{'branch µs':>11}{'lookup µs':>11}"
          f"{'evict KV ms':>13}{'evict st ms':>13}{'hit rate':>10}{'from 3rd':>10}{'lookup hit':>12}")
    for ps in args.page_sizes:
        for name, hybrid, boundaries in (("kv-only", False, False), ("hybrid", True, False), ("hybrid+b", True, True)):
            r = run(ps, hybrid, args.num_requests, args.seed, boundaries)
            print(f"{name:<8}{ps:>5}{r['match_us']:>10.1f}{r['insert_us']:>11.1f}"
                  f"{r.get('branch_us', float('nan')):>11.1f}{r['lookup_us']:>11.1f}{r['evict_kv_ms']:>13.1f}"
                  f"{r.get('evict_state_ms', float('nan')):>13.1f}{100 * r['hit_rate']:>9.2f}%"
                  f"{100 * r['steady_hit_rate']:>9.2f}%{100 * r['lookup_hit_rate']:>11.2f}%")


if __name__ == "__main__":
    main()
