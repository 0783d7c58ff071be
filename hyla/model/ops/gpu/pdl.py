"""Programmatic dependent launch (PDL): each of hyla's Triton kernels overlaps the one before it.

At batch 1 a decode step is a chain of ~136 small kernels, each waiting for the one before it. A
CUDA graph removes the launch calls, not the gaps: a kernel starts when the previous one has
finished, and its first bytes arrive a memory latency after that. Most of the chain reads a
weight (a few MB each: ~5 µs at HBM speed, with a ~1-2 µs ramp and tail around it). A cached
prompt's extend graph is ~300 kernels in a row the same way.

On Hopper and later a kernel launched with ``launch_pdl`` may start while the one before it still
runs. Every Triton kernel of ``ops/gpu`` takes ``PDL: tl.constexpr`` and is written for that:

1. first it may load what no kernel writes — parameters as the module holds them (a GEMV's weight
   slice or first tile, a Gated DeltaNet layer's conv weights, ``A_log`` and dt bias: those
   kernels' wrappers say which of their arguments they read early) — and nothing else, and it
   stores nothing. Not a value a PyTorch op computes during the step (a lazily derived weight such
   as ``RMSNorm.scale()`` or Mamba2's ``-exp(A_log)``, a ``.float()`` copy): a kernel before it may
   still be writing that, and only the wait makes such writes visible;
2. then :func:`wait` — ``gdc_wait`` returns once the kernel before has finished and its writes are
   visible — and right after it ``gdc_launch_dependents``, which lets the next kernel launch;
3. then its inputs, its work and its stores.

So the next kernel's launch and weight loads run under this one's work, and at most two kernels
of the chain run at once (the next launches only after every program of this one has passed its
wait, so everything before this one has finished). Every program of such a kernel calls
:func:`wait` before it may end: the order the chain keeps relies on each kernel finishing after
the one before it. A kernel that is not PDL-aware (a cuBLAS GEMM, a PyTorch op, fla's kernels)
still runs in stream order: the kernel after it launches when it has finished, as without PDL.

:func:`enabled` decides per launch (``PDL``, a CUDA tensor on an NVIDIA device of compute
capability 9 or more, CUDA 12.3 or later to capture such launches in a graph, a Triton with
``gdc_wait``, and a first probe there — two PDL launches, eager and replayed from a graph — that
gave the right numbers, else a warning); :func:`launch` gives the launch its keywords. A CUDA
graph keeps what its capture launched: ``PDL`` changed later applies to graphs captured after.
Under the interpreter (CPU tensors) it is off: the kernels run their ``PDL=False`` form. ``benchmarks/gpu_decode.py
--pdl 0|1`` times the decode step and the cached TTFT without and with it.
"""

from __future__ import annotations

import logging

import torch
import triton
import triton.language as tl

try:  # Triton >= 3.4
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait, globaltimer

    HAS_GDC = True
except ImportError:  # pragma: no cover - an older Triton: PDL stays off
    HAS_GDC = False

PDL = True  # read at each launch (and graph capture): False launches every kernel as before (no overlap)

logger = logging.getLogger(__name__)


@triton.jit
def wait(PDL: tl.constexpr):
    """The end of a kernel's weight loads (module docstring): wait for the kernel before, then let
    the next one launch. Nothing without ``PDL``."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


PROBE_PROGRAMS, PROBE_HOLD_NS = 8, 20_000  # the probe's grid, and how long its first launch holds its stores


@triton.jit
def _probe_kernel(x_ptr, hold_ns, PDL: tl.constexpr):
    """Adds 1 to 32 floats per program, holding the store back ``hold_ns`` after the load: a launch
    after it whose wait did not order would load the old values meanwhile."""
    wait(PDL)
    i = tl.program_id(0) * 32 + tl.arange(0, 32)
    x = tl.load(x_ptr + i)
    if hold_ns > 0:
        start = globaltimer()
        while globaltimer() - start < hold_ns:
            x += 0.0
    tl.store(x_ptr + i, x + 1.0)


def _hopper_or_later(index: int) -> bool:
    """An NVIDIA GPU of compute capability 9.0 or more (not ROCm, whose capabilities also read 9.x)
    under CUDA 12.3 or later (graph capture of PDL launches)."""
    cuda = tuple(int(v) for v in (torch.version.cuda or "0.0").split(".")[:2])
    return torch.version.hip is None and cuda >= (12, 3) and torch.cuda.get_device_capability(index)[0] >= 9


_works: dict[int, bool] = {}  # device index -> whether PDL runs there (_hopper_or_later, then _probe; once)


def _probe(index: int) -> bool:
    """Whether PDL launches run right on device ``index``: two dependent launches eagerly, then two
    captured in a CUDA graph and replayed, each adding 1, the first of each pair holding its stores
    back (``PROBE_HOLD_NS``) so that a second launch whose wait did not order would read the values
    before them and the sum would come out short. A driver, Triton or capture that refuses them, or
    a wait that does not order, costs a warning and the launches without PDL, not an engine that
    cannot start or a wrong token."""
    def pair() -> None:
        for hold in (PROBE_HOLD_NS, 0):
            _probe_kernel[(PROBE_PROGRAMS,)](x, hold, PDL=True, launch_pdl=True)

    try:
        with torch.cuda.device(index):
            x = torch.zeros(PROBE_PROGRAMS * 32, device=f"cuda:{index}")
            pair()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                pair()
            graph.replay()
            torch.cuda.synchronize(index)
            if bool((x == 4).all()):
                return True
            reason = f"the probe computed {sorted(set(x.tolist()))}, not 4 everywhere"
    except Exception as exc:  # a refused launch or capture
        reason = f"{type(exc).__name__}: {exc}"
    logger.warning("programmatic dependent launch does not work on cuda:%d (%s); launching without it",
                   index, reason)
    return False


def enabled(t: torch.Tensor) -> bool:
    """Whether a kernel working on ``t`` launches with PDL: the conditions in the module docstring,
    and :func:`_probe` passed on its device (run at the first call outside a graph capture; inside
    one, a launch before any probe goes without PDL)."""
    if not (PDL and HAS_GDC and t.is_cuda):
        return False
    index = t.device.index if t.device.index is not None else torch.cuda.current_device()
    if index not in _works:
        if not _hopper_or_later(index):
            _works[index] = False
        elif _capturing(index):
            return False
        else:
            _works[index] = _probe(index)
    return _works[index]


def _capturing(index: int) -> bool:
    """Whether device ``index``'s current stream is capturing a CUDA graph (no probe runs then)."""
    with torch.cuda.device(index):
        return torch.cuda.is_current_stream_capturing()


def launch(t: torch.Tensor) -> dict[str, bool]:
    """The keywords of a launch of a kernel taking ``PDL`` that works on ``t``: ``PDL`` (its
    constexpr) and, when on, Triton's ``launch_pdl``."""
    return {"PDL": True, "launch_pdl": True} if enabled(t) else {"PDL": False}
