"""``load_model``: a Hugging Face checkpoint directory -> a ready hyla model.

Steps: read ``config.json`` into a ``ModelConfig`` (which rejects unsupported architectures),
pick the architecture class, index the checkpoint's tensors (single ``model.safetensors`` or
sharded via ``model.safetensors.index.json``), pick per parameter the first of the checkpoint
layouts the architecture lists that the checkpoint holds (``choose_layouts``), check that they are
exactly the tensors the architecture needs (``mtp.*`` tensors are set aside in ``model.mtp_weights``;
an architecture may ignore some names, e.g. Qwen3.5's vision tower), then build every parameter from its sources
(``WeightSpec``), converted to the requested dtype (the small SSM/router parameters stay fp32).

``read_weights`` reads another checkpoint of a loaded model the same way (its ``config.json`` must
describe the same model) and ``copy_weights_`` writes it into the model in place: a serving
engine's weight update (``Engine.update_weights_from_disk``).

Errors are ``ValueError`` naming the offending tensor(s): missing, unexpected, or wrong shape.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Iterable

import torch
from safetensors import safe_open
from torch import nn

from hyla.model.architectures import ARCHITECTURES
from hyla.model.config import ModelConfig, parse_dtype
from hyla.model.layers import HybridForCausalLM, refresh_derived_weights_
from hyla.model.weight_specs import WeightSpec

_MAX_NAMES_IN_ERROR = 8


def read_config(path: str | os.PathLike, dtype: str | torch.dtype | None = None) -> ModelConfig:
    """``ModelConfig`` of the checkpoint directory ``path`` (no weights read)."""
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        raise ValueError(f"{path} has no config.json")
    with open(config_file) as f:
        return ModelConfig.from_hf(json.load(f), dtype=dtype)


def _shard_map(path: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        with open(index) as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index} has no weight_map")
        missing_files = sorted({f for f in weight_map.values() if not (path / f).is_file()})
        if missing_files:
            raise ValueError(f"{index} names shard files that do not exist: {missing_files}")
        return {name: path / file for name, file in weight_map.items()}
    single = path / "model.safetensors"
    if not single.is_file():
        raise ValueError(f"{path} has neither model.safetensors nor model.safetensors.index.json")
    with safe_open(single, framework="pt") as f:
        return {name: single for name in f.keys()}


def name_listing(names: Iterable[str]) -> str:
    names = sorted(names)
    shown = ", ".join(names[:_MAX_NAMES_IN_ERROR])
    more = len(names) - _MAX_NAMES_IN_ERROR
    return shown + (f" (and {more} more)" if more > 0 else "")


class _TensorReader:
    """Reads tensors by (normalised) name, keeping each shard file open once."""

    def __init__(self, files: dict[str, Path], original: dict[str, str]):
        self.files = files  # normalised name -> shard file
        self.original = original  # normalised name -> name in the file
        self._handles: dict[Path, object] = {}

    def get(self, name: str) -> torch.Tensor:
        file = self.files[name]
        if file not in self._handles:
            self._handles[file] = safe_open(file, framework="pt")
        return self._handles[file].get_tensor(self.original[name])


def load_model(path: str | os.PathLike, dtype: str | torch.dtype = "float32",
               device: str | torch.device = "cpu") -> HybridForCausalLM:
    """Load the Hugging Face checkpoint directory ``path`` as a hyla model in eval mode.

    ``dtype``: ``"float32"``, ``"bfloat16"`` or ``"float16"`` (weights and activations; recurrent
    states and the SSM/router parameters ``A_log``, ``dt_bias``, ``D``, ``e_score_correction_bias``
    are fp32 regardless). Raises ``ValueError`` for an unsupported architecture, a missing,
    unexpected or mis-shaped tensor.
    """
    path = Path(path)
    config = read_config(path, dtype=parse_dtype(dtype))
    cls = ARCHITECTURES[config.architecture].model_class
    with torch.device("meta"):
        model = cls(config)
    state, mtp = _read_weights(path, cls, config, model, device)
    model.load_state_dict(state, strict=True, assign=True)
    model.to(device)
    model.mtp_weights = mtp
    return model.eval()


def read_weights(path: str | os.PathLike, model: HybridForCausalLM,
                 device: str | torch.device = "cpu") -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Another checkpoint of ``model`` (a training step's, say), read as :func:`load_model` reads
    one: ``(parameters, mtp.* tensors)``, every parameter of ``model`` by name (tied ones under each
    name) in its dtype, on ``device``. Nothing of ``model`` changes (``copy_weights_`` puts them in).

    ``ValueError`` when the checkpoint's ``config.json`` describes another model (every field of
    ``ModelConfig`` must be equal, the dtype aside: the differing ones are named), or a tensor is
    missing, unexpected or mis-shaped."""
    path = Path(path)
    config = read_config(path, dtype=model.config.dtype)
    differ = config_differences(model.config, config)
    if differ:
        raise ValueError(f"{path}: config.json describes another model than the one loaded (it differs in "
                         f"{name_listing(differ)}); a weight update needs a checkpoint of the same model")
    return _read_weights(path, type(model), config, model, device)


def config_differences(a: ModelConfig, b: ModelConfig) -> list[str]:
    """The names of the ``ModelConfig`` fields in which ``a`` and ``b`` differ (the raw
    ``config.json``, ``extra``, aside)."""
    return [f.name for f in dataclasses.fields(a) if f.compare and getattr(a, f.name) != getattr(b, f.name)]


@torch.no_grad()
def copy_weights_(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Write ``state`` (every parameter of ``model`` by name, as :func:`read_weights` gives them)
    into ``model``'s parameters in place: their storage, layout and addresses stay (a CUDA graph
    replays the new values; a weight relaid column-major stays so), and every derived weight
    (``layers._DerivedWeight``) sees the write."""
    params = dict(model.named_parameters(remove_duplicate=False))
    if set(params) != set(state):
        raise ValueError(f"internal: weights for {name_listing(set(state) ^ set(params))} do not match the model's")
    for name, param in params.items():
        param.copy_(state[name])
    refresh_derived_weights_(model)


def _read_weights(path: Path, cls: type[HybridForCausalLM], config: ModelConfig, model: nn.Module,
                  device: str | torch.device) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The checkpoint ``path``'s tensors as ``model``'s parameters (``model`` may be on the meta
    device: only its parameters' names, shapes and dtypes are read) and its ``mtp.*`` tensors."""
    reader, mtp_names = _index_checkpoint(path, cls)
    specs = choose_layouts(cls.hf_weight_specs(config), set(reader.files))
    _check_names(path, config, specs, set(reader.files))
    state = build_parameters(specs, dict(model.named_parameters(remove_duplicate=False)), reader.get, device,
                             prefix=f"{path}: ")
    mtp = {name: tensor.to(device=device, dtype=config.dtype) for name, tensor in _read_all(mtp_names).items()}
    return state, mtp


def build_parameters(specs: list[WeightSpec], params: dict[str, torch.Tensor], get, device: str | torch.device,
                     prefix: str = "", owner: str = "") -> dict[str, torch.Tensor]:
    """Every parameter of ``params`` (name -> the parameter, possibly on the meta device) built from
    its spec's source tensors (``get(name)``), checked against its shape, in its dtype on ``device``;
    a plain copy of the same sources is built once, so tied weights share storage. ``ValueError``
    for a mis-shaped result (``prefix``, ``owner``: where, and whose parameter, in the message)."""
    state: dict[str, torch.Tensor] = {}
    built: dict[tuple[str, ...], torch.Tensor] = {}  # plain copies, so tied weights share storage
    for spec in specs:
        if spec.target not in params:
            raise ValueError(f"internal: weight spec targets unknown parameter {spec.target!r}")
        target = params[spec.target]
        if spec.combine is None and spec.sources in built and built[spec.sources].dtype == target.dtype:
            state[spec.target] = built[spec.sources]
            continue
        tensor = spec.build([get(name) for name in spec.sources])
        if tuple(tensor.shape) != tuple(target.shape):
            raise ValueError(
                f"{prefix}tensor(s) {name_listing(spec.sources)} give shape {tuple(tensor.shape)} for "
                f"{owner}{spec.target}, the config implies {tuple(target.shape)}"
            )
        state[spec.target] = tensor.to(device=device, dtype=target.dtype).contiguous()
        if spec.combine is None:
            built[spec.sources] = state[spec.target]
    unbuilt = set(params) - set(state)
    if unbuilt:
        raise ValueError(f"internal: no weight spec for parameters {name_listing(unbuilt)}")
    return state


def _index_checkpoint(path: Path, cls: type[HybridForCausalLM]) -> tuple[_TensorReader, dict[str, Path]]:
    """Split the checkpoint's tensors into those the architecture reads (by normalised name) and
    the ``mtp.*`` ones; names the architecture ignores are dropped."""
    files: dict[str, Path] = {}
    original: dict[str, str] = {}
    mtp: dict[str, Path] = {}
    for name, file in _shard_map(path).items():
        if name.startswith("mtp."):
            mtp[name] = file
            continue
        normalised = cls.normalize_hf_name(name)
        if normalised is None:
            continue
        if normalised in files:
            raise ValueError(f"{path}: tensors {original[normalised]!r} and {name!r} are the same weight")
        files[normalised], original[normalised] = file, name
    return _TensorReader(files, original), mtp


def choose_layouts(specs: list[WeightSpec], available: set[str]) -> list[WeightSpec]:
    """One spec per parameter. An architecture whose checkpoints come in several layouts lists one
    spec per layout for the same parameter (Qwen3.5-MoE: the published fused
    ``experts.gate_up_proj`` or the per-expert tensors transformers' ``save_pretrained`` writes):
    the first whose sources the checkpoint all holds is kept, else the first (whose missing tensors
    the error then names). Order is kept."""
    first: dict[str, int] = {}
    chosen: list[WeightSpec] = []
    for spec in specs:
        if spec.target not in first:
            first[spec.target] = len(chosen)
            chosen.append(spec)
        elif not set(chosen[first[spec.target]].sources) <= available and set(spec.sources) <= available:
            chosen[first[spec.target]] = spec
    return chosen


def _check_names(path: Path, config: ModelConfig, specs: list[WeightSpec], available: set[str]) -> None:
    needed = {name for spec in specs for name in spec.sources}
    missing = needed - available
    if missing:
        raise ValueError(
            f"{path}: checkpoint lacks tensor(s) required by {config.architecture}: {name_listing(missing)}"
        )
    unexpected = available - needed
    if config.tie_word_embeddings:  # a tied checkpoint may still carry the (duplicate) lm_head
        unexpected.discard("lm_head.weight")
    if unexpected:
        raise ValueError(
            f"{path}: checkpoint has tensor(s) that {config.architecture} with this config.json does not "
            f"use: {name_listing(unexpected)}"
        )


def _read_all(names: dict[str, Path]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    by_file: dict[Path, list[str]] = {}
    for name, file in names.items():
        by_file.setdefault(file, []).append(name)
    for file, file_names in by_file.items():
        with safe_open(file, framework="pt") as f:
            for name in file_names:
                out[name] = f.get_tensor(name)
    return out
