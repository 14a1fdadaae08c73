"""`python -m dilated_attn` (console script `dilated-attn`): environment report, self-check, benchmark.

    python -m dilated_attn          # all three: env, check, then a short benchmark sized for the device
    python -m dilated_attn env      # python, torch, CUDA, GPUs, triton, build_info(), backend verdicts
    python -m dilated_attn check    # every backend that can run here against the float64 reference
    python -m dilated_attn bench --seq-len 16384 65536 --mode both --json out.json --plot out.png

Exit status: 0 when all is well, 1 when a self-check fails, 2 for bad arguments (argparse's errors, and
attention configurations the package rejects, with its ValueError message).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import platform
import statistics
import sys
import time
from datetime import datetime, timezone

import torch

from . import __version__, build_info, dispatch
from .backends import verdicts as backend_verdicts
from .backends import triton as triton_backend
from .functional import dilated_attention
from .reference import dilated_attention_reference
from .spec import BACKEND_NAMES, flops, validate

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32, "float64": torch.float64}
MODES = {"fwd": ("fwd",), "fwdbwd": ("fwd+bwd",), "both": ("fwd", "fwd+bwd")}

# Benchmark sizes when no flag says otherwise. GPU: the LongNet configuration every GPU number in the README
# uses. CPU: small enough that the whole default run (env, check, bench of cpu and reference) takes ~10 s
# on 2 cores.
BENCH_DEFAULTS = {
    "cuda": dict(batch=1, seq_len=[65536], heads=16, head_dim=128, segment_lengths=[2048, 4096, 8192, 16384],
                 dilation_rates=[1, 2, 4, 8], dtype="bfloat16", warmup=3, repeats=10),
    "cpu": dict(batch=1, seq_len=[4096], heads=8, head_dim=64, segment_lengths=[512, 1024, 2048],
                dilation_rates=[1, 2, 4], dtype="float32", warmup=1, repeats=3),
}

# The self-check problem: GQA, an N no segment length divides, a segment longer than N (256 > 203), a head
# dim that is not a power of two (the padded paths of the kernels), and with head_groups="split" positions
# no branch covers. Every branch has at most 64 members per segment: one Triton autotuning bucket, so a
# GPU's first check compiles few kernels.
CHECK_SHAPE = dict(batch=2, seq_len=203, heads=4, kv_heads=2, head_dim=40)
CHECK_BRANCHES = ([64, 128, 256], [1, 2, 4])
CHECK_CASES = (dict(causal=False, head_groups="all"), dict(causal=True, head_groups="split"))
CHECK_DTYPES = ("float32", "bfloat16")


def say(*parts) -> None:
    print(*parts, flush=True)  # flushed: progress must show as it happens, also through a pipe


def default_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def use_device(device: torch.device) -> torch.device:
    """Makes a GPU the current device: CUDA events, memory statistics and kernel launches follow it."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def placeholder(shape, dtype, device) -> torch.Tensor:
    """A tensor of `shape` backed by one element: enough for validation and backend verdicts, no memory."""
    return torch.empty((), dtype=dtype, device=device).expand(shape)


def problem_of(device, dtype, batch, seq_len, heads, kv_heads, head_dim, segment_lengths, dilation_rates, **kwargs):
    """The package's validated Problem for these sizes (raises its ValueError/TypeError for invalid ones)."""
    q = placeholder((batch, seq_len, heads, head_dim), dtype, device)
    kv = placeholder((batch, seq_len, kv_heads, head_dim), dtype, device)
    return validate(q, kv, kv, segment_lengths, dilation_rates, **kwargs)


def device_backends(p) -> list[str]:
    """The backends that apply to p's device (those the auto rule would consider), in dispatch's order. Triton
    on CPU tensors (its interpreter, a test tool) is left out unless asked for by name."""
    return [name for name in BACKEND_NAMES if name in dispatch.auto_preference(p)]


# --- env ------------------------------------------------------------------------------------------------


def environment(device: torch.device | None = None) -> dict:
    """What this process runs with, as plain data (printed by `env`, stored in the benchmark JSON)."""
    device = device or default_device()
    try:
        import triton

        triton_version, triton_error = triton.__version__, None
    except Exception as exc:  # noqa: BLE001 - missing, or broken on this machine: report why
        triton_version, triton_error = None, f"{type(exc).__name__}: {exc}"
    gpus = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            gpus.append(dict(index=i, name=props.name, capability=f"{props.major}.{props.minor}",
                             memory_gib=round(props.total_memory / 2**30, 1)))
    dtype = DTYPES[BENCH_DEFAULTS[device.type]["dtype"]]
    p = problem_of(device, dtype, 1, 1, 1, 1, 64, [1], [1])
    return dict(
        dilated_attn=dict(version=__version__, path=os.path.dirname(os.path.abspath(__file__))),
        python=dict(version=platform.python_version(), executable=sys.executable),
        platform=platform.platform(),
        cpu_threads=torch.get_num_threads(),
        torch=torch.__version__,
        torch_cuda=torch.version.cuda,
        cuda_available=torch.cuda.is_available(),
        gpus=gpus,
        triton=triton_version,
        triton_error=triton_error,
        # Why the triton backend is unavailable even where triton itself imports (None if it loaded).
        triton_backend_error=triton_backend.load_error() if triton_version else None,
        build_info=build_info(),
        variables={k: os.environ[k] for k in ("DILATED_ATTN_BACKEND", "TRITON_INTERPRET",
                                              "DILATED_ATTN_TRITON_AUTOTUNE", "CUDA_VISIBLE_DEVICES")
                   if k in os.environ},
        verdicts=dict(device=str(device), dtype=dtype_name(dtype), head_dim=64, backends=backend_verdicts(p)),
    )


def print_environment(env: dict) -> None:
    say(f"dilated_attn {env['dilated_attn']['version']} ({env['dilated_attn']['path']})")
    say(f"  python       {env['python']['version']} ({env['python']['executable']})")
    say(f"  platform     {env['platform']}; {env['cpu_threads']} CPU threads")
    say(f"  torch        {env['torch']} (CUDA build: {env['torch_cuda'] or 'none'})")
    if env["gpus"]:
        for g in env["gpus"]:
            say(f"  GPU {g['index']}        {g['name']}, compute capability {g['capability']}, {g['memory_gib']} GiB")
    else:
        say("  CUDA         not available")
    if env["triton"]:
        why = env["triton_backend_error"]
        note = f" (the triton backend did not load: {why})" if why else ""
        say(f"  triton       {env['triton']}{note}")
    else:
        say(f"  triton       not available ({env['triton_error']})")
    say(f"  build_info   {', '.join(f'{k}={v}' for k, v in env['build_info'].items())}")
    for name, value in env["variables"].items():
        say(f"  {name}={value}")
    v = env["verdicts"]
    say(f"  backends for {v['device']} {v['dtype']} tensors:")
    for name, why in v["backends"].items():
        say(f"    {name:<10} {'can run' if why is None else why}")


# --- check ----------------------------------------------------------------------------------------------


def tolerance(dtype: torch.dtype, device: torch.device) -> float:
    """Largest error a backend may show against the float64 reference, relative to the largest reference
    entry (at least 1): a few roundings of the dtype. bf16/fp16 kernels round the probabilities to the dtype
    before the second matmul, as flash attention does; float32 matmuls on a GPU that allows TF32 carry
    TF32's 10-bit mantissa."""
    if dtype == torch.float32 and device.type == "cuda" and torch.backends.cuda.matmul.allow_tf32:
        return 5e-3
    return {torch.float64: 1e-9, torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 5e-2}[dtype]


def _outputs(fn, inputs, grad_out, grad_lse) -> dict:
    """out, lse and the gradients of <out, grad_out> + <lse, grad_lse> (over covered positions), in float64."""
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    out, lse = fn(*leaves)
    loss = (out.double() * grad_out).sum() + (lse.double().masked_fill(~torch.isfinite(lse), 0) * grad_lse).sum()
    grads = torch.autograd.grad(loss, leaves)
    return dict(out=out.double(), lse=lse.double(), **{f"d{n}": g.double() for n, g in zip("qkv", grads)})


def _worst_error(got: dict, ref: dict) -> tuple[float, str]:
    """The largest error over out, lse and the gradients, each relative to its largest reference entry."""
    errors = {}
    for name, r in ref.items():
        g = got[name]
        if name == "lse":  # -inf where no branch covers a position: must match exactly, compare the rest
            covered = torch.isfinite(r)
            if not torch.equal(covered, torch.isfinite(g)):
                errors[name] = math.inf
                continue
            g, r = g[covered], r[covered]
        err = (g - r).abs().max().item() / max(1.0, r.abs().max().item()) if r.numel() else 0.0
        errors[name] = math.inf if math.isnan(err) else err
    name = max(errors, key=errors.get)
    return errors[name], name


def self_check(device: torch.device, dtypes=CHECK_DTYPES, backends=None) -> list[dict]:
    """Runs every backend that applies to `device` (or those named) on a small random problem, forward and
    backward, against dilated_attention_reference in float64, and prints PASS/FAIL/SKIP per backend, dtype
    and case. Returns the rows."""
    s = CHECK_SHAPE
    branches = ", ".join(f"({w}, {r})" for w, r in zip(*CHECK_BRANCHES))
    say(f"self-check against the float64 reference: B={s['batch']} N={s['seq_len']} Hq={s['heads']} "
        f"Hkv={s['kv_heads']} D={s['head_dim']}, branches {branches}; forward and backward on {device}")
    if device.type == "cuda":
        # Triton caches compiled kernels on disk; on a cold cache each new kernel takes seconds to compile
        # (float32 ones up to a minute), so a first run is slow without anything being wrong.
        say("  (the first run on a machine compiles the Triton kernels: allow a few minutes)")
    say(f"  {'backend':<10} {'dtype':<9} {'case':<18} {'max error':>9} {'(where)':<7} {'tolerance':>9}  result")
    gen = torch.Generator().manual_seed(0)
    rows = []
    for case in CHECK_CASES:
        label = f"{'causal' if case['causal'] else 'non-causal'}, {case['head_groups']}"
        # Drawn once in float64 on the CPU, so that every dtype and backend starts from the same numbers.
        q, k, v = (torch.randn(s["batch"], s["seq_len"], h, s["head_dim"], generator=gen, dtype=torch.float64)
                   for h in (s["heads"], s["kv_heads"], s["kv_heads"]))
        grad_out = torch.randn(q.shape, generator=gen, dtype=torch.float64).to(device)
        grad_lse = torch.randn(s["batch"], s["heads"], s["seq_len"], generator=gen, dtype=torch.float64).to(device)
        for name_of_dtype in dtypes:
            dtype = DTYPES[name_of_dtype]
            inputs = [x.to(device, dtype) for x in (q, k, v)]
            # The truth: the reference in float64 on the same (rounded) inputs.
            ref = _outputs(lambda *x: dilated_attention_reference(*x, *CHECK_BRANCHES, **case),
                           [x.double() for x in inputs], grad_out, grad_lse)
            p = validate(*inputs, *CHECK_BRANCHES, **case)
            found = backend_verdicts(p)
            tol = tolerance(dtype, device)
            for name in backends or device_backends(p):
                row = dict(backend=name, dtype=name_of_dtype, case=label, tolerance=tol)
                if found[name] is not None:
                    rows.append(dict(row, result="SKIP", reason=found[name]))
                    say(f"  {name:<10} {name_of_dtype:<9} {label:<18} SKIP: {found[name]}")
                    continue
                try:
                    got = _outputs(lambda *x: dilated_attention(*x, *CHECK_BRANCHES, **case, return_lse=True,
                                                                backend=name), inputs, grad_out, grad_lse)
                except Exception as exc:  # noqa: BLE001 - a backend that crashes fails; the others still run
                    rows.append(dict(row, result="FAIL", reason=f"{type(exc).__name__}: {exc}"))
                    say(f"  {name:<10} {name_of_dtype:<9} {label:<18} FAIL: raised {type(exc).__name__}: {exc}")
                    continue
                err, where = _worst_error(got, ref)
                result = "PASS" if err <= tol else "FAIL"
                rows.append(dict(row, result=result, error=err, where=where))
                say(f"  {name:<10} {name_of_dtype:<9} {label:<18} {err:9.2e} {'(' + where + ')':<7} {tol:9.1e}  "
                    f"{result}")
    failed = sum(r["result"] == "FAIL" for r in rows)
    passed = sum(r["result"] == "PASS" for r in rows)
    say(f"self-check: {passed} passed, {failed} failed, {len(rows) - passed - failed} skipped")
    return rows


# --- bench ----------------------------------------------------------------------------------------------


def time_ms(fn, device: torch.device, warmup: int, repeats: int) -> float:
    """Median milliseconds of `fn()` over `repeats` runs after `warmup` runs: CUDA events on a GPU (no host
    synchronisation inside the timed region), time.perf_counter on the CPU (its ops are synchronous)."""
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeats)]
        for start, end in events:
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize(device)
        times = [start.elapsed_time(end) for start, end in events]
    else:
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def peak_memory_mib(fn, device: torch.device) -> float:
    """Peak memory allocated during one call of `fn`, above what was allocated before it (the inputs)."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    fn()
    torch.cuda.synchronize(device)
    return (torch.cuda.max_memory_allocated(device) - base) / 2**20


def _call(q, k, v, grad, cfg, backend, mode):
    def forward():
        with torch.no_grad():
            dilated_attention(q, k, v, cfg["segment_lengths"], cfg["dilation_rates"], causal=cfg["causal"],
                              backend=backend)

    def forward_backward():
        out = dilated_attention(q, k, v, cfg["segment_lengths"], cfg["dilation_rates"], causal=cfg["causal"],
                                backend=backend)
        torch.autograd.grad(out, (q, k, v), grad)

    return forward if mode == "fwd" else forward_backward


def plan(cfg: dict, backends) -> tuple[dict[int, list[str]], dict[str, str]]:
    """Validates the configuration at every N before anything runs, and picks the backends: those named
    (each must be able to run, else the package's ValueError saying why), or all that apply to the device
    and can run. Returns ({N: backends}, {backend passed over: why})."""
    out, skipped = {}, {}
    sizes = {k: cfg[k] for k in ("device", "dtype", "batch", "heads", "kv_heads", "head_dim", "segment_lengths",
                                 "dilation_rates", "causal")}
    for n in cfg["seq_len"]:
        p = problem_of(seq_len=n, **sizes)
        if backends:
            for name in backends:
                decision = dispatch.decide(p, name)
                if decision.error:
                    raise ValueError(decision.error)
            out[n] = list(backends)
            continue
        found = backend_verdicts(p)
        out[n] = [name for name in device_backends(p) if found[name] is None]
        skipped.update({name: found[name] for name in device_backends(p) if found[name] is not None})
    return out, skipped


def describe(cfg: dict) -> str:
    """A benchmark configuration in one line (dtype as a name or a torch.dtype)."""
    branches = ", ".join(f"({w}, {r})" for w, r in zip(cfg["segment_lengths"], cfg["dilation_rates"]))
    heads = f"Hq={cfg['heads']} Hkv={cfg['kv_heads']}" if "kv_heads" in cfg else f"H={cfg['heads']}"
    return (f"B={cfg['batch']} N={'/'.join(map(str, cfg['seq_len']))} {heads} D={cfg['head_dim']} "
            f"{str(cfg['dtype']).removeprefix('torch.')}, branches {branches}"
            f"{', causal' if cfg.get('causal') else ''}; "
            f"medians of {cfg['repeats']} after {cfg['warmup']} warm-up")


def print_bench_header(cfg: dict) -> None:
    timing = "CUDA events" if cfg["device"].type == "cuda" else "time.perf_counter"
    say(f"benchmark on {cfg['device_name']}: {describe(cfg)} ({timing})")


def bench(cfg: dict, backends_at: dict[int, list[str]]) -> list[dict]:
    """Times every planned (N, backend, mode); prints one line per measurement as it finishes, then a table.
    Returns the rows (the JSON/CSV records)."""
    device, dtype = cfg["device"], cfg["dtype"]
    rows = []
    for n, backends in backends_at.items():
        gen = torch.Generator(device=device).manual_seed(0)
        q = torch.randn(cfg["batch"], n, cfg["heads"], cfg["head_dim"], generator=gen, device=device, dtype=dtype)
        k, v = (torch.randn(cfg["batch"], n, cfg["kv_heads"], cfg["head_dim"], generator=gen, device=device,
                            dtype=dtype) for _ in range(2))
        q, k, v = (x.requires_grad_() for x in (q, k, v))
        grad = torch.randn(q.shape, generator=gen, device=device, dtype=dtype)
        p = validate(q, k, v, cfg["segment_lengths"], cfg["dilation_rates"], causal=cfg["causal"])
        for name in backends:
            for mode in MODES[cfg["mode"]]:
                fn = _call(q, k, v, grad, cfg, name, mode)
                try:
                    ms = time_ms(fn, device, cfg["warmup"], cfg["repeats"])
                    mem = peak_memory_mib(fn, device) if device.type == "cuda" else None
                except torch.OutOfMemoryError:  # e.g. the reference at a large N: report it, go on
                    say(f"  N={n:>7} {name:<10} {mode:<8}: out of memory, skipped")
                    torch.cuda.empty_cache()
                    continue
                tflops = flops(p, backward=mode == "fwd+bwd") / ms / 1e9
                rows.append(dict(N=n, batch=cfg["batch"], heads=cfg["heads"], kv_heads=cfg["kv_heads"],
                                 head_dim=cfg["head_dim"], dtype=dtype_name(dtype),
                                 segment_lengths=cfg["segment_lengths"], dilation_rates=cfg["dilation_rates"],
                                 causal=cfg["causal"], provider=name, mode=mode, median_ms=ms, tflops=tflops,
                                 peak_memory_mib=mem))
                extra = f"  peak {mem:.0f} MiB" if mem is not None else ""
                say(f"  N={n:>7} {name:<10} {mode:<8}: {ms:#10.4g} ms  {tflops:8.3g} TFLOP/s{extra}")
        del q, k, v, grad
        if device.type == "cuda":
            torch.cuda.empty_cache()
    reference = {(r["N"], r["mode"]): r["median_ms"] for r in rows if r["provider"] == "reference"}
    for r in rows:
        ref = reference.get((r["N"], r["mode"]))
        r["speedup_over_reference"] = ref / r["median_ms"] if ref else None
    print_table(rows)
    return rows


def print_table(rows: list[dict]) -> None:
    def cell(n, name, mode, key, fmt):
        for r in rows:
            if (r["N"], r["provider"], r["mode"]) == (n, name, mode) and r[key] is not None:
                return format(r[key], fmt)
        return "-"

    header = (f"{'N':>7}  {'backend':<10} {'fwd ms':>9} {'fwd+bwd ms':>10} {'TFLOP/s fwd':>11} "
              f"{'TFLOP/s f+b':>11} {'peak MiB':>8} {'vs ref fwd':>10} {'vs ref f+b':>10}")
    say(header)
    seen = []
    for r in rows:
        if (r["N"], r["provider"]) in seen:
            continue
        seen.append((r["N"], r["provider"]))
        n, name = r["N"], r["provider"]
        peaks = [x["peak_memory_mib"] for x in rows if (x["N"], x["provider"]) == (n, name)
                 and x["peak_memory_mib"] is not None]
        say(f"{n:>7}  {name:<10} {cell(n, name, 'fwd', 'median_ms', '#.4g'):>9} "
            f"{cell(n, name, 'fwd+bwd', 'median_ms', '#.4g'):>10} {cell(n, name, 'fwd', 'tflops', '.3g'):>11} "
            f"{cell(n, name, 'fwd+bwd', 'tflops', '.3g'):>11} {format(max(peaks), '.0f') if peaks else '-':>8} "
            f"{cell(n, name, 'fwd', 'speedup_over_reference', '.2f'):>10} "
            f"{cell(n, name, 'fwd+bwd', 'speedup_over_reference', '.2f'):>10}")
    say("  (TFLOP/s from dilated_attn.spec.flops; peak MiB: CUDA only, the most allocated above the inputs "
        "during one call; vs ref: the reference backend's time over this backend's)")


def write_json(path: str, cfg: dict, rows: list[dict], env: dict, command: str) -> None:
    config = {k: v for k, v in cfg.items() if k not in ("device", "dtype")}
    config.update(device=str(cfg["device"]), dtype=dtype_name(cfg["dtype"]))
    record = dict(benchmark="python -m dilated_attn bench", command=command,
                  date=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                  device=dict(name=cfg["device_name"], type=cfg["device"].type), config=config,
                  environment=env, results=rows)
    _makedirs_for(path)
    with open(path, "w") as f:
        json.dump(record, f, indent=2)
    say(f"wrote {path}")


def write_csv(path: str, rows: list[dict]) -> None:
    _makedirs_for(path)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else ["N", "provider", "mode", "median_ms"])
        writer.writeheader()
        for r in rows:  # branch lists as "2048 4096", one cell each
            writer.writerow({k: " ".join(map(str, v)) if isinstance(v, list) else v for k, v in r.items()})
    say(f"wrote {path}")


def _makedirs_for(path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)


# --- plots (also used by benchmarks/plot_results.py) --------------------------------------------------------

METRICS = {"tflops": "TFLOP/s", "median_ms": "time (ms)"}


def matplotlib_missing() -> str | None:
    """None if matplotlib imports, else an error message naming it."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        return f"plotting needs matplotlib, which is not importable here ({exc}); pip install matplotlib"
    return None


def plot_rows(rows: list[dict], path: str, metric: str = "tflops", title: str | None = None) -> None:
    """One panel per mode (fwd, fwd+bwd), `metric` against N, a line per provider (its causal rows dashed, in
    the same colour). Rows need N, provider, mode and the metric (the format of bench_gpu.py and of `bench`)."""
    import matplotlib
    from matplotlib.figure import Figure  # no pyplot: no global state, no display needed

    modes = [m for m in ("fwd", "fwd+bwd") if any(r["mode"] == m for r in rows)]
    providers = list(dict.fromkeys(r["provider"] for r in rows))
    colours = matplotlib.colormaps["tab10"]
    ns = sorted({r["N"] for r in rows})
    fig = Figure(figsize=(5.5 * len(modes) + 2.5, 4.5), layout="constrained")
    for ax, mode in zip(fig.subplots(1, len(modes), squeeze=False)[0], modes):
        series: dict[tuple, list] = {}
        for r in rows:
            if r["mode"] == mode and r.get(metric) is not None:
                series.setdefault((r["provider"], bool(r.get("causal"))), []).append((r["N"], r[metric]))
        for (provider, causal), points in sorted(series.items(), key=lambda kv: (providers.index(kv[0][0]), kv[0][1])):
            ax.plot(*zip(*sorted(points)), color=colours(providers.index(provider) % 10),
                    linestyle="--" if causal else "-", marker="s" if causal else "o",
                    label=provider + (" (causal)" if causal else ""))
        ax.set_xscale("log", base=2)
        ax.set_xticks(ns, labels=[str(n) for n in ns])
        ax.minorticks_off()
        if metric == "median_ms":
            ax.set_yscale("log")
        ax.set(xlabel="sequence length N", ylabel=METRICS[metric],
               title="forward" if mode == "fwd" else "forward + backward")
        ax.grid(alpha=0.3)
    # One legend for both panels, outside them: the union of their lines, in the order drawn.
    handles = {}
    for ax in fig.axes:
        for line in ax.get_lines():
            handles.setdefault(line.get_label(), line)
    fig.legend(list(handles.values()), list(handles), loc="outside right upper", fontsize="small")
    # Say so when N values come with different branch sets, since a line then joins different configurations.
    branch_sets: dict[str, set] = {}
    for r in rows:
        key = ", ".join(f"({w},{d})" for w, d in zip(r.get("segment_lengths", ()), r.get("dilation_rates", ())))
        branch_sets.setdefault(key, set()).add(r["N"])
    if len(branch_sets) > 1:
        fig.supxlabel("branches (w,r): " + "; ".join(f"N={'/'.join(map(str, sorted(n)))}: {key}"
                                                     for key, n in branch_sets.items()), fontsize="small")
    if title:
        fig.suptitle(title)
    _makedirs_for(path)
    fig.savefig(path, dpi=110)


# --- command line ---------------------------------------------------------------------------------------


def _int_at_least(minimum: int, rule: str):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {rule}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be {rule}, got {value}")
        return value

    return parse


positive_int = _int_at_least(1, "a positive integer")
non_negative_int = _int_at_least(0, "an integer >= 0")


def device_arg(text: str) -> torch.device:
    try:
        device = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"must be cpu or cuda[:index], got {text!r}") from None
    if device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"must be cpu or cuda[:index], got {text!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"{text!r}: CUDA is not available (torch {torch.__version__}, CUDA build: "
                                         f"{torch.version.cuda or 'none'})")
    if device.type == "cuda" and device.index is None:  # torch.cuda.set_device needs an index
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type == "cuda" and device.index >= torch.cuda.device_count():
        raise argparse.ArgumentTypeError(f"{text!r}: there are {torch.cuda.device_count()} GPUs")
    return device


def build_parser() -> argparse.ArgumentParser:
    script = bool(sys.argv) and sys.argv[0].endswith("dilated-attn")  # the console script, else python -m
    prog = os.path.basename(sys.argv[0]) if script else "python -m dilated_attn"
    parser = argparse.ArgumentParser(prog=prog, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.set_defaults(command=None, fail=parser.error)
    sub = parser.add_subparsers(title="commands", metavar="{env,check,bench}")
    env = sub.add_parser("env", help="report the environment and what each backend can run")
    env.add_argument("--device", type=device_arg, default=None,
                     help="device for the verdicts (default: cuda if available, else cpu)")
    env.set_defaults(command="env")
    check = sub.add_parser("check", help="self-check every backend that can run here against the reference")
    check.add_argument("--device", type=device_arg, default=None, help="default: cuda if available, else cpu")
    check.add_argument("--dtype", nargs="+", choices=list(DTYPES), default=list(CHECK_DTYPES), dest="dtypes")
    check.add_argument("--backends", nargs="+", choices=BACKEND_NAMES, default=None,
                       help="default: every backend that applies to the device")
    check.set_defaults(command="check", fail=check.error)
    b = sub.add_parser("bench", help="time backends (defaults: a size suited to the device)",
                       description="Times backends forward and forward+backward. Flags left out take the device's "
                                   "defaults: " + "; ".join(f"{d}: {describe(c)}" for d, c in BENCH_DEFAULTS.items()))
    b.add_argument("--device", type=device_arg, default=None, help="default: cuda if available, else cpu")
    b.add_argument("--batch", type=positive_int)
    b.add_argument("--seq-len", type=positive_int, nargs="+", help="one or more sequence lengths N")
    b.add_argument("--heads", type=positive_int, help="query heads")
    b.add_argument("--kv-heads", type=positive_int, help="key/value heads (default: --heads)")
    b.add_argument("--head-dim", type=positive_int)
    b.add_argument("--segment-lengths", type=int, nargs="+", help="w of each branch (with --dilation-rates)")
    b.add_argument("--dilation-rates", type=int, nargs="+", help="r of each branch (with --segment-lengths)")
    b.add_argument("--dtype", choices=list(DTYPES))
    b.add_argument("--causal", action="store_true")
    b.add_argument("--mode", choices=list(MODES), default="both")
    b.add_argument("--backends", nargs="+", choices=BACKEND_NAMES,
                   help="default: every backend that applies to the device and can run")
    b.add_argument("--repeats", type=positive_int)
    b.add_argument("--warmup", type=non_negative_int)
    b.add_argument("--json", metavar="PATH", help="write the rows, configuration and environment as JSON")
    b.add_argument("--csv", metavar="PATH", help="write the rows as CSV")
    b.add_argument("--plot", metavar="FILE.png", help="plot the metric against N per backend (needs matplotlib)")
    b.add_argument("--plot-metric", choices=["tflops", "ms"], default="tflops")
    b.set_defaults(command="bench", fail=b.error)
    return parser


def bench_config(args) -> dict:
    """The benchmark's configuration: the flags given, the device's defaults for the rest."""
    device = args.device or default_device()
    defaults = BENCH_DEFAULTS[device.type]
    if (args.segment_lengths is None) != (args.dilation_rates is None):
        args.fail("--segment-lengths and --dilation-rates go together: give both or neither")
    cfg = {key: getattr(args, key) if getattr(args, key) is not None else value for key, value in defaults.items()}
    cfg.update(device=device, dtype=DTYPES[cfg["dtype"]], kv_heads=args.kv_heads or cfg["heads"],
               causal=args.causal, mode=args.mode)
    cfg["device_name"] = (torch.cuda.get_device_name(device) if device.type == "cuda"
                          else f"CPU ({torch.get_num_threads()} threads)")
    return cfg


def run_bench(args, env=None) -> list[dict]:
    if args.plot and matplotlib_missing():  # before a long run, not after it
        args.fail(f"--plot: {matplotlib_missing()}")
    cfg = bench_config(args)
    use_device(cfg["device"])
    try:
        backends_at, skipped = plan(cfg, args.backends)
    except (ValueError, TypeError) as exc:  # the package's own message for an invalid configuration
        args.fail(str(exc))
    print_bench_header(cfg)
    for name, why in skipped.items():
        say(f"  {name}: skipped ({why})")
    rows = bench(cfg, backends_at)
    if args.json:
        write_json(args.json, cfg, rows, env or environment(cfg["device"]), args.command_line)
    if args.csv:
        write_csv(args.csv, rows)
    if args.plot:
        metric = "median_ms" if args.plot_metric == "ms" else "tflops"
        title = (f"{cfg['device_name']}, {dtype_name(cfg['dtype'])}, B={cfg['batch']} H={cfg['heads']} "
                 f"D={cfg['head_dim']}")
        plot_rows(rows, args.plot, metric, title)
        say(f"wrote {args.plot}")
    return rows


def main(argv=None) -> int:
    try:
        return _main(argv)
    except BrokenPipeError:  # output piped into `head` and the like: stop quietly (recipe of the Python docs)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


def _main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    args.command_line = " ".join(["python -m dilated_attn", *argv])
    if args.command == "env":
        print_environment(environment(args.device or default_device()))
        return 0
    if args.command == "check":
        rows = self_check(use_device(args.device or default_device()), args.dtypes, args.backends)
        return 1 if any(r["result"] == "FAIL" for r in rows) else 0
    if args.command == "bench":
        run_bench(args)
        return 0
    # No command: all three, the benchmark at the device's default size.
    device = default_device()
    env = environment(device)
    print_environment(env)
    say()
    rows = self_check(device)
    say()
    bench_args = parser.parse_args(["bench"])
    bench_args.command_line = args.command_line
    run_bench(bench_args, env)
    return 1 if any(r["result"] == "FAIL" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
