"""Layers shared by the hybrid architectures, and the model skeleton they plug into.

Every layer works on *packed* tokens ``x [T, hidden]`` (all sequences of a ``ForwardBatch`` one
after another) and reads its cache through the batch: attention layer ``j`` (its ordinal among
attention layers) uses ``batch.k_buffers[j] / v_buffers[j]``; linear layer ``j`` (its ordinal among
linear layers) uses ``batch.conv_states[j] / ssm_states[j]``. No layer keeps per-request state.

Numerics follow the Hugging Face reference (see docs/models.md): norms compute in fp32 and cast
back; routers, gates and recurrent states are fp32; the small SSM parameters (``A_log``,
``dt_bias``, ``D``, the router's score-correction bias) are kept in fp32 whatever the model dtype.

One idea a file, in the order a forward meets them:

* ``model`` — :class:`HybridLayer` (the residual layer; :class:`PostNormLayer`: OLMo's reordered norms;
  :class:`SandwichLayer`: LFM3's norms before and after each part) and :class:`HybridForCausalLM`
  (embedding, layers, final norm, LM head), which each architecture's file (``hyla/model/<arch>.py``)
  subclasses.
* ``norms``, ``rotary`` — RMSNorm (also without a weight) and the gated RMSNorm; RoPE.
* ``attention`` — full attention over the paged KV pool.
* ``gated_deltanet``, ``mamba2`` — the recurrent mixers; ``recurrent`` — what they (and the other
  architectures' recurrent mixers) share: the extend's conv, checkpoints, the fused extend's segments.
* ``mlp``, ``sparse_moe`` — the feed-forward parts.
* ``projections`` — a fused decode step's GEMV projections, the out projection in the next norm's kernel.
* ``device`` — which path a layer runs (the Triton kernels on CUDA, fla's prefill); ``derived`` —
  tensors cached from parameters.

The names below are the package's: ``from hyla.model.layers import HybridForCausalLM``.
"""

from __future__ import annotations

from hyla.model.layers import device
from hyla.model.layers.attention import Attention, runs_prologue_kernel, tree_masks
from hyla.model.layers.derived import DerivedWeight, refresh_derived_weights_
from hyla.model.layers.gated_deltanet import GatedDeltaNet
from hyla.model.layers.mamba2 import Mamba2Mixer
from hyla.model.layers.mlp import MLP, relu2
from hyla.model.layers.model import HybridForCausalLM, HybridLayer, PostNormLayer, SandwichLayer
from hyla.model.layers.norms import GatedRMSNorm, RMSNorm, WeightlessRMSNorm
from hyla.model.layers.projections import (
    OutProjection,
    add_rms_norm,
    in_projection,
    is_gemv_step,
    materialized,
    on_gemv_step,
    out_projection,
    project,
)
from hyla.model.layers.recurrent import (
    ConvTickets,
    ckpt_kwargs,
    conv1d_extend,
    conv1d_fused_extend,
    copy_decode_checkpoints,
    run_fused_extend_segments,
)
from hyla.model.layers.rotary import Rope, RotaryEmbedding, apply_rotary, apply_rotary_, signed_sin
from hyla.model.layers.sparse_moe import SparseMoE

__all__ = [
    "Attention", "ConvTickets", "DerivedWeight", "GatedDeltaNet", "GatedRMSNorm", "HybridForCausalLM", "HybridLayer",
    "MLP", "Mamba2Mixer", "OutProjection", "PostNormLayer", "RMSNorm", "Rope", "RotaryEmbedding", "SandwichLayer",
    "SparseMoE", "WeightlessRMSNorm",
    "add_rms_norm", "apply_rotary", "apply_rotary_", "ckpt_kwargs", "conv1d_extend", "conv1d_fused_extend",
    "copy_decode_checkpoints", "device", "in_projection", "is_gemv_step", "materialized", "on_gemv_step", "out_projection", "project",
    "refresh_derived_weights_", "relu2", "run_fused_extend_segments", "runs_prologue_kernel", "signed_sin",
    "tree_masks",
]
