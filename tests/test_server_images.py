"""Images through the HTTP API (a tiny Qwen3.5 vision-language checkpoint with the default model's tokenizer,
the image tokens added, and a chat template that writes Qwen's image placeholder): an ``image_url`` part (a
data URL, or an http URL of a host ``--allowed-media-domains`` lists, served here by a local HTTP server) in a
chat completion gives what the engine gives for the rendered prompt and the image, the repeated request hits
the cache, and what cannot be an image is a 400 naming ``messages``.
"""

from __future__ import annotations

import base64
import io
import json
import shutil
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import numpy as np
import openai
import PIL.Image
import pytest
from tokenizers import AddedToken
from tokenizers import Tokenizer as BackendTokenizer

import checkpoints
from hyla.engine.engine import DEFAULT_MODEL_DIR
from hyla.server.app import create_app
from hyla.server.launch import BackgroundServer

MODEL = "tiny-vl"
CONTEXT = 160
IMAGE_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
TEMPLATE = (
    "{%- for message in messages -%}{{- '<|im_start|>' + message.role + '\\n' -}}"
    "{%- if message.content is string -%}{{- message.content -}}{%- else -%}{%- for part in message.content -%}"
    "{%- if part.type == 'image' -%}{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif part.type == 'text' -%}{{- part.text -}}{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}{%- endfor -%}{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def make_vl_chat_model(tmp_dir: Path) -> Path:
    """The tiny vision-language checkpoint over the default tokenizer's 4,096 ids and its image tokens (4,096 on)."""
    backend = BackendTokenizer.from_file(str(DEFAULT_MODEL_DIR / "tokenizer.json"))
    base = backend.get_vocab_size()
    tokens = dict(vision_start_token_id=base, vision_end_token_id=base + 1, image_token_id=base + 2,
                  video_token_id=base + 3)
    path = checkpoints.make_qwen3_5_vl(tmp_dir, tokens=tokens, vocab_size=base + 4, eos_token_id=2)
    if not (path / "tokenizer.json").is_file():
        backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in IMAGE_TOKENS])
        assert backend.token_to_id("<|image_pad|>") == tokens["image_token_id"]
        config = json.loads((DEFAULT_MODEL_DIR / "tokenizer_config.json").read_text())
        config["chat_template"] = TEMPLATE
        (path / "tokenizer_config.json").write_text(json.dumps(config))
        backend.save(str(path / "tokenizer.json"))
    return path


def data_url(seed: int, height: int = 48, width: int = 40) -> str:
    pixels = np.random.RandomState(seed).randint(0, 256, (height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    PIL.Image.fromarray(pixels).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def image_message(text: str, *urls: str) -> dict:
    return {"role": "user", "content": [{"type": "text", "text": text},
                                        *({"type": "image_url", "image_url": {"url": u}} for u in urls)]}


class ImageHost:
    """A local HTTP server answering each path from ``routes``: ``(status, headers, body)``."""

    def __init__(self) -> None:
        self.routes: dict[str, tuple[int, dict[str, str], bytes]] = {}
        self.hits: dict[str, int] = {}  # requests per path
        routes, hits = self.routes, self.hits

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                hits[self.path] = hits.get(self.path, 0) + 1
                status, headers, body = routes.get(self.path, (404, {}, b"missing"))
                self.send_response(status)
                for k, v in {"Content-Length": str(len(body)), **headers}.items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.http.server_port}"
        threading.Thread(target=self.http.serve_forever, daemon=True).start()


@pytest.fixture(scope="module")
def image_host():
    host = ImageHost()
    yield host
    host.http.shutdown()


@pytest.fixture(scope="module")
def server(tiny_ckpt_dir):
    app = create_app(make_vl_chat_model(tiny_ckpt_dir), served_model_name=MODEL, max_total_tokens=4096,
                     max_state_slots=32, chunked_prefill_size=64, context_length=CONTEXT,
                     allowed_media_domains=["127.0.0.1"], limit_mm_per_prompt={"image": 6})
    with BackgroundServer(app) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def test_a_chat_with_an_image_equals_the_engine_and_hits_the_cache(server, client):
    """The answer (tokens and logprobs) is the engine's for the template's prompt with the image; the
    prompt's usage counts the image's tokens; the same chat again is served from the cache but its last token;
    another image gives another answer."""
    engine = server.app.state.server.engine
    url = data_url(1)
    messages = [{"role": "system", "content": "Look."}, image_message("What is this?", url)]

    def ask(msgs: list[dict]):
        return client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, temperature=0, logprobs=True)

    encodes = engine.get_stats()["num_image_encodes"]
    first, again, other = ask(messages), ask(messages), ask([messages[0], image_message("What is this?", data_url(2))])
    encoding = engine.tokenizer.encode_chat([messages[0], {"role": "user", "content": [
        {"type": "text", "text": "What is this?"}, {"type": "image"}]}])
    ref = engine.generate(input_ids=encoding.ids, image_data=[url], return_logprob=True,
                          sampling_params={"max_new_tokens": 6, "temperature": 0})
    assert [t.token for t in first.choices[0].logprobs.content] == [
        engine.tokenizer.decode([t]) for t in ref["output_ids"]]
    for ours, (lp, _, _) in zip(first.choices[0].logprobs.content, ref["meta_info"]["output_token_logprobs"]):
        assert abs(ours.logprob - lp) < 1e-4
    assert first.usage.prompt_tokens == ref["meta_info"]["prompt_tokens"] > len(encoding.ids)
    assert again.choices[0].message.content == first.choices[0].message.content
    assert again.usage.prompt_tokens_details.cached_tokens == first.usage.prompt_tokens - 1
    assert other.choices[0].logprobs.content != first.choices[0].logprobs.content
    # /metrics: the tower embedded each image once (the repeats hit the prefix cache through their images)
    metrics = httpx.get(server.url + "/metrics").text
    stats = engine.get_stats()
    assert stats["num_image_encodes"] == encodes + 2
    assert f"hyla_image_encodes_total {float(stats['num_image_encodes'])}" in metrics
    assert f"hyla_image_cache_hits_total {float(stats['num_image_cache_hits'])}" in metrics


def test_the_output_budget_counts_the_images_tokens(client):
    """Without max_tokens the answer may fill the context the prompt leaves, the images' tokens counted: it
    ends at the context length, not refused for overrunning it."""
    out = client.chat.completions.create(model=MODEL, messages=[image_message("Go on.", data_url(5), data_url(6))],
                                         temperature=0, extra_body={"ignore_eos": True})
    assert out.choices[0].finish_reason == "length"
    assert out.usage.prompt_tokens + out.usage.completion_tokens == CONTEXT


def test_responses_and_messages_take_images(server, client):
    """An ``input_image`` (Responses) and an ``image`` block (Anthropic's Messages) give the chat completion's
    answer for the same turn; their token counts (input_tokens, count_tokens) count the image's tokens."""
    url = data_url(7)
    chat = client.chat.completions.create(model=MODEL, messages=[image_message("What is this?", url)], max_tokens=6,
                                          temperature=0)
    response = client.responses.create(model=MODEL, max_output_tokens=6, temperature=0, input=[
        {"role": "user", "content": [{"type": "input_text", "text": "What is this?"},
                                     {"type": "input_image", "image_url": url}]}])
    assert response.output_text == chat.choices[0].message.content
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    listed = client.responses.input_items.list(response.id).data[0].content
    assert [p.type for p in listed] == ["input_text", "input_image"] and listed[1].image_url == url
    counted = httpx.post(server.url + "/v1/responses/input_tokens", timeout=60, json={"model": MODEL, "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "What is this?"},
                                     {"type": "input_image", "image_url": url}]}]}).json()
    assert counted["input_tokens"] == chat.usage.prompt_tokens
    media, data = url.removeprefix("data:").split(";base64,")
    # input_tokens reads each image's header alone: a PNG cut short after it is counted, and refused when sent
    half = "data:image/png;base64," + base64.b64encode(base64.b64decode(data)[:len(data) // 3]).decode()
    cut_input = [{"role": "user", "content": [{"type": "input_text", "text": "What is this?"},
                                              {"type": "input_image", "image_url": half}]}]
    counted = httpx.post(server.url + "/v1/responses/input_tokens", timeout=60,
                         json={"model": MODEL, "input": cut_input}).json()
    assert counted["input_tokens"] == chat.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=MODEL, max_output_tokens=6, input=cut_input)
    assert "cannot be decoded" in err.value.body["message"]
    message = {"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                           {"type": "image", "source": {"type": "base64", "media_type": media,
                                                                        "data": data}}]}
    answer = httpx.post(server.url + "/v1/messages", timeout=60, json={
        "model": MODEL, "max_tokens": 6, "temperature": 0, "messages": [message]}).json()
    assert answer["content"][0]["text"] == chat.choices[0].message.content
    usage = answer["usage"]  # (Anthropic's input_tokens leave out what the cache served)
    assert usage["input_tokens"] + usage.get("cache_read_input_tokens", 0) == chat.usage.prompt_tokens
    tokens = httpx.post(server.url + "/v1/messages/count_tokens", timeout=60,
                        json={"model": MODEL, "messages": [message]}).json()
    assert tokens["input_tokens"] == chat.usage.prompt_tokens
    # count_tokens reads each image's header alone: a PNG cut short after it is counted, and refused when sent
    raw = base64.b64decode(data)
    cut = {**message, "content": [message["content"][0], {"type": "image", "source": {
        "type": "base64", "media_type": media, "data": base64.b64encode(raw[:len(raw) // 2]).decode()}}]}
    tokens = httpx.post(server.url + "/v1/messages/count_tokens", timeout=60, json={"model": MODEL, "messages": [cut]})
    assert tokens.json()["input_tokens"] == chat.usage.prompt_tokens
    bad = httpx.post(server.url + "/v1/messages", timeout=60, json={"model": MODEL, "max_tokens": 6, "messages": [cut]})
    assert bad.status_code == 400 and "cannot be decoded" in bad.json()["error"]["message"]
    for source, words in (({"type": "url", "url": "https://example.com/a.png"}, "does not fetch images from"),
                          ({"type": "file", "file_id": "file_1"}, "holds no files")):
        bad = httpx.post(server.url + "/v1/messages", timeout=60, json={"model": MODEL, "max_tokens": 6, "messages": [
            {"role": "user", "content": [{"type": "image", "source": source}]}]})
        assert bad.status_code == 400 and words in bad.json()["error"]["message"]


def test_image_urls_of_allowed_hosts_are_fetched(client, image_host):
    """An http URL of a listed host gives the data URL's answer, and hits what the data URL cached (the image's
    digest is its key); a host not listed, a redirect to one, a 404, a body over the limit and another scheme
    are 400s naming messages."""
    url = data_url(8)
    image_host.routes["/cat.png"] = (200, {"Content-Type": "image/png"}, base64.b64decode(url.split(",")[1]))
    image_host.routes["/away"] = (302, {"Location": f"http://localhost:{image_host.http.server_port}/cat.png"}, b"")
    image_host.routes["/huge"] = (200, {"Content-Length": str(21 * 2**20)}, b"")
    image_host.routes["/moved"] = (301, {"Location": "/cat.png"}, b"")

    def ask(image: str):
        return client.chat.completions.create(model=MODEL, messages=[image_message("Describe it.", image)],
                                              max_tokens=4, temperature=0, logprobs=True)

    by_data = ask(url)
    image_host.routes["/twice.png"] = image_host.routes["/cat.png"]
    twice = client.chat.completions.create(model=MODEL, max_tokens=2, messages=[
        image_message("Two?", image_host.url + "/twice.png", image_host.url + "/twice.png")])
    assert twice.usage.prompt_tokens > by_data.usage.prompt_tokens and image_host.hits["/twice.png"] == 1  # (once)
    for path in ("/cat.png", "/moved"):  # (a redirect within the listed host is followed)
        fetched = ask(image_host.url + path)
        assert fetched.choices[0].message.content == by_data.choices[0].message.content
        assert fetched.usage.prompt_tokens_details.cached_tokens == by_data.usage.prompt_tokens - 1
    for target, words in ((f"http://localhost:{image_host.http.server_port}/cat.png", "allowed-media-domains"),
                          (image_host.url + "/away", "allowed-media-domains"), (image_host.url + "/nothing", "HTTP 404"),
                          (image_host.url + "/huge", "larger than"), ("ftp://127.0.0.1/cat.png", "http(s) URL")):
        with pytest.raises(openai.BadRequestError) as err:
            ask(target)
        assert err.value.body["param"].startswith("messages") and words in err.value.body["message"], target


def test_token_counts_agree_and_truncation_counts_images(server, client):
    """/tokenize and return_token_ids give the prompt as the engine feeds it (the images' tokens repeated), as
    many tokens as usage counts; truncate_prompt_tokens, which cannot cut images, is a 400 with them; a Responses
    conversation whose images overflow the context is truncated (truncation auto), counting their tokens."""
    messages = [image_message("hello there, what is this", data_url(1)), {"role": "assistant", "content": "a picture"},
                image_message("and this one?", data_url(2, 64, 64))]
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2,
                                         extra_body={"return_token_ids": True})
    counted = httpx.post(server.url + "/tokenize", timeout=60, json={"model": MODEL, "messages": messages}).json()
    assert counted["count"] == out.usage.prompt_tokens == len(out.model_extra["prompt_token_ids"])
    assert counted["tokens"] == out.model_extra["prompt_token_ids"]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2,
                                       extra_body={"truncate_prompt_tokens": 20})
    assert err.value.body["param"] == "truncate_prompt_tokens"
    turns = []
    for i in range(5):  # 5 x 16 image tokens: more than the context (160) with the text
        turns += [{"role": "user", "content": [{"type": "input_text", "text": f"turn {i}, look"},
                                               {"type": "input_image", "image_url": data_url(10 + i, 64, 64)}]},
                  {"role": "assistant", "content": f"answer {i}"}]
    turns.append({"role": "user", "content": "so?"})
    response = client.responses.create(model=MODEL, input=turns, max_output_tokens=4, truncation="auto")
    assert response.output_text and response.usage.input_tokens + response.usage.output_tokens <= CONTEXT
    with pytest.raises(openai.BadRequestError):  # (without truncation: the context is exceeded)
        client.responses.create(model=MODEL, input=turns, max_output_tokens=4)
    # truncation weighs turns by their images' headers and decodes only the kept turns' images: the oldest turn's
    # image, cut short after its header, goes with its turn; input_tokens counts what the response feeds
    good = data_url(30, 64, 64)
    raw = base64.b64decode(good.split(",")[1])
    cut = "data:image/png;base64," + base64.b64encode(raw[:len(raw) // 3]).decode()
    turns = [{"role": "user", "content": [{"type": "input_text", "text": "an old turn " * 20},
                                          {"type": "input_image", "image_url": cut}]},
             {"role": "assistant", "content": "old"}]
    for i in range(4):
        turns += [{"role": "user", "content": [{"type": "input_text", "text": f"look {i}"},
                                               {"type": "input_image", "image_url": data_url(31 + i, 64, 64)}]},
                  {"role": "assistant", "content": f"seen {i}"}]
    turns.append({"role": "user", "content": "and?"})
    with pytest.raises(openai.BadRequestError) as err:  # (whole: over the context)
        client.responses.create(model=MODEL, input=turns, max_output_tokens=4)
    assert "context" in err.value.body["message"] or "cannot be decoded" in err.value.body["message"]
    response = client.responses.create(model=MODEL, input=turns, max_output_tokens=4, truncation="auto")
    counted = httpx.post(server.url + "/v1/responses/input_tokens", timeout=60, json={
        "model": MODEL, "input": turns, "max_output_tokens": 4, "truncation": "auto"}).json()
    assert counted["input_tokens"] == response.usage.input_tokens and response.output_text
    assert response.usage.input_tokens > 4 * 16  # (the four good images kept)


def test_a_request_overrides_its_images_preprocessing(server, client):
    """vLLM's mm_processor_kwargs: a chat completion's (and /tokenize's) images resized within the request's
    bounds, so fewer tokens; an option the engine does not take is a 400 naming it."""
    messages = [image_message("what is this", data_url(5, 64, 64))]  # (16 tokens by the checkpoint's bounds)
    small = {"mm_processor_kwargs": {"max_pixels": 32 * 32}}  # (4)
    full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    less = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, extra_body=small)
    assert full.usage.prompt_tokens - less.usage.prompt_tokens == 16 - 4
    counted = httpx.post(server.url + "/tokenize", timeout=60, json={"model": MODEL, "messages": messages, **small})
    assert counted.json()["count"] == less.usage.prompt_tokens
    text_only = [{"role": "user", "content": "no image here"}]
    for bad, msgs in (({"size": {"longest_edge": 4}}, messages), ({"max_pixels": -1}, messages),
                      ({"max_pixels": 128 * 128}, messages), ({"size": 4}, text_only)):
        with pytest.raises(openai.BadRequestError) as err:  # (past the checkpoint's max_pixels: 64 x 64)
            client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2,
                                           extra_body={"mm_processor_kwargs": bad})
        assert err.value.body["param"] == "mm_processor_kwargs"
    server.app.state.server.engine.check_integrity()
    # --limit-mm-per-prompt: counted before any image is fetched (an unlisted host would be a 400 of its own)
    many = [image_message("so many", *["http://unlisted.example/cat.png"] * 7)]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=many, max_tokens=2)
    assert err.value.body["param"] == "messages" and "at most 6" in err.value.body["message"]


@pytest.mark.parametrize("url, words", [
    ("https://example.com/cat.png", "data URL"),
    ("data:image/png;base64,%%%", "base64"),
    ("data:image/png;base64," + base64.b64encode(b"not a png").decode(), "not an image"),
])
def test_what_is_not_an_image_is_a_400_and_loses_nothing(server, client, url, words):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=[image_message("hi", url)], max_tokens=2)
    assert err.value.body["param"].startswith("messages")
    assert words in err.value.body["message"]
    ok = client.chat.completions.create(model=MODEL, messages=[image_message("hi", data_url(3))], max_tokens=2)
    assert ok.usage.completion_tokens == 2
    server.app.state.server.engine.check_integrity()


def test_an_image_without_its_placeholder_is_a_400(server, tiny_ckpt_dir, tmp_path):
    """A template that drops image parts (one reading text only) leaves the image without a place: a 400."""
    source = make_vl_chat_model(tiny_ckpt_dir)
    path = tmp_path / "text-template"
    shutil.copytree(source, path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = TEMPLATE.replace("{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}", "")
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    with BackgroundServer(create_app(path, served_model_name=MODEL, max_total_tokens=1024, max_state_slots=8)) as srv:
        r = httpx.post(srv.url + "/v1/chat/completions", timeout=60, json={
            "model": MODEL, "max_tokens": 2, "messages": [image_message("hi", data_url(4))]})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "messages" and "placeholder" in r.json()["error"]["message"]


def test_disaggregated_prompts_with_images_answer_as_one_worker_does(tiny_ckpt_dir):
    """Behind ``hyla route --prefill-urls``, a chat with an image moves as any prompt: the prefill worker runs the
    tower and computes it, the decode worker imports the prefix (keyed by the image's digest) and hits all of it
    but its last token, running no tower; the answer (tokens and logprobs) is the decode worker's computing the
    prompt itself. The next turn, with another image, moves too."""
    from hyla.router.app import create_router_app
    from test_router import _Uvicorn, _counts

    path = make_vl_chat_model(tiny_ckpt_dir)
    opts = dict(served_model_name=MODEL, max_total_tokens=4096, max_state_slots=32, context_length=CONTEXT)
    first = [image_message("What is in this one?", data_url(21, 64, 64))]
    second = first + [{"role": "assistant", "content": "a thing"}, image_message("and here?", data_url(22))]

    def chat(url: str, messages: list[dict]):
        with openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
            r = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, temperature=0, logprobs=True)
        return r.choices[0].message.content, [t.logprob for t in r.choices[0].logprobs.content], r.usage

    with BackgroundServer(create_app(path, **opts)) as decode, BackgroundServer(create_app(path, **opts)) as prefill:
        engines = [decode.app.state.server.engine, prefill.app.state.server.engine]
        want = [chat(decode.url, m) for m in (first, second)]  # (computed by the decode worker alone)
        for engine in engines:
            assert engine.flush_cache()
        encodes = [e.get_stats()["num_image_encodes"] for e in engines]
        with _Uvicorn(create_router_app([decode.url], prefill_urls=[prefill.url], health_interval=0.2,
                                        local_prefill_tokens=0)) as router:
            got = [chat(router.url, m) for m in (first, second)]
            assert _counts(router.url, "hyla_router_prefills_total") == {"exported": 2}
            assert _counts(router.url, "hyla_router_prefix_imports_total") == {"imported": 2}
        for (text, lps, usage), (want_text, want_lps, want_usage) in zip(got, want):
            assert text == want_text and usage.prompt_tokens == want_usage.prompt_tokens
            assert all(abs(a - b) <= 1e-4 for a, b in zip(lps, want_lps)) and len(lps) == len(want_lps)
            assert usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens - 1  # (moved)
        stats = [e.get_stats()["num_image_encodes"] - n for e, n in zip(engines, encodes)]
        assert stats == [0, 2], stats  # (the tower ran on the prefill worker alone: once an image)
        for engine in engines:
            engine.check_integrity()
