"""``cache_salt`` (vLLM's field) on /v1/chat/completions, /v1/completions, /v1/responses and /generate: requests share
cached prefixes only with requests of the same salt; an unsalted request only with unsalted ones; no
salt reaches the health check's partition. An empty or non-string salt is a 400 naming the field."""

from __future__ import annotations

import httpx
import pytest

from hyla.server.native_routes import HEALTH_NAMESPACE
from hyla.server.protocol import CACHE_SALT_ERROR, cache_namespace
from test_server_openai import MODEL, client, engine, server  # noqa: F401  (fixtures)


def _messages(tag: str) -> list[dict]:
    """A conversation of its own (no other test's prompt shares a cached prefix with it), long enough
    that a hit is many tokens."""
    system = {"role": "system", "content": f"Cache salt test {tag}: a long preamble about many things. " * 4}
    return [system, {"role": "user", "content": f"What is cached for {tag}?"}]


def _chat(client, messages: list[dict], salt: str | None = None):
    extra = {} if salt is None else {"cache_salt": salt}
    return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0,
                                          extra_body=extra)


def _complete(client, prompt: str, salt: str | None = None):
    extra = {} if salt is None else {"cache_salt": salt}
    return client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0, extra_body=extra)


def _cached(resp) -> int:
    return resp.usage.prompt_tokens_details.cached_tokens


def test_chat_different_salts_share_nothing(client):
    messages = _messages("A")
    first = _chat(client, messages, "tenant-a1")
    again = _chat(client, messages, "tenant-a1")
    other = _chat(client, messages, "tenant-a2")
    assert _cached(again) == again.usage.prompt_tokens - 1  # the cache works for this prompt...
    assert _cached(other) == 0  # ...but not across salts
    assert other.choices[0].message.content == first.choices[0].message.content  # the salt changes no output


def test_chat_same_salt_shares(client):
    messages = _messages("B")
    first = _chat(client, messages, "tenant-b")
    second = _chat(client, messages, "tenant-b")
    assert _cached(first) == 0
    assert _cached(second) == second.usage.prompt_tokens - 1
    assert second.choices[0].message.content == first.choices[0].message.content


def test_chat_salted_and_unsalted_share_nothing(client):
    unsalted_first = _messages("C1")
    _chat(client, unsalted_first)
    assert _cached(_chat(client, unsalted_first, "tenant-c")) == 0
    salted_first = _messages("C2")
    _chat(client, salted_first, "tenant-c")
    assert _cached(_chat(client, salted_first)) == 0
    again = _chat(client, salted_first)  # (the unsalted partition caches it on its own)
    assert _cached(again) == again.usage.prompt_tokens - 1


def test_completions_take_the_salt(client):
    prompt = "Cache salt completions test D: the same long prompt, sent under several salts. " * 3
    first = _complete(client, prompt, "tenant-d1")
    same = _complete(client, prompt, "tenant-d1")
    other = _complete(client, prompt, "tenant-d2")
    unsalted = _complete(client, prompt)
    assert _cached(first) == 0
    assert _cached(same) == same.usage.prompt_tokens - 1
    assert _cached(other) == 0 and _cached(unsalted) == 0
    assert same.choices[0].text == first.choices[0].text == other.choices[0].text == unsalted.choices[0].text


def test_generate_takes_the_salt(server, engine):
    ids = engine.tokenizer.encode("Cache salt native test E: token ids sent under several salts. " * 3)

    def cached(salt: str | None) -> int:
        body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
        if salt is not None:
            body["cache_salt"] = salt
        out = httpx.post(server.url + "/generate", json=body, timeout=60)
        assert out.status_code == 200, out.text
        return out.json()["meta_info"]["cached_tokens"]

    assert cached("tenant-e1") == 0
    assert cached("tenant-e1") == len(ids) - 1
    assert cached("tenant-e2") == 0
    assert cached(None) == 0


def test_no_salt_reaches_the_health_checks_partition(client, engine):
    """A client naming the health check's namespace as its salt gets a partition of its own."""
    assert cache_namespace(HEALTH_NAMESPACE) != HEALTH_NAMESPACE and cache_namespace(None) is None
    prompt = "Cache salt test F: a prompt the health check's partition holds. " * 3
    ids = engine.tokenizer.encode(prompt)
    engine.generate(input_ids=ids, namespace=HEALTH_NAMESPACE, sampling_params={"max_new_tokens": 2, "temperature": 0})
    hit = engine.generate(input_ids=ids, namespace=HEALTH_NAMESPACE,
                          sampling_params={"max_new_tokens": 2, "temperature": 0})
    assert hit["meta_info"]["cached_tokens"] == len(ids) - 1  # that partition holds the prompt
    assert _cached(_complete(client, ids, HEALTH_NAMESPACE)) == 0


def test_responses_take_the_salt(client):
    """A Responses turn, and a turn chained to it (previous_response_id), hit the cache only under
    their own salt."""
    def create(salt: str | None, **kw):
        extra = {} if salt is None else {"cache_salt": salt}
        return client.responses.create(model=MODEL, max_output_tokens=2, temperature=0, extra_body=extra, **kw)

    text = "Cache salt responses test J: a long question asked under several salts. " * 3
    first = create("tenant-j1", input=text)
    same = create("tenant-j1", input=text)
    other = create("tenant-j2", input=text)
    assert same.usage.input_tokens_details.cached_tokens == same.usage.input_tokens - 1
    assert other.usage.input_tokens_details.cached_tokens == 0
    assert same.output_text == first.output_text == other.output_text
    chained = create("tenant-j1", input="And then?", previous_response_id=first.id)
    foreign = create("tenant-j3", input="And then?", previous_response_id=first.id)
    assert chained.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens
    assert foreign.usage.input_tokens_details.cached_tokens == 0  # the chain's turns are tenant-j1's
    assert foreign.output_text == chained.output_text


@pytest.mark.parametrize("salt", ["", 123, ["a"], True])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/responses", "/generate"])
def test_a_bad_salt_is_a_400_naming_it(server, path, salt):
    body = {"/v1/chat/completions": {"model": MODEL, "messages": _messages("G"), "max_tokens": 1},
            "/v1/completions": {"model": MODEL, "prompt": "Hi", "max_tokens": 1},
            "/v1/responses": {"model": MODEL, "input": "Hi", "max_output_tokens": 1},
            "/generate": {"text": "Hi", "sampling_params": {"max_new_tokens": 1}}}[path]
    resp = httpx.post(server.url + path, json={**body, "cache_salt": salt}, timeout=60)
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == "cache_salt" and err["type"] == "invalid_request_error", err
    if salt == "":
        assert CACHE_SALT_ERROR in err["message"], err


def test_a_null_salt_is_no_salt(server, client):
    prompt = "Cache salt test H: null is the unsalted partition. " * 3
    _complete(client, prompt)
    resp = httpx.post(server.url + "/v1/completions", timeout=60,
                      json={"model": MODEL, "prompt": prompt, "max_tokens": 2, "cache_salt": None})
    assert resp.status_code == 200, resp.text
    usage = resp.json()["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"] - 1


def test_the_openai_client_sends_a_salted_stream(server, client):
    messages = _messages("I")
    _chat(client, messages, "tenant-i")
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"cache_salt": "tenant-i"})
    usage = [chunk.usage for chunk in stream if chunk.usage is not None][-1]
    assert usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens - 1
