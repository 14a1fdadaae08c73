"""Does the order in which the Triton forward kernel visits (batch, head, segment) tiles matter?

    python benchmarks/bench_tile_order.py            # bf16, D=128, H=16, MHA and GQA, N = 16384 .. 262144

Orders (dilated_attn.triton.TILE_ORDERS): plain (batch, head, segment: the default), segment (the heads of
a segment together, so GQA heads that share K/V rows run at the same time), hilbert (a generalized Hilbert
curve over the (head, segment) grid). Each configuration is timed in --rounds interleaved rounds (every
order once per round, triton.testing.do_bench medians with warm-up); an order "wins" only if its slowest
round beats plain's fastest round, i.e. by more than the run-to-run spread. JSON goes to
benchmarks/results/tile_order_<device>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import datetime, timezone

import torch
import triton
import triton.testing

import dilated_attn
from dilated_attn import triton as triton_backend
from dilated_attn.spec import flops, validate

LONGNET = ([2048, 4096, 8192, 16384], [1, 2, 4, 8])
LONGNET_LONG = ([2048, 8192, 32768, 131072], [1, 4, 16, 64])
CONFIGS = [  # (N, branches, Hkv)
    (16384, LONGNET, 16), (65536, LONGNET, 16), (262144, LONGNET_LONG, 16),
    (16384, LONGNET, 2), (65536, LONGNET, 2), (262144, LONGNET_LONG, 2),
]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    dev = torch.cuda.get_device_name()
    print(f"device: {dev}; torch {torch.__version__}; triton {triton.__version__}", flush=True)
    rows = []
    for N, (segs, dils), hkv in CONFIGS:
        gen = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(1, N, 16, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
        k, v = (torch.randn(1, N, hkv, 128, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))

        def call():
            dilated_attn.dilated_attention(q, k, v, segs, dils, causal=args.causal, backend="triton")

        times = {o: [] for o in triton_backend.TILE_ORDERS}
        for _ in range(args.rounds):
            for order in triton_backend.TILE_ORDERS:
                triton_backend.TILE_ORDER = order
                call()  # tables and compilation outside the timing
                times[order].append(triton.testing.do_bench(call, warmup=25, rep=200, return_mode="median"))
        triton_backend.TILE_ORDER = "plain"
        f = flops(validate(q, k, v, segs, dils, causal=args.causal))
        best_plain = min(times["plain"])
        row = dict(N=N, heads=16, kv_heads=hkv, head_dim=128, dtype="bfloat16", causal=args.causal,
                   branches=list(zip(segs, dils)), times_ms=times,
                   median_ms={o: sorted(t)[len(t) // 2] for o, t in times.items()},
                   tflops={o: f / (sorted(t)[len(t) // 2]) / 1e9 for o, t in times.items()},
                   wins={o: max(t) < best_plain for o, t in times.items() if o != "plain"})
        rows.append(row)
        med = row["median_ms"]
        print(f"N={N:>6} Hkv={hkv:>2}: " + "  ".join(
            f"{o} {med[o]:.3f} ms ({med[o] / med['plain']:.3f}x, spread {max(t) - min(t):.3f})"
            for o, t in times.items()) + f"  wins: {[o for o, w in row['wins'].items() if w] or 'none'}",
            flush=True)
        del q, k, v
        torch.cuda.empty_cache()
    record = dict(benchmark="tile_order", command=" ".join(["python", *sys.argv]),
                  date=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                  device=dict(name=dev, capability=".".join(map(str, torch.cuda.get_device_capability()))),
                  versions=dict(torch=torch.__version__, triton=triton.__version__), results=rows)
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                   f"tile_order_{dev.replace(' ', '_')}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as fh:
        json.dump(record, fh, indent=2)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
