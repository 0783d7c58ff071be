"""LoRA adapters at the server (vLLM's API): ``--lora-modules``, a request's ``model`` naming an adapter at
every generating endpoint (``/generate``: SGLang's ``lora_path``), the adapters on ``/v1/models``,
``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``, their errors, and the router's broadcast.

Two servers: one whose engine is a real engine behind ``LoraShim`` (the engine's LoRA contract kept in a
dict, each submission's ``lora_name`` recorded: what the server passes, whatever the engine does with it),
and, where the engine has LoRA (``Engine.load_lora_adapter``), a real engine with real PEFT adapters:
an adapter's chat is the engine's own greedy output with that adapter, and not the base model's.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import httpx
import openai
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse

import checkpoints
from hyla.engine.engine import DEFAULT_MODEL_DIR, Engine
from hyla.engine.errors import RequestError
from hyla.router.app import create_router_app
from hyla.server import app as app_module
from hyla.server import cli
from hyla.server.app import Server, create_app
from hyla.server.launch import BackgroundServer
from hyla.server.lora_routes import LoraModule, parse_lora_module
from hyla.tokenizer import Tokenizer
from test_router import _Uvicorn

MODEL = "tiny-lora-base"
LORA_OPTIONS = ("enable_lora", "max_loras", "max_cpu_loras", "max_lora_rank")
SHIM_MAX_LORAS = 3
ENGINE_HAS_LORA = hasattr(Engine, "load_lora_adapter") and hasattr(checkpoints, "make_lora_adapter")


def make_chat_base(tmp_dir: Path) -> Path:
    """A tiny random two-layer Qwen3.5 (a linear-attention layer, an attention layer) with the built-in
    model's tokenizer and chat template."""
    tokenizer = Tokenizer.from_pretrained(DEFAULT_MODEL_DIR)
    path = checkpoints.make_qwen3_5(tmp_dir, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
                                    vocab_size=tokenizer.vocab_size, eos_token_id=tokenizer.eos_token_id)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEFAULT_MODEL_DIR / name, path / name)
    return path


def _fake_adapter(root: Path, name: str) -> Path:
    """A directory that passes the shim's (and the CLI's) check: an adapter_config.json."""
    path = root / name
    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4}))
    return path


class LoraShim:
    """The engine's LoRA contract (``load_lora_adapter``, ``unload_lora_adapter``, ``lora_adapters``, the
    ``lora_name`` of ``generate`` / ``async_generate`` / ``check_requests``) over a real engine: adapters are
    names in a dict; each submission's ``lora_name`` goes to ``submitted``, then the request runs on the base
    model. ``vanished``: names listed as loaded that the engine refuses at submission (unloaded between the
    server's check and the engine call)."""

    def __init__(self, engine: Engine):
        self._engine = engine
        self.adapters: dict[str, str] = {}
        self.submitted: list[str | None] = []
        self.vanished: set[str] = set()

    def __getattr__(self, name: str):
        return getattr(self._engine, name)

    def load_lora_adapter(self, name: str, path, *, replace: bool = False) -> None:
        if name in self.adapters and not replace:
            raise ValueError(f"a LoRA adapter named {name!r} is already loaded")
        if len(self.adapters) - (replace and name in self.adapters) >= SHIM_MAX_LORAS:
            raise ValueError(f"all {SHIM_MAX_LORAS} LoRA adapter slots are in use (max_loras)")
        if not (Path(path) / "adapter_config.json").is_file():
            raise ValueError(f"{path} is not a PEFT LoRA adapter directory (no adapter_config.json)")
        self.adapters[name] = str(path)

    def unload_lora_adapter(self, name: str) -> None:
        if name not in self.adapters:
            raise ValueError(f"no LoRA adapter named {name!r} is loaded")
        del self.adapters[name]

    def lora_adapters(self) -> dict[str, str]:
        return dict(self.adapters)

    def _take(self, lora_name) -> None:
        for name in lora_name if isinstance(lora_name, list) else [lora_name]:
            if name is not None and (name not in self.adapters or name in self.vanished):
                raise RequestError(f"no LoRA adapter named {name!r} is loaded", param="lora_name")
            self.submitted.append(name)

    def generate(self, *args, lora_name=None, **kwargs):
        self._take(lora_name)
        return self._engine.generate(*args, **kwargs)

    async def async_generate(self, *args, lora_name=None, **kwargs):
        self._take(lora_name)
        return await self._engine.async_generate(*args, **kwargs)

    def check_requests(self, requests):
        for r in requests:
            r = dict(r)
            self._take(r.pop("lora_name", None))
            self._engine.check_requests([r])


def _shim_engine(path, **options):
    return LoraShim(Engine(path, **{k: v for k, v in options.items() if k not in LORA_OPTIONS}))


@pytest.fixture(scope="module")
def adapter_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("adapters")


@pytest.fixture(scope="module")
def shim_server(tiny_ckpt_dir, adapter_root):
    modules = [LoraModule("sql", str(_fake_adapter(adapter_root, "sql"))),
               LoraModule("chat", str(_fake_adapter(adapter_root, "chat")), base_model_name="the-base")]
    app = create_app(make_chat_base(tiny_ckpt_dir), served_model_name=MODEL, lora_modules=modules,
                     max_total_tokens=4096, max_state_slots=32, chunked_prefill_size=256)
    with pytest.MonkeyPatch.context() as mp:  # (while it starts: the engine is made then)
        mp.setattr(app_module, "Engine", _shim_engine)
        srv = BackgroundServer(app).start()
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def shim(shim_server) -> LoraShim:
    engine = shim_server.app.state.server.engine
    engine.submitted.clear()
    engine.vanished.clear()
    return engine


def _post(srv, path: str, body: dict, **kw) -> httpx.Response:
    return httpx.post(srv.url + path, json=body, timeout=60, **kw)


def _chat_body(model: str, **extra) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 3, "temperature": 0,
            **extra}


def _error(answer: httpx.Response, status: int) -> dict:
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"}
    return error


# ----------------------------------------------------------------------------------------------
# the server's side, over the shim
# ----------------------------------------------------------------------------------------------
def test_models_list_the_adapters_of_lora_modules(shim_server, adapter_root):
    cards = httpx.get(shim_server.url + "/v1/models").json()["data"]
    assert [c["id"] for c in cards] == [MODEL, "sql", "chat"]
    base, sql, chat = cards
    assert base["parent"] is None and sql["parent"] == MODEL and chat["parent"] == "the-base"
    assert sql["root"] == str(adapter_root / "sql") and sql["max_model_len"] == base["max_model_len"]
    one = httpx.get(shim_server.url + "/v1/models/sql").json()
    assert one["id"] == "sql" and one["root"] == sql["root"] and one["parent"] == MODEL
    error = _error(httpx.get(shim_server.url + "/v1/models/nope"), 404)
    assert error["code"] == "model_not_found" and "'sql'" in error["message"] and repr(MODEL) in error["message"]


@pytest.mark.parametrize("model, lora", [(MODEL, None), ("sql", "sql")])
def test_every_generating_endpoint_passes_the_adapter(shim_server, shim, model, lora):
    """Chat, completions, Responses, Anthropic's messages (streamed too) and /generate's lora_path: each
    request reaches the engine with its adapter, and the answer names the model asked for."""
    answer = _post(shim_server, "/v1/chat/completions", _chat_body(model))
    assert answer.status_code == 200 and answer.json()["model"] == model, answer.text
    answer = _post(shim_server, "/v1/chat/completions", _chat_body(model, stream=True, n=2))
    chunks = [json.loads(line[6:]) for line in answer.text.splitlines() if line.startswith("data: {")]
    assert chunks and {c["model"] for c in chunks} == {model}
    answer = _post(shim_server, "/v1/completions", {"model": model, "prompt": ["a", "b"], "max_tokens": 2})
    assert answer.status_code == 200 and answer.json()["model"] == model, answer.text
    answer = _post(shim_server, "/v1/responses", {"model": model, "input": "Hi", "max_output_tokens": 2})
    assert answer.status_code == 200 and answer.json()["model"] == model, answer.text
    answer = _post(shim_server, "/v1/messages", {"model": model, "max_tokens": 2,
                                                 "messages": [{"role": "user", "content": "Hi"}]})
    assert answer.status_code == 200 and answer.json()["model"] == model, answer.text
    generate = {"text": "Hi", "sampling_params": {"max_new_tokens": 2}}
    answer = _post(shim_server, "/generate", {**generate, "lora_path": lora} if lora else generate)
    assert answer.status_code == 200, answer.text
    assert shim.submitted == [lora] * (1 + 2 + 2 + 1 + 1 + 1)


def test_generate_takes_one_adapter_per_item_of_a_batch(shim_server, shim):
    answer = _post(shim_server, "/generate", {"text": ["a", "b", "c"], "lora_path": ["sql", None, "chat"],
                                              "sampling_params": {"max_new_tokens": 1}})
    assert answer.status_code == 200 and len(answer.json()) == 3, answer.text
    assert shim.submitted == ["sql", None, "chat"]
    error = _error(_post(shim_server, "/generate", {"text": ["a", "b"], "lora_path": [None, "nope"]}), 400)
    assert error["param"] == "lora_path.1" and "'nope'" in error["message"]
    error = _error(_post(shim_server, "/generate", {"text": "a", "lora_path": "nope"}), 400)
    assert error["param"] == "lora_path"
    error = _error(_post(shim_server, "/generate", {"text": ["a", "b"], "lora_path": ["sql"]}), 400)
    assert error["param"] == "lora_path"
    assert shim.submitted == ["sql", None, "chat"]


def test_an_unknown_model_is_a_404_naming_what_is_served(shim_server, shim):
    for path, body in (("/v1/chat/completions", _chat_body("nope")),
                       ("/v1/completions", {"model": "nope", "prompt": "a"}),
                       ("/v1/responses", {"model": "nope", "input": "a"})):
        error = _error(_post(shim_server, path, body), 404)
        assert error["param"] == "model" and error["code"] == "model_not_found"
        assert "'nope'" in error["message"] and "'sql'" in error["message"]
    answer = _post(shim_server, "/v1/messages", {"model": "nope", "max_tokens": 2,
                                                 "messages": [{"role": "user", "content": "Hi"}]})
    assert answer.status_code == 404 and answer.json()["type"] == "error", answer.text
    assert shim.submitted == []


def test_an_adapter_unloaded_after_the_check_is_a_404_not_a_500(shim_server, shim):
    """The engine's refusal (a ``RequestError`` naming ``lora_name``) of an adapter unloaded between the
    server's check of ``model`` and the submission."""
    shim.vanished.add("sql")
    error = _error(_post(shim_server, "/v1/chat/completions", _chat_body("sql")), 404)
    assert error["param"] == "model" and error["code"] == "model_not_found"
    error = _error(_post(shim_server, "/v1/completions", {"model": "sql", "prompt": "a", "max_tokens": 1}), 404)
    assert error["param"] == "model"
    error = _error(_post(shim_server, "/generate", {"text": "a", "lora_path": "sql"}), 404)
    assert error["param"] == "lora_path"
    answer = _post(shim_server, "/v1/chat/completions", _chat_body("sql", stream=True))
    assert answer.status_code == 404, answer.text


def test_load_and_unload_endpoints(shim_server, shim, adapter_root):
    url = shim_server.url
    path = str(_fake_adapter(adapter_root, "extra"))
    error = _error(_post(shim_server, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(adapter_root)}),
                   400)
    assert "not a PEFT LoRA adapter" in error["message"] and error["param"] == "lora_path"
    answer = _post(shim_server, "/v1/load_lora_adapter", {"lora_name": "extra", "lora_path": path})
    assert answer.status_code == 200 and answer.headers["content-type"].startswith("text/plain"), answer.text
    assert answer.text == "Success: LoRA adapter 'extra' added successfully."
    assert [c["id"] for c in httpx.get(url + "/v1/models").json()["data"]] == [MODEL, "sql", "chat", "extra"]
    assert _post(shim_server, "/v1/chat/completions", _chat_body("extra")).status_code == 200
    assert shim.submitted == ["extra"]

    # the engine's refusals: a 400 with an OpenAI body, nothing changed
    error = _error(_post(shim_server, "/v1/load_lora_adapter", {"lora_name": "extra", "lora_path": path}), 400)
    assert "already loaded" in error["message"] and error["code"] == "invalid_lora_adapter"
    error = _error(_post(shim_server, "/v1/load_lora_adapter", {"lora_name": "four", "lora_path": path}), 400)
    assert "slots" in error["message"]
    error = _error(_post(shim_server, "/v1/load_lora_adapter", {"lora_name": MODEL, "lora_path": path}), 400)
    assert error["param"] == "lora_name"
    for body in ({"lora_name": "x"}, {"lora_name": "", "lora_path": path}, {"lora_name": "x", "lora_path": path,
                                                                             "extra": 1}):
        _error(_post(shim_server, "/v1/load_lora_adapter", body), 400)
    # load_inplace replaces one of that name
    answer = _post(shim_server, "/v1/load_lora_adapter", {"lora_name": "extra", "lora_path": path,
                                                          "load_inplace": True})
    assert answer.status_code == 200, answer.text

    answer = _post(shim_server, "/v1/unload_lora_adapter", {"lora_name": "extra"})
    assert answer.status_code == 200 and answer.text == "Success: LoRA adapter 'extra' removed successfully."
    assert "extra" not in shim.adapters
    error = _error(_post(shim_server, "/v1/unload_lora_adapter", {"lora_name": "extra"}), 404)
    assert error["param"] == "lora_name" and "'extra'" in error["message"]
    for bad in ("x" * 300, "a\nb"):  # a name no adapter could have: a 400, as a load's
        assert _error(_post(shim_server, "/v1/unload_lora_adapter", {"lora_name": bad}), 400)["param"] == "lora_name"
    _error(_post(shim_server, "/v1/chat/completions", _chat_body("extra")), 404)
    _error(httpx.get(url + "/v1/models/extra"), 404)


def test_the_adapter_endpoints_need_the_api_key(shim_server, shim, adapter_root):
    server = shim_server.app.state.server
    server.api_key = "k"
    try:
        body = {"lora_name": "keyed", "lora_path": str(_fake_adapter(adapter_root, "keyed"))}
        assert _post(shim_server, "/v1/load_lora_adapter", body).status_code == 401
        assert _post(shim_server, "/v1/unload_lora_adapter", {"lora_name": "sql"}).status_code == 401
        assert "keyed" not in shim.adapters and "sql" in shim.adapters
        assert _post(shim_server, "/v1/load_lora_adapter", body,
                     headers={"Authorization": "Bearer k"}).status_code == 200
        assert _post(shim_server, "/v1/unload_lora_adapter", {"lora_name": "keyed"},
                     headers={"Authorization": "Bearer k"}).status_code == 200
    finally:
        server.api_key = None


def test_a_bad_lora_module_fails_the_start_up(shim, adapter_root):
    server = Server(None, MODEL, None, {}, lora_modules=[LoraModule("ok", str(_fake_adapter(adapter_root, "ok"))),
                                                         LoraModule("bad", str(adapter_root / "missing"))])
    server.model_name = MODEL
    engine = LoraShim(shim._engine)
    with pytest.raises(ValueError, match="--lora-modules bad=.*missing: .*not a PEFT LoRA adapter"):
        server._load_lora_modules(engine)
    server = Server(None, MODEL, None, {}, lora_modules=[LoraModule(MODEL, str(adapter_root / "ok"))])
    server.model_name = MODEL
    with pytest.raises(ValueError, match="served model's"):
        server._load_lora_modules(LoraShim(shim._engine))


# ----------------------------------------------------------------------------------------------
# the command line
# ----------------------------------------------------------------------------------------------
def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return parser.parse_args(argv)


def test_lora_modules_flag_takes_vllms_forms():
    assert _parse([]).lora_modules is None
    args = _parse(["--lora-modules", "sql=/a/sql", "x=/b=c",
                   '{"name": "chat", "path": "/a/chat", "base_model_name": "base"}', "--port", "1"])
    assert args.lora_modules == [LoraModule("sql", "/a/sql"), LoraModule("x", "/b=c"),
                                 LoraModule("chat", "/a/chat", "base")]
    assert parse_lora_module('{"name": "n", "path": "p"}') == LoraModule("n", "p")
    for bad in ("sql", "=p", "n=", '{"name": "n"}', '{"name": "n", "path": "p", "rank": 2}', "{not json",
                '{"name": 1, "path": "p"}'):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_lora_module(bad)


def test_lora_modules_errors_before_anything_loads(capsys, adapter_root):
    good = str(_fake_adapter(adapter_root, "good"))
    cases = [(["--lora-modules", f"a={good}"], "--lora-modules needs --enable-lora"),
             (["--enable-lora", "--lora-modules", f"a={good}", f"a={good}"], "names 'a' more than once"),
             (["--enable-lora", "--served-model-name", "a", "--lora-modules", f"a={good}"], "--served-model-name"),
             (["--enable-lora", "--lora-modules", f"a={adapter_root / 'missing'}"], "no adapter_config.json"),
             (["--enable-lora", "--max-loras", "1", "--lora-modules", f"a={good}", f"b={good}"], "--max-loras holds 1"),
             (["--enable-lora", "--max-loras", "1", "--max-cpu-loras", "2", "--lora-modules", f"a={good}", f"b={good}",
               f"c={good}"], "--max-cpu-loras holds 2")]
    if not ENGINE_HAS_LORA:
        cases = cases[:1]
    for argv, message in cases:
        assert cli.run(_parse(["--port", "1", *argv])) == 2
        assert message in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------
# the router: the adapter endpoints reach every worker
# ----------------------------------------------------------------------------------------------
def _lora_worker() -> tuple[FastAPI, list]:
    app, calls = FastAPI(), []

    @app.get("/health")
    async def health():
        return JSONResponse({})

    @app.post("/v1/load_lora_adapter")
    @app.post("/v1/unload_lora_adapter")
    async def lora(request: Request):
        calls.append((request.url.path, await request.json()))
        return PlainTextResponse("Success")

    return app, calls


def test_the_router_sends_adapter_loads_to_every_worker():
    (a, a_calls), (b, b_calls) = _lora_worker(), _lora_worker()
    with _Uvicorn(a) as wa, _Uvicorn(b) as wb, _Uvicorn(create_router_app([wa.url, wb.url], health_interval=60)) as r:
        body = {"lora_name": "sql", "lora_path": "/a/sql"}
        assert httpx.post(r.url + "/v1/load_lora_adapter", json=body, timeout=30).text == "Success"
        assert httpx.post(r.url + "/v1/unload_lora_adapter", json={"lora_name": "sql"}, timeout=30).status_code == 200
        expected = [("/v1/load_lora_adapter", body), ("/v1/unload_lora_adapter", {"lora_name": "sql"})]
        assert a_calls == expected and b_calls == expected


# ----------------------------------------------------------------------------------------------
# a real engine with real adapters
# ----------------------------------------------------------------------------------------------
TARGETS = ("q_proj", "v_proj")
needs_lora = pytest.mark.skipif(not ENGINE_HAS_LORA, reason="the engine has no LoRA adapters yet")


@pytest.fixture(scope="module")
def lora_server(tiny_ckpt_dir, tmp_path_factory):
    base = make_chat_base(tiny_ckpt_dir)
    root = tmp_path_factory.mktemp("peft")
    sql = checkpoints.make_lora_adapter(root / "sql", base, target_modules=TARGETS, r=4, seed=0)
    app = create_app(base, served_model_name=MODEL, enable_lora=True, max_loras=2, max_lora_rank=8,
                     lora_modules=[LoraModule("sql", str(sql))], max_total_tokens=4096, max_state_slots=32,
                     chunked_prefill_size=256)
    with BackgroundServer(app) as srv:
        yield srv, base, root


def _greedy_chat(client: openai.OpenAI, model: str):
    return client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Tell me a story"}],
                                          max_tokens=8, temperature=0, extra_body={"return_token_ids": True,
                                                                                   "ignore_eos": True})


@needs_lora
def test_an_adapters_chat_is_the_engines_output_with_it(lora_server):
    srv, base, _ = lora_server
    engine = srv.app.state.server.engine
    with openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60) as client:
        assert [m.id for m in client.models.list().data] == [MODEL, "sql"]
        tuned, plain = _greedy_chat(client, "sql"), _greedy_chat(client, MODEL)
    assert tuned.model == "sql" and plain.model == MODEL
    ids = tuned.prompt_token_ids
    assert ids == plain.prompt_token_ids
    params = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}
    assert tuned.choices[0].token_ids == engine.generate(input_ids=ids, sampling_params=params,
                                                         lora_name="sql")["output_ids"]
    assert plain.choices[0].token_ids == engine.generate(input_ids=ids, sampling_params=params)["output_ids"]
    assert tuned.choices[0].token_ids != plain.choices[0].token_ids


@needs_lora
def test_real_adapters_load_and_unload(lora_server):
    srv, base, root = lora_server
    other = checkpoints.make_lora_adapter(root / "other", base, target_modules=TARGETS, r=4, seed=1)
    answer = _post(srv, "/v1/load_lora_adapter", {"lora_name": "other", "lora_path": str(other)})
    assert answer.status_code == 200, answer.text
    assert srv.app.state.server.engine.lora_adapters() == {"sql": srv.app.state.server.lora_adapters()["sql"],
                                                           "other": str(other)}
    with openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60) as client:
        first, second = _greedy_chat(client, "sql"), _greedy_chat(client, "other")
    assert first.choices[0].token_ids != second.choices[0].token_ids
    metrics = httpx.get(srv.url + "/metrics").text
    assert "hyla_num_lora_adapters 2.0" in metrics
    loads = [line for line in metrics.splitlines() if line.startswith("hyla_lora_slot_loads_total ")]
    assert loads and float(loads[0].split()[1]) >= 2
    assert 'hyla_lora_requests_info{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""}' in metrics
    # refusals of the engine: max_cpu_loras (2) loaded, not an adapter directory, a rank too large
    error = _error(_post(srv, "/v1/load_lora_adapter", {"lora_name": "third", "lora_path": str(other)}), 400)
    assert error["code"] == "invalid_lora_adapter"
    assert _post(srv, "/v1/unload_lora_adapter", {"lora_name": "other"}).status_code == 200
    _error(_post(srv, "/v1/load_lora_adapter", {"lora_name": "base", "lora_path": str(base)}), 400)
    big = checkpoints.make_lora_adapter(root / "big", base, target_modules=TARGETS, r=16, seed=0)
    _error(_post(srv, "/v1/load_lora_adapter", {"lora_name": "big", "lora_path": str(big)}), 400)
    _error(_post(srv, "/v1/unload_lora_adapter", {"lora_name": "other"}), 404)
    _error(_post(srv, "/v1/chat/completions", _chat_body("other")), 404)
    assert [c["id"] for c in httpx.get(srv.url + "/v1/models").json()["data"]] == [MODEL, "sql"]


@needs_lora
def test_an_adapter_the_engine_refuses_stops_the_start_up(lora_server):
    _, base, _ = lora_server
    server = Server(base, MODEL, None, dict(enable_lora=True, max_total_tokens=1024, max_state_slots=8),
                    lora_modules=[LoraModule("broken", str(base))])  # (a model directory, not an adapter)
    with pytest.raises(ValueError, match="--lora-modules broken=") as refused:
        server.start_engine()
    assert "adapter_config.json" in str(refused.value) and server.engine is None


@needs_lora
def test_an_adapters_prompt_moves_between_workers_in_its_namespace(lora_server):
    """Prefill/decode disaggregation with adapters: a chat naming an adapter, through a router with a prefill
    worker (a second server of the same model and adapter files), is computed there with the adapter and moved in
    the adapter's namespace: the decode worker finds all of its prompt but the last token cached, and answers
    the tokens and logprobs (within 1e-4) it gives computing the prompt itself; the base model's request of the
    same messages finds none of it. The base model's chat moves as before."""
    srv, base, _ = lora_server
    path = srv.app.state.server.engine.lora_adapters()["sql"]
    messages = [{"role": "user", "content": "Move this prompt to the decode worker, please. " * 6}]

    def chat(url: str, model: str):
        with openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60) as client:
            r = client.chat.completions.create(model=model, messages=messages, max_tokens=6, temperature=0,
                                               logprobs=True, extra_body={"ignore_eos": True})
        return r.choices[0].message.content, [t.logprob for t in r.choices[0].logprobs.content], \
            r.usage.prompt_tokens, r.usage.prompt_tokens_details.cached_tokens

    prefill_app = create_app(base, served_model_name=MODEL, enable_lora=True, max_loras=2, max_lora_rank=8,
                             lora_modules=[LoraModule("sql", path)], max_total_tokens=4096, max_state_slots=32,
                             chunked_prefill_size=256)
    texts = {}
    with BackgroundServer(prefill_app) as p:
        for model in ("sql", MODEL):
            for url in (srv.url, p.url):
                assert httpx.post(url + "/flush_cache", timeout=30).status_code == 200
            with _Uvicorn(create_router_app([srv.url], prefill_urls=[p.url], health_interval=3600,
                                            local_prefill_tokens=0)) as r:  # (every prompt moves)
                text, lps, prompt, cached = chat(r.url, model)
                exports = httpx.get(r.url + "/metrics").text
            assert cached == prompt - 1, (model, cached, prompt)  # moved: the decode worker computed one token
            assert 'hyla_router_prefix_imports_total{outcome="imported"} 1.0' in exports
            if model == "sql":  # (the base model's request of the same messages: the adapter's prefix is not its)
                assert chat(srv.url, MODEL)[3] == 0
            assert httpx.post(srv.url + "/flush_cache", timeout=30).status_code == 200
            cold_text, cold_lps, _, cold_cached = chat(srv.url, model)
            assert cold_cached == 0 and text == cold_text and len(lps) == len(cold_lps) == 6
            assert all(abs(a - b) <= 1e-4 for a, b in zip(lps, cold_lps)), model
            texts[model] = text
    assert texts["sql"] != texts[MODEL]
