"""Workloads for `hyla bench`: ShareGPT multi-turn sessions and random prompts with shared prefixes.

A workload is a list of ``BenchSession``; a session is a list of turns sent one after the other
(turn ``k + 1`` is sent when turn ``k`` has finished, with the server's own reply in its history),
so a multi-turn session exercises the server's prefix cache the way a chat client does. Random
prompts are one-turn sessions.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from hyla.data.sharegpt import load_conversations, sharegpt_rounds

# A fixed vocabulary of short common words: random prompts are sequences of them, about one
# token per word for BPE tokenizers (the server reports the exact prompt_tokens in its usage).
_WORDS = (
    "the of and to in is you that it he was for on are as with his they at be this have from or one "
    "had by word but not what all were we when your can said there use an each which she do how their "
    "if will up other about out many then them these so some her would make like him into time has look "
    "two more write go see number no way could people my than first water been call who oil its now find "
    "long down day did get come made may part over new sound take only little work know place year live "
    "me back give most very after thing our just name good sentence man think say great where help through "
    "much before line right too mean old any same tell boy follow came want show also around form three "
    "small set put end does another well large must big even such because turn here why ask went men read "
    "need land different home us move try kind hand picture again change off play spell air away animal "
    "house point page letter mother answer found study still learn should world high every near add food"
).split()


@dataclass(frozen=True)
class BenchTurn:
    user: str  # the new user message of this turn
    max_tokens: int  # output length asked of the server (ignore_eos where the backend supports it)


@dataclass(frozen=True)
class BenchSession:
    session_id: int
    turns: tuple[BenchTurn, ...]
    prefix: str = ""  # shared text placed before the first user message (random workload)

    @property
    def num_turns(self) -> int:
        return len(self.turns)


def random_text(rng: random.Random, num_words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(num_words))


def random_sessions(
    num_prompts: int,
    input_len: int,
    output_len: int,
    shared_prefix_ratio: float = 0.0,
    num_prefixes: int = 1,
    range_ratio: float = 1.0,
    seed: int = 0,
) -> list[BenchSession]:
    """One-turn sessions of ~``input_len`` words; the first ``shared_prefix_ratio`` of every prompt
    is one of ``num_prefixes`` shared prefixes (request ``i`` gets prefix ``i % num_prefixes``).

    With ``range_ratio < 1`` the input and output lengths are drawn uniformly from
    ``[ratio * len, len]``.
    """
    if num_prompts < 1 or input_len < 1 or output_len < 1:
        raise ValueError(f"need num_prompts, input_len and output_len >= 1, got {num_prompts}, {input_len}, {output_len}")
    if not 0.0 <= shared_prefix_ratio <= 1.0:
        raise ValueError(f"shared_prefix_ratio must be in [0, 1], got {shared_prefix_ratio}")
    if not 0.0 < range_ratio <= 1.0:
        raise ValueError(f"range_ratio must be in (0, 1], got {range_ratio}")
    if num_prefixes < 1:
        raise ValueError(f"num_prefixes must be >= 1, got {num_prefixes}")
    rng = random.Random(seed)
    prefix_words = round(input_len * shared_prefix_ratio)
    prefixes = [random_text(rng, prefix_words) for _ in range(num_prefixes)]
    sessions = []
    for i in range(num_prompts):
        n_in = rng.randint(max(1, int(input_len * range_ratio)), input_len)
        n_out = rng.randint(max(1, int(output_len * range_ratio)), output_len)
        own = max(1, n_in - prefix_words)
        prefix = prefixes[i % num_prefixes]
        sessions.append(BenchSession(i, (BenchTurn(random_text(rng, own), n_out),), prefix=prefix + " " if prefix else ""))
    return sessions


def sharegpt_sessions(
    num_sessions: int,
    min_turns: int = 1,
    max_turns: int | None = None,
    output_len: int | None = None,
    conversations: list[Any] | None = None,
) -> list[BenchSession]:
    """The first ``num_sessions`` ShareGPT conversations with at least ``min_turns`` rounds
    (:func:`sharegpt_rounds`: user message, then the recorded reply).

    Each turn sends the user's message; the output length asked is the number of words of the
    recorded reply (a cheap stand-in for its token count), or ``output_len`` (>= 1) when given.
    Raises ``ValueError`` for bad sizes or when fewer conversations qualify.
    """
    if num_sessions < 1 or min_turns < 1 or (max_turns is not None and max_turns < 1):
        raise ValueError(f"bad ShareGPT workload: {num_sessions=}, {min_turns=}, {max_turns=}")
    if output_len is not None and output_len < 1:
        raise ValueError(f"the ShareGPT output length must be >= 1 token (omit it for the recorded replies' "
                         f"lengths), got {output_len}")
    if conversations is None:
        conversations = load_conversations()
    sessions: list[BenchSession] = []
    for conv in conversations:
        rounds = sharegpt_rounds(conv)
        if len(rounds) < min_turns:
            continue
        turns = tuple(BenchTurn(user, output_len if output_len is not None else max(1, len(reply.split())))
                      for user, reply in rounds[:max_turns])
        sessions.append(BenchSession(len(sessions), turns))
        if len(sessions) == num_sessions:
            return sessions
    raise ValueError(f"only {len(sessions)} ShareGPT conversations have >= {min_turns} rounds, "
                     f"{num_sessions} asked")
