"""Mamba2 (``Mamba2ForCausalLM``: mistralai/Mamba-Codestral-7B-v0.1, transformers-format Mamba2
checkpoints): a pure state-space model, every layer a Mamba2 mixer — the degenerate hybrid with no
attention and no feed-forward.

Each layer is ``x + mixer(norm(x))`` (``mamba.py``'s backbone: ``backbone.embeddings``,
``backbone.layers.N.norm``, ``backbone.layers.N.mixer.*``, ``backbone.norm_f``, ``lm_head``), the mixer
hyla's shared :class:`~hyla.model.layers.Mamba2Mixer`, the one NemotronH, Bamba, Granite 4.0-H and
Falcon-H1 run (transformers derived NemotronH's mixer from this one; the tensor names are the same)::

      [z | xBC | dt] = in_proj(h)                   # [T, I], [T, I + 2GN], [T, H]; I = expand * hidden = H * P
      x, B, C = split(silu(conv1d(xBC)))             # [T, H, P], [T, G, N], [T, G, N]
      y = ssd(x, clamp(softplus(dt + dt_bias), time_step_limit), -exp(A_log), B, C) + D * x
      out = out_proj(w * rms_norm_per_group(y * silu(z)))     # G groups of I / G channels

Config keys are transformers' ``Mamba2Config`` (``num_heads``, ``head_dim``, ``state_size``, ``n_groups``,
``conv_kernel``, ``expand``, ``use_bias`` on ``in_proj`` / ``out_proj``, ``use_conv_bias``,
``layer_norm_epsilon`` for both the block norms and the gated norm, ``time_step_limit``,
``tie_word_embeddings``: untied by default) with its defaults; ``chunk_size`` and the ``time_step_*``
initialisation keys change nothing at inference.

The dt clamp is ``time_step_limit`` (default ``(0, inf)``, which never binds), applied on every path
as ``Mamba2Mixer`` applies it; transformers' Mamba2 applies it in its chunked scan only (not in its
decode), so with a binding limit hyla's decode follows HF's full forward, not HF's decode (see
docs/models.md). NemotronH's is the same (Zamba2's HF mixer hard-codes ``(time_step_min, inf)``).

Refused (``ValueError``): a conv activation (``hidden_act``) other than ``silu``, ``num_heads *
head_dim`` other than ``expand * hidden_size`` (transformers refuses it too), and ``rms_norm: false``
(mamba_ssm: no norm, ``y * silu(z)``; transformers never reads the key and always normalises), rather
than serve a model whose norm is ambiguous. ``norm_before_gate`` is ignored, as transformers and vLLM
ignore it (the output norm gates first, ``norm(y * silu(z))``): Mamba-Codestral's own config says
``true`` for weights trained gate-first (its conversion to transformers dropped the key).
``residual_in_fp32`` (default true: HF's residual stream in fp32 under a bf16 model) is not followed:
hyla keeps the residual in the model dtype (the same numbers in fp32).
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import nn

from hyla.model.config import ModelConfig, hf_common_fields, hf_time_step_limit
from hyla.model.layers import Mamba2Mixer
from hyla.model.mamba import MambaForCausalLM, backbone_fields
from hyla.model.weight_specs import WeightSpec, mamba2_specs


class Mamba2ForCausalLM(MambaForCausalLM):
    """``mamba.py``'s backbone with the Mamba2 mixer (its gated norm always there)."""

    linear_mixer: type[nn.Module] | None = Mamba2Mixer

    @staticmethod
    def mixer_specs(config: ModelConfig, target: str, source: str) -> list[WeightSpec]:
        return mamba2_specs(config, target, source)


# ------------------------------------------------------------------------------------------------
# config.json parsing (``ModelConfig.from_hf`` through ``hyla.model.architectures``)
# ------------------------------------------------------------------------------------------------
def parse_hf_config(cfg: Mapping[str, Any], arch: str, dtype: str | torch.dtype | None) -> dict[str, Any]:
    """``ModelConfig`` fields of a Mamba2 ``config.json`` (HF ``Mamba2Config`` keys and defaults).
    Raises ``ValueError`` for what the module docstring lists as refused, and for a bad
    ``time_step_limit``."""
    common = hf_common_fields(cfg, arch, dtype)  # first: its required keys are checked first
    backbone = backbone_fields(cfg, "Mamba2")
    hidden = int(cfg["hidden_size"])
    if cfg.get("rms_norm") is False:
        raise ValueError("Mamba2 with rms_norm: false (no gated output norm) is not served: transformers' Mamba2 "
                         "ignores the key and always normalises, mamba_ssm would not; hyla refuses the ambiguity")
    inner = int(float(cfg.get("expand", 2)) * hidden)
    heads, head_dim = int(cfg.get("num_heads", 128)), int(cfg.get("head_dim", 64))
    if heads <= 0 or heads * head_dim != inner:
        raise ValueError(f"Mamba2 num_heads ({heads}) * head_dim ({head_dim}) must equal expand * hidden_size "
                         f"({inner})")
    groups = int(cfg.get("n_groups", 8))
    if groups <= 0:
        raise ValueError(f"Mamba2 n_groups must be positive, got {groups}")
    return dict(
        **common,
        **backbone,
        model_type="mamba2",
        linear_kind="mamba2",
        mamba_num_heads=heads,
        mamba_head_dim=head_dim,
        ssm_state_size=int(cfg.get("state_size", 128)),
        mamba_n_groups=groups,  # (ModelConfig checks that it divides num_heads)
        mamba_dt_limit=hf_time_step_limit(cfg),
    )
