"""Pool sizes that come from memory are capped by what the engine can use (issue 13: the built-in
15 MB model's server took 2.4 GB because 10% of RAM was preallocated): KV for every running request at
the full context length, a state slot per running request plus three checkpoints each. Explicit
sizes win, and a budget below the caps (a large model) sizes the pools as before."""

from __future__ import annotations

import pytest
import torch

from hyla import Engine
from hyla.cache import split_memory
from hyla.engine import engine as engine_module
from hyla.engine.engine import (CHECKPOINTS_PER_RUNNING_REQUEST, CPU_MAX_RUNNING_REQUESTS, MAX_RUNNING_REQUESTS,
                                default_max_running_requests)

CONTEXT = 4096  # the built-in model's max_position_embeddings
GREEDY = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}


@pytest.fixture(autouse=True)
def plenty_of_ram(monkeypatch):
    """32 GiB free, whatever the machine has now: the caps, not the moment's free RAM, decide these sizes
    (CI's runner once had little enough free that the ngram engine below got 30 running requests, not 32).
    Tests that give a budget or a RAM size of their own patch over this."""
    monkeypatch.setattr(engine_module, "_available_ram", lambda: 32 << 30)


def _pool_bytes(e: Engine) -> int:
    return e.kv_pool.size * e.kv_pool.bytes_per_token + e.state_pool.size * e.state_pool.bytes_per_slot


def _old_sizes(e: Engine) -> tuple[int, int]:
    """What the pools were before the caps: the memory split, capped at 2^22 tokens and 4096 slots."""
    layout = e.model_config.cache_layout
    split = split_memory(engine_module._cache_budget_bytes(e.device, 0.0), e.args.state_memory_ratio,
                         layout.kv_bytes_per_token, layout.state_bytes_per_slot, e.args.page_size)
    return min(max(split.num_kv_tokens, 4), 1 << 22), min(max(split.num_state_slots, 8), 4096)


def test_default_model_pools_are_sized_for_the_model_and_still_serve():
    assert default_max_running_requests(torch.device("cpu")) == CPU_MAX_RUNNING_REQUESTS == 32
    assert default_max_running_requests(torch.device("cuda")) == MAX_RUNNING_REQUESTS == 256
    with Engine() as e:
        old_tokens, old_slots = _old_sizes(e)
        running = CPU_MAX_RUNNING_REQUESTS
        assert e.max_running_requests == running
        assert e.kv_pool.size == min(running * CONTEXT, old_tokens)
        assert e.state_pool.size == min(running * (1 + CHECKPOINTS_PER_RUNNING_REQUEST), old_slots)
        assert e.context_length == CONTEXT
        assert _pool_bytes(e) < 320 * 2**20  # 256 MiB of KV + 52.5 MiB of state
        assert old_tokens * e.kv_pool.bytes_per_token > 1 << 30  # 10% of 32 GiB, less the state share
        assert e.kv_pool.size * 4 < old_tokens and e.state_pool.size * 4 < old_slots
        assert "pool sizes: KV capped at 32 requests x 4096 tokens, state capped at 32 requests x 4 slots" \
            in e.summary()
        # still serves: a batch larger than the running limit queues and finishes
        outs = e.generate(input_ids=[[5 + i, 6, 7, 8] for i in range(running + 8)], sampling_params=GREEDY)
        assert all(o["meta_info"]["completion_tokens"] == 6 for o in outs)
        long = e.generate(input_ids=list(range(3, 3003)), sampling_params=GREEDY)  # most of the context
        assert long["meta_info"]["completion_tokens"] == 6


def test_context_length_and_max_running_requests_shrink_the_caps():
    with Engine(context_length=1024, max_running_requests=8) as e:
        assert e.context_length == 1024 and e.max_running_requests == 8
        assert e.kv_pool.size == 8 * 1024
        assert e.state_pool.size == 8 * (1 + CHECKPOINTS_PER_RUNNING_REQUEST)
        assert "KV capped at 8 requests x 1024 tokens" in e.summary()
    with Engine(speculative_algorithm="ngram", speculative_num_draft_tokens=4, page_size=16,
                context_length=1000) as e:  # 3 scratch slots per running request; whole pages
        assert e.max_running_requests == 32
        assert e.state_pool.size == 32 * (4 + CHECKPOINTS_PER_RUNNING_REQUEST)
        assert e.kv_pool.size == 32 * 1000 and e.kv_pool.size % 16 == 0


def test_explicit_sizes_win():
    with Engine(max_total_tokens=1000, max_state_slots=600) as e:
        assert e.kv_pool.size == 1000 and e.state_pool.size == 600
        assert e.max_running_requests == 256  # half the explicit slots, at most 256: as before
        assert e.context_length == 1000
        assert "pool sizes: KV given, state given" in e.summary()
        out = e.generate(input_ids=[5, 6, 7], sampling_params=GREEDY)
        assert out["meta_info"]["completion_tokens"] == 6


def test_a_budget_below_the_caps_sizes_the_pools_as_before(monkeypatch):
    """A large model: the budget, not the caps, decides (the sizes the memory split gives)."""
    budget = 12 * 2**20
    monkeypatch.setattr(engine_module, "_cache_budget_bytes", lambda device, fraction: budget)
    with Engine() as e:
        layout = e.model_config.cache_layout
        split = split_memory(budget, 0.9, layout.kv_bytes_per_token, layout.state_bytes_per_slot, 1)
        assert (e.kv_pool.size, e.state_pool.size) == (split.num_kv_tokens, split.num_state_slots)
        assert e.max_running_requests == split.num_state_slots // 2
        assert e.kv_pool.size < 32 * CONTEXT and "pool sizes: KV from memory, state from memory" in e.summary()


@pytest.mark.parametrize("options", [{"max_state_slots": 1}, {"max_running_requests": 4, "max_state_slots": 4}])
def test_too_few_slots_are_still_refused(options):
    with pytest.raises(ValueError, match="max_state_slots|max_running_requests"):
        Engine(**options)


def test_a_context_length_the_kv_pool_cannot_hold_is_refused(caplog):
    """An explicit context_length longer than the KV pool holds for one request is a ValueError
    saying what to raise (it was silently cut to the pool); past the model's
    max_position_embeddings (the built-in model's 4,096) it runs, with a warning."""
    with pytest.raises(ValueError, match=r"context_length=5000 does not fit the KV pool \(4096 tokens.*max_total_tokens"):
        Engine(max_total_tokens=4096, context_length=5000)
    with caplog.at_level("WARNING", logger="hyla.engine"), Engine(max_total_tokens=6000, context_length=5000) as e:
        assert e.context_length == 5000
        out = e.generate(input_ids=[3 + i % 4000 for i in range(4600)], sampling_params=GREEDY)  # positions past 4,096
        assert out["meta_info"]["completion_tokens"] == 6
    assert "longer than the model's max_position_embeddings (4096)" in caplog.text


def test_a_model_without_attention_sizes_its_pools_from_memory(mamba2_path, monkeypatch):
    """A pure state-space model (Mamba2: no KV at all) with no explicit sizes: the split of the budget
    needs KV bytes per token (it raised a ValueError), so the state pool takes the whole budget and the
    KV pool (token indices only, zero bytes) its cap; a small budget then bounds the slots, not the caps."""
    with Engine(mamba2_path) as e:
        assert e.model_config.cache_layout.kv_bytes_per_token == 0
        assert e.kv_pool.size == 32 * CONTEXT and e.state_pool.size == 32 * (1 + CHECKPOINTS_PER_RUNNING_REQUEST)
        assert e.generate(input_ids=[5, 6, 7], sampling_params=GREEDY)["meta_info"]["completion_tokens"] == 6
    per_slot = e.model_config.cache_layout.state_bytes_per_slot
    monkeypatch.setattr(engine_module, "_cache_budget_bytes", lambda device, fraction: 41 * per_slot)
    with Engine(mamba2_path) as e:
        assert e.state_pool.size == 40 and e.max_running_requests == 20
        assert "state from memory" in e.summary()


def test_a_long_context_warns_only_where_attention_has_positions(mamba2_path, caplog):
    """Past max_position_embeddings only attention layers see untrained positions: a pure state-space
    model (whose configs give no limit: the default 4,096) runs a longer context without the warning."""
    with caplog.at_level("WARNING", logger="hyla.engine"), \
            Engine(mamba2_path, max_total_tokens=6000, max_state_slots=8, context_length=5000) as e:
        assert e.context_length == 5000
        out = e.generate(input_ids=[3 + i % 200 for i in range(4600)], sampling_params=GREEDY)
        assert out["meta_info"]["completion_tokens"] == 6
    assert "max_position_embeddings" not in caplog.text


def test_the_host_tier_is_sized_by_ratio_or_by_size(qwen3_next_dense_path):
    """hicache_ratio multiplies both device pools; hicache_size (GiB) is split between KV and states
    as the device's budget is (state_memory_ratio)."""
    with Engine(qwen3_next_dense_path, max_total_tokens=600, max_state_slots=20, enable_hierarchical_cache=True,
                hicache_ratio=1.5) as e:
        host = e.cache.host
        assert (host.kv_pool.size, host.state_pool.size) == (900, 30)
        assert host.kv_pool.device.type == "cpu" and "host tier: 900 tokens, 30 state slots" in e.summary()
        assert e.get_stats()["host_token_usage"] == 0.0
    with Engine(qwen3_next_dense_path, max_total_tokens=600, max_state_slots=20, enable_hierarchical_cache=True,
                hicache_size=0.01) as e:
        layout, host = e.model_config.cache_layout, e.cache.host
        split = split_memory(int(0.01 * 2**30), 0.9, layout.kv_bytes_per_token, layout.state_bytes_per_slot, 1)
        assert (host.kv_pool.size, host.state_pool.size) == (split.num_kv_tokens, split.num_state_slots)


def test_a_host_tier_larger_than_the_ram_is_refused(qwen3_next_dense_path, monkeypatch):
    """The host pools' bytes (``HostCache.planned_bytes``: the pools' own ``total_bytes``, before they
    are built) are checked against the RAM available: more is a ValueError naming both."""
    opts = dict(max_total_tokens=600, max_state_slots=20, enable_hierarchical_cache=True, hicache_ratio=2.0)
    with Engine(qwen3_next_dense_path, **opts) as e:
        planned = e.cache.host.total_bytes
        assert planned == e.cache.host.planned_bytes(e.model_config.cache_layout, e.tree, 1200, 40)
    monkeypatch.setattr(engine_module, "_available_ram", lambda: planned - 1)
    with pytest.raises(ValueError, match=r"host pools .* need .* GiB, more than the .* GiB of RAM available"):
        Engine(qwen3_next_dense_path, **opts)
    monkeypatch.setattr(engine_module, "_available_ram", lambda: planned)
    with Engine(qwen3_next_dense_path, **opts) as e:
        assert e.cache.host.total_bytes == planned


def test_a_host_tier_under_a_gpu_plans_its_pinned_staging_too():
    """Under a CUDA device's tree the plan adds the pinned memory the tier's copies may hold: the saves in
    flight (1 GiB, or the pools' size where smaller) and a load's two blocks."""
    from types import SimpleNamespace

    from hyla.cache import HostCache
    from hyla.cache.host_cache import MAX_STAGED_BYTES
    from hyla.cache.layout import CacheLayout
    from hyla.cache.transfer import COPY_BLOCK_BYTES

    layout = CacheLayout(num_attention_layers=2, num_kv_heads=2, head_dim=4, num_linear_layers=1, conv_shape=(8, 3),
                         ssm_shape=(8, 8))

    def tree(device):
        return SimpleNamespace(page_size=1, state_pool=object(), kv_pool=SimpleNamespace(device=torch.device(device)))
    for tokens, slots in ((1000, 10), (10_000_000, 10)):
        pools = HostCache.planned_bytes(layout, tree("cpu"), tokens, slots)
        assert pools == (tokens + 1) * layout.kv_bytes_per_token + (slots + 1) * layout.state_bytes_per_slot
        staged = min(MAX_STAGED_BYTES, pools) + 2 * COPY_BLOCK_BYTES
        assert HostCache.planned_bytes(layout, tree("cuda"), tokens, slots) == pools + staged


def test_given_running_requests_get_their_slots_however_low_the_budget(monkeypatch):
    """max_running_requests given, slots from memory: a budget whose split holds fewer slots than the
    requests need (CI's runner, its free RAM low under the suite, gave an ngram engine of 4 requests x
    5 slots 10 slots: a ValueError naming max_state_slots, which nobody gave) still gets a state slot
    and scratch plus a checkpoint for each (here 4 x (1 + 3 drafts + 1)); a budget below even that is
    refused, saying what to change."""
    per_slot = Engine().model_config.cache_layout.state_bytes_per_slot
    spec = {"speculative_algorithm": "ngram", "speculative_num_draft_tokens": 4, "max_running_requests": 4}
    monkeypatch.setattr(engine_module, "_cache_budget_bytes", lambda device, fraction: 40 * per_slot)
    with Engine(**spec) as e:
        assert e.max_running_requests == 4 and e.state_pool.size == 4 * (1 + 3 + 1)
        assert _pool_bytes(e) <= 40 * per_slot  # (the slots past the state share came out of the KV's)
        outs = e.generate(input_ids=[[5, 6, 7, 5, 6, 7]] * 4, sampling_params=GREEDY)
        assert [o["meta_info"]["completion_tokens"] for o in outs] == [6] * 4
    monkeypatch.setattr(engine_module, "_cache_budget_bytes", lambda device, fraction: 21 * per_slot)
    with pytest.raises(ValueError, match=r"max_running_requests \(4\) needs at least 20 state slots .* no room for "
                                         r"KV .* lower max_running_requests, raise mem_fraction, or give max_state_slots"):
        Engine(**spec)


def test_available_ram_is_what_the_kernel_can_give(monkeypatch):
    """Linux's MemAvailable (the page cache counts: the kernel drops it on demand), not the free
    pages alone, which a busy machine keeps near zero."""
    meminfo = "MemTotal:       32000000 kB\nMemFree:          100000 kB\nMemAvailable:   20000000 kB\n"
    monkeypatch.undo()  # the autouse fixture's 32 GiB
    import io
    monkeypatch.setattr(engine_module, "open", lambda path, *a, **k: io.StringIO(meminfo), raising=False)
    assert engine_module._available_ram() == 20000000 * 1024


@pytest.mark.parametrize("files, left", [
    ({"fs/cgroup/memory.max": "2147483648\n", "fs/cgroup/memory.current": "536870912\n"}, 3 << 29),
    ({"fs/cgroup/memory.max": "max\n", "fs/cgroup/memory.current": "536870912\n"}, None),
    ({"fs/cgroup/memory/memory.limit_in_bytes": "1073741824\n", "fs/cgroup/memory/memory.usage_in_bytes": "0\n"}, 1 << 30),
    ({"fs/cgroup/memory/memory.limit_in_bytes": "9223372036854771712\n",
      "fs/cgroup/memory/memory.usage_in_bytes": "5\n"}, None),
    ({}, None)])
def test_a_containers_memory_limit_bounds_the_ram_available(tmp_path, files, left):
    """Inside a container MemAvailable is the host's: the cgroup's limit less its usage bounds it (v2, else v1;
    none, or v1's near-2^63 "no limit", leaves MemAvailable)."""
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert engine_module._cgroup_memory_left(str(tmp_path)) == left
