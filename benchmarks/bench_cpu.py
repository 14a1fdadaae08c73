"""CPU benchmark: the compiled CPU backend against the reference backend, forward and forward+backward.

    python benchmarks/bench_cpu.py                        # B=1, N=8192, H=8, D=64, float32, 2 threads,
                                                          # branches (512,1), (1024,2), (2048,4)
    python benchmarks/bench_cpu.py --causal --seq 16384   # any other

The measurement of `dilated-attn bench --device cpu --backends cpu reference` (dilated_attn.cli.bench):
medians over --repeats runs after --warmup runs, time.perf_counter around each call (CPU ops are
synchronous), both backends in the same process on the same inputs. Each row is printed as it is measured
and the JSON (benchmarks/results/cpu_<config>.json, or --out) is rewritten after every row; it ends with
speedup_over_reference, the reference's time over the cpu backend's per mode.
"""

from __future__ import annotations

import argparse
import os

import torch

import dilated_attn
from dilated_attn.cli.bench import BenchConfig, bench_plan, print_table, run_bench
from dilated_attn.cli.measure import DTYPES, Record, say

PROVIDERS = ("cpu", "reference")


def parse_branches(text: str) -> tuple[list[int], list[int]]:
    """"512:1,1024:2" -> ([512, 1024], [1, 2])."""
    try:
        pairs = [item.split(":") for item in text.split(",")]
        return [int(w) for w, _ in pairs], [int(r) for _, r in pairs]
    except ValueError:
        rule = "w:r pairs separated by commas (512:1,1024:2)"
        raise argparse.ArgumentTypeError(f"must be {rule}, got {text!r}") from None


def main(argv=None) -> Record:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--branches", type=parse_branches, default="512:1,1024:2,2048:4",
                    help="w:r pairs, comma separated (default: %(default)s)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "float64", "bfloat16"])
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None, help="JSON path (default: benchmarks/results/cpu_<config>.json)")
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    segs, dils = args.branches
    cfg = BenchConfig(device=torch.device("cpu"), dtype=DTYPES[args.dtype], batch=args.batch, seq_len=[args.seq],
                      heads=args.heads, kv_heads=args.heads, head_dim=args.dim, segment_lengths=segs,
                      dilation_rates=dils, causal=args.causal, mode="both", warmup=args.warmup,
                      repeats=args.repeats)
    try:
        planned = bench_plan(cfg, PROVIDERS)
    except (ValueError, TypeError) as exc:
        ap.error(str(exc))
    if planned.refused:
        ap.error("; ".join(f"backend {name!r} cannot run here: {why}" for name, why in planned.refused.items()))
    out = args.out or os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "results",
        f"cpu_b{args.batch}_n{args.seq}_h{args.heads}_d{args.dim}_{args.dtype}{'_causal' if args.causal else ''}.json",
    )
    say(f"cpu backend against the reference: {cfg.describe()}, {torch.get_num_threads()} threads")
    record = Record("cpu_backend_vs_reference", cfg.device, cfg.as_json(), json_path=out,
                    build=dilated_attn.build_info())
    rows = run_bench(cfg, planned.backends, record)
    print_table(rows)
    speedups = {r["mode"]: r["speedup_over_reference"] for r in rows if r["provider"] == "cpu"}
    for mode, s in speedups.items():
        say(f"cpu backend vs reference, {mode}: {s:.2f}x faster")
    record.set(speedup_over_reference=speedups)
    record.close()
    return record


if __name__ == "__main__":
    main()
