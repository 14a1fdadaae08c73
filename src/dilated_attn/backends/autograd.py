"""Autograd for the registered forward ops, through their backward ops.

A forward op whose backward cannot take an LSE gradient or is not bitwise repeatable (cudnn's) stores on the
context, at forward time, the backward op to run where the LSE gets one or deterministic algorithms are on. The dispatch layer, which ranks the backends, picks it: it installs its
chooser here (`set_lse_gradient_chooser`), so that backends/ imports nothing above it.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

__all__ = ["register_attention_autograd", "set_lse_gradient_chooser"]

_SAVED = "saved tensor"  # marks the place of a config tensor in ctx.config (the tensor goes to save_for_backward)

# (q, k, v, *config) -> the backward op to run where the forward backend's backward cannot run the call
_lse_gradient_chooser: Optional[Callable] = None


def set_lse_gradient_chooser(chooser: Callable) -> None:
    """Install the function that names, for a forward op's inputs, the backward op an LSE gradient needs
    (dilated_attn.dispatch.lse_gradient_backward_op)."""
    global _lse_gradient_chooser
    _lse_gradient_chooser = chooser


def register_attention_autograd(forward_op: str, backward_op: str, takes_lse_gradient: bool = True,
                                deterministic: bool = True) -> None:
    """Register autograd for `forward_op` (a `dilated_attn::` op taking `(q, k, v, *config)`) that calls
    `backward_op` (the name of a `dilated_attn::` op taking `(grad_out, grad_lse, q, k, v, out, lse, *config)`)
    with the merged out and lse it saved. `config` is the forward schema's rest (segment_lengths, dilation_rates,
    split_heads, causal, scale, head_start, global_heads), led for packed sequences by cu_seqlens and max_seqlen. A
    backward op that `takes_lse_gradient=False` runs only where the LSE has no gradient, and one that is not
    `deterministic` (bitwise repeatable) only where torch.use_deterministic_algorithms is off; elsewhere the backward
    op chosen at forward time runs instead (explain() says which)."""

    def setup_context(ctx, inputs, output):
        q, k, v, *config = inputs
        out, lse = output
        tensors = [x for x in config if isinstance(x, torch.Tensor)]  # cu_seqlens: saved, not kept on ctx
        ctx.save_for_backward(q, k, v, out, lse, *tensors)
        ctx.config = [_SAVED if isinstance(x, torch.Tensor) else x for x in config]
        # whether the deterministic algorithms torch is told to use rule this backward out, read when the forward runs
        ctx.always_other = not deterministic and torch.are_deterministic_algorithms_enabled()
        needs_other = ctx.always_other or not takes_lse_gradient
        ctx.other_backward = _lse_gradient_chooser(q, k, v, *config) if needs_other else None
        # An output without a gradient arrives as None, not as zeros: a backward told that the LSE has no
        # gradient skips its term (the cudnn backend needs that to use cuDNN's backward at all).
        ctx.set_materialize_grads(False)

    def backward(ctx, grad_out, grad_lse):
        q, k, v, out, lse, *tensors = ctx.saved_tensors
        if torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (q, k, v, grad_out, grad_lse)):
            # create_graph=True: the backward ops are not differentiable, so a second derivative would be silently 0
            raise RuntimeError(f"dilated_attn: double backward (create_graph=True) is not supported by {forward_op}'s "
                               f"backward; backend='reference' differentiates twice")
        if grad_out is None:  # only the LSE has a gradient
            grad_out = torch.zeros_like(out)
        refill = iter(tensors)
        config = [next(refill) if x is _SAVED else x for x in ctx.config]
        if ctx.always_other or (grad_lse is not None and not takes_lse_gradient):
            op = ctx.other_backward
        else:
            op = getattr(torch.ops.dilated_attn, backward_op)
        grad_q, grad_k, grad_v = op(grad_out, grad_lse, q, k, v, out, lse, *config)
        return (grad_q, grad_k, grad_v) + (None,) * len(config)

    torch.library.register_autograd(forward_op, backward, setup_context=setup_context)
