"""The one signature of the attention ops.

Every backend's forward and backward op takes the same arguments: the compiled extension's `dilated_attn::forward`
and `backward` (csrc/registration.cpp declares them in C++, where they must be; tests/test_build.py pins those
declarations to the signatures here, argument by argument), the cudnn, triton and fa4 ops, and their packed-sequence
forms, whose configuration starts with `cu_seqlens, max_seqlen`. `forward_op` and `backward_op` register a Python
backend's op with them (torch.library reads its schema from the signature), with the shapes torch.compile traces
with; `Problem.op_arguments` makes the configuration's keyword arguments.

    forward(q, k, v, [cu_seqlens, max_seqlen,] *config) -> (out, lse)
    backward(grad_out, grad_lse, q, k, v, out, lse, [cu_seqlens, max_seqlen,] *config) -> (grad_q, grad_k, grad_v)

q `[B, N, Hq, D]` (packed: `[T, Hq, D]`), out alike, lse `[B, Hq, N]` (packed: `[Hq, T]`) in float32 (float64 for
float64 inputs); grad_lse is None where the LSE has no gradient.
"""

import inspect
import sys
from typing import Callable, Optional

import torch

from ..spec import lse_dtype

__all__ = ["forward_signature", "backward_signature", "forward_op", "backward_op", "fake_forward", "fake_backward"]

_Arg = inspect.Parameter
_TENSOR = torch.Tensor
# segment_lengths, dilation_rates: the branches; head_start, global_heads (0: q's heads are the whole problem): q's
# heads are the heads [head_start, head_start + Hq) of a problem of global_heads heads, with its offsets (the
# head-parallel ring modes).
_CONFIG = (("segment_lengths", list[int]), ("dilation_rates", list[int]), ("split_heads", bool), ("causal", bool),
           ("scale", float), ("head_start", int, 0), ("global_heads", int, 0))
_PACKED = (("cu_seqlens", _TENSOR), ("max_seqlen", int))


def _signature(leading: tuple, packed: bool, outputs: int) -> inspect.Signature:
    args = [*leading, *(_PACKED if packed else ()), *_CONFIG]
    params = [_Arg(a[0], _Arg.POSITIONAL_OR_KEYWORD, annotation=a[1], **({"default": a[2]} if len(a) > 2 else {}))
              for a in args]
    return inspect.Signature(params, return_annotation=tuple[(_TENSOR,) * outputs])


def forward_signature(packed: bool = False) -> inspect.Signature:
    return _signature((("q", _TENSOR), ("k", _TENSOR), ("v", _TENSOR)), packed, 2)


def backward_signature(packed: bool = False) -> inspect.Signature:
    leading = (("grad_out", _TENSOR), ("grad_lse", Optional[_TENSOR]), ("q", _TENSOR), ("k", _TENSOR),
               ("v", _TENSOR), ("out", _TENSOR), ("lse", _TENSOR))
    return _signature(leading, packed, 3)


def fake_forward(q, k, v, *config, **named):
    """The forward's outputs for tracing (shapes and dtypes, no data)."""
    lse_shape = (q.shape[1], q.shape[0]) if q.dim() == 3 else (q.shape[0], q.shape[2], q.shape[1])
    return q.new_empty(q.shape), q.new_empty(lse_shape, dtype=lse_dtype(q.dtype))


def fake_backward(grad_out, grad_lse, q, k, v, *rest, **named):
    """The backward's outputs for tracing."""
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _register(name: str, signature: inspect.Signature, fake: Callable, triton: bool) -> Callable:
    def register(fn: Callable):
        fn.__signature__ = signature  # torch.library reads the schema from it
        if triton:  # a Triton op traces through its launches: it needs no fake
            return torch.library.triton_op(f"dilated_attn::{name}", fn, mutates_args=())
        op = torch.library.custom_op(f"dilated_attn::{name}", fn, mutates_args=())
        op.register_fake(fake)
        _dynamo_imported_lazily(op)
        return op
    return register


def _dynamo_imported_lazily(op) -> None:
    """A custom op's kernels, which torch wraps in `torch._disable_dynamo`, run without importing torch._dynamo until
    something else has imported it.

    The wrapper imports torch._dynamo on a kernel's first call (0.5-4 s: sympy, torch.fx's symbolic shapes), the
    largest part of an eager process's first call once its kernels are compiled; eager code needs none of it. It
    looks for the disabled kernel in the kernel's `__dynamo_disable` attribute first, so that attribute is set to run
    the kernel as it is while torch._dynamo is not imported (nothing can be compiling then: torch.compile imports it)
    and, from the first call after it is, as torch._dynamo.disable makes it. Where torch's custom ops are built
    otherwise (another version), nothing is set: the first call imports torch._dynamo, as it would."""
    for wrapped in getattr(op, "_backend_fns", {}).values():
        kernel = getattr(wrapped, "__wrapped__", None)
        if kernel is not None and getattr(kernel, "__dynamo_disable", None) is None:
            kernel.__dynamo_disable = _disabled_once_dynamo_is_imported(kernel)


def _disabled_once_dynamo_is_imported(kernel: Callable) -> Callable:
    disabled = None

    def run(*args, **kwargs):
        nonlocal disabled
        if disabled is None:
            dynamo = sys.modules.get("torch._dynamo")
            if dynamo is None:
                return kernel(*args, **kwargs)
            disabled = dynamo.disable(kernel, True, wrapping=False)
        return disabled(*args, **kwargs)

    return run


def forward_op(name: str, *, packed: bool = False, triton: bool = False) -> Callable:
    """Decorator: `fn` as the op `dilated_attn::<name>` of the forward signature (a torch.library custom op, or
    with `triton` a triton op)."""
    return _register(name, forward_signature(packed), fake_forward, triton)


def backward_op(name: str, *, packed: bool = False, triton: bool = False) -> Callable:
    """Decorator: `fn` as the op `dilated_attn::<name>` of the backward signature."""
    return _register(name, backward_signature(packed), fake_backward, triton)
