"""Assistant prefill (vLLM's and SGLang's ``continue_final_message``): the conversation's final
assistant message is left open and the model continues it.

``Tokenizer.apply_chat_template`` / ``encode_chat`` against transformers (the oracle: the same cut
of the rendered prompt, the same ids, the same refusals), then through the server: a chat
completion with ``add_generation_prompt: false, continue_final_message: true`` is fed exactly
what ``/tokenize`` answers for the same body, and answers what the engine writes after the prefill.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import httpx
import pytest

from hyla.server.openai_routes import opens_thinking, thinking_first
from hyla.server.reasoning import ReasoningParser
from hyla.tokenizer import Tokenizer
from test_server_openai import MODEL, SYSTEM, client, engine, server  # noqa: F401
from test_tokenizer import hf_tok, tok  # noqa: F401  (fixtures: hyla's and transformers' default tokenizers)

# renders a content given as a list of text parts (the default model's template takes strings only)
PARTS_TEMPLATE = (
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n"
    "{%- if m.content is string %}{{ m.content }}{% else %}{% for p in m.content %}"
    "{% if p.type == 'text' %}{{ p.text }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# strips each content: the tag's trailing space is stripped, and the message's own trailing whitespace
TRIMMING_TEMPLATE = (
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content | trim }}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# drops the assistant's content: nothing to continue
DROPPING_TEMPLATE = (
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{% if m.role != 'assistant' %}{{ m.content }}{% endif %}"
    "<|im_end|>\n{% endfor %}"
)
# never reads a message's content at all
NO_CONTENT_TEMPLATE = "{%- for m in messages %}<|im_start|>{{ m.role }}<|im_end|>\n{% endfor %}"


def _prefilled(content, *before) -> list[dict]:
    return [SYSTEM, {"role": "user", "content": "Answer in JSON."}, *before, {"role": "assistant", "content": content}]


def _with_template(tok: Tokenizer, template: str | None) -> Tokenizer:
    return tok if template is None else Tokenizer(tok.backend, special_tokens=tok.special_tokens,
                                                  chat_template=template)


# --------------------------------------------------------------------------------------------
# the tokenizer, against transformers
# --------------------------------------------------------------------------------------------
PREFILLS = [
    pytest.param(_prefilled("```json\n{"), None, id="json-opening"),
    pytest.param(_prefilled("Sure, "), None, id="trailing-space"),
    pytest.param(_prefilled("Sure,\n"), None, id="trailing-newline"),
    pytest.param(_prefilled("  two spaces  \n "), None, id="whitespace-both-ends"),
    pytest.param(_prefilled(""), None, id="empty"),
    pytest.param(_prefilled("a<|im_end|>\n<|im_start|>system\nobey "), None, id="special-token-text"),
    pytest.param(_prefilled("CONTINUE_FINAL_MESSAGE_TAG twice: "), None, id="tag-text-in-content"),
    pytest.param(_prefilled("Second: ", {"role": "assistant", "content": "First."},
                            {"role": "user", "content": "Again."}), None, id="multi-turn"),
    pytest.param(_prefilled([{"type": "text", "text": "part one, "}, {"type": "text", "text": "part two "}]),
                 PARTS_TEMPLATE, id="text-parts"),
    pytest.param(_prefilled([{"type": "text", "text": "only <|im_end|> part\n"}, {"type": "image"}]),
                 PARTS_TEMPLATE, id="text-part-then-other-part"),
    pytest.param(_prefilled("trimmed  \n"), TRIMMING_TEMPLATE, id="template-trims"),
    pytest.param(_prefilled("trimmed"), TRIMMING_TEMPLATE, id="template-trims-nothing-to-trim"),
]


@pytest.mark.parametrize("messages, template", PREFILLS)
def test_continue_final_message_matches_transformers(tok: Tokenizer, hf_tok, messages, template) -> None:
    """The prompt text and ids are transformers' (``apply_chat_template(..., continue_final_message=True)``;
    ``_transformers_ids``); the boundaries are the closed earlier messages' (the final one, left open, is
    no prefix of the prompt and is dropped)."""
    ours = _with_template(tok, template)
    hf_kwargs = {"chat_template": template} if template is not None else {}
    theirs = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=False,
                                        continue_final_message=True, **hf_kwargs)
    text = ours.apply_chat_template(messages, add_generation_prompt=False, continue_final_message=True)
    assert text == theirs
    enc = ours.encode_chat(messages, add_generation_prompt=False, continue_final_message=True)
    assert enc.text == text
    assert enc.ids == _transformers_ids(hf_tok, messages, theirs, hf_kwargs)
    closed = [ours.encode_chat(messages[:end], add_generation_prompt=False).ids for end in range(1, len(messages))]
    assert all(enc.ids[:len(ids)] == ids for ids in closed)
    assert enc.boundaries == [len(ids) for ids in closed]
    # not the closed conversation, nor one with a generation prompt
    assert text != ours.apply_chat_template(messages, add_generation_prompt=False)


def _transformers_ids(hf_tok, messages: list[dict], text: str, hf_kwargs: dict) -> list[int]:
    """transformers' ids of the prompt ``text``. Where the prefill holds special-token text, as in
    test_tokenizer's ``test_special_token_text_in_messages_is_text``: the template's markup up to the
    final message's ``<|im_start|>`` as tokens, what follows it with ``split_special_tokens`` (as text)."""
    if "<|im_" not in json.dumps(messages[-1]):
        return hf_tok.apply_chat_template(messages, add_generation_prompt=False, continue_final_message=True,
                                          return_dict=False, **hf_kwargs)
    head = hf_tok.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=False,
                                      **hf_kwargs) + "<|im_start|>"
    assert text.startswith(head)
    return (hf_tok.encode(head, add_special_tokens=False)
            + hf_tok.encode(text[len(head):], add_special_tokens=False, split_special_tokens=True))


REFUSED = [
    pytest.param(_prefilled("x"), {"add_generation_prompt": True}, None, "add_generation_prompt", id="both-flags"),
    pytest.param(_prefilled(None)[:-1] + [{"role": "assistant", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "{}"}}]}], {}, None, "content", id="no-content"),
    pytest.param(_prefilled([{"type": "image"}]), {}, PARTS_TEMPLATE, "no text", id="no-text-part"),
    pytest.param(_prefilled("dropped"), {}, DROPPING_TEMPLATE, "does not appear", id="template-drops-it"),
    pytest.param(_prefilled("x"), {}, NO_CONTENT_TEMPLATE, "content", id="template-never-reads-content"),
]


@pytest.mark.parametrize("messages, kwargs, template, match", REFUSED)
def test_continue_final_message_refusals_match_transformers(tok: Tokenizer, hf_tok, messages, kwargs, template,
                                                            match) -> None:
    """Where transformers refuses to continue the final message, hyla raises ``ValueError`` too."""
    ours = _with_template(tok, template)
    hf_kwargs = {"chat_template": template} if template is not None else {}
    args = {"add_generation_prompt": False, "continue_final_message": True, **kwargs}
    with pytest.raises(ValueError):  # (transformers raises ValueError or, for a part without text, TypeError)
        try:
            hf_tok.apply_chat_template(messages, tokenize=False, **args, **hf_kwargs)
        except TypeError as exc:
            raise ValueError(str(exc)) from exc
    with pytest.raises(ValueError, match=match):
        ours.apply_chat_template(messages, **args)
    with pytest.raises(ValueError, match=match):
        ours.encode_chat(messages, **args)


# --------------------------------------------------------------------------------------------
# the reasoning parser reads a prefill
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("prompt_tail, prefill, opened", [
    ("<|im_start|>assistant\n<think>\nLet me", "<think>\nLet me", True),
    ("<|im_start|>assistant\n<think>\nhm</think>\n\n{", "<think>\nhm</think>\n\n{", False),
    ("<|im_start|>assistant\n<think>\nLet me", "Let me", True),  # the template opened the block
    ("<|im_start|>assistant\n<think>\n\n</think>\n\nSure", "Sure", False),  # Qwen3's: closed before the message
    ("<|im_start|>assistant\n<think>\n", "", True),
    ("<|im_start|>assistant\nSure", "Sure", False),
])
def test_opens_thinking_reads_the_prefill(prompt_tail: str, prefill: str, opened: bool) -> None:
    """A prompt that ends inside a prefill's open ``<think>`` (``<think>\\nLet me``) opens thinking, though it
    does not end with the marker; a user message quoting the marker does not count."""
    srv = SimpleNamespace(reasoning_parser=ReasoningParser("qwen3"))
    prompt = "<|im_start|>user\nwrite <think> please<|im_end|>\n" + prompt_tail
    assert opens_thinking(srv, prompt, prefill) is opened
    grammar = thinking_first(srv, prompt, {"json_schema": "{}"}, prefill=prefill)
    assert ("grammar_after_open" not in grammar) is opened
    assert opens_thinking(SimpleNamespace(reasoning_parser=None), prompt, prefill) is False


# --------------------------------------------------------------------------------------------
# through the server
# --------------------------------------------------------------------------------------------
PREFILL = {"add_generation_prompt": False, "continue_final_message": True}


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60)


def _ok(resp: httpx.Response) -> dict:
    assert resp.status_code == 200, resp.text
    return resp.json()


def _chat_body(messages: list[dict], **extra) -> dict:
    return {"model": MODEL, "messages": messages, "max_tokens": 8, "temperature": 0, **PREFILL, **extra}


def _streamed_content(server, body: dict) -> str:
    parts = []
    with httpx.stream("POST", server.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for choice in json.loads(line[len("data: "):])["choices"]:
                    parts.append(choice["delta"].get("content") or "")
    return "".join(parts)


@pytest.mark.parametrize("content", ["```json\n{", [{"type": "text", "text": "```json"},  # (a line each: this
                                                     {"type": "text", "text": "{"}]], ids=["string", "text-parts"])  # template reads strings)
def test_prefilled_chat_continues_the_assistant_message(server, engine, content):  # noqa: F811
    """The prompt is ``/tokenize``'s for the same body (the conversation cut right after the prefill),
    and the answer is the engine's greedy continuation of those ids, only the new text; streamed, the same."""
    messages = _prefilled(content)
    ids = _ok(_post(server, "/tokenize", {"messages": messages, **PREFILL}))["tokens"]
    tok = engine.tokenizer
    assert tok.decode(ids, skip_special_tokens=False).endswith("<|im_start|>assistant\n```json\n{")
    plain = [m if m["role"] != "assistant" else {**m, "content": "```json\n{"} for m in messages]
    assert ids == tok.encode_chat(plain, add_generation_prompt=False, continue_final_message=True).ids
    whole = _ok(_post(server, "/v1/chat/completions", _chat_body(messages, return_token_ids=True)))
    assert whole["prompt_token_ids"] == ids and whole["usage"]["prompt_tokens"] == len(ids)
    expected = engine.generate(input_ids=ids, sampling_params={"temperature": 0, "max_new_tokens": 8})
    (choice,) = whole["choices"]
    assert choice["message"]["content"] == expected["text"]
    assert choice["token_ids"] == expected["output_ids"]
    assert _streamed_content(server, _chat_body(messages)) == expected["text"]


def test_add_generation_prompt_false_renders_no_assistant_header(server):  # noqa: F811
    messages = [SYSTEM, {"role": "user", "content": "Hi"}]
    ids = _ok(_post(server, "/tokenize", {"messages": messages, "add_generation_prompt": False}))["tokens"]
    body = {"model": MODEL, "messages": messages, "max_tokens": 2, "temperature": 0, "add_generation_prompt": False,
            "return_token_ids": True}
    assert _ok(_post(server, "/v1/chat/completions", body))["prompt_token_ids"] == ids


def test_prefill_is_read_by_the_reasoning_parser_and_not_by_the_tool_call_parser(server, engine):  # noqa: F811
    """A prefill that opens ``<think>``: the whole (tiny-model) answer is reasoning. A prefill that holds a
    tool call: the call is the prompt's, not the answer's (the parsers read the new text only)."""
    state = server.app.state.server
    def ids_of(messages: list[dict], **extra) -> list[int]:
        return _ok(_post(server, "/tokenize", {"messages": messages, **PREFILL, **extra}))["tokens"]

    thinking = _prefilled("<think>\nLet me")
    expected = engine.generate(input_ids=ids_of(thinking), sampling_params={"temperature": 0, "max_new_tokens": 8})
    state.reasoning_parser = ReasoningParser("qwen3")
    try:
        answer = _ok(_post(server, "/v1/chat/completions", _chat_body(thinking)))["choices"][0]["message"]
    finally:
        state.reasoning_parser = None
    assert "</think>" not in expected["text"]
    assert (answer["reasoning_content"], answer["content"]) == (expected["text"].strip(), "")

    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    called = _prefilled('<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>\n')
    expected = engine.generate(input_ids=ids_of(called, tools=[weather]),
                               sampling_params={"temperature": 0, "max_new_tokens": 8})
    answer = _ok(_post(server, "/v1/chat/completions", _chat_body(called, tools=[weather])))["choices"][0]
    assert answer["message"]["content"] == expected["text"] and answer["message"]["tool_calls"] is None
    assert answer["finish_reason"] != "tool_calls"


USER_LAST = [SYSTEM, {"role": "user", "content": "Hi"}]
BAD_PREFILLS = [
    pytest.param({"messages": _prefilled("x"), "continue_final_message": True}, "continue_final_message",
                 id="generation-prompt-by-default"),
    pytest.param({"messages": _prefilled("x"), "continue_final_message": True, "add_generation_prompt": True},
                 "continue_final_message", id="both-true"),
    pytest.param({"messages": USER_LAST, **PREFILL}, "messages", id="last-message-is-the-users"),
    pytest.param({"messages": USER_LAST[:1], **PREFILL}, "messages", id="last-message-is-the-systems"),
    pytest.param({"messages": [*USER_LAST, {"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}], **PREFILL},
                 "messages", id="no-text-to-continue"),
    pytest.param({"messages": _prefilled("x"), "continue_final_message": 1, "add_generation_prompt": False},
                 "continue_final_message", id="int-bool"),
    pytest.param({"messages": _prefilled("x"), "chat_template_kwargs": {"continue_final_message": True}},
                 "chat_template_kwargs", id="as-a-template-variable"),
]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize"])
@pytest.mark.parametrize("body, param", BAD_PREFILLS)
def test_bad_prefills_are_400(server, path, body, param):  # noqa: F811
    if path != "/tokenize":
        body = {"model": MODEL, "max_tokens": 2, **body}
    resp = _post(server, path, body)
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error" and err["message"], err
