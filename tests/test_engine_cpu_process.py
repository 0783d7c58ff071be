"""hyla.engine.cpu_process: a CPU engine keeps freed memory mapped (glibc's mmap/trim thresholds),
takes one intra-op thread per usable core, and sets up on a thread that ends before its scheduler's."""

from __future__ import annotations

import platform
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from hyla import Engine
from hyla.engine import cpu_process

ROOT = Path(__file__).resolve().parents[1]
GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"

# a 24 MiB activation allocated, touched and freed: prints the MiB the process's resident set
# gained with it and how many of those it gave back when it was freed
ONE_ACTIVATION = """
import sys, torch
sys.path.insert(0, {root!r})
if {apply}:
    from hyla.engine.cpu_process import keep_freed_memory
    assert keep_freed_memory()
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20
r0 = rss()
x = torch.ones(6 << 20)
r1 = rss()
del x
r2 = rss()
print(r1 - r0, r1 - r2)
"""


def _gained_and_returned(apply: bool) -> tuple[float, float]:
    env = {"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}  # no LD_PRELOAD / GLIBC_TUNABLES of the caller's
    out = subprocess.run([sys.executable, "-c", ONE_ACTIVATION.format(root=str(ROOT), apply=apply)], env=env,
                         capture_output=True, text=True, timeout=120, check=True)
    gained, returned = map(float, out.stdout.split())
    return gained, returned


@pytest.mark.skipif(not GLIBC, reason="glibc's malloc only")
def test_a_freed_activation_stays_mapped_for_the_next_forward():
    gained, returned = _gained_and_returned(False)
    assert gained > 20 and returned > 20, (gained, returned)  # glibc's default: mmap'ed, unmapped when freed
    gained, returned = _gained_and_returned(True)
    assert gained > 20 and returned < 1, (gained, returned)  # kept: the next forward finds its pages mapped


@pytest.mark.parametrize("env", [{"LD_PRELOAD": "/usr/lib/libtcmalloc.so.4"},
                                 {"LD_PRELOAD": "libjemalloc.so.2"},
                                 {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=131072"}])
def test_an_allocator_the_user_chose_is_left_alone(monkeypatch, env):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert cpu_process.keep_freed_memory() is False


@pytest.fixture
def threads_restored():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_the_default_is_one_thread_per_usable_core(monkeypatch, threads_restored):
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(cpu_process, "usable_cores", lambda: 3)
    assert cpu_process.default_cpu_threads() == 3
    assert cpu_process.set_cpu_threads(None) == 3 == torch.get_num_threads()
    monkeypatch.setattr(cpu_process, "usable_cores", lambda: 1)
    assert cpu_process.set_cpu_threads(None) == 1


def test_a_cpu_engine_sets_up_on_a_thread_that_ends_first(monkeypatch):
    """The set-up's torch work (here: loading the model) runs on a thread of its own that has ended
    when the constructor returns, so the scheduler thread's OpenMP team is the process's only one;
    an error there is raised to the caller."""
    from hyla.engine import engine as engine_module

    loaded_on = []
    real = engine_module.load_model

    def load_model(*args, **kwargs):
        loaded_on.append(threading.current_thread())
        return real(*args, **kwargs)

    monkeypatch.setattr(engine_module, "load_model", load_model)
    with Engine(cpu_threads=1, max_total_tokens=256, max_state_slots=4) as engine:
        (setup,) = loaded_on
        assert setup is not threading.main_thread() and setup is not engine._thread and not setup.is_alive()
        assert len(engine.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 2})["output_ids"]) == 2

    def broken(*args, **kwargs):
        raise ValueError("no such weight")

    monkeypatch.setattr(engine_module, "load_model", broken)
    with pytest.raises(ValueError, match="no such weight"):
        Engine(cpu_threads=1, max_total_tokens=256, max_state_slots=4)


def _fake_sys(root, siblings: dict[int, str], cpu_max: str | None):
    for cpu, text in siblings.items():
        d = root / f"devices/system/cpu/cpu{cpu}/topology"
        d.mkdir(parents=True)
        (d / "thread_siblings_list").write_text(text + "\n")
    if cpu_max is not None:
        (root / "fs/cgroup").mkdir(parents=True)
        (root / "fs/cgroup/cpu.max").write_text(cpu_max + "\n")
    return str(root)


def test_usable_cores_count_hyperthreads_once_and_keep_to_the_quota(monkeypatch, tmp_path):
    monkeypatch.setattr(cpu_process.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5, 6, 7})
    smt = {c: f"{c % 4},{c % 4 + 4}" for c in range(8)}  # 4 cores of 2 hyper-threads
    assert cpu_process.usable_cores(_fake_sys(tmp_path / "a", smt, "max 100000")) == 4
    assert cpu_process.usable_cores(_fake_sys(tmp_path / "b", smt, "250000 100000")) == 3  # 2.5 CPUs of quota
    assert cpu_process.usable_cores(_fake_sys(tmp_path / "c", {c: str(c) for c in range(8)}, None)) == 8


def test_the_environment_and_an_explicit_count_win(monkeypatch, threads_restored):
    torch.set_num_threads(2)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert cpu_process.set_cpu_threads(None) == 2  # the environment's choice, left as torch read it
    assert cpu_process.set_cpu_threads(1) == 1 == torch.get_num_threads()
    assert cpu_process.set_cpu_threads(0) == 1  # 0: torch's setting as it is


def test_an_engine_sets_its_threads_and_says_so(monkeypatch, threads_restored):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    with Engine(cpu_threads=1, max_total_tokens=256, max_state_slots=4) as eng:
        assert eng.cpu_threads == 1 == torch.get_num_threads()
        assert "device=cpu (intra-op threads: 1)" in eng.summary()
        assert eng.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 2})["output_ids"]


@pytest.mark.parametrize("bad", [-1, 1.5, True, "2"])
def test_bad_thread_counts_are_rejected(bad):
    with pytest.raises(ValueError, match="cpu_threads"):
        Engine(cpu_threads=bad)
