"""The GPU benchmark scripts run end to end in their CPU modes (tiny model, Triton interpreted).

A GPU session has 30 minutes of device time; a script that broke since the last one (an argument
renamed, an engine option gone) costs a device call to find out. These run each script's CPU
smoke mode and check what it measured, not the times: the cached TTFT hits exactly the cached
prefix, the profile has each phase's Python profile, the fused out projection agrees with the
separate kernels, each extend attention tile with PyTorch's SDPA. Four CPU scripts are run the
same way: ``state_ops.py`` (both paths of the state pool's slot operations), ``cpu_ab.py`` (its
two worker processes, here one checkout against itself), ``cache_pressure.py`` (one workload
seed of a smaller workload, then its ``--replay`` and its ``--timing`` through its ``main`` in
this process), ``cpu_model_size.py`` (its tiny model, both thread counts, the unsplit side at
both, shorter prompts), ``cpu_gemm.py`` (the tiny model's weights, every path where it applies)
and ``cpu_moe.py`` (its tiny model, shorter prompts, the eager engine against transformers: the
compiled side's start-up is minutes); ``startup.py``'s and ``mixed_chunk.py``'s measurements run
in this process. A script's engine that failed a step (its requests aborted, ``generate``
returning them) fails the test too.
``recurrent_tiles.py`` is left out (minutes in the interpreter);
``fla_prefill.py`` needs fla, which CPU installs lack.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import script_zygote

ROOT = Path(__file__).resolve().parents[1]


# each script's process forked from one that imported torch, transformers and hyla already (tests/script_zygote.py
# says what a run still gets of its own): this file's CPU time 197 s -> 120 s
ZYGOTE = script_zygote.Zygote()


@pytest.fixture(scope="session", autouse=True)
def _stop_the_zygote():
    yield
    ZYGOTE.close()


def _run(*args: str, timeout: int = 300) -> str:
    # OMP_WAIT_POLICY: a script's run at 2 threads (cpu_model_size.py, cpu_gemm.py) times nothing here, and its
    # OpenMP workers spinning between parallel regions would burn a core the suite's other worker needs
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "passive", "PYTHONUNBUFFERED": "1"}
    out = ZYGOTE.run(list(args), cwd=ROOT, env=env, timeout=timeout)
    assert out.returncode == 0, f"{args[0]} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    # a step that raises aborts its requests and generate returns them (hyla/engine/engine.py's _loop): the log is
    # all that says so, and a script would go on to time requests that did nothing
    assert "scheduler step failed" not in out.stderr, f"{args[0]} aborted requests:\n{out.stderr[-3000:]}"
    return out.stdout


@pytest.mark.slow
def test_gpu_decode_runs_on_cpu(tmp_path):
    report = tmp_path / "gpu_decode.json"
    out = _run("benchmarks/gpu_decode.py", "--device", "cpu", "--tiny", "--batches", "1,2", "--new-tokens", "4",
               "--prefill-tokens", "64", "--cached-tokens", "48", "--repeats", "1", "--hyla-only", "--no-write",
               "--log-compiles", "--json", str(report), "--pdl", "0", "--gemv-in", "0",
               "--variants", "gemv-max-rows=1; gemv-max-rows=0,fuse-conv=0")
    assert "pdl.PDL = False" in out and "gemv.IN_PROJ = False" in out  # the A/B switches, set before the engine
    data = json.loads(report.read_text())
    medians = data["medians"]
    # --variants: each timed on a runner of its own (the first's numbers are the tables'), in a table against the first
    assert all(f"variant {v}: its runner's graphs captured" in out for v in ("gemv-max-rows=1", "gemv-max-rows=0,fuse-conv=0"))
    assert "| `gemv-max-rows=0,fuse-conv=0` | " in out and "| `gemv-max-rows=1` | " in out
    assert all(k in medians for k in ("hyla_decode_2@gemv-max-rows=0,fuse-conv=0", "hyla_cached_ttft@gemv-max-rows=0,"
                                      "fuse-conv=0", "hyla_decode_2"))
    # --log-compiles counts the Triton compiles in the timed repeats (the CPU runs no Triton kernel)
    assert "Triton compiles inside the timed repeats (`--log-compiles`): 0; 0 before them" in out
    assert data["triton_compiles"] == []
    assert medians["hyla_cached_hit"] == 48  # the cached TTFT's prompt hit its whole cached prefix
    assert all(medians[k] > 0 for k in ("hyla_ttft", "hyla_cached_ttft"))  # timed directly
    # a decode time is the difference of two runs (1 + N tokens minus 1): a number, whose sign a loaded machine
    # can flip at N = 4 (this test's first failure, 2026-11-30: the suite's other worker busy)
    assert all(math.isfinite(medians[k]) for k in ("hyla_decode_1", "hyla_decode_2"))


def test_gpu_decode_refuses_a_bad_variant():
    bad = subprocess.run([sys.executable, "benchmarks/gpu_decode.py", "--device", "cpu", "--variants", "pdl=2; pdl=0"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "pdl takes 0 or 1" in bad.stderr


def test_gpu_decode_runs_on_cpu_with_moe_layers(tmp_path):
    """``--moe``: the model with MoE layers, both sides (their greedy check agrees), its roofline
    counting the experts a batch chooses."""
    out, data = _tiny_gpu_decode(tmp_path, "--moe")
    assert "Qwen3.5-MoE-style model (8 experts, top-2" in out and "per distinct expert" in out
    assert data["greedy_agreement"] == 8 and data["moe"]["num_experts"] == 8 and data["sizes"]["expert_bytes"] > 0
    roof = {int(b): v for b, v in data["roofline_tok_s"].items()}
    # (a decode time is a difference of two timings, 1 + n tokens less 1: with n = 2 on a loaded machine
    # it can come out <= 0, hyla's too, once in a full run: measured, not asserted)
    medians = data["medians"]
    assert roof[2] > roof[1] > 0 and math.isfinite(medians["hyla_decode_1"]) and "hf_decode_2" in medians


def test_gpu_decode_runs_on_cpu_with_jamba(tmp_path):
    """``--jamba``: the Jamba-style model (Mamba1 + attention, MoE in every 2nd layer), both sides (their
    greedy check agrees), its cached TTFT hitting the whole prefix, its roofline counting the experts a
    batch chooses and the untied lm_head once."""
    out, data = _tiny_gpu_decode(tmp_path, "--jamba")
    assert "Jamba-style model (`JambaForCausalLM`)" in out and "(3 Mamba1 + 1 attention at 2)" in out
    assert data["sizes"]["expert_bytes"] > 0
    _assert_untied_moe_report(out, data)


def test_gpu_decode_runs_on_cpu_with_minimax(tmp_path):
    """``--minimax``: the MiniMax-style model (lightning + softmax attention 3:1, a MoE in every layer), both sides
    (their greedy check agrees), transformers named as PyTorch alone, its cached TTFT hitting the whole prefix, its
    roofline counting the experts a batch chooses, the untied lm_head once and no conv window in the states."""
    out, data = _tiny_gpu_decode(tmp_path, "--minimax")
    assert "MiniMax-style model (`MiniMaxForCausalLM`)" in out and "(3 lightning attention + 1 softmax attention at 3)" in out
    assert "transformers (PyTorch)" in out
    _assert_untied_moe_report(out, data)


def test_gpu_decode_runs_on_cpu_with_kimi(tmp_path):
    """``--kimi``: the Kimi-Linear-style model (KDA + MLA 3:1, a dense layer 0 then MoE with a shared
    expert), both sides (their greedy check agrees), its cached TTFT hitting the whole prefix, its
    roofline counting the experts a batch chooses (transformers' fused ``mlp.experts.gate_up_proj`` /
    ``down_proj``, not the shared expert) and the untied lm_head once, MLA's latent as its KV."""
    out, data = _tiny_gpu_decode(tmp_path, "--kimi")
    assert "Kimi-Linear-style model (`KimiLinearForCausalLM`)" in out and "(3 KDA + 1 MLA at 3)" in out
    assert "KDA 2 heads of 32" in out and "a latent of 32 + 16 per token" in out
    # each expert: 3 matrices of hidden x moe_intermediate_size (fp32 here) in each of the 3 MoE layers
    config = data["config"]
    assert data["sizes"]["expert_bytes"] == 3 * 3 * config["hidden_size"] * config["moe_intermediate_size"] * 4
    _assert_untied_moe_report(out, data)


def test_gpu_decode_runs_on_cpu_with_olmo(tmp_path):
    """``--olmo``: the OLMo-Hybrid-style model (Gated DeltaNet with beta = 2 sigmoid(b), post-norm NoPE attention
    3:1, dense MLPs), both sides (their greedy check agrees), no experts, its cached TTFT hitting the whole prefix."""
    out, data = _tiny_gpu_decode(tmp_path, "--olmo")
    assert "OLMo-Hybrid-style model (`OlmoHybridForCausalLM`)" in out and "(3 Gated DeltaNet + 1 post-norm" in out
    assert "beta = 2 sigmoid(b)" in out and "NoPE" in out
    assert data["greedy_agreement"] == 8 and data["moe"] is None and data["medians"]["hyla_cached_hit"] == 48


def test_gpu_decode_runs_on_cpu_with_zamba2(tmp_path):
    """``--zamba2``: the Zamba2-style model (Mamba2 + hybrid layers over one shared block, run twice), both sides
    (their greedy check agrees), its roofline reading the block once per layer that runs it (and of its adapters,
    each layer its own), its cached TTFT hitting the whole prefix."""
    import checkpoints
    import transformers

    from benchmarks.gpu_decode import TINY_ZAMBA2

    out, data = _tiny_gpu_decode(tmp_path, "--zamba2")
    assert "Zamba2-style model (`Zamba2ForCausalLM`)" in out and "(2 Mamba2 + 2 hybrid at 1, 3: Mamba2 after one" in out
    assert data["greedy_agreement"] == 8 and data["moe"] is None and data["medians"]["hyla_cached_hit"] == 48
    hf = transformers.Zamba2ForCausalLM(transformers.Zamba2Config(**{**checkpoints.ZAMBA2_KW, **TINY_ZAMBA2}))
    block = hf.model.layers[1].shared_transformer
    assert hf.model.layers[3].shared_transformer.self_attn.q_proj.weight is block.self_attn.q_proj.weight
    nbytes = lambda ps: sum(p.numel() * 4 for p in ps)  # noqa: E731  (fp32 on the CPU)
    adapters = [p for name, p in block.named_parameters() if "_adapter_list." in name]
    # each unique parameter once, the shared block (less the adapters) once more, the tied lm_head read once
    want = nbytes(hf.parameters()) + nbytes(block.parameters()) - nbytes(adapters)
    assert data["sizes"]["weight_bytes_per_step"] == want


def _tiny_gpu_decode(tmp_path, model: str) -> tuple[str, dict]:
    """``gpu_decode.py --tiny`` on the CPU for ``model`` (``--moe``, ``--jamba``, ``--kimi``, ``--olmo``, ``--zamba2``,
    ``--minimax``), both sides,
    batches 1 and 2, a 64-token cached TTFT with 48 cached: ``(its output, its JSON report)``."""
    report = tmp_path / "gpu_decode.json"
    out = _run("benchmarks/gpu_decode.py", "--device", "cpu", "--tiny", model, "--batches", "1,2", "--new-tokens", "2",
               "--prefill-tokens", "64", "--cached-tokens", "48", "--repeats", "1", "--no-write", "--json", str(report))
    return out, json.loads(report.read_text())


def _assert_untied_moe_report(out: str, data: dict) -> None:
    """The tiny Jamba and Kimi-Linear reports alike: 4 experts top-2, both sides agreeing, every parameter
    counted once (the step's weights, the untied lm_head among them; the embedding, B rows a step; the 4
    experts), a roofline growing with the batch, the cached prompt hitting its whole prefix."""
    sizes, medians = data["sizes"], data["medians"]
    assert "4 experts, top-2" in out and "per distinct expert" in out
    assert data["greedy_agreement"] == 8 and data["moe"] == {"num_experts": 4, "num_experts_per_tok": 2}
    h, vocab = data["config"]["hidden_size"], data["config"]["vocab_size"]
    assert sizes["param_bytes"] == sizes["weight_bytes_per_step"] + 4 * vocab * h + 4 * sizes["expert_bytes"]
    roof = {int(b): v for b, v in data["roofline_tok_s"].items()}
    assert roof[2] > roof[1] > 0 and math.isfinite(medians["hyla_decode_1"]) and "hf_decode_2" in medians
    assert medians["hyla_cached_hit"] == 48


def test_cpu_moe_measures_hyla_against_transformers(tmp_path):
    # shorter prompts than the script's (32 tokens, not 512; 8 requests of 16 -> 4, not 128 -> 64)
    out = _run("benchmarks/cpu_moe.py", "--tiny", "--model-dir", str(tmp_path), "--repeats", "1", "--new-tokens", "4",
               "--sides", "hyla,hf", "--prompt", "32", "--batch-prompt", "16", "--batch-new", "4")
    rows = [line for line in out.splitlines() if line.startswith("| decode") or line.startswith("| output")]
    assert len(rows) == 2 and all(line.count("x**)") == 1 for line in rows)  # hyla's ratio to transformers
    assert "after a 32-token prompt" in rows[0] and "8 concurrent 16 → 4 requests" in rows[1]  # the lengths run


@pytest.mark.slow
def test_gpu_profile_runs_on_cpu_for_the_prefill_phases_alone(tmp_path):
    _run("benchmarks/gpu_profile.py", "--device", "cpu", "--tiny", "--out", str(tmp_path), "--prefill-tokens", "64",
         "--cached-tokens", "48", "--batches", "", "--no-traces")
    profile = (tmp_path / "profile.md").read_text()
    phases = [line.split(":")[0][3:] for line in profile.splitlines() if line.endswith("Python profile")]
    assert phases == ["prefill_cold", "prefill_cached"]  # one profile each, no decode phase
    assert "forward_extend" in profile
    # the clock's marks in the order a prefill passes them, each ending before the next starts
    clock = profile.split("## Prefill phases on the clock", 1)[1].split("\n## ", 1)[0]
    rows = [line.split(" | ") for line in clock.splitlines() if line.startswith("| ") and line[2] != "-"][1:]
    assert [r[0][2:] for r in rows][:3] == ["requests validated and built",
                                            "scheduled: prefix matched, admitted, state restored", "forward launched"]
    assert rows[-1][0] == "| call returned"
    for col in (1, 3):  # cold and cached: each mark a start no later than its end, the call's return last
        # (not each mark ending before the next starts: the scheduler thread's marks overlap the caller's
        # on a loaded machine — an idle schedule() begun before the call, a delivery ending after its return)
        spans = [(float(r[col]), float(r[col + 1].rstrip(" |"))) for r in rows]
        assert all(start <= end for start, end in spans) and spans[-1][0] > 0
        assert spans[-1][0] >= max(start for start, _ in spans)


@pytest.mark.slow
def test_out_projection_runs_on_cpu_and_matches_the_separate_kernels():
    rows = [line for line in _run("benchmarks/out_projection.py", "--device", "cpu", "--no-write", "--repeats", "1",
                                  "--rows", "1,2").splitlines() if line.startswith("| ")]
    assert len(rows) == 9  # 3 out projections x 2 row counts, 3 in projections
    assert all(float(r.rstrip(" |").rsplit("|", 1)[1]) <= 0.05 for r in rows)  # max diff, bf16


def test_attention_tiles_agree_with_sdpa():
    """Each tile's output against the default's, and the default against PyTorch's SDPA (fp32 here).
    The keys split 2 ways, not the kernel's 32 (most of them empty at this shape, each an interpreted
    program): still two partials merged; ``test_fused_extend.py`` checks the kernel's own choice."""
    rows = [line for line in _run("benchmarks/attention_tiles.py", "--device", "cpu", "--repeats", "1",
                                  "--splits", "2").splitlines() if line.startswith("| ")]
    assert len(rows) == 4  # 3 tiles, then the summary
    assert all(float(r.rstrip(" |").rsplit("|", 1)[1]) <= 1e-5 for r in rows)  # max diffs


@pytest.mark.slow
def test_state_ops_times_both_paths():
    rows = [line for line in _run("benchmarks/state_ops.py", "--device", "cpu", "--no-write", "--repeats", "1",
                                  "--calls", "2").splitlines() if line.startswith("| ") and "µs" not in line]
    assert len(rows) == 8  # 2 layouts x 4 operations
    assert all(float(r.split("|")[5].strip().rstrip("x")) > 0 for r in rows)  # the speed-up column


def test_window_attention_times_both_paths():
    """Small sizes: each call checks the window's keys against the whole context (the script asserts it), then
    times both."""
    out = _run("benchmarks/window_attention.py", "--no-write", "--repeats", "1", "--threads", "1", "--window", "16",
               "--decodes", "1x64,2x40", "--extends", "64+8,8+8")
    rows = [line.split("|") for line in out.splitlines() if line.startswith("| ")]
    # both paths timed (a ratio may round to 0.0x where a noisy first call is slow: not asserted on)
    assert len(rows) == 4 and all(float(r[2]) > 0 and float(r[3]) > 0 and r[4].strip().endswith("x") for r in rows)


def test_images_measure_each_stage_against_transformers():
    """A tiny model: the script asserts the repeated image is served from the cache, and prints each stage timed
    against its peer."""
    out = _run("benchmarks/images.py", "--tiny", "--no-write", "--repeats", "1", "--size", "64")
    rows = [line.split("|") for line in out.splitlines() if line.startswith("| ") and "measurement" not in line]
    assert len(rows) == 5 and all(float(r[2]) > 0 for r in rows)


def test_tool_call_stream_times_the_stream_against_the_whole_parse():
    """Small calls: the script checks that the stream gives the whole parse's content and calls, then times both."""
    out = _run("benchmarks/tool_call_stream.py", "--no-write", "--repeats", "1", "--sizes", "200,3000")
    rows = {line for line in out.splitlines() if line.startswith("| ") and "chunks" not in line}  # (printed twice)
    assert len(rows) == 2 and all(float(r.split("|")[5].strip().rstrip("x")) > 0 for r in rows)


def test_host_cache_benchmark_measures_the_tier_against_the_device_alone():
    """A short run: the tier brings back prefixes the device pool evicted (more cached tokens)."""
    out = _run("benchmarks/host_cache.py", "--no-write", "--sessions", "2", "--turns", "2", "--kv-tokens", "768",
               "--repeats", "1", "--ratios", "4")
    off, on = (line for line in out.splitlines() if line.startswith(("prefix cache only:", "host tier x4:")))
    hit = lambda line: float(line.split("hit ")[1].split("%")[0])  # noqa: E731
    assert hit(on) > hit(off) and "loaded 0 tokens" not in on


def test_host_cache_replay_study_runs_at_a_real_models_size():
    out = _run("benchmarks/host_cache.py", "--no-write", "--replay", "qwen3-next-80b-a3b", "--sessions", "6",
               "--turns", "2", "--kv-tokens", "32768", "--state-slots", "16", "--ratios", "4")
    off, on = (line for line in out.splitlines() if line.startswith(("prefix cache only:", "x4:")))
    hit = lambda line: float(line.split("hit ")[1].split("%")[0])  # noqa: E731
    assert hit(on) > hit(off)


@pytest.mark.slow
def test_cpu_ab_runs_both_workers_in_turn():
    out = _run("benchmarks/cpu_ab.py", ".", ".", "--eager", "--small", "--rounds", "1", "--new-tokens", "30")
    lines = {line.split(":")[0]: line for line in out.splitlines() if line.startswith(("b1:", "b8:", "p8:"))}
    assert set(lines) == {"b1", "b8", "p8"} and all("1 rounds" in line for line in lines.values())


# cpu_model_size.py's prompts shortened (32 tokens, not 512; 8 requests of 16 -> 4, not 128 -> 64): at 2 threads on a
# busy machine its OpenMP team waits on the other worker, and the default lengths take a minute
CPU_MODEL_SIZE_LENGTHS = ("--new-tokens", "2", "--prompt", "32", "--batch-prompt", "16", "--batch-new", "4")


@pytest.fixture(scope="module")
def model_size_dir(tmp_path_factory) -> Path:
    """cpu_model_size.py's ``--model-dir``: the first of its tests to run builds the tiny model there (a
    transformers import and a build, ~5 s CPU), the other reads it."""
    return tmp_path_factory.mktemp("cpu-model-size") / "model"


@pytest.mark.slow
def test_cpu_model_size_measures_every_side_at_every_thread_count(model_size_dir):
    out = _run("benchmarks/cpu_model_size.py", "--tiny", "--model-dir", str(model_size_dir), "--threads", "1,2",
               "--repeats", "1", *CPU_MODEL_SIZE_LENGTHS)
    rows = [line for line in out.splitlines() if line.startswith(("| prefill", "| decode", "| output"))]
    assert len(rows) == 6, out  # 3 measurements x 2 thread counts
    assert "one 32-token prompt" in rows[0] and "8 concurrent 16 → 4 requests" in rows[-1], out  # the lengths run
    assert all(line.split("|")[3].strip()[0].isdigit() for line in rows)  # hyla measured at both
    assert all(line.split("|")[4].strip()[0].isdigit() for line in rows)  # and the unsplit side


def test_cpu_model_size_builds_only_the_sides_asked_for(model_size_dir):
    out = _run("benchmarks/cpu_model_size.py", "--tiny", "--model-dir", str(model_size_dir), "--threads", "1",
               "--repeats", "1", *CPU_MODEL_SIZE_LENGTHS, "--sides", "unsplit")
    assert "| measurement | threads | hyla, unsplit |" in out, out
    rows = [line for line in out.splitlines() if line.startswith(("| prefill", "| decode", "| output"))]
    assert len(rows) == 3 and all(line.split("|")[3].strip()[0].isdigit() for line in rows), out
    bad = subprocess.run([sys.executable, "benchmarks/cpu_model_size.py", "--tiny", "--sides", "llama.cpp"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "needs --llama-cpp" in bad.stderr


def test_cpu_gemm_times_every_path_of_every_weight():
    out = _run("benchmarks/cpu_gemm.py", "--tiny", "--threads", "1,2", "--rows", "1,8,80", "--repeats", "1",
               "--stream-mb", "1")
    step = [line.split("|")[1:-1] for line in out.splitlines() if line.startswith("| 1 |") or line.startswith("| 2 |")]
    assert [(c[0].strip(), c[1].strip()) for c in step] == [(t, r) for t in "12" for r in ("1", "8", "80")], out
    for threads, rows, mkl, split, onednn, hyla, ratio in (map(str.strip, c) for c in step):
        assert (split == "—") == (threads == "1" or rows == "80")  # the split: more threads, at most 16 rows
        assert all(float(v.replace(",", "")) > 0 for v in (mkl, onednn, hyla, ratio))
    per_weight = [line for line in out.splitlines() if line.startswith("| ") and "-major, x" in line]
    assert len(per_weight) == 6 * 2 * 3  # the tiny model's distinct weights x threads x rows
    counts = {line.split("|")[1].strip() for line in per_weight}
    assert sum(int(name.rsplit("x", 1)[1]) for name in counts) == 4 * 4 + 1  # 4 projections a layer, the lm_head


def test_chunk_sizes_times_every_scan_at_every_size():
    out = _run("benchmarks/chunk_sizes.py", "--shapes", "1x40", "--sizes", "16,64", "--repeats", "1", "--no-write")
    rows = [line for line in out.splitlines() if line.startswith(("| Gated DeltaNet", "| KDA", "| Mamba2 SSD"))]
    assert len(rows) == 3 and all(line.count("|") == 7 for line in rows), out  # 16, 32 (CHUNK_SIZE), 64, best


@pytest.mark.slow
def test_cache_pressure_reports_every_configuration_replays_and_times_the_hold(monkeypatch, capsys):
    """The measurement in a process of its own, then ``--replay`` and ``--timing`` through the
    script's ``main`` in this one (a fresh process's imports cost more than either)."""
    # a smaller workload than the script's (4 sessions x 3 turns, not 8 x 4) on a KV pool shrunk to match (512
    # tokens, not 1,536): still under pressure, every configuration losing some of its ideal to evictions
    small = ("--seeds", "1", "--sessions", "4", "--turns", "3", "--kv-tokens", "512")
    sys.path.insert(0, str(ROOT))
    from benchmarks import cache_pressure

    def main(*args: str) -> str:
        monkeypatch.setattr(sys, "argv", ["cache_pressure.py", *args])
        cache_pressure.main()
        return capsys.readouterr().out

    out = _run("benchmarks/cache_pressure.py", *small, "--archs", "qwen3_next", "--no-write")  # 2 archs: ~2x
    rows = [line for line in out.splitlines() if line.startswith("| qwen3_next") or line.startswith("| nemotron_h")]
    assert len(rows) == 3 * 3  # the main table, the cost table and the decomposition: 3 grids
    assert "--kv-tokens 512 --sessions 4 --turns 3" in out  # the section's command says what it measured
    assert "--archs qwen3_next" in out and "4 concurrent sessions × 3 turns" in out
    assert "reported every request's cached tokens exactly as the engine did" in out  # hyla sim --engine agreed
    lost = {r.split("|")[1].strip().removeprefix("qwen3_next, "): r.split("|")[3].split()[0] for r in rows[:3]}
    assert all(float(share.rstrip("%")) > 0 for share in lost.values()), rows  # the pool was under pressure
    replayed = main(*small, "--replay")
    rows = [line.split("|") for line in replayed.splitlines() if line.startswith("| page")]
    assert {r[1].strip(): r[2].strip() for r in rows} == lost  # without a model, the engine's own lost shares
    out = main("--seeds", "1", "--sessions", "2", "--turns", "2", "--timing", "1")  # what it times is not checked
    assert "protect_waiting_prefixes on" in out and "on / off" in out


def test_startup_measures_the_first_requests_of_a_process():
    """``startup.py``'s measurement, in this process (the script runs it in a fresh process per
    repeat): every phase timed, the cached requests hit exactly the cached prefix (it raises
    otherwise), the warm-up ran."""
    sys.path.insert(0, str(ROOT))
    from benchmarks.startup import PHASES, measure

    out = measure(None, "cpu", "float32", "on", prompt=64, cached=48)
    assert set(out) == set(PHASES) and all(v > 0 for v in out.values())


def test_priority_measures_interactive_requests_behind_a_batch(qwen3_next_dense_path):
    """``priority.py``'s round, in this process: the interactive requests arrive once the batch
    fills every slot; with priority scheduling they preempt batch requests, without it none is."""
    import argparse
    import random

    sys.path.insert(0, str(ROOT))
    from benchmarks.priority import METRICS, measure
    from hyla import Engine

    args = argparse.Namespace(batch=6, batch_prompt=40, batch_tokens=60, running=3, interactive=2, interval=1.0,
                              prompt=30, new_tokens=4)
    for on in (False, True):
        with Engine(qwen3_next_dense_path, enable_priority_scheduling=on, max_running_requests=3,
                    max_total_tokens=2048, max_state_slots=32) as engine:
            out = measure(engine, random.Random(0), args, priority=20 if on else 0)
        assert set(out) == set(METRICS) and out["interactive latency (ms)"] >= out["interactive TTFT (ms)"] > 0
        assert (out["preemptions"] > 0) == on


def test_mixed_chunk_measures_the_streams_during_a_long_prefill(qwen3_next_dense_path):
    """``mixed_chunk.py``'s window, in this process: with mixed steps each of the long prompt's
    prefill steps feeds every stream a token; without them the streams wait for all of them."""
    import argparse
    import random

    sys.path.insert(0, str(ROOT))
    from benchmarks.mixed_chunk import METRICS, window
    from hyla import Engine

    args = argparse.Namespace(streams=2, prompt=640, stream_tokens=400)
    tokens = {}
    for mixed in (False, True):
        with Engine(qwen3_next_dense_path, chunked_prefill_size=64, enable_mixed_chunk=mixed, max_total_tokens=4096,
                    max_state_slots=16) as engine:
            out = window(engine, random.Random(0), args)
        assert set(out) == set(METRICS) and out["max gap (ms)"] >= out["median gap (ms)"] > 0
        tokens[mixed] = out["tokens / stream"]
    # ceil(640 / (64 - 2)) = 11 mixed steps, each a token to every stream. Both sides may count a few tokens
    # that are not the prefill's: a decode step between the arrival and the admission, a token from before
    # the window that its consumer thread stamped inside it (a loaded machine: 2 without mixed steps once),
    # and the last mixed step's token stamped after the long prompt's answer closed the window (1 short)
    assert tokens[True] >= 8 and tokens[False] <= 3


def test_kv_cache_dtype_measures_float8_against_auto():
    """The tiny model, one round: every metric for both engines, the bytes per token a quarter in fp32, and
    the outputs' comparison."""
    out = _run("benchmarks/kv_cache_dtype.py", "--tiny", "--repeats", "1", "--context", "48", "--new-tokens", "4",
               "--prompts", "2", "--batch", "2", "--no-write")
    rows = {r.split("|")[1].strip(): r.split("|")[2:5] for r in out.splitlines() if r.startswith("| ") and "---" not in r}
    assert len(rows) == 6 and rows["KV bytes per token"][2].strip() == "0.25x"
    assert all(float(r[2].strip().rstrip("x")) > 0 for name, r in rows.items() if name != "measurement")
    assert "tokens (" in out and "equal up to each request's first divergence" in out


def test_lora_measures_every_mix_against_the_base_model():
    """The tiny model, one round: adapters made for every projection an adapter may target, every metric of
    every mix of requests, as a ratio against the base model's engine; then the adapters taking turns in one
    slot, written into it more than once each round."""
    out = _run("benchmarks/lora.py", "--tiny", "--repeats", "1", "--context", "32", "--new-tokens", "12",
               "--prefill", "48", "--batch", "4", "--adapters", "2", "--rank", "4", "--no-write")
    mixes, turns = out.split("Adapters taking turns")
    rows = {r.split("|")[1].strip(): r.split("|")[2:6] for r in mixes.splitlines() if r.startswith("| ") and "---" not in r}
    assert len(rows) == 4 and "2 adapters of rank 4 on " in out
    assert all(float(cell.split("(")[1].split("x")[0]) > 0 for name, r in rows.items() if name != "measurement"
               for cell in r[1:])
    (row,) = [r for r in turns.splitlines() if r.startswith("| ") and "---" not in r and "base model" not in r]
    assert all(float(cell.split("(")[1].split("x")[0]) > 0 for cell in row.split("|")[2:4])
    assert int(turns.split("written into the slot ")[1].split(" times")[0]) > 2


def test_prefix_transfer_moves_a_prefix_and_checks_the_first_token():
    """benchmarks/prefix_transfer.py: export, bytes, import timed; the first token after the import is the
    cold run's (the script asserts it)."""
    out = _run("benchmarks/prefix_transfer.py", "--lengths", "64", "--repeats", "1", "--no-write")
    row = next(line for line in out.splitlines() if line.startswith("| 64 | "))
    assert len(row.split("|")) == 10 and "move + TTFT / cold" in out
