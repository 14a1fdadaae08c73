"""What the two decode kernels share (the triton backend's, triton/decode.py, and the cuda backend's,
csrc/cuda/decode.cu: one launch writes the new rows and attends over every branch, the shares of a token's keys
merged by the last one to finish): the branch table they read and each stream's workspace; and the cuda backend's
decoding call.

The CUDA kernel streams each warp's keys through its own cp.async pipeline into mma.sync (Ampere and newer, 16-bit
inputs, head_dim 64 or 128); it serves the cuda backend's eager decoding calls, and auto's where Triton cannot run
(on an H200 it measured even with the Triton kernel: benchmarks/README.md, "Decoding").
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

from ..branches import branch_table
from ..cache_spec import CacheProblem
from ..spec import Problem

__all__ = ["branch_rows", "cache_lengths", "workspace", "cuda_decode_refusal", "cuda_decode"]


@functools.lru_cache(maxsize=64)
def branch_rows(p: Problem, device: torch.device) -> torch.Tensor:
    """The decode kernels' int32 branch table of a KV-cache call's problem (its branches bounded by the cache:
    Problem.op_branches), one row (w, r, head_lo, head_hi, offset_div, offset_base) a branch. Segments are not
    clipped further: a causal row's segment starts at (P // w) * w whatever the sequence's length."""
    w, r = p.op_branches()
    table = branch_table(w, r, max(w), p.num_heads, p.head_groups)
    rows = [[br.seg_len, br.dilation, br.head_lo, br.head_hi, br.offset_div, br.offset_base] for br in table]
    return torch.tensor(rows, dtype=torch.int32, device=device)


def cache_lengths(cp: CacheProblem, device: torch.device) -> tuple:
    """(lengths, cache_len) as the decode kernels take cache_seqlens: a tensor of per-batch lengths on `device` and 0,
    or None and the one int the caller gave."""
    given = cp.given_seqlens
    return (given.to(device), 0) if isinstance(given, torch.Tensor) else (None, given)


# Each stream's decode workspace, kept between calls: the shares' partial softmaxes, the counters (0 between
# launches: the kernels set each back), and an LSE nobody asked for. An eager call allocates only its output.
_WORKSPACES: dict = {}


def workspace(device: torch.device, stats: int, partial: int, counters: int, lse: int, keep: bool) -> tuple:
    """(stats, partial, counters, lse) fp32/fp32/int32/fp32 buffers of at least those many elements: where `keep`, the
    current stream's kept ones, grown where too small; fresh ones in a traced op (torch.compile), on the CPU (Triton's
    interpreter) and while a CUDA graph is captured (the graph owns them: kept ones would be shared with eager calls
    on the stream)."""
    fresh = not keep or device.type != "cuda" or torch.cuda.is_current_stream_capturing()
    key = None if fresh else (device.index, torch._C._cuda_getCurrentRawStream(device.index))
    held = _WORKSPACES.get(key) if key is not None else None
    sizes = (stats, partial, counters, lse)
    if held is None or any(x.numel() < n for x, n in zip(held, sizes)):
        if held is not None:  # grown to cover every call so far
            sizes = tuple(max(n, x.numel()) for n, x in zip(sizes, held))
        held = (torch.empty(sizes[0], dtype=torch.float32, device=device),
                torch.empty(sizes[1], dtype=torch.float32, device=device),
                torch.zeros(sizes[2], dtype=torch.int32, device=device),
                torch.empty(sizes[3], dtype=torch.float32, device=device))
        if key is not None:
            _WORKSPACES[key] = held
    return held


# The CUDA kernel's limits (csrc/cuda/launch.h), its pipeline depth (tiles of 16 keys in flight a warp: 2, 3 or 4) and
# the most shares a token's keys are cut into. The grid aims at one full wave: the blocks an SM holds, on every SM.
CUDA_DECODE_HEAD_DIMS = (64, 128)
CUDA_DECODE_MAX_GROUP = 16
CUDA_DECODE_MAX_KV_HEADS = 256
CUDA_DECODE_MAX_BRANCHES = 16
CUDA_DECODE_STAGES = 3
CUDA_DECODE_MAX_SPLITS = 256


def cuda_decode_refusal(p: Problem) -> Optional[str]:
    """Why the CUDA decode kernel cannot take the KV-cache call of problem `p` (on a GPU), or None. The tensors' layout
    is cuda_decode's to check: a cache it cannot read goes to the Triton kernel."""
    from .base import device_capability

    if device_capability(p.device) < (8, 0):
        return "the CUDA decode kernel needs compute capability 8.0 or newer (mma.sync, cp.async)"
    if p.dtype not in (torch.float16, torch.bfloat16):
        return "the CUDA decode kernel takes float16 or bfloat16"
    if p.head_dim not in CUDA_DECODE_HEAD_DIMS:
        return f"the CUDA decode kernel takes head_dim 64 or 128, got {p.head_dim}"
    if p.num_heads // p.num_kv_heads > CUDA_DECODE_MAX_GROUP or p.num_kv_heads > CUDA_DECODE_MAX_KV_HEADS:
        return (f"the CUDA decode kernel takes up to {CUDA_DECODE_MAX_GROUP} query heads a kv head and "
                f"{CUDA_DECODE_MAX_KV_HEADS} kv heads")
    if len(p.segment_lengths) > CUDA_DECODE_MAX_BRANCHES:
        return f"the CUDA decode kernel takes up to {CUDA_DECODE_MAX_BRANCHES} branches"
    return None


def _rows_aligned(x: torch.Tensor) -> bool:
    """Unit-stride rows on 16-byte boundaries, as the CUDA kernel reads and writes them."""
    return x.stride(-1) == 1 and x.data_ptr() % 16 == 0 and all(s % 8 == 0 for s in x.stride()[:-1])


_BLOCKS_PER_SM: dict = {}


def _splits(q: torch.Tensor, tokens: int, stages: int) -> int:
    """Shares of each token's keys: one wave of blocks over the device's SMs, as full as whole tokens make it (a block
    past it would start only when one of the wave ends)."""
    key = (q.device.index, q.dtype, q.shape[-1], stages)
    blocks = _BLOCKS_PER_SM.get(key)
    if blocks is None:
        from .. import _C  # the CUDA build's; cuda_decode runs only where the extension has CUDA kernels

        with torch.cuda.device(q.device):
            per_sm = _C.decode_blocks_per_sm(q.dtype == torch.bfloat16, q.shape[-1], stages)
        blocks = _BLOCKS_PER_SM[key] = per_sm * torch.cuda.get_device_properties(q.device).multi_processor_count
    return max(1, min(CUDA_DECODE_MAX_SPLITS, blocks // tokens))


def cuda_decode(q, k_cache, v_cache, k, v, cp: CacheProblem):
    """dilated_attention_with_kvcache on the CUDA decode kernel (the new k, v written into the caches by the same
    launch): (out, lse or None where the call did not ask for it); None where the tensors' layout does not suit the
    kernel (a cache without unit-stride, 16-byte aligned rows), which the caller then runs otherwise."""
    q, k, v = (x if x is None or _rows_aligned(x) else x.clone(memory_format=torch.contiguous_format)
               for x in (q, k, v))  # a fresh allocation is aligned (.contiguous() keeps a contiguous view's offset)
    if not (_rows_aligned(k_cache) and _rows_aligned(v_cache)):
        return None
    B, Sq, H, D = q.shape
    tokens, stages = B * Sq, CUDA_DECODE_STAGES
    splits = _splits(q, tokens, stages)
    queries = tokens * H
    stats, partial, counters, spare_lse = workspace(q.device, queries * splits * 2, queries * splits * D,
                                                    tokens * k_cache.shape[2], queries,
                                                    keep=not torch.compiler.is_compiling())
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty((B, H, Sq), dtype=torch.float32, device=q.device) if cp.return_lse else spare_lse
    lengths, cache_len = cache_lengths(cp, q.device)
    torch.ops.dilated_attn.decode(q, k_cache, v_cache, k, v, lengths, cache_len, branch_rows(cp.problem, q.device),
                                  cp.problem.scale, out, lse, stats, partial, counters, splits, stages)
    return out, lse if cp.return_lse else None
