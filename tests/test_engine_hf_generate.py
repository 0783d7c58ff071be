"""Greedy output of the whole engine (batching, chunked prefill, prefix cache) equals transformers'
``generate`` on the same tiny checkpoint, token for token, for 32 tokens."""

from __future__ import annotations

import random

import pytest
import torch
import transformers

from hyla import Engine

NUM_TOKENS = 32


def hf_greedy(path, prompt: list[int]) -> tuple[list[int], list[float]]:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=NUM_TOKENS, do_sample=False,
                             output_scores=True, return_dict_in_generate=True, eos_token_id=None,
                             pad_token_id=0)
    tokens = out.sequences[0, len(prompt):].tolist()
    logprobs = [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(out.scores, tokens)]
    return tokens, logprobs


@pytest.mark.parametrize("ckpt", ["qwen3_next_dense_path", "qwen3_next_moe_path", "qwen3_5_moe_path", "nemotron_h_path",
                                  "falcon_h1_path", "bamba_path", "granite_h_path", "lfm2_path",
                                  "lfm2_moe_path", "kimi_linear_path", "bailing_hybrid_path", "olmo_hybrid_path",
                                  "lara_mini_path", "lfm3_path", "zamba2_path", "jamba_path", "minimax_path", "mamba_path", "falcon_mamba_path",
                                  "mamba2_path"])
def test_engine_greedy_equals_transformers_generate(ckpt, request):
    path = request.getfixturevalue(ckpt)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 2048) for _ in range(n)] for n in (7, 70, 150)]
    # chunked prefill (64-token chunks) and the prefix cache are both on: neither may change a token
    with Engine(path, chunked_prefill_size=64, max_total_tokens=4096, max_state_slots=32,
                max_running_requests=4) as engine:
        outs = engine.generate(input_ids=prompts, return_logprob=True,
                               sampling_params={"temperature": 0, "max_new_tokens": NUM_TOKENS, "ignore_eos": True})
    for prompt, out in zip(prompts, outs):
        ref_tokens, ref_lps = hf_greedy(path, prompt)
        lps = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
        for i, (a, b) in enumerate(zip(out["output_ids"], ref_tokens)):
            assert abs(lps[i] - ref_lps[i]) < 1e-4, f"token {i}: logprob {lps[i]} vs transformers {ref_lps[i]}"
            if a != b:  # a floating-point tie (same logprob, different argmax): stop comparing here
                break
        else:
            assert out["output_ids"] == ref_tokens
