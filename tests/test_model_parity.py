"""hyla vs Hugging Face transformers (the test-only oracle), fp32, max |Δlogit| <= 1e-4.

For every architecture (Qwen3-Next dense and MoE, Qwen3.5, Qwen3.5-MoE, NemotronH, Falcon-H1, Bamba,
Granite 4.0-H, LFM2, LFM2-MoE, Kimi-Linear, Ling 3 (Bailing-Hybrid), OLMo-Hybrid, Lara-4-Mini and LFM3 (sliding-window
attention), Jamba, MiniMax (lightning attention), and the pure state-space
models Mamba, FalconMamba, Mamba2):
one full prefill; the same
prompt prefilled in chunks with state and KV carried; a continuation started from a checkpoint
taken at an unaligned position plus the cached KV; 32 decode steps; a packed batch of
different-length prompts equal to each prompt alone. Prompts of 65-130 tokens cross the 64-token
chunk boundary of the linear-attention kernels.
"""

from __future__ import annotations

import inspect

import pytest
import torch
import transformers
from checkpoints import (
    TinyRunner,
    make_bailing_hybrid,
    make_bamba,
    make_falcon_h1,
    make_falcon_mamba,
    make_granite_h,
    make_kimi_linear,
    make_lara_mini,
    make_lfm2,
    make_lfm2_moe,
    make_lfm3,
    make_mamba,
    make_mamba2,
    make_minimax,
    make_nemotron_h,
    make_olmo_hybrid,
    make_qwen3_5_moe,
    make_qwen3_next,
    make_zamba2,
)

from hyla.model import load_model

TOL = 1e-4
ARCHS = ["qwen3_next_dense", "qwen3_next_moe", "qwen3_5", "qwen3_5_moe", "nemotron_h", "falcon_h1", "bamba",
         "granite_h", "lfm2", "lfm2_moe", "kimi_linear", "bailing_hybrid", "olmo_hybrid", "lara_mini", "lfm3", "zamba2",
         "jamba", "minimax", "mamba", "falcon_mamba", "mamba2"]


@pytest.fixture(scope="module")
def models(request):
    """Loaded (hyla, HF) model pairs, built lazily per architecture and kept for the module."""
    cache: dict[str, tuple[torch.nn.Module, torch.nn.Module]] = {}

    def get(arch: str):
        if arch not in cache:
            path = request.getfixturevalue(f"{arch}_path")
            hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            cache[arch] = (load_model(path, dtype="float32"), hf)
        return cache[arch]

    return get


def tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 2048, (n,), generator=g).tolist()


@torch.no_grad()
def hf_logits(hf: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """HF logits for every position of one sequence, full forward, no cache."""
    return hf(torch.tensor([ids])).logits[0].float()


@torch.no_grad()
def hf_decode(hf: torch.nn.Module, token: int, cache, position: int):
    """One HF cached decode step. The position is explicit: HF's Bamba numbers positions from 0
    when a forward gets none, even after a cache (its ``generate`` passes them). The cache goes in
    as ``cache`` where the forward takes that name (transformers 5.24: the others still accept
    ``past_key_values``, the Mamba models would leave it unread in their ``**kwargs``)."""
    name = "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"
    return hf(torch.tensor([[token]]), **{name: cache}, use_cache=True, position_ids=torch.tensor([[position]]))


def hf_cache(out):
    """The cache a HF forward returned: ``past_key_values``, the Mamba models' ``cache``."""
    return out["cache"] if "cache" in out else out.past_key_values


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a - b).abs().max().item()


@pytest.mark.parametrize("arch", ARCHS)
def test_full_prefill(models, arch):
    model, hf = models(arch)
    ids = tokens(130, seed=1)
    runner = TinyRunner(model)
    got = runner.step([runner.new_seq()], [ids], all_logits=True)
    assert max_diff(got, hf_logits(hf, ids)) <= TOL


@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_prefill_carries_state_and_kv(models, arch):
    model, hf = models(arch)
    ids = tokens(130, seed=2)
    ref = hf_logits(hf, ids)
    runner = TinyRunner(model)
    seq = runner.new_seq()
    start = 0
    for size in (50, 31, 1, 48):  # unaligned cuts, one across the 64 boundary, one single-token extend
        got = runner.step([seq], [ids[start : start + size]], decode=False, all_logits=True)
        assert max_diff(got, ref[start : start + size]) <= TOL, f"chunk at {start}"
        start += size
    assert start == len(ids)


@pytest.mark.parametrize("arch", ARCHS)
def test_continuation_from_unaligned_checkpoint_and_cached_kv(models, arch):
    model, hf = models(arch)
    prompt = tokens(100, seed=3)
    runner = TinyRunner(model)
    seq = runner.new_seq()
    ckpt_37, ckpt_70 = runner.new_state_slot(), runner.new_state_slot()
    runner.step([seq], [prompt], checkpoints=[(0, 37, ckpt_37), (0, 70, ckpt_70)])
    for cut, slot in ((37, ckpt_37), (70, ckpt_70)):
        branch = runner.fork(seq, cut, slot)  # shares the first `cut` KV slots, state = checkpoint
        cont = tokens(60, seed=4 + cut)
        got = runner.step([branch], [cont], all_logits=True)
        ref = hf_logits(hf, prompt[:cut] + cont)[cut:]
        assert max_diff(got, ref) <= TOL, f"continuation from checkpoint at {cut}"


@pytest.mark.parametrize("arch", ARCHS)
@torch.no_grad()
def test_32_decode_steps(models, arch):
    model, hf = models(arch)
    prompt = tokens(70, seed=5)
    runner = TinyRunner(model)
    seq = runner.new_seq()
    got = runner.step([seq], [prompt])
    out = hf(torch.tensor([prompt]), use_cache=True)
    cache = hf_cache(out)
    assert max_diff(got, out.logits[:, -1].float()) <= TOL
    next_token = int(out.logits[0, -1].argmax())
    for step in range(32):
        got = runner.step([seq], [[next_token]], decode=True)
        out = hf_decode(hf, next_token, cache, len(prompt) + step)
        cache = hf_cache(out)
        assert max_diff(got, out.logits[:, -1].float()) <= TOL, f"decode step {step}"
        assert int(got.argmax()) == int(out.logits[0, -1].argmax())
        next_token = int(out.logits[0, -1].argmax())


@pytest.mark.parametrize("arch", ARCHS)
def test_packed_batch_equals_each_alone(models, arch):
    model, hf = models(arch)
    prompts = [tokens(n, seed=10 + n) for n in (70, 5, 130, 1, 64)]
    packed = TinyRunner(model)
    seqs = [packed.new_seq() for _ in prompts]
    got = packed.step(seqs, prompts, all_logits=True)
    start = 0
    for ids in prompts:
        alone = TinyRunner(model)
        ref_alone = alone.step([alone.new_seq()], [ids], all_logits=True)
        assert max_diff(got[start : start + len(ids)], ref_alone) <= 1e-4  # the project fp32 tolerance: summation order varies with thread count
        assert max_diff(got[start : start + len(ids)], hf_logits(hf, ids)) <= TOL
        start += len(ids)
    # a packed batch mixing a cached-prefix continuation with fresh prompts, then batched decode
    conts = [tokens(9, seed=40 + i) for i in range(len(prompts))]
    mixed = [seqs[0], seqs[2], packed.new_seq()]
    new = [conts[0], conts[2], tokens(33, seed=50)]
    got = packed.step(mixed, new, all_logits=True)
    full = [prompts[0] + conts[0], prompts[2] + conts[2], new[2]]
    start = 0
    for ids, n in zip(full, (len(x) for x in new)):
        assert max_diff(got[start : start + n], hf_logits(hf, ids)[-n:]) <= TOL
        start += n
    for step in range(3):
        nxt = [[int(t)] for t in torch.tensor(tokens(len(mixed), seed=60 + step))]
        got = packed.step(mixed, nxt, decode=True)
        for i, s in enumerate(mixed):
            assert max_diff(got[i], hf_logits(hf, s.tokens)[-1]) <= TOL, f"decode step {step}, seq {i}"


@pytest.mark.parametrize("make,limit", [(make_nemotron_h, {"time_step_limit": (0.1, float("inf"))}), (make_zamba2, {})],
                         ids=["nemotron_h", "zamba2"])
@torch.no_grad()
def test_decode_applies_the_dt_clamp_like_prefill(tiny_ckpt_dir, make, limit):
    """Regression (issue 12, defect 4): decode steps must compute the state a prefill of the same
    tokens computes, on a checkpoint whose dt clamp binds: NemotronH's ``time_step_limit``, and
    Zamba2's ``(time_step_min, inf)``, which its HF mixer hard-codes (as NemotronH's did up to
    transformers 5.24).

    HF clamps ``softplus(dt + dt_bias)`` in its chunked (full) forward but not in its decode, so
    there its decode differs from its own full forward. hyla clamps on both paths: its decode
    follows HF's full forward, and the cache (which resumes from states left by decode) gives what
    a cache-off prefill gives.
    """
    # time_step_min = time_step_max: HF's init centres softplus(dt + dt_bias) on the clamp (binds ~half the time)
    path = make(tiny_ckpt_dir, time_step_min=0.1, time_step_max=0.1, **limit)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model = load_model(path)
    prompt, steps = tokens(40, seed=7), tokens(8, seed=8)

    full = hf_logits(hf, prompt + steps)  # clamped everywhere
    out = hf(torch.tensor([prompt]), use_cache=True)
    cache, hf_steps = hf_cache(out), []
    for i, t in enumerate(steps):
        out = hf_decode(hf, t, cache, len(prompt) + i)
        cache = hf_cache(out)
        hf_steps.append(out.logits[0, -1])
    assert max_diff(torch.stack(hf_steps), full[len(prompt) :]) > 2 * TOL  # the clamp binds here

    runner = TinyRunner(model)
    seq = runner.new_seq()
    runner.step([seq], [prompt])
    got = torch.cat([runner.step([seq], [[t]], decode=True) for t in steps])
    assert max_diff(got, full[len(prompt) :]) <= TOL
    # the state left by the decode steps is the state a prefill of the same tokens leaves
    other = TinyRunner(model)
    seq2 = other.new_seq()
    other.step([seq2], [prompt + steps])
    for a, b in zip((*runner.conv_states, *runner.ssm_states), (*other.conv_states, *other.ssm_states)):
        assert max_diff(a[seq.state_slot], b[seq2.state_slot]) <= 1e-5


@torch.no_grad()
def test_falcon_h1_dt_clamp_applies_in_prefill_and_decode(tiny_ckpt_dir):
    """Falcon-H1's time_step_limit clamps softplus(dt + dt_bias) in both hyla paths.

    HF clamps in its chunked scan only, so with a binding limit (0.05 < softplus(dt + dt_bias) ~ 1)
    HF's own decode differs from its full forward; hyla's prefill *and* decode match HF's full
    forward, and HF's decode only where the limit does not bind (the default limit: the parity tests).
    """
    _check_dt_limit_in_prefill_and_decode(make_falcon_h1(tiny_ckpt_dir, time_step_limit=[0.0, 0.05]))


@torch.no_grad()
def test_mamba2_time_step_limit_applies_in_prefill_and_decode(tiny_ckpt_dir):
    """Mamba2's ``time_step_limit`` (read as it is, where NemotronH's HF mixer hard-codes
    ``(time_step_min, inf)``) clamps softplus(dt + dt_bias) in both hyla paths, as Falcon-H1's: HF
    applies it in its chunked scan only."""
    _check_dt_limit_in_prefill_and_decode(make_mamba2(tiny_ckpt_dir, time_step_limit=[0.0, 0.05]))


def _check_dt_limit_in_prefill_and_decode(path) -> None:
    """The checkpoint at ``path`` has ``time_step_limit = (0, 0.05)``: HF's decode and full forward
    disagree (> 1e-3); hyla's prefill and decode both match HF's full forward (1e-4)."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model = load_model(path)
    assert model.config.mamba_dt_limit == (0.0, 0.05)
    prompt, steps = tokens(40, seed=7), tokens(6, seed=8)
    full = hf_logits(hf, prompt + steps)
    out = hf(torch.tensor([prompt]), use_cache=True)
    cache, hf_steps = hf_cache(out), []
    for i, t in enumerate(steps):
        out = hf_decode(hf, t, cache, len(prompt) + i)
        cache = hf_cache(out)
        hf_steps.append(out.logits[0, -1])
    assert max_diff(torch.stack(hf_steps), full[len(prompt) :]) > 1e-3  # HF's asymmetry is real here

    runner = TinyRunner(model)
    seq = runner.new_seq()
    assert max_diff(runner.step([seq], [prompt], all_logits=True), full[: len(prompt)]) <= TOL
    got_decode = torch.cat([runner.step([seq], [[t]], decode=True) for t in steps])
    assert max_diff(got_decode, full[len(prompt) :]) <= TOL  # decode clamps too: equals the full forward


VARIANTS = {
    # biases everywhere, grouped sigmoid routing over 8 experts, latent MoE, scaled weights, tied embeddings
    "nemotron_h_variant": lambda d: make_nemotron_h(
        d, seed=1, use_bias=True, use_conv_bias=False, mlp_bias=True, n_routed_experts=8, n_group=4,
        topk_group=2, num_experts_per_tok=3, moe_latent_size=64, routed_scaling_factor=2.5,
        tie_word_embeddings=True, hybrid_override_pattern=None,
        layers_block_type=["full_attention", "linear_attention", "moe", "linear_attention", "mlp"],
    ),
    # no Mamba norm (y * silu(z), HF's decode gates inside its kernel), every bias, no conv bias, one
    # group, tied embeddings (lm_head = embedding * lm_head_multiplier), mamba_d_ssm from expand * hidden
    "falcon_h1_no_norm_biases_tied": lambda d: make_falcon_h1(
        d, seed=1, mamba_rms_norm=False, attention_bias=True, mlp_bias=True, mamba_proj_bias=True,
        projectors_bias=True, mamba_conv_bias=False, mamba_n_groups=1, tie_word_embeddings=True,
        mamba_d_ssm=None, mamba_expand=1, mamba_n_heads=8, mamba_d_head="auto",
        embedding_multiplier=0.5, lm_head_multiplier=0.5,  # the tied lm_head is the embedding scaled by 8
    ),
    # Mamba: in/out projection biases, no conv bias, tied embeddings, a dt rank of 5 (not ceil(hidden / 16)),
    # a 3-wide conv, 8 states, an intermediate_size (192) other than expand * hidden
    "mamba_variant": lambda d: make_mamba(
        d, seed=1, use_bias=True, use_conv_bias=False, tie_word_embeddings=True, time_step_rank=5, conv_kernel=3,
        state_size=8, intermediate_size=192, num_hidden_layers=3,
    ),
    # FalconMamba: a mixer_rms_eps that matters (0.1: wrong eps or a missing dt/B/C norm shows), another
    # layer_norm_epsilon, tied embeddings, falcon-mamba-7b's expand 16 overridden by intermediate_size
    "falcon_mamba_variant": lambda d: make_falcon_mamba(
        d, seed=1, mixer_rms_eps=0.1, layer_norm_epsilon=1e-3, tie_word_embeddings=True, expand=16,
        intermediate_size=256, use_bias=True, num_hidden_layers=3,
    ),
    # Mamba2: in/out projection biases, no conv bias, one group, tied embeddings, 4 heads of 64, a 3-wide conv,
    # an eps that matters for the block norms and the gated norm
    "mamba2_variant": lambda d: make_mamba2(
        d, seed=1, use_bias=True, use_conv_bias=False, n_groups=1, tie_word_embeddings=True, num_heads=4,
        head_dim=64, conv_kernel=3, layer_norm_epsilon=1e-2, num_hidden_layers=3,
    ),
    # gated norm applied before the gate (w * norm(y) * silu(z)) over 4 groups, 5 layers
    "falcon_h1_norm_before_gate": lambda d: make_falcon_h1(
        d, seed=2, mamba_norm_before_gate=True, mamba_n_groups=4, num_hidden_layers=5, num_key_value_heads=4,
    ),
    # every bias, no conv bias, one group, tied embeddings, full-head RoPE from rope_parameters, other layout
    "bamba_variant": lambda d: make_bamba(
        d, seed=1, attention_bias=True, mlp_bias=True, mamba_proj_bias=True, mamba_conv_bias=False,
        mamba_n_groups=1, tie_word_embeddings=True, attn_layer_indices=[0, 3], num_hidden_layers=4,
        mamba_d_head="auto", rope_parameters={"rope_type": "default", "rope_theta": 5e5, "partial_rotary_factor": 1.0},
    ),
    # dense (no experts: the shared MLP alone), RoPE, attention bias, Mamba2 projection bias, tied
    # embeddings (lm_head = embedding / logits_scaling), MHA, layers from the legacy spelling
    "granite_h_dense_rope_tied": lambda d: make_granite_h(
        d, seed=1, num_local_experts=0, position_embedding_type="rope", attention_bias=True, mamba_proj_bias=True,
        tie_word_embeddings=True, num_key_value_heads=4, embedding_multiplier=0.5, logits_scaling=2.0,
        layer_types=["attention", "mamba", "mamba", "attention", "mamba", "mamba"],
    ),
    # top-3 of 6 experts, a wider shared expert, attention bias, tied embeddings, other layout
    "qwen3_5_moe_variant": lambda d: make_qwen3_5_moe(
        d, seed=1, num_experts=6, num_experts_per_tok=3, shared_expert_intermediate_size=192, attention_bias=True,
        tie_word_embeddings=True, num_hidden_layers=5,
        layer_types=["full_attention", "linear_attention", "linear_attention", "full_attention", "linear_attention"],
    ),
    # conv (and projection) biases, a 4-wide conv window, untied embeddings, attention from full_attn_idxs,
    # the MLP width as given (no auto-adjust), MHA, another RoPE base
    "lfm2_variant": lambda d: make_lfm2(
        d, seed=1, conv_bias=True, conv_L_cache=4, tie_word_embeddings=False, layer_types=None,
        full_attn_idxs=[0, 3], num_hidden_layers=5, block_auto_adjust_ff_dim=False, intermediate_size=384,
        num_key_value_heads=4, rope_parameters={"rope_type": "default", "rope_theta": 5e5},
    ),
    # no expert bias (the top-k of the sigmoid scores themselves), weights not renormalised, two dense layers, top-3
    # of 6 experts, conv biases, a 4-wide conv, tied embeddings, attention first
    "lfm2_moe_variant": lambda d: make_lfm2_moe(
        d, seed=1, use_expert_bias=False, norm_topk_prob=False, num_dense_layers=2, num_experts=6,
        num_experts_per_tok=3, routed_scaling_factor=0.8, conv_bias=True, conv_L_cache=4, tie_word_embeddings=True,
        num_hidden_layers=4, layer_types=["full_attention", "conv", "conv", "full_attention"],
    ),
    # low-rank q (q_a/q_b), attention biases, an odd 79-wide latent (63 + 16: zero-padded in the pool), grouped
    # routing (top-3 within the best 2 of 4 groups), other scaling, dense and sparse layers interleaved, MLA
    # first, 2 KDA heads of 48 with a 3-wide conv, tie_word_embeddings=True (which HF's Kimi-Linear ignores)
    "kimi_linear_variant": lambda d: make_kimi_linear(
        d, seed=1, q_lora_rank=48, attention_bias=True, kv_lora_rank=63, qk_rope_head_dim=16, n_group=4,
        topk_group=2, num_experts_per_tok=3, routed_scaling_factor=1.5, tie_word_embeddings=True,
        num_hidden_layers=5, mlp_layer_types=["sparse", "dense", "sparse", "sparse", "dense"],
        layer_types=["full_attention", "linear_attention", "linear_attention", "full_attention", "linear_attention"],
        linear_num_heads=2, linear_head_dim=48, linear_conv_kernel_dim=3,
    ),
    # Kimi-Linear's softplus decay (kda_safe_gate off), low-rank q (q_a/q_b, its RoPE rows de-interleaved), attention
    # biases, an odd 71-wide latent (63 + 8), top-3 of 8 experts within the best 2 of 4 groups, no renormalisation,
    # explicit layer lists (MLA first, dense layers between), 2 KDA heads of 48 with a 3-wide conv, RoPE theta 6e6
    "bailing_hybrid_variant": lambda d: make_bailing_hybrid(
        d, seed=1, kda_safe_gate=False, q_lora_rank=48, attention_bias=True, kv_lora_rank=63, qk_rope_head_dim=8,
        n_group=4, topk_group=2, num_experts_per_tok=3, norm_topk_prob=False, routed_scaling_factor=1.5,
        num_hidden_layers=5, mlp_layer_types=["sparse", "dense", "sparse", "sparse", "dense"],
        layer_types=["full_attention", "linear_attention", "linear_attention", "full_attention", "linear_attention"],
        num_attention_heads=2, head_dim=48, short_conv_kernel_size=3, rope_theta=6e6,
    ),
    # RoPE (theta 5e5), beta = sigmoid(b) (allow_neg_eigval off), 2 key heads for 4 value heads of equal width,
    # grouped-query attention (4 heads, 2 KV heads), a 3-wide conv, tied embeddings, attention first
    "olmo_hybrid_variant": lambda d: make_olmo_hybrid(
        d, seed=1, rope_parameters={"rope_type": "default", "rope_theta": 5e5}, linear_allow_neg_eigval=False,
        linear_num_key_heads=2, linear_key_head_dim=64, num_key_value_heads=2, linear_conv_kernel_dim=3,
        tie_word_embeddings=True, num_hidden_layers=4,
        layer_types=["full_attention", "linear_attention", "linear_attention", "full_attention"],
    ),
    # a window of 3 (the tree and decode masks bind sooner), sliding attention first, 4 query heads a KV head,
    # attention biases, top-3 without renormalisation, tied embeddings, RoPE theta 5e5
    "lara_mini_variant": lambda d: make_lara_mini(
        d, seed=1, sliding_window=3, num_key_value_heads=1, attention_bias=True, num_experts_per_tok=3,
        norm_topk_prob=False, tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 5e5},
        num_hidden_layers=5,
        layer_types=["sliding_attention", "linear_attention", "full_attention", "sliding_attention", "linear_attention"],
    ),
    # no sandwich norms, no head gates, the default RoPE for the global layers too (theta 2e5; the sliding ones' 5e5),
    # a window of 2, global attention first, a 3-wide conv with biases, untied embeddings
    "lfm3_variant": lambda d: make_lfm3(
        d, seed=1, use_sandwich_norm=False, use_attention_gate=False, sliding_window=2, conv_L_cache=3, conv_bias=True,
        tie_word_embeddings=False, num_hidden_layers=4, layer_types=["full_attention", "conv", "sliding_attention", "conv"],
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 2e5},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 5e5}},
    ),
    # one shared block for every hybrid layer (each with its own MLP adapter), no q/k/v adapters, no RoPE, 2 KV heads
    # for 4, one group of B/C, biases on the Mamba2 and MLP projections (add_bias_linear), a 3-wide conv (its bias
    # there whatever use_conv_bias says, as transformers'), untied embeddings, a hybrid layer first
    "zamba2_variant": lambda d: make_zamba2(
        d, seed=1, num_mem_blocks=1, use_shared_attention_adapter=False, use_mem_rope=False, num_key_value_heads=2,
        mamba_ngroups=1, add_bias_linear=True, mamba_d_conv=3, use_conv_bias=False, tie_word_embeddings=False,
        num_hidden_layers=4,
        layers_block_type=["hybrid", "mamba", "hybrid", "mamba"],
    ),
    # transformers' default layout (softmax attention at the even layers, first), a sliding window of 8 on every
    # attention layer, MiniMax-Text-01's kind of factors (alpha ~3.56, beta 1; the lightning layers' beta 0.9), 8 heads
    # of 16 (MHA), 3 experts top-1, tied embeddings, transformers' 256-token blocks
    "minimax_variant": lambda d: make_minimax(
        d, seed=1, layer_types=None, num_hidden_layers=4, sliding_window=8, full_attn_alpha_factor=3.5565588200778455,
        full_attn_beta_factor=1.0, linear_attn_alpha_factor=3.5565588200778455, linear_attn_beta_factor=0.9,
        mlp_alpha_factor=3.5565588200778455, mlp_beta_factor=1.0, num_attention_heads=8, num_key_value_heads=8,
        head_dim=16, num_local_experts=3, num_experts_per_tok=1, tie_word_embeddings=True, block_size=256,
    ),
    # attention bias, half-rotary heads, MoE only every 2nd layer but not layer 3, other layout
    "qwen3_next_variant": lambda d: make_qwen3_next(
        d, moe=True, seed=1, attention_bias=True, decoder_sparse_step=2, mlp_only_layers=[3], num_hidden_layers=5,
        layer_types=["full_attention", "linear_attention", "linear_attention", "full_attention", "linear_attention"],
        rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5},
    ),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@torch.no_grad()
def test_config_variants_prefill_and_decode(variant, tiny_ckpt_dir):
    path = VARIANTS[variant](tiny_ckpt_dir)
    model = load_model(path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompt = tokens(90, seed=9)
    runner = TinyRunner(model)
    seq = runner.new_seq()
    got = runner.step([seq], [prompt[:70]], all_logits=True)
    got = torch.cat([got, runner.step([seq], [prompt[70:]], all_logits=True)])
    assert max_diff(got, hf_logits(hf, prompt)) <= TOL
    out = hf(torch.tensor([prompt]), use_cache=True)
    cache = hf_cache(out)
    for i, t in enumerate(tokens(4, seed=11)):
        got = runner.step([seq], [[t]], decode=True)
        out = hf_decode(hf, t, cache, len(prompt) + i)
        cache = hf_cache(out)
        assert max_diff(got, out.logits[:, -1].float()) <= TOL
