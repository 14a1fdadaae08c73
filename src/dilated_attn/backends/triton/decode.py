"""The decode kernel: new queries over a KV cache, every branch in one launch (dilated_attention_with_kvcache).

A program owns one new query (batch element, query head, new token i) at position P = cache_seqlens[b] + i, and
one of SPLITS interleaved shares of its key blocks (one query alone would leave most of the GPU idle). For
each branch it takes part in, P's segment starts at (P // w) * w (clipping a segment to the sequence never moves
a causal row's keys: docs/SPEC.md, "Decoding with a KV cache"); P is a member iff its offset in the segment is
the head's offset modulo r, and then its keys are the members up to P, every r-th row from the segment's start
plus the offset. All branches' keys feed one online softmax, which is the merge of the branches (one softmax over
the union of their keys). Each share's partial softmax (max, sum, unnormalised output) goes to a scratch buffer,
and `_decode_combine_kernel` merges the shares. One query row has no matrix product to make, so the scores are fp32
dot products on the CUDA cores; the kernels are bound by reading the keys and values. The query heads of one kv
head run in adjacent programs, so their reads of the same rows meet in L2.
"""

from __future__ import annotations

import triton
import triton.language as tl

LN2 = tl.constexpr(0.6931471805599453)
# Branches: one int32 row per branch, (segment length, dilation, head_lo, head_hi, offset_div, offset_base)


@triton.jit(do_not_specialize=["Sq", "H", "n_branches", "cache_len", "max_pos"])
def _decode_kernel(
    Q, K, V,
    PartStats,  # fp32 [B * H * Sq, SPLITS, 2]: each share's running max (base 2) and sum
    PartAcc,  # fp32 [B * H * Sq, SPLITS, BLOCK_D]: each share's unnormalised output
    CacheSeqlens,  # with PER_BATCH, each batch element's cached tokens (int32 or int64 [B]); else cache_len for all
    Branches,  # int32 [n_branches, BRANCH_FIELDS]
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    Sq, H, n_branches, cache_len,
    max_pos,  # the last cache row: positions are clamped to it, so that no program reads outside the cache
    qk_scale,  # scale * log2(e)
    GROUP,  # query heads per kv head
    HEAD_DIM,
    PER_BATCH: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)
    share = tl.program_id(1)
    splits = tl.num_programs(1)
    i = pid % Sq
    h = (pid // Sq) % H
    b = (pid // (Sq * H)).to(tl.int64)
    kvh = h // GROUP
    cached = cache_len
    if PER_BATCH:
        cached = tl.load(CacheSeqlens + b).to(tl.int32)
    pos = tl.minimum(cached + i, max_pos)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    q = tl.load(Q + b * stride_qb + i * stride_qs + h * stride_qh + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    scale2 = tl.cast(qk_scale, tl.float32)
    m_i = tl.full([1], float("-inf"), tl.float32)
    l_i = tl.zeros([1], tl.float32)
    acc = tl.zeros([BLOCK_D], tl.float32)
    k_base = K + b * stride_kb + kvh * stride_kh
    v_base = V + b * stride_vb + kvh * stride_vh
    for br in range(n_branches):
        w = tl.load(Branches + br * 6)
        r = tl.load(Branches + br * 6 + 1)
        head_lo = tl.load(Branches + br * 6 + 2)
        head_hi = tl.load(Branches + br * 6 + 3)
        offset = tl.load(Branches + br * 6 + 5) + (h - head_lo) // tl.load(Branches + br * 6 + 4)
        start = pos // w * w
        if (h >= head_lo) & (h < head_hi) & ((pos - start) % r == offset):
            n_keys = (pos - start - offset) // r + 1  # the members t <= pos: start + offset + j * r
            for j0 in range(share * BLOCK_N, n_keys, splits * BLOCK_N):
                offs_n = j0 + tl.arange(0, BLOCK_N)
                n_mask = offs_n < n_keys
                rows = (start + offset + offs_n * r).to(tl.int64)
                kv_mask = n_mask[:, None] & d_mask[None, :]
                k = tl.load(k_base + rows[:, None] * stride_kn + offs_d[None, :], mask=kv_mask, other=0.0)
                s = tl.sum(q[None, :] * k.to(tl.float32), 1) * scale2
                s = tl.where(n_mask, s, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, 0))  # finite: a block has at least one key
                alpha = tl.math.exp2(m_i - m_new)
                p = tl.math.exp2(s - m_new)
                v = tl.load(v_base + rows[:, None] * stride_vn + offs_d[None, :], mask=kv_mask, other=0.0)
                acc = acc * alpha + tl.sum(p[:, None] * v.to(tl.float32), 0)
                l_i = l_i * alpha + tl.sum(p, 0)
                m_i = m_new
    part = pid.to(tl.int64) * splits + share
    tl.store(PartStats + part * 2 + tl.arange(0, 1), m_i)
    tl.store(PartStats + part * 2 + 1 + tl.arange(0, 1), l_i)
    tl.store(PartAcc + part * BLOCK_D + offs_d, acc)


@triton.jit(do_not_specialize=["Sq", "H", "HEAD_DIM"])
def _decode_combine_kernel(
    PartStats, PartAcc, Out, Lse,
    stride_ob, stride_os, stride_oh,
    Sq, H, HEAD_DIM,
    SPLITS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One new query's shares merged (dilated_attn/merge.py's formula over SPLITS terms): out and lse."""
    pid = tl.program_id(0)
    i = pid % Sq
    h = (pid // Sq) % H
    b = (pid // (Sq * H)).to(tl.int64)
    parts = pid.to(tl.int64) * SPLITS + tl.arange(0, SPLITS)
    m = tl.load(PartStats + parts * 2)
    l_sum = tl.load(PartStats + parts * 2 + 1)
    has_keys = l_sum > 0  # a share without keys has max -inf: weight 0, and no -inf - -inf
    top = tl.max(tl.where(has_keys, m, float("-inf")), 0)
    top = tl.where(top == float("-inf"), 0.0, top)
    weight = tl.where(has_keys, tl.math.exp2(tl.where(has_keys, m, top) - top), 0.0)
    total = tl.sum(l_sum * weight, 0)
    offs_d = tl.arange(0, BLOCK_D)
    acc = tl.load(PartAcc + parts[:, None] * BLOCK_D + offs_d[None, :])
    out = tl.sum(acc * weight[:, None], 0)
    covered = total > 0
    out = tl.where(covered, out / tl.where(covered, total, 1.0), 0.0)
    lse = tl.where(covered, (top + tl.log2(tl.where(covered, total, 1.0))) * LN2, float("-inf"))
    tl.store(Out + b * stride_ob + i * stride_os + h * stride_oh + offs_d, out.to(Out.dtype.element_ty),
             mask=offs_d < HEAD_DIM)
    tl.store(Lse + pid, lse)
