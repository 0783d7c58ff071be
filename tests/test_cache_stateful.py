"""Random interleavings of the engine's cache flow, checked after every step (hypothesis stateful).

The pools hold real (tiny) tensors used as fingerprints: each KV slot stores (token, position,
namespace) of the token it holds, each state slot stores (hash of the prefix, its length) of the
state it holds. Requests follow the engine's flow: match → lock → copy the hit's checkpoint into
an own slot → allocate the miss → "prefill" (write fingerprints) → insert with forked checkpoints
→ take the tree's canonical slots and move the lock → finish (insert the live state, unlock, free
the own slot and private tail) or abort. Interleaved with lookups, held KV/state locks, dry-run
branch points, both evictions, and the eviction that makes room for speculative checkpoints (which
may take only speculative or superseded ones). With a host tier (``HostCache``), every eviction
saves into it and a request's match first loads a longer host hit into the device tree, as the
engine's cache manager does. After every step, in both tiers:

* every KV page and every state slot is free xor owned exactly once (tree, or one request);
* lock counts are never negative, evictable + protected = total (``check_integrity``);
* every KV slot a match returns or the tree or a request holds has the fingerprint of the token
  and position it claims, and every checkpoint the fingerprint of exactly its prefix.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from hyla.cache import Checkpoint, HostCache, KVPool, RadixCache, StatePool, TreeNode

BASES = [[(i * 7 + b * 3) % 5 for i in range(96)] for b in range(3)]  # shared prefixes
NAMESPACES = {None: 0.0, "lora": 1.0}
MOD = 1_000_003


def prefix_hash(namespace, tokens) -> float:
    """Fingerprint of the recurrent state after ``tokens`` (0 for the empty prefix: the zero state)."""
    if not tokens:
        return 0.0
    h = 17 + int(NAMESPACES[namespace])
    for t in tokens:
        h = (h * 31 + t + 1) % MOD
    return float(h)


@dataclass
class Req:
    tokens: list[int]
    namespace: str | None
    kv: list[int]  # KV slot of every token
    protected_len: int  # kv[:protected_len] are the tree's (locked through `node`), the rest ours
    node: TreeNode
    slot: int | None  # own state slot (hybrid)
    branch: int | None = None  # the tree's branch point at admission: where the engine wants a checkpoint


fresh_prompts = st.tuples(  # (token ids, namespace): a cut of a shared base plus a random tail
    st.builds(lambda base, cut, tail: (BASES[base][:cut] + tail) or [4],
              st.integers(0, 2), st.integers(0, 80), st.lists(st.integers(0, 4), max_size=24)),
    st.sampled_from([None, "lora"]),
)
tails = st.lists(st.integers(0, 4), max_size=20)


class CacheMachine(RuleBasedStateMachine):
    @initialize(page_size=st.sampled_from([1, 16]), hybrid=st.booleans(), host=st.booleans())
    def setup(self, page_size: int, hybrid: bool, host: bool) -> None:
        self.ps = page_size
        self.hybrid = hybrid
        # (with a host tier, a device pool of a few prompts: evictions, and hits back from the host, are frequent)
        self.kv_pool, self.state_pool = self.pools((96 if host else 256) if page_size == 1 else (8 if host else 24) * 16,
                                                   6 if host else 10)
        self.cache: RadixCache = RadixCache(self.kv_pool, state_pool=self.state_pool)
        # the host tier: evictions save into it, ``start`` loads a longer hit from it (the engine's flow)
        self.host = HostCache(self.cache, *self.pools(192 if page_size == 1 else 12 * 16, 6)) if host else None
        self.reqs: list[Req] = []
        self.seen: list[tuple[list[int], str | None]] = []  # recent prompts: repeats and next turns
        self.held: list[tuple[TreeNode, bool]] = []  # extra locks from lookups: (node, state lock too)

    def pools(self, num_tokens: int, num_slots: int) -> tuple[KVPool, StatePool | None]:
        kv = KVPool(num_tokens, self.ps, 1, 1, 3, torch.float64)
        return kv, StatePool(num_slots, 1, (1, 1), torch.float64, (2,), torch.float64) if self.hybrid else None

    # ------------------------------------------------------------------------------------------
    # fingerprints
    # ------------------------------------------------------------------------------------------
    def write_kv(self, slots: list[int], tokens: list[int], start: int, namespace) -> None:
        buf = self.kv_pool.k_buffers[0]
        for i, s in enumerate(slots):
            buf[s, 0] = torch.tensor([tokens[start + i], start + i, NAMESPACES[namespace]], dtype=torch.float64)

    def check_kv(self, slots, tokens: list[int], namespace, kv_pool: KVPool | None = None) -> None:
        if len(slots) == 0:
            return
        got = (kv_pool or self.kv_pool).k_buffers[0][torch.as_tensor(slots, dtype=torch.long), 0]  # [n, 3]
        want = torch.tensor([[t, i, NAMESPACES[namespace]] for i, t in enumerate(tokens)], dtype=torch.float64)
        assert torch.equal(got, want), "a KV slot does not hold the token it claims"

    def write_state(self, slot: int, namespace, tokens: list[int]) -> None:
        self.state_pool.ssm_states[0][slot] = torch.tensor([prefix_hash(namespace, tokens), len(tokens)])

    def check_state(self, slot: int, namespace, tokens: list[int], state_pool: StatePool | None = None) -> None:
        got = (state_pool or self.state_pool).ssm_states[0][slot].tolist()
        assert got == [prefix_hash(namespace, tokens), len(tokens)], "a checkpoint holds another prefix's state"

    def check_match(self, res, tokens: list[int], namespace) -> None:
        assert len(res.kv_indices) == res.prefix_len <= res.kv_only_len <= len(tokens)
        assert res.prefix_len % self.ps == 0 and res.last_node.depth == res.prefix_len
        assert res.kv_only_node.depth == res.kv_only_len
        self.check_kv(res.kv_only_indices, tokens[: res.kv_only_len], namespace)
        if self.hybrid and res.prefix_len:
            self.check_state(res.state_slot, namespace, tokens[: res.prefix_len])
        else:
            assert res.state_slot is None

    # ------------------------------------------------------------------------------------------
    # memory
    # ------------------------------------------------------------------------------------------
    def ensure_kv(self, tokens: int) -> bool:
        short = tokens - self.kv_pool.available_size()
        if short > 0:
            self.cache.evict(short)
        return self.kv_pool.available_size() >= tokens

    def ensure_states(self, n: int) -> bool:
        short = n - self.state_pool.available_size()
        if short > 0:
            self.cache.evict_state(short)
        return self.state_pool.available_size() >= n

    def draw_prompt(self, data) -> tuple[list[int], str | None]:
        """A fresh prompt, or a seen one repeated, cut, or extended (a chat's next turn)."""
        if not self.seen or data.draw(st.booleans()):
            return data.draw(fresh_prompts)
        tokens, ns = data.draw(st.sampled_from(self.seen))
        cut = data.draw(st.one_of(st.just(len(tokens)), st.integers(0, len(tokens))))
        return (tokens[:cut] + data.draw(tails)) or [4], ns

    # ------------------------------------------------------------------------------------------
    # the engine's flow
    # ------------------------------------------------------------------------------------------
    def load_from_host(self, tokens: list[int], ns) -> None:
        """``CacheManager._load_from_host``: where the host holds a longer usable prefix than the
        device, copy what the device lacks into fresh device slots and insert them."""
        cache, host = self.cache, self.host
        res = cache.match_prefix(tokens, namespace=ns)
        hit = host.match(tokens, ns)
        if hit is None:
            return
        end = hit.prefix_len
        start = min(res.kv_only_len, end)
        if end > res.prefix_len:
            device_kv = res.kv_only_indices[:start]
            cache.inc_lock_ref(res.kv_only_node)
            if self.ensure_kv(end - start) and (not self.hybrid or self.ensure_states(1)):
                kv = self.kv_pool.alloc(end - start) if end > start else torch.zeros(0, dtype=torch.long)
                slot = int(self.state_pool.alloc(1, zero=False)[0]) if self.hybrid else None
                host.load(hit, start, kv, slot)
                cache.insert(tokens[:end], torch.cat([device_kv, kv]), [(end, slot)] if self.hybrid else [],
                             namespace=ns)
                assert cache.match_prefix(tokens, namespace=ns).prefix_len == end
            cache.dec_lock_ref(res.kv_only_node)
        host.unlock(hit)

    @rule(data=st.data())
    def start(self, data) -> None:
        tokens, ns = self.draw_prompt(data)
        self.seen = (self.seen + [(tokens, ns)])[-12:]
        cache = self.cache
        if self.host is not None:
            self.load_from_host(tokens, ns)
        res = cache.match_prefix(tokens, namespace=ns)
        self.check_match(res, tokens, ns)
        p, n = res.prefix_len, len(tokens)
        cache.inc_lock_ref(res.last_node)
        if self.hybrid and p:
            cache.inc_state_lock(res.last_node)  # until the copy below
        ok = self.ensure_kv(self.kv_pool.pages_needed([p], [n - p]) * self.ps)
        ok = ok and (not self.hybrid or self.ensure_states(1))
        slot = None
        if ok and self.hybrid:
            slot = int(self.state_pool.alloc(1))
            if p:
                self.state_pool.copy([res.state_slot], [slot])
            self.check_state(slot, ns, tokens[:p])  # a hit restores exactly the prefix's state
        if self.hybrid and p:
            cache.dec_state_lock(res.last_node)
        if not ok:
            cache.dec_lock_ref(res.last_node)
            return
        last = int(res.kv_indices[-1]) if p else -1
        new = self.kv_pool.alloc_extend([p], [last], [n - p]).tolist()
        self.write_kv(new, tokens, p, ns)  # "prefill"
        if self.hybrid:
            self.write_state(slot, ns, tokens)
        branch = cache.branch_point(tokens, namespace=ns)
        self.reqs.append(Req(tokens, ns, res.kv_indices.tolist() + new, p, res.last_node, slot, branch))

    def insert(self, req: Req, ckpt_lengths: list[int], live_checkpoint: bool, speculative: bool = False) -> None:
        """Insert what ``req`` computed, adopt the tree's canonical slots, move the lock. The
        checkpoints at ``ckpt_lengths`` are ``speculative`` (the live one never is)."""
        ckpts = []
        if self.hybrid:
            wanted = sorted(set(ckpt_lengths) - {len(req.tokens)})
            if live_checkpoint and len(req.tokens) % self.ps == 0:
                wanted.append(len(req.tokens))
            if wanted and self.ensure_states(len(wanted)):
                slots = self.state_pool.alloc(len(wanted)).tolist()
                for length, s in zip(wanted, slots):
                    self.write_state(s, req.namespace, req.tokens[:length])  # a forked state
                ckpts = [Checkpoint(length, s, speculative and length in ckpt_lengths)
                         for length, s in zip(wanted, slots)]
        res = self.cache.insert(req.tokens, torch.tensor(req.kv), ckpts, namespace=req.namespace)
        n = len(req.tokens) - len(req.tokens) % self.ps
        assert res.last_node.depth == n and res.num_existing <= n
        canonical = res.kv_indices.tolist()
        assert canonical == self.cache.match_kv(req.tokens, namespace=req.namespace).tolist()
        self.check_kv(canonical, req.tokens[:n], req.namespace)
        req.kv[:n] = canonical
        self.cache.inc_lock_ref(res.last_node)
        self.cache.dec_lock_ref(req.node)
        req.node, req.protected_len = res.last_node, n

    @precondition(lambda self: self.reqs)
    @rule(data=st.data(), speculative=st.booleans())
    def cache_unfinished(self, data, speculative: bool) -> None:
        req = data.draw(st.sampled_from(self.reqs))
        n = len(req.tokens) - len(req.tokens) % self.ps
        lengths = data.draw(st.lists(st.integers(1, max(1, n // self.ps)), max_size=3)) if n else []
        lengths = [k * self.ps for k in lengths]
        if req.branch and data.draw(st.booleans()):
            lengths.append(req.branch)
        self.insert(req, lengths, live_checkpoint=False, speculative=speculative)

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def finish(self, data) -> None:
        req = self.reqs.pop(data.draw(st.integers(0, len(self.reqs) - 1)))
        self.insert(req, [], live_checkpoint=True)
        self.release(req)

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def abort(self, data) -> None:
        self.release(self.reqs.pop(data.draw(st.integers(0, len(self.reqs) - 1))))

    def release(self, req: Req) -> None:
        self.cache.dec_lock_ref(req.node)
        if req.slot is not None:
            self.state_pool.free([req.slot])
        if len(req.kv) > req.protected_len:
            self.kv_pool.free(req.kv[req.protected_len :])

    # ------------------------------------------------------------------------------------------
    # lookups, extra locks, dry runs, eviction
    # ------------------------------------------------------------------------------------------
    @rule(data=st.data(), hold=st.sampled_from(["nothing", "kv", "kv+state"]))
    def lookup(self, data, hold: str) -> None:
        tokens, ns = self.draw_prompt(data)
        res = self.cache.match_prefix(tokens, namespace=ns)
        self.check_match(res, tokens, ns)
        if hold != "nothing":
            state_lock = hold == "kv+state" and self.hybrid and res.prefix_len > 0
            self.cache.inc_lock_ref(res.last_node)
            if state_lock:
                self.cache.inc_state_lock(res.last_node)
            self.held.append((res.last_node, state_lock))

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def release_held(self, data) -> None:
        node, state_lock = self.held.pop(data.draw(st.integers(0, len(self.held) - 1)))
        if state_lock:
            self.cache.dec_state_lock(node)
        self.cache.dec_lock_ref(node)

    @rule(data=st.data())
    def branch_point(self, data) -> None:
        tokens, ns = self.draw_prompt(data)
        nodes = self.cache.num_nodes()
        bp = self.cache.branch_point(tokens, namespace=ns)
        kv_len = len(self.cache.match_kv(tokens, namespace=ns))
        assert bp is None or (bp == kv_len and bp % self.ps == 0 and bp > 0)
        assert self.cache.num_nodes() == nodes

    @rule(num_tokens=st.integers(0, 200))
    def evict(self, num_tokens: int) -> None:
        freed = self.cache.evict(num_tokens)
        # short only when nothing evictable is left (a state-locked leaf counts but stays)
        assert freed >= num_tokens or self.cache.evictable_size() == 0 or self.held_state_leaves()

    @precondition(lambda self: self.hybrid)
    @rule(num_slots=st.integers(0, 4))
    def evict_state(self, num_slots: int) -> None:
        """Replaceable checkpoints go first: a plain eviction takes another only once none of those
        that were replaceable is left."""
        evictable = self.cache.evictable_checkpoints()
        replaceable = {n.state for n in self.cache.nodes() if n.replaceable and not n.state_lock}
        before = {n.state for n in self.cache.nodes() if n.state is not None}
        freed = self.cache.evict_state(num_slots)
        assert freed == min(num_slots, evictable)
        after = [n for n in self.cache.nodes() if n.state is not None]
        if before - {n.state for n in after} - replaceable:
            assert not any(n.state in replaceable and n.replaceable and not n.state_lock for n in after)

    @rule(data=st.data())
    def touch(self, data) -> None:
        nodes = list(self.cache.nodes())
        if nodes:
            node = data.draw(st.sampled_from(nodes))
            self.cache.touch(node)
            assert node.last_access == node.parent.last_access or node.parent is self.cache.root

    @precondition(lambda self: self.hybrid)
    @rule(data=st.data())
    def confirm_checkpoint(self, data) -> None:
        nodes = list(self.cache.nodes())
        if nodes:
            node = data.draw(st.sampled_from(nodes))
            above = node
            while above is not self.cache.root and above.state is None:
                above = above.parent
            assert self.cache.confirm_checkpoint(node) == above.depth
            assert not above.speculative

    @precondition(lambda self: self.hybrid)
    @rule(data=st.data())
    def evict_checkpoint(self, data) -> None:
        nodes = [n for n in self.cache.nodes() if n.state is not None and not n.state_lock]
        if nodes:
            node = data.draw(st.sampled_from(nodes))
            self.cache.evict_checkpoint(node)
            assert node.state is None

    @precondition(lambda self: self.hybrid)
    @rule(num_slots=st.integers(1, 3))
    def evict_state_for_speculative(self, num_slots: int) -> None:
        """One checkpoint at a time: one is freed iff an unlocked replaceable one exists, and it is one of those."""
        for _ in range(num_slots):
            replaceable = {n.state for n in self.cache.nodes() if n.replaceable and not n.state_lock}
            before = {n.state for n in self.cache.nodes() if n.state is not None}
            freed = self.cache.evict_state(1, for_speculative=True)
            gone = before - {n.state for n in self.cache.nodes() if n.state is not None}
            assert freed == len(gone) == min(1, len(replaceable)) and gone <= replaceable

    def held_state_leaves(self) -> bool:
        """State-locked nodes keep their KV out of eviction although counted evictable."""
        return any(state_lock for _, state_lock in self.held)

    # ------------------------------------------------------------------------------------------
    # invariants
    # ------------------------------------------------------------------------------------------
    def tiers(self) -> list[tuple[RadixCache, KVPool, StatePool | None, list[Req]]]:
        """(tree, KV pool, state pool, requests holding slots of it) of the device and the host tier."""
        tiers = [(self.cache, self.kv_pool, self.state_pool, self.reqs)]
        if self.host is not None:
            tiers.append((self.host.tree, self.host.kv_pool, self.host.state_pool, []))
        return tiers

    @invariant()
    def integrity(self) -> None:
        if not hasattr(self, "cache"):
            return
        for tree, kv_pool, state_pool, _ in self.tiers():
            tree.check_integrity()
            kv_pool.check_integrity()
            assert tree.evictable_size() + tree.protected_size() == tree.total_size()
            if self.hybrid:
                state_pool.check_integrity()
        if self.host is not None:
            assert not self.host.tree.protected_size(), "a host hit still locked after its load"

    @invariant()
    def every_slot_is_free_xor_owned_once(self) -> None:
        if not hasattr(self, "cache"):
            return
        ps = self.ps
        for tree, kv_pool, state_pool, reqs in self.tiers():
            owners = np.zeros(kv_pool.num_pages + 1, dtype=np.int64)
            for node in tree.nodes():
                np.add.at(owners, np.unique(node.value // ps), 1)
            for req in reqs:
                own = np.asarray(req.kv[req.protected_len :], dtype=np.int64)
                np.add.at(owners, np.unique(own // ps), 1)
            allocated = np.zeros_like(owners)
            allocated[kv_pool.allocated_pages()] = 1
            assert np.array_equal(owners, allocated), "a KV page is leaked, shared, or owned while free"
            if self.hybrid:
                held = [n.state for n in tree.nodes() if n.state is not None] + [r.slot for r in reqs]
                assert sorted(held) == state_pool.allocated_slots(), "a state slot is leaked or shared"

    @invariant()
    def every_slot_holds_what_it_claims(self) -> None:
        if not hasattr(self, "cache"):
            return
        for tree, kv_pool, state_pool, reqs in self.tiers():
            stack = [(child, list(child.key), child.child_key[0][0]) for child in tree.root.children.values()]
            while stack:
                node, tokens, ns = stack.pop()  # tokens: the whole path from the root through node
                got = kv_pool.k_buffers[0][torch.from_numpy(node.value.copy()), 0]  # [len, 3]
                want = torch.tensor([[t, node.start + i, NAMESPACES[ns]] for i, t in enumerate(node.key)],
                                    dtype=torch.float64)
                assert torch.equal(got, want), f"tree node {node!r} holds foreign KV"
                if node.state is not None:
                    self.check_state(node.state, ns, tokens, state_pool)
                stack.extend((c, tokens + list(c.key), ns) for c in node.children.values())
            for req in reqs:
                self.check_kv(req.kv, req.tokens, req.namespace)
                if self.hybrid:
                    self.check_state(req.slot, req.namespace, req.tokens)

    def teardown(self) -> None:
        """Release everything: the pools must be full again (nothing leaked)."""
        if not hasattr(self, "cache"):
            return
        while self.reqs:
            self.release(self.reqs.pop())
        while self.held:
            node, state_lock = self.held.pop()
            if state_lock:
                self.cache.dec_state_lock(node)
            self.cache.dec_lock_ref(node)
        self.cache.evict(self.cache.total_size())
        for tree, kv_pool, state_pool, _ in self.tiers():
            tree.evict(tree.total_size())
            assert tree.total_size() == 0 and kv_pool.available_size() == kv_pool.size
            if self.hybrid:
                assert tree.num_checkpoints() == 0 and state_pool.available_size() == state_pool.size


CacheMachine.TestCase.settings = settings(
    max_examples=80, stateful_step_count=50, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestCacheStateful = CacheMachine.TestCase
