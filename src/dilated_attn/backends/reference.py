"""The `reference` backend: dilated_attn.reference (pure PyTorch) on any device and floating dtype.

It is the truth the tests compare with, and where no kernel applies (float64 on a GPU, other devices, attention
dropout) it is what runs. Its memory grows with `N * w / r` per branch (`memory_bytes`), not with N.
"""

from __future__ import annotations

import torch

from ..reference import default_compute_dtype, dilated_attention_reference
from ..spec import Problem
from .base import Backend, ForwardOp

__all__ = ["REFERENCE", "memory_bytes"]


class _InGraph(torch.autograd.Function):
    """The LSE as it is, in the autograd graph of inputs it does not depend on (with a zero gradient): the compiled
    and Triton ops' autograd puts both results in the graph of q, k and v whenever one of them requires grad, so
    `torch.autograd.grad([out, lse], [v])` runs on every backend alike."""

    @staticmethod
    def forward(ctx, lse, *inputs):
        ctx.inputs = len(inputs)
        return lse.view_as(lse)

    @staticmethod
    def backward(ctx, grad):
        return (grad, *(None,) * ctx.inputs)


def forward(q, k, v, segment_lengths, dilation_rates, split_heads, causal, scale, head_start=0, global_heads=0):
    """The reference with the forward op's arguments; differentiable through PyTorch's autograd."""
    out, lse = dilated_attention_reference(q, k, v, segment_lengths, dilation_rates, causal=causal, scale=scale,
                                           head_groups="split" if split_heads else "all", head_start=head_start,
                                           global_heads=global_heads)
    if torch.is_grad_enabled() and not lse.requires_grad and any(x.requires_grad for x in (q, k, v)):
        lse = _InGraph.apply(lse, q, k, v)  # only v requires grad: the LSE, which does not read v, joins its graph
    return out, lse


def backward(grad_out, grad_lse, q, k, v, out, lse, segment_lengths, dilation_rates, split_heads, causal, scale,
             head_start=0, global_heads=0):
    """The backward op's contract (the gradient share of these keys, given the merged `out` and `lse`) through
    autograd: the reference's own `(out_b, lse_b)` enters the merged result with weight `alpha = exp(lse_b -
    LSE)`, so `d out_b = alpha dO` and `d lse_b = alpha (dO . out_b - dO . O + dLSE)`, which autograd turns into
    the spec's `dS = P (dO . v - delta)`."""
    with torch.enable_grad():
        qb, kb, vb = (x.detach().requires_grad_() for x in (q, k, v))
        ob, lb = forward(qb, kb, vb, segment_lengths, dilation_rates, split_heads, causal, scale, head_start,
                         global_heads)
        finite = torch.isfinite(lb)
        alpha = torch.where(finite, torch.exp(lb - torch.where(finite, lse, lb)), torch.zeros_like(lb))
        go = grad_out.to(ob.dtype)
        dot = ((go * ob.detach()).sum(-1) - (go * out.to(ob.dtype)).sum(-1)).transpose(1, 2)
        if grad_lse is not None:
            dot = dot + grad_lse
        grads = torch.autograd.grad((ob, lb), (qb, kb, vb),
                                    (alpha.transpose(1, 2).unsqueeze(-1) * go, (alpha * dot).to(lb.dtype)))
    return grads


def memory_bytes(p: Problem) -> int:
    """An upper bound on what the reference allocates for `p`'s forward and backward beyond the inputs: per branch
    four score-sized tensors (the scores, their exponentials and the probabilities, kept for the backward, and one
    gradient) and four [B, H, N + 1, D] ones (gathered q, k, v and the output), in the compute dtype. Measured
    peaks were 0.72-0.97 of it (benchmarks/README.md, "The auto rule")."""
    element = torch.finfo(default_compute_dtype(p.dtype)).bits // 8
    total = 0
    for br in p.branches:
        members = -(-br.seg_len // br.dilation)
        scores = (br.head_hi - br.head_lo) * -(-p.seq_len // br.seg_len) * members * members
        total += 4 * scores + 4 * p.num_heads * (p.seq_len + 1) * p.head_dim
    return p.batch * total * element


class ReferenceBackend(Backend):
    name = "reference"
    forward_op = ForwardOp(varlen="per_sequence")  # any device, any floating dtype, any head dim
    backward_op = forward_op.backward()

    def ops(self):
        return forward, backward


REFERENCE = ReferenceBackend()
