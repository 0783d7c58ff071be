"""Prompt logprobs (SGLang's ``return_logprob`` + ``logprob_start_len``): each prompt token's
logprob under the model, equal to a plain forward's ``log_softmax`` — whatever the prefill chunking,
page size or prefix cache (a cached token has no logits: such a request reuses the cache only up to
the position before its first prompt logprob)."""

from __future__ import annotations

import random

import pytest
import torch

import checkpoints
from hyla import Engine
from hyla.model import load_model

TOL = 1e-4


def _reference(path, ids: list[int]) -> list[float]:
    runner = checkpoints.TinyRunner(load_model(path))
    logits = runner.step([runner.new_seq()], [ids], all_logits=True)  # [T, V]
    logprobs = torch.log_softmax(logits, dim=-1)
    return [logprobs[q, ids[q + 1]].item() for q in range(len(ids) - 1)]


@pytest.mark.parametrize("opts", [dict(chunked_prefill_size=8), dict(page_size=16, chunked_prefill_size=32),
                                  dict(enable_prefix_cache=False)])
def test_prompt_logprobs_match_a_plain_forward(qwen3_5_path, opts):
    rng = random.Random(0)
    ids = [rng.randrange(3, 2000) for _ in range(45)]
    ref = _reference(qwen3_5_path, ids)
    with Engine(qwen3_5_path, max_total_tokens=1024, max_state_slots=16, **opts) as engine:
        greedy = {"temperature": 0, "max_new_tokens": 3, "top_logprobs_num": 2}
        plain = engine.generate(input_ids=ids, sampling_params=greedy, return_logprob=True)
        assert "input_token_logprobs" not in plain["meta_info"]
        for start in (0, 1, 20, 44):
            out = engine.generate(input_ids=ids, sampling_params=greedy, return_logprob=True,
                                  logprob_start_len=start)
            got = out["meta_info"]["input_token_logprobs"]
            assert [t for _, t, _ in got] == ids[start:]
            if start == 0:
                assert got[0][0] is None and out["meta_info"]["input_top_logprobs"][0] is None
            values = [lp for lp, _, _ in got if lp is not None]
            assert values == pytest.approx(ref[max(start, 1) - 1:], abs=TOL)
            tops = [t for t in out["meta_info"]["input_top_logprobs"] if t is not None]
            assert len(tops) == len(values) and all(len(t) == 2 for t in tops)
            # the cache never serves a token whose logits are needed; the output is unchanged
            assert out["meta_info"]["cached_tokens"] <= max(start - 1, 0)
            assert out["output_ids"] == plain["output_ids"]
        engine.wait_idle()
        engine.check_integrity()


def test_prompt_logprobs_only(qwen3_5_path):
    """``max_new_tokens=0``: prompt logprobs and no output (an evaluation harness's loglikelihood)."""
    ids = list(range(10, 40))
    ref = _reference(qwen3_5_path, ids)
    with Engine(qwen3_5_path, max_total_tokens=512, max_state_slots=16) as engine:
        outs = engine.generate(input_ids=[ids, ids[:12]], sampling_params={"max_new_tokens": 0},
                               return_logprob=True, logprob_start_len=[5, 0])
    assert outs[0]["output_ids"] == [] and outs[0]["meta_info"]["finish_reason"]["type"] == "length"
    assert [lp for lp, _, _ in outs[0]["meta_info"]["input_token_logprobs"]] == pytest.approx(ref[4:], abs=TOL)
    assert len(outs[1]["meta_info"]["input_token_logprobs"]) == 12


def test_logprob_start_len_is_validated(qwen3_5_path):
    with Engine(qwen3_5_path, max_total_tokens=256, max_state_slots=8) as engine:
        for bad in (5, -2, 1.5, True):
            with pytest.raises(ValueError, match="logprob_start_len"):
                engine.generate(input_ids=[1, 2, 3, 4, 5], return_logprob=True, logprob_start_len=bad)
        with pytest.raises(ValueError, match="return_logprob"):
            engine.generate(input_ids=[1, 2, 3], logprob_start_len=0)
        with pytest.raises(ValueError, match="logprob_start_len values"):
            engine.generate(input_ids=[[1, 2], [3, 4]], return_logprob=True, logprob_start_len=[0])
        assert engine.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 1})["output_ids"]
