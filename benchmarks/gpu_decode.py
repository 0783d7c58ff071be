"""GPU decode and prefill speed of the whole engine against transformers and the HBM roofline.

Model (issue 10): a Qwen3.5-style dense model at Qwen3.5-0.8B dims with random weights, built with
transformers' ``Qwen3_5ForCausalLM`` and saved to a temporary directory: hidden 1024, 24 layers
(18 Gated DeltaNet + 6 gated attention, ``[linear x 3, full] x 6``), GDN 16 key / 16 value heads of
128, attention 8 query / 2 KV heads of 256, MLP 3584, vocab 151,936, tied embeddings, partial RoPE
(0.25, theta 1e7); ~0.65 B parameters, ~1.31 GB in bf16. No tokenizer: every request is
``input_ids``. ``--tiny`` shrinks it (hidden 64, 3 + 1 layers, vocab 2,048) to test on CPU.
``--moe``: the same with Qwen3.5-MoE's layers (``MOE``). ``--jamba``: a Jamba-style model instead
(``JAMBA``: transformers' ``JambaForCausalLM``, Mamba1 + attention layers, MoE in every 2nd layer;
~0.92 B parameters, ~1.85 GB in bf16), its section ``GPU decode: Jamba``. ``--kimi``: a Kimi-Linear-style model
(``KIMI``: transformers' ``KimiLinearForCausalLM``, Kimi Delta Attention + MLA layers 3:1, MoE after a dense
first layer; ~1.06 B parameters, ~2.11 GB in bf16), its section ``GPU decode: Kimi-Linear``. ``--olmo``: an
OLMo-Hybrid-style model (``OLMO``: transformers' ``OlmoHybridForCausalLM``, Gated DeltaNet with ``beta = 2 sigmoid(b)``
+ post-norm NoPE attention 3:1, dense MLPs; ~0.74 B parameters), its section ``GPU decode: OLMo-Hybrid``.
``--zamba2``: a Zamba2-style model (``ZAMBA2``: transformers' ``Zamba2ForCausalLM``, Mamba2 layers, every 6th a hybrid
that runs one of two weight-shared attention + GeGLU blocks with its own adapters; ~0.52 B parameters), its section
``GPU decode: Zamba2`` (its roofline reads a shared block's weights once per layer that runs it). ``--minimax``: a
MiniMax-style model (``MINIMAX``: transformers' ``MiniMaxForCausalLM``, lightning attention + softmax attention 7:1, a
MoE in every layer, scaled post-norm residuals; ~1.43 B parameters), its section ``GPU decode: MiniMax``.

Measured in one process, hyla and transformers interleaved repeat by repeat, medians of
``--repeats`` after one untimed warm-up pass of everything (Triton compilation, graph capture):

* **decode**, batch B in ``--batches``: B concurrent requests with fresh random 128-token prompts,
  greedy, EOS ignored, run with 1 and with ``1 + N`` new tokens; decode tok/s =
  ``B * N / (t(1 + N) - t(1))``, so prefill and start-up cancel. hyla: one ``Engine.generate`` of
  B requests; transformers: one batched ``generate`` (equal lengths, no padding), batches up to
  ``--hf-max-batch`` only. transformers uses fla's Triton kernels when ``fla`` is importable.
* **roofline**: bytes one decode step must read from HBM (weights: every parameter, the tied
  embedding once as the full ``lm_head``; per request: the fp32 SSM and conv states read and
  written, the KV cache read at the mean context) over the bandwidth of a 1 GiB device copy
  measured here (bytes read + written).
* **prefill**: time to first token of one fresh 4,096-token prompt (hyla: ``generate`` with
  ``max_new_tokens=1``; transformers: one forward keeping only the last logits).
* **cached TTFT** (hyla only): a 4,096-token prompt whose first 3,800 tokens were sent before with
  another tail and a checkpoint at 3,800 (a shared system prompt); its TTFT as % of cold.

Before timing, one greedy 8-token request on each side checks that both run the same model (bf16
rounding on random weights may part them after a few tokens). Prints a markdown table and writes the
``## GPU decode`` section of docs/benchmarks.md; ``--json PATH`` keeps every raw number
(``raw_seconds``: per repeat, ``*_decode_B`` = t(1 + N) - t(1), ``*_ttft`` = TTFT, in seconds).

    PYTHONUNBUFFERED=1 .venv/bin/python benchmarks/gpu_decode.py [--repeats 5] [--batches 1,8,32,64,128]
        [--hf-max-batch 32] [--prompt-tokens 128] [--new-tokens 128] [--prefill-tokens 4096]
        [--cached-tokens 3800] [--no-cuda-graph] [--overlap-schedule auto|on|off] [--hyla-only | --hf-only]
        [--log-compiles] [--gemv-max-rows N] [--gemv-in 0|1] [--pdl 0|1] [--fuse-conv 0|1] [--gdn-wy 0|1]
        [--variants "pdl=1,gemv-in=1; pdl=0,gemv-in=1"] [--moe | --jamba | --kimi | --olmo | --zamba2 | --minimax]
        [--json PATH]
        [--no-write]
    .venv/bin/python benchmarks/gpu_decode.py --device cpu --tiny --batches 1,2 --new-tokens 4 \\
        --prefill-tokens 64 --cached-tokens 48 --repeats 1 --no-write            # CPU smoke test
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib.util
import json
import random
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

import checkpoints  # noqa: E402  (tests/checkpoints.py: the Qwen3.5 config keys, perturb_constants)

LAYER_TYPES = ["linear_attention"] * 3 + ["full_attention"]
FULL = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3584, num_hidden_layers=24,
            layer_types=LAYER_TYPES * 6, num_attention_heads=8, num_key_value_heads=2, head_dim=256,
            linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128,
            linear_conv_kernel_dim=4, max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25})
TINY = dict(FULL, vocab_size=2048, hidden_size=64, intermediate_size=128, num_hidden_layers=4, layer_types=LAYER_TYPES,
            num_attention_heads=2, num_key_value_heads=1, head_dim=32, linear_num_key_heads=2,
            linear_num_value_heads=2, linear_key_head_dim=32, linear_value_head_dim=32)
# --moe: the same decoder with Qwen3.5-MoE's layer (Qwen3.5-35B-A3B's experts: top-8, 512 wide, and a
# shared expert; 64 of them here, at hidden 1,024) in place of the MLP
MOE = dict(num_experts=64, num_experts_per_tok=8, moe_intermediate_size=512, shared_expert_intermediate_size=512)
TINY_MOE = dict(MOE, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
# --jamba: transformers' JambaForCausalLM (hyla/model/jamba.py; its Mamba1 layers' Triton kernels in
# hyla/model/ops/gpu/selective_scan.py). Jamba's own layout (v0.1, 1.5 Mini and Large alike) scaled to the
# Qwen3.5 model's width and depth: hidden 1,024 and 24 layers, attention in every 8th from layer 4 (3 attention
# + 21 Mamba1: Jamba's 1:7), Mamba1 d_state 16, expand 2 (inner 2,048), conv 4, dt rank auto (64); MoE in every
# 2nd layer (12 of 24) with Jamba's routing, 16 experts, top-2 — so the engine meets the E and k a real Jamba
# has. The FFN width is the one knob scaled down (Jamba's 3.5 x hidden would make 2.2 B parameters): 1,024 for
# the experts and the other layers' MLPs alike (Jamba has one intermediate_size), which lands at ~0.92 B
# parameters (1.85 GB in bf16; a batch-1 step reads ~0.33 B of them, the Qwen3.5 model's 0.65 B), the same
# order as the Qwen3.5 model. Attention: 8 query / 2 KV heads as the Qwen3.5 model's, of 128 (Jamba: hidden / heads; no RoPE).
# Jamba's vocab of 65,536, untied embeddings; its token ids (pad 0, bos 1, eos 2).
JAMBA = dict(vocab_size=65536, hidden_size=1024, intermediate_size=1024, num_hidden_layers=24, attn_layer_period=8,
             attn_layer_offset=4, expert_layer_period=2, expert_layer_offset=1, num_experts=16, num_experts_per_tok=2,
             num_attention_heads=8, num_key_value_heads=2, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2,
             mamba_dt_rank="auto", max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=False,
             pad_token_id=0, bos_token_id=1, eos_token_id=2)
# tiny: 4 layers (3 Mamba1 + attention at layer 2, as the tiny Qwen3.5 model's 3 + 1), MoE in layers 1 and 3 (4
# experts, top-2), dt rank auto (4)
TINY_JAMBA = dict(JAMBA, vocab_size=2048, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  attn_layer_period=4, attn_layer_offset=2, num_experts=4, num_attention_heads=2, num_key_value_heads=1)
# --kimi: transformers' KimiLinearForCausalLM (hyla/model/kimi_linear.py; its decode kernels in
# hyla/model/ops/gpu/kda_decode.py and latent_attention.py). Kimi-Linear-48B-A3B's layout scaled to the Qwen3.5
# model's width and depth: hidden 1,024 and 24 layers, MLA in every 4th ([KDA x 3, MLA] x 6: 18 KDA + 6 MLA,
# Kimi's 3:1 and its 1-based full_attn_layers 4, 8, ..., 24, less its 27th); KDA 8 heads of 128 (the KDA width
# = hidden, where Kimi's 32 x 128 is 1.8 x its 2,304), conv 4; MLA exactly Kimi's per head: 8 heads (= KV heads),
# kv_lora_rank 512 + rope 64 (a 576-wide latent cached per token), nope 128, v 128, no q LoRA, no RoPE (Kimi's
# MLA is NoPE: k_pe is never rotated). FFN: layer 0 a dense SwiGLU MLP of 4 x hidden (Kimi's 9,216 = 4 x 2,304,
# first_k_dense_replace 1), then MoE in 23 layers with Kimi's routing (sigmoid scores + correction bias, one
# group, renormalised top-k x 2.446) and one shared expert: top-8, Kimi's k, so the engine meets the 8
# (token, expert) pairs a token makes in a real Kimi-Linear; 32 experts of 256 (Kimi's 256 experts would be
# 4.6 B parameters even at this width; 32 x top-8 is k/E = 1/4, and a token's routed width 8 x 256 = 2 x hidden,
# Kimi's 8 x 1,024 = 3.6 x its hidden). Kimi's vocab of 163,840, untied (transformers' Kimi-Linear never ties);
# ~1.06 B parameters (2.11 GB in bf16: 0.58 B of them routed experts, 0.34 B the embedding and lm_head), of
# which a batch-1 step reads ~0.45 B (the Qwen3.5 model's 0.65 B, the Jamba model's 0.33 B). Token ids as the
# tests' (pad 0, bos 1, eos 2; the random prompts draw from 3 up).
KIMI = dict(vocab_size=163840, hidden_size=1024, intermediate_size=4096, moe_intermediate_size=256,
            num_hidden_layers=24, layer_types=LAYER_TYPES * 6, mlp_layer_types=["dense"] + ["sparse"] * 23,
            num_attention_heads=8, num_key_value_heads=8, kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128,
            qk_rope_head_dim=64, v_head_dim=128, linear_num_heads=8, linear_head_dim=128, linear_conv_kernel_dim=4,
            num_local_experts=32, num_experts_per_tok=8, n_shared_experts=1, routed_scaling_factor=2.446,
            max_position_embeddings=32768, rms_norm_eps=1e-5, tie_word_embeddings=False, pad_token_id=0,
            bos_token_id=1, eos_token_id=2)
# tiny: 4 layers (3 KDA + MLA at layer 3, as the tiny Qwen3.5 model's 3 + 1), KDA 2 heads of 32; MLA 2 heads,
# kv_lora_rank 32 + rope 16 (a 48-wide latent), nope 32, v 32; layer 0 dense (128), MoE in 1-3 (4 experts of
# 32, top-2, a shared expert)
TINY_KIMI = dict(KIMI, vocab_size=2048, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                 num_hidden_layers=4, layer_types=LAYER_TYPES, mlp_layer_types=["dense"] + ["sparse"] * 3,
                 num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=32, qk_nope_head_dim=32,
                 qk_rope_head_dim=16, v_head_dim=32, linear_num_heads=2, linear_head_dim=32, num_local_experts=4,
                 num_experts_per_tok=2)


# --olmo: transformers' OlmoHybridForCausalLM (hyla/model/olmo_hybrid.py: Qwen3.5's Gated DeltaNet kernels with
# beta = 2 sigmoid(b), attention layers post-norm). Olmo-Hybrid-7B's layout scaled to the Qwen3.5 model's width and
# depth: hidden 1,024, 24 layers ([GDN x 3, attention] x 6, OLMo's every 4th from layer 3), attention 8 heads of 128
# (= KV heads, OLMo's MHA; hidden / heads), NoPE as the released checkpoints, q/k normalised over all heads; GDN as
# many key as value heads (8), keys of 96 (0.75 x hidden / heads, OLMo's default) and values of 192 (twice), conv 4;
# SwiGLU MLP 3,584 (the Qwen3.5 model's); OLMo's vocab of 100,352, untied. ~0.74 B parameters (~1.47 GB in bf16).
OLMO = dict(vocab_size=100352, hidden_size=1024, intermediate_size=3584, num_hidden_layers=24,
            layer_types=LAYER_TYPES * 6, num_attention_heads=8, num_key_value_heads=8, linear_num_key_heads=8,
            linear_num_value_heads=8, linear_key_head_dim=96, linear_value_head_dim=192, linear_conv_kernel_dim=4,
            linear_allow_neg_eigval=True, rope_parameters={"rope_type": "default", "rope_theta": None},
            max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=False, pad_token_id=0,
            bos_token_id=1, eos_token_id=2)
# tiny: 4 layers (3 GDN + attention at layer 3), GDN 2 heads, keys of 24 and values of 48, attention 2 heads of 32
TINY_OLMO = dict(OLMO, vocab_size=2048, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                 layer_types=LAYER_TYPES, num_attention_heads=2, num_key_value_heads=2, linear_num_key_heads=2,
                 linear_num_value_heads=2, linear_key_head_dim=24, linear_value_head_dim=48)


# --zamba2: transformers' Zamba2ForCausalLM (hyla/model/zamba2.py: Bamba's Mamba2 kernels, attention on [x | e]).
# Zamba2's layout at the Qwen3.5 model's width and depth: hidden 1,024, 24 layers ([Mamba2 x 5, hybrid] x 4), Mamba2
# 32 heads of 64 (expand 2), 64 states, one group, conv 4; two shared blocks (the hybrid layers take them in turn),
# attention 8 heads of 256 (2 hidden / heads; KV heads as many: the q/k/v adapters need it), RoPE theta 1e4, GeGLU MLP
# 4 hidden; adapters of rank 128 on q, k, v and the MLP; Zamba2's vocab of 32,000, tied. ~0.52 B parameters.
ZAMBA2 = dict(vocab_size=32000, hidden_size=1024, num_hidden_layers=24,
              layers_block_type=(["mamba"] * 5 + ["hybrid"]) * 4, num_attention_heads=8, num_key_value_heads=8,
              mamba_d_state=64, mamba_d_conv=4, mamba_expand=2, n_mamba_heads=32, mamba_ngroups=1, num_mem_blocks=2,
              use_shared_attention_adapter=True, adapter_rank=128, use_mem_rope=True, intermediate_size=4096,
              hidden_act="gelu", rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
              time_step_min=0.001, max_position_embeddings=32768, rms_norm_eps=1e-5, tie_word_embeddings=True,
              pad_token_id=0, bos_token_id=1, eos_token_id=2)
# tiny: 4 layers (Mamba2, hybrid, Mamba2, hybrid) over one shared block (run twice), 2 heads of 64
TINY_ZAMBA2 = dict(ZAMBA2, vocab_size=2048, hidden_size=64, num_hidden_layers=4,
                   layers_block_type=["mamba", "hybrid"] * 2, num_attention_heads=2, num_key_value_heads=2,
                   mamba_d_state=16, n_mamba_heads=4, num_mem_blocks=1, adapter_rank=8, intermediate_size=128)

# --minimax: transformers' MiniMaxForCausalLM (hyla/model/minimax.py: lightning attention on Mamba2's SSD kernels with
# dt held at 1). MiniMax-Text-01's layout at the Qwen3.5 model's width and depth: hidden 1,024, 24 layers ([lightning x 7,
# softmax] x 3: MiniMax's 7:1), 8 heads of 128 (lightning and softmax alike; hidden / heads, as MiniMax's 64 x 128 at
# 6,144), softmax attention with 1 KV head (MiniMax's 8 query heads a KV head) and RoPE theta 1e7 over whole heads
# (transformers'); a MoE in every layer, top-2 as MiniMax's, 8 experts of 1,536 (MiniMax's 1.5 x hidden; its 32
# experts would be 3.6 B parameters at this width); DeepNorm's alpha (2 x 24) ** 0.25 on every residual, beta 1
# (MiniMax's kind of factors); MiniMax's vocab of 200,064, untied. ~1.43 B parameters (0.91 B of them routed
# experts, 0.2 B each embedding), of which a batch-1 step reads ~0.55 B.
MINIMAX = dict(vocab_size=200064, hidden_size=1024, intermediate_size=1536, num_hidden_layers=24,
               layer_types=(["linear_attention"] * 7 + ["full_attention"]) * 3, num_attention_heads=8,
               num_key_value_heads=1, head_dim=128, num_local_experts=8, num_experts_per_tok=2,
               rope_parameters={"rope_type": "default", "rope_theta": 1e7},
               **{f"{part}_alpha_factor": 48 ** 0.25 for part in ("full_attn", "linear_attn", "mlp")},
               **{f"{part}_beta_factor": 1.0 for part in ("full_attn", "linear_attn", "mlp")},
               block_size=256, max_position_embeddings=32768, rms_norm_eps=1e-5, tie_word_embeddings=False,
               pad_token_id=0, bos_token_id=1, eos_token_id=2)
# tiny: 4 layers (3 lightning + softmax attention at layer 3), 2 heads of 32, 4 experts of 96, top-2
TINY_MINIMAX = dict(MINIMAX, vocab_size=2048, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                    layer_types=LAYER_TYPES, num_attention_heads=2, head_dim=32, num_local_experts=4)


def _qwen3_5(kw: dict):
    import transformers

    return transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**{**checkpoints.QWEN3_5_KW, **kw}))


def _qwen3_5_moe(kw: dict):  # (Qwen3.5-MoE has no dense MLP: no intermediate_size)
    import transformers

    kw = {k: v for k, v in kw.items() if k != "intermediate_size"}
    return transformers.Qwen3_5MoeForCausalLM(transformers.Qwen3_5MoeTextConfig(**{**checkpoints.QWEN3_5_MOE_KW, **kw}))


def _jamba(kw: dict):
    import transformers

    return transformers.JambaForCausalLM(transformers.JambaConfig(**{**checkpoints.JAMBA_KW, **kw}))


def _kimi(kw: dict):
    import transformers

    return transformers.KimiLinearForCausalLM(transformers.KimiLinearConfig(**{**checkpoints.KIMI_LINEAR_KW, **kw}))


def _olmo(kw: dict):
    import transformers

    return transformers.OlmoHybridForCausalLM(transformers.OlmoHybridConfig(**{**checkpoints.OLMO_HYBRID_KW, **kw}))


def _zamba2(kw: dict):
    import transformers

    return transformers.Zamba2ForCausalLM(transformers.Zamba2Config(**{**checkpoints.ZAMBA2_KW, **kw}))


def _minimax(kw: dict):
    import transformers

    return transformers.MiniMaxForCausalLM(transformers.MiniMaxConfig(**{**checkpoints.MINIMAX_KW, **kw}))


def _zamba2_reads(kw: dict, name: str) -> bool:
    """A hybrid layer reads its block's weights and, of the block's adapters, its own (``*_adapter_list.{k}``, ``k``
    its hybrid ordinal)."""
    parts = name.split(".")
    if "shared_transformer" not in parts or not any(p.endswith("_adapter_list") for p in parts):
        return True
    layer = int(parts[parts.index("layers") + 1])
    k = int(parts[next(i for i, p in enumerate(parts) if p.endswith("_adapter_list")) + 1])
    return kw["layers_block_type"][:layer].count("hybrid") == k


def _describe_zamba2(kw: dict) -> str:
    types, h, heads = kw["layers_block_type"], kw["hidden_size"], kw["num_attention_heads"]
    hybrid = [i for i, t in enumerate(types) if t == "hybrid"]
    inner = kw["mamba_expand"] * h
    adapters = "q, k, v and the MLP" if kw["use_shared_attention_adapter"] else "the MLP"
    return (f"Zamba2-style model (`Zamba2ForCausalLM`), random weights: hidden {h}, {len(types)} layers "
            f"({len(types) - len(hybrid)} Mamba2 + {len(hybrid)} hybrid at {', '.join(map(str, hybrid))}: Mamba2 after "
            f"one of {min(kw['num_mem_blocks'], len(hybrid))} shared attention + GeGLU blocks), Mamba2 "
            f"{kw['n_mamba_heads']} heads of {inner // kw['n_mamba_heads']}, {kw['mamba_d_state']} states, "
            f"{kw['mamba_ngroups']} group(s), conv {kw['mamba_d_conv']}, attention on [x | embeddings] "
            f"{heads}/{kw['num_key_value_heads']} heads of {2 * h // heads} "
            f"({'RoPE' if kw['use_mem_rope'] else 'NoPE'}), GeGLU MLP {kw['intermediate_size']}, adapters of rank "
            f"{kw['adapter_rank']} on {adapters}, vocab {kw['vocab_size']:,}, "
            f"{'tied' if kw['tie_word_embeddings'] else 'untied'} embeddings")


def _describe_minimax(kw: dict) -> str:
    types = kw["layer_types"]
    attn = [i for i, t in enumerate(types) if t == "full_attention"]
    heads, dim = kw["num_attention_heads"], kw["head_dim"]
    return (f"MiniMax-style model (`MiniMaxForCausalLM`), random weights: hidden {kw['hidden_size']}, {len(types)} "
            f"layers ({len(types) - len(attn)} lightning attention + {len(attn)} softmax attention at "
            f"{', '.join(map(str, attn))}), {heads} heads of {dim} (lightning: a fixed decay per head, an [{dim}, {dim}] "
            f"state each; softmax: {kw['num_key_value_heads']} KV head(s), RoPE theta "
            f"{kw['rope_parameters']['rope_theta']:g}), MoE in every layer ({kw['num_local_experts']} experts, "
            f"top-{kw['num_experts_per_tok']}, {kw['intermediate_size']} wide, no shared expert), residuals "
            f"{kw['linear_attn_alpha_factor']:.3f} x norm(x) + {kw['linear_attn_beta_factor']:g} x part, vocab "
            f"{kw['vocab_size']:,}, {'tied' if kw['tie_word_embeddings'] else 'untied'} embeddings")


def _describe_olmo(kw: dict) -> str:
    types = kw["layer_types"]
    attn = [i for i, t in enumerate(types) if t == "full_attention"]
    rope = (kw.get("rope_parameters") or {}).get("rope_theta")
    return (f"OLMo-Hybrid-style model (`OlmoHybridForCausalLM`), random weights: hidden {kw['hidden_size']}, "
            f"{len(types)} layers ({len(types) - len(attn)} Gated DeltaNet + {len(attn)} post-norm attention at "
            f"{', '.join(map(str, attn))}), GDN {kw['linear_num_key_heads']}/{kw['linear_num_value_heads']} heads, keys "
            f"of {kw['linear_key_head_dim']} and values of {kw['linear_value_head_dim']}, beta = "
            f"{'2 sigmoid(b)' if kw['linear_allow_neg_eigval'] else 'sigmoid(b)'}, attention "
            f"{kw['num_attention_heads']}/{kw['num_key_value_heads']} heads of {kw['hidden_size'] // kw['num_attention_heads']} "
            f"({'NoPE' if rope is None else f'RoPE theta {rope:g}'}, q/k normalised over all heads), SwiGLU MLP "
            f"{kw['intermediate_size']}, vocab {kw['vocab_size']:,}, "
            f"{'tied' if kw['tie_word_embeddings'] else 'untied'} embeddings")


def _describe_qwen3_5(kw: dict) -> str:
    moe = "num_experts" in kw
    kind = (f"Qwen3.5-MoE-style model ({kw['num_experts']} experts, top-{kw['num_experts_per_tok']}, "
            f"{kw['moe_intermediate_size']} wide, and a shared expert of {kw['shared_expert_intermediate_size']}, "
            f"in place of the MLP)") if moe else "Qwen3.5-style dense model"
    return (f"{kind}, random weights: hidden {kw['hidden_size']}, {kw['num_hidden_layers']} layers "
            f"({kw['layer_types'].count('linear_attention')} Gated DeltaNet + {kw['layer_types'].count('full_attention')} "
            f"attention), GDN {kw['linear_num_key_heads']}/{kw['linear_num_value_heads']} heads of "
            f"{kw['linear_key_head_dim']}, attention {kw['num_attention_heads']}/{kw['num_key_value_heads']} heads of "
            f"{kw['head_dim']}, {'' if moe else 'MLP ' + str(kw['intermediate_size']) + ', '}vocab "
            f"{kw['vocab_size']:,}, tied embeddings")


def _describe_jamba(kw: dict) -> str:
    layers = range(kw["num_hidden_layers"])
    attn = [i for i in layers if i % kw["attn_layer_period"] == kw["attn_layer_offset"]]
    moe = kw["num_experts"] > 1
    moe_layers = [i for i in layers if i % kw["expert_layer_period"] == kw["expert_layer_offset"]] if moe else []
    inner, dt_rank = kw["mamba_expand"] * kw["hidden_size"], kw["mamba_dt_rank"]
    dt_rank = -(-kw["hidden_size"] // 16) if dt_rank == "auto" else dt_rank  # JambaConfig's auto
    ffn = (f"MoE in {len(moe_layers)} layers (i % {kw['expert_layer_period']} = {kw['expert_layer_offset']}: "
           f"{kw['num_experts']} experts, top-{kw['num_experts_per_tok']}, {kw['intermediate_size']} wide, no shared "
           f"expert), SwiGLU MLP {kw['intermediate_size']} in the other {len(layers) - len(moe_layers)}") if moe \
        else f"SwiGLU MLP {kw['intermediate_size']}"
    return (f"Jamba-style model (`JambaForCausalLM`), random weights: hidden {kw['hidden_size']}, {len(layers)} layers "
            f"({len(layers) - len(attn)} Mamba1 + {len(attn)} attention at {', '.join(map(str, attn))}), Mamba1 d_state "
            f"{kw['mamba_d_state']}, expand {kw['mamba_expand']} (inner {inner}), conv {kw['mamba_d_conv']}, dt rank "
            f"{dt_rank}, attention {kw['num_attention_heads']}/{kw['num_key_value_heads']} heads of "
            f"{kw['hidden_size'] // kw['num_attention_heads']} (no RoPE), {ffn}, vocab {kw['vocab_size']:,}, "
            f"{'tied' if kw['tie_word_embeddings'] else 'untied'} embeddings")


def _describe_kimi(kw: dict) -> str:
    types, ffn_types = kw["layer_types"], kw["mlp_layer_types"]
    mla = [i for i, t in enumerate(types) if t == "full_attention"]
    dense = [i for i, t in enumerate(ffn_types) if t == "dense"]
    return (f"Kimi-Linear-style model (`KimiLinearForCausalLM`), random weights: hidden {kw['hidden_size']}, "
            f"{len(types)} layers ({len(types) - len(mla)} KDA + {len(mla)} MLA at {', '.join(map(str, mla))}), KDA "
            f"{kw['linear_num_heads']} heads of {kw['linear_head_dim']}, conv {kw['linear_conv_kernel_dim']}, MLA "
            f"{kw['num_attention_heads']} heads (nope {kw['qk_nope_head_dim']} + rope {kw['qk_rope_head_dim']}, v "
            f"{kw['v_head_dim']}, no RoPE, "
            f"{'no q LoRA' if kw['q_lora_rank'] is None else 'q LoRA ' + str(kw['q_lora_rank'])}) on a latent of "
            f"{kw['kv_lora_rank']} + {kw['qk_rope_head_dim']} per token, MoE in {len(ffn_types) - len(dense)} layers "
            f"({kw['num_local_experts']} experts, top-{kw['num_experts_per_tok']}, {kw['moe_intermediate_size']} wide, "
            f"sigmoid router, and {kw['n_shared_experts']} shared expert of "
            f"{kw['moe_intermediate_size'] * kw['n_shared_experts']}), SwiGLU MLP {kw['intermediate_size']} in "
            f"layer{'s' if len(dense) > 1 else ''} {', '.join(map(str, dense))}, vocab {kw['vocab_size']:,}, untied "
            f"embeddings")


@dataclasses.dataclass(frozen=True)
class ModelKind:
    """A model the benchmark builds (``--moe``, ``--jamba``, ``--kimi``, ``--olmo``, ``--zamba2``, ``--minimax``; the
    default ``qwen3_5``): its
    config keys at full size and ``--tiny``, its transformers model from them, its routed experts'
    config keys (count, top-k) for the roofline, what transformers' side runs where importable (the
    peer's kernels, named in the table), and its section of docs/benchmarks.md."""

    full: dict
    tiny: dict
    make: Callable[[dict], object]  # config keys -> a transformers model, random weights
    describe: Callable[[dict], str]  # config keys -> the section's description of the model
    section: str
    experts: tuple[str, str] | None = None  # the keys of the routed experts' count and top-k
    # transformers' Qwen3.5 and Kimi-Linear run fla's kernels, its Jamba mamba_ssm's; None: PyTorch alone (MiniMax)
    peer: str | None = "fla"
    help: str = ""
    # whether a step reads the parameter of this name (in transformers' model, each module that holds a shared
    # one naming it: Zamba2's blocks hold every layer's adapters, of which a layer reads its own)
    reads: Callable[[dict, str], bool] = lambda kw, name: True

    def routing(self, kw: dict) -> dict | None:
        """``{num_experts, num_experts_per_tok}`` of the routed experts (None: dense MLPs only)."""
        if self.experts is None or kw[self.experts[0]] <= 1:
            return None
        return dict(num_experts=kw[self.experts[0]], num_experts_per_tok=kw[self.experts[1]])


MODELS = {
    "qwen3_5": ModelKind(FULL, TINY, _qwen3_5, _describe_qwen3_5, "GPU decode"),
    "moe": ModelKind({**FULL, **MOE}, {**TINY, **TINY_MOE}, _qwen3_5_moe, _describe_qwen3_5,
                     "GPU decode: a model with MoE layers", ("num_experts", "num_experts_per_tok"),
                     help="the model with MoE layers (MOE: 64 experts, top-8, and a shared expert) in place of its "
                          "MLPs; writes its own section"),
    "jamba": ModelKind(JAMBA, TINY_JAMBA, _jamba, _describe_jamba, "GPU decode: Jamba",
                       ("num_experts", "num_experts_per_tok"), peer="mamba_ssm",
                       help="a Jamba-style model instead (JAMBA: 21 Mamba1 + 3 attention layers, 16 experts, top-2, in "
                            "every 2nd); writes its own section"),
    "kimi": ModelKind(KIMI, TINY_KIMI, _kimi, _describe_kimi, "GPU decode: Kimi-Linear",
                      ("num_local_experts", "num_experts_per_tok"),
                      help="a Kimi-Linear-style model instead (KIMI: 18 KDA + 6 MLA layers, 32 experts, top-8, and a "
                           "shared expert, after a dense layer 0); writes its own section"),
    "olmo": ModelKind(OLMO, TINY_OLMO, _olmo, _describe_olmo, "GPU decode: OLMo-Hybrid",
                      help="an OLMo-Hybrid-style model instead (OLMO: 18 Gated DeltaNet with beta = 2 sigmoid(b) + 6 "
                           "post-norm NoPE attention layers, dense MLPs); writes its own section"),
    "zamba2": ModelKind(ZAMBA2, TINY_ZAMBA2, _zamba2, _describe_zamba2, "GPU decode: Zamba2", peer="mamba_ssm",
                        reads=_zamba2_reads,
                        help="a Zamba2-style model instead (ZAMBA2: 20 Mamba2 + 4 hybrid layers over 2 shared "
                             "attention + GeGLU blocks with per-layer adapters); writes its own section"),
    "minimax": ModelKind(MINIMAX, TINY_MINIMAX, _minimax, _describe_minimax, "GPU decode: MiniMax",
                         ("num_local_experts", "num_experts_per_tok"), peer=None,
                         help="a MiniMax-style model instead (MINIMAX: 21 lightning + 3 softmax attention layers, 8 "
                              "experts, top-2, in every layer); writes its own section"),
}


def log_triton_compiles() -> list[str] | None:
    """From now on, log every Triton kernel compiled (its name and specialization) with the time:
    a compile inside a timed run is a stall (``--log-compiles``). Returns the list each compiled
    kernel's name is appended to; None if this Triton has no
    ``triton.knobs.runtime.jit_post_compile_hook``."""
    try:
        from triton import knobs
    except ImportError:
        return None
    if not hasattr(knobs.runtime, "jit_post_compile_hook"):
        return None
    compiled: list[str] = []

    def hook(*_, **kw) -> None:  # key: each argument's (type, specialization: 'D' divisible by 16, ...)
        name = str(kw.get("repr", "?")).partition("[")[0]
        compiled.append(name)
        log(f"Triton compiled {name} {str(kw.get('key', ''))[:400]}")

    knobs.runtime.jit_post_compile_hook = hook
    return compiled


def log(msg: str) -> None:
    print(f"[gpu_decode {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# the kernels' switches an A/B run sets (--flag: module, constant, int or bool, what it switches)
KNOBS = {
    "gemv-max-rows": ("hyla.model.ops.gpu.gemv", "MAX_ROWS", int, "decode steps of at most this many rows are GEMV "
                      "steps: each out projection in the next norm's kernel (0: the separate kernels, cuBLAS)"),
    "gemv-in": ("hyla.model.ops.gpu.gemv", "IN_PROJ", bool, "a GEMV step's in projections as gemv.linear (1) or "
                "cuBLAS (0)"),
    "pdl": ("hyla.model.ops.gpu.pdl", "PDL", bool, "the decode step's kernels launched with programmatic dependent "
            "launch (1) or without (0)"),
    "fuse-conv": ("hyla.model.ops.gpu.gated_delta_decode", "FUSE_CONV", bool, "the decode step's conv in the Gated "
                  "DeltaNet kernel (1) or a kernel of its own (0)"),
    "kda-fuse-conv": ("hyla.model.ops.gpu.kda_decode", "FUSE_CONV", bool, "with --kimi: the decode step's conv in the "
                      "KDA kernel (1) or a kernel of its own (0)"),
    "gdn-wy": ("hyla.model.ops.gpu.gated_delta_chunks", "WY_PREPASS", bool, "an extend's Gated DeltaNet chunks with "
               "the WY pre-pass (1) or without (0)"),
    "moe-gather-max": ("hyla.model.layers.sparse_moe", "GATHER_MAX_ASSIGNMENTS", int, "with --moe: steps of at most "
                       "this many (token, expert) pairs run their experts gathered, larger ones grouped "
                       "(moe.expert_gemm)"),
}


def set_knobs(values: dict[str, int]) -> list[str]:
    """Set switches (KNOBS: ``{flag: value}``); returns ``module.NAME = value`` for each."""
    done = []
    for flag, value in values.items():
        module, name, kind, _ = KNOBS[flag]
        setattr(importlib.import_module(module), name, kind(value))
        done.append(f"{module.rsplit('.', 1)[1]}.{name} = {kind(value)}")
    return done


def knob_value(flag: str) -> int:
    """A switch's current value, as the command line gives it."""
    module, name, _, _ = KNOBS[flag]
    return int(getattr(importlib.import_module(module), name))


def parse_variants(text: str) -> dict[str, dict[str, int]]:
    """``--variants "pdl=1,gemv-in=1; pdl=0,gemv-in=1"`` -> ``{label: {flag: value}}``, in order."""
    variants = {}
    for item in filter(None, (part.strip() for part in text.split(";"))):
        values = {}
        for pair in item.split(","):
            flag, _, value = pair.strip().partition("=")
            if flag not in KNOBS or not value.strip().lstrip("-").isdigit():
                raise ValueError(f"--variants: {pair.strip()!r} is not SWITCH=INT with a switch of {sorted(KNOBS)}")
            if KNOBS[flag][2] is bool and value.strip() not in ("0", "1"):
                raise ValueError(f"--variants: {flag} takes 0 or 1, got {value.strip()}")
            values[flag] = int(value)
        variants[item] = values
    if len(variants) < 2:
        raise ValueError("--variants needs two or more variants, separated by ';'")
    return variants


def build(out: Path, kw: dict, device: str, dtype: torch.dtype, kind: str = "qwen3_5") -> dict:
    """The random transformers model of ``MODELS[kind]`` with config keys ``kw``, built on ``device`` in
    ``dtype``, saved to ``out``; returns its sizes for the roofline (bytes one decode step reads of the
    weights; with MoE layers without the routed experts, and ``expert_bytes``: one expert's, every
    layer's)."""
    model_kind = MODELS[kind]
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = model_kind.make(kw)
    finally:
        torch.set_default_dtype(default)
    model.eval()
    with torch.no_grad():
        # non-constant norms (Jamba: also D, the conv and dt biases; Kimi-Linear: also the routers' score-correction
        # biases); peaked lm_head (Qwen3.5: the tied embedding)
        checkpoints.perturb_constants(model)
    nbytes = lambda t: t.numel() * t.element_size()  # noqa: E731
    params = list(model.parameters())  # tied: the shared matrix once
    embed, head = model.get_input_embeddings().weight, model.lm_head.weight
    # what a step reads: every parameter once per module that uses it (Zamba2's shared blocks: once per layer that
    # runs one, too big to stay in a cache between them), but the embedding (B rows) and the lm_head (once)
    uses = [p for name, p in model.named_parameters(remove_duplicate=False)
            if p is not embed and p is not head and model_kind.reads(kw, name)]
    # the routed experts: Qwen3.5-MoE's mlp.experts.*, Jamba's feed_forward.experts.*, Kimi-Linear's
    # mlp.experts.gate_up_proj / down_proj (in memory; not the shared expert — Kimi's mlp.shared_experts.* —, the
    # routers, nor the dense MLPs)
    experts = sum(nbytes(p) for name, p in model.named_parameters() if ".experts." in name)
    routing = model_kind.routing(kw)
    routed = routing["num_experts"] if routing else 0
    info = dict(params=sum(p.numel() for p in params), param_bytes=sum(nbytes(p) for p in params),
                # every step reads the whole lm_head (tied or not) but only B rows of the embedding (and
                # of the routed experts, those its tokens chose: roofline())
                weight_bytes_per_step=sum(nbytes(p) for p in uses) + nbytes(head) - experts,
                expert_bytes=experts // routed if experts else 0)
    model.save_pretrained(out, safe_serialization=True)
    del model
    return info


def fp8_savings(model: torch.nn.Module, dtype: torch.dtype) -> tuple[int, int]:
    """The bytes hyla's float8 weights save against ``dtype`` (a byte an element instead of the
    dtype's, less their fp32 scales): ``(dense projections, routed experts)``, each module once."""
    size = torch.tensor([], dtype=dtype).element_size()
    dense = routed = 0
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if p.dtype == torch.float8_e4m3fn:
                saved = p.numel() * (size - 1) - 4 * getattr(module, f"{name}_scale").numel()
                if name in getattr(module, "stacked_weights", ()):
                    routed += saved
                else:
                    dense += saved
    return dense, routed


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn, device: str) -> float:
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def bandwidth(device: str) -> tuple[float, int]:
    """Bytes/s of a device-to-device copy of a 1 GiB buffer (64 MiB on CPU), read + written; its size."""
    n = 2**30 if device.startswith("cuda") else 2**26
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    reps = 10 if device.startswith("cuda") else 2
    dst.copy_(src)
    times = [timed(lambda: [dst.copy_(src) for _ in range(reps)], device) / reps for _ in range(5)]
    del src, dst
    return 2 * n / statistics.median(times), n


def greedy(max_new: int) -> dict:
    return {"temperature": 0, "max_new_tokens": max_new, "ignore_eos": True}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), help="default: bf16 on GPU, fp32 on CPU")
    ap.add_argument("--tiny", action="store_true", help="tiny dims (hidden 64, 4 layers, vocab 2048) to test on CPU")
    model_kind = ap.add_mutually_exclusive_group()
    for name, kind in MODELS.items():
        if name != "qwen3_5":  # (the default)
            model_kind.add_argument(f"--{name}", dest="model", action="store_const", const=name, help=kind.help)
    ap.add_argument("--repeats", type=int, default=5)  # 3 let one stalled run move a median
    ap.add_argument("--batches", default="1,8,32,64,128", help="comma-separated decode batch sizes")
    ap.add_argument("--hf-max-batch", type=int, default=32, help="largest batch transformers runs")
    ap.add_argument("--prompt-tokens", type=int, default=128, help="prompt length of each decode request")
    ap.add_argument("--new-tokens", type=int, default=128, help="N decode tokens timed per request")
    ap.add_argument("--prefill-tokens", type=int, default=4096, help="prompt length of the TTFT measurements")
    ap.add_argument("--cached-tokens", type=int, default=3800, help="cached prefix of the cached-TTFT prompt")
    ap.add_argument("--no-cuda-graph", action="store_true", help="Engine(disable_cuda_graph=True), if it has it")
    ap.add_argument("--quantization", choices=("fp8",), help="Engine(quantization=...): hyla's projections and "
                    "experts quantized to float8 at load (transformers keeps the model's dtype); the roofline then "
                    "counts the bytes hyla's weights take")
    ap.add_argument("--extend-ab", action="store_true", help="also time each cached TTFT with the fused extend "
                    "(its CUDA graphs) bypassed, in the same engine: the row the graphs are measured against")
    ap.add_argument("--overlap-schedule", default=None, help="Engine(overlap_schedule=...), if it has it "
                    "(default: the engine's, auto)")
    for flag, (module, name, kind, what) in KNOBS.items():
        ap.add_argument(f"--{flag}", type=int, choices=None if kind is int else (0, 1), default=None,
                        help=f"set {module.rsplit('.', 1)[1]}.{name}: {what}")
    ap.add_argument("--variants", metavar="SPEC", help="time these settings of the switches above in one engine, "
                    "interleaved, each on a runner of its own (its graphs captured under them): e.g. "
                    "\"pdl=1,gemv-in=1; pdl=0,gemv-in=1\"; the tables are the first's, a table compares the others "
                    "with it")
    ap.add_argument("--log-compiles", action="store_true", help="log each Triton compile with the time (a compile "
                    "inside a timed repeat is a stall: the repeats' medians have hidden single runs 10x slower)")
    side = ap.add_mutually_exclusive_group()
    side.add_argument("--hyla-only", action="store_true")
    side.add_argument("--hf-only", action="store_true")
    ap.add_argument("--json", type=Path, metavar="PATH", help="write every raw number to this JSON file")
    ap.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    dev, n, p = args.device, args.new_tokens, args.prompt_tokens
    dtype_name = args.dtype or ("float32" if dev == "cpu" else "bfloat16")
    dtype = getattr(torch, dtype_name)
    if not 0 < args.cached_tokens < args.prefill_tokens:
        ap.error("--cached-tokens must be in (0, --prefill-tokens)")
    try:
        variants = parse_variants(args.variants) if args.variants else {}
    except ValueError as e:
        ap.error(str(e))
    if variants and args.hf_only:
        ap.error("--variants times hyla's engine: not with --hf-only")

    import transformers

    from benchmarks.report import machine, write_section
    from hyla import Engine
    from hyla.engine.args import EngineArgs
    from hyla.model.config import ModelConfig

    transformers.logging.set_verbosity_error()
    # transformers' Jamba runs mamba_ssm's kernels (and causal_conv1d's) where importable, else PyTorch; its
    # Qwen3.5 and Kimi-Linear, fla's (chunk / fused_recurrent gated delta rule, KDA) and causal_conv1d's
    model = MODELS[args.model or "qwen3_5"]
    kernels = {k: importlib.util.find_spec(k) is not None
               for k in dict.fromkeys(("fla", "causal_conv1d", *([model.peer] if model.peer else [])))}
    kw = model.tiny if args.tiny else model.full
    moe = model.routing(kw)  # the routed experts, for the roofline (their weights are in kw)
    log(f"{machine()}, transformers {transformers.__version__}, {dtype_name}, importable: {kernels}")
    bw, copy_bytes = bandwidth(dev)
    log(f"copy bandwidth {bw / 1e9:,.0f} GB/s")

    tmp = tempfile.TemporaryDirectory(prefix="hyla-gpu-decode-")
    path = Path(tmp.name)
    t0 = time.perf_counter()
    sizes = build(path, kw, dev, dtype, args.model or "qwen3_5")
    gc.collect()
    log(f"built and saved {sizes['params'] / 1e6:,.1f} M parameters ({sizes['param_bytes'] / 1e9:.3f} GB) "
        f"in {time.perf_counter() - t0:.1f} s")
    layout = ModelConfig.from_hf(json.loads((path / "config.json").read_text()), dtype_name).cache_layout
    vocab = kw["vocab_size"]
    rng = random.Random(0)
    fresh = lambda k: [rng.randrange(3, vocab) for _ in range(k)]  # noqa: E731

    engine, hf, opts, knobs, compiled = None, None, {}, [], None
    if not args.hf_only:
        have = {f.name for f in dataclasses.fields(EngineArgs)}
        if "disable_cuda_graph" in have:
            opts["disable_cuda_graph"] = args.no_cuda_graph
        elif args.no_cuda_graph:
            log("EngineArgs has no disable_cuda_graph: --no-cuda-graph ignored")
        if args.overlap_schedule is not None:
            if "overlap_schedule" in have:
                opts["overlap_schedule"] = args.overlap_schedule
            else:
                log("EngineArgs has no overlap_schedule: --overlap-schedule ignored")
        if args.quantization:
            if "quantization" not in have:
                ap.error("this EngineArgs has no quantization")
            opts["quantization"] = args.quantization
        if "cuda_graph_max_bs" in have and not args.no_cuda_graph:
            opts["cuda_graph_max_bs"] = max(batches)
        opts.update(max_running_requests=max(batches), max_state_slots=2 * max(batches) + 16,
                    max_total_tokens=2 * max(max(batches) * (p + n + 2), 2 * (args.prefill_tokens + 2)) + 4096)
        knobs = set_knobs({flag: getattr(args, flag.replace("-", "_")) for flag in KNOBS
                           if getattr(args, flag.replace("-", "_")) is not None})
        for knob in knobs:
            log(knob)
        if args.log_compiles and (compiled := log_triton_compiles()) is None:
            log("this Triton has no jit_post_compile_hook: --log-compiles ignored")
        t0 = time.perf_counter()
        engine = Engine(path, device=dev, dtype=dtype_name, **opts)
        log(f"engine up in {time.perf_counter() - t0:.1f} s: {engine.summary()}")
        if args.quantization:  # the roofline's weight bytes as hyla holds them (float8 and their scales)
            dense, routed = fp8_savings(engine.model, dtype)
            experts = (moe or {}).get("num_experts", 1)
            sizes = dict(sizes, weight_bytes_per_step=sizes["weight_bytes_per_step"] - dense,
                         expert_bytes=sizes["expert_bytes"] - routed / experts, saved=dense + routed)
            log(f"--quantization {args.quantization}: hyla's float8 weights save {(dense + routed) / 1e9:.3f} GB")
    runners: dict[str, object] = {}  # --variants: each one's runner, and every switch any of them sets
    if variants:
        base = {flag: knob_value(flag) for values in variants.values() for flag in values}
        variants = {label: {**base, **values} for label, values in variants.items()}
        for label, values in variants.items():
            set_knobs(values)
            t0 = time.perf_counter()
            runners[label] = engine.scheduler.runner.rebuilt()
            log(f"variant {label}: its runner's graphs captured in {time.perf_counter() - t0:.1f} s")

    def use(label: str | None) -> str:
        """Make ``label``'s switches and runner the engine's (the engine is idle); the suffix of its keys."""
        if label is None:
            return ""
        set_knobs(variants[label])
        engine.scheduler.runner = runners[label]
        return "" if label == next(iter(variants)) else f"@{label}"
    if not args.hyla_only:
        hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(dev).eval()
        log(f"transformers model loaded ({hf.config._attn_implementation} attention)")

    def hyla_decode(b: int) -> float:
        short = timed(lambda: engine.generate(input_ids=[fresh(p) for _ in range(b)], sampling_params=greedy(1)), dev)
        outs = []
        long = timed(lambda: outs.extend(engine.generate(input_ids=[fresh(p) for _ in range(b)],
                                                         sampling_params=greedy(1 + n))), dev)
        assert all(len(o["output_ids"]) == 1 + n for o in outs), "hyla stopped early"
        return long - short

    @torch.inference_mode()
    def hf_generate(b: int, max_new: int, prompts: list[list[int]] | None = None) -> torch.Tensor:
        ids = torch.tensor(prompts or [fresh(p) for _ in range(b)], device=dev)
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, min_new_tokens=max_new,
                          do_sample=False, pad_token_id=0)
        assert out.shape == (b, p + max_new)
        return out[:, p:]

    def hf_decode(b: int) -> float:
        short = timed(lambda: hf_generate(b, 1), dev)
        return timed(lambda: hf_generate(b, 1 + n), dev) - short

    def hyla_ttft() -> float:
        return timed(lambda: engine.generate(input_ids=fresh(args.prefill_tokens), sampling_params=greedy(1)), dev)

    @torch.inference_mode()
    def hf_ttft() -> float:
        ids = torch.tensor([fresh(args.prefill_tokens)], device=dev)
        return timed(lambda: hf(ids, use_cache=True, logits_to_keep=1), dev)

    def hyla_cached(fused: bool = True) -> tuple[float, int]:
        runner = engine.scheduler.runner
        keep = getattr(runner, "extend_inputs", None)  # an older checkout's runner has none
        if not fused:  # the PyTorch-driven extend (the path before CUDA graphs of extends)
            runner.extend_inputs = None
        try:
            prefix, c = fresh(args.cached_tokens), args.cached_tokens
            engine.generate(input_ids=prefix + fresh(args.prefill_tokens - c), checkpoints=[c],
                            sampling_params=greedy(1))
            outs = []
            t = timed(lambda: outs.append(engine.generate(input_ids=prefix + fresh(args.prefill_tokens - c),
                                                          sampling_params=greedy(1))), dev)
            return t, outs[0]["meta_info"]["cached_tokens"]
        finally:
            if keep is not None:
                runner.extend_inputs = keep

    agree = None
    if engine is not None and hf is not None:  # sanity: both sides run the same model
        ids = fresh(p)
        ours = engine.generate(input_ids=ids, sampling_params=greedy(8))["output_ids"]
        ref = hf_generate(1, 8, [ids])[0].tolist()
        agree = next((i for i, (a, b) in enumerate(zip(ours, ref)) if a != b), len(ref))
        log(f"greedy agreement: the first {agree} of 8 tokens equal (hyla {ours}, transformers {ref})")
    raw: dict[str, list] = {}
    add = lambda key, v: raw.setdefault(key, []).append(v)  # noqa: E731
    t_start = time.perf_counter()
    labels = list(variants) or [None]
    for rep in range(args.repeats + 1):  # pass 0: warm-up, discarded
        tag = "warm-up" if rep == 0 else f"repeat {rep}/{args.repeats}"
        for b in batches:
            for label in labels if engine is not None else []:
                at = use(label)
                add(f"hyla_decode_{b}{at}", hyla_decode(b))
            if hf is not None and b <= args.hf_max_batch:
                add(f"hf_decode_{b}", hf_decode(b))
            this_b = [(k.replace(f"_decode_{b}", ""), v) for k, v in raw.items()  # "hyla", "hyla@<variant>", "hf"
                      if k.partition("@")[0] in (f"hyla_decode_{b}", f"hf_decode_{b}")]
            log(f"{tag}: decode batch {b}: " + ", ".join(f"{side} {b * n / v[-1]:,.0f} tok/s" for side, v in this_b))
        for label in labels if engine is not None else []:
            at = use(label)
            add(f"hyla_ttft{at}", hyla_ttft())
            t, hit = hyla_cached()
            add(f"hyla_cached_ttft{at}", t), add(f"hyla_cached_hit{at}", hit)
            if args.extend_ab:
                add(f"hyla_cached_ttft_unfused{at}", hyla_cached(fused=False)[0])
        if hf is not None:
            add("hf_ttft", hf_ttft())
        log(f"{tag}: TTFT " + ", ".join(f"{k} {1e3 * v[-1]:.1f} ms" for k, v in raw.items() if "ttft" in k))
        if rep == 0:
            raw = {}
            warm_compiles = len(compiled) if compiled is not None else 0
    wall = time.perf_counter() - t_start
    # Triton compiles inside the timed repeats (--log-compiles): each a stall of the request it hit
    stalls = sorted(set(compiled[warm_compiles:])) if compiled is not None else None
    med = {k: statistics.median(v) for k, v in raw.items()}
    if engine is not None:
        engine.shutdown()
    del engine, hf
    gc.collect()

    # roofline: weights once per step, plus each request's states (read + write) and KV (mean context);
    # with MoE layers the experts B tokens choose, E * (1 - (1 - k/E)^B) distinct ones expected
    ctx = p + (1 + n) / 2
    chosen = (lambda b: moe["num_experts"] * (1 - (1 - moe["num_experts_per_tok"] / moe["num_experts"]) ** b)) \
        if moe else (lambda b: 0)
    roof = {b: b * bw / (sizes["weight_bytes_per_step"] + chosen(b) * sizes["expert_bytes"] + b * (
        2 * layout.state_bytes_per_slot + layout.kv_bytes_per_token * (ctx + 1))) for b in batches}
    hf_name = "transformers (PyTorch)" if model.peer is None else "transformers" + (
        f" + {model.peer}" if kernels[model.peer] else f" (no {model.peer}: torch fallback)")
    rows = []
    for b in batches:
        cells = {}
        for s in ("hyla", "hf"):
            t = med.get(f"{s}_decode_{b}")
            cells[s] = (b * n / t, 1e3 * t / n) if t else None
        fmt = lambda c: f"{c[0]:,.0f} tok/s ({c[1]:.2f} ms/step)" if c else "—"  # noqa: E731
        ratio = f"**{cells['hyla'][0] / cells['hf'][0]:.2f}x**" if cells["hyla"] and cells["hf"] else "—"
        share = f" (hyla {100 * cells['hyla'][0] / roof[b]:.0f}%)" if cells["hyla"] else ""
        rows.append(f"| decode, batch {b} | {fmt(cells['hyla'])} | {fmt(cells['hf'])} | {ratio} | "
                    f"{roof[b]:,.0f} tok/s{share} |")
    pt = args.prefill_tokens
    h, f = med.get("hyla_ttft"), med.get("hf_ttft")
    fmt = lambda t: f"{pt / t:,.0f} tok/s (TTFT {1e3 * t:.1f} ms)" if t else "—"  # noqa: E731
    rows.append(f"| prefill, one {pt:,}-token prompt | {fmt(h)} | {fmt(f)} | "
                f"{f'**{f / h:.2f}x**' if h and f else '—'} | |")
    if h:
        c, hit = med["hyla_cached_ttft"], min(raw["hyla_cached_hit"])
        rows.append(f"| TTFT, {pt:,}-token prompt, {args.cached_tokens:,}-token prefix cached ({hit:,} hit) | "
                    f"{1e3 * c:.1f} ms = **{100 * c / h:.1f}%** of cold | | | target ≤ 15% |")
        if "hyla_cached_ttft_unfused" in med:
            u = med["hyla_cached_ttft_unfused"]
            rows.append(f"| the same, fused extend (its CUDA graphs) bypassed | {1e3 * u:.1f} ms = {100 * u / h:.1f}% "
                        f"of cold; the graphs {u / c:.2f}x faster | | | |")
    if variants:  # each variant against the first, which the table above shows
        first = next(iter(variants))
        head = [f"decode, batch {b}" for b in batches] + ["prefill TTFT", "cached TTFT (% of its cold)"]
        rows += ["", f"Variants (`--variants`, each on its own runner in this engine, interleaved; in parentheses "
                 f"the ratio to `{first}`: tok/s for decode, time for TTFTs):", "",
                 "| variant | " + " | ".join(head) + " |", "|---" * (len(head) + 1) + "|"]
        for label in variants:
            at = "" if label == first else f"@{label}"
            cells = []
            for b in batches:
                t, t0 = med[f"hyla_decode_{b}{at}"], med[f"hyla_decode_{b}"]
                cells.append(f"{b * n / t:,.0f} tok/s ({t0 / t:.3f}x)")
            t, t0 = med[f"hyla_ttft{at}"], med["hyla_ttft"]
            cells.append(f"{1e3 * t:.1f} ms ({t / t0:.3f}x)")
            c, c0 = med[f"hyla_cached_ttft{at}"], med["hyla_cached_ttft"]
            cells.append(f"{1e3 * c:.2f} ms = {100 * c / t:.1f}% ({c / c0:.3f}x)")
            rows.append(f"| `{label}` | " + " | ".join(cells) + " |")
    desc = (f"{'tiny ' if args.tiny else ''}{model.describe(kw)}; {sizes['params'] / 1e6:,.1f} M parameters, "
            f"{sizes['param_bytes'] / 1e9:.3f} GB in {dtype_name}"
            + (f"; hyla's projections and experts quantized to float8 at load (`--quantization "
               f"{args.quantization}`): {sizes['saved'] / 1e9:.3f} GB fewer, which its roofline counts"
               if "saved" in sizes else ""))
    cmd = shlex.join([".venv/bin/python", "benchmarks/gpu_decode.py", *sys.argv[1:]])
    agreed = "" if agree is None else \
        f" Greedy check before timing: hyla and transformers agree on the first {agree} of 8 tokens."
    body = "\n".join([
        f"`{cmd}` — {machine()}, transformers {transformers.__version__}; importable: "
        f"{', '.join(f'{k} {v}' for k, v in kernels.items())}; hyla engine options {opts or '—'}"
        f"{''.join(f'; {knob}' for knob in knobs)}.",
        "",
        f"{desc}.",
        "",
        f"* Decode: B concurrent requests of {p} random prompt tokens, {n} new tokens each (greedy, EOS ignored); "
        f"tok/s = B × {n} / (t({1 + n} new) − t(1 new)), so prefill cancels; transformers runs batches "
        f"≤ {args.hf_max_batch}.",
        f"* HBM roofline: per decode step {sizes['weight_bytes_per_step'] / 1e9:.3f} GB of weights"
        + (f" and {sizes['expert_bytes'] / 1e6:.1f} MB per distinct expert the batch's tokens choose (expected "
           f"E(1 - (1 - k/E)^B))" if moe else "") + ", plus per request "
        f"{2 * layout.state_bytes_per_slot / 2**20:.1f} MiB of recurrent states (read + written) and "
        f"{layout.kv_bytes_per_token * (ctx + 1) / 2**20:.2f} MiB of KV (mean context), at {bw / 1e9:,.0f} GB/s "
        f"(a {copy_bytes >> 20:,} MiB device copy, read + written, measured in this run).",
        f"* Prefill: TTFT of one fresh prompt (transformers: one forward, last logits only). Cached: a prompt of the "
        f"same length whose first {args.cached_tokens:,} tokens were sent before with another tail and a checkpoint there.",
        f"* Medians of {args.repeats} runs after one warm-up pass, hyla and transformers interleaved.{agreed}",
        *([] if stalls is None else [
            f"* Triton compiles inside the timed repeats (`--log-compiles`): {len(compiled) - warm_compiles}"
            + (f" ({', '.join(stalls)})" if stalls else "") + f"; {warm_compiles} before them."]),
        "",
        f"| measurement | hyla | {hf_name} | hyla / transformers | HBM roofline |",
        "|---|---|---|---|---|",
        *rows,
    ]) + "\n"
    print(body)
    log(f"measured in {wall:.0f} s")
    if args.json:
        args.json.write_text(json.dumps(dict(command=cmd, machine=machine(), transformers=transformers.__version__,
                                             importable=kernels, dtype=dtype_name, config=kw, moe=moe, sizes=sizes,
                                             bandwidth_bytes_per_s=bw, engine_options=opts, roofline_tok_s=roof,
                                             greedy_agreement=agree, triton_compiles=compiled,
                                             raw_seconds=raw, medians=med, args={k: str(v) for k, v in vars(args).items()}),
                                        indent=1))
    if not args.no_write:
        write_section(model.section, body)
    tmp.cleanup()


if __name__ == "__main__":
    main()
