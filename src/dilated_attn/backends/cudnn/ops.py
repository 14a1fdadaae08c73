"""The cudnn backend's ops: cuDNN's fused attention on strided views of each branch's members, each call's result
merged into the running one. This module plans the calls; csrc/cuda/cudnn_steps.cpp runs them, with the merge and
gradient-addition kernels of csrc/cuda/merge.cu.

A branch's members are evenly spaced rows: for offset `o`, segment `j` holds rows `j*s + o + r*i`. For a run of
heads sharing one offset they form a 4-D strided view `[segments, heads, members, D]` of `[B, N, H, D]` (row stride
`r*H*D`, segment stride `s*H*D`), which cuDNN reads in place, with no gather. With `head_groups="all"` the offset
grows by one per `c = ceil(H/r)` heads, so the `i`-th head of every offset group also forms one view (head stride
`(H + c)*D`), and so do all the groups of one segment (group stride `(H + c)*D`): a branch takes
`min(groups, c, segments)` calls, not one per group. The backward passes cuDNN the merged
`out` and `lse` of the whole problem: its `P = exp(S - lse)` and `delta = rowsum(dO * out)` are then this
branch's share of the exact gradient (docs/SPEC.md, "Gradients"), which is added into the gradients in place.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Optional

import torch

from ...spec import Branch, branch_table, lse_dtype
from ..autograd import register_attention_autograd
from ..triton.ops import covers_everything, triton_backward

__all__ = ["Call", "branch_calls", "cudnn_forward", "cudnn_backward"]


@dataclass(frozen=True)
class Call:
    """One attention call over `n_seg` segments (`seg_rows` rows and `seg_head_step` heads apart) starting at row
    `first_row`: head `i` of the call is head `head0 + i*head_step` at row shift `i*row_step`, and its members are
    `members` rows `dilation` apart. (A call's "segments" may also be the offset groups of one segment: see
    branch_calls.)"""

    first_row: int
    n_seg: int
    seg_rows: int
    members: int
    dilation: int
    head0: int
    n_heads: int
    head_step: int = 1
    row_step: int = 0
    seg_head_step: int = 0


def _offset_groups(br: Branch) -> list[tuple[int, int, int]]:
    """(offset, first head, heads) for each run of heads that share an offset (runs of `offset_div` heads)."""
    return [(br.offset(h), h, min(br.offset_div, br.head_hi - h)) for h in range(br.head_lo, br.head_hi, br.offset_div)]


def branch_calls(br: Branch, seq_len: int) -> list[Call]:
    """The calls that cover branch `br`: the full segments, then the shorter last one (if any), each by offset
    group, unless another cut takes fewer calls where the groups allow it (equal groups, consecutive offsets, and
    every offset with the same number of members): by head within the groups (the `i`-th head of every group and
    segment in one call), or by segment (every group of one segment in one call). Fewer calls cost less host time,
    which bounds small problems."""
    s, r = br.seg_len, br.dilation
    n_full, tail = divmod(seq_len, s)
    groups = _offset_groups(br)
    size = groups[0][2]
    calls = []
    for first_row, n_seg, length in ((0, n_full, s), (n_full * s, 1, tail)):
        if n_seg == 0 or length == 0:
            continue
        stackable = (len(groups) > 1 and length % r == 0
                     and all(g == (groups[0][0] + i, br.head_lo + i * size, size) for i, g in enumerate(groups)))
        if stackable and n_seg < min(size, len(groups)):
            calls += [Call(first_row + j * s + groups[0][0], len(groups), 1, length // r, r, br.head_lo, size,
                           seg_head_step=size) for j in range(n_seg)]
            continue
        if stackable and size < len(groups):
            calls += [Call(first_row + groups[0][0], n_seg, s, length // r, r, br.head_lo + i, len(groups),
                           head_step=size, row_step=1) for i in range(size)]
            continue
        for offset, head0, n_heads in groups:
            if offset < length:
                calls.append(Call(first_row + offset, n_seg, s, -(-(length - offset) // r), r, head0, n_heads))
    return calls


def _batch_merges(call: Call, shape, stride) -> bool:
    """Batches of a `[B, N, H, ...]` layout continue its segment dimension (one view spans them)."""
    return shape[0] == 1 or (call.seg_head_step == 0 and stride[0] == call.n_seg * call.seg_rows * stride[1])


# The most elements (segments x heads x members x D) one cuDNN call takes in the forward and in the backward:
# bounds what a call allocates beyond the result (its output in the forward; its gradients and cuDNN's float32 dQ
# accumulator in the backward), while a call still has >= 1024 programs at the sizes that matter. The backward's
# larger pieces take fewer calls and let a first branch of up to 2^25 elements be the starting gradients without a
# copy (benchmarks/README.md, "The cudnn backend": forward + backward at N = 65536 in 1.32 GiB, not 1.17, and
# 0.3 ms faster).
MAX_CALL_ELEMENTS = 1 << 24
MAX_BACKWARD_CALL_ELEMENTS = 1 << 25


@functools.lru_cache(maxsize=4096)
def _geometry(call: Call, layouts: tuple, limit: Optional[int]) -> tuple:
    """as_strided arguments (sizes, strides, offset) of the call's views `[segments, heads, members, *rest]` of
    tensors with `layouts` (shape, strides, storage offset) `[B, N, H, *rest]`: per piece, one per tensor. A piece
    spans all batches where every layout lets it (_batch_merges), else one batch; with a `limit`, pieces hold at
    most that many elements (whole segments, at least one)."""
    merged = all(_batch_merges(call, shape, stride) for shape, stride, _ in layouts)
    n_batch = layouts[0][0][0]
    segments = call.n_seg * (n_batch if merged else 1)
    size = segments
    if limit is not None:
        size = max(1, limit // (call.n_heads * call.members * layouts[0][0][-1]))
    pieces = []
    for b in [0] if merged else range(n_batch):
        for first in range(0, segments, size):
            piece = []
            for shape, (sb, sn, sh, *rest), offset in layouts:
                strides = (call.seg_rows * sn + call.seg_head_step * sh, call.row_step * sn + call.head_step * sh,
                           call.dilation * sn, *rest)
                start = offset + b * sb + call.first_row * sn + call.head0 * sh + first * strides[0]
                piece.append(((min(size, segments - first), call.n_heads, call.members, *shape[3:]), strides, start))
            pieces.append(tuple(piece))
    return tuple(pieces)


def _layouts(*tensors: torch.Tensor) -> tuple:
    return tuple((tuple(x.shape), x.stride(), x.storage_offset()) for x in tensors)


def _call_views(call: Call, *tensors: torch.Tensor, limit: Optional[int]) -> list[tuple[torch.Tensor, ...]]:
    """The call's views of each of `tensors`, as one tuple per piece (see _geometry; with a `limit`, of at most that
    many elements)."""
    return [tuple(x.as_strided(*g) for x, g in zip(tensors, piece))
            for piece in _geometry(call, _layouts(*tensors), limit)]


@functools.lru_cache(maxsize=256)
def _plan(segment_lengths: tuple, dilation_rates: tuple, seq_len: int, heads: int, split_heads: bool):
    """(the calls of each branch, whether the first branch reaches every row and head once)."""
    table = branch_table(list(segment_lengths), list(dilation_rates), seq_len, heads,
                         "split" if split_heads else "all")
    plans = tuple(tuple(branch_calls(br, seq_len)) for br in table) if seq_len else ()
    return plans, bool(table) and covers_everything(table[0], heads)


# A view as the C++ loops read it (csrc/cuda/cudnn_steps.cpp): 4 sizes, 4 strides, the storage offset.
VIEW_INTS = 9


def _packed(view: tuple) -> tuple:
    sizes, strides, start = view
    pad = 4 - len(sizes)  # the LSE's views are 3-D
    return (*sizes, *(1,) * pad, *strides, *(0,) * pad, start)


@functools.lru_cache(maxsize=256)
def _schedule(plan_key: tuple, first_branch: int, layouts: tuple, limit: int) -> tuple[torch.Tensor, int]:
    """The steps of the C++ loops (`cudnn_forward_steps`, `cudnn_backward_steps`): every piece of every call of the
    branches of `_plan(*plan_key)` from `first_branch` on, in order, as an int64 tensor with one row per piece (the
    piece's view of each tensor of `layouts`, packed; see _geometry); and how many of them are branch 0's. The
    small problems this backend runs are bound by the host's time per call (benchmarks/README.md, "The cudnn
    backend"): a layout's steps are planned once, and run without Python."""
    plans, _ = _plan(*plan_key)
    rows, first_branch_steps = [], 0
    for i, calls in enumerate(plans[first_branch:], first_branch):
        for call in calls:
            for piece in _geometry(call, layouts, limit):
                rows.append([n for view in piece for n in _packed(view)])
                first_branch_steps += i == 0
    return torch.tensor(rows, dtype=torch.int64).view(len(rows), len(layouts) * VIEW_INTS), first_branch_steps


# The C++ loops, called through these two functions: the CPU tests put the loops' contract, in Python, in their place.
def _forward_steps(q, k, v, out, lse_rows, steps: torch.Tensor, causal: bool, scale: float) -> None:
    torch.ops.dilated_attn.cudnn_forward_steps(q, k, v, out, lse_rows, steps, causal, scale)


def _backward_steps(grad_out, q, k, v, out, lse_rows, grads: tuple, steps: torch.Tensor, stored_steps: int,
                    causal: bool, scale: float) -> None:
    torch.ops.dilated_attn.cudnn_backward_steps(grad_out, q, k, v, out, lse_rows, *grads, steps, stored_steps,
                                                causal, scale)


_CUDNN_ATTENTION = torch.ops.aten._scaled_dot_product_cudnn_attention.default
_CUDNN_ATTENTION_BACKWARD = torch.ops.aten._scaled_dot_product_cudnn_attention_backward.default


def _attend(q, k, v, causal: bool, scale: float):
    """cuDNN attention of `[b, h, s, d]` views (s > 1): out `[b, h, s, d]` and the natural-log LSE `[b, h, s]`
    (float32). For the first branch's call, which becomes the starting result; the C++ loops make the others."""
    out, lse = _CUDNN_ATTENTION(q, k, v, None, True, 0.0, causal, False, scale=scale)[:2]
    return out, lse.view(q.shape[:3])


def _attend_backward(grad_out, q, k, v, out, lse, causal: bool, scale: float):
    """cuDNN's attention backward given `out` and `lse` `[b, h, s]`: (dq, dk, dv) `[b, h, s, d]`."""
    none = _no_philox(q.device)  # philox seed and offset: no dropout
    return _CUDNN_ATTENTION_BACKWARD(
        grad_out, q, k, v, out, lse.unsqueeze(-1), none, none, None, None, None, q.shape[2], k.shape[2], 0.0,
        causal, scale=scale)


@functools.lru_cache(maxsize=None)
def _no_philox(device: torch.device) -> torch.Tensor:
    return torch.empty(0, dtype=torch.int64, device=device)


def _cudnn_layout(x: torch.Tensor) -> torch.Tensor:
    """`x`, or a contiguous copy where cuDNN could not read its views: cuDNN needs unit-stride rows, 16-byte
    aligned addresses and strides (head_dim % 8 == 0 makes a fresh copy's so), and no broadcast (stride 0)
    dimensions."""
    size = x.element_size()
    readable = x.stride(-1) == 1 and x.data_ptr() % 16 == 0 and all(
        stride * size % 16 == 0 and (stride > 0 or n == 1) for stride, n in zip(x.stride()[:-1], x.shape[:-1]))
    return x if readable else torch.empty_like(x, memory_format=torch.contiguous_format).copy_(x)


def _single_full_call(calls: tuple, *tensors: torch.Tensor) -> bool:
    """The branch is one call over every row and head, in one view of each of `tensors` `[B, N, H, ...]`: its
    result, in row-major layout, is the whole `[B, N, H, ...]` one. (Not for one-row segments, which cuDNN rejects:
    the C++ loops answer those.)"""
    x, call = tensors[0], calls[0]
    return (len(calls) == 1 and call.n_seg * call.seg_rows == x.shape[1] and call.dilation == 1 and call.members > 1
            and call.n_heads == x.shape[2] and all(_batch_merges(call, t.shape, t.stride()) for t in tensors))


def _as_rows(result: torch.Tensor, shape) -> torch.Tensor:
    """A call's `[B*segments, H, members, D]` result over all rows as `[B, N, H, D]` (a view where its layout
    allows)."""
    return result.transpose(1, 2).reshape(shape).contiguous()


@torch.library.custom_op("dilated_attn::cudnn_forward", mutates_args=())
def cudnn_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segment_lengths: list[int],
    dilation_rates: list[int],
    split_heads: bool,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    q, k, v = _cudnn_layout(q), _cudnn_layout(k), _cudnn_layout(v)
    B, N, H, D = q.shape
    plan_key = (tuple(segment_lengths), tuple(dilation_rates), N, H, split_heads)
    plans, _ = _plan(*plan_key)
    first_branch = 0
    if plans and _single_full_call(plans[0], q, k, v):  # the first branch's result is the starting (out, lse)
        (first,), first_branch = plans[0], 1
        part_out, part_lse = _attend(*_call_views(first, q, k, v, limit=None)[0], causal, scale)
        out = _as_rows(part_out, q.shape)
        lse_rows = part_lse.view(B, N // first.seg_rows, H, first.seg_rows).transpose(2, 3).reshape(B, N, H)
        lse_rows = lse_rows.to(lse_dtype(q.dtype))
    else:
        out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
        lse_rows = torch.full((B, N, H), -math.inf, dtype=lse_dtype(q.dtype), device=q.device)
    steps, _ = _schedule(plan_key, first_branch, _layouts(q, k, v, out, lse_rows), MAX_CALL_ELEMENTS)
    _forward_steps(q, k, v, out, lse_rows, steps, causal, scale)
    return out, lse_rows.transpose(1, 2).contiguous()


@cudnn_forward.register_fake
def _(q, k, v, segment_lengths, dilation_rates, split_heads, causal, scale):
    B, N, H, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((B, H, N), dtype=lse_dtype(q.dtype))


@torch.library.custom_op("dilated_attn::cudnn_backward", mutates_args=())
def cudnn_backward(
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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if grad_lse is not None:  # cuDNN's backward has no LSE gradient input: the Triton kernels take it
        return triton_backward(grad_out, grad_lse, q, k, v, out, lse, segment_lengths, dilation_rates, split_heads,
                               causal, scale)
    q, k, v, grad_out, out = (_cudnn_layout(x) for x in (q, k, v, grad_out.to(q.dtype), out))
    B, N, H, D = q.shape
    lse_rows = lse.to(lse_dtype(q.dtype)).transpose(1, 2).contiguous()
    # A first branch with dilation 1 over all heads reaches every gradient row once: its calls store, not add
    plan_key = (tuple(segment_lengths), tuple(dilation_rates), N, H, split_heads)
    plans, store = _plan(*plan_key)
    tensors = (grad_out, q, k, v, out, lse_rows)
    limit, first_branch = MAX_BACKWARD_CALL_ELEMENTS, 0
    first = _call_views(plans[0][0], *tensors, limit=limit) if plans and _single_full_call(plans[0], *tensors) else []
    if len(first) == 1:  # one cuDNN call within the limit: its gradients, in row-major layout, are the starting ones
        grads = _attend_backward(*first[0], causal, scale)
        dq, dk, dv = (_as_rows(g, q.shape) for g in grads)
        first_branch, store = 1, False
    else:
        new = torch.empty if store else torch.zeros
        dq, dk, dv = (new(q.shape, dtype=q.dtype, device=q.device) for _ in range(3))
    # the gradients share one layout: dq's views are theirs
    steps, first_branch_steps = _schedule(plan_key, first_branch, _layouts(*tensors, dq), limit)
    _backward_steps(*tensors, (dq, dk, dv), steps, first_branch_steps if store else 0, causal, scale)
    return dq, dk, dv


@cudnn_backward.register_fake
def _(grad_out, grad_lse, q, k, v, out, lse, segment_lengths, dilation_rates, split_heads, causal, scale):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


register_attention_autograd("dilated_attn::cudnn_forward", "cudnn_backward")
