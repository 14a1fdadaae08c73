"""Ring attention scaling: ring_attention on P GPUs against dilated_attention on one GPU, same global N.

    torchrun --nproc_per_node=2 benchmarks/bench_ring.py                 # both presets below
    torchrun --nproc_per_node=2 benchmarks/bench_ring.py --preset dense  # one of them

Presets (bf16, B=1, H=16, D=128):
  longnet  N = 524288, branches (4096,1),(32768,4),(262144,16),(524288,32), non-causal, contiguous layout
  dense    N = 65536, dense causal ring (segment_lengths=None), zigzag layout

efficiency = T1 / (P * TP): T1 is forward+backward of dilated_attention on one GPU (rank 0 alone, the others
wait) for the global tensors, TP the forward+backward of ring_attention on P GPUs (each iteration starts
after a barrier; the slowest rank's time counts). Times are medians over --repeats after --warmup calls
(dilated_attn.cli.harness.median_ms: CUDA events, L2 flushed before each run). Bytes sent per rank are the
plan's forward K/V traffic (dilated_attn.ring.ring_plan), shown against the volume the branches select.
Results go to benchmarks/results/ring_<device>_<P>gpu.json (or --out), rewritten after every preset.

--profile adds, per preset and rank, where one ring forward and one forward+backward spend their GPU time
(torch.profiler's kernel timeline): attention kernels (cuDNN's or Triton's), merges and gradient additions (the merge
and addition kernels and PyTorch's elementwise, copy and reduction kernels), the communication kernels, the
communication time no compute kernel overlaps (exposed), and the time no kernel runs (the host).
benchmarks/ring_model.py projects the efficiency at more GPUs from these figures.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys

import torch
import torch.distributed as dist

import dilated_attn
from dilated_attn.cli.harness import Record, attention_call, median_ms, random_inputs, say, tflops
from dilated_attn.ring import ring_plan
from dilated_attn.spec import validate

PRESETS = {
    "longnet": dict(N=524288, w=[4096, 32768, 262144, 524288], r=[1, 4, 16, 32], causal=False, layout="contiguous"),
    "dense": dict(N=65536, w=None, r=None, causal=True, layout="zigzag"),
}
B, H, D, DTYPE = 1, 16, 128, torch.bfloat16


def synchronized():
    """before_run for median_ms: every rank starts each run together."""
    dist.barrier()
    torch.cuda.synchronize()


def slowest_rank(times: list[float]) -> list[float]:
    """combine for median_ms: each run's time on its slowest rank."""
    t = torch.tensor(times, device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def timed(fn, warmup: int, repeats: int, group_sync: bool) -> float:
    """Median milliseconds of fn() (with group_sync: all ranks start together, the slowest rank's time)."""
    if group_sync:
        return median_ms(fn, "cuda", warmup, repeats, before_run=synchronized, combine=slowest_rank)
    return median_ms(fn, "cuda", warmup, repeats)


def calls(attn, inputs):
    """(forward, forward+backward) calls of attn on inputs, for timing."""
    return attention_call(attn, inputs, "fwd"), attention_call(attn, inputs, "fwd+bwd")


def p2p_bandwidth(mib: int = 256) -> float:
    """GB/s of one point-to-point transfer from rank 0 to rank 1 (median of 5), for context."""
    rank = dist.get_rank()
    buf = torch.empty(mib * 2**20, dtype=torch.uint8, device="cuda")

    def transfer():
        if rank == 0:
            dist.send(buf, 1)
        elif rank == 1:
            dist.recv(buf, 0)

    return mib * 2**20 / timed(transfer, 2, 5, True) / 1e6


ATTENTION_KERNELS = ("sdpa", "_fwd_kernel", "_dkdv_kernel", "_dq_kernel", "_delta_kernel", "dot_do_o", "convert_dq")


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return merged


def _length(intervals) -> float:
    return sum(b - a for a, b in intervals)


def _overlap(xs, ys) -> float:
    """Total length of the intersection of two unions of intervals."""
    total, j = 0.0, 0
    for a, b in xs:
        while j < len(ys) and ys[j][1] <= a:
            j += 1
        k = j
        while k < len(ys) and ys[k][0] < b:
            total += min(b, ys[k][1]) - max(a, ys[k][0])
            k += 1
    return total


def gpu_time_breakdown(fn) -> dict:
    """Milliseconds of one call of fn by kind of kernel, from torch.profiler's timeline of this rank's GPU."""
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kinds = {"attention": [], "merge_and_accumulate": [], "communication": []}
    for e in prof.profiler.kineto_results.events():
        if e.device_type() != torch.autograd.DeviceType.CUDA or e.duration_ns() <= 0:
            continue
        name = e.name()
        kind = ("communication" if "nccl" in name.lower() else
                "attention" if any(k in name for k in ATTENTION_KERNELS) else "merge_and_accumulate")
        kinds[kind].append((e.start_ns() / 1e6, (e.start_ns() + e.duration_ns()) / 1e6))
    every = _union([iv for ivs in kinds.values() for iv in ivs])
    compute = _union(kinds["attention"] + kinds["merge_and_accumulate"])
    comm = _union(kinds["communication"])
    wall = every[-1][1] - every[0][0] if every else 0.0
    return dict(wall_ms=wall, attention_ms=_length(_union(kinds["attention"])),
                merge_and_accumulate_ms=_length(_union(kinds["merge_and_accumulate"])),
                communication_ms=_length(comm), exposed_communication_ms=_length(comm) - _overlap(comm, compute),
                no_kernel_ms=wall - _length(every))


def run(name: str, cfg: dict, warmup: int, repeats: int, profile: bool = False) -> dict:
    P, rank = dist.get_world_size(), dist.get_rank()
    N, L = cfg["N"], cfg["N"] // P
    w, r = cfg["w"], cfg["r"]
    row = dict(preset=name, N=N, P=P, B=B, H=H, D=D, dtype=str(DTYPE).removeprefix("torch."),
               branches=None if w is None else list(zip(w, r)), causal=cfg["causal"], layout=cfg["layout"])
    t1 = {}
    if rank == 0:  # T1: one GPU, the global sequence
        inputs = random_inputs(B, N, H, D, dtype=DTYPE, device="cuda", seed=rank)
        f, fb = calls(lambda q, k, v: dilated_attn.dilated_attention(
            q, k, v, w or [N], r or [1], causal=cfg["causal"]), inputs)
        t1 = dict(fwd_ms=timed(f, warmup, repeats, False), fwd_bwd_ms=timed(fb, warmup, repeats, False))
        p = validate(*inputs[:3], w or [N], r or [1], causal=cfg["causal"])
        row["tflops_1gpu_fwd_bwd"] = tflops(p, t1["fwd_bwd_ms"], backward=True)
        row["t1_backend"] = dilated_attn.explain(*inputs[:3], w or [N], r or [1], causal=cfg["causal"]).backend
        del inputs, f, fb
        torch.cuda.empty_cache()
        say(f"[{name}] 1 GPU ({row['t1_backend']}): fwd {t1['fwd_ms']:.2f} ms, fwd+bwd {t1['fwd_bwd_ms']:.2f} ms")
    dist.barrier()
    inputs = random_inputs(B, L, H, D, dtype=DTYPE, device="cuda", seed=rank)
    f, fb = calls(lambda q, k, v: dilated_attn.ring_attention(
        q, k, v, w, r, causal=cfg["causal"], layout=cfg["layout"]), inputs)
    tp = dict(fwd_ms=timed(f, warmup, repeats, True), fwd_bwd_ms=timed(fb, warmup, repeats, True))
    if profile:
        breakdown = {}
        for mode, fn in (("fwd", f), ("fwd_bwd", fb)):
            dist.barrier()
            mine = gpu_time_breakdown(fn)
            every = [None] * P
            dist.all_gather_object(every, mine)
            breakdown[mode] = every
        if rank == 0:
            row["gpu_time_per_rank"] = breakdown
            for mode, ranks in breakdown.items():
                for j, b in enumerate(ranks):
                    say(f"[{name}] {mode} rank {j}: " + ", ".join(f"{k.removesuffix('_ms')} {v:.2f} ms"
                                                                 for k, v in b.items()))
    plan = ring_plan(P, L, H, H, tuple(w or [N]), tuple(r or [1]), "all", cfg["causal"], cfg["layout"])
    sent = torch.tensor([plan.bytes_sent(j, B, D, DTYPE.itemsize) for j in range(P)])
    # the peak of one forward+backward, inputs included (measured apart from the timing, whose L2 flush
    # buffer would count otherwise)
    torch.cuda.reset_peak_memory_stats()
    fb()
    torch.cuda.synchronize()
    peak = torch.tensor(torch.cuda.max_memory_allocated() / 2**30, device="cuda")
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    if rank == 0:
        row.update(
            t1_fwd_ms=t1["fwd_ms"], t1_fwd_bwd_ms=t1["fwd_bwd_ms"], tp_fwd_ms=tp["fwd_ms"],
            tp_fwd_bwd_ms=tp["fwd_bwd_ms"],
            efficiency_fwd_bwd=t1["fwd_bwd_ms"] / (P * tp["fwd_bwd_ms"]),
            efficiency_fwd=t1["fwd_ms"] / (P * tp["fwd_ms"]),
            forward_bytes_sent_per_rank=sent.tolist(),
            peak_memory_gib_max_rank=peak.item(),
        )
        if w is not None:
            # what the branches select: the spanning branches' 1/r of the K and V of a rank's L positions
            spanning = [i for i in range(len(w)) if i not in plan.local_branches]
            row["expected_bytes_per_rank"] = sum(2 * B * L * H * D * DTYPE.itemsize // r[i] for i in spanning)
        say(f"[{name}] {P} GPUs: fwd {tp['fwd_ms']:.2f} ms, fwd+bwd {tp['fwd_bwd_ms']:.2f} ms; efficiency "
            f"fwd+bwd {row['efficiency_fwd_bwd']:.1%}, fwd {row['efficiency_fwd']:.1%}; bytes sent per rank "
            f"{[f'{b / 2**20:.1f} MiB' for b in sent.tolist()]}"
            + (f" (selected volume {row['expected_bytes_per_rank'] / 2**20:.1f} MiB)" if w else ""))
    del inputs, f, fb
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=[*PRESETS, "all"], default="all")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--profile", action="store_true", help="print a torch.profiler table of one ring call")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/ring_<device>_<P>gpu.json)")
    args = ap.parse_args()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    P, rank = dist.get_world_size(), dist.get_rank()
    names = list(PRESETS) if args.preset == "all" else [args.preset]
    bandwidth = p2p_bandwidth()
    record = None
    if rank == 0:
        say(f"point-to-point rank 0 -> 1: {bandwidth:.1f} GB/s (256 MiB)")
        device = torch.cuda.get_device_name()
        path = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                        f"ring_{device.replace(' ', '_')}_{P}gpu.json")
        record = Record("ring_scaling", "cuda",
                        dict(presets={n: PRESETS[n] for n in names}, B=B, H=H, D=D, dtype="bfloat16",
                             warmup=args.warmup, repeats=args.repeats),
                        json_path=path, command=shlex.join(["torchrun", f"--nproc_per_node={P}", *sys.argv]),
                        gpus=P, nccl=".".join(map(str, torch.cuda.nccl.version())), p2p_GBps=bandwidth)
    for name in names:
        row = run(name, PRESETS[name], args.warmup, args.repeats, args.profile)
        if record is not None:
            record.add(row)
    if record is not None:
        record.close()
    dist.barrier()  # no rank tears the group down while a peer still uses it
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
