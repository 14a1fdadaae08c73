"""The ring's autograd function: forward and exact backward of one ring_attention call on this rank.

Forward: the local branches run as one single-device call; each head stack's compacted queries meet the blocks of
keys of every rank (own rows first, then one received block per step) and their partials merge into the local
result. Backward: the exact method of the spec (each block's backward with the merged out and LSE), K/V exchanged
again, dK/dV of received rows summed in float32 and sent back to their owner, dQ local.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from .. import backends, dispatch
from ..spec import Problem, lse_dtype
from .blocks import merge_block, block_backward, block_forward
from .comm import RingComm
from .plan import HeadStack, RingPlan

__all__ = ["RingAttention", "RingConfig", "ring_forward", "ring_backward"]


class RowSet:
    """A set of (row, head) pairs of a [B, L, H, ...] tensor: head heads[c] at rows[:, c]. Gathers them as a
    [B, n, c, ...] tensor and writes back. Where every head has the same contiguous rows and the heads are
    contiguous (dense attention), the gather is a slice (a view), not a copy."""

    def __init__(self, rows: list[torch.Tensor], heads: list[int], device):
        n = len(rows[0])
        first = int(rows[0][0]) if n else 0
        # Columns with the same head and rows (query heads of one stack that share a kv entry's rows without a
        # uniform grouping) are summed into the first of them before a write-back: `merge[c]` is its index.
        first_col = {}
        self.merge = [first_col.setdefault((h, int(r[0]) if n else None), c)
                      for c, (h, r) in enumerate(zip(heads, rows))]
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
        """acc[rows, heads] += values (float32/64, one rounding to acc's dtype; `values` is consumed). Repeated
        columns are summed first, in column order, so the result does not depend on the device's scheduling."""
        if len(self.unique) < len(self.merge):
            summed = values[:, :, self.unique].clone()
            slot = {c: i for i, c in enumerate(self.unique)}
            for c, m in enumerate(self.merge):
                if m != c:
                    summed[:, :, slot[m]] += values[:, :, c]
            values = summed
        index = self._index(acc.shape[0], acc.device)
        if self.slices is not None:  # a view: added in place, two passes
            view = acc[index]
            view.copy_(values.add_(view))
        else:
            acc[index] = (acc[index].to(values.dtype) + values).to(acc.dtype)


class CompactedRows:
    """One head stack on one rank: its query rows and its kv rows."""

    def __init__(self, stack: HeadStack, rank: int, device):
        self.q = RowSet(stack.rows(rank, stack.q_offsets), stack.q_heads, device)
        self.kv = RowSet(stack.rows(rank, stack.kv_offsets), stack.kv_heads, device)


@functools.lru_cache(maxsize=64)
def compacted_rows(plan: RingPlan, rank: int, device) -> list[CompactedRows]:
    return [CompactedRows(stack, rank, device) for stack in plan.stacks]


def _zeros_like(xs, dtype):
    return [None if x is None else torch.zeros(x.shape, dtype=dtype, device=x.device) for x in xs]


def _task_slices(task):
    return task.stack, slice(task.q_start, task.q_stop), slice(task.kv_start, task.kv_stop)


@dataclass(frozen=True)
class RingConfig:
    """One rank's part of a ring call: the plan, this rank and its group, the problem of the local branches and
    the backend that runs them and the blocks."""

    plan: RingPlan
    rank: int
    group: object
    local_problem: Problem
    backend: str
    scale: float
    causal: bool


class RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cfg: RingConfig):
        out, lse = ring_forward(q, k, v, cfg)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.cfg = cfg
        # An output without a gradient arrives as None, not as zeros: the blocks then get no LSE gradient, which
        # the cudnn backend's backward needs in order to run at all.
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, d_out, d_lse):
        q, k, v, out, lse = ctx.saved_tensors
        return (*ring_backward(q, k, v, out, lse, d_out, d_lse, ctx.cfg), None)


def _start_exchange(cfg: RingConfig, q, k, v):
    """This rank's compacted rows and their K/V, and the K/V exchange posted: step 1, or every step at once
    (comm.py, `eager`), in flight while the local branches compute."""
    comm = RingComm(cfg.plan, cfg.rank, cfg.group, q.shape[0], q.shape[3], q.device)
    rows = compacted_rows(cfg.plan, cfg.rank, q.device)
    kc = [cp.kv.gather(k) for cp in rows]
    vc = [cp.kv.gather(v) for cp in rows]
    eager = comm.eager(q.shape[2], k.shape[2])
    return comm, rows, kc, vc, eager, comm.post_all_kv(kc, vc) if eager else comm.post_kv(1, kc, vc)


def ring_forward(q, k, v, cfg: RingConfig):
    """(out, lse) of this rank's shard: the local branches, then every head stack's blocks."""
    plan, rank, local_problem, scale = cfg.plan, cfg.rank, cfg.local_problem, cfg.scale
    forward_op, _ = backends.get(cfg.backend).ops()
    B, L, H, D = q.shape
    lse_type = lse_dtype(q.dtype)
    comm, rows, kc, vc, eager, step = _start_exchange(cfg, q, k, v)
    # The result starts as the local branches' (merged by the kernel, as on one device); each block's partial
    # result merges into its rows: in place where a stack's rows are a block of the result (dense attention),
    # else into the stack's own (out, lse), merged into its rows at the end.
    if plan.local_branches:
        out, lse = forward_op(q, k, v, **local_problem.op_arguments())
    else:
        out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
        lse = torch.full((B, H, L), -math.inf, dtype=lse_type, device=q.device)
    qc = [cp.q.gather(q) for cp in rows]
    acc = [(cp.q.gather(out), cp.q.gather_lse(lse)) if cp.q.slices is not None else
           (torch.zeros(x.shape, dtype=q.dtype, device=q.device),
            torch.full((B, x.shape[2], x.shape[1]), -math.inf, dtype=lse_type, device=q.device))
           for cp, x in zip(rows, qc)]
    for t in range(plan.P):
        src = (rank - t) % plan.P
        if t == 0:
            keys, values = kc, vc
        else:
            keys, values = comm.received_kv(step, t)
            if not eager:
                step = comm.post_kv(t + 1, kc, vc)
        for task in plan.tasks[rank][src]:
            s, qs, ks = _task_slices(task)
            block_forward(forward_op, qc[s][:, qs], keys[s][:, ks], values[s][:, ks], task.causal, scale,
                          acc[s][0][:, qs], acc[s][1][:, :, qs])
    for cp, (acc_out, acc_lse) in zip(rows, acc):
        if cp.q.slices is None:
            cur_out, cur_lse = cp.q.gather(out), cp.q.gather_lse(lse)
            merge_block(cur_out, cur_lse, acc_out, acc_lse)
            cp.q.put(out, cur_out)
            cp.q.put_lse(lse, cur_lse)
    return out, lse


def ring_backward(q, k, v, out, lse, d_out, d_lse, cfg: RingConfig):
    """(dq, dk, dv) of this rank's shards, from the merged out and lse (d_out or d_lse may be None)."""
    plan, rank, local_problem, scale = cfg.plan, cfg.rank, cfg.local_problem, cfg.scale
    # Every block's backward takes the merged out and LSE of its rows, so only the user's own LSE gradient
    # (None where the LSE was not used) reaches the blocks: where it is there and this backend's backward cannot
    # take it, dispatch names the one that runs.
    name, _ = dispatch.backward_backend(local_problem, cfg.backend, lse_gradient=d_lse is not None)
    _, backward_op = backends.get(name).ops()
    B, L, H, D = q.shape
    acc_dtype = lse_dtype(q.dtype)
    d_out = torch.zeros_like(out) if d_out is None else d_out.to(q.dtype)
    comm, rows, kc, vc, eager, step = _start_exchange(cfg, q, k, v)

    def local_branches():
        if plan.local_branches:
            return backward_op(d_out, d_lse, q, k, v, out, lse, **local_problem.op_arguments())
        return tuple(torch.zeros(x.shape, dtype=x.dtype, device=x.device) for x in (q, k, v))

    # Stepwise: the local branches' gradients (the kernel's, as on one device) while the first K/V block travels;
    # then the received blocks, each one's dK/dV sent back as soon as they are complete; the own rows last, while
    # the last of them travel. Eager (every K/V already posted): the own rows first while the K/V arrive, then the
    # received blocks, and the local branches last, while the dK/dV travel back. Each head stack's float32 sums are
    # added to their rows with one rounding.
    if not eager:
        dq, dk, dv = local_branches()
    qc, oc, doc = ([cp.q.gather(x) for cp in rows] for x in (q, out, d_out))
    lc = [cp.q.gather_lse(lse) for cp in rows]
    dlc = [None if d_lse is None else cp.q.gather_lse(d_lse) for cp in rows]
    dqc, dkc, dvc = _zeros_like(qc, acc_dtype), _zeros_like(kc, acc_dtype), _zeros_like(vc, acc_dtype)
    returning = []  # the dK/dV of my rows coming back from the ranks that read them
    # The received blocks first, each one's dK/dV sent back as soon as they are complete; the own rows last,
    # while the last of them travel.
    for t in [0, *range(1, plan.P)] if eager else [*range(1, plan.P), 0]:
        src = (rank - t) % plan.P
        if t == 0:
            keys, values, gk, gv = kc, vc, dkc, dvc
        else:
            keys, values = comm.received_kv(step, t)
            if not eager:
                step = comm.post_kv(t + 1, kc, vc)
            grads, gk, gv = comm.grad_buffer(t, acc_dtype)
        for task in plan.tasks[rank][src]:
            s, qs, ks = _task_slices(task)
            block_backward(backward_op, qc[s][:, qs], keys[s][:, ks], values[s][:, ks], oc[s][:, qs],
                           lc[s][:, :, qs], doc[s][:, qs], None if dlc[s] is None else dlc[s][:, :, qs],
                           task.causal, scale, dqc[s][:, qs], gk[s][:, ks], gv[s][:, ks])
        if t > 0:
            returning.append(comm.post_grads(t, grads))
    if eager:
        dq, dk, dv = local_branches()
    for ret, dst in returning:
        comm.add_returned_grads(ret, dst, dkc, dvc)
    for cp, g_q, g_k, g_v in zip(rows, dqc, dkc, dvc):
        cp.q.add(dq, g_q)
        cp.kv.add(dk, g_k)
        cp.kv.add(dv, g_v)
    return dq, dk, dv
