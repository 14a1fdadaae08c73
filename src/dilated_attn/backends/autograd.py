"""Autograd for the registered forward ops (the compiled and the Triton ones), through their backward ops."""

from __future__ import annotations

import torch

__all__ = ["register_attention_autograd"]

_SAVED = "saved tensor"  # marks the place of a config tensor in ctx.config (the tensor goes to save_for_backward)


def register_attention_autograd(forward_op: str, backward_op: str, takes_lse_gradient: bool = True) -> None:
    """Register autograd for `forward_op` (a `dilated_attn::` op taking `(q, k, v, *config)`) that calls
    `backward_op` (the name of a `dilated_attn::` op taking `(grad_out, grad_lse, q, k, v, out, lse, *config)`)
    with the merged out and lse it saved. `config` is the forward schema's rest (segment_lengths, dilation_rates,
    split_heads, causal, scale, head_start, global_heads), led for packed sequences by cu_seqlens and max_seqlen. A
    backward op that `takes_lse_gradient=False` runs only where the LSE has no gradient; where it has one, the
    backward of the backend dispatch.backward_backend names runs instead (explain() says which)."""

    def setup_context(ctx, inputs, output):
        q, k, v, *config = inputs
        out, lse = output
        tensors = [x for x in config if isinstance(x, torch.Tensor)]  # cu_seqlens: saved, not kept on ctx
        ctx.save_for_backward(q, k, v, out, lse, *tensors)
        ctx.config = [_SAVED if isinstance(x, torch.Tensor) else x for x in config]
        # An output without a gradient arrives as None, not as zeros: a backward told that the LSE has no
        # gradient skips its term (the cudnn backend needs that to use cuDNN's backward at all).
        ctx.set_materialize_grads(False)

    def backward(ctx, grad_out, grad_lse):
        q, k, v, out, lse, *tensors = ctx.saved_tensors
        if grad_out is None:  # only the LSE has a gradient
            grad_out = torch.zeros_like(out)
        refill = iter(tensors)
        config = [next(refill) if x is _SAVED else x for x in ctx.config]
        if grad_lse is not None and not takes_lse_gradient:
            op = _lse_gradient_backward(q, k, v, *config)
        else:
            op = getattr(torch.ops.dilated_attn, backward_op)
        grad_q, grad_k, grad_v = op(grad_out, grad_lse, q, k, v, out, lse, *config)
        return (grad_q, grad_k, grad_v) + (None,) * len(config)

    torch.library.register_autograd(forward_op, backward, setup_context=setup_context)


def _lse_gradient_backward(q, k, v, segment_lengths, dilation_rates, split_heads, causal, scale, head_start=0,
                           global_heads=0):
    """The backward op that runs where the LSE has a gradient that this backend's backward cannot take."""
    from .. import backends, dispatch  # imported here: both import this module's users
    from ..spec import validate

    p = validate(q, k, v, segment_lengths, dilation_rates, causal=causal, scale=scale,
                 head_groups="split" if split_heads else "all")
    if global_heads:
        p = p.with_heads(head_start, global_heads)
    return backends.get(dispatch.lse_gradient_backend(p)).ops()[1]
