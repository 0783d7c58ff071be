"""Kernels one fused decode step launches, by kind, on the GPU benchmark's model shape.

A decode step of a small model on a GPU costs a few microseconds per kernel even when replayed from
a CUDA graph, so the count is a cost in itself (issue 10). This counts the fused decode step
(``ForwardBatch.fused_decode``) of ``benchmarks/gpu_decode.py``'s Qwen3.5-style model (24 layers:
18 Gated DeltaNet + 6 attention; the vocabulary cut to 4,096 to keep the run short, which changes no
count) at batch ``--batch``:

* on a GPU: the CUDA kernels ``torch.profiler`` records for one eager fused step (no graph);
* without one: the CUDA code path run on CPU tensors (``layers.device.on_gpu`` answers yes, Triton in its
  interpreter), counting every ATen op that computes (views and allocations excluded: on CUDA they
  launch nothing) and every Triton launch. Elementwise ops that are no-ops at the CPU run's dtype
  (a ``.to`` of a tensor already in it) are counted only when they copy.

    .venv/bin/python benchmarks/decode_kernels.py [--batch 1] [--dtype bfloat16] [--no-write]
        [--compare-with <a checkout of an earlier commit>] [--verify W | --extend NEW [--prefix P]] [--moe]

``--verify W``: a speculative verify step of ``W``-token chains through the fused kernels instead
(``ModelRunner.forward_chains`` on a fused runner: ``W`` decode rows per request, the recurrent
layers run column by column), written to its own section.

``--moe``: the model of ``gpu_decode.py --moe`` (a MoE layer of 64 experts, top-8, and a shared
expert in place of each MLP; without a GPU at the tiny model's widths): a step of at most
``sparse_moe.GATHER_MAX_ASSIGNMENTS`` (token, expert) pairs runs its experts gathered, a larger one
grouped (``ops/gpu/moe.py``); each batch size writes its own section.

``--mtp``: the MTP head's launches instead (``speculative_algorithm="mtp"``, 3 draft steps, on the
model with a random MTP head added): one draft of 3 steps and one pass over a verify step's pairs,
at batch ``--batch``, through the fused kernels (``MtpDrafter(fused=True)``: what a GPU replays from
one CUDA graph each) beside the head's PyTorch rows (``fused=False``: what a GPU launched one by one
before 2026-11-30). Written to the section "GPU decode: kernels per MTP draft".

``--extend NEW``: the model forward of an extend step instead — a prompt of ``P`` cached tokens
(sent before with a checkpoint there) and ``NEW`` new ones with its end − 1 checkpoint, the
cached-TTFT case of ``gpu_decode.py`` (which has ``NEW`` = 296; above ``SHORT_EXTEND`` = 8 tokens
an extend takes the same path at any length, so a short one counts the same launches). A CUDA
prefill is host-bound (issue 10): each launch costs host time, an fla call several launches'
worth. Without a GPU, fla's kernels (which the interpreter cannot run) are stood in for and each
call counted once, and the model keeps its 24 layers at the tiny model's widths. Host reads
(``.item()``, ``.tolist()``) are counted too. Written to the section "GPU prefill: kernels per
extend step".
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

GPU = torch.cuda.is_available()
if not GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel is defined

ROOT = Path(__file__).resolve().parents[1]
if "--root" in sys.argv:  # count another checkout's step (--compare-with runs this script so)
    ROOT = Path(sys.argv[sys.argv.index("--root") + 1]).resolve()
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))

import gpu_decode  # noqa: E402
from report import machine, write_section  # noqa: E402

# ATen ops that launch no kernel on CUDA (views, metadata, allocation)
NO_KERNEL = {"view", "_unsafe_view", "reshape", "expand", "slice", "select", "split", "split_with_sizes",
             "unsqueeze", "squeeze", "transpose", "t", "permute", "as_strided", "alias", "detach", "unbind",
             "narrow", "chunk", "_reshape_alias", "view_as", "lift_fresh", "empty", "empty_like",
             "empty_strided", "new_empty", "diagonal", "unflatten", "flatten", "movedim", "set_", "lift_fresh_copy"}


def count_cpu(run_step) -> collections.Counter:
    """What ``run_step()`` would launch on a GPU, run on CPU tensors: ATen ops that compute, Triton launches,
    and the host reads (``.item()``, ``.tolist()``, ``bool()`` of a tensor) as ``host read``."""
    from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
    import triton.runtime.interpreter as interp

    counts: collections.Counter = collections.Counter()

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            name = func.overloadpacket.__name__
            if name == "_local_scalar_dense":
                counts["host read"] += 1
            copies = not (name in ("to", "_to_copy") and isinstance(out, torch.Tensor) and args
                          and isinstance(args[0], torch.Tensor) and out.data_ptr() == args[0].data_ptr())
            if name not in NO_KERNEL and copies:
                counts[f"aten.{name}"] += 1
            return out

    launch = interp.InterpretedFunction.run

    def run(self, *a, **k):  # a Triton launch; the interpreter's own tensor work is not counted
        counts[f"triton.{self.fn.__name__}"] += 1
        with _disable_current_modes():
            return launch(self, *a, **k)

    tolist = torch.Tensor.tolist

    def counted_tolist(self):
        counts["host read"] += 1
        return tolist(self)

    import hyla.model.ops.attention as attention

    causal_lower_right = attention.causal_lower_right

    def causal_bias(*args):  # a tensor subclass, which a dispatch mode cannot create; launches nothing
        with _disable_current_modes():
            return causal_lower_right(*args)

    interp.InterpretedFunction.run = run
    torch.Tensor.tolist = counted_tolist
    attention.causal_lower_right = causal_bias
    try:
        with Count():
            run_step()
    finally:
        interp.InterpretedFunction.run = launch
        torch.Tensor.tolist = tolist
        attention.causal_lower_right = causal_lower_right
    return counts


def count_gpu(run_step) -> collections.Counter:
    """The CUDA kernels ``torch.profiler`` records while ``run_step()`` runs (warmed up by the caller)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run_step()
        torch.cuda.synchronize()
    counts: collections.Counter = collections.Counter()
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            counts[ev.name[:60]] += 1
    return counts


def _gemms(counts: collections.Counter) -> int:
    return sum(v for k, v in counts.items() if k in ("aten.linear", "aten.mm", "aten.addmm") or "gemv" in k
               or "gemm" in k.lower() or "cutlass" in k or "sm90" in k)


FLA_KERNELS = {"gated_delta_rule": ("chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule"),
               "kda": ("chunk_kda", "fused_recurrent_kda"),
               "simple_gla": ("chunk_simple_gla", "fused_recurrent_simple_gla")}
FLA_CALLS: collections.Counter = collections.Counter()


def stand_in_fla() -> None:
    """Without a GPU, fla's kernels (which do not run in Triton's interpreter) as stand-ins that count
    their calls in ``FLA_CALLS`` and return zero outputs and the initial states, launching nothing."""
    import types

    from torch.utils._python_dispatch import _disable_current_modes

    from hyla.model.ops.gpu import fla_chunk

    def stand_in(name):
        def kernel(q, k, v, *args, initial_state=None, **kwargs):
            FLA_CALLS[f"fla.{name}"] += 1
            with _disable_current_modes():
                return torch.zeros_like(v), initial_state.clone()
        return kernel

    sys.modules["fla"], sys.modules["fla.ops"] = types.ModuleType("fla"), types.ModuleType("fla.ops")
    for module, names in FLA_KERNELS.items():
        mod = sys.modules[f"fla.ops.{module}"] = types.ModuleType(f"fla.ops.{module}")
        for name in names:
            setattr(mod, name, stand_in(name))
    fla_chunk.HAS_FLA = True


def decode_counts(engine, runner, count, batch: int, w: int) -> collections.Counter:
    """One fused decode step at ``batch`` (or a verify step of ``w``-token chains), as ``count`` sees it."""
    captured = []
    step = runner.decode_fused_step
    runner.decode_fused_step = lambda b: captured.append(b) or step(b)
    engine.generate(input_ids=[[5 + i, 6, 7, 8] for i in range(batch)],
                    sampling_params={"max_new_tokens": 2, "temperature": 0, "ignore_eos": True})
    if w:  # a verify step of chains: W tokens per request, its states through W - 1 scratch slots each
        from types import SimpleNamespace

        reqs = [SimpleNamespace(kv_len=8, tokens=lambda a, e: [5] * (e - a), req_pool_idx=i, state_slot=1 + i)
                for i in range(batch)]
        scratch = [[1 + batch + i * (w - 1) + j for j in range(w - 1)] for i in range(batch)]
        runner.forward_chains(reqs, [w] * batch, torch.arange(1, 1 + w * batch), scratch)
    runner.decode_fused_step = step
    if GPU:
        step(captured[-1])  # Triton compiles, cuBLAS picks its kernels
    return count(lambda: step(captured[-1]))


def mtp_counts(engine, count, batch: int) -> dict[str, collections.Counter]:
    """The MTP head's launches per draft (its ``num_draft`` steps for ``batch`` requests) and per pass
    over a verify step's pairs, as ``count`` sees them, for its fused rows and its PyTorch rows:
    ``{"<rows> draft": ..., "<rows> pairs": ...}``. The first of each in a short greedy run (a
    prompt's pass over its pairs, where the verify step's is counted, is told apart by its empty
    prefix); on a GPU the run before warms the kernels up."""
    from hyla.engine.mtp_drafter import MtpDrafter

    old, counts = engine.scheduler.drafter, {}
    scratch = [s for row in old.scratch for s in row]
    for name, fused in (("PyTorch", False), ("fused", True)):
        drafter = MtpDrafter(engine.mtp_head, engine.kv_pool, engine.state_pool, engine.req_to_token, scratch,
                             old.num_draft, fused=fused)
        engine.scheduler.drafter = drafter
        propose, observe, box = drafter.propose_batch, drafter.observe, {}

        def counted_propose(reqs, limits, _real=propose, _box=box, _name=name):
            if f"{_name} draft" in _box or not _box.get("warm", not GPU):
                return _real(reqs, limits)
            out = []
            _box[f"{_name} draft"] = count(lambda: out.append(_real(reqs, limits)))
            return out[0]

        def counted_observe(reqs, lens, *a, _real=observe, _box=box, _name=name, **k):
            verify = min(r.kv_len for r in reqs) > 0 and max(lens) > 1
            if not verify or f"{_name} pairs" in _box or not _box.get("warm", not GPU):
                return _real(reqs, lens, *a, **k)
            _box[f"{_name} pairs"] = count(lambda: _real(reqs, lens, *a, **k))

        drafter.propose_batch, drafter.observe = counted_propose, counted_observe
        for _ in range(2 if GPU else 1):
            engine.generate(input_ids=[[5 + i, 6, 7, 8] for i in range(batch)],
                            sampling_params={"max_new_tokens": 8, "temperature": 0, "ignore_eos": True})
            box["warm"] = True
        missing = {f"{name} draft", f"{name} pairs"} - box.keys()
        if missing:
            raise RuntimeError(f"the run made no {sorted(missing)}: nothing was drafted or verified")
        counts.update((key, box[key]) for key in (f"{name} draft", f"{name} pairs"))
    engine.scheduler.drafter = old
    return counts


def mtp_section(args, counts: dict[str, collections.Counter]) -> str:
    """The ``--mtp`` report: each count's total, GEMMs and host reads, and the kernels side by side."""
    for c in counts.values():
        c.setdefault("host read", 0)
    reads = {k: c.pop("host read") for k, c in counts.items()}
    total = {k: sum(c.values()) for k, c in counts.items()}
    how = ("CUDA kernels recorded by torch.profiler, eager (no graph)" if GPU else
           "the CUDA code path on CPU tensors (Triton interpreted): ATen ops that compute + Triton launches")
    summary = "; ".join(f"{k}: **{total[k]} kernels**, {_gemms(counts[k])} GEMMs, {reads[k]} host reads"
                        for k in counts)
    keys = list(counts)
    names = sorted(set().union(*counts.values()), key=lambda n: tuple(-counts[k].get(n, 0) for k in keys) + (n,))
    body = (f"`.venv/bin/python benchmarks/decode_kernels.py --mtp --batch {args.batch} --dtype {args.dtype}` — "
            f"{machine()}; {how}.\n\n"
            f"The MTP head (`speculative_algorithm=\"mtp\"`, 3 draft steps; a random head on the GPU decode "
            f"benchmark's model, vocabulary cut to 4,096{'; the tiny model widths, which change no count' if not GPU else ''}) at batch {args.batch}, {args.dtype}: one draft of 3 steps "
            f"and one pass over a verify step's pairs, through its PyTorch rows (`MtpDrafter(fused=False)`: "
            f"what a GPU launched one by one until 2026-11-30) and through the fused kernels (`fused=True`: on "
            f"a GPU, one CUDA graph replay each, `cuda_graph.CudaGraphMtp`). {summary}.\n\n")
    body += "| kernels | " + " | ".join(keys) + " |\n" + "|---" * (len(keys) + 1) + "|\n"
    body += "\n".join(f"| `{n}` | " + " | ".join(str(counts[k].get(n, 0)) for k in keys) + " |" for n in names)
    body += "\n| **total** | " + " | ".join(f"**{total[k]}**" for k in keys) + " |\n"
    return body


def extend_counts(engine, runner, count, prefix: int, new: int) -> collections.Counter:
    """The model forward of one extend step: a prompt whose first ``prefix`` tokens are cached (sent
    before with another tail and a checkpoint there: ``gpu_decode.py``'s cached TTFT) and ``new``
    tokens more, with its end - 1 checkpoint. On a GPU the second of two such prompts is counted
    (the first compiles and autotunes)."""
    import random

    rng = random.Random(0)
    fresh = lambda n: [rng.randrange(3, 4096) for _ in range(n)]  # noqa: E731
    greedy = {"temperature": 0, "max_new_tokens": 1, "ignore_eos": True}
    forward = runner.model.forward
    box: list = []

    def counted_forward(batch):
        if not box or box[0] is not None:
            return forward(batch)
        FLA_CALLS.clear()
        out = []
        box[0] = count(lambda: out.append(forward(batch)))
        box[0].update(FLA_CALLS)
        return out[0]

    runner.model.forward = counted_forward
    try:
        for _ in range(2 if GPU else 1):
            pre = fresh(prefix)
            engine.generate(input_ids=pre + fresh(8), checkpoints=[prefix], sampling_params=greedy)
            box[:] = [None]
            hit = engine.generate(input_ids=pre + fresh(new), sampling_params=greedy)["meta_info"]["cached_tokens"]
            if hit != prefix:
                raise RuntimeError(f"the prefix was not cached: {hit} of {prefix} tokens hit")
    finally:
        del runner.model.forward
    return box[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    ap.add_argument("--compare-with", type=Path, help="a checkout of an earlier commit: its count beside this one")
    ap.add_argument("--verify", type=int, default=0, metavar="W",
                    help="count a verify step of W-token chains (fused) instead of a decode step")
    ap.add_argument("--extend", type=int, default=0, metavar="NEW",
                    help="count the forward of an extend step of NEW tokens after a cached prefix instead")
    ap.add_argument("--prefix", type=int, default=32, help="--extend: the cached prefix's tokens")
    ap.add_argument("--moe", action="store_true", help="the model with MoE layers of gpu_decode.py --moe (64 "
                    "experts, top-8; without a GPU at the tiny widths): its experts gathered up to "
                    "sparse_moe.GATHER_MAX_ASSIGNMENTS (token, expert) pairs, grouped above")
    ap.add_argument("--mtp", action="store_true", help="the MTP head's launches per draft and per verify pass "
                    "(fused rows against PyTorch rows); its own section")
    ap.add_argument("--root", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    device = "cuda" if GPU else "cpu"
    kw = dict(gpu_decode.FULL, vocab_size=4096)
    w, new = args.verify, args.extend
    narrowed = (new or args.moe or args.mtp) and not GPU
    if narrowed:  # the benchmark model's 24 layers at the tiny model's widths: the same launches,
        # and the interpreted kernels' time (which grows with tokens x heads) cut ~20x
        kw.update({key: value for key, value in gpu_decode.TINY.items() if key not in ("num_hidden_layers", "layer_types")},
                  vocab_size=4096)
    moe = None
    if args.moe:  # the experts' count and top-k of the GPU benchmark's, narrow without a GPU
        moe = dict(gpu_decode.MOE, **({} if GPU else {"moe_intermediate_size": 32, "shared_expert_intermediate_size": 32}))

    from hyla import Engine
    from hyla.engine.model_runner import ModelRunner
    import hyla.model.layers as layers

    path = Path(tempfile.mkdtemp())
    gpu_decode.build(path, {**kw, **moe} if moe else kw, device, dtype, "moe" if moe else "qwen3_5")
    spec = {}
    if args.mtp:  # a random MTP head, and the engine drafting from it (3 steps: chains of 4)
        sys.path.insert(0, str(ROOT / "tests"))
        import checkpoints

        checkpoints.add_mtp_tensors(path)
        w, spec = 4, dict(speculative_algorithm="mtp", speculative_num_steps=3)
    engine = Engine(path, device=device, dtype=args.dtype, max_running_requests=max(args.batch, 2),
                    max_state_slots=(max(w, 1) + 3) * args.batch + 8,
                    max_total_tokens=64 * args.batch + 512 + 2 * (args.prefix + new + 8), **spec)
    runner = ModelRunner(engine.model, engine.kv_pool, engine.state_pool, engine.req_to_token, engine.device,
                         cuda_graph=False, fused_decode=True, verify_width=w or None, return_hidden=args.mtp)
    engine.scheduler.runner = runner
    on_gpu = layers.device.on_gpu
    if not GPU:
        layers.device.on_gpu = lambda x: True  # the CUDA code path on CPU tensors
        engine.model.fuse_moe_inputs_()  # as a CUDA runner does
        stand_in_fla()
    count = count_gpu if GPU else count_cpu
    try:
        if args.mtp:
            body = mtp_section(args, mtp_counts(engine, count, args.batch))
            print(body)
            if not args.no_write:
                write_section("GPU decode: kernels per MTP draft", body)
            return
        if new:
            counts = extend_counts(engine, runner, count, args.prefix, new)
        else:
            counts = decode_counts(engine, runner, count, args.batch, w)
    finally:
        layers.device.on_gpu = on_gpu
        engine.shutdown()
    if args.json:
        print(json.dumps(dict(counts)))
        return
    mode = (["--verify", str(w)] if w else ["--extend", str(new), "--prefix", str(args.prefix)] if new else []) \
        + (["--moe"] if args.moe else [])
    before = None
    if args.compare_with is not None:
        cmd = [sys.executable, __file__, "--root", str(args.compare_with), "--json", "--batch", str(args.batch),
               "--dtype", args.dtype] + mode
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
        before = collections.Counter(json.loads(out))
        rev = subprocess.run(["git", "-C", str(args.compare_with), "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True).stdout.strip() or str(args.compare_with)
    reads = counts.pop("host read", 0)
    if before is not None:
        before_reads = before.pop("host read", 0)
    total, gemm = sum(counts.values()), _gemms(counts)
    lines = [f"{v:5d}  {k}" for k, v in counts.most_common()]
    print("\n".join(lines))
    if new:
        step_name = f"extend forward ({new} new tokens after {args.prefix} cached, end - 1 checkpoint)"
    else:
        step_name = f"verify step ({w}-token chains)" if w else "decode step"
    fla = sum(v for k, v in counts.items() if k.startswith("fla."))
    print(f"total {total} kernels per {step_name} at batch {args.batch}, {gemm} of them GEMMs"
          + (f", {fla} fla calls" if fla else "") + f"; {reads} host reads")
    how = ("CUDA kernels recorded by torch.profiler in one eager fused step" if GPU else
           "the CUDA code path on CPU tensors (Triton interpreted): ATen ops that compute + Triton launches"
           + ("; fla's kernels stood in for, each call counted once (on a GPU one call launches several)"
              if new else ""))
    cmp = f" --compare-with <checkout of {rev}>" if before is not None else ""
    flag = "".join(f" {m}" for m in mode)
    what = f"The {step_name}" if new else f"The fused {step_name}"
    narrow = "; the tiny model's widths, which change no count" if narrowed else ""
    experts = (f"; a MoE layer of {moe['num_experts']} experts, top-{moe['num_experts_per_tok']}, and a shared "
               f"expert in place of each MLP: its experts "
               + ("gathered" if args.batch * moe["num_experts_per_tok"] <= layers.sparse_moe.GATHER_MAX_ASSIGNMENTS else "grouped")
               if moe else "")
    body = (f"`.venv/bin/python benchmarks/decode_kernels.py --batch {args.batch} --dtype {args.dtype}{flag}{cmp}` — "
            f"{machine()}; {how}.\n\n"
            f"{what} of the GPU decode benchmark's model (24 layers: 18 Gated DeltaNet + 6 "
            f"attention{experts}; vocabulary cut to 4,096{narrow}) at batch {args.batch}, {args.dtype}: **{total} kernels**, "
            f"{gemm} of them GEMMs" + (f", {fla} fla calls" if fla else "") + f", {reads} host reads"
            + (f" ({sum(before.values())}, {_gemms(before)} and {before_reads} at {rev})" if before is not None else "")
            + ".\n\n")
    if before is None:
        body += "| kernels | what |\n|---|---|\n" + "\n".join(f"| {v} | `{k}` |" for k, v in counts.most_common())
    else:
        names = sorted(set(counts) | set(before), key=lambda k: (-counts.get(k, 0), -before.get(k, 0), k))
        body += f"| what | {rev} | now |\n|---|---|---|\n" + "\n".join(
            f"| `{k}` | {before.get(k, 0)} | {counts.get(k, 0)} |" for k in names)
        body += f"\n| **total** | **{sum(before.values())}** | **{total}** |"
    body += "\n"
    if not args.no_write:
        section = ("GPU prefill: kernels per extend step" if new else
                   "GPU decode: kernels per verify step" if w else "GPU decode: kernels per step")
        if args.moe:
            section += f", a model with MoE layers (batch {args.batch})"
        write_section(section, body)


if __name__ == "__main__":
    main()
