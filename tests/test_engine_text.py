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


def _texts(engine, prompts, params):
    """Each prompt's text without streaming (detokenized once, when the request ends) and
    streamed (detokenized token by token), and the non-streamed outputs."""
    outs = engine.generate(prompts, params)
    streamed = ["".join(c["text"] for c in engine.generate(p, params, stream=True)) for p in prompts]
    return [o["text"] for o in outs], streamed, outs


def test_text_at_the_end_equals_text_token_by_token(engine):
    """A request that neither streams nor has stop strings is detokenized once, when it ends: the
    same text as token by token, also when a stop token (a plain one here, from ``stop_token_ids``)
    ends it (its text left out), and when an unfinished multi-byte character is held back."""
    prompts = ["Once upon a time", "The weather today", "Numbers: 1 2 3", "\u00e9t\u00e9 \u4e2d\u6587"]
    params = {**PARAMS, "max_new_tokens": 40}
    deferred, streamed, outs = _texts(engine, prompts, params)
    assert deferred == streamed
    assert [o["text"] for o in outs] == [engine.tokenizer.decode(o["output_ids"]) for o in outs]
    # a stop token picked from inside each greedy output: the outputs end there, its text left out
    stops = [o["output_ids"][5] for o in outs]
    for p, tok, full in zip(prompts, stops, outs):
        params = {**PARAMS, "max_new_tokens": 40, "stop_token_ids": [tok]}
        (deferred,), (streamed,), (out,) = _texts(engine, [p], params)
        cut = full["output_ids"].index(tok)
        assert out["output_ids"] == full["output_ids"][:cut + 1]
        assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": tok}
        assert deferred == streamed == engine.tokenizer.decode(full["output_ids"][:cut])
    # some outputs of the random model hold bytes of unfinished characters: the case is exercised
    assert any("\ufffd" in engine.tokenizer.decode(o["output_ids"][:k]) for o in outs for k in range(1, 40))


def test_tokenizer_is_loaded_from_the_model_dir(engine):
    assert isinstance(engine.tokenizer, Tokenizer)
    assert engine.tokenizer.eos_token_ids


def test_async_generate_tokenizes_a_long_prompt_off_the_event_loop(engine):
    """A prompt of megabytes takes ~1 s to tokenize (then it is refused: it cannot fit the context);
    ``async_generate`` tokenizes it in a worker thread, so the event loop's other tasks keep their
    pace meanwhile."""
    import asyncio
    import time

    text = "lorem ipsum dolor sit amet, " * 40_000  # 1.1 M characters

    async def main():
        gaps, stop = [], asyncio.Event()

        async def ticker():
            last = time.perf_counter()
            while not stop.is_set():
                await asyncio.sleep(0.005)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        tick = asyncio.create_task(ticker())
        await asyncio.sleep(0.02)
        t = time.perf_counter()
        with pytest.raises(ValueError, match="context length"):
            await engine.async_generate(text, PARAMS)
        took = time.perf_counter() - t
        stop.set()
        await tick
        return took, max(gaps)

    took, worst = asyncio.run(main())
    assert worst < max(0.25, took / 3), (took, worst)  # the loop never waited for the tokenizer
