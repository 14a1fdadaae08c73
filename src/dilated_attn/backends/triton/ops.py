"""Launchers of the Triton kernels and their `torch.library.triton_op` registrations.

`torch.ops.dilated_attn.triton_forward` / `triton_backward` are triton ops, so torch.compile traces through them
into the kernels without graph breaks; autograd is registered on the forward op. Importing this module imports
triton and compiles nothing; the package imports it on first use (`dilated_attn.backends.triton.load_error`).
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass, field

import torch
import triton
from torch.library import triton_op, wrap_triton

from ...branches import branch_table, covers_everything
from ...hilbert import hilbert_index
from ..autograd import register_attention_autograd
from ..decoding import branch_rows, cache_lengths, workspace
from ..signature import backward_op, forward_op
from . import block_d, configs, float32_precision, interpreting
from .bwd import DKDV, DQ, _delta_kernel
from .configs import launch, launch_plain, make_key
from .decode import _decode_kernel
from .fwd import FORWARD

LOG2E = 1.4426950408889634


TILE_ORDERS = ("plain", "segment", "hilbert")
# The order in which the forward kernel's programs visit the (batch, head, segment) tiles of a branch (the
# query blocks of one tile always run together, sharing its K/V in L2):
#   plain    batch, head, segment (row-major)
#   segment  batch, segment, head: the heads of a segment together (GQA heads share K/V rows)
#   hilbert  along a generalized Hilbert curve over the (head, segment) grid of each batch
#   auto     (default) hilbert where it measurably won, plain elsewhere: see auto_tile_order
# DILATED_ATTN_TILE_ORDER sets it at import; `dilated_attn.backends.triton.ops.TILE_ORDER = ...` at any time.
TILE_ORDER = os.environ.get("DILATED_ATTN_TILE_ORDER", "auto")


def auto_tile_order(seq_len: int, num_heads: int, num_kv_heads: int) -> str:
    """The order "auto" uses: hilbert where it beat plain by more than the run-to-run spread (N >= 262144, and
    N >= 65536 with GQA), plain elsewhere (benchmarks/README.md, "Tile order and Hilbert locality")."""
    if seq_len >= 262144 or (num_kv_heads < num_heads and seq_len >= 65536):
        return "hilbert"
    return "plain"


@functools.lru_cache(maxsize=256)
def tile_order(order: str, batch: int, n_heads: int, n_seg: int, device: torch.device) -> torch.Tensor:
    """int32 table: position i of the visiting order -> row-major tile index (b * n_heads + h) * n_seg + seg."""
    if order not in TILE_ORDERS:
        raise ValueError(f"tile order must be one of {TILE_ORDERS}, got {order!r}")
    per_batch = n_heads * n_seg
    if order == "segment":
        grid = torch.arange(per_batch).view(n_heads, n_seg).T.reshape(-1)  # segment-major
    elif order == "hilbert":
        grid = hilbert_index((n_heads, n_seg)).cpu() if n_heads > 1 and n_seg > 1 else torch.arange(per_batch)
    else:
        grid = torch.arange(per_batch)
    table = (torch.arange(batch).view(-1, 1) * per_batch + grid.view(1, -1)).reshape(-1)
    return table.to(device=device, dtype=torch.int32)


TUNABLES = (FORWARD, DKDV, DQ)


def tf32x3_fits(shared_memory_limit: int, tile_d: int) -> bool:
    """Every kernel has a config whose tiles, with tf32x3's second copy of the resident ones, fit the limit."""
    return all(min(t.shared_memory(c, tile_d, 4, "tf32x3") for c in t.candidates_for("tf32x3")) <= shared_memory_limit
               for t in TUNABLES)


def _precision(q: torch.Tensor) -> str:
    return float32_precision(q.device, q.shape[-1]) if q.dtype == torch.float32 else "tf32"


def _rows_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _common(q, k, segment_lengths, dilation_rates, split_heads, cu_seqlens, max_seqlen, head_start=0,
            global_heads=0):
    """The branch table, the kernels' shared flags, and the batches or packed sequences the grid runs over."""
    B, N, H, D = q.shape
    varlen = cu_seqlens is not None
    # packed sequences: segments clipped to the longest sequence here, to each one's length in the kernels
    table = branch_table(segment_lengths, dilation_rates, max_seqlen if varlen else N, H,
                         "split" if split_heads else "all", head_start, global_heads)
    tile_d = block_d(D)
    meta = dict(GROUP=H // k.shape[2], HEAD_DIM=D, BLOCK_D=tile_d, EVEN_D=tile_d == D, VARLEN=varlen)
    sequences = cu_seqlens.numel() - 1 if varlen else B
    return table, meta, sequences, max_seqlen if varlen else N


def _placeholder_int32(device) -> torch.Tensor:
    """An int32 argument the kernel never reads (the tile order when not ordered, the offsets without VARLEN).
    A fresh tensor, not a view of another argument: under torch.compile, arguments aliasing a tensor the kernel
    writes gave wrong results (the functionalised kernel's writes do not all reach the output)."""
    return torch.empty(1, dtype=torch.int32, device=device)


def _branch_geometry(br, N):
    """Segments of the branch, the most members one segment has, and that count's bucket (configs.py)."""
    max_members = -(-br.seg_len // br.dilation)
    return math.ceil(N / br.seg_len), max_members, configs.members_bucket(max_members)


@forward_op("triton_forward", triton=True)
def triton_forward(q, k, v, segment_lengths, dilation_rates, split_heads, causal, scale, head_start=0, global_heads=0):
    return _forward(q, k, v, segment_lengths, dilation_rates, split_heads, causal, scale,
                    head_start=head_start, global_heads=global_heads)


@forward_op("triton_varlen_forward", packed=True, triton=True)
def triton_varlen_forward(q, k, v, cu_seqlens, max_seqlen, segment_lengths, dilation_rates, split_heads, causal, scale,
                          head_start=0, global_heads=0):
    """Packed sequences: q `[T, Hq, D]` -> out `[T, Hq, D]`, lse `[Hq, T]`; one launch per branch for the pack."""
    if q.shape[0] == 0 or max_seqlen == 0:  # no token, or only empty sequences: nothing to launch
        return (torch.zeros(q.shape, dtype=q.dtype, device=q.device),
                torch.full((q.shape[1], q.shape[0]), -math.inf, dtype=torch.float32, device=q.device))
    out, lse = _forward(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), segment_lengths, dilation_rates, split_heads,
                        causal, scale, cu_seqlens.to(torch.int32), max_seqlen, head_start, global_heads)
    return out[0], lse[0]


def _forward(q, k, v, segment_lengths, dilation_rates, split_heads, causal, scale, cu_seqlens=None, max_seqlen=0,
             head_start=0, global_heads=0):
    q, k, v = _rows_contiguous(q), _rows_contiguous(k), _rows_contiguous(v)
    B, N, H, D = q.shape
    table, meta, sequences, length = _common(q, k, segment_lengths, dilation_rates, split_heads, cu_seqlens,
                                             max_seqlen, head_start, global_heads)
    if covers_everything(table[0], H):  # the first branch writes every row: no fill needed
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        lse = torch.empty((B, H, N), dtype=torch.float32, device=q.device)
    else:
        out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
        lse = torch.full((B, H, N), -math.inf, dtype=torch.float32, device=q.device)
    order = auto_tile_order(N, H, k.shape[2]) if TILE_ORDER == "auto" else TILE_ORDER
    unread = _placeholder_int32(q.device)
    precision = _precision(q)
    if torch.compiler.is_compiling() or cu_seqlens is not None:
        # the order tables are cached host-side objects, which a traced graph cannot hold; packed sequences
        # are visited in their order
        order = "plain"
    for i, br in enumerate(table):
        n_seg, max_members, bucket = _branch_geometry(br, length)
        n_heads = br.head_hi - br.head_lo
        programs = sequences * n_heads * n_seg

        def grid(m, programs=programs, max_members=max_members):
            return (programs * triton.cdiv(max_members, m["BLOCK_M"]),)

        ordered = order != "plain" and programs > 1
        launch(
            FORWARD, grid, make_key(q, precision, meta["BLOCK_D"], causal, max_members),
            q, k, v, out, lse, tile_order(order, B, n_heads, n_seg, q.device) if ordered else unread,
            unread if cu_seqlens is None else cu_seqlens,
            q.stride(0), q.stride(1), q.stride(2),
            k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2),
            out.stride(0), out.stride(1), out.stride(2),
            N, H, br.seg_len, br.dilation, n_seg, br.head_lo, n_heads, br.offset_div, br.offset_base, max_members,
            scale * LOG2E, scale < 0,
            first_branch=int(i == 0), ordered=int(ordered),  # ints (a bool argument would be an i1)
            CAUSAL=causal, PRECISION=precision, MAX_MEMBERS_BUCKET=bucket, **meta,
        )
    return out, lse


@backward_op("triton_backward", triton=True)
def triton_backward(grad_out, grad_lse, q, k, v, out, lse, segment_lengths, dilation_rates, split_heads, causal,
                    scale, head_start=0, global_heads=0):
    return _backward(grad_out, grad_lse, q, k, v, out, lse, segment_lengths, dilation_rates, split_heads, causal,
                     scale, head_start=head_start, global_heads=global_heads)


@backward_op("triton_varlen_backward", packed=True, triton=True)
def triton_varlen_backward(grad_out, grad_lse, q, k, v, out, lse, cu_seqlens, max_seqlen, segment_lengths,
                           dilation_rates, split_heads, causal, scale, head_start=0, global_heads=0):
    if q.shape[0] == 0 or max_seqlen == 0:
        return tuple(torch.zeros(x.shape, dtype=x.dtype, device=x.device) for x in (q, k, v))
    dq, dk, dv = _backward(grad_out.unsqueeze(0), None if grad_lse is None else grad_lse.unsqueeze(0), q.unsqueeze(0),
                           k.unsqueeze(0), v.unsqueeze(0), out.unsqueeze(0), lse.unsqueeze(0), segment_lengths,
                           dilation_rates, split_heads, causal, scale, cu_seqlens.to(torch.int32), max_seqlen,
                           head_start, global_heads)
    return dq[0], dk[0], dv[0]


def _backward(grad_out, grad_lse, q, k, v, out, lse, segment_lengths, dilation_rates, split_heads, causal, scale,
              cu_seqlens=None, max_seqlen=0, head_start=0, global_heads=0):
    q, k, v = _rows_contiguous(q), _rows_contiguous(k), _rows_contiguous(v)
    grad_out, out = _rows_contiguous(grad_out.to(q.dtype)), _rows_contiguous(out)
    B, N, H, D = q.shape
    Hkv = k.shape[2]
    table, meta, sequences, length = _common(q, k, segment_lengths, dilation_rates, split_heads, cu_seqlens,
                                             max_seqlen, head_start, global_heads)
    lse = lse.to(torch.float32).contiguous()
    delta = torch.empty((B, H, N), dtype=torch.float32, device=q.device)
    has_dlse = grad_lse is not None
    dlse = grad_lse.to(torch.float32).contiguous() if has_dlse else delta
    block = 16 if interpreting() else 64
    launch_plain(
        _delta_kernel, (B * H, triton.cdiv(N, block)), out, grad_out, dlse, delta,
        out.stride(0), out.stride(1), out.stride(2),
        grad_out.stride(0), grad_out.stride(1), grad_out.stride(2),
        N, H, HEAD_DIM=D, BLOCK_D=meta["BLOCK_D"], HAS_DLSE=has_dlse, BLOCK=block,
    )
    # The gradients accumulate across branches in place (fp32 within a branch): no gradient-sized
    # scratch. Zero-filled because positions no branch covers get no contribution, unless the first branch
    # covers them all and stores rather than adds.
    first_stores = covers_everything(table[0], H)
    new = torch.empty if first_stores else torch.zeros
    dq = new(q.shape, dtype=q.dtype, device=q.device)
    dk = new(k.shape, dtype=k.dtype, device=q.device)
    dv = new(v.shape, dtype=v.dtype, device=q.device)
    strides = (
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        grad_out.stride(0), grad_out.stride(1), grad_out.stride(2),
    )
    precision = _precision(q)
    flags = dict(CAUSAL=causal, PRECISION=precision, **meta)
    offsets = _placeholder_int32(q.device) if cu_seqlens is None else cu_seqlens
    for i, br in enumerate(table):
        n_seg, max_members, bucket = _branch_geometry(br, length)
        n_heads = br.head_hi - br.head_lo
        accumulate = int(i > 0 or not first_stores)  # an int (a bool argument would be an i1)

        def kv_grid(m, programs=sequences * Hkv * n_seg, max_members=max_members):
            return (programs * triton.cdiv(max_members, m["BLOCK_N"]),)

        key = make_key(q, precision, meta["BLOCK_D"], causal, max_members)
        launch(
            DKDV, kv_grid, key, q, k, v, grad_out, lse, delta, dk, dv, offsets, *strides,
            dk.stride(0), dk.stride(1), dk.stride(2),
            N, H, Hkv, br.seg_len, br.dilation, n_seg, br.head_lo, br.head_hi, br.offset_div, br.offset_base,
            max_members, accumulate, scale, scale * LOG2E, MAX_MEMBERS_BUCKET=bucket, **flags,
        )

        def q_grid(m, programs=sequences * n_heads * n_seg, max_members=max_members):
            return (programs * triton.cdiv(max_members, m["BLOCK_M"]),)

        launch(
            DQ, q_grid, key, q, k, v, grad_out, lse, delta, dq, offsets, *strides,
            dq.stride(0), dq.stride(1), dq.stride(2),
            N, H, br.seg_len, br.dilation, n_seg, br.head_lo, n_heads, br.offset_div, br.offset_base, max_members,
            accumulate, scale, scale * LOG2E, MAX_MEMBERS_BUCKET=bucket, **flags,
        )
    return dq, dk, dv


register_attention_autograd("dilated_attn::triton_forward", "triton_backward")
register_attention_autograd("dilated_attn::triton_varlen_forward", "triton_varlen_backward")


_prepared: set = set()


def collect_launches(q, k, v, p, backward: bool) -> list:
    """The Triton launches (kernel, grid, args, kwargs) a call on these inputs makes, its backward's too with
    `backward`: the launchers run with their launches recorded instead of made (configs.collecting)."""
    args = p.op_arguments()
    with torch.no_grad(), configs.collecting() as launches:
        out, lse = triton_forward(q, k, v, **args)  # out and lse are left unwritten: nothing is launched
        if backward:
            triton_backward(out, None, q, k, v, out, lse, **args)
    return launches


def prepare(q, k, v, p, backward: bool) -> None:
    """Compile the kernels a call on these inputs launches (and its backward's, with `backward`) all at once, in
    parallel, the first time this process meets such a call; eager calls only (torch.compile compiles its own).

    What is compiled is exactly what the call launches (collect_launches); a later call whose kernels differ only
    in what Triton specialises on (an unaligned stride, say) compiles those on launch, one after another."""
    if interpreting() or torch.compiler.is_compiling() or q.numel() == 0:
        return
    buckets = tuple(sorted({_branch_geometry(br, p.seq_len)[2] for br in p.branches}))
    precision = _precision(q)
    family = (q.device, q.dtype, p.head_dim, p.causal, precision, p.scale < 0, buckets, backward, configs.AUTOTUNE)
    if family in _prepared:
        return
    _prepared.add(family)
    what = str(q.dtype).removeprefix("torch.") + (f" ({precision} products)" if q.dtype == torch.float32 else "")
    configs.precompile(collect_launches(q, k, v, p, backward),
                       f"{what}, head dim {p.head_dim}{', causal' if p.causal else ''}")


# The decode kernel's block of keys, warps, pipeline depth and register cap (maxnreg: None leaves the compiler its
# choice, which takes every register it may and so fits two programs on an SM), and the programs it aims for (the keys
# of each (batch element, new token) are split into shares to reach it). benchmarks/bench_decode.py --sweep measures
# them.
DECODE_CONFIG = dict(BLOCK_N=32, num_warps=4, num_stages=3, maxnreg=None)
DECODE_PROGRAMS = 256
DECODE_MAX_SPLITS = 256  # bounds the workspace of a call of few tokens


@dataclass(frozen=True)
class _DecodeLayout:
    """What a decode launch derives from its tensors' layouts and sizes alone, the same every step of a decoding
    loop: the grid, the workspace's sizes, the kernel's arguments after cache_len (its ints and constexprs) and its
    options."""

    grid: tuple
    sizes: tuple
    arguments: tuple
    options: dict
    # (device index, cache_seqlens' dtype) -> the eager launch of the kernel compiled for this layout (_launch_decode)
    launches: dict = field(default_factory=dict, compare=False)


def _decode_layout(q, k_cache, v_cache, k, v, n_branches: int, scale: float, per_batch: bool, append: bool,
                   return_lse: bool) -> _DecodeLayout:
    B, Sq, H, D = q.shape
    Hkv = k_cache.shape[2]
    tile_d, group = block_d(D), H // Hkv
    programs = B * Sq  # one per (batch element, new token), times the shares of its keys
    splits = 2 if interpreting() else min(DECODE_MAX_SPLITS, triton.cdiv(DECODE_PROGRAMS, programs))
    queries = programs * H
    new_strides = (*k.stride(), *v.stride()) if append else (0, 0, 0, 1) * 2  # not read without APPEND
    strides = (q.stride(0), q.stride(1), q.stride(2), *k_cache.stride(), *v_cache.stride(), *new_strides,
               Sq * H * D, H * D, D)  # out: made contiguous
    ints = (*strides, Sq, H, n_branches, k_cache.shape[1] - 1)
    config = dict(DECODE_CONFIG, BLOCK_N=16, num_warps=1) if interpreting() else DECODE_CONFIG
    constexprs = (D, per_batch, append, "ieee" if q.dtype == torch.float32 else "tf32",
                  triton.next_power_of_2(max(2, n_branches)), max(16, triton.next_power_of_2(group)), tile_d,
                  config["BLOCK_N"], triton.next_power_of_2(Hkv))
    options = {name: value for name, value in config.items() if name != "BLOCK_N" and value is not None}
    return _DecodeLayout((programs, splits), (queries * splits * 2, queries * splits * tile_d, programs * Hkv,
                                              0 if return_lse else queries),
                         (*ints, scale * LOG2E, group, *constexprs), options)


_DECODE_LAYOUTS: dict = {}  # layout key -> _DecodeLayout, at most MAX_DECODE_LAYOUTS
MAX_DECODE_LAYOUTS = 256


def _decode(q, k_cache, v_cache, k, v, cache_seqlens, cache_len, branches, scale, return_lse, launch=None):
    """New queries q `[B, Sq, Hq, D]` at positions cache_seqlens[b] + i (cache_len + i without cache_seqlens)
    over the cache, after k, v (where given) are written into it at those rows: (out, the lse `[B, Hq, Sq]` where
    `return_lse`, else None), in one launch (decode.py): through `launch` (wrap_triton, traced), else eagerly
    (_launch_decode)."""
    q = _rows_contiguous(q)  # the kernel reads q's rows with unit stride (the caches and k, v with theirs)
    append = k is not None
    if not append:  # k and v are not read (APPEND=False): q stands in for them (no tensor the kernel writes)
        k, v = q, q
    per_batch = cache_seqlens is not None
    layout_of = functools.partial(_decode_layout, q, k_cache, v_cache, k, v, branches.shape[0], scale, per_batch,
                                  append, return_lse)
    if launch is not None:  # traced once per graph: nothing to keep
        layout = layout_of()
    else:
        key = (q.shape, q.stride(), k_cache.shape, k_cache.stride(), v_cache.stride(), k.stride() if append else None,
               v.stride() if append else None, branches.shape[0], scale, per_batch, return_lse, q.dtype,
               interpreting(), DECODE_PROGRAMS, tuple(DECODE_CONFIG.items()))
        layout = _DECODE_LAYOUTS.get(key)
        if layout is None:
            if len(_DECODE_LAYOUTS) >= MAX_DECODE_LAYOUTS:
                _DECODE_LAYOUTS.clear()
            layout = _DECODE_LAYOUTS[key] = layout_of()
    out = torch.empty_like(q, memory_format=torch.contiguous_format)  # half torch.empty's host time on an H200's host
    stats, partial, counters, spare_lse = workspace(q.device, *layout.sizes, keep=launch is None)
    lse = torch.empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32,
                      device=q.device) if return_lse else spare_lse
    lengths = cache_seqlens if per_batch else branches  # without PER_BATCH not read: the branch table stands in
    tensors = (q, k_cache, v_cache, k, v, out, lse, stats, partial, counters, lengths, branches)
    if launch is not None:
        launch(_decode_kernel)[layout.grid](*tensors, cache_len, *layout.arguments, **layout.options)
    else:
        _launch_decode(layout, tensors, cache_len)
    return out, lse if return_lse else None


# Eager decode launches: the launcher of the kernel compiled for a layout, called directly (Triton's JIT function
# spends more host time binding and specialising a call's arguments than the kernel takes on the GPU), with the
# tensors' addresses as ints (for a tensor the launcher asks the driver where its memory lies: 2.7 us of 10.8 a call on
# an H200's host). The tensors are on the current device: validate_kvcache puts them on q's, checked below. Only for
# the Triton versions whose launcher this was written against, and only where the call's specialisation is the
# compiled one's: the same ints (the layout's, and cache_len, unspecialised, of 32 bits), every tensor 16-byte aligned,
# and the current device the tensors'. Anything else runs the JIT function.
DIRECT_TRITON_VERSIONS = ("3.6",)
_DIRECT_VERSION = triton.__version__.rsplit(".", 1)[0] in DIRECT_TRITON_VERSIONS


def _launch_decode(layout: _DecodeLayout, tensors: tuple, cache_len: int) -> None:
    device = tensors[0].device
    if (device.type == "cuda" and 0 <= cache_len < 2**31 and _DIRECT_VERSION
            and torch._C._cuda_getDevice() == device.index):
        pointers = [x.data_ptr() for x in tensors]
        if all(pointer % 16 == 0 for pointer in pointers):
            key = (device.index, tensors[10].dtype)
            launch = layout.launches.get(key)
            if launch is not None:
                launch(torch._C._cuda_getCurrentRawStream(device.index), pointers, cache_len)
                return
            compiled = _decode_kernel[layout.grid](*tensors, cache_len, *layout.arguments, **layout.options)
            launch = _direct_launch(compiled, layout)
            if launch is not None:
                layout.launches[key] = launch
            return
    _decode_kernel[layout.grid](*tensors, cache_len, *layout.arguments, **layout.options)


def _direct_launch(compiled, layout: _DecodeLayout):
    """launch(stream, pointers, cache_len) of `compiled` over the layout's grid and ints, or None where the compiled
    kernel lacks what it calls. Past the launcher's Python wrapper where that would only find no scratch memory to
    allocate (1.1 us a call)."""
    run = getattr(compiled, "run", None)
    if run is None or not all(hasattr(compiled, name) for name in ("function", "packed_metadata")):
        return None
    grid, function, metadata, arguments = (*layout.grid, 1), compiled.function, compiled.packed_metadata, layout.arguments
    flags = tuple(getattr(run, name, None) for name in ("launch_cooperative_grid", "launch_pdl"))
    if (hasattr(run, "launch") and None not in flags
            and getattr(run, "global_scratch_size", None) == 0 and getattr(run, "profile_scratch_size", None) == 0):
        launch = run.launch
        return lambda stream, pointers, cache_len: launch(*grid, stream, function, *flags, None, None, metadata, None,
                                                          None, None, *pointers, cache_len, *arguments)
    return lambda stream, pointers, cache_len: run(*grid, stream, function, metadata, None, None, None, *pointers,
                                                   cache_len, *arguments)


# The op torch.compile traces. An eager decoding call launches the kernel itself, past the op and wrap_triton:
# their dispatch costs more host time than the kernel takes on the GPU, and a decode step is bound by latency.
@triton_op("dilated_attn::triton_decode", mutates_args=("k_cache", "v_cache"))
def triton_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    cache_seqlens: torch.Tensor | None,
    cache_len: int,
    branches: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse = _decode(q, k_cache, v_cache, k, v, cache_seqlens, cache_len, branches, scale, True, launch=wrap_triton)
    return out, lse


def decode(q, k_cache, v_cache, k, v, cp):
    """dilated_attention_with_kvcache's computation on the Triton backend, the new k, v (where given) written into
    the caches first: (out, lse or None where the call did not ask for it)."""
    branches = branch_rows(cp.problem, q.device)
    lengths, cache_len = cache_lengths(cp, q.device)
    if torch.compiler.is_compiling():
        return triton_decode(q, k_cache, v_cache, k, v, lengths, cache_len, branches, cp.problem.scale)
    return _decode(q, k_cache, v_cache, k, v, lengths, cache_len, branches, cp.problem.scale, cp.return_lse)
