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

import torch

from hyla.model.ops.varlen import VarlenPlan, read_states, write_states

HAS_FLA = importlib.util.find_spec("fla") is not None


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
    lengths, starts, ckpts = list(varlen.lengths), varlen.starts, varlen.ckpts
    dev = q.device
    # each sequence's segment bounds: 0, its checkpoint positions inside it, its length
    bounds = [sorted({0, n} | {c for s, c in zip(ckpts.seq, ckpts.num_tokens) if s == i and c < n})
              for i, n in enumerate(lengths)]
    state = read_states(ssm_states, varlen.slots, torch.float32)  # [B, Hv, Dk, Dv], zeros for -1
    o = torch.empty(v.shape, dtype=q.dtype, device=dev)
    rounds = max((len(b) - 1 for b in bounds), default=0)
    for r in range(rounds):
        segs = [(i, starts[i] + b[r], starts[i] + b[r + 1]) for i, b in enumerate(bounds) if r + 1 < len(b)]
        seqs = torch.tensor([i for i, _, _ in segs], dtype=torch.long, device=dev)
        cu = [0]
        for _, a, e in segs:
            cu.append(cu[-1] + e - a)
        whole = rounds == 1 and len(segs) == len(lengths)  # every token in order: no gather
        if whole:
            idx = None
            xs = (q, k, v, g, beta)
        else:
            idx = torch.cat([torch.arange(a, e) for _, a, e in segs]).to(dev)
            xs = tuple(x.index_select(0, idx) for x in (q, k, v, g, beta))
        out, final = chunk_gated_delta_rule(
            *(x.unsqueeze(0) for x in xs), initial_state=state.index_select(0, seqs), output_final_state=True,
            cu_seqlens=torch.tensor(cu, dtype=torch.long, device=dev), use_qk_l2norm_in_kernel=use_qk_l2norm)
        if whole:
            o = out[0].to(q.dtype)
        else:
            o.index_copy_(0, idx, out[0].to(q.dtype))
        state.index_copy_(0, seqs, final.float())
        done = [(j, i) for j, (i, n) in enumerate(zip(ckpts.seq, ckpts.num_tokens))
                if r + 1 < len(bounds[i]) and bounds[i][r + 1] == n]
        if done:  # checkpoints at this round's cut points
            rows = state.index_select(0, torch.tensor([i for _, i in done], dtype=torch.long, device=dev))
            ssm_states.index_copy_(0, ckpts.slot[[j for j, _ in done]], rows)
    write_states(ssm_states, varlen.slots, state)
    return o
