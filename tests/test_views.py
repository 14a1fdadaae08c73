"""backends/views.py, the plan that the cudnn and fa4 backends share, plans what it planned when it was cudnn's:
each case's CallPlan and its forward Schedule over contiguous tensors hash to the digests recorded in
tests/data/strided_view_plans.json (LongNet's branches at the benchmarks' lengths, local and small branches; 16:16,
16:4, 16:1 and 8:2 heads; both head groupings; a problem's own heads and a share of twice as many)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from dilated_attn.backends import views
from dilated_attn.backends.cudnn.ops import MAX_CALL_ELEMENTS

RECORDED = json.loads((Path(__file__).parent / "data" / "strided_view_plans.json").read_text())


def digest(segment_lengths, dilation_rates, n, hq, hkv, split, head_start, global_heads) -> str:
    p = views.view_plan(tuple(segment_lengths), tuple(dilation_rates), n, hq, hkv, split, head_start, global_heads)
    d = 128 if n >= 4096 else 8
    tensors = [torch.empty(1, n, h, d, device="meta") for h in (hq, hkv, hkv)]
    layouts = views.layouts_of(*tensors) + views.contiguous((1, n, hq, d), (1, n, hq))
    s = p.schedule(layouts, views.kv_sides("q k v out lse"), MAX_CALL_ELEMENTS)
    return hashlib.sha256((repr(p) + repr(s.steps.tolist()) + repr(s.stored)).encode()).hexdigest()


def test_the_recorded_cases_are_there():
    assert len(RECORDED) == 128


@pytest.mark.parametrize("case, expected", [(r["case"], r["sha256"]) for r in RECORDED],
                         ids=[f"{r['case'][2]}-{r['case'][3]}:{r['case'][4]}-{'split' if r['case'][5] else 'all'}-"
                              f"{r['case'][6]}of{r['case'][7]}-{len(r['case'][0])}br" for r in RECORDED])
def test_plans_are_the_recorded_ones(case, expected):
    assert digest(*case) == expected
