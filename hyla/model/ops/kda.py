"""Kimi Delta Attention (KDA, Kimi-Linear): the gated delta rule with a *per-channel* decay, as
chunked prefill over packed variable-length sequences and the recurrent decode step, on a state pool.

Per value head, with state ``S [Dk, Dv]`` (fp32), log-decay ``g_t [Dk] <= 0`` (one per key channel,
where Gated DeltaNet has one scalar per head) and ``beta_t in (0, 1)``::

    S   <- diag(exp(g_t)) S                          # row d of S decays by exp(g_t[d])
    S   <- S + k_t (beta_t * (v_t - k_t^T S))^T      # delta rule: write only the correction
    o_t  = q_t^T S

``q, k`` are l2-normalised (eps 1e-6), ``q`` is scaled by ``Dk**-0.5`` and, as in
``gated_delta.py``, key head ``h`` serves value heads ``h*r .. h*r + r-1`` (``r = Hv // Hk``;
Kimi-Linear has ``Hk == Hv``). Everything runs in fp32 and ``o`` comes back in the dtype of ``q``.
This is transformers' ``recurrent_kimi_delta_attention`` (FLA's ``fused_recurrent_kda``);
:func:`kda_ref` is the token-by-token oracle.

The chunked form (:func:`chunk_kda_varlen`) is the chunkwise algorithm of Gated DeltaNet's
``_chunk_scan`` (UT transform per chunk, then one small recurrence per chunk step) with the decay
moved inside the key dimension. With ``G_t = cumsum(g)`` from the chunk start (per channel)::

    A_ts  = sum_d k_t[d] k_s[d] exp(G_t[d] - G_s[d])        s < t   (key-key, the UT transform)
    P_ts  = sum_d q_t[d] k_s[d] exp(G_t[d] - G_s[d])        s <= t  (query-key, intra-chunk output)

Unlike GDN, a per-channel decay does not factor out of the dot product, and factoring it as
``(k_t e^{G_t}) . (k_s e^{-G_s})`` overflows for strong decays. As in FLA's KDA kernel, ``A`` and ``P``
are built per sub-chunk of 16 rows: blocks below the diagonal factor through the decay at the
later block's first row (both factors ``<= 1``, one matmul per block row), the diagonal blocks are
built column by column from the exact differences ``G_t - G_s <= 0``. No ``exp`` ever sees a positive
number, whatever the decay strength.

Pool rules (see ``varlen.py``): ``ssm_states [S, Hv, Dk, Dv]`` fp32; ``slots[i] == -1`` starts from
zeros and writes nothing; all reads precede all writes; checkpoint rows are distinct from the
batch's own rows; a checkpoint may fall at any token.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

from hyla.model.ops.gated_delta import check_inputs, delta_rule_across_chunks, prepare_qk, solve_unit_lower
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


class DecayGate(NamedTuple):
    """How a KDA layer's per-channel log-decay ``g [T, H, D] <= 0`` comes from its raw input ``f [T, H*D]``
    (with ``x = f + dt_bias`` in fp32): Kimi-Linear's ``-exp(A_log) * softplus(x)`` (transformers'
    ``log(1 + exp(x))`` form, ``x`` above 20, fp32), or with ``lower_bound < 0`` Ling 3's bounded
    ``lower_bound * sigmoid(exp(A_log) * x)``, in ``[lower_bound, 0]``. ``rounded`` (Ling 3, both forms):
    ``F.softplus``, and ``g`` rounded to ``f``'s dtype, as transformers' ``BailingHybridForgetGate`` returns
    it. The fused kernels (``ops/gpu/kda_decode.py``) take both as compile-time constants."""

    lower_bound: float = 0.0
    rounded: bool = False

    def check(self, what: str = "the decay's lower bound") -> "DecayGate":
        """``self``; ``ValueError`` naming ``what`` unless the bound is finite and ``<= 0``."""
        if not (self.lower_bound <= 0.0 and math.isfinite(self.lower_bound)):
            raise ValueError(f"{what} must be finite and <= 0 (0: softplus), got {self.lower_bound}")
        return self

    def __call__(self, f: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor, heads: int) -> torch.Tensor:
        t = f.shape[0]
        x = (f.float() + dt_bias).view(t, heads, -1)
        rate = torch.exp(a_log.float())[:, None]  # [H, 1]
        if self.lower_bound:
            g = self.lower_bound * torch.sigmoid(rate * x)
        elif self.rounded:
            g = -rate * F.softplus(x)
        else:
            g = -rate * torch.where(x > 20.0, x, torch.log(1.0 + torch.exp(x)))  # transformers' Kimi form, exactly
        return g.to(f.dtype).float() if self.rounded else g


_SUB_CHUNK = 16  # rows per sub-chunk of the intra-chunk products (see _intra_chunk)


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dim (FLA's and transformers' definition)."""
    return x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _prepare_qk(q: torch.Tensor, k: torch.Tensor, num_v_heads: int, use_qk_l2norm: bool):
    """Gated DeltaNet's :func:`~hyla.model.ops.gated_delta.prepare_qk` with transformers' KDA l2norm."""
    return prepare_qk(q, k, num_v_heads, use_qk_l2norm, norm=_l2norm)


# --- reference -------------------------------------------------------------------------------


def kda_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor | None = None,
    use_qk_l2norm: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence, token by token: ``q, k [L, Hk, Dk]``, ``v [L, Hv, Dv]``, ``g [L, Hv, Dk]``,
    ``beta [L, Hv]``, ``state [Hv, Dk, Dv] | None`` -> ``(o [L, Hv, Dv] in q's dtype, final state fp32)``.

    The readable oracle for the tests.
    """
    dtype, (num_v_heads, dv) = q.dtype, v.shape[1:]
    q, k = _prepare_qk(q, k, num_v_heads, use_qk_l2norm)  # [L, Hv, Dk]
    v, g, beta = v.float(), g.float(), beta.float()
    S = v.new_zeros(num_v_heads, q.shape[-1], dv) if state is None else state.float().clone()  # [Hv, Dk, Dv]
    out = []
    for t in range(q.shape[0]):
        S = S * g[t].exp().unsqueeze(-1)  # [Hv, Dk, Dv]: row d decays by exp(g_t[d])
        predicted = (k[t].unsqueeze(-1) * S).sum(dim=1)  # [Hv, Dv]: k_t^T S
        delta = (v[t] - predicted) * beta[t].unsqueeze(-1)  # [Hv, Dv]
        S = S + k[t].unsqueeze(-1) * delta.unsqueeze(1)  # [Hv, Dk, Dv]
        out.append((q[t].unsqueeze(-1) * S).sum(dim=1))  # [Hv, Dv]: q_t^T S
    o = torch.stack(out) if out else v.new_zeros(0, num_v_heads, dv)
    return o.to(dtype), S


# --- chunked prefill -------------------------------------------------------------------------


def chunk_kda_varlen(
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
    """KDA over packed sequences: ``q, k [T, Hk, Dk]``, ``v [T, Hv, Dv]``, ``g [T, Hv, Dk]``,
    ``beta [T, Hv]`` -> ``o [T, Hv, Dv]`` (dtype of ``q``).

    Sequence ``i`` starts from ``ssm_states[slots[i]]`` and its final state is written back there;
    for each checkpoint ``j`` the state after ``ckpt_len[j]`` new tokens of sequence ``ckpt_seq[j]``
    is written into ``ssm_states[ckpt_slot[j]]``. Each sequence is chunked from its own first token.
    ``tree``: the new tokens form trees (``ops/tree.py``: each token continues its parent's state);
    trees and extends of at most ``SHORT_EXTEND`` tokens run token by token with the decode step.
    ``varlen``: a :class:`~hyla.model.ops.varlen.VarlenPlan` validated once per step (``ForwardBatch.varlen``):
    then nothing is read back from the device (``ckpt_*`` must be None: the plan carries them).
    """
    check_inputs(q, k, v, g, beta, ssm_states, decay_per_channel=True)
    chunk_size = chunk_size_for(chunk_size, q.device, accelerator=64)
    scan, varlen = plan_scan(tree, cu_seqlens, q.shape[0], slots, ssm_states, ckpt_seq, ckpt_len, ckpt_slot,
                               q.device, varlen)
    if scan is not None:  # token by token with the decode step; each token's terms computed once, for all of them
        terms = _token_terms(q, k, v, g, beta, use_qk_l2norm)
        return tree_scan(_state_step, terms, ssm_states, slots, scan).to(q.dtype)

    qf, kf = _prepare_qk(q, k, v.shape[1], use_qk_l2norm)  # [T, Hv, Dk]
    vf, gf, bf = v.float(), g.float(), beta.float()
    o = chunk_scan_on_pool(lambda layout, plan, state: _chunk_scan(layout, plan, qf, kf, vf, gf, bf, state),
                           varlen, chunk_size, ssm_states, q.device)  # [T, Hv, Dv] fp32
    return o.to(q.dtype)


def _intra_chunk(qc: torch.Tensor, kc: torch.Tensor, cum: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``A [NC, H, Q, Q]`` (key-key, strictly lower) and ``P [NC, H, Q, Q]`` (query-key, lower with
    the diagonal) of every chunk, without ever exponentiating a positive number.

    The chunk is cut into sub-chunks of ``C`` rows. A block of rows ``I`` against earlier columns
    factors through the decay at the block's first row ``r`` (``s < r <= t``, both factors ``<= 1``)::

        A_ts = (k_t e^{cum_t - cum_r}) . (k_s e^{cum_r - cum_s})        (one matmul per block row)

    Inside a diagonal block, columns ``s`` are built one at a time from the exact differences
    ``cum_t - cum_s <= 0`` of rows ``t >= s`` (``C`` vectorised steps over every block of the batch).
    """
    nc, h, Q, dk = kc.shape
    C = _SUB_CHUNK if Q % _SUB_CHUNK == 0 else Q
    n = Q // C
    A = kc.new_zeros(nc, h, Q, Q)
    P = kc.new_zeros(nc, h, Q, Q)
    for i in range(1, n):  # rows of sub-chunk i against the columns of sub-chunks 0 .. i-1
        rows, ref = slice(i * C, (i + 1) * C), cum[:, :, i * C : i * C + 1]  # ref [NC, H, 1, Dk]
        down = decay_exp(cum[:, :, rows] - ref)  # [NC, H, C, Dk]
        cols = kc[:, :, : i * C] * decay_exp(ref - cum[:, :, : i * C])  # [NC, H, iC, Dk]
        A[:, :, rows, : i * C] = (kc[:, :, rows] * down) @ cols.transpose(-1, -2)
        P[:, :, rows, : i * C] = (qc[:, :, rows] * down) @ cols.transpose(-1, -2)
    qb, kb, cb = (x.view(nc, h, n, C, dk) for x in (qc, kc, cum))  # sub-chunks
    Ab, Pb = kc.new_zeros(nc, h, n, C, C), kc.new_zeros(nc, h, n, C, C)
    for s in range(C):  # the diagonal blocks, column s of each
        k_s = kb[..., s : s + 1, :] * decay_exp(cb[..., s:, :] - cb[..., s : s + 1, :])  # [NC, H, n, C-s, Dk]
        Ab[..., s + 1 :, s] = (kb[..., s + 1 :, :] * k_s[..., 1:, :]).sum(dim=-1)
        Pb[..., s:, s] = (qb[..., s:, :] * k_s).sum(dim=-1)
    for i in range(n):
        block = slice(i * C, (i + 1) * C)
        A[:, :, block, block] = Ab[:, :, i]
        P[:, :, block, block] = Pb[:, :, i]
    return A, P


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
    """fp32 core: the UT transform turns each chunk's ``Q`` sequential delta updates into triangular
    solves; across chunks, one small recurrence per step over all sequences still active.

    Returns ``(o [T, H, Dv], final state [B, H, Dk, Dv] in rank order, checkpoint states [M, H, Dk, Dv])``.
    """
    qc, kc, vc, gc = (layout.chunk_heads_first(x) for x in (q, k, v, g))  # [NC, H, Q, D]
    bc = layout.chunk_heads_first(beta).unsqueeze(-1)  # [NC, H, Q, 1]

    cum = gc.cumsum(dim=-2)  # [NC, H, Q, Dk] log-decay from the chunk start through each token, per channel
    A, P = _intra_chunk(qc, kc, cum)  # [NC, H, Q, Q] each
    # (I + diag(beta) A) u = beta v  and  (I + diag(beta) A) w = beta k e^{cum}: then the corrections
    # written into the state entering the chunk S are  v_new = u - w S.
    cum_exp = decay_exp(cum)  # [NC, H, Q, Dk]
    u, w = solve_unit_lower((A * bc).transpose(-1, -2), vc * bc, kc * bc * cum_exp)  # [NC, H, Q, Dv], [.., Dk]
    q_dec = qc * cum_exp  # [NC, H, Q, Dk] reads the state entering the chunk
    k_dec = kc * decay_exp(cum[:, :, -1:] - cum)  # [NC, H, Q, Dk] writes the state leaving it
    chunk_decay = cum_exp[:, :, -1].unsqueeze(-1)  # [NC, H, Dk, 1]

    # across chunks: Gated DeltaNet's recurrence, the per-channel decay inside chunk_decay and k_dec
    o, enter, ckpt_v_new = delta_rule_across_chunks(layout, plan, state, u, w, q_dec, P, k_dec, chunk_decay)
    ckpt_states = _states_inside_chunks(plan, cum, kc, enter, ckpt_v_new) if plan.num_checkpoints else enter
    o = layout.unchunk(o.transpose(1, 2))  # [T, H, Dv]
    return o, state, ckpt_states


def _states_inside_chunks(
    plan: CheckpointPlan, cum: torch.Tensor, kc: torch.Tensor, enter: torch.Tensor, v_new: torch.Tensor
) -> torch.Tensor:
    """State after the first ``r = plan.within`` tokens of each checkpoint's chunk, exactly as a
    run that stopped there would leave it (per channel ``d``)::

        S_r[d] = exp(cum[r-1, d]) S_enter[d] + sum_{t<r} exp(cum[r-1, d] - cum[t, d]) k_t[d] v_new_t^T

    (``v_new_t`` only depends on tokens ``<= t`` of the chunk, so the full chunk's values serve).
    """
    Q, dk = cum.shape[-2:]
    cum_m, k_m = cum[plan.chunk], kc[plan.chunk]  # [M, H, Q, Dk] each
    index = (plan.within - 1).view(-1, 1, 1, 1).expand(-1, cum_m.shape[1], 1, dk)
    last = cum_m.gather(2, index)  # [M, H, 1, Dk]
    consumed = torch.arange(Q, device=cum.device).view(1, 1, Q, 1) < plan.within.view(-1, 1, 1, 1)  # [M, 1, Q, 1]
    weight = decay_exp((last - cum_m).masked_fill_(~consumed, float("-inf")))  # [M, H, Q, Dk]
    return enter * decay_exp(last.transpose(-1, -2)) + (k_m * weight).transpose(-1, -2) @ v_new


# --- decode ----------------------------------------------------------------------------------


def recurrent_kda_update(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    ssm_states: torch.Tensor,
    slots: torch.Tensor | SlotPlan,
    use_qk_l2norm: bool = True,
) -> torch.Tensor:
    """One decode step for ``B`` sequences: ``q, k [B, Hk, Dk]``, ``v [B, Hv, Dv]``, ``g [B, Hv, Dk]``,
    ``beta [B, Hv]`` -> ``o [B, Hv, Dv]`` (dtype of ``q``). Updates ``ssm_states[slots]`` in place;
    ``slots[i] == -1``: row ``i`` of ``o`` is don't-care and nothing is written. ``slots`` may be a
    :class:`SlotPlan` validated at batch construction (then nothing here reads the device).
    """
    check_inputs(q, k, v, g, beta, ssm_states, decay_per_channel=True)
    plan = as_slot_plan(slots, ssm_states, q.shape[0])
    return _state_step(*_token_terms(q, k, v, g, beta, use_qk_l2norm), ssm_states, plan).to(q.dtype)


def _token_terms(q, k, v, g, beta, use_qk_l2norm: bool) -> tuple[torch.Tensor, ...]:
    """The per-token factors of the decode step (no state involved), fp32, per value head: ``q, k [N, Hv, Dk]``
    (l2-normalised, q scaled), ``decay = exp(g) [N, Hv, Dk, 1]``, ``v [N, Hv, Dv]``, ``beta [N, Hv, 1]``.
    Computed once for all the tokens an op scans (a tree step's, a padded chain's, a decode step's batch),
    so that the tree scan and the padded chains see the same numbers."""
    qf, kf = _prepare_qk(q, k, v.shape[1], use_qk_l2norm)  # [N, Hv, Dk]
    return qf, kf, g.float().exp().unsqueeze(-1), v.float(), beta.float().unsqueeze(-1)


def _state_step(q, k, decay, v, beta, ssm_states: torch.Tensor, plan: SlotPlan) -> torch.Tensor:
    """One token per row on the states ``ssm_states[plan]`` (updated in place) from :func:`_token_terms`
    -> fp32 ``o [N, Hv, Dv]``: the decode step's math (trees and short extends run it through ``tree_scan``)."""
    return update_on_pool(_update_, (q, k, decay, v, beta), ssm_states, plan)


def _update_(S, q, k, decay, v, beta) -> torch.Tensor:
    """The decode step on fp32 states ``S [N, Hv, Dk, Dv]``, updated in place -> ``o [N, Hv, Dv]``: row ``d``
    of each state decays by ``exp(g[d])``, then the delta rule. Products and sums alone, each row its own."""
    S.mul_(decay)
    predicted = (k.unsqueeze(-2) @ S).squeeze(-2)  # [N, Hv, Dv]: k^T S
    delta = (v - predicted) * beta  # [N, Hv, Dv]
    dk, dv = S.shape[-2:]
    S.view(-1, dk, dv).baddbmm_(k.reshape(-1, dk, 1), delta.reshape(-1, 1, dv))  # S += k delta^T
    return (q.unsqueeze(-2) @ S).squeeze(-2)  # [N, Hv, Dv]: q^T S


def kda_chains(
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
    """A verify step of chains (or trees) padded to one width (``chains``: ``varlen.PaddedChains``;
    ``gated_delta.gated_delta_rule_chains``' contract): the packed tokens ``q, k [T, Hk, Dk]``,
    ``v [T, Hv, Dv]``, ``g [T, Hv, Dk]``, ``beta [T, Hv]`` -> ``o [T, Hv, Dv]``, token by token with the
    decode step's math (the tree path's result, bitwise). The state after padded token ``j < W - 1`` of
    sequence ``i`` goes to ``ssm_states[chains.ckpt_rows[i, j]]``, after the last to its own slot;
    nothing is read on the host, so the step compiles to one graph. Padding rows are zeros (decay 0 too)."""
    check_inputs(q, k, v, g, beta, ssm_states, decay_per_channel=True)
    terms = _token_terms(q, k, v, g, beta, use_qk_l2norm)
    return scan_padded_chains(_update_, terms, ssm_states, slots, chains).to(q.dtype)  # [T, Hv, Dv]
