"""LoRA adapters, vLLM's way: ``hyla serve --enable-lora --lora-modules NAME=PATH ...`` loads adapters as
the server starts, ``POST /v1/load_lora_adapter`` and ``POST /v1/unload_lora_adapter`` while it runs,
and a request's ``model`` names the served model or a loaded adapter (``Server.check_model``; SGLang's
``/generate`` names it in ``lora_path``). ``GET /v1/models`` lists each adapter after the model, its
``root`` the adapter's directory and ``parent`` the served model's name.

    curl localhost:30000/v1/load_lora_adapter -H 'Content-Type: application/json' \\
         -d '{"lora_name": "sql", "lora_path": "/adapters/sql-lora"}'
    # Success: LoRA adapter 'sql' added successfully.

The engine does the work (``Engine.load_lora_adapter``, ``unload_lora_adapter``, ``lora_adapters``; each
adapter's prefix cache apart from the others'); here are the CLI's parser and the two endpoints, whose
blocking engine calls run on a worker thread. Answers as vLLM's: 200 with a plain-text message; an
adapter the engine refuses (not a PEFT LoRA directory, its rank above ``--max-lora-rank``, a target hyla
does not adapt, a name already loaded, ``--max-cpu-loras`` (or ``--max-loras``) loaded already, LoRA not enabled) a 400,
unloading one not loaded a 404, an engine that did not take the call between its steps in time a 409
(``engine_busy``), each with hyla's OpenAI-style error body.

Torch-free at import (the server's error module is imported where used), so that ``hyla serve``'s
argument parsing takes ``parse_lora_module`` from here without loading the engine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse, Response

from hyla.server.protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest

if TYPE_CHECKING:
    from hyla.server.app import Server


@dataclass(frozen=True)
class LoraModule:
    """One ``--lora-modules`` item: the adapter's ``name`` (what requests send as ``model``), its PEFT
    directory ``path``, and ``base_model_name`` (vLLM's JSON form: its ``parent`` on ``/v1/models``; None:
    the served model's name)."""

    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_module(text: str) -> LoraModule:
    """``NAME=PATH``, or vLLM's JSON form ``{"name": ..., "path": ..., "base_model_name": ...}``
    (``base_model_name`` optional), as a ``LoraModule``; ``argparse.ArgumentTypeError`` for anything else."""
    text = text.strip()
    if text.startswith("{"):
        try:
            item = json.loads(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"not valid JSON: {text!r} ({exc})") from None
        unknown = set(item) - {"name", "path", "base_model_name"}
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown key(s) {sorted(unknown)} in {text!r}: give name, path and "
                                             "optionally base_model_name")
        name, path, base = item.get("name"), item.get("path"), item.get("base_model_name")
        if not (isinstance(name, str) and name and isinstance(path, str) and path):
            raise argparse.ArgumentTypeError(f"{text!r} needs a non-empty \"name\" and \"path\"")
        if base is not None and not (isinstance(base, str) and base):
            raise argparse.ArgumentTypeError(f"\"base_model_name\" must be a non-empty string in {text!r}")
        return LoraModule(name, path, base)
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH or a JSON object, got {text!r}")
    return LoraModule(name, path)


class LoraRoutes:
    """vLLM's adapter endpoints of one ``Server`` (behind the API key, as the other /v1 routes)."""

    def __init__(self, server: Server):
        self.server = server

    def router(self) -> APIRouter:
        router = APIRouter()
        router.post("/v1/load_lora_adapter")(self.load_lora_adapter)
        router.post("/v1/unload_lora_adapter")(self.unload_lora_adapter)
        return router

    async def load_lora_adapter(self, body: LoadLoRAAdapterRequest) -> Response:
        """Load ``body.lora_path`` as ``body.lora_name`` (replacing the one of that name with ``load_inplace``:
        it stays where the new one is refused); a 400 where the engine refuses it, or the name is the served
        model's."""
        from hyla.server.errors import APIError

        engine = self.server.admit()
        name = body.lora_name
        if name == self.server.model_name:
            raise APIError(400, f"the LoRA adapter's name {name!r} is the served model's: give it another",
                           param="lora_name", code="invalid_lora_adapter")

        try:  # (on a worker thread: the engine loads between its steps, and waits for that)
            await asyncio.to_thread(lambda: engine.load_lora_adapter(name, body.lora_path,
                                                                     replace=body.load_inplace))
        except ValueError as exc:
            raise APIError(400, f"the LoRA adapter {name!r} was not loaded: {exc}", param="lora_path",
                           code="invalid_lora_adapter") from None
        except TimeoutError:
            raise _busy(f"the LoRA adapter {name!r} was not loaded") from None
        self.server.lora_parents.pop(name, None)  # (a --lora-modules base_model_name was the old adapter's)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    async def unload_lora_adapter(self, body: UnloadLoRAAdapterRequest) -> Response:
        """Unload ``body.lora_name`` (requests running with it finish with it; new ones naming it get
        404s); a 404 where no adapter of that name is loaded."""
        from hyla.server.errors import APIError

        from hyla.engine.lora_manager import check_lora_name

        engine = self.server.admit()
        name = body.lora_name
        try:
            check_lora_name(name)  # (a name no adapter could have: a 400, as a load's)
        except ValueError as exc:
            raise APIError(400, str(exc), param="lora_name") from None
        try:
            await asyncio.to_thread(engine.unload_lora_adapter, name)
        except ValueError as exc:
            raise APIError(404, f"the LoRA adapter {name!r} cannot be found: {exc}", type="not_found_error",
                           param="lora_name", code="lora_adapter_not_found") from None
        except TimeoutError:
            raise _busy(f"the LoRA adapter {name!r} was not unloaded") from None
        self.server.lora_parents.pop(name, None)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")


def _busy(what: str):
    """The 409 of an engine that did not get between two steps in time (the engine's timeout: a step
    that long), as a weight update's."""
    from hyla.server.errors import APIError

    return APIError(409, f"{what}: the engine did not take it between its steps in time (retry)", code="engine_busy")
