"""Locality of Hilbert-curve serialisation against raster (row-major) order, and index build times.

    python benchmarks/hilbert_locality.py [--json PATH]

A dilated-attention branch of segment length w attends within the runs of w consecutive positions
[k*w, (k+1)*w). For each run this measures the bounding box of its cells on the grid: its size in cells
(area; volume in 3-D) and its half-perimeter (sum of the box's side lengths), averaged over the runs.
Area alone does not show locality: an aligned raster run of m full rows fills its box exactly, as a
Hilbert square does; the half-perimeter tells a 1 x 256 stripe from a 16 x 16 square.

Build times (dilated_attn.cli.measure.median_ms): "first" is a cold build (cache cleared before each run;
median of 3), "cached" a repeated call (median of 1000). CPU only; the index is built on the CPU and copied
once per device. --json writes the locality rows as `results` and the build times as `build`.
"""

from __future__ import annotations

import argparse
import math

import torch

from dilated_attn import hilbert
from dilated_attn.cli.measure import Record, median_ms

LOCALITY = [((256, 256), (256, 1024, 4096)), ((224, 224), (256, 1024, 4096)), ((32, 32, 32), (512, 4096))]
BUILD = [(256, 256), (224, 224), (1024, 1024), (1000, 999), (32, 32, 32), (100, 37, 55), (128, 128, 128)]


def run_boxes(cells: torch.Tensor, w: int) -> tuple[float, float]:
    """Mean bounding-box cell count and mean half-perimeter over the complete runs of w positions."""
    runs = cells[: cells.shape[0] // w * w].view(-1, w, cells.shape[1])
    extent = runs.amax(1) - runs.amin(1) + 1
    return extent.prod(1).double().mean().item(), extent.sum(1).double().mean().item()


def locality(shape, ws):
    raster = torch.stack(torch.unravel_index(torch.arange(math.prod(shape)), shape), 1)
    curve = raster[hilbert.hilbert_index(shape)]
    rows = []
    for w in ws:
        r_cells, r_half = run_boxes(raster, w)
        h_cells, h_half = run_boxes(curve, w)
        rows.append(dict(grid="x".join(map(str, shape)), w=w, raster_bbox_cells=r_cells,
                         hilbert_bbox_cells=h_cells, cells_ratio=r_cells / h_cells,
                         raster_half_perimeter=r_half, hilbert_half_perimeter=h_half,
                         half_perimeter_ratio=r_half / h_half))
    return rows


def build_time(shape):
    def build():
        hilbert.hilbert_index(shape)

    first_ms = median_ms(build, "cpu", warmup=0, repeats=3, before_run=hilbert.clear_cache)
    cached_ms = median_ms(build, "cpu", warmup=1, repeats=1000)
    return dict(grid="x".join(map(str, shape)), cells=math.prod(shape), first_ms=first_ms, cached_us=cached_ms * 1e3)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    args = ap.parse_args(argv)

    loc = [row for shape, ws in LOCALITY for row in locality(shape, ws)]
    print("| grid | w | bbox cells: raster | hilbert | ratio | bbox half-perimeter: raster | hilbert | ratio |")
    print("|---|---|---|---|---|---|---|---|")
    for r in loc:
        print(f"| {r['grid']} | {r['w']} | {r['raster_bbox_cells']:.0f} | {r['hilbert_bbox_cells']:.0f} | "
              f"{r['cells_ratio']:.2f} | {r['raster_half_perimeter']:.1f} | {r['hilbert_half_perimeter']:.1f} | "
              f"{r['half_perimeter_ratio']:.2f} |")
    print()
    builds = [build_time(shape) for shape in BUILD]
    print("| grid | cells | first call | cached call |")
    print("|---|---|---|---|")
    for b in builds:
        print(f"| {b['grid']} | {b['cells']} | {b['first_ms']:.1f} ms | {b['cached_us']:.1f} us |")

    if args.json:
        record = Record("hilbert_locality", "cpu", dict(locality=LOCALITY, build=BUILD), json_path=args.json,
                        build=builds)
        for row in loc:
            record.add(row)
        print()
        record.close()


if __name__ == "__main__":
    main()
