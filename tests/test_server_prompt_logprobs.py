"""Prompt logprobs at the server: ``echo`` + ``logprobs`` on ``/v1/completions`` (the prompt, then the
completion, with the prompt tokens' logprobs, the first null — what evaluation harnesses send,
``max_tokens: 0`` included) and ``return_logprob`` + ``logprob_start_len`` on the native ``/generate``.
Values equal the engine's own prompt logprobs (themselves checked against a plain forward in
``test_engine_prompt_logprobs``)."""

from __future__ import annotations

import httpx
import openai
import pytest

from test_server_openai import MODEL, client, engine, server  # noqa: F401  (fixtures)

PROMPT = "The quick brown fox jumps over the lazy dog"


def _engine_prompt_logprobs(engine, ids: list[int]) -> list[float | None]:  # noqa: F811
    out = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 0}, return_logprob=True,
                          logprob_start_len=0)
    return [lp for lp, _, _ in out["meta_info"]["input_token_logprobs"]]


def test_echo_with_logprobs_and_no_new_tokens(client, engine):  # noqa: F811
    ids = engine.tokenizer.encode(PROMPT)
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1)
    choice = r.choices[0]
    assert choice.text == PROMPT
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx(_engine_prompt_logprobs(engine, ids)[1:], abs=1e-4)
    assert all(len(t) >= 1 for t in lp.top_logprobs[1:])
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    assert r.usage.completion_tokens == 0 and r.usage.prompt_tokens == len(ids)


def test_echo_then_completion_streamed_and_not(client, engine):  # noqa: F811
    ids = engine.tokenizer.encode(PROMPT)
    kw = dict(model=MODEL, prompt=ids, max_tokens=4, temperature=0.0, echo=True, logprobs=0)
    r = client.completions.create(**kw)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(ids) + r.usage.completion_tokens
    prompt_text = engine.tokenizer.decode(ids)
    assert r.choices[0].text.startswith(prompt_text)
    assert lp.text_offset[len(ids)] == len(prompt_text)  # the completion's tokens continue after the prompt
    chunks = list(client.completions.create(stream=True, **kw))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    streamed = [v for c in chunks if c.choices and c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs]
    assert text == r.choices[0].text
    assert streamed[0] is None and streamed[1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-6)


def test_echo_without_logprobs_and_max_tokens_rules(client, server):  # noqa: F811
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, echo=True, temperature=0.0)
    assert r.choices[0].text.startswith(PROMPT) and r.choices[0].logprobs is None
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0)


def test_native_logprob_start_len(server, engine):  # noqa: F811
    ids = engine.tokenizer.encode(PROMPT)
    body = {"input_ids": ids, "return_logprob": True, "logprob_start_len": 3, "top_logprobs_num": 2,
            "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
    out = httpx.post(server.url + "/generate", json=body, timeout=60).json()
    got = out["meta_info"]["input_token_logprobs"]
    assert [t for _, t, _ in got] == ids[3:]
    assert [lp for lp, _, _ in got] == pytest.approx(_engine_prompt_logprobs(engine, ids)[3:], abs=1e-4)
    assert len(out["meta_info"]["input_top_logprobs"]) == len(ids) - 3
    bad = httpx.post(server.url + "/generate", json={**body, "logprob_start_len": len(ids)}, timeout=60)
    assert bad.status_code == 400 and "logprob_start_len" in bad.json()["error"]["message"]
