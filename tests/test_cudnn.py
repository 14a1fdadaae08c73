"""The cudnn backend: its call plan and the steps it packs for the C++ loops on CPU (cuDNN's attention replaced by a
float64 math version with the same contract, the loops by their contract in Python), and on the GPU, the real
cuDNN and loops, against the float64 reference."""

import dataclasses
import math
import random

import pytest
import torch

import dilated_attn
from dilated_attn.merge import merge_into
from dilated_attn.reference import dilated_attention_reference
from dilated_attn.spec import branch_table, lse_dtype

from cases import make_qkv, random_case
from parity import poison_allocator

ops = pytest.importorskip("dilated_attn.backends.cudnn.ops", reason="the cudnn ops need triton")
from dilated_attn.backends.triton.ops import triton_backward  # noqa: E402

# Random configurations without GQA (which the backend does not take): odd lengths, w > N, r > w, both head
# groupings, heads not divisible by r, causal, three memory layouts, batch 2.
CASES = [dataclasses.replace(c, num_kv_heads=c.num_heads)
         for c in (random_case(random.Random(8100 + i), max_seq=80) for i in range(40))]
LONGNET = dataclasses.replace(CASES[0], batch=2, seq_len=64, num_heads=8, num_kv_heads=8, head_dim=8,
                              segment_lengths=(16, 32, 64), dilation_rates=(1, 2, 4), head_groups="all",
                              layout="contiguous")


def _scores(q, k, causal, scale):
    s = (q.double() @ k.double().transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(torch.ones_like(s, dtype=torch.bool).triu(1), -math.inf)
    return s


def math_attend(q, k, v, causal, scale):
    """cuDNN's contract in float64: out [b, h, s, d] in q's dtype, the LSE [b, h, s]."""
    s = _scores(q, k, causal, scale)
    lse = torch.logsumexp(s, -1)
    return (torch.exp(s - lse[..., None]) @ v.double()).to(q.dtype), lse.to(lse_dtype(q.dtype))


def math_attend_backward(grad_out, q, k, v, out, lse, causal, scale):
    """cuDNN's backward contract: P from the given LSE, delta from the given out."""
    p = torch.exp(_scores(q, k, causal, scale) - lse.double()[..., None])
    do = grad_out.double()
    ds = p * (do @ v.double().transpose(-1, -2) - (do * out.double()).sum(-1, keepdim=True))
    return tuple(x.to(q.dtype) for x in (ds @ k.double() * scale, ds.transpose(-1, -2) @ q.double() * scale,
                                         p.transpose(-1, -2) @ do))


def _step_views(steps, *tensors):
    """Each step's views of `tensors` (its row of `steps`, unpacked as csrc/cuda/cudnn_steps.cpp reads it)."""
    n = ops.VIEW_INTS
    for row in steps.tolist():
        views = (row[i * n:(i + 1) * n] for i in range(len(tensors)))
        yield [x.as_strided(view[:x.dim()], view[4:4 + x.dim()], view[8]) for x, view in zip(tensors, views)]


def forward_steps(q, k, v, out, lse_rows, steps, causal, scale):
    """The C++ forward loop's contract: each step's attention (ops._attend: math_attend here) merged into its views
    of (out, lse_rows)."""
    assert steps.dtype == torch.int64 and steps.shape[1] == 5 * ops.VIEW_INTS
    for qs, ks, vs, out_view, lse_view in _step_views(steps, q, k, v, out, lse_rows):
        merge_into(out_view, lse_view, *ops._attend(qs, ks, vs, causal, scale))


def backward_steps(grad_out, q, k, v, out, lse_rows, grads, steps, stored_steps, causal, scale):
    """The C++ backward loop's contract: each step's gradients (ops._attend_backward) stored into (for the first
    `stored_steps` steps) or added to their views of `grads` (one layout: the step's last view is each one's)."""
    assert steps.dtype == torch.int64 and steps.shape[1] == 7 * ops.VIEW_INTS
    for i, (*views, target) in enumerate(_step_views(steps, grad_out, q, k, v, out, lse_rows, grads[0])):
        for g, grad in zip(grads, ops._attend_backward(*views, causal, scale)):
            view = g.as_strided(target.shape, target.stride(), target.storage_offset())
            view.copy_(grad) if i < stored_steps else view.add_(grad)


@pytest.fixture
def math_primitives(monkeypatch):
    monkeypatch.setattr(ops, "_attend", math_attend)
    monkeypatch.setattr(ops, "_attend_backward", math_attend_backward)
    monkeypatch.setattr(ops, "_forward_steps", forward_steps)
    monkeypatch.setattr(ops, "_backward_steps", backward_steps)


@pytest.mark.parametrize("index", range(len(CASES)))
def test_calls_cover_every_member_once(index):
    case = CASES[index]
    for br in branch_table(case.segment_lengths, case.dilation_rates, case.seq_len, case.num_heads,
                           case.head_groups):
        want = {(p, h) for h in range(br.head_lo, br.head_hi) for p in range(case.seq_len)
                if (p % br.seg_len) % br.dilation == br.offset(h)}
        got = []
        for c in ops.branch_calls(br, case.seq_len):
            rows = [(c.first_row + j * c.seg_rows + i * c.row_step + m * c.dilation,
                     c.head0 + j * c.seg_head_step + i * c.head_step)
                    for j in range(c.n_seg) for i in range(c.n_heads) for m in range(c.members)]
            # one call's members share one segment: they attend to each other only
            for j in range(c.n_seg):
                segs = {(c.first_row + j * c.seg_rows + i * c.row_step + m * c.dilation) // br.seg_len
                        for i in range(c.n_heads) for m in range(c.members)}
                assert len(segs) == 1
            got += rows
        assert len(got) == len(set(got)) and set(got) == want


def test_longnet_branches_take_few_calls():
    # H=16, r=8: two calls (one per head within the offset groups of 2), not eight
    table = branch_table([2048, 4096, 8192, 16384], [1, 2, 4, 8], 65536, 16, "all")
    assert [len(ops.branch_calls(br, 65536)) for br in table] == [1, 2, 4, 2]
    # N=16384: r=4 and r=8 have fewer segments (2, 1) than heads within a group: one call per segment
    table = branch_table([2048, 4096, 8192, 16384], [1, 2, 4, 8], 16384, 16, "all")
    assert [len(ops.branch_calls(br, 16384)) for br in table] == [1, 2, 2, 1]


def _reference_grads(q, k, v, case, grad_out):
    inputs = [x.detach().double().requires_grad_() for x in (q, k, v)]
    out, lse = dilated_attention_reference(*inputs, case.segment_lengths, case.dilation_rates, **case.kwargs())
    return out, lse, torch.autograd.grad((out * grad_out.double()).sum(), inputs)


def _cut_calls_into_pieces(monkeypatch, elements: int) -> None:
    monkeypatch.setattr(ops, "MAX_CALL_ELEMENTS", elements)
    monkeypatch.setattr(ops, "MAX_BACKWARD_CALL_ELEMENTS", elements)


def _forward_backward_equal_the_reference(case, seed: int):
    """The ops' out, LSE and gradients (float64 inputs of `case`, cuDNN's contract in math) against the reference:
    returns (out, lse)."""
    q, k, v = make_qkv(case, dtype=torch.float64, seed=seed)
    args = (list(case.segment_lengths), list(case.dilation_rates), case.head_groups == "split", case.causal,
            case.head_dim ** -0.5)
    torch.manual_seed(seed)
    out, lse = ops.cudnn_forward(q, k, v, *args)
    grad_out = torch.randn(out.shape, dtype=torch.float64)
    ref_out, ref_lse, ref_grads = _reference_grads(q, k, v, case, grad_out)
    torch.testing.assert_close(out, ref_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-12, atol=1e-12)
    grads = ops.cudnn_backward(grad_out, None, q, k, v, out, lse, *args)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    return out, lse


@pytest.mark.parametrize("pieces", ["whole", "split"])
@pytest.mark.parametrize("index", range(len(CASES)))
def test_plan_views_and_merge_equal_the_reference(index, pieces, math_primitives, monkeypatch):
    if pieces == "split":  # calls cut into pieces of a few segments
        if index % 4:
            pytest.skip("a quarter of the cases is enough")
        _cut_calls_into_pieces(monkeypatch, 64)
    out, lse = _forward_backward_equal_the_reference(CASES[index], seed=index)
    assert out.is_contiguous() and lse.is_contiguous()


@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("pieces", [None, 64])
def test_calls_by_segment_equal_the_reference(layout, causal, pieces, math_primitives, monkeypatch):
    """Calls that take every offset group of one segment (n=80 with w=64, r=4 and 8 heads: a full segment and the
    16-row tail, one call each), over two batches that one view cannot span, whole and cut into pieces."""
    if pieces is not None:
        _cut_calls_into_pieces(monkeypatch, pieces)
    case = dataclasses.replace(LONGNET, seq_len=80, dilation_rates=(1, 2, 4), layout=layout, causal=causal)
    calls = ops.branch_calls(branch_table([64], [4], 80, 8, "all")[0], 80)
    assert [(c.n_seg, c.n_heads, c.seg_head_step) for c in calls] == [(4, 2, 2), (4, 2, 2)]
    _forward_backward_equal_the_reference(case, seed=5)


def test_first_branch_result_is_used_in_place(math_primitives, monkeypatch):
    """LongNet branches: the first (dilation 1) call's out, and in the backward its gradients, become the result
    without a merge or a copy; the later branches' calls each merge (add their gradients) once."""
    merges, adds = [], []
    monkeypatch.setattr(ops, "_forward_steps", lambda *a: (merges.append(len(a[5])), forward_steps(*a)))
    monkeypatch.setattr(ops, "_backward_steps", lambda *a: (adds.append((len(a[7]), a[8])), backward_steps(*a)))
    q, k, v = make_qkv(LONGNET, dtype=torch.float64, seed=1)
    args = ([16, 32, 64], [1, 2, 4], False, False, 8 ** -0.5)
    out, lse = ops.cudnn_forward(q, k, v, *args)
    assert merges == [2 + 2]  # r=2: one call per offset group of 4 heads; r=4: one per head of the groups of 2
    grad_out = torch.randn(out.shape, dtype=torch.float64)
    grads = ops.cudnn_backward(grad_out, None, q, k, v, out, lse, *args)
    assert adds == [(4, 0)]  # four calls, none stored
    ref_out, _, ref_grads = _reference_grads(q, k, v, LONGNET, grad_out)
    torch.testing.assert_close(out, ref_out, rtol=1e-12, atol=1e-12)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_first_branch_in_pieces_stores_its_gradients(math_primitives, monkeypatch):
    """A first branch that reaches every row once but takes more than one call (here: cut into pieces) stores its
    gradients into fresh tensors: its steps come first, and the loop is told how many they are."""
    _cut_calls_into_pieces(monkeypatch, 64)
    stored = []
    monkeypatch.setattr(ops, "_backward_steps", lambda *a: (stored.append((len(a[7]), a[8])), backward_steps(*a)))
    _forward_backward_equal_the_reference(LONGNET, seed=9)
    assert stored[0][1] == 2 * 64 // 16 and stored[0][0] > stored[0][1]  # 2 batches x 4 segments, one a piece


def test_views_cudnn_cannot_read_are_copied(math_primitives, monkeypatch):
    """Rows at a 2-byte offset, strides that are not multiples of 16 bytes, a broadcast gradient: cuDNN gets
    aligned, unit-stride, non-broadcast views, and the results are those of the plain inputs."""
    seen = []
    attend, attend_backward = math_attend, math_attend_backward

    def readable(*xs):
        for x in xs:
            size = x.element_size()
            seen.append(x.data_ptr() % 16 == 0 and x.stride(-1) == 1
                        and all(s * size % 16 == 0 and s > 0 for s in x.stride()[:-1]))

    monkeypatch.setattr(ops, "_attend", lambda q, k, v, *a: (readable(q, k, v), attend(q, k, v, *a))[1])
    monkeypatch.setattr(ops, "_attend_backward", lambda go, q, k, v, o, l, *a: (
        readable(go, q, k, v, o), attend_backward(go, q, k, v, o, l, *a))[1])
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
    assert all(torch.equal(a, b) for a, b in zip(got, want)) and seen and all(seen)


def test_lse_gradient_goes_to_the_triton_backward(math_primitives):
    case = LONGNET
    q, k, v = make_qkv(case, dtype=torch.float32, seed=2)
    args = ([16, 32, 64], [1, 2, 4], False, True, 8 ** -0.5)
    out, lse = ops.cudnn_forward(q, k, v, *args)
    grad_out, grad_lse = torch.randn_like(out), torch.randn_like(lse)
    got = ops.cudnn_backward(grad_out, grad_lse, q, k, v, out, lse, *args)
    want = triton_backward(grad_out, grad_lse, q, k, v, out, lse, *args)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


# --- GPU: the real cuDNN ---------------------------------------------------------------------------------------

GPU_CASES = [
    dict(B=1, N=4096, H=16, D=128, segs=[512, 1024, 2048, 4096], dils=[1, 2, 4, 8], groups="all"),
    dict(B=2, N=1000, H=6, D=64, segs=[128, 300, 1000], dils=[1, 3, 4], groups="all"),  # odd lengths
    dict(B=2, N=777, H=6, D=64, segs=[100, 300, 2000], dils=[2, 3, 5], groups="split"),
    dict(B=1, N=2048, H=4, D=32, segs=[2048], dils=[1], groups="all"),
    dict(B=3, N=513, H=5, D=96, segs=[64, 512], dils=[1, 7], groups="all"),
    # one-member calls, which cuDNN rejects (the loops use the one-key formulas): a one-row tail segment, r > w
    dict(B=2, N=1025, H=4, D=64, segs=[256, 1024, 4], dils=[1, 2, 8], groups="all"),
]
# Tolerances against float64: the reference run in the same dtype sets the scale (cuDNN rounds P and dS to the
# input dtype, as the Triton kernels do), with the floors of tests/parity.py.
FACTOR = 2.0
FLOOR = {torch.bfloat16: 1.6e-2, torch.float16: 2e-3}
GRAD_FLOOR = {torch.bfloat16: 3e-2, torch.float16: 4e-3}


def _err(a, b):
    return (a.double() - b.double()).abs().max().item()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("index", range(len(GPU_CASES)))
def test_gpu_parity(index, causal, dtype):
    c = GPU_CASES[index]
    if dilated_attn.backends.CUDNN.unavailable() is not None:
        pytest.skip(dilated_attn.backends.CUDNN.unavailable())
    g = torch.Generator().manual_seed(index)
    q, k, v = (torch.randn(c["B"], c["N"], c["H"], c["D"], generator=g).to("cuda", dtype) for _ in range(3))
    if index % 2:  # heads-first storage: the views of a non-contiguous layout
        q = q.transpose(1, 2).contiguous().transpose(1, 2)
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
    assert _err(out, ref_out) <= FACTOR * _err(low_out, ref_out) + FLOOR[dtype]
    finite = torch.isfinite(ref_lse)  # head_groups="split" leaves some (head, position) pairs without keys
    assert torch.equal(torch.isfinite(lse), finite) and (out.transpose(1, 2)[~finite] == 0).all()
    assert _err(lse[finite], ref_lse[finite]) <= FACTOR * _err(low_lse[finite], ref_lse[finite]) + FLOOR[dtype]
    for name, a, b, lo in zip("qkv", grads, ref_grads, low_grads):
        size = max(b.abs().max().item(), 1.0)
        assert _err(a, b) <= FACTOR * _err(lo, b) + GRAD_FLOOR[dtype] * size, f"grad {name}"


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


def test_deterministic_algorithms_rule_cudnn_out(monkeypatch):
    """With torch.use_deterministic_algorithms(True), auto passes cudnn over (its dQ is not bitwise repeatable)
    and an explicit backend="cudnn" says why."""
    from dilated_attn import dispatch
    from dilated_attn.spec import validate

    monkeypatch.setattr(dispatch.cudnn_backend.CUDNN, "unavailable", lambda: None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    q = torch.empty(1, 65536, 16, 64, dtype=torch.bfloat16, device="meta")
    p = dataclasses.replace(validate(q, q, q, [2048, 4096], [1, 2]), device=torch.device("cuda", 0))
    assert dispatch.CUDNN_MIN_ELEMENTS <= q.numel() and dispatch.auto_preference(p)[0] == "cudnn"
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        assert "deterministic" in dispatch.cudnn_backend.CUDNN.why_not(p)
        assert dispatch.auto_preference(p)[0] == "triton"
        # the rule is read when a compiled caller is traced, without a graph break
        compiled = torch.compile(lambda x: x + len(dispatch.auto_preference(p)[0]), fullgraph=True)
        assert torch.equal(compiled(torch.zeros(2)), torch.full((2,), 6.0))
    finally:
        torch.use_deterministic_algorithms(before)


@pytest.mark.gpu
def test_gpu_auto_picks_cudnn_on_hopper():
    q = torch.randn(1, 65536, 16, 64, device="cuda", dtype=torch.bfloat16)
    hopper = torch.cuda.get_device_capability() >= (9, 0)
    expected = "cudnn" if hopper and dilated_attn.backends.CUDNN.unavailable() is None else "triton"
    assert dilated_attn.explain(q, q, q, [1024, 2048], [1, 2]).backend == expected
    small = q[:, :2048]  # 2^21 elements, below the forward's threshold: triton
    assert dilated_attn.explain(small, small, small, [1024, 2048], [1, 2]).backend == "triton"
    kv = q[:, :, :4]  # GQA: triton, without a warning
    assert dilated_attn.explain(q, kv, kv, [1024], [1]).backend == "triton"


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cudnn", "auto"])
def test_gpu_torch_compile_fullgraph(backend):
    """Compiled without graph breaks, by name and through auto's rule (which picks cudnn on Hopper): the same
    output and gradients as eager."""
    if dilated_attn.backends.CUDNN.unavailable() is not None:
        pytest.skip(dilated_attn.backends.CUDNN.unavailable())
    n = 65536 if backend == "auto" else 1024  # auto prefers cudnn from 2^21 elements (with the backward)
    q, k, v = (torch.randn(1, n, 16, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    if backend == "auto" and torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("auto prefers cudnn from compute capability 9.0")
    assert dilated_attn.explain(q, k, v, [256, 512], [1, 2], backend=backend).backend == "cudnn"

    def f(q, k, v):
        return dilated_attn.dilated_attention(q, k, v, [256, 512], [1, 2], backend=backend)

    compiled = torch.compile(f, fullgraph=True)
    out, out_eager = compiled(q, k, v), f(q, k, v)
    torch.testing.assert_close(out, out_eager)
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    for a, b in zip(grads, torch.autograd.grad(out_eager, (q, k, v), grad_out)):
        torch.testing.assert_close(a, b)


def test_autograd_without_lse_gradient_runs_cudnn_backward(math_primitives, monkeypatch):
    """Autograd passes no LSE gradient when only `out` is used, so cuDNN's backward runs, not the Triton one."""
    calls = []
    monkeypatch.setattr(ops, "_attend_backward", lambda *a: (calls.append(1), math_attend_backward(*a))[1])
    q, k, v = (x.requires_grad_() for x in make_qkv(LONGNET, dtype=torch.float64, seed=3))
    out, lse = ops.cudnn_forward(q, k, v, [16, 32, 64], [1, 2, 4], False, False, 8 ** -0.5)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    assert len(calls) == 1 + 2 + 2
    ref = [x.detach().requires_grad_() for x in (q, k, v)]
    want = torch.autograd.grad(dilated_attention_reference(*ref, [16, 32, 64], [1, 2, 4])[0].sum(), ref)
    for a, b in zip(grads, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
