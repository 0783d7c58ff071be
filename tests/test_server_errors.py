"""Error handling and robustness of the HTTP server against a real Engine: status codes and
OpenAI-style error bodies, API keys, a full queue (429), and clients that disconnect (their requests
are aborted and every pool slot comes back)."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest

from hyla.server.app import create_app
from hyla.server.launch import BackgroundServer
from test_server_openai import MODEL, make_chat_model

MESSAGES = [{"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def model_dir(tiny_ckpt_dir):
    return make_chat_model(tiny_ckpt_dir)


@pytest.fixture(scope="module")
def server(model_dir):
    app = create_app(model_dir, served_model_name=MODEL, max_total_tokens=16384, max_state_slots=64,
                     context_length=2048)
    with BackgroundServer(app) as srv:
        yield srv


def _engine(server):
    return server.app.state.server.engine


def wait_until_idle(engine, timeout: float = 10.0) -> float:
    """Seconds until the engine has no running or queued request (fails after ``timeout``)."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        stats = engine.get_stats()
        if stats["num_running_requests"] == 0 and stats["num_queued_requests"] == 0:
            engine.wait_idle(timeout)
            return time.monotonic() - start
        time.sleep(0.02)
    raise AssertionError(f"engine still busy after {timeout} s: {engine.get_stats()}")


def assert_pools_clean(engine) -> None:
    """Idle engine: invariants hold, and every KV slot, state slot and request row is free or held
    by the prefix tree (nothing leaked by an aborted request)."""
    engine.check_integrity()
    tree = engine.tree
    assert tree.protected_size() == 0
    assert engine.kv_pool.available_size() + tree.total_size() == engine.kv_pool.size
    assert engine.state_pool.available_size() + tree.num_checkpoints() == engine.state_pool.size
    assert engine.req_to_token.available_size() == engine.max_running_requests + 1


def _post(server, path: str, **kwargs) -> httpx.Response:
    return httpx.post(server.url + path, timeout=60, **kwargs)


def _assert_error(resp: httpx.Response, status: int, type_: str, param: str | None = None) -> dict:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["type"] == type_
    if param is not None:
        assert err["param"] == param
    return err


# --------------------------------------------------------------------------------------------
# 400
# --------------------------------------------------------------------------------------------
CHAT = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4}
BAD_CHAT_BODIES = [
    pytest.param({k: v for k, v in CHAT.items() if k != "messages"}, "messages", id="missing-messages"),
    pytest.param({k: v for k, v in CHAT.items() if k != "model"}, "model", id="missing-model"),
    pytest.param({**CHAT, "messages": []}, "messages", id="empty-messages"),
    pytest.param({**CHAT, "max_tokens": "16"}, "max_tokens", id="string-max-tokens"),
    pytest.param({**CHAT, "max_tokens": -1}, "max_tokens", id="negative-max-tokens"),
    pytest.param({**CHAT, "temperature": 2.5}, "temperature", id="temperature-above-2"),
    pytest.param({**CHAT, "top_p": 1.5}, "top_p", id="top-p-above-1"),
    pytest.param({**CHAT, "n": 0}, "n", id="n-zero"),
    pytest.param({**CHAT, "n": True}, "n", id="bool-n"),
    pytest.param({**CHAT, "stream": "yes"}, "stream", id="string-stream"),
    pytest.param({**CHAT, "top_logprobs": 3}, "top_logprobs", id="top-logprobs-without-logprobs"),
    pytest.param({**CHAT, "top_logprobs": 3, "logprobs": None}, "top_logprobs", id="top-logprobs-null-logprobs"),
    pytest.param({**CHAT, "top_logprobs": 50, "logprobs": True}, "top_logprobs", id="top-logprobs-too-many"),
    pytest.param({**CHAT, "tools": [{"type": "function"}]}, "tools.0.function", id="tool-without-function"),
    pytest.param({**CHAT, "messages": [{"role": "robot", "content": "x"}]}, None, id="unknown-role"),
    pytest.param({**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
                 None, id="image-content"),
    pytest.param({**CHAT, "stream_options": {"include_usage": True}}, "stream_options", id="stream-options-no-stream"),
    pytest.param({**CHAT, "stop": ["x"] * 17}, "stop", id="too-many-stop-strings"),
    pytest.param({**CHAT, "messages": [{"role": "user"}]}, "messages.0.content", id="no-content"),
    pytest.param({**CHAT, "max_tokens": 5000}, None, id="max-tokens-beyond-context"),
    pytest.param({**CHAT, "stop": [""]}, "stop", id="empty-stop-string"),
    pytest.param({**CHAT, "seed": -1}, "seed", id="negative-seed"),
    pytest.param({**CHAT, "top_k": -5}, "top_k", id="engine-rejects-top-k"),
    pytest.param({**CHAT, "chat_template_kwargs": {"messages": []}}, "chat_template_kwargs", id="reserved-template-var"),
    # encode_chat's own first parameter (was a TypeError, a 500)
    pytest.param({**CHAT, "chat_template_kwargs": {"self": 1}}, "chat_template_kwargs", id="template-var-self"),
    pytest.param({**CHAT, "messages": [{"role": "user", "content": {"nested": "object"}}]}, None, id="dict-content"),
]


@pytest.mark.parametrize("body, param", BAD_CHAT_BODIES)
def test_bad_chat_requests_are_400(server, body, param):
    _assert_error(_post(server, "/v1/chat/completions", json=body), 400, "invalid_request_error", param)


@pytest.mark.parametrize("content, headers", [
    (b"{not json", {"content-type": "application/json"}),
    (b"\xff\xfe\x00garbage", {"content-type": "application/json"}),
    (b"[1, 2, 3]", {"content-type": "application/json"}),
    (b'{"model": "m"}' * 2, {"content-type": "application/json"}),
    (b"[" * 10000 + b"]" * 10000, {"content-type": "application/json"}),
    (b"", {}),
])
def test_malformed_bodies_are_400(server, content, headers):
    for path in ("/v1/chat/completions", "/v1/completions", "/generate"):
        _assert_error(_post(server, path, content=content, headers=headers), 400, "invalid_request_error")


def test_prompt_too_long_is_400(server):
    engine = _engine(server)
    ids = [5] * engine.context_length
    err = _assert_error(_post(server, "/v1/completions", json={"model": MODEL, "prompt": ids, "max_tokens": 1}),
                        400, "invalid_request_error")
    assert "context length" in err["message"]
    long_text = "word " * (engine.context_length + 10)
    _assert_error(_post(server, "/v1/chat/completions",
                        json={"model": MODEL, "messages": [{"role": "user", "content": long_text}]}),
                  400, "invalid_request_error")


def test_bad_completion_and_generate_requests_are_400(server):
    vocab = _engine(server).model_config.vocab_size
    cases = [  # (path, body, the error's param: what the engine refused is named in the endpoint's words)
        ("/v1/completions", {"model": MODEL, "prompt": [1, vocab + 7]}, "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": []}, "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 0}, "max_tokens"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "n": None, "echo": "yes"}, "echo"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "logprobs": 21}, "logprobs"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "suffix": "y"}, "suffix"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "logit_bias": {str(vocab + 1): 5}}, "logit_bias"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "top_k": -5}, "top_k"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "repetition_penalty": 0.0}, "repetition_penalty"),
        ("/v1/chat/completions", {**CHAT, "min_p": 1.5}, "min_p"),
        ("/generate", {"text": "x", "input_ids": [1, 2]}, None),
        ("/generate", {}, None),
        ("/generate", {"text": "x", "sampling_params": {"max_new_tokens": 4, "temperature": -1}},
         "sampling_params.temperature"),
        ("/generate", {"text": "x", "sampling_params": {"no_such_param": 1}}, "sampling_params"),
        ("/generate", {"text": "x", "sampling_params": {"min_new_tokens": 9, "max_new_tokens": 4}},
         "sampling_params.min_new_tokens"),
        ("/generate", {"text": ["a", "b"], "stream": True}, "stream"),
        ("/generate", {"text": ["a", "b"], "rid": ["x"]}, "rid"),
        ("/generate", {"text": ["a", "b"], "sampling_params": [{}]}, "sampling_params"),
        ("/generate", {"input_ids": [1, 2, 3], "checkpoints": [7]}, "checkpoints"),
        ("/generate", {"input_ids": [1, 2, 3], "checkpoints": [2], "speculative_checkpoints": 1},
         "speculative_checkpoints"),
        ("/generate", {"input_ids": [1, vocab]}, "input_ids"),
        ("/generate", {"text": "hello " * 3000}, "text"),  # beyond the context once tokenized
        ("/generate", {"input_ids": [1, 2, 3], "logprob_start_len": 1}, "logprob_start_len"),
    ]
    for path, body, param in cases:
        err = _assert_error(_post(server, path, json=body), 400, "invalid_request_error")
        if param is not None:
            assert err["param"] == param, (path, body, err)


def test_a_batch_needs_a_list_of_rids(server):
    """``/generate`` with a batch of prompts takes a list of rids, one per prompt, all different (SGLang's
    rule): one string for two prompts, or an id twice, is a 400 saying so, not the engine's "already in
    use" (what the second request with the same id met)."""
    for rid, words in (("x", "a list of rids, one per prompt"), (["x", "x"], "twice")):
        err = _assert_error(_post(server, "/generate", json={"text": ["a", "b"], "rid": rid}), 400,
                            "invalid_request_error", "rid")
        assert words in err["message"] and "in use" not in err["message"], err
    ok = _post(server, "/generate", json={"text": ["a", "b"], "rid": ["rid-a", "rid-b"],
                                          "sampling_params": {"max_new_tokens": 1}})
    assert ok.status_code == 200 and len(ok.json()) == 2
    one = _post(server, "/generate", json={"text": ["a"], "rid": "rid-c", "sampling_params": {"max_new_tokens": 1}})
    assert one.status_code == 200 and len(one.json()) == 1  # a batch of one: its one id


ONE_TOKEN = {"max_new_tokens": 1}


@pytest.mark.parametrize("body, param", [
    pytest.param({"text": ["a", "b"], "sampling_params": [ONE_TOKEN, {**ONE_TOKEN, "temperature": -1}]},
                 "sampling_params.1.temperature", id="temperature"),
    pytest.param({"text": ["a", "b"], "sampling_params": [ONE_TOKEN, {**ONE_TOKEN, "no_such_param": 1}]},
                 "sampling_params.1", id="unknown-param"),
    pytest.param({"input_ids": [[1, 2], [3, 4], [5, 6]], "sampling_params": [ONE_TOKEN, ONE_TOKEN, {"regex": "("}]},
                 "sampling_params.2.regex", id="regex-does-not-compile"),
    pytest.param({"text": ["a", "b"], "sampling_params": [{"min_new_tokens": 9, "max_new_tokens": 4}, ONE_TOKEN]},
                 "sampling_params.0.min_new_tokens", id="first-item"),
    pytest.param({"text": ["a", "hello " * 3000], "sampling_params": ONE_TOKEN}, "text.1", id="text-too-long"),
    pytest.param({"text": ["a", "b"], "logprob_start_len": [-1, 1], "sampling_params": ONE_TOKEN},
                 "logprob_start_len.1", id="logprob-start-len"),
    # one value for the whole batch: no item to name
    pytest.param({"text": ["a", "b"], "sampling_params": {**ONE_TOKEN, "temperature": -1}},
                 "sampling_params.temperature", id="one-for-all"),
])
def test_a_batch_item_at_fault_is_named_with_its_index(server, body, param):
    """``/generate`` with a batch: a field given per prompt (a list) that the engine refuses for one
    item names that item, as ``messages.0.content`` does; the items before it, already submitted, are
    aborted and the server goes on serving."""
    _assert_error(_post(server, "/generate", json=body), 400, "invalid_request_error", param)
    engine = _engine(server)
    wait_until_idle(engine)
    assert_pools_clean(engine)
    ok = _post(server, "/generate", json={"text": ["a", "b"], "sampling_params": [ONE_TOKEN, ONE_TOKEN]})
    assert ok.status_code == 200 and len(ok.json()) == 2, ok.text


def test_chat_message_ends_are_speculative_checkpoints(server, monkeypatch):
    """The chat endpoint passes its message ends as guesses (``speculative_checkpoints``); the
    native ``/generate`` passes the caller's ``checkpoints`` as asked for, unless it says otherwise."""
    engine, seen = _engine(server), []
    real = engine.async_generate

    async def spy(*args, **kw):
        seen.append((kw.get("checkpoints"), kw.get("speculative_checkpoints")))
        return await real(*args, **kw)

    monkeypatch.setattr(engine, "async_generate", spy)
    assert _post(server, "/v1/chat/completions", json=CHAT).status_code == 200
    for flag in (None, True):
        body = {"input_ids": [1, 2, 3], "checkpoints": [2], "sampling_params": {"max_new_tokens": 2}}
        assert _post(server, "/generate", json=body if flag is None else {**body, "speculative_checkpoints": flag}
                     ).status_code == 200
    (chat_ends, chat_flag), native, native_guess = seen
    assert chat_ends and chat_flag is True
    assert native == ([2], False) and native_guess == ([2], True)


def test_openai_client_raises_bad_request(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0) as client:
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=7)
    assert info.value.status_code == 400 and info.value.param == "temperature"


# --------------------------------------------------------------------------------------------
# 404, 405
# --------------------------------------------------------------------------------------------
def test_unknown_model_is_404(server):
    for path, body in (("/v1/chat/completions", {**CHAT, "model": "gpt-5"}),
                       ("/v1/completions", {"model": "gpt-5", "prompt": "x"})):
        err = _assert_error(_post(server, path, json=body), 404, "invalid_request_error", "model")
        assert err["code"] == "model_not_found" and MODEL in err["message"]
    _assert_error(httpx.get(server.url + "/v1/models/gpt-5"), 404, "invalid_request_error", "model")
    with openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0) as client:
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(model="gpt-5", messages=MESSAGES)


def test_unknown_route_and_method(server):
    _assert_error(httpx.get(server.url + "/v1/nothing"), 404, "not_found_error")
    resp = httpx.get(server.url + "/v1/chat/completions")
    _assert_error(resp, 405, "invalid_request_error")
    assert resp.headers["allow"] == "POST"


def test_server_still_serves_after_errors(server):
    resp = _post(server, "/v1/chat/completions", json={**CHAT, "temperature": 0})
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 4
    wait_until_idle(_engine(server))
    assert_pools_clean(_engine(server))


# --------------------------------------------------------------------------------------------
# disconnects free their slots
# --------------------------------------------------------------------------------------------
def test_streaming_client_disconnect_aborts_its_request(server):
    engine = _engine(server)
    wait_until_idle(engine)
    generated_before = engine.get_stats()["num_generated_tokens"]
    with openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0) as client:
        stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1500, temperature=0,
                                                stream=True, extra_body={"ignore_eos": True})
        for i, _ in enumerate(stream):
            if i == 3:
                break
        assert engine.get_stats()["num_running_requests"] == 1
        stream.close()
    wait_until_idle(engine, timeout=10)
    assert engine.get_stats()["num_generated_tokens"] - generated_before < 1500  # stopped early
    assert_pools_clean(engine)


def test_non_streaming_client_disconnect_aborts_its_request(server):
    engine = _engine(server)
    wait_until_idle(engine)
    finished_before = engine.get_stats()["num_requests_finished"]
    generated_before = engine.get_stats()["num_generated_tokens"]
    body = {**CHAT, "max_tokens": 1500, "temperature": 0, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/chat/completions", json=body, timeout=httpx.Timeout(60, read=0.5))
    wait_until_idle(engine, timeout=10)
    stats = engine.get_stats()
    assert stats["num_requests_finished"] == finished_before + 1
    assert stats["num_generated_tokens"] - generated_before < 1500
    assert_pools_clean(engine)


def test_flush_cache_is_200_when_idle_and_409_while_a_request_runs(server):
    engine = _engine(server)
    body = {"input_ids": list(range(40, 100)), "sampling_params": {"temperature": 0, "max_new_tokens": 2}}
    _post(server, "/generate", json=body)
    assert _post(server, "/generate", json=body).json()["meta_info"]["cached_tokens"] > 0
    cache_id = httpx.get(server.url + "/health").json()["cache_id"]
    resp = _post(server, "/flush_cache")
    assert resp.status_code == 200 and resp.json()["status"] == "ok"
    assert engine.tree.total_size() == 0
    assert httpx.get(server.url + "/health").json()["cache_id"] != cache_id  # (a router's table of it is stale)
    assert _post(server, "/generate", json=body).json()["meta_info"]["cached_tokens"] == 0
    long = {**body, "stream": True, "sampling_params": {"max_new_tokens": 100, "ignore_eos": True}}
    with httpx.stream("POST", server.url + "/generate", json=long, timeout=60) as running:
        lines = running.iter_lines()  # (kept: a dropped iterator closes the stream, which aborts the request)
        next(lines)
        err = _assert_error(_post(server, "/flush_cache"), 409, "invalid_request_error")
        assert err["code"] == "engine_busy"
        assert json.loads([line for line in lines if line][-2][len("data: "):])["meta_info"]["completion_tokens"] == 100
    wait_until_idle(engine)
    assert_pools_clean(engine)
    assert 'route="/flush_cache"' in httpx.get(server.url + "/metrics").text


# --------------------------------------------------------------------------------------------
# 401: API key
# --------------------------------------------------------------------------------------------
def test_api_key(model_dir):
    key = "sk-test-123"
    app = create_app(model_dir, served_model_name=MODEL, api_key=key, max_total_tokens=4096, max_state_slots=16)
    with BackgroundServer(app) as srv:
        body = {**CHAT, "temperature": 0}
        _assert_error(_post(srv, "/v1/chat/completions", json=body), 401, "authentication_error")
        for header in (f"Bearer {key}x", f"Basic {key}", key, "Bearer"):
            resp = _post(srv, "/v1/chat/completions", json=body, headers={"Authorization": header})
            _assert_error(resp, 401, "authentication_error")
        _assert_error(_post(srv, "/generate", json={"text": "x"}), 401, "authentication_error")
        _assert_error(_post(srv, "/flush_cache"), 401, "authentication_error")
        assert _post(srv, "/flush_cache", headers={"Authorization": f"Bearer {key}"}).json()["status"] == "ok"
        _assert_error(_post(srv, "/v1/completions", json={"model": MODEL, "prompt": "x"}), 401, "authentication_error")
        _assert_error(httpx.get(srv.url + "/v1/models"), 401, "authentication_error")
        assert httpx.get(srv.url + "/health").status_code == 200  # open for load balancers
        assert httpx.get(srv.url + "/metrics").status_code == 200
        ok = _post(srv, "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"})
        assert ok.status_code == 200
        with openai.OpenAI(base_url=srv.url + "/v1", api_key="wrong", max_retries=0) as client:
            with pytest.raises(openai.AuthenticationError):
                client.models.list()
        with openai.OpenAI(base_url=srv.url + "/v1", api_key=key, max_retries=0) as client:
            assert client.models.list().data[0].id == MODEL


# --------------------------------------------------------------------------------------------
# 429: queue full
# --------------------------------------------------------------------------------------------
def test_full_queue_is_429_with_retry_after(model_dir):
    app = create_app(model_dir, served_model_name=MODEL, max_total_tokens=8192, max_state_slots=16,
                     max_running_requests=1, max_queued_requests=1)
    long = {**CHAT, "max_tokens": 1500, "temperature": 0, "ignore_eos": True, "stream": True}

    async def scenario(url: str, engine) -> httpx.Response:
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            async with client.stream("POST", "/v1/chat/completions", json=long) as running:
                assert running.status_code == 200
                lines = running.aiter_lines()
                await anext(lines)
                deadline = time.monotonic() + 10
                # the first SSE line can precede admission: wait until the engine runs the request
                while engine.get_stats()["num_running_requests"] < 1:
                    assert time.monotonic() < deadline
                    await asyncio.sleep(0.01)
                queued = asyncio.create_task(client.post("/v1/chat/completions", json={**long, "stream": False}))
                deadline = time.monotonic() + 10
                while engine.get_stats()["num_queued_requests"] < 1:  # the second one waits
                    assert time.monotonic() < deadline and not queued.done()
                    await asyncio.sleep(0.01)
                refused = await client.post("/v1/chat/completions", json={**CHAT})
                queued.cancel()
            return refused

    with BackgroundServer(app) as srv:
        engine = srv.app.state.server.engine
        refused = asyncio.run(scenario(srv.url, engine))
        err = _assert_error(refused, 429, "rate_limit_error")
        assert err["code"] == "rate_limit_exceeded"
        assert int(refused.headers["retry-after"]) >= 1
        wait_until_idle(engine, timeout=10)  # both long requests were aborted by their disconnects
        assert_pools_clean(engine)
        resp = _post(srv, "/v1/chat/completions", json={**CHAT, "temperature": 0})
        assert resp.status_code == 200  # and the server takes requests again


@pytest.mark.parametrize("message, cause, status, code", [
    ("grammar: Parser Error: Current row has 2001 items; max is 2000", "grammar", 400, "grammar_error"),
    ("engine shut down", "shutdown", 503, "engine_shutdown"),
    ("internal error: RuntimeError: boom", "internal", 500, "request_aborted"),
    ("the consumer of this request failed", "consumer", 500, "request_aborted"),
    ("the queue is full and a more urgent request took this one's place", "overloaded", 429, "rate_limit_exceeded"),
    # the cause decides, not the words: a grammar's message that mentions a shutdown is still its fault
    ("grammar: the engine shut down its parser", "grammar", 400, "grammar_error"),
])
def test_an_engine_abort_is_answered_by_its_cause(message, cause, status, code):
    """A request the engine aborted: its grammar failing deep in the output (a parser limit no
    compile-time probe finds) is the request's fault, a 400; a shutdown a 503; a request a more
    urgent one displaced from the full queue a 429, as a full queue answers at submission; anything
    else a 500."""
    from hyla.engine.request import abort_reason
    from hyla.server.errors import abort_error

    err = abort_error(abort_reason(message, cause))
    assert (err.status, err.body()["error"]["code"]) == (status, code)
    assert err.body()["error"]["message"] == message


def test_an_abort_reason_names_a_known_cause():
    from hyla.engine.request import ABORT_CAUSES, abort_reason

    assert abort_reason("x", "client") == {"type": "abort", "message": "x", "cause": "client"}
    assert set(ABORT_CAUSES) == {"client", "shutdown", "grammar", "consumer", "internal", "overloaded"}
    with pytest.raises(ValueError, match="unknown abort cause"):
        abort_reason("x", "timeout")


def test_a_stream_line_that_cannot_be_sent_is_an_error_event():
    """A line of a stream that is not UTF-8 text (a lone surrogate some field let through) ends the stream with
    an internal error event and ``[DONE]`` (it dropped the connection: the line was encoded after the body's
    error handling), and nothing after it is sent."""
    from hyla.server.generation import Generation

    async def lines():
        yield 'data: {"ok": 1}\n\n'
        yield "data: \ud800\n\n"
        yield "data: never sent\n\n"

    async def sent() -> list[bytes]:
        return [chunk async for chunk in Generation(None, None, "chat", 0.0).stream(lines()).body_iterator]

    chunks = asyncio.run(sent())
    assert len(chunks) == 3 and chunks[0] == b'data: {"ok": 1}\n\n' and chunks[2] == b"data: [DONE]\n\n"
    assert json.loads(chunks[1].removeprefix(b"data: "))["error"]["code"] == "internal_error"


def test_a_generation_closed_early_aborts_its_requests_themselves():
    """A generation closed before its choices were read to the end (the client left) aborts each unfinished
    request through its stream, by the request itself, and not one that has ended meanwhile (its last chunk
    not read yet): an abort by rid could reach a new request that has taken the rid."""
    from hyla.engine.streams import AsyncRequestStream
    from hyla.server.generation import Generation, Job

    class Engine:
        def __init__(self):
            self.by_rid, self.by_request, self.sinks = [], [], []

        async def async_generate(self, *, stream, rid, **request):
            answer = AsyncRequestStream(rid, self.by_request.append, ("request", rid), asyncio.get_running_loop())
            self.sinks.append(answer.sink())
            return answer

        def abort(self, rid):
            self.by_rid.append(rid)

    class Metrics:
        def observe_request(self, *args):
            pass

    async def run() -> tuple[Engine, Generation]:
        engine = Engine()
        gen = Generation(engine, Metrics(), "generate", 0.0)
        await gen.submit([Job([5, 6], {}, rid="ended"), Job([5, 7], {}, rid="running")])
        engine.sinks[0]({"text": "", "meta_info": {"finish_reason": {"type": "length"}}}, True)  # (not read yet)
        gen.close()
        return engine, gen

    engine, gen = asyncio.run(run())
    assert engine.by_rid == [] and engine.by_request == [("request", "running")]
