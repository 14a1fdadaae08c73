"""Argument validation of dilated_attention_with_kvcache (docs/SPEC.md, "Decoding with a KV cache"): the
CacheProblem it runs, and the checks that the caches, the new keys and values and the output share no memory that
the call writes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch

from .spec import Problem, check_tensor, is_int, warn_if_swapped

__all__ = ["CacheProblem", "reads_cache_seqlens", "validate_kvcache"]


@dataclass(frozen=True)
class CacheProblem:
    """Validated arguments of one dilated_attention_with_kvcache call: the problem of a sequence as long as the
    cache (batch 1, causal, `decodes`; what dispatch decides on) and each batch element's cached length."""

    problem: Problem
    cache_seqlens: Optional[tuple[int, ...]]  # on the host; None where that needs a device-to-host copy
    new_tokens: int
    given_seqlens: Union[int, torch.Tensor]  # cache_seqlens as the caller gave it: an int, or a tensor [B] kernels may read
    return_lse: bool = False


def _byte_span(x: torch.Tensor) -> tuple[int, int]:
    """[first, last + 1) byte of x's elements."""
    start = x.data_ptr()
    last = sum((n - 1) * s for n, s in zip(x.shape, x.stride()) if n > 1)
    return start, start + (last + 1) * x.element_size()


def _dense(x: torch.Tensor) -> bool:
    """x's elements fill its span without gaps or repeats (a permutation of a contiguous layout)."""
    expected = 1
    for s, n in sorted((s, n) for n, s in zip(x.shape, x.stride()) if n > 1):
        if s != expected:
            return False
        expected *= n
    return True


def _share_memory(a: torch.Tensor, b: torch.Tensor, dense_only: bool) -> bool:
    """Whether a and b, views of one storage, may refer to one element: their spans intersect (with `dense_only`,
    and both are dense, the rule of PyTorch's copies, which lets interleaved views such as kv[:, :, 0] and
    kv[:, :, 1] be)."""
    if a.numel() == 0 or b.numel() == 0:
        return False
    (a0, a1), (b0, b1) = _byte_span(a), _byte_span(b)
    return a0 < b1 and b0 < a1 and (not dense_only or (_dense(a) and _dense(b)))


def reads_cache_seqlens(cache_seqlens) -> bool:
    """Whether the KV-cache call reads `cache_seqlens` on the host: an int or a CPU tensor, in eager mode. A GPU
    tensor is left on the GPU (no device-to-host copy: the call stays asynchronous and can be captured in a CUDA
    graph), and so is any tensor under torch.compile (no graph break); the kernels then clamp every row they
    touch to the cache."""
    if not isinstance(cache_seqlens, torch.Tensor):
        return True
    return cache_seqlens.device.type == "cpu" and not torch.compiler.is_compiling()


def validate_kvcache(q, k_cache, v_cache, cache_seqlens, segment_lengths, dilation_rates, *, k=None, v=None,
                     scale=None, head_groups="all", return_lse=False, backend="auto") -> CacheProblem:
    """The KV-cache call's checks (docs/SPEC.md, "Decoding with a KV cache"). A cache too short for the new tokens
    is a ValueError where `cache_seqlens` is read on the host (reads_cache_seqlens).

    The checks of the arguments' types, shapes, strides, dtypes and devices run once per key of them (a decoding
    loop makes the same call every step); what memory the tensors share and the lengths' values, every call."""
    args = (segment_lengths, dilation_rates, scale, head_groups, return_lse, backend)
    key = _layout_key(q, k_cache, v_cache, k, v, cache_seqlens, args)
    try:
        problem = _CHECKED.get(key) if key is not None else None
    except TypeError:  # an unhashable argument: no key
        key = problem = None
    if problem is None:
        problem = _check_layouts(q, k_cache, v_cache, k, v, cache_seqlens, *args)
        if key is not None:
            if len(_CHECKED) >= MAX_CHECKED:
                _CHECKED.clear()
            _CHECKED[key] = problem
    # A traced call (torch.compile) and meta tensors have no memory to look at
    if not torch.compiler.is_compiling() and q.device.type != "meta":
        _check_memory(k_cache, v_cache, k, v)
    B, Sq = q.shape[:2]
    lengths: Optional[tuple[int, ...]] = None
    if reads_cache_seqlens(cache_seqlens):
        tensor = isinstance(cache_seqlens, torch.Tensor)
        lengths = tuple(int(n) for n in cache_seqlens.tolist()) if tensor else (cache_seqlens,) * B
        for element, cached in enumerate(lengths if tensor else lengths[:1]):  # an int: one check for every element
            if cached < 0:
                raise ValueError(f"cache_seqlens must be >= 0, got {cached} for batch element {element}")
            if cached + Sq > k_cache.shape[1]:
                raise ValueError(f"the cache is too short: cache_seqlens + Sq = {cached} + {Sq} > Nmax = "
                                 f"{k_cache.shape[1]} (batch element {element}); cache_seqlens[b] + Sq <= "
                                 f"k_cache.shape[1] must hold")
    return CacheProblem(problem, lengths, Sq, cache_seqlens, bool(return_lse))


_CHECKED: dict = {}  # _layout_key -> the Problem its checks gave, at most MAX_CHECKED
MAX_CHECKED = 64


def _layout_key(q, k_cache, v_cache, k, v, cache_seqlens, args: tuple) -> Optional[tuple]:
    """What _check_layouts looks at, as a key (None where there is none: a traced call, an argument that is not a
    tensor). Equal arguments share a key only where their types are the same too (1.0 == 1 and True == 1, but a rule
    takes one and refuses the other); lists and tuples are keyed by their items."""
    if torch.compiler.is_compiling():
        return None
    tensors = []
    for x in (q, k_cache, v_cache, k, v):
        if x is not None and not isinstance(x, torch.Tensor):
            return None
        try:
            tensors.append(None if x is None else (type(x), x.shape, x.stride(), x.dtype, x.device, x.requires_grad))
        except RuntimeError:  # no strides (a sparse tensor)
            return None
    lengths = ((type(cache_seqlens), cache_seqlens.dtype, cache_seqlens.shape, cache_seqlens.device)
               if isinstance(cache_seqlens, torch.Tensor) else type(cache_seqlens))
    return (tuple(tensors), lengths, tuple(tuple(x) if type(x) in (list, tuple) else x for x in args),
            tuple(tuple(map(type, x)) if type(x) in (list, tuple) else type(x) for x in args))


def _check_layouts(q, k_cache, v_cache, k, v, cache_seqlens, segment_lengths, dilation_rates, scale, head_groups,
                   return_lse, backend) -> Problem:
    """validate_kvcache's checks of what the arguments are (not of their memory or the lengths' values): the
    problem dispatch decides on."""
    given = [("q", q), ("k_cache", k_cache), ("v_cache", v_cache)]
    given += [(name, x) for name, x in (("k", k), ("v", v)) if x is not None]
    for name, x in given:
        check_tensor(name, x)
        if x.requires_grad:
            raise ValueError(f"{name} requires grad: dilated_attention_with_kvcache is inference only (call it "
                             f"under torch.no_grad(), or detach {name})")
    if (k is None) != (v is None):
        raise ValueError("k and v go together: give both (written into the cache first) or neither")
    for name, x in given[1:]:
        if x.device != q.device or x.dtype != q.dtype:
            raise ValueError(f"{name} must have q's device and dtype ({q.device}, {q.dtype}), got {x.device}, "
                             f"{x.dtype}")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache must have the same shape, got {tuple(k_cache.shape)} and "
                         f"{tuple(v_cache.shape)}")
    B, Sq, Hq, D = q.shape
    _, Nmax, Hkv, Dc = k_cache.shape
    if k_cache.shape[0] != B or Dc != D:
        raise ValueError(f"k_cache must be [B={B}, Nmax, Hkv, D={D}] for q of shape {tuple(q.shape)}, got "
                         f"{tuple(k_cache.shape)}")
    if Sq < 1:
        raise ValueError(f"q must hold at least one new token (q.shape[1] >= 1), got {Sq}")
    for name, x in (("k", k), ("v", v)):
        if x is not None and tuple(x.shape) != (B, Sq, Hkv, D):
            raise ValueError(f"{name} must be [B, Sq, Hkv, D] = {(B, Sq, Hkv, D)}, got {tuple(x.shape)}")
    # The caches are written in place: every element needs memory of its own, checked before anything is written.
    # A traced call (torch.compile) and meta tensors have no memory to look at: there only strides of 0 can be seen.
    eager = not torch.compiler.is_compiling() and q.device.type != "meta"
    for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
        if (0 in x.stride() and any(st == 0 and n > 1 for st, n in zip(x.stride(), x.shape))) or (
                eager and torch._debug_has_internal_overlap(x) == 1):
            raise ValueError(f"{name} has elements that share memory (a stride of 0, as expand() makes, or "
                             f"overlapping strides): the cache is written in place, so each row needs its own memory")
    if isinstance(cache_seqlens, torch.Tensor):
        if cache_seqlens.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"cache_seqlens must be an int or an int32/int64 tensor, got dtype {cache_seqlens.dtype}")
        if tuple(cache_seqlens.shape) != (B,):
            raise ValueError(f"cache_seqlens must have shape [B] = ({B},), got {tuple(cache_seqlens.shape)}")
        if cache_seqlens.device != q.device and cache_seqlens.device.type != "cpu":
            raise ValueError(f"cache_seqlens must be on q's device ({q.device}) or the CPU, got {cache_seqlens.device}")
    elif not is_int(cache_seqlens):
        raise TypeError(f"cache_seqlens must be an int or an integer tensor [B], got {type(cache_seqlens).__name__}")
    return _problem(min(B, 1), Nmax, Hq, Hkv, D, segment_lengths, dilation_rates, q.dtype, q.device, scale,
                    head_groups, return_lse, backend)


def _check_memory(k_cache, v_cache, k, v) -> None:
    """The caches and the new rows written into them share no memory (the caches' own rows: _check_layouts)."""
    given = [("k_cache", k_cache), ("v_cache", v_cache)]
    pairs = [("k_cache", k_cache, "v_cache", v_cache, True)]
    if k is not None:
        given += [("k", k), ("v", v)]
        pairs += [(n, x, c, cache, False) for n, x in (("k", k), ("v", v))
                  for c, cache in (("k_cache", k_cache), ("v_cache", v_cache))]
    storage = {name: x.untyped_storage().data_ptr() for name, x in given}
    for a, x, b, y, dense_only in pairs:
        if storage[a] == storage[b] and _share_memory(x, y, dense_only):
            raise ValueError(f"{a} and {b} share memory: the new tokens are written into the caches in place, so "
                             f"they need memory apart from each other's")


def _problem(batch, cache_len, Hq, Hkv, D, segment_lengths, dilation_rates, dtype, device, scale, head_groups,
             return_lse, backend) -> Problem:
    """The problem dispatch decides on: one batch element's sequence as long as the cache, causal, decoding. Warns
    as validate() does where the lists look swapped."""
    p = Problem.from_sizes(batch, cache_len, Hq, Hkv, D, segment_lengths, dilation_rates, dtype=dtype, device=device,
                           causal=True, scale=scale, head_groups=head_groups, return_lse=return_lse, backend=backend,
                           decodes=True)
    warn_if_swapped(p, stacklevel=6)  # -> _problem -> _check_layouts -> validate_kvcache -> the call -> caller
    return p
