"""A tiktoken BPE file as a ``tokenizers`` backend: the tokenizer of models that ship ``tiktoken.model``
and no ``tokenizer.json`` (Kimi-Linear, Kimi-K2: ``tokenizer_class`` ``TikTokenTokenizer``, whose
remote code builds a ``tiktoken.Encoding``).

The file holds one ``base64(token bytes) rank`` per line; a token's id is its rank. tiktoken encodes
a pre-token by merging, again and again, the adjacent pair whose concatenation has the lowest rank
(the leftmost of equals), and takes a pre-token that is itself a token whole. The same as a byte-level
``tokenizers`` BPE (as transformers' ``TikTokenConverter`` builds it): the vocabulary is the tokens in
GPT-2's byte-to-character alphabet, a merge ``(a, b)`` for every split of a token into two tokens,
ordered by the rank of their concatenation, and ``ignore_merges`` (a pre-token in the vocabulary is
one token). The pre-tokens are the remote code's ``pat_str`` matches (``KNOWN``: tiktoken passes a
pattern in code, not in a file, so a class of tokenizer is read only where its pattern is known).

The special tokens follow the base vocabulary, in id order: those ``tokenizer_config.json``'s
``added_tokens_decoder`` names, the others ``<|reserved_token_{id}|>``, as Kimi's code names them.
They are matched in text (the remote code encodes with ``allowed_special="all"``). Kimi's remote
``apply_chat_template`` sorts the keys of ``tools`` before rendering (``TiktokenClass.sorts_tools``):
``Tokenizer`` does too for such a tokenizer.

Differential test against ``tiktoken`` itself: ``tests/test_tokenizer_tiktoken.py``.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer

from hyla.tokenizer.token_text import BYTE_LEVEL_ALPHABET

TIKTOKEN_FILE = "tiktoken.model"

KIMI_PATTERN = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"""
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"""
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])
"""Kimi's ``TikTokenTokenizer.pat_str``: Han runs apart, words with their case and contractions,
numbers of up to three digits, punctuation runs, newlines, spaces."""


class TiktokenClass(NamedTuple):
    """What a tiktoken tokenizer's remote code holds that its files do not."""

    pattern: str  # the split pattern (``pat_str``)
    num_special: int  # how many special ids follow the base vocabulary
    sorts_tools: bool  # its apply_chat_template sorts the keys of ``tools`` (recursively) before rendering


KNOWN = {"TikTokenTokenizer": TiktokenClass(KIMI_PATTERN, 258, sorts_tools=True)}  # Kimi's (256 reserved + 2)
"""``tokenizer_config.json``'s ``tokenizer_class`` -> what its code holds."""


def is_tiktoken_dir(model_dir: Path) -> bool:
    """A model directory whose tokenizer is a tiktoken file (and no ``tokenizer.json``)."""
    return not (model_dir / "tokenizer.json").is_file() and (model_dir / TIKTOKEN_FILE).is_file()


def tiktoken_backend(model_dir: Path, config: Mapping[str, Any], known: TiktokenClass) -> BackendTokenizer:
    """The backend of ``model_dir``'s ``tiktoken.model`` with ``tokenizer_config.json``'s ``config``, its
    class ``known`` (``tiktoken_class``). ``ValueError`` for a malformed file."""
    ranks = read_ranks(model_dir / TIKTOKEN_FILE)
    backend = bpe_backend(ranks, known.pattern)
    for i, token in enumerate(special_tokens(config, len(ranks), known.num_special), len(ranks)):
        backend.add_special_tokens([token]) if token.special else backend.add_tokens([token])
        if backend.token_to_id(token.content) != i:
            raise ValueError(f"tokenizer_config.json: added token {token.content!r} (id {i}) is listed twice")
    return backend


def tiktoken_class(model_dir: Path, config: Mapping[str, Any]) -> TiktokenClass:
    """What the code of ``config``'s ``tokenizer_class`` holds; ``ValueError`` where hyla does not know it."""
    tokenizer_class = config.get("tokenizer_class")
    if tokenizer_class not in KNOWN:
        raise ValueError(f"{model_dir / TIKTOKEN_FILE}: a tiktoken tokenizer of class {tokenizer_class!r} is not "
                         f"known (its split pattern is in its own code); hyla reads {sorted(KNOWN)}, or tokenizer.json")
    return KNOWN[tokenizer_class]


def read_ranks(path: Path) -> dict[bytes, int]:
    """A tiktoken BPE file's ``{token bytes: rank}``; ``ValueError`` unless every line is ``base64 rank``,
    the ranks are ``0 .. n-1`` (the ids) and every single byte is a token (BPE starts from bytes)."""
    ranks: dict[bytes, int] = {}
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                token, rank = line.split()
                ranks[base64.b64decode(token, validate=True)] = int(rank)
            except (ValueError, binascii.Error) as exc:
                raise ValueError(f"{path}:{number}: not a tiktoken line (base64 token, rank): {exc}") from exc
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"{path}: the ranks must be 0 .. {len(ranks) - 1}, each once")
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise ValueError(f"{path}: {len(missing)} single bytes are not tokens (the first: {missing[0]})")
    return ranks


def bpe_backend(ranks: Mapping[bytes, int], pattern: str) -> BackendTokenizer:
    """A byte-level BPE that encodes as tiktoken does with these ``ranks`` and split ``pattern``."""
    alphabet = {b: c for c, b in BYTE_LEVEL_ALPHABET.items()}  # byte -> the character a byte-level BPE writes

    def chars(token: bytes) -> str:
        return "".join(alphabet[b] for b in token)

    merges = []
    for token, rank in ranks.items():
        for i in range(1, len(token)):
            left, right = token[:i], token[i:]
            if left in ranks and right in ranks:
                merges.append((rank, ranks[left], ranks[right], chars(left), chars(right)))
    merges.sort()
    model = models.BPE(vocab={chars(t): r for t, r in ranks.items()}, merges=[(a, b) for *_, a, b in merges],
                       ignore_merges=True)
    backend = BackendTokenizer(model)
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    return backend


def special_tokens(config: Mapping[str, Any], first_id: int, count: int) -> list[AddedToken]:
    """The ``count`` special tokens from id ``first_id``, in id order: named by ``added_tokens_decoder``
    (its flags kept), else ``<|reserved_token_{id}|>``. ``ValueError`` for a named id outside them."""
    decoder = config.get("added_tokens_decoder") or {}
    if not isinstance(decoder, Mapping):
        raise ValueError("tokenizer_config.json: added_tokens_decoder must be an object")
    outside = [i for i in decoder if not (str(i).isdigit() and first_id <= int(i) < first_id + count)]
    if outside:
        raise ValueError(f"tokenizer_config.json: added token id {outside[0]} is not one of the tiktoken special ids "
                         f"{first_id} .. {first_id + count - 1}")
    tokens = []
    for i in range(first_id, first_id + count):
        spec = decoder.get(str(i))
        if not isinstance(spec, Mapping) or not isinstance(spec.get("content"), str):
            if spec is not None:
                raise ValueError(f"tokenizer_config.json: added_tokens_decoder[{i}] must be an object with a content")
            tokens.append(AddedToken(f"<|reserved_token_{i}|>", special=True, normalized=False))
            continue
        tokens.append(AddedToken(spec["content"], special=spec.get("special", True), normalized=False,
                                 lstrip=spec.get("lstrip", False), rstrip=spec.get("rstrip", False),
                                 single_word=spec.get("single_word", False)))
    return tokens
