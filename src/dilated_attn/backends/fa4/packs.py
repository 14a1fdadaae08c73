"""The calls of packed sequences (dilated_attention_varlen) on FlashAttention's variable-length interface: a few calls
per branch for the whole pack, not calls per sequence.

Of one branch `(w, r)`, the query heads that share an offset `o` take, in segment `[a, a + s)` of a sequence, the
rows `a + o + r*i`. Every such run of rows is one "sequence" of a varlen call over the strided view `[rows, heads,
D]` of `[T, H, D]` that starts at row `t` and steps `r` rows: the run starts at view row `(a + o - t) / r`, so the
runs of all segments of all sequences whose start `a + o` has the residue `t` modulo `r` go in one call. Segment
lengths divisible by `r` (LongNet's) keep one residue per sequence; a pack whose sequences start at multiples of
every `r` (lengths divisible by them) then takes, per branch, one call per offset group, or fewer where the groups
stack as a uniform batch's do (the cudnn plan's branch_calls): with `head_groups="all"` and fewer heads per group
than groups, the `j`-th head of every group goes in one call whose head `i` is group `i`'s, at a row shift of `i`
(head stride `(H + heads per group)*D`), where every group has the same runs, shifted by its offset; with
grouped-query heads whose groups do not map so onto kv heads, the `j`-th head of each class of groups `p, p + m, ...`
(or of each run of groups reading one kv head) goes in one call, as the cudnn plan's by_head cuts them. In a pack of
other lengths the starts take several residues, one call each (up to `r` per offset group): where that costs more
calls than copying the tensors does, the ops run on a copy with each sequence moved to a multiple of the dilations
(plan_pack).

A view's rows between the runs (other sequences' rows, or a shorter last segment's) belong to no sequence of the
call: FlashAttention then takes `seqused` (each run's length, `cu_seqlens` its start) and does not write them, so
the results there are not defined, and the ops merge and add only the runs' rows (ops.py). Its tiles do load rows
past a run's end, masked: those rows must hold finite values, which the pack's own rows do (and the moved copy's
rows between sequences copy them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from ...branches import Branch, branch_table, covers_everything, groups_stack, offset_groups
from ..views import by_head

__all__ = ["Pack", "PackCall", "PackPlan", "plan_pack", "plan_sequences"]

# FlashAttention reads cu_seqlens and seqused at 16-byte aligned addresses: each call's slice of the plan's int32
# metadata starts at a multiple of 4 values.
_ALIGN = 4


@dataclass(frozen=True)
class PackCall:
    """One varlen call: the view of rows `start + dilation*m` (`rows` of them) whose head `i` is query head `head0 +
    i*head_step` (`n_heads` of them) at rows shifted by `i*row_step` (kv heads: `kv_head0 + i*kv_head_step`, `kv_heads`
    of them), and its `count` runs, whose starts (then the end of the last) are the plan's `metadata[at : at + count
    + 1]` and lengths `metadata[at + used : at + used + count]` (`used` 0: no gaps, the starts alone define them)."""

    start: int
    dilation: int
    rows: int
    head0: int
    n_heads: int
    kv_head0: int
    kv_heads: int
    count: int
    at: int
    used: int
    longest: int
    head_step: int = 1
    row_step: int = 0
    kv_head_step: int = 1


@dataclass(frozen=True)
class PackPlan:
    """The calls of each branch, whether the first branch's calls write every (row, head) of the results once (so
    they store, and the results need no initial value), and the calls' int32 metadata (one copy to the device)."""

    calls: tuple[tuple[PackCall, ...], ...]
    first_stores: bool
    metadata: tuple[int, ...]
    # Every view's rows between its runs lie between the sequences, whose results are dropped: where each branch's
    # segments and each sequence's first row are multiples of its dilation, a sequence's rows in a view are all
    # members of one offset, so its runs meet (measured: 1.2-1.3% off a ragged pack's forward+backward on fa4,
    # benchmarks/results/varlen_NVIDIA_H200_ragged_gaps_outside_ab.json)
    gaps_outside: bool = False


def _head_runs(br: Branch, group: int) -> list[tuple[int, int, int, int, int]]:
    """(offset, first head, heads, first kv head, kv heads) of each run of query heads sharing an offset that one
    call can take: FlashAttention has query head `i` of a call read kv head `i // (heads / kv_heads)`, so a run
    whose heads do not map so onto kv heads `h // group` is cut into runs of one kv head."""
    runs = []
    for offset, h, n in offset_groups(br):
        kv0, kv_end = h // group, (h + n - 1) // group + 1
        per_kv = n // (kv_end - kv0)
        if n % (kv_end - kv0) == 0 and all((h + i) // group == kv0 + i // per_kv for i in range(n)):
            runs.append((offset, h, n, kv0, kv_end - kv0))
            continue
        for kv in range(kv0, kv_end):
            lo, hi = max(h, kv * group), min(h + n, (kv + 1) * group)
            runs.append((offset, lo, hi - lo, kv, 1))
    return runs


def _runs(br: Branch, offset: int, lengths: list[tuple[int, int]]) -> dict[int, list[tuple[int, int]]]:
    """The runs of rows of one offset group over every segment of every sequence (`(start, length)` in the pack),
    keyed by their first row's residue modulo r: `(first row, members)` each."""
    r = br.dilation
    by_residue: dict[int, list[tuple[int, int]]] = {}
    for a, n in lengths:
        s = min(br.segment_length, n)  # segments are clipped to each sequence
        for first in range(a, a + n, s):
            length = min(s, a + n - first)
            if offset < length:
                row = first + offset
                by_residue.setdefault(row % r, []).append((row, -(-(length - offset) // r)))
    return by_residue


def _stacked(br: Branch, group: int, lengths: list[tuple[int, int]]):
    """Where calls can each take the `j`-th head of several offset groups as the cudnn plan cuts them (its
    by_head: head `t` of a call that of group `first + t*step`, at a row shift of `t*step`, with its kv heads): the
    residue and runs of the first group, which every group has shifted by its offset, that group's offset, and the
    calls (their `first_row` the offset of their first group); else None. It needs groups that stack
    (branches.groups_stack) and a cut of fewer calls than one per group whose heads map onto kv heads."""
    groups = offset_groups(br)
    offset = groups[0][0]
    # one segment of one member from row 0: the calls' rows are their first groups' offsets
    calls = by_head(0, 1, 0, 1, br.dilation, groups, group) if groups_stack(groups) else None
    if calls is None:
        return None
    first = _runs(br, offset, lengths)
    if len(first) != 1:
        return None
    (t, runs), = first.items()
    for i in range(1, len(groups)):
        shifted = sorted(run for same in _runs(br, offset + i, lengths).values() for run in same)
        if shifted != [(row + i, m) for row, m in runs]:
            return None
    return t, runs, offset, calls


def plan_sequences(sequences: tuple[tuple[int, int], ...], total: int, segment_lengths: tuple[int, ...],
              dilation_rates: tuple[int, ...], heads: int, kv_heads: int, split_heads: bool, head_start: int = 0,
              global_heads: int = 0) -> PackPlan:
    """The calls of sequences `(start, length)` (in order, apart or not) in tensors of `total` rows; the heads are
    those `[head_start, head_start + heads)` of a problem of `global_heads` (branches.branch_table)."""
    lengths = [(a, n) for a, n in sequences if n > 0]
    longest = max((n for _, n in lengths), default=0)
    if not lengths:
        return PackPlan((), False, ())
    table = branch_table(list(segment_lengths), list(dilation_rates), longest, heads,
                         "split" if split_heads else "all", head_start, global_heads)
    metadata: list[int] = []

    def call_fields(t: int, r: int, rows: int, runs: list[tuple[int, int]]) -> dict:
        """The metadata of runs `(first row, members)` in the view of `rows` rows from row `t`, `r` apart: the
        PackCall fields it gives."""
        starts = [(row - t) // r for row, _ in runs]
        counts = [m for _, m in runs]
        gapless = starts[0] == 0 and starts[-1] + counts[-1] == rows and all(
            a + m == b for a, m, b in zip(starts, counts, starts[1:]))
        at = len(metadata)
        metadata.extend(starts + [starts[-1] + counts[-1]])
        used = 0
        if not gapless:
            metadata.extend([0] * (-len(metadata) % _ALIGN))
            used = len(metadata) - at
            metadata.extend(counts)
        metadata.extend([0] * (-len(metadata) % _ALIGN))
        return dict(start=t, dilation=r, rows=rows, count=len(runs), at=at, used=used, longest=max(counts))

    branches = []
    for br in table:
        r = br.dilation
        calls = []
        stacked = _stacked(br, heads // kv_heads, lengths)
        if stacked is not None:
            t, runs, offset, stacked_calls = stacked
            wheres = {}
            for c in stacked_calls:
                # the call's first group: its runs those of the first group, `shift` rows further
                shift, n, step = c.first_row - offset, c.n_heads, c.row_step
                if (shift, n, step) not in wheres:
                    # its view; the last head's view, `(n - 1)*step` rows further still, stays inside the tensors
                    wheres[shift, n, step] = call_fields(t + shift, r, (total - 1 - t - shift - (n - 1) * step) // r
                                                         + 1, [(row + shift, m) for row, m in runs])
                calls.append(PackCall(head0=c.head0, n_heads=n, kv_head0=c.kv_head0, kv_heads=c.kv_heads,
                                      head_step=c.head_step, row_step=step, kv_head_step=c.kv_head_step,
                                      **wheres[shift, n, step]))
        else:
            for offset, head0, n_heads, kv_head0, n_kv in _head_runs(br, heads // kv_heads):
                for t, runs in sorted(_runs(br, offset, lengths).items()):
                    where = call_fields(t, r, (total - 1 - t) // r + 1, runs)
                    calls.append(PackCall(head0=head0, n_heads=n_heads, kv_head0=kv_head0, kv_heads=n_kv, **where))
        branches.append(tuple(calls))
    gaps_outside = all(br.segment_length % br.dilation == 0 and all(a % br.dilation == 0 for a, _ in lengths)
                       for br in table)
    return PackPlan(tuple(branches), bool(table) and covers_everything(table[0], heads), tuple(metadata), gaps_outside)


@dataclass(frozen=True)
class Pack:
    """How the ops run a pack: its plan, and where it runs on a copy of the tensors with every sequence moved to a
    multiple of every dilation (`starts`, in `total` rows), the new first rows."""

    plan: PackPlan
    starts: Optional[tuple[int, ...]]
    total: int


# Moving the sequences costs a copy of each tensor in and of each result out, about what this many calls cost in host
# time (an H200: a varlen call takes 122 us of host time; the copies of a pack of 64K tokens, H = 16, D = 128, 0.54 ms
# in the forward): a pack is moved where that saves more calls than this.
MOVE_SAVES_CALLS = 4


def _calls(plan: PackPlan) -> int:
    return sum(len(calls) for calls in plan.calls)


def plan_pack(offsets: tuple[int, ...], segment_lengths: tuple[int, ...], dilation_rates: tuple[int, ...],
              heads: int, kv_heads: int, split_heads: bool, head_start: int = 0, global_heads: int = 0) -> Pack:
    """The calls of a pack with these `offsets` (cu_seqlens' values, checked): in place, or, where the sequences'
    starts have several residues modulo the dilations (one call each) and moving them saves calls, on the moved
    copy. (ops._planned keeps the plans it makes.)"""
    lengths = [b - a for a, b in zip(offsets, offsets[1:])]
    args = (segment_lengths, dilation_rates, heads, kv_heads, split_heads, head_start, global_heads)
    here = plan_sequences(tuple(zip(offsets, lengths)), offsets[-1], *args)
    step = math.lcm(*dilation_rates)
    starts, total = [], 0
    for n in lengths:
        starts.append(total)
        total += -(-n // step) * step
    if starts == list(offsets[:-1]) or total > 2 * offsets[-1]:
        return Pack(here, None, offsets[-1])
    moved = plan_sequences(tuple(zip(starts, lengths)), total, *args)
    if _calls(here) <= _calls(moved) + MOVE_SAVES_CALLS:
        return Pack(here, None, offsets[-1])
    return Pack(moved, tuple(starts), total)
