"""The fa4 backend (backends/fa4): its ops' plan, stores, merges and gradient additions against the reference through
FlashAttention-4's contract in float64 on CPU (CI has no flash-attn-4), and the real kernels on a Hopper GPU."""

from __future__ import annotations

import collections
import contextlib
import functools
import itertools
import json
import math
import os
import random
import subprocess
import sys
import types
import warnings

import pytest
import torch
from cases import make_qkv, random_case
from parity import case_inputs, math_attend, math_attend_backward, poison_allocator

import dilated_attn
from dilated_attn.backends.fa4 import direct, ops
from dilated_attn.reference import allowed_error, dilated_attention_reference, max_error

CASES = [random_case(random.Random(4700 + i), max_seq=80) for i in range(24)]


def _bhsd(x):
    """FlashAttention's `[b, s, h, d]` as the math contract's `[b, h, s, d]` (and back)."""
    return x.transpose(1, 2)


def _runs(cu_seqlens, seqused):
    """FlashAttention's varlen sequences: (first row, rows) each, `seqused` giving the lengths where it is given."""
    starts = cu_seqlens.tolist()
    used = seqused.tolist() if seqused is not None else [b - a for a, b in zip(starts, starts[1:])]
    return list(zip(starts, used))


def _check_lengths(cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k):
    """What FlashAttention takes of them: int32, 16-byte aligned (else it copies), the same for q and k here (each
    run attends to itself), and max_seqlen at least the longest."""
    assert cu_seqlens_q is cu_seqlens_k and seqused_q is seqused_k
    for x in (cu_seqlens_q, seqused_q):
        if x is not None:
            assert x.dtype == torch.int32 and x.is_contiguous() and x.storage_offset() % 4 == 0
    assert max(n for _, n in _runs(cu_seqlens_q, seqused_q)) <= max_seqlen_q == max_seqlen_k


def _check_tiles_finite(runs, *tensors, tile=128):
    """FlashAttention loads whole tiles of rows, past a run's end too (masked: but a NaN or inf there would reach the
    result through a zero weight): the rows it may load must hold finite values."""
    for a, n in runs:
        for x in tensors:
            assert torch.isfinite(x[a:a + -(-n // tile) * tile]).all(), "a tile past a run reads non-finite rows"


def _rows_of(x, a, n):
    """Rows [a, a + n) of a varlen `[total, h, d]` as the contract's `[1, h, n, d]`."""
    return x[a:a + n].transpose(0, 1)[None]


class MathInterface:
    """flash_attn.cute.interface's two calls the ops use, as their contract in float64 (parity.math_attend and
    math_attend_backward on transposed views): results preallocated or returned, the LSE `[b, h, s]`, the backward's
    `delta = rowsum(dO * out) - dLSE`, dK/dV summed per kv head. Varlen calls (`cu_seqlens_q`, `seqused_q`) take
    `[total, h, d]` views and an LSE `[h, total]`; rows outside their sequences are neither read nor written, and
    results it allocates are NaN there."""

    forward_calls = 0
    varlen_calls = 0
    out_storages: list = []  # the storage of each result given (`out`)

    @classmethod
    def _flash_attn_fwd(cls, q, k, v, softmax_scale, causal=False, return_lse=False, out=None, lse=None,
                        cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None, seqused_k=None, max_seqlen_q=None,
                        max_seqlen_k=None):
        cls.forward_calls += 1
        if out is not None:
            assert out.stride(-1) == 1 and lse.stride(-1) == 1, "FlashAttention writes unit-stride rows only"
            cls.out_storages.append(out.untyped_storage().data_ptr())
        if cu_seqlens_q is None:
            rows, rows_lse = math_attend(_bhsd(q), _bhsd(k), _bhsd(v), causal, softmax_scale)
            if out is None:
                return _bhsd(rows), rows_lse, None, None, None
            out.copy_(_bhsd(rows))
            lse.copy_(rows_lse)
            return out, lse, None, None, None
        cls.varlen_calls += 1
        _check_lengths(cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k)
        assert all(x.stride(-1) == 1 for x in (q, k, v))
        _check_tiles_finite(_runs(cu_seqlens_q, seqused_q), q, k, v)
        if out is None:
            out = torch.full(q.shape, math.nan, dtype=q.dtype)
        if lse is None:
            lse = torch.full(q.shape[1::-1], math.nan, dtype=torch.float64)
        for a, n in _runs(cu_seqlens_q, seqused_q):
            o, l_ = math_attend(*(_rows_of(x, a, n) for x in (q, k, v)), causal, softmax_scale)
            out[a:a + n] = o[0].transpose(0, 1)
            lse[:, a:a + n] = l_[0]
        return out, lse, None, None, None

    @staticmethod
    def _flash_attn_bwd(q, k, v, out, dout, lse, softmax_scale, causal=False, deterministic=False, dlse=None,
                        dq=None, dk=None, dv=None, cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None,
                        seqused_k=None, max_seqlen_q=None, max_seqlen_k=None):
        given = (dq, dk, dv)
        if cu_seqlens_q is None:
            grads = [_bhsd(g) for g in math_attend_backward(_bhsd(dout), _bhsd(q), _bhsd(k), _bhsd(v), _bhsd(out),
                                                             lse, causal, softmax_scale, grad_lse=dlse)]
            if all(x is not None for x in given):
                for target, g in zip(given, grads):
                    target.copy_(g)
                return given
            return tuple(grads)
        _check_lengths(cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k)
        _check_tiles_finite(_runs(cu_seqlens_q, seqused_q), q, k, v, out, dout)
        results = [g if g is not None else torch.full(x.shape, math.nan, dtype=x.dtype) for g, x in zip(given, (q, k, v))]
        for a, n in _runs(cu_seqlens_q, seqused_q):
            grads = math_attend_backward(*(_rows_of(x, a, n) for x in (dout, q, k, v, out)), lse[None, :, a:a + n],
                                         causal, softmax_scale,
                                         grad_lse=None if dlse is None else dlse[None, :, a:a + n])
            for target, g in zip(results, grads):
                target[a:a + n] = g[0].transpose(0, 1)
        return tuple(results)


@pytest.fixture
def math_interface(monkeypatch):
    monkeypatch.setattr(ops, "fa", MathInterface)
    MathInterface.forward_calls = MathInterface.varlen_calls = 0
    MathInterface.out_storages = []
    yield MathInterface


def _poisoned_empty(monkeypatch):
    """torch.empty / empty_like give NaN-filled floating-point tensors: an element the ops do not write shows."""
    for name in ("empty", "empty_like"):
        make = getattr(torch, name)

        def poisoned(*args, _make=make, **kwargs):
            x = _make(*args, **kwargs)
            return x.fill_(math.nan) if x.is_floating_point() else x

        monkeypatch.setattr(torch, name, poisoned)


def _args(case):
    return (list(case.segment_lengths), list(case.dilation_rates), case.head_groups == "split", case.causal,
            case.head_dim ** -0.5)


@pytest.mark.parametrize("pieces", ["whole", "split"])
@pytest.mark.parametrize("index", range(len(CASES)))
def test_ops_equal_the_reference(index, pieces, math_interface, monkeypatch):
    """out, LSE and gradients with an LSE gradient too, every case's layout, calls whole or cut into pieces."""
    case = CASES[index]
    if pieces == "split":
        if index % 3:
            pytest.skip("a third of the cases is enough")
        monkeypatch.setattr(ops, "MAX_CALL_ELEMENTS", 64)
        monkeypatch.setattr(ops, "MAX_BACKWARD_CALL_BYTES", 640)  # 64 elements where added
    q, k, v = make_qkv(case, dtype=torch.float64, seed=index)
    _poisoned_empty(monkeypatch)
    out, lse = ops.fa4_forward(q, k, v, *_args(case))
    g = torch.Generator().manual_seed(index)
    grad_out = torch.randn(out.shape, generator=g, dtype=torch.float64)
    grad_lse = torch.randn(lse.shape, generator=g, dtype=torch.float64)
    ref = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ref_out, ref_lse = dilated_attention_reference(*ref, case.segment_lengths, case.dilation_rates, **case.kwargs())
    finite = torch.isfinite(ref_lse)
    torch.testing.assert_close(out, ref_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-12, atol=1e-12)
    grad_lse = torch.where(finite, grad_lse, 0)  # rows without keys: their LSE is -inf, and has no gradient
    through_out = (ref_out * grad_out).sum()
    through_lse = (torch.where(finite, ref_lse, 0) * grad_lse).sum()
    expected = {False: torch.autograd.grad(through_out, ref, retain_graph=True),
                True: torch.autograd.grad(through_out + through_lse, ref)}
    for with_lse_gradient, want in expected.items():
        grads = ops.fa4_backward(grad_out, grad_lse if with_lse_gradient else None, q, k, v, out, lse,
                                 *_args(case))
        for got, exp in zip(grads, want):
            torch.testing.assert_close(got, exp, rtol=1e-10, atol=1e-10)

def test_longnet_first_branch_stores_in_place(math_interface):
    """LongNet's dilation-1 branch is written by the kernel into the results (no copy, no merge); the others merge."""
    q, k, v = (torch.randn(1, 64, 8, 8, dtype=torch.float64) for _ in range(3))
    out, lse = ops.fa4_forward(q, k, v, [16, 32, 64], [1, 2, 4], False, False, 0.3)
    into_result = [ptr == out.untyped_storage().data_ptr() for ptr in math_interface.out_storages]
    assert sum(into_result) == 1 and math_interface.forward_calls > 1
    ref_out, ref_lse = dilated_attention_reference(q, k, v, [16, 32, 64], [1, 2, 4], scale=0.3)
    torch.testing.assert_close(out, ref_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-12, atol=1e-12)


def kernel_interface(copies: bool = False) -> types.SimpleNamespace:
    """FlashAttention-4's interface in miniature, in flash_attn.cute.interface's shape: each function with a compile
    cache (keyed by what its kernel is built for), the kernels called with the call's tensors, tensors it makes (a
    zeroed workspace, results not given) and plain arguments; MathInterface's math in the kernels. With `copies`, the
    forward hands its kernel a copy of q (as FlashAttention does with an input it must make contiguous). Counts its
    calls and its kernels' calls in `counts`."""
    counts = collections.Counter()

    def forward_kernel(causal, q, k, v, out, lse, scale, workspace, *plain):
        assert plain == (None, (None, 4)) and not workspace.any()
        counts["kernel"] += 1
        rows, rows_lse = math_attend(_bhsd(q), _bhsd(k), _bhsd(v), causal, scale)
        out.copy_(_bhsd(rows))
        lse.copy_(rows_lse)
        workspace.fill_(1)

    def _flash_attn_fwd(q, k, v, softmax_scale, causal=False, return_lse=False, out=None, lse=None, **lengths):
        assert not any(x is not None for x in lengths.values())  # dense calls only
        counts["interface"] += 1
        out = torch.empty(q.shape[:-1] + v.shape[-1:], dtype=q.dtype) if out is None else out
        lse = torch.empty(q.shape[:-1], dtype=torch.float64).transpose(1, 2) if lse is None else lse
        workspace = torch.zeros(q.shape[1], dtype=torch.int32)
        key = (q.dtype, q.shape[-1], causal)
        if key not in _flash_attn_fwd.compile_cache:
            _flash_attn_fwd.compile_cache[key] = functools.partial(forward_kernel, causal)
        _flash_attn_fwd.compile_cache[key](q.clone() if copies else q.detach(), k, v, out, lse, softmax_scale,
                                           workspace, None, (None, 4))
        return out, lse, None, None, None

    def backward_kernel(causal, q, k, v, out, dout, lse, dlse, dq, dk, dv, scale, accumulator, deterministic):
        assert not accumulator.any()
        counts["kernel"] += 1
        grads = MathInterface._flash_attn_bwd(q, k, v, out, dout, lse, scale, causal, deterministic, dlse)
        for target, g in zip((dq, dk, dv), grads):
            target.copy_(g)
        accumulator.fill_(1)

    def _flash_attn_bwd(q, k, v, out, dout, lse, softmax_scale, causal=False, deterministic=False, dlse=None,
                        dq=None, dk=None, dv=None, **lengths):
        assert not any(x is not None for x in lengths.values())
        counts["interface"] += 1
        assert lse.is_contiguous() and (dlse is None or dlse.is_contiguous())
        dq, dk, dv = (torch.empty_like(x) if g is None else g for x, g in ((q, dq), (k, dk), (v, dv)))
        accumulator = torch.empty(q.shape[1], dtype=torch.float32)
        accumulator.zero_()
        key = (q.dtype, q.shape[-1], causal, dlse is None)
        if key not in _flash_attn_bwd.compile_cache:
            _flash_attn_bwd.compile_cache[key] = functools.partial(backward_kernel, causal)
        _flash_attn_bwd.compile_cache[key](q, k, v, out, dout, lse, dlse, dq, dk, dv, softmax_scale, accumulator,
                                           deterministic)
        return dq, dk, dv

    _flash_attn_fwd.compile_cache, _flash_attn_bwd.compile_cache = {}, {}
    return types.SimpleNamespace(_flash_attn_fwd=_flash_attn_fwd, _flash_attn_bwd=_flash_attn_bwd, counts=counts,
                                 __version__=direct.VERIFIED_VERSIONS[0])


@pytest.mark.parametrize("copies", [False, True])
def test_kernels_called_directly_equal_the_reference(copies, monkeypatch):
    """A call of shapes and layouts seen before repeats the interface's program with its own tensors: its kernels, a
    fresh zeroed workspace (a kernel would find the last call's writes in a reused one), its results; new inputs give
    their own exact results, forward and backward with the LSE's gradient. Where the interface gave a kernel a tensor
    it copied, every call goes through the interface."""
    interface = kernel_interface(copies)
    monkeypatch.setattr(ops, "fa", interface)
    for name in ("FORWARD", "BACKWARD"):
        monkeypatch.setattr(direct, name, direct.Direct(name.lower()))
    _poisoned_empty(monkeypatch)
    for seed, causal in [(0, False), (1, False), (2, True), (3, True)]:
        before = collections.Counter(interface.counts)
        _forward_backward_exact(seed, causal)
        kernels = interface.counts["kernel"] - before["kernel"]
        through_interface = interface.counts["interface"] - before["interface"]
        assert kernels > 2
        if copies:  # the forward's calls through the interface; the backward's direct
            assert 0 < through_interface < kernels
        elif seed % 2:  # the second call of each causal setting: every shape seen before
            assert through_interface == 0
        else:  # the first: once per shape and layout
            assert 0 < through_interface < kernels
    assert all(program is None for program in direct.FORWARD.programs.values()) == copies
    assert all(direct.BACKWARD.programs.values())


def test_direct_programs_stay_bounded(monkeypatch):
    """Past MAX_PROGRAMS shapes the programs are dropped and noted anew (packs of ever new lengths)."""
    interface = kernel_interface()
    monkeypatch.setattr(direct, "FORWARD", direct.Direct("forward"))
    monkeypatch.setattr(direct, "MAX_PROGRAMS", 2)
    for n in (16, 24, 32, 16):
        q = torch.randn(1, n, 2, 8, dtype=torch.float64)
        out, lse = direct.forward(interface, q, q, q, 0.3, False, {})
        want, want_lse = math_attend(_bhsd(q), _bhsd(q), _bhsd(q), False, 0.3)
        torch.testing.assert_close(out, _bhsd(want), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(lse, want_lse, rtol=1e-12, atol=1e-12)
        assert len(direct.FORWARD.programs) <= 2
    assert direct.FORWARD.hits == 0 and interface.counts["interface"] == 4


def test_direct_calls_resume_when_turned_on_again(monkeypatch):
    """Turned off and on again in one process (bench_gpu.py's fa4_interface provider beside fa4), the calls go
    directly again: an interface's first call while they were off does not keep it on the interface."""
    interface = kernel_interface()
    monkeypatch.setattr(ops, "fa", interface)
    monkeypatch.setattr(direct, "FORWARD", direct.Direct("forward"))
    monkeypatch.setattr(direct, "_PATHS", {})
    g = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(1, 64, 8, 8, generator=g, dtype=torch.float64) for _ in range(3))
    args = ([16, 32, 64], [1, 2, 4], False, False, 0.3)
    monkeypatch.setattr(direct, "ENABLED", False)
    ops.fa4_forward(q, k, v, *args)
    assert direct.FORWARD.hits == 0 and not direct.FORWARD.programs
    monkeypatch.setattr(direct, "ENABLED", True)
    ops.fa4_forward(q, k, v, *args)  # each shape's first call watched
    watched, hits = interface.counts["interface"], direct.FORWARD.hits
    ops.fa4_forward(q, k, v, *args)
    assert interface.counts["interface"] == watched and direct.FORWARD.hits > hits


class _StreamLog:
    """Stand-in CUDA streams that log what each lane runs, in the order the host enqueues it: `(lane, kind, x)`."""

    def __init__(self):
        self.ops: list = []
        self.current = "main"

    def stream(self, name):
        log = self

        class Stream:
            def wait_stream(self, other):
                log.ops.append((name, "wait stream", other.name))

            def wait_event(self, event):
                log.ops.append((name, "wait", event))

            def record_event(self):
                log.ops.append((name, "record", len(log.ops)))
                return log.ops[-1][2]

        s = Stream()
        s.name = name
        return s

    def ordered_before(self):
        """For each op, the ops that have finished when it starts: those before it on its lane, and for a wait,
        those before the event's record (or, for a wait on a stream, everything that stream was given)."""
        before: list = []
        last = {}
        for i, (lane, kind, x) in enumerate(self.ops):
            done = set(before[last[lane]]) | {last[lane]} if lane in last else set()
            if kind == "wait":
                done |= before[x] | {x}
            if kind == "wait stream" and x in last:
                done |= before[last[x]] | {last[x]}
            before.append(done)
            last[lane] = i
        return before


def _enter_logged_streams(log, monkeypatch):
    """`with torch.cuda.stream(s)` on `log`'s stand-in streams: what runs inside is logged on `s`."""
    @contextlib.contextmanager
    def on(stream):
        log.current, before = stream.name, log.current
        yield
        log.current = before

    monkeypatch.setattr(torch.cuda, "stream", on)


def _log_lanes(log, math_interface, monkeypatch):
    """Run the backward's two lanes on `log`'s stand-in streams, logging each call, store and addition there."""
    monkeypatch.setattr(ops._Lanes, "of", classmethod(lambda cls, like: cls([log.stream("main"), log.stream("side")])))
    _enter_logged_streams(log, monkeypatch)
    accumulate = ops.extension.accumulate

    def logged_accumulate(targets, parts, store=False):
        log.ops.append((log.current, "store" if store else "add", None))
        accumulate(targets, parts, store)

    monkeypatch.setattr(ops.extension, "accumulate", logged_accumulate)
    backward = math_interface._flash_attn_bwd

    def logged_backward(*args, dq=None, **kwargs):
        log.ops.append((log.current, "call writes" if dq is not None else "call", None))
        return backward(*args, dq=dq, **kwargs)

    monkeypatch.setattr(math_interface, "_flash_attn_bwd", staticmethod(logged_backward))


@pytest.mark.parametrize("lse_gradient", [False, True])
@pytest.mark.parametrize("packed", [False, True])
def test_backward_lanes_keep_the_writes_in_order(packed, lse_gradient, math_interface, monkeypatch):
    """The backward's calls alternate between two streams (ops._Lanes), strided and packed: each addition into the
    gradients starts after every earlier write into them, stored writes wait for nothing, the lanes alternate, the
    second starts after what the caller's stream was given and the caller's stream waits for it at the end; the
    gradients are those of one stream (packed) or the reference's."""
    segs, dils, scale = [16, 32, 64], [1, 2, 4], 0.3
    g = torch.Generator().manual_seed(7)
    if packed:
        cu_seqlens, max_seqlen = torch.tensor([0, 64, 96, 160], dtype=torch.int32), 64
        q, k, v, grad_out = (torch.randn(160, 8, 8, generator=g, dtype=torch.float64) for _ in range(4))
        args = (cu_seqlens, max_seqlen, segs, dils, False, False, scale)
        forward, backward = ops.fa4_varlen_forward, ops.fa4_varlen_backward
    else:
        q, k, v, grad_out = (torch.randn(1, 64, 8, 8, generator=g, dtype=torch.float64) for _ in range(4))
        args = (segs, dils, False, False, scale)
        forward, backward = ops.fa4_forward, ops.fa4_backward
        monkeypatch.setattr(ops, "MAX_BACKWARD_CALL_BYTES", 5120)  # 512 elements where added
    out, lse = forward(q, k, v, *args)
    grad_lse = torch.randn(lse.shape, generator=g, dtype=torch.float64) if lse_gradient else None
    one_lane = backward(grad_out, grad_lse, q, k, v, out, lse, *args)
    log = _StreamLog()
    _log_lanes(log, math_interface, monkeypatch)
    grads = backward(grad_out, grad_lse, q, k, v, out, lse, *args)

    for got, want in zip(grads, one_lane):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    if not packed:
        ref = [x.clone().requires_grad_() for x in (q, k, v)]
        ref_out, ref_lse = dilated_attention_reference(*ref, segs, dils, scale=scale)
        loss = (ref_out * grad_out).sum() + ((ref_lse * grad_lse).sum() if lse_gradient else 0)
        for got, want in zip(grads, torch.autograd.grad(loss, ref)):
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)

    assert log.ops[0] == ("side", "wait stream", "main"), "the second lane starts after what the caller enqueued"
    calls = [lane for lane, kind, _ in log.ops if kind.startswith("call")]
    assert len(calls) > 4 and calls == ["main", "side"] * (len(calls) // 2) + ["main"] * (len(calls) % 2)
    writes = [i for i, (_, kind, _) in enumerate(log.ops) if kind in ("call writes", "store", "add")]
    kinds = [log.ops[i][1] for i in writes]
    assert kinds.count("add") > 2 and kinds[0] != "add"
    assert kinds.index("add") > max(i for i, kind in enumerate(kinds) if kind != "add"), "stored writes come first"
    before = log.ordered_before()
    for n, i in enumerate(writes):
        if log.ops[i][1] == "add":
            assert set(writes[:n]) <= before[i], f"addition {log.ops[i]} may run beside an earlier write"
    assert log.ops[-1] == ("main", "wait stream", "side")


@pytest.mark.parametrize("packed", [False, True])
def test_forward_merges_follow_their_parts(packed, math_interface, monkeypatch):
    """The forward's merged calls run on a second stream beside the stored ones (ops._run_forward), strided and
    packed: the second stream starts after what the caller's stream was given, and each merge runs on the caller's
    stream after every stored call and after its own part's call; the results are one stream's, and the
    reference's."""
    segs, dils, scale = [16, 32, 64], [1, 2, 4], 0.3
    g = torch.Generator().manual_seed(8)
    if packed:
        q, k, v = (torch.randn(160, 8, 8, generator=g, dtype=torch.float64) for _ in range(3))
        args = (torch.tensor([0, 64, 96, 160], dtype=torch.int32), 64, segs, dils, False, False, scale)
        forward = ops.fa4_varlen_forward
    else:
        q, k, v = (torch.randn(1, 64, 8, 8, generator=g, dtype=torch.float64) for _ in range(3))
        args = (segs, dils, False, False, scale)
        forward = ops.fa4_forward
    one_stream = forward(q, k, v, *args)
    log = _StreamLog()
    main, side = log.stream("main"), log.stream("side")
    monkeypatch.setattr(ops, "_second_stream", lambda like: side)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: main)
    _enter_logged_streams(log, monkeypatch)
    attend, merge = math_interface._flash_attn_fwd, ops._merge

    def logged_attend(*a, **kw):
        log.ops.append((log.current, "call", None))
        return attend(*a, **kw)

    def logged_merge(*a):
        log.ops.append((log.current, "merge", None))
        merge(*a)

    monkeypatch.setattr(math_interface, "_flash_attn_fwd", staticmethod(logged_attend))
    monkeypatch.setattr(ops, "_merge", logged_merge)
    results = forward(q, k, v, *args)

    for got, want in zip(results, one_stream):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    if not packed:
        for got, want in zip(results, dilated_attention_reference(q, k, v, segs, dils, scale=scale)):
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert log.ops[0] == ("side", "wait stream", "main"), "the second stream starts after what the caller enqueued"
    parts = [i for i, (lane, kind, _) in enumerate(log.ops) if kind == "call" and lane == "side"]
    stored = [i for i, (lane, kind, _) in enumerate(log.ops) if kind == "call" and lane == "main"]
    merges = [i for i, (_, kind, _) in enumerate(log.ops) if kind == "merge"]
    assert len(parts) == len(merges) > 2 and stored and all(log.ops[i][0] == "main" for i in merges)
    before = log.ordered_before()
    for part, i in zip(parts, merges):
        assert set(stored) | {part} <= before[i], f"merge {i} may run before its part or a stored call"


def test_another_flash_attn_4_version_runs_the_interface_and_says_so(monkeypatch):
    """A flash-attn-4 version outside VERIFIED_VERSIONS (a stand-in's own `__version__`) is taken, with a warning
    once naming the path: its calls go through the interface every time (none directly), with exact results; explain()
    names that path."""
    from dilated_attn.backends import fa4

    interface = kernel_interface()
    interface.__version__ = "4.0.0b999"
    monkeypatch.setattr(ops, "fa", None)
    monkeypatch.setattr(direct, "_PATHS", {})
    for name in ("FORWARD", "BACKWARD"):
        monkeypatch.setattr(direct, name, direct.Direct(name.lower()))
    with pytest.warns(UserWarning, match=r"fa4 backend runs FlashAttention-4's interface on every call: flash-attn-4 "
                                         r"4\.0\.0b999 is not a version whose direct kernel calls the GPU tests verified"):
        assert fa4.use_interface(interface) is None
    assert ops.fa is interface
    segs, dils = [16, 32], [1, 2]
    for seed in range(2):  # the second call of the same shapes too: through the interface
        g = torch.Generator().manual_seed(seed)
        q, k, v = (torch.randn(1, 32, h, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2))
        before = collections.Counter(interface.counts)
        out, lse = ops.fa4_forward(q, k, v, segs, dils, False, True, 0.3)
        grads = ops.fa4_backward(torch.ones_like(out), None, q, k, v, out, lse, segs, dils, False, True, 0.3)
        ref = [x.detach().requires_grad_() for x in (q, k, v)]
        ref_out, _ = dilated_attention_reference(*ref, segs, dils, causal=True, scale=0.3)
        torch.testing.assert_close(out, ref_out, rtol=1e-12, atol=1e-12)
        for got, want in zip(grads, torch.autograd.grad(ref_out.sum(), ref)):
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
        calls = interface.counts["interface"] - before["interface"]
        assert calls == interface.counts["kernel"] - before["kernel"] > 2  # each kernel by an interface call
    assert direct.FORWARD.hits == direct.BACKWARD.hits == 0 and not direct.FORWARD.programs
    monkeypatch.setattr(fa4, "_installed", lambda: True)
    monkeypatch.setattr(fa4._loader, "done", True)
    monkeypatch.setattr(fa4._loader, "error", None)
    assert fa4.FA4.run_path().startswith("FlashAttention-4's interface on every call: flash-attn-4 4.0.0b999 is not")
    interface.__version__ = direct.VERIFIED_VERSIONS[0]
    monkeypatch.setattr(direct, "_PATHS", {})
    assert fa4.FA4.run_path() == f"flash-attn-4 {direct.VERIFIED_VERSIONS[0]}'s kernels, called directly after each " \
                                 f"shape's first call"


@pytest.mark.parametrize("broken, rule", [
    (dict(_flash_attn_fwd=None), "has no _flash_attn_fwd, which the fa4 backend calls"),
    (dict(_flash_attn_fwd=lambda q, k, v, softmax_scale, causal=False: None),
     "_flash_attn_fwd takes no return_lse, out, lse, cu_seqlens_q"),
    (dict(_flash_attn_bwd=lambda q, k, v, out, dout, lse, softmax_scale, causal, deterministic, dlse: None),
     "_flash_attn_bwd takes no dq, dk, dv, cu_seqlens_q"),
])
def test_an_interface_without_the_calls_it_needs_is_refused(broken, rule, monkeypatch):
    """A flash-attn-4 whose private calls are not what the fa4 backend passes is refused when it loads, with the
    reason, instead of called wrongly."""
    from dilated_attn.backends import fa4

    monkeypatch.setattr(ops, "fa", None)
    interface = kernel_interface()
    for name, function in broken.items():
        setattr(interface, name, function)
    assert rule in fa4.use_interface(interface)
    assert ops.fa is None


def test_fa4_verdict_without_flash_attn(monkeypatch):
    """Where flash-attn-4 is not installed the backend says so (and how to install it), without importing it."""
    from dilated_attn.backends import fa4

    monkeypatch.setattr(fa4, "_installed", lambda: False)
    assert "pip install --no-build-isolation .[fa4]" in fa4.FA4.unavailable()
    with pytest.raises(RuntimeError, match=r"fa4 backend cannot run: flash-attn-4 is not installed"):
        fa4.FA4.ops()


# --- GPU: the real FlashAttention-4 -----------------------------------------------------------------------------

GPU_CASES = [
    dict(B=1, N=4096, H=16, D=128, segs=[512, 1024, 2048, 4096], dils=[1, 2, 4, 8], groups="all"),
    dict(B=1, N=4096, H=16, Hkv=4, D=128, segs=[512, 1024, 2048, 4096], dils=[1, 2, 4, 8], groups="all"),
    dict(B=2, N=1000, H=8, Hkv=1, D=64, segs=[128, 300, 1000], dils=[1, 3, 4], groups="all"),
    # one kv head read at the row shifts of calls that stack the offset groups (kv head step 0)
    dict(B=1, N=2048, H=8, Hkv=1, D=64, segs=[256, 512, 1024], dils=[1, 2, 4], groups="all"),
    # offset groups in interleaved classes (r = 8 and 16 at Hkv = 4: row shift 2 and 4, kv head step 1) and in runs
    # of groups reading one kv head (Hkv = 2: kv head step 0)
    dict(B=1, N=2048, H=16, Hkv=4, D=64, segs=[256, 512, 1024], dils=[1, 8, 16], groups="all"),
    dict(B=1, N=2048, H=16, Hkv=2, D=64, segs=[256, 512, 1024], dils=[1, 8, 16], groups="all"),
    dict(B=2, N=777, H=6, Hkv=2, D=64, segs=[100, 300, 2000], dils=[2, 3, 5], groups="split"),
    dict(B=3, N=513, H=5, D=96, segs=[64, 512], dils=[1, 7], groups="all"),
    dict(B=2, N=1025, H=4, D=64, segs=[256, 1024, 4], dils=[1, 2, 8], groups="all"),  # one-member calls
]


def _skip_without_fa4():
    why = dilated_attn.backends.FA4.unavailable()
    if why is not None:
        pytest.skip(why)
    if torch.cuda.get_device_capability()[0] not in (9, 10, 11):
        pytest.skip("FlashAttention-4 runs on Hopper and Blackwell")


@pytest.mark.gpu
@pytest.mark.parametrize("lse_gradient", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("index", range(len(GPU_CASES)))
def test_gpu_parity(index, causal, dtype, lse_gradient):
    _skip_without_fa4()
    c = GPU_CASES[index]
    q, k, v, g = case_inputs(c, index, dtype)
    kw = dict(causal=causal, head_groups=c["groups"])
    poison_allocator()
    inputs = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    out, lse = dilated_attn.dilated_attention(*inputs, c["segs"], c["dils"], return_lse=True, backend="fa4", **kw)
    grad_out = torch.randn(out.shape, generator=g).to("cuda", dtype)
    grad_lse = torch.randn(lse.shape, generator=g).to("cuda")
    ref = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ref_out, ref_lse = dilated_attention_reference(*ref, c["segs"], c["dils"], **kw)
    low = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    low_out, low_lse = dilated_attention_reference(*low, c["segs"], c["dils"], compute_dtype=dtype, **kw)
    finite = torch.isfinite(ref_lse)
    grad_lse = torch.where(finite, grad_lse, 0) if lse_gradient else None

    def grads_of(o, l_, xs, go):
        loss = (o.double() * go.double()).sum()
        if grad_lse is not None:
            loss = loss + (torch.where(finite, l_.double(), 0) * grad_lse.double()).sum()
        return torch.autograd.grad(loss, xs)

    grads = grads_of(out, lse, inputs, grad_out)
    ref_grads = grads_of(ref_out, ref_lse, ref, grad_out)
    low_grads = grads_of(low_out, low_lse, low, grad_out)
    assert torch.isfinite(out).all()
    assert max_error(out, ref_out) <= allowed_error(dtype, max_error(low_out, ref_out))
    assert torch.equal(torch.isfinite(lse), finite) and (out.transpose(1, 2)[~finite] == 0).all()
    assert max_error(lse[finite], ref_lse[finite]) <= allowed_error(
        dtype, max_error(low_lse[finite], ref_lse[finite]))
    for name, a, b, lo in zip("qkv", grads, ref_grads, low_grads):
        largest = b.abs().max().item()
        assert max_error(a, b) <= allowed_error(dtype, max_error(lo, b), gradient=True, largest=largest), name


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kv_heads", [16, 4])
def test_gpu_direct_calls_equal_the_interface(kv_heads, causal, monkeypatch):
    """The kernels called directly (backends/fa4/direct.py) give the interface's results bit for bit (the backward
    under deterministic algorithms), on new inputs of the shapes seen before: stored calls, merged parts, gradient
    additions, grouped-query heads, the LSE's gradient. Every call of these problems can be repeated directly."""
    _skip_without_fa4()
    dilated_attn.backends.FA4.ops()  # flash-attn-4 loaded
    for name in ("FORWARD", "BACKWARD"):
        monkeypatch.setattr(direct, name, direct.Direct(name.lower()))
    args = ([512, 1024, 2048], [1, 2, 8], False, causal, 64 ** -0.5)
    g = torch.Generator().manual_seed(kv_heads + causal)
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        for _ in range(2):  # the first inputs' calls are watched, the second's repeated
            q, k, v = (torch.randn(1, 4096, h, 64, generator=g).to("cuda", torch.bfloat16)
                       for h in (16, kv_heads, kv_heads))
            grad_out = torch.randn(q.shape, generator=g).to("cuda", torch.bfloat16)
            grad_lse = torch.randn(1, 16, 4096, generator=g).to("cuda")
            results = []
            for enabled in (False, True):
                monkeypatch.setattr(direct, "ENABLED", enabled)
                out, lse = ops.fa4_forward(q, k, v, *args)
                results.append((out, lse, *ops.fa4_backward(grad_out, grad_lse, q, k, v, out, lse, *args)))
            for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), *results):
                assert torch.equal(a, b), name
    finally:
        torch.use_deterministic_algorithms(deterministic)
    for calls in (direct.FORWARD, direct.BACKWARD):
        assert calls.hits > 0 and all(calls.programs.values()), calls.why_not


def test_direct_calls_turn_off_by_environment():
    """DILATED_ATTN_FA4_DIRECT=0 sets the direct calls off for the process, and the path says why."""
    code = ("from dilated_attn.backends.fa4 import direct; "
            "print(direct.ENABLED); print(direct.path()[1])")
    env = dict(os.environ, **{direct.DIRECT_ENV: "0"})
    printed = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    enabled, why = printed.stdout.splitlines()
    assert enabled == "False"
    assert why == "FlashAttention-4's interface on every call: DILATED_ATTN_FA4_DIRECT=0 turned the direct calls off"
    env[direct.DIRECT_ENV] = "1"
    printed = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert printed.stdout.splitlines()[0] == "True"


@pytest.mark.gpu
@pytest.mark.parametrize("nq, nk, kv_heads", [(1000, 3000, 4), (3000, 1000, 2), (2, 4097, 1)])
def test_gpu_dense_ops_take_unequal_lengths(nq, nk, kv_heads):
    """The ring's joined blocks: FlashAttention-4 over keys of another length, against float64 math."""
    _skip_without_fa4()
    g = torch.Generator().manual_seed(nq + nk)
    q, go = (torch.randn(2, nq, 4, 64, generator=g).to("cuda", torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(2, nk, kv_heads, 64, generator=g).to("cuda", torch.bfloat16) for _ in range(2))
    forward, backward = dilated_attn.backends.FA4.dense_ops()
    out, lse = forward(q, k, v, 0.3)
    grads = backward(go, q, k, v, out, lse, 0.3)
    exact = [x.cpu().double() for x in (q, k, v, go)]
    ref_out, ref_lse, *_ = MathInterface._flash_attn_fwd(*exact[:3], 0.3)
    ref_grads = MathInterface._flash_attn_bwd(*exact[:3], ref_out, exact[3], ref_lse, 0.3)
    assert max_error(out.cpu(), ref_out) <= allowed_error(torch.bfloat16, 0.0)
    assert max_error(lse.cpu(), ref_lse) <= 1e-4 * (1 + ref_lse.abs().max().item())
    for a, b in zip(grads, ref_grads):
        assert max_error(a.cpu(), b) <= allowed_error(torch.bfloat16, 0.0, gradient=True,
                                                      largest=b.abs().max().item())



@pytest.mark.parametrize("installed, causal, kv_heads, backward, first", [
    (True, False, 16, False, "fa4"), (True, True, 16, False, "fa4"), (True, False, 4, False, "fa4"),
    (True, True, 4, False, "fa4"), (True, True, 4, True, "fa4"), (True, True, 16, True, "fa4"),
    (False, False, 16, True, "cudnn"), (False, True, 4, False, "cudnn")])
def test_auto_prefers_fa4_where_installed_and_measured_faster(monkeypatch, installed, causal, kv_heads, backward,
                                                               first):
    """auto's rule, without a GPU: fa4 before cudnn on Hopper where flash-attn-4 is installed, causal or not, with a
    backward or not; the verdict imports nothing."""
    import dataclasses

    from dilated_attn import dispatch
    from dilated_attn.backends import extension, fa4
    from dilated_attn.spec import validate

    monkeypatch.setattr(extension, "_KERNELS", {"cpu": True, "cuda": True})
    monkeypatch.setattr(dispatch.cudnn_backend.CUDNN, "why_not", lambda p: None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(fa4, "_installed", lambda: installed)
    monkeypatch.setattr(fa4._loader, "_load", lambda: pytest.fail("a verdict imported flash-attn-4"))
    q = torch.empty(1, 65536, 16, 128, dtype=torch.bfloat16, device="meta", requires_grad=backward)
    kv = torch.empty(1, 65536, kv_heads, 128, dtype=torch.bfloat16, device="meta")
    p = dataclasses.replace(validate(q, kv, kv, [2048, 4096], [1, 2], causal=causal), device=torch.device("cuda", 0))
    assert p.records_backward == backward
    assert dispatch.auto_preference(p)[0] == first
    # a pack of the same tokens: fa4's varlen calls where it is preferred, never cudnn's per-sequence calls
    packed = dataclasses.replace(p, cu_seqlens=torch.tensor([0, 1000, 65536]), max_seqlen=64536)
    assert packed.varlen
    assert dispatch.auto_preference(packed)[0] == ("fa4" if first == "fa4" else "triton")


def _use_math_interface(monkeypatch):
    """The fa4 backend, loaded, on the float64 contract."""
    from dilated_attn.backends import fa4

    monkeypatch.setattr(fa4, "_installed", lambda: True)
    monkeypatch.setattr(fa4._loader, "done", True)
    monkeypatch.setattr(fa4._loader, "error", None)
    return fa4.FA4


# (lengths, Hq, Hkv, segment_lengths, dilation_rates, causal, head_groups): empty sequences, sequences shorter than
# a segment and than a dilation, starts of every residue, segments not divisible by their dilation, GQA runs cut per
# kv head, split heads (uncovered rows), r > w; offset groups stacked in one call (the last six: kv heads one
# (step 0), one per head pair (step 1), groups that do not stack (no cut saves a call, or their runs differ), and,
# moved, with gaps; then in calls of interleaved classes of groups, and in runs of groups reading one kv head:
# the cudnn plan's _by_head)
PACKS = [
    ([5, 0, 17, 40], 4, 2, (8, 16), (1, 2), True, "all"),
    ([5, 0, 17, 3, 40], 4, 2, (8, 16), (1, 2), False, "split"),
    ([33, 1, 0, 29], 6, 3, (64, 8, 4), (4, 2, 1), True, "all"),
    ([0, 0, 12, 0], 2, 1, (4, 32), (2, 4), False, "split"),
    ([7, 9, 30, 11, 2], 8, 2, (6, 12, 24), (1, 3, 8), False, "all"),
    ([13, 64, 3, 21], 5, 1, (10, 3), (3, 5), True, "all"),
    ([16, 32, 48], 4, 4, (8, 16, 32), (1, 2, 4), True, "all"),
    ([16, 32, 48], 8, 1, (8, 16, 32), (1, 2, 8), False, "all"),
    ([24, 8, 32], 8, 4, (8, 16), (1, 4), True, "all"),
    ([12, 20, 16], 8, 2, (8, 16, 32), (1, 4, 8), False, "all"),
    ([12, 20, 16], 4, 1, (8, 16, 32), (1, 4, 8), True, "all"),
    ([16, 32, 48], 16, 4, (8, 16, 32), (1, 2, 8), True, "all"),
    ([16, 32, 48], 8, 2, (8, 16, 32), (1, 4, 8), False, "all"),
]


@pytest.mark.parametrize("move", ["never", "always"])
@pytest.mark.parametrize("index", range(len(PACKS)))
def test_packs_equal_each_sequence_alone(index, move, math_interface, monkeypatch):
    """dilated_attention_varlen on the fa4 ops (float64 through the contract, results it allocates NaN between the
    runs), in place and on the sequences moved to multiples of the dilations: each sequence equals the reference
    on it alone, out, LSE and gradients with an LSE gradient."""
    from dilated_attn.backends.fa4 import packs
    from dilated_attn.spec import validate_varlen

    backend = _use_math_interface(monkeypatch)
    monkeypatch.setattr(packs, "MOVE_SAVES_CALLS", 10**9 if move == "never" else -10**9)
    ops._planned.cache_clear()
    lengths, H, Hkv, segs, dils, causal, groups = PACKS[index]
    T = sum(lengths)
    g = torch.Generator().manual_seed(index)
    q = torch.randn(T, H, 32, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(T, Hkv, 32, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
    _poisoned_empty(monkeypatch)
    p = validate_varlen(q, k, v, cu, segs, dils, causal=causal, head_groups=groups)
    out, lse = backend.forward_varlen(q, k, v, p)
    assert math_interface.varlen_calls == math_interface.forward_calls > 0
    go, gl = (torch.randn(x.shape, generator=g, dtype=torch.float64) for x in (out, lse))
    want_out, want_lse = [], []
    for a, b in zip(cu.tolist(), cu.tolist()[1:]):
        if b > a:
            o, lse_ = dilated_attention_reference(q[None, a:b], k[None, a:b], v[None, a:b], segs, dils,
                                                  causal=causal, head_groups=groups)
            want_out.append(o[0])
            want_lse.append(lse_[0])
    want_out, want_lse = torch.cat(want_out), torch.cat(want_lse, dim=1)
    torch.testing.assert_close(out, want_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, want_lse, rtol=1e-12, atol=1e-12)
    finite = torch.isfinite(want_lse)

    def loss(o, l_):
        return (o * go).sum() + (torch.where(finite, l_, 0) * gl).sum()

    got = torch.autograd.grad(loss(out, lse), (q, k, v))
    want = torch.autograd.grad(loss(want_out, want_lse), (q, k, v))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_packs_of_other_head_dims_run_one_sequence_at_a_time(math_interface, monkeypatch):
    """Head dims FlashAttention's varlen backward did not compute exactly (fa4.VARLEN_HEAD_DIM_STEP) take the
    per-sequence calls; a cu_seqlens changed in place is read again."""
    from dilated_attn.spec import validate_varlen

    backend = _use_math_interface(monkeypatch)
    q, k, v = (torch.randn(24, 2, 16, dtype=torch.float64) for _ in range(3))
    cu = torch.tensor([0, 5, 24], dtype=torch.int32)
    backend.forward_varlen(q, k, v, validate_varlen(q, k, v, cu, [8], [2]))
    assert math_interface.varlen_calls == 0 and math_interface.forward_calls > 0
    q, k, v = (torch.randn(24, 2, 32, dtype=torch.float64) for _ in range(3))
    out = backend.forward_varlen(q, k, v, validate_varlen(q, k, v, cu, [8], [2]))[0]
    assert math_interface.varlen_calls > 0
    cu[1] = 9  # in place: read again
    out = backend.forward_varlen(q, k, v, validate_varlen(q, k, v, cu, [8], [2]))[0]
    want = torch.cat([dilated_attention_reference(q[None, a:b], k[None, a:b], v[None, a:b], [8], [2])[0][0]
                      for a, b in ((0, 9), (9, 24))])
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)


def test_aligned_pack_takes_a_uniform_batchs_calls():
    """Sequences whose lengths every dilation divides take, per branch, the calls of a uniform batch for the whole
    pack: one per offset group, or one per head of a group where the groups stack; the first branch written in
    place. Other starts take a call per residue and offset group, or run moved to multiples of the dilations where
    that saves calls."""
    from dilated_attn.backends.fa4 import packs
    from dilated_attn.backends.views import view_plan

    aligned = packs.plan_pack((0, 32, 48, 112), (16, 32), (1, 4), 16, 16, False)  # 4 heads in each of 4 groups
    assert aligned.starts is None and [len(calls) for calls in aligned.plan.calls] == [1, 4]
    assert aligned.plan.first_stores and all(call.used == 0 for calls in aligned.plan.calls for call in calls)
    # 8 heads, 2 per offset group: the j-th head of the 4 groups in one call, head i at a row shift of i
    stacked = packs.plan_pack((0, 32, 48, 112), (16, 32), (1, 4), 8, 8, False).plan.calls[1]
    assert [(c.head0, c.n_heads, c.head_step, c.row_step, c.kv_heads, c.used) for c in stacked] == [
        (0, 4, 2, 1, 4, 0), (1, 4, 2, 1, 4, 0)]
    # LongNet's branches over a pack of 8 sequences (bench_varlen --eight): a uniform batch's calls (9, not 15; with
    # 4 kv heads the last branch's 8 groups in two interleaved classes, 11 calls, not 15)
    eight = (0, *itertools.accumulate([4096, 12288, 2048, 16384, 6144, 10240, 8192, 6144]))
    longnet = ((2048, 4096, 8192, 16384), (1, 2, 4, 8))
    for kv_heads, counts in ((16, [1, 2, 4, 2]), (4, [1, 2, 4, 4]), (1, [1, 2, 4, 2])):
        calls = packs.plan_pack(eight, *longnet, 16, kv_heads, False).plan.calls
        uniform = view_plan(*longnet, 65536, 16, kv_heads, False).calls
        assert [len(c) for c in calls] == [len(c) for c in uniform] == counts
    here = packs.plan_sequences(((0, 31), (31, 17), (48, 65)), 113, (16, 32), (1, 4), 8, 8, False)
    # starts 0, 31 and 48, residues 0, 3 and 0 modulo 4: two calls per offset group, the second sequence's apart
    assert [len(calls) for calls in here.calls] == [1, 8]
    # every segment's run once: 5 segments (the last one row), whose one row only offset 0 has
    assert sum(call.count for call in here.calls[1]) == 5 + 3 * 4
    moved = packs.plan_pack((0, 31, 48, 113), (16, 32), (1, 4), 8, 8, False)
    assert moved.starts is None  # 4 calls saved: not worth the copies
    many = packs.plan_pack((0, 31, 49, 114, 200), (16, 32), (1, 8), 16, 16, False)
    assert many.starts == (0, 32, 56, 128) and many.total == 216
    # moved: a call per offset group (lengths off multiples of 8 give the groups runs of unequal lengths: unstacked)
    assert [len(calls) for calls in many.plan.calls] == [1, 8]
    # its views' rows between runs all lie between the moved sequences (their results are dropped: not filled);
    # in place, rows between runs lie within the sequences (another offset's members): filled
    assert many.plan.gaps_outside and any(call.used for call in many.plan.calls[1])
    assert not here.gaps_outside and any(call.used for call in here.calls[1])
    assert not packs.plan_sequences(((0, 32), (32, 17)), 49, (12,), (8,), 8, 8, False).gaps_outside  # 8 -/-> 12


# packs whose starts take several residues modulo the dilations, GQA, split heads, a sequence shorter than a dilation;
# offset groups stacked in one call (packs._stacked: head i at a row shift of i), MHA, one kv head on the moved copy,
# whose views have rows between the runs, and 4 kv heads (two interleaved classes of groups per call)
GPU_PACKS = [
    ([300, 77, 0, 1000, 5], 8, 2, (64, 256, 1024), (1, 4, 8), "all"),
    ([513, 1030, 2], 4, 4, (128, 512), (2, 4), "split"),
    ([256, 768, 512, 512], 16, 16, (64, 128, 256), (1, 2, 8), "all"),
    ([300, 200, 516], 8, 1, (64, 128, 256), (1, 4, 8), "all"),
    ([256, 768, 512, 512], 16, 4, (64, 128, 256), (1, 2, 8), "all"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("move", ["never", "always"])
@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("index", range(len(GPU_PACKS)))
def test_gpu_varlen_ops(index, causal, dtype, head_dim, move, monkeypatch):
    """FlashAttention-4's varlen calls on the packs' strided views, in place and on the moved copy, against the
    float64 reference of each sequence alone (out, LSE, gradients through both), results poisoned."""
    from test_varlen import check_varlen

    from dilated_attn.backends.fa4 import packs

    _skip_without_fa4()
    monkeypatch.setattr(packs, "MOVE_SAVES_CALLS", 10**9 if move == "never" else -10**9)
    ops._planned.cache_clear()
    lengths, H, Hkv, segs, dils, groups = GPU_PACKS[index]
    check_varlen("fa4", dtype, "cuda", (lengths, H, Hkv, head_dim, segs, dils, causal, groups), transposed=causal)


def _stored_on_disk(monkeypatch, tmp_path) -> dict:
    """stored.py on `tmp_path` with the stand-in's kernels: each kernel's "object file" and "library" named by its
    compile key, loaded back from the returned dict (name -> kernel) as a new process would load the library."""
    from dilated_attn.backends.fa4 import stored

    kernels = {}

    def object_file(cache, key):
        name = f"k{len(kernels)}" if all(k is not cache.cache[key] for k in kernels.values()) else \
            next(n for n, k in kernels.items() if k is cache.cache[key])
        kernels[name] = cache.cache[key]
        return f"/nowhere/{name}.o"

    monkeypatch.setattr(direct._NotingCache, "_object_file", object_file)
    monkeypatch.setattr(stored, "directory", lambda: tmp_path)
    monkeypatch.setattr(stored, "_link", lambda obj, where: obj.rsplit("/", 1)[1].replace(".o", ".so"))
    monkeypatch.setattr(stored, "_kernel", lambda path: kernels[path.stem])
    monkeypatch.setattr(direct, "_installed_version", lambda: direct.VERIFIED_VERSIONS[0])
    return kernels


def _fresh_process(monkeypatch, interface):
    for name in ("FORWARD", "BACKWARD"):
        monkeypatch.setattr(direct, name, direct.Direct(name.lower()))
    monkeypatch.setattr(ops, "fa", interface)


def _forward_backward_exact(seed: int, causal: bool = True):
    """fa4_forward and fa4_backward (with an LSE gradient) of LongNet-like branches on seeded float64 inputs, exact
    against the reference."""
    segs, dils = [16, 32, 64], [1, 2, 4]
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, 64, h, 8, generator=g, dtype=torch.float64) for h in (8, 2, 2))
    grad_out, grad_lse = torch.randn(2, 64, 8, 8, generator=g, dtype=torch.float64), \
        torch.randn(2, 8, 64, generator=g, dtype=torch.float64)
    out, lse = ops.fa4_forward(q, k, v, segs, dils, False, causal, 0.3)
    grads = ops.fa4_backward(grad_out, grad_lse, q, k, v, out, lse, segs, dils, False, causal, 0.3)
    ref = [x.detach().requires_grad_() for x in (q, k, v)]
    ref_out, ref_lse = dilated_attention_reference(*ref, segs, dils, causal=causal, scale=0.3)
    torch.testing.assert_close(out, ref_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-12, atol=1e-12)
    want = torch.autograd.grad((ref_out * grad_out).sum() + (ref_lse * grad_lse).sum(), ref)
    for got, exp in zip(grads, want):
        torch.testing.assert_close(got, exp, rtol=1e-10, atol=1e-10)


def test_stored_programs_run_in_a_new_process_without_importing_flash_attn(monkeypatch, tmp_path):
    """A shape's first call stores its program (backends/fa4/stored.py) and says once what it waited for; a new
    process (fresh programs, an interface whose import fails the test) runs the stored programs, forward and
    backward, with exact results and without importing FlashAttention-4; a damaged file is a miss that goes through
    the interface and is stored anew."""
    from dilated_attn.backends.fa4 import stored

    interface = kernel_interface()
    _stored_on_disk(monkeypatch, tmp_path)
    _poisoned_empty(monkeypatch)
    _fresh_process(monkeypatch, direct.Deferred(lambda: interface))
    with pytest.warns(UserWarning, match=r"fa4 backend's first call of a shape waited for .*later processes load it"):
        _forward_backward_exact(0)
    files = sorted(tmp_path.glob("*.json"))
    assert files and stored.store_problem() is None
    assert direct.FORWARD.loaded == 0 and interface.counts["interface"] > 0

    def no_import():
        raise AssertionError("FlashAttention-4 was imported although every program is stored")

    before = collections.Counter(interface.counts)
    _fresh_process(monkeypatch, direct.Deferred(no_import))
    _forward_backward_exact(1)
    assert interface.counts["interface"] == before["interface"] and interface.counts["kernel"] > before["kernel"]
    assert direct.FORWARD.loaded + direct.BACKWARD.loaded == len(files) and ops.fa.module is None

    files[0].write_text("{")
    _fresh_process(monkeypatch, direct.Deferred(lambda: interface))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _forward_backward_exact(2)
    assert interface.counts["interface"] > before["interface"]
    assert json.loads(files[0].read_text())["format"] == stored.FORMAT


def test_stored_programs_defer_the_import(monkeypatch, tmp_path):
    """Where programs are stored for this install, loading the backend imports nothing (the first call's shapes may
    all be stored); where none are, it imports FlashAttention-4 at once, so that a broken install is found then."""
    from dilated_attn.backends import fa4
    from dilated_attn.backends.fa4 import stored

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(direct, "path", lambda interface=None: (True, "directly"))
    monkeypatch.setattr(ops, "fa", None)
    imported = []
    monkeypatch.setattr(fa4, "_import_interface", lambda: imported.append(1) or kernel_interface())
    for has, imports in ((True, 0), (False, 1)):
        monkeypatch.setattr(stored, "has_programs", lambda: has)
        imported.clear()
        assert fa4._load() is None
        assert isinstance(ops.fa, direct.Deferred) and len(imported) == imports
    monkeypatch.setattr(fa4, "_import_interface", lambda: (_ for _ in ()).throw(RuntimeError("flash-attn-4 broke")))
    assert fa4._load() == "flash-attn-4 broke"


def test_stored_program_names_are_exact(monkeypatch):
    """A program's key text is repr's: exact for scales and distinct for layouts that differ in one stride."""
    from dilated_attn.backends.fa4 import stored

    cpu = torch.device("cpu")
    a = ((True, 0.1 + 0.2, ()), (((torch.Size([1, 2]), (2, 1), torch.bfloat16, True),), (0,)))
    b = ((True, 0.3, ()), (((torch.Size([1, 2]), (2, 1), torch.bfloat16, True),), (0,)))
    c = ((True, 0.1 + 0.2, ()), (((torch.Size([1, 2]), (1, 1), torch.bfloat16, True),), (0,)))
    names = {stored._name("forward", key, cpu)[0] for key in (a, b, c)}
    assert len(names) == 3 and stored._name("backward", a, cpu) != stored._name("forward", a, cpu)
    assert stored._decode(json.loads(json.dumps(stored._encode((None, (1.5, True), "x"))))) == (None, (1.5, True), "x")
    with pytest.raises(TypeError, match="a list argument"):
        stored._encode([1])


_NEW_PROCESS = r"""
import json, sys, time
import torch
torch.use_deterministic_algorithms(True)
import dilated_attn
g = torch.Generator().manual_seed(7)
q, k, v = (torch.randn(1, 4096, h, 64, generator=g).to("cuda", torch.bfloat16).requires_grad_() for h in (8, 2, 2))
grad_out = torch.randn(1, 4096, 8, 64, generator=g).to("cuda", torch.bfloat16)
torch.cuda.synchronize()
began = time.perf_counter()
out = dilated_attn.dilated_attention(q, k, v, [1024, 2048, 4096], [1, 2, 4], causal=True, backend="fa4")
grads = torch.autograd.grad(out, (q, k, v), grad_out)
torch.cuda.synchronize()
seconds = time.perf_counter() - began
torch.save([x.cpu() for x in (out, *grads)], sys.argv[1])
print(json.dumps(dict(imported="flash_attn.cute" in sys.modules, seconds=seconds)))
"""


@pytest.mark.gpu
def test_gpu_a_new_process_runs_stored_programs_without_importing_flash_attn(tmp_path):
    """The first process of an empty program store imports FlashAttention-4 and stores its programs; the next runs
    them without importing it and, under deterministic algorithms, gives the first one's results bit for bit (the
    same kernels on its first call)."""
    _skip_without_fa4()
    from dilated_attn.backends import fa4

    script = tmp_path / "first_call.py"
    script.write_text(_NEW_PROCESS)
    # an empty program store, beside FlashAttention-4's kernels as earlier tests compiled them
    env = dict(os.environ, DILATED_ATTN_FA4_CACHE=str(tmp_path / "cache"),
               FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=os.environ.get("FLASH_ATTENTION_CUTE_DSL_CACHE_DIR", fa4.cache_dir()))
    runs = []
    for i in range(2):
        done = subprocess.run([sys.executable, str(script), str(tmp_path / f"{i}.pt")], env=env, capture_output=True,
                              text=True, timeout=900)
        assert done.returncode == 0, done.stderr[-3000:]
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    assert runs[0]["imported"] and not runs[1]["imported"], runs
    for name, a, b in zip(("out", "dq", "dk", "dv"), torch.load(tmp_path / "0.pt"), torch.load(tmp_path / "1.pt")):
        assert torch.equal(a, b), name


_EAGER_PROCESS = r"""
import sys
import torch
from dilated_attn.backends.fa4 import ops
from test_fa4 import MathInterface
ops.fa = MathInterface
q, k, v = (torch.randn(1, 64, 4, 8, dtype=torch.float64) for _ in range(3))
out, lse = ops.fa4_forward(q, k, v, [16, 32], [1, 2], False, False, 0.3)
eager_imports = "torch._dynamo" in sys.modules
compiled = torch.compile(lambda *x: ops.fa4_forward(*x, [16, 32], [1, 2], False, False, 0.3)[0], backend="aot_eager",
                         fullgraph=True)
print(eager_imports, torch.equal(compiled(q, k, v), out), torch.equal(ops.fa4_forward(q, k, v, [16, 32], [1, 2],
                                                                                      False, False, 0.3)[0], out))
"""


def test_an_eager_call_does_not_import_dynamo():
    """The ops' first eager call does not import torch._dynamo (seconds of a new process's first call:
    signature._dynamo_imported_lazily); once torch.compile has imported it, compiled and eager calls give the same
    results."""
    here = os.path.dirname(os.path.abspath(__file__))
    done = subprocess.run([sys.executable, "-c", _EAGER_PROCESS], capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, PYTHONPATH=os.pathsep.join([here, os.environ.get("PYTHONPATH", "")])))
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["False", "True", "True"], done.stdout
