"""The architecture registry: Hugging Face architecture name -> model class and ``config.json`` parser.

Each architecture lives in one file that holds its model class (layers, checkpoint layout) and its
``parse_hf_config(cfg, arch, dtype) -> dict`` (the ``ModelConfig`` keyword arguments read from a
decoded ``config.json``). Adding an architecture is that file plus one line in ``ARCHITECTURES``.

``ModelConfig.from_hf`` and ``load_model`` read this registry; ``hyla.model.config`` imports it
only inside ``from_hf`` (the architecture files import the config module and the layers).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch

from hyla.model import (
    bailing_hybrid,
    bamba,
    falcon_h1,
    granitemoehybrid,
    jamba,
    kimi_linear,
    lara_mini,
    lfm2,
    lfm2_moe,
    lfm3,
    mamba,
    mamba2,
    minimax,
    nemotron_h,
    olmo_hybrid,
    qwen3_5,
    qwen3_5_moe,
    qwen3_next,
    zamba2,
)
from hyla.model.layers import HybridForCausalLM

ConfigParser = Callable[[Mapping[str, Any], str, str | torch.dtype | None], dict[str, Any]]


@dataclass(frozen=True)
class Architecture:
    """One registered architecture: ``load_model`` builds ``model_class``; ``ModelConfig.from_hf``
    calls ``parse_config`` (which raises ``ValueError`` for a config it cannot serve)."""

    model_class: type[HybridForCausalLM]
    parse_config: ConfigParser  # (decoded config.json, architecture name, dtype override) -> ModelConfig kwargs
    hf_model_type: str  # config.json "model_type" that names this architecture when "architectures" is absent


ARCHITECTURES: dict[str, Architecture] = {
    "Qwen3NextForCausalLM": Architecture(qwen3_next.Qwen3NextForCausalLM, qwen3_next.parse_hf_config, "qwen3_next"),
    "Qwen3_5ForCausalLM": Architecture(qwen3_5.Qwen3_5ForCausalLM, qwen3_5.parse_hf_config, "qwen3_5_text"),
    "Qwen3_5ForConditionalGeneration": Architecture(qwen3_5.Qwen3_5ForCausalLM, qwen3_5.parse_hf_config, "qwen3_5"),
    "Qwen3_5MoeForCausalLM": Architecture(
        qwen3_5_moe.Qwen3_5MoeForCausalLM, qwen3_5_moe.parse_hf_config, "qwen3_5_moe_text"),
    "Qwen3_5MoeForConditionalGeneration": Architecture(
        qwen3_5_moe.Qwen3_5MoeForCausalLM, qwen3_5_moe.parse_hf_config, "qwen3_5_moe"),
    "NemotronHForCausalLM": Architecture(nemotron_h.NemotronHForCausalLM, nemotron_h.parse_hf_config, "nemotron_h"),
    "FalconH1ForCausalLM": Architecture(falcon_h1.FalconH1ForCausalLM, falcon_h1.parse_hf_config, "falcon_h1"),
    "BambaForCausalLM": Architecture(bamba.BambaForCausalLM, bamba.parse_hf_config, "bamba"),
    "GraniteMoeHybridForCausalLM": Architecture(
        granitemoehybrid.GraniteMoeHybridForCausalLM, granitemoehybrid.parse_hf_config, "granitemoehybrid"),
    "Lfm2ForCausalLM": Architecture(lfm2.Lfm2ForCausalLM, lfm2.parse_hf_config, "lfm2"),
    "Lfm2MoeForCausalLM": Architecture(lfm2_moe.Lfm2MoeForCausalLM, lfm2_moe.parse_hf_config, "lfm2_moe"),
    "KimiLinearForCausalLM": Architecture(
        kimi_linear.KimiLinearForCausalLM, kimi_linear.parse_hf_config, "kimi_linear"),
    "JambaForCausalLM": Architecture(jamba.JambaForCausalLM, jamba.parse_hf_config, "jamba"),
    "MambaForCausalLM": Architecture(mamba.MambaForCausalLM, mamba.parse_hf_config, "mamba"),
    "FalconMambaForCausalLM": Architecture(mamba.FalconMambaForCausalLM, mamba.parse_hf_config, "falcon_mamba"),
    "Mamba2ForCausalLM": Architecture(mamba2.Mamba2ForCausalLM, mamba2.parse_hf_config, "mamba2"),
    "BailingHybridForCausalLM": Architecture(
        bailing_hybrid.BailingHybridForCausalLM, bailing_hybrid.parse_hf_config, "bailing_hybrid"),
    "OlmoHybridForCausalLM": Architecture(
        olmo_hybrid.OlmoHybridForCausalLM, olmo_hybrid.parse_hf_config, "olmo_hybrid"),
    "LaraMiniForCausalLM": Architecture(lara_mini.LaraMiniForCausalLM, lara_mini.parse_hf_config, "lara_mini"),
    "Lfm3ForCausalLM": Architecture(lfm3.Lfm3ForCausalLM, lfm3.parse_hf_config, "lfm3"),
    "Zamba2ForCausalLM": Architecture(zamba2.Zamba2ForCausalLM, zamba2.parse_hf_config, "zamba2"),
    "MiniMaxForCausalLM": Architecture(minimax.MiniMaxForCausalLM, minimax.parse_hf_config, "minimax"),
    # MiniMax's own names for the same checkpoints (its config keys: minimax.parse_hf_config), as vLLM registers them
    "MiniMaxText01ForCausalLM": Architecture(minimax.MiniMaxForCausalLM, minimax.parse_hf_config, "minimax_text_01"),
    "MiniMaxM1ForCausalLM": Architecture(minimax.MiniMaxForCausalLM, minimax.parse_hf_config, "minimax_m1"),
}

SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(ARCHITECTURES)


def architecture_name(cfg: Mapping[str, Any]) -> str:
    """The registered architecture of a ``config.json`` dict: the first supported name in
    ``architectures``, else (no ``architectures`` at all) the one whose ``hf_model_type`` is
    ``model_type``. Raises ``ValueError`` listing the supported names otherwise."""
    archs = cfg.get("architectures") or []
    for arch in archs:
        if arch in ARCHITECTURES:
            return arch
    model_type = cfg.get("model_type")
    if not archs:
        for arch, entry in ARCHITECTURES.items():
            if entry.hf_model_type == model_type:
                return arch
    raise ValueError(
        f"unsupported architecture {archs or model_type!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )
