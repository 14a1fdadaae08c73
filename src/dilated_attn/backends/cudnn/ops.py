"""The cudnn backend's ops: cuDNN's fused attention on the strided views of each branch's members
(backends/views.py plans them), each call's result merged into the running one. csrc/cuda/cudnn_steps.cpp runs the
schedules, with the merge and gradient-addition kernels of csrc/cuda/merge.cu.

The backward passes cuDNN the merged `out` and `lse` of the whole problem: its `P = exp(S - lse)` and
`delta = rowsum(dO * out)` are then this branch's share of the exact gradient (docs/SPEC.md, "Gradients"), which
is added into the gradients in place. cuDNN's backward takes no LSE gradient: autograd runs another backend's
backward where the LSE has one (backends/autograd.py, dispatch.backward_backend).
"""

from __future__ import annotations

import torch

from ...spec import lse_dtype
from ..autograd import register_attention_autograd
from ..signature import backward_op, forward_op
from ..views import aligned, contiguous, kv_sides, layouts_of, plan_of
from . import CUDNN

__all__ = ["cudnn_forward", "cudnn_backward", "dense_forward", "dense_backward"]


# The most elements (segments x heads x members x D) one cuDNN call takes in the forward and in the backward:
# bounds what a call allocates beyond the result (its output in the forward; its gradients and cuDNN's float32 dQ
# accumulator in the backward), while a call still has >= 1024 programs at the sizes that matter. The backward's
# larger pieces take fewer calls. A first branch that is one call over
# every row is not cut: its result is the whole one (CallPlan.schedule).
MAX_CALL_ELEMENTS = 1 << 24
MAX_BACKWARD_CALL_ELEMENTS = 1 << 25


@forward_op("cudnn_forward")
def cudnn_forward(q, k, v, segment_lengths, dilation_rates, split_heads, causal, scale, head_start=0, global_heads=0):
    q, k, v = aligned(q), aligned(k), aligned(v)
    B, N, H, D = q.shape
    p = plan_of(q, k, segment_lengths, dilation_rates, split_heads, head_start, global_heads)
    # the C++ loop's tensors (csrc/cuda/cudnn_steps.cpp): the inputs, then the results it allocates
    s = p.schedule(layouts_of(q, k, v) + contiguous(q.shape, (B, N, H)), kv_sides("q k v out lse"), MAX_CALL_ELEMENTS)
    out, lse_rows = torch.ops.dilated_attn.cudnn_forward_steps(q, k, v, s.steps, s.stored, causal, scale)
    return out, lse_rows.transpose(1, 2).contiguous()


@backward_op("cudnn_backward")
def cudnn_backward(grad_out, grad_lse, q, k, v, out, lse, segment_lengths, dilation_rates, split_heads, causal,
                   scale, head_start=0, global_heads=0):
    if grad_lse is not None:
        raise ValueError("the cudnn backward takes no LSE gradient (grad_lse must be None): cuDNN computes "
                         "delta = rowsum(dO * out) itself; dispatch.backward_backend names a backend that takes one")
    q, k, v, grad_out, out = (aligned(x) for x in (q, k, v, grad_out.to(q.dtype), out))
    lse_rows = lse.to(lse_dtype(q.dtype)).transpose(1, 2).contiguous()
    p = plan_of(q, k, segment_lengths, dilation_rates, split_heads, head_start, global_heads)
    # the loop's tensors, then the layouts of the gradients it allocates (one for grad_k and grad_v)
    layouts = layouts_of(grad_out, q, k, v, out, lse_rows) + contiguous(q.shape, k.shape)
    s = p.schedule(layouts, kv_sides("grad_out q k v out lse grad_q grad_kv"), MAX_BACKWARD_CALL_ELEMENTS)
    return torch.ops.dilated_attn.cudnn_backward_steps(grad_out, q, k, v, out, lse_rows, s.steps, s.stored, causal,
                                                       scale)


register_attention_autograd("dilated_attn::cudnn_forward", "cudnn_backward",
                            takes_lse_gradient=CUDNN.backward_op.takes_lse_gradient,
                            deterministic=CUDNN.backward_op.deterministic)


def _heads_view(x: torch.Tensor) -> list[int]:
    """The packed view `[B, H, n, D]` of a `[B, n, H, D]` tensor (the batch elements as the loop's segments)."""
    B, n, H, D = x.shape
    sb, sn, sh, sd = x.stride()
    return [B, H, n, D, sb, sh, sn, sd, x.storage_offset()]


def _rows_view(B: int, n: int, H: int, D: int) -> list[int]:
    """The packed view `[B, H, n(, D)]` of a fresh contiguous `[B, n, H(, D)]` result (D = 0: an LSE's rows)."""
    if D == 0:
        return [B, H, n, 1, n * H, 1, H, 0, 0]
    return [B, H, n, D, n * H * D, D, H * D, 1, 0]


def dense_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
    """Full (non-causal) attention of q `[B, nq, H, D]` over k, v `[B, nk, Hk, D]` in one cuDNN call, the lengths
    unequal where they are (both >= 2): `(out [B, nq, H, D], lse [B, H, nq])`. The ring's blocks over the keys of
    several ranks at once run here; the op of one branch `(n, 1)` needs nq == nk."""
    q, k, v = aligned(q), aligned(k), aligned(v)
    B, nq, H, D = q.shape
    steps = torch.tensor([_heads_view(q) + _heads_view(k) + _heads_view(v) + _rows_view(B, nq, H, D)
                          + _rows_view(B, nq, H, 0)], dtype=torch.int64)
    out, lse_rows = torch.ops.dilated_attn.cudnn_forward_steps(q, k, v, steps, 1, False, scale)
    return out, lse_rows.transpose(1, 2)


def dense_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, scale: float):
    """The gradients `(dq, dk, dv)` of dense_forward, given its out and the LSE `[B, H, nq]` of the rows (the merged
    ones in the ring: each block's share of the exact gradient, as in cudnn_backward)."""
    q, k, v, grad_out, out = (aligned(x) for x in (q, k, v, grad_out.to(q.dtype), out))
    B, nq, H, D = q.shape
    _, nk, Hk, _ = k.shape
    lse_rows = lse.to(lse_dtype(q.dtype)).transpose(1, 2).contiguous()
    steps = torch.tensor([_heads_view(grad_out) + _heads_view(q) + _heads_view(k) + _heads_view(v)
                          + _heads_view(out) + _rows_view(B, nq, H, 0) + _rows_view(B, nq, H, D)
                          + _rows_view(B, nk, Hk, D)],
                         dtype=torch.int64)
    return torch.ops.dilated_attn.cudnn_backward_steps(grad_out, q, k, v, out, lse_rows, steps, 1, False, scale)
