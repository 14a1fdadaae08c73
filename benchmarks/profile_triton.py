"""One forward+backward of a GPU backend (triton by default) under Nsight Compute, after a warm-up that compiles and
autotunes.

    ncu --profile-from-start off -k regex:"_fwd_kernel|_dkdv_kernel|_dq_kernel" -c 6 \\
        --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \\
        --metrics sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active \\
        python benchmarks/profile_triton.py [--seq-len 65536] [--dim 128] [--causal]

Only the call between cudaProfilerStart and cudaProfilerStop is profiled: with -c 6 that is the four branches'
forward kernels and the first branch's dK/dV and dQ kernels (bf16, B=1, H=16, the LongNet branches).
`bash benchmarks/run_on_gpu.sh ncu` runs exactly this and keeps the report under $OUT. With `--backend cudnn`
profile cuDNN's kernels and the merge and gradient-addition kernels instead
(NCU_KERNELS="sdpa|merge_kernel|accumulate_kernel|dot_do_o|convert_dq" NCU_COUNT=60 for the stage); with
`--backend cuda --dtype float32` the hand-written CUDA kernels (NCU_KERNELS="forward_kernel|dq_kernel|dkdv_kernel").

With `--host`, the host's time to issue a step and cProfile's view of it. With `--kernel-times` it runs without
Nsight Compute: torch.profiler over --steps steps, then each kernel's time
per step, the GPU's busy time and the wall time per step (where a backend's time goes beyond its attention
kernels: merges, gradient additions, copies, idle).
"""

from __future__ import annotations

import argparse

import torch

import dilated_attn
from dilated_attn.cli.measure import LONGNET, random_inputs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq-len", type=int, default=65536)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--backend", default="triton", choices=["triton", "cudnn", "fa4", "cuda"])
    ap.add_argument("--kv-heads", type=int, default=16)
    ap.add_argument("--forward-only", action="store_true", help="profile the forward alone")
    ap.add_argument("--kernel-times", action="store_true", help="torch.profiler's kernel table, no Nsight")
    ap.add_argument("--host", action="store_true",
                    help="the host's time to issue a step, then where it goes (cProfile, the top functions)")
    ap.add_argument("--steps", type=int, default=5, help="profiled steps with --kernel-times or --host")
    ap.add_argument("--trace", default=None, help="with --kernel-times: write the profiled steps' timeline here "
                                                  "(Chrome trace JSON: each stream's kernels, the host's calls)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    args = ap.parse_args()
    q, k, v, go = random_inputs(1, args.seq_len, 16, args.dim, kv_heads=args.kv_heads,
                                dtype=getattr(torch, args.dtype), device="cuda")

    def step() -> None:
        out = dilated_attn.dilated_attention(q, k, v, *LONGNET, causal=args.causal, backend=args.backend)
        if not args.forward_only:
            torch.autograd.grad(out, (q, k, v), go)

    for _ in range(2):  # compile and autotune outside the profiled range
        step()
    torch.cuda.synchronize()
    if args.host:  # first, so that no torch.profiler instrumentation is active while the host is timed
        host_times(step, args)
    if args.kernel_times:
        kernel_times(step, args)
    if args.kernel_times or args.host:
        return
    torch.cuda.cudart().cudaProfilerStart()
    step()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


def kernel_times(step, args) -> None:
    """Each kernel's time per step, the kernels' total (GPU busy, if they do not overlap) and the wall per step."""
    from torch.profiler import ProfilerActivity, profile

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start.record()
        for _ in range(args.steps):
            step()
        end.record()
        torch.cuda.synchronize()
    wall = start.elapsed_time(end) / args.steps
    if args.trace:
        prof.export_chrome_trace(args.trace)
    rows = [(e.device_time_total / 1e3 / args.steps, e.count // args.steps, e.key) for e in prof.key_averages()
            if e.device_time_total > 0]
    rows.sort(reverse=True)
    busy = sum(ms for ms, _, _ in rows)
    mode = "forward" if args.forward_only else "forward+backward"
    print(f"{args.backend} {mode}, N={args.seq_len} Hkv={args.kv_heads} causal={args.causal}: wall {wall:.3f} ms "
          f"per step, kernels {busy:.3f} ms, GPU busy {gpu_busy_ms(prof) / args.steps:.3f} ms (any stream)")
    for ms, count, name in rows[:14]:
        print(f"  {ms:8.3f} ms {count:4d}x  {name[:110]}")


def gpu_busy_ms(prof) -> float:
    """The time some kernel or copy ran on the GPU (the union of their intervals over every stream)."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA)
    busy, reach = 0.0, float("-inf")
    for begin, end in spans:
        busy += max(0.0, end - max(begin, reach))
        reach = max(reach, end)
    return busy / 1e3


def host_times(step, args) -> None:
    """The host's time to issue one step (no synchronisation inside it: where it exceeds the GPU's time per step
    the step is bound by the host), then cProfile's top functions by their own time."""
    import cProfile
    import pstats
    import time

    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    issued = (time.perf_counter() - start) / args.steps * 1e3
    torch.cuda.synchronize()
    wall = (time.perf_counter() - start) / args.steps * 1e3
    mode = "forward" if args.forward_only else "forward+backward"
    print(f"{args.backend} {mode}, N={args.seq_len} Hkv={args.kv_heads} causal={args.causal}: host {issued:.3f} ms "
          f"per step to issue, wall {wall:.3f} ms per step")
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(args.steps):
        step()
    profiler.disable()
    torch.cuda.synchronize()
    pstats.Stats(profiler).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
