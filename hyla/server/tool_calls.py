"""Tool calls in a model's output, and the grammar that forces one.

One idea: a model family writes tool calls in its own syntax inside its text; a ``ToolCallParser``
finds them and turns them into OpenAI ``tool_calls``, whole (``parse``) or as the text streams in
(``stream``: ``hyla.server.tool_call_stream``). The parser is chosen per server (``--tool-call-parser``,
SGLang's and vLLM's names; by default, ``auto``, the one the model's chat template writes:
``detect_tool_call_parser``); every syntax is a block between two markers (``SYNTAXES``) whose body
holds the calls:

* ``qwen`` — Qwen's ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` (Qwen2.5,
  Qwen3, Qwen3-Next, Granite 4.0-H, Falcon-H1; the default; also named ``hermes``, vLLM's name, and
  ``qwen25``): one JSON call per block.
* ``nemotron_json`` — ``<TOOLCALL>[{"name": ..., "arguments": {...}}, ...]</TOOLCALL>``: one block,
  a JSON list of calls (NemotronH / Nemotron-H chat models).
* ``jamba`` — ``<tool_calls>[{"name": ..., "arguments": {...}}, ...]</tool_calls>`` (Jamba 1.5 and
  later): a JSON list, as ``nemotron_json``.
* ``minimax`` — ``<tool_calls>\\n{"name": ..., "arguments": {...}}\\n{...}\\n</tool_calls>``
  (MiniMax-Text-01, MiniMax-M1): one JSON call per line.
* ``qwen3_coder`` — the XML syntax of Qwen3-Coder, Qwen3.5 and Nemotron-3: ``<tool_call>``, then
  ``<function=NAME>``, one ``<parameter=KEY>\\nVALUE\\n</parameter>`` per argument, ``</function>``,
  ``</tool_call>``. A value is text; it becomes a JSON value by the tool's ``parameters`` schema
  (:func:`xml_argument`), so the parser takes the request's tools.
* ``kimi_k2`` — Kimi's sections (Kimi-Linear, Kimi-K2): ``<|tool_calls_section_begin|>``, then per
  call ``<|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{...}<|tool_call_end|>``,
  ``<|tool_calls_section_end|>``. The call's id is the model's ``functions.NAME:IDX`` (Kimi's chat
  template writes an earlier call back with its id, as vLLM and SGLang keep it).
* ``lfm2`` — LFM2's ``<|tool_call_start|>[get_weather(city="Paris"), ...]<|tool_call_end|>``: a
  Python list of calls with keyword arguments whose values are literals (``True``, ``None``, ...; read
  with ``ast``, never evaluated), or a JSON list of calls, as SGLang's ``lfm2`` reads it.

``tool_choice: "required"`` or a named function is enforced with an ``ebnf`` grammar in the same
syntax (``forced_grammar``), whose JSON is constrained by the tools' parameter schemas, so even a
model that never learned the syntax returns a valid call (``lfm2``'s forced calls are its JSON list:
a Python literal has no grammar a JSON schema constrains). A grammar never produces a special token
(``hyla.engine.grammar``): a marker that is one (Kimi's, LFM2's) is written in ordinary tokens, as
text, which the parser reads the same.

A block that does not hold well-formed calls stays in the content as text (as vLLM does).
Parsing never raises: the model's text and the request's tool schemas may hold anything (a schema
the request validation let through, JSON nested past Python's recursion limit). ``forced_grammar``
raises ``ValueError`` for parameters that are not shaped as a JSON Schema
(``check_function_parameters``, which the HTTP API applies to every request's tools).
"""

from __future__ import annotations

import ast
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hyla.server.protocol import check_function_parameters

if TYPE_CHECKING:
    from hyla.server.tool_call_stream import ToolCallStream

# parser name -> (start marker, end marker, what a block's body holds)
SYNTAXES = {
    "qwen": ("<tool_call>", "</tool_call>", "object"),
    "nemotron_json": ("<TOOLCALL>", "</TOOLCALL>", "list"),
    "jamba": ("<tool_calls>", "</tool_calls>", "list"),
    "minimax": ("<tool_calls>", "</tool_calls>", "lines"),
    "qwen3_coder": ("<tool_call>", "</tool_call>", "xml"),
    "kimi_k2": ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "kimi"),
    "lfm2": ("<|tool_call_start|>", "<|tool_call_end|>", "python"),
}
ALIASES = {"hermes": "qwen", "qwen25": "qwen"}  # vLLM's and SGLang's other names for Qwen's syntax
TOOL_CALL_PARSERS = (*SYNTAXES, *ALIASES)
AUTO = "auto"  # the server's default: the syntax the model's chat template writes (detect_tool_call_parser)
DEFAULT_TOOL_CALL_PARSER = "qwen"
_KIMI_CALL, _KIMI_ARGS, _KIMI_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"


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


def _json_rule(schema: dict[str, Any]) -> str:
    """A Lark rule's body: JSON that ``schema`` constrains, laid out as ``response_format``'s JSON is
    (``hyla.engine.grammar.JSON_DEFAULTS``; imported here, not at the top: that module imports torch, and
    ``hyla serve --help`` imports this one)."""
    from hyla.engine.grammar import JSON_DEFAULTS

    return f"%json {json.dumps({**schema, 'x-guidance': JSON_DEFAULTS})}"

class ToolCallParser:
    """A family's tool-call syntax (``SYNTAXES``): block markers, and what a block's body holds
    (``body``: one call as a JSON object, ``object``; a JSON list of them, ``list``; one per line,
    ``lines``; XML function and parameter tags, ``xml``; Kimi's tagged calls, ``kimi``; a Python list
    of calls, ``python``). ``tools`` (the request's OpenAI tools or their ``function`` objects) only
    matter to ``xml``, whose argument values are typed by their schemas."""

    def __init__(self, name: str = DEFAULT_TOOL_CALL_PARSER):
        if name not in TOOL_CALL_PARSERS:
            raise ValueError(f"unknown tool-call parser {name!r}; expected one of {TOOL_CALL_PARSERS}")
        self.name = name = ALIASES.get(name, name)
        self.start, self.end, self.body = SYNTAXES[name]
        self.xml = self.body == "xml"
        self.markers = (self.start, self.end) + ((_KIMI_CALL, _KIMI_ARGS, _KIMI_END) if self.body == "kimi" else ())
        """Every marker of the syntax: a special token among them must be kept in the decoded text."""

    def calls_of(self, body: str, tools: list[dict[str, Any]] | None = None) -> list[ToolCall] | None:
        """The calls a block's body holds, or None if it is not a well-formed block (JSON nested
        too deep for Python to read or write included)."""
        try:
            if self.body == "xml":
                return xml_calls(body, tools)
            if self.body == "kimi":
                return kimi_calls(body)
            if self.body == "python":
                return python_calls(body)
            return json_calls(body, self.body)
        except (ValueError, RecursionError):
            return None

    def parse(self, text: str, tools: list[dict[str, Any]] | None = None) -> tuple[str, list[ToolCall]]:
        """``(content, calls)``: the text without the well-formed call blocks (its whitespace as
        ``ContentLayout`` lays it out), and the calls. The whole text streamed in one piece: a stream's
        content deltas, joined, are this content, and its call deltas these calls, however the text was cut."""
        stream = self.stream(tools)
        content, _ = stream.feed(text, final=True)
        return content, stream.calls

    def in_order(self, text: str, tools: list[dict[str, Any]] | None = None) -> list[str | ToolCall]:
        """``parse``'s content and calls in the output's order: each run of content between calls one string
        (its whitespace as ``parse`` lays it out: joined, the strings are ``parse``'s content), each call
        itself. What an Anthropic message makes its blocks of (text, ``tool_use``, text, ...)."""
        stream = self.stream(tools)
        pieces = stream.feed_in_order(text, final=True)
        return [p if isinstance(p, str) else stream.calls[p.index] for p in pieces
                if isinstance(p, str) or p.name is not None]

    def for_template(self, messages: list[dict[str, Any]], template: str | None = None) -> list[dict[str, Any]]:
        """Chat messages as this syntax's chat templates read them (``template``: the source of the one that
        renders them). ``qwen3_coder`` templates write an earlier call's arguments one ``<parameter>`` tag
        each (``arguments | items``), so the JSON text OpenAI clients send back in an assistant turn's
        ``tool_calls`` becomes an object (as vLLM does). LFM2's template never reads ``tool_calls`` (the
        model's calls were its text): where the template names no ``tool_calls``, an ``lfm2`` assistant
        turn's calls are written after its content as the model writes them (``python_call_block``), so
        the model sees what it called. The other templates take the messages as they are. Messages are
        not modified."""
        def calling(m: dict[str, Any]) -> bool:
            return m.get("role") == "assistant" and isinstance(m.get("tool_calls"), list) and bool(m["tool_calls"])

        if self.xml:
            return [{**m, "tool_calls": [_decoded_arguments(c) for c in m["tool_calls"]]} if calling(m) else m
                    for m in messages]
        if self.body == "python" and template is not None and "tool_calls" not in template:
            return [{**m, "content": _with_text_after(m.get("content"), python_call_block(m["tool_calls"]))}
                    if calling(m) else m for m in messages]
        return messages

    def stream(self, tools: list[dict[str, Any]] | None = None, incremental: bool = False) -> ToolCallStream:
        """The calls as the text streams in (``hyla.server.tool_call_stream``): sent whole as each block
        closes, or, ``incremental``, each call's id and name as soon as they come and its arguments as
        they are written."""
        from hyla.server.tool_call_stream import ToolCallStream  # (which reads the syntaxes defined here)
        return ToolCallStream(self, tools, incremental)

    def forced_grammar(self, tools: list[dict[str, Any]], parallel: bool) -> str:
        """An ``ebnf`` (Lark) grammar: one call (or several, ``parallel``) of one of ``tools``
        (OpenAI ``function`` objects), each with arguments following its ``parameters`` schema.
        ``ValueError`` when a function's ``parameters`` is not shaped as a JSON Schema."""
        for fn in tools:
            check_function_parameters(fn.get("name", "?"), fn.get("parameters"))
        if self.body == "xml":
            return xml_forced_grammar(tools, parallel)
        if self.body == "kimi":
            return kimi_forced_grammar(tools, parallel)
        # a call is {"name": NAME, "arguments": ARGS}, laid out as JSON_DEFAULTS lays out an object of those two
        # keys; each tool's parameters a JSON rule of their own, so that their "$ref"s ("#/$defs/...", "#")
        # resolve in them, as in the tool's schema
        rules, options = [], []
        for f, fn in enumerate(tools):
            params = fn.get("parameters") or {"type": "object"}
            rules += [f'c{f}: "{{\\"name\\": " n{f} ", \\"arguments\\": " a{f} "}}"',
                      f"n{f}: {_json_rule({'const': fn['name']})}", f"a{f}: {_json_rule(params)}"]
            options.append(f"c{f}")
        body = f"body: {' | '.join(options)}\n" + "\n".join(rules) + "\n"
        if self.body in ("list", "python"):  # one block, a list of one call (or several, parallel)
            items = 'body (", " body)*' if parallel else "body"
            return f"start: {json.dumps(self.start + '[')} {items} {json.dumps(']' + self.end)}\n" + body
        if self.body == "lines":  # one block, a call per line
            items = 'body ("\\n" body)*' if parallel else "body"
            return f"start: {json.dumps(self.start + chr(10))} {items} {json.dumps(chr(10) + self.end)}\n" + body
        call = f"call: {json.dumps(self.start + chr(10))} body {json.dumps(chr(10) + self.end)}\n"  # a block a call
        start = "call (\"\\n\" call)*" if parallel else "call"
        return f"start: {start}\n" + call + body


def _with_text_after(content: Any, text: str) -> Any:
    """A message's ``content`` (a string, or a list of parts) with ``text`` written right after it: on its last
    text part, or in a part of its own after a part of another kind."""
    if not isinstance(content, list):
        return (content or "") + text
    if content and isinstance(content[-1], dict) and content[-1].get("type") == "text":
        return [*content[:-1], {**content[-1], "text": content[-1].get("text", "") + text}]
    return [*content, {"type": "text", "text": text}]


def detect_tool_call_parser(template: str | None, architecture: str = "") -> str:
    """The syntax a chat template writes earlier calls in (and teaches the model), by its markers, most
    specific first; ``<tool_calls>``, Jamba's and MiniMax's both, by the ``architecture``; Qwen's where
    none is found (a template without tools included)."""
    template = template or ""
    for marker, name in (("<|tool_calls_section_begin|>", "kimi_k2"), ("<|tool_call_start|>", "lfm2"),
                         ("<|tool_list_start|>", "lfm2"),  # (LFM2's template lists the tools; it writes no call)
                         ("<TOOLCALL>", "nemotron_json"), ("<parameter=", "qwen3_coder")):
        if marker in template:
            return name
    if "<tool_calls>" in template:
        return "minimax" if architecture.lower().startswith("minimax") else "jamba"
    return DEFAULT_TOOL_CALL_PARSER


# --- kimi_k2: tagged calls in a section ----------------------------------------------------------

_KIMI_ID = re.compile(r"(?:functions\.)?([^\s:.]+):\d+")  # functions.NAME:IDX (the name alone is read)


def kimi_calls(body: str) -> list[ToolCall] | None:
    """The calls of a ``kimi_k2`` section's body (each with the model's id), or None when the body
    holds anything else: text between the calls, an id not ``functions.NAME:IDX``, arguments that
    are not JSON. Linear in the body (split at the markers, never searched again from each call)."""
    head, *parts = body.split(_KIMI_CALL)
    if head.strip() or not parts:
        return None
    calls = []
    for part in parts:
        call_id, found, rest = part.partition(_KIMI_ARGS)
        arguments, ended, tail = rest.partition(_KIMI_END)
        name = _KIMI_ID.fullmatch(call_id.strip())
        if not (found and ended) or tail.strip() or name is None:
            return None
        call = _call({"name": name.group(1), "arguments": _json_value(arguments)},
                     {"arguments": arguments.strip(_JSON_WHITESPACE)})
        if call is None:
            return None
        call.id = call_id.strip()
        calls.append(call)
    return calls


def kimi_forced_grammar(tools: list[dict[str, Any]], parallel: bool) -> str:
    """The ``kimi_k2`` forced-call grammar: a section of one call (or several), each
    ``functions.NAME:IDX`` with arguments following the function's schema."""
    rules, options = [], []
    for f, fn in enumerate(tools):
        params = fn.get("parameters") or {"type": "object"}
        opening = json.dumps(f"{_KIMI_CALL}functions.{fn['name']}:")
        rules += [f"f{f}: {opening} index {json.dumps(_KIMI_ARGS)} a{f} {json.dumps(_KIMI_END)}",
                  f"a{f}: {_json_rule(params)}"]
        options.append(f"f{f}")
    calls = "call+" if parallel else "call"
    return "\n".join([f"start: {json.dumps(SYNTAXES['kimi_k2'][0])} {calls} {json.dumps(SYNTAXES['kimi_k2'][1])}",
                      f"call: {' | '.join(options)}", "index: /[0-9]{1,3}/", *rules]) + "\n"


# --- lfm2: a Python list of calls ----------------------------------------------------------------

def python_calls(body: str) -> list[ToolCall] | None:
    """The calls of an ``lfm2`` block's body: a Python list of calls (or one call) with keyword
    arguments whose values are literals (:func:`_literal`), or, as SGLang reads it too, a JSON list of
    calls (or one). None for anything else: positional arguments, a call of an attribute, an
    expression that is not a literal. The text is parsed (``ast``), never evaluated."""
    text = body.strip()
    if text.startswith(("[{", "{")):
        try:
            value = _json_value(text)
        except (ValueError, RecursionError):
            value = None
        if value is not None:
            return _calls(value if isinstance(value, list) else [value])
    try:
        node = ast.parse(text, mode="eval").body
        nodes = node.elts if isinstance(node, ast.List) else [node]
        calls = []
        for call in nodes:
            if not isinstance(call, ast.Call) or not isinstance(call.func, ast.Name) or call.args:
                return None
            if any(kw.arg is None for kw in call.keywords):  # **kwargs
                return None
            arguments = {kw.arg: _literal(kw.value) for kw in call.keywords}
            calls.append(_call({"name": call.func.id, "arguments": arguments}))
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    return calls if calls and all(c is not None for c in calls) else None


def python_call_block(calls: list[Any]) -> str:
    """OpenAI tool calls (``{"function": {"name", "arguments"}}``, arguments as JSON text) as an ``lfm2``
    block: ``<|tool_call_start|>[name(key=value, ...), ...]<|tool_call_end|>``, each value a Python literal
    (:func:`_python_literal`). A call whose arguments are not a JSON object is written with none."""
    written = []
    for call in calls:
        fn = call.get("function") if isinstance(call, dict) else None
        fn = fn if isinstance(fn, dict) else {}
        try:
            args = json.loads(fn.get("arguments") or "{}")
        except (ValueError, TypeError, RecursionError):
            args = {}
        args = args if isinstance(args, dict) else {}
        written.append(f"{fn.get('name', '')}({', '.join(f'{k}={_python_literal(v)}' for k, v in args.items())})")
    start, end, _ = SYNTAXES["lfm2"]
    return f"{start}[{', '.join(written)}]{end}"


def _python_literal(value: Any) -> str:
    """A JSON value as the Python literal ``python_calls`` reads back to it: strings and numbers as JSON
    writes them (double-quoted, as LFM2 writes them), ``True`` / ``False`` / ``None``, lists and dicts of
    such."""
    if value is None or isinstance(value, bool):
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(_python_literal(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_python_literal(str(k))}: {_python_literal(v)}" for k, v in value.items()) + "}"
    return _json_text(value)


_NAMED = {"True": True, "False": False, "None": None, "true": True, "false": False, "null": None}


def _literal(node: ast.AST) -> Any:
    """A Python literal's JSON value: a string, a finite number, ``True`` / ``False`` / ``None``
    (or JSON's ``true`` / ``false`` / ``null``), a list or tuple, a dict with string keys; a sign
    on a number. ``ValueError`` for anything else (a name, a call, bytes, ``1e999``)."""
    if isinstance(node, ast.Constant) and (node.value is None or isinstance(node.value, (str, int, float))):
        value = node.value
        if isinstance(value, float) and not abs(value) < float("inf"):
            raise ValueError("not a finite number")
        return value
    if isinstance(node, ast.Name) and node.id in _NAMED:
        return _NAMED[node.id]
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict) and all(isinstance(k, ast.Constant) and isinstance(k.value, str) for k in node.keys):
        return {k.value: _literal(v) for k, v in zip(node.keys, node.values)}
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _literal(node.operand)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError("a sign on something not a number")
        return -value if isinstance(node.op, ast.USub) else value
    raise ValueError(f"not a literal: {type(node).__name__}")


# --- qwen3_coder: XML calls --------------------------------------------------------------------

def xml_calls(body: str, tools: list[dict[str, Any]] | None) -> list[ToolCall] | None:
    """The ``<function=NAME>...</function>`` calls of a ``qwen3_coder`` block's body, or None when
    the body holds anything else (text outside the tags, no function)."""
    functions = _tagged(body, "function")
    if not functions:
        return None
    calls = []
    for name, inner in functions:
        name = name.strip()
        params = _parameters(tools, name)
        properties = params.get("properties")
        properties = properties if isinstance(properties, dict) else {}
        parameters = _tagged(inner, "parameter")
        if parameters is None:
            return None
        args: dict[str, Any] = {}
        for key, value in parameters:  # (a parameter written twice: the first is kept, as a stream sent it)
            if key.strip() not in args:
                args[key.strip()] = xml_argument(value, properties.get(key.strip()), params)
        calls.append(ToolCall(name, _json_text(args)))
    return calls


def _tagged(text: str, tag: str) -> list[tuple[str, str]] | None:
    """The ``<TAG=NAME>BODY</TAG>`` elements of ``text`` as ``(NAME, BODY)`` in order (a body ends at the
    first closing tag; a name holds no ``>`` nor newline), where only whitespace is around and between
    them; None for anything else. Linear in the text: each character is looked at a bounded number of
    times (a regex searched again from every opening tag without a closing one was quadratic: an output
    of 8,000 ``<function=a>`` took 6 s, 100k characters, on the event loop)."""
    opening, closing = f"<{tag}=", f"</{tag}>"
    elements, pos = [], 0
    while (start := text.find(opening, pos)) >= 0:
        name_end = text.find(">", start + len(opening))
        name = text[start + len(opening):name_end] if name_end >= 0 else ""
        end = text.find(closing, name_end + 1) if name and "\n" not in name else -1
        if end < 0 or text[pos:start].strip():
            return None
        elements.append((name, text[name_end + 1:end]))
        pos = end + len(closing)
    return elements if not text[pos:].strip() else None


def xml_argument(text: str, schema: dict[str, Any] | None, root: Any = None) -> Any:
    """A ``<parameter>`` tag's text as a JSON value: the text between the newline after the opening
    tag and the one before the closing tag; kept a string when the schema allows a string (or the
    parameter has no schema), else read as JSON (``42``, ``true``, ``null``, ``[1, 2]``, ...), and a
    string again when it is not valid JSON (vLLM and SGLang also fall back to the text). ``root``: the
    tool's parameters, which the schema's ``$ref`` s name."""
    if text.startswith("\n"):
        text = text[1:]
    if text.endswith("\n"):
        text = text[:-1]
    if _allows_string(schema, root):
        return text
    try:
        return _json_value(text)
    except (ValueError, RecursionError):
        return text


def _allows_string(schema: Any, root: Any = None) -> bool:
    """Whether a parameter's schema lets its value be a string: no schema (or not an object), a
    ``type`` naming ``string``, an ``enum`` / ``const`` with a string value, or, without those, any
    ``anyOf`` / ``oneOf`` branch that does; a ``$ref`` is the schema it names in ``root`` (the tool's
    parameters: ``#``, ``#/$defs/...``; one it cannot find allows anything). Iterative, and any JSON value
    is taken."""
    stack, followed = [schema], set()
    while stack:
        schema = stack.pop()
        if isinstance(schema, dict) and isinstance(schema.get("$ref"), str):
            if schema["$ref"] not in followed:  # (a cycle of references: each followed once)
                followed.add(schema["$ref"])
                stack.append(_pointer(root, schema["$ref"]))
            continue
        if not isinstance(schema, dict):
            return True
        kind = schema.get("type")
        if kind is not None:
            if kind == "string" or (isinstance(kind, list) and "string" in kind):
                return True
            continue
        if "enum" in schema or "const" in schema:  # a string if any string value allows it
            values = schema["enum"] if "enum" in schema else [schema["const"]]
            if isinstance(values, list) and any(isinstance(v, str) for v in values):
                return True
            continue
        branches = schema.get("anyOf") or schema.get("oneOf")
        if not isinstance(branches, list) or not branches:
            return True
        stack.extend(branches)
    return False


def _pointer(root: Any, ref: str) -> Any:
    """What the local JSON pointer ``ref`` (``#``, ``#/$defs/Name``) names in ``root``; None where nothing."""
    if not ref.startswith("#"):
        return None
    node = root
    for part in ref[1:].split("/")[1:]:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _followed(schema: Any, root: Any) -> Any:
    """``schema``, or where its chain of ``$ref`` s leads in ``root`` (None where nowhere, or in a cycle)."""
    seen: set[str] = set()
    while isinstance(schema, dict) and isinstance(schema.get("$ref"), str):
        if schema["$ref"] in seen:
            return None
        seen.add(schema["$ref"])
        schema = _pointer(root, schema["$ref"])
    return schema


_TOOL_DEF = "__tool"  # where _in_tool puts the tool's parameters


def _in_tool(params: dict[str, Any], key: str) -> dict[str, Any]:
    """A JSON schema of the parameter ``key`` of a tool whose parameters are ``params``, as a document of its
    own in which the parameter's ``$ref`` s (``#``, ``#/$defs/...``, ``#/properties/...``) name what they
    name in ``params``: the parameters under ``$defs`` (each local ``$ref`` moved there), the root a
    ``$ref`` to the parameter."""
    def moved(node: Any) -> Any:
        if isinstance(node, list):
            return [moved(v) for v in node]
        if not isinstance(node, dict):
            return node
        return {k: (f"#/$defs/{_TOOL_DEF}{v[1:]}" if k == "$ref" and isinstance(v, str) and v.startswith("#")
                    else v if k in _LITERAL_KEYWORDS else moved(v)) for k, v in node.items()}

    pointer = key.replace("~", "~0").replace("/", "~1")
    return {"$ref": f"#/$defs/{_TOOL_DEF}/properties/{pointer}", "$defs": {_TOOL_DEF: moved(params)}}


_LITERAL_KEYWORDS = frozenset(("const", "enum", "default", "examples"))  # values, not schemas: no $ref to move


def _parameters(tools: list[dict[str, Any]] | None, name: str) -> dict[str, Any]:
    """The ``parameters`` schema of function ``name`` among ``tools`` (OpenAI tools or their
    ``function`` objects); ``{}`` when it is not there."""
    for tool in tools or ():
        fn = tool.get("function", tool) if isinstance(tool, dict) else None
        if isinstance(fn, dict) and fn.get("name") == name:
            params = fn.get("parameters")
            return params if isinstance(params, dict) else {}
    return {}


def xml_forced_grammar(tools: list[dict[str, Any]], parallel: bool) -> str:
    """The ``qwen3_coder`` forced-call grammar: each function with its parameters in schema order
    (the required ones always, the others optional); a value is one of its ``enum`` (or ``const``)
    written bare, any text up to the closing tag where the schema allows a string, else a JSON
    value following the schema."""
    rules, options = [], []
    for f, fn in enumerate(tools):
        params = fn.get("parameters") or {}  # forced_grammar checked its shape (check_function_parameters)
        required = set(params.get("required") or ())
        items = []
        for k, (key, schema) in enumerate((params.get("properties") or {}).items()):
            name, value = f"p{f}_{k}", f"v{f}_{k}"
            tag, close = json.dumps(f"<parameter={key}>\n"), json.dumps("\n</parameter>\n")
            choices = _choices(_followed(schema, params))
            if choices is not None:
                rules += [f"{name}: {tag} {value} {close}", f"{value}: {' | '.join(choices)}"]
            elif _allows_string(schema, params):  # any text, up to (and with) the closing tag
                rules += [f"{name}: {tag} {value}", f"{value}[stop={close}]: /(?s:.*)/"]
            else:  # (a document whose "$ref"s resolve in the tool's parameters: _in_tool)
                rules += [f"{name}: {tag} {value} {close}", f"{value}: {_json_rule(_in_tool(params, key))}"]
            items.append(name if key in required else f"{name}?")
        opening = json.dumps(f"<function={fn['name']}>\n")
        rules.append(f'f{f}: {opening} {" ".join(items)} "</function>\\n"')
        options.append(f"f{f}")
    call = f'"<tool_call>\\n" ({" | ".join(options)}) "</tool_call>"'
    start = 'call ("\\n" call)*' if parallel else "call"
    return "\n".join([f"start: {start}", f"call: {call}", *rules]) + "\n"


def _choices(schema: Any) -> list[str] | None:
    """An ``enum`` / ``const`` parameter's values as grammar literals, each as the parser reads it
    back (strings bare, other values as JSON), or None."""
    if not isinstance(schema, dict) or not ("enum" in schema or "const" in schema):
        return None
    values = schema["enum"] if "enum" in schema else [schema["const"]]
    if not isinstance(values, list):
        return None
    return [json.dumps(v if isinstance(v, str) else json.dumps(v)) for v in values] or None


def _decoded_arguments(call: Any) -> Any:
    """An OpenAI tool call with its ``function.arguments`` JSON text as an object (kept as it is
    when it is not the text of a JSON object, or when the object is not Unicode text: a lone
    surrogate the JSON escapes, ``"\\ud800"``, which the tokenizer cannot encode)."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("arguments"), str):
        return call
    try:
        args = json.loads(fn["arguments"])
        if not _is_text(json.dumps(args, ensure_ascii=False)):
            return call
    except (ValueError, RecursionError):  # not JSON, or nested past what Python reads: kept as text
        return call
    return {**call, "function": {**fn, "arguments": args}} if isinstance(args, dict) else call


def json_calls(body: str, kind: str) -> list[ToolCall] | None:
    """The calls of a JSON block's body (``kind``: ``object``, one call; ``list``, a JSON list of calls;
    ``lines``, calls one after another), or None where one is no call. Arguments that are a JSON object
    or list are the model's own text of them (as a stream sends them while they come: the JSON the model
    wrote, its spacing included), any others as ``_call`` makes them. ``ValueError`` where the body is
    not such JSON."""
    calls, at = [], _space(body, 0)
    if kind == "list":
        if not body.startswith("[", at):
            raise ValueError("not a list")
        at = _space(body, at + 1)
        while not body.startswith("]", at):
            call, at = _json_call(body, at)
            calls.append(call)
            at = _space(body, at)
            if body.startswith(",", at):
                at = _space(body, at + 1)
            elif not body.startswith("]", at):
                raise ValueError("not a list")
        at = _space(body, at + 1)
    else:
        while at < len(body) and (kind == "lines" or not calls):
            call, at = _json_call(body, at)
            calls.append(call)
            at = _space(body, at)
    if at != len(body):
        raise ValueError("text after the calls")
    return calls if calls and all(c is not None for c in calls) else None


def _json_call(text: str, at: int) -> tuple[ToolCall | None, int]:
    """The call of the JSON value at ``text[at]`` (None if it is no call), and where the value ends."""
    if not text.startswith("{", at):
        value, at = _DECODER.raw_decode(text, at)
        return _call(value), at
    value, raw, at = _members(text, at)
    return _call(value, raw), at


def _members(text: str, at: int) -> tuple[dict[str, Any], dict[str, str], int]:
    """The JSON object at ``text[at]``: its value, each member's text, and where it ends (a key
    written twice: the last, as ``json`` reads it). The values are read by ``json``'s own scanner."""
    value: dict[str, Any] = {}
    raw: dict[str, str] = {}
    at = _space(text, at + 1)
    if text.startswith("}", at):
        return value, raw, at + 1
    while True:
        if not text.startswith('"', at):
            raise ValueError("expected a key")
        key, at = _DECODER.raw_decode(text, at)
        at = _space(text, at)
        if not text.startswith(":", at):
            raise ValueError("expected ':'")
        start = _space(text, at + 1)
        value[key], at = _DECODER.raw_decode(text, start)
        raw[key] = text[start:at]
        at = _space(text, at)
        if text.startswith("}", at):
            return value, raw, at + 1
        if not text.startswith(",", at):
            raise ValueError("expected ',' or '}'")
        at = _space(text, at + 1)


def _calls(items: list[Any] | None) -> list[ToolCall] | None:
    """The calls JSON ``items`` are (``_call`` each), or None where there are none or one is no call."""
    calls = [_call(item) for item in items or ()]
    return calls if calls and all(c is not None for c in calls) else None


def _call(value: object, raw: dict[str, str] | None = None) -> ToolCall | None:
    """``{"name": str, "arguments": {...} | str}`` (or ``"parameters"``) as a call, else None (a
    name or a text of arguments that is not Unicode text included: ``_is_text``). ``arguments`` is
    always JSON text: an object or a list is ``raw``'s text of it where given (the model's), else
    written as JSON; a string that is JSON text is kept as it is, any other string is JSON-encoded
    (``"not json"`` -> ``"\"not json\""``, as vLLM and SGLang write it), so a client can parse it."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not _is_text(value["name"]):
        return None
    key = "arguments" if "arguments" in value else "parameters"
    args = value.get(key, {})
    if isinstance(args, str) and not _is_text(args):
        return None
    if raw is not None and key in raw and isinstance(args, (dict, list)):
        return ToolCall(value["name"], raw[key])
    return ToolCall(value["name"], args if isinstance(args, str) and _is_json(args) else _json_text(args))


def _is_json(text: str) -> bool:
    """Whether ``text`` is the text of a JSON value (``_json_value``)."""
    try:
        _json_value(text)
    except (ValueError, RecursionError):
        return False
    return True


def _json_value(text: str) -> Any:
    """The JSON value ``text`` holds; ``ValueError`` where it holds none (``NaN`` and ``Infinity``
    included: Python reads them, but they are not JSON, and no other client reads them back)."""
    return json.loads(text, parse_constant=_not_json)


_JSON_WHITESPACE = " \t\n\r"
_JSON_SPACE = re.compile(f"[{_JSON_WHITESPACE}]*")


def _space(text: str, at: int) -> int:
    """Where the JSON whitespace at ``text[at]`` ends."""
    return _JSON_SPACE.match(text, at).end()


def _not_json(name: str) -> Any:
    """``json.loads``'s ``parse_constant``: ``NaN``, ``Infinity`` and ``-Infinity`` are refused."""
    raise ValueError(f"{name} is not JSON")


_DECODER = json.JSONDecoder(parse_constant=_not_json)


def _json_text(value: Any) -> str:
    """``value`` as JSON text for a call's ``arguments``: characters as they are, but a lone UTF-16
    surrogate (what a JSON escape such as ``"\\ud800"`` reads as), which no UTF-8 answer can carry,
    escaped as ``\\uXXXX``. Piece by piece the same: an object's text is its keys' and values' texts
    put together (what a stream sends of an ``xml`` call, a parameter at a time)."""
    text = json.dumps(value, ensure_ascii=False)
    return text if _is_text(text) else _SURROGATE.sub(lambda m: f"\\u{ord(m.group()):04x}", text)


_SURROGATE = re.compile("[\ud800-\udfff]")


def _is_text(text: str) -> bool:
    """Whether ``text`` is Unicode text, which UTF-8 encodes (no lone surrogate)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
