"""The start-up warm-up: a few requests through the whole engine before it serves anyone, so that
the first user request does not pay what a first run costs. On a GPU that is Triton's compiles and
fla's autotuning of the eager prefill's kernels, seconds of them (a CUDA graph's capture compiles
only the kernels it captures); on CPU, ~50-130 ms of first-touch work (docs/benchmarks.md, "Engine
start-up: the warm-up"). SGLang's server sends one warm-up request (``--skip-server-warmup``);
vLLM's model runner runs dummy batches before it serves.

The requests (input ids from a fixed seed, ``ignore_eos``, ``GEN_TOKENS`` new tokens each, fewer
in a context under 32 tokens), through
the public API and the scheduler, as a user's would go:

1. a cold prompt as long as the longest prefill step (``chunked_prefill_size`` tokens, and at
   least ``LONG_PROMPT_PAST_GRAPHS`` past the longest captured extend graph): the eager prefill
   (fla's chunked kernels, the attention's prefill) at its largest, so that the allocator's pools
   (CUDA's caching allocator, the host heap) grow to it now, then decode steps at batch 1;
2. its next turn: that prompt, its output and ``TURN_TOKENS`` new tokens, a cached prefix (the
   checkpoint restored, the new part's extend from its CUDA graph);
3. ``SHORT_PROMPTS`` submitted together: a prefill batch of several sequences (the recurrent and
   the chunked kernels' short paths), decode steps at batch 4 down to 1, and the sampler's paths
   (greedy with top logprobs, temperature with top-p / top-k, min-p with penalties).

With speculative decoding the decode steps are verify steps wherever the drafter drafts. Then the
cache is flushed, the admission heuristic reset and the counters zeroed (``Scheduler.flush_cache``,
``Scheduler.reset_stats``): a warmed engine starts empty and gives the outputs an engine without the
warm-up gives (``tests/test_engine_warmup.py``). A request's sampling seed comes from its id, and
the warm-up's ids (``warmup-*``) are not the user's.

Sizes shrink to fit a small context or KV pool; the warm-up takes one ``Engine.generate`` call per
stage, on the constructing thread, with the engine's loop running. A request that does not run to
its length (a step that failed: out of memory at the longest prefill, say) fails the engine's
construction, rather than the first user request that would fail the same way.
"""

from __future__ import annotations

import logging
import random
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hyla.engine.engine import Engine

logger = logging.getLogger("hyla.engine")

GEN_TOKENS = 8  # tokens each warm-up request generates
LONG_PROMPT_PAST_GRAPHS = 97  # the cold prompt's least length past the longest extend graph
TURN_TOKENS = 200  # the next turn's new tokens
SHORT_PROMPTS = (16, 33, 64, 100)  # the batch's prompt lengths (below and above the chunked kernels' 32)
SHORT_SAMPLING = (
    {"temperature": 0.0, "top_logprobs_num": 5},
    {"temperature": 0.8, "top_p": 0.9, "top_k": 20},
    {"temperature": 1.0, "min_p": 0.05, "repetition_penalty": 1.1, "frequency_penalty": 0.1},
    {"temperature": 0.0, "presence_penalty": 0.5},
)


def warmup_enabled(mode: str, device_type: str) -> bool:
    """Whether an engine warms up: ``mode`` is ``EngineArgs.warmup`` ("auto": on a GPU only)."""
    return mode == "on" or (mode == "auto" and device_type == "cuda")


def warm_up(engine: "Engine") -> dict[str, Any]:
    """Run the warm-up's requests on ``engine`` (idle, nothing cached yet), then flush the cache and
    zero the counters. Returns what ran: ``{"requests", "prompt_tokens", "seconds"}``."""
    start = time.perf_counter()
    rng = random.Random(0)
    vocab, eos = engine.model_config.vocab_size, set(engine.eos_token_ids)
    tokens = [t for t in range(min(vocab, 1 << 16)) if t not in eos]

    def prompt(n: int) -> list[int]:
        return [rng.choice(tokens) for _ in range(n)]

    # the longest prompt one request may have: the context less its new tokens, and a third of the
    # free KV (the first prompt stays cached while its next turn runs)
    gen = max(1, min(GEN_TOKENS, engine.context_length // 4))
    room = min(engine.context_length, engine.kv_pool.available_size() // 3) - gen
    graphs = engine.args.cuda_graph_max_extend_tokens if not engine.args.disable_cuda_graph else 0
    long_len = max(engine.args.chunked_prefill_size, graphs + LONG_PROMPT_PAST_GRAPHS if graphs else 0)
    long_len = max(1, min(long_len, room - gen - TURN_TOKENS))
    greedy = {"max_new_tokens": gen, "ignore_eos": True, "temperature": 0.0}
    lens = [max(1, min(n, room)) for n in SHORT_PROMPTS][:engine.max_running_requests]

    def run(**kw: Any) -> list[dict]:
        """``engine.generate(**kw)``; RuntimeError unless every request ran to its length (a step
        that fails, out of memory say, aborts its requests: the engine would fail the same way on
        the first such request of a user)."""
        outs = engine.generate(**kw)
        outs = outs if isinstance(outs, list) else [outs]
        for out in outs:
            if out["meta_info"]["finish_reason"]["type"] != "length":
                raise RuntimeError(f"the warm-up's request {out['meta_info']['id']} did not run to its length: "
                                   f"{out['meta_info']['finish_reason']} (warmup='off' starts without the warm-up)")
        return outs

    first = prompt(long_len)
    prompts = [first]  # the single prompts that ran
    turn = first + run(input_ids=first, sampling_params=greedy, rid="warmup-0")[0]["output_ids"]
    turn += prompt(max(0, min(TURN_TOKENS, room - len(turn))))
    if len(turn) <= room:  # (a tiny context: no next turn)
        run(input_ids=turn, sampling_params=greedy, rid="warmup-1")
        prompts.append(turn)
    run(input_ids=[prompt(n) for n in lens],
        sampling_params=[{**greedy, **SHORT_SAMPLING[i % len(SHORT_SAMPLING)]} for i in range(len(lens))],
        return_logprob=True, rid=[f"warmup-{2 + i}" for i in range(len(lens))])
    if not engine.flush_cache():
        raise RuntimeError("the engine is still busy after its warm-up's requests returned")
    engine.scheduler.reset_stats()  # idle: the scheduler thread runs no step until the next request
    ran = {"requests": len(prompts) + len(lens), "prompt_tokens": sum(map(len, prompts)) + sum(lens),
           "seconds": time.perf_counter() - start}
    logger.info("warm-up: %d requests (%d prompt tokens) in %.2f s; cache flushed, counters zeroed",
                ran["requests"], ran["prompt_tokens"], ran["seconds"])
    return ran
