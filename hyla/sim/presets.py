"""Published ``config.json`` contents of the hybrid models the simulator ships as presets.

Copied from the model cards on the Hugging Face Hub (fields that matter to no part of hyla, such
as ``initializer_range``, kept for fidelity; Falcon-H1-7B, Granite-4.0-H-Small, Qwen3.5-35B-A3B, MiniMax-Text-01 and
LFM2-1.2B, LFM2-8B-A1B, Jamba-1.5-Mini, Falcon-Mamba-7B and Mamba-Codestral-7B keep only their sizes, see their comments; Kimi-Linear-48B-A3B leaves out ``auto_map``); parsed by ``ModelConfig.from_hf`` like any other checkpoint.
"""

from __future__ import annotations

from typing import Any

QWEN3_NEXT_80B_A3B: dict[str, Any] = {  # Qwen/Qwen3-Next-80B-A3B-Instruct
    "architectures": ["Qwen3NextForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "decoder_sparse_step": 1,
    "eos_token_id": 151645,
    "full_attention_interval": 4,
    "head_dim": 256,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 5120,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_value_head_dim": 128,
    "max_position_embeddings": 262144,
    "mlp_only_layers": [],
    "model_type": "qwen3_next",
    "moe_intermediate_size": 512,
    "norm_topk_prob": True,
    "num_attention_heads": 16,
    "num_experts": 512,
    "num_experts_per_tok": 10,
    "num_hidden_layers": 48,
    "num_key_value_heads": 2,
    "output_router_logits": False,
    "partial_rotary_factor": 0.25,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 10000000,
    "router_aux_loss_coef": 0.001,
    "shared_expert_intermediate_size": 512,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.57.0.dev0",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}

NEMOTRON_H_8B: dict[str, Any] = {  # nvidia/Nemotron-H-8B-Base-8K
    "architectures": ["NemotronHForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "attention_head_dim": 128,
    "bos_token_id": 1,
    "chunk_size": 128,
    "conv_kernel": 4,
    "eos_token_id": 2,
    "expand": 2,
    "hidden_dropout": 0.0,
    "hidden_size": 4096,
    "hybrid_override_pattern": "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-",
    "initializer_range": 0.02,
    "intermediate_size": 21504,
    "layer_norm_epsilon": 1e-05,
    "mamba_head_dim": 64,
    "mamba_hidden_act": "silu",
    "mamba_num_heads": 128,
    "mamba_proj_bias": False,
    "max_position_embeddings": 8192,
    "mlp_bias": False,
    "mlp_hidden_act": "relu2",
    "model_type": "nemotron_h",
    "n_groups": 8,
    "num_attention_heads": 32,
    "num_hidden_layers": 52,
    "num_key_value_heads": 8,
    "num_logits_to_keep": 1,
    "pad_token_id": 0,
    "rescale_prenorm_residual": True,
    "residual_in_fp32": False,
    "rms_norm_eps": 1e-05,
    "ssm_state_size": 128,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.48.0.dev0",
    "use_bias": False,
    "use_cache": True,
    "use_conv_bias": True,
    "use_mamba_kernels": True,
    "vocab_size": 131072,
}

# tiiuae/Falcon-H1-7B-Instruct (also -Base): the sizes of the FalconH1 table in the transformers docs and
# the model card -- 44 layers of d=3072, each attention (12 query / 2 KV heads of 128) *and* Mamba2
# (24 heads of 128 = mamba_d_ssm 3072, one group, d_state 256, conv 4) in parallel, SwiGLU MLP 12288,
# vocabulary 130048, 256K context, bf16. The µP multipliers (embedding_multiplier, ssm_multipliers, ...)
# are left at their defaults here: they scale weights and change neither the cache layout nor the FLOPs.
FALCON_H1_7B: dict[str, Any] = {
    "architectures": ["FalconH1ForCausalLM"],
    "attention_bias": False,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 3072,
    "intermediate_size": 12288,
    "mamba_chunk_size": 128,
    "mamba_conv_bias": True,
    "mamba_d_conv": 4,
    "mamba_d_head": 128,
    "mamba_d_ssm": 3072,
    "mamba_d_state": 256,
    "mamba_n_groups": 1,
    "mamba_n_heads": 24,
    "mamba_proj_bias": False,
    "max_position_embeddings": 262144,
    "mlp_bias": False,
    "model_type": "falcon_h1",
    "num_attention_heads": 12,
    "num_hidden_layers": 44,
    "num_key_value_heads": 2,
    "projectors_bias": False,
    "rms_norm_eps": 1e-05,
    "rope_theta": 100000000000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "vocab_size": 130048,
}

# ibm-granite/granite-4.0-h-small: 40 layers of d=4096, 36 Mamba2 (128 heads of 64 = 2 x 4096, one
# group, d_state 128, conv 4) and 4 attention layers (32 query / 8 KV heads of 128, no RoPE); every layer's
# feed-forward is a MoE of 72 SwiGLU experts of 768 (10 active) beside a shared expert of 1536; tied
# embeddings, vocabulary 100352, bf16 -- 32B parameters, ~9B active. The attention layers sit at 5, 15,
# 25, 35 (the Granite 4.0-H pattern; the positions change neither the bytes nor the FLOPs). The µP
# multipliers are left at their defaults: they scale weights only.
GRANITE_4_0_H_SMALL: dict[str, Any] = {
    "architectures": ["GraniteMoeHybridForCausalLM"],
    "attention_bias": False,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "intermediate_size": 768,
    "layer_types": ["attention" if i in (5, 15, 25, 35) else "mamba" for i in range(40)],
    "mamba_chunk_size": 256,
    "mamba_conv_bias": True,
    "mamba_d_conv": 4,
    "mamba_d_head": 64,
    "mamba_d_state": 128,
    "mamba_expand": 2,
    "mamba_n_groups": 1,
    "mamba_n_heads": 128,
    "mamba_proj_bias": False,
    "max_position_embeddings": 131072,
    "model_type": "granitemoehybrid",
    "num_attention_heads": 32,
    "num_experts_per_tok": 10,
    "num_hidden_layers": 40,
    "num_key_value_heads": 8,
    "num_local_experts": 72,
    "position_embedding_type": "nope",
    "rms_norm_eps": 1e-05,
    "shared_intermediate_size": 1536,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "vocab_size": 100352,
}

# Qwen/Qwen3.5-35B-A3B: the published vision-language config.json, text part (the vision tower's
# vision_config is left out: hyla serves text only and reads only text_config). 40 layers of d=2048 in
# the Qwen3.5 pattern (3 Gated DeltaNet + 1 gated attention, x10): attention 16 query / 2 KV heads of 256,
# partial RoPE (0.25, theta 1e7, interleaved M-RoPE sections that equal the default RoPE on text);
# GDN 16 key / 32 value heads of 128, conv 4; a MoE in every layer, 256 experts of 512 (8 active) + a
# shared expert of 512 with its sigmoid gate; vocabulary 248320, 256K context, bf16 -- 35B parameters,
# ~3B active.
QWEN3_5_35B_A3B: dict[str, Any] = {
    "architectures": ["Qwen3_5MoeForConditionalGeneration"],
    "model_type": "qwen3_5_moe",
    "tie_word_embeddings": False,
    "text_config": {
        "model_type": "qwen3_5_moe_text",
        "attention_bias": False,
        "attn_output_gate": True,
        "dtype": "bfloat16",
        "eos_token_id": 248044,
        "full_attention_interval": 4,
        "head_dim": 256,
        "hidden_act": "silu",
        "hidden_size": 2048,
        "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(40)],
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "linear_value_head_dim": 128,
        "max_position_embeddings": 262144,
        "moe_intermediate_size": 512,
        "num_attention_heads": 16,
        "num_experts": 256,
        "num_experts_per_tok": 8,
        "num_hidden_layers": 40,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-06,
        "rope_parameters": {"mrope_interleaved": True, "mrope_section": [11, 11, 10], "partial_rotary_factor": 0.25,
                            "rope_theta": 10000000, "rope_type": "default"},
        "shared_expert_intermediate_size": 512,
        "vocab_size": 248320,
    },
}

# LiquidAI/LFM2-1.2B: 16 layers of d=2048, 10 gated short convolutions (conv_L_cache 3: a state of 2 x 2048
# values per layer) and 6 GQA attention layers at 2, 5, 8, 10, 12, 14 (32 query / 8 KV heads of 64); SwiGLU
# MLP of block_ff_dim 12288 -> 2/3, rounded to 256: 8192; tied embeddings, vocabulary 65536, 128K context,
# bf16 -- 1.2B parameters. The checkpoint's legacy keys (block_ff_dim, tie_embedding, full_attn_idxs) as
# published; init-only keys left out.
LFM2_1_2B: dict[str, Any] = {
    "architectures": ["Lfm2ForCausalLM"],
    "block_auto_adjust_ff_dim": True,
    "block_ff_dim": 12288,
    "block_ffn_dim_multiplier": 1.0,
    "block_multiple_of": 256,
    "bos_token_id": 1,
    "conv_L_cache": 3,
    "conv_bias": False,
    "eos_token_id": 7,
    "full_attn_idxs": [2, 5, 8, 10, 12, 14],
    "hidden_size": 2048,
    "max_position_embeddings": 128000,
    "model_type": "lfm2",
    "norm_eps": 1e-05,
    "num_attention_heads": 32,
    "num_hidden_layers": 16,
    "num_key_value_heads": 8,
    "pad_token_id": 0,
    "rope_theta": 1000000.0,
    "tie_embedding": True,
    "torch_dtype": "bfloat16",
    "vocab_size": 65536,
}

# moonshotai/Kimi-Linear-48B-A3B-Instruct (also -Base), as published (auto_map and init-only keys left out):
# 27 layers of d=2304 -- 20 Kimi Delta Attention layers (32 heads of 128, short convs of 4) and 7 MLA layers at
# the 1-based positions 4, 8, 12, 16, 20, 24, 27 (32 heads; kv_lora_rank 512, full-rank q, nope 128 / rope 64 /
# v 128, no RoPE: mla_use_nope); layer 1 a dense SwiGLU MLP of 9216, the other 26 a MoE of 256 experts of 1024
# (8 active, sigmoid router, renormalised, x 2.446) + 1 shared expert; vocabulary 163840, 1M context
# (model_max_length), bf16 -- 48B parameters, ~3B active. The MLA cache is the 576-wide latent per token
# and layer (hyla keeps it half in K, half in V); head_dim 72 is read by no one (transformers ignores it too).
KIMI_LINEAR_48B_A3B: dict[str, Any] = {
    "architectures": ["KimiLinearForCausalLM"],
    "bos_token_id": 163584,
    "dtype": "bfloat16",
    "eos_token_id": 163586,
    "first_k_dense_replace": 1,
    "head_dim": 72,
    "hidden_act": "silu",
    "hidden_size": 2304,
    "initializer_range": 0.02,
    "intermediate_size": 9216,
    "kv_lora_rank": 512,
    "linear_attn_config": {
        "full_attn_layers": [4, 8, 12, 16, 20, 24, 27],
        "head_dim": 128,
        "kda_layers": [1, 2, 3, 5, 6, 7, 9, 10, 11, 13, 14, 15, 17, 18, 19, 21, 22, 23, 25, 26],
        "num_heads": 32,
        "short_conv_kernel_size": 4,
    },
    "mla_use_nope": True,
    "model_max_length": 1048576,
    "model_type": "kimi_linear",
    "moe_intermediate_size": 1024,
    "moe_layer_freq": 1,
    "moe_renormalize": True,
    "moe_router_activation_func": "sigmoid",
    "num_attention_heads": 32,
    "num_expert_group": 1,
    "num_experts": 256,
    "num_experts_per_token": 8,
    "num_hidden_layers": 27,
    "num_key_value_heads": 32,
    "num_nextn_predict_layers": 0,
    "num_shared_experts": 1,
    "pad_token_id": 163839,
    "q_lora_rank": None,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-05,
    "rope_scaling": None,
    "rope_theta": 10000.0,
    "routed_scaling_factor": 2.446,
    "tie_word_embeddings": False,
    "topk_group": 1,
    "use_cache": True,
    "v_head_dim": 128,
    "vocab_size": 163840,
}

# ai21labs/AI21-Jamba-1.5-Mini: 32 layers, attention (32 query / 8 KV heads of 128, no positional encoding)
# every 8th from layer 4, Mamba1 in the other 28 (inner 8192, 16 states, conv 4, dt rank 256); MoE of 16
# experts (top-2, 14336 wide) every 2nd layer from 1, SwiGLU MLPs between; vocabulary 65536, 256K context,
# bf16 -- 52B parameters, 12B active. Its sizes only (init-only and serving keys left out).
JAMBA_1_5_MINI: dict[str, Any] = {
    "architectures": ["JambaForCausalLM"],
    "attn_layer_offset": 4,
    "attn_layer_period": 8,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "expert_layer_offset": 1,
    "expert_layer_period": 2,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "mamba_conv_bias": True,
    "mamba_d_conv": 4,
    "mamba_d_state": 16,
    "mamba_dt_rank": 256,
    "mamba_expand": 2,
    "mamba_proj_bias": False,
    "max_position_embeddings": 262144,
    "model_type": "jamba",
    "num_attention_heads": 32,
    "num_experts": 16,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "pad_token_id": 0,
    "rms_norm_eps": 1e-06,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "vocab_size": 65536,
}

# LiquidAI/LFM2-8B-A1B: LFM2's 18 short-conv + 6 attention layers (2048 wide), the first 2 with dense
# SwiGLU MLPs, the rest 32 sigmoid-routed experts (top-4, 1792 wide, expert bias); vocabulary 65536,
# bf16. Its sizes only (transformers 4.57's spelling: tie_embedding, a top-level rope_theta).
LFM2_8B_A1B: dict[str, Any] = {
    "architectures": ["Lfm2MoeForCausalLM"],
    "conv_L_cache": 3,
    "conv_bias": False,
    "hidden_size": 2048,
    "intermediate_size": 7168,
    "layer_types": ["conv", "conv", "full_attention", "conv", "conv", "conv", "full_attention", "conv", "conv",
                    "conv", "full_attention", "conv", "conv", "conv", "full_attention", "conv", "conv", "conv",
                    "full_attention", "conv", "conv", "full_attention", "conv", "conv"],
    "max_position_embeddings": 128000,
    "model_type": "lfm2_moe",
    "moe_intermediate_size": 1792,
    "norm_eps": 1e-05,
    "norm_topk_prob": True,
    "num_attention_heads": 32,
    "num_dense_layers": 2,
    "num_experts": 32,
    "num_experts_per_tok": 4,
    "num_hidden_layers": 24,
    "num_key_value_heads": 8,
    "rope_theta": 1000000.0,
    "routed_scaling_factor": 1.0,
    "tie_embedding": True,
    "torch_dtype": "bfloat16",
    "use_expert_bias": True,
    "vocab_size": 65536,
}

# tiiuae/falcon-mamba-7b: 64 Mamba1 layers (4096 wide, 8192 inner, state 16, dt rank 256, weightless
# dt/B/C norms), no attention; vocabulary 65024, bf16. Its sizes only (init-only keys left out).
FALCON_MAMBA_7B: dict[str, Any] = {
    "architectures": ["FalconMambaForCausalLM"],
    "conv_kernel": 4,
    "expand": 16,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "intermediate_size": 8192,
    "layer_norm_epsilon": 1e-05,
    "mixer_rms_eps": 1e-06,
    "model_type": "falcon_mamba",
    "num_hidden_layers": 64,
    "residual_in_fp32": True,
    "state_size": 16,
    "tie_word_embeddings": False,
    "time_step_rank": 256,
    "torch_dtype": "bfloat16",
    "use_bias": False,
    "use_conv_bias": True,
    "vocab_size": 65024,
}

# mistralai/Mamba-Codestral-7B-v0.1: 64 Mamba2 layers (4096 wide, 128 heads of 64, 8 groups, state 128),
# no attention; vocabulary 32768, bf16. Its sizes only (init-only keys left out).
MAMBA_CODESTRAL_7B: dict[str, Any] = {
    "architectures": ["Mamba2ForCausalLM"],
    "chunk_size": 256,
    "conv_kernel": 4,
    "expand": 2,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "layer_norm_epsilon": 1e-05,
    "model_type": "mamba2",
    "n_groups": 8,
    "norm_before_gate": True,
    "num_heads": 128,
    "num_hidden_layers": 64,
    "residual_in_fp32": True,
    "rms_norm": True,
    "state_size": 128,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_bias": False,
    "use_conv_bias": True,
    "vocab_size": 32768,
}

# Ling-3.0-Flash: transformers 5.24's BailingHybridConfig defaults, which its docstring gives as
# inclusionAI/Ling-3.0-Flash's (the published config.json is not among the sources here), in inclusionAI's keys:
# 35 KDA + 7 MLA layers (every 6th), MoE of 512 experts top-8 (8 groups, top-4) + a shared expert after 2 dense
# layers, one MTP layer
LING_3_0_FLASH: dict[str, Any] = {
    "architectures": ["BailingHybridForCausalLM"],
    "dtype": "bfloat16",
    "eos_token_id": 156895,
    "first_k_dense_replace": 2,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 2560,
    "intermediate_size": 6144,
    "kda_lower_bound": -5.0,
    "kda_safe_gate": True,
    "kv_lora_rank": 512,
    "layer_group_size": 6,
    "model_max_length": 262144,
    "model_type": "bailing_hybrid",
    "moe_intermediate_size": 768,
    "moe_renormalize": True,
    "num_attention_heads": 32,
    "num_expert_group": 8,
    "num_experts": 512,
    "num_experts_per_token": 8,
    "num_hidden_layers": 42,
    "num_key_value_heads": 32,
    "num_nextn_predict_layers": 1,
    "num_shared_experts": 1,
    "pad_token_id": 156892,
    "q_lora_rank": None,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-06,
    "rope_theta": 6000000.0,
    "routed_scaling_factor": 2.5,
    "short_conv_kernel_size": 4,
    "tie_word_embeddings": False,
    "topk_group": 4,
    "v_head_dim": 128,
    "vocab_size": 157184,
}

# Olmo-Hybrid-7B: transformers 5.24's OlmoHybridConfig defaults, which its docstring gives as allenai/Olmo-Hybrid-7B's,
# with NoPE as the released checkpoints: 24 Gated DeltaNet + 8 attention layers (every 4th), 30 heads of 128,
# linear keys of 96 and values of 192
OLMO_HYBRID_7B: dict[str, Any] = {
    "architectures": ["OlmoHybridForCausalLM"],
    "dtype": "bfloat16",
    "eos_token_id": 100257,
    "hidden_act": "silu",
    "hidden_size": 3840,
    "intermediate_size": 11008,
    "linear_allow_neg_eigval": True,
    "linear_conv_kernel_dim": 4,
    "max_position_embeddings": 65536,
    "model_type": "olmo_hybrid",
    "num_attention_heads": 30,
    "num_hidden_layers": 32,
    "num_key_value_heads": 30,
    "pad_token_id": 100277,
    "rms_norm_eps": 1e-06,
    "rope_parameters": {"rope_type": "default", "rope_theta": None},
    "tie_word_embeddings": False,
    "vocab_size": 100352,
}

# Lara-4-Mini: transformers 5.24's LaraMiniConfig defaults, which its docstring gives as translated/Lara-4-Mini-Base's:
# 34 layers in the period-5 pattern (14 Gated DeltaNet, 13 sliding-window attention layers of 512 positions, 7 global
# NoPE ones), 4 KV heads of 128, MoE 128 experts top-4 + an ungated shared expert in every layer. hyla keeps every
# token's K/V in the sliding layers too (their window is a mask), so a token costs all 20 attention layers' KV
LARA_4_MINI: dict[str, Any] = {
    "architectures": ["LaraMiniForCausalLM"],
    "dtype": "bfloat16",
    "model_type": "lara_mini",
}

# Zamba2-2.7B: transformers 5.24's Zamba2Config defaults, which its docstring gives as a Zamba2-2.7B-style
# configuration: 54 Mamba2 layers (8 heads of 640, 64 states), 9 of them hybrid with a KV of 32 heads of 160 (the
# heads read [x | embeddings]: 2 hidden / heads wide) over one shared attention block
ZAMBA2_2_7B: dict[str, Any] = {
    "architectures": ["Zamba2ForCausalLM"],
    "dtype": "bfloat16",
    "model_type": "zamba2",
}

# MiniMax-Text-01: its published sizes (the MiniMax-01 report and model card: 456 B parameters, 45.9 B activated,
# which these give: tests/test_sim_models.py; 80 layers, softmax
# attention after every 7 lightning layers, 64 heads of 128 with 8 KV heads, RoPE over half of each head, 32 experts
# top-2 of 9,216, DeepNorm's alpha (2 * 80) ** 0.25 on every residual) in MiniMax's own config keys
MINIMAX_TEXT_01: dict[str, Any] = {
    "architectures": ["MiniMaxText01ForCausalLM"],
    "attn_type_list": [0, 0, 0, 0, 0, 0, 0, 1] * 10,
    "block_size": 256,
    "bos_token_id": None,
    "eos_token_id": 200020,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 6144,
    "intermediate_size": 9216,
    "layernorm_full_attention_alpha": 3.5565588200778455,
    "layernorm_full_attention_beta": 1.0,
    "layernorm_linear_attention_alpha": 3.5565588200778455,
    "layernorm_linear_attention_beta": 1.0,
    "layernorm_mlp_alpha": 3.5565588200778455,
    "layernorm_mlp_beta": 1.0,
    "max_position_embeddings": 10240000,
    "model_type": "minimax_text_01",
    "num_attention_heads": 64,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 80,
    "num_key_value_heads": 8,
    "num_local_experts": 32,
    "postnorm": True,
    "rms_norm_eps": 1e-05,
    "rope_theta": 10000000,
    "rotary_dim": 64,
    "shared_intermediate_size": 0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "vocab_size": 200064,
}

HF_CONFIGS: dict[str, dict[str, Any]] = {
    "qwen3-next-80b-a3b": QWEN3_NEXT_80B_A3B,
    "nemotron-h-8b": NEMOTRON_H_8B,
    "falcon-h1-7b": FALCON_H1_7B,
    "granite-4.0-h-small": GRANITE_4_0_H_SMALL,
    "qwen3.5-35b-a3b": QWEN3_5_35B_A3B,
    "lfm2-1.2b": LFM2_1_2B,
    "kimi-linear-48b-a3b": KIMI_LINEAR_48B_A3B,
    "jamba-1.5-mini": JAMBA_1_5_MINI,
    "lfm2-8b-a1b": LFM2_8B_A1B,
    "falcon-mamba-7b": FALCON_MAMBA_7B,
    "mamba-codestral-7b": MAMBA_CODESTRAL_7B,
    "ling-3.0-flash": LING_3_0_FLASH,
    "olmo-hybrid-7b": OLMO_HYBRID_7B,
    "lara-4-mini": LARA_4_MINI,
    "zamba2-2.7b": ZAMBA2_2_7B,
    "minimax-text-01": MINIMAX_TEXT_01,
}
