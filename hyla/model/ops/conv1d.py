"""Causal depthwise conv1d over packed variable-length sequences, with a state pool.

Each channel ``c`` of token ``t`` sees the last ``K`` pre-conv inputs of its own sequence::

    y[t, c] = act(bias[c] + sum_k weight[c, k] * x_ext[t - (K-1) + k, c])

where ``x_ext`` is the sequence's new tokens preceded by its *conv window*: the last ``K-1``
pre-conv inputs it consumed before (zeros for a fresh sequence). The window lives in
``conv_states[slot] [C, K-1]`` (oldest first) in the model dtype; Hugging Face keeps ``K`` inputs, the
oldest of which never influences a future output. Math follows HF's ``causal_conv1d_fn/update``,
accumulated in fp32 (HF: in the weight dtype); the result is returned in the input dtype.

Pool rules (see ``varlen.py``): ``slots[i] == -1`` reads zeros and writes nothing; all reads
precede all writes; checkpoint rows are distinct from the batch's own rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hyla.cache.transfer import to_device_packed
from hyla.model.ops.varlen import (
    PaddedChains,
    SlotPlan,
    VarlenPlan,
    as_slot_plan,
    open_state_rows,
    read_states,
    scatter_rows,
    write_rows_,
    write_states,
)
from hyla.model.ops.tree import TokenTree, TreeScan, plan_scan

_ACTIVATIONS = {None: lambda y: y, "silu": F.silu, "swish": F.silu}


def _activation(name: str | None):
    if name not in _ACTIVATIONS:
        raise ValueError(f"activation must be one of {sorted(map(str, _ACTIVATIONS))}, got {name!r}")
    return _ACTIVATIONS[name]


def _check_weights(weight: torch.Tensor, bias: torch.Tensor | None, channels: int) -> int:
    """Validate ``weight [C, K]`` and ``bias [C] | None``; return ``K``."""
    if weight.dim() != 2 or weight.shape[0] != channels or weight.shape[1] < 2:
        raise ValueError(f"weight must be [C={channels}, K>=2], got {list(weight.shape)}")
    if bias is not None and bias.shape != (channels,):
        raise ValueError(f"bias must be [{channels}], got {list(bias.shape)}")
    return weight.shape[1]


def _check_pool(conv_states: torch.Tensor, channels: int, kernel: int) -> None:
    if conv_states.dim() != 3 or conv_states.shape[1:] != (channels, kernel - 1):
        raise ValueError(f"conv_states must be [S, C={channels}, K-1={kernel - 1}], got {list(conv_states.shape)}")


# --- reference -------------------------------------------------------------------------------


def causal_conv1d_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    window: torch.Tensor,
    activation: str | None = "silu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence, token by token: ``x [L, C]``, ``window [C, K-1]`` -> ``(y [L, C] in x's dtype,
    final window [C, K-1] fp32)``. The readable oracle for the tests; computes in fp32.
    """
    act = _activation(activation)
    weight = weight.float()
    window = window.float()
    ys = []
    for t in range(x.shape[0]):
        full = torch.cat([window, x[t].float().unsqueeze(1)], dim=1)  # [C, K]
        y = (full * weight).sum(dim=1)  # [C]
        if bias is not None:
            y = y + bias.float()
        ys.append(act(y))
        window = full[:, 1:]  # [C, K-1]
    y = torch.stack(ys) if ys else x.new_zeros(0, x.shape[1], dtype=torch.float32)
    return y.to(x.dtype), window


# --- fast paths ------------------------------------------------------------------------------


def _accumulate_dtype(weight: torch.Tensor) -> torch.dtype:
    return torch.float64 if weight.dtype == torch.float64 else torch.float32


def _depthwise_taps(x_ext: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``y[r] = bias + sum_k weight[:, k] * x_ext[r + k]`` for every ``r`` in ``[0, len - K + 1)`` -> ``[R, C]``,
    accumulated in fp32 (fp64 for fp64 weights): one fused multiply-add per tap over shifted views."""
    acc = _accumulate_dtype(weight)
    w = weight.to(acc).t().contiguous()  # [K, C]: each tap's weights contiguous (a strided column of
    # [C, K] broadcast over the rows made every multiply-add ~5x slower on CPU)
    rows = x_ext.shape[0] - weight.shape[1] + 1
    y = x_ext[:rows].to(acc) * w[0]  # [R, C]
    for k in range(1, weight.shape[1]):
        y.addcmul_(x_ext[k : k + rows].to(acc), w[k])
    if bias is not None:
        y += bias.to(acc)
    return y


@dataclass(frozen=True)
class _WindowRows:
    """Rows of a varlen step's ``x_ext`` (see :func:`causal_conv1d_varlen`), built once per step on
    the host and sent to the device in one copy that does not wait for it: every conv layer of the
    step reads the same rows."""

    tokens: torch.Tensor | None  # [T] row of the taps' output for each token (None: one sequence, every row)
    final: torch.Tensor  # [B*(K-1)] the K-1 rows ending at each sequence's last token
    ckpt: torch.Tensor | None  # [M*(K-1)] the K-1 rows ending at each checkpoint's token


def _window_rows(varlen: VarlenPlan, kernel: int, device: torch.device) -> _WindowRows:
    def build() -> _WindowRows:
        w, ckpts = kernel - 1, varlen.ckpts
        lengths = torch.tensor(varlen.lengths, dtype=torch.long)
        window_first = torch.tensor(varlen.starts[:-1], dtype=torch.long) + torch.arange(len(lengths)) * w  # [B]
        taps = torch.arange(w)
        # sequence i's window is x_ext rows window_first[i] + (0..K-2), then its tokens: the K-1 rows
        # ending at its n-th token start at window_first[i] + n, and the taps' output row of its
        # packed token t (the row its receptive field starts at) is t + i*(K-1)
        final = (window_first + lengths)[:, None] + taps  # [B, K-1]
        ckpt = (window_first[ckpts.seq] + torch.tensor(ckpts.num_tokens, dtype=torch.long))[:, None] + taps  # [M, K-1]
        several = len(lengths) > 1
        tokens = (torch.arange(varlen.starts[-1]) + torch.repeat_interleave(torch.arange(len(lengths)) * w, lengths)
                  if several else torch.zeros(0, dtype=torch.long))  # [T]
        final_d, ckpt_d, tokens_d = to_device_packed([final.flatten(), ckpt.flatten(), tokens], device)
        return _WindowRows(tokens=tokens_d if several else None, final=final_d,
                           ckpt=ckpt_d if ckpts.num_checkpoints else None)

    return varlen.derive(("conv_window_rows", kernel, device), build)


def causal_conv1d_varlen(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    cu_seqlens: torch.Tensor,
    conv_states: torch.Tensor,
    slots: torch.Tensor,
    activation: str | None = "silu",
    ckpt_seq: torch.Tensor | None = None,
    ckpt_len: torch.Tensor | None = None,
    ckpt_slot: torch.Tensor | None = None,
    tree: TokenTree | TreeScan | None = None,
    varlen: VarlenPlan | None = None,
) -> torch.Tensor:
    """Causal depthwise conv over packed sequences ``x [T, C]`` -> ``y [T, C]`` (dtype of ``x``).

    Sequence ``i`` starts from window ``conv_states[slots[i]]`` and its final window is written
    back there; for each checkpoint ``j`` the window after ``ckpt_len[j]`` new tokens of sequence
    ``ckpt_seq[j]`` is written into ``conv_states[ckpt_slot[j]]``.

    How: every sequence's window is laid in front of its tokens in one extended buffer
    ``x_ext [T + B*(K-1), C]``; token ``t`` reads the ``K`` rows of ``x_ext`` ending at its own (never
    the previous sequence's), and the window after ``n`` tokens of sequence ``i`` is just the
    ``K-1`` rows ending at its ``n``-th token.

    ``tree``: the new tokens form trees (``ops/tree.py``: each token's window is its parent's);
    trees and extends of at most ``SHORT_EXTEND`` tokens run token by token with the decode update.
    ``varlen``: a :class:`~hyla.model.ops.varlen.VarlenPlan` validated once per step (``ForwardBatch.varlen``):
    then nothing is read back from the device (``ckpt_*`` must be None: the plan carries them).
    """
    if x.dim() != 2:
        raise ValueError(f"x must be [T, C], got {list(x.shape)}")
    num_tokens, channels = x.shape
    kernel = _check_weights(weight, bias, channels)
    _check_pool(conv_states, channels, kernel)
    act = _activation(activation)
    scan, varlen = plan_scan(tree, cu_seqlens, num_tokens, slots, conv_states, ckpt_seq, ckpt_len, ckpt_slot,
                             x.device, varlen)
    if scan is not None:
        return _conv_tree(x, weight, bias, conv_states, scan, act)

    rows = _window_rows(varlen, kernel, x.device)
    windows = read_states(conv_states, varlen.slots, x.dtype).transpose(1, 2)  # [B, K-1, C], zeros for -1
    starts = varlen.starts
    x_ext = torch.cat([part for i in range(len(varlen.lengths)) for part in (windows[i], x[starts[i] : starts[i + 1]])])
    # x_ext [T + B*(K-1), C]: sequence i's window, then its tokens

    y = _depthwise_taps(x_ext, weight, bias)  # [T + (B-1)*(K-1), C]: row r ends its receptive field at x_ext[r + K-1]
    if rows.tokens is not None:  # drop the rows that straddle two sequences
        y = y.index_select(0, rows.tokens)  # [T, C]
    y = act(y)

    w = kernel - 1
    if rows.ckpt is not None:
        ckpt_windows = x_ext.index_select(0, rows.ckpt).view(varlen.ckpts.num_checkpoints, w, channels)  # [M, K-1, C]
        write_rows_(conv_states, varlen.ckpts.slot, ckpt_windows.transpose(1, 2).to(conv_states.dtype))
    final = x_ext.index_select(0, rows.final).view(len(varlen.lengths), w, channels)  # [B, K-1, C]: the K-1 rows ending at the last token
    write_states(conv_states, varlen.slots, final.transpose(1, 2))
    return y.to(x.dtype)


def _conv_tree(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv_states: torch.Tensor,
               scan: TreeScan, act) -> torch.Tensor:
    """Trees and short extends: every token at once with the decode update's math (bitwise). A
    token's input window is its ``K - 1`` nearest ancestors, continued into its sequence's window
    (``TreeScan.conv_rows``); the window a token leaves is the last ``K - 1`` entries of its own."""
    num_tokens, channels = x.shape
    kernel = weight.shape[1]
    windows = read_states(conv_states, scan.slots, conv_states.dtype)  # [B, C, K-1], zeros for padding
    ext = torch.cat([windows.transpose(1, 2).reshape(-1, channels), x.to(conv_states.dtype)])  # [B*(K-1) + T, C]
    full = ext.index_select(0, scan.conv_rows(kernel).view(-1)).view(num_tokens, kernel, channels)
    full = full.transpose(1, 2)  # [T, C, K]: each token's window + its own input, as the decode update's
    acc = _accumulate_dtype(weight)
    y = (full.to(acc) * weight.to(acc)).sum(dim=2)  # [T, C]
    if bias is not None:
        y += bias.to(acc)
    if scan.write_tokens is not None:  # the checkpoints' windows and the sequences' final windows
        write_rows_(conv_states, scan.write_slots, full.index_select(0, scan.write_tokens)[:, :, 1:])
    return act(y).to(x.dtype)


def causal_conv1d_chains(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_states: torch.Tensor,
    slots: SlotPlan,
    chains: PaddedChains,
    activation: str | None = "silu",
) -> torch.Tensor:
    """A verify step of chains padded to one width (``chains``: ``varlen.PaddedChains``; see
    ``gated_delta_rule_chains``): ``x [T, C]`` packed -> ``y [T, C]``, with the decode update's math
    (the tree path's result over the same chains, bitwise). The window after padded token
    ``j < W - 1`` of sequence ``i`` goes to ``conv_states[chains.ckpt_rows[i, j]]``, the window after
    the last to its own slot. Shapes depend on ``B``, ``W`` and ``T`` only (one compiled graph).
    Padded trees (``chains.parents``): each token's window the inputs along its path
    (:func:`tree_windows`)."""
    if x.dim() != 2:
        raise ValueError(f"x must be [T, C], got {list(x.shape)}")
    channels = x.shape[1]
    kernel = _check_weights(weight, bias, channels)
    _check_pool(conv_states, channels, kernel)
    batch, width = chains.check(x.shape[0], slots)
    ckpt_rows, rows, parents = chains.ckpt_rows, chains.rows, chains.parents
    act = _activation(activation)
    padded = x if rows is None else scatter_rows(x, rows, batch * width)  # [B*W, C]
    windows = read_states(conv_states, slots, conv_states.dtype)  # [B, C, K-1]
    ext = torch.cat([windows, padded.view(batch, width, channels).transpose(1, 2).to(conv_states.dtype)], dim=2)
    if parents is None:
        full = ext.unfold(2, kernel, 1)  # [B, C, W, K]: token j's window + its own input, as the decode update's
    else:  # the same along each token's path
        idx = tree_windows(parents, kernel).view(batch, 1, width * kernel).expand(batch, channels, width * kernel)
        full = ext.gather(2, idx).view(batch, channels, width, kernel)
    full = full.permute(0, 2, 3, 1).reshape(batch * width, kernel, channels).transpose(1, 2)  # [B*W, C, K]
    left = full[:, :, 1:].reshape(batch, width, channels, kernel - 1)  # the window each token leaves
    if width > 1:
        write_rows_(conv_states, ckpt_rows.reshape(-1), left[:, :-1].reshape(-1, channels, kernel - 1))
    write_states(conv_states, slots, left[:, -1])
    if rows is not None:
        full = full.index_select(0, rows)  # [T, C, K]
    acc = _accumulate_dtype(weight)
    y = (full.to(acc) * weight.to(acc)).sum(dim=2)  # [T, C]
    if bias is not None:
        y += bias.to(acc)
    return act(y).to(x.dtype)


def tree_windows(parents: torch.Tensor, kernel: int) -> torch.Tensor:
    """``[B, W, K]``: for padded trees ``parents [B, W]`` (column ``j > 0`` continues column
    ``parents[:, j] < j``, column 0 the sequence's window), where each column's convolution window
    lies in ``cat([window [K-1], columns [W]])``: the ``K - 1`` inputs before it along its path, then
    its own (``K - 1 + j``). For chains, ``j .. j + K - 1`` (what ``unfold`` takes). Traceable: a
    loop of ``K - 1`` gathers, no host read."""
    batch, width = parents.shape
    cur = torch.arange(width, device=parents.device).expand(batch, width)  # each column itself
    back = [cur]
    for _ in range(kernel - 1):  # one more step back along the path: a parent column, or into the window
        cur = torch.where(cur >= 0, parents.gather(1, cur.clamp(min=0)), cur - 1)
        back.append(cur)
    return torch.stack(back[::-1], dim=2) + (kernel - 1)  # column c at K - 1 + c; the window's last input at K - 2


def causal_conv1d_update(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_states: torch.Tensor,
    slots: torch.Tensor | SlotPlan,
    activation: str | None = "silu",
) -> torch.Tensor:
    """One decode step: ``x [B, C]`` (one token per sequence) -> ``y [B, C]``.

    Reads window ``conv_states[slots[i]]``, writes the shifted window (dropping its oldest input,
    appending ``x[i]``) back in place. ``slots[i] == -1``: row ``i`` of ``y`` is don't-care and
    nothing is written. ``slots`` may be a :class:`SlotPlan` validated at batch construction (no
    host read here); when the slots are one ascending run the pool rows are updated through a view.
    """
    if x.dim() != 2:
        raise ValueError(f"x must be [B, C], got {list(x.shape)}")
    batch, channels = x.shape
    kernel = _check_weights(weight, bias, channels)
    _check_pool(conv_states, channels, kernel)
    act = _activation(activation)
    plan = as_slot_plan(slots, conv_states, batch)

    window, copied = open_state_rows(conv_states, plan, conv_states.dtype)  # [B, C, K-1]
    full = torch.cat([window, x.unsqueeze(2).to(window.dtype)], dim=2)  # [B, C, K]: window + the new input
    acc = _accumulate_dtype(weight)
    y = (full.to(acc) * weight.to(acc)).sum(dim=2)  # [B, C]
    if bias is not None:
        y += bias.to(acc)
    if copied:
        write_states(conv_states, plan, full[:, :, 1:])
    else:
        window.copy_(full[:, :, 1:])  # the pool rows themselves
    return act(y).to(x.dtype)
