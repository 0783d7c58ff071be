"""Graceful shutdown (issue 13): from the first moment new requests get an OpenAI-style 503, running
ones get ``shutdown_timeout`` seconds to finish, then are aborted with an error event and ``[DONE]``
(a waiting non-streaming request gets a 503); ``hyla serve`` exits 0 on SIGTERM, without tracebacks."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest

from hyla.server.app import create_app
from hyla.server.launch import BackgroundServer
from test_server_cli import ServeProcess, _free_port
from test_server_errors import _assert_error
from test_server_openai import MODEL, make_chat_model

MESSAGES = [{"role": "user", "content": "Tell me a long story."}]


@pytest.fixture(scope="module")
def model_dir(tiny_ckpt_dir):
    return make_chat_model(tiny_ckpt_dir)


def _stream_in_background(url: str, max_tokens: int) -> tuple[threading.Thread, list[str]]:
    """A streaming chat on its own thread; its SSE data lines land in the returned list."""
    events: list[str] = []
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}

    def run() -> None:
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as r:
            events.extend(line[len("data: "):] for line in r.iter_lines() if line.startswith("data: "))

    thread = threading.Thread(target=run)
    thread.start()
    return thread, events


def _wait(condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_shutdown_aborts_what_outlives_the_timeout(model_dir):
    app = create_app(model_dir, served_model_name=MODEL, max_total_tokens=8192, max_state_slots=16,
                     max_running_requests=1, shutdown_timeout=0.5)
    srv = BackgroundServer(app).start()
    server = app.state.server
    stream, events = _stream_in_background(srv.url, 4000)
    _wait(lambda: len(events) >= 3)  # decoding
    waiting: dict = {}
    queued = threading.Thread(target=lambda: waiting.setdefault("resp", httpx.post(
        srv.url + "/v1/chat/completions", timeout=60,
        json={"model": MODEL, "messages": MESSAGES, "max_tokens": 50, "ignore_eos": True})))
    queued.start()
    _wait(lambda: server.engine.get_stats()["num_queued_requests"] == 1)  # behind the running one
    stopper = threading.Thread(target=srv.stop)
    stopper.start()
    _wait(lambda: server.draining)
    refused = httpx.post(srv.url + "/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES}, timeout=10)
    err = _assert_error(refused, 503, "service_unavailable")
    assert err["code"] == "server_shutting_down"
    assert httpx.get(srv.url + "/health", timeout=10).status_code == 503
    for thread in (stream, queued, stopper):
        thread.join(timeout=60)
        assert not thread.is_alive()
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert last["error"]["code"] == "server_shutting_down" and last["error"]["type"] == "service_unavailable"
    assert all("choices" in json.loads(e) for e in events[:-2])  # content chunks until then
    err = _assert_error(waiting["resp"], 503, "service_unavailable")
    assert err["code"] == "server_shutting_down"


def test_shutdown_lets_running_requests_finish(model_dir):
    app = create_app(model_dir, served_model_name=MODEL, max_total_tokens=8192, max_state_slots=16,
                     shutdown_timeout=60)
    srv = BackgroundServer(app).start()
    stream, events = _stream_in_background(srv.url, 300)
    _wait(lambda: len(events) >= 2)
    srv.stop()  # returns once the stream has finished
    stream.join(timeout=60)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert sum(bool(c["choices"][0]["delta"].get("content")) for c in chunks) > 1


@pytest.mark.slow
def test_sigterm_drains_and_exits_0(model_dir, tmp_path):
    server = ServeProcess(["--model", str(model_dir), "--served-model-name", MODEL, "--max-total-tokens", "8192",
                           "--max-state-slots", "16", "--shutdown-timeout", "1"], tmp_path / "serve.log")
    try:
        stream, events = _stream_in_background(server.url, 4000)
        _wait(lambda: len(events) >= 3)
        server.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        refused = httpx.post(server.url + "/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES},
                             timeout=10)
        _assert_error(refused, 503, "service_unavailable")
        stream.join(timeout=60)
        code = server.proc.wait(timeout=60)
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
    log = server.log()
    assert code == 0, log
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "server_shutting_down"
    assert "Traceback" not in log and "CancelledError" not in log, log
    assert "shutting down: aborting 1 requests still running" in log


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_while_starting_exits_at_once(model_dir, tmp_path, sig):
    """SIGTERM or Ctrl-C while the engine still starts (here compiling the decode graphs, a minute or more on a
    small CPU) exits at once with status 0: nothing listens or runs yet, so nothing drains (uvicorn looked at its
    exit flag only after the start-up: one Ctrl-C waited out the compile, three ended in a traceback)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    log_path = tmp_path / "serve.log"
    repo = Path(__file__).parents[1]
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "hyla.cli", "serve", "--model", str(model_dir), "--port", str(_free_port()),
                                 "--compile-decode", "--max-total-tokens", "4096", "--max-state-slots", "16"],
                                cwd=repo, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONPATH": str(repo), "PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.monotonic() + 120
        while "compiling the decode graphs" not in log_path.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.1)
        start = time.monotonic()
        proc.send_signal(sig)
        assert proc.wait(timeout=30) == 0, log_path.read_text()
        assert time.monotonic() - start < 10 and "while starting: exiting" in log_path.read_text()
        assert "Traceback" not in log_path.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
