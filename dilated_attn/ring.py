"""Ring attention: dilated (and dense) attention over a sequence sharded across the ranks of a process group.

`ring_attention(q, k, v, ...)` takes each rank's shard `[B, L, H, D]` of a global sequence of `N = P * L`
tokens (layout "contiguous" or "zigzag", ../shared/SPEC.md) and returns the output (and LSE) of
`dilated_attention` on the gathered tensors, restricted to the local positions; its backward gives the
gradients of the local shards. Every rank holds O(N/P) of every tensor.

How a branch `(w, r)` is computed (the plan is a pure function of the configuration, so every rank derives the
same one and no sizes travel):

* Local branches: when no segment crosses a chunk of the layout and chunks start on segment boundaries
  (contiguous: `s | L`; zigzag: `s | L/2`), the branch on the local shard is the branch on the global
  sequence. These run in one call of the single-device op, and nothing moves.
* Spanning branches: each rank cuts its positions into pieces (a chunk intersected with a segment) and keeps
  only the branch's members, per head: the compacted rows. Within a segment, the members of all ranks in
  position order form one dense (causal or not) attention problem, so a spanning branch is dense ring
  attention on compacted tensors among the ranks that share segments: only 1/r of K and V travels, only to
  ranks that read it. Heads whose pieces have the same member counts are stacked into one problem ("class").
* Block primitive: queries against a block of keys is the single-device op with one branch `(n, 1)`
  (causal on a rank's own rows, full otherwise; unequal lengths are cut into equal squares), so the ring and
  the single-device path share one kernel family. Its partial `(out, lse)` merge in float32 (float64 for
  float64) by log-sum-exp.
* Communication: at step `t = 1 .. P-1` rank `j` sends its compacted K/V to `j + t` and receives from
  `j - t` (only where the receiver needs rows); step `t + 1` is posted before step `t` is computed.
* Backward: the exact method of the spec (each block's backward with the merged out and LSE), K/V exchanged
  again, dK/dV of received rows sent back to their owner in float32 and accumulated there, dQ local.
"""

from __future__ import annotations

import functools
import math
import struct
import zlib
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from . import dispatch
from .functional import dilated_attention
from .reference import dilated_attention_reference
from .spec import BACKENDS, branch_table, lse_dtype, validate

LAYOUTS = ("contiguous", "zigzag")

__all__ = ["ring_attention", "shard", "unshard", "ring_plan", "LAYOUTS"]


# ---------------------------------------------------------------------------------------------------------
# Process group and layout helpers


def _group_size_rank(group) -> tuple[int, int]:
    """(P, this rank in group); (1, 0) without an initialised default process group."""
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a torch.distributed.ProcessGroup or None, got {type(group).__name__}")
    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise ValueError("group was given, but torch.distributed is not initialised (init_process_group)")
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def _check_layout(layout) -> str:
    if not isinstance(layout, str):
        raise TypeError(f"layout must be a str, one of {LAYOUTS}, got {type(layout).__name__}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return layout


def _chunks(rank: int, P: int, L: int, layout: str) -> list[tuple[int, int]]:
    """The global ranges [start, stop) a rank holds, in its local order."""
    if layout == "contiguous":
        return [(rank * L, (rank + 1) * L)]
    C = L // 2
    return [(rank * C, (rank + 1) * C), ((2 * P - 1 - rank) * C, (2 * P - rank) * C)]


def shard(x: torch.Tensor, group=None, layout: str = "contiguous", dim: int = 1) -> torch.Tensor:
    """This rank's shard of a full tensor `x` (the same on every rank) along `dim` (the sequence dim of
    `[B, N, H, D]` by default), for `ring_attention` with the same group and layout. Returns a copy."""
    layout = _check_layout(layout)
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    P, rank = _group_size_rank(group)
    N = x.shape[dim]
    parts = 2 * P if layout == "zigzag" else P
    if N % parts != 0:
        raise ValueError(f"x: sequence length {N} (dim {dim}) must be divisible by {parts} for layout={layout!r} "
                         f"on {P} ranks")
    L = N // P
    return torch.cat([x.narrow(dim, a, b - a) for a, b in _chunks(rank, P, L, layout)], dim).contiguous()


def unshard(x: torch.Tensor, group=None, layout: str = "contiguous", dim: int = 1) -> torch.Tensor:
    """The full tensor from every rank's shard `x` (all-gather, then the layout's order); not differentiable."""
    layout = _check_layout(layout)
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    P, _ = _group_size_rank(group)
    if P == 1:
        return x.clone()
    L = x.shape[dim]
    if layout == "zigzag" and L % 2:
        raise ValueError(f"x: local length {L} must be even for layout='zigzag'")
    parts = [torch.empty_like(x) for _ in range(P)]
    dist.all_gather(parts, x.contiguous(), group=group)
    pieces = []
    for rank, part in enumerate(parts):
        local = 0
        for a, b in _chunks(rank, P, L, layout):
            pieces.append((a, part.narrow(dim, local, b - a)))
            local += b - a
    return torch.cat([p for _, p in sorted(pieces, key=lambda t: t[0])], dim)


# ---------------------------------------------------------------------------------------------------------
# The plan: which rows each rank computes against which, derived identically on every rank


@dataclass
class _Class:
    """Heads of one spanning branch whose pieces have identical member counts: one stacked problem."""

    q_heads: list[int]
    q_offsets: list[int]  # each query head's offset in the branch
    kv_heads: list[int]  # one entry per distinct (offset, kv head); q head i of the class reads entry i // group
    kv_offsets: list[int]
    group: int
    dilation: int
    seg_len: int
    pieces: list[list[tuple[int, int, int, int]]]  # [rank] -> (segment, global lo, global hi, local row of lo)
    segments: list[list[tuple[int, int, int, int]]]  # [rank] -> (segment, global start, start, stop) per piece

    def rows(self, rank: int, offsets: list[int]) -> list[torch.Tensor]:
        """Per offset, the local rows of its members on `rank`, concatenated over the rank's pieces."""
        r, s = self.dilation, self.seg_len
        out = []
        for o in offsets:
            parts = []
            for seg, lo, hi, local in self.pieces[rank]:
                first = _first_member(lo, seg * s, o, r)
                if first < hi:
                    parts.append(torch.arange(first - lo + local, hi - lo + local, r))
            out.append(torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long))
        return out


@dataclass
class _Task:
    cls: int
    x0: int  # query rows [x0, x1) of the class's compacted rows on this rank
    x1: int
    y0: int  # key rows [y0, y1): own compacted rows (local tasks) or offsets in the received payload
    y1: int
    causal: bool


@dataclass(eq=False)  # hashed by identity: plans are cached, and so are their index tensors
class RingPlan:
    """What one configuration computes and sends (see the module docstring). `bytes_sent(rank, ...)` is the
    forward traffic of that rank; backward sends the same K/V again and the same rows of dK/dV in float32."""

    P: int
    L: int
    layout: str
    local_branches: list[int]
    classes: list[_Class]
    # needed[dst][src]: per class, the compacted row ranges [a, b) of src that dst reads, in payload order
    needed: list[list[list[list[tuple[int, int]]]]]
    tasks: list[list[list[_Task]]] = field(default_factory=list)  # tasks[rank][src]

    def rows_needed(self, dst: int, src: int) -> int:
        """kv rows x kv heads that src sends dst (one of K or V)."""
        return sum((b - a) * len(self.classes[c].kv_heads)
                   for c, ranges in enumerate(self.needed[dst][src]) for a, b in ranges)

    def bytes_sent(self, rank: int, batch: int, head_dim: int, itemsize: int) -> int:
        """Forward bytes of K and V that `rank` sends in total."""
        rows = sum(self.rows_needed(dst, rank) for dst in range(self.P) if dst != rank)
        return 2 * rows * batch * head_dim * itemsize


def _first_member(lo: int, seg_start: int, offset: int, r: int) -> int:
    """The first global position p >= lo with (p - seg_start) % r == offset (members are p, p + r, ...)."""
    return seg_start + offset + r * max(0, -(-(lo - seg_start - offset) // r))


def _count(lo: int, hi: int, seg_start: int, offset: int, r: int) -> int:
    return max(0, -(-(hi - _first_member(lo, seg_start, offset, r)) // r))


def _is_local(s: int, L: int, layout: str) -> bool:
    chunk = L if layout == "contiguous" else L // 2
    return chunk % s == 0


@functools.lru_cache(maxsize=64)
def ring_plan(P: int, L: int, num_heads: int, num_kv_heads: int, segment_lengths: tuple, dilation_rates: tuple,
              head_groups: str, causal: bool, layout: str) -> RingPlan:
    """The plan of `ring_attention` for a configuration (cached): local branches, stacked head classes of the
    spanning branches, the rows every rank sends every other, and each rank's block tasks."""
    N = P * L
    G = num_heads // num_kv_heads
    table = branch_table(segment_lengths, dilation_rates, N, num_heads, head_groups)
    all_local = all(_is_local(br.seg_len, L, layout) for br in table)
    # Local branches run as a subset of the branch list; "split" heads depend on the whole list, so there a
    # branch is only run locally when all are.
    local = [i for i, br in enumerate(table)
             if _is_local(br.seg_len, L, layout) and (head_groups == "all" or all_local)]
    chunks = [_chunks(j, P, L, layout) for j in range(P)]
    classes: list[_Class] = []
    for i, br in enumerate(table):
        if i in local:
            continue
        s, r = br.seg_len, br.dilation
        # pieces[j]: (segment, global lo, global hi, local row of lo) in local order
        pieces = []
        for ch in chunks:
            out, base = [], 0
            for a, b in ch:
                for seg in range(a // s, (b - 1) // s + 1) if b > a else ():
                    lo, hi = max(a, seg * s), min(b, (seg + 1) * s)
                    out.append((seg, lo, hi, base + lo - a))
                base += b - a
            pieces.append(out)
        by_key: dict = {}
        for h in range(br.head_lo, br.head_hi):
            o = br.offset(h)
            key = tuple(tuple(_count(lo, hi, seg * s, o, r) for seg, lo, hi, _ in pj) for pj in pieces)
            by_key.setdefault(key, []).append((h, o))
        for key, heads in by_key.items():
            segs = []
            for j, pj in enumerate(pieces):
                start, seg_list = 0, []
                for n, (seg, lo, _, _) in enumerate(pj):
                    count = key[j][n]
                    if count:
                        seg_list.append((seg, lo, start, start + count))
                    start += count
                segs.append(seg_list)
            pairs = [(o, h // G) for h, o in heads]
            distinct = list(dict.fromkeys(pairs))
            per = len(heads) // len(distinct)
            if any(distinct.index(pr) != n // per for n, pr in enumerate(pairs)):
                distinct, per = pairs, 1  # no uniform grouping: one kv entry per query head
            classes.append(_Class([h for h, _ in heads], [o for _, o in heads], [kvh for _, kvh in distinct],
                                  [o for o, _ in distinct], per, r, s, pieces, segs))
    needed = [[[[] for _ in classes] for _ in range(P)] for _ in range(P)]
    tasks = [[[] for _ in range(P)] for _ in range(P)]
    for c, cl in enumerate(classes):
        for j in range(P):
            for src in range(P):
                _plan_pair(c, cl, j, src, causal, needed[j][src][c], tasks[j][src])
    # A task against received rows indexes the class's received tensor: the class's ranges one after another.
    for j in range(P):
        for src in range(P):
            if src == j:
                continue
            offsets = []
            for ranges in needed[j][src]:
                base, offs = 0, []
                for a, b in ranges:
                    offs.append((a, b, base))
                    base += b - a
                offsets.append(offs)
            for t in tasks[j][src]:
                a, b, off = next(rng for rng in offsets[t.cls] if rng[0] <= t.y0 and t.y1 <= rng[1])
                t.y0, t.y1 = off + t.y0 - a, off + t.y1 - a
    return RingPlan(P, L, layout, local, classes, needed, tasks)


def _plan_pair(c: int, cl: _Class, j: int, src: int, causal: bool, needed: list, tasks: list) -> None:
    """Tasks of rank j's queries of class c against src's keys, and the ranges of src's rows they read."""
    mine, theirs = cl.segments[j], cl.segments[src]
    for seg in sorted({p[0] for p in mine}):
        xs = [p for p in mine if p[0] == seg]
        ys = [p for p in theirs if p[0] == seg]
        if not ys:
            continue
        if src == j:  # own rows in position order: one causal (or full) square over the segment's rows
            tasks.append(_Task(c, xs[0][2], xs[-1][3], xs[0][2], xs[-1][3], causal))
            continue
        for _, glo, x0, x1 in xs:
            # pieces are disjoint position ranges: a key piece is wholly before a query piece or after it
            before = [p for p in ys if not causal or p[1] < glo]
            if before:
                y0, y1 = before[0][2], before[-1][3]
                if tasks and tasks[-1].cls == c and (tasks[-1].y0, tasks[-1].y1) == (y0, y1) and tasks[-1].x1 == x0:
                    tasks[-1].x1 = x1  # the previous query piece reads the same keys: extend it
                else:
                    tasks.append(_Task(c, x0, x1, y0, y1, False))
                if needed and needed[-1][1] >= y0:
                    needed[-1] = (needed[-1][0], max(needed[-1][1], y1))
                else:
                    needed.append((y0, y1))
    needed.sort()
    merged = []
    for a, b in needed:
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    needed[:] = merged


# ---------------------------------------------------------------------------------------------------------
# Block primitive: the single-device kernels on one dense branch, and the log-sum-exp merge


def _reference_forward(q, k, v, segment_lengths, dilation_rates, split_heads, causal, scale):
    return dilated_attention_reference(q, k, v, segment_lengths, dilation_rates, causal=causal, scale=scale,
                                       head_groups="split" if split_heads else "all")


def _reference_backward(grad_out, grad_lse, q, k, v, out, lse, segment_lengths, dilation_rates, split_heads,
                        causal, scale):
    # The reference has no backward op: recompute the block and chain through the merge by hand. With
    # alpha = exp(lse_b - LSE), d out_b = alpha dO and d lse_b = alpha (dO.out_b - dO.O + dLSE) give
    # dS = P (dO.v - delta): the spec's exact gradient.
    with torch.enable_grad():
        qb, kb, vb = (x.detach().requires_grad_() for x in (q, k, v))
        ob, lb = _reference_forward(qb, kb, vb, segment_lengths, dilation_rates, split_heads, causal, scale)
        finite = torch.isfinite(lb)
        alpha = torch.where(finite, torch.exp(lb - torch.where(finite, lse, lb)), torch.zeros_like(lb))
        go = grad_out.to(ob.dtype)
        dot = ((go * ob.detach()).sum(-1) - (go * out.to(ob.dtype)).sum(-1)).transpose(1, 2)
        if grad_lse is not None:
            dot = dot + grad_lse
        grads = torch.autograd.grad((ob, lb), (qb, kb, vb),
                                    (alpha.transpose(1, 2).unsqueeze(-1) * go, (alpha * dot).to(lb.dtype)))
    return grads


def _kernels(name: str):
    """(forward op, backward op) of a backend, both with the schemas of dilated_attn::forward/backward."""
    if name in ("cpu", "cuda"):
        return torch.ops.dilated_attn.forward, torch.ops.dilated_attn.backward
    if name == "triton":
        return torch.ops.dilated_attn.triton_forward, torch.ops.dilated_attn.triton_backward
    return _reference_forward, _reference_backward


def _squares(nq: int, nk: int) -> list[tuple[int, int, int, int]]:
    """Cut a full nq x nk block into squares (q0, q1, k0, k1) the one-branch op can run (q and k of equal
    length): keys in slices of nq when nk > nq, queries in slices of nk (the last padded) when nq > nk."""
    if nq <= nk:
        out = [(0, nq, k0, k0 + nq) for k0 in range(0, nk - nk % nq, nq)]
        if nk % nq:
            rest = nk - nk % nq
            out += [(q0, q1, k0 + rest, k1 + rest) for q0, q1, k0, k1 in _squares(nq, nk % nq)]
        return out
    return [(q0, min(q0 + nk, nq), 0, nk) for q0 in range(0, nq, nk)]


def _pad_rows(x: torch.Tensor, n: int) -> torch.Tensor:
    """x [B, m, ...] padded with zero rows to [B, n, ...] (zero queries: finite, and their output is dropped)."""
    if x.shape[1] == n:
        return x
    return torch.cat([x, x.new_zeros((x.shape[0], n - x.shape[1], *x.shape[2:]))], 1)


def _merge(acc_o, acc_l, o, lse):
    """acc <- log-sum-exp merge of (acc_o [B,n,H,D], acc_l [B,H,n]) with (o, lse), in place, in acc's dtype;
    rows where both are -inf stay (0, -inf)."""
    lse = lse.to(acc_l.dtype)
    top = torch.maximum(acc_l, lse)
    top = torch.where(torch.isinf(top), torch.zeros_like(top), top)  # both -inf: weights 0, result (0, -inf)
    e_acc, e_new = torch.exp(acc_l - top), torch.exp(lse - top)
    total = e_acc + e_new
    # normalised by their sum (not exp(. - merged lse), which a rounded lse would keep from summing to 1)
    safe = torch.where(total > 0, total, torch.ones_like(total))
    w_acc = (e_acc / safe).transpose(1, 2).unsqueeze(-1)
    w_new = (e_new / safe).transpose(1, 2).unsqueeze(-1)
    acc_o.mul_(w_acc).add_(w_new * o.to(acc_o.dtype))
    acc_l.copy_(top + torch.log(total))


def _block_forward(fwd, q, k, v, causal, scale, acc_o, acc_l):
    """Merge the attention of q [B,nq,H,D] over k, v [B,nk,Hk,D] (one dense block) into acc_o/acc_l."""
    if causal:  # own rows: nq == nk
        o, lse = fwd(q, k, v, [q.shape[1]], [1], False, True, scale)
        _merge(acc_o, acc_l, o, lse)
        return
    for q0, q1, k0, k1 in _squares(q.shape[1], k.shape[1]):
        n = k1 - k0
        o, lse = fwd(_pad_rows(q[:, q0:q1], n), k[:, k0:k1], v[:, k0:k1], [n], [1], False, False, scale)
        _merge(acc_o[:, q0:q1], acc_l[:, :, q0:q1], o[:, : q1 - q0], lse[:, :, : q1 - q0])


def _block_backward(bwd, q, k, v, out, lse, d_out, d_lse, causal, scale, dq, dk, dv):
    """Add one block's exact gradients (merged out/LSE of its query rows) into dq, dk, dv (accumulators)."""
    squares = [(0, q.shape[1], 0, k.shape[1])] if causal else _squares(q.shape[1], k.shape[1])
    for q0, q1, k0, k1 in squares:
        n = k1 - k0
        rows = [_pad_rows(x[:, q0:q1], n) for x in (q, out, d_out)]
        pad_l = [torch.nn.functional.pad(x[:, :, q0:q1], (0, n - (q1 - q0))) for x in (lse, d_lse)]
        gq, gk, gv = bwd(rows[2], pad_l[1], rows[0], k[:, k0:k1], v[:, k0:k1], rows[1], pad_l[0], [n], [1],
                         False, causal, scale)
        dq[:, q0:q1] += gq[:, : q1 - q0]
        dk[:, k0:k1] += gk
        dv[:, k0:k1] += gv


# ---------------------------------------------------------------------------------------------------------
# Communication: per-class tensors [B, n, Hk, D] travel as one flat buffer per step and direction


def _pack(parts: list[torch.Tensor], ranges: list[list[tuple[int, int]]], dtype) -> torch.Tensor:
    """The given row ranges of each class's tensor, class after class, flattened (one send buffer)."""
    flat = [x[:, a:b].reshape(-1) for x, rng in zip(parts, ranges) for a, b in rng]
    return torch.cat(flat).to(dtype) if flat else torch.empty(0, dtype=dtype)


def _unpack(buf: torch.Tensor, shapes: list[tuple[int, ...]]) -> list[torch.Tensor]:
    """Views of `buf` as consecutive tensors of the given shapes (the inverse of _pack on the receiver)."""
    out, start = [], 0
    for shape in shapes:
        n = math.prod(shape)
        out.append(buf[start: start + n].view(shape))
        start += n
    return out


def _global(group, rank: int) -> int:
    return rank if group is None else dist.get_global_rank(group, rank)


class _Step:
    """One step's point-to-point transfers, posted at once (batch_isend_irecv) and waited on later."""

    def __init__(self, group, sends, recv=None):
        ops = [dist.P2POp(dist.isend, buf, _global(group, peer), group) for peer, buf in sends]
        if recv is not None:
            ops.append(dist.P2POp(dist.irecv, recv[1], _global(group, recv[0]), group))
        self.works = dist.batch_isend_irecv(ops) if ops else []
        self.recv = recv
        self.sends = sends  # the send buffers must live until the transfer is done

    def wait(self) -> Optional[torch.Tensor]:
        for w in self.works:
            w.wait()
        self.works, self.sends = [], []
        return None if self.recv is None else self.recv[1]


class _Ring:
    """This rank's view of a plan: compacted index tensors and the transfers of each step."""

    def __init__(self, plan: RingPlan, rank: int, group, B: int, D: int, device):
        self.plan, self.rank, self.group, self.B, self.D = plan, rank, group, B, D
        self.comp = _compacted(plan, rank, device)
        self.device = device

    def shapes(self, dst: int, src: int) -> list[tuple[int, ...]]:
        """Shapes of the per-class tensors that src sends dst (one of K, V, dK or dV)."""
        return [(self.B, sum(b - a for a, b in rng), len(cl.kv_heads), self.D)
                for cl, rng in zip(self.plan.classes, self.plan.needed[dst][src])]

    def post_kv(self, t: int, kc, vc) -> Optional[_Step]:
        """Step t of the K/V exchange: my rows that rank+t reads go there; the rows I read from rank-t come."""
        P, me = self.plan.P, self.rank
        if t >= P:
            return None
        dst, src = (me + t) % P, (me - t) % P
        sends, recv = [], None
        if self.plan.rows_needed(dst, me):
            rng = self.plan.needed[dst][me]
            sends.append((dst, torch.cat([_pack(kc, rng, kc[0].dtype), _pack(vc, rng, vc[0].dtype)])))
        rows = self.plan.rows_needed(me, src)
        if rows:
            recv = (src, torch.empty(2 * rows * self.B * self.D, dtype=kc[0].dtype, device=kc[0].device))
        return _Step(self.group, sends, recv)

    def received_kv(self, step: _Step, t: int):
        """(keys, values) per class received at step t (None for a class with nothing received)."""
        src = (self.rank - t) % self.plan.P
        buf = step.wait()
        shapes = self.shapes(self.rank, src)
        if buf is None:
            return [None] * len(shapes), [None] * len(shapes)
        parts = _unpack(buf, shapes + shapes)
        return parts[: len(shapes)], parts[len(shapes):]

    def post_grads(self, t: int, gk, gv, dtype) -> tuple[_Step, int]:
        """Send dK/dV of the rows received at step t back to their owner rank-t (float32 or float64); receive
        those of my rows from rank+t."""
        P, me = self.plan.P, self.rank
        src, dst = (me - t) % P, (me + t) % P
        sends, recv = [], None
        if self.plan.rows_needed(me, src):
            whole = [[(0, x.shape[1])] for x in gk]
            sends.append((src, torch.cat([_pack(gk, whole, gk[0].dtype), _pack(gv, whole, gv[0].dtype)])))
        rows = self.plan.rows_needed(dst, me)
        if rows:
            recv = (dst, torch.empty(2 * rows * self.B * self.D, dtype=dtype, device=self.device))
        return _Step(self.group, sends, recv), dst

    def add_returned_grads(self, step: _Step, dst: int, dkc, dvc) -> None:
        buf = step.wait()
        if buf is None:
            return
        shapes = self.shapes(dst, self.rank)
        parts = _unpack(buf, shapes + shapes)
        for c, rng in enumerate(self.plan.needed[dst][self.rank]):
            for grads, acc in ((parts[c], dkc[c]), (parts[len(shapes) + c], dvc[c])):
                start = 0
                for a, b in rng:
                    acc[:, a:b] += grads[:, start: start + b - a]
                    start += b - a


# ---------------------------------------------------------------------------------------------------------
# The autograd function


class _Rows:
    """A set of (row, head) pairs of a [B, L, H, ...] tensor: head heads[c] at rows[:, c]. Gathers them as a
    [B, n, c, ...] tensor and writes back. Where every head has the same contiguous rows and the heads are
    contiguous (dense attention), the gather is a slice (a view), not a copy."""

    def __init__(self, rows: list[torch.Tensor], heads: list[int], device):
        n = len(rows[0])
        first = int(rows[0][0]) if n else 0
        # Columns with the same head and rows (query heads of one class that share a kv entry's rows without a
        # uniform grouping) are summed into the first of them before a write-back: `merge[c]` is its index.
        first_col = {}
        self.merge = [first_col.setdefault((h, int(r[0]) if n else None), c) for c, (h, r) in enumerate(zip(heads, rows))]
        self.unique = [c for c, m in enumerate(self.merge) if m == c]
        contiguous = n > 0 and all(torch.equal(r, rows[0]) for r in rows) and int(rows[0][-1]) == first + n - 1
        if contiguous and heads == list(range(heads[0], heads[0] + len(heads))):
            self.slices = (slice(first, first + n), slice(heads[0], heads[0] + len(heads)))
        else:
            self.slices = None
            self.all_rows = torch.stack(rows, 1).to(device)  # [n, columns]
            self.all_heads = torch.tensor(heads, dtype=torch.long, device=device)
            self.rows, self.heads = self.all_rows[:, self.unique], self.all_heads[self.unique]

    def _index(self, B: int, device, every_column: bool = False):
        if self.slices is not None:
            return (slice(None), *self.slices)
        rows, heads = (self.all_rows, self.all_heads) if every_column else (self.rows, self.heads)
        return (torch.arange(B, device=device).view(B, 1, 1), rows.unsqueeze(0), heads.view(1, 1, -1))

    def gather(self, x):  # [B, L, H, ...] -> [B, n, c, ...]
        return x[self._index(x.shape[0], x.device, every_column=True)]

    def gather_lse(self, x):  # [B, H, L] -> [B, c, n]
        return self.gather(x.transpose(1, 2)).transpose(1, 2)

    def put(self, x, values):  # every column is distinct here: query rows (one per head and position)
        x[self._index(x.shape[0], x.device, every_column=True)] = values.to(x.dtype)

    def put_lse(self, x, values):
        self.put(x.transpose(1, 2), values.transpose(1, 2))

    def add(self, acc, values):
        """acc[rows, heads] += values (float32/64, one rounding to acc's dtype). Repeated columns are summed
        first, in column order, so the result does not depend on the device's scheduling."""
        if len(self.unique) < len(self.merge):
            summed = values[:, :, self.unique].clone()
            slot = {c: i for i, c in enumerate(self.unique)}
            for c, m in enumerate(self.merge):
                if m != c:
                    summed[:, :, slot[m]] += values[:, :, c]
            values = summed
        index = self._index(acc.shape[0], acc.device)
        acc[index] = (acc[index].to(values.dtype) + values).to(acc.dtype)


class _Compacted:
    """One class on one rank: its query rows and its kv rows."""

    def __init__(self, cl: _Class, rank: int, device):
        self.q = _Rows(cl.rows(rank, cl.q_offsets), cl.q_heads, device)
        self.kv = _Rows(cl.rows(rank, cl.kv_offsets), cl.kv_heads, device)


@functools.lru_cache(maxsize=64)
def _compacted(plan: RingPlan, rank: int, device) -> list[_Compacted]:
    return [_Compacted(cl, rank, device) for cl in plan.classes]


def _zeros_like(xs, dtype):
    return [None if x is None else torch.zeros(x.shape, dtype=dtype, device=x.device) for x in xs]


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, plan, rank, group, local_problem, backend, scale, causal):
        fwd, _ = _kernels(backend)
        B, L, H, D = q.shape
        acc_dtype = lse_dtype(q.dtype)
        ring = _Ring(plan, rank, group, B, D, q.device)
        kc = [cp.kv.gather(k) for cp in ring.comp]
        vc = [cp.kv.gather(v) for cp in ring.comp]
        step = ring.post_kv(1, kc, vc)  # in flight while the local blocks compute
        # The result starts as the local branches' (merged by the kernel, as on one device); the spanning
        # branches' partials merge into their rows at the end, in float32, rounded once.
        if plan.local_branches:
            p = local_problem
            out, lse = fwd(q, k, v, list(p.segment_lengths), list(p.dilation_rates), p.split_heads, causal, scale)
        else:
            out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
            lse = torch.full((B, H, L), -math.inf, dtype=acc_dtype, device=q.device)
        qc = [cp.q.gather(q) for cp in ring.comp]
        acc = [(torch.zeros(x.shape, dtype=acc_dtype, device=q.device),
                torch.full((B, x.shape[2], x.shape[1]), -math.inf, dtype=acc_dtype, device=q.device)) for x in qc]
        for t in range(plan.P):
            src = (rank - t) % plan.P
            if t == 0:
                keys, values = kc, vc
            else:
                keys, values = ring.received_kv(step, t)
                step = ring.post_kv(t + 1, kc, vc)
            for task in plan.tasks[rank][src]:
                c, xs, ys = task.cls, slice(task.x0, task.x1), slice(task.y0, task.y1)
                _block_forward(fwd, qc[c][:, xs], keys[c][:, ys], values[c][:, ys], task.causal, scale,
                               acc[c][0][:, xs], acc[c][1][:, :, xs])
        for cp, (a_o, a_l) in zip(ring.comp, acc):
            cur_o, cur_l = cp.q.gather(out).to(acc_dtype), cp.q.gather_lse(lse)
            _merge(cur_o, cur_l, a_o, a_l)
            cp.q.put(out, cur_o)
            cp.q.put_lse(lse, cur_l)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.config = (plan, rank, group, local_problem, backend, scale, causal)
        return out, lse

    @staticmethod
    def backward(ctx, d_out, d_lse):
        q, k, v, out, lse = ctx.saved_tensors
        plan, rank, group, local_problem, backend, scale, causal = ctx.config
        _, bwd = _kernels(backend)
        B, L, H, D = q.shape
        acc_dtype = lse_dtype(q.dtype)
        d_out = torch.zeros_like(out) if d_out is None else d_out.to(q.dtype)
        d_lse = torch.zeros_like(lse) if d_lse is None else d_lse
        ring = _Ring(plan, rank, group, B, D, q.device)
        kc = [cp.kv.gather(k) for cp in ring.comp]
        vc = [cp.kv.gather(v) for cp in ring.comp]
        step = ring.post_kv(1, kc, vc)
        # As in the forward: the local branches' gradients (the kernel's, as on one device), then each spanning
        # class's float32 sums added to their rows with one rounding.
        if plan.local_branches:
            p = local_problem
            dq, dk, dv = bwd(d_out, d_lse, q, k, v, out, lse, list(p.segment_lengths), list(p.dilation_rates),
                             p.split_heads, causal, scale)
        else:
            dq, dk, dv = (torch.zeros(x.shape, dtype=x.dtype, device=x.device) for x in (q, k, v))
        comp = ring.comp
        qc, oc, doc = ([cp.q.gather(x) for cp in comp] for x in (q, out, d_out))
        lc, dlc = ([cp.q.gather_lse(x) for cp in comp] for x in (lse, d_lse))
        dqc, dkc, dvc = _zeros_like(qc, acc_dtype), _zeros_like(kc, acc_dtype), _zeros_like(vc, acc_dtype)
        returning = []  # the dK/dV of my rows coming back from the ranks that read them
        for t in range(plan.P):
            src = (rank - t) % plan.P
            if t == 0:
                keys, values, gk, gv = kc, vc, dkc, dvc
            else:
                keys, values = ring.received_kv(step, t)
                step = ring.post_kv(t + 1, kc, vc)
                gk, gv = _zeros_like(keys, acc_dtype), _zeros_like(values, acc_dtype)
            for task in plan.tasks[rank][src]:
                c, xs, ys = task.cls, slice(task.x0, task.x1), slice(task.y0, task.y1)
                _block_backward(bwd, qc[c][:, xs], keys[c][:, ys], values[c][:, ys], oc[c][:, xs],
                                lc[c][:, :, xs], doc[c][:, xs], dlc[c][:, :, xs], task.causal, scale,
                                dqc[c][:, xs], gk[c][:, ys], gv[c][:, ys])
            if t > 0:
                returning.append(ring.post_grads(t, gk, gv, acc_dtype))
        for ret, dst in returning:
            ring.add_returned_grads(ret, dst, dkc, dvc)
        for cp, g_q, g_k, g_v in zip(comp, dqc, dkc, dvc):
            cp.q.add(dq, g_q)
            cp.kv.add(dk, g_k)
            cp.kv.add(dv, g_v)
        return dq, dk, dv, None, None, None, None, None, None, None


# ---------------------------------------------------------------------------------------------------------
# The public function

_CODES = {
    "dtype": {d: n for n, d in enumerate((torch.float16, torch.bfloat16, torch.float32, torch.float64))},
    "layout": {n: i for i, n in enumerate(LAYOUTS)},
    "head_groups": {"all": 0, "split": 1},
    "backend": {n: i for i, n in enumerate(BACKENDS)},
}
_FIELDS = ("batch", "local length", "query heads", "kv heads", "head_dim", "dtype", "device type", "causal",
           "layout", "head_groups", "backend", "scale", "segment_lengths/dilation_rates")


def _check_same_config(group, device, fields: tuple[int, ...]) -> None:
    """All-gather a small descriptor of the call and raise the same ValueError on every rank on a mismatch,
    so a rank with a different configuration fails the call instead of hanging in a transfer."""
    backend = dist.get_backend(group)
    dev = device if "nccl" in str(backend).lower() else torch.device("cpu")
    mine = torch.tensor(fields, dtype=torch.int64, device=dev)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)
    table = torch.stack(every).cpu()
    for col, name in enumerate(_FIELDS):
        values = table[:, col]
        if (values != values[0]).any():
            bad = int((values != values[0]).nonzero()[0])
            shown = values.tolist() if name not in ("scale", "segment_lengths/dilation_rates") else "differs"
            raise ValueError(f"ring_attention: every rank of the group must pass the same {name}, but rank 0 and "
                             f"rank {bad} differ ({shown})")


def ring_attention(q, k, v, segment_lengths=None, dilation_rates=None, *, causal=False, scale=None,
                   head_groups="all", group=None, layout="contiguous", return_lse=False, backend="auto"):
    """Dilated attention over a sequence sharded across the ranks of `group` (../shared/SPEC.md).

    Each rank passes its shard `q` `[B, L, Hq, D]`, `k`, `v` `[B, L, Hkv, D]` of a global sequence of
    `N = P * L` tokens (`layout="contiguous"`: rank j holds `[j*L, (j+1)*L)`; `"zigzag"`: the sequence cut in
    2P chunks, rank j holds chunks j and 2P-1-j, which balances causal work) and gets the output (and with
    `return_lse=True` the LSE `[B, Hq, L]`) of `dilated_attention` on the gathered tensors at its positions;
    the backward gives its shards' gradients. `segment_lengths=None` (and `dilation_rates=None`) is dense
    attention over the whole sequence (one branch `(N, 1)`). `group=None` is the default process group, or a
    single process where none is initialised; with one rank this is `dilated_attention`. `backend` picks the
    single-device kernels of the local blocks, as in `dilated_attention`.

    Every rank must pass the same configuration; the call all-gathers a small descriptor first and raises the
    same ValueError on every rank if they differ. `dilated_attn.shard` / `unshard` cut and reassemble tensors.
    """
    layout = _check_layout(layout)
    if (segment_lengths is None) != (dilation_rates is None):
        raise ValueError("segment_lengths and dilation_rates must both be None (dense ring attention) or both "
                         "be given")
    P, rank = _group_size_rank(group)
    dense = segment_lengths is None
    L = q.shape[1] if isinstance(q, torch.Tensor) and q.dim() == 4 else 0
    N = P * L
    w, r = ([max(N, 1)], [1]) if dense else (segment_lengths, dilation_rates)
    # validates the local tensors and every argument with the single-device rules
    p = validate(q, k, v, w, r, causal=causal, scale=scale, head_groups=head_groups, return_lse=return_lse,
                 backend=backend)
    if layout == "zigzag" and L % 2:
        raise ValueError(f"layout='zigzag' needs the global length N = P*L divisible by 2P, i.e. an even local "
                         f"length L, got L={L} on {P} ranks")
    if P == 1:
        return dilated_attention(q, k, v, w, r, causal=causal, scale=scale, head_groups=head_groups,
                                 return_lse=return_lse, backend=backend)
    branches = tuple(zip(p.segment_lengths, p.dilation_rates))
    digest = zlib.crc32(repr(("dense",) if dense else branches).encode())
    scale_bits = struct.unpack("<q", struct.pack("<d", p.scale))[0]
    _check_same_config(group, q.device, (
        p.batch, L, p.num_heads, p.num_kv_heads, p.head_dim, _CODES["dtype"].get(p.dtype, -1),
        ["cpu", "cuda"].index(q.device.type) if q.device.type in ("cpu", "cuda") else 2, int(causal),
        _CODES["layout"][layout], _CODES["head_groups"][head_groups], _CODES["backend"][backend], scale_bits,
        digest))
    plan = ring_plan(P, L, p.num_heads, p.num_kv_heads, p.segment_lengths, p.dilation_rates, head_groups,
                     causal, layout)
    # The kernels of the local blocks: the backend dilated_attention would pick for this shard.
    local = [i for i in plan.local_branches]
    local_problem = validate(q, k, v, [p.segment_lengths[i] for i in local] or [1],
                             [p.dilation_rates[i] for i in local] or [1], causal=causal, scale=p.scale,
                             head_groups=head_groups if len(local) == len(branches) else "all", backend=backend)
    chosen = dispatch.select(local_problem, backend).name
    out, lse = _RingAttention.apply(q, k, v, plan, rank, group, local_problem, chosen, p.scale, causal)
    return (out, lse) if return_lse else out
