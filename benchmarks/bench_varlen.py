"""Packed sequences on the GPU: a pack of 16 documents against one uniform sequence of the same tokens and against
padding the pack to a batch.

    python benchmarks/bench_varlen.py                 # bf16, H=16, D=128, LongNet branches
    python benchmarks/bench_varlen.py --causal --out varlen.json
    python benchmarks/bench_varlen.py --eight --backends triton,cudnn,fa4   # 8 sequences, 64K tokens, per backend
    python benchmarks/bench_varlen.py --eight --ragged --backends triton,fa4  # their lengths off multiples of 2
    python benchmarks/bench_varlen.py --eight --kv-heads 4 --backends fa4      # grouped-query heads

Rows (each measured in this process, on the same GPU, forward and forward+backward):
  pack      dilated_attention_varlen over 16 sequences of 1K-16K tokens, 128K in all (LENGTHS; --eight: EIGHT;
            --ragged: the same tokens in sequences of odd lengths, RAGGED or RAGGED_EIGHT, so that their starts take
            every residue modulo the dilations)
  uniform   dilated_attention over one sequence of those 128K tokens ([1, 131072, H, D])
  padded    dilated_attention over the pack padded to a batch of 16 x 16K ([16, 16384, H, D]): what a user
            without varlen runs (padding keys then enter the short sequences' softmax: a cost only, not a result)
TFLOP/s count each sequence with its own length (segments clipped to it: dilated_attn.cli.measure.flops), so the pack's
and the uniform sequence's rates compare the kernels' speed, and padded's rate counts only the pack's work.
Times are medians of --repeats runs after --warmup (dilated_attn.cli.measure.median_ms, L2 flushed), on a GPU
brought to its sustained clock first (settle_clock), the providers timed in turn for --rounds rounds, each round
starting one provider further along, and the median of the round medians reported.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics

import torch
import triton

import dilated_attn
from dilated_attn.cli.measure import (
    LONGNET,
    Record,
    attention_call,
    flops,
    in_turn,
    median_ms,
    peak_memory_bytes,
    say,
    settle_clock,
)
from dilated_attn.spec import validate, validate_varlen

LENGTHS = [1024, 16384, 2048, 12288, 4096, 9216, 15360, 3072, 6144, 11264, 8192, 13312, 5120, 7168, 10240, 6144]
EIGHT = [4096, 12288, 2048, 16384, 6144, 10240, 8192, 6144]  # --eight: 8 sequences, 65536 tokens
# --ragged: the same totals in lengths of no common factor (each a few tokens off the above)
RAGGED = [1021, 16411, 2039, 12263, 4099, 9221, 15349, 3067, 6151, 11251, 8209, 13309, 5113, 7177, 10243, 6149]
RAGGED_EIGHT = [4001, 12289, 2085, 16373, 6150, 10233, 8275, 6130]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=None, help="key/value heads (default: --heads)")
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None, help="JSON path (default: benchmarks/results/varlen_<device>.json)")
    ap.add_argument("--eight", action="store_true", help="a pack of 8 sequences, 64K tokens (EIGHT), not 16")
    ap.add_argument("--ragged", action="store_true", help="the same tokens in sequences of odd lengths")
    ap.add_argument("--backends", default="triton",
                    help="comma-separated backends, each timed on the pack and the uniform sequence (padded: the first)")
    args = ap.parse_args(argv)
    dtype, H, D = getattr(torch, args.dtype), args.heads, args.dim
    Hkv = args.kv_heads or H
    if H % Hkv:
        raise ValueError(f"--kv-heads ({Hkv}) must divide --heads ({H})")
    dev = torch.cuda.get_device_name()
    say(f"device: {dev}; torch {torch.__version__}; triton {triton.__version__}")
    segs, dils = LONGNET
    lengths = {(False, False): LENGTHS, (True, False): EIGHT, (False, True): RAGGED,
               (True, True): RAGGED_EIGHT}[args.eight, args.ragged]
    T, longest = sum(lengths), max(lengths)
    g = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape):
        return torch.randn(shape, generator=g, device="cuda", dtype=dtype).requires_grad_()

    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device="cuda")
    packed = (randn(T, H, D), randn(T, Hkv, D), randn(T, Hkv, D), torch.randn(T, H, D, device="cuda", dtype=dtype))
    uniform = tuple(x.detach().unsqueeze(0).requires_grad_(x.requires_grad) for x in packed)
    padded = (randn(len(lengths), longest, H, D), randn(len(lengths), longest, Hkv, D),
              randn(len(lengths), longest, Hkv, D), torch.randn(len(lengths), longest, H, D, device="cuda", dtype=dtype))
    work = flops(validate_varlen(*packed[:3], cu, segs, dils, causal=args.causal))
    names = args.backends.split(",")
    providers = {}
    for b in names:
        suffix = "" if len(names) == 1 else f"_{b}"
        providers[f"pack{suffix}"] = (lambda q, k, v, b=b: dilated_attn.dilated_attention_varlen(
            q, k, v, cu, segs, dils, max_seqlen=longest, causal=args.causal, backend=b), packed, work)
        providers[f"uniform{suffix}"] = (lambda q, k, v, b=b: dilated_attn.dilated_attention(
            q, k, v, segs, dils, causal=args.causal, backend=b), uniform,
            flops(validate(*uniform[:3], segs, dils, causal=args.causal)))
    providers["padded"] = (lambda q, k, v: dilated_attn.dilated_attention(
        q, k, v, segs, dils, causal=args.causal, backend=names[0]), padded, work)
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                   f"varlen_{dev.replace(' ', '_')}.json")
    record = Record("varlen_pack", "cuda", dict(lengths=lengths, backends=names, heads=H, kv_heads=Hkv, head_dim=D,
                                                dtype=args.dtype, causal=args.causal, segment_lengths=segs,
                                                dilation_rates=dils, warmup=args.warmup, repeats=args.repeats,
                                                rounds=args.rounds),
                    json_path=out)
    for mode in ("fwd", "fwd+bwd"):
        samples = {name: [] for name in providers}
        settle_clock("cuda")
        for name in in_turn(providers, args.rounds):
            attention, inputs, _ = providers[name]
            samples[name].append(median_ms(attention_call(attention, inputs, mode), "cuda", args.warmup, args.repeats))
        for name, (attention, inputs, count) in providers.items():
            ms = statistics.median(samples[name])
            rate = count * (3.5 if mode == "fwd+bwd" else 1.0) / ms / 1e9
            extra = peak_memory_bytes(attention_call(attention, inputs, mode), "cuda")
            record.add(dict(provider=name, mode=mode, median_ms=ms, tflops=rate, round_medians_ms=samples[name],
                            extra_memory_gib=extra / 2**30))
            say(f"{name:>8} {mode:>7}: {ms:8.3f} ms  {rate:6.1f} TFLOP/s  extra {extra / 2**30:.2f} GiB")
        rows = {r["provider"]: r for r in record.rows if r["mode"] == mode}
        fastest_uniform = max(r["tflops"] for name, r in rows.items() if name.startswith("uniform"))
        for b in names:
            suffix = "" if len(names) == 1 else f"_{b}"
            pack = rows[f"pack{suffix}"]
            say(f"{mode} {b}: pack / uniform rate {pack['tflops'] / rows[f'uniform{suffix}']['tflops']:.3f}, "
                f"/ the fastest uniform {pack['tflops'] / fastest_uniform:.3f}")
        first_pack = rows["pack" if len(names) == 1 else f"pack_{names[0]}"]
        say(f"{mode}: padded / pack time {rows['padded']['median_ms'] / first_pack['median_ms']:.2f}")
    record.close()


if __name__ == "__main__":
    main()
