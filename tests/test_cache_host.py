"""The host tier (``HostCache``): what the device tree evicts goes down with its checkpoint, comes back
bit-exact, is copied once, and never takes a locked hit.

Every KV row and state the tests write is a fingerprint of the prefix it belongs to (its namespace
and tokens), so a host hit restores exact data iff each loaded row equals the fingerprint of its
own prefix.
"""

from __future__ import annotations

import random

import pytest
import torch

from hyla.cache import HostCache, KVPool, RadixCache, StatePool


def fingerprint(namespace, tokens) -> float:
    return float(hash((namespace, tuple(tokens))) % 1_000_003)


def pools(num_tokens: int, num_slots: int, page_size: int, states: bool):
    kv = KVPool(num_tokens, page_size, 2, 1, 2, torch.float32)  # 2 layers, 1 head of 2
    sp = StatePool(num_slots, 2, (3, 2), torch.float32, (2, 2, 2), torch.float32, hidden_size=3,
                   hidden_dtype=torch.float32) if states else None
    return kv, sp


def make(page_size: int = 1, kv_tokens: int = 64, slots: int = 8, host_tokens: int = 128, host_slots: int = 16,
         states: bool = True, defer: bool = False) -> tuple[RadixCache, HostCache]:
    """``defer``: saves land only when they must (a load reads their rows), as on a device whose
    copies never finish by themselves."""
    kv, sp = pools(kv_tokens, slots, page_size, states)
    tree = RadixCache(kv, state_pool=sp)
    return tree, HostCache(tree, *pools(host_tokens, host_slots, page_size, states), defer=defer)


def write_kv(pool: KVPool, slots: torch.Tensor, namespace, tokens, start: int) -> None:
    """Slot ``slots[j]`` holds position ``start + j`` of ``tokens``: its fingerprint, per layer."""
    for j, s in enumerate(slots.tolist()):
        f = fingerprint(namespace, tokens[:start + j + 1])
        for layer, (k, v) in enumerate(zip(pool.k_buffers, pool.v_buffers)):
            k[s] = f + layer
            v[s] = -(f + layer)


def kv_ok(pool: KVPool, slots: torch.Tensor, namespace, tokens, start: int) -> bool:
    for j, s in enumerate(slots.tolist()):
        f = fingerprint(namespace, tokens[:start + j + 1])
        for layer, (k, v) in enumerate(zip(pool.k_buffers, pool.v_buffers)):
            if not (torch.all(k[s] == f + layer) and torch.all(v[s] == -(f + layer))):
                return False
    return True


def write_state(pool: StatePool, slot: int, namespace, tokens) -> None:
    f = fingerprint(namespace, tokens)
    for i, buf in enumerate(pool.all_buffers()):
        buf[slot] = f + i


def state_ok(pool: StatePool, slot: int, namespace, tokens) -> bool:
    f = fingerprint(namespace, tokens)
    return all(torch.all(buf[slot] == f + i) for i, buf in enumerate(pool.all_buffers()))


def put(tree: RadixCache, tokens: list[int], namespace=None, ckpt: bool = True) -> None:
    """The engine's flow: match, KV for the miss (evicting if short), a checkpoint at the end, insert."""
    hit = tree.match_prefix(tokens, namespace)
    p = hit.kv_only_len
    need = len(tokens) - p
    tree.inc_lock_ref(hit.kv_only_node)  # the matched KV stays while room is made
    if tree.kv_pool.available_size() < need:
        tree.evict(need - tree.kv_pool.available_size())
    ckpts = []
    if ckpt and tree.state_pool is not None:
        if not tree.state_pool.available_size():
            tree.evict_state(1)
        slot = int(tree.state_pool.alloc(1)[0])
        write_state(tree.state_pool, slot, namespace, tokens)
        ckpts = [(len(tokens), slot)]
    new = tree.kv_pool.alloc(need)
    write_kv(tree.kv_pool, new, namespace, tokens, p)
    tree.insert(tokens, torch.cat([hit.kv_only_indices, new]), ckpts, namespace)
    tree.dec_lock_ref(hit.kv_only_node)


def load_and_check(tree: RadixCache, host: HostCache, tokens: list[int], namespace=None) -> int:
    """Load the host's hit for ``tokens`` into fresh device slots (the cache manager's flow, without
    the device tree's insert), check every row, free them; returns the hit's length (0: none)."""
    hit = host.match(tokens, namespace)
    if hit is None:
        return 0
    try:
        short = hit.prefix_len - tree.kv_pool.available_size()
        if short > 0:  # room on the device: its evictions save into the host while the hit is locked
            tree.evict(short)
        if tree.state_pool is not None and not tree.state_pool.available_size():
            tree.evict_state(1)
        kv = tree.kv_pool.alloc(hit.prefix_len)
        slot = int(tree.state_pool.alloc(1, zero=False)[0]) if tree.state_pool is not None else None
        host.load(hit, 0, kv, slot)
        assert kv_ok(tree.kv_pool, kv, namespace, tokens, 0)
        if slot is not None:
            assert state_ok(tree.state_pool, slot, namespace, tokens[:hit.prefix_len])
            tree.state_pool.free([slot])
        tree.kv_pool.free(kv)
    finally:
        host.unlock(hit)
    return hit.prefix_len


def tokens_of(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(50) for _ in range(n)]


def test_an_evicted_prefix_goes_down_with_its_checkpoint_and_comes_back_exact() -> None:
    tree, host = make()
    x = tokens_of(20, 1)
    put(tree, x)
    assert tree.evict(20) == 20 and tree.total_size() == 0
    assert (host.tree.total_size(), host.tree.num_checkpoints()) == (20, 1)
    assert (host.num_saved_tokens, host.num_saved_checkpoints) == (20, 1)
    assert load_and_check(tree, host, x + [7, 8]) == 20
    assert load_and_check(tree, host, x[:19]) == 0  # the state after 19 tokens was never kept
    assert (host.num_loaded_tokens, host.num_loaded_checkpoints) == (20, 1)
    host.check_integrity()
    tree.check_integrity()


def test_a_checkpoint_evicted_alone_goes_down_with_its_path() -> None:
    """``evict_state`` of an internal node (a tombstone afterwards): the host keeps the checkpoint
    with the KV of its whole path, though the device keeps that KV too."""
    tree, host = make()
    x = tokens_of(30, 2)
    put(tree, x[:10])
    put(tree, x)
    node = tree.match_prefix(x[:10]).last_node
    tree.inc_lock_ref(tree.match_prefix(x).last_node)  # only the 10-token checkpoint is evictable
    assert tree.evict_state(1) == 1 and node.state is None and tree.total_size() == 30
    assert (host.tree.total_size(), host.tree.num_checkpoints()) == (10, 1)
    assert load_and_check(tree, host, x) == 10
    tree.dec_lock_ref(tree.match_prefix(x).last_node)
    tree.check_integrity()
    host.check_integrity()


def test_the_host_copies_a_shared_prefix_once_and_nothing_it_already_holds() -> None:
    tree, host = make(kv_tokens=128)
    system = tokens_of(16, 3)
    a, b = system + tokens_of(8, 4), system + tokens_of(12, 5)
    put(tree, a)
    put(tree, b)
    tree.evict(1000)
    assert host.num_saved_tokens == 16 + 8 + 12 and host.tree.num_checkpoints() == 2
    # a hit loaded back and evicted again copies nothing: the host kept its copy (inclusive)
    hit = host.match(a)
    kv = tree.kv_pool.alloc(len(a))
    slot = int(tree.state_pool.alloc(1, zero=False)[0])
    host.load(hit, 0, kv, slot)
    host.unlock(hit)
    tree.insert(a, kv, [(len(a), slot)])
    tree.evict(1000)
    assert host.num_saved_tokens == 36 and host.num_saved_checkpoints == 2
    assert load_and_check(tree, host, a) == len(a) and load_and_check(tree, host, b) == len(b)
    host.check_integrity()


def test_what_is_not_evicted_for_room_is_not_kept() -> None:
    """A checkpoint its caller supersedes (``evict_checkpoint``), garbage (a tombstone leaf), a
    reset: none reaches the host."""
    tree, host = make()
    x = tokens_of(12, 6)
    put(tree, x)
    tree.evict_checkpoint(tree.match_prefix(x).last_node)  # an unlocked leaf: gone with its KV
    put(tree, x, ckpt=False)  # KV only: a tombstone leaf, given back when its last lock goes
    node = tree.match_prefix(x).kv_only_node
    tree.inc_lock_ref(node)
    tree.dec_lock_ref(node)
    assert tree.total_size() == 0 and tree.num_garbage_tokens == 12
    put(tree, x)
    tree.reset()
    assert host.tree.total_size() == 0 and host.num_saved_tokens == 0 and host.num_unsaved == 0


def test_a_full_host_evicts_its_least_recent_never_a_locked_hit() -> None:
    tree, host = make(kv_tokens=64, host_tokens=40, host_slots=2)
    xs = [tokens_of(16, 10 + i) for i in range(4)]
    put(tree, xs[0])
    tree.evict(16)
    hit = host.match(xs[0])  # locked: the host must keep it
    for x in xs[1:]:
        put(tree, x)
        tree.evict(16)
        host.check_integrity()
    assert host.tree.match_prefix(xs[0]).prefix_len == 16  # kept, locked
    assert host.num_unsaved == 0  # each newer prefix pushed out the least recent unlocked one
    # a prefix the host cannot make room for (the locked hit stays) is not kept, and costs nothing else
    big = tokens_of(32, 20)
    put(tree, big)
    tree.evict(1000)
    assert host.num_unsaved == 1
    host.unlock(hit)
    assert [load_and_check(tree, host, x) for x in xs] == [16, 0, 0, 16]
    host.check_integrity()


def test_namespaces_stay_apart_in_the_host() -> None:
    tree, host = make()
    x = tokens_of(10, 7)
    put(tree, x, namespace="tenant-a")
    tree.evict(10)
    assert load_and_check(tree, host, x, namespace="tenant-b") == 0
    assert load_and_check(tree, host, x, namespace="tenant-a") == 10


def test_a_kv_only_tree_keeps_its_evicted_leaves() -> None:
    tree, host = make(states=False)
    x = tokens_of(24, 8)
    put(tree, x[:8])
    put(tree, x)
    tree.evict(16)  # the leaf past 8
    assert host.tree.total_size() == 24  # its path, from the root
    assert load_and_check(tree, host, x) == 24
    host.check_integrity()


@pytest.mark.parametrize("page_size, states, host_tokens, defer", [
    (1, True, 256, False), (4, True, 256, False), (4, False, 256, False),
    # saves in flight until a load reads their rows (the host reuses rows of saves in flight meanwhile)
    (1, True, 256, True), (4, True, 256, True), (4, False, 256, True)])
def test_random_workload_every_host_hit_restores_exact_data(page_size: int, states: bool, host_tokens: int,
                                                            defer: bool) -> None:
    """Chats of shared prefixes on a device pool of a few requests' size: every prefix the host
    serves loads back the exact rows and state of its own tokens, and both trees stay consistent."""
    rng = random.Random(page_size * 10 + states)
    tree, host = make(page_size=page_size, kv_tokens=96, slots=6, host_tokens=host_tokens, host_slots=12,
                      states=states, defer=defer)
    systems = [tokens_of(4 * page_size, 100 + i) for i in range(3)]
    sessions = [systems[i % 3] + tokens_of(2 * page_size, 200 + i) for i in range(8)]
    hits = in_flight = 0
    for _ in range(120):
        i = rng.randrange(len(sessions))
        ns = i % 2
        if rng.random() < 0.4:
            hits += load_and_check(tree, host, sessions[i], ns) > 0
        else:
            grow = page_size * rng.randrange(1, 4)
            seq = sessions[i] + tokens_of(grow, rng.randrange(10**6))
            if len(seq) <= 80:
                sessions[i] = seq
            put(tree, sessions[i], ns)
        if rng.random() < 0.2 and states:
            tree.evict_state(rng.randrange(1, 3))
        tree.check_integrity()
        host.check_integrity()
        in_flight = max(in_flight, host.num_in_flight)
    assert hits > 10 and host.num_saved_tokens > 0 and host.tree.num_nodes() > 3
    assert (in_flight > 3) == defer


def test_pools_of_another_layout_or_tier_are_refused() -> None:
    tree, _ = make()
    kv, sp = pools(64, 8, 1, True)
    other_kv = KVPool(64, 1, 2, 1, 4, torch.float32)
    with pytest.raises(ValueError, match="another layout"):
        other_kv.copy_from(kv, [1], [1])
    other_sp = StatePool(8, 2, (3, 2), torch.float32, (2, 2, 2), torch.float32)  # no hidden state
    with pytest.raises(ValueError, match="another layout"):
        other_sp.copy_from(sp, [1], [1])
    with pytest.raises(ValueError, match="lower tier"):
        HostCache(tree, kv, sp)  # the tree has one already
    bare = RadixCache(KVPool(64, 4, 2, 1, 2, torch.float32), state_pool=pools(64, 8, 4, True)[1])
    with pytest.raises(ValueError, match="page size"):
        HostCache(bare, kv, sp)
    with pytest.raises(ValueError, match="state pool"):
        HostCache(bare, KVPool(64, 4, 2, 1, 2, torch.float32), None)


def test_the_cache_manager_loads_a_host_hit_only_where_the_device_has_room() -> None:
    """``CacheManager.match``: a prefix only the host holds is loaded into the device tree (and the
    hit ends there); where the device cannot make room for it — its KV held by a running request —
    the device's own hit stands, and neither tier keeps a lock or a slot for the attempt."""
    from hyla.cache import ReqToTokenPool
    from hyla.engine.cache_manager import CacheManager
    from hyla.engine.request import Req
    from hyla.engine.sampling_params import SamplingParams

    tree, host = make(kv_tokens=64, slots=8)
    cache = CacheManager(tree.kv_pool, tree.state_pool, ReqToTokenPool(4, 128), tree, host=host)
    x = tokens_of(40, 30)
    put(tree, x)
    tree.evict(40)
    req = lambda: Req(rid="r", input_ids=x + [1, 2], sampling=SamplingParams(max_new_tokens=1))  # noqa: E731
    assert cache.cached_len(req(), cache.peek(req())) == 40  # what LPM ranks by: the host's hit counts
    assert host.tree.num_nodes() == 1 and not host.tree.protected_size()  # (and ranking changed nothing)
    held = tree.kv_pool.alloc(30)  # a running request's KV: 34 slots free, the prefix needs 40
    hit = cache.match(r := req())
    assert hit.prefix_len == 0 and r.kv_len == 0 and cache.num_host_hit_tokens == 0
    cache.admit(r, hit, 0)  # (admission fails on n=0: drops the match's locks)
    assert not host.tree.protected_size() and tree.kv_pool.available_size() == 34
    tree.kv_pool.free(held)
    hit = cache.match(r := req())
    assert hit.prefix_len == 40 and hit.state_slot is not None
    assert kv_ok(tree.kv_pool, hit.kv_indices, None, x, 0) and state_ok(tree.state_pool, hit.state_slot, None, x)
    assert cache.num_host_hit_tokens == 0  # counted when the request is admitted: it may not be
    assert cache.admit(r, hit, 2) is not None and cache.num_host_hit_tokens == 40
    cache.release(r, insert=False)
    cache.check_integrity()
    assert cache.flush() == (40, 1) and host.tree.total_size() == 0  # flushing empties both tiers


def test_usable_len_is_match_prefix_without_its_side_effects() -> None:
    for states in (True, False):
        tree, _ = make(states=states)
        x = tokens_of(24, 40)
        put(tree, x[:8])
        put(tree, x)
        nodes, probe = tree.num_nodes(), x[:20] + [99]
        assert tree.usable_len(probe) == (8 if states else 20) and tree.num_nodes() == nodes  # no split
        assert tree.usable_len(probe) == tree.match_prefix(probe).prefix_len
        assert tree.usable_len(x, namespace="other") == 0 and tree.usable_len(x) == 24


def test_a_failed_copy_between_the_tiers_leaks_nothing_and_the_eviction_goes_on(monkeypatch) -> None:
    """A save whose copy raises (a device out of memory) keeps nothing and frees what it took; the
    device's eviction finishes; a load whose copy raises leaves the device's own hit."""
    from hyla.cache import ReqToTokenPool
    from hyla.engine.cache_manager import CacheManager
    from hyla.engine.request import Req
    from hyla.engine.sampling_params import SamplingParams

    tree, host = make()
    x, y = tokens_of(20, 50), tokens_of(20, 51)
    put(tree, x)
    put(tree, y)
    copy_from = KVPool.copy_from

    def failing(self, *a, **k):
        raise RuntimeError("CUDA out of memory (injected)")

    monkeypatch.setattr(KVPool, "copy_from", failing)
    assert tree.evict(40) == 40 and tree.total_size() == 0  # both leaves went, though neither was kept
    assert host.tree.total_size() == 0 and host.kv_pool.available_size() == host.kv_pool.size
    assert host.state_pool.available_size() == host.state_pool.size
    tree.check_integrity()
    host.check_integrity()
    monkeypatch.setattr(KVPool, "copy_from", copy_from)
    put(tree, x)
    tree.evict(20)  # kept this time
    cache = CacheManager(tree.kv_pool, tree.state_pool, ReqToTokenPool(4, 128), tree, host=host)
    monkeypatch.setattr(KVPool, "copy_from", failing)
    free = tree.kv_pool.available_size(), tree.state_pool.available_size()
    r = Req(rid="r", input_ids=x + [1], sampling=SamplingParams(max_new_tokens=1))
    hit = cache.match(r)  # (logged: the request runs on the device's own hit, here none)
    assert hit.prefix_len == 0
    if hit.last_node is not None:
        tree.dec_lock_ref(hit.last_node)
    assert (tree.kv_pool.available_size(), tree.state_pool.available_size()) == free
    assert not host.tree.protected_size() and not tree.protected_size()
    cache.check_integrity()


def test_copies_move_in_blocks_of_rows(monkeypatch) -> None:
    """A prefix's copy moves a block of rows at a time (``transfer.COPY_BLOCK_BYTES``), exact at any block."""
    from hyla.cache import transfer

    monkeypatch.setattr(transfer, "COPY_BLOCK_BYTES", 40)  # a few rows of the test pools' dtype groups
    tree, host = make()
    x = tokens_of(30, 60)
    put(tree, x)
    tree.evict(30)
    assert load_and_check(tree, host, x) == 30


def test_a_deferred_save_lands_before_a_load_reads_its_rows_and_not_before() -> None:
    """Deferred saves (a CUDA device's) leave the host rows as they were until they land; a load
    lands, oldest first, exactly the saves up to the last one that wrote a row it reads — also a
    save into rows the host freed from an earlier save still in flight — and a reset drops them."""
    tree, host = make(kv_tokens=64, host_tokens=32, host_slots=2, defer=True)
    x, y, z = tokens_of(20, 70), tokens_of(12, 71), tokens_of(12, 72)
    put(tree, x)
    tree.evict(20)
    assert host.num_in_flight == 1 and not torch.any(host.kv_pool.k_buffers[0])  # nothing landed
    put(tree, y)
    tree.evict(12)  # the host has room for y beside x: a second save in flight
    put(tree, z)
    tree.evict(12)  # the host evicts x (its least recent) for z: z reuses rows x's save writes
    assert host.num_in_flight == 3 and host.tree.match_prefix(x).prefix_len == 0
    assert host.tree.num_checkpoints() == 2  # x's eviction freed the slot z needed: y keeps its checkpoint
    assert load_and_check(tree, host, y) == 12
    assert host.num_in_flight == 1  # x's and y's saves landed; z's (rows y's load does not read) has not
    assert load_and_check(tree, host, z) == 12 and host.num_in_flight == 0  # over x's rows: z's landed last
    put(tree, x)
    tree.evict(20)
    assert host.num_in_flight == 1
    host.reset()
    assert host.num_in_flight == 0 and host.tree.total_size() == 0
    host.check_integrity()


def test_deferred_saves_hold_bounded_staging_memory(monkeypatch) -> None:
    """Past ``MAX_STAGED_BYTES`` of staged rows a save lands the oldest; what lands stays exact."""
    from hyla.cache import host_cache

    tree, host = make(kv_tokens=64, host_tokens=128, defer=True)
    xs = [tokens_of(10, 80 + i) for i in range(5)]
    put(tree, xs[0])
    tree.evict(10)
    one = host.staged_bytes  # a save of 10 tokens' K and V and a state
    assert host.num_in_flight == 1 and one == 10 * 32 + sum(b[0].numel() * 4 for b in host.state_pool.all_buffers())
    monkeypatch.setattr(host_cache, "MAX_STAGED_BYTES", one + one // 2)
    for x in xs[1:]:
        put(tree, x)
        tree.evict(10)
        assert host.num_in_flight == 1 and host.staged_bytes == one  # the save before it landed
    assert [load_and_check(tree, host, x) for x in xs] == [10] * 5
    monkeypatch.setattr(host_cache, "MAX_STAGED_BYTES", one - 1)  # a save larger than the cap alone: not deferred
    y = tokens_of(12, 99)
    put(tree, y)
    tree.evict(64)
    assert host.num_in_flight == 0 and host.staged_bytes == 0 and load_and_check(tree, host, y) == 12



def test_a_save_too_large_to_defer_lands_the_saves_in_flight_first(monkeypatch) -> None:
    """A save past ``MAX_STAGED_BYTES`` is copied at once; the host evicted an older save still in flight to make
    room for it and gave it that save's rows and state slot: the older save lands first, not later over the new
    one's rows (a later hit loaded stale KV and state)."""
    from hyla.cache import host_cache

    monkeypatch.setattr(host_cache, "MAX_STAGED_BYTES", 1000)  # a: 10 tokens, deferred; b: 30, copied at once
    tree, host = make(kv_tokens=64, slots=8, host_tokens=32, host_slots=1, defer=True)
    a, b = tokens_of(10, 1), tokens_of(30, 2)
    put(tree, a)
    tree.evict(10)
    assert host.num_in_flight == 1
    put(tree, b)
    tree.evict(30)  # the host evicts a (its rows and its one state slot) for b
    assert host.num_in_flight == 0 and host.tree.match_prefix(a).prefix_len == 0
    assert load_and_check(tree, host, b) == 30
    host.check_integrity()

def test_a_checkpoint_only_save_in_flight_lands_before_its_load() -> None:
    """A save that adds only a checkpoint (the host holds its path's KV already) is in flight with no KV rows:
    a load of that prefix lands it for its state slot."""
    tree, host = make(kv_tokens=64, host_tokens=64, host_slots=4, defer=True)
    x = tokens_of(20, 5)
    put(tree, x)
    tree.evict(64)
    host.land()
    put(tree, x[:10])  # a checkpoint at 10, whose KV the host holds
    tree.evict(64)
    assert host.num_in_flight == 1 and host._in_flight[0].kv_rows.size == 0
    assert load_and_check(tree, host, x[:10]) == 10


def test_a_deferred_copy_lands_in_host_memory_only() -> None:
    from hyla.cache.transfer import copy_rows

    a, b = torch.zeros(4, 2), torch.arange(8.0).view(4, 2)
    landing = copy_rows([a], [0, 1], [b], [2, 3], defer=True)
    assert not torch.any(a) and not landing.ready()  # staged, not landed: a host source lands when told
    landing.land()
    assert torch.equal(a[:2], b[2:]) and landing.nbytes == 0
    with pytest.raises(ValueError, match="lands in host memory"):
        copy_rows([torch.zeros(4, 2, device="meta")], [0], [b], [1], defer=True)


def test_a_readmission_from_the_host_tier_is_no_prompt_hit() -> None:
    """``num_host_hit_tokens`` counts prompt tokens the tier added at a request's first admission, as
    ``num_cached_tokens`` does: a retracted request loaded back from the host on re-admission counts
    in neither (else the host's hits could exceed every cached prompt token)."""
    from hyla.cache import ReqToTokenPool
    from hyla.engine.cache_manager import CacheManager
    from hyla.engine.request import Req
    from hyla.engine.sampling_params import SamplingParams

    tree, host = make(kv_tokens=64, slots=8)
    cache = CacheManager(tree.kv_pool, tree.state_pool, ReqToTokenPool(4, 128), tree, host=host)
    x = tokens_of(40, 31)
    put(tree, x)
    tree.evict(40)  # saved into the host tier
    again = Req(rid="r", input_ids=x + [1, 2], sampling=SamplingParams(max_new_tokens=1))
    again.admitted_once = True  # a re-admission after a retraction
    hit = cache.match(again)
    assert hit.prefix_len == 40 and cache.admit(again, hit, 2) is not None
    assert cache.num_host_hit_tokens == 0
    cache.release(again, insert=False)
    tree.evict(40)
    first = Req(rid="s", input_ids=x + [3, 4], sampling=SamplingParams(max_new_tokens=1))
    hit = cache.match(first)
    assert hit.prefix_len == 40 and cache.admit(first, hit, 2) is not None
    assert cache.num_host_hit_tokens == 40  # a first admission's load counts
    cache.release(first, insert=False)
    cache.check_integrity()
