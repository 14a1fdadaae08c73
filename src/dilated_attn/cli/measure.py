"""The measuring toolkit of the main job (`dilated-attn bench`, dilated_attn.cli.bench) and of the scripts in
benchmarks/, which import it from here (dilated_attn.cli.measure). The runtime package never imports it.

    median_ms               median time of a call after warm-up (CUDA events with L2 flushed; time.perf_counter)
    settle_clock            a few seconds of matrix products, so that the timings that follow run at the GPU's
                            sustained clock, not at the boost of a GPU that was idle
    in_turn                 the order in which a comparison's rounds time its providers
    peak_memory_bytes       the most one call allocates on a GPU above what was allocated before it
    gpu_state, GpuSampler   the GPU's SM clock, power draw, temperature and clock-event reasons, now or over a round
                            (read with nvidia-smi)
    random_inputs           seeded q, k, v (requiring grad) and an output gradient, GQA-capable
    attention_call          a forward, or forward and backward, of an attention function, as one call to time
    LONGNET, ...            branch presets (segment_lengths, dilation_rates)
    flops, tflops           the matmul FLOPs of a problem, and over a time
    device_info, versions   the device and the software a record was measured with
    Record                  a benchmark's JSON (and CSV) file, rewritten after every row
    applicable_backends     the backends the auto rule considers for a problem's device
    plot_rows               benchmark rows drawn to a PNG (`bench --plot`, benchmarks/plot_results.py; matplotlib,
                            which matplotlib_missing checks for)

The `bench` command's run is dilated_attn.cli.bench's. A problem of given sizes, without tensors:
dilated_attn.spec.Problem.from_sizes.
"""

from __future__ import annotations

import contextlib
import csv
import functools
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import threading
import time
from datetime import datetime, timezone
from typing import Callable, Iterator, NamedTuple, Optional, Sequence

import torch

from .. import __version__, dispatch
from ..spec import BACKEND_NAMES, Problem, host_offsets, sequence_problem

__all__ = [
    "LONGNET", "LONGNET_LONG", "LOCAL2", "DTYPES", "PASSES", "L2_FLUSH_BYTES",
    "say", "median_ms", "settle_clock", "in_turn", "run_times_ms", "format_ms", "peak_memory_bytes", "gpu_state",
    "GpuSampler", "Inputs",
    "random_inputs", "attention_call", "tflops",
    "device_info", "versions", "triton_version", "command_line", "Record", "applicable_backends",
    "METRICS", "matplotlib_missing", "plot_rows",
]

# Branch presets, (segment_lengths, dilation_rates).
LONGNET = ([2048, 4096, 8192, 16384], [1, 2, 4, 8])  # "longnet4" of benchmarks/README.md: w and r double
LONGNET_LONG = ([2048, 8192, 32768, 131072], [1, 4, 16, 64])  # for N >= 262144: w and r grow x4
LOCAL2 = ([512, 1024], [1, 2])  # "local2": two short branches, many small segments

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32, "float64": torch.float64}
# --mode -> the measurements taken: "fwd" (forward under no_grad), "fwd+bwd" (forward and the input gradients)
PASSES = {"fwd": ("fwd",), "fwdbwd": ("fwd+bwd",), "both": ("fwd", "fwd+bwd")}

# More than the L2 cache of current GPUs (H100: 50 MB, H200: 60 MB); read before each timed run, so that no run finds
# its inputs in L2 left there by the run before. Read, not zeroed as triton.testing.do_bench does: zeroing leaves the
# L2 full of written lines, whose write-back the timed run then pays for (on an H200, 7 us of a 44 us decode
# kernel; benchmarks/README.md, "Decoding").
L2_FLUSH_BYTES = 256 * 2**20


def say(*parts) -> None:
    print(*parts, flush=True)  # flushed: progress must show as it happens, also through a pipe


# --- measuring ------------------------------------------------------------------------------------------


def run_times_ms(fn: Callable[[], object], device: torch.device | str, warmup: int, repeats: int, *,
                 before_run: Optional[Callable[[], None]] = None,
                 combine: Optional[Callable[[list[float]], Sequence[float]]] = None) -> list[float]:
    """Milliseconds of each of `repeats` timed runs of `fn()` after `warmup` untimed ones (median_ms: their
    median).

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
            flush = torch.ones(L2_FLUSH_BYTES // 8, dtype=torch.int64, device=device)
            flushed = torch.empty((), dtype=torch.int64, device=device)
            events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                      for _ in range(repeats)]
            for start, end in events:
                torch.sum(flush, 0, out=flushed)
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
    return list(times)


def median_ms(fn: Callable[[], object], device: torch.device | str, warmup: int, repeats: int, *,
              before_run: Optional[Callable[[], None]] = None,
              combine: Optional[Callable[[list[float]], Sequence[float]]] = None) -> float:
    """Median milliseconds of `fn()` over `repeats` timed runs after `warmup` untimed ones (run_times_ms)."""
    return statistics.median(run_times_ms(fn, device, warmup, repeats, before_run=before_run, combine=combine))


def host_ms(fn: Callable[[], object], device: torch.device | str, repeats: int = 5) -> float:
    """Median milliseconds until `fn()` returns, each run started with the device idle: the host's share of a call
    (on a GPU the kernels it enqueues may still run after it returns)."""
    device = torch.device(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda _device: None)
    times = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    sync(device)
    return statistics.median(times)


def settle_clock(device: torch.device | str, seconds: float = 3.0) -> None:
    """Keeps a GPU busy with bf16 matrix products for `seconds`: an idle GPU starts at its boost clock and settles
    lower under sustained load, so a comparison's first provider timed on a rested GPU would be favoured. (It does not
    remove every first-round advantage: on an H200 the cudnn backend's first round stayed 10-15% faster after it,
    which in_turn's rotation and the median of several rounds discard.) Nothing on the CPU."""
    device = torch.device(device)
    if device.type != "cuda":
        return
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(10):
            a @ a
        torch.cuda.synchronize(device)


def in_turn(names: Sequence[str], rounds: int) -> Iterator[str]:
    """`names` in turn, `rounds` times, each round starting one further along: drift, and whatever one provider
    leaves behind for the next, hit them all alike (no provider is always timed first, or always after the same
    one)."""
    names = list(names)
    for r in range(rounds):
        shift = r % len(names) if names else 0
        yield from names[shift:] + names[:shift]


def format_ms(ms: float) -> str:
    """Milliseconds with four significant digits and no exponent: 1160, 72.35, 0.4310."""
    return f"{ms:.0f}" if ms >= 1000 else f"{ms:#.4g}".rstrip(".")


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


# What gpu_state reads (nvidia-smi --query-gpu fields) and the keys it gives them. Clock-event reasons (a bit mask:
# 0x4 the power cap, 0x20 and 0x40 thermal slowdowns) tell why the SM clock is below its maximum.
GPU_STATE_FIELDS = (("clocks.sm", "sm_clock_mhz"), ("power.draw", "power_w"), ("temperature.gpu", "temperature_c"),
                    ("clocks_event_reasons.active", "clock_event_reasons"))
_SMI_FIELDS: Optional[tuple] = None  # the fields this machine's nvidia-smi answered (older drivers lack the reasons)


@functools.lru_cache(maxsize=None)
def _smi_id(device: torch.device) -> str:
    """The device as nvidia-smi names it: by UUID, since CUDA's numbering follows CUDA_VISIBLE_DEVICES and
    nvidia-smi's does not."""
    uuid = str(torch.cuda.get_device_properties(device).uuid)
    return uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"


def gpu_state(device: torch.device | str) -> dict:
    """The GPU's SM clock (MHz), power draw (W), temperature (C) and clock-event reasons (an int mask) now, from
    nvidia-smi (about 50 ms of the host's time); {} on the CPU or where nvidia-smi does not answer, and without a
    field it does not know."""
    device = torch.device(device)
    if device.type != "cuda":
        return {}
    try:
        ident = _smi_id(device)
    except (RuntimeError, AttributeError, AssertionError):
        return {}
    global _SMI_FIELDS
    for fields in (_SMI_FIELDS,) if _SMI_FIELDS else (GPU_STATE_FIELDS, GPU_STATE_FIELDS[:3]):
        query = ",".join(field for field, _ in fields)
        try:
            done = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader,nounits", "-i", ident],
                                  capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return {}
        if done.returncode == 0:
            _SMI_FIELDS = fields
            break
    else:
        return {}
    values = [v.strip() for v in done.stdout.strip().splitlines()[0].split(",")] if done.stdout.strip() else []
    state = {}
    for (_, key), value in zip(fields, values):
        try:
            state[key] = int(value, 16) if key == "clock_event_reasons" else float(value)
        except ValueError:  # "[N/A]" and the like
            continue
    return state


class GpuSampler:
    """gpu_state read on a thread every `interval` seconds while the `with` block runs (and once at its start):
    what a round's timings ran at, without a reading inside the timed region's host code. `summary()`: the median
    of each reading, the readings' count and the union of the clock-event reasons; {} on the CPU."""

    def __init__(self, device: torch.device | str, interval: float = 0.2):
        self.device = torch.device(device)
        self.interval = interval
        self.samples: list[dict] = []
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def _run(self) -> None:
        while True:
            state = gpu_state(self.device)
            if state:
                self.samples.append(state)
            if self._stop.wait(self.interval):
                return

    def __enter__(self) -> "GpuSampler":
        if self.device.type == "cuda":
            self._thread = threading.Thread(target=self._run, name="gpu-state", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()

    def summary(self) -> dict:
        if not self.samples:
            return {}
        out = {key: statistics.median(s[key] for s in self.samples if key in s)
               for _, key in GPU_STATE_FIELDS[:3] if any(key in s for s in self.samples)}
        reasons = [s["clock_event_reasons"] for s in self.samples if "clock_event_reasons" in s]
        if reasons:
            mask = 0
            for r in reasons:
                mask |= r
            out["clock_event_reasons"] = hex(mask)
        out["samples"] = len(self.samples)
        return out


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
    """TFLOP/s of a run of `p` that took `ms` milliseconds (FLOPs: flops)."""
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


# --- problems -------------------------------------------------------------------------------------------


def applicable_backends(p: Problem) -> list[str]:
    """The backends for p's device type (those the auto rule considers), in BACKEND_NAMES order. Triton on
    CPU tensors (its interpreter, a test tool) is not among them; it runs there only when named."""
    return [name for name in BACKEND_NAMES if name in dispatch.auto_preference(p)]


def flops(problem: Problem, backward: bool = False) -> float:
    """Matmul FLOPs: 4*B*N*D*sum_i(H_i*s_i/r_i^2), H_i the heads taking part in branch i (all H with
    head_groups="all"), halved for causal, x3.5 with backward (forward 2 matmuls, backward 5). Packed sequences
    count each sequence with its own length (its segments clipped to it)."""
    if problem.varlen:
        offsets = host_offsets(problem.cu_seqlens)
        return sum(flops(sequence_problem(problem, end - start), backward) for start, end in zip(offsets, offsets[1:]))
    b = problem
    work = sum((br.head_hi - br.head_lo) * br.seg_len / br.dilation**2 for br in b.branches)
    f = 4.0 * b.batch * b.seq_len * b.head_dim * work
    if b.causal:
        f /= 2
    return f * (3.5 if backward else 1.0)


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
