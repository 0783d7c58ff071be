"""A serving engine's weights replaced by another checkpoint of the same model, in place.

What reinforcement-learning loops do between rollouts (SGLang's ``update_weights_from_disk``): the
trainer saves a checkpoint, the engine serves it next. ``Engine.update_weights_from_disk`` runs it
in two halves:

* :meth:`NewWeights.read`, on the caller's thread while the engine serves on: the checkpoint
  checked as the loader checks one, from its files' headers alone (``loader.check_weights``: its
  ``config.json`` must describe the same model; every tensor there, a float, giving its parameter
  the parameter's shape), the MTP head's ``mtp.*`` tensors too where the engine drafts with it
  (``MtpHead.state_from`` on their headers). No tensor data is read. A bad checkpoint is a
  ``ValueError`` and nothing changed.
* :meth:`NewWeights.apply`, on the scheduler thread between two steps, once no request runs or has
  run and waits (``Scheduler.drained``): every parameter read from the checkpoint and written in
  place, one at a time (``loader.copy_weights_``: host memory holds one parameter's tensors at
  most; storage and addresses stay, so CUDA graphs replay the new values, and the weights' derived
  copies the model keeps are recomputed), the graphs ``compile_decode`` compiled from the old
  weights compiled again (their graph of more rows holds the weights as constants; should that
  compile fail, the steps run eager, logged as an error), and the prefix cache emptied: what it
  holds was computed with the old weights, and the cache must never change what the model computes.

A read that fails during ``apply`` (a file truncated, deleted or rewritten since ``read`` checked
it, an I/O error) leaves some parameters new and the others old. As SGLang does, the weights the
engine served are then read back the same way from the checkpoint they came from (the engine's
``model_path``: the one it loaded, or its last successful update), the graphs compiled and the cache
emptied as after an update, and the error is raised as a ``ValueError``: a failed update, the old
weights served on. Should that read fail too, the engine's weights are a mix of two checkpoints: a
``RuntimeError`` that says so, logged as an error (another update, from a good checkpoint, mends
it). Even then the derived weights the layers keep are recomputed from the parameters as they are,
the graphs compiled and the prefix cache emptied, as after an update: the model the engine serves
is one (mixed) set of weights, and no request hits a prefix the old weights computed. So everything
the headers tell is checked before a weight changes; what only the data can tell costs a second
read of the old checkpoint when it goes wrong.

A draft model (``speculative_algorithm="draft"``) keeps its weights: drafts only propose, the
model verifies every token. The tokenizer, chat template and generation defaults stay those loaded
at start-up.
"""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from hyla.model.layers import HybridForCausalLM, refresh_derived_weights_
from hyla.model.loader import CheckedWeights, check_weights, copy_mtp_weights_, copy_weights_
from hyla.model.mtp import MtpHead

logger = logging.getLogger("hyla.engine")


@dataclass
class NewWeights:
    """A checkpoint for a weight update, checked against the model it is for from its headers."""

    checked: CheckedWeights

    @property
    def path(self) -> Path:
        return self.checked.path

    @classmethod
    def read(cls, path: str | Path, model: HybridForCausalLM, mtp_head: MtpHead | None) -> "NewWeights":
        """``ValueError`` when ``path`` is no checkpoint of ``model`` (and, with an MTP head, has no
        fitting ``mtp.*`` tensors). Reads the files' headers, no tensor data; leaves no file open."""
        checked = check_weights(path, model)  # (ValueError for a directory without config.json too)
        if mtp_head is not None:
            with torch.device("meta"):
                mtp_head.state_from(checked.mtp_headers(), device="meta")
        return cls(checked)

    @torch.no_grad()
    def apply(self, model: HybridForCausalLM, mtp_head: MtpHead | None, scheduler, current: Path) -> None:
        """Read the weights into ``model`` (and ``mtp_head``) in place, rebuild what holds them
        otherwise, empty the prefix cache. Scheduler thread only, while ``scheduler.drained()``.

        ``current``: the checkpoint of the weights served now. Should a read fail, they are read
        back from it and the error is raised as a ``ValueError``; should that fail too, a
        ``RuntimeError`` (the weights are a mix of both). Either way, as after an update, the derived
        weights match the parameters, the graphs are compiled again and the prefix cache is empty:
        see the module docstring."""
        if not scheduler.drained():
            raise RuntimeError("internal: weights written while requests run")
        start = time.perf_counter()
        try:
            _write(self.checked, model, mtp_head)
        except Exception as exc:
            logger.warning("weight update: reading %s failed (%s); reading the weights served back from %s",
                           self.path, exc, current)
            try:
                _write(NewWeights.read(current, model, mtp_head).checked, model, mtp_head)
            except Exception as again:
                message = (f"weight update: reading {self.path} failed ({exc}), and reading the weights served "
                           f"back from {current} failed too ({again}): the engine's weights are now "
                           f"inconsistent, parts of two checkpoints; update them from a good checkpoint")
                logger.error("%s", message)
                # (copy_weights_ stopped before refreshing the derived weights: the graphs read them)
                refresh_derived_weights_(model)
                if mtp_head is not None:
                    refresh_derived_weights_(mtp_head)
                _rebuild(mtp_head, scheduler)
                raise RuntimeError(message) from again
            _rebuild(mtp_head, scheduler)
            raise ValueError(f"{self.path}: reading the checkpoint failed during the update ({exc}); the "
                             f"weights served before were read back from {current}") from exc
        _rebuild(mtp_head, scheduler)
        logger.info("weight update: %s in place in %.2f s", self.path, time.perf_counter() - start)


def _write(checked: CheckedWeights, model: HybridForCausalLM, mtp_head: MtpHead | None) -> None:
    """Every weight of ``model`` (its ``mtp_weights`` too) and ``mtp_head`` read from the checkpoint
    ``checked`` and written in place, one parameter at a time; its files closed after."""
    prefix = f"{checked.path}: "
    try:
        copy_weights_(model, checked.specs, checked.tensors.get, prefix=prefix, tensors=checked.tensors)
        if mtp_head is not None:
            mtp_head.copy_from_(set(checked.mtp.files), checked.mtp.get, prefix=prefix, tensors=checked.mtp)
        copy_mtp_weights_(model, checked.mtp)
    finally:
        checked.close()


def _rebuild(mtp_head: MtpHead | None, scheduler) -> None:
    """After the weights were written: the prefix cache (computed with the old ones) emptied, then
    the compiled graphs (which hold them as constants) compiled again. The cache first: should a
    compile fail, no request hits what the old weights computed. Should it fail (inductor's cache
    directory full, memory short), the old graphs are dropped all the same and the steps run eager
    (``ModelRunner.compile_failed``, logged as an error): the new weights served exactly, slower,
    until an update compiles them."""
    scheduler.flush_cache(with_waiting=True)
    runner, drafter = scheduler.runner, scheduler.drafter
    if not (runner.compiled or runner.compile_failed):
        return
    logger.info("weight update: compiling the decode graphs again (compile_decode)")
    try:
        scheduler.runner = runner.rebuilt(compile_decode=True)
        if mtp_head is not None and getattr(drafter, "head", None) is mtp_head and (drafter.compiled
                                                                                  or runner.compile_failed):
            drafter.compile()
    except Exception:
        logger.exception("weight update: compiling the decode graphs failed; decode steps run eager (the new "
                         "weights, slower) until an update compiles them")
        scheduler.runner = runner.rebuilt(compile_decode=False)
        scheduler.runner.compile_failed = True


# elements a digest turns into int64 at a time (a 128 MiB temporary at most, however large the tensor)
DIGEST_BLOCK_ELEMENTS = 1 << 24
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def weights_digest(*modules: torch.nn.Module | None) -> str:
    """A digest of the values of ``modules``' parameters and buffers (None: skipped): equal for the same weights
    in the same dtypes on any device or process, different after any update that changes them. What an exported
    prefix carries beside ``weight_version``, which an update may leave unnamed (SGLang's default): a prefix of
    other weights would change what the model computes (``Engine.import_prefix``). Per tensor its name, dtype,
    shape and the wrapping int64 sum of its elements' bits (exact integer arithmetic: no order or device
    dependence); one pass over the weights at memory speed (a 1.3 GB model: ~0.5 s on a CPU core)."""
    digest = hashlib.sha256()
    for i, module in enumerate(modules):
        if module is None:
            continue
        for name, t in sorted(module.state_dict(keep_vars=False).items()):
            flat = t.detach().reshape(-1)
            bits = (flat.to(torch.uint8) if flat.dtype == torch.bool else flat).view(_INT_OF_SIZE[flat.element_size()])
            total = sum(int(bits[j:j + DIGEST_BLOCK_ELEMENTS].to(torch.int64).sum())
                        for j in range(0, bits.numel(), DIGEST_BLOCK_ELEMENTS)) % 2**64
            digest.update(f"{i}.{name}:{t.dtype}:{tuple(t.shape)}:{total};".encode())
    return digest.hexdigest()[:32]
