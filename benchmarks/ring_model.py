"""ring_attention's modes beyond the GPUs at hand: a model calibrated on measured runs, and its projection.

    python benchmarks/ring_model.py results/ring_NVIDIA_H200_2gpu.json results/ring_NVIDIA_H200_4gpu.json [--out PATH]

The inputs are bench_ring.py's JSON (strong scaling) at two GPU counts of one machine. For each preset, mode and
pass (forward; forward+backward) the model writes one call on P ranks as

    TP(P) = T1/P * (1 + e) + s * (steps a rank waits on) + exposed transfer time

T1 is one GPU's time for the global N (measured in the same run). e is the work a rank does beyond T1/P (merges,
layout copies, smaller launches, the host). s is the time a rank loses per ring step (P - 1 of them) or per
all-to-all peer: waiting for the slowest peer's step, which the profiles show as communication no kernel overlaps
and which does not shrink with the bytes. The transfer time is the bytes the busiest rank sends over the link's
bandwidth (the forward's: the ring plan's K/V (dilated_attn.ring.ring_plan), or the heads mode's all-to-all;
forward+backward: the ring sends dK/dV in float32 and, where its forward exchanged step by step, K/V again: 3x or 4x
the forward's (RingComm.eager); the heads mode d_out in and dq, dk, dv back, 2x); the ring hides it behind a rank's
compute and exposes only what outlasts it, the heads mode (one head chunk) waits for all of it. The two measured
GPU counts give e and s (two equations), so the model reproduces both runs, except where they would make s
negative: then s = 0 and e is the mean of the two (the table prints how closely it reproduces them). The 2-D mode,
measured at one size only (2 x 2), takes the ring's and the heads mode's waits and fits e.

Packs placed whole (`--documents`: bench_ring.py's JSON of the documents mode, strong or weak, at one or more GPU
counts) move no bytes where no document is shared, so a call on P ranks is the busiest rank's share of the work:

    TP(P) = T1/P * balance(P) * (1 + e) + c

balance(P) the busiest rank's work over the mean in place_documents' layout of the pack on P ranks (its work
includes ROW_COST), e the work a rank does beyond its share (merges, smaller launches), c a call's fixed time (the
host's before the first kernel), both fitted over the GPU counts given (from one count: c = 0, e all of it).
Strong scaling keeps the run's pack; weak scaling draws bench_ring.documents(P * tokens a GPU) for each P, T1/P then
one GPU's time for a rank's share of that pack's work. The transfers of documents shared by rings (where one's work
exceeds a rank's share and no cut avoids its segments) are not counted: the table gives their share of the rows.

Projected: strong scaling at P = 8 (one node), 16 and 64 (nodes of 8 GPUs): NVLink 450 GB/s inside a node, 50 GB/s a
GPU between nodes (8 x 50 GB/s a node). A transfer that spans nodes runs at the slower link for its bytes that
cross. heads needs Hq % P == 0 (16 heads: P <= 16); 2d runs heads inside a node and the ring across nodes.
The seeds' machine: 2 GTX 1080 over PCIe 3.0 x16 without peer-to-peer (6 GB/s assumed: two host-staged copies),
running the CUDA kernels in float32 at the Pascal tiles' measured share of the FMA peak (46% forward, 31% forward +
backward; benchmarks/README.md), the H200 calibration's e and s, at sizes that fit 8 GB.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os

import torch
from bench_ring import documents

from dilated_attn import place_documents
from dilated_attn.cli.measure import flops
from dilated_attn.ring import ring_plan
from dilated_attn.ring.comm import RingComm
from dilated_attn.spec import Problem

NODE = 8
NVLINK_GBPS = 450.0
CROSS_NODE_GBPS = 50.0
PCIE_GBPS = 6.0
GTX1080 = dict(peak_tflops=8.9, share_fwd=0.46, share_fwd_bwd=0.31)
PASSES = (("fwd", 1.0), ("fwd_bwd", 2.0))  # (pass, the heads mode's traffic in units of its forward's)


def _branches(row):
    if row["branches"]:
        return tuple(w for w, _ in row["branches"]), tuple(r for _, r in row["branches"])
    return (row["N"],), (1,)


def _plan(row, P: int, heads: int = 0, head_start: int = 0):
    w, r = _branches(row)
    H = row["H"]
    n = heads or H
    return ring_plan(P, row["N"] // P, n, n, w, r, "all", row["causal"], row["layout"], head_start if heads else 0,
                     H if heads else 0)


def ring_bytes(row, P: int, heads: int = 0, head_start: int = 0, itemsize: int = 2, name: str = "fwd") -> float:
    """Bytes the busiest rank sends in the ring mode (over `heads` of the row's heads, from head_start) in pass
    `name`: the forward's K/V; forward+backward adds dK/dV in float32 (2x) and, where the forward exchanged step by
    step rather than at once (RingComm.eager: then the backward keeps the forward's), the K/V again."""
    plan = _plan(row, P, heads, head_start)
    forward = max(plan.bytes_sent(j, row["B"], row["D"], itemsize) for j in range(P))
    if name == "fwd":
        return forward
    n = heads or row["H"]
    return forward * (3 if RingComm(plan, 0, None, row["B"], row["D"], "cpu").eager(n, n) else 4)


def heads_bytes(row, P: int, itemsize: int = 2) -> int:
    """Forward bytes one rank sends in the heads mode (q's other heads, the key/value heads others read, the output
    of its heads at the others' positions; MHA)."""
    hq = row["H"] // P
    return row["B"] * (row["N"] // P) * row["D"] * itemsize * (P - 1) * (2 * hq + 2 * hq)


def _a2a_seconds(nbytes: float, P: int) -> float:
    """An all-to-all of P ranks in nodes of NODE: the bytes to peers in other nodes cross at CROSS_NODE_GBPS."""
    if P <= NODE:
        return nbytes / NVLINK_GBPS / 1e9
    crossing = (P - NODE) / (P - 1)
    return max(nbytes * crossing / CROSS_NODE_GBPS, nbytes * (1 - crossing) / NVLINK_GBPS) / 1e9


def _ring_seconds(nbytes: float, P: int) -> float:
    """The ring's steps run in lockstep: past one node every step waits for the hops that cross."""
    return nbytes / (NVLINK_GBPS if P <= NODE else CROSS_NODE_GBPS) / 1e9


def transfer_ms(row, mode: str, P: int, name: str, factor_heads: float) -> dict:
    """{'inner': ms, 'outer': ms} of the busiest rank's transfers at P on nodes of NODE GPUs (inner: heads)."""
    if mode == "ring":
        return {"outer": _ring_seconds(ring_bytes(row, P, name=name), P) * 1e3}
    if mode == "heads":
        return {"inner": _a2a_seconds(heads_bytes(row, P) * factor_heads, P) * 1e3}
    pi = min(P, NODE) if P > NODE else 2
    po = P // pi
    share = dict(row, N=row["N"] // po)  # the inner group's sequence
    inner = heads_bytes(share, pi) * factor_heads
    outer = 0 if po == 1 else max(ring_bytes(row, po, row["H"] // pi, j * (row["H"] // pi), name=name)
                                  for j in range(pi))
    return {"inner": _a2a_seconds(inner, pi) * 1e3,
            "outer": (outer / (CROSS_NODE_GBPS if P > NODE else NVLINK_GBPS) / 1e9) * 1e3}


def measured_transfer_ms(row, mode: str, bw: float, name: str, factor_heads: float) -> dict:
    """transfer_ms at the measured P with the measured link bandwidth (one host)."""
    P = row["P"]
    if mode == "ring":
        return {"outer": ring_bytes(row, P, name=name) / bw / 1e6}
    if mode == "heads":
        return {"inner": heads_bytes(row, P) * factor_heads / bw / 1e6}
    pi, po = 2, P // 2
    share = dict(row, N=row["N"] // po)
    outer = max(ring_bytes(row, po, row["H"] // pi, j * (row["H"] // pi), name=name) for j in range(pi))
    return {"inner": heads_bytes(share, pi) * factor_heads / bw / 1e6, "outer": outer / bw / 1e6}


def exposed_ms(mode: str, compute_ms: float, comm: dict) -> float:
    """Transfer time no compute hides: the ring's K/V travel while the previous step computes (exposed only past
    the rank's compute), the heads mode's all-to-all waits (one head chunk), the 2-D mode both."""
    return comm.get("inner", 0.0) + max(0.0, comm.get("outer", 0.0) - compute_ms)


def steps(mode: str, P: int) -> tuple[int, int]:
    """(ring steps, all-to-all peers) a rank waits on."""
    if mode == "ring":
        return P - 1, 0
    if mode == "heads":
        return 0, P - 1
    pi = min(P, NODE) if P > NODE else 2
    return P // pi - 1, pi - 1


def predict_ms(fit: dict, t1: float, P: int, comm: dict, mode: str) -> float:
    compute = t1 / P * (1 + fit["e"])
    ring_steps, peers = steps(mode, P)
    return compute + ring_steps * fit["s_ring"] + peers * fit["s_heads"] + exposed_ms(mode, compute, comm)


def calibrate(runs: list[dict]) -> dict:
    """{(preset, mode, pass): dict(e=, s_ring=, s_heads=, reproduced={P: (measured, model)})}: the 1-D modes from
    two GPU counts (e and the per-step wait s), the 2-D mode's e from its one size with the others' waits."""
    rows = {}
    for data in runs:
        for row in data["results"]:
            rows.setdefault((row["preset"], row["mode"]), []).append((row, data["p2p_GBps"]))
    fitted = {}
    for (preset, mode), found in sorted(rows.items(), key=lambda x: x[0][1] == "2d"):
        for name, fh in PASSES:
            t1_key, tp_key = ("t1_fwd_ms", "tp_fwd_ms") if name == "fwd" else ("t1_fwd_bwd_ms", "tp_fwd_bwd_ms")
            points = [(row["P"], row[t1_key], row[tp_key], measured_transfer_ms(row, mode, bw, name, fh))
                      for row, bw in sorted(found, key=lambda x: x[0]["P"])]
            if mode == "2d":
                ring, heads = fitted.get((preset, "ring", name)), fitted.get((preset, "heads", name))
                if ring is None or heads is None:
                    continue
                P, t1, tp, comm = points[-1]
                fit = dict(e=0.0, s_ring=ring["s_ring"], s_heads=heads["s_heads"])
                # e from the one size: TP - waits - exposed transfers = T1/P (1 + e) (exposed taken at e = 0)
                rest = tp - predict_ms(fit, t1, P, comm, mode) + t1 / P
                fit["e"] = rest * P / t1 - 1
            else:
                # y_P = TP - exposed - T1/P = e T1/P + s (P - 1): two GPU counts, two unknowns
                (p_a, t_a, tp_a, c_a), (p_b, t_b, tp_b, c_b) = points[0], points[-1]
                y_a = tp_a - exposed_ms(mode, t_a / p_a, c_a) - t_a / p_a
                y_b = tp_b - exposed_ms(mode, t_b / p_b, c_b) - t_b / p_b
                det = (t_a / p_a) * (p_b - 1) - (t_b / p_b) * (p_a - 1)
                e = (y_a * (p_b - 1) - y_b * (p_a - 1)) / det
                s = (y_b * (t_a / p_a) - y_a * (t_b / p_b)) / det
                if s < 0:  # a wait cannot be negative: no wait, and e the mean of the two runs' (then not exact)
                    s, e = 0.0, (y_a * p_a / t_a + y_b * p_b / t_b) / 2
                fit = dict(e=e, s_ring=s if mode == "ring" else 0.0, s_heads=s if mode == "heads" else 0.0)
            fit["reproduced"] = {P: (t1 / (P * tp), t1 / (P * predict_ms(fit, t1, P, comm, mode)))
                                 for P, t1, tp, comm in points}
            fitted[(preset, mode, name)] = fit
    return fitted


def gtx1080(row, fit: dict, name: str, P: int = 2) -> dict:
    """Efficiency on 2 GTX 1080 (PCIe, float32, the CUDA kernels) from the H200 calibration's e and s."""
    N = row["N"]
    w, r = _branches(row)
    q = torch.empty(row["B"], N, row["H"], row["D"], device="meta", dtype=torch.float32)
    p = Problem.from_sizes(row["B"], N, row["H"], row["H"], row["D"], list(w), list(r), dtype=torch.float32,
                           device="meta", causal=row["causal"])
    del q
    share = GTX1080["share_fwd" if name == "fwd" else "share_fwd_bwd"]
    t1 = flops(p, backward=name != "fwd") / (GTX1080["peak_tflops"] * 1e12 * share) * 1e3
    fh = dict(PASSES)[name]
    mode = row["mode"]
    if mode == "ring":
        comm = {"outer": ring_bytes(row, P, itemsize=4, name=name) / PCIE_GBPS / 1e6}
    else:
        comm = {"inner": heads_bytes(row, P, itemsize=4) * fh / PCIE_GBPS / 1e6}
    tp = predict_ms(fit, t1, P, comm, mode)
    return dict(t1_ms=t1, tp_ms=tp, efficiency=t1 / (P * tp))


def placement(lengths: list[int], row, P: int) -> tuple[float, float, float]:
    """(the busiest rank's work over the mean, the share of rows shared by rings, the pack's work) of the pack
    `lengths` placed on P ranks for the row's branches."""
    w, r = (None, None) if not row["branches"] else _branches(row)
    layout = place_documents([0, *itertools.accumulate(lengths)], w, r, causal=row["causal"], num_ranks=P)
    return max(layout.work) * P / sum(layout.work), layout.shared / layout.total, sum(layout.work)


def _weak(row) -> bool:
    """Whether a bench_ring row is weak scaling (its T1 ran on one GPU's tokens, not the whole N)."""
    return row["N"] != row["t1_N"]


def _pack(row, P: int) -> list[int]:
    """The row's pack at P ranks: its own lengths (strong scaling), or the documents preset's draw of P times its
    tokens a GPU (weak)."""
    return documents(P * row["t1_N"]) if _weak(row) else row["lengths"]


def calibrate_documents(runs: list[dict]) -> dict:
    """{(preset, "strong" or "weak", pass): dict(e=, c=, reproduced={P: (measured, model)}, ...)} of the documents
    mode's rows. A run's ideal time is TP * efficiency (T1/P; weak: one GPU's time for a rank's share of the work);
    TP = ideal * balance * (1 + e) + c, fitted over the runs' GPU counts (c = 0 from one count)."""
    found: dict = {}
    for data in runs:
        for row in data["results"]:
            if row["mode"] == "documents":
                found.setdefault((row["preset"], "weak" if _weak(row) else "strong"), []).append(row)
    fitted = {}
    for (preset, kind), rows in sorted(found.items()):
        placed = {row["P"]: placement(_pack(row, row["P"]), row, row["P"]) for row in rows}
        for name, _ in PASSES:
            points = [(row["P"], row[f"tp_{name}_ms"] * row[f"efficiency_{name}"], row[f"tp_{name}_ms"])
                      for row in sorted(rows, key=lambda x: x["P"])]
            xs = [ideal * placed[P][0] for P, ideal, _ in points]
            ys = [tp for _, _, tp in points]
            if len(points) == 1:
                e, c = ys[0] / xs[0] - 1, 0.0
            else:  # least squares of y = x (1 + e) + c
                mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
                slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
                e, c = slope - 1, my - slope * mx
            P0, ideal0, _ = points[0]
            fit = dict(e=e, c=c, kind=kind, row=next(row for row in rows if row["P"] == P0), P0=P0, ideal0=ideal0,
                       work0=placed[P0][2])
            fit["reproduced"] = {P: (ideal_p / tp, ideal_p / (ideal_p * placed[P][0] * (1 + e) + c))
                                 for P, ideal_p, tp in points}
            fitted[(preset, kind, name)] = fit
    return fitted


def project_documents(fit: dict, P: int) -> dict:
    """The documents mode's efficiency on P ranks, the layout's balance and the rows shared by rings. The ideal time
    at P: T1/P (strong), or in proportion to a rank's share of the pack drawn for P (weak)."""
    row = fit["row"]
    balance, shared, work = placement(_pack(row, P), row, P)
    if fit["kind"] == "strong":
        ideal = fit["ideal0"] * fit["P0"] / P
    else:
        ideal = fit["ideal0"] * (work / P) / (fit["work0"] / fit["P0"])
    return dict(efficiency=ideal / (ideal * balance * (1 + fit["e"]) + fit["c"]), balance=balance,
                shared_rows=shared)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", nargs=2, help="bench_ring.py JSON (strong scaling) at two GPU counts")
    ap.add_argument("--documents", nargs="+", default=[], metavar="JSON",
                    help="bench_ring.py JSON with documents-mode rows (packs placed whole), strong or weak")
    ap.add_argument("--gpus", default="8,16,64")
    ap.add_argument("--out", default=None, help="JSON path (default: results/ring_model_<device>.json)")
    args = ap.parse_args(argv)
    runs = [json.load(open(path)) for path in args.results]
    fitted = calibrate(runs)
    rows = {(row["preset"], row["mode"]): row for data in runs for row in data["results"]}
    report = dict(sources=[os.path.basename(p) for p in args.results], device=runs[0]["device"],
                  links_GBps=dict(nvlink=NVLINK_GBPS, cross_node=CROSS_NODE_GBPS, pcie_gtx1080=PCIE_GBPS),
                  node_gpus=NODE, fits={}, projected={}, gtx1080_2gpu={})
    print("calibration: e (work per rank beyond T1/P), s_ring / s_heads (ms a rank waits per ring step / all-to-all "
          "peer); efficiency measured / model")
    for (preset, mode, name), fit in fitted.items():
        key = f"{preset}/{mode}/{name}"
        report["fits"][key] = {k: v for k, v in fit.items() if k != "reproduced"} | {
            "reproduced": {str(P): dict(measured=m, model=x) for P, (m, x) in fit["reproduced"].items()}}
        shown = ", ".join(f"P={P}: {m:.1%} / {x:.1%}" for P, (m, x) in fit["reproduced"].items())
        params = ", ".join(f"{k} {v:.3f}" for k, v in fit.items() if k != "reproduced")
        print(f"  {key}: {params}; {shown}")
    print(f"projected (strong scaling, nodes of {NODE}: NVLink {NVLINK_GBPS:.0f} GB/s, {CROSS_NODE_GBPS:.0f} GB/s "
          f"a GPU between nodes), efficiency fwd+bwd / fwd:")
    for preset in sorted({p for p, _, _ in fitted}):
        for mode in ("ring", "heads", "2d"):
            if (preset, mode, "fwd") not in fitted:
                continue
            row = rows[(preset, mode)]
            cells = []
            for P in (int(x) for x in args.gpus.split(",")):
                out = {}
                if mode == "heads" and row["H"] % P:
                    cells.append(f"P={P}: n/a ({row['H']} heads)")
                    report["projected"].setdefault(f"{preset}/{mode}", {})[P] = None
                    continue
                for name, fh in PASSES:
                    fit = fitted[(preset, mode, name)]
                    t1 = row["t1_fwd_ms" if name == "fwd" else "t1_fwd_bwd_ms"]
                    tp = predict_ms(fit, t1, P, transfer_ms(row, mode, P, name, fh), mode)
                    out[name] = dict(tp_ms=tp, efficiency=t1 / (P * tp))
                report["projected"].setdefault(f"{preset}/{mode}", {})[P] = out
                cells.append(f"P={P}: {out['fwd_bwd']['efficiency']:.1%} / {out['fwd']['efficiency']:.1%}")
            print(f"  {preset}/{mode}: " + "; ".join(cells))
    print(f"2 x GTX 1080 (PCIe 3.0 x16, {PCIE_GBPS:.0f} GB/s, float32, the CUDA kernels), efficiency fwd+bwd / fwd:")
    for preset, mode, N in (("dense", "ring", 65536), ("dense", "heads", 65536), ("longnet", "ring", 131072),
                            ("longnet", "heads", 131072)):
        if (preset, mode, "fwd") not in fitted:
            continue
        row = dict(rows[(preset, mode)], N=N, mode=mode)
        res = {name: gtx1080(row, fitted[(preset, mode, name)], name) for name, _ in PASSES}
        report["gtx1080_2gpu"][f"{preset}/{mode}/N={N}"] = res
        print(f"  {preset} N={N} {mode}: {res['fwd_bwd']['efficiency']:.1%} / {res['fwd']['efficiency']:.1%} "
              f"(T1 {res['fwd_bwd']['t1_ms']:.0f} / {res['fwd']['t1_ms']:.0f} ms)")
    if args.documents:
        documents_report(args.documents, [int(x) for x in args.gpus.split(",")], report)
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(args.results[0])),
                                   f"ring_model_{runs[0]['device']['name'].replace(' ', '_')}.json")
    with open(out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"written: {out}")


def documents_report(paths: list[str], gpus: list[int], report: dict) -> None:
    """The documents mode's fits and projections, printed and into `report` ("documents")."""
    fitted = calibrate_documents([json.load(open(path)) for path in paths])
    report["documents"] = dict(sources=[os.path.basename(p) for p in paths], fits={}, projected={})
    print("packs placed whole (documents mode): e (work per rank beyond its share), c (ms a call beyond it); "
          "efficiency measured / model")
    for (preset, kind, name), fit in fitted.items():
        shown = ", ".join(f"P={P}: {m:.1%} / {x:.1%}" for P, (m, x) in fit["reproduced"].items())
        print(f"  {preset}/{kind}/{name}: e {fit['e']:.3f}, c {fit['c']:.3f}; {shown}")
        report["documents"]["fits"][f"{preset}/{kind}/{name}"] = dict(e=fit["e"], c=fit["c"], reproduced={
            str(P): dict(measured=m, model=x) for P, (m, x) in fit["reproduced"].items()})
    print("projected, efficiency fwd+bwd / fwd (the layout's busiest rank over the mean; rows shared by rings):")
    for preset, kind in sorted({(p, k) for p, k, _ in fitted}):
        cells = []
        for P in gpus:
            out = {name: project_documents(fitted[(preset, kind, name)], P) for name, _ in PASSES}
            report["documents"]["projected"].setdefault(f"{preset}/{kind}", {})[P] = out
            one = out["fwd"]
            cells.append(f"P={P}: {out['fwd_bwd']['efficiency']:.1%} / {one['efficiency']:.1%} ({one['balance']:.3f}x"
                         + (f", {one['shared_rows']:.0%} shared" if one["shared_rows"] else "") + ")")
        print(f"  {preset}/{kind}: " + "; ".join(cells))


if __name__ == "__main__":
    main()
