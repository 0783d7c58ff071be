"""``hyla serve --dp-size N [--prefill-workers M]``: N workers (and M prefill workers) and the router
in one command (SGLang's ``--dp-size``).

The command starts N (+ M) ``hyla serve`` processes with the same flags (each on a free port of
127.0.0.1, and with ``--device cuda`` each on a GPU of its own: the i-th of ``CUDA_VISIBLE_DEVICES``,
or GPU i), waits until every one answers ``/health``, then serves the router (``hyla route``'s
cache-aware policy; with M prefill workers, ``--prefill-urls``: the first N decode, the last M
prefill) on ``--host``/``--port`` in this process. When it stops (SIGTERM, Ctrl-C), the
workers are stopped too (SIGTERM: each drains as a single ``hyla serve`` does); a worker that fails
to start stops the command.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Any

import httpx

from hyla.server.tls import tls_options

logger = logging.getLogger("hyla.router")

# flags of `hyla serve` a worker does not inherit (its own port on localhost, over HTTP: TLS is the router's; no data
# parallelism of its own)
NOT_INHERITED = ("--dp-size", "--prefill-workers", "--local-prefill-tokens", "--router-policy", "--router-read-timeout",
                 "--port", "--host", "--ssl-certfile", "--ssl-keyfile", "--ssl-keyfile-password", "--ssl-ca-certs",
                 "--ssl-cert-reqs")


def worker_argv(given: list[str], port: int) -> list[str]:
    """``hyla serve``'s own arguments as given, for a worker on ``127.0.0.1:port``."""
    out, skip = [], False
    for arg in given:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in NOT_INHERITED:
            skip = "=" not in arg
            continue
        out.append(arg)
    return out + ["--host", "127.0.0.1", "--port", str(port)]


def worker_devices(device: str, n: int) -> list[str | None]:
    """What ``CUDA_VISIBLE_DEVICES`` each of ``n`` workers gets (None: the environment's, on CPU)."""
    if device == "cpu":
        return [None] * n
    if device != "cuda":
        raise ValueError(f"with --dp-size each worker takes a GPU of its own: use --device cuda, not {device!r}")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [d.strip() for d in visible.split(",") if d.strip()] if visible else None
    if ids is None:
        import torch

        ids = [str(i) for i in range(torch.cuda.device_count())]
    if len(ids) < n:
        raise ValueError(f"{n} workers (--dp-size and --prefill-workers) need {n} GPUs; {len(ids)} are visible")
    return ids[:n]


def free_port() -> int:
    """A port of 127.0.0.1 free now (the OS's pick)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def router_options(args: argparse.Namespace) -> dict[str, Any]:
    """``create_router_app``'s options from ``hyla serve``'s flags: the workers' key, body cap and CORS, and the
    router's own (``--router-policy``, ``--router-read-timeout``, ``--local-prefill-tokens``)."""
    from hyla.server.cors import cors_options

    return dict(policy=args.router_policy, read_timeout=args.router_read_timeout, api_key=args.api_key,
                max_request_bytes=args.max_request_bytes, local_prefill_tokens=args.local_prefill_tokens,
                **cors_options(args))


def _exit_on_sigterm(signum: int, frame: object) -> None:
    """A SIGTERM that reaches the command after its router has shut down: exit through the ``finally`` that stops
    the workers (status 0, as a single server's SIGTERM)."""
    raise SystemExit(0)


def serve_data_parallel(args: argparse.Namespace, given: list[str]) -> int:
    """Run ``hyla serve`` with ``args.dp_size`` workers behind the router; ``given``: the command's
    own arguments, passed on to the workers."""
    import uvicorn

    from hyla.router.app import create_router_app

    n = args.dp_size + args.prefill_workers
    try:
        devices = worker_devices(args.device, n)
    except ValueError as exc:
        print(f"hyla serve: error: {exc}", file=sys.stderr)
        return 2
    workers: list[tuple[subprocess.Popen, str]] = []
    # SIGTERM (a container's stop) as SIGINT, from the first worker's start: it exits through the ``finally`` that
    # stops the workers. uvicorn re-raises the signal it caught once it has shut down, and the default handler
    # killed the command there (or while the workers loaded), before they were stopped: left running, their ports
    # and devices held
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        for i, device in enumerate(devices):
            port = free_port()
            env = dict(os.environ)
            if device is not None:
                env["CUDA_VISIBLE_DEVICES"] = device
            proc = subprocess.Popen([sys.executable, "-m", "hyla.cli", "serve", *worker_argv(given, port)], env=env)
            workers.append((proc, f"http://127.0.0.1:{port}"))
        logger.info("started %d workers: %s; waiting for them to load", n, " ".join(url for _, url in workers))
        for proc, url in workers:
            while True:
                if proc.poll() is not None:
                    print(f"hyla serve: error: the worker for {url} exited with status {proc.returncode} before it "
                          "served (its log is above)", file=sys.stderr)
                    return 1
                try:
                    if httpx.get(url + "/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.5)
        urls = [url for _, url in workers]
        app = create_router_app(urls[:args.dp_size], prefill_urls=urls[args.dp_size:], **router_options(args))
        tls = tls_options(args)
        logger.info("the %d workers serve (%d prefill only); the router listens on %s://%s:%d", n,
                    args.prefill_workers, "https" if tls else "http", args.host, args.port)
        # (the router waits for its open answers as long as a worker drains its own)
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, log_config=None,
                    timeout_graceful_shutdown=max(5.0, args.shutdown_timeout), **tls)
        return 0
    finally:
        for proc, _ in workers:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        signal.signal(signal.SIGTERM, previous)  # (signalled, the workers drain and exit even if this is killed)
        deadline = time.monotonic() + args.shutdown_timeout + 30
        for proc, _ in workers:
            try:
                proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
