"""Which Triton compiles a serving engine's request data would cause on a GPU, found on a CPU.

Runs an engine whose steps take the fused (Triton) path on CPU tensors, interpreted, over a tiny
2-layer model (``tests/checkpoints.py``): a warm-up of two waves at 128 prompt tokens, then a mix of
batch sizes, prompt lengths (3 to 1,100 tokens), cached prefixes and, with ``--speculative``, verify
steps. Each launch's compile key is the one a CUDA launch of the same arguments would have
(``tests/compile_keys.py``). It prints, per kernel, its compile keys, its constexpr sets, the
arguments whose specialization differs between launches of the same constexprs, and the launches
after the warm-up that a GPU would have compiled anew (stalls mid-serving). See
``hyla/model/ops/gpu/__init__.py`` ("One compile per model"). Interpreted: 5-10 minutes.

    .venv/bin/python scripts/triton_compile_keys.py [--model qwen3_5|bamba|qwen3_5_moe] [--speculative ngram|mtp]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"  # before any kernel is defined
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=("qwen3_5", "bamba", "qwen3_5_moe"), default="qwen3_5")
    ap.add_argument("--speculative", choices=("ngram", "mtp"), help="verify steps (and the MTP head's steps)")
    args = ap.parse_args()

    import pytest

    import checkpoints
    import hyla.model.ops.gpu as gpu_ops
    from compile_keys import record_compile_keys
    from hyla import Engine
    from hyla.model.layers import SparseMoE

    short = dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"])  # as tests/conftest.py's
    make = {"qwen3_5": lambda d: checkpoints.make_qwen3_5(d, mtp=args.speculative == "mtp", **short),
            "qwen3_5_moe": lambda d: checkpoints.make_qwen3_5_moe(d, **short),
            "bamba": lambda d: checkpoints.make_bamba(d, num_hidden_layers=2, attn_layer_indices=[1])}[args.model]
    if args.speculative == "mtp" and args.model != "qwen3_5":
        ap.error("--speculative mtp: the qwen3_5 model (its checkpoint has an MTP head)")
    tmp = tempfile.TemporaryDirectory(prefix="hyla-compile-keys-")
    path = make(Path(tmp.name))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gpu_ops, "available", lambda device: True)  # the fused path (CUDA's) on the CPU
        mp.setattr(SparseMoE, "path", lambda self, x: "grouped")  # MoE experts as on a GPU (moe.expert_gemm)
        keys = record_compile_keys(mp)
        opts = dict(device="cpu", dtype="float32", max_total_tokens=8192, max_state_slots=48, max_running_requests=8)
        if args.speculative:
            opts["speculative_algorithm"] = args.speculative
        with Engine(path, **opts) as engine:
            vocab = engine.model_config.vocab_size
            rng = random.Random(0)

            def wave(n: int, lo: int, hi: int) -> None:
                motif = [rng.randrange(3, vocab) for _ in range(8)]  # repeated: n-gram drafts find matches
                ids = [(motif * 200)[:rng.randrange(lo, hi)] if args.speculative == "ngram"
                       else [rng.randrange(3, vocab) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]
                engine.generate(input_ids=ids, sampling_params={"temperature": 0, "ignore_eos": True,
                                                                "max_new_tokens": rng.randrange(2, 7)})

            wave(1, 128, 129)
            wave(4, 128, 129)
            keys.mark()
            for n, lo, hi in [(1, 3, 40), (3, 20, 300), (6, 3, 90), (2, 1030, 1100), (1, 300, 301)]:
                wave(n, lo, hi)
    new = keys.new_variants()
    print(f"| kernel ({args.model}{', ' + args.speculative if args.speculative else ''}) | compile keys | "
          "constexpr sets | specialization differing at the same constexprs | new after the warm-up |")
    print("|---|---|---|---|---|")
    for kernel, (n, consts, varied) in keys.variation().items():
        print(f"| `{kernel}` | {n} | {consts} | {'; '.join(varied) or '—'} | {'; '.join(new.get(kernel, [])) or '—'} |")
    tmp.cleanup()


if __name__ == "__main__":
    main()
