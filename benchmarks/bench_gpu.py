"""GPU benchmark: dilated_attn's GPU backends against what users run today, all in one run.

    python benchmarks/bench_gpu.py                 # bf16, B=1, H=16, D=128: the four configurations below
    python benchmarks/bench_gpu.py --quick         # the N = 65536 non-causal configuration only
    python benchmarks/bench_gpu.py --providers triton,triton_sweep --rounds 5   # shipped configs vs the sweep
    python benchmarks/bench_gpu.py --quick --providers cudnn,triton --kv-heads 16,4,1   # grouped-query heads

Configurations: N = 65536 with the LongNet branches (2048,1), (4096,2), (8192,4), (16384,8), non-causal and
causal; N = 16384 with the same branches; N = 262144 with the long branches (2048,1), (8192,4), (32768,16),
(131072,64) (dilated_attn.cli.measure.LONGNET, LONGNET_LONG).

Providers (each measured in the same process, on the same inputs):
  triton, cudnn, fa4, cuda    dilated_attn's backends (where they can run); triton with the shipped configs
  auto                        dilated_attn's default (backend="auto"): what it picks, with the dispatch's host time
  fa4_interface               fa4 with every FlashAttention-4 call, forward and backward, through its Python
                              interface (the direct calls of backends/fa4/direct.py off)
  triton_sweep                triton with DILATED_ATTN_AUTOTUNE's full sweep instead of the shipped configs
  sdpa_recipe                 gather + flash SDPA + LSE merge (torchscale's recipe, benchmarks/baselines.py)
  sdpa_recipe_cudnn           the same with cuDNN attention
  sdpa_recipe_compiled        the flash recipe under torch.compile
  sdpa_recipe_cudnn_compiled  the cuDNN recipe under torch.compile: the strongest baseline
  dense_cudnn                 dense cuDNN SDPA over the whole sequence, for scale (N <= 65536)
  segments_cudnn, segments_fa4
                              dense cuDNN SDPA / FlashAttention-4 over sequences of the first segment length
                              (the first branch's shape alone, where its dilation is 1): the kernels' ceiling;
                              with segments_fa4, each row gives its rate as a fraction of that one's
                              (of_segments_fa4_rate: the same kernel's dense rate on the same work; with
                              --rounds > 1 also of_segments_fa4_rate_by_round, the median of each round's ratio)
The device's fp32 FMA peak is measured first (the CUDA kernels' yardstick: they use no tensor cores), and
every row also gives its fraction of it. Times are medians over --repeats runs after --warmup runs
(dilated_attn.cli.measure.median_ms: CUDA events, L2 flushed before each run), after a few seconds of load that
bring the GPU to its sustained clock (settle_clock); with --rounds R the providers of a configuration are timed in
turn R times, each round starting with the next provider, and a row gives the median of its R medians; TFLOP/s use
FLOPs = 4*B*H*N*D*sum_i(w_i/r_i^2) forward (half with causal), x3.5 for forward+backward; with --gpu-state each
round also records the GPU's SM clock, power draw, temperature and clock-event reasons read while it ran
(dilated_attn.cli.measure.GpuSampler), which tell a GPU's state from the host's in rounds of unequal speed;
"host" is the median time one call takes to return, started on an idle GPU (host_ms; where it nears the GPU time,
the host bounds the call); "extra memory" is the peak allocated above the inputs during one call, "working memory"
that less the results every provider must hold (out, and with the backward its float32 LSE, dQ, dK and dV:
results_bytes). Before timing, the Triton kernels (shipped configs) and the cudnn backend are checked against
dilated_attn.reference at N = 16384. The JSON (benchmarks/results/gpu_<device>_<dtype>.json, or --out) is rewritten
after every row.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys

import torch
import triton
import triton.language as tl

import dilated_attn
from dilated_attn import backends
from dilated_attn.cli.measure import (
    LONGNET,
    LONGNET_LONG,
    GpuSampler,
    Record,
    attention_call,
    host_ms,
    in_turn,
    median_ms,
    peak_memory_bytes,
    random_inputs,
    say,
    settle_clock,
    tflops,
)
from dilated_attn.reference import dilated_attention_reference
from dilated_attn.spec import validate

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from baselines import compiled_recipe, gather_sdpa_merge

PRESETS = [  # (N, branches, causal)
    (65536, LONGNET, False),
    (65536, LONGNET, True),
    (16384, LONGNET, False),
    (262144, LONGNET_LONG, False),
]


def results_bytes(inputs, backward: bool) -> int:
    """Bytes of what a call must hold whatever runs it: out like q, and with the backward the float32 LSE it reads
    and the gradients of q, k and v."""
    q, k, v = inputs.q, inputs.k, inputs.v
    if not backward:
        return q.numel() * q.element_size()
    lse = q.numel() // q.shape[-1] * 4
    return q.numel() * q.element_size() + lse + sum(x.numel() * x.element_size() for x in (q, k, v))


def providers(N, segs, dils, causal):
    """name -> attention(q, k, v) for this configuration."""
    def ours(backend):
        return lambda q, k, v: dilated_attn.dilated_attention(q, k, v, segs, dils, causal=causal, backend=backend)

    table = {
        "triton": ours("triton"),
        "triton_sweep": ours("triton"),  # run with configs.AUTOTUNE set (main)
        "cudnn": ours("cudnn"),
        "fa4": ours("fa4"),
        "auto": ours("auto"),
        "fa4_interface": ours("fa4"),  # timed with direct calls off (without_direct_calls)
        "cuda": ours("cuda"),
        "sdpa_recipe": lambda q, k, v: gather_sdpa_merge(q, k, v, segs, dils, causal=causal),
        "sdpa_recipe_cudnn": lambda q, k, v: gather_sdpa_merge(q, k, v, segs, dils, causal=causal, kernel="cudnn"),
        "sdpa_recipe_compiled": lambda q, k, v: compiled_recipe("flash")(q, k, v, segs, dils, causal=causal),
        "sdpa_recipe_cudnn_compiled":
            lambda q, k, v: compiled_recipe("cudnn")(q, k, v, segs, dils, causal=causal),
    }
    if N <= 65536:
        def dense(q, k, v):
            with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
                return torch.nn.functional.scaled_dot_product_attention(
                    q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal).transpose(1, 2)
        table["dense_cudnn"] = dense
    first = segs[0] if dils[0] == 1 else None
    if first and N % first == 0:  # the first branch's shape alone: dense attention over sequences of w_0
        def segments(kernel):
            def run(q, k, v):
                cut = [x.reshape(-1, first, *x.shape[2:]) for x in (q, k, v)]
                if kernel == "fa4":
                    from flash_attn.cute import flash_attn_func
                    return flash_attn_func(*cut, causal=causal)[0].reshape(q.shape)  # (out, lse)
                with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
                    return torch.nn.functional.scaled_dot_product_attention(
                        *(x.transpose(1, 2) for x in cut), is_causal=causal).transpose(1, 2).reshape(q.shape)
            return run
        table["segments_cudnn"] = segments("cudnn")
        table["segments_fa4"] = segments("fa4")
    return table


@contextlib.contextmanager
def without_direct_calls(on: bool):
    """Inside, with `on`, every FlashAttention-4 call of the fa4 backend, forward and backward, goes through its Python
    interface (backends/fa4/direct.py off): the `fa4_interface` provider, whose backward runs after its call
    returns."""
    if not on:
        yield
        return
    from dilated_attn.backends.fa4 import direct

    enabled, direct.ENABLED = direct.ENABLED, False
    try:
        yield
    finally:
        direct.ENABLED = enabled


@contextlib.contextmanager
def full_sweep(on: bool):
    """Inside, with `on`, the Triton kernels sweep their candidates (DILATED_ATTN_AUTOTUNE=1's behaviour: the first
    call of each key benchmarks every config that fits) instead of running the shipped configs."""
    if not on:
        yield
        return
    from dilated_attn.backends.triton import configs

    configs.AUTOTUNE = True
    try:
        yield
    finally:
        configs.AUTOTUNE = False


def check_tuned_kernels(dtype, head_dim, heads):
    """The Triton kernels (shipped configs) and the cudnn backend at N = 16384 against the reference (float32 compute):
    relative errors, under "<backend>/<causal or noncausal>"."""
    q, k, v, go = random_inputs(1, 16384, heads, head_dim, dtype=dtype, device="cuda", seed=1)
    problem = validate(q, k, v, *LONGNET)
    report = {}
    for causal in (False, True):
        ref = dilated_attention_reference(q, k, v, *LONGNET, causal=causal, compute_dtype=torch.float32)[0]
        ref_grads = torch.autograd.grad(ref, (q, k, v), go)
        for backend in ("triton", "cudnn", "fa4"):
            if backends.get(backend).why_not(problem) is not None:
                continue
            out = dilated_attn.dilated_attention(q, k, v, *LONGNET, causal=causal, backend=backend)
            grads = torch.autograd.grad(out, (q, k, v), go)
            rel = lambda a, b: ((a.float() - b.float()).norm() / b.float().norm()).item()  # noqa: E731
            report[f"{backend}/{'causal' if causal else 'noncausal'}"] = dict(
                out=rel(out, ref), **{f"grad_{n}": rel(a, b) for n, a, b in zip("qkv", grads, ref_grads)})
    return report


@triton.jit
def _fma_chains(X, ITERS: tl.constexpr, BLOCK: tl.constexpr):
    # Eight independent FMA chains per element keep every FP32 lane busy; the result is stored so that
    # nothing is optimised away.
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + offs)
    a, b, c, d, e, f, g, h = x, x + 1, x + 2, x + 3, x + 4, x + 5, x + 6, x + 7
    for _ in range(ITERS):
        a = a * 0.9999 + 0.5
        b = b * 0.9999 + 0.5
        c = c * 0.9999 + 0.5
        d = d * 0.9999 + 0.5
        e = e * 0.9999 + 0.5
        f = f * 0.9999 + 0.5
        g = g * 0.9999 + 0.5
        h = h * 0.9999 + 0.5
    tl.store(X + offs, a + b + c + d + e + f + g + h)


def fp32_fma_peak(warmup, repeats):
    """The device's measured fp32 FMA throughput in TFLOP/s (2 FLOPs per FMA): the bar of the CUDA
    kernels, which use no tensor cores."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    block, iters = 1024, 4096
    x = torch.rand(sms * 16 * block, device="cuda")
    grid = (x.numel() // block,)
    ms = median_ms(lambda: _fma_chains[grid](x, ITERS=iters, BLOCK=block, num_warps=8), "cuda", warmup, repeats)
    return 2.0 * 8 * iters * x.numel() / ms / 1e9


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="only N = 65536, non-causal")
    ap.add_argument("--presets", default=None,
                    help="comma-separated indices of the configurations above (0: N = 65536, 1: its causal twin, ...)")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", default=None,
                    help="comma-separated kv head counts, each a run of the configurations (default: --heads)")
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--providers", default=None, help="comma-separated subset")
    ap.add_argument("--warmup", type=int, default=3, help="untimed runs first (the first compiles; triton_sweep's "
                    "first also sweeps)")
    ap.add_argument("--repeats", type=int, default=20, help="timed runs per round; their median is the round's")
    ap.add_argument("--rounds", type=int, default=1,
                    help="rounds, each timing every provider in turn; a row reports the median of its rounds")
    ap.add_argument("--gpu-state", action="store_true",
                    help="read the GPU's SM clock, power, temperature and clock-event reasons during each round "
                    "(nvidia-smi on a thread, every 0.2 s): each row's round_gpu_state")
    ap.add_argument("--out", default=None, help="JSON path (default: benchmarks/results/gpu_<device>_<dtype>.json)")
    args = ap.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    dev = torch.cuda.get_device_name()
    say(f"device: {dev}; torch {torch.__version__}; triton {triton.__version__}")

    peak = fp32_fma_peak(args.warmup, args.repeats)
    say(f"measured fp32 FMA peak: {peak:.1f} TFLOP/s")
    check = check_tuned_kernels(dtype, args.dim, args.heads)
    say("tuned Triton kernels vs reference (relative error):", json.dumps(check))

    out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                   f"gpu_{dev.replace(' ', '_')}_{args.dtype}.json")
    record = Record("gpu_backends_vs_baselines", "cuda",
                    dict(batch=1, heads=args.heads, head_dim=args.dim, dtype=args.dtype, warmup=args.warmup,
                         repeats=args.repeats, rounds=args.rounds),
                    json_path=out, fp32_fma_peak_tflops=peak, tuned_kernel_check=check)
    presets = PRESETS[:1] if args.quick else PRESETS
    if args.presets:
        presets = [PRESETS[int(i)] for i in args.presets.split(",")]
    kv_counts = [int(n) for n in args.kv_heads.split(",")] if args.kv_heads else [args.heads]
    for kv_heads, (N, (segs, dils), causal) in ((kv, preset) for kv in kv_counts for preset in presets):
        inputs = random_inputs(1, N, args.heads, args.dim, kv_heads=kv_heads, dtype=dtype, device="cuda")
        problem = validate(*inputs[:3], segs, dils, causal=causal)
        where = f"N={N:>6} Hkv={kv_heads:>2} causal={causal!s:5}"
        runnable = {}
        for name, attention in providers(N, segs, dils, causal).items():
            if args.providers and name not in args.providers.split(","):
                continue
            backend = "fa4" if name == "fa4_interface" else name
            reason = backends.get(backend).why_not(problem) if backend in backends.REGISTRY else None
            if reason:
                say(f"{where} {name:>20}: skipped ({reason})")
                continue
            runnable[name] = attention
        for mode in ("fwd", "fwd+bwd"):
            backward = mode == "fwd+bwd"
            rounds, extra, host, states = {name: [] for name in runnable}, {}, {}, {name: [] for name in runnable}
            settle_clock("cuda")
            for name in in_turn(runnable, args.rounds):
                if name not in rounds:
                    continue
                call = attention_call(runnable[name], inputs, mode)
                try:
                    with full_sweep(name == "triton_sweep"), without_direct_calls(name == "fa4_interface"):
                        with GpuSampler("cuda") if args.gpu_state else contextlib.nullcontext() as sampler:
                            rounds[name].append(median_ms(call, "cuda", args.warmup, args.repeats))
                        if sampler is not None:
                            states[name].append(sampler.summary())
                        if name not in extra:
                            extra[name] = peak_memory_bytes(call, "cuda")
                            host[name] = host_ms(call, "cuda")
                except Exception as exc:  # noqa: BLE001 - a baseline that cannot run this configuration
                    say(f"{where} {name:>20} {mode:>7}: failed ({type(exc).__name__}: "
                        f"{str(exc)[:120]})")
                    del rounds[name]
                    torch.cuda.empty_cache()
            dense_rate = None  # the rate of FlashAttention-4's kernel over the first branch's shape alone
            dense_rounds: list = []  # that rate in each round

            def rate_of(name: str, ms: float) -> float:
                if name == "dense_cudnn" or name.startswith("segments_"):  # all N x n scores, not the branches'
                    n = N if name == "dense_cudnn" else segs[0]
                    work = 4.0 * N * n * args.heads * args.dim * (0.5 if causal else 1) * (3.5 if backward else 1)
                    return work / (ms * 1e9)
                return tflops(problem, ms, backward)

            for name, samples in sorted(rounds.items(), key=lambda item: item[0] != "segments_fa4"):
                ms = statistics.median(samples)
                rate = rate_of(name, ms)
                row = dict(N=N, kv_heads=kv_heads, segment_lengths=segs, dilation_rates=dils, causal=causal,
                           provider=name, mode=mode,
                           median_ms=ms, tflops=rate, extra_memory_gib=extra[name] / 2**30,
                           working_memory_gib=(extra[name] - results_bytes(inputs, backward)) / 2**30,
                           fraction_of_fp32_peak=rate / peak, host_ms=host[name])
                if name == "segments_fa4":
                    dense_rate, dense_rounds = rate, [rate_of(name, t) for t in samples]
                elif dense_rate is not None:
                    row["of_segments_fa4_rate"] = rate / dense_rate
                    if len(samples) > 1 and len(samples) == len(dense_rounds):
                        # each round's rate against segments_fa4's in the same round (in_turn times them one after
                        # the other): the GPU's clock drifts by a few percent between rounds, less within one
                        row["of_segments_fa4_rate_by_round"] = statistics.median(
                            rate_of(name, t) / d for t, d in zip(samples, dense_rounds))
                if args.rounds > 1:
                    row["round_medians_ms"] = samples
                if args.gpu_state:
                    row["round_gpu_state"] = states[name]
                record.add(row)
                spread = f" (rounds {min(samples):.3f}-{max(samples):.3f})" if len(samples) > 1 else ""
                say(f"{where} {name:>20} {mode:>7}: {ms:9.3f} ms{spread} {rate:7.1f} TFLOP/s"
                    f" ({100 * row['fraction_of_fp32_peak']:5.1f}% of fp32 peak)"
                    f"  extra {row['extra_memory_gib']:.2f} GiB (working {row['working_memory_gib']:.2f})"
                    f"  host {row['host_ms']:.3f} ms"
                    + (f"  {100 * row['of_segments_fa4_rate']:.1f}% of segments_fa4's rate"
                       if "of_segments_fa4_rate" in row else "")
                    + (f" ({100 * row['of_segments_fa4_rate_by_round']:.1f}% the median of the rounds' ratios)"
                       if "of_segments_fa4_rate_by_round" in row else ""))
                if args.gpu_state:
                    say(f"{where} {name:>20} {mode:>7}: by round, ms / SM MHz / W / event reasons: " + ", ".join(
                        f"{t:.2f} / {st.get('sm_clock_mhz', '?')} / {st.get('power_w', '?')} / "
                        f"{st.get('clock_event_reasons', '?')}" for t, st in zip(samples, states[name])))
        del inputs
        torch.cuda.empty_cache()

    from dilated_attn.backends.triton import configs, ops

    tuned = configs.chosen(ops.TUNABLES)
    say("Triton configs run (key -> config):", json.dumps(tuned, indent=1))
    record.set(triton_configs=tuned)
    record.close()


if __name__ == "__main__":
    main()
