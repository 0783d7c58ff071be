"""The built-in default model copies from its context (``scripts/train_copy.py``), and the script
that taught it runs.

A model that copies is what n-gram speculative decoding drafts from (``benchmarks/speculative.py``'s
*grounded* workload); a default model retrained without the copy fine-tune fails here rather than
in a benchmark nobody reruns.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hyla import Engine
from hyla.engine.engine import DEFAULT_MODEL_DIR

ROOT = Path(__file__).resolve().parents[1]

# Written for this test (in no training data): what the model is asked to repeat.
PASSAGE = ("The old lighthouse keeper climbed the stairs every evening at six. He checked the lamp, "
           "cleaned the glass and wrote the weather in a small blue book. Ships passed far from the "
           "rocks, and nobody on board ever knew his name, but every one of them came home safely.")


def _four_gram_share(output: list[int], source: list[int]) -> float:
    grams = {tuple(source[i:i + 4]) for i in range(len(source) - 3)}
    return sum(tuple(output[i:i + 4]) in grams for i in range(len(output) - 3)) / max(1, len(output) - 3)


def test_the_default_model_repeats_a_passage_and_ngram_drafts_are_accepted():
    """Asked to repeat a passage it never saw, the model's greedy output is mostly the passage; with
    n-gram speculation the same tokens come out at several tokens per verify step."""
    params = {"temperature": 0, "max_new_tokens": 48}
    with Engine(enable_prefix_cache=False) as plain, Engine(speculative_algorithm="ngram") as spec:
        tok = plain.tokenizer
        prompt = tok.encode(tok.apply_chat_template(
            [{"role": "user", "content": "Repeat the following text exactly:\n\n" + PASSAGE}]), add_special_tokens=False)
        want = plain.generate(input_ids=prompt, sampling_params=params)
        got = spec.generate(input_ids=prompt, sampling_params=params)
    source = tok.encode(PASSAGE, add_special_tokens=False)
    assert _four_gram_share(want["output_ids"], source) > 0.6, tok.decode(want["output_ids"])
    assert got["output_ids"] == want["output_ids"]
    assert got["meta_info"]["spec_accept_length"] > 2.5


@pytest.mark.slow
def test_train_copy_smoke_run(tmp_path):
    """``scripts/train_copy.py`` on a copy of the model, a few steps: new tensors under the same
    names, the MTP head and its config key dropped, the card's copy section written and its MTP
    section gone; the result loads and generates."""
    from safetensors.torch import load_file

    model = tmp_path / "model"
    shutil.copytree(DEFAULT_MODEL_DIR, model)
    before = load_file(model / "model.safetensors")
    run = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "train_copy.py"), "--model-dir", str(model), "--induction-steps", "1",
         "--mixed-steps", "1", "--threads", "1", "--benchmark-passages", "1", "--probe-new-tokens", "8",
         "--seq-len", "128", "--batch-size", "1", "--eval-batches", "1", "--eval-batch-size", "1",
         "--span-probes", "2"],  # a smoke run: 222 -> ~30 s
        capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    after = load_file(model / "model.safetensors")
    assert set(after) == {k for k in before if not k.startswith("mtp.")}
    assert any(not after[k].equal(before[k]) for k in after)
    assert all(after[k].dtype == before[k].dtype for k in after)
    assert "mtp_num_hidden_layers" not in json.loads((model / "config.json").read_text())
    card = (model / "README.md").read_text()
    assert "## Copying from the context" in card and "## MTP head" not in card
    assert card.index("## Copying from the context") < card.index("## Reproduce")
    assert "held-out loss (512 tokens)" in card  # what was measured: --eval-batch-size, --span-probes
    assert "100-token span repeated (2 spans)" in card
    with Engine(model) as eng:
        assert len(eng.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 4})["output_ids"]) == 4
