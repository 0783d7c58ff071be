"""``hyla serve --ssl-certfile/--ssl-keyfile``: HTTPS without a proxy in front (vLLM's flags), client
certificates with ``--ssl-ca-certs`` and ``--ssl-cert-reqs``, and the flags' errors. The certificates are
made here with the ``openssl`` command (self-signed, for 127.0.0.1)."""

from __future__ import annotations

import argparse
import shutil
import ssl
import subprocess
from pathlib import Path

import httpx
import pytest

from hyla.server import cli
from hyla.server.app import create_app
from hyla.server.launch import BackgroundServer
from hyla.server.tls import tls_error, tls_options
from test_server_openai import MODEL, make_chat_model

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")


def _self_signed(directory: Path, name: str) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 and its key: ``(cert, key)``."""
    cert, key = directory / f"{name}.pem", directory / f"{name}.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "2", "-subj", f"/CN={name}", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    return cert, key


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    directory = tmp_path_factory.mktemp("certs")
    return {name: _self_signed(directory, name) for name in ("server", "client", "stranger")}


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return make_chat_model(tmp_path_factory.mktemp("tls_model"))


def _app(model: Path):
    return create_app(model, served_model_name=MODEL, max_total_tokens=4096, max_state_slots=16,
                      chunked_prefill_size=256)


def test_https_serves_the_api_and_plain_http_is_refused(model, certs):
    cert, key = certs["server"]
    with BackgroundServer(_app(model), ssl_certfile=str(cert), ssl_keyfile=str(key)) as server:
        assert server.url.startswith("https://")
        with httpx.Client(verify=ssl.create_default_context(cafile=str(cert)), timeout=60) as client:
            assert client.get(server.url + "/health").status_code == 200  # (the loop's, after the handshake)
            assert client.get(server.url + "/v1/models").json()["data"][0]["id"] == MODEL
            r = client.post(server.url + "/v1/chat/completions", json={
                "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "temperature": 0})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
            with client.stream("POST", server.url + "/v1/completions", json={
                    "model": MODEL, "prompt": "Hi", "max_tokens": 3, "stream": True}) as s:
                assert s.status_code == 200 and list(s.iter_lines())[-2:] == ["data: [DONE]", ""]
        # a client that does not trust the certificate, and one that speaks plain HTTP, get nothing
        with pytest.raises(httpx.ConnectError):
            httpx.get(server.url + "/health", timeout=10)
        with pytest.raises(httpx.HTTPError):
            httpx.get(server.url.replace("https://", "http://") + "/health", timeout=10)
        with httpx.Client(verify=ssl.create_default_context(cafile=str(cert)), timeout=60) as client:
            assert client.get(server.url + "/health").status_code == 200  # (still serving)


def test_client_certificates_are_required_with_cert_reqs_2(model, certs):
    cert, key = certs["server"]
    client_cert, client_key = certs["client"]
    with BackgroundServer(_app(model), ssl_certfile=str(cert), ssl_keyfile=str(key), ssl_ca_certs=str(client_cert),
                          ssl_cert_reqs=ssl.CERT_REQUIRED) as server:
        trust = ssl.create_default_context(cafile=str(cert))
        trust.load_cert_chain(str(client_cert), str(client_key))
        with httpx.Client(verify=trust, timeout=60) as client:
            assert client.get(server.url + "/v1/models").status_code == 200
        for who in (None, "stranger"):  # no certificate, or one the server's CA file does not hold
            context = ssl.create_default_context(cafile=str(cert))
            if who is not None:
                context.load_cert_chain(*(str(p) for p in certs[who]))
            with pytest.raises(httpx.HTTPError):
                httpx.get(server.url + "/v1/models", verify=context, timeout=10)


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return parser.parse_args(argv)


def test_tls_flags_are_checked_before_anything_loads(certs, tmp_path, capsys):
    cert, key = certs["server"]
    locked = tmp_path / "locked.key"  # the key, encrypted
    subprocess.run(["openssl", "pkey", "-in", str(key), "-out", str(locked), "-aes256", "-passout", "pass:sesame"],
                   check=True, capture_output=True)
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate")
    for argv, message in (
            (["--ssl-certfile", str(cert)], "go together"),
            (["--ssl-keyfile", str(key)], "go together"),
            (["--ssl-cert-reqs", "2"], "need --ssl-certfile"),
            (["--ssl-certfile", str(cert), "--ssl-keyfile", str(key), "--ssl-cert-reqs", "2"], "needs --ssl-ca-certs"),
            (["--ssl-certfile", str(garbage), "--ssl-keyfile", str(key)], "cannot use the TLS certificate"),
            (["--ssl-certfile", str(cert), "--ssl-keyfile", str(tmp_path / "missing.key")], "cannot use"),
            (["--ssl-certfile", str(cert), "--ssl-keyfile", str(locked)], "cannot use"),  # (no password: no prompt)
            (["--ssl-certfile", str(cert), "--ssl-keyfile", str(locked), "--ssl-keyfile-password", "wrong"], "cannot use"),
            (["--ssl-certfile", str(garbage), "--ssl-keyfile", str(key), "--dp-size", "2"], "cannot use")):
        assert cli.run(_parse(argv)) == 2, argv
        assert message in capsys.readouterr().err, argv
    args = _parse(["--ssl-certfile", str(cert), "--ssl-keyfile", str(key)])
    assert tls_error(args) is None
    assert tls_options(args) == {"ssl_certfile": str(cert), "ssl_keyfile": str(key), "ssl_keyfile_password": None,
                                     "ssl_ca_certs": None, "ssl_cert_reqs": 0}
    assert tls_error(_parse(["--ssl-certfile", str(cert), "--ssl-keyfile", str(locked),
                             "--ssl-keyfile-password", "sesame"])) is None
    assert tls_options(_parse([])) == {}


def test_hyla_route_serves_https_and_data_parallel_workers_serve_http(certs, capsys, monkeypatch):
    """``hyla route`` takes the same flags (checked, exit 2) and gives them to uvicorn; behind ``hyla serve
    --dp-size`` TLS is the router's: the workers, on 127.0.0.1, do not inherit the flags."""
    from hyla.router import cli as route_cli
    from hyla.router.launch import worker_argv

    cert, key = certs["server"]
    parser = argparse.ArgumentParser()
    route_cli.add_arguments(parser)
    ran = {}
    monkeypatch.setattr("uvicorn.run", lambda app, **kw: ran.update(kw))
    bad = parser.parse_args(["--worker-urls", "http://127.0.0.1:1", "--ssl-certfile", str(cert)])
    assert route_cli.run(bad) == 2 and "go together" in capsys.readouterr().err and not ran
    good = parser.parse_args(["--worker-urls", "http://127.0.0.1:1", "--ssl-certfile", str(cert),
                              "--ssl-keyfile", str(key)])
    assert route_cli.run(good) == 0 and ran["ssl_certfile"] == str(cert) and ran["ssl_keyfile"] == str(key)
    given = ["--model", "m", "--ssl-certfile", str(cert), f"--ssl-keyfile={key}", "--ssl-cert-reqs", "0",
             "--dp-size", "2"]
    assert worker_argv(given, 7000) == ["--model", "m", "--host", "127.0.0.1", "--port", "7000"]
