"""Moving a cached prefix between engines (``Engine.export_prefix`` / ``import_prefix``,
``hyla/cache/prefix_transfer.py``): the engine that imports a prefix serves a request on it with the
tokens and logprobs of an engine that computes everything (the cache off), on every kind of cache
(Gated DeltaNet + attention, Mamba2, Mamba1, attention alone: no states; pages; a float8 KV cache;
MTP's hidden state), under pressure, from the host tier; what it cannot hold is refused with a
``ValueError`` and changes nothing.
"""

from __future__ import annotations

import dataclasses
import json
import random

import pytest
import torch

from hyla import Engine
from hyla.cache import CachedPrefix
from hyla.cache.layout import CacheLayout
from hyla.cache.transfer import as_bytes
from test_engine_differential import FP8_KV_TOL, TOL, assert_drained, compare_outputs

POOLS = dict(max_total_tokens=2048, max_state_slots=32, max_running_requests=8)


def _prompts(seed: int, vocab: int, n: int = 6) -> list[list[int]]:
    """``n`` prompts of 20-120 tokens, every other one starting with one of two shared system prompts."""
    rng = random.Random(seed)
    tok = lambda k: [rng.randrange(3, vocab) for _ in range(k)]  # noqa: E731
    systems = [tok(40), tok(64)]
    return [(systems[i % 2] if i % 3 else []) + tok(rng.randrange(20, 60)) for i in range(n)]


def _greedy(n: int) -> dict:
    return {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}


def _generate(engine: Engine, prompts: list[list[int]], n: int = 8, **kw) -> list[dict]:
    return engine.generate(input_ids=prompts, sampling_params=[_greedy(n)] * len(prompts), return_logprob=True, **kw)


def _exported(path, prompts: list[list[int]], kv_from: list[int] | None = None, **opts) -> list[bytes]:
    """Each prompt prefilled on an engine of its own (one token generated), then its prefix exported (the
    KV from ``kv_from[i]`` on)."""
    with Engine(path, **{**POOLS, **opts}) as source:
        _generate(source, prompts, n=1)
        prefixes = [source.export_prefix(p, kv_from=k) for p, k in zip(prompts, kv_from or [0] * len(prompts))]
        assert all(p is not None and 0 < len(p) <= len(q) - 1 for p, q in zip(prefixes, prompts))
        assert_drained(source)
        return [p.to_bytes() for p in prefixes]


@pytest.mark.parametrize("arch, opts, tol", [
    ("qwen3_next_dense_path", {}, TOL),  # Gated DeltaNet + attention
    ("bamba_short_path", {}, TOL),  # Mamba2 + attention
    ("jamba_short_path", {}, TOL),  # Mamba1 + attention, MoE
    ("qwen3_next_attention_path", {}, TOL),  # attention alone: a tree without states
    ("qwen3_next_dense_path", dict(page_size=16), TOL),  # whole pages
    ("lara_mini_short_path", dict(kv_cache_dtype="fp8"), FP8_KV_TOL),  # float8 K/V, sliding windows
], ids=["qwen3_next", "bamba", "jamba", "attention_only", "paged", "fp8_kv"])
def test_an_imported_prefix_is_hit_exactly(arch, opts, tol, request):
    """A prompt prefilled on one engine, its prefix moved to another as bytes: the other hits all of it
    and answers as an engine with the cache off; the second turn of each, exported after it with only the
    KV the importer lacks (``kv_from``: what it holds, ``cached_tokens(device_only=True)``), adds only that."""
    path = request.getfixturevalue(arch)
    with Engine(path, enable_prefix_cache=False, **{**POOLS, **opts}) as off:
        prompts = _prompts(0, off.model_config.vocab_size)
        first = _generate(off, prompts)
        turns = [p + o["output_ids"] + [5, 6, 7] for p, o in zip(prompts, first)]
        second = _generate(off, turns)
    blobs, whole = _exported(path, prompts, **opts), _exported(path, turns, **opts)
    with Engine(path, **{**POOLS, **opts}) as dest:
        sizes = [dest.import_prefix(b) for b in blobs]
        assert sizes == [len(CachedPrefix.from_bytes(b, dest.cache_layout, dest.tree.state_pool is not None))
                         for b in blobs]
        out = _generate(dest, prompts)
        assert [o["meta_info"]["cached_tokens"] for o in out] == sizes  # (nothing else computed them)
        assert compare_outputs(out, first, tol) > len(prompts) * 4
        held = [dest.cached_tokens(t, device_only=True) for t in turns]
        assert all(h >= s for h, s in zip(held, sizes))
        later = _exported(path, turns, kv_from=held, **opts)
        assert all(len(d) < len(w) for d, w in zip(later, whole))  # (less KV travels)
        kv_before = dest.kv_pool.available_size()
        assert [dest.import_prefix(b) for b in later] == [len(CachedPrefix.from_bytes(
            b, dest.cache_layout, dest.tree.state_pool is not None)) for b in later]
        assert kv_before - dest.kv_pool.available_size() < sum(len(t) for t in turns) // 2  # the new parts only
        out = _generate(dest, turns)
        assert compare_outputs(out, second, tol) > len(prompts) * 4
        assert_drained(dest)


def test_a_prefix_without_the_kv_a_cache_lacks_is_not_taken(qwen3_next_dense_path):
    """A prefix exported with ``kv_from`` into a cache that does not hold the KV before it (it never did, or
    evicted it): nothing changes (the import answers what the cache held), and a request computes the
    prompt itself, exactly. ``kv_from`` past the prefix keeps its last token's KV; a negative one is refused."""
    with Engine(qwen3_next_dense_path, enable_prefix_cache=False, **POOLS) as off:
        prompt = _prompts(6, off.model_config.vocab_size, n=1)[0]
        want = _generate(off, [prompt])
    with Engine(qwen3_next_dense_path, **POOLS) as source:
        _generate(source, [prompt], n=1)
        partial = source.export_prefix(prompt, kv_from=len(prompt) // 2)
        assert partial.kv_start == len(prompt) // 2 and len(partial.kv_rows) == len(partial) - partial.kv_start
        assert source.export_prefix(prompt, kv_from=10 * len(prompt)).kv_start == len(prompt) - 2
        with pytest.raises(ValueError, match="kv_from"):
            source.export_prefix(prompt, kv_from=-1)
        data = partial.to_bytes()
    with Engine(qwen3_next_dense_path, **POOLS) as dest:
        free = dest.kv_pool.available_size()
        assert dest.import_prefix(data) == 0 and dest.kv_pool.available_size() == free
        out = _generate(dest, [prompt])
        assert out[0]["meta_info"]["cached_tokens"] == 0 and compare_outputs(out, want) == 8
        assert_drained(dest)


def test_mtp_hidden_states_travel_with_the_prefix(qwen3_next_dense_mtp_path):
    """With MTP speculation a state slot also holds the last hidden state (the head's input): an
    imported prefix carries it, and the importer's drafts and outputs are those of the cache off."""
    opts = dict(POOLS, speculative_algorithm="mtp", speculative_num_steps=2)
    with Engine(qwen3_next_dense_mtp_path, enable_prefix_cache=False, **opts) as off:
        prompts = _prompts(1, off.model_config.vocab_size, n=4)
        want = _generate(off, prompts, n=10)
    blobs = _exported(qwen3_next_dense_mtp_path, prompts, **opts)
    with Engine(qwen3_next_dense_mtp_path, **opts) as dest:
        assert dest.cache_layout.hidden_size > 0
        sizes = [dest.import_prefix(b) for b in blobs]
        out = _generate(dest, prompts, n=10)
        assert [o["meta_info"]["cached_tokens"] for o in out] == sizes and min(sizes) > 0
        assert compare_outputs(out, want) > 30
        assert_drained(dest)


def test_imports_under_pressure_evict_what_is_unlocked_and_never_a_running_request(qwen3_next_dense_path):
    """A small pool: importing evicts older cached prefixes (the imported ones too), an import that
    only the running requests' KV could make room for holds nothing (returns what the cache had), and
    every answer stays exact."""
    small = dict(max_total_tokens=320, max_state_slots=12, max_running_requests=4)
    with Engine(qwen3_next_dense_path, enable_prefix_cache=False, **small) as off:
        vocab = off.model_config.vocab_size
        prompts = _prompts(2, vocab, n=8)
        rng = random.Random(3)
        long, other = [rng.randrange(3, vocab) for _ in range(250)], [rng.randrange(3, vocab) for _ in range(100)]
        want = _generate(off, prompts)
        want_long = _generate(off, [long], n=60)
    blobs = _exported(qwen3_next_dense_path, prompts + [other])
    with Engine(qwen3_next_dense_path, **small) as dest:
        sizes = [dest.import_prefix(b) for b in blobs[:-1]]  # 8 prefixes of ~50-110 tokens in 320 slots: evictions
        assert all(s > 0 for s in sizes) and dest.cache.num_evicted_tokens > 0
        dest.check_integrity()
        stream = dest.generate(input_ids=long, sampling_params=_greedy(60), return_logprob=True, stream=True)
        chunks = [next(stream)]  # running now: 250 tokens and more of its own, at most 70 left to the tree
        assert dest.import_prefix(blobs[-1]) == 0  # 99 tokens: the room is the running request's
        chunks += list(stream)
        assert compare_outputs([{"output_ids": [t for c in chunks for t in c["output_ids"]], "meta_info": {
            "id": "long", "output_token_logprobs": [lp for c in chunks for lp in c["meta_info"]["output_token_logprobs"]]}}],
            want_long) == 60
        assert [dest.import_prefix(b) for b in blobs[:2]] == sizes[:2]  # room again once it has finished
        out = _generate(dest, prompts[:2])
        assert [o["meta_info"]["cached_tokens"] for o in out] == sizes[:2]
        assert compare_outputs(out, want[:2]) > 10
        assert_drained(dest)


def test_a_prefix_the_device_evicted_is_exported_from_the_host_tier(qwen3_next_dense_path):
    small = dict(max_total_tokens=256, max_state_slots=12, max_running_requests=4, enable_hierarchical_cache=True,
                 hicache_ratio=4.0)
    with Engine(qwen3_next_dense_path, enable_prefix_cache=False, **POOLS) as off:
        prompts = _prompts(4, off.model_config.vocab_size, n=6)
        want = _generate(off, prompts[:1])
    with Engine(qwen3_next_dense_path, **small) as source:
        _generate(source, prompts, n=1)  # the first prompt's prefix evicted from the device by the others'
        assert source.tree.match_prefix(prompts[0][:-1]).prefix_len < len(prompts[0]) - 1
        assert source.cached_tokens(prompts[0]) == len(prompts[0]) - 1  # (the host tier's counts)
        device = source.tree.match_prefix(prompts[0][:-1]).prefix_len
        assert source.cached_tokens(prompts[0], device_only=True) == device
        assert source.cached_tokens_by_tier(prompts[0]) == (device, len(prompts[0]) - 1, len(prompts[0]) - 1)
        prefix = source.export_prefix(prompts[0])
        assert prefix is not None and len(prefix) == len(prompts[0]) - 1
        assert_drained(source)
    with Engine(qwen3_next_dense_path, **POOLS) as dest:
        assert dest.import_prefix(prefix.to_bytes()) == len(prefix)
        out = _generate(dest, prompts[:1])
        assert out[0]["meta_info"]["cached_tokens"] == len(prefix) and compare_outputs(out, want) == 8


def test_a_prefix_keeps_its_namespace(qwen3_next_dense_path):
    with Engine(qwen3_next_dense_path, **POOLS) as source:
        prompt = _prompts(5, source.model_config.vocab_size, n=1)[0]
        source.generate(input_ids=prompt, sampling_params=_greedy(1), namespace=("tenant", 7))
        assert source.export_prefix(prompt) is None and source.cached_tokens(prompt) == 0  # (another namespace's)
        assert source.cached_tokens(prompt, namespace=("tenant", 7)) == len(prompt) - 1
        data = source.export_prefix(prompt, namespace=("tenant", 7)).to_bytes()
    with Engine(qwen3_next_dense_path, **POOLS) as dest:
        assert dest.import_prefix(data) == len(prompt) - 1
        hit = lambda ns: dest.generate(input_ids=prompt, sampling_params=_greedy(1), namespace=ns)[  # noqa: E731
            "meta_info"]["cached_tokens"]
        assert hit(None) == 0 and hit(("tenant", 8)) == 0 and hit(("tenant", 7)) == len(prompt) - 1


def test_namespaces_cross_as_json_with_their_types():
    """A prefix's namespace survives ``to_bytes``: None, str, int, tuples and ``SubNamespace`` (an adapter's
    requests': its kind and key, around the request's own), each read back as the same type (``namespace_key``
    differs between a tuple and a SubNamespace of the same values); what is none of those is refused."""
    from hyla.cache.prefix_transfer import _namespace_from_json, _namespace_to_json
    from hyla.cache.radix_types import SubNamespace, namespace_key

    for ns in (None, "t", 7, ("tenant", 7, None), SubNamespace("lora", "ab12", None),
               SubNamespace("lora", "ab12", ("tenant", SubNamespace("x", "y", 1)))):
        back = _namespace_from_json(json.loads(json.dumps(_namespace_to_json(ns))))
        assert namespace_key(back) == namespace_key(ns)
    assert namespace_key(SubNamespace("lora", "ab12", None)) != namespace_key(("lora", "ab12", None))
    assert namespace_key(SubNamespace("lora", "ab12", 1)) != namespace_key(SubNamespace("lora", "ab12", True))
    for bad in ({"sub": ["lora", 1, None]}, {"sub": ["lora", "k"]}, {"sub": "x"}, {"sub": [], "tuple": []}, 1.5):
        with pytest.raises(ValueError, match="not one"):
            _namespace_from_json(bad)
    for bad in (1.5, True, SubNamespace("lora", 3, None), frozenset()):
        with pytest.raises(ValueError, match="must be None"):
            _namespace_to_json(bad)


def test_what_a_cache_cannot_hold_is_refused_and_changes_nothing(qwen3_next_dense_path, bamba_short_path,
                                                                 qwen3_next_attention_path):
    with Engine(qwen3_next_dense_path, **POOLS) as source:
        prompt = _prompts(6, source.model_config.vocab_size, n=1)[0][:50]
        source.generate(input_ids=prompt, sampling_params=_greedy(1))
        prefix = source.export_prefix(prompt)
        data = prefix.to_bytes()
        assert source.export_prefix(prompt[:1]) is None and source.export_prefix([]) is None
        for bad in ("abc", [1.5, 2], [source.model_config.vocab_size]):
            with pytest.raises(ValueError):
                source.export_prefix(bad)
        with pytest.raises(ValueError, match="hashable"):
            source.export_prefix(prompt, namespace=["a"])
    with Engine(qwen3_next_dense_path, **POOLS) as dest:
        for garbage, match in ((b"", "not a hyla cached prefix"), (b"\x00" * 64, "not a hyla cached prefix"),
                               (data[:len(data) // 2], "not a hyla cached prefix")):
            with pytest.raises(ValueError, match=match):
                dest.import_prefix(garbage)
        with pytest.raises(ValueError, match="CachedPrefix or its bytes"):
            dest.import_prefix("data")
        big = CachedPrefix.from_bytes(data, dest.cache_layout, True)
        assert big.weight_version == prefix.weight_version == "default"  # (the weights that computed it, by name)
        for first in (dest.model_config.vocab_size, -1):
            big.token_ids = (first,) + big.token_ids[1:]
            with pytest.raises(ValueError, match="outside the vocabulary"):
                dest.import_prefix(big)
        # bytes claiming more positions than their tensors hold: refused before pools of the claimed size are made
        claimed = dataclasses.replace(prefix, token_ids=prefix.token_ids + (5,) * 100000).to_bytes()
        with pytest.raises(ValueError, match="do not hold one row per position"):
            dest.import_prefix(claimed)
        assert dest.tree.total_size() == 0
        assert dest.import_prefix(data) == len(prefix)  # and the engine goes on
        assert_drained(dest)
    for path, opts, match in ((bamba_short_path, {}, "another model or cache layout"),
                              (qwen3_next_dense_path, dict(kv_cache_dtype="fp8"), "another model or cache layout"),
                              (qwen3_next_attention_path, {}, "holds a state"),
                              (qwen3_next_dense_path, dict(page_size=16), "page grid"),
                              (qwen3_next_dense_path, dict(enable_prefix_cache=False), "prefix cache is off"),
                              (qwen3_next_dense_path, dict(context_length=len(prefix)), "longer than any prompt"),
                              (qwen3_next_dense_path, dict(weight_version="step-2"), "computed by the weights 'default'")):
        with Engine(path, **{**POOLS, "max_total_tokens": 256, **opts}) as other:
            held = [[3 + (11 * i + j) % 97 for j in range(min(60, other.context_length - 8))] for i in range(4)]
            _generate(other, held, n=1)
            before = [other.cached_tokens(p) for p in held]
            for given in (data, prefix):  # (the object as export_prefix made it: checked before any eviction)
                with pytest.raises(ValueError, match=match):
                    other.import_prefix(given)
                assert [other.cached_tokens(p) for p in held] == before
            other.generate(input_ids=[5, 6, 7], sampling_params=_greedy(2))  # still serving
            assert_drained(other)


def _poison(t, value: float) -> None:
    """One element of ``t`` (a row of a pool's buffer) set to ``value``, in ``t``'s dtype (float8 too)."""
    as_bytes(t).view(-1)[:t.dtype.itemsize] = as_bytes(torch.tensor([value]).to(t.dtype))


def _carried_rows(prefix: CachedPrefix) -> list[tuple[str, torch.Tensor]]:
    """``(name, the last row the prefix carries)`` of each of its buffers: each K and V, each state buffer."""
    kv = [(f"{side}.{i}", buf[int(prefix.kv_rows[-1])]) for side, bufs in (("k", prefix.kv.k_buffers),
                                                                        ("v", prefix.kv.v_buffers))
          for i, buf in enumerate(bufs)]
    state = prefix.state.all_buffers() if prefix.state is not None else []
    return kv + [(f"state.{i}", buf[prefix.state_slot]) for i, buf in enumerate(state) if buf.numel()]


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn,
                                      torch.float8_e5m2], ids=str)
def test_check_values_refuses_non_finite_values(kv_dtype):
    """``CachedPrefix.check_values`` (what ``Engine.import_prefix`` checks of any prefix before the receiving
    cache allocates or evicts anything) refuses a NaN or an infinity, in any K, V or state buffer, of any dtype a cache
    keeps (float8's by its bytes: e4m3fn has no infinity), in the rows the prefix carries: a row it
    does not carry (``drop_kv_before``) is not its to check, and rows out of order are checked as well."""
    layout = CacheLayout(num_attention_layers=2, num_kv_heads=2, head_dim=8, kv_dtype=kv_dtype, num_linear_layers=2,
                         conv_shape=(4, 3), conv_dtype=torch.bfloat16, ssm_shape=(2, 4, 4), ssm_dtype=torch.float32)
    prefix = CachedPrefix.empty(layout, list(range(3, 11)), None, with_state=True)
    for buf in [*prefix.kv.k_buffers, *prefix.kv.v_buffers, *prefix.state.all_buffers()]:
        as_bytes(buf).zero_()
    prefix.check_values()
    shuffled = dataclasses.replace(prefix, kv_rows=prefix.kv_rows.flip(0))
    for value in (float("nan"), float("inf"), float("-inf")):
        for name, row in _carried_rows(prefix):
            if torch.tensor([value]).to(row.dtype).float().isfinite().all():
                continue  # (float8 e4m3fn saturates an infinity)
            saved = row.clone()
            _poison(row, value)
            for given in (prefix, shuffled):
                with pytest.raises(ValueError, match=f"{name} holds NaN or infinite values"):
                    given.check_values()
            row.copy_(saved)
    _poison(prefix.kv.k_buffers[0][int(prefix.kv_rows[0])], float("nan"))  # position 0's KV: not carried below
    prefix.drop_kv_before(4).check_values()
    with pytest.raises(ValueError, match="k.0 holds NaN"):
        prefix.check_values()


def test_a_prefix_with_non_finite_values_is_refused_and_changes_nothing(qwen3_next_dense_path):
    """``import_prefix`` refuses a prefix whose KV or state holds a NaN or an infinity, as bytes and as the
    object, with a ``ValueError`` (the server's 400), before the receiving cache changes; then goes on."""
    with Engine(qwen3_next_dense_path, **POOLS) as source:
        prompt = _prompts(8, source.model_config.vocab_size, n=1)[0][:50]
        source.generate(input_ids=prompt, sampling_params=_greedy(1))
        data = source.export_prefix(prompt).to_bytes()
    with Engine(qwen3_next_dense_path, **POOLS) as dest:
        held = [[3 + (7 * i + j) % 89 for j in range(40)] for i in range(2)]
        _generate(dest, held, n=1)
        before = [dest.cached_tokens(p) for p in held]
        size, free = dest.tree.total_size(), dest.kv_pool.available_size()
        names = [name for name, _ in _carried_rows(CachedPrefix.from_bytes(data, dest.cache_layout, True))]
        assert any(n.startswith("k.") for n in names) and any(n.startswith("state.") for n in names)
        for k, name in enumerate(names):
            bad = CachedPrefix.from_bytes(data, dest.cache_layout, True)
            _poison(dict(_carried_rows(bad))[name], (float("nan"), float("inf"), float("-inf"))[k % 3])
            for given in (bad.to_bytes(), bad):
                with pytest.raises(ValueError, match=f"{name} holds NaN or infinite values"):
                    dest.import_prefix(given)
            assert [dest.cached_tokens(p) for p in held] == before
            assert dest.tree.total_size() == size and dest.kv_pool.available_size() == free
        assert dest.import_prefix(data) == len(CachedPrefix.from_bytes(data, dest.cache_layout, True))
        assert_drained(dest)


# ----------------------------------------------------------------------------------------------
# the server: /export_prefix and /import_prefix
# ----------------------------------------------------------------------------------------------
def test_a_conversation_moves_between_servers(tiny_ckpt_dir):
    """A chat's prompt prefilled on one server (``max_tokens: 1``, ``return_token_ids``), its prefix exported
    there and imported into another: the other answers the chat from its cache, as the first would."""
    import httpx

    from hyla.server.app import create_app
    from hyla.server.launch import BackgroundServer
    from test_server_openai import MODEL, SYSTEM, make_chat_model

    path = make_chat_model(tiny_ckpt_dir)
    opts = dict(served_model_name=MODEL, max_total_tokens=4096, max_state_slots=32, api_key="k")
    auth = {"Authorization": "Bearer k"}
    chat = {"model": MODEL, "messages": [SYSTEM, {"role": "user", "content": "Move me to another server. " * 6}],
            "temperature": 0, "max_tokens": 8, "cache_salt": "team-a"}
    with BackgroundServer(create_app(path, **opts)) as a, \
            BackgroundServer(create_app(path, **opts, max_prefix_bytes=1 << 20)) as b:
        first = httpx.post(a.url + "/v1/chat/completions", json={**chat, "max_tokens": 1, "return_token_ids": True},
                           headers=auth).json()
        ids = first["prompt_token_ids"]
        exported = httpx.post(a.url + "/export_prefix", json={"input_ids": ids, "cache_salt": "team-a"}, headers=auth)
        assert exported.status_code == 200 and exported.headers["content-type"] == "application/octet-stream"
        n = int(exported.headers["x-prefix-tokens"])
        assert n == len(ids) - 1
        imported = httpx.post(b.url + "/import_prefix", content=exported.content, headers=auth)
        assert imported.status_code == 200 and imported.json() == {"cached_tokens": n, "prefix_tokens": n}
        there = httpx.post(b.url + "/v1/chat/completions", json=chat, headers=auth).json()
        here = httpx.post(a.url + "/v1/chat/completions", json=chat, headers=auth).json()
        assert there["usage"]["prompt_tokens_details"]["cached_tokens"] == n
        assert there["choices"][0]["message"] == here["choices"][0]["message"]
        # what is not cached, not a prefix, too large, or not allowed
        unsalted = httpx.post(a.url + "/export_prefix", json={"input_ids": ids}, headers=auth)
        assert unsalted.status_code == 404 and unsalted.json()["error"]["code"] == "prefix_not_cached"
        both = httpx.post(a.url + "/export_prefix", json={"input_ids": ids, "text": "x"}, headers=auth)
        assert both.status_code == 400
        by_text = httpx.post(a.url + "/export_prefix", json={"text": "never seen before, not cached"}, headers=auth)
        assert by_text.status_code == 404
        garbage = httpx.post(b.url + "/import_prefix", content=b"\x00" * 100, headers=auth)
        assert garbage.status_code == 400 and garbage.json()["error"]["code"] == "invalid_prefix"
        engine = b.app.state.server.engine
        poisoned = CachedPrefix.from_bytes(exported.content, engine.cache_layout, True)
        _poison(poisoned.state.all_buffers()[0][poisoned.state_slot], float("nan"))
        refused = httpx.post(b.url + "/import_prefix", content=poisoned.to_bytes(), headers=auth)
        assert refused.status_code == 400 and refused.json()["error"]["code"] == "invalid_prefix"
        assert "NaN or infinite" in refused.json()["error"]["message"]
        too_big = httpx.post(b.url + "/import_prefix", content=b"\x00" * (1 << 20) + b"\x00", headers=auth)
        assert too_big.status_code == 413 and "--max-prefix-bytes" in too_big.json()["error"]["message"]
        assert httpx.post(b.url + "/import_prefix", content=exported.content).status_code == 401
        assert httpx.post(a.url + "/export_prefix", json={"input_ids": ids}).status_code == 401
