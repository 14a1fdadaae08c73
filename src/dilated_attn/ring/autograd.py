"""The ring's autograd function: forward and exact backward of one ring_attention call on this rank.

Forward: the local branches run as one single-device call; each head stack's compacted queries meet the blocks of
keys of every rank (own rows first, then one received block per step) and their partials merge into the local
result. Where every step's keys are posted at once (comm.RingComm.eager, as for LongNet), a stack's full blocks run
as one block over their keys joined (JoinedBlock): one call and one merge. Backward: the exact method of the spec
(each block's backward with the merged out and LSE); the K/V the forward received where it posted every step at
once (Exchanged), else exchanged again but for the last step's, which the forward keeps; dK/dV of received rows
summed in float32 and sent back to their owner, dQ local.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from .. import dispatch
from ..spec import Problem, lse_dtype
from .blocks import (
    Sums,
    accumulate,
    block_backward,
    block_forward,
    block_gradients,
    block_ops,
    merge_block,
    run_backward,
    run_forward,
)
from .comm import RingComm
from .plan import BranchRun, HeadStack, RingPlan

__all__ = ["RingAttention", "RingConfig", "ring_forward", "ring_backward"]


class RowSet:
    """A set of (row, head) pairs of a [B, L, H, ...] tensor: head heads[c] at rows[:, c]. Gathers them as a
    [B, n, c, ...] tensor and writes back. Where the rows of column c are `first + c*column_rows + i*step` of head
    `head0 + c*column_heads` (a dense block, or a dilated branch's members with offsets rising by head, as the cudnn
    backend reads them), the gather is a strided view of the tensor, not a copy, and writes go through it."""

    def __init__(self, rows: list[torch.Tensor], heads: list[int], device):
        n = len(rows[0])
        # Columns with the same head and rows (query heads of one stack that share a kv entry's rows without a
        # uniform grouping) are summed into the first of them before a write-back: `merge[c]` is its index.
        first_col = {}
        self.merge = [first_col.setdefault((h, int(r[0]) if n else None), c)
                      for c, (h, r) in enumerate(zip(heads, rows))]
        self.unique = [c for c, m in enumerate(self.merge) if m == c]
        self.shape = (n, len(heads))
        self.strides = _progression(rows, heads) if len(self.unique) == len(heads) else None
        if self.strides is None:
            self.all_rows = torch.stack(rows, 1).to(device)  # [n, columns]
            self.all_heads = torch.tensor(heads, dtype=torch.long, device=device)
            self.rows, self.heads = self.all_rows[:, self.unique], self.all_heads[self.unique]
            self._indices: dict = {}  # (batch, every column) -> _index's tensors

    @property
    def is_view(self) -> bool:
        return self.strides is not None

    def covers(self, x) -> bool:
        """Whether the pairs are every element of x `[B, L, H, ...]` (a view of distinct pairs, as many as x's)."""
        return self.is_view and self._view(x).numel() == x.numel()

    def _view(self, x):  # [B, L, H, ...] -> a [B, n, c, ...] view
        first, step, column_rows, head0, column_heads = self.strides
        sb, sl, sh, *rest = x.stride()
        return x.as_strided((x.shape[0], *self.shape, *x.shape[3:]),
                            (sb, step * sl, column_rows * sl + column_heads * sh, *rest),
                            x.storage_offset() + first * sl + head0 * sh)

    def _index(self, B: int, every_column: bool = False):
        """The pairs as an index of a `[B, L, H, ...]` tensor, made once (the set is kept with its plan): no
        kernel of its own on each call."""
        if (B, every_column) not in self._indices:
            rows, heads = (self.all_rows, self.all_heads) if every_column else (self.rows, self.heads)
            self._indices[B, every_column] = (torch.arange(B, device=rows.device).view(B, 1, 1), rows.unsqueeze(0),
                                              heads.view(1, 1, -1))
        return self._indices[B, every_column]

    def gather(self, x):  # [B, L, H, ...] -> [B, n, c, ...]
        if self.is_view:
            return self._view(x)
        return x[self._index(x.shape[0], every_column=True)]

    def gather_lse(self, x):  # [B, H, L] -> [B, c, n]
        return self.gather(x.transpose(1, 2)).transpose(1, 2)

    def put(self, x, values):  # every column is distinct here: query rows (one per head and position)
        if self.is_view:
            self._view(x).copy_(values)
        else:
            x[self._index(x.shape[0], every_column=True)] = values.to(x.dtype)

    def put_lse(self, x, values):
        self.put(x.transpose(1, 2), values.transpose(1, 2))

    def add(self, acc, values):
        """acc[rows, heads] += values (float32/64, one rounding to acc's dtype; `values` is consumed). Repeated
        columns are summed first, in column order, so the result does not depend on the device's scheduling."""
        if self.is_view:  # added in place through the view, two passes
            view = self._view(acc)
            view.copy_(values.add_(view))
            return
        if len(self.unique) < len(self.merge):
            summed = values[:, :, self.unique].clone()
            slot = {c: i for i, c in enumerate(self.unique)}
            for c, m in enumerate(self.merge):
                if m != c:
                    summed[:, :, slot[m]] += values[:, :, c]
            values = summed
        index = self._index(acc.shape[0])
        acc[index] = (acc[index].to(values.dtype) + values).to(acc.dtype)


def _progression(rows: list[torch.Tensor], heads: list[int]) -> Optional[tuple[int, int, int, int, int]]:
    """(first, step, column_rows, head0, column_heads) where column c holds rows `first + c*column_rows + i*step` of
    head `head0 + c*column_heads` (every step >= 0, as strides are; distinct heads, so no two elements meet), else
    None."""
    n, c = len(rows[0]), len(rows)
    if n == 0 or (c > 1 and heads[1] <= heads[0]):
        return None
    first = int(rows[0][0])
    step = int(rows[0][1] - rows[0][0]) if n > 1 else 1
    column_rows = int(rows[1][0]) - first if c > 1 else 0
    column_heads = heads[1] - heads[0] if c > 1 else 0
    if step <= 0 or column_rows < 0:
        return None
    expected = first + column_rows * torch.arange(c).view(c, 1) + step * torch.arange(n).view(1, n)
    if heads != [heads[0] + column_heads * j for j in range(c)] or not torch.equal(torch.stack(rows), expected):
        return None
    return first, step, column_rows, heads[0], column_heads


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


def _sums_like(xs, dtype) -> list:
    return [None if x is None else Sums.empty(x.shape, dtype, x.device) for x in xs]


def _finished(xs) -> list:
    """The tensors of a list of Sums (each finished: zero where no block reached), tensors or None."""
    return [x.finish() if isinstance(x, Sums) else x for x in xs]


def _task_slices(task):
    return task.stack, slice(task.q_start, task.q_stop), slice(task.kv_start, task.kv_stop)


@dataclass(frozen=True)
class JoinedBlock:
    """The full blocks of one head stack that read the same queries against whole key buffers (the own rows' and
    each received one's), run as one block over those buffers joined along the rows: one attention call and one
    merge instead of one per block. Where every rank's keys are posted at once (comm.RingComm.eager) they are all
    here together, as for LongNet's spanning branches."""

    stack: int
    q: slice
    steps: tuple[int, ...]  # the ring step t of each joined buffer (0: own rows), in order
    whole: bool  # the block is all of the stack's work on this rank (every query row, no causal block beside it)


@functools.lru_cache(maxsize=64)
def joined_blocks(plan: RingPlan, rank: int) -> dict[int, JoinedBlock]:
    """Per head stack (index), its JoinedBlock on `rank`, where it has one: every full block of the stack reads the
    same query rows and all of one key buffer, and there are at least two."""
    joined = {}
    for s, stack in enumerate(plan.stacks):
        full = []
        own = stack.segments[rank][-1][3] if stack.segments[rank] else 0  # the stack's rows on this rank
        for t in range(plan.P):
            src = (rank - t) % plan.P
            rows = own if t == 0 else sum(b - a for a, b in plan.needed[rank][src][s])
            full += [(t, task) for task in plan.tasks[rank][src] if task.stack == s and not task.causal
                     and not task.seg_len and (task.kv_start, task.kv_stop) == (0, rows)]
        tasks = [task for per_src in plan.tasks[rank] for task in per_src if task.stack == s]
        q_ranges = {(task.q_start, task.q_stop) for _, task in full}
        steps = [t for t, _ in full]
        if (len(full) >= 2 and len(full) == sum(not task.causal for task in tasks) and len(q_ranges) == 1
                and len(set(steps)) == len(steps)):
            q = q_ranges.pop()
            joined[s] = JoinedBlock(s, slice(*q), tuple(steps), q == (0, own) and len(full) == len(tasks))
    return joined


def _joined_buffers(plan: RingPlan, rank: int, joined: dict, kc, vc):
    """Per joined stack (index): its keys' and values' buffers `[B, rows, Hk, D]` and each step's rows in them;
    where each step's received rows go (RingComm.post_all_kv's `into`); the own rows to send: their copy in a
    joined buffer where they have one (no second copy), else kc and vc; and those copies, `(target, source)`, due
    before the send."""
    buffers, into, send_k, send_v, copies = {}, {}, list(kc), list(vc), []
    for s, j in joined.items():
        rows, spans = 0, {}
        for t in j.steps:
            n = kc[s].shape[1] if t == 0 else sum(b - a for a, b in plan.needed[rank][(rank - t) % plan.P][s])
            spans[t] = (rows, rows + n)
            rows += n
        keys, values = (x.new_empty((x.shape[0], rows, *x.shape[2:])) for x in (kc[s], vc[s]))
        for t, (a, b) in spans.items():
            if t == 0:
                send_k[s], send_v[s] = keys[:, a:b], values[:, a:b]
                copies += [(keys[:, a:b], kc[s]), (values[:, a:b], vc[s])]
            else:
                into[(t, s)] = (keys[:, a:b], values[:, a:b])
        buffers[s] = (keys, values, spans)
    return buffers, into, send_k, send_v, copies


@dataclass(frozen=True)
class RingConfig:
    """One rank's part of a ring call: the plan, this rank, the problem of the local branches and the backend that
    runs them and the blocks. It holds no process group (the call passes its own): configurations are kept between
    calls, and a kept group would outlive the user's destroy_process_group."""

    plan: RingPlan
    rank: int
    local_problem: Problem
    backend: str
    scale: float
    causal: bool


@dataclass
class Exchanged:
    """What a forward keeps for its backward: this rank's compacted rows and their K/V, whether every step was
    posted at once, the joined blocks and their buffers, and the received rows: every step's where it posted every
    step at once (eager: at most the bytes of the shard's q, k, v and output, RingComm.eager), else the last step's,
    which the backward computes first while its first step travels again."""

    rows: list
    kc: list
    vc: list
    eager: bool
    joined: dict
    buffers: dict
    received: dict  # step t >= 1 -> (keys, values) per stack


class _Saved:
    """A tensor's place in ctx.saved_tensors (a plain class: _map_leaves passes it whole)."""

    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index


def _map_leaves(tree, leaf):
    """`tree` (lists, tuples, dicts and dataclasses of other values) with each value replaced by leaf(value)."""
    if isinstance(tree, (list, tuple)):
        return type(tree)(_map_leaves(x, leaf) for x in tree)
    if isinstance(tree, dict):
        return {key: _map_leaves(x, leaf) for key, x in tree.items()}
    if dataclasses.is_dataclass(tree) and not isinstance(tree, type):
        return dataclasses.replace(tree, **{f.name: _map_leaves(getattr(tree, f.name), leaf)
                                            for f in dataclasses.fields(tree) if f.init})
    return leaf(tree)


def save_state(ctx, state) -> None:
    """Keep what a forward hands its backward (`state`: tensors in lists, tuples, dicts and dataclasses) in ctx:
    its tensors through ctx.save_for_backward, so that autograd frees them with the graph and a second backward
    through a retained graph finds them again."""
    tensors: list = []

    def saved(x):
        if not isinstance(x, torch.Tensor):
            return x
        tensors.append(x)
        return _Saved(len(tensors) - 1)

    ctx.state = _map_leaves(state, saved)
    ctx.save_for_backward(*tensors)


def saved_state(ctx):
    """What save_state kept, a fresh copy of its containers (a backward may empty them as it goes)."""
    tensors = ctx.saved_tensors
    return _map_leaves(ctx.state, lambda x: tensors[x.index] if isinstance(x, _Saved) else x)


class RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cfg: RingConfig, group, post_check: Optional[Callable[[], Callable[[], None]]] = None):
        out, lse, exchanged = ring_forward(q, k, v, cfg, group, post_check=post_check)
        save_state(ctx, (q, k, v, out, lse, exchanged))
        ctx.cfg, ctx.group = cfg, group
        # An output without a gradient arrives as None, not as zeros: the blocks then get no LSE gradient, which
        # the cudnn backend's backward needs in order to run at all.
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, d_out, d_lse):
        q, k, v, out, lse, exchanged = saved_state(ctx)
        return (*ring_backward(q, k, v, out, lse, d_out, d_lse, ctx.cfg, ctx.group, exchanged), None, None, None)


@dataclass
class _KVExchange:
    """What the backward keeps (its received rows still to come) and the K/V exchange ready to post: its buffers
    allocated and its wait point fixed (RingComm.hold_inputs), so that kernels queued after _prepare_exchange delay
    no transfer."""

    comm: RingComm
    kept: Exchanged
    send: tuple  # the (keys, values) per stack to send
    copies: list  # (target, source): the own rows into the joined buffers, made on the exchange stream

    def post(self):
        """Post step 1, or every step at once (eager, comm.py)."""
        if not self.kept.eager:
            return self.comm.post_kv(1, self.kept.kc, self.kept.vc)
        with self.comm.exchange_stream():
            for target, source in self.copies:
                target.copy_(source)
        return self.comm.post_all_kv(*self.send)


def _run_arguments(cfg: RingConfig, run: BranchRun) -> dict:
    """The op arguments of an internal run: its branch over its rows, the heads' offsets those of the call."""
    p = cfg.local_problem
    return dict(segment_lengths=[run.seg_len], dilation_rates=[run.dilation], split_heads=False, causal=cfg.causal,
                scale=cfg.scale, head_start=p.head_start, global_heads=p.global_heads)


def _prepare_exchange(cfg: RingConfig, group, q, k, v) -> _KVExchange:
    comm = RingComm(cfg.plan, cfg.rank, group, q.shape[0], q.shape[3], q.device)
    rows = compacted_rows(cfg.plan, cfg.rank, q.device)
    kc = [cp.kv.gather(k) for cp in rows]
    vc = [cp.kv.gather(v) for cp in rows]
    if not comm.eager(q.shape[2], k.shape[2]):
        comm.hold_inputs()
        return _KVExchange(comm, Exchanged(rows, kc, vc, False, {}, {}, {}), (kc, vc), [])
    joined = joined_blocks(cfg.plan, cfg.rank)
    buffers, into, send_k, send_v, copies = _joined_buffers(cfg.plan, cfg.rank, joined, kc, vc)
    comm.prepare_all_kv(k.dtype, into)
    comm.hold_inputs()
    return _KVExchange(comm, Exchanged(rows, kc, vc, True, joined, buffers, {}), (send_k, send_v), copies)


def _early_heads(group: int, q_columns: int, kv_columns: int) -> Optional[tuple[tuple[slice, slice], ...]]:
    """The columns (query, kv) of about the first quarter of a block's heads and of the rest, each a block of its
    own (query column i reads kv column i // group), or None where there is one query column. A quarter of the own
    block of a dense call (N = 65536 on 2 to 4 GPUs) outlasts the host's time from the check to the first block
    after the posts (0.3-0.9 ms on H200 hosts), and the other three quarters outlast step 1's transfer, which starts
    when that quarter ends (a transfer queued while an attention kernel runs starts at that kernel's tail)."""
    if kv_columns >= 2:  # whole kv columns with their query columns
        m = max(1, kv_columns // 4)
        return (slice(0, m * group), slice(0, m)), (slice(m * group, None), slice(m, None))
    if q_columns >= 2:  # one kv column, read by both parts
        m = max(1, q_columns // 4)
        return (slice(0, m), slice(None)), (slice(m, None), slice(None))
    return None


def ring_forward(q, k, v, cfg: RingConfig, group, post_check: Optional[Callable[[], Callable[[], None]]] = None):
    """(out, lse, the Exchanged rows for ring_backward) of this rank's shard (`group`: the ring's process group):
    the local branches, then every head stack's blocks.

    post_check(): posts ring_attention's configuration check and returns the call that waits for it and raises
    where the ranks' calls differ, which runs before the first transfer is posted. The local branches read no
    peer's rows: they are queued first, and the check's gather and the transfers come from the exchange stream, so
    that the GPU computes while the host checks and posts."""
    plan, rank, local_problem, scale = cfg.plan, cfg.rank, cfg.local_problem, cfg.scale
    ops = block_ops(cfg.backend, q.shape[3])
    B, L, H, D = q.shape
    lse_type = lse_dtype(q.dtype)
    ex = _prepare_exchange(cfg, group, q, k, v)
    comm, kept = ex.comm, ex.kept
    rows, kc, vc, eager, joined, buffers = kept.rows, kept.kc, kept.vc, kept.eager, kept.joined, kept.buffers
    # The result starts as the local branches' (merged by the kernel, as on one device); each block's partial
    # result merges into its rows: in place where a stack's rows are a view of the result, else into the stack's
    # own (out, lse), merged into its rows at the end.
    if plan.local_branches:
        out, lse = ops.forward(q, k, v, **local_problem.op_arguments())
    else:
        out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
        lse = torch.full((B, H, L), -math.inf, dtype=lse_type, device=q.device)
    for run in plan.runs[rank]:  # no peer's rows either
        run_forward(ops, run, q, k, v, out, lse, _run_arguments(cfg, run))
    qc = [cp.q.gather(q) for cp in rows]
    acc = [(cp.q.gather(out), cp.q.gather_lse(lse)) if cp.q.is_view else
           (torch.zeros(x.shape, dtype=q.dtype, device=q.device),
            torch.full((B, x.shape[2], x.shape[1]), -math.inf, dtype=lse_type, device=q.device))
           for cp, x in zip(rows, qc)]

    def blocks_of(src: int) -> list:  # the blocks of src's keys, but the joined ones (run together at the end)
        return [task for task in plan.tasks[rank][src] if not (task.stack in joined and not task.causal)]

    def run_block(task, keys, values, columns=(slice(None), slice(None))):  # columns: (query, kv) of the stack
        (s, qs, ks), (q_cols, kv_cols) = _task_slices(task), columns
        block_forward(ops, qc[s][:, qs, q_cols], keys[s][:, ks, kv_cols], values[s][:, ks, kv_cols], task.causal,
                      scale, acc[s][0][:, qs, q_cols], acc[s][1][:, q_cols, qs], task.seg_len)

    own = blocks_of(rank)
    # Where nothing computes before the transfers are posted (no local branches or runs: dense attention), the
    # first own block's first heads run while the host waits for the check and posts (_early_heads); posted after
    # them, the check's gather would wait for their kernel to end.
    early = (_early_heads(plan.stacks[own[0].stack].group, qc[own[0].stack].shape[2], kc[own[0].stack].shape[2])
             if post_check is not None and own and not plan.local_branches and not plan.runs[rank] else None)
    if post_check is not None:
        with comm.exchange_stream():
            check = post_check()
        if early is not None:
            run_block(own[0], kc, vc, early[0])
        check()
    step = ex.post()
    received = {}
    for t in range(plan.P):
        if t == 0:
            keys, values, tasks = kc, vc, own
            if early is not None:
                run_block(own[0], kc, vc, early[1])
                tasks = own[1:]
        else:
            keys, values = received[t] = comm.received_kv(step, t)
            if not eager:
                step = comm.post_kv(t + 1, kc, vc)
                if t < plan.P - 1:
                    del received[t]
            tasks = blocks_of((rank - t) % plan.P)
        for task in tasks:
            run_block(task, keys, values)
    for s, j in joined.items():
        block_forward(ops, qc[s][:, j.q], buffers[s][0], buffers[s][1], False, scale, acc[s][0][:, j.q],
                      acc[s][1][:, :, j.q])
    for cp, (acc_out, acc_lse) in zip(rows, acc):
        if not cp.q.is_view:
            cur_out, cur_lse = cp.q.gather(out), cp.q.gather_lse(lse)
            merge_block(cur_out, cur_lse, acc_out, acc_lse)
            cp.q.put(out, cur_out)
            cp.q.put_lse(lse, cur_lse)
    kept.received = received
    return out, lse, kept


def ring_backward(q, k, v, out, lse, d_out, d_lse, cfg: RingConfig, group, exchanged: Exchanged):
    """(dq, dk, dv) of this rank's shards, from the merged out and lse (d_out or d_lse may be None); `exchanged`:
    what the forward kept (ring_forward's). One of two schedules runs the blocks (_stepwise_backward where the
    forward posted its steps one by one, _eager_backward where it posted them all at once); both leave each head
    stack's float32 sums, added to their rows here with one rounding."""
    b = _Backward(q, k, v, out, lse, d_out, d_lse, cfg, group, exchanged)
    returning, (dq, dk, dv) = (_eager_backward if exchanged.eager else _stepwise_backward)(b)
    dqc, dkc, dvc = _finished(b.dqc), _finished(b.dkc), _finished(b.dvc)
    for ret, dst in returning:
        b.comm.add_returned_grads(ret, dst, dkc, dvc)
    for cp, g_q, g_k, g_v in zip(b.rows, dqc, dkc, dvc):
        for rowset, grad, sums, w in zip((cp.q, cp.kv, cp.kv), (dq, dk, dv), (g_q, g_k, g_v), b.whole):
            (rowset.put if w else rowset.add)(grad, sums)
    return tuple(g.to(x.dtype) for g, x in zip((dq, dk, dv), (q, k, v)))


class _Backward:
    """What both backward schedules share: the call's tensors, this backward's comm (its transfers wait for what is
    queued when it is made), the rows the forward kept, and the steps' work (local_branches, gather, blocks)."""

    def __init__(self, q, k, v, out, lse, d_out, d_lse, cfg: RingConfig, group, exchanged: Exchanged):
        self.cfg, self.plan, self.ex = cfg, cfg.plan, exchanged
        # Every block's backward takes the merged out and LSE of its rows, so only the user's own LSE gradient
        # (None where the LSE was not used) reaches the blocks: where it is there and this backend's backward cannot
        # take it, dispatch names the one that runs.
        name, _ = dispatch.backward_backend(cfg.local_problem, cfg.backend, lse_gradient=d_lse is not None)
        self.ops = block_ops(name, q.shape[3])
        self.acc_dtype = lse_dtype(q.dtype)
        self.d_out = torch.zeros_like(out) if d_out is None else d_out.to(q.dtype)
        self.q, self.k, self.v, self.out, self.lse, self.d_lse = q, k, v, out, lse, d_lse
        self.comm = RingComm(self.plan, cfg.rank, group, q.shape[0], q.shape[3], q.device)
        self.rows, self.kc, self.vc = exchanged.rows, exchanged.kc, exchanged.vc
        self.runs = self.plan.runs[cfg.rank]
        # Without local branches or runs, a gradient that one head stack's rows cover whole is that stack's sums: it
        # starts empty and takes them with one rounding, where it would start as zeros and add them
        rows = self.rows
        self.whole = [not self.plan.local_branches and not self.runs and len(rows) == 1 and rowset.covers(x)
                      for rowset, x in ((rows[0].q, q), (rows[0].kv, k), (rows[0].kv, v))] if rows else [False] * 3

    def local_branches(self) -> tuple:
        """The gradients of the local branches and of the internal runs: with runs, float32 (float64) sums of
        every branch's part, rounded once at the end, as the stacks' are."""
        q, k, v, cfg = self.q, self.k, self.v, self.cfg
        if self.plan.local_branches:
            grads = self.ops.backward(self.d_out, self.d_lse, q, k, v, self.out, self.lse,
                                      **cfg.local_problem.op_arguments())
        else:
            grads = tuple((torch.empty if w else torch.zeros)(x.shape, dtype=x.dtype, device=x.device)
                          for x, w in zip((q, k, v), self.whole))
        if not self.runs:
            return grads
        grads = tuple(g.to(self.acc_dtype) for g in grads)
        for run in self.runs:
            run_backward(self.ops, run, q, k, v, self.out, self.lse, self.d_out, self.d_lse, _run_arguments(cfg, run),
                         grads)
        return grads

    def gather(self) -> None:
        """Each head stack's rows of q, out, dO, LSE and its gradient, and its float32 gradient sums (Sums: the
        first block to reach a row stores its part there; a whole joined block's dq is its call's own)."""
        rows, joined = self.rows, self.ex.joined
        self.qc, self.oc, self.doc = ([cp.q.gather(x) for cp in rows] for x in (self.q, self.out, self.d_out))
        self.lc = [cp.q.gather_lse(self.lse) for cp in rows]
        self.dlc = [None if self.d_lse is None else cp.q.gather_lse(self.d_lse) for cp in rows]
        self.dqc = _sums_like([None if s in joined and joined[s].whole else x for s, x in enumerate(self.qc)],
                              self.acc_dtype)
        self.dkc, self.dvc = _sums_like(self.kc, self.acc_dtype), _sums_like(self.vc, self.acc_dtype)

    def blocks(self, t: int, keys, values, gk, gv) -> None:
        """The backward of step t's blocks (the keys of rank - t) but the joined ones, their dK/dV added into gk, gv."""
        for task in self.plan.tasks[self.cfg.rank][(self.cfg.rank - t) % self.plan.P]:
            if task.stack in self.ex.joined and not task.causal:
                continue
            s, qs, ks = _task_slices(task)
            dlc = self.dlc[s]
            block_backward(self.ops, self.qc[s][:, qs], keys[s][:, ks], values[s][:, ks], self.oc[s][:, qs],
                           self.lc[s][:, :, qs], self.doc[s][:, qs], None if dlc is None else dlc[:, :, qs],
                           task.causal, self.cfg.scale, self.dqc[s][:, qs], gk[s][:, ks], gv[s][:, ks], task.seg_len)


def _stepwise_backward(b: _Backward):
    """The forward posted its steps one by one and kept the last step's K/V: the local branches' gradients (the
    kernel's, as on one device) and the kept last block while the first K/V block travels again; then the received
    blocks, each one's dK/dV sent back as soon as they are complete, in one batch with the K/V of the step after next
    (RingComm.post_grads says why); the own rows last, while the last of them travel. (the dK/dV coming back, the
    local gradients)"""
    P, comm, kc, vc = b.plan.P, b.comm, b.kc, b.vc
    travelling = list(range(1, P - 1))
    arrivals = {1: comm.post_kv(1, kc, vc)} if travelling else {}  # step -> the arrival of its K/V (received_kv)
    unposted = travelling[1:]
    grads = b.local_branches()
    b.gather()
    returning = []
    for t in [P - 1, *travelling, 0]:
        if t == 0:
            b.blocks(0, kc, vc, b.dkc, b.dvc)
            continue
        keys, values = b.ex.received[t] if t in b.ex.received else comm.received_kv(arrivals.pop(t), t)
        buffer, gk, gv = comm.grad_buffer(t, b.acc_dtype)
        b.blocks(t, keys, values, gk, gv)
        _finished(gk + gv)  # sent as they are
        del keys, values  # the received rows' memory serves the next ones (in stream order)
        nxt = unposted.pop(0) if unposted else None
        ret, arrival = comm.post_grads(t, buffer, None if nxt is None else (nxt, kc, vc))
        returning.append(ret)
        if nxt is not None:
            arrivals[nxt] = arrival
    return returning, grads


def _eager_backward(b: _Backward):
    """The forward posted every step at once and kept every step's K/V: the own rows, the received blocks and the
    joined ones, then every step's dK/dV sent back in one batch (one transfer kernel) while the local branches
    compute. (the dK/dV coming back, the local gradients)"""
    P, comm = b.plan.P, b.comm
    b.gather()
    held = {0: (b.dkc, b.dvc, None)}  # step -> (dK, dV, send buffer) of its rows, where joined blocks read them
    b.blocks(0, b.kc, b.vc, b.dkc, b.dvc)
    for t in range(1, P):
        keys, values = b.ex.received[t]
        buffer, gk, gv = comm.grad_buffer(t, b.acc_dtype)
        b.blocks(t, keys, values, gk, gv)
        held[t] = (gk, gv, buffer)
    for s, j in b.ex.joined.items():
        # The joined block's gradients of each buffer's rows are those rows' whole share: the own rows' go to
        # their float32 sums, the received rows' into the buffers sent back; and where the block is all of the
        # stack's work, its dq is the stack's.
        keys, values, spans = b.ex.buffers[s]
        args = (b.qc[s][:, j.q], keys, values, b.oc[s][:, j.q], b.lc[s][:, :, j.q], b.doc[s][:, j.q],
                None if b.dlc[s] is None else b.dlc[s][:, :, j.q])
        if j.whole:
            b.dqc[s], gk, gv = block_gradients(b.ops, *args, b.cfg.scale)
        else:
            gk, gv = _zeros_like([keys, values], b.acc_dtype)
            block_backward(b.ops, *args, False, b.cfg.scale, b.dqc[s][:, j.q], gk, gv)
        for t, (lo, hi) in spans.items():
            accumulate([held[t][0][s][:, :], held[t][1][s][:, :]], [gk[:, lo:hi], gv[:, lo:hi]])
    for t in range(1, P):
        _finished(held[t][0] + held[t][1])  # sent as they are
    returning = comm.post_all_grads({t: held[t][2] for t in range(1, P)})
    return returning, b.local_branches()
