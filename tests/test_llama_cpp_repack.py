"""The llama.cpp peer of the CPU benchmark runs the built-in dense model repacked as a one-expert MoE
(``benchmarks/llama_cpp.py``): the repacked checkpoint must compute exactly what the dense one does."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.llama_cpp import repack_as_moe  # noqa: E402
from hyla.engine.engine import DEFAULT_MODEL_DIR  # noqa: E402

transformers = pytest.importorskip("transformers")


def test_dense_model_repacked_as_one_expert_moe_gives_identical_logits(tmp_path):
    repack_as_moe(DEFAULT_MODEL_DIR, tmp_path)
    dense = transformers.AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL_DIR, dtype=torch.float32).eval()
    moe = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert moe.config.num_experts == 1 and moe.config.num_experts_per_tok == 1
    ids = torch.randint(3, dense.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(moe(ids).logits, dense(ids).logits)
