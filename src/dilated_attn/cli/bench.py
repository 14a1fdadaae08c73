"""The `bench` command's run: its configuration (BenchConfig, and BENCH_DEFAULTS for the flags left out), the
plan made before anything runs (which backends at each N, which are refused and why), the timing of every
(N, backend, mode) into a Record, and the table printed at the end. The measuring itself, and the plots of
`bench --plot`, are dilated_attn.cli.measure's.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from typing import NamedTuple, Optional, Sequence

import torch

from .. import backends
from ..functional import dilated_attention
from ..spec import Problem, dtype_name, validate
from .measure import (
    LONGNET,
    PASSES,
    Record,
    applicable_backends,
    attention_call,
    format_ms,
    peak_memory_bytes,
    random_inputs,
    run_times_ms,
    say,
    tflops,
)

# A measurement whose first call takes longer than this says so before it times the rest (a CPU run of the
# reference at the GPU sizes takes minutes).
SLOW_CALL_S = 2.0

__all__ = [
    "BENCH_DEFAULTS", "BenchConfig", "BenchPlan", "bench_plan", "refusals", "run_bench", "print_table",
]


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
    mode: str = "both"  # a key of PASSES
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


def refusals(problems: Sequence[Problem], names: Sequence[str]) -> dict[str, str]:
    """{name: why} for each backend of `names` that cannot run one of `problems` (the first reason each)."""
    refused: dict[str, str] = {}
    for p in problems:
        for name, why in backends.verdicts(p).items():
            if name in names and why is not None:
                refused.setdefault(name, why)
    return refused


class BenchPlan(NamedTuple):
    backends: dict[int, list[str]]  # N -> the backends timed at N
    skipped: dict[str, str]  # a backend not named that cannot run -> why
    refused: dict[str, str]  # a backend named that cannot run -> why (the run must not start)


def bench_plan(cfg: BenchConfig, names: Optional[Sequence[str]] = None) -> BenchPlan:
    """Validates the configuration at every N before anything runs (raising the package's ValueError/TypeError
    for an invalid one) and picks the backends at each N: those named, or every one that applies to the device
    and can run."""
    timed, skipped = {}, {}
    problems = []
    for n in cfg.seq_len:
        p = Problem.from_sizes(cfg.batch, n, cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.segment_lengths,
                               cfg.dilation_rates, dtype=cfg.dtype, device=cfg.device, causal=cfg.causal)
        problems.append(p)
        if names:
            timed[n] = list(names)
            continue
        found = backends.verdicts(p)
        timed[n] = [name for name in applicable_backends(p) if found[name] is None]
        skipped.update({name: found[name] for name in applicable_backends(p) if found[name] is not None})
    return BenchPlan(timed, skipped, refusals(problems, names or ()))


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

            for mode in PASSES[cfg.mode]:
                fn = attention_call(attention, inputs, mode)
                label = f"  N={n:>7} {name:<10} {mode:<8}:"
                try:
                    warmup = cfg.warmup
                    if warmup:  # the first call timed: a slow measurement says what it will take before it does
                        start = time.perf_counter()
                        fn()
                        if device.type == "cuda":
                            torch.cuda.synchronize(device)
                        took, warmup = time.perf_counter() - start, warmup - 1
                        if took > SLOW_CALL_S:
                            say(f"{label} a call takes {took:.0f} s; timing {cfg.repeats} runs after {warmup} more "
                                f"warm-up (about {took * (warmup + cfg.repeats):.0f} s)")
                    times = run_times_ms(fn, device, warmup, cfg.repeats)
                    ms = statistics.median(times)
                    peak = peak_memory_bytes(fn, device)
                except torch.OutOfMemoryError:  # e.g. the reference at a large N: report it, go on
                    say(f"{label} out of memory, skipped")
                    torch.cuda.empty_cache()
                    continue
                row = dict(N=n, batch=cfg.batch, heads=cfg.heads, kv_heads=cfg.kv_heads, head_dim=cfg.head_dim,
                           dtype=dtype_name(cfg.dtype), segment_lengths=cfg.segment_lengths,
                           dilation_rates=cfg.dilation_rates, causal=cfg.causal, provider=name, mode=mode,
                           median_ms=ms, min_ms=min(times), max_ms=max(times), runs=len(times),
                           tflops=tflops(p, ms, backward=mode == "fwd+bwd"),
                           peak_memory_mib=None if peak is None else peak / 2**20, speedup_over_reference=None)
                _fill_speedups(record.rows + [row])
                record.add(row)
                extra = f"  peak {row['peak_memory_mib']:.0f} MiB" if peak is not None else ""
                spread = f"({format_ms(min(times))}-{format_ms(max(times))}, {len(times)} runs)"
                say(f"{label} {format_ms(ms):>8} ms {spread:<24} {row['tflops']:8.3g} TFLOP/s{extra}")
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
                return fmt(r[key]) if callable(fmt) else format(r[key], fmt)
        return "-"

    say(f"{'N':>7}  {'backend':<10} {'fwd ms':>9} {'fwd+bwd ms':>10} {'TFLOP/s fwd':>11} "
        f"{'TFLOP/s f+b':>11} {'peak MiB':>8} {'vs ref fwd':>10} {'vs ref f+b':>10}")
    for n, name in dict.fromkeys((r["N"], r["provider"]) for r in rows):
        peaks = [r["peak_memory_mib"] for r in rows
                 if (r["N"], r["provider"]) == (n, name) and r["peak_memory_mib"] is not None]
        say(f"{n:>7}  {name:<10} {cell(n, name, 'fwd', 'median_ms', format_ms):>9} "
            f"{cell(n, name, 'fwd+bwd', 'median_ms', format_ms):>10} {cell(n, name, 'fwd', 'tflops', '.3g'):>11} "
            f"{cell(n, name, 'fwd+bwd', 'tflops', '.3g'):>11} {format(max(peaks), '.0f') if peaks else '-':>8} "
            f"{cell(n, name, 'fwd', 'speedup_over_reference', '.2f'):>10} "
            f"{cell(n, name, 'fwd+bwd', 'speedup_over_reference', '.2f'):>10}")
    say("  (medians; each measurement's line above gives its fastest and slowest run; TFLOP/s from "
        "dilated_attn.cli.measure.flops; peak MiB: CUDA only, the most allocated above the inputs during one call; vs ref: "
        "the reference backend's time over this backend's)")
