"""Ring attention: dilated (and dense) attention over a sequence sharded across the ranks of a process group.

`ring_attention(q, k, v, ...)` takes each rank's shard `[B, L, H, D]` of a global sequence of `N = P * L` tokens
(layout "contiguous" or "zigzag", docs/SPEC.md) and returns the output (and LSE) of `dilated_attention` on the
gathered tensors, restricted to the local positions; its backward gives the gradients of the local shards. Every
rank holds O(N/P) of every tensor. docs/ring.md describes the method; the parts:

    layout.py    how the sequence is cut across ranks; shard / unshard
    documents.py packed documents placed whole on the ranks (place_documents, DocumentLayout)
    plan.py      which rows each rank computes against which, and sends where (the same on every rank)
    blocks.py    the block primitive: a backend's single-device ops on one dense block of keys
    comm.py      the point-to-point transfers of each ring step
    autograd.py  forward and backward of one ring call on this rank
    heads.py     the head-parallel modes: "heads" (all-to-all, DeepSpeed-Ulysses) and "2d" (heads inside, ring across)
    modes.py     which mode runs a call (the `mode` argument, "auto"'s rule), explain_ring, a DocumentLayout's run
    check.py     that every rank of a call passed the same arguments, and that invalid ones raise on every rank
"""

from __future__ import annotations

import functools
from typing import Optional, Sequence

import torch

from .. import dispatch
from ..functional import Attention, dilated_attention, dilated_attention_varlen
from .autograd import RingAttention
from .check import check_same_config, config_fields, deferred_check
from .documents import DocumentLayout, place_documents
from .heads import HeadParallelFunction
from .layout import LAYOUTS, shard, unshard
from .modes import MODES, explain_ring, plan_call, resolve_groups, run_documents
from .plan import RingPlan, ring_plan

__all__ = ["ring_attention", "shard", "unshard", "place_documents", "DocumentLayout", "ring_plan", "RingPlan", "LAYOUTS",
           "MODES", "explain_ring"]

# A model calls ring_attention with the same sizes and arguments in every layer and step. Such a call is validated and
# planned once: its plan (plan_call) and its descriptor's fields are kept under _plan_key, which holds everything they
# read, so that the host, which the GPU waits for before the first exchange, spends no time on them again.
_PLANS: dict = {}
_PLANS_KEPT = 64
_PLAIN = (bool, int, float, str, type(None))


def _plan_key(groups, q, k, v, segment_lengths, dilation_rates, options: dict) -> Optional[tuple]:
    """The key of a call's kept plan, or None where some argument is not plain data (an int subclass, a tensor of
    lengths, a tensor subclass, a call being compiled): such a call is planned afresh. The plan reads the groups'
    sizes and this rank's place in them, not the groups: neither key nor plan holds a group, which would outlive
    the user's destroy_process_group."""
    if torch.compiler.is_compiling():
        return None
    tensors = []
    for x in (q, k, v):
        if type(x) not in (torch.Tensor, torch.nn.Parameter):
            return None
        tensors.append((x.shape, x.dtype, x.device, x.requires_grad))
    branches = []
    for xs in (segment_lengths, dilation_rates):
        if xs is not None and not (isinstance(xs, (list, tuple)) and all(type(x) is int for x in xs)):
            return None
        branches.append(None if xs is None else tuple(xs))
    if not all(type(x) in _PLAIN or type(x) is DocumentLayout for x in options.values()):
        return None
    # with the types: causal=1 equals causal=True as a key, but only the bool is valid
    arguments = tuple((type(x), x) for x in options.values())
    return (groups.ranks, groups.sizes, *tensors, *branches, arguments, torch.is_grad_enabled(), dispatch.state())


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segment_lengths: Optional[Sequence[int]] = None,
                   dilation_rates: Optional[Sequence[int]] = None, *, causal: bool = False,
                   scale: Optional[float] = None, head_groups: str = "all", group=None, layout="contiguous",
                   return_lse: bool = False, backend: str = "auto", mode: str = "auto",
                   cu_seqlens: Optional[torch.Tensor] = None, max_seqlen: Optional[int] = None) -> Attention:
    """Dilated attention over a sequence sharded across the ranks of `group`.

    Every rank calls it with its shard; the result is `dilated_attention` of
    the gathered tensors at this rank's positions, and its backward gives the
    gradients of this rank's shards. (The method and the modes: docs/ring.md
    in the repository.)

    Args:
        q: this rank's shard `[B, L, Hq, D]` of a global sequence of
            `N = P * L` tokens.
        k, v: `[B, L, Hkv, D]` shards (`Hq % Hkv == 0`).
        segment_lengths, dilation_rates: the branches, as in
            `dilated_attention`; both None is dense attention over the whole
            sequence (one branch `(N, 1)`).
        causal, scale, head_groups, return_lse, backend: as in
            `dilated_attention` (`backend` picks the single-device kernels
            every mode runs).
        group: the ranks: a ProcessGroup (None: the default group, or one
            process where none is initialised); for `mode="2d"` a 2-D
            DeviceMesh (dim 0 the ring, e.g. across nodes; dim 1 the heads,
            e.g. the GPUs of a node) or the pair `(ring_group, heads_group)`.
            A rank's shard is the `outer * inner_size + inner`-th of the
            sequence: `shard(x, group)` cuts it.
        layout: "contiguous" (rank j holds `[j*L, (j+1)*L)`) or "zigzag"
            (the sequence cut in 2P chunks, rank j holding chunks j and
            2P-1-j, which balances causal work; L even); or, for a pack of
            documents, a DocumentLayout (`place_documents(cu_seqlens, ...)`):
            q is then this rank's rows `[L_j, Hq, D]` (`shard(x,
            layout=layout)`; ranks hold unequal rows), each document whole on
            one rank where it fits (no transfer), and only documents longer
            than a rank's share cut; cu_seqlens and max_seqlen stay None.
        mode: "ring" (K/V blocks travel around the ring; any head count),
            "heads" (an all-to-all trades the sequence shards for a share of
            the heads; `Hq % P == 0`), "2d" (heads inside the mesh's second
            dim, ring along its first), or "auto": "2d" for a mesh or a pair,
            else whichever of "ring" and "heads" moves fewer bytes per rank.
            `explain_ring(...)` says which and why.
        cu_seqlens, max_seqlen: packed sequences, as in
            `dilated_attention_varlen`: q is then this rank's shard
            `[L, Hq, D]` (k, v `[L, Hkv, D]`) of a pack of `N = P * L`
            rows, `cu_seqlens` the pack's offsets `[S + 1]` (the same on
            every rank, on q's device); a sequence may cross ranks, and no
            key is shared between sequences. Every mode runs them; "auto"
            takes them to "heads" where it can run.

    Returns:
        out `[B, L, Hq, D]`, and with `return_lse=True` the LSE `[B, Hq, L]`
        (packed: `[L, Hq, D]` and `[Hq, L]`).

    Every rank must pass the same configuration: the call all-gathers a small
    descriptor first and raises the same ValueError on every rank if they
    differ; invalid arguments on one rank make every rank raise (that rank its
    own error, the others a ValueError naming it).

    Example: save as `example.py`, launch with
    `torchrun --nproc_per_node=4 example.py` (NCCL on 4 GPUs; on a machine
    without GPUs use "gloo" and CPU tensors)::

        import os
        import torch
        import torch.distributed as dist
        import dilated_attn

        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))  # this node's GPU
        dist.init_process_group("nccl")
        torch.manual_seed(0)  # the same global tensors on every rank
        q_full, k_full, v_full = (
            torch.randn(1, 65536, 16, 128, device="cuda", dtype=torch.bfloat16)
            for _ in range(3))
        q, k, v = (dilated_attn.shard(x, layout="zigzag")
                   for x in (q_full, k_full, v_full))
        out = dilated_attn.ring_attention(q, k, v, causal=True,
                                          layout="zigzag")
        dist.destroy_process_group()
    """
    # raises alone: without valid groups there are no peers to tell (a mode they cannot run raises in plan_call, on
    # every rank)
    groups = resolve_groups(group)
    P = groups.size
    options = dict(causal=causal, scale=scale, head_groups=head_groups, layout=layout, return_lse=return_lse,
                   backend=backend, mode=mode)
    key = _plan_key(groups, q, k, v, segment_lengths, dilation_rates, options) if cu_seqlens is None else None
    planned = _PLANS.get(key) if key is not None else None
    if planned is not None:
        call, fields = planned
    else:
        try:
            call = plan_call(q, k, v, segment_lengths, dilation_rates, **options, groups=groups,
                             cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)
        except (ValueError, TypeError) as exc:
            if P == 1:
                raise
            check_same_config(groups, q, None, exc)  # raises on every rank
            raise AssertionError("unreachable") from exc
        fields = None if P == 1 else config_fields(call, q, segment_lengths, options, cu_seqlens)
        if key is not None:  # kept under the state after the plan, which may have loaded a backend
            if len(_PLANS) >= _PLANS_KEPT:  # calls of ever new sizes: start afresh (no iteration a thread could upset)
                _PLANS.clear()
            _PLANS[_plan_key(groups, q, k, v, segment_lengths, dilation_rates, options)] = call, fields
    if call.documents is not None:
        post_check = None if P == 1 else functools.partial(deferred_check, groups, q, fields)
        out, lse = run_documents(q, k, v, call.documents, groups.all[0], post_check)
        return (out, lse) if return_lse else out
    packed = cu_seqlens is not None
    if P == 1:
        if cu_seqlens is not None:
            return dilated_attention_varlen(q, k, v, cu_seqlens, *call.branches, max_seqlen=max_seqlen, causal=causal,
                                            scale=scale, head_groups=head_groups, return_lse=return_lse,
                                            backend=backend)
        return dilated_attention(q, k, v, *call.branches, causal=causal, scale=scale, head_groups=head_groups,
                                 return_lse=return_lse, backend=backend)
    if packed:  # the shards [L, H, D] as a batch of one
        q, k, v = q[None], k[None], v[None]
    if call.mode == "ring":  # checked before its first transfer, after its local branches are queued
        out, lse = RingAttention.apply(q, k, v, call.ring, groups.all[0],
                                       functools.partial(deferred_check, groups, q, fields))
    else:  # checked after the copies into the first exchange's send buffer are queued
        out, lse = HeadParallelFunction.apply(q, k, v, call.head_parallel, groups.all,
                                              deferred_check(groups, q, fields), return_lse)
    if packed:
        out, lse = out[0], lse if lse is None else lse[0]
    return (out, lse) if return_lse else out
