"""CUDA graphs on the CPU: ``hyla.engine.cuda_graph``'s classes tested in CI.

The graphs' host side (the inputs staged into static buffers, the padding rows, the graph chosen
for a batch size or token count, the outputs sliced) only runs where a GPU captures graphs. Here a
capture becomes an :class:`EmulatedGraph` whose replay runs the captured function again into the
captured outputs, and ``torch.cuda``'s streams and events become no-ops for that module only; with
the kernels interpreted (``TRITON_INTERPRET=1``) an engine then serves from "graphs" on the CPU.
``ModelRunner`` captures none off CUDA: :func:`attach_graphs` gives a fused runner the graphs a
GPU's would have.

Graphs captured into one memory pool (``capture(..., pool)``: a runner's decode, verify and extend
graphs share one) also share memory here, as much as they may on a GPU: a graph captured later can
keep its outputs in memory that an earlier one freed after its capture, and which that earlier
one's replays write again. So replaying a graph poisons (NaN, or -2**40 in integer outputs) the
outputs of every graph captured after it in its pool: an output read after another graph of its
pool replayed, which on a GPU may be overwritten, is here certainly wrong.

A capture also keeps what a CUDA capture refuses (:class:`CaptureRules`): the captured function may
not read the device from the host (``.item()``, ``.tolist()``, a tensor's truth value, ops whose
output's size follows the data: ``nonzero``, a boolean mask's indexing, ``repeat_interleave``
without its ``output_size``), nor make a tensor of host data (``torch.tensor``, ``torch.as_tensor``
of a list: a copy from pageable memory, which a capture refuses; and had it been taken, the graph would
replay the values of the capture). On a GPU these fail the capture at start-up; here the test.
"""

from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes, _get_current_dispatch_mode_stack

aten = torch.ops.aten
# ops that read the device from the host (a synchronization, which a capture refuses): a scalar's value,
# and ops whose output's size is data (their kernels copy a count back)
SYNCING_OPS = {aten._local_scalar_dense.default, aten.nonzero.default, aten.masked_select.default,
               aten._unique2.default, aten.unique_dim.default, aten.unique_consecutive.default,
               aten.lift_fresh.default}  # (lift_fresh: a tensor of host data, torch.tensor's)
HOST_READS = ("tolist", "numpy")  # Tensor methods that read the data without dispatching an op


class CaptureRules(TorchDispatchMode):
    """Fails on what a CUDA graph capture refuses (the module docstring), naming the op. Triton
    launches are exempt (``TRITON_INTERPRET=1``: the interpreter copies its arguments to the host,
    where a GPU only launches a kernel)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in SYNCING_OPS or (func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None):
            raise AssertionError(f"not allowed in a CUDA graph capture: {func}")
        if func in (aten.index.Tensor, aten.index_put_.default, aten.index_put.default) and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1] if i is not None):
            raise AssertionError(f"not allowed in a CUDA graph capture: {func} with a boolean mask")
        return func(*args, **kwargs)


class _NoHostReads(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in HOST_READS:
            raise AssertionError(f"not allowed in a CUDA graph capture: Tensor.{func.__name__}")
        return func(*args, **(kwargs or {}))


def in_emulated_graph() -> bool:
    """Whether the code runs inside an emulated graph's capture or replay."""
    return any(isinstance(m, CaptureRules) for m in _get_current_dispatch_mode_stack())


@contextlib.contextmanager
def capture_rules():
    """:class:`CaptureRules` over the block, Triton's interpreted launches exempt."""
    from triton.runtime.interpreter import InterpretedFunction

    run = InterpretedFunction.run

    def exempt(self, *args, **kwargs):
        with _disable_current_modes(), torch._C.DisableTorchFunction():
            return run(self, *args, **kwargs)

    InterpretedFunction.run = exempt
    try:
        with CaptureRules(), _NoHostReads():
            yield
    finally:
        InterpretedFunction.run = run


class EmulatedGraph:
    """A CUDA graph's contract on the CPU: ``replay`` runs the captured function again and writes
    its outputs into the tensors the capture returned (what a replay does to the graph's memory),
    then poisons the outputs of the graphs captured after it in its memory pool (the module
    docstring)."""

    def __init__(self, fn, out, pool: list[EmulatedGraph]):
        self.fn, self.out, self._pool = fn, out, pool
        pool.append(self)  # capture order

    def outputs(self) -> list[torch.Tensor]:
        return [self.out] if isinstance(self.out, torch.Tensor) else list(self.out)

    def replay(self) -> None:
        with capture_rules():  # a replay runs what the capture ran
            new = self.fn()  # a tensor, or a tuple of them (logits, hidden)
        for dst, src in zip(self.outputs(), [new] if isinstance(new, torch.Tensor) else new):
            dst.copy_(src)
        for later in self._pool[self._pool.index(self) + 1:]:
            for t in later.outputs():
                t.fill_(float("nan") if t.is_floating_point() else -2 ** 40)

    def pool(self) -> list[EmulatedGraph]:
        return self._pool


def emulate_cuda_graphs(monkeypatch) -> None:
    """Without a GPU, ``hyla.engine.cuda_graph``'s classes run on CPU tensors: captures become
    :class:`EmulatedGraph`, streams and events no-ops (its host buffers are pinned on CUDA only).
    Their staging of inputs and padding, their choice of graph and their outputs are then tested in
    CI, with the kernels interpreted, and each capture keeps :class:`CaptureRules`."""
    from types import SimpleNamespace

    from hyla.engine import cuda_graph
    from hyla.model.layers import SparseMoE

    def capture(fn, stream, pool=None):  # (no warm-up runs: nothing to compile or autotune)
        with capture_rules():
            out = fn()
        return EmulatedGraph(fn, out, [] if pool is None else pool), out

    class Torch:  # torch, as the module sees it, with torch.cuda's streams and events as no-ops
        cuda = SimpleNamespace(Stream=lambda *a, **k: None, synchronize=lambda *a, **k: None,
                               Event=lambda *a, **k: SimpleNamespace(record=lambda: None, synchronize=lambda: None))

        def __getattr__(self, name):
            return getattr(torch, name)

    monkeypatch.setattr(cuda_graph, "capture", capture)
    monkeypatch.setattr(cuda_graph, "torch", Torch())
    # MoE layers inside a graph run their experts as a GPU's would (gathered or grouped, no host read);
    # outside, as they would here (eager steps: sorted)
    monkeypatch.setattr(SparseMoE, "path", lambda self, x, cpu=SparseMoE.path:
                        self.device_path(x) if in_emulated_graph() else cpu(self, x))


def attach_graphs(runner, decode_max_bs: int = 0, verify_max_bs: int = 0, extends: bool = False) -> None:
    """Capture (emulated: :func:`emulate_cuda_graphs` first) what ``ModelRunner`` captures on CUDA, for
    a fused runner built on the CPU: decode steps up to ``decode_max_bs`` requests, verify steps of
    chains up to ``verify_max_bs`` (its ``verify_width``), and extends of one sequence at its token
    counts (``fused_extend_max_tokens``)."""
    from hyla.engine.cuda_graph import CudaGraphDecode, CudaGraphExtend

    if not runner.fused:
        raise ValueError("graphs capture the fused step: a runner with fused_decode=True")
    pool = None  # one memory pool, as ModelRunner's graphs share
    if decode_max_bs:
        runner.graphs = CudaGraphDecode(runner, decode_max_bs)
        pool = runner.graphs.pool
        if runner.serves_lora:  # (and those of steps applying LoRA adapters)
            runner.lora_graphs = CudaGraphDecode(runner, decode_max_bs, pool=pool, lora=True)
    if verify_max_bs:
        runner.verify_graphs = CudaGraphDecode(runner, verify_max_bs, width=runner.verify_width, pool=pool)
        pool = runner.verify_graphs.pool
        if runner.serves_lora:
            runner.lora_verify_graphs = CudaGraphDecode(runner, verify_max_bs, width=runner.verify_width, pool=pool,
                                                        lora=True)
    if extends:
        runner.extend_graphs = CudaGraphExtend(runner, runner._extend_buckets, pool=pool)
        runner.extend_inputs = runner.extend_graphs.inputs
        if runner.serves_lora:
            runner.lora_extend_graphs = CudaGraphExtend(runner, runner._extend_buckets, pool=pool,
                                                        inputs=runner.extend_inputs, lora=True)
