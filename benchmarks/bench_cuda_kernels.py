"""The `cuda` backend's two tile tables, forward and forward + backward, as shares of the fp32 FMA peak.

    python benchmarks/bench_cuda_kernels.py [--tables volta,pascal,gp100] [--label NAME] [--out JSON]

float32 at head dims 64 and 128, bfloat16 and float16 at 128 (N=16384, B=1, H=16, the longnet4 branches, TF32 off),
each a median of --repeats timed runs after --warmup runs (dilated_attn.cli.measure.median_ms, as bench_auto.py times:
CUDA events, L2 flushed before each run; the forward under no_grad). The fp32 FMA peak is measured in the same call
(bench_gpu.fp32_fma_peak); the backward is the difference of the two. Each table runs through
DILATED_ATTN_CUDA_TILES: Pascal's two (GP10x's and the P100's) on a newer GPU need a build with
DILATED_ATTN_PASCAL_PROXY=1
(benchmarks/run_on_gpu.sh makes one), which is how its rates are measured without a Pascal GPU (an H100's or H200's
SM has Pascal's 128 fp32 lanes, 64K registers and 32 shared-memory banks; benchmarks/pascal_roofline.py carries the
figures over to a GTX 1080 and a P100).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

import dilated_attn
from dilated_attn.cli.measure import LONGNET, attention_call, device_info, median_ms, random_inputs, tflops
from dilated_attn.spec import Problem

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_gpu import fp32_fma_peak

CONFIGS = [(torch.float32, 64), (torch.float32, 128), (torch.bfloat16, 128), (torch.float16, 128)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tables", default="volta,pascal,gp100",
                    help="comma-separated tile tables (DILATED_ATTN_CUDA_TILES)")
    ap.add_argument("--label", default="", help="printed at the start of every line and stored in the JSON")
    ap.add_argument("--seq-len", type=int, default=16384)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--out", default=None, help="JSON path (default: print only)")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    peak = fp32_fma_peak(args.warmup, 20)
    print(f"{torch.cuda.get_device_name()}: measured fp32 FMA peak {peak:.1f} TFLOP/s", flush=True)
    heads = 16
    segments, dilations = LONGNET

    def attention(q, k, v):
        return dilated_attn.dilated_attention(q, k, v, segments, dilations, backend="cuda")

    rows = []
    for table in args.tables.split(","):
        os.environ["DILATED_ATTN_CUDA_TILES"] = table
        for dtype, dim in CONFIGS:
            inputs = random_inputs(1, args.seq_len, heads, dim, dtype=dtype, device="cuda")
            problem = Problem.from_sizes(1, args.seq_len, heads, heads, dim, segments, dilations, dtype=dtype,
                                         device="cuda")
            ms = {mode: median_ms(attention_call(attention, inputs, mode), "cuda", args.warmup, args.repeats)
                  for mode in ("fwd", "fwd+bwd")}
            pct = {mode: 100 * tflops(problem, ms[mode], mode == "fwd+bwd") / peak for mode in ms}
            rows.append(dict(table=table, dtype=str(dtype)[6:], head_dim=dim, fwd_ms=ms["fwd"],
                             fwd_bwd_ms=ms["fwd+bwd"], fwd_pct_of_peak=pct["fwd"], fwd_bwd_pct_of_peak=pct["fwd+bwd"]))
            print(f"{args.label:>8} {table:>6} {str(dtype)[6:]:>8} D{dim:<3}: forward {ms['fwd']:7.2f} ms "
                  f"({pct['fwd']:4.1f}%)  forward+backward {ms['fwd+bwd']:7.2f} ms ({pct['fwd+bwd']:4.1f}%)  "
                  f"backward {ms['fwd+bwd'] - ms['fwd']:7.2f} ms", flush=True)
    os.environ.pop("DILATED_ATTN_CUDA_TILES")
    if args.out:
        record = dict(command="python " + " ".join(sys.argv), label=args.label, device=device_info("cuda"),
                      build=dilated_attn.build_info(), fp32_fma_peak_tflops=peak, seq_len=args.seq_len, heads=heads,
                      branches=dict(segment_lengths=segments, dilation_rates=dilations), rows=rows)
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
        print("wrote", args.out)


if __name__ == "__main__":
    main()
