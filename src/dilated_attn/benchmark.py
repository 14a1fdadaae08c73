"""The benchmark harness: what `dilated-attn bench` and every script in benchmarks/ measure and record with.

    median_ms               median time of a call after warm-up (CUDA events with L2 flushed; time.perf_counter)
    peak_memory_bytes       the most one call allocates on a GPU above what was allocated before it
    random_inputs           seeded q, k, v (requiring grad) and an output gradient, GQA-capable
    attention_call          a forward, or forward and backward, of an attention function, as one call to time
    LONGNET, ...            branch presets (segment_lengths, dilation_rates)
    tflops                  dilated_attn.spec.flops over a time
    device_info, versions   the device and the software a record was measured with
    Record                  a benchmark's JSON (and CSV) file, rewritten after every row
    plot_rows               the plots (matplotlib without pyplot)

and the `bench` command's run: BenchConfig, BENCH_DEFAULTS, plan, run_bench, print_table.
"""

from __future__ import annotations

import contextlib
import csv
import json
import os
import platform
import shlex
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from typing import Callable, NamedTuple, Optional, Sequence

import torch

from . import __version__, backends, dispatch
from .functional import dilated_attention
from .spec import BACKEND_NAMES, Problem, dtype_name, flops, validate

__all__ = [
    "LONGNET", "LONGNET_LONG", "LOCAL2", "DTYPES", "MODES", "BENCH_DEFAULTS", "L2_FLUSH_BYTES",
    "say", "median_ms", "peak_memory_bytes", "Inputs", "random_inputs", "attention_call", "tflops",
    "device_info", "versions", "triton_version", "command_line", "Record", "BenchConfig", "Plan", "plan", "refusals",
    "applicable_backends", "problem_for", "run_bench", "print_table", "plot_rows", "matplotlib_missing",
]

# Branch presets, (segment_lengths, dilation_rates).
LONGNET = ([2048, 4096, 8192, 16384], [1, 2, 4, 8])  # "longnet4" of benchmarks/README.md: w and r double
LONGNET_LONG = ([2048, 8192, 32768, 131072], [1, 4, 16, 64])  # for N >= 262144: w and r grow x4
LOCAL2 = ([512, 1024], [1, 2])  # "local2": two short branches, many small segments

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32, "float64": torch.float64}
# --mode -> the measurements taken: "fwd" (forward under no_grad), "fwd+bwd" (forward and the input gradients)
MODES = {"fwd": ("fwd",), "fwdbwd": ("fwd+bwd",), "both": ("fwd", "fwd+bwd")}

# More than the L2 cache of current GPUs (H100: 50 MB, H200: 60 MB); zeroed before each timed run, as by
# triton.testing.do_bench, so that no run finds its inputs in L2 left there by the run before.
L2_FLUSH_BYTES = 256 * 2**20


def say(*parts) -> None:
    print(*parts, flush=True)  # flushed: progress must show as it happens, also through a pipe


# --- measuring ------------------------------------------------------------------------------------------


def median_ms(fn: Callable[[], object], device: torch.device | str, warmup: int, repeats: int, *,
              before_run: Optional[Callable[[], None]] = None,
              combine: Optional[Callable[[list[float]], Sequence[float]]] = None) -> float:
    """Median milliseconds of `fn()` over `repeats` timed runs after `warmup` untimed ones.

    On a GPU each run is timed by two CUDA events on the current stream, with the L2 cache flushed before it
    and no host synchronisation between runs; on the CPU by time.perf_counter (CPU ops are synchronous).
    The first call of a Triton kernel compiles it (and sweeps its configs under DILATED_ATTN_AUTOTUNE=1): give
    warmup >= 1 on a GPU.

    before_run(): called before every run, warm-up included, outside the timed region (e.g. a barrier and
    a synchronisation, so that all ranks of a process group start together).
    combine(times): maps the list of run times (ms) to the ones whose median is returned (e.g. each run's
    slowest rank, by an all-reduce).
    """
    device = torch.device(device)
    if not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup must be an integer >= 0, got {warmup!r}")
    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be a positive integer, got {repeats!r}")

    def run() -> None:
        if before_run is not None:
            before_run()
        fn()

    for _ in range(warmup):
        run()
    if device.type == "cuda":
        with torch.cuda.device(device):
            flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device=device)
            events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                      for _ in range(repeats)]
            for start, end in events:
                flush.zero_()
                if before_run is not None:
                    before_run()
                start.record()
                fn()
                end.record()
            torch.cuda.synchronize(device)
            times = [start.elapsed_time(end) for start, end in events]
            del flush
    else:
        times = []
        for _ in range(repeats):
            if before_run is not None:
                before_run()
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    if combine is not None:
        times = list(combine(times))
    return statistics.median(times)


def peak_memory_bytes(fn: Callable[[], object], device: torch.device | str) -> Optional[int]:
    """The most memory one call of `fn` has allocated at once on a GPU beyond what was allocated before it
    (outputs, saved tensors, gradients, workspaces), from the CUDA caching allocator's statistics; None on
    the CPU, which keeps none."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    fn()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - base


class Inputs(NamedTuple):
    q: torch.Tensor  # [B, N, Hq, D], requires grad
    k: torch.Tensor  # [B, N, Hkv, D], requires grad
    v: torch.Tensor  # [B, N, Hkv, D], requires grad
    grad_out: torch.Tensor  # [B, N, Hq, D], the output gradient of a backward


def random_inputs(batch: int, seq_len: int, heads: int, head_dim: int, *, kv_heads: Optional[int] = None,
                  dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", seed: int = 0) -> Inputs:
    """Standard-normal q, k, v and output gradient, drawn in that order by a generator on `device` seeded with
    `seed`: the same numbers for every provider timed in a process. kv_heads: default `heads`."""
    device = torch.device(device)
    kv_heads = heads if kv_heads is None else kv_heads
    gen = torch.Generator(device=device).manual_seed(seed)

    def draw(h: int) -> torch.Tensor:
        return torch.randn(batch, seq_len, h, head_dim, generator=gen, device=device, dtype=dtype)

    q, k, v = (draw(h).requires_grad_() for h in (heads, kv_heads, kv_heads))
    return Inputs(q, k, v, draw(heads))


def attention_call(attention: Callable, inputs: Inputs, mode: str) -> Callable[[], None]:
    """The call to time: `attention(q, k, v)` under no_grad (mode "fwd"), or it and the gradients of q, k, v
    for inputs.grad_out (mode "fwd+bwd"). `attention` returns the output, or a tuple led by it."""
    q, k, v, grad_out = inputs
    if mode == "fwd":
        def forward() -> None:
            with torch.no_grad():
                attention(q, k, v)

        return forward
    if mode == "fwd+bwd":
        def forward_backward() -> None:
            out = attention(q, k, v)
            torch.autograd.grad(out[0] if isinstance(out, tuple) else out, (q, k, v), grad_out)

        return forward_backward
    raise ValueError(f"mode must be 'fwd' or 'fwd+bwd', got {mode!r}")


def tflops(p: Problem, ms: float, backward: bool) -> float:
    """TFLOP/s of a run of `p` that took `ms` milliseconds (FLOPs: dilated_attn.spec.flops)."""
    return flops(p, backward=backward) / ms / 1e9


# --- what a record was measured with ------------------------------------------------------------------


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_info(device: torch.device | str) -> dict:
    """The device as plain data: type and name; a GPU's compute capability and memory, a CPU's thread count."""
    device = torch.device(device)
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return dict(type="cuda", name=props.name, capability=f"{props.major}.{props.minor}",
                    memory_gib=round(props.total_memory / 2**30, 1))
    return dict(type=device.type, name=_cpu_model(), threads=torch.get_num_threads(), machine=platform.machine())


def triton_version() -> tuple[Optional[str], Optional[str]]:
    """(triton's version, None), or (None, why it does not import)."""
    try:
        import triton
    except Exception as exc:  # noqa: BLE001 - missing, or broken on this machine: say why
        return None, f"{type(exc).__name__}: {exc}"
    return triton.__version__, None


def versions() -> dict:
    return dict(dilated_attn=__version__, torch=torch.__version__, cuda=torch.version.cuda,
                triton=triton_version()[0], python=platform.python_version())


def command_line() -> str:
    """This process's command, as a shell would take it."""
    return shlex.join(["python", *sys.argv])


# --- records --------------------------------------------------------------------------------------------


def _csv_cell(value):
    if isinstance(value, (list, tuple)):  # branch lists as "2048 4096", one cell each
        return " ".join(map(str, value))
    if isinstance(value, dict):
        return json.dumps(value)
    return value


class Record:
    """A benchmark's results: a JSON file and optionally a CSV of its rows, both rewritten whole (through a
    temporary file and a rename) after every row, so that a run cut short keeps every row it measured.

    The JSON: {benchmark, command, date (UTC, ISO 8601), device (device_info), versions, config, *fields,
    results: [row, ...]}. Paths left None write nothing; the rows are kept all the same.
    """

    def __init__(self, benchmark: str, device: torch.device | str, config: dict, *, json_path: Optional[str] = None,
                 csv_path: Optional[str] = None, command: Optional[str] = None, **fields):
        self.json_path, self.csv_path = json_path, csv_path
        self.data = dict(benchmark=benchmark, command=command or command_line(),
                         date=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                         device=device_info(device), versions=versions(), config=config, **fields)
        self.rows: list[dict] = []
        self.write()  # at once: an unwritable path fails before the run, not after it

    def add(self, row: dict) -> None:
        self.rows.append(row)
        self.write()

    def set(self, **fields) -> None:
        """Adds or replaces top-level fields (summaries, tuned configs) and rewrites the files."""
        self.data.update(fields)
        self.write()

    def write(self) -> None:
        if self.json_path:
            with _replacing(self.json_path) as f:
                json.dump({**self.data, "results": self.rows}, f, indent=2)
        if self.csv_path:
            columns = list(dict.fromkeys(key for row in self.rows for key in row))
            with _replacing(self.csv_path, newline="") as f:
                writer = csv.DictWriter(f, fieldnames=columns)
                writer.writeheader()
                writer.writerows({k: _csv_cell(v) for k, v in row.items()} for row in self.rows)

    def close(self) -> None:
        for path in (self.json_path, self.csv_path):
            if path:
                say(f"wrote {path}")


@contextlib.contextmanager
def _replacing(path: str, **kwargs):
    """open(path, "w"), writing a temporary file beside `path` and renaming it over `path` when done: readers,
    and a run interrupted while writing, find the old file or the new one, never half of one."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp"
    try:
        with open(tmp, "w", **kwargs) as f:
            yield f
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


# --- the `bench` command ----------------------------------------------------------------------------------


@dataclass
class BenchConfig:
    """One `bench` run: the sizes, timed at each N in seq_len."""

    device: torch.device
    dtype: torch.dtype
    batch: int
    seq_len: list[int]
    heads: int
    kv_heads: int
    head_dim: int
    segment_lengths: list[int]
    dilation_rates: list[int]
    causal: bool = False
    mode: str = "both"  # a key of MODES
    warmup: int = 1
    repeats: int = 3

    def as_json(self) -> dict:
        return {**asdict(self), "device": str(self.device), "dtype": dtype_name(self.dtype)}

    def describe(self) -> str:
        branches = ", ".join(f"({w}, {r})" for w, r in zip(self.segment_lengths, self.dilation_rates))
        return (f"B={self.batch} N={'/'.join(map(str, self.seq_len))} Hq={self.heads} Hkv={self.kv_heads} "
                f"D={self.head_dim} {dtype_name(self.dtype)}, branches {branches}{', causal' if self.causal else ''}"
                f"; medians of {self.repeats} after {self.warmup} warm-up")


# The `bench` sizes where no flag says otherwise. GPU: the LongNet configuration of the GPU numbers in the
# README. CPU: small enough that the whole default run (env, check, bench of cpu and reference) takes
# seconds on 2 cores.
BENCH_DEFAULTS = {
    "cuda": dict(batch=1, seq_len=[65536], heads=16, head_dim=128, segment_lengths=LONGNET[0],
                 dilation_rates=LONGNET[1], dtype="bfloat16", warmup=3, repeats=10),
    "cpu": dict(batch=1, seq_len=[4096], heads=8, head_dim=64, segment_lengths=[512, 1024, 2048],
                dilation_rates=[1, 2, 4], dtype="float32", warmup=1, repeats=3),
}


def problem_for(device, dtype, batch, seq_len, heads, kv_heads, head_dim, segment_lengths, dilation_rates,
                **kwargs) -> Problem:
    """The package's validated Problem for these sizes, without allocating them (tensors of one element,
    expanded). Raises the package's ValueError/TypeError for an invalid configuration."""
    def placeholder(h: int) -> torch.Tensor:
        return torch.empty((), dtype=dtype, device=device).expand(batch, seq_len, h, head_dim)

    kv = placeholder(kv_heads)
    return validate(placeholder(heads), kv, kv, segment_lengths, dilation_rates, **kwargs)


def applicable_backends(p: Problem) -> list[str]:
    """The backends for p's device type (those the auto rule considers), in BACKEND_NAMES order. Triton on
    CPU tensors (its interpreter, a test tool) is not among them; it runs there only when named."""
    return [name for name in BACKEND_NAMES if name in dispatch.auto_preference(p)]


def refusals(problems: Sequence[Problem], names: Sequence[str]) -> dict[str, str]:
    """{name: why} for each backend of `names` that cannot run one of `problems` (the first reason each)."""
    refused: dict[str, str] = {}
    for p in problems:
        for name, why in backends.verdicts(p).items():
            if name in names and why is not None:
                refused.setdefault(name, why)
    return refused


class Plan(NamedTuple):
    backends: dict[int, list[str]]  # N -> the backends timed at N
    skipped: dict[str, str]  # a backend not named that cannot run -> why
    refused: dict[str, str]  # a backend named that cannot run -> why (the run must not start)


def plan(cfg: BenchConfig, names: Optional[Sequence[str]] = None) -> Plan:
    """Validates the configuration at every N before anything runs (raising the package's ValueError/TypeError
    for an invalid one) and picks the backends at each N: those named, or every one that applies to the device
    and can run."""
    timed, skipped = {}, {}
    problems = []
    for n in cfg.seq_len:
        p = problem_for(cfg.device, cfg.dtype, cfg.batch, n, cfg.heads, cfg.kv_heads, cfg.head_dim,
                        cfg.segment_lengths, cfg.dilation_rates, causal=cfg.causal)
        problems.append(p)
        if names:
            timed[n] = list(names)
            continue
        found = backends.verdicts(p)
        timed[n] = [name for name in applicable_backends(p) if found[name] is None]
        skipped.update({name: found[name] for name in applicable_backends(p) if found[name] is not None})
    return Plan(timed, skipped, refusals(problems, names or ()))


def run_bench(cfg: BenchConfig, timed: dict[int, list[str]], record: Record) -> list[dict]:
    """Times every planned (N, backend, mode), one line printed per measurement as it finishes and each row
    added to `record` at once. speedup_over_reference is filled in once the reference's time at (N, mode) is
    known. Returns the rows."""
    device = cfg.device
    for n, names in timed.items():
        inputs = random_inputs(cfg.batch, n, cfg.heads, cfg.head_dim, kv_heads=cfg.kv_heads, dtype=cfg.dtype,
                               device=device)
        p = validate(*inputs[:3], cfg.segment_lengths, cfg.dilation_rates, causal=cfg.causal)
        for name in names:
            def attention(q, k, v, name=name):
                return dilated_attention(q, k, v, cfg.segment_lengths, cfg.dilation_rates, causal=cfg.causal,
                                         backend=name)

            for mode in MODES[cfg.mode]:
                fn = attention_call(attention, inputs, mode)
                try:
                    ms = median_ms(fn, device, cfg.warmup, cfg.repeats)
                    peak = peak_memory_bytes(fn, device)
                except torch.OutOfMemoryError:  # e.g. the reference at a large N: report it, go on
                    say(f"  N={n:>7} {name:<10} {mode:<8}: out of memory, skipped")
                    torch.cuda.empty_cache()
                    continue
                row = dict(N=n, batch=cfg.batch, heads=cfg.heads, kv_heads=cfg.kv_heads, head_dim=cfg.head_dim,
                           dtype=dtype_name(cfg.dtype), segment_lengths=cfg.segment_lengths,
                           dilation_rates=cfg.dilation_rates, causal=cfg.causal, provider=name, mode=mode,
                           median_ms=ms, tflops=tflops(p, ms, backward=mode == "fwd+bwd"),
                           peak_memory_mib=None if peak is None else peak / 2**20, speedup_over_reference=None)
                _fill_speedups(record.rows + [row])
                record.add(row)
                extra = f"  peak {row['peak_memory_mib']:.0f} MiB" if peak is not None else ""
                say(f"  N={n:>7} {name:<10} {mode:<8}: {ms:#10.4g} ms  {row['tflops']:8.3g} TFLOP/s{extra}")
        del inputs
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return record.rows


def _fill_speedups(rows: list[dict]) -> None:
    reference = {(r["N"], r["mode"]): r["median_ms"] for r in rows if r["provider"] == "reference"}
    for r in rows:
        ref = reference.get((r["N"], r["mode"]))
        r["speedup_over_reference"] = ref / r["median_ms"] if ref else None


def print_table(rows: list[dict]) -> None:
    """One line per (N, backend): times, TFLOP/s and speedups over the reference, forward and fwd+bwd."""
    def cell(n, name, mode, key, fmt):
        for r in rows:
            if (r["N"], r["provider"], r["mode"]) == (n, name, mode) and r[key] is not None:
                return format(r[key], fmt)
        return "-"

    say(f"{'N':>7}  {'backend':<10} {'fwd ms':>9} {'fwd+bwd ms':>10} {'TFLOP/s fwd':>11} "
        f"{'TFLOP/s f+b':>11} {'peak MiB':>8} {'vs ref fwd':>10} {'vs ref f+b':>10}")
    for n, name in dict.fromkeys((r["N"], r["provider"]) for r in rows):
        peaks = [r["peak_memory_mib"] for r in rows
                 if (r["N"], r["provider"]) == (n, name) and r["peak_memory_mib"] is not None]
        say(f"{n:>7}  {name:<10} {cell(n, name, 'fwd', 'median_ms', '#.4g'):>9} "
            f"{cell(n, name, 'fwd+bwd', 'median_ms', '#.4g'):>10} {cell(n, name, 'fwd', 'tflops', '.3g'):>11} "
            f"{cell(n, name, 'fwd+bwd', 'tflops', '.3g'):>11} {format(max(peaks), '.0f') if peaks else '-':>8} "
            f"{cell(n, name, 'fwd', 'speedup_over_reference', '.2f'):>10} "
            f"{cell(n, name, 'fwd+bwd', 'speedup_over_reference', '.2f'):>10}")
    say("  (TFLOP/s from dilated_attn.spec.flops; peak MiB: CUDA only, the most allocated above the inputs "
        "during one call; vs ref: the reference backend's time over this backend's)")


# --- plots ----------------------------------------------------------------------------------------------

METRICS = {"tflops": "TFLOP/s", "median_ms": "time (ms)"}


def matplotlib_missing() -> Optional[str]:
    """None if matplotlib imports, else an error message naming it."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        return f"plotting needs matplotlib, which is not importable here ({exc}); pip install matplotlib"
    return None


def plot_rows(rows: list[dict], path: str, metric: str = "tflops", title: Optional[str] = None) -> None:
    """One panel per mode (fwd, fwd+bwd), `metric` ("tflops" or "median_ms") against N, a line per provider
    (its causal rows dashed, in the same colour). Rows need N, provider, mode and the metric (the rows of
    `bench` and of benchmarks/bench_gpu.py)."""
    if metric not in METRICS:
        raise ValueError(f"metric must be one of {tuple(METRICS)}, got {metric!r}")
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
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
