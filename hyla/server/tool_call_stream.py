"""Tool calls read as the model's text streams in: the deltas of OpenAI's streamed ``tool_calls``.

One idea: a ``ToolCallStream`` takes an output's text chunk by chunk and gives back what a stream sends
for it, content deltas and ``ToolCallDelta`` s, such that, joined, they are what
``ToolCallParser.parse`` makes of the whole text, however the text was cut.

Text that cannot be part of a call block is passed on at once (but the whitespace ``ContentLayout``
holds). A call block (``tool_calls.SYNTAXES``) is sent in one of two ways:

* **whole** (the default; the Responses API's stream): a block is held until it closes (its end
  marker, or the output's end), then sent as whole calls (or as content when it holds none);
* **incremental** (``incremental=True``; chat completions, as vLLM and SGLang stream calls): a call's
  id and name go out as soon as they are written, then its arguments as the model writes them, a
  delta at a time (an agent writing a file in a call shows it coming). An *echo* of the syntax
  (``_JsonEcho``, ``_KimiEcho``, ``_XmlEcho``) follows the open block; when the block closes, the
  whole parse of it decides, and the deltas sent are always the start of its calls: the rest of each
  call's arguments, and any call the echo did not begin, go out then. ``lfm2``'s Python calls, and a
  call whose name does not come first, are sent whole at the block's end.

  A block that turns out to be no call after a call of it was begun (cut off by ``max_tokens``
  inside its arguments, or not what it began as) cannot be taken back: the calls begun end with the
  arguments sent, and the rest of the block is dropped. That is the one place where the stream and
  the whole answer differ (the whole answer keeps a malformed block as content); OpenAI's own
  stream, cut off by the length limit, ends the same way, its arguments unfinished.

Every step is linear in the text: a held block is kept as its pieces, searched for the end marker
piece by piece (with the marker's length less one of what came before it), and an echo looks at
each character a bounded number of times (a long call costs time linear in its length).
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

from hyla.server.reasoning import Stripped, partial_suffix
from hyla.server.tool_calls import (_JSON_WHITESPACE, _KIMI_ARGS, _KIMI_CALL, _KIMI_END, _KIMI_ID, ToolCall,
                                    ToolCallParser, _allows_string, _is_text, _json_text, _parameters, new_call_id,
                                    xml_argument)


@dataclass
class ToolCallDelta:
    """A piece of a streamed call: the call's first delta has its ``id`` and ``name``; each delta
    has more of its ``arguments``' JSON text (OpenAI clients join them by ``index``)."""
    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None

    def openai(self) -> dict[str, Any]:
        if self.name is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        return {"index": self.index, "id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


class ToolCallStream:
    """Streamed text in, ``(content_delta, call_deltas)`` out (see the module's docstring); ``calls``:
    the output's calls so far, whole (those of closed blocks, and those an incremental stream began)."""

    def __init__(self, parser: ToolCallParser, tools: list[dict[str, Any]] | None = None,
                 incremental: bool = False):
        self.parser = parser
        self.tools = tools
        self.incremental = incremental
        self.buffer = ""
        self.calls: list[ToolCall] = []
        self.layout = ContentLayout()
        self.open: list[str] = []  # the pieces of a block whose end marker has not come (buffer empty meanwhile)
        self.open_tail = ""  # their last characters, one fewer than the end marker's: where it may begin
        self.echo: _Echo | None = None  # the open block's echo (incremental)
        self.echo_seen = 0  # how much of the open block's body the echo has been fed
        self.echo_held = ""  # what may be the start of the block's end marker: not fed to the echo yet

    def feed(self, text: str, final: bool = False) -> tuple[str, list[ToolCallDelta]]:
        """The output's next ``text`` (``final``: its last): ``(content delta, call deltas)`` to send for it."""
        pieces = self.feed_in_order(text, final)
        return "".join(p for p in pieces if isinstance(p, str)), [p for p in pieces if isinstance(p, ToolCallDelta)]

    def feed_in_order(self, text: str, final: bool = False) -> list[str | ToolCallDelta]:
        """``feed``'s content and call deltas in the output's order (a chunk may hold text, a whole call and
        more text: what an Anthropic stream's blocks, or a Responses stream's items, follow). Each run of
        one call's deltas is one (``_merged``)."""
        end = self.parser.end
        if self.open:
            seen = self.open_tail + text
            if end not in seen and not final:
                self.open.append(text)
                self.open_tail = _last(seen, len(end) - 1)
                return _merged(self._echoed(text))
            text, self.open = "".join(self.open) + text, []
        self.buffer += text
        out: list[str | ToolCallDelta] = []
        start = self.parser.start
        while self.buffer:
            i = self.buffer.find(start)
            if i < 0:
                keep = 0 if final else partial_suffix(self.buffer, start)
                out.append(self.layout.text(self.buffer[:len(self.buffer) - keep], bool(self.calls)))
                self.buffer = self.buffer[len(self.buffer) - keep:]
                break
            out.append(self.layout.text(self.buffer[:i], bool(self.calls)))
            self.buffer = self.buffer[i:]
            j = self.buffer.find(end)
            if j < 0 and not final:  # (held as pieces until its end comes)
                self.open, self.open_tail = [self.buffer], _last(self.buffer, len(end) - 1)
                self.echo = _echo_of(self.parser, self.tools) if self.incremental else None
                self.echo_seen, self.echo_held = 0, ""
                out += self._echoed(self.buffer[len(start):])
                self.buffer = ""
                break
            # a block ends with its end marker, or with the output (a stop string such as the end
            # marker itself cut it off: still a call when its body is one)
            body_end = j if j >= 0 else len(self.buffer)
            block = self.buffer[:body_end + (len(end) if j >= 0 else 0)]
            self.buffer = self.buffer[len(block):]
            content, sent = self._close(block, block[len(start):body_end])
            out.append(self.layout.text(content, bool(self.calls)) if content else "")
            out += sent
        if final:
            out.append(self.layout.end(bool(self.calls)))
        return _merged([p for p in out if p != ""])

    def _echoed(self, text: str) -> list[ToolCallDelta]:
        """The deltas the open block's echo makes of more of its body, ``text``. What may be the start
        of the end marker is held: the echo sees only the body."""
        if self.echo is None:
            return []
        text = self.echo_held + text
        keep = partial_suffix(text, self.parser.end)
        self.echo_held = text[len(text) - keep:]
        return self._echo_feed(self.echo, text[:len(text) - keep])

    def _echo_feed(self, echo: _Echo, text: str) -> list[ToolCallDelta]:
        """``echo``'s deltas for more of the body, numbered after the calls before the block."""
        self.echo_seen += len(text)
        return [ToolCallDelta(len(self.calls) + d.index, d.arguments, d.id, d.name) for d in echo.feed(text)]

    def _close(self, block: str, body: str) -> tuple[str, list[ToolCallDelta]]:
        """A block closed: ``(content, deltas)`` for it. Incremental, the echo reads the rest of the body
        first (an echo that saw the whole body, however it came, began the same calls). The whole parse's
        calls finish those the echo began, where they go on from what it sent; the block is content where
        it holds no call and none was begun; else the begun calls end as sent (the module's docstring)."""
        echo, self.echo = self.echo, None
        if self.incremental and echo is None:
            echo, self.echo_seen = _echo_of(self.parser, self.tools), 0
        deltas = self._echo_feed(echo, body[self.echo_seen:]) if echo is not None else []
        begun = echo.begun if echo is not None else []
        found = self.parser.calls_of(body, self.tools)
        base = len(self.calls)
        if found is not None and _goes_on(found, begun):
            for k, call in enumerate(found):
                if k < len(begun):
                    call.id, sent = begun[k].id, begun[k].sent()
                    if len(call.arguments) > len(sent):
                        deltas.append(ToolCallDelta(base + k, call.arguments[len(sent):]))
                else:
                    deltas.append(ToolCallDelta(base + k, call.arguments, call.id, call.name))
            self.calls += found
            return "", deltas
        if begun:
            self.calls += [ToolCall(b.name, b.sent(), b.id) for b in begun]
            return "", deltas
        return block, []


def _goes_on(found: list[ToolCall], begun: list[_Begun]) -> bool:
    """Whether the parsed calls ``found`` are the calls begun, the same names and ids, each with arguments
    that go on from those sent."""
    return len(found) >= len(begun) and all(
        f.name == b.name and (b.model_id is None or f.id == b.model_id) and f.arguments.startswith(b.sent())
        for f, b in zip(found, begun))


def _last(text: str, n: int) -> str:
    """The last ``n`` characters of ``text`` (all of it where it is shorter; none for ``n`` 0)."""
    return text[len(text) - n:] if 0 < n < len(text) else text if n > 0 else ""


def _merged(pieces: list[Any]) -> list[Any]:
    """``pieces`` (content and ``ToolCallDelta`` s) with each run of content as one, and each run of one call's
    deltas as one (a call's first delta keeps its id and name)."""
    out: list[Any] = []
    for p in pieces:
        if out and isinstance(p, str) and isinstance(out[-1], str):
            out[-1] += p
        elif (out and isinstance(p, ToolCallDelta) and isinstance(out[-1], ToolCallDelta)
              and out[-1].index == p.index and p.name is None):
            out[-1].arguments += p.arguments
        else:
            out.append(p)
    return out


class ContentLayout(Stripped):
    """The whitespace around tool calls is layout, not content: once the output has a call, the
    content's trailing whitespace is dropped, and so is its leading whitespace where a call comes
    before any text (whitespace before text that precedes every call is sent before a call can be
    known: it stays). Whitespace between texts stays. Streamed, trailing whitespace is held until
    text follows (then sent) or the output ends (then sent only if there is no call), so that the
    deltas joined are the whole output's content however the text was cut (``Stripped``'s rule)."""

    def text(self, text: str, called: bool) -> str:
        """The delta to send for the output's next ``text`` outside the calls (``called``: a call
        came before it)."""
        return self.feed(text, leading=called)

    def end(self, called: bool) -> str:
        """The last delta, at the output's end (``called``: it has a call)."""
        held, self.held = self.held, ""
        return "" if called else held


# --- echoes: an open block's calls as they are written ----------------------------------------------

HEAD_LIMIT = 1024  # the most characters an echo waits for a call's name (then it is sent whole)


class _Begun:
    """A call an echo began: its id (the model's, ``model_id``, where the syntax writes one) and name,
    and the pieces of its arguments sent so far."""

    def __init__(self, name: str, model_id: str | None = None):
        self.name, self.model_id = name, model_id
        self.id = model_id or new_call_id()
        self.pieces: list[str] = []

    def sent(self) -> str:
        if len(self.pieces) > 1:
            self.pieces = ["".join(self.pieces)]
        return self.pieces[0] if self.pieces else ""


class _Echo(ABC):
    """An open block's body as it comes (``feed``), the calls it begins, and their deltas (numbered
    within the block). A state machine whose ``off`` state sends nothing more: what the echo cannot
    follow is left to the whole parse at the block's end. Its decisions depend on the text, not on how
    it was cut: a state that waits for a marker or a call's head looks at the first ``HEAD_LIMIT``
    characters held (``window``), and gives up where they hold none (``wait``)."""

    def __init__(self) -> None:
        self.begun: list[_Begun] = []
        self.state = "seek"
        self.buf = ""  # text held while a marker or a call's head may still be coming
        self.out: list[ToolCallDelta] = []

    def feed(self, text: str) -> list[ToolCallDelta]:
        while text and self.state != "off":
            text = self.step(text)
        out, self.out = self.out, []
        return out

    @abstractmethod
    def step(self, text: str) -> str:
        """Take in the start of ``text``; return what is left of it (empty: wait for more). Each syntax's echo
        is its own state machine."""

    def begin(self, name: str, model_id: str | None = None, arguments: str = "") -> None:
        call = _Begun(name, model_id)
        self.begun.append(call)
        self.out.append(ToolCallDelta(len(self.begun) - 1, "", call.id, name))
        self.send(arguments)

    def send(self, arguments: str) -> None:
        """More of the newest call's arguments."""
        if arguments:
            self.begun[-1].pieces.append(arguments)
            self.out.append(ToolCallDelta(len(self.begun) - 1, arguments))

    def window(self, text: str) -> str:
        """Hold ``text`` after what is held; the first ``HEAD_LIMIT`` characters held, where a waiting
        state looks (what follows what it finds there is ``self.buf[k:]``, at the same ``k``)."""
        self.buf += text
        return self.buf[:HEAD_LIMIT]

    def wait(self) -> str:
        """Nothing found in the window yet: wait for more text, or give up where the window is full."""
        if len(self.buf) >= HEAD_LIMIT:
            self.state = "off"
        return ""

    def go(self, state: str, at: int) -> str:
        """To ``state``, with what is held from ``at`` on as the text left."""
        self.state, rest, self.buf = state, self.buf[at:], ""
        return rest


def _echo_of(parser: ToolCallParser, tools: list[dict[str, Any]] | None) -> _Echo | None:
    """The echo of ``parser``'s syntax (None: its calls are sent whole)."""
    if parser.body in ("object", "list", "lines"):
        return _JsonEcho(parser.body)
    if parser.body == "kimi":
        return _KimiEcho()
    if parser.body == "xml":
        return _XmlEcho(tools)
    return None


class _JsonEnd:
    """Where a JSON object or list ends, its text coming in pieces: brackets counted outside
    strings (escapes followed). Starts ``depth`` brackets deep (1: inside an object whose other
    members follow)."""

    _IN_STRING = re.compile(r'[^"\\]*')
    _OUTSIDE = re.compile(r'[^"{}\[\]]*')

    def __init__(self, depth: int = 0):
        self.depth, self.in_string, self.escape, self.done = depth, False, False, False

    def scan(self, text: str) -> int:
        """How much of ``text`` belongs to the value: all of it, or up to its closing bracket (``done``)."""
        at, n = 0, len(text)
        while at < n:
            if self.escape:
                self.escape, at = False, at + 1
            elif self.in_string:
                at = self._IN_STRING.match(text, at).end()
                if at < n:  # a backslash (the next character is escaped) or the closing quote
                    if text[at] == "\\":
                        self.escape = True
                    else:
                        self.in_string = False
                    at += 1
            else:
                at = self._OUTSIDE.match(text, at).end()
                if at < n:
                    c, at = text[at], at + 1
                    if c == '"':
                        self.in_string = True
                    elif c in "{[":
                        self.depth += 1
                    else:
                        self.depth -= 1
                        if self.depth <= 0:
                            self.done = True
                            return at
        return n


# the head of a call whose arguments can be streamed: its name first, then its arguments, an object or a list
_HEAD = re.compile(r'\{[ \t\n\r]*"name"[ \t\n\r]*:[ \t\n\r]*("(?:[^"\\]|\\.)*")[ \t\n\r]*,[ \t\n\r]*'
                   r'"(?:arguments|parameters)"[ \t\n\r]*:[ \t\n\r]*(?=[{\[])')


class _JsonEcho(_Echo):
    """The calls of a JSON body (``object``, ``list``, ``lines``), each begun once its head
    (``{"name": ..., "arguments": ``) is whole, its arguments sent as written up to their closing
    bracket; then the rest of the call's object is skipped, to the next call."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.value = _JsonEnd()
        self.opened = False  # (a list:) its "[" was read

    def step(self, text: str) -> str:
        if self.state == "seek":  # between calls
            text = text.lstrip(_JSON_WHITESPACE)
            if not text:
                return ""
            c = text[0]
            if self.kind == "list" and not self.opened and c == "[":
                self.opened = True
                return text[1:]
            if self.kind == "list" and self.begun and c == ",":
                return text[1:]
            may_start = self.opened if self.kind == "list" else self.kind == "lines" or not self.begun
            if c == "{" and may_start:
                self.state = "head"
                return text
            self.state = "off"
            return ""
        if self.state == "head":
            m = _HEAD.match(self.window(text))
            if m is None:
                return self.wait()
            name = json.loads(m.group(1))
            if not _is_text(name):
                self.state = "off"
                return ""
            self.begin(name)
            self.value = _JsonEnd()
            return self.go("arguments", m.end())
        end = self.value.scan(text)
        if self.state == "arguments":
            self.send(text[:end])
            if self.value.done:
                self.state, self.value = "rest", _JsonEnd(depth=1)
        elif self.value.done:  # (rest: the call's other members, to its closing brace)
            self.state = "seek"
        return text[end:]


class _KimiEcho(_Echo):
    """Kimi's tagged calls: each begun at ``<|tool_call_argument_begin|>`` with the model's id
    (``functions.NAME:IDX``), its arguments (an object or a list) sent to their closing bracket."""

    def __init__(self) -> None:
        super().__init__()
        self.value: _JsonEnd | None = None

    def step(self, text: str) -> str:
        if self.state in ("seek", "tail"):  # whitespace, then a call's opening marker (or the call's end marker)
            window = self.window(text)
            marker, held = (_KIMI_CALL, window.lstrip()) if self.state == "seek" else \
                (_KIMI_END, window.lstrip(_JSON_WHITESPACE))
            if held.startswith(marker):
                return self.go("id" if self.state == "seek" else "seek", len(window) - len(held) + len(marker))
            if not marker.startswith(held):
                self.state = "off"
            return self.wait()
        if self.state == "id":  # the call's id, up to its arguments' marker
            window = self.window(text)
            i = window.find(_KIMI_ARGS)
            if i < 0:
                return self.wait()
            call_id = window[:i].strip()
            name = _KIMI_ID.fullmatch(call_id)
            if name is None:
                self.state = "off"
                return ""
            self.begin(name.group(1), call_id)
            return self.go("arguments", i + len(_KIMI_ARGS))
        if self.value is None:  # (arguments:) JSON whitespace, then an object or a list
            text = text.lstrip(_JSON_WHITESPACE)
            if not text:
                return ""
            if text[0] not in "{[":  # (a string or a number: the whole parse sends it)
                self.state = "off"
                return ""
            self.value = _JsonEnd()
        end = self.value.scan(text)
        self.send(text[:end])
        if self.value.done:
            self.state, self.value = "tail", None
        return text[end:]


_FUNCTION, _FUNCTION_END = "<function=", "</function>"
_PARAMETER, _PARAMETER_END = "<parameter=", "</parameter>"


class _XmlEcho(_Echo):
    """``qwen3_coder``'s XML calls: each begun at ``<function=NAME>``, its arguments the JSON object
    ``xml_calls`` makes, a parameter at a time: ``{`` at once, a value the schema lets be a string
    character by character as it comes (JSON-escaped, its first and last newline dropped), any
    other value whole at its closing tag, ``}`` at ``</function>``."""

    def __init__(self, tools: list[dict[str, Any]] | None):
        super().__init__()
        self.tools = tools
        self.properties: dict[str, Any] = {}
        self.params: dict[str, Any] = {}  # the function's parameters (which its properties' "$ref"s name)
        self.keys: set[str] = set()
        self.key = ""
        self.value: list[str] = []  # a value sent whole: its pieces
        self.fresh = True  # a streamed value: its first character is still to come (a newline there is dropped)

    def step(self, text: str) -> str:
        if self.state in ("seek", "parameters"):
            return self._tag(text)
        if self.state == "string":
            return self._string(text)
        # (value:) a value sent whole, or skipped (a parameter written again), at its closing tag
        held = self.buf + text  # (only what may be the start of the closing tag is held: bounded)
        i = held.find(_PARAMETER_END)
        if i < 0:
            keep = partial_suffix(held, _PARAMETER_END)
            self.value.append(held[:len(held) - keep])
            self.buf = held[len(held) - keep:]
            return ""
        self.value.append(held[:i])
        if self.key not in self.keys:
            value = xml_argument("".join(self.value), self.properties.get(self.key), self.params)
            self.send(self._key_text() + _json_text(value))
            self.keys.add(self.key)
        self.state, self.value, self.buf = "parameters", [], ""
        return held[i + len(_PARAMETER_END):]

    def _tag(self, text: str) -> str:
        """Whitespace, then the tag that comes next: ``<function=NAME>`` (seek), or ``<parameter=KEY>``
        or ``</function>`` (within a function)."""
        window = self.window(text)
        held = window.lstrip()
        at = len(window) - len(held)  # where ``held`` starts in what is held
        tags = (_FUNCTION,) if self.state == "seek" else (_PARAMETER, _FUNCTION_END)
        tag = next((t for t in tags if held.startswith(t)), None)
        if tag is None:
            if not any(t.startswith(held) for t in tags):
                self.state = "off"
            return self.wait()
        if tag == _FUNCTION_END:
            self.send("}")
            return self.go("seek", at + len(tag))
        close = held.find(">", len(tag))
        name = held[len(tag):close] if close >= 0 else held[len(tag):]
        if "\n" in name or (close >= 0 and not name):
            self.state = "off"
            return ""
        if close < 0:
            return self.wait()
        rest = self.go(self.state, at + close + 1)
        if tag == _FUNCTION:
            name = name.strip()
            self.params = _parameters(self.tools, name)
            properties = self.params.get("properties")
            self.properties = properties if isinstance(properties, dict) else {}
            self.keys = set()
            self.begin(name, arguments="{")
            self.state = "parameters"
            return rest
        self.key = name.strip()
        if self.key not in self.keys and _allows_string(self.properties.get(self.key), self.params):
            self.send(self._key_text() + '"')
            self.keys.add(self.key)
            self.state, self.fresh = "string", True
        else:
            self.state, self.value = "value", []
        return rest

    def _key_text(self) -> str:
        return (", " if self.keys else "") + _json_text(self.key) + ": "

    def _string(self, text: str) -> str:
        """A string value: its characters sent JSON-escaped as they come, but a newline that may be
        its last and what may be its closing tag held."""
        held = self.buf + text
        if self.fresh and held:
            held, self.fresh = held[1:] if held.startswith("\n") else held, False
        i = held.find(_PARAMETER_END)
        if i >= 0:
            value = held[:i]
            value = value[:-1] if value.endswith("\n") else value
            self.send(_json_text(value)[1:-1] + '"')
            self.state, self.buf = "parameters", ""
            return held[i + len(_PARAMETER_END):]
        keep = partial_suffix(held, _PARAMETER_END)
        if len(held) > keep and held[len(held) - keep - 1] == "\n":
            keep += 1
        self.send(_json_text(held[:len(held) - keep])[1:-1])
        self.buf = held[len(held) - keep:]
        return ""

