"""Does backend="auto" pick the fastest backend? A sweep over (dtype, head dim, N, branches) on the GPU.

    python benchmarks/bench_auto.py                   # the full grid, forward+backward
    python benchmarks/bench_auto.py --mode fwd --quick
    python benchmarks/bench_auto.py --dtypes float32 --head-dims 128

For every configuration it times each backend that can run it (triton, cuda, reference; the same inputs,
in the same process), records which one `dilated_attn.explain` says auto picks, and reports auto's time
over the best backend's. The auto rule lives in dilated_attn.dispatch.auto_preference; this is its
evidence. Times are medians over --repeats runs after --warmup runs (dilated_attn.cli.measure.median_ms:
CUDA events, L2 flushed before each run); peak_memory_mib is what one call allocates beyond the inputs at
its peak (outputs, saved tensors, gradients). JSON goes to benchmarks/results/auto_<device>.json (or --out),
rewritten after every row (a run cut short keeps its rows).

The Triton kernels run the shipped configs (tuned_configs.json); DILATED_ATTN_AUTOTUNE=1 sweeps them instead.
Each row records the configs the process has launched so far (configs.chosen).
"""

from __future__ import annotations

import argparse
import itertools
import os

import torch
import triton

import dilated_attn
from dilated_attn.backends import triton as triton_backend
from dilated_attn.backends.triton import configs, ops
from dilated_attn.cli.measure import (
    LOCAL2,
    LONGNET,
    Record,
    attention_call,
    median_ms,
    peak_memory_bytes,
    random_inputs,
    say,
    tflops,
)
from dilated_attn.spec import validate

BRANCHES = {"longnet4": LONGNET, "local2": LOCAL2}
GRID = dict(dtype=["bfloat16", "float16", "float32"], head_dim=[64, 128], N=[4096, 16384, 65536],
            branches=list(BRANCHES))
QUICK = dict(dtype=["bfloat16"], head_dim=[64, 128], N=[4096, 65536], branches=["longnet4"])
MODE_NAMES = {"fwd": "fwd", "fwdbwd": "fwd+bwd"}  # --mode -> dilated_attn.cli.measure's mode


def _inputs(dtype_name, head_dim, N, heads):
    return random_inputs(1, N, heads, head_dim, dtype=getattr(torch, dtype_name), device="cuda")


def time_backend(backend, inputs, segs, dils, mode, warmup, repeats):
    """(median ms, peak MiB above the inputs) of one backend."""
    call = attention_call(lambda q, k, v: dilated_attn.dilated_attention(q, k, v, segs, dils, backend=backend),
                          inputs, mode)
    ms = median_ms(call, "cuda", warmup, repeats)
    return ms, peak_memory_bytes(call, "cuda") / 2**20


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
    ap.add_argument("--allow-tf32", action="store_true",
                    help="set torch.backends.cuda.matmul.allow_tf32 (float32: TF32 in triton and the reference)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed runs first (the first compiles)")
    ap.add_argument("--repeats", type=int, default=10, help="timed runs; their median is reported")
    ap.add_argument("--out", default=None, help="JSON path (default: benchmarks/results/auto_<device>.json)")
    args = ap.parse_args(argv)
    torch.backends.cuda.matmul.allow_tf32 = args.allow_tf32
    dev = torch.cuda.get_device_name()
    say(f"device: {dev}; torch {torch.__version__}; triton {triton.__version__}")
    grid = dict(QUICK if args.quick else GRID)
    for key, value in (("dtype", args.dtypes), ("head_dim", args.head_dims), ("N", args.seq_lens),
                       ("branches", args.branches)):
        if value:
            grid[key] = value
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                   f"auto_{dev.replace(' ', '_')}.json")
    mode = MODE_NAMES[args.mode]
    record = Record("auto_rule_sweep", "cuda", dict(grid=grid, mode=args.mode, warmup=args.warmup,
                                                    repeats=args.repeats, max_reference_n=args.max_reference_n),
                    json_path=out, heads=args.heads, allow_tf32=args.allow_tf32, worst_auto_over_best=None)
    for dtype_name, head_dim, N, branch_name in itertools.product(*grid.values()):
        segs, dils = BRANCHES[branch_name]
        inputs = _inputs(dtype_name, head_dim, N, args.heads)
        with torch.set_grad_enabled(mode == "fwd+bwd"):  # as the timed call: auto's rule reads records_backward
            decision = dilated_attn.explain(*inputs[:3], segs, dils)
        times, peak_mib = {}, {}
        for name, why in decision.verdicts.items():
            if why is not None or (name == "reference" and N > args.max_reference_n):
                continue
            times[name], peak_mib[name] = time_backend(name, inputs, segs, dils, mode, args.warmup, args.repeats)
        best = min(times, key=times.get)
        auto_ms = times.get(decision.backend)
        problem = validate(*inputs[:3], segs, dils)
        row = dict(dtype=dtype_name, head_dim=head_dim, N=N, branches=branch_name, segment_lengths=segs,
                   dilation_rates=dils, mode=args.mode, auto=decision.backend, best=best, times_ms=times,
                   peak_memory_mib=peak_mib,
                   triton_products=triton_backend.float32_precision(problem.device, head_dim)
                   if dtype_name == "float32" else dtype_name,
                   auto_over_best=None if auto_ms is None else auto_ms / times[best],
                   triton_configs=configs.chosen(ops.TUNABLES) if "triton" in times else None,
                   tflops={n: tflops(problem, t, backward=mode == "fwd+bwd") for n, t in times.items()})
        record.add(row)
        timing = "  ".join(f"{n} {t:8.3f} ms" for n, t in times.items())
        say(f"{row['triton_products']:>8} D={head_dim:<3} N={N:>6} {branch_name:>8}: auto={decision.backend:<9} "
            f"best={best:<9} auto/best={row['auto_over_best'] or float('nan'):.2f}  {timing}")
        del inputs
        torch.cuda.empty_cache()
        record.set(worst_auto_over_best=max((r["auto_over_best"] for r in record.rows
                                             if r["auto_over_best"] is not None), default=None))
    worst = record.data["worst_auto_over_best"]
    say(f"worst auto/best over the grid: {worst:.3f}" if worst else "no comparable rows")
    record.close()


if __name__ == "__main__":
    main()
