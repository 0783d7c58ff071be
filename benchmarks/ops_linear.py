"""Linear-attention ops against Hugging Face's PyTorch fallbacks, on the tiny test configs' shapes.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/ops_linear.py [--rounds 7] [--only decode]

Each case times hyla and HF interleaved, ``rounds`` times, and reports the minimum per call (the
least disturbed by other load on the machine). hyla's time includes reading and writing the state
pool through slot indices; HF's works on dense per-batch states. Prefill is one extend of
``batch x 512`` tokens, decode one token per sequence.
"""

from __future__ import annotations

import argparse
import time
from typing import Callable

import torch
import torch.nn.functional as F
import transformers.models.nemotron_h.modeling_nemotron_h as hf_nemotron
import transformers.models.qwen3_next.modeling_qwen3_next as hf_qwen
from transformers.utils import logging

from hyla.model.ops import (
    causal_conv1d_update,
    causal_conv1d_varlen,
    chunk_gated_delta_rule_varlen,
    mamba2_chunk_scan_varlen,
    mamba2_state_update,
    recurrent_gated_delta_rule_update,
)

HK, HV, DK = 2, 4, 64  # Qwen3-Next tiny: linear key/value heads, head dim
CONV_DIM, KERNEL = 512, 4
H, P, G, N = 8, 32, 2, 32  # NemotronH tiny: mamba heads, head dim, groups, state size


def best_of(fns: dict[str, Callable[[], object]], rounds: int, calls: int) -> dict[str, float]:
    """Minimum seconds per call of each function, timed interleaved."""
    best = {name: float("inf") for name in fns}
    for fn in fns.values():
        fn()  # warm-up
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            best[name] = min(best[name], (time.perf_counter() - start) / calls)
    return best


def gdn_cases(batch: int, decode: bool):
    t = 1 if decode else 512
    n = batch * t
    q, k = torch.randn(n, HK, DK), torch.randn(n, HK, DK)
    v = torch.randn(n, HV, DK)
    g, beta = -F.softplus(torch.randn(n, HV)), torch.rand(n, HV)
    pool = torch.zeros(batch + 1, HV, DK, DK)
    slots, cu = torch.arange(1, batch + 1), torch.arange(batch + 1) * t
    dense = pool[1:].clone()
    shaped = [x.view(batch, t, *x.shape[1:]) for x in (q, k, v, g, beta)]
    if decode:
        return {
            "hyla": lambda: recurrent_gated_delta_rule_update(q, k, v, g, beta, pool, slots),
            "hf": lambda: hf_qwen.torch_recurrent_gated_delta_rule(
                *shaped, initial_state=dense, output_final_state=True, use_qk_l2norm_in_kernel=True),
        }
    return {
        "hyla": lambda: chunk_gated_delta_rule_varlen(q, k, v, g, beta, cu, pool, slots),
        "hf": lambda: hf_qwen.torch_chunk_gated_delta_rule(
            *shaped, initial_state=dense, output_final_state=True, use_qk_l2norm_in_kernel=True),
    }


def conv_cases(batch: int, decode: bool):
    t = 1 if decode else 512
    x, w = torch.randn(batch * t, CONV_DIM), torch.randn(CONV_DIM, KERNEL)
    pool = torch.zeros(batch + 1, CONV_DIM, KERNEL - 1)
    slots, cu = torch.arange(1, batch + 1), torch.arange(batch + 1) * t
    dense = torch.zeros(batch, CONV_DIM, KERNEL)
    if decode:
        return {
            "hyla": lambda: causal_conv1d_update(x, w, None, pool, slots),
            "hf": lambda: hf_qwen.causal_conv1d_update(x.unsqueeze(2), dense, w, None, "silu"),
        }
    x_hf = x.view(batch, t, CONV_DIM).transpose(1, 2)
    return {
        "hyla": lambda: causal_conv1d_varlen(x, w, None, cu, pool, slots),
        "hf": lambda: hf_qwen.causal_conv1d_fn(x_hf, w, None, activation="silu"),
    }


def ssd_cases(batch: int, decode: bool, chunk_size: int = 64):
    t = 1 if decode else 512
    n = batch * t
    x, dt = torch.randn(n, H, P), torch.randn(n, H)
    B, C = torch.randn(n, G, N), torch.randn(n, G, N)
    A, D, dt_bias = -torch.arange(1, H + 1).float(), torch.ones(H), torch.ones(H)
    pool = torch.zeros(batch + 1, H, P, N)
    slots, cu = torch.arange(1, batch + 1), torch.arange(batch + 1) * t
    dense = pool[1:].clone()
    limit = (1e-3, float("inf"))
    if decode:
        return {
            "hyla": lambda: mamba2_state_update(x, dt, A, B, C, D, dt_bias, pool, slots),
            "hf": lambda: hf_nemotron.mamba2_selective_state_update(
                dense, x, dt[:, :, None].expand(-1, -1, P), A[:, None, None].expand(-1, P, N), B, C,
                D[:, None].expand(-1, P), dt_bias=dt_bias[:, None].expand(-1, P), dt_softplus=True),
        }
    shaped = [y.view(batch, t, *y.shape[1:]) for y in (x, dt)]
    return {
        "hyla": lambda: mamba2_chunk_scan_varlen(x, dt, A, B, C, D, dt_bias, cu, pool, slots,
                                                 chunk_size=chunk_size, dt_limit=limit),
        "hf": lambda: hf_nemotron.mamba2_chunk_scan(
            *shaped, A, B.view(batch, t, G, N), C.view(batch, t, G, N), chunk_size, D=D, dt_bias=dt_bias,
            initial_states=dense, dt_softplus=True, dt_limit=limit, return_final_states=True),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--only", default="", help="run only the cases whose label contains this text")
    args = parser.parse_args()
    logging.set_verbosity_error()
    torch.manual_seed(0)
    print(f"{'op':<28}{'hyla':>12}{'hf':>12}{'hf/hyla':>10}")
    for op, make in (("conv1d", conv_cases), ("gated delta", gdn_cases), ("mamba2 ssd", ssd_cases)):
        for decode, batches in ((False, (1, 8)), (True, (1, 8, 32))):
            for batch in batches:
                label = f"{op} {'decode' if decode else 'prefill 512'} b={batch}"
                if args.only not in label:
                    continue
                times = best_of(make(batch, decode), args.rounds, calls=200 if decode else 5)
                unit, scale = ("us", 1e6) if decode else ("ms", 1e3)
                print(f"{label:<28}{times['hyla'] * scale:>9.1f} {unit}{times['hf'] * scale:>9.1f} {unit}"
                      f"{times['hf'] / times['hyla']:>9.2f}x")


if __name__ == "__main__":
    main()
