"""Does backend="auto" pick the fastest backend? A sweep over (dtype, head dim, N, branches) on the GPU.

    python benchmarks/bench_auto.py                   # the full grid, forward+backward
    python benchmarks/bench_auto.py --mode fwd --quick

For every configuration it times each backend that can run it (triton, cuda, reference; the same inputs,
in the same process), records which one `dilated_attn.explain` says auto picks, and reports auto's time
over the best backend's. The auto rule lives in dilated_attn.dispatch.auto_preference; this is its
evidence. Times are medians of triton.testing.do_bench (CUDA events, warm-up). JSON goes to
benchmarks/results/auto_<device>.json.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from datetime import datetime, timezone

import torch
import triton
import triton.testing

import dilated_attn
from dilated_attn.spec import flops, validate

BRANCHES = {
    "longnet4": ([2048, 4096, 8192, 16384], [1, 2, 4, 8]),
    "local2": ([512, 1024], [1, 2]),
}
GRID = dict(dtype=["bfloat16", "float16", "float32"], head_dim=[64, 128], N=[4096, 16384, 65536],
            branches=list(BRANCHES))
QUICK = dict(dtype=["bfloat16"], head_dim=[64, 128], N=[4096, 65536], branches=["longnet4"])


def time_backend(backend, q, k, v, segs, dils, grad, mode):
    def call():
        if mode == "fwd":
            with torch.no_grad():
                dilated_attn.dilated_attention(q, k, v, segs, dils, backend=backend)
        else:
            out = dilated_attn.dilated_attention(q, k, v, segs, dils, backend=backend)
            torch.autograd.grad(out, (q, k, v), grad)

    call()  # compile / autotune outside the timing
    return triton.testing.do_bench(call, warmup=25, rep=100, return_mode="median")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=["fwd", "fwdbwd"], default="fwdbwd")
    ap.add_argument("--quick", action="store_true", help="a small grid")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--max-reference-n", type=int, default=65536, help="skip the reference above this N")
    ap.add_argument("--dtypes", nargs="+", choices=GRID["dtype"], help="override the grid's dtypes")
    ap.add_argument("--head-dims", nargs="+", type=int, help="override the grid's head dims")
    ap.add_argument("--seq-lens", nargs="+", type=int, help="override the grid's sequence lengths")
    ap.add_argument("--branches", nargs="+", choices=list(BRANCHES), help="override the grid's branch sets")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    dev = torch.cuda.get_device_name()
    print(f"device: {dev}; torch {torch.__version__}; triton {triton.__version__}", flush=True)
    grid = dict(QUICK if args.quick else GRID)
    for key, value in (("dtype", args.dtypes), ("head_dim", args.head_dims), ("N", args.seq_lens),
                       ("branches", args.branches)):
        if value:
            grid[key] = value
    rows = []
    for dtype_name, head_dim, N, branch_name in itertools.product(*grid.values()):
        dtype = getattr(torch, dtype_name)
        segs, dils = BRANCHES[branch_name]
        gen = torch.Generator(device="cuda").manual_seed(0)
        shape = (1, N, args.heads, head_dim)
        q, k, v = (torch.randn(shape, device="cuda", dtype=dtype, generator=gen).requires_grad_() for _ in range(3))
        grad = torch.randn(shape, device="cuda", dtype=dtype, generator=gen)
        decision = dilated_attn.explain(q, k, v, segs, dils)
        times = {}
        for name, why in decision.verdicts.items():
            if why is not None or (name == "reference" and N > args.max_reference_n):
                continue
            times[name] = time_backend(name, q, k, v, segs, dils, grad, args.mode)
        best = min(times, key=times.get)
        auto_ms = times.get(decision.backend)
        row = dict(dtype=dtype_name, head_dim=head_dim, N=N, branches=branch_name, segment_lengths=segs,
                   dilation_rates=dils, mode=args.mode, auto=decision.backend, best=best, times_ms=times,
                   auto_over_best=None if auto_ms is None else auto_ms / times[best],
                   tflops={n: flops(validate(q, k, v, segs, dils), backward=args.mode == "fwdbwd") / t / 1e9
                           for n, t in times.items()})
        rows.append(row)
        timing = "  ".join(f"{n} {t:8.3f} ms" for n, t in times.items())
        print(f"{dtype_name:>8} D={head_dim:<3} N={N:>6} {branch_name:>8}: auto={decision.backend:<9} best={best:<9} "
              f"auto/best={row['auto_over_best'] or float('nan'):.2f}  {timing}", flush=True)
        del q, k, v, grad
        torch.cuda.empty_cache()
    worst = max((r["auto_over_best"] for r in rows if r["auto_over_best"] is not None), default=None)
    print(f"worst auto/best over the grid: {worst:.3f}" if worst else "no comparable rows", flush=True)
    record = dict(benchmark="auto_rule_sweep", command=" ".join(["python", *sys.argv]),
                  date=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                  device=dict(name=dev, capability=".".join(map(str, torch.cuda.get_device_capability()))),
                  versions=dict(torch=torch.__version__, triton=triton.__version__,
                                dilated_attn=dilated_attn.__version__),
                  heads=args.heads, worst_auto_over_best=worst, results=rows)
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                   f"auto_{dev.replace(' ', '_')}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(record, f, indent=2)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
