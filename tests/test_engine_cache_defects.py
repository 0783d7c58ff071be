"""Regressions for the cache defects found under pressure (issue: cache under pressure).

Each test fails on the engine before its fix: a hit lost on a grid > 1, a pending decode
checkpoint that evicted a tree checkpoint to replace itself, and a malformed ``checkpoints``
argument that raised ``TypeError`` instead of ``ValueError``.
"""

from __future__ import annotations

import random

import pytest

from hyla import Engine


def _ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 2048) for _ in range(n)]


def _greedy(n: int) -> dict:
    return {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}


@pytest.mark.parametrize("opts", [dict(page_size=16), dict(page_size=1, checkpoint_alignment=64)])
def test_a_prompt_ending_on_the_grid_is_hit_whole_by_the_next_turn(qwen3_next_dense_path, opts):
    """Prompt length P on the grid, output O short of the next grid point: the state at P must be
    cached (prefill asked for P - 1 rounded down, i.e. P - grid, and decode never crossed P)."""
    grid = 64
    prompt = _ids(grid * 2, 1)
    with Engine(qwen3_next_dense_path, max_total_tokens=4096, max_state_slots=32, max_running_requests=4,
                debug_checks=True, **opts) as eng, \
            Engine(qwen3_next_dense_path, enable_prefix_cache=False, max_total_tokens=4096, max_state_slots=32,
                   max_running_requests=4, **opts) as ref:
        first = eng.generate(input_ids=prompt, sampling_params=_greedy(4))
        turn2 = prompt + first["output_ids"] + _ids(30, 2)
        out = eng.generate(input_ids=turn2, sampling_params=_greedy(4), return_logprob=True)
        assert out["meta_info"]["cached_tokens"] == len(prompt)
        want = ref.generate(input_ids=turn2, sampling_params=_greedy(4), return_logprob=True)
        assert out["output_ids"] == want["output_ids"]
        for (a, _, _), (b, _, _) in zip(out["meta_info"]["output_token_logprobs"],
                                        want["meta_info"]["output_token_logprobs"]):
            assert abs(a - b) < 1e-4


def test_replacing_the_pending_decode_checkpoint_evicts_nothing(qwen3_next_dense_path):
    """A full state pool: a long decode passes several grid points. Moving its pending checkpoint
    forward must reuse its own slot, not evict a cached checkpoint for a new one."""
    a = _ids(100, 3)
    with Engine(qwen3_next_dense_path, page_size=16, max_total_tokens=4096, max_state_slots=4,
                max_running_requests=1, debug_checks=True) as eng:
        eng.generate(input_ids=a, sampling_params=_greedy(2))  # caches a checkpoint at 96
        eng.generate(input_ids=_ids(20, 4), sampling_params=_greedy(80))  # passes 32, 48, ..., 96
        again = eng.generate(input_ids=a, sampling_params=_greedy(2))
        assert again["meta_info"]["cached_tokens"] == 96
        assert eng.get_stats()["num_evicted_states"] == 0


def test_a_flat_checkpoint_list_with_a_batch_is_a_value_error(qwen3_next_dense_path):
    with Engine(qwen3_next_dense_path, max_total_tokens=1024, max_state_slots=8, max_running_requests=2) as eng:
        with pytest.raises(ValueError, match="checkpoints"):
            eng.generate(input_ids=[[5, 6, 7, 8], [9, 10, 11]], checkpoints=[3, 2])
        with pytest.raises(ValueError, match="checkpoints"):
            eng.generate(input_ids=[5, 6, 7, 8], checkpoints=[[3]])
        with pytest.raises(ValueError, match="speculative_checkpoints"):
            eng.generate(input_ids=[5, 6, 7, 8], checkpoints=[3], speculative_checkpoints="yes")
        assert eng.generate(input_ids=[[5, 6, 7, 8], [9, 10, 11]], checkpoints=[[3], [2]],
                            sampling_params=_greedy(2))[1]["meta_info"]["completion_tokens"] == 2


def test_a_failed_load_from_the_host_tier_runs_the_request_on_the_devices_hit(qwen3_next_dense_path, monkeypatch,
                                                                             caplog):
    """A load from the host tier whose copy raises (a device out of memory) is logged and the request runs on
    the device's own hit, as without the tier (docs/cache.md); it was aborted with an internal error."""
    from hyla.cache import HostCache

    prompt, others = _ids(120, 7), [_ids(120, 8 + i) for i in range(4)]
    opts = dict(max_total_tokens=300, max_state_slots=16, max_running_requests=2, debug_checks=True)
    with Engine(qwen3_next_dense_path, enable_prefix_cache=False, **opts) as ref:
        want = ref.generate(input_ids=prompt, sampling_params=_greedy(4), return_logprob=True)
    with Engine(qwen3_next_dense_path, enable_hierarchical_cache=True, **opts) as eng:
        for ids in [prompt] + others:  # the prompt's prefix evicted to the host tier
            eng.generate(input_ids=ids, sampling_params=_greedy(4))
        assert eng.cached_tokens(prompt, device_only=True) == 0 and eng.cached_tokens(prompt) > 0

        def fails(self, *args, **kwargs):
            raise RuntimeError("CUDA out of memory (injected)")

        monkeypatch.setattr(HostCache, "load", fails)
        with caplog.at_level("ERROR", logger="hyla.engine"):
            out = eng.generate(input_ids=prompt, sampling_params=_greedy(4), return_logprob=True)
        assert out["meta_info"]["finish_reason"]["type"] == "length" and out["output_ids"] == want["output_ids"]
        assert out["meta_info"]["cached_tokens"] == 0 and "from the host tier failed" in caplog.text
        for (a, _, _), (b, _, _) in zip(out["meta_info"]["output_token_logprobs"],
                                        want["meta_info"]["output_token_logprobs"]):
            assert abs(a - b) < 1e-4
        monkeypatch.undo()
        again = eng.generate(input_ids=prompt, sampling_params=_greedy(4))
        assert again["output_ids"] == want["output_ids"]
