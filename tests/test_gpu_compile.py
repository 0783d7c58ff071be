"""Every Triton kernel compiles for an H100 (sm_90), checked on a machine without a GPU.

The other CPU tests run the kernels in Triton's interpreter, which checks what they compute, not
that Triton's compiler takes them: ``scripts/compile_gpu_kernels.py`` compiles each one, through
ptxas, at the shapes and dtypes the models give it (in a process of its own: the interpreter is
process-wide once the test modules set ``TRITON_INTERPRET``).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[1]
# the kernels that load weights before their PDL wait (gemv.py, gated_delta_decode.py, kda_decode.py; pdl.py's
# rule 1)
LOADS_BEFORE_WAIT = {"_linear_kernel", "_linear_add_rms_norm_kernel", "_gdn_decode_kernel", "_gdn_conv_decode_kernel",
                     "_kda_conv_decode_kernel"}


@pytest.mark.slow  # cold, minutes: started first (conftest's order), not last while the other workers run dry
def test_every_kernel_compiles_for_sm90():
    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("this Triton has no CUDA backend to compile with")
    # Triton's own cache (~/.triton/cache, or TRITON_CACHE_DIR): keyed by each kernel's source, its
    # constexprs, the target and Triton's version, so only what changed compiles again: ~100 s alone cold (a
    # first run, a new Triton; bf16 cases with PDL only, fp32 plain), ~15 s warm. A cache inside the checkout compiled
    # everything again in every fresh clone or worktree.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "compile_gpu_kernels.py"), "--arch", "90"],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    assert "0 cases failed" in proc.stdout and "linear_add_rms_norm gated_norm x3 bfloat16" in proc.stdout
    # the decode step's kernels as a GPU launches them, with PDL: each waits (griddepcontrol.wait) once
    pdl = [line for line in proc.stdout.splitlines() if line.startswith("ok") and " pdl: " in line]
    assert len(pdl) >= 15 and any(line.startswith("ok     linear K=1024 bfloat16 pdl") for line in pdl)
    assert all(line.count("1 griddepcontrol.wait") == line.count(" warps, ") for line in pdl), pdl
    # before its wait a kernel writes nothing (the kernel before may still read that memory), and only
    # the kernels whose wrappers say so load (weights as the module holds them): pdl.py's rule, in the PTX
    kernels = [k for line in pdl for k in re.findall(r"(\w+) \([^()]*griddepcontrol\.wait: (\d+) loads, (\d+) writes", line)]
    assert len(kernels) >= len(pdl) and not [k for k in kernels if k[2] != "0"], kernels
    assert {name for name, loads, _ in kernels if loads != "0"} <= LOADS_BEFORE_WAIT, kernels
    plain = [line for line in proc.stdout.splitlines() if line.startswith("ok") and " pdl: " not in line]
    assert plain and not any("griddepcontrol" in line for line in plain)  # and without it, as other GPUs
