"""Ring attention: dilated (and dense) attention over a sequence sharded across the ranks of a process group.

`ring_attention(q, k, v, ...)` takes each rank's shard `[B, L, H, D]` of a global sequence of `N = P * L` tokens
(layout "contiguous" or "zigzag", docs/SPEC.md) and returns the output (and LSE) of `dilated_attention` on the
gathered tensors, restricted to the local positions; its backward gives the gradients of the local shards. Every
rank holds O(N/P) of every tensor. docs/ring.md describes the method; the parts:

    layout.py    how the sequence is cut across ranks; shard / unshard
    plan.py      which rows each rank computes against which, and sends where (the same on every rank)
    blocks.py    the block primitive: a backend's single-device ops on one dense block of keys
    comm.py      the point-to-point transfers of each ring step
    autograd.py  forward and backward of one call on this rank
"""

from __future__ import annotations

import struct
import zlib
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from .. import dispatch
from ..functional import Attention, dilated_attention
from ..spec import BACKEND_CHOICES, validate
from .autograd import RingAttention
from .layout import LAYOUTS, check_layout, group_size_rank, shard, unshard
from .plan import RingPlan, ring_plan

__all__ = ["ring_attention", "shard", "unshard", "ring_plan", "RingPlan", "LAYOUTS"]

# The call's descriptor, all-gathered before any transfer (_check_same_config): categorical fields as codes.
_CODES = {
    "dtype": {d: n for n, d in enumerate((torch.float16, torch.bfloat16, torch.float32, torch.float64))},
    "layout": {n: i for i, n in enumerate(LAYOUTS)},
    "head_groups": {"all": 0, "split": 1},
    "backend": {n: i for i, n in enumerate(BACKEND_CHOICES)},
}
_FIELDS = ("batch", "local length", "query heads", "kv heads", "head_dim", "dtype", "device type", "causal",
           "layout", "head_groups", "backend", "scale", "segment_lengths/dilation_rates")
# A rank's row of the gather, as bytes: whether its own arguments are invalid, the fields, then the length and
# the UTF-8 text of its error (cut to _MESSAGE_BYTES), so that its peers can say what was wrong.
_HEADER = struct.Struct(f"<q{len(_FIELDS)}qq")
_MESSAGE_BYTES = 1024


def _check_same_config(group, rank: int, q, fields: tuple[int, ...] | None, error: Exception | None) -> None:
    """All-gather a small descriptor of the call (or this rank's own validation `error`) and raise on every
    rank if any rank's arguments are invalid or the ranks' configurations differ. Every rank takes part in this
    one collective whatever its arguments, so no rank is left waiting for a peer that raised."""
    if "nccl" in str(dist.get_backend(group)).lower():
        # NCCL gathers CUDA tensors only, and on a rank with bad arguments q may be a CPU tensor or no tensor.
        cuda = isinstance(q, torch.Tensor) and q.is_cuda
        dev = q.device if cuda else torch.device("cuda", torch.cuda.current_device())
    else:
        dev = torch.device("cpu")
    message = str(error).encode()[:_MESSAGE_BYTES] if error is not None else b""
    row = _HEADER.pack(int(error is not None), *(fields or (0,) * len(_FIELDS)), len(message))
    mine = torch.frombuffer(bytearray(row + message.ljust(_MESSAGE_BYTES, b"\0")), dtype=torch.uint8).to(dev)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)
    table = torch.stack(every).cpu()
    headers = [_HEADER.unpack(bytes(h)) for h in table[:, :_HEADER.size].tolist()]
    if error is not None:
        kind = TypeError if isinstance(error, TypeError) else ValueError
        raise kind(f"ring_attention: rank {rank}: {error}") from error
    invalid = [j for j, h in enumerate(headers) if h[0]]
    if invalid:
        j = invalid[0]
        text = bytes(table[j, _HEADER.size:_HEADER.size + headers[j][-1]].tolist()).decode(errors="ignore")
        more = invalid[1:]
        also = f" (and those of rank{'s' * (len(more) > 1)} {', '.join(map(str, more))})" if more else ""
        raise ValueError(f"ring_attention: rank {j}'s arguments are invalid: {text}{also}")
    for col, name in enumerate(_FIELDS, start=1):
        values = [h[col] for h in headers]
        if any(x != values[0] for x in values):
            bad = next(j for j, x in enumerate(values) if x != values[0])
            shown = values if name not in ("scale", "segment_lengths/dilation_rates") else "differs"
            raise ValueError(f"ring_attention: every rank of the group must pass the same {name}, but rank 0 and "
                             f"rank {bad} differ ({shown})")


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segment_lengths: Optional[Sequence[int]] = None,
                   dilation_rates: Optional[Sequence[int]] = None, *, causal: bool = False,
                   scale: Optional[float] = None, head_groups: str = "all",
                   group: Optional[dist.ProcessGroup] = None, layout: str = "contiguous", return_lse: bool = False,
                   backend: str = "auto") -> Attention:
    """Dilated attention over a sequence sharded across the ranks of `group` (docs/SPEC.md, docs/ring.md).

    Each rank passes its shard `q` `[B, L, Hq, D]`, `k`, `v` `[B, L, Hkv, D]` of a global sequence of
    `N = P * L` tokens (`layout="contiguous"`: rank j holds `[j*L, (j+1)*L)`; `"zigzag"`: the sequence cut in
    2P chunks, rank j holds chunks j and 2P-1-j, which balances causal work) and gets the output (and with
    `return_lse=True` the LSE `[B, Hq, L]`) of `dilated_attention` on the gathered tensors at its positions;
    the backward gives its shards' gradients. `segment_lengths=None` (and `dilation_rates=None`) is dense
    attention over the whole sequence (one branch `(N, 1)`). `group=None` is the default process group, or a
    single process where none is initialised; with one rank this is `dilated_attention`. `backend` picks the
    single-device kernels of the local blocks, as in `dilated_attention`.

    Every rank must pass the same configuration; the call all-gathers a small descriptor first and raises the
    same ValueError on every rank if they differ. Invalid arguments on one rank make every rank raise: that
    rank its own error, the others a ValueError naming it. `dilated_attn.shard` / `unshard` cut and reassemble
    tensors.
    """
    P, rank = group_size_rank(group)
    # Every check of this rank's own arguments, before the gather: with P > 1 a failure is carried to the peers
    # by _check_same_config (which every rank must reach) instead of raising here and leaving them waiting.
    try:
        layout = check_layout(layout)
        if (segment_lengths is None) != (dilation_rates is None):
            raise ValueError("segment_lengths and dilation_rates must both be None (dense ring attention) or both "
                             "be given")
        dense = segment_lengths is None
        L = q.shape[1] if isinstance(q, torch.Tensor) and q.dim() == 4 else 0
        N = P * L
        w, r = ([max(N, 1)], [1]) if dense else (segment_lengths, dilation_rates)
        # validates the local tensors and every argument with the single-device rules
        p = validate(q, k, v, w, r, causal=causal, scale=scale, head_groups=head_groups, return_lse=return_lse,
                     backend=backend)
        if layout == "zigzag" and L % 2:
            raise ValueError(f"layout='zigzag' needs the global length N = P*L divisible by 2P, i.e. an even "
                             f"local length L, got L={L} on {P} ranks")
        if P > 1:
            gw, gr = p.op_branches(N)  # the branches bounded by the global sequence (the plan's ints stay small)
            plan = ring_plan(P, L, p.num_heads, p.num_kv_heads, tuple(gw), tuple(gr), head_groups, causal, layout)
            # The kernels of the local blocks: the backend dilated_attention would pick for this shard (raises
            # if an explicit backend cannot run it).
            local = plan.local_branches
            all_local = len(local) == len(gw)
            local_problem = validate(q, k, v, [gw[i] for i in local] or [1], [gr[i] for i in local] or [1],
                                     causal=causal, scale=p.scale, head_groups=head_groups if all_local else "all",
                                     backend=backend)
            chosen = dispatch.select(local_problem, backend).name
    except (ValueError, TypeError) as exc:
        if P == 1:
            raise
        _check_same_config(group, rank, q, None, exc)  # raises on every rank
        raise AssertionError("unreachable") from exc
    if P == 1:
        return dilated_attention(q, k, v, w, r, causal=causal, scale=scale, head_groups=head_groups,
                                 return_lse=return_lse, backend=backend)
    branches = tuple(zip(gw, gr))
    digest = zlib.crc32(repr(("dense",) if dense else branches).encode())
    scale_bits = struct.unpack("<q", struct.pack("<d", p.scale))[0]
    _check_same_config(group, rank, q, (
        p.batch, L, p.num_heads, p.num_kv_heads, p.head_dim, _CODES["dtype"].get(p.dtype, -1),
        ["cpu", "cuda"].index(q.device.type) if q.device.type in ("cpu", "cuda") else 2, int(causal),
        _CODES["layout"][layout], _CODES["head_groups"][head_groups], _CODES["backend"][backend], scale_bits,
        digest), None)
    out, lse = RingAttention.apply(q, k, v, plan, rank, group, local_problem, chosen, p.scale, causal)
    return (out, lse) if return_lse else out
