"""FP8 checkpoints: float8 weights with their scales, read back to a model's dtype.

The FP8 releases of hybrid models (Qwen3-Next-80B-A3B-*-FP8, Qwen3.5's ``-FP8`` checkpoints)
store most projections as ``float8_e4m3fn`` with one fp32 scale per block of 128 x 128 weights,
and say so in ``config.json``::

    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                            "weight_block_size": [128, 128], "modules_to_not_convert": [...]}

A quantized tensor ``X`` (``...q_proj.weight``; a fused expert tensor has no ``.weight``) comes with
``X_scale_inv`` of shape ``[..., ceil(rows / 128), ceil(cols / 128)]`` over its last two dims, and
its value is ``X * X_scale_inv`` blockwise (the name is DeepSeek's: the inverse of the scale the
quantizer divided by). Without ``weight_block_size`` the scheme is per-tensor, as vLLM writes it:
one ``X_scale`` (``weight_scale``) per weight and an ``input_scale`` for a static activation scale.
Tensors the config leaves unconverted (norms, embeddings, gates) are plain float tensors.

The loader (``loader.TensorReader``) gives every quantized tensor to the weight specs already
dequantized, in fp32, so every architecture and layout reads FP8 checkpoints with no code of its
own, and the model computes in its dtype (weight-only dequantization, as vLLM's and
transformers' fallbacks where the GPU has no FP8 tensor cores; an ``input_scale`` is therefore not
used). The values are exactly transformers' (``FineGrainedFP8Config(dequantize=True)``).

:meth:`Fp8Scheme.quantize` is the inverse: an fp32 weight to float8 and its scales, the way tests
write FP8 checkpoints (``tests/checkpoints.py: quantize_checkpoint``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

import torch

FP8_DTYPES = {"F8_E4M3": torch.float8_e4m3fn}
"""The float8 tensors a quantized checkpoint may hold, by their dtype's name in a safetensors header."""
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448

BLOCK_SCALE = "_scale_inv"  # the block-wise scheme: tensor X's scales are X_scale_inv
TENSOR_SCALE = "_scale"  # the per-tensor scheme: weight X's scale is X_scale ...
INPUT_SCALE = ".input_scale"  # ... and its layer's static activation scale (unused: weight-only)


@dataclass(frozen=True)
class Fp8Scheme:
    """How a checkpoint's FP8 tensors are scaled: ``block = (rows, cols)`` of one scale (block-wise),
    or ``None`` (one scale per tensor)."""

    block: tuple[int, int] | None

    @classmethod
    def from_hf(cls, cfg: Mapping[str, Any]) -> "Fp8Scheme | None":
        """The scheme of a checkpoint's ``config.json`` (``quantization_config``; a vision-language
        config may hold it in its ``text_config``), ``None`` for an unquantized one. ``ValueError``
        for another quantization method or format."""
        qc = cfg.get("quantization_config")
        if qc is None and isinstance(cfg.get("text_config"), Mapping):
            qc = cfg["text_config"].get("quantization_config")
        if qc is None:
            return None
        if not isinstance(qc, Mapping):
            raise ValueError(f"config.json: quantization_config must be an object, got {qc!r}")
        method = qc.get("quant_method")
        if method != "fp8":
            raise ValueError(f"config.json: quantization_config.quant_method {method!r} is not supported; hyla reads "
                             f"unquantized checkpoints and FP8 ones (quant_method 'fp8', block-wise or per-tensor)")
        fmt = qc.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise ValueError(f"config.json: quantization_config.fmt {fmt!r} is not supported; FP8 checkpoints "
                             f"must be e4m3 (float8_e4m3fn)")
        block = qc.get("weight_block_size")
        if block is None:
            return cls(None)
        if (not isinstance(block, (list, tuple)) or len(block) != 2
                or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
            raise ValueError(f"config.json: quantization_config.weight_block_size must be two positive integers, "
                             f"got {block!r}")
        return cls((block[0], block[1]))

    @property
    def scale_suffix(self) -> str:
        """What a quantized tensor's name is followed by to name its scales."""
        return TENSOR_SCALE if self.block is None else BLOCK_SCALE

    def scale_shape(self, shape: torch.Size | tuple[int, ...]) -> tuple[int, ...]:
        """The shape of the scales of a quantized tensor of ``shape`` (per-tensor: a scalar, which
        checkpoints also write as ``[1]``)."""
        if self.block is None:
            return ()
        if len(shape) < 2:
            raise ValueError(f"a block-quantized tensor has at least two dims, got shape {tuple(shape)}")
        return (*shape[:-2], math.ceil(shape[-2] / self.block[0]), math.ceil(shape[-1] / self.block[1]))

    def scale_fits(self, tensor_shape: tuple[int, ...], scale_shape: tuple[int, ...]) -> bool:
        want = self.scale_shape(tensor_shape)
        return tuple(scale_shape) == want or (not want and tuple(scale_shape) == (1,))

    def dequantize(self, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """``q`` (float8) times its scales, blockwise over the last two dims -> fp32 of ``q``'s shape."""
        if not self.scale_fits(tuple(q.shape), tuple(scale.shape)):
            raise ValueError(f"scales of shape {tuple(scale.shape)} do not fit a tensor of shape {tuple(q.shape)}; "
                             f"expected {self.scale_shape(q.shape) or '[] or [1]'}")
        if self.block is None:
            return q.float() * scale.float().reshape(())
        rows, cols = q.shape[-2:]
        s = scale.float().repeat_interleave(self.block[0], dim=-2)[..., :rows, :]
        s = s.repeat_interleave(self.block[1], dim=-1)[..., :cols]
        return q.float() * s

    def quantize(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``w`` -> ``(float8 tensor, fp32 scales)`` whose :meth:`dequantize` is within float8's
        rounding of ``w``: each block (each tensor, per-tensor) scaled so that its largest magnitude is
        ``FP8_MAX``."""
        w = w.float()
        if self.block is None:
            scale = (w.abs().amax() / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)
            return (w / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale
        rows, cols = w.shape[-2:]
        br, bc = self.block
        nr, nc = math.ceil(rows / br), math.ceil(cols / bc)
        padded = w.new_zeros(*w.shape[:-2], nr * br, nc * bc)
        padded[..., :rows, :cols] = w
        blocks = padded.reshape(*w.shape[:-2], nr, br, nc, bc)
        scale = (blocks.abs().amax(dim=(-3, -1)) / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)  # [..., nr, nc]
        q = (blocks / scale[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return q.reshape(*w.shape[:-2], nr * br, nc * bc)[..., :rows, :cols].contiguous(), scale


# --- weights kept in FP8 ----------------------------------------------------------------------------
#
# With ``keep_fp8`` (``load_model``; the engine's ``fp8_weights``), a parameter whose checkpoint tensors
# are all quantized stays float8 where it can: a ``Linear``'s weight or a stack of expert weights
# (``keep_fp8_targets``), built from its tensors by rows alone (``WeightSpec.moves_rows_only``), each
# tensor's rows a whole number of blocks (so that the stacked scales still describe the stacked
# weight). Its scales go beside it, ``[..., ceil(rows / bn), ceil(cols / bk)]`` as a buffer named
# ``<param>_scale``, its block as the attribute ``<param>_block`` (a per-tensor scale is the block
# form of one block the tensor's size). Every other parameter is dequantized as above. The forward
# pass then computes ``x @ dequantize(W).to(x.dtype).T`` (:func:`fp8_linear`): on a GPU Triton
# kernels that dequantize tiles as they stream the float8 weight (``ops/gpu/fp8.py``, half the
# bytes of bf16), elsewhere this file's PyTorch reference. The numbers are the dequantized model's,
# but for the summation order of the kernels.

FP8 = torch.float8_e4m3fn


def is_fp8(t: torch.Tensor) -> bool:
    return t.dtype == FP8


def block_form(scheme: Fp8Scheme, q: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int]]:
    """``q``'s scales as a block grid over its last two dims -> ``(scale [..., rows', cols'] fp32,
    block)``: block-wise ones as they are, a per-tensor one as one block ``[rows, cols]``."""
    if scheme.block is not None:
        return scale.float(), scheme.block
    return scale.float().reshape(()).expand(*q.shape[:-2], 1, 1).contiguous(), (q.shape[-2], q.shape[-1])


ONLINE_BLOCK = (128, 128)  # the blocks of load_model(quantize_fp8=True): Qwen's and DeepSeek's


def keep_fp8_targets(model: torch.nn.Module) -> set[str]:
    """The parameters of ``model`` that may stay float8: every ``Linear``'s weight (but a module's
    whose ``keeps_fp8`` is False: ``lm_head``, a MoE router, a weight read as a matrix as
    Kimi-Linear's absorbed ``kv_b_proj``) and the stacked expert weights a module names in
    ``stacked_weights``."""
    from hyla.model.linear import Linear  # (linear.py imports this file)

    targets = set()
    for name, m in model.named_modules(remove_duplicate=False):  # (a module shared by layers: each of its names)
        prefix = f"{name}." if name else ""
        if isinstance(m, Linear) and getattr(m, "keeps_fp8", True):
            targets.add(prefix + "weight")
        targets.update(prefix + w for w in getattr(m, "stacked_weights", ()))
    return targets


def attach_scales_(model: torch.nn.Module,
                   scales: dict[str, tuple[torch.Tensor, tuple[int, int], torch.Tensor | None]]) -> None:
    """Give each float8 parameter of ``model`` (``scales``: its name -> its scales, block and tail)
    its ``<param>_scale`` buffer, ``<param>_block`` attribute and, with a tail, ``<param>_tail``
    buffer: the parameter's last rows in the model's dtype (their float8 rows and scales zero)."""
    for target, (scale, block, tail) in scales.items():
        module_name, _, param = target.rpartition(".")
        module = model.get_submodule(module_name)
        module.register_buffer(f"{param}_scale", scale)
        setattr(module, f"{param}_block", block)
        if tail is not None:
            module.register_buffer(f"{param}_tail", tail)


def fp8_scales(module: torch.nn.Module, param: str) -> tuple[torch.Tensor, tuple[int, int]] | None:
    """``(scale, block)`` of ``module``'s parameter ``param`` where it is float8, else None."""
    if not is_fp8(getattr(module, param)):
        return None
    return getattr(module, f"{param}_scale"), getattr(module, f"{param}_block")


def dequantized(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """A float8 weight kept with its block scales -> its value in ``dtype`` (what the loader would
    have built from the checkpoint without ``keep_fp8``)."""
    return Fp8Scheme(block).dequantize(weight, scale).to(dtype)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, dequantized(weight, scale, block, x.dtype), bias)``: on a GPU a Triton kernel
    reading the float8 weight (``ops/gpu/fp8.py``), elsewhere that reference."""
    from hyla.model.layers import device  # (the layers import linear.py, which imports this file)

    if device.on_gpu(x):
        rows = x.reshape(-1, x.shape[-1])
        if rows.stride(-1) != 1:  # (the kernels read rows of unit column stride; any row stride)
            rows = rows.contiguous()
        y = device.gpu("fp8").linear(rows, weight, scale, block, bias)
        return y.view(*x.shape[:-1], weight.shape[0])
    return torch.nn.functional.linear(x, dequantized(weight, scale, block, x.dtype), bias)
