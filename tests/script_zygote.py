"""Run ``python script.py ...`` from a process that has imported torch, transformers and hyla already.

Why: ``test_benchmark_scripts.py`` runs benchmark scripts (~25 runs), each in a process of its own, and
most of each run's CPU was imports (torch, transformers, hyla: 6-8 s of ~10 s). The zygote (this
file, run as a script) imports them once (``PRELOAD``), then forks a child for each run.

What a run gets (:meth:`Zygote.run`): what ``subprocess.run([sys.executable, *argv], cwd=cwd,
env=env, capture_output=True, text=True, timeout=timeout)`` gives. The child is that process but
for the modules already imported: ``sys.argv`` is ``argv``, ``__main__`` the script (``__file__``
absolute, ``sys.path[0]`` its folder), working directory and ``os.environ`` the run's, its random
states seeded anew (``random``, torch, numpy's); stdin is /dev/null (what pytest's capture gives a
subprocess), stdout and stderr files of its own. It exits as Python does (a ``SystemExit``'s code;
an uncaught exception's traceback on stderr and status 1; non-daemon threads joined, ``atexit``
handlers run, stdout and stderr flushed) but for the interpreter's teardown, skipped (~1 s of CPU
with these modules loaded): objects still alive are not finalized. A timeout kills the child and
raises :class:`subprocess.TimeoutExpired`.

What it guarantees: each run is a fresh fork of the zygote, and the zygote runs nothing but its
imports, so nothing a script does (threads, torch settings, globals, modules imported, files)
reaches the next run. The zygote's imports saw the environment it started with, so a run whose
environment differs (``PYTEST_CURRENT_TEST``, pytest's note of the test running, aside) runs as a
plain subprocess; so does every run where ``TRITON_INTERPRET`` is not 1 (the zygote defines hyla's
Triton kernels, and a script run on the CPU sets it before it imports them; it is unset only with
CUDA, which a fork does not survive either), and every run after the zygote failed to start or
held a thread besides its main one (a fork copies the forking thread alone: a started OpenMP team
would hang the child), with a warning saying why. Shared by every child: Python's hash seed.
"""

from __future__ import annotations

import atexit
import builtins
import importlib
import json
import os
import random
import select
import signal
import subprocess
import sys
import tempfile
import threading
import types
import warnings
from importlib.machinery import SourceFileLoader
from pathlib import Path
from typing import NoReturn

# what the benchmark scripts import that costs the most (their ``sys.modules`` at exit, ``python -X importtime``),
# ~9 s of CPU with the transformers model classes of hyla's architectures; none of it runs a torch op or starts a
# thread on import
PRELOAD = (
    "torch",
    "torch._dynamo",
    "torch._inductor.compile_fx",
    "transformers.modeling_utils",
    "transformers.generation",
    "transformers.models.auto.modeling_auto",
    "hyla.engine.engine",
    "hyla.model.architectures",
    "safetensors.torch",
    "tabulate",
)
IGNORED_ENV = "PYTEST_CURRENT_TEST"
START_TIMEOUT_S = 300


class Zygote:
    """A zygote, started by the first :meth:`run` with that run's working directory and environment."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.env: dict[str, str] | None = None
        self.broken = ""  # why runs go to plain subprocesses: set once, warned once

    def run(self, argv: list[str], *, cwd: Path, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
        """``subprocess.run([sys.executable, *argv], ...)``'s result, forked from the zygote where it can (the
        module docstring)."""
        if self.proc is None and not self.broken and env.get("TRITON_INTERPRET") == "1":
            self._start(cwd, env)
        if self.proc is None or _key(env) != self.env:
            return subprocess.run([sys.executable, *argv], cwd=cwd, env=env, capture_output=True, text=True,
                                  timeout=timeout)
        with tempfile.TemporaryDirectory(prefix="zygote-run-") as tmp:
            out, err = Path(tmp, "stdout"), Path(tmp, "stderr")
            forked = self._ask({"argv": argv, "cwd": str(cwd), "env": env, "stdout": str(out), "stderr": str(err)})
            status = self._answer(timeout) if "pid" in forked else {}
            if status is None:  # the timeout: kill the child as subprocess.run would, then collect it
                os.kill(forked["pid"], signal.SIGKILL)
                self._answer(None)
                raise subprocess.TimeoutExpired([sys.executable, *argv], timeout, out.read_text(), err.read_text())
            if not status:  # refused, or the zygote is gone: this run and the next as plain subprocesses
                self._break(forked.get("refused", "it exited"))
                return self.run(argv, cwd=cwd, env=env, timeout=timeout)
            return subprocess.CompletedProcess([sys.executable, *argv], os.waitstatus_to_exitcode(status["status"]),
                                               out.read_text(), err.read_text())

    def close(self) -> None:
        """Stop the zygote (its stdin closed, it exits); runs after this start another."""
        if self.proc is not None:
            self.proc.stdin.close()
            self.proc.wait()
            self.proc = None

    def _start(self, cwd: Path, env: dict[str, str]) -> None:
        if not hasattr(os, "fork"):
            self._break("os.fork is unavailable here")
            return
        self.env = _key(env)
        with tempfile.TemporaryFile() as log:  # the zygote's stderr: import warnings, a failed start's traceback
            self.proc = subprocess.Popen([sys.executable, __file__], cwd=cwd, env=self.env, stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=log, bufsize=0)
            if self._answer(START_TIMEOUT_S) != {"ready": True}:
                self.proc.kill()
                log.seek(0)
                self._break(f"it failed to start:\n{log.read().decode(errors='replace')[-3000:]}")

    def _break(self, why: str) -> None:
        warnings.warn(f"script_zygote: running scripts as plain subprocesses: {why}", stacklevel=3)
        self.broken = why
        self.close()

    def _ask(self, request: dict) -> dict:
        try:
            self.proc.stdin.write(json.dumps(request).encode() + b"\n")
        except BrokenPipeError:
            return {}
        return self._answer(None)

    def _answer(self, timeout: float | None) -> dict | None:
        """The zygote's next reply (``{}`` if it exited), or None after ``timeout`` seconds."""
        if not select.select([self.proc.stdout], [], [], timeout)[0]:
            return None
        line = self.proc.stdout.readline()  # unbuffered: reads this line alone, the next one stays for select
        return json.loads(line) if line else {}


def _key(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k != IGNORED_ENV}


def serve() -> dict | None:
    """The zygote: imports ``PRELOAD``, then forks a child per request read from stdin, replying
    ``{"pid"}`` then ``{"status"}`` (``os.waitpid``'s) on stdout. Returns the request in a child,
    None in the zygote once stdin closes."""
    requests, replies = os.fdopen(os.dup(0), "rb", buffering=0), os.fdopen(os.dup(1), "wb", buffering=0)
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)  # fds 0 and 1 as a child's stdin and stdout would be: /dev/null, not the replies pipe
    os.dup2(2, 1)
    os.close(devnull)
    for name in PRELOAD:
        importlib.import_module(name)
    import transformers
    from hyla.model.architectures import ARCHITECTURES

    for arch in ARCHITECTURES:  # (transformers imports a model's module at the first look-up of its class)
        getattr(transformers, arch, None)

    def reply(message: dict) -> None:
        replies.write(json.dumps(message).encode() + b"\n")

    reply({"ready": True})
    while line := requests.readline():
        if (threads := _threads()) > 1:
            reply({"refused": f"the zygote has {threads} threads (a fork copies only the forking one)"})
            continue
        sys.stdout.flush()  # (nothing of the zygote's written twice)
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            requests.close()
            replies.close()
            return json.loads(line)
        reply({"pid": pid})
        reply({"status": os.waitpid(pid, 0)[1]})
    return None


def _threads() -> int:
    """This process's threads, native ones included (Linux), else Python's."""
    try:
        return len(os.listdir("/proc/self/task"))
    except FileNotFoundError:
        return threading.active_count()


def become(request: dict) -> NoReturn:
    """In a forked child: run ``request``'s script as ``python argv...`` would (the module docstring)."""
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        file = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(file, fd)
        os.close(file)
    sys.argv = request["argv"]
    path = os.path.abspath(sys.argv[0])
    sys.path[0] = os.path.dirname(path)  # the zygote's own folder was there
    importlib.invalidate_caches()  # files written since the zygote's imports
    main = types.ModuleType("__main__")
    main.__file__, main.__cached__, main.__builtins__ = path, None, builtins
    main.__loader__ = SourceFileLoader("__main__", path)
    sys.modules["__main__"] = main
    _reseed()
    # not runpy.run_path: it sets sys.argv[0] to the path it is given, and leaves sys.path alone
    try:
        exec(compile(Path(path).read_bytes(), path, "exec", dont_inherit=True), main.__dict__)
        status = 0
    except SystemExit as e:
        status = _exit_status(e.code)
    except BaseException as e:  # noqa: BLE001  (as the interpreter handles an uncaught one)
        e.with_traceback(e.__traceback__.tb_next)  # the traceback from the script's own frame on
        sys.excepthook(type(e), e, e.__traceback__)
        status = 1
    # what the interpreter does at exit before its teardown (the module docstring), then no teardown
    threading._shutdown()  # non-daemon threads joined
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _reseed() -> None:
    """Seed what a fresh interpreter seeds from the OS's entropy, and a fork would share with every other run."""
    random.seed()
    torch = sys.modules["torch"]
    torch.seed()
    if "numpy.random" in sys.modules:
        sys.modules["numpy.random"].seed()


def _exit_status(code: object) -> int:
    """The status Python exits with for ``SystemExit(code)`` (printing a code that is neither None nor an int)."""
    if code is None or isinstance(code, int):
        return code or 0
    print(code, file=sys.stderr)
    return 1


if __name__ == "__main__":
    request = serve()
    if request is not None:
        become(request)
