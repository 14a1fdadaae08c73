"""What a Pascal GPU's memory lets Pascal's tile table reach: a roofline on paper, since no Pascal GPU is at hand.

    python benchmarks/pascal_roofline.py [--proxy benchmarks/results/cuda_kernels_<device>.json] [--out JSON]

For the configuration of benchmarks/bench_cuda_kernels.py (N=16384, B=1, H=16, the longnet4 branches, head dims 64
and 128, float32 and bfloat16), counts each kernel's FLOPs as executed (the backward recomputes S in both its
kernels) and its global-memory traffic at Pascal's tiles (csrc/cuda: ForwardTiles, DqTiles, DkdvTiles with
TileTable::kPascal on a GTX 1080, kGp100 on a P100; every operand streamed, nothing resident), in two bounds:
- requested: every load a block issues goes to DRAM (no reuse in L2): the lower bound of the rate;
- unique: each tensor crosses DRAM once per branch (perfect reuse in L2): the upper bound.
The roofline then allows min(peak, FLOPs / traffic x bandwidth) per kernel; a pass's share of the fp32 peak is its
useful FLOPs (dilated_attn.cli.measure.flops) over the sum of its kernels' times. The proxy's measured shares (an H100's or
H200's SM has Pascal's 128 fp32 lanes a clock, 64K registers and 32 shared-memory banks) carry over to a Pascal GPU
wherever they are below the requested bound: then its memory does not cap them.
"""

from __future__ import annotations

import argparse
import json
import math

import torch

from dilated_attn.cli.measure import LONGNET, flops
from dilated_attn.spec import Problem

# fp32 peak (TFLOP/s), DRAM bandwidth (GB/s), SMs, L2 (MiB), and the tile table each runs (csrc/cuda/launch.h)
GPUS = {
    "GTX 1080 (GP104, sm_61)": dict(peak=8.9, bandwidth=320.0, sms=20, l2_mib=2, table="pascal"),
    "Tesla P100 (GP100, sm_60)": dict(peak=10.6, bandwidth=732.0, sms=56, l2_mib=4, table="gp100"),
}
# Pascal's tables (csrc/cuda/attention_fwd.cu, attention_bwd.cu): queries (m) and keys (n) a block or step. The
# P100's differs in dQ's blocks only, of 32 queries so that two fit its 64 KiB an SM.
TILES = {
    "pascal": dict(forward=dict(m=64, n=64), dq=dict(m=64, n=64), dkdv=dict(m=32, n=64)),
    "gp100": dict(forward=dict(m=64, n=64), dq=dict(m=32, n=64), dkdv=dict(m=32, n=64)),
}
SEQ_LEN, HEADS = 16384, 16
BRANCHES = LONGNET
CONFIGS = [("float32", 64), ("float32", 128), ("bfloat16", 128)]
FP32 = 4


def segments():
    """(members, count) of the (head, segment) problems of every branch: each a dense m x m attention."""
    for w, r in zip(*BRANCHES):
        w = min(w, SEQ_LEN)
        yield math.ceil(w / r), HEADS * (SEQ_LEN // w)


def kernel_costs(tiles: dict, dim: int, size: int) -> dict:
    """kernel -> (executed FLOPs, requested bytes, unique bytes) over all branches, at `tiles` (a TILES entry)."""
    costs = {k: [0.0, 0.0, 0.0] for k in ("forward", "delta", "dq", "dkdv")}
    for m, count in segments():
        def add(kernel, flops, requested, unique):
            costs[kernel][0] += count * flops
            costs[kernel][1] += count * requested
            costs[kernel][2] += count * unique

        t = tiles["forward"]  # Q^T, K^T and V per key step; O and the LSE read and written once
        blocks, steps = math.ceil(m / t["m"]), math.ceil(m / t["n"])
        add("forward", 4 * m * m * dim,
            blocks * (steps * (t["m"] + 2 * t["n"]) * dim * size + t["m"] * (2 * dim * size + 2 * FP32)),
            m * (5 * dim * size + 2 * FP32))
        t = tiles["dq"]  # Q^T, dO^T, K^T, V^T and K's rows per key step; LSE, delta; dQ (fp32) read and written
        blocks, steps = math.ceil(m / t["m"]), math.ceil(m / t["n"])
        add("dq", 6 * m * m * dim,
            blocks * (steps * (2 * t["m"] + 3 * t["n"]) * dim * size + t["m"] * (2 * FP32 + 2 * dim * FP32)),
            m * (4 * dim * size + 2 * FP32 + 2 * dim * FP32))
        t = tiles["dkdv"]  # K^T, V^T, Q^T, dO^T, Q's and dO's rows, LSE, delta per query step; dK, dV (fp32)
        blocks, steps = math.ceil(m / t["n"]), math.ceil(m / t["m"])
        add("dkdv", 8 * m * m * dim,
            blocks * (steps * ((2 * t["n"] + 4 * t["m"]) * dim * size + 2 * t["m"] * FP32) + 4 * t["n"] * dim * FP32),
            m * (4 * dim * size + 2 * FP32 + 4 * dim * FP32))
        add("delta", 2 * m * dim, m * (2 * dim * size + FP32), m * (2 * dim * size + FP32))
    return {k: tuple(v) for k, v in costs.items()}


def useful_flops(dim: int, backward: bool) -> float:
    """dilated_attn.cli.measure.flops for this configuration (the FLOPs the benchmarks' rates count)."""
    p = Problem.from_sizes(1, SEQ_LEN, HEADS, HEADS, dim, *BRANCHES, dtype=torch.float32, device="cpu")
    return flops(p, backward=backward)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--proxy", default=None, help="bench_cuda_kernels.py JSON: the proxy's measured shares beside")
    ap.add_argument("--out", default=None, help="JSON path for the table")
    args = ap.parse_args()
    proxy = {}
    if args.proxy:
        with open(args.proxy) as f:
            record = json.load(f)
        proxy = {(r["table"], r["dtype"], r["head_dim"]): r for r in record["rows"]}
        print(f"proxy: {record['device']['name']}, fp32 FMA peak {record['fp32_fma_peak_tflops']:.1f} TFLOP/s")
    rows = []
    for gpu, g in GPUS.items():
        print(f"\n{gpu}, tile table {g['table']}: {g['peak']} TFLOP/s fp32, {g['bandwidth']:.0f} GB/s "
              f"(ridge {g['peak'] * 1e3 / g['bandwidth']:.1f} FLOP/B), {g['l2_mib']} MiB L2")
        for dtype, dim in CONFIGS:
            costs = kernel_costs(TILES[g["table"]], dim, FP32 if dtype == "float32" else 2)
            row = dict(gpu=gpu, table=g["table"], dtype=dtype, head_dim=dim, kernels={})
            for bound, index in (("requested", 1), ("unique", 2)):
                seconds = {}
                for kernel, c in costs.items():
                    seconds[kernel] = max(c[0] / (g["peak"] * 1e12), c[index] / (g["bandwidth"] * 1e9))
                    row["kernels"].setdefault(kernel, {}).update(
                        flops=c[0], **{f"{bound}_bytes": c[index],
                                       f"{bound}_flop_per_byte": c[0] / c[index],
                                       f"{bound}_share_of_peak": c[0] / seconds[kernel] / (g["peak"] * 1e12)})
                fwd = seconds["forward"]
                fwd_bwd = sum(seconds.values())
                row[f"{bound}_fwd_pct"] = 100 * useful_flops(dim, False) / fwd / (g["peak"] * 1e12)
                row[f"{bound}_fwd_bwd_pct"] = 100 * useful_flops(dim, True) / fwd_bwd / (g["peak"] * 1e12)
            measured = proxy.get((g["table"], dtype, dim))
            if measured:
                row["proxy_fwd_pct"] = measured["fwd_pct_of_peak"]
                row["proxy_fwd_bwd_pct"] = measured["fwd_bwd_pct_of_peak"]
            rows.append(row)
            k = row["kernels"]
            print(f"  {dtype:>8} D{dim:<3}  FLOP/B requested (unique): "
                  + ", ".join(f"{name} {k[name]['requested_flop_per_byte']:.1f} ({k[name]['unique_flop_per_byte']:.0f})"
                              for name in ("forward", "dq", "dkdv"))
                  + f"\n{'':16}roofline allows forward {row['requested_fwd_pct']:.0f}-{row['unique_fwd_pct']:.0f}%, "
                  f"forward+backward {row['requested_fwd_bwd_pct']:.0f}-{row['unique_fwd_bwd_pct']:.0f}% of the fp32 peak"
                  + (f"; proxy measured {row['proxy_fwd_pct']:.1f}% / {row['proxy_fwd_bwd_pct']:.1f}%"
                     if measured else ""))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(command="python benchmarks/pascal_roofline.py" + (f" --proxy {args.proxy}" if args.proxy
                                                                               else ""),
                           seq_len=SEQ_LEN, heads=HEADS, branches=BRANCHES, tiles=TILES, gpus=GPUS, rows=rows),
                      f, indent=1)
        print("wrote", args.out)


if __name__ == "__main__":
    main()
