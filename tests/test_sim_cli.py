"""`hyla sim` end to end (a trace file, a tiny ShareGPT sweep), sizes, and the sweep summary."""

from __future__ import annotations

import json

import pytest

from hyla.cli import main as hyla_main
from hyla.sim.cli import parse_size
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


def test_parse_size():
    assert parse_size("4GB") == 4 * 10**9
    assert parse_size("1.5GiB") == 3 * 2**29
    assert parse_size("512mb") == 512 * 10**6
    assert parse_size("1000") == 1000
    for bad in ("", "GB", "-1GB", "0", "4 parsecs"):
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
