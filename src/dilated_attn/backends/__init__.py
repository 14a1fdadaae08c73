"""The backends, one module each; each declares what its forward and backward ops support (as data: base.ForwardOp,
base.BackwardOp), every reason it cannot run an input (`reasons`), and its ops (see base.Backend).

    extension.py  `cpu` and `cuda`: the ops of the compiled extension dilated_attn._C (csrc/)
    triton/       `triton`: Triton kernels, imported on first use
    cudnn/        `cudnn`: cuDNN's fused attention on strided views of each branch, merged by a CUDA kernel
    fa4/          `fa4`: FlashAttention-4 (the optional flash-attn-4 package) on the same views, imported on first use
    reference.py  `reference`: dilated_attn.reference (pure PyTorch) as a backend, any device
    signature.py  the ops' one signature, and the registration of a Python backend's ops under it

dispatch.py ranks them for `backend="auto"`; the ring and the benchmarks look them up here by name.
"""

from __future__ import annotations

from typing import Optional

from ..spec import BACKEND_NAMES, Problem
from .base import Backend
from .cudnn import CUDNN
from .extension import CPU, CUDA
from .fa4 import FA4
from .reference import REFERENCE
from .triton import TRITON

__all__ = ["Backend", "REGISTRY", "get", "verdicts", "CPU", "CUDA", "CUDNN", "FA4", "TRITON", "REFERENCE"]

# name -> backend, in the order verdicts are listed
REGISTRY: dict[str, Backend] = {b.name: b for b in (CUDA, TRITON, CUDNN, FA4, CPU, REFERENCE)}
assert tuple(REGISTRY) == BACKEND_NAMES


def get(name: str) -> Backend:
    """The backend called `name` (one of spec.BACKEND_NAMES)."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise ValueError(f"backend must be one of {BACKEND_NAMES}, got {name!r}") from None


def verdicts(p: Problem) -> dict[str, Optional[str]]:
    """Every backend's verdict on `p`: None (can run) or why it cannot."""
    return {name: b.why_not(p) for name, b in REGISTRY.items()}
