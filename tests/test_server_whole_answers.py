"""A whole (not streamed) answer is built off the event loop: its Python work (a long answer's logprobs, its
JSON) runs on a worker thread, and the server answers other requests meanwhile."""

from __future__ import annotations

import threading

import httpx
import pytest

from hyla.server import native_routes, openai_routes, responses_routes
from test_server_openai import MODEL, SYSTEM, engine, server  # noqa: F401  (fixtures)

USER = [SYSTEM, {"role": "user", "content": "Hello there"}]
BODIES = {
    "chat": ("/v1/chat/completions", {"model": MODEL, "messages": USER, "max_tokens": 4, "logprobs": True,
                                      "top_logprobs": 2}),
    "completions": ("/v1/completions", {"model": MODEL, "prompt": "Hello", "max_tokens": 4, "logprobs": 2,
                                        "echo": True}),
    "responses": ("/v1/responses", {"model": MODEL, "input": "Hello", "max_output_tokens": 4}),
    "responses stream": ("/v1/responses", {"model": MODEL, "input": "Hello", "max_output_tokens": 4,
                                           "stream": True}),
    "generate": ("/generate", {"text": "Hello", "sampling_params": {"max_new_tokens": 4}, "return_logprob": True}),
}
# where each endpoint builds its answer: held here until the server has answered a request made meanwhile
BUILT_IN = {"chat": (openai_routes, "usage"), "completions": (openai_routes, "usage"),
            "responses": (responses_routes._Turn, "finish"), "responses stream": (responses_routes._Turn, "finish"),
            "generate": (native_routes, "_output")}


@pytest.mark.parametrize("endpoint", BODIES)
def test_the_server_answers_others_while_a_whole_answer_is_built(server, endpoint, monkeypatch):
    owner, attr = BUILT_IN[endpoint]
    real = getattr(owner, attr)
    building, release = threading.Event(), threading.Event()

    def held(*args, **kwargs):
        building.set()
        release.wait(timeout=60)
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, attr, held)
    path, body = BODIES[endpoint]
    answer: dict = {}
    slow = threading.Thread(target=lambda: answer.update(r=httpx.post(server.url + path, json=body, timeout=120)))
    slow.start()
    try:
        assert building.wait(timeout=60), "the answer was never built"
        # the event loop is free: another request is answered while the first answer is still being built
        other = httpx.get(server.url + "/v1/models", timeout=10)
        assert other.status_code == 200 and not release.is_set()
    finally:
        release.set()
        slow.join(timeout=120)
    assert answer["r"].status_code == 200, answer["r"].text
