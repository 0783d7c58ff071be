"""``logit_bias`` and ``min_tokens`` over HTTP: /v1/chat/completions and /v1/completions take them
(``logit_bias`` keyed by token ids as JSON strings, ``min_tokens`` mapped to the engine's
``min_new_tokens``), /generate passes them in ``sampling_params``; a bad value is a 400 with an
OpenAI error body naming the field. The server runs the built-in default model in this process."""

from __future__ import annotations

import pytest

from hyla.server.app import create_app
from hyla.server.launch import BackgroundServer
from test_server_errors import _assert_error, _post

MODEL = "default"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 4, "temperature": 0}
COMPLETION = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}


@pytest.fixture(scope="module")
def server():
    with BackgroundServer(create_app(served_model_name=MODEL, max_total_tokens=8192, max_running_requests=4)) as srv:
        yield srv


def _engine(server):
    return server.app.state.server.engine


BAD = [
    pytest.param({"logit_bias": {"abc": 5}}, "logit_bias", id="key-not-a-number"),
    pytest.param({"logit_bias": {"-3": 5}}, "logit_bias", id="negative-key"),
    pytest.param({"logit_bias": {"1.0": 5}}, "logit_bias", id="decimal-point-key"),
    pytest.param({"logit_bias": {"50": 100.5}}, "logit_bias", id="bias-above-100"),
    pytest.param({"logit_bias": {"50": -1000}}, "logit_bias", id="bias-below-100"),
    pytest.param({"logit_bias": {"50": "1"}}, "logit_bias.50", id="bias-a-string"),
    pytest.param({"logit_bias": [50]}, "logit_bias", id="not-an-object"),
    pytest.param({"logit_bias": {"4096": 1}}, None, id="outside-the-vocabulary"),  # the engine's check
    pytest.param({"min_tokens": -1}, "min_tokens", id="negative-min-tokens"),
    pytest.param({"min_tokens": "2"}, "min_tokens", id="string-min-tokens"),
    pytest.param({"min_tokens": 5}, "min_tokens", id="min-tokens-above-max-tokens"),
]


@pytest.mark.parametrize("path, base", [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)])
@pytest.mark.parametrize("extra, param", BAD)
def test_bad_values_are_400(server, path, base, extra, param):
    err = _assert_error(_post(server, path, json={**base, **extra}), 400, "invalid_request_error", param)
    assert next(iter(extra)) in err["message"]


def test_min_tokens_beyond_what_the_context_leaves_is_400(server, monkeypatch):
    context = _engine(server).context_length
    body = {**CHAT, "max_tokens": None, "min_tokens": context}
    err = _assert_error(_post(server, "/v1/chat/completions", json=body), 400, "invalid_request_error", "min_tokens")
    assert "generation_config.json max_new_tokens" in err["message"]  # (the built-in model's 256: the default)
    monkeypatch.setattr(_engine(server), "default_max_new_tokens", None)  # (no cap: the context sets the limit)
    err = _assert_error(_post(server, "/v1/chat/completions", json=body), 400, "invalid_request_error", "min_tokens")
    assert "context" in err["message"]


def test_a_bias_forces_a_token(server):
    engine = _engine(server)
    forced = 100
    want = engine.tokenizer.decode([forced] * 4)
    resp = _post(server, "/v1/completions", json={**COMPLETION, "logit_bias": {str(forced): 100}})
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["text"] == want
    resp = _post(server, "/v1/chat/completions", json={**CHAT, "logit_bias": {str(forced): 100}})
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["message"]["content"] == want
    resp = _post(server, "/generate", json={"text": COMPLETION["prompt"], "sampling_params": {
        "max_new_tokens": 4, "temperature": 0, "logit_bias": {str(forced): 100}}})
    assert resp.status_code == 200, resp.text
    assert resp.json()["output_ids"] == [forced] * 4


def test_min_tokens_holds_back_a_stop_token(server):
    engine = _engine(server)
    first = engine.generate(COMPLETION["prompt"], {"max_new_tokens": 1, "temperature": 0})["output_ids"][0]
    body = {**COMPLETION, "max_tokens": 6, "stop_token_ids": [first]}
    assert _post(server, "/v1/completions", json=body).json()["usage"]["completion_tokens"] == 1
    resp = _post(server, "/v1/completions", json={**body, "min_tokens": 4})
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] >= 4
    native = _post(server, "/generate", json={"text": COMPLETION["prompt"], "sampling_params": {
        "max_new_tokens": 6, "temperature": 0, "stop_token_ids": [first], "min_new_tokens": 4}}).json()
    assert len(native["output_ids"]) >= 4 and first not in native["output_ids"][:4]
    bad = _post(server, "/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 2, "min_new_tokens": 3}})
    assert "min_new_tokens" in _assert_error(bad, 400, "invalid_request_error")["message"]
