"""Token text: what one token id shows as in logprobs (OpenAI's ``token`` and ``bytes`` fields).

A token's exact bytes: for byte-level BPE (GPT-2, Qwen, Llama-3) its vocabulary string mapped back
through the byte-level alphabet; otherwise the UTF-8 of its decode (special tokens kept). Its
display string is those bytes as UTF-8, or ``bytes:\\xe4\\xbd`` when they are not valid UTF-8 on
their own (part of a multi-byte character), as OpenAI shows such tokens.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from tokenizers import decoders

if TYPE_CHECKING:
    from hyla.tokenizer.tokenizer import Tokenizer


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the character a byte-level BPE token uses → the byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = list(bs)
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


BYTE_LEVEL_ALPHABET: dict[str, int] = _byte_level_alphabet()
"""A constant table: byte-level BPE character → byte."""


class TokenText(NamedTuple):
    text: str
    """The token as text, or ``bytes:\\xe4\\xbd`` when its bytes are not valid UTF-8 alone."""
    bytes: list[int]
    """The token's exact bytes."""


class TokenTexts:
    """Token id → ``TokenText`` for one tokenizer, each computed once (at most one entry per id)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.byte_level = isinstance(tokenizer.backend.decoder, decoders.ByteLevel)
        self._cache: dict[int, TokenText] = {}

    def __call__(self, token_id: int) -> TokenText:
        found = self._cache.get(token_id)
        if found is None:
            found = self._cache[token_id] = self._lookup(token_id)
        return found

    def _lookup(self, token_id: int) -> TokenText:
        raw = self.tokenizer.id_to_token(token_id) or ""
        if self.byte_level and raw and all(c in BYTE_LEVEL_ALPHABET for c in raw):
            data = bytes(BYTE_LEVEL_ALPHABET[c] for c in raw)
        else:
            data = self.tokenizer.decode([token_id], skip_special_tokens=False).encode("utf-8")
        try:
            return TokenText(data.decode("utf-8"), list(data))
        except UnicodeDecodeError:
            return TokenText("bytes:" + "".join(f"\\x{b:02x}" for b in data), list(data))
