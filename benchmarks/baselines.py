"""What users run today, for comparison: torchscale's recipe (gather each branch's dilated rows, run
PyTorch SDPA with its log-sum-exp, scatter back, merge branches by a softmax over the stacked LSEs), with
the flash or cuDNN kernel, eager or under torch.compile (`compiled_recipe`). Compiled with cuDNN attention
it is the strongest baseline we know: on an H100 its training step is within a few percent of the `triton`
backend's, with about 4x its extra memory (benchmarks/README.md, "The training step on one GPU").

Like torchscale, its gradient treats the merge weights as constants (SDPA's LSE has no gradient), so it is
a speed baseline only; dilated_attn.reference is the truth. It needs N % w == 0 and w % r == 0.
"""

from __future__ import annotations

import functools
import math

import torch

from dilated_attn.branches import branch_table


def _sdpa_with_lse(q, k, v, causal, scale, kernel):
    """q, k, v: [batch, heads, seq, dim] -> out [batch, heads, seq, dim], lse [batch, heads, seq]."""
    if kernel == "cudnn":
        out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
            q, k, v, None, True, 0.0, causal, False, scale=scale
        )[:2]
    else:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)[:2]
    return out, lse.float()


def gather_sdpa_merge(q, k, v, segment_lengths, dilation_rates, *, causal=False, scale=None, kernel="flash"):
    """q: [B, N, H, D], k/v: [B, N, H, D] (no GQA here). Returns out [B, N, H, D]."""
    B, N, H, D = q.shape
    scale = D**-0.5 if scale is None else scale
    heads = torch.arange(H, device=q.device)
    outs, lses = [], []
    for br in branch_table(segment_lengths, dilation_rates, N, H, "all"):
        s, r = br.seg_len, br.dilation
        if N % s or s % r:
            raise ValueError(f"baseline needs N % w == 0 and w % r == 0, got N={N}, w={s}, r={r}")
        offsets = (heads - br.head_lo) // br.offset_div + br.offset_base

        def gather(x):  # [B, N, H, D] -> [B * n_seg, H, s // r, D]: member j of head h is row o(h) + r*j
            x = x.view(B, N // s, s // r, r, H, D)[:, :, :, offsets, heads]  # [B, n_seg, s // r, H, D]
            return x.reshape(B * (N // s), s // r, H, D).transpose(1, 2)

        out_b, lse_b = _sdpa_with_lse(gather(q), gather(k), gather(v), causal, scale, kernel)
        out_full = q.new_zeros(B, N // s, s // r, r, H, D)
        out_full[:, :, :, offsets, heads] = out_b.transpose(1, 2).reshape(B, N // s, s // r, H, D)
        lse_full = q.new_full((B, N // s, s // r, r, H), -math.inf, dtype=torch.float32)
        lse_full[:, :, :, offsets, heads] = lse_b.transpose(1, 2).reshape(B, N // s, s // r, H)
        outs.append(out_full.view(B, N, H, D))
        lses.append(lse_full.view(B, N, H))
    weights = torch.softmax(torch.stack(lses), dim=0).to(q.dtype)  # every position is covered by some branch
    return sum(w.unsqueeze(-1) * o for w, o in zip(weights, outs))


@functools.cache
def compiled_recipe(kernel: str = "cudnn"):
    """gather_sdpa_merge under torch.compile (static shapes) with the given SDPA kernel: one compiled graph
    per (shape, branches, causal), gathers, scatters and the merge fused by Inductor around the attention
    calls. Cached per kernel, so that every configuration of a run reuses one torch.compile object."""
    return torch.compile(functools.partial(gather_sdpa_merge, kernel=kernel), dynamic=False)
