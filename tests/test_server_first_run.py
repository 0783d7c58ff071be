"""The first run (issue 13): `make serve` installs only runtime dependencies and says where `hyla` is;
the README's own chat example, sent to the built-in model, leaves sampling to the model's
generation_config.json defaults and gets an answer that does not loop (greedy decoding does: the
README says so); those defaults reach server requests."""

from __future__ import annotations

import collections
import json
import re
import shutil
import subprocess
from pathlib import Path

import httpx
import openai
import pytest

from hyla.server.app import create_app
from hyla.server.launch import BackgroundServer

REPO = Path(__file__).resolve().parent.parent


def _readme_chat_body() -> dict:
    """The JSON body of the README's curl chat example."""
    readme = (REPO / "README.md").read_text()
    match = re.search(r"curl -s http://127\.0\.0\.1:30000/v1/chat/completions .*? -d '(\{.*?\})'", readme, re.S)
    assert match, "the README's curl chat example is gone"
    return json.loads(match.group(1))


def _max_trigram_repeats(text: str) -> int:
    words = text.split()
    counts = collections.Counter(zip(words, words[1:], words[2:]))
    return max(counts.values(), default=0)


@pytest.fixture(scope="module")
def server():
    app = create_app(None, max_total_tokens=8192, max_state_slots=32)  # the built-in model
    with BackgroundServer(app) as srv:
        yield srv


def test_readme_chat_example_gets_the_model_defaults_and_no_loop(server):
    body = _readme_chat_body()
    assert body["model"] == "hyla-default"
    assert "temperature" not in body and "top_p" not in body  # the model's generation_config.json decides
    assert server.app.state.server.engine.sampling_defaults == {"temperature": 0.7, "top_p": 0.9}
    for seed in range(4):
        resp = httpx.post(server.url + "/v1/chat/completions", json={**body, "seed": seed}, timeout=60)
        assert resp.status_code == 200, resp.text
        text = resp.json()["choices"][0]["message"]["content"]
        assert re.search(r"[A-Za-z]{3}", text) and _max_trigram_repeats(text) <= 2, text
    # what the README warns of: at temperature 0 the question comes back, as the README quotes it
    quoted = re.search(r'`"temperature": 0` answers the example above with `(.*?)`', " ".join(
        (REPO / "README.md").read_text().split()))
    assert quoted, "the README no longer quotes the greedy answer"
    resp = httpx.post(server.url + "/v1/chat/completions", json={**body, "temperature": 0}, timeout=60)
    greedy = resp.json()["choices"][0]["message"]["content"]
    assert greedy.strip() == quoted.group(1), greedy


def test_generation_config_defaults_reach_server_requests(server):
    messages = [{"role": "user", "content": "Write a short story about a dog."}]  # not echoed back verbatim
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as client:
        def ids(**kwargs) -> str:
            resp = client.chat.completions.create(model="hyla-default", messages=messages, max_tokens=24, seed=7,
                                                  extra_body={"ignore_eos": True}, **kwargs)
            return resp.choices[0].message.content

        implicit = ids()
        assert implicit == ids(temperature=0.7, top_p=0.9)
        assert implicit != ids(temperature=1.0, top_p=1.0)


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_serve_installs_runtime_dependencies_only(tmp_path):
    """`make -n` prints the recipes without running them: serve's set-up installs the package without
    the dev extras and says where `hyla` is; test's adds the dev extras."""
    venv = tmp_path / "venv"  # not there: every set-up step is printed

    def dry_run(target: str) -> str:
        return subprocess.run(["make", "-n", "-C", str(REPO), target, f"VENV={venv}"], capture_output=True,
                              text=True, check=True).stdout

    serve = dry_run("serve")
    assert "install -q -e .\n" in serve and ".[dev]" not in serve
    assert f"{venv}/bin/hyla" in serve and "activate" in serve
    assert "-m hyla.cli serve" in serve
    assert '-e ".[dev]"' in dry_run("test")
