"""Pure-PyTorch implementations of the spec: the truth every backend, test and benchmark is compared with.

* `dilated_attention_reference` gathers each branch's dilated rows into dense `[.., segment, member, D]`
  blocks, attends within each block and merges branches with merge.merge. Memory is
  O(B*H*N*w/r^2) scores per branch, never N x N, so it runs at N = 65536 on one GPU.
* `dilated_attention_bruteforce` builds the full N x N membership mask of every branch straight from the
  spec's wording (`(p mod s) mod r == o(h)`) in float64. It is for tests at small N only.

Both are differentiated by PyTorch's autograd, so their gradients are exact for the merged function,
merge weights included. Neither uses the package's kernels.

`allowed_error` is the one tolerance rule of every check against them: the `dilated-attn check` self-check and
the test suite's parity checks.
"""

from __future__ import annotations

import math

import torch

from .branches import split_group_bounds
from .merge import merge
from .spec import Problem, lse_dtype, validate

__all__ = ["dilated_attention_reference", "dilated_attention_bruteforce", "default_compute_dtype", "allowed_error",
           "max_error"]

# The tolerance rule, after flash-attention's tests: a result's largest error against the float64 reference may be at
# most ERROR_FACTOR times that of the reference computed in the result's dtype (compute_dtype=dtype, on the same
# inputs), plus a floor of a few roundings of the dtype for results whose own reference error happens to be ~0.
# Gradients get a floor relative to their largest entry (at least 1): each is a sum over many keys of
# P * (dP - delta), where the subtraction cancels and P carries the float32 LSE's rounding; bf16/fp16 kernels round P
# and dS to the input dtype before the second matmul, as flash attention does. float32 products on a GPU that
# allows TF32 carry TF32's rounding in the dtype's reference too, so the rule scales with them.
ERROR_FACTOR = 2.0
ERROR_FLOOR = {torch.float64: 1e-12, torch.float32: 2e-6, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}
GRADIENT_ERROR_FLOOR = {torch.float64: 1e-10, torch.float32: 2e-5, torch.bfloat16: 3e-2, torch.float16: 4e-3}


def max_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest absolute difference of two tensors, in float64 (0 for empty ones)."""
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def allowed_error(dtype: torch.dtype, dtype_reference_error: float, gradient: bool = False,
                  largest: float = 1.0) -> float:
    """The largest error against the float64 reference that a result in `dtype` may show, given the error of the
    reference computed in `dtype` (`dtype_reference_error`); `largest`: a gradient's largest reference entry."""
    if gradient:
        return ERROR_FACTOR * dtype_reference_error + GRADIENT_ERROR_FLOOR[dtype] * max(largest, 1.0)
    return ERROR_FACTOR * dtype_reference_error + ERROR_FLOOR[dtype]


def _masked_attention(scores: torch.Tensor, mask: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0):
    """softmax(scores) @ v and logsumexp(scores) over the keys where `mask` holds, along the last dim.

    Rows without any key give out = 0 and lse = -inf, and their gradients are 0, not NaN: the max and the
    normaliser are replaced by harmless values before exp/log on such rows. `dropout_p` drops (and rescales)
    the normalised probabilities before they weight `v`; lse stays that of the undropped scores.
    """
    scores = scores.masked_fill(~mask, -math.inf)
    has_key = mask.any(-1)
    row_max = scores.amax(-1, keepdim=True).detach()  # a shift: lse does not depend on it
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    e = torch.exp(scores - row_max)
    denom = torch.where(has_key, e.sum(-1), torch.ones_like(row_max[..., 0]))
    lse = torch.where(has_key, torch.log(denom) + row_max[..., 0], torch.full_like(denom, -math.inf))
    probs = e / denom.unsqueeze(-1)
    if dropout_p > 0:
        probs = torch.nn.functional.dropout(probs, dropout_p)
    return probs @ v, lse


def _finish(out_bhnd: torch.Tensor, lse: torch.Tensor, p: Problem):
    out = out_bhnd.transpose(1, 2).to(p.dtype).contiguous()
    return out, lse.to(lse_dtype(p.dtype)).contiguous()


def default_compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The reference's default arithmetic: float64 for float64 inputs, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def dilated_attention_reference(
    q,
    k,
    v,
    segment_lengths,
    dilation_rates,
    *,
    causal=False,
    scale=None,
    head_groups="all",
    compute_dtype=None,
    dropout_p=0.0,
    head_start=0,
    global_heads=0,
):
    """Gather-based reference. Returns `(out [B, N, Hq, D] in q.dtype, lse [B, Hq, N])`.

    With `global_heads` > 0 the heads of q are the heads `[head_start, head_start + Hq)` of a problem of
    `global_heads` query heads, and keep its offsets (branches.branch_table).

    Arithmetic runs in `compute_dtype` (default: float64 for float64 inputs, else float32).

    `dropout_p > 0` applies attention dropout (not part of the spec; for `dilated_attn.nn` in training) to the
    merged attention probabilities, i.e. to every entry of the one softmax over the multiset union of the
    branches' keys, each entry kept with probability 1 - p and scaled by 1 / (1 - p). The merge is linear in
    each branch's output with weights exp(lse_i - LSE), so this is dropout on each branch's normalised
    probabilities before they weight v, with the merge weights of the undropped branches; `lse` is unchanged.
    """
    p = validate(q, k, v, segment_lengths, dilation_rates, causal=causal, scale=scale, head_groups=head_groups)
    if global_heads:
        p = p.with_heads(head_start, global_heads)
    B, N, Hq, D = q.shape
    cdt = compute_dtype or default_compute_dtype(q.dtype)
    dev = q.device
    group = Hq // p.num_kv_heads
    kv_of_head = torch.arange(Hq, device=dev) // group

    # [B, H, N + 1, D]: one zero row at index N is where the padding of short segments points.
    def heads_first(x):
        x = x.to(cdt).transpose(1, 2)
        return torch.cat([x, x.new_zeros(B, x.shape[1], 1, D)], dim=2)

    qh, kh, vh = heads_first(q), heads_first(k), heads_first(v)
    outs, lses = [], []
    for br in p.branches:
        s, r = br.seg_len, br.dilation
        heads = torch.arange(br.head_lo, br.head_hi, device=dev)
        offsets = br.offset_base + (heads - br.head_lo) // br.offset_div
        n_seg, n_max = -(-N // s), -(-s // r)
        member = torch.arange(n_max, device=dev)
        local = offsets[:, None, None] + r * member  # [nh, 1, n_max]: position inside the segment
        pos = torch.arange(n_seg, device=dev)[None, :, None] * s + local  # [nh, n_seg, n_max]
        valid = (local < s) & (pos < N)
        pos = torch.where(valid, pos, N)
        qg = qh[:, heads[:, None, None], pos]  # [B, nh, n_seg, n_max, D]
        kg = kh[:, kv_of_head[heads][:, None, None], pos]
        vg = vh[:, kv_of_head[heads][:, None, None], pos]
        mask = valid.unsqueeze(-2)  # keys
        if causal:
            mask = mask & torch.ones(n_max, n_max, dtype=torch.bool, device=dev).tril()
        out_b, lse_b = _masked_attention((qg @ kg.transpose(-1, -2)) * p.scale, mask, vg, dropout_p)
        # Scatter back to sequence order; invalid rows (queries that are padding) land on the spare row N.
        out_full = qh.new_zeros(B, Hq, N + 1, D)
        lse_full = qh.new_full((B, Hq, N + 1), -math.inf)
        out_full[:, heads[:, None, None], pos] = out_b
        lse_full[:, heads[:, None, None], pos] = lse_b
        outs.append(out_full[:, :, :N])
        lses.append(lse_full[:, :, :N])
    out, lse = merge(outs, lses)
    return _finish(out, lse, p)


def dilated_attention_bruteforce(
    q, k, v, segment_lengths, dilation_rates, *, causal=False, scale=None, head_groups="all"
):
    """Full N x N masked attention in float64, written from the spec's definitions. Small N only."""
    p = validate(q, k, v, segment_lengths, dilation_rates, causal=causal, scale=scale, head_groups=head_groups)
    B, N, Hq, D = q.shape
    dev = q.device
    group = Hq // p.num_kv_heads
    qd = q.double().transpose(1, 2)  # [B, Hq, N, D]
    kd = k.double().transpose(1, 2).repeat_interleave(group, dim=1)
    vd = v.double().transpose(1, 2).repeat_interleave(group, dim=1)
    scores = (qd @ kd.transpose(-1, -2)) * p.scale  # [B, Hq, N, N]
    pos = torch.arange(N, device=dev)
    m = len(p.segment_lengths)
    outs, lses = [], []
    for i, (w, r) in enumerate(zip(p.segment_lengths, p.dilation_rates)):
        s = max(min(w, N), 1)
        offset = torch.empty(Hq, dtype=torch.long)
        takes_part = torch.zeros(Hq, dtype=torch.bool)
        for h in range(Hq):
            if p.head_groups == "all":
                takes_part[h] = True
                offset[h] = h // -(-Hq // r)  # ceil(Hq / r) in integers, r any size
            else:
                lo, hi = split_group_bounds(Hq, m, i)
                takes_part[h] = lo <= h < hi
                offset[h] = i % r
        offset, takes_part = offset.to(dev), takes_part.to(dev)
        # (pos % s) % r, r any size (pos % s < s: a larger r changes nothing)
        member = takes_part[:, None] & ((pos % s) % min(r, s) == offset[:, None])  # [Hq, N]
        segment = pos // s
        mask = member[:, :, None] & member[:, None, :] & (segment[:, None] == segment[None, :])
        if causal:
            mask = mask & (pos[None, :] <= pos[:, None])
        out_i, lse_i = _masked_attention(scores, mask.unsqueeze(0), vd)
        outs.append(out_i)
        lses.append(lse_i)
    out, lse = merge(outs, lses)
    return _finish(out, lse, p)
