"""Ring attention scaling: ring_attention on P GPUs against dilated_attention on one GPU, same global N.

    torchrun --nproc_per_node=2 benchmarks/bench_ring.py                 # both presets of the ring issue
    torchrun --nproc_per_node=2 benchmarks/bench_ring.py --preset dense  # one of them

Presets (bf16, B=1, H=16, D=128):
  longnet  N = 524288, branches (4096,1),(32768,4),(262144,16),(524288,32), non-causal, contiguous layout
  dense    N = 65536, dense causal ring (segment_lengths=None), zigzag layout

efficiency = T1 / (P * TP): T1 is forward+backward of dilated_attention on one GPU (rank 0 alone, the others
wait) for the global tensors, TP the forward+backward of ring_attention on P GPUs (each iteration starts
after a barrier; the slowest rank's time counts). Times are medians over --repeats after --warmup calls,
CUDA events. Bytes sent per rank are the plan's forward K/V traffic (dilated_attn.ring.ring_plan), shown
against the volume the branches select. Results go to benchmarks/results/ring_<device>_<P>gpu.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from datetime import datetime, timezone

import torch
import torch.distributed as dist

import dilated_attn
from dilated_attn.ring import ring_plan
from dilated_attn.spec import flops, validate

PRESETS = {
    "longnet": dict(N=524288, w=[4096, 32768, 262144, 524288], r=[1, 4, 16, 32], causal=False, layout="contiguous"),
    "dense": dict(N=65536, w=None, r=None, causal=True, layout="zigzag"),
}
B, H, D, DTYPE = 1, 16, 128, torch.bfloat16


def timed(fn, warmup: int, repeats: int, group_sync: bool) -> float:
    """Median milliseconds of fn() (the slowest rank's when group_sync)."""
    times = []
    for i in range(warmup + repeats):
        if group_sync:
            dist.barrier()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        ms = torch.tensor(start.elapsed_time(end), device="cuda")
        if group_sync:
            dist.all_reduce(ms, op=dist.ReduceOp.MAX)
        if i >= warmup:
            times.append(ms.item())
    return statistics.median(times)


def fwd_bwd(attn, q, k, v):
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]

    def forward():
        with torch.no_grad():
            attn(*leaves)

    def forward_backward():
        for x in leaves:
            x.grad = None
        out = attn(*leaves)
        out.backward(grad)

    grad = None
    out = attn(*leaves)
    grad = torch.randn_like(out)
    return forward, forward_backward


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


def run(name: str, cfg: dict, warmup: int, repeats: int, profile: bool = False) -> dict:
    P, rank = dist.get_world_size(), dist.get_rank()
    N, L = cfg["N"], cfg["N"] // P
    w, r = cfg["w"], cfg["r"]
    torch.manual_seed(rank)
    row = dict(preset=name, N=N, P=P, B=B, H=H, D=D, dtype=str(DTYPE).removeprefix("torch."),
               branches=None if w is None else list(zip(w, r)), causal=cfg["causal"], layout=cfg["layout"])
    t1 = {}
    if rank == 0:  # T1: one GPU, the global sequence
        q, k, v = (torch.randn(B, N, H, D, device="cuda", dtype=DTYPE) for _ in range(3))
        f, fb = fwd_bwd(lambda q, k, v: dilated_attn.dilated_attention(
            q, k, v, w or [N], r or [1], causal=cfg["causal"]), q, k, v)
        t1 = dict(fwd_ms=timed(f, warmup, repeats, False), fwd_bwd_ms=timed(fb, warmup, repeats, False))
        p = validate(q, k, v, w or [N], r or [1], causal=cfg["causal"])
        row["tflops_1gpu_fwd_bwd"] = flops(p, backward=True) / t1["fwd_bwd_ms"] / 1e9
        del q, k, v, f, fb
        torch.cuda.empty_cache()
        print(f"[{name}] 1 GPU: fwd {t1['fwd_ms']:.2f} ms, fwd+bwd {t1['fwd_bwd_ms']:.2f} ms", flush=True)
    dist.barrier()
    q, k, v = (torch.randn(B, L, H, D, device="cuda", dtype=DTYPE) for _ in range(3))
    f, fb = fwd_bwd(lambda q, k, v: dilated_attn.ring_attention(
        q, k, v, w, r, causal=cfg["causal"], layout=cfg["layout"]), q, k, v)
    tp = dict(fwd_ms=timed(f, warmup, repeats, True), fwd_bwd_ms=timed(fb, warmup, repeats, True))
    if profile:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            fb()
            torch.cuda.synchronize()
        if rank == 0:
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25), flush=True)
    plan = ring_plan(P, L, H, H, tuple(w or [N]), tuple(r or [1]), "all", cfg["causal"], cfg["layout"])
    sent = torch.tensor([plan.bytes_sent(j, B, D, DTYPE.itemsize) for j in range(P)])
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
        print(f"[{name}] {P} GPUs: fwd {tp['fwd_ms']:.2f} ms, fwd+bwd {tp['fwd_bwd_ms']:.2f} ms; efficiency "
              f"fwd+bwd {row['efficiency_fwd_bwd']:.1%}, fwd {row['efficiency_fwd']:.1%}; bytes sent per rank "
              f"{[f'{b / 2**20:.1f} MiB' for b in sent.tolist()]}"
              + (f" (selected volume {row['expected_bytes_per_rank'] / 2**20:.1f} MiB)" if w else ""), flush=True)
    del q, k, v, f, fb
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
    names = list(PRESETS) if args.preset == "all" else [args.preset]
    bandwidth = p2p_bandwidth()
    if dist.get_rank() == 0:
        print(f"point-to-point rank 0 -> 1: {bandwidth:.1f} GB/s (256 MiB)", flush=True)
    rows = [run(n, PRESETS[n], args.warmup, args.repeats, args.profile) for n in names]
    if dist.get_rank() == 0:
        device = torch.cuda.get_device_name()
        result = dict(device=device, gpus=dist.get_world_size(), torch=torch.__version__,
                      nccl=".".join(map(str, torch.cuda.nccl.version())), p2p_GBps=bandwidth,
                      date=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                      command="torchrun --nproc_per_node=%d benchmarks/bench_ring.py --preset %s"
                              % (dist.get_world_size(), args.preset),
                      rows=rows)
        path = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                        f"ring_{device.replace(' ', '_')}_{dist.get_world_size()}gpu.json")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
        print("wrote", path)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
