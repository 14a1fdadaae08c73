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
    # off < dilation and length >= 1 make the numerator positive, and the count 0 when off >= length; a segment
    # past the end (length <= 0) gets a count <= 0.
    n = (length - off + dilation - 1) // dilation
    return start + off, n


@triton.jit
def sequence_of(b, CuSeqlens, N, seg_len, VARLEN: tl.constexpr):
    """Where sequence `b` lies: (its batch index, its first row, its length, its segment length).

    Without VARLEN, batch b's N rows. With VARLEN (packed sequences: one batch of N rows), rows
    [CuSeqlens[b], CuSeqlens[b + 1]) of batch 0, its segments clipped to its length; the offsets are clamped
    to [0, N] so that no offsets, valid or not, make a program read or write outside the pack."""
    start = b * 0
    length = N
    if VARLEN:
        first = tl.minimum(tl.maximum(tl.load(CuSeqlens + b).to(tl.int64), 0), N)
        end = tl.minimum(tl.maximum(tl.load(CuSeqlens + b + 1).to(tl.int64), first), N)
        length = (end - first).to(tl.int32)
        seg_len = tl.maximum(tl.minimum(seg_len, length), 1)
        start = first
        b = b * 0
    return b, start, length, seg_len


@triton.jit
def segment_of(pid, CuSeqlens, N, seg_len, dilation, n_seg, head_lo, n_heads, offset_div, offset_base, GROUP,
               VARLEN: tl.constexpr):
    """Decode program id `pid` over (batch or packed sequence, head of the branch, segment) into the batch
    index, the query head, its key/value head, the row of member 0 of the segment, and the member count
    (<= 0 for a segment past the end of a packed sequence)."""
    seg = pid % n_seg
    h = head_lo + (pid // n_seg) % n_heads
    b, start, length, seg_len = sequence_of((pid // (n_seg * n_heads)).to(tl.int64), CuSeqlens, N, seg_len, VARLEN)
    first, n = members_of(h, seg, length, seg_len, dilation, head_lo, offset_div, offset_base)
    return b, h, h // GROUP, start + first, n
