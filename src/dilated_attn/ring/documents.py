"""Packed documents placed whole across the ranks: the layout `place_documents` makes, and how a call runs it.

Cut by rows, a pack of documents (each attending only within itself) puts most documents across two ranks, and
every segment that crosses travels. Placed instead, each document stays whole on one rank: the ranks are balanced by
the documents' attention work (the query-key pairs of their dilated, causal segments and a cost per row, not their
tokens), and a
document that stays on one rank moves no byte and runs in one packed call (the backend's varlen kernels) with the
rank's other documents. Only a document whose work exceeds a rank's share is cut:

* where every branch's segments allow it, at multiples of every segment length from the document's start: no segment
  crosses such a cut, so the pieces are documents of their own, placed like the others;
* else (dense attention, or a segment as long as the document) into equal parts on the least-loaded ranks (for
  causal attention two chunks a rank, the first and the mirrored last, as "zigzag" does), which run it as a ring
  among themselves (plan.ring_plan over the ranks' chunks of these shared documents); no other rank takes part.

A rank's rows are its documents and pieces in pack order, then its parts of shared documents in pack order.
`shard(x, layout=...)` and `unshard` apply the layout to any per-row tensor (labels, positions); modes.py runs a
call under it (run_documents).
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
import zlib
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from ..spec import Problem, check_offsets, host_offsets

__all__ = ["DocumentLayout", "place_documents", "document_work", "ROW_COST", "shard_documents", "unshard_documents"]


@dataclass(frozen=True, eq=False)  # compared and hashed by identity: kept plans key on it
class DocumentLayout:
    """Where each row of a pack lives on P ranks (place_documents makes it; every field is the same on every rank).

    rows[j]: the pack's row ranges [a, b) rank j holds, in its local order. Its first local_offsets[j][-1] rows are
    whole documents and pieces cut where no segment crosses, `local_offsets[j]` their offsets (the rank's own
    cu_seqlens); the rest are its parts of the shared documents, which are the pack `shared_offsets` (those
    documents one after another), of which rank j holds the ranges `shared_chunks[j]`. `work[j]`: the work of rank j
    (document_work, in query-key pairs a head)."""

    P: int
    offsets: tuple[int, ...]
    segment_lengths: Optional[tuple[int, ...]]
    dilation_rates: Optional[tuple[int, ...]]
    causal: bool
    rows: tuple[tuple[tuple[int, int], ...], ...]
    local_offsets: tuple[tuple[int, ...], ...]
    shared_offsets: tuple[int, ...]
    shared_chunks: tuple[tuple[tuple[int, int], ...], ...]
    work: tuple[float, ...]
    cut: int  # documents cut into pieces of their own
    _tensors: dict = field(default_factory=dict, repr=False)  # (what, device) -> offsets as a tensor there

    @property
    def total(self) -> int:
        """The pack's rows."""
        return self.offsets[-1]

    def length(self, rank: int) -> int:
        """Rank `rank`'s rows."""
        return sum(b - a for a, b in self.rows[rank])

    def own_rows(self, rank: int) -> int:
        """Rank `rank`'s rows of whole documents and pieces: its first rows."""
        return self.local_offsets[rank][-1]

    @property
    def shared(self) -> int:
        """The rows of shared documents (cut across ranks that run them as a ring)."""
        return self.shared_offsets[-1]

    def offsets_tensor(self, what: str, rank: int, device) -> torch.Tensor:
        """local_offsets[rank] ("local") or shared_offsets ("shared") as an int32 tensor on `device`, made once:
        the calls of every layer read one tensor, whose values the host reads once (spec.host_offsets)."""
        key = (what, rank, torch.device(device))
        if key not in self._tensors:
            values = self.local_offsets[rank] if what == "local" else self.shared_offsets
            self._tensors[key] = torch.tensor(values, dtype=torch.int32, device=device)
        return self._tensors[key]

    @property
    def digest(self) -> int:
        """A checksum of the placement, the same on every rank that made the same layout."""
        return zlib.crc32(repr((self.P, self.offsets, self.segment_lengths, self.dilation_rates, self.rows,
                                self.local_offsets, self.shared_chunks)).encode())

    def __repr__(self) -> str:
        documents = sum(b > a for a, b in zip(self.offsets, self.offsets[1:]))
        mean = sum(self.work) / self.P
        balance = max(self.work) / mean if mean else 1.0
        return (f"DocumentLayout(P={self.P}, {self.total} rows, {documents} documents, {self.cut} cut into pieces of "
                f"their own, {self.shared} rows shared by rings; rows per rank "
                f"{[self.length(j) for j in range(self.P)]}, work per rank "
                f"{[f'{w:.3g}' for w in self.work]}: the busiest at {balance:.3f}x the mean)")


# What a row costs in each branch beside its query-key pairs, in pairs: the passes over every row that do not grow
# with the segment (a kernel's work per query tile, the merges, the gathers of a packed call). Two placements of
# bench_ring.py's documents preset on two H200s under fa4, forward+backward: with pairs alone, ranks of equal pairs
# took 40.3 and 43.8 ms (the second 32558 rows more); with 870 pairs a row and branch, the rank of 3.2e7 more pairs
# and 9200 fewer rows took 1.0 ms more (42.9 against 41.9). So a row took 0.109 us and a pair (counted for one
# head) 62.5 ps: a row costs about 1740 pairs, 435 a branch (4 branches).
ROW_COST = 435


def document_work(n: int, segment_lengths: Optional[Sequence[int]], dilation_rates: Optional[Sequence[int]],
                  causal: bool) -> float:
    """The work of a document of n rows for one head, in query-key pairs: over every branch, each segment's members
    (one in r) against each other (the lower triangle where causal), plus ROW_COST pairs for each row. Dense
    attention (no branches): one segment."""
    branches = [(n, 1)] if segment_lengths is None else list(zip(segment_lengths, dilation_rates))
    total = float(ROW_COST * n * len(branches))
    for w, r in branches:
        s = max(min(w, n), 1)
        full, rest = divmod(n, s)
        for length, count in ((s, full), (rest, 1)):
            m = -(-length // r)
            total += count * (m * (m + 1) / 2 if causal else float(m * m))
    return total


def _cut_step(n: int, segment_lengths: Optional[Sequence[int]]) -> int:
    """The step of the cuts inside a document of n rows that no segment of any branch crosses (n or more: none)."""
    if segment_lengths is None:
        return n
    step = 1
    for w in segment_lengths:
        step = math.lcm(step, min(w, n))
    return step


def _group_size(group) -> int:
    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise ValueError("group was given, but torch.distributed is not initialised (init_process_group)")
        return 1
    if not (group is None or isinstance(group, dist.ProcessGroup)):
        raise TypeError(f"group must be a torch.distributed.ProcessGroup or None (a DocumentLayout runs on one "
                        f"group), got {type(group).__name__}")
    return dist.get_world_size(group)


def place_documents(cu_seqlens, segment_lengths: Optional[Sequence[int]] = None,
                    dilation_rates: Optional[Sequence[int]] = None, *, causal: bool = False, group=None,
                    num_ranks: Optional[int] = None) -> DocumentLayout:
    """Place the documents of a pack on the ranks of `group` (or on `num_ranks` ranks), whole where they fit.

    Args:
        cu_seqlens: the pack's offsets `[S + 1]` (a tensor, read once on the host, or a sequence of ints), as
            `dilated_attention_varlen` takes them.
        segment_lengths, dilation_rates: the branches the calls will use (None, None: dense attention); they decide
            each document's work and where it can be cut without a transfer.
        causal: whether the calls are causal (the work of each document).
        group: the ProcessGroup the calls use (None: the default group); `num_ranks` instead places for that many
            ranks without one (a data loader's process, a test).

    Returns:
        A DocumentLayout, the same on every rank for the same arguments: `shard(x, layout=layout)` cuts a pack's
        per-row tensor (q, k, v, labels) for this rank, `ring_attention(q, k, v, segment_lengths, dilation_rates,
        layout=layout)` runs on those shards, `unshard` gathers them back. `print()` it for its balance.
    """
    if num_ranks is not None:
        if isinstance(num_ranks, bool) or not isinstance(num_ranks, int) or num_ranks < 1:
            raise ValueError(f"num_ranks must be an int >= 1, got {num_ranks!r}")
        if group is not None:
            raise ValueError("place_documents takes group or num_ranks, not both")
        P = num_ranks
    else:
        P = _group_size(group)
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.dtype not in (torch.int32, torch.int64) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
            raise ValueError(f"cu_seqlens must be a 1-D int32 or int64 tensor of S + 1 >= 1 offsets, got "
                             f"{cu_seqlens.dtype} of shape {tuple(cu_seqlens.shape)}")
        offsets = list(host_offsets(cu_seqlens))
    elif isinstance(cu_seqlens, Sequence) and not isinstance(cu_seqlens, (str, bytes)) and len(cu_seqlens) > 0 \
            and all(isinstance(x, int) and not isinstance(x, bool) for x in cu_seqlens):
        offsets = [int(x) for x in cu_seqlens]
    else:
        raise TypeError("cu_seqlens must be a tensor or a non-empty sequence of int offsets")
    check_offsets(offsets, offsets[-1], None)
    if (segment_lengths is None) != (dilation_rates is None):
        raise ValueError("segment_lengths and dilation_rates must both be None (dense attention) or both be given")
    # the spec's rules for the branches and causal (the errors dilated_attention raises)
    Problem.from_sizes(1, max(offsets[-1], 1), 1, 1, 1, segment_lengths or [1], dilation_rates or [1],
                       dtype=torch.float32, device="cpu", causal=causal)
    w = None if segment_lengths is None else tuple(int(x) for x in segment_lengths)
    r = None if dilation_rates is None else tuple(int(x) for x in dilation_rates)
    return _place(P, tuple(offsets), w, r, causal)


def _place(P: int, offsets: tuple[int, ...], w, r, causal: bool) -> DocumentLayout:
    def cost(n: int) -> float:
        return document_work(n, w, r, causal)

    documents = [(a, b) for a, b in zip(offsets, offsets[1:]) if b > a]
    share = sum(cost(b - a) for a, b in documents) / P
    alone, shared, cut = [], [], 0  # (work, start, stop) and, shared, the ranks that share it
    for a, b in documents:
        n, work = b - a, cost(b - a)
        # the ranks a shared document would take: a share of work each, and a row for each of their chunks
        ranks = min(P, math.ceil(work / share) if share else 1, n // 2 if causal else n)
        if ranks <= 1:
            alone.append((work, a, b))
            continue
        step = _cut_step(n, w)
        if step >= n:
            shared.append((work, a, b, ranks))
            continue
        # pieces of about half a share (a multiple of the step), so that they pack as well as small documents do
        size = step * max(1, math.ceil(n / math.ceil(2 * work / share) / step))
        alone += [(cost(min(c + size, b) - c), c, min(c + size, b)) for c in range(a, b, size)]
        cut += 1
    load = [0.0] * P
    mine: list[list] = [[] for _ in range(P)]  # per rank: (start, stop) of its documents and pieces
    parts: list[list] = [[] for _ in range(P)]  # per rank: (start, stop) of its parts of shared documents
    for work, a, b, g in sorted(shared, key=lambda x: (-x[0], x[1])):
        ranks = sorted(sorted(range(P), key=lambda j: (load[j], j))[:g])
        pieces = 2 * g if causal else g
        bounds = [a + (b - a) * c // pieces for c in range(pieces + 1)]
        for i, j in enumerate(ranks):
            load[j] += work / g
            chunks = (i, pieces - 1 - i) if causal else (i,)
            parts[j] += [(bounds[c], bounds[c + 1]) for c in chunks if bounds[c + 1] > bounds[c]]
    heap = [(load[j], j) for j in range(P)]
    heapq.heapify(heap)
    placed: list[list] = [[] for _ in range(P)]  # per rank: (work, start, stop) of its documents and pieces
    for work, a, b in sorted(alone, key=lambda x: (-x[0], x[1])):  # the largest first, each to the least loaded
        least, j = heapq.heappop(heap)
        placed[j].append((work, a, b))
        heapq.heappush(heap, (least + work, j))
        load[j] += work
    _rebalance(placed, load)
    for j in range(P):
        mine[j] = [(a, b) for _, a, b in placed[j]]
    shared_docs = sorted((a, b) for _, a, b, _ in shared)
    shared_offsets = [0]
    for a, b in shared_docs:
        shared_offsets.append(shared_offsets[-1] + b - a)
    starts = [a for a, _ in shared_docs]

    def in_shared(a: int, b: int) -> tuple[int, int]:
        d = bisect.bisect_right(starts, a) - 1
        base = shared_offsets[d] - shared_docs[d][0]
        return a + base, b + base

    rows, local_offsets, shared_chunks = [], [], []
    for j in range(P):
        own, theirs = sorted(mine[j]), sorted(parts[j])
        ranges: list[tuple[int, int]] = []
        for a, b in own + theirs:
            if ranges and ranges[-1][1] == a:
                ranges[-1] = (ranges[-1][0], b)
            else:
                ranges.append((a, b))
        rows.append(tuple(ranges))
        local_offsets.append((0, *itertools.accumulate(b - a for a, b in own)))
        shared_chunks.append(tuple(in_shared(a, b) for a, b in theirs))
    return DocumentLayout(P, offsets, w, r, causal, tuple(rows), tuple(local_offsets), tuple(shared_offsets),
                          tuple(shared_chunks), tuple(load), cut)


def _rebalance(placed: list[list], load: list[float], rounds: int = 64, most_items: int = 512) -> None:
    """Lower the busiest rank's load after the largest-first placement by moving one of its documents to another
    rank, or swapping one for a lighter one there, while that lowers it (in place; a few rounds, and only for
    packs of at most `most_items` documents, where each round's pairs stay few)."""
    if sum(len(x) for x in placed) > most_items:
        return
    for _ in range(rounds):
        top = max(range(len(load)), key=lambda j: (load[j], -j))
        best = None  # (the pair's new max, rank, item of top, item of the other rank or None)
        for j in range(len(load)):
            if j == top:
                continue
            for i, x in enumerate(placed[top]):
                for m, y in [(None, None), *enumerate(placed[j])]:
                    delta = x[0] - (0.0 if y is None else y[0])
                    if delta <= 0:
                        continue
                    after = max(load[top] - delta, load[j] + delta)
                    if after < load[top] * (1 - 1e-9) and (best is None or after < best[0]):
                        best = (after, j, i, m)
        if best is None:
            return
        _, j, i, m = best
        x = placed[top].pop(i)
        y = None if m is None else placed[j].pop(m)
        placed[j].append(x)
        load[j] += x[0] - (0.0 if y is None else y[0])
        load[top] -= x[0] - (0.0 if y is None else y[0])
        if y is not None:
            placed[top].append(y)


def shard_documents(x: torch.Tensor, layout: DocumentLayout, rank: int, dim: int) -> torch.Tensor:
    """Rank `rank`'s rows of `x` (the whole pack along `dim`) under `layout`, a copy."""
    if x.shape[dim] != layout.total:
        raise ValueError(f"x: the pack's rows along dim {dim} must be the layout's {layout.total}, got "
                         f"{x.shape[dim]} (a pack [T, H, D] is cut along dim=0)")
    pieces = [x.narrow(dim, a, b - a) for a, b in layout.rows[rank]]
    if not pieces:
        return x.narrow(dim, 0, 0).clone()
    return torch.cat(pieces, dim).contiguous()


def unshard_documents(x: torch.Tensor, layout: DocumentLayout, group, rank: int, dim: int) -> torch.Tensor:
    """The whole pack from every rank's rows `x` under `layout` (all-gathered over `group`; no gradient)."""
    if x.shape[dim] != layout.length(rank):
        raise ValueError(f"x: rank {rank} holds {layout.length(rank)} rows of the layout along dim {dim}, got "
                         f"{x.shape[dim]}")
    most = max(layout.length(j) for j in range(layout.P))
    padded = x.new_zeros((*x.shape[:dim], most, *x.shape[dim + 1:]))
    padded.narrow(dim, 0, x.shape[dim]).copy_(x)
    gathered = [padded]
    if layout.P > 1:
        gathered = [torch.empty_like(padded) for _ in range(layout.P)]
        dist.all_gather(gathered, padded, group=group)
    full = x.new_empty((*x.shape[:dim], layout.total, *x.shape[dim + 1:]))
    for j, part in enumerate(gathered):
        local = 0
        for a, b in layout.rows[j]:
            full.narrow(dim, a, b - a).copy_(part.narrow(dim, local, b - a))
            local += b - a
    return full
