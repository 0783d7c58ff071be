"""SGLang's native endpoints beside ``/generate``: ``/abort_request`` (an aborted request's client
gets what it produced, ``finish_reason`` abort), ``/get_model_info``, ``/get_server_info`` and
``/health_generate`` (a health check through the engine)."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from hyla.server import native_routes
from hyla.server.app import create_app
from hyla.server.launch import BackgroundServer
from test_server_openai import MODEL, make_chat_model

LONG = {"max_new_tokens": 1500, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(tiny_ckpt_dir):
    app = create_app(make_chat_model(tiny_ckpt_dir), served_model_name=MODEL, max_total_tokens=8192,
                     max_state_slots=32, context_length=2048, max_running_requests=4)
    with BackgroundServer(app) as srv:
        yield srv


def _engine(server):
    return server.app.state.server.engine


def _in_thread(fn):
    """Run ``fn()`` in a thread; returns a function that joins it and gives ``fn``'s result."""
    box: dict = {}
    thread = threading.Thread(target=lambda: box.setdefault("out", fn()))
    thread.start()
    return lambda: (thread.join(60), box["out"])[1]


def _wait_running(engine, n: int) -> None:
    deadline = time.monotonic() + 30
    while engine.get_stats()["num_running_requests"] < n:
        assert time.monotonic() < deadline, engine.get_stats()
        time.sleep(0.01)


def test_abort_request_by_rid_answers_what_was_generated(server):
    engine = _engine(server)
    body = {"text": "Tell me a long story", "rid": "long-1", "sampling_params": LONG}
    result = _in_thread(lambda: httpx.post(server.url + "/generate", json=body, timeout=60))
    other = _in_thread(lambda: httpx.post(server.url + "/generate", timeout=60, json={
        "text": "Another one", "sampling_params": {**LONG, "max_new_tokens": 40}}))
    _wait_running(engine, 2)
    resp = httpx.post(server.url + "/abort_request", json={"rid": "long-1"}, timeout=10)
    assert resp.status_code == 200 and resp.json() == {"status": "ok"}
    out = result()
    assert out.status_code == 200, out.text
    meta = out.json()["meta_info"]
    assert meta["finish_reason"]["type"] == "abort" and meta["finish_reason"]["cause"] == "client"
    assert 0 < meta["completion_tokens"] < 1500 and len(out.json()["output_ids"]) == meta["completion_tokens"]
    assert other().json()["meta_info"]["finish_reason"] == {"type": "length", "length": 40}  # untouched
    httpx.post(server.url + "/abort_request", json={"rid": "no-such-request"}, timeout=10).raise_for_status()


def test_chats_and_completions_take_their_request_ids_from_rid_or_x_request_id(server):
    """SGLang's body ``rid`` names a chat's or completion's engine requests, so ``/abort_request`` aborts one by
    it (one in use is a 400); vLLM's ``X-Request-Id`` starts them (``<id>-<i>-<hex>``: the same header twice at
    once never clashes) and comes back on the answer, errors included; ids that do not fit are a 400."""
    engine = _engine(server)
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1500, "temperature": 0,
            "ignore_eos": True}
    answer = _in_thread(lambda: httpx.post(server.url + "/v1/chat/completions", timeout=60,
                                           json={**chat, "rid": "chat-a"}))
    _wait_running(engine, 1)
    clash = httpx.post(server.url + "/v1/chat/completions", json={**chat, "rid": "chat-a"}, timeout=30)
    assert clash.status_code == 400 and clash.json()["error"]["param"] == "rid", clash.text
    httpx.post(server.url + "/abort_request", json={"rid": "chat-a"}, timeout=10).raise_for_status()
    out = answer()
    assert out.status_code == 200 and out.json()["choices"][0]["finish_reason"] == "abort", out.text
    assert "x-request-id" not in out.headers
    completion = {"model": MODEL, "prompt": ["a", "b"], "n": 2, "max_tokens": 1500, "temperature": 0,
                  "ignore_eos": True}
    answers = [_in_thread(lambda: httpx.post(server.url + "/v1/completions", json=completion, timeout=60,
                                             headers={"X-Request-Id": "batch"})) for _ in range(2)]
    deadline = time.monotonic() + 30  # (the same header twice at once: no clash; 4 run, 4 wait)
    while len(rids := [r.rid for r in [*engine.scheduler.running, *engine.scheduler.waiting]]) < 8:
        assert time.monotonic() < deadline, rids
        time.sleep(0.01)
    rids = sorted(rids)
    assert [r.rsplit("-", 1)[0] for r in rids] == ["batch-0", "batch-0", "batch-1", "batch-1", "batch-2", "batch-2",
                                                   "batch-3", "batch-3"], rids
    httpx.post(server.url + "/abort_request", json={"abort_all": True}, timeout=10).raise_for_status()
    assert [a().headers["x-request-id"] for a in answers] == ["batch", "batch"]
    for body, message in (({**completion, "rid": "one"}, "4 choices"), ({**completion, "rid": ["x"] * 4}, "distinct"),
                          ({**chat, "n": 2, "rid": ["x", ""]}, "distinct")):
        path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
        bad = httpx.post(server.url + path, json=body, headers={"X-Request-Id": "e"}, timeout=30)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "rid" and message in bad.text, bad.text
        assert bad.headers["x-request-id"] == "e"


def test_abort_all_ends_streams_and_chats_with_an_abort_finish(server):
    engine = _engine(server)

    def stream() -> list[str]:
        with httpx.stream("POST", server.url + "/generate", timeout=60,
                          json={"text": "Once", "stream": True, "sampling_params": LONG}) as r:
            return [line for line in r.iter_lines() if line]

    streamed = _in_thread(stream)
    chat = _in_thread(lambda: httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1500,
        "temperature": 0, "ignore_eos": True}))
    _wait_running(engine, 2)
    httpx.post(server.url + "/abort_request", json={"abort_all": True}, timeout=10).raise_for_status()
    lines = streamed()
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2].removeprefix("data: "))["meta_info"]["finish_reason"]["type"] == "abort"
    answer = chat()
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["finish_reason"] == "abort"
    assert 0 < answer.json()["usage"]["completion_tokens"] < 1500
    engine.wait_idle()
    engine.check_integrity()


@pytest.mark.parametrize("body", [{}, {"rid": "x", "abort_all": True}, {"rid": 5}, {"abort_all": "yes"},
                                  {"rid": "x", "bogus": 1}])
def test_abort_request_needs_one_target(server, body):
    resp = httpx.post(server.url + "/abort_request", json=body, timeout=10)
    assert resp.status_code == 400 and resp.json()["error"]["type"] == "invalid_request_error"


def test_model_and_server_info(server):
    engine = _engine(server)
    info = httpx.get(server.url + "/get_model_info", timeout=10).json()
    assert info["served_model_name"] == MODEL and info["model_path"] == str(engine.model_path)
    assert info["is_generation"] is True and info["tokenizer_path"] == str(engine.model_path)
    assert info["context_length"] == 2048 and info["vocab_size"] == engine.model_config.vocab_size
    srv = httpx.get(server.url + "/get_server_info", timeout=10).json()
    assert srv["engine_args"]["max_total_tokens"] == 8192 and srv["engine_args"]["context_length"] == 2048
    assert srv["max_running_requests"] == 4 and srv["max_total_num_tokens"] == engine.kv_pool.size
    assert set(srv["internal_states"][0]) >= {"num_running_requests", "cache_hit_rate", "token_usage"}
    assert srv["version"] and (srv["tool_call_parser"], srv["reasoning_parser"]) == ("qwen", None)  # (auto: Qwen's)


def test_health_generate(server, monkeypatch):
    engine = _engine(server)
    before = engine.get_stats()["num_requests_finished"]
    resp = httpx.get(server.url + "/health_generate", timeout=30)
    assert resp.status_code == 200 and resp.json() == {"status": "ok"}
    assert engine.get_stats()["num_requests_finished"] == before + 1  # it went through the engine

    async def stalled(*args, **kwargs):  # an engine that never answers
        import asyncio
        await asyncio.sleep(3600)

    monkeypatch.setattr(native_routes, "HEALTH_GENERATE_SECONDS", 0.3)
    monkeypatch.setattr(engine, "async_generate", stalled)
    resp = httpx.get(server.url + "/health_generate", timeout=30)
    assert resp.status_code == 503 and resp.json()["error"]["code"] == "engine_stalled"


def test_health_generate_behind_a_busy_engine_is_healthy(server, monkeypatch):
    """A health request that waits behind others past the deadline is not a stall when the engine
    moved meanwhile (its own one-token request is made to never finish here)."""
    engine = _engine(server)

    async def queued(*args, **kwargs):
        import asyncio
        await asyncio.sleep(3600)

    # (a deadline of a few steps even on a loaded machine: 0.5 s once saw no step finish in it, a 503)
    monkeypatch.setattr(native_routes, "HEALTH_GENERATE_SECONDS", 1.5)
    monkeypatch.setattr(engine, "async_generate", queued)
    busy = _in_thread(lambda: engine.generate(input_ids=[5, 6, 7], sampling_params={**LONG, "max_new_tokens": 400}))
    _wait_running(engine, 1)
    resp = httpx.get(server.url + "/health_generate", timeout=30)
    assert resp.status_code == 200 and resp.json() == {"status": "ok"}
    assert busy()["meta_info"]["finish_reason"]["type"] == "length"
