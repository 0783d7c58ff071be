"""Mamba2's selective state space (SSD): chunked scan over packed variable-length sequences and the
single-step decode update, on a state pool.

Per head ``h`` with state ``S [P, N]`` (fp32), scalar ``A[h] < 0`` and ``dt = softplus(dt + dt_bias)``
(optionally clamped to ``dt_limit``)::

    S   <- exp(dt_t A) S + dt_t x_t B_t^T          # x_t [P], B_t [N]
    y_t  = S C_t + D x_t                            # C_t [N]

``B`` and ``C`` have ``G`` groups, repeated over heads (``repeat_interleave(H // G)``). The chunked
path is Hugging Face's ``mamba2_chunk_scan`` (intra-chunk "attention" with a stable segment sum,
chunk states, inter-chunk recurrence, state-to-output); the decode step is HF's
``mamba2_selective_state_update``. HF's Mamba2 mixers clamp ``dt`` to their limit in the
chunked path only and not in decode; both ops take ``dt_limit`` (``None`` = no clamp) and hyla's
mixers pass the config's limit to both, so prefill and decode agree (docs/models.md).

Pool rules (see ``varlen.py``): ``ssm_states [S, H, P, N]`` fp32; ``slots[i] == -1`` starts from zeros
and writes nothing; all reads precede all writes; checkpoint rows are distinct from the batch's own.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

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


def discretize_dt(
    dt: torch.Tensor, dt_bias: torch.Tensor | None, dt_limit: tuple[float, float] | None
) -> torch.Tensor:
    """fp32 ``clamp(softplus(dt + dt_bias), *dt_limit)``; no clamp when ``dt_limit`` is None."""
    dt = dt.float()
    if dt_bias is not None:
        dt = dt + dt_bias.float()
    dt = F.softplus(dt)
    if dt_limit is not None:
        dt = dt.clamp(min=dt_limit[0], max=dt_limit[1])
    return dt


def repeat_groups(t: torch.Tensor, num_heads: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``[N, G, Ns] -> [N, H, Ns]`` in ``dtype``: group ``g`` serves heads ``g*H/G .. (g+1)*H/G - 1``."""
    return t.to(dtype).repeat_interleave(num_heads // t.shape[1], dim=1)


def check_inputs(x, dt, A, B, C, D, dt_bias, ssm_states, dt_limit) -> None:
    """Shapes every SSD op checks on the host (the chunked scan, the decode step, fla's path)."""
    if x.dim() != 3:
        raise ValueError(f"x must be [N, H, P], got {list(x.shape)}")
    n, num_heads, head_dim = x.shape
    if dt.shape != (n, num_heads):
        raise ValueError(f"dt must be [N={n}, H={num_heads}], got {list(dt.shape)}")
    for name, t in (("A", A), ("D", D), ("dt_bias", dt_bias)):
        if t is not None and t.shape != (num_heads,):
            raise ValueError(f"{name} must be [H={num_heads}], got {list(t.shape)}")
    if B.dim() != 3 or B.shape[0] != n or C.shape != B.shape:
        raise ValueError(f"B and C must both be [N={n}, G, Ns], got {list(B.shape)} and {list(C.shape)}")
    if num_heads % B.shape[1]:
        raise ValueError(f"heads ({num_heads}) must be a multiple of groups ({B.shape[1]})")
    state_shape = (num_heads, head_dim, B.shape[2])
    if ssm_states.dim() != 4 or ssm_states.shape[1:] != state_shape:
        raise ValueError(f"ssm_states must be [S, H, P, Ns] = [S, {', '.join(map(str, state_shape))}], "
                         f"got {list(ssm_states.shape)}")
    if dt_limit is not None and (len(dt_limit) != 2 or not dt_limit[0] <= dt_limit[1]):
        raise ValueError(f"dt_limit must be None or (lo, hi) with lo <= hi, got {dt_limit}")


# --- reference -------------------------------------------------------------------------------


def mamba2_ssd_ref(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    state: torch.Tensor | None = None,
    dt_limit: tuple[float, float] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence, token by token: ``x [L, H, P]``, ``dt [L, H]``, ``B, C [L, G, N]``,
    ``state [H, P, N] | None`` -> ``(y [L, H, P] in x's dtype, final state fp32)``.

    The readable oracle for the tests.
    """
    num_heads, head_dim = x.shape[1:]
    dt = discretize_dt(dt, dt_bias, dt_limit)  # [L, H]
    B, C = repeat_groups(B, num_heads), repeat_groups(C, num_heads)  # [L, H, N]
    xf, A = x.float(), A.float()
    S = xf.new_zeros(num_heads, head_dim, B.shape[-1]) if state is None else state.float().clone()  # [H, P, N]
    ys = []
    for t in range(x.shape[0]):
        S = S * (dt[t] * A).exp()[:, None, None] + (dt[t, :, None] * xf[t]).unsqueeze(-1) * B[t].unsqueeze(1)
        y = (S * C[t].unsqueeze(1)).sum(dim=-1)  # [H, P]
        if D is not None:
            y = y + D.float()[:, None] * xf[t]
        ys.append(y)
    y = torch.stack(ys) if ys else xf.new_zeros(0, num_heads, head_dim)
    return y.to(x.dtype), S


# --- chunked prefill -------------------------------------------------------------------------


def mamba2_chunk_scan_varlen(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    cu_seqlens: torch.Tensor,
    ssm_states: torch.Tensor,
    slots: torch.Tensor,
    ckpt_seq: torch.Tensor | None = None,
    ckpt_len: torch.Tensor | None = None,
    ckpt_slot: torch.Tensor | None = None,
    chunk_size: int | None = None,
    dt_limit: tuple[float, float] | None = None,
    tree: TokenTree | TreeScan | None = None,
    varlen: VarlenPlan | None = None,
) -> torch.Tensor:
    """SSD over packed sequences: ``x [T, H, P]``, raw ``dt [T, H]``, ``A [H]``, ``B, C [T, G, N]``,
    ``D, dt_bias [H]`` -> ``y [T, H, P]`` (dtype of ``x``), any sequence lengths.

    Sequence ``i`` starts from ``ssm_states[slots[i]]`` and its final state is written back there;
    for each checkpoint ``j`` the state after ``ckpt_len[j]`` new tokens of sequence ``ckpt_seq[j]``
    is written into ``ssm_states[ckpt_slot[j]]``. Each sequence is chunked from its own first token.
    ``tree``: the new tokens form trees (``ops/tree.py``: each token continues its parent's state);
    trees and extends of at most ``SHORT_EXTEND`` tokens run token by token with the decode step.
    ``varlen``: a :class:`~hyla.model.ops.varlen.VarlenPlan` validated once per step (``ForwardBatch.varlen``):
    then nothing is read back from the device (``ckpt_*`` must be None: the plan carries them).
    """
    check_inputs(x, dt, A, B, C, D, dt_bias, ssm_states, dt_limit)
    chunk_size = chunk_size_for(chunk_size, x.device, accelerator=128)
    scan, varlen = plan_scan(tree, cu_seqlens, x.shape[0], slots, ssm_states, ckpt_seq, ckpt_len, ckpt_slot,
                               x.device, varlen)
    if scan is not None:  # token by token; each token's dt terms computed once, for all of them
        step = lambda x, dtf, decay, B, C, pool, rows: _update_on_pool(x, dtf, decay, B, C, D, pool, rows)  # noqa: E731
        return tree_scan(step, (x, *_dt_terms(dt, A, dt_bias, dt_limit), B, C), ssm_states, slots, scan)

    num_heads = x.shape[1]
    xf, Af = x.float(), A.float()
    dtf = discretize_dt(dt, dt_bias, dt_limit)  # [T, H]
    Bf, Cf = repeat_groups(B, num_heads), repeat_groups(C, num_heads)  # [T, H, N]
    y = chunk_scan_on_pool(lambda layout, plan, state: _chunk_scan(layout, plan, xf, dtf, Af, Bf, Cf, state),
                           varlen, chunk_size, ssm_states, x.device)  # [T, H, P] fp32
    if D is not None:
        y = y + D.float()[:, None] * xf
    return y.to(x.dtype)


def segment_sum(a: torch.Tensor) -> torch.Tensor:
    """``[..., Q] -> [..., Q, Q]`` with ``out[i, j] = a[j+1] + ... + a[i]`` for ``i >= j`` and ``-inf`` above
    the diagonal; summed directly rather than as a difference of cumsums, which loses precision."""
    Q = a.shape[-1]
    ones = torch.ones(Q, Q, dtype=torch.bool, device=a.device)
    terms = a.unsqueeze(-1).expand(*a.shape, Q).masked_fill(~ones.tril(-1), 0)  # [..., Q, Q]: a_i where i > j
    return terms.cumsum(dim=-2).masked_fill(~ones.tril(), float("-inf"))  # sum over j < k <= i


def _chunk_scan(
    layout: ChunkLayout,
    plan: CheckpointPlan,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 core, without the ``D`` skip. Returns ``(y [T, H, P], final state [B, H, P, N] in rank
    order, checkpoint states [M, H, P, N])``."""
    xc, Bc, Cc = (layout.chunk_heads_first(t) for t in (x, B, C))  # [NC, H, Q, P|N]
    dtc = layout.chunk_heads_first(dt)  # [NC, H, Q]; padding has dt = 0: no decay, no input
    xdt = xc * dtc.unsqueeze(-1)  # [NC, H, Q, P]
    a = dtc * A[:, None]  # [NC, H, Q] log-decay of each token
    cum = a.cumsum(dim=-1)  # [NC, H, Q]

    # 1. within chunks: y_diag[i] = sum_{j<=i} (C_i . B_j) exp(a_{j+1} + ... + a_i) dt_j x_j
    L = decay_exp(segment_sum(a))  # [NC, H, Q, Q]
    y = ((Cc @ Bc.transpose(-1, -2)) * L) @ xdt  # [NC, H, Q, P]

    # 2. each chunk's own contribution to the state leaving it
    to_end = decay_exp(cum[..., -1:] - cum)  # [NC, H, Q]
    chunk_states = xdt.transpose(-1, -2) @ (Bc * to_end.unsqueeze(-1))  # [NC, H, P, N]
    cum_exp = decay_exp(cum)  # [NC, H, Q]
    chunk_decay = cum_exp[..., -1, None, None]  # [NC, H, 1, 1]

    # 3. across chunks: the state entering every chunk, one step per chunk index
    enter = torch.empty_like(chunk_states)  # [NC, H, P, N]
    for first, active in layout.steps():
        c = slice(first, first + active)
        enter[c] = state[:active]
        state[:active] = state[:active] * chunk_decay[c] + chunk_states[c]

    # 4. the entering state read out through C
    y = y + (Cc @ enter.transpose(-1, -2)) * cum_exp.unsqueeze(-1)  # [NC, H, Q, P]
    ckpt_states = _states_inside_chunks(plan, cum, xdt, Bc, enter) if plan.num_checkpoints else enter[:0]
    return layout.unchunk(y.transpose(1, 2)), state, ckpt_states


def _states_inside_chunks(
    plan: CheckpointPlan, cum: torch.Tensor, xdt: torch.Tensor, Bc: torch.Tensor, enter: torch.Tensor
) -> torch.Tensor:
    """State after the first ``r = plan.within`` tokens of each checkpoint's chunk, exactly as a
    run that stopped there would leave it::

        S_r = exp(cum[r-1]) S_enter + sum_{t<r} exp(cum[r-1] - cum[t]) dt_t x_t B_t^T
    """
    Q = cum.shape[-1]
    cum_m = cum[plan.chunk]  # [M, H, Q]
    last = cum_m.gather(-1, (plan.within - 1).view(-1, 1, 1).expand(-1, cum_m.shape[1], 1))  # [M, H, 1]
    consumed = torch.arange(Q, device=cum.device).view(1, 1, Q) < plan.within.view(-1, 1, 1)  # [M, 1, Q]
    weight = decay_exp((last - cum_m).masked_fill_(~consumed, float("-inf")))  # [M, H, Q]
    inside = xdt[plan.chunk].transpose(-1, -2) @ (Bc[plan.chunk] * weight.unsqueeze(-1))  # [M, H, P, N]
    return enter[plan.chunk] * decay_exp(last).unsqueeze(-1) + inside


# --- decode ----------------------------------------------------------------------------------


def mamba2_state_update(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    ssm_states: torch.Tensor,
    slots: torch.Tensor | SlotPlan,
    dt_limit: tuple[float, float] | None = None,
) -> torch.Tensor:
    """One decode step for ``B`` sequences: ``x [B, H, P]``, raw ``dt [B, H]``, ``B, C [B, G, N]``
    -> ``y [B, H, P]`` (dtype of ``x``). Updates ``ssm_states[slots]`` in place; ``slots[i] == -1``:
    row ``i`` of ``y`` is don't-care and nothing is written. ``slots`` may be a :class:`SlotPlan`
    validated at batch construction (then nothing here reads the device). ``dt_limit=None``: no
    clamp (HF's ``selective_state_update``); hyla's NemotronH passes its limit, as to the chunked
    op (docs/models.md).

    Heads are grouped under their B/C group and broadcast against it (no repeated copies).
    """
    check_inputs(x, dt, A, B, C, D, dt_bias, ssm_states, dt_limit)
    return _update_on_pool(x, *_dt_terms(dt, A, dt_bias, dt_limit), B, C, D, ssm_states, slots)


def _dt_terms(dt: torch.Tensor, A: torch.Tensor, dt_bias: torch.Tensor | None,
              dt_limit: tuple[float, float] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's discretized ``dt`` and decay ``exp(dt A)``, ``[N, H]`` fp32. Computed once for all the
    tokens an op scans (``exp`` and ``softplus`` may round a vector's tail otherwise than its body), so
    that the tree scan and the padded chains see the same numbers."""
    dtf = discretize_dt(dt, dt_bias, dt_limit)
    return dtf, (dtf * A.float()).exp_()


def _update_on_pool(x: torch.Tensor, dtf: torch.Tensor, decay: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                    D: torch.Tensor | None, pool: torch.Tensor, slots: torch.Tensor | SlotPlan) -> torch.Tensor:
    """:func:`_step_` on the pool rows of ``slots`` (in place where they are one run, else read and
    written back) -> ``y`` in x's dtype."""
    plan = as_slot_plan(slots, pool, x.shape[0])
    return update_on_pool(functools.partial(_step_, D=D), (x, dtf, decay, B, C), pool, plan).to(x.dtype)


def _step_(S: torch.Tensor, x: torch.Tensor, dtf: torch.Tensor, decay: torch.Tensor, B: torch.Tensor,
           C: torch.Tensor, D: torch.Tensor | None) -> torch.Tensor:
    """The decode update of fp32 states ``S [B, H, P, N]`` in place, one token a row (``x [B, H, P]``,
    ``dtf, decay [B, H]`` (:func:`_dt_terms`), ``B, C [B, G, N]``) -> fp32 ``y [B, H, P]``: products and
    sums alone, so each row's numbers are its own whatever ``B`` (the tree scan and the padded chains
    agree bitwise)."""
    b, num_heads, head_dim = x.shape
    groups, n = B.shape[1:]
    h = num_heads // groups  # heads per group
    xf = x.float()
    S5 = S.view(b, groups, h, head_dim, n)
    decay = decay.view(b, groups, h, 1, 1)  # [B, G, h, 1, 1]
    x_dt = (xf * dtf.unsqueeze(-1)).view(b, groups, h, head_dim, 1)  # [B, G, h, P, 1]
    S5.mul_(decay).addcmul_(x_dt, B.float().view(b, groups, 1, 1, n))  # exp(dt A) S + dt x B^T
    y = torch.matmul(S5, C.float().view(b, groups, 1, n, 1)).view(b, num_heads, head_dim)  # [B, H, P]: S C
    if D is not None:
        y = y.addcmul_(D.float().view(1, num_heads, 1), xf)
    return y


def mamba2_chains(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    ssm_states: torch.Tensor,
    slots: SlotPlan,
    chains: PaddedChains,
    dt_limit: tuple[float, float] | None = None,
) -> torch.Tensor:
    """A verify step of chains (or trees) padded to one width (``chains``: ``varlen.PaddedChains``;
    ``gated_delta.gated_delta_rule_chains``' contract): the packed tokens of ``x [T, H, P]``, raw
    ``dt [T, H]``, ``B, C [T, G, N]`` -> ``y [T, H, P]``, token by token with the decode step's
    arithmetic (the tree path's result, bitwise). The state after padded token ``j < W - 1`` of
    sequence ``i`` goes to ``ssm_states[chains.ckpt_rows[i, j]]``, after the last to its own slot;
    nothing is read on the host, so the step compiles to one graph."""
    check_inputs(x, dt, A, B, C, D, dt_bias, ssm_states, dt_limit)
    terms = (x, *_dt_terms(dt, A, dt_bias, dt_limit), B, C)  # (padding: zeros, decay 0)
    return scan_padded_chains(functools.partial(_step_, D=D), terms, ssm_states, slots, chains).to(x.dtype)  # [T, H, P]
