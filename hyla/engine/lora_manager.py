"""Which LoRA adapters an engine serves: names, the loads behind them, and which sit in the model's slots.

An adapter is read off the scheduler thread (:func:`hyla.model.lora.read_adapter`), fp32 on the host, and
registered under a *uid*: a number of that one load, never reused. Up to ``max_cpu_loras`` are loaded at once.
A request resolves its adapter's name to the uid when it is made (``Req.lora_uid``), and its prefix cache
namespace gets the adapter's content digest, so requests of different adapters (or of none) never share a
cached prefix, while the same files loaded again, under any name, in any process, do.

The model has ``max_loras`` adapter *slots* (``1..max_loras``: the projections' slots,
:func:`hyla.model.lora.enable_lora_`): how many adapters one batch applies. A request gets its adapter's slot
when it is admitted (:meth:`acquire`, ``Req.lora_slot``): the slot already holding the adapter, else an empty
one, else the least recently used slot whose adapter no running request applies, the adapter written into it
in place (a CUDA graph captured once applies whatever the slots hold). Where every slot holds an adapter a
running request applies, the request waits (``Scheduler``). A running request's slot never changes under it; a
retracted one takes a slot again when it is admitted again.

Ownership and locks. ``Engine`` owns one ``LoRAManager``. Names are read on callers' threads
(:meth:`resolve`) and changed on the scheduler thread; ``lock`` guards them. The slots are written on the
scheduler thread only, between steps (a forward reads them there). Unloading removes the name at once; the
adapter stays while a live request (running or waiting) still applies it (``retiring``), and goes when the
last one ends (:meth:`release`): a request never runs with its adapter gone. Retiring adapters count against
``max_cpu_loras`` until they go. ``Engine`` calls :meth:`unload`, :meth:`publish` and :meth:`release` under
its inbox lock, which its submissions hold too, so a request made before an unload but submitted after it is
refused (:meth:`is_loaded`), never run.
"""

from __future__ import annotations

import itertools
import logging
import threading
from dataclasses import dataclass
from typing import Iterable

from hyla.cache.radix_types import SubNamespace
from hyla.model.lora import LoRAAdapter, check_fits, install_, uninstall_

logger = logging.getLogger("hyla.engine")

MAX_LORA_NAME_CHARS = 256


def check_lora_name(name: object) -> str:
    """A LoRA adapter's name: a non-empty string of printable characters, at most ``MAX_LORA_NAME_CHARS``."""
    if not isinstance(name, str) or not name or not name.isprintable() or len(name) > MAX_LORA_NAME_CHARS:
        raise ValueError(f"a LoRA adapter's name must be a non-empty string of printable characters, at most "
                         f"{MAX_LORA_NAME_CHARS} long, got {name!r:.80}")
    return name


@dataclass(frozen=True)
class Loaded:
    """One load of an adapter: its uid, name and what was read."""

    uid: int
    name: str
    adapter: LoRAAdapter


class LoRAManager:
    def __init__(self, model, max_loras: int, max_cpu_loras: int):
        self.model = model
        self.max_loras, self.max_cpu_loras = max_loras, max_cpu_loras
        self.lock = threading.Lock()
        self._by_name: dict[str, Loaded] = {}
        self._by_uid: dict[int, Loaded] = {}  # loaded, and retiring ones still applied by live requests
        self.retiring: set[int] = set()
        self._uids = itertools.count(1)
        # the scheduler thread's: each slot's adapter (uid; 0 empty), and when it was last acquired
        self._slot_uid = [0] * (max_loras + 1)  # (index 0 unused: slot 0 is the base model's)
        self._slot_used = [0] * (max_loras + 1)
        self._clock = itertools.count(1)
        self.num_slot_loads = 0  # adapters written into a slot (the first time, or again after another took it)

    # --- callers' threads ---------------------------------------------------------------------
    def resolve(self, name: str) -> Loaded:
        """The adapter loaded as ``name``; ``ValueError`` naming the loaded ones otherwise."""
        with self.lock:
            loaded = self._by_name.get(name)
            if loaded is None:
                raise ValueError(f"no LoRA adapter named {name!r} is loaded"
                                 + (f" (loaded: {', '.join(map(repr, self._by_name))})" if self._by_name else ""))
            return loaded

    def is_loaded(self, uid: int) -> bool:
        with self.lock:
            return uid in self._by_uid and uid not in self.retiring

    def names(self, uids: Iterable[int]) -> list[str]:
        """The names the adapters ``uids`` were loaded under (retiring ones' too), sorted, each once."""
        with self.lock:
            return sorted({self._by_uid[uid].name for uid in uids if uid in self._by_uid})

    def adapters(self) -> dict[str, str]:
        """Loaded adapters: name -> path."""
        with self.lock:
            return {name: loaded.adapter.path for name, loaded in self._by_name.items()}

    def check_room(self, name: str, replace: bool = False, live_uids: Iterable[int] | None = None) -> None:
        """``ValueError`` unless ``name`` is free (or ``replace``) and there is room for one more adapter: fewer
        than ``max_cpu_loras`` are loaded (retiring ones included: their live requests still apply them), or the
        one replaced goes at once, no live request (``live_uids``; None: not known yet, assumed none) applying
        it. Checked again when the adapter is published."""
        with self.lock:
            replacing = self._by_name.get(name) if replace else None
            if name in self._by_name and replacing is None:
                raise ValueError(f"a LoRA adapter named {name!r} is already loaded (unload it first)")
            applied = replacing is not None and live_uids is not None and replacing.uid in live_uids
            if len(self._by_uid) < self.max_cpu_loras or (replacing is not None and not applied):
                return
            retiring = len(self.retiring)
            raise ValueError(f"{len(self._by_uid)} LoRA adapters are loaded, max_cpu_loras is {self.max_cpu_loras}"
                             + (f" ({retiring} unloaded but still applied by live requests)" if retiring else "")
                             + (f" and {name!r} is applied by live requests until they finish" if applied else "")
                             + ": unload one first")

    def publish(self, name: str, adapter: LoRAAdapter, live_uids: Iterable[int], replace: bool = False) -> Loaded:
        """Serve ``adapter`` as ``name`` from now on (``ValueError`` where :meth:`check_room` refuses it, or its
        projections take no adapter of its rank); the one it replaces (``replace``), if any, is unloaded as by
        :meth:`unload` (``live_uids``: the live requests'). Its weights go into a slot when a request applying it
        is admitted (:meth:`acquire`). Under the engine's inbox lock."""
        check_fits(self.model, adapter)
        self.check_room(name, replace, live_uids)
        with self.lock:
            old = self._by_name.get(name)
            loaded = Loaded(next(self._uids), name, adapter)
            self._by_name[name] = self._by_uid[loaded.uid] = loaded
            if old is not None:
                self.retiring.add(old.uid)
        if old is not None:
            self.release(old.uid, live_uids)
        logger.info("LoRA adapter %r loaded from %s (rank %d, %d projections)%s", name, adapter.path, adapter.rank,
                    len(adapter.weights), " in place of the one of that name" if old else "")
        return loaded

    def unload(self, name: str, live_uids: Iterable[int]) -> None:
        """Stop serving ``name`` (``ValueError`` if not loaded); it goes now, or when the last of the live
        requests (``live_uids``: theirs) applying it ends (:meth:`release`)."""
        with self.lock:
            loaded = self._by_name.pop(name, None)
            if loaded is None:
                raise ValueError(f"no LoRA adapter named {name!r} is loaded")
            self.retiring.add(loaded.uid)
        self.release(loaded.uid, live_uids)
        logger.info("LoRA adapter %r unloaded", name)

    # --- the scheduler thread ----------------------------------------------------------------
    def release(self, uid: int, live_uids: Iterable[int]) -> None:
        """A request applying ``uid`` ended: a retiring adapter goes once no live request (``live_uids``)
        applies it, from its slot too."""
        if uid not in self.retiring or uid in live_uids:
            return
        with self.lock:
            self._by_uid.pop(uid)
            self.retiring.discard(uid)
        slot = self.slot_of(uid)
        if slot:
            self._empty(slot)

    def slot_for(self, uid: int, pinned: Iterable[int]) -> int | None:
        """The slot :meth:`acquire` would give adapter ``uid``: where it is already, else an empty slot, else the
        least recently used one whose adapter is not ``pinned`` (the running requests' adapters); None when every
        slot holds a pinned adapter. Nothing changes."""
        held = self.slot_of(uid)
        if held:
            return held
        pinned = set(pinned) - {0}
        free = [s for s in range(1, self.max_loras + 1) if self._slot_uid[s] not in pinned]  # (0: empty)
        return min(free, key=lambda s: (self._slot_uid[s] != 0, self._slot_used[s], s)) if free else None

    def slot_uids(self) -> list[int]:
        """The adapters in the slots (uids)."""
        return [uid for uid in self._slot_uid[1:] if uid]

    def acquire(self, uid: int, pinned: Iterable[int]) -> int | None:
        """The slot of adapter ``uid`` for a request being admitted (:meth:`slot_for`), the adapter written into
        it where it is not there yet. None when every slot holds a pinned adapter: the request waits for one."""
        slot = self.slot_for(uid, pinned)
        if slot is None:
            return None
        if self._slot_uid[slot] != uid:
            self._slot_uid[slot] = 0
            with self.lock:
                adapter = self._by_uid[uid].adapter
            try:
                install_(self.model, slot, adapter)
            except BaseException:
                self._empty(slot)  # (written part-way: emptied, to be written whole by the next acquire)
                raise
            self._slot_uid[slot] = uid
            self.num_slot_loads += 1
        self._slot_used[slot] = next(self._clock)
        return slot

    def slot_of(self, uid: int) -> int:
        """The slot holding adapter ``uid`` (0: none)."""
        return self._slot_uid.index(uid) if uid in self._slot_uid else 0

    def _empty(self, slot: int) -> None:
        self._slot_uid[slot] = 0
        uninstall_(self.model, slot)


def lora_namespace(loaded: Loaded | None, namespace: object) -> object:
    """A request's prefix-cache namespace: its own (``namespace``), or with an adapter one of that
    adapter's content (``SubNamespace("lora", digest, namespace)``, a type no caller's namespace is): the
    adapter changes every K/V and state."""
    return namespace if loaded is None else SubNamespace("lora", loaded.adapter.digest, namespace)
