"""Request traces: Marconi's JSON Lines format plus message boundaries.

One request per line::

    {"session_id": 3, "turn_id": 1, "ts": 12.5,
     "input_tokens": [...], "output_tokens": [...], "boundaries": [57, 412, 470]}

* ``session_id`` (an int or a string) / ``turn_id`` (a non-negative int): a multi-turn conversation
  and the request's place in it. Turn ``t + 1`` of a chat normally starts with turn ``t``'s input
  followed by its output.
* ``ts``: arrival time in seconds from the start of the trace (finite, non-negative).
* ``input_tokens``: the whole prompt (history + new message); ``output_tokens``: what the model
  answered (the simulator allocates them as decode output). Token ids are non-negative ints (the
  engine replay also needs them below the model's vocabulary size).
* ``boundaries`` (optional): token positions of message ends inside ``input_tokens``
  (``1 <= b <= len(input_tokens)``, strictly increasing). The ``hyla`` admission rule stores
  state checkpoints there, where a later conversation is likely to branch.
* ``priority`` (optional int, default 0): the request's priority for the engine replay with
  ``enable_priority_scheduling`` (``replay_engine``: admission order and preemption, as the engine's
  ``generate(priority=...)``); the policy simulator serves one request at a time and ignores it.

Invalid lines raise ``ValueError`` naming the line.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence


@dataclass(frozen=True)
class TraceRequest:
    session_id: int | str
    turn_id: int
    ts: float
    input_tokens: Sequence[int]
    output_tokens: Sequence[int]
    boundaries: tuple[int, ...] = ()
    priority: int = 0

    def __post_init__(self) -> None:
        where = f"request (session {self.session_id!r}, turn {self.turn_id})"
        if isinstance(self.session_id, bool) or not isinstance(self.session_id, (int, str)):
            raise ValueError(f"{where}: session_id must be an int or a string, got {self.session_id!r}")
        if isinstance(self.turn_id, bool) or not isinstance(self.turn_id, int) or self.turn_id < 0:
            raise ValueError(f"{where}: turn_id must be a non-negative int, got {self.turn_id!r}")
        if not (self.ts >= 0 and math.isfinite(self.ts)):  # also rejects NaN and infinity
            raise ValueError(f"{where}: ts must be a non-negative finite number of seconds, got {self.ts!r}")
        if len(self.input_tokens) == 0:
            raise ValueError(f"{where}: input_tokens is empty")
        prev = 0
        for b in self.boundaries:
            if not isinstance(b, int) or b <= prev or b > len(self.input_tokens):
                raise ValueError(
                    f"{where}: boundaries must be strictly increasing ints in [1, {len(self.input_tokens)}], "
                    f"got {list(self.boundaries)}"
                )
            prev = b
        if isinstance(self.priority, bool) or not isinstance(self.priority, int):
            raise ValueError(f"{where}: priority must be an int, got {self.priority!r}")

    @property
    def num_input_tokens(self) -> int:
        return len(self.input_tokens)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_tokens)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "session_id": self.session_id,
            "turn_id": self.turn_id,
            "ts": self.ts,
            "input_tokens": list(self.input_tokens),
            "output_tokens": list(self.output_tokens),
        }
        if self.boundaries:
            out["boundaries"] = list(self.boundaries)
        if self.priority:
            out["priority"] = self.priority
        return out


_REQUIRED = ("session_id", "turn_id", "ts", "input_tokens", "output_tokens")


def parse_request(obj: Any, where: str = "request") -> TraceRequest:
    """One decoded JSON object -> ``TraceRequest`` (``ValueError`` on a missing or mistyped field)."""
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    missing = [k for k in _REQUIRED if k not in obj]
    if missing:
        raise ValueError(f"{where}: missing field(s) {', '.join(missing)}")
    for key in ("input_tokens", "output_tokens", "boundaries"):
        value = obj.get(key, [])
        if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
            raise ValueError(f"{where}: {key} must be a list of ints")
        if key != "boundaries" and value and min(value) < 0:
            raise ValueError(f"{where}: {key} must be non-negative token ids, got {min(value)}")
    if not isinstance(obj["ts"], (int, float)) or isinstance(obj["ts"], bool):
        raise ValueError(f"{where}: ts must be a number, got {obj['ts']!r}")
    try:
        ts = float(obj["ts"])
    except OverflowError:  # an int too large for a float: refused as not finite
        ts = math.inf if obj["ts"] > 0 else -math.inf
    try:
        return TraceRequest(
            session_id=obj["session_id"],
            turn_id=obj["turn_id"],
            ts=ts,
            input_tokens=obj["input_tokens"],
            output_tokens=obj["output_tokens"],
            boundaries=tuple(obj.get("boundaries", ())),
            priority=obj.get("priority", 0),
        )
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


def load_trace(path: str | Path) -> list[TraceRequest]:
    """Read a JSON Lines trace, sorted by arrival (stable: ties keep file order)."""
    requests = []
    with open(path, "rb") as f:  # decoded line by line, so that bytes that are not UTF-8 name their line
        for lineno, raw in enumerate(f, 1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{where}: not UTF-8 text ({e.reason})") from None
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except ValueError as e:  # JSONDecodeError, or an integer of more digits than Python converts
                raise ValueError(f"{where}: not valid JSON ({getattr(e, 'msg', e)})") from None
            except RecursionError:  # (the decoder recurses once per level of nesting)
                raise ValueError(f"{where}: not valid JSON (nested too deeply)") from None
            requests.append(parse_request(obj, where))
    if not requests:
        raise ValueError(f"{path}: the trace has no requests")
    return sorted(requests, key=lambda r: r.ts)


def write_trace(path: str | Path, requests: Iterable[TraceRequest]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for r in requests:
            f.write(json.dumps(r.to_json(), separators=(",", ":")) + "\n")
