"""Cache policies of the simulator: an admission rule (which checkpoints to store) + an eviction rule.

| policy    | admission (checkpoint positions)                                  | eviction |
|-----------|-------------------------------------------------------------------|----------|
| `block`   | every multiple of 32 tokens; only whole 32-token blocks cached    | LRU over leaves, a leaf's KV and checkpoint together (vLLM-like) |
| `lru`     | the branch point + after the last fed token (Marconi's admission) | LRU over checkpoints: the cache's own ``LRUPolicy(replaceable_first=False)`` (SGLang-like) |
| `marconi` | the same                                                          | Marconi's FLOP-aware utility, α tuned once by replay |
| `hyla`    | the engine's: branch point, prompt end − 1, message boundaries, after the last fed token | superseded checkpoints first, then FLOPs saved per byte-age with α adapted online |

"After the last fed token": a finished request holds KV and state for its prompt and its output
except the last sampled token (never fed) — exactly what the next turn of a chat starts with.

Eviction frees one unit at a time (``SimPolicy.evict_one``) through the tree's public API:
``evict_state(1)`` takes the checkpoint of lowest priority (an unlocked leaf goes with its KV and
the tombstone edges above it; an internal node becomes a tombstone) and ``evict(1)`` deletes the
KV leaf of lowest priority (vLLM-like blocks, and KV left without any checkpoint). Policies whose
ranking depends on time or on other nodes (``VictimEviction``: marconi, hyla) pick their victim when
memory is needed and hand it to the tree's heap at priority -inf; every other checkpoint waits at
+inf.

Speculative checkpoints (``Admission.optional``) follow the tree's rule, shared with the engine:
they are inserted as ``Checkpoint(..., speculative=True)`` and go only into free memory or in place
of *replaceable* checkpoints (``TreeNode.replaceable``: speculative ones that have served no hit,
and superseded ones) — ``evict_one(tree, for_speculative=True)``, which ends in the tree's
``evict_state(1, for_speculative=True)``. They never push out a checkpoint that has served a hit
or ends a finished turn; where they do not all fit even so, the deepest that fit are stored
(``Simulator._admit``).
"""

from __future__ import annotations

import abc
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from hyla.cache import EvictionPolicy, LRUPolicy, RadixCache, TreeNode
from hyla.sim.models import CostModel
from hyla.sim.trace import TraceRequest

BLOCK_SIZE = 32

Stage = tuple[int, tuple[int, ...], frozenset[int]]
"""One insert of a request: (length, checkpoint positions, those of them stored as speculative)."""


# ---- admission ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Admission:
    """What one request caches: its prompt (``prompt_len`` tokens, checkpoints at the given
    lengths) after prefill, then ``final_len`` tokens of prompt + output at its finish.

    ``optional`` checkpoints (a subset of ``prompt_checkpoints``) are speculative: they go only
    into free memory or in place of replaceable checkpoints (speculative or superseded ones).
    """

    prompt_len: int
    prompt_checkpoints: tuple[int, ...]
    final_len: int
    final_checkpoints: tuple[int, ...]
    optional: frozenset[int] = frozenset()

    def stages(self) -> list[Stage]:
        """The two inserts, ``(length, checkpoint positions, speculative positions)``: the prompt with
        its speculative checkpoints marked so, then the finished sequence, whose checkpoint is never
        speculative (it ends a finished turn: the engine confirms it at the finish,
        ``RadixCache.confirm_checkpoint``, even where a speculative one sits at the same position)."""
        return [(self.prompt_len, self.prompt_checkpoints, self.optional),
                (self.final_len, self.final_checkpoints, frozenset())]

    @property
    def num_required(self) -> int:
        return len(self.prompt_checkpoints) + len(self.final_checkpoints) - len(self.optional)

    def keeping_optional(self, keep: Iterable[int]) -> "Admission":
        """This admission with only the speculative checkpoints in ``keep`` (the others dropped)."""
        kept = self.optional & frozenset(keep)
        prompt = tuple(p for p in self.prompt_checkpoints if p not in self.optional or p in kept)
        return Admission(self.prompt_len, prompt, self.final_len, self.final_checkpoints, kept)

    def without_optional(self) -> "Admission":
        return self.keeping_optional(())


def fed_len(req: TraceRequest) -> int:
    """Tokens whose KV and state exist when the request finishes (the last sampled one is never fed)."""
    return req.num_input_tokens + max(req.num_output_tokens - 1, 0)


def block_admission(req: TraceRequest, hit: int, branch: int | None, block: int = BLOCK_SIZE) -> Admission:
    """vLLM-like: whole blocks only, a checkpoint at every block boundary past the hit."""
    prompt_len = req.num_input_tokens // block * block
    final_len = fed_len(req) // block * block
    return Admission(
        prompt_len, tuple(range(hit + block, prompt_len + 1, block)),
        final_len, tuple(range(max(hit, prompt_len) + block, final_len + 1, block)),
    )


def marconi_admission(req: TraceRequest, hit: int, branch: int | None) -> Admission:
    """Marconi / SGLang-like: at most two checkpoints per request — where a dry-run insert of the
    prompt branches off the tree, and after the last fed token."""
    n = req.num_input_tokens
    prompt = (branch,) if branch is not None and hit < branch <= n else ()
    return Admission(n, prompt, fed_len(req), (fed_len(req),))


def hyla_admission(req: TraceRequest, hit: int, branch: int | None) -> Admission:
    """The engine's admission, at exact positions: the branch point, the end of the prompt minus one
    (an identical prompt then hits all but the token it must compute), the caller's message
    boundaries, and after the last fed token. The prompt-end and boundary checkpoints are
    speculative (``optional``): stored only into free memory or in place of replaceable ones."""
    n = req.num_input_tokens
    final = fed_len(req)
    required = {branch} if branch is not None and hit < branch <= n else set()
    speculative = {p for p in (n - 1, *req.boundaries) if hit < p <= n} - required
    return Admission(n, tuple(sorted(required | speculative)), final, (final,), frozenset(speculative))


# ---- eviction ----------------------------------------------------------------------------------
def nearest_checkpoint_depth(node: TreeNode) -> int:
    """Depth of the deepest proper ancestor of ``node`` holding a checkpoint (0: the root)."""
    p = node.parent
    while p is not None and p.parent is not None and p.state is None:
        p = p.parent
    return p.depth if p is not None else 0


def freed_bytes(model: CostModel, node: TreeNode) -> int:
    """Bytes evicting ``node``'s checkpoint gives back: the slot, and for an unlocked leaf its edge
    plus the tombstone edges above it that become garbage with it."""
    freed = model.state_bytes_per_slot
    if node.children or node.lock_ref:
        return freed
    tokens, p = node.num_tokens, node.parent
    while p.parent is not None and p.state is None and p.num_children == 1 and not p.lock_ref:
        tokens += p.num_tokens
        p = p.parent
    return freed + tokens * model.kv_bytes_per_token


def flops_per_byte(model: CostModel, node: TreeNode) -> float:
    """FLOPs the checkpoint at ``node`` saves (prefilling from the nearest checkpoint above it) per
    byte its eviction frees."""
    anc = nearest_checkpoint_depth(node)
    return model.prefill_flops(node.depth - anc, anc) / freed_bytes(model, node)


class VictimEviction(EvictionPolicy):
    """Base of policies that pick the victim checkpoint themselves, at eviction time.

    ``choose`` returns the checkpoint to evict among the candidates it is given (unlocked
    checkpoints, or only replaceable ones); ``SimPolicy.evict_one`` marks it (``victim``) and
    re-queues it with the tree's ``refresh_priority``, so it is the only entry of the tree's
    checkpoint orders below +inf. KV leaves (in practice only garbage left without any checkpoint)
    go in LRU order.
    """

    structural = False
    replaceable_first = False  # ``choose`` picks the victim (HylaEviction puts superseded ones first itself)

    def __init__(self, model: CostModel, alpha: float) -> None:
        self.model = model
        self.alpha = alpha
        self.victim: int | None = None

    @abc.abstractmethod
    def choose(self, nodes: list[TreeNode], now: float) -> TreeNode | None:
        """The checkpoint to evict next among ``nodes`` (unlocked nodes holding one), or None."""

    def kv_priority(self, node: TreeNode) -> float:
        return node.last_access

    def state_priority(self, node: TreeNode) -> float:
        return -math.inf if node.id == self.victim else math.inf


def _normalize(values: list[float]) -> list[float]:
    """Marconi's min-max normalisation (all ones when the values are all equal)."""
    lo, hi = min(values), max(values)
    if hi == lo:
        return [1.0] * len(values)
    return [(v - lo) / (hi - lo) for v in values]


class MarconiEviction(VictimEviction):
    """Marconi's FLOP-aware eviction over the checkpoints of nodes with at most one child.

    ``utility = α · norm(FLOPs saved per byte) + norm(1 / (now - last use))``, min-max normalised
    over the current candidates; the lowest utility goes. Nodes with two or more children are never
    candidates. (Marconi's tree has no tombstones, so "saved relative to the parent" is, here,
    relative to the nearest checkpointed ancestor.)
    """

    def choose(self, nodes: list[TreeNode], now: float) -> TreeNode | None:
        nodes = [n for n in nodes if n.num_children <= 1]
        if not nodes:
            return None
        eff = _normalize([flops_per_byte(self.model, n) for n in nodes])
        rec = _normalize([1.0 / max(now - n.state_access, 1e-9) for n in nodes])
        utility = [self.alpha * e + r for e, r in zip(eff, rec)]
        return nodes[min(range(len(nodes)), key=utility.__getitem__)]


class HylaEviction(VictimEviction):
    """hyla's eviction: superseded checkpoints first, then the fewest FLOPs saved per byte-age.

    * A checkpoint is *superseded* (``TreeNode.superseded``, the tree's rule) when its node has
      exactly one child and a deeper checkpoint lies on that single-child path: every request that
      continues past it uses the deeper one, so it only serves a request that branches off before
      the deeper one. Superseded checkpoints go first, least recently used first.
    * Otherwise the victim maximises ``age / u**α``: ``age`` = clock ticks since the checkpoint was
      last used (or stored), ``u`` = ``flops_per_byte``. ``α = 0`` is plain LRU; larger α keeps
      long, FLOP-dense prefixes longer than short ones.
    """

    def choose(self, nodes: list[TreeNode], now: float) -> TreeNode | None:
        best, best_key = None, (-1, 0.0)
        for n in nodes:
            age = max(now - n.state_access, 1.0)
            if n.superseded:
                key = (1, age)
            else:
                key = (0, age / flops_per_byte(self.model, n) ** self.alpha if self.alpha else age)
            if key > best_key:
                best, best_key = n, key
        return best


# ---- policies ----------------------------------------------------------------------------------
class SimPolicy:
    """One run's policy: its admission rule, the ``EvictionPolicy`` ordering the tree's heaps, and
    how to free one unit of memory. ``attach`` hands it the tree's logical clock (ages are in its
    ticks)."""

    name = "base"
    kv_first = False  # block: evict KV leaves (with their checkpoints) rather than checkpoints

    def __init__(self, model: CostModel, admission: Callable[..., Admission], eviction: EvictionPolicy) -> None:
        self.model = model
        self.admission_rule = admission
        self.eviction = eviction
        self.clock: Any = None

    def attach(self, clock: Any) -> None:
        self.clock = clock

    def admission(self, req: TraceRequest, hit: int, branch: int | None) -> Admission:
        return self.admission_rule(req, hit, branch)

    def on_request(self, req: TraceRequest, hit: int) -> None:
        """Called once per request, right after its match."""

    def evict_one(self, tree: RadixCache, for_speculative: bool = False) -> bool:
        """Free one unit (a checkpoint, or a KV leaf); False when nothing is left to evict. With
        ``for_speculative``, only a replaceable checkpoint: room for speculative checkpoints."""
        if isinstance(self.eviction, VictimEviction):
            nodes = [n for n in tree.nodes()
                     if n.state is not None and not n.state_lock and (n.replaceable or not for_speculative)]
            victim = self.eviction.choose(nodes, self.clock.now)
            if victim is not None:
                self.eviction.victim = victim.id
                tree.refresh_priority(victim)
                freed = tree.evict_state(1, for_speculative=for_speculative)
                self.eviction.victim = None
                if freed:
                    return True
            return not for_speculative and tree.evict(1) > 0
        if for_speculative:
            return tree.evict_state(1, for_speculative=True) > 0
        if self.kv_first:
            return tree.evict(1) > 0 or tree.evict_state(1) > 0
        return tree.evict_state(1) > 0 or tree.evict(1) > 0

    def info(self) -> dict[str, Any]:
        return {}


class BlockPolicy(SimPolicy):
    name = "block"
    kv_first = True

    def __init__(self, model: CostModel) -> None:
        super().__init__(model, block_admission, LRUPolicy(replaceable_first=False))


class LRUSimPolicy(SimPolicy):
    name = "lru"

    def __init__(self, model: CostModel) -> None:
        super().__init__(model, marconi_admission, LRUPolicy(replaceable_first=False))


MARCONI_ALPHAS = (0.0, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0)
BOOTSTRAP_MULTIPLIER = 5  # Marconi tunes on 5x the requests seen before the first eviction


class MarconiPolicy(SimPolicy):
    """Marconi: its admission and eviction, α tuned once by replay as published.

    α starts at 0 (pure recency). At the first eviction the policy notes how many requests it has
    seen (``n0``); once it has seen ``5 · n0`` it replays them from an empty cache once per α in
    ``MARCONI_ALPHAS`` and keeps the α with the best token hit rate for the rest of the run.
    """

    name = "marconi"

    def __init__(self, model: CostModel, cache_bytes: int, alpha: float = 0.0, tune: bool = True) -> None:
        super().__init__(model, marconi_admission, MarconiEviction(model, alpha))
        self.cache_bytes = cache_bytes
        self.tune = tune
        self.history: list[TraceRequest] = []
        self.first_eviction_at: int | None = None
        self.tuned = False

    def on_request(self, req: TraceRequest, hit: int) -> None:
        if not self.tune or self.tuned:
            return
        self.history.append(req)
        if self.first_eviction_at and len(self.history) >= BOOTSTRAP_MULTIPLIER * self.first_eviction_at:
            self._tune()

    def _tune(self) -> None:
        from hyla.sim.simulator import SimConfig, simulate  # the replays are simulations themselves

        rates = [
            simulate(self.history, SimConfig(self.model, "marconi", self.cache_bytes,
                                             policy_options=(("alpha", a), ("tune", False)))).token_hit_rate
            for a in MARCONI_ALPHAS
        ]
        self.eviction.alpha = MARCONI_ALPHAS[max(range(len(rates)), key=lambda k: (rates[k], -k))]
        self.tuned = True
        self.history = []

    def evict_one(self, tree: RadixCache, for_speculative: bool = False) -> bool:
        if self.first_eviction_at is None:
            self.first_eviction_at = max(1, len(self.history))
        return super().evict_one(tree, for_speculative)

    def info(self) -> dict[str, Any]:
        return {"alpha": self.eviction.alpha, "tuned": self.tuned}


HYLA_ALPHAS = (0.0, 1.0, 2.0, 4.0, 8.0, 16.0)
HYLA_DECAY = 0.995  # per request: ghost scores weigh roughly the last 200 requests


class HylaPolicy(SimPolicy):
    """hyla: the engine's admission and ``HylaEviction`` with α adapted online.

    With ``alpha=None`` (the default) the policy runs one *ghost* cache per α in ``arms`` — a whole
    simulator with the same admission, budget and requests and that fixed α — and before each
    request switches its own α to the ghost with the most tokens hit over the recent past
    (exponentially decayed, ties to the smaller α). ``α = 0`` (LRU order, superseded first) is an
    arm, so the policy follows LRU wherever FLOP awareness does not pay. A fixed ``alpha`` runs no
    ghosts.
    """

    name = "hyla"

    def __init__(self, model: CostModel, cache_bytes: int, alpha: float | None = None,
                 arms: tuple[float, ...] = HYLA_ALPHAS, decay: float = HYLA_DECAY,
                 max_tokens: int | None = None) -> None:
        if alpha is None and (not arms or any(a < 0 for a in arms)):
            raise ValueError(f"hyla needs at least one arm and non-negative alphas, got {arms}")
        super().__init__(model, hyla_admission, HylaEviction(model, arms[0] if alpha is None else alpha))
        self.cache_bytes = cache_bytes
        self.max_tokens = max_tokens  # the run's bound on its pools (``SimConfig.max_tokens``), the ghosts' too
        self.arms = arms if alpha is None else ()
        self.decay = decay
        self.ghosts: list[Any] = []
        self.scores = [0.0] * len(self.arms)

    def attach(self, clock: Any) -> None:
        super().attach(clock)
        from hyla.sim.simulator import SimConfig, Simulator  # the ghosts are simulators themselves

        self.ghosts = [Simulator(SimConfig(self.model, "hyla", self.cache_bytes, policy_options=(("alpha", a),),
                                           max_tokens=self.max_tokens))
                       for a in self.arms]

    def on_request(self, req: TraceRequest, hit: int) -> None:
        if not self.ghosts:
            return
        for k, ghost in enumerate(self.ghosts):
            self.scores[k] = self.decay * self.scores[k] + ghost.serve(req).cached_tokens
        best = max(range(len(self.arms)), key=lambda k: (self.scores[k], -k))
        self.eviction.alpha = self.arms[best]

    def info(self) -> dict[str, Any]:
        return {"alpha": self.eviction.alpha, "adaptive": bool(self.arms)}


POLICIES: dict[str, type[SimPolicy]] = {
    "block": BlockPolicy,
    "lru": LRUSimPolicy,
    "marconi": MarconiPolicy,
    "hyla": HylaPolicy,
}


def make_policy(name: str, model: CostModel, cache_bytes: int, max_tokens: int | None = None,
                **options: Any) -> SimPolicy:
    """Policy ``name`` for a run of ``cache_bytes`` whose pools hold at most ``max_tokens`` ids
    (``SimConfig.max_tokens``: hyla's ghost caches are bounded alike); ``options``: the policy's own."""
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; choose from {', '.join(POLICIES)}")
    cls = POLICIES[name]
    if cls in (MarconiPolicy, HylaPolicy):
        options["cache_bytes"] = cache_bytes
    if cls is HylaPolicy:
        options["max_tokens"] = max_tokens
    try:
        return cls(model, **options)
    except TypeError as e:
        raise ValueError(f"bad options for policy {name!r}: {e}") from None
