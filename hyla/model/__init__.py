"""hyla's model room: configs, layers, architectures, the loader and the ops.

Public API (see docs/architecture.md and docs/models.md)::

    from hyla.model import ModelConfig, load_model, ForwardBatch
    config = ModelConfig.from_hf(json.load(open("config.json")))
    model = load_model("path/to/checkpoint", dtype="bfloat16", device="cuda")
    logits = model(batch)  # [N, vocab] fp32

Names are imported lazily, so ``import hyla.model.forward_batch`` stays cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "ModelConfig": "hyla.model.config",
    "FlopCount": "hyla.model.flops",
    "SUPPORTED_ARCHITECTURES": "hyla.model.architectures",
    "ForwardBatch": "hyla.model.forward_batch",
    "HybridForCausalLM": "hyla.model.layers",
    "ARCHITECTURES": "hyla.model.architectures",
    "load_model": "hyla.model.loader",
    "read_config": "hyla.model.loader",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'hyla.model' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
