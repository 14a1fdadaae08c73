"""Pieces shared by the Triton kernels: where a program's segment lies."""

from __future__ import annotations

import triton
import triton.language as tl


# Integer arguments that change with every shape. Triton would otherwise specialise on their values
# (== 1, divisible by 16) and compile a new kernel for each; strides stay specialised (aligned loads).
# MAX_MEMBERS_BUCKET is only the sweep's key (configs.py): a bucket picks its config, not a new compilation.
SIZE_ARGS = ["N", "H", "seg_len", "dilation", "n_seg", "head_lo", "offset_div", "offset_base", "max_members", "GROUP",
             "HEAD_DIM", "MAX_MEMBERS_BUCKET"]


@triton.jit
def members_of(h, seg, N, seg_len, dilation, head_lo, offset_div, offset_base):
    """Position of member 0 and the member count of segment `seg` for query head `h` of a branch."""
    off = offset_base + (h - head_lo) // offset_div
    start = seg * seg_len
    length = tl.minimum(seg_len, N - start)
    # off < dilation and length >= 1 make the numerator positive, and the count 0 when off >= length.
    n = (length - off + dilation - 1) // dilation
    return start + off, n


@triton.jit
def segment_of(pid, N, seg_len, dilation, n_seg, head_lo, n_heads, offset_div, offset_base, GROUP):
    """Decode program id `pid` over (batch, head of the branch, segment) into the batch index, the query
    head, its key/value head, the position of member 0 of the segment, and the member count."""
    seg = pid % n_seg
    h = head_lo + (pid // n_seg) % n_heads
    b = (pid // (n_seg * n_heads)).to(tl.int64)
    first, n = members_of(h, seg, N, seg_len, dilation, head_lo, offset_div, offset_base)
    return b, h, h // GROUP, first, n
