"""The head-parallel modes of ring_attention: "heads" (DeepSpeed-Ulysses) and "2d" (heads inside, ring outside).

In the "heads" mode each of the P ranks of a group trades its sequence shard of q, k and v (all heads, L positions)
for all P*L positions of its share of the heads (an all-to-all), runs the single-device kernels on them (no ring
step, no merge), and trades the output back; the backward mirrors it. Rank j takes the query heads
`[j*Hq/P, (j+1)*Hq/P)`, with the offsets of their global indices (branches.branch_table), and the key/value heads they
read: a key/value head that serves the query heads of several ranks (Hkv < P) goes to each of them, and the
gradients of its copies are summed where it came from.

The heads of a rank's share are cut into chunks that run one after another: the exchange of chunk g+1 travels
while chunk g computes, and the output of chunk g travels back while chunk g+1 computes, so only the first
chunk's inputs and the last chunk's output wait for the network.

The "2d" mode (USP, LoongTrain) does the same inside an inner group (the GPUs of a node) and runs the ring across
an outer group (the nodes) on each head chunk: the inner exchange gathers the inner group's shards, which are one
rank's shard of the outer ring (layout.py's chunks nest so, for both layouts).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist

from ..spec import lse_dtype
from .autograd import save_state, saved_state

__all__ = ["HeadShare", "head_share", "HeadParallelAttention"]

# A rank's heads are cut into at most this many chunks (fewer where the heads do not divide so): with n chunks the
# first chunk's exchange and the last one's return are what stays exposed, 1/n of the traffic each. On 4 H200s
# (NVLink) one chunk was the faster (benchmarks/README.md, "Ring attention"): NCCL's all-to-all kernels running
# beside the attention slowed both, and one-head attention calls ran slower than four-head ones. Slower links
# may gain from more: DILATED_ATTN_HEAD_CHUNKS sets the bound.
MAX_HEAD_CHUNKS = int(os.environ.get("DILATED_ATTN_HEAD_CHUNKS", "1"))


@dataclass(frozen=True)
class HeadShare:
    """How the P ranks of a group share the heads: rank j takes query heads [j*hq, (j+1)*hq) and key/value heads
    [kv_first[j], kv_first[j] + hkv); its heads run in chunks (query head slice, key/value head slice) of the
    share, locally numbered."""

    P: int
    rank: int
    num_heads: int
    num_kv_heads: int
    hq: int
    hkv: int
    kv_first: tuple[int, ...]
    chunks: tuple[tuple[slice, slice], ...]
    layout: str

    @property
    def head_start(self) -> int:
        return self.rank * self.hq


def head_share(P: int, rank: int, num_heads: int, num_kv_heads: int, layout: str,
               max_chunks: int = MAX_HEAD_CHUNKS, check: Optional[Callable[[int, int], None]] = None) -> HeadShare:
    """The share of `rank`, or ValueError naming the rule the head counts break. `check(head_start, heads)` raises
    where the kernels cannot run heads [head_start, head_start + heads) (spec.Problem.with_heads); it is asked
    for every rank's share and chunk, so that every rank raises alike."""
    if num_heads % P:
        raise ValueError(f"mode='heads' and '2d' give each rank of the head-parallel group an equal share of the "
                         f"query heads: their number ({num_heads}) must be divisible by the group's size ({P})")
    hq, group = num_heads // P, num_heads // num_kv_heads
    if hq % group and group % hq:
        raise ValueError(f"mode='heads' and '2d' need each rank's {hq} query heads to read whole key/value heads "
                         f"({group} query heads share one): one of the two counts must divide the other")
    hkv = max(hq // group, 1)
    kv_first = tuple(j * hq // group for j in range(P))
    # n chunks: n divides hq, whole key/value heads per chunk where there are several. The most chunks up to
    # max_chunks; where a kernel cannot run such a chunk's heads (their offsets start inside a run of heads sharing
    # one), more and smaller chunks, which it can.
    valid = [n for n in range(1, hq + 1) if hq % n == 0 and (hkv % n == 0 or hkv == 1)]
    error = None
    for n in [*(n for n in reversed(valid) if n <= max_chunks), *(n for n in valid if n > max_chunks)]:
        size = hq // n
        chunks = []
        for g in range(n):
            kv = slice(g * size // group, g * size // group + max(size // group, 1)) if hkv > 1 else slice(0, 1)
            chunks.append((slice(g * size, (g + 1) * size), kv))
        try:
            if check is not None:
                for j in range(P):
                    for qs, _ in chunks:
                        check(j * hq + qs.start, qs.stop - qs.start)
        except ValueError as exc:
            error = error or exc
            continue
        break
    else:
        raise error
    return HeadShare(P, rank, num_heads, num_kv_heads, hq, hkv, kv_first, tuple(chunks), layout)


# ---------------------------------------------------------------------------------------------------------
# The exchange: [B, L, H, E] shards of the sequence <-> [B, P*L, h, E] shares of the heads, in position order.


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst.copy_(src), moved in 8-byte words where both last dims allow it. The exchange's copies are strided
    (a share of the heads, a permutation of the shards), and a strided copy moves one element per step of its
    index arithmetic: 8-byte elements move four times the bytes of 2-byte ones per step."""
    if dst.dtype == src.dtype and dst.element_size() < 8:
        try:
            dst, src = dst.view(torch.int64), src.view(torch.int64)
        except RuntimeError:  # a last dim not of whole words, or not of unit stride: element by element
            pass
    dst.copy_(src)


def _positions(x: torch.Tensor, P: int, layout: str) -> torch.Tensor:
    """The P shards of `x` [P, B, L, h, E] (shard j from rank j) as one sequence [B, P*L, h, E] in position order:
    contiguous, the shards one after another; zigzag, their first halves in rank order, then their second halves
    in reverse rank order (rank j holds chunks j and 2P-1-j). One pass over the data at most."""
    _, B, L, h, E = x.shape
    if layout == "contiguous":
        return x.transpose(0, 1).reshape(B, P * L, h, E)  # a view for B = 1
    halves = x.view(P, B, 2, L // 2, h, E)
    y = torch.empty((B, 2 * P, L // 2, h, E), dtype=x.dtype, device=x.device)
    _copy(y[:, :P], halves[:, :, 0].transpose(0, 1))
    for j in range(P):  # one copy a rank: flip() would copy them all once more first
        _copy(y[:, 2 * P - 1 - j], halves[j, :, 1])
    return y.view(B, P * L, h, E)


def _shards(y: torch.Tensor, P: int, layout: str, out: torch.Tensor) -> None:
    """The inverse of _positions: [B, P*L, h, E] -> out [P, B, L, h, E], shard j the positions of rank j. One pass
    over the data."""
    B, N, h, E = y.shape
    if layout == "contiguous":
        _copy(out, y.reshape(B, P, N // P, h, E).transpose(0, 1))
        return
    chunks = y.reshape(B, 2 * P, N // (2 * P), h, E)
    x = out.unflatten(2, (2, N // (2 * P)))
    _copy(x[:, :, 0], chunks[:, :P].transpose(0, 1))
    for j in range(P):
        _copy(x[j, :, 1], chunks[:, 2 * P - 1 - j])


class _AllToAll:
    """One all-to-all in flight: `wait()` gives what arrived."""

    def __init__(self, send: torch.Tensor, group, finish: Callable[[torch.Tensor], object]):
        self.recv = torch.empty_like(send)
        self.send, self.finish = send, finish
        self.work = dist.all_to_all_single(self.recv, send, group=group, async_op=True)

    def wait(self):
        self.work.wait()
        self.send = None
        return self.finish(self.recv)


def _split(y: torch.Tensor, widths: list[int]) -> list[torch.Tensor]:
    """Views of y [..., sum(widths), E] along its heads, `widths` heads each."""
    starts = [sum(widths[:i]) for i in range(len(widths))]
    return [y[..., a:a + w, :] for a, w in zip(starts, widths)]


def to_heads(parts: list[tuple[torch.Tensor, list[slice]]], share: HeadShare, group,
             check: Optional[Callable[[], None]] = None) -> _AllToAll:
    """Post one exchange of tensors x [B, L, H_x, E] (one dtype) that gives this rank, of each, [B, P*L, h_x, E] of
    its heads: rank j receives the heads `heads[j]` of every rank's positions, for each (x, heads) of `parts`. One
    all-to-all for them all: one transfer kernel, whose latency counts once. `check()` runs between the copies into
    the send buffer and the transfer (ring_attention's configuration check, read while the GPU copies)."""
    x0 = parts[0][0]
    B, L, _, E = x0.shape
    widths = [heads[0].stop - heads[0].start for _, heads in parts]
    send = torch.empty((share.P, B, L, sum(widths), E), dtype=x0.dtype, device=x0.device)
    for (x, heads), view in zip(parts, _split(send, widths)):
        w = heads[0].stop - heads[0].start
        if all(s.start == heads[0].start + j * w for j, s in enumerate(heads)):  # every rank's heads in turn
            _copy(view, x[:, :, heads[0].start:heads[-1].stop].unflatten(2, (share.P, w)).permute(2, 0, 1, 3, 4))
        else:
            for j, s in enumerate(heads):
                _copy(view[j], x[:, :, s])
    if check is not None:
        check()
    return _AllToAll(send, group, lambda recv: _split(_positions(recv, share.P, share.layout), widths))


def to_positions(ys: list[torch.Tensor], share: HeadShare, group) -> _AllToAll:
    """Post one exchange of tensors y [B, P*L, h_y, E] (this rank's heads, every position; one dtype) that gives
    back, of each, [P, B, L, h_y, E]: entry j holds rank j's heads at this rank's positions."""
    B, N, _, E = ys[0].shape
    widths = [y.shape[2] for y in ys]
    send = torch.empty((share.P, B, N // share.P, sum(widths), E), dtype=ys[0].dtype, device=ys[0].device)
    for y, view in zip(ys, _split(send, widths)):
        _shards(y, share.P, share.layout, view)
    return _AllToAll(send, group, lambda recv: _split(recv, widths))


def _query_heads(share: HeadShare, qs: slice) -> list[slice]:
    return [slice(j * share.hq + qs.start, j * share.hq + qs.stop) for j in range(share.P)]


def _kv_heads(share: HeadShare, ks: slice) -> list[slice]:
    return [slice(share.kv_first[j] + ks.start, share.kv_first[j] + ks.stop) for j in range(share.P)]


def _lse_rows(lse: torch.Tensor) -> torch.Tensor:
    """[B, H, N] -> [B, N, H, 1] (a view), the layout the exchange moves."""
    return lse.transpose(1, 2).unsqueeze(-1)


@dataclass
class HeadParallelAttention:
    """Attention of a head-parallel mode on this rank. `attend(g, q, k, v, groups)` gives (out, lse) of head chunk g
    on the gathered [B, P*L, h, D] tensors (plus whatever its backward keeps), `attend_backward(g, kept, d_out,
    d_lse, groups)` that chunk's (dq, dk, dv); both run on the sequence of the whole group (the single-device ops
    for "heads", the outer ring for "2d"). `groups`: the call's process groups, the head-parallel one first (a
    configuration is kept between calls and holds none: a kept group would outlive destroy_process_group); "head
    chunk" below is a run of this rank's heads."""

    share: HeadShare
    attend: Callable
    attend_backward: Callable

    def forward(self, q, k, v, process_groups: tuple, check: Optional[Callable[[], None]] = None,
                with_lse: bool = True):
        """(out [B, L, Hq, D], lse [B, Hq, L] or None without `with_lse`, what the backward keeps). `check()`:
        ring_attention's configuration check, read before the first transfer. The backward needs only what it keeps
        (each head chunk's LSE at every position), so the LSE travels back only where the caller returns it."""
        share, group = self.share, process_groups[0]
        B, L, H, D = q.shape
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        lse = torch.empty((B, H, L), dtype=lse_dtype(q.dtype), device=q.device) if with_lse else None
        chunks = share.chunks

        def post(g):
            qs, ks = chunks[g]
            kv = g == 0 or share.hkv > 1  # a single key/value head serves every chunk: it travels once
            parts = [(q, _query_heads(share, qs))]
            if kv and k.dtype == q.dtype == v.dtype:
                parts += [(k, _kv_heads(share, ks)), (v, _kv_heads(share, ks))]
            pending = [to_heads(parts, share, group, check if g == 0 else None)]
            if kv and len(parts) == 1:
                pending += [to_heads([(x, _kv_heads(share, ks))], share, group) for x in (k, v)]
            return pending

        kept, returning, pending = [], [], post(0)
        k_h = v_h = None
        for g, (qs, _) in enumerate(chunks):
            arrived = [t for x in pending for t in x.wait()]
            q_h = arrived[0]
            if len(arrived) == 3:
                k_h, v_h = arrived[1], arrived[2]
            if g + 1 < len(chunks):
                pending = post(g + 1)
            o_h, l_h, keep = self.attend(g, q_h, k_h, v_h, process_groups)
            kept.append(keep)
            returning.append((qs, to_positions([o_h], share, group),
                              to_positions([_lse_rows(l_h)], share, group) if with_lse else None))
        out_heads = out.view(B, L, share.P, share.hq, D)
        for qs, outs, lses in returning:
            _copy(out_heads[:, :, :, qs], outs.wait()[0].permute(1, 2, 0, 3, 4))
            if lses is not None:
                lse.view(B, share.P, share.hq, L)[:, :, qs] = lses.wait()[0][..., 0].permute(1, 0, 3, 2)
        return out, lse, kept

    def backward(self, kept, d_out, d_lse, q, k, v, process_groups: tuple, with_lse: bool):
        """(dq, dk, dv) of this rank's shards; d_out [B, L, Hq, D] (zeros where None), d_lse [B, Hq, L] or None.
        `with_lse`: the call returned the LSE. Then its gradient travels from every rank, zeros where a rank's has
        none: whether a rank's loss used the LSE is its own, and every rank must post the same exchanges."""
        share, group = self.share, process_groups[0]
        B, L, H, D = q.shape
        acc = lse_dtype(q.dtype)
        chunks = share.chunks
        if d_out is None:
            d_out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
        d_out = d_out.to(q.dtype)
        if with_lse and d_lse is None:
            d_lse = torch.zeros((B, H, L), dtype=acc, device=q.device)

        def post(g):
            heads = _query_heads(share, chunks[g][0])
            return (to_heads([(d_out, heads)], share, group),
                    None if d_lse is None else to_heads([(_lse_rows(d_lse), heads)], share, group))

        dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        dq_heads = dq.view(B, L, share.P, share.hq, D)
        # A key/value head that several ranks read (Hkv < P) gets a gradient back from each: they are summed in
        # float32 (float64). Otherwise each head's comes from one rank and is written as it arrives.
        shared = share.P * share.hkv > share.num_kv_heads
        dk, dv = (torch.zeros(x.shape, dtype=acc, device=x.device) if shared else
                  torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in (k, v))
        returning, pending = [], post(0)
        dk_h = dv_h = None
        for g, (qs, ks) in enumerate(chunks):
            do_h = pending[0].wait()[0]
            dl_h = None if pending[1] is None else pending[1].wait()[0][..., 0].transpose(1, 2)
            if g + 1 < len(chunks):
                pending = post(g + 1)
            gq, gk, gv = self.attend_backward(g, kept[g], do_h, dl_h, process_groups)
            kept[g] = None
            if (share.hkv > 1 or len(chunks) == 1) and gq.dtype == gk.dtype == gv.dtype:  # one exchange of all
                returning.append((qs, ks, to_positions([gq, gk, gv], share, group)))
                continue
            returning.append((qs, None, to_positions([gq], share, group)))
            if share.hkv > 1 or len(chunks) == 1:
                returning.append((None, ks, to_positions([gk, gv], share, group)))
            else:  # one key/value head for every chunk: summed here, sent once
                dk_h = gk.to(acc) if dk_h is None else dk_h + gk
                dv_h = gv.to(acc) if dv_h is None else dv_h + gv
        if dk_h is not None:
            returning.append((None, chunks[0][1], to_positions([dk_h, dv_h], share, group)))
        for qs, ks, exchange in returning:
            arrived = exchange.wait()
            if qs is not None:
                _copy(dq_heads[:, :, :, qs], arrived.pop(0).permute(1, 2, 0, 3, 4))
            if ks is not None:
                for j, s in enumerate(_kv_heads(share, ks)):
                    for sums, grads in zip((dk, dv), arrived):
                        if shared:
                            sums[:, :, s] += grads[j]
                        else:
                            _copy(sums[:, :, s], grads[j])
        return dq, dk.to(k.dtype), dv.to(v.dtype)


class HeadParallelFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, attention: HeadParallelAttention, groups: tuple,
                check: Optional[Callable[[], None]] = None, with_lse: bool = True):
        out, lse, kept = attention.forward(q, k, v, groups, check, with_lse)
        save_state(ctx, (q, k, v, kept))
        ctx.attention, ctx.groups, ctx.with_lse = attention, groups, with_lse
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, d_out, d_lse):
        q, k, v, kept = saved_state(ctx)
        grads = ctx.attention.backward(kept, d_out, d_lse, q, k, v, ctx.groups, ctx.with_lse)
        return (*grads, None, None, None, None)
