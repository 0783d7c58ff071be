"""Model presets (bytes per token / checkpoint, FLOP model) and the TTFT latency model."""

from __future__ import annotations

import json

import pytest

from hyla.model.config import ModelConfig
from hyla.sim.latency import LatencyModel
from hyla.sim.models import CostModel, from_model_config, marconi_7b, resolve_model
from hyla.sim.presets import HF_CONFIGS


def test_marconi_7b_matches_the_published_sizes():
    m = marconi_7b()
    assert m.kv_bytes_per_token == 64 * 1024  # 4 attention layers x K,V x d=4096 x fp16
    assert m.state_bytes_per_slot == 26_787_840  # 24 x (d*N*2 + (2d + 2N)*4*2): "26.8 MB"
    assert round(m.state_to_kv_ratio()) == 409  # one checkpoint costs ~400 tokens of KV
    d, n = 4096, 128
    # Marconi's per-layer formulas at sequence length 1 (no context): attention 8d^2 (+4d per
    # context token), MLP 16d^2, SSM 12d^2 + 16dN + 10d
    assert m.flops_per_token_base == 4 * 8 * d * d + 28 * 16 * d * d + 24 * (12 * d * d + 16 * d * n + 10 * d)
    assert m.attention_context_flops == 4 * 4 * d


@pytest.mark.parametrize("extend, prefix", [(1, 0), (7, 0), (5, 11), (100, 3)])
def test_prefill_flops_closed_form_is_the_per_token_sum(extend, prefix):
    m = marconi_7b()
    per_token = sum(m.flops_per_token_base + m.attention_context_flops * (prefix + j + 1) for j in range(extend))
    assert m.prefill_flops(extend, prefix) == pytest.approx(per_token, rel=1e-12)
    # what a cached prefix saves is exactly the prefill of that prefix
    total = prefix + extend
    assert m.prefill_flops(total) - m.prefill_flops(extend, prefix) == pytest.approx(m.prefill_flops(prefix))
    with pytest.raises(ValueError):
        m.prefill_flops(-1)


@pytest.mark.parametrize(
    "name, kv_bytes, state_bytes",
    [
        # 12 attention layers x K,V x 2 KV heads x 256 x bf16; 36 GDN layers x (conv 8192 x 3 bf16 +
        # SSM 32 x 128 x 128 fp32)
        ("qwen3-next-80b-a3b", 12 * 2 * 2 * 256 * 2, 36 * (8192 * 3 * 2 + 32 * 128 * 128 * 4)),
        # 4 attention layers x K,V x 8 KV heads x 128 x bf16; 24 Mamba2 layers x (conv (8192 + 2*8*128)
        # x 3 bf16 + SSM 128 x 64 x 128 fp32)
        ("nemotron-h-8b", 4 * 2 * 8 * 128 * 2, 24 * ((8192 + 2 * 8 * 128) * 3 * 2 + 128 * 64 * 128 * 4)),
        # every one of 44 layers: K,V x 2 KV heads x 128 x bf16 and a Mamba2 state (conv (3072 + 2*1*256)
        # x 3 bf16 + SSM 24 x 128 x 256 fp32)
        ("falcon-h1-7b", 44 * 2 * 2 * 128 * 2, 44 * ((3072 + 2 * 256) * 3 * 2 + 24 * 128 * 256 * 4)),
        # 4 attention layers x K,V x 8 KV heads x 128 x bf16; 36 Mamba2 layers x (conv (8192 + 2*128) x 3
        # bf16 + SSM 128 x 64 x 128 fp32)
        ("granite-4.0-h-small", 4 * 2 * 8 * 128 * 2, 36 * ((8192 + 2 * 128) * 3 * 2 + 128 * 64 * 128 * 4)),
        # 10 attention layers x K,V x 2 KV heads x 256 x bf16; 30 GDN layers x (conv (2*16*128 + 32*128) x 3
        # bf16 + SSM 32 x 128 x 128 fp32)
        ("qwen3.5-35b-a3b", 10 * 2 * 2 * 256 * 2, 30 * (8192 * 3 * 2 + 32 * 128 * 128 * 4)),
        # 6 attention layers x K,V x 8 KV heads x 64 x bf16; 10 short-conv layers x conv window 2048 x 2
        # bf16 and no SSM state
        ("lfm2-1.2b", 6 * 2 * 8 * 64 * 2, 10 * 2048 * 2 * 2),
        # 7 MLA layers x the latent (kv_lora_rank 512 + rope 64) x bf16; 20 KDA layers x (conv 3 x 32 x 128 x 3
        # bf16 + SSM 32 x 128 x 128 fp32)
        ("kimi-linear-48b-a3b", 7 * 576 * 2, 20 * (3 * 4096 * 3 * 2 + 32 * 128 * 128 * 4)),
        # 4 attention layers x K,V x 8 KV heads x 128 x bf16; 28 Mamba1 layers x (conv 8192 x 3 bf16 + SSM
        # 8192 x 16 fp32)
        ("jamba-1.5-mini", 4 * 2 * 8 * 128 * 2, 28 * (8192 * 3 * 2 + 8192 * 16 * 4)),
        # 6 attention layers x K,V x 8 KV heads x 64 x bf16; 18 short-conv layers x conv window 2048 x 2 bf16
        ("lfm2-8b-a1b", 6 * 2 * 8 * 64 * 2, 18 * 2048 * 2 * 2),
        # no attention: no KV; 64 Mamba1 layers x (conv 8192 x 3 bf16 + SSM 8192 x 16 fp32)
        ("falcon-mamba-7b", 0, 64 * (8192 * 3 * 2 + 8192 * 16 * 4)),
        # no attention: no KV; 64 Mamba2 layers x (conv (8192 + 2*8*128) x 3 bf16 + SSM 128 x 64 x 128 fp32)
        ("mamba-codestral-7b", 0, 64 * ((8192 + 2 * 8 * 128) * 3 * 2 + 128 * 64 * 128 * 4)),
        # 7 MLA layers x the 576-wide latent; 35 KDA layers x (conv 3 x 4096 x 3 bf16 + 32 x 128 x 128 fp32)
        ("ling-3.0-flash", 7 * 576 * 2, 35 * (3 * 4096 * 3 * 2 + 32 * 128 * 128 * 4)),
        # 8 attention layers x K,V x 30 KV heads x 128 x bf16; 24 GDN layers x (conv (2 x 30 x 96 + 30 x 192) x 3 bf16
        # + SSM 30 x 96 x 192 fp32)
        ("olmo-hybrid-7b", 8 * 2 * 30 * 128 * 2, 24 * ((2 * 30 * 96 + 30 * 192) * 3 * 2 + 30 * 96 * 192 * 4)),
        # 20 attention layers (13 of them sliding-window: their K/V kept whole) x K,V x 4 KV heads x 128 x bf16;
        # 14 GDN layers x (conv (2 x 8 x 128 + 16 x 128) x 3 bf16 + SSM 16 x 128 x 128 fp32)
        ("lara-4-mini", 20 * 2 * 4 * 128 * 2, 14 * ((2 * 8 * 128 + 16 * 128) * 3 * 2 + 16 * 128 * 128 * 4)),
        # 9 hybrid layers x K,V x 32 heads x 160 (2 x 2560 / 32) x bf16; 54 Mamba2 layers x (conv (5120 + 2 x 64) x 3
        # bf16 + SSM 8 x 640 x 64 fp32)
        ("zamba2-2.7b", 9 * 2 * 32 * 160 * 2, 54 * ((5120 + 2 * 64) * 3 * 2 + 8 * 640 * 64 * 4)),
        # 10 softmax attention layers x K,V x 8 KV heads x 128 x bf16; 70 lightning layers x 64 x 128 x 128 fp32 (no conv)
        ("minimax-text-01", 10 * 2 * 8 * 128 * 2, 70 * 64 * 128 * 128 * 4),
    ],
)
def test_hf_presets_go_through_the_model_config_parser(name, kv_bytes, state_bytes):
    m = resolve_model(name)
    cfg = ModelConfig.from_hf(HF_CONFIGS[name])
    assert (m.kv_bytes_per_token, m.state_bytes_per_slot) == (kv_bytes, state_bytes)
    assert m.kv_bytes_per_token == cfg.cache_layout.kv_bytes_per_token
    # the FLOP model is ModelConfig's, less the LM head (a prefill runs it for one token whatever is cached)
    one = cfg.flops_per_token(1)
    assert m.prefill_flops(1) == pytest.approx(one.total - one.lm_head)
    ctx = cfg.flops_per_token(1000)
    assert m.prefill_flops(1, 999) == pytest.approx(ctx.total - ctx.lm_head)


def test_any_config_json_path(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(HF_CONFIGS["nemotron-h-8b"]))
    by_dir = resolve_model(str(tmp_path))
    by_file = resolve_model(str(tmp_path / "config.json"))
    assert by_dir.kv_bytes_per_token == by_file.kv_bytes_per_token == resolve_model("nemotron-h-8b").kv_bytes_per_token
    with pytest.raises(ValueError, match="unknown model"):
        resolve_model("no-such-model")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ValueError, match="not valid JSON"):
        resolve_model(str(tmp_path / "bad.json"))
    assert by_dir.vocab_size == HF_CONFIGS["nemotron-h-8b"]["vocab_size"] and marconi_7b().vocab_size is None


@pytest.mark.parametrize("content, message", [
    ("[1]", "a model config is a JSON object, got list"),
    ("null", "a model config is a JSON object, got NoneType"),
    (json.dumps({**HF_CONFIGS["nemotron-h-8b"], "hidden_size": "abc"}), "config.json: invalid literal"),
])
def test_a_config_json_that_is_not_a_config_is_a_value_error(tmp_path, content, message):
    (tmp_path / "config.json").write_text(content)
    with pytest.raises(ValueError, match=message):
        resolve_model(str(tmp_path))


def test_pure_attention_model_is_rejected():
    cfg = ModelConfig.from_hf({**HF_CONFIGS["qwen3-next-80b-a3b"], "layer_types": ["full_attention"] * 48})
    with pytest.raises(ValueError, match="hybrid model"):
        from_model_config(cfg, "dense")


def test_a_pure_state_space_model_caches_checkpoints_alone():
    """No KV bytes: its accounting KV pool is token indices alone (the engine's, ``split_memory``),
    and a cache is checkpoints; the simulator hits at a checkpoint's exact position."""
    from hyla.cache.memory import INDEX_ONLY_KV_TOKENS
    from hyla.sim.simulator import SimConfig, Simulator
    from hyla.sim.trace import TraceRequest

    m = resolve_model("falcon-mamba-7b")
    assert m.kv_bytes_per_token == 0 and m.state_to_kv_ratio() == float("inf")
    kv, state = m.make_pools(10**9)
    assert kv.size == INDEX_ONLY_KV_TOKENS and state.size == 10**9 // m.state_bytes_per_slot
    sim = Simulator(SimConfig(m, "hyla", 10**9))
    first = TraceRequest(0, 0, 0.0, list(range(1, 301)), list(range(1000, 1040)))
    second = TraceRequest(0, 1, 9.0, list(range(1, 301)) + list(range(1000, 1040)) + [7, 8], [5])
    assert sim.serve(first).cached_tokens == 0
    assert sim.serve(second).cached_tokens == 339  # the first turn's end: prompt + output, less its last token
    assert sim.kv_bytes() == 0 and 0 < sim.state_bytes() <= 10**9
    sim.tree.check_integrity()


@pytest.mark.parametrize("policy", ["block", "lru", "marconi", "hyla"])
def test_a_pure_state_space_model_evicts_when_its_token_ids_run_out(monkeypatch, policy):
    """Its tokens cost no bytes, so what binds at a large budget is the KV pool's token ids: the
    simulator evicts for them as the engine does (it crashed with PoolExhaustedError)."""
    import random

    from hyla.sim import models
    from hyla.sim.simulator import SimConfig, simulate
    from hyla.sim.trace import TraceRequest

    monkeypatch.setattr(models, "INDEX_ONLY_KV_TOKENS", 3000)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 65024) for _ in range(1000)] for _ in range(6)]
    trace = [TraceRequest(i, 0, float(i), p, [1, 2]) for i, p in enumerate(prompts)]
    trace.append(TraceRequest(5, 1, 9.0, prompts[-1] + [1, 2, 7, 8], [5]))  # the last session's next turn
    res = simulate(trace, SimConfig(resolve_model("falcon-mamba-7b"), policy, 10**12))
    assert res.request_hit_rate > 0  # the newest checkpoint survived the evictions for token ids


def test_accounting_pools_use_the_model_layout():
    m = marconi_7b()
    kv, state = m.make_pools(10**9)
    assert kv.accounting and state.accounting
    assert (kv.bytes_per_token, state.bytes_per_slot) == (m.kv_bytes_per_token, m.state_bytes_per_slot)
    assert kv.size == 10**9 // m.kv_bytes_per_token and state.size == 10**9 // m.state_bytes_per_slot
    with pytest.raises(ValueError):
        m.make_pools(1000)


def test_ttft_is_overhead_plus_uncached_prefill_flops():
    m = marconi_7b()
    lat = LatencyModel(effective_flops=1e14, overhead_s=0.01)
    assert lat.ttft(m, 1000, 0) == pytest.approx(0.01 + m.prefill_flops(1000) / 1e14)
    assert lat.ttft(m, 1000, 600) == pytest.approx(0.01 + m.prefill_flops(400, 600) / 1e14)
    assert lat.ttft(m, 1000, 999) < lat.ttft(m, 1000, 600) < lat.ttft(m, 1000, 0)
    # linear in the uncached tokens, plus the attention term growing with the context
    a, b = lat.ttft(m, 2000, 1000), lat.ttft(m, 3000, 2000)
    assert b - a == pytest.approx(m.attention_context_flops * 1000 * 1000 / 1e14)
    with pytest.raises(ValueError):
        lat.ttft(m, 10, 11)
    with pytest.raises(ValueError):
        LatencyModel(effective_flops=0)


def test_cost_model_is_frozen():
    with pytest.raises(Exception):
        marconi_7b().head_dim = 1  # type: ignore[misc]
    assert isinstance(marconi_7b(), CostModel)


def test_falcon_h1_7b_preset_counts_attention_and_mamba_in_every_layer():
    cfg = ModelConfig.from_hf(HF_CONFIGS["falcon-h1-7b"])
    assert cfg.layer_types == ("hybrid",) * 44 and (cfg.num_attention_layers, cfg.num_linear_layers) == (44, 44)
    one = cfg.flops_per_token(1)
    params = (one.total - 4 * 12 * 128 * 44) / 2  # FLOPs at context 1 = 2 x (weights used) + QK^T / PV
    assert 6.5e9 < params + 130048 * 3072 < 8e9  # ~7B parameters (embedding counted once more)


def test_granite_4_0_h_small_preset_is_32b_with_9b_active():
    cfg = ModelConfig.from_hf(HF_CONFIGS["granite-4.0-h-small"])
    assert (cfg.num_attention_layers, cfg.num_linear_layers) == (4, 36) and cfg.rotary_dim == 0
    one = cfg.flops_per_token(1)
    active = (one.total - 4 * 4 * 32 * 128) / 2 + 100352 * 4096  # weights used per token + the embedding
    assert 8e9 < active < 10e9  # "~9B active"
    total = active + 40 * (72 - 10) * 3 * 4096 * 768  # plus the idle experts
    assert 31e9 < total < 34e9  # "32B"


def test_qwen3_5_35b_a3b_preset_is_35b_with_3b_active():
    cfg = ModelConfig.from_hf(HF_CONFIGS["qwen3.5-35b-a3b"])  # the vision-language config's text part
    assert cfg.architecture == "Qwen3_5MoeForConditionalGeneration" and cfg.ffn_types == ("moe",) * 40
    assert (cfg.num_attention_layers, cfg.num_linear_layers) == (10, 30) and cfg.rotary_dim == 64
    one = cfg.flops_per_token(1)
    active = (one.total - 10 * 4 * 16 * 256) / 2 + 248320 * 2048  # weights used per token + the embedding
    assert 2.5e9 < active < 4e9  # "A3B"
    total = active + 40 * (256 - 8) * 3 * 2048 * 512  # plus the idle experts
    assert 33e9 < total < 37e9  # "35B"


def test_lfm2_1_2b_preset_is_1_2b_with_a_conv_only_state():
    cfg = ModelConfig.from_hf(HF_CONFIGS["lfm2-1.2b"])
    assert cfg.layer_types.count("attention") == 6 and cfg.num_linear_layers == 10
    assert cfg.intermediate_size == 8192 and cfg.tie_word_embeddings and cfg.ssm_shape == (0,)
    assert cfg.cache_layout.state_bytes_per_slot == 80 * 1024  # a checkpoint costs ~7 tokens of KV
    one = cfg.flops_per_token(1)
    params = (one.total - 6 * 4 * 32 * 64) / 2  # weights used per token (the tied LM head included)
    assert 1.1e9 < params < 1.3e9


def test_kimi_linear_48b_a3b_preset_is_48b_with_3b_active():
    cfg = ModelConfig.from_hf(HF_CONFIGS["kimi-linear-48b-a3b"])
    assert (cfg.num_attention_layers, cfg.num_linear_layers) == (7, 20) and cfg.linear_kind == "kda"
    assert [i + 1 for i, t in enumerate(cfg.layer_types) if t == "attention"] == [4, 8, 12, 16, 20, 24, 27]
    assert cfg.ffn_types == ("mlp",) + ("moe",) * 26 and cfg.max_position_embeddings == 1048576
    assert (cfg.num_kv_heads, cfg.head_dim) == (1, 288)  # the 576-wide MLA latent, half in K, half in V
    one = cfg.flops_per_token(1)
    assert cfg.flops_per_token(2).attention - one.attention == 7 * 2 * 32 * (2 * 512 + 64)  # latent scores + values
    active = (one.total - 7 * 2 * 32 * (2 * 512 + 64)) / 2 + 163840 * 2304  # weights used per token + the embedding
    assert 3e9 < active < 4e9  # "A3B"
    total = active + 26 * (256 - 8) * 3 * 2304 * 1024  # plus the idle experts
    assert 46e9 < total < 50e9  # "48B"


def test_jamba_1_5_mini_preset_is_52b_with_12b_active():
    cfg = ModelConfig.from_hf(HF_CONFIGS["jamba-1.5-mini"])
    assert (cfg.num_attention_layers, cfg.num_linear_layers) == (4, 28) and cfg.linear_kind == "mamba1"
    one = cfg.flops_per_token(1)
    active = (one.total - 4 * 4 * 32 * 128) / 2 + 65536 * 4096  # weights used per token + the embedding
    assert 11e9 < active < 13e9  # "12B active"
    total = active + 16 * (16 - 2) * 3 * 4096 * 14336  # plus the idle experts
    assert 50e9 < total < 54e9  # "52B"


def test_minimax_text_01_preset_is_456b():
    """MiniMax-Text-01's sizes give its published 456 B parameters and 45.9 B activated per token (the report's
    count leaves out the embedding and the LM head: 2.5 B more)."""
    cfg = ModelConfig.from_hf(HF_CONFIGS["minimax-text-01"])
    assert (cfg.num_attention_layers, cfg.num_linear_layers) == (10, 70) and cfg.linear_kind == "lightning"
    one = cfg.flops_per_token(1)
    lightning_state = 70 * 3 * 64 * 128 * 128  # the state's multiply-adds, not weights
    attention = 10 * 2 * 64 * 128  # the one context token's scores and values
    active = (one.total - 2 * lightning_state - 2 * attention) / 2 + 200064 * 6144  # weights per token + embedding
    assert 45.8e9 < active - 2 * 200064 * 6144 < 46.0e9  # "45.9B activated"
    total = active + 80 * (32 - 2) * 3 * 6144 * 9216  # plus the idle experts
    assert 450e9 < total < 460e9  # "456B"


@pytest.mark.parametrize("field, value", [
    ("full_attention_interval", 0),  # ModelConfig.from_hf: ZeroDivisionError
    ("layer_types", 5),  # TypeError
])
def test_a_malformed_config_json_is_a_value_error(tmp_path, field, value):
    """A config.json whose fields have the wrong type or value is a bad ``--model`` (ValueError naming
    the file: the CLI exits 2 with a message), whatever the parser trips over, not a traceback."""
    (tmp_path / "config.json").write_text(json.dumps({**HF_CONFIGS["qwen3-next-80b-a3b"], field: value}))
    with pytest.raises(ValueError) as e:
        resolve_model(str(tmp_path))
    assert str(tmp_path / "config.json") in str(e.value) and "not a usable model config" in str(e.value)


@pytest.mark.parametrize("depth, message", [
    (100_000, "not valid JSON (nested too deeply)"),  # deeper than the JSON decoder recurses
    (600, "not a usable model config (a value nested too deeply)"),  # decoded, but deeper than the parser walks
])
def test_a_config_json_nested_too_deeply_is_a_value_error(tmp_path, depth, message):
    """Deep nesting in a config.json is a bad ``--model`` (a ValueError naming the file), not a
    RecursionError traceback."""
    text = json.dumps(HF_CONFIGS["qwen3-next-80b-a3b"])[:-1] + ', "x": ' + "[" * depth + "]" * depth + "}"
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(ValueError) as e:
        resolve_model(str(tmp_path))
    assert str(e.value) == f"{tmp_path / 'config.json'}: {message}"
