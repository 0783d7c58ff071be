"""Mamba1's selective scan (Jamba's SSM layers): the decode update and the extend over packed
variable-length sequences, on a state pool.

Per channel ``d`` (``I`` of them) with state ``h_d [N]`` (fp32), a decay per channel *and state*
``A [I, N] < 0`` and a step ``dt = softplus(dt + dt_bias)`` per channel::

    h_d <- exp(dt_d A_d) * h_d + dt_d x_d B_t        # B_t [N]: shared by every channel
    y_d  = h_d . C_t + D_d x_d                        # C_t [N]

(Hugging Face's ``mamba_selective_state_update`` and ``mamba_selective_scan``; the gate
``y * silu(z)`` is the layer's.) Unlike Mamba2 (``ssd.py``), whose decay is one scalar per head,
the decay varies along the state, so SSD's chunked matrix form does not apply: an extend runs token
by token with the decode update (``tree.tree_scan``: one chain per sequence, its checkpoints written
on the way; a verify step's trees alike), so prefill, decode and verification are the same
arithmetic, bitwise. The cost is one small update per token and layer: prefill is the slow path of
this layer kind (a chunked or Triton scan would be the fast one).

Pool rules (``varlen.py``): ``ssm_states [S, I, N]`` fp32; ``slots[i] == -1`` starts from zeros and
writes nothing; all reads precede all writes; checkpoint rows are distinct from the batch's own.
"""

from __future__ import annotations

import torch

from hyla.model.ops.ssd import discretize_dt
from hyla.model.ops.tree import TokenTree, TreeScan, plan_scan, tree_scan
from hyla.model.ops.varlen import SlotPlan, VarlenPlan, as_slot_plan, open_state_rows, write_states


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
    plan = as_slot_plan(slots, ssm_states, x.shape[0])
    dtf = discretize_dt(dt, dt_bias, None)  # [B, I]
    xf = x.float()
    h, copied = open_state_rows(ssm_states, plan, torch.float32)  # [B, I, N]
    h.mul_((dtf.unsqueeze(-1) * A.float()).exp_()).addcmul_((dtf * xf).unsqueeze(-1), B.float().unsqueeze(1))
    y = torch.matmul(h, C.float().unsqueeze(-1)).squeeze(-1)  # [B, I]: h C
    if D is not None:
        y = y.addcmul_(D.float(), xf)
    if copied:
        write_states(ssm_states, plan, h)
    return y.to(x.dtype)


def selective_scan_varlen(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                          D: torch.Tensor | None, dt_bias: torch.Tensor | None, cu_seqlens: torch.Tensor,
                          ssm_states: torch.Tensor, slots: torch.Tensor,
                          ckpt_seq: torch.Tensor | None = None, ckpt_len: torch.Tensor | None = None,
                          ckpt_slot: torch.Tensor | None = None, tree: TokenTree | TreeScan | None = None,
                          varlen: VarlenPlan | None = None) -> torch.Tensor:
    """The scan over packed sequences: ``x``, raw ``dt [T, I]``, ``B, C [T, N]`` -> ``y [T, I]``
    (dtype of ``x``), any sequence lengths. Sequence ``i`` starts from ``ssm_states[slots[i]]`` and
    its final state is written back there; for each checkpoint ``j`` the state after ``ckpt_len[j]``
    new tokens of sequence ``ckpt_seq[j]`` goes to ``ssm_states[ckpt_slot[j]]``. ``tree``: the new
    tokens form trees (``ops/tree.py``). ``varlen``: a plan validated once per step
    (``ForwardBatch.varlen``; ``ckpt_*`` then None). Every path runs :func:`selective_state_update`
    token by token (chains when no tree is given)."""
    check_inputs(x, dt, A, B, C, D, dt_bias, ssm_states)
    scan, varlen = plan_scan(tree, cu_seqlens, x.shape[0], slots, ssm_states, ckpt_seq, ckpt_len, ckpt_slot,
                             x.device, varlen)
    if scan is None:  # a long extend: its sequences as chains, with the plan's slots and checkpoints
        scan = TokenTree.chains(list(varlen.lengths), x.device).plan(varlen.slots, varlen.ckpts)
    step = lambda x, dt, B, C, pool, rows: selective_state_update(x, dt, A, B, C, D, dt_bias, pool, rows)  # noqa: E731
    return tree_scan(step, (x, dt, B, C), ssm_states, slots, scan)
