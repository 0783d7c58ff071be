"""The HTTP API against a real Engine, through the official ``openai`` client (and httpx for raw SSE).

The server runs on 127.0.0.1 on a free port, in this process (``BackgroundServer``), serving a tiny
random Qwen3-Next checkpoint with the built-in default model's tokenizer and chat template: outputs
are not language, but every check here compares the server with the engine or with itself.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

import checkpoints
from hyla.engine.engine import DEFAULT_MODEL_DIR
from hyla.tokenizer import Tokenizer
from hyla.server.app import create_app
from hyla.server.launch import BackgroundServer

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
MODEL = "tiny-chat"
SYSTEM = {"role": "system", "content": "You are a helpful assistant. Answer in one short sentence."}


def make_chat_model(tmp_dir: Path) -> Path:
    """A tiny random Qwen3-Next checkpoint with the default model's tokenizer and chat template."""
    tokenizer = Tokenizer.from_pretrained(DEFAULT_MODEL_DIR)
    path = checkpoints.make_qwen3_next(tmp_dir, moe=False, vocab_size=tokenizer.vocab_size,
                                       eos_token_id=tokenizer.eos_token_id)
    for name in TOKENIZER_FILES:
        shutil.copy(DEFAULT_MODEL_DIR / name, path / name)
    return path


@pytest.fixture(scope="module")
def server(tiny_ckpt_dir):
    app = create_app(make_chat_model(tiny_ckpt_dir), served_model_name=MODEL, max_total_tokens=16384,
                     max_state_slots=96, chunked_prefill_size=512)
    with BackgroundServer(app) as srv:
        yield srv


@pytest.fixture(scope="module")
def engine(server):
    return server.app.state.server.engine


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def _chat(user: str, system: dict = SYSTEM) -> list[dict]:
    return [system, {"role": "user", "content": user}]


def _engine_greedy(engine, input_ids: list[int], max_new_tokens: int, **extra) -> dict:
    params = {"max_new_tokens": max_new_tokens, "temperature": 0.0, **extra}
    return engine.generate(input_ids=input_ids, sampling_params=params)


def _sse_events(response: httpx.Response) -> list[str]:
    return [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]


# --------------------------------------------------------------------------------------------
# models, health
# --------------------------------------------------------------------------------------------
def test_models_and_health(server, client, engine):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    card = client.models.retrieve(MODEL)
    assert card.id == MODEL and card.owned_by == "hyla"
    assert card.model_extra["max_model_len"] == engine.context_length
    health = httpx.get(server.url + "/health")
    assert health.status_code == 200 and health.json() == {"status": "ok", "cache_id": engine.cache_id,
                                                           "instance_id": engine.instance_id, "model": MODEL}


# --------------------------------------------------------------------------------------------
# completions
# --------------------------------------------------------------------------------------------
def test_completion_is_the_engine_output(client, engine):
    prompt = "The quick brown fox jumps over"
    resp = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
    ids = engine.tokenizer.encode(prompt)
    expected = _engine_greedy(engine, ids, 8)
    (choice,) = resp.choices
    assert resp.object == "text_completion" and resp.model == MODEL and resp.id.startswith("cmpl-")
    assert choice.text == expected["text"]
    assert choice.finish_reason == "length"
    assert resp.usage.prompt_tokens == len(ids)
    assert resp.usage.completion_tokens == 8
    assert resp.usage.total_tokens == len(ids) + 8


def test_priority_needs_priority_scheduling(client):
    """Both OpenAI endpoints take ``priority`` (SGLang's and vLLM's extra field); this server runs
    without priority scheduling, so a priority other than 0 is a 400 naming the flag."""
    for create, first in ((client.chat.completions.create, {"messages": _chat("Hi")}),
                          (client.completions.create, {"prompt": "Hi"})):
        with pytest.raises(openai.BadRequestError, match="enable-priority-scheduling"):
            create(model=MODEL, max_tokens=2, extra_body={"priority": 3}, **first)
        out = create(model=MODEL, max_tokens=2, extra_body={"priority": 0, "ignore_eos": True}, **first)
        assert out.usage.completion_tokens == 2


def test_completion_batch_of_prompts_with_n(client, engine):
    prompts = ["Once upon a time", "In the beginning"]
    resp = client.completions.create(model=MODEL, prompt=prompts, n=2, max_tokens=5, temperature=0)
    assert [c.index for c in resp.choices] == [0, 1, 2, 3]
    for i, prompt in enumerate(prompts):
        expected = _engine_greedy(engine, engine.tokenizer.encode(prompt), 5)["text"]
        assert resp.choices[2 * i].text == resp.choices[2 * i + 1].text == expected
    assert resp.usage.prompt_tokens == sum(len(engine.tokenizer.encode(p)) for p in prompts)  # once per prompt
    assert resp.usage.completion_tokens == 4 * 5


def test_completion_token_ids_prompt(client, engine):
    ids = engine.tokenizer.encode("Token ids go straight to the engine")
    resp = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0)
    assert resp.choices[0].text == _engine_greedy(engine, ids, 6)["text"]
    assert resp.usage.prompt_tokens == len(ids)


def test_completion_logprobs(client, engine):
    resp = client.completions.create(model=MODEL, prompt="Counting: one, two", max_tokens=6, temperature=0,
                                     logprobs=3)
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert "".join(lp.tokens) == resp.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 3 and logprob <= 0
        assert max(top.values()) == pytest.approx(logprob)  # greedy picks the most likely token
        assert top[token] == pytest.approx(logprob)


MULTIBYTE = "日本 😀 é ü 日本 😀 é ü"  # characters of 2-4 UTF-8 bytes: each split across byte tokens


def _completion_streamed(server, body: dict) -> tuple[str, dict]:
    """A streamed completion (one choice) added up: its text and its logprobs' four lists."""
    with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        events = [json.loads(e) for e in _sse_events(r) if e != "[DONE]"]
    text, lists = "", {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for choice in (c for e in events for c in e["choices"]):
        text += choice["text"]
        for key in lists:
            lists[key] += (choice["logprobs"] or {}).get(key, [])
    return text, lists


def _assert_offsets_follow_the_text(offsets: list[int], text: str, before: list[str]) -> None:
    """``offsets`` (a completion's ``text_offset``) are where each token starts in ``text``, ``before[i]``
    being the decode of the tokens before token ``i``: they never decrease nor pass the end of the
    text, the text up to token ``i``'s offset is what the tokens before it decode to, and only a
    character they leave incomplete (U+FFFD at the end: the next token may complete it) is left out."""
    assert offsets == sorted(offsets) and all(0 <= o <= len(text) for o in offsets)
    for offset, decoded in zip(offsets, before):
        assert decoded.startswith(text[:offset])
        assert offset == len(decoded) or (offset == len(decoded) - 1 and decoded.endswith("\ufffd"))


def test_text_offsets_of_a_byte_fallback_tokenizer():
    """``TextOffsets`` for a tokenizer whose text is not its tokens' bytes (Llama's SentencePiece
    layout: ``▁`` for a space, ``<0xC3>`` byte tokens, the first space stripped): the window decode,
    where the built-in model's byte-level tokenizer takes the UTF-8 decoder. Each offset is the length
    of what the tokens before decode to, but the character their bytes leave incomplete; chunks as a
    stream gives them equal one call."""
    from tokenizers import Tokenizer as BackendTokenizer, decoders, models

    from hyla.server.openai_routes import TextOffsets
    from hyla.tokenizer import Tokenizer

    vocab = {"<unk>": 0, **{f"<0x{b:02X}>": 1 + b for b in range(256)}}
    for word in ("▁hello", "▁wor", "ld", "▁", "日"):
        vocab[word] = len(vocab)
    backend = BackendTokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>"))
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    tok = Tokenizer(backend)
    byte = lambda b: vocab[f"<0x{b:02X}>"]  # noqa: E731
    ids = [vocab["▁hello"], byte(0xC3), byte(0xA9), vocab["▁wor"], vocab["ld"], byte(0xF0), byte(0x9F), byte(0x98),
           byte(0x80), vocab["日"], vocab["▁"], vocab["▁hello"]]
    assert tok.decode(ids) == "helloé world😀日  hello"
    offsets = TextOffsets(tok).advance(ids)
    assert offsets == [0, 5, 5, 6, 10, 12, 12, 12, 12, 13, 14, 15]
    # (byte fallback shows each byte of an incomplete character as a U+FFFD)
    assert offsets == [len(tok.decode(ids[:i]).rstrip("\ufffd")) for i in range(len(ids))]
    stream = TextOffsets(tok)
    assert stream.advance(ids[:2]) + stream.advance(ids[2:6]) + stream.advance(ids[6:]) == offsets
    # after a prompt's last ids (a completion's context): offsets from start, the prompt's text not counted
    assert TextOffsets(tok, ids[:3], start=7).advance(ids[3:5]) == [7, 11]  # " wor" after "helloé"


def test_completion_text_offset_of_multibyte_characters(server, engine):
    """A token holding the first bytes of a character (``bytes:\\xe6``) adds nothing to the text; the
    one completing it adds the character: text_offset follows the text, not the tokens' display
    strings (which ran past the end of the text). The same streamed; with echo, the prompt's too."""
    tok = engine.tokenizer
    ids = tok.encode(MULTIBYTE)
    assert any(tok.token_text(i).text.startswith("bytes:") for i in ids)
    # the output: byte tokens of 日 and é, and a space, drawn at random (seeded); partial, complete and
    # invalid (U+FFFD) characters mixed
    bias = {str(t): 100 for t in tok.encode("日 é")}
    body = {"model": MODEL, "prompt": MULTIBYTE, "max_tokens": 12, "temperature": 1.0, "seed": 7, "logprobs": 0,
            "logit_bias": bias}
    out_ids = engine.generate(prompt=MULTIBYTE, sampling_params={
        "max_new_tokens": 12, "temperature": 1.0, "seed": 7, "logit_bias": bias})["output_ids"]
    assert any(tok.token_text(i).text.startswith("bytes:") for i in out_ids)
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()
    choice = r["choices"][0]
    lp = choice["logprobs"]
    assert lp["tokens"] == [tok.token_text(i).text for i in out_ids]
    assert choice["text"] == tok.decode(out_ids)
    out_before = [tok.decode(out_ids[:i]) for i in range(len(out_ids))]
    _assert_offsets_follow_the_text(lp["text_offset"], choice["text"], out_before)
    assert _completion_streamed(server, body) == (choice["text"], lp)

    # echo: the prompt's tokens first (from 0), then the completion's from the prompt's end; the prompt
    # is valid text: a token's offset is the length of the complete characters before it
    echo = httpx.post(server.url + "/v1/completions", json={**body, "echo": True}, timeout=60).json()["choices"][0]
    assert echo["text"] == MULTIBYTE + choice["text"]
    offsets = echo["logprobs"]["text_offset"]
    assert offsets[:len(ids)] == [len(tok.decode(ids[:i]).rstrip("\ufffd")) for i in range(len(ids))]
    assert offsets[len(ids):] == [len(MULTIBYTE) + o for o in lp["text_offset"]]
    _assert_offsets_follow_the_text(offsets, echo["text"], [tok.decode(ids[:i]) for i in range(len(ids))]
                                    + [MULTIBYTE + t for t in out_before])
    assert _completion_streamed(server, {**body, "echo": True}) == (echo["text"], echo["logprobs"])

    # a prompt of token ids: echoed decoded, the offsets in that text
    echo_ids = httpx.post(server.url + "/v1/completions", json={**body, "prompt": ids, "echo": True, "max_tokens": 0},
                          timeout=60).json()["choices"][0]
    assert echo_ids["text"] == MULTIBYTE
    assert echo_ids["logprobs"]["text_offset"] == offsets[:len(ids)]


def test_completion_text_offset_with_a_stop_string(server):
    """A stop string cuts the text before the tokens that hold it (they are in the logprobs): their
    offsets stop at the text's end; streamed, a token whose text may still be cut waits for the chunk
    that sends its text (or the last one), so the stream adds up to the same logprobs."""
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 16, "temperature": 0, "logprobs": 1}
    full = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]
    text, offsets = full["text"], full["logprobs"]["text_offset"]
    # a stop string of three tokens' text (the first place it occurs in the output)
    first = next(i for i in range(2, 12) if len(set(offsets[i:i + 4])) == 4
                 and text.find(text[offsets[i]:offsets[i + 3]]) == offsets[i])
    stop = text[offsets[first]:offsets[first + 3]]
    cut = {**body, "stop": [stop]}
    r = httpx.post(server.url + "/v1/completions", json=cut, timeout=60).json()["choices"][0]
    assert r["finish_reason"] == "stop" and r["text"] == text[:offsets[first]]
    lp = r["logprobs"]
    assert lp["tokens"] == full["logprobs"]["tokens"][:first + 3]  # the stop string's tokens with the rest
    assert lp["text_offset"] == [min(o, len(r["text"])) for o in offsets[:first + 3]]
    assert _completion_streamed(server, cut) == (r["text"], lp)


def test_completion_top_logprobs_hold_the_chosen_token(server, client):
    """OpenAI's legacy logprobs always hold the sampled token's logprob (up to logprobs + 1 entries),
    as vLLM's: ``logprobs: 0`` gives the token alone; with echo, the prompt's tokens too (but the
    first, which has no logprob)."""
    kw = dict(model=MODEL, prompt="Counting: one, two", max_tokens=8, temperature=1.5, seed=11)
    for k in (0, 1):
        r = client.completions.create(logprobs=k, **kw)
        lp = r.choices[0].logprobs
        assert len(lp.tokens) == 8
        for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
            assert top[token] == pytest.approx(logprob) and 1 <= len(top) <= k + 1
        if k == 1:  # sampled hot: some token was not the most likely one, beside it
            assert any(len(top) == 2 for top in lp.top_logprobs)
        chunks = list(client.completions.create(logprobs=k, stream=True, **kw))
        streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.top_logprobs]
        # the same entries; the values within fp32 rounding (the stream's prompt is a prefix-cache hit)
        assert [list(t) for t in streamed] == [list(t) for t in lp.top_logprobs]
        assert [list(t.values()) for t in streamed] == [pytest.approx(list(t.values()), abs=1e-4)
                                                        for t in lp.top_logprobs]
    echo = client.completions.create(model=MODEL, prompt="Counting: one, two", max_tokens=0, echo=True, logprobs=0)
    lp = echo.choices[0].logprobs
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(top == {token: logprob} for token, logprob, top in
               zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:]))


def test_null_is_the_default(server, client):
    """``null`` in a field OpenAI lets be null (the openai client sends it for a None) is its default."""
    r = client.completions.create(model=MODEL, prompt="Hi", max_tokens=3, temperature=0, n=None, stream=None,
                                  echo=None, logprobs=None)
    assert len(r.choices) == 1 and r.choices[0].logprobs is None and not r.choices[0].text.startswith("Hi")
    chat = {"model": MODEL, "messages": _chat("Hi"), "max_tokens": 3, "temperature": 0, "n": None, "stream": None,
            "logprobs": None, "parallel_tool_calls": None}
    resp = httpx.post(server.url + "/v1/chat/completions", json=chat, timeout=60)
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["object"] == "chat.completion" and len(body["choices"]) == 1 and body["choices"][0]["logprobs"] is None
    streamed = httpx.post(server.url + "/v1/chat/completions", json={**chat, "stream": None,
                                                                     "stream_options": {"include_usage": True}})
    assert streamed.status_code == 400 and streamed.json()["error"]["param"] == "stream_options"


# --------------------------------------------------------------------------------------------
# chat
# --------------------------------------------------------------------------------------------
def test_chat_is_the_engine_output_on_the_chat_template(client, engine):
    messages = _chat("What is the capital of France?")
    resp = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    ids = engine.tokenizer.encode_chat(messages).ids
    expected = _engine_greedy(engine, ids, 8)
    (choice,) = resp.choices
    assert resp.object == "chat.completion" and resp.id.startswith("chatcmpl-")
    assert choice.message.role == "assistant"
    assert choice.message.content == expected["text"]
    assert choice.finish_reason == {"length": "length", "stop": "stop"}[expected["meta_info"]["finish_reason"]["type"]]
    assert resp.usage.prompt_tokens == len(ids)
    assert resp.usage.completion_tokens == expected["meta_info"]["completion_tokens"]


def test_chat_streaming_adds_up_to_the_non_streaming_answer(client):
    messages = _chat("Tell me about rivers.")
    full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == full.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == full.choices[0].finish_reason and all(f is None for f in finishes[:-1])
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage is not None
    assert usage_chunk.usage.completion_tokens == full.usage.completion_tokens
    assert usage_chunk.usage.prompt_tokens == full.usage.prompt_tokens
    assert len({c.id for c in chunks}) == 1


def test_raw_sse_format(server):
    body = {"model": MODEL, "messages": _chat("Hi"), "max_tokens": 4, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = _sse_events(r)
    assert events[-1] == "[DONE]"
    parsed = [json.loads(e) for e in events[:-1]]
    assert all(p["object"] == "chat.completion.chunk" for p in parsed)
    assert all("usage" not in p or p["usage"] is None for p in parsed)  # no include_usage: no usage chunk
    assert parsed[-1]["choices"][0]["finish_reason"] in ("stop", "length")


def test_chat_n2_with_seed_is_reproducible_and_diverse(client):
    kwargs = dict(model=MODEL, messages=_chat("Write a poem."), max_tokens=16, temperature=1.0, n=2, seed=1234)
    first = client.chat.completions.create(**kwargs)
    again = client.chat.completions.create(**kwargs)
    texts = [c.message.content for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1]
    assert texts == [c.message.content for c in again.choices]  # seed + choice index: reproducible
    assert texts[0] != texts[1]  # ...and the two choices are different draws


def test_chat_n2_streaming_interleaves_both_choices(client):
    stream = client.chat.completions.create(model=MODEL, messages=_chat("Count to ten."), max_tokens=8,
                                            temperature=0, n=2, stream=True)
    texts = {0: "", 1: ""}
    finished = set()
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                finished.add(c.index)
    assert finished == {0, 1}
    assert texts[0] == texts[1] != ""  # greedy: the same answer twice


def test_stop_string_cuts_the_text(client):
    messages = _chat("Say something long.")
    full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0,
                                          extra_body={"ignore_eos": True})
    text = full.choices[0].message.content
    assert len(text) > 12
    start = next(i for i in range(4, len(text) - 3) if text.find(text[i:i + 3]) == i)  # first occurrence
    stop = text[start:start + 3]
    cut = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0,
                                         stop=[stop, "\u2603never"], extra_body={"ignore_eos": True})
    assert cut.choices[0].message.content == text[:start]
    assert cut.choices[0].finish_reason == "stop"
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0,
                                            stop=stop, stream=True, extra_body={"ignore_eos": True})
    chunks = [c for c in stream if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text[:start]  # never leaks the stop
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_chat_logprobs(client):
    resp = client.chat.completions.create(model=MODEL, messages=_chat("Name a colour."), max_tokens=6,
                                          temperature=0, logprobs=True, top_logprobs=2)
    content = resp.choices[0].logprobs.content
    assert len(content) == resp.usage.completion_tokens
    assert b"".join(bytes(t.bytes) for t in content).decode("utf-8", errors="replace").startswith(
        resp.choices[0].message.content)
    for t in content:
        assert len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob
        assert t.top_logprobs[0].token == t.token and t.top_logprobs[0].logprob == pytest.approx(t.logprob)


def test_max_completion_tokens_wins_over_max_tokens(client):
    resp = client.chat.completions.create(model=MODEL, messages=_chat("Go on."), max_tokens=9,
                                          max_completion_tokens=3, temperature=0, extra_body={"ignore_eos": True})
    assert resp.usage.completion_tokens == 3 and resp.choices[0].finish_reason == "length"


# --------------------------------------------------------------------------------------------
# prefix cache through the API
# --------------------------------------------------------------------------------------------
def test_repeated_chat_reports_cached_tokens(client):
    messages = _chat("Is this prompt cached the second time?", {"role": "system", "content": "Repeat test A."})
    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0)
    second = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0)
    n = first.usage.prompt_tokens
    assert first.usage.prompt_tokens_details.cached_tokens < n - 1
    # everything but the last prompt token (whose logits give the first output token) is a hit
    assert second.usage.prompt_tokens_details.cached_tokens == n - 1
    assert second.choices[0].message.content == first.choices[0].message.content


def test_second_turn_hits_the_first_turn(client, engine):
    system = {"role": "system", "content": "Conversation test B: you are terse."}
    turn1 = _chat("First question?", system)
    r1 = client.chat.completions.create(model=MODEL, messages=turn1, max_tokens=6, temperature=0)
    turn2 = turn1 + [{"role": "assistant", "content": r1.choices[0].message.content},
                     {"role": "user", "content": "And a follow-up?"}]
    r2 = client.chat.completions.create(model=MODEL, messages=turn2, max_tokens=6, temperature=0)
    cached = r2.usage.prompt_tokens_details.cached_tokens
    assert r1.usage.prompt_tokens - 1 <= cached < r2.usage.prompt_tokens


def test_shared_system_prompt_hits_on_second_use(client, engine):
    system = {"role": "system", "content": "Shared system prompt C: a long preamble about many things " * 3}
    boundary = engine.tokenizer.chat_message_boundaries([system, {"role": "user", "content": "x"}])[0]
    client.chat.completions.create(model=MODEL, messages=_chat("first user", system), max_tokens=2, temperature=0)
    other = client.chat.completions.create(model=MODEL, messages=_chat("a different user", system), max_tokens=2,
                                           temperature=0)
    # the first conversation stored a checkpoint at the end of the system message
    assert other.usage.prompt_tokens_details.cached_tokens >= boundary


# --------------------------------------------------------------------------------------------
# native /generate
# --------------------------------------------------------------------------------------------
def test_generate_input_ids_and_cached_tokens(server, engine):
    ids = engine.tokenizer.encode("Native generate with token ids, twice.")
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 5, "temperature": 0}}
    first = httpx.post(server.url + "/generate", json=body, timeout=60).json()
    second = httpx.post(server.url + "/generate", json=body, timeout=60).json()
    assert first["output_ids"] == _engine_greedy(engine, ids, 5)["output_ids"]
    assert first["meta_info"]["prompt_tokens"] == len(ids)
    assert first["meta_info"]["completion_tokens"] == 5 == len(first["output_ids"])
    assert first["meta_info"]["finish_reason"] == {"type": "length", "length": 5}
    assert second["meta_info"]["cached_tokens"] == len(ids) - 1
    assert second["output_ids"] == first["output_ids"] and second["text"] == first["text"]


def test_a_chat_without_max_tokens_gets_the_generation_configs_max_new_tokens(server, engine, monkeypatch):
    """vLLM's default ``max_tokens``: the model's ``generation_config.json`` ``max_new_tokens`` where it sets one
    (``Engine.default_max_new_tokens``), else up to the context; a request's own ``max_tokens`` wins."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Count to ten."}], "temperature": 0,
            "ignore_eos": True}
    monkeypatch.setattr(engine, "default_max_new_tokens", 3)
    capped = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60).json()
    assert capped["usage"]["completion_tokens"] == 3 and capped["choices"][0]["finish_reason"] == "length"
    own = httpx.post(server.url + "/v1/chat/completions", json={**body, "max_tokens": 5}, timeout=60).json()
    assert own["usage"]["completion_tokens"] == 5
    too_many = httpx.post(server.url + "/v1/chat/completions", json={**body, "min_tokens": 4}, timeout=60)
    assert too_many.status_code == 400 and "generation_config.json max_new_tokens) (3)" in too_many.text


def test_generate_takes_sglangs_frontend_fields(server, engine):
    """What SGLang's frontend (``sglang.lang``) sends in ``sampling_params``: ``n`` 1, ``stop_regex`` none,
    ``spaces_between_special_tokens``, and ``no_stop_trim`` (SGLang's ``include_stop_str_in_output``); the same
    answer. ``n`` above 1 and a ``stop_regex`` are 400s naming them."""
    ids = engine.tokenizer.encode("Native generate with SGLang's fields.")
    plain = {"max_new_tokens": 6, "temperature": 0}
    want = httpx.post(server.url + "/generate", json={"input_ids": ids, "sampling_params": plain}, timeout=60).json()
    sglang = {**plain, "n": 1, "stop_regex": None, "spaces_between_special_tokens": True, "no_stop_trim": False}
    got = httpx.post(server.url + "/generate", json={"input_ids": ids, "sampling_params": sglang}, timeout=60)
    assert got.status_code == 200 and got.json()["output_ids"] == want["output_ids"], got.text
    stop = engine.tokenizer.decode(want["output_ids"][2:4])
    kept = httpx.post(server.url + "/generate", json={"input_ids": ids, "sampling_params": {
        **plain, "stop": [stop], "no_stop_trim": True}}, timeout=60).json()
    assert kept["text"].endswith(stop) and kept["meta_info"]["finish_reason"]["matched"] == stop
    for bad, param in (({"n": 2}, "sampling_params.n"), ({"stop_regex": "a+"}, "sampling_params.stop_regex"),
                       ({"no_stop_trim": True, "include_stop_str_in_output": False}, "sampling_params.no_stop_trim")):
        r = httpx.post(server.url + "/generate", json={"input_ids": ids, "sampling_params": {**plain, **bad}}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    chat = httpx.post(server.url + "/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
        "spaces_between_special_tokens": False}, timeout=60)  # (vLLM's: accepted, no effect)
    assert chat.status_code == 200, chat.text


def test_generate_batch_and_logprobs(server):
    body = {"text": ["alpha beta", "gamma delta"], "return_logprob": True,
            "sampling_params": [{"max_new_tokens": 3, "temperature": 0}, {"max_new_tokens": 4, "temperature": 0}]}
    outs = httpx.post(server.url + "/generate", json=body, timeout=60).json()
    assert [o["meta_info"]["completion_tokens"] for o in outs] == [3, 4]
    for o in outs:
        assert [tid for _, tid, _ in o["meta_info"]["output_token_logprobs"]] == o["output_ids"]


def test_generate_stream_is_cumulative(server):
    body = {"text": "Streaming natively", "stream": True, "sampling_params": {"max_new_tokens": 6, "temperature": 0}}
    full = httpx.post(server.url + "/generate", json={**body, "stream": False}, timeout=60).json()
    with httpx.stream("POST", server.url + "/generate", json=body, timeout=60) as r:
        events = _sse_events(r)
    assert events[-1] == "[DONE]"
    parsed = [json.loads(e) for e in events[:-1]]
    texts = [p["text"] for p in parsed]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))  # each event holds all the text so far
    assert parsed[-1]["text"] == full["text"] and parsed[-1]["output_ids"] == full["output_ids"]
    assert parsed[-1]["meta_info"]["finish_reason"]["type"] == "length"


# --------------------------------------------------------------------------------------------
# metrics (last: counts what the tests above sent)
# --------------------------------------------------------------------------------------------
def _scrape(server) -> dict[str, float]:
    text = httpx.get(server.url + "/metrics").text
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = s.name + ("{" + ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())) + "}" if s.labels else "")
            samples[key] = s.value
    return samples


def test_metrics(server, client, engine):
    before = _scrape(server)
    messages = _chat("Metrics test: count me.", {"role": "system", "content": "Metrics system D."})
    for _ in range(2):
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0,
                                       extra_body={"ignore_eos": True})
    after = _scrape(server)
    stats = engine.get_stats()
    assert after["hyla_prompt_tokens_total"] == stats["num_prompt_tokens"] > before["hyla_prompt_tokens_total"]
    assert after["hyla_cached_tokens_total"] - before["hyla_cached_tokens_total"] >= 1
    assert after["hyla_generation_tokens_total"] - before["hyla_generation_tokens_total"] == 8
    assert after["hyla_cache_hit_rate"] == pytest.approx(stats["num_cached_tokens"] / stats["num_prompt_tokens"])
    assert 0 < after["hyla_kv_pool_usage"] <= 1 and 0 < after["hyla_state_pool_usage"] <= 1  # the tree holds some
    assert after["hyla_num_running_requests"] == 0 and after["hyla_num_queued_requests"] == 0
    assert "hyla_spec_accept_length" not in after  # speculation is off
    assert "hyla_host_cache_usage" not in after and after["hyla_host_cache_hit_tokens_total"] == 0  # no host tier
    assert after["hyla_time_to_first_token_seconds_count"] - before["hyla_time_to_first_token_seconds_count"] == 2
    assert after["hyla_time_per_output_token_seconds_count"] - before["hyla_time_per_output_token_seconds_count"] == 2
    # each request's wait in the queue, its lengths, and the waits between its tokens (3 after the first of 4, fewer
    # where a stream's chunks merged: all 3 of a request's in one chunk at the least)
    diff = {k: after[k] - before.get(k, 0) for k in after if k.startswith(("hyla_request_", "hyla_inter_token"))}
    assert diff["hyla_request_queue_time_seconds_count"] == 2 and diff["hyla_request_queue_time_seconds_sum"] >= 0
    assert diff["hyla_request_generation_tokens_count"] == 2 and diff["hyla_request_generation_tokens_sum"] == 8
    assert diff["hyla_request_prompt_tokens_sum"] == 2 * (after["hyla_prompt_tokens_total"] - before["hyla_prompt_tokens_total"]) / 2
    assert 2 <= diff["hyla_inter_token_latency_seconds_count"] <= 6 and diff["hyla_inter_token_latency_seconds_sum"] > 0
    assert after["hyla_requests_finished_total{endpoint=chat,finish_reason=length}"] >= 2
    key = "hyla_http_requests_total{method=POST,route=/v1/chat/completions,status=200}"
    assert after[key] - before.get(key, 0) == 2
