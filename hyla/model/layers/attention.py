"""Attention over the paged KV pool (GQA; Qwen3-Next's output gate, q/k norms, partial RoPE, sliding windows)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hyla.model.config import ModelConfig
from hyla.model.forward_batch import ForwardBatch
from hyla.model.layers import device
from hyla.model.layers.derived import DerivedWeight
from hyla.model.layers.norms import RMSNorm
from hyla.model.layers.projections import OutProjection, in_projection, out_projection
from hyla.model.layers.rotary import Rope, apply_rotary_
from hyla.model.linear import Linear
from hyla.model.ops.attention import (
    paged_attention,
    paged_attention_decode,
    paged_attention_short_extend,
    paged_attention_written,
    short_extend_attention,
)


def runs_prologue_kernel(batch: ForwardBatch, x: torch.Tensor) -> bool:
    """Whether :class:`Attention` runs the q/k prologue kernel for this batch (RoPE from the
    positions, no tables): a fused decode step or extend, or an extend on CUDA, but one with an
    image's tokens (their multimodal positions come as tables)."""
    return batch.on_device or (device.on_gpu(x) and not batch.is_decode and batch.mrope_positions is None)


class Attention(nn.Module):
    """GQA attention over the paged KV pool.

    Qwen3-Next / Qwen3.5: ``q_proj`` also emits a per-head output gate (``[q | gate]`` per head),
    per-head zero-centred q/k RMSNorm before partial RoPE, output ``* sigmoid(gate)``.
    NemotronH: plain q/k/v, no RoPE. OLMo-Hybrid: q and k RMS-normalised over all their heads at
    once (``qk_norm_whole``), RoPE or none. ``qkv_proj`` holds the q, k and v projections stacked by rows.
    A layer of ``config.sliding_layers`` attends within ``config.sliding_window`` (``window``: each
    token over its last ``window`` positions, the rest of its KV kept in the pool but masked). LFM3:
    each head's output times ``sigmoid(head_gate(x))``, one gate a head (``attn_head_gate``).
    """

    fused_decode = True  # a fused (Triton) decode path: see HybridForCausalLM.supports_fused_decode
    fused_extend = True  # and a fused extend (ForwardBatch.fused_extend): HybridForCausalLM.supports_fused_extend
    chain_verify = True  # a verify step of padded chains: HybridForCausalLM.supports_chain_verify
    takes_gemv_step = True  # forward(gemv_step=True): see HybridLayer.forward_fused

    def __init__(self, config: ModelConfig, attention_ordinal: int, window: int = 0,
                 projections: tuple[nn.Linear, nn.Linear] | None = None):
        """``projections``: the ``(qkv_proj, o_proj)`` to use, owned elsewhere and not registered here (Zamba2:
        a shared block's, which every layer that runs the block borrows); None: this layer's own."""
        super().__init__()
        c = config
        self.kv_index = attention_ordinal
        self.window = window  # a sliding window (config.attention_window); 0: full attention
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_attention_heads, c.num_kv_heads, c.head_dim
        self.output_gate = c.attn_output_gate
        self.q_size = self.num_heads * self.head_dim * (2 if self.output_gate else 1)
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scaling = self.head_dim**-0.5
        if projections is None:
            self.qkv_proj = Linear(c.hidden_size, self.q_size + 2 * self.kv_size, bias=c.attention_bias, dtype=c.dtype)
            self.o_proj = Linear(self.num_heads * self.head_dim, c.hidden_size, bias=c.attention_bias, dtype=c.dtype)
        else:  # borrowed: plain attributes, so that the parameters have one name (their owner's)
            object.__setattr__(self, "qkv_proj", projections[0])
            object.__setattr__(self, "o_proj", projections[1])
        self.head_gate = Linear(c.hidden_size, self.num_heads, bias=False, dtype=c.dtype) if c.attn_head_gate else None
        self.q_norm = RMSNorm(c.head_dim, c.norm_eps, c.zero_centered_norm, c.dtype) if c.qk_norm else None
        self.k_norm = RMSNorm(c.head_dim, c.norm_eps, c.zero_centered_norm, c.dtype) if c.qk_norm else None
        # OLMo-Hybrid: q and k each normalised over all their heads at once, before the kernels and RoPE
        whole = c.qk_norm_whole
        self.q_whole_norm = RMSNorm(self.q_size, c.norm_eps, c.zero_centered_norm, c.dtype) if whole else None
        self.k_whole_norm = RMSNorm(self.kv_size, c.norm_eps, c.zero_centered_norm, c.dtype) if whole else None
        # q_norm and k_norm as one per-head scale table [Hq + Hkv, D]: both norms in one rms_norm
        offset, hq, hkv = (self.q_norm.offset if c.qk_norm else 0.0), self.num_heads, self.num_kv_heads
        self._qk_scale = DerivedWeight(lambda wq, wk: torch.cat([
            (offset + wq.float()).expand(hq, -1), (offset + wk.float()).expand(hkv, -1)]))

    def forward(self, x: torch.Tensor, batch: ForwardBatch, rope: Rope | None,
                gemv_step: bool = False) -> torch.Tensor | OutProjection:
        t = x.shape[0]
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        kb, vb = batch.k_buffers[self.kv_index], batch.v_buffers[self.kv_index]
        qkv = self.project_qkv(x, gemv_step)
        if self.q_whole_norm is not None:
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            qkv = torch.cat([self.q_whole_norm(q), self.k_whole_norm(k), v], dim=-1)
        if batch.on_device:  # three Triton kernels: q/k norm + RoPE + the K/V writes, then attention (+ gate)
            o = self._head_gated(self._attend_fused(qkv, kb, vb, batch, rope), x)
            return out_projection(self.o_proj, o.reshape(t, hq * d), gemv_step)
        if runs_prologue_kernel(batch, qkv):  # an extend on CUDA: the prologue kernel, then attention over the pool
            q = self._prologue(qkv, kb, vb, batch, rope)  # [T, Hq, D]
            if batch.short_extend is not None:
                o = short_extend_attention(q, kb, vb, batch.short_extend_layout(self.window), self.scaling)
            else:
                o = paged_attention_written(q, kb, vb, batch.kv_indices, batch.kv_indptr, batch.prefix_lens,
                                            batch.extend_lens, self.scaling, tree_masks=tree_masks(batch),
                                            kv_starts=batch.kv_starts, window=self.window)  # [T, Hq, D]
            if self.output_gate:  # o * sigmoid(gate) in one kernel, the gate read in place
                o = device.gpu("norms").sigmoid_gate_fused(o, qkv[:, :self.q_size].view(t, hq, 2 * d)[:, :, d:])
            return self.o_proj(self._head_gated(o, x).reshape(t, hq * d))
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        gate = None
        if self.output_gate:
            q, gate = q.view(t, hq, 2 * d).chunk(2, dim=-1)  # [T, Hq, D] each
            qk = torch.cat([q, k.view(t, hkv, d)], dim=1)  # [T, Hq + Hkv, D], a fresh tensor
        else:
            qk = torch.cat([q.view(t, hq, d), k.view(t, hkv, d)], dim=1)  # [T, Hq + Hkv, D]
        if self.q_norm is not None:  # per-head q/k RMSNorm, as HF's: norm(x) * (offset + w) in fp32
            scale = self._qk_scale(self.q_norm.weight, self.k_norm.weight)  # [Hq + Hkv, D]
            if device.on_gpu(qk):
                qk = device.gpu("norms").rms_norm_fused(qk.view(-1, d), scale, self.q_norm.eps).view(qk.shape)
            else:
                qk = (F.rms_norm(qk.float(), (d,), eps=self.q_norm.eps) * scale).to(x.dtype)
        if rope is not None:
            apply_rotary_(qk, rope.cos, rope.sin)
        q, k = qk[:, :hq], qk[:, hq:]  # [T, Hq, D], [T, Hkv, D] views
        v = v.view(t, hkv, d)  # [T, Hkv, D]
        if batch.is_decode:
            rows, mask = batch.decode_kv_layout(self.window)
            o = paged_attention_decode(q, k, v, kb, vb, batch.out_cache_loc, batch.kv_table, mask, self.scaling,
                                       kv_rows=rows)  # [B, Hq, D]
        elif batch.short_extend is not None:  # a verify step: one batched attention
            o = paged_attention_short_extend(q, k, v, kb, vb, batch.out_cache_loc,
                                             batch.short_extend_layout(self.window), self.scaling)  # [T, Hq, D]
        else:
            o = paged_attention(q, k, v, kb, vb, batch.out_cache_loc, batch.kv_indices, batch.kv_indptr,
                                batch.prefix_lens, batch.extend_lens, self.scaling,
                                tree_masks=tree_masks(batch), kv_starts=batch.kv_starts, window=self.window)
        o = self._head_gated(o, x).reshape(t, hq * d)
        if gate is not None:
            o = o * torch.sigmoid(gate.reshape(t, hq * d))
        return self.o_proj(o)

    def project_qkv(self, x: torch.Tensor, gemv_step: bool = False) -> torch.Tensor:
        """The stacked ``[q | k | v]`` projection of ``x`` (Zamba2 adds its layer's adapters)."""
        return in_projection(self.qkv_proj, x, gemv_step)

    def _head_gated(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``o [T, Hq, D]`` times LFM3's per-head gate ``sigmoid(head_gate(x)) [T, Hq]`` (in the model
        dtype, as transformers'); ``o`` itself without one."""
        if self.head_gate is None:
            return o
        return o * torch.sigmoid(self.head_gate(x)).unsqueeze(-1)

    def _attend_fused(self, qkv: torch.Tensor, kb: torch.Tensor, vb: torch.Tensor, batch: ForwardBatch,
                      rope: Rope | None) -> torch.Tensor:
        """A fused decode step's or fused extend's attention ``[T, Hq, D]`` from the projection
        ``qkv``: what :meth:`forward`'s PyTorch path computes, in the kernels of
        ``ops/gpu/decode_attention.py`` (one query per sequence) or ``ops/gpu/extend_attention.py``."""
        t, hq, d = qkv.shape[0], self.num_heads, self.head_dim
        q = self._prologue(qkv, kb, vb, batch, rope)
        gate = qkv[:, :self.q_size].view(t, hq, 2 * d)[:, :, d:] if self.output_gate else None  # [T, Hq, D] view
        fe = batch.fused_extend
        if fe is not None:
            return device.gpu("extend_attention").paged_extend_attention(q, kb, vb, batch.req_to_token, fe.req_row,
                                                                          fe.kv_lens, self.scaling, gate=gate,
                                                                          window=self.window)
        return device.gpu("decode_attention").paged_decode_attention(
            q, kb, vb, batch.req_to_token, batch.req_pool_indices, batch.kv_lens, self.scaling, gate=gate,
            window=self.window)

    def _prologue(self, qkv: torch.Tensor, kb: torch.Tensor, vb: torch.Tensor, batch: ForwardBatch,
                  rope: Rope | None) -> torch.Tensor:
        """``q [T, Hq, D]`` from the projection, normed and rotated, with the new tokens' K/V written
        to the pool, in one Triton kernel (``decode_qk_prologue``; any number of tokens): what
        :meth:`forward`'s PyTorch path computes up to the attention, rounded where it rounds."""
        scale = self._qk_scale(self.q_norm.weight, self.k_norm.weight) if self.q_norm is not None else None
        return device.gpu("decode_attention").decode_qk_prologue(
            qkv, self.num_heads, self.num_kv_heads, self.head_dim, self.output_gate, kb, vb, batch.out_cache_loc,
            scale, self.q_norm.eps if self.q_norm is not None else 0.0,
            (rope.positions, rope.inv_freq) if rope is not None else None)


def tree_masks(batch: ForwardBatch):
    """Attention's per-sequence masks over the new tokens of a tree verify step (None: causal)."""
    return batch.tree.masks if batch.tree_parents is not None else None
