"""``load_model``: a Hugging Face checkpoint directory -> a ready hyla model.

Steps: read ``config.json`` into a ``ModelConfig`` (which rejects unsupported architectures),
pick the architecture class, index the checkpoint's tensors (single ``model.safetensors`` or
sharded via ``model.safetensors.index.json``, which must agree with its shards' headers), pick per
parameter the first of the checkpoint layouts the architecture lists that the checkpoint holds (``choose_layouts``), check that they are
exactly the tensors the architecture needs (``mtp.*`` tensors are set aside in ``model.mtp_weights``;
an architecture may ignore some names, e.g. Qwen3.5's vision tower), then build every parameter from its sources
(``WeightSpec``), converted to the requested dtype (the small SSM/router parameters stay fp32).

``check_weights`` checks another checkpoint of a loaded model the same way from its files' headers
alone, no tensor data read (its ``config.json`` must describe the same model; each parameter's
shape comes from its spec run on meta tensors), and ``copy_weights_`` then reads it parameter by
parameter into the model in place: a serving engine's weight update
(``Engine.update_weights_from_disk``).

Only float tensors are read (``SOURCE_DTYPES``), and float8 ones with their scales in an FP8
checkpoint (``quantization.py``: each is read dequantized, in fp32, then converted as any other).
Errors are ``ValueError`` naming the offending tensor(s): missing, unexpected, of another dtype,
or wrong shape.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, NamedTuple

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from hyla.model.architectures import ARCHITECTURES
from hyla.model.config import ModelConfig, parse_dtype, read_json
from hyla.model.layers import HybridForCausalLM, refresh_derived_weights_
from hyla.model.quantization import (BLOCK_SCALE, FP8, FP8_DTYPES, INPUT_SCALE, ONLINE_BLOCK, TENSOR_SCALE,
                                     Fp8Scheme, attach_scales_, block_form, fp8_scales, is_fp8, keep_fp8_targets)
from hyla.model.weight_specs import WeightSpec

_MAX_NAMES_IN_ERROR = 8

SOURCE_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
"""The tensors the loader reads, by their dtype's name in a safetensors header: the float types it
converts to a model's dtype. An integer tensor is refused, and a float8 one unless it comes with
its scales in an FP8 checkpoint (``FP8_DTYPES``)."""


def read_config(path: str | os.PathLike, dtype: str | torch.dtype | None = None) -> ModelConfig:
    """``ModelConfig`` of the checkpoint directory ``path`` (no weights read). ``ValueError`` for a config.json
    that does not describe a model hyla reads, a field of the wrong type among them."""
    config = _config_json(path)
    try:
        return ModelConfig.from_hf(config, dtype=dtype)
    except (TypeError, KeyError, AttributeError, IndexError) as exc:  # (a field of another type than HF's)
        raise ValueError(f"{path}/config.json: a field hyla reads is malformed ({type(exc).__name__}: {exc})") from None


def read_quantization(path: str | os.PathLike) -> Fp8Scheme | None:
    """How the checkpoint directory ``path`` stores its FP8 tensors (``None``: it has none);
    ``ValueError`` for a quantization hyla does not read."""
    try:
        return Fp8Scheme.from_hf(_config_json(path))
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from exc


def _config_json(path: str | os.PathLike) -> dict:
    """The checkpoint directory ``path``'s config.json, a JSON object; ``ValueError`` for anything else (no such
    file, a path the OS refuses, invalid JSON, another JSON value)."""
    config_file = Path(path) / "config.json"
    try:
        if not config_file.is_file():
            raise ValueError(f"{path} has no config.json")
        with open(config_file) as f:
            config = json.load(f)  # (invalid JSON: a ValueError)
    except OSError as exc:  # (a name too long, a directory not readable)
        raise ValueError(f"{path}: config.json cannot be read ({exc.strerror or exc})") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"{config_file} is not UTF-8 JSON ({exc.reason})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{config_file} holds a JSON {type(config).__name__}, not an object")
    return config


def _shard_map(path: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it: ``model.safetensors``, or the shards
    ``model.safetensors.index.json`` lists (which wins where both are present). The index and its
    shards' headers must agree: every tensor it lists is in the shard it names, and every tensor of a
    shard is listed there (so none is in two shards). ``ValueError`` naming the file for anything
    else: an index that is not a JSON object whose ``weight_map`` maps tensor names to file names,
    a shard missing, a disagreement (naming the tensors), a file safetensors cannot read."""
    index = path / "model.safetensors.index.json"
    if not index.is_file():
        single = path / "model.safetensors"
        if not single.is_file():
            raise ValueError(f"{path} has neither model.safetensors nor model.safetensors.index.json")
        return {name: single for name in _tensor_names(single)}
    weight_map = _weight_map(index)
    missing_files = sorted({f for f in weight_map.values() if not (path / f).is_file()})
    if missing_files:
        raise ValueError(f"{index} names shard files that do not exist: {missing_files}")
    files = {name: path / file for name, file in weight_map.items()}
    listed: dict[Path, set[str]] = {}  # shard file -> the tensors the index puts in it
    for name, file in files.items():
        listed.setdefault(file, set()).add(name)
    for file, names in listed.items():
        held = _tensor_names(file)
        absent = names - held
        if absent:
            raise ValueError(f"{index} lists tensor(s) in {file.name} that it does not hold: {name_listing(absent)}")
        elsewhere = {name: files[name] for name in held - names if name in files}
        if elsewhere:
            name = min(elsewhere)
            more = "" if len(elsewhere) == 1 else f" (and {len(elsewhere) - 1} more tensors)"
            raise ValueError(f"{path}: tensor {name!r} is in two shards, {file.name} and {elsewhere[name].name} "
                             f"(which {index.name} names){more}")
        unlisted = held - names
        if unlisted:
            raise ValueError(f"{file} holds tensor(s) that {index.name} does not list: {name_listing(unlisted)}")
    return files


def _weight_map(index: Path) -> dict[str, str]:
    """The ``weight_map`` of the index file ``index`` (tensor name -> shard file name); ``ValueError``
    naming the file unless it is UTF-8 JSON holding an object with such a map."""
    content = read_json(index)
    weight_map = content.get("weight_map") if isinstance(content, dict) else None
    if not isinstance(weight_map, dict):
        raise ValueError(f"{index} has no weight_map (an object of tensor name -> shard file name)")
    bad = {name: file for name, file in weight_map.items() if not isinstance(file, str) or not file}
    if bad:
        name = min(bad)
        raise ValueError(f"{index}: weight_map gives tensor {name!r} the shard file {bad[name]!r}, not a file name")
    return weight_map


def _tensor_names(file: Path) -> set[str]:
    """The names of the tensors the safetensors file ``file`` holds, from its header; ``ValueError``
    naming the file where safetensors cannot read it (a truncated file, a garbage header)."""
    try:
        with safe_open(file, framework="pt") as f:
            return set(f.keys())
    except SafetensorError as exc:
        raise ValueError(f"{file}: {exc}") from exc


def name_listing(names: Iterable[str]) -> str:
    names = sorted(names)
    shown = ", ".join(names[:_MAX_NAMES_IN_ERROR])
    more = len(names) - _MAX_NAMES_IN_ERROR
    return shown + (f" (and {more} more)" if more > 0 else "")


def _shapes_listing(names: list[str] | tuple[str, ...], tensors: list[torch.Tensor]) -> str:
    """``name (shape)`` of each tensor, in order (``names[i]`` is ``tensors[i]``'s), the first
    ``_MAX_NAMES_IN_ERROR`` of them."""
    shown = ", ".join(f"{name} {tuple(t.shape)}" for name, t in zip(names[:_MAX_NAMES_IN_ERROR], tensors))
    more = len(names) - _MAX_NAMES_IN_ERROR
    return shown + (f" (and {more} more)" if more > 0 else "")


class TensorReader:
    """A checkpoint's tensors by name (normalised, or the file's own), from their shard files: a
    tensor's header (:meth:`meta`: its shape and dtype, no data read) or its data (:meth:`get`).
    A float8 tensor of an FP8 checkpoint (one with ``scales``) is its dequantized value: fp32.
    ``ValueError`` naming the file for a tensor whose dtype is not in ``SOURCE_DTYPES`` (nor float8
    with scales), scales that do not fit their tensor, and a file safetensors cannot read (one
    truncated, say: a file must cover its header, which is checked when it is opened). A file is
    opened (memory-mapped) on first use and stays open until :meth:`close`; one truncated while
    open is not safe to read."""

    def __init__(self, files: dict[str, Path], original: dict[str, str] | None = None,
                 scales: dict[str, tuple[Path, str]] | None = None, scheme: Fp8Scheme | None = None):
        self.files = files  # name -> shard file
        self.original = original or {}  # name -> name in the file, where they differ
        self.scales = scales or {}  # name of a quantized tensor -> (file, name in the file) of its scales
        self.scheme = scheme  # how the scales apply (set where there are scales)
        self._handles: dict[Path, object] = {}

    def meta(self, name: str) -> torch.Tensor:
        """The tensor ``name`` as its header describes it: a meta tensor of its shape and dtype (fp32
        for a quantized one, as :meth:`get` returns it)."""
        file, name_in_file = self.files[name], self.original.get(name, name)
        header = self._read(file, name_in_file, lambda f, n: f.get_slice(n))
        shape, dtype_name = tuple(header.get_shape()), header.get_dtype()
        if name in self.scales:
            scale_file, scale_name = self.scales[name]
            scale = self._read(scale_file, scale_name, lambda f, n: f.get_slice(n))
            if dtype_name not in FP8_DTYPES:
                raise ValueError(f"{file}: tensor {name_in_file!r} has scales ({scale_name!r}) but is {dtype_name}, "
                                 f"not {', '.join(FP8_DTYPES)}")
            if scale.get_dtype() not in SOURCE_DTYPES:
                raise ValueError(f"{scale_file}: scales {scale_name!r} are {scale.get_dtype()}; the loader reads "
                                 f"{', '.join(SOURCE_DTYPES)} scales")
            if self.scheme.block is not None and len(shape) < 2:
                raise ValueError(f"{file}: tensor {name_in_file!r} of shape {shape} has block scales "
                                 f"({scale_name!r}); block-quantized tensors are matrices (or stacks of them)")
            if not self.scheme.scale_fits(shape, tuple(scale.get_shape())):
                raise ValueError(f"{scale_file}: scales {scale_name!r} of shape {tuple(scale.get_shape())} do not fit "
                                 f"{name_in_file!r} of shape {shape} (expected {self.scheme.scale_shape(shape)})")
            return torch.empty(shape, dtype=torch.float32, device="meta")
        dtype = SOURCE_DTYPES.get(dtype_name)
        if dtype is None:
            if dtype_name in FP8_DTYPES:
                why = (f"an FP8 checkpoint's float8 tensor needs its scales ({name_in_file}"
                       f"{self.scheme.scale_suffix if self.scheme else '_scale_inv'}) and config.json's "
                       f"quantization_config" + ("" if self.scheme else ", which this checkpoint has not"))
            else:
                why = f"the loader reads {', '.join(SOURCE_DTYPES)} tensors"
            raise ValueError(f"{file}: tensor {name_in_file!r} is {dtype_name}; {why}")
        return torch.empty(shape, dtype=dtype, device="meta")

    def get(self, name: str) -> torch.Tensor:
        """The tensor ``name`` (its dtype checked first, as :meth:`meta`), on safetensors' mapping of
        the file: what is kept must be copied off it first (:func:`_owned`), or it would follow the
        file's later changes (a parameter kept on it would change with a trainer's next checkpoint
        written over it, or fault once the file is truncated, even after an update wrote it in
        place)."""
        self.meta(name)
        tensor = self._read(self.files[name], self.original.get(name, name), lambda f, n: f.get_tensor(n))
        if name not in self.scales:
            return tensor
        return self.scheme.dequantize(tensor, self._scales(name))

    def _scales(self, name: str) -> torch.Tensor:
        """The scales of the quantized tensor ``name``; ``ValueError`` naming them unless every one is
        finite and not negative."""
        file, scale_name = self.scales[name]
        scale = self._read(file, scale_name, lambda f, n: f.get_tensor(n))
        if not bool(torch.isfinite(scale).all()) or bool((scale < 0).any()):
            raise ValueError(f"{file}: scales {scale_name!r} hold a negative, infinite or NaN value")
        return scale

    def quantized(self, name: str) -> bool:
        """Whether ``name`` is a float8 tensor with scales (:meth:`get` dequantizes it)."""
        return name in self.scales

    def raw(self, name: str) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int]]:
        """A quantized tensor as stored: ``(float8 tensor, its scales in block form, block)``
        (``quantization.block_form``), checked as :meth:`meta` checks it."""
        self.meta(name)
        q = self._read(self.files[name], self.original.get(name, name), lambda f, n: f.get_tensor(n))
        return q, *block_form(self.scheme, q, self._scales(name))

    def raw_block(self, name: str) -> tuple[int, int]:
        """The block :meth:`raw` would give, from the headers alone."""
        shape = tuple(self.meta(name).shape)
        return self.scheme.block or shape[-2:]

    def close(self) -> None:
        """Close the files; a later read opens them again."""
        self._handles.clear()

    def _read(self, file: Path, name_in_file: str, read):
        """``read(file handle, name_in_file)``, the file opened first where it is not."""
        try:
            if file not in self._handles:
                self._handles[file] = safe_open(file, framework="pt")
            return read(self._handles[file], name_in_file)
        except SafetensorError as exc:
            raise ValueError(f"{file}: {exc}") from exc


def load_model(path: str | os.PathLike, dtype: str | torch.dtype = "float32",
               device: str | torch.device = "cpu", keep_fp8: bool = False,
               quantize_fp8: bool = False, mtp: bool = True) -> HybridForCausalLM:
    """Load the Hugging Face checkpoint directory ``path`` as a hyla model in eval mode.

    ``dtype``: ``"float32"``, ``"bfloat16"`` or ``"float16"`` (weights and activations; recurrent
    states and the SSM/router parameters ``A_log``, ``dt_bias``, ``D``, ``e_score_correction_bias``
    are fp32 regardless). ``keep_fp8``: an FP8 checkpoint's projection and expert weights stay
    float8 where they can, with their scales (``quantization.py``: weights kept in FP8); otherwise
    every tensor is dequantized to ``dtype``. ``quantize_fp8`` (implies ``keep_fp8``): the others of
    those weights quantized at load, per ``ONLINE_BLOCK`` block, from their values in ``dtype``
    (SGLang's and vLLM's ``--quantization fp8`` for an unquantized checkpoint). ``mtp``: whether the
    checkpoint's ``mtp.*`` tensors are read into ``model.mtp_weights`` (in ``dtype`` on ``device``; with
    ``keep_fp8``, the quantized ones float8 as stored, their scales in ``model.mtp_scales``), for an MTP
    head (``mtp.MtpHead.from_model``); a model that drafts with none leaves them on disk. Raises ``ValueError``
    for an unsupported architecture, a missing, unexpected, mis-shaped or non-float tensor.
    """
    path = Path(path)
    config = read_config(path, dtype=parse_dtype(dtype))
    cls = ARCHITECTURES[config.architecture].model_class
    with torch.device("meta"):
        model = cls(config)
    tensors, mtp_reader = _index_checkpoint(path, cls, config)
    specs = _checkpoint_specs(path, cls, config, set(tensors.files))
    keep = KeepFp8(tensors, keep_fp8_targets(model)) if keep_fp8 or quantize_fp8 else None
    state = build_parameters(specs, dict(model.named_parameters(remove_duplicate=False)), tensors.get, device,
                             prefix=f"{path}: ", keep=keep)
    if quantize_fp8:
        quantize_the_rest_(state, keep)
    model.quantized_at_load = quantize_fp8
    state = _as_parameters(state, model)  # (the values themselves: none kept aside)
    model.load_state_dict(state, strict=True, assign=True)
    model.to(device)
    if keep is not None:
        attach_scales_(model, keep.scales)
    if mtp:
        model.mtp_weights, model.mtp_scales = _read_mtp(mtp_reader, config, device, keep_fp8 or quantize_fp8)
    return model.eval()


def _as_parameters(state: dict[str, torch.Tensor], model: nn.Module) -> dict[str, nn.Parameter]:
    """``state`` (parameter name -> its value) as the parameters ``load_state_dict(assign=True)`` puts in
    ``model`` as they are: one per parameter of ``model`` (its several names, a shared module's, get
    the same), each holding its value's memory. A load hook that gives a parameter new memory
    (``HybridForCausalLM.relayout_weights_``) then frees the old at once: the state dict, which the
    load holds until it returns, holds the same parameters, not other views of that memory, which
    would keep a second copy of every such weight until then."""
    params = dict(model.named_parameters(remove_duplicate=False))
    made: dict[int, nn.Parameter] = {}  # id of a parameter of model -> its new value
    out = {}
    for name, value in state.items():
        param = params[name]
        if id(param) not in made:
            made[id(param)] = value if isinstance(value, nn.Parameter) else nn.Parameter(value, param.requires_grad)
        out[name] = made[id(param)]
    return out


@dataclass
class CheckedWeights:
    """Another checkpoint of a loaded model, checked against it from its headers
    (:func:`check_weights`); :func:`copy_weights_` reads it into the model. Its files are closed
    (:meth:`close`) between reads."""

    path: Path
    specs: list[WeightSpec]  # one per parameter of the model: the checkpoint's tensors that build it
    tensors: TensorReader  # the tensors the specs read, by normalised name
    mtp: TensorReader  # the checkpoint's mtp.* tensors, by name

    def mtp_headers(self) -> dict[str, torch.Tensor]:
        """Every ``mtp.*`` tensor as its header describes it (meta tensors: ``TensorReader.meta``)."""
        try:
            return {name: self.mtp.meta(name) for name in self.mtp.files}
        finally:
            self.mtp.close()

    def close(self) -> None:
        self.tensors.close()
        self.mtp.close()


def check_weights(path: str | os.PathLike, model: HybridForCausalLM) -> CheckedWeights:
    """Another checkpoint of ``model`` (a training step's, say), checked as :func:`load_model` checks
    one but from its files' headers alone: no tensor data is read, nothing of ``model`` changes, and
    no file stays open.

    ``ValueError`` when the checkpoint's ``config.json`` describes another model (every field of
    ``ModelConfig`` must be equal, the dtype aside: the differing ones are named), or a tensor is
    missing, unexpected, not a float (``SOURCE_DTYPES``; the ``mtp.*`` ones too), or gives its
    parameter another shape (each spec run on meta tensors of the headers' shapes)."""
    path = Path(path)
    config = read_config(path, dtype=model.config.dtype)
    differ = config_differences(model.config, config)
    if differ:
        raise ValueError(f"{path}: config.json describes another model than the one loaded (it differs in "
                         f"{name_listing(differ)}); a weight update needs a checkpoint of the same model")
    cls = type(model)
    tensors, mtp = _index_checkpoint(path, cls, config)
    checked = CheckedWeights(path, _checkpoint_specs(path, cls, config, set(tensors.files)), tensors, mtp)
    try:
        with torch.device("meta"):  # the same specs, their own constants (µP row scales) on the meta device too
            specs = _checkpoint_specs(path, cls, config, set(tensors.files))
        build_parameters(specs, dict(model.named_parameters(remove_duplicate=False)), tensors.meta, "meta",
                         prefix=f"{path}: ")
        checked.mtp_headers()
    finally:
        checked.close()
    return checked


def config_differences(a: ModelConfig, b: ModelConfig) -> list[str]:
    """The names of the ``ModelConfig`` fields in which ``a`` and ``b`` differ (the raw
    ``config.json``, ``extra``, aside)."""
    return [f.name for f in dataclasses.fields(a) if f.compare and getattr(a, f.name) != getattr(b, f.name)]


@torch.no_grad()
def copy_weights_(module: nn.Module, specs: list[WeightSpec], get: Callable[[str], torch.Tensor],
                  prefix: str = "", owner: str = "", tensors: TensorReader | None = None) -> None:
    """Write every parameter of ``module`` in place, one at a time: built from its spec's source
    tensors (``get(name)``) as :func:`build_parameters` builds it, checked against its shape, then
    copied into it. Host memory holds one parameter's sources and value at most; the parameters'
    storage, layout and addresses stay (a CUDA graph replays the new values; a weight relaid
    column-major stays so), and a plain copy of the same sources into one storage (tied weights)
    is written once. Then every derived weight (``layers.DerivedWeight``) is recomputed.

    A parameter kept in float8 is written with its scales: from ``tensors`` as stored where they
    hold it quantized in its blocks, else built as any other and quantized in its blocks, as
    ``load_model(quantize_fp8=True)`` quantizes (a trainer's unquantized checkpoint, served in FP8).

    An error (a mis-shaped value: ``ValueError``; a failed read) is raised as it comes: the
    parameters before it are written, the others not, the derived weights stale."""
    params = dict(module.named_parameters(remove_duplicate=False))
    _check_targets(specs, params)
    written: set[tuple[int, tuple[str, ...]]] = set()  # (address, sources) of the plain copies written
    for spec in specs:
        param = params[spec.target]
        if spec.combine is None and (param.data_ptr(), spec.sources) in written:
            continue
        if is_fp8(param):
            module_name, _, name = spec.target.rpartition(".")
            owner_module = module.get_submodule(module_name)
            (scale, block), dtype = fp8_scales(owner_module, name), module.config.dtype
            tail = getattr(owner_module, f"{name}_tail", None)
            rows = param.shape[0] - (0 if tail is None else tail.shape[0])
            plan = _fp8_plan(spec, tensors, param, prefix, owner) if tensors is not None else None
            if plan is not None and (plan.block, plan.rows) == (block, rows):
                value, (new_scale, _, new_tail) = _build_fp8(spec, plan, param, tensors, prefix, owner, param.device,
                                                             dtype)
            else:  # built in the model's dtype, as load_model quantizes it
                dense = _build(spec, torch.empty(param.shape, dtype=dtype, device="meta"), get, prefix, owner)
                value, (new_scale, _, new_tail) = _quantized_rows(dense, block, rows)
            param.copy_(value)
            scale.copy_(new_scale)
            if tail is not None:
                tail.copy_(new_tail)
        else:
            param.copy_(_build(spec, param, get, prefix, owner))
        if spec.combine is None:
            written.add((param.data_ptr(), spec.sources))
    refresh_derived_weights_(module)


@torch.no_grad()
def copy_mtp_weights_(model: HybridForCausalLM, mtp: TensorReader) -> None:
    """``model.mtp_weights`` given the checkpoint's ``mtp.*`` tensors (``mtp``), where the model keeps
    any (none: it drafts with no MTP head, or its head took them: ``MtpHead.from_model(take=True)``):
    read one at a time and written in place where the names and the headers' shapes agree with the
    current ones and none is kept float8, else replaced by the new ones once all are read."""
    current = model.mtp_weights
    if not current:
        return
    if not model.mtp_scales and current.keys() == mtp.files.keys() \
            and all(current[n].shape == mtp.meta(n).shape for n in current):
        for name, tensor in current.items():
            tensor.copy_(mtp.get(name))
    else:
        new, scales = _read_mtp(mtp, model.config, model.embed_tokens.weight.device, bool(model.mtp_scales))
        current.clear()
        current.update(new)
        model.mtp_scales = scales


MtpScales = dict[str, tuple[torch.Tensor, tuple[int, int]]]  # a float8 mtp.* tensor's name -> (block scales, block)


def _read_mtp(mtp: TensorReader, config: ModelConfig, device: str | torch.device,
              keep_fp8: bool = False) -> tuple[dict[str, torch.Tensor], MtpScales]:
    """The ``mtp.*`` tensors as a model keeps them (``mtp_weights``), on its device: in its dtype, or
    with ``keep_fp8`` the quantized ones float8 as stored, with their scales in block form (``mtp_scales``)."""
    weights, scales = {}, {}
    for name in mtp.files:
        if keep_fp8 and mtp.quantized(name):
            q, scale, block = mtp.raw(name)
            weights[name], scales[name] = _owned(q.to(device), [q]), (_owned(scale.to(device), [scale]), block)
            continue
        source = mtp.get(name)
        weights[name] = _owned(source.to(device=device, dtype=config.dtype), [source])
    return weights, scales


class StoredTensors:
    """Tensors already in memory, some float8 with block scales (``model.mtp_weights`` and
    ``mtp_scales``), read as a :class:`TensorReader` reads a checkpoint: what :class:`KeepFp8` and
    :func:`build_parameters` take."""

    def __init__(self, tensors: dict[str, torch.Tensor], scales: MtpScales):
        self.tensors, self.scales = tensors, scales

    def meta(self, name: str) -> torch.Tensor:
        t = self.tensors[name]
        return torch.empty(t.shape, dtype=torch.float32 if name in self.scales else t.dtype, device="meta")

    def get(self, name: str) -> torch.Tensor:
        if name not in self.scales:
            return self.tensors[name]
        scale, block = self.scales[name]
        return Fp8Scheme(block).dequantize(self.tensors[name], scale)

    def quantized(self, name: str) -> bool:
        return name in self.scales

    def raw(self, name: str) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int]]:
        return self.tensors[name], *self.scales[name]

    def raw_block(self, name: str) -> tuple[int, int]:
        return self.scales[name][1]


@dataclass
class KeepFp8:
    """What :func:`build_parameters` keeps float8 (``load_model(keep_fp8=True)``): parameters named
    in ``targets`` whose sources in ``tensors`` are quantized and can stay so (:func:`_fp8_plan`);
    their scales, blocks and tails are left in ``scales`` by name."""

    tensors: TensorReader
    targets: set[str]
    scales: dict[str, tuple[torch.Tensor, tuple[int, int], torch.Tensor | None]] = \
        dataclasses.field(default_factory=dict)  # name -> (scales, block, tail)


def quantize_the_rest_(state: dict[str, torch.Tensor], keep: KeepFp8) -> None:
    """``load_model(quantize_fp8=True)``: each parameter of ``state`` that ``keep`` names and could not keep
    float8 from the checkpoint, quantized from its value per ``ONLINE_BLOCK`` block (its scales into ``keep``)."""
    online = Fp8Scheme(ONLINE_BLOCK)
    for name in sorted(keep.targets - keep.scales.keys()):
        q, scale = online.quantize(state[name])
        state[name], keep.scales[name] = q, (scale, online.block, None)


def build_parameters(specs: list[WeightSpec], params: dict[str, torch.Tensor], get: Callable[[str], torch.Tensor],
                     device: str | torch.device, prefix: str = "", owner: str = "",
                     keep: KeepFp8 | None = None, copy: bool = True) -> dict[str, torch.Tensor]:
    """Every parameter of ``params`` (name -> the parameter, possibly on the meta device) built from
    its spec's source tensors (``get(name)``), checked against its shape, in its dtype on ``device``;
    a plain copy of the same sources is built once, so tied weights share storage. ``copy`` False: a
    parameter that is a source as it is (its dtype, on ``device``) is that tensor, not a copy (the
    caller gives the sources up: ``MtpHead.from_model(take=True)``). ``ValueError``
    for a mis-shaped result (``prefix``, ``owner``: where, and whose parameter, in the message).
    Meta tensors from ``get`` and ``device="meta"``: the same checks, no data. With ``keep``, the
    parameters it can keep float8 are built in float8 from the sources as stored (:class:`KeepFp8`)."""
    _check_targets(specs, params)
    state: dict[str, torch.Tensor] = {}
    built: dict[tuple[str, ...], torch.Tensor] = {}  # plain copies, so tied weights share storage
    for spec in specs:
        target = params[spec.target]
        plan = _fp8_plan(spec, keep.tensors, target, prefix, owner) \
            if keep is not None and spec.target in keep.targets else None
        if plan is not None:
            state[spec.target], keep.scales[spec.target] = _build_fp8(spec, plan, target, keep.tensors, prefix, owner,
                                                                      device, target.dtype, copy)
            continue
        if spec.combine is None and spec.sources in built and built[spec.sources].dtype == target.dtype:
            state[spec.target] = built[spec.sources]
            continue
        state[spec.target] = _build(spec, target, get, prefix, owner, device, copy)
        if spec.combine is None:
            built[spec.sources] = state[spec.target]
    return state


def _build(spec: WeightSpec, target: torch.Tensor, get: Callable[[str], torch.Tensor], prefix: str,
           owner: str, device: str | torch.device | None = None, copy: bool = True) -> torch.Tensor:
    """``spec``'s value for the parameter ``target`` from its source tensors (``get(name)``) in
    ``target``'s dtype: on the sources' device (``device`` None: for a caller that copies it), else
    contiguous on ``device`` in memory of its own (:func:`_owned`; ``copy`` False: maybe a source's). ``ValueError`` when its shape is
    not ``target``'s, or the sources do not combine (rows of other widths stacked, row scales for
    another number of rows)."""
    sources = [get(name) for name in spec.sources]
    try:
        tensor = spec.build(sources)
    except (RuntimeError, ValueError, IndexError) as exc:  # (a combine's own check, e.g. heads that do not fit,
        # or torch's on a tensor of other dims: where, too)
        raise ValueError(f"{prefix}tensor(s) {_shapes_listing(spec.sources, sources)} do not make "
                         f"{owner}{spec.target}: {exc}") from exc
    if tuple(tensor.shape) != tuple(target.shape):
        raise ValueError(
            f"{prefix}tensor(s) {name_listing(spec.sources)} give shape {tuple(tensor.shape)} for "
            f"{owner}{spec.target}, the config implies {tuple(target.shape)}"
        )
    if device is None:
        return tensor.to(dtype=target.dtype)
    tensor = tensor.to(device=device, dtype=target.dtype).contiguous()
    return _owned(tensor, sources) if copy else tensor


class Fp8Plan(NamedTuple):
    """How a parameter is built in float8 from a checkpoint's tensors as stored (:func:`_fp8_plan`)."""

    block: tuple[int, int]
    head: int  # its first sources float8 (all of them, or a concatenation's leading ones; the rest its tail)
    rows: int  # its dim-0 rows those make (without a tail, all of them)
    # a row-regrouping combine's (weight_specs.row_segments) ranges, (source, first row, rows): its first `head`
    # ranges float8, the rest its tail (None: `head` counts sources)
    segments: tuple[tuple[int, int, int], ...] | None = None


def _fp8_plan(spec: WeightSpec, tensors: TensorReader, target: torch.Tensor, prefix: str = "",
              owner: str = "") -> Fp8Plan | None:
    """How ``spec``'s parameter ``target`` is built in float8 from ``tensors`` as stored, or None where it
    cannot be; ``ValueError`` as :func:`_build` first where the headers' shapes do not make ``target``'s (so
    :func:`_build_fp8` need not check them). A source is float8 with its scales where it is quantized in the
    block of the ones before it and, unless it is the last of its matrix, a whole number of blocks tall (else
    its last scale row would cover the next source's rows). A tail (Qwen3.5's Gated DeltaNet in projection
    ``[qkv | z | b | a]``, whose ``b`` and ``a`` rows are no whole blocks, or not quantized) is for a plain
    concatenation (``concat_rows``); a spec that changes values (not ``moves_rows_only``) has none. Headers
    alone are read."""
    if not spec.moves_rows_only:
        return None
    _build(spec, torch.empty(target.shape, device="meta"), tensors.meta, prefix, owner)
    if getattr(spec.combine, "row_segments", None) is not None:
        return _segments_plan(spec, tensors)
    n = len(spec.sources)
    group = getattr(spec.combine, "rows_group", 0) or n  # sources per concatenated matrix
    block, head, rows = None, 0, 0
    for i, name in enumerate(spec.sources):
        if not tensors.quantized(name):
            break
        own, height = tensors.raw_block(name), tensors.meta(name).shape[-2]
        if block not in (None, own) or ((i + 1) % group and height % own[0]):
            break  # (another block; or not the last of its matrix, and no whole number of blocks tall)
        block, head, rows = own, head + 1, rows + height
    if head == n:  # every source: the parameter's own rows
        return Fp8Plan(block, head, spec.build([tensors.meta(name) for name in spec.sources]).shape[0])
    if head and group == n and rows % block[0] == 0:
        return Fp8Plan(block, head, rows)
    return None


def _segments_plan(spec: WeightSpec, tensors: TensorReader) -> Fp8Plan | None:
    """:func:`_fp8_plan` for a row-regrouping combine (``weight_specs.row_segments``): its leading row
    ranges float8 where each is of a quantized source in one block, starts on a block and is whole blocks
    tall (the last range may end on its source's partial last block); the ranges after them its tail,
    which must start on a block."""
    shapes = [tuple(tensors.meta(name).shape) for name in spec.sources]
    segments = tuple(spec.combine.row_segments(shapes))
    block, head, rows = None, 0, 0
    for k, (s, first, n) in enumerate(segments):
        name = spec.sources[s]
        if not tensors.quantized(name):
            break
        own = tensors.raw_block(name)
        ends_partial = k == len(segments) - 1 and first + n == shapes[s][0]  # (its scales' last row: the source's)
        if block not in (None, own) or first % own[0] or (n % own[0] and not ends_partial):
            break
        block, head, rows = own, head + 1, rows + n
    if not head or (head < len(segments) and rows % block[0]):
        return None
    return Fp8Plan(block, head, rows, segments)


Fp8Value = tuple[torch.Tensor, tuple[torch.Tensor, tuple[int, int], torch.Tensor | None]]  # weight, (scale, block,
# tail: the dense rows after the float8 ones, or None)


def _build_fp8(spec: WeightSpec, plan: Fp8Plan, target: torch.Tensor, tensors: TensorReader, prefix: str, owner: str,
               device: str | torch.device, dtype: torch.dtype, copy: bool = True) -> Fp8Value:
    """``spec``'s parameter in float8 from its quantized sources as stored, as ``plan`` says
    (:func:`_fp8_plan`) -> ``(float8 value, (scales, block, tail))``, contiguous on ``device``: a
    tail's rows zero in the float8 value and its scales, built from its sources in ``dtype``;
    ``ValueError`` as :func:`_build` for a value not of ``target``'s shape."""
    if plan.segments is not None:
        return _build_fp8_segments(spec, plan, target, tensors, prefix, owner, device, dtype)
    fp8_names = spec.sources[:plan.head]
    raws = {name: tensors.raw(name) for name in fp8_names}
    if plan.head == len(spec.sources):
        value = _build(spec, torch.empty(target.shape, dtype=FP8, device="meta"), lambda name: raws[name][0], prefix,
                       owner, device, copy)
        scales = [raws[name][1] for name in fp8_names]  # (a file's memory, or a model's kept scales: copied)
        scale = spec.build(scales).to(device=device).contiguous()
        return value, (_owned(scale, scales) if copy else scale, plan.block, None)
    # a tail (a plain concatenation): the head as stored, the tail dequantized
    value = torch.zeros(target.shape, dtype=FP8, device=device)
    value[:plan.rows] = torch.cat([raws[name][0] for name in fp8_names]).to(device)
    scale = torch.zeros(Fp8Scheme(plan.block).scale_shape(target.shape), dtype=torch.float32, device=device)
    scale[:plan.rows // plan.block[0]] = torch.cat([raws[name][1] for name in fp8_names]).to(device)
    tail = torch.cat([tensors.get(name) for name in spec.sources[plan.head:]]).to(device=device, dtype=dtype)
    return value, (scale, plan.block, tail)


def _build_fp8_segments(spec: WeightSpec, plan: Fp8Plan, target: torch.Tensor, tensors: TensorReader, prefix: str,
                        owner: str, device: str | torch.device, dtype: torch.dtype) -> Fp8Value:
    """:func:`_build_fp8` for a row-regrouping combine: its float8 ranges' rows and their scales' rows moved
    alike, the rest its tail, built in ``dtype``."""
    fp8, dense = plan.segments[:plan.head], plan.segments[plan.head:]
    raws = {s: tensors.raw(spec.sources[s]) for s in dict.fromkeys(s for s, _, _ in fp8)}
    br = plan.block[0]
    value = torch.zeros(target.shape, dtype=FP8, device=device)
    value[:plan.rows] = torch.cat([raws[s][0][first:first + n] for s, first, n in fp8]).to(device)
    scale = torch.zeros(Fp8Scheme(plan.block).scale_shape(target.shape), dtype=torch.float32, device=device)
    scale[:-(-plan.rows // br)] = torch.cat([raws[s][1][first // br:-(-(first + n) // br)]
                                             for s, first, n in fp8]).to(device)
    tail = None
    if dense:
        values = {s: tensors.get(spec.sources[s]) for s in dict.fromkeys(s for s, _, _ in dense)}
        tail = torch.cat([values[s][first:first + n] for s, first, n in dense]).to(device=device, dtype=dtype)
    return value, (scale, plan.block, tail)


def _quantized_rows(dense: torch.Tensor, block: tuple[int, int], rows: int) -> Fp8Value:
    """A dense parameter value quantized in ``block`` as a kept one with ``rows`` float8 rows: the
    rest its tail (``_build_fp8``'s layout)."""
    value, scale = Fp8Scheme(block).quantize(dense)
    if rows == dense.shape[0]:
        return value, (scale, block, None)
    value[rows:] = 0
    scale[rows // block[0]:] = 0
    return value, (scale, block, dense[rows:].clone())


def _owned(tensor: torch.Tensor, sources: list[torch.Tensor]) -> torch.Tensor:
    """``tensor``, or a copy of it where it is still the memory of one of ``sources`` (a CPU
    parameter of the checkpoint's dtype, a plain copy of its tensor: safetensors' mapping of the
    file, ``TensorReader.get``). A GPU parameter, or one converted or combined, is a copy already."""
    if tensor.device.type != "meta" and any(
            s.device == tensor.device and s.untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr()
            for s in sources):
        return tensor.clone()
    return tensor


def _check_targets(specs: list[WeightSpec], params: dict[str, torch.Tensor]) -> None:
    """Internal: every spec targets a parameter of ``params``, and every parameter has a spec."""
    unknown = {spec.target for spec in specs} - set(params)
    if unknown:
        raise ValueError(f"internal: weight specs target unknown parameters {name_listing(unknown)}")
    unbuilt = set(params) - {spec.target for spec in specs}
    if unbuilt:
        raise ValueError(f"internal: no weight spec for parameters {name_listing(unbuilt)}")


def _index_checkpoint(path: Path, cls: type[HybridForCausalLM],
                      config: ModelConfig) -> tuple[TensorReader, TensorReader]:
    """The checkpoint's tensors the architecture reads (by normalised name) and its ``mtp.*`` ones;
    names the architecture ignores are dropped. In an FP8 checkpoint, a tensor's scales (and a
    per-tensor scheme's ``input_scale`` beside its weight) go with the tensor, not in the listing;
    scales of no tensor stay in it, as unexpected names."""
    scheme = read_quantization(path)
    shard = _shard_map(path)
    scales: dict[str, tuple[Path, str]] = {}  # a quantized tensor's name in its file -> its scales
    consumed: set[str] = set()
    if scheme is None:
        scale_names = [name for name in shard if name.endswith((BLOCK_SCALE, ".weight" + TENSOR_SCALE))]
        if scale_names:
            raise ValueError(f"{path}: the checkpoint holds FP8 scales ({name_listing(scale_names)}) but its "
                             f"config.json has no quantization_config")
    else:
        for name, file in shard.items():
            tensor = name.removesuffix(scheme.scale_suffix)
            if tensor != name and tensor in shard:
                scales[tensor] = (file, name)
                consumed.add(name)
            elif scheme.block is None and name.endswith(INPUT_SCALE) \
                    and name.removesuffix(INPUT_SCALE) + ".weight" in shard:
                consumed.add(name)
    files: dict[str, Path] = {}
    original: dict[str, str] = {}
    own_scales: dict[str, tuple[Path, str]] = {}  # by normalised name
    mtp: dict[str, Path] = {}
    for name, file in shard.items():
        if name in consumed:
            continue
        if name.startswith("mtp."):
            mtp[name] = file
            continue
        if cls.ignores_hf_name(config, name):
            continue
        normalised = cls.normalize_hf_name(name)
        if normalised is None:
            continue
        if normalised in files:
            raise ValueError(f"{path}: tensors {original[normalised]!r} and {name!r} are the same weight")
        files[normalised], original[normalised] = file, name
        if name in scales:
            own_scales[normalised] = scales[name]
    mtp_scales = {name: scales[name] for name in mtp if name in scales}
    return TensorReader(files, original, own_scales, scheme), TensorReader(mtp, scales=mtp_scales, scheme=scheme)


def _checkpoint_specs(path: Path, cls: type[HybridForCausalLM], config: ModelConfig,
                      available: set[str]) -> list[WeightSpec]:
    """One spec per parameter of ``cls`` for ``config``, in the layout the checkpoint holding the
    tensors ``available`` has (``choose_layouts``); ``ValueError`` unless those are exactly the
    tensors the specs read."""
    specs = choose_layouts(cls.hf_weight_specs(config), available)
    _check_names(path, config, specs, available)
    return specs


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
