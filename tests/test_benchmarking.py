"""dilated_attn.benchmarking, the library `dilated-attn bench` and the scripts in benchmarks/ measure with: timing,
seeded inputs, the call to time, records, number formats. Its GPU timing runs in test_cli.py's GPU test."""

import csv
import json
import os
import time

import pytest
import torch

import dilated_attn
from dilated_attn import benchmarking


def test_median_ms_times_after_warmup_with_hooks():
    calls = []
    ms = benchmarking.median_ms(lambda: calls.append("run") or sum(range(10_000)), "cpu", warmup=2, repeats=5,
                           before_run=lambda: calls.append("before"))
    assert ms > 0 and calls == ["before", "run"] * 7  # every run, warm-up included, after its hook
    # combine maps the run times before the median, as bench_ring takes the slowest rank's
    assert benchmarking.median_ms(lambda: None, "cpu", warmup=0, repeats=3, combine=lambda t: [7.0, 1.0, 7.0]) == 7.0
    with pytest.raises(ValueError, match="repeats must be a positive integer, got 0"):
        benchmarking.median_ms(lambda: None, "cpu", warmup=0, repeats=0)
    assert benchmarking.peak_memory_bytes(lambda: None, "cpu") is None
    start = time.perf_counter()
    benchmarking.settle_clock("cpu", seconds=30)  # nothing to settle on the CPU: returns at once
    assert time.perf_counter() - start < 1.0
    # each round starts one provider further along, so none is always first or always after the same one
    assert list(benchmarking.in_turn({"a": 1, "b": 2, "c": 3}, 4)) == list("abc" "bca" "cab" "abc")
    assert list(benchmarking.in_turn([], 3)) == []


def test_random_inputs_are_seeded_and_gqa_shaped():
    a = benchmarking.random_inputs(2, 24, 4, 8, kv_heads=2, dtype=torch.float64, seed=3)
    b = benchmarking.random_inputs(2, 24, 4, 8, kv_heads=2, dtype=torch.float64, seed=3)
    assert [tuple(x.shape) for x in a] == [(2, 24, 4, 8), (2, 24, 2, 8), (2, 24, 2, 8), (2, 24, 4, 8)]
    assert all(x.requires_grad for x in a[:3]) and not a.grad_out.requires_grad
    assert all(torch.equal(x, y) for x, y in zip(a, b)) and a.q.dtype == torch.float64
    with pytest.raises(ValueError, match="mode must be 'fwd' or 'fwd\\+bwd', got 'back'"):
        benchmarking.attention_call(lambda q, k, v: q, a, "back")



def test_record_rewrites_json_and_csv_after_every_row(tmp_path):
    jpath, cpath = tmp_path / "r" / "rows.json", tmp_path / "rows.csv"
    record = benchmarking.Record("unit", "cpu", dict(size=1), json_path=str(jpath), csv_path=str(cpath), extra="x")
    data = json.loads(jpath.read_text())  # written at once, with no rows yet
    assert {"benchmark", "command", "date", "device", "versions", "config", "extra", "results"} <= set(data)
    assert data["results"] == [] and data["versions"]["dilated_attn"] == dilated_attn.__version__
    assert data["device"]["type"] == "cpu" and data["date"].endswith("+00:00")
    for n in (1, 2):
        record.add(dict(N=n, provider="p", segment_lengths=[4, 8]))
        assert [r["N"] for r in json.loads(jpath.read_text())["results"]] == list(range(1, n + 1))
        with open(cpath) as f:
            assert [row["N"] for row in csv.DictReader(f)] == [str(i) for i in range(1, n + 1)]
    record.set(summary=0.5)
    assert json.loads(jpath.read_text())["summary"] == 0.5
    assert sorted(os.listdir(tmp_path / "r")) == ["rows.json"]  # no temporary file left behind



def test_format_ms_keeps_four_digits_without_exponents():
    """Benchmark times print alike at every size: no `1160.` and no `1.668e+04`."""
    assert [benchmarking.format_ms(x) for x in (16680.4, 1160.2, 999.96, 72.346, 1.6, 0.43101)] == [
        "16680", "1160", "1000", "72.35", "1.600", "0.4310"]
