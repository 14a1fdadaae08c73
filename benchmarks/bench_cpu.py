"""CPU benchmark: the compiled CPU backend against the reference backend, forward and forward+backward.

    python benchmarks/bench_cpu.py                        # the foundation issue's configuration
    python benchmarks/bench_cpu.py --causal --seq 16384   # any other

Times are medians over --repeats runs after --warmup runs (time.perf_counter around each call; CPU ops are
synchronous). Both providers are measured in the same process on the same inputs. Results are printed and
written as JSON to benchmarks/results/ (or --out).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from datetime import datetime, timezone

import torch

import dilated_attn
from dilated_attn.spec import flops, validate

PROVIDERS = ("cpu", "reference")


def parse_branches(text: str):
    pairs = [item.split(":") for item in text.split(",")]
    return [int(w) for w, _ in pairs], [int(r) for _, r in pairs]


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def median_time(fn, warmup: int, repeats: int) -> tuple[float, list[float]]:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), times


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--branches", default="512:1,1024:2,2048:4", help="w:r pairs, comma separated")
    ap.add_argument("--dtype", default="float32", choices=["float32", "float64", "bfloat16"])
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None, help="JSON path (default: benchmarks/results/cpu_<config>.json)")
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    segs, dils = parse_branches(args.branches)
    gen = torch.Generator().manual_seed(0)
    shape = (args.batch, args.seq, args.heads, args.dim)
    q, k, v = (torch.randn(shape, generator=gen).to(dtype).requires_grad_() for _ in range(3))
    grad = torch.randn(shape, generator=gen).to(dtype)
    problem = validate(q, k, v, segs, dils, causal=args.causal)

    results = []
    for provider in PROVIDERS:

        def forward():
            with torch.no_grad():
                dilated_attn.dilated_attention(q, k, v, segs, dils, causal=args.causal, backend=provider)

        def forward_backward():
            out = dilated_attn.dilated_attention(q, k, v, segs, dils, causal=args.causal, backend=provider)
            torch.autograd.grad(out, (q, k, v), grad)

        for mode, fn in (("fwd", forward), ("fwd+bwd", forward_backward)):
            med, times = median_time(fn, args.warmup, args.repeats)
            tflops = flops(problem, backward=mode == "fwd+bwd") / med / 1e12
            results.append(dict(provider=provider, mode=mode, median_s=med, times_s=times, tflops=tflops))
            print(f"{provider:>10} {mode:>8}: {med * 1e3:9.1f} ms  {tflops * 1e3:7.1f} GFLOP/s", flush=True)

    by = {(r["provider"], r["mode"]): r["median_s"] for r in results}
    speedups = {mode: by[("reference", mode)] / by[("cpu", mode)] for mode in ("fwd", "fwd+bwd")}
    for mode, s in speedups.items():
        print(f"cpu backend vs reference, {mode}: {s:.2f}x faster")

    record = dict(
        benchmark="cpu_backend_vs_reference",
        command=" ".join([os.path.basename(sys.executable), *sys.argv]),
        date=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        device=dict(kind="cpu", model=cpu_model(), threads=torch.get_num_threads(), machine=platform.machine()),
        versions=dict(torch=torch.__version__, python=platform.python_version(), dilated_attn=dilated_attn.__version__),
        build=dilated_attn.build_info(),
        config=dict(batch=args.batch, seq=args.seq, heads=args.heads, head_dim=args.dim, segment_lengths=segs,
                    dilation_rates=dils, dtype=args.dtype, causal=args.causal, warmup=args.warmup,
                    repeats=args.repeats, flops_fwd=flops(problem)),
        results=results,
        speedup_over_reference=speedups,
    )
    out = args.out or os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "results",
        f"cpu_b{args.batch}_n{args.seq}_h{args.heads}_d{args.dim}_{args.dtype}{'_causal' if args.causal else ''}.json",
    )
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(record, f, indent=2)
    print(f"wrote {out}")
    return record


if __name__ == "__main__":
    main()
