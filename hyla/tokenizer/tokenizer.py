"""``Tokenizer``: a model's text <-> token ids: loading, encode/decode, special ids, chat encoding.

``Tokenizer`` wraps a Hugging Face ``tokenizers.Tokenizer`` (``tokenizer.json``, or a tiktoken file
converted: ``tiktoken_bpe.py``) and reads the model directory's ``tokenizer_config.json`` (special
tokens, ``added_tokens_decoder``, ``chat_template``), an optional ``chat_template.jinja`` (which wins
over the config, as in transformers v5) and ``generation_config.json`` (extra end-of-sequence ids).
It reproduces what ``transformers.AutoTokenizer`` does for such a directory, without depending on
transformers.

Invariants
----------
* ``decode(encode(text, add_special_tokens=False)) == text`` for byte-level BPE tokenizers without a
  normalizer (the built-in default model's): every string round-trips exactly.
* ``apply_chat_template`` renders as transformers does (``hyla.tokenizer.chat_template``).
* ``encode_chat`` boundaries are prefix lengths of the returned ids: ``ids[:b]`` is exactly what the
  conversation up to that message tokenizes to, so a prefix cache keyed on token ids may store a
  recurrent-state checkpoint there and a later conversation that shares those messages hits it.
* Bad input (unknown files, wrong message types, a template that rejects the conversation)
  raises ``ValueError``.
"""

from __future__ import annotations

import bisect
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from tokenizers import AddedToken
from tokenizers import Tokenizer as BackendTokenizer

from hyla.tokenizer.chat_template import ChatTemplates, check_messages
from hyla.tokenizer.detokenizer import IncrementalDetokenizer
from hyla.tokenizer.tiktoken_bpe import TIKTOKEN_FILE, is_tiktoken_dir, tiktoken_backend, tiktoken_class
from hyla.tokenizer.token_text import TokenText, TokenTexts

SPECIAL_TOKEN_ATTRIBUTES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
"""The named special tokens of a tokenizer_config.json; chat templates see them as variables."""


def _token_content(value: Any) -> str | None:
    """A special token from tokenizer_config.json: a string, an AddedToken dict, or null."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    raise ValueError(f"cannot read a special token from {value!r}")


def _read_json(path: Path) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return data


@dataclass(frozen=True)
class ChatEncoding:
    """A rendered conversation: ``ids`` and ``boundaries`` (ascending token positions at the end of
    messages, each a prefix length of ``ids`` that the conversation up to that message tokenizes to)."""

    text: str
    ids: list[int]
    boundaries: list[int]


class Tokenizer:
    """A model's tokenizer: ``tokenizers.Tokenizer`` plus the special tokens and chat template."""

    def __init__(
        self,
        backend: BackendTokenizer,
        *,
        special_tokens: Mapping[str, str] | None = None,
        chat_template: Any = None,
        extra_eos_token_ids: Iterable[int] = (),
        sorts_tools: bool = False,
    ) -> None:
        """``special_tokens`` maps names from ``SPECIAL_TOKEN_ATTRIBUTES`` to token strings, each of
        which must be in the vocabulary; ``extra_eos_token_ids`` (from generation_config) are added to
        ``eos_token_ids`` after the ``eos_token``; ``sorts_tools``: the chat template sees ``tools`` with
        their keys sorted, at every depth (what Kimi's remote ``apply_chat_template`` does)."""
        self.backend = backend
        """The ``tokenizers.Tokenizer``: for ``hyla.tokenizer``'s own modules and tests; everything else
        uses the methods below (the server does)."""
        self.sorts_tools = sorts_tools
        self.special_tokens: dict[str, str] = {}
        for name, content in (special_tokens or {}).items():
            if name not in SPECIAL_TOKEN_ATTRIBUTES:
                raise ValueError(f"unknown special token name {name!r}; expected one of {SPECIAL_TOKEN_ATTRIBUTES}")
            if content is not None:
                if backend.token_to_id(content) is None:
                    raise ValueError(f"{name} {content!r} is not in the vocabulary")
                self.special_tokens[name] = content
        self._chat_templates = ChatTemplates(chat_template)
        self._token_texts = TokenTexts(self)
        eos = [self.eos_token_id] if self.eos_token_id is not None else []
        for i in extra_eos_token_ids:
            if not isinstance(i, int) or not 0 <= i < self.vocab_size:
                raise ValueError(f"eos token id {i!r} is outside the vocabulary [0, {self.vocab_size})")
            eos.append(i)
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(eos))
        """Every id that ends a generation: tokenizer_config's eos_token, then generation_config's."""

    # --- loading -------------------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, *, chat_template: str | None = None) -> Tokenizer:
        """Load ``tokenizer.json`` (+ ``tokenizer_config.json``, ``chat_template.jinja``,
        ``generation_config.json`` when present) from a Hugging Face model directory; without a
        ``tokenizer.json``, a ``tiktoken.model`` of a tokenizer class whose split pattern hyla knows
        (``hyla.tokenizer.tiktoken_bpe``: Kimi's). ``chat_template`` (a template's text: the engine's
        ``chat_template`` option, ``read_chat_template``) replaces the directory's templates, its
        ``tool_use`` one included: it renders every conversation, with tools or without."""
        model_dir = Path(model_dir)
        tokenizer_file = model_dir / "tokenizer.json"
        config_file = model_dir / "tokenizer_config.json"
        config = _read_json(config_file) if config_file.is_file() else {}
        sorts_tools = False
        if not has_tokenizer(model_dir):
            raise ValueError(f"{model_dir} has no tokenizer.json (hyla reads the fast-tokenizer format, and "
                             f"{TIKTOKEN_FILE} of the tokenizer classes it knows)")
        if is_tiktoken_dir(model_dir):
            known = tiktoken_class(model_dir, config)
            backend, sorts_tools = tiktoken_backend(model_dir, config, known), known.sorts_tools
        else:
            try:
                backend = BackendTokenizer.from_file(str(tokenizer_file))
            except Exception as e:  # tokenizers raises a bare Exception on malformed files
                raise ValueError(f"cannot read {tokenizer_file}: {e}") from e

        _add_missing_tokens(backend, config)
        special_tokens = {name: _token_content(config.get(name)) for name in SPECIAL_TOKEN_ATTRIBUTES}
        special_tokens = {k: v for k, v in special_tokens.items() if v is not None}

        if chat_template is None:
            chat_template = _directory_chat_template(model_dir, config)

        extra_eos: list[int] = []
        generation_file = model_dir / "generation_config.json"
        if generation_file.is_file():
            value = _read_json(generation_file).get("eos_token_id")
            extra_eos = [value] if isinstance(value, int) else list(value or [])
        return cls(backend, special_tokens=special_tokens, chat_template=chat_template, extra_eos_token_ids=extra_eos,
                   sorts_tools=sorts_tools)

    # --- vocabulary ----------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included (the model's embedding may be larger)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def _special_id(self, name: str) -> int | None:
        content = self.special_tokens.get(name)
        return None if content is None else self.backend.token_to_id(content)

    @property
    def bos_token_id(self) -> int | None:
        return self._special_id("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        return self._special_id("eos_token")

    @property
    def pad_token_id(self) -> int | None:
        return self._special_id("pad_token")

    @property
    def all_special_ids(self) -> list[int]:
        """Ids of added tokens marked special (what ``skip_special_tokens`` drops), ascending."""
        return sorted(i for i, t in self.backend.get_added_tokens_decoder().items() if t.special)

    @cached_property
    def special_id_set(self) -> frozenset[int]:
        """``all_special_ids`` as a set, made once (every request's detokenizer reads it)."""
        return frozenset(self.all_special_ids)

    # --- encode / decode -------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``. Special tokens written in the text (``<|im_start|>``) are matched as
        such. ``add_special_tokens`` applies tokenizer.json's post-processor (e.g. a leading BOS); as
        in transformers v5, ``add_bos_token``/``add_eos_token`` in tokenizer_config.json are ignored."""
        if not isinstance(text, str):
            raise ValueError(f"encode expects a str, got {type(text).__name__}")
        try:  # tokenizers takes Unicode text only: a lone surrogate ("\ud800") would be its TypeError
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(f"the text holds a lone UTF-16 surrogate at character {exc.start}: not valid Unicode "
                             "text") from None
        # encode_batch releases the GIL (encode does not): a long text does not stall other threads
        return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; an incomplete or invalid UTF-8 byte sequence decodes to U+FFFD. Ids at or
        above ``vocab_size`` (a model's embedding is often padded beyond the tokenizer's vocabulary,
        and an untrained row can still be sampled) decode to nothing, as in transformers."""
        ids = list(ids)
        bad = [i for i in ids if not isinstance(i, int) or i < 0]
        if bad:
            raise ValueError(f"token ids must be non-negative ints, got {bad[:5]}")
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def detokenizer(self, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True) -> IncrementalDetokenizer:
        """A fresh streaming detokenizer for one output sequence (see ``IncrementalDetokenizer``)."""
        return IncrementalDetokenizer(self, prompt_ids=prompt_ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> TokenText:
        """What ``token_id`` shows as in logprobs: ``(text, bytes)``, see ``hyla.tokenizer.token_text``."""
        return self._token_texts(token_id)

    # --- chat --------------------------------------------------------------------------------------

    @property
    def chat_template(self) -> str | None:
        """The default chat template's source text (None without one)."""
        return self.chat_template_for(None)

    def chat_template_for(self, tools: Any) -> str | None:
        """The source text of the chat template ``apply_chat_template`` renders with these ``tools`` (with
        tools, ``tool_use`` where the tokenizer names one, else the default; None without one)."""
        template = self._chat_templates.select(tools)
        return None if template is None else template.source

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        *,
        continue_final_message: bool = False,
        **template_kwargs: Any,
    ) -> str:
        """Render a conversation as the prompt text. Encode the result with ``add_special_tokens=False``
        (the template writes its own BOS), or use ``encode_chat``, which does so.

        ``continue_final_message`` (transformers'; needs ``add_generation_prompt=False``): the prompt
        ends inside the final message, right after its content, for the model to continue it (an
        assistant message prefilled with the start of the answer). See ``_tag_final_message``.

        A template that never names the ``developer`` role (OpenAI's newer name for ``system``, sent
        by current SDKs) sees ``developer`` messages as ``system`` messages."""
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt are not compatible: continue the final "
                             "message, or start a new assistant message after it")
        template = self._chat_templates.select(tools)
        if template is None:
            raise ValueError("this tokenizer has no chat_template (tokenizer_config.json or chat_template.jinja)")
        if "developer" not in template.source:
            messages = _developer_as_system(messages)
        variables = {**self.special_tokens, **template_kwargs}  # explicit kwargs win, as in transformers
        if self.sorts_tools and tools:
            tools = _sorted_keys(tools)
        if not continue_final_message:
            return template.render(messages, add_generation_prompt=add_generation_prompt, tools=tools, **variables)
        messages, final_text = _tag_final_message(messages, template.source)
        rendered = template.render(messages, add_generation_prompt=False, tools=tools, **variables)
        return _cut_at_tag(rendered, final_text)

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        *,
        continue_final_message: bool = False,
        max_boundaries: int | None = None,
        **template_kwargs: Any,
    ) -> ChatEncoding:
        """Render and tokenize a conversation, with the token position at the end of each message.

        Only the template's own markup yields special tokens: special-token text inside the messages
        (a user typing ``<|im_end|><|im_start|>system``) is encoded as text, as transformers'
        ``encode(..., split_special_tokens=True)`` encodes it, so a message cannot forge a turn.

        A message's boundary is ``len(encode_chat(messages[:i + 1], add_generation_prompt=False).ids)``;
        it is kept only if those ids are a prefix of ``ids`` (a template may render earlier turns
        differently once more follow, or a tokenizer may merge across the message end) and dropped
        otherwise. Boundaries are strictly ascending and > 0; with ``add_generation_prompt=False``
        the last one may equal ``len(ids)``. ``max_boundaries`` bounds the work (each boundary
        renders the conversation up to it): only the first message's and the last
        ``max_boundaries - 1`` messages' boundaries are computed. With ``continue_final_message``
        (``apply_chat_template``'s) the prompt ends inside the final message: that message's
        boundary, the conversation with it closed, is no prefix of it and is dropped (unless the
        template writes nothing after a message's content).

        Cost: the prefixes are not re-tokenized from the start. ``tokenizers`` first splits the text
        at added tokens that are matched verbatim (not normalized, no lstrip/rstrip/single_word)
        and tokenizes the pieces between them independently, so a prefix's ids are the full
        encoding's ids up to its last such token (``<|im_end|>``) followed by the encoding of the
        text after it; only that tail is encoded. Without such a token the whole prefix is encoded.
        """
        as_text = _SpecialTextAsText.of(self, messages)
        if as_text is not None:
            messages = as_text.messages
        text = self.apply_chat_template(messages, add_generation_prompt, tools,
                                        continue_final_message=continue_final_message, **template_kwargs)
        if as_text is None:
            encoding = self.backend.encode_batch([text], add_special_tokens=False)[0]
            ids = encoding.ids
            split_ends, split_counts = self._hard_splits(encoding)
        else:
            ids = as_text.encode(text)
        boundaries: list[int] = []
        for end in _boundary_ends(len(messages), max_boundaries):
            try:
                prefix_text = self.apply_chat_template(messages[:end], False, tools, **template_kwargs)
            except ValueError:  # e.g. a template that insists the conversation ends with a user turn
                continue
            if not text.startswith(prefix_text):
                continue
            if as_text is None:
                # the last hard split at or before the prefix end: ids before it are shared for sure
                j = bisect.bisect_right(split_ends, len(prefix_text))
                start, num_shared = (split_ends[j - 1], split_counts[j - 1]) if j else (0, 0)
                tail = self.encode(prefix_text[start:], add_special_tokens=False)
            else:
                num_shared, tail = 0, as_text.encode(prefix_text)
            n = num_shared + len(tail)
            if n > (boundaries[-1] if boundaries else 0) and ids[num_shared:n] == tail:
                boundaries.append(n)
        return ChatEncoding(text=text if as_text is None else as_text.restore(text), ids=ids, boundaries=boundaries)

    def _hard_splits(self, encoding: Any) -> tuple[list[int], list[int]]:
        """Character end and number of ids up to it, for each verbatim-matched added token."""
        hard = {
            i for i, t in self.backend.get_added_tokens_decoder().items()
            if not (t.normalized or t.lstrip or t.rstrip or t.single_word)
        }
        ends, counts = [], []
        for k, (token_id, (_, end)) in enumerate(zip(encoding.ids, encoding.offsets)):
            if token_id in hard:
                ends.append(end)
                counts.append(k + 1)
        return ends, counts

    def is_special_token(self, text: str) -> bool:
        """Whether ``text`` is the text of one added token marked special (one that decoding with
        ``skip_special_tokens`` drops)."""
        return text in self._special_texts[1].values()

    @cached_property
    def _special_texts(self) -> tuple[list[str], dict[int, str], re.Pattern[str] | None]:
        """The special added tokens' texts, ids → text, and a pattern matching any of them."""
        by_id = {i: t.content for i, t in self.backend.get_added_tokens_decoder().items() if t.special}
        texts = sorted(set(by_id.values()), key=len, reverse=True)  # longest first: the regex takes the first
        return texts, by_id, re.compile("|".join(map(re.escape, texts))) if texts else None

    @cached_property
    def _text_only_backend(self) -> BackendTokenizer:
        """A copy of the backend that encodes special-token text as text (``split_special_tokens``)."""
        backend = BackendTokenizer.from_str(self.backend.to_str())
        backend.encode_special_tokens = True
        return backend

    def chat_message_boundaries(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> list[int]:
        """Token positions at the end of each message in the rendered prompt (see ``encode_chat``)."""
        return self.encode_chat(messages, add_generation_prompt, tools, **template_kwargs).boundaries


CONTINUE_FINAL_MESSAGE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
"""What ``continue_final_message`` appends to the final message's text to find its end in the
rendered prompt (transformers' tag, so that the same templates cut at the same place)."""


def _tag_final_message(messages: Any, template_source: str) -> tuple[list[dict[str, Any]], str]:
    """The messages (checked, ``check_messages``' plain copies) with ``CONTINUE_FINAL_MESSAGE_TAG``
    appended to the final message's text, and that text untagged (transformers' rules: the
    ``content`` string, or, for a list of parts, the last part's ``text``). ``ValueError`` when the
    final message has no such text, or the template never reads ``content``."""
    chat = check_messages(messages)
    final = chat[-1]
    if "content" not in final:
        raise ValueError('continue_final_message is set but the final message has no "content" to continue')
    if "content" not in template_source:
        raise ValueError('continue_final_message is set but the chat template never reads a message\'s "content"')
    content = final["content"]
    if isinstance(content, str):
        chat[-1] = {**final, "content": content + CONTINUE_FINAL_MESSAGE_TAG}
        return chat, content
    if isinstance(content, list):
        for i in reversed(range(len(content))):
            part = content[i]
            if isinstance(part, Mapping) and "text" in part:  # the last part with text
                if not isinstance(part["text"], str):
                    raise ValueError("continue_final_message is set but the final message's last text part is not "
                                     "a string")
                parts = list(content)
                parts[i] = {**part, "text": part["text"] + CONTINUE_FINAL_MESSAGE_TAG}
                chat[-1] = {**final, "content": parts}
                return chat, part["text"]
    raise ValueError("continue_final_message is set but there is no text to continue in the final message")


def _cut_at_tag(rendered: str, final_text: str) -> str:
    """``rendered`` (a conversation whose final message carries ``CONTINUE_FINAL_MESSAGE_TAG``) cut
    where the tag starts, as transformers cuts it: where the template kept the tag's trailing space,
    exactly there; where it stripped it (and so maybe the message's own trailing whitespace), with
    the whitespace before the tag stripped too. ``ValueError`` when the template dropped the
    message's text or the tag."""
    tag = CONTINUE_FINAL_MESSAGE_TAG.strip()
    if final_text.strip() not in rendered or tag not in rendered:
        raise ValueError("continue_final_message is set but the final message does not appear in the chat after "
                         "applying the chat template (the template deletes part of it), so it cannot be continued")
    at = rendered.rindex(tag)
    if rendered.startswith(CONTINUE_FINAL_MESSAGE_TAG, at):
        return rendered[:at]
    return rendered[:at].rstrip()


def _boundary_ends(num_messages: int, max_boundaries: int | None) -> list[int]:
    """Message counts whose end gets a boundary: all, or the first and the last ``max - 1``."""
    ends = list(range(1, num_messages + 1))
    if max_boundaries is None or len(ends) <= max_boundaries:
        return ends
    return ends[:1] + ends[len(ends) - (max_boundaries - 1):] if max_boundaries > 1 else ends[:max_boundaries]


class _SpecialTextAsText:
    """Special-token text inside a conversation's messages, kept as text.

    Before rendering, every occurrence in a message string (any field but ``role``) is replaced by a
    placeholder ``M<k>M``, ``M`` a private-use character that appears in no message and ``k`` the
    text's index, so the special-token text of the rendered prompt is the template's own markup.
    ``encode`` splits the rendered prompt where ``tokenizers`` matches that markup, keeps those
    special tokens, and encodes the text between them, placeholders turned back into the text they
    stand for, with special-token matching off (the pieces between added tokens are tokenized
    independently either way).
    """

    def __init__(self, tokenizer: Tokenizer, messages: list[Any], marker: str, texts: list[str]) -> None:
        self.tokenizer, self.messages, self.texts = tokenizer, messages, texts
        self._placeholder = re.compile(re.escape(marker) + r"(\d+)" + re.escape(marker))

    @classmethod
    def of(cls, tokenizer: Tokenizer, messages: Any) -> _SpecialTextAsText | None:
        """None when no message string holds special-token text (the common case: plain encoding)."""
        texts, _, pattern = tokenizer._special_texts
        if pattern is None or isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
            return None
        strings = [s for m in messages if isinstance(m, Mapping) for k, v in m.items() if k != "role"
                   for s in _strings(v)]
        if not any(pattern.search(s) for s in strings):
            return None
        marker = next(chr(c) for c in range(0xE000, 0xF900) if not any(chr(c) in s for s in strings))
        index = {t: i for i, t in enumerate(texts)}

        def protect(value: Any) -> Any:
            if isinstance(value, str):
                return pattern.sub(lambda m: f"{marker}{index[m.group(0)]}{marker}", value)
            if isinstance(value, Mapping):
                return {k: protect(v) for k, v in value.items()}
            if isinstance(value, (list, tuple)):
                return [protect(v) for v in value]
            return value

        protected = [{k: v if k == "role" else protect(v) for k, v in m.items()} if isinstance(m, Mapping) else m
                     for m in messages]
        return cls(tokenizer, protected, marker, texts)

    def restore(self, text: str) -> str:
        return self._placeholder.sub(lambda m: self.texts[int(m.group(1))], text)

    def encode(self, rendered: str) -> list[int]:
        tok = self.tokenizer
        _, special_ids, _ = tok._special_texts
        text_only = tok._text_only_backend
        encoding = tok.backend.encode_batch([rendered], add_special_tokens=False)[0]
        ids: list[int] = []
        pos = 0
        for token_id, (start, end) in zip(encoding.ids, encoding.offsets):
            if token_id in special_ids:  # the template's markup (the messages' is a placeholder now)
                if start > pos:
                    ids += text_only.encode_batch([self.restore(rendered[pos:start])], add_special_tokens=False)[0].ids
                ids.append(token_id)
                pos = end
        if pos < len(rendered):
            ids += text_only.encode_batch([self.restore(rendered[pos:])], add_special_tokens=False)[0].ids
        return ids


def _strings(value: Any) -> Iterable[str]:
    """Every string inside a JSON value (keys excluded)."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, Mapping):
        for v in value.values():
            yield from _strings(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _strings(v)


def _developer_as_system(messages: Any) -> Any:
    """``messages`` with each ``developer`` message's role set to ``system`` (anything that is not a
    list of dicts is left for the template's own checks to refuse)."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        return messages
    return [{**m, "role": "system"} if isinstance(m, Mapping) and m.get("role") == "developer" else m for m in messages]


def _directory_chat_template(model_dir: Path, config: Mapping[str, Any]) -> Any:
    """A model directory's chat template(s): ``chat_template.jinja`` where it has one, else
    tokenizer_config.json's ``chat_template`` (a string, a list of named ones, or None)."""
    template_file = model_dir / "chat_template.jinja"
    if template_file.is_file():
        return template_file.read_text(encoding="utf-8")
    return config.get("chat_template")


def has_tokenizer(model_dir: Path) -> bool:
    """Whether ``model_dir`` holds a tokenizer ``Tokenizer.from_pretrained`` reads: ``tokenizer.json``, or a
    tiktoken file (whose class it may still not know: a ``ValueError`` there)."""
    return (model_dir / "tokenizer.json").is_file() or (model_dir / TIKTOKEN_FILE).is_file()


def _sorted_keys(value: Any) -> Any:
    """``value`` with the keys of every mapping in it sorted (lists keep their order); ``ValueError`` for
    one nested past Python's recursion limit."""
    def walk(v: Any) -> Any:
        if isinstance(v, Mapping):
            return {k: walk(v[k]) for k in sorted(v)}
        if isinstance(v, (list, tuple)):
            return [walk(x) for x in v]
        return v
    try:
        return walk(value)
    except RecursionError as exc:
        raise ValueError("tools are nested too deeply") from exc
    except TypeError as exc:  # keys of mixed types
        raise ValueError(f"cannot sort the keys of tools: {exc}") from exc


def _add_missing_tokens(backend: BackendTokenizer, config: Mapping[str, Any]) -> None:
    """Register tokens listed in tokenizer_config's ``added_tokens_decoder`` that tokenizer.json lacks."""
    decoder = config.get("added_tokens_decoder") or {}
    if not isinstance(decoder, Mapping):
        raise ValueError("tokenizer_config.json: added_tokens_decoder must be an object")
    for index in sorted(decoder, key=int):
        spec = decoder[index]
        if not isinstance(spec, Mapping):
            raise ValueError(f"tokenizer_config.json: added_tokens_decoder[{index}] must be an object")
        content = _token_content(spec)
        if content is None or backend.token_to_id(content) is not None:
            continue
        token = AddedToken(
            content,
            single_word=spec.get("single_word", False),
            lstrip=spec.get("lstrip", False),
            rstrip=spec.get("rstrip", False),
            normalized=spec.get("normalized", not spec.get("special", False)),
            special=spec.get("special", False),
        )
        backend.add_special_tokens([token]) if token.special else backend.add_tokens([token])
        if backend.token_to_id(content) != int(index):
            raise ValueError(f"added token {content!r} was listed as id {index} but got id {backend.token_to_id(content)}")
