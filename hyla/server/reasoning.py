"""Reasoning content: the ``<think>...</think>`` part of a thinking model's output, separated from
the answer (``--reasoning-parser``, SGLang's and vLLM's names).

* ``qwen3`` — Qwen3's ``<think>`` / ``</think>``. The output is reasoning from its start when it
  opens with ``<think>``, or when the prompt already ends inside an open ``<think>`` (templates that
  write ``<think>\\n`` into the generation prompt); everything after ``</think>`` is content, both
  stripped of their surrounding whitespace. An output that never opens a think block is all
  content, as it is. ``nano_v3`` (Nemotron 3 Nano, whose template opens the block in the prompt, or
  writes it closed with ``enable_thinking`` false) reads the same.
* ``deepseek-r1`` (also ``deepseek_r1``) and ``qwen3-thinking`` — the same markers, but the output is
  reasoning from its start whether or not ``<think>`` opens it (models that always think, and may leave
  the opening marker out), unless the prompt closed the block itself (ends with ``</think>``).
"""

from __future__ import annotations

# name -> whether the output is reasoning from its start (unless the prompt closed the block)
REASONING_PARSERS = {"qwen3": False, "nano_v3": False, "deepseek-r1": True, "deepseek_r1": True,
                     "qwen3-thinking": True}


class ReasoningParser:
    start = "<think>"
    end = "</think>"

    def __init__(self, name: str):
        if name not in REASONING_PARSERS:
            raise ValueError(f"unknown reasoning parser {name!r}; expected one of {tuple(REASONING_PARSERS)}")
        self.name = name
        self.always_thinks = REASONING_PARSERS[name]

    def prompt_opens_thinking(self, prompt: str) -> bool:
        """Whether the answer starts inside a think block: the generation prompt ends with an open
        ``<think>`` (only its end counts: a user message quoting the marker does not); for a parser of a
        model that always thinks, unless it ends with ``</think>`` (the template closed the block)."""
        end = prompt.rstrip()
        if self.always_thinks:
            return not end.endswith(self.end)
        return end.endswith(self.start)

    def parse(self, text: str, in_thinking: bool = False) -> tuple[str | None, str]:
        """``(reasoning_content or None, content)`` of a whole output: the whole text streamed in one
        piece (a stream's deltas, joined, are these, however the text was cut)."""
        stream = self.stream(in_thinking)
        reasoning, content = stream.feed(text, final=True)
        return (reasoning if stream.seen_reasoning else None), content

    def stream(self, in_thinking: bool = False) -> "ReasoningStream":
        return ReasoningStream(self, in_thinking)


class ReasoningStream:
    """Streamed text in, ``(reasoning_delta, content_delta)`` out; a marker split across chunks is
    held back until it is whole. Where there is reasoning, it and the content after it are each
    stripped of their surrounding whitespace (``Stripped``); an output without reasoning is all
    content, as it is."""

    def __init__(self, parser: ReasoningParser, in_thinking: bool):
        self.parser = parser
        self.state = "start"  # start -> thinking -> content, or start -> content
        # the prompt opened <think>: the output is reasoning up to </think> (a <think> it begins with all the
        # same is dropped, as vLLM and SGLang drop it)
        self.opened = in_thinking
        self.seen_reasoning = in_thinking
        self.buffer = ""
        self.thought, self.answer = Stripped(), Stripped()

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        self.buffer += text
        reasoning, content = "", ""
        start, end = self.parser.start, self.parser.end
        if self.state == "start":
            stripped = self.buffer.lstrip()
            if stripped.startswith(start):
                self.buffer = stripped[len(start):]
                self.state, self.seen_reasoning = "thinking", True
            elif start.startswith(stripped) and not final:
                return "", ""  # maybe the start of <think>
            else:
                self.state = "thinking" if self.opened else "content"
        if self.state == "thinking":
            i = self.buffer.find(end)
            if i < 0:
                keep = 0 if final else partial_suffix(self.buffer, end)
                reasoning, self.buffer = self.buffer[:len(self.buffer) - keep], self.buffer[len(self.buffer) - keep:]
                return self.thought.feed(reasoning), ""
            reasoning, self.buffer = self.thought.feed(self.buffer[:i]), self.buffer[i + len(end):]
            self.state = "content"
        if self.state == "content":
            content, self.buffer = self.buffer, ""
            if self.seen_reasoning:
                content = self.answer.feed(content)
        return reasoning, content


class Stripped:
    """Deltas of a text in, deltas of the text stripped out: its leading whitespace dropped, and
    whitespace after text held until more text follows (then sent; what is held when the text ends
    is its trailing whitespace, never sent). The rule of the whitespace around tool calls too
    (``tool_call_stream.ContentLayout``)."""

    def __init__(self) -> None:
        self.held = ""  # trailing whitespace not sent yet
        self.started = False  # text other than whitespace was sent

    def feed(self, text: str, leading: bool = True) -> str:
        """The delta to send for the text's next ``text``; ``leading``: whitespace before the first
        text is dropped (else sent with it)."""
        text = self.held + text
        if leading and not self.started:
            text = text.lstrip()
        body = text.rstrip()
        self.held, self.started = text[len(body):], self.started or bool(body)
        return body


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker`` (where the marker
    may be beginning, held until the next chunk tells). Found with ``str.find``: a stream asks at every chunk."""
    at = max(0, len(text) - len(marker) + 1)
    while (at := text.find(marker[0], at)) >= 0:
        if marker.startswith(text[at:]):
            return len(text) - at
        at += 1
    return 0
