"""The one log-sum-exp merge of partial attention results (docs/SPEC.md, "Merging branches").

Partial results `(o_i, L_i)` over disjoint multisets of keys merge into the result over their union:

    L = log sum_i exp(L_i)        o = sum_i w_i o_i,   w_i = exp(L_i - m) / sum_j exp(L_j - m),   m = max_j L_j

`w_i` equals the spec's `exp(L_i - L)`, but normalised by its own sum it cannot drift from 1 when `L` is rounded
(at |L| * eps near log 2, float32 from |L| ~ 1e7). Rows where every `L_i` is -inf (no key) give (0, -inf); a
NaN `L_i` makes the row's out and lse NaN.

The reference merges its branches and the ring its blocks with these functions. The kernels (CPU, CUDA, Triton)
merge each branch into their running `(out, lse)` in their epilogues with the same two-term formula, and the cudnn
backend each cuDNN call's result with a CUDA kernel of it (csrc/cuda/merge.cu, `merge_kernel`);
tests/test_merge.py pins every one of them to `merge` on crafted inputs.
"""

from __future__ import annotations

import math

import torch

__all__ = ["merge", "merge_into"]


def merge(outs: list[torch.Tensor], lses: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge partial results: `outs[i]` `[..., D]`, `lses[i]` of the shape `[...]` (each lse row belongs to the
    out row above it). Differentiable, merge weights included. Returns `(out, lse)`."""
    lse_all = torch.stack(lses)
    covered = (lse_all != -math.inf).any(0)  # a NaN counts as covered, so that it reaches the result
    top = lse_all.amax(0).detach()  # a shift: the result does not depend on it
    top = torch.where(covered, top, torch.zeros_like(top))
    weights = torch.exp(lse_all - top)  # in [0, 1]: no overflow
    total = torch.where(covered, weights.sum(0), torch.ones_like(top))
    lse = torch.where(covered, torch.log(total) + top, torch.full_like(top, -math.inf))
    out = sum((w / total).unsqueeze(-1) * o for o, w in zip(outs, weights))
    return out, lse


@torch.no_grad()
def merge_into(acc_out: torch.Tensor, acc_lse: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
    """In place: `(acc_out, acc_lse) <- merge([acc_out, out], [acc_lse, lse])`, in the accumulators' dtypes
    (`acc_lse` may be a transposed view: the result is written through it). Not differentiable."""
    new_out, new_lse = merge([acc_out, out.to(acc_out.dtype)], [acc_lse, lse.to(acc_lse.dtype)])
    acc_out.copy_(new_out)
    acc_lse.copy_(new_lse)
