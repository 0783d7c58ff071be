"""Mamba1's selective scan (Jamba's SSM layers): the decode update and the extend over packed
variable-length sequences, on a state pool.

Per channel ``d`` (``I`` of them) with state ``h_d [N]`` (fp32), a decay per channel *and state*
``A [I, N] < 0`` and a step ``dt = softplus(dt + dt_bias)`` per channel::

    h_d <- exp(dt_d A_d) * h_d + dt_d x_d B_t        # B_t [N]: shared by every channel
    y_d  = h_d . C_t + D_d x_d                        # C_t [N]

(Hugging Face's ``mamba_selective_state_update`` and ``mamba_selective_scan``; the gate
``y * silu(z)`` is the layer's.) Unlike Mamba2 (``ssd.py``), whose decay is one scalar per head,
the decay varies along the state, so SSD's matrix form (a ``[Q, Q]`` decay per head) would be a
``[Q, Q, I, N]`` tensor here. Two paths instead:

* short extends (at most ``tree.SHORT_EXTEND`` tokens a sequence: verify steps, a cached prompt's
  few new tokens) and token trees run token by token with the decode update (``tree.tree_scan``),
  the decode step's arithmetic, each token's softplus and ``exp`` computed once for all the tokens
  (bitwise the padded chains' :func:`selective_scan_chains`; a decode batch's vectors may round
  those by an ulp otherwise);
* longer extends run in chunks of ``Q`` tokens (``varlen.chunk_scan_on_pool``: chunks per sequence,
  checkpoints anywhere): inside a chunk, a parallel prefix scan (Hillis-Steele, ``log2(Q)`` rounds)
  of the pairs ``(a_t, b_t) = (exp(dt_t A), dt_t x_t B_t)`` under ``(a, b) o (a', b') = (a a', a' b +
  b')`` gives every position's decay product and state from zero, then ``h_t = a_t h_0 + b_t`` from
  the state entering the chunk — products of decays only (no ``exp(-cumsum)``, which overflows), so
  it equals the token loop up to fp32 rounding. ``Q`` tokens cost ``O(log Q)`` operations on
  ``[Q, I, N]`` instead of ``Q`` on ``[I, N]``: fewer, larger operations (what a GPU and a small CPU
  model need; see docs/benchmarks.md, "Model forward").

Pool rules (``varlen.py``): ``ssm_states [S, I, N]`` fp32; ``slots[i] == -1`` starts from zeros and
writes nothing; all reads precede all writes; checkpoint rows are distinct from the batch's own.
"""

from __future__ import annotations

import functools

import torch

from hyla.model.ops.ssd import discretize_dt
from hyla.model.ops.tree import TokenTree, TreeScan, plan_scan, tree_scan
from hyla.model.ops.varlen import (
    CheckpointPlan,
    ChunkLayout,
    PaddedChains,
    SlotPlan,
    VarlenPlan,
    as_slot_plan,
    chunk_scan_on_pool,
    scan_padded_chains,
    update_on_pool,
)


def check_inputs(x, dt, A, B, C, D, dt_bias, ssm_states) -> None:
    """Shapes every selective-scan op checks on the host."""
    if x.dim() != 2:
        raise ValueError(f"x must be [T, I], got {list(x.shape)}")
    t, channels = x.shape
    if dt.shape != x.shape:
        raise ValueError(f"dt must be [T={t}, I={channels}], got {list(dt.shape)}")
    if A.dim() != 2 or A.shape[0] != channels:
        raise ValueError(f"A must be [I={channels}, N], got {list(A.shape)}")
    n = A.shape[1]
    if B.shape != (t, n) or C.shape != (t, n):
        raise ValueError(f"B and C must both be [T={t}, N={n}], got {list(B.shape)} and {list(C.shape)}")
    for name, v in (("D", D), ("dt_bias", dt_bias)):
        if v is not None and v.shape != (channels,):
            raise ValueError(f"{name} must be [I={channels}], got {list(v.shape)}")
    if ssm_states.dim() != 3 or ssm_states.shape[1:] != (channels, n):
        raise ValueError(f"ssm_states must be [S, I, N] = [S, {channels}, {n}], got {list(ssm_states.shape)}")


def selective_scan_ref(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                       D: torch.Tensor | None, dt_bias: torch.Tensor | None,
                       state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence, token by token, written as the formula: ``x, dt [L, I]``, ``B, C [L, N]``,
    ``state [I, N] | None`` -> ``(y [L, I] in x's dtype, final state fp32)``. The tests' oracle."""
    dt = discretize_dt(dt, dt_bias, None)  # [L, I]
    xf, A = x.float(), A.float()
    h = xf.new_zeros(A.shape) if state is None else state.float().clone()  # [I, N]
    ys = []
    for t in range(x.shape[0]):
        h = torch.exp(dt[t, :, None] * A) * h + (dt[t] * xf[t])[:, None] * B[t].float()[None, :]
        y = h @ C[t].float()  # [I]
        ys.append(y if D is None else y + D.float() * xf[t])
    y = torch.stack(ys) if ys else xf.new_zeros(0, x.shape[1])
    return y.to(x.dtype), h


def selective_state_update(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                           D: torch.Tensor | None, dt_bias: torch.Tensor | None, ssm_states: torch.Tensor,
                           slots: torch.Tensor | SlotPlan) -> torch.Tensor:
    """One decode step for ``B`` sequences: ``x``, raw ``dt [B, I]``, ``B, C [B, N]`` -> ``y [B, I]``
    (dtype of ``x``). Updates ``ssm_states[slots]`` in place; ``slots[i] == -1``: row ``i`` of ``y``
    is don't-care and nothing is written. ``slots`` may be a :class:`SlotPlan` validated at batch
    construction (then nothing here reads the device)."""
    check_inputs(x, dt, A, B, C, D, dt_bias, ssm_states)
    return _update_on_pool(x, *_dt_terms(dt, A, dt_bias), B, C, D, ssm_states, slots)


def _dt_terms(dt: torch.Tensor, A: torch.Tensor, dt_bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's discretized ``dt [n, I]`` and decay ``exp(dt A) [n, I, N]``, fp32. Computed once for all
    the tokens an op scans (``exp`` and ``softplus`` may round a vector's tail otherwise than its body), so
    that the tree scan and the padded chains see the same numbers (``ssd._dt_terms``, per channel and state)."""
    dtf = discretize_dt(dt, dt_bias, None)
    return dtf, (dtf.unsqueeze(-1) * A.float()).exp_()


def _update_on_pool(x: torch.Tensor, dtf: torch.Tensor, decay: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                    D: torch.Tensor | None, pool: torch.Tensor, slots: torch.Tensor | SlotPlan) -> torch.Tensor:
    """:func:`_step_` on the pool rows of ``slots`` (in place where they are one run, else read and
    written back) -> ``y`` in x's dtype."""
    plan = as_slot_plan(slots, pool, x.shape[0])
    return update_on_pool(functools.partial(_step_, D=D), (x, dtf, decay, B, C), pool, plan).to(x.dtype)


def _step_(h: torch.Tensor, x: torch.Tensor, dtf: torch.Tensor, decay: torch.Tensor, B: torch.Tensor,
           C: torch.Tensor, D: torch.Tensor | None) -> torch.Tensor:
    """The decode update of fp32 states ``h [B, I, N]`` in place, one token a row (``x [B, I]``, ``dtf [B, I]``
    and ``decay [B, I, N]`` (:func:`_dt_terms`), ``B, C [B, N]``) -> fp32 ``y [B, I]``: products and sums
    alone, so each row's numbers are its own whatever ``B`` (the tree scan and the padded chains agree
    bitwise)."""
    xf = x.float()
    h.mul_(decay).addcmul_((dtf * xf).unsqueeze(-1), B.float().unsqueeze(1))  # exp(dt A) h + dt x B
    y = (h * C.float().unsqueeze(1)).sum(-1)  # [B, I]: h C (not a matmul: a batch of one row rounds otherwise)
    if D is not None:
        y = y.addcmul_(D.float(), xf)
    return y


def selective_scan_chains(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                          D: torch.Tensor | None, dt_bias: torch.Tensor | None, ssm_states: torch.Tensor,
                          slots: SlotPlan, chains: PaddedChains) -> torch.Tensor:
    """A verify step of chains (or trees) padded to one width (``chains``: ``varlen.PaddedChains``;
    ``gated_delta.gated_delta_rule_chains``' contract): the packed tokens of ``x``, raw ``dt [T, I]``,
    ``B, C [T, N]`` -> ``y [T, I]``, token by token with the decode step's arithmetic (the tree path's
    result, bitwise). The state after padded token ``j < W - 1`` of sequence ``i`` goes to
    ``ssm_states[chains.ckpt_rows[i, j]]``, after the last to its own slot; nothing is read on the host,
    so the step compiles to one graph."""
    check_inputs(x, dt, A, B, C, D, dt_bias, ssm_states)
    terms = (x, *_dt_terms(dt, A, dt_bias), B, C)  # (padding: zeros, decay 0)
    return scan_padded_chains(functools.partial(_step_, D=D), terms, ssm_states, slots, chains).to(x.dtype)  # [T, I]


CHUNK = 16
"""Tokens per chunk of the chunked path (its ``[Q, I, N]`` rounds per active sequence: Jamba-1.5-Mini's
8192 x 16 states, 16 tokens: 8 MiB a tensor)."""


def selective_scan_varlen(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                          D: torch.Tensor | None, dt_bias: torch.Tensor | None, cu_seqlens: torch.Tensor,
                          ssm_states: torch.Tensor, slots: torch.Tensor,
                          ckpt_seq: torch.Tensor | None = None, ckpt_len: torch.Tensor | None = None,
                          ckpt_slot: torch.Tensor | None = None, tree: TokenTree | TreeScan | None = None,
                          varlen: VarlenPlan | None = None, chunk_size: int = CHUNK) -> torch.Tensor:
    """The scan over packed sequences: ``x``, raw ``dt [T, I]``, ``B, C [T, N]`` -> ``y [T, I]``
    (dtype of ``x``), any sequence lengths. Sequence ``i`` starts from ``ssm_states[slots[i]]`` and
    its final state is written back there; for each checkpoint ``j`` the state after ``ckpt_len[j]``
    new tokens of sequence ``ckpt_seq[j]`` goes to ``ssm_states[ckpt_slot[j]]``. ``tree``: the new
    tokens form trees (``ops/tree.py``). ``varlen``: a plan validated once per step
    (``ForwardBatch.varlen``; ``ckpt_*`` then None). Trees and short extends run
    :func:`selective_state_update` token by token, longer extends the chunked scan (module docstring)."""
    check_inputs(x, dt, A, B, C, D, dt_bias, ssm_states)
    scan, varlen = plan_scan(tree, cu_seqlens, x.shape[0], slots, ssm_states, ckpt_seq, ckpt_len, ckpt_slot,
                             x.device, varlen)
    if scan is not None:  # token by token; each token's dt terms computed once, for all of them
        step = lambda x, dtf, decay, B, C, pool, rows: _update_on_pool(x, dtf, decay, B, C, D, pool, rows)  # noqa: E731
        return tree_scan(step, (x, *_dt_terms(dt, A, dt_bias), B, C), ssm_states, slots, scan)
    xf, Af = x.float(), A.float()
    dtf = discretize_dt(dt, dt_bias, None)  # [T, I]
    y = chunk_scan_on_pool(lambda layout, plan, state: _chunk_scan(layout, plan, xf, dtf, Af, B.float(), C.float(),
                                                                   state),
                           varlen, chunk_size, ssm_states, x.device)  # [T, I] fp32
    if D is not None:
        y = y.addcmul_(D.float(), xf)
    return y.to(x.dtype)


def _chunk_scan(layout: ChunkLayout, plan: CheckpointPlan, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor,
                B: torch.Tensor, C: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 core, without the ``D`` skip: ``x``, discretised ``dt [T, I]``, ``B, C [T, N]``, ``state [R, I, N]``
    in rank order -> ``(y [T, I], final state [R, I, N] in rank order, checkpoint states [M, I, N])``.
    Padding positions have ``dt = 0``: decay 1, input 0, so a sequence's state passes them unchanged."""
    xc, dtc, Bc, Cc = (layout.chunk(v) for v in (x, dt, B, C))  # [NC, Q, I] or [NC, Q, N]
    q = layout.chunk_size
    y = x.new_empty(layout.num_chunks, q, x.shape[1])  # [NC, Q, I]
    ckpt_states = state.new_empty(plan.num_checkpoints, *state.shape[1:])  # [M, I, N]
    for j, (first, active) in enumerate(layout.steps()):
        rows = slice(first, first + active)
        a = (dtc[rows].unsqueeze(-1) * A).exp_()  # [n, Q, I, N]: each token's decay
        b = (dtc[rows] * xc[rows]).unsqueeze(-1) * Bc[rows].unsqueeze(2)  # [n, Q, I, N]: its input
        k = 1
        while k < q:  # after round r, position t holds the product over its last 2^r tokens
            b[:, k:] = torch.addcmul(b[:, k:], a[:, k:], b[:, :-k])  # (reads b before the write: a new tensor)
            a[:, k:] = a[:, k:] * a[:, :-k]
            k *= 2
        h = b.addcmul_(a, state[:active].unsqueeze(1))  # [n, Q, I, N]: h_t = (prod a) h_0 + b_t
        y[rows] = torch.matmul(h, Cc[rows].unsqueeze(-1)).squeeze(-1)  # [n, Q, I]: h_t C_t
        state[:active] = h[:, -1]
        at = plan.at_step(j)
        if at is not None:
            entries, _ = at
            ckpt_states[entries] = h[plan.chunk[entries] - first, plan.within[entries] - 1]
    return layout.unchunk(y), state, ckpt_states
