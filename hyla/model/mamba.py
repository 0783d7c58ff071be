"""Mamba (``MambaForCausalLM``: state-spaces/mamba-*-hf) and FalconMamba (``FalconMambaForCausalLM``:
tiiuae/falcon-mamba-7b): pure state-space models, every layer a Mamba1 mixer — the degenerate hybrid
with no attention and no feed-forward.

Each layer is ``x + mixer(norm(x))``; the final norm is ``norm_f``. The mixer is Jamba's
:class:`~hyla.model.jamba.Mamba1Mixer` (its fused decode and extend kernels, CUDA graphs, checkpoints)::

      [x | z] = in_proj(h)                          # [T, I] each; I = intermediate_size or expand * hidden
      x = silu(conv1d(x))                            # depthwise causal conv over K = conv_kernel inputs
      [dt | B | C] = x_proj(x)                       # [T, R], [T, N], [T, N]; R = time_step_rank
      dt, B, C = rms(dt), rms(B), rms(C)             # FalconMamba only: no weight, eps mixer_rms_eps
      dt = dt_proj.weight @ dt                       # [T, I]; dt_proj.bias (always there) inside the softplus
      y = selective_scan(x, dt, -exp(A_log), B, C, D, dt_proj.bias)
      out = out_proj(y * silu(z))

The two differ only in those three weightless norms (``mamba1_bcdt_norms`` with
``mamba1_bcdt_norm_weights=False``; plain Mamba has no norm there, Jamba learned ones). Config keys
are transformers' ``MambaConfig`` / ``FalconMambaConfig`` (``state_size``, ``conv_kernel``, ``expand``,
``time_step_rank``: ``"auto"`` = ``ceil(hidden / 16)``, ``use_bias`` on ``in_proj`` / ``out_proj``,
``use_conv_bias``, ``layer_norm_epsilon``, ``mixer_rms_eps``) with their defaults; an explicit
``intermediate_size`` wins over ``expand * hidden_size``, as in transformers (falcon-mamba-7b: 8192
with ``expand: 16``). Embeddings are tied unless ``tie_word_embeddings`` says otherwise (both HF
classes default to tied). ``hidden_act`` is the conv's activation and must be ``silu`` (the gate
is ``silu`` whatever it says).

Checkpoint names: ``backbone.embeddings`` (the old ``backbone.embedding`` too, as HF's load hook
renames it), ``backbone.layers.N.norm``, ``backbone.layers.N.mixer.{in_proj, conv1d, x_proj, dt_proj,
A_log, D, out_proj}``, ``backbone.norm_f``, ``lm_head``. :class:`MambaForCausalLM` is also the
skeleton of ``mamba2.py``'s Mamba2 (the same backbone, another mixer).

transformers' ``residual_in_fp32`` (default true) keeps the residual stream in fp32 under a bf16
model; hyla keeps it in the model dtype, as for every architecture (the same numbers in fp32).
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import torch
from torch import nn

from hyla.model.config import ModelConfig, hf_common_fields, hf_require, hf_silu_only
from hyla.model.jamba import Mamba1Mixer, mamba1_specs
from hyla.model.layers import HybridForCausalLM, HybridLayer
from hyla.model.weight_specs import WeightSpec, embedding_specs, norm_spec


class MambaForCausalLM(HybridForCausalLM):
    """Embedding, ``num_hidden_layers`` layers of ``x + mixer(norm(x))``, ``norm_f``, ``lm_head``
    (tied to the embedding with ``tie_word_embeddings``). Subclasses change the mixer
    (``linear_mixer``) and its checkpoint layout (``mixer_specs``)."""

    linear_mixer: type[nn.Module] | None = Mamba1Mixer

    def build_layer(self, index: int) -> HybridLayer:
        return HybridLayer(mixer=self.build_mixer(index), mixer_norm=self.new_norm(), ffn=None, ffn_norm=None)

    @classmethod
    def normalize_hf_name(cls, name: str) -> str | None:
        if name == "backbone.embedding.weight":  # the older name HF's MambaModel.load_hook renames
            return "backbone.embeddings.weight"
        return name

    @staticmethod
    def mixer_specs(config: ModelConfig, target: str, source: str) -> list[WeightSpec]:
        return mamba1_specs(config, target, source)

    @classmethod
    def hf_weight_specs(cls, config: ModelConfig) -> list[WeightSpec]:
        c = config
        specs = embedding_specs(c, "backbone.embeddings.weight", "backbone.norm_f.weight")
        for i in range(c.num_hidden_layers):
            t, s = f"layers.{i}", f"backbone.layers.{i}"
            specs.append(norm_spec(f"{t}.mixer_norm.weight", f"{s}.norm.weight"))
            specs += cls.mixer_specs(c, f"{t}.mixer", f"{s}.mixer")
        return specs


class FalconMambaForCausalLM(MambaForCausalLM):
    """Mamba with weightless RMSNorms on dt, B and C (the config's ``mamba1_bcdt_norms``)."""


# ------------------------------------------------------------------------------------------------
# config.json parsing (``ModelConfig.from_hf`` through ``hyla.model.architectures``)
# ------------------------------------------------------------------------------------------------
def backbone_fields(cfg: Mapping[str, Any], name: str) -> dict[str, Any]:
    """The ``ModelConfig`` fields every pure state-space backbone shares (Mamba's, FalconMamba's,
    Mamba2's): one recurrent mixer a layer and no feed-forward, HF's ``layer_norm_epsilon`` norms, the
    conv's width and bias (``conv_kernel``, ``use_conv_bias``), ``use_bias`` on the projections.
    Raises ``ValueError`` for a conv activation (``hidden_act``) other than ``silu``."""
    num_layers = int(hf_require(cfg, "num_hidden_layers"))
    hf_silu_only(cfg, name)
    return dict(
        layer_types=("linear",) * num_layers,
        ffn_types=("none",) * num_layers,
        norm_eps=float(cfg.get("layer_norm_epsilon", 1e-5)),
        zero_centered_norm=False,
        conv_kernel=int(cfg.get("conv_kernel", 4)),
        mamba_conv_bias=bool(cfg.get("use_conv_bias", True)),
        mamba_proj_bias=bool(cfg.get("use_bias", False)),
    )


def parse_hf_config(cfg: Mapping[str, Any], arch: str, dtype: str | torch.dtype | None) -> dict[str, Any]:
    """``ModelConfig`` fields of a Mamba or FalconMamba ``config.json`` (HF ``MambaConfig`` /
    ``FalconMambaConfig`` keys and defaults). Raises ``ValueError`` for a conv activation other than
    ``silu`` or a non-positive width, rank or state size."""
    falcon = arch == "FalconMambaForCausalLM"
    name = "FalconMamba" if falcon else "Mamba"
    common = hf_common_fields(cfg, arch, dtype)  # first: its required keys are checked first
    common["tie_word_embeddings"] = bool(cfg.get("tie_word_embeddings", True))  # both HF classes tie by default
    backbone = backbone_fields(cfg, name)
    hidden = int(cfg["hidden_size"])
    # HF: an explicit intermediate_size wins over expand * hidden_size (falcon-mamba-7b: 8192, expand 16)
    inner = cfg.get("intermediate_size")
    inner = int(float(cfg.get("expand", 2)) * hidden) if inner is None else int(inner)
    rank = cfg.get("time_step_rank", "auto")
    rank = math.ceil(hidden / 16) if rank in (None, "auto") else int(rank)
    state = int(cfg.get("state_size", 16))
    if min(inner, rank, state) <= 0:
        raise ValueError(f"{name} needs a positive intermediate size ({inner}), time_step_rank ({rank}) and "
                         f"state_size ({state})")
    return dict(
        **common,
        **backbone,
        model_type="falcon_mamba" if falcon else "mamba",
        linear_kind="mamba1",
        ssm_state_size=state,
        mamba1_inner_size=inner,
        mamba1_dt_rank=rank,
        mamba1_bcdt_norms=falcon,
        mamba1_bcdt_norm_weights=not falcon,
        mamba1_bcdt_norm_eps=float(cfg.get("mixer_rms_eps", 1e-6)) if falcon else None,
    )
