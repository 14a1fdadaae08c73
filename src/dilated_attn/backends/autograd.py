"""Autograd for the registered forward ops (the compiled and the Triton ones), through their backward ops."""

from __future__ import annotations

import torch

__all__ = ["register_attention_autograd"]


def register_attention_autograd(forward_op: str, backward_op: str) -> None:
    """Register autograd for `forward_op` (a `dilated_attn::` op with the forward schema) that calls `backward_op`
    (the name of a `dilated_attn::` op with the backward schema) with the merged out and lse it saved."""

    def setup_context(ctx, inputs, output):
        q, k, v, segment_lengths, dilation_rates, split_heads, causal, scale = inputs
        out, lse = output
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.config = (segment_lengths, dilation_rates, split_heads, causal, scale)
        # An output without a gradient arrives as None, not as zeros: a backward told that the LSE has no
        # gradient skips its term (the cudnn backend needs that to use cuDNN's backward at all).
        ctx.set_materialize_grads(False)

    def backward(ctx, grad_out, grad_lse):
        q, k, v, out, lse = ctx.saved_tensors
        if grad_out is None:  # only the LSE has a gradient
            grad_out = torch.zeros_like(out)
        op = getattr(torch.ops.dilated_attn, backward_op)
        grad_q, grad_k, grad_v = op(grad_out, grad_lse, q, k, v, out, lse, *ctx.config)
        return grad_q, grad_k, grad_v, None, None, None, None, None

    torch.library.register_autograd(forward_op, backward, setup_context=setup_context)
