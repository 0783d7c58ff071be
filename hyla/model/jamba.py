"""Jamba (``JambaForCausalLM``, AI21): Mamba1 layers and attention layers, each followed by an MLP or
a mixture of experts.

Each layer is ``x + mixer(input_layernorm(x))`` then ``x + ffn(pre_ff_layernorm(x))``. Layer ``i``'s
mixer is attention when ``i % attn_layer_period == attn_layer_offset``, else Mamba1; its feed-forward
is a mixture of experts when ``i % expert_layer_period == expert_layer_offset`` (and ``num_experts >
1``), else a SwiGLU MLP. The final norm is ``final_layernorm``.

* The Mamba1 mixer (:class:`Mamba1Mixer`, HF's ``JambaMambaMixer``)::

      [x | z] = in_proj(h)                          # [T, I] each, I = mamba_expand * hidden
      x = silu(conv1d(x))                            # depthwise causal conv over K = mamba_d_conv inputs
      [dt | B | C] = x_proj(x)                       # [T, R], [T, N], [T, N]; R = mamba_dt_rank
      dt, B, C = dt_layernorm(dt), b_layernorm(B), c_layernorm(C)     # Jamba's RMSNorms
      dt = dt_proj.weight @ dt                       # [T, I]; its bias goes into the scan's softplus
      y = selective_scan(x, dt, -exp(A_log), B, C, D, dt_proj.bias)   # ops/selective_scan.py
      out = out_proj(y * silu(z))

  Its recurrent state per sequence: the conv window ``[I, K-1]`` and the SSM state ``[I, N]`` (fp32).
* Attention: GQA without positional encoding (no RoPE: the Mamba layers carry position), no bias.
* The mixture of experts: a softmax router over ``num_experts``, the top ``num_experts_per_tok``
  weights *not* renormalised, SwiGLU experts of ``intermediate_size``; no shared expert. Checkpoints
  (AI21's and transformers' ``save_pretrained``) hold each expert's ``gate_proj`` / ``up_proj`` /
  ``down_proj`` and the ``router``.

Norms are plain RMSNorms (``w * norm(x)``). On a GPU the Mamba1 layers run Triton kernels
(``ops/gpu/selective_scan.py``; :class:`Mamba1Mixer`), so Jamba's decode steps are fused and
captured in CUDA graphs as the other architectures' are.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from hyla.model.config import ModelConfig, hf_attention_fields, hf_common_fields, hf_require
from hyla.model.forward_batch import ForwardBatch
from hyla.model.layers import (
    DerivedWeight,
    HybridForCausalLM,
    HybridLayer,
    OutProjection,
    RMSNorm,
    Rope,
    WeightlessRMSNorm,
    ckpt_kwargs,
    conv1d_extend,
    conv1d_fused_extend,
    copy_decode_checkpoints,
    in_projection,
    out_projection,
    run_fused_extend_segments,
)
from hyla.model.layers.device import gpu, on_gpu
from hyla.model.linear import Linear
from hyla.model.ops.conv1d import causal_conv1d_chains, causal_conv1d_update
from hyla.model.ops.selective_scan import selective_scan_chains, selective_scan_varlen, selective_state_update
from hyla.model.qwen3_next import expert_specs
from hyla.model.weight_specs import (
    WeightSpec,
    attention_specs,
    embedding_specs,
    linear_specs,
    mlp_specs,
    norm_spec,
    squeeze_conv,
)


class Mamba1Mixer(nn.Module):
    """Jamba's Mamba1 layer (see the module docstring), also the whole of Mamba's and FalconMamba's
    layers (``mamba.py``): the norms of dt, B and C are there with ``mamba1_bcdt_norms`` (Jamba's
    RMSNorms; without a weight, ``mamba1_bcdt_norm_weights=False``: FalconMamba's), absent otherwise
    (Mamba). State: ``batch.conv_states[j]`` ``[S, I, K-1]`` and ``batch.ssm_states[j]`` ``[S, I, N]``
    (``j`` = the layer's linear ordinal).

    On a GPU (``ops/gpu/selective_scan.py``): a fused decode step runs the conv window kernel, then
    the scan's kernel with the gate ``silu(z)`` fused in (verify steps' chains in the same two
    launches); an extend runs the conv's extend kernels and the scan's segments kernel, whole
    sequences in one launch with their checkpoints (a fused extend: its one sequence). Token trees
    take the PyTorch ops' tree scan."""

    fused_decode = True
    fused_extend = True
    takes_gemv_step = True  # forward(gemv_step=True): see HybridLayer.forward_fused
    chain_verify = True  # a verify step of padded chains: HybridForCausalLM.supports_chain_verify

    def __init__(self, config: ModelConfig, linear_ordinal: int):
        super().__init__()
        c = config
        self.state_index = linear_ordinal
        inner, self.state_size, self.dt_rank = c.mamba1_inner_size, c.ssm_state_size, c.mamba1_dt_rank
        self.in_proj = Linear(c.hidden_size, 2 * inner, bias=c.mamba_proj_bias, dtype=c.dtype)  # [x | z]
        self.conv_weight = nn.Parameter(torch.empty(inner, c.conv_kernel, dtype=c.dtype))  # [I, K]
        self.conv_bias = nn.Parameter(torch.empty(inner, dtype=c.dtype)) if c.mamba_conv_bias else None
        self.x_proj = Linear(inner, self.dt_rank + 2 * self.state_size, bias=False, dtype=c.dtype)  # [dt | B | C]
        self.dt_proj = Linear(self.dt_rank, inner, bias=False, dtype=c.dtype)
        self.dt_bias = nn.Parameter(torch.empty(inner, dtype=torch.float32))  # HF's dt_proj.bias, added in fp32
        self.A_log = nn.Parameter(torch.empty(inner, self.state_size, dtype=torch.float32))
        self.D = nn.Parameter(torch.empty(inner, dtype=torch.float32))
        self.norms = None
        if c.mamba1_bcdt_norms:  # dt, B, C: Jamba's RMSNorms, or FalconMamba's without a weight
            eps = c.norm_eps if c.mamba1_bcdt_norm_eps is None else c.mamba1_bcdt_norm_eps
            self.norms = nn.ModuleList([RMSNorm(n, eps, dtype=c.dtype) if c.mamba1_bcdt_norm_weights
                                        else WeightlessRMSNorm(n, eps)
                                        for n in (self.dt_rank, self.state_size, self.state_size)])
        self.out_proj = Linear(inner, c.hidden_size, bias=c.mamba_proj_bias, dtype=c.dtype)
        self._neg_A = DerivedWeight(lambda a_log: -torch.exp(a_log.float()))  # [I, N] fp32

    def forward(self, x: torch.Tensor, batch: ForwardBatch, rope: Rope | None = None,
                gemv_step: bool = False) -> torch.Tensor | OutProjection:
        xs, z = in_projection(self.in_proj, x, gemv_step).chunk(2, dim=-1)  # [T, I] each (strided views)
        conv_states, ssm_states = batch.conv_states[self.state_index], batch.ssm_states[self.state_index]
        A = self._neg_A(self.A_log)
        if batch.fused_decode:  # Triton: the conv window, then the scan step with the gate
            xs = gpu("conv1d_decode").causal_conv1d_update_fused(xs, self.conv_weight, self.conv_bias, conv_states,
                                                                  batch.state_slots, "silu", chain=batch.chain_slots)
            dt, B, C = self._dt_b_c(xs, gemv_step)
            y = gpu("selective_scan").selective_state_update_fused(
                xs, dt, A, B, C, self.D, self.dt_bias, ssm_states, batch.state_slots, z, chain=batch.chain_slots)
            return out_projection(self.out_proj, y, gemv_step)  # [B, I] gated
        if batch.fused_extend is not None:  # Triton: the conv, then the scan in one launch (padding rows: 0)
            xs = conv1d_fused_extend(xs, self.conv_weight, self.conv_bias, conv_states, batch, "silu")
            dt, B, C = self._dt_b_c(xs)
            y = torch.zeros_like(xs)
            run_fused_extend_segments(gpu("selective_scan").segment_kernel(xs, dt, A, B, C, self.D, self.dt_bias, z),
                                      y, ssm_states, batch)
            return self.out_proj(y)
        slots, chains = batch.state_slot_plan, batch.chains  # (chains: the compiled verify step)
        if batch.is_decode:  # (the slots as validated at batch construction: no host read here)
            xs = causal_conv1d_update(xs, self.conv_weight, self.conv_bias, conv_states, slots, "silu")
        elif chains is not None:
            xs = causal_conv1d_chains(xs, self.conv_weight, self.conv_bias, conv_states, slots, chains, "silu")
        else:
            xs = conv1d_extend(xs, self.conv_weight, self.conv_bias, conv_states, batch, "silu")  # [T, I]
        dt, B, C = self._dt_b_c(xs)
        if batch.is_decode:
            y = selective_state_update(xs, dt, A, B, C, self.D, self.dt_bias, ssm_states, slots)
            copy_decode_checkpoints(conv_states, batch)
            copy_decode_checkpoints(ssm_states, batch)
        elif chains is not None:
            y = selective_scan_chains(xs, dt, A, B, C, self.D, self.dt_bias, ssm_states, slots, chains)
        elif on_gpu(xs) and batch.tree_parents is None and batch.varlen is not None:  # the segments kernel
            return self.out_proj(gpu("selective_scan").selective_scan_extend_fused(
                xs, dt, A, B, C, self.D, self.dt_bias, ssm_states, batch.varlen, z))
        else:
            y = selective_scan_varlen(xs, dt, A, B, C, self.D, self.dt_bias, batch.cu_seqlens, ssm_states,
                                      batch.state_slots, **ckpt_kwargs(batch))  # [T, I]
        return self.out_proj((y.float() * F.silu(z.float())).to(x.dtype))

    def _dt_b_c(self, xs: torch.Tensor, gemv_step: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The scan's raw ``dt [T, I]`` (``dt_proj``'s, its bias still to add) and ``B, C [T, N]`` from
        the conv's output: ``x_proj``, the three RMSNorms where the model has them (Jamba; FalconMamba's
        without a weight), ``dt_proj`` (GEMVs on a GEMV step). Every path (PyTorch, fused decode,
        fused extend) takes dt, B and C from here: the kernels see them normalised or not alike."""
        dt, B, C = in_projection(self.x_proj, xs, gemv_step).split([self.dt_rank, self.state_size, self.state_size],
                                                                    dim=-1)
        if self.norms is not None:
            dt, B, C = (norm(v) for norm, v in zip(self.norms, (dt, B, C)))
        return in_projection(self.dt_proj, dt, gemv_step), B, C


class JambaForCausalLM(HybridForCausalLM):
    linear_mixer = Mamba1Mixer

    def build_layer(self, index: int) -> HybridLayer:
        return self.mixer_ffn_layer(index)  # Mamba1 or attention, then the MLP or the experts

    @classmethod
    def hf_weight_specs(cls, config: ModelConfig) -> list[WeightSpec]:
        c = config
        specs = embedding_specs(c, "model.embed_tokens.weight", "model.final_layernorm.weight")
        for i, (kind, ffn) in enumerate(zip(c.layer_types, c.ffn_types)):
            t, s = f"layers.{i}", f"model.layers.{i}"
            specs += [norm_spec(f"{t}.mixer_norm.weight", f"{s}.input_layernorm.weight"),
                      norm_spec(f"{t}.ffn_norm.weight", f"{s}.pre_ff_layernorm.weight")]
            if kind == "attention":
                specs += attention_specs(c, f"{t}.mixer", f"{s}.self_attn")
            else:
                specs += mamba1_specs(c, f"{t}.mixer", f"{s}.mamba")
            if ffn == "moe":  # the router and the experts (no shared expert)
                specs += [WeightSpec(f"{t}.ffn.router.weight", (f"{s}.feed_forward.router.weight",)),
                          *expert_specs(c, f"{t}.ffn", f"{s}.feed_forward")]
            else:
                specs += mlp_specs(f"{t}.ffn", f"{s}.feed_forward")
        return specs


def mamba1_specs(config: ModelConfig, target: str, source: str) -> list[WeightSpec]:
    """:class:`Mamba1Mixer` from HF's Mamba1 mixer tensors (Jamba's ``mamba.*``, Mamba's and
    FalconMamba's ``mixer.*``; the dt/B/C norms' weights where they have one)."""
    specs = [
        *linear_specs(f"{target}.in_proj", [f"{source}.in_proj"], config.mamba_proj_bias),
        WeightSpec(f"{target}.conv_weight", (f"{source}.conv1d.weight",), squeeze_conv),  # [I, 1, K] -> [I, K]
        *linear_specs(f"{target}.x_proj", [f"{source}.x_proj"], False),
        WeightSpec(f"{target}.dt_proj.weight", (f"{source}.dt_proj.weight",)),
        WeightSpec(f"{target}.dt_bias", (f"{source}.dt_proj.bias",)),
        WeightSpec(f"{target}.A_log", (f"{source}.A_log",)),
        WeightSpec(f"{target}.D", (f"{source}.D",)),
        *linear_specs(f"{target}.out_proj", [f"{source}.out_proj"], config.mamba_proj_bias),
    ]
    if config.mamba_conv_bias:
        specs.append(WeightSpec(f"{target}.conv_bias", (f"{source}.conv1d.bias",)))
    if config.mamba1_bcdt_norms and config.mamba1_bcdt_norm_weights:  # (FalconMamba's have no weight)
        specs += [norm_spec(f"{target}.norms.{k}.weight", f"{source}.{name}_layernorm.weight")
                  for k, name in enumerate(("dt", "b", "c"))]
    return specs


# ------------------------------------------------------------------------------------------------
# config.json parsing (``ModelConfig.from_hf`` through ``hyla.model.architectures``)
# ------------------------------------------------------------------------------------------------
def parse_hf_config(cfg: Mapping[str, Any], arch: str, dtype: str | torch.dtype | None) -> dict[str, Any]:
    """``ModelConfig`` fields of a Jamba ``config.json`` (HF ``JambaConfig`` keys and defaults).
    Raises ``ValueError`` for a period/offset pair that places no layer, or an unsupported activation."""
    common = hf_common_fields(cfg, arch, dtype)  # first: its required keys are checked first
    common["max_position_embeddings"] = int(cfg.get("max_position_embeddings", 262_144))  # HF's Jamba default
    num_layers = int(hf_require(cfg, "num_hidden_layers"))
    hidden = int(cfg["hidden_size"])
    periods = {}
    for what in ("attn", "expert"):
        period, offset = int(cfg.get(f"{what}_layer_period", 8 if what == "attn" else 2)), \
            int(cfg.get(f"{what}_layer_offset", 4 if what == "attn" else 1))
        if period < 1 or not 0 <= offset < period:
            raise ValueError(f"Jamba {what}_layer_offset ({offset}) must be in [0, {what}_layer_period ({period}))")
        periods[what] = (period, offset)
    num_experts = int(cfg.get("num_experts", cfg.get("num_local_experts", 16)))
    experts = num_experts > 1
    layer_types = tuple("attention" if i % periods["attn"][0] == periods["attn"][1] else "linear"
                        for i in range(num_layers))
    ffn_types = tuple("moe" if experts and i % periods["expert"][0] == periods["expert"][1] else "mlp"
                      for i in range(num_layers))
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"Jamba hidden_act must be 'silu', got {cfg.get('hidden_act')!r}")
    dt_rank = cfg.get("mamba_dt_rank", "auto")
    intermediate = int(cfg.get("intermediate_size", 14336))
    return dict(
        **common,
        model_type="jamba",
        layer_types=layer_types,
        ffn_types=ffn_types,
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        zero_centered_norm=False,
        **hf_attention_fields(cfg),
        attention_bias=False,
        rotary_dim=0,  # no positional encoding
        linear_kind="mamba1",
        conv_kernel=int(cfg.get("mamba_d_conv", 4)),
        ssm_state_size=int(cfg.get("mamba_d_state", 16)),
        mamba1_inner_size=int(cfg.get("mamba_expand", 2)) * hidden,
        mamba1_dt_rank=math.ceil(hidden / 16) if dt_rank == "auto" else int(dt_rank),
        mamba1_bcdt_norms=True,
        mamba_conv_bias=bool(cfg.get("mamba_conv_bias", True)),
        mamba_proj_bias=bool(cfg.get("mamba_proj_bias", False)),
        intermediate_size=intermediate,
        hidden_act="silu",
        mlp_bias=False,
        num_experts=num_experts if experts else 0,
        num_experts_per_tok=int(cfg.get("num_experts_per_tok", 2)) if experts else 0,
        moe_intermediate_size=intermediate if experts else 0,
        norm_topk_prob=False,  # the top-k softmax weights as they are
        router="softmax",
    )
