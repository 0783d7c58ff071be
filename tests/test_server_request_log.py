"""``--log-requests``: a log line for each request as it ends (``hyla.server.request_log``)."""

from __future__ import annotations

import json
import logging
import re

import httpx
import pytest

from hyla.server.app import create_app
from hyla.server.launch import BackgroundServer
from hyla.server.request_log import PARTIAL_CHARS, RequestLog
from test_server_openai import MODEL, SYSTEM, make_chat_model

LOGGER = "hyla.server.requests"


class _Decoder:
    def decode(self, ids, skip_special_tokens=True):
        assert skip_special_tokens is False  # (the prompt as the model read it)
        return "".join(chr(97 + i % 26) for i in ids)


def _line(caplog, level: int, prompt, output: str = "out\nput", **meta) -> str:
    caplog.clear()
    meta = {"finish_reason": {"type": "stop", "matched": "\n"}, "prompt_tokens": 3, "cached_tokens": 1,
            "completion_tokens": 2, **meta}
    RequestLog(level).ended("chat", "r-1", prompt, {"temperature": 0.5}, meta, output, 10.0, 10.25, 11.5, _Decoder())
    (record,) = [r for r in caplog.records if r.name == LOGGER]
    return record.getMessage()


def test_each_level_says_more(caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    line = _line(caplog, 0, [0, 1, 2])
    assert line == ('request ended: rid=r-1 endpoint=chat finish=(stop matched="\\n") prompt_tokens=3 '
                    "cached_tokens=1 completion_tokens=2 ttft=0.250s e2e=1.500s")
    assert _line(caplog, 1, [0, 1, 2]) == line + ' sampling_params={"temperature": 0.5}'
    # level 2: the prompt (token ids decoded) and the output, as JSON strings: one line whatever they hold
    assert _line(caplog, 2, [0, 1, 2]).endswith('sampling_params={"temperature": 0.5} prompt="abc" output="out\\nput"')
    assert "\n" not in _line(caplog, 2, "a\nb")
    long_ids, long_text = list(range(PARTIAL_CHARS + 5)), "x" * (PARTIAL_CHARS + 7)
    partial = _line(caplog, 2, long_ids, long_text)
    assert "(+5 more tokens)" in partial and "(+7 more characters)" in partial
    whole = _line(caplog, 3, long_ids, long_text)
    assert "more" not in whole and json.dumps(long_text) in whole
    # a request the client left before the engine ended it: an abort, its cause the client
    assert "finish=(abort cause=\"client\")" in _line(caplog, 0, [1], finish_reason=None)
    for level in (4, -1, True, "2"):
        with pytest.raises(ValueError, match="log_requests_level"):
            RequestLog(level)


@pytest.fixture(scope="module")
def server(tiny_ckpt_dir):
    app = create_app(make_chat_model(tiny_ckpt_dir), served_model_name=MODEL, max_total_tokens=4096,
                     max_state_slots=16, log_requests_level=2)
    with BackgroundServer(app) as srv:
        yield srv


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_every_request_is_logged_as_it_ends(server, caplog, stream):
    caplog.set_level(logging.INFO, logger=LOGGER)
    body = {"model": MODEL, "messages": [SYSTEM, {"role": "user", "content": "Hi"}], "max_tokens": 5,
            "temperature": 0, "n": 2, "stream": stream}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, headers={"X-Request-Id": "trace-7"}, timeout=60)
    assert r.status_code == 200
    lines = [rec.getMessage() for rec in caplog.records if rec.name == LOGGER]
    assert len(lines) == 2  # (one per choice: each is an engine request)
    for i, line in enumerate(sorted(lines)):
        assert re.search(rf"rid=trace-7-{i}-[0-9a-f]{{8}} endpoint=chat finish=\((stop|length)", line), line
        assert "completion_tokens=5" in line or "finish=(stop" in line
        assert '"max_new_tokens": 5' in line and 'prompt="<|im_start|>system' in line
    if not stream:
        texts = {json.dumps(c["message"]["content"], ensure_ascii=False) for c in r.json()["choices"]}
        assert {line.rsplit(" output=", 1)[1] for line in lines} == texts
