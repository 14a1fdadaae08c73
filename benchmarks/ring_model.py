"""Ring attention beyond the GPUs at hand: a model of the efficiency at P = 4, 8 and 16, from a measured P-GPU run.

    python benchmarks/ring_model.py benchmarks/results/ring_NVIDIA_H100_80GB_HBM3_2gpu.json [--out PATH]

The input is bench_ring.py's JSON with --profile (T1, the ring's times, each rank's kernel-time breakdown and the
point-to-point bandwidth). For each preset and P the model takes each rank's work from the ring's own plan
(dilated_attn.ring.ring_plan: local branches, the block tasks of every step, the rows each step receives) and:

* compute time: the FLOPs of that work over the rate the measured run achieved (FLOPs of its slowest rank over
  that rank's attention and merge/addition kernel time, forward and forward+backward apart), so per-call costs
  that grow as blocks shrink are not modelled: an upper bound on the efficiency in that respect;
* communication: the bytes of each step (K/V in the forward; K/V again and dK/dV in float32 in the backward) over
  the bandwidth; a step's K/V travel while the previous step computes (the local branches and the own rows first),
  dK/dV while the following steps compute, the last of them while the own rows compute (as ring/autograd.py
  orders them); only what outlasts that compute is exposed;
* the rest of the measured call's time (the host's, before, between and after the kernels: the measured time less
  the slowest rank's kernel and exposed communication time), added as is, so the model gives the measured
  efficiency at the measured P.

T1 is the measured single-GPU time of the run, so the efficiency is T1 / (P * TP). Two links: the run's measured
point-to-point bandwidth (one node, NVLink) and 50 GB/s (every transfer between nodes: a lower bound for a ring of
8-GPU nodes, where only one hop in eight crosses). The model at the run's own P is printed beside the measurement.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from dilated_attn.ring import ring_plan
from dilated_attn.spec import flops, validate

CROSS_NODE_GBPS = 50.0


def _local_flops(cfg, L, plan, backward: bool) -> float:
    if not plan.local_branches:
        return 0.0
    q = torch.empty(cfg["B"], L, cfg["H"], cfg["D"], device="meta")
    w = [cfg["branches"][i][0] for i in plan.local_branches]
    r = [cfg["branches"][i][1] for i in plan.local_branches]
    return flops(validate(q, q, q, w, r, causal=cfg["causal"]), backward)


def rank_work(cfg, P: int, rank: int, itemsize: int = 2):
    """(local FLOPs, [FLOPs of step t], [K/V bytes received at step t]) of one rank's forward."""
    N, B, H, D = cfg["N"], cfg["B"], cfg["H"], cfg["D"]
    L = N // P
    w, r = zip(*cfg["branches"]) if cfg["branches"] else ((N,), (1,))
    plan = ring_plan(P, L, H, H, tuple(w), tuple(r), "all", cfg["causal"], cfg["layout"])
    steps, received = [], []
    for t in range(P):
        src = (rank - t) % P
        steps.append(sum(4.0 * B * (task.q_stop - task.q_start) * (task.kv_stop - task.kv_start)
                         * len(plan.stacks[task.stack].q_heads) * D * (0.5 if task.causal else 1.0)
                         for task in plan.tasks[rank][src]))
        received.append(0 if t == 0 else 2 * plan.rows_needed(rank, src) * B * D * itemsize)
    return _local_flops(cfg, L, plan, backward=False), steps, received


def ring_time(local_ms: float, step_ms: list, kv_ms: list, grad_ms: list | None) -> tuple[float, float]:
    """(total ms, exposed communication ms) of one pass: K/V of step t travel while step t-1 computes (step 0 with
    the local work); with `grad_ms`, dK/dV of step t travel while the later steps and the own rows compute."""
    P = len(step_ms)
    clock, exposed, ready = local_ms, 0.0, {}
    if grad_ms is None:
        clock += step_ms[0]
    posted = 0.0  # when the next K/V transfer started
    for t in range(1, P):
        arrive = posted + kv_ms[t]
        if arrive > clock:
            exposed += arrive - clock
            clock = arrive
        posted = clock
        clock += step_ms[t]
        if grad_ms is not None:
            ready[t] = clock + grad_ms[t]
    if grad_ms is not None:
        clock += step_ms[0]
        last = max(ready.values(), default=0.0)
        if last > clock:
            exposed += last - clock
            clock = last
    return clock, exposed


def model(row: dict, P: int, gbps: float, measured_P: int) -> dict:
    cfg = dict(N=row["N"], B=row["B"], H=row["H"], D=row["D"], causal=row["causal"], layout=row["layout"],
               branches=[tuple(b) for b in row["branches"]] if row["branches"] else None)
    prof = row["gpu_time_per_rank"]
    rates, host = {}, {}
    for mode, factor in (("fwd", 1.0), ("fwd_bwd", 3.5)):
        worst = None
        for rank, b in enumerate(prof[mode]):
            local, steps, _ = rank_work(cfg, measured_P, rank)
            work = (local + sum(steps)) * factor
            rate = work / (b["attention_ms"] + b["merge_and_accumulate_ms"])
            if worst is None or rate < worst:
                worst = rate
        rates[mode] = worst
        # everything else the measured call took: the host's time before, between and after the kernels
        tp = row["tp_fwd_ms"] if mode == "fwd" else row["tp_fwd_bwd_ms"]
        host[mode] = max(0.0, tp - max(b["attention_ms"] + b["merge_and_accumulate_ms"] + b["exposed_communication_ms"]
                                       for b in prof[mode]))
    out = {}
    for mode, factor in (("fwd", 1.0), ("fwd_bwd", 3.5)):
        slowest, exposed_max = 0.0, 0.0
        for rank in range(P):
            local, steps, received = rank_work(cfg, P, rank)
            step_ms = [f * factor / rates[mode] for f in steps]
            local_ms = local * factor / rates[mode]
            kv_ms = [b / gbps / 1e6 for b in received]
            if mode == "fwd":
                total, exposed = ring_time(local_ms, step_ms, kv_ms, None)
            else:
                # forward, then the backward: its compute is 2.5/3.5 of the step's; K/V again, dK/dV in float32
                f_ms = [s / 3.5 for s in step_ms]
                fwd, e1 = ring_time(local_ms / 3.5, f_ms, kv_ms, None)
                b_ms = [s * 2.5 / 3.5 for s in step_ms]
                bwd, e2 = ring_time(local_ms * 2.5 / 3.5, b_ms, kv_ms, [2 * k for k in kv_ms])
                total, exposed = fwd + bwd, e1 + e2
            total += host[mode]
            if total > slowest:
                slowest, exposed_max = total, exposed
        t1 = row["t1_fwd_ms"] if mode == "fwd" else row["t1_fwd_bwd_ms"]
        out[mode] = dict(tp_ms=slowest, exposed_communication_ms=exposed_max, efficiency=t1 / (P * slowest))
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", help="bench_ring.py JSON (run with --profile)")
    ap.add_argument("--gpus", default="2,4,8,16")
    ap.add_argument("--out", default=None, help="JSON path (default: beside the input, ring_model_<input name>)")
    args = ap.parse_args(argv)
    with open(args.results) as f:
        data = json.load(f)
    measured_P = data["gpus"]
    links = {"one node": data["p2p_GBps"], "across nodes": CROSS_NODE_GBPS}
    report = dict(source=os.path.basename(args.results), device=data["device"], measured_P=measured_P,
                  links_GBps=links, presets={})
    for row in data["results"]:
        if "gpu_time_per_rank" not in row:
            continue
        name = row["preset"]
        entry = report["presets"][name] = dict(
            measured=dict(fwd=row["efficiency_fwd"], fwd_bwd=row["efficiency_fwd_bwd"]), model={})
        print(f"{name}: measured at P={measured_P}: fwd {row['efficiency_fwd']:.1%}, fwd+bwd "
              f"{row['efficiency_fwd_bwd']:.1%}")
        for link, gbps in links.items():
            for P in (int(p) for p in args.gpus.split(",")):
                m = model(row, P, gbps, measured_P)
                entry["model"].setdefault(link, {})[P] = m
                print(f"  model, {link} ({gbps:.0f} GB/s), P={P:>2}: fwd {m['fwd']['efficiency']:.1%} "
                      f"(exposed {m['fwd']['exposed_communication_ms']:.2f} ms), fwd+bwd "
                      f"{m['fwd_bwd']['efficiency']:.1%} (exposed {m['fwd_bwd']['exposed_communication_ms']:.2f} ms)")
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(args.results)),
                                   "ring_model_" + os.path.basename(args.results))
    with open(out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"written: {out}")


if __name__ == "__main__":
    main()
