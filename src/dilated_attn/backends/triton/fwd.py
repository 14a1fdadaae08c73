"""Triton forward kernel: one launch per branch, merging into the running (out, lse) in place.

A program owns BLOCK_M consecutive members j of one (batch, head, segment) of a branch, i.e. the query
rows at positions `first + r*j` (first = seg*s + o(h)): strided row pointers straight into q/k/v, no
gathered copies. It runs flash attention over the members of its segment and merges its result into
`out`/`lse`, which hold the merge of the earlier branches (0 and -inf where nothing has landed yet; the
first branch writes its result as is, and when it covers every position they start uninitialised).
Within one launch every (batch, head, position) belongs to exactly one program, so the merge has no race.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import SIZE_ARGS, segment_of
from .configs import Tunable

LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _fwd_blocks(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn, first, dilation, offs_m, offs_d, d_mask,
                lo, hi, key_end, qk_scale, MASKED: tl.constexpr, CAUSAL: tl.constexpr, EVEN_D: tl.constexpr,
                PRECISION: tl.constexpr, NEGATIVE_SCALE: tl.constexpr, BLOCK_N: tl.constexpr):
    """Online softmax over the key blocks [lo, hi) of one query block; MASKED: keys >= key_end and (causal)
    keys after the query are masked, else every key of every block is visible."""
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        pos_n = (first + offs_n * dilation).to(tl.int64)
        k_ptrs = k_base + pos_n[:, None] * stride_kn + offs_d[None, :]
        v_ptrs = v_base + pos_n[:, None] * stride_vn + offs_d[None, :]
        if MASKED:
            n_mask = offs_n < key_end
            k = tl.load(k_ptrs, mask=n_mask[:, None] & d_mask[None, :], other=0.0)
            v = tl.load(v_ptrs, mask=n_mask[:, None] & d_mask[None, :], other=0.0)
        elif EVEN_D:
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
        else:
            k = tl.load(k_ptrs, mask=d_mask[None, :], other=0.0)
            v = tl.load(v_ptrs, mask=d_mask[None, :], other=0.0)
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        if MASKED:
            valid = n_mask[None, :]
            if CAUSAL:
                valid = valid & (offs_n[None, :] <= offs_m[:, None])
            qk = tl.where(valid, qk * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            qk = qk - m_new[:, None]
        else:
            # the scale folded into the row maximum and into one FMA per score: max(s * x) = s * max(x) for
            # s >= 0, s * min(x) for s < 0 (a negative scale is legal)
            if NEGATIVE_SCALE:
                m_new = tl.maximum(m_i, tl.min(qk, 1) * qk_scale)
            else:
                m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            qk = qk * qk_scale - m_new[:, None]
        p = tl.math.exp2(qk)
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        # accumulating in the product's own accumulator (no separate sum) keeps one [BLOCK_M, BLOCK_D] tile live
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit(do_not_specialize=SIZE_ARGS + ["n_heads", "first_branch", "ordered"])
def _fwd_kernel(
    Q, K, V, Out, Lse,
    TileOrder,  # int32 [tiles]: the (batch, head, segment) tile each position of the visiting order runs
    CuSeqlens,  # with VARLEN, the packed sequences' offsets (common.sequence_of)

    stride_qb, stride_qn, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_ob, stride_on, stride_oh,
    N, H, seg_len, dilation, n_seg, head_lo, n_heads, offset_div, offset_base, max_members,
    qk_scale,  # scale * log2(e): the softmax runs in base 2
    NEGATIVE_SCALE: tl.constexpr,  # qk_scale < 0
    GROUP,  # query heads per kv head
    HEAD_DIM,
    BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr,  # HEAD_DIM == BLOCK_D: no head-dim masks
    CAUSAL: tl.constexpr,
    first_branch,  # nothing to merge with: write (o, lse) as they are (run time, not a second kernel variant)
    PRECISION: tl.constexpr,
    MAX_MEMBERS_BUCKET,  # the sweep's key only (a plain argument: a new bucket re-tunes, it does not recompile)
    ordered,  # visit tiles in TileOrder's order (else batch, head, segment: row-major)
    VARLEN: tl.constexpr,  # packed sequences: the batch index runs over the sequences of CuSeqlens
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    scale2 = tl.cast(qk_scale, tl.float32)  # torch.compile may hand qk_scale over as a float64 (or constant)
    # 1-D grid, the blocks of one segment adjacent so that they share its K/V in L2.
    n_blocks = tl.cdiv(max_members, BLOCK_M)
    pid_m = tl.program_id(0) % n_blocks
    tile = tl.program_id(0) // n_blocks
    if ordered != 0:
        tile = tl.load(TileOrder + tile)
    b, h, kvh, first, n = segment_of(tile, CuSeqlens, N, seg_len, dilation, n_seg, head_lo, n_heads,
                                     offset_div, offset_base, GROUP, VARLEN)
    start_m = pid_m * BLOCK_M
    if start_m < n:
        offs_m = start_m + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        m_mask = offs_m < n
        d_mask = (offs_d < BLOCK_D) if EVEN_D else (offs_d < HEAD_DIM)
        pos_m = (first + offs_m * dilation).to(tl.int64)
        q = tl.load(Q + b * stride_qb + h * stride_qh + pos_m[:, None] * stride_qn + offs_d[None, :],
                    mask=m_mask[:, None] & d_mask[None, :], other=0.0)
        k_base = K + b * stride_kb + kvh * stride_kh
        v_base = V + b * stride_vb + kvh * stride_vh

        # A finite start for the running max keeps fully masked rows NaN-free (their p is exp2(-inf) = 0); the
        # lowest finite float, so that rows whose scores are all below any other start (say -1e30) still count.
        m_i = tl.full([BLOCK_M], -3.4028234663852886e38, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        # Key blocks wholly inside the segment and wholly visible to every query of the block need no
        # masks; only the diagonal (causal) and the last, partial block take the masked path.
        hi = n
        if CAUSAL:
            hi = tl.minimum(n, start_m + BLOCK_M)
        full = n // BLOCK_N * BLOCK_N
        if CAUSAL:
            full = tl.minimum(full, (start_m + 1) // BLOCK_N * BLOCK_N)
        acc, l_i, m_i = _fwd_blocks(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn, first, dilation, offs_m,
                                    offs_d, d_mask, 0, full, hi, scale2, False, CAUSAL, EVEN_D, PRECISION,
                                    NEGATIVE_SCALE, BLOCK_N)
        acc, l_i, m_i = _fwd_blocks(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn, first, dilation, offs_m,
                                    offs_d, d_mask, full, hi, hi, scale2, True, CAUSAL, EVEN_D, PRECISION,
                                    NEGATIVE_SCALE, BLOCK_N)

        # Every member query sees at least itself: l_i > 0 on the rows that are stored.
        l_safe = tl.where(m_mask, l_i, 1.0)
        lse = (m_i + tl.math.log2(l_safe)) * LN2
        o = acc / l_safe[:, None]
        lse_ptrs = Lse + (b * H + h).to(tl.int64) * N + pos_m
        o_ptrs = Out + b * stride_ob + h * stride_oh + pos_m[:, None] * stride_on + offs_d[None, :]
        o_mask = m_mask[:, None] & d_mask[None, :]
        if first_branch == 0:
            # dilated_attn/merge.py's formula for two terms (tests/test_merge.py pins it); a row no earlier branch
            # covered holds (0, -inf) and gets weight e_old = 0
            old_lse = tl.load(lse_ptrs, mask=m_mask, other=float("-inf"))
            old_o = tl.load(o_ptrs, mask=o_mask, other=0.0).to(tl.float32)
            top = tl.maximum(old_lse, lse)
            e_old = tl.exp(old_lse - top)
            e_new = tl.exp(lse - top)
            total = e_old + e_new
            o = (old_o * e_old[:, None] + o * e_new[:, None]) / total[:, None]
            lse = top + tl.log(total)
        tl.store(lse_ptrs, lse, mask=m_mask)
        tl.store(o_ptrs, o.to(Out.dtype.element_ty), mask=o_mask)


FORWARD = Tunable(
    "fwd", _fwd_kernel,
    candidates=[
        dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3),
        dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3),
        dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=2),
        dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=3),
        dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=4),
        dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3),
        dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2),  # float32 tf32x3 at head dim 128
        dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=2),
    ],
    tf32x3_candidates=[
        dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=1),
        dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=1),
        dict(BLOCK_M=32, BLOCK_N=32, num_warps=4, num_stages=2),
    ],
    # the query rows stay; per stage a block of K and one of V
    rows_per_stage=lambda c: (c["BLOCK_M"], 2 * c["BLOCK_N"], 0),
    restore=("Out", "Lse"),
)
