"""Tool calls in a model's output, and the grammar that forces one.

One idea: a model family writes tool calls in its own syntax inside its text; a ``ToolCallParser``
finds them and turns them into OpenAI ``tool_calls``, whole (``parse``) or as the text streams in
(``ToolCallStream``). The parser is chosen per server (``--tool-call-parser``, SGLang's names):

* ``qwen`` — Qwen's ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` (Qwen2.5,
  Qwen3, Qwen3-Next; the default).

``tool_choice: "required"`` or a named function is enforced with an ``ebnf`` grammar in the same
syntax (``forced_grammar``), whose JSON is constrained by the tools' parameter schemas, so even a
model that never learned the syntax returns a valid call.

A block that is not valid JSON with a string ``name`` stays in the content as text (as vLLM does).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from hyla.engine.grammar import JSON_DEFAULTS

TOOL_CALL_PARSERS = ("qwen", "nemotron_json")
DEFAULT_TOOL_CALL_PARSER = "qwen"


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=new_call_id)

    def openai(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "type": "function",
                               "function": {"name": self.name, "arguments": self.arguments}}
        if index is not None:
            out["index"] = index
        return out


class ToolCallParser:
    """A family's tool-call syntax: block markers, and what a block's body holds (one call as a JSON
    object for ``qwen``; a JSON list of such objects for ``nemotron_json``)."""

    MARKERS = {"qwen": ("<tool_call>", "</tool_call>"), "nemotron_json": ("<TOOLCALL>", "</TOOLCALL>")}

    def __init__(self, name: str = DEFAULT_TOOL_CALL_PARSER):
        if name not in TOOL_CALL_PARSERS:
            raise ValueError(f"unknown tool-call parser {name!r}; expected one of {TOOL_CALL_PARSERS}")
        self.name = name
        self.start, self.end = self.MARKERS[name]
        self.listed = name == "nemotron_json"  # a block holds a list of calls
        self._block = re.compile(re.escape(self.start) + r"(.*?)" + re.escape(self.end), re.S)

    def calls_of(self, body: str) -> list[ToolCall] | None:
        """The calls a block's body holds, or None if it is not a well-formed block."""
        try:
            value = json.loads(body)
        except ValueError:
            return None
        items = value if self.listed and isinstance(value, list) else [value] if not self.listed else None
        if not items:
            return None
        calls = [_call(item) for item in items]
        return None if any(c is None for c in calls) else calls

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """``(content, calls)``: the text without the well-formed call blocks, and the calls."""
        calls, kept, pos = [], [], 0
        for m in self._block.finditer(text):
            found = self.calls_of(m.group(1))
            if found is None:
                continue
            kept.append(text[pos:m.start()])
            pos = m.end()
            calls.extend(found)
        kept.append(text[pos:])
        content = "".join(kept)
        return (content.strip() if calls else content), calls

    def stream(self) -> "ToolCallStream":
        return ToolCallStream(self)

    def forced_grammar(self, tools: list[dict[str, Any]], parallel: bool) -> str:
        """An ``ebnf`` (Lark) grammar: one call (or several, ``parallel``) of one of ``tools``
        (OpenAI ``function`` objects), each with arguments following its ``parameters`` schema."""
        options = []
        for fn in tools:
            params = fn.get("parameters") or {"type": "object"}
            options.append({"type": "object", "properties": {"name": {"const": fn["name"]}, "arguments": params},
                            "required": ["name", "arguments"], "additionalProperties": False})
        schema = options[0] if len(options) == 1 else {"anyOf": options}
        schema = {**schema, "x-guidance": JSON_DEFAULTS}
        if self.listed:  # one block, a list of one call (or several, parallel)
            items = 'body (", " body)*' if parallel else "body"
            return f'start: "{self.start}[" {items} "]{self.end}"\nbody: %json {json.dumps(schema)}\n'
        call = f'"{self.start}\\n" body "\\n{self.end}"'
        start = "call (\"\\n\" call)*" if parallel else "call"
        return f"start: {start}\ncall: {call}\nbody: %json {json.dumps(schema)}\n"


class ToolCallStream:
    """Streamed text in, ``(content_delta, calls)`` out: text that cannot be part of a call block is
    passed on at once; a block is held until it closes, then sent as one whole call (OpenAI clients
    accumulate ``delta.tool_calls`` by ``index``)."""

    def __init__(self, parser: ToolCallParser):
        self.parser = parser
        self.buffer = ""
        self.calls: list[ToolCall] = []

    def feed(self, text: str, final: bool = False) -> tuple[str, list[ToolCall]]:
        self.buffer += text
        out, new = [], []
        start, end = self.parser.start, self.parser.end
        while self.buffer:
            i = self.buffer.find(start)
            if i < 0:
                keep = 0 if final else _partial_suffix(self.buffer, start)
                out.append(self.buffer[:len(self.buffer) - keep])
                self.buffer = self.buffer[len(self.buffer) - keep:]
                break
            out.append(self.buffer[:i])
            self.buffer = self.buffer[i:]
            j = self.buffer.find(end)
            if j < 0:
                if final:
                    out.append(self.buffer)
                    self.buffer = ""
                break
            block = self.buffer[:j + len(end)]
            self.buffer = self.buffer[j + len(end):]
            found = self.parser.calls_of(block[len(start):-len(end)])
            if found is None:
                out.append(block)
            else:
                new.extend(found)
        content = "".join(out)
        if self.calls or new:  # the whitespace around call blocks is layout, not content
            content = content.strip() if not content.strip() else content
        self.calls += new
        return content, new


def _call(value: object) -> ToolCall | None:
    """``{"name": str, "arguments": {...} | str}`` (or ``"parameters"``) as a call, else None."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    args = value.get("arguments", value.get("parameters", {}))
    return ToolCall(value["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
