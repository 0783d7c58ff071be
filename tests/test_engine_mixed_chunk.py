"""Mixed chunked prefill (``enable_mixed_chunk``): while a long prompt is prefilled in chunks, every
step also feeds the decoding requests their next token, and nothing they compute changes.

The cache-pressure differential with mixed steps against the plain uncached run is
``test_engine_differential.py``'s ``mixed_chunk`` case.
"""

from __future__ import annotations

import math
import random

import pytest

from hyla import Engine
from hyla.engine.args import EngineArgs
from hyla.engine.model_runner import ModelRunner
from hyla.engine.scheduler import Scheduler
from test_engine_differential import assert_drained, compare_outputs, hold_for_next_submission, join_stream

GREEDY = dict(temperature=0, ignore_eos=True)


STREAM_TOKENS = 32  # each stream's output: it decodes through the long prompt's 10-11 prefill steps


def _streams_during_a_long_prefill(path, mixed: bool, streams: int = 2, **opts) -> tuple[list[dict], int]:
    """``streams`` requests decode; then a 600-token prompt arrives and is prefilled in 64-token steps.
    Returns every request's output (the streams' chunks joined) and the decode tokens fed in the long
    prompt's prefill steps."""
    rng = random.Random(0)
    shorts = [[rng.randrange(3, 2000) for _ in range(9 + 8 * i)] for i in range(streams)]
    long_prompt = [rng.randrange(3, 2000) for _ in range(600)]
    with Engine(path, chunked_prefill_size=64, enable_mixed_chunk=mixed, max_total_tokens=4096, max_state_slots=32,
                debug_checks=True, **opts) as engine:
        # once every stream decodes, the engine waits for the long prompt: it is admitted one decode
        # step later whatever the machine's speed, and the streams outlive its prefill
        hold_for_next_submission(engine, lambda sched: len(sched.running) == streams
                                 and all(r.output_ids for r in sched.running))
        its = [engine.generate(input_ids=p, sampling_params=dict(GREEDY, max_new_tokens=STREAM_TOKENS),
                               return_logprob=True, stream=True) for p in shorts]
        firsts = [next(s) for s in its]  # all are decoding now: no prefill step until the long prompt's
        before = engine.get_stats()["num_mixed_tokens"]  # (a stream admitted after another mixed it in)
        long_out = engine.generate(input_ids=long_prompt, sampling_params=dict(GREEDY, max_new_tokens=8),
                                   return_logprob=True, logprob_start_len=570)  # its last chunk's logits rows too
        mixed_tokens = engine.get_stats()["num_mixed_tokens"] - before
        outs = [join_stream([first, *stream]) for first, stream in zip(firsts, its)]
        assert_drained(engine)
    return [*outs, long_out], mixed_tokens


def _check_mixed_against_plain(path, streams: int, **opts) -> None:
    plain, plain_mixed = _streams_during_a_long_prefill(path, False, streams, **opts)
    mixed, mixed_tokens = _streams_during_a_long_prefill(path, True, streams, **opts)
    assert plain_mixed == 0
    # every one of the long prompt's prefill steps (its chunks 64 - streams tokens) fed each stream a token
    assert mixed_tokens == streams * math.ceil(600 / (64 - streams))
    assert [len(o["output_ids"]) for o in mixed] == [STREAM_TOKENS] * streams + [8]
    assert compare_outputs(mixed, plain) > 0.9 * (STREAM_TOKENS * streams + 8)
    got, want = (o[-1]["meta_info"]["input_token_logprobs"] for o in (mixed, plain))  # the long prompt's last 30
    assert len(got) == 30 and all(a[1] == b[1] and abs(a[0] - b[0]) < 1e-4 for a, b in zip(got, want))


@pytest.mark.parametrize("apart", [False, True], ids=["in_the_extend", "decode_step_apart"])
def test_a_long_prefill_feeds_the_running_streams_and_changes_no_output(qwen3_next_dense_path, apart, monkeypatch):
    """In the extend (CPU), and as a decode step of their own after it (``decodes_apart``: where
    decode steps replay CUDA graphs, here the eager decode)."""
    steps = []
    if apart:
        monkeypatch.setattr(ModelRunner, "decodes_apart", True)
        real = Scheduler._run_mixed_apart
        monkeypatch.setattr(Scheduler, "_run_mixed_apart", lambda self, batch, ckpts: steps.append(batch.num_mixed)
                            or real(self, batch, ckpts))
    _check_mixed_against_plain(qwen3_next_dense_path, streams=2)
    assert steps.count(2) >= 10 if apart else not steps  # the long prompt's steps (and a stream's admission)


@pytest.mark.gpu
@pytest.mark.parametrize("streams", [2, 9])
def test_mixed_steps_on_a_gpu(qwen3_5_path, streams):
    """fp32 on CUDA with its graphs: a mixed step runs the long prompt's chunk as a fused extend (its
    graph) and the decoding requests as a decode step of their own (``decodes_apart``: the decode
    graph of their batch size, 2 or 9), after it; the outputs within 1e-4 of the plain steps'."""
    _check_mixed_against_plain(qwen3_5_path, streams, device="cuda", dtype="float32")


@pytest.mark.parametrize("bad", ["yes", 1, None])
def test_enable_mixed_chunk_takes_a_bool(bad):
    with pytest.raises(ValueError, match="enable_mixed_chunk must be a bool"):
        EngineArgs(enable_mixed_chunk=bad)


def test_mixed_chunk_is_refused_with_speculative_decoding():
    with pytest.raises(ValueError, match="enable_mixed_chunk is not supported with speculative decoding"):
        EngineArgs(enable_mixed_chunk=True, speculative_algorithm="ngram")
