"""Keep freed host memory mapped, so a CPU forward's activations land on pages already faulted in.

glibc's ``malloc`` serves a large allocation (128 KiB and up, a threshold it raises as such blocks
are freed) with ``mmap`` and gives the top of a heap back to the OS once more than
``M_TRIM_THRESHOLD`` of it is free. A CPU forward allocates and frees its activations, a few MB
each, every step, so every step touched fresh pages: each a trap into the kernel and a 4 KiB page
zeroed. The default model's 8 x 128-token prefill took 6,500-19,000 minor page faults (25-75 MB of
fresh pages) and 4-17% more CPU time; with both thresholds raised, ~100 (``docs/engine.md``, "Host
memory on CPU").

vLLM's and SGLang's CPU backends get the same effect by asking for tcmalloc in ``LD_PRELOAD``; here
it is two ``mallopt`` calls on an engine whose device is the CPU. The price: the process keeps its
peak heap (what the OS shows as resident) instead of returning freed memory. Nothing is changed
where the allocator is not glibc's, or where the user chose one (tcmalloc or jemalloc preloaded, a
malloc setting in ``GLIBC_TUNABLES``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

logger = logging.getLogger(__name__)

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
        logger.info("glibc malloc: freed memory kept mapped (mmap threshold %d MiB, trim threshold %d MiB)",
                    MMAP_THRESHOLD >> 20, TRIM_THRESHOLD >> 20)
    return ok
