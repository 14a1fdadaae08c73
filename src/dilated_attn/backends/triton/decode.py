"""The decode kernel: new queries over a KV cache, every branch in one launch (dilated_attention_with_kvcache).

New token i of batch element b sits at position P = cache_seqlens[b] + i. For each branch a query head takes part
in, P's segment starts at (P // w) * w (clipping a segment to the sequence never moves a causal row's keys:
docs/SPEC.md, "Decoding with a KV cache"); P is a member iff its offset in the segment is the head's offset modulo
r, and then its keys are the members up to P, every r-th row from the segment's start plus the offset: in each
branch only the heads of one offset attend, and those of a kv head read the same rows, so one pass per (kv head,
branch) reads them once for all its heads, as one [heads, keys] matrix product, and all of a head's passes feed one
online softmax, which is the merge of the branches (one softmax over the union of their keys).

One token's passes differ in length from kv head to kv head (a head's offset decides which dilated branches it
takes part in), so the work is cut by keys, not by heads: the passes of all kv heads, one after the other, make one
list of keys, and each of SPLITS programs of a (b, i) takes an equal share of it (one token's queries alone would
leave most of the GPU idle, and the slowest program sets the time). Each share's partial softmax (max, sum,
unnormalised output) per query head goes to a scratch buffer, and `_decode_combine_kernel` merges the shares. The
kernels are bound by reading the keys and values.
"""

from __future__ import annotations

import triton
import triton.language as tl

LN2 = tl.constexpr(0.6931471805599453)
# Branches: one int32 row per branch, (segment length, dilation, head_lo, head_hi, offset_div, offset_base)


@triton.jit
def _branch_keys(Branches, br, pos):
    """The keys of branch `br` for the token at `pos`: (the first key row, the dilation, the key count, the query
    heads [head_a, head_b) that attend to them). Those heads are the ones whose offset is pos's offset in its
    segment modulo r (offsets grow with the head, so they are a range); the count is 0 where there are none."""
    w = tl.load(Branches + br * 6)
    r = tl.load(Branches + br * 6 + 1)
    head_lo = tl.load(Branches + br * 6 + 2)
    head_hi = tl.load(Branches + br * 6 + 3)
    offset_div = tl.load(Branches + br * 6 + 4)
    offset_base = tl.load(Branches + br * 6 + 5)
    start = pos // w * w
    offset = (pos - start) % r
    head_a = head_lo + (offset - offset_base) * offset_div
    head_b = tl.minimum(head_a + offset_div, head_hi)
    n_keys = tl.where((offset >= offset_base) & (head_a < head_b), (pos - start) // r + 1, 0)  # members t <= pos
    return start + offset, r, n_keys, head_a, head_b


@triton.jit
def _kv_head_keys(n_keys, head_a, head_b, kvh, GROUP):
    """A branch's key count for kv head `kvh`: n_keys where one of its query heads is among [head_a, head_b)."""
    return tl.where((kvh * GROUP < head_b) & (kvh * GROUP + GROUP > head_a), n_keys, 0)


@triton.jit(do_not_specialize=["Sq", "H", "n_branches", "cache_len", "max_pos", "GROUP"])
def _decode_kernel(
    Q, K, V,
    PartStats,  # fp32 [B * H * Sq, SPLITS, 2]: each share's running max (base 2) and sum
    PartAcc,  # fp32 [B * H * Sq, SPLITS, BLOCK_D]: each share's unnormalised output (written where its sum > 0)
    CacheSeqlens,  # with PER_BATCH, each batch element's cached tokens (int32 or int64 [B]); else cache_len for all
    Branches,  # int32 [n_branches, 6]
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    Sq, H, n_branches, cache_len,
    max_pos,  # the last cache row: positions are clamped to [0, max_pos], so no program reads outside the cache
    qk_scale,  # scale * log2(e)
    GROUP,  # query heads per kv head
    HEAD_DIM,
    PER_BATCH: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_G: tl.constexpr,  # GROUP rounded up to a power of two, at least 16 (a matrix product's rows)
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)  # (batch element, new token)
    share = tl.program_id(1)
    splits = tl.num_programs(1)
    H_KV = H // GROUP
    i = pid % Sq
    b = (pid // Sq).to(tl.int64)
    cached = cache_len
    if PER_BATCH:
        cached = tl.load(CacheSeqlens + b).to(tl.int32)
    pos = tl.maximum(tl.minimum(cached + i, max_pos), 0)  # lengths not checked on the host may be out of range
    offs_g = tl.arange(0, BLOCK_G)
    g_mask = offs_g < GROUP
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    # The passes of every kv head, one after the other, make one list of keys; this share takes an equal part
    total = 0
    for br in range(n_branches):
        _, _, n_keys, head_a, head_b = _branch_keys(Branches, br, pos)
        total += n_keys * ((head_b - 1) // GROUP - head_a // GROUP + 1)  # a pass per kv head of those heads
    lo = share * (total // splits) + tl.minimum(share, total % splits)
    hi = lo + total // splits + (share < total % splits).to(tl.int32)
    scale2 = tl.cast(qk_scale, tl.float32)
    before = 0  # the keys of the passes of the kv heads before this one
    for kvh in range(H_KV):
        heads = kvh * GROUP + offs_g  # the query heads of this kv head (rows past GROUP are padding)
        kvh_keys = 0
        for br in range(n_branches):
            _, _, n_keys, head_a, head_b = _branch_keys(Branches, br, pos)
            kvh_keys += _kv_head_keys(n_keys, head_a, head_b, kvh, GROUP)
        part = ((b * H + heads) * Sq + i) * splits + share  # the combine's (batch, query head, token) order
        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        if (before < hi) & (before + kvh_keys > lo):  # this share has keys of this kv head
            q = tl.load(Q + b * stride_qb + i * stride_qs + heads[:, None] * stride_qh + offs_d[None, :],
                        mask=g_mask[:, None] & d_mask[None, :], other=0.0)
            acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
            k_base = K + b * stride_kb + kvh * stride_kh
            v_base = V + b * stride_vb + kvh * stride_vh
            pass_start = before
            for br in range(n_branches):
                first, r, n_keys, head_a, head_b = _branch_keys(Branches, br, pos)
                in_pass = g_mask & (heads >= head_a) & (heads < head_b)
                n_keys = _kv_head_keys(n_keys, head_a, head_b, kvh, GROUP)
                j_lo = tl.maximum(lo - pass_start, 0)
                j_hi = tl.minimum(hi - pass_start, n_keys)
                if j_lo < j_hi:
                    for j0 in range(j_lo, j_hi, BLOCK_N):
                        offs_n = j0 + tl.arange(0, BLOCK_N)
                        n_mask = offs_n < j_hi
                        rows = (first + offs_n * r).to(tl.int64)
                        kv_mask = n_mask[:, None] & d_mask[None, :]
                        k = tl.load(k_base + rows[:, None] * stride_kn + offs_d[None, :], mask=kv_mask, other=0.0)
                        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale2
                        s = tl.where(in_pass[:, None] & n_mask[None, :], s, float("-inf"))
                        m_new = tl.maximum(m_i, tl.max(s, 1))
                        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # heads not in the pass keep theirs
                        alpha = tl.math.exp2(tl.where(m_i == float("-inf"), float("-inf"), m_i - m_safe))
                        p = tl.math.exp2(s - m_safe[:, None])  # exp2(-inf) = 0 outside the pass and the keys
                        v = tl.load(v_base + rows[:, None] * stride_vn + offs_d[None, :], mask=kv_mask, other=0.0)
                        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
                        l_i = l_i * alpha + tl.sum(p, 1)
                        m_i = m_new
                pass_start += n_keys
            tl.store(PartAcc + part[:, None] * BLOCK_D + offs_d[None, :], acc, mask=(g_mask & (l_i > 0))[:, None])
        before += kvh_keys
        tl.store(PartStats + part * 2, m_i, mask=g_mask)
        tl.store(PartStats + part * 2 + 1, l_i, mask=g_mask)


@triton.jit(do_not_specialize=["Sq", "H", "HEAD_DIM"])
def _decode_combine_kernel(
    PartStats, PartAcc, Out, Lse,
    stride_ob, stride_os, stride_oh,
    Sq, H, HEAD_DIM,
    SPLITS: tl.constexpr,
    CHUNK: tl.constexpr,  # shares read at a time (a power of two dividing SPLITS)
    BLOCK_D: tl.constexpr,
):
    """One new query's shares merged (dilated_attn/merge.py's formula over SPLITS terms): out and lse. A share
    without keys (sum 0) has weight 0, and its output was not written."""
    pid = tl.program_id(0)
    i = pid % Sq
    h = (pid // Sq) % H
    b = (pid // (Sq * H)).to(tl.int64)
    parts = pid.to(tl.int64) * SPLITS + tl.arange(0, SPLITS)
    m = tl.load(PartStats + parts * 2)
    l_sum = tl.load(PartStats + parts * 2 + 1)
    has_keys = l_sum > 0
    top = tl.max(tl.where(has_keys, m, float("-inf")), 0)
    top = tl.where(top == float("-inf"), 0.0, top)
    total = tl.sum(tl.where(has_keys, l_sum * tl.math.exp2(tl.where(has_keys, m, top) - top), 0.0), 0)
    offs_d = tl.arange(0, BLOCK_D)
    out = tl.zeros([BLOCK_D], tl.float32)
    for c in range(0, SPLITS, CHUNK):
        chunk = pid.to(tl.int64) * SPLITS + c + tl.arange(0, CHUNK)
        m_c = tl.load(PartStats + chunk * 2)
        keys_c = tl.load(PartStats + chunk * 2 + 1) > 0
        weight = tl.where(keys_c, tl.math.exp2(tl.where(keys_c, m_c, top) - top), 0.0)
        acc = tl.load(PartAcc + chunk[:, None] * BLOCK_D + offs_d[None, :], mask=keys_c[:, None], other=0.0)
        out += tl.sum(acc * weight[:, None], 0)
    covered = total > 0
    out = tl.where(covered, out / tl.where(covered, total, 1.0), 0.0)
    lse = tl.where(covered, (top + tl.log2(tl.where(covered, total, 1.0))) * LN2, float("-inf"))
    tl.store(Out + b * stride_ob + i * stride_os + h * stride_oh + offs_d, out.to(Out.dtype.element_ty),
             mask=offs_d < HEAD_DIM)
    tl.store(Lse + pid, lse)


@triton.jit
def _copy_row(New, Cache, b, i, row, stride_nb, stride_ns, stride_nh, stride_nd, stride_cb, stride_cn, stride_ch,
              stride_cd, mask, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    x = tl.load(New + b * stride_nb + i * stride_ns + offs_h[:, None] * stride_nh + offs_d[None, :] * stride_nd,
                mask=mask)
    tl.store(Cache + b * stride_cb + row.to(tl.int64) * stride_cn + offs_h[:, None] * stride_ch
             + offs_d[None, :] * stride_cd, x, mask=mask)


@triton.jit(do_not_specialize=["Sq", "cache_len", "max_row", "H_KV", "HEAD_DIM"])
def _append_kernel(
    K, V,  # the new rows, [B, Sq, Hkv, D] ...
    KCache, VCache,  # ... written to [B, Nmax, Hkv, D] at rows cache_seqlens[b] + i
    CacheSeqlens,  # as in _decode_kernel
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_kcb, stride_kcn, stride_kch, stride_kcd,
    stride_vcb, stride_vcn, stride_vch, stride_vcd,
    Sq, cache_len,
    max_row,  # the last cache row: a new row past it (or before row 0) is not written
    H_KV, HEAD_DIM,
    PER_BATCH: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """dilated_attention_with_kvcache's write of the new k and v into the caches: a program per new row of each."""
    pid = tl.program_id(0)  # (batch element, new token)
    i = pid % Sq
    b = (pid // Sq).to(tl.int64)
    cached = cache_len
    if PER_BATCH:
        cached = tl.load(CacheSeqlens + b).to(tl.int32)
    row = cached + i
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < H_KV) & (offs_d[None, :] < HEAD_DIM) & (row >= 0) & (row <= max_row)
    if tl.program_id(1) == 0:
        _copy_row(K, KCache, b, i, row, stride_kb, stride_ks, stride_kh, stride_kd, stride_kcb, stride_kcn,
                  stride_kch, stride_kcd, mask, BLOCK_H, BLOCK_D)
    else:
        _copy_row(V, VCache, b, i, row, stride_vb, stride_vs, stride_vh, stride_vd, stride_vcb, stride_vcn,
                  stride_vch, stride_vcd, mask, BLOCK_H, BLOCK_D)
