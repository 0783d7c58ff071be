"""LoRA adapters (``hyla/model/lora.py``, ``hyla/engine/lora_manager.py``).

The oracle is PEFT itself: each adapter is made by ``peft`` (``checkpoints.make_lora_adapter``), and the
model it must serve as is the base checkpoint with that adapter merged by ``peft`` (``merge_and_unload``).
An engine serving several adapters and the base model in one batch, its prefix cache on and its pools
small enough to evict and retract, gives each request the greedy tokens and logprobs (within fp32's 1e-4,
up to a tie: ``test_engine_differential.compare_outputs``) of the merged model run alone with no cache.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

import checkpoints
from hyla import Engine
from hyla.engine.args import EngineArgs
from hyla.engine.errors import RequestError
from hyla.model.linear import Linear
from hyla.model import lora
from hyla.model.lora import LinearLoRA, LoRABatch, LoRAScope
from test_engine_differential import assert_drained, compare_outputs, make_workload

# the fused kernels on CPU tensors, interpreted (conftest sets TRITON_INTERPRET=1 without a GPU); on a GPU machine
# the gpu test below runs them for real, against the merged models
INTERPRETED = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs Triton's interpreter on CPU")

# every projection of Qwen3.5's layers PEFT can target (its MLP's gate and up are one fused parameter
# in transformers, which PEFT leaves alone); B: another set, another rank, rsLoRA
QWEN3_5_A = ("q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj",
             "down_proj")
QWEN3_5_B = ("q_proj", "v_proj", "in_proj_qkv", "down_proj")


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, qwen3_5_short_path):
    """``{name: (adapter dir, merged checkpoint)}`` for two adapters of the short Qwen3.5."""
    pytest.importorskip("peft")  # (a dev dependency: absent only on a GPU machine given hyla's wheels alone)
    d = tmp_path_factory.mktemp("lora")
    made = {}
    for name, kw in (("a", dict(target_modules=QWEN3_5_A, r=4, seed=0)),
                     ("b", dict(target_modules=QWEN3_5_B, r=8, lora_alpha=4.0, use_rslora=True, seed=1))):
        made[name] = (checkpoints.make_lora_adapter(d, qwen3_5_short_path, **kw),
                      checkpoints.make_lora_adapter(d, qwen3_5_short_path, merged=True, **kw))
    return made


def greedy(max_new: int) -> dict:
    return {"temperature": 0, "max_new_tokens": max_new, "ignore_eos": True}


def run(engine: Engine, specs: list[dict], lora_names: list[str | None] | None = None) -> list[dict]:
    return engine.generate(input_ids=[s["ids"] for s in specs], sampling_params=[greedy(s["max_new"]) for s in specs],
                           return_logprob=True, lora_name=lora_names)


def reference(path, specs: list[dict]) -> list[dict]:
    """``specs`` on the checkpoint at ``path`` (a merged one, or the base), no cache, one at a time."""
    with Engine(str(path), enable_prefix_cache=False, max_running_requests=1) as engine:
        return run(engine, specs)


@pytest.mark.parametrize("slots", [{}, dict(max_loras=1, max_cpu_loras=2, max_total_tokens=300)], ids=["a-slot-each", "one-slot"])
def test_adapters_and_base_in_one_batch_equal_their_merged_models_under_pressure(qwen3_5_short_path, adapters, slots):
    """Every prompt three times, under adapter a, adapter b and the base model, in one engine whose cache
    must keep them apart (same tokens, different K/V and states), with small pools (eviction, retraction)
    and a small prefill chunk; then second turns that hit the cache within each adapter. With one slot for
    two adapters (``max_cpu_loras``), their requests take turns in it: each adapter written in again and
    again, a retracted request's adapter gone from the slot when it is admitted again."""
    wave1, followups = make_workload(seed=3, vocab=2048, num_sessions=8, num_shared=4, scale=0.5)
    names = ["a", "b", None]
    kw = dict(enable_lora=True, max_total_tokens=500, max_state_slots=16, chunked_prefill_size=48) | slots
    with Engine(str(qwen3_5_short_path), **kw) as engine:
        for name in ("a", "b"):
            engine.load_lora_adapter(name, adapters[name][0])
        assert engine.lora_adapters() == {n: str(adapters[n][0]) for n in ("a", "b")}
        specs = [s for s in wave1 for _ in names]
        first = run(engine, specs, names * len(wave1))
        wave2 = [{"ids": s["ids"] + o["output_ids"] + followups[k // 3 % len(followups)], "max_new": 6}
                 for k, (s, o) in enumerate(zip(specs, first))]
        second = run(engine, wave2, names * len(wave1))
        assert sum(o["meta_info"]["cached_tokens"] for o in second) > 0
        assert engine.scheduler.num_retractions > 0 and engine.cache.num_evicted_tokens > 0  # the pressure was real
        loads = engine.get_stats()["num_lora_slot_loads"]
        assert loads > 4 if slots else loads == 2  # (one slot: the adapters took turns in it)
        assert_drained(engine)
    compared = 0
    for i, name in enumerate(names):
        path = adapters[name][1] if name else qwen3_5_short_path
        want = reference(path, specs[i::3] + wave2[i::3])
        compared += compare_outputs((first[i::3] + second[i::3]), want)
    assert compared > 0.9 * sum(s["max_new"] for s in specs + wave2)
    # the adapters matter: each gives other tokens than the base model
    for i in (0, 1):
        assert any(o["output_ids"] != base["output_ids"] for o, base in zip(first[i::3], first[2::3]))


def test_cache_is_per_adapter(qwen3_5_short_path, adapters):
    """A prompt cached by the base model is no hit for an adapter (and back); the adapter's own is, under
    any name its files are loaded as, and after being unloaded and loaded again."""
    prompt = list(range(10, 90))
    with Engine(str(qwen3_5_short_path), enable_lora=True) as engine:
        engine.load_lora_adapter("a", adapters["a"][0])
        base = engine.generate(input_ids=prompt, sampling_params=greedy(4))
        first = engine.generate(input_ids=prompt, sampling_params=greedy(4), lora_name="a")
        assert first["meta_info"]["cached_tokens"] == 0
        again = engine.generate(input_ids=prompt, sampling_params=greedy(4), lora_name="a")
        assert again["meta_info"]["cached_tokens"] > 0 and again["output_ids"] == first["output_ids"]
        engine.load_lora_adapter("a-too", adapters["a"][0])
        assert engine.generate(input_ids=prompt, sampling_params=greedy(4), lora_name="a-too")["meta_info"][
            "cached_tokens"] > 0
        engine.load_lora_adapter("b", adapters["b"][0])
        assert engine.generate(input_ids=prompt, sampling_params=greedy(4), lora_name="b")["meta_info"][
            "cached_tokens"] == 0
        engine.unload_lora_adapter("a")
        engine.unload_lora_adapter("a-too")
        engine.load_lora_adapter("a", adapters["a"][0])
        reloaded = engine.generate(input_ids=prompt, sampling_params=greedy(4), lora_name="a")
        assert reloaded["meta_info"]["cached_tokens"] > 0 and reloaded["output_ids"] == first["output_ids"]
        assert base["output_ids"] != first["output_ids"]


@pytest.mark.parametrize("make, kw, targets", [
    # Qwen3-Next: in_proj_qkvz and in_proj_ba regrouped per head into one in projection, q/k/v into one
    (checkpoints.make_qwen3_next, dict(moe=False, num_hidden_layers=2, layer_types=["linear_attention",
                                                                                     "full_attention"]),
     ("in_proj_qkvz", "in_proj_ba", "q_proj", "k_proj", "o_proj", "out_proj")),
    # NemotronH: Mamba2's in projection, attention, MLP and a MoE layer's shared expert
    (checkpoints.make_nemotron_h, {}, ("in_proj", "q_proj", "v_proj", "up_proj", "down_proj")),
    # Lara-4-Mini: the adapter names transformers' modules as they are in memory (in_proj_qkv, _z, _b, _a), its
    # checkpoint holds them fused (in_proj): another layout of the same weight
    (checkpoints.make_lara_mini, dict(num_hidden_layers=2, layer_types=["linear_attention", "sliding_attention"]),
     "all-linear"),
], ids=["qwen3_next", "nemotron_h", "lara_mini"])
def test_regrouped_and_fused_projections_equal_the_merged_model(tmp_path_factory, make, kw, targets):
    d = tmp_path_factory.mktemp("tiny")
    base = make(d, **kw)
    # (std 0.05: at 0.2, every projection of Lara's adapted, fp32's rounding of the merged weights against the
    # separate update reaches 1e-4 in a logprob; 4e-6 here)
    adapter = checkpoints.make_lora_adapter(d, base, target_modules=targets, r=4, seed=2, std=0.05)
    merged = checkpoints.make_lora_adapter(d, base, target_modules=targets, r=4, seed=2, std=0.05, merged=True)
    rng = random.Random(0)
    specs = [{"ids": [rng.randrange(3, 2048) for _ in range(rng.randrange(5, 60))], "max_new": 8} for _ in range(4)]
    with Engine(str(base), enable_lora=True) as engine:
        engine.load_lora_adapter("x", adapter)
        got = run(engine, specs + specs, ["x"] * 4 + [None] * 4)
    assert compare_outputs(got[:4], reference(merged, specs)) > 20
    assert compare_outputs(got[4:], reference(base, specs)) > 20
    assert any(a["output_ids"] != b["output_ids"] for a, b in zip(got[:4], got[4:]))  # the adapter matters


def test_unload_lets_running_requests_finish_and_refuses_new_ones(qwen3_5_short_path, adapters):
    with Engine(str(qwen3_5_short_path), enable_lora=True) as engine:
        engine.load_lora_adapter("a", adapters["a"][0])
        # long enough (~0.5 s) to be running through the unload below, which follows its first chunk at once
        whole = engine.generate(input_ids=list(range(5, 40)), sampling_params=greedy(400), lora_name="a")
        stream = engine.generate(input_ids=list(range(5, 40)), sampling_params=greedy(400), lora_name="a", stream=True)
        chunks = [next(stream)]
        assert engine.get_stats()["num_lora_requests"] == 1 and engine.get_stats()["num_lora_adapters"] == 1
        assert engine.get_stats()["lora_requests_info"] == {"running": ["a"], "waiting": [], "max_lora": 4}
        made, _ = engine._make_requests(None, [1, 2, 3], greedy(2), False, None, None, None, lora_name="a")
        engine.unload_lora_adapter("a")
        assert engine.lora_adapters() == {} and engine.get_stats()["num_lora_adapters"] == 0
        with pytest.raises(RequestError, match="no LoRA adapter named 'a'"):
            engine.generate(input_ids=[1, 2, 3], sampling_params=greedy(2), lora_name="a")
        with pytest.raises(RequestError, match="unloaded"):  # made before the unload, submitted after
            engine._submit(made)
        holders = [m for m in engine.model.modules() if isinstance(m, Linear) and m.lora is not None]
        assert holders and any(1 in m.lora.dense for m in holders)  # the running request still applies them
        chunks += list(stream)
        assert [t for c in chunks for t in c["output_ids"]] == whole["output_ids"]
        engine.wait_idle()
        assert not any(1 in m.lora.dense or m.lora.at.any() for m in holders)  # its weights went with its last request
        assert_drained(engine)


def test_bad_adapters_and_names_are_refused_and_the_engine_serves_on(tmp_path, qwen3_5_short_path, adapters):
    import json
    import shutil

    def variant(name: str, **changes) -> str:
        path = tmp_path / name
        shutil.copytree(adapters["a"][0], path)
        config = json.loads((path / "adapter_config.json").read_text())
        (path / "adapter_config.json").write_text(json.dumps({**config, **changes}))
        return str(path)

    from safetensors.torch import load_file, save_file

    head = checkpoints.make_lora_adapter(tmp_path, qwen3_5_short_path, target_modules=("lm_head",), r=2)
    bare_head = tmp_path / "bare-head"  # without the tied embedding PEFT saves beside it
    shutil.copytree(head, bare_head)
    tensors = load_file(head / "adapter_model.safetensors")
    save_file({k: v for k, v in tensors.items() if ".lora_" in k}, bare_head / "adapter_model.safetensors")
    zero_rank = tmp_path / "zero-rank"  # (every lora_A [0, in], every lora_B [out, 0])
    shutil.copytree(adapters["a"][0], zero_rank)
    save_file({k: v[:0] if ".lora_A." in k else v[:, :0] for k, v in
               load_file(adapters["a"][0] / "adapter_model.safetensors").items()},
              zero_rank / "adapter_model.safetensors")
    huge_b = tmp_path / "huge-b"  # finite in the file, infinite once scaled by lora_alpha / r
    shutil.copytree(adapters["a"][0], huge_b)
    save_file({k: v if ".lora_A." in k else torch.full_like(v, 3e38) for k, v in
               load_file(adapters["a"][0] / "adapter_model.safetensors").items()}, huge_b / "adapter_model.safetensors")
    with Engine(str(qwen3_5_short_path), enable_lora=True, max_loras=2, max_lora_rank=4) as engine:
        for path, message in [
                # an inf in a slot made every row of a mixed step NaN (0 x inf), the base model's too
                (variant("overflow", lora_alpha=1e300), "not finite in torch.float32 once scaled"),
                (huge_b, "not finite in torch.float32 once scaled"),
                (zero_rank, "rank 0; ranks go from 1"),
                (variant("pattern", alpha_pattern={"[": 16}), "not a regular expression"),
                (variant("rslora", use_rslora="false"), "use_rslora must be true or false"),
                (None, "must be a directory's path"),
                (tmp_path / "nowhere", "no such directory"),
                (tmp_path, "no adapter_config.json"),
                (variant("dora", use_dora=True), "use_dora"),
                (variant("prompt", peft_type="PROMPT_TUNING"), "peft_type"),
                (variant("bias", bias="all"), "trained biases"),
                (head, "a whole weight"),
                (bare_head, "the LM head projects the rows kept for logits"),
                (adapters["b"][0], "rank 8; ranks go from 1 to max_lora_rank, 4")]:
            with pytest.raises(ValueError, match=message):
                engine.load_lora_adapter("x", path)
        engine.load_lora_adapter("a", adapters["a"][0])
        with pytest.raises(ValueError, match="already loaded"):
            engine.load_lora_adapter("a", adapters["a"][0])
        engine.load_lora_adapter("a2", adapters["a"][0])
        with pytest.raises(ValueError, match="2 LoRA adapters are loaded, max_cpu_loras is 2"):
            engine.load_lora_adapter("a3", adapters["a"][0])
        with pytest.raises(ValueError, match="rank 8"):  # in place of a2: refused, and a2 stays
            engine.load_lora_adapter("a2", adapters["b"][0], replace=True)
        with pytest.raises(ValueError, match="replace must be a bool"):
            engine.load_lora_adapter("a2", adapters["a"][0], replace="yes")
        assert set(engine.lora_adapters()) == {"a", "a2"}
        for name in ("", 7, "a\n"):
            with pytest.raises(ValueError, match="name"):
                engine.load_lora_adapter(name, adapters["a"][0])
        with pytest.raises(RequestError, match="no LoRA adapter named 'zz'"):
            engine.generate(input_ids=[1, 2], sampling_params=greedy(2), lora_name="zz")
        with pytest.raises(RequestError, match="1 lora_name values for 2 requests"):
            engine.generate(input_ids=[[1, 2], [3, 4]], sampling_params=greedy(2), lora_name=["a"])
        with pytest.raises(ValueError, match="no LoRA adapter named 'zz'"):
            engine.unload_lora_adapter("zz")
        with pytest.raises(RequestError, match="no LoRA adapter named 'zz'"):
            engine.check_requests([{"input_ids": [1, 2], "lora_name": "zz"}])
        assert len(engine.generate(input_ids=[[1, 2], [3, 4]], sampling_params=greedy(3),
                                   lora_name=["a", None])) == 2
        assert_drained(engine)
    with Engine(str(qwen3_5_short_path)) as plain:
        with pytest.raises(ValueError, match="enable_lora"):
            plain.load_lora_adapter("a", adapters["a"][0])
        with pytest.raises(RequestError, match="enable_lora"):
            plain.generate(input_ids=[1, 2], sampling_params=greedy(2), lora_name="a")
        assert plain.lora_adapters() == {} and plain.get_stats()["num_lora_adapters"] is None
        assert plain.get_stats()["lora_requests_info"] is None


@pytest.mark.parametrize("options, message", [
    (dict(max_loras=2), "max_loras set without enable_lora"),
    (dict(max_cpu_loras=2), "max_cpu_loras set without enable_lora"),
    (dict(enable_lora=True, max_loras=3, max_cpu_loras=2), r"max_cpu_loras \(2\) must be at least max_loras \(3\)"),
    (dict(enable_lora=True, compile_decode=True), "not supported with compile_decode"),
    (dict(enable_lora=True, max_lora_rank=0), "max_lora_rank must be a positive integer"),
    (dict(enable_lora="yes"), "enable_lora must be a bool"),
])
def test_lora_options_are_checked(options, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs(**options)


def test_linear_adds_each_slots_update_to_its_rows_only():
    """``LoRABatch.of`` lays packed rows out by adapter slot; a projection adds each slot's ``B A x`` to its rows
    (all rows: one slot, no mask), none to the base model's, and a slot it holds nothing in changes nothing; a
    graph's static batch (any slots, read on the device) gives the same. An adapter's values never reach another
    row, not even an overflow's inf (as NaN through the masked GEMM's zeros)."""
    torch.manual_seed(0)
    linear = Linear(6, 5, bias=True)
    scope = LoRAScope(slots=3)
    linear.lora = LinearLoRA(scope, 6, 5, width=4, device=torch.device("cpu"), dtype=torch.float32)
    weights = {1: (torch.randn(2, 6), torch.randn(5, 2)), 3: (torch.randn(4, 6), torch.randn(5, 4))}
    for slot, (a, b) in weights.items():
        linear.lora.write(slot, a, b)
    x = torch.randn(9, 6)
    base = torch.nn.functional.linear(x, linear.weight, linear.bias)
    slots, counts = [0, 1, 0, 1, 3, 2, 3], [2, 1, 3, 2, 1, 0, 0]  # (slot 2 holds nothing; the last feed no row)
    rows = [s for s, n in zip(slots, counts) for _ in range(n)]
    want = base.clone()
    for row, slot in enumerate(rows):
        if slot in weights:
            a, b = weights[slot]
            want[row] += b @ (a @ x[row])
    batch = LoRABatch.of(slots + [0], counts + [0], torch.device("cpu"))
    assert batch.single is None and batch.slots == {1, 3} and batch.row_slot.tolist() == rows
    for bound in (batch, LoRABatch.static(torch.tensor(rows))):
        with scope.bind(bound):
            torch.testing.assert_close(linear(x), want)
    assert LoRABatch.of([0, 0], [3, 1], torch.device("cpu")) is None
    every = LoRABatch.of([3, 3, 1], [4, 5, 0], torch.device("cpu"))
    assert every.single == 3 and every.row_slot is None  # one adapter for every row: its columns alone
    a, b = weights[3]
    with scope.bind(every):
        torch.testing.assert_close(linear(x), base + x @ a.T @ b.T)
    with scope.bind(LoRABatch.of([2, 0], [4, 5], torch.device("cpu"))):  # a slot empty here
        torch.testing.assert_close(linear(x), base)
    torch.testing.assert_close(linear(x), base)  # (unbound)
    # a slot whose A x overflows (to inf): the other rows' zeros of its columns stay zeros (inf * 0 would be NaN)
    linear.lora.write(2, torch.full((4, 6), 3e38), torch.ones(5, 4))
    with scope.bind(batch):
        torch.testing.assert_close(linear(x), want)
    linear.lora.clear(3)
    with scope.bind(every):
        torch.testing.assert_close(linear(x), base)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_shrink_and_expand_kernels_equal_the_masked_gemms(dtype):
    """``ops/gpu/lora.py`` (Triton: interpreted without a GPU) against the PyTorch form of a graph's step: rows of
    several slots, an empty slot, the base model (slot 0: its output untouched), ranks short of the slot width
    and a width not a power of two; an extend's one slot for every row (an expanded index); a strided input.
    fp32 within fp32 rounding; bf16 within 2 ulps (the kernels keep ``A x`` in fp32, the GEMMs round it)."""
    pytest.importorskip("triton")
    from hyla.model.ops.gpu import lora as kernels

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    scope = LoRAScope(slots=3)
    linear = LinearLoRA(scope, 130, 200, width=48, device=torch.device(dev), dtype=dtype)
    for slot, r in ((1, 7), (3, 48)):
        linear.write(slot, torch.randn(r, 130), torch.randn(200, r))
    x = torch.randn(6, 260, device=dev).to(dtype)[:, ::2]  # (strided)
    y = torch.randn(6, 200, device=dev).to(dtype)
    tol = dict(rtol=0, atol=1e-4) if dtype == torch.float32 else dict(rtol=2 ** -7, atol=0.5)
    for row_slot in (torch.tensor([0, 1, 3, 2, 1, 0]), torch.tensor([3]).expand(6)):
        row_slot = row_slot.to(dev)
        want = y.clone()
        with scope.bind(LoRABatch.static(row_slot)):
            linear.add_(want, x)
        xa = kernels.shrink(x, linear.at, row_slot, linear.ranks_dev, linear.width)
        got = kernels.expand_(y.clone(), xa, linear.bt, row_slot, linear.ranks_dev, linear.width)
        torch.testing.assert_close(got.float(), want.float(), **tol)
        base = (row_slot == 0) | (row_slot == 2)  # (slot 2 is empty)
        assert torch.equal(got[base], y[base]) and not torch.equal(got[~base], y[~base])


@pytest.mark.gpu
@pytest.mark.parametrize("slots", [{}, dict(max_loras=1, max_cpu_loras=2)], ids=["a-slot-each", "one-slot"])
def test_adapters_on_a_gpu_equal_their_merged_models(qwen3_5_short_path, adapters, slots):
    """The same on CUDA, fp32, through the fused kernels and CUDA graphs (and the overlap schedule): the adapters
    and the base model in one batch against each merged model, each run on the same path (an engine with
    ``enable_lora`` serving no adapter: its graphs run the slots' GEMMs too, all zeros). With one slot for both
    adapters, each is written into it between the graphs' replays, in turn, in two waves."""
    rng = random.Random(1)
    specs = [{"ids": [rng.randrange(3, 2048) for _ in range(rng.randrange(5, 90))], "max_new": 12} for _ in range(6)]
    names = ["a", "b", None]
    with Engine(str(qwen3_5_short_path), device="cuda", enable_lora=True, **slots) as engine:
        for name in ("a", "b"):
            engine.load_lora_adapter(name, adapters[name][0])
        batch = [s for s in specs for _ in names]
        got = [o for half in (slice(0, 9), slice(9, 18))  # (two waves: one slot written over again and again)
               for o in run(engine, batch[half], (names * len(specs))[half])]
        loads = engine.get_stats()["num_lora_slot_loads"]
        assert loads >= 4 if slots else loads == 2
    for i, name in enumerate(names):
        with Engine(str(adapters[name][1] if name else qwen3_5_short_path), device="cuda", enable_lora=True,
                    enable_prefix_cache=False) as ref:
            assert compare_outputs(got[i::3], run(ref, specs)) > 50


def test_a_replaced_adapter_serves_its_running_requests_and_no_base_request_reads_an_adapters_cache(
        qwen3_5_short_path, adapters):
    """``replace=True`` swaps the adapter behind a name between steps: a stream running with the old one
    finishes with it, new requests get the new one; the loaded count holds both until the stream ends.
    A caller's namespace never equals an adapter's, whatever it spells."""
    prompt = list(range(5, 40))
    with Engine(str(qwen3_5_short_path), enable_lora=True, max_loras=2, max_lora_rank=8) as engine:
        engine.load_lora_adapter("x", adapters["a"][0])
        old = engine.generate(input_ids=prompt, sampling_params=greedy(400), lora_name="x")
        stream = engine.generate(input_ids=prompt, sampling_params=greedy(400), lora_name="x", stream=True)
        chunks = [next(stream)]
        engine.load_lora_adapter("x", adapters["b"][0], replace=True)
        with pytest.raises(ValueError, match=r"2 LoRA adapters are loaded, max_cpu_loras is 2 \(1 unloaded"):
            engine.load_lora_adapter("y", adapters["a"][0])
        new = engine.generate(input_ids=prompt, sampling_params=greedy(8), lora_name="x")
        chunks += list(stream)
        assert [t for c in chunks for t in c["output_ids"]] == old["output_ids"]
        assert new["output_ids"] != old["output_ids"][:8]
        engine.wait_idle()
        engine.load_lora_adapter("y", adapters["a"][0])  # (the old one's weights went with its stream)
        digest = engine.loras.resolve("y").adapter.digest
        for spelled in (("lora", digest, None), digest, (digest, None)):  # (the adapter's requests cached it)
            cached = engine.generate(input_ids=prompt, sampling_params=greedy(1), namespace=spelled)
            assert cached["meta_info"]["cached_tokens"] == 0
        assert engine.generate(input_ids=prompt, sampling_params=greedy(1), lora_name="y")["meta_info"][
            "cached_tokens"] > 0
        assert_drained(engine)


@pytest.mark.slow
@INTERPRETED
def test_fused_kernels_and_cuda_graphs_apply_each_rows_adapter(qwen3_5_short_path, adapters, monkeypatch):
    """The fused decode step (Triton's kernels: interpreted without a GPU), its CUDA graphs (emulated here, the
    decode graphs' LoRA updates through the shrink and expand kernels) and fused extends of one sequence (graphs too) apply each
    row's adapter: adapters a and b and the base model in
    one batch give the greedy tokens and logprobs of the eager PyTorch steps (which equal the merged models:
    the tests above), across two turns, the second's prompts cached. Steps of the base model alone replay graphs
    of their own (no adapter's op in them). The graphs read the slots in place: with two slots for three
    adapters, one is written over after capture (an idle adapter c, the same files as b, written into a slot
    first, then taken over by a or b)."""
    from emulated_cuda_graphs import attach_graphs, emulate_cuda_graphs
    from hyla.engine.model_runner import ModelRunner

    rng = random.Random(3)
    wave1 = [{"ids": [rng.randrange(3, 2048) for _ in range(rng.randrange(5, 40))], "max_new": 2 + i} for i in range(3)]
    names = [None, "b", "a"]  # (a alone last: its steps of one row, whose projections are GEMV kernels)
    opts = dict(max_total_tokens=2048, max_state_slots=32, max_running_requests=8, warmup="off", max_loras=2)

    def two_turns(engine: Engine) -> list[dict]:
        out1 = run(engine, wave1, names)
        # (the base model's request alone last: steps of no adapter, which replay the base model's graphs)
        wave2 = [{"ids": w["ids"] + o["output_ids"] + [5, 6, 7], "max_new": 4 if i == 0 else 2} for i, (w, o) in
                 enumerate(zip(wave1, out1))]
        return out1 + run(engine, wave2, names)

    with Engine(str(qwen3_5_short_path), enable_lora=True, **opts) as eager:
        for name in ("a", "b"):
            eager.load_lora_adapter(name, adapters[name][0])
        want = two_turns(eager)
    replays = dict.fromkeys(("graphs", "extend_graphs", "lora_graphs", "lora_extend_graphs"), 0)
    with monkeypatch.context() as m:
        emulate_cuda_graphs(m)
        # the decode graphs' steps through the shrink and expand kernels, as a GPU's (interpreted, an extend's 16+
        # rows would cost minutes: those run the masked GEMMs, the kernels' oracle)
        m.setattr(lora, "sgmv_kernels", lambda x: x.shape[0] <= 4)
        with Engine(str(qwen3_5_short_path), enable_lora=True, max_cpu_loras=3, **opts) as engine:
            for name in ("c", "a", "b"):
                engine.load_lora_adapter(name, adapters["b" if name == "c" else name][0])
            runner = engine.scheduler.runner = ModelRunner(
                engine.model, engine.kv_pool, engine.state_pool, engine.req_to_token, engine.device, cuda_graph=False,
                fused_decode=True, fused_extend_max_tokens=16)
            attach_graphs(runner, decode_max_bs=4, extends=True)
            for key in replays:
                graphs = getattr(runner, key)
                m.setattr(graphs, "replay", lambda *a, _real=graphs.replay, _key=key, **kw:
                          replays.__setitem__(_key, replays[_key] + 1) or _real(*a, **kw))
            engine.generate(input_ids=[1, 2, 3], sampling_params=greedy(1), lora_name="c")  # (c in slot 1)
            got = two_turns(engine)
            assert engine.get_stats()["num_lora_slot_loads"] >= 3
            engine.wait_idle()
            engine.check_integrity()
    assert all(replays.values()), replays
    assert compare_outputs(got, want) == sum(len(o["output_ids"]) for o in want)
    assert len({tuple(o["output_ids"]) for o in want[:3]}) == 3  # (the adapters matter)


def _record_slot_takers(monkeypatch) -> list[str]:
    """The ids of the requests given a LoRA slot as they are admitted (``Scheduler._take_lora_slot``), in order."""
    from hyla.engine.scheduler import Scheduler

    admitted: list[str] = []
    real_take = Scheduler._take_lora_slot

    def take(self, req):
        real_take(self, req)
        admitted.append(req.rid)
    monkeypatch.setattr(Scheduler, "_take_lora_slot", take)
    return admitted


def _alone(path, adapters_by_name: dict, specs_by_name: dict) -> dict[str, list[dict]]:
    """Each adapter's specs served by an engine serving that adapter alone: ``{name: outputs}``."""
    out = {}
    for name, specs in specs_by_name.items():
        with Engine(str(path), enable_lora=True, max_loras=1, max_lora_rank=8) as alone:
            alone.load_lora_adapter(name, adapters_by_name[name])
            out[name] = run(alone, specs, [name] * len(specs))
    return out


def test_requests_wait_for_a_slot_in_turn_and_a_failed_write_ends_only_its_request(qwen3_5_short_path, adapters,
                                                                                     monkeypatch):
    """One slot (``max_loras=1``) for two adapters. Queued together, x's requests run together and y's wait for
    the slot (the base model's run beside them); an x request queued after y began waiting waits for y, whatever
    the policy's order (else a stream of x's requests would keep the slot forever). Each request gives what an
    engine serving its adapter alone gives. A write into the slot that fails half-way ends only the request
    being admitted (aborted, cause ``internal``): the slot is emptied, and the next request gets the adapter
    written whole."""
    import threading
    import time

    from hyla.engine import lora_manager
    prompt = list(range(5, 40))
    admitted = _record_slot_takers(monkeypatch)
    first = {"names": ["x", "y", None, "x"], "lens": [120, 8, 8, 8]}
    outs: dict[str, list[dict]] = {}
    with Engine(str(qwen3_5_short_path), enable_lora=True, max_loras=1, max_cpu_loras=2, max_lora_rank=8) as engine:
        engine.load_lora_adapter("x", adapters["b"][0])
        engine.load_lora_adapter("y", adapters["a"][0])

        def submit(key: str, names: list, lens: list, rids: list) -> None:
            outs[key] = engine.generate(input_ids=[prompt] * len(names), sampling_params=[greedy(n) for n in lens],
                                        return_logprob=True, lora_name=names, rid=rids)
        together = threading.Thread(target=submit, args=("first", first["names"], first["lens"],
                                                         [f"r{i}" for i in range(4)]))
        together.start()
        deadline = time.monotonic() + 30
        while engine.scheduler.slot_waiter is None:  # (y waits for the slot x's requests hold)
            assert time.monotonic() < deadline
            time.sleep(0.005)
        assert engine.scheduler.slot_waiter[0].rid == "r1"
        submit("later", ["x", "x"], [8, 8], ["r4", "r5"])
        together.join()
        assert admitted == ["r0", "r3", "r1", "r4", "r5"]
        assert engine.get_stats()["num_lora_slot_loads"] == 3
        with monkeypatch.context() as m:  # (the write fails half-way: the first projection written, then an error)
            def fail(model, slot, adapter, real=lora_manager.install_):
                first_one = next(iter(adapter.weights))
                real(model, slot, lora.LoRAAdapter(adapter.path, adapter.rank, adapter.digest,
                                                   {first_one: adapter.weights[first_one]}))
                raise RuntimeError("out of device memory")
            m.setattr(lora_manager, "install_", fail)
            failed = engine.generate(input_ids=prompt, sampling_params=greedy(8), lora_name="y")
        assert failed["meta_info"]["finish_reason"]["cause"] == "internal"
        assert "out of device memory" in failed["meta_info"]["finish_reason"]["message"]
        holders = [m.lora for m in engine.model.modules() if isinstance(m, Linear) and m.lora is not None]
        assert not any(h.at.any() or h.dense for h in holders)  # (emptied)
        again = engine.generate(input_ids=prompt, sampling_params=greedy(8), lora_name="y", return_logprob=True)
        assert_drained(engine)
    got = {"x": [outs["first"][0], outs["first"][3], *outs["later"]], "y": [outs["first"][1], again]}
    want = _alone(qwen3_5_short_path, {"x": adapters["b"][0], "y": adapters["a"][0]},
                  {"x": [{"ids": prompt, "max_new": n} for n in (120, 8, 8, 8)],
                   "y": [{"ids": prompt, "max_new": 8}] * 2})
    for name in ("x", "y"):
        assert compare_outputs(got[name], want[name]) == sum(len(o["output_ids"]) for o in got[name])


def _joined(chunks: list[dict]) -> dict:
    """A streamed request's chunks as one output (its tokens and their logprobs)."""
    out = {**chunks[-1], "output_ids": [t for c in chunks for t in c["output_ids"]]}
    out["meta_info"] = {**out["meta_info"], "output_token_logprobs": [
        e for c in chunks for e in c["meta_info"].get("output_token_logprobs", [])]}
    return out


def test_an_urgent_request_preempts_the_less_urgent_requests_holding_the_slot(qwen3_5_short_path, adapters,
                                                                              monkeypatch):
    """Priority scheduling, one slot: a request of adapter y, more urgent than the running request of adapter x
    by more than the threshold, retracts it to take the slot; a second urgent y request, queued after x's began
    waiting for the slot again, runs beside the first (x's wait holds back no request more urgent than it); x's
    resumes after them. Each gives what an engine serving its adapter alone gives."""
    prompt = list(range(5, 40))
    admitted = _record_slot_takers(monkeypatch)
    with Engine(str(qwen3_5_short_path), enable_lora=True, max_loras=1, max_cpu_loras=2, max_lora_rank=8,
                enable_priority_scheduling=True) as engine:
        engine.load_lora_adapter("x", adapters["b"][0])
        engine.load_lora_adapter("y", adapters["a"][0])

        def stream(rid: str, name: str, n: int, priority: int):
            return engine.generate(input_ids=prompt, sampling_params=greedy(n), lora_name=name, stream=True,
                                   priority=priority, return_logprob=True, rid=rid)
        x = stream("x", "x", 300, 0)
        x_chunks = [next(x)]
        y1 = stream("y1", "y", 60, 100)
        y1_chunks = [next(y1)]  # (x retracted for it)
        y2 = engine.generate(input_ids=prompt, sampling_params=greedy(8), lora_name="y", priority=100,
                             return_logprob=True, rid="y2")
        y1_chunks += list(y1)
        x_chunks += list(x)
        assert admitted == ["x", "y1", "y2", "x"] and engine.scheduler.num_preemptions == 1
        assert_drained(engine)
    want = _alone(qwen3_5_short_path, {"x": adapters["b"][0], "y": adapters["a"][0]},
                  {"x": [{"ids": prompt, "max_new": 300}],
                   "y": [{"ids": prompt, "max_new": 60}, {"ids": prompt, "max_new": 8}]})
    assert compare_outputs([_joined(y1_chunks), y2], want["y"]) == 68
    assert compare_outputs([_joined(x_chunks)], want["x"]) == 300


@pytest.mark.slow
@INTERPRETED
def test_speculative_verify_steps_apply_each_rows_adapter(qwen3_5_short_path, adapters, monkeypatch):
    """Speculative decoding with adapters: drafts of the merged-model-exact outputs (``OracleDrafter``, some
    corrupted: accepted whole, in part and not at all) verified with each request's adapter give the greedy
    tokens and logprobs of plain decoding, two adapters and the base model in one batch; on the eager steps
    (verify as one extend), then on the fused kernels (interpreted without a GPU), verify steps as padded chains
    replaying (emulated) CUDA graphs of chains, their LoRA updates through the shrink and expand kernels."""
    from emulated_cuda_graphs import attach_graphs, emulate_cuda_graphs
    from hyla.engine.model_runner import ModelRunner
    from test_engine_speculative import OracleDrafter, _count_verdicts

    rng = random.Random(4)
    specs = [{"ids": [rng.randrange(3, 2048) for _ in range(rng.randrange(5, 30))], "max_new": 6 + 4 * i}
             for i in range(3)]  # (the last steps of 2 requests or 1: those replay the graphs)
    names = ["a", None, "b"]
    opts = dict(max_total_tokens=2048, max_state_slots=48, max_running_requests=8, warmup="off")
    with Engine(str(qwen3_5_short_path), enable_lora=True, enable_prefix_cache=False, **opts) as off:
        for name in ("a", "b"):
            off.load_lora_adapter(name, adapters[name][0])
        want = run(off, specs, names)
    reference = {tuple(s["ids"]): o["output_ids"] for s, o in zip(specs, want)}
    for fused in (False, True):
        replays = {"n": 0}
        with monkeypatch.context() as m, Engine(str(qwen3_5_short_path), enable_lora=True, speculative_algorithm="ngram",
                                                speculative_num_draft_tokens=5, **opts) as eng:
            for name in ("a", "b"):
                eng.load_lora_adapter(name, adapters[name][0])
            if fused:  # verify steps as chains of 5 rows, those of up to 2 requests replaying (emulated) graphs
                runner = eng.scheduler.runner = ModelRunner(eng.model, eng.kv_pool, eng.state_pool, eng.req_to_token,
                                                            eng.device, cuda_graph=False, fused_decode=True, verify_width=5)
                emulate_cuda_graphs(m)
                attach_graphs(runner, verify_max_bs=2)
                m.setattr(lora, "sgmv_kernels", lambda x: True)
                graphs = runner.lora_verify_graphs
                m.setattr(graphs, "replay", lambda *a, _real=graphs.replay, **kw:
                          replays.__setitem__("n", replays["n"] + 1) or _real(*a, **kw))
            eng.scheduler.drafter = OracleDrafter(reference, num_draft=4)
            verdicts = _count_verdicts(eng)
            got = run(eng, specs, names)
            eng.wait_idle()
            eng.check_integrity()
            assert eng.scheduler.num_accepted_tokens > 0 and min(verdicts.values()) > 0, verdicts
        assert replays["n"] > 0 or not fused
        assert compare_outputs(got, want) == sum(len(o["output_ids"]) for o in want), f"fused={fused}"
