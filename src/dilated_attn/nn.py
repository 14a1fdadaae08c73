"""nn.Module front ends, argument-compatible with fkodom's dilated-attention-pytorch 0.2.0.

* `DilatedAttention`: the attention alone, on `[B, N, H, D]` query/key/value.
* `MultiheadDilatedAttention`: q/k/v projections, dilated attention, optional sub-LayerNorm (MAGNETO) and the
  output projection, on `[B, N, embed_dim]`.

Both take dilated-attention-pytorch's constructor arguments in its order (`op` included, and ignored) and
its forward argument names; the arguments it does not have are keyword-only, after `op`. The default
`head_groups="all"` is LongNet's; pass `head_groups="split"` for dilated-attention-pytorch's split heads.

Attention dropout is not part of the spec and no kernel implements it: in training mode with a dropout
probability p > 0 the modules run the pure-PyTorch reference, which drops entries of the merged attention
probabilities (see `dilated_attention_reference`), and warn once that this is slower than the kernel that
would have run. In eval mode, or with p = 0, they dispatch like `dilated_attention`.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Optional, Sequence, cast

import torch
import torch.distributed as dist
from torch import nn

from . import dispatch
from .compile_hints import warn_once
from .functional import dilated_attention, dilated_attention_with_kvcache
from .hilbert import _check_shape, hilbert_index
from .reference import dilated_attention_reference
from .ring import ring_attention
from .ring.layout import check_layout
from .spec import Problem, _int_list, looks_swapped, validate

__all__ = ["DilatedAttention", "MultiheadDilatedAttention", "KVCache"]


class KVCache:
    """The keys and values one attention layer has seen, for decoding token by token (flash-attn's
    `flash_attn_with_kvcache` layout): `k` and `v` are `[batch, max_len, num_kv_heads, head_dim]` buffers, and
    `length` the tokens every batch element holds. `MultiheadDilatedAttention.forward(..., kv_cache=cache)` writes
    the new tokens' keys and values into it and advances `length`; `reset()` empties it for a new prompt."""

    def __init__(self, batch: int, max_len: int, num_kv_heads: int, head_dim: int, device=None, dtype=None):
        shape = tuple(_check_positive_int(name, x) for name, x in
                      (("batch", batch), ("max_len", max_len), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)))
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.length = 0

    def reset(self) -> None:
        self.length = 0

    def __repr__(self) -> str:
        batch, max_len, heads, head_dim = self.k.shape
        return f"KVCache(batch={batch}, length={self.length}/{max_len}, kv_heads={heads}, head_dim={head_dim})"


def _check_positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value}")
    return int(value)


def _check_real(name: str, value, rule: str, ok) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number ({rule}), got {type(value).__name__}")
    if not ok(float(value)):
        raise ValueError(f"{name} must be {rule}, got {value}")
    return float(value)


def _check_dropout(name: str, value, backend) -> float:
    p = _check_real(name, value, "a probability in [0, 1]", lambda x: 0.0 <= x <= 1.0)
    if p > 0 and backend not in ("auto", "reference"):
        raise ValueError(
            f"{name} > 0 needs backend 'auto' or 'reference', got backend={backend!r}: no kernel implements "
            f"dropout, so training runs the reference backend"
        )
    return p


def _check_ordering(spatial_shape, ordering) -> Optional[tuple[int, ...]]:
    """Validate the grid arguments; returns spatial_shape as a tuple of ints (or None)."""
    if not isinstance(ordering, str) or ordering not in ("raster", "hilbert"):
        raise ValueError(f"ordering must be 'raster' or 'hilbert', got {ordering!r}")
    if spatial_shape is None:
        if ordering == "hilbert":
            raise ValueError("ordering='hilbert' needs spatial_shape (the (H, W) or (D, H, W) grid of the sequence)")
        return None
    if not isinstance(spatial_shape, (tuple, list)):  # torch.Size is a tuple
        raise TypeError(f"spatial_shape must be None or a tuple of 2 or 3 ints, got {type(spatial_shape).__name__}")
    if len(spatial_shape) not in (2, 3):
        # hilbert also takes (n,), the identity; as a module argument that is only a confusing no-op
        raise ValueError(f"spatial_shape must have 2 or 3 sizes ((H, W) or (D, H, W)), got {tuple(spatial_shape)}")
    try:
        return _check_shape(spatial_shape)  # hilbert's own checks of the sizes (ints, positive), with our name
    except (TypeError, ValueError) as e:
        raise type(e)(f"spatial_shape: {str(e).removeprefix('shape: ')}") from None


def _ranks(process_group) -> str:
    """How a module's repr names its ring group."""
    if isinstance(process_group, dist.ProcessGroup):
        return f"{process_group.size()} ranks"
    if isinstance(process_group, tuple):
        return f"{process_group[0].size()} x {process_group[1].size()} ranks"
    return f"{' x '.join(map(str, process_group.shape))} mesh"


def _check_ring_args(process_group, layout, dropout: float):
    """Validate the ring arguments of the modules; returns (process_group, layout)."""
    pair = isinstance(process_group, tuple) and len(process_group) == 2 and all(
        isinstance(g, dist.ProcessGroup) for g in process_group)
    if not (process_group is None or isinstance(process_group, dist.ProcessGroup) or pair
            or type(process_group).__name__ == "DeviceMesh"):
        raise TypeError(f"process_group must be None, a torch.distributed.ProcessGroup, or for ring_attention's 2-D "
                        f"mode a 2-D DeviceMesh or a pair (ring_group, heads_group), got "
                        f"{type(process_group).__name__}")
    check_layout(layout)
    if process_group is not None and dropout > 0:
        raise ValueError(f"attention dropout ({dropout}) cannot be combined with process_group: ring_attention has "
                         f"no dropout")
    return process_group, layout


def _check_op(op) -> None:
    # No xformers op is a str or a number: such a value is a keyword-only argument passed by position.
    if isinstance(op, (str, numbers.Number)):
        raise TypeError(f"op is dilated-attention-pytorch's xformers attention op (ignored here), got "
                        f"{type(op).__name__} {op!r}: the arguments after op are keyword-only")


def _check_not_swapped(p: Problem, order: str) -> None:
    """ValueError where the lists look swapped (spec.looks_swapped; the functions warn)."""
    w, r = list(p.segment_lengths), list(p.dilation_rates)
    if looks_swapped(p):
        raise ValueError(f"dilation_rates {r} are each larger than the segment_lengths {w}: every segment would "
                         f"hold at most one position per head; the lists look swapped ({order}, as "
                         f"dilated-attention-pytorch does)")


def _check_attention_args(
    segment_lengths, dilation_rates, *, scale=None, head_groups="all", backend="auto", num_heads=None, num_kv_heads=None
) -> Problem:
    """The spec's own checks of the attention arguments, run at construction on sizes (Problem.from_sizes: no
    tensors), so a bad configuration fails when the module is built, with the functional call's messages. Returns
    the Problem, whose branch lists are normalised to tuples of ints."""
    if num_heads is None:  # unknown until forward: one head per branch passes the "split" rule until then
        num_heads = len(_int_list("segment_lengths", segment_lengths))
    return Problem.from_sizes(1, 1, num_heads, num_kv_heads or num_heads, 1, segment_lengths, dilation_rates,
                              dtype=torch.float32, device="meta", scale=scale, head_groups=head_groups,
                              backend=backend)


class DilatedAttention(nn.Module):
    """LongNet dilated attention (`dilated_attn.dilated_attention`) as a module.

    Args:
        segment_lengths, dilation_rates: the branches `(w_i, r_i)`, positive ints, same length >= 1; not every
            r_i > w_i (ValueError: the lists look swapped).
        softmax_scale: score scale, default `head_dim ** -0.5`.
        attention_dropout: dropout probability on the attention probabilities, in training mode only. With
            p > 0 training runs the reference backend (no kernel implements dropout; a one-time warning says
            so), which drops each entry of the merged softmax over the branches' keys independently and
            scales the kept ones by 1 / (1 - p). Needs `backend` "auto" or "reference".
        op: accepted for dilated-attention-pytorch compatibility and ignored: xformers attention ops do not
            apply here; dilated_attn picks its kernels through `backend`.
    Keyword-only:
        head_groups: "all" (LongNet) or "split" (dilated-attention-pytorch), as in `dilated_attention`.
        backend: "auto", "cuda", "triton", "cudnn", "fa4", "cpu" or "reference", as in `dilated_attention`.
        process_group: None, or a torch.distributed ProcessGroup (`dist.group.WORLD` for all ranks), or a 2-D
            DeviceMesh or a pair (ring_group, heads_group): then the inputs are this rank's shards of a sequence
            split across the group and forward runs `dilated_attn.ring_attention` in the mode its `auto` picks (no
            attention dropout there: ValueError at construction).
        layout: "contiguous" or "zigzag", the sharding of the sequence with a process_group (see
            `ring_attention`).

    `forward(query, key, value, is_causal=False)`: query `[B, N, Hq, D]`, key and value `[B, N, Hkv, D]` with
    `Hq % Hkv == 0`; returns `[B, N, Hq, D]`. (Errors from the call name them q, k and v, as
    `dilated_attention` does.) With `kv_cache=` a `KVCache` (keyword-only), the N inputs are new tokens that follow
    the cache's: decoding, as MultiheadDilatedAttention describes.
    """

    def __init__(
        self,
        segment_lengths: Sequence[int],
        dilation_rates: Sequence[int],
        softmax_scale: Optional[float] = None,
        attention_dropout: float = 0.0,
        op=None,
        *,
        head_groups: str = "all",
        backend: str = "auto",
        process_group=None,
        layout: str = "contiguous",
    ):
        super().__init__()
        _check_op(op)
        p = _check_attention_args(
            segment_lengths, dilation_rates, scale=softmax_scale, head_groups=head_groups, backend=backend
        )
        _check_not_swapped(p, "DilatedAttention takes segment_lengths before dilation_rates")
        self.attention_dropout = _check_dropout("attention_dropout", attention_dropout, backend)
        self.process_group, self.layout = _check_ring_args(process_group, layout, self.attention_dropout)
        self.segment_lengths = p.segment_lengths
        self.dilation_rates = p.dilation_rates
        self.softmax_scale = softmax_scale
        self.head_groups = head_groups
        self.backend = backend

    def forward(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, is_causal: bool = False, *,
        kv_cache: Optional[KVCache] = None,
    ) -> torch.Tensor:
        """Dilated attention of query over key and value, with the module's branches and options.

        Args:
            query: `[B, N, Hq, D]`; key, value: `[B, N, Hkv, D]` with `Hq % Hkv == 0` (with a process_group,
                this rank's shards `[B, L, H, D]` of the sequence).
            is_causal: a query attends only to keys at positions <= its own.
            kv_cache: keyword-only, a `KVCache`: query, key and value are the `Sq` new tokens `[B, Sq, H, D]`
                that follow the cache's `length` ones; key and value are written into the cache, which advances.
                Needs is_causal=True and no grad (torch.no_grad() or torch.inference_mode()).

        Returns:
            `[B, N, Hq, D]` (`[B, Sq, Hq, D]` with kv_cache), query's dtype.
        """
        if kv_cache is not None:
            return self._decode(query, key, value, is_causal, kv_cache)
        args = (query, key, value, self.segment_lengths, self.dilation_rates)
        kwargs: dict[str, Any] = dict(causal=is_causal, scale=self.softmax_scale, head_groups=self.head_groups)
        if self.process_group is not None:  # return_lse=False: the output alone
            return cast(torch.Tensor, ring_attention(*args, **kwargs, group=self.process_group, layout=self.layout,
                                                     backend=self.backend))
        if not (self.training and self.attention_dropout > 0):
            return cast(torch.Tensor, dilated_attention(*args, **kwargs, backend=self.backend))
        # Dispatch as usual (same errors, same fallback warnings), but run the reference, which has dropout.
        usual = dispatch.select(validate(*args, **kwargs, backend=self.backend), self.backend).name
        if usual != "reference":
            warn_once(
                f"dilated_attn: attention_dropout={self.attention_dropout} in training mode runs the reference "
                f"backend instead of {usual} (no kernel implements dropout; slower)"
            )
        out, _ = dilated_attention_reference(*args, **kwargs, dropout_p=self.attention_dropout)
        return out

    def _decode(self, query, key, value, is_causal, cache: KVCache) -> torch.Tensor:
        """The new tokens query, key, value `[B, Sq, H, D]` after the `cache.length` cached ones: key and value
        written into the cache, then causal attention over it (dilated_attention_with_kvcache)."""
        if not isinstance(cache, KVCache):
            raise TypeError(f"kv_cache must be a dilated_attn.KVCache, got {type(cache).__name__}")
        if not is_causal:
            raise ValueError("kv_cache needs is_causal=True: a new token attends to the cached ones before it")
        if self.process_group is not None:
            raise ValueError("kv_cache cannot be combined with process_group: decoding runs on one process")
        if torch.is_grad_enabled():
            raise ValueError("kv_cache decoding is inference only: run it under torch.no_grad() or "
                             "torch.inference_mode()")
        if not (isinstance(key, torch.Tensor) and isinstance(value, torch.Tensor)):
            raise TypeError("kv_cache decoding writes the new tokens' keys and values into the cache: key and value "
                            f"must be tensors, got {type(key).__name__} and {type(value).__name__}")
        batch, _, kv_heads, head_dim = cache.k.shape
        if key.dim() == 4 and (key.shape[0], key.shape[2], key.shape[3]) != (batch, kv_heads, head_dim):
            raise ValueError(f"kv_cache was built for batch={batch}, num_kv_heads={kv_heads}, head_dim={head_dim}, "
                             f"but this layer's new keys have batch={key.shape[0]}, {key.shape[2]} kv heads of "
                             f"head_dim {key.shape[3]}: build the KVCache with those")
        out = dilated_attention_with_kvcache(query, cache.k, cache.v, cache.length, self.segment_lengths,
                                             self.dilation_rates, k=key, v=value, scale=self.softmax_scale,
                                             head_groups=self.head_groups, backend=self.backend)
        cache.length += query.shape[1]
        return cast(torch.Tensor, out)  # return_lse=False: the output alone

    def extra_repr(self) -> str:
        return (
            f"segment_lengths={self.segment_lengths}, dilation_rates={self.dilation_rates}, "
            f"softmax_scale={self.softmax_scale}, attention_dropout={self.attention_dropout}, "
            f"head_groups={self.head_groups!r}, backend={self.backend!r}"
            + (f", process_group=<{_ranks(self.process_group)}>, layout={self.layout!r}"
               if self.process_group is not None else "")
        )


class MultiheadDilatedAttention(nn.Module):
    """Multi-head dilated attention with projections, laid out as in fkodom's dilated-attention-pytorch: the
    same arguments and parameter names (q_proj, k_proj, v_proj, norm, out_proj), so its state_dicts load.

    `forward(query, key=None, value=None, is_causal=False)` on `[B, N, embed_dim]` (key and value default to
    query: self-attention) returns `(out [B, N, embed_dim], None)`:

        q = q_proj(query), k = k_proj(key), v = v_proj(value), split into heads of head_dim = embed_dim / num_heads
        x = DilatedAttention(q, k, v), heads merged back       (dropout: see DilatedAttention)
        out = out_proj(norm(x))                                 (norm: LayerNorm, when layer_norm=True)

    Parameters are initialised as in MAGNETO (arXiv:2210.06423): xavier_normal_ weights, with gain
    `gamma_init` for v_proj and out_proj, zero biases.

    `dilation_rates` come before `segment_lengths` here (as in dilated-attention-pytorch; DilatedAttention and
    `dilated_attention` take segment_lengths first); not every r_i > w_i (ValueError: the lists look swapped).
    `dropout` is the attention dropout probability. `op` is accepted and ignored: xformers attention ops do
    not apply here; dilated_attn picks its kernels through `backend`.

    Keyword-only args beyond dilated-attention-pytorch's: `num_kv_heads` (GQA/MQA: k_proj and v_proj produce
    `num_kv_heads * head_dim` features; default num_heads), `head_groups` and `backend` (see
    `dilated_attention`).

    Decoding: `forward(query, is_causal=True, kv_cache=cache)` with a `dilated_attn.KVCache` (batch, max_len,
    num_kv_heads, head_dim) takes the new tokens `[B, Sq, embed_dim]` that follow the cache's `length` tokens,
    writes their keys and values into it and returns their outputs, as a causal forward over the whole sequence
    would (dilated_attention_with_kvcache; inference only, under torch.no_grad()).

    Sequence parallel: `process_group` and `layout` as in DilatedAttention (forward then takes this rank's
    shards of query/key/value, and the projections act on the shards).

    Grid inputs:
        spatial_shape: None, or the grid `(H, W)` / `(D, H, W)` (positive ints) whose row-major flattening is
            the sequence: every forward input must then have `N == prod(spatial_shape)` (ValueError otherwise).
        ordering: "raster" (default) attends in the given row-major order. "hilbert" (needs spatial_shape)
            reorders query, key and value along the generalized Hilbert curve of the grid
            (`dilated_attn.hilbert.serialize`) before the projections, attends in curve order, and puts the
            output back in row-major order (`deserialize`), so callers see the same layout as with "raster".
            Each segment of w consecutive positions is then a compact patch of the grid rather than a stripe
            of rows. With `is_causal=True`, causality follows the CURVE: a position attends to the positions
            at or before it on the Hilbert curve, not to those before it in row-major order.
    Projections and LayerNorm act per token, so permuting the tokens before them and after out_proj is the
    same as permuting q/k/v and the attention output; the permutation is a non-persistent buffer (moves with
    the module, not in the state_dict, so checkpoints do not depend on the ordering).
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        dilation_rates: Sequence[int],
        segment_lengths: Sequence[int],
        dropout: float = 0.0,
        bias: bool = True,
        layer_norm: bool = True,
        layer_norm_eps: float = 1e-5,
        gamma_init: float = 1.0,
        device=None,
        dtype=None,
        op=None,
        *,
        num_kv_heads: Optional[int] = None,
        head_groups: str = "all",
        backend: str = "auto",
        spatial_shape: Optional[Sequence[int]] = None,
        ordering: str = "raster",
        process_group=None,
        layout: str = "contiguous",
    ):
        super().__init__()
        _check_op(op)
        self.spatial_shape = _check_ordering(spatial_shape, ordering)
        if process_group is not None and spatial_shape is not None:
            raise ValueError("spatial_shape (and ordering='hilbert') cannot be combined with process_group: the grid "
                             "is the global sequence, each rank holds a shard of it; serialise the grid before "
                             "sharding instead (dilated_attn.hilbert.serialize, then dilated_attn.shard)")
        self.ordering = ordering
        embed_dim = _check_positive_int("embed_dim", embed_dim)
        num_heads = _check_positive_int("num_heads", num_heads)
        if embed_dim % num_heads != 0:
            raise ValueError(f"embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads})")
        num_kv_heads = num_heads if num_kv_heads is None else _check_positive_int("num_kv_heads", num_kv_heads)
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"num_heads ({num_heads}) must be divisible by num_kv_heads ({num_kv_heads})")
        # The head count is known here, so "split" is checked against the branches at construction.
        p = _check_attention_args(
            segment_lengths, dilation_rates, head_groups=head_groups, backend=backend, num_heads=num_heads,
            num_kv_heads=num_kv_heads,
        )
        _check_not_swapped(p, "MultiheadDilatedAttention takes dilation_rates before segment_lengths")
        dropout = _check_dropout("dropout", dropout, backend)
        for name, flag in (("bias", bias), ("layer_norm", layer_norm)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
        layer_norm_eps = _check_real("layer_norm_eps", layer_norm_eps, "positive", lambda x: x > 0)
        self.gamma_init = _check_real("gamma_init", gamma_init, "finite", math.isfinite)
        self.embed_dim, self.num_heads, self.num_kv_heads = embed_dim, num_heads, num_kv_heads
        self.head_dim = embed_dim // num_heads
        self.layer_norm = layer_norm
        factory = dict(device=device, dtype=dtype)
        kv_dim = num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **factory)
        self.k_proj = nn.Linear(embed_dim, kv_dim, bias=bias, **factory)
        self.v_proj = nn.Linear(embed_dim, kv_dim, bias=bias, **factory)
        self.attention = DilatedAttention(
            segment_lengths, dilation_rates, attention_dropout=dropout, head_groups=head_groups, backend=backend,
            process_group=process_group, layout=layout,
        )
        self.norm = nn.LayerNorm(embed_dim, eps=layer_norm_eps, **factory) if layer_norm else None
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **factory)
        self._reset_parameters()
        if ordering == "hilbert":
            self._fill_curve(device)

    def _fill_curve(self, device) -> None:
        # The permutation lives in buffers rather than being looked up per call: hilbert's cache is a Python
        # lru_cache keyed by device, which torch.compile cannot trace, while a buffer is a plain graph input
        # that follows .to(). Non-persistent: the ordering has no parameters, so checkpoints do not depend on it.
        # a copy of the shared cache entry: a module's buffers are its own to change
        perm = hilbert_index(cast(Sequence[int], self.spatial_shape), device).clone()  # set: ordering "hilbert"
        self.register_buffer("_curve_perm", perm, persistent=False)
        # Undo with index_select by the inverse (argsort of a permutation) rather than a scatter by perm.
        self.register_buffer("_curve_inverse", torch.argsort(perm), persistent=False)

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        # Refill the curve buffers after every conversion: to_empty() (meta-device init, then load_state_dict)
        # leaves buffers uninitialised, the state_dict does not restore non-persistent ones, and a garbage (or
        # all-zero) permutation would silently scramble the output.
        if self.ordering == "hilbert":
            self._fill_curve(self._curve_perm.device)
        return self

    def _reset_parameters(self) -> None:
        # MAGNETO, Fig. 2: the gain (set by the caller, who knows the depth of the model) scales only the value
        # and output projections.
        for proj, gain in ((self.q_proj, 1.0), (self.k_proj, 1.0), (self.v_proj, self.gamma_init),
                           (self.out_proj, self.gamma_init)):
            nn.init.xavier_normal_(proj.weight, gain=gain)
            if proj.bias is not None:
                nn.init.zeros_(proj.bias)

    def forward(
        self,
        query: torch.Tensor,
        key: Optional[torch.Tensor] = None,
        value: Optional[torch.Tensor] = None,
        is_causal: bool = False,
        *,
        kv_cache: Optional[KVCache] = None,
    ) -> tuple[torch.Tensor, None]:
        """Project, attend and project back, as the class docstring writes it out.

        Args:
            query: `[B, N, embed_dim]`; key, value: `[B, N, embed_dim]`, default query (self-attention). With a
                process_group, this rank's shards `[B, L, embed_dim]`; with spatial_shape, `N == prod(spatial_shape)`.
            is_causal: a token attends only to those at or before it (along the Hilbert curve with
                ordering="hilbert").
            kv_cache: keyword-only, a `KVCache` (batch, max_len, num_kv_heads, head_dim): query holds the new
                tokens `[B, Sq, embed_dim]` after the cache's `length` ones; their keys and values are written
                into it and it advances. Needs is_causal=True and no grad; not with ordering="hilbert".

        Returns:
            `(out, None)`, out `[B, N, embed_dim]` (`[B, Sq, embed_dim]` with kv_cache): the pair
            dilated-attention-pytorch returns (no attention weights).
        """
        if kv_cache is not None and self.ordering == "hilbert":
            raise ValueError("kv_cache decodes a sequence token by token; ordering='hilbert' reorders a whole grid")
        key = query if key is None else key
        value = query if value is None else value
        for name, x in (("query", query), ("key", key), ("value", value)):
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
            if x.dim() != 3 or x.shape[-1] != self.embed_dim:
                raise ValueError(f"{name} must be [batch, seq, embed_dim={self.embed_dim}], got {tuple(x.shape)}")
            if self.spatial_shape is not None and kv_cache is None and x.shape[1] != math.prod(self.spatial_shape):
                raise ValueError(f"{name} has sequence length {x.shape[1]}, but spatial_shape {self.spatial_shape} "
                                 f"holds {math.prod(self.spatial_shape)} positions")
        if self.ordering == "hilbert":
            # key and value share query's positions (self-attention), so one permutation serves all three;
            # an input passed more than once is permuted once.
            perm = cast(torch.Tensor, self._curve_perm)  # x.index_select(1, perm) == hilbert.serialize(x, spatial_shape)
            q_in = query.index_select(1, perm)
            k_in = q_in if key is query else key.index_select(1, perm)
            value = q_in if value is query else k_in if value is key else value.index_select(1, perm)
            query, key = q_in, k_in
        q = self.q_proj(query).unflatten(-1, (self.num_heads, self.head_dim))
        k = self.k_proj(key).unflatten(-1, (self.num_kv_heads, self.head_dim))
        v = self.v_proj(value).unflatten(-1, (self.num_kv_heads, self.head_dim))
        x = self.attention(q, k, v, is_causal=is_causal, kv_cache=kv_cache).flatten(-2)
        if self.norm is not None:
            x = self.norm(x)
        out = self.out_proj(x)
        if self.ordering == "hilbert":
            out = out.index_select(1, self._curve_inverse)  # back to row-major: == hilbert.deserialize
        return out, None

    def extra_repr(self) -> str:
        if self.spatial_shape is None:
            return ""
        return f"spatial_shape={self.spatial_shape}, ordering={self.ordering!r}"
