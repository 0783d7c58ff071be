"""Text through the engine: a tiny checkpoint with the default model's tokenizer. Output text is
the decode of the output ids, streamed text adds up to it, and stop strings cut it exactly."""

from __future__ import annotations

import shutil

import pytest

import checkpoints
from hyla import Engine
from hyla.engine.engine import DEFAULT_MODEL_DIR
from hyla.tokenizer import Tokenizer

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


@pytest.fixture(scope="module")
def engine(tiny_ckpt_dir):
    path = checkpoints.make_qwen3_next(tiny_ckpt_dir, moe=False, vocab_size=4096)
    for name in TOKENIZER_FILES:
        shutil.copy(DEFAULT_MODEL_DIR / name, path / name)
    with Engine(path, max_total_tokens=4096, max_state_slots=32, max_running_requests=4, debug_checks=True) as e:
        yield e


PARAMS = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}


def test_text_is_decode_of_output_ids(engine):
    out = engine.generate("The quick brown fox", PARAMS)
    assert out["text"] == engine.tokenizer.decode(out["output_ids"])
    assert out["meta_info"]["prompt_tokens"] == len(engine.tokenizer.encode("The quick brown fox"))


def test_streamed_text_adds_up(engine):
    full = engine.generate("Once upon a time", PARAMS)
    chunks = list(engine.generate("Once upon a time", PARAMS, stream=True))
    assert "".join(c["text"] for c in chunks) == full["text"]


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_cuts_text_before_the_match(engine, stream):
    prompt = "Hello there, how are you"
    ref = engine.generate(prompt, PARAMS)["text"]
    assert len(ref) > 10
    stop = ref[len(ref) // 2: len(ref) // 2 + 3]
    params = {**PARAMS, "stop": ["never-appears", stop]}
    if stream:
        chunks = list(engine.generate(prompt, params, stream=True))
        text = "".join(c["text"] for c in chunks)
        reason = chunks[-1]["meta_info"]["finish_reason"]
    else:
        out = engine.generate(prompt, params)
        text, reason = out["text"], out["meta_info"]["finish_reason"]
    assert text == ref[: ref.index(stop)]
    assert reason == {"type": "stop", "matched": stop}


def test_tokenizer_is_loaded_from_the_model_dir(engine):
    assert isinstance(engine.tokenizer, Tokenizer)
    assert engine.tokenizer.eos_token_ids
