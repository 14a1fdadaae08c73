"""Which mode runs a ring_attention call, and what it needs: the `mode` argument, the "auto" rule, explain_ring.

    ring    K/V blocks travel around the ring (plan.py, autograd.py): any head count, traffic per rank the rows the
            branches select from the other ranks; local branches move nothing.
    heads   an all-to-all trades each rank's sequence shard for a share of the heads (heads.py): Hq % P == 0,
            traffic per rank about 2(Hq + P*hkv)/P of the shard's rows, no merge.
    2d      heads inside the inner group, ring across the outer group (a 2-D DeviceMesh or a pair of groups).
    auto    2d for a mesh or a pair; else whichever of ring and heads sends fewer bytes per rank (the ring on a
            tie; heads only where it can run).

Packed sequences (`cu_seqlens`) run in every mode. In the heads mode each rank's share of the heads holds the whole
pack, on which the single-device backends run dilated_attention_varlen's packed kernels; in the ring (and the 2-D
mode's ring) each sequence's segments are ranges of the pack (plan.segment_ranges). "auto" takes packs to the heads
mode where it can run (benchmarks/README.md, "Ring attention": packs), else to the ring.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from dataclasses import dataclass
from typing import Optional

import torch

from .. import backends, dispatch
from ..spec import Problem, check_cu_seqlens, check_packed_tensors, host_offsets, lse_dtype, validate
from .autograd import RingAttention, RingConfig, ring_backward, ring_forward
from .comm import exchange_stream
from .documents import DocumentLayout
from .heads import HeadParallelAttention, HeadShare, head_share
from .layout import MODES, Groups, check_documents_groups, check_layout, check_mode, resolve_groups
from .plan import ring_plan

__all__ = ["MODES", "RingCall", "DocumentsRun", "plan_call", "run_documents", "explain_ring", "resolve_groups"]


@dataclass(frozen=True)
class DocumentsRun:
    """A ring_attention call under a DocumentLayout on this rank: its own documents' packed call (the first
    `own_rows` rows: `own_problem`, validated, run by the backend `own_backend`), and its part of the shared
    documents' ring, or None where it holds none."""

    layout: DocumentLayout
    rank: int
    own_rows: int
    own_problem: Problem
    own_backend: Optional[backends.Backend]
    ring: Optional[RingConfig]


@dataclass
class RingCall:
    """A validated ring_attention call on this rank: its mode and why, the local problem, and what runs it."""

    mode: str
    reason: str
    problem: Problem  # the local shard's
    branches: tuple  # (segment_lengths, dilation_rates) bounded by the global sequence
    backend: str = ""  # the single-device backend of its kernels
    bytes_per_rank: Optional[dict] = None  # forward bytes each candidate mode sends from the busiest rank
    ring: Optional[RingConfig] = None
    head_parallel: Optional[HeadParallelAttention] = None
    documents: Optional[DocumentsRun] = None

    def __str__(self) -> str:
        sent = "" if not self.bytes_per_rank else "; forward bytes sent per rank: " + ", ".join(
            f"{m} {b / 2**20:.1f} MiB" for m, b in self.bytes_per_rank.items())
        return f"mode {self.mode!r} with the {self.backend!r} kernels: {self.reason}{sent}"


def _ring_config(q_like: Problem, plan, rank: int, gw, gr, head_groups: str, backend: str,
                 head_start: int = 0, global_heads: int = 0, packed=None) -> RingConfig:
    """The ring's config for a local problem `q_like` (the shard's sizes): its local branches' problem and
    backend. With `packed` (cu_seqlens, max_seqlen) the backend is the one a pack's call would run (its internal
    runs are packs of their parts)."""
    local = plan.local_branches
    all_local = len(local) == len(gw)
    local_problem = Problem.from_sizes(
        q_like.batch, q_like.seq_len, q_like.num_heads, q_like.num_kv_heads, q_like.head_dim,
        [gw[i] for i in local] or [1], [gr[i] for i in local] or [1], dtype=q_like.dtype, device=q_like.device,
        causal=q_like.causal, scale=q_like.scale, head_groups=head_groups if all_local else "all",
        records_backward=q_like.records_backward)
    if global_heads:
        local_problem = local_problem.with_heads(head_start, global_heads)
    asked = local_problem if packed is None else dataclasses.replace(local_problem, cu_seqlens=packed[0],
                                                                        max_seqlen=packed[1])
    chosen = dispatch.select(asked, backend).name
    return RingConfig(plan, rank, local_problem, chosen, q_like.scale, q_like.causal)


def _heads_bytes(p: Problem, share: HeadShare) -> int:
    """Forward bytes one rank sends in the heads mode: q's other heads and the key/value heads the other ranks
    read, of its L rows, and the output of its heads at the other ranks' positions."""
    P = share.P
    rows = p.batch * p.seq_len * p.head_dim * p.dtype.itemsize
    return rows * ((P - 1) * share.hq * 2 + (P - 1) * share.hkv * 2)


def plan_call(q, k, v, segment_lengths, dilation_rates, *, causal, scale, head_groups, layout, return_lse, backend,
              mode, groups: Groups, cu_seqlens=None, max_seqlen=None) -> RingCall:
    """Validate a call on this rank and choose its mode (ValueError/TypeError as the spec says). Packed sequences
    (`cu_seqlens`, q `[L, Hq, D]`) are validated as the shard `[1, L, Hq, D]` of a pack of P*L rows."""
    mode = check_mode(mode, groups.two_d)
    if isinstance(layout, DocumentLayout):
        return _documents_call(q, k, v, segment_lengths, dilation_rates, causal=causal, scale=scale,
                               head_groups=head_groups, return_lse=return_lse, backend=backend, mode=mode,
                               groups=groups, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, layout=layout)
    if cu_seqlens is not None:
        check_packed_tensors(q, k, v)
        q, k, v = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)
    layout = check_layout(layout)
    if (segment_lengths is None) != (dilation_rates is None):
        raise ValueError("segment_lengths and dilation_rates must both be None (dense ring attention) or both be "
                         "given")
    dense = segment_lengths is None
    P = groups.size
    L = q.shape[1] if isinstance(q, torch.Tensor) and q.dim() == 4 else 0
    N = P * L
    w, r = ([max(N, 1)], [1]) if dense else (segment_lengths, dilation_rates)
    p = validate(q, k, v, w, r, causal=causal, scale=scale, head_groups=head_groups, return_lse=return_lse,
                 backend=backend)
    if layout == "zigzag" and L % 2:
        raise ValueError(f"layout='zigzag' needs the global length N = P*L divisible by 2P, i.e. an even local "
                         f"length L, got L={L} on {P} ranks")
    packed, offsets = None, None
    if cu_seqlens is not None:
        whole = (f"the whole pack's P * L = {P} * {L} = {N} rows (each rank passes its shard of L rows: "
                 f"shard(x, dim=0) cuts a pack [T, H, D] along its rows)")
        packed = (cu_seqlens, check_cu_seqlens(cu_seqlens, N, q.device, max_seqlen, whole))
        offsets = tuple(host_offsets(cu_seqlens))
    if P == 1:
        return RingCall("ring", "one rank: dilated_attention" + ("_varlen" if packed else ""), p, (w, r))
    gw, gr = (tuple(x) for x in p.op_branches(N))  # bounded by the global sequence (the plan's ints stay small)
    Hq, Hkv = p.num_heads, p.num_kv_heads
    if groups.two_d:
        (ri, ro), (Pi, Po) = groups.ranks, groups.sizes
        share = heads_share(p, N, Pi, ri, layout)
        attention, chosen = _two_d(p, share, ro, Po, Pi * L, gw, gr, layout, backend, packed, offsets)
        return RingCall("2d", f"a 2-D group: heads across the inner {Pi} ranks, ring across the outer {Po}", p,
                        (gw, gr), chosen, head_parallel=attention)
    rank = groups.rank
    plan = ring_plan(P, L, Hq, Hkv, gw, gr, head_groups, causal, layout, offsets=offsets)
    ring_bytes = max(plan.bytes_sent(j, p.batch, p.head_dim, p.dtype.itemsize) for j in range(P))
    share, why_not = None, None
    if mode in ("auto", "heads"):
        try:
            share = heads_share(p, N, P, rank, layout)
        except ValueError as exc:
            if mode == "heads":
                raise
            why_not = str(exc)
    sent = {"ring": ring_bytes}
    if share is not None:
        sent["heads"] = _heads_bytes(p, share)
    # packs: heads wherever it runs (faster on 2 H200s though it sends more: benchmarks/README.md, "Ring attention")
    heads_wins = share is not None and (packed is not None or sent["heads"] < ring_bytes)
    if mode == "ring" or (mode == "auto" and not heads_wins):
        reason = ("asked for" if mode == "ring" else
                  f"heads cannot run ({why_not})" if share is None else "it sends no more bytes than heads")
        cfg = _ring_config(p, plan, rank, gw, gr, head_groups, backend, packed=packed)
        return RingCall("ring", reason, p, (gw, gr), cfg.backend, sent, ring=cfg)
    reason = ("asked for" if mode == "heads" else "packed sequences run whole in the heads mode" if packed
              else "it sends fewer bytes than ring")
    attention, chosen = _heads(p, share, N, gw, gr, backend, packed)
    return RingCall("heads", reason, p, (gw, gr), chosen, sent, head_parallel=attention)


def _documents_call(q, k, v, segment_lengths, dilation_rates, *, causal, scale, head_groups, return_lse, backend,
                    mode, groups: Groups, cu_seqlens, max_seqlen, layout: DocumentLayout) -> RingCall:
    """plan_call for a DocumentLayout: the rank's own documents in one packed call, its parts of shared documents
    in a ring among the ranks that hold them."""
    check_documents_groups(layout, groups)
    if mode not in ("auto", "ring"):
        raise ValueError(f"mode={mode!r}: a DocumentLayout keeps each document on its ranks and runs the documents "
                         f"it shares among ranks as rings: mode must be 'auto' or 'ring'")
    if cu_seqlens is not None or max_seqlen is not None:
        raise ValueError("a DocumentLayout holds the pack's offsets: pass cu_seqlens=None and max_seqlen=None with it")
    check_packed_tensors(q, k, v)
    if (segment_lengths is None) != (dilation_rates is None):
        raise ValueError("segment_lengths and dilation_rates must both be None (dense ring attention) or both be "
                         "given")
    rank, N = groups.rank, layout.total
    w, r = ([max(N, 1)], [1]) if segment_lengths is None else (segment_lengths, dilation_rates)
    p = validate(q[None], k[None], v[None], w, r, causal=causal, scale=scale, head_groups=head_groups,
                 return_lse=return_lse, backend=backend)
    given = None if segment_lengths is None else (p.segment_lengths, p.dilation_rates)
    if given != (None if layout.segment_lengths is None else (layout.segment_lengths, layout.dilation_rates)):
        raise ValueError(f"layout: this DocumentLayout was placed for the branches segment_lengths="
                         f"{layout.segment_lengths}, dilation_rates={layout.dilation_rates} (its cuts are where "
                         f"their segments allow), got {given}: place_documents with the call's branches")
    if q.shape[0] != layout.length(rank):
        raise ValueError(f"q: rank {rank} holds {layout.length(rank)} rows of the DocumentLayout, got {q.shape[0]} "
                         f"(shard(x, layout=layout) cuts them)")
    own = layout.own_rows(rank)
    local = layout.local_offsets[rank]
    longest = max((b - a for a, b in zip(local, local[1:])), default=0)
    own_problem = dataclasses.replace(p, seq_len=own, cu_seqlens=layout.offsets_tensor("local", rank, q.device),
                                      max_seqlen=longest)
    own_backend = dispatch.select(own_problem, backend) if own else None
    chosen = own_backend.name if own_backend is not None else ""
    ring, sent = None, 0
    if layout.shared_chunks[rank]:
        gw, gr = (tuple(x) for x in p.op_branches(layout.shared))  # bounded as the shared pack's ring sees them
        plan = ring_plan(layout.P, 0, p.num_heads, p.num_kv_heads, gw, gr, head_groups, causal, "contiguous",
                         offsets=layout.shared_offsets, rank_chunks=layout.shared_chunks)
        shared = layout.shared_offsets
        rows = q.shape[0] - own
        like = Problem.from_sizes(1, rows, p.num_heads, p.num_kv_heads, p.head_dim, gw, gr, dtype=p.dtype,
                                  device=p.device, causal=causal, scale=p.scale, head_groups=head_groups,
                                  records_backward=p.records_backward)
        packed = (layout.offsets_tensor("shared", rank, q.device), max(b - a for a, b in zip(shared, shared[1:])))
        ring = _ring_config(like, plan, rank, gw, gr, head_groups, backend, packed=packed)
        chosen = chosen or ring.backend
        sent = plan.bytes_sent(rank, 1, p.head_dim, p.dtype.itemsize)
    run = DocumentsRun(layout, rank, own, own_problem, own_backend, ring)
    documents = sum(b > a for a, b in zip(local, local[1:]))
    reason = (f"layout=DocumentLayout: {documents} documents and pieces whole on this rank ({own} rows, no "
              f"transfer)" + (f", and {q.shape[0] - own} rows of documents shared with other ranks, run as rings "
                              f"among them" if ring is not None else ""))
    return RingCall("ring", reason, p, (w, r), chosen, {"ring": sent}, documents=run)


def heads_share(p: Problem, seq_len: int, P: int, rank: int, layout: str) -> HeadShare:
    """This rank's share of the heads in a head-parallel group of P ranks for the local problem `p` of a global
    sequence of `seq_len`, or ValueError naming the rule that `p` breaks (head_share's, the kernels' offsets)."""
    if p.head_groups != "all":
        raise ValueError("mode='heads' and '2d' run head_groups='all' (LongNet's); head_groups='split' runs in "
                         "mode='ring'")
    w, r = p.op_branches(seq_len)
    return _heads_share(p.batch, seq_len, p.num_heads, p.num_kv_heads, p.head_dim, tuple(w), tuple(r), p.dtype,
                        p.device, p.causal, p.scale, P, rank, layout)


# A pure function of its arguments, asked on every call (and by "auto" where the ring runs): kept, so that the
# host, which the GPU waits for before the first exchange, spends no time on it again.
@functools.lru_cache(maxsize=256)
def _heads_share(batch, seq_len, Hq, Hkv, head_dim, w, r, dtype, device, causal, scale, P, rank,
                 layout) -> HeadShare:
    def check(h0: int, n: int) -> None:
        Problem.from_sizes(batch, seq_len, n, max(n * Hkv // Hq, 1), head_dim, w, r, dtype=dtype, device=device,
                           causal=causal, scale=scale).with_heads(h0, Hq)

    return head_share(P, rank, Hq, Hkv, layout, check=check)


@functools.lru_cache(maxsize=256)
def _chunk_problem(p: Problem, heads: int, kv_heads: int, seq_len: int, gw, gr, head_start: int) -> Problem:
    """The problem of one head chunk: `heads` query heads from `head_start` on, all seq_len positions (kept, as
    _heads_share)."""
    return Problem.from_sizes(p.batch, seq_len, heads, kv_heads, p.head_dim, gw, gr, dtype=p.dtype, device=p.device,
                              causal=p.causal, scale=p.scale,
                              records_backward=p.records_backward).with_heads(head_start, p.num_heads)


def _heads(p: Problem, share: HeadShare, N: int, gw, gr, backend: str, packed=None):
    """The heads mode: the single-device ops on each head chunk's gathered [B, N, h, D] tensors; with `packed`
    (cu_seqlens, max_seqlen), the backends' packed path on them (_packed_heads)."""
    problems = [_chunk_problem(p, qs.stop - qs.start, ks.stop - ks.start, N, gw, gr, share.head_start + qs.start)
                for qs, ks in share.chunks]
    if packed is not None:
        problems = [dataclasses.replace(x, cu_seqlens=packed[0], max_seqlen=packed[1]) for x in problems]
        return _packed_heads(p, share, problems, backend)
    chosen = [dispatch.select(x, backend).name for x in problems]

    def attend(g, q_h, k_h, v_h, groups):  # k_h, v_h: the chunk's key/value heads
        forward_op, _ = backends.get(chosen[g]).ops()
        out, lse = forward_op(q_h, k_h, v_h, **problems[g].op_arguments())
        return out, lse, (q_h, k_h, v_h, out, lse)

    def attend_backward(g, kept, d_out, d_lse, groups):
        name, _ = dispatch.backward_backend(problems[g], chosen[g], lse_gradient=d_lse is not None)
        _, backward_op = backends.get(name).ops()
        q_h, k_g, v_g, out, lse = kept
        return backward_op(d_out, d_lse, q_h, k_g, v_g, out, lse, **problems[g].op_arguments())

    return HeadParallelAttention(share, attend, attend_backward), chosen[0]


def _packed_heads(p: Problem, share: HeadShare, problems: list[Problem], backend: str):
    """The heads mode on packed sequences: each head chunk's whole pack `[N, h, D]` through its backend's
    forward_varlen (the packed kernels, or one call per sequence), whose autograd graph the backward runs. That
    graph is kept with the call's (retained: a second backward through a retained graph runs it again), and freed
    with it."""
    chosen = [dispatch.select(x, backend) for x in problems]
    records = p.records_backward

    def attend(g, q_h, k_h, v_h, groups):
        leaves = [x[0].detach().requires_grad_(records) for x in (q_h, k_h, v_h)]
        with torch.enable_grad() if records else contextlib.nullcontext():
            out, lse = chosen[g].forward_varlen(*leaves, problems[g])
        return out[None], lse[None], (leaves, out, lse)

    def attend_backward(g, kept, d_out, d_lse, groups):
        leaves, out, lse = kept
        outputs, grads = [out], [d_out[0]]
        if d_lse is not None:
            outputs.append(lse)
            grads.append(d_lse[0].to(lse.dtype))
        got = torch.autograd.grad(outputs, leaves, grads, allow_unused=True, retain_graph=True)
        return tuple((torch.zeros_like(x) if gx is None else gx)[None] for gx, x in zip(got, leaves))

    return HeadParallelAttention(share, attend, attend_backward), chosen[0].name


def _two_d(p: Problem, share: HeadShare, outer_rank: int, Po: int, L_outer: int, gw, gr, layout: str,
           backend: str, packed=None, offsets=None) -> tuple[HeadParallelAttention, str]:
    """The 2-D mode: each head chunk's gathered [B, Pi*L, h, D] tensors are one shard of a ring across the outer
    group (`packed`: a pack's (cu_seqlens, max_seqlen), `offsets` its offsets, for the ring's plan)."""
    configs = []
    for g, (qs, ks) in enumerate(share.chunks):
        h0 = share.head_start + qs.start
        n_q, n_kv = qs.stop - qs.start, ks.stop - ks.start
        plan = ring_plan(Po, L_outer, n_q, n_kv, gw, gr, "all", p.causal, layout, h0, p.num_heads, offsets)
        local = Problem.from_sizes(p.batch, L_outer, n_q, n_kv, p.head_dim, gw, gr, dtype=p.dtype, device=p.device,
                                   causal=p.causal, scale=p.scale, records_backward=p.records_backward)
        configs.append(_ring_config(local, plan, outer_rank, gw, gr, "all", backend, h0, p.num_heads, packed))

    def attend(g, q_h, k_h, v_h, groups):  # groups: (inner, outer)
        out, lse, exchanged = ring_forward(q_h, k_h, v_h, configs[g], groups[1])
        return out, lse, (q_h, k_h, v_h, out, lse, exchanged)

    def attend_backward(g, kept, d_out, d_lse, groups):
        q_h, k_g, v_g, out, lse, exchanged = kept
        return ring_backward(q_h, k_g, v_g, out, lse, d_out, d_lse, configs[g], groups[1], exchanged)

    return HeadParallelAttention(share, attend, attend_backward), configs[0].backend


def explain_ring(q, k, v, segment_lengths=None, dilation_rates=None, *, causal=False, scale=None, head_groups="all",
                 group=None, layout="contiguous", return_lse=False, backend="auto", mode="auto", cu_seqlens=None,
                 max_seqlen=None) -> RingCall:
    """Which mode (and single-device backend) `ring_attention` with these arguments runs on this rank, and why:
    `print()` it. Validates like ring_attention without any collective or attention."""
    groups = resolve_groups(group, mode)
    return plan_call(q, k, v, segment_lengths, dilation_rates, causal=causal, scale=scale, head_groups=head_groups,
                     layout=layout, return_lse=return_lse, backend=backend, mode=mode, groups=groups,
                     cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)


def run_documents(q, k, v, run: DocumentsRun, group, post_check=None):
    """(out [L, Hq, D], lse [Hq, L]) of this rank's rows `q`, `k`, `v` under run.layout. The own documents' call is
    queued first: its kernels wait for no collective and no validation (the kept plan's problem). `post_check()`
    posts ring_attention's configuration check and returns the call that reads it: posted from the exchange stream
    beside the own documents' kernels (it reads nothing they write) and read after them, so that the host waits for
    the gather while the GPU computes, and before the shared documents' first transfer."""
    n = run.own_rows
    if n and run.ring is not None:  # one split, whose backward joins the two parts' gradients in one pass (slices'
        # would each write theirs into zeros of the whole shard, then add the two)
        own, shared = zip(*(x.split([n, x.shape[0] - n]) for x in (q, k, v)))
    else:  # all its own or all shared: the rows as they are
        own = shared = (q, k, v)
    outs, lses = [], []
    if n:
        out, lse = run.own_backend.forward_varlen(*own, run.own_problem)
        outs.append(out)
        lses.append(lse)
    if post_check is not None:
        with exchange_stream(q.device, after_current=False):
            check = post_check()
        check()
    if run.ring is not None:
        out, lse = RingAttention.apply(*(x[None] for x in shared), run.ring, group, None)
        outs.append(out[0])
        lses.append(lse[0])
    if not outs:  # a rank without rows (fewer rows than ranks): empty results, of q's, k's and v's graph still
        empty = q * 0 + (k.sum() + v.sum()) * 0
        return empty, empty.sum(-1).t().to(lse_dtype(q.dtype))
    if len(outs) == 1:
        return outs[0], lses[0]
    return torch.cat(outs), torch.cat(lses, 1)
