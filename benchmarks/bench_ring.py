"""Ring attention scaling: ring_attention on P GPUs, in each mode, against dilated_attention on one GPU.

    torchrun --nproc_per_node=4 benchmarks/bench_ring.py                          # both presets, every mode
    torchrun --nproc_per_node=4 benchmarks/bench_ring.py --preset dense --mode heads
    torchrun --nproc_per_node=2 benchmarks/bench_ring.py --preset packed,documents --mode heads,documents
    torchrun --nproc_per_node=4 benchmarks/bench_ring.py --tokens-per-gpu         # weak scaling

Presets (bf16, B=1, H=16, D=128):
  longnet  N = 524288, branches (4096,1),(32768,4),(262144,16),(524288,32), non-causal, contiguous layout
  dense    N = 65536, dense causal ring (segment_lengths=None), zigzag layout
  packed   N = 131072 as 16 packed sequences of 1K-16K tokens (benchmarks/bench_varlen.py's LENGTHS), branches
           (2048,1),(4096,2),(8192,4),(16384,8), non-causal, contiguous: ring_attention(cu_seqlens=...) against
           dilated_attention_varlen on one GPU (strong scaling only)
  documents  N = 524288 as documents of long-tailed lengths (documents(): about half the tokens in documents of 8K
           or less, a few of 64K-256K; seeded), the packed preset's branches, causal; weak scaling draws a pack of
           P times the tokens per GPU the same way (131072 a GPU by default)

Packs run in every mode, the sequence cut by rows (contiguous), and in the mode "documents": the pack placed by
place_documents (each document whole on one rank where it fits) and ring_attention(layout=that layout) with mode
"auto", which is what a data loader that places the pack gets.

Strong scaling (the default): the preset's N on P GPUs. efficiency = T1 / (P * TP): T1 is dilated_attention on one
GPU (rank 0 alone, the others wait) for the global tensors (auto's backend: the fastest single-GPU path), TP
ring_attention on P GPUs (each iteration starts after a barrier; the slowest rank's time counts), forward+backward
and forward apart. Weak scaling (--tokens-per-gpu, default 131072 tokens a GPU for longnet, 32768 for dense): N = P
times that, the preset's branches; per-GPU TFLOP/s = measure.flops(N) / (P * TP), against one GPU's on the
same tokens per GPU (N = tokens, measured in the same run): weak efficiency = their ratio; one GPU's time on the
whole N is measured too (one_gpu_same_n_*: the kernels' own rate at that N) and gives the same_n_efficiency_* of
strong scaling. Times are medians over
--repeats after --warmup calls (dilated_attn.cli.measure.median_ms: CUDA events, L2 flushed before each run).
Each row also holds each rank's own median (tp_rank_median_ms: above TP where the ranks start apart) and the time
per call of --repeats calls in a row with no barrier between them, as a training loop runs (tp_back_to_back_ms).

Modes (--mode, default all that run): ring, heads, and on 4 or more GPUs 2d as (P/2) x 2 (inner pairs of
consecutive ranks standing for a node). Bytes sent per rank: the ring plan's forward K/V traffic
(dilated_attn.ring.ring_plan) and the heads mode's all-to-all (explain_ring). Results go to
benchmarks/results/ring_<device>_<P>gpu.json (or --out), rewritten after every row.

--profile adds, per preset and rank, where one ring forward and one forward+backward spend their GPU time
(torch.profiler's kernel timeline): attention kernels (cuDNN's or Triton's), merges and gradient additions (the merge
and addition kernels and PyTorch's elementwise, copy and reduction kernels), the communication kernels, the
communication time no compute kernel overlaps (exposed), the time no kernel runs (the host) from the first kernel on,
the host's time from the call to its first kernel, and the merge and accumulation kernels that take the most time.
benchmarks/ring_model.py projects the efficiency at more GPUs from these figures.
"""

from __future__ import annotations

import argparse
import itertools
import os
import random
import shlex
import statistics
import sys
import time
from typing import Optional

import torch
import torch.distributed as dist

import dilated_attn
from dilated_attn import dispatch
from dilated_attn.cli.measure import Record, attention_call, flops, host_ms, median_ms, random_inputs, say
from dilated_attn.spec import validate, validate_varlen

PRESETS = {
    "longnet": dict(N=524288, w=[4096, 32768, 262144, 524288], r=[1, 4, 16, 32], causal=False, layout="contiguous",
                    tokens_per_gpu=131072),
    "dense": dict(N=65536, w=None, r=None, causal=True, layout="zigzag", tokens_per_gpu=32768),
    "packed": dict(N=131072, w=[2048, 4096, 8192, 16384], r=[1, 2, 4, 8], causal=False, layout="contiguous",
                   tokens_per_gpu=None,
                   lengths=[1024, 16384, 2048, 12288, 4096, 9216, 15360, 3072, 6144, 11264, 8192, 13312, 5120, 7168,
                            10240, 6144]),
    "documents": dict(N=524288, w=[2048, 4096, 8192, 16384], r=[1, 2, 4, 8], causal=True, layout="contiguous",
                      tokens_per_gpu=131072, lengths="documents"),
}
MODES = ("ring", "heads", "2d", "documents")


def documents(N: int, seed: int = 0) -> list[int]:
    """Lengths of a pack of N tokens with a long tail, drawn with `seed`: half the tokens in documents of 8K-256K
    (log-uniform; the first of 64K or more), the other half in documents of 128 to 8192 tokens (log-uniform), each
    half's last document cut to fill it, in shuffled order."""
    rng = random.Random(seed)
    lengths = []
    for budget, low, high in ((N - N // 2, 13, 18), (N // 2, 7, 13)):
        while budget > 0:
            first = low == 13 and not lengths
            n = min(budget, int(2 ** rng.uniform(16 if first else low, high)))
            lengths.append(n)
            budget -= n
    rng.shuffle(lengths)
    return lengths


def lengths_of(cfg: dict, N: int) -> Optional[list[int]]:
    """The preset's document lengths on N tokens (None: one sequence)."""
    lengths = cfg.get("lengths")
    return documents(N) if lengths == "documents" else lengths
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


def timed_ranks(fn, warmup: int, repeats: int) -> tuple[float, list[float]]:
    """Median milliseconds of fn() on P ranks (all ranks start each run together; a run's time is its slowest
    rank's), and each rank's own median: where the slowest rank's time of a run exceeds every rank's own, the ranks
    did not start together (a rank's time counts from its own start)."""
    own = []

    def combine(times):
        own[:] = times
        return slowest_rank(times)

    tp = median_ms(fn, "cuda", warmup, repeats, before_run=synchronized, combine=combine)
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, statistics.median(own))
    return tp, ranks


def host_ranks_ms(fn, repeats: int) -> list[float]:
    """Each rank's median milliseconds until fn() returns, every run started together on idle GPUs: the host's
    share of a call; a forward whose host time is close to its GPU time is bound by the host."""
    times = []
    for _ in range(repeats):
        synchronized()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    torch.cuda.synchronize()
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, statistics.median(times))
    return ranks


def back_to_back_ms(fn, calls: int) -> float:
    """Milliseconds per call of `calls` calls run in a row with no barrier between them (as a training loop runs its
    steps), after one barrier; the slowest rank's."""
    synchronized()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize()
    return slowest_rank([start.elapsed_time(end) / calls])[0]


def packed_inputs(inputs):
    """[1, n, H, D] inputs as the packed layout's [n, H, D] leaves."""
    return type(inputs)(*(x[0].detach().requires_grad_(x.requires_grad) for x in inputs))


def offsets(cfg: dict, N: int) -> torch.Tensor:
    return torch.tensor([0, *itertools.accumulate(lengths_of(cfg, N))], dtype=torch.int32, device="cuda")


def work(cfg: dict, N: int, backward: bool) -> float:
    """The FLOPs of the preset on N tokens (a pack: each sequence with its own length, as measure.flops counts)."""
    def problem(n):
        x = torch.empty(B, n, H, D, device="meta")
        return validate(x, x.clone(), x.clone(), cfg["w"] or [n], cfg["r"] or [1], causal=cfg["causal"])

    return sum(flops(problem(n), backward) for n in lengths_of(cfg, N) or [N])


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

    return mib * 2**20 / timed_ranks(transfer, 2, 5)[0] / 1e6


# Kernel names of attention (its pre- and post-processing included): cuDNN's SDPA, the Triton kernels, and
# FlashAttention-4's CuTe kernels (`...FlashAttentionForwardSm90...`, `...FlashAttentionBackwardPostprocess...`)
ATTENTION_KERNELS = ("sdpa", "_fwd_kernel", "_dkdv_kernel", "_dq_kernel", "_delta_kernel", "dot_do_o", "convert_dq",
                     "FlashAttention")


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


def gpu_time_breakdown(fn, trace: Optional[str] = None) -> dict:
    """Milliseconds of one call of fn by kind of kernel, from torch.profiler's timeline of this rank's GPU (with
    `trace`, the host's too, its Python calls among them, written there as a Chrome trace)."""
    torch.cuda.synchronize()
    marker = torch.empty(1, device="cuda")
    activities = [torch.profiler.ProfilerActivity.CUDA] + ([torch.profiler.ProfilerActivity.CPU] if trace else [])
    with torch.profiler.profile(activities=activities, with_stack=trace is not None) as prof:
        marker.fill_(0)  # the call starts here (as TP's start event): the host's time before its first kernel shows
        fn()
        torch.cuda.synchronize()
    if trace:
        prof.export_chrome_trace(trace)
    kinds = {"attention": [], "merge_and_accumulate": [], "communication": []}
    by_name = {}  # the merge-and-accumulate kernels by name: (ms, launches)
    events = sorted((e for e in prof.profiler.kineto_results.events()
                     if e.device_type() == torch.autograd.DeviceType.CUDA and e.duration_ns() > 0),
                    key=lambda e: e.start_ns())
    called = (events[0].start_ns() + events[0].duration_ns()) / 1e6 if events else 0.0
    for e in events[1:]:
        name = e.name()
        kind = ("communication" if "nccl" in name.lower() else
                "attention" if any(k in name for k in ATTENTION_KERNELS) else "merge_and_accumulate")
        kinds[kind].append((e.start_ns() / 1e6, (e.start_ns() + e.duration_ns()) / 1e6))
        if kind == "merge_and_accumulate":
            ms, n = by_name.get(name[:100], (0.0, 0))
            by_name[name[:100]] = (ms + e.duration_ns() / 1e6, n + 1)
    every = _union([iv for ivs in kinds.values() for iv in ivs])
    compute = _union(kinds["attention"] + kinds["merge_and_accumulate"])
    comm = _union(kinds["communication"])
    wall = every[-1][1] - every[0][0] if every else 0.0
    return dict(wall_ms=wall, before_first_kernel_ms=every[0][0] - called if every else 0.0,
                attention_ms=_length(_union(kinds["attention"])),
                merge_and_accumulate_ms=_length(_union(kinds["merge_and_accumulate"])),
                communication_ms=_length(comm), exposed_communication_ms=_length(comm) - _overlap(comm, compute),
                no_kernel_ms=wall - _length(every), kernels=sum(len(ivs) for ivs in kinds.values()),
                top_merge_and_accumulate=[dict(kernel=k, ms=ms, launches=n) for k, (ms, n) in
                                          sorted(by_name.items(), key=lambda kv: -kv[1][0])[:6]])


def mesh_pair(inner: int = 2):
    """(ring_group, heads_group) of this rank: inner groups of `inner` consecutive ranks (the GPUs of a node) and
    outer groups of the ranks with the same inner index, so that a rank's shard is its global rank's."""
    world, rank = dist.get_world_size(), dist.get_rank()
    inners = [dist.new_group(list(range(o, o + inner))) for o in range(0, world, inner)]
    outers = [dist.new_group(list(range(i, world, inner))) for i in range(inner)]
    return outers[rank % inner], inners[rank // inner]


def single_gpu(name: str, cfg: dict, N: int, warmup: int, repeats: int) -> dict:
    """T1 on rank 0 (the others wait): dilated_attention of N tokens with auto's backend."""
    row = {}
    if dist.get_rank() == 0:
        w, r = cfg["w"] or [N], cfg["r"] or [1]
        inputs = random_inputs(B, N, H, D, dtype=DTYPE, device="cuda", seed=0)
        if "lengths" in cfg:
            inputs, cu = packed_inputs(inputs), offsets(cfg, N)

            def attention(q, k, v):
                return dilated_attn.dilated_attention_varlen(q, k, v, cu, w, r, causal=cfg["causal"])

            backend = dispatch.select(validate_varlen(*inputs[:3], cu, w, r, causal=cfg["causal"]), "auto").name
        else:
            def attention(q, k, v):
                return dilated_attn.dilated_attention(q, k, v, w, r, causal=cfg["causal"])

            backend = dilated_attn.explain(*inputs[:3], w, r, causal=cfg["causal"]).backend
        f, fb = calls(attention, inputs)
        row = dict(t1_fwd_ms=median_ms(f, "cuda", warmup, repeats),
                   t1_fwd_bwd_ms=median_ms(fb, "cuda", warmup, repeats),
                   t1_host_fwd_ms=host_ms(f, "cuda", repeats), t1_backend=backend)
        row["t1_tflops_fwd_bwd"] = work(cfg, N, True) / row["t1_fwd_bwd_ms"] / 1e9
        row["t1_tflops_fwd"] = work(cfg, N, False) / row["t1_fwd_ms"] / 1e9
        del inputs, f, fb
        torch.cuda.empty_cache()
        say(f"[{name}] 1 GPU, N={N} ({row['t1_backend']}): fwd {row['t1_fwd_ms']:.2f} ms (host "
            f"{row['t1_host_fwd_ms']:.2f} ms), fwd+bwd {row['t1_fwd_bwd_ms']:.2f} ms")
    dist.barrier()
    return row


def run(name: str, cfg: dict, mode: str, group, N: int, t1: dict, warmup: int, repeats: int,
        profile: bool = False, trace: Optional[str] = None) -> dict:
    """One mode of one preset on P GPUs at global length N: TP, the efficiency against t1, traffic, profile."""
    P, rank = dist.get_world_size(), dist.get_rank()
    L = N // P
    w, r = cfg["w"], cfg["r"]
    row = dict(preset=name, mode=mode, N=N, P=P, B=B, H=H, D=D, dtype=str(DTYPE).removeprefix("torch."),
               branches=None if w is None else list(zip(w, r)), causal=cfg["causal"], layout=cfg["layout"])
    kw = dict(causal=cfg["causal"], layout=cfg["layout"], group=group, mode=mode)
    if mode == "documents":  # the pack placed, each rank's own rows; auto's mode under that layout
        if "lengths" not in cfg:
            raise ValueError("the documents layout is for packs")
        layout = dilated_attn.place_documents(offsets(cfg, N), w, r, causal=cfg["causal"])
        L = layout.length(rank)
        kw.update(layout=layout, mode="auto")
        row.update(layout=repr(layout), rows_per_rank=[layout.length(j) for j in range(P)],
                   work_busiest_over_mean=max(layout.work) * P / sum(layout.work))
    inputs = random_inputs(B, L, H, D, dtype=DTYPE, device="cuda", seed=rank)
    if "lengths" in cfg:
        inputs = packed_inputs(inputs)
        if mode != "documents":
            kw["cu_seqlens"] = offsets(cfg, N)
        row["lengths"] = lengths_of(cfg, N)
    call = dilated_attn.explain_ring(*inputs[:3], w, r, **kw)
    f, fb = calls(lambda q, k, v: dilated_attn.ring_attention(q, k, v, w, r, **kw), inputs)
    tp, own = {}, {}
    for part, fn in (("fwd", f), ("fwd_bwd", fb)):
        tp[f"{part}_ms"], own[part] = timed_ranks(fn, warmup, repeats)
        own[f"{part}_back_to_back"] = back_to_back_ms(fn, repeats)
    own["host_fwd"] = host_ranks_ms(f, repeats)
    if profile:
        breakdown = {}
        for part, fn in (("fwd", f), ("fwd_bwd", fb)):
            dist.barrier()
            where = None if trace is None else os.path.join(trace, f"trace_{name}_{mode}_{P}gpu_{part}_rank{rank}.json")
            mine = gpu_time_breakdown(fn, where)
            every = [None] * P
            dist.all_gather_object(every, mine)
            breakdown[part] = every
        row["gpu_time_per_rank"] = breakdown
        if rank == 0:
            for part, ranks in breakdown.items():
                for j, b in enumerate(ranks):
                    say(f"[{name}/{mode}] {part} rank {j}: " + ", ".join(
                        f"{k.removesuffix('_ms')} {v:.2f} ms" for k, v in b.items() if k.endswith("_ms"))
                        + f", {b['kernels']} kernels; most merge/accumulate time: " + "; ".join(
                        f"{t['kernel'][:60]} {t['ms']:.2f} ms x{t['launches']}"
                        for t in b["top_merge_and_accumulate"][:3]))
    sent = [None] * P
    dist.all_gather_object(sent, (call.bytes_per_rank or {}).get("ring" if mode == "documents" else mode)
                           if mode != "2d" else None)
    # the peak of one forward+backward, inputs included (measured apart from the timing, whose L2 flush
    # buffer would count otherwise)
    torch.cuda.reset_peak_memory_stats()
    fb()
    torch.cuda.synchronize()
    peak = torch.tensor(torch.cuda.max_memory_allocated() / 2**30, device="cuda")
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    row.update(
        t1, tp_fwd_ms=tp["fwd_ms"], tp_fwd_bwd_ms=tp["fwd_bwd_ms"], backend=call.backend,
        tflops_per_gpu_fwd_bwd=work(cfg, N, True) / tp["fwd_bwd_ms"] / 1e9 / P,
        tflops_per_gpu_fwd=work(cfg, N, False) / tp["fwd_ms"] / 1e9 / P,
        forward_bytes_sent_per_rank=sent, peak_memory_gib_max_rank=peak.item(),
        tp_rank_median_ms={part: own[part] for part in ("fwd", "fwd_bwd")},
        tp_back_to_back_ms={part: own[f"{part}_back_to_back"] for part in ("fwd", "fwd_bwd")},
        host_fwd_ms_per_rank=own["host_fwd"],
    )
    if "t1_fwd_ms" in t1 and t1.get("t1_N", N) == N:  # as a training loop runs: calls back to back, no barrier
        row.update(back_to_back_efficiency_fwd_bwd=t1["t1_fwd_bwd_ms"] / (P * own["fwd_bwd_back_to_back"]),
                   back_to_back_efficiency_fwd=t1["t1_fwd_ms"] / (P * own["fwd_back_to_back"]))
    if "t1_fwd_ms" in t1 and t1.get("t1_N", N) == N:  # strong scaling: the same N on one GPU
        row.update(efficiency_fwd_bwd=t1["t1_fwd_bwd_ms"] / (P * tp["fwd_bwd_ms"]),
                   efficiency_fwd=t1["t1_fwd_ms"] / (P * tp["fwd_ms"]))
    elif "t1_fwd_ms" in t1:  # weak scaling: per-GPU rates against one GPU's on the same tokens per GPU
        row.update(efficiency_fwd_bwd=row["tflops_per_gpu_fwd_bwd"] / t1["t1_tflops_fwd_bwd"],
                   efficiency_fwd=row["tflops_per_gpu_fwd"] / t1["t1_tflops_fwd"])
        if "one_gpu_same_n_fwd_ms" in t1:  # and the strong-scaling figure of the same N
            row.update(same_n_efficiency_fwd_bwd=t1["one_gpu_same_n_fwd_bwd_ms"] / (P * tp["fwd_bwd_ms"]),
                       same_n_efficiency_fwd=t1["one_gpu_same_n_fwd_ms"] / (P * tp["fwd_ms"]))
    if rank == 0:
        mib = [f"{b / 2**20:.1f}" for b in sent if b is not None]
        say(f"[{name}/{mode}] {P} GPUs, N={N}: fwd {tp['fwd_ms']:.2f} ms, fwd+bwd {tp['fwd_bwd_ms']:.2f} ms; "
            f"{row['tflops_per_gpu_fwd_bwd']:.0f} TFLOP/s per GPU fwd+bwd; efficiency fwd+bwd "
            f"{row.get('efficiency_fwd_bwd', float('nan')):.1%}, fwd {row.get('efficiency_fwd', float('nan')):.1%}"
            + (f"; MiB sent per rank {mib}" if mib else "") + f" ({call})")
        say(f"[{name}/{mode}] each rank's own median fwd+bwd " + ", ".join(f"{t:.2f}" for t in own["fwd_bwd"])
            + " ms, fwd " + ", ".join(f"{t:.2f}" for t in own["fwd"]) + f" ms; back to back (no barrier) fwd+bwd "
            f"{own['fwd_bwd_back_to_back']:.2f} ms, fwd {own['fwd_back_to_back']:.2f} ms; host's fwd "
            + ", ".join(f"{t:.2f}" for t in own["host_fwd"]) + " ms")
    del inputs, f, fb
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="all", help=f"comma-separated, of {', '.join(PRESETS)}; or all")
    ap.add_argument("--mode", default="all", help=f"the modes to time, comma-separated, of {', '.join(MODES)}; or all")
    ap.add_argument("--tokens-per-gpu", type=int, nargs="?", const=0, default=None,
                    help="weak scaling: N = P * this (no value: each preset's default tokens per GPU)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--profile", action="store_true", help="each rank's kernel-time breakdown of one call per mode")
    ap.add_argument("--trace", metavar="DIR", default=None,
                    help="with --profile: each rank's host and GPU timeline of each profiled call, as Chrome traces")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/ring_<device>_<P>gpu.json)")
    args = ap.parse_args()
    if args.trace:
        os.makedirs(args.trace, exist_ok=True)
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    P, rank = dist.get_world_size(), dist.get_rank()
    names = list(PRESETS) if args.preset == "all" else args.preset.split(",")
    asked = list(MODES) if args.mode == "all" else args.mode.split(",")
    unknown = sorted(set(names) - set(PRESETS)) + sorted(set(asked) - set(MODES))
    if unknown:
        ap.error(f"unknown presets or modes: {unknown} (presets {list(PRESETS)}, modes {list(MODES)})")
    modes = [m for m in asked if m != "2d" or (P >= 4 and P % 2 == 0)]
    pair = mesh_pair() if "2d" in modes else None
    bandwidth = p2p_bandwidth()
    weak = args.tokens_per_gpu is not None
    record = None
    if rank == 0:
        say(f"point-to-point rank 0 -> 1: {bandwidth:.1f} GB/s (256 MiB)")
        device = torch.cuda.get_device_name()
        path = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                        f"ring_{device.replace(' ', '_')}_{P}gpu{'_weak' if weak else ''}.json")
        record = Record("ring_weak_scaling" if weak else "ring_scaling", "cuda",
                        dict(presets={n: PRESETS[n] for n in names}, modes=modes, B=B, H=H, D=D, dtype="bfloat16",
                             warmup=args.warmup, repeats=args.repeats, tokens_per_gpu=args.tokens_per_gpu),
                        json_path=path, command=shlex.join(["torchrun", f"--nproc_per_node={P}", *sys.argv]),
                        gpus=P, nccl=".".join(map(str, torch.cuda.nccl.version())), p2p_GBps=bandwidth)
    for name in names:
        cfg = PRESETS[name]
        if weak and not cfg["tokens_per_gpu"]:
            continue  # a pack of fixed lengths
        tokens = (args.tokens_per_gpu or cfg["tokens_per_gpu"]) if weak else cfg["N"] // P
        N = tokens * P
        t1 = single_gpu(name, cfg, tokens if weak else N, args.warmup, args.repeats)
        t1["t1_N"] = tokens if weak else N
        if weak:  # one GPU's rate on the whole problem too: what the kernels reach at this N without a ring
            whole = single_gpu(name, cfg, N, args.warmup, args.repeats)
            t1.update({f"one_gpu_same_n_{k.removeprefix('t1_')}": x for k, x in whole.items()})
        for mode in modes:
            if mode == "documents" and "lengths" not in cfg:
                continue
            try:
                row = run(name, cfg, mode, pair if mode == "2d" else None, N, t1, args.warmup, args.repeats,
                          args.profile, args.trace)
            except ValueError as exc:  # a mode these sizes cannot run (the same on every rank)
                if rank == 0:
                    say(f"[{name}/{mode}] not run: {exc}")
                continue
            if record is not None:
                record.add(row)
    if record is not None:
        record.close()
    dist.barrier()  # no rank tears the group down while a peer still uses it
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
