"""Streaming decode: one output sequence's ids → text chunks as they arrive.

The algorithm is vLLM's and SGLang's (and ``tokenizers.decoders.DecodeStream``'s): keep a window
of ids, ``last`` (the ids of the chunk returned last, or the prompt context at first) followed by
``pending`` (ids whose text was not returned yet). A step appends ids to ``pending``, decodes
``last`` and ``last + pending``, and returns the extra characters unless they end in U+FFFD (an
unfinished multi-byte character, or a byte-level BPE merge split across steps); then the window
slides: ``last = pending``, ``pending = []``. Decoding a short window, not the whole text, keeps a
step O(window), and the window's first ids give decoders that strip a leading space (Metaspace /
SentencePiece) the context they need.

``DecodeStream`` runs the steps (in Rust, about twice as fast as decoding from Python). Two things
it cannot do, which this class does with the same window:

* ``flush``: it has no end of sequence, so the text held back for an unfinished character would be
  lost; ``flush`` decodes it as ``decode`` would (U+FFFD).
* Byte-fallback tokenizers (``<0xE4>`` tokens) on invalid UTF-8: ``decode(last + pending)`` need
  not start with ``decode(last)`` there, and ``DecodeStream`` raises "Invalid prefix encountered"
  on output a model can produce. From that step on, the window is decoded here (as before
  ``DecodeStream``), which never raises.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from tokenizers.decoders import DecodeStream

if TYPE_CHECKING:
    from hyla.tokenizer.tokenizer import Tokenizer

REPLACEMENT_CHAR = "\ufffd"
"""What a lossy UTF-8 decode produces for an incomplete or invalid byte sequence."""

PROMPT_CONTEXT_TOKENS = 5
"""Prompt tokens the detokenizer decodes along with the output (as vLLM does), so that decoders
which strip a leading space (Metaspace/SentencePiece) keep the first output token's space."""


class IncrementalDetokenizer:
    """Turns one sequence's output ids into text chunks (see the module docstring).

    Invariant: every chunk ``step`` returns ends at a complete character, and
    ``"".join(chunks) + flush()`` is the decode of the output ids in the prompt's context,
    ``decode(context + output)[len(decode(context)):]`` (for byte-level BPE exactly; byte-fallback
    tokenizers may show invalid bytes as a different number of U+FFFD). ``ids`` is the context
    followed by the output ids, ``output_ids`` the output ids alone.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        context = list(prompt_ids)[-PROMPT_CONTEXT_TOKENS:]
        # Start the window at a character boundary: drop leading context ids that decode to U+FFFD
        # (the tail of a character whose start lies further back in the prompt).
        while context and REPLACEMENT_CHAR in self._decode(context):
            context = context[1:]
        self.ids: list[int] = list(context)
        self.num_context_ids = len(context)
        self._last: list[int] = context
        self._pending: list[int] = []
        self._stream: DecodeStream | None = DecodeStream(ids=context, skip_special_tokens=skip_special_tokens)

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def step(self, new_ids: int | Iterable[int]) -> str:
        """Append output ids; return the text that became final (possibly ``""``)."""
        new = [new_ids] if isinstance(new_ids, int) else list(new_ids)
        self.ids.extend(new)
        if self._stream is not None:
            try:
                text = self._stream.step(self.tokenizer.backend, new)
            except Exception as e:  # tokenizers raises a bare Exception
                if "Invalid prefix" not in str(e):
                    raise
                self._stream = None  # byte fallback on invalid UTF-8: decode the window here from now on
            else:
                self._pending.extend(new)
                if text is not None:
                    self._last, self._pending = self._pending, []
                return text or ""
        self._pending.extend(new)
        return self._slide(final=False)

    def flush(self) -> str:
        """At the end of the sequence: the text still held back (an unfinished character decodes to
        U+FFFD, as ``decode`` would). Afterwards nothing is pending."""
        self._stream = None  # its window is ours: nothing more may go through it
        return self._slide(final=True) if self._pending else ""

    def _slide(self, final: bool) -> str:
        prefix_text = self._decode(self._last)
        text = self._decode(self._last + self._pending)
        if not final and (len(text) <= len(prefix_text) or text.endswith(REPLACEMENT_CHAR)):
            return ""  # nothing new yet, or the last character is still incomplete
        self._last, self._pending = self._pending, []
        return text[len(prefix_text):]

    @property
    def output_ids(self) -> list[int]:
        return self.ids[self.num_context_ids:]
