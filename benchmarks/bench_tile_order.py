"""Does the order in which the Triton forward kernel visits (batch, head, segment) tiles matter?

    python benchmarks/bench_tile_order.py            # bf16, D=128, H=16, MHA and GQA, N = 16384 .. 262144

Orders (dilated_attn.backends.triton.ops.TILE_ORDERS): plain (batch, head, segment), segment (the heads of a
segment together, so GQA heads that share K/V rows run at the same time), hilbert (a generalized Hilbert
curve over the (head, segment) grid). Configurations: N = 16384 and 65536 with the LongNet branches (2048,1),
(4096,2), (8192,4), (16384,8), N = 262144 with (2048,1), (8192,4), (32768,16), (131072,64); each with 16 and
with 2 K/V heads. Each configuration is timed in --rounds interleaved rounds (every order once per round,
medians over --repeats runs after --warmup runs, dilated_attn.cli.measure.median_ms); an order "wins" only if
its slowest round beats plain's fastest round, i.e. by more than the run-to-run spread. JSON goes to
benchmarks/results/tile_order_<device>.json (or --out), rewritten after every row.
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch
import triton

import dilated_attn
from dilated_attn.backends.triton import ops as triton_ops
from dilated_attn.cli.measure import (
    LONGNET,
    LONGNET_LONG,
    Record,
    attention_call,
    median_ms,
    random_inputs,
    say,
    tflops,
)
from dilated_attn.spec import validate

CONFIGS = [  # (N, branches, Hkv)
    (16384, LONGNET, 16), (65536, LONGNET, 16), (262144, LONGNET_LONG, 16),
    (16384, LONGNET, 2), (65536, LONGNET, 2), (262144, LONGNET_LONG, 2),
]
H, D, DTYPE = 16, 128, torch.bfloat16


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--warmup", type=int, default=3, help="untimed runs per order and round (the first compiles)")
    ap.add_argument("--repeats", type=int, default=20, help="timed runs per order and round")
    ap.add_argument("--out", default=None, help="JSON path (default: benchmarks/results/tile_order_<device>.json)")
    args = ap.parse_args(argv)
    dev = torch.cuda.get_device_name()
    say(f"device: {dev}; torch {torch.__version__}; triton {triton.__version__}")
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                   f"tile_order_{dev.replace(' ', '_')}.json")
    record = Record("tile_order", "cuda", dict(heads=H, head_dim=D, dtype="bfloat16", causal=args.causal,
                                               rounds=args.rounds, warmup=args.warmup, repeats=args.repeats),
                    json_path=out)
    chosen = triton_ops.TILE_ORDER  # what the launcher reads on every call; restored at the end
    try:
        for N, (segs, dils), hkv in CONFIGS:
            inputs = random_inputs(1, N, H, D, kv_heads=hkv, dtype=DTYPE, device="cuda")
            call = attention_call(lambda q, k, v: dilated_attn.dilated_attention(
                q, k, v, segs, dils, causal=args.causal, backend="triton"), inputs, "fwd")

            times = {o: [] for o in triton_ops.TILE_ORDERS}
            for _ in range(args.rounds):
                for order in triton_ops.TILE_ORDERS:
                    triton_ops.TILE_ORDER = order
                    times[order].append(median_ms(call, "cuda", args.warmup, args.repeats))
            p = validate(*inputs[:3], segs, dils, causal=args.causal)
            median = {o: statistics.median(t) for o, t in times.items()}
            best_plain = min(times["plain"])
            row = dict(N=N, heads=H, kv_heads=hkv, head_dim=D, dtype="bfloat16", causal=args.causal,
                       branches=list(zip(segs, dils)), times_ms=times, median_ms=median,
                       tflops={o: tflops(p, ms, backward=False) for o, ms in median.items()},
                       wins={o: max(t) < best_plain for o, t in times.items() if o != "plain"})
            record.add(row)
            say(f"N={N:>6} Hkv={hkv:>2}: " + "  ".join(
                f"{o} {median[o]:.3f} ms ({median[o] / median['plain']:.3f}x, spread {max(t) - min(t):.3f})"
                for o, t in times.items()) + f"  wins: {[o for o, w in row['wins'].items() if w] or 'none'}")
            del inputs, call
            torch.cuda.empty_cache()
    finally:
        triton_ops.TILE_ORDER = chosen
    record.close()


if __name__ == "__main__":
    main()
