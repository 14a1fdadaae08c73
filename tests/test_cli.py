"""The `dilated-attn` command (dilated_attn.cli, with its self-check dilated_attn.cli.check and its bench run
dilated_attn.cli.bench) and benchmarks/plot_results.py, at tiny sizes."""

import csv
import dataclasses
import importlib.util
import json
import os
import resource
import subprocess
import sys
import time

import pytest
import torch

import dilated_attn
from dilated_attn import backends, cli
from dilated_attn.cli import bench, check, measure
from dilated_attn.cli.measure import flops
from dilated_attn.spec import Problem, validate
from dilated_attn.warmup import fa4_families, prepare_cudnn, warmup_fa4

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Tiny sizes: N values no segment length divides, GQA, two branches.
TINY = ["--device", "cpu", "--batch", "1", "--seq-len", "40", "72", "--heads", "4", "--kv-heads", "2",
        "--head-dim", "16", "--segment-lengths", "16", "32", "--dilation-rates", "1", "2", "--repeats", "2",
        "--warmup", "0"]


def has_matplotlib():
    return importlib.util.find_spec("matplotlib") is not None


def test_default_run_completes_within_a_minute_of_two_cores():
    # In a subprocess, as a user runs it, with the package this test imported; GPUs hidden, so that this is
    # the CPU-sized run everywhere (test_check_and_bench_on_gpu covers the GPU paths).
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.dirname(dilated_attn.__file__)),
                                           os.environ.get("PYTHONPATH", "")]))
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "dilated_attn"], capture_output=True, text=True, env=env,
                          timeout=300, cwd=ROOT)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    for expected in ("torch", "build_info", "self-check:", "0 failed", "PASS", "TFLOP/s f+b", "vs ref"):
        assert expected in out, (expected, out)
    assert "Traceback" not in proc.stderr
    # CPU seconds rather than wall time, so that other processes sharing the machine do not make this flaky:
    # under a minute on 2 cores is at most 120 CPU seconds.
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    print(f"default run: {wall:.1f} s wall, {cpu:.1f} s CPU")
    assert cpu < 120, f"default run took {cpu:.0f} CPU seconds ({wall:.0f} s wall)"


@pytest.mark.gpu
def test_check_and_bench_on_gpu(tmp_path, capsys):
    assert cli.main(["check", "--device", "cuda", "--dtype", "bfloat16", "float32"]) == 0
    out = capsys.readouterr().out
    assert "0 failed" in out and "reference  bfloat16" in out
    # cudnn on its own problem: bfloat16 checked wherever it can run it, float32 skipped with its reason
    device = torch.device("cuda", torch.cuda.current_device())
    why = backends.CUDNN.why_not(check.check_problems(device, ["bfloat16"], "cudnn")[0])
    cudnn_bf16 = [line for line in out.splitlines() if line.startswith("  cudnn      bfloat16")]
    assert len(cudnn_bf16) == 2 and all(line.endswith("PASS" if why is None else why) for line in cudnn_bf16)
    assert "cudnn      float32   non-causal, all    SKIP: " in out
    # fa4 on its own problem where flash-attn-4 is installed and runs here, else one line saying why not
    why = backends.FA4.why_not(check.check_problems(device, ["bfloat16"], "fa4")[0])
    fa4_bf16 = [line for line in out.splitlines() if line.startswith("  fa4        bfloat16")]
    if why is None:
        assert len(fa4_bf16) == 2 and all(line.endswith("PASS") for line in fa4_bf16), out
    elif backends.FA4.unavailable():
        assert f"  fa4: not checked: {backends.FA4.unavailable()}" in out
    path = tmp_path / "gpu.json"
    tiny = [flag if flag != "cpu" else "cuda" for flag in TINY]
    assert cli.main(["bench", *tiny, "--dtype", "bfloat16", "--json", str(path)]) == 0
    rows = json.loads(path.read_text())["results"]
    assert {r["provider"] for r in rows} >= {"reference"}
    assert all(r["peak_memory_mib"] is not None and r["median_ms"] > 0 for r in rows)
    x = torch.randn(1 << 20, device="cuda")
    assert measure.median_ms(lambda: x.mul(2), "cuda", warmup=1, repeats=5) > 0
    assert measure.peak_memory_bytes(lambda: x.mul(2), "cuda") >= x.numel() * 4


def test_env(capsys):
    assert cli.main(["env", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert f"dilated_attn {dilated_attn.__version__}" in out and torch.__version__ in out
    assert "build_info   loaded=" in out
    assert "cpu        can run" in out  # the verdicts of dilated_attn.dispatch


def test_check_passes_on_cpu(capsys):
    assert cli.main(["check", "--device", "cpu", "--dtype", "float32", "float64"]) == 0
    out = capsys.readouterr().out
    assert out.count("PASS") == 8  # (cpu, reference) x 2 dtypes x 2 cases
    assert "self-check: 8 passed, 0 failed, 0 skipped" in out
    assert "cudnn" not in out  # it applies to CUDA tensors only, like triton


def _cudnn_on_cpu(monkeypatch) -> list:
    """The cudnn backend made to apply to CPU tensors, its forward the cpu backend's: returns a list with, per
    call, its problem and the gradients its out and LSE received in the backward."""
    calls = []

    def forward(q, k, v, p):
        out, lse = backends.CPU.forward(q, k, v, p)
        call = dict(problem=p, grad_out=[], grad_lse=[])
        calls.append(call)
        for x, grads in ((out, call["grad_out"]), (lse, call["grad_lse"])) if out.requires_grad else ():
            x.register_hook(lambda g, grads=grads: grads.append(g) if g is not None else None)  # None: no gradient
        return out, lse

    monkeypatch.setattr(backends.CUDNN, "supported_device_types", lambda: ("cuda", "cpu"))
    monkeypatch.setattr(backends.CUDNN, "unavailable", lambda: None)
    monkeypatch.setattr(backends.CUDNN, "forward", forward)
    return calls


def test_check_runs_cudnn_on_its_own_problem_where_it_applies(capsys, monkeypatch):
    """Where the cudnn backend applies to the device (CUDA tensors; here the CPU, made to), the check runs it on a
    problem it takes, with no LSE term in the loss (so that cuDNN's backward runs), and skips float32 with the
    backend's reason."""
    calls = _cudnn_on_cpu(monkeypatch)
    assert cli.main(["check", "--device", "cpu", "--dtype", "float32", "bfloat16"]) == 0
    out = capsys.readouterr().out
    assert ("  cudnn on a problem it takes: B=2 N=448 Hq=4 Hkv=2 D=64, branches (64, 1), (128, 2), (256, 4), no LSE "
            "term") in out
    for case in ("non-causal, all   ", "causal, split     "):
        assert f"cudnn      float32   {case} SKIP: dtype float32 is not supported (supported: float16, bfloat16)" in out
        assert any(line.startswith(f"  cudnn      bfloat16  {case}") and line.endswith("PASS")
                   for line in out.splitlines())
    assert "self-check: 10 passed, 0 failed, 2 skipped" in out  # (cpu, reference) x 2 x 2, then cudnn's
    assert [(c["problem"].seq_len, c["problem"].num_kv_heads, c["problem"].causal) for c in calls] == [
        (448, 2, False), (448, 2, True)]
    assert all(c["grad_out"] and not c["grad_lse"] for c in calls)  # the LSE had no gradient


def test_check_named_cudnn_runs_its_problem_only(capsys, monkeypatch):
    _cudnn_on_cpu(monkeypatch)
    assert cli.main(["check", "--device", "cpu", "--dtype", "bfloat16", "--backends", "cudnn"]) == 0
    out = capsys.readouterr().out
    assert "self-check against the float64 reference: B=2 N=448 Hq=4 Hkv=2 D=64, branches" in out
    assert out.count("PASS") == 2 and "self-check: 2 passed, 0 failed, 0 skipped" in out
    # float32 named: refused with its reason before anything runs
    assert cli.main(["check", "--device", "cpu", "--dtype", "float32", "--backends", "cudnn"]) == cli.EXIT_CANNOT_RUN
    assert "backend 'cudnn' cannot run here: dtype float32 is not supported" in capsys.readouterr().err


def test_check_runs_fa4_on_its_own_problem_with_the_lse_term(capsys, monkeypatch):
    """Where the fa4 backend applies (here a stand-in on the CPU, its forward the cpu backend's), the check runs it on
    its own problem with the LSE term (its backward takes the LSE's gradient): the main problem is too small for the
    auto rule to reach it, and auto runs it from a benchmark's sizes on."""
    calls = []

    def forward(q, k, v, p):
        out, lse = backends.CPU.forward(q, k, v, p)
        calls.append(lse.requires_grad)
        return out, lse

    monkeypatch.setattr(backends.FA4, "supported_device_types", lambda: ("cuda", "cpu"))
    monkeypatch.setattr(backends.FA4, "unavailable", lambda: None)
    monkeypatch.setattr(backends.FA4, "extra_reasons", lambda p: [])
    monkeypatch.setattr(backends.FA4, "forward", forward)
    assert cli.main(["check", "--device", "cpu", "--dtype", "float32", "bfloat16"]) == 0
    out = capsys.readouterr().out
    assert "  fa4 on a problem it takes: B=2 N=448 Hq=4 Hkv=2 D=64, branches (64, 1), (128, 2), (256, 4)\n" in out
    assert sum(line.startswith("  fa4        bfloat16") and line.endswith("PASS") for line in out.splitlines()) == 2
    assert calls == [True, True]


def test_check_says_in_one_line_that_fa4_is_not_installed(capsys, monkeypatch):
    monkeypatch.setattr(backends.FA4, "supported_device_types", lambda: ("cuda", "cpu"))
    monkeypatch.setattr(backends.FA4, "unavailable", lambda: "flash-attn-4 is not installed (`pip install --no-build-isolation .[fa4]`)")
    monkeypatch.setattr(backends.FA4, "extra_reasons", lambda p: [])
    assert cli.main(["check", "--device", "cpu", "--dtype", "float32", "bfloat16"]) == 0
    out = capsys.readouterr().out
    assert [line for line in out.splitlines() if "fa4" in line] == [
        "  fa4: not checked: flash-attn-4 is not installed (`pip install --no-build-isolation .[fa4]`)"]


def test_a_backend_that_failed_the_check_is_not_timed(capsys):
    args = cli.build_parser().parse_args(["bench", *TINY, "--backends", "cpu", "reference"])
    args.command_line = "test"
    assert cli.bench_command(args, failed=frozenset({"cpu"})) == 0
    out = capsys.readouterr().out
    assert "  cpu: not timed (it failed the self-check above)" in out
    assert "reference" in out and not any(line.lstrip().startswith("cpu ") for line in out.splitlines())


def test_check_failure_gives_exit_status_1(capsys, monkeypatch):
    # nothing can pass: a bound below every error (positive, as the worst output is the largest error / bound)
    monkeypatch.setattr(check, "allowed_error", lambda *args, **kwargs: 1e-30)
    assert cli.main(["check", "--device", "cpu", "--dtype", "float32", "--backends", "cpu"]) == 1
    assert "FAIL" in capsys.readouterr().out


def test_check_reports_a_backend_that_raises_as_failed(capsys, monkeypatch):
    def broken(q, k, v, p):
        raise RuntimeError("kernel exploded")

    monkeypatch.setattr(backends.CPU, "forward", broken)
    assert cli.main(["check", "--device", "cpu", "--dtype", "float32"]) == 1
    out = capsys.readouterr().out
    assert "FAIL: raised RuntimeError: kernel exploded" in out and "reference  float32   causal, split" in out


def test_check_refuses_a_named_backend_that_cannot_run(capsys):
    # Named: a failure with the package's reason, before anything runs (the same status as `bench`).
    status = cli.main(["check", "--device", "cpu", "--dtype", "float32", "--backends", "cuda", "cpu", "cudnn"])
    assert status == cli.EXIT_CANNOT_RUN == 3
    captured = capsys.readouterr()
    assert "check: error: backend 'cuda' cannot run here: needs CUDA tensors, got cpu" in captured.err
    assert "check: error: backend 'cudnn' cannot run here: needs CUDA tensors, got cpu" in captured.err
    assert "PASS" not in captured.out


def test_check_skips_backends_not_named_that_cannot_run(capsys, monkeypatch):
    monkeypatch.setattr(backends.CPU, "why_not", lambda p: "switched off for this test")
    assert cli.main(["check", "--device", "cpu", "--dtype", "float32"]) == 0
    out = capsys.readouterr().out
    assert "cpu        float32   non-causal, all    SKIP: switched off for this test" in out
    assert "self-check: 2 passed, 0 failed, 2 skipped" in out


def test_bench_refuses_a_named_backend_that_cannot_run(capsys):
    assert cli.main(["bench", *TINY, "--backends", "cpu", "cuda"]) == cli.EXIT_CANNOT_RUN
    captured = capsys.readouterr()
    # as argparse reports errors: the program's name first
    assert " bench: error: backend 'cuda' cannot run here: needs CUDA tensors, got cpu" in captured.err
    assert "N=" not in captured.out  # refused before anything was timed


@pytest.mark.skipif(backends.TRITON.unavailable() is not None or os.environ.get("TRITON_INTERPRET") != "1",
                    reason="needs triton under its interpreter (TRITON_INTERPRET=1, set by conftest without a GPU)")
def test_check_triton_interpreted(capsys, monkeypatch):
    # A smaller problem and one case: the interpreter takes ~20 s on the full check.
    monkeypatch.setattr(check, "CHECK_SHAPE", dict(batch=1, seq_len=75, heads=4, kv_heads=2, head_dim=16))
    monkeypatch.setattr(check, "CHECK_CASES", (dict(causal=True, head_groups="split"),))
    assert cli.main(["check", "--device", "cpu", "--dtype", "float32", "--backends", "triton"]) == 0
    assert capsys.readouterr().out.count("PASS") == 1


def test_bench_json_and_csv(tmp_path, capsys):
    jpath, cpath = tmp_path / "out" / "bench.json", tmp_path / "bench.csv"
    assert cli.main(["bench", *TINY, "--json", str(jpath), "--csv", str(cpath)]) == 0
    out = capsys.readouterr().out
    assert out.count("\n  N=") == 8  # one progress line per measurement: 2 N x (cpu, reference) x (fwd, fwd+bwd)
    record = json.loads(jpath.read_text())
    rows = record["results"]
    assert {(r["N"], r["provider"], r["mode"]) for r in rows} == {
        (n, b, m) for n in (40, 72) for b in ("cpu", "reference") for m in ("fwd", "fwd+bwd")}
    assert record["config"]["dtype"] == "float32" and record["environment"]["build_info"] == dilated_attn.build_info()
    for r in rows:
        q = torch.empty(1, r["N"], 4, 16)
        kv = torch.empty(1, r["N"], 2, 16)
        p = validate(q, kv, kv, [16, 32], [1, 2])
        assert r["tflops"] == pytest.approx(flops(p, backward=r["mode"] == "fwd+bwd") / r["median_ms"] / 1e9)
        assert r["median_ms"] > 0 and r["peak_memory_mib"] is None
        assert r["min_ms"] <= r["median_ms"] <= r["max_ms"] and r["runs"] >= 1
        if r["provider"] == "reference":
            assert r["speedup_over_reference"] == 1.0
    with open(cpath) as f:
        table = list(csv.DictReader(f))
    assert [(int(t["N"]), t["provider"], t["mode"]) for t in table] == [
        (r["N"], r["provider"], r["mode"]) for r in rows]
    assert [float(t["median_ms"]) for t in table] == pytest.approx([r["median_ms"] for r in rows])
    assert table[0]["segment_lengths"] == "16 32"


def test_bench_forward_only_one_backend(capsys):
    assert cli.main(["bench", *TINY, "--mode", "fwd", "--backends", "cpu", "--causal"]) == 0
    out = capsys.readouterr().out
    assert out.count("\n  N=") == 2 and "fwd+bwd :" not in out and ", causal;" in out


@pytest.mark.parametrize("flags, message", [
    (["--segment-lengths", "16", "0", "--dilation-rates", "1", "2"],
     "segment_lengths[1] must be a positive integer, got 0"),
    (["--segment-lengths", "16", "32", "--dilation-rates", "1"],
     "segment_lengths and dilation_rates must have the same length"),
    (["--heads", "6", "--kv-heads", "4"], "q heads (6) must be a multiple of k/v heads (4)"),
])
def test_invalid_configuration_exits_2_with_the_package_message(flags, message, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "--device", "cpu", "--seq-len", "64", *flags])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


# a small training run's shapes for `warmup --backend fa4`
FA4_SHAPES = ["--seq-len", "1024", "--heads", "4", "--segment-lengths", "256", "512", "--dilation-rates", "1", "2"]


@pytest.mark.parametrize("command, flags, message", [
    ("bench", ["--heads", "0"], "argument --heads: must be a positive integer, got 0"),
    ("bench", ["--seq-len", "x"], "argument --seq-len: must be a positive integer, got 'x'"),
    ("bench", ["--mode", "back"], "argument --mode: invalid choice"),
    ("bench", ["--dtype", "int8"], "argument --dtype: invalid choice"),
    ("bench", ["--segment-lengths", "16"], "--segment-lengths and --dilation-rates go together"),
    ("bench", ["--device", "tpu"], "argument --device: must be cpu or cuda[:index]"),
    ("warmup", ["--head-dim", "512"], "argument --head-dim: must be at most 256"),
    ("warmup", ["--dtype", "float64"], "argument --dtype: invalid choice"),
    ("warmup", ["--jobs", "0"], "argument --jobs: must be a positive integer, got 0"),
    ("warmup", ["--causal", "maybe"], "argument --causal: invalid choice"),
    ("warmup", ["--backend", "cudnn"], "argument --backend: invalid choice"),
    ("warmup", ["--seq-len", "1024"], "--seq-len: only with --backend fa4"),
    ("warmup", ["--lse-gradient"], "--lse-gradient: only with --backend fa4"),
    ("warmup", ["--backend", "fa4", "--heads", "4"],
     "--backend fa4 needs --segment-lengths, --dilation-rates and --seq-len or --pack-lengths"),
    ("warmup", ["--backend", "fa4", "--jobs", "2", *FA4_SHAPES], "--jobs: only with --backend triton"),
    ("warmup", ["--backend", "fa4", "--allow-tf32", *FA4_SHAPES], "--allow-tf32: only with --backend triton"),
    ("warmup", ["--backend", "fa4", "--pack-lengths", "0"], "argument --pack-lengths: must be a positive integer"),
    ("warmup", ["--backend", "fa4", *FA4_SHAPES, "--kv-heads", "3"], "q heads (4) must be a multiple of k/v heads (3)"),
    ("warmup", ["--backend", "fa4", *FA4_SHAPES, "--dilation-rates", "1"],
     "segment_lengths and dilation_rates must have the same length, got 2 and 1"),
])
def test_bad_flags_are_argparse_errors(command, flags, message, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main([command, *flags])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the error of a machine without CUDA")
def test_warmup_without_cuda_is_a_clear_error(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["warmup"])
    assert exc.value.code == 2
    assert "warmup compiles the Triton kernels for a CUDA GPU, and CUDA is not available" in capsys.readouterr().err


def test_prepare_cudnn_does_nothing_where_cudnn_does_not_run():
    # CPU tensors (the default device without CUDA): no error, nothing run
    assert prepare_cudnn(1, 256, 4, 64, [64, 128], [1, 2], device="cpu") is False
    assert prepare_cudnn(1, 256, 4, 64, [64, 128], [1, 2], device="cpu", backend="cudnn", backward=False) is False
    if not torch.cuda.is_available():
        assert prepare_cudnn(2, 1024, 8, 128, [256, 512], [1, 2], causal=True) is False
    with pytest.raises(ValueError, match="segment_lengths and dilation_rates must have the same length"):
        prepare_cudnn(1, 256, 4, 64, [64, 128], [1], device="cpu")


def test_prepare_cudnn_runs_forward_and_backward_where_cudnn_runs(monkeypatch):
    calls = _cudnn_on_cpu(monkeypatch)  # cudnn made to run CPU tensors
    # auto does not pick cudnn for CPU tensors: nothing runs
    assert prepare_cudnn(2, 256, 4, 64, [64, 128], [1, 2], device="cpu") is False and not calls
    assert prepare_cudnn(2, 256, 4, 64, [64, 128], [1, 2], device="cpu", backend="cudnn", causal=True) is True
    (call,) = calls
    p = call["problem"]
    assert (p.batch, p.seq_len, p.num_heads, p.head_dim, p.dtype, p.causal) == (2, 256, 4, 64, torch.bfloat16, True)
    assert call["grad_out"] and not call["grad_lse"]  # forward and backward, as a training step without the LSE
    assert prepare_cudnn(2, 256, 4, 64, [64, 128], [1, 2], device="cpu", backend="cudnn", backward=False) is True
    assert not calls[1]["grad_out"]  # forward only
    # what cudnn does not take (float32): nothing, no error
    assert prepare_cudnn(2, 256, 4, 64, [64, 128], [1, 2], device="cpu", backend="cudnn",
                         dtype=torch.float32) is False and len(calls) == 2


@pytest.mark.gpu
def test_prepare_cudnn_on_gpu():
    device = torch.device("cuda", torch.cuda.current_device())
    p = Problem.from_sizes(1, 2048, 8, 8, 64, [512, 1024], [1, 2], dtype=torch.bfloat16, device=device)
    ran = prepare_cudnn(1, 2048, 8, 64, [512, 1024], [1, 2], backend="cudnn")
    assert ran is (backends.CUDNN.why_not(p) is None)


@pytest.mark.gpu
def test_warmup_compiles_each_family(capsys, monkeypatch, tmp_path):
    """A warm-up into an empty Triton cache compiles every family; a second one finds them all cached."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # the spawned workers' cache
    flags = ["warmup", "--dtype", "float16", "--head-dim", "40", "--causal", "true", "--jobs", "2"]
    assert cli.main(flags) == 0
    first = capsys.readouterr().out
    assert "1/1 float16 D=40 causal" in first and " 0 kernels compiled" not in first
    assert cli.main(flags) == 0
    assert " 0 kernels compiled" in capsys.readouterr().out


def test_fa4_warmup_without_flash_attn_4_exits_3(capsys, monkeypatch):
    """Where flash-attn-4 is not installed, `warmup --backend fa4` says so, as a backend that cannot run, before
    anything runs (on any device)."""
    from dilated_attn.backends import fa4

    monkeypatch.setattr(fa4, "_installed", lambda: False)
    assert cli.main(["warmup", "--backend", "fa4", *FA4_SHAPES]) == cli.EXIT_CANNOT_RUN
    out, err = capsys.readouterr()
    assert "error: backend 'fa4' cannot run here: flash-attn-4 is not installed (`pip install --no-build-isolation .[fa4]`)" in err
    assert not out and "Traceback" not in err
    with pytest.raises(RuntimeError, match="the fa4 backend cannot run: flash-attn-4 is not installed"):
        warmup_fa4(fa4_families("cpu", heads=4, segment_lengths=[256], dilation_rates=[1], seq_lens=[256]))


def test_fa4_families_are_the_training_shapes():
    families = fa4_families("cpu", heads=8, kv_heads=2, segment_lengths=[256, 512], dilation_rates=[1, 2],
                            seq_lens=[512, 1024], pack_lengths=[300, 700], batch=4, dtypes=["float16", torch.bfloat16],
                            head_dims=[64], causal=[True], head_groups="split")
    assert [f.describe() for f in families] == [
        "float16 D=64 causal B=4 N=512", "float16 D=64 causal B=4 N=1024",
        "float16 D=64 causal pack of 2 sequences (1000 tokens)",
        "bfloat16 D=64 causal B=4 N=512", "bfloat16 D=64 causal B=4 N=1024",
        "bfloat16 D=64 causal pack of 2 sequences (1000 tokens)"]
    p = families[2].problem  # a pack: one sequence of its longest length, for the rules of its calls
    assert (p.batch, p.seq_len, p.num_heads, p.num_kv_heads, p.head_groups) == (1, 700, 8, 2, "split")
    with pytest.raises(ValueError, match="seq_lens or pack_lengths must give at least one shape"):
        fa4_families("cpu", heads=4, segment_lengths=[256], dilation_rates=[1])
    with pytest.raises(ValueError, match=r"pack_lengths must be positive integers, got \[300, 0\]"):
        fa4_families("cpu", heads=4, segment_lengths=[256], dilation_rates=[1], pack_lengths=[300, 0])


def test_warmup_fa4_reports_each_family_and_the_kernels_it_cached(monkeypatch, tmp_path):
    """Each family is one line: the files it added to FlashAttention-4's cache (an export not yet renamed into
    place is not one), or its error, after which the others go on."""
    from dilated_attn import warmup as warm
    from dilated_attn.backends import FA4

    for name in ("unavailable", "ops"):
        monkeypatch.setattr(FA4, name, lambda: None)
    monkeypatch.setattr(FA4, "why_not", lambda p: None)
    monkeypatch.setattr(warm, "_fa4_cache", lambda: tmp_path)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "a GPU")
    ran = []

    def run(family, lse_gradient):
        ran.append(lse_gradient)
        if family.pack:
            raise RuntimeError("no such kernel")
        (tmp_path / "fp" / "fwd").mkdir(parents=True, exist_ok=True)
        for name in (f"{len(ran)}a.o", f"{len(ran)}b.o", f".{len(ran)}.123.tmp.o"):
            (tmp_path / "fp" / "fwd" / name).write_bytes(b"\0")

    monkeypatch.setattr(warm, "_run_fa4", run)
    lines = []
    families = fa4_families("cpu", heads=4, segment_lengths=[256], dilation_rates=[1], seq_lens=[256],
                            pack_lengths=[100, 156], causal=[False])
    results = warmup_fa4(families, lse_gradient=True, say=lines.append)
    assert ran == [True, True]
    assert [(compiled, error) for _, _, compiled, error in results] == [(2, None), (0, "RuntimeError: no such kernel")]
    assert lines[0].endswith(f"; kernels cached in {tmp_path}") and lines[1] == "warming 2 fa4 families on a GPU"
    assert "1/2 bfloat16 D=128 B=1 N=256: 2 kernels compiled" in lines[2]
    assert "2/2 bfloat16 D=128 pack of 2 sequences (256 tokens): FAILED: RuntimeError: no such kernel" in lines[3]
    assert lines[4].startswith("done in ")


@pytest.mark.gpu
def test_fa4_warmup_fills_the_cache_that_another_process_finds(tmp_path):
    """`warmup --backend fa4` compiles into DILATED_ATTN_FA4_CACHE; a second process, as a training run would be,
    finds every kernel there and compiles none."""
    why = backends.FA4.unavailable()
    if why is not None:
        pytest.skip(why)
    if torch.cuda.get_device_capability()[0] not in (9, 10, 11):
        pytest.skip("FlashAttention-4 runs on Hopper and Blackwell")
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLASH_ATTENTION_CUTE_DSL_CACHE")}
    env.update(DILATED_ATTN_FA4_CACHE=str(tmp_path), PYTHONUNBUFFERED="1")
    command = [sys.executable, "-m", "dilated_attn", "warmup", "--backend", "fa4", "--dtype", "bfloat16",
               "--head-dim", "64", "--causal", "true", "--heads", "4", "--kv-heads", "2",
               "--segment-lengths", "256", "512", "--dilation-rates", "1", "2", "--seq-len", "1024",
               "--pack-lengths", "300", "724"]

    def run_warmup():
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout, sorted(tmp_path.rglob("*.o"))

    first, files = run_warmup()
    assert f"kernels cached in {tmp_path}" in first and files
    assert first.count(" kernels compiled, ") == 2 and " 0 kernels compiled" not in first, first
    second, again = run_warmup()
    assert second.count(" 0 kernels compiled, ") == 2, second
    assert again == files


def test_interrupted_bench_keeps_the_rows_it_measured(tmp_path, monkeypatch):
    timed = measure.run_times_ms

    def interrupted_at_the_third(fn, *args, **kwargs):
        if len(calls) == 2:
            raise KeyboardInterrupt
        calls.append(1)
        return timed(fn, *args, **kwargs)

    calls = []
    monkeypatch.setattr(bench, "run_times_ms", interrupted_at_the_third)  # as run_bench looks it up
    path = tmp_path / "bench.json"
    with pytest.raises(KeyboardInterrupt):
        cli.main(["bench", *TINY, "--json", str(path)])
    rows = json.loads(path.read_text())["results"]
    assert [(r["N"], r["provider"], r["mode"]) for r in rows] == [(40, "cpu", "fwd"), (40, "cpu", "fwd+bwd")]


@pytest.mark.skipif(not has_matplotlib(), reason="matplotlib is not installed")
def test_bench_plot(tmp_path):
    png = tmp_path / "plot.png"
    assert cli.main(["bench", *TINY, "--plot", str(png), "--plot-metric", "ms"]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_is_a_clear_error(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` raise ImportError
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", *TINY, "--plot", "x.png"])
    assert exc.value.code == 2 and "matplotlib" in capsys.readouterr().err


@pytest.mark.skipif(not has_matplotlib(), reason="matplotlib is not installed")
def test_plot_results_renders_the_gpu_json_and_the_cli_json(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("plot_results", os.path.join(ROOT, "benchmarks", "plot_results.py"))
    plot_results = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plot_results)
    cli_json = tmp_path / "cli.json"
    assert cli.main(["bench", *TINY, "--mode", "fwd", "--json", str(cli_json)]) == 0
    gpu_json = os.path.join(ROOT, "benchmarks", "results", "gpu_NVIDIA_H100_80GB_HBM3_bfloat16.json")
    written = plot_results.main([gpu_json, str(cli_json), "--out-dir", str(tmp_path / "png")])
    assert [os.path.basename(p) for p in written] == ["gpu_NVIDIA_H100_80GB_HBM3_bfloat16.png", "cli.png"]
    assert all(open(p, "rb").read(4) == b"\x89PNG" for p in written)
    # A JSON of another format, named explicitly: an error naming the file.
    with pytest.raises(SystemExit):
        plot_results.main([os.path.join(ROOT, "benchmarks", "results", "cpu_b1_n8192_h8_d64_float32.json"),
                           "--out-dir", str(tmp_path)])
    assert "cpu_b1_n8192_h8_d64_float32.json: no `results` rows" in capsys.readouterr().err


def test_console_script_entry_point():
    tomllib = pytest.importorskip("tomllib")
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        target = tomllib.load(f)["project"]["scripts"]["dilated-attn"]
    module, func = target.split(":")
    assert module == "dilated_attn.cli" and getattr(cli, func) is cli.main
    assert importlib.import_module("dilated_attn.__main__").main is cli.main  # python -m dilated_attn


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.split()[-1] == dilated_attn.__version__


def test_bench_shows_each_measurements_spread_and_says_when_a_call_is_slow(monkeypatch, capsys):
    """Each line gives the fastest and slowest run beside the median, and a measurement whose first call is slow
    says what it will take before the silence (here every call counts as slow)."""
    monkeypatch.setattr(bench, "SLOW_CALL_S", 0.0)
    assert cli.main(["bench", *TINY, "--backends", "cpu", "--mode", "fwd", "--repeats", "3", "--warmup", "1"]) == 0
    out = capsys.readouterr().out
    assert out.count("a call takes") == 2 and out.count(", 3 runs)") == 2  # one of each per N


def test_help_examples_run_as_given():
    """The module docstring's bench examples (dilated-attn --help) need nothing beyond the install, or say what
    they need (--plot: matplotlib) and what they are sized for."""
    lines = [line for line in cli.__doc__.splitlines() if " bench " in line]
    assert lines and all("--plot" not in line or "matplotlib" in line for line in lines)
    assert any("sized for a GPU" in line for line in lines)


def test_env_names_a_missing_triton_as_not_needed_on_a_cpu(monkeypatch, capsys):
    """Without a GPU, triton's absence is no error: `env` says what needs it instead of printing the import
    error."""
    env = cli.environment(torch.device("cpu"))
    env.update(gpus=[], triton=None, triton_error="ModuleNotFoundError: No module named 'triton'")
    cli.print_environment(env)
    out = capsys.readouterr().out
    assert "triton       not installed (only the triton backend, for CUDA GPUs, needs it)" in out
    assert "ModuleNotFoundError" not in out


def test_check_skips_the_dtypes_a_named_backend_cannot_run(capsys, monkeypatch):
    """A named backend that can run some of the check's dtypes runs those and SKIPs the others with its reason (as
    `TRITON_INTERPRET=1 check --backends triton` skips bfloat16, which the interpreter computes wrongly)."""
    monkeypatch.setattr(backends.CPU, "extra_reasons", lambda p: ["no float64 today"] if p.dtype == torch.float64
                        else [])
    assert cli.main(["check", "--device", "cpu", "--dtype", "float32", "float64", "--backends", "cpu"]) == 0
    out = capsys.readouterr().out
    assert out.count("PASS") == 2 and out.count("SKIP: no float64 today") == 2


def test_triton_interpreter_refuses_bfloat16(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    p = Problem.from_sizes(1, 64, 2, 2, 16, [32], [1], dtype=torch.bfloat16, device="cpu")
    assert "Triton's interpreter (TRITON_INTERPRET=1, for tests) computes bfloat16 wrongly" in backends.TRITON.why_not(p)
    assert backends.TRITON.why_not(dataclasses.replace(p, dtype=torch.float16)) in (None, backends.TRITON.unavailable())
