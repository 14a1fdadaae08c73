"""Write the shipped config table of the Triton kernels from a full sweep on this GPU.

    python benchmarks/tune.py                                   # the default grid, merged into the shipped table
    python benchmarks/tune.py --dtypes bfloat16 --head-dims 128 --members 2048
    python benchmarks/tune.py --out /tmp/table.json             # merged into another file (created if missing)

For every (dtype, head dim, causal, members bucket) of the grid it runs one forward+backward of one branch
(segment length = the bucket, dilation 1; B=1, H=16, N = 32 x the bucket within [16384, 65536]) with
DILATED_ATTN_AUTOTUNE's sweep: each kernel (forward, dK/dV, dQ) benchmarks every candidate config that fits this
GPU's shared memory (triton.testing.do_bench medians) and keeps the fastest. Each result becomes one entry of the
table (src/dilated_attn/backends/triton/tuned_configs.json), replacing an entry of the same key, with the index of
its source: the device, capability, command, date and versions of this run. The file is rewritten after every
entry, so a run cut short keeps what it measured.

The sweep's problem is the branch a LongNet layer sweeps on first (dilation 1, full segments): the kernels' key
has no dilation, and every branch of a key runs the same config. float32 is tuned with the products it runs by
default (tf32x3; TF32 with --allow-tf32). About 10 s per entry on an H100 (float32 longer).
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import sys
import time
from pathlib import Path

import torch
import triton

import dilated_attn
from dilated_attn.backends import triton as triton_backend
from dilated_attn.cli.measure import command_line, random_inputs, say

GRID = dict(dtypes=["bfloat16", "float16", "float32"], head_dims=[128, 64], causal=[False, True],
            members=[64, 512, 2048, 8192])
ABOUT = ("Triton kernel configs per (GPU family, dtype, float32 precision, head-dim tile, causal, members bucket), "
         "written by benchmarks/tune.py from a full sweep on the device its source names; read by "
         "dilated_attn/backends/triton/configs.py.")


def sweep(dtype: torch.dtype, head_dim: int, causal: bool, members: int) -> dict:
    """One forward+backward under the sweep: {kernel name: config dict} of what each kernel's sweep chose."""
    from dilated_attn.backends.triton import configs, ops

    seq_len = min(max(32 * members, 16384), 65536)
    q, k, v, grad_out = random_inputs(1, seq_len, 16, head_dim, dtype=dtype, device="cuda")
    for t in ops.TUNABLES:
        t.autotuner.cache.clear()  # this key's sweep, not a result kept from an earlier one in this process
    configs.AUTOTUNE = True
    try:
        out = dilated_attn.dilated_attention(q, k, v, [members], [1], causal=causal, backend="triton")
        torch.autograd.grad(out, (q, k, v), grad_out)
        torch.cuda.synchronize()
    finally:
        configs.AUTOTUNE = False
    best = {}
    for t in ops.TUNABLES:
        (config,) = t.autotuner.cache.values()  # one branch: one key
        best[t.name] = configs.config_dict(config)
    return best


def main(argv=None) -> int:
    from dilated_attn.backends.triton import configs

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", nargs="+", choices=["bfloat16", "float16", "float32"], default=GRID["dtypes"])
    ap.add_argument("--head-dims", nargs="+", type=int, default=GRID["head_dims"])
    ap.add_argument("--causal", nargs="+", choices=["false", "true"], default=["false", "true"])
    ap.add_argument("--members", nargs="+", type=int, default=GRID["members"],
                    help="members buckets (powers of two up to %d)" % configs.MAX_MEMBERS_BUCKET)
    ap.add_argument("--allow-tf32", action="store_true", help="tune float32 with TF32 products")
    ap.add_argument("--out", default=str(configs.TABLE_PATH), help="the table to merge into (default: the shipped)")
    args = ap.parse_args(argv)
    for m in args.members:
        if m != configs.members_bucket(m):
            ap.error(f"--members: {m} is not a members bucket (a power of two up to {configs.MAX_MEMBERS_BUCKET})")
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU")
    if triton_backend.load_error() is not None:
        ap.error(f"the triton backend cannot load: {triton_backend.load_error()}")
    torch.backends.cuda.matmul.allow_tf32 = args.allow_tf32

    path = Path(args.out)
    table = json.loads(path.read_text()) if path.exists() else dict(about=ABOUT, sources=[], entries=[])
    table["about"] = ABOUT
    capability = torch.cuda.get_device_capability()
    source = dict(device=torch.cuda.get_device_name(), capability="%d.%d" % capability,
                  command=command_line(), date=datetime.date.today().isoformat(),
                  torch=torch.__version__, triton=triton.__version__)
    table["sources"].append(source)
    source_index = len(table["sources"]) - 1
    gpu = configs.gpu_family(capability)
    say(f"tuning on {source['device']} ({gpu}), torch {torch.__version__}, triton {triton.__version__} -> {path}")

    grid = list(itertools.product(args.dtypes, args.head_dims, [c == "true" for c in args.causal], args.members))
    start = time.perf_counter()
    for i, (dtype_name, head_dim, causal, members) in enumerate(grid, 1):
        dtype = getattr(torch, dtype_name)
        precision = triton_backend.float32_precision(torch.device("cuda"), head_dim) if dtype_name == "float32" \
            else None
        t0 = time.perf_counter()
        best = sweep(dtype, head_dim, causal, members)
        key = configs.Key(gpu, dtype_name, precision, triton_backend.block_d(head_dim), causal, members)
        entry = dict(key._asdict(), **best, source=source_index)
        table["entries"] = [e for e in table["entries"]
                            if configs.Key(*(e[f] for f in configs.Key._fields)) != key] + [entry]
        table["entries"].sort(key=lambda e: (e["gpu"], e["dtype"], e["precision"] or "", e["block_d"], e["causal"],
                                             e["members"]))
        path.write_text(json.dumps(table, indent=1) + "\n")
        say(f"[{i}/{len(grid)}] {dtype_name} {precision or ''} D={head_dim} causal={causal} members={members}: "
            f"{time.perf_counter() - t0:.1f} s  fwd {best['fwd']}  dkdv {best['dkdv']}  dq {best['dq']}"
            f"  ({time.perf_counter() - start:.0f} s in all)")
    # sources no entry names any more are dropped, the indices renumbered
    used = sorted({e["source"] for e in table["entries"]})
    renumber = {old: new for new, old in enumerate(used)}
    table["sources"] = [table["sources"][old] for old in used]
    for e in table["entries"]:
        e["source"] = renumber[e["source"]]
    path.write_text(json.dumps(table, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TRITON_PRINT_AUTOTUNING", "0")
    sys.exit(main())
