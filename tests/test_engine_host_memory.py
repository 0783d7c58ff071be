"""hyla.engine.host_memory: a CPU engine keeps freed memory mapped (glibc's mmap/trim thresholds)."""

from __future__ import annotations

import platform
import subprocess
import sys
from pathlib import Path

import pytest

from hyla.engine import host_memory

ROOT = Path(__file__).resolve().parents[1]
GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"

# a 24 MiB activation allocated, touched and freed: prints the MiB the process's resident set
# gained with it and how many of those it gave back when it was freed
ONE_ACTIVATION = """
import sys, torch
sys.path.insert(0, {root!r})
if {apply}:
    from hyla.engine.host_memory import keep_freed_memory
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
    assert host_memory.keep_freed_memory() is False
