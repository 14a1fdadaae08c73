"""The branch table (dilated_attn.branches) against the spec's own words (docs/SPEC.md, "Which keys a query sees"),
head by head: which heads take part in each branch and with which offset, for both head groupings, and for a share
of the heads (the ring's head-parallel modes), which keeps its global offsets or is refused."""

import math
import random

import pytest

from dilated_attn.branches import branch_table, covers_everything, split_group_bounds


def _spec_heads(segment_lengths, dilation_rates, heads, head_groups):
    """Per branch, {head: offset} of the heads that take part, written from the spec's formulas."""
    m = len(segment_lengths)
    out = []
    for i, r in enumerate(dilation_rates):  # the segment lengths decide membership by position, not by head
        if head_groups == "all":
            out.append({h: h // math.ceil(heads / r) for h in range(heads)})
        else:
            sizes = [heads // m + (1 if g < heads % m else 0) for g in range(m)]
            lo = sum(sizes[:i])
            out.append({h: i % r for h in range(lo, lo + sizes[i])})
    return out


def _table_heads(table, heads):
    return [{h: br.offset(h) for h in range(heads) if br.head_lo <= h < br.head_hi} for br in table]


CONFIGS = [([8, 16], [1, 2], 32, 8), ([2048, 4096, 8192], [1, 2, 4], 8192, 16), ([5, 7, 100], [2, 3, 5], 37, 6),
           ([16], [3], 16, 4), ([4, 8, 16, 32], [1, 2, 4, 8], 20, 5), ([64], [32], 64, 3)]


@pytest.mark.parametrize("head_groups", ["all", "split"])
@pytest.mark.parametrize("config", CONFIGS)
def test_heads_and_offsets_are_the_spec(config, head_groups):
    segs, dils, n, heads = config
    table = branch_table(segs, dils, n, heads, head_groups)
    assert [br.seg_len for br in table] == [min(w, n) for w in segs]  # a segment longer than N is clipped
    assert [(br.segment_length, br.dilation) for br in table] == list(zip(segs, dils))
    assert _table_heads(table, heads) == _spec_heads(segs, dils, heads, head_groups)


def test_random_configurations_are_the_spec():
    rng = random.Random(5)
    for _ in range(300):
        m = rng.randint(1, 4)
        heads = rng.randint(1, 24)
        segs, dils = [rng.randint(1, 64) for _ in range(m)], [rng.randint(1, 12) for _ in range(m)]
        for head_groups in ("all", "split") if heads >= m else ("all",):
            table = branch_table(segs, dils, rng.randint(1, 80), heads, head_groups)
            assert _table_heads(table, heads) == _spec_heads(segs, dils, heads, head_groups), (segs, dils, heads)


def test_split_groups_hold_the_extra_heads_first():
    assert [split_group_bounds(10, 4, g) for g in range(4)] == [(0, 3), (3, 6), (6, 8), (8, 10)]
    assert [split_group_bounds(4, 4, g) for g in range(4)] == [(0, 1), (1, 2), (2, 3), (3, 4)]


@pytest.mark.parametrize("head_groups", ["all", "split"])
def test_a_share_of_the_heads_keeps_its_global_offsets(head_groups):
    """Heads [start, start + n) of a problem of `total` heads: each keeps the offset of its global index; a branch
    none of them takes part in ("split") is left out."""
    segs, dils, total = [64, 128, 256, 512], [1, 2, 4, 8], 16
    whole = _spec_heads(segs, dils, total, head_groups)
    for n in (4, 8):
        for start in range(0, total, n):
            table = branch_table(segs, dils, 512, n, head_groups, head_start=start, global_heads=total)
            want = [{h - start: o for h, o in heads.items() if start <= h < start + n} for heads in whole]
            assert _table_heads(table, n) == [w for w in want if w], (n, start)


def test_a_share_that_splits_a_run_of_one_offset_is_refused():
    # "all" with r = 2 over 16 heads: heads 0-7 offset 0, 8-15 offset 1; heads [4, 12) start inside the first run
    # and leave it, which no (head_lo, offset_div, offset_base) form holds
    with pytest.raises(ValueError, match="cannot run as one problem"):
        branch_table([64], [2], 64, 8, "all", head_start=4, global_heads=16)
    # inside one run: one offset for all of them
    table = branch_table([64], [2], 64, 4, "all", head_start=2, global_heads=16)
    assert _table_heads(table, 4) == [{0: 0, 1: 0, 2: 0, 3: 0}]


def test_covers_everything_only_for_a_dense_branch_over_every_head():
    heads = 6
    dense, dilated = branch_table([8, 8], [1, 2], 8, heads, "all")
    assert covers_everything(dense, heads) and not covers_everything(dilated, heads)
    first, _ = branch_table([8, 8], [1, 1], 8, heads, "split")
    assert not covers_everything(first, heads)  # half the heads
