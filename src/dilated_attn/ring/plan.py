"""The ring plan: which rows each rank computes against which, and which rows it sends where.

The plan is a pure function of the configuration (`ring_plan`, cached), so every rank derives the same one and no
sizes travel. For a branch `(w, r)`:

* Local branches: when no segment crosses a chunk of the layout and chunks start on segment boundaries
  (contiguous: `s | L`; zigzag: `s | L/2`), the branch on the local shard is the branch on the global sequence.
  These run in one call of the single-device op, and nothing moves.
* Spanning branches: each rank cuts its positions into pieces (a chunk intersected with a segment) and keeps only
  the branch's members, per head: the compacted rows. Within a segment, the members of all ranks in position
  order form one dense (causal or not) attention problem, so a spanning branch is dense ring attention on
  compacted tensors among the ranks that share segments: only 1/r of K and V travels, only to ranks that read it.
  Heads whose pieces have the same member counts are stacked into one problem (a `HeadStack`).
* Internal runs: with head_groups "all", a spanning branch's segments that lie within one chunk of a rank need
  nothing from the others. Consecutive ones run like a local branch, by the single-device op with the branch
  itself on the rank's rows (a `BranchRun`); only the segments that cross chunks become head stacks.

Packed sequences (`offsets`, the pack's cu_seqlens): each sequence's segments start at its own first row and the last
is clipped at its end, so a segment is a range of the pack (`segment_ranges`) rather than a cell of one grid. No
branch is then local (a shard's rows of a sequence do not start where its segments do): the segments within a chunk
run as internal runs, and those that cross ranks as head stacks.
"""

from __future__ import annotations

import bisect
import functools
import itertools
from dataclasses import dataclass, field
from typing import Optional

import torch

from ..branches import branch_table
from .layout import chunks

__all__ = ["BlockTask", "BranchRun", "HeadStack", "RingPlan", "ring_plan", "segment_ranges"]


@dataclass
class HeadStack:
    """Heads of one spanning branch whose pieces have identical member counts: one stacked problem."""

    q_heads: list[int]
    q_offsets: list[int]  # each query head's offset in the branch
    kv_heads: list[int]  # one entry per distinct (offset, kv head); q head i of the stack reads entry i // group
    kv_offsets: list[int]
    group: int
    dilation: int
    seg_starts: list[int]  # the global first row of each segment of the branch (segment_ranges)
    pieces: list[list[tuple[int, int, int, int]]]  # [rank] -> (segment, global lo, global hi, local row of lo)
    segments: list[list[tuple[int, int, int, int]]]  # [rank] -> (segment, global start, start, stop) per piece

    def rows(self, rank: int, offsets: list[int]) -> list[torch.Tensor]:
        """Per offset, the local rows of its members on `rank`, concatenated over the rank's pieces."""
        r = self.dilation
        out = []
        for o in offsets:
            parts = []
            for seg, lo, hi, local in self.pieces[rank]:
                first = _first_member(lo, self.seg_starts[seg], o, r)
                if first < hi:
                    parts.append(torch.arange(first - lo + local, hi - lo + local, r))
            out.append(torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long))
        return out


@dataclass
class BlockTask:
    """Queries of one head stack on this rank against one block of keys: a dense (causal or full) block."""

    stack: int  # index into RingPlan.stacks
    q_start: int  # query rows [q_start, q_stop) of the stack's compacted rows on this rank
    q_stop: int
    kv_start: int  # key rows [kv_start, kv_stop): own compacted rows, or offsets in the received payload
    kv_stop: int
    causal: bool
    # 0: one block. Else the own rows of consecutive segments, seg_len rows each (the last may have fewer), each
    # segment its own block: one call of the branch (seg_len, 1) instead of one call per segment.
    seg_len: int = 0


@dataclass(frozen=True)
class BranchRun:
    """Consecutive segments of one branch within a rank's chunk, its local rows [start, stop): the op with the branch
    (seg_len, dilation) on those rows cuts them into segments from the first row, so where a segment is shorter
    (the end of a packed sequence) the next starts a part of its own. `bounds`: the parts' first rows from
    `start`, and the run's length: as one call, the packed op's cu_seqlens; else one call of the op per part."""

    seg_len: int
    dilation: int
    start: int
    stop: int
    bounds: tuple[int, ...]

    def parts(self) -> list[tuple[int, int]]:
        """The local rows [a, b) of each part."""
        return [(self.start + a, self.start + b) for a, b in zip(self.bounds, self.bounds[1:])]


@dataclass(eq=False)  # hashed by identity: plans are cached, and so are their index tensors
class RingPlan:
    """What one configuration computes and sends. `bytes_sent(rank, ...)` is the forward traffic of that rank;
    backward sends the same K/V again and the same rows of dK/dV in float32."""

    P: int
    L: int
    layout: str
    local_branches: list[int]
    stacks: list[HeadStack]
    # needed[dst][src]: per stack, the compacted row ranges [a, b) of src that dst reads, in payload order
    needed: list[list[list[list[tuple[int, int]]]]]
    tasks: list[list[list[BlockTask]]] = field(default_factory=list)  # tasks[rank][src]
    runs: list[list[BranchRun]] = field(default_factory=list)  # runs[rank]: the internal runs, in branch order

    def rows_needed(self, dst: int, src: int) -> int:
        """kv rows x kv heads that src sends dst (one of K or V)."""
        return sum((b - a) * len(self.stacks[s].kv_heads)
                   for s, ranges in enumerate(self.needed[dst][src]) for a, b in ranges)

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


def segment_ranges(s: int, N: int, offsets: Optional[tuple[int, ...]] = None) -> list[tuple[int, int]]:
    """The segments [start, stop) of a branch of segment length `s` over N rows: `[j*s, (j+1)*s)` clipped at N, or
    with packed sequences (`offsets`: cu_seqlens) each sequence's own, from its first row and clipped at its end (the
    spec's segment clipped to the sequence is such a range too)."""
    bounds = zip(offsets, offsets[1:]) if offsets is not None else [(0, N)]
    return [(a, min(a + s, stop)) for start, stop in bounds for a in range(start, stop, s)]


def _internal_runs(segments: list[tuple[int, int]], s: int, rank_chunks: list[list[tuple[int, int]]],
                   dilation: int) -> tuple[list[list[BranchRun]], list[tuple[int, int]]]:
    """Of a branch's segments (segment_length s), those within one chunk as each rank's BranchRuns, and the rest
    (crossing chunks), in order."""
    chunk_list = sorted((a, b, rank, base) for rank, ranges in enumerate(rank_chunks)
                        for (a, b), base in zip(ranges, itertools.accumulate([0] + [b - a for a, b in ranges])))
    chunk_starts = [c[0] for c in chunk_list]
    runs: list[list[BranchRun]] = [[] for _ in rank_chunks]
    crossing = []
    for a, b in segments:
        ca, cb, rank, base = chunk_list[bisect.bisect_right(chunk_starts, a) - 1]
        if b > cb:
            crossing.append((a, b))
            continue
        start, stop = base + a - ca, base + b - ca
        mine = runs[rank]
        last = mine[-1] if mine else None
        if last is not None and last.stop == start:
            # the op segments a part from its first row: after a shorter segment, a new part
            whole = (last.stop - last.start - last.bounds[-2]) % s == 0
            bounds = last.bounds[:-1] + (() if whole else (start - last.start,)) + (stop - last.start,)
            mine[-1] = BranchRun(s, dilation, last.start, stop, bounds)
        else:
            mine.append(BranchRun(s, dilation, start, stop, (0, stop - start)))
    return runs, crossing


def _pieces(ranges: list[tuple[int, int]], segments: list[tuple[int, int]],
            starts: list[int]) -> list[tuple[int, int, int, int]]:
    """A rank's pieces in local order: each of its chunks `ranges` cut by the segments it meets, as (segment, global
    lo, global hi, local row of lo). `starts`: the segments' first rows (sorted, as the segments are)."""
    out, base = [], 0
    for a, b in ranges:
        seg = max(bisect.bisect_right(starts, a) - 1, 0)
        while b > a and seg < len(segments) and segments[seg][0] < b:
            lo, hi = max(a, segments[seg][0]), min(b, segments[seg][1])
            if hi > lo:
                out.append((seg, lo, hi, base + lo - a))
            seg += 1
        base += b - a
    return out


@functools.lru_cache(maxsize=64)
def ring_plan(P: int, L: int, num_heads: int, num_kv_heads: int, segment_lengths: tuple, dilation_rates: tuple,
              head_groups: str, causal: bool, layout: str, head_start: int = 0, global_heads: int = 0,
              offsets: Optional[tuple[int, ...]] = None, rank_chunks: Optional[tuple] = None) -> RingPlan:
    """The plan of `ring_attention` for a configuration (cached): local branches, head stacks of the spanning
    branches, the rows every rank sends every other, and each rank's block tasks. With `global_heads` > 0 the
    heads are the heads `[head_start, head_start + num_heads)` of a problem of that many (the 2-D mode's ring over
    one head chunk), with their global offsets. `offsets`: the cu_seqlens of packed sequences over the N = P*L rows
    (segment_ranges). `rank_chunks`: with `offsets`, each rank's ranges of the pack in its local order, in place
    of the layout's (ranks may then hold unequal numbers of rows, or none; `L` is unused): a DocumentLayout's
    shared documents."""
    if global_heads and head_groups != "all":
        # a share of "split" heads drops the branches it takes no part in, which the branch indices here count
        raise ValueError("the ring runs a share of the heads with head_groups='all' only")
    if rank_chunks is not None and offsets is None:
        raise ValueError("rank_chunks are the ranges of a pack: offsets are required")
    N = P * L if rank_chunks is None else offsets[-1]
    G = num_heads // num_kv_heads
    table = branch_table(segment_lengths, dilation_rates, N, num_heads, head_groups, head_start, global_heads)
    all_local = offsets is None and all(_is_local(br.seg_len, L, layout) for br in table)
    # Local branches run as a subset of the branch list; "split" heads depend on the whole list, so there a
    # branch is only run locally when all are.
    local = [i for i, br in enumerate(table) if offsets is None
             and _is_local(br.seg_len, L, layout) and (head_groups == "all" or all_local)]
    if rank_chunks is None:
        rank_chunks = tuple(tuple(chunks(rank, P, L, layout)) for rank in range(P))
    stacks: list[HeadStack] = []
    runs: list[list[BranchRun]] = [[] for _ in range(P)]
    for i, br in enumerate(table):
        if i in local:
            continue
        r = br.dilation
        segments = segment_ranges(br.seg_len, N, offsets)
        if head_groups == "all":  # "split" heads: a branch alone is not the op's problem of those heads
            mine, segments = _internal_runs(segments, br.seg_len, rank_chunks, r)
            for rank in range(P):
                runs[rank] += mine[rank]
        if not segments:
            continue
        starts = [a for a, _ in segments]
        pieces = [_pieces(ranges, segments, starts) for ranges in rank_chunks]
        heads_by_counts: dict = {}
        for h in range(br.head_lo, br.head_hi):
            o = br.offset(h)
            counts = tuple(tuple(_count(lo, hi, starts[seg], o, r) for seg, lo, hi, _ in own) for own in pieces)
            heads_by_counts.setdefault(counts, []).append((h, o))
        for counts, heads in heads_by_counts.items():
            listed_by_rank = []
            for rank, own in enumerate(pieces):
                start, listed = 0, []
                for n, (seg, lo, _, _) in enumerate(own):
                    count = counts[rank][n]
                    if count:
                        listed.append((seg, lo, start, start + count))
                    start += count
                listed_by_rank.append(listed)
            pairs = [(o, h // G) for h, o in heads]
            distinct = list(dict.fromkeys(pairs))
            per = len(heads) // len(distinct)
            if any(distinct.index(pr) != n // per for n, pr in enumerate(pairs)):
                distinct, per = pairs, 1  # no uniform grouping: one kv entry per query head
            stacks.append(HeadStack([h for h, _ in heads], [o for _, o in heads], [kvh for _, kvh in distinct],
                                    [o for o, _ in distinct], per, r, starts, pieces, listed_by_rank))
    needed = [[[[] for _ in stacks] for _ in range(P)] for _ in range(P)]
    tasks = [[[] for _ in range(P)] for _ in range(P)]
    for index, stack in enumerate(stacks):
        for rank in range(P):
            for src in range(P):
                _plan_rank_pair(index, stack, rank, src, causal, needed[rank][src][index], tasks[rank][src])
    for rank in range(P):
        tasks[rank][rank] = _own_segments_joined(tasks[rank][rank])
    # A task against received rows indexes the stack's received tensor: the stack's ranges one after another.
    for rank in range(P):
        for src in range(P):
            if src == rank:
                continue
            placed = []
            for ranges in needed[rank][src]:
                base, offs = 0, []
                for a, b in ranges:
                    offs.append((a, b, base))
                    base += b - a
                placed.append(offs)
            for t in tasks[rank][src]:
                a, b, off = next(rng for rng in placed[t.stack] if rng[0] <= t.kv_start and t.kv_stop <= rng[1])
                t.kv_start, t.kv_stop = off + t.kv_start - a, off + t.kv_stop - a
    return RingPlan(P, L, layout, local, stacks, needed, tasks, runs)


def _own_segments_joined(own: list[BlockTask]) -> list[BlockTask]:
    """A rank's own blocks with consecutive segments of one stack as one task (seg_len): the blocks are squares of
    equal size over consecutive rows, the last possibly smaller, as the single-device op cuts its rows into
    segments. Compacted segments within a chunk ("split" heads, whose branches have no internal runs) give them."""
    out: list[BlockTask] = []
    for t in own:
        last = out[-1] if out else None
        n = t.q_stop - t.q_start
        if last is not None and last.stack == t.stack and last.causal == t.causal and last.q_stop == t.q_start:
            size = last.seg_len or last.q_stop - last.q_start
            full = (last.q_stop - last.q_start) % size == 0  # no smaller segment has ended the run yet
            if full and n <= size:
                last.q_stop = last.kv_stop = t.q_stop
                last.seg_len = size
                continue
        out.append(t)
    return out


def _plan_rank_pair(index: int, stack: HeadStack, rank: int, src: int, causal: bool, needed: list,
                    tasks: list) -> None:
    """Append the tasks of `rank`'s queries of stack `index` against `src`'s keys to `tasks`, and the ranges of
    src's compacted rows they read to `needed` (merged)."""
    mine, theirs = stack.segments[rank], stack.segments[src]
    for seg in sorted({p[0] for p in mine}):
        queries = [p for p in mine if p[0] == seg]
        keys = [p for p in theirs if p[0] == seg]
        if not keys:
            continue
        if src == rank:  # own rows in position order: one causal (or full) square over the segment's rows
            start, stop = queries[0][2], queries[-1][3]
            tasks.append(BlockTask(index, start, stop, start, stop, causal))
            continue
        for _, global_start, q_start, q_stop in queries:
            # pieces are disjoint position ranges: a key piece is wholly before a query piece or after it
            before = [p for p in keys if not causal or p[1] < global_start]
            if before:
                kv_start, kv_stop = before[0][2], before[-1][3]
                last = tasks[-1] if tasks else None
                if (last is not None and last.stack == index and (last.kv_start, last.kv_stop) == (kv_start, kv_stop)
                        and last.q_stop == q_start):
                    last.q_stop = q_stop  # the previous query piece reads the same keys: extend it
                else:
                    tasks.append(BlockTask(index, q_start, q_stop, kv_start, kv_stop, False))
                if needed and needed[-1][1] >= kv_start:
                    needed[-1] = (needed[-1][0], max(needed[-1][1], kv_stop))
                else:
                    needed.append((kv_start, kv_stop))
    needed.sort()
    merged = []
    for a, b in needed:
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    needed[:] = merged
