"""The plan of the backends that read each branch's members as strided views (cudnn and fa4): which calls a
problem takes (`CallPlan`, planned once per problem: `view_plan`), and each call's views of given tensors, cut into
pieces (`Schedule`, once per layout). The cudnn backend's C++ loops (csrc/cuda/cudnn_steps.cpp) and the fa4
backend's Python loops run the same schedules.

A branch's members are evenly spaced rows: for offset `o`, segment `j` holds rows `j*s + o + r*i`. For a run of
heads sharing one offset they form a 4-D strided view `[segments, heads, members, D]` of `[B, N, H, D]` (row stride
`r*H*D`, segment stride `s*H*D`), which the kernels read in place, with no gather. With `head_groups="all"` the offset
grows by one per `c = ceil(H/r)` heads, so the `i`-th head of every offset group also forms one view (head stride
`(H + c)*D`), and so do all the groups of one segment (group stride `(H + c)*D`): a branch takes
`min(groups, c, segments)` calls, not one per group. Grouped-query heads (Hkv < Hq) use the kernels' own grouping
(query head `i` of a call reads kv head `i // (heads / kv_heads)` of the call's k and v views) wherever a call's heads
map so, and a call of heads at row shifts of their own that all read one kv head (Hkv = 1) gives each a view of it;
elsewhere the call is cut into runs of query heads that share one kv head and one offset.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Iterator, Optional

import torch

from ..branches import Branch, branch_table, covers_everything, groups_stack, offset_groups

__all__ = ["Call", "CallPlan", "Schedule", "VIEW_INTS", "aligned", "branch_calls", "by_head", "contiguous", "kv_sides",
           "layouts_of", "plan_of", "view_plan"]


@dataclass(frozen=True)
class Call:
    """One attention call over `n_seg` segments (`seg_rows` rows and `segment_head_step` heads apart) starting at
    row `first_row`: head `i` of the call is head `head0 + i*head_step` at row shift `i*row_step`, and its members are
    `members` rows `dilation` apart. (A call's "segments" may also be the offset groups of one segment: see
    branch_calls.) Its k and v views take `kv_heads` heads from `kv_head0`, `kv_head_step` apart (and
    `kv_segment_head_step` from one segment to the next): the call's heads in runs of `n_heads // kv_heads` share
    one."""

    first_row: int
    n_seg: int
    seg_rows: int
    members: int
    dilation: int
    head0: int
    n_heads: int
    head_step: int = 1
    row_step: int = 0
    segment_head_step: int = 0
    kv_head0: int = 0
    kv_heads: int = 0
    kv_head_step: int = 1
    kv_segment_head_step: int = 0

    def heads(self, kv: bool) -> tuple[int, int, int, int]:
        """(first head, heads, head step, head step per segment) of the query-side or the kv-side views."""
        if kv:
            return self.kv_head0, self.kv_heads, self.kv_head_step, self.kv_segment_head_step
        return self.head0, self.n_heads, self.head_step, self.segment_head_step


def _with_kv_heads(call: Call, group: int) -> Optional[Call]:
    """`call` with its kv views, where query head `h` reads kv head `h // group`; None where its heads do not map
    onto kv heads as cuDNN groups them (equal runs of query heads per kv head, evenly spaced kv heads, and the heads
    of a run reading the same rows)."""
    def kv(j: int, i: int) -> int:
        return (call.head0 + j * call.segment_head_step + i * call.head_step) // group

    first = [kv(0, i) for i in range(call.n_heads)]
    run = next((i for i, h in enumerate(first) if h != first[0]), call.n_heads)
    if call.row_step and run == call.n_heads:
        # heads at row shifts of their own cannot share a kv view head; where all read one kv head, each takes a
        # view of it at its own rows (kv head step 0)
        run = 1
    if call.n_heads % run or (run > 1 and call.row_step):
        return None
    starts = first[::run]
    step = starts[1] - starts[0] if len(starts) > 1 else 1
    seg_step = kv(1, 0) - kv(0, 0) if call.segment_head_step else 0
    if any(kv(j, i) != starts[0] + (i // run) * step + j * seg_step
           for j in range(call.n_seg if call.segment_head_step else 1) for i in range(call.n_heads)):
        return None
    return dataclasses.replace(call, kv_head0=starts[0], kv_heads=len(starts), kv_head_step=step,
                               kv_segment_head_step=seg_step)


def _group_calls(first_row: int, n_seg: int, s: int, length: int, r: int, offset: int, head0: int, n_heads: int,
                 group: int) -> list[Call]:
    """The calls of one offset group: one, or where its heads do not map onto kv heads as one call, one per run of
    heads sharing a kv head."""
    call = Call(first_row + offset, n_seg, s, -(-(length - offset) // r), r, head0, n_heads)
    whole = _with_kv_heads(call, group)
    if whole is not None:
        return [whole]
    runs = []
    for h in range(head0, head0 + n_heads):
        if h == head0 or h // group != (h - 1) // group:
            runs.append([h, 0])
        runs[-1][1] += 1
    return [dataclasses.replace(call, head0=h, n_heads=n, kv_head0=h // group, kv_heads=1) for h, n in runs]


def _mapped(calls: list[Call], group: int) -> Optional[list[Call]]:
    """`calls` with their kv views (_with_kv_heads), or None where one of them does not map onto kv heads."""
    mapped = [_with_kv_heads(c, group) for c in calls]
    return mapped if all(c is not None for c in mapped) else None


def by_head(first_row: int, n_seg: int, s: int, members: int, r: int, groups: list, group: int) -> Optional[list]:
    """Calls that each take the `i`-th head of several offset groups (head `t` of a call is that of group
    `first + t*step`, `t*step` rows further), with their kv views; None where no cut below maps onto kv heads in
    fewer calls than there are groups. All the groups in one call (step 1) where their heads map; else, with
    grouped-query heads, the fewer calls of two cuts that do: the groups in `m` interleaved classes (groups
    `p, p + m, ...`), `m` such that `m` groups' heads span whole kv heads, so each class's heads read evenly spaced
    kv heads; or runs of the groups whose heads read one kv head (kv head step 0)."""
    offset0, head_lo, size = groups[0]
    n = len(groups)
    cuts = [[(0, 1, n)]]  # (first group, step, groups) of each call per head within the groups
    if group > 1:
        m = group // math.gcd(size, group)
        cuts.append([(p, m, -(-(n - p) // m)) for p in range(min(m, n))])
        if group % size == 0:
            run = group // size
            cuts.append([(b, 1, min(run, n - b)) for b in range(0, n, run)])
    for cut in sorted(cuts, key=len):
        if size * len(cut) >= n:  # no fewer calls than one per group
            break
        calls = _mapped([Call(first_row + offset0 + first, n_seg, s, members, r, head_lo + first * size + i, count,
                              head_step=step * size, row_step=step) for i in range(size) for first, step, count in cut],
                        group)
        if calls is not None:
            return calls
    return None


def branch_calls(br: Branch, seq_len: int, group: int = 1) -> list[Call]:
    """The calls that cover branch `br` (query heads reading kv head `h // group`): the full segments, then the
    shorter last one (if any), each by offset group, unless another cut takes fewer calls where the groups allow it
    (equal groups, consecutive offsets, every offset with the same number of members, and heads that map onto kv
    heads): by head within the groups (the `i`-th head of every group and segment in one call, or of every group of
    a class: by_head), or by segment (every group of one segment in one call). Fewer calls cost less host time,
    which bounds small problems."""
    s, r = br.seg_len, br.dilation
    n_full, tail = divmod(seq_len, s)
    groups = offset_groups(br)
    size = groups[0][2]
    calls = []
    for first_row, n_seg, length in ((0, n_full, s), (n_full * s, 1, tail)):
        if n_seg == 0 or length == 0:
            continue
        stackable = len(groups) > 1 and length % r == 0 and groups_stack(groups)
        stacked = None
        if stackable and n_seg < min(size, len(groups)):
            stacked = _mapped([Call(first_row + j * s + groups[0][0], len(groups), 1, length // r, r, br.head_lo, size,
                                    segment_head_step=size) for j in range(n_seg)], group)
        elif stackable and size < len(groups):
            stacked = by_head(first_row, n_seg, s, length // r, r, groups, group)
        if stacked is not None:
            calls += stacked
            continue
        for offset, head0, n_heads in groups:
            if offset < length:
                calls += _group_calls(first_row, n_seg, s, length, r, offset, head0, n_heads, group)
    return calls


def _batch_merges(call: Call, shape, stride) -> bool:
    """Batches of a `[B, N, H, ...]` layout continue its segment dimension (one view spans them)."""
    return shape[0] == 1 or (call.segment_head_step == 0 and stride[0] == call.n_seg * call.seg_rows * stride[1])


# A view as the C++ loops read it: 4 sizes, 4 strides, the storage offset (3-D views padded with size 1, stride 0).
VIEW_INTS = 9


def _geometry(call: Call, layouts: tuple, kv: tuple, limit: Optional[int]) -> Iterator[tuple]:
    """as_strided arguments (sizes, strides, offset) of the call's views `[segments, heads, members, *rest]` of
    tensors with `layouts` (shape, strides, storage offset) `[B, N, H, *rest]`, the kv-side heads where `kv` says:
    per piece, one per tensor. A piece spans all batches where every layout lets it (_batch_merges), else one batch;
    with a `limit`, pieces hold at most that many elements (whole segments, at least one)."""
    merged = all(_batch_merges(call, shape, stride) for shape, stride, _ in layouts)
    n_batch = layouts[0][0][0]
    segments = call.n_seg * (n_batch if merged else 1)
    size = segments
    if limit is not None:
        size = max(1, limit // (call.n_heads * call.members * layouts[0][0][-1]))
    for b in [0] if merged else range(n_batch):
        for first in range(0, segments, size):
            piece = []
            for (shape, (sb, sn, sh, *rest), offset), kv_side in zip(layouts, kv):
                head0, n_heads, head_step, segment_head_step = call.heads(kv_side)
                strides = (call.seg_rows * sn + segment_head_step * sh, call.row_step * sn + head_step * sh,
                           call.dilation * sn, *rest)
                start = offset + b * sb + call.first_row * sn + head0 * sh + first * strides[0]
                piece.append(((min(size, segments - first), n_heads, call.members, *shape[3:]), strides, start))
            yield tuple(piece)


_KV_SIDE = frozenset(("k", "v", "grad_k", "grad_v", "grad_kv"))


@functools.lru_cache(maxsize=None)
def kv_sides(names: str) -> tuple[bool, ...]:
    """For a loop's tensors named in order (space-separated), which take the calls' kv-side views: k, v and their
    gradients (`grad_kv`: one layout for both). Written where the loop's tensors are listed, so that each loop's
    order is read in one place."""
    return tuple(name in _KV_SIDE for name in names.split())


def layouts_of(*tensors: torch.Tensor) -> tuple:
    return tuple((tuple(x.shape), x.stride(), x.storage_offset()) for x in tensors)


def contiguous(*shapes) -> tuple:
    """The layouts of fresh contiguous tensors of `shapes`: the results the loops return."""
    return tuple((tuple(shape), torch.empty(shape, device="meta").stride(), 0) for shape in shapes)


def _packed(view: tuple) -> list[int]:
    sizes, strides, start = view
    pad = 4 - len(sizes)  # the LSE's views are 3-D
    return [*sizes, *(1,) * pad, *strides, *(0,) * pad, start]


@dataclass(frozen=True)
class Schedule:
    """The steps of one C++ loop (`cudnn_forward_steps`, `cudnn_backward_steps`) over given tensors: one int64 row
    per step (a piece of a call) holding the step's view of each tensor, VIEW_INTS each, and how many leading steps
    store their results rather than merge or add them. The one definition of the format: `views` reads it back."""

    steps: torch.Tensor
    stored: int

    def views(self, *tensors: torch.Tensor) -> Iterator[list[torch.Tensor]]:
        """Each step's views of `tensors` (the loop's tensors, in its order), as the C++ loop builds them."""
        assert self.steps.shape[1] == len(tensors) * VIEW_INTS
        for row in self.steps.tolist():
            views = (row[i * VIEW_INTS:(i + 1) * VIEW_INTS] for i in range(len(tensors)))
            yield [x.as_strided(v[:x.dim()], v[4:4 + x.dim()], v[8]) for x, v in zip(tensors, views)]


@dataclass(frozen=True)
class CallPlan:
    """The calls of each branch of one problem, and whether the first branch's calls write every (row, head) of
    the results once (so they store, and the results need no initial value)."""

    calls: tuple[tuple[Call, ...], ...]
    first_stores: bool

    @functools.lru_cache(maxsize=256)
    def schedule(self, layouts: tuple, kv: tuple[bool, ...], limit: int, whole_first: bool = True,
                 stored_limit: Optional[int] = None) -> Schedule:
        """The loop's steps over tensors of `layouts` (whose views are kv-side where `kv` says): every piece of every
        call, branch after branch, pieces of at most `limit` elements (`stored_limit` where given for the steps that
        store: a backward's stored call holds less beside its results than one whose results are added), except
        (with `whole_first`) a first branch of one call that stores: it is one step, whose result the loops can take
        as the whole result without a copy. Cached: a layout's steps are planned once and run without Python (the
        small problems this backend runs are bound by the host's time per call)."""
        rows, first_branch_steps = [], 0
        for i, calls in enumerate(self.calls):
            stores = i == 0 and self.first_stores
            whole = whole_first and stores and len(calls) == 1
            piece_limit = None if whole else stored_limit if stores and stored_limit else limit
            for call in calls:
                for piece in _geometry(call, layouts, kv, piece_limit):
                    rows.append([n for view in piece for n in _packed(view)])
                    first_branch_steps += i == 0
        steps = torch.tensor(rows, dtype=torch.int64).view(len(rows), len(layouts) * VIEW_INTS)
        return Schedule(steps, first_branch_steps if self.first_stores else 0)


@functools.lru_cache(maxsize=256)
def view_plan(segment_lengths: tuple, dilation_rates: tuple, seq_len: int, heads: int, kv_heads: int,
         split_heads: bool, head_start: int = 0, global_heads: int = 0) -> CallPlan:
    table = branch_table(list(segment_lengths), list(dilation_rates), seq_len, heads, "split" if split_heads else "all",
                         head_start, global_heads)
    if not seq_len:
        return CallPlan((), False)
    calls = tuple(tuple(branch_calls(br, seq_len, heads // kv_heads)) for br in table)
    # A first branch over all heads with dilation 1 takes every (row, head) once, in calls of disjoint rows (the
    # full segments, the tail), each with all heads: every kv head's rows once too.
    return CallPlan(calls, covers_everything(table[0], heads))


def aligned(x: torch.Tensor) -> torch.Tensor:
    """`x`, or a contiguous copy where cuDNN could not read its views: cuDNN needs unit-stride rows, 16-byte
    aligned addresses and strides (head_dim % 8 == 0 makes a fresh copy's so), and no broadcast (stride 0)
    dimensions."""
    size = x.element_size()
    readable = x.stride(-1) == 1 and x.data_ptr() % 16 == 0 and all(
        stride * size % 16 == 0 and (stride > 0 or n == 1) for stride, n in zip(x.stride()[:-1], x.shape[:-1]))
    return x if readable else torch.empty_like(x, memory_format=torch.contiguous_format).copy_(x)


def plan_of(q, k, segment_lengths, dilation_rates, split_heads, head_start, global_heads) -> CallPlan:
    return view_plan(tuple(segment_lengths), tuple(dilation_rates), q.shape[1], q.shape[2], k.shape[2], split_heads,
                head_start, global_heads)
