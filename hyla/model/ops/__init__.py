"""Linear-attention / SSM ops: pure PyTorch, device-agnostic, each beside its naive reference.

See docs/architecture.md ("ops") for the contracts and ``varlen.py`` for the pool conventions.
"""

from hyla.model.ops.conv1d import causal_conv1d_chains, causal_conv1d_ref, causal_conv1d_update, causal_conv1d_varlen
from hyla.model.ops.gated_delta import (
    chunk_gated_delta_rule_varlen,
    gated_delta_rule_chains,
    gated_delta_rule_ref,
    recurrent_gated_delta_rule_update,
)
from hyla.model.ops.kda import chunk_kda_varlen, kda_chains, kda_ref, recurrent_kda_update
from hyla.model.ops.selective_scan import selective_scan_chains, selective_scan_varlen, selective_state_update
from hyla.model.ops.ssd import mamba2_chains, mamba2_chunk_scan_varlen, mamba2_ssd_ref, mamba2_state_update
from hyla.model.ops.varlen import PaddedChains

__all__ = [
    "PaddedChains",
    "causal_conv1d_chains",
    "causal_conv1d_ref",
    "causal_conv1d_update",
    "causal_conv1d_varlen",
    "chunk_gated_delta_rule_varlen",
    "chunk_kda_varlen",
    "gated_delta_rule_chains",
    "gated_delta_rule_ref",
    "kda_chains",
    "kda_ref",
    "mamba2_chains",
    "mamba2_chunk_scan_varlen",
    "mamba2_ssd_ref",
    "mamba2_state_update",
    "recurrent_gated_delta_rule_update",
    "recurrent_kda_update",
    "selective_scan_chains",
    "selective_scan_varlen",
    "selective_state_update",
]
