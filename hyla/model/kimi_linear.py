"""Kimi-Linear (``KimiLinearForCausalLM``): Kimi Delta Attention + multi-head latent attention, MoE.

Each decoder layer is ``x + mixer(input_layernorm(x))`` then ``x + ffn(post_attention_layernorm(x))``
(plain RMSNorms, ``w * norm(x)``); the mixer is, per ``layer_types`` (or the checkpoint's
``linear_attn_config``: 1-based ``kda_layers`` / ``full_attn_layers``):

* **KDA** (``KimiDeltaAttention``): ``q, k, v`` projections (``H`` heads of ``D``), each through a
  depthwise causal conv (kernel ``short_conv_kernel_size``, no bias) and ``silu``; a per-channel
  log-decay ``g = -exp(A_log[h]) * softplus(f_b(f_a(x)) + dt_bias)`` ``[T, H, D]`` (fp32; softplus as
  transformers: ``x`` above 20), ``beta = sigmoid(b_proj(x))``; the KDA op
  (``hyla/model/ops/kda.py``, q/k l2-normalised); then an RMSNorm over each head (``o_norm``, fp32)
  gated by ``sigmoid(g_b(g_a(x)))`` and ``o_proj``. Its recurrent state is the conv window of
  ``[q | k | v]`` (``3·H·D`` channels) and the ``[H, D, D]`` fp32 KDA state: a checkpoint holds both.
* **MLA** (``LatentAttention``, DeepSeek-V2's multi-head latent attention without RoPE, as
  transformers' ``KimiLinearAttention``): ``q = q_proj(x)`` (or ``q_b(norm(q_a(x)))`` with a
  ``q_lora_rank``) of ``H`` heads ``[q_nope | q_pe]``; one latent per token,
  ``[c_kv | k_pe] = kv_a_proj_with_mqa(x)`` with ``c_kv`` RMS-normalised; ``kv_b_proj`` expands
  ``c_kv`` into each head's ``k_nope`` and ``v``; the key is ``[k_nope | k_pe]`` (``k_pe`` shared by the
  heads, never rotated), softmax scale ``(nope + rope)**-0.5``.

**What the KV pool holds (MLA).** The latent ``[c_kv | k_pe]`` (``kv_lora_rank + qk_rope_head_dim``
values, 576 for the published model), not per-head K/V (``H·(192 + 128)`` = 10240): the first half
in the layer's K buffer, the second half in its V buffer (``num_kv_heads = 1``,
``head_dim = ceil(576 / 2)``; an odd latent is zero-padded), so ``CacheLayout.kv_bytes_per_token``
is MLA's exact cache size. Attention runs in the latent space with the up-projections absorbed
(``W_uk``, ``W_uv`` are the two row blocks of each head in ``kv_b_proj``)::

    score(t, s) = q_nope_t W_uk . c_kv_s + q_pe_t . k_pe_s   (= [q_nope W_uk | q_pe] . latent_s)
    out_t       = (sum_s p_ts c_kv_s) W_uv^T

which is transformers' expanded form regrouped (equal up to fp32 rounding; no per-step expansion of the
cached tokens). Prefill and chunked prefill take ``latent_paged_attention``, decode steps
``latent_decode_attention`` (one batched attention over the step's KV table, which a compiled CPU
decode graph traces once); a GPU's fused decode steps and extends, and its prefills, run it as
Triton kernels (``ops/gpu/latent_attention.py``, reading the request table on the device).

FFN per ``mlp_layer_types`` (or the first ``first_k_dense_replace`` layers dense): a SwiGLU MLP, or a
MoE: sigmoid router with score-correction bias (``num_expert_group`` / ``topk_group`` grouping),
renormalised (``moe_renormalize``) top-``num_experts_per_token`` weights times
``routed_scaling_factor``, SwiGLU experts, plus ``num_shared_experts`` shared experts as one MLP of
``moe_intermediate_size * num_shared_experts`` (hyla's ``SparseMoE``, NemotronH's router).

``lm_head`` is never tied to the embedding (transformers' Kimi-Linear ignores ``tie_word_embeddings``).
Checkpoint layout: Moonshot's (what transformers' ``save_pretrained`` writes too): separate
``q/k/v_conv1d`` (concatenated here), ``f_a_proj`` / ``f_b_proj`` / ``dt_bias`` / ``A_log [1, 1, H, 1]`` on
``self_attn``, ``block_sparse_moe.experts.{e}.w1/w3/w2`` (gate / up / down), ``block_sparse_moe.gate``;
the dense MLP under ``mlp.`` or ``block_sparse_moe.``; transformers' in-memory names
(``forget_gate.*``, ``mlp.*``, fused ``conv1d.weight`` and ``experts.gate_up_proj`` / ``down_proj``) are
accepted as well.
"""

from __future__ import annotations

import itertools
import math
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from hyla.model.config import ModelConfig, hf_common_fields, hf_first, hf_layer_types, hf_require, hf_silu_only
from hyla.model.forward_batch import ForwardBatch
from hyla.model.layers import (
    ConvTickets,
    HybridForCausalLM,
    HybridLayer,
    RMSNorm,
    Rope,
    apply_rotary_,
    ckpt_kwargs,
    conv1d_extend,
    conv1d_fused_extend,
    copy_decode_checkpoints,
    run_fused_extend_segments,
    tree_masks,
)
from hyla.model.layers.device import fla_prefill, gpu, on_gpu
from hyla.model.linear import Linear
from hyla.model.ops.attention import ShortExtendLayout, extend_sdpa, widened
from hyla.model.ops.conv1d import causal_conv1d_chains, causal_conv1d_update
from hyla.model.ops.kda import DecayGate, chunk_kda_varlen, kda_chains, recurrent_kda_update
from hyla.model.ops.varlen import write_rows_
from hyla.model.weight_specs import (
    WeightSpec,
    concat_convs,
    embedding_specs,
    linear_specs,
    mlp_specs,
    norm_spec,
    stack_experts,
)

# transformers builds the MLA q_a / kv_a norms without an eps: its RMSNorm default
MLA_NORM_EPS = 1e-6


# --- Kimi Delta Attention ----------------------------------------------------------------------


class KimiDeltaAttention(nn.Module):
    """KDA mixer. ``qkv_proj`` rows are ``[q | k | v]`` (``H·D`` each, heads contiguous), the conv
    runs over those ``3·H·D`` channels. State: ``batch.conv_states[j]`` ``[S, 3HD, K-1]`` and
    ``batch.ssm_states[j]`` ``[S, H, D, D]`` (``j`` = the layer's linear ordinal). A fused decode step
    (a GPU's) runs ``ops/gpu/kda_decode.py``'s kernel with the conv inside (``FUSE_CONV``); a fused
    extend the conv's extend kernels and ``kda_decode``'s segments kernel; a GPU extend fla's
    ``chunk_kda``, its short rounds through that segments kernel."""

    fused_decode = True  # see HybridForCausalLM.supports_fused_decode
    fused_extend = True  # see HybridForCausalLM.supports_fused_extend
    chain_verify = True  # a verify step of padded chains: HybridForCausalLM.supports_chain_verify

    def __init__(self, config: ModelConfig, linear_ordinal: int):
        super().__init__()
        c = config
        self.state_index = linear_ordinal
        self.num_heads, self.head_dim = c.linear_num_value_heads, c.linear_value_head_dim
        self.dim = self.num_heads * self.head_dim
        self.eps = c.norm_eps
        h, d = c.hidden_size, self.head_dim
        self.qkv_proj = Linear(h, 3 * self.dim, bias=False, dtype=c.dtype)
        self.conv_weight = nn.Parameter(torch.empty(3 * self.dim, c.conv_kernel, dtype=c.dtype))  # [3HD, K]
        self.gate = DecayGate(c.kda_gate_lower_bound, c.kda_decay_rounded).check()  # Kimi-Linear's or Ling 3's
        if c.kda_full_rank_gates:  # Ling 3: f_proj and g_proj, [HD, h] each
            self.f_proj = Linear(h, self.dim, bias=False, dtype=c.dtype)
            self.g_proj = Linear(h, self.dim, bias=False, dtype=c.dtype)
            self.f_a_proj = self.f_b_proj = self.g_a_proj = self.g_b_proj = None
        else:  # Kimi-Linear: rank-D pairs
            self.f_proj = self.g_proj = None
            self.f_a_proj = Linear(h, d, bias=False, dtype=c.dtype)
            self.f_b_proj = Linear(d, self.dim, bias=False, dtype=c.dtype)
            self.g_a_proj = Linear(h, d, bias=False, dtype=c.dtype)
            self.g_b_proj = Linear(d, self.dim, bias=False, dtype=c.dtype)
        self.dt_bias = nn.Parameter(torch.empty(self.dim, dtype=torch.float32))
        self.A_log = nn.Parameter(torch.empty(self.num_heads, dtype=torch.float32))
        self.b_proj = Linear(h, self.num_heads, bias=False, dtype=c.dtype)
        self.o_norm = nn.Parameter(torch.empty(d, dtype=c.dtype))  # the per-head output RMSNorm weight
        self.o_proj = Linear(self.dim, h, bias=False, dtype=c.dtype)
        self._tickets = ConvTickets()  # the fused conv decode kernel's counters

    def forward(self, x: torch.Tensor, batch: ForwardBatch, rope: Rope | None = None) -> torch.Tensor:
        t, heads, d = x.shape[0], self.num_heads, self.head_dim
        conv_states, ssm_states = batch.conv_states[self.state_index], batch.ssm_states[self.state_index]
        slots = batch.state_slots
        mixed = self.qkv_proj(x)  # [T, 3HD]
        # the raw decay input [T, HD] and gate [T, H]
        f = self.f_proj(x) if self.f_proj is not None else self.f_b_proj(self.f_a_proj(x))
        b, gate = self.b_proj(x), self.gate
        kernels = gpu("kda_decode") if batch.on_device or fla_prefill(x, batch) else None
        if batch.fused_decode:  # Triton: the conv window, the gates and the state update in one kernel (chains
            # too), or the conv in a kernel of its own
            chain = batch.chain_slots
            if kernels.FUSE_CONV and self.conv_weight.shape[1] == kernels.CONV_WIDTH:
                seqs = slots.shape[0] if chain is None else chain.shape[1]
                o = kernels.kda_conv_decode_fused(mixed, self.conv_weight, conv_states, self._tickets(seqs * heads, x.device),
                                                  f, b, self.A_log, self.dt_bias, ssm_states, slots, chain=chain,
                                                  gate=gate)
            else:
                mixed = gpu("conv1d_decode").causal_conv1d_update_fused(mixed, self.conv_weight, None, conv_states,
                                                                         slots, "silu", chain=chain)
                o = kernels.kda_decode_fused(mixed, f, b, self.A_log, self.dt_bias, ssm_states, slots,
                                             chain=chain, gate=gate)  # [B, H, D]
            return self._out(o, x)
        if batch.fused_extend is not None:  # Triton: the conv, then the recurrence in one launch (padding rows: 0)
            mixed = conv1d_fused_extend(mixed, self.conv_weight, None, conv_states, batch, "silu")
            o = torch.zeros(t, heads, d, dtype=x.dtype, device=x.device)
            run_fused_extend_segments(kernels.segment_kernel(mixed, f, b, self.A_log, self.dt_bias, gate), o,
                                      ssm_states, batch)
            return self._out(o, x)
        plan, chains = batch.state_slot_plan, batch.chains  # (chains: the compiled verify step)
        if batch.is_decode:
            mixed = causal_conv1d_update(mixed, self.conv_weight, None, conv_states, plan, "silu")
        elif chains is not None:
            mixed = causal_conv1d_chains(mixed, self.conv_weight, None, conv_states, plan, chains, "silu")
        else:
            mixed = conv1d_extend(mixed, self.conv_weight, None, conv_states, batch, "silu")
        q, k, v = (part.reshape(t, heads, d) for part in mixed.split(self.dim, dim=-1))  # [T, H, D] each
        if batch.is_decode:
            o = recurrent_kda_update(q, k, v, *self._gates(f, b), ssm_states, plan)
            copy_decode_checkpoints(conv_states, batch)
            copy_decode_checkpoints(ssm_states, batch)
        elif chains is not None:
            o = kda_chains(q, k, v, *self._gates(f, b), ssm_states, plan, chains)
        elif kernels is not None:  # fla's chunked Triton kernel; short rounds through hyla's recurrent one
            o = gpu("fla_chunk").chunk_kda_fla(
                q, k, v, None, None, batch.cu_seqlens, ssm_states, slots, **ckpt_kwargs(batch, scan=False),
                segments=kernels.segment_kernel(mixed, f, b, self.A_log, self.dt_bias, gate),
                gates=lambda: self._gates(f, b))  # [T, H, D]
        else:
            o = chunk_kda_varlen(q, k, v, *self._gates(f, b), batch.cu_seqlens, ssm_states, slots,
                                 **ckpt_kwargs(batch), use_qk_l2norm=True)  # [T, H, D]
        return self._out(o, x)

    def _gates(self, f: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(g [T, H, D], beta [T, H])``: the per-channel log-decay of the layer's :class:`DecayGate`
        (fp32) and ``sigmoid(b)`` (b's dtype) from the raw ``f [T, HD]``, ``b [T, H]``."""
        return self.gate(f, self.A_log, self.dt_bias, self.num_heads), torch.sigmoid(b)

    def _out(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The KDA output ``o [T, H, D]`` through each head's RMSNorm (fp32), gated by
        ``sigmoid(g_b(g_a(x)))`` (or ``sigmoid(g_proj(x))``), and ``o_proj``."""
        t, heads, d = o.shape
        gate = (self.g_proj(x) if self.g_proj is not None else self.g_b_proj(self.g_a_proj(x))).view(t, heads, d)
        o32 = o.float()
        o32 = o32 * torch.rsqrt(o32.pow(2).mean(-1, keepdim=True) + self.eps) * self.o_norm.float()
        o = (o32 * torch.sigmoid(gate.float())).to(x.dtype)  # [T, H, D]
        return self.o_proj(o.reshape(t, self.dim))


# --- multi-head latent attention ---------------------------------------------------------------


class LatentAttention(nn.Module):
    """MLA, attending in the latent space over the paged KV pool (see the module docstring: the pool
    holds each token's latent ``[c_kv | k_pe]``, half in K, half in V). Kimi-Linear's has no RoPE; Ling 3's
    (``config.rotary_dim``) rotates ``q_pe`` and ``k_pe`` (before ``k_pe`` enters the pool; on every path with
    the PyTorch ops, from the tables of the model's ``Rope``, which a fused step makes for it) and gates each
    head's output by ``sigmoid(g_proj(x))`` (``config.mla_output_gate``). A fused
    decode step (a GPU's) attends through ``ops/gpu/latent_attention.py``'s split-KV kernel over the
    request table on the device, a fused extend through its causal form."""

    fused_decode = True  # see HybridForCausalLM.supports_fused_decode
    fused_extend = True  # see HybridForCausalLM.supports_fused_extend
    chain_verify = True  # a verify step of padded chains (latent_short_extend_attention)

    def __init__(self, config: ModelConfig, attention_ordinal: int):
        super().__init__()
        c = config
        self.kv_index = attention_ordinal
        self.num_heads = c.num_attention_heads
        self.nope, self.rope, self.v_dim = c.mla_qk_nope_head_dim, c.mla_qk_rope_head_dim, c.mla_v_head_dim
        self.rank = c.mla_kv_lora_rank
        self.scaling = (self.nope + self.rope) ** -0.5
        h, heads, bias = c.hidden_size, self.num_heads, c.attention_bias
        q_out = heads * (self.nope + self.rope)
        if c.mla_q_lora_rank:
            self.q_proj = None
            self.q_a_proj = Linear(h, c.mla_q_lora_rank, bias=bias, dtype=c.dtype)
            self.q_a_norm = RMSNorm(c.mla_q_lora_rank, MLA_NORM_EPS, dtype=c.dtype)
            self.q_b_proj = Linear(c.mla_q_lora_rank, q_out, bias=False, dtype=c.dtype)
        else:
            self.q_proj = Linear(h, q_out, bias=False, dtype=c.dtype)
            self.q_a_proj = self.q_a_norm = self.q_b_proj = None
        self.kv_a_proj = Linear(h, self.rank + self.rope, bias=bias, dtype=c.dtype)
        self.kv_a_norm = RMSNorm(self.rank, MLA_NORM_EPS, dtype=c.dtype)
        self.kv_b_proj = Linear(self.rank, heads * (self.nope + self.v_dim), bias=False, dtype=c.dtype)
        self.kv_b_proj.lora_refused = "its weight is absorbed into the queries and outputs of attention"
        self.kv_b_proj.keeps_fp8 = False  # read as a matrix (absorbed into q and the output), never run
        self.o_proj = Linear(heads * self.v_dim, h, bias=bias, dtype=c.dtype)
        self.g_proj = Linear(h, heads, bias=False, dtype=c.dtype) if c.mla_output_gate else None
        if c.rotary_dim not in (0, self.rope):
            raise ValueError(f"MLA's RoPE rotates all of qk_rope_head_dim={self.rope}, got rotary_dim={c.rotary_dim}")
        self.rotates_in_pytorch = bool(c.rotary_dim)  # on every path: the model's Rope brings its tables

    def forward(self, x: torch.Tensor, batch: ForwardBatch, rope: Rope | None = None) -> torch.Tensor:
        t, heads = x.shape[0], self.num_heads
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_norm(self.q_a_proj(x)))
        q_nope, q_pe = q.view(t, heads, self.nope + self.rope).split([self.nope, self.rope], dim=-1)
        c_kv, k_pe = self.kv_a_proj(x).split([self.rank, self.rope], dim=-1)
        if self.rotates_in_pytorch:  # rotate-half RoPE (interleaved checkpoints are de-interleaved at load)
            q_pe = apply_rotary_(q_pe, rope.cos, rope.sin)  # (rope.sin: signed_sin's)
            k_pe = apply_rotary_(k_pe[:, None], rope.cos, rope.sin)[:, 0]
        latent = torch.cat([self.kv_a_norm(c_kv), k_pe], dim=-1)  # [T, r + rope]
        w = self.kv_b_proj.weight.view(heads, self.nope + self.v_dim, self.rank)
        w_uk, w_uv = w[:, : self.nope], w[:, self.nope :]  # [H, nope, r], [H, v, r]
        q_latent = torch.cat([torch.einsum("thn,hnr->thr", q_nope, w_uk), q_pe], dim=-1)  # [T, H, r + rope]
        kb, vb = batch.k_buffers[self.kv_index], batch.v_buffers[self.kv_index]
        if batch.fused_decode:  # the latents written to their slots, then a Triton split-KV attention
            write_latents(latent, kb, vb, batch.out_cache_loc)
            o = gpu("latent_attention").paged_latent_decode_attention(
                q_latent, kb, vb, batch.req_to_token, batch.req_pool_indices, batch.kv_lens, self.scaling,
                self.rank)  # [B, H, r]
        elif batch.fused_extend is not None:  # the same for one sequence's new tokens, causal
            write_latents(latent, kb, vb, batch.out_cache_loc)
            fe = batch.fused_extend
            o = gpu("latent_attention").paged_latent_extend_attention(
                q_latent, kb, vb, batch.req_to_token, fe.req_row, fe.kv_lens, self.scaling, self.rank)  # [T, H, r]
        elif batch.is_decode:  # one batched attention over the step's KV table (what a compiled graph traces)
            write_latents(latent, kb, vb, batch.out_cache_loc)
            o = latent_decode_attention(q_latent, kb, vb, batch.kv_table, batch.decode_kv_layout()[1], self.scaling,
                                        self.rank)  # [B, H, r]
        elif on_gpu(q_latent) and batch.tree_parents is None and batch.chain_ckpt_rows is None:
            write_latents(latent, kb, vb, batch.out_cache_loc)  # a CUDA extend: that kernel, sequence by sequence
            o = latent_extend_by_sequence(q_latent, kb, vb, batch, self.scaling, self.rank)  # [T, H, r]
        elif batch.short_extend is not None:  # a short extend (a verify step's trees, chains or padded chains, or
            # a few tokens a sequence): one batched fp32 attention, shapes from the layout (a compiled graph's)
            write_latents(latent, kb, vb, batch.out_cache_loc)
            o = latent_short_extend_attention(q_latent, kb, vb, batch.short_extend, self.scaling, self.rank)
        else:
            o = latent_paged_attention(
                q_latent, latent, kb, vb, batch.out_cache_loc, batch.kv_indices, batch.kv_indptr, batch.prefix_lens,
                batch.extend_lens, self.scaling, self.rank, tree_masks=tree_masks(batch), kv_starts=batch.kv_starts,
            )  # [T, H, r]
        o = torch.einsum("thr,hvr->thv", o, w_uv)  # [T, H, v]
        if self.g_proj is not None:  # transformers: sigmoid in fp32, rounded to the model dtype
            o = o * torch.sigmoid(self.g_proj(x).float()).to(o.dtype)[..., None]
        return self.o_proj(o.reshape(t, heads * self.v_dim))


def latent_paged_attention(
    q: torch.Tensor,  # [T, H, L]
    latent: torch.Tensor,  # [T, L]
    k_buffer: torch.Tensor,  # [S, 1, ceil(L/2)]: latent[:half]
    v_buffer: torch.Tensor,  # [S, 1, ceil(L/2)]: latent[half:], zero-padded
    out_cache_loc: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_indptr: torch.Tensor,
    prefix_lens: Sequence[int],
    extend_lens: Sequence[int],
    scaling: float,
    value_dim: int,
    tree_masks: Sequence[torch.Tensor | None] | None = None,
    kv_starts: Sequence[int] | None = None,
) -> torch.Tensor:
    """Write the new tokens' latents into their pool slots, then attend causally (each new token to
    its sequence's cached prefix and the new tokens up to itself) with keys = the whole latent and
    values = its first ``value_dim`` channels. Returns ``[T, H, value_dim]`` in ``q``'s dtype; the
    softmax is fp32 (as ``ops.attention.paged_attention``, whose slot, ``tree_masks`` and
    ``kv_starts`` conventions this follows: ``kv_indptr`` on the host, so nothing is read back)."""
    t, heads, width = q.shape
    half = k_buffer.shape[-1]
    if latent.shape != (t, width) or k_buffer.shape[1:] != (1, half) or v_buffer.shape[1:] != (1, half) \
            or not width <= 2 * half < width + 2:
        raise ValueError(f"latent {tuple(latent.shape)} / q {tuple(q.shape)} do not fit the KV buffers "
                         f"{tuple(k_buffer.shape)}, {tuple(v_buffer.shape)} (two halves of the latent)")
    if sum(extend_lens) != t or out_cache_loc.numel() != t:
        raise ValueError(f"extend_lens / out_cache_loc disagree with the {t} new tokens")
    write_latents(latent, k_buffer, v_buffer, out_cache_loc)

    out = q.new_empty(t, heads, value_dim)
    indptr = list(kv_starts) if kv_starts is not None else kv_indptr.tolist()
    start = 0
    for i, (prefix, extend) in enumerate(zip(prefix_lens, extend_lens)):
        if extend == 0:
            continue
        if indptr[i + 1] - indptr[i] != prefix + extend:
            raise ValueError(f"sequence {i}: kv_indptr gives {indptr[i + 1] - indptr[i]} slots, "
                             f"expected {prefix + extend}")
        slots = kv_indices[indptr[i] : indptr[i + 1]]
        keys = widened(read_latents(k_buffer, v_buffer, slots, width), q.dtype)[None]  # [1, L, W]
        oi = extend_sdpa(q[start : start + extend].transpose(0, 1), keys, keys[..., :value_dim], prefix,
                         tree_masks[i] if tree_masks is not None else None, scaling)  # [H, E, value_dim]
        out[start : start + extend] = oi.transpose(0, 1)
        start += extend
    return out


def latent_decode_attention(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, kv_table: torch.Tensor,
                            kv_mask: torch.Tensor | None, scaling: float, value_dim: int) -> torch.Tensor:
    """A decode step's MLA, the new latents already in the pool: query ``q [B, H, L]`` of sequence ``i``
    over the latents of its slots ``kv_table[i]`` (``[B, Lk]``, padded; ``kv_mask [B, Lk]`` additive fp32,
    -inf past each sequence's length, or None) -> ``[B, H, value_dim]`` in q's dtype (fp32 softmax).
    ``ops.attention.decode_attention``'s form — one gather per buffer, two batched matmuls, shapes from
    the step's table — so a compiled decode graph traces it once for every context length."""
    b, heads, width = q.shape
    length = kv_table.shape[1]
    keys = widened(read_latents(k_buffer, v_buffer, kv_table.reshape(-1), width), torch.float32).view(b, length, width)
    scores = torch.matmul(q.float() * scaling, keys.transpose(-1, -2))  # [B, H, Lk]
    if kv_mask is not None:
        scores += kv_mask.view(b, 1, length)
    return torch.matmul(torch.softmax(scores, dim=-1), keys[..., :value_dim]).to(q.dtype)  # [B, H, value_dim]


def latent_short_extend_attention(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                                  layout: ShortExtendLayout, scaling: float, value_dim: int) -> torch.Tensor:
    """A short extend's MLA (a verify step: chains, padded chains or token trees), the new latents already in
    the pool: ``ops.attention.short_extend_attention``'s layout (each sequence's slots, its new tokens padded
    to ``E`` rows, one additive mask) with :func:`latent_decode_attention`'s math, ``q [T, H, L]`` ->
    ``[T, H, value_dim]``. Shapes from the layout alone, so a compiled verify step traces it once."""
    b, e, length = layout.kv_rows.shape[0], layout.width, layout.kv_rows.shape[-1]
    heads, width = q.shape[1:]
    keys = widened(read_latents(k_buffer, v_buffer, layout.kv_rows.reshape(-1), width),
                   torch.float32).view(b, length, width)  # [B, Lk, L]
    qp = q if layout.q_rows is None else q.index_select(0, layout.q_rows)  # [B*E, H, L]
    scores = torch.matmul(qp.float().view(b, e * heads, width) * scaling, keys.transpose(-1, -2))  # [B, E*H, Lk]
    scores.view(b, e, heads, length).add_(layout.mask.view(b, e, 1, length))
    out = torch.matmul(torch.softmax(scores, dim=-1), keys[..., :value_dim])  # [B, E*H, value_dim]
    out = out.view(b * e, heads, value_dim)
    if layout.out_rows is not None:
        out = out.index_select(0, layout.out_rows)
    return out.to(q.dtype)  # [T, H, value_dim]


def read_latents(k_buffer: torch.Tensor, v_buffer: torch.Tensor, slots: torch.Tensor, width: int) -> torch.Tensor:
    """The latents ``[n, width]`` of pool slots ``slots [n]``: their two halves from the K and V buffers
    (``[S, 1, half]``), joined, the zero padding cut (the buffers' dtype)."""
    half = k_buffer.shape[-1]
    return torch.cat([k_buffer.view(-1, half).index_select(0, slots), v_buffer.view(-1, half).index_select(0, slots)],
                     dim=-1)[:, :width]


def latent_extend_by_sequence(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, batch: ForwardBatch,
                              scaling: float, value_dim: int) -> torch.Tensor:
    """A CUDA extend's MLA (chains: no token trees), its new latents already in the pool: each
    sequence's new tokens through ``latent_attention.paged_latent_extend_attention``, causal over its
    slots in ``kv_indices`` (from ``kv_starts[i]``; new token ``j`` sees ``prefix_lens[i] + j + 1``
    keys), one launch a sequence -> ``[T, H, value_dim]``. Where the PyTorch path gathers each
    sequence's latents and runs SDPA, whose math fallback (a 576-wide head is past the flash kernels)
    builds the whole ``[H, E, L]`` score matrix: 1 GB in bf16 for one 4,096-token prompt of 32 heads.
    Every launch passes the whole ``kv_indices`` as a one-column table (its row the sequence's start)
    and slices of two index tensors made once, so no batch compiles another kernel variant; those are
    made on the device from ``3 B`` host numbers (not one per token: a long prompt's 8,192 would cost
    ~1 ms of Python in every MLA layer)."""
    kernels = gpu("latent_attention")
    b, t = len(batch.extend_lens), q.shape[0]
    cu = itertools.accumulate(batch.extend_lens, initial=0)
    host = torch.tensor([*batch.kv_starts[:b], *(p + 1 - c for p, c in zip(batch.prefix_lens, cu)), *batch.extend_lens],
                        dtype=torch.long)
    rows, shift, counts = host.to(q.device, non_blocking=True).view(3, b)
    # each sequence's first slot in kv_indices; each token's keys: its sequence's prefix + its index in it + 1
    lens = torch.arange(t, device=q.device) + torch.repeat_interleave(shift, counts, output_size=t)
    table = batch.kv_indices.view(-1, 1)
    out = q.new_empty(q.shape[0], q.shape[1], value_dim)
    start = 0
    for i, n in enumerate(batch.extend_lens):
        if n:
            out[start:start + n] = kernels.paged_latent_extend_attention(
                q[start:start + n], k_buffer, v_buffer, table, rows[i:i + 1], lens[start:start + n], scaling,
                value_dim)
        start += n
    return out


def write_latents(latent: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                  out_cache_loc: torch.Tensor) -> None:
    """The new tokens' latents ``[T, L]`` into their pool slots: the first half of each (zero-padded
    to ``2 * half``) in the K buffer, the second in the V buffer (``[S, 1, half]``). No host read."""
    half = k_buffer.shape[-1]
    padded = F.pad(latent, (0, 2 * half - latent.shape[1])).to(k_buffer.dtype)  # [T, 2*half]
    write_rows_(k_buffer, out_cache_loc, padded[:, None, :half])
    write_rows_(v_buffer, out_cache_loc, padded[:, None, half:])


# --- the model ---------------------------------------------------------------------------------


class KimiLinearForCausalLM(HybridForCausalLM):
    attention_mixer = LatentAttention
    linear_mixer = KimiDeltaAttention

    def build_layer(self, index: int) -> HybridLayer:
        return self.mixer_ffn_layer(index)  # KDA or MLA, then the MLP or MoE

    @classmethod
    def normalize_hf_name(cls, name: str) -> str | None:
        """transformers' in-memory names -> Moonshot's (the names ``hf_weight_specs`` reads)."""
        name = name.replace(".mlp.", ".block_sparse_moe.").replace(".self_attn.forget_gate.", ".self_attn.")
        return name

    @classmethod
    def hf_weight_specs(cls, config: ModelConfig) -> list[WeightSpec]:
        c = config
        specs = embedding_specs(c, "model.embed_tokens.weight", "model.norm.weight", tied=False)  # see parse_hf_config
        for i, (mixer, ffn) in enumerate(zip(c.layer_types, c.ffn_types)):
            t, s = f"layers.{i}", f"model.layers.{i}"
            specs += [
                norm_spec(f"{t}.mixer_norm.weight", f"{s}.input_layernorm.weight"),
                norm_spec(f"{t}.ffn_norm.weight", f"{s}.post_attention_layernorm.weight"),
            ]
            specs += mla_specs(c, f"{t}.mixer", f"{s}.self_attn") if mixer == "attention" else \
                kda_specs(c, f"{t}.mixer", f"{s}.self_attn")
            moe = f"{s}.block_sparse_moe"
            specs += moe_specs(c, f"{t}.ffn", moe) if ffn == "moe" else mlp_specs(f"{t}.ffn", moe)
        return specs


def kda_specs(c: ModelConfig, target: str, source: str, out: str = "o_proj") -> list[WeightSpec]:
    """A KDA layer from separate ``{q,k,v}_conv1d`` (or transformers' fused ``conv1d``), its gate
    projections as ``config.kda_full_rank_gates`` says, the output projection ``out``."""
    convs = tuple(f"{source}.{p}_conv1d.weight" for p in "qkv")
    gates = ("f_proj", "g_proj") if c.kda_full_rank_gates else ("f_a_proj", "f_b_proj", "g_a_proj", "g_b_proj")
    return [
        *linear_specs(f"{target}.qkv_proj", [f"{source}.q_proj", f"{source}.k_proj", f"{source}.v_proj"], False),
        WeightSpec(f"{target}.conv_weight", convs, concat_convs),
        WeightSpec(f"{target}.conv_weight", (f"{source}.conv1d.weight",), concat_convs),  # transformers'
        *(spec for g in gates for spec in linear_specs(f"{target}.{g}", [f"{source}.{g}"], False)),
        WeightSpec(f"{target}.dt_bias", (f"{source}.dt_bias",), lambda ts: ts[0].reshape(-1)),
        WeightSpec(f"{target}.A_log", (f"{source}.A_log",), lambda ts: ts[0].reshape(-1)),  # [1, 1, H, 1] -> [H]
        *linear_specs(f"{target}.b_proj", [f"{source}.b_proj"], False),
        WeightSpec(f"{target}.o_norm", (f"{source}.o_norm.weight",)),
        *linear_specs(f"{target}.o_proj", [f"{source}.{out}"], False),
    ]


def mla_specs(c: ModelConfig, target: str, source: str, out: str = "o_proj",
              interleaved_rope: bool = False) -> list[WeightSpec]:
    """An MLA layer (``q_proj`` or the ``q_a`` / ``q_b`` pair, the latent projections, ``config.mla_output_gate``'s
    ``g_proj``), the output projection ``out``. ``interleaved_rope``: the checkpoint's RoPE channels are
    DeepSeek's interleaved pairs, reordered here (:func:`deinterleave_rope_rows`)."""
    bias = c.attention_bias
    q_rows = rope_rows = None
    if interleaved_rope:
        q_rows = deinterleave_rope_rows(c.mla_qk_nope_head_dim + c.mla_qk_rope_head_dim, c.mla_qk_rope_head_dim)
        rope_rows = deinterleave_rope_rows(c.mla_kv_lora_rank + c.mla_qk_rope_head_dim, c.mla_qk_rope_head_dim)
    if c.mla_q_lora_rank:
        q = [
            *linear_specs(f"{target}.q_a_proj", [f"{source}.q_a_proj"], bias),
            norm_spec(f"{target}.q_a_norm.weight", f"{source}.q_a_layernorm.weight"),
            WeightSpec(f"{target}.q_b_proj.weight", (f"{source}.q_b_proj.weight",), q_rows),
        ]
    else:
        q = [WeightSpec(f"{target}.q_proj.weight", (f"{source}.q_proj.weight",), q_rows)]
    kv_a = [WeightSpec(f"{target}.kv_a_proj.{p}", (f"{source}.kv_a_proj_with_mqa.{p}",), rope_rows)
            for p in (("weight", "bias") if bias else ("weight",))]
    gate = linear_specs(f"{target}.g_proj", [f"{source}.g_proj"], False) if c.mla_output_gate else []
    return [
        *q,
        *kv_a,
        norm_spec(f"{target}.kv_a_norm.weight", f"{source}.kv_a_layernorm.weight"),
        *linear_specs(f"{target}.kv_b_proj", [f"{source}.kv_b_proj"], False),
        *gate,
        *linear_specs(f"{target}.o_proj", [f"{source}.{out}"], bias),
    ]


def deinterleave_rope_rows(rows_per_head: int, rope: int) -> Callable[[list[torch.Tensor]], torch.Tensor]:
    """A projection's rows (weight or bias) with the last ``rope`` of every ``rows_per_head`` in DeepSeek's
    interleaved RoPE layout (pairs ``(x0, x1), (x2, x3), ...``, each rotated by one frequency) reordered to
    the rotate-half layout (``x0, x2, ..., x1, x3, ...``): transformers' ``apply_rotary_pos_emb_interleave`` is
    then exactly the rotate-half RoPE of ``apply_rotary_`` (its output is in that order too, and scores
    see the same permutation on both sides)."""
    def combine(tensors: list[torch.Tensor]) -> torch.Tensor:
        w = tensors[0]
        keep = torch.arange(rows_per_head - rope, device=w.device)
        pairs = torch.arange(rope, device=w.device).view(-1, 2).t().reshape(-1) + (rows_per_head - rope)
        return w.reshape(-1, rows_per_head, *w.shape[1:])[:, torch.cat([keep, pairs])].reshape(w.shape)
    return combine


def moe_specs(c: ModelConfig, target: str, source: str, expert_names: tuple[str, str, str] = ("w1", "w3", "w2"),
              router_bias: str = "e_score_correction_bias") -> list[WeightSpec]:
    """DeepSeek-V3's MoE: the router ``gate`` (its score-correction bias ``gate.{router_bias}``), the experts
    per expert (``experts.{e}.{gate | up | down}``: ``expert_names``) or fused as transformers holds them,
    the shared experts."""
    experts = range(c.num_experts)
    gate, up, down = expert_names
    gate_up = tuple(f"{source}.experts.{e}.{w}.weight" for e in experts for w in (gate, up))
    specs = [
        WeightSpec(f"{target}.router.weight", (f"{source}.gate.weight",)),
        WeightSpec(f"{target}.e_score_correction_bias", (f"{source}.gate.{router_bias}",)),
        WeightSpec(f"{target}.w_in", gate_up, stack_experts(2)),  # [E, 2I, H]: [gate | up]
        WeightSpec(f"{target}.w_in", (f"{source}.experts.gate_up_proj",)),  # transformers' fused layout
        WeightSpec(f"{target}.w_out", tuple(f"{source}.experts.{e}.{down}.weight" for e in experts), stack_experts(1)),
        WeightSpec(f"{target}.w_out", (f"{source}.experts.down_proj",)),
    ]
    if c.shared_expert_intermediate_size:
        specs += mlp_specs(f"{target}.shared_expert", f"{source}.shared_experts")
    return specs


# ------------------------------------------------------------------------------------------------
# config.json parsing (``ModelConfig.from_hf`` through ``hyla.model.architectures``)
# ------------------------------------------------------------------------------------------------
def parse_hf_config(cfg: Mapping[str, Any], arch: str, dtype: str | torch.dtype | None) -> dict[str, Any]:
    """``ModelConfig`` fields of a Kimi-Linear ``config.json``: Moonshot's keys (``linear_attn_config``,
    ``num_experts``, ``num_experts_per_token``, ``num_shared_experts``, ``moe_renormalize``,
    ``num_expert_group``, ``model_max_length``, ``first_k_dense_replace``) or transformers' names for
    them, with ``KimiLinearConfig``'s defaults. Raises ``ValueError`` for what transformers' Kimi-Linear
    does not compute (RoPE in MLA, an MLA output gate, a KDA gate lower bound or full-rank gate, a
    non-``silu`` activation or non-sigmoid router) and for inconsistent layer lists."""
    cfg = dict(cfg)
    cfg["max_position_embeddings"] = hf_first(cfg, ("model_max_length", "max_position_embeddings"), 1048576)
    common = hf_common_fields(cfg, arch, dtype)  # first: its required keys are checked first
    # transformers' KimiLinearForCausalLM ties nothing (_tied_weights_keys = {}), whatever
    # tie_word_embeddings says: lm_head.weight is always its own tensor
    common["tie_word_embeddings"] = False
    num_layers = int(hf_require(cfg, "num_hidden_layers"))
    linear = dict(cfg.get("linear_attn_config") or {})
    for key, what in (("gate_lower_bound", "a KDA gate lower bound"), ("use_full_rank_gate", "a full-rank KDA gate")):
        if linear.get(key):
            raise ValueError(f"Kimi-Linear linear_attn_config.{key}: {what} is not supported")
    if cfg.get("mla_use_nope", True) is False:
        raise ValueError("Kimi-Linear with mla_use_nope=false (RoPE in MLA) is not supported: transformers' "
                         "KimiLinearAttention applies no RoPE")
    if cfg.get("mla_use_output_gate"):
        raise ValueError("Kimi-Linear mla_use_output_gate is not supported")
    hf_silu_only(cfg, arch)
    router = cfg.get("moe_router_activation_func", "sigmoid")
    if router != "sigmoid":
        raise ValueError(f"unsupported moe_router_activation_func {router!r} for {arch} (expected 'sigmoid')")
    if int(cfg.get("moe_layer_freq", 1) or 1) != 1:
        raise ValueError("Kimi-Linear moe_layer_freq != 1 is not supported (transformers reads "
                         "first_k_dense_replace only)")

    linear_heads = int(hf_first(linear, ("num_heads",), cfg.get("linear_num_heads", 32)))
    linear_dim = int(hf_first(linear, ("head_dim",), cfg.get("linear_head_dim", 128)))
    kernel = int(hf_first(linear, ("short_conv_kernel_size",), cfg.get("linear_conv_kernel_dim", 4)))
    ffn_types = ffn_layer_types(cfg, num_layers, "Kimi-Linear", first_dense=1)
    return dict(
        **common,
        model_type="kimi_linear",
        layer_types=_layer_types(cfg, linear, num_layers),
        ffn_types=ffn_types,
        norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
        zero_centered_norm=False,
        **kda_fields(linear_heads, linear_dim, kernel, "Kimi-Linear"),
        **latent_attention_fields(cfg, "Kimi-Linear"),
        rotary_dim=0,
        **moe_fields(cfg, ffn_types, "Kimi-Linear", intermediate=9216, num_experts=256, moe_width=1024,
                     routed_scaling=2.446),
    )


def kda_fields(heads: int, head_dim: int, kernel: int, name: str) -> dict[str, Any]:
    """The ``ModelConfig`` fields of KDA layers of ``heads`` heads of ``head_dim`` (as many key as value
    heads) and a ``kernel``-wide short conv (``ValueError`` below 2)."""
    if kernel < 2:
        raise ValueError(f"{name} short_conv_kernel_size must be >= 2, got {kernel}")
    return dict(linear_kind="kda", conv_kernel=kernel, linear_num_key_heads=heads, linear_num_value_heads=heads,
                linear_key_head_dim=head_dim, linear_value_head_dim=head_dim)


def latent_attention_fields(cfg: Mapping[str, Any], name: str) -> dict[str, Any]:
    """MLA's ``ModelConfig`` fields from DeepSeek-V3's keys (``num_attention_heads``, ``kv_lora_rank``,
    ``q_lora_rank``, ``qk_nope_head_dim``, ``qk_rope_head_dim``, ``v_head_dim``, ``attention_bias``, with
    their defaults): the KV pool's geometry is the latent's (one "head" of half its width)."""
    heads = int(cfg.get("num_attention_heads", 32))
    rank, rope = int(cfg.get("kv_lora_rank", 512)), int(cfg.get("qk_rope_head_dim", 64))
    nope, v_dim = int(cfg.get("qk_nope_head_dim", 128)), int(cfg.get("v_head_dim") or 128)
    if min(heads, rank, nope + rope, v_dim) <= 0:
        raise ValueError(f"{name} MLA needs positive num_attention_heads, kv_lora_rank, "
                         "qk_nope_head_dim + qk_rope_head_dim and v_head_dim")
    return dict(
        num_attention_heads=heads,
        num_kv_heads=1,
        head_dim=math.ceil((rank + rope) / 2),  # the pool holds the latent, half in K, half in V
        attention_bias=bool(cfg.get("attention_bias", False)),
        mla_kv_lora_rank=rank,
        mla_q_lora_rank=int(cfg.get("q_lora_rank") or 0),
        mla_qk_nope_head_dim=nope,
        mla_qk_rope_head_dim=rope,
        mla_v_head_dim=v_dim,
    )


def moe_fields(cfg: Mapping[str, Any], ffn_types: Sequence[str], name: str, *, intermediate: int, num_experts: int,
               moe_width: int, routed_scaling: float, groups: int = 1, topk_groups: int = 1) -> dict[str, Any]:
    """The FFN fields of DeepSeek-V3's MoE (a SwiGLU MLP of ``intermediate_size`` in the dense layers;
    the sigmoid router with score-correction bias and expert groups, shared experts) from Moonshot's /
    Ling's keys or transformers' names for them; the keyword arguments are the architecture's defaults.
    (The caller checks ``hidden_act``: ``hf_silu_only``.)"""
    moe = "moe" in ffn_types
    experts = int(hf_first(cfg, ("num_experts", "num_local_experts"), num_experts))
    if moe and experts < 1:
        raise ValueError(f"{name} sparse layers need num_experts >= 1, got {experts}")
    width = int(cfg.get("moe_intermediate_size", moe_width))
    shared = int(hf_first(cfg, ("num_shared_experts", "n_shared_experts"), 1))
    return dict(
        intermediate_size=int(cfg.get("intermediate_size", intermediate)),
        hidden_act="silu",
        num_experts=experts if moe else 0,
        num_experts_per_tok=int(hf_first(cfg, ("num_experts_per_token", "num_experts_per_tok"), 8)) if moe else 0,
        moe_intermediate_size=width if moe else 0,
        shared_expert_intermediate_size=width * shared if moe else 0,
        shared_expert_gate=False,
        norm_topk_prob=bool(hf_first(cfg, ("moe_renormalize", "norm_topk_prob"), True)),
        router="sigmoid",
        router_num_groups=int(hf_first(cfg, ("num_expert_group", "n_group"), groups)),
        router_topk_groups=int(hf_first(cfg, ("topk_group",), topk_groups)),
        routed_scaling_factor=float(hf_first(cfg, ("routed_scaling_factor",), routed_scaling)),
    )


def _layer_types(cfg: Mapping[str, Any], linear: Mapping[str, Any], num_layers: int) -> tuple[str, ...]:
    """transformers' precedence: ``layer_types``, else ``linear_attn_config``'s 1-based
    ``full_attn_layers`` / ``kda_layers`` (together covering every layer), else full attention at
    every 4th layer from layer 4 (0-based ``i % 4 == 0``, ``i > 0``)."""
    listed = cfg.get("layer_types")
    if listed is None and "full_attn_layers" in linear and "kda_layers" in linear:
        full, kda = [int(i) for i in linear["full_attn_layers"]], [int(i) for i in linear["kda_layers"]]
        if sorted(full + kda) != list(range(1, num_layers + 1)):
            raise ValueError(f"linear_attn_config full_attn_layers {full} and kda_layers {kda} must number "
                             f"the {num_layers} layers 1..{num_layers} once each")
        return tuple("attention" if i + 1 in full else "linear" for i in range(num_layers))
    if listed is None:
        return tuple("attention" if i and i % 4 == 0 else "linear" for i in range(num_layers))
    return hf_layer_types(listed, num_layers, "Kimi-Linear", "full_attention / linear_attention")


def ffn_layer_types(cfg: Mapping[str, Any], num_layers: int, name: str, first_dense: int) -> tuple[str, ...]:
    """Each layer's FFN: ``mlp_layer_types`` (``dense`` / ``sparse``), else dense in the first
    ``first_k_dense_replace`` layers (default ``first_dense``), MoE after."""
    listed = cfg.get("mlp_layer_types")
    if listed is None:
        dense = int(hf_first(cfg, ("first_k_dense_replace",), first_dense))
        return tuple("mlp" if i < dense else "moe" for i in range(num_layers))
    if len(listed) != num_layers:
        raise ValueError(f"{name} mlp_layer_types has {len(listed)} entries, num_hidden_layers is {num_layers}")
    names = {"dense": "mlp", "sparse": "moe"}
    bad = sorted({t for t in listed if t not in names})
    if bad:
        raise ValueError(f"{name} mlp_layer_types must be 'dense' or 'sparse', got {bad}")
    return tuple(names[t] for t in listed)
