"""The decode kernel: new queries over a KV cache, with the new rows' write, every branch and the merge of the
programs' shares in one launch (dilated_attention_with_kvcache).

New token i of batch element b sits at position P = cache_seqlens[b] + i. For each branch a query head takes part
in, P's segment starts at (P // w) * w (clipping a segment to the sequence never moves a causal row's keys:
docs/SPEC.md, "Decoding with a KV cache"); P is a member iff its offset in the segment is the head's offset modulo
r, and then its keys are the members up to P, every r-th row from the segment's start plus the offset. In each
branch only the heads of one offset attend, and those of a kv head read the same rows, so one pass per
(kv head, branch) reads them once for all its heads, as one [heads, keys] matrix product, and all of a head's passes
feed one online softmax, which is the merge of the branches (one softmax over the union of their keys, a key in two
branches counted twice). A row two branches share is read by both passes: reading each kv head's union of rows
once, with each row's multiplicity per head, read a quarter fewer bytes at N = 65536 but ran slower on an H200 (the
kernel is bound by its work per row there; benchmarks/README.md, "Decoding").

One token's passes differ in length from kv head to kv head, so the work is cut by keys, not by heads: the passes of
all kv heads, one after the other, make one list of keys, and each of SPLITS programs of a (b, i) takes an equal
share of it. Each share writes its partial softmax (max, sum, unnormalised output) per query head to a workspace and
counts itself done on its kv head's counter; the last share of a kv head to finish merges that kv head's shares into
the output and sets the counter back to 0 (so the counters are 0 between launches).

With APPEND the new rows k, v are written into the caches (by each token's first share), and every program reads
rows at or past cache_seqlens[b] from k, v themselves, so no program waits for the write.
"""

from __future__ import annotations

import triton
import triton.language as tl

LN2 = tl.constexpr(0.6931471805599453)
# Branches: one int32 row per branch, (segment length, dilation, head_lo, head_hi, offset_div, offset_base)


@triton.jit
def _branch(Branches, e, n_branches, pos):
    """Branch e's (a scalar, or a vector of branches) first member row of P's segment (first), its dilation (r),
    whether P is a member for some heads (member), and those query heads [head_a, head_b): the ones whose offset is
    P's offset in its segment modulo r (offsets grow with the head, so they are a range). Branches past n_branches
    are no member."""
    valid = e < n_branches
    w = tl.load(Branches + e * 6, mask=valid, other=1)
    r = tl.load(Branches + e * 6 + 1, mask=valid, other=1)
    head_lo = tl.load(Branches + e * 6 + 2, mask=valid, other=0)
    head_hi = tl.load(Branches + e * 6 + 3, mask=valid, other=0)
    offset_div = tl.load(Branches + e * 6 + 4, mask=valid, other=1)
    offset_base = tl.load(Branches + e * 6 + 5, mask=valid, other=0)
    start = pos // w * w
    offset = (pos - start) % r
    head_a = head_lo + (offset - offset_base) * offset_div
    head_b = tl.minimum(head_a + offset_div, head_hi)
    member = valid & (offset >= offset_base) & (head_a < head_b)
    return start + offset, r, member, head_a, head_b


@triton.jit
def _passes(first, r, member, head_a, head_b, kvh, pos, GROUP):
    """Kv head kvh's passes: each branch's keys, the members from first[j] by r[j] up to P (0 where none of its
    heads takes part)."""
    takes = member & (kvh * GROUP < head_b) & (kvh * GROUP + GROUP > head_a)
    return tl.where(takes, (pos - first) // r + 1, 0)


@triton.jit
def _pick(x, nb, j):
    """x[j] of a per-branch vector."""
    return tl.sum(tl.where(nb == j, x, 0), axis=0)


@triton.jit
def _share_of(x, total, splits):
    """The share holding position x of a token's list of `total` keys (share s holds total // splits keys, one
    more for the first total % splits)."""
    size = total // splits
    big = total % splits * (size + 1)
    return tl.where(x < big, x // (size + 1), total % splits + (x - big) // tl.maximum(size, 1))


@triton.jit
def _copy_row(New, Cache, b, i, row, stride_nb, stride_ns, stride_nh, stride_nd, stride_cb, stride_cn, stride_ch,
              stride_cd, H_KV, HEAD_DIM, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < H_KV) & (offs_d[None, :] < HEAD_DIM)
    x = tl.load(New + b * stride_nb + i * stride_ns + offs_h[:, None] * stride_nh + offs_d[None, :] * stride_nd,
                mask=mask)
    tl.store(Cache + b * stride_cb + row.to(tl.int64) * stride_cn + offs_h[:, None] * stride_ch
             + offs_d[None, :] * stride_cd, x, mask=mask)


@triton.jit(do_not_specialize=["cache_len", "Sq", "H", "n_branches", "max_pos", "GROUP"])
def _decode_kernel(
    Q, K, V,  # q [B, Sq, H, D]; the caches [B, Nmax, H_KV, D]
    KNew, VNew,  # with APPEND, the new rows [B, Sq, H_KV, D], written into the caches at rows cache_seqlens[b] + i
    Out, Lse,  # out like q; lse fp32 [B, H, Sq]
    PartStats,  # fp32 [B * Sq, SPLITS, H, 2]: each share's running max (base 2) and sum
    PartAcc,  # fp32 [B * Sq, SPLITS, H, BLOCK_D]: each share's unnormalised output (written where its sum > 0)
    Counters,  # int32 [B * Sq, H_KV], 0 at the start: shares done per (token, kv head)
    CacheSeqlens,  # with PER_BATCH, each batch element's cached tokens (int32 or int64 [B]); else cache_len for all
    Branches,  # int32 [n_branches, 6]
    cache_len,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_kn, stride_kh, stride_kd,
    stride_vb, stride_vn, stride_vh, stride_vd,
    stride_nkb, stride_nks, stride_nkh, stride_nkd,
    stride_nvb, stride_nvs, stride_nvh, stride_nvd,
    stride_ob, stride_os, stride_oh,
    Sq, H, n_branches,
    max_pos,  # the last cache row: positions are clamped to [0, max_pos], so no program reads outside the cache
    qk_scale,  # scale * log2(e)
    GROUP,  # query heads per kv head
    HEAD_DIM: tl.constexpr,
    PER_BATCH: tl.constexpr,
    APPEND: tl.constexpr,
    PRECISION: tl.constexpr,
    NB: tl.constexpr,  # n_branches rounded up to a power of two
    BLOCK_G: tl.constexpr,  # GROUP rounded up to a power of two, at least 16 (a matrix product's rows)
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_H: tl.constexpr,  # H_KV rounded up to a power of two (the write of a new row)
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
    if APPEND:
        row = cached + i
        if (share == 0) & (row >= 0) & (row <= max_pos):  # a row outside the cache is not written
            _copy_row(KNew, K, b, i, row, stride_nkb, stride_nks, stride_nkh, stride_nkd, stride_kb, stride_kn,
                      stride_kh, stride_kd, H_KV, HEAD_DIM, BLOCK_H, BLOCK_D)
            _copy_row(VNew, V, b, i, row, stride_nvb, stride_nvs, stride_nvh, stride_nvd, stride_vb, stride_vn,
                      stride_vh, stride_vd, H_KV, HEAD_DIM, BLOCK_H, BLOCK_D)
    pos = tl.maximum(tl.minimum(cached + i, max_pos), 0)  # lengths not checked on the host may be out of range
    nb = tl.arange(0, NB)
    first, r, member, head_a, head_b = _branch(Branches, nb, n_branches, pos)  # every branch's, as vectors
    offs_g = tl.arange(0, BLOCK_G)
    g_mask = offs_g < GROUP
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    # The passes of every kv head, one after the other, make one list of keys; this share takes an equal part
    total = 0
    for kvh in range(H_KV):
        total += tl.sum(_passes(first, r, member, head_a, head_b, kvh, pos, GROUP), axis=0)
    lo = share * (total // splits) + tl.minimum(share, total % splits)
    hi = lo + total // splits + (share < total % splits).to(tl.int32)
    scale2 = tl.cast(qk_scale, tl.float32)
    before = 0  # the keys of the passes of the kv heads before this one
    for kvh in range(H_KV):
        keys = _passes(first, r, member, head_a, head_b, kvh, pos, GROUP)
        kvh_keys = tl.sum(keys, axis=0)
        heads = kvh * GROUP + offs_g  # the query heads of this kv head (rows past GROUP are padding)
        if (before < hi) & (before + kvh_keys > lo):  # this share has keys of this kv head
            q = tl.load(Q + b * stride_qb + i * stride_qs + heads[:, None] * stride_qh + offs_d[None, :],
                        mask=g_mask[:, None] & d_mask[None, :], other=0.0)
            m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
            l_i = tl.zeros([BLOCK_G], tl.float32)
            acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
            k_base = K + b * stride_kb + kvh * stride_kh
            v_base = V + b * stride_vb + kvh * stride_vh
            pass_start = before
            for j in range(n_branches):
                n_keys = _pick(keys, nb, j)
                first_j, r_j, _, head_a_j, head_b_j = _branch(Branches, j, n_branches, pos)
                in_pass = g_mask & (heads >= head_a_j) & (heads < head_b_j)
                j_lo = tl.maximum(lo - pass_start, 0)
                j_hi = tl.minimum(hi - pass_start, n_keys)
                for j0 in range(j_lo, j_hi, BLOCK_N):
                    offs_n = j0 + tl.arange(0, BLOCK_N)
                    rows = first_j + offs_n * r_j
                    read = offs_n < j_hi
                    kv_mask = read[:, None] & d_mask[None, :]
                    k_rows = k_base + rows.to(tl.int64)[:, None] * stride_kn + offs_d[None, :] * stride_kd
                    v_rows = v_base + rows.to(tl.int64)[:, None] * stride_vn + offs_d[None, :] * stride_vd
                    if APPEND:  # a new row is read from k, v (its write into the cache may not have landed yet)
                        fresh = ((rows >= cached) & (rows - cached < Sq))[:, None]
                        new = b * stride_nkb + (rows - cached).to(tl.int64)[:, None] * stride_nks + kvh * stride_nkh
                        k_rows = tl.where(fresh, KNew + new + offs_d[None, :] * stride_nkd, k_rows)
                        new = b * stride_nvb + (rows - cached).to(tl.int64)[:, None] * stride_nvs + kvh * stride_nvh
                        v_rows = tl.where(fresh, VNew + new + offs_d[None, :] * stride_nvd, v_rows)
                    k = tl.load(k_rows, mask=kv_mask, other=0.0)
                    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale2
                    s = tl.where(in_pass[:, None] & read[None, :], s, float("-inf"))
                    m_new = tl.maximum(m_i, tl.max(s, 1))
                    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # heads without keys keep theirs
                    alpha = tl.math.exp2(tl.where(m_i == float("-inf"), float("-inf"), m_i - m_safe))
                    p = tl.math.exp2(s - m_safe[:, None])  # exp2(-inf) = 0 outside the pass and the keys
                    v = tl.load(v_rows, mask=kv_mask, other=0.0)
                    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
                    l_i = l_i * alpha + tl.sum(p, 1)
                    m_i = m_new
                pass_start += n_keys
            part = (pid.to(tl.int64) * splits + share) * H + heads
            tl.store(PartStats + part * 2, m_i, mask=g_mask)
            tl.store(PartStats + part * 2 + 1, l_i, mask=g_mask)
            tl.store(PartAcc + part[:, None] * BLOCK_D + offs_d[None, :], acc, mask=(g_mask & (l_i > 0))[:, None])
            # every thread's writes before the count: the last share to count reads them all
            tl.debug_barrier()
            first_share = _share_of(before, total, splits)
            shares = _share_of(before + kvh_keys - 1, total, splits) - first_share + 1
            counter = Counters + pid.to(tl.int64) * H_KV + kvh
            if tl.atomic_add(counter, 1, sem="acq_rel") == shares - 1:
                _merge_shares(PartStats, PartAcc, Out, Lse, pid, b, i, heads, g_mask, offs_d, d_mask, first_share,
                              shares, splits, stride_ob, stride_os, stride_oh, Sq, H, BLOCK_G, BLOCK_D)
                tl.store(counter, 0)
        elif (kvh_keys == 0) & (share == 0):  # no branch has keys for this kv head's heads: a merge of no share
            _merge_shares(PartStats, PartAcc, Out, Lse, pid, b, i, heads, g_mask, offs_d, d_mask, 0, 0, splits,
                          stride_ob, stride_os, stride_oh, Sq, H, BLOCK_G, BLOCK_D)
        before += kvh_keys


@triton.jit
def _merge_shares(PartStats, PartAcc, Out, Lse, pid, b, i, heads, g_mask, offs_d, d_mask, first_share, shares,
                  splits, stride_ob, stride_os, stride_oh, Sq, H, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr):
    """A kv head's query heads: their shares' partial softmaxes merged (dilated_attn/merge.py's formula), into out
    and lse (0 and -inf for a head without keys, and from no share at all). A share where a head has no keys (sum 0)
    has weight 0, and its output was not written. The loads go past L1 (.cg): other programs wrote the shares."""
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_sum = tl.zeros([BLOCK_G], tl.float32)
    out = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for s in range(first_share, first_share + shares):
        part = (pid.to(tl.int64) * splits + s) * H + heads
        m_s = tl.load(PartStats + part * 2, mask=g_mask, other=float("-inf"), cache_modifier=".cg")
        l_s = tl.load(PartStats + part * 2 + 1, mask=g_mask, other=0.0, cache_modifier=".cg")
        has_keys = l_s > 0
        m_new = tl.maximum(m, tl.where(has_keys, m_s, float("-inf")))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.where(m == float("-inf"), 0.0, tl.math.exp2(m - m_safe))
        weight = tl.where(has_keys, tl.math.exp2(tl.where(has_keys, m_s, 0.0) - m_safe), 0.0)
        acc = tl.load(PartAcc + part[:, None] * BLOCK_D + offs_d[None, :], mask=has_keys[:, None], other=0.0,
                      cache_modifier=".cg")
        out = out * alpha[:, None] + acc * weight[:, None]
        l_sum = l_sum * alpha + l_s * weight
        m = m_new
    covered = l_sum > 0
    out = tl.where(covered[:, None], out / tl.where(covered, l_sum, 1.0)[:, None], 0.0)
    lse = tl.where(covered, (m + tl.log2(tl.where(covered, l_sum, 1.0))) * LN2, float("-inf"))
    tl.store(Out + b * stride_ob + i * stride_os + heads[:, None] * stride_oh + offs_d[None, :],
             out.to(Out.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])
    tl.store(Lse + (b * H + heads) * Sq + i, lse, mask=g_mask)
