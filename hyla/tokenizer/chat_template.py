"""Chat templates: a model's jinja2 template, compiled once in a sandbox, rendering a conversation.

Chat templates come from model hubs: untrusted code. ``ChatTemplate`` compiles one in the same
sandboxed jinja2 environment as transformers (``trim_blocks``, ``lstrip_blocks``, ``loopcontrols``,
``raise_exception``, ``tojson``, ``strftime_now``, ``{% generation %}``), so for the same
messages it renders the same string; templates see JSON values only (no objects with methods),
and ``namespace()`` refuses underscore attributes.

Bad input (wrong message types, malformed ``tool_calls``, values nested deeper than
``MAX_NESTING_DEPTH``, a template that does not compile, that rejects the conversation or that
fails on it) raises ``ValueError``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import cached_property
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (transformers' assistant-mask tag): renders its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render", []), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


class _TemplateNamespace(jinja2.utils.Namespace):
    """jinja2's ``namespace()`` without underscore attributes (no way to reach Python internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # same signature trick as jinja2.utils.Namespace
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set underscore attributes ({name!r})")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False) -> str:
    # jinja2's own tojson escapes HTML characters; chat templates expect plain json.dumps.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


JSON_SCALARS = frozenset((str, int, float, bool, type(None)))
"""The types of JSON's scalar values as ``json.loads`` makes them (subclasses are not among them)."""

MAX_NESTING_DEPTH = 64
"""Messages, tools, documents and template variables may nest lists and objects this deep (a
message object is one level, its ``tool_calls`` list two, ...); deeper is a ``ValueError``. Real
conversations and tool schemas stay far below it; the bound keeps every walk over them (the copy
below, the template, JSON encoding) far from Python's recursion limit."""


def _nests_too_deep(value: Any) -> bool:
    """Whether ``value`` nests lists and objects deeper than ``MAX_NESTING_DEPTH``: one pass, only
    lists and objects on the stack (a list of millions of numbers costs a check each, not a tuple
    and a path each: 12.6 s of a server's event loop for 5 million that way). Iterative."""
    stack = [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, Mapping):
            item = item.values()
        elif not isinstance(item, (list, tuple)):
            continue
        if level > MAX_NESTING_DEPTH:
            return True
        if not set(map(type, item)) <= JSON_SCALARS:  # (a list of numbers or strings: one pass in C)
            stack.extend((v, level + 1) for v in item if isinstance(v, (Mapping, list, tuple)))
    return False


def check_nesting(value: Any, where: str) -> None:
    """``ValueError`` naming the spot when ``value`` nests lists and objects deeper than
    ``MAX_NESTING_DEPTH``. Iterative: the value may nest arbitrarily deep. The spot is looked for
    only once a cheap pass found one (:func:`_nests_too_deep`)."""
    if not _nests_too_deep(value):
        return
    # (value, its level, its path as a linked list of (key or index, is_index, parent))
    stack: list[tuple[Any, int, Any]] = [(value, 1, None)]
    while stack:
        item, level, path = stack.pop()
        if isinstance(item, Mapping):
            children: Any = ((v, (k, False, path)) for k, v in item.items())
        elif isinstance(item, (list, tuple)):
            children = ((v, (i, True, path)) for i, v in enumerate(item))
        else:
            continue
        if level > MAX_NESTING_DEPTH:
            parts = []
            while path is not None:
                key, is_index, path = path
                parts.append(f"[{key}]" if is_index else f".{key}")
            parts.reverse()
            shown = where + "".join(parts[:3]) + ("..." if len(parts) > 3 else "")
            raise ValueError(f"{shown} nests lists and objects more than {MAX_NESTING_DEPTH} levels deep")
        stack.extend((v, level + 1, at) for v, at in children)


def _plain(value: Any, where: str, level: int = 1) -> Any:
    """A copy of ``value`` made of JSON types only: templates never see objects with methods.
    ``ValueError`` past ``MAX_NESTING_DEPTH`` levels of lists and objects (so the copy's recursion
    stays shallow; ``check_nesting`` names the spot, for the server's requests)."""
    if type(value) in JSON_SCALARS:
        return value
    if isinstance(value, (Mapping, list, tuple)) and level > MAX_NESTING_DEPTH:
        raise ValueError(f"{where} nests lists and objects more than {MAX_NESTING_DEPTH} levels deep")
    if isinstance(value, Mapping):
        return {str(k): _plain(v, where, level + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v, where, level + 1) for v in value]
    for base in (bool, str, int, float):  # subclasses (str enums, numpy floats): strip to the base type
        if isinstance(value, base):
            return base(value) if base is not str else str.__str__(value)
    raise ValueError(f"{where}: {type(value).__name__} is not a JSON value")


def _check_tool_calls(calls: Any, where: str) -> None:
    """An assistant message's ``tool_calls`` as OpenAI's API takes them: a list of
    ``{"id"?: str, "type"?: "function", "function": {"name": str, "arguments": str}}``, where
    ``arguments`` may also be an object (transformers' convention, which templates read too)."""
    if not isinstance(calls, list):
        raise ValueError(f"{where}.tool_calls must be a list of tool calls, got {type(calls).__name__}")
    for j, call in enumerate(calls):
        at = f"{where}.tool_calls[{j}]"
        if not isinstance(call, Mapping):
            raise ValueError(f"{at} must be an object with a 'function', got {type(call).__name__}")
        if call.get("id") is not None and not isinstance(call["id"], str):
            raise ValueError(f"{at}.id must be a string, got {type(call['id']).__name__}")
        if call.get("type") is not None and call["type"] != "function":
            raise ValueError(f"{at}.type must be 'function', got {call['type']!r}")
        fn = call.get("function")
        if not isinstance(fn, Mapping):
            got = "none" if fn is None else type(fn).__name__
            raise ValueError(f"{at}.function must be an object with 'name' and 'arguments', got {got}")
        if not isinstance(fn.get("name"), str):
            got = "none" if fn.get("name") is None else type(fn["name"]).__name__
            raise ValueError(f"{at}.function.name must be a string, got {got}")
        if not isinstance(fn.get("arguments"), (str, Mapping)):
            got = "none" if fn.get("arguments") is None else type(fn["arguments"]).__name__
            raise ValueError(f"{at}.function.arguments must be a string (the arguments as JSON text) or an "
                             f"object, got {got}")


def check_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Validate chat messages and return plain copies without ``None`` fields (as transformers does:
    OpenAI clients send ``content=None`` next to ``tool_calls``, and templates test for a missing key).
    ``tool_calls`` must be well formed (``_check_tool_calls``): templates index into them. A message's
    reasoning (the first of ``REASONING_FIELDS`` it has) is also its ``reasoning_content`` and, unless set,
    its ``thinking``, as transformers passes it."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or len(messages) == 0:
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ValueError(f"messages[{i}] must be a dict, got {type(message).__name__}")
        if not isinstance(message.get("role"), str):
            raise ValueError(f"messages[{i}] needs a string 'role'")
        plain = {k: v for k, v in _plain(message, f"messages[{i}]").items() if v is not None}
        if "tool_calls" in plain:
            _check_tool_calls(plain["tool_calls"], f"messages[{i}]")
        reasoning = next((plain[key] for key in REASONING_FIELDS if key in plain), None)
        if reasoning is not None:  # (transformers' _alias_reasoning_fields: a template reads one of the names)
            plain = {"thinking": reasoning, **plain, "reasoning_content": reasoning}
        out.append(plain)
    return out


# the names a message's reasoning comes under (vLLM's and OpenRouter's ``reasoning``, gpt-oss templates'
# ``thinking``), the first the one chat templates read: it and ``thinking`` filled from the first set, as
# transformers' _alias_reasoning_fields does
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _text_parts(content: Any) -> bool:
    """Whether a message's ``content`` is a list of ``{"type": "text", "text": str}`` parts only."""
    return isinstance(content, list) and all(
        isinstance(p, Mapping) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content)


class ChatTemplate:
    """One chat template; ``source`` is its text. It is compiled in the sandbox on first use and
    then reused (a model whose template does not compile still serves plain completions)."""

    def __init__(self, source: str) -> None:
        if not isinstance(source, str):
            raise ValueError(f"a chat template must be a string, got {type(source).__name__}")
        self.source = source

    @cached_property
    def _compiled(self) -> jinja2.Template:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        env.globals["namespace"] = _TemplateNamespace
        try:
            return env.from_string(self.source)
        except jinja2.exceptions.TemplateSyntaxError as e:
            raise ValueError(f"chat template does not compile: {e}") from e

    @cached_property
    def reads_content_parts(self) -> bool:
        """Whether the template loops over a message's ``content`` (``{% for part in message.content %}``, or
        over a variable or macro argument named ``content``): it renders a list of parts itself. vLLM's
        detection of the "openai" content format, by the template's syntax tree."""
        tree = self._compiled.environment.parse(self.source)

        def names_content(node: jinja2.nodes.Node) -> bool:
            if isinstance(node, jinja2.nodes.Name):
                return node.name == "content"
            if isinstance(node, jinja2.nodes.Getattr):
                return node.attr == "content"
            if isinstance(node, jinja2.nodes.Getitem):
                return isinstance(node.arg, jinja2.nodes.Const) and node.arg.value == "content"
            if isinstance(node, jinja2.nodes.Filter):  # (``message.content | list``, ``... | selectattr(...)``)
                return node.node is not None and names_content(node.node)
            return False

        return any(names_content(loop.iter) for loop in tree.find_all(jinja2.nodes.For))

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> str:
        """Render ``messages`` (the same result as transformers; but a content of text parts, for a template that
        does not loop over parts, is their texts joined a line each, as vLLM passes it). ``template_kwargs`` become template
        variables (special tokens such as ``bos_token``, or switches such as ``enable_thinking``). A
        template that calls ``raise_exception``, or that fails on the values it is given (a
        ``TypeError`` adding a number to a string, ...), raises ``ValueError``."""
        chat = check_messages(messages)
        if not self.reads_content_parts:  # its text parts as one string, a line each (vLLM's "string" format)
            chat = [{**m, "content": "\n".join(p["text"] for p in m["content"])} if _text_parts(m.get("content"))
                    else m for m in chat]
        if tools is not None and (isinstance(tools, (str, bytes, Mapping)) or not isinstance(tools, Sequence)
                                  or not all(isinstance(t, Mapping) for t in tools)):
            raise ValueError("tools must be a list of JSON-schema dicts")
        variables = dict(tools=_plain(tools, "tools"), documents=_plain(documents, "documents"),
                         add_generation_prompt=add_generation_prompt, **_plain(template_kwargs, "template_kwargs"))
        compiled = self._compiled
        try:
            return compiled.render(messages=chat, **variables)
        except jinja2.exceptions.TemplateError as e:
            raise ValueError(f"chat template rejected the conversation: {e}") from e
        except Exception as e:  # the template's code failed on these values: they are not what it expects
            raise ValueError(f"chat template could not render the messages ({type(e).__name__}: {e})") from e


def render_chat_template(template: str, messages: Sequence[Mapping[str, Any]], **kwargs: Any) -> str:
    """Compile ``template`` and render ``messages`` once (``ChatTemplate.render``'s keywords)."""
    return ChatTemplate(template).render(messages, **kwargs)


JINJA_MARKERS = ("{%", "{{")
"""A ``chat_template`` option holding one of these (and naming no file) is the template's text itself."""


def read_chat_template(value: str | os.PathLike, option: str = "chat_template") -> str:
    """The template a ``chat_template`` option gives (vLLM's and SGLang's ``--chat-template``): the UTF-8
    text of the file ``value`` names where one exists, else ``value`` itself where it is a string holding
    Jinja markup (``{%`` or ``{{``: the template's text given inline, as vLLM takes it). The template is
    compiled here, so that a bad one fails at start-up rather than at the first chat request.
    ``ValueError`` naming ``option`` for anything else: a file that does not exist (or is no file), one
    that is not UTF-8 or cannot be read, a template that does not compile."""
    name = os.fspath(value) if isinstance(value, (str, os.PathLike)) else None
    if not isinstance(name, str) or not name:
        raise ValueError(f"{option} must be a path to a Jinja file or a template's text, got {value!r:.80}")
    if os.path.isfile(name):  # (False, not an error, for a text too long or odd to be a path)
        try:
            with open(name, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"{option}: cannot read {name!r} as UTF-8 text: {exc}") from exc
    elif isinstance(value, str) and any(marker in value for marker in JINJA_MARKERS):
        text = value
    else:
        what = "is a directory, not a file" if os.path.isdir(name) else "does not exist"
        raise ValueError(f"{option}: file {name!r:.200} {what} (a template's text given inline must hold Jinja markup: "
                         f"'{{%' or '{{{{')")
    try:
        _ = ChatTemplate(text)._compiled
    except ValueError as exc:
        raise ValueError(f"{option} {name!r:.80}: {exc}") from None
    return text


class ChatTemplates:
    """tokenizer_config's ``chat_template``: one string, or a list of ``{"name", "template"}``; with
    tools the ``tool_use`` template is taken when there is one, else ``default``."""

    def __init__(self, value: Any) -> None:
        if value is None:
            self._named: dict[Any, ChatTemplate] = {}
        elif isinstance(value, str):
            self._named = {"default": ChatTemplate(value)}
        elif isinstance(value, list):
            named = {t.get("name"): t.get("template") for t in value if isinstance(t, Mapping)}
            self._named = {name: ChatTemplate(source) for name, source in named.items()
                           if name in ("default", "tool_use") and source is not None}
        else:
            raise ValueError(f"chat_template must be a string or a list of named templates, got {type(value).__name__}")

    def select(self, tools: Any) -> ChatTemplate | None:
        if tools and "tool_use" in self._named:
            return self._named["tool_use"]
        return self._named.get("default")
