"""The decode kernel: new queries over a KV cache, every branch in one launch (dilated_attention_with_kvcache).

A program owns the query heads of one kv head for one new token i of batch element b, at position
P = cache_seqlens[b] + i, and one of SPLITS interleaved shares of their key blocks (one token's queries alone would
leave most of the GPU idle). For
each branch it takes part in, P's segment starts at (P // w) * w (clipping a segment to the sequence never moves
a causal row's keys: docs/SPEC.md, "Decoding with a KV cache"); P is a member iff its offset in the segment is
the head's offset modulo r, and then its keys are the members up to P, every r-th row from the segment's start
plus the offset. All branches' keys feed one online softmax, which is the merge of the branches (one softmax over
the union of their keys). The heads of a kv head with the same offset in a branch read the same rows: a pass per
distinct offset reads them once for all those heads, as one [heads, keys] matrix product. Each share's partial
softmax (max, sum, unnormalised output) per head goes to a scratch buffer, and `_decode_combine_kernel` merges the
shares. The kernels are bound by reading the keys and values.
"""

from __future__ import annotations

import triton
import triton.language as tl

LN2 = tl.constexpr(0.6931471805599453)
# Branches: one int32 row per branch, (segment length, dilation, head_lo, head_hi, offset_div, offset_base)


@triton.jit(do_not_specialize=["Sq", "H", "n_branches", "cache_len", "max_pos", "GROUP"])
def _decode_kernel(
    Q, K, V,
    PartStats,  # fp32 [B * H * Sq, SPLITS, 2]: each share's running max (base 2) and sum
    PartAcc,  # fp32 [B * H * Sq, SPLITS, BLOCK_D]: each share's unnormalised output
    CacheSeqlens,  # with PER_BATCH, each batch element's cached tokens (int32 or int64 [B]); else cache_len for all
    Branches,  # int32 [n_branches, 6]
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    Sq, H, n_branches, cache_len,
    max_pos,  # the last cache row: positions are clamped to it, so that no program reads outside the cache
    qk_scale,  # scale * log2(e)
    GROUP,  # query heads per kv head
    HEAD_DIM,
    PER_BATCH: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_G: tl.constexpr,  # GROUP rounded up to a power of two, at least 16 (a matrix product's rows)
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)  # (batch element, kv head, new token)
    share = tl.program_id(1)
    splits = tl.num_programs(1)
    H_KV = H // GROUP
    i = pid % Sq
    kvh = (pid // Sq) % H_KV
    b = (pid // (Sq * H_KV)).to(tl.int64)
    cached = cache_len
    if PER_BATCH:
        cached = tl.load(CacheSeqlens + b).to(tl.int32)
    pos = tl.minimum(cached + i, max_pos)
    offs_g = tl.arange(0, BLOCK_G)
    heads = kvh * GROUP + offs_g  # the query heads of this kv head (rows past GROUP are padding)
    g_mask = offs_g < GROUP
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    q = tl.load(Q + b * stride_qb + i * stride_qs + heads[:, None] * stride_qh + offs_d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    scale2 = tl.cast(qk_scale, tl.float32)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    k_base = K + b * stride_kb + kvh * stride_kh
    v_base = V + b * stride_vb + kvh * stride_vh
    for br in range(n_branches):
        w = tl.load(Branches + br * 6)
        r = tl.load(Branches + br * 6 + 1)
        head_lo = tl.load(Branches + br * 6 + 2)
        head_hi = tl.load(Branches + br * 6 + 3)
        offset_div = tl.load(Branches + br * 6 + 4)
        offset_base = tl.load(Branches + br * 6 + 5)
        start = pos // w * w
        offsets = offset_base + (heads - head_lo) // offset_div
        member = g_mask & (heads >= head_lo) & (heads < head_hi) & ((pos - start) % r == offsets)
        # One pass per distinct offset among the member heads (offsets grow with the head): the heads of a pass
        # share its rows, which are read once for all of them.
        for g0 in range(0, GROUP):
            h0 = kvh * GROUP + g0
            offset = offset_base + (h0 - head_lo) // offset_div
            previous = offset_base + (h0 - 1 - head_lo) // offset_div  # the offset of the head before
            first_of_offset = (g0 == 0) | (h0 - 1 < head_lo) | (previous != offset)
            if (h0 >= head_lo) & (h0 < head_hi) & ((pos - start) % r == offset) & first_of_offset:
                in_pass = member & (offsets == offset)
                n_keys = (pos - start - offset) // r + 1  # the members t <= pos: start + offset + j * r
                for j0 in range(share * BLOCK_N, n_keys, splits * BLOCK_N):
                    offs_n = j0 + tl.arange(0, BLOCK_N)
                    n_mask = offs_n < n_keys
                    rows = (start + offset + offs_n * r).to(tl.int64)
                    kv_mask = n_mask[:, None] & d_mask[None, :]
                    k = tl.load(k_base + rows[:, None] * stride_kn + offs_d[None, :], mask=kv_mask, other=0.0)
                    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale2
                    s = tl.where(in_pass[:, None] & n_mask[None, :], s, float("-inf"))
                    m_new = tl.maximum(m_i, tl.max(s, 1))
                    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # heads not in the pass keep their state
                    alpha = tl.math.exp2(tl.where(m_i == float("-inf"), float("-inf"), m_i - m_safe))
                    p = tl.math.exp2(s - m_safe[:, None])  # exp2(-inf) = 0 outside the pass and the keys
                    v = tl.load(v_base + rows[:, None] * stride_vn + offs_d[None, :], mask=kv_mask, other=0.0)
                    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
                    l_i = l_i * alpha + tl.sum(p, 1)
                    m_i = m_new
    part = ((b * H + heads) * Sq + i) * splits + share  # the combine's (batch, query head, token) order
    tl.store(PartStats + part * 2, m_i, mask=g_mask)
    tl.store(PartStats + part * 2 + 1, l_i, mask=g_mask)
    tl.store(PartAcc + part[:, None] * BLOCK_D + offs_d[None, :], acc, mask=g_mask[:, None])


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
