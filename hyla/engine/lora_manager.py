"""Which LoRA adapters an engine serves: names, the loads behind them, and when their weights may go.

An adapter is read off the scheduler thread (:func:`hyla.model.lora.read_adapter`), then installed into
the model's projections on it, between steps, under a *uid*: a number of that one load, never reused.
A request resolves its adapter's name to the uid when it is made (``Req.lora_uid``), and its prefix
cache namespace gets the adapter's content digest, so requests of different adapters (or of none)
never share a cached prefix, while the same files loaded again, under any name, in any process, do.

Ownership and locks. ``Engine`` owns one ``LoRAManager``. Names are read on callers' threads
(:meth:`resolve`) and changed on the scheduler thread; ``lock`` guards them. The weights are
installed and removed on the scheduler thread only (a forward reads them there). Unloading removes
the name at once; the weights stay while a live request still applies them (``retiring``), and go
when the last one ends (:meth:`release`): a request never runs with its adapter gone. Those count against
``max_loras`` until they go (their weights are resident). ``Engine``
calls :meth:`unload` and :meth:`release` under its inbox lock, which its submissions hold too, so a
request made before an unload but submitted after it is refused (:meth:`is_loaded`), never run.
"""

from __future__ import annotations

import itertools
import logging
import threading
from dataclasses import dataclass
from typing import Iterable

import torch

from hyla.model.lora import LoRAAdapter, install_, uninstall_

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
    def __init__(self, model, max_loras: int):
        self.model = model
        self.max_loras = max_loras
        self.lock = threading.Lock()
        self._by_name: dict[str, Loaded] = {}
        self._by_uid: dict[int, Loaded] = {}  # loaded, and retiring ones still applied by live requests
        self.retiring: set[int] = set()
        self._uids = itertools.count(1)

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
            self._check_room(name, self._by_name.get(name) if replace else None)

    # --- the scheduler thread ----------------------------------------------------------------
    def install(self, name: str, adapter: LoRAAdapter, replace: bool = False) -> Loaded:
        """Install ``adapter``'s weights for ``name`` (not yet served: :meth:`publish`); ``ValueError`` for a name
        in use (unless ``replace``), no room (``max_loras``; the one replaced leaves room), or too little
        memory for its weights (none stays)."""
        with self.lock:
            self._check_room(name, self._by_name.get(name) if replace else None)
            loaded = Loaded(next(self._uids), name, adapter)
        try:
            install_(self.model, loaded.uid, adapter)
        except BaseException as exc:
            uninstall_(self.model, loaded.uid)  # (the projections it reached before it failed)
            if isinstance(exc, torch.OutOfMemoryError):
                raise ValueError(f"LoRA adapter {name!r}: not enough memory for its weights ({exc})") from None
            raise
        return loaded

    def publish(self, loaded: Loaded, live_uids: Iterable[int]) -> None:
        """Serve ``loaded`` under its name from now on; the adapter it replaces (if any) is unloaded, as by
        :meth:`unload` (``live_uids``: the live requests'; under the engine's inbox lock)."""
        with self.lock:
            old = self._by_name.get(loaded.name)
            self._by_name[loaded.name] = loaded
            self._by_uid[loaded.uid] = loaded
            if old is not None:
                self.retiring.add(old.uid)
        if old is not None:
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
        uninstall_(self.model, uid)
        with self.lock:
            self.retiring.discard(uid)
            self._by_uid.pop(uid, None)

    def _check_room(self, name: str, replacing: Loaded | None = None) -> None:
        """``ValueError`` unless ``name`` is free (or ``replacing`` holds it) and fewer than ``max_loras`` adapters
        are resident: loaded, or unloaded but still applied by running requests (their weights are there too)."""
        if name in self._by_name and replacing is None:
            raise ValueError(f"a LoRA adapter named {name!r} is already loaded (unload it first)")
        resident = len(self._by_uid) - (replacing is not None)
        if resident >= self.max_loras:
            retiring = len(self.retiring)
            raise ValueError(f"{resident} LoRA adapters are resident, max_loras is {self.max_loras}"
                             + (f" ({retiring} unloaded but still applied by running requests)" if retiring else "")
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

