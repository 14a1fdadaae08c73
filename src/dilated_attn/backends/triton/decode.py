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
once, with each row's multiplicity per head, read a quarter fewer bytes at N = 65536 but ran slower on an H200
(benchmarks/README.md, "Decoding").

One token's passes differ in length from kv head to kv head, so the work is cut by keys, not by heads: the passes of
all kv heads, one after the other, make one list of keys, and each of SPLITS programs of a (b, i) takes an equal
share of it. Each share writes its partial softmax (max, sum, unnormalised output) per query head to a workspace and
counts itself done on its kv head's counter; the last share of a kv head to finish merges that kv head's shares into
the output and sets the counter back to 0 (so the counters are 0 between launches).

With APPEND the new rows k, v are written into the caches (by each token's first share), and every program reads
rows at or past cache_seqlens[b] from k, v themselves (a pass's keys before them from the caches, then its new keys),
so no program waits for the write.
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
def _members_before(row, first, r):
    """How many of the members first, first + r, ... lie before `row` (0 where `row` <= first)."""
    return tl.maximum((row - first + r - 1) // r, 0)


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
            l_i = tl.zeros([BLOCK_G, BLOCK_N], tl.float32)  # the sums by key column, added up at the end
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
                old_hi = j_hi  # the share's keys before the new rows: read from the caches
                if APPEND:
                    n_old = _members_before(cached, first_j, r_j)
                    old_hi = tl.minimum(j_hi, n_old)
                first_row = (first_j + j_lo * r_j).to(tl.int64)
                # a pass without keys in this share is skipped: its pipelined loop's prologue and epilogue would still
                # run (6% of the instructions at B=16, a 64K cache)
                if old_hi > j_lo:
                    m_i, l_i, acc = _attend(q, k_base + first_row * stride_kn, v_base + first_row * stride_vn,
                                            r_j * stride_kn, r_j * stride_vn, stride_kd, stride_vd, old_hi - j_lo,
                                            in_pass, m_i, l_i, acc, scale2, HEAD_DIM, PRECISION, BLOCK_D, BLOCK_N)
                if APPEND:  # the new rows, from k and v themselves (their write into the caches may not have landed)
                    new_lo = tl.maximum(j_lo, n_old)
                    # the members before row cached + Sq: past them only where lengths below 0 clamped P up to row
                    # 0, and those rows are not read (no index in k, v)
                    new_hi = tl.minimum(j_hi, _members_before(cached + Sq, first_j, r_j))
                    first_new = (first_j + new_lo * r_j - cached).to(tl.int64)  # its index in k, v
                    if new_hi > new_lo:
                        m_i, l_i, acc = _attend(q, KNew + b * stride_nkb + kvh * stride_nkh + first_new * stride_nks,
                                                VNew + b * stride_nvb + kvh * stride_nvh + first_new * stride_nvs,
                                                r_j * stride_nks, r_j * stride_nvs, stride_nkd, stride_nvd,
                                                new_hi - new_lo, in_pass, m_i, l_i, acc, scale2, HEAD_DIM, PRECISION,
                                                BLOCK_D, BLOCK_N)
                pass_start += n_keys
            part = (pid.to(tl.int64) * splits + share) * H + heads
            tl.store(PartStats + part * 2, m_i, mask=g_mask)
            l_i = tl.sum(l_i, 1)
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
def _attend(q, k_first, v_first, k_step, v_step, stride_kd, stride_vd, count, in_pass, m_i, l_i, acc, scale2,
            HEAD_DIM: tl.constexpr, PRECISION: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):
    """The online softmax (m_i, l_i by key column, acc) of q's heads in `in_pass` carried over `count` keys, the
    rows k_first + n * k_step (v likewise). The rows' addresses are carried from block to block (one step per block,
    not a product per row), and a pass reads one tensor (the caches, or the new rows): a block takes 40% fewer
    instructions than with each row's address computed and chosen between the two."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    k_rows = k_first + offs_n[:, None] * k_step + offs_d[None, :] * stride_kd
    v_rows = v_first + offs_n[:, None] * v_step + offs_d[None, :] * stride_vd
    for j0 in range(0, count, BLOCK_N):
        read = offs_n < count - j0
        if HEAD_DIM == BLOCK_D:
            kv_mask = read[:, None]
        else:
            kv_mask = read[:, None] & (offs_d < HEAD_DIM)[None, :]
        k = tl.load(k_rows, mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale2
        s = tl.where(in_pass[:, None] & read[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # heads without keys keep theirs
        alpha = tl.math.exp2(tl.where(m_i == float("-inf"), float("-inf"), m_i - m_safe))
        p = tl.math.exp2(s - m_safe[:, None])  # exp2(-inf) = 0 outside the pass and the keys
        v = tl.load(v_rows, mask=kv_mask, other=0.0)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
        l_i = l_i * alpha[:, None] + p  # summed over the keys once, after the passes: no reduction per block
        m_i = m_new
        k_rows += BLOCK_N * k_step
        v_rows += BLOCK_N * v_step
    return m_i, l_i, acc


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
