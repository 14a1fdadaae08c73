"""Backends and the rule that picks one.

Each backend answers `reason(problem)`: None if it can run the input, otherwise why not. `decide()` turns
the requested backend into the one that runs:

* an explicit backend runs if it can, else dilated_attention raises ValueError listing every verdict;
* "auto" with the environment variable DILATED_ATTN_BACKEND set to a backend name behaves as that name;
* otherwise "auto" runs the first backend of `auto_preference(problem)` that can run, warning once per
  distinct reason when it had to pass over a preference that applies to the input's device, and once when
  it runs the reference on a GPU (float32 at large head dims: see reference_preferred).

`explain()` (dilated_attn.explain) returns that decision without running attention.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from . import ops
from .reference import dilated_attention_reference, reference_memory_bytes
from .spec import BACKENDS as BACKEND_NAMES
from .spec import Problem, validate

CPU_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# Imported once, here: torch.compile cannot trace an import, and a missing or broken triton must not
# break the package, only this backend.
try:
    from . import triton as triton_backend

    TRITON_ERROR: Optional[str] = None
except Exception as exc:  # noqa: BLE001 - triton missing, or failing to load on this machine
    triton_backend = None
    TRITON_ERROR = f"{type(exc).__name__}: {exc}"


# Why the extension did not load (None if it did), read once: ops.build_info() calls into the extension, which
# torch.compile cannot trace.
LOAD_ERROR: Optional[str] = None if ops.LOAD_ERROR is None else f"{type(ops.LOAD_ERROR).__name__}: {ops.LOAD_ERROR}"


def _compiled_reason(p: Problem, device_type: str, dtypes) -> Optional[str]:
    if p.device.type != device_type:
        return f"needs {device_type.upper()} tensors, got {p.device.type}"
    if not ops.has_kernel(device_type):
        if LOAD_ERROR is not None:
            return f"the compiled extension dilated_attn._C is not loaded ({LOAD_ERROR})"
        return f"dilated_attn._C was built without {device_type.upper()} kernels"
    if p.dtype not in dtypes:
        names = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        return f"dtype {str(p.dtype).removeprefix('torch.')} is not supported (supported: {names})"
    return None


def _cpu_reason(p: Problem) -> Optional[str]:
    return _compiled_reason(p, "cpu", CPU_DTYPES)


# What the hand-written CUDA kernels (csrc/cuda/) support.
CUDA_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
CUDA_MAX_HEAD_DIM = 256
CUDA_MIN_CAPABILITY = (6, 0)  # Pascal


def _cuda_reason(p: Problem) -> Optional[str]:
    why = _compiled_reason(p, "cuda", CUDA_DTYPES)
    if why is not None:
        return why
    if p.head_dim > CUDA_MAX_HEAD_DIM:
        return f"head_dim {p.head_dim} > {CUDA_MAX_HEAD_DIM}"
    capability = torch.cuda.get_device_capability(p.device)
    if capability < CUDA_MIN_CAPABILITY:
        return f"compute capability {capability[0]}.{capability[1]} < 6.0 (the CUDA kernels need Pascal or newer)"
    return None


def _triton_reason(p: Problem) -> Optional[str]:
    interpret = os.environ.get("TRITON_INTERPRET", "0") == "1"
    if p.device.type != "cuda" and not (p.device.type == "cpu" and interpret):
        return f"needs CUDA tensors, got {p.device.type}"
    if triton_backend is None:
        return f"triton is not available ({TRITON_ERROR})"
    return triton_backend.reason(p.device, p.dtype, p.head_dim)


def _reference_reason(p: Problem) -> Optional[str]:
    return None


def _run_compiled(q, k, v, p: Problem):
    return ops.forward(q, k, v, p)


def _run_triton(q, k, v, p: Problem):
    return triton_backend.forward(q, k, v, p)


def _run_reference(q, k, v, p: Problem):
    return dilated_attention_reference(
        q, k, v, p.segment_lengths, p.dilation_rates, causal=p.causal, scale=p.scale, head_groups=p.head_groups
    )


@dataclass(frozen=True)
class Backend:
    name: str
    reason: Callable[[Problem], Optional[str]]
    run: Callable


BACKENDS = {
    "cuda": Backend("cuda", _cuda_reason, _run_compiled),
    "triton": Backend("triton", _triton_reason, _run_triton),
    "cpu": Backend("cpu", _cpu_reason, _run_compiled),
    "reference": Backend("reference", _reference_reason, _run_reference),
}

# Preferences of "auto" by device type, best first; every list holds the reference, which runs anything.
AUTO_ORDER = {"cpu": ("cpu", "reference"), "cuda": ("triton", "cuda", "reference")}


@torch.compiler.assume_constant_result
def _triton_float32_is_ieee(device: torch.device, head_dim: int) -> bool:
    # reads torch's TF32 setting and the device's properties: constants for a traced graph, like _env_backend
    return triton_backend is not None and triton_backend.float32_precision(device, head_dim) == "ieee"


@torch.compiler.assume_constant_result
def _gpu_memory_bytes(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).total_memory


# auto runs the reference on a GPU only where its memory estimate is at most this share of the GPU's memory.
REFERENCE_MEMORY_SHARE = 0.25


def _float32_with_ieee_products(p: Problem) -> bool:
    """float32 on a GPU where Triton would multiply with IEEE fp32 FMAs (see triton.float32_precision)."""
    return p.device.type == "cuda" and p.dtype == torch.float32 and _triton_float32_is_ieee(p.device, p.head_dim)


def reference_preferred(p: Problem) -> Optional[str]:
    """Why auto prefers the reference for `p` on a GPU (None where it does not): float32 with head_dim > 64
    where Triton would multiply with IEEE fp32 FMAs, while the reference's memory estimate fits the share."""
    if not (p.head_dim > 64 and _float32_with_ieee_products(p)):
        return None
    need, total = reference_memory_bytes(p), _gpu_memory_bytes(p.device)
    if need > REFERENCE_MEMORY_SHARE * total:
        return None
    return (f"float32 with head_dim {p.head_dim} > 64 and IEEE products in Triton: cuBLAS makes the reference "
            f"fastest, and its estimated {need / 2**30:.1f} GiB for forward and backward is at most "
            f"{REFERENCE_MEMORY_SHARE:.0%} of the GPU's {total / 2**30:.0f} GiB")


# Warned once when auto runs the reference on a GPU: its memory is not O(N).
REFERENCE_ON_GPU_WARNING = (
    "dilated_attn: backend='auto' runs the reference for float32 inputs with head_dim > 64 on this GPU (faster "
    "there than the kernels; see dilated_attn.explain). It keeps about four score-sized tensors per branch for "
    "the backward; backend='cuda' needs O(N) memory."
)


def auto_preference(p: Problem) -> tuple[str, ...]:
    """THE auto rule: the backends "auto" tries for `p`, best first; the first that can run runs.

    CUDA tensors: triton (Volta or newer, triton importable), else the hand-written cuda kernels (Pascal or
    newer), else reference. CPU tensors: the compiled cpu kernels, else reference. Other devices: reference.
    Measured exceptions, for float32 where Triton would multiply with IEEE fp32 FMAs (TF32 not allowed, and
    tf32x3 not available: see triton.float32_precision), on an H200:
    - the cuda kernels first: 1.75-1.9x (head dim 64), about 7x (128) and 17-18x (256) faster than Triton's
      FMA products (benchmarks/results/auto_NVIDIA_H200_float32_ieee.json);
    - the reference first where head_dim > 64 and its memory fits (reference_preferred): cuBLAS's fp32 GEMMs
      made it 1.04-1.3x faster than the cuda kernels at head dim 128 and 1.6-2.2x at 256
      (auto_NVIDIA_H200_float32.json, auto_NVIDIA_H200_float32_tf32x3_configs.json). Above the memory
      share the cuda kernels run: the reference's memory grows with N * w/r per branch, theirs with N.
    Only backends that apply to the device are listed, so passing one over always has a reason worth a
    warning. Further measured thresholds belong here, as conditions on `p` that reorder the list.
    """
    if _float32_with_ieee_products(p):
        return ("reference", "cuda", "triton") if reference_preferred(p) else ("cuda", "triton", "reference")
    return AUTO_ORDER.get(p.device.type, ("reference",))


ENV_VAR = "DILATED_ATTN_BACKEND"


@torch.compiler.assume_constant_result
def _env_backend() -> str:
    # Called per call in eager. Under torch.compile, dynamo runs this at trace time and bakes the result into
    # the graph (no guard, so no graph break and no dependence on how dynamo models os.environ): a compiled
    # function keeps the value it was traced with until it recompiles (torch.compiler.reset()).
    return os.environ.get(ENV_VAR, "")


_WARNED: set[str] = set()


@torch.compiler.assume_constant_result
def warn_once(message: str, stacklevel: int = 1) -> bool:
    """warnings.warn(message) the first time this message comes, then never again in this process.

    Dynamo cannot trace warnings.warn (a graph break); marked as a constant, it runs at trace time instead,
    so a compiled caller warns once when it is traced. `stacklevel` counts from the caller of warn_once.
    """
    if message not in _WARNED:
        _WARNED.add(message)
        warnings.warn(message, stacklevel=stacklevel + 1)
    return True


def verdicts(p: Problem) -> dict[str, Optional[str]]:
    """Every backend's verdict on `p`: None (can run) or the reason it cannot."""
    return {name: b.reason(p) for name, b in BACKENDS.items()}


def _verdict_text(why: Optional[str]) -> str:
    return "can run" if why is None else why


@dataclass(frozen=True)
class Decision:
    """Which backend dilated_attention runs for an input, and why (returned by dilated_attn.explain)."""

    backend: Optional[str]  # the backend that runs; None when the requested one cannot (see `error`)
    decided_by: str  # the argument, the environment variable or the auto rule that decided
    verdicts: dict  # name -> None (can run) or why it cannot, for every backend
    fallback: Optional[str] = None  # auto had to pass over preferences for these reasons (warned once)
    note: Optional[str] = None  # a warning select() gives once (auto running the reference on a GPU)
    error: Optional[str] = None  # the ValueError dilated_attention raises when `backend` is None
    problem: Optional[Problem] = None

    def __str__(self) -> str:
        lines = [f"dilated_attn backend: {self.backend or 'none (dilated_attention raises ValueError)'}"]
        lines.append(f"  decided by: {self.decided_by}")
        if self.fallback:
            lines.append(f"  fallback: {self.fallback}")
        if self.note:
            lines.append(f"  note: {self.note}")
        if self.error:
            lines.append(f"  error: {self.error}")
        p = self.problem
        if p is not None:
            branches = ", ".join(f"({w}, {r})" for w, r in zip(p.segment_lengths, p.dilation_rates))
            dtype = str(p.dtype).removeprefix("torch.")
            lines.append(
                f"  input: B={p.batch} N={p.seq_len} Hq={p.num_heads} Hkv={p.num_kv_heads} D={p.head_dim} "
                f"{dtype} on {p.device}; branches {branches}; causal={p.causal}, head_groups={p.head_groups!r}"
            )
        width = max(len(name) for name in self.verdicts)
        lines.append(f"  {'backend':<{width}}  verdict")
        for name, why in self.verdicts.items():
            mark = "  <- runs" if name == self.backend else ""
            lines.append(f"  {name:<{width}}  {_verdict_text(why)}{mark}")
        return "\n".join(lines)


def decide(p: Problem, backend: str) -> Decision:
    """Resolve `backend` ("auto" or a backend name, already validated) for `p`. Raises only for an invalid
    DILATED_ATTN_BACKEND; an explicit backend that cannot run gives a Decision with `error` set."""
    found = verdicts(p)
    label, decided_by = f"backend={backend!r}", "the backend argument"
    if backend == "auto":
        env = _env_backend()
        if env not in ("", "auto"):
            if env not in BACKEND_NAMES:
                raise ValueError(
                    f"environment variable {ENV_VAR} must be unset or one of {BACKEND_NAMES}, got {env!r}"
                )
            backend, label = env, f"{ENV_VAR}={env!r}"
            decided_by = f"the environment variable {ENV_VAR} (the backend argument is 'auto')"
    if backend != "auto":
        if found[backend] is None:
            return Decision(backend, f"{label}: {decided_by}", found, problem=p)
        usable = ", ".join(n for n, why in found.items() if why is None)
        listing = "; ".join(f"{n}: {_verdict_text(why)}" for n, why in found.items())
        error = f"{label} cannot run this input: {found[backend]}. Backends that can: {usable} ({listing})"
        return Decision(None, f"{label}: {decided_by}", found, error=error, problem=p)
    order = auto_preference(p)
    rule = f"the auto rule for {p.device.type} tensors: {' > '.join(order)}, the first that can run"
    why_reference = reference_preferred(p) if order[0] == "reference" else None
    if why_reference is not None:
        rule += f" ({why_reference})"
    passed = []
    for name in order:
        if found[name] is None:
            break
        passed.append(f"{name} cannot ({found[name]})")
    else:  # unreachable while every preference list holds the reference
        name = "reference"
    fallback = f"backend='auto' runs {name}: " + "; ".join(passed) if passed else None
    note = REFERENCE_ON_GPU_WARNING if name == "reference" and why_reference is not None else None
    return Decision(name, rule, found, fallback=fallback, note=note, problem=p)


def select(p: Problem, backend: str) -> Backend:
    """The backend that runs `p`: raises ValueError when the requested one cannot, warns once on a fallback."""
    d = decide(p, backend)
    if d.backend is None:
        raise ValueError(d.error)
    if d.fallback:
        warn_once(f"dilated_attn: {d.fallback}", stacklevel=3)  # -> select -> dilated_attention -> caller
    if d.note:
        warn_once(d.note, stacklevel=3)
    return BACKENDS[d.backend]


def explain(q, k, v, segment_lengths, dilation_rates, **kwargs) -> Decision:
    """Which backend `dilated_attention(q, k, v, segment_lengths, dilation_rates, **kwargs)` would run, every
    backend's verdict, and what decided; `print()` it for a table. Validates like dilated_attention (and
    raises the same errors for invalid arguments), but does not run attention."""
    p = validate(q, k, v, segment_lengths, dilation_rates, **kwargs)
    return decide(p, kwargs.get("backend", "auto"))
