"""`hyla bench` against an in-test stub server that speaks the OpenAI / native streaming formats.

The stub is a fake *for testing the client*: it streams ``max_tokens`` words with a fixed delay
before the first one and between the others, reports usage, and reports as cached the longest
word prefix the prompt shares with any earlier prompt (a toy prefix cache).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from hyla.bench.backends import RequestResult, build_payload, render_transcript, send_request
from hyla.bench.datasets import BenchSession, BenchTurn, random_sessions, sharegpt_sessions
from hyla.bench.metrics import latency_stats_ms, summarize
from hyla.bench.runner import arrival_times, run_benchmark
from hyla.cli import main as hyla_main

FIRST_DELAY = 0.05  # s before the first streamed token
TOKEN_DELAY = 0.01  # s between later tokens
SLOW_DELAY = 0.1  # s before each token of a FAULT=slow stream
# what hyla's server (and OpenAI's, vLLM's) sends when a request fails after its stream started
SERVER_ERROR = {"error": {"message": "engine crashed", "type": "internal_error", "param": None, "code": 500}}


def _make_app(log: list[dict]) -> FastAPI:
    app = FastAPI()
    seen: list[list[str]] = []
    state = {"in_flight": 0, "max_in_flight": 0, "paths": []}
    app.state.counters = state

    @app.middleware("http")
    async def record_path(request: Request, call_next):
        state["paths"].append(request.url.path)  # every request the stub got, whatever its route
        state.setdefault("auth", []).append(request.headers.get("authorization"))
        return await call_next(request)

    def cached_prefix(words: list[str]) -> int:
        best = 0
        for prev in seen:
            n = 0
            for a, b in zip(prev, words):
                if a != b:
                    break
                n += 1
            best = max(best, n)
        seen.append(words)
        return best

    async def stream(kind: str, prompt: str, max_tokens: int, priority: int | None = None):
        words = prompt.split()
        cached = cached_prefix(words)
        log.append({"kind": kind, "prompt": prompt, "max_tokens": max_tokens, "t": time.perf_counter(),
                    "priority": priority})
        # a word FAULT=<mode> in the prompt makes the stream misbehave (see FAULTS)
        fault = next((w.split("=", 1)[1] for w in words if w.startswith("FAULT=")), None)
        state["in_flight"] += 1
        state["max_in_flight"] = max(state["max_in_flight"], state["in_flight"])
        try:
            text = ""
            if fault == "early_error":
                yield f"data: {json.dumps(SERVER_ERROR)}\n\n"
                yield "data: [DONE]\n\n"
                return
            for i in range(max_tokens):
                if fault == "midstream_error" and i == 2:
                    yield f"data: {json.dumps(SERVER_ERROR)}\n\n"
                    yield "data: [DONE]\n\n"
                    return
                if fault == "not_an_object" and i == 1:
                    yield "data: 5\n\n"
                if fault == "bad_choices" and i == 1:
                    bad = {"text": 5} if kind == "native" else {"choices": [5]}
                    yield f"data: {json.dumps(bad)}\n\n"
                if fault == "no_done" and i == 2:
                    return
                await asyncio.sleep(SLOW_DELAY if fault == "slow" else FIRST_DELAY if i == 0 else TOKEN_DELAY)
                piece = f"w{i} "
                text += piece
                thinking = next((int(w.split("=", 1)[1]) for w in words if w.startswith("THINK=")), 0)
                if kind == "chat" and i < thinking:  # (a thinking model's first tokens: reasoning_content)
                    text = text[:-len(piece)]
                    event = {"choices": [{"index": 0, "delta": {"reasoning_content": piece}}]}
                elif kind == "chat":
                    event = {"choices": [{"index": 0, "delta": {"content": piece}}]}
                elif kind == "completions":
                    event = {"choices": [{"index": 0, "text": piece}]}
                else:
                    event = {"text": text, "meta_info": {"prompt_tokens": len(words), "completion_tokens": i + 1,
                                                         "cached_tokens": cached}}
                yield f"data: {json.dumps(event)}\n\n"
            if kind != "native":
                usage = {"prompt_tokens": len(words), "completion_tokens": max_tokens,
                         "prompt_tokens_details": {"cached_tokens": cached}}
                yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            state["in_flight"] -= 1

    @app.post("/flush_cache")
    async def flush_cache():
        if state["in_flight"]:
            return JSONResponse({"error": "busy"}, status_code=409)
        seen.clear()
        state["flushes"] = state.get("flushes", 0) + 1
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "stub-model", "object": "model"}]}

    def unknown_model(body: dict) -> JSONResponse | None:
        if body.get("model") == "missing-model":  # what a server answers a wrong --model
            return JSONResponse({"error": {"message": "model 'missing-model' not found"}}, status_code=404)
        return None

    @app.post("/v1/completions")
    async def completions(req: Request):
        body = await req.json()
        if (refusal := unknown_model(body)) is not None:
            return refusal
        return StreamingResponse(stream("completions", body["prompt"], body["max_tokens"], body.get("priority")),
                                 media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat(req: Request):
        body = await req.json()
        prompt = render_transcript(body["messages"])
        return StreamingResponse(stream("chat", prompt, body["max_tokens"], body.get("priority")),
                                 media_type="text/event-stream")

    @app.post("/generate")
    async def generate(req: Request):
        body = await req.json()
        if body["sampling_params"]["max_new_tokens"] > 1000:
            return JSONResponse({"error": "too long"}, status_code=400)
        return StreamingResponse(stream("native", body["text"], body["sampling_params"]["max_new_tokens"],
                                        body.get("priority")), media_type="text/event-stream")

    return app


@pytest.fixture()
def server():
    """(base_url, request log, counters) of a stub server on a free 127.0.0.1 port."""
    log: list[dict] = []
    app = _make_app(log)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error", lifespan="off"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.time() + 10
    while not srv.started:
        if time.time() > deadline:
            raise RuntimeError("stub server did not start")
        time.sleep(0.01)
    yield f"http://127.0.0.1:{port}", log, app.state.counters
    srv.should_exit = True
    thread.join(timeout=5)


@pytest.mark.parametrize("backend", ["openai", "openai-chat", "hyla"])
def test_one_request_times_ttft_itl_and_reads_usage(server, backend):
    base_url, log, _ = server

    async def go() -> RequestResult:
        async with httpx.AsyncClient(base_url=base_url, timeout=10) as client:
            return await send_request(client, backend, "m", [{"role": "user", "content": "a b c d"}], 5)

    r = asyncio.run(go())
    assert r.success, r.error
    assert r.text == "w0 w1 w2 w3 w4 "
    assert r.completion_tokens == 5
    # prompt = "User: a b c d\nAssistant:" -> 6 words in the stub's count
    assert r.prompt_tokens == 6
    assert r.ttft >= FIRST_DELAY * 0.9
    # one gap per later chunk; a single gap has no lower bound (a busy client can read two chunks in
    # one go), but the last chunk cannot arrive before the stub sent it
    assert len(r.itl) == 4 and all(g >= 0 for g in r.itl)
    assert r.ttft + sum(r.itl) >= (FIRST_DELAY + 4 * TOKEN_DELAY) * 0.9
    assert r.latency >= r.ttft + sum(r.itl)  # the end of the stream comes after its last chunk
    assert r.tpot == pytest.approx((r.latency - r.ttft) / 4)
    assert log[-1]["max_tokens"] == 5


def test_a_thinking_models_reasoning_tokens_are_timed_but_not_its_text(server):
    """``delta.reasoning_content`` (``hyla serve --reasoning-parser``) is output: the first token is the first
    reasoning token's, each chunk a gap; the reply's text (a conversation's next turn) is the content only. An
    answer still thinking at ``max_tokens`` completed (it was 'the stream carried no output')."""
    base_url, _, _ = server

    async def go(content: str, max_tokens: int) -> RequestResult:
        async with httpx.AsyncClient(base_url=base_url, timeout=10) as client:
            return await send_request(client, "openai-chat", "m", [{"role": "user", "content": content}], max_tokens)

    r = asyncio.run(go("a b THINK=3", 5))
    assert r.success and r.text == "w3 w4 " and len(r.itl) == 4, r
    assert FIRST_DELAY * 0.9 <= r.ttft < FIRST_DELAY + 3 * TOKEN_DELAY
    still = asyncio.run(go("a b THINK=9", 4))
    assert still.success and still.text == "" and len(still.itl) == 3


def test_the_api_key_goes_with_every_request_and_not_into_the_output_file(server, tmp_path, capsys, monkeypatch):
    """``--api-key`` (else ``OPENAI_API_KEY``): 'Authorization: Bearer KEY' on every request, the model list
    and the flush included; the output file leaves it out."""
    base_url, _, counters = server
    out = tmp_path / "bench.json"
    argv = ["bench", "--base-url", base_url, "--dataset", "random", "--num-prompts", "2", "--random-input-len", "4",
            "--random-output-len", "2", "--disable-tqdm", "--flush-cache"]
    assert hyla_main([*argv, "--api-key", "sekret", "--output-file", str(out)]) == 0
    assert counters["auth"] and set(counters["auth"]) == {"Bearer sekret"}
    assert "sekret" not in out.read_text() and "api_key" not in json.loads(out.read_text())["config"]
    counters["auth"].clear()
    monkeypatch.setenv("OPENAI_API_KEY", "from-env")
    assert hyla_main(argv) == 0 and set(counters["auth"]) == {"Bearer from-env"}
    capsys.readouterr()


def test_http_error_is_a_failed_result_not_an_exception(server):
    base_url, _, _ = server

    async def go() -> RequestResult:
        async with httpx.AsyncClient(base_url=base_url, timeout=10) as client:
            return await send_request(client, "hyla", "m", [{"role": "user", "content": "x"}], 5000)

    r = asyncio.run(go())
    assert not r.success and r.error.startswith("HTTP 400")


def test_multi_turn_sessions_carry_replies_and_hit_the_server_cache(server):
    base_url, log, _ = server
    sessions = [BenchSession(0, (BenchTurn("hello there", 3), BenchTurn("and again", 2)))]
    results, duration = asyncio.run(run_benchmark(base_url, sessions, backend="openai-chat", show_progress=False))
    assert [r.success for r in results] == [True, True]
    second = log[1]["prompt"]
    # the second turn's history holds the server's actual reply to the first
    assert second == "User: hello there\nAssistant: w0 w1 w2 \nUser: and again\nAssistant:"
    # the first prompt is 4 words ("User: hello there Assistant:"); the second (11 words) starts with them
    assert results[0].cached_tokens == 0
    assert results[1].cached_tokens == 4
    summary = summarize(results, duration)
    assert results[1].prompt_tokens == 11
    assert summary["cache_hit_rate"] == pytest.approx(4 / (4 + 11))
    assert summary["completed"] == 2 and summary["total_output_tokens"] == 5


def test_max_concurrency_caps_requests_in_flight(server):
    base_url, log, counters = server
    sessions = random_sessions(8, input_len=6, output_len=3, seed=1)
    results, _ = asyncio.run(run_benchmark(base_url, sessions, backend="openai", max_concurrency=2,
                                           show_progress=False))
    assert len(results) == 8 and all(r.success for r in results)
    assert counters["max_in_flight"] == 2


def test_request_rate_spaces_arrivals():
    times = arrival_times(2000, 4.0, seed=3)
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert times[0] == 0.0
    assert sum(gaps) / len(gaps) == pytest.approx(0.25, rel=0.1)  # mean gap of a rate-4 Poisson process
    assert arrival_times(3, math.inf) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError):
        arrival_times(3, 0.0)


def test_random_prompts_share_the_asked_prefix():
    sessions = random_sessions(6, input_len=100, output_len=10, shared_prefix_ratio=0.4, num_prefixes=2, seed=0)
    prompts = [s.prefix + s.turns[0].user for s in sessions]
    assert all(len(p.split()) == 100 for p in prompts)
    head = [" ".join(p.split()[:40]) for p in prompts]
    assert head[0] == head[2] == head[4] and head[1] == head[3] == head[5] and head[0] != head[1]
    assert len({" ".join(p.split()[40:]) for p in prompts}) == 6
    with pytest.raises(ValueError):
        random_sessions(1, 10, 10, shared_prefix_ratio=1.5)


def test_sharegpt_sessions_pick_multi_turn_conversations():
    convs = [
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "one two three"}]},
        {"conversations": [{"from": "human", "value": "a"}, {"from": "gpt", "value": "b c"},
                           {"from": "human", "value": "d"}, {"from": "gpt", "value": "e"}]},
    ]
    sessions = sharegpt_sessions(1, min_turns=2, conversations=convs)
    assert len(sessions) == 1 and [t.user for t in sessions[0].turns] == ["a", "d"]
    assert [t.max_tokens for t in sessions[0].turns] == [2, 1]
    with pytest.raises(ValueError):
        sharegpt_sessions(3, conversations=convs)


def test_sharegpt_turns_are_user_messages_paired_with_their_replies():
    """A third of ShareGPT's conversations start with a reply (the rest of a conversation the
    dataset split) and some with a system prompt: a turn is a user's message and the reply after
    it, never a reply sent as the user's words. Malformed entries are skipped, not a traceback."""
    convs = [
        {"conversations": [{"from": "gpt", "value": "a long reply continuing a split conversation"},
                           {"from": "human", "value": "continue"}, {"from": "gpt", "value": "x y z"}]},
        "not a conversation",
        {"conversations": None},
        {"conversations": [5, {"from": "human", "value": "u"}]},
        {"conversations": [{"from": "system", "value": "be brief"}, {"from": "human", "value": "q1"},
                           {"from": "gpt", "value": "r1"}, {"from": "human", "value": "q2"},
                           {"from": "human", "value": "q2 again"}, {"from": "gpt", "value": "r2"}]},
    ]
    sessions = sharegpt_sessions(2, conversations=convs)
    assert [[(t.user, t.max_tokens) for t in s.turns] for s in sessions] == [[("continue", 3)], [("q1", 1)]]
    assert [s.session_id for s in sessions] == [0, 1]
    with pytest.raises(ValueError, match="only 2 ShareGPT conversations"):
        sharegpt_sessions(3, conversations=convs)
    with pytest.raises(ValueError, match="only 0 ShareGPT conversations have >= 2 rounds"):
        sharegpt_sessions(1, min_turns=2, conversations=convs)


def test_e2e_latency_and_total_throughput_are_reported_over_completed_requests():
    """E2E latency (send to end of stream) gets mean/P50/P90/P99 like TTFT; a failed request (here
    a 9 s timeout) counts as failed but adds nothing to the latency statistics or the tokens."""
    from hyla.bench.metrics import format_report

    results = [RequestResult(0, 0, success=True, ttft=0.1, latency=0.5, prompt_tokens=10, completion_tokens=5),
               RequestResult(1, 0, success=True, ttft=0.2, latency=1.5, prompt_tokens=10, completion_tokens=1),
               RequestResult(2, 0, success=False, ttft=0.3, latency=9.0, prompt_tokens=10, completion_tokens=3,
                             error="timed out")]
    s = summarize(results, 2.0)
    assert s["completed"] == 2 and s["failed"] == 1 and s["errors"] == ["timed out"]
    assert s["e2e_latency_ms"]["mean"] == pytest.approx(1000.0) and s["e2e_latency_ms"]["p50"] == pytest.approx(1000.0)
    assert s["ttft_ms"]["mean"] == pytest.approx(150.0)
    assert s["tpot_ms"]["mean"] == pytest.approx(100.0)  # the 1-token request has no TPOT
    assert s["total_token_throughput"] == pytest.approx((20 + 6) / 2.0)
    report = format_report(s)
    assert "P99 E2E (ms):" in report and "Total token throughput (tok/s):" in report
    empty = summarize([results[2]], 2.0)  # no completed request: zeros, no division by zero
    assert empty["completed"] == 0 and empty["tpot_ms"]["mean"] == 0.0 and empty["request_throughput"] == 0.0
    assert "P99 E2E (ms):" in format_report(empty)


def test_served_model_reads_the_first_listed_model_or_fails_clearly(monkeypatch):
    """An answer to /v1/models that is not a model list is a ValueError (exit 2), not a traceback."""
    from hyla.bench import cli as bench_cli

    for body in ([1, 2], {"data": [5]}, {"data": []}, {"data": {"id": "x"}}, "text"):
        monkeypatch.setattr(httpx, "get", lambda *a, _body=body, **k: httpx.Response(
            200, json=_body, request=httpx.Request("GET", "http://x/v1/models")))
        with pytest.raises(ValueError, match="pass --model"):
            bench_cli.served_model("http://x", 1.0)
    monkeypatch.setattr(httpx, "get", lambda *a, **k: httpx.Response(
        200, json={"data": [{"id": "m1"}, {"id": "m2"}]}, request=httpx.Request("GET", "http://x/v1/models")))
    assert bench_cli.served_model("http://x", 1.0) == "m1"


def test_warmup_requests_go_first_and_are_left_out_of_the_results(server):
    """``warmup_requests``: short requests of random words, sent before the workload (and before
    its clock starts), unrelated to its prompts, and absent from the results."""
    base_url, log, _ = server
    sessions = random_sessions(3, input_len=6, output_len=2, seed=1)
    results, _ = asyncio.run(run_benchmark(base_url, sessions, backend="openai", show_progress=False,
                                           warmup_requests=2))
    assert [(r.session_id, r.success) for r in results] == [(0, True), (1, True), (2, True)]
    assert len(log) == 5
    warm, work = log[:2], log[2:]
    assert [e["max_tokens"] for e in warm] == [8, 8] and [e["max_tokens"] for e in work] == [2, 2, 2]
    assert max(e["t"] for e in warm) < min(e["t"] for e in work)
    assert all(len(e["prompt"].split()) == 16 + 2 for e in warm)  # 16 words + "User:" "Assistant:"
    assert {e["prompt"] for e in warm}.isdisjoint({e["prompt"] for e in work})
    with pytest.raises(ValueError, match="warmup_requests"):
        asyncio.run(run_benchmark(base_url, sessions, warmup_requests=-1, show_progress=False))


def test_a_failed_warmup_stops_the_bench_before_the_workload(server, capsys):
    """A wrong ``--model`` fails the warm-up once (exit 2, the server's message), instead of every
    request of the run; without warm-ups every request is sent and fails."""
    base_url, log, counters = server
    argv = ["bench", "--base-url", base_url, "--dataset", "random", "--num-prompts", "3", "--random-input-len", "4",
            "--random-output-len", "2", "--disable-tqdm", "--model", "missing-model"]
    assert hyla_main(argv + ["--warmup-requests", "2"]) == 2
    err = capsys.readouterr().err
    assert "2 of 2 warm-up requests failed" in err and "HTTP 404" in err and "not found" in err
    assert counters["paths"] == ["/v1/completions"] * 2  # the warm-ups only
    assert hyla_main(argv) == 1 and counters["paths"] == ["/v1/completions"] * 5
    assert "Failed requests:                                   3" in capsys.readouterr().out
    assert hyla_main(argv[:-1] + ["stub-model", "--warmup-requests", "-1"]) == 2
    assert "--warmup-requests must be >= 0" in capsys.readouterr().err


def test_latency_stats_and_payloads():
    stats = latency_stats_ms([0.001 * i for i in range(1, 101)])
    assert stats["p50"] == pytest.approx(50.5) and stats["p99"] == pytest.approx(99.01)
    assert stats["mean"] == pytest.approx(50.5)
    path, body = build_payload("hyla", "m", [{"role": "user", "content": "x"}], 7)
    assert path == "/generate" and body["sampling_params"]["max_new_tokens"] == 7 and body["stream"]
    with pytest.raises(ValueError):
        build_payload("grpc", "m", [], 1)


def test_cli_writes_output_file(server, tmp_path, capsys):
    base_url, log, _ = server
    out = tmp_path / "bench.json"
    rc = hyla_main(["bench", "--base-url", base_url, "--dataset", "random", "--num-prompts", "4",
                    "--random-input-len", "12", "--random-output-len", "3", "--shared-prefix-ratio", "0.5",
                    "--request-rate", "50", "--output-file", str(out), "--disable-tqdm"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "Request throughput (req/s):" in printed and "P99 TTFT (ms):" in printed
    record = json.loads(out.read_text())
    s = record["summary"]
    assert s["completed"] == 4 and s["total_output_tokens"] == 12
    assert s["ttft_ms"]["p50"] >= FIRST_DELAY * 1000 * 0.9
    # 4 prompts with the same 6-word prefix (plus "User:"): later ones hit it on the stub
    assert s["cached_tokens"] >= 3 * 7
    assert len(record["requests"]) == 4 and record["config"]["request_rate"] == 50.0
    assert record["config"]["model"] == "stub-model"  # no --model: the server's first listed model


@pytest.mark.parametrize("backend", ["openai", "openai-chat", "hyla"])
def test_a_share_of_sessions_sends_a_priority_and_the_report_splits_by_it(server, tmp_path, capsys, backend):
    """``--priority-share 0.5 --priority 7``: half the sessions (every turn of each) send
    ``priority: 7`` in each API's body, the others no priority field; the report and the JSON give
    TTFT and latency per class, and each request record its priority."""
    base_url, log, _ = server
    out = tmp_path / "bench.json"
    rc = hyla_main(["bench", "--base-url", base_url, "--backend", backend, "--dataset", "random", "--num-prompts",
                    "6", "--random-input-len", "8", "--random-output-len", "2", "--priority-share", "0.5",
                    "--priority", "7", "--output-file", str(out), "--disable-tqdm"])
    assert rc == 0
    assert sorted(e["priority"] for e in log if e["priority"] is not None) == [7, 7, 7]
    assert sum(e["priority"] is None for e in log) == 3
    record = json.loads(out.read_text())
    by = record["summary"]["by_priority"]
    assert set(by) == {"none", "7"} and by["7"]["completed"] == by["none"]["completed"] == 3
    assert by["7"]["latency_ms"]["p50"] >= by["7"]["ttft_ms"]["p50"] > 0
    assert sorted(str(r["priority"]) for r in record["requests"]) == ["7"] * 3 + ["None"] * 3
    assert "priority 7 (3/3):" in capsys.readouterr().out


def test_priorities_are_assigned_to_a_seeded_share_of_sessions():
    from hyla.bench.runner import assign_priorities

    picked = assign_priorities(10, 0.3, 5, seed=1)
    assert picked.count(5) == 3 and picked.count(None) == 7
    assert picked == assign_priorities(10, 0.3, 5, seed=1) != assign_priorities(10, 0.3, 5, seed=2)
    assert assign_priorities(4, 0.0, 5) == [None] * 4 and assign_priorities(4, 1.0, 5) == [5] * 4
    with pytest.raises(ValueError, match="share"):
        assign_priorities(4, 1.5, 5)
    _, body = build_payload("openai-chat", "m", [{"role": "user", "content": "x"}], 3, priority=-2)
    assert body["priority"] == -2
    assert "priority" not in build_payload("hyla", "m", [{"role": "user", "content": "x"}], 3)[1]
    assert summarize([RequestResult(0, 0, success=True, ttft=0.1, latency=0.2)], 1.0)["by_priority"] == {}


def test_flush_cache_empties_the_server_cache_before_the_run(server, capsys):
    """``--flush-cache``: the same workload twice hits the first run's prefixes unless the server's
    cache is flushed first; a server that refuses is an error (exit 2), not a run."""
    base_url, _, counters = server
    argv = ["bench", "--base-url", base_url, "--dataset", "random", "--num-prompts", "3", "--random-input-len", "8",
            "--random-output-len", "2", "--max-concurrency", "1", "--disable-tqdm"]

    def cached() -> float:
        return float(capsys.readouterr().out.split("Server cache hit rate:")[1].split("%")[0])

    assert hyla_main(argv) == 0
    first = cached()
    assert hyla_main(argv) == 0 and cached() > first  # the second run hits the first one's prompts
    assert hyla_main(argv + ["--flush-cache"]) == 0 and cached() == first and counters["flushes"] == 1
    assert hyla_main(argv[:2] + ["http://127.0.0.1:9/"] + argv[3:] + ["--model", "m", "--flush-cache"]) == 2
    assert "could not flush the cache" in capsys.readouterr().err


def test_help_names_every_option_with_a_help_line_and_its_default(capsys, monkeypatch):
    """``hyla bench --help`` (issue 13): every option is listed with a line of help that states its default."""
    import argparse

    from hyla.bench import cli as bench_cli

    monkeypatch.setenv("COLUMNS", "1000")  # no line wrapping (argparse would break "openai-chat" at the hyphen)
    with pytest.raises(SystemExit) as exit_info:
        hyla_main(["bench", "--help"])
    assert exit_info.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    parser = argparse.ArgumentParser(prog="hyla bench")
    bench_cli.add_arguments(parser)
    options = [a for a in parser._actions if a.option_strings and a.dest != "help"]
    assert len(options) == 24
    for action in options:
        flag = max(action.option_strings, key=len)
        assert flag in out
        assert action.help and "(default: " in action.help, flag
        expanded = " ".join((action.help % {**vars(action), "prog": parser.prog}).split())
        assert expanded in out, flag
        if action.default not in (None, False):
            assert f"(default: {action.default}" in expanded, flag  # the value itself, not a description


def _send(base_url: str, backend: str, content: str, max_tokens: int = 5, timeout_s: float | None = None):
    async def go() -> RequestResult:
        async with httpx.AsyncClient(base_url=base_url, timeout=10) as client:
            return await send_request(client, backend, "m", [{"role": "user", "content": content}], max_tokens,
                                      timeout_s=timeout_s)

    return asyncio.run(go())


@pytest.mark.parametrize("backend", ["openai", "openai-chat", "hyla"])
@pytest.mark.parametrize("fault, message", [
    ("midstream_error", "server error: engine crashed (internal_error, code 500)"),  # after 2 tokens
    ("early_error", "server error: engine crashed (internal_error, code 500)"),  # before any text
    ("no_done", "ended without [DONE]"),  # a broken stream
    ("not_an_object", "malformed event (not a JSON object): 5"),
    ("bad_choices", "malformed event"),
])
def test_a_stream_that_fails_after_its_headers_is_a_failed_request(server, backend, fault, message):
    """An error event (``data: {"error": ...}``, then ``[DONE]``: hyla's, OpenAI's and vLLM's way to
    fail a started stream), a stream that ends without ``[DONE]`` and a malformed event make the
    request fail with that message, whichever backend; none raises."""
    base_url, _, _ = server
    r = _send(base_url, backend, f"a b FAULT={fault}")
    assert not r.success
    assert message in r.error, r.error


def test_a_malformed_or_failed_request_does_not_stop_the_run(server, tmp_path, capsys):
    """One request's bad event fails that request (and ends its session); the others complete."""
    base_url, _, _ = server
    sessions = [BenchSession(0, (BenchTurn("FAULT=not_an_object", 3), BenchTurn("never sent", 2))),
                BenchSession(1, (BenchTurn("FAULT=midstream_error", 4),)),
                BenchSession(2, (BenchTurn("fine", 3), BenchTurn("again", 2)))]
    results, duration = asyncio.run(run_benchmark(base_url, sessions, backend="openai", show_progress=False))
    assert [(r.session_id, r.turn_id, r.success) for r in results] == [(0, 0, False), (1, 0, False), (2, 0, True),
                                                                         (2, 1, True)]
    summary = summarize(results, duration)
    assert summary["completed"] == 2 and summary["failed"] == 2
    assert any("malformed event" in e for e in summary["errors"])
    assert any("engine crashed" in e for e in summary["errors"])


def test_timeout_limits_the_whole_request_not_each_read(server):
    """``--timeout`` is a limit on a whole request: a stream whose every gap (0.1 s) is under it but
    whose whole (1 s) is not fails with 'timed out after ...' (httpx's read timeout, the same
    number, never fires: no gap reaches it); under the limit it completes."""
    base_url, _, _ = server
    sessions = [BenchSession(0, (BenchTurn("FAULT=slow", 10),))]
    (slow,), _ = asyncio.run(run_benchmark(base_url, sessions, backend="openai-chat", show_progress=False,
                                           timeout_s=0.45))
    assert not slow.success and slow.error.startswith("timed out after 0.45 s"), slow.error
    assert _send(base_url, "hyla", "FAULT=slow", max_tokens=2, timeout_s=5).success
    with pytest.raises(ValueError, match="timeout"):
        asyncio.run(run_benchmark(base_url, sessions, timeout_s=0, show_progress=False))


def test_a_transport_error_has_a_message():
    """httpx's timeouts carry an empty message: the error names what timed out."""
    from hyla.bench.backends import _describe

    assert _describe(httpx.ReadTimeout("")) == "ReadTimeout: timed out waiting for data"
    assert _describe(httpx.ConnectError("refused")) == "ConnectError: refused"
    assert _describe(httpx.RemoteProtocolError("")) == "RemoteProtocolError (no message)"


@pytest.mark.parametrize("argv, message", [
    (["--request-rate", "0"], "--request-rate must be positive"),
    (["--request-rate", "-2"], "--request-rate must be positive"),
    (["--request-rate", "nan"], "--request-rate must be positive"),
    (["--max-concurrency", "0"], "--max-concurrency must be >= 1"),
    (["--priority-share", "1.5"], "--priority-share must be in [0, 1]"),
    (["--base-url", "127.0.0.1:30000"], "--base-url must be an http:// or https:// URL"),
    (["--timeout", "0"], "--timeout must be positive"),
    (["--timeout", "-5"], "--timeout must be positive"),
    (["--timeout", "nan"], "--timeout must be positive"),
    (["--dataset", "sharegpt", "--sharegpt-output-len", "0"], "--sharegpt-output-len must be >= 1"),
    (["--dataset", "sharegpt", "--sharegpt-output-len", "-3"], "--sharegpt-output-len must be >= 1"),
    (["--output-file", "/nonexistent/dir/x.json"], "does not exist"),
])
def test_bad_values_exit_2_before_the_run(server, capsys, argv, message):
    """A bad option is refused before the server gets any request: not the model lookup, not
    ``--flush-cache`` (which would empty a shared server's cache for a run that never starts)."""
    base_url, log, counters = server
    rc = hyla_main(["bench", "--base-url", base_url, "--dataset", "random", "--num-prompts", "2",
                    "--random-input-len", "4", "--random-output-len", "2", "--disable-tqdm", "--flush-cache", *argv])
    assert rc == 2
    assert message in capsys.readouterr().err
    assert log == [] and counters["paths"] == []  # nothing was sent
    with pytest.raises(ValueError, match="output length"):
        sharegpt_sessions(1, output_len=0, conversations=[])


def test_output_file_is_checked_before_the_run(server, tmp_path, capsys, monkeypatch):
    """A directory, or a file in a missing directory, is refused before any request; a bare file
    name goes to the working directory."""
    base_url, log, _ = server
    argv = ["bench", "--base-url", base_url, "--dataset", "random", "--num-prompts", "2", "--random-input-len", "4",
            "--random-output-len", "2", "--disable-tqdm", "--output-file"]
    assert hyla_main(argv + [str(tmp_path)]) == 2 and "is a directory" in capsys.readouterr().err
    assert hyla_main(argv + [str(tmp_path / "missing" / "x.json")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert log == []
    monkeypatch.chdir(tmp_path)
    assert hyla_main(argv + ["bench-out.json"]) == 0
    assert json.loads((tmp_path / "bench-out.json").read_text())["summary"]["completed"] == 2


def test_ctrl_c_stops_the_run_with_status_130_and_no_traceback(server):
    """Ctrl-C (SIGINT) during a run: ``hyla bench: interrupted`` on stderr and exit status 130, the shell's for
    a command stopped by SIGINT; no traceback (it printed asyncio's KeyboardInterrupt) and no report."""
    base_url, log, _ = server
    repo = Path(__file__).resolve().parents[1]
    proc = subprocess.Popen([sys.executable, "-m", "hyla.cli", "bench", "--base-url", base_url, "--dataset", "random",
                             "--num-prompts", "1", "--random-input-len", "4", "--random-output-len", "3000",
                             "--disable-tqdm"], cwd=repo, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(repo)})
    try:
        deadline = time.monotonic() + 60
        while not log:  # (until its request streams: the stub logs it as its stream starts, ~30 s of tokens)
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, (out, err)
    assert "Traceback" not in err and err.strip() == "hyla bench: interrupted", err
    assert "Request throughput" not in out
