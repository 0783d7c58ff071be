"""What the recurrent mixers share (Gated DeltaNet, Mamba2 here; Mamba1, KDA, LFM2's short conv in
their architectures' files): the extend step's conv on the state pools, the checkpoints a step
writes, the fused extend's segments, the fused conv decode kernels' counters."""

from __future__ import annotations

import torch

from hyla.model.forward_batch import ForwardBatch
from hyla.model.layers import device
from hyla.model.ops.conv1d import causal_conv1d_varlen
from hyla.model.ops.varlen import write_rows_


def copy_decode_checkpoints(pool: torch.Tensor, batch: ForwardBatch) -> None:
    """Decode: a checkpoint after the (only) new token is the sequence's final state: copy it
    (source and destination rows were resolved and validated when the batch was built)."""
    if batch.decode_ckpt_src is not None:
        write_rows_(pool, batch.decode_ckpt_dst, pool.index_select(0, batch.decode_ckpt_src))


def conv1d_extend(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv_states: torch.Tensor,
                  batch: ForwardBatch, activation: str | None) -> torch.Tensor:
    """An extend step's causal conv ``x [T, C] -> [T, C]`` on the conv-state pool, with the batch's
    checkpoints: on CUDA, for the chunked paths (no token trees, no short extends), two Triton
    launches (``gpu/conv1d_extend.py``); elsewhere the PyTorch op (``ops/conv1d.py``)."""
    if device.on_gpu(x) and batch.tree_scan is None and batch.varlen is not None:
        return device.gpu("conv1d_extend").causal_conv1d_varlen_fused(x, weight, bias, conv_states, batch.varlen,
                                                                      activation)
    return causal_conv1d_varlen(x, weight, bias, batch.cu_seqlens, conv_states, batch.state_slots, activation,
                                **ckpt_kwargs(batch))


def conv1d_fused_extend(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                        conv_states: torch.Tensor, batch: ForwardBatch, activation: str | None) -> torch.Tensor:
    """A fused extend's causal conv (``ForwardBatch.fused_extend``): the extend kernels of
    ``gpu/conv1d_extend.py`` on its device indices, the checkpoints' windows first, then the
    sequence's final window into its own row."""
    fe, conv = batch.fused_extend, device.gpu("conv1d_extend")
    m = fe.ckpt_pos.shape[0]
    rows = conv.ConvRows(fe.tok_seq[:x.shape[0]], fe.cu_seqlens[:1],
                         ((fe.tok_seq[:m], fe.ckpt_pos, fe.ckpt_slot), (fe.tok_seq[:1], fe.cu_seqlens[1:],
                                                                       batch.state_slots)))
    return conv.causal_conv1d_rows_fused(x, weight, bias, conv_states, rows, batch.state_slots, activation)


def run_fused_extend_segments(segments, out: torch.Tensor, ssm_states: torch.Tensor, batch: ForwardBatch) -> None:
    """A fused extend's recurrence: the layer's segment kernel (``fla_chunk.SegmentKernel``) over
    its one sequence, from and back to its pool row, writing the checkpoints on the way."""
    fe = batch.fused_extend
    ckpts = device.gpu("segment_checkpoints").SegmentCheckpoints(ssm_states, fe.ckpt_offsets, fe.ckpt_pos, fe.ckpt_slot)
    segments(ssm_states, batch.state_slots, fe.cu_seqlens[:1], fe.cu_seqlens, out, ckpts, longest=fe.longest)


def ckpt_kwargs(batch: ForwardBatch, scan: bool = True) -> dict:
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
