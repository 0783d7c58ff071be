"""Which LoRA adapters an engine serves: names, the loads behind them, and when their weights may go.

An adapter is read off the scheduler thread (:func:`hyla.model.lora.read_adapter`), then written into
the model's projections on it, between steps, in a free *slot* (``1..max_loras``: the projections' adapter
slots, :func:`hyla.model.lora.enable_lora_`), under a *uid*: a number of that one load, never reused. A
request resolves its adapter's name to the uid and slot when it is made (``Req.lora_uid``,
``Req.lora_slot``), and its prefix cache namespace gets the adapter's content digest, so requests of
different adapters (or of none) never share a cached prefix, while the same files loaded again, under
any name, in any process, do.

Ownership and locks. ``Engine`` owns one ``LoRAManager``. Names are read on callers' threads
(:meth:`resolve`) and changed on the scheduler thread; ``lock`` guards them. The weights are
installed and removed on the scheduler thread only (a forward reads them there). Unloading removes
the name at once; the weights stay while a live request still applies them (``retiring``), and go
when the last one ends (:meth:`release`): a request never runs with its adapter gone. Those keep their
slots, and count against ``max_loras``, until they go. ``Engine``
calls :meth:`unload` and :meth:`release` under its inbox lock, which its submissions hold too, so a
request made before an unload but submitted after it is refused (:meth:`is_loaded`), never run.
"""

from __future__ import annotations

import itertools
import logging
import threading
from dataclasses import dataclass
from typing import Iterable

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
    """One load of an adapter: its uid, slot, name and what was read."""

    uid: int
    slot: int
    name: str
    adapter: LoRAAdapter


class LoRAManager:
    def __init__(self, model, max_loras: int):
        self.model = model
        self.max_loras = max_loras
        self.lock = threading.Lock()
        self._by_name: dict[str, Loaded] = {}
        self._by_uid: dict[int, Loaded] = {}  # loaded, and retiring ones still applied by live requests
        self.retiring: set[int] = set()
        self._uids = itertools.count(1)
        self._free_slots = list(range(max_loras, 0, -1))  # (popped from the end: slot 1 first)

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

    def adapters(self) -> dict[str, str]:
        """Loaded adapters: name -> path."""
        with self.lock:
            return {name: loaded.adapter.path for name, loaded in self._by_name.items()}

    def check_room(self, name: str, replace: bool = False) -> None:
        """``ValueError`` where loading ``name`` now would be refused (checked again when it is installed)."""
        with self.lock:
            self._check_room(name, self._by_name.get(name) if replace else None, ())

    # --- the scheduler thread ----------------------------------------------------------------
    def install(self, name: str, adapter: LoRAAdapter, live_uids: Iterable[int], replace: bool = False) -> Loaded:
        """Write ``adapter``'s weights for ``name`` into a free slot (not yet served: :meth:`publish`);
        ``ValueError`` for a name in use (unless ``replace``) or no free slot (``max_loras``). Replacing an adapter
        no live request applies (``live_uids``) with every slot taken writes over its slot: it is served, in that
        slot, until :meth:`publish` (under the engine's inbox lock with this call: no step runs between them), and
        stays where the new one fails to install."""
        check_fits(self.model, adapter)  # (before anything changes)
        with self.lock:
            old = self._by_name.get(name) if replace else None
            self._check_room(name, old, live_uids)
            slot = self._free_slots.pop() if self._free_slots else old.slot  # (_check_room: one of the two)
            loaded = Loaded(next(self._uids), slot, name, adapter)
        try:
            install_(self.model, slot, adapter)
        except BaseException:
            if old is not None and old.slot == slot:
                install_(self.model, slot, old.adapter)  # (the old one back in its slot)
            else:
                uninstall_(self.model, slot)
                with self.lock:
                    self._free_slots.append(slot)
            raise
        return loaded

    def publish(self, loaded: Loaded, live_uids: Iterable[int]) -> None:
        """Serve ``loaded`` under its name from now on; the adapter it replaces (if any) is unloaded, as by
        :meth:`unload` (``live_uids``: the live requests'; under the engine's inbox lock), or, where the new one
        took its slot, gone."""
        with self.lock:
            old = self._by_name.get(loaded.name)
            self._by_name[loaded.name] = loaded
            self._by_uid[loaded.uid] = loaded
            retire = old is not None and old.slot != loaded.slot
            if retire:
                self.retiring.add(old.uid)
            elif old is not None:  # (its slot taken: its weights are overwritten, and no live request read them)
                self._by_uid.pop(old.uid, None)
        if retire:
            self.release(old.uid, live_uids)
        adapter = loaded.adapter
        logger.info("LoRA adapter %r loaded from %s (rank %d, %d projections)%s", loaded.name, adapter.path,
                    adapter.rank, len(adapter.weights), " in place of the one of that name" if old else "")

    def unload(self, name: str, live_uids: Iterable[int]) -> None:
        """Stop serving ``name`` (``ValueError`` if not loaded); its weights go now, or when the last of
        the live requests (``live_uids``: theirs) applying them ends (:meth:`release`)."""
        with self.lock:
            loaded = self._by_name.pop(name, None)
            if loaded is None:
                raise ValueError(f"no LoRA adapter named {name!r} is loaded")
            self.retiring.add(loaded.uid)
        self.release(loaded.uid, live_uids)
        logger.info("LoRA adapter %r unloaded", name)

    def release(self, uid: int, live_uids: Iterable[int]) -> None:
        """A request applying ``uid`` ended: the weights of a retiring adapter go once no live request
        (``live_uids``) applies them."""
        if uid not in self.retiring or uid in live_uids:
            return
        with self.lock:
            loaded = self._by_uid.pop(uid)
            self.retiring.discard(uid)
        uninstall_(self.model, loaded.slot)
        with self.lock:
            self._free_slots.append(loaded.slot)

    def _check_room(self, name: str, replacing: Loaded | None, live_uids: Iterable[int]) -> None:
        """``ValueError`` unless ``name`` is free (or ``replacing`` holds it) and a slot is free: fewer than
        ``max_loras`` adapters are resident (loaded, or unloaded but still applied by running requests: their
        weights are there too), or the one replaced is applied by no live request (``live_uids``)."""
        if name in self._by_name and replacing is None:
            raise ValueError(f"a LoRA adapter named {name!r} is already loaded (unload it first)")
        if self._free_slots or (replacing is not None and replacing.uid not in live_uids):
            return
        retiring = len(self.retiring)
        raise ValueError(f"{len(self._by_uid)} LoRA adapters are resident, max_loras is {self.max_loras}"
                         + (f" ({retiring} unloaded but still applied by running requests)" if retiring else "")
                         + (f" and {name!r} is applied by running requests until they finish" if replacing else "")
                         + ": unload one first")


@dataclass(frozen=True)
class LoRANamespace:
    """The prefix-cache namespace of an adapter's requests: the adapter's content digest and the request's
    own namespace. A type of its own, so that no namespace a caller passes (a tuple, a string) equals it
    (``radix_types.namespace_key`` compares types too): a base request never reads an adapter's K/V."""

    digest: str
    namespace: object


def lora_namespace(loaded: Loaded | None, namespace: object) -> object:
    """A request's prefix-cache namespace: its own (``namespace``), or with an adapter one of that
    adapter's content (:class:`LoRANamespace`): the adapter changes every K/V and state."""
    return namespace if loaded is None else LoRANamespace(loaded.adapter.digest, namespace)

