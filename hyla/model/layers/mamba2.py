"""The Mamba2 mixer (NemotronH, Bamba, Granite 4.0-H, Falcon-H1)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hyla.model.config import ModelConfig
from hyla.model.forward_batch import ForwardBatch
from hyla.model.layers import device
from hyla.model.layers.derived import DerivedWeight
from hyla.model.layers.norms import GatedRMSNorm
from hyla.model.layers.projections import OutProjection, in_projection, out_projection
from hyla.model.layers.recurrent import (
    ckpt_kwargs,
    conv1d_extend,
    conv1d_fused_extend,
    copy_decode_checkpoints,
    run_fused_extend_segments,
)
from hyla.model.layers.rotary import Rope
from hyla.model.linear import Linear
from hyla.model.ops.conv1d import causal_conv1d_chains, causal_conv1d_update
from hyla.model.ops.ssd import mamba2_chains, mamba2_chunk_scan_varlen, mamba2_state_update


class Mamba2Mixer(nn.Module):
    """Mamba2 mixer (NemotronH ``M`` blocks, Bamba, Granite 4.0-H, Falcon-H1's Mamba2 half).

    ``in_proj`` rows are ``[z (I) | xBC (I + 2*G*N) | dt (H)]``; xBC goes through the causal conv
    (bias when ``mamba_conv_bias``) and ``silu``, then splits into x ``[T, H, P]``, B and C ``[T, G, N]``.
    Both paths, the chunked extend and the decode step, clamp ``softplus(dt + dt_bias)`` to
    ``config.mamba_dt_limit``, so a state is the same whether its tokens came as an extend or as
    decode steps (the cache relies on it). Hugging Face's decode does not clamp: hyla deviates from
    it there on purpose (docs/models.md).

    Output: ``norm(y, z)``, a gated RMSNorm per group (``w * norm(y * silu(z))``; with
    ``mamba_norm_before_gate``, ``w * norm(y) * silu(z)``), or, without ``mamba_rms_norm`` (a Falcon-H1
    option), ``y * silu(z)`` in fp32; then ``out_proj`` (bias: ``mamba_out_proj_bias``, which
    defaults to ``mamba_proj_bias``).
    """

    fused_decode = True
    fused_extend = True
    chain_verify = True  # a verify step of padded chains: HybridForCausalLM.supports_chain_verify
    takes_gemv_step = True  # forward(gemv_step=True): see HybridLayer.forward_fused

    def __init__(self, config: ModelConfig, linear_ordinal: int):
        super().__init__()
        c = config
        self.state_index = linear_ordinal
        self.num_heads, self.head_dim = c.mamba_num_heads, c.mamba_head_dim
        self.n_groups, self.state_size = c.mamba_n_groups, c.ssm_state_size
        self.inner = c.mamba_intermediate_size
        self.conv_dim = c.conv_dim
        self.dt_limit = c.mamba_dt_limit
        proj = self.inner + self.conv_dim + self.num_heads
        self.in_proj = Linear(c.hidden_size, proj, bias=c.mamba_proj_bias, dtype=c.dtype)
        self.conv_weight = nn.Parameter(torch.empty(self.conv_dim, c.conv_kernel, dtype=c.dtype))  # [C, K]
        self.conv_bias = nn.Parameter(torch.empty(self.conv_dim, dtype=c.dtype)) if c.mamba_conv_bias else None
        self.dt_bias = nn.Parameter(torch.empty(self.num_heads, dtype=torch.float32))
        self.A_log = nn.Parameter(torch.empty(self.num_heads, dtype=torch.float32))
        self.D = nn.Parameter(torch.empty(self.num_heads, dtype=torch.float32))
        self.norm = (
            GatedRMSNorm(self.inner, c.norm_eps if c.linear_norm_eps is None else c.linear_norm_eps,
                         self.inner // self.n_groups,
                         norm_before_gate=c.mamba_norm_before_gate, dtype=c.dtype)
            if c.mamba_rms_norm else None
        )
        out_bias = c.mamba_proj_bias if c.mamba_out_proj_bias is None else c.mamba_out_proj_bias
        self.out_proj = Linear(self.inner, c.hidden_size, bias=out_bias, dtype=c.dtype)
        self._neg_A = DerivedWeight(lambda a_log: -torch.exp(a_log.float()))  # [H] fp32

    def forward(self, x: torch.Tensor, batch: ForwardBatch, rope: Rope | None = None,
                gemv_step: bool = False) -> torch.Tensor | OutProjection:
        t = x.shape[0]
        z, xbc, dt = in_projection(self.in_proj, x, gemv_step).split([self.inner, self.conv_dim, self.num_heads],
                                                                     dim=-1)
        conv_states, ssm_states = batch.conv_states[self.state_index], batch.ssm_states[self.state_index]
        slots = batch.state_slot_plan
        A = self._neg_A(self.A_log)  # [H]
        gn = self.n_groups * self.state_size
        if batch.fused_decode:  # two Triton kernels: the conv window, then dt + the state update
            # (a verify step of chains: each runs its requests' tokens in order, batch.chain_slots)
            xbc = device.gpu("conv1d_decode").causal_conv1d_update_fused(
                xbc, self.conv_weight, self.conv_bias, conv_states, batch.state_slots, "silu", chain=batch.chain_slots)
            xs, bs, cs = xbc.split([self.inner, gn, gn], dim=-1)
            y = device.gpu("mamba2_decode").mamba2_state_update_fused(
                xs, dt, A, bs, cs, self.D, self.dt_bias, ssm_states, batch.state_slots, self.dt_limit,
                chain=batch.chain_slots)  # [B, H, P]
            return self._out(y, z, t, x.dtype, gemv_step)
        if batch.fused_extend is not None:  # Triton: the conv, then the scan in one launch, then D * x
            xbc = conv1d_fused_extend(xbc, self.conv_weight, self.conv_bias, conv_states, batch, "silu")
            xs, bs, cs = xbc.split([self.inner, gn, gn], dim=-1)
            y = torch.zeros(t, self.num_heads, self.head_dim, dtype=x.dtype, device=x.device)  # padding rows: 0
            run_fused_extend_segments(device.gpu("mamba2_chunks").segment_kernel(
                xs, dt, A, bs, cs, None, self.dt_bias, self.dt_limit), y, ssm_states, batch)
            y = (y.float() + self.D.float()[:, None] * xs.view(t, self.num_heads, self.head_dim).float()).to(x.dtype)
            return self._out(y, z, t, x.dtype)
        chains = batch.chains  # a verify step of padded chains (the compiled verify)
        if batch.is_decode:
            xbc = causal_conv1d_update(xbc, self.conv_weight, self.conv_bias, conv_states, slots, "silu")
        elif chains is not None:
            xbc = causal_conv1d_chains(xbc, self.conv_weight, self.conv_bias, conv_states, slots, chains, "silu")
        else:
            xbc = conv1d_extend(xbc, self.conv_weight, self.conv_bias, conv_states, batch, "silu")  # [T, conv_dim]
        xs, bs, cs = xbc.split([self.inner, gn, gn], dim=-1)
        xs = xs.reshape(t, self.num_heads, self.head_dim)  # [T, H, P]
        bs = bs.reshape(t, self.n_groups, self.state_size)  # [T, G, N]
        cs = cs.reshape(t, self.n_groups, self.state_size)  # [T, G, N]
        if batch.is_decode:
            y = mamba2_state_update(xs, dt, A, bs, cs, self.D, self.dt_bias, ssm_states, slots,
                                    dt_limit=self.dt_limit)
            copy_decode_checkpoints(conv_states, batch)
            copy_decode_checkpoints(ssm_states, batch)
        elif chains is not None:
            y = mamba2_chains(xs, dt, A, bs, cs, self.D, self.dt_bias, ssm_states, slots, chains, dt_limit=self.dt_limit)
        elif device.fla_prefill(xs, batch):  # fla's chunked Triton kernel, as simple GLA
            y = device.gpu("fla_chunk").mamba2_chunk_scan_fla(
                xs, dt, A, bs, cs, self.D, self.dt_bias, batch.cu_seqlens, ssm_states, batch.state_slots,
                **ckpt_kwargs(batch, scan=False), dt_limit=self.dt_limit)  # [T, H, P]
        else:
            y = mamba2_chunk_scan_varlen(
                xs, dt, A, bs, cs, self.D, self.dt_bias, batch.cu_seqlens, ssm_states, batch.state_slots,
                **ckpt_kwargs(batch), dt_limit=self.dt_limit,
            )  # [T, H, P]
        return self._out(y, z, t, x.dtype)

    def _out(self, y: torch.Tensor, z: torch.Tensor, t: int, dtype: torch.dtype,
             gemv_step: bool = False) -> torch.Tensor | OutProjection:
        y = y.reshape(t, self.inner)  # [T, I]
        if self.norm is not None:
            y = self.norm(y, z)
        else:
            y = y.float() * F.silu(z.float())  # fp32, as HF's ungated path
        return out_projection(self.out_proj, y.to(dtype), gemv_step)
