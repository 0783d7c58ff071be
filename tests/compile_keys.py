"""What an interpreted test's Triton launches would compile on a GPU.

Triton compiles a kernel once per *key*: its constexprs, the launch options, and a specialization
of every other argument (an int equal to 1 or divisible by 16, a pointer aligned to 16 bytes;
``triton.runtime.jit.create_function_from_signature``). A serving engine that launches a kernel
with a key it has not seen compiles it again on the spot: ~1-3 s on the GPU machines, a stall of
every request in the step. Keys that follow the request data (a token count that happens to be a
multiple of 16, an index array sliced at an offset that depends on the batch size) make such
stalls come at random, long after the warm-up; the kernels declare those arguments
``do_not_specialize`` / ``do_not_specialize_on_alignment``.

Under ``TRITON_INTERPRET=1`` (the CPU suite) nothing is compiled, so :func:`record_compile_keys` computes each
launch's key the way a CUDA launch of the same arguments would (Triton's own specialization
function, with its CUDA backend) and keeps them per kernel. :meth:`CompileKeys.new_variants` after
:meth:`CompileKeys.mark` lists the launches since the mark whose constexprs the kernel had been
launched with before, but not their key: what a GPU would compile again mid-serving. On a GPU
(the kernels compiled, not interpreted) it records nothing: the keys follow from the same argument
values there.
"""

from __future__ import annotations

import inspect
from collections import defaultdict


class CompileKeys:
    """The compile keys of the launches :func:`record_compile_keys` saw, per kernel."""

    def __init__(self) -> None:
        self.keys: dict[str, set[tuple]] = defaultdict(set)  # kernel -> (constexprs, runtime specialization)
        self.before: dict[str, set[tuple]] | None = None

    def add(self, kernel: str, constexprs: tuple, runtime: tuple) -> None:
        self.keys[kernel].add((constexprs, runtime))

    def mark(self) -> None:
        """The keys so far are the warm-up's: :meth:`new_variants` lists what comes after."""
        self.before = {k: set(v) for k, v in self.keys.items()}

    def variation(self) -> dict[str, tuple[int, int, list[str]]]:
        """Per kernel: its compile keys, its constexpr sets, and each argument whose specialization
        differs between launches of the same constexprs (a data-driven one, or one that differs
        between call sites: two weights' shapes)."""
        table = {}
        for kernel, keys in sorted(self.keys.items()):
            by_consts: dict[tuple, list[tuple]] = defaultdict(list)
            for consts, runtime in keys:
                by_consts[consts].append(runtime)
            varied = sorted({f"{name} {sorted({str(tuple(r[i][1:])) for r in rs})}"
                             for rs in by_consts.values() if len(rs) > 1
                             for i, (name, *_) in enumerate(rs[0]) if len({r[i] for r in rs}) > 1})
            table[kernel] = (len(keys), len(by_consts), varied)
        return table

    def assert_no_new_variants(self) -> None:
        """Launches were recorded, and none since :meth:`mark` would compile anew on a GPU."""
        assert self.keys, "no Triton launch recorded"
        new = self.new_variants()
        assert not new, f"launches since the warm-up would compile anew on a GPU: {new}"

    def new_variants(self) -> dict[str, list[str]]:
        """Per kernel, each argument whose specialization made a key new since :meth:`mark`, where the
        kernel had been launched with the same constexprs before it (``{}``: none)."""
        if self.before is None:
            raise ValueError("mark() the warm-up first")
        found: dict[str, list[str]] = {}
        for kernel, keys in self.keys.items():
            old = self.before.get(kernel, set())
            old_consts = {c for c, _ in old}
            for consts, runtime in keys - old:
                if consts not in old_consts:
                    continue  # a constexpr choice (a tile, a path) made for the first time: not data-driven
                nearest = [r for c, r in old if c == consts]
                varied = {f"{name} {spec}" for r in nearest for (name, *spec), (_, *was) in zip(runtime, r)
                          if spec != was}
                found.setdefault(kernel, []).extend(sorted(varied))
        return found


def record_compile_keys(monkeypatch) -> CompileKeys:
    """Record the compile key of every interpreted Triton launch from here to the test's end."""
    keys = CompileKeys()
    try:
        from triton._C.libtriton import native_specialize_impl
        from triton.backends.nvidia.compiler import CUDABackend
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:  # another Triton layout: nothing recorded
        return keys
    run = InterpretedFunction.run
    signatures: dict = {}

    def recorded(self, *args, grid, warmup, **kwargs):
        sig = signatures.get(self.fn) or signatures.setdefault(self.fn, inspect.signature(self.fn))
        bound = sig.bind(*args, **{k: v for k, v in kwargs.items() if k in sig.parameters})
        bound.apply_defaults()
        options = tuple(sorted((k, v) for k, v in kwargs.items() if k not in sig.parameters))
        nospec = set(self.kwargs.get("do_not_specialize") or ())
        noalign = set(self.kwargs.get("do_not_specialize_on_alignment") or ())
        consts, runtime = [], []
        for i, (name, param) in enumerate(sig.parameters.items()):
            value = bound.arguments[name]
            if "constexpr" in str(param.annotation):
                consts.append((name, value))
            else:
                spec = native_specialize_impl(CUDABackend, value, False, not ({i, name} & nospec),
                                              not ({i, name} & noalign))
                runtime.append((name, *spec))
        keys.add(self.fn.__qualname__, tuple(consts) + options, tuple(runtime))
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", recorded)
    return keys
