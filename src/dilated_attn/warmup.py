"""Compiling the Triton kernels a training run will need before its first step (`dilated-attn warmup`).

A first call of a new (dtype, head dim, causal) family compiles its kernels (a few seconds on an H100; once per
machine, as Triton caches them on disk). `warmup` compiles them ahead of time, one family per process, several
processes at once: a cluster job can fill the cache (TRITON_CACHE_DIR, on a shared filesystem or the node's disk)
before it starts training. Each family runs one small forward+backward per members bucket of the shipped table
(the buckets whose configs, and so kernels, may differ), with the shapes' alignment of real calls (16 heads).
With DILATED_ATTN_AUTOTUNE=1 it also sweeps each bucket (cached on disk too), one process at a time so that the
timings are not disturbed.

The cudnn backend has a first-call cost of its own that no other process can pay for it: cuDNN builds an execution
plan for each shape of call it has not seen, and PyTorch keeps the plans in the process (a cache per thread).
`prepare_cudnn` runs one forward and backward at a training run's shapes in the training process itself, before
its first step (docs/backends.md, "The cuDNN backend").
"""

from __future__ import annotations

import itertools
import multiprocessing
import time
from typing import Callable, NamedTuple, Optional, Sequence

import torch

__all__ = ["Family", "families", "members_buckets", "prepare_cudnn", "warmup"]

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


def prepare_cudnn(batch: int, seq_len: int, heads: int, head_dim: int, segment_lengths: Sequence[int],
                  dilation_rates: Sequence[int], *, kv_heads: Optional[int] = None,
                  dtype: torch.dtype = torch.bfloat16, causal: bool = False, head_groups: str = "all",
                  device=None, backend: str = "auto", backward: bool = True) -> bool:
    """Builds, in this process, the cuDNN plans that attention calls of these shapes will use, so that a training
    run's first step does not build them: one forward (and backward) with the cudnn backend on random q, k, v
    `[batch, seq_len, heads (kv_heads for k, v), head_dim]` of `dtype`, contiguous as the modules pass them.

    cuDNN builds an execution plan the first time it sees a shape of call (sizes, strides, dtype, causal), and
    PyTorch caches it in the process, per thread: call this in the training process, from the thread that runs
    the steps (the backward runs in autograd's thread, in both). Calls of other shapes, or of q, k, v in another
    layout (views of a fused projection have other strides), build plans of their own. `dilated-attn warmup` does
    not do this: it fills Triton's on-disk cache, from other processes.

    backend: the `backend` the training calls pass. With "auto" (the default; DILATED_ATTN_BACKEND counts, as in
    those calls) it runs only where auto picks cudnn for these shapes, with "cudnn" wherever cudnn can run them.
    backward: False for calls without a backward (inference): a forward under torch.no_grad, which is also how
    auto then decides. device: default the current CUDA device, else the CPU.

    Returns True when it ran cudnn, and False, having done nothing, where these calls would not run it (a CPU, a
    GPU without cuDNN 9, float32, a smaller input than auto gives cudnn, ...). Raises the ValueError/TypeError of
    dilated_attention for an invalid configuration.
    """
    from .dispatch import explain
    from .functional import dilated_attention

    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    kv_heads = heads if kv_heads is None else kv_heads
    options = dict(causal=causal, head_groups=head_groups)
    with torch.set_grad_enabled(backward):
        # The decision needs the shapes only: placeholders of one element, expanded (no memory).
        q, kv = (torch.empty((), dtype=dtype, device=device, requires_grad=backward).expand(
            batch, seq_len, h, head_dim) for h in (heads, kv_heads))
        if explain(q, kv, kv, segment_lengths, dilation_rates, backend=backend, **options).backend != "cudnn":
            return False
        q, k, v = (torch.randn(batch, seq_len, h, head_dim, dtype=dtype, device=device, requires_grad=backward)
                   for h in (heads, kv_heads, kv_heads))
        out = dilated_attention(q, k, v, segment_lengths, dilation_rates, backend="cudnn", **options)
        if backward:
            out.backward(torch.randn_like(out))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return True
