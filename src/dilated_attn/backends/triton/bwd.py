"""Triton backward kernels: the exact gradient of the merged function.

With the merged output O and log-sum-exp L of the forward, every key t a query p sees in any branch has
P = exp(s_pt - L(p)), and dS = P * (dP - delta) with delta(p) = rowsum(dO * O)(p) - dL(p) (dL: the
gradient reaching the returned LSE). Running each branch's flash-style backward with these merged O, L
and delta gives the gradient of the merged function, merge weights included.

- `_delta_kernel`: delta for every (batch, head, position).
- `_dkdv_kernel`: per branch, a program owns BLOCK_N members of one (batch, kv head, segment) and loops
  over the query heads of its group that take part, accumulating in fp32 and adding the sum into dK/dV.
  Positions written by two programs of one launch never coincide, so the read-add-write needs no atomics.
- `_dq_kernel`: per branch, a program owns BLOCK_M query members, like the forward, adding into dQ.

Within a branch every sum is fp32; the gradients themselves (input dtype) carry the sum across branches,
so the backward allocates nothing gradient-sized beyond the gradients (one rounding per branch in
fp16/bf16, the same as a per-branch reference summed in that dtype). When the first branch has dilation 1
and all heads, it covers every position: it stores its gradients into uninitialised ones instead of adding.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import SIZE_ARGS, members_of, segment_of, sequence_of
from .configs import Tunable

LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit(do_not_specialize=["N", "H", "HEAD_DIM"])
def _delta_kernel(
    O, dO, dLse, Delta,  # noqa: E741 - the attention output, as the kernels name their tensors
    stride_ob, stride_on, stride_oh,
    stride_db, stride_dn, stride_dh,
    N, H,
    HEAD_DIM,
    BLOCK_D: tl.constexpr,
    HAS_DLSE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    bh = tl.program_id(0)
    pid = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = bh % H
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs < N)[:, None] & (offs_d < HEAD_DIM)[None, :]
    pos = offs.to(tl.int64)
    o = tl.load(O + b * stride_ob + h * stride_oh + pos[:, None] * stride_on + offs_d[None, :], mask=mask, other=0.0)
    do = tl.load(dO + b * stride_db + h * stride_dh + pos[:, None] * stride_dn + offs_d[None, :], mask=mask,
                 other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    row = (b * H + h) * N + pos
    if HAS_DLSE:
        delta -= tl.load(dLse + row, mask=offs < N, other=0.0)
    tl.store(Delta + row, delta, mask=offs < N)


@triton.jit
def _load_rows(ptrs, rows_ok, d_mask, MASKED: tl.constexpr, EVEN_D: tl.constexpr):
    if MASKED:
        x = tl.load(ptrs, mask=rows_ok[:, None] & d_mask[None, :], other=0.0)
    elif EVEN_D:
        x = tl.load(ptrs)
    else:
        x = tl.load(ptrs, mask=d_mask[None, :], other=0.0)
    return x


@triton.jit
def _dkdv_blocks(dkT, dvT, k, v, q_base, do_base, lse_row, delta_row, stride_qn, stride_don, first, dilation, offs_n,
                 offs_d, d_mask, n, qk_scale, lo, hi, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
                 EVEN_D: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr):
    """dK/dV contributions of the query blocks [lo, hi); MASKED: queries >= n and (causal) queries before a
    key are masked, else every query of every block sees every key of the program."""
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        m_ok = offs_m < n
        pos_m = (first + offs_m * dilation).to(tl.int64)
        q = _load_rows(q_base + pos_m[:, None] * stride_qn + offs_d[None, :], m_ok, d_mask, MASKED, EVEN_D)
        do = _load_rows(do_base + pos_m[:, None] * stride_don + offs_d[None, :], m_ok, d_mask, MASKED, EVEN_D)
        if MASKED:
            lse2 = tl.load(lse_row + pos_m, mask=m_ok, other=0.0) * LOG2E
            delta = tl.load(delta_row + pos_m, mask=m_ok, other=0.0)
        else:
            lse2 = tl.load(lse_row + pos_m) * LOG2E
            delta = tl.load(delta_row + pos_m)
        # Keys along the columns: K and V enter the products only as the B operand, which the tensor cores read
        # from shared memory, not as a register-held A operand beside the dK/dV accumulators (held transposed,
        # [BLOCK_D, BLOCK_N]); faster at head dim 128 on Hopper.
        qk = (tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale).to(tl.float32)  # [BLOCK_M, BLOCK_N]
        p = tl.math.exp2(qk - lse2[:, None])
        if MASKED:
            valid = m_ok[:, None]
            if CAUSAL:
                valid = valid & (offs_m[:, None] >= offs_n[None, :])
            p = tl.where(valid, p, 0.0)
        dvT = tl.dot(tl.trans(do), p.to(do.dtype), dvT, input_precision=PRECISION)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        ds = p * (dp - delta[:, None])
        dkT = tl.dot(tl.trans(q), ds.to(q.dtype), dkT, input_precision=PRECISION)
    return dkT, dvT


@triton.jit(do_not_specialize=SIZE_ARGS + ["H_KV", "head_hi", "accumulate"])
def _dkdv_kernel(
    Q, K, V, dO, Lse, Delta, dK, dV,
    CuSeqlens,  # with VARLEN, the packed sequences' offsets (common.sequence_of)
    stride_qb, stride_qn, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_dob, stride_don, stride_doh,
    stride_gb, stride_gn, stride_gh,  # dK and dV: contiguous [B, N, Hkv, D], the input dtype
    N, H, H_KV, seg_len, dilation, n_seg, head_lo, head_hi, offset_div, offset_base, max_members,
    accumulate,  # add to dK/dV (else store: the first branch, when it covers every position of every head)
    sm_scale,
    qk_scale,  # sm_scale * log2(e)
    GROUP,  # query heads per kv head
    HEAD_DIM,
    BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr,
    CAUSAL: tl.constexpr,
    PRECISION: tl.constexpr,
    MAX_MEMBERS_BUCKET,  # the sweep's key only
    VARLEN: tl.constexpr,  # packed sequences: the batch index runs over the sequences of CuSeqlens
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    n_blocks = tl.cdiv(max_members, BLOCK_N)  # 1-D grid, segment-major
    pid_n = tl.program_id(0) % n_blocks
    pid = tl.program_id(0) // n_blocks
    seg = pid % n_seg
    kvh = (pid // n_seg) % H_KV
    b, start, length, seg_len = sequence_of((pid // (n_seg * H_KV)).to(tl.int64), CuSeqlens, N, seg_len, VARLEN)
    start_n = pid_n * BLOCK_N
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = (offs_d < BLOCK_D) if EVEN_D else (offs_d < HEAD_DIM)
    offs_n = start_n + tl.arange(0, BLOCK_N)
    h_begin = tl.maximum(kvh * GROUP, head_lo)
    h_end = tl.minimum((kvh + 1) * GROUP, head_hi)
    for h in range(h_begin, h_end):
        first, n = members_of(h, seg, length, seg_len, dilation, head_lo, offset_div, offset_base)
        first += start
        if start_n < n:
            n_mask = offs_n < n
            kv_mask = n_mask[:, None] & d_mask[None, :]
            pos_n = (first + offs_n * dilation).to(tl.int64)
            k = tl.load(K + b * stride_kb + kvh * stride_kh + pos_n[:, None] * stride_kn + offs_d[None, :],
                        mask=kv_mask, other=0.0)
            v = tl.load(V + b * stride_vb + kvh * stride_vh + pos_n[:, None] * stride_vn + offs_d[None, :],
                        mask=kv_mask, other=0.0)
            dkT = tl.zeros([BLOCK_D, BLOCK_N], dtype=tl.float32)
            dvT = tl.zeros([BLOCK_D, BLOCK_N], dtype=tl.float32)
            q_base = Q + b * stride_qb + h * stride_qh
            do_base = dO + b * stride_dob + h * stride_doh
            row_base = (b * H + h) * N
            # Query blocks: masked near the diagonal (causal) and at the partial end, mask-free between.
            # Key rows past n are zero and never stored, so only query rows need masks.
            lo = 0
            diag_end = 0
            if CAUSAL:
                lo = (start_n // BLOCK_M) * BLOCK_M  # earlier queries cannot see these keys
                diag_end = lo + tl.cdiv(start_n + BLOCK_N - 1 - lo, BLOCK_M) * BLOCK_M
            full = lo + (n - lo) // BLOCK_M * BLOCK_M
            mid = tl.minimum(tl.maximum(diag_end, lo), full)
            lse_row = Lse + row_base
            delta_row = Delta + row_base
            dkT, dvT = _dkdv_blocks(dkT, dvT, k, v, q_base, do_base, lse_row, delta_row, stride_qn, stride_don, first,
                                    dilation, offs_n, offs_d, d_mask, n, qk_scale, lo, mid,
                                    True, CAUSAL, EVEN_D, PRECISION, BLOCK_M)
            dkT, dvT = _dkdv_blocks(dkT, dvT, k, v, q_base, do_base, lse_row, delta_row, stride_qn, stride_don, first,
                                    dilation, offs_n, offs_d, d_mask, n, qk_scale, mid, full,
                                    False, CAUSAL, EVEN_D, PRECISION, BLOCK_M)
            dkT, dvT = _dkdv_blocks(dkT, dvT, k, v, q_base, do_base, lse_row, delta_row, stride_qn, stride_don, first,
                                    dilation, offs_n, offs_d, d_mask, n, qk_scale, full, n,
                                    True, CAUSAL, EVEN_D, PRECISION, BLOCK_M)
            g_ptrs = b * stride_gb + kvh * stride_gh + pos_n[:, None] * stride_gn + offs_d[None, :]
            dk = tl.trans(dkT) * sm_scale
            dv = tl.trans(dvT)
            if (accumulate != 0) | (h > h_begin):
                dk += tl.load(dK + g_ptrs, mask=kv_mask, other=0.0).to(tl.float32)
                dv += tl.load(dV + g_ptrs, mask=kv_mask, other=0.0).to(tl.float32)
            tl.store(dK + g_ptrs, dk.to(dK.dtype.element_ty), mask=kv_mask)
            tl.store(dV + g_ptrs, dv.to(dV.dtype.element_ty), mask=kv_mask)


@triton.jit
def _dq_blocks(dq, q, do, lse2, delta, k_base, v_base, stride_kn, stride_vn, first, dilation, offs_m, offs_d, d_mask,
               lo, hi, key_end, qk_scale, MASKED: tl.constexpr, CAUSAL: tl.constexpr, EVEN_D: tl.constexpr,
               PRECISION: tl.constexpr, BLOCK_N: tl.constexpr):
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        pos_n = (first + offs_n * dilation).to(tl.int64)
        n_ok = offs_n < key_end
        k = _load_rows(k_base + pos_n[:, None] * stride_kn + offs_d[None, :], n_ok, d_mask, MASKED, EVEN_D)
        v = _load_rows(v_base + pos_n[:, None] * stride_vn + offs_d[None, :], n_ok, d_mask, MASKED, EVEN_D)
        qk = (tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale).to(tl.float32)
        p = tl.math.exp2(qk - lse2[:, None])
        if MASKED:
            valid = n_ok[None, :]
            if CAUSAL:
                valid = valid & (offs_n[None, :] <= offs_m[:, None])
            p = tl.where(valid, p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
    return dq


@triton.jit(do_not_specialize=SIZE_ARGS + ["n_heads", "accumulate"])
def _dq_kernel(
    Q, K, V, dO, Lse, Delta, dQ,
    CuSeqlens,  # with VARLEN, the packed sequences' offsets (common.sequence_of)
    stride_qb, stride_qn, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_dob, stride_don, stride_doh,
    stride_gb, stride_gn, stride_gh,  # dQ: contiguous [B, N, H, D], the input dtype
    N, H, seg_len, dilation, n_seg, head_lo, n_heads, offset_div, offset_base, max_members,
    accumulate,  # add to dQ (else store, as in the dK/dV kernel)
    sm_scale,
    qk_scale,
    GROUP,  # query heads per kv head
    HEAD_DIM,
    BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr,
    CAUSAL: tl.constexpr,
    PRECISION: tl.constexpr,
    MAX_MEMBERS_BUCKET,  # the sweep's key only
    VARLEN: tl.constexpr,  # packed sequences: the batch index runs over the sequences of CuSeqlens
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # 1-D grid, the blocks of one segment adjacent so that they share its K/V in L2.
    n_blocks = tl.cdiv(max_members, BLOCK_M)
    pid_m = tl.program_id(0) % n_blocks
    b, h, kvh, first, n = segment_of(tl.program_id(0) // n_blocks, CuSeqlens, N, seg_len, dilation, n_seg, head_lo,
                                     n_heads, offset_div, offset_base, GROUP, VARLEN)
    start_m = pid_m * BLOCK_M
    if start_m < n:
        offs_m = start_m + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        m_mask = offs_m < n
        d_mask = (offs_d < BLOCK_D) if EVEN_D else (offs_d < HEAD_DIM)
        q_mask = m_mask[:, None] & d_mask[None, :]
        pos_m = (first + offs_m * dilation).to(tl.int64)
        q = tl.load(Q + b * stride_qb + h * stride_qh + pos_m[:, None] * stride_qn + offs_d[None, :], mask=q_mask,
                    other=0.0)
        do = tl.load(dO + b * stride_dob + h * stride_doh + pos_m[:, None] * stride_don + offs_d[None, :],
                     mask=q_mask, other=0.0)
        row_base = (b * H + h) * N
        lse2 = tl.load(Lse + row_base + pos_m, mask=m_mask, other=0.0) * LOG2E
        delta = tl.load(Delta + row_base + pos_m, mask=m_mask, other=0.0)
        k_base = K + b * stride_kb + kvh * stride_kh
        v_base = V + b * stride_vb + kvh * stride_vh
        dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        # Mask-free key blocks first (whole, visible to every query), then the diagonal/partial ones. Rows
        # past n hold q = dO = 0 and are never stored, so they need no mask.
        hi = n
        if CAUSAL:
            hi = tl.minimum(n, start_m + BLOCK_M)
        full = n // BLOCK_N * BLOCK_N
        if CAUSAL:
            full = tl.minimum(full, (start_m + 1) // BLOCK_N * BLOCK_N)
        dq = _dq_blocks(dq, q, do, lse2, delta, k_base, v_base, stride_kn, stride_vn, first, dilation, offs_m, offs_d,
                        d_mask, 0, full, hi, qk_scale, False, CAUSAL, EVEN_D, PRECISION, BLOCK_N)
        dq = _dq_blocks(dq, q, do, lse2, delta, k_base, v_base, stride_kn, stride_vn, first, dilation, offs_m, offs_d,
                        d_mask, full, hi, hi, qk_scale, True, CAUSAL, EVEN_D, PRECISION, BLOCK_N)
        g_ptrs = dQ + b * stride_gb + h * stride_gh + pos_m[:, None] * stride_gn + offs_d[None, :]
        dq = dq * sm_scale
        if accumulate != 0:
            dq += tl.load(g_ptrs, mask=q_mask, other=0.0).to(tl.float32)
        tl.store(g_ptrs, dq.to(dQ.dtype.element_ty), mask=q_mask)


DKDV = Tunable(
    "dkdv", _dkdv_kernel,
    candidates=[
        dict(BLOCK_M=32, BLOCK_N=128, num_warps=8, num_stages=3),
        dict(BLOCK_M=64, BLOCK_N=128, num_warps=8, num_stages=3),
        dict(BLOCK_M=32, BLOCK_N=64, num_warps=4, num_stages=3),
        dict(BLOCK_M=32, BLOCK_N=64, num_warps=4, num_stages=2),  # float32 tf32x3 at head dim 128
        dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2),
        dict(BLOCK_M=16, BLOCK_N=64, num_warps=4, num_stages=2),
    ],
    tf32x3_candidates=[
        dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=1),
        dict(BLOCK_M=32, BLOCK_N=32, num_warps=4, num_stages=1),
        dict(BLOCK_M=16, BLOCK_N=32, num_warps=4, num_stages=2),
    ],
    # resident K and V rows; per stage Q and dO rows, and their lse and delta values; P and dS, the B operands
    # of the dV and dK products, staged through one [BLOCK_M, BLOCK_N] tile
    rows_per_stage=lambda c: (2 * c["BLOCK_N"], 2 * c["BLOCK_M"], 2 * c["BLOCK_M"], c["BLOCK_M"] * c["BLOCK_N"]),
    restore=("dK", "dV"),
)

DQ = Tunable(
    "dq", _dq_kernel,
    candidates=[
        dict(BLOCK_M=128, BLOCK_N=32, num_warps=8, num_stages=3),
        dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3),
        dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3),
        dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=3),  # float32 tf32x3 at head dim 128
        dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=2),
        dict(BLOCK_M=64, BLOCK_N=16, num_warps=4, num_stages=2),
    ],
    tf32x3_candidates=[
        dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=1),
        dict(BLOCK_M=32, BLOCK_N=32, num_warps=4, num_stages=1),
        dict(BLOCK_M=32, BLOCK_N=16, num_warps=4, num_stages=2),
    ],
    # resident Q and dO rows; per stage a block of K and one of V
    rows_per_stage=lambda c: (2 * c["BLOCK_M"], 2 * c["BLOCK_N"], 0),
    restore=("dQ",),
)
