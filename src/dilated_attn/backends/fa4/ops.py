"""The fa4 backend's ops: FlashAttention-4 on the strided views of the cudnn backend's plan (backends/views.py:
the same calls, pieces and steps), each call's result merged into the running `(out, lse)` by the CUDA merge kernel
(csrc/cuda/merge.cu) or, stored, written in place by the kernel itself.

The views are those of the cudnn loops, `[segments, heads, members, D]`, transposed to FlashAttention's
`[batch, seqlen, heads, D]`; its kernels read any 16-byte-aligned strides, so nothing is gathered. A first branch
that covers every row (LongNet's dilation 1) is written by the kernel straight into the result, and its LSE into
the result's `[B, H, N]` LSE. Grouped-query calls pass the kv views' fewer heads: FlashAttention groups query head
`i` onto kv head `i // (Hq / Hkv)`, as cuDNN does.

The backward runs FlashAttention's backward per step with the merged `out` and `lse` of the whole problem and the
LSE's gradient (its `delta = rowsum(dO * out) - dLSE`), so each step gives its share of the exact gradient (docs/
SPEC.md, "Gradients"), added into the gradients through the steps' views.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ...merge import merge_into
from ...spec import check_offsets, host_offsets, lse_dtype
from .. import extension
from ..autograd import register_attention_autograd
from ..signature import backward_op, forward_op

# FlashAttention reads the views cuDNN reads (unit-stride rows, 16-byte aligned address and strides, no broadcast
# dimensions): the same copy where a tensor is not so (views.aligned)
from ..views import aligned, kv_sides, layouts_of, plan_of
from . import direct
from .packs import PackCall, PackPlan, plan_pack

__all__ = ["fa4_forward", "fa4_backward", "fa4_varlen_forward", "fa4_varlen_backward", "dense_forward",
           "dense_backward"]

# flash_attn.cute.interface, set by the backend's loader (fa4/__init__.py): flash-attn-4 is imported only when the
# backend is chosen. Its private `_flash_attn_fwd` / `_flash_attn_bwd` are the calls that take preallocated results,
# the LSE's gradient and strided views, which its autograd functions do not expose.
fa = None

# The most elements of one forward call. FlashAttention's Python interface took enough host time per call (70-125 us
# on an H200 machine's host, before the direct calls of direct.py) that fewer, larger calls ran faster (an H100,
# LongNet at N = 65536: 2^25 against 2^24).
MAX_CALL_ELEMENTS = 1 << 25

# The most bytes a backward call holds beside the gradients, in 16-bit dtypes: FlashAttention's float32 dQ
# accumulator (4 bytes per element), and where the call's gradients are added rather than written in place, its dq,
# dk and dv before they are (6 more). The two lanes (_Lanes) hold two calls' at once. On an H200, LongNet at N = 65536
# (benchmarks/README.md, "The backward's calls"): 80 MiB ran non-causal forward+backward 0.3-0.7% faster than 320 MiB
# (calls of 2^25 elements, before) at 0.13 GiB of working memory, not 0.51.
MAX_BACKWARD_CALL_BYTES = 80 << 20
# A causal call does half the work per element, so it takes more bytes: smaller calls leave the GPU waiting for the
# host, whose time per backward call (0.2-0.35 ms on an H200 machine's host) does not shrink with the call. Causal
# calls of 80 MiB were 5-29% slower (Hkv 16, 4, 1). Twice the bytes ran as fast as 320 MiB, but put N = 65536's first
# branch in calls of 4 segments and the working memory at 0.2515 GiB; 1.9 times cuts them to 3 (0.220 GiB), as fast.
CAUSAL_BACKWARD_FACTOR = 1.9


def _backward_limits(causal: bool) -> tuple[int, int]:
    """(the most elements of a backward call that adds its gradients, of one that stores them in place)."""
    budget = int(MAX_BACKWARD_CALL_BYTES * (CAUSAL_BACKWARD_FACTOR if causal else 1))
    return budget // 10, budget // 4


def _forward_options(q: torch.Tensor, causal: bool) -> dict:
    """FlashAttention-4's forward options (tile, pipeline flags) for a call: none, its own choice for every shape.
    benchmarks/tune_fa4.py times other tiles on this backend's calls by replacing this function; its own was the
    fastest in every run so far (docs/backends.md, "The fa4 backend")."""
    return {}


_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _second_stream(like: torch.Tensor) -> Optional[torch.cuda.Stream]:
    """The stream beside the caller's for calls on `like`'s device (a forward's merged calls, the backward's second
    lane), or None: on the CPU, and while a CUDA graph is being captured (the fork and join have not been run inside
    a capture). benchmarks/tune_fa4.py times one stream against two by replacing this function."""
    if not like.is_cuda or torch.cuda.is_current_stream_capturing():
        return None
    if like.device not in _SIDE_STREAMS:
        _SIDE_STREAMS[like.device] = torch.cuda.Stream(like.device)
    return _SIDE_STREAMS[like.device]


class _Lanes:
    """A backward's calls alternating between the caller's stream and a second one. FlashAttention's backward runs
    a grid of one tile per CTA: each call ends in a part-filled wave, and its pre- and post-processing kernels are
    short; beside the next call on the other stream, both fill SMs that would wait.

    The calls' writes into the gradients keep their order: a stored step's write (each row once, the rows of the
    stored steps disjoint) waits for nothing, an addition waits for the other lane's latest write. Each lane's own
    tensors (FlashAttention's workspace, a call's gradients before they are added) are made and freed on that lane.
    """

    def __init__(self, streams: list):
        self.streams = streams  # the caller's first; [None] on the CPU
        self.written: list = [None] * len(streams)  # each lane's event after its latest write
        self.lane = -1
        if len(streams) > 1:
            streams[1].wait_stream(streams[0])

    @classmethod
    def of(cls, like: torch.Tensor) -> "_Lanes":
        """Two lanes where there is a second stream to use (_second_stream), else one."""
        if not like.is_cuda:
            return cls([None])
        side = _second_stream(like)
        main = torch.cuda.current_stream(like.device)
        return cls([main] if side is None else [main, side])

    def next(self):
        """The context of the next call's lane."""
        self.lane = (self.lane + 1) % len(self.streams)
        stream = self.streams[self.lane]
        return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()

    def write(self, adds: bool) -> None:
        """Before the current lane writes into the gradients: an addition waits for the other lane's latest write."""
        other = self.written[self.lane - 1]
        if adds and other is not None and len(self.streams) > 1:
            self.streams[self.lane].wait_event(other)

    def wrote(self) -> None:
        if len(self.streams) > 1:
            self.written[self.lane] = self.streams[self.lane].record_event()

    def join(self) -> None:
        """The caller's stream waits for the second lane's work."""
        if len(self.streams) > 1:
            self.streams[0].wait_stream(self.streams[1])


def _bshd(view: torch.Tensor) -> torch.Tensor:
    """A step's `[segments, heads, members, D]` view as FlashAttention's `[batch, seqlen, heads, D]`."""
    return view.transpose(1, 2)


def _merge(out_view, lse_view, part_out, part_lse) -> None:
    """(out_view, lse_view) <- their merge with (part_out, part_lse); rows whose part_lse is -inf keep their values
    and part_out is not read there (the kernel skips it: a packed call's rows between its runs hold no result)."""
    if out_view.is_cuda and extension.has_kernel("cuda"):
        torch.ops.dilated_attn.merge_into(out_view, lse_view, part_out, part_lse)
    else:  # an extension built without CUDA: the same merge in PyTorch
        merge_into(out_view, lse_view, part_out.masked_fill((part_lse == float("-inf"))[..., None], 0), part_lse)


def _results(q: torch.Tensor, lse_shape: tuple, stores: bool):
    """A forward's (out, lse): uninitialised where its first calls store every element, else the merge's start (0 and
    -inf)."""
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty(lse_shape, dtype=lse_dtype(q.dtype), device=q.device)
    if not stores:
        out.zero_()
        lse.fill_(float("-inf"))
    return out, lse


def _gradients(q: torch.Tensor, k: torch.Tensor, stores: bool):
    """A backward's (grad_q, grad_k, grad_v): uninitialised where its first calls store every element, else 0."""
    make = torch.empty if stores else torch.zeros
    return (make(q.shape, dtype=q.dtype, device=q.device), make(k.shape, dtype=q.dtype, device=q.device),
            make(k.shape, dtype=q.dtype, device=q.device))


class _ForwardLanes:
    """A forward's calls, each launched as soon as it is made (so that the first kernel waits for one call's host
    work, not every call's): the stored calls (each writing its rows of the results) on the caller's stream, the
    merged ones (a call writing a part of its own, merged into the results) on a second stream beside them, and each
    merge on the caller's stream after every stored call and its own part. The parts fill the stored calls' last
    waves and launch gaps, and each merge runs beside the parts after it. One stream where there is no second
    (_second_stream) or nothing beside the stored calls (`beside` False): each merge then follows its part."""

    def __init__(self, like: torch.Tensor, beside: bool):
        self.side = _second_stream(like) if beside else None
        self.merges: list = []
        if self.side is not None:
            self.main = torch.cuda.current_stream(like.device)
            self.side.wait_stream(self.main)  # q, k, v and the results' initial values

    def merged(self, make_parts: Callable[[], tuple], run: Callable, merge: Callable) -> None:
        """A merged call: `make_parts()` makes its part (out, lse), `run(out=, lse=)` writes it, `merge(out, lse)`
        merges it into the results."""
        if self.side is None:
            parts = make_parts()
            run(out=parts[0], lse=parts[1])
            merge(*parts)
            return
        with torch.cuda.stream(self.side):  # the parts are made there: a fill of theirs runs before the call
            parts = make_parts()
            run(out=parts[0], lse=parts[1])
            ready = self.side.record_event()
        for part in parts:
            if part.is_cuda:  # read by the merge on the caller's stream: not reused before it has run
                part.record_stream(self.main)
        self.merges.append((ready, functools.partial(merge, *parts)))

    def finish(self) -> None:
        for ready, merge in self.merges:
            self.main.wait_event(ready)
            merge()


def _store(into, outs: torch.Tensor, lses: torch.Tensor) -> None:
    """A stored call whose LSE view FlashAttention cannot write in place: its results, copied."""
    part_out = torch.empty(outs.shape, dtype=outs.dtype, device=outs.device)
    part_lse = torch.empty(lses.shape, dtype=lses.dtype, device=lses.device)
    into(out=part_out, lse=part_lse)
    outs.copy_(part_out)
    lses.copy_(part_lse)


def _parts(out_shape, dtype, lse_shape, lse_dtype_, device, lse_fill: Optional[float] = None) -> tuple:
    """A merged call's part (out, lse), uninitialised, or with the LSE filled with `lse_fill`."""
    part_out = torch.empty(out_shape, dtype=dtype, device=device)
    part_lse = (torch.empty(lse_shape, dtype=lse_dtype_, device=device) if lse_fill is None else
                torch.full(lse_shape, lse_fill, dtype=lse_dtype_, device=device))
    return part_out, part_lse


def _merge_step(outs, lses, part_out, part_lse) -> None:
    """A strided step's part merged into its views of the results (`[b, s, h, d]` as the merge's `[b, h, s, d]`)."""
    _merge(_bshd(outs), lses, _bshd(part_out), part_lse)


@forward_op("fa4_forward")
def fa4_forward(q, k, v, segment_lengths, dilation_rates, split_heads, causal, scale, head_start=0, global_heads=0):
    q, k, v = aligned(q), aligned(k), aligned(v)
    B, N, H, D = q.shape
    p = plan_of(q, k, segment_lengths, dilation_rates, split_heads, head_start, global_heads)
    out, lse = _results(q, (B, H, N), p.first_stores)
    tensors = (q, k, v, out, lse.transpose(1, 2))  # the plan reads LSEs as [B, N, H]
    s = p.schedule(layouts_of(*tensors), kv_sides("q k v out lse"), MAX_CALL_ELEMENTS)
    options = _forward_options(q, causal)
    lanes = _ForwardLanes(q, beside=0 < s.stored < s.steps.shape[0])
    for i, (qs, ks, vs, outs, lses) in enumerate(s.views(*tensors)):
        qs, ks, vs, outs = _bshd(qs), _bshd(ks), _bshd(vs), _bshd(outs)  # the LSE stays [b, h, s]
        into = functools.partial(direct.forward, fa, qs, ks, vs, scale, causal, options)
        if i < s.stored:
            if lses.stride(-1) == 1:
                into(out=outs, lse=lses)
            else:
                _store(into, outs, lses)
            continue
        make_parts = functools.partial(_parts, qs.shape[:-1] + vs.shape[-1:], q.dtype, lses.shape, lse.dtype, q.device)
        lanes.merged(make_parts, into, functools.partial(_merge_step, outs, lses))
    lanes.finish()
    return out, lse


@backward_op("fa4_backward")
def fa4_backward(grad_out, grad_lse, q, k, v, out, lse, segment_lengths, dilation_rates, split_heads, causal,
                 scale, head_start=0, global_heads=0):
    q, k, v, grad_out, out = (aligned(x) for x in (q, k, v, grad_out.to(q.dtype), out))
    lse = lse.to(lse_dtype(q.dtype))
    p = plan_of(q, k, segment_lengths, dilation_rates, split_heads, head_start, global_heads)
    grad_q, grad_k, grad_v = _gradients(q, k, p.first_stores)
    tensors = [grad_out, q, k, v, out, lse.transpose(1, 2), grad_q, grad_k, grad_v]
    names = "grad_out q k v out lse grad_q grad_k grad_v"
    if grad_lse is not None:
        tensors.append(grad_lse.to(lse.dtype).transpose(1, 2))
        names += " grad_lse"
    adds, stores = _backward_limits(causal)
    s = p.schedule(layouts_of(*tensors), kv_sides(names), adds, whole_first=False, stored_limit=stores)
    deterministic = torch.are_deterministic_algorithms_enabled()
    lanes = _Lanes.of(q)
    for i, views in enumerate(s.views(*tensors)):
        gos, qs, ks, vs, outs, lses, dqs, dks, dvs = views[:9]
        dlse = views[9] if grad_lse is not None else None
        stored = i < s.stored
        written = stored and all(_bshd(t).is_contiguous() for t in (dqs, dks, dvs))
        given = dict(dq=_bshd(dqs), dk=_bshd(dks), dv=_bshd(dvs)) if written else {}
        with lanes.next():
            grads = direct.backward(fa, _bshd(qs), _bshd(ks), _bshd(vs), _bshd(outs), _bshd(gos), lses, scale, causal,
                                    deterministic, dlse=dlse, **given)
            if not written:
                lanes.write(adds=not stored)
                extension.accumulate((dqs, dks, dvs), [_bshd(g) for g in grads], stored)
            lanes.wrote()
    lanes.join()
    return grad_q, grad_k, grad_v


register_attention_autograd("dilated_attn::fa4_forward", "fa4_backward")


# Packed sequences (dilated_attention_varlen): q `[T, H, D]`, out the same, lse `[H, T]` (FlashAttention's varlen
# layouts). A few varlen calls per branch for the whole pack (packs.py), each on strided views of the tensors.


@dataclass(frozen=True)
class _DevicePack:
    """A planned pack on its device: the plan and its metadata; where the sequences are moved, the moved row of each
    of the pack's rows (`rows`) and the pack's row each moved row copies (`sources`, int64)."""

    plan: PackPlan
    metadata: torch.Tensor
    rows: Optional[torch.Tensor]
    sources: Optional[torch.Tensor]

    def spread(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """`x` (its rows along `dim`) in the moved layout. The rows between the sequences copy a row of the pack:
        FlashAttention's tiles read rows past a sequence's end (masked, but a NaN or inf there would still reach
        the result through a zero weight)."""
        return x if self.sources is None else x.index_select(dim, self.sources)

    def gather(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """The pack's rows of a moved `x`."""
        return x if self.rows is None else x.index_select(dim, self.rows)


@functools.lru_cache(maxsize=16)
def _planned(offsets: tuple, segment_lengths: tuple, dilation_rates: tuple, heads: int, kv_heads: int,
             split_heads: bool, head_start: int, global_heads: int, device: torch.device) -> _DevicePack:
    """The pack's plan and its metadata on the device (one copy, shared by the forward and the backward)."""
    pack = plan_pack(offsets, segment_lengths, dilation_rates, heads, kv_heads, split_heads, head_start, global_heads)
    metadata = torch.tensor(pack.plan.metadata, dtype=torch.int32).to(device, non_blocking=True)
    if pack.starts is None:
        return _DevicePack(pack.plan, metadata, None, None)
    # row i of sequence j moves from offsets[j] + i to starts[j] + i; a row between sequences copies the row before
    lengths = torch.tensor([b - a for a, b in zip(offsets, offsets[1:])])
    rows = torch.arange(offsets[-1]) + (torch.tensor(pack.starts) - torch.tensor(offsets[:-1])).repeat_interleave(
        lengths)
    sources = torch.zeros(pack.total, dtype=torch.int64).index_copy_(0, rows, torch.arange(offsets[-1]))
    sources = sources.cummax(0).values
    return _DevicePack(pack.plan, metadata, rows.to(device, non_blocking=True),
                       sources.to(device, non_blocking=True))


def _pack_of(q, k, cu_seqlens, max_seqlen, segment_lengths, dilation_rates, split_heads, head_start,
             global_heads) -> _DevicePack:
    # the offsets are checked where they are read: validate_varlen cannot read them
    offsets = host_offsets(cu_seqlens)
    check_offsets(offsets, q.shape[0], max_seqlen)
    return _planned(tuple(offsets), tuple(segment_lengths), tuple(dilation_rates), q.shape[1], k.shape[1],
                    split_heads, head_start, global_heads, q.device)


def _pack_view(x: torch.Tensor, call: PackCall, kv: bool = False) -> torch.Tensor:
    """The call's view `[rows, heads, D]` of `[T, H, D]`: rows `start + dilation*m`, its query or kv heads (each
    `row_step` rows further than the one before)."""
    head0, n, step = (call.kv_head0, call.kv_heads, call.kv_head_step) if kv else (
        call.head0, call.n_heads, call.head_step)
    st, sh, sd = x.stride()
    return x.as_strided((call.rows, n, x.shape[2]), (call.dilation * st, call.row_step * st + step * sh, sd),
                        x.storage_offset() + call.start * st + head0 * sh)


def _pack_lse_view(lse: torch.Tensor, call: PackCall) -> torch.Tensor:
    """The call's view `[heads, rows]` of an LSE `[H, T]`."""
    sh, st = lse.stride()
    return lse.as_strided((call.n_heads, call.rows), (call.row_step * st + call.head_step * sh, call.dilation * st),
                          lse.storage_offset() + call.start * st + call.head0 * sh)


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    """`[rows, heads, D]` as the merge and addition kernels' `[1, heads, rows, D]`."""
    return x.permute(1, 0, 2)[None]


def _merge_pack_call(outs, lses, part_out, part_lse) -> None:
    """A packed call's part merged into its views of the results (`[rows, heads, D]` and `[heads, rows]`)."""
    _merge(_heads_first(outs), lses[None], _heads_first(part_out), part_lse[None])


def _lengths(call: PackCall, metadata: torch.Tensor) -> dict:
    """FlashAttention's varlen arguments of the call: its runs' starts in the view, and their lengths where the view
    has rows between them."""
    starts = metadata[call.at:call.at + call.count + 1]
    given = dict(cu_seqlens_q=starts, cu_seqlens_k=starts, max_seqlen_q=call.longest, max_seqlen_k=call.longest)
    if call.used:
        used = metadata[call.at + call.used:call.at + call.used + call.count]
        given.update(seqused_q=used, seqused_k=used)
    return given


@forward_op("fa4_varlen_forward", packed=True)
def fa4_varlen_forward(q, k, v, cu_seqlens, max_seqlen, segment_lengths, dilation_rates, split_heads, causal, scale,
                       head_start=0, global_heads=0):
    q, k, v = aligned(q), aligned(k), aligned(v)
    pack = _pack_of(q, k, cu_seqlens, max_seqlen, segment_lengths, dilation_rates, split_heads, head_start,
                    global_heads)
    q, k, v = pack.spread(q), pack.spread(k), pack.spread(v)
    plan, metadata = pack.plan, pack.metadata
    out, lse = _results(q, (q.shape[1], q.shape[0]), plan.first_stores)
    options = _forward_options(q, causal)
    stores = plan.first_stores and bool(plan.calls) and bool(plan.calls[0])
    lanes = _ForwardLanes(q, beside=stores and any(plan.calls[1:]))
    for i, calls in enumerate(plan.calls):
        for call in calls:
            run = functools.partial(direct.forward, fa, _pack_view(q, call), _pack_view(k, call, True),
                                    _pack_view(v, call, True), scale, causal, options, **_lengths(call, metadata))
            outs, lses = _pack_view(out, call), _pack_lse_view(lse, call)
            if i == 0 and plan.first_stores:  # every row of the pack once: written in place
                run(out=outs, lse=lses)
                continue
            # the rows between runs keep an LSE of -inf, which the merge passes over (their part_out is not read);
            # where they all lie between the moved sequences (gaps_outside) their results are dropped: left unset
            make_parts = functools.partial(_parts, outs.shape, q.dtype, (call.n_heads, call.rows), lse.dtype,
                                           q.device, float("-inf") if call.used and not plan.gaps_outside else None)
            lanes.merged(make_parts, run, functools.partial(_merge_pack_call, outs, lses))
    lanes.finish()
    return pack.gather(out), pack.gather(lse, 1)


@backward_op("fa4_varlen_backward", packed=True)
def fa4_varlen_backward(grad_out, grad_lse, q, k, v, out, lse, cu_seqlens, max_seqlen, segment_lengths,
                        dilation_rates, split_heads, causal, scale, head_start=0, global_heads=0):
    q, k, v, grad_out, out = (aligned(x) for x in (q, k, v, grad_out.to(q.dtype), out))
    lse = lse.to(lse_dtype(q.dtype))
    grad_lse = None if grad_lse is None else grad_lse.to(lse.dtype)
    pack = _pack_of(q, k, cu_seqlens, max_seqlen, segment_lengths, dilation_rates, split_heads, head_start,
                    global_heads)
    q, k, v, grad_out, out = (pack.spread(x) for x in (q, k, v, grad_out, out))
    lse = pack.spread(lse, 1)
    grad_lse = None if grad_lse is None else pack.spread(grad_lse, 1)
    plan, metadata = pack.plan, pack.metadata
    grad_q, grad_k, grad_v = _gradients(q, k, plan.first_stores)
    deterministic = torch.are_deterministic_algorithms_enabled()
    lanes = _Lanes.of(q)
    for i, calls in enumerate(plan.calls):
        stored = i == 0 and plan.first_stores
        for call in calls:
            targets = (_pack_view(grad_q, call), _pack_view(grad_k, call, True), _pack_view(grad_v, call, True))
            written = stored and all(t.is_contiguous() for t in targets)
            with lanes.next():
                if written:
                    given = dict(zip(("dq", "dk", "dv"), targets))
                elif call.used and not plan.gaps_outside:
                    # FlashAttention does not write the rows between runs: zeros, which add nothing (between the
                    # moved sequences, gaps_outside, their sums are dropped)
                    given = {name: torch.zeros_like(t) for name, t in zip(("dq", "dk", "dv"), targets)}
                else:
                    given = {}
                dlse = None if grad_lse is None else _pack_lse_view(grad_lse, call)
                grads = direct.backward(fa, _pack_view(q, call), _pack_view(k, call, True),
                                        _pack_view(v, call, True), _pack_view(out, call), _pack_view(grad_out, call),
                                        _pack_lse_view(lse, call), scale, causal, deterministic, dlse=dlse,
                                        **_lengths(call, metadata), **given)
                if not written:
                    lanes.write(adds=not stored)
                    extension.accumulate([_heads_first(t) for t in targets], [_heads_first(g) for g in grads],
                                        stored)
                lanes.wrote()
    lanes.join()
    return pack.gather(grad_q), pack.gather(grad_k), pack.gather(grad_v)


register_attention_autograd("dilated_attn::fa4_varlen_forward", "fa4_varlen_backward")


def dense_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
    """Full (non-causal) attention of q `[B, nq, H, D]` over k, v `[B, nk, Hk, D]` in one call, the lengths unequal
    where they are: `(out [B, nq, H, D], lse [B, H, nq])` (the ring's blocks over several ranks' keys)."""
    return direct.forward(fa, aligned(q), aligned(k), aligned(v), scale, False, _forward_options(q, False))


def dense_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, scale: float):
    """The gradients `(dq, dk, dv)` of dense_forward given the merged out and LSE of the rows (each block's share of
    the exact gradient)."""
    q, k, v, grad_out, out = (aligned(x) for x in (q, k, v, grad_out.to(q.dtype), out))
    return direct.backward(fa, q, k, v, out, grad_out, lse.to(torch.float32), scale, False,
                           torch.are_deterministic_algorithms_enabled())
