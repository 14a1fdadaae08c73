"""Backends and the rule that picks one.

Each backend answers `reason(problem)`: None if it can run the input, otherwise why not. An explicit
backend that cannot run raises ValueError listing every backend's verdict; "auto" takes the first
backend of its preference list that can run.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from . import ops
from .reference import dilated_attention_reference
from .spec import Problem

CPU_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# Imported once, here: torch.compile cannot trace an import, and a missing or broken triton must not
# break the package, only this backend.
try:
    from . import triton as triton_backend

    TRITON_ERROR: Optional[str] = None
except Exception as exc:  # noqa: BLE001 - triton missing, or failing to load on this machine
    triton_backend = None
    TRITON_ERROR = f"{type(exc).__name__}: {exc}"


def _compiled_reason(p: Problem, device_type: str, dtypes) -> Optional[str]:
    if p.device.type != device_type:
        return f"needs {device_type.upper()} tensors, got {p.device.type}"
    if not ops.has_kernel(device_type):
        info = ops.build_info()
        if not info["loaded"]:
            return f"the compiled extension dilated_attn._C is not loaded ({info['error']})"
        return f"dilated_attn._C was built without {device_type.upper()} kernels"
    if p.dtype not in dtypes:
        names = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        return f"dtype {str(p.dtype).removeprefix('torch.')} is not supported (supported: {names})"
    return None


def _cpu_reason(p: Problem) -> Optional[str]:
    return _compiled_reason(p, "cpu", CPU_DTYPES)


def _cuda_reason(p: Problem) -> Optional[str]:
    return _compiled_reason(p, "cuda", (torch.float16, torch.bfloat16, torch.float32))


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

# "auto": the compiled kernels of the tensors' device, else the pure-PyTorch reference.
AUTO_ORDER = {"cpu": ("cpu", "reference"), "cuda": ("triton", "cuda", "reference")}


def verdicts(p: Problem) -> dict[str, Optional[str]]:
    """Every backend's verdict on `p`: None (can run) or the reason it cannot."""
    return {name: b.reason(p) for name, b in BACKENDS.items()}


def select(p: Problem, backend: str) -> Backend:
    if backend == "auto":
        for name in AUTO_ORDER.get(p.device.type, ("reference",)):
            if BACKENDS[name].reason(p) is None:
                return BACKENDS[name]
        return BACKENDS["reference"]
    why = BACKENDS[backend].reason(p)
    if why is None:
        return BACKENDS[backend]
    usable = [n for n, r in verdicts(p).items() if r is None]
    listing = "; ".join(f"{n}: {r or 'can run'}" for n, r in verdicts(p).items())
    raise ValueError(
        f"backend={backend!r} cannot run this input: {why}. Backends that can: {', '.join(usable)} ({listing})"
    )
