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

The window stays short whatever the model samples (each step would otherwise decode all the ids
held back, O(n²) for n such ids, on the scheduler thread): ids that decode to nothing in any
context — special tokens with ``skip_special_tokens``, ids past the vocabulary (padded embedding
rows) — never enter it, as ``decode`` drops them before its decoders run; and once more than
``MAX_PENDING_IDS`` ids are held back for a text that ends in U+FFFD (invalid bytes: a lone
continuation byte is never completed), the text before the last, unfinished character is returned
(``_slide``).
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


MAX_PENDING_IDS = 16
"""Ids held back for an unfinished character beyond which the text before it is returned. A
character is at most 4 bytes, so a valid one is never held back by more than 4 ids (plus ids of
no text, which skip the window)."""


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
        # ids whose text is nothing in any context: they skip the window (see the module docstring)
        self._no_text = tokenizer.special_id_set if skip_special_tokens else frozenset()
        self._vocab_size = tokenizer.vocab_size
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

    def _has_token(self, token_id: int) -> bool:
        """Whether an id past ``vocab_size`` (a count of tokens: their ids may have gaps) has a
        token, else it has no text (a padded embedding row)."""
        return self.tokenizer.id_to_token(token_id) is not None

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def step(self, new_ids: int | Iterable[int]) -> str:
        """Append output ids; return the text that became final (possibly ``""``)."""
        new = [new_ids] if isinstance(new_ids, int) else list(new_ids)
        self.ids.extend(new)
        new = [i for i in new if i not in self._no_text and (i < self._vocab_size or self._has_token(i))]
        if not new:
            return ""
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
                    return text
                if len(self._pending) <= MAX_PENDING_IDS:
                    return ""
                self._stream = None  # too many ids held back: ``_slide`` returns what is final
                return self._slide(final=False)
        self._pending.extend(new)
        return self._slide(final=False)

    def flush(self) -> str:
        """At the end of the sequence: the text still held back (an unfinished character decodes to
        U+FFFD, as ``decode`` would). Afterwards nothing is pending."""
        self._stream = None  # its window is ours: nothing more may go through it
        return self._slide(final=True) if self._pending else ""

    def _slide(self, final: bool) -> str:
        """One step of the window decoded here: the new text of ``pending`` if it is final (or
        ``final``), and the window slides past it. Held back for a text ending in U+FFFD by more than
        ``MAX_PENDING_IDS`` ids, the text of the longest run of them whose text ends before that last
        U+FFFD is returned (the bytes before an unfinished character are final: no later byte changes
        their text), and the window slides past that run."""
        prefix_text = self._decode(self._last)
        text = self._decode(self._last + self._pending)
        if not final and (len(text) <= len(prefix_text) or text.endswith(REPLACEMENT_CHAR)):
            if len(self._pending) > MAX_PENDING_IDS and text.endswith(REPLACEMENT_CHAR):
                return self._slide_before_the_end(prefix_text, text)
            return ""  # nothing new yet, or the last character is still incomplete
        self._last, self._pending = self._pending, []
        return text[len(prefix_text):]

    def _slide_before_the_end(self, prefix_text: str, text: str) -> str:
        """The text of the longest run ``pending[:k]`` (``k`` at most 4 + 1 ids short: the bytes of
        an unfinished character) whose decode after ``last`` is a prefix of ``text`` without its last
        U+FFFD, the window sliding past it. If there is none (byte fallback on invalid UTF-8 decodes
        a whole run of byte tokens as U+FFFD), all of ``text``, as ``flush`` would."""
        for k in range(len(self._pending) - 1, max(0, len(self._pending) - 6), -1):
            head = self._decode(self._last + self._pending[:k])
            if len(head) > len(prefix_text) and text[:-1].startswith(head) and head.startswith(prefix_text):
                self._last, self._pending = self._pending[:k], self._pending[k:]
                return head[len(prefix_text):]
        self._last, self._pending = self._pending, []
        return text[len(prefix_text):]

    @property
    def output_ids(self) -> list[int]:
        return self.ids[self.num_context_ids:]
