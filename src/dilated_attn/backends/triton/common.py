"""Pieces shared by the Triton kernels: where a program's segment lies, and autotuning configs."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from . import interpreting


# Integer arguments that change with every shape. Triton would otherwise specialise on their values
# (== 1, divisible by 16) and compile a new kernel for each; strides stay specialised (aligned loads).
# MAX_MEMBERS_BUCKET is only an autotuning key: each bucket picks its own config from the same compiled
# kernels (IEEE float32 kernels take up to a minute each to compile).
SIZE_ARGS = ["N", "H", "seg_len", "dilation", "n_seg", "head_lo", "offset_div", "offset_base", "max_members", "GROUP",
             "HEAD_DIM", "MAX_MEMBERS_BUCKET"]


# ids of the configs made from `tf32x3_variants` (the autotuner keeps these objects for the process's life)
_TF32X3_ONLY: set[int] = set()


def autotune_configs(variants: list[dict], interpreter: dict,
                     tf32x3_variants: list[dict] = ()) -> list[triton.Config]:
    """triton.Config objects for `variants` (block sizes plus num_warps/num_stages); under the interpreter,
    where every config would be run and is slow, one small config. `tf32x3_variants` come last and are tuned
    only with tf32x3 products (see prune_by_shared_memory): small tiles, or one pipeline stage, that fit
    tf32x3's doubled resident tiles, which are what wins float32 at head dim 128 (benchmarks/README.md,
    "float32 products")."""
    if interpreting():
        variants, tf32x3_variants = [interpreter], []
    configs = []
    for v in [*variants, *tf32x3_variants]:
        v = dict(v)
        warps, stages = v.pop("num_warps"), v.pop("num_stages")
        configs.append(triton.Config(v, num_warps=warps, num_stages=stages))
        if len(configs) > len(variants):
            _TF32X3_ONLY.add(id(configs[-1]))
    return configs


def _shared_memory_limit(tensor) -> int:
    if tensor.device.type != "cuda":
        return 1 << 30
    return torch.cuda.get_device_properties(tensor.device).shared_memory_per_block_optin


def shared_memory_need(rows_per_stage, config, block_d: int, elt: int, copies: int) -> int:
    """Bytes of shared memory a config asks for (see prune_by_shared_memory)."""
    resident, streamed, values, *tile = rows_per_stage(config.kwargs)
    stages = max(config.num_stages, 1)
    staged = tile[0] * elt if tile else 0  # a computed [rows, cols] operand staged through shared memory, once
    return (resident * copies + streamed * stages) * block_d * elt + values * stages * 4 + staged


def prune_by_shared_memory(rows_per_stage):
    """An `early_config_prune` for triton.autotune: drop configs whose tiles would not fit in shared memory.

    `rows_per_stage(config)` -> (rows held for the whole loop, rows loaded per pipeline stage, fp32 values
    loaded per stage beside them[, elements of a computed operand staged through shared memory]), each row
    BLOCK_D elements. With tf32x3 products Triton keeps the resident rows twice (their TF32 high and low
    parts). tools/triton_shared_memory.py checks this against what Triton 3.6 compiles (exact for the rows,
    the fp32 and staged terms bounds). With DILATED_ATTN_TRITON_AUTOTUNE=0 (read at
    import) it keeps only the first config that fits: no tuning, far fewer compilations (the GPU test suite)."""
    tune = os.environ.get("DILATED_ATTN_TRITON_AUTOTUNE", "1") != "0"

    def prune(configs, named_args, **kwargs):
        block_d = kwargs.get("BLOCK_D", named_args.get("BLOCK_D"))
        copies = 2 if kwargs.get("PRECISION", named_args.get("PRECISION")) == "tf32x3" else 1
        elt = named_args["Q"].element_size()
        limit = _shared_memory_limit(named_args["Q"])

        def need(c):
            return shared_memory_need(rows_per_stage, c, block_d, elt, copies)

        if copies == 1:
            configs = [c for c in configs if id(c) not in _TF32X3_ONLY]
        fits = [c for c in configs if need(c) <= limit] or [min(configs, key=need)]
        return fits if tune else fits[:1]

    prune.rows_per_stage = rows_per_stage
    return prune


@triton.jit
def members_of(h, seg, N, seg_len, dilation, head_lo, offset_div, offset_base):
    """Position of member 0 and the member count of segment `seg` for query head `h` of a branch."""
    off = offset_base + (h - head_lo) // offset_div
    start = seg * seg_len
    length = tl.minimum(seg_len, N - start)
    # off < dilation and length >= 1 make the numerator positive, and the count 0 when off >= length.
    n = (length - off + dilation - 1) // dilation
    return start + off, n


@triton.jit
def segment_of(pid, N, seg_len, dilation, n_seg, head_lo, n_heads, offset_div, offset_base, GROUP):
    """Decode program id `pid` over (batch, head of the branch, segment) into the batch index, the query
    head, its key/value head, the position of member 0 of the segment, and the member count."""
    seg = pid % n_seg
    h = head_lo + (pid // n_seg) % n_heads
    b = (pid // (n_seg * n_heads)).to(tl.int64)
    first, n = members_of(h, seg, N, seg_len, dilation, head_lo, offset_div, offset_base)
    return b, h, h // GROUP, first, n
