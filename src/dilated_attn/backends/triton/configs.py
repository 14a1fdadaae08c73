"""The block shapes (configs) the Triton kernels run, and compiling a call's kernels before it launches them.

Each launch of a tunable kernel (forward, dK/dV, dQ) takes its config from:

1. `tuned_configs.json`, shipped with the package and written by benchmarks/tune.py from a full sweep on a GPU:
   one entry per (GPU family, dtype, float32 precision, head-dim tile, causal, members bucket), each naming the
   device and command that produced it. A members bucket the table lacks takes the nearest one it has for the
   same other fields.
2. Where the table has no entry for this GPU family, the heuristic: the sm_90 entry for the key where it fits this
   GPU's shared memory, else the kernel's first candidate that fits (candidates are listed largest tiles first).

DILATED_ATTN_AUTOTUNE=1 (read at import; `configs.AUTOTUNE` at any time) sweeps every candidate that fits instead,
once per (kernel, key), with the timings cached in Triton's cache directory: a machine pays each sweep once (about
3-10 s per new (dtype, head dim, causal, members bucket) on an H100; float32 up to 40 s). Without it, under Triton's
interpreter every kernel runs one small config.

`precompile` compiles the kernels a call will launch in parallel threads (Triton's compiler releases the GIL), so
a first call waits for its slowest kernel rather than for all of them in turn, and logs once per process that it
is compiling.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, NamedTuple, Optional

import torch
import triton
from torch.library import wrap_triton
from triton.runtime._async_compile import AsyncCompileMode

from . import interpreting

__all__ = ["AUTOTUNE", "TABLE_PATH", "Key", "Tunable", "gpu_family", "members_bucket", "load_table", "lookup",
           "select", "launch", "collecting", "precompile", "config_dict", "chosen"]

logger = logging.getLogger("dilated_attn")

AUTOTUNE = os.environ.get("DILATED_ATTN_AUTOTUNE", "0") == "1"
TABLE_PATH = Path(__file__).with_name("tuned_configs.json")
MAX_MEMBERS_BUCKET = 8192  # longer segments tune like this many members: the kernels stream keys in blocks
HEURISTIC_FAMILY = "sm_90"  # the table's family whose entries other GPUs start from
_INTERPRETER_CONFIG = dict(BLOCK_M=16, BLOCK_N=16, num_warps=1, num_stages=1)


class Key(NamedTuple):
    """What a kernel's best config depends on (the table's key)."""

    gpu: str  # gpu_family()
    dtype: str  # "bfloat16", "float16", "float32"
    precision: Optional[str]  # float32's products: "tf32", "tf32x3" or "ieee"; None for 16-bit inputs
    block_d: int  # the head-dim tile (the next power of two of the head dim, at least 16)
    causal: bool
    members: int  # members_bucket() of the branch's longest segment


def gpu_family(capability: tuple[int, int]) -> str:
    """The table's name for a compute capability: GPUs of one family share shared memory and tensor-core
    generation (sm_86 stands for 8.6, 8.7 and 8.9)."""
    major, minor = capability
    if major == 8 and minor > 0:
        return "sm_86"
    if major in (10, 11, 12):
        return f"sm_{major}0"
    return f"sm_{major}{minor}"


def members_bucket(members: int) -> int:
    """The power of two at or above a segment's member count, at most MAX_MEMBERS_BUCKET."""
    return min(triton.next_power_of_2(max(members, 1)), MAX_MEMBERS_BUCKET)


def config_dict(config: triton.Config) -> dict:
    return dict(config.kwargs, num_warps=config.num_warps, num_stages=config.num_stages)


def _make_config(d: dict) -> triton.Config:
    d = dict(d)
    warps, stages = d.pop("num_warps"), d.pop("num_stages")
    return triton.Config(d, num_warps=warps, num_stages=stages)


class Tunable:
    """A kernel with block-shape parameters, its candidate configs and what the sweep needs.

    rows_per_stage(config kwargs) -> (rows held for the whole loop, rows loaded per pipeline stage, fp32 values
    loaded per stage beside them[, elements of a computed operand staged through shared memory]), each row BLOCK_D
    elements: the shared-memory estimate (shared_memory). With tf32x3 products Triton keeps the resident rows
    twice (their TF32 high and low parts); `tf32x3_candidates` (small tiles, or one stage, that fit that) are only
    considered for tf32x3. tools/triton_shared_memory.py checks the estimate against what Triton compiles.
    """

    def __init__(self, name: str, fn, candidates: list[dict], rows_per_stage: Callable, restore: tuple[str, ...],
                 tf32x3_candidates: list[dict] = ()):
        self.name = name  # the table's column: "fwd", "dkdv", "dq"
        self.fn = fn
        self.candidates = tuple(_make_config(c) for c in candidates)
        self.tf32x3_candidates = tuple(_make_config(c) for c in tf32x3_candidates)
        self.rows_per_stage = rows_per_stage
        self.restore = restore  # the outputs it adds into: the sweep restores them between timed runs
        self._autotuner = None

    def candidates_for(self, precision: Optional[str]) -> tuple[triton.Config, ...]:
        return self.candidates + (self.tf32x3_candidates if precision == "tf32x3" else ())

    def shared_memory(self, config: triton.Config, block_d: int, element_size: int, precision: Optional[str]) -> int:
        """Bytes of shared memory the config asks for."""
        resident, streamed, values, *tile = self.rows_per_stage(config.kwargs)
        copies = 2 if precision == "tf32x3" else 1
        stages = max(config.num_stages, 1)
        staged = tile[0] * element_size if tile else 0  # a computed [rows, cols] operand staged once
        return (resident * copies + streamed * stages) * block_d * element_size + values * stages * 4 + staged

    def fitting(self, block_d: int, element_size: int, precision: Optional[str], limit: int) -> list[triton.Config]:
        """The candidates that fit in `limit` bytes, in preference order (the smallest one if none does)."""
        configs = self.candidates_for(precision)
        fits = [c for c in configs if self.shared_memory(c, block_d, element_size, precision) <= limit]
        return fits or [min(configs, key=lambda c: self.shared_memory(c, block_d, element_size, precision))]

    @property
    def autotuner(self):
        """triton.autotune over every candidate (pruned to those that fit), timings cached on disk."""
        if self._autotuner is None:
            def prune(configs, named_args, **kwargs):
                q = named_args["Q"]
                limit = _shared_memory_limit(q.device.index) if q.device.type == "cuda" else 1 << 30
                precision = kwargs["PRECISION"] if q.dtype == torch.float32 else None
                return self.fitting(kwargs["BLOCK_D"], q.element_size(), precision, limit)

            self._autotuner = triton.autotune(
                configs=list(self.candidates + self.tf32x3_candidates),
                key=["BLOCK_D", "CAUSAL", "MAX_MEMBERS_BUCKET", "PRECISION"],
                restore_value=list(self.restore),
                prune_configs_by={"early_config_prune": prune},
                cache_results=True,
            )(self.fn)
        return self._autotuner

    def __repr__(self) -> str:
        return f"<tunable Triton kernel {self.name!r}>"


@functools.lru_cache(maxsize=None)
def _shared_memory_limit(device_index: Optional[int]) -> int:
    index = torch.cuda.current_device() if device_index is None else device_index
    return torch.cuda.get_device_properties(index).shared_memory_per_block_optin


@functools.lru_cache(maxsize=None)
def _gpu_family_of(device_index: Optional[int]) -> str:
    index = torch.cuda.current_device() if device_index is None else device_index
    return gpu_family(torch.cuda.get_device_capability(index))


# --- the table ----------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def load_table(path: Path = TABLE_PATH) -> dict[Key, dict[str, triton.Config]]:
    """The shipped table: Key -> {kernel name: config}."""
    data = json.loads(Path(path).read_text())
    return {Key(e["gpu"], e["dtype"], e["precision"], e["block_d"], e["causal"], e["members"]):
            {name: _make_config(e[name]) for name in ("fwd", "dkdv", "dq")} for e in data["entries"]}


def lookup(key: Key, table: Optional[dict] = None) -> Optional[dict[str, triton.Config]]:
    """The table's configs for `key`: its own entry, else that of the nearest members bucket (the larger on a tie)
    with the same GPU family, dtype, precision, head-dim tile and causality; None if there is none."""
    table = load_table() if table is None else table
    if key in table:
        return table[key]
    same = [k for k in table if k[:5] == key[:5]]
    if not same:
        return None
    nearest = min(same, key=lambda k: (abs(math.log2(k.members) - math.log2(key.members)), -k.members))
    return table[nearest]


def families_consulted(gpu: str) -> tuple[str, ...]:
    """The table's GPU families a launch on `gpu` looks up, in order: its own, then HEURISTIC_FAMILY."""
    return tuple(dict.fromkeys((gpu, HEURISTIC_FAMILY)))


def table_buckets(key: Key) -> tuple[int, ...]:
    """The members buckets the table has for `key` (its own members ignored), in the first of
    families_consulted(key.gpu) that has any; () where none has."""
    for gpu in families_consulted(key.gpu):
        same = key._replace(gpu=gpu, members=0)
        buckets = sorted(k.members for k in load_table() if k._replace(members=0) == same)
        if buckets:
            return tuple(buckets)
    return ()


_chosen: dict[tuple[str, Key], triton.Config] = {}  # what _select returned, for chosen()


@functools.lru_cache(maxsize=4096)
def _select(tunable: Tunable, key: Key, element_size: int, limit: int) -> triton.Config:
    config = tunable.fitting(key.block_d, element_size, key.precision, limit)[0]
    for gpu in families_consulted(key.gpu):
        entry = lookup(key._replace(gpu=gpu))
        if entry is not None and tunable.shared_memory(entry[tunable.name], key.block_d, element_size,
                                                       key.precision) <= limit:
            config = entry[tunable.name]
            break
    _chosen[tunable.name, key] = config
    return config


def select(tunable: Tunable, key: Key, element_size: int, limit: int) -> triton.Config:
    """The config a launch of `tunable` runs without a sweep (see the module's docstring)."""
    if interpreting():
        return _make_config(_INTERPRETER_CONFIG)
    return _select(tunable, key, element_size, limit)


def chosen(tunables) -> dict[str, dict[str, str]]:
    """{kernel name: {key: config}} of what this process has launched: the table's (or the heuristic's) config per
    Key, and under DILATED_ATTN_AUTOTUNE=1 the sweep's per autotuning key (benchmarks report them)."""
    report: dict[str, dict[str, str]] = {}
    for (name, key), config in _chosen.items():
        report.setdefault(name, {})[str(tuple(key))] = str(config)
    for tunable in tunables:
        for key, config in (tunable._autotuner.cache if tunable._autotuner is not None else {}).items():
            report.setdefault(tunable.name, {})[f"sweep {key}"] = str(config)
    return report


def make_key(q: torch.Tensor, precision: str, block_d: int, causal: bool, max_members: int) -> Key:
    """The key of a launch over `q`'s dtype and device."""
    gpu = _gpu_family_of(q.device.index) if q.device.type == "cuda" else "cpu"
    dtype = str(q.dtype).removeprefix("torch.")
    return Key(gpu, dtype, precision if q.dtype == torch.float32 else None, block_d, causal,
               members_bucket(max_members))


# --- launching ----------------------------------------------------------------------------------------------


_collected: Optional[list] = None  # set by collecting(): launches are recorded instead of run
FORCED: dict[str, triton.Config] = {}  # kernel name -> the config every launch of it runs (tests, tools)


def launch(tunable: Tunable, grid, key: Key, *args, **kwargs) -> None:
    """Launch `tunable` over `grid` with its config for `key` (or through the sweep with AUTOTUNE)."""
    q = args[0]
    if tunable.name in FORCED:
        kernel, extra = tunable.fn, config_dict(FORCED[tunable.name])
    elif AUTOTUNE:
        kernel, extra = tunable.autotuner, {}
    else:
        limit = _shared_memory_limit(q.device.index) if q.device.type == "cuda" else 1 << 30
        kernel, extra = tunable.fn, config_dict(select(tunable, key, q.element_size(), limit))
    if _collected is not None:
        _collected.append((kernel, grid, args, {**kwargs, **extra}))
        return
    wrap_triton(kernel)[grid](*args, **kwargs, **extra)


def launch_plain(fn, grid, *args, **kwargs) -> None:
    """Launch a kernel without block-shape parameters (or record it, inside collecting())."""
    if _collected is not None:
        _collected.append((fn, grid, args, kwargs))
        return
    wrap_triton(fn)[grid](*args, **kwargs)


@contextlib.contextmanager
def collecting():
    """Inside, launch() records (kernel, grid, args, kwargs) in the yielded list rather than launching."""
    global _collected
    outer, _collected = _collected, []
    try:
        yield _collected
    finally:
        _collected = outer


_executor: Optional[ThreadPoolExecutor] = None
ANNOUNCE = True  # log (once per process) when a call has to compile; `dilated-attn warmup` reports on its own
_said_compiling = False


def _compile_pool() -> ThreadPoolExecutor:
    global _executor
    if _executor is None:
        _executor = ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1), thread_name_prefix="dilated_attn")
    return _executor


def precompile(launches: list, what: str) -> None:
    """Compile (or load from Triton's cache) every kernel `launches` (from collecting()) needs, in parallel threads.
    When that takes longer than a cache load, say once per process what is being compiled (`what`)."""

    def say() -> None:
        global _said_compiling
        if ANNOUNCE and not _said_compiling:
            _said_compiling = True
            sweep = " and tuning (DILATED_ATTN_AUTOTUNE=1)" if AUTOTUNE else ""
            logger.warning(f"dilated_attn: compiling{sweep} the Triton kernels for {what}: a few seconds, once per "
                           f"machine (they are cached on disk; `dilated-attn warmup` compiles them ahead of time)")

    timer = threading.Timer(0.5, say)  # a cache load takes well under that; a compile takes seconds
    timer.start()
    try:
        # errors are left to the launch itself, which raises them where they belong
        with AsyncCompileMode(_compile_pool(), ignore_errors=True):
            for kernel, grid, args, kwargs in launches:
                kernel.warmup(*args, grid=grid, **kwargs)
    finally:
        timer.cancel()
