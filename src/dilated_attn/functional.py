"""The public functions."""

from __future__ import annotations

from . import dispatch
from .spec import validate


def dilated_attention(
    q,
    k,
    v,
    segment_lengths,
    dilation_rates,
    *,
    causal=False,
    scale=None,
    head_groups="all",
    return_lse=False,
    backend="auto",
):
    """LongNet dilated attention, exactly as docs/SPEC.md defines it.

    Args:
        q: `[B, N, Hq, D]`; k, v: `[B, N, Hkv, D]` with `Hq % Hkv == 0` (query head h reads kv head
            `h // (Hq // Hkv)`).
        segment_lengths, dilation_rates: the branches `(w_i, r_i)`, positive ints, same length >= 1.
        causal: a query attends only to keys at positions <= its own.
        scale: score scale, default `D ** -0.5`.
        head_groups: "all" (LongNet/torchscale: every head in every branch, head offsets
            `h // ceil(Hq / r)`) or "split" (heads cut into one group per branch, offset `i % r`).
        return_lse: also return the merged log-sum-exp `[B, Hq, N]` (float32; float64 for float64).
        backend: "auto", "cuda", "triton", "cpu" or "reference". "auto" follows the environment variable
            DILATED_ATTN_BACKEND when it names a backend, else `dispatch.auto_preference`;
            `dilated_attn.explain(...)` tells which backend runs and why.

    Returns:
        `out` `[B, N, Hq, D]` (contiguous, q's dtype), or `(out, lse)` with `return_lse=True`.
    """
    p = validate(
        q,
        k,
        v,
        segment_lengths,
        dilation_rates,
        causal=causal,
        scale=scale,
        head_groups=head_groups,
        return_lse=return_lse,
        backend=backend,
    )
    out, lse = dispatch.select(p, backend).forward(q, k, v, p)
    return (out, lse) if return_lse else out
