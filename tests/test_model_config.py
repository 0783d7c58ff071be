"""ModelConfig.from_hf: layouts, legacy keys, state shapes vs HF's caches, sizes and the FLOP model."""

from __future__ import annotations

import json
import math

import pytest
import torch
import transformers
from checkpoints import (
    BAILING_HYBRID_KW,
    BAMBA_KW,
    FALCON_H1_KW,
    FALCON_MAMBA_KW,
    GRANITE_H_KW,
    KIMI_LINEAR_KW,
    LARA_MINI_KW,
    LFM3_KW,
    ZAMBA2_KW,
    LFM2_KW,
    LFM2_MOE_KW,
    MAMBA2_KW,
    MAMBA_KW,
    NEMOTRON_H_KW,
    OLMO_HYBRID_KW,
    QWEN3_5_KW,
    QWEN3_5_MOE_KW,
    QWEN3_NEXT_KW,
)

from hyla.model.architectures import ARCHITECTURES, SUPPORTED_ARCHITECTURES, architecture_name
from hyla.model.config import ModelConfig


def hf_dict(config: transformers.PreTrainedConfig, arch: str) -> dict:
    """What save_pretrained writes to config.json (JSON round trip included)."""
    d = json.loads(config.to_json_string())
    d["architectures"] = [arch]
    return d


@pytest.fixture(scope="module")
def qwen_moe() -> ModelConfig:
    return ModelConfig.from_hf(hf_dict(transformers.Qwen3NextConfig(**QWEN3_NEXT_KW), "Qwen3NextForCausalLM"))


@pytest.fixture(scope="module")
def nemotron() -> ModelConfig:
    return ModelConfig.from_hf(hf_dict(transformers.NemotronHConfig(**NEMOTRON_H_KW), "NemotronHForCausalLM"))


def test_qwen3_next_layout_and_shapes(qwen_moe):
    c = qwen_moe
    assert c.layer_types == ("linear",) * 3 + ("attention",) + ("linear",) * 3 + ("attention",)
    assert c.ffn_types == ("moe",) * 8
    assert (c.num_attention_layers, c.num_linear_layers) == (2, 6)
    assert [c.attention_ordinal(i) for i in (3, 7)] == [0, 1]
    assert [c.linear_ordinal(i) for i in (0, 1, 2, 4, 5, 6)] == [0, 1, 2, 3, 4, 5]
    # HF keeps K=4 conv inputs of 2*key_dim + value_dim = 512 channels; hyla keeps K-1
    assert c.conv_shape == (512, 3) and c.conv_dtype == torch.float32
    assert c.ssm_shape == (4, 64, 64) and c.ssm_dtype == torch.float32
    assert c.rotary_dim == 16 and c.attn_output_gate and c.qk_norm and c.zero_centered_norm
    assert c.max_position_embeddings == 4096 and c.eos_token_ids == (2,)
    with pytest.raises(ValueError, match="not attention"):
        c.attention_ordinal(0)


def test_qwen3_next_dense_and_mlp_only_layers():
    kw = {**QWEN3_NEXT_KW, "mlp_only_layers": [0, 5], "decoder_sparse_step": 2}
    c = ModelConfig.from_hf(hf_dict(transformers.Qwen3NextConfig(**kw), "Qwen3NextForCausalLM"))
    assert c.ffn_types == ("mlp", "moe", "mlp", "moe", "mlp", "mlp", "mlp", "moe")
    dense = ModelConfig.from_hf(hf_dict(transformers.Qwen3NextConfig(**{**QWEN3_NEXT_KW, "num_experts": 0}),
                                        "Qwen3NextForCausalLM"))
    assert dense.ffn_types == ("mlp",) * 8 and dense.num_experts == 0


def test_nemotron_h_layout_and_shapes(nemotron):
    c = nemotron
    assert c.layer_types == ("linear", "mlp", "linear", "attention", "mlp", "linear", "moe", "attention")
    assert c.ffn_types == ("none",) * 8
    assert (c.num_attention_layers, c.num_linear_layers) == (2, 3)
    assert c.conv_shape == (384, 3)  # HF: [B, 384, 4]
    assert c.ssm_shape == (8, 32, 32)  # HF: [B, H=8, P=32, N=32]
    assert c.rotary_dim == 0 and not c.zero_centered_norm
    assert c.mamba_dt_limit == (0.0, math.inf)  # time_step_limit's default; time_step_min (0.001) only inits
    assert c.router == "sigmoid" and c.hidden_act == "relu2"


def test_qwen3_5_vl_ties_its_lm_head_by_the_top_level_flag_alone():
    """A vision-language Qwen3.5 config ties its lm_head as transformers' ``Qwen3_5Config`` reads it: by the
    top-level ``tie_word_embeddings`` (False where absent), whatever the text config's flag says."""
    from checkpoints import QWEN3_5_VL_TOKENS, QWEN3_5_VL_VISION_KW
    text = {**QWEN3_5_KW, "tie_word_embeddings": True}
    base = hf_dict(transformers.Qwen3_5Config(text_config=text, vision_config=QWEN3_5_VL_VISION_KW,
                                              **QWEN3_5_VL_TOKENS), "Qwen3_5ForConditionalGeneration")
    bare = {k: v for k, v in base.items() if k != "tie_word_embeddings"}
    assert base["text_config"]["tie_word_embeddings"] and not transformers.Qwen3_5Config(**bare).tie_word_embeddings
    assert not ModelConfig.from_hf(bare).tie_word_embeddings
    assert ModelConfig.from_hf({**bare, "tie_word_embeddings": True}).tie_word_embeddings


def test_nemotron_h_head_dim_without_the_key_is_transformers_default():
    """A config without ``head_dim``: 128, as transformers' ``NemotronHConfig`` reads it (not hidden / heads), or
    NVIDIA's remote code's ``attention_head_dim``."""
    base = hf_dict(transformers.NemotronHConfig(**NEMOTRON_H_KW), "NemotronHForCausalLM")
    bare = {k: v for k, v in base.items() if k != "head_dim"}
    assert ModelConfig.from_hf(bare).head_dim == transformers.NemotronHConfig(**{
        k: v for k, v in NEMOTRON_H_KW.items() if k != "head_dim"}).head_dim == 128
    assert ModelConfig.from_hf({**bare, "attention_head_dim": 96}).head_dim == 96
    assert ModelConfig.from_hf(base).head_dim == base["head_dim"]


def test_nemotron_h_dt_clamp_is_time_step_limit():
    """NemotronH clamps dt to ``time_step_limit`` (legacy ``mamba_dt_limit``, which wins, as in HF's config),
    as NVIDIA's reference and transformers >= 5.25 do; ``time_step_min`` only initialises ``dt_bias``."""
    base = hf_dict(transformers.NemotronHConfig(**NEMOTRON_H_KW), "NemotronHForCausalLM")
    limited = hf_dict(transformers.NemotronHConfig(**NEMOTRON_H_KW, time_step_limit=(0.01, 0.5)), "NemotronHForCausalLM")
    assert ModelConfig.from_hf(limited).mamba_dt_limit == (0.01, 0.5)
    assert ModelConfig.from_hf({**base, "time_step_min": 0.2}).mamba_dt_limit == (0.0, math.inf)
    legacy = {**base, "mamba_dt_limit": [0.02, 0.3], "time_step_limit": [0.01, 0.5]}
    assert ModelConfig.from_hf(legacy).mamba_dt_limit == (0.02, 0.3)
    with pytest.raises(ValueError, match="time_step_limit must be"):
        ModelConfig.from_hf({**base, "time_step_limit": [0.5, 0.1]})


def test_state_shapes_match_hf_caches(qwen_moe, nemotron):
    """conv_shape is HF's conv cache less its oldest column; ssm_shape is HF's recurrent state."""
    for kind, cfg in (("qwen", qwen_moe), ("nemotron", nemotron)):
        if kind == "qwen":
            hf_cfg = transformers.Qwen3NextConfig(**{**QWEN3_NEXT_KW, "num_experts": 0})
            model = transformers.Qwen3NextForCausalLM(hf_cfg)
        else:
            hf_cfg = transformers.NemotronHConfig(**NEMOTRON_H_KW)
            model = transformers.NemotronHForCausalLM(hf_cfg)
        with torch.no_grad():
            out = model(torch.tensor([[5, 6, 7]]), use_cache=True)
        layer = cfg.layer_types.index("linear")
        conv = out.past_key_values.layers[layer].conv_states[0]
        rec = out.past_key_values.layers[layer].recurrent_states[0]
        assert tuple(conv.shape[1:]) == (cfg.conv_shape[0], cfg.conv_shape[1] + 1)
        assert tuple(rec.shape[1:]) == cfg.ssm_shape


def test_legacy_keys_and_infinity_encoding():
    qwen = {
        "architectures": ["Qwen3NextForCausalLM"], "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 8, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "full_attention_interval": 4, "rope_theta": 5e6, "partial_rotary_factor": 0.5,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
        "linear_value_head_dim": 16, "eos_token_id": [7, 8], "torch_dtype": "bfloat16",
    }
    c = ModelConfig.from_hf(qwen)
    assert c.layer_types == ("linear", "linear", "linear", "attention") * 2
    assert c.rope_theta == 5e6 and c.rotary_dim == 8 and c.eos_token_ids == (7, 8)
    assert c.dtype == torch.bfloat16 and c.conv_dtype == torch.bfloat16
    assert ModelConfig.from_hf(qwen, dtype="float32").dtype == torch.float32

    nemo = {
        "architectures": ["NemotronHForCausalLM"], "vocab_size": 100, "hidden_size": 64,
        "hybrid_override_pattern": "M-M*E", "num_attention_heads": 4, "num_key_value_heads": 2,
        "mamba_num_heads": 4, "mamba_head_dim": 16, "ssm_state_size": 8, "mamba_n_groups": 2,
        "mamba_d_conv": 3, "mamba_chunk_size": 32, "mamba_dt_min": 0.01,
        "time_step_limit": [0.02, {"__float__": "Infinity"}], "n_routed_experts": 4, "num_experts_per_tok": 2,
        "moe_intermediate_size": 32, "moe_shared_expert_intermediate_size": 32, "intermediate_size": 32,
    }
    c = ModelConfig.from_hf(nemo)
    assert c.layer_types == ("linear", "mlp", "linear", "attention", "moe")
    assert c.conv_kernel == 3 and c.conv_shape == (64 + 2 * 2 * 8, 2)
    assert c.mamba_n_groups == 2 and c.mamba_dt_limit == (0.02, math.inf)  # mamba_dt_min only inits dt_bias
    legacy_names = {**nemo, "layers_block_type": ["mamba", "attention", "moe"]}
    del legacy_names["hybrid_override_pattern"]
    assert ModelConfig.from_hf(legacy_names).layer_types == ("linear", "attention", "moe")


def test_qwen3_5_conditional_generation_reads_text_config():
    text = hf_dict(transformers.Qwen3_5TextConfig(**QWEN3_5_KW), "Qwen3_5ForCausalLM")
    del text["architectures"]
    c = ModelConfig.from_hf({"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
                             "text_config": text, "tie_word_embeddings": True})
    assert c.architecture == "Qwen3_5ForConditionalGeneration" and c.model_type == "qwen3_5"
    assert c.tie_word_embeddings and c.ffn_types == ("mlp",) * 8 and c.num_linear_layers == 6


def test_errors_are_value_errors():
    with pytest.raises(ValueError) as err:
        ModelConfig.from_hf({"architectures": ["LlamaForCausalLM"], "vocab_size": 10, "hidden_size": 8})
    for arch in SUPPORTED_ARCHITECTURES:
        assert arch in str(err.value)
    with pytest.raises(ValueError, match="vocab_size"):
        ModelConfig.from_hf({"architectures": ["NemotronHForCausalLM"], "hidden_size": 8})
    with pytest.raises(ValueError, match="unsupported dtype"):
        ModelConfig.from_hf({**hf_dict(transformers.NemotronHConfig(**NEMOTRON_H_KW), "NemotronHForCausalLM")},
                            dtype="float64")
    with pytest.raises(ValueError, match="rope_type"):
        kw = {**QWEN3_NEXT_KW, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0,
                                                   "original_max_position_embeddings": 1024}}
        ModelConfig.from_hf({**hf_dict(transformers.Qwen3NextConfig(**QWEN3_NEXT_KW), "Qwen3NextForCausalLM"),
                             "rope_parameters": kw["rope_parameters"]})


def test_bytes_per_token_and_slot(qwen_moe, nemotron):
    bf16 = qwen_moe.with_dtype("bfloat16").cache_layout  # K, V and conv state in bf16; SSM state fp32
    assert bf16.kv_bytes_per_token == 2 * 2 * 2 * 64 * 2  # layers * (K, V) * Hkv * D * bytes
    assert bf16.state_bytes_per_slot == 6 * (512 * 3 * 2 + 4 * 64 * 64 * 4)
    assert nemotron.cache_layout.state_bytes_per_slot == 3 * (384 * 3 * 4 + 8 * 32 * 32 * 4)  # fp32


def test_flops_per_token_model(qwen_moe, nemotron):
    f1, f2 = qwen_moe.flops_per_token(1), qwen_moe.flops_per_token(1001)
    # only the quadratic attention term grows with the context: 2 layers * 4 * Hq * D per token
    assert f2.attention - f1.attention == pytest.approx(1000 * 2 * 4 * 4 * 64)
    assert (f2.linear, f2.moe, f2.lm_head) == (f1.linear, f1.moe, f1.lm_head)
    # MoE counts the active experts (2 of 8) + router + shared expert + its gate, per layer
    expert = 2 * 3 * 256 * 128
    assert f1.moe == pytest.approx(8 * (2 * 256 * 8 + 2 * expert + expert + 2 * 256))
    assert f1.lm_head == 2 * 256 * 2048 and f1.total > 0
    assert nemotron.flops_per_token(10).mlp == pytest.approx(2 * 2 * 2 * 256 * 512)  # 2 relu2 MLP blocks
    # prefill_flops is the exact sum of the per-token costs
    want = sum(qwen_moe.flops_per_token(c).total for c in range(31, 31 + 17))
    assert qwen_moe.prefill_flops(17, prefix_len=30) == pytest.approx(want)
    with pytest.raises(ValueError):
        qwen_moe.flops_per_token(0)


def test_80b_config_needs_no_weights():
    """Qwen3-Next-80B-A3B's published config.json: active compute ~3B params -> ~6 GFLOP/token."""
    cfg = {
        "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "vocab_size": 151936,
        "hidden_size": 2048, "intermediate_size": 5120, "num_hidden_layers": 48, "num_attention_heads": 16,
        "num_key_value_heads": 2, "head_dim": 256, "full_attention_interval": 4, "rope_theta": 10000000,
        "partial_rotary_factor": 0.25, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
        "linear_value_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
        "num_experts": 512, "num_experts_per_tok": 10, "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512, "decoder_sparse_step": 1, "norm_topk_prob": True,
        "mlp_only_layers": [], "max_position_embeddings": 262144, "eos_token_id": 151645,
        "torch_dtype": "bfloat16", "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
    }
    c = ModelConfig.from_hf(cfg)
    assert (c.num_attention_layers, c.num_linear_layers) == (12, 36)
    assert c.cache_layout.kv_bytes_per_token == 12 * 2 * 2 * 256 * 2  # bf16
    assert c.conv_shape == (2 * 2048 + 4096, 3) and c.ssm_shape == (32, 128, 128)
    gflops = c.flops_per_token(1).total / 1e9
    assert 4.0 < gflops < 8.0


def test_registry_picks_the_architecture_by_name_or_model_type(qwen_moe):
    assert architecture_name({"architectures": ["LlamaForCausalLM", "NemotronHForCausalLM"]}) == "NemotronHForCausalLM"
    # no "architectures" at all: HF's model_type names it
    assert architecture_name({"model_type": "qwen3_5_text"}) == "Qwen3_5ForCausalLM"
    assert architecture_name({"model_type": "qwen3_5"}) == "Qwen3_5ForConditionalGeneration"
    with pytest.raises(ValueError, match="unsupported architecture"):
        architecture_name({"architectures": ["LlamaForCausalLM"], "model_type": "qwen3_next"})
    hf = dict(qwen_moe.extra["hf_config"])
    del hf["architectures"]
    assert ModelConfig.from_hf(hf) == qwen_moe  # parsed by the registered Qwen3-Next parser
    for name, entry in ARCHITECTURES.items():  # every entry's parser and class belong together
        assert entry.model_class.__module__ == entry.parse_config.__module__, name


def test_cache_layout_follows_the_config(qwen_moe, nemotron):
    q = qwen_moe.cache_layout
    assert (q.num_attention_layers, q.num_kv_heads, q.head_dim, q.kv_dtype) == (2, 2, 64, torch.float32)
    assert (q.num_linear_layers, q.conv_shape, q.ssm_shape) == (6, (512, 3), (4, 64, 64))
    assert (q.conv_dtype, q.ssm_dtype) == (qwen_moe.conv_dtype, torch.float32)
    assert nemotron.with_dtype("float16").cache_layout.kv_dtype == torch.float16


@pytest.fixture(scope="module")
def falcon() -> ModelConfig:
    return ModelConfig.from_hf(hf_dict(transformers.FalconH1Config(**FALCON_H1_KW), "FalconH1ForCausalLM"))


def test_falcon_h1_every_layer_has_kv_and_state(falcon):
    c = falcon
    assert c.layer_types == ("hybrid",) * 4 and c.ffn_types == ("mlp",) * 4
    assert (c.num_attention_layers, c.num_linear_layers) == (4, 4)
    assert [c.attention_ordinal(i) for i in range(4)] == [0, 1, 2, 3]
    assert [c.linear_ordinal(i) for i in range(4)] == [0, 1, 2, 3]
    assert c.linear_kind == "mamba2" and c.mamba_intermediate_size == 384  # mamba_d_ssm, not expand * hidden
    assert c.conv_shape == (384 + 2 * 2 * 32, 3) and c.ssm_shape == (12, 32, 32)
    assert c.rotary_dim == 64 and c.rope_theta == 1e6
    assert c.mamba_rms_norm and not c.mamba_norm_before_gate and c.mamba_dt_limit == (0.0, math.inf)
    assert c.key_multiplier == 0.4 and c.ssm_multipliers == (0.35, 0.8, 0.5, 1.4, 0.6) and c.mlp_multipliers == (0.9, 0.6)
    layout = c.with_dtype("bfloat16").cache_layout
    assert layout.kv_bytes_per_token == 4 * 2 * 2 * 64 * 2  # every layer caches K and V
    assert layout.state_bytes_per_slot == 4 * (512 * 3 * 2 + 12 * 32 * 32 * 4)  # and a state
    # HF's defaults: no Mamba norm, norm_before_gate, width expand * hidden, head dim "auto"
    bare = ModelConfig.from_hf({"architectures": ["FalconH1ForCausalLM"], "vocab_size": 64, "hidden_size": 32,
                                "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                                "mamba_n_heads": 4, "time_step_limit": [0.0, {"__float__": "Infinity"}]})
    assert not bare.mamba_rms_norm and bare.mamba_norm_before_gate and bare.mamba_out_proj_bias is False
    assert (bare.mamba_num_heads, bare.mamba_head_dim, bare.ssm_state_size) == (4, 16, 256)
    assert bare.num_kv_heads == 4 and bare.head_dim == 8 and bare.ssm_multipliers == (1.0,) * 5


def test_falcon_h1_state_shapes_match_hf_cache(falcon):
    model = transformers.FalconH1ForCausalLM(transformers.FalconH1Config(**FALCON_H1_KW))
    with torch.no_grad():
        out = model(torch.tensor([[5, 6, 7]]), use_cache=True)
    for layer in out.past_key_values.layers:  # every layer holds K/V and a Mamba2 state
        assert tuple(layer.conv_states[0].shape[1:]) == (falcon.conv_shape[0], falcon.conv_shape[1] + 1)
        assert tuple(layer.recurrent_states[0].shape[1:]) == falcon.ssm_shape
        assert tuple(layer.keys.shape[1::2]) == (falcon.num_kv_heads, falcon.head_dim)


def test_falcon_h1_flops_count_attention_and_mamba_per_layer(falcon):
    c, h = falcon, 256
    f1, f2 = c.flops_per_token(1), c.flops_per_token(101)
    assert f2.attention - f1.attention == pytest.approx(100 * 4 * 4 * 4 * 64)  # 4 layers * 4 * Hq * D
    proj = 2 * h * (4 * 64 + 2 * 2 * 64) + 2 * 4 * 64 * h
    assert f1.attention == pytest.approx(4 * (proj + 4 * 4 * 64))
    inner, conv_dim = 384, 512
    mamba = 2 * h * (inner + conv_dim + 12) + 2 * inner * h + 2 * conv_dim * 4 + 2 * 3 * 12 * 32 * 32
    assert f1.linear == pytest.approx(4 * mamba)
    assert f1.mlp == pytest.approx(4 * 2 * 3 * h * 512) and f1.moe == 0


@pytest.mark.parametrize("bad, match", [
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"mamba_d_ssm": 380}, "mamba_d_ssm"),
    ({"mamba_n_groups": 5}, "n_groups"),
    ({"ssm_multipliers": [1.0, 1.0]}, "ssm_multipliers"),
    ({"mlp_multipliers": 2.0}, "mlp_multipliers"),
    ({"time_step_limit": [0.1, 0.01]}, "time_step_limit"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}}, "rope_type"),
])
def test_falcon_h1_bad_configs_are_value_errors(falcon, bad, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf({**falcon.extra["hf_config"], **bad})


@pytest.fixture(scope="module")
def bamba() -> ModelConfig:
    return ModelConfig.from_hf(hf_dict(transformers.BambaConfig(**BAMBA_KW), "BambaForCausalLM"))


@pytest.fixture(scope="module")
def granite() -> ModelConfig:
    return ModelConfig.from_hf(hf_dict(transformers.GraniteMoeHybridConfig(**GRANITE_H_KW), "GraniteMoeHybridForCausalLM"))


def test_bamba_and_granite_layouts(bamba, granite):
    for c in (bamba, granite):
        assert c.layer_types == ("linear", "linear", "attention", "linear", "linear", "attention")
        assert (c.num_attention_layers, c.num_linear_layers) == (2, 4)
        assert c.conv_shape == (512 + 2 * 2 * 32, 3) and c.ssm_shape == (8, 64, 32)
    assert bamba.ffn_types == ("mlp",) * 6 and bamba.rotary_dim == 32  # HF's Bamba: half of each head
    assert granite.ffn_types == ("moe",) * 6 and granite.rotary_dim == 0  # position_embedding_type "nope"
    assert (granite.num_experts, granite.num_experts_per_tok, granite.moe_intermediate_size) == (8, 2, 128)
    assert granite.shared_expert_intermediate_size == 256 and granite.router == "softmax"
    assert granite.lm_head_multiplier == pytest.approx(1 / 0.8) and granite.attention_multiplier == 0.1
    assert granite.residual_multiplier == 0.5 and granite.embedding_multiplier == 6.0
    dense = ModelConfig.from_hf({**granite.extra["hf_config"], "num_local_experts": 0})
    assert dense.ffn_types == ("mlp",) * 6 and dense.intermediate_size == 256 and dense.num_experts == 0
    # Bamba's legacy config.json: top-level rope_theta, no rope_parameters -> partial factor 0.5
    legacy = {k: v for k, v in bamba.extra["hf_config"].items() if k != "rope_parameters"}
    assert ModelConfig.from_hf({**legacy, "rope_theta": 5e5}).rope_theta == 5e5
    # Granite's default layout (no layer_types) is Mamba2 everywhere, as HF's
    no_types = {k: v for k, v in granite.extra["hf_config"].items() if k != "layer_types"}
    assert ModelConfig.from_hf(no_types).layer_types == ("linear",) * 6


def test_bamba_and_granite_state_shapes_match_hf_caches(bamba, granite):
    for cfg, model in ((bamba, transformers.BambaForCausalLM(transformers.BambaConfig(**BAMBA_KW))),
                       (granite, transformers.GraniteMoeHybridForCausalLM(
                           transformers.GraniteMoeHybridConfig(**GRANITE_H_KW)))):
        with torch.no_grad():
            out = model(torch.tensor([[5, 6, 7]]), use_cache=True)
        conv = out.past_key_values.layers[0].conv_states[0]
        rec = out.past_key_values.layers[0].recurrent_states[0]
        assert tuple(conv.shape[1:]) == (cfg.conv_shape[0], cfg.conv_shape[1] + 1)
        assert tuple(rec.shape[1:]) == cfg.ssm_shape
        keys = out.past_key_values.layers[2].keys
        assert tuple(keys.shape[1::2]) == (cfg.num_kv_heads, cfg.head_dim)


def test_granite_flops_count_active_experts_and_shared_expert(granite):
    h = 256
    expert = 2 * 3 * h * 128
    assert granite.flops_per_token(1).moe == pytest.approx(6 * (2 * h * 8 + 2 * expert + 2 * 3 * h * 256))


@pytest.mark.parametrize("arch, bad, match", [
    ("bamba", {"attn_layer_indices": [7]}, "outside"),
    ("bamba", {"mamba_d_head": 48}, "mamba_d_head"),
    ("bamba", {"hidden_act": "gelu"}, "hidden_act"),
    ("bamba", {"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}}, "rope_type"),
    ("granite", {"layer_types": ["mamba"] * 5}, "num_hidden_layers"),
    ("granite", {"layer_types": ["mamba"] * 5 + ["moe"]}, "Mamba2 or attention"),
    ("granite", {"num_experts_per_tok": 9}, "num_experts_per_tok"),
    ("granite", {"logits_scaling": 0}, "logits_scaling"),
    ("granite", {"time_step_limit": [1.0, 0.5]}, "time_step_limit"),
])
def test_bamba_and_granite_bad_configs_are_value_errors(bamba, granite, arch, bad, match):
    base = (bamba if arch == "bamba" else granite).extra["hf_config"]
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf({**base, **bad})


@pytest.fixture(scope="module")
def qwen3_5_moe() -> ModelConfig:
    return ModelConfig.from_hf(hf_dict(transformers.Qwen3_5MoeTextConfig(**QWEN3_5_MOE_KW), "Qwen3_5MoeForCausalLM"))


def test_qwen3_5_moe_layout_vl_config_and_defaults(qwen3_5_moe):
    c = qwen3_5_moe
    assert c.model_type == "qwen3_5_moe" and c.linear_kind == "gdn"
    assert c.layer_types == ("linear",) * 3 + ("attention",) + ("linear",) * 3 + ("attention",)
    assert c.ffn_types == ("moe",) * 8 and c.intermediate_size == 0  # no dense MLP, no intermediate_size
    assert (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size) == (8, 2, 128)
    assert c.shared_expert_intermediate_size == 128 and c.shared_expert_gate and c.norm_topk_prob
    assert c.conv_shape == (512, 3) and c.ssm_shape == (4, 64, 64) and c.zero_centered_norm and c.attn_output_gate
    # HF reads neither decoder_sparse_step, mlp_only_layers nor norm_topk_prob: MoE everywhere, renormalised
    odd = ModelConfig.from_hf({**c.extra["hf_config"], "decoder_sparse_step": 2, "mlp_only_layers": [1],
                               "norm_topk_prob": False})
    assert odd.ffn_types == ("moe",) * 8 and odd.norm_topk_prob
    # the vision-language checkpoint: text_config, top-level tie_word_embeddings / eos / dtype, mrope keys
    text = {k: v for k, v in c.extra["hf_config"].items() if k not in ("architectures", "eos_token_id")}
    text["rope_parameters"] = {**text["rope_parameters"], "mrope_section": [11, 11, 10], "mrope_interleaved": True}
    vl = ModelConfig.from_hf({"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
                              "text_config": text, "tie_word_embeddings": True, "eos_token_id": 9,
                              "torch_dtype": "bfloat16"})
    assert vl.architecture == "Qwen3_5MoeForConditionalGeneration" and vl.tie_word_embeddings
    assert vl.eos_token_ids == (9,) and vl.dtype == torch.bfloat16  # the top level fills what text lacks
    assert vl.ffn_types == c.ffn_types and vl.rotary_dim == c.rotary_dim
    # MoE keys absent: HF's defaults (256 experts, top-8, 512 / 512)
    moe_keys = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size")
    bare = {k: v for k, v in c.extra["hf_config"].items() if k not in moe_keys}
    d = ModelConfig.from_hf(bare)
    assert (d.num_experts, d.num_experts_per_tok, d.moe_intermediate_size, d.shared_expert_intermediate_size) == (
        256, 8, 512, 512)
    assert architecture_name({"model_type": "qwen3_5_moe"}) == "Qwen3_5MoeForConditionalGeneration"
    assert architecture_name({"model_type": "qwen3_5_moe_text"}) == "Qwen3_5MoeForCausalLM"


def test_qwen3_5_moe_state_shapes_match_hf_cache_and_flops(qwen3_5_moe):
    c = qwen3_5_moe
    model = transformers.Qwen3_5MoeForCausalLM(transformers.Qwen3_5MoeTextConfig(**QWEN3_5_MOE_KW))
    with torch.no_grad():
        out = model(torch.tensor([[5, 6, 7]]), use_cache=True)
    layer = out.past_key_values.layers[0]
    assert tuple(layer.conv_states[0].shape[1:]) == (c.conv_shape[0], c.conv_shape[1] + 1)
    assert tuple(layer.recurrent_states[0].shape[1:]) == c.ssm_shape
    assert tuple(out.past_key_values.layers[3].keys.shape[1::2]) == (c.num_kv_heads, c.head_dim)
    h, expert = 256, 2 * 3 * 256 * 128  # router + 2 active experts + shared expert + its gate, every layer
    assert c.flops_per_token(1).moe == pytest.approx(8 * (2 * h * 8 + 2 * expert + expert + 2 * h))
    assert c.flops_per_token(1).mlp == 0


@pytest.mark.parametrize("bad, match", [
    ({"num_experts": 0}, "num_experts"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"layer_types": ["linear_attention"] * 7}, "num_hidden_layers"),
])
def test_qwen3_5_moe_bad_configs_are_value_errors(qwen3_5_moe, bad, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf({**qwen3_5_moe.extra["hf_config"], **bad})


@pytest.fixture(scope="module")
def lfm2() -> ModelConfig:
    return ModelConfig.from_hf(hf_dict(transformers.Lfm2Config(**LFM2_KW), "Lfm2ForCausalLM"))


def test_lfm2_layout_conv_only_state_and_legacy_keys(lfm2):
    c = lfm2
    assert c.model_type == "lfm2" and c.linear_kind == "short_conv"
    assert c.layer_types == ("linear", "linear", "attention", "linear", "attention", "linear")
    assert c.ffn_types == ("mlp",) * 6 and (c.num_attention_layers, c.num_linear_layers) == (2, 4)
    assert [c.linear_ordinal(i) for i in (0, 1, 3, 5)] == [0, 1, 2, 3]
    # the state is the conv window of B*x alone (K-1 = 2 of conv_L_cache = 3); no SSM state at all
    assert c.conv_shape == (256, 2) and c.ssm_shape == (0,)
    assert c.intermediate_size == 512  # HF: int(2/3 * 700) = 466 rounded up to a multiple of 256
    assert c.qk_norm and not c.zero_centered_norm and not c.attn_output_gate and c.rotary_dim == 64
    assert not c.tie_word_embeddings and c.rope_theta == 1e6 and not c.short_conv_bias  # untied: LFM2_KW
    layout = c.with_dtype("bfloat16").cache_layout
    assert layout.state_bytes_per_slot == 4 * 256 * 2 * 2 and layout.kv_bytes_per_token == 2 * 2 * 2 * 64 * 2
    # HF's defaults and legacy keys: attention at full_attn_idxs (every layer without it), block_ff_dim and
    # tie_embedding win, default theta 1e6, no auto-adjust keeps the width
    base = {"architectures": ["Lfm2ForCausalLM"], "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 4,
            "num_attention_heads": 16}
    legacy = ModelConfig.from_hf({**base, "full_attn_idxs": [1], "block_ff_dim": 96, "intermediate_size": 10,
                                  "tie_embedding": False, "tie_word_embeddings": True, "conv_bias": True,
                                  "block_auto_adjust_ff_dim": False, "conv_L_cache": 4})
    assert legacy.layer_types == ("linear", "attention", "linear", "linear") and legacy.intermediate_size == 96
    assert not legacy.tie_word_embeddings and legacy.short_conv_bias and legacy.conv_shape == (32, 3)
    bare = ModelConfig.from_hf(base)
    assert bare.layer_types == ("attention",) * 4 and bare.num_linear_layers == 0  # HF: all attention
    assert bare.intermediate_size == 8192 and bare.tie_word_embeddings and bare.max_position_embeddings == 128_000
    assert bare.rope_theta == 1e6 and bare.num_kv_heads == 8 and bare.head_dim == 2  # HF: 8 KV heads by default
    no_multiplier = ModelConfig.from_hf({**base, "intermediate_size": 100, "block_ffn_dim_multiplier": None})
    assert no_multiplier.intermediate_size == 66  # int(2/3 * 100), HF rounds only with a multiplier


def test_lfm2_state_shapes_match_hf_cache_and_flops(lfm2):
    model = transformers.Lfm2ForCausalLM(transformers.Lfm2Config(**LFM2_KW))
    with torch.no_grad():
        out = model(torch.tensor([[5, 6, 7]]), use_cache=True)
    conv_layer = out.past_key_values.layers[0]  # HF keeps K = 3 inputs of B*x; hyla K-1; no recurrent state
    assert tuple(conv_layer.conv_states[0].shape[1:]) == (lfm2.conv_shape[0], lfm2.conv_shape[1] + 1)
    assert all(state is None for state in conv_layer.recurrent_states.values())
    assert tuple(out.past_key_values.layers[2].keys.shape[1::2]) == (lfm2.num_kv_heads, lfm2.head_dim)
    h = 256
    f1, f2 = lfm2.flops_per_token(1), lfm2.flops_per_token(11)
    assert f1.linear == pytest.approx(4 * (2 * h * 3 * h + 2 * h * h + 2 * h * 3))  # in_proj, out_proj, conv taps
    assert f1.mlp == pytest.approx(6 * 2 * 3 * h * 512) and f1.moe == 0
    assert f2.attention - f1.attention == pytest.approx(10 * 2 * 4 * 4 * 64)
    assert f1.attention == pytest.approx(2 * (2 * h * (4 * 64 + 2 * 2 * 64) + 2 * 4 * 64 * h + 4 * 4 * 64))


@pytest.mark.parametrize("bad, match", [
    ({"layer_types": ["conv"] * 5 + ["sliding_attention"]}, "conv' or 'full_attention"),
    ({"layer_types": ["conv"] * 5}, "num_hidden_layers"),
    ({"layer_types": None, "full_attn_idxs": [6]}, "outside"),
    ({"conv_L_cache": 1}, "conv_L_cache"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}}, "rope_type"),
    ({"intermediate_size": 1, "block_auto_adjust_ff_dim": True, "block_ffn_dim_multiplier": None}, "width"),
])
def test_lfm2_bad_configs_are_value_errors(lfm2, bad, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf({**lfm2.extra["hf_config"], **bad})


@pytest.fixture(scope="module")
def lfm2_moe() -> ModelConfig:
    return ModelConfig.from_hf(hf_dict(transformers.Lfm2MoeConfig(**LFM2_MOE_KW), "Lfm2MoeForCausalLM"))


def test_lfm2_moe_layout_router_and_hf_defaults(lfm2_moe):
    c = lfm2_moe
    assert c.model_type == "lfm2_moe" and c.linear_kind == "short_conv"
    assert c.layer_types == ("linear", "attention", "linear", "attention")
    assert c.ffn_types == ("mlp", "moe", "moe", "moe")  # num_dense_layers = 1
    assert c.intermediate_size == 256  # as given: LFM2's block_auto_adjust_ff_dim rule is not LFM2-MoE's
    assert (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size, c.shared_expert_intermediate_size) == \
        (8, 2, 64, 0)
    assert c.router == "sigmoid" and c.router_bias and c.norm_topk_prob and c.routed_scaling_factor == 1.7
    # HF's Lfm2MoeTopKRouter: w / (sum + 1e-6), logits and sigmoid in the model dtype, no groups
    assert c.router_norm_eps == 1e-6 and not c.router_fp32 and (c.router_num_groups, c.router_topk_groups) == (1, 1)
    assert c.conv_shape == (128, 2) and c.ssm_shape == (0,) and c.qk_norm and c.rotary_dim == 32
    assert not c.tie_word_embeddings and c.rope_theta == 1e6 and c.norm_eps == 1e-5
    # the published LFM2-8B-A1B config.json (transformers 4.57's spelling: tie_embedding, top-level rope_theta)
    layer_types = ["conv"] * 24
    for i in (2, 6, 10, 14, 18, 21):
        layer_types[i] = "full_attention"
    published = {
        "architectures": ["Lfm2MoeForCausalLM"], "model_type": "lfm2_moe", "vocab_size": 65536, "hidden_size": 2048,
        "intermediate_size": 7168, "moe_intermediate_size": 1792, "num_hidden_layers": 24, "num_attention_heads": 32,
        "num_key_value_heads": 8, "layer_types": layer_types, "conv_L_cache": 3, "conv_bias": False, "norm_eps": 1e-5,
        "rope_theta": 1e6, "max_position_embeddings": 128000, "num_dense_layers": 2, "num_experts": 32,
        "num_experts_per_tok": 4, "use_expert_bias": True, "norm_topk_prob": True, "routed_scaling_factor": 1.0,
        "tie_embedding": True, "bos_token_id": 1, "eos_token_id": 7, "pad_token_id": 0, "dtype": "bfloat16",
    }
    big = ModelConfig.from_hf(published)
    assert big.ffn_types == ("mlp",) * 2 + ("moe",) * 22 and big.num_attention_layers == 6
    assert (big.num_experts, big.num_experts_per_tok, big.moe_intermediate_size, big.intermediate_size) == \
        (32, 4, 1792, 7168)
    assert big.tie_word_embeddings and big.eos_token_ids == (7,) and big.dtype == torch.bfloat16
    assert big.cache_layout.state_bytes_per_slot == 18 * 2048 * 2 * 2  # 18 conv windows of [2048, 2], bf16
    # HF's defaults (checked against Lfm2MoeConfig's own), LFM2's block_* width keys not read, tie_embedding wins
    base = {"vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 3, "num_attention_heads": 16,
            "layer_types": ["conv", "full_attention", "conv"], "block_ff_dim": 96, "block_auto_adjust_ff_dim": True}
    ref = transformers.Lfm2MoeConfig(**base)
    bare = ModelConfig.from_hf({**base, "architectures": ["Lfm2MoeForCausalLM"]})
    assert bare.ffn_types == ("mlp", "mlp", "moe") and ref.num_dense_layers == 2
    assert (bare.intermediate_size, bare.moe_intermediate_size) == (ref.intermediate_size, ref.moe_intermediate_size)
    assert (bare.num_experts, bare.num_experts_per_tok) == (ref.num_experts, ref.num_experts_per_tok) == (32, 4)
    assert bare.router_bias == ref.use_expert_bias and bare.norm_topk_prob == ref.norm_topk_prob
    assert bare.routed_scaling_factor == ref.routed_scaling_factor and bare.norm_eps == ref.norm_eps
    assert bare.tie_word_embeddings == ref.tie_word_embeddings and bare.rope_theta == ref.rope_parameters["rope_theta"]
    assert bare.max_position_embeddings == ref.max_position_embeddings and bare.num_kv_heads == ref.num_key_value_heads
    off = ModelConfig.from_hf({**base, "model_type": "lfm2_moe", "use_expert_bias": False, "norm_topk_prob": False,
                               "tie_embedding": False, "tie_word_embeddings": True, "num_dense_layers": 0})
    assert off.architecture == "Lfm2MoeForCausalLM" and off.ffn_types == ("moe",) * 3
    assert not off.router_bias and not off.norm_topk_prob and not off.tie_word_embeddings
    dense = ModelConfig.from_hf({**base, "architectures": ["Lfm2MoeForCausalLM"], "num_dense_layers": 5})
    assert dense.ffn_types == ("mlp",) * 3 and dense.num_experts == 0  # every layer dense: no experts at all


def test_lfm2_moe_state_shapes_match_hf_cache_and_flops(lfm2_moe):
    c = lfm2_moe
    model = transformers.Lfm2MoeForCausalLM(transformers.Lfm2MoeConfig(**LFM2_MOE_KW))
    with torch.no_grad():
        out = model(torch.tensor([[5, 6, 7]]), use_cache=True)
    cache = out["cache"]
    assert tuple(cache.layers[0].conv_states[0].shape[1:]) == (c.conv_shape[0], c.conv_shape[1] + 1)  # HF: K, hyla K-1
    assert tuple(cache.layers[1].keys.shape[1::2]) == (c.num_kv_heads, c.head_dim)
    h = 128
    f1 = c.flops_per_token(1)
    assert f1.linear == pytest.approx(2 * (2 * h * 3 * h + 2 * h * h + 2 * h * 3))
    assert f1.mlp == pytest.approx(2 * 3 * h * 256)  # the one dense layer
    assert f1.moe == pytest.approx(3 * (2 * h * 8 + 2 * 2 * 3 * h * 64))  # router + 2 active experts, 3 layers


@pytest.mark.parametrize("bad, match", [
    ({"layer_types": None}, "needs layer_types"),
    ({"layer_types": None, "full_attn_idxs": [1]}, "needs layer_types"),  # HF's Lfm2MoeConfig cannot build it
    ({"layer_types": ["conv"] * 3}, "num_hidden_layers"),
    ({"layer_types": ["conv"] * 3 + ["sliding_attention"]}, "conv' or 'full_attention"),
    ({"num_experts": 0}, "num_experts"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
    ({"moe_intermediate_size": 0}, "moe_intermediate_size"),
    ({"intermediate_size": 0}, "intermediate_size"),
    ({"conv_L_cache": 1}, "conv_L_cache"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}}, "rope_type"),
])
def test_lfm2_moe_bad_configs_are_value_errors(lfm2_moe, bad, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf({**lfm2_moe.extra["hf_config"], **bad})


@pytest.fixture(scope="module")
def kimi() -> ModelConfig:
    return ModelConfig.from_hf(hf_dict(transformers.KimiLinearConfig(**KIMI_LINEAR_KW), "KimiLinearForCausalLM"))


def test_kimi_linear_layout_latent_kv_and_kda_state(kimi):
    c = kimi
    assert c.model_type == "kimi_linear" and c.linear_kind == "kda" and c.rotary_dim == 0
    assert c.layer_types == ("linear", "linear", "attention", "linear", "linear", "attention")
    assert c.ffn_types == ("mlp",) + ("moe",) * 5  # first_k_dense_replace = 1 (HF's mlp_layer_types)
    assert (c.mla_kv_lora_rank, c.mla_q_lora_rank, c.mla_qk_nope_head_dim, c.mla_qk_rope_head_dim,
            c.mla_v_head_dim) == (64, 0, 32, 32, 48)
    # the pool holds the 96-wide latent [c_kv | k_pe]: one "head" of 48 in K and one in V
    assert (c.num_attention_heads, c.num_kv_heads, c.head_dim) == (4, 1, 48)
    assert c.conv_shape == (3 * 4 * 32, 3) and c.ssm_shape == (4, 32, 32)
    assert (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size, c.shared_expert_intermediate_size) == \
        (8, 2, 128, 128)
    assert c.router == "sigmoid" and c.norm_topk_prob and c.routed_scaling_factor == 2.446 and not c.shared_expert_gate
    assert not c.tie_word_embeddings and c.max_position_embeddings == 4096 and c.norm_eps == 1e-5
    layout = c.with_dtype("bfloat16").cache_layout
    assert layout.kv_bytes_per_token == 2 * 96 * 2  # 2 MLA layers x the latent in bf16
    assert layout.state_bytes_per_slot == 4 * (384 * 3 * 2 + 4 * 32 * 32 * 4)


def test_kimi_linear_moonshot_config_keys_equal_transformers_names(kimi):
    """The published config.json spells things Moonshot's way (linear_attn_config with 1-based layer
    lists, num_experts_per_token, moe_renormalize, ...): the same model as transformers' spelling."""
    moonshot = {
        "architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear", "vocab_size": 2048,
        "hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 128, "num_hidden_layers": 6,
        "num_attention_heads": 4, "num_key_value_heads": 4, "kv_lora_rank": 64, "q_lora_rank": None,
        "qk_nope_head_dim": 32, "qk_rope_head_dim": 32, "v_head_dim": 48, "mla_use_nope": True,
        "linear_attn_config": {"full_attn_layers": [3, 6], "kda_layers": [1, 2, 4, 5], "num_heads": 4, "head_dim": 32,
                               "short_conv_kernel_size": 4},
        "num_experts": 8, "num_experts_per_token": 2, "num_shared_experts": 1, "moe_renormalize": True,
        "moe_router_activation_func": "sigmoid", "num_expert_group": 1, "topk_group": 1, "moe_layer_freq": 1,
        "first_k_dense_replace": 1, "routed_scaling_factor": 2.446, "model_max_length": 4096, "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False, "eos_token_id": 2, "bos_token_id": 1, "pad_token_id": 0, "hidden_act": "silu",
    }
    assert ModelConfig.from_hf(moonshot) == kimi
    # HF's defaults: full attention at every 4th layer from 4, one dense layer; tie_word_embeddings is ignored
    bare = ModelConfig.from_hf({"architectures": ["KimiLinearForCausalLM"], "vocab_size": 64, "hidden_size": 32,
                                "num_hidden_layers": 9, "tie_word_embeddings": True})
    assert [i for i, t in enumerate(bare.layer_types) if t == "attention"] == [4, 8]
    assert bare.ffn_types == ("mlp",) + ("moe",) * 8 and bare.num_experts == 256 and not bare.tie_word_embeddings
    assert (bare.linear_num_value_heads, bare.linear_key_head_dim, bare.mla_kv_lora_rank, bare.head_dim) == \
        (32, 128, 512, 288)
    assert bare.max_position_embeddings == 1048576


def test_kimi_linear_state_shapes_match_hf_cache_and_flops(kimi):
    model = transformers.KimiLinearForCausalLM(transformers.KimiLinearConfig(**KIMI_LINEAR_KW))
    with torch.no_grad():
        out = model(torch.tensor([[5, 6, 7]]), use_cache=True)
    kda = out.past_key_values.layers[0]  # HF keeps K = 4 inputs of [q | k | v]; hyla K-1
    assert tuple(kda.conv_states[0].shape[1:]) == (kimi.conv_shape[0], kimi.conv_shape[1] + 1)
    assert tuple(kda.recurrent_states[0].shape[1:]) == kimi.ssm_shape
    mla = out.past_key_values.layers[2]  # HF caches the latent as (c_kv, k_pe): hyla's K and V halves
    assert mla.keys.shape[-1] + mla.values.shape[-1] == 2 * kimi.head_dim
    h, heads, d = 256, 4, 32
    f1, f2 = kimi.flops_per_token(1), kimi.flops_per_token(11)
    proj = 2 * h * (3 * heads * d + heads) + 2 * heads * d * h
    gates = 2 * 2 * (h * d + d * heads * d)
    assert f1.linear == pytest.approx(4 * (proj + gates + 2 * 3 * heads * d * 4 + 2 * 4 * heads * d * d))
    assert f2.attention - f1.attention == pytest.approx(10 * 2 * 2 * heads * (2 * 64 + 32))
    mla_proj = h * heads * 64 + h * 96 + heads * 32 * 64 + heads * 64 * 48 + heads * 48 * h
    assert f1.attention == pytest.approx(2 * (2 * mla_proj + 2 * heads * (2 * 64 + 32)))
    assert f1.mlp == pytest.approx(2 * 3 * h * 512)
    assert f1.moe == pytest.approx(5 * (2 * h * 8 + 2 * 2 * 3 * h * 128 + 2 * 3 * h * 128))


@pytest.mark.parametrize("bad, match", [
    ({"mla_use_nope": False}, "mla_use_nope"),
    ({"mla_use_output_gate": True}, "output_gate"),
    ({"linear_attn_config": {"gate_lower_bound": -5.0}}, "gate_lower_bound"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"moe_router_activation_func": "softmax"}, "sigmoid"),
    ({"moe_layer_freq": 2}, "moe_layer_freq"),
    ({"layer_types": ["linear_attention"] * 5}, "num_hidden_layers"),
    ({"layer_types": ["sliding_attention"] * 6}, "full_attention / linear_attention"),
    ({"mlp_layer_types": ["dense"] * 5 + ["moe"]}, "'dense' or 'sparse'"),
    ({"layer_types": None, "linear_attn_config": {"full_attn_layers": [3], "kda_layers": [1, 2, 4, 5]}}, "once each"),
    ({"num_experts": 0}, "num_experts"),
    ({"num_experts_per_token": 9}, "num_experts_per_tok"),
])
def test_kimi_linear_bad_configs_are_value_errors(kimi, bad, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf({**kimi.extra["hf_config"], **bad})


@pytest.fixture(scope="module")
def ling() -> ModelConfig:
    return ModelConfig.from_hf(hf_dict(transformers.BailingHybridConfig(**BAILING_HYBRID_KW),
                                       "BailingHybridForCausalLM"))


def test_bailing_hybrid_layout_rope_gates_and_defaults(ling):
    """Ling 3: Kimi-Linear's geometry (the latent in the pool, KDA states) with RoPE on MLA's 16 rope channels,
    full-rank KDA gates, the bounded decay, the per-head MLA gate; transformers' saved config.json (its head_dim
    rewritten to qk_rope_head_dim, linear_head_dim kept) and the bare defaults (Ling-3.0-Flash's sizes)."""
    c = ling
    assert c.model_type == "bailing_hybrid" and c.linear_kind == "kda"
    assert c.layer_types == ("linear", "linear", "attention") * 2  # layer_group_size 3
    assert c.ffn_types == ("mlp",) + ("moe",) * 5
    assert (c.rotary_dim, c.rope_theta, c.mla_output_gate) == (16, 10000.0, True)
    assert (c.kda_full_rank_gates, c.kda_gate_lower_bound) == (True, -5.0)
    assert (c.num_attention_heads, c.num_kv_heads, c.head_dim) == (4, 1, 40)  # the 80-wide latent, halved
    assert c.conv_shape == (3 * 4 * 32, 3) and c.ssm_shape == (4, 32, 32) and c.mtp_num_hidden_layers == 1
    assert (c.router_num_groups, c.router_topk_groups, c.routed_scaling_factor) == (2, 1, 2.5)
    assert c.extra["hf_config"]["head_dim"] == 16  # what save_pretrained writes: not the linear heads' dim
    assert ModelConfig.from_hf({**c.extra["hf_config"], "kda_safe_gate": False}).kda_gate_lower_bound == 0.0
    bare = ModelConfig.from_hf({"architectures": ["BailingHybridForCausalLM"], "vocab_size": 157184,
                                "hidden_size": 2560, "num_hidden_layers": 42, "tie_word_embeddings": True})
    assert [i for i, t in enumerate(bare.layer_types) if t == "attention"] == [5, 11, 17, 23, 29, 35, 41]
    assert bare.ffn_types == ("mlp",) * 2 + ("moe",) * 40 and not bare.tie_word_embeddings
    assert (bare.num_experts, bare.num_experts_per_tok, bare.shared_expert_intermediate_size) == (512, 8, 768)
    assert (bare.linear_num_value_heads, bare.linear_key_head_dim, bare.head_dim, bare.rope_theta) == \
        (32, 128, 288, 6e6)
    assert bare.max_position_embeddings == 262144 and bare.mtp_num_hidden_layers == 1  # transformers' defaults
    assert (bare.router_num_groups, bare.router_topk_groups, bare.eos_token_ids, bare.pad_token_id) == \
        (8, 4, (156895,), 156892)
    assert bare.kda_decay_rounded and bare.kda_gate_lower_bound == -5.0


def test_bailing_hybrid_state_shapes_match_hf_cache_and_flops(ling):
    model = transformers.BailingHybridForCausalLM(transformers.BailingHybridConfig(**BAILING_HYBRID_KW))
    with torch.no_grad():
        out = model(torch.tensor([[5, 6, 7]]), use_cache=True)
    kda = out.past_key_values.layers[0]
    assert tuple(kda.conv_states[0].shape[1:]) == (ling.conv_shape[0], ling.conv_shape[1] + 1)
    assert tuple(kda.recurrent_states[0].shape[1:]) == ling.ssm_shape
    mla = out.past_key_values.layers[2]
    assert mla.keys.shape[-1] + mla.values.shape[-1] == 2 * ling.head_dim
    mixers = sum(p.numel() for n, p in model.named_parameters() if ".self_attn." in n and p.dim() == 2)  # matrices
    f1, heads, d = ling.flops_per_token(1), 4, 32
    kda_extra = 4 * (2 * 3 * heads * d * 4 + 2 * 4 * heads * d * d)  # 4 KDA layers' convs and state updates
    mla_scores = 2 * 2 * heads * (2 * 64 + 16)  # 2 MLA layers: one token's scores and values over the latent
    assert f1.linear + f1.attention == pytest.approx(2 * mixers + kda_extra + mla_scores)
    assert f1.moe == pytest.approx(5 * (2 * 256 * 8 + 2 * 2 * 3 * 256 * 128 + 2 * 3 * 256 * 128))


@pytest.mark.parametrize("bad, match", [
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"kda_lower_bound": 1.0}, "kda_lower_bound"),
    ({"kda_lower_bound": 0.0}, "zero decay"),
    ({"layer_types": None, "layer_group_size": 0}, "layer_group_size"),
    ({"layer_types": ["linear_attention"] * 5}, "num_hidden_layers"),
    ({"mlp_layer_types": ["dense"] * 5 + ["moe"]}, "'dense' or 'sparse'"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}}, "rope_type"),
    ({"num_expert_group": 3}, "n_group"),
    ({"use_mla_nope": True}, "use_mla_nope"),
    ({"rope_interleave": False}, "rope_interleave"),
    ({"score_function": "softmax"}, "score_function"),
    ({"moe_layer_freq": 2}, "moe_layer_freq"),
])
def test_bailing_hybrid_bad_configs_are_value_errors(ling, bad, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf({**ling.extra["hf_config"], **bad})


@pytest.fixture(scope="module")
def olmo() -> ModelConfig:
    return ModelConfig.from_hf(hf_dict(transformers.OlmoHybridConfig(**OLMO_HYBRID_KW), "OlmoHybridForCausalLM"))


def test_olmo_hybrid_layout_rope_and_defaults(olmo):
    """OLMo-Hybrid: Gated DeltaNet (keys of 48, values of 64, beta x 2, output norm eps 1e-5) and post-norm
    attention with q/k normalised over all heads, NoPE (rope_theta null) as the released checkpoints; RoPE
    when a theta is set, and transformers' default when rope_parameters is absent; OlmoHybridConfig's defaults."""
    c = olmo
    assert c.model_type == "olmo_hybrid" and c.linear_kind == "gdn" and c.ffn_types == ("mlp",) * 6
    assert c.layer_types == ("linear", "linear", "attention") * 2
    assert (c.qk_norm_whole, c.qk_norm, c.attn_output_gate, c.rotary_dim) == (True, False, False, 0)
    assert (c.gdn_beta_scale, c.linear_norm_eps, c.norm_eps) == (2.0, 1e-5, 1e-6)
    assert c.ssm_shape == (4, 48, 64) and c.conv_shape == (2 * 4 * 48 + 4 * 64, 3)
    hf = c.extra["hf_config"]
    roped = ModelConfig.from_hf({**hf, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5},
                                 "linear_allow_neg_eigval": False})
    assert (roped.rotary_dim, roped.rope_theta, roped.gdn_beta_scale) == (64, 5e5, 1.0)
    assert ModelConfig.from_hf({k: v for k, v in hf.items() if k != "rope_parameters"}).rotary_dim == 64
    bare = ModelConfig.from_hf({"architectures": ["OlmoHybridForCausalLM"], "vocab_size": 100352,
                                "hidden_size": 3840, "num_hidden_layers": 32, "num_attention_heads": 30})
    assert [i for i, t in enumerate(bare.layer_types) if t == "attention"] == [3, 7, 11, 15, 19, 23, 27, 31]
    assert (bare.linear_num_key_heads, bare.linear_key_head_dim, bare.linear_value_head_dim) == (30, 96, 192)
    assert (bare.head_dim, bare.num_kv_heads, bare.intermediate_size) == (128, 30, 11008)
    two = ModelConfig.from_hf({**hf, "num_hidden_layers": 2, "layer_types": None})
    assert two.layer_types == ("linear", "attention")  # at least one attention layer: the last
    assert (bare.max_position_embeddings, bare.eos_token_ids, bare.pad_token_id) == (65536, (100257,), 100277)


def test_olmo_hybrid_state_shapes_match_hf_cache(olmo):
    model = transformers.OlmoHybridForCausalLM(transformers.OlmoHybridConfig(**OLMO_HYBRID_KW))
    with torch.no_grad():
        out = model(torch.tensor([[5, 6, 7]]), use_cache=True)
    gdn = out.past_key_values.layers[0]
    assert tuple(gdn.conv_states[0].shape[1:]) == (olmo.conv_shape[0], olmo.conv_shape[1] + 1)
    assert tuple(gdn.recurrent_states[0].shape[1:]) == olmo.ssm_shape
    attn = out.past_key_values.layers[2]
    assert tuple(attn.keys.shape[1:]) == (olmo.num_kv_heads, 3, olmo.head_dim)


@pytest.mark.parametrize("bad, match", [
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"layer_types": ["linear_attention"] * 6}, "at least one"),
    ({"layer_types": ["linear_attention"] * 5}, "num_hidden_layers"),
    ({"layer_types": ["sliding_attention"] * 6}, "full_attention / linear_attention"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}}, "rope_type"),
    ({"linear_conv_kernel_dim": 1}, "linear_conv_kernel_dim"),
    ({"linear_num_value_heads": 6}, "multiple"),
])
def test_olmo_hybrid_bad_configs_are_value_errors(olmo, bad, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf({**olmo.extra["hf_config"], **bad})


@pytest.fixture(scope="module")
def lara() -> ModelConfig:
    return ModelConfig.from_hf(hf_dict(transformers.LaraMiniConfig(**LARA_MINI_KW), "LaraMiniForCausalLM"))


def test_lara_mini_layout_windows_ropes_and_defaults(lara):
    """Lara-4-Mini: sliding-window layers (RoPE over whole heads) and NoPE global layers, Qwen3's attention (no
    output gate), plain norms, an ungated shared expert and an fp32 router in every layer; LaraMiniConfig's
    defaults (the released pattern of period 5, a window of 512)."""
    c = lara
    assert c.model_type == "lara_mini" and c.linear_kind == "gdn" and c.ffn_types == ("moe",) * 6
    assert c.layer_types == ("linear", "attention", "linear", "attention", "attention", "linear")
    assert (c.sliding_window, c.sliding_layers, c.sliding_rope, c.rotary_dim) == (6, (1, 4), (64, 10000.0), 0)
    assert (c.zero_centered_norm, c.attn_output_gate, c.qk_norm, c.shared_expert_gate) == (False, False, True, False)
    assert (c.router, c.router_logits_fp32, c.norm_topk_prob, c.num_experts_per_tok) == ("softmax", True, True, 2)
    bare = ModelConfig.from_hf({"architectures": ["LaraMiniForCausalLM"]})
    assert bare.num_hidden_layers == 34 and bare.sliding_window == 512
    assert bare.sliding_layers == tuple(i for i in range(34) if i % 5 in (1, 4))
    assert [i for i, t in enumerate(bare.layer_types) if t == "attention" and i not in bare.sliding_layers] == \
        list(range(3, 34, 5))
    assert (bare.hidden_size, bare.num_experts, bare.head_dim, bare.linear_num_value_heads) == (1024, 128, 128, 16)
    assert (bare.tie_word_embeddings, bare.eos_token_ids, bare.max_position_embeddings) == (True, (151643,), 131072)
    no_sliding = ModelConfig.from_hf({**c.extra["hf_config"], "layer_types": ["linear_attention", "full_attention"],
                                      "num_hidden_layers": 2})
    assert (no_sliding.sliding_window, no_sliding.sliding_layers, no_sliding.sliding_rope) == (0, (), None)


@pytest.mark.parametrize("bad, match", [
    ({"sliding_window": 0}, "sliding_window"),
    ({"layer_types": ["linear_attention"] * 5 + ["chunked_attention"]}, "linear_attention / sliding_attention"),
    ({"layer_types": ["linear_attention"] * 5}, "num_hidden_layers"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}}, "rope_type"),
    ({"hidden_act": "gelu"}, "hidden_act"),
])
def test_lara_mini_bad_configs_are_value_errors(lara, bad, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf({**lara.extra["hf_config"], **bad})


@pytest.fixture(scope="module")
def lfm3() -> ModelConfig:
    return ModelConfig.from_hf(hf_dict(transformers.Lfm3Config(**LFM3_KW), "Lfm3ForCausalLM"))


def test_lfm3_layout_ropes_and_defaults(lfm3):
    """LFM3: short convolutions (a window of 7), global attention with the proportional RoPE (half the frequencies
    rotate), sliding-window attention with the default RoPE (theta 1e4), sandwich norms, per-head gates; the
    intermediate size as given; Lfm3Config's defaults (global at 2 mod 4, sliding at 0 mod 4 from 4)."""
    c = lfm3
    assert c.model_type == "lfm3" and c.linear_kind == "short_conv" and c.conv_kernel == 7
    assert c.layer_types == ("linear", "linear", "attention", "linear", "attention", "linear")
    assert (c.sliding_window, c.sliding_layers, c.sliding_rope) == (6, (4,), (64, 10000.0))
    assert (c.rotary_dim, c.rope_theta, c.rope_angles) == (64, 1e6, 16)
    assert (c.attn_head_gate, c.sandwich_norm, c.qk_norm, c.attn_output_gate) == (True, True, True, False)
    assert (c.intermediate_size, c.norm_eps, c.tie_word_embeddings) == (384, 1e-5, True)
    bare = ModelConfig.from_hf({"architectures": ["Lfm3ForCausalLM"]})
    assert [i for i, t in enumerate(bare.layer_types) if t == "attention"] == [2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22]
    assert bare.sliding_layers == (4, 8, 12, 16, 20) and bare.sliding_window == 256
    assert (bare.hidden_size, bare.intermediate_size, bare.num_kv_heads, bare.head_dim) == (2048, 7680, 4, 128)
    assert (bare.eos_token_ids, bare.pad_token_id, bare.vocab_size) == ((124_900,), 124_893, 128_000)
    assert (bare.rope_angles, bare.sliding_rope) == (32, (128, 10000.0))
    hf = c.extra["hf_config"]
    plain = ModelConfig.from_hf({**hf, "use_sandwich_norm": False, "use_attention_gate": False, "rope_parameters": {
        "full_attention": {"rope_type": "default", "rope_theta": 2e5}, "sliding_attention": {"rope_theta": 5e5}}})
    assert (plain.sandwich_norm, plain.attn_head_gate, plain.rope_angles, plain.rope_theta, plain.sliding_rope) == (
        False, False, 0, 2e5, (64, 5e5))


@pytest.mark.parametrize("bad, match", [
    ({"sliding_window": None}, "sliding_window"),
    ({"layer_types": ["conv"] * 5 + ["chunked_attention"]}, "conv / sliding_attention"),
    ({"layer_types": ["conv"] * 5}, "num_hidden_layers"),
    ({"rope_parameters": {"full_attention": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}}}, "RoPE"),
    ({"rope_parameters": {"full_attention": {"rope_type": "proportional", "rope_theta": 1e6, "factor": 2.0}}},
     "RoPE"),
    ({"rope_parameters": {"sliding_attention": {"rope_type": "proportional", "rope_theta": 1e6,
                                                "partial_rotary_factor": 0.5}}}, "default RoPE"),
    ({"conv_L_cache": 1}, "conv_L_cache"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}, "per layer type"),
])
def test_lfm3_bad_configs_are_value_errors(lfm3, bad, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf({**lfm3.extra["hf_config"], **bad})


@pytest.fixture(scope="module")
def zamba2() -> ModelConfig:
    return ModelConfig.from_hf(hf_dict(transformers.Zamba2Config(**ZAMBA2_KW), "Zamba2ForCausalLM"))


def test_zamba2_layout_blocks_and_defaults(zamba2):
    """Zamba2: Mamba2 and hybrid layers (KV and a state each), heads 2 hidden / heads wide, RoPE over whole heads,
    the Mamba2 fields under their Zamba2 names with the clamp at time_step_min, the gated norm's eps 1e-5, a GeGLU
    MLP, the shared blocks and adapters; Zamba2Config's defaults (Zamba2-2.7B's 54 layers, 9 hybrid); untied
    embeddings give every hybrid layer a block of its own (transformers ties the blocks with the embeddings)."""
    c = zamba2
    assert c.model_type == "zamba2" and c.linear_kind == "mamba2"
    assert c.layer_types == ("linear", "hybrid") * 3 and c.ffn_types == ("none",) * 6
    assert (c.num_attention_layers, c.num_linear_layers) == (3, 6)
    assert (c.num_attention_heads, c.num_kv_heads, c.head_dim, c.rotary_dim) == (4, 4, 64, 64)
    assert (c.mamba_num_heads, c.mamba_head_dim, c.ssm_state_size, c.mamba_n_groups) == (8, 32, 16, 2)
    assert c.mamba_dt_limit == (1e-6, math.inf) and c.linear_norm_eps == 1e-5
    assert (c.hidden_act, c.intermediate_size, c.mlp_bias, c.mamba_proj_bias) == ("gelu", 256, False, False)
    assert (c.shared_blocks, c.shared_adapter_rank, c.shared_attention_adapters) == (2, 16, True)
    bare = ModelConfig.from_hf({"architectures": ["Zamba2ForCausalLM"]})
    assert (bare.num_hidden_layers, bare.layer_types.count("hybrid"), bare.hidden_size) == (54, 9, 2560)
    assert (bare.head_dim, bare.intermediate_size, bare.rotary_dim, bare.mamba_dt_limit[0]) == (160, 10240, 0, 1e-3)
    assert (bare.mamba_num_heads, bare.mamba_head_dim, bare.shared_blocks, bare.tie_word_embeddings) == (8, 640, 1,
                                                                                                         True)
    untied = ModelConfig.from_hf({**c.extra["hf_config"], "tie_word_embeddings": False})
    assert untied.shared_blocks == 3
    one = ModelConfig.from_hf({**c.extra["hf_config"], "num_hidden_layers": 2, "layers_block_type": ["mamba", "hybrid"]})
    assert one.shared_blocks == 1  # num_mem_blocks 2, one hybrid layer: the block no layer runs is not built
    # as transformers 5.24: use_long_context sets the context length alone, use_conv_bias is never read, a RoPE
    # that no layer applies (use_mem_rope off) is not checked
    other = ModelConfig.from_hf({**c.extra["hf_config"], "use_long_context": True, "use_conv_bias": False,
                                 "use_mem_rope": False, "rope_parameters": {"rope_type": "yarn", "factor": 4.0}})
    assert (other.max_position_embeddings, other.mamba_conv_bias, other.rotary_dim) == (16_384, True, 0)


@pytest.mark.parametrize("bad, match", [
    ({"layers_block_type": ["mamba", "hybrid", "attention"] * 2}, "Mamba2 or hybrid"),
    ({"layers_block_type": ["mamba", "hybrid"]}, "num_hidden_layers"),
    ({"hidden_act": "silu"}, "gelu"),
    ({"num_key_value_heads": 2}, "as many KV heads"),
    ({"num_attention_heads": 3, "num_key_value_heads": 3}, "multiple of num_attention_heads"),
    ({"num_mem_blocks": 0}, "num_mem_blocks"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}}, "rope_type"),
])
def test_zamba2_bad_configs_are_value_errors(zamba2, bad, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf({**zamba2.extra["hf_config"], **bad})


def test_jamba_layout_state_and_hf_defaults():
    """Jamba 1.5 Mini's config.json: attention every 8th layer from 4, experts every 2nd from 1; Mamba1
    states of [I, K-1] conv inputs and [I, N] fp32 SSM states (HF's cache shapes), no RoPE."""
    mini = {"architectures": ["JambaForCausalLM"], "vocab_size": 65536, "hidden_size": 4096, "num_hidden_layers": 32,
            "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336, "num_experts": 16,
            "num_experts_per_tok": 2, "attn_layer_period": 8, "attn_layer_offset": 4, "expert_layer_period": 2,
            "expert_layer_offset": 1, "mamba_d_state": 16, "mamba_d_conv": 4, "mamba_expand": 2,
            "mamba_dt_rank": 256, "torch_dtype": "bfloat16"}
    c = ModelConfig.from_hf(mini)
    assert c.model_type == "jamba" and c.linear_kind == "mamba1" and c.rotary_dim == 0
    assert [i for i, t in enumerate(c.layer_types) if t == "attention"] == [4, 12, 20, 28]
    assert [i for i, t in enumerate(c.ffn_types) if t == "moe"] == list(range(1, 32, 2))
    assert c.conv_shape == (8192, 3) and c.ssm_shape == (8192, 16) and c.mamba1_dt_rank == 256
    assert c.num_experts == 16 and not c.norm_topk_prob and c.moe_intermediate_size == 14336
    assert c.cache_layout.state_bytes_per_slot == 28 * (8192 * 3 * 2 + 8192 * 16 * 4)  # bf16 conv, fp32 SSM
    f = c.flops_per_token(1)
    assert f.linear == pytest.approx(28 * (2 * 4096 * 2 * 8192 + 2 * 8192 * (256 + 32) + 2 * 256 * 8192
                                           + 2 * 8192 * 4096 + 2 * 8192 * 4 + 2 * 3 * 8192 * 16))
    # HF's defaults: dt rank ceil(hidden / 16), one expert means plain MLPs
    small = ModelConfig.from_hf({**mini, "mamba_dt_rank": "auto", "num_experts": 1, "hidden_size": 40})
    assert small.mamba1_dt_rank == 3 and small.ffn_types == ("mlp",) * 32 and small.num_experts == 0
    for bad, match in [({"attn_layer_offset": 8}, "attn_layer_offset"), ({"hidden_act": "gelu"}, "hidden_act")]:
        with pytest.raises(ValueError, match=match):
            ModelConfig.from_hf({**mini, **bad})


# MiniMax-Text-01's sizes in MiniMax's own keys (attn_type_list: softmax attention after every 7 lightning layers,
# layernorm_*_alpha / _beta, rotary_dim over half of each head, postnorm)
MINIMAX_TEXT_01 = {"architectures": ["MiniMaxText01ForCausalLM"], "vocab_size": 200064,
                   "hidden_size": 6144, "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
                   "head_dim": 128, "intermediate_size": 9216, "num_local_experts": 32, "num_experts_per_tok": 2,
                   "attn_type_list": [0, 0, 0, 0, 0, 0, 0, 1] * 10, "rotary_dim": 64, "rope_theta": 10000000,
                   "layernorm_full_attention_alpha": 3.5565588200778455, "layernorm_full_attention_beta": 1.0,
                   "layernorm_linear_attention_alpha": 3.5565588200778455, "layernorm_linear_attention_beta": 1.0,
                   "layernorm_mlp_alpha": 3.5565588200778455, "layernorm_mlp_beta": 1.0, "postnorm": True,
                   "shared_intermediate_size": 0, "rms_norm_eps": 1e-05, "torch_dtype": "bfloat16"}


def test_minimax_layout_state_and_hf_keys():
    """MiniMax: lightning layers hold an [H, D, D] fp32 state and no conv window, softmax layers K/V; the
    layer list and residual factors read from transformers' keys or MiniMax's; the lightning FLOPs;
    ValueErrors for what transformers' MiniMax does not have."""
    c = ModelConfig.from_hf(MINIMAX_TEXT_01)
    assert c.architecture == "MiniMaxText01ForCausalLM" and c.model_type == "minimax" and c.linear_kind == "lightning"
    assert [i for i, t in enumerate(c.layer_types) if t == "attention"] == list(range(7, 80, 8))
    assert c.ffn_types == ("moe",) * 80 and c.num_experts == 32 and c.moe_intermediate_size == 9216
    assert c.norm_topk_prob and c.router == "softmax" and c.rotary_dim == 64 and c.rope_theta == 1e7
    assert c.residual_factors == (((3.5565588200778455, 1.0), (3.5565588200778455, 1.0)),) * 80
    assert c.conv_shape == (0, 3) and c.ssm_shape == (64, 128, 128)
    assert c.cache_layout.state_bytes_per_slot == 70 * 64 * 128 * 128 * 4  # no conv window: the fp32 states alone
    assert c.cache_layout.kv_bytes_per_token == 10 * 2 * 8 * 128 * 2  # bf16 K and V of the softmax layers
    inner = 64 * 128
    assert c.flops_per_token(1).linear == pytest.approx(70 * (2 * 6144 * 4 * inner + 2 * inner * 6144
                                                              + 2 * 3 * 64 * 128 * 128))
    # transformers' keys; its default layout (softmax attention at the even layers); whole-head RoPE by default
    hf = {k: v for k, v in MINIMAX_TEXT_01.items() if k not in ("attn_type_list", "rotary_dim") and "layernorm" not in k}
    d = ModelConfig.from_hf({**hf, "num_hidden_layers": 4, "full_attn_alpha_factor": 2, "mlp_beta_factor": 0.5})
    assert d.layer_types == ("attention", "linear", "attention", "linear") and d.rotary_dim == 128
    assert d.residual_factors[0] == ((2.0, 1.0), (1.0, 0.5)) and d.residual_factors[1] == ((1.0, 1.0), (1.0, 0.5))
    listed = ModelConfig.from_hf({**hf, "num_hidden_layers": 2, "layer_types": ["linear_attention", "full_attention"],
                                  "sliding_window": 16})
    assert listed.layer_types == ("linear", "attention") and listed.sliding_window == 16
    assert listed.sliding_layers == (1,)
    assert ModelConfig.from_hf({**MINIMAX_TEXT_01, "shared_intermediate_size": [0]}).num_experts == 32  # (MiniMax-VL's)
    no_postnorm = {k: v for k, v in MINIMAX_TEXT_01.items() if k != "postnorm"}
    with pytest.raises(ValueError, match="postnorm"):  # MiniMax's code reads a missing postnorm as false
        ModelConfig.from_hf(no_postnorm)
    assert ModelConfig.from_hf({**no_postnorm, "architectures": ["MiniMaxForCausalLM"]}).residual_factors
    for bad, match in [({"postnorm": False}, "postnorm"), ({"shared_intermediate_size": 512}, "shared experts"),
                       ({"shared_intermediate_size": [0, 512]}, "shared experts"),
                       ({"attn_type_list": [0, 2] * 40}, "attn_type_list"),
                       ({"num_local_experts": None}, "num_local_experts"),
                       ({"hidden_act": "gelu"}, "hidden_act"), ({"rotary_dim": 130}, "rotary_dim"),
                       ({"attn_type_list": [0, 1]}, "layer_types"), ({"sliding_window": 0}, "sliding_window"),
                       ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope_type")]:
        with pytest.raises(ValueError, match=match):
            ModelConfig.from_hf({**MINIMAX_TEXT_01, **bad})


# --- the pure state-space models: Mamba, FalconMamba (Mamba1), Mamba2 ----------------------------------------------
# config.json of tiiuae/falcon-mamba-7b (expand 16, but the explicit intermediate_size 8192 is what HF builds) and of
# mistralai/Mamba-Codestral-7B-v0.1 (transformers 4.44's keys: rms_norm, time_step_limit with Infinity)
FALCON_MAMBA_7B = {"architectures": ["FalconMambaForCausalLM"], "model_type": "falcon_mamba", "bos_token_id": 0,
                   "conv_kernel": 4, "eos_token_id": 11, "expand": 16, "hidden_act": "silu", "hidden_size": 4096,
                   "intermediate_size": 8192, "layer_norm_epsilon": 1e-05, "num_hidden_layers": 64, "pad_token_id": 11,
                   "residual_in_fp32": True, "state_size": 16, "tie_word_embeddings": False, "time_step_rank": 256,
                   "torch_dtype": "bfloat16", "use_bias": False, "use_conv_bias": True, "vocab_size": 65024}
MAMBA_CODESTRAL_7B = {"architectures": ["Mamba2ForCausalLM"], "model_type": "mamba2", "bos_token_id": 0,
                      "chunk_size": 256, "conv_kernel": 4, "eos_token_id": 0, "expand": 2, "head_dim": 64,
                      "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 8192,
                      "layer_norm_epsilon": 1e-05, "n_groups": 8, "norm_before_gate": True, "num_heads": 128,
                      "num_hidden_layers": 64, "pad_token_id": 0, "residual_in_fp32": True,
                      "rms_norm": True, "state_size": 128, "tie_word_embeddings": False,
                      "time_step_limit": [0.0, {"__float__": "Infinity"}], "time_step_max": 0.1, "time_step_min": 0.001,
                      "time_step_rank": 256, "torch_dtype": "bfloat16", "use_bias": False, "use_conv_bias": True,
                      "vocab_size": 32768}


def test_pure_ssm_layouts_states_and_hf_defaults():
    """FalconMamba-7B, Mamba-Codestral-7B and HF's Mamba defaults: every layer a recurrent mixer with no KV
    and no feed-forward; Mamba1 states [I, K-1] / [I, N], Mamba2's [C, K-1] / [H, P, N]; HF's defaults for
    what a config leaves out (tied Mamba embeddings, dt rank ceil(hidden / 16), expand * hidden)."""
    falcon = ModelConfig.from_hf(FALCON_MAMBA_7B)
    assert falcon.model_type == "falcon_mamba" and falcon.linear_kind == "mamba1" and falcon.dtype == torch.bfloat16
    assert falcon.layer_types == ("linear",) * 64 and falcon.ffn_types == ("none",) * 64
    assert (falcon.num_attention_layers, falcon.num_linear_layers) == (0, 64)
    assert falcon.conv_shape == (8192, 3) and falcon.ssm_shape == (8192, 16) and falcon.mamba1_dt_rank == 256
    assert falcon.mamba1_bcdt_norms and not falcon.mamba1_bcdt_norm_weights and falcon.mamba1_bcdt_norm_eps == 1e-6
    assert not falcon.tie_word_embeddings and falcon.norm_eps == 1e-5 and falcon.eos_token_ids == (11,)
    assert falcon.cache_layout.kv_bytes_per_token == 0
    assert falcon.cache_layout.state_bytes_per_slot == 64 * (8192 * 3 * 2 + 8192 * 16 * 4)  # bf16 conv, fp32 SSM
    f = falcon.flops_per_token(1)
    assert f.attention == 0 and f.mlp == 0 and f.moe == 0
    assert f.linear == pytest.approx(64 * (2 * 4096 * 2 * 8192 + 2 * 8192 * (256 + 32) + 2 * 256 * 8192
                                           + 2 * 8192 * 4096 + 2 * 8192 * 4 + 2 * 3 * 8192 * 16))
    # plain Mamba: HF's defaults (tied embeddings, expand * hidden, "auto" dt rank), no dt/B/C norms
    mamba = ModelConfig.from_hf({"architectures": ["MambaForCausalLM"], "vocab_size": 50280, "hidden_size": 40,
                                 "num_hidden_layers": 2})
    assert mamba.model_type == "mamba" and mamba.tie_word_embeddings and not mamba.mamba1_bcdt_norms
    assert mamba.mamba1_inner_size == 80 and mamba.mamba1_dt_rank == 3 and mamba.ssm_state_size == 16
    assert mamba.conv_kernel == 4 and mamba.mamba_conv_bias and not mamba.mamba_proj_bias
    codestral = ModelConfig.from_hf(MAMBA_CODESTRAL_7B)
    assert codestral.model_type == "mamba2" and codestral.linear_kind == "mamba2" and not codestral.tie_word_embeddings
    assert codestral.layer_types == ("linear",) * 64 and codestral.num_attention_layers == 0
    assert codestral.conv_shape == (8192 + 2 * 8 * 128, 3) and codestral.ssm_shape == (128, 64, 128)
    assert codestral.mamba_dt_limit == (0.0, math.inf) and codestral.mamba_rms_norm
    # its config.json says norm_before_gate: true, which transformers and vLLM ignore (the norm gates first)
    assert not codestral.mamba_norm_before_gate and codestral.mamba_n_groups == 8
    limited = ModelConfig.from_hf({**MAMBA_CODESTRAL_7B, "time_step_limit": [0.01, 0.5]})
    assert limited.mamba_dt_limit == (0.01, 0.5)  # read as it is
    # no "architectures": HF's model_type names each
    for model_type, arch in (("mamba", "MambaForCausalLM"), ("falcon_mamba", "FalconMambaForCausalLM"),
                             ("mamba2", "Mamba2ForCausalLM")):
        assert architecture_name({"model_type": model_type}) == arch


@pytest.mark.parametrize("config_cls, kw, arch", [
    (transformers.MambaConfig, MAMBA_KW, "MambaForCausalLM"),
    (transformers.FalconMambaConfig, FALCON_MAMBA_KW, "FalconMambaForCausalLM"),
    (transformers.Mamba2Config, MAMBA2_KW, "Mamba2ForCausalLM"),
], ids=["mamba", "falcon_mamba", "mamba2"])
def test_pure_ssm_state_shapes_match_hf_caches(config_cls, kw, arch):
    hf_config = config_cls(**kw)
    cfg = ModelConfig.from_hf(hf_dict(hf_config, arch))
    model = getattr(transformers, arch)(hf_config)
    with torch.no_grad():
        out = model(torch.tensor([[5, 6, 7]]), use_cache=True)
    for layer in out.cache.layers:  # (HF 5.24 returns the cache as ``cache``)
        assert tuple(layer.conv_states[0].shape[1:]) == (cfg.conv_shape[0], cfg.conv_shape[1] + 1)
        assert tuple(layer.recurrent_states[0].shape[1:]) == cfg.ssm_shape
    assert cfg.num_linear_layers == len(out.cache.layers) and cfg.num_attention_layers == 0


@pytest.mark.parametrize("base, bad, match", [
    (FALCON_MAMBA_7B, {"hidden_act": "gelu"}, "hidden_act"),
    ({**FALCON_MAMBA_7B, "architectures": ["MambaForCausalLM"]}, {"hidden_act": "relu"}, "hidden_act"),
    (FALCON_MAMBA_7B, {"state_size": 0}, "state_size"),
    (MAMBA_CODESTRAL_7B, {"hidden_act": "gelu"}, "hidden_act"),
    (MAMBA_CODESTRAL_7B, {"rms_norm": False}, "rms_norm"),
    (MAMBA_CODESTRAL_7B, {"num_heads": 64}, "expand"),
    (MAMBA_CODESTRAL_7B, {"n_groups": 3}, "n_groups"),
    (MAMBA_CODESTRAL_7B, {"n_groups": 0}, "n_groups"),
    (MAMBA_CODESTRAL_7B, {"time_step_limit": [0.5, 0.1]}, "time_step_limit"),
    (MAMBA_CODESTRAL_7B, {"num_hidden_layers": None}, "num_hidden_layers"),
], ids=["falcon_mamba-act", "mamba-act", "falcon_mamba-state", "mamba2-act", "mamba2-rms_norm",
        "mamba2-heads", "mamba2-groups", "mamba2-no-groups", "mamba2-dt-limit",
        "mamba2-layers"])
def test_pure_ssm_bad_configs_are_value_errors(base, bad, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf({**base, **bad})


@pytest.mark.parametrize("change, match", [
    ({"vocab_size": -5}, "vocab_size must be a positive integer"),
    ({"hidden_size": 0}, "hidden_size must be a positive integer"),
    ({"max_position_embeddings": 0}, "max_position_embeddings must be a positive integer"),
    ({"head_dim": None, "hidden_size": 8, "num_attention_heads": 16}, "head_dim > 0"),  # (hidden // heads)
])
def test_sizes_that_make_no_model_are_refused(change, match):
    """Sizes no model has (a negative vocabulary, a zero head size: an attention layer without KV, silently a
    state-space model to the cache's accounting) are a ValueError naming the field, not a model built on them."""
    qwen = hf_dict(transformers.Qwen3NextConfig(**QWEN3_NEXT_KW), "Qwen3NextForCausalLM")
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf({**qwen, **change})
