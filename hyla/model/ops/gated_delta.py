"""The gated delta rule (Gated DeltaNet, Qwen3-Next / Qwen3.5): chunked prefill over packed
variable-length sequences and the recurrent decode step, on a state pool.

Per value head, with state ``S [Dk, Dv]`` (fp32), log-decay ``g_t <= 0`` and ``beta_t in (0, 1)``::

    S   <- exp(g_t) * S
    S   <- S + k_t (beta_t * (v_t - k_t^T S))^T      # delta rule: write only the correction
    o_t  = q_t^T S

``q, k`` are l2-normalised (eps 1e-6), ``q`` is scaled by ``Dk**-0.5`` and both are repeated over
value heads with ``repeat_interleave(Hv // Hk)`` (Hugging Face's GQA). Everything runs in fp32 and
``o`` comes back in the dtype of ``q``. This is HF's ``torch_recurrent_gated_delta_rule``; the
chunked path is HF's ``torch_chunk_gated_delta_rule`` (UT transform per chunk of
``varlen.chunk_size_for`` tokens: 32 on CPU, HF's 64 on an accelerator).

Pool rules (see ``varlen.py``): ``ssm_states [S, Hv, Dk, Dv]`` fp32; ``slots[i] == -1`` starts from
zeros and writes nothing; all reads precede all writes; checkpoint rows are distinct from the
batch's own rows.
"""

from __future__ import annotations

from typing import Callable

import torch

from hyla.model.ops.varlen import (
    CheckpointPlan,
    ChunkLayout,
    PaddedChains,
    SlotPlan,
    VarlenPlan,
    as_slot_plan,
    chunk_scan_on_pool,
    chunk_size_for,
    decay_exp,
    scan_padded_chains,
    update_on_pool,
)
from hyla.model.ops.tree import TokenTree, TreeScan, plan_scan, tree_scan


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dim (FLA's and HF's definition)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def prepare_qk(q: torch.Tensor, k: torch.Tensor, num_v_heads: int, use_qk_l2norm: bool,
               norm: Callable[[torch.Tensor], torch.Tensor] = l2norm):
    """``[N, Hk, Dk]`` -> fp32 ``[N, Hv, Dk]``: optional ``norm`` (:func:`l2norm`), ``q *= Dk**-0.5``, then
    key head ``h`` serves value heads ``h*r .. h*r + r-1`` (``repeat_interleave(r)``, ``r = Hv // Hk``)."""
    q, k = q.float(), k.float()
    if use_qk_l2norm:
        q, k = norm(q), norm(k)
    q = q * q.shape[-1] ** -0.5
    n, num_k_heads, dk = q.shape
    repeat = num_v_heads // num_k_heads
    if repeat == 1:
        return q, k
    return tuple(x.unsqueeze(2).expand(n, num_k_heads, repeat, dk).reshape(n, num_v_heads, dk) for x in (q, k))


def check_inputs(q, k, v, g, beta, ssm_states, decay_per_channel: bool = False) -> None:
    """Shapes of a delta-rule call: ``q, k [N, Hk, Dk]``, ``v [N, Hv, Dv]`` (``Hv`` a multiple of ``Hk``),
    ``g`` ``[N, Hv]`` (``[N, Hv, Dk]`` with ``decay_per_channel``, KDA), ``beta [N, Hv]``, ``ssm_states
    [S, Hv, Dk, Dv]``; ``ValueError`` naming the first that does not fit."""
    if q.dim() != 3 or k.shape != q.shape:
        raise ValueError(f"q and k must both be [N, Hk, Dk], got {list(q.shape)} and {list(k.shape)}")
    n, num_k_heads, dk = q.shape
    if v.dim() != 3 or v.shape[0] != n:
        raise ValueError(f"v must be [N={n}, Hv, Dv], got {list(v.shape)}")
    num_v_heads, dv = v.shape[1:]
    if num_v_heads % num_k_heads:
        raise ValueError(f"value heads ({num_v_heads}) must be a multiple of key heads ({num_k_heads})")
    if decay_per_channel and g.shape != (n, num_v_heads, dk):
        raise ValueError(f"g must be [N={n}, Hv={num_v_heads}, Dk={dk}] (one decay per key channel), "
                         f"got {list(g.shape)}")
    if not decay_per_channel and g.shape != (n, num_v_heads):
        raise ValueError(f"g must be [N={n}, Hv={num_v_heads}], got {list(g.shape)}")
    if beta.shape != (n, num_v_heads):
        raise ValueError(f"beta must be [N={n}, Hv={num_v_heads}], got {list(beta.shape)}")
    if ssm_states.dim() != 4 or ssm_states.shape[1:] != (num_v_heads, dk, dv):
        raise ValueError(f"ssm_states must be [S, Hv={num_v_heads}, Dk={dk}, Dv={dv}], got {list(ssm_states.shape)}")


# --- reference -------------------------------------------------------------------------------


def gated_delta_rule_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor | None = None,
    use_qk_l2norm: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence, token by token: ``q, k [L, Hk, Dk]``, ``v [L, Hv, Dv]``, ``g, beta [L, Hv]``,
    ``state [Hv, Dk, Dv] | None`` -> ``(o [L, Hv, Dv] in q's dtype, final state fp32)``.

    The readable oracle for the tests.
    """
    dtype, (num_v_heads, dv) = q.dtype, v.shape[1:]
    q, k = prepare_qk(q, k, num_v_heads, use_qk_l2norm)  # [L, Hv, Dk]
    v, g, beta = v.float(), g.float(), beta.float()
    S = v.new_zeros(num_v_heads, q.shape[-1], dv) if state is None else state.float().clone()  # [Hv, Dk, Dv]
    out = []
    for t in range(q.shape[0]):
        S = S * g[t].exp()[:, None, None]
        predicted = (k[t].unsqueeze(-1) * S).sum(dim=1)  # [Hv, Dv]: k_t^T S
        delta = (v[t] - predicted) * beta[t].unsqueeze(-1)  # [Hv, Dv]
        S = S + k[t].unsqueeze(-1) * delta.unsqueeze(1)  # [Hv, Dk, Dv]
        out.append((q[t].unsqueeze(-1) * S).sum(dim=1))  # [Hv, Dv]: q_t^T S
    o = torch.stack(out) if out else v.new_zeros(0, num_v_heads, dv)
    return o.to(dtype), S


# --- chunked prefill -------------------------------------------------------------------------


def chunk_gated_delta_rule_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    ssm_states: torch.Tensor,
    slots: torch.Tensor,
    ckpt_seq: torch.Tensor | None = None,
    ckpt_len: torch.Tensor | None = None,
    ckpt_slot: torch.Tensor | None = None,
    chunk_size: int | None = None,
    use_qk_l2norm: bool = True,
    tree: TokenTree | TreeScan | None = None,
    varlen: VarlenPlan | None = None,
) -> torch.Tensor:
    """Gated delta rule over packed sequences: ``q, k [T, Hk, Dk]``, ``v [T, Hv, Dv]``,
    ``g, beta [T, Hv]`` -> ``o [T, Hv, Dv]`` (dtype of ``q``).

    Sequence ``i`` starts from ``ssm_states[slots[i]]`` and its final state is written back there;
    for each checkpoint ``j`` the state after ``ckpt_len[j]`` new tokens of sequence ``ckpt_seq[j]``
    is written into ``ssm_states[ckpt_slot[j]]``. Each sequence is chunked from its own first token.
    ``tree``: the new tokens form trees (``ops/tree.py``: each token continues its parent's state);
    trees and extends of at most ``SHORT_EXTEND`` tokens run token by token with the decode step.
    ``varlen``: a :class:`~hyla.model.ops.varlen.VarlenPlan` validated once per step (``ForwardBatch.varlen``):
    then nothing is read back from the device (``ckpt_*`` must be None: the plan carries them).
    """
    check_inputs(q, k, v, g, beta, ssm_states)
    chunk_size = chunk_size_for(chunk_size, q.device, accelerator=64)
    scan, varlen = plan_scan(tree, cu_seqlens, q.shape[0], slots, ssm_states, ckpt_seq, ckpt_len, ckpt_slot,
                               q.device, varlen)
    if scan is not None:  # token by token with the decode step (each token from its parent's state)
        terms = _token_terms(q, k, v, g, beta, use_qk_l2norm)  # once for every token, then one update per depth
        return tree_scan(_state_step, terms, ssm_states, slots, scan).to(q.dtype)

    qf, kf = prepare_qk(q, k, v.shape[1], use_qk_l2norm)  # [T, Hv, Dk]
    vf, gf, bf = v.float(), g.float(), beta.float()
    o = chunk_scan_on_pool(lambda layout, plan, state: _chunk_scan(layout, plan, qf, kf, vf, gf, bf, state),
                           varlen, chunk_size, ssm_states, q.device)  # [T, Hv, Dv] fp32
    return o.to(q.dtype)


def _chunk_scan(
    layout: ChunkLayout,
    plan: CheckpointPlan,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 core. Inside a chunk, the UT transform turns the ``Q`` sequential delta updates into
    triangular solves; across chunks, one small recurrence per step over all sequences still active.

    Returns ``(o [T, H, Dv], final state [B, H, Dk, Dv] in rank order, checkpoint states [M, H, Dk, Dv])``.
    """
    Q = layout.chunk_size
    qc, kc, vc = (layout.chunk_heads_first(x) for x in (q, k, v))  # [NC, H, Q, D]
    gc, bc = (layout.chunk_heads_first(x) for x in (g, beta))  # [NC, H, Q]

    cum = gc.cumsum(dim=-1)  # [NC, H, Q] log-decay from the chunk start through each token
    upper = torch.ones(Q, Q, dtype=torch.bool, device=q.device).triu(1)
    decay = decay_exp((cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill_(upper, float("-inf")))  # [NC, H, Q, Q] i>=j
    cum_exp = decay_exp(cum)  # [NC, H, Q]
    k_beta = kc * bc.unsqueeze(-1)  # [NC, H, Q, Dk]
    # the UT transform: (I + A) [u | w] = [beta v | k_beta e^cum], A the strictly lower part of
    # (k_beta k^T) * decay, here built transposed (what solve_unit_lower takes)
    a_t = (kc @ k_beta.transpose(-1, -2)) * decay.transpose(-1, -2)  # [NC, H, Q, Q] = A^T (+ a diagonal, unused)
    u, w = solve_unit_lower(a_t, vc * bc.unsqueeze(-1), k_beta * cum_exp.unsqueeze(-1))  # [NC, H, Q, Dv], [.., Dk]
    attn = (qc @ kc.transpose(-1, -2)) * decay  # [NC, H, Q, Q] intra-chunk q.k, causal incl. diagonal
    q_dec = qc * cum_exp.unsqueeze(-1)  # [NC, H, Q, Dk] reads the state entering the chunk
    k_dec = kc * decay_exp(cum[..., -1:] - cum).unsqueeze(-1)  # [NC, H, Q, Dk] writes the state leaving it
    chunk_decay = cum_exp[..., -1, None, None]  # [NC, H, 1, 1]

    o, enter, ckpt_v_new = delta_rule_across_chunks(layout, plan, state, u, w, q_dec, attn, k_dec, chunk_decay)
    ckpt_states = _states_inside_chunks(plan, cum, kc, enter, ckpt_v_new) if plan.num_checkpoints else enter
    o = layout.unchunk(o.transpose(1, 2))  # [T, H, Dv]
    return o, state, ckpt_states


def solve_unit_lower(a_t: torch.Tensor, *rhs: torch.Tensor) -> list[torch.Tensor]:
    """``X = (I + A)^-1 B`` for each right-hand side ``B [..., Q, D]``: the chunked delta rule's UT
    transform, ``A`` strictly lower triangular, given as ``a_t = A^T [..., Q, Q]`` (only its strictly
    upper part is read; the diagonal is the unit one).

    Solved as the transposed system ``X^T (I + A)^T = B^T`` with every ``B`` in one call: with the
    triangle contiguous in that orientation, LAPACK takes both sides without copying them into
    column-major order, half the time of the left-side solve of ``I + A`` on CPU (8 x 128 tokens
    of the default model: ~2 against ~4 ms a layer)."""
    b = torch.cat(rhs, dim=-1) if len(rhs) > 1 else rhs[0]
    x = torch.linalg.solve_triangular(a_t.contiguous(), b.transpose(-1, -2), upper=True, left=False,
                                      unitriangular=True).transpose(-1, -2)
    return list(x.split([r.shape[-1] for r in rhs], dim=-1))


def delta_rule_across_chunks(
    layout: ChunkLayout,
    plan: CheckpointPlan,
    state: torch.Tensor,
    u: torch.Tensor,
    w: torch.Tensor,
    q_dec: torch.Tensor,
    attn: torch.Tensor,
    k_dec: torch.Tensor,
    chunk_decay: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The recurrence across chunks of the chunked delta rule, Gated DeltaNet's and KDA's alike (they
    differ in how they build the per-chunk terms). With ``S`` the state entering a chunk::

        v_new = u - w S                              # the corrections the chunk's tokens write
        o     = q_dec S + attn v_new
        S    <- chunk_decay * S + k_dec^T v_new

    one step per chunk index over the sequences still active; ``state [B, H, Dk, Dv]`` (rank order) is
    updated in place to the final states. Returns ``(o [NC, H, Q, Dv], enter [M, H, Dk, Dv], v_new [M,
    H, Q, Dv])``: the outputs and, per checkpoint, the state entering its chunk and that chunk's
    corrections (from which the state inside the chunk follows).
    """
    M = plan.num_checkpoints
    enter = state.new_empty(M, *state.shape[1:])  # [M, H, Dk, Dv] state entering each checkpoint's chunk
    ckpt_v_new = u.new_empty(M, *u.shape[1:])  # [M, H, Q, Dv]
    o = torch.empty_like(u)  # [NC, H, Q, Dv]
    for step, (first, active) in enumerate(layout.steps()):
        c = slice(first, first + active)
        S = state[:active]  # [A, H, Dk, Dv]
        v_new = u[c] - w[c] @ S  # [A, H, Q, Dv] the corrections actually written
        o[c] = q_dec[c] @ S + attn[c] @ v_new
        here = plan.at_step(step)
        if here is not None:
            entries, ranks = here
            enter[entries] = S[ranks]
            ckpt_v_new[entries] = v_new[ranks]
        state[:active] = S * chunk_decay[c] + k_dec[c].transpose(-1, -2) @ v_new
    return o, enter, ckpt_v_new


def _states_inside_chunks(
    plan: CheckpointPlan, cum: torch.Tensor, kc: torch.Tensor, enter: torch.Tensor, v_new: torch.Tensor
) -> torch.Tensor:
    """State after the first ``r = plan.within`` tokens of each checkpoint's chunk, exactly as a
    run that stopped there would leave it::

        S_r = exp(cum[r-1]) S_enter + sum_{t<r} exp(cum[r-1] - cum[t]) k_t v_new_t^T

    (``v_new_t`` only depends on tokens ``<= t`` of the chunk, so the full chunk's values serve).
    """
    Q = cum.shape[-1]
    cum_m, k_m = cum[plan.chunk], kc[plan.chunk]  # [M, H, Q], [M, H, Q, Dk]
    last = cum_m.gather(-1, (plan.within - 1).view(-1, 1, 1).expand(-1, cum_m.shape[1], 1))  # [M, H, 1]
    consumed = torch.arange(Q, device=cum.device).view(1, 1, Q) < plan.within.view(-1, 1, 1)  # [M, 1, Q]
    weight = decay_exp((last - cum_m).masked_fill_(~consumed, float("-inf")))  # [M, H, Q]
    return enter * decay_exp(last).unsqueeze(-1) + (k_m * weight.unsqueeze(-1)).transpose(-1, -2) @ v_new


# --- decode ----------------------------------------------------------------------------------


def recurrent_gated_delta_rule_update(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    ssm_states: torch.Tensor,
    slots: torch.Tensor | SlotPlan,
    use_qk_l2norm: bool = True,
) -> torch.Tensor:
    """One decode step for ``B`` sequences: ``q, k [B, Hk, Dk]``, ``v [B, Hv, Dv]``, ``g, beta [B, Hv]``
    -> ``o [B, Hv, Dv]`` (dtype of ``q``). Updates ``ssm_states[slots]`` in place; ``slots[i] == -1``:
    row ``i`` of ``o`` is don't-care and nothing is written. ``slots`` may be a :class:`SlotPlan`
    validated at batch construction (then nothing here reads the device).

    One pass over the old state reads both ``k^T S`` and ``q^T S``; with ``e = exp(g)``::

        delta = beta * (v - e k^T S)        o = e q^T S + (q . k) delta        S <- e S + k delta^T

    which is the reference's ``S <- e S; S <- S + k (beta (v - k^T S))^T; o = q^T S`` regrouped.
    Value heads share their key head's q/k by broadcasting (no repeated copies).
    """
    check_inputs(q, k, v, g, beta, ssm_states)
    plan = as_slot_plan(slots, ssm_states, q.shape[0])
    return _state_step(*_token_terms(q, k, v, g, beta, use_qk_l2norm), ssm_states, plan).to(q.dtype)


def _token_terms(q, k, v, g, beta, use_qk_l2norm: bool) -> tuple[torch.Tensor, ...]:
    """The per-token factors of the decode step (no state involved), fp32, per value head (a key
    head's q/k serve its ``Hv // Hk`` value heads): ``qk [N, Hv, 2, Dk]`` (l2-normalised q then k,
    q scaled by ``Dk**-0.5``), ``decay = exp(g) [N, Hv, 1, 1]``, ``v [N, Hv, Dv]``, ``beta [N, Hv, 1]``,
    ``q . k [N, Hv, 1]``. Each row depends on its own token only, bitwise, whatever ``N`` (a tree step
    computes them once for all its tokens, a decode step for its batch)."""
    n, num_k_heads, dk = q.shape
    num_v_heads = v.shape[1]
    r = num_v_heads // num_k_heads
    qk = torch.stack([q, k], dim=2).float()  # [N, Hk, 2, Dk]: q then k of each key head
    if use_qk_l2norm:
        inv = (qk * qk).sum(dim=-1, keepdim=True).add_(1e-6).rsqrt_()  # [N, Hk, 2, 1] (l2norm)
        inv[:, :, 0].mul_(dk**-0.5)  # fold the q scale in
        qk = qk * inv
    else:
        qk[:, :, 0].mul_(dk**-0.5)
    qk_dot = (qk[:, :, 0] * qk[:, :, 1]).sum(dim=-1, keepdim=True)  # [N, Hk, 1]
    if r > 1:  # one copy per value head, so that each step's matmul is one plain bmm
        qk = qk.unsqueeze(2).expand(n, num_k_heads, r, 2, dk).reshape(n, num_v_heads, 2, dk)
        qk_dot = qk_dot.unsqueeze(2).expand(n, num_k_heads, r, 1).reshape(n, num_v_heads, 1)
    decay = g.float().exp().view(n, num_v_heads, 1, 1)
    return qk, decay, v.float(), beta.float().view(n, num_v_heads, 1), qk_dot


def _state_step(qk, decay, v, beta, qk_dot, ssm_states: torch.Tensor, plan: SlotPlan) -> torch.Tensor:
    """One token per row on the states ``ssm_states[plan]`` (updated in place) from
    :func:`_token_terms` -> fp32 ``o [N, Hv, Dv]``: the decode step's math (short extends and trees
    run it too, through ``tree_scan``, so a verify step computes what decode steps would)."""
    return update_on_pool(_update_, (qk, decay, v, beta, qk_dot), ssm_states, plan)


def _update_(S, qk, decay, v, beta, qk_dot) -> torch.Tensor:
    """The decode step on fp32 states ``S [N, Hv, Dk, Dv]``, updated in place -> ``o [N, Hv, Dv]``."""
    read = torch.matmul(qk, S).mul_(decay)  # [N, Hv, 2, Dv]: e q^T S, e k^T S
    delta = (v - read[:, :, 1]).mul_(beta)  # [N, Hv, Dv]
    o = torch.addcmul(read[:, :, 0], qk_dot, delta)  # [N, Hv, Dv]
    S.mul_(decay).addcmul_(qk[:, :, 1].unsqueeze(-1), delta.unsqueeze(2))  # e S + k delta^T
    return o


def gated_delta_rule_chains(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    ssm_states: torch.Tensor,
    slots: SlotPlan,
    chains: PaddedChains,
    use_qk_l2norm: bool = True,
) -> torch.Tensor:
    """A verify step of chains padded to one width (``chains``: ``varlen.PaddedChains``): ``B``
    sequences, each ``W`` new tokens long once padded; the ``T`` packed tokens ``q, k [T, Hk, Dk]``,
    ``v [T, Hv, Dv]``, ``g, beta [T, Hv]`` at their padded rows ``chains.rows`` -> ``o [T, Hv, Dv]``,
    token by token with the decode step's math, so each token equals a decode step (the tree path's
    result, :func:`tree_scan` over the same chains, bitwise). Padding follows a sequence's tokens
    with zero inputs; its outputs are dropped.

    The state after padded token ``j < W - 1`` of sequence ``i`` goes to
    ``ssm_states[chains.ckpt_rows[i, j]]``, the state after the last to its own slot (after padding,
    if any). Shapes depend on ``B``, ``W`` and ``T`` only and nothing is read on the host, so the step
    compiles to one graph (``ModelRunner``'s compiled verify). Padded trees (``chains.parents``): each
    column continues its parent column's state (``varlen.scan_padded_chains``), the tree path's
    result over the same trees, bitwise."""
    check_inputs(q, k, v, g, beta, ssm_states)
    terms = _token_terms(q, k, v, g, beta, use_qk_l2norm)  # (as the tree path: once, packed)
    return scan_padded_chains(_update_, terms, ssm_states, slots, chains).to(q.dtype)  # [T, Hv, Dv]
