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
"""

from __future__ import annotations

import functools
import struct
import zlib
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from .. import dispatch
from ..functional import Attention, dilated_attention, dilated_attention_varlen
from ..spec import BACKEND_CHOICES, host_offsets
from .autograd import RingAttention
from .documents import DocumentLayout, place_documents
from .heads import HeadParallelFunction
from .layout import LAYOUTS, shard, unshard
from .modes import MODES, explain_ring, plan_call, resolve_groups, run_documents
from .plan import RingPlan, ring_plan

__all__ = ["ring_attention", "shard", "unshard", "place_documents", "DocumentLayout", "ring_plan", "RingPlan", "LAYOUTS",
           "MODES", "explain_ring"]

# The call's descriptor, all-gathered before any transfer (_check_same_config, _deferred_check): categorical
# fields as codes.
_CODES = {
    "dtype": {d: n for n, d in enumerate((torch.float16, torch.bfloat16, torch.float32, torch.float64))},
    "layout": {n: i for i, n in enumerate((*LAYOUTS, "documents"))},
    "head_groups": {"all": 0, "split": 1},
    "backend": {n: i for i, n in enumerate(BACKEND_CHOICES)},
    "mode": {n: i for i, n in enumerate(MODES)},
}
_FIELDS = ("batch", "local length", "query heads", "kv heads", "head_dim", "dtype", "device type", "causal",
           "layout", "head_groups", "backend", "scale", "segment_lengths/dilation_rates/cu_seqlens", "mode",
           "return_lse")
# A rank's row of the gather, as bytes: whether it carries invalid arguments, the rank (its shard's index) whose
# arguments they are, the fields, then the length and the UTF-8 text of that error (cut to _MESSAGE_BYTES), so that
# its peers can say what was wrong.
_HEADER = struct.Struct(f"<qq{len(_FIELDS)}qq")
_MESSAGE_BYTES = 1024


def _post_config(group, q, fields: tuple[int, ...] | None, invalid: tuple[int, str] | None):
    """All-gather a small descriptor of the call over `group`, or `invalid` = (rank, message) of a rank whose
    arguments are invalid (this one's, or a peer's learnt from an earlier gather), and return `read()`, which waits
    for it and returns the first invalid arguments any row carries as (rank, message), a ValueError for
    configurations that differ, or None. Every rank takes part in this one collective whatever its arguments, so no
    rank is left waiting for a peer that raised. On a GPU the gathered rows come to the host by a copy queued
    behind the gather alone: kernels queued after this call do not delay read()."""
    if "nccl" in str(dist.get_backend(group)).lower():
        # NCCL gathers CUDA tensors only, and on a rank with bad arguments q may be a CPU tensor or no tensor.
        cuda = isinstance(q, torch.Tensor) and q.is_cuda
        dev = q.device if cuda else torch.device("cuda", torch.cuda.current_device())
    else:
        dev = torch.device("cpu")
    origin, text = invalid if invalid is not None else (0, "")
    message = text.encode()[:_MESSAGE_BYTES]
    row = _HEADER.pack(int(invalid is not None), origin, *(fields or (0,) * len(_FIELDS)), len(message))
    row += message.ljust(_MESSAGE_BYTES, b"\0")
    valid = row if invalid is None else None
    mine = _to_device(row, dev) if valid is None else _descriptor(row, dev)
    if dev.type == "cuda":
        table = torch.empty((dist.get_world_size(group), mine.numel()), dtype=mine.dtype, device=dev)
        dist.all_gather_into_tensor(table, mine, group=group)
        host = torch.empty(table.shape, dtype=table.dtype, pin_memory=True)
        host.copy_(table, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record(torch.cuda.current_stream(dev))

        def read():
            copied.synchronize()
            return _read_config(host, valid)
        return read
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)
    return functools.partial(_read_config, torch.stack(every), valid)


def _to_device(row: bytes, dev: torch.device) -> torch.Tensor:
    """A descriptor row as a uint8 tensor on `dev`: on a GPU copied from pinned memory, so that the copy waits for no
    kernel queued before it on this stream."""
    mine = torch.frombuffer(bytearray(row), dtype=torch.uint8)
    return mine.pin_memory().to(dev, non_blocking=True) if dev.type == "cuda" else mine


@functools.lru_cache(maxsize=64)
def _descriptor(row: bytes, dev: torch.device) -> torch.Tensor:
    """_to_device of a valid call's row, kept (it is the same on each call of one configuration, and read only)."""
    return _to_device(row, dev)


def _read_config(table: torch.Tensor, valid: Optional[bytes] = None):
    """_post_config's result from the gathered rows (on the host). `valid`: this rank's row where its arguments are
    valid; where every rank sent that row, the call goes ahead without the rows being decoded."""
    if valid is not None and table.numpy().tobytes() == valid * table.shape[0]:
        return None
    headers = [_HEADER.unpack(bytes(h)) for h in table[:, :_HEADER.size].tolist()]
    carried = sorted({(h[1], j) for j, h in enumerate(headers) if h[0]})
    if carried:
        first, j = carried[0]
        text = bytes(table[j, _HEADER.size:_HEADER.size + headers[j][-1]].tolist()).decode(errors="ignore")
        more = sorted({o for o, _ in carried[1:]} - {first})
        also = f" (and those of rank{'s' * (len(more) > 1)} {', '.join(map(str, more))})" if more else ""
        return first, text + also
    for col, name in enumerate(_FIELDS, start=2):
        values = [h[col] for h in headers]
        if any(x != values[0] for x in values):
            bad = next(j for j, x in enumerate(values) if x != values[0])
            shown = values if name not in ("scale", "segment_lengths/dilation_rates/cu_seqlens") else "differs"
            return ValueError(f"ring_attention: every rank of the group must pass the same {name}, but ranks "
                              f"differ ({shown}; rank {bad} of the group differs from its rank 0)")
    return None


def _check_same_config(groups, q, fields, error: Exception | None, first: Optional[Callable] = None) -> None:
    """_post_config over each group of the call in turn (the 2-D mode's inner and outer groups), carrying any
    invalid arguments into the next gather so that every rank of every group learns them, then raise on every rank:
    the rank with invalid arguments its own error as `ring_attention: rank j: ...` (its own type), every other a
    ValueError `ring_attention: rank j's arguments are invalid: ...` (j: the index of that rank's shard).
    `first`: the first group's gather where it is posted already (_deferred_check)."""
    invalid = None if error is None else (groups.rank, str(error))
    mismatch = None
    for i, group in enumerate(groups.all):
        seen = (first if i == 0 and first is not None else _post_config(group, q, fields, invalid))()
        if isinstance(seen, tuple):
            invalid = seen if invalid is None else min(invalid, seen)
        elif seen is not None and mismatch is None:
            # differing configurations in this group: carried on like invalid arguments, so that the ranks of the
            # other groups raise too instead of waiting for this group's ranks
            mismatch = seen
            invalid = invalid or (groups.rank, str(seen).removeprefix("ring_attention: "))
    if error is not None:
        kind = TypeError if isinstance(error, TypeError) else ValueError
        raise kind(f"ring_attention: rank {groups.rank}: {error}") from error
    if mismatch is not None:
        raise mismatch
    if invalid is not None:
        raise ValueError(f"ring_attention: rank {invalid[0]}'s arguments are invalid: {invalid[1]}")


def _deferred_check(groups, q, fields) -> Callable[[], None]:
    """_check_same_config of valid arguments as a call: the first group's gather is posted now (on the current
    stream) and read by the call, so that work which needs no peer can be queued in between."""
    return functools.partial(_check_same_config, groups, q, fields, None, _post_config(groups.all[0], q, fields, None))


def _config_fields(call, q, segment_lengths, options: dict, cu_seqlens) -> tuple[int, ...]:
    """The fields of a valid call's descriptor (_FIELDS); `options`: ring_attention's keyword arguments."""
    # every rank's branches, and offsets where the sequences are packed (or the placement of a DocumentLayout, whose
    # ranks hold unequal rows), must agree
    layout = options["layout"]
    documents = isinstance(layout, DocumentLayout)
    agreed = (("dense",) if segment_lengths is None else call.branches,
              host_offsets(cu_seqlens) if cu_seqlens is not None else None, layout.digest if documents else None)
    digest = zlib.crc32(repr(agreed).encode())
    scale_bits = struct.unpack("<q", struct.pack("<d", call.problem.scale))[0]
    p = call.problem
    return (
        p.batch, layout.total if documents else p.seq_len, p.num_heads, p.num_kv_heads, p.head_dim,
        _CODES["dtype"].get(p.dtype, -1),
        ["cpu", "cuda"].index(q.device.type) if q.device.type in ("cpu", "cuda") else 2, int(options["causal"]),
        _CODES["layout"]["documents" if documents else layout], _CODES["head_groups"][options["head_groups"]],
        _CODES["backend"][options["backend"]], scale_bits, digest, _CODES["mode"][call.mode],
        int(options["return_lse"]))


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

        import torch
        import torch.distributed as dist
        import dilated_attn

        dist.init_process_group("nccl")
        torch.cuda.set_device(dist.get_rank())
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
            _check_same_config(groups, q, None, exc)  # raises on every rank
            raise AssertionError("unreachable") from exc
        fields = None if P == 1 else _config_fields(call, q, segment_lengths, options, cu_seqlens)
        if key is not None:  # kept under the state after the plan, which may have loaded a backend
            if len(_PLANS) >= _PLANS_KEPT:  # calls of ever new sizes: start afresh (no iteration a thread could upset)
                _PLANS.clear()
            _PLANS[_plan_key(groups, q, k, v, segment_lengths, dilation_rates, options)] = call, fields
    if call.documents is not None:
        post_check = None if P == 1 else functools.partial(_deferred_check, groups, q, fields)
        out, lse = run_documents(q, k, v, call.documents, groups.all[0], post_check)
        return (out, lse) if return_lse else out
    packed = cu_seqlens is not None
    if P == 1:
        if packed:
            return dilated_attention_varlen(q, k, v, cu_seqlens, *call.branches, max_seqlen=max_seqlen, causal=causal,
                                            scale=scale, head_groups=head_groups, return_lse=return_lse,
                                            backend=backend)
        return dilated_attention(q, k, v, *call.branches, causal=causal, scale=scale, head_groups=head_groups,
                                 return_lse=return_lse, backend=backend)
    if packed:  # the shards [L, H, D] as a batch of one
        q, k, v = q[None], k[None], v[None]
    if call.mode == "ring":  # checked before its first transfer, after its local branches are queued
        out, lse = RingAttention.apply(q, k, v, call.ring, groups.all[0],
                                       functools.partial(_deferred_check, groups, q, fields))
    else:  # checked after the copies into the first exchange's send buffer are queued
        out, lse = HeadParallelFunction.apply(q, k, v, call.head_parallel, groups.all,
                                              _deferred_check(groups, q, fields), return_lse)
    if packed:
        out, lse = out[0], lse if lse is None else lse[0]
    return (out, lse) if return_lse else out
