"""Gated DeltaNet prefill on the GPU through fla's chunked Triton kernel, with exact checkpoints.

Same contract as :func:`hyla.model.ops.gated_delta.chunk_gated_delta_rule_varlen` (the PyTorch
reference and the CPU path): packed sequences start from their pool rows, write their final states
back, and checkpoint ``j`` wants the state after ``ckpt_len[j]`` tokens of sequence ``ckpt_seq[j]``.

fla (``fla-core``, the ``hyla[cuda]`` extra) returns only each sequence's final state. A checkpoint
inside a sequence therefore cuts it there: the sequences run in rounds, round ``r`` feeding every
sequence's ``r``-th segment (between consecutive cut points) in one varlen call that starts from the
state the previous round left, so the state at each cut is a final state — exact, whatever the
position in a chunk. A prompt's usual checkpoint (its end − 1) costs one more call of one token per
sequence; a batch without checkpoints is one call.
"""

from __future__ import annotations

import importlib.util
import itertools
from dataclasses import dataclass

import torch

from hyla.cache.transfer import to_device_packed
from hyla.model.ops.varlen import VarlenPlan, read_states, write_states

HAS_FLA = importlib.util.find_spec("fla") is not None


@dataclass(frozen=True)
class FlaRound:
    """One varlen call of fla's kernel: sequences ``seqs`` (batch rows), their tokens ``idx`` of the
    packed batch (None: every token in order, or the one run ``span``), ``cu_seqlens`` on the device and on the host (fla
    then computes its chunk indices without a device read), and the checkpoints whose position
    ends this round: rows ``ckpt_rows`` of the running state go to pool rows ``ckpt_slots``."""

    seqs: torch.Tensor
    idx: torch.Tensor | None
    span: tuple[int, int] | None  # the tokens are one run start:end of the packed batch (slices, no gather)
    cu_seqlens: torch.Tensor
    cu_seqlens_cpu: torch.Tensor
    ckpt_rows: torch.Tensor | None
    ckpt_slots: torch.Tensor | None


def fla_rounds(varlen: VarlenPlan, device: torch.device) -> list[FlaRound]:
    """The batch's segment rounds (see the module docstring), built once per step: every Gated
    DeltaNet layer of the step then passes fla the same tensors (its own caches, keyed on tensor
    identity, hit from the second layer on) and sends nothing to the device."""
    return varlen.derive(("fla_rounds", device), lambda: _plan_rounds(varlen, device))


def _plan_rounds(varlen: VarlenPlan, device: torch.device) -> list[FlaRound]:
    lengths, starts, ckpts = varlen.lengths, varlen.starts, varlen.ckpts
    # each sequence's segment bounds: 0, its checkpoint positions inside it, its length
    bounds = [sorted({0, n} | {c for s, c in zip(ckpts.seq, ckpts.num_tokens) if s == i and c < n})
              for i, n in enumerate(lengths)]
    num_rounds = max((len(b) - 1 for b in bounds), default=0)
    rounds = []
    for r in range(num_rounds):
        segs = [(i, starts[i] + b[r], starts[i] + b[r + 1]) for i, b in enumerate(bounds) if r + 1 < len(b)]
        cu = torch.tensor(list(itertools.accumulate((e - a for _, a, e in segs), initial=0)), dtype=torch.long)
        whole = num_rounds == 1 and len(segs) == len(lengths)  # every token in order: no gather
        span = (segs[0][1], segs[-1][2]) if all(a == e0 for (_, _, e0), (_, a, _) in zip(segs, segs[1:])) else None
        done = [(j, i) for j, (i, n) in enumerate(zip(ckpts.seq, ckpts.num_tokens))
                if r + 1 < len(bounds[i]) and bounds[i][r + 1] == n]  # checkpoints at this round's cuts
        # one asynchronous copy of the round's index tensors: [cu | seqs | ckpt rows | ckpt slots | token index]
        long = lambda values: torch.tensor(values, dtype=torch.long)  # noqa: E731
        host = [cu, long([i for i, _, _ in segs]), long([i for _, i in done]),
                long([ckpts.slot_list[j] for j, _ in done])]
        if not whole and span is None:
            host.append(torch.cat([torch.arange(a, e) for _, a, e in segs]))
        parts = to_device_packed(host, device)
        rounds.append(FlaRound(
            seqs=parts[1], idx=parts[4] if len(parts) > 4 else None, span=None if whole else span,
            cu_seqlens=parts[0], cu_seqlens_cpu=cu, ckpt_rows=parts[2] if done else None,
            ckpt_slots=parts[3] if done else None))
    return rounds


def chunk_gated_delta_rule_fla(
    q: torch.Tensor,  # [T, Hk, Dk]
    k: torch.Tensor,  # [T, Hk, Dk]
    v: torch.Tensor,  # [T, Hv, Dv]
    g: torch.Tensor,  # [T, Hv] fp32 log-decay
    beta: torch.Tensor,  # [T, Hv]
    cu_seqlens: torch.Tensor,
    ssm_states: torch.Tensor,  # [S, Hv, Dk, Dv] fp32
    slots: torch.Tensor,
    ckpt_seq: torch.Tensor | None = None,
    ckpt_len: torch.Tensor | None = None,
    ckpt_slot: torch.Tensor | None = None,
    use_qk_l2norm: bool = True,
    tree=None,
    varlen: VarlenPlan | None = None,
) -> torch.Tensor:
    """``o [T, Hv, Dv]`` (dtype of ``q``); pool rows updated in place as the reference does.
    ``tree``: chains only (a short extend's, which fla runs as plain sequences); token trees take
    the PyTorch op's ``tree_scan``. ``varlen``: the batch's plan, validated once per step (no host
    read here; ``ckpt_*`` must then be None)."""
    if tree is not None and not tree.is_chain:
        raise ValueError("fla's chunked kernel runs chains; a token tree takes chunk_gated_delta_rule_varlen")
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    if varlen is not None:
        varlen.check(cu_seqlens, q.shape[0], ckpt_seq, ckpt_len, ckpt_slot)
    else:
        varlen = VarlenPlan.from_tensors(cu_seqlens, q.shape[0], slots, ssm_states, ckpt_seq, ckpt_len, ckpt_slot,
                                         q.device)
    state = read_states(ssm_states, varlen.slots, torch.float32)  # [B, Hv, Dk, Dv], zeros for -1
    o = torch.empty(v.shape, dtype=q.dtype, device=q.device)
    for rnd in fla_rounds(varlen, q.device):
        xs = (q, k, v, g, beta)
        if rnd.span is not None:
            xs = tuple(x[rnd.span[0]:rnd.span[1]] for x in xs)
        elif rnd.idx is not None:
            xs = tuple(x.index_select(0, rnd.idx) for x in xs)
        out, final = chunk_gated_delta_rule(
            *(x.unsqueeze(0) for x in xs), initial_state=state.index_select(0, rnd.seqs), output_final_state=True,
            cu_seqlens=rnd.cu_seqlens, cu_seqlens_cpu=rnd.cu_seqlens_cpu, use_qk_l2norm_in_kernel=use_qk_l2norm)
        if rnd.span is not None:
            o[rnd.span[0]:rnd.span[1]] = out[0]
        elif rnd.idx is not None:
            o.index_copy_(0, rnd.idx, out[0].to(q.dtype))
        else:
            o = out[0].to(q.dtype)
        state.index_copy_(0, rnd.seqs, final.float())
        if rnd.ckpt_rows is not None:
            ssm_states.index_copy_(0, rnd.ckpt_slots, state.index_select(0, rnd.ckpt_rows))
    write_states(ssm_states, varlen.slots, state)
    return o
