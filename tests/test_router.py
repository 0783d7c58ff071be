"""``hyla route``: the cache-aware policy on its own, then the router in front of two real workers.

The workers are two ``hyla serve`` apps in this process (``BackgroundServer``) on the tiny chat model
of ``test_server_openai``; the router is its own uvicorn server on a thread. Every check compares
what the router answers with what a worker answers directly, or follows a conversation to the
worker holding its prefix (its later turns report cached tokens).
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import argparse
import asyncio
import signal

import httpx
import openai
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from hyla.router.app import create_router_app, routing_key
from hyla.router.policy import Namespaced, PrefixTable, Router, block_names
from hyla.server.app import create_app
from hyla.server.disaggregation import (ABORTED_HEADER, CACHED_TOKENS_HEADER, KV_FROM_HEADER, LOCAL_PREFILL_HEADER,
                                        PREFILL_ELSEWHERE, PREFIX_TOKENS_HEADER)
from hyla.server.launch import BackgroundServer
from test_server_openai import MODEL, SYSTEM, make_chat_model


# ----------------------------------------------------------------------------------------------
# the policy
# ----------------------------------------------------------------------------------------------
def test_block_names_name_prefixes():
    a = block_names("x" * 64 + "y" * 64 + "z" * 10)
    b = block_names("x" * 64 + "y" * 64 + "w" * 64)
    assert len(a) == 2 and len(b) == 3 and a == b[:2]  # a partial block has no name
    assert block_names("y" * 64 + "x" * 64)[1] != a[1]  # the same block after another prefix: another name
    assert block_names(list(range(40)), block_tokens=16) == block_names(list(range(32)), block_tokens=16)
    assert block_names("short") == [] and block_names([1, 2, 3]) == []


def test_block_names_look_at_a_bounded_prefix(monkeypatch):
    from hyla.router import policy

    monkeypatch.setattr(policy, "MAX_KEY_BLOCKS", 3)
    assert block_names("x" * 64 * 10) == block_names("x" * 64 * 3) and len(block_names([1] * 1000)) == 3


def test_prefix_table_matches_the_longest_prefix_and_forgets_the_oldest():
    t = PrefixTable(max_blocks=5)
    names = block_names("a" * 64 * 4)
    t.insert(names[:3])
    assert t.match(names) == 3 and t.match(block_names("b" * 64 * 4)) == 0 and t.match([]) == 0
    t.insert(block_names("c" * 64 * 3))  # 6 blocks: the oldest, the deepest of the first prompt, dropped
    assert len(t) == 5 and t.match(names) == 2
    t.insert(block_names("d" * 64 * 4))  # the first prompt's two others go, its first block last
    assert t.match(names) == 0
    with pytest.raises(ValueError, match="max_blocks"):
        PrefixTable(0)


def _route(r: Router, key, loads, healthy, **kw) -> tuple[int, str]:
    """``choose`` and ``record``, as the app does once the worker has taken the request."""
    w, why = r.choose(key, loads, healthy, **kw)
    r.record(w, key)
    return w, why


def test_cache_aware_follows_prefixes_and_spreads_the_rest():
    r = Router(3)
    loads = [0, 0, 0]
    convo = "system prompt " * 20
    first, why = _route(r, convo, loads, [True] * 3)
    assert why == "load"  # nothing cached anywhere yet
    for turn in range(3):  # each later turn extends the key: the same worker, for the cache
        convo += f" turn {turn} " * 30
        loads[first] += 1  # (even when busier than the others)
        assert _route(r, convo, loads, [True] * 3) == (first, "cache")
    others = {_route(r, f"{i} another conversation " * 20, loads, [True] * 3)[0] for i in range(2)}
    assert first not in others and len(others) == 2  # new prefixes go where the load and tables are least
    # a prefix covering less than the threshold of the key does not attract it
    assert r.choose(convo[:64] + "z" * 64 * 10, [0, 0, 0], [True] * 3)[1] == "load"


def test_choosing_records_nothing_and_equal_workers_take_turns():
    """A worker that was chosen but failed the request (``record`` not called) does not keep its prefix;
    equal workers share traffic in turn (not the first one always)."""
    r = Router(2)
    key = "q" * 640
    w, _ = r.choose(key, [0, 0], [True, True])
    assert r.choose(key, [0, 0], [True, True]) == (1 - w, "load")  # nothing recorded: the next in turn
    ll = Router(3, "least_load")
    assert [ll.choose(None, [0] * 3, [True] * 3)[0] for _ in range(3)] == [0, 1, 2]


def test_cache_aware_gives_way_to_an_unbalanced_load_and_skips_unhealthy_workers():
    r = Router(2, balance_abs=4, balance_rel=1.5)
    key = "k" * 640
    w, _ = _route(r, key, [0, 0], [True, True])
    other = 1 - w
    loads = [0, 0]
    loads[w] = 5  # 5 - 0 > 4 and 5 > 1.5 x 0
    assert r.choose(key, loads, [True, True]) == (other, "balance")
    assert r.choose(key, [0, 0], [w == 0, w == 1]) == (w, "cache")
    healthy = [True, True]
    healthy[w] = False
    assert r.choose(key, [0, 0], healthy)[0] == other  # its prefix is on a worker that is down
    assert r.choose(key, [0, 0], [True, True], exclude=frozenset({w}))[0] == other
    with pytest.raises(ValueError, match="no healthy worker"):
        r.choose(key, [0, 0], [False, False])


def test_other_policies_and_bad_settings():
    rr = Router(3, "round_robin")
    assert [rr.choose("x", [0] * 3, [True, False, True])[0] for _ in range(4)] == [0, 2, 0, 2]
    assert Router(2, "least_load").choose("x" * 640, [3, 1], [True, True]) == (1, "load")
    lone = Router(2, "least_load")
    lone.record(0, "x" * 640)
    assert not len(lone.tables[0])  # only cache_aware keeps tables
    assert {Router(4, "random", seed=s).choose(None, [0] * 4, [True] * 4)[0] for s in range(20)} == {0, 1, 2, 3}
    for kw, match in ((dict(num_workers=0), "a worker at least"), (dict(policy="fastest"), "policy must be"),
                      (dict(cache_threshold=1.5), "cache_threshold"), (dict(balance_rel=0.5), "balance_rel"),
                      (dict(block_chars=0), "block sizes")):
        with pytest.raises(ValueError, match=match):
            Router(**{"num_workers": 2, **kw})


def test_routing_keys_of_each_endpoint():
    m1 = [SYSTEM, {"role": "user", "content": "hi"}]
    m2 = m1 + [{"role": "assistant", "content": "hello"}, {"role": "user", "content": "more"}]
    k1, k2 = routing_key("/v1/chat/completions", {"messages": m1}), routing_key("/v1/chat/completions", {"messages": m2})
    assert k2.startswith(k1[:-1])  # a later turn's key extends the earlier one's (but for the closing bracket)
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert routing_key("/v1/chat/completions", {"messages": m1, "tools": tools}).startswith(json.dumps(tools, sort_keys=True))
    assert routing_key("/v1/completions", {"prompt": "abc"}) == "abc"
    assert routing_key("/v1/completions", {"prompt": ["abc", "d"]}) == "abc"
    assert routing_key("/v1/completions", {"prompt": [[1, 2], [3]]}) == [1, 2]
    assert routing_key("/generate", {"input_ids": [5, 6]}) == [5, 6]
    assert routing_key("/generate", {"text": "t"}) == "t"
    assert isinstance(routing_key("/v1/responses", {"input": "hi", "instructions": "be brief"}), str)
    # Anthropic's messages: the system prompt and the tools, then the turns; a later turn extends the key
    a1 = [{"role": "user", "content": "hi"}]
    a2 = a1 + [{"role": "assistant", "content": "hello"}, {"role": "user", "content": "more"}]
    k1, k2 = (routing_key("/v1/messages", {"system": "be brief", "messages": m}) for m in (a1, a2))
    assert k1.startswith(json.dumps("be brief")) and k2.startswith(k1[:-1])
    for path, body in (("/v1/chat/completions", {"messages": "x"}), ("/v1/completions", {"prompt": [True]}),
                       ("/v1/messages", {"messages": "x"}),
                       ("/v1/completions", None), ("/tokenize", {"prompt": "x"})):
        assert routing_key(path, body) is None


def test_each_model_routes_in_its_own_namespace():
    """A request naming a ``model`` (a LoRA adapter, which the workers cache apart) routes in that model's
    namespace: its prompt is a cache hit where that model's requests went, and none where another model's (or
    nameless requests') with the same text went; within a namespace blocks fall where they would without one."""
    messages = [SYSTEM, {"role": "user", "content": "hi " * 40}]
    plain = routing_key("/v1/chat/completions", {"messages": messages})
    keys = {m: routing_key("/v1/chat/completions", {"model": m, "messages": messages}) for m in ("base", "sql-lora")}
    assert keys["base"] == Namespaced("base", plain) and keys["sql-lora"].key == plain
    assert routing_key("/generate", {"text": "t", "lora_path": "sql-lora"}) == Namespaced("sql-lora", "t")
    assert routing_key("/generate", {"text": "t", "model": "sql-lora"}) == "t"  # (/generate names adapters so)
    # the served model (its name from the workers' /health) is no adapter: its requests route as nameless ones
    assert routing_key("/v1/chat/completions", {"model": "base", "messages": messages}, base_model="base") == plain
    assert routing_key("/generate", {"text": "t", "lora_path": "base"}, base_model="base") == "t"
    assert routing_key("/generate", {"text": ["t", "u"], "lora_path": ["sql-lora", None]}) == Namespaced("sql-lora", "t")
    names = {m: block_names(k) for m, k in keys.items()}
    assert len(names["base"]) == len(names["sql-lora"]) == len(block_names(plain)) > 2
    assert not {*names["base"], *block_names(plain)} & set(names["sql-lora"])
    router = Router(num_workers=2)
    router.record(0, keys["sql-lora"])
    router.record(1, plain)
    loads, healthy = [0, 0], [True, True]
    assert router.choose(keys["sql-lora"], loads, healthy) == (0, "cache")
    assert router.choose(plain, loads, healthy) == (1, "cache")
    assert router.choose(keys["base"], loads, healthy)[1] == "load"


def test_a_prompt_cache_key_keeps_each_conversation_together():
    """OpenAI's ``prompt_cache_key`` (a chat's, a Responses turn's) comes first in the routing key: two agents with
    the same long system prompt and tools but their own keys go to different workers (by load), and each agent's
    next turn returns to its own; without keys both would follow the shared prefix to one worker."""
    system = {"role": "system", "content": "You are a coding agent. Follow the rules. " * 30}
    tools = [{"type": "function", "function": {"name": "run_shell"}}]

    def key(agent: str | None, turns: int, path: str = "/v1/chat/completions") -> str:
        messages = [system] + [{"role": "user", "content": f"{agent} step {t}"} for t in range(turns)]
        body = {"messages": messages, "tools": tools} if path != "/v1/responses" else {
            "instructions": system["content"], "input": messages[1:]}
        return routing_key(path, {**body, "prompt_cache_key": agent} if agent else body)

    for path in ("/v1/chat/completions", "/v1/responses"):
        assert key("a", 2, path).startswith(key("a", 1, path)[:-1])  # (a later turn extends the key)
        assert key("a", 1, path).startswith('prompt_cache_key="a"') and not key("b", 1, path).startswith(
            key("a", 1, path)[:30])
        r, loads = Router(2), [0, 0]
        first = [_route(r, key(agent, 1, path), loads, [True, True])[0] for agent in ("a", "b")]
        assert sorted(first) == [0, 1]
        assert [_route(r, key(agent, 3, path), loads, [True, True]) for agent in ("a", "b")] == [
            (first[0], "cache"), (first[1], "cache")]
        keyless, loads = Router(2), [0, 0]
        w, _ = _route(keyless, key(None, 1, path), loads, [True, True])
        assert _route(keyless, key(None, 1, path).replace("None step", "other step"), loads, [True, True]) == (w, "cache")


def test_router_app_refuses_bad_worker_lists():
    for urls, match in (([], "a worker URL at least"), (["gpu0:30000"], "starts with http"),
                        (["http://a", "http://a/"], "given twice")):
        with pytest.raises(ValueError, match=match):
            create_router_app(urls)


# ----------------------------------------------------------------------------------------------
# the router in front of two workers
# ----------------------------------------------------------------------------------------------
class _Uvicorn:
    """An app (the router) on a thread of this process, on a free port."""

    def __init__(self, app) -> None:
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self._sock]}, daemon=True)

    def __enter__(self) -> "_Uvicorn":
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self._thread.is_alive(), "the router did not start"
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self._thread.join(timeout=30)
        self._sock.close()


def _closed_port_url() -> str:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there
    return f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def workers(tiny_ckpt_dir):
    path = make_chat_model(tiny_ckpt_dir)
    opts = dict(served_model_name=MODEL, max_total_tokens=16384, max_state_slots=64, chunked_prefill_size=512)
    with BackgroundServer(create_app(path, **opts)) as a, BackgroundServer(create_app(path, **opts)) as b:
        yield [a, b]


@pytest.fixture
def router(workers):
    for w in workers:  # every test starts from empty caches
        assert httpx.post(w.url + "/flush_cache", timeout=30).status_code == 200
    with _Uvicorn(create_router_app([w.url for w in workers], health_interval=0.2)) as r:
        yield r


def _client(url: str, api_key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=api_key, max_retries=0, timeout=60)


def _chat(client: openai.OpenAI, messages: list[dict], **kw):
    return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0, **kw)


def test_conversations_stay_with_their_cache_and_answer_as_a_worker_does(workers, router):
    """Four conversations of three turns through the router: every later turn finds its history cached
    (it went to the worker holding it), both workers serve some, and each answer is the one a worker
    gives directly."""
    via = _client(router.url)
    convos = [[SYSTEM, {"role": "user", "content": f"Conversation {i}: tell me about topic number {i} " * 6}]
              for i in range(4)]
    answers = []
    for turn in range(3):
        for i, messages in enumerate(convos):
            r = _chat(via, messages)
            if turn:
                assert r.usage.prompt_tokens_details.cached_tokens > 0.5 * r.usage.prompt_tokens, (i, turn)
            answers.append((list(messages), r.choices[0].message.content))
            messages += [{"role": "assistant", "content": r.choices[0].message.content},
                         {"role": "user", "content": f"And then, turn {turn + 1}?"}]
    info = httpx.get(router.url + "/workers").json()
    assert info["policy"] == "cache_aware" and all(w["healthy"] and w["in_flight"] == 0 for w in info["workers"])
    assert sum(w["routed"] for w in info["workers"]) == 12 and all(w["routed"] for w in info["workers"])
    direct = _client(workers[0].url)
    for messages, content in answers[:4] + answers[-2:]:
        assert _chat(direct, messages).choices[0].message.content == content


def test_streams_pass_through_whole(router):
    via = _client(router.url)
    messages = [SYSTEM, {"role": "user", "content": "Stream me something."}]
    whole = _chat(via, messages).choices[0].message.content
    pieces = [c.choices[0].delta.content or "" for c in _chat(via, messages, stream=True) if c.choices]
    assert "".join(pieces) == whole
    with httpx.stream("POST", router.url + "/v1/completions", json={"model": MODEL, "prompt": "abc", "max_tokens": 3,
                                                                     "stream": True}, timeout=60) as r:
        lines = [x for x in r.iter_lines() if x]
    assert r.headers["content-type"].startswith("text/event-stream") and lines[-1] == "data: [DONE]"


def test_a_client_that_leaves_a_stream_aborts_it_on_the_worker(workers, router):
    """Closing the router's stream closes the worker's, and the worker aborts the request (no tokens
    generated for nobody)."""
    engines = [w.app.state.server.engine for w in workers]
    before = sum(e.get_stats()["num_generated_tokens"] for e in engines)
    body = {"model": MODEL, "prompt": "abc", "max_tokens": 4000, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", router.url + "/v1/completions", json=body, timeout=60) as r:
        next(r.iter_lines())
    deadline = time.monotonic() + 20
    while any(e.get_stats()["num_running_requests"] for e in engines):
        assert time.monotonic() < deadline, "the worker still generates for a client that left"
        time.sleep(0.05)
    assert sum(e.get_stats()["num_generated_tokens"] for e in engines) - before < 2000  # aborted, not finished
    assert all(w["in_flight"] == 0 for w in httpx.get(router.url + "/workers").json()["workers"])


def test_stored_responses_are_found_where_they_were_made(workers):
    """``previous_response_id`` goes to the worker that stores the response (round robin would send each
    follow-up here to the other worker, which does not have it: a 404)."""
    with _Uvicorn(create_router_app([w.url for w in workers], policy="round_robin", health_interval=60)) as r:
        via = _client(r.url)
        r1 = via.responses.create(model=MODEL, input="Remember the number 7.", max_output_tokens=4, temperature=0)
        r2 = via.responses.create(model=MODEL, input="Which number?", previous_response_id=r1.id, max_output_tokens=4,
                                  temperature=0)
        assert r2.previous_response_id == r1.id and r2.usage.input_tokens_details.cached_tokens > 0
        events = list(via.responses.create(model=MODEL, input="A streamed one " * 10, max_output_tokens=3,
                                           temperature=0, stream=True))
        streamed = events[-1].response.id  # its id read from the stream's first event
        r3 = via.responses.create(model=MODEL, input="And?", previous_response_id=streamed, max_output_tokens=2,
                                  temperature=0)
        assert r3.previous_response_id == streamed and r3.usage.input_tokens_details.cached_tokens > 0
        assert via.responses.retrieve(r1.id).id == r1.id and via.responses.retrieve(streamed).id == streamed
        assert [w["routed"] for w in httpx.get(r.url + "/workers").json()["workers"]] == [3, 3]  # with the GETs
        assert r.server.config.app.state.router.base_model == MODEL  # (from the workers' /health)


def test_conversations_are_found_where_they_were_made(workers):
    """A conversation (the Conversations API) lives on the worker that made it: its turns, items and metadata
    go there, round robin or not, and a router that did not see it made asks the workers for it."""
    with _Uvicorn(create_router_app([w.url for w in workers], policy="round_robin", health_interval=60)) as r:
        via = _client(r.url)
        conversation = via.conversations.create(metadata={"n": "1"})
        for text in ("Remember the number 7.", "Which number?", "And again?"):
            turn = via.responses.create(model=MODEL, input=text, conversation=conversation.id, max_output_tokens=3,
                                        temperature=0)
            assert turn.conversation.id == conversation.id
        assert turn.usage.input_tokens_details.cached_tokens > 0
        assert len(via.conversations.items.list(conversation.id).data) == 6
        assert via.conversations.update(conversation.id, metadata={"n": "2"}).metadata == {"n": "2"}
        assert [w["routed"] for w in httpx.get(r.url + "/workers").json()["workers"]] in ([6, 0], [0, 6])
        # a new conversation starting with an item of a stored response goes where that response is (round
        # robin's next pick is the other worker)
        stored = via.responses.create(model=MODEL, input="Something to refer to.", max_output_tokens=2, temperature=0)
        referring = via.conversations.create(items=[{"type": "item_reference", "id": stored.output[0].id}])
        assert via.conversations.items.list(referring.id).data[0].id == stored.output[0].id
    with _Uvicorn(create_router_app([w.url for w in workers], policy="round_robin", health_interval=60)) as r:
        via = _client(r.url)
        for _ in range(2):  # (each worker tried first once)
            assert via.conversations.retrieve(conversation.id).metadata == {"n": "2"}
        later = via.responses.create(model=MODEL, input="Still there?", conversation={"id": conversation.id},
                                     max_output_tokens=2, temperature=0)
        assert later.usage.input_tokens_details.cached_tokens > 0
        assert via.conversations.delete(conversation.id).deleted


def test_a_stored_response_is_found_by_a_router_that_did_not_see_it_made(workers):
    """A router started after the response was made asks the workers for it: it is retrieved, and
    continued, where it is (each of the two workers is tried first once, round robin)."""
    made = _client(workers[1].url).responses.create(model=MODEL, input="made on the second worker " * 4,
                                                    max_output_tokens=2, temperature=0)
    with _Uvicorn(create_router_app([w.url for w in workers], policy="round_robin", health_interval=60)) as r:
        via = _client(r.url)
        for _ in range(2):
            follow = via.responses.create(model=MODEL, input="and?", previous_response_id=made.id, max_output_tokens=2,
                                          temperature=0)
            assert follow.previous_response_id == made.id and follow.usage.input_tokens_details.cached_tokens > 0
        assert via.responses.retrieve(made.id).id == made.id
        assert httpx.get(r.url + "/v1/responses/resp_0123").status_code == 404
        assert httpx.delete(r.url + f"/v1/responses/{made.id}").json()["deleted"]  # (where it is stored)
        assert httpx.get(workers[1].url + f"/v1/responses/{made.id}").status_code == 404


def test_item_references_go_where_their_response_is_stored(workers):
    """An ``item_reference`` with no ``previous_response_id`` goes to the worker that stores the item's
    response (an output item's id names its response: ``output_item_id``); round robin alone sends one of
    two references in a row to the other worker, which answers 400 (item not found). So do an
    ``input_tokens`` count of such a turn (or of a ``previous_response_id`` one) and an ``input_items`` list."""
    made = [_client(w.url).responses.create(model=MODEL, input=f"made on worker {i} " * 4, max_output_tokens=2,
                                            temperature=0) for i, w in enumerate(workers)]
    with _Uvicorn(create_router_app([w.url for w in workers], policy="round_robin", health_interval=60)) as r:
        for resp in (made[0], made[0], made[1], made[1]):
            body = {"model": MODEL, "max_output_tokens": 2, "temperature": 0,
                    "input": [{"type": "item_reference", "id": resp.output[-1].id},
                              {"role": "user", "content": "and?"}]}
            answer = httpx.post(r.url + "/v1/responses", json=body, timeout=60)
            assert answer.status_code == 200, answer.text
        for resp in (made[0], made[0], made[1], made[1]):  # a count of a turn's tokens reads the same response
            for body in ({"previous_response_id": resp.id, "input": "and?"},
                         {"input": [{"type": "item_reference", "id": resp.output[-1].id}]}):
                answer = httpx.post(r.url + "/v1/responses/input_tokens", json={"model": MODEL, **body}, timeout=60)
                assert answer.status_code == 200 and answer.json()["input_tokens"] > 0, answer.text
        for resp in (made[0], made[0], made[1], made[1]):
            answer = httpx.get(f"{r.url}/v1/responses/{resp.id}/input_items", timeout=60)
            assert answer.status_code == 200 and answer.json()["data"], answer.text


def test_errors_and_broadcasts_pass_through(workers, router):
    bad = httpx.post(router.url + "/v1/chat/completions", json={"model": MODEL, "messages": [], "temperature": -1})
    direct = httpx.post(workers[0].url + "/v1/chat/completions", json={"model": MODEL, "messages": [],
                                                                       "temperature": -1})
    assert bad.status_code == direct.status_code == 400 and bad.json() == direct.json()
    assert httpx.post(router.url + "/v1/completions", content=b"{not json",
                      headers={"content-type": "application/json"}).status_code == 400
    assert httpx.get(router.url + "/v1/models").json()["data"][0]["id"] == MODEL
    _chat(_client(router.url), [SYSTEM, {"role": "user", "content": "fill the tables " * 10}])
    assert any(w["table_blocks"] for w in httpx.get(router.url + "/workers").json()["workers"])
    assert httpx.post(router.url + "/flush_cache", timeout=30).status_code == 200
    assert not any(w["table_blocks"] for w in httpx.get(router.url + "/workers").json()["workers"])
    metrics = httpx.get(router.url + "/metrics").text
    assert "hyla_router_requests_total" in metrics and "hyla_router_worker_healthy" in metrics
    assert httpx.get(router.url + "/health").json()["healthy_workers"] == 2


def test_an_export_finds_the_worker_holding_the_prefix(workers, router):
    """``/export_prefix`` through the router: asked of every worker, the longest prefix comes back (the one
    the worker that served the prompt holds), whichever worker the router would pick; none cached: a 404."""
    ids = list(range(100, 180))
    served = httpx.post(router.url + "/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": 1}})
    assert served.status_code == 200
    via = httpx.post(router.url + "/export_prefix", json={"input_ids": ids})
    assert via.status_code == 200 and via.headers["x-prefix-tokens"] == str(len(ids) - 1)
    direct = [httpx.post(w.url + "/export_prefix", json={"input_ids": ids}) for w in workers]
    assert sorted(d.status_code for d in direct) == [200, 404]  # one worker holds it
    assert _safetensors(via.content) == _safetensors(next(d.content for d in direct if d.status_code == 200))
    missing = httpx.post(router.url + "/export_prefix", json={"input_ids": list(range(300, 340))})
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "prefix_not_cached"


def _safetensors(data: bytes) -> tuple[dict, bytes]:
    """Safetensors bytes as (header, tensor data): the header's keys come in no fixed order."""
    n = int.from_bytes(data[:8], "little")
    return json.loads(data[8:8 + n]), data[8 + n:]


def test_a_body_past_the_limit_is_a_413_and_reaches_no_worker(workers):
    with _Uvicorn(create_router_app([workers[0].url], max_request_bytes=1000, health_interval=60)) as r:
        answer = httpx.post(r.url + "/v1/completions", json={"model": MODEL, "prompt": "x" * 2000})
        assert answer.status_code == 413 and answer.json()["error"]["code"] == "request_too_large"
        assert httpx.get(r.url + "/workers").json()["workers"][0]["routed"] == 0
        assert httpx.post(r.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1}).status_code == 200


def test_a_worker_answering_503_is_skipped(workers):
    """A worker that is shutting down (its 503) gets no more requests until its health check passes;
    the request is served by another."""
    draining = FastAPI()

    @draining.post("/v1/chat/completions")
    async def refuse():
        return JSONResponse({"error": {"message": "the server is shutting down"}}, status_code=503)

    @draining.get("/health")
    async def health():  # (it started draining after the router's last check)
        return JSONResponse({"status": "ok"})

    with _Uvicorn(draining) as fake, \
            _Uvicorn(create_router_app([fake.url, workers[0].url], policy="round_robin", health_interval=60)) as r:
        for i in range(2):
            assert _chat(_client(r.url), [SYSTEM, {"role": "user", "content": f"served anyway {i}"}]).choices
        info = httpx.get(r.url + "/workers").json()["workers"]
        assert [w["healthy"] for w in info] == [False, True] and [w["routed"] for w in info] == [0, 2]
        assert "hyla_router_retries_total 1.0" in httpx.get(r.url + "/metrics").text


def test_a_dead_worker_is_skipped_and_none_left_is_a_503(workers):
    dead = _closed_port_url()
    with _Uvicorn(create_router_app([dead, workers[0].url], policy="round_robin", health_interval=60)) as r:
        via = _client(r.url)
        for i in range(3):  # the first try of the dead worker fails to connect: sent to the live one instead
            assert _chat(via, [SYSTEM, {"role": "user", "content": f"still served {i}"}]).choices
        info = httpx.get(r.url + "/workers").json()["workers"]
        assert [w["healthy"] for w in info] == [False, True] and info[1]["routed"] == 3
    with _Uvicorn(create_router_app([dead], health_interval=60)) as r:
        answer = httpx.post(r.url + "/v1/chat/completions", json={"model": MODEL, "messages": []})
        assert answer.status_code == 503 and "no worker is available" in answer.json()["error"]["message"]
        assert httpx.get(r.url + "/health").status_code == 503


# ----------------------------------------------------------------------------------------------
# the router against a fake worker: failures a real one rarely shows on demand
# ----------------------------------------------------------------------------------------------
def _fake_worker():
    """A worker that echoes what it was sent (/v1/completions), answers slowly and watches for its
    client leaving (/v1/chat/completions), dies mid-stream (/generate), and whose health can be set."""
    app, state = FastAPI(), {"healthy": True, "left": 0, "cache_id": None}

    @app.get("/health")
    async def health():
        body = {"cache_id": state["cache_id"]} if state["cache_id"] is not None else {}
        return JSONResponse(body, status_code=200 if state["healthy"] else 503)

    @app.api_route("/page", methods=["GET", "HEAD"])
    async def page():
        return Response(b"hello", media_type="text/plain")

    @app.post("/v1/completions")
    async def echo(request: Request):
        body = json.dumps({"authorization": request.headers.get("authorization"), "query": str(request.query_params),
                           "body": (await request.body()).decode()})
        answer = Response(body, media_type="application/json")
        answer.raw_headers += [(b"set-cookie", b"a=1"), (b"set-cookie", b"b=2")]
        return answer

    @app.post("/v1/chat/completions")
    async def slow(request: Request):
        for _ in range(300):
            if await request.is_disconnected():
                state["left"] += 1
                return Response(status_code=499)
            await asyncio.sleep(0.05)
        return JSONResponse({"late": True})

    @app.post("/generate")
    async def dies():
        async def events():
            yield b'data: {"text": "a"}\n\n'
            await asyncio.sleep(0.1)
            raise RuntimeError("the worker died")
        return StreamingResponse(events(), media_type="text/event-stream")

    return app, state


@pytest.mark.parametrize("path, words", [("/update_weights_from_disk", "serve the old weights"),
                                         ("/v1/load_lora_adapter", "lack it"),
                                         ("/v1/unload_lora_adapter", "still serve it")])
def test_a_broadcast_that_must_reach_every_worker_waits_for_the_unhealthy(path, words):
    """A weight update, an adapter's load and its unload need every worker: with one unhealthy, a 503 naming it
    and none is sent (an unload that skipped it left that worker serving the adapter, behind a 200)."""
    sick_app, sick = _fake_worker()
    well_app, _ = _fake_worker()
    sent: list[str] = []

    @well_app.post(path)
    async def took():
        sent.append(path)
        return JSONResponse({})

    sick["healthy"] = False
    with _Uvicorn(sick_app) as a, _Uvicorn(well_app) as b, \
            _Uvicorn(create_router_app([a.url, b.url], health_interval=0.1)) as r:
        while [w["healthy"] for w in httpx.get(r.url + "/workers").json()["workers"]] != [False, True]:
            time.sleep(0.05)
        answer = httpx.post(r.url + path, json={"lora_name": "sql", "lora_path": "/x", "model_path": "/x"})
        assert answer.status_code == 503 and words in answer.json()["error"]["message"] and a.url in answer.text
        assert sent == []



def _restartable_worker():
    """A worker whose ``/health`` names its instance (``state["instance"]``: a new one, a restart) and that records
    the weight updates and adapter loads and unloads it takes (answering ``state["status"]``)."""
    app, state = FastAPI(), {"instance": "first", "status": 200, "took": []}

    @app.get("/health")
    async def health():
        return JSONResponse({"status": "ok", "cache_id": state["instance"] + ".0", "instance_id": state["instance"]})

    async def take(request: Request):
        body = json.loads(await request.body())
        state["took"].append((request.url.path, body.get("lora_name") or body.get("model_path"),
                              request.headers.get("authorization")))
        return JSONResponse({"success": state["status"] == 200}, status_code=state["status"])

    for path in ("/update_weights_from_disk", "/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
        app.post(path)(take)
    return app, state


def test_a_restarted_worker_gets_the_weights_and_adapters_again_before_any_request():
    """A worker restarted behind the router (its ``/health``'s ``instance_id`` is new) serves its start-up's weights
    and adapters; it stays unhealthy while the router sends it again what every worker took — the last weight
    update, then the adapters loaded and not unloaded since, in order, with the headers they came with — and is
    healthy once it took them; one that refuses them stays unhealthy, tried again at the next check."""
    apps = [_restartable_worker() for _ in range(2)]
    key = {"Authorization": "Bearer k"}
    with _Uvicorn(apps[0][0]) as a, _Uvicorn(apps[1][0]) as b, \
            _Uvicorn(create_router_app([a.url, b.url], health_interval=0.2)) as r:
        for path, body in [("/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": "/x"}),
                           ("/v1/load_lora_adapter", {"lora_name": "old", "lora_path": "/y"}),
                           ("/update_weights_from_disk", {"model_path": "/new"}),
                           ("/v1/unload_lora_adapter", {"lora_name": "old"}),
                           ("/v1/load_lora_adapter", {"lora_name": "chat", "lora_path": "/z"})]:
            assert httpx.post(r.url + path, json=body, headers=key).status_code == 200
        restarted = apps[0][1]
        restarted["took"].clear()
        restarted["status"] = 500  # (it cannot take them yet)
        restarted["instance"] = "second"

        def health() -> list[bool]:
            return [w["healthy"] for w in httpx.get(r.url + "/workers").json()["workers"]]

        deadline = time.monotonic() + 10
        while not restarted["took"]:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        time.sleep(0.5)  # (the next checks try again)
        assert health() == [False, True] and len(restarted["took"]) >= 2  # (the first refusal stops each try)
        restarted["took"].clear()
        restarted["status"] = 200
        while health() != [True, True]:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert restarted["took"] == [("/update_weights_from_disk", "/new", "Bearer k"),
                                     ("/v1/load_lora_adapter", "sql", "Bearer k"),
                                     ("/v1/load_lora_adapter", "chat", "Bearer k")]
        assert apps[1][1]["took"][-1] == ("/v1/load_lora_adapter", "chat", "Bearer k")  # (the other: nothing again)
        assert len(apps[1][1]["took"]) == 5


def test_a_weight_update_some_workers_failed_is_a_502_naming_both_and_the_others_catch_up():
    """One worker takes a weight update, the other refuses it (its machine lacks the checkpoint yet): a 502 naming
    both (it said "not updated" while one worker served the new weights), the refusing worker unhealthy — no
    request runs on the old weights beside the new — until a health check's retry takes it; an unload some
    refused says who still serves the adapter."""
    apps = [_restartable_worker() for _ in range(2)]
    with _Uvicorn(apps[0][0]) as a, _Uvicorn(apps[1][0]) as b, \
            _Uvicorn(create_router_app([a.url, b.url], health_interval=0.2)) as r:
        lagging = apps[1][1]
        lagging["status"] = 400
        answer = httpx.post(r.url + "/update_weights_from_disk", json={"model_path": "/step-7"})
        assert answer.status_code == 502 and answer.json()["success"] is False
        message = answer.json()["error"]["message"]
        assert f"updated on workers ['{a.url}'] but not on ['{b.url}']" in message and "400" in message

        def health() -> list[bool]:
            return [w["healthy"] for w in httpx.get(r.url + "/workers").json()["workers"]]

        assert health() == [True, False]
        time.sleep(0.5)
        assert health() == [True, False] and len(lagging["took"]) >= 2  # (refused again at each check)
        lagging["status"] = 200
        deadline = time.monotonic() + 10
        while health() != [True, True]:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert lagging["took"][-1][:2] == ("/update_weights_from_disk", "/step-7")
        assert [t[:2] for t in apps[0][1]["took"]] == [("/update_weights_from_disk", "/step-7")]  # (sent once)
        assert httpx.post(r.url + "/v1/load_lora_adapter", json={"lora_name": "sql", "lora_path": "/x"}).status_code \
            == 200
        lagging["status"] = 500
        answer = httpx.post(r.url + "/v1/unload_lora_adapter", json={"lora_name": "sql"})
        assert answer.status_code == 502 and f"not on ['{b.url}']" in answer.text and "still serve it" in answer.text


def _fleet_worker():
    """A worker as a real one answers weight updates and adapters: an update from a path it lacks (``missing``) a
    400, a load of a name it has a 400 unless in place (``load_inplace``), an unload of one it lacks a 404, anything
    while ``broken`` a 500; ``weights`` and ``loras`` what it serves."""
    app = FastAPI()
    state = {"instance": "first", "missing": set(), "broken": False, "weights": "/start", "loras": set()}

    @app.get("/health")
    async def health():
        return JSONResponse({"status": "ok", "cache_id": state["instance"] + ".0", "instance_id": state["instance"]})

    @app.post("/update_weights_from_disk")
    async def update(request: Request):
        path = json.loads(await request.body())["model_path"]
        if state["broken"] or path in state["missing"]:
            return JSONResponse({"error": {"message": f"no checkpoint {path}"}}, status_code=500 if state["broken"] else 400)
        state["weights"] = path
        return JSONResponse({"success": True})

    @app.post("/v1/load_lora_adapter")
    async def load(request: Request):
        body = json.loads(await request.body())
        if state["broken"] or (body["lora_name"] in state["loras"] and not body.get("load_inplace")):
            return JSONResponse({"error": {"message": "already loaded"}}, status_code=500 if state["broken"] else 400)
        state["loras"].add(body["lora_name"])
        return Response("loaded")

    @app.post("/v1/unload_lora_adapter")
    async def unload(request: Request):
        name = json.loads(await request.body())["lora_name"]
        if state["broken"]:
            return JSONResponse({"error": {"message": "broken"}}, status_code=500)
        if name not in state["loras"]:
            return JSONResponse({"error": {"message": "not loaded"}}, status_code=404)
        state["loras"].discard(name)
        return Response("unloaded")

    return app, state


def test_what_a_worker_owes_a_later_broadcast_replaces_and_nothing_sticks():
    """A worker that owes an update it cannot take (its machine lacks the checkpoint) takes the next update, a
    rollback, which replaces what it owes: healthy again (a 503 refused the rollback, the worker unhealthy for
    ever). A restarted worker started with an adapter the router loaded takes the replayed load in place (its
    400 "already loaded" kept it unhealthy for ever). An unload retried after some had done it (their 404s) is
    done, and a worker restarted later does not get the adapter back."""
    (app_a, a_state), (app_b, b_state) = _fleet_worker(), _fleet_worker()
    with _Uvicorn(app_a) as a, _Uvicorn(app_b) as b, \
            _Uvicorn(create_router_app([a.url, b.url], health_interval=0.2)) as r:

        def workers() -> list[dict]:
            return httpx.get(r.url + "/workers").json()["workers"]

        def wait_healthy() -> None:
            deadline = time.monotonic() + 10
            while [w["healthy"] for w in workers()] != [True, True]:
                assert time.monotonic() < deadline, workers()
                time.sleep(0.05)

        b_state["missing"].add("/step-7")
        assert httpx.post(r.url + "/update_weights_from_disk", json={"model_path": "/step-7"}).status_code == 502
        time.sleep(0.5)
        assert [w["healthy"] for w in workers()] == [True, False] and workers()[1]["owed"] == ["/update_weights_from_disk"]
        back = httpx.post(r.url + "/update_weights_from_disk", json={"model_path": "/step-6"})
        assert back.status_code == 200, back.text
        assert a_state["weights"] == b_state["weights"] == "/step-6" and "owed" not in workers()[1]
        wait_healthy()
        assert httpx.post(r.url + "/v1/load_lora_adapter", json={"lora_name": "sql", "lora_path": "/x"}).status_code \
            == 200
        b_state.update(instance="second", weights="/start", loras={"sql"})  # (restarted with --lora-modules sql=...)
        time.sleep(0.5)
        wait_healthy()
        assert b_state["weights"] == "/step-6" and b_state["loras"] == {"sql"}
        b_state["broken"] = True
        assert httpx.post(r.url + "/v1/unload_lora_adapter", json={"lora_name": "sql"}).status_code == 502
        b_state["broken"] = False
        again = httpx.post(r.url + "/v1/unload_lora_adapter", json={"lora_name": "sql"})
        assert again.status_code == 200, again.text  # (a: 404, done already; b: 200)
        assert a_state["loras"] == b_state["loras"] == set()
        a_state.update(instance="second", weights="/start")
        time.sleep(0.5)
        wait_healthy()
        assert a_state["weights"] == "/step-6" and a_state["loras"] == set()  # (the unloaded adapter not brought back)

def test_a_worker_silent_on_a_broadcast_fails_it_in_time(monkeypatch):
    """A worker hung on ``/abort_request`` (or ``/flush_cache``) held the operator's request forever: past
    ``BROADCAST_SECONDS`` it has failed it, a 502 naming it."""
    from hyla.router import app as router_app

    monkeypatch.setitem(router_app.BROADCAST_SECONDS, "/abort_request", 0.5)
    app, state = _fake_worker()

    @app.post("/abort_request")
    async def hangs():
        await asyncio.sleep(30)
        return JSONResponse({})

    with _Uvicorn(app) as fake, _Uvicorn(create_router_app([fake.url], health_interval=60)) as r:
        start = time.monotonic()
        answer = httpx.post(r.url + "/abort_request", json={"rid": "x"}, timeout=20)
        assert answer.status_code == 502 and fake.url in answer.json()["error"]["message"], answer.text
        assert time.monotonic() - start < 10


def test_what_the_client_sent_reaches_the_worker_and_its_headers_come_back():
    app, _ = _fake_worker()
    with _Uvicorn(app) as fake, _Uvicorn(create_router_app([fake.url], health_interval=60)) as r:
        answer = httpx.post(r.url + "/v1/completions?x=1&x=2", json={"prompt": "p"},
                            headers={"Authorization": "Bearer k"})
        sent = answer.json()
        assert sent["authorization"] == "Bearer k" and sent["query"] == "x=1&x=2" and json.loads(sent["body"]) == {
            "prompt": "p"}
        assert answer.headers.get_list("set-cookie") == ["a=1", "b=2"]
        # a HEAD's answer keeps the worker's Content-Length (what a GET would get), and has no body
        for url in (fake.url, r.url):
            head = httpx.head(url + "/page")
            assert head.status_code == 200 and head.headers["content-length"] == "5" and head.content == b""
        assert httpx.get(r.url + "/page").content == b"hello"


def test_a_chunked_body_past_the_limit_is_a_413():
    app, _ = _fake_worker()
    with _Uvicorn(app) as fake, _Uvicorn(create_router_app([fake.url], max_request_bytes=1000, health_interval=60)) as r:
        answer = httpx.post(r.url + "/v1/completions", content=iter([b"x" * 600, b"x" * 600]))  # no content-length
        assert answer.status_code == 413


def test_a_client_that_leaves_a_whole_answer_closes_the_workers_request():
    app, state = _fake_worker()
    with _Uvicorn(app) as fake, _Uvicorn(create_router_app([fake.url], health_interval=60)) as r:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(r.url + "/v1/chat/completions", json={"messages": []}, timeout=0.5)
        deadline = time.monotonic() + 10
        while not state["left"]:
            assert time.monotonic() < deadline, "the worker never saw the client leave"
            time.sleep(0.05)
        while httpx.get(r.url + "/workers").json()["workers"][0]["in_flight"]:
            assert time.monotonic() < deadline
            time.sleep(0.05)


def test_a_worker_dying_mid_stream_ends_the_stream_with_an_error_event():
    app, _ = _fake_worker()
    with _Uvicorn(app) as fake, _Uvicorn(create_router_app([fake.url], health_interval=60)) as r:
        with httpx.stream("POST", r.url + "/generate", json={"text": "x", "stream": True}, timeout=30) as s:
            lines = [x for x in s.iter_lines() if x]
        assert lines[0] == 'data: {"text": "a"}' and lines[-1] == "data: [DONE]"
        assert json.loads(lines[-2][len("data: "):])["error"]["code"] == "worker_failed"
        info = httpx.get(r.url + "/workers").json()["workers"][0]
        assert not info["healthy"] and info["in_flight"] == 0


def _busy_worker():
    """A worker whose waiting queue is full: a 429 with ``Retry-After`` (the engine's ``--max-queued-requests``),
    counting what it refused; it holds one stored response."""
    app, state = FastAPI(), {"refused": 0}

    @app.get("/health")
    async def health():
        return JSONResponse({"status": "ok"})

    @app.get("/v1/responses/{rid}")
    async def stored(rid: str):
        return JSONResponse({"id": rid}) if rid == "resp_held" else JSONResponse({}, status_code=404)

    @app.post("/{path:path}")
    async def refuse(path: str):
        state["refused"] += 1
        return JSONResponse({"error": {"message": "the waiting queue is full", "type": "rate_limit_error",
                                       "param": None, "code": "rate_limit_exceeded"}},
                            status_code=429, headers={"Retry-After": "1"})

    return app, state


def test_a_full_queue_429_sends_the_request_to_another_worker():
    """A worker whose queue is full stays healthy and the request goes to another; the client gets the
    429 (its ``Retry-After`` too) only when no worker is left to try, or when the request reads a
    stored response only that worker holds."""
    busy_app, busy = _busy_worker()
    echo_app, _ = _fake_worker()
    with _Uvicorn(busy_app) as full, _Uvicorn(echo_app) as free, \
            _Uvicorn(create_router_app([full.url, free.url], policy="round_robin", health_interval=60)) as r:
        for i in range(3):
            answer = httpx.post(r.url + "/v1/completions", json={"prompt": f"p{i}"})
            assert answer.status_code == 200 and json.loads(answer.json()["body"]) == {"prompt": f"p{i}"}
        info = httpx.get(r.url + "/workers").json()["workers"]
        assert [w["healthy"] for w in info] == [True, True] and [w["routed"] for w in info] == [0, 3]
        assert [w["in_flight"] for w in info] == [0, 0] and busy["refused"] == 3  # (its turn each time: a retry takes a turn too)
        metrics = httpx.get(r.url + "/metrics").text
        assert "hyla_router_busy_retries_total 3.0" in metrics and "hyla_router_retries_total 0.0" in metrics
        held = httpx.post(r.url + "/v1/responses", json={"input": "x", "previous_response_id": "resp_held"})
        assert held.status_code == 429 and busy["refused"] == 4  # (the free worker does not hold it)
    with _Uvicorn(busy_app) as full, _Uvicorn(create_router_app([full.url], health_interval=60)) as r:
        answer = httpx.post(r.url + "/v1/chat/completions", json={"messages": []})
        assert answer.status_code == 429 and answer.headers["retry-after"] == "1"
        assert answer.json()["error"]["code"] == "rate_limit_exceeded"
        assert httpx.get(r.url + "/workers").json()["workers"][0] == {
            "url": full.url, "healthy": True, "in_flight": 0, "routed": 1, "table_blocks": 0}


def test_a_router_api_key_is_checked_before_any_worker_and_forwarded():
    app, _ = _fake_worker()
    with pytest.raises(ValueError, match="api_key"):
        create_router_app(["http://127.0.0.1:1"], api_key="")
    with _Uvicorn(app) as fake, _Uvicorn(create_router_app([fake.url], api_key="sesame", health_interval=60)) as r:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic sesame"}):
            answer = httpx.post(r.url + "/v1/completions", json={"prompt": "p"}, headers=headers)
            assert answer.status_code == 401 and answer.headers["www-authenticate"] == "Bearer"
            assert answer.json()["error"]["code"] == "invalid_api_key"
            assert httpx.post(r.url + "/flush_cache", headers=headers).status_code == 401
            assert httpx.get(r.url + "/workers", headers=headers).status_code == 401
        assert httpx.get(r.url + "/health").status_code == 200 and httpx.get(r.url + "/metrics").status_code == 200
        key = {"Authorization": "bearer sesame"}  # (the scheme's case does not matter, as a worker's)
        info = httpx.get(r.url + "/workers", headers=key).json()["workers"]
        assert info[0]["routed"] == 0  # nothing refused reached the worker
        answer = httpx.post(r.url + "/v1/completions", json={"prompt": "p"}, headers=key)
        assert answer.status_code == 200 and answer.json()["authorization"] == "bearer sesame"
        # Anthropic's header passes too, and is forwarded (a worker's /v1/messages checks it)
        assert httpx.post(r.url + "/v1/completions", json={"prompt": "p"}, headers={"x-api-key": "wrong"}).status_code \
            == 401
        assert httpx.post(r.url + "/v1/completions", json={"prompt": "p"},
                          headers={"x-api-key": "sesame"}).status_code == 200



def test_the_routers_own_errors_on_anthropic_paths_have_anthropics_shape():
    """A 401, a 413, a 404 and a 503 the router answers itself, for /v1/messages, have Anthropic's error body (its
    SDK reads ``error.type``), as a worker's own answer there has; OpenAI's paths keep OpenAI's."""
    app, _ = _fake_worker()
    key = {"x-api-key": "sesame"}
    with _Uvicorn(app) as fake, _Uvicorn(create_router_app([fake.url], api_key="sesame", max_request_bytes=1000,
                                                            health_interval=60)) as r:
        raw = httpx.Request("POST", r.url + "/v1/messages/%2E%2E/x", headers=key)  # (a ".." segment, as it came)
        cases = [(httpx.post(r.url + "/v1/messages", json={}), 401, "authentication_error"),
                 (httpx.post(r.url + "/v1/messages", json={"x": "x" * 2000}, headers=key), 413, "request_too_large")]
        with httpx.Client() as client:
            cases.append((client.send(raw), 404, "not_found_error"))
    with _Uvicorn(create_router_app([_closed_port_url()], health_interval=60)) as r:
        cases.append((httpx.post(r.url + "/v1/messages", json={}), 503, "overloaded_error"))
        openai = httpx.post(r.url + "/v1/chat/completions", json={})
        assert openai.status_code == 503 and "no worker is available" in openai.json()["error"]["message"]
    for answer, status, kind in cases:
        assert answer.status_code == status, answer.text
        body = answer.json()
        assert body["type"] == "error" and body["error"]["type"] == kind and body["error"]["message"], body


def test_a_worker_that_emptied_its_cache_loses_its_routing_table():
    """A worker's /health names its cache (``cache_id``); a new name (a flush, a weight update, a restart) clears
    the router's table of the prompts sent there, which would otherwise draw requests to a cache that lost them."""
    app, state = _fake_worker()
    state["cache_id"] = "first.0"
    with _Uvicorn(app) as fake, _Uvicorn(create_router_app([fake.url], health_interval=0.1)) as r:
        assert httpx.post(r.url + "/v1/completions", json={"prompt": "a long shared prompt " * 40}).status_code == 200

        def blocks() -> int:
            return httpx.get(r.url + "/workers").json()["workers"][0]["table_blocks"]

        assert blocks() > 0
        time.sleep(0.5)  # (health checks of the same cache: the table stays)
        assert blocks() > 0
        state["cache_id"] = "second.0"  # (the worker restarted)
        deadline = time.monotonic() + 10
        while blocks() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert blocks() == 0


def test_a_refused_connection_is_retried_and_health_comes_back():
    """A worker healthy at the last check whose connection is refused now: the request goes to the other
    worker; a worker whose health check fails gets nothing until a check passes again."""
    app, state = _fake_worker()
    dead = _closed_port_url()
    with _Uvicorn(app) as fake, \
            _Uvicorn(create_router_app([dead, fake.url], policy="round_robin", health_interval=0.2)) as r:
        router_state = r.server.config.app.state.router
        router_state.workers[0].healthy = True  # (as if it had died after the check)
        router_state.health_interval = 3600  # (no check before the request)
        assert httpx.post(r.url + "/v1/completions", json={"prompt": "p"}).status_code == 200
        assert "hyla_router_retries_total 1.0" in httpx.get(r.url + "/metrics").text
        assert [w["healthy"] for w in httpx.get(r.url + "/workers").json()["workers"]] == [False, True]
    with _Uvicorn(app) as fake, _Uvicorn(create_router_app([fake.url], health_interval=0.1)) as r:
        state["healthy"] = False
        deadline = time.monotonic() + 10
        while httpx.get(r.url + "/health").status_code != 503:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert httpx.post(r.url + "/v1/completions", json={"prompt": "p"}).status_code == 503
        state["healthy"] = True
        while httpx.get(r.url + "/health").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert httpx.post(r.url + "/v1/completions", json={"prompt": "p"}).status_code == 200


# ----------------------------------------------------------------------------------------------
# prefill/decode disaggregation: workers[0] decodes, workers[1] prefills
# ----------------------------------------------------------------------------------------------
@pytest.fixture
def pd_router(workers):
    for w in workers:
        assert httpx.post(w.url + "/flush_cache", timeout=30).status_code == 200
    with _Uvicorn(create_router_app([workers[0].url], prefill_urls=[workers[1].url], health_interval=0.2,
                                    local_prefill_tokens=0)) as r:  # (every prompt moves, however short)
        yield r


def _counts(url: str, metric: str) -> dict[str, float]:
    """The router's ``metric`` by its ``outcome`` label."""
    found = {}
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(metric + "{"):
            found[line.split('outcome="')[1].split('"')[0]] = float(line.rsplit(" ", 1)[1])
    return found


def _routed(url: str) -> tuple[int, int]:
    """Requests routed so far to the decode worker and to the prefill worker."""
    info = httpx.get(url + "/workers").json()
    return info["workers"][0]["routed"], info["prefill_workers"][0]["routed"]


def _cold(workers, send):
    """``send(url)``'s answer from the decode worker with both caches empty: the prompt computed there."""
    for w in workers:
        assert httpx.post(w.url + "/flush_cache", timeout=30).status_code == 200
    return send(workers[0].url)


def _close(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= 1e-4 for x, y in zip(a, b))


def test_disaggregated_requests_answer_as_a_worker_computing_the_prompt(workers, pd_router):
    """A chat (with logprobs; then streamed), a completion (salted), a ``/generate`` and a Responses request through a
    prefill and a decode worker: the decode worker finds all of each prompt but its last token cached (moved
    from the prefill worker: it served none of them before), and each answer's tokens and logprobs are those
    of the decode worker computing the prompt itself, within 1e-4."""
    user = {"role": "user", "content": "Disaggregate this: tell me about topic number 11 " * 5}

    def chat(url):
        r = _chat(_client(url), [SYSTEM, user], logprobs=True, top_logprobs=2)
        lps = [t.logprob for t in r.choices[0].logprobs.content]
        return r.choices[0].message.content, lps, r.usage.prompt_tokens, r.usage.prompt_tokens_details.cached_tokens

    def streamed(url):
        chunks = list(_client(url).chat.completions.create(
            model=MODEL, messages=[SYSTEM, user, {"role": "assistant", "content": "Sure."},
                                   {"role": "user", "content": "And more, streamed?"}],
            max_tokens=6, temperature=0, stream=True, stream_options={"include_usage": True}))
        usage = chunks[-1].usage
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), [], usage.prompt_tokens, \
            usage.prompt_tokens_details.cached_tokens

    def completion(url):
        r = _client(url).completions.create(model=MODEL, prompt="Once upon a time, a router " * 8, max_tokens=6,
                                            temperature=0, logprobs=2, extra_body={"cache_salt": "tenant-a"})
        return r.choices[0].text, r.choices[0].logprobs.token_logprobs, r.usage.prompt_tokens, \
            r.usage.prompt_tokens_details.cached_tokens

    def generate(url):
        r = httpx.post(url + "/generate", json={"input_ids": list(range(40, 140)), "return_logprob": True,
                                                "sampling_params": {"max_new_tokens": 6, "temperature": 0}}).json()
        meta = r["meta_info"]
        return r["output_ids"], [lp for lp, _, _ in meta["output_token_logprobs"]], meta["prompt_tokens"], \
            meta["cached_tokens"]

    def responses(url):
        r = httpx.post(url + "/v1/responses", json={"model": MODEL, "input": "Respond about routers, please. " * 6,
                                                    "max_output_tokens": 6, "temperature": 0}).json()
        return r["output"][-1]["content"][0]["text"], [], r["usage"]["input_tokens"], \
            r["usage"]["input_tokens_details"]["cached_tokens"]

    sends = [chat, streamed, completion, generate, responses]
    for i, send in enumerate(sends):
        text, lps, prompt, cached = send(pd_router.url)
        assert cached == prompt - 1, (send.__name__, cached, prompt)  # moved: the decode worker computed one token
        cold_text, cold_lps, cold_prompt, cold_cached = _cold(workers, send)
        assert (text, prompt, cold_cached) == (cold_text, cold_prompt, 0) and _close(lps, cold_lps), send.__name__
        assert _routed(pd_router.url) == (i + 1, i + 1)
    assert _counts(pd_router.url, "hyla_router_prefills_total") == {"exported": len(sends)}
    assert _counts(pd_router.url, "hyla_router_prefix_imports_total") == {"imported": len(sends)}


def test_what_disaggregation_cannot_help_goes_to_the_decode_worker(workers, pd_router):
    """A prompt with nothing to move (one token), a batch of prompts, and a Responses turn that reads a stored
    response (only the decode worker that made it holds it) are served by the decode worker alone, and a request
    it refuses (an unknown model) reaches no prefill worker."""
    one = httpx.post(pd_router.url + "/generate", json={"input_ids": [7], "sampling_params": {"max_new_tokens": 3}})
    assert one.status_code == 200 and one.json()["meta_info"]["completion_tokens"] == 3
    assert _counts(pd_router.url, "hyla_router_prefills_total") == {"local": 1} and _routed(pd_router.url) == (1, 0)
    batch = _client(pd_router.url).completions.create(model=MODEL, prompt=["First prompt " * 4, "Second prompt " * 4],
                                                       max_tokens=3, temperature=0)
    assert len(batch.choices) == 2 and _routed(pd_router.url) == (2, 0)
    first = httpx.post(pd_router.url + "/v1/responses", json={"model": MODEL, "input": "Remember the number 42. " * 4,
                                                              "max_output_tokens": 4, "temperature": 0}).json()
    assert _routed(pd_router.url) == (3, 1)
    later = httpx.post(pd_router.url + "/v1/responses", json={"model": MODEL, "input": "Which number?", "max_output_tokens": 4,
                                                              "temperature": 0, "previous_response_id": first["id"]})
    assert later.status_code == 200 and later.json()["usage"]["input_tokens_details"]["cached_tokens"] > 0
    assert _routed(pd_router.url) == (4, 1)
    refused = httpx.post(pd_router.url + "/v1/chat/completions", json={"model": "nope", "messages": [SYSTEM]})
    assert refused.status_code == 404 and refused.json()["error"]["code"] == "model_not_found"
    assert _routed(pd_router.url) == (5, 1)  # (the decode worker refused it first)
    assert _counts(pd_router.url, "hyla_router_prefills_total") == {"local": 1, "exported": 1}


def test_a_failed_prefill_worker_costs_only_the_saving(workers):
    """A prefill worker that refuses connections: the prompt goes to the next prefill worker (the first turns
    unhealthy); with none left the decode worker computes the prompt itself, and the answer is the same."""
    for w in workers:
        assert httpx.post(w.url + "/flush_cache", timeout=30).status_code == 200
    messages = [SYSTEM, {"role": "user", "content": "A prompt whose prefill worker died. " * 4}]
    with _Uvicorn(create_router_app([workers[0].url], prefill_urls=[_closed_port_url(), workers[1].url],
                                    policy="round_robin", health_interval=0.2, local_prefill_tokens=0)) as r:
        state = r.server.config.app.state.router
        state.prefill_workers[0].healthy = True  # (as if it had died after the check)
        state.health_interval = 3600
        moved = _chat(_client(r.url), messages)
        assert moved.usage.prompt_tokens_details.cached_tokens == moved.usage.prompt_tokens - 1
        assert [w["healthy"] for w in httpx.get(r.url + "/workers").json()["prefill_workers"]] == [False, True]
    assert httpx.post(workers[0].url + "/flush_cache", timeout=30).status_code == 200
    with _Uvicorn(create_router_app([workers[0].url], prefill_urls=[_closed_port_url()], health_interval=0.2,
                                    local_prefill_tokens=0)) as r:
        alone = _chat(_client(r.url), messages)
        assert alone.usage.prompt_tokens_details.cached_tokens == 0
        assert alone.choices[0].message.content == moved.choices[0].message.content
        assert _counts(r.url, "hyla_router_prefills_total") == {"no_prefill_worker": 1}


def test_what_moving_cannot_help_or_the_decode_worker_refuses_is_not_prefilled(workers, pd_router):
    """A request whose prompt logprobs the decode worker computes anyway (``/generate`` from position 0, a completion's
    echo), and one it refuses (prompt + max_tokens past the context, a grammar that does not compile), go to no prefill
    worker: the first are served there, the others get the decode worker's 400. A prefill worker given a KV-From of
    5,000 digits answers the prefix (from its last token: the value is past any prompt)."""
    logprobs = httpx.post(pd_router.url + "/generate", json={
        "input_ids": list(range(300, 500)), "return_logprob": True, "logprob_start_len": 0,
        "sampling_params": {"max_new_tokens": 2, "temperature": 0}}).json()["meta_info"]
    echo = _client(pd_router.url).completions.create(model=MODEL, prompt="Echo this back to me. " * 20, echo=True,
                                                     logprobs=1, max_tokens=2, temperature=0)
    assert logprobs["cached_tokens"] == 0 and len(logprobs["input_token_logprobs"]) == 200
    assert echo.usage.prompt_tokens_details.cached_tokens == 0 and _routed(pd_router.url) == (2, 0)
    long = httpx.post(pd_router.url + "/generate", json={"input_ids": list(range(10, 210)),
                                                          "sampling_params": {"max_new_tokens": 100000}})
    schema = httpx.post(pd_router.url + "/v1/completions", json={
        "model": MODEL, "prompt": "Some JSON, please. " * 20, "max_tokens": 4, "response_format": {
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}})
    assert (long.status_code, schema.status_code) == (400, 400) and _routed(pd_router.url) == (4, 0)
    assert "context length" in long.json()["error"]["message"] and "compiled" in schema.json()["error"]["message"]
    assert _counts(pd_router.url, "hyla_router_prefills_total") == {"local": 2}
    prefix = httpx.post(workers[1].url + "/generate", json={"input_ids": list(range(600, 650)), "sampling_params": {
        "max_new_tokens": 3}}, headers={"X-Hyla-Prefill-Only": "1", KV_FROM_HEADER: "9" * 5000})
    assert prefix.status_code == 200 and prefix.headers[PREFIX_TOKENS_HEADER] == "49"


def test_a_request_for_prompt_logprobs_moves_what_a_cache_can_serve_of_it(workers, pd_router):
    """``/generate`` with prompt logprobs from position 150 of 200: a cache serves such a request up to position 149
    (the logits there give token 150's logprob), so the prefill worker computes and sends those 149 tokens' prefix,
    and the decode worker hits all of it: its prompt and output logprobs are those of the prompt computed there."""
    def generate(url):
        return httpx.post(url + "/generate", json={
            "input_ids": list(range(700, 900)), "return_logprob": True, "logprob_start_len": 150,
            "sampling_params": {"max_new_tokens": 4, "temperature": 0}}).json()

    moved = generate(pd_router.url)
    assert _routed(pd_router.url) == (1, 1) and moved["meta_info"]["cached_tokens"] == 149
    assert _counts(pd_router.url, "hyla_router_prefix_imports_total") == {"imported": 1}
    cold = _cold(workers, generate)
    assert cold["meta_info"]["cached_tokens"] == 0 and moved["output_ids"] == cold["output_ids"]
    for key, n in (("input_token_logprobs", 50), ("output_token_logprobs", 4)):
        got, want = ([lp for lp, _, _ in out["meta_info"][key]] for out in (moved, cold))
        assert len(got) == n and _close(got, want), key


def test_what_the_decode_worker_nearly_holds_is_prefilled_there(workers):
    """With ``local_prefill_tokens`` (here 100) the decode worker decides on its own cache: a short prompt, and
    a conversation's next turn (the history cached there, the reply and the new message not), are computed
    there; a long new prompt moves, also after the decode worker's cache was emptied behind the router's back.
    The answers are the same either way."""
    for w in workers:
        assert httpx.post(w.url + "/flush_cache", timeout=30).status_code == 200
    with _Uvicorn(create_router_app([workers[0].url], prefill_urls=[workers[1].url], health_interval=0.2,
                                    local_prefill_tokens=100)) as r:
        via = _client(r.url)
        short = _chat(via, [SYSTEM, {"role": "user", "content": "A short one."}])
        assert short.usage.prompt_tokens_details.cached_tokens == 0 and _routed(r.url) == (1, 0)
        messages = [SYSTEM, {"role": "user", "content": "A long first question about many things. " * 20}]
        first = _chat(via, messages)
        assert first.usage.prompt_tokens > 100
        assert first.usage.prompt_tokens_details.cached_tokens == first.usage.prompt_tokens - 1
        assert _routed(r.url) == (2, 1)
        later = _chat(via, messages + [{"role": "assistant", "content": first.choices[0].message.content},
                                       {"role": "user", "content": "And a short follow-up?"}])
        assert later.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 1
        assert _routed(r.url) == (3, 1)
        assert httpx.post(workers[0].url + "/flush_cache", timeout=30).status_code == 200  # (the router's table stays)
        again = _chat(via, messages)
        assert again.usage.prompt_tokens_details.cached_tokens == first.usage.prompt_tokens - 1
        assert again.choices[0].message.content == first.choices[0].message.content and _routed(r.url) == (4, 2)
        assert _counts(r.url, "hyla_router_prefills_total") == {"local": 2, "exported": 2}
        # a next turn with a long new part moves, but only the KV the decode worker lacks travels
        turn = messages + [{"role": "assistant", "content": again.choices[0].message.content},
                           {"role": "user", "content": "Now a long tool result to read: " + "rows of data " * 60}]
        ids = httpx.post(workers[1].url + "/tokenize", json={"messages": turn}).json()["tokens"]
        sent = _sent_bytes(r.url)
        moved = _chat(via, turn)
        assert moved.usage.prompt_tokens_details.cached_tokens == moved.usage.prompt_tokens - 1
        whole = httpx.post(workers[1].url + "/export_prefix", json={"input_ids": ids}).content
        assert _sent_bytes(r.url) - sent < len(whole) * 0.75  # (the first question's KV stayed where it was)
        assert _counts(r.url, "hyla_router_prefix_imports_total") == {"imported": 3}
    for follow_up, answer in ((messages + [{"role": "assistant", "content": first.choices[0].message.content},
                                           {"role": "user", "content": "And a short follow-up?"}], later),
                              (turn, moved)):
        cold = _cold(workers, lambda url: _chat(_client(url), follow_up))
        assert cold.choices[0].message.content == answer.choices[0].message.content


def _sent_bytes(url: str) -> float:
    line = next(x for x in httpx.get(url + "/metrics").text.splitlines() if x.startswith("hyla_router_prefix_bytes_total"))
    return float(line.rsplit(" ", 1)[1])


def test_the_decode_workers_own_check(workers):
    """``X-Hyla-Local-Prefill-Tokens: N`` at a worker: a prompt with more than N tokens uncached there is a 409
    ``prefill_elsewhere`` that computes nothing; with fewer it is served; a header that is not a number is a 400."""
    for w in workers:
        assert httpx.post(w.url + "/flush_cache", timeout=30).status_code == 200
    body = {"input_ids": list(range(200, 300)), "sampling_params": {"max_new_tokens": 2}}
    refused = httpx.post(workers[0].url + "/generate", json=body, headers={"X-Hyla-Local-Prefill-Tokens": "99"})
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "prefill_elsewhere"
    assert httpx.post(workers[0].url + "/export_prefix", json={"input_ids": body["input_ids"]}).status_code == 404
    served = httpx.post(workers[0].url + "/generate", json=body, headers={"X-Hyla-Local-Prefill-Tokens": "100"})
    assert served.status_code == 200 and served.json()["meta_info"]["completion_tokens"] == 2
    again = httpx.post(workers[0].url + "/generate", json=body, headers={"X-Hyla-Local-Prefill-Tokens": "1"})
    assert again.status_code == 200 and again.json()["meta_info"]["cached_tokens"] == 99
    for header in (b"many", "\u00b2".encode()):  # (not a number; a digit, but not an ASCII one)
        bad = httpx.post(workers[0].url + "/generate", json=body, headers={"X-Hyla-Local-Prefill-Tokens": header})
        assert bad.status_code == 400
    outside = httpx.post(workers[0].url + "/generate", json={"input_ids": [1, 10**6]},
                         headers={"X-Hyla-Local-Prefill-Tokens": "0"})  # (the engine's own 400, not a 500)
    assert outside.status_code == 400 and outside.json()["error"]["param"] == "input_ids"
    # /export_prefix's kv_from: the KV from there on only
    whole, part = (httpx.post(workers[0].url + "/export_prefix", json={"input_ids": body["input_ids"], "kv_from": k})
                   for k in (0, 90))
    assert whole.status_code == part.status_code == 200 and len(part.content) < len(whole.content)
    assert part.headers["x-prefix-tokens"] == whole.headers["x-prefix-tokens"] == "99"
    assert httpx.post(workers[0].url + "/export_prefix", json={"input_ids": [1, 2], "kv_from": -1}).status_code == 400


def test_a_request_the_router_marks_aborted_is_answered_as_aborted_at_once(workers):
    """``X-Hyla-Aborted: 1`` (an ``/abort_request`` reached the router while the prompt moved) at each generating
    endpoint: the request is answered as one ``POST /abort_request`` ended before its first token (200, nothing
    produced, finish reason abort; ``cancelled`` at the Responses API), streamed or not; the engine is left with
    nothing running. Without the header the same request runs."""
    url, marked = workers[0].url, {ABORTED_HEADER: "1"}
    body = {"input_ids": list(range(300, 340)), "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
    out = httpx.post(url + "/generate", json=body, headers=marked).json()
    assert out["meta_info"]["finish_reason"]["type"] == "abort" and out["meta_info"]["finish_reason"]["cause"] == "client"
    assert out["meta_info"]["completion_tokens"] == 0 and out["output_ids"] == []
    assert httpx.post(url + "/generate", json=body).json()["meta_info"]["completion_tokens"] == 4
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 4}
    answer = httpx.post(url + "/v1/chat/completions", json=chat, headers=marked).json()
    assert answer["choices"][0]["finish_reason"] == "abort" and answer["usage"]["completion_tokens"] == 0
    with httpx.stream("POST", url + "/v1/chat/completions", json={**chat, "stream": True}, headers=marked) as events:
        lines = [line for line in events.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]" and json.loads(lines[-2][6:])["choices"][0]["finish_reason"] == "abort"
    completion = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 4},
                            headers=marked).json()
    assert completion["choices"][0]["finish_reason"] == "abort" and completion["choices"][0]["text"] == ""
    response = httpx.post(url + "/v1/responses", json={"model": MODEL, "input": "Hello", "max_output_tokens": 4},
                          headers=marked).json()
    assert response["status"] == "cancelled" and response["usage"]["output_tokens"] == 0
    message = httpx.post(url + "/v1/messages", json={"model": MODEL, "max_tokens": 4, "messages": chat["messages"]},
                         headers=marked).json()
    assert message["content"] == [] and message["usage"]["output_tokens"] == 0
    # a JSON list of rids (an abort of some choices): those alone; another value a 400
    two = {**chat, "n": 2, "rid": ["keep-1", "drop-1"], "temperature": 0, "ignore_eos": True}
    answer = httpx.post(url + "/v1/chat/completions", json=two, headers={ABORTED_HEADER: '["drop-1"]'}).json()
    assert [c["finish_reason"] for c in answer["choices"]] == ["length", "abort"], answer
    assert httpx.post(url + "/v1/chat/completions", json={**two, "rid": ["k2", "d2"]},
                      headers={ABORTED_HEADER: "yes"}).status_code == 400
    running = [line for line in httpx.get(url + "/metrics").text.splitlines() if line.startswith("hyla_num_running_requests ")]
    assert running and all(line.endswith(" 0.0") for line in running)


def test_a_prefill_only_request_answers_its_prompts_prefix(workers):
    """A worker sent ``X-Hyla-Prefill-Only: 1`` computes the prompt whatever the request asks of its output
    (here n=2, streamed, a JSON schema) and answers its prefix, which another worker imports; a batch of
    prompts is a 400."""
    for w in workers:
        assert httpx.post(w.url + "/flush_cache", timeout=30).status_code == 200
    messages = [SYSTEM, {"role": "user", "content": "Only prefill this, please. " * 4}]
    prompt = httpx.post(workers[1].url + "/tokenize", json={"messages": messages}).json()["count"]
    answer = httpx.post(workers[1].url + "/v1/chat/completions", headers={"X-Hyla-Prefill-Only": "1"},
                        json={"model": MODEL, "messages": messages, "n": 2, "stream": True, "response_format": {
                            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}})
    assert answer.status_code == 200 and answer.headers["content-type"] == "application/octet-stream"
    assert answer.headers["x-prefix-tokens"] == str(prompt - 1)
    imported = httpx.post(workers[0].url + "/import_prefix", content=answer.content).json()
    assert imported == {"cached_tokens": prompt - 1, "prefix_tokens": prompt - 1}
    anthropic = httpx.post(workers[1].url + "/v1/messages", headers={"X-Hyla-Prefill-Only": "1"},
                           json={"model": MODEL, "max_tokens": 4, "stream": True,
                                 "system": SYSTEM["content"], "messages": messages[1:]})
    assert anthropic.status_code == 200 and anthropic.headers["x-prefix-tokens"] == str(prompt - 1)
    batch = httpx.post(workers[1].url + "/v1/completions", headers={"X-Hyla-Prefill-Only": "1"},
                       json={"model": MODEL, "prompt": ["one prompt", "another prompt"]})
    assert batch.status_code == 400 and batch.json()["error"]["code"] == "batch_not_disaggregated"


# ----------------------------------------------------------------------------------------------
# hyla serve --dp-size
# ----------------------------------------------------------------------------------------------
def test_serve_with_dp_size_gives_the_router_its_flags():
    """``hyla serve --dp-size``'s router takes ``--router-policy`` and ``--router-read-timeout`` (``hyla route``'s
    ``--policy`` and ``--read-timeout``), and the workers' key and body cap; a bad timeout stops it at once."""
    from hyla.router.launch import router_options
    from hyla.server import cli as serve_cli

    parser = argparse.ArgumentParser()
    serve_cli.add_arguments(parser)
    options = router_options(parser.parse_args(["--dp-size", "2", "--router-policy", "least_load",
                                                "--router-read-timeout", "30", "--api-key", "k"]))
    assert (options["policy"], options["read_timeout"], options["api_key"]) == ("least_load", 30.0, "k")
    assert router_options(parser.parse_args([]))["policy"] == "cache_aware"
    create_router_app(["http://127.0.0.1:1"], **options)  # (options the router takes)
    assert serve_cli.run(parser.parse_args(["--dp-size", "2", "--router-read-timeout", "0"])) == 2


def test_worker_argv_drops_what_a_worker_does_not_inherit():
    from hyla.router.launch import worker_argv, worker_devices

    given = ["--model", "m", "--dp-size", "2", "--prefill-workers=1", "--local-prefill-tokens", "64", "--port=9",
             "--host", "0.0.0.0", "--api-key", "k", "--router-policy", "round_robin", "--router-read-timeout=30"]
    assert worker_argv(given, 1234) == ["--model", "m", "--api-key", "k", "--host", "127.0.0.1", "--port", "1234"]
    assert worker_devices("cpu", 3) == [None] * 3
    with pytest.raises(ValueError, match="use --device cuda"):
        worker_devices("cuda:1", 2)


@pytest.mark.slow
def test_serve_with_dp_size_runs_workers_behind_the_router(tiny_ckpt_dir, tmp_path):
    """``hyla serve --dp-size 2 --prefill-workers 1``: two decode workers, a prefill worker and the router in
    one command; a first turn's prompt is computed by the prefill worker (the decode worker finds it cached),
    a later turn is cached; the key (``--api-key``) is the router's and the workers'; SIGTERM (a container's stop)
    stops the workers too and exits 0 (uvicorn re-raised it after its shutdown, which killed the command there:
    status -15, the workers left running)."""
    from test_server_cli import ServeProcess

    server = ServeProcess(["--model", str(make_chat_model(tiny_ckpt_dir)), "--served-model-name", MODEL, "--dp-size",
                           "2", "--prefill-workers", "1", "--max-total-tokens", "4096", "--max-state-slots", "16",
                           "--cpu-threads", "1", "--api-key", "k2"], tmp_path / "serve.log", timeout=300)
    try:
        assert httpx.get(server.url + "/workers").status_code == 401
        info = httpx.get(server.url + "/workers", headers={"Authorization": "Bearer k2"}).json()
        assert info["policy"] == "cache_aware" and [w["healthy"] for w in info["workers"]] == [True, True]
        assert [w["healthy"] for w in info["prefill_workers"]] == [True]
        assert httpx.get(info["workers"][0]["url"] + "/v1/models").status_code == 401  # (a worker's own check)
        via = _client(server.url, api_key="k2")
        messages = [SYSTEM, {"role": "user", "content": "A first question, long enough to be moved. " * 80}]
        first = _chat(via, messages)
        assert first.usage.prompt_tokens_details.cached_tokens == first.usage.prompt_tokens - 1
        messages += [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": "And a second one?"}]
        assert _chat(via, messages).usage.prompt_tokens_details.cached_tokens > first.usage.prompt_tokens // 2
    finally:
        code = server.stop(signal.SIGTERM)
    assert code == 0, server.log()
    for w in info["workers"] + info["prefill_workers"]:  # the workers are gone with the command
        with pytest.raises(httpx.TransportError):
            httpx.get(w["url"] + "/health", timeout=2)


_LOADING_WORKER = """
import http.server, os, sys
open(os.path.join(sys.argv[2], f"worker-{os.getpid()}"), "w").close()
class Loading(http.server.BaseHTTPRequestHandler):  # (a worker still loading its model: never healthy)
    def do_GET(self):
        self.send_response(503); self.send_header("content-length", "0"); self.end_headers()
    def log_message(self, *args): pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Loading).serve_forever()
"""
_LAUNCHER = """
import subprocess, sys, types
import hyla.router.launch as launch
real = subprocess.Popen
def worker(argv, env=None, **kw):  # (hyla serve's workers replaced by ones that never finish loading)
    return real([sys.executable, sys.argv[1], argv[argv.index("--port") + 1], sys.argv[2]])
launch.subprocess = types.SimpleNamespace(Popen=worker, TimeoutExpired=subprocess.TimeoutExpired)
from hyla.cli import main
sys.exit(main(["serve", "--dp-size", "2", "--port", sys.argv[3], "--shutdown-timeout", "1"]))
"""


def test_sigterm_while_the_workers_load_stops_them(tmp_path):
    """``hyla serve --dp-size``: a SIGTERM while the workers still load their models (minutes, for a real one)
    exits 0 through the code that stops them (the default handler killed the command there: status 143, the
    workers left running)."""
    (tmp_path / "worker.py").write_text(_LOADING_WORKER)
    (tmp_path / "launcher.py").write_text(_LAUNCHER)
    proc = subprocess.Popen([sys.executable, str(tmp_path / "launcher.py"), str(tmp_path / "worker.py"),
                             str(tmp_path), _closed_port_url().rsplit(":", 1)[1]], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})
    try:
        deadline = time.monotonic() + 60
        while len(list(tmp_path.glob("worker-*"))) < 2:
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    for marker in tmp_path.glob("worker-*"):
        pid = int(marker.name.removeprefix("worker-"))
        deadline = time.monotonic() + 10
        while Path(f"/proc/{pid}").exists() and "zombie" not in Path(f"/proc/{pid}/status").read_text().lower():
            assert time.monotonic() < deadline, f"worker {pid} left running"
            time.sleep(0.05)


def _fake_decode_worker(held: int, import_seconds: float = 0.0):
    """A decode worker that sends every prompt it may (the router's local-prefill header) to prefill, saying its
    device holds the KV of ``held`` tokens, and records what reaches it: imported prefixes (each taking
    ``import_seconds``) and the requests it serves."""
    app, seen = FastAPI(), {"imports": [], "served": []}

    @app.get("/health")
    async def health():
        return JSONResponse({})

    @app.post("/import_prefix")
    async def import_prefix(request: Request):
        await asyncio.sleep(import_seconds)
        seen["imports"].append(await request.body())
        return JSONResponse({"cached_tokens": 30, "prefix_tokens": 30})

    @app.post("/v1/completions")
    async def complete(request: Request):
        if LOCAL_PREFILL_HEADER in request.headers:
            return JSONResponse({"error": {"message": "prefill it elsewhere", "type": "invalid_request_error",
                                           "param": None, "code": PREFILL_ELSEWHERE}},
                                status_code=409, headers={CACHED_TOKENS_HEADER: str(held)})
        seen["served"].append(json.loads(await request.body())["prompt"])
        return JSONResponse({"served": True})

    return app, seen



def _fake_prefill_worker() -> FastAPI:
    """A prefill worker whose every prompt's prefix is the same 30 tokens' bytes."""
    prefill = FastAPI()

    @prefill.get("/health")
    async def health():
        return JSONResponse({})

    @prefill.post("/v1/completions")
    async def prefill_only():
        return Response(b"prefix bytes", media_type="application/octet-stream", headers={PREFIX_TOKENS_HEADER: "30"})

    return prefill

def test_a_prefix_goes_to_the_decode_worker_it_was_made_for():
    """A decode worker that sent a prompt to prefill gets its prefix (made without the KV it said it holds) and then
    the request, though the policy would pick the other worker next; only where it has failed meanwhile do both go to
    another worker."""
    d0, seen0 = _fake_decode_worker(held=7)
    d1, seen1 = _fake_decode_worker(held=0)
    prefill, asked = FastAPI(), []
    router_state = {}

    @prefill.get("/health")
    async def health():
        return JSONResponse({})

    @prefill.post("/v1/completions")
    async def prefill_only(request: Request):
        asked.append(request.headers.get(KV_FROM_HEADER))
        if "kill" in router_state:  # (the decode worker that asked dies while the prompt is computed)
            router_state["router"].workers[router_state["kill"]].healthy = False
        return Response(b"prefix bytes", media_type="application/octet-stream", headers={PREFIX_TOKENS_HEADER: "30"})

    with _Uvicorn(d0) as w0, _Uvicorn(d1) as w1, _Uvicorn(prefill) as p, \
            _Uvicorn(create_router_app([w0.url, w1.url], prefill_urls=[p.url], policy="round_robin",
                                       health_interval=3600, local_prefill_tokens=0)) as r:
        router_state["router"] = r.server.config.app.state.router
        answer = httpx.post(r.url + "/v1/completions", json={"prompt": "a long prompt"})
        assert answer.status_code == 200 and asked == ["7"]
        assert seen0 == {"imports": [b"prefix bytes"], "served": ["a long prompt"]}
        assert seen1 == {"imports": [], "served": []}  # (round robin's next pick, had the prefix not been pinned)
        router_state["kill"] = 1
        answer = httpx.post(r.url + "/v1/completions", json={"prompt": "another"})  # (round robin: worker 1 asks)
        assert answer.status_code == 200 and asked == ["7", "0"] and seen1 == {"imports": [], "served": []}
        assert seen0 == {"imports": [b"prefix bytes"] * 2, "served": ["a long prompt", "another"]}
        assert _counts(r.url, "hyla_router_prefix_imports_total") == {"imported": 2}



def test_a_decode_worker_silent_on_an_import_fails_it_within_the_read_timeout():
    """``read_timeout`` bounds the prefix's import too (it waited for ever): a decode worker silent on
    ``/import_prefix`` has failed the request, which another worker serves."""
    hung, seen_hung = _fake_decode_worker(held=0, import_seconds=8.0)
    live, seen_live = _fake_decode_worker(held=0)
    prefill = _fake_prefill_worker()

    with _Uvicorn(hung) as h, _Uvicorn(live) as w, _Uvicorn(prefill) as p, \
            _Uvicorn(create_router_app([h.url, w.url], prefill_urls=[p.url], policy="round_robin", health_interval=3600,
                                       local_prefill_tokens=0, read_timeout=0.5)) as r:
        start = time.monotonic()
        answer = httpx.post(r.url + "/v1/completions", json={"prompt": "moved"}, timeout=30)
        assert answer.status_code == 200 and time.monotonic() - start < 6
        assert seen_live == {"imports": [b"prefix bytes"], "served": ["moved"]} and seen_hung["served"] == []
        assert [w["healthy"] for w in httpx.get(r.url + "/workers").json()["workers"]] == [False, True]


def test_a_client_that_leaves_while_its_prompt_moves_is_not_served():
    decode, seen = _fake_decode_worker(held=0, import_seconds=1.0)
    prefill = _fake_prefill_worker()

    with _Uvicorn(decode) as d, _Uvicorn(prefill) as p, \
            _Uvicorn(create_router_app([d.url], prefill_urls=[p.url], health_interval=3600, local_prefill_tokens=0)) as r:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(r.url + "/v1/completions", json={"prompt": "gone"}, timeout=0.3)
        deadline = time.monotonic() + 10
        while httpx.get(r.url + "/workers").json()["workers"][0]["in_flight"]:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        time.sleep(0.3)  # (what the router would send next would have reached the worker by now)
        assert seen == {"imports": [b"prefix bytes"], "served": []}


def _slow_prefill_worker(seconds: float):
    """A prefill worker that takes ``seconds`` over each prompt (``/generate``, chat) unless its client leaves
    first, and records each request's start and end (``"done"``, or ``"left"``: the connection closed)."""
    app, seen = FastAPI(), []

    @app.get("/health")
    async def health():
        return JSONResponse({})

    async def prefill_only(request: Request):
        seen.append("started")
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if await request.is_disconnected():
                seen.append("left")
                return Response(status_code=499)
            await asyncio.sleep(0.02)
        seen.append("done")
        return Response(b"prefix bytes", media_type="application/octet-stream", headers={PREFIX_TOKENS_HEADER: "30"})

    @app.post("/abort_request")
    async def abort_request():  # (no rid of the router's requests: a prefill has none)
        return JSONResponse({"status": "ok"})

    app.post("/generate")(prefill_only)
    app.post("/v1/chat/completions")(prefill_only)
    return app, seen


def _moving_decode_worker():
    """A decode worker that sends every prompt to prefill and records the prefixes imported, the aborts broadcast,
    and each request it serves with whether the router marked it aborted (``ABORTED_HEADER``)."""
    app, seen = FastAPI(), {"imports": 0, "aborts": [], "served": []}

    @app.get("/health")
    async def health():
        return JSONResponse({})

    @app.post("/import_prefix")
    async def import_prefix():
        seen["imports"] += 1
        return JSONResponse({"cached_tokens": 30, "prefix_tokens": 30})

    @app.post("/abort_request")
    async def abort_request(request: Request):
        seen["aborts"].append(json.loads(await request.body()))
        return JSONResponse({"status": "ok"})

    async def serve(request: Request):
        if LOCAL_PREFILL_HEADER in request.headers:
            return JSONResponse({"error": {"message": "prefill it elsewhere", "type": "invalid_request_error",
                                           "param": None, "code": PREFILL_ELSEWHERE}}, status_code=409)
        seen["served"].append((request.url.path, request.headers.get(ABORTED_HEADER)))
        return JSONResponse({"served": True})

    app.post("/generate")(serve)
    app.post("/v1/chat/completions")(serve)
    return app, seen


def test_an_abort_while_the_prompt_moves_reaches_the_request():
    """An ``/abort_request`` that arrives while a prefill worker computes the prompt (no worker knows the request
    yet) is kept by the router: the prefill stops (its connection closes), nothing is imported, and the decode worker
    gets the request marked aborted (it answers it as aborted at once). An abort of another rid, or one the workers
    would refuse, leaves the move alone; ``abort_all`` reaches a chat request too (it has no rid)."""
    decode, seen = _moving_decode_worker()
    prefill, steps = _slow_prefill_worker(seconds=3.0)
    with _Uvicorn(decode) as d, _Uvicorn(prefill) as p, \
            _Uvicorn(create_router_app([d.url], prefill_urls=[p.url], health_interval=3600,
                                       local_prefill_tokens=0)) as r:
        router = r.server.config.app.state.router

        def moving(path: str, body: dict, *aborts: dict) -> httpx.Response:
            answers = []
            client = threading.Thread(target=lambda: answers.append(httpx.post(r.url + path, json=body, timeout=30)))
            client.start()
            deadline = time.monotonic() + 10
            while not router.moves:
                assert time.monotonic() < deadline and client.is_alive()
                time.sleep(0.01)
            for abort in aborts:
                assert httpx.post(r.url + "/abort_request", json=abort).status_code == 200
            client.join(timeout=30)
            return answers[0]

        started = time.monotonic()
        answer = moving("/generate", {"input_ids": [5] * 40, "rid": "r1"}, {"rid": "r1"})
        assert answer.status_code == 200 and time.monotonic() - started < 2.5  # (the prefill was not waited for)
        assert seen == {"imports": 0, "aborts": [{"rid": "r1"}], "served": [("/generate", "1")]}
        deadline = time.monotonic() + 5
        while steps[-1:] != ["left"]:  # the prefill worker's request was closed: it aborts the prefill
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert steps == ["started", "left"] and not router.moves
        assert _counts(r.url, "hyla_router_prefills_total") == {"aborted": 1}

        answer = moving("/generate", {"input_ids": [5] * 40, "rid": "r2"}, {"rid": "another"},
                        {"rid": "r2", "abort_all": True}, {"rid": 2})  # (another's; refused by the workers)
        assert answer.status_code == 200 and steps[2:] == ["started", "done"]
        assert seen["imports"] == 1 and seen["served"][1:] == [("/generate", None)]

        answer = moving("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, {"abort_all": True})
        assert answer.status_code == 200 and seen["imports"] == 1 and steps[4:5] == ["started"]
        assert seen["served"][2:] == [("/v1/chat/completions", "1")] and not router.moves
        # a chat's own rids (one per choice) reach it as /generate's does (they were lost: the request served):
        # one choice's, that choice alone (the prompt still moves); every choice's, all of it (no prefill)
        chat = {"messages": [{"role": "user", "content": "hi"}], "n": 2, "rid": ["c1", "c2"]}
        answer = moving("/v1/chat/completions", chat, {"rid": "c2"})
        assert answer.status_code == 200 and seen["imports"] == 2
        assert seen["served"][3:] == [("/v1/chat/completions", '["c2"]')] and not router.moves
        answer = moving("/v1/chat/completions", {**chat, "rid": ["c3", "c4"]}, {"rid": "c4"}, {"rid": "c3"})
        assert answer.status_code == 200 and seen["imports"] == 2
        assert seen["served"][4:] == [("/v1/chat/completions", "1")] and not router.moves


def test_answers_the_router_cannot_read_cost_only_the_saving():
    """A prefill worker whose answer cannot be decoded (gzip declared, not sent) is a failed prefill: the decode worker
    computes the prompt itself. At ``/export_prefix`` a worker's ``X-Prefix-Tokens`` that is no ASCII number (``²``) is
    not taken for a length, and one of 5,000 digits is taken for the longest: the router answers, not a 500."""
    decode, seen = _fake_decode_worker(held=0)
    garbled = FastAPI()

    @garbled.get("/health")
    async def health():
        return JSONResponse({})

    @garbled.post("/{path:path}")
    async def garble(path: str, request: Request):
        if path == "export_prefix":  # (as many tokens as the body says)
            return Response(b"xx", media_type="application/octet-stream",
                            headers={PREFIX_TOKENS_HEADER: (await request.json())["length"]})
        return Response(b"not gzip", media_type="application/octet-stream",
                        headers={"content-encoding": "gzip", PREFIX_TOKENS_HEADER: "30"})

    with _Uvicorn(decode) as d, _Uvicorn(garbled) as p, \
            _Uvicorn(create_router_app([d.url], prefill_urls=[p.url], health_interval=3600, local_prefill_tokens=0)) as r:
        answer = httpx.post(r.url + "/v1/completions", json={"prompt": "a prompt"})
        assert answer.status_code == 200 and seen == {"imports": [], "served": ["a prompt"]}
        assert _counts(r.url, "hyla_router_prefills_total") == {"no_prefill_worker": 1}
        r.server.config.app.state.router.prefill_workers[0].healthy = True
        for length, status in (("\u00b2", 404), ("9" * 5000, 200)):  # (not a length: the first worker's answer, the
            exported = httpx.post(r.url + "/export_prefix", json={"input_ids": [1, 2, 3], "length": length})
            assert exported.status_code == status  # decode worker's 404; past 10^18 tokens: the longest)


def test_what_the_router_cannot_pass_on_as_it_came_is_an_answer_not_a_500():
    """Bytes httpx would refuse or rewrite: a worker's header outside latin-1 and a client's outside ASCII pass
    through as they came (no 500, no in-flight count left behind); a body nested past Python's recursion limit
    reaches the worker (it answers it); a path with a control character or a dot segment (which the worker's URL
    would resolve: ``/v1/../update_weights_from_disk`` reaching one worker, not the broadcast) is a 404 here; a
    worker dying inside a whole answer drops the client's connection, so the answer cannot look complete; CORS is
    answered by the router itself, as by a worker."""
    app, _ = _fake_worker()

    @app.post("/odd")
    async def odd():
        return Response(b"{}", media_type="application/json", headers={"x-note": "\u20ac".encode().decode("latin-1")})

    @app.post("/v1/short")
    async def short():
        return Response(b"x" * 11, headers={"content-length": "100"})

    with _Uvicorn(app) as fake, _Uvicorn(create_router_app([fake.url], health_interval=3600)) as r:
        odd_answer = httpx.post(r.url + "/odd")
        assert odd_answer.status_code == 200 and (b"x-note", "\u20ac".encode()) in odd_answer.headers.raw
        sent = httpx.post(r.url + "/v1/completions", json={"prompt": "p"}, headers={"user-agent": "caf\xe9".encode("latin-1")})
        assert sent.status_code == 200
        nested = httpx.post(r.url + "/v1/completions", content=b"[" * 100000, headers={"content-type": "application/json"})
        assert nested.status_code == 200 and json.loads(nested.json()["body"][:0] or "0") == 0  # (the worker echoed it)
        for path in ("/v1/models%00", "/v1/../update_weights_from_disk", "/v1/responses/..%2F..%2Fflush_cache"):
            conn = http.client.HTTPConnection(r.url.removeprefix("http://"), timeout=30)  # (httpx would resolve "..")
            conn.request("POST", path, body=b"{}", headers={"content-type": "application/json"})
            refused = conn.getresponse()
            assert refused.status == 404 and json.loads(refused.read())["error"]["code"] == "not_found", path
            conn.close()
        with pytest.raises(httpx.RemoteProtocolError):
            httpx.post(r.url + "/v1/short")
        preflight = httpx.options(r.url + "/v1/completions", headers={
            "origin": "https://a.example", "access-control-request-method": "POST"})
        assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] == "*"
        deadline = time.monotonic() + 10
        while httpx.get(r.url + "/workers").json()["workers"][0]["in_flight"]:
            assert time.monotonic() < deadline, "an in-flight count was left behind"
            time.sleep(0.05)


def test_a_stored_responses_owner_is_the_worker_that_returns_it():
    """A worker that fails (500) or stalls when asked for a stored response is not taken for its owner: the
    worker that returns it is, and the request goes there. A draining owner's 503 is the client's answer (another
    worker does not hold the response), and so is an unhealthy owner's. Only requests a worker took count toward its
    prefix table."""
    failing, stalling, holder = FastAPI(), FastAPI(), FastAPI()
    state = {"draining": False}

    for app in (failing, stalling, holder):
        app.get("/health")(lambda: JSONResponse({}))

    @failing.get("/v1/responses/{rid}")
    async def boom(rid: str):
        return JSONResponse({"error": {"message": "boom"}}, status_code=500)

    @stalling.get("/v1/responses/{rid}")
    async def stall(rid: str):
        await asyncio.sleep(30)

    @holder.get("/v1/responses/{rid}")
    async def held(rid: str):
        return JSONResponse({"id": rid})

    @holder.post("/v1/responses")
    async def create(request: Request):
        if (await request.json())["input"].startswith("c"):  # (a request it refuses: it computes nothing)
            return JSONResponse({"error": {"message": "bad", "code": None}}, status_code=400)
        if state["draining"]:
            return JSONResponse({"error": {"message": "shutting down", "code": "server_shutting_down"}}, status_code=503)
        return JSONResponse({"id": "resp_new", "from": "holder"})

    with _Uvicorn(failing) as a, _Uvicorn(stalling) as b, _Uvicorn(holder) as c, \
            _Uvicorn(create_router_app([a.url, b.url, c.url], health_interval=3600)) as r, \
            pytest.MonkeyPatch.context() as mp:
        mp.setattr("hyla.router.app.OWNER_LOOKUP_SECONDS", 0.5)
        follow = httpx.post(r.url + "/v1/responses", json={"input": "a" * 300, "previous_response_id": "resp_abc"},
                            timeout=20)
        assert follow.status_code == 200 and follow.json()["from"] == "holder"
        tables = [w["table_blocks"] for w in httpx.get(r.url + "/workers").json()["workers"]]
        assert tables[:2] == [0, 0] and tables[2] > 0
        state["draining"] = True
        refused = httpx.post(r.url + "/v1/responses", json={"input": "b" * 300, "previous_response_id": "resp_abc"})
        assert refused.status_code == 503
        bad = httpx.post(r.url + "/v1/responses", json={"input": "c" * 300, "previous_response_id": "resp_abc"})
        assert bad.status_code == 400
        assert [w["table_blocks"] for w in httpx.get(r.url + "/workers").json()["workers"]] == tables
        # the owner unhealthy for a moment (one failed request, until its next health check): a 503 the client
        # retries after Retry-After, naming it (another worker answered "not found": the conversation looked lost)
        r.server.config.app.state.router.workers[2].healthy = False
        for answer in (httpx.get(r.url + "/v1/responses/resp_abc"),
                       httpx.post(r.url + "/v1/responses", json={"input": "d", "previous_response_id": "resp_abc"})):
            assert answer.status_code == 503 and answer.headers["retry-after"] == "30" and c.url in answer.text


def test_hyla_route_stops_with_status_0_on_sigterm_and_imports_no_torch(tmp_path):
    """``hyla route`` (the router alone) exits 0 on SIGTERM, a container's stop, as on Ctrl-C and as ``hyla
    serve`` does (uvicorn re-raised the signal after its shutdown: status -15, a stop that looked like a crash);
    the router imports no torch (it runs anywhere: its modules share only the server's light ones)."""
    repo = Path(__file__).parents[1]
    probe = "import sys, hyla.router.app, hyla.router.cli; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, cwd=repo,
                         env={**os.environ, "PYTHONPATH": str(repo)})
    assert out.stdout.strip() == "False", out.stdout + out.stderr
    port = _closed_port_url().rsplit(":", 1)[1]
    with open(tmp_path / "route.log", "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "hyla.cli", "route", "--worker-urls", _closed_port_url(),
                                 "--port", port, "--health-interval", "60"], cwd=repo, stdout=log,
                                stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": str(repo)})
        try:
            deadline = time.monotonic() + 60
            while True:  # (up: its /health answers, a 503 with its one worker down)
                assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "route.log").read_text()
                try:
                    if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 503:
                        break
                except httpx.TransportError:
                    time.sleep(0.1)
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=30) == 0, (tmp_path / "route.log").read_text()
        finally:
            if proc.poll() is None:
                proc.kill()


def test_hyla_route_refuses_a_port_in_use_before_it_starts(capsys):
    """``hyla route`` checks that it can bind its port before uvicorn starts, as ``hyla serve`` does: a port in use is
    status 2 and ``hyla route: error: cannot listen on ...`` (it was uvicorn's log line and status 3)."""
    from hyla.cli import main

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["route", "--worker-urls", _closed_port_url(), "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert f"hyla route: error: cannot listen on 127.0.0.1:{port}" in err and "in use" in err



def test_hyla_route_refuses_local_prefill_tokens_without_prefill_workers(capsys):
    """``--local-prefill-tokens`` only means something with ``--prefill-urls``: without them it would be ignored,
    so it is refused (status 2), as ``hyla serve`` refuses its own."""
    from hyla.cli import main

    assert main(["route", "--worker-urls", _closed_port_url(), "--local-prefill-tokens", "64"]) == 2
    assert "--local-prefill-tokens set without --prefill-urls" in capsys.readouterr().err
