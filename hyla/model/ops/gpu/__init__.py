"""Triton kernels for the GPU decode step, each beside (and tested against) its PyTorch reference.

The references in ``hyla/model/ops`` stay the oracle and the CPU path; these kernels are what a
CUDA decode step runs (``ForwardBatch.fused_decode``). They read and write the pools in place
through slot / table indices held on the device, so a decode step has no host read and a fixed
shape for a given batch size: it can be captured in a CUDA graph (``hyla/engine/cuda_graph.py``).

* :func:`causal_conv1d_update_fused` — the conv window update (``ops/conv1d.py``).
* :func:`gated_delta_decode_fused` — the Gated DeltaNet step with its gating, q/k l2norm and the
  in-place state update fused (``ops/gated_delta.py``'s ``recurrent_gated_delta_rule_update``).
* :func:`paged_decode_attention` — split-KV attention of one query per sequence over the request
  table (``ops/attention.py``'s ``decode_attention``), the output gate fused in; before it,
  :func:`decode_qk_prologue` — q/k norm, RoPE and the K/V pool writes in one kernel.
* ``norms`` — RMSNorm (alone or with the residual add before it), the gated RMSNorm, SwiGLU.
* :func:`linear_add_rms_norm` (``gemv``) — at a few rows, a part's out projection with its prologue
  (SwiGLU, the gated RMSNorm) and the residual add + RMSNorm after it, in one split-K launch.
* ``lora`` — LoRA adapters' shrink and expand (punica's), each row by its own adapter slot, in CUDA graphs.
* ``mamba2_decode`` (Mamba2), ``selective_scan`` (Mamba1: Jamba, Mamba, FalconMamba), ``kda_decode`` and
  ``latent_attention`` (Kimi-Linear's KDA and MLA): the other architectures' decode kernels.

Prefill (extend steps) on bf16/fp16 runs fla's chunked kernels where fla is installed (the
``hyla[cuda]`` extra): ``fla_chunk`` (Gated DeltaNet, KDA, Mamba2 as simple GLA; exact checkpoints
by cutting sequences into rounds).

Under ``TRITON_INTERPRET=1`` the kernels also run on CPU tensors (slowly): the CPU test suite checks
them that way; on a GPU the same tests run them for real (``tests/test_fused_*.py``).

**One compile per model.** Triton compiles a kernel anew for every new specialization of its
arguments (an int equal to 1 or a multiple of 16, a pointer aligned to 16 bytes): ~1-3 s on a GPU,
in the middle of a step, whenever the request data first makes one. So an argument that follows
the step's data (a token count, a chain's stride, which is its number of sequences, an index array
sliced from a packed buffer at an offset its lengths decide) is declared in ``@triton.jit``'s
``do_not_specialize`` or ``do_not_specialize_on_alignment``; what stays specialized is the model's
(its dimensions, its weights' strides) and the constexprs each launch chooses (tiles, paths, split
counts: a few values each, compiled as the warm-up and the CUDA graphs' captures first meet them).
The engine tests check it (``tests/compile_keys.py``): a second turn of other lengths launches no
kernel with constexprs the first turn had but another compile key.
"""

from __future__ import annotations

import importlib.util

import torch

HAS_TRITON = importlib.util.find_spec("triton") is not None


def available(device: torch.device | str) -> bool:
    """Whether the engine runs the fused kernels on ``device`` by default: CUDA with Triton."""
    return HAS_TRITON and torch.device(device).type == "cuda" and torch.cuda.is_available()


# the compute capability Triton's float8 types need: e4m3 (fp8e4nv) Ada and Hopper on, not an A100 (8.0);
# e5m2 (fp8e5) Ampere on
FLOAT8_MIN_CAPABILITY = {torch.float8_e4m3fn: (8, 9), torch.float8_e5m2: (8, 0)}


def float8_supported(device: torch.device | str, dtype: torch.dtype = torch.float8_e4m3fn) -> bool:
    """Whether ``device``'s kernels can read and write float8 ``dtype`` (FP8 weights kept: e4m3; a float8 KV
    cache): any device but CUDA (PyTorch's paths), or a CUDA device of ``FLOAT8_MIN_CAPABILITY[dtype]`` or more."""
    device = torch.device(device)
    return device.type != "cuda" or torch.cuda.get_device_capability(device) >= FLOAT8_MIN_CAPABILITY[dtype]


def chain_of(chain: torch.Tensor | None, slots: torch.Tensor, rows: int) -> tuple[int, torch.Tensor, int]:
    """``(W, chain, sequences)`` for a launch over ``rows`` rows: a verify step's ``chain [W+1, S]``
    (``rows = S*W``), or a decode step's slots as the one-token chain ``[slots, slots]`` (a row
    stride of 0: read and written in place). Shared by the decode kernels
    (``conv1d_decode``, ``gated_delta_decode``, ``mamba2_decode``)."""
    if chain is None:
        if slots.shape != (rows,) or slots.stride(0) != 1:
            raise ValueError(f"slots must be a contiguous [{rows}], got {list(slots.shape)}")
        return 1, slots.as_strided((2, rows), (0, 1)), rows
    w = chain.shape[0] - 1
    if chain.dim() != 2 or w < 1 or chain.stride(1) != 1 or rows != chain.shape[1] * w:
        raise ValueError(f"chain must be [W+1, S] with unit column stride for {rows} = S*W rows, "
                         f"got {list(chain.shape)}")
    return w, chain, chain.shape[1]


def segments_of(rows: torch.Tensor, starts: torch.Tensor, cu_seqlens: torch.Tensor, out: torch.Tensor,
                shape: tuple[int, int, int]) -> int:
    """The number of segments ``n`` of an extend's segments launch (``gated_delta_segments_fused``,
    ``mamba2_segments_fused``): ``rows, starts [n]`` and ``cu_seqlens [n+1]`` must agree, and the
    output ``out`` be ``shape = [T, heads, dim]`` with dense heads (rows may be strided)."""
    if out.shape != shape or out.stride(2) != 1 or out.stride(1) != shape[2]:
        raise ValueError(f"out must be {list(shape)} with dense heads, got {list(out.shape)}")
    n = rows.shape[0]
    if rows.dim() != 1 or starts.shape != (n,) or cu_seqlens.shape != (n + 1,):
        raise ValueError(f"rows, starts [{n}] and cu_seqlens [{n + 1}] disagree")
    return n


def conv_kernel_size(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv_states: torch.Tensor,
                     activation: str | None) -> int:
    """The conv kernels' shared checks (``conv1d_decode``, ``conv1d_extend``): ``x [R, C]`` with unit
    stride along channels, ``weight [C, K]`` contiguous, ``bias [C] | None``, ``conv_states [S, C,
    K-1]`` contiguous, a supported activation. Returns ``K``."""
    c = x.shape[1]
    k = weight.shape[1] if weight.dim() == 2 else 0
    if weight.shape != (c, k) or not weight.is_contiguous() or k < 2:
        raise ValueError(f"weight must be a contiguous [C={c}, K>=2] tensor, got {list(weight.shape)}")
    if bias is not None and bias.shape != (c,):
        raise ValueError(f"bias must be [{c}], got {list(bias.shape)}")
    if conv_states.shape[1:] != (c, k - 1) or not conv_states.is_contiguous():
        raise ValueError(f"conv_states must be a contiguous [S, {c}, {k - 1}] pool, got {list(conv_states.shape)}")
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"unsupported activation {activation!r}")
    if x.stride(1) != 1:
        raise ValueError("x must have unit stride along channels")
    return k
