"""Render benchmark JSON to PNG: TFLOP/s (or time) per provider against N, forward and forward+backward.

    python benchmarks/plot_results.py                          # every benchmarks/results/*.json it can read
    python benchmarks/plot_results.py out.json --out-dir plots --metric ms

Reads the JSON of benchmarks/bench_gpu.py and of `python -m dilated_attn bench --json` (a `results` list of
rows with N, provider, mode, median_ms, tflops); other files are skipped with a note (named files: an
error). Each PNG goes next to its JSON (same name, .png; _ms.png for --metric ms) or into --out-dir. Needs
matplotlib. The plotting itself is dilated_attn.cli.measure.plot_rows, shared with `bench --plot`.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys

from dilated_attn.cli.measure import matplotlib_missing, plot_rows

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
ROW_KEYS = ("N", "provider", "mode", "median_ms", "tflops")


def load_rows(path: str) -> tuple[list[dict] | None, dict]:
    """(rows, record), or (None, record) when the file is not in the format described above."""
    with open(path) as f:
        record = json.load(f)
    rows = record.get("results") if isinstance(record, dict) else None
    if not rows or not all(isinstance(r, dict) and all(k in r for k in ROW_KEYS) for r in rows):
        return None, record if isinstance(record, dict) else {}
    return rows, record


def title_of(record: dict) -> str:
    device = record.get("device", {})
    cfg = record.get("config", {})
    sizes = " ".join(f"{label}={cfg[key]}" for key, label in (("batch", "B"), ("heads", "H"), ("head_dim", "D"))
                     if key in cfg)
    name = device.get("name") if isinstance(device, dict) else device
    return ", ".join(str(x) for x in (name, cfg.get("dtype"), sizes) if x)


def main(argv=None) -> list[str]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("json", nargs="*", help="JSON files (default: benchmarks/results/*.json)")
    ap.add_argument("--out-dir", default=None, help="where the PNGs go (default: next to each JSON)")
    ap.add_argument("--metric", choices=["tflops", "ms"], default="tflops")
    args = ap.parse_args(argv)
    missing = matplotlib_missing()
    if missing:
        ap.error(missing)
    paths = args.json or sorted(glob.glob(os.path.join(RESULTS, "*.json")))
    metric = "median_ms" if args.metric == "ms" else "tflops"
    written = []
    for path in paths:
        if not os.path.isfile(path):
            ap.error(f"no such file: {path}")
        rows, record = load_rows(path)
        if rows is None:
            note = f"{path}: no `results` rows with {', '.join(ROW_KEYS)}"
            if args.json:
                ap.error(note)
            print(f"skipped {note}", flush=True)
            continue
        stem = os.path.splitext(os.path.basename(path))[0] + ("_ms" if args.metric == "ms" else "")
        out = os.path.join(args.out_dir or os.path.dirname(os.path.abspath(path)), stem + ".png")
        plot_rows(rows, out, metric, title_of(record))
        print(f"wrote {out}", flush=True)
        written.append(out)
    return written


if __name__ == "__main__":
    main()
    sys.exit(0)
