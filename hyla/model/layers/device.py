"""Which path a layer runs: the Triton kernels on CUDA tensors, fla's chunked prefill.

The shared layers of this package ask through the module (``device.on_gpu(x)``, not a copy of the
function), so that a test or a benchmark sends all their CUDA paths through CPU tensors (Triton
interpreted) by patching one function: ``monkeypatch.setattr(device, "on_gpu", lambda x: True)``.
An architecture's file (``jamba.py``, ``kimi_linear.py``) imports the functions by name: a test
sends its own layers alone down their CUDA paths by patching them there.
"""
from __future__ import annotations

import importlib

import torch

from hyla.model.forward_batch import ForwardBatch
from hyla.model.ops.gpu import HAS_TRITON


def gpu(name: str):
    """``hyla.model.ops.gpu.<name>``, the Triton kernels, imported on first use (CPU runs never load
    Triton). Layers run them on CUDA tensors (:func:`on_gpu`) and the PyTorch ops elsewhere."""
    return importlib.import_module(f"hyla.model.ops.gpu.{name}")


def on_gpu(x: torch.Tensor) -> bool:
    return x.is_cuda and HAS_TRITON


def fla_prefill(x: torch.Tensor, batch: ForwardBatch) -> bool:
    """Whether a chunked extend runs fla's Triton kernel (``ops/gpu/fla_chunk.py``): on CUDA, with
    fla installed, for bf16/fp16 activations (fla's fp32 dots run in tf32, so fp32 models keep the
    exact PyTorch ops, as the cache's fp32 differential tests require), chains only (token trees
    take the PyTorch ops' tree scan; a short extend's chains run with the batch's ``varlen`` plan,
    built once per step)."""
    return (on_gpu(x) and x.dtype != torch.float32 and batch.tree_parents is None
            and gpu("fla_chunk").HAS_FLA)
