"""Shared pytest fixtures: tiny Hugging Face checkpoints, built once per test session.

The builders live in ``tests/checkpoints.py`` (importable as ``checkpoints`` from any test, and by
the benchmarks) so engine and server tests can reuse them.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from hypothesis import settings

# CI replays the same examples on every run (a red CI must be reproducible and never a lucky draw);
# local runs keep exploring new ones. Select explicitly with --hypothesis-profile.
settings.register_profile("ci", derandomize=True, print_blob=True)
settings.register_profile("dev", print_blob=True)
settings.load_profile("ci" if os.environ.get("CI") else "dev")

sys.path.insert(0, str(Path(__file__).resolve().parent))

import checkpoints  # noqa: E402  (needs the path above)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_ckpt_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One directory per session holding every tiny checkpoint built (builders reuse them)."""
    return tmp_path_factory.mktemp("tiny_checkpoints")


@pytest.fixture(scope="session")
def qwen3_next_dense_path(tiny_ckpt_dir: Path) -> Path:
    return checkpoints.make_qwen3_next(tiny_ckpt_dir, moe=False)


@pytest.fixture(scope="session")
def qwen3_next_moe_path(tiny_ckpt_dir: Path) -> Path:
    return checkpoints.make_qwen3_next(tiny_ckpt_dir, moe=True)


@pytest.fixture(scope="session")
def qwen3_5_path(tiny_ckpt_dir: Path) -> Path:
    return checkpoints.make_qwen3_5(tiny_ckpt_dir)


# the same checkpoints with a random MTP head (mtp.* tensors) for speculative_algorithm="mtp"
@pytest.fixture(scope="session")
def qwen3_next_dense_mtp_path(tiny_ckpt_dir: Path) -> Path:
    return checkpoints.make_qwen3_next(tiny_ckpt_dir, moe=False, mtp=True)


@pytest.fixture(scope="session")
def qwen3_next_moe_mtp_path(tiny_ckpt_dir: Path) -> Path:
    return checkpoints.make_qwen3_next(tiny_ckpt_dir, moe=True, mtp=True)


@pytest.fixture(scope="session")
def qwen3_5_mtp_path(tiny_ckpt_dir: Path) -> Path:
    return checkpoints.make_qwen3_5(tiny_ckpt_dir, mtp=True)


@pytest.fixture(scope="session")
def qwen3_5_moe_mtp_path(tiny_ckpt_dir: Path) -> Path:
    return checkpoints.make_qwen3_5_moe(tiny_ckpt_dir, mtp=True)


@pytest.fixture(scope="session")
def nemotron_h_path(tiny_ckpt_dir: Path) -> Path:
    return checkpoints.make_nemotron_h(tiny_ckpt_dir)


@pytest.fixture(scope="session")
def falcon_h1_path(tiny_ckpt_dir: Path) -> Path:
    return checkpoints.make_falcon_h1(tiny_ckpt_dir)


@pytest.fixture(scope="session")
def bamba_path(tiny_ckpt_dir: Path) -> Path:
    return checkpoints.make_bamba(tiny_ckpt_dir)


@pytest.fixture(scope="session")
def granite_h_path(tiny_ckpt_dir: Path) -> Path:
    return checkpoints.make_granite_h(tiny_ckpt_dir)


@pytest.fixture(scope="session")
def qwen3_5_moe_path(tiny_ckpt_dir: Path) -> Path:
    return checkpoints.make_qwen3_5_moe(tiny_ckpt_dir)


@pytest.fixture(scope="session")
def lfm2_path(tiny_ckpt_dir: Path) -> Path:
    return checkpoints.make_lfm2(tiny_ckpt_dir)


@pytest.fixture(scope="session")
def kimi_linear_path(tiny_ckpt_dir: Path) -> Path:
    return checkpoints.make_kimi_linear(tiny_ckpt_dir)
