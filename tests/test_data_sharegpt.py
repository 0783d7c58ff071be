"""The shared ShareGPT loader: truncated-list parsing, rounds, selection."""

from __future__ import annotations

import pytest

from hyla.data.sharegpt import iter_json_list, num_rounds, select_conversations


def test_iter_json_list_stops_at_a_truncated_item():
    text = '[\n {"a": 1},\n {"b": [2, 3]},\n {"c": "cut'
    assert list(iter_json_list(text)) == [{"a": 1}, {"b": [2, 3]}]
    assert list(iter_json_list("[]")) == []
    with pytest.raises(ValueError):
        list(iter_json_list("{}"))


def _conv(num_messages: int, tag: str) -> dict:
    return {"id": tag, "conversations": [{"from": "human", "value": f"{tag}{i}"} for i in range(num_messages)]}


def test_rounds_are_pairs_of_messages_and_selection_keeps_order():
    convs = [_conv(1, "a"), _conv(4, "b"), _conv(3, "c"), _conv(5, "d"), {"id": "e"}]
    assert [num_rounds(c) for c in convs] == [0, 2, 1, 2, 0]
    assert [c["id"] for c in select_conversations(convs, 2, min_rounds=2)] == ["b", "d"]
    assert [c["id"] for c in select_conversations(convs, 1, min_rounds=1)] == ["b"]
    with pytest.raises(ValueError, match="only 2 conversations have >= 2 rounds, 3 asked"):
        select_conversations(convs, 3, min_rounds=2)
    with pytest.raises(ValueError):
        select_conversations(convs, 0, min_rounds=1)
