"""Shared memory of every candidate config of the Triton kernels, as compiled, against the estimate that picks them:

    python tools/triton_shared_memory.py                      # float32 and bfloat16, head dims 64/128/256
    python tools/triton_shared_memory.py --dtypes float32 --head-dims 128 --precision tf32x3
    python tools/triton_shared_memory.py --dtypes float32 --head-dims 256 --kept-only   # those that may run

For each kernel (forward, dK/dV, dQ), dtype and head dim it compiles every candidate (without launching) and
prints the bytes Triton asks for, the device's limit, and whether the estimate (`Tunable.fitting`) keeps the
config. A kept config that does not fit is an estimate that is too low: the heuristic or the sweep could pick it
and the launch would fail. Exit status 1 when there is one.
"""

from __future__ import annotations

import argparse
import sys

import torch

from dilated_attn.backends import triton as triton_backend
from dilated_attn.spec import validate


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--head-dims", nargs="+", type=int, default=[64, 128, 256])
    ap.add_argument("--precision", choices=["tf32", "tf32x3", "ieee"],
                    help="float32 products to compile (default: what float32_precision chooses)")
    ap.add_argument("--kept-only", action="store_true", help="compile only the configs the estimate keeps")
    args = ap.parse_args(argv)
    if triton_backend.load_error() is not None:
        sys.exit(f"the triton backend cannot load: {triton_backend.load_error()}")
    from dilated_attn.backends.triton import configs, ops

    limit = torch.cuda.get_device_properties(0).shared_memory_per_block_optin
    print(f"{torch.cuda.get_device_name()}: {limit} bytes of shared memory per block", flush=True)
    too_low = 0
    for dtype_name in args.dtypes:
        for head_dim in args.head_dims:
            dtype = getattr(torch, dtype_name)
            q, k, v = (torch.randn(1, 512, 2, head_dim, device="cuda", dtype=dtype) for _ in range(3))
            p = validate(q, k, v, [256, 512], [1, 2])
            launches = ops.collect_launches(q, k, v, p, backward=True)
            for t in ops.TUNABLES:
                kernel, grid, call_args, kwargs = next(launch for launch in launches if launch[0] is t.fn)
                for name in ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages"):
                    kwargs.pop(name)
                if dtype == torch.float32:
                    kwargs["PRECISION"] = args.precision or kwargs["PRECISION"]
                precision = kwargs["PRECISION"] if dtype == torch.float32 else None
                block_d = kwargs["BLOCK_D"]
                kept = t.fitting(block_d, q.element_size(), precision, limit)
                for config in kept if args.kept_only else t.candidates_for(precision):
                    compiled = t.fn.warmup(*call_args, grid=grid, **kwargs, **configs.config_dict(config))
                    shared = compiled.metadata.shared
                    estimate = t.shared_memory(config, block_d, q.element_size(), precision)
                    verdict = ("kept" if config in kept else "pruned") + (", fits" if shared <= limit else ", too big")
                    if config in kept and shared > limit:
                        too_low += 1
                        verdict += "  <-- estimate too low"
                    print(f"{dtype_name:>8} {precision or '':>6} D={head_dim:<3} {t.name:<5} {str(config):<60} "
                          f"{shared:>7} B (estimate {estimate:>7} B)  {verdict}", flush=True)
    print(f"{too_low} kept config(s) that do not fit")
    return 1 if too_low else 0


if __name__ == "__main__":
    sys.exit(main())
