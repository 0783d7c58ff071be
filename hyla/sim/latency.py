"""The modelled time to first token: a fixed overhead plus the prefill FLOPs of the uncached part.

``ttft = overhead_s + prefill_flops(uncached, prefix=cached) / effective_flops``

Prefill of a hybrid model is compute-bound, so its latency is linear in the uncached tokens plus
the attention layers' term that grows with the context (``CostModel.prefill_flops``). The defaults
model one H100 (989 dense bf16 TFLOP/s) at 40% utilisation and 5 ms of scheduling / launch
overhead. Queueing is not modelled: under the simulator's event-ordered replay, load shows up only
through what the cache holds.
"""

from __future__ import annotations

from dataclasses import dataclass

from hyla.sim.models import CostModel


@dataclass(frozen=True)
class LatencyModel:
    effective_flops: float = 0.4 * 989e12  # FLOP/s the prefill sustains
    overhead_s: float = 0.005  # per request: scheduling, launch, sampling the first token

    def __post_init__(self) -> None:
        if self.effective_flops <= 0 or self.overhead_s < 0:
            raise ValueError(f"bad latency model: {self.effective_flops=}, {self.overhead_s=}")

    def ttft(self, model: CostModel, input_len: int, cached_len: int) -> float:
        """Seconds to the first token of a prompt of ``input_len`` tokens with ``cached_len`` cached."""
        if not 0 <= cached_len <= input_len:
            raise ValueError(f"cached_len must be in [0, input_len={input_len}], got {cached_len}")
        return self.overhead_s + model.prefill_flops(input_len - cached_len, cached_len) / self.effective_flops
