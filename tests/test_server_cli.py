"""``hyla serve``: flags generated from EngineArgs, argument errors, and the real command in a fresh
process (start-up summary and per-step log lines, a chat through the openai client, clean exit)."""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from hyla.cli import main
from hyla.engine.args import EngineArgs
from hyla.server import cli
from test_server_openai import make_chat_model

REPO = Path(__file__).resolve().parent.parent


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return parser.parse_args(argv)


def test_every_engine_option_is_a_flag_with_the_engine_default():
    fields = {f.name: f.default for f in dataclasses.fields(EngineArgs) if f.name != "model_path"}
    args = _parse([])
    assert cli.engine_options(args) == fields
    assert args.model_path is None and args.host == "127.0.0.1" and args.port == 30000 and args.api_key is None


def test_flags_reach_the_engine_options():
    args = _parse(["--model", "/models/x", "--max-total-tokens", "1000", "--no-enable-prefix-cache",
                   "--dtype", "bfloat16", "--state-memory-ratio", "0.3", "--debug-checks", "--host", "0.0.0.0",
                   "--port", "8080", "--api-key", "k", "--served-model-name", "m",
                   "--speculative-algorithm", "ngram", "--no-speculative-ngram-adaptive"])
    opts = cli.engine_options(args)
    assert opts["speculative_ngram_adaptive"] is False
    assert opts["max_total_tokens"] == 1000 and opts["enable_prefix_cache"] is False
    assert opts["dtype"] == "bfloat16" and opts["state_memory_ratio"] == 0.3 and opts["debug_checks"] is True
    assert (args.model_path, args.host, args.port, args.api_key, args.served_model_name) == (
        "/models/x", "0.0.0.0", 8080, "k", "m")
    EngineArgs(model_path=args.model_path, **opts)  # a valid EngineArgs
    assert cli.engine_options(_parse(["--skip-server-warmup"]))["warmup"] == "off"  # SGLang's flag
    assert cli.engine_options(_parse(["--warmup", "on"]))["warmup"] == "on"


def test_vllms_names_of_flags_reach_the_same_options():
    """A vLLM command line runs: its names of the flags that mean the same (``cli.FLAG_ALIASES``), and its
    ``--trust-remote-code``, which changes nothing (hyla runs no checkpoint code)."""
    opts = cli.engine_options(_parse(["--tokenizer", "/tok", "--max-model-len", "4096", "--max-num-seqs", "8",
                                      "--enforce-eager", "--trust-remote-code"]))
    assert (opts["tokenizer_path"], opts["context_length"], opts["max_running_requests"],
            opts["disable_cuda_graph"]) == ("/tok", 4096, 8, True)
    assert cli.engine_options(_parse(["--trust-remote-code"])) == cli.engine_options(_parse([]))
    assert cli.engine_options(_parse(["--no-enforce-eager"]))["disable_cuda_graph"] is False


def test_help_explains_every_flag(capsys, monkeypatch):
    # argparse wraps at the terminal's width, and may break a line at a hyphen ("compile-\ndecode"), which
    # joining the lines cannot undo: one line per help text, whatever terminal runs the tests
    monkeypatch.setenv("COLUMNS", "100000")
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--help"])
    assert exit_info.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # undo argparse's line wrapping
    for name, (_, help_text) in EngineArgs.field_help().items():
        if name != "model_path":
            assert "--" + name.replace("_", "-") in out
        assert " ".join(help_text.split()) in out
    assert "--no-enable-prefix-cache" in out and "--api-key" in out and "--port" in out


@pytest.mark.parametrize("argv", [["serve", "--dp", "2"], ["serve", "--prefill-w", "1"], ["route", "--worker", "http://a"]])
def test_abbreviated_flags_are_refused(argv, capsys):
    """``--dp 2`` for ``--dp-size 2`` would be passed on to each worker, which matches flags by their full names
    (``hyla serve --dp-size``): each would start a data-parallel set of its own."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and ("unrecognized arguments" in err or "required: --worker-urls" in err)


@pytest.mark.parametrize("argv, message", [
    (["--page-size", "0"], "page_size"),
    (["--dtype", "int3"], "dtype"),
    (["--state-memory-ratio", "-0.5"], "state_memory_ratio"),
    (["--warmup", "always"], "warmup"),
    (["--model", "/no/such/dir"], "config.json"),
    (["--port", "70000"], "--port"),
    (["--max-request-bytes", "0"], "--max-request-bytes"),
    (["--max-prompt-chars", "-3"], "--max-prompt-chars"),
    (["--shutdown-timeout", "-1"], "--shutdown-timeout"),
    (["--max-stored-responses", "-1"], "--max-stored-responses"),
    (["--max-stored-response-bytes", "-5"], "--max-stored-response-bytes"),
    (["--media-fetch-timeout", "0"], "--media-fetch-timeout must be a finite number of seconds > 0, got 0.0"),
    (["--media-fetch-timeout", "-1"], "--media-fetch-timeout must be a finite number of seconds > 0"),
    (["--media-fetch-timeout", "nan"], "--media-fetch-timeout must be a finite number of seconds > 0"),
    (["--media-fetch-timeout", "inf"], "--media-fetch-timeout must be a finite number of seconds > 0"),
    (["--served-model-name", ""], "--served-model-name must not be empty"),
    (["--dp-size", "2", "--served-model-name", ""], "--served-model-name must not be empty"),  # (before any worker)
])
def test_bad_options_exit_2_with_a_message(argv, message, capsys):
    assert cli.run(_parse(argv)) == 2
    err = capsys.readouterr().err
    assert message in err and err.startswith("hyla serve: error: ") and "Traceback" not in err


@pytest.mark.parametrize("argv, message", [
    (["--router-policy", "round_robin"], "--router-policy set without --dp-size above 1 or --prefill-workers"),
    (["--dp-size", "1", "--router-read-timeout", "30"], "--router-read-timeout set without --dp-size above 1"),
    (["--local-prefill-tokens", "64"], "--local-prefill-tokens set without --prefill-workers"),
    (["--dp-size", "2", "--local-prefill-tokens", "0"], "--local-prefill-tokens set without --prefill-workers"),
    (["--log-requests-level", "3"], "--log-requests-level set without --log-requests"),
    (["--no-speculative-ngram-adaptive"], "speculative_ngram_adaptive set without speculative_algorithm='ngram'"),
    (["--enforce-eager", "--cuda-graph-max-extend-tokens", "64"], "cuda_graph_max_extend_tokens set with "
                                                                   "disable_cuda_graph"),
])
def test_a_flag_of_a_feature_that_is_off_is_refused(argv, message, capsys):
    """A flag that would be ignored (the engine's rule, ``EngineArgs``, for the server's own flags too): status 2
    and a message naming it, before anything starts."""
    assert cli.run(_parse(argv)) == 2
    err = capsys.readouterr().err
    assert message in err and "which would ignore it" in err


@pytest.mark.parametrize("argv", [
    [],
    ["--router-policy", "cache_aware", "--local-prefill-tokens", "512", "--log-requests-level", "2"],  # defaults
    ["--dp-size", "2", "--router-policy", "round_robin", "--router-read-timeout", "30"],
    ["--prefill-workers", "1", "--router-policy", "least_load", "--local-prefill-tokens", "0"],
    ["--log-requests", "--log-requests-level", "0"],
])
def test_a_flag_of_a_feature_that_is_on_or_at_its_default_is_taken(argv):
    assert cli._ignored_flags_error(_parse(argv)) is None


def test_an_empty_served_model_name_is_refused_by_the_app_too():
    from hyla.server.app import create_app

    with pytest.raises(ValueError, match="served_model_name must be a non-empty string"):
        create_app(None, served_model_name="")
    create_app(None, served_model_name="m")  # (the engine starts with the app's lifespan: nothing loads here)


@pytest.mark.parametrize("argv, message", [
    (["foo"], "argument command: invalid choice: 'foo' (choose from "),  # (the choices as this Python quotes them)
    (["--bogus", "serve"], "unrecognized arguments: --bogus"),
])
def test_an_unknown_subcommand_is_an_argparse_error(argv, message, capsys):
    """``hyla foo``: argparse's usual error and status 2 (it printed the help alone); ``hyla`` alone and ``hyla
    --help`` print the help, status 0."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    captured = capsys.readouterr()
    assert exit_info.value.code == 2 and message in captured.err and captured.err.startswith("usage: hyla")
    for argv in ([], ["--help"]):
        assert main(argv) == 0 and "Serving engine for hybrid LLMs." in capsys.readouterr().out


def test_wrong_typed_flag_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        _parse(["--max-total-tokens", "lots"])
    assert exit_info.value.code == 2 and "invalid int value" in capsys.readouterr().err


def test_image_flags_take_json_objects(capsys):
    """vLLM's --limit-mm-per-prompt and --mm-processor-kwargs: JSON objects, checked as the engine checks them."""
    args = _parse(["--limit-mm-per-prompt", '{"image": 2}', "--mm-processor-kwargs", '{"max_pixels": 4096}'])
    options = cli.engine_options(args)
    assert options["limit_mm_per_prompt"] == {"image": 2} and options["mm_processor_kwargs"] == {"max_pixels": 4096}
    for bad in ("2", "[1]", "{image: 2}"):
        with pytest.raises(SystemExit) as exit_info:
            _parse(["--limit-mm-per-prompt", bad])
        assert exit_info.value.code == 2 and "a JSON object" in capsys.readouterr().err
    assert cli.run(_parse(["--limit-mm-per-prompt", '{"audio": 1}'])) == 2
    assert "not a modality" in capsys.readouterr().err
    assert cli.run(_parse(["--mm-processor-kwargs", '{"max_pixels": 0}'])) == 2
    assert "max_pixels must be an integer" in capsys.readouterr().err


def test_cors_flags_take_json_lists(capsys):
    """vLLM's CORS flags: JSON lists of strings, any origin by default."""
    args = _parse([])
    assert (args.allowed_origins, args.allowed_methods, args.allowed_headers, args.allow_credentials) == (
        ["*"], ["*"], ["*"], False)
    args = _parse(["--allowed-origins", '["https://ui.example", "http://localhost:3000"]',
                   "--allowed-headers", '["content-type"]', "--allow-credentials"])
    assert args.allowed_origins == ["https://ui.example", "http://localhost:3000"]
    assert args.allowed_headers == ["content-type"] and args.allow_credentials
    assert _parse(["--allowed-origins", "[]"]).allowed_origins == []
    for bad, message in (("https://ui.example", "not JSON"), ('{"a": 1}', "a JSON list of strings"), ("[1]", "list")):
        with pytest.raises(SystemExit) as exit_info:
            _parse(["--allowed-origins", bad])
        assert exit_info.value.code == 2 and message in capsys.readouterr().err


# --------------------------------------------------------------------------------------------
# the real command
# --------------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServeProcess:
    """``python -m hyla.cli serve ...`` in a fresh process, its output in a file."""

    def __init__(self, args: list[str], log_path: Path, timeout: float = 180.0):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "hyla.cli", "serve", "--port", str(self.port), *args],
            cwd=REPO, env=env, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while True:
            assert self.proc.poll() is None, f"hyla serve exited early:\n{self.log()}"
            assert time.monotonic() < deadline, f"hyla serve did not come up:\n{self.log()}"
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)

    def log(self) -> str:
        return self.log_path.read_text()

    def stop(self, sig: int = signal.SIGINT) -> int:
        self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout=30)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
            self._log.close()


@pytest.mark.slow
def test_serve_command_in_a_fresh_process(tiny_ckpt_dir, tmp_path):
    model_dir = make_chat_model(tiny_ckpt_dir)
    server = ServeProcess(["--model", str(model_dir), "--served-model-name", "tiny", "--api-key", "secret",
                           "--max-total-tokens", "4096", "--max-state-slots", "16", "--log-interval", "1"],
                          tmp_path / "serve.log")
    try:
        with openai.OpenAI(base_url=server.url + "/v1", api_key="secret", max_retries=0) as client:
            resp = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                                  max_tokens=4, temperature=0)
        assert resp.usage.completion_tokens >= 1
        assert httpx.get(server.url + "/v1/models").status_code == 401  # --api-key took effect
    finally:
        code = server.stop()
    log = server.log()
    assert code == 0, log
    assert "hyla engine: model=" in log and "KV pool=4096 tokens" in log and "state pool=16 slots" in log
    assert "Prefill batch." in log and "Decode batch." in log  # the engine's per-step lines at INFO
    assert f"http://127.0.0.1:{server.port}" in log  # bound to localhost by default


@pytest.mark.slow
def test_default_model_answers_a_chat_in_a_fresh_process(tmp_path):
    """``hyla serve`` with no --model: the built-in default model, served as ``hyla-default``."""
    server = ServeProcess(["--max-total-tokens", "8192", "--max-state-slots", "32"], tmp_path / "serve.log")
    messages = [{"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "Can you give me some tips for writing a good cover letter?"}]
    try:
        with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as client:
            assert [m.id for m in client.models.list().data] == ["hyla-default"]
            first = client.chat.completions.create(model="hyla-default", messages=messages, max_tokens=24,
                                                   temperature=0)
            again = client.chat.completions.create(model="hyla-default", messages=messages, max_tokens=24,
                                                   temperature=0)
    finally:
        code = server.stop()
    assert code == 0, server.log()
    text = first.choices[0].message.content
    words = re.findall(r"[A-Za-z']+", text)
    assert len(words) >= 4, text  # an answer made of words, not an empty or byte-garbage string
    assert sum(map(len, words)) >= 0.6 * len(re.sub(r"\s", "", text)), text
    assert first.usage.completion_tokens >= 1 and first.usage.prompt_tokens > 20
    assert again.choices[0].message.content == text  # greedy, and the prefix cache changes nothing
    assert again.usage.prompt_tokens_details.cached_tokens == first.usage.prompt_tokens - 1
    assert "hyla engine: model=" in server.log() and "default-model" in server.log()


def test_port_in_use_is_refused_before_loading(capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        start = time.monotonic()
        assert cli.run(_parse(["--port", str(port)])) == 2
    assert time.monotonic() - start < 2  # the model was not loaded first
    assert f"cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err


def test_cuda_without_cuda_is_an_error_not_a_traceback(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert cli.run(_parse(["--device", "cuda"])) == 2
    assert "no CUDA device" in capsys.readouterr().err


def test_the_command_line_imports_no_torch_before_it_serves():
    """``hyla serve --help`` and argument errors answer in about a second: the CLI's modules import neither
    torch nor the engine (which take ~2.5 s) until a server starts."""
    probe = "import sys, hyla.server.cli; print(sorted(m for m in ('torch', 'hyla.engine.engine') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr
