"""Shared memory of every Triton autotuning config, as compiled, against the estimate that prunes them:

    python tools/triton_shared_memory.py                      # float32 and bfloat16, head dims 64/128/256
    python tools/triton_shared_memory.py --dtypes float32 --head-dims 128 --precision tf32x3
    python tools/triton_shared_memory.py --dtypes float32 --head-dims 256 --kept-only   # the configs tuned

For each kernel (forward, dK/dV, dQ), dtype and head dim it compiles every config (without launching) and
prints the bytes Triton asks for, the device's limit, and whether `prune_by_shared_memory` keeps the config.
A kept config that does not fit is an estimate that is too low: with DILATED_ATTN_TRITON_AUTOTUNE=0, or when
it is the only config left, the launch fails. Exit status 1 when there is one.
"""

from __future__ import annotations

import argparse
import sys

import torch

import dilated_attn
from dilated_attn.backends import triton as triton_backend
from dilated_attn.backends.triton import bwd, fwd, ops  # ops first: it reads the kernels' own prunes at import

KERNELS = {"forward": fwd._fwd_kernel, "dkdv": bwd._dkdv_kernel, "dq": bwd._dq_kernel}


def capture_launches(dtype, head_dim):
    """The (args, kwargs) of each kernel's first launch in a forward + backward, each run with its smallest
    config (the last of its list) so that the capture itself cannot run out of shared memory."""
    launches = {}
    for name, kernel in KERNELS.items():
        def run(*args, _name=name, _kernel=kernel, _run=kernel.run, **kwargs):
            launches.setdefault(_name, (args, dict(kwargs)))
            return _run(*args, **kwargs)

        kernel.run = run
        kernel.early_config_prune = lambda configs, named_args, **kw: configs[-1:]
    q, k, v = (torch.randn(1, 512, 2, head_dim, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
    out = dilated_attn.dilated_attention(q, k, v, [256, 512], [1, 2], backend="triton")
    out.sum().backward()
    return launches


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--head-dims", nargs="+", type=int, default=[64, 128, 256])
    ap.add_argument("--precision", choices=["tf32", "tf32x3", "ieee"],
                    help="float32 products to compile (default: what float32_precision chooses)")
    ap.add_argument("--kept-only", action="store_true", help="compile only the configs the estimate keeps")
    args = ap.parse_args(argv)
    prunes = {name: kernel.early_config_prune for name, kernel in KERNELS.items()}
    runs = {name: kernel.run for name, kernel in KERNELS.items()}
    limit = torch.cuda.get_device_properties(0).shared_memory_per_block_optin
    print(f"{torch.cuda.get_device_name()}: {limit} bytes of shared memory per block", flush=True)
    too_low = 0
    for dtype_name in args.dtypes:
        for head_dim in args.head_dims:
            dtype = getattr(torch, dtype_name)
            precision = "tf32"  # ignored by 16-bit inputs
            if dtype == torch.float32:
                precision = args.precision or triton_backend.float32_precision(torch.device("cuda"), head_dim)
            # captured with products whose smallest configs fit and compile quickly (TF32 from Ampere on, IEEE
            # before), then compiled with `precision`
            capture = "tf32" if torch.cuda.get_device_capability() >= (8, 0) else "ieee"
            choose, ops.float32_precision = ops.float32_precision, lambda *a: capture  # what the launchers call
            try:
                launches = capture_launches(dtype, head_dim)
            finally:
                ops.float32_precision = choose
            for name, kernel in KERNELS.items():
                kernel.run, kernel.early_config_prune = runs[name], prunes[name]
                call_args, kwargs = launches[name]
                grid = kwargs.pop("grid")
                kwargs.pop("warmup", None)
                kwargs["PRECISION"] = precision
                kept = prunes[name](kernel.configs, dict(zip(kernel.arg_names, call_args)), **kwargs)
                for config in kept if args.kept_only else kernel.configs:
                    compiled = kernel.fn.warmup(*call_args, grid=grid, **kwargs, **config.all_kwargs())
                    shared = compiled.metadata.shared
                    verdict = ("kept" if config in kept else "pruned") + (", fits" if shared <= limit else ", too big")
                    if config in kept and shared > limit:
                        too_low += 1
                        verdict += "  <-- estimate too low"
                    print(f"{dtype_name:>8} {kwargs['PRECISION']:>6} D={head_dim:<3} {name:<7} {str(config):<60} "
                          f"{shared:>7} B  {verdict}", flush=True)
    print(f"{too_low} kept config(s) that do not fit")
    return 1 if too_low else 0


if __name__ == "__main__":
    sys.exit(main())
