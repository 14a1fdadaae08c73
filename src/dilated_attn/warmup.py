"""Compiling the Triton kernels a training run will need before its first step (`dilated-attn warmup`).

A first call of a new (dtype, head dim, causal) family compiles its kernels (a few seconds on an H100; once per
machine, as Triton caches them on disk). `warmup` compiles them ahead of time, one family per process, several
processes at once: a cluster job can fill the cache (TRITON_CACHE_DIR, on a shared filesystem or the node's disk)
before it starts training. Each family runs one small forward+backward per members bucket of the shipped table
(the buckets whose configs, and so kernels, may differ), with the shapes' alignment of real calls (16 heads).
With DILATED_ATTN_AUTOTUNE=1 it also sweeps each bucket (cached on disk too), one process at a time so that the
timings are not disturbed.
"""

from __future__ import annotations

import itertools
import multiprocessing
import time
from typing import Callable, NamedTuple, Optional, Sequence

import torch

__all__ = ["Family", "families", "members_buckets", "warmup"]

HEADS = 16  # the heads of a warm-up call: strides (heads x head dim) divisible by 16, like a model's


class Family(NamedTuple):
    """The kernels of one (dtype, head dim, causal) family, warmed over these members buckets."""

    dtype: str
    head_dim: int
    causal: bool
    members: tuple[int, ...]

    def describe(self) -> str:
        return f"{self.dtype} D={self.head_dim}{' causal' if self.causal else ''}"


def members_buckets(device: torch.device, dtype: str, head_dim: int, causal: bool) -> tuple[int, ...]:
    """The members buckets the shipped table has for this family on this GPU (or, where it has none, on the
    family the heuristic starts from); one bucket where neither has any (every bucket then runs one config)."""
    from .backends import triton as triton_backend
    from .backends.triton import configs

    precision = triton_backend.float32_precision(device, head_dim) if dtype == "float32" else None
    gpu = configs.gpu_family(torch.cuda.get_device_capability(device))
    key = configs.Key(gpu, dtype, precision, triton_backend.block_d(head_dim), causal, 0)
    return configs.table_buckets(key) or (configs.MAX_MEMBERS_BUCKET,)


def families(device: torch.device, dtypes: Sequence[str], head_dims: Sequence[int],
             causal: Sequence[bool]) -> list[Family]:
    return [Family(d, h, c, members_buckets(device, d, h, c))
            for d, h, c in itertools.product(dtypes, head_dims, causal)]


def _warm(task: tuple) -> tuple[Family, float, int, Optional[str]]:
    """Worker: the family's forward+backward per bucket; (family, seconds, kernels compiled, error or None)."""
    family, device, allow_tf32 = task
    from triton import knobs

    from .backends.triton import configs
    from .functional import dilated_attention

    configs.ANNOUNCE = False  # the parent reports each family

    torch.backends.cuda.matmul.allow_tf32 = allow_tf32  # a spawned process starts with torch's default
    torch.cuda.set_device(device)
    compiled = []

    def listener(*, src, metadata, metadata_group, times, cache_hit):
        if not cache_hit:
            compiled.append(getattr(src, "name", "?"))

    knobs.compilation.listener = listener
    start = time.perf_counter()
    try:
        for members in family.members:
            shape = (1, members, HEADS, family.head_dim)
            q, k, v = (torch.randn(shape, device=device, dtype=getattr(torch, family.dtype), requires_grad=True)
                       for _ in range(3))
            out = dilated_attention(q, k, v, [members], [1], causal=family.causal, backend="triton")
            out.sum().backward()
        torch.cuda.synchronize(device)
    except Exception as exc:  # noqa: BLE001 - reported with the family, the other families go on
        return family, time.perf_counter() - start, len(compiled), f"{type(exc).__name__}: {exc}"
    return family, time.perf_counter() - start, len(compiled), None


def _bar(done: int, total: int, width: int = 24) -> str:
    filled = width * done // total
    return "[" + "#" * filled + "." * (width - filled) + f"] {done}/{total}"


def warmup(device: torch.device, dtypes: Sequence[str] = ("bfloat16",), head_dims: Sequence[int] = (128,),
           causal: Sequence[bool] = (False, True), jobs: int = 4,
           say: Callable[[str], None] = lambda line: print(line, flush=True)) -> list[tuple]:
    """Compile (or, with DILATED_ATTN_AUTOTUNE=1, also sweep) the Triton kernels of every (dtype, head dim, causal)
    family for `device`, `jobs` families at a time in spawned processes, reporting each as it finishes.
    Returns [(family, seconds, kernels compiled, error or None)]."""
    from .backends.triton import configs

    todo = families(device, dtypes, head_dims, causal)
    if configs.AUTOTUNE:
        jobs = 1
    jobs = max(1, min(jobs, len(todo)))
    say(f"warming {len(todo)} kernel families on {torch.cuda.get_device_name(device)} in {jobs} process(es)"
        + (" with the full sweep (DILATED_ATTN_AUTOTUNE=1)" if configs.AUTOTUNE else ""))
    tasks = [(family, device, torch.backends.cuda.matmul.allow_tf32) for family in todo]
    results = []
    start = time.perf_counter()
    with multiprocessing.get_context("spawn").Pool(jobs) as pool:
        for result in pool.imap_unordered(_warm, tasks):
            family, seconds, n_compiled, error = result
            results.append(result)
            outcome = f"FAILED: {error}" if error else f"{n_compiled} kernels compiled"
            say(f"{_bar(len(results), len(todo))} {family.describe()} (members buckets "
                f"{', '.join(map(str, family.members))}): {outcome}, {seconds:.1f} s")
    say(f"done in {time.perf_counter() - start:.1f} s")
    return results
