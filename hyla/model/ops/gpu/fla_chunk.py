"""Prefill on the GPU through fla's chunked Triton kernels, on the state pool, with exact checkpoints.

Three adapters, each with the contract of its PyTorch op (the reference and the CPU path): packed
sequences start from their pool rows and write their final states back; checkpoint ``j`` wants
the state after ``ckpt_len[j]`` tokens of sequence ``ckpt_seq[j]``.

* :func:`chunk_gated_delta_rule_fla` — Gated DeltaNet (``gated_delta.chunk_gated_delta_rule_varlen``),
  fla's ``chunk_gated_delta_rule``.
* :func:`chunk_kda_fla` — Kimi Delta Attention (``kda.chunk_kda_varlen``), fla's ``chunk_kda``.
* :func:`mamba2_chunk_scan_fla` — Mamba2's SSD (``ssd.mamba2_chunk_scan_varlen``) as fla's
  ``chunk_simple_gla`` (its docstring has the mapping). mamba-ssm's own Triton SSD would need its CUDA
  build to install; fla is the extra hyla already takes.

fla (``fla-core``, the ``hyla[cuda]`` extra) runs a varlen batch from given initial states and
returns each sequence's output and *final* state only. A checkpoint inside a sequence therefore
cuts it there: the sequences run in rounds, round ``r`` feeding every sequence's ``r``-th segment
(between consecutive cut points) in one varlen call that starts from the state the previous round
left, so the state at each cut is a final state — exact, whatever the position in a chunk
(:func:`scan_in_rounds`). A prompt's usual checkpoint (its end − 1) costs one more round, of one token
per sequence; a batch without checkpoints is one call. A round of short segments (at most
``RECURRENT_MAX_LEN`` tokens each: such a last token, a short extend, the new part of a prompt whose
prefix was cached) runs a recurrent kernel instead of the chunked pipeline's ten or so launches:
hyla's own where the op has one (a ``SegmentKernel``: ``gated_delta_chunks.segment_kernel`` — the
decode step's recurrence looping over each segment, or the same in chunks of 16 tokens for longer
ones —, and ``mamba2_chunks.segment_kernel`` alike; one launch on the running states, writing into
the output), fla's fused recurrent kernel for KDA.
Where the op has its own kernel and every sequence of the batch is that short (a cached prompt's
new part, a short extend), there are no rounds: one launch runs whole sequences and writes the
checkpoints itself as it passes them (:func:`single_pass`), as the decode step's chain kernels do.
An op with no fla kernel (Mamba1's, ``selective_scan``: no matrix form to chunk) runs the same plans
through its own segments kernel alone: one pass at any length, rounds only where two checkpoints of
a sequence share a position.
Below ~1,000 tokens an fla call is host-bound, and the chunked one costs ~1 ms more of it
(measured on an H100, one layer's call, wall time: Gated DeltaNet with 16 heads of 128x128, chunked
~1.5-1.9 ms at any length up to 2,048 tokens, recurrent 0.4-0.6 ms up to 256 tokens, 0.9 ms at 512,
1.5 ms at 1,024, 3.7 ms at 2,048; Mamba2 with 64 heads of 64x128 alike). hyla's own kernels in
chunks took 0.48 ms at 296 tokens and 1.23 ms at 1,024 (``benchmarks/fla_prefill.py``), so the bound
is 1,024, where fla's recurrent kernel (for the layers without hyla's) still ties with its chunked
pipeline; and
a round of more than ``RECURRENT_MAX_TOKENS`` tokens in all (a large batch of short prompts) is
device-bound, so it stays chunked (a bound set by reasoning, not yet by a measurement). The
pool rules are ``varlen.py``'s (fp32 states, ``-1`` slots start from zeros and write nothing, all
reads before all writes); the running states are the pool rows themselves when the slots are one
run (``open_state_rows``), each sequence writing only its own row.

These run for bf16/fp16 models only (``layers.device.fla_prefill``): fla's fp32 dots run in tf32, so fp32
models keep the exact PyTorch ops. fla's kernels do not run in Triton's interpreter: without a GPU
the tests stand in a reference recurrence with fla's signature.
"""

from __future__ import annotations

import importlib.util
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from hyla.cache.transfer import to_device_packed
from hyla.model.ops import ssd
from hyla.model.ops.gpu.segment_checkpoints import SegmentCheckpoints
from hyla.model.ops.gpu import mamba2_chunks
from hyla.model.ops.varlen import VarlenPlan, open_state_rows, write_states

HAS_FLA = importlib.util.find_spec("fla") is not None
RECURRENT_MAX_LEN = 1024  # a round whose segments are all this short runs a recurrent kernel,
RECURRENT_MAX_TOKENS = 4096  # unless it has more tokens in all than this: a recurrent kernel runs each
# segment token by token, so a large batch of them is device-bound, where the chunked pipeline is not
# (benchmarks/fla_prefill.py on an H100, one 1,024-token sequence: hyla's chunked kernel 1.23 ms a call,
# fla's recurrent 2.00, fla's chunked pipeline 2.15, most of it host time; at 4,096 fla's chunked wins)


def _recurrent(rnd: "FlaRound") -> bool:
    """Whether a round runs a recurrent kernel (short segments, a host-bound round) or fla's chunked one."""
    return rnd.longest <= RECURRENT_MAX_LEN and rnd.tokens <= RECURRENT_MAX_TOKENS


# kernel(*per-token inputs of the round, each [1, t, ...], initial_state [n, *state] fp32,
#        cu_seqlens [n+1] on the device, cu_seqlens_cpu [n+1] on the host)
#   -> (out [1, t, ...], final [n, *state])
FlaKernel = Callable[..., tuple[torch.Tensor, torch.Tensor]]
# segments(states [B, *state] fp32, rows [n], starts [n], cu_seqlens [n+1], out [T, ...], ckpts=None, *,
#          longest) -> None:
# hyla's own kernel over n segments (segment i: the packed tokens starts[i] .. + its length, from
# states[rows[i]], updated in place), writing their outputs into out's rows and, with ckpts (a
# segment_checkpoints.SegmentCheckpoints), the states after given tokens into pool rows; longest:
# the longest segment's tokens, known on the host (Gated DeltaNet's picks its recurrent or its
# chunked kernel by it: gated_delta_chunks.segment_kernel)
SegmentKernel = Callable[..., None]


@dataclass(frozen=True)
class FlaRound:
    """One round: a varlen call of fla's kernel (or one launch of the op's own recurrent kernel,
    segment ``i`` starting at packed token ``seg_starts[i]``): sequences ``seqs`` (batch rows),
    their tokens ``idx`` of the packed batch (None: every token in order, or the one run ``span``),
    ``cu_seqlens`` on the device and on the host (fla then computes its chunk indices without a
    device read), and the checkpoints whose position ends this round: rows ``ckpt_rows`` of the
    running state go to pool rows ``ckpt_slots``."""

    seqs: torch.Tensor
    seg_starts: torch.Tensor  # [n] each segment's first packed token
    every: bool  # seqs is every sequence of the batch, in order: the running states are passed whole
    idx: torch.Tensor | None
    span: tuple[int, int] | None  # the tokens are one run start:end of the packed batch (slices, no gather)
    longest: int  # the longest segment's tokens (a recurrent kernel: at most RECURRENT_MAX_LEN)
    tokens: int  # the round's tokens in all (a recurrent kernel: at most RECURRENT_MAX_TOKENS)
    cu_seqlens: torch.Tensor
    cu_seqlens_cpu: torch.Tensor
    ckpt_rows: torch.Tensor | None
    ckpt_slots: torch.Tensor | None


def fla_rounds(varlen: VarlenPlan, device: torch.device) -> list[FlaRound]:
    """The batch's segment rounds (see the module docstring), built once per step: every layer of
    the step then passes fla the same tensors (its own caches, keyed on tensor identity, hit from
    the second layer on) and sends nothing to the device."""
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
        # one asynchronous copy of the round's index tensors:
        # [cu | seqs | ckpt rows | ckpt slots | segment starts | token index]
        long = lambda values: torch.tensor(values, dtype=torch.long)  # noqa: E731
        host = [cu, long([i for i, _, _ in segs]), long([i for _, i in done]),
                long([ckpts.slot_list[j] for j, _ in done]), long([a for _, a, _ in segs])]
        if not whole and span is None:
            host.append(torch.cat([torch.arange(a, e) for _, a, e in segs]))
        parts = to_device_packed(host, device)
        rounds.append(FlaRound(
            seqs=parts[1], seg_starts=parts[4], every=[i for i, _, _ in segs] == list(range(len(lengths))),
            idx=parts[5] if len(parts) > 5 else None, span=None if whole else span,
            longest=max(e - a for _, a, e in segs), tokens=sum(e - a for _, a, e in segs), cu_seqlens=parts[0],
            cu_seqlens_cpu=cu,
            ckpt_rows=parts[2] if done else None, ckpt_slots=parts[3] if done else None))
    return rounds


@dataclass(frozen=True)
class SinglePass:
    """A batch whose every sequence is short (at most ``RECURRENT_MAX_LEN`` tokens, at most
    ``RECURRENT_MAX_TOKENS`` in all): one launch of the op's own recurrent kernel over whole
    sequences (``rows``: every running state, in order), which writes the checkpoints itself, on
    the way (``offsets``, ``pos``, ``slot``: a ``segment_checkpoints.SegmentCheckpoints``'
    tensors) — the new part of a prompt whose prefix was cached, with its end − 1 checkpoint, or a
    short extend."""

    rows: torch.Tensor
    starts: torch.Tensor
    cu_seqlens: torch.Tensor
    offsets: torch.Tensor
    pos: torch.Tensor
    slot: torch.Tensor
    longest: int  # the longest sequence's tokens


def single_pass(varlen: VarlenPlan, device: torch.device, bounded: bool = True) -> SinglePass | None:
    """The batch's :class:`SinglePass`, built once per step; None when (``bounded``: where fla's
    chunked kernel would run instead) a sequence is too long for a recurrent kernel or the batch too
    large, or when two checkpoints of a sequence share a position (then the rounds run)."""
    return varlen.derive(("fla_single_pass", device, bounded), lambda: _plan_single_pass(varlen, device, bounded))


def _plan_single_pass(varlen: VarlenPlan, device: torch.device, bounded: bool) -> SinglePass | None:
    lengths, ckpts = varlen.lengths, varlen.ckpts
    if not lengths or bounded and (max(lengths) > RECURRENT_MAX_LEN or sum(lengths) > RECURRENT_MAX_TOKENS):
        return None
    per_seq = [sorted((n, slot) for s, n, slot in zip(ckpts.seq, ckpts.num_tokens, ckpts.slot_list) if s == i)
               for i in range(len(lengths))]
    if any(a[0] == b[0] for marks in per_seq for a, b in zip(marks, marks[1:])):
        return None
    cu, rows, offsets, pos, slot = to_device_packed(
        [varlen.starts, range(len(lengths)), list(itertools.accumulate(map(len, per_seq), initial=0)),
         [n for marks in per_seq for n, _ in marks], [slot for marks in per_seq for _, slot in marks]], device)
    return SinglePass(rows=rows, starts=cu[:-1], cu_seqlens=cu, offsets=offsets, pos=pos, slot=slot,
                      longest=max(lengths))


def batch_plan(varlen: VarlenPlan | None, tree, cu_seqlens: torch.Tensor, num_tokens: int, slots: torch.Tensor,
               ssm_states: torch.Tensor, ckpt_seq: torch.Tensor | None, ckpt_len: torch.Tensor | None,
               ckpt_slot: torch.Tensor | None) -> VarlenPlan:
    """The batch's plan for an fla op: ``varlen`` checked against the op's arguments (no device
    read), or, without one, built from the tensors. ``tree``: chains only (a short extend's, which
    fla runs as plain sequences); token trees take the PyTorch ops' ``tree_scan``."""
    if tree is not None and not tree.is_chain:
        raise ValueError("fla's chunked kernels run chains; a token tree takes the PyTorch op")
    if varlen is not None:
        varlen.check(cu_seqlens, num_tokens, ckpt_seq, ckpt_len, ckpt_slot)
        return varlen
    return VarlenPlan.from_tensors(cu_seqlens, num_tokens, slots, ssm_states, ckpt_seq, ckpt_len, ckpt_slot,
                                   ssm_states.device)


def scan_in_rounds(chunk: FlaKernel | None, recurrent: FlaKernel | None,
                   xs: Sequence[torch.Tensor] | Callable[[], Sequence[torch.Tensor]], out: torch.Tensor,
                   ssm_states: torch.Tensor, varlen: VarlenPlan, segments: SegmentKernel | None = None) -> torch.Tensor:
    """Run fla's ``chunk`` kernel (or its ``recurrent`` one, for rounds of segments of at most
    ``RECURRENT_MAX_LEN`` tokens and ``RECURRENT_MAX_TOKENS`` in all) over the packed batch's
    per-token inputs ``xs`` (each ``[T, ...]``; or a function returning them, called at the first
    round that runs fla) in the plan's rounds,
    writing its output rows into ``out [T, ...]`` (returned; a round covering every token in order
    returns the kernel's output itself, cast to ``out``'s dtype). Sequence
    ``i`` starts from ``ssm_states[slots[i]]`` and its final state goes back there; checkpoint
    states go to their rows as their rounds end. Where the op has its own recurrent kernel
    (``segments``: Gated DeltaNet's, Mamba2's), the short rounds run it instead of fla's: one launch
    on the running states, writing into ``out``, where an fla call costs ~0.4 ms of host time
    (a prompt's last token after its end - 1 checkpoint, the new part of a cached prompt). An op
    with no fla kernel (``chunk`` and ``recurrent`` None: Mamba1's ``selective_scan``) runs every
    round, of any length, through ``segments``. No device read."""
    # [B, *state]: the pool rows themselves when the slots are one run (fp32 pools), else a copy (zeros for -1)
    state, write_back = open_state_rows(ssm_states, varlen.slots, torch.float32)
    own_only = chunk is None
    one = single_pass(varlen, out.device, bounded=not own_only) if segments is not None else None
    if one is not None:  # every sequence short: one launch, writing its checkpoints on the way
        segments(state, one.rows, one.starts, one.cu_seqlens, out,
                 SegmentCheckpoints(ssm_states, one.offsets, one.pos, one.slot), longest=one.longest)
    for rnd in [] if one is not None else fla_rounds(varlen, out.device):
        if segments is not None and (own_only or _recurrent(rnd)):
            segments(state, rnd.seqs, rnd.seg_starts, rnd.cu_seqlens, out, longest=rnd.longest)
        else:
            if callable(xs):
                xs = xs()
            if rnd.span is not None:
                part = [x[rnd.span[0]:rnd.span[1]] for x in xs]
            elif rnd.idx is not None:
                part = [x.index_select(0, rnd.idx) for x in xs]
            else:
                part = list(xs)
            kernel = recurrent if _recurrent(rnd) else chunk
            initial = state if rnd.every else state.index_select(0, rnd.seqs)
            o, final = kernel(*(x.unsqueeze(0) for x in part), initial_state=initial,
                              cu_seqlens=rnd.cu_seqlens, cu_seqlens_cpu=rnd.cu_seqlens_cpu)
            if rnd.every:
                state.copy_(final)
            else:
                state.index_copy_(0, rnd.seqs, final.float())
            if rnd.span is not None:
                out[rnd.span[0]:rnd.span[1]] = o[0]
            elif rnd.idx is not None:
                out.index_copy_(0, rnd.idx, o[0].to(out.dtype))
            else:
                out = o[0].to(out.dtype)
        if rnd.ckpt_rows is not None:
            ssm_states.index_copy_(0, rnd.ckpt_slots, state.index_select(0, rnd.ckpt_rows))
    if write_back:
        write_states(ssm_states, varlen.slots, state)
    return out


def chunk_gated_delta_rule_fla(*args, **kwargs) -> torch.Tensor:
    """Gated DeltaNet (``gated_delta.chunk_gated_delta_rule_varlen``'s contract; ``g [T, Hv]``, one
    decay per head) through fla's ``chunk_gated_delta_rule`` / ``fused_recurrent_gated_delta_rule``:
    the arguments of :func:`_delta_rule_fla`."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

    return _delta_rule_fla(chunk_gated_delta_rule, fused_recurrent_gated_delta_rule, *args, **kwargs)


def chunk_kda_fla(*args, **kwargs) -> torch.Tensor:
    """Kimi Delta Attention (``kda.chunk_kda_varlen``'s contract; ``g [T, Hv, Dk]``, one decay per key
    channel) through fla's ``chunk_kda`` / ``fused_recurrent_kda``, which compute the reference's
    rule as it stands (the decay before the delta update, q scaled by ``Dk**-0.5`` after its
    l2norm, ``[Dk, Dv]`` states): the arguments of :func:`_delta_rule_fla`."""
    from fla.ops.kda import chunk_kda, fused_recurrent_kda

    return _delta_rule_fla(chunk_kda, fused_recurrent_kda, *args, **kwargs)


def _delta_rule_fla(
    chunk_fn,
    recurrent_fn,
    q: torch.Tensor,  # [T, Hk, Dk]
    k: torch.Tensor,  # [T, Hk, Dk]
    v: torch.Tensor,  # [T, Hv, Dv]
    g: torch.Tensor | None,  # [T, Hv] (Gated DeltaNet) or [T, Hv, Dk] (KDA) fp32 log-decay
    beta: torch.Tensor | None,  # [T, Hv]
    cu_seqlens: torch.Tensor,
    ssm_states: torch.Tensor,  # [S, Hv, Dk, Dv] fp32
    slots: torch.Tensor,
    ckpt_seq: torch.Tensor | None = None,
    ckpt_len: torch.Tensor | None = None,
    ckpt_slot: torch.Tensor | None = None,
    use_qk_l2norm: bool = True,
    tree=None,
    varlen: VarlenPlan | None = None,
    segments: SegmentKernel | None = None,
    gates: Callable[[], tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> torch.Tensor:
    """``o [T, Hv, Dv]`` (dtype of ``q``); pool rows updated in place as the reference does.
    ``tree``: chains only (a short extend's, which fla runs as plain sequences); token trees take
    the PyTorch op's ``tree_scan``. ``varlen``: the batch's plan, validated once per step (no host
    read here; ``ckpt_*`` must then be None). ``segments``: the short rounds' kernel
    (:func:`scan_in_rounds`; Gated DeltaNet's is ``gated_delta_chunks.segment_kernel``). ``gates``:
    instead of ``g`` and ``beta`` (then None), a function computing them, called only if a round
    runs fla (hyla's kernel gates the raw inputs itself)."""
    if (g is None) != (beta is None) or (g is None) == (gates is None):
        raise ValueError("give g and beta, or gates instead of them")
    varlen = batch_plan(varlen, tree, cu_seqlens, q.shape[0], slots, ssm_states, ckpt_seq, ckpt_len, ckpt_slot)

    def chunk(q, k, v, g, beta, initial_state, cu_seqlens, cu_seqlens_cpu):
        return chunk_fn(q, k, v, g=g, beta=beta, initial_state=initial_state, output_final_state=True,
                        cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu, use_qk_l2norm_in_kernel=use_qk_l2norm)

    def recurrent(q, k, v, g, beta, initial_state, cu_seqlens, cu_seqlens_cpu):
        return recurrent_fn(q, k, v, g=g, beta=beta, initial_state=initial_state, output_final_state=True,
                            cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=use_qk_l2norm)

    out = torch.empty(v.shape, dtype=q.dtype, device=q.device)
    xs = (q, k, v, g, beta) if gates is None else lambda: (q, k, v, *gates())
    return scan_in_rounds(chunk, recurrent, xs, out, ssm_states, varlen, segments)


def mamba2_chunk_scan_fla(
    x: torch.Tensor,  # [T, H, P]
    dt: torch.Tensor,  # [T, H] raw (before softplus)
    A: torch.Tensor,  # [H] fp32, < 0
    B: torch.Tensor,  # [T, G, N]
    C: torch.Tensor,  # [T, G, N]
    D: torch.Tensor | None,  # [H]
    dt_bias: torch.Tensor | None,  # [H]
    cu_seqlens: torch.Tensor,
    ssm_states: torch.Tensor,  # [S, H, P, N] fp32
    slots: torch.Tensor,
    ckpt_seq: torch.Tensor | None = None,
    ckpt_len: torch.Tensor | None = None,
    ckpt_slot: torch.Tensor | None = None,
    dt_limit: tuple[float, float] | None = None,
    tree=None,
    varlen: VarlenPlan | None = None,
) -> torch.Tensor:
    """``y [T, H, P]`` (dtype of ``x``); pool rows updated in place as the reference does.

    Mamba2's scan is a linear attention with one scalar decay per head and token — fla's simple
    GLA, ``S_t = exp(g_t) S_{t-1} + k_t v_t^T``, ``o_t = scale * q_t^T S_t`` — with ``q = C``,
    ``k = B`` (groups repeated over heads), ``v = dt * x``, ``g = dt * A``, ``scale = 1`` and fla's
    ``state_v_first`` layout ``[H, V, K] = [H, P, N]``, the pool's; ``D * x`` is added after. ``dt``
    is the reference's ``clamp(softplus(dt + dt_bias), *dt_limit)``, so prefill and decode clamp
    alike. Precision: ``dt * x`` is rounded to the activations' dtype before the kernel (mamba-ssm
    scales inside it, in fp32), the chunk states feeding the outputs are kept in that dtype too
    (fla's ``chunk_simple_gla``; the carried and final states are fp32), and the output is rounded
    before ``D * x`` is added. fla's ``chunk_fwd_h`` reads one number from the device per call
    (its split offsets), so a chunked round of this op is not free of host syncs as the delta-rule
    ones are. ``varlen``: as the other ops."""
    ssd.check_inputs(x, dt, A, B, C, D, dt_bias, ssm_states, dt_limit)
    from fla.ops.simple_gla import chunk_simple_gla, fused_recurrent_simple_gla

    varlen = batch_plan(varlen, tree, cu_seqlens, x.shape[0], slots, ssm_states, ckpt_seq, ckpt_len, ckpt_slot)
    num_heads = x.shape[1]

    def gla_inputs():  # fla's simple-GLA inputs, computed only if a round runs fla (hyla's kernel takes the raw ones)
        dtf = ssd.discretize_dt(dt, dt_bias, dt_limit)  # [T, H] fp32
        g = dtf * A.float()  # [T, H] fp32 log-decay
        v = (x.float() * dtf.unsqueeze(-1)).to(x.dtype)  # [T, H, P]
        k = ssd.repeat_groups(B, num_heads, x.dtype)  # [T, H, N]
        q = ssd.repeat_groups(C, num_heads, x.dtype)  # [T, H, N]
        return q, k, v, g

    def chunk(q, k, v, g, initial_state, cu_seqlens, cu_seqlens_cpu):
        return chunk_simple_gla(q, k, v, g, scale=1.0, initial_state=initial_state, output_final_state=True,
                                state_v_first=True, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu)

    def recurrent(q, k, v, g, initial_state, cu_seqlens, cu_seqlens_cpu):
        return fused_recurrent_simple_gla(q, k, v, g, scale=1.0, initial_state=initial_state,
                                          output_final_state=True, state_v_first=True, cu_seqlens=cu_seqlens)

    # hyla's kernel on the raw inputs; D * x is added below
    segments = mamba2_chunks.segment_kernel(x.flatten(1), dt, A, B.flatten(1), C.flatten(1), None, dt_bias, dt_limit)

    y = scan_in_rounds(chunk, recurrent, gla_inputs, torch.empty(x.shape, dtype=x.dtype, device=x.device),
                       ssm_states, varlen, segments)  # [T, H, P]
    if D is not None:
        y = (y.float() + D.float()[:, None] * x.float()).to(x.dtype)
    return y
