"""The `cuda` backend alone, forward and forward + backward, for comparing variants of the hand-written kernels.

    python benchmarks/bench_cuda_kernels.py [--label NAME] [--peak TFLOPS]

float32 at head dims 64 and 128 and bfloat16 at 128 (N=16384, B=1, H=16, the longnet4 branches, TF32 off), each a
median of --repeats timed runs after --warmup runs (dilated_attn.benchmark.median_ms, as bench_auto.py times: CUDA
events, L2 flushed before each run; the forward under no_grad), printed one line per configuration with its share
of the fp32 FMA peak (--peak, default the H100's measured 66.5 TFLOP/s; benchmarks/bench_gpu.py fp32_fma_peak
measures it) and the backward as the difference of the two. The final rates of a change come from bench_auto.py,
beside the other backends; this is the quick loop for tile variants built side by side (PYTHONPATH per build).
"""

from __future__ import annotations

import argparse

import torch

import dilated_attn
from dilated_attn.benchmark import LONGNET, attention_call, median_ms, problem_for, random_inputs, tflops

CONFIGS = [(torch.float32, 64), (torch.float32, 128), (torch.bfloat16, 128)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--label", default="", help="printed at the start of every line (the variant's name)")
    ap.add_argument("--seq-len", type=int, default=16384)
    ap.add_argument("--peak", type=float, default=66.5, help="fp32 FMA peak in TFLOP/s for the percentages")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    heads = 16
    segments, dilations = LONGNET

    def attention(q, k, v):
        return dilated_attn.dilated_attention(q, k, v, segments, dilations, backend="cuda")

    for dtype, dim in CONFIGS:
        inputs = random_inputs(1, args.seq_len, heads, dim, dtype=dtype, device="cuda")
        problem = problem_for("cuda", dtype, 1, args.seq_len, heads, heads, dim, segments, dilations)
        ms = {mode: median_ms(attention_call(attention, inputs, mode), "cuda", args.warmup, args.repeats)
              for mode in ("fwd", "fwd+bwd")}
        pct = {mode: 100 * tflops(problem, ms[mode], mode == "fwd+bwd") / args.peak for mode in ms}
        print(f"{args.label:>8} {str(dtype)[6:]:>8} D{dim:<3}: forward {ms['fwd']:7.2f} ms ({pct['fwd']:4.1f}%)  "
              f"forward+backward {ms['fwd+bwd']:7.2f} ms ({pct['fwd+bwd']:4.1f}%)  "
              f"backward {ms['fwd+bwd'] - ms['fwd']:7.2f} ms", flush=True)


if __name__ == "__main__":
    main()
