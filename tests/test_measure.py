"""dilated_attn.cli.measure, the toolkit `dilated-attn bench` and the scripts in benchmarks/ measure with: timing,
seeded inputs, the call to time, records, number formats. Its GPU timing runs in test_cli.py's GPU test."""

import csv
import functools
import json
import os
import subprocess
import time

import pytest
import torch

import dilated_attn
from dilated_attn.cli import measure


def test_median_ms_times_after_warmup_with_hooks():
    calls = []
    ms = measure.median_ms(lambda: calls.append("run") or sum(range(10_000)), "cpu", warmup=2, repeats=5,
                           before_run=lambda: calls.append("before"))
    assert ms > 0 and calls == ["before", "run"] * 7  # every run, warm-up included, after its hook
    # combine maps the run times before the median, as bench_ring takes the slowest rank's
    assert measure.median_ms(lambda: None, "cpu", warmup=0, repeats=3, combine=lambda t: [7.0, 1.0, 7.0]) == 7.0
    with pytest.raises(ValueError, match="repeats must be a positive integer, got 0"):
        measure.median_ms(lambda: None, "cpu", warmup=0, repeats=0)
    assert measure.peak_memory_bytes(lambda: None, "cpu") is None
    start = time.perf_counter()
    measure.settle_clock("cpu", seconds=30)  # nothing to settle on the CPU: returns at once
    assert time.perf_counter() - start < 1.0
    # each round starts one provider further along, so none is always first or always after the same one
    assert list(measure.in_turn({"a": 1, "b": 2, "c": 3}, 4)) == list("abc" "bca" "cab" "abc")
    assert list(measure.in_turn([], 3)) == []


def test_random_inputs_are_seeded_and_gqa_shaped():
    a = measure.random_inputs(2, 24, 4, 8, kv_heads=2, dtype=torch.float64, seed=3)
    b = measure.random_inputs(2, 24, 4, 8, kv_heads=2, dtype=torch.float64, seed=3)
    assert [tuple(x.shape) for x in a] == [(2, 24, 4, 8), (2, 24, 2, 8), (2, 24, 2, 8), (2, 24, 4, 8)]
    assert all(x.requires_grad for x in a[:3]) and not a.grad_out.requires_grad
    assert all(torch.equal(x, y) for x, y in zip(a, b)) and a.q.dtype == torch.float64
    with pytest.raises(ValueError, match="mode must be 'fwd' or 'fwd\\+bwd', got 'back'"):
        measure.attention_call(lambda q, k, v: q, a, "back")



def test_record_rewrites_json_and_csv_after_every_row(tmp_path):
    jpath, cpath = tmp_path / "r" / "rows.json", tmp_path / "rows.csv"
    record = measure.Record("unit", "cpu", dict(size=1), json_path=str(jpath), csv_path=str(cpath), extra="x")
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



def test_host_ms_times_until_the_call_returns():
    """host_ms: the median of the runs' times until the call returns, with the call made once per run."""
    calls = []

    def call():
        calls.append(1)
        time.sleep(0.002 * len(calls))  # 2, 4 and 6 ms: the median is the second

    ms = measure.host_ms(call, "cpu", repeats=3)
    assert len(calls) == 3 and 3.9 <= ms < 6


def test_format_ms_keeps_four_digits_without_exponents():
    """Benchmark times print alike at every size: no `1160.` and no `1.668e+04`."""
    assert [measure.format_ms(x) for x in (16680.4, 1160.2, 999.96, 72.346, 1.6, 0.43101)] == [
        "16680", "1160", "1000", "72.35", "1.600", "0.4310"]


def test_gpu_state_reads_nvidia_smi_by_uuid(monkeypatch):
    """gpu_state asks nvidia-smi for the device by UUID (CUDA's numbering follows CUDA_VISIBLE_DEVICES), parses its
    CSV (the clock-event reasons as a hex mask, "[N/A]" left out), falls back to the fields an older driver knows,
    and gives {} where nvidia-smi is missing; GpuSampler summarises a round's readings. On the CPU: nothing."""
    assert measure.gpu_state("cpu") == {}
    with measure.GpuSampler("cpu") as sampler:
        pass
    assert sampler.summary() == {}

    class Props:
        uuid = "58bd63f5-0000-1111-2222-333344445555"

    asked = []

    def smi(args, **kwargs):
        asked.append(args)
        query = args[1]
        if "clocks_event_reasons" in query and len(asked) == 1:  # an older driver: the reasons are unknown
            return subprocess.CompletedProcess(args, 2, "", "Field not valid")
        answer = "1755, 612.40, 61, 0x0000000000000004" if "clocks_event_reasons" in query else "1980, [N/A], 55"
        return subprocess.CompletedProcess(args, 0, answer + "\n", "")

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: Props())
    monkeypatch.setattr(subprocess, "run", smi)
    monkeypatch.setattr(measure, "_SMI_FIELDS", None)
    # a fresh cache of the UUIDs, which monkeypatch puts back: the fake UUID must not outlive the test
    monkeypatch.setattr(measure, "_smi_id", functools.lru_cache(maxsize=None)(measure._smi_id.__wrapped__))
    assert measure.gpu_state("cuda:0") == {"sm_clock_mhz": 1980.0, "temperature_c": 55.0}
    assert asked[0][-2:] == ["-i", "GPU-58bd63f5-0000-1111-2222-333344445555"]
    assert "clocks_event_reasons" not in asked[1][1]
    monkeypatch.setattr(measure, "_SMI_FIELDS", None)  # a driver that knows the reasons
    assert measure.gpu_state("cuda:0") == {"sm_clock_mhz": 1755.0, "power_w": 612.4, "temperature_c": 61.0,
                                                "clock_event_reasons": 4}
    with measure.GpuSampler("cuda:0", interval=0.01) as sampler:  # reads on its thread until the block ends
        time.sleep(0.1)
    assert sampler.summary()["samples"] >= 2 and sampler.summary()["clock_event_reasons"] == "0x4"

    def missing(args, **kwargs):
        raise FileNotFoundError("nvidia-smi")

    monkeypatch.setattr(subprocess, "run", missing)
    monkeypatch.setattr(measure, "_SMI_FIELDS", None)
    assert measure.gpu_state("cuda:0") == {}

    sampler = measure.GpuSampler("cpu")
    sampler.samples = [dict(sm_clock_mhz=1700.0, power_w=600.0, clock_event_reasons=4),
                       dict(sm_clock_mhz=1900.0, power_w=500.0, clock_event_reasons=0x20),
                       dict(sm_clock_mhz=1800.0, power_w=550.0)]
    assert sampler.summary() == {"sm_clock_mhz": 1800.0, "power_w": 550.0, "clock_event_reasons": "0x24",
                                 "samples": 3}


def _ring_model(monkeypatch):
    """benchmarks/ring_model.py as a module (it imports bench_ring beside it)."""
    import importlib.util
    import os

    here = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
    monkeypatch.syspath_prepend(here)
    spec = importlib.util.spec_from_file_location("ring_model", os.path.join(here, "ring_model.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_ring_model_fits_packs_placed_whole(monkeypatch):
    """ring_model's documents fit: from runs made by its own form (TP = T1/P * balance * (1 + e) + c) at two GPU
    counts it recovers e and c and reproduces both; from one count c is 0 and the run is reproduced; a projection
    never beats the layout's balance."""
    rm = _ring_model(monkeypatch)
    lengths = [1024, 16384, 2048, 12288, 4096, 9216, 15360, 3072, 6144, 11264, 8192, 13312, 5120, 7168, 10240, 6144]
    base = dict(preset="packed", mode="documents", N=sum(lengths), t1_N=sum(lengths), causal=False, lengths=lengths,
                branches=[[2048, 1], [4096, 2], [8192, 4], [16384, 8]])
    t1, e, c = 25.0, 0.05, 0.3
    runs = []
    for P in (2, 4):
        balance = rm.placement(lengths, base, P)[0]
        tp = t1 / P * balance * (1 + e) + c
        row = dict(base, P=P, **{f"tp_{n}_ms": tp for n, _ in rm.PASSES},
                   **{f"efficiency_{n}": t1 / (P * tp) for n, _ in rm.PASSES})
        runs.append(dict(results=[row]))
    fit = rm.calibrate_documents(runs)[("packed", "strong", "fwd")]
    assert fit["e"] == pytest.approx(e) and fit["c"] == pytest.approx(c)
    assert all(m == pytest.approx(x) for m, x in fit["reproduced"].values()) and set(fit["reproduced"]) == {2, 4}
    one = rm.calibrate_documents(runs[:1])[("packed", "strong", "fwd_bwd")]
    assert one["c"] == 0 and all(m == pytest.approx(x) for m, x in one["reproduced"].values())
    for P in (2, 8, 16):
        out = rm.project_documents(fit, P)
        assert out["balance"] >= 1 and out["efficiency"] <= 1 / (out["balance"] * (1 + e)) + 1e-12
        assert 0 <= out["shared_rows"] <= 1
