"""LoRA adapters: a PEFT checkpoint read into hyla's projections, and its low-rank update applied per row.

A LoRA adapter changes a projection ``y = W x`` into ``y = W x + s B A x`` (``A [r, in]``, ``B [out, r]``,
``s = lora_alpha / r``, or ``/ sqrt(r)`` with ``use_rslora``), for the Hugging Face modules its
``adapter_config.json`` targets. hyla serves several adapters, and the base model, in one batch: each
token row applies its own request's adapter, or none.

**Reading** (:func:`read_adapter`). A hyla parameter is built from checkpoint tensors (``WeightSpec``:
Qwen3-Next's ``in_proj_qkvz`` and ``in_proj_ba`` regrouped per head into one matrix, attention's q, k, v
concatenated). The adapter's update of the built weight is that same build applied to the sources'
updates; where the build only moves rows (``WeightSpec.moves_rows_only``) it stays low-rank: the
sources' ``A`` stacked (rank ``sum r_i``) and each source's ``s_i B_i`` placed in its own columns of a
``[out_i, sum r_i]`` block (zeros for a source the adapter leaves alone), those blocks built as the
weight is. A spec that changes values (a µP multiplier folded in), a target that is not a hyla
:class:`~hyla.model.linear.Linear` (embeddings, stacked experts) or one whose rows are not the step's
token rows (the LM head) is refused with a ``ValueError`` naming it, as is anything of PEFT hyla does
not apply (DoRA, trained biases, ``modules_to_save``). ``rank_pattern`` and ``alpha_pattern`` apply as in PEFT.

**Applying** (:class:`LoRABatch`, :class:`LinearLoRA`). An engine serving adapters gives each projection they may
target ``S`` adapter *slots* at start-up (:func:`enable_lora_`; ``S``, ``max_loras``), written in place when an
adapter is loaded (:func:`install_`): a CUDA graph captured at start-up applies whatever they hold. The runner
gives each step a :class:`LoRABatch` in ``ForwardBatch.lora``: each token row's slot (built on the host once per
step, or a graph's static input). The model binds it to its :class:`LoRAScope` for the forward; every projection
adds ``B (A x)`` to each row by its slot's adapter (a step mixing adapters: the slots in the same two GEMMs,
each row masked to its own; a CUDA graph's step on a GPU: punica's shrink and expand, ``ops/gpu/lora.py``). A step where no row has an adapter has no ``LoRABatch`` and costs the projections
one attribute test. The update is computed apart from ``W x`` (never merged into ``W``): the sum differs from a
merged weight's within rounding.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import torch

if TYPE_CHECKING:
    from hyla.model.layers.model import HybridForCausalLM

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
LORA_A, LORA_B = ".lora_A.weight", ".lora_B.weight"


@dataclass(frozen=True)
class LoRABatch:
    """A step's token rows by adapter slot (``LinearLoRA``: slot ``k`` in ``1..S`` holds one adapter; 0 is the base
    model). ``single``: the slot every row applies (an eager step of one adapter), else ``row_slot [num_rows]``,
    each row's slot, on the model's device; ``slots``: the slots the rows apply (host), or None for a CUDA graph's
    batch (:meth:`static`), whose rows may apply any."""

    num_rows: int
    single: int | None
    row_slot: torch.Tensor | None
    slots: frozenset[int] | None

    @staticmethod
    def of(slots: Sequence[int] | None, counts: Sequence[int], device: torch.device) -> LoRABatch | None:
        """The batch of sequences whose ``counts[i]`` rows (packed, in order) apply slot ``slots[i]`` (0: none);
        None where no sequence has one (``slots`` None: none has)."""
        used = frozenset(slot for slot, n in zip(slots, counts) if slot and n) if slots is not None else ()
        if not used:
            return None
        if len(used) == 1 and all(slot for slot, n in zip(slots, counts) if n):
            return LoRABatch(sum(counts), next(iter(used)), None, used)
        rows = [slot for slot, n in zip(slots, counts) for _ in range(n)]
        return LoRABatch(len(rows), None, torch.tensor(rows, dtype=torch.long).to(device), used)

    @staticmethod
    def static(row_slot: torch.Tensor) -> LoRABatch:
        """A CUDA graph's batch: ``row_slot`` its static input (``[num_rows]``, any slots), which each replay's
        step fills; its projections run punica's kernels on CUDA (``sgmv_kernels``), else the masked GEMMs over every
        slot, and read nothing from the host."""
        return LoRABatch(row_slot.shape[0], None, row_slot, None)


class LoRAScope:
    """The adapters' view of the step being run: the model binds ``batch`` (``ForwardBatch.lora``) for the
    length of its forward (:meth:`bind`); its projections read it. One per model, created by :func:`enable_lora_`
    with the slot count ``slots``."""

    def __init__(self, slots: int) -> None:
        self.slots = slots
        self.batch: LoRABatch | None = None
        self._drops: dict[int, torch.Tensor] = {}

    @contextmanager
    def bind(self, batch: LoRABatch | None):
        """``batch`` applies to the projections run inside the block."""
        self.batch, self._drops = batch, {}
        try:
            yield
        finally:
            self.batch, self._drops = None, {}

    def drop(self, width: int, device: torch.device) -> torch.Tensor:
        """``[num_rows, S * width]``: which rank columns of a projection whose slots are ``width`` wide each row
        drops (all but its own slot's), made once per step and width (inside a CUDA graph: by the graph, from
        its static ``row_slot``)."""
        d = self._drops.get(width)
        if d is None:
            owner = torch.arange(self.slots * width, device=device) // width + 1  # each column's slot
            d = self._drops[width] = self.batch.row_slot[:, None] != owner[None, :]
        return d


class LinearLoRA:
    """The adapter slots of one projection. Slot ``k`` (``1..S``) holds an adapter's ``A^T`` in columns
    ``[(k - 1) W, (k - 1) W + r)`` of ``at [in, S W]`` and its ``B^T`` (the scale in it) in those rows of
    ``bt [S W, out]``, zeros past its rank ``r`` here (all zeros: an empty slot, or an adapter that leaves this
    projection alone). ``W``, the slot width, is the largest rank an adapter may have here. Allocated once
    (:func:`enable_lora_`) and written in place: a CUDA graph captured once reads whatever the slots hold.

    An eager step of one adapter adds ``B (A x)``, from a contiguous copy of its slot (two small GEMMs: at a few rows
    ``addmm_(mm(x, A^T), B^T)`` takes ~30-50% less time than ``F.linear`` twice and an add on a CPU:
    docs/benchmarks.md, "LoRA adapters"). A CUDA graph's step on a GPU runs punica's shrink and expand kernels
    (``ops/gpu/lora.py``: each row reads its own slot's columns). A step mixing adapters (or an adapter and the
    base model) elsewhere runs the same two GEMMs over all the slots (eager: those from its first adapter's to
    its last's), each row's columns of the other slots zeroed between them (``masked_fill``: an adapter's ``A x``
    never reaches another row, even overflowed to inf, which a multiply by zero would make NaN; ``read_adapter``
    refuses values that are not finite): the op count does not grow with the adapters, and the shapes depend on
    the row count alone."""

    def __init__(self, scope: LoRAScope, in_features: int, out_features: int, width: int, device: torch.device,
                 dtype: torch.dtype):
        self.scope, self.width = scope, width
        self.at = torch.zeros(in_features, scope.slots * width, device=device, dtype=dtype)
        self.bt = torch.zeros(scope.slots * width, out_features, device=device, dtype=dtype)
        # each slot holding something here: its A^T [in, r] and B^T [r, out] contiguous too, for eager steps of one
        # adapter (a column slice of ``at`` takes MKL 1.5-2x the time: 27 against 15 µs a projection at one row,
        # 256 -> 768, rank 48)
        self.dense: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.ranks_dev = torch.zeros(scope.slots + 1, dtype=torch.int32, device=device)  # each slot's rank (0: none)

    @property
    def nbytes(self) -> int:
        """The slots' bytes (each adapter's contiguous copy comes with it, at its own rank)."""
        return self.at.nbytes + self.bt.nbytes

    def write(self, slot: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """Put an adapter's ``A [r, in]`` and ``B [out, r]`` (scaled) in ``slot``."""
        self.clear(slot)
        first, r = (slot - 1) * self.width, a.shape[0]
        self.at[:, first:first + r].copy_(a.t())
        self.bt[first:first + r].copy_(b.t())
        self.ranks_dev[slot] = r
        self.dense[slot] = (self.at[:, first:first + r].contiguous(), self.bt[first:first + r].contiguous())

    def clear(self, slot: int) -> None:
        first = (slot - 1) * self.width
        self.at[:, first:first + self.width].zero_()
        self.bt[first:first + self.width].zero_()
        self.ranks_dev[slot] = 0
        self.dense.pop(slot, None)

    def add_(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``y += B (A x)`` on each row of the bound step, by its slot's adapter (``x [..., in]``, ``y [..., out]``)."""
        batch = self.scope.batch
        if batch is None:
            return y
        x2, y2 = x.reshape(-1, x.shape[-1]), y.view(-1, y.shape[-1])
        if x2.shape[0] != batch.num_rows:  # (an invariant: read_adapter refuses projections of other rows)
            raise RuntimeError(f"a LoRA projection got {x2.shape[0]} rows; the step has {batch.num_rows}")
        if batch.single is not None:
            dense = self.dense.get(batch.single)
            if dense is not None:  # (else the adapter leaves this projection alone)
                y2.addmm_(torch.mm(x2, dense[0]), dense[1])  # [T, r] -> [T, out]
            return y
        if batch.slots is None and sgmv_kernels(x2):  # a CUDA graph's step: each row reads its own slot only
            from hyla.model.ops.gpu import lora as kernels

            xa = kernels.shrink(x2, self.at, batch.row_slot, self.ranks_dev, self.width)  # [T, W] fp32
            kernels.expand_(y2, xa, self.bt, batch.row_slot, self.ranks_dev, self.width)
            return y
        cols = slice(None)  # a graph's step: every slot
        if batch.slots is not None:  # an eager step: the slots from its first adapter's to its last's
            held = [s for s in batch.slots if s in self.dense]
            if not held:
                return y  # (none of its adapters reaches this projection)
            cols = slice((min(held) - 1) * self.width, max(held) * self.width)
        xa = torch.mm(x2, self.at[:, cols])  # [T, S W] (or the slots' columns)
        xa.masked_fill_(self.scope.drop(self.width, xa.device)[:, cols], 0)  # each row keeps its own slot's columns
        y2.addmm_(xa, self.bt[cols])  # [T, out]
        return y


def sgmv_kernels(x: torch.Tensor) -> bool:
    """Whether a CUDA graph's step applies the slots through the Triton kernels (``ops/gpu/lora.py``: each row
    its own slot; on CUDA) rather than the masked GEMMs over every slot (the PyTorch form, their oracle)."""
    from hyla.model.ops.gpu import HAS_TRITON

    return x.is_cuda and HAS_TRITON


def enable_lora_(model: HybridForCausalLM, slots: int, widths: dict[str, int]) -> LoRAScope:
    """Give ``model`` a :class:`LoRAScope` of ``slots`` adapter slots and each projection named in ``widths``
    (:func:`lora_widths`) its :class:`LinearLoRA`, slots that wide, zeroed, in the model's dtype on its device;
    returns the scope."""
    if model.lora_scope is not None:
        raise ValueError("this model already serves LoRA adapters")
    if slots < 1:
        raise ValueError(f"LoRA needs at least one adapter slot, got {slots}")
    scope = model.lora_scope = LoRAScope(slots)
    for name, width in widths.items():
        module = model.get_submodule(name)
        module.lora = LinearLoRA(scope, module.in_features, module.out_features, width, module.weight.device,
                                 model.config.dtype)
    return scope


def lora_widths(model: HybridForCausalLM, base_path: str | Path, max_rank: int) -> dict[str, int]:
    """``{module name: slot width}`` for every projection of ``model`` (loaded from ``base_path``) an adapter may
    target: ``max_rank`` times the most checkpoint tensors a layout of its weight stacks (an adapter of each,
    :func:`read_adapter`), over the projections that are :class:`~hyla.model.linear.Linear`, not refused, and
    built by moving rows only."""
    from hyla.model.linear import Linear

    _, layouts = _layouts(model, Path(base_path))
    widths = {}
    for target, specs in layouts.items():
        name = target.removesuffix(".weight")
        sources = [len(spec.sources) for spec in specs if spec.moves_rows_only]
        if not target.endswith(".weight") or not sources:
            continue
        try:
            module = model.get_submodule(name)
        except AttributeError:
            continue
        if isinstance(module, Linear) and not module.lora_refused:
            widths[name] = max_rank * max(sources)
    return widths


def _layouts(model: HybridForCausalLM, base_path: Path) -> tuple[object, dict[str, list]]:
    """The checkpoint's reader and every layout's ``WeightSpec`` of each target weight (the checkpoint's
    first, then the model's other layouts)."""
    from hyla.model.loader import _checkpoint_specs, _index_checkpoint

    cls = type(model)
    reader, _ = _index_checkpoint(base_path, cls, model.config)
    chosen = {spec.target: spec for spec in _checkpoint_specs(base_path, cls, model.config, set(reader.files))}
    layouts: dict[str, list] = {}
    for spec in [*chosen.values(), *cls.hf_weight_specs(model.config)]:
        if spec not in layouts.setdefault(spec.target, []):
            layouts[spec.target].append(spec)
    return reader, layouts


@dataclass(frozen=True)
class LoRAAdapter:
    """An adapter read for a model: ``weights[module] = (A, B)`` per hyla projection (module name), fp32
    on the CPU, the scale in ``B``; ``rank`` its largest source rank; ``digest`` names its content (the
    prefix cache's namespace of its requests: the same files give the same digest in any process)."""

    path: str
    rank: int
    digest: str
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]


def read_adapter(path: str | Path, model: HybridForCausalLM, base_path: str | Path, max_rank: int) -> LoRAAdapter:
    """Read the PEFT LoRA adapter directory ``path`` for ``model`` (loaded from the checkpoint at
    ``base_path``, whose tensor layout says how hyla built each weight). ``ValueError`` with the reason for a
    directory that is not such an adapter, a rank above ``max_rank``, shapes that do not fit the model, and
    anything hyla does not apply (see the module docstring)."""
    from safetensors.torch import load as load_safetensors

    from hyla.model.linear import Linear

    if not isinstance(path, (str, Path)):
        raise ValueError(f"a LoRA adapter's path must be a directory's path, got {path!r:.80}")
    path = Path(path)
    config_bytes, config = _adapter_config(path)
    weights_file = path / WEIGHTS_FILE
    if not weights_file.is_file():
        raise ValueError(f"{path}: no {WEIGHTS_FILE} (a PEFT adapter saved with safe_serialization)")
    data = weights_file.read_bytes()  # (read once: the digest names the very bytes parsed)
    try:
        tensors = load_safetensors(data)
    except Exception as exc:  # (safetensors raises its own errors for a file it cannot read)
        raise ValueError(f"{weights_file}: not a safetensors file safetensors can read ({exc})") from None
    pairs = _lora_pairs(path, tensors)
    scale_of = _scales(config)
    cls = type(model)
    reader, layouts = _layouts(model, Path(base_path))  # every layout's spec of each target (the checkpoint's first)
    touched: dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}  # target -> source -> (A, sB)
    for module, (a, b) in pairs.items():
        name = cls.normalize_hf_name(module + ".weight")
        targets = {t for t, specs in layouts.items() for spec in specs if name in spec.sources} if name else set()
        if not targets and cls.ignores_hf_name(model.config, module + ".weight"):  # a repeat of a shared weight
            if any(m != module and torch.equal(a, o[0]) and torch.equal(b, o[1]) for m, o in pairs.items()):
                continue  # (the same module, so the same adapter, saved under each of its names)
            raise ValueError(f"{path}: the adapter targets {module!r}, a repeat of a shared block's weight (Zamba2's), "
                             f"with an adapter of its own: hyla runs one copy of the block, with one adapter")
        if not targets:
            raise ValueError(f"{path}: the adapter targets {module!r}, which is no weight of this "
                             f"{model.config.architecture} checkpoint")
        if len(targets) > 1:  # (its update would have to reach every one of them)
            raise ValueError(f"{path}: the adapter targets {module!r}, whose weight hyla builds into several "
                             f"({', '.join(sorted(targets))}): not supported")
        r = a.shape[0]
        if not 0 < r <= max_rank:
            raise ValueError(f"{path}: {module!r} has rank {r}; ranks go from 1 to max_lora_rank, {max_rank}")
        if b.shape[1] != r:
            raise ValueError(f"{path}: {module!r}'s lora_A is {tuple(a.shape)} and lora_B {tuple(b.shape)}: "
                             f"ranks differ")
        touched.setdefault(targets.pop(), {})[name] = (a.float(), b.float() * scale_of(module, r))
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for target, parts in touched.items():
        module_name = target.removesuffix(".weight")
        module = model.get_submodule(module_name) if target.endswith(".weight") else None
        what = f"{path}: the adapter targets {', '.join(map(repr, parts))} (hyla's {module_name})"
        if not isinstance(module, Linear) or module.lora_refused:
            why = module.lora_refused if isinstance(module, Linear) and module.lora_refused else \
                "not a projection hyla applies adapters to"
            raise ValueError(f"{what}: {why}")
        # the layout the adapter names: the checkpoint's, or another of the same weight (transformers' modules
        # as they are in memory, where its checkpoint holds them fused: Lara-4-Mini's in_proj)
        spec = next((s for s in layouts[target] if set(parts) <= set(s.sources)), None)
        if spec is None:
            raise ValueError(f"{what}: no layout of the weight holds all of them")
        if not spec.moves_rows_only:
            raise ValueError(f"{what}, which hyla builds with more than moved rows (e.g. a multiplier folded "
                             f"in): not supported")
        weights[module_name] = low = _low_rank(what, spec, parts, _source_rows(what, spec, parts, reader, module), module)
        # finite as the slots hold it (scaled by lora_alpha / r, in the model's dtype): an inf in a slot would make
        # every row of a mixed step NaN (0 x inf), the base model's too, and the cache would keep them
        dtype = module.lora.at.dtype if module.lora is not None else torch.float32
        if not all(torch.isfinite(t.to(dtype)).all() for t in low):
            raise ValueError(f"{what}: its update is not finite in {dtype} once scaled by lora_alpha / r")
    digest = hashlib.sha256(config_bytes + data).hexdigest()[:16]
    return LoRAAdapter(str(path), max(a.shape[0] for a, _ in pairs.values()), digest, weights)


def _source_rows(what: str, spec, parts: dict, reader, module) -> list[int]:
    """The rows of each of ``spec``'s sources: the checkpoint's tensor's, else the adapter's ``B``'s, else
    (one source alone unknown) what the others leave of the weight's."""
    rows = [reader.meta(s).shape[0] if s in reader.files else parts[s][1].shape[0] if s in parts else None
            for s in spec.sources]
    unknown = [i for i, n in enumerate(rows) if n is None]
    if len(unknown) > 1:
        raise ValueError(f"{what}: the sizes of {', '.join(spec.sources[i] for i in unknown)} are unknown here")
    if unknown:
        rows[unknown[0]] = module.out_features - sum(n for n in rows if n is not None)
        if rows[unknown[0]] < 0:
            raise ValueError(f"{what}: its lora_B have more rows than the weight ({module.out_features})")
    return rows


def _low_rank(what: str, spec, parts: dict, rows: list[int], module) -> tuple[torch.Tensor, torch.Tensor]:
    """The update of the weight ``spec`` builds from its sources, whose adapted ones are ``parts[source] = (A,
    sB)``, as ``(A [R, in], B [out, R])``: the ``A`` stacked, each ``B`` in its own columns of a block of its
    source's ``rows`` (zeros for the others), the blocks built as the weight is (moving rows only)."""
    ranks = [parts[s][0].shape[0] if s in parts else 0 for s in spec.sources]
    total = sum(ranks)
    blocks, offset = [], 0
    for source, r, n in zip(spec.sources, ranks, rows):
        block = torch.zeros(n, total)
        if r:
            a, b = parts[source]
            if b.shape[0] != n or a.shape[1] != module.in_features:
                raise ValueError(f"{what}: {source.removesuffix('.weight')!r}'s adapter is {b.shape[0]} x "
                                 f"{a.shape[1]}; the model's weight is {n} x {module.in_features}")
            block[:, offset:offset + r] = b
        blocks.append(block)
        offset += r
    try:
        big_b = spec.build(blocks)
    except (RuntimeError, IndexError) as exc:  # (blocks of sizes the layout does not take)
        raise ValueError(f"{what}: its update does not fit the weight's layout ({exc})") from None
    if tuple(big_b.shape) != (module.out_features, total):
        raise ValueError(f"{what}: its update came out {tuple(big_b.shape)}, not {(module.out_features, total)}")
    big_a = torch.cat([parts[s][0] for s in spec.sources if s in parts])
    return big_a.contiguous(), big_b.contiguous()


def install_(model: HybridForCausalLM, slot: int, adapter: LoRAAdapter) -> None:
    """Write ``adapter``'s weights into slot ``slot`` of ``model``'s projections (each :class:`LinearLoRA` in
    place, in the model's dtype: a weight kept in FP8 too, its projection's output is in the model's dtype)."""
    check_fits(model, adapter)  # (all checked before any is written)
    for name, lora in _slots(model):  # (each cleared once: by its write, else emptied)
        if name in adapter.weights:
            lora.write(slot, *adapter.weights[name])
        else:
            lora.clear(slot)


def check_fits(model: HybridForCausalLM, adapter: LoRAAdapter) -> None:
    """``ValueError`` where one of ``adapter``'s projections has no slots, or slots too narrow for its rank
    (never, for an adapter ``read_adapter`` read for this model: it and :func:`lora_widths` read the same
    layouts)."""
    for name, (a, _) in adapter.weights.items():
        lora = model.get_submodule(name).lora
        if lora is None or a.shape[0] > lora.width:
            raise ValueError(f"{adapter.path}: {name} takes no adapter of rank {a.shape[0]} here")


def uninstall_(model: HybridForCausalLM, slot: int) -> None:
    """Empty slot ``slot`` of ``model``'s projections."""
    for _, lora in _slots(model):
        lora.clear(slot)


def _slots(model: HybridForCausalLM) -> list[tuple[str, LinearLoRA]]:
    """``(module name, its LinearLoRA)`` of every projection of ``model`` that takes adapters."""
    from hyla.model.linear import Linear

    return [(name, m.lora) for name, m in model.named_modules() if isinstance(m, Linear) and m.lora is not None]


def _adapter_config(path: Path) -> tuple[bytes, dict]:
    """``adapter_config.json``'s bytes and object; ``ValueError`` for what hyla does not apply."""
    if not path.is_dir():
        raise ValueError(f"{path}: no such directory (a LoRA adapter is a directory with {CONFIG_FILE} and "
                         f"{WEIGHTS_FILE})")
    file = path / CONFIG_FILE
    if not file.is_file():
        raise ValueError(f"{path}: no {CONFIG_FILE} (not a PEFT adapter directory)")
    raw = file.read_bytes()
    try:
        config = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"{file}: not JSON ({exc})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{file}: not a JSON object")
    kind = config.get("peft_type", "LORA")
    if kind != "LORA":
        raise ValueError(f"{file}: peft_type {kind!r}; hyla serves LORA adapters")
    refused = [(config.get("use_dora"), "use_dora (DoRA)"), (config.get("bias", "none") != "none", "trained biases"),
               (config.get("modules_to_save"), "modules_to_save (whole modules)"),
               (config.get("fan_in_fan_out"), "fan_in_fan_out")]
    for given, what in refused:
        if given:
            raise ValueError(f"{file}: {what} is not supported by hyla's LoRA")
    pattern = config.get("alpha_pattern") or {}
    if not isinstance(pattern, dict):
        raise ValueError(f"{file}: alpha_pattern must be an object, got {pattern!r:.80}")
    for alpha in [config.get("lora_alpha", 8), *pattern.values()]:
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
            raise ValueError(f"{file}: lora_alpha must be a number, got {alpha!r}")
    for key in pattern:
        try:
            re.compile(key)
        except re.error as exc:
            raise ValueError(f"{file}: alpha_pattern key {key!r} is not a regular expression ({exc})") from None
    if not isinstance(config.get("use_rslora", False), bool):
        raise ValueError(f"{file}: use_rslora must be true or false, got {config['use_rslora']!r:.80}")
    return raw, config


def _scales(config: dict):
    """``(module, r) -> s``: PEFT's scale of a rank-``r`` module, ``alpha / r`` (``/ sqrt(r)`` with
    ``use_rslora``), ``alpha`` the ``alpha_pattern`` entry matching the module's name as PEFT matches it
    (``peft.utils.other.get_pattern_key``: the first key that is a suffix of whole name parts, as a regex),
    else ``lora_alpha``."""
    alpha, rs, pattern = float(config.get("lora_alpha", 8)), bool(config.get("use_rslora")), \
        config.get("alpha_pattern") or {}

    def scale(module: str, r: int) -> float:
        key = next((k for k in pattern if re.match(rf"(.*\.)?({k})$", module)), None)
        a = float(pattern[key]) if key is not None else alpha
        return a / math.sqrt(r) if rs else a / r
    return scale


def _lora_pairs(path: Path, tensors: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The adapter's ``{HF module name: (lora_A [r, in], lora_B [out, r])}``; ``ValueError`` for any other tensor
    (embedding adapters, DoRA magnitudes) or an unpaired one."""
    pairs: dict[str, list] = {}
    for name, t in tensors.items():
        module = name.removeprefix(PEFT_PREFIX)
        for i, suffix in enumerate((LORA_A, LORA_B)):
            if module.endswith(suffix):
                if t.dim() != 2 or not t.is_floating_point():
                    raise ValueError(f"{path}: {name} is {t.dtype} of shape {tuple(t.shape)}, not a float matrix")
                if not torch.isfinite(t).all():
                    raise ValueError(f"{path}: {name} holds values that are not finite (NaN or inf)")
                pairs.setdefault(module.removesuffix(suffix), [None, None])[i] = t
                break
        else:
            whole = ".base_layer." in name or not (".lora_" in name)
            raise ValueError(f"{path}: tensor {name!r} is " + (
                "a whole weight (PEFT saves those for modules_to_save, or embedding layers with "
                "save_embedding_layers)" if whole else "not a LoRA A or B matrix of a projection")
                + "; hyla applies the lora_A and lora_B of projections only")
    for module, (a, b) in pairs.items():
        if a is None or b is None:
            raise ValueError(f"{path}: {module!r} has {'no lora_A' if a is None else 'no lora_B'}")
    if not pairs:
        raise ValueError(f"{path}: {WEIGHTS_FILE} holds no LoRA tensors")
    return {m: (a, b) for m, (a, b) in pairs.items()}
