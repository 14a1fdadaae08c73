"""The ring's communication: per-stack tensors `[B, n, Hk, D]` travel as one message per stack and tensor, sent from
the tensor's own memory where the rows are one contiguous range of it, received into one flat buffer per step; dK/dV
go back as one buffer per step.

At step `t = 1 .. P-1` rank `j` sends its compacted K/V rows to `j + t` and receives from `j - t`, only where the
receiver reads rows (RingPlan.needed); the caller posts step `t + 1` before it computes step `t`. Where local
branches compute while the rows travel and every step's rows together are few (`eager`: at most the bytes of the
local q, k, v and output, as for LongNet's dilated branches), all steps are posted at once instead, in one batch:
the ranks then wait on no peer's step, and memory stays within a constant of the shard's; each stack's rows are then
received straight into the buffers of the blocks that read them. In the backward
the dK/dV of received rows go back to their owner in float32 (float64 for float64), all steps' in one batch where
the K/V came in one.
"""

from __future__ import annotations

import contextlib
import math
from typing import Optional

import torch
import torch.distributed as dist

from .blocks import Sums
from .plan import RingPlan

__all__ = ["RingComm", "Step", "exchange_stream"]


def _pack(x: torch.Tensor, ranges: list[tuple[int, int]]) -> torch.Tensor:
    """The given row ranges of x `[B, n, Hk, D]` as one flat send buffer the receiver reads as `[B, sum, Hk, D]`:
    x's own memory where that is one contiguous range of it (no copy), else the ranges joined along the rows
    (flattening each range apart would put batch element 1 of the first range before the second range)."""
    if len(ranges) == 1:
        rows = x[:, ranges[0][0]: ranges[0][1]]
        if rows.is_contiguous():
            return rows.view(-1)
    buf = x.new_empty((x.shape[0], sum(b - a for a, b in ranges), *x.shape[2:]))
    row = 0
    for a, b in ranges:
        buf[:, row:row + b - a].copy_(x[:, a:b])
        row += b - a
    return buf.view(-1)


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


class Step:
    """Point-to-point transfers posted at once (batch_isend_irecv) and waited on later: one step's, or every
    step's (any number of messages per peer); waiting returns `result` (the buffer the receives fill, or None)."""

    def __init__(self, group, sends, recvs=(), result: Optional[torch.Tensor] = None):
        ops = [dist.P2POp(dist.isend, buf, _global(group, peer), group) for peer, buf in sends]
        ops += [dist.P2POp(dist.irecv, buf, _global(group, peer), group) for peer, buf in recvs]
        self.works = dist.batch_isend_irecv(ops) if ops else []
        self.result = result
        self.sends = sends  # the send buffers must live until the transfer is done

    def wait(self) -> Optional[torch.Tensor]:
        for w in self.works:
            w.wait()
        self.works, self.sends = [], []
        return self.result


_exchange_streams: dict = {}  # device -> the stream the step-by-step exchange posts from (RingComm.post_kv)


def _exchange_stream_of(device: torch.device) -> torch.cuda.Stream:
    if device not in _exchange_streams:
        _exchange_streams[device] = torch.cuda.Stream(device)
    return _exchange_streams[device]


def exchange_stream(device: torch.device, after_current: bool = True):
    """A context on the exchange's stream of `device`, after what is queued on the current stream now (the
    current stream where there is no GPU): a collective posted there waits for no kernel queued after it. With
    `after_current` False it waits for nothing queued on the current stream either (a collective of tensors no
    kernel there writes: the configuration check's)."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    stream = _exchange_stream_of(device)
    if after_current:
        stream.wait_stream(torch.cuda.current_stream(device))
    return torch.cuda.stream(stream)


class _Arrival:
    """One receive of a batch (post_grads, post_all_grads): waiting on it waits on the batch."""

    def __init__(self, step: Step, buf: Optional[torch.Tensor]):
        self.step, self.buf = step, buf

    def wait(self) -> Optional[torch.Tensor]:
        self.step.wait()
        return self.buf


class RingComm:
    """This rank's transfers under a plan: the K/V exchange of each step and the return of dK/dV."""

    def __init__(self, plan: RingPlan, rank: int, group, B: int, D: int, device):
        self.plan, self.rank, self.group, self.B, self.D = plan, rank, group, B, D
        self.device = device
        self._arrived = None  # post_all_kv's receive buffers per step: (per-stack views, copies due on arrival)
        self._recvs = []  # post_all_kv's receives: (source, flat buffer)
        self._stream = None  # the exchange's stream, once it has waited for the inputs (hold_inputs)

    def shapes(self, dst: int, src: int) -> list[tuple[int, ...]]:
        """Shapes of the per-stack tensors that src sends dst (one of K, V, dK or dV)."""
        return [(self.B, sum(b - a for a, b in rng), len(stack.kv_heads), self.D)
                for stack, rng in zip(self.plan.stacks, self.plan.needed[dst][src])]

    def eager(self, heads: int, kv_heads: int) -> bool:
        """Whether every step's K/V is posted at once (see the module's docstring): where local branches compute
        while they travel (without them the first block would wait for every step's rows) and the plan's busiest
        receiver gets at most the bytes of its q, k, v and output (`heads` query and `kv_heads` key/value heads)."""
        plan = self.plan
        if not plan.local_branches:
            return False
        most = max(sum(plan.rows_needed(dst, src) for src in range(plan.P) if src != dst) for dst in range(plan.P))
        return 2 * most <= plan.L * (2 * heads + 2 * kv_heads)

    def hold_inputs(self) -> None:
        """Fix the point of the caller's stream after which no transfer waits: the exchange stream (post_kv,
        post_all_kv, and what the caller runs in exchange_stream()) waits for what is queued there now (the inputs
        and the rows gathered from them), not for the kernels queued after it."""
        if self.device.type == "cuda" and self._stream is None:
            self._stream = _exchange_stream_of(self.device)
            self._stream.wait_stream(torch.cuda.current_stream(self.device))

    def exchange_stream(self):
        """A context on the exchange's stream (hold_inputs): the caller's stream where there is no GPU."""
        if self.device.type != "cuda":
            return contextlib.nullcontext()
        self.hold_inputs()
        return torch.cuda.stream(self._stream)

    def post_kv(self, t: int, kc, vc) -> Optional[Step]:
        """Step t of the K/V exchange: my rows that rank+t reads go there; the rows I read from rank-t come.

        On a GPU the send (_sends) is posted from a stream of the exchange's own, which waits only for what
        was queued before the first step (hold_inputs): posted while step t-1 computes, its transfer kernel is
        queued before step t's attention and takes its SMs first. (Posted after the attention on the same stream,
        it waits for a kernel that fills every SM and runs only at its tail: the ring then computes and transfers
        in turn.) The receive buffer is allocated on that stream too, so that it can reuse no memory the caller's
        queued kernels still use; received_kv records the caller's stream on it."""
        if t >= self.plan.P:
            return None
        with self.exchange_stream():
            return Step(self.group, *self._kv_messages(t, kc, vc))

    def _kv_messages(self, t: int, kc, vc) -> tuple[list, list, Optional[torch.Tensor]]:
        """Step t's K/V messages: (sends, receives, the flat buffer the receives fill, or None)."""
        P, me = self.plan.P, self.rank
        dst, src = (me + t) % P, (me - t) % P
        rows = self.plan.rows_needed(me, src)
        buf = torch.empty(2 * rows * self.B * self.D, dtype=kc[0].dtype, device=self.device) if rows else None
        recvs = [] if buf is None else self._receives(src, _unpack(buf, self.shapes(me, src) * 2))
        return self._sends(dst, kc, vc), recvs, buf

    def _sends(self, dst: int, kc, vc) -> list:
        """My rows that dst reads: one message per stack and tensor (every stack's K, then every stack's V), each
        the tensor's own memory where its rows are one contiguous range of it (_pack), so that most transfers wait
        for no copy."""
        if not self.plan.rows_needed(dst, self.rank):
            return []
        rng = self.plan.needed[dst][self.rank]
        chunks = [_pack(x, ranges) for x, ranges in zip(kc + vc, rng + rng) if ranges]
        return [(dst, chunk) for chunk in chunks if chunk.numel()]  # as _receives: empty parts travel in no message

    @staticmethod
    def _receives(src: int, parts: list[torch.Tensor]) -> list:
        """The receives of _sends' messages from src, into the receiver's per-stack parts (K then V)."""
        return [(src, part.view(-1)) for part in parts if part.numel()]

    def prepare_all_kv(self, dtype: torch.dtype, into: Optional[dict] = None) -> None:
        """The receive buffers of post_all_kv, allocated before the transfers' wait point (hold_inputs), so that no
        transfer writes memory a kernel queued after it still reads. `into[(t, s)]`: the (keys, values) views
        `[B, n, Hk, D]` where step t's rows of stack s go (the joined blocks' buffers: received in place where the
        views are contiguous, else copied there on arrival); other rows arrive in one buffer per step."""
        P, me, into = self.plan.P, self.rank, into or {}
        self._arrived, self._recvs = {}, []
        for t in range(1, P):
            src = (me - t) % P
            if not self.plan.rows_needed(me, src):
                continue
            shapes = self.shapes(me, src)
            buf = torch.empty(2 * self.plan.rows_needed(me, src) * self.B * self.D, dtype=dtype,
                              device=self.device)
            parts, copies = _unpack(buf, shapes + shapes), []
            for i, part in enumerate(parts):
                target = into.get((t, i % len(shapes)))
                target = None if target is None else target[i // len(shapes)]
                if part.numel() and target is not None and target.is_contiguous():
                    parts[i] = part = target
                elif target is not None:
                    copies.append((target, part))
            self._recvs += self._receives(src, parts)
            self._arrived[t] = (parts, copies)

    def post_all_kv(self, kc, vc) -> Step:
        """Every step's K/V exchange in one batch (eager), into prepare_all_kv's buffers: one message per stack
        and tensor, so that a receiver can take each where it reads it."""
        P, me = self.plan.P, self.rank
        with self.exchange_stream():
            sends = [send for t in range(1, P) for send in self._sends((me + t) % P, kc, vc)]
            return Step(self.group, sends, self._recvs)

    def received_kv(self, step: Step, t: int):
        """(keys, values) per stack received at step t (None for a stack with nothing received); `step` is that
        step's (post_kv's, or the arrival post_grads returns), or the one of post_all_kv."""
        src = (self.rank - t) % self.plan.P
        shapes = self.shapes(self.rank, src)
        if self._arrived is not None:  # every step at once (post_all_kv): waited on once
            step.wait()
            if t not in self._arrived:
                return [None] * len(shapes), [None] * len(shapes)
            parts, copies = self._arrived[t]
            for target, part in copies:
                target.copy_(part)
        else:
            buf = step.wait()
            if buf is None:
                return [None] * len(shapes), [None] * len(shapes)
            if buf.is_cuda:  # allocated on the exchange stream (post_kv) and read on the caller's
                buf.record_stream(torch.cuda.current_stream(buf.device))
            parts = _unpack(buf, shapes + shapes)
        return parts[: len(shapes)], parts[len(shapes):]

    def grad_buffer(self, t: int, dtype) -> tuple[torch.Tensor, list, list]:
        """float32 (float64) sums of dK and dV per stack for the rows received at step t (blocks.Sums, finished
        before the send), views of one buffer in the order post_grads sends it (all dK, then all dV): it travels
        without a copy."""
        shapes = self.shapes(self.rank, (self.rank - t) % self.plan.P)
        buf = Sums.memory((2 * sum(math.prod(x) for x in shapes),), dtype, self.device)
        parts = [Sums(x) for x in _unpack(buf, shapes + shapes)]
        return buf, parts[: len(shapes)], parts[len(shapes):]

    def _grad_messages(self, t: int, grads: torch.Tensor) -> tuple[list, list, Optional[torch.Tensor], int]:
        """Step t's dK/dV return: (sends, receives, the buffer the receive fills or None, rank+t): the dK/dV of the
        rows received at step t (grad_buffer's buffer) go back to rank-t; those of my rows come from rank+t."""
        P, me = self.plan.P, self.rank
        src, dst = (me - t) % P, (me + t) % P
        sends = [(src, grads)] if self.plan.rows_needed(me, src) else []
        rows = self.plan.rows_needed(dst, me)
        recv = torch.empty(2 * rows * self.B * self.D, dtype=grads.dtype, device=self.device) if rows else None
        return sends, [] if recv is None else [(dst, recv)], recv, dst

    def post_grads(self, t: int, grads: torch.Tensor, kv: Optional[tuple] = None):
        """Step t's dK/dV return (_grad_messages). Returns (its arrival, rank+t) for add_returned_grads, and with
        `kv` = (t2, kc, vc) step t2's K/V exchange, posted in the same batch, as an arrival for received_kv.

        Posted on the caller's stream after step t's kernels, the batch's one transfer kernel is ready when the next
        step's attention is and, queued before it, runs beside it. A K/V exchange posted alone after these
        gradients would wait behind them on the transfers' stream, and then behind the next attention kernel, which
        holds every SM: it would run only at that kernel's tail."""
        sends, recvs, recv, dst = self._grad_messages(t, grads)
        kv_buf = None
        if kv is not None:  # after the gradients on both sides of a pair, so that their messages match in order
            kv_sends, kv_recvs, kv_buf = self._kv_messages(*kv)
            sends, recvs = sends + kv_sends, recvs + kv_recvs
        step = Step(self.group, sends, recvs)
        return (_Arrival(step, recv), dst), None if kv is None else _Arrival(step, kv_buf)

    def post_all_grads(self, grads: dict) -> list:
        """Every step t's dK/dV return (grads[t], grad_buffer's buffer) in one batch: [(arrival, rank+t)] for
        add_returned_grads."""
        messages = [self._grad_messages(t, buf) for t, buf in grads.items()]
        step = Step(self.group, [x for m in messages for x in m[0]], [x for m in messages for x in m[1]])
        return [(_Arrival(step, recv), dst) for _, _, recv, dst in messages]

    def add_returned_grads(self, step: Step, dst: int, dkc, dvc) -> None:
        """Wait for the dK/dV that `dst` returns (posted by post_grads) and add them into my rows' accumulators."""
        buf = step.wait()
        if buf is None:
            return
        shapes = self.shapes(dst, self.rank)
        parts = _unpack(buf, shapes + shapes)
        for s, rng in enumerate(self.plan.needed[dst][self.rank]):
            for grads, acc in ((parts[s], dkc[s]), (parts[len(shapes) + s], dvc[s])):
                start = 0
                for a, b in rng:
                    acc[:, a:b] += grads[:, start: start + b - a]
                    start += b - a
