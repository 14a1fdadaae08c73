"""The `triton` backend: Triton kernels for NVIDIA GPUs from Volta up, the GPU fast path.

This module declares what the backend runs and how it multiplies float32; it imports triton only when a kernel is
first needed (`load_error()`), so that `import dilated_attn` stays cheap and a missing or broken triton costs this
backend only. The rest of the package:

    ops.py      launchers and the `torch.library.triton_op` registrations (`dilated_attn::triton_forward`,
                `triton_backward`), the tile visiting order, compiling a first call's kernels at once (`prepare`)
    fwd.py      the forward kernel          bwd.py     the backward kernels (delta, dK/dV, dQ)
    common.py   segment decoding shared by the kernels
    configs.py  which block shapes each launch runs: the shipped table (tuned_configs.json, written by
                benchmarks/tune.py), the heuristic, the opt-in sweep (DILATED_ATTN_AUTOTUNE=1)
"""

from __future__ import annotations

import functools
import os
from typing import Optional

import torch

from ...compile_hints import trace_constant
from ..base import Backend, ForwardOp, OnceLoader, device_capability

__all__ = ["TRITON", "float32_precision", "interpreting", "load_error", "TF32X3_MAX_HEAD_DIM"]

# Above this head dim the tf32x3 tiles that fit in shared memory are too small to be fast: float32 at head dim
# 256 ran several times slower than the cuda kernels (benchmarks/README.md, "The auto rule").
TF32X3_MAX_HEAD_DIM = 128


def interpreting() -> bool:
    """TRITON_INTERPRET=1: kernels run on CPU tensors through Triton's interpreter (tests without a GPU)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


_ops = None  # the module ops.py once loaded


def _load() -> Optional[str]:
    global _ops
    try:
        from . import ops as module
    except Exception as exc:  # noqa: BLE001 - triton missing, or failing to load on this machine
        return f"{type(exc).__name__}: {exc}"
    _ops = module
    return None


_loader = OnceLoader(_load)


@trace_constant
def load_error() -> Optional[str]:
    """Import triton and the kernels (registering the triton ops) on the first call; None, or why they cannot
    be loaded. Marked constant for torch.compile, so a first call inside a traced function loads them then.
    Thread-safe: a second thread's first call waits until the ops are registered (base.OnceLoader)."""
    return _loader()


def block_d(head_dim: int) -> int:
    """The head-dim tile of the kernels: the next power of two, at least 16."""
    return max(16, 1 << (head_dim - 1).bit_length())


def float32_precision(device: torch.device, head_dim: int) -> str:
    """How the kernels multiply float32 tiles (tl.dot's input_precision; 16-bit inputs ignore it).

    TF32 (10-bit mantissa) only where torch's matmul setting allows it. Otherwise float32 accuracy: on Ampere and
    newer, up to head dim TF32X3_MAX_HEAD_DIM, "tf32x3", three TF32 tensor-core products per tile product
    (hi*hi + hi*lo + lo*hi of operands split into TF32 high and low parts, fp32 accumulation), held by the GPU
    tests to the float32 reference's accuracy; else "ieee" fp32 FMAs (slow: see dispatch.auto_preference): on
    Volta/Turing, which have no TF32, above TF32X3_MAX_HEAD_DIM, and where tf32x3's extra shared memory (a second
    copy of the resident tiles) leaves some kernel no config that fits.
    """
    if torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    if (device.type == "cuda" and block_d(head_dim) <= TF32X3_MAX_HEAD_DIM
            and device_capability(device) >= (8, 0)):
        index = device.index if device.index is not None else torch.cuda.current_device()
        if _tf32x3_fits(index, block_d(head_dim)):
            return "tf32x3"
    return "ieee"


@functools.lru_cache(maxsize=None)
def _tf32x3_fits(device_index: int, block_d: int) -> bool:
    """Every kernel has a config whose tf32x3 tiles fit in the device's shared memory."""
    if load_error() is not None:
        return False
    return _ops.tf32x3_fits(torch.cuda.get_device_properties(device_index).shared_memory_per_block_optin, block_d)


class TritonBackend(Backend):
    name = "triton"
    forward_op = ForwardOp(device_types=("cuda",), dtypes=(torch.float16, torch.bfloat16, torch.float32),
                           max_head_dim=256, min_capability=(7, 0), capability_rule="Triton needs Volta or newer",
                           varlen="kernels")
    backward_op = forward_op.backward()

    def supported_device_types(self) -> tuple[str, ...]:
        # CPU tensors only under Triton's interpreter, which is for tests
        return ("cuda", "cpu") if interpreting() else ("cuda",)

    def unavailable(self) -> Optional[str]:
        why = load_error()
        return None if why is None else f"triton is not available ({why})"

    def extra_reasons(self, p) -> list[str]:
        if p.device.type == "cpu" and p.dtype == torch.bfloat16:
            return ["bfloat16 on CPU tensors: Triton's interpreter (TRITON_INTERPRET=1, for tests) computes bfloat16 "
                    "wrongly"]
        return []

    def ops(self):
        why = self.unavailable()
        if why is not None:
            raise RuntimeError(f"dilated_attn: the triton backend cannot run: {why}")
        return torch.ops.dilated_attn.triton_forward, torch.ops.dilated_attn.triton_backward

    def forward(self, q, k, v, p):
        # an eager first call compiles its kernels, and its backward's where a gradient will be asked for, in
        # parallel before it launches any (ops.prepare); torch.compile compiles them itself
        if not torch.compiler.is_compiling():
            self.ops()
            _ops.prepare(q, k, v, p, backward=torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v)))
        return super().forward(q, k, v, p)

    def forward_kvcache(self, q, k_cache, v_cache, k, v, cp):
        # one launch: the new rows' write, every branch and new token (decode.py), instead of a forward over each
        # prefix; (out, None) where the call did not ask for the lse
        self.ops()
        return _ops.decode(q, k_cache, v_cache, k, v, cp)

    def varlen_ops(self, head_dim):
        # the whole pack in each launch: a program per (sequence, head, segment, block), no padding copies
        self.ops()
        return torch.ops.dilated_attn.triton_varlen_forward, torch.ops.dilated_attn.triton_varlen_backward


TRITON = TritonBackend()
