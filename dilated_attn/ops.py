"""torch.library glue for the compiled ops (csrc/registration.cpp): loading, fake kernels, autograd.

Importing this module registers `torch.ops.dilated_attn.forward` / `.backward` with fake (meta) kernels
for torch.compile and an autograd formula, so the ops differentiate and trace like built-in ones.
"""

from __future__ import annotations

import torch

from .spec import lse_dtype

try:
    from . import _C  # noqa: F401  (loading the library registers the ops)

    LOAD_ERROR: Exception | None = None
except ImportError as exc:  # source tree without a build, or a build for another torch
    _C = None
    LOAD_ERROR = exc


def build_info() -> dict:
    """What the compiled extension was built with, or why it could not be loaded."""
    if _C is None:
        return {"loaded": False, "error": f"{type(LOAD_ERROR).__name__}: {LOAD_ERROR}"}
    return {"loaded": True, **_C.build_info()}


# Which devices the compiled forward op has kernels for: fixed once the library is loaded, and read here
# once because torch.compile cannot trace the dispatcher query.
_KERNELS = {
    device: _C is not None and torch._C._dispatch_has_kernel_for_dispatch_key("dilated_attn::forward", key)
    for device, key in (("cpu", "CPU"), ("cuda", "CUDA"))
}


def has_kernel(device_type: str) -> bool:
    """True if the compiled forward op has a kernel for `device_type` ("cpu", "cuda")."""
    return _KERNELS.get(device_type, False)


def register_attention_autograd(forward_op: str, backward_op: str) -> None:
    """Autograd for a forward op with the schema of dilated_attn::forward, through `backward_op` (a
    dilated_attn op with the schema of dilated_attn::backward). Shared by the compiled and Triton ops."""

    def setup_context(ctx, inputs, output):
        q, k, v, segment_lengths, dilation_rates, split_heads, causal, scale = inputs
        out, lse = output
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.config = (segment_lengths, dilation_rates, split_heads, causal, scale)

    def backward(ctx, grad_out, grad_lse):
        q, k, v, out, lse = ctx.saved_tensors
        op = getattr(torch.ops.dilated_attn, backward_op)
        grad_q, grad_k, grad_v = op(grad_out, grad_lse, q, k, v, out, lse, *ctx.config)
        return grad_q, grad_k, grad_v, None, None, None, None, None

    torch.library.register_autograd(forward_op, backward, setup_context=setup_context)


if _C is not None:

    @torch.library.register_fake("dilated_attn::forward")
    def _forward_fake(q, k, v, segment_lengths, dilation_rates, split_heads, causal, scale):
        B, N, H, _ = q.shape
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        lse = torch.empty((B, H, N), dtype=lse_dtype(q.dtype), device=q.device)
        return out, lse

    @torch.library.register_fake("dilated_attn::backward")
    def _backward_fake(grad_out, grad_lse, q, k, v, out, lse, segment_lengths, dilation_rates, split_heads,
                       causal, scale):
        return (
            torch.empty(q.shape, dtype=q.dtype, device=q.device),
            torch.empty(k.shape, dtype=k.dtype, device=k.device),
            torch.empty(v.shape, dtype=v.dtype, device=v.device),
        )

    register_attention_autograd("dilated_attn::forward", "backward")


def forward(q, k, v, problem):
    """The compiled op on a validated problem: returns (out, lse)."""
    p = problem
    return torch.ops.dilated_attn.forward(
        q, k, v, list(p.segment_lengths), list(p.dilation_rates), p.split_heads, p.causal, p.scale
    )
