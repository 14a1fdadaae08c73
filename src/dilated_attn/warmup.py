"""Compiling the kernels a training run will need before its first step (`dilated-attn warmup`).

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

The fa4 backend's kernels (FlashAttention-4) are compiled per variant, and a variant depends on more than the
family: on each call's grouped-query ratio, on whether its lengths fit in one tile (so on each branch's members and
the last segment's), on varlen calls and the number of runs in one, on the LSE's gradient and deterministic mode,
and on the GPU's architecture. `warmup_fa4` therefore runs the fa4 backend at a training run's own shapes
(`fa4_families`). FlashAttention-4 keeps what it compiles on disk (`backends.fa4.cache_dir()`, one file per
variant, found by a hash of the variant's key), so the process that compiles them may be another than the
training process, and the fa4 backend keeps each call's program beside them (backends/fa4/stored.py), so that the
training process runs them without importing FlashAttention-4 (docs/backends.md, "The fa4 backend").
"""

from __future__ import annotations

import itertools
import multiprocessing
import time
from pathlib import Path
from typing import Callable, NamedTuple, Optional, Sequence, Union

import torch

from .spec import Problem, dtype_name

__all__ = ["Family", "Fa4Family", "families", "fa4_families", "fa4_refusal", "members_buckets", "prepare_cudnn",
           "warmup", "warmup_fa4"]

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
    from .backends.fa4 import stored

    where, why = stored.directory(), stored.store_problem()
    kept = len(list(where.glob("*.json"))) if where is not None and where.is_dir() else 0
    say(f"done in {time.perf_counter() - start:.1f} s; " + (f"programs not stored: {why}" if why else
        f"{kept} programs stored in {where} (a later process runs them without importing flash-attn-4)"))
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


class Fa4Family(NamedTuple):
    """One forward+backward of the fa4 backend: a training run's calls at one sequence length, or over one pack."""

    problem: Problem  # the calls' sizes; for a pack, batch 1 and its longest sequence
    pack: tuple[int, ...] = ()  # the lengths of a pack's sequences (dilated_attention_varlen), else ()

    def describe(self) -> str:
        p = self.problem
        shape = (f"pack of {len(self.pack)} sequences ({sum(self.pack)} tokens)" if self.pack
                 else f"B={p.batch} N={p.seq_len}")
        return f"{dtype_name(p.dtype)} D={p.head_dim}{' causal' if p.causal else ''} {shape}"


def fa4_families(device, *, heads: int, segment_lengths: Sequence[int], dilation_rates: Sequence[int],
                 seq_lens: Sequence[int] = (), pack_lengths: Sequence[int] = (), kv_heads: Optional[int] = None,
                 batch: int = 1, dtypes: Sequence[Union[str, torch.dtype]] = ("bfloat16",),
                 head_dims: Sequence[int] = (128,), causal: Sequence[bool] = (False, True),
                 head_groups: str = "all") -> list[Fa4Family]:
    """The fa4 warm-up of a training run's attention calls: one family per (dtype, head dim, causal) and per
    sequence length of `seq_lens` (q `[batch, N, heads, D]`, k and v `kv_heads`), and per pack of sequences of
    `pack_lengths` (one pack, as `dilated_attention_varlen` takes it). Raises the ValueError/TypeError of
    dilated_attention for an invalid configuration.

    The batch changes no kernel (it is the calls' batch of segments); the lengths, heads and branches do, so give
    the training run's. A pack's variants depend on its sequences' lengths (how many runs of rows a call takes,
    whether they have gaps, the longest): give a typical pack; one of other lengths may compile a few more."""
    if not seq_lens and not pack_lengths:
        raise ValueError("seq_lens or pack_lengths must give at least one shape to warm, got neither")
    if any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in pack_lengths):
        raise ValueError(f"pack_lengths must be positive integers, got {list(pack_lengths)}")
    kv_heads = heads if kv_heads is None else kv_heads
    shapes = [(batch, n, ()) for n in seq_lens]
    if pack_lengths:
        shapes.append((1, max(pack_lengths), tuple(pack_lengths)))
    found = []
    for dtype, head_dim, masked, (b, n, pack) in itertools.product(dtypes, head_dims, causal, shapes):
        dtype = getattr(torch, dtype, dtype) if isinstance(dtype, str) else dtype  # else from_sizes says why
        p = Problem.from_sizes(b, n, heads, kv_heads, head_dim, segment_lengths, dilation_rates, dtype=dtype,
                               device=device, causal=masked, head_groups=head_groups)
        found.append(Fa4Family(p, pack))
    return found


def fa4_refusal(families: Sequence[Fa4Family]) -> Optional[str]:
    """None where the fa4 backend can run every family, else the first reason it cannot (without importing
    flash-attn-4: a broken install is found when warmup_fa4 imports it)."""
    from .backends import FA4

    why = FA4.unavailable()  # first: whether flash-attn-4 is installed says more than the device does
    for family in families:
        why = why or FA4.why_not(family.problem)
    return why


def _fa4_cache() -> Optional[Path]:
    """Where the imported FlashAttention-4 keeps the kernels it compiles (backends.fa4.cache_dir() unless the
    caller set FLASH_ATTENTION_CUTE_DSL_CACHE_DIR), or None where its disk cache is off."""
    from flash_attn.cute import cache_utils

    return cache_utils.get_cache_path() if cache_utils.CUTE_DSL_CACHE_ENABLED else None


def _cached(cache: Optional[Path]) -> int:
    # one object file per variant; a file whose name starts with "." is an export not yet renamed into place
    return 0 if cache is None else sum(1 for f in cache.rglob("*.o") if not f.name.startswith("."))


def _run_fa4(family: Fa4Family, lse_gradient: bool) -> None:
    from .functional import dilated_attention, dilated_attention_varlen

    p = family.problem
    rows = (sum(family.pack),) if family.pack else (p.batch, p.seq_len)
    q, k, v = (torch.randn(*rows, h, p.head_dim, dtype=p.dtype, device=p.device, requires_grad=True)
               for h in (p.num_heads, p.num_kv_heads, p.num_kv_heads))
    options = dict(causal=p.causal, head_groups=p.head_groups, return_lse=True, backend="fa4")
    if family.pack:
        cu_seqlens = torch.tensor([0, *itertools.accumulate(family.pack)], dtype=torch.int32, device=p.device)
        out, lse = dilated_attention_varlen(q, k, v, cu_seqlens, p.segment_lengths, p.dilation_rates,
                                            max_seqlen=max(family.pack), **options)
    else:
        out, lse = dilated_attention(q, k, v, p.segment_lengths, p.dilation_rates, **options)
    # the backward's kernels differ where the LSE has a gradient: a loss of `out` alone gives it none
    outputs, grads = [out], [torch.randn_like(out)]
    if lse_gradient:
        outputs.append(lse)
        grads.append(torch.randn_like(lse))
    torch.autograd.backward(outputs, grads)
    torch.cuda.synchronize(p.device)


def warmup_fa4(families: Sequence[Fa4Family], *, lse_gradient: bool = False,
               say: Callable[[str], None] = lambda line: print(line, flush=True)) -> list[tuple]:
    """Compiles, in this process, the FlashAttention-4 kernels of the fa4 backend's forward and backward for each
    family of `fa4_families` (one call of random inputs each), reporting each as it finishes. They go to
    FlashAttention-4's disk cache, where a training process started later, with the same environment on the
    same kind of GPU, finds them; called in the training process, it also imports flash-attn-4 there (seconds)
    and keeps the kernels loaded.

    lse_gradient: also compile the backward of a loss that uses the LSE (`return_lse=True`). The backward of
    torch.use_deterministic_algorithms(True) has kernels of its own: this compiles those of this process's
    setting. Raises RuntimeError where the fa4 backend cannot run (fa4_refusal) or flash-attn-4 does not load.
    Returns [(family, seconds, kernels compiled, error or None)]; kernels compiled counts the files it added to
    the cache (0 where the disk cache is off)."""
    from .backends import FA4

    why = fa4_refusal(families)
    if why is not None:
        raise RuntimeError(f"dilated_attn: the fa4 backend cannot run: {why}")
    start = time.perf_counter()
    FA4.ops()  # imports flash-attn-4
    cache = _fa4_cache()
    where = (f"kernels cached in {cache}" if cache is not None else
             "its disk cache is off (FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED is not 1): the kernels stay in this process")
    say(f"imported flash-attn-4 in {time.perf_counter() - start:.1f} s; {where}")
    if families:
        device = families[0].problem.device
        say(f"warming {len(families)} fa4 families on {torch.cuda.get_device_name(device)}"
            f"{' (deterministic backward)' if torch.are_deterministic_algorithms_enabled() else ''}")
    results = []
    for done, family in enumerate(families, 1):
        before, began = _cached(cache), time.perf_counter()
        try:
            _run_fa4(family, lse_gradient)
            error = None
        except Exception as exc:  # noqa: BLE001 - reported with the family, the other families go on
            error = f"{type(exc).__name__}: {exc}"
        seconds, compiled = time.perf_counter() - began, _cached(cache) - before
        results.append((family, seconds, compiled, error))
        outcome = f"FAILED: {error}" if error else f"{compiled} kernels compiled"
        say(f"{_bar(done, len(families))} {family.describe()}: {outcome}, {seconds:.1f} s")
    from .backends.fa4 import stored

    where, why = stored.directory(), stored.store_problem()
    kept = len(list(where.glob("*.json"))) if where is not None and where.is_dir() else 0
    say(f"done in {time.perf_counter() - start:.1f} s; " + (f"programs not stored: {why}" if why else
        f"{kept} programs stored in {where} (a later process runs them without importing flash-attn-4)"))
    return results
