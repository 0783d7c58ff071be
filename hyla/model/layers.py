"""Layers shared by the hybrid architectures, and the model skeleton they plug into.

Every layer works on *packed* tokens ``x [T, hidden]`` (all sequences of a ``ForwardBatch`` one
after another) and reads its cache through the batch: attention layer ``j`` (its ordinal among
attention layers) uses ``batch.k_buffers[j] / v_buffers[j]``; linear layer ``j`` (its ordinal among
linear layers) uses ``batch.conv_states[j] / ssm_states[j]``. No layer keeps per-request state.

Numerics follow the Hugging Face reference (see docs/models.md): norms compute in fp32 and cast
back; routers, gates and recurrent states are fp32; the small SSM parameters (``A_log``,
``dt_bias``, ``D``, the router's score-correction bias) are kept in fp32 whatever the model dtype.
"""

from __future__ import annotations

import abc
import functools
import importlib
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from hyla.model.config import ModelConfig
from hyla.model.forward_batch import ForwardBatch
from hyla.model.linear import Linear, few_row_linear, mkl_weight, relayout_weights_
from hyla.model.ops.attention import (
    paged_attention,
    paged_attention_decode,
    paged_attention_short_extend,
    paged_attention_written,
    short_extend_attention,
)
from hyla.model.ops.conv1d import causal_conv1d_chains, causal_conv1d_update, causal_conv1d_varlen
from hyla.model.ops.gated_delta import (
    chunk_gated_delta_rule_varlen,
    gated_delta_rule_chains,
    recurrent_gated_delta_rule_update,
)
from hyla.model.ops.ssd import mamba2_chunk_scan_varlen, mamba2_state_update
from hyla.model.ops.gpu import HAS_TRITON
from hyla.model.ops.varlen import write_rows_
from hyla.model.weight_specs import WeightSpec


def _gpu(name: str):
    """``hyla.model.ops.gpu.<name>``, the Triton kernels, imported on first use (CPU runs never load
    Triton). Layers run them on CUDA tensors (:func:`_on_gpu`) and the PyTorch ops elsewhere."""
    return importlib.import_module(f"hyla.model.ops.gpu.{name}")


def _on_gpu(x: torch.Tensor) -> bool:
    return x.is_cuda and HAS_TRITON


class Rope(NamedTuple):
    """A batch's RoPE, shared by every attention layer (``HybridForCausalLM.rope``): the tokens'
    ``positions [T]`` and the rotary's fp32 ``inv_freq [rotary_dim / 2]``, which the q/k prologue
    kernel reads (it computes the angles itself), and the tables the PyTorch path reads, ``cos`` and
    :func:`signed_sin` ``[T, rotary_dim]`` (None where attention runs the kernel:
    :func:`_runs_prologue_kernel`)."""

    positions: torch.Tensor
    inv_freq: torch.Tensor
    cos: torch.Tensor | None
    sin: torch.Tensor | None


def _runs_prologue_kernel(batch: ForwardBatch, x: torch.Tensor) -> bool:
    """Whether :class:`Attention` runs the q/k prologue kernel for this batch (RoPE from the
    positions, no tables): a fused decode step or extend, or an extend on CUDA."""
    return batch.on_device or (_on_gpu(x) and not batch.is_decode)


# --- norms -------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    """``x * rsqrt(mean(x^2) + eps) * w`` in fp32, cast back to the input dtype.

    ``zero_centered=True`` (Qwen3-Next / Qwen3.5) stores ``w - 1``: the scale is ``1 + weight``.
    """

    def __init__(self, dim: int, eps: float, zero_centered: bool = False, dtype: torch.dtype | None = None):
        super().__init__()
        self.eps = eps
        self.offset = 1.0 if zero_centered else 0.0
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype))
        offset = self.offset
        self._scale = _DerivedWeight(lambda w: offset + w.float())  # [dim] fp32
        self._ticket: torch.Tensor | None = None

    def scale(self) -> torch.Tensor:
        """The fp32 multiplier ``offset + weight`` ([dim]), recomputed only when the weight changes."""
        return self._scale(self.weight)

    def ticket(self, device: torch.device) -> torch.Tensor:
        """The zeroed int32 that the kernel ending in this norm (an :class:`OutProjection` run by
        :func:`add_rms_norm`) counts its programs on, and resets. One per norm: a norm runs once
        per forward, and forwards run one after another on the device's stream."""
        if self._ticket is None or self._ticket.device != device:
            self._ticket = torch.zeros(1, dtype=torch.int32, device=device)
        return self._ticket

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.scale()
        if _on_gpu(x):
            return _gpu("norms").rms_norm_fused(x.reshape(-1, x.shape[-1]), scale, self.eps).view(x.shape)
        return F.rms_norm(x.float(), scale.shape, scale, self.eps).to(x.dtype)


class _DerivedWeight:
    """A tensor computed from parameters, cached until one of them changes (new storage, dtype,
    device, or an in-place write, which bumps its version counter): a decode step then skips
    recomputing e.g. ``1 + w`` or ``-exp(A_log)`` in every layer. A CUDA graph captured with it
    replays the cached tensor without asking: a weight update refreshes it in place
    (:func:`refresh_derived_weights_`)."""

    def __init__(self, fn: Callable[..., torch.Tensor]):
        self.fn = fn
        self.key: tuple | None = None
        self.value: torch.Tensor | None = None
        self.weights: tuple[torch.Tensor, ...] = ()  # what value was computed from

    def __call__(self, *weights: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():  # traced: the compiler fuses or folds it
            return self.fn(*weights)
        key = tuple((w.data_ptr(), w._version, w.dtype, w.device) for w in weights)
        if key != self.key or self.value is None:
            with torch.no_grad():
                self.value = self.fn(*(w.detach() for w in weights))
            self.key, self.weights = key, weights
        return self.value

    @torch.inference_mode()  # (a value computed in a forward is an inference tensor)
    def refresh_(self) -> None:
        """Recompute the cached tensor from its weights' current values into its own storage."""
        if self.value is not None:
            self.value.copy_(self.fn(*(w.detach() for w in self.weights)))
            self.key = tuple((w.data_ptr(), w._version, w.dtype, w.device) for w in self.weights)


def refresh_derived_weights_(module: nn.Module) -> int:
    """:meth:`_DerivedWeight.refresh_` every derived weight of ``module``'s submodules (after their
    parameters were written in place: ``loader.copy_weights_``); returns how many were cached."""
    derived = [d for m in module.modules() for d in vars(m).values() if isinstance(d, _DerivedWeight)]
    for d in derived:
        d.refresh_()
    return sum(d.value is not None for d in derived)


class GatedRMSNorm(nn.Module):
    """RMSNorm combined with a ``silu(z)`` gate, over groups of ``group_size`` channels.

    ``norm_before_gate=True`` (Gated DeltaNet): ``(w * norm(x)) * silu(z)``.
    ``norm_before_gate=False`` (Mamba2): ``w * norm(x * silu(z))``, normalised per group.
    """

    def __init__(self, dim: int, eps: float, group_size: int | None = None, norm_before_gate: bool = True,
                 dtype: torch.dtype | None = None):
        super().__init__()
        self.eps = eps
        self.group_size = group_size or dim
        if dim % self.group_size:
            raise ValueError(f"group_size {self.group_size} does not divide {dim}")
        self.norm_before_gate = norm_before_gate
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype))

    def _norm(self, x32: torch.Tensor) -> torch.Tensor:
        groups = x32.view(*x32.shape[:-1], -1, self.group_size)  # [..., G, dim/G]
        return F.rms_norm(groups, (self.group_size,), eps=self.eps).view(x32.shape)

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if self.norm_before_gate:
            weight = self.weight
            if dtype == torch.float32 and weight.dtype == torch.float32 and self.group_size == x.shape[-1]:
                # one rms_norm with the weight folded in: w * norm(x), the same products
                return F.rms_norm(x, (self.group_size,), weight, self.eps).mul_(F.silu(z.float()))
            y = weight * self._norm(x.float()).to(dtype)
            return (y * F.silu(z.float())).to(dtype)
        y = self._norm(x.float() * F.silu(z.float()))
        return self.weight * y.to(dtype)


# --- rotary position embedding -----------------------------------------------------------------


class RotaryEmbedding(nn.Module):
    """Default (non-interleaved, "rotate half") RoPE on the first ``rotary_dim`` channels of a head."""

    def __init__(self, rotary_dim: int, theta: float):
        super().__init__()
        if rotary_dim <= 0 or rotary_dim % 2:
            raise ValueError(f"rotary_dim must be a positive even number, got {rotary_dim}")
        exponents = torch.arange(0, rotary_dim, 2, dtype=torch.float32, device="cpu") / rotary_dim
        self.register_buffer("inv_freq", 1.0 / (theta**exponents), persistent=False)  # [rotary_dim/2]

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, rotary_dim/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, rotary_dim]
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``cos.shape[-1]`` channels of ``x [T, H, D]``; the rest pass through."""
    dim = cos.shape[-1]
    rot, rest = x[..., :dim], x[..., dim:]
    half = dim // 2
    rotated = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
    out = rot * cos[:, None, :] + rotated * sin[:, None, :]  # [T, H, rotary_dim]
    return torch.cat((out, rest), dim=-1)


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """``sin [T, rotary_dim]`` with its first half negated: ``rotate_half(x) * sin`` becomes
    ``roll(x, half) * signed_sin`` (bitwise equal: ``(-a) * b == a * (-b)``)."""
    out = sin.clone()
    out[:, : sin.shape[-1] // 2].neg_()
    return out


def apply_rotary_(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """In-place :func:`apply_rotary` on a tensor the caller owns (bitwise the same result):
    ``x [T, H, D]``, ``cos`` and :func:`signed_sin` ``[T, rotary_dim]``. Returns ``x``."""
    dim = cos.shape[-1]
    rot = x[..., :dim]  # [T, H, rotary_dim] view
    rotated = torch.roll(rot, dim // 2, dims=-1).mul_(sin_signed[:, None, :])  # rotate_half(rot) * sin
    rot.mul_(cos[:, None, :]).add_(rotated)
    return x


# --- full attention ----------------------------------------------------------------------------


class Attention(nn.Module):
    """GQA attention over the paged KV pool.

    Qwen3-Next / Qwen3.5: ``q_proj`` also emits a per-head output gate (``[q | gate]`` per head),
    per-head zero-centred q/k RMSNorm before partial RoPE, output ``* sigmoid(gate)``.
    NemotronH: plain q/k/v, no RoPE. ``qkv_proj`` holds the q, k and v projections stacked by rows.
    """

    fused_decode = True  # a fused (Triton) decode path: see HybridForCausalLM.supports_fused_decode
    fused_extend = True  # and a fused extend (ForwardBatch.fused_extend): HybridForCausalLM.supports_fused_extend
    takes_gemv_step = True  # forward(gemv_step=True): see HybridLayer.forward_fused

    def __init__(self, config: ModelConfig, attention_ordinal: int):
        super().__init__()
        c = config
        self.kv_index = attention_ordinal
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_attention_heads, c.num_kv_heads, c.head_dim
        self.output_gate = c.attn_output_gate
        self.q_size = self.num_heads * self.head_dim * (2 if self.output_gate else 1)
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scaling = self.head_dim**-0.5
        self.qkv_proj = Linear(c.hidden_size, self.q_size + 2 * self.kv_size, bias=c.attention_bias, dtype=c.dtype)
        self.o_proj = Linear(self.num_heads * self.head_dim, c.hidden_size, bias=c.attention_bias, dtype=c.dtype)
        self.q_norm = RMSNorm(c.head_dim, c.norm_eps, c.zero_centered_norm, c.dtype) if c.qk_norm else None
        self.k_norm = RMSNorm(c.head_dim, c.norm_eps, c.zero_centered_norm, c.dtype) if c.qk_norm else None
        # q_norm and k_norm as one per-head scale table [Hq + Hkv, D]: both norms in one rms_norm
        offset, hq, hkv = (self.q_norm.offset if c.qk_norm else 0.0), self.num_heads, self.num_kv_heads
        self._qk_scale = _DerivedWeight(lambda wq, wk: torch.cat([
            (offset + wq.float()).expand(hq, -1), (offset + wk.float()).expand(hkv, -1)]))

    def forward(self, x: torch.Tensor, batch: ForwardBatch, rope: Rope | None,
                gemv_step: bool = False) -> torch.Tensor | OutProjection:
        t = x.shape[0]
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        kb, vb = batch.k_buffers[self.kv_index], batch.v_buffers[self.kv_index]
        qkv = in_projection(self.qkv_proj, x, gemv_step)
        if batch.on_device:  # three Triton kernels: q/k norm + RoPE + the K/V writes, then attention (+ gate)
            return out_projection(self.o_proj, self._attend_fused(qkv, kb, vb, batch, rope).reshape(t, hq * d),
                                  gemv_step)
        if _runs_prologue_kernel(batch, qkv):  # an extend on CUDA: the prologue kernel, then attention over the pool
            q = self._prologue(qkv, kb, vb, batch, rope)  # [T, Hq, D]
            if batch.short_extend is not None:
                o = short_extend_attention(q, kb, vb, batch.short_extend, self.scaling)
            else:
                o = paged_attention_written(q, kb, vb, batch.kv_indices, batch.kv_indptr, batch.prefix_lens,
                                            batch.extend_lens, self.scaling, tree_masks=_tree_masks(batch),
                                            kv_starts=batch.kv_starts)  # [T, Hq, D]
            if self.output_gate:  # o * sigmoid(gate) in one kernel, the gate read in place
                o = _gpu("norms").sigmoid_gate_fused(o, qkv[:, :self.q_size].view(t, hq, 2 * d)[:, :, d:])
            return self.o_proj(o.reshape(t, hq * d))
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        gate = None
        if self.output_gate:
            q, gate = q.view(t, hq, 2 * d).chunk(2, dim=-1)  # [T, Hq, D] each
            qk = torch.cat([q, k.view(t, hkv, d)], dim=1)  # [T, Hq + Hkv, D], a fresh tensor
        else:
            qk = torch.cat([q.view(t, hq, d), k.view(t, hkv, d)], dim=1)  # [T, Hq + Hkv, D]
        if self.q_norm is not None:  # per-head q/k RMSNorm, as HF's: norm(x) * (offset + w) in fp32
            scale = self._qk_scale(self.q_norm.weight, self.k_norm.weight)  # [Hq + Hkv, D]
            if _on_gpu(qk):
                qk = _gpu("norms").rms_norm_fused(qk.view(-1, d), scale, self.q_norm.eps).view(qk.shape)
            else:
                qk = (F.rms_norm(qk.float(), (d,), eps=self.q_norm.eps) * scale).to(x.dtype)
        if rope is not None:
            apply_rotary_(qk, rope.cos, rope.sin)
        q, k = qk[:, :hq], qk[:, hq:]  # [T, Hq, D], [T, Hkv, D] views
        v = v.view(t, hkv, d)  # [T, Hkv, D]
        if batch.is_decode:
            rows, mask = batch.decode_kv_layout()
            o = paged_attention_decode(q, k, v, kb, vb, batch.out_cache_loc, batch.kv_table, mask, self.scaling,
                                       kv_rows=rows)  # [B, Hq, D]
        elif batch.short_extend is not None:  # a verify step: one batched attention
            o = paged_attention_short_extend(q, k, v, kb, vb, batch.out_cache_loc, batch.short_extend,
                                             self.scaling)  # [T, Hq, D]
        else:
            o = paged_attention(q, k, v, kb, vb, batch.out_cache_loc, batch.kv_indices, batch.kv_indptr,
                                batch.prefix_lens, batch.extend_lens, self.scaling,
                                tree_masks=_tree_masks(batch), kv_starts=batch.kv_starts)  # [T, Hq, D]
        o = o.reshape(t, hq * d)
        if gate is not None:
            o = o * torch.sigmoid(gate.reshape(t, hq * d))
        return self.o_proj(o)

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
            return _gpu("extend_attention").paged_extend_attention(q, kb, vb, batch.req_to_token, fe.req_row,
                                                                   fe.kv_lens, self.scaling, gate=gate)
        return _gpu("decode_attention").paged_decode_attention(q, kb, vb, batch.req_to_token, batch.req_pool_indices,
                                                               batch.kv_lens, self.scaling, gate=gate)

    def _prologue(self, qkv: torch.Tensor, kb: torch.Tensor, vb: torch.Tensor, batch: ForwardBatch,
                  rope: Rope | None) -> torch.Tensor:
        """``q [T, Hq, D]`` from the projection, normed and rotated, with the new tokens' K/V written
        to the pool, in one Triton kernel (``decode_qk_prologue``; any number of tokens): what
        :meth:`forward`'s PyTorch path computes up to the attention, rounded where it rounds."""
        scale = self._qk_scale(self.q_norm.weight, self.k_norm.weight) if self.q_norm is not None else None
        return _gpu("decode_attention").decode_qk_prologue(
            qkv, self.num_heads, self.num_kv_heads, self.head_dim, self.output_gate, kb, vb, batch.out_cache_loc,
            scale, self.q_norm.eps if self.q_norm is not None else 0.0,
            (rope.positions, rope.inv_freq) if rope is not None else None)


# --- recurrent mixers --------------------------------------------------------------------------


def _copy_decode_checkpoints(pool: torch.Tensor, batch: ForwardBatch) -> None:
    """Decode: a checkpoint after the (only) new token is the sequence's final state: copy it
    (source and destination rows were resolved and validated when the batch was built)."""
    if batch.decode_ckpt_src is not None:
        write_rows_(pool, batch.decode_ckpt_dst, pool.index_select(0, batch.decode_ckpt_src))


def conv1d_extend(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv_states: torch.Tensor,
                  batch: ForwardBatch, activation: str | None) -> torch.Tensor:
    """An extend step's causal conv ``x [T, C] -> [T, C]`` on the conv-state pool, with the batch's
    checkpoints: on CUDA, for the chunked paths (no token trees, no short extends), two Triton
    launches (``gpu/conv1d_extend.py``); elsewhere the PyTorch op (``ops/conv1d.py``)."""
    if _on_gpu(x) and batch.tree_scan is None and batch.varlen is not None:
        return _gpu("conv1d_extend").causal_conv1d_varlen_fused(x, weight, bias, conv_states, batch.varlen, activation)
    return causal_conv1d_varlen(x, weight, bias, batch.cu_seqlens, conv_states, batch.state_slots, activation,
                                **_ckpt_kwargs(batch))


def conv1d_fused_extend(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                        conv_states: torch.Tensor, batch: ForwardBatch, activation: str | None) -> torch.Tensor:
    """A fused extend's causal conv (``ForwardBatch.fused_extend``): the extend kernels of
    ``gpu/conv1d_extend.py`` on its device indices, the checkpoints' windows first, then the
    sequence's final window into its own row."""
    fe, conv = batch.fused_extend, _gpu("conv1d_extend")
    m = fe.ckpt_pos.shape[0]
    rows = conv.ConvRows(fe.tok_seq[:x.shape[0]], fe.cu_seqlens[:1],
                         ((fe.tok_seq[:m], fe.ckpt_pos, fe.ckpt_slot), (fe.tok_seq[:1], fe.cu_seqlens[1:],
                                                                       batch.state_slots)))
    return conv.causal_conv1d_rows_fused(x, weight, bias, conv_states, rows, batch.state_slots, activation)


def run_fused_extend_segments(segments, out: torch.Tensor, ssm_states: torch.Tensor, batch: ForwardBatch) -> None:
    """A fused extend's recurrence: the layer's segment kernel (``fla_chunk.SegmentKernel``) over
    its one sequence, from and back to its pool row, writing the checkpoints on the way."""
    fe = batch.fused_extend
    ckpts = _gpu("segment_checkpoints").SegmentCheckpoints(ssm_states, fe.ckpt_offsets, fe.ckpt_pos, fe.ckpt_slot)
    segments(ssm_states, batch.state_slots, fe.cu_seqlens[:1], fe.cu_seqlens, out, ckpts, longest=fe.longest)


def _ckpt_kwargs(batch: ForwardBatch, scan: bool = True) -> dict:
    """What every recurrent extend op takes from the batch: its checkpoints and its token trees —
    for a tree or short extend the batch's ``tree_scan``, for the chunked paths its ``varlen`` plan,
    each carrying the checkpoints (validated once per step); ``scan=False``: the raw checkpoint
    tensors and the tree (fla's kernel)."""
    if scan and batch.tree_scan is not None:
        return dict(ckpt_seq=None, ckpt_len=None, ckpt_slot=None, tree=batch.tree_scan)
    if batch.varlen is not None:  # the chunked paths (fla's kernel too), validated once per step
        return dict(ckpt_seq=None, ckpt_len=None, ckpt_slot=None, tree=None, varlen=batch.varlen)
    if not batch.num_checkpoints:
        return dict(ckpt_seq=None, ckpt_len=None, ckpt_slot=None, tree=batch.tree)
    return dict(ckpt_seq=batch.ckpt_seq, ckpt_len=batch.ckpt_len, ckpt_slot=batch.ckpt_slot, tree=batch.tree)


def _fla_prefill(x: torch.Tensor, batch: ForwardBatch) -> bool:
    """Whether a chunked extend runs fla's Triton kernel (``ops/gpu/fla_chunk.py``): on CUDA, with
    fla installed, for bf16/fp16 activations (fla's fp32 dots run in tf32, so fp32 models keep the
    exact PyTorch ops, as the cache's fp32 differential tests require), chains only (token trees
    take the PyTorch ops' tree scan; a short extend's chains run with the batch's ``varlen`` plan,
    built once per step)."""
    return (_on_gpu(x) and x.dtype != torch.float32 and batch.tree_parents is None
            and _gpu("fla_chunk").HAS_FLA)


def _tree_masks(batch: ForwardBatch):
    """Attention's per-sequence masks over the new tokens of a tree verify step (None: causal)."""
    return batch.tree.masks if batch.tree_parents is not None else None


class ConvTickets:
    """A layer's counters for the decode kernels with the conv inside (``gated_delta_decode.
    gated_delta_conv_decode_fused``, ``kda_decode.kda_conv_decode_fused``: one per sequence and key
    head, which the kernel leaves zeroed). ``tickets(n, device)``: at least ``n`` zeroed int32
    counters, grown when a batch needs more; a buffer grown out of stays referenced, as a captured
    CUDA graph may still use it."""

    def __init__(self):
        self._buf: torch.Tensor | None = None
        self._retired: list[torch.Tensor] = []

    def __call__(self, n: int, device: torch.device) -> torch.Tensor:
        if self._buf is None or self._buf.numel() < n or self._buf.device != device:
            if self._buf is not None:
                self._retired.append(self._buf)
            self._buf = torch.zeros(max(n, 64), dtype=torch.int32, device=device)
        return self._buf


class GatedDeltaNet(nn.Module):
    """Gated DeltaNet mixer (Qwen3-Next / Qwen3.5 ``linear_attention`` layers).

    ``in_proj`` rows are ``[q (Hk*Dk) | k (Hk*Dk) | v (Hv*Dv) | z (Hv*Dv) | b (Hv) | a (Hv)]``, heads
    contiguous (the loader reorders Qwen3-Next's per-key-head grouped layout into this). The first
    ``conv_dim = 2*Hk*Dk + Hv*Dv`` channels go through the causal conv (no bias) and ``silu``.
    ``beta = sigmoid(b)``, log-decay ``g = -exp(A_log) * softplus(a + dt_bias)`` (fp32).
    """

    fused_decode = True
    fused_extend = True
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
        self.norm = GatedRMSNorm(self.head_v_dim, c.norm_eps, norm_before_gate=True, dtype=c.dtype)
        self.out_proj = Linear(self.value_dim, c.hidden_size, bias=False, dtype=c.dtype)
        self._neg_A = _DerivedWeight(lambda a_log: -torch.exp(a_log.float()))  # [Hv] fp32
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
            gdn, chain = _gpu("gated_delta_decode"), batch.chain_slots
            if gdn.FUSE_CONV and self.conv_weight.shape[1] == gdn.CONV_WIDTH:
                seqs = batch.state_slots.shape[0] if chain is None else chain.shape[1]
                o = gdn.gated_delta_conv_decode_fused(
                    mixed, self.conv_weight, conv_states, self._tickets(seqs * self.num_k_heads, x.device), a, b,
                    self.A_log, self.dt_bias, ssm_states, batch.state_slots, self.num_k_heads, self.head_k_dim,
                    chain=chain)  # [B, Hv, Dv]
            else:
                mixed = _gpu("conv1d_decode").causal_conv1d_update_fused(
                    mixed, self.conv_weight, None, conv_states, batch.state_slots, "silu", chain=chain)
                o = gdn.gated_delta_decode_fused(mixed, a, b, self.A_log, self.dt_bias, ssm_states, batch.state_slots,
                                                 self.num_k_heads, self.head_k_dim, chain=chain)  # [B, Hv, Dv]
        elif batch.fused_extend is not None:  # Triton: the conv, then the recurrence in one launch
            mixed = conv1d_fused_extend(mixed, self.conv_weight, None, conv_states, batch, "silu")
            o = torch.zeros(t, self.num_v_heads, self.head_v_dim, dtype=x.dtype, device=x.device)  # padding rows: 0
            run_fused_extend_segments(_gpu("gated_delta_chunks").segment_kernel(
                mixed, a, b, self.A_log, self.dt_bias, self.num_k_heads, self.head_k_dim), o, ssm_states, batch)
        else:
            o = self._mix(mixed, b, a, batch, slots, conv_states, ssm_states)
        d = self.head_v_dim
        if gemv_step and self.out_proj.bias is None and d & (d - 1) == 0:  # the gated norm in the projection's kernel
            return OutProjection(self.out_proj, o.reshape(t, self.value_dim), "gated_norm",
                                 (z, self.norm.weight, self.norm.eps))
        if _on_gpu(o):  # one kernel, reading z in place from the projection
            o = _gpu("norms").gated_rms_norm_fused(o.reshape(t, self.value_dim), z, self.norm.weight, self.norm.eps,
                                                   self.num_v_heads)
        else:
            o = self.norm(o.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))  # [T*Hv, Dv]
        return self.out_proj(o.reshape(t, self.value_dim))

    def _gates(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(g, beta)`` from the raw gates ``a, b [T, Hv]``: the fp32 log-decay and ``sigmoid(b)``."""
        return self._neg_A(self.A_log) * F.softplus(a.float() + self.dt_bias), torch.sigmoid(b)

    def _mix(self, mixed, b, a, batch: ForwardBatch, slots, conv_states, ssm_states) -> torch.Tensor:
        """The PyTorch path (CPU, extend steps): conv, gating, then the chunked or recurrent rule."""
        t = mixed.shape[0]
        chains = batch.chain_ckpt_rows  # a verify step of padded chains (the compiled verify)
        if batch.is_decode:
            mixed = causal_conv1d_update(mixed, self.conv_weight, None, conv_states, slots, "silu")
        elif chains is not None:
            mixed = causal_conv1d_chains(mixed, self.conv_weight, None, conv_states, slots, chains, "silu",
                                         rows=batch.chain_rows)
        else:
            mixed = conv1d_extend(mixed, self.conv_weight, None, conv_states, batch, "silu")  # [T, conv_dim]
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.reshape(t, self.num_k_heads, self.head_k_dim)  # [T, Hk, Dk]
        k = k.reshape(t, self.num_k_heads, self.head_k_dim)  # [T, Hk, Dk]
        v = v.reshape(t, self.num_v_heads, self.head_v_dim)  # [T, Hv, Dv]
        if not batch.is_decode and chains is None and _fla_prefill(q, batch):  # fla's chunked Triton kernel; short
            # rounds: hyla's own kernel (recurrent or chunked), which gates a and b itself (the gates computed only
            # if fla runs)
            segments = _gpu("gated_delta_chunks").segment_kernel(mixed, a, b, self.A_log, self.dt_bias,
                                                                 self.num_k_heads, self.head_k_dim)
            return _gpu("fla_chunk").chunk_gated_delta_rule_fla(
                q, k, v, None, None, batch.cu_seqlens, ssm_states, batch.state_slots,
                **_ckpt_kwargs(batch, scan=False), segments=segments, gates=lambda: self._gates(a, b))
        g, beta = self._gates(a, b)
        if batch.is_decode:
            o = recurrent_gated_delta_rule_update(q, k, v, g, beta, ssm_states, slots)
            _copy_decode_checkpoints(conv_states, batch)
            _copy_decode_checkpoints(ssm_states, batch)
        elif chains is not None:
            o = gated_delta_rule_chains(q, k, v, g, beta, ssm_states, slots, chains, rows=batch.chain_rows)
        else:
            o = chunk_gated_delta_rule_varlen(
                q, k, v, g, beta, batch.cu_seqlens, ssm_states, batch.state_slots, **_ckpt_kwargs(batch),
                use_qk_l2norm=True,
            )  # [T, Hv, Dv]
        return o


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
            GatedRMSNorm(self.inner, c.norm_eps, self.inner // self.n_groups,
                         norm_before_gate=c.mamba_norm_before_gate, dtype=c.dtype)
            if c.mamba_rms_norm else None
        )
        out_bias = c.mamba_proj_bias if c.mamba_out_proj_bias is None else c.mamba_out_proj_bias
        self.out_proj = Linear(self.inner, c.hidden_size, bias=out_bias, dtype=c.dtype)
        self._neg_A = _DerivedWeight(lambda a_log: -torch.exp(a_log.float()))  # [H] fp32

    def forward(self, x: torch.Tensor, batch: ForwardBatch, rope: Rope | None = None,
                gemv_step: bool = False) -> torch.Tensor | OutProjection:
        t = x.shape[0]
        z, xbc, dt = in_projection(self.in_proj, x, gemv_step).split([self.inner, self.conv_dim, self.num_heads], dim=-1)
        conv_states, ssm_states = batch.conv_states[self.state_index], batch.ssm_states[self.state_index]
        slots = batch.state_slot_plan
        A = self._neg_A(self.A_log)  # [H]
        gn = self.n_groups * self.state_size
        if batch.fused_decode:  # two Triton kernels: the conv window, then dt + the state update
            # (a verify step of chains: each runs its requests' tokens in order, batch.chain_slots)
            xbc = _gpu("conv1d_decode").causal_conv1d_update_fused(xbc, self.conv_weight, self.conv_bias, conv_states,
                                                                   batch.state_slots, "silu", chain=batch.chain_slots)
            xs, bs, cs = xbc.split([self.inner, gn, gn], dim=-1)
            y = _gpu("mamba2_decode").mamba2_state_update_fused(xs, dt, A, bs, cs, self.D, self.dt_bias, ssm_states,
                                                                batch.state_slots, self.dt_limit,
                                                                chain=batch.chain_slots)  # [B, H, P]
            return self._out(y, z, t, x.dtype, gemv_step)
        if batch.fused_extend is not None:  # Triton: the conv, then the scan in one launch, then D * x
            xbc = conv1d_fused_extend(xbc, self.conv_weight, self.conv_bias, conv_states, batch, "silu")
            xs, bs, cs = xbc.split([self.inner, gn, gn], dim=-1)
            y = torch.zeros(t, self.num_heads, self.head_dim, dtype=x.dtype, device=x.device)  # padding rows: 0
            run_fused_extend_segments(_gpu("mamba2_chunks").segment_kernel(
                xs, dt, A, bs, cs, None, self.dt_bias, self.dt_limit), y, ssm_states, batch)
            y = (y.float() + self.D.float()[:, None] * xs.view(t, self.num_heads, self.head_dim).float()).to(x.dtype)
            return self._out(y, z, t, x.dtype)
        if batch.is_decode:
            xbc = causal_conv1d_update(xbc, self.conv_weight, self.conv_bias, conv_states, slots, "silu")
        else:
            xbc = conv1d_extend(xbc, self.conv_weight, self.conv_bias, conv_states, batch, "silu")  # [T, conv_dim]
        xs, bs, cs = xbc.split([self.inner, gn, gn], dim=-1)
        xs = xs.reshape(t, self.num_heads, self.head_dim)  # [T, H, P]
        bs = bs.reshape(t, self.n_groups, self.state_size)  # [T, G, N]
        cs = cs.reshape(t, self.n_groups, self.state_size)  # [T, G, N]
        if batch.is_decode:
            y = mamba2_state_update(xs, dt, A, bs, cs, self.D, self.dt_bias, ssm_states, slots,
                                    dt_limit=self.dt_limit)
            _copy_decode_checkpoints(conv_states, batch)
            _copy_decode_checkpoints(ssm_states, batch)
        elif _fla_prefill(xs, batch):  # fla's chunked Triton kernel, as simple GLA
            y = _gpu("fla_chunk").mamba2_chunk_scan_fla(
                xs, dt, A, bs, cs, self.D, self.dt_bias, batch.cu_seqlens, ssm_states, batch.state_slots,
                **_ckpt_kwargs(batch, scan=False), dt_limit=self.dt_limit)  # [T, H, P]
        else:
            y = mamba2_chunk_scan_varlen(
                xs, dt, A, bs, cs, self.D, self.dt_bias, batch.cu_seqlens, ssm_states, batch.state_slots,
                **_ckpt_kwargs(batch), dt_limit=self.dt_limit,
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


# --- feed-forward ------------------------------------------------------------------------------


def relu2(x: torch.Tensor) -> torch.Tensor:
    return torch.square(F.relu(x))


class MLP(nn.Module):
    """Dense feed-forward. ``act="silu"``: gated SwiGLU, ``in_proj`` rows ``[gate (I) | up (I)]``;
    ``act="relu2"``: ``down(relu(up(x))^2)``, ``in_proj`` rows ``[up (I)]``."""

    takes_gemv_step = True  # forward(gemv_step=True): see HybridLayer.forward_fused

    def __init__(self, hidden: int, intermediate: int, act: str, bias: bool = False, dtype: torch.dtype | None = None):
        super().__init__()
        if act not in ("silu", "relu2"):
            raise ValueError(f"unsupported activation {act!r}")
        self.gated = act == "silu"
        self.in_proj = Linear(hidden, intermediate * (2 if self.gated else 1), bias=bias, dtype=dtype)
        self.out_proj = Linear(intermediate, hidden, bias=bias, dtype=dtype)

    def forward(self, x: torch.Tensor, gemv_step: bool = False) -> torch.Tensor | OutProjection:
        h = in_projection(self.in_proj, x, gemv_step)
        if gemv_step and self.out_proj.bias is None:  # SwiGLU in the down projection's kernel (relu2 before it)
            return OutProjection(self.out_proj, h, "silu_mul") if self.gated else OutProjection(self.out_proj, relu2(h))
        return self.down(h)

    def down(self, h: torch.Tensor, gemv_step: bool = False) -> torch.Tensor:
        """The activation and the out projection of the in projection's output ``h [..., I or 2I]``
        (on a GEMV step without bias, :func:`project`'s GEMV)."""
        if self.gated and _on_gpu(h):
            a = _gpu("norms").silu_mul_fused(h.reshape(-1, h.shape[-1])).view(*h.shape[:-1], -1)
        elif self.gated:
            gate, up = h.chunk(2, dim=-1)
            a = F.silu(gate) * up
        else:
            a = relu2(h)
        return project(a, self.out_proj.weight, gemv_step) if gemv_step and self.out_proj.bias is None \
            else self.out_proj(a)


# GPU MoE steps of at most this many (token, expert) assignments run gathered (SparseMoE.path): each
# assignment reads its expert's weights once (gemv.expert_linear: two assignments of one expert read
# it twice); larger ones run grouped (moe.expert_gemm: each chosen expert read once per block of its
# assignments). Neither reads the host, so CUDA graphs capture MoE steps of any size. Not yet timed
# on a GPU.
GATHER_MAX_ASSIGNMENTS = 64


def expert_activation(h: torch.Tensor, gated: bool) -> torch.Tensor:
    """The experts' activation between their two projections: SwiGLU of ``h = [gate | up]`` where
    ``gated`` (on a GPU one kernel, ``norms.silu_mul_fused``), else relu²."""
    if gated and _on_gpu(h):
        return _gpu("norms").silu_mul_fused(h)
    if gated:
        gate, up = h.chunk(2, dim=-1)
        return F.silu(gate) * up
    return relu2(h)


def run_experts_sorted(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, w_in: torch.Tensor,
                       w_out: torch.Tensor, gated: bool) -> torch.Tensor:
    """``sum_k weights[t, k] * expert_{experts[t, k]}(x[t])``: ``x [T, Hin]``, ``weights, experts
    [T, k]``, stacked experts ``w_in [E, I or 2I, Hin]``, ``w_out [E, Hin, I]`` (SwiGLU where
    ``gated``, else relu²) -> ``[T, Hin]`` in ``weights.dtype``. The assignments sorted by expert, one
    matmul pair per expert that received tokens: each chosen expert's weights read once, its group's
    size read on the host."""
    flat = experts.flatten()  # [T*k]
    order = torch.argsort(flat, stable=True)  # assignments grouped by expert
    token = order // experts.shape[1]  # [T*k] token of each sorted assignment
    counts = torch.bincount(flat, minlength=w_in.shape[0]).tolist()
    xs = x[token]  # [T*k, Hin]
    outs = []
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        h = expert_activation(expert_linear(xs[start : start + n], w_in[e]), gated)  # [n, I]
        outs.append(expert_linear(h, w_out[e]))  # [n, Hin]
        start += n
    ys = torch.cat(outs) * weights.flatten()[order, None]  # [T*k, Hin]
    out = torch.zeros(x.shape[0], x.shape[1], dtype=weights.dtype, device=x.device)
    return out.index_add_(0, token, ys.to(weights.dtype))


def expert_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w.T`` for one expert's weight ``w [N, K]``: a few fp32 CPU rows as a dense projection's
    (:func:`linear.few_row_linear`: on more than one thread split across them, as MKL runs such a
    GEMM on one), else the GEMM."""
    y = few_row_linear(x, w) if mkl_weight(w) else None
    return x @ w.t() if y is None else y


@torch.library.custom_op("hyla::moe_experts", mutates_args=())
def moe_experts(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, w_in: torch.Tensor,
                w_out: torch.Tensor, gated: bool) -> torch.Tensor:
    """:func:`run_experts_sorted` as one op of a ``compile_decode`` graph (``torch.ops.hyla.moe_experts``):
    opaque to the compiler, so its host read does not break the graph, and it runs MKL's GEMMs on
    the weights as loaded, each chosen expert's once."""
    return run_experts_sorted(x, weights, experts, w_in, w_out, gated)


@moe_experts.register_fake
def _(x, weights, experts, w_in, w_out, gated):
    return x.new_empty(x.shape, dtype=weights.dtype)


def expert_matvec(w: torch.Tensor, experts: torch.Tensor, x: torch.Tensor, per_row: int = 1) -> torch.Tensor:
    """``w[experts[a]] @ x[a // per_row]`` for each assignment ``a``: stacked expert weights ``w [E, N,
    K]``, ``experts [A]``, ``x [A / per_row, K]`` (the tokens, ``per_row = k``; or the assignments) ->
    ``[A, N]`` in ``x``'s dtype. On a GPU a GEMV kernel whose programs read their assignment's expert in
    place (``gemv.expert_linear``); elsewhere, or a K it does not take, a batched GEMV on the gathered
    weights (a copy of ``A`` experts' weights)."""
    if _on_gpu(x) and x.stride(1) == 1 and _gpu("gemv").linear_fits(w[0]):
        return _gpu("gemv").expert_linear(x, w, experts, per_row)
    xs = x.repeat_interleave(per_row, dim=0) if per_row > 1 else x  # [A, K]
    return torch.bmm(w[experts], xs.unsqueeze(-1)).squeeze(-1)  # [A, N, K] @ [A, K, 1] -> [A, N]


def _weighted_sum(ys: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``sum_j weights[t, j] * ys[t * k + j]``: the experts' outputs by (token, choice) ``ys [T * k, H]``
    and ``weights [T, k]`` -> ``[T, H]`` in ``weights.dtype``, summed in choice order."""
    t, k = weights.shape
    return (ys.view(t, k, -1) * weights.unsqueeze(-1)).sum(1).to(weights.dtype)


class SparseMoE(nn.Module):
    """Top-k routed experts plus an optional shared expert.

    Routers: ``"softmax"`` (Qwen3-Next: softmax in fp32, top-k, renormalise if ``norm_topk_prob``,
    shared expert scaled by ``sigmoid(shared_expert_gate(x))``) and ``"sigmoid"`` (NemotronH:
    ``sigmoid`` scores, top-k chosen on ``scores + e_score_correction_bias`` within the best
    ``topk_group`` of ``n_group`` groups, weights are the uncorrected scores, renormalised, times
    ``routed_scaling_factor``; relu² experts, optional latent projection around the experts).

    Experts stay stacked (``w_in [E, I or 2I, Hin]``, ``w_out [E, Hin, I]``). Three ways to run them,
    the same numbers within rounding (:meth:`path` picks):

    * sorted (:meth:`run_experts`, the CPU's): tokens sorted by expert, one matmul pair per expert
      that received tokens; each chosen expert's weights are read once, but the group sizes are read
      on the host, so the step's shapes depend on the routing. A ``compile_decode`` graph runs it as
      one opaque op (:func:`moe_experts`);
    * gathered (:meth:`run_experts_gathered`, small GPU steps): every (token, choice) assignment runs
      its own expert on its own token, reading that expert's weights once per assignment;
    * grouped (:meth:`run_experts_grouped`, larger GPU steps): the assignments sorted by expert and
      padded to blocks on the device (``ops/gpu/moe.py``), each block's expert read once.

    On a GPU neither path reads the host, and the shapes depend on the token count alone: CUDA graphs
    capture MoE decode steps of any batch size and extends. There the softmax router is one kernel
    (``moe.softmax_topk``), and so are the weighted sum, the shared expert's gate and its add
    (``moe.combine``; not around a latent projection).
    """

    stacked_weights = ("w_in", "w_out")  # fp32 CPU: column-major, as nn.Linear's (linear.relayout_weights_)
    takes_gemv_step = True  # forward(gemv_step=True): the fused input projection as a GEMV (fuse_inputs_)

    def __init__(self, config: ModelConfig):
        super().__init__()
        c = config
        self.num_experts, self.top_k = c.num_experts, c.num_experts_per_tok
        self.router_kind = c.router
        self.norm_topk_prob = c.norm_topk_prob
        self.num_groups, self.topk_groups = c.router_num_groups, c.router_topk_groups
        self.scaling = c.routed_scaling_factor
        self.gated = c.hidden_act == "silu"
        inner = c.moe_latent_size or c.hidden_size
        width = c.moe_intermediate_size * (2 if self.gated else 1)
        self.router = Linear(c.hidden_size, c.num_experts, bias=False, dtype=c.dtype)
        self.e_score_correction_bias = (
            nn.Parameter(torch.empty(c.num_experts, dtype=torch.float32)) if c.router == "sigmoid" else None
        )
        self.w_in = nn.Parameter(torch.empty(c.num_experts, width, inner, dtype=c.dtype))  # [E, I or 2I, Hin]
        self.w_out = nn.Parameter(torch.empty(c.num_experts, inner, c.moe_intermediate_size, dtype=c.dtype))
        self.latent_in = self.latent_out = None
        if c.moe_latent_size:
            self.latent_in = Linear(c.hidden_size, c.moe_latent_size, bias=c.mlp_bias, dtype=c.dtype)
            self.latent_out = Linear(c.moe_latent_size, c.hidden_size, bias=c.mlp_bias, dtype=c.dtype)
        self.shared_expert = None
        if c.shared_expert_intermediate_size:
            self.shared_expert = MLP(c.hidden_size, c.shared_expert_intermediate_size, c.hidden_act, c.mlp_bias, c.dtype)
        self.shared_expert_gate = Linear(c.hidden_size, 1, bias=False, dtype=c.dtype) if c.shared_expert_gate else None
        self.fused_inputs: torch.Tensor | None = None  # fuse_inputs_: not a parameter, not in the state dict

    def fuse_inputs_(self) -> bool:
        """Give the projections that read the layer's input — the softmax router, the shared expert's
        gate and its in projection — one weight (GPU runners, after loading): a step runs one GEMM
        (a GEMV at batch 1) where it ran three. Their own weights become views of it (no copy), so
        the state dict and the other paths are unchanged. Only a softmax router without bias, with
        a shared expert and no latent projection (Qwen3-Next, Qwen3.5-MoE); returns whether fused."""
        if self.fused_inputs is not None:
            return True
        parts = [self.router] + ([self.shared_expert_gate] if self.shared_expert_gate is not None else []) \
            + ([self.shared_expert.in_proj] if self.shared_expert is not None else [])
        if self.router_kind != "softmax" or self.shared_expert is None or self.latent_in is not None \
                or any(p.bias is not None for p in parts):
            return False
        with torch.no_grad():
            fused = torch.cat([p.weight for p in parts])  # [E (+ 1) + I or 2I, H]
        start = 0
        for p in parts:
            rows = p.weight.shape[0]
            p.weight = nn.Parameter(fused[start:start + rows], requires_grad=False)
            start += rows
        self.fused_inputs = fused
        return True

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [T, H]`` -> ``(weights [T, k], experts [T, k])``; weights fp32 for the sigmoid
        router, model dtype for the softmax router (as the reference)."""
        if self.router_kind == "softmax":
            logits = self.router(x)  # [T, E]
            if _on_gpu(logits):  # the same in one kernel
                return _gpu("moe").softmax_topk(logits, self.top_k, self.norm_topk_prob)
            probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
            weights, experts = torch.topk(probs, self.top_k, dim=-1)  # [T, k]
            if self.norm_topk_prob:
                weights = weights / weights.sum(dim=-1, keepdim=True)
            return weights.to(logits.dtype), experts
        scores = torch.sigmoid(F.linear(x.float(), self.router.weight.float()))  # [T, E]
        choice = scores + self.e_score_correction_bias  # [T, E]
        if self.num_groups > 1:
            grouped = choice.view(-1, self.num_groups, self.num_experts // self.num_groups)  # [T, G, E/G]
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [T, G]
            best = torch.topk(group_scores, self.topk_groups, dim=-1, sorted=False).indices  # [T, topk_group]
            keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)  # [T, G]
            keep = keep.repeat_interleave(self.num_experts // self.num_groups, dim=1)  # [T, E]
            choice = choice.masked_fill(~keep, float("-inf"))
        experts = torch.topk(choice, self.top_k, dim=-1, sorted=False).indices  # [T, k]
        weights = scores.gather(1, experts)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scaling, experts

    def run_experts(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """``sum_k weights[t, k] * expert_{experts[t, k]}(x[t])`` -> ``[T, Hin]`` in ``weights.dtype``,
        sorted by expert (:func:`run_experts_sorted`; inside a compiled graph as its op,
        :func:`moe_experts`)."""
        run = torch.ops.hyla.moe_experts if torch.compiler.is_compiling() else run_experts_sorted
        return run(x, weights, experts, self.w_in, self.w_out, self.gated)

    def path(self, x: torch.Tensor) -> str:
        """How ``x``'s tokens run their experts: ``"sorted"`` on the CPU, compiled or not (a host read
        costs nothing there, and gathering the weights would copy them); on a GPU
        :meth:`device_path` (without Triton: gathered where few, else ``"sorted"``)."""
        if _on_gpu(x):
            return self.device_path(x)
        return "gathered" if x.is_cuda and x.shape[0] * self.top_k <= GATHER_MAX_ASSIGNMENTS else "sorted"

    def device_path(self, x: torch.Tensor) -> str:
        """A GPU's way, no host read: ``"gathered"`` for at most ``GATHER_MAX_ASSIGNMENTS``
        assignments (decode steps of a few requests), else ``"grouped"`` (Triton kernels)."""
        return "gathered" if x.shape[0] * self.top_k <= GATHER_MAX_ASSIGNMENTS else "grouped"

    def expert_outputs(self, x: torch.Tensor, experts: torch.Tensor, path: str) -> torch.Tensor:
        """Each (token, choice) assignment's expert on its token, unweighted, gathered or grouped (no
        host read either way): ``x [T, Hin]``, ``experts [T, k]`` -> ``[T * k, Hin]`` in x's dtype."""
        t, k = experts.shape
        if path == "gathered":  # each assignment's expert read once (a GEMV on a GPU)
            flat = experts.flatten()  # [A]
            h = expert_activation(expert_matvec(self.w_in, flat, x, per_row=k), self.gated)  # [A, I]: token a // k
            return expert_matvec(self.w_out, flat, h)  # [A, Hin]
        kernels = _gpu("moe")  # grouped: sorted by expert into blocks on the device, each block's expert read once
        plan = kernels.plan(experts, self.num_experts)
        h = expert_activation(kernels.expert_gemm(x, self.w_in, plan, per_row=k), self.gated)  # [A, I]
        return kernels.expert_gemm(h, self.w_out, plan, per_row=1)  # [A, Hin]

    def run_experts_gathered(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """:meth:`run_experts` as one product per (token, choice) assignment, ``A = T * k`` of them,
        with no host read: ``x [T, Hin]``, ``weights, experts [T, k]`` -> ``[T, Hin]`` in
        ``weights.dtype``. Each token's choices are summed in choice order (the sorted path: in expert
        order), so the two agree within rounding."""
        return _weighted_sum(self.expert_outputs(x, experts, "gathered"), weights)

    def run_experts_grouped(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """:meth:`run_experts_gathered`'s sums, each projection one grouped GEMM (``ops/gpu/moe.py``):
        the assignments sorted by expert and padded to blocks on the device, each block's expert read
        once. No host read; the shapes depend on the token count alone."""
        return _weighted_sum(self.expert_outputs(x, experts, "grouped"), weights)

    def _route_and_share(self, x: torch.Tensor, gemv_step: bool) -> tuple[torch.Tensor, ...]:
        """A GPU step's ``(weights, experts)`` (:meth:`route`), the shared expert's output (None without
        one) and its gate's logit ``[T, 1]`` (None without one); with :meth:`fuse_inputs_`, the router,
        the gate and the shared in projection as one GEMM (a GEMV on a GEMV step)."""
        if self.fused_inputs is None:
            weights, experts = self.route(x)
            shared = self.shared_expert(x) if self.shared_expert is not None else None
            gate = self.shared_expert_gate(x) if shared is not None and self.shared_expert_gate is not None else None
            return weights, experts, shared, gate
        e, gated = self.num_experts, int(self.shared_expert_gate is not None)
        y = project(x, self.fused_inputs, gemv_step)  # [T, E (+ 1) + I or 2I]
        weights, experts = _gpu("moe").softmax_topk(y[:, :e], self.top_k, self.norm_topk_prob)
        return weights, experts, self.shared_expert.down(y[:, e + gated:], gemv_step), y[:, e:e + 1] if gated else None

    def forward(self, x: torch.Tensor, gemv_step: bool = False) -> torch.Tensor:
        path = self.path(x)
        if path != "sorted" and _on_gpu(x) and self.latent_in is None:  # the sums, the shared expert and
            # its gate in one kernel
            weights, experts, shared, gate = self._route_and_share(x, gemv_step)
            return _gpu("moe").combine(self.expert_outputs(x, experts, path), weights, shared, gate)
        weights, experts = self.route(x)
        h = self.latent_in(x) if self.latent_in is not None else x
        run = {"sorted": self.run_experts, "gathered": self.run_experts_gathered,
               "grouped": self.run_experts_grouped}[path]
        out = run(h, weights, experts).to(x.dtype)  # [T, Hin]
        if self.latent_out is not None:
            out = self.latent_out(out)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        return out


# --- the layer and the model skeleton ----------------------------------------------------------


class HybridLayer(nn.Module):
    """One residual layer: ``x + mixer(mixer_norm(x))`` then ``x + ffn(ffn_norm(x))``; either part
    may be absent (NemotronH blocks hold exactly one of them)."""

    def __init__(self, mixer: nn.Module | None, mixer_norm: nn.Module | None,
                 ffn: nn.Module | None, ffn_norm: nn.Module | None):
        super().__init__()
        self.mixer, self.mixer_norm, self.ffn, self.ffn_norm = mixer, mixer_norm, ffn, ffn_norm

    def mixers(self) -> list[nn.Module]:
        """The layer's token mixers (none in a NemotronH FFN block; Falcon-H1's layer has two)."""
        return [] if self.mixer is None else [self.mixer]

    def forward(self, x: torch.Tensor, batch: ForwardBatch, rope: Rope | None) -> torch.Tensor:
        if self.mixer is not None:
            x = x + self.mixer(self.mixer_norm(x), batch, rope)
        if self.ffn is not None:
            x = x + self.ffn(self.ffn_norm(x))
        return x

    def forward_fused(self, out: torch.Tensor | OutProjection | None, residual: torch.Tensor, batch: ForwardBatch,
                      rope: Rope | None) -> tuple[torch.Tensor | OutProjection, torch.Tensor]:
        """:meth:`forward` with each residual add fused into the norm after it (the fused decode
        step, CUDA extend steps; the same numbers): the layer's input is ``residual + out`` (``out``
        None: just ``residual``), its output the same pair, the last part's output not yet added.
        A fused decode step of at most ``gemv.MAX_ROWS`` rows is a *GEMV step*: each part runs its in
        projection as a GEMV (:func:`in_projection`) and leaves its out projection to the next
        norm's kernel (:class:`OutProjection`); a part's module says it takes such a step with
        ``takes_gemv_step`` and its forward's ``gemv_step=True``."""
        gemv_step = is_gemv_step(batch, residual)
        if self.mixer is not None:
            h, residual = add_rms_norm(out, residual, self.mixer_norm)
            out = on_gemv_step(self.mixer, gemv_step)(h, batch, rope)
        if self.ffn is not None:
            h, residual = add_rms_norm(out, residual, self.ffn_norm)
            out = on_gemv_step(self.ffn, gemv_step)(h)
        return out, residual


def is_gemv_step(batch: ForwardBatch, residual: torch.Tensor) -> bool:
    """A fused decode step of at most ``gemv.MAX_ROWS`` rows (:meth:`HybridLayer.forward_fused`)."""
    return batch.fused_decode and residual.shape[0] <= _gpu("gemv").MAX_ROWS


def on_gemv_step(module: nn.Module, gemv_step: bool) -> Callable[..., torch.Tensor | OutProjection]:
    """``module``'s forward, told that this is a GEMV step (``gemv_step=True``) where it takes one."""
    return functools.partial(module, gemv_step=True) if gemv_step and getattr(module, "takes_gemv_step", False) \
        else module


@dataclass(frozen=True)
class OutProjection:
    """A part's output projection ``linear(prologue(x))``, left for the next :func:`add_rms_norm` to
    run in one kernel with the residual add and the norm (``ops/gpu/gemv.py``): the fused decode
    step at a few rows. ``prologue``: ``"plain"``, ``"silu_mul"`` (SwiGLU of ``x = [gate | up]``) or
    ``"gated_norm"`` (Gated DeltaNet's, ``gate = (z, weight, eps)``). The linear has no bias."""

    linear: nn.Linear
    x: torch.Tensor
    prologue: str = "plain"
    gate: tuple[torch.Tensor, torch.Tensor, float] | None = None

    def run(self) -> torch.Tensor:
        """The projection, run now (a GEMV where :func:`project` takes one): for a part whose output
        is summed with another's before the next norm (Falcon-H1's parallel mixers). Plain prologues
        only: the parts whose projections carry a prologue (MLP, Gated DeltaNet) never need this."""
        if self.prologue != "plain":
            raise NotImplementedError(f"OutProjection.run with the {self.prologue!r} prologue")
        return project(self.x, self.linear.weight, True)


def in_projection(linear: nn.Linear, x: torch.Tensor, gemv_step: bool) -> torch.Tensor:
    """``linear(x)``; on a GEMV step (no bias, ``gemv.IN_PROJ``, a weight ``gemv.linear`` takes) that
    kernel, which loads its weight before it waits for ``x`` (``ops/gpu/pdl.py``)."""
    if gemv_step and linear.bias is None and _gemv_takes(linear.weight):
        return _gpu("gemv").linear(x, linear.weight)
    return linear(x)


def project(x: torch.Tensor, weight: torch.Tensor, gemv_step: bool) -> torch.Tensor:
    """``F.linear(x, weight)`` (no bias), through :func:`in_projection`'s GEMV on a GEMV step."""
    return _gpu("gemv").linear(x, weight) if gemv_step and _gemv_takes(weight) else F.linear(x, weight)


def _gemv_takes(weight: torch.Tensor) -> bool:
    """Whether a GEMV step runs a projection of ``weight`` through ``gemv.linear`` (``gemv.IN_PROJ``)."""
    kernels = _gpu("gemv")
    return kernels.IN_PROJ and kernels.linear_fits(weight)


def out_projection(linear: nn.Linear, x: torch.Tensor, gemv_step: bool) -> torch.Tensor | OutProjection:
    """``linear(x)``, or with ``gemv_step`` (and no bias) the projection left as an :class:`OutProjection`."""
    return OutProjection(linear, x) if gemv_step and linear.bias is None else linear(x)


def add_rms_norm(out: torch.Tensor | OutProjection | None, residual: torch.Tensor,
                 norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
    """``s = residual + out`` and ``norm(s)`` in one Triton kernel (``out`` None: ``s = residual``;
    an :class:`OutProjection`: the projection too): returns ``(norm(s), s)``. The fused decode
    step's and CUDA extend steps'; it runs the kernels on any device."""
    if isinstance(out, OutProjection):
        return _gpu("gemv").linear_add_rms_norm(out.x, out.linear.weight, residual, norm.scale(), norm.eps,
                                                norm.ticket(residual.device), out.prologue, out.gate)
    kernels = _gpu("norms")
    if out is None:
        return kernels.rms_norm_fused(residual, norm.scale(), norm.eps), residual
    return kernels.add_rms_norm_fused(out, residual, norm.scale(), norm.eps)


class HybridForCausalLM(nn.Module, abc.ABC):
    """Embedding -> hybrid layers -> final norm -> lm_head, driven by a ``ForwardBatch``.

    Subclasses (one per architecture) build ``self.layers`` from the config and describe how HF
    checkpoint tensors map onto their parameters (``hf_weight_specs``). ``mtp_weights`` holds the
    checkpoint's multi-token-prediction tensors (``mtp.*``) untouched, for speculative decoding.
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        c = config
        self.config = c
        # no random init (the loader fills every parameter): nn.Embedding's normal_ on the meta device
        # goes through a decomposition that imports torch._dynamo, ~2-4 s of every engine's start-up
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size,
                                         _weight=torch.empty(c.vocab_size, c.hidden_size, dtype=c.dtype))
        self.layers = nn.ModuleList([self.build_layer(i) for i in range(c.num_hidden_layers)])
        self.norm = RMSNorm(c.hidden_size, c.norm_eps, c.zero_centered_norm, c.dtype)
        self.lm_head = Linear(c.hidden_size, c.vocab_size, bias=False, dtype=c.dtype)
        self.rotary = RotaryEmbedding(c.rotary_dim, c.rope_theta) if c.rotary_dim and c.num_attention_layers else None
        self.mtp_weights: dict[str, torch.Tensor] = {}
        self.register_load_state_dict_post_hook(lambda module, _keys: module.relayout_weights_())

    def relayout_weights_(self) -> None:
        """Store fp32 CPU projection weights column-major (runs after ``load_state_dict``; see
        :func:`relayout_weights_`). A tied lm_head shares the embedding's storage and keeps its layout."""
        relayout_weights_(self, keep=self.embed_tokens.weight)

    # --- construction (architecture files override) ---
    @abc.abstractmethod
    def build_layer(self, index: int) -> HybridLayer:
        """Layer ``index`` of this architecture, from ``self.config``."""

    @classmethod
    @abc.abstractmethod
    def hf_weight_specs(cls, config: ModelConfig) -> list[WeightSpec]:
        """Every tensor the Hugging Face checkpoint must hold, and where it goes."""

    @classmethod
    def normalize_hf_name(cls, name: str) -> str | None:
        """Map a checkpoint tensor name to the name ``hf_weight_specs`` uses; ``None`` = ignore it."""
        return name

    attention_mixer: type[nn.Module] = Attention  # the mixer of "attention" layers (Kimi-Linear: MLA)
    linear_mixer: type[nn.Module] | None = None  # of "linear" layers; None: GatedDeltaNet / Mamba2Mixer (linear_kind)

    def build_mixer(self, index: int) -> nn.Module:
        """The mixer of an ``"attention"`` or ``"linear"`` layer, built as ``cls(config, ordinal)``."""
        c = self.config
        if c.layer_types[index] == "attention":
            return self.attention_mixer(c, c.attention_ordinal(index))
        mixer = self.linear_mixer or (GatedDeltaNet if c.linear_kind == "gdn" else Mamba2Mixer)
        return mixer(c, c.linear_ordinal(index))

    def build_ffn(self, kind: str) -> nn.Module:
        c = self.config
        if kind == "moe":
            return SparseMoE(c)
        return MLP(c.hidden_size, c.intermediate_size, c.hidden_act, c.mlp_bias, c.dtype)

    def mixer_ffn_layer(self, index: int) -> HybridLayer:
        """The decoder layer of most architectures: ``x + mixer(norm(x))`` (:meth:`build_mixer`), then
        ``x + ffn(norm(x))`` (``config.ffn_types[index]``)."""
        return HybridLayer(mixer=self.build_mixer(index), mixer_norm=self.new_norm(),
                           ffn=self.build_ffn(self.config.ffn_types[index]), ffn_norm=self.new_norm())

    def new_norm(self) -> RMSNorm:
        c = self.config
        return RMSNorm(c.hidden_size, c.norm_eps, c.zero_centered_norm, c.dtype)

    # --- what the fused (Triton) decode step covers ---
    def supports_fused_decode(self) -> bool:
        """Every mixer has a fused decode path (its class sets ``fused_decode``: every mixer of every
        architecture now — full attention, Gated DeltaNet, Mamba2, Mamba1, LFM2's short conv, KDA and
        MLA, Falcon-H1's parallel pair included)."""
        return all(getattr(mixer, "fused_decode", False) for layer in self.layers for mixer in layer.mixers())

    @functools.cached_property
    def _residual_fusable(self) -> bool:
        """The fused decode step and CUDA extend steps may run :meth:`HybridLayer.forward_fused`
        (Falcon-H1's parallel layer has its own): every norm an :class:`RMSNorm`."""
        norms = [self.norm] + [n for layer in self.layers for n in (layer.mixer_norm, layer.ffn_norm) if n is not None]
        return all(type(n) is RMSNorm for n in norms)

    def supports_chain_verify(self) -> bool:
        """Every mixer runs a verify step of padded chains (``ForwardBatch.chain_ckpt_rows``, the
        compiled verify step): full attention and Gated DeltaNet so far."""
        return all(type(mixer) in (Attention, GatedDeltaNet) for layer in self.layers for mixer in layer.mixers())

    def supports_fused_extend(self) -> bool:
        """Every mixer runs a fused extend (``ForwardBatch.fused_extend``: full attention, Gated
        DeltaNet, Mamba2, Mamba1, KDA, MLA and LFM2's short conv — every mixer of every architecture now
        —, whose extend kernels read only device indices): what a CUDA graph of an
        extend needs (MoE layers read nothing on the host on a GPU either: :meth:`SparseMoE.path`)."""
        return all(getattr(mixer, "fused_extend", False) for layer in self.layers for mixer in layer.mixers())

    def fuse_moe_inputs_(self) -> int:
        """:meth:`SparseMoE.fuse_inputs_` in every MoE layer (a GPU runner's, once the weights are on
        their device); returns how many fused."""
        return sum(m.fuse_inputs_() for m in self.modules() if isinstance(m, SparseMoE))

    # --- forward ---
    @torch.no_grad()
    def forward(self, batch: ForwardBatch) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Run the batch's new tokens; return fp32 logits ``[N, vocab]`` at ``batch.logits_indices``
        (default: the last new token of each sequence), with ``batch.return_hidden`` also the final
        hidden states ``[T, hidden]`` of every new token (after the final norm)."""
        self.check_batch(batch)
        return self.forward_unchecked(batch)

    @torch.no_grad()
    def forward_unchecked(self, batch: ForwardBatch) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """:meth:`forward` without :meth:`check_batch` (the runner checks, then runs this compiled:
        the checks read host ints a compiled graph would specialise on)."""
        h = self.embed_tokens(batch.input_ids)  # [T, hidden]
        rope = self.rope(batch, h)
        if (batch.on_device or _on_gpu(h)) and self._residual_fusable:  # each residual add in the next norm's kernel
            out, residual = None, h
            for layer in self.layers:
                out, residual = layer.forward_fused(out, residual, batch, rope)
            if batch.fused_decode:
                h, _ = add_rms_norm(out, residual, self.norm)  # [B, hidden]
                logits = self.lm_head(h).float()  # [B, vocab]
                return (logits, h) if batch.return_hidden else logits
            h = residual + out  # [T, hidden]: the last add (the final norm runs on the rows kept below)
        else:
            for layer in self.layers:
                h = layer(h, batch, rope)
        if batch.return_hidden:
            h = self.norm(h)  # [T, hidden]: every new token's final hidden state
            rows = h[batch.logits_indices] if batch.logits_indices is not None else (
                h if batch.is_decode or batch.chain_ckpt_rows is not None else h[batch.last_token_indices()])
            return self.lm_head(rows).float(), h  # [N, vocab], [T, hidden]
        if batch.logits_indices is not None:
            h = h[batch.logits_indices]
        elif not batch.is_decode and batch.chain_ckpt_rows is None:  # decode, chains: every token's
            h = h[batch.last_token_indices()]
        return self.lm_head(self.norm(h)).float()  # [N, vocab]

    def rope(self, batch: ForwardBatch, x: torch.Tensor) -> Rope | None:
        """The batch's :class:`Rope`, once per step for every attention layer (``x``: the hidden
        states, for their dtype and device); its tables only where attention runs the PyTorch path.
        None without RoPE."""
        if self.rotary is None:
            return None
        if _runs_prologue_kernel(batch, x):
            return Rope(batch.positions, self.rotary.inv_freq, None, None)
        cos, sin = self.rotary(batch.positions, x.dtype)
        return Rope(batch.positions, self.rotary.inv_freq, cos, signed_sin(sin))

    def check_batch(self, batch: ForwardBatch) -> None:
        """``ValueError`` unless the batch fits this model (pools per layer kind, token ids)."""
        c = self.config
        if len(batch.k_buffers) != c.num_attention_layers or len(batch.v_buffers) != c.num_attention_layers:
            raise ValueError(f"the model has {c.num_attention_layers} attention layers, the batch brings "
                             f"{len(batch.k_buffers)} K and {len(batch.v_buffers)} V buffers")
        if len(batch.conv_states) != c.num_linear_layers or len(batch.ssm_states) != c.num_linear_layers:
            raise ValueError(f"the model has {c.num_linear_layers} linear layers, the batch brings "
                             f"{len(batch.conv_states)} conv and {len(batch.ssm_states)} SSM state buffers")
        if batch.chain_ckpt_rows is not None and not self.supports_chain_verify():
            raise ValueError(f"{c.architecture}: a verify step of padded chains needs full attention and "
                             "Gated DeltaNet layers only")
        if batch.max_token_id >= c.vocab_size:  # read once when the batch was built, not here
            raise ValueError(f"token id {batch.max_token_id} is outside the vocabulary ({c.vocab_size})")
