"""Routed experts with an optional shared expert (Qwen3-Next, Qwen3.5-MoE, NemotronH, Jamba, Kimi-Linear,
LFM2-MoE)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hyla.model.config import ModelConfig
from hyla.model.layers import device
from hyla.model.layers.mlp import MLP, relu2
from hyla.model.layers.projections import adapted, project
from hyla.model.linear import Linear, few_row_linear, mkl_weight
from hyla.model.quantization import dequantized, fp8_scales


# GPU MoE steps of at most this many (token, expert) assignments run gathered (SparseMoE.path): each
# assignment reads its expert's weights once (gemv.expert_linear: two assignments of one expert read
# it twice); larger ones run grouped (moe.expert_gemm: each chosen expert read once per block of its
# assignments). Neither reads the host, so CUDA graphs capture MoE steps of any size. Not yet timed
# on a GPU.
GATHER_MAX_ASSIGNMENTS = 64


def expert_activation(h: torch.Tensor, gated: bool) -> torch.Tensor:
    """The experts' activation between their two projections: SwiGLU of ``h = [gate | up]`` where
    ``gated`` (on a GPU one kernel, ``norms.silu_mul_fused``), else relu²."""
    if gated and device.on_gpu(h):
        return device.gpu("norms").silu_mul_fused(h)
    if gated:
        gate, up = h.chunk(2, dim=-1)
        return F.silu(gate) * up
    return relu2(h)


def run_experts_sorted(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, w_in: torch.Tensor,
                       w_out: torch.Tensor, gated: bool, fp8_in: FP8Weight | None = None,
                       fp8_out: FP8Weight | None = None) -> torch.Tensor:
    """``sum_k weights[t, k] * expert_{experts[t, k]}(x[t])``: ``x [T, Hin]``, ``weights, experts
    [T, k]``, stacked experts ``w_in [E, I or 2I, Hin]``, ``w_out [E, Hin, I]`` (SwiGLU where
    ``gated``, else relu²) -> ``[T, Hin]`` in ``weights.dtype``. The assignments sorted by expert, one
    matmul pair per expert that received tokens: each chosen expert's weights read once, its group's
    size read on the host. Weights kept in FP8 come with their ``(scale, block)`` (``fp8_in``,
    ``fp8_out``): each chosen expert is dequantized to x's dtype first."""
    flat = experts.flatten()  # [T*k]
    order = torch.argsort(flat, stable=True)  # assignments grouped by expert
    token = order // experts.shape[1]  # [T*k] token of each sorted assignment
    counts = torch.bincount(flat, minlength=w_in.shape[0]).tolist()
    xs = x[token]  # [T*k, Hin]
    outs = []
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        h = expert_activation(expert_linear(xs[start : start + n], _expert(w_in, fp8_in, e, x.dtype)), gated)  # [n, I]
        outs.append(expert_linear(h, _expert(w_out, fp8_out, e, x.dtype)))  # [n, Hin]
        start += n
    ys = torch.cat(outs) * weights.flatten()[order, None]  # [T*k, Hin]
    out = torch.zeros(x.shape[0], x.shape[1], dtype=weights.dtype, device=x.device)
    return out.index_add_(0, token, ys.to(weights.dtype))


FP8Weight = tuple[torch.Tensor, tuple[int, int]]  # a stacked weight kept in FP8: its (scale, block)


def _expert(w: torch.Tensor, fp8: FP8Weight | None, e: int, dtype: torch.dtype) -> torch.Tensor:
    """Expert ``e``'s matrix of the stacked ``w``, dequantized to ``dtype`` where kept in FP8."""
    return w[e] if fp8 is None else dequantized(w[e], fp8[0][e], fp8[1], dtype)


def expert_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w.T`` for one expert's weight ``w [N, K]``: a few fp32 CPU rows as a dense projection's
    (:func:`linear.few_row_linear`: on more than one thread split across them, as MKL runs such a
    GEMM on one), else the GEMM."""
    y = few_row_linear(x, w) if mkl_weight(w) else None
    return x @ w.t() if y is None else y


@torch.library.custom_op("hyla::moe_experts", mutates_args=())
def moe_experts(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, w_in: torch.Tensor,
                w_out: torch.Tensor, gated: bool) -> torch.Tensor:
    """:func:`run_experts_sorted` as one op of a ``compile_decode`` graph (``torch.ops.hyla.moe_experts``):
    opaque to the compiler, so its host read does not break the graph, and it runs MKL's GEMMs on
    the weights as loaded, each chosen expert's once."""
    return run_experts_sorted(x, weights, experts, w_in, w_out, gated)


@moe_experts.register_fake
def _(x, weights, experts, w_in, w_out, gated):
    return x.new_empty(x.shape, dtype=weights.dtype)


# (an op of its own, not optional arguments of moe_experts: inductor's on-disk cache does not key its
# graphs on an op's schema, and a graph cached against moe_experts' schema crashed once it changed)
@torch.library.custom_op("hyla::moe_experts_fp8", mutates_args=())
def moe_experts_fp8(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, w_in: torch.Tensor,
                    w_out: torch.Tensor, gated: bool, in_scale: torch.Tensor | None, in_block: list[int] | None,
                    out_scale: torch.Tensor | None, out_block: list[int] | None) -> torch.Tensor:
    """:func:`moe_experts` with experts kept in FP8 (``quantization.py``): each stacked weight's scales
    and block, or None for one in the model's dtype."""
    fp8_in = (in_scale, tuple(in_block)) if in_scale is not None else None
    fp8_out = (out_scale, tuple(out_block)) if out_scale is not None else None
    return run_experts_sorted(x, weights, experts, w_in, w_out, gated, fp8_in, fp8_out)


@moe_experts_fp8.register_fake
def _(x, weights, experts, w_in, w_out, gated, in_scale, in_block, out_scale, out_block):
    return x.new_empty(x.shape, dtype=weights.dtype)


def expert_matvec(w: torch.Tensor, experts: torch.Tensor, x: torch.Tensor, per_row: int = 1,
                  fp8: FP8Weight | None = None) -> torch.Tensor:
    """``w[experts[a]] @ x[a // per_row]`` for each assignment ``a``: stacked expert weights ``w [E, N,
    K]`` (kept in FP8: with their ``(scale, block)``), ``experts [A]``, ``x [A / per_row, K]`` (the
    tokens, ``per_row = k``; or the assignments) -> ``[A, N]`` in ``x``'s dtype. On a GPU a GEMV
    kernel whose programs read their assignment's expert in place (``gemv.expert_linear``);
    elsewhere, or a K it does not take, a batched GEMV on the gathered weights (a copy of ``A``
    experts' weights, dequantized)."""
    scale, block = _scale_block(fp8)
    if device.on_gpu(x) and x.stride(1) == 1 and device.gpu("gemv").linear_fits(w[0]):
        return device.gpu("gemv").expert_linear(x, w, experts, per_row, scale=scale, block=block)
    xs = x.repeat_interleave(per_row, dim=0) if per_row > 1 else x  # [A, K]
    ws = w[experts] if fp8 is None else dequantized(w[experts], scale[experts], block, x.dtype)  # [A, N, K]
    return torch.bmm(ws, xs.unsqueeze(-1)).squeeze(-1)  # [A, N, K] @ [A, K, 1] -> [A, N]


def _scale_block(fp8: FP8Weight | None) -> tuple[torch.Tensor | None, tuple[int, int] | None]:
    """A stacked weight's ``(scale, block)`` where kept in FP8, else ``(None, None)``: what the kernels
    and ``moe_experts_fp8`` take for it."""
    return fp8 if fp8 is not None else (None, None)


def _weighted_sum(ys: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``sum_j weights[t, j] * ys[t * k + j]``: the experts' outputs by (token, choice) ``ys [T * k, H]``
    and ``weights [T, k]`` -> ``[T, H]`` in ``weights.dtype``, summed in choice order."""
    t, k = weights.shape
    return (ys.view(t, k, -1) * weights.unsqueeze(-1)).sum(1).to(weights.dtype)


class SparseMoE(nn.Module):
    """Top-k routed experts plus an optional shared expert.

    Routers: ``"softmax"`` (Qwen3-Next: softmax in fp32, top-k, renormalise if ``norm_topk_prob``,
    shared expert scaled by ``sigmoid(shared_expert_gate(x))``) and ``"sigmoid"`` (NemotronH:
    ``sigmoid`` scores, top-k chosen on ``scores + e_score_correction_bias`` within the best
    ``topk_group`` of ``n_group`` groups, weights are the uncorrected scores, renormalised
    (``w / (sum + router_norm_eps)``), times ``routed_scaling_factor``; relu² experts, optional latent
    projection around the experts). The sigmoid router's options (``ModelConfig``): ``router_bias``
    (False: no bias, the top-k of the scores themselves: LFM2-MoE's ``use_expert_bias: false``),
    ``router_norm_eps`` (1e-20; LFM2-MoE 1e-6) and ``router_fp32`` (logits and sigmoid in fp32; False:
    in the model dtype, then fp32, as LFM2-MoE's reference). It runs in PyTorch on every path (the GPU
    kernel ``moe.softmax_topk`` is the softmax router's alone).

    Experts stay stacked (``w_in [E, I or 2I, Hin]``, ``w_out [E, Hin, I]``). Three ways to run them,
    the same numbers within rounding (:meth:`path` picks):

    * sorted (:meth:`run_experts`, the CPU's): tokens sorted by expert, one matmul pair per expert
      that received tokens; each chosen expert's weights are read once, but the group sizes are read
      on the host, so the step's shapes depend on the routing. A ``compile_decode`` graph runs it as
      one opaque op (:func:`moe_experts`);
    * gathered (:meth:`run_experts_gathered`, small GPU steps): every (token, choice) assignment runs
      its own expert on its own token, reading that expert's weights once per assignment;
    * grouped (:meth:`run_experts_grouped`, larger GPU steps): the assignments sorted by expert and
      padded to blocks on the device (``ops/gpu/moe.py``), each block's expert read once.

    On a GPU neither path reads the host, and the shapes depend on the token count alone: CUDA graphs
    capture MoE decode steps of any batch size and extends. There the softmax router is one kernel
    (``moe.softmax_topk``), and so are the weighted sum, the shared expert's gate and its add
    (``moe.combine``; not around a latent projection).
    """

    stacked_weights = ("w_in", "w_out")  # fp32 CPU: column-major, as nn.Linear's (linear.relayout_weights_)
    takes_gemv_step = True  # forward(gemv_step=True): the fused input projection as a GEMV (fuse_inputs_)

    def __init__(self, config: ModelConfig):
        super().__init__()
        c = config
        self.num_experts, self.top_k = c.num_experts, c.num_experts_per_tok
        self.router_kind = c.router
        self.norm_topk_prob = c.norm_topk_prob
        self.num_groups, self.topk_groups = c.router_num_groups, c.router_topk_groups
        self.scaling = c.routed_scaling_factor
        self.norm_eps, self.router_fp32 = c.router_norm_eps, c.router_fp32
        self.logits_fp32 = c.router_logits_fp32  # the softmax router's logits from fp32 (Lara-4-Mini)
        self.gated = c.hidden_act == "silu"
        inner = c.moe_latent_size or c.hidden_size
        width = c.moe_intermediate_size * (2 if self.gated else 1)
        self.router = Linear(c.hidden_size, c.num_experts, bias=False, dtype=c.dtype)
        self.router.keeps_fp8 = False  # (the routing in the model's precision, as FP8 checkpoints keep it)
        self.router.lora_refused = "the router's logits may be computed from its weight alone (in fp32)"
        self.e_score_correction_bias = (
            nn.Parameter(torch.empty(c.num_experts, dtype=torch.float32))
            if c.router == "sigmoid" and c.router_bias else None
        )
        self.w_in = nn.Parameter(torch.empty(c.num_experts, width, inner, dtype=c.dtype))  # [E, I or 2I, Hin]
        self.w_out = nn.Parameter(torch.empty(c.num_experts, inner, c.moe_intermediate_size, dtype=c.dtype))
        self.latent_in = self.latent_out = None
        if c.moe_latent_size:
            self.latent_in = Linear(c.hidden_size, c.moe_latent_size, bias=c.mlp_bias, dtype=c.dtype)
            self.latent_out = Linear(c.moe_latent_size, c.hidden_size, bias=c.mlp_bias, dtype=c.dtype)
        self.shared_expert = None
        if c.shared_expert_intermediate_size:
            self.shared_expert = MLP(c.hidden_size, c.shared_expert_intermediate_size, c.hidden_act, c.mlp_bias,
                                     c.dtype)
        self.shared_expert_gate = Linear(c.hidden_size, 1, bias=False, dtype=c.dtype) if c.shared_expert_gate else None
        if self.shared_expert_gate is not None:
            self.shared_expert_gate.keeps_fp8 = False  # (one row: nothing to save)
        self.fused_inputs: torch.Tensor | None = None  # fuse_inputs_: not a parameter, not in the state dict

    def fuse_inputs_(self) -> bool:
        """Give the projections that read the layer's input — the softmax router, the shared expert's
        gate and its in projection — one weight (GPU runners, after loading): a step runs one GEMM
        (a GEMV at batch 1) where it ran three. Their own weights become views of it (no copy), so
        the state dict and the other paths are unchanged. Only a softmax router without bias, with
        a shared expert and no latent projection (Qwen3-Next, Qwen3.5-MoE); returns whether fused."""
        if self.fused_inputs is not None:
            return True
        parts = [self.router] + ([self.shared_expert_gate] if self.shared_expert_gate is not None else []) \
            + ([self.shared_expert.in_proj] if self.shared_expert is not None else [])
        if self.router_kind != "softmax" or self.shared_expert is None or self.latent_in is not None \
                or self.logits_fp32 or any(p.bias is not None or p.weight.dtype != self.router.weight.dtype
                                           for p in parts):  # (a shared expert kept in FP8 runs its own kernels)
            return False
        with torch.no_grad():
            fused = torch.cat([p.weight for p in parts])  # [E (+ 1) + I or 2I, H]
        start = 0
        for p in parts:
            rows = p.weight.shape[0]
            p.weight = nn.Parameter(fused[start:start + rows], requires_grad=False)
            start += rows
        self.fused_inputs = fused
        return True

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [T, H]`` -> ``(weights [T, k], experts [T, k])``; weights fp32 for the sigmoid
        router, model dtype for the softmax router (as the reference). The sigmoid router's scores
        are fp32 from fp32 logits, or (``router_fp32`` off) the model dtype's sigmoid of the model
        dtype's logits, made fp32 (the same numbers in an fp32 model). The softmax router's logits are
        the model dtype's, or (``router_logits_fp32``) fp32 from fp32 input and weight."""
        if self.router_kind == "softmax":
            if self.logits_fp32:
                logits = F.linear(x.float(), self.router.weight.float())  # [T, E] fp32
            else:
                logits = self.router(x)  # [T, E]
            if device.on_gpu(logits):  # the same in one kernel
                weights, experts = device.gpu("moe").softmax_topk(logits, self.top_k, self.norm_topk_prob)
                return weights.to(x.dtype), experts
            probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
            weights, experts = torch.topk(probs, self.top_k, dim=-1)  # [T, k]
            if self.norm_topk_prob:
                weights = weights / weights.sum(dim=-1, keepdim=True)
            return weights.to(x.dtype), experts
        if self.router_fp32:
            scores = torch.sigmoid(F.linear(x.float(), self.router.weight.float()))  # [T, E]
        else:
            scores = torch.sigmoid(self.router(x)).float()  # [T, E]
        bias = self.e_score_correction_bias
        choice = scores if bias is None else scores + bias  # [T, E]
        if self.num_groups > 1:
            grouped = choice.view(-1, self.num_groups, self.num_experts // self.num_groups)  # [T, G, E/G]
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [T, G]
            best = torch.topk(group_scores, self.topk_groups, dim=-1, sorted=False).indices  # [T, topk_group]
            keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)  # [T, G]
            keep = keep.repeat_interleave(self.num_experts // self.num_groups, dim=1)  # [T, E]
            choice = choice.masked_fill(~keep, float("-inf"))
        experts = torch.topk(choice, self.top_k, dim=-1, sorted=False).indices  # [T, k]
        weights = scores.gather(1, experts)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + self.norm_eps)
        return weights * self.scaling, experts

    def run_experts(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """``sum_k weights[t, k] * expert_{experts[t, k]}(x[t])`` -> ``[T, Hin]`` in ``weights.dtype``,
        sorted by expert (:func:`run_experts_sorted`; inside a compiled graph as its op,
        :func:`moe_experts`)."""
        fp8_in, fp8_out = fp8_scales(self, "w_in"), fp8_scales(self, "w_out")
        if not torch.compiler.is_compiling():
            return run_experts_sorted(x, weights, experts, self.w_in, self.w_out, self.gated, fp8_in, fp8_out)
        if fp8_in is None and fp8_out is None:
            return torch.ops.hyla.moe_experts(x, weights, experts, self.w_in, self.w_out, self.gated)
        (in_scale, in_block), (out_scale, out_block) = _scale_block(fp8_in), _scale_block(fp8_out)
        return torch.ops.hyla.moe_experts_fp8(x, weights, experts, self.w_in, self.w_out, self.gated, in_scale,
                                              in_block and list(in_block), out_scale, out_block and list(out_block))

    def path(self, x: torch.Tensor) -> str:
        """How ``x``'s tokens run their experts: ``"sorted"`` on the CPU, compiled or not (a host read
        costs nothing there, and gathering the weights would copy them); on a GPU
        :meth:`device_path` (without Triton: gathered where few, else ``"sorted"``)."""
        if device.on_gpu(x):
            return self.device_path(x)
        return "gathered" if x.is_cuda and x.shape[0] * self.top_k <= GATHER_MAX_ASSIGNMENTS else "sorted"

    def device_path(self, x: torch.Tensor) -> str:
        """A GPU's way, no host read: ``"gathered"`` for at most ``GATHER_MAX_ASSIGNMENTS``
        assignments (decode steps of a few requests), else ``"grouped"`` (Triton kernels)."""
        return "gathered" if x.shape[0] * self.top_k <= GATHER_MAX_ASSIGNMENTS else "grouped"

    def expert_outputs(self, x: torch.Tensor, experts: torch.Tensor, path: str) -> torch.Tensor:
        """Each (token, choice) assignment's expert on its token, unweighted, gathered or grouped (no
        host read either way): ``x [T, Hin]``, ``experts [T, k]`` -> ``[T * k, Hin]`` in x's dtype."""
        t, k = experts.shape
        fp8_in, fp8_out = fp8_scales(self, "w_in"), fp8_scales(self, "w_out")
        if path == "gathered":  # each assignment's expert read once (a GEMV on a GPU)
            flat = experts.flatten()  # [A]
            h = expert_activation(expert_matvec(self.w_in, flat, x, per_row=k, fp8=fp8_in), self.gated)  # [A, I]:
            # token a // k
            return expert_matvec(self.w_out, flat, h, fp8=fp8_out)  # [A, Hin]
        kernels = device.gpu("moe")  # grouped: sorted by expert into blocks on the device, each block's expert read
        # once
        plan = kernels.plan(experts, self.num_experts)
        (in_scale, in_block), (out_scale, out_block) = _scale_block(fp8_in), _scale_block(fp8_out)
        h = expert_activation(kernels.expert_gemm(x, self.w_in, plan, per_row=k, scale=in_scale, block=in_block),
                              self.gated)  # [A, I]
        return kernels.expert_gemm(h, self.w_out, plan, per_row=1, scale=out_scale, block=out_block)  # [A, Hin]

    def run_experts_gathered(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """:meth:`run_experts` as one product per (token, choice) assignment, ``A = T * k`` of them,
        with no host read: ``x [T, Hin]``, ``weights, experts [T, k]`` -> ``[T, Hin]`` in
        ``weights.dtype``. Each token's choices are summed in choice order (the sorted path: in expert
        order), so the two agree within rounding."""
        return _weighted_sum(self.expert_outputs(x, experts, "gathered"), weights)

    def run_experts_grouped(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """:meth:`run_experts_gathered`'s sums, each projection one grouped GEMM (``ops/gpu/moe.py``):
        the assignments sorted by expert and padded to blocks on the device, each block's expert read
        once. No host read; the shapes depend on the token count alone."""
        return _weighted_sum(self.expert_outputs(x, experts, "grouped"), weights)

    def _route_and_share(self, x: torch.Tensor, gemv_step: bool) -> tuple[torch.Tensor, ...]:
        """A GPU step's ``(weights, experts)`` (:meth:`route`), the shared expert's output (None without
        one) and its gate's logit ``[T, 1]`` (None without one); with :meth:`fuse_inputs_`, the router,
        the gate and the shared in projection as one GEMM (a GEMV on a GEMV step)."""
        if self.fused_inputs is None or adapted(self.shared_expert.in_proj):  # (LoRA: the projection's own)
            weights, experts = self.route(x)
            shared = self.shared_expert(x) if self.shared_expert is not None else None
            gate = self.shared_expert_gate(x) if shared is not None and self.shared_expert_gate is not None else None
            return weights, experts, shared, gate
        e, gated = self.num_experts, int(self.shared_expert_gate is not None)
        y = project(x, self.fused_inputs, gemv_step)  # [T, E (+ 1) + I or 2I]
        weights, experts = device.gpu("moe").softmax_topk(y[:, :e], self.top_k, self.norm_topk_prob)
        return weights, experts, self.shared_expert.down(y[:, e + gated:], gemv_step), y[:, e:e + 1] if gated else None

    def forward(self, x: torch.Tensor, gemv_step: bool = False) -> torch.Tensor:
        path = self.path(x)
        if path != "sorted" and device.on_gpu(x) and self.latent_in is None:  # the sums, the shared expert and
            # its gate in one kernel
            weights, experts, shared, gate = self._route_and_share(x, gemv_step)
            return device.gpu("moe").combine(self.expert_outputs(x, experts, path), weights, shared, gate)
        weights, experts = self.route(x)
        h = self.latent_in(x) if self.latent_in is not None else x
        run = {"sorted": self.run_experts, "gathered": self.run_experts_gathered,
               "grouped": self.run_experts_grouped}[path]
        out = run(h, weights, experts).to(x.dtype)  # [T, Hin]
        if self.latent_out is not None:
            out = self.latent_out(out)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        return out
