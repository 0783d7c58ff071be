"""What a CPU engine sets for its process: glibc's malloc thresholds and torch's intra-op threads,
and where its set-up runs.

Both are process-wide (as vLLM's and SGLang's CPU backends set them: tcmalloc in ``LD_PRELOAD``,
OpenMP threads bound to cores), so each leaves alone a setting the user made.

**Freed host memory stays mapped** (:func:`keep_freed_memory`), so a CPU forward's activations land
on pages already faulted in. glibc's ``malloc`` serves a large allocation (128 KiB and up, a
threshold it raises as such blocks are freed) with ``mmap`` and gives the top of a heap back to the
OS once more than ``M_TRIM_THRESHOLD`` of it is free. A CPU forward allocates and frees its
activations, a few MB each, every step, so every step touched fresh pages: each a trap into the
kernel and a 4 KiB page zeroed. The default model's 8 x 128-token prefill took 6,500-19,000 minor
page faults (25-75 MB of fresh pages) and 4-17% more CPU time; with both thresholds raised, ~100
(``docs/engine.md``, "CPU threads and host memory"). The price: the process may keep its peak heap
resident instead of returning it (``hyla serve`` with the built-in model: 908 against 907 MiB after a
4,000-token prefill). Nothing is changed where the allocator is not glibc's, or where the user chose
one (tcmalloc or jemalloc preloaded, a malloc setting in ``GLIBC_TUNABLES``).

**torch's intra-op threads: one per physical core** (:func:`set_cpu_threads`), torch's own default,
counted within the process's cgroup CPU quota; ``OMP_NUM_THREADS`` or ``MKL_NUM_THREADS`` in the
environment, or an explicit ``cpu_threads``, win (``cpu_threads=0`` keeps a ``torch.set_num_threads``
made in code). Until 2026-11-29 one core was left to the engine's own threads: on a 2-core machine 1
thread had served 1.42x the batch-1 decode and 1.74x the 8-request throughput of 2 (``compile_decode``:
4.1x and 1.8x). That was the OpenMP teams below, not the scheduler's Python: with the set-up on a
thread of its own, 2 threads serve 0.96x / 1.11x what 1 does eager and 1.28x / 1.37x compiled on the
built-in model, and 1.3-1.8x at a 0.65 B model (``docs/benchmarks.md``, "CPU threads"). torch applies
the count to the calling thread and to threads started after it (the engine's scheduler thread), not
to threads that already ran parallel work.

**The set-up's torch work runs on a thread of its own** (:func:`run_in_own_thread`), which ends
before the scheduler thread starts. torch's OpenMP runtime (GNU libgomp) keeps a team of worker
threads for every thread that ran parallel work, for as long as that thread lives; with more such
threads than cores it stops spinning between parallel regions (``GOMP_SPINCOUNT``'s throttled
count), so that every region of the forward waits for its workers to be woken. A team that the
engine's constructing thread kept (loading the model, allocating the pools, compiling) put the
scheduler's forward in that state: a 0.65 B model's decode step with 2 threads took ~185 ms in the
engine against ~120 ms on the thread that built it, its team using 1.6 of the 2 cores (a bmm over a
split weight: 0.90 against 0.68 ms, medians of 5 processes). A team ends with its thread, so the
scheduler's is then the only one. Torch work of the caller's own on other threads (a reference
model run beside the engine, say) forms teams again.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import math
import os
import threading
from typing import Callable, TypeVar

import torch

logger = logging.getLogger(__name__)
T = TypeVar("T")

M_TRIM_THRESHOLD = -1  # <malloc.h>
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # the largest glibc accepts (HEAP_MAX_SIZE / 2 on 64-bit): larger blocks stay mmap'ed
TRIM_THRESHOLD = 1 << 30  # free heap top kept before any is returned


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds for this process (see the module docstring). Returns
    whether they were set; idempotent."""
    if "tcmalloc" in os.environ.get("LD_PRELOAD", "") or "jemalloc" in os.environ.get("LD_PRELOAD", ""):
        return False
    if "malloc" in os.environ.get("GLIBC_TUNABLES", ""):
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
        libc.gnu_get_libc_version  # glibc only: musl has no mallopt thresholds of this meaning
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    if ok:
        logger.debug("glibc malloc: freed memory kept mapped (mmap threshold %d MiB, trim threshold %d MiB)",
                    MMAP_THRESHOLD >> 20, TRIM_THRESHOLD >> 20)
    return ok


def set_cpu_threads(requested: int | None) -> int:
    """Set torch's intra-op threads for a CPU engine: ``requested`` if given (0: leave torch's
    setting), else the environment's ``OMP_NUM_THREADS`` / ``MKL_NUM_THREADS`` if set (torch read it
    at start-up: left as is), else :func:`default_cpu_threads`. Returns the threads in effect."""
    if requested is None and not any(os.environ.get(v) for v in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")):
        requested = default_cpu_threads()
    if requested:
        torch.set_num_threads(requested)
    return torch.get_num_threads()


def default_cpu_threads() -> int:
    """The physical cores this process may run on (hyper-threads counted once, as torch's own
    default counts them; at most its cgroup CPU quota)."""
    return usable_cores()


def usable_cores(sys_root: str = "/sys") -> int:
    """Physical cores among the CPUs this process may run on, capped by a cgroup v2 CPU quota
    (``sys_root``: where sysfs is, for tests)."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        return max(1, torch.get_num_threads())  # torch's default: the physical cores
    cores = set()
    for cpu in cpus:
        try:
            with open(f"{sys_root}/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list") as f:
                cores.add(f.read().strip())  # one entry per physical core
        except OSError:
            cores.add(str(cpu))
    n = len(cores)
    try:
        with open(f"{sys_root}/fs/cgroup/cpu.max") as f:  # "max 100000", or "<quota> <period>"
            quota, period = f.read().split()[:2]
        if quota != "max":
            n = min(n, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return n


def run_in_own_thread(fn: Callable[[], T]) -> T:
    """``fn()`` on a new thread, waited for; its result returned, its exception raised here. The
    thread's OpenMP team (workers of the parallel torch work it ran) ends with it (see the module
    docstring)."""
    errors: list[BaseException] = []
    results: list[T] = []

    def target() -> None:
        try:
            results.append(fn())
        except BaseException as e:  # re-raised on the calling thread
            errors.append(e)

    thread = threading.Thread(target=target, name="hyla-setup", daemon=True)  # daemon: Ctrl-C at start-up exits
    thread.start()
    thread.join()
    if errors:
        raise errors[0]
    return results[0]
