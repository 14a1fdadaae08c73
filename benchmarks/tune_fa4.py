"""FlashAttention-4's forward options for the fa4 backend: each candidate (tile and pipeline flags of its Hopper
forward) timed on the fa4 backend's LongNet forward, beside the cudnn backend, in one run.

    python benchmarks/tune_fa4.py                      # bf16, H=16, D=128, N=65536, LongNet branches, causal and not
    python benchmarks/tune_fa4.py --rounds 6 --candidates 0,7,9 --mode both   # three candidates, also fwd+bwd
    python benchmarks/tune_fa4.py --backward --rounds 5                          # the backward's variants
    python benchmarks/tune_fa4.py --backward --variants 0,1 --causal yes         # one stream against two

Rows, for each causal setting:
  cudnn         the cudnn backend's forward (the yardstick of the fa4 backend's forward)
  fa4 <opts>    the fa4 backend's forward with the candidate as FlashAttention-4's options ({}: its own choice)
  dense <opts>  FlashAttention-4 alone on the first branch's shape ([N/2048, 2048, H, D]) with the candidate
                (forward only)
With --mode fwd+bwd or both, the backends' forward+backward too (the options change its forward). With --serial,
each fa4 row also with every call on the caller's stream (`... serial`), in the same run.
With --backward, the backward's options instead, forward+backward: its calls on one stream or alternating between
two (with one stream, the forward's calls are on one stream too), the most bytes one call holds beside the gradients
(ops.MAX_BACKWARD_CALL_BYTES, in MiB; a causal call takes ops.CAUSAL_BACKWARD_FACTOR times that), and
FlashAttention-4's Hopper backward tile (BACKWARD_TILES; `other`: its causal tile for non-causal inputs and the
reverse), each with the extra memory of one call and its gradients' max difference from the first variant's.
The GPU is brought to its sustained clock before the rounds (settle_clock).
Each candidate's output is checked against the first candidate's (the max difference in the JSON; bf16 rounds at
about 4e-3 of the values' scale). A candidate the kernel cannot build is recorded with its error. The providers are
timed in turn for --rounds rounds, each round starting with the next provider; a row gives the median of its round
medians (dilated_attn.cli.measure.median_ms, L2 flushed). A candidate that wins goes into backends/fa4/ops.py's
_forward_options by hand, with the run that chose it. The variants are set by fa4_settings, which replaces the backend's
private _forward_options and _second_stream for the timed calls: the package has no switch for them.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics

import torch

import dilated_attn
from dilated_attn import backends
from dilated_attn.cli.measure import (
    LONGNET,
    Record,
    attention_call,
    flops,
    in_turn,
    median_ms,
    peak_memory_bytes,
    random_inputs,
    say,
    settle_clock,
)
from dilated_attn.spec import validate

CANDIDATES = [
    {},  # FlashAttention-4's choice (4.0.0b36, Hopper, D = 128: 128 x 128, P from registers, intra-warpgroup overlap)
    dict(tile_mn=(128, 176)),  # FlashAttention-3's non-causal tile for D = 128
    dict(tile_mn=(128, 160)),
    dict(tile_mn=(128, 144)),
    dict(tile_mn=(128, 192)),
    dict(tile_mn=(128, 112)),
    dict(tile_mn=(128, 176), mma_pv_is_rs=False),
    dict(tile_mn=(128, 128), mma_pv_is_rs=False),
    dict(tile_mn=(128, 128), intra_wg_overlap=False),
    dict(tile_mn=(192, 128), mma_pv_is_rs=False),  # FlashAttention-4's tile for D <= 96
    dict(tile_mn=(192, 112), mma_pv_is_rs=False),
    dict(tile_mn=(128, 112), mma_pv_is_rs=False),
    dict(tile_mn=(128, 144), mma_pv_is_rs=False),
]


# FlashAttention-4's Hopper backward tiles for D = 128 (flash_attn.cute.interface._tile_size_bwd_sm90, 4.0.0b36):
# non-causal 80 x 128 with dQ swapped, causal 64 x 128. `other` runs the other one.
BACKWARD_TILES = {
    False: dict(m_block_size=80, n_block_size=128, num_stages_Q=2, num_stages_dO=2, num_stages_PdS=2,
                SdP_swapAB=True, dKV_swapAB=False, dQ_swapAB=True, AtomLayoutMSdP=1, AtomLayoutNdKV=2,
                AtomLayoutMdQ=1),
    True: dict(m_block_size=64, n_block_size=128, num_stages_Q=2, num_stages_dO=2, num_stages_PdS=2,
               SdP_swapAB=True, dKV_swapAB=False, dQ_swapAB=False, AtomLayoutMSdP=1, AtomLayoutNdKV=2,
               AtomLayoutMdQ=1),
}
# (two streams, MiB per call, tile); the first is the shipped choice (each variant's gradients are compared with it)
BACKWARD_VARIANTS = [(True, 80, "own"), (True, 320, "own"), (True, 160, "own"), (True, 40, "own"), (False, 80, "own"),
                     (False, 160, "own"), (True, 80, "other"), (True, 320, "other"), (True, 85, "own")]


@contextlib.contextmanager
def fa4_settings(ops, options=None, overlap=True, backward_bytes=None):
    """Inside: the fa4 backend's forward calls take FlashAttention-4 `options` (None: its own choice), its calls run
    on the caller's stream alone unless `overlap`, and a backward call holds at most `backward_bytes` beside the
    gradients (None: ops.MAX_BACKWARD_CALL_BYTES)."""
    saved = ops._forward_options, ops._second_stream, ops.MAX_BACKWARD_CALL_BYTES
    if options is not None:
        ops._forward_options = lambda q, causal: options
    if not overlap:
        ops._second_stream = lambda like: None
    if backward_bytes is not None:
        ops.MAX_BACKWARD_CALL_BYTES = backward_bytes
    try:
        yield
    finally:
        ops._forward_options, ops._second_stream, ops.MAX_BACKWARD_CALL_BYTES = saved


def label(options: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in options.items()) or "default"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq-len", type=int, default=65536)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=None, help="key/value heads (default: --heads)")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--causal", choices=["no", "yes", "both"], default="both")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--candidates", default=None, help="indices into CANDIDATES (default: all)")
    ap.add_argument("--mode", choices=["fwd", "fwd+bwd", "both"], default="fwd")
    ap.add_argument("--serial", action="store_true",
                    help="also each candidate with the calls on one stream")
    ap.add_argument("--backward", action="store_true",
                    help="the backward's variants (BACKWARD_VARIANTS), forward+backward, instead of forward tiles")
    ap.add_argument("--variants", default=None, help="with --backward: indices into BACKWARD_VARIANTS (default: all)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    backends.get("fa4").ops()  # loads flash-attn-4, or says why not
    from flash_attn.cute import interface as fa

    from dilated_attn.backends.fa4 import ops

    dev = torch.device("cuda")
    segs, dils = LONGNET
    N, H, D = args.seq_len, args.heads, args.head_dim
    candidates = CANDIDATES if args.candidates is None else [CANDIDATES[int(i)] for i in args.candidates.split(",")]
    modes = ["fwd", "fwd+bwd"] if args.mode == "both" else [args.mode]
    inputs = random_inputs(1, N, H, D, kv_heads=args.kv_heads, dtype=torch.bfloat16, device=dev)
    q, k, v = (x.detach() for x in inputs[:3])
    first = segs[0]
    cut = [x.reshape(-1, first, x.shape[2], D) for x in (q, k, v)]
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                   f"tune_fa4_{torch.cuda.get_device_name(dev).replace(' ', '_')}.json")
    name = "fa4_backward_variants" if args.backward else "fa4_forward_options"
    config = dict(N=N, heads=H, kv_heads=k.shape[2], head_dim=D, dtype="bfloat16", segment_lengths=segs,
                  dilation_rates=dils, warmup=args.warmup, repeats=args.repeats, rounds=args.rounds, mode=args.mode)
    record = Record(name, dev, config, json_path=out)
    for causal in {"no": [False], "yes": [True], "both": [False, True]}[args.causal]:
        if args.backward:
            backward_variants(args, record, inputs, causal, fa, ops)
            continue
        work = flops(validate(q, k, v, segs, dils, causal=causal))
        dense_work = 4 * N * first * H * D * (0.5 if causal else 1.0)

        def backend(name, options=None, mode="fwd", overlap=True):
            def attention(q, k, v):
                return dilated_attn.dilated_attention(q, k, v, segs, dils, causal=causal, backend=name)

            call = attention_call(attention, inputs, mode)

            def run():
                with fa4_settings(ops, options, overlap):
                    return call()
            return run

        def dense(options):
            return lambda: fa._flash_attn_fwd(*cut, causal=causal, return_lse=True, **options)[0]

        providers = {f"cudnn {mode}": (backend("cudnn", None, mode), work * (3.5 if mode != "fwd" else 1.0))
                     for mode in modes}
        reference = None
        for options in candidates:
            name = label(options)
            try:
                with fa4_settings(ops, options):
                    result = dilated_attn.dilated_attention(q, k, v, segs, dils, causal=causal, backend="fa4")
                dense(options)()
                torch.cuda.synchronize()
            except Exception as exc:  # noqa: BLE001 - a tile the kernel cannot build is a result of the sweep
                error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
                say(f"causal={causal} {name}: cannot run ({error})")
                record.add(dict(causal=causal, provider=f"fa4 {name}", options=options, error=error))
                continue
            if reference is None:
                reference = result
            diff = (result.float() - reference.float()).abs().max().item()
            say(f"causal={causal} {name}: built, max difference from the default {diff:.2e}")
            for mode in modes:
                count = work * (3.5 if mode != "fwd" else 1.0)
                providers[f"fa4 {mode} {name}"] = (backend("fa4", options, mode), count, options, diff)
                if args.serial:
                    providers[f"fa4 {mode} {name} serial"] = (backend("fa4", options, mode, False), count, options,
                                                              diff)
            providers[f"dense fwd {name}"] = (dense(options), dense_work, options, None)
        samples = {name: [] for name in providers}
        settle_clock(dev)
        for name in in_turn(providers, args.rounds):
            samples[name].append(median_ms(providers[name][0], dev, args.warmup, args.repeats))
        for name, (fn, count, *rest) in providers.items():
            ms = statistics.median(samples[name])
            row = dict(causal=causal, provider=name, median_ms=ms, tflops=count / ms / 1e9,
                       round_medians_ms=samples[name])
            if rest:
                row.update(options=rest[0], max_difference=rest[1])
            mode = name.split()[1]
            if name.startswith("fa4"):
                row["speedup_vs_cudnn"] = statistics.median(samples[f"cudnn {mode}"]) / ms
            record.add(row)
            say(f"causal={causal} {name:>60}: {ms:7.3f} ms {row['tflops']:6.1f} TFLOP/s"
                + (f"  {row['speedup_vs_cudnn']:.3f}x cudnn" if name.startswith("fa4") else ""))
    record.close()


def backward_variants(args, record, inputs, causal, fa, ops) -> None:
    """BACKWARD_VARIANTS and the cudnn backend, forward+backward, timed in turn."""
    segs, dils = LONGNET
    dev = inputs.q.device
    work = 3.5 * flops(validate(*inputs[:3], segs, dils, causal=causal))
    own_tile = fa._tile_size_bwd_sm90

    def attention(backend):
        return lambda q, k, v: dilated_attn.dilated_attention(q, k, v, segs, dils, causal=causal, backend=backend)

    @contextlib.contextmanager
    def settings(lanes, mib, tile):
        if tile == "other":
            fa._tile_size_bwd_sm90 = lambda *a, **kw: fa.BwdConfig(**BACKWARD_TILES[not causal])
        try:
            with fa4_settings(ops, overlap=lanes, backward_bytes=mib << 20):
                yield
        finally:
            fa._tile_size_bwd_sm90 = own_tile

    def timed(variant):
        call = attention_call(attention("fa4"), inputs, "fwd+bwd")

        def run():
            with settings(*variant):
                call()
        return run

    cudnn = attention_call(attention("cudnn"), inputs, "fwd+bwd")
    providers = {"cudnn fwd+bwd": cudnn}
    facts = {"cudnn fwd+bwd": dict(extra_memory_gib=peak_memory_bytes(cudnn, dev) / 2**30)}
    reference = None
    chosen = [BACKWARD_VARIANTS[int(i)] for i in args.variants.split(",")] if args.variants else BACKWARD_VARIANTS
    for variant in chosen:
        lanes, mib, tile = variant
        streams = "two streams" if lanes else "one stream"
        per_call = mib * (ops.CAUSAL_BACKWARD_FACTOR if causal else 1)
        name = f"fa4 fwd+bwd {streams}, {per_call:g} MiB per call, {tile} tile"
        try:
            with settings(*variant):
                out = attention("fa4")(*inputs[:3])
                grads = torch.autograd.grad(out, inputs[:3], inputs.grad_out)
            extra = peak_memory_bytes(timed(variant), dev)
        except Exception as exc:  # noqa: BLE001 - a tile the kernel cannot build is a result of the sweep
            error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            say(f"causal={causal} {name}: cannot run ({error})")
            record.add(dict(causal=causal, provider=name, error=error))
            continue
        reference = reference or grads
        diff = max((g.float() - r.float()).abs().max().item() for g, r in zip(grads, reference))
        say(f"causal={causal} {name}: max gradient difference from the first {diff:.2e}")
        providers[name] = timed(variant)
        facts[name] = dict(two_streams=lanes, max_call_mib=mib, tile=tile, max_difference=diff,
                           extra_memory_gib=extra / 2**30)
    samples = {name: [] for name in providers}
    settle_clock(dev)
    for name in in_turn(providers, args.rounds):
        samples[name].append(median_ms(providers[name], dev, args.warmup, args.repeats))
    base = statistics.median(samples["cudnn fwd+bwd"])
    for name, times in samples.items():
        ms = statistics.median(times)
        row = dict(causal=causal, provider=name, median_ms=ms, tflops=work / ms / 1e9, round_medians_ms=times,
                   speedup_vs_cudnn=base / ms, **facts[name])
        record.add(row)
        say(f"causal={causal} {name:>44}: {ms:7.3f} ms {row['tflops']:6.1f} TFLOP/s  {base / ms:.3f}x cudnn"
            f"  extra {row['extra_memory_gib']:.2f} GiB")


if __name__ == "__main__":
    main()
