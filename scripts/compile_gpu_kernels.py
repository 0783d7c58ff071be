"""Compile every Triton kernel of ``hyla/model/ops/gpu`` for a GPU, on a machine without one.

The CPU test suite runs the kernels in Triton's interpreter, which checks what they compute but
not that they compile: a kernel the interpreter accepts can still fail in Triton's compiler (a
type, a layout, an unsupported op), and that would first show on a GPU. Triton compiles without a
device: this script swaps in a driver that only names the target (``sm_90``, an H100, by default),
turns every launch into a compile (``JITFunction.run`` with ``warmup=True``: nothing runs), and
calls each kernel's wrapper on small CPU tensors at the shapes and dtypes the models use, so that
each kernel compiles with the constexprs it gets in the engine — through ptxas, to a cubin. It
prints one line per compiled variant and exits 1 if any failed.

    .venv/bin/python scripts/compile_gpu_kernels.py [--arch 90]

``tests/test_gpu_compile.py`` runs it. It needs Triton's CUDA backend (in the ``triton`` wheel) and
must run in a process where ``TRITON_INTERPRET`` is unset.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import traceback
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


class CompileOnlyDriver:
    """As much of Triton's driver as compiling needs: the target, device 0, no stream."""

    def __init__(self, arch: int):
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", arch, 32)

    def get_current_target(self):
        return self.target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0


# a PTX instruction on local memory (what Triton could not keep in registers; ptxas's own spills come later)
LOCAL_ACCESS = re.compile(r"(?m)^\s*(?:ld|st)\.local")
# a load from, or a store or atomic to, memory other kernels see (not shared, local, param or const space)
GLOBAL_LOAD = re.compile(r"(?m)^\s*(?:@!?%p\d+\s+)?ld\.(?!shared|local|param|const)")
GLOBAL_WRITE = re.compile(r"(?m)^\s*(?:@!?%p\d+\s+)?(?:st|atom|red)\.(?!shared|local|param)")


def before_wait(ptx: str) -> str:
    """What a PDL kernel's PTX does before its ``griddepcontrol.wait`` (hyla/model/ops/gpu/pdl.py:
    weight loads at most, no write): its global loads and writes there."""
    head = ptx.split("griddepcontrol.wait")[0]
    return f"{len(GLOBAL_LOAD.findall(head))} loads, {len(GLOBAL_WRITE.findall(head))} writes before it"


def compile_only(arch: int) -> list[str]:
    """Route every Triton launch to a compile for ``arch``; returns the list each compile appends to."""
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    driver.set_active(CompileOnlyDriver(arch))
    compiled: list[str] = []
    run = JITFunction.run

    def compile_instead(self, *args, grid, warmup, **kwargs):
        kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        ptx = kernel.asm["ptx"]  # barriers: what a chain of cross-warp reductions costs
        local = len(LOCAL_ACCESS.findall(ptx))
        gdc = ptx.count("griddepcontrol.wait")  # a PDL kernel's wait (hyla/model/ops/gpu/pdl.py)
        compiled.append(f"{self.__name__} ({kernel.metadata.num_warps} warps, {kernel.metadata.shared} B shared, "
                        f"{ptx.count('bar.sync')} bar.sync, {local} local loads/stores"
                        + (f", {gdc} griddepcontrol.wait: {before_wait(ptx)}" if gdc else "") + ")")
        return kernel

    JITFunction.run = compile_instead
    return compiled


def cases():
    """``(name, call)`` per variant: each kernel's wrapper on small tensors at the models' head sizes."""
    import torch

    from hyla.model.ops.gpu import conv1d_decode, conv1d_extend, decode_attention, gated_delta_decode, gemv, norms
    from hyla.model.ops.gpu import extend_attention
    from hyla.model.ops.gpu import gated_delta_chunks, mamba2_chunks
    from hyla.model.ops.gpu import fp8, kda_decode, latent_attention, logits, lora, mamba2_decode, moe, pdl
    from hyla.model.ops.gpu import selective_scan
    from hyla.model.ops.gpu.segment_checkpoints import SegmentCheckpoints
    from hyla.model.ops.kda import DecayGate
    from hyla.model.ops.varlen import VarlenPlan

    long = lambda *v: torch.tensor(v, dtype=torch.long)  # noqa: E731
    chains = torch.tensor([[1, 2], [3, 4], [5, 6]])  # a verify step: 2 requests of 2-token chains
    for dt in (torch.bfloat16, torch.float32):
        r = lambda *shape: torch.randn(*shape).to(dt)  # noqa: E731
        f32 = lambda *shape: torch.randn(*shape)  # noqa: E731
        n = str(dt).split(".")[-1]
        hidden, heads, dh = 256, 2, 128
        # norms
        yield f"rms_norm {n}", lambda: norms.rms_norm_fused(r(3, hidden), f32(hidden), 1e-6)
        yield f"add_rms_norm {n}", lambda: norms.add_rms_norm_fused(r(3, hidden), r(3, hidden), f32(hidden), 1e-6)
        yield f"gated_rms_norm {n}", lambda: norms.gated_rms_norm_fused(r(3, heads * dh), r(3, heads * dh), r(dh), 1e-6,
                                                                         heads)
        yield f"silu_mul {n}", lambda: norms.silu_mul_fused(r(3, 2 * 512))
        yield f"sigmoid_gate {n}", lambda: norms.sigmoid_gate_fused(r(3, heads, 256), r(3, heads, 512)[:, :, 256:])
        # the out projection + residual add + norm, each prologue, one row (GEMV) and more (tl.dot)
        for prologue in gemv.PROLOGUES:
            for rows in (1, 3):
                k = 2 * 512 if prologue == "silu_mul" else heads * dh
                gate = (r(rows, heads * dh), r(dh), 1e-6) if prologue == "gated_norm" else None
                yield f"linear_add_rms_norm {prologue} x{rows} {n}", lambda rows=rows, k=k, gate=gate, p=prologue: \
                    gemv.linear_add_rms_norm(r(rows, k), r(hidden, k // 2 if p == "silu_mul" else k), r(rows, hidden),
                                             f32(hidden), 1e-6, torch.zeros(1, dtype=torch.int32), p, gate)
        # the in projections' GEMV (K = the model's hidden size; a K that is not a power of two)
        for k in (1024, 1000):
            yield f"linear K={k} {n}", lambda k=k: gemv.linear(r(1, k), r(300, k))
        # LoRA adapters' shrink and expand (4 slots of width 192: a qkv_proj's three sources at rank 64), each row
        # its own slot (a decode graph's) or one slot for every row (an extend's, an expanded slot index)
        ranks = torch.tensor([0, 16, 0, 192, 8], dtype=torch.int32)
        for label, slots in (("rows", long(1, 0, 3)), ("one slot", long(4).expand(3))):
            yield f"lora_shrink {label} {n}", lambda slots=slots: lora.shrink(r(3, 1000), r(1000, 4 * 192), slots, ranks,
                                                                             192)
            yield f"lora_expand {label} {n}", lambda slots=slots: lora.expand_(r(3, 1000), f32(3, 192), r(4 * 192, 1000),
                                                                              slots, ranks, 192)
        # a MoE step's gathered experts (K: the hidden size into the experts, their width out of them)
        for k, out, per_row in ((1024, 2 * 512, 2), (512, 1024, 1)):  # in: 3 tokens' 2 assignments each
            yield f"expert_linear K={k} {n}", lambda k=k, out=out, per_row=per_row: gemv.expert_linear(
                r(6 // per_row, k), r(4, out, k), torch.tensor([0, 3, 1, 1, 2, 0]), per_row)
        # a larger MoE step's grouped experts: decode (few pairs an expert: small tiles) and an extend (many)
        for t, k in ((16, 8), (256, 8)):
            ids = torch.stack([torch.randperm(64)[:k] for _ in range(t)])
            yield f"expert_gemm in, {t} tokens top-{k} {n}", lambda ids=ids, t=t: moe.expert_gemm(
                r(t, 1024), r(64, 2 * 512, 1024), moe.plan(ids, 64), per_row=ids.shape[1])
            yield f"expert_gemm out, {t} tokens top-{k} {n}", lambda ids=ids, t=t: moe.expert_gemm(
                r(t * ids.shape[1], 512), r(64, 1024, 512), moe.plan(ids, 64), per_row=1)
        # FP8 weights with 128 x 128 block scales (hyla/model/quantization.py): the GEMV, the GEMM past it,
        # the experts gathered and grouped; bf16 only (what a GPU engine computes in)
        if dt == torch.bfloat16:
            q = lambda *shape: torch.randn(*shape).to(torch.float8_e4m3fn)  # noqa: E731
            s = lambda *shape: torch.rand(*shape[:-2], -(-shape[-2] // 128), -(-shape[-1] // 128))  # noqa: E731
            yield "fp8 linear x1 (GEMV)", lambda: fp8.linear(r(1, 1024), q(300, 1024), s(300, 1024), (128, 128))
            yield "fp8 linear x40 (GEMM) + bias", lambda: fp8.linear(r(40, 1024), q(300, 1024), s(300, 1024),
                                                                     (128, 128), r(300))
            yield "fp8 expert_linear", lambda: gemv.expert_linear(r(3, 1024), q(4, 1024, 1024), torch.tensor(
                [0, 3, 1, 1, 2, 0]), 2, scale=s(4, 1024, 1024), block=(128, 128))
            for t in (16, 256):
                ids = torch.stack([torch.randperm(64)[:8] for _ in range(t)])
                yield f"fp8 expert_gemm in, {t} tokens", lambda ids=ids, t=t: moe.expert_gemm(
                    r(t, 1024), q(64, 1024, 1024), moe.plan(ids, 64), per_row=8, scale=s(64, 1024, 1024),
                    block=(128, 128))
        # a MoE layer's softmax router and its combine (the experts' weighted sum, the gated shared expert)
        yield f"softmax_topk {n}", lambda: moe.softmax_topk(r(3, 64), 8, True)
        yield f"combine {n}", lambda: moe.combine(r(3 * 8, 1024), r(3, 8), r(3, 1024), r(3, 1))
        # convs
        c, kk = 3 * heads * dh, 4
        for chain in (None, chains):
            yield f"conv1d_update chain={chain is not None} {n}", lambda chain=chain: \
                conv1d_decode.causal_conv1d_update_fused(r(2 if chain is None else 4, c), r(c, kk), None,
                                                         r(8, c, kk - 1), long(1, 2), "silu", chain=chain)
        plan = VarlenPlan.from_tensors(long(0, 5, 12), 12, long(1, 2), f32(8, 4), long(0, 1), long(1, 6), long(4, 5),
                                       torch.device("cpu"))
        yield f"conv1d_extend {n}", lambda: conv1d_extend.causal_conv1d_varlen_fused(r(12, c), r(c, kk), r(c),
                                                                                     r(8, c, kk - 1), plan, "silu")
        # Gated DeltaNet: decode, chains, segments (recurrent, in chunks) with and without checkpoints
        hk, hv, dk, dv = 1, 2, 128, 128
        width = 2 * hk * dk + hv * dv
        states = f32(8, hv, dk, dv)
        for chain in (None, chains):
            rows = 2 if chain is None else 4
            yield f"gdn_decode chain={chain is not None} {n}", lambda chain=chain, rows=rows: \
                gated_delta_decode.gated_delta_decode_fused(r(rows, width), r(rows, hv), r(rows, hv), f32(hv), f32(hv),
                                                           states, long(1, 2), hk, dk, chain=chain)
            yield f"gdn_conv_decode chain={chain is not None} {n}", lambda chain=chain, rows=rows: \
                gated_delta_decode.gated_delta_conv_decode_fused(
                    r(rows, width), r(width, 4), r(8, width, 3), torch.zeros(2 * hk, dtype=torch.int32), r(rows, hv),
                    r(rows, hv), f32(hv), f32(hv), states, long(1, 2), hk, dk, chain=chain)
        ckpts = SegmentCheckpoints(states, long(0, 1, 2), long(3, 6), long(5, 6))
        for with_ckpts in (None, ckpts):
            yield f"gdn_segments ckpts={with_ckpts is not None} {n}", lambda with_ckpts=with_ckpts: \
                gated_delta_decode.gated_delta_segments_fused(r(12, width), r(12, hv), r(12, hv), f32(hv), f32(hv),
                                                             states, long(1, 2), long(0, 5), long(0, 5, 12),
                                                             torch.empty(12, hv, dv, dtype=dt), hk, dk, with_ckpts)
            for wy in (True, False) if dt == torch.bfloat16 else ():  # the chunked kernels run in bf16/fp16
                # prefills only (fla_chunk's rule); with and without the WY pre-pass (WY_PREPASS)
                @mock.patch.object(gated_delta_chunks, "WY_PREPASS", wy)
                def gdn_chunks(with_ckpts=with_ckpts):
                    gated_delta_chunks.gated_delta_chunks_fused(
                        r(12, width), r(12, hv), r(12, hv), f32(hv), f32(hv), states, long(1, 2), long(0, 5),
                        long(0, 5, 12), torch.empty(12, hv, dv, dtype=dt), hk, dk, with_ckpts, longest=7)
                yield f"gdn_chunks wy={wy} ckpts={with_ckpts is not None} {n}", gdn_chunks
        # OLMo-Hybrid's Gated DeltaNet: keys of 96, values of 192, beta = 2 sigmoid(b) (BETA_SCALE)
        ohk, odk, odv = 2, 96, 192
        owidth, ostates = 2 * ohk * odk + ohk * odv, f32(8, ohk, odk, odv)
        yield f"gdn_decode olmo {n}", lambda: gated_delta_decode.gated_delta_decode_fused(
            r(2, owidth), r(2, ohk), r(2, ohk), f32(ohk), f32(ohk), ostates, long(1, 2), ohk, odk, beta_scale=2.0)
        yield f"gdn_conv_decode olmo {n}", lambda: gated_delta_decode.gated_delta_conv_decode_fused(
            r(2, owidth), r(owidth, 4), r(8, owidth, 3), torch.zeros(2 * ohk, dtype=torch.int32), r(2, ohk), r(2, ohk),
            f32(ohk), f32(ohk), ostates, long(1, 2), ohk, odk, beta_scale=2.0)
        yield f"gdn_segments olmo {n}", lambda: gated_delta_decode.gated_delta_segments_fused(
            r(12, owidth), r(12, ohk), r(12, ohk), f32(ohk), f32(ohk), ostates, long(1, 2), long(0, 5), long(0, 5, 12),
            torch.empty(12, ohk, odv, dtype=dt), ohk, odk, None, beta_scale=2.0)
        if dt == torch.bfloat16:
            yield f"gdn_chunks olmo {n}", lambda: gated_delta_chunks.gated_delta_chunks_fused(
                r(12, owidth), r(12, ohk), r(12, ohk), f32(ohk), f32(ohk), ostates, long(1, 2), long(0, 5),
                long(0, 5, 12), torch.empty(12, ohk, odv, dtype=dt), ohk, odk, None, longest=7, beta_scale=2.0)
        # Mamba2: decode, segments (recurrent, in chunks)
        h, p, g, ns = 4, 64, 1, 128
        mstates = f32(8, h, p, ns)
        yield f"mamba2_decode {n}", lambda: mamba2_decode.mamba2_state_update_fused(
            r(2, h * p), r(2, h), f32(h), r(2, g * ns), r(2, g * ns), f32(h), f32(h), mstates, long(1, 2), (0.0, 1e9))
        mckpts = SegmentCheckpoints(mstates, long(0, 1, 2), long(3, 6), long(5, 6))
        for with_ckpts in (None, mckpts):
            yield f"mamba2_segments ckpts={with_ckpts is not None} {n}", lambda with_ckpts=with_ckpts: \
                mamba2_decode.mamba2_segments_fused(r(12, h * p), r(12, h), f32(h), r(12, g * ns), r(12, g * ns), None,
                                                    f32(h), mstates, long(1, 2), long(0, 5), long(0, 5, 12),
                                                    torch.empty(12, h, p, dtype=dt), None, with_ckpts)
            if dt == torch.bfloat16:  # (as the chunked Gated DeltaNet kernel)
                yield f"mamba2_chunks ckpts={with_ckpts is not None} {n}", lambda with_ckpts=with_ckpts: \
                    mamba2_chunks.mamba2_chunks_fused(r(12, h * p), r(12, h), f32(h), r(12, g * ns), r(12, g * ns),
                                                      f32(h), f32(h), mstates, long(1, 2), long(0, 5), long(0, 5, 12),
                                                      torch.empty(12, h, p, dtype=dt), (0.0, 1e9), with_ckpts)
        # Mamba1 (Jamba): decode and chains with the gate, segments with and without checkpoints
        ch, n1 = 256, 16
        sstates, a1 = f32(8, ch, n1), -f32(ch, n1).abs()
        for chain in (None, chains):
            rows = 2 if chain is None else 4
            yield f"mamba1_decode chain={chain is not None} {n}", lambda chain=chain, rows=rows: \
                selective_scan.selective_state_update_fused(r(rows, ch), r(rows, ch), a1, r(rows, n1), r(rows, n1),
                                                            f32(ch), f32(ch), sstates, long(1, 2), r(rows, ch),
                                                            chain=chain)
        sckpts = SegmentCheckpoints(sstates, long(0, 1, 2), long(3, 6), long(5, 6))
        for with_ckpts in (None, sckpts):
            yield f"mamba1_segments ckpts={with_ckpts is not None} {n}", lambda with_ckpts=with_ckpts: \
                selective_scan.selective_scan_segments_fused(r(12, ch), r(12, ch), a1, r(12, n1), r(12, n1), f32(ch),
                                                             f32(ch), sstates, long(1, 2), long(0, 5), long(0, 5, 12),
                                                             torch.empty(12, ch, dtype=dt), r(12, ch), with_ckpts)
        # Kimi-Linear: KDA's decode (heads of 128, as the published model) and chains; MLA's decode
        # attention over its 576-wide latent (halves of 288 in the K and V buffers), 32 heads
        kstates = f32(8, 2, 128, 128)
        for chain in (None, chains):
            rows = 2 if chain is None else 4
            yield f"kda_decode chain={chain is not None} {n}", lambda chain=chain, rows=rows: \
                kda_decode.kda_decode_fused(r(rows, 3 * 2 * 128), r(rows, 2 * 128), r(rows, 2), f32(2), f32(2 * 128),
                                            kstates, long(1, 2), chain=chain)
            yield f"kda_conv_decode chain={chain is not None} {n}", lambda chain=chain, rows=rows: \
                kda_decode.kda_conv_decode_fused(
                    r(rows, 3 * 2 * 128), r(3 * 2 * 128, 4), r(8, 3 * 2 * 128, 3), torch.zeros(2 * 2, dtype=torch.int32),
                    r(rows, 2 * 128), r(rows, 2), f32(2), f32(2 * 128), kstates, long(1, 2), chain=chain)
        kckpts = SegmentCheckpoints(kstates, long(0, 1, 2), long(3, 6), long(5, 6))
        for with_ckpts in (None, kckpts):
            yield f"kda_segments ckpts={with_ckpts is not None} {n}", lambda with_ckpts=with_ckpts: \
                kda_decode.kda_segments_fused(r(12, 3 * 2 * 128), r(12, 2 * 128), r(12, 2), f32(2), f32(2 * 128),
                                              kstates, long(1, 2), long(0, 5), long(0, 5, 12),
                                              torch.empty(12, 2, 128, dtype=dt), with_ckpts)
        ling = DecayGate(-5.0, True)  # Ling 3's decay: bounded, rounded to the model dtype
        yield f"kda_decode ling {n}", lambda: kda_decode.kda_decode_fused(
            r(2, 3 * 2 * 128), r(2, 2 * 128), r(2, 2), f32(2), f32(2 * 128), kstates, long(1, 2), gate=ling)
        yield f"kda_conv_decode ling {n}", lambda: kda_decode.kda_conv_decode_fused(
            r(2, 3 * 2 * 128), r(3 * 2 * 128, 4), r(8, 3 * 2 * 128, 3), torch.zeros(2 * 2, dtype=torch.int32),
            r(2, 2 * 128), r(2, 2), f32(2), f32(2 * 128), kstates, long(1, 2), gate=ling)
        yield f"kda_segments ling {n}", lambda: kda_decode.kda_segments_fused(
            r(12, 3 * 2 * 128), r(12, 2 * 128), r(12, 2), f32(2), f32(2 * 128), kstates, long(1, 2), long(0, 5),
            long(0, 5, 12), torch.empty(12, 2, 128, dtype=dt), None, gate=ling)
        ltable = torch.zeros(4, 16, dtype=torch.long)
        yield f"latent_decode_attention {n}", lambda: latent_attention.paged_latent_decode_attention(
            r(2, 32, 576), r(64, 1, 288), r(64, 1, 288), ltable, long(1, 2), long(9, 3), 576**-0.5, 512)
        yield f"latent_extend_attention {n}", lambda: latent_attention.paged_latent_extend_attention(
            r(5, 32, 576), r(64, 1, 288), r(64, 1, 288), ltable, long(1), long(9, 10, 11, 12, 13), 576**-0.5, 512)
        # attention: the q/k prologue (norm + RoPE + K/V writes), split-KV decode with the output gate
        hq, hkv, d = 4, 1, 256
        kb, vb = r(64, hkv, d), r(64, hkv, d)
        qkv = r(2, hq * d * 2 + 2 * hkv * d)
        rope = (long(5, 6), f32(32))  # positions, inv_freq: RoPE on 64 channels
        yield f"qk_prologue {n}", lambda: decode_attention.decode_qk_prologue(
            qkv, hq, hkv, d, True, kb, vb, long(5, 6), f32(hq + hkv, d), 1e-6, rope)
        table = torch.zeros(4, 16, dtype=torch.long)
        yield f"paged_decode_attention {n}", lambda: decode_attention.paged_decode_attention(
            r(2, hq, d), kb, vb, table, long(1, 2), long(9, 3), d**-0.5, gate=r(2, hq, 2 * d)[:, :, d:])
        # an extend's causal split-KV attention over the request table: 4 query heads per KV head of 256
        # (Qwen3.5), 8 of 128
        yield f"paged_extend_attention {n}", lambda: extend_attention.paged_extend_attention(
            r(5, hq, d), kb, vb, table, long(1), long(9, 10, 11, 1, 1), d**-0.5, gate=r(5, hq, 2 * d)[:, :, d:])
        yield f"paged_extend_attention 8x128 {n}", lambda: extend_attention.paged_extend_attention(
            r(5, 8, 128), r(64, 1, 128), r(64, 1, 128), table, long(1), long(9, 10, 11, 1, 1), 128**-0.5)
        # both with a sliding window (WINDOW: its own variant of each)
        yield f"paged_decode_attention window {n}", lambda: decode_attention.paged_decode_attention(
            r(2, hq, d), kb, vb, table, long(1, 2), long(9, 3), d**-0.5, gate=r(2, hq, 2 * d)[:, :, d:], window=4)
        yield f"paged_extend_attention window {n}", lambda: extend_attention.paged_extend_attention(
            r(5, hq, d), kb, vb, table, long(1), long(9, 10, 11, 1, 1), d**-0.5, gate=r(5, hq, 2 * d)[:, :, d:],
            window=4)
        yield f"paged_extend_attention 8x128 window {n}", lambda: extend_attention.paged_extend_attention(
            r(5, 8, 128), r(64, 1, 128), r(64, 1, 128), table, long(1), long(9, 10, 11, 1, 1), 128**-0.5, window=4)
        if dt == torch.bfloat16:  # a float8 KV cache (kv_cache_dtype): written rounded, read widened (bf16 q;
            # named without the dtype: no PDL variant of its own, the bf16 cases check the PDL waits)
            kb8, vb8, lb8 = kb.to(torch.float8_e4m3fn), vb.to(torch.float8_e4m3fn), r(64, 1, 288).to(torch.float8_e4m3fn)
            yield "qk_prologue kv=float8", lambda: decode_attention.decode_qk_prologue(
                qkv, hq, hkv, d, True, kb8, vb8, long(5, 6), f32(hq + hkv, d), 1e-6, rope)
            yield "paged_decode_attention kv=float8", lambda: decode_attention.paged_decode_attention(
                r(2, hq, d), kb8, vb8, table, long(1, 2), long(9, 3), d**-0.5, gate=r(2, hq, 2 * d)[:, :, d:])
            yield "paged_extend_attention kv=float8", lambda: extend_attention.paged_extend_attention(
                r(5, hq, d), kb8, vb8, table, long(1), long(9, 10, 11, 1, 1), d**-0.5, gate=r(5, hq, 2 * d)[:, :, d:])
            yield "latent_decode_attention kv=float8", lambda: latent_attention.paged_latent_decode_attention(
                r(2, 32, 576), lb8, lb8, ltable, long(1, 2), long(9, 3), 576**-0.5, 512)
            yield "latent_extend_attention kv=float8", lambda: latent_attention.paged_latent_extend_attention(
                r(5, 32, 576), lb8, lb8, ltable, long(1), long(9, 10, 11, 12, 13), 576**-0.5, 512)
            kb5, vb5 = kb.to(torch.float8_e5m2), vb.to(torch.float8_e5m2)  # e5m2 (kv_cache_dtype="fp8_e5m2")
            yield "qk_prologue kv=float8_e5m2", lambda: decode_attention.decode_qk_prologue(
                qkv, hq, hkv, d, True, kb5, vb5, long(5, 6), f32(hq + hkv, d), 1e-6, rope)
            yield "paged_decode_attention kv=float8_e5m2", lambda: decode_attention.paged_decode_attention(
                r(2, hq, d), kb5, vb5, table, long(1, 2), long(9, 3), d**-0.5, gate=r(2, hq, 2 * d)[:, :, d:])
    # the probe of PDL launches (pdl._probe: launched with PDL wherever it runs)
    yield "pdl_probe pdl", lambda: pdl._probe_kernel[(pdl.PROBE_PROGRAMS,)](
        torch.zeros(pdl.PROBE_PROGRAMS * 32), pdl.PROBE_HOLD_NS, PDL=True, launch_pdl=True)
    # the sampler's argmax + logsumexp (fp32 logits, once)
    yield "argmax_logsumexp", lambda: logits.argmax_logsumexp(torch.randn(2, 3 * logits.BLOCK + 5))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arch", type=int, default=90, help="the compute capability to compile for (90: H100/H200)")
    args = ap.parse_args()
    if os.environ.get("TRITON_INTERPRET"):
        sys.exit("unset TRITON_INTERPRET: the interpreter compiles nothing")
    compiled = compile_only(args.arch)
    from hyla.model.ops.gpu import pdl

    failed = 0
    for name, call in cases():
        variants = [(name, call)]
        if "bfloat16" in name and args.arch >= 90:  # as sm_90+ launches every kernel: with PDL
            # (hyla/model/ops/gpu/pdl.py), in place of the plain form, which the fp32 cases compile (PDL is a
            # constexpr branch of each kernel; compiling the plain bf16 form too was a third of the time)
            def with_pdl(call=call):
                with mock.patch.object(pdl, "enabled", lambda t: True):
                    call()
            variants = [(f"{name} pdl", with_pdl)]
        for label, run in variants:
            before = len(compiled)
            try:
                run()
            except Exception:  # a compile error (or a wrapper refusing the case): report it, go on
                failed += 1
                print(f"FAILED {label}\n{traceback.format_exc(limit=-3)}", flush=True)
                continue
            print(f"ok     {label}: {', '.join(compiled[before:]) or 'no launch'}", flush=True)
    print(f"{len(compiled)} kernel variants compiled for sm_{args.arch}, {failed} cases failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
