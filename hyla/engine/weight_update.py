"""A serving engine's weights replaced by another checkpoint of the same model, in place.

What reinforcement-learning loops do between rollouts (SGLang's ``update_weights_from_disk``): the
trainer saves a checkpoint, the engine serves it next. ``Engine.update_weights_from_disk`` runs it
in two halves:

* :meth:`NewWeights.read`, on the caller's thread while the engine serves on: the checkpoint read
  and checked as the loader checks one (``loader.read_weights``: its ``config.json`` must describe
  the same model, every tensor there with its shape), into host memory, the MTP head's tensors
  too where the engine drafts with it. A bad checkpoint is a ``ValueError`` and nothing changed.
* :meth:`NewWeights.apply`, on the scheduler thread between two steps, once no request runs or has
  run and waits (``Scheduler.drained``): every parameter written in place (``loader.copy_weights_``;
  storage and addresses stay, so CUDA graphs replay the new values, and the weights' derived copies
  the model keeps are recomputed), the graphs ``compile_decode`` compiled from the old weights
  compiled again (their graph of more rows holds the weights as constants), and the prefix cache
  emptied: what it holds was computed with the old weights, and the cache must never change what
  the model computes.

A draft model (``speculative_algorithm="draft"``) keeps its weights: drafts only propose, the
model verifies every token. The tokenizer, chat template and generation defaults stay those loaded
at start-up.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from hyla.model.layers import HybridForCausalLM
from hyla.model.loader import copy_weights_, read_weights
from hyla.model.mtp import MtpHead

logger = logging.getLogger("hyla.engine")


@dataclass
class NewWeights:
    """A checkpoint read for a weight update, checked against the model it is for."""

    path: Path
    state: dict[str, torch.Tensor]  # every parameter of the model, by name, on the host
    mtp: dict[str, torch.Tensor]  # the checkpoint's mtp.* tensors
    head_state: dict[str, torch.Tensor] | None  # the MTP head's parameters (an engine drafting with it)

    @classmethod
    def read(cls, path: str | Path, model: HybridForCausalLM, mtp_head: MtpHead | None) -> "NewWeights":
        """``ValueError`` when ``path`` is no checkpoint of ``model`` (and, with an MTP head, has no
        fitting ``mtp.*`` tensors)."""
        path = Path(path)
        state, mtp = read_weights(path, model)  # (ValueError for a directory without config.json too)
        head_state = mtp_head.state_from(mtp) if mtp_head is not None else None
        return cls(path, state, mtp, head_state)

    @torch.no_grad()
    def apply(self, model: HybridForCausalLM, mtp_head: MtpHead | None, scheduler) -> None:
        """Write the weights into ``model`` (and ``mtp_head``), rebuild what holds them otherwise,
        empty the prefix cache. Scheduler thread only, while ``scheduler.drained()``."""
        if not scheduler.drained():
            raise RuntimeError("internal: weights written while requests run")
        start = time.perf_counter()
        copy_weights_(model, self.state)
        if mtp_head is not None:
            copy_weights_(mtp_head, self.head_state)
        _replace_tensors(model.mtp_weights, self.mtp, model.embed_tokens.weight.device)
        if scheduler.runner.compiled:  # graphs holding the old weights as constants: compiled again
            logger.info("weight update: compiling the decode graphs again (compile_decode)")
            scheduler.runner = scheduler.runner.rebuilt()
            drafter = scheduler.drafter
            if getattr(drafter, "compiled", False) and getattr(drafter, "head", None) is mtp_head:
                drafter.compile()
        scheduler.flush_cache(with_waiting=True)
        logger.info("weight update: %s in place in %.2f s", self.path, time.perf_counter() - start)


def _replace_tensors(old: dict[str, torch.Tensor], new: dict[str, torch.Tensor], device: torch.device) -> None:
    """``old`` (the model's ``mtp_weights``) given ``new``'s values: written in place where names and
    shapes agree (an MTP head built from them may share their storage), else replaced."""
    if old.keys() == new.keys() and all(old[k].shape == new[k].shape for k in old):
        for name, tensor in new.items():
            old[name].copy_(tensor)
    else:
        old.clear()
        old.update({name: tensor.to(device) for name, tensor in new.items()})
