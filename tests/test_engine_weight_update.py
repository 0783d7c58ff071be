"""``Engine.update_weights_from_disk``: another checkpoint of the same model served in place.

* Differential: after an update the engine gives what a fresh engine on the new checkpoint gives
  (greedy tokens, logprobs within 1e-4 up to each request's first tie, the same cache hits: the
  prefixes cached from the old weights are gone), with the prefix cache on under eviction and
  retraction pressure; the MTP head is updated too (its drafts are the fresh engine's).
* No request's output mixes two weights: a request running when the update is asked for finishes on
  the old weights, one submitted meanwhile runs on the new ones (``meta_info["weight_version"]``
  says which); ``abort_all_requests`` ends the running ones instead.
* A checkpoint of another model, a broken one, bad arguments, or running requests outlasting the
  timeout: an error, and the engine serves on, unchanged. What the files' headers tell is checked
  before any tensor data is read.
* The weights are read one parameter at a time: no more of the checkpoint in host memory at once.
* A checkpoint broken after its check (a shard truncated before the weights are written): a failed
  update, the old weights read back and served exactly; the served checkpoint broken too: an error
  that says the weights are inconsistent, the prefix cache emptied and the derived weights refreshed
  all the same. A later update works.
* A prefix exported before an update is not imported after it (``CachedPrefix.weight_version``).
* A second update waits for the first at most its own ``timeout``.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import threading
import time
import weakref
from pathlib import Path

import pytest
import torch

import checkpoints
from hyla import Engine
from hyla.engine.weight_update import NewWeights
from hyla.model.loader import TensorReader
from test_engine_differential import assert_drained, compare_outputs, make_workload, run

OPTS = dict(max_total_tokens=360, max_state_slots=16, max_running_requests=10, chunked_prefill_size=64,
            debug_checks=True)


@pytest.fixture(scope="module")
def other_seed_path(tiny_ckpt_dir):
    """The tiny Qwen3-Next of another seed: the same model, other weights (most tokens differ)."""
    return checkpoints.make_qwen3_next(tiny_ckpt_dir, moe=False, seed=1)


@pytest.fixture(scope="module")
def stepped_mtp_path(tiny_ckpt_dir):
    """The tiny Qwen3-Next with an MTP head, every matrix nudged (the head's too): a training step."""
    return checkpoints.make_perturbed(tiny_ckpt_dir, base=checkpoints.make_qwen3_next, moe=False, mtp=True)


def _greedy(n: int) -> dict:
    return {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}


def _stepped(path, tmp_path, edit) -> str:
    """A copy of the checkpoint ``path`` whose tensors ``edit(dict)`` changed in place."""
    from safetensors.torch import load_file, save_file

    out = tmp_path / "edited"
    shutil.copytree(path, out)
    tensors = load_file(out / "model.safetensors")
    edit(tensors)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return str(out)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_update_serves_the_new_checkpoint_exactly(qwen3_next_dense_path, qwen3_next_dense_draft_path, kv_cache_dtype):
    """The old weights' prefixes cached (and evicted, retracted), then an update: the same workload gives
    what a fresh engine on the new checkpoint gives, with that engine's hits. ``fp8``: over a float8 KV
    cache (``test_engine_differential.FP8_KV_TOL``)."""
    from test_engine_differential import FP8_KV_TOL, TOL

    new = qwen3_next_dense_draft_path  # the same model, every matrix nudged
    opts = {**OPTS, "kv_cache_dtype": kv_cache_dtype}
    wave1, followups = make_workload(5, 2048, num_sessions=16, num_shared=24, scale=0.5)

    def second_turns(outs: list[dict]) -> list[dict]:
        return [{"ids": w["ids"] + o["output_ids"] + f, "max_new": 4, "ckpt": []}
                for w, o, f in zip(wave1, outs, followups)]

    with Engine(new, **opts) as fresh:
        want = run(fresh, wave1)
        wave2 = second_turns(want)
        want += run(fresh, wave2)
    with Engine(qwen3_next_dense_path, weight_version="step-0", **opts) as engine:
        before = run(engine, wave1)
        before += run(engine, second_turns(before))
        assert engine.tree.total_size() > 0
        done = engine.update_weights_from_disk(new, weight_version="step-1")
        assert done["weight_version"] == engine.weight_version == "step-1" and done["num_aborted_requests"] == 0
        assert engine.tree.total_size() == 0 and str(engine.model_path) == str(new)
        got = run(engine, wave1) + run(engine, wave2)
        assert_drained(engine)
        stats = engine.get_stats()
    assert stats["num_retractions"] > 0 and stats["num_evicted_tokens"] > 0 and stats["num_evicted_states"] > 0
    assert {o["meta_info"]["weight_version"] for o in before} == {"step-0"}
    assert {o["meta_info"]["weight_version"] for o in got} == {"step-1"}
    assert [o["output_ids"] for o in before] != [o["output_ids"] for o in want]  # the weights did change
    assert compare_outputs(got, want, TOL if kv_cache_dtype == "auto" else FP8_KV_TOL) > 0.9 * sum(s["max_new"] for s in wave1 + wave2)
    assert [o["meta_info"]["cached_tokens"] for o in got] == [o["meta_info"]["cached_tokens"] for o in want]


@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_update_reaches_the_mtp_head(qwen3_next_dense_mtp_path, stepped_mtp_path, quantization):
    """An engine drafting with the checkpoint's MTP head drafts with the new head after an update:
    the same tokens and the same verify steps per request as a fresh engine on the new checkpoint.
    ``fp8``: the model and its head quantized at load (``quantization="fp8"``), and the update quantizes
    the new weights as a fresh engine's load does."""
    opts = dict(max_total_tokens=600, max_state_slots=40, max_running_requests=6, chunked_prefill_size=64,
                speculative_algorithm="mtp", speculative_num_steps=3, quantization=quantization)
    wave1, _ = make_workload(7, 2048, num_sessions=6, num_shared=6, scale=0.5)
    with Engine(stepped_mtp_path, **opts) as fresh:
        want = run(fresh, wave1)
    with Engine(qwen3_next_dense_mtp_path, **opts) as engine:
        run(engine, wave1)
        engine.update_weights_from_disk(stepped_mtp_path)
        got = run(engine, wave1)
        assert_drained(engine)
        assert (engine.mtp_head.fc.weight.dtype == torch.float8_e4m3fn) == (quantization == "fp8")
    assert compare_outputs(got, want) > 0.9 * sum(s["max_new"] for s in wave1)
    assert [o["meta_info"].get("spec_verify_ct") for o in got] == [o["meta_info"].get("spec_verify_ct") for o in want]


def _reference(path, prompts: list[list[int]], n: int) -> list[list[int]]:
    with Engine(path, **OPTS) as engine:
        return [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=_greedy(n))]


def _slow_steps(engine: Engine, seconds: float = 0.005) -> None:
    """Every step of ``engine`` takes ``seconds`` longer: a request of ``n`` tokens runs at least ``n``
    times that, however fast the machine (so that it still runs when the test acts)."""
    step = engine.scheduler.step
    engine.scheduler.step = lambda: (time.sleep(seconds), step())[1]


def _wait(cond, what: str) -> None:
    deadline = time.monotonic() + 30
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.002)


def test_running_requests_finish_on_the_old_weights(qwen3_next_dense_path, other_seed_path):
    """A request running when the update is asked for ends on the old weights; one submitted while the
    update waits for it queues and runs on the new ones; nothing mixes."""
    first, second = list(range(3, 40)), list(range(50, 70))
    old = _reference(qwen3_next_dense_path, [first], 120)[0]
    new = _reference(other_seed_path, [second], 30)[0]
    with Engine(qwen3_next_dense_path, **OPTS) as engine:
        _slow_steps(engine)  # the first request runs >= 0.6 s
        stream = engine.generate(input_ids=first, sampling_params=_greedy(120), stream=True)
        chunks = [next(stream)]
        done: dict = {}
        updater = threading.Thread(target=lambda: done.update(
            engine.update_weights_from_disk(other_seed_path, weight_version="v2")))
        updater.start()
        _wait(lambda: not engine.scheduler.admit_new, "the update did not close admission")
        queued = engine.generate(input_ids=second, sampling_params=_greedy(30), stream=True)
        chunks += list(stream)
        updater.join(60)
        later = list(queued)
        assert done["weight_version"] == "v2"
        assert_drained(engine)
    assert [t for c in chunks for t in c["output_ids"]] == old
    assert chunks[-1]["meta_info"]["weight_version"] == "default"
    assert [t for c in later for t in c["output_ids"]] == new
    assert later[-1]["meta_info"]["weight_version"] == "v2"


def test_abort_all_requests_ends_the_running_ones(qwen3_next_dense_path, other_seed_path):
    with Engine(qwen3_next_dense_path, **OPTS) as engine:
        _slow_steps(engine)  # the request would run >= 1.5 s
        stream = engine.generate(input_ids=list(range(3, 40)), sampling_params=_greedy(300), stream=True)
        next(stream)
        done = engine.update_weights_from_disk(other_seed_path, abort_all_requests=True)
        last = list(stream)[-1]
        assert done["num_aborted_requests"] == 1
        assert last["meta_info"]["finish_reason"]["type"] == "abort"
        out = engine.generate(input_ids=list(range(50, 70)), sampling_params=_greedy(30))
        assert_drained(engine)
    assert out["output_ids"] == _reference(other_seed_path, [list(range(50, 70))], 30)[0]


def test_a_prefix_of_the_old_weights_is_not_imported_after_an_update(qwen3_next_dense_path, other_seed_path):
    """A prefix exported before an update (the old weights' KV and state) is refused after it, as an
    object or as bytes, and changes nothing; one exported after it is taken and hit exactly."""
    prompt = list(range(3, 60))
    with Engine(qwen3_next_dense_path, **OPTS) as engine:
        engine.generate(input_ids=prompt, sampling_params=_greedy(1))
        old = engine.export_prefix(prompt)
        engine.update_weights_from_disk(other_seed_path, weight_version="v2")
        for given in (old, old.to_bytes()):
            with pytest.raises(ValueError, match="computed by the weights 'default', this engine serves 'v2'"):
                engine.import_prefix(given)
        assert engine.cached_tokens(prompt) == 0
        cold = engine.generate(input_ids=prompt, sampling_params=_greedy(8))
        new = engine.export_prefix(prompt)
        assert new.weight_version == "v2" and engine.flush_cache()
        assert engine.import_prefix(new.to_bytes()) == len(new) == len(prompt) - 1
        hit = engine.generate(input_ids=prompt, sampling_params=_greedy(8))
        assert_drained(engine)
    assert cold["output_ids"] == hit["output_ids"] == _reference(other_seed_path, [prompt], 8)[0]
    assert hit["meta_info"]["cached_tokens"] == len(new)



def test_an_unnamed_update_still_refuses_a_prefix_of_the_old_weights(qwen3_next_dense_path, other_seed_path,
                                                                     tmp_path):
    """An update without a ``weight_version`` (SGLang's default) keeps the name: the prefix exported before it
    carried the same name and was imported, and requests hitting it ran on the old weights' KV and state (output
    of neither model). The prefix carries a digest of the weights' values too (``weights_digest``): refused, as
    bytes or as the object; a prefix exported after the update is taken, and so is one from another engine
    serving the same weights (the digest is of the values, not of a process); an update back to the first
    checkpoint takes the first export again."""
    prompt = list(range(3, 60))
    with Engine(qwen3_next_dense_path, **OPTS) as engine:
        engine.generate(input_ids=prompt, sampling_params=_greedy(1))
        old = engine.export_prefix(prompt)
        engine.update_weights_from_disk(other_seed_path)
        assert engine.weight_version == old.weight_version == "default" and old.weights_digest
        for given in (old, old.to_bytes()):
            with pytest.raises(ValueError, match="other weights than those served now"):
                engine.import_prefix(given)
        assert engine.cached_tokens(prompt) == 0
        engine.generate(input_ids=prompt, sampling_params=_greedy(1))
        new = engine.export_prefix(prompt)
        assert new.weights_digest != old.weights_digest
        with Engine(other_seed_path, **OPTS) as other:  # (a fresh engine of the new weights takes it)
            assert other.import_prefix(new.to_bytes()) == len(new)
            hit = other.generate(input_ids=prompt, sampling_params=_greedy(8))
            assert hit["meta_info"]["cached_tokens"] == len(new)
        engine.update_weights_from_disk(qwen3_next_dense_path)  # (back: the first export is of these weights)
        engine.flush_cache()
        assert engine.import_prefix(old) == len(old)
        assert_drained(engine)
    assert hit["output_ids"] == _reference(other_seed_path, [prompt], 8)[0]

def test_an_update_waiting_for_another_keeps_its_timeout(qwen3_next_dense_path, other_seed_path, monkeypatch):
    """A second update asked while one runs waits for it at most its own ``timeout``: a ``TimeoutError``
    that changed nothing; the first lands, and the engine serves it."""
    real_read, reading, go = NewWeights.read, threading.Event(), threading.Event()

    def slow_read(path, model, mtp_head):
        reading.set()
        go.wait(60)
        return real_read(path, model, mtp_head)

    with Engine(qwen3_next_dense_path, **OPTS) as engine:
        monkeypatch.setattr(NewWeights, "read", slow_read)
        done: dict = {}
        first = threading.Thread(target=lambda: done.update(
            engine.update_weights_from_disk(other_seed_path, weight_version="v1")))
        first.start()
        assert reading.wait(30)
        threading.Timer(5.0, go.set).start()  # (the first would hold the second for 5 s)
        start = time.monotonic()
        with pytest.raises(TimeoutError, match="another weight update still running after 0.3 s"):
            engine.update_weights_from_disk(other_seed_path, weight_version="v2", timeout=0.3)
        assert time.monotonic() - start < 4 and engine.weight_version == "default"
        go.set()
        first.join(60)
        assert done["weight_version"] == engine.weight_version == "v1"
        out = engine.generate(input_ids=list(range(50, 70)), sampling_params=_greedy(10))
        assert_drained(engine)
    assert out["output_ids"] == _reference(other_seed_path, [list(range(50, 70))], 10)[0]


def test_bad_updates_change_nothing(qwen3_next_dense_path, other_seed_path, nemotron_h_path, tmp_path):
    prompt = list(range(3, 30))
    missing = _stepped(other_seed_path, tmp_path, lambda t: t.pop("model.norm.weight"))
    truncated = tmp_path / "truncated"  # a file safetensors cannot read (was its SafetensorError, no ValueError)
    shutil.copytree(other_seed_path, truncated)
    os.truncate(truncated / "model.safetensors", (truncated / "model.safetensors").stat().st_size // 2)
    with Engine(qwen3_next_dense_path, **OPTS) as engine:
        before = engine.generate(input_ids=prompt, sampling_params=_greedy(20))
        for path, match in [(nemotron_h_path, "describes another model"), (missing, "lacks tensor"),
                            (tmp_path, "no config.json"), (truncated, "model.safetensors: .*header"),
                            (None, "model_path must be a path"), (123, "model_path must be a path")]:
            with pytest.raises(ValueError, match=match):
                engine.update_weights_from_disk(path)
        for kw, match in [(dict(weight_version=""), "weight_version"), (dict(weight_version="v1\nINFO forged"),
                                                                        "printable"),
                          (dict(weight_version="v" * 257), "at most 256"), (dict(timeout=0), "timeout")]:
            with pytest.raises(ValueError, match=match):
                engine.update_weights_from_disk(other_seed_path, **kw)
        # no limit: the same update (the weights back as they were; a huge wait once overflowed the lock's)
        assert engine.update_weights_from_disk(qwen3_next_dense_path, timeout=math.inf)["num_aborted_requests"] == 0
        # running requests that outlast the timeout: nothing changes, and the queue moves again
        _slow_steps(engine)  # the request runs >= 1.5 s
        stream = engine.generate(input_ids=prompt, sampling_params=_greedy(300), stream=True)
        next(stream)
        with pytest.raises(TimeoutError, match="not updated"):
            engine.update_weights_from_disk(other_seed_path, weight_version="v2", timeout=0.2)
        after = engine.generate(input_ids=prompt, sampling_params=_greedy(20))
        assert list(stream)[-1]["meta_info"]["finish_reason"]["type"] == "length"
        assert engine.weight_version == "default" and after["meta_info"]["weight_version"] == "default"
        assert_drained(engine)
    assert after["output_ids"] == before["output_ids"]


def test_read_checks_the_headers_and_reads_no_tensor_data(qwen3_next_dense_mtp_path, stepped_mtp_path, tmp_path,
                                                         monkeypatch):
    """``NewWeights.read`` refuses a tensor of the wrong shape, the model's or the MTP head's, from the
    headers alone: every read of tensor data raises here, and a good checkpoint still passes."""
    from hyla.model import load_model
    from hyla.model.mtp import MtpHead

    model = load_model(qwen3_next_dense_mtp_path)
    head = MtpHead.from_model(model)
    down, fc = "model.layers.5.mlp.down_proj.weight", "mtp.fc.weight"
    short_down = _stepped(stepped_mtp_path, tmp_path / "down", lambda t: t.update({down: t[down][:-1].clone()}))
    short_fc = _stepped(stepped_mtp_path, tmp_path / "fc", lambda t: t.update({fc: t[fc][:, :-1].clone()}))

    def no_data(self, name):
        raise AssertionError(f"tensor data read: {name}")

    monkeypatch.setattr(TensorReader, "get", no_data)
    assert NewWeights.read(stepped_mtp_path, model, head).path == Path(stepped_mtp_path)
    for path, match in [(short_down, r"down_proj\.weight.*give shape"), (short_fc, r"give shape.*the MTP head's fc")]:
        with pytest.raises(ValueError, match=match):
            NewWeights.read(path, model, head)
    NewWeights.read(short_fc, model, None)  # (an engine without the head does not read it)


def test_update_holds_one_parameter_of_the_checkpoint_at_a_time(qwen3_next_dense_path, other_seed_path, monkeypatch):
    """The host memory an update costs: while the weights are written, the checkpoint's tensors alive at
    once (read, not yet dropped) are at most those one parameter is built from, though all are read."""
    from hyla.model.loader import check_weights

    lock = threading.Lock()
    count = {"live": 0, "most": 0, "read": 0}

    def dropped(nbytes: int) -> None:
        with lock:
            count["live"] -= nbytes

    real_get = TensorReader.get

    def get(self, name):
        tensor = real_get(self, name)
        nbytes = tensor.numel() * tensor.element_size()
        with lock:
            count["live"] += nbytes
            count["most"], count["read"] = max(count["most"], count["live"]), count["read"] + nbytes
        weakref.finalize(tensor, dropped, nbytes)
        return tensor

    def size(t: torch.Tensor) -> int:
        return t.numel() * t.element_size()

    with Engine(qwen3_next_dense_path, **OPTS) as engine:
        checked = check_weights(other_seed_path, engine.model)
        headers = {name: checked.tensors.meta(name) for name in checked.tensors.files}
        one_parameter = max(sum(size(headers[n]) for n in spec.sources) for spec in checked.specs)
        monkeypatch.setattr(TensorReader, "get", get)  # (after the engine loaded its weights)
        engine.update_weights_from_disk(other_seed_path)
        monkeypatch.undo()
    assert count["read"] == sum(size(t) for t in headers.values())  # every tensor read, once
    assert 0 < count["most"] <= one_parameter < count["read"] / 4
    assert count["live"] == 0


SECOND_SHARD = "model-00002-of-00002.safetensors"


def _sharded(path, out: Path) -> Path:
    """A copy of the checkpoint ``path`` in two shards, the second holding its last layer (read last)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(path, out)
    tensors = load_file(out / "model.safetensors")
    (out / "model.safetensors").unlink()
    last = f"model.layers.{max(int(k.split('.')[2]) for k in tensors if k.startswith('model.layers.'))}."
    shards = {SECOND_SHARD.replace("2-of", "1-of"): {k: v for k, v in tensors.items() if not k.startswith(last)},
              SECOND_SHARD: {k: v for k, v in tensors.items() if k.startswith(last)}}
    for file, part in shards.items():
        save_file(part, out / file, metadata={"format": "pt"})
    weight_map = {name: file for file, part in shards.items() for name in part}
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return out


def test_a_checkpoint_broken_after_its_check_leaves_the_old_weights(qwen3_next_dense_path, other_seed_path, tmp_path,
                                                                     monkeypatch, caplog):
    """A shard truncated after ``read`` checked the checkpoint and before ``apply`` reads it (a trainer
    rewriting it, say), once the first shard's parameters are written: the update fails naming the file,
    the weights written are read back from the checkpoint served, and the engine serves exactly what it
    did (tokens, logprobs), consistent; a later update works. With the served checkpoint broken too,
    the read back fails: an error, logged, that says the weights are inconsistent; an update from a good
    checkpoint mends them."""
    old = _sharded(qwen3_next_dense_path, tmp_path / "old")
    new, new_again = _sharded(other_seed_path, tmp_path / "new"), _sharded(other_seed_path, tmp_path / "new-again")
    breaks: dict[Path, list[Path]] = {}  # checkpoint -> the shards truncated once NewWeights.read checked it
    real_read, real_get = NewWeights.read, TensorReader.get
    reads: list[tuple[Path, str]] = []  # (checkpoint, tensor), in order

    def read_then_break(path, model, mtp_head):
        checked = real_read(path, model, mtp_head)
        for shard in breaks.pop(Path(path), []):
            os.truncate(shard, shard.stat().st_size // 2)
        return checked

    def get(self, name):
        tensor = real_get(self, name)
        reads.append((self.files[name].parent, name))
        return tensor

    prompt, params = list(range(3, 30)), dict(sampling_params=_greedy(16), return_logprob=True)
    with Engine(old, weight_version="v0", **OPTS) as engine:
        before = engine.generate(input_ids=prompt, **params)
        monkeypatch.setattr(NewWeights, "read", read_then_break)
        monkeypatch.setattr(TensorReader, "get", get)
        breaks[new] = [new / SECOND_SHARD]
        with pytest.raises(ValueError, match="reading the checkpoint failed during the update") as err:
            engine.update_weights_from_disk(new, weight_version="v1")
        assert SECOND_SHARD in str(err.value) and f"read back from {old}" in str(err.value)
        first_old = next(i for i, (ckpt, _) in enumerate(reads) if ckpt == old)
        assert first_old > 0 and {ckpt for ckpt, _ in reads[:first_old]} == {new}  # some parameters written
        read_back = reads[first_old:]  # every tensor of the served checkpoint, once
        weight_map = json.loads((old / "model.safetensors.index.json").read_text())["weight_map"]
        assert {ckpt for ckpt, _ in read_back} == {old} and len(set(read_back)) == len(read_back) == len(weight_map)
        assert engine.weight_version == "v0" and engine.model_path == old
        after = engine.generate(input_ids=prompt, **params)
        assert_drained(engine)  # (check_integrity)
        assert after["output_ids"] == before["output_ids"]
        assert after["meta_info"]["weight_version"] == "v0"
        got, want = after["meta_info"]["output_token_logprobs"], before["meta_info"]["output_token_logprobs"]
        assert max(abs(g[0] - w[0]) for g, w in zip(got, want)) <= 1e-4

        breaks[new_again] = [new_again / SECOND_SHARD, old / SECOND_SHARD]  # the served checkpoint broken too
        with caplog.at_level(logging.ERROR, logger="hyla.engine"), pytest.raises(RuntimeError, match="inconsistent"):
            engine.update_weights_from_disk(new_again)
        assert any(r.levelno == logging.ERROR and "inconsistent" in r.getMessage() for r in caplog.records)
        monkeypatch.undo()
        assert engine.update_weights_from_disk(other_seed_path, weight_version="v2")["weight_version"] == "v2"
        later = engine.generate(input_ids=prompt, sampling_params=_greedy(16))
        assert_drained(engine)
    assert later["output_ids"] == _reference(other_seed_path, [prompt], 16)[0] != before["output_ids"]


def _stale_derived_weights(model: torch.nn.Module) -> list[str]:
    """The derived weights (``layers.DerivedWeight``) of ``model`` whose cached value is not what their
    parameters give now: what a CUDA graph would replay stale."""
    from hyla.model.layers import DerivedWeight

    stale = []
    for name, module in model.named_modules():
        for attr, d in vars(module).items():
            if isinstance(d, DerivedWeight) and d.value is not None:
                with torch.no_grad():
                    if not torch.equal(d.value, d.fn(*(w.detach() for w in d.weights))):
                        stale.append(f"{name}.{attr}")
    return stale


def test_inconsistent_weights_still_empty_the_cache(qwen3_next_dense_path, other_seed_path, tmp_path, monkeypatch):
    """The update's read fails, and so does the read back of the served checkpoint (its first shard broken
    too): the weights are a mix of both (a ``RuntimeError``), and yet, as after any update, the prefix
    cache is emptied (it holds what the old weights computed: a request would hit it and continue on
    the others) and the derived weights are those of the parameters as they are (the graphs replay
    them). The next request computes its whole prompt."""
    old = _sharded(qwen3_next_dense_path, tmp_path / "old")
    new = _sharded(other_seed_path, tmp_path / "new")
    real_read = NewWeights.read

    def read_then_break(path, model, mtp_head):
        checked = real_read(path, model, mtp_head)
        if Path(path) == new:  # (after its check: the update's own read fails, then the read back at once)
            for shard in (new / SECOND_SHARD, old / SECOND_SHARD.replace("2-of", "1-of")):
                os.truncate(shard, shard.stat().st_size // 2)
        return checked

    prompt = list(range(3, 40))
    with Engine(old, **OPTS) as engine:
        engine.generate(input_ids=prompt, sampling_params=_greedy(8))
        assert engine.tree.total_size() > 0 and not _stale_derived_weights(engine.model)
        monkeypatch.setattr(NewWeights, "read", read_then_break)
        with pytest.raises(RuntimeError, match="inconsistent"):
            engine.update_weights_from_disk(new)
        assert engine.tree.total_size() == 0
        assert _stale_derived_weights(engine.model) == []
        out = engine.generate(input_ids=prompt, sampling_params=_greedy(8))
        assert out["meta_info"]["cached_tokens"] == 0
        assert_drained(engine)


@pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                    reason="torch.compile needs a C++ compiler")
def test_update_recompiles_compiled_decode(qwen3_next_short_path, tiny_ckpt_dir, monkeypatch):
    """``compile_decode``: the graphs compiled from the old weights are compiled again (the graph of more
    rows holds the weights as constants, or here, as for a model with large projections, runs on
    weights packed at start-up: ``linear.pack_weights_``, a graph inductor's cache keeps, so that the
    recompile is a load); the engine then decodes as an eager one on the new weights."""
    from hyla.engine import model_runner
    from hyla.model import linear

    monkeypatch.setattr(linear, "PACK_MIN_WEIGHT", 1)  # every projection packed: stale copies unless rebuilt
    monkeypatch.setattr(model_runner, "ROWS_OPTIONS", {"realize_opcount_threshold": 4})  # (not autotuned)
    new = checkpoints.make_qwen3_next(tiny_ckpt_dir, moe=False, seed=1, num_hidden_layers=2,
                                      layer_types=["linear_attention", "full_attention"])
    prompts = [list(range(3 + i, 30 + 2 * i)) for i in range(3)]
    params = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
    with Engine(new, **OPTS) as eager:
        want = eager.generate(input_ids=prompts, sampling_params=params, return_logprob=True)
    with Engine(qwen3_next_short_path, compile_decode=True, **OPTS) as engine:
        engine.generate(input_ids=prompts, sampling_params=params)
        old_runner = engine.scheduler.runner
        engine.update_weights_from_disk(new)
        assert engine.scheduler.runner is not old_runner and engine.scheduler.runner.compiled
        one = engine.generate(input_ids=prompts[0], sampling_params=params, return_logprob=True)  # the one-row graph
        rows = engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True)  # more rows
        assert engine.scheduler.runner.late_compiles == 0
        assert_drained(engine)
    assert compare_outputs([one] + rows, want[:1] + want) > 0.9 * 4 * 12


def test_server_update_weights_from_disk(tiny_ckpt_dir, tmp_path):
    """``POST /update_weights_from_disk`` and ``GET /get_weight_version`` (SGLang's), as an RL loop calls
    them: the next generations run on the new weights and say so; a bad request is a 400 whose body has
    SGLang's ``success: false`` beside the OpenAI-style error."""
    import httpx

    from hyla.server.app import create_app
    from hyla.server.launch import BackgroundServer
    from test_server_openai import make_chat_model

    path = make_chat_model(tiny_ckpt_dir)
    stepped = _stepped(path, tmp_path, lambda t: t.update(
        {k: v * 1.5 for k, v in t.items() if k.endswith("proj.weight")}))
    body = {"text": "Hello there", "sampling_params": _greedy(8)}
    with BackgroundServer(create_app(path, max_total_tokens=4096, max_state_slots=16, max_running_requests=4)) as srv:
        url = srv.url
        before = httpx.post(url + "/generate", json=body, timeout=60).json()
        assert before["meta_info"]["weight_version"] == "default"
        resp = httpx.post(url + "/update_weights_from_disk", timeout=60,
                          json={"model_path": stepped, "weight_version": "rl-step-1"})
        assert resp.status_code == 200, resp.text
        assert resp.json()["success"] is True and resp.json()["weight_version"] == "rl-step-1"
        after = httpx.post(url + "/generate", json=body, timeout=60).json()
        assert after["meta_info"]["weight_version"] == "rl-step-1" and after["meta_info"]["cached_tokens"] == 0
        assert httpx.get(url + "/get_weight_version", timeout=10).json() == {"weight_version": "rl-step-1"}
        info = httpx.get(url + "/get_model_info", timeout=10).json()
        assert info["weight_version"] == "rl-step-1" and info["model_path"] == stepped
        assert info["tokenizer_path"] == str(path)  # (the tokenizer loaded at start-up, which an update keeps)
        for bad, param in [({"model_path": str(tmp_path / "nowhere")}, "model_path"),
                           ({"model_path": stepped, "flush_cache": False}, "flush_cache"),
                           ({"model_path": stepped, "weight_version": ""}, "weight_version"),
                           ({"model_path": stepped, "weight_version": "v\r\n2"}, "weight_version"),
                           ({}, "model_path")]:
            resp = httpx.post(url + "/update_weights_from_disk", json=bad, timeout=60)
            assert resp.status_code == 400, (bad, resp.text)
            assert resp.json()["error"]["param"] == param, resp.text
        resp = httpx.post(url + "/update_weights_from_disk", json={"model_path": str(tmp_path)}, timeout=60)
        assert resp.json()["success"] is False and "no config.json" in resp.json()["message"]
        assert httpx.get(url + "/get_weight_version", timeout=10).json() == {"weight_version": "rl-step-1"}
    assert after["output_ids"] != before["output_ids"]
    with Engine(stepped, max_total_tokens=4096, max_state_slots=16) as engine:
        assert engine.generate("Hello there", sampling_params=_greedy(8))["output_ids"] == after["output_ids"]



def test_updates_waiting_their_turn_hold_no_thread_and_apply_in_order(tiny_ckpt_dir, monkeypatch):
    """Eight updates at once (a trainer's client retrying): each waited for the one before on a thread of the
    event loop's pool (six on two cores), so the pool was full and every endpoint that works off the loop
    (``/tokenize``, chat rendering) hung while ``/health`` said ok. They wait their turn on the loop now, and
    apply in the order they came."""
    import concurrent.futures
    import threading

    import httpx

    from hyla.server.app import create_app
    from hyla.server.launch import BackgroundServer
    from test_server_openai import make_chat_model

    path = make_chat_model(tiny_ckpt_dir)
    applied, release = [], threading.Event()

    def slow_update(self, model_path, **kwargs):
        release.wait(30)
        applied.append(kwargs["weight_version"])
        return {"model_path": str(model_path), "weight_version": kwargs["weight_version"],
                "num_aborted_requests": 0, "seconds": 0.0}

    monkeypatch.setattr(Engine, "update_weights_from_disk", slow_update)
    with BackgroundServer(create_app(path, **OPTS)) as srv, concurrent.futures.ThreadPoolExecutor(8) as pool:
        updates = []
        try:
            for i in range(8):  # (sent one after the other: their order of arrival is known)
                updates.append(pool.submit(httpx.post, srv.url + "/update_weights_from_disk", timeout=60,
                                           json={"model_path": str(path), "weight_version": f"v{i}"}))
                time.sleep(0.05)
            answer = httpx.post(srv.url + "/tokenize", json={"prompt": "Hello there"}, timeout=10)
            assert answer.status_code == 200 and answer.json()["tokens"], answer.text
        finally:
            release.set()
        assert [u.result().status_code for u in updates] == [200] * 8
    assert applied == [f"v{i}" for i in range(8)]


def test_an_update_waiting_too_long_for_its_turn_is_a_409(tiny_ckpt_dir, monkeypatch):
    """The wait for the turn counts toward the update's ten minutes (here one second), as the engine's own wait
    for another update did: past it, a 409 (``engine_busy``), the weights not updated."""
    import concurrent.futures
    import threading

    import httpx

    from hyla.server import native_routes
    from hyla.server.app import create_app
    from hyla.server.launch import BackgroundServer
    from test_server_openai import make_chat_model

    path, release = make_chat_model(tiny_ckpt_dir), threading.Event()

    def slow_update(self, model_path, **kwargs):
        release.wait(30)
        return {"model_path": str(model_path), "weight_version": "v", "num_aborted_requests": 0, "seconds": 0.0}

    monkeypatch.setattr(Engine, "update_weights_from_disk", slow_update)
    monkeypatch.setattr(native_routes, "WEIGHT_UPDATE_SECONDS", 1.0)
    with BackgroundServer(create_app(path, **OPTS)) as srv, concurrent.futures.ThreadPoolExecutor(1) as pool:
        try:
            first = pool.submit(httpx.post, srv.url + "/update_weights_from_disk", json={"model_path": str(path)},
                                timeout=60)
            time.sleep(0.2)
            start = time.monotonic()
            second = httpx.post(srv.url + "/update_weights_from_disk", json={"model_path": str(path)}, timeout=60)
            assert second.status_code == 409 and time.monotonic() - start < 10, second.text
            assert second.json()["success"] is False and "another weight update still running" in second.text
        finally:
            release.set()
        assert first.result().status_code == 200

def test_a_failed_recompile_serves_the_new_weights_eager(qwen3_next_dense_path, other_seed_path, monkeypatch, caplog):
    """``compile_decode``'s graphs compiled again after the weights were written, and the compile fails
    (inductor's cache dir full, say): the old graphs (the old weights as constants) are dropped all the
    same, the steps run eager on the new weights, the prefix cache is empty, and the next update compiles
    again. (Faked on an eager engine: its runner said compiled, ``rebuilt`` raising when asked to compile.)"""
    from hyla.engine.model_runner import ModelRunner

    real_rebuilt, asked = ModelRunner.rebuilt, []

    def rebuilt(self, **changes):
        asked.append(changes)
        if changes.get("compile_decode"):
            raise RuntimeError("compile failed")
        return real_rebuilt(self, **changes)

    prompt = list(range(3, 40))
    with Engine(qwen3_next_dense_path, **OPTS) as engine:
        engine.generate(input_ids=prompt, sampling_params=_greedy(8))
        assert engine.tree.total_size() > 0
        old_runner = engine.scheduler.runner
        monkeypatch.setattr(ModelRunner, "compiled", property(lambda self: self is old_runner))
        monkeypatch.setattr(ModelRunner, "rebuilt", rebuilt)
        with caplog.at_level(logging.ERROR, logger="hyla.engine.weight_update"):
            done = engine.update_weights_from_disk(other_seed_path, weight_version="v2")
        assert done["weight_version"] == engine.weight_version == "v2"
        assert "compiling the decode graphs failed" in caplog.text
        runner = engine.scheduler.runner
        assert runner is not old_runner and runner.compile_failed and not runner.compiled
        assert engine.tree.total_size() == 0
        out = engine.generate(input_ids=prompt, sampling_params=_greedy(8))
        assert out["meta_info"]["cached_tokens"] == 0
        engine.update_weights_from_disk(other_seed_path)  # compiles again (and fails again: eager again)
        assert asked == [{"compile_decode": True}, {"compile_decode": False}] * 2
        assert engine.scheduler.runner.compile_failed
        assert_drained(engine)
    assert out["output_ids"] == _reference(other_seed_path, [prompt], 8)[0]


def test_server_answers_inconsistent_weights_as_sglang_does(qwen3_next_dense_path, other_seed_path, tmp_path,
                                                            monkeypatch):
    """A weight update that leaves the weights inconsistent (the update's read and the read back both
    fail) is the server's fault, not the request's: a 500 whose body has SGLang's ``success: false`` and
    ``message`` beside the OpenAI-style error (an RL client reads ``success``), not a bare internal
    error. The server serves on, and an update from a good checkpoint mends it."""
    import httpx

    from hyla.server.app import create_app
    from hyla.server.launch import BackgroundServer

    old = _sharded(qwen3_next_dense_path, tmp_path / "old")
    new = _sharded(other_seed_path, tmp_path / "new")
    real_read = NewWeights.read

    def read_then_break(path, model, mtp_head):
        checked = real_read(path, model, mtp_head)
        if Path(path) == new:
            for shard in (new / SECOND_SHARD, old / SECOND_SHARD.replace("2-of", "1-of")):
                os.truncate(shard, shard.stat().st_size // 2)
        return checked

    body = {"input_ids": list(range(3, 30)), "sampling_params": _greedy(8)}
    with BackgroundServer(create_app(str(old), **OPTS)) as srv:
        url = srv.url
        monkeypatch.setattr(NewWeights, "read", read_then_break)
        resp = httpx.post(url + "/update_weights_from_disk", json={"model_path": str(new)}, timeout=60)
        assert resp.status_code == 500, resp.text
        answer = resp.json()
        assert answer["success"] is False and "inconsistent" in answer["message"]
        assert answer["error"]["type"] == "internal_error" and "inconsistent" in answer["error"]["message"]
        monkeypatch.undo()
        resp = httpx.post(url + "/update_weights_from_disk", timeout=60,
                          json={"model_path": str(other_seed_path), "weight_version": "mended"})
        assert resp.status_code == 200 and resp.json()["success"] is True, resp.text
        out = httpx.post(url + "/generate", json=body, timeout=60).json()
    assert out["meta_info"]["weight_version"] == "mended"
    assert out["output_ids"] == _reference(other_seed_path, [body["input_ids"]], 8)[0]


@pytest.mark.gpu
def test_cuda_graphs_replay_the_new_weights(qwen3_next_dense_path, other_seed_path):
    """On a GPU, decode and cached-extend steps replay CUDA graphs captured with the old weights' addresses:
    after an update they compute with the new ones (written in place, and the derived weights the graphs
    read, ``-exp(A_log)`` and the norms' scales, recomputed in place), as a fresh engine on the new
    checkpoint does. fp32, greedy; the same workload as the first test, cache on."""
    opts = dict(OPTS, device="cuda", dtype="float32")
    wave1, _ = make_workload(5, 2048, num_sessions=8, num_shared=8, scale=0.5)
    with Engine(other_seed_path, **opts) as fresh:
        assert fresh.scheduler.runner.graphs is not None
        want = run(fresh, wave1) + run(fresh, wave1)  # the second time from the cache (cached extends)
    with Engine(qwen3_next_dense_path, **opts) as engine:
        run(engine, wave1)
        engine.update_weights_from_disk(other_seed_path)
        got = run(engine, wave1) + run(engine, wave1)
        assert_drained(engine)
    assert compare_outputs(got, want) > 0.9 * 2 * sum(s["max_new"] for s in wave1)
