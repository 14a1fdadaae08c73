"""The public functions."""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

from . import dispatch
from .cache_spec import validate_kvcache
from .spec import lse_dtype, validate, validate_varlen

# What the functions return: `out`, or `(out, lse)` with return_lse=True.
Attention = Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]


def dilated_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segment_lengths: Sequence[int],
                      dilation_rates: Sequence[int], *, causal: bool = False, scale: Optional[float] = None,
                      head_groups: str = "all", return_lse: bool = False, backend: str = "auto") -> Attention:
    """LongNet dilated attention, exactly as the spec (docs/SPEC.md in the
    repository) defines it.

    Args:
        q: `[B, N, Hq, D]`; k, v: `[B, N, Hkv, D]` with `Hq % Hkv == 0`
            (query head h reads kv head `h // (Hq // Hkv)`).
        segment_lengths, dilation_rates: the branches `(w_i, r_i)`,
            positive ints, same length >= 1.
        causal: a query attends only to keys at positions <= its own.
        scale: score scale, default `D ** -0.5`; at most 1e30 in magnitude
            (1e300 for float64), past which the scores overflow.
        head_groups: "all" (LongNet/torchscale: every head in every branch,
            head offsets `h // ceil(Hq / r)`) or "split" (heads cut into one
            group per branch, offset `i % r`).
        return_lse: also return the merged log-sum-exp `[B, Hq, N]` (float32;
            float64 for float64).
        backend: "auto", "cuda", "triton", "cudnn", "fa4", "cpu" or
            "reference". "auto" follows the environment variable
            DILATED_ATTN_BACKEND when it names a backend, else
            `dispatch.auto_preference`; `dilated_attn.explain(...)` tells
            which backend runs and why.

    Returns:
        `out` `[B, N, Hq, D]` (contiguous, q's dtype), or `(out, lse)` with
        `return_lse=True`.

    Example::

        q, k, v = (torch.randn(1, 8192, 8, 64) for _ in range(3))
        out = dilated_attn.dilated_attention(
            q, k, v, segment_lengths=[2048, 4096, 8192],
            dilation_rates=[1, 2, 4], causal=True)
    """
    p = validate(q, k, v, segment_lengths, dilation_rates, causal=causal, scale=scale, head_groups=head_groups,
                 return_lse=return_lse, backend=backend)
    out, lse = dispatch.select(p, backend).forward(q, k, v, p)
    return (out, lse) if return_lse else out


def dilated_attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                             segment_lengths: Sequence[int], dilation_rates: Sequence[int], *,
                             max_seqlen: Optional[int] = None, causal: bool = False, scale: Optional[float] = None,
                             head_groups: str = "all", return_lse: bool = False, backend: str = "auto") -> Attention:
    """Dilated attention over packed sequences of different lengths, the layout of flash-attn's varlen functions
    (docs/SPEC.md, "Packed variable-length sequences (varlen)").

    Args:
        q: `[T, Hq, D]`; k, v: `[T, Hkv, D]`: S sequences packed along the first axis.
        cu_seqlens: `[S + 1]` int32 or int64 offsets on q's device: 0, then non-decreasing, then T; sequence j is
            rows `[cu_seqlens[j], cu_seqlens[j + 1])`. Empty sequences are allowed. GPU offsets are read back once
            per tensor while it is unchanged: give new offsets as a new tensor, or write them in place with torch
            ops (`cu.copy_(...)`), not through `.data` or a NumPy view, which torch does not count as a change.
        max_seqlen: at least the longest sequence. Without it the offsets are read back to find it (a host
            synchronisation); under torch.compile it is required.
        The other arguments are those of `dilated_attention`; segments are clipped to each sequence's length.

    Returns:
        `out` `[T, Hq, D]`, or `(out, lse)` with `lse` `[Hq, T]`: each sequence's rows equal `dilated_attention`
        on that sequence alone, and so do the gradients. No key is shared between sequences.
    """
    p = validate_varlen(q, k, v, cu_seqlens, segment_lengths, dilation_rates, max_seqlen=max_seqlen, causal=causal,
                        scale=scale, head_groups=head_groups, return_lse=return_lse, backend=backend)
    out, lse = dispatch.select(p, backend).forward_varlen(q, k, v, p)
    return (out, lse) if return_lse else out


def dilated_attention_with_kvcache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                   cache_seqlens: Union[int, torch.Tensor], segment_lengths: Sequence[int],
                                   dilation_rates: Sequence[int], *, k: Optional[torch.Tensor] = None,
                                   v: Optional[torch.Tensor] = None, scale: Optional[float] = None,
                                   head_groups: str = "all", return_lse: bool = False,
                                   backend: str = "auto") -> Attention:
    """Dilated attention for decoding with a KV cache, like flash-attn's `flash_attn_with_kvcache` (docs/SPEC.md,
    "Decoding with a KV cache"). Inference only.

    Args:
        q: `[B, Sq, Hq, D]`, the `Sq >= 1` new tokens (1 for a decode step; more for chunked prefill or
            speculative decoding).
        k_cache, v_cache: `[B, Nmax, Hkv, D]`.
        cache_seqlens: how many tokens each batch element has cached: an int, or an integer tensor `[B]`. A CPU
            tensor is read on the host and checked; a GPU tensor is not (no device-to-host copy: the call can be
            captured in a CUDA graph, and runs under torch.compile without a graph break), and rows outside the
            cache are then neither read nor written.
        k, v: `[B, Sq, Hkv, D]` or None. When given they are first written into the cache, in place, at rows
            `cache_seqlens[b] + i`.
        The other arguments are those of `dilated_attention`.

    Returns:
        `out` `[B, Sq, Hq, D]`, or `(out, lse)` with `lse` `[B, Hq, Sq]`: new query i of batch element b is row
        `P = cache_seqlens[b] + i` of `dilated_attention(..., causal=True)` over the cache's first P + 1 rows.
    """
    cp = validate_kvcache(
        q,
        k_cache,
        v_cache,
        cache_seqlens,
        segment_lengths,
        dilation_rates,
        k=k,
        v=v,
        scale=scale,
        head_groups=head_groups,
        return_lse=return_lse,
        backend=backend,
    )
    chosen = dispatch.select(cp.problem, backend)
    if q.shape[0] == 0:  # no batch element: nothing to write or attend
        out, lse = torch.empty_like(q), torch.empty((0, q.shape[2], q.shape[1]), dtype=lse_dtype(q.dtype),
                                                    device=q.device)
        return (out, lse) if return_lse else out
    out, lse = chosen.forward_kvcache(q, k_cache, v_cache, k, v, cp)  # nothing requires grad (validate_kvcache)
    return (out, lse) if return_lse else out
