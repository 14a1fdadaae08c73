"""The cudnn backend: its call plan and the steps it packs for the C++ loops, on CPU (the loops' ops given CPU
kernels here that keep their contract in Python, with cuDNN's attention replaced by a float64 math version), and on
the GPU, the real cuDNN and loops, against the float64 reference."""

import dataclasses
import math
import random

import pytest
import torch
from cases import make_qkv, random_case
from parity import case_inputs, math_attend, math_attend_backward, poison_allocator

import dilated_attn
from dilated_attn.backends import views as planner
from dilated_attn.backends.cudnn import ops
from dilated_attn.branches import branch_table
from dilated_attn.merge import merge_into
from dilated_attn.reference import GRADIENT_ERROR_FLOOR, allowed_error, dilated_attention_reference, max_error
from dilated_attn.spec import lse_dtype

# Random configurations: odd lengths, w > N, r > w, both head groupings, heads not divisible by r, grouped-query
# heads, causal, three memory layouts, batch 2.
CASES = [random_case(random.Random(8100 + i), max_seq=80) for i in range(40)]
LONGNET = dataclasses.replace(CASES[0], batch=2, seq_len=64, num_heads=8, num_kv_heads=8, head_dim=8,
                              segment_lengths=(16, 32, 64), dilation_rates=(1, 2, 4), head_groups="all",
                              layout="contiguous")


SEEN_VIEWS = []  # each step's input views, for tests that look at what cuDNN would read
BACKWARD_LOOPS = []  # (steps, stored steps) of each backward loop


def _forward_steps_cpu(q, k, v, steps, stored_steps, causal, scale):
    """The C++ forward loop's contract: each step's attention stored into (the first `stored_steps` steps) or merged
    into its views of the results (out [B, N, H, D], lse float32 [B, N, H])."""
    # fresh results: uninitialised where the first steps store, else (0, -inf)
    out, lse_rows = torch.empty(q.shape, dtype=q.dtype), torch.empty(q.shape[:3], dtype=lse_dtype(q.dtype))
    if stored_steps == 0:
        out.zero_()
        lse_rows.fill_(-math.inf)
    for i, (qs, ks, vs, out_view, lse_view) in enumerate(planner.Schedule(steps, stored_steps).views(
            q, k, v, out, lse_rows)):
        SEEN_VIEWS.append((qs, ks, vs))
        part_out, part_lse = math_attend(qs, ks, vs, causal, scale)
        if i < stored_steps:
            out_view.copy_(part_out)
            lse_view.copy_(part_lse)
        else:
            merge_into(out_view, lse_view, part_out, part_lse)
    return out, lse_rows


def _backward_steps_cpu(grad_out, q, k, v, out, lse_rows, steps, stored_steps, causal, scale):
    """The C++ backward loop's contract: each step's gradients stored into (the first `stored_steps` steps) or added
    to their views of the gradients (grad_q's target, then grad_k's and grad_v's)."""
    BACKWARD_LOOPS.append((steps.shape[0], stored_steps))
    new = torch.empty if stored_steps else torch.zeros
    grad_q, grad_k, grad_v = (new(shape, dtype=q.dtype) for shape in (q.shape, k.shape, k.shape))
    schedule = planner.Schedule(steps, stored_steps)
    for i, (*views, q_target, kv_target) in enumerate(schedule.views(grad_out, q, k, v, out, lse_rows, grad_q,
                                                                        grad_k)):
        SEEN_VIEWS.append(tuple(views[:5]))
        targets = (q_target, kv_target, grad_v.as_strided(kv_target.shape, kv_target.stride(),
                                                          kv_target.storage_offset()))
        for target, grad in zip(targets, math_attend_backward(*views, causal, scale)):
            target.copy_(grad) if i < stored_steps else target.add_(grad)
    return grad_q, grad_k, grad_v


@pytest.fixture
def math_loops():
    """The loops' ops on CPU tensors: their contract in Python (the compiled extension has them for CUDA only)."""
    lib = torch.library.Library("dilated_attn", "IMPL")
    lib.impl("cudnn_forward_steps", _forward_steps_cpu, "CPU")
    lib.impl("cudnn_backward_steps", _backward_steps_cpu, "CPU")
    SEEN_VIEWS.clear()
    BACKWARD_LOOPS.clear()
    yield
    lib._destroy()


def _member_pairs(c, kv: bool):
    """(row, head) of every member of call `c`, the query side's or the kv side's views."""
    head0, n_heads, head_step, segment_head_step = c.heads(kv)
    return [(c.first_row + j * c.seg_rows + i * c.row_step + m * c.dilation,
             head0 + j * segment_head_step + i * head_step)
            for j in range(c.n_seg) for i in range(n_heads) for m in range(c.members)]


@pytest.mark.parametrize("index", range(len(CASES)))
def test_calls_cover_every_member_once(index):
    case = CASES[index]
    group = case.num_heads // case.num_kv_heads
    for br in branch_table(case.segment_lengths, case.dilation_rates, case.seq_len, case.num_heads,
                           case.head_groups):
        want = {(p, h) for h in range(br.head_lo, br.head_hi) for p in range(case.seq_len)
                if (p % br.seg_len) % br.dilation == br.offset(h)}
        got = []
        for c in planner.branch_calls(br, case.seq_len, group):
            rows = _member_pairs(c, kv=False)
            # one call's members share one segment: they attend to each other only
            for j in range(c.n_seg):
                segs = {(c.first_row + j * c.seg_rows + i * c.row_step + m * c.dilation) // br.seg_len
                        for i in range(c.n_heads) for m in range(c.members)}
                assert len(segs) == 1
            # cuDNN's grouping: query head i of the call reads kv head i // (n_heads / kv_heads), at its own rows
            assert c.kv_heads >= 1 and c.n_heads % c.kv_heads == 0
            run = c.n_heads // c.kv_heads
            kv_rows = _member_pairs(dataclasses.replace(c, n_heads=c.kv_heads, row_step=c.row_step * run), kv=True)
            per_head = c.members
            for n, (row, head) in enumerate(rows):
                j, rest = divmod(n, c.n_heads * per_head)
                i, m = divmod(rest, per_head)
                kv_row, kv_head = kv_rows[(j * c.kv_heads + i // run) * per_head + m]
                assert kv_head == head // group and kv_row == row
            got += rows
        assert len(got) == len(set(got)) and set(got) == want


@pytest.mark.parametrize("kv_heads, expected", [(16, [1, 2, 4, 2, 1]), (4, [1, 2, 4, 4, 4]), (2, [1, 2, 4, 4, 2]),
                                                 (1, [1, 2, 4, 2, 1])])
def test_longnet_branches_take_few_calls(kv_heads, expected):
    # H=16, r=8: two calls (one per head within the offset groups of 2), not eight; with 4 kv heads the heads of
    # groups j and j+1 share a kv head, so each call takes every other group (4 calls); with 2 kv heads, runs of 4
    # groups whose heads read one kv head (4 calls); with one kv head, each head of the two calls reads its own view
    # of it. r=16 (groups of one head): 4 interleaved classes with 4 kv heads, 2 runs with 2.
    table = branch_table([2048, 4096, 8192, 16384, 32768], [1, 2, 4, 8, 16], 65536, 16, "all")
    assert [len(planner.branch_calls(br, 65536, 16 // kv_heads)) for br in table] == expected
    # N=16384: r=4 and r=8 have fewer segments (2, 1) than heads within a group: one call per segment
    table = branch_table([2048, 4096, 8192, 16384], [1, 2, 4, 8], 16384, 16, "all")
    assert [len(planner.branch_calls(br, 16384)) for br in table] == [1, 2, 2, 1]


def _reference_grads(q, k, v, case, grad_out, grad_lse=None):
    inputs = [x.detach().double().requires_grad_() for x in (q, k, v)]
    out, lse = dilated_attention_reference(*inputs, case.segment_lengths, case.dilation_rates, **case.kwargs())
    loss = (out * grad_out.double()).sum()
    if grad_lse is not None:
        loss = loss + (torch.where(torch.isfinite(lse), lse, 0) * grad_lse.double()).sum()
    return out, lse, torch.autograd.grad(loss, inputs)


def _cut_calls_into_pieces(monkeypatch, elements: int) -> None:
    monkeypatch.setattr(ops, "MAX_CALL_ELEMENTS", elements)
    monkeypatch.setattr(ops, "MAX_BACKWARD_CALL_ELEMENTS", elements)


def _poisoned_empty(monkeypatch):
    """torch.empty gives NaN-filled floating-point tensors: an element the loops do not write shows."""
    empty = torch.empty

    def poisoned(*args, **kwargs):
        x = empty(*args, **kwargs)
        return x.fill_(math.nan) if x.is_floating_point() else x

    monkeypatch.setattr(torch, "empty", poisoned)


def _args(case):
    return (list(case.segment_lengths), list(case.dilation_rates), case.head_groups == "split", case.causal,
            case.head_dim ** -0.5)


def _forward_backward_equal_the_reference(case, seed: int):
    """The ops' out, LSE and gradients (float64 inputs of `case`, cuDNN's contract in math) against the reference:
    returns (out, lse)."""
    q, k, v = make_qkv(case, dtype=torch.float64, seed=seed)
    torch.manual_seed(seed)
    out, lse = ops.cudnn_forward(q, k, v, *_args(case))
    grad_out = torch.randn(out.shape, dtype=torch.float64)
    ref_out, ref_lse, ref_grads = _reference_grads(q, k, v, case, grad_out)
    torch.testing.assert_close(out, ref_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-12, atol=1e-12)
    grads = ops.cudnn_backward(grad_out, None, q, k, v, out, lse, *_args(case))
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    return out, lse


@pytest.mark.parametrize("pieces", ["whole", "split"])
@pytest.mark.parametrize("index", range(len(CASES)))
def test_plan_views_and_merge_equal_the_reference(index, pieces, math_loops, monkeypatch):
    if pieces == "split":  # calls cut into pieces of a few segments
        if index % 4:
            pytest.skip("a quarter of the cases is enough")
        _cut_calls_into_pieces(monkeypatch, 64)
    _poisoned_empty(monkeypatch)
    out, lse = _forward_backward_equal_the_reference(CASES[index], seed=index)
    assert out.is_contiguous() and lse.is_contiguous()


@pytest.mark.parametrize("kv_heads", [8, 2])
@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("pieces", [None, 64])
def test_calls_by_segment_equal_the_reference(layout, causal, pieces, kv_heads, math_loops, monkeypatch):
    """Calls that take every offset group of one segment (n=80 with w=64, r=4 and 8 heads: a full segment and the
    16-row tail, one call each), over two batches that one view cannot span, whole and cut into pieces. With 2 kv
    heads the groups of one segment do not step evenly through the kv heads (heads 0-3 read kv head 0, 4-7 kv head
    1): one call per offset group then, its 2 heads sharing a kv head."""
    if pieces is not None:
        _cut_calls_into_pieces(monkeypatch, pieces)
    case = dataclasses.replace(LONGNET, seq_len=80, dilation_rates=(1, 2, 4), layout=layout, causal=causal,
                               num_kv_heads=kv_heads)
    calls = planner.branch_calls(branch_table([64], [4], 80, 8, "all")[0], 80, 8 // kv_heads)
    if kv_heads == 8:
        assert [(c.n_seg, c.n_heads, c.segment_head_step, c.kv_heads, c.kv_segment_head_step) for c in calls] == \
            [(4, 2, 2, 2, 2)] * 2
    else:
        assert [(c.n_seg, c.n_heads, c.segment_head_step, c.kv_heads) for c in calls] == [(1, 2, 0, 1)] * 8
    _forward_backward_equal_the_reference(case, seed=5)


@pytest.mark.parametrize("kv_heads", [8, 2, 1])
@pytest.mark.parametrize("causal", [False, True])
def test_calls_by_head_equal_the_reference(causal, kv_heads, math_loops, monkeypatch):
    """Calls that take the i-th head of every offset group (n=256 with w=64, r=4 and 8 heads: 4 segments, 2 heads
    in each of 4 groups, head i of a call at a row shift of i): one kv view head per query head, evenly spaced kv
    heads (8) or one kv head for all (1, kv head step 0); with 2 kv heads they are not evenly spaced (heads 0-3
    read kv head 0, 4-7 kv head 1), so each group takes a call, its 2 heads sharing a kv head."""
    case = dataclasses.replace(LONGNET, seq_len=256, num_kv_heads=kv_heads)
    calls = planner.branch_calls(branch_table([64], [4], 256, 8, "all")[0], 256, 8 // kv_heads)
    if kv_heads == 2:
        assert [(c.n_heads, c.row_step, c.kv_heads) for c in calls] == [(2, 0, 1)] * 4
    else:
        assert [(c.n_heads, c.row_step, c.kv_heads, c.kv_head_step) for c in calls] == \
            [(4, 1, 4, {8: 2, 1: 0}[kv_heads])] * 2
    _poisoned_empty(monkeypatch)
    _forward_backward_equal_the_reference(dataclasses.replace(case, causal=causal), seed=6)


@pytest.mark.parametrize("kv_heads, cut", [(4, (2, 2, 1)), (2, (1, 1, 0))])
@pytest.mark.parametrize("causal", [False, True])
def test_grouped_query_calls_by_class_equal_the_reference(causal, kv_heads, cut, math_loops, monkeypatch):
    """Groups of one head (n=256 with w=64, r=8 and 8 heads) whose heads do not step through the kv heads one by one
    in a call of every group: with 4 kv heads (groups 2j and 2j+1 share one), two calls of every other group (head
    step 2, row shift 2, kv head step 1); with 2 kv heads, two calls of the 4 groups that read one kv head (kv head
    step 0). Both cuts take 2 calls, not 8."""
    case = dataclasses.replace(LONGNET, seq_len=256, segment_lengths=(64,), dilation_rates=(8,), num_kv_heads=kv_heads,
                               causal=causal)
    calls = planner.branch_calls(branch_table([64], [8], 256, 8, "all")[0], 256, 8 // kv_heads)
    assert [(c.n_heads, c.head_step, c.row_step, c.kv_head_step) for c in calls] == [(4, *cut)] * 2
    _poisoned_empty(monkeypatch)
    _forward_backward_equal_the_reference(case, seed=7)


@pytest.mark.parametrize("kv_heads", [8, 4, 1])
def test_first_branch_stores(math_loops, monkeypatch, kv_heads):
    """LongNet branches: the first (dilation 1) call's out, and in the backward its gradients, are stored into
    uninitialised results; the later branches' calls each merge (add their gradients) once."""
    _poisoned_empty(monkeypatch)
    case = dataclasses.replace(LONGNET, num_kv_heads=kv_heads)
    p = planner.view_plan((16, 32, 64), (1, 2, 4), 64, 8, kv_heads, False)
    assert p.first_stores and len(p.calls[0]) == 1
    _forward_backward_equal_the_reference(case, seed=1)
    q, k, v = make_qkv(case, dtype=torch.float64, seed=1)
    layouts = planner.layouts_of(q, k, v) + planner.contiguous(q.shape, q.shape[:3])
    s = p.schedule(layouts, planner.kv_sides("q k v out lse"), ops.MAX_CALL_ELEMENTS)
    # r=2: one call per offset group of 4 heads; r=4: every group of the one segment in one call, per batch
    assert [len(calls) for calls in p.calls] == [1, 2, 1] and s.stored == 1 and s.steps.shape[0] == 1 + 2 + 2


def test_first_branch_in_pieces_stores_its_gradients(math_loops, monkeypatch):
    """A first branch that reaches every row once in more than one call (here: 4 full segments and a tail, cut into
    pieces of one segment) stores its results into fresh tensors: its steps come first, and the loops are told how
    many they are."""
    _cut_calls_into_pieces(monkeypatch, 64)
    _poisoned_empty(monkeypatch)
    _forward_backward_equal_the_reference(dataclasses.replace(LONGNET, seq_len=72), seed=9)
    (steps, stored), = BACKWARD_LOOPS
    assert stored == 2 * (4 + 1) and steps > stored  # 2 batches (one view cannot span them) x 5 segments


def test_views_cudnn_cannot_read_are_copied(math_loops):
    """Rows at a 4-byte offset, strides that are not multiples of 16 bytes, a broadcast gradient: cuDNN gets
    aligned, unit-stride, non-broadcast views, and the results are those of the plain inputs."""
    def readable(x):
        size = x.element_size()
        return (x.data_ptr() % 16 == 0 and x.stride(-1) == 1
                and all(s * size % 16 == 0 and s > 0 for s in x.stride()[:-1]))

    g = torch.Generator().manual_seed(4)
    shape = (2, 64, 4, 8)
    plain = [torch.randn(shape, generator=g, dtype=torch.float32) for _ in range(3)]
    shifted = torch.empty(3 * 2 * 64 * 4 * 8 + 1)[1:].view(3, *shape)  # 4 bytes past a 16-byte boundary
    shifted.copy_(torch.stack(plain))
    padded = torch.empty(2, 64, 4, 9)[..., :8]  # row stride 9 elements: not a multiple of 16 bytes
    padded.copy_(plain[2])
    args = ([16, 32], [1, 2], False, True, 8 ** -0.5)
    out, lse = ops.cudnn_forward(shifted[0], shifted[1], padded, *args)
    want_out, want_lse = ops.cudnn_forward(*plain, *args)
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
    grad_out = torch.ones(1, 1, 1, 8).expand(shape)  # broadcast: stride 0
    got = ops.cudnn_backward(grad_out, None, shifted[0], shifted[1], padded, out, lse, *args)
    want = ops.cudnn_backward(grad_out.contiguous(), None, *plain, out, lse, *args)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert SEEN_VIEWS and all(readable(x) for views in SEEN_VIEWS for x in views)


def test_backward_op_refuses_an_lse_gradient():
    q, k, v = make_qkv(LONGNET, dtype=torch.float64, seed=2)
    with pytest.raises(ValueError, match="takes no LSE gradient"):
        ops.cudnn_backward(q, torch.zeros(2, 8, 64, dtype=torch.float64), q, k, v, q, q[..., 0], *_args(LONGNET))


@pytest.mark.parametrize("kv_heads", [8, 2])
def test_lse_gradient_runs_another_backward(math_loops, kv_heads):
    """A loss that uses the LSE: autograd runs the backward of the backend dispatch names (on CPU the cpu one), and
    the gradients are exact; explain() names it."""
    case = dataclasses.replace(LONGNET, num_kv_heads=kv_heads, causal=True)
    q, k, v = (x.requires_grad_() for x in make_qkv(case, dtype=torch.float64, seed=2))
    out, lse = ops.cudnn_forward(q, k, v, *_args(case))
    grad_out, grad_lse = torch.randn_like(out), torch.randn_like(lse)
    grads = torch.autograd.grad((out * grad_out).sum() + (lse * grad_lse).sum(), (q, k, v))
    _, _, want = _reference_grads(q, k, v, case, grad_out, grad_lse)
    for a, b in zip(grads, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    from dilated_attn import dispatch
    from dilated_attn.spec import validate

    p = validate(q, k, v, case.segment_lengths, case.dilation_rates, causal=True)
    rule = dilated_attn.backends.CUDNN.backward_op.lse_gradient_rule
    assert dispatch.backward_backend(p, "cudnn", lse_gradient=True) == ("cpu", rule)
    assert dispatch.backward_backend(p, "cudnn", lse_gradient=False) == ("cudnn", None)


def test_autograd_without_lse_gradient_runs_cudnn_backward(math_loops):
    """Autograd passes no LSE gradient when only `out` is used, so cuDNN's backward runs."""
    q, k, v = (x.requires_grad_() for x in make_qkv(LONGNET, dtype=torch.float64, seed=3))
    out, lse = ops.cudnn_forward(q, k, v, [16, 32, 64], [1, 2, 4], False, False, 8 ** -0.5)
    forward_steps = len(SEEN_VIEWS)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    assert len(SEEN_VIEWS) - forward_steps == 1 + 2 + 2
    ref = [x.detach().requires_grad_() for x in (q, k, v)]
    want = torch.autograd.grad(dilated_attention_reference(*ref, [16, 32, 64], [1, 2, 4])[0].sum(), ref)
    for a, b in zip(grads, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


# --- GPU: the real cuDNN ---------------------------------------------------------------------------------------

GPU_CASES = [
    dict(B=1, N=4096, H=16, D=128, segs=[512, 1024, 2048, 4096], dils=[1, 2, 4, 8], groups="all"),
    # grouped-query heads: cuDNN's own grouping, and calls cut per kv head where it does not fit
    dict(B=1, N=4096, H=16, Hkv=4, D=128, segs=[512, 1024, 2048, 4096], dils=[1, 2, 4, 8], groups="all"),
    dict(B=2, N=1000, H=8, Hkv=1, D=64, segs=[128, 300, 1000], dils=[1, 3, 4], groups="all"),
    # one kv head read at the row shifts of calls that stack the offset groups (kv head step 0)
    dict(B=1, N=2048, H=8, Hkv=1, D=64, segs=[256, 512, 1024], dils=[1, 2, 4], groups="all"),
    # offset groups in interleaved classes (r = 8 and 16 at Hkv = 4: row shift 2 and 4, kv head step 1) and in runs
    # of groups reading one kv head (Hkv = 2: kv head step 0)
    dict(B=1, N=2048, H=16, Hkv=4, D=64, segs=[256, 512, 1024], dils=[1, 8, 16], groups="all"),
    dict(B=1, N=2048, H=16, Hkv=2, D=64, segs=[256, 512, 1024], dils=[1, 8, 16], groups="all"),
    dict(B=2, N=777, H=6, Hkv=2, D=64, segs=[100, 300, 2000], dils=[2, 3, 5], groups="split"),
    dict(B=2, N=1000, H=6, D=64, segs=[128, 300, 1000], dils=[1, 3, 4], groups="all"),  # odd lengths
    dict(B=2, N=777, H=6, D=64, segs=[100, 300, 2000], dils=[2, 3, 5], groups="split"),
    dict(B=1, N=2048, H=4, D=32, segs=[2048], dils=[1], groups="all"),
    dict(B=3, N=513, H=5, D=96, segs=[64, 512], dils=[1, 7], groups="all"),
    # one-member calls, which cuDNN rejects (the loops use the one-key formulas): a one-row tail segment, r > w
    dict(B=2, N=1025, H=4, D=64, segs=[256, 1024, 4], dils=[1, 2, 8], groups="all"),
]
# Tolerances against float64: the package's rule (dilated_attn.reference.allowed_error); the reference run in the
# same dtype sets the scale (cuDNN rounds P and dS to the input dtype, as the Triton kernels do).
_err = max_error


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("index", range(len(GPU_CASES)))
def test_gpu_parity(index, causal, dtype):
    c = GPU_CASES[index]
    if dilated_attn.backends.CUDNN.unavailable() is not None:
        pytest.skip(dilated_attn.backends.CUDNN.unavailable())
    q, k, v, g = case_inputs(c, index, dtype)
    kw = dict(causal=causal, head_groups=c["groups"])
    poison_allocator()  # an element left unwritten shows up as NaN
    inputs = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    out, lse = dilated_attn.dilated_attention(*inputs, c["segs"], c["dils"], return_lse=True, backend="cudnn", **kw)
    grad_out = torch.randn(out.shape, generator=g).to("cuda", dtype)
    grads = torch.autograd.grad(out, inputs, grad_out)  # no LSE gradient: cuDNN's backward runs
    ref = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ref_out, ref_lse = dilated_attention_reference(*ref, c["segs"], c["dils"], **kw)
    ref_grads = torch.autograd.grad(ref_out, ref, grad_out.double())
    low = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    low_out, low_lse = dilated_attention_reference(*low, c["segs"], c["dils"], compute_dtype=dtype, **kw)
    low_grads = torch.autograd.grad(low_out, low, grad_out)
    assert torch.isfinite(out).all()
    assert _err(out, ref_out) <= allowed_error(dtype, _err(low_out, ref_out))
    finite = torch.isfinite(ref_lse)  # head_groups="split" leaves some (head, position) pairs without keys
    assert torch.equal(torch.isfinite(lse), finite) and (out.transpose(1, 2)[~finite] == 0).all()
    assert _err(lse[finite], ref_lse[finite]) <= allowed_error(dtype, _err(low_lse[finite], ref_lse[finite]))
    for name, a, b, lo in zip("qkv", grads, ref_grads, low_grads):
        largest = b.abs().max().item()
        assert _err(a, b) <= allowed_error(dtype, _err(lo, b), gradient=True, largest=largest), f"grad {name}"


def _dense_ops_match_math(device, dtype, nq, nk, kv_heads):
    """ops.dense_forward / dense_backward (the ring's blocks of unequal lengths) against math_attend in float64 on
    the same (rounded) inputs."""
    g = torch.Generator().manual_seed(nq * 100 + nk + kv_heads)
    q, go = (torch.randn(2, nq, 4, 64, generator=g).to(device, dtype) for _ in range(2))
    k, v = (torch.randn(2, nk, kv_heads, 64, generator=g).to(device, dtype) for _ in range(2))
    q = q.transpose(1, 2).contiguous().transpose(1, 2)  # heads-first storage: strided views
    scale = 0.3
    out, lse = ops.dense_forward(q, k, v, scale)
    grads = ops.dense_backward(go, q, k, v, out, lse, scale)
    exact = [x.transpose(1, 2).cpu().double() for x in (q, k, v, go)]
    ref_out, ref_lse = math_attend(*exact[:3], False, scale)
    ref_grads = math_attend_backward(exact[3], *exact[:3], ref_out, ref_lse, False, scale)
    assert out.shape == q.shape and lse.shape == (2, 4, nq)
    assert _err(out.transpose(1, 2).cpu(), ref_out) <= allowed_error(dtype, 0.0)
    assert _err(lse.cpu(), ref_lse) <= 1e-4 * (1 + ref_lse.abs().max().item())  # float32 sums of exact products
    for a, b in zip(grads, ref_grads):
        largest = b.abs().max().item()
        assert _err(a.transpose(1, 2).cpu(), b) <= allowed_error(dtype, 0.0, gradient=True, largest=largest)


@pytest.mark.parametrize("nq, nk, kv_heads", [(5, 13, 4), (13, 5, 2), (7, 7, 1)])
def test_dense_ops_take_unequal_lengths(nq, nk, kv_heads, math_loops):
    """The steps dense_forward and dense_backward pack, through the loops' contract (float64 on CPU)."""
    _dense_ops_match_math("cpu", torch.float64, nq, nk, kv_heads)


@pytest.mark.gpu
@pytest.mark.parametrize("nq, nk, kv_heads", [(1000, 3000, 4), (3000, 1000, 2), (2, 4097, 1)])
def test_gpu_dense_ops_take_unequal_lengths(nq, nk, kv_heads):
    if dilated_attn.backends.CUDNN.unavailable() is not None:
        pytest.skip(dilated_attn.backends.CUDNN.unavailable())
    _dense_ops_match_math("cuda", torch.bfloat16, nq, nk, kv_heads)


@pytest.mark.parametrize("capability, seq_len, backward, chosen", [
    ((9, 0), 4096, False, "cudnn"), ((9, 0), 2048, False, "triton"), ((9, 0), 2048, True, "cudnn"),
    ((9, 0), 1024, True, "triton"), ((8, 0), 65536, True, "triton")])
def test_auto_prefers_cudnn_on_hopper_for_large_problems(monkeypatch, capability, seq_len, backward, chosen):
    """auto's rule, without a GPU: cudnn first from compute capability 9.0 and 2^22 elements of q (B*N*H*D), or
    2^21 where the call records its backward (grad mode on and an input requiring grad; not under no_grad)."""
    from dilated_attn import dispatch
    from dilated_attn.spec import validate

    monkeypatch.setattr(dispatch.cudnn_backend.CUDNN, "why_not", lambda p: None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    q = torch.empty(1, seq_len, 16, 64, dtype=torch.bfloat16, device="meta", requires_grad=backward)
    p = dataclasses.replace(validate(q, q, q, [2048, 4096], [1, 2]), device=torch.device("cuda", 0))
    assert p.records_backward == backward and dispatch.auto_preference(p)[0] == chosen
    with torch.no_grad():
        assert not validate(q, q, q, [2048, 4096], [1, 2]).records_backward


@pytest.mark.gpu
def test_gpu_repeatable_but_dq(monkeypatch):
    """The same inputs give the same bits for out, dK and dV, with calls cut into pieces too; dQ may differ in
    its last bits (cuDNN adds it up with float32 atomics; docs/numerics.md, "Determinism")."""
    if dilated_attn.backends.CUDNN.unavailable() is not None:
        pytest.skip(dilated_attn.backends.CUDNN.unavailable())
    _cut_calls_into_pieces(monkeypatch, 1 << 18)
    c = GPU_CASES[0]
    g = torch.Generator(device="cuda").manual_seed(2)
    q, k, v = (torch.randn(c["B"], c["N"], c["H"], c["D"], device="cuda", dtype=torch.bfloat16, generator=g,
                           requires_grad=True) for _ in range(3))
    runs = []
    for _ in range(3):
        out = dilated_attn.dilated_attention(q, k, v, c["segs"], c["dils"], backend="cudnn")
        runs.append((out, *torch.autograd.grad(out.float().square().sum(), (q, k, v))))
    for out, dq, dk, dv in runs[1:]:
        assert torch.equal(out, runs[0][0]) and torch.equal(dk, runs[0][2]) and torch.equal(dv, runs[0][3])
        torch.testing.assert_close(dq, runs[0][1], rtol=1e-2, atol=1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 2])
def test_gpu_sequences_within_the_first_segment(batch):
    """N no longer than the first (dilation-1) segment: its one call's result is the starting result, and the later
    branches merge into its LSE (which must be laid out as the merges read it)."""
    if dilated_attn.backends.CUDNN.unavailable() is not None:
        pytest.skip(dilated_attn.backends.CUDNN.unavailable())
    g = torch.Generator().manual_seed(batch)
    for n in (2, 3, 5, 8):
        q, k, v = (torch.randn(batch, n, 4, 16, generator=g).to("cuda", torch.float16) for _ in range(3))
        out, lse = dilated_attn.dilated_attention(q, k, v, [8, 16], [1, 2], return_lse=True, backend="cudnn")
        ref_out, ref_lse = dilated_attention_reference(*(x.double() for x in (q, k, v)), [8, 16], [1, 2])
        low_out, low_lse = dilated_attention_reference(q, k, v, [8, 16], [1, 2], compute_dtype=torch.float16)
        assert _err(out, ref_out) <= allowed_error(torch.float16, _err(low_out, ref_out)), n
        assert _err(lse, ref_lse) <= allowed_error(torch.float16, _err(low_lse, ref_lse)), n


@pytest.mark.gpu
def test_gpu_nan_stays_in_the_rows_that_read_it():
    """A NaN key makes NaN exactly the outputs of the rows whose branches read it, as in the reference."""
    if dilated_attn.backends.CUDNN.unavailable() is not None:
        pytest.skip(dilated_attn.backends.CUDNN.unavailable())
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(1, 2048, 4, 64, generator=g, dtype=torch.float64) for _ in range(3))
    k[0, 700, :, 5] = math.nan
    segs, dils = [512, 1024], [1, 2]
    want = dilated_attention_reference(q, k, v, segs, dils)[0].isnan().any(-1)
    out = dilated_attn.dilated_attention(*(x.to("cuda", torch.bfloat16) for x in (q, k, v)), segs, dils,
                                         backend="cudnn")
    got = out.isnan().any(-1).cpu()
    assert want.any() and not want.all() and torch.equal(got, want)


@pytest.mark.gpu
def test_gpu_unaligned_inputs():
    """q at a 2-byte offset and k with padded rows (views cuDNN cannot read): the results of aligned copies."""
    if dilated_attn.backends.CUDNN.unavailable() is not None:
        pytest.skip(dilated_attn.backends.CUDNN.unavailable())
    g = torch.Generator(device="cuda").manual_seed(3)
    shape = (1, 1000, 4, 64)
    q = torch.randn(1000 * 4 * 64 + 1, device="cuda", dtype=torch.bfloat16, generator=g)[1:].view(shape)
    k = torch.randn(1, 1000, 4, 72, device="cuda", dtype=torch.bfloat16, generator=g)[..., :64]
    v = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=g)
    inputs = [x.detach().clone().requires_grad_() for x in (q, k, v)]  # clone(): dense, aligned
    odd = [x.detach().requires_grad_() for x in (q, k, v)]
    kw = dict(causal=True, backend="cudnn")
    out, want = (dilated_attn.dilated_attention(*x, [128, 512], [1, 4], **kw) for x in (odd, inputs))
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    grad_out = torch.randn(out.shape, device="cuda", dtype=out.dtype, generator=g)
    for a, b in zip(torch.autograd.grad(out, odd, grad_out), torch.autograd.grad(want, inputs, grad_out)):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)  # cuDNN's dQ accumulation order may differ


def test_deterministic_algorithms_keep_cudnn_forward_and_run_another_backward(math_loops, monkeypatch):
    """With torch.use_deterministic_algorithms(True), cudnn's forward still runs (auto keeps it first), and its
    backward, not bitwise repeatable (dQ by atomics), is replaced by one chosen when the forward runs: on CPU the
    cpu backend's, exact; explain() says so."""
    from dilated_attn import dispatch
    from dilated_attn.spec import validate

    q, k, v = (x.requires_grad_() for x in make_qkv(LONGNET, dtype=torch.float64, seed=4))
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        out, _ = ops.cudnn_forward(q, k, v, *_args(LONGNET))
        forward_steps = len(SEEN_VIEWS)
        torch.use_deterministic_algorithms(before)  # read when the forward ran, not now
        grads = torch.autograd.grad(out.sum(), (q, k, v))
        assert len(SEEN_VIEWS) == forward_steps  # no cuDNN backward step ran
        _, _, want = _reference_grads(q, k, v, LONGNET, torch.ones_like(out))
        for a, b in zip(grads, want):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
        torch.use_deterministic_algorithms(True)
        monkeypatch.setattr(dispatch.cudnn_backend.CUDNN, "unavailable", lambda: None)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
        big = torch.empty(1, 65536, 16, 64, dtype=torch.bfloat16, device="meta")
        p = dataclasses.replace(validate(big, big, big, [2048, 4096], [1, 2]), device=torch.device("cuda", 0))
        assert dilated_attn.backends.CUDNN.why_not(p) is None and dispatch.auto_preference(p)[0] == "cudnn"
        rule = dilated_attn.backends.CUDNN.backward_op.nondeterminism_rule
        assert dispatch.backward_backend(p, "cudnn", lse_gradient=False)[1] == rule
        # the rule is read when a compiled caller is traced, without a graph break
        compiled = torch.compile(lambda x: x + len(dispatch.auto_preference(p)[0]), fullgraph=True)
        assert torch.equal(compiled(torch.zeros(2)), torch.full((2,), 5.0))
    finally:
        torch.use_deterministic_algorithms(before)


@pytest.mark.gpu
def test_gpu_auto_picks_cudnn_on_hopper(monkeypatch):
    monkeypatch.setattr(dilated_attn.backends.fa4, "_installed", lambda: False)  # else auto prefers fa4 (test_fa4)
    q = torch.randn(1, 65536, 16, 64, device="cuda", dtype=torch.bfloat16)
    hopper = torch.cuda.get_device_capability() >= (9, 0)
    expected = "cudnn" if hopper and dilated_attn.backends.CUDNN.unavailable() is None else "triton"
    assert dilated_attn.explain(q, q, q, [1024, 2048], [1, 2]).backend == expected
    small = q[:, :2048]  # 2^21 elements, below the forward's threshold: triton
    assert dilated_attn.explain(small, small, small, [1024, 2048], [1, 2]).backend == "triton"
    kv = q[:, :, :4]  # grouped-query heads: cudnn too
    assert dilated_attn.explain(q, kv, kv, [1024], [1]).backend == expected


@pytest.mark.gpu
@pytest.mark.parametrize("kv_heads", [8, 2])
def test_gpu_lse_gradient(kv_heads):
    """A loss that uses the LSE: the forward is cuDNN's, the backward the one dispatch names (triton), exact; and
    explain() says so."""
    if dilated_attn.backends.CUDNN.unavailable() is not None:
        pytest.skip(dilated_attn.backends.CUDNN.unavailable())
    g = torch.Generator().manual_seed(kv_heads)
    q, k, v = (torch.randn(2, 1000, h, 64, generator=g).to("cuda", torch.bfloat16) for h in (8, kv_heads, kv_heads))
    segs, dils, kw = [128, 300, 1000], [1, 3, 4], dict(causal=True)
    decision = dilated_attn.explain(q, k, v, segs, dils, backend="cudnn", **kw)
    assert decision.backward == "cudnn" and decision.lse_gradient_backward == "triton"
    assert "where the LSE has a gradient: triton" in str(decision)
    inputs = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    out, lse = dilated_attn.dilated_attention(*inputs, segs, dils, return_lse=True, backend="cudnn", **kw)
    grad_out, grad_lse = torch.randn(out.shape, generator=g).to("cuda", out.dtype), torch.randn(lse.shape).cuda()
    grads = torch.autograd.grad((out * grad_out).float().sum() + (lse * grad_lse).sum(), inputs)
    ref = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ref_out, ref_lse = dilated_attention_reference(*ref, segs, dils, **kw)
    want = torch.autograd.grad((ref_out * grad_out.double()).sum() + (ref_lse * grad_lse.double()).sum(), ref)
    for name, a, b in zip("qkv", grads, want):
        size = max(b.abs().max().item(), 1.0)
        assert _err(a, b) <= GRADIENT_ERROR_FLOOR[torch.bfloat16] * size, f"grad {name}"


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cudnn", "fa4", "auto"])
def test_gpu_torch_compile_fullgraph(backend):
    """Compiled without graph breaks, by name and through auto's rule (which picks fa4 on Hopper where flash-attn-4
    is installed, else cudnn): the same output and gradients as eager."""
    for name in ("cudnn", "fa4") if backend == "fa4" else ("cudnn",):
        why = dilated_attn.backends.get(name).unavailable()
        if why is not None:
            pytest.skip(why)
    n = 65536 if backend == "auto" else 1024  # auto prefers cudnn from 2^21 elements (with the backward)
    q, k, v = (torch.randn(1, n, 16, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    if backend != "cudnn" and torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("fa4 runs, and auto prefers cudnn, from compute capability 9.0")
    expected = backend
    if backend == "auto":
        expected = "fa4" if dilated_attn.backends.FA4.unavailable() is None else "cudnn"
    assert dilated_attn.explain(q, k, v, [256, 512], [1, 2], backend=backend).backend == expected

    def f(q, k, v):
        return dilated_attn.dilated_attention(q, k, v, [256, 512], [1, 2], backend=backend)

    compiled = torch.compile(f, fullgraph=True)
    out, out_eager = compiled(q, k, v), f(q, k, v)
    torch.testing.assert_close(out, out_eager)
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    for a, b in zip(grads, torch.autograd.grad(out_eager, (q, k, v), grad_out)):
        torch.testing.assert_close(a, b)


@pytest.mark.gpu
def test_gpu_torch_compile_with_a_dynamic_sequence_length():
    """A sequence length that changes between calls (which torch.compile then traces as dynamic) compiles without
    graph breaks and gives eager's results, also where it clips a segment: the ops were handed the clipped segment
    as a symbolic expression, and raised."""
    why = dilated_attn.backends.get("cudnn").unavailable()
    if why is not None:
        pytest.skip(why)

    def f(q, k, v):
        return dilated_attn.dilated_attention(q, k, v, [256, 512], [1, 2], backend="cudnn")

    compiled = torch.compile(f, fullgraph=True)
    # the second length makes the compiler mark it dynamic; the third clips the segment of 512 (a guard on it)
    for n in (1024, 1536, 384):
        q, k, v = (torch.randn(1, n, 8, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        out, out_eager = compiled(q, k, v), f(q, k, v)
        torch.testing.assert_close(out, out_eager)
        grad_out = torch.randn_like(out)
        for a, b in zip(torch.autograd.grad(out, (q, k, v), grad_out),
                        torch.autograd.grad(out_eager, (q, k, v), grad_out)):
            torch.testing.assert_close(a, b)
