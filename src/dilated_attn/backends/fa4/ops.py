"""The fa4 backend's ops: FlashAttention-4 on the strided views of the cudnn backend's plan (backends/cudnn/ops.py:
the same calls, pieces and steps), each call's result merged into the running `(out, lse)` by the CUDA merge kernel
(csrc/cuda/merge.cu) or, stored, written in place by the kernel itself.

The views are those of the cudnn loops, `[segments, heads, members, D]`, transposed to FlashAttention's
`[batch, seqlen, heads, D]`; its kernels read any 16-byte-aligned strides, so nothing is gathered. A first branch
that covers every row (LongNet's dilation 1) is written by the kernel straight into the result, and its LSE into
the result's `[B, H, N]` LSE. Grouped-query calls pass the kv views' fewer heads: FlashAttention groups query head
`i` onto kv head `i // (Hq / Hkv)`, as cuDNN does.

The backward runs FlashAttention's backward per step with the merged `out` and `lse` of the whole problem and the
LSE's gradient (its `delta = rowsum(dO * out) - dLSE`), so each step gives its share of the exact gradient (docs/
SPEC.md, "Gradients"), added into the gradients through the steps' views.
"""

from __future__ import annotations

from typing import Optional

import torch

from ...spec import lse_dtype
from .. import compiled
from ..autograd import register_attention_autograd
# FlashAttention reads the views cuDNN reads (unit-stride rows, 16-byte aligned address and strides, no broadcast
# dimensions): the same copy where a tensor is not so
from ..cudnn.ops import _cudnn_layout as _aligned
from ..cudnn.ops import _layouts, _plan_of
from ...merge import merge_into

__all__ = ["fa4_forward", "fa4_backward", "dense_forward", "dense_backward"]

# flash_attn.cute.interface, set by the backend's loader (fa4/__init__.py): flash-attn-4 is imported only when the
# backend is chosen. Its private `_flash_attn_fwd` / `_flash_attn_bwd` are the calls that take preallocated results,
# the LSE's gradient and strided views, which its autograd functions do not expose.
fa = None

# The most elements of one call. FlashAttention's Python interface takes enough host time per call that fewer,
# larger calls ran faster (an H100, LongNet at N = 65536: 2^25 against 2^24). In the backward, its float32 dQ
# accumulator and the call's gradients, before they are added, take 10 bytes per element (320 MiB here), the first
# branch's calls too: the extra memory of a training step stays the cudnn backend's, or below it with grouped-query
# heads (benchmarks/README.md, "FlashAttention-4").
MAX_CALL_ELEMENTS = 1 << 25
MAX_BACKWARD_CALL_ELEMENTS = 1 << 25

# The tensors of each loop and whether each takes the kv-side views: forward q, k, v, out, lse; backward grad_out,
# q, k, v, out, lse, grad_q, grad_k, grad_v (then grad_lse where it is given).
FORWARD_KV = (False, True, True, False, False)
BACKWARD_KV = (False, False, True, True, False, False, False, True, True)


def _bshd(view: torch.Tensor) -> torch.Tensor:
    """A step's `[segments, heads, members, D]` view as FlashAttention's `[batch, seqlen, heads, D]`."""
    return view.transpose(1, 2)


def _accumulate(targets, grads, store: bool) -> None:
    """targets (the steps' `[segments, heads, members, D]` views of dq, dk, dv) += grads (= with `store`), in one
    launch where the query and kv views agree (no grouped-query heads), else two."""
    if targets[0].is_cuda and compiled.has_kernel("cuda"):
        if targets[0].shape == targets[1].shape:
            torch.ops.dilated_attn.cudnn_accumulate(list(targets), grads, store)
        else:
            torch.ops.dilated_attn.cudnn_accumulate([targets[0]], grads[:1], store)
            torch.ops.dilated_attn.cudnn_accumulate(list(targets[1:]), grads[1:], store)
        return
    for target, grad in zip(targets, grads):  # an extension built without CUDA
        target.copy_(grad) if store else target.add_(grad)


def _merge(out_view, lse_view, part_out, part_lse) -> None:
    if out_view.is_cuda and compiled.has_kernel("cuda"):
        torch.ops.dilated_attn.cudnn_merge(out_view, lse_view, part_out, part_lse)
    else:  # an extension built without CUDA: the same merge in PyTorch
        merge_into(out_view, lse_view, part_out, part_lse)


@torch.library.custom_op("dilated_attn::fa4_forward", mutates_args=())
def fa4_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segment_lengths: list[int],
    dilation_rates: list[int],
    split_heads: bool,
    causal: bool,
    scale: float,
    head_start: int = 0,
    global_heads: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    q, k, v = _aligned(q), _aligned(k), _aligned(v)
    B, N, H, D = q.shape
    p = _plan_of(q, k, segment_lengths, dilation_rates, split_heads, head_start, global_heads)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty((B, H, N), dtype=lse_dtype(q.dtype), device=q.device)
    if not p.first_stores:
        out.zero_()
        lse.fill_(float("-inf"))
    tensors = (q, k, v, out, lse.transpose(1, 2))  # the plan reads LSEs as [B, N, H]
    s = p.schedule(_layouts(*tensors), FORWARD_KV, MAX_CALL_ELEMENTS)
    for i, (qs, ks, vs, outs, lses) in enumerate(s.views(*tensors)):
        qs, ks, vs = _bshd(qs), _bshd(ks), _bshd(vs)
        if i < s.stored and lses.stride(-1) == 1:  # written in place
            fa._flash_attn_fwd(qs, ks, vs, softmax_scale=scale, causal=causal, return_lse=True, out=_bshd(outs),
                               lse=lses)
            continue
        part_out, part_lse = fa._flash_attn_fwd(qs, ks, vs, softmax_scale=scale, causal=causal, return_lse=True)[:2]
        if i < s.stored:
            outs.copy_(_bshd(part_out))
            lses.copy_(part_lse)
        else:
            _merge(outs, lses, _bshd(part_out), part_lse)
    return out, lse


@fa4_forward.register_fake
def _(q, k, v, segment_lengths, dilation_rates, split_heads, causal, scale, head_start=0, global_heads=0):
    B, N, H, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((B, H, N), dtype=lse_dtype(q.dtype))


@torch.library.custom_op("dilated_attn::fa4_backward", mutates_args=())
def fa4_backward(
    grad_out: torch.Tensor,
    grad_lse: Optional[torch.Tensor],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    segment_lengths: list[int],
    dilation_rates: list[int],
    split_heads: bool,
    causal: bool,
    scale: float,
    head_start: int = 0,
    global_heads: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q, k, v, grad_out, out = (_aligned(x) for x in (q, k, v, grad_out.to(q.dtype), out))
    lse = lse.to(lse_dtype(q.dtype))
    p = _plan_of(q, k, segment_lengths, dilation_rates, split_heads, head_start, global_heads)
    make = torch.empty if p.first_stores else torch.zeros
    grad_q = make(q.shape, dtype=q.dtype, device=q.device)
    grad_k = make(k.shape, dtype=q.dtype, device=q.device)
    grad_v = make(k.shape, dtype=q.dtype, device=q.device)
    tensors = [grad_out, q, k, v, out, lse.transpose(1, 2), grad_q, grad_k, grad_v]
    kv = BACKWARD_KV
    if grad_lse is not None:
        tensors.append(grad_lse.to(lse.dtype).transpose(1, 2))
        kv = kv + (False,)
    s = p.schedule(_layouts(*tensors), kv, MAX_BACKWARD_CALL_ELEMENTS, whole_first=False)
    deterministic = torch.are_deterministic_algorithms_enabled()
    for i, views in enumerate(s.views(*tensors)):
        gos, qs, ks, vs, outs, lses, dqs, dks, dvs = views[:9]
        dlse = views[9] if grad_lse is not None else None
        stored = i < s.stored
        direct = stored and all(_bshd(t).is_contiguous() for t in (dqs, dks, dvs))
        given = dict(dq=_bshd(dqs), dk=_bshd(dks), dv=_bshd(dvs)) if direct else {}
        grads = fa._flash_attn_bwd(_bshd(qs), _bshd(ks), _bshd(vs), _bshd(outs), _bshd(gos), lses,
                                   softmax_scale=scale, causal=causal, deterministic=deterministic, dlse=dlse,
                                   **given)[:3]
        if not direct:
            _accumulate((dqs, dks, dvs), [_bshd(g) for g in grads], stored)
    return grad_q, grad_k, grad_v


@fa4_backward.register_fake
def _(grad_out, grad_lse, q, k, v, out, lse, segment_lengths, dilation_rates, split_heads, causal, scale,
      head_start=0, global_heads=0):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


register_attention_autograd("dilated_attn::fa4_forward", "fa4_backward")


def dense_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
    """Full (non-causal) attention of q `[B, nq, H, D]` over k, v `[B, nk, Hk, D]` in one call, the lengths unequal
    where they are: `(out [B, nq, H, D], lse [B, H, nq])` (the ring's blocks over several ranks' keys)."""
    out, lse = fa._flash_attn_fwd(_aligned(q), _aligned(k), _aligned(v), softmax_scale=scale, return_lse=True)[:2]
    return out, lse


def dense_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, scale: float):
    """The gradients `(dq, dk, dv)` of dense_forward given the merged out and LSE of the rows (each block's share of
    the exact gradient)."""
    q, k, v, grad_out, out = (_aligned(x) for x in (q, k, v, grad_out.to(q.dtype), out))
    return tuple(fa._flash_attn_bwd(q, k, v, out, grad_out, lse.to(torch.float32), softmax_scale=scale,
                                    deterministic=torch.are_deterministic_algorithms_enabled())[:3])
