"""The Gated DeltaNet mixer (Qwen3-Next's and Qwen3.5's ``linear_attention`` layers)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hyla.model.config import ModelConfig
from hyla.model.forward_batch import ForwardBatch
from hyla.model.layers import device
from hyla.model.layers.derived import DerivedWeight
from hyla.model.layers.norms import GatedRMSNorm
from hyla.model.layers.projections import OutProjection, deferrable, in_projection
from hyla.model.layers.recurrent import (
    ConvTickets,
    ckpt_kwargs,
    conv1d_extend,
    conv1d_fused_extend,
    copy_decode_checkpoints,
    run_fused_extend_segments,
)
from hyla.model.layers.rotary import Rope
from hyla.model.linear import Linear
from hyla.model.ops.conv1d import causal_conv1d_chains, causal_conv1d_update
from hyla.model.ops.gated_delta import (
    chunk_gated_delta_rule_varlen,
    gated_delta_rule_chains,
    recurrent_gated_delta_rule_update,
)


class GatedDeltaNet(nn.Module):
    """Gated DeltaNet mixer (Qwen3-Next / Qwen3.5 ``linear_attention`` layers).

    ``in_proj`` rows are ``[q (Hk*Dk) | k (Hk*Dk) | v (Hv*Dv) | z (Hv*Dv) | b (Hv) | a (Hv)]``, heads
    contiguous (the loader reorders Qwen3-Next's per-key-head grouped layout into this). The first
    ``conv_dim = 2*Hk*Dk + Hv*Dv`` channels go through the causal conv (no bias) and ``silu``.
    ``beta = sigmoid(b)`` (OLMo-Hybrid: ``2 * sigmoid(b)``, ``config.gdn_beta_scale``), log-decay
    ``g = -exp(A_log) * softplus(a + dt_bias)`` (fp32).
    """

    fused_decode = True
    fused_extend = True
    chain_verify = True  # a verify step of padded chains: HybridForCausalLM.supports_chain_verify
    takes_gemv_step = True  # forward(gemv_step=True): see HybridLayer.forward_fused

    def __init__(self, config: ModelConfig, linear_ordinal: int):
        super().__init__()
        c = config
        self.state_index = linear_ordinal
        self.num_k_heads, self.num_v_heads = c.linear_num_key_heads, c.linear_num_value_heads
        self.head_k_dim, self.head_v_dim = c.linear_key_head_dim, c.linear_value_head_dim
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        self.conv_dim = c.conv_dim
        proj = self.conv_dim + self.value_dim + 2 * self.num_v_heads
        self.in_proj = Linear(c.hidden_size, proj, bias=False, dtype=c.dtype)
        self.conv_weight = nn.Parameter(torch.empty(self.conv_dim, c.conv_kernel, dtype=c.dtype))  # [C, K]
        self.dt_bias = nn.Parameter(torch.empty(self.num_v_heads, dtype=torch.float32))
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads, dtype=torch.float32))
        eps = c.norm_eps if c.linear_norm_eps is None else c.linear_norm_eps
        self.norm = GatedRMSNorm(self.head_v_dim, eps, norm_before_gate=True, dtype=c.dtype)
        self.beta_scale = c.gdn_beta_scale  # OLMo-Hybrid's allow_neg_eigval: 2
        self.out_proj = Linear(self.value_dim, c.hidden_size, bias=False, dtype=c.dtype)
        self._neg_A = DerivedWeight(lambda a_log: -torch.exp(a_log.float()))  # [Hv] fp32
        self._tickets = ConvTickets()  # the fused conv decode kernel's counters

    def forward(self, x: torch.Tensor, batch: ForwardBatch, rope: Rope | None = None,
                gemv_step: bool = False) -> torch.Tensor | OutProjection:
        t = x.shape[0]
        mixed, z, b, a = in_projection(self.in_proj, x, gemv_step).split(
            [self.conv_dim, self.value_dim, self.num_v_heads, self.num_v_heads], -1)
        conv_states, ssm_states = batch.conv_states[self.state_index], batch.ssm_states[self.state_index]
        slots = batch.state_slot_plan
        if batch.fused_decode:  # Triton: the conv window, gating and the state update in one kernel, or
            # the conv in a kernel of its own (a verify step of chains: each runs its requests' tokens in order)
            gdn, chain = device.gpu("gated_delta_decode"), batch.chain_slots
            if gdn.FUSE_CONV and self.conv_weight.shape[1] == gdn.CONV_WIDTH:
                seqs = batch.state_slots.shape[0] if chain is None else chain.shape[1]
                o = gdn.gated_delta_conv_decode_fused(
                    mixed, self.conv_weight, conv_states, self._tickets(seqs * self.num_k_heads, x.device), a, b,
                    self.A_log, self.dt_bias, ssm_states, batch.state_slots, self.num_k_heads, self.head_k_dim,
                    chain=chain, beta_scale=self.beta_scale)  # [B, Hv, Dv]
            else:
                mixed = device.gpu("conv1d_decode").causal_conv1d_update_fused(
                    mixed, self.conv_weight, None, conv_states, batch.state_slots, "silu", chain=chain)
                o = gdn.gated_delta_decode_fused(mixed, a, b, self.A_log, self.dt_bias, ssm_states, batch.state_slots,
                                                 self.num_k_heads, self.head_k_dim, chain=chain,
                                                 beta_scale=self.beta_scale)  # [B, Hv, Dv]
        elif batch.fused_extend is not None:  # Triton: the conv, then the recurrence in one launch
            mixed = conv1d_fused_extend(mixed, self.conv_weight, None, conv_states, batch, "silu")
            o = torch.zeros(t, self.num_v_heads, self.head_v_dim, dtype=x.dtype, device=x.device)  # padding rows: 0
            run_fused_extend_segments(device.gpu("gated_delta_chunks").segment_kernel(
                mixed, a, b, self.A_log, self.dt_bias, self.num_k_heads, self.head_k_dim, self.beta_scale), o,
                ssm_states, batch)
        else:
            o = self._mix(mixed, b, a, batch, slots, conv_states, ssm_states)
        d = self.head_v_dim
        if gemv_step and deferrable(self.out_proj) and d & (d - 1) == 0:  # the gated norm in the projection's kernel
            return OutProjection(self.out_proj, o.reshape(t, self.value_dim), "gated_norm",
                                 (z, self.norm.weight, self.norm.eps))
        if device.on_gpu(o):  # one kernel, reading z in place from the projection
            o = device.gpu("norms").gated_rms_norm_fused(o.reshape(t, self.value_dim), z, self.norm.weight,
                                                          self.norm.eps, self.num_v_heads)
        else:
            o = self.norm(o.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))  # [T*Hv, Dv]
        return in_projection(self.out_proj, o.reshape(t, self.value_dim), gemv_step)  # (a GEMV: with LoRA adapters)

    def _gates(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(g, beta)`` from the raw gates ``a, b [T, Hv]``: the fp32 log-decay and ``sigmoid(b)`` (times
        ``beta_scale``, in b's dtype, as transformers' OLMo-Hybrid)."""
        beta = torch.sigmoid(b)
        return self._neg_A(self.A_log) * F.softplus(a.float() + self.dt_bias), \
            beta if self.beta_scale == 1.0 else beta * self.beta_scale

    def _mix(self, mixed, b, a, batch: ForwardBatch, slots, conv_states, ssm_states) -> torch.Tensor:
        """The PyTorch path (CPU, extend steps): conv, gating, then the chunked or recurrent rule."""
        t = mixed.shape[0]
        chains = batch.chains  # a verify step of padded chains (the compiled verify)
        if batch.is_decode:
            mixed = causal_conv1d_update(mixed, self.conv_weight, None, conv_states, slots, "silu")
        elif chains is not None:
            mixed = causal_conv1d_chains(mixed, self.conv_weight, None, conv_states, slots, chains, "silu")
        else:
            mixed = conv1d_extend(mixed, self.conv_weight, None, conv_states, batch, "silu")  # [T, conv_dim]
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.reshape(t, self.num_k_heads, self.head_k_dim)  # [T, Hk, Dk]
        k = k.reshape(t, self.num_k_heads, self.head_k_dim)  # [T, Hk, Dk]
        v = v.reshape(t, self.num_v_heads, self.head_v_dim)  # [T, Hv, Dv]
        if not batch.is_decode and chains is None and device.fla_prefill(q, batch):  # fla's chunked Triton kernel;
            # short rounds: hyla's own kernel (recurrent or chunked), which gates a and b itself (the gates computed
            # only if fla runs)
            segments = device.gpu("gated_delta_chunks").segment_kernel(mixed, a, b, self.A_log, self.dt_bias,
                                                                        self.num_k_heads, self.head_k_dim,
                                                                        self.beta_scale)
            return device.gpu("fla_chunk").chunk_gated_delta_rule_fla(
                q, k, v, None, None, batch.cu_seqlens, ssm_states, batch.state_slots,
                **ckpt_kwargs(batch, scan=False), segments=segments, gates=lambda: self._gates(a, b))
        g, beta = self._gates(a, b)
        if batch.is_decode:
            o = recurrent_gated_delta_rule_update(q, k, v, g, beta, ssm_states, slots)
            copy_decode_checkpoints(conv_states, batch)
            copy_decode_checkpoints(ssm_states, batch)
        elif chains is not None:
            o = gated_delta_rule_chains(q, k, v, g, beta, ssm_states, slots, chains)
        else:
            o = chunk_gated_delta_rule_varlen(
                q, k, v, g, beta, batch.cu_seqlens, ssm_states, batch.state_slots, **ckpt_kwargs(batch),
                use_qk_l2norm=True,
            )  # [T, Hv, Dv]
        return o
