"""The `cuda` backend alone, forward and forward + backward, for comparing variants of the hand-written kernels.

    python benchmarks/bench_cuda_kernels.py [--label NAME] [--peak TFLOPS]

float32 at head dims 64 and 128 and bfloat16 at 128 (N=16384, B=1, H=16, the longnet4 branches, TF32 off), each a
median of --repeats timed runs (CUDA events) after --warmup runs, printed one line per configuration with its share
of the fp32 FMA peak (--peak, default the H100's measured 66.5 TFLOP/s; benchmarks/bench_gpu.py fp32_fma_peak
measures it) and the backward as the difference of the two. The final rates of a change come from bench_auto.py,
beside the other backends; this is the quick loop for tile variants built side by side (PYTHONPATH per build).
"""

from __future__ import annotations

import argparse

import torch

import dilated_attn
from dilated_attn.benchmark import LONGNET

CONFIGS = [(torch.float32, 64), (torch.float32, 128), (torch.bfloat16, 128)]


def median_ms(fn, warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeats)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return sorted(start.elapsed_time(end) for start, end in events)[repeats // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--label", default="", help="printed at the start of every line (the variant's name)")
    ap.add_argument("--seq-len", type=int, default=16384)
    ap.add_argument("--peak", type=float, default=66.5, help="fp32 FMA peak in TFLOP/s for the percentages")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    n, heads = args.seq_len, 16
    segments, dilations = LONGNET
    for dtype, dim in CONFIGS:
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(1, n, heads, dim, device="cuda", dtype=dtype, generator=gen).requires_grad_()
                   for _ in range(3))
        grad_out = torch.randn(1, n, heads, dim, device="cuda", dtype=dtype, generator=gen)

        def forward():
            return dilated_attn.dilated_attention(q, k, v, segments, dilations, backend="cuda")

        def forward_backward():
            torch.autograd.grad(forward(), (q, k, v), grad_out)

        # 4 N D H per unit of sum(w / r^2) over the branches; x3.5 with the backward (benchmarks/README.md)
        flops = 4 * n * dim * heads * sum(w / r / r for w, r in zip(segments, dilations))
        fwd, fwd_bwd = median_ms(forward, args.warmup, args.repeats), median_ms(forward_backward, args.warmup,
                                                                                args.repeats)
        fwd_pct = 100 * flops / fwd / 1e9 / args.peak
        fwd_bwd_pct = 100 * 3.5 * flops / fwd_bwd / 1e9 / args.peak
        print(f"{args.label:>8} {str(dtype)[6:]:>8} D{dim:<3}: forward {fwd:7.2f} ms ({fwd_pct:4.1f}%)  "
              f"forward+backward {fwd_bwd:7.2f} ms ({fwd_bwd_pct:4.1f}%)  backward {fwd_bwd - fwd:7.2f} ms",
              flush=True)


if __name__ == "__main__":
    main()
