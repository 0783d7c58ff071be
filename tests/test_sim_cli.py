"""`hyla sim` end to end (a trace file, a tiny ShareGPT sweep), sizes, and the sweep summary."""

from __future__ import annotations

import json

import pytest

from hyla.cli import main as hyla_main
from hyla.sim.cli import format_size, parse_size
from hyla.sim.simulator import SimResult
from hyla.sim.sweep import SweepPoint, format_summary, format_table, summarize
from hyla.sim.trace import TraceRequest, write_trace

REQUIRED = {"token_hit_rate", "request_hit_rate", "flops_saved", "kv_bytes", "state_bytes", "ttft_p50", "ttft_p95"}


def _trace(tmp_path):
    turn0 = TraceRequest(0, 0, 0.0, list(range(1, 301)), list(range(1000, 1040)))
    turn1 = TraceRequest(0, 1, 9.0, list(range(1, 301)) + list(range(1000, 1040)) + list(range(2000, 2100)), [5, 6])
    path = tmp_path / "trace.jsonl"
    write_trace(path, [turn0, turn1])
    return path


def _last_json(capsys) -> dict:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_one_configuration_prints_one_json_object_last(tmp_path, capsys):
    rc = hyla_main(["sim", str(_trace(tmp_path)), "--model", "marconi-7b", "--policy", "lru",
                    "--cache-size", "4GB", "--json", "--no-progress"])
    assert rc == 0
    out = _last_json(capsys)
    assert REQUIRED <= set(out)
    assert out["token_hit_rate"] == pytest.approx(339 / 740)  # turn 1 hits the 339 tokens turn 0 fed
    assert out["request_hit_rate"] == 0.5 and out["cache_bytes"] == 4 * 10**9


def test_policy_and_size_lists_plot_and_output(tmp_path, capsys):
    png, out_file = tmp_path / "hit.png", tmp_path / "res.json"
    rc = hyla_main(["sim", str(_trace(tmp_path)), "--model", "nemotron-h-8b", "--policy", "block,lru,hyla",
                    "--cache-size", "1GB,2GiB", "--json", "--no-progress", "--plot", str(png),
                    "--output", str(out_file)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "token hit" in text  # the table
    results = json.loads(text.strip().splitlines()[-1])["results"]
    assert [(r["policy"], r["cache_bytes"]) for r in results] == [
        (p, s) for s in (10**9, 2 * 2**30) for p in ("block", "lru", "hyla")]
    assert all(r["model"] == "nemotron-h-8b" for r in results)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads(out_file.read_text())["results"] == results


def test_a_float8_kv_cache_fits_a_prefix_the_models_dtype_does_not(tmp_path, capsys):
    """``--kv-cache-dtype fp8_e4m3``: the model's KV at a byte per element (half of NemotronH's bf16), as the
    engine's option keeps it; in a cache with room for turn 0's state and its 340 tokens' KV in float8 but not in
    bf16, turn 1 hits only with float8."""
    from hyla.sim.models import resolve_model

    bf16, fp8 = resolve_model("nemotron-h-8b"), resolve_model("nemotron-h-8b", "fp8_e4m3")
    assert fp8.kv_bytes_per_token * 2 == bf16.kv_bytes_per_token and fp8.name == "nemotron-h-8b (fp8 KV)"
    assert fp8.state_bytes_per_slot == bf16.state_bytes_per_slot
    size = bf16.state_bytes_per_slot + 345 * fp8.kv_bytes_per_token
    hits = {}
    for kv in ("auto", "fp8_e4m3"):
        assert hyla_main(["sim", str(_trace(tmp_path)), "--model", "nemotron-h-8b", "--cache-size", str(size),
                          "--kv-cache-dtype", kv, "--json", "--no-progress"]) == 0
        out = _last_json(capsys)
        hits[kv] = out["cached_tokens"]
    assert hits == {"auto": 0, "fp8_e4m3": 339}
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        resolve_model("nemotron-h-8b", "int8")


@pytest.mark.parametrize("argv, message", [
    (["--cache-size", "4XB"], "bad size"),
    (["--policy", "lru,fifo"], "unknown policy fifo"),
    (["--model", "gpt-9"], "unknown model"),
])
def test_bad_arguments_exit_2_with_a_message(tmp_path, capsys, argv, message):
    assert hyla_main(["sim", str(_trace(tmp_path)), "--no-progress", *argv]) == 2
    assert message in capsys.readouterr().err
    assert hyla_main(["sim"]) == 2
    assert hyla_main(["sim", str(tmp_path / "missing.jsonl")]) == 2


def test_a_cache_size_given_twice_is_refused(tmp_path, capsys):
    """``1GB,1000MB`` would run the same configurations twice, as two rows and two plot points."""
    assert hyla_main(["sim", str(_trace(tmp_path)), "--no-progress", "--cache-size", "1GB,2GB,1000MB"]) == 2
    captured = capsys.readouterr()
    assert "--cache-size lists 1GB (1,000,000,000 bytes) more than once" in captured.err
    assert "token hit" not in captured.out
    assert hyla_main(["sim", str(_trace(tmp_path)), "--no-progress", "--policy", "lru,hyla,lru"]) == 2
    assert "--policy lists lru more than once" in capsys.readouterr().err


def test_the_results_table_prints_sizes_in_units_not_exponents(tmp_path, capsys):
    assert [format_size(b) for b in (10**14, 4 * 10**9, 2 * 2**30, 512 * 10**6, 1500, 999, 10**18)] == [
        "100TB", "4GB", "2.15GB", "512MB", "1.5KB", "999B", "1,000,000TB"]
    assert hyla_main(["sim", str(_trace(tmp_path)), "--no-progress", "--cache-size", "100TB"]) == 0
    row = capsys.readouterr().out.strip().splitlines()[-1]
    assert row.split()[:2] == ["hyla", "100TB"]


def test_parse_size():
    assert parse_size("4GB") == 4 * 10**9
    assert parse_size("1.5GiB") == 3 * 2**29
    assert parse_size("512mb") == 512 * 10**6
    assert parse_size("1000") == 1000
    for bad in ("", "GB", "-1GB", "0", "4 parsecs", "9" * 400, "1" + "0" * 300 + "TB"):  # (the last: not a float)
        with pytest.raises(ValueError):
            parse_size(bad)


def test_tiny_sharegpt_sweep(tmp_path, monkeypatch, capsys):
    """The protocol on 2 sessions, 2 rates, 1 cache size, 2 workers: table, summary, JSON, plot."""
    monkeypatch.setenv("HYLA_CACHE_DIR", str(tmp_path))
    png = tmp_path / "sweep.png"
    rc = hyla_main(["sim", "--sweep", "sharegpt", "--sessions", "2", "--rates", "1,10", "--cache-size", "1GB",
                    "--policy", "block,lru,hyla", "--workers", "2", "--json", "--no-progress", "--plot", str(png)])
    assert rc == 0
    text = capsys.readouterr().out
    out = json.loads(text.strip().splitlines()[-1])
    assert len(out["results"]) == 2 * 3
    assert {(r["rate"], r["cache_gb"]) for r in out["results"]} == {(1.0, 1.0), (10.0, 1.0)}
    assert out["summary"]["num_configs"] == 2
    lru = out["summary"]["policies"]["lru"]
    assert lru["p50_win_over_lru_pct"] == 0.0
    assert "P95 vs lru" in text and png.exists()


@pytest.mark.parametrize("argv, message", [
    (["--rates", "1,2"], "--rates applies only with --sweep"),
    (["--sessions", "5", "--workers", "1", "--words-per-minute", "60"],
     "--sessions, --workers, --words-per-minute apply only with --sweep"),
    (["--sweep", "sharegpt"], "give a TRACE or --sweep sharegpt, not both"),
])
def test_sweep_options_with_a_trace_are_refused(tmp_path, capsys, monkeypatch, argv, message):
    """The sweep's options would be silently ignored on a trace (and a trace ignored by a sweep)."""
    from hyla.sim import sharegpt

    monkeypatch.setattr(sharegpt, "build_sessions", lambda **kw: pytest.fail("the sweep should not start"))
    assert hyla_main(["sim", str(_trace(tmp_path)), "--no-progress", *argv]) == 2
    captured = capsys.readouterr()
    assert message in captured.err and "token hit" not in captured.out


@pytest.mark.parametrize("argv, message", [
    (["--rates", "1,fast"], "--rates: 'fast' is not a positive number of sessions per second"),
    (["--rates", "0"], "--rates: '0' is not a positive number"),
    (["--rates", "nan"], "--rates: 'nan' is not a positive number"),
    (["--words-per-minute", "0"], "--words-per-minute must be a positive number"),
    (["--workers", "0"], "--workers must be at least 1"),
    (["--workers", "-3"], "--workers must be at least 1 (worker processes), got -3"),
    (["--rates", "1,2,1"], "--rates lists 1 more than once"),
])
def test_bad_sweep_options_exit_2_before_the_sweep(capsys, monkeypatch, argv, message):
    """Bad rates or typing speeds exit 2 naming the option, before the sessions are built (not as a
    worker's error after it)."""
    from hyla.sim import sharegpt

    monkeypatch.setattr(sharegpt, "build_sessions", lambda **kw: pytest.fail("the sweep should not start"))
    assert hyla_main(["sim", "--sweep", "sharegpt", "--no-progress", *argv]) == 2
    assert message in capsys.readouterr().err


def _point(rate: float, gb: float, policy: str, hit: float) -> SweepPoint:
    r = SimResult(policy, "m", int(gb * 1e9), 1, 100, int(hit * 100), hit, hit, 1.0, 0.0, 0.0, 0.0, 0, 0,
                  0.0, 0.0, 0.0, 0)
    return SweepPoint(rate, gb, r)


def test_summary_ratios_and_percentiles():
    points = []
    for k, (b, l, h) in enumerate([(0.1, 0.5, 0.6), (0.2, 0.4, 0.4), (0.0, 0.2, 0.3), (0.05, 0.5, 0.45)]):
        points += [_point(1.0, k + 1, "block", b), _point(1.0, k + 1, "lru", l), _point(1.0, k + 1, "hyla", h)]
    s = summarize(points)["policies"]
    # ratios over block: 6, 2, undefined (block hit nothing), 9
    assert s["hyla"]["mean_ratio_over_block"] == pytest.approx((6 + 2 + 9) / 3)
    assert s["hyla"]["ratio_over_block_undefined"] == 1
    # wins over lru: +20%, 0%, +50%, -10% -> P50 = 10%, min = -10%
    assert s["hyla"]["p50_win_over_lru_pct"] == pytest.approx(10.0)
    assert s["hyla"]["min_win_over_lru_pct"] == pytest.approx(-10.0)
    assert s["hyla"]["p5_win_over_lru_pct"] == pytest.approx(-10 + 0.15 * 10)
    assert s["hyla"]["mean_token_hit_rate"] == pytest.approx((0.6 + 0.4 + 0.3 + 0.45) / 4)
    assert "hyla" in format_summary(summarize(points)) and "60.00%" in format_table(points)


def test_engine_replay_prints_the_engines_hits(tmp_path, capsys):
    """--engine replays hyla's scheduler and cache manager (accounting pools) on the trace."""
    opts = json.dumps({"max_total_tokens": 4096, "max_state_slots": 16, "page_size": 16})
    rc = hyla_main(["sim", str(_trace(tmp_path)), "--model", "nemotron-h-8b", "--engine", opts, "--json"])
    assert rc == 0
    out = _last_json(capsys)
    assert out["cached_tokens_per_request"] == [0, 336]  # turn 1 hits the 339 tokens turn 0 fed, in pages of 16
    assert out["num_retractions"] == 0 and out["request_hit_rate"] == 0.5
    for bad, message in (("[1]", "JSON object"), ('{"max_total_tokens": 64}', "max_state_slots"),
                         ('{"max_total_tokens": 64, "max_state_slots": 4, "warp": 9}', "warp")):
        assert hyla_main(["sim", str(_trace(tmp_path)), "--engine", bad]) == 2
        assert message in capsys.readouterr().err


def test_engine_replay_with_a_host_tier_prints_its_hits(tmp_path, capsys):
    """A session whose prefix another session pushes out of a 512-token KV pool: its next turn
    recomputes it, unless the host tier (enable_hierarchical_cache) kept it."""
    a0 = TraceRequest(0, 0, 0.0, list(range(1, 301)), list(range(1000, 1040)))
    b0 = TraceRequest(1, 0, 1.0, list(range(3000, 3400)), [7, 8])
    a1 = TraceRequest(0, 1, 2.0, a0.input_tokens + a0.output_tokens + [9, 10], [5, 6])
    path = tmp_path / "evicting.jsonl"
    write_trace(path, [a0, b0, a1])
    pools = {"max_total_tokens": 512, "max_state_slots": 8}
    outs = []
    for extra in ({}, {"enable_hierarchical_cache": True}):
        assert hyla_main(["sim", str(path), "--model", "nemotron-h-8b", "--engine", json.dumps({**pools, **extra}),
                          "--json"]) == 0
        outs.append(_last_json(capsys))
    assert outs[0]["cached_tokens_per_request"] == [0, 0, 0] and "host_hit_tokens" not in outs[0]
    assert outs[1]["cached_tokens_per_request"] == [0, 0, 339]  # all turn 0 fed, back from the host
    assert outs[1]["host_hit_tokens"] == 339 and outs[1]["host_kv_tokens"] == 1024
    assert outs[1]["host_saved_tokens"] >= 339 and outs[1]["host_loaded_tokens"] > 0
    # a host tier given in GiB holds twice the tokens in a float8 KV cache (the engine's kv_cache_dtype) as in
    # bfloat16, and twice bfloat16's in float32 (the engine's dtype, default float32, is its KV's)
    sized = {"enable_hierarchical_cache": True, "hicache_size": 1}
    tokens = []
    for dtype, kv in (("bfloat16", "auto"), ("bfloat16", "fp8"), ("float32", "auto")):
        assert hyla_main(["sim", str(path), "--model", "nemotron-h-8b", "--engine",
                          json.dumps({**pools, **sized, "dtype": dtype, "kv_cache_dtype": kv}), "--json"]) == 0
        tokens.append(_last_json(capsys)["host_kv_tokens"])
    assert tokens[1] == pytest.approx(2 * tokens[0], rel=1e-3)
    assert tokens[0] == pytest.approx(2 * tokens[2], rel=1e-3)


ENGINE = json.dumps({"max_total_tokens": 4096, "max_state_slots": 16})


@pytest.mark.parametrize("argv, message", [
    (["--policy", "lru"], "--policy does not apply with --engine"),
    (["--cache-size", "1GB"], "--cache-size does not apply with --engine"),
    (["--plot", "x.png"], "--plot does not apply with --engine"),
    (["--policy", "hyla", "--cache-size", "4GB"], "--policy, --cache-size do not apply with --engine"),
    (["--kv-cache-dtype", "fp8"], "--kv-cache-dtype does not apply with --engine"),
])
def test_policy_options_are_refused_with_engine(tmp_path, capsys, argv, message):
    """--engine replays the engine's own eviction and pools: a policy, cache size or plot would be ignored."""
    assert hyla_main(["sim", str(_trace(tmp_path)), "--engine", ENGINE, *argv]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("option", ["--output", "--plot"])
def test_output_paths_are_checked_before_the_run(tmp_path, capsys, option):
    """A file in a missing directory, or a directory, is refused (exit 2) before the simulation runs."""
    trace = str(_trace(tmp_path))
    assert hyla_main(["sim", trace, "--no-progress", option, str(tmp_path / "missing" / "out")]) == 2
    captured = capsys.readouterr()
    assert f"{option} " in captured.err and "does not exist" in captured.err
    assert "token hit" not in captured.out  # nothing ran
    assert hyla_main(["sim", trace, "--no-progress", option, str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err
    assert hyla_main(["sim", trace, "--no-progress", "--engine", ENGINE, "--output",
                      str(tmp_path / "missing" / "out.json")]) == 2
    assert "does not exist" in capsys.readouterr().err


@pytest.mark.parametrize("plot", ["hit", "hit.xyz", "hit.pdf"])
def test_a_plot_that_is_not_a_png_path_is_refused_before_the_run(tmp_path, capsys, plot):
    """--plot writes a PNG: another suffix (which matplotlib would write in another format, or refuse
    after the whole run, losing --output) or none (matplotlib would write PLOT.png, a path never
    checked) exits 2 before anything runs."""
    out = tmp_path / "res.json"
    assert hyla_main(["sim", str(_trace(tmp_path)), "--no-progress", "--plot", str(tmp_path / plot),
                      "--output", str(out)]) == 2
    captured = capsys.readouterr()
    assert "--plot" in captured.err and ".png" in captured.err and "Traceback" not in captured.err
    assert "token hit" not in captured.out and not list(tmp_path.glob("hit*"))  # nothing ran, nothing written


@pytest.mark.parametrize("options, message", [
    # the trace's requests are 340 and 442 tokens
    ({"max_total_tokens": 4096, "max_state_slots": 16, "context_length": 50},
     "request (session 0, turn 0): prompt (300 tokens) + output (40 tokens) does not fit context_length=50"),
    ({"max_total_tokens": 400, "max_state_slots": 16},
     "request (session 0, turn 1): prompt (440 tokens) + output (2 tokens) does not fit the KV pool of 400 tokens"),
    ({"max_total_tokens": 100, "max_state_slots": 16}, "the KV pool cannot hold a single such request"),
    ({"max_total_tokens": 100, "max_state_slots": 16, "context_length": 200}, "does not fit the KV pool"),
    ({"max_total_tokens": 4096, "max_state_slots": 8, "max_running_requests": 8}, "must be below max_state_slots"),
    ({"max_total_tokens": 4096, "max_state_slots": 1}, "max_state_slots must be at least 2"),
])
def test_engine_replay_refuses_what_the_engine_would_refuse(tmp_path, capsys, options, message):
    """Requests too long for the context (or the KV pool) and pool sizes the engine refuses exit 2
    with a message naming the first such request, not per-request tracebacks or a RuntimeError."""
    rc = hyla_main(["sim", str(_trace(tmp_path)), "--model", "nemotron-h-8b", "--engine", json.dumps(options)])
    err = capsys.readouterr().err
    assert rc == 2 and message in err, err
    assert "Traceback" not in err


@pytest.mark.parametrize("key", ["record", "vocab_size", "layout", "max_position_embeddings", "model_path"])
def test_engine_replay_refuses_what_is_not_an_engine_option(tmp_path, capsys, key):
    """Every key of --engine is an ``Engine`` option: not one of ``replay_engine``'s own parameters
    (which would be taken as such — ``record`` — or clash with what --model gives), named in the
    message."""
    options = {"max_total_tokens": 4096, "max_state_slots": 16, key: 1}
    assert hyla_main(["sim", str(_trace(tmp_path)), "--model", "nemotron-h-8b", "--engine", json.dumps(options)]) == 2
    err = capsys.readouterr().err
    assert f"--engine: unknown engine option {key!r}" in err or f"--engine: {key}: " in err, err


def test_engine_replay_bounds_the_context_by_the_models_positions(tmp_path, capsys):
    """The engine's context length is the model's max_position_embeddings cut to the KV pool: a
    request longer than it is refused as the engine would, however large the pool."""
    from hyla.sim.presets import HF_CONFIGS

    (tmp_path / "config.json").write_text(json.dumps({**HF_CONFIGS["nemotron-h-8b"], "max_position_embeddings": 400}))
    args = ["sim", str(_trace(tmp_path)), "--model", str(tmp_path), "--engine"]
    assert hyla_main([*args, ENGINE]) == 2
    err = capsys.readouterr().err
    assert ("request (session 0, turn 1): prompt (440 tokens) + output (2 tokens) does not fit the model's "
            "max_position_embeddings (400): the engine would refuse it") in err, err
    # context_length past the model's positions is the engine's to allow (with a warning)
    assert hyla_main([*args, json.dumps({**json.loads(ENGINE), "context_length": 1000}), "--json"]) == 0
    assert _last_json(capsys)["cached_tokens_per_request"] == [0, 339]


def test_engine_replay_refuses_a_wave_the_engine_would_refuse(tmp_path, capsys):
    """Requests of one ``ts`` are one batch, which the engine refuses whole when it is larger than
    its running requests plus ``max_queued_requests``."""
    path = tmp_path / "wave.jsonl"
    write_trace(path, [TraceRequest(i, 0, 0.0, [1 + i, 2, 3], [5, 6]) for i in range(4)])
    options = {"max_total_tokens": 4096, "max_state_slots": 16, "max_running_requests": 2}
    assert hyla_main(["sim", str(path), "--engine", json.dumps({**options, "max_queued_requests": 1})]) == 2
    assert ("the 4 requests arriving at ts=0 (one batch) can never fit: the engine holds at most 3 at once "
            "(max_running_requests=2 + max_queued_requests=1)") in capsys.readouterr().err
    assert hyla_main(["sim", str(path), "--engine", json.dumps({**options, "max_queued_requests": 2})]) == 0


def test_engine_replay_pools_too_large_for_host_memory_exit_2(tmp_path, capsys, monkeypatch):
    """Pools whose free lists (an entry per id) the host cannot allocate (``max_total_tokens`` of 10^12:
    8 TB) exit 2 with a message, not a MemoryError traceback. (The allocation is simulated: a machine that
    overcommits memory would grant it and be killed filling it.)"""
    from hyla.sim import replay

    def out_of_memory(*args, **kwargs):
        raise MemoryError("Unable to allocate 7.28 TiB for an array with shape (1000000000000,)")

    monkeypatch.setattr(replay, "replay_engine", out_of_memory)
    rc = hyla_main(["sim", str(_trace(tmp_path)), "--engine", json.dumps({"max_total_tokens": 10**12,
                                                                          "max_state_slots": 16})])
    err = capsys.readouterr().err
    assert rc == 2 and "out of host memory for the accounting pools" in err and "Traceback" not in err


@pytest.mark.parametrize("model, tokens, message", [
    ("nemotron-h-8b", [1, 2, 2**40], "input_tokens has token id 1099511627776, outside the model's vocabulary "
                                     "[0, 131072)"),
    ("nemotron-h-8b", [1, 2, 131072], "outside the model's vocabulary [0, 131072)"),
    ("marconi-7b", [1, 2, 2**40], "the model gives no vocab_size"),
])
def test_engine_replay_refuses_token_ids_outside_the_vocabulary(tmp_path, capsys, model, tokens, message):
    path = tmp_path / "big.jsonl"
    write_trace(path, [TraceRequest(0, 0, 0.0, [1, 2, 3], [5, 6]), TraceRequest(0, 1, 1.0, tokens, [5])])
    assert hyla_main(["sim", str(path), "--model", model, "--engine", ENGINE]) == 2
    err = capsys.readouterr().err
    assert "request (session 0, turn 1)" in err and message in err, err
    assert hyla_main(["sim", str(path), "--model", model, "--no-progress"]) == 0  # the policy simulator: any id


def test_negative_token_ids_name_the_line(tmp_path, capsys):
    path = tmp_path / "neg.jsonl"
    path.write_text('{"session_id":0,"turn_id":0,"ts":0,"input_tokens":[1,2,-7],"output_tokens":[3]}\n')
    for extra in ([], ["--engine", ENGINE]):
        assert hyla_main(["sim", str(path), "--no-progress", *extra]) == 2
        assert f"{path}:1: input_tokens must be non-negative token ids, got -7" in capsys.readouterr().err


def test_a_model_config_that_is_not_an_object_exits_2(tmp_path, capsys):
    (tmp_path / "config.json").write_text("[1]")
    assert hyla_main(["sim", str(_trace(tmp_path)), "--model", str(tmp_path), "--no-progress"]) == 2
    assert "a model config is a JSON object, got list" in capsys.readouterr().err
