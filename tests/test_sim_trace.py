"""Trace format (JSON Lines) and the ShareGPT trace builder."""

from __future__ import annotations

import json

import pytest

from hyla.data.sharegpt import load_conversations
from hyla.sim import sharegpt
from hyla.sim.sharegpt import Session, build_sessions, sessions_to_trace, typing_delay_s
from hyla.sim.trace import TraceRequest, load_trace, parse_request, write_trace


def _line(**kw) -> str:
    obj = {"session_id": 0, "turn_id": 0, "ts": 0.0, "input_tokens": [1, 2, 3], "output_tokens": [4]}
    obj.update(kw)
    return json.dumps(obj)


def test_round_trip_and_arrival_order(tmp_path):
    reqs = [
        TraceRequest("s1", 1, 2.5, [1, 2, 3, 4, 5], [6, 7], boundaries=(2, 5)),
        TraceRequest("s0", 0, 0.5, [9, 8], []),
    ]
    path = tmp_path / "t.jsonl"
    write_trace(path, reqs)
    loaded = load_trace(path)
    assert [r.session_id for r in loaded] == ["s0", "s1"]  # sorted by ts
    assert loaded[1] == reqs[0] and loaded[0] == reqs[1]
    assert "boundaries" not in path.read_text().splitlines()[1]  # optional field left out when empty


@pytest.mark.parametrize(
    "line, message",
    [
        ("not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        (json.dumps({"session_id": 0, "ts": 0, "input_tokens": [1], "output_tokens": []}), "missing field(s) turn_id"),
        (_line(input_tokens=[]), "input_tokens is empty"),
        (_line(input_tokens=[1, "x"]), "input_tokens must be a list of ints"),
        (_line(ts=-1), "ts must be a non-negative"),
        (_line(ts="soon"), "ts must be a number"),
        (_line(turn_id=-2), "turn_id must be a non-negative int"),
        (_line(boundaries=[2, 2]), "strictly increasing"),
        (_line(boundaries=[4]), "strictly increasing ints in [1, 3]"),
        (_line(input_tokens=[1, 2, -7]), "input_tokens must be non-negative token ids, got -7"),
        (_line(output_tokens=[-5, 3]), "output_tokens must be non-negative token ids, got -5"),
        # JSON's Infinity (and a number too large for a float) is no arrival time
        (_line(ts=float("inf")), "ts must be a non-negative finite number"),
        (_line().replace('"ts": 0.0', '"ts": 1e400'), "ts must be a non-negative finite number"),
        (_line(turn_id=True), "turn_id must be a non-negative int, got True"),
        (_line(session_id=[1]), "session_id must be an int or a string, got [1]"),
        (_line(session_id=None), "session_id must be an int or a string, got None"),
        (_line(session_id=False), "session_id must be an int or a string, got False"),
    ],
)
def test_bad_lines_name_the_line(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(_line() + "\n\n" + line + "\n")
    with pytest.raises(ValueError) as e:
        load_trace(path)
    assert f"{path}:3" in str(e.value) and message in str(e.value)


@pytest.mark.parametrize("line, message", [
    (_line().replace('"ts": 0.0', '"ts": 1' + "0" * 400), "ts must be a non-negative finite number"),  # > a float
    (_line().replace('"ts": 0.0', '"ts": -1' + "0" * 400), "ts must be a non-negative finite number"),
    (_line().replace("[1, 2, 3]", "[1" + "0" * 5000 + "]"), "not valid JSON (Exceeds the limit"),  # > int() takes
], ids=["huge-ts", "huge-negative-ts", "too-many-digits"])
def test_numbers_out_of_range_name_the_line(tmp_path, line, message):
    """Huge numbers are bad lines (a ValueError naming ``file:line``), not an OverflowError."""
    path = tmp_path / "huge.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(ValueError) as e:
        load_trace(path)
    assert f"{path}:1: " in str(e.value) and message in str(e.value)


def test_a_line_nested_too_deeply_names_the_line(tmp_path):
    """JSON nested deeper than the decoder's recursion allows is a bad line (a ValueError naming
    ``file:line``), not a RecursionError traceback."""
    path = tmp_path / "deep.jsonl"
    path.write_text(_line() + "\n" + "[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(ValueError) as e:
        load_trace(path)
    assert str(e.value) == f"{path}:2: not valid JSON (nested too deeply)"


def test_a_line_that_is_not_utf8_names_the_line(tmp_path):
    """Bytes that are not UTF-8 (a binary or Latin-1 file) are a bad line like any other: a ValueError
    naming ``file:line``, not a bare UnicodeDecodeError."""
    path = tmp_path / "latin1.jsonl"
    latin1 = _line(session_id="cafe").encode().replace(b"cafe", b"caf\xe9")  # "café" in Latin-1
    path.write_bytes(_line().encode() + b"\n" + latin1 + b"\n")
    with pytest.raises(ValueError) as e:
        load_trace(path)
    assert f"{path}:2: not UTF-8 text" in str(e.value)
    path.write_text(_line(session_id="caf\u00e9", turn_id=1) + "\n" + _line(session_id="\u4f1a\u8bdd") + "\n",
                    encoding="utf-8")
    assert [r.session_id for r in load_trace(path)] == ["caf\u00e9", "\u4f1a\u8bdd"]  # UTF-8 itself is fine


def test_empty_trace_is_an_error(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n")
    with pytest.raises(ValueError, match="no requests"):
        load_trace(path)
    with pytest.raises(ValueError, match="expected a JSON object"):
        parse_request("x")


class CharTokenizer:
    """One token per character: lengths are easy to work out by hand."""

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]


def _conv(*values: str) -> dict:
    roles = ("human", "gpt")
    return {"id": "x", "conversations": [{"from": roles[i % 2], "value": v} for i, v in enumerate(values)]}


def test_sessions_pick_first_with_enough_rounds_and_cap_tokens():
    convs = [_conv("a", "b"), _conv("hi there", "yo", "two words", "ok"), _conv("x", "y", "z", "w")]
    tok = CharTokenizer()
    sessions = build_sessions(num_sessions=2, min_rounds=2, max_tokens=1000, conversations=convs, tokenizer=tok)
    assert [s.source_id for s in sessions] == ["x", "x"] and [s.num_turns for s in sessions] == [2, 2]
    first = sessions[0]
    # each message is json.dumps-ed whole: {"from": "human", "value": "hi there"} is 38 characters
    assert len(first.messages[0]) == len(json.dumps({"from": "human", "value": "hi there"})) == 38
    assert first.user_words == (2, 2)
    # a cap below turn 1's input + output keeps only turn 0
    m0, m1 = (len(json.dumps(m)) for m in convs[1]["conversations"][:2])
    capped = build_sessions(1, 2, max_tokens=m0 + m1 + 1, conversations=convs, tokenizer=tok)
    assert capped[0].num_turns == 1
    with pytest.raises(ValueError, match="only 2 conversations"):
        build_sessions(3, 2, conversations=convs, tokenizer=tok)


def test_trace_from_sessions_histories_boundaries_and_typing_delays():
    s = Session(0, "a", ((1, 2), (3,), (4, 5, 6), (7, 8)), user_words=(5, 45))
    t = Session(1, "b", ((9,), (10,)), user_words=(3,))
    trace = sessions_to_trace([s, t], sessions_per_second=0.5, words_per_minute=90)
    by_key = {(r.session_id, r.turn_id): r for r in trace}
    assert list(by_key[0, 0].input_tokens) == [1, 2] and list(by_key[0, 0].output_tokens) == [3]
    assert list(by_key[0, 1].input_tokens) == [1, 2, 3, 4, 5, 6] and list(by_key[0, 1].output_tokens) == [7, 8]
    assert by_key[0, 1].boundaries == (2, 3, 6)  # ends of the user, reply and new user message
    assert by_key[0, 0].ts == 0.0
    assert by_key[0, 1].ts == pytest.approx(30.0)  # 45 words at 90 words per minute
    assert by_key[1, 0].ts == pytest.approx(2.0)  # session 1 starts at 1 / 0.5 s
    assert [r.ts for r in trace] == sorted(r.ts for r in trace)
    assert typing_delay_s(90, 90) == 60.0
    with pytest.raises(ValueError):
        sessions_to_trace([s], 0.0)


def test_packaged_sharegpt_protocol_set(tmp_path, monkeypatch):
    """The shipped ShareGPT file: 17,671 complete conversations, 524 with >= 10 rounds; the
    tokenized sessions are cached on disk and read back from there."""
    convs = load_conversations()
    assert len(convs) == 17671
    assert sum(len(c["conversations"]) // 2 >= 10 for c in convs) == 524
    monkeypatch.setenv("HYLA_CACHE_DIR", str(tmp_path))
    first = build_sessions(num_sessions=2)
    assert all(s.num_turns >= 10 for s in first)
    assert list(tmp_path.glob("sim/sharegpt-*.json"))
    monkeypatch.setattr(sharegpt, "load_conversations", lambda: pytest.fail("should read the cache"))
    assert build_sessions(num_sessions=2) == first


def test_any_non_negative_token_id_is_a_valid_trace(tmp_path):
    """The policy simulator only compares ids: a huge one is fine (the engine replay checks the vocabulary)."""
    path = tmp_path / "big.jsonl"
    path.write_text(_line(input_tokens=[0, 2, 2**40]) + "\n")
    assert list(load_trace(path)[0].input_tokens) == [0, 2, 2**40]
