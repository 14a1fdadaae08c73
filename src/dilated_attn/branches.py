"""The branch table of the spec (docs/SPEC.md, "Which keys a query sees"): which heads take part in each branch
`(w, r)`, with which offset, for both head groupings and for a share of the heads (the ring's head-parallel modes,
FlashAttention-4's packs)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

__all__ = ["Branch", "covers_everything", "offset_groups", "groups_stack", "split_group_bounds", "branch_table",
           "localize_branch"]


@dataclass(frozen=True)
class Branch:
    """One (segment length, dilation) pair resolved for a given sequence length and head count.

    Query head `h` takes part iff `head_lo <= h < head_hi`, and then uses the offset
    `offset_base + (h - head_lo) // offset_div`. Both head groupings of the spec fit this form:
    "all": every head, offset `h // ceil(Hq / r)`; "split": group `i`, offset `i % r`.
    """

    segment_length: int  # w as given
    seg_len: int  # s = min(w, N)
    dilation: int  # r
    head_lo: int
    head_hi: int
    offset_div: int
    offset_base: int

    def offset(self, head: int) -> int:
        return self.offset_base + (head - self.head_lo) // self.offset_div


def covers_everything(br: Branch, n_heads: int) -> bool:
    """A branch with dilation 1 over all heads has every (head, position) as a member of some segment."""
    return br.dilation == 1 and br.head_lo == 0 and br.head_hi == n_heads


def offset_groups(br: Branch) -> list[tuple[int, int, int]]:
    """(offset, first head, heads) of each run of heads that share an offset (runs of `offset_div` heads)."""
    return [(br.offset(h), h, min(br.offset_div, br.head_hi - h)) for h in range(br.head_lo, br.head_hi, br.offset_div)]


def groups_stack(groups: list[tuple[int, int, int]]) -> bool:
    """Offset groups of equal size at consecutive offsets: the `i`-th head of every group is one strided view (head
    `j` of the view is group `j`'s, one row further than the one before), so one call can take them."""
    offset, head0, size = groups[0]
    return all(g == (offset + j, head0 + j * size, size) for j, g in enumerate(groups))


def split_group_bounds(num_heads: int, num_groups: int, group: int) -> tuple[int, int]:
    """Head range [lo, hi) of `group` when `num_heads` heads are cut into `num_groups` contiguous groups,
    the first `num_heads % num_groups` groups holding one head more."""
    base, extra = divmod(num_heads, num_groups)
    lo = group * base + min(group, extra)
    return lo, lo + base + (1 if group < extra else 0)


def branch_table(
    segment_lengths: Sequence[int], dilation_rates: Sequence[int], seq_len: int, num_heads: int, head_groups: str,
    head_start: int = 0, global_heads: int = 0,
) -> list[Branch]:
    """The branches for `num_heads` query heads. With `global_heads` > 0 these heads are the heads
    `[head_start, head_start + num_heads)` of a problem of `global_heads` heads (a rank's share in the head-parallel
    ring modes): each keeps the offsets of its global index, written in local head indices (localize_branch), and a
    branch in which none of them takes part ("split") is left out, as csrc/checks.h leaves it out."""
    total = global_heads or num_heads
    m = len(segment_lengths)
    table = []
    for i, (w, r) in enumerate(zip(segment_lengths, dilation_rates)):
        s = max(min(w, seq_len), 1)  # N = 0: no position, any s >= 1 will do
        if head_groups == "all":
            table.append(Branch(w, s, r, 0, total, -(-total // r), 0))
        else:
            lo, hi = split_group_bounds(total, m, i)
            table.append(Branch(w, s, r, lo, hi, max(total, 1), i % r))
    if total == num_heads and head_start == 0:
        return table
    local = (localize_branch(br, head_start, num_heads) for br in table)
    return [br for br in local if br.head_hi > br.head_lo]


def localize_branch(br: Branch, head_start: int, num_heads: int) -> Branch:
    """`br` restricted to the heads `[head_start, head_start + num_heads)`, renumbered from 0, offsets unchanged.
    The Branch form holds it where the first of these heads begins a run of heads sharing an offset, or where all
    of them share one; elsewhere ValueError (a head split a kernel could not run). No head of the range: an empty
    branch (head_lo == head_hi)."""
    lo, hi = max(br.head_lo, head_start), min(br.head_hi, head_start + num_heads)
    if lo >= hi:
        return dataclasses.replace(br, head_lo=0, head_hi=0, offset_div=1, offset_base=0)
    into_run = (lo - br.head_lo) % br.offset_div
    if into_run == 0:
        div = br.offset_div
    elif hi - lo <= br.offset_div - into_run:
        div = max(num_heads, 1)  # one offset for every head of the range
    else:
        raise ValueError(
            f"heads [{head_start}, {head_start + num_heads}) cannot run as one problem: branch "
            f"(w={br.segment_length}, r={br.dilation}) gives runs of {br.offset_div} heads one offset, and the range "
            f"starts inside a run and leaves it (choose a head count per rank that is a multiple of "
            f"ceil(heads / r) or divides it)")
    return Branch(br.segment_length, br.seg_len, br.dilation, lo - head_start, hi - head_start, div, br.offset(lo))
