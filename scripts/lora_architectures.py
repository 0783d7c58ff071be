"""Which architectures serve a PEFT LoRA adapter of every linear module, checked against PEFT's own merge.

For each architecture's tiny checkpoint (``tests/checkpoints.py``, two or three layers), PEFT makes an adapter
of rank 4 on ``all-linear`` and merges it into a copy of the checkpoint (``merge_and_unload``); hyla serves the
adapter and the base model in one batch, and the merged checkpoint alone with no cache. Prints, per
architecture: ``equal`` (greedy tokens and logprobs within 1e-4 up to a tie, adapter rows against the merged
model, base rows against the base; and the adapter changes the tokens), or the reason hyla refuses the adapter
(``ValueError`` at load), or PEFT's own refusal. ``tests/test_engine_lora.py`` runs three of them in CI; this
covers the rest (about a minute and a half on 2 cores). Needs the dev extras (``transformers``, ``peft``).

    .venv/bin/python scripts/lora_architectures.py [NAME ...]
"""

from __future__ import annotations

import random
import sys
import tempfile
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import checkpoints  # noqa: E402
from hyla import Engine  # noqa: E402
from test_engine_differential import compare_outputs  # noqa: E402

TWO = ["linear_attention", "full_attention"]
CASES = {
    "qwen3_next": (checkpoints.make_qwen3_next, dict(moe=False, num_hidden_layers=2, layer_types=TWO)),
    "qwen3_5": (checkpoints.make_qwen3_5, dict(num_hidden_layers=2, layer_types=TWO)),
    "qwen3_5_moe": (checkpoints.make_qwen3_5_moe, dict(num_hidden_layers=2, layer_types=TWO)),
    "nemotron_h": (checkpoints.make_nemotron_h, {}),
    "falcon_h1": (checkpoints.make_falcon_h1, dict(num_hidden_layers=2)),
    "bamba": (checkpoints.make_bamba, dict(num_hidden_layers=2, attn_layer_indices=[1])),
    "granite_h": (checkpoints.make_granite_h, dict(num_hidden_layers=2, layer_types=["mamba", "attention"])),
    "lfm2": (checkpoints.make_lfm2, dict(num_hidden_layers=2, layer_types=["conv", "full_attention"])),
    "lfm2_moe": (checkpoints.make_lfm2_moe, dict(num_hidden_layers=2, layer_types=["conv", "full_attention"])),
    "kimi_linear": (checkpoints.make_kimi_linear, dict(num_hidden_layers=2, layer_types=TWO)),
    "bailing_hybrid": (checkpoints.make_bailing_hybrid, dict(num_hidden_layers=2, layer_group_size=2)),
    "olmo_hybrid": (checkpoints.make_olmo_hybrid, dict(num_hidden_layers=2, layer_types=TWO)),
    "lara_mini": (checkpoints.make_lara_mini, dict(num_hidden_layers=2, layer_types=["linear_attention",
                                                                                     "sliding_attention"])),
    "lfm3": (checkpoints.make_lfm3, dict(num_hidden_layers=2, layer_types=["conv", "sliding_attention"])),
    "zamba2": (checkpoints.make_zamba2, dict(num_hidden_layers=3, layers_block_type=["mamba", "hybrid", "hybrid"],
                                             num_mem_blocks=1)),
    "jamba": (checkpoints.make_jamba, dict(num_hidden_layers=2, attn_layer_period=2, attn_layer_offset=1)),
    "minimax": (checkpoints.make_minimax, dict(num_hidden_layers=2, layer_types=TWO)),
    "mamba": (checkpoints.make_mamba, {}),
    "mamba2": (checkpoints.make_mamba2, {}),
}

# where PEFT refuses all-linear (its Mamba check: out_proj), the projections of every other kind
MAMBA_TARGETS = ("in_proj", "x_proj", "dt_proj", "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                 "down_proj")


def check(name: str, tmp: Path) -> str:
    make, kw = CASES[name]
    base = make(tmp, **kw)
    lora = dict(target_modules="all-linear", r=4, seed=3, std=0.05)
    try:
        adapter = checkpoints.make_lora_adapter(tmp, base, **lora)
    except ValueError as exc:  # PEFT refuses Mamba's out_proj: every other projection, then
        if "incompatible with Mamba" not in str(exc):
            return f"PEFT refuses: {exc}"
        lora["target_modules"] = MAMBA_TARGETS
        adapter = checkpoints.make_lora_adapter(tmp, base, **lora)
    merged = checkpoints.make_lora_adapter(tmp, base, merged=True, **lora)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randrange(5, 40))] for _ in range(3)]
    greedy = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
    try:
        with Engine(str(base), enable_lora=True) as engine:
            engine.load_lora_adapter("x", adapter)
            got = engine.generate(input_ids=prompts * 2, sampling_params=greedy, lora_name=["x"] * 3 + [None] * 3,
                                  return_logprob=True)
    except ValueError as exc:
        return f"refused: {str(exc).split(': ', 1)[-1]}"
    want = {}
    for kind, path in (("adapter", merged), ("base", base)):
        with Engine(str(path), enable_prefix_cache=False) as engine:
            want[kind] = engine.generate(input_ids=prompts, sampling_params=greedy, return_logprob=True)
    try:
        compare_outputs(got[:3], want["adapter"])
        compare_outputs(got[3:], want["base"])
    except AssertionError as exc:
        return f"DIFFERS: {exc}"
    changed = any(a["output_ids"] != b["output_ids"] for a, b in zip(got[:3], got[3:]))
    return "equal" if changed else "equal, but the adapter changed no token (no evidence)"


def main() -> None:
    warnings.filterwarnings("ignore")
    names = sys.argv[1:] or list(CASES)
    with tempfile.TemporaryDirectory(prefix="hyla-lora-arch-") as tmp:
        for name in names:
            print(f"{name}: {check(name, Path(tmp))}", flush=True)


if __name__ == "__main__":
    main()
