"""``logit_bias`` (OpenAI's) and ``min_new_tokens`` (SGLang's; vLLM's ``min_tokens``) end to end.

The rules (``hyla/engine/sampler.py``, ``process_row``): a bias is added to its token's logit after
the penalties and before the grammar mask, for greedy and random rows alike; while a request has
fewer than ``min_new_tokens`` output tokens the ids that would end it (its stop token ids, and EOS
unless ``ignore_eos``) are ``-inf`` and its stop strings are not looked for. Reported logprobs stay
the raw model's. A request whose logits are processed gets no drafts, and a verify step processes its
one row as the sampler does, so speculation, the prefix cache and the overlap schedule change no
output.

The engine tests run the built-in default model (``Engine()``: a real tokenizer, text that repeats),
greedy unless a test says otherwise, a few tokens each.
"""

from __future__ import annotations

import math

import pytest
import torch

from hyla import Engine
from hyla.engine.request import Req
from hyla.engine.sampler import needs_processing, process_logits, process_row, sample
from hyla.engine.sampling_params import SamplingParams
from test_default_model import PASSAGE
from test_engine_differential import assert_drained, compare_outputs
from test_engine_speculative import _greedy

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def engine():
    with Engine(enable_prefix_cache=False) as e:
        yield e


def _gen(engine: Engine, n: int, prompt: str = PROMPT, **params) -> dict:
    return engine.generate(prompt, _greedy(n, **params), return_logprob=True)


def _req(output_ids: tuple = (), **params) -> Req:
    req = Req(rid="r", input_ids=[1, 2], sampling=SamplingParams(**params))
    req.output_ids = list(output_ids)
    return req


# --------------------------------------------------------------------------------------------
# the processing stage, alone
# --------------------------------------------------------------------------------------------
def test_which_requests_are_processed():
    assert not needs_processing(_req())
    assert not needs_processing(_req(temperature=0.7, top_k=5, stop_token_ids=[3]))
    assert needs_processing(_req(logit_bias={5: 1.0}))
    assert needs_processing(_req(repetition_penalty=1.1))
    assert needs_processing(_req(min_new_tokens=2, output_ids=(7,)))  # 1 token of 2
    assert not needs_processing(_req(min_new_tokens=2, output_ids=(7, 8)))  # reached: drafts again
    assert not needs_processing(_req(logit_bias={}))  # an empty bias is none


def test_bias_after_penalties_and_the_ban_over_both():
    row = torch.tensor([0.0, 2.0, -1.0, 3.0, 0.5])
    req = _req(output_ids=(1,), repetition_penalty=2.0, logit_bias={1: 0.25, 2: -100})
    out = process_row(row, req, eos_token_ids=[4])
    assert out.tolist() == [0.0, 1.0 + 0.25, -1.0 * 2.0 - 100, 3.0, 0.5]  # HF penalty on seen 1 and 2, then bias
    assert row.tolist() == [0.0, 2.0, -1.0, 3.0, 0.5]  # a new tensor
    # short of min_new_tokens: its stop ids and EOS are -inf, a +100 bias included; ids past the row ignored
    req = _req(output_ids=(1,), min_new_tokens=2, stop_token_ids=[3, 99], logit_bias={3: 100.0})
    out = process_row(row, req, eos_token_ids=[4])
    assert out[3] == out[4] == -math.inf and out[:3].tolist() == [0.0, 2.0, -1.0]
    assert process_row(row, _req(output_ids=(1,), min_new_tokens=2, ignore_eos=True), [4])[4] == 0.5
    assert process_row(row, _req(output_ids=(1, 2), min_new_tokens=2, stop_token_ids=[3]), [4]).tolist() == row.tolist()


def test_a_batch_with_nothing_to_process_is_left_as_it_is():
    logits = torch.randn(3, 10)
    plain = [_req(), _req(temperature=0.5), _req(min_new_tokens=1, output_ids=(4,))]
    assert process_logits(logits, [], [], None, [2]) is logits  # no copy, no per-row work
    biased = process_logits(logits, [1], [_req(logit_bias={0: 50.0})], None, [2])
    assert biased is not logits and torch.equal(biased[[0, 2]], logits[[0, 2]]) and biased[1, 0] == logits[1, 0] + 50
    assert not any(needs_processing(r) for r in plain)


def test_sample_greedy_and_random_rows_follow_the_bias_and_report_raw_logprobs():
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(0)) * 3
    reqs = [_req(temperature=0.0), _req(temperature=0.0, logit_bias={"7": 100}),
            _req(temperature=1.0, logit_bias={11: 100.0}), ]
    reqs[2].generator = torch.Generator().manual_seed(1)
    reqs[0].return_logprob = True
    out = sample(logits, reqs)
    assert out.token_ids == [int(logits[0].argmax()), 7, 11]
    raw = torch.log_softmax(logits, dim=-1)[torch.arange(3), torch.tensor(out.token_ids)]
    torch.testing.assert_close(torch.tensor(out.logprobs), raw)  # not the biased distribution's (~0)
    # short of the minimum, the model's EOS (given by the caller) cannot be drawn, even forced by a bias
    eos = int(logits[0].argmax())
    banned = [_req(temperature=0.0, min_new_tokens=1), _req(temperature=0.0, min_new_tokens=1, ignore_eos=True)]
    assert sample(logits[[0, 0]], banned, eos_token_ids=[eos]).token_ids == [int(logits[0].topk(2).indices[1]), eos]


# --------------------------------------------------------------------------------------------
# validation
# --------------------------------------------------------------------------------------------
def test_logit_bias_keys_are_normalised():
    assert SamplingParams(logit_bias={"50": -100, 7: 2}).logit_bias == {50: -100.0, 7: 2.0}
    assert SamplingParams(logit_bias={}).logit_bias is None
    assert SamplingParams.from_dict({"logit_bias": {"3": 1.5}, "min_new_tokens": 2}).min_new_tokens == 2


@pytest.mark.parametrize("params, name", [
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"-1": 1}}, "logit_bias"),
    ({"logit_bias": {-1: 1}}, "logit_bias"),
    ({"logit_bias": {"1.5": 1}}, "logit_bias"),
    ({"logit_bias": {True: 1}}, "logit_bias"),
    ({"logit_bias": {1: 100.5}}, "logit_bias"),
    ({"logit_bias": {1: -101}}, "logit_bias"),
    ({"logit_bias": {1: float("nan")}}, "logit_bias"),
    ({"logit_bias": {1: float("inf")}}, "logit_bias"),
    ({"logit_bias": {1: "1"}}, "logit_bias"),
    ({"logit_bias": {1: True}}, "logit_bias"),
    ({"logit_bias": {1: 1, "1": 2}}, "logit_bias"),
    ({"logit_bias": [1, 2]}, "logit_bias"),
    ({"min_new_tokens": -1}, "min_new_tokens"),
    ({"min_new_tokens": 2.0}, "min_new_tokens"),
    ({"min_new_tokens": True}, "min_new_tokens"),
    ({"min_new_tokens": 9, "max_new_tokens": 8}, "min_new_tokens"),
])
def test_bad_values_are_refused(params, name):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**params)


def test_a_bias_outside_the_vocabulary_is_refused_at_submission(engine):
    vocab = engine.model_config.vocab_size
    with pytest.raises(ValueError, match=rf"logit_bias: token id {vocab} is outside the vocabulary"):
        engine.generate(PROMPT, {"max_new_tokens": 2, "logit_bias": {vocab - 1: 1.0, str(vocab): 1.0}})
    assert engine.generate(PROMPT, _greedy(1, logit_bias={vocab - 1: 100}))["output_ids"] == [vocab - 1]
    assert_drained(engine)


# --------------------------------------------------------------------------------------------
# logit_bias through the engine
# --------------------------------------------------------------------------------------------
def test_a_positive_bias_forces_its_token_and_logprobs_stay_raw(engine):
    base = _gen(engine, 4, top_logprobs_num=5)
    first_top = base["meta_info"]["output_top_logprobs"][0]  # [(logprob, id)], most likely first
    runner_up_lp, runner_up = first_top[1]
    assert runner_up != base["output_ids"][0]
    out = _gen(engine, 4, top_logprobs_num=5, logit_bias={runner_up: 100})
    assert out["output_ids"] == [runner_up] * 4
    (lp, tok, _) = out["meta_info"]["output_token_logprobs"][0]
    assert tok == runner_up and lp == pytest.approx(runner_up_lp, abs=1e-5)  # the raw model's, not ~0
    top = out["meta_info"]["output_top_logprobs"][0]
    assert [i for _, i in top] == [i for _, i in first_top]
    assert [lp for lp, _ in top] == pytest.approx([lp for lp, _ in first_top], abs=1e-5)
    # a bias that leaves the choice alone leaves the logprob alone
    same = _gen(engine, 1, logit_bias={base["output_ids"][0]: 3.0})["meta_info"]["output_token_logprobs"][0]
    want = base["meta_info"]["output_token_logprobs"][0]
    assert same[1] == want[1] and same[0] == pytest.approx(want[0], abs=1e-5)


def test_a_negative_bias_bans_the_greedy_token(engine):
    base = _gen(engine, 8)["output_ids"]
    out = _gen(engine, 8, logit_bias={str(base[0]): -100})["output_ids"]
    assert out[0] != base[0] and base[0] not in out and len(out) == 8


def test_random_sampling_follows_a_huge_bias(engine):
    params = {"temperature": 1.0, "seed": 7, "max_new_tokens": 6, "ignore_eos": True}
    plain = engine.generate(PROMPT, params)["output_ids"]
    forced = engine.generate(PROMPT, {**params, "logit_bias": {33: 100}})["output_ids"]
    assert forced == [33] * 6 and plain != forced
    assert engine.generate(PROMPT, params)["output_ids"] == plain  # (the seed reproduces)


# --------------------------------------------------------------------------------------------
# min_new_tokens through the engine
# --------------------------------------------------------------------------------------------
def test_min_new_tokens_holds_back_a_stop_token(engine):
    first = _gen(engine, 1)["output_ids"][0]
    short = _gen(engine, 10, stop_token_ids=[first])
    assert short["output_ids"] == [first] and short["meta_info"]["finish_reason"] == {"type": "stop", "matched": first}
    held = _gen(engine, 10, stop_token_ids=[first], min_new_tokens=5)
    ids = held["output_ids"]
    assert len(ids) >= 5 and first not in ids[:5]
    if held["meta_info"]["finish_reason"]["type"] == "stop":  # a stop after the minimum ends it as ever
        assert ids[-1] == first and first not in ids[:-1]


def test_min_new_tokens_holds_back_eos_unless_ignored(engine):
    first = _gen(engine, 1)["output_ids"][0]
    output = engine.scheduler.output
    real_eos = output.eos_token_ids
    output.eos_token_ids = {first}  # as if the model's EOS were the token greedy decoding starts with
    try:
        params = {"temperature": 0, "max_new_tokens": 6}
        assert engine.generate(PROMPT, params)["output_ids"] == [first]
        held = engine.generate(PROMPT, {**params, "min_new_tokens": 4})["output_ids"]
        assert len(held) >= 4 and first not in held[:4]
        # with ignore_eos EOS ends nothing, so nothing holds it back
        assert engine.generate(PROMPT, {**params, "min_new_tokens": 4, "ignore_eos": True})["output_ids"][0] == first
    finally:
        output.eos_token_ids = real_eos


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_string_does_not_end_the_output_before_the_minimum(engine, stream):
    tok = engine.tokenizer
    ids = _gen(engine, 12)["output_ids"]
    text = tok.decode(ids)
    minimum = 5
    before = len(tok.decode(ids[:minimum - 1]))  # the text of the tokens a stop string may not end in
    # a stop string the output holds both before the minimum and after it
    stop = next((s for s in (tok.decode([t]) for t in ids[:minimum - 1])
                 if s.strip() and text.find(s, before - len(s) + 1) >= 0), None)
    assert stop is not None, f"no repeated piece in {text!r}"
    params = _greedy(12, stop=[stop])
    short = engine.generate(PROMPT, params)
    assert len(short["output_ids"]) < minimum and short["text"] == text[:text.index(stop)]

    params["min_new_tokens"] = minimum
    if stream:
        chunks = list(engine.generate(PROMPT, params, stream=True))
        got_text = "".join(c["text"] for c in chunks)
        got_ids = [t for c in chunks for t in c["output_ids"]]
        reason = chunks[-1]["meta_info"]["finish_reason"]
    else:
        out = engine.generate(PROMPT, params)
        got_text, got_ids, reason = out["text"], out["output_ids"], out["meta_info"]["finish_reason"]
    assert len(got_ids) >= minimum and got_ids == ids[:len(got_ids)]
    assert reason == {"type": "stop", "matched": stop}
    # the output is cut before the first stop string that ends after the text of the first minimum - 1 tokens
    assert got_text == text[:text.find(stop, before - len(stop) + 1)]


def test_min_new_tokens_under_a_grammar(engine):
    """Where the grammar may end or go on, EOS waits for the minimum; a complete grammar (nothing
    but EOS could follow) still ends the output before it."""
    params = {"temperature": 0, "max_new_tokens": 10, "regex": "a+"}
    assert engine.generate(PROMPT, params)["text"] == "a"  # greedy takes EOS at once
    held = engine.generate(PROMPT, {**params, "min_new_tokens": 5})
    assert held["text"] == "a" * len(held["output_ids"]) and len(held["output_ids"]) >= 5
    done = engine.generate(PROMPT, {**params, "regex": "(yes|no)", "min_new_tokens": 5})
    assert done["text"] in ("yes", "no") and done["meta_info"]["finish_reason"]["type"] == "stop"


# --------------------------------------------------------------------------------------------
# the same outputs with the prefix cache, the overlap schedule and speculation
# --------------------------------------------------------------------------------------------
def _workload(engine: Engine) -> tuple[list[list[int]], list[dict]]:
    """Prompts (a passage to repeat: n-gram drafts get accepted) and one request of each kind."""
    tok = engine.tokenizer
    repeat = tok.encode(tok.apply_chat_template(
        [{"role": "user", "content": "Repeat the following text exactly:\n\n" + PASSAGE}]), add_special_tokens=False)
    plain = tok.encode(PROMPT)
    first = engine.generate(input_ids=repeat, sampling_params=_greedy(2))["output_ids"]
    prompts = [repeat, repeat, repeat, repeat, plain, repeat, repeat]
    sampled = {"temperature": 0.8, "max_new_tokens": 16}
    params = [
        _greedy(16),  # a control: drafts as ever
        _greedy(16, logit_bias={first[0]: -100, first[1]: -5.0}),  # never drafts
        {**_greedy(16), "ignore_eos": False, "stop_token_ids": [first[1]], "min_new_tokens": 6},  # drafts after 6
        {**sampled, "seed": 11, "stop_token_ids": [first[1]], "min_new_tokens": 3},
        _greedy(10, stop=[" and"], min_new_tokens=4, logit_bias={"279": 1.0}),
        _greedy(12, repetition_penalty=1.2, logit_bias={first[0]: 1.0}),
        {**sampled, "seed": 12, "logit_bias": {first[0]: 2.5}, "min_new_tokens": 3},
    ]
    return prompts, params


@pytest.mark.parametrize("options", [
    pytest.param(dict(), id="prefix-cache"),
    pytest.param(dict(overlap_schedule="on"), id="overlap"),
    pytest.param(dict(speculative_algorithm="ngram"), id="ngram"),
])
def test_same_outputs_as_the_plain_engine(engine, options):
    prompts, params = _workload(engine)
    want = engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True)
    spec = "speculative_algorithm" in options
    # a sampled request that drafts draws differently (speculative sampling spends its own uniforms:
    # the module docstring of hyla/engine/speculative.py); before its minimum it has no drafts
    drafts_sampled = {3} if spec else set()
    with Engine(**options) as other:
        for _ in range(2):  # the second time from the prefix cache
            got = other.generate(input_ids=prompts, sampling_params=params, return_logprob=True)
            exact = [i for i in range(len(params)) if i not in drafts_sampled]
            assert compare_outputs([got[i] for i in exact], [want[i] for i in exact]) > 40
            for i in range(len(params)):
                g, w = got[i], want[i]
                if i in drafts_sampled:
                    n = params[i]["min_new_tokens"]
                    assert g["output_ids"][:n] == w["output_ids"][:n]
                    continue
                assert g["output_ids"] == w["output_ids"] and g["meta_info"]["finish_reason"] == w["meta_info"]["finish_reason"]
        assert_drained(other)
    banned = params[1]["logit_bias"]
    assert min(banned, key=banned.get) not in want[1]["output_ids"]
    assert params[2]["stop_token_ids"][0] not in want[2]["output_ids"][:6] and len(want[2]["output_ids"]) >= 6
    if spec:
        meta = [g["meta_info"] for g in got]
        assert meta[0]["spec_accept_length"] > 1.5  # drafts were fed and accepted
        assert meta[1]["spec_accept_length"] == 1.0 and meta[5]["spec_accept_length"] == 1.0  # never any drafts
