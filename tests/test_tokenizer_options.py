"""The tokenizer options (``hyla/engine/args.py``): ``chat_template`` (a Jinja file, or the template's text
itself, replacing the tokenizer's for chat completions, the Responses API, /tokenize of messages and the
tool-call parser's ``auto`` detection) and ``tokenizer_path`` (another directory's tokenizer, kept across
weight updates). Bad values are ``ValueError``s naming the option, at engine construction."""

from __future__ import annotations

import shutil
from pathlib import Path

import httpx
import pytest

import checkpoints
from hyla import Engine
from hyla.engine.args import EngineArgs
from hyla.engine.engine import DEFAULT_MODEL_DIR
from hyla.server.app import create_app
from hyla.server.launch import BackgroundServer
from hyla.tokenizer import Tokenizer
from hyla.tokenizer.chat_template import read_chat_template

MODEL = "tiny-chat"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
ENGINE_OPTS = dict(max_total_tokens=2048, max_state_slots=16, max_running_requests=4, warmup="off")
# a template of our own: the default model's renders "<|im_start|>user\n...", this one "[user]..."
TEMPLATE = ("{% for m in messages %}[{{ m.role }}]{{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}[assistant]{% endif %}")
# the same rendering, with Kimi's tool-call marker in a comment: what the tool-call parser's auto detection reads
KIMI_TEMPLATE = TEMPLATE + "{# calls are written as <|tool_calls_section_begin|> ... #}"
# the tokenizer directory's own template (chat_template.jinja), unlike both
OTHER_TEMPLATE = "{% for m in messages %}<<{{ m.role }}:{{ m.content }}>>{% endfor %}"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
RENDERED = "[system]Be brief.\n[user]Hello there\n[assistant]"
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}}}


@pytest.fixture(scope="module")
def default_tokenizer() -> Tokenizer:
    return Tokenizer.from_pretrained(DEFAULT_MODEL_DIR)


@pytest.fixture(scope="module")
def bare_model(tiny_ckpt_dir, tmp_path_factory, default_tokenizer) -> Path:
    """A tiny Qwen3-Next of the default tokenizer's vocabulary, without any tokenizer file (a copy: other
    modules copy the tokenizer into the shared checkpoint)."""
    built = checkpoints.make_qwen3_next(tiny_ckpt_dir, moe=False, vocab_size=default_tokenizer.vocab_size,
                                        eos_token_id=default_tokenizer.eos_token_id)
    path = tmp_path_factory.mktemp("bare-model")
    for file in built.iterdir():
        if file.name == "config.json" or file.suffix == ".safetensors" or file.name.endswith(".index.json"):
            shutil.copy(file, path / file.name)
    return path


@pytest.fixture(scope="module")
def chat_model(bare_model, tmp_path_factory) -> Path:
    """``bare_model`` with the default model's tokenizer and chat template."""
    path = tmp_path_factory.mktemp("chat-model")
    shutil.copytree(bare_model, path, dirs_exist_ok=True)
    for name in TOKENIZER_FILES:
        shutil.copy(DEFAULT_MODEL_DIR / name, path / name)
    return path


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    """A tokenizer alone: the default model's, with a chat_template.jinja of its own (``OTHER_TEMPLATE``)."""
    path = tmp_path_factory.mktemp("tokenizer-only")
    for name in TOKENIZER_FILES:
        shutil.copy(DEFAULT_MODEL_DIR / name, path / name)
    (path / "chat_template.jinja").write_text(OTHER_TEMPLATE, encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def template_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("templates") / "kimi-like.jinja"
    path.write_text(KIMI_TEMPLATE, encoding="utf-8")
    return path


# --------------------------------------------------------------------------------------------
# chat_template
# --------------------------------------------------------------------------------------------
def test_read_chat_template_takes_a_file_or_the_text(template_file, tmp_path):
    assert read_chat_template(str(template_file)) == KIMI_TEMPLATE
    assert read_chat_template(template_file) == KIMI_TEMPLATE  # (a Path too)
    assert read_chat_template(TEMPLATE) == TEMPLATE
    assert read_chat_template("{{ messages[0].content }}") == "{{ messages[0].content }}"
    # a file's text wins even where the value could be a template: a file named "{{x}}" is read
    odd = tmp_path / "{{x}}"
    odd.write_text("from the file", encoding="utf-8")
    assert read_chat_template(str(odd)) == "from the file"


@pytest.mark.parametrize("value, words", [
    ("no/such/template.jinja", "does not exist"),
    ("chatml", "does not exist"),
    ("", "chat_template must be"),
    ("{% for m in messages %}no end", "does not compile"),
])
def test_a_bad_chat_template_is_a_value_error_naming_the_option(value, words):
    for make in (lambda: read_chat_template(value), lambda: EngineArgs(chat_template=value)):
        with pytest.raises(ValueError, match="chat_template") as info:
            make()
        assert words in str(info.value)


def test_a_directory_or_a_non_utf8_file_is_no_template(tmp_path):
    with pytest.raises(ValueError, match="chat_template: file .* is a directory"):
        read_chat_template(str(tmp_path))
    latin1 = tmp_path / "latin1.jinja"
    latin1.write_bytes("{{ 'caf\u00e9' }}".encode("latin-1"))
    with pytest.raises(ValueError, match="chat_template: cannot read .* as UTF-8"):
        read_chat_template(str(latin1))


def test_engine_construction_refuses_a_missing_template_file(chat_model, tmp_path):
    with pytest.raises(ValueError, match="chat_template: file .*missing.jinja' does not exist"):
        Engine(chat_model, chat_template=str(tmp_path / "missing.jinja"), **ENGINE_OPTS)


def test_a_chat_template_without_a_tokenizer_is_a_value_error(bare_model):
    with pytest.raises(ValueError, match="chat_template needs a tokenizer"):
        Engine(bare_model, chat_template=TEMPLATE, **ENGINE_OPTS)


def test_an_inline_template_replaces_the_models(chat_model, default_tokenizer):
    assert default_tokenizer.apply_chat_template(MESSAGES) != RENDERED  # (the model's own renders otherwise)
    with Engine(chat_model, chat_template=TEMPLATE, **ENGINE_OPTS) as engine:
        tok = engine.tokenizer
        assert tok.chat_template == TEMPLATE and tok.chat_template_for([TOOL]) == TEMPLATE  # its tool_use one too
        assert tok.apply_chat_template(MESSAGES) == RENDERED
        assert tok.apply_chat_template(MESSAGES, tools=[TOOL]) == RENDERED
        assert tok.encode_chat(MESSAGES).ids == tok.encode(RENDERED, add_special_tokens=False)
        assert engine.tokenizer_path == chat_model


# --------------------------------------------------------------------------------------------
# tokenizer_path
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["empty", "missing", "model-without-tokenizer"])
def test_a_tokenizer_path_without_a_tokenizer_is_a_value_error(chat_model, bare_model, tmp_path, kind):
    path = {"empty": tmp_path, "missing": tmp_path / "nope", "model-without-tokenizer": bare_model}[kind]
    with pytest.raises(ValueError, match=f"tokenizer_path '{path}'"):
        Engine(chat_model, tokenizer_path=str(path), **ENGINE_OPTS)


def test_tokenizer_path_is_the_tokenizer_read_and_a_weight_update_keeps_it(chat_model, tokenizer_dir,
                                                                           default_tokenizer):
    with Engine(chat_model, tokenizer_path=str(tokenizer_dir), **ENGINE_OPTS) as engine:
        tok = engine.tokenizer
        assert engine.tokenizer_path == tokenizer_dir and engine.model_path == chat_model
        assert tok.chat_template == OTHER_TEMPLATE  # the tokenizer directory's, not the model's
        assert tok.apply_chat_template(MESSAGES) == "<<system:Be brief.>><<user:Hello there>>"
        assert tok.vocab_size == default_tokenizer.vocab_size
        engine.update_weights_from_disk(chat_model, weight_version="v2")
        assert engine.weight_version == "v2"
        assert engine.tokenizer is tok and engine.tokenizer_path == tokenizer_dir
        assert engine.tokenizer.chat_template == OTHER_TEMPLATE


# --------------------------------------------------------------------------------------------
# the server: both options, a model directory without a tokenizer
# --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(bare_model, tokenizer_dir, template_file):
    """A model without a tokenizer, served with ``tokenizer_dir``'s and ``KIMI_TEMPLATE`` (a file)."""
    app = create_app(bare_model, served_model_name=MODEL, tokenizer_path=str(tokenizer_dir),
                     chat_template=str(template_file), **ENGINE_OPTS)
    with BackgroundServer(app) as srv:
        yield srv


def _post(server, path: str, body: dict) -> dict:
    resp = httpx.post(server.url + path, json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_server_chat_tokenize_and_responses_render_the_option_template(server, default_tokenizer):
    expected = default_tokenizer.encode(RENDERED, add_special_tokens=False)
    out = _post(server, "/tokenize", {"model": MODEL, "messages": MESSAGES})
    assert out["tokens"] == expected
    chat = _post(server, "/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "max_tokens": 1})
    assert chat["usage"]["prompt_tokens"] == len(expected)
    with_tools = _post(server, "/tokenize", {"model": MODEL, "messages": MESSAGES, "tools": [TOOL]})
    assert with_tools["tokens"] == expected  # (the template names no tools: the same prompt)
    response = _post(server, "/v1/responses", {"model": MODEL, "instructions": "Be brief.", "input": "Hello there",
                                               "max_output_tokens": 1, "store": False})
    assert response["usage"]["input_tokens"] == len(expected)


def test_server_info_shows_the_options_and_auto_reads_the_option_template(server, tokenizer_dir, template_file):
    info = httpx.get(server.url + "/get_server_info", timeout=10).json()
    assert info["engine_args"]["chat_template"] == str(template_file)
    assert info["engine_args"]["tokenizer_path"] == str(tokenizer_dir)
    assert info["tool_call_parser"] == "kimi_k2"  # the option template's marker; the tokenizer's has none
    model_info = httpx.get(server.url + "/get_model_info", timeout=10).json()
    assert model_info["tokenizer_path"] == str(tokenizer_dir)
