"""GPU benchmark: dilated_attn's GPU backends against what users run today, all in one run.

    python benchmarks/bench_gpu.py                 # the presets of the Triton issue (LongNet branches, bf16)
    python benchmarks/bench_gpu.py --quick         # the N = 65536 non-causal configuration only

Providers (each measured in the same process, on the same inputs):
  triton, cuda                dilated_attn's backends (where they can run)
  sdpa_recipe                 gather + flash SDPA + LSE merge (torchscale's recipe, benchmarks/baselines.py)
  sdpa_recipe_cudnn           the same with cuDNN attention
  sdpa_recipe_compiled        the flash recipe under torch.compile
  dense_cudnn                 dense cuDNN SDPA over the whole sequence, for scale (N <= 65536)
The device's fp32 FMA peak is measured first (the CUDA kernels' yardstick: they use no tensor cores), and
every row also gives its fraction of it. Times are medians of triton.testing.do_bench (CUDA events, warm-up, L2 flushed between runs); TFLOP/s use
FLOPs = 4*B*H*N*D*sum_i(w_i/r_i^2) forward (half with causal), x3.5 for forward+backward; "extra memory"
is the peak allocated above the inputs during one call. Before timing, the tuned Triton kernels are
checked against dilated_attn.reference at N = 16384. Results go to benchmarks/results/ as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from datetime import datetime, timezone

import torch
import triton
import triton.language as tl
import triton.testing

import dilated_attn
from dilated_attn.reference import dilated_attention_reference
from dilated_attn.spec import flops, validate

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from baselines import gather_sdpa_merge  # noqa: E402

LONGNET = ([2048, 4096, 8192, 16384], [1, 2, 4, 8])
LONGNET_LONG = ([2048, 8192, 32768, 131072], [1, 4, 16, 64])
PRESETS = [  # (N, branches, causal)
    (65536, LONGNET, False),
    (65536, LONGNET, True),
    (16384, LONGNET, False),
    (262144, LONGNET_LONG, False),
]


def providers(N):
    def ours(backend):
        return lambda q, k, v, w, r, causal: dilated_attn.dilated_attention(q, k, v, w, r, causal=causal,
                                                                             backend=backend)

    compiled = torch.compile(gather_sdpa_merge, dynamic=False)
    table = {
        "triton": ours("triton"),
        "cuda": ours("cuda"),
        "sdpa_recipe": lambda q, k, v, w, r, causal: gather_sdpa_merge(q, k, v, w, r, causal=causal),
        "sdpa_recipe_cudnn": lambda q, k, v, w, r, causal: gather_sdpa_merge(q, k, v, w, r, causal=causal,
                                                                             kernel="cudnn"),
        "sdpa_recipe_compiled": lambda q, k, v, w, r, causal: compiled(q, k, v, w, r, causal=causal),
    }
    if N <= 65536:
        def dense(q, k, v, w, r, causal):
            with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
                return torch.nn.functional.scaled_dot_product_attention(
                    q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal).transpose(1, 2)
        table["dense_cudnn"] = dense
    return table


def check_tuned_kernels(dtype, head_dim, heads):
    """The autotuned Triton kernels at N = 16384 against the reference (float32 compute): relative errors."""
    N = 16384
    gen = torch.Generator(device="cuda").manual_seed(1)
    q, k, v = (torch.randn(1, N, heads, head_dim, device="cuda", dtype=dtype, generator=gen).requires_grad_()
               for _ in range(3))
    go = torch.randn(q.shape, device="cuda", dtype=dtype, generator=gen)
    report = {}
    for causal in (False, True):
        out = dilated_attn.dilated_attention(q, k, v, *LONGNET, causal=causal, backend="triton")
        grads = torch.autograd.grad(out, (q, k, v), go)
        ref = dilated_attention_reference(q, k, v, *LONGNET, causal=causal, compute_dtype=torch.float32)[0]
        ref_grads = torch.autograd.grad(ref, (q, k, v), go)
        rel = lambda a, b: ((a.float() - b.float()).norm() / b.float().norm()).item()  # noqa: E731
        report["causal" if causal else "noncausal"] = dict(
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


def fp32_fma_peak():
    """The device's measured fp32 FMA throughput in TFLOP/s (2 FLOPs per FMA): the bar of the CUDA
    kernels, which use no tensor cores."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    block, iters = 1024, 4096
    x = torch.rand(sms * 16 * block, device="cuda")
    grid = (x.numel() // block,)
    ms = triton.testing.do_bench(lambda: _fma_chains[grid](x, ITERS=iters, BLOCK=block, num_warps=8),
                                 warmup=25, rep=200, return_mode="median")
    return 2.0 * 8 * iters * x.numel() / ms / 1e9


def measure(fn, args, grad, backward):
    q, k, v = args[:3]
    if backward:
        def call():
            out = fn(*args)
            torch.autograd.grad(out, (q, k, v), grad)
    else:
        def call():
            with torch.no_grad():
                fn(*args)
    call()  # compile / autotune outside the timed region and the memory measurement
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    call()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    ms = triton.testing.do_bench(call, warmup=25, rep=200, return_mode="median")
    return ms, extra


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="only N = 65536, non-causal")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--providers", default=None, help="comma-separated subset")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    dev = torch.cuda.get_device_name()
    print(f"device: {dev}; torch {torch.__version__}; triton {triton.__version__}", flush=True)

    peak = fp32_fma_peak()
    print(f"measured fp32 FMA peak: {peak:.1f} TFLOP/s", flush=True)
    check = check_tuned_kernels(dtype, args.dim, args.heads)
    print("tuned Triton kernels vs reference (relative error):", json.dumps(check), flush=True)

    presets = PRESETS[:1] if args.quick else PRESETS
    rows = []
    for N, (segs, dils), causal in presets:
        gen = torch.Generator(device="cuda").manual_seed(0)
        shape = (1, N, args.heads, args.dim)
        q, k, v = (torch.randn(shape, device="cuda", dtype=dtype, generator=gen).requires_grad_() for _ in range(3))
        grad = torch.randn(shape, device="cuda", dtype=dtype, generator=gen)
        problem = validate(q, k, v, segs, dils, causal=causal)
        for name, fn in providers(N).items():
            if args.providers and name not in args.providers.split(","):
                continue
            if name in ("triton", "cuda"):
                reason = dilated_attn.dispatch.BACKENDS[name].reason(problem)
                if reason:
                    print(f"N={N:>6} causal={causal!s:5} {name:>20}: skipped ({reason})", flush=True)
                    continue
            for backward in (False, True):
                mode = "fwd+bwd" if backward else "fwd"
                run_flops = flops(problem, backward=backward)
                if name == "dense_cudnn":
                    run_flops = 4.0 * N * N * args.heads * args.dim * (0.5 if causal else 1) * (3.5 if backward else 1)
                try:
                    ms, extra = measure(fn, (q, k, v, segs, dils, causal), grad, backward)
                except Exception as exc:  # a baseline that cannot run this configuration
                    print(f"N={N:>6} causal={causal!s:5} {name:>20} {mode:>7}: failed ({type(exc).__name__}: "
                          f"{str(exc)[:120]})", flush=True)
                    torch.cuda.empty_cache()
                    continue
                row = dict(N=N, segment_lengths=segs, dilation_rates=dils, causal=causal, provider=name, mode=mode,
                           median_ms=ms, tflops=run_flops / ms / 1e9, extra_memory_gib=extra / 2**30)
                row["fraction_of_fp32_peak"] = row["tflops"] / peak
                rows.append(row)
                print(f"N={N:>6} causal={causal!s:5} {name:>20} {mode:>7}: {ms:9.3f} ms {row['tflops']:7.1f} TFLOP/s"
                      f" ({100 * row['fraction_of_fp32_peak']:5.1f}% of fp32 peak)"
                      f"  extra {row['extra_memory_gib']:.2f} GiB", flush=True)
        del q, k, v, grad
        torch.cuda.empty_cache()

    from dilated_attn.triton import bwd as triton_bwd, fwd as triton_fwd

    tuned = {name: {str(key): str(cfg) for key, cfg in kernel.cache.items()}
             for name, kernel in (("forward", triton_fwd._fwd_kernel), ("dkdv", triton_bwd._dkdv_kernel),
                                  ("dq", triton_bwd._dq_kernel))}
    print("Triton configs chosen (autotune key -> config):", json.dumps(tuned, indent=1), flush=True)
    record = dict(
        benchmark="gpu_backends_vs_baselines",
        command=" ".join(["python", *sys.argv]),
        date=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        device=dict(name=dev, capability=".".join(map(str, torch.cuda.get_device_capability())),
                    host_cpu=platform.processor() or platform.machine()),
        versions=dict(torch=torch.__version__, triton=triton.__version__, cuda=torch.version.cuda,
                      dilated_attn=dilated_attn.__version__),
        config=dict(batch=1, heads=args.heads, head_dim=args.dim, dtype=args.dtype),
        fp32_fma_peak_tflops=peak,
        tuned_kernel_check=check,
        triton_configs=tuned,
        results=rows,
    )
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                   f"gpu_{dev.replace(' ', '_')}_{args.dtype}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(record, f, indent=2)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
