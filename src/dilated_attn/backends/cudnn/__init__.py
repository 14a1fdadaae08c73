"""The `cudnn` backend: each branch's segments run through cuDNN's fused attention (PyTorch's
`aten::_scaled_dot_product_cudnn_attention` and its backward) reading q, k, v in place through strided views, with
no gather and no scatter; a CUDA kernel merges each call's result into the running (out, lse). It is the fast
path on Hopper for large inputs (dispatch.auto_preference; the measurements are in benchmarks/README.md, "The training
step on one GPU"; how it works: docs/design.md).

    ops.py    the call plan of a problem (`plan`: `branch_calls` per branch), its views packed as the steps of the C++
              loops (`CallPlan.schedule`), and the `torch.library.custom_op` registrations
              (`dilated_attn::cudnn_forward`, `cudnn_backward`)
    csrc/cuda/cudnn_steps.cpp, merge.cu
              the loops over the calls (`dilated_attn::cudnn_forward_steps`, `cudnn_backward_steps`) and the merge
              and gradient-addition kernels, in the compiled extension

Like the triton backend, it imports its ops on first use; it needs no triton. Its backward takes no LSE gradient:
where the LSE has one, autograd runs the backward the dispatch layer chose at forward time (backends/autograd.py).
"""

from __future__ import annotations

from typing import Optional

import torch

from ...compile_hints import trace_constant
from ...spec import Problem
from .. import extension
from ..base import Backend, ForwardOp, OnceLoader

__all__ = ["CUDNN", "MIN_CUDNN_VERSION"]

MIN_CUDNN_VERSION = 90000  # cuDNN 9: fused attention forward and backward with the LSE, arbitrary strides

@trace_constant
def load_error() -> Optional[str]:
    """Import the ops (registering them) on the first call; None, or why they cannot be loaded (thread-safe:
    base.OnceLoader)."""
    return _loader()


def _load() -> Optional[str]:
    if not extension.has_kernel("cuda"):
        return ("its loops over the cuDNN calls are CUDA code of dilated_attn._C, "
                + ("which was built without CUDA" if extension.LOAD_ERROR is None else "which is not loaded"))
    if not torch.backends.cudnn.is_available():
        return "this torch has no cuDNN"
    if torch.backends.cudnn.version() < MIN_CUDNN_VERSION:
        return f"cuDNN {torch.backends.cudnn.version()} < {MIN_CUDNN_VERSION} (cuDNN 9)"
    try:
        from . import ops  # noqa: F401 - registers the ops
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {exc}"
    return None


_loader = OnceLoader(_load)


class CudnnBackend(Backend):
    name = "cudnn"
    forward_op = ForwardOp(device_types=("cuda",), dtypes=(torch.float16, torch.bfloat16), max_head_dim=128,
                           min_capability=(8, 0), capability_rule="cuDNN's fused attention needs Ampere or newer",
                           varlen="per_sequence")  # one call per sequence (auto takes packs elsewhere: auto_preference)
    backward_op = forward_op.backward(
        takes_lse_gradient=False,
        lse_gradient_rule="cuDNN's backward takes no LSE gradient (it computes delta = rowsum(dO * out) itself)",
        deterministic=False,
        nondeterminism_rule=("torch.use_deterministic_algorithms is on, and cuDNN's backward adds up dQ with atomics "
                             "(not bitwise repeatable)"))

    def unavailable(self) -> Optional[str]:
        why = load_error()
        return None if why is None else f"cuDNN attention is not available ({why})"

    def extra_reasons(self, p: Problem) -> list[str]:
        return [f"head_dim {p.head_dim} is not a multiple of 8 (cuDNN's 16-byte rows)"] if p.head_dim % 8 else []

    def ops(self):
        why = self.unavailable()
        if why is not None:
            raise RuntimeError(f"dilated_attn: the cudnn backend cannot run: {why}")
        return torch.ops.dilated_attn.cudnn_forward, torch.ops.dilated_attn.cudnn_backward

    def dense_ops(self):
        self.ops()  # loaded, or why not
        from .ops import dense_backward, dense_forward

        return dense_forward, dense_backward


CUDNN = CudnnBackend()
