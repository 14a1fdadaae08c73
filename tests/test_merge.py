"""The one log-sum-exp merge (dilated_attn.merge), and every backend's branch-merge epilogue pinned to it.

Each kernel (cpu, cuda, triton) merges branch after branch into its running (out, lse) in its forward epilogue,
and the reference merges its branches with merge.merge. With head_groups="all" a branch's heads and offsets do not
depend on the other branches, so a backend's multi-branch result must equal merge.merge of the same backend's
single-branch results. The crafted inputs reach the merge's edge cases: equal LSEs (a branch given twice), -inf
(positions a branch does not cover, and positions no branch covers), |LSE| ~ 1e8 (where exp(lse_i - LSE) with a
rounded LSE would not sum to 1) and NaN (a NaN score, and a NaN value).
"""

import math
import os

import pytest
import torch

import dilated_attn
from dilated_attn.backends import TRITON
from dilated_attn.merge import merge, merge_into

GPU = torch.cuda.is_available()
INTERPRETER = not GPU and os.environ.get("TRITON_INTERPRET") == "1" and TRITON.unavailable() is None


def _single_branch_merge(q, k, v, segments, dilations, backend, scale):
    outs, lses = [], []
    for w, r in zip(segments, dilations):
        out, lse = dilated_attn.dilated_attention(q, k, v, [w], [r], scale=scale, return_lse=True, backend=backend)
        outs.append(out.double())
        lses.append(lse.double().transpose(1, 2))  # [B, N, H]: one lse per out row
    out, lse = merge(outs, lses)
    return out, lse.transpose(1, 2)


def _inputs(case, dtype, device):
    # one batch element: the merge is row by row, and the interpreter's time grows with the rows
    B, N, H, D = 1, 37, 4, 8
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(B, N, H, D, generator=g, dtype=torch.float64) for _ in range(3))
    scale = None
    if case == "huge_lse":  # scores ~ +-1e8: the LSE is ~1e8, where float32's spacing is 8
        scale = 1e8
    elif case == "nan_score":
        q[0, 5, 1, 0] = math.nan
    elif case == "nan_value":
        v[0, 12, 2, 3] = math.nan
    return [x.to(device, dtype) for x in (q, k, v)], scale


# branches: equal LSEs (one branch given twice); -inf in one branch (r = 2 leaves half the positions out); -inf in
# every branch (offset 0 of r = 2 in both: odd positions of a one-head group are covered by no branch)
BRANCHES = {
    "equal": ([8, 8], [1, 1]),
    "partial": ([8, 16, 32], [1, 2, 4]),
    "uncovered": ([8, 16], [2, 2]),
}
CASES = [("equal", "plain"), ("partial", "plain"), ("partial", "huge_lse"), ("equal", "huge_lse"),
         ("partial", "nan_score"), ("partial", "nan_value"), ("uncovered", "plain")]

BACKENDS = [
    ("cpu", "cpu", torch.float64),
    ("cpu", "cpu", torch.float32),
    ("reference", "cpu", torch.float64),
    pytest.param("triton", "cpu", torch.float32, marks=pytest.mark.skipif(
        not INTERPRETER, reason="the Triton interpreter on CPU tensors (TRITON_INTERPRET=1 without a GPU)")),
    pytest.param("triton", "cuda", torch.float32, marks=pytest.mark.gpu),
    pytest.param("cuda", "cuda", torch.float32, marks=pytest.mark.gpu),
]


@pytest.mark.parametrize("backend, device, dtype", BACKENDS)
@pytest.mark.parametrize("branches, case", CASES)
def test_kernel_epilogue_is_the_merge(backend, device, dtype, branches, case):
    segments, dilations = BRANCHES[branches]
    (q, k, v), scale = _inputs(case, dtype, device)
    if branches == "uncovered":  # one query head per offset group: offset 0 in both branches, odd positions bare
        q, k, v = q[:, :, :1], k[:, :, :1], v[:, :, :1]
    out, lse = dilated_attn.dilated_attention(q, k, v, segments, dilations, scale=scale, return_lse=True,
                                              backend=backend)
    want_out, want_lse = _single_branch_merge(q, k, v, segments, dilations, backend, scale)
    # float64: the same formula up to a few roundings; float32: the kernels keep the running output in the input
    # dtype between branches, so each later branch rounds it once more (relative 2^-24 per branch)
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(out.double().cpu(), want_out.cpu(), equal_nan=True, **tol)
    torch.testing.assert_close(lse.double().cpu(), want_lse.cpu(), equal_nan=True, **tol)
    if case.startswith("nan"):
        assert out.isnan().any() and out.isnan().sum() < out.numel() // 4  # NaN reached some rows, not all
    if case == "nan_score":
        assert lse.isnan().any()
    if branches == "uncovered":
        bare = torch.isinf(lse)
        assert bare.any() and (out[bare.transpose(1, 2)] == 0).all()
    if branches == "equal" and case == "plain":  # two equal halves: the output of one branch, LSE + log 2
        one_out, one_lse = dilated_attn.dilated_attention(q, k, v, [8], [1], return_lse=True, backend=backend)
        torch.testing.assert_close(out, one_out, **tol)
        torch.testing.assert_close(lse, one_lse + math.log(2), **tol)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, vectors", [(torch.float32, True), (torch.float32, False),
                                            (torch.bfloat16, True), (torch.float16, False)])
def test_merge_into_kernel_is_the_merge(dtype, vectors):
    """The cudnn backend merges each cuDNN call's result with a CUDA kernel of its own (csrc/cuda/merge.cu): in
    place, with 16-byte vectors or (views at an odd element) element by element, it equals merge_into on equal LSEs,
    -inf (one side and both), |LSE| ~ 1e8 and NaN, to the rounding of the output's dtype; a part whose LSE is -inf
    is not read (NaN there, as a packed call leaves the rows between its runs, changes nothing)."""
    from dilated_attn.backends import CUDNN

    if CUDNN.unavailable() is not None:
        pytest.skip(CUDNN.unavailable())
    g = torch.Generator().manual_seed(7)
    acc_out, part_out = (torch.randn(2, 3, 40, 16, generator=g, dtype=torch.float64) for _ in range(2))
    acc_lse, part_lse = (torch.randn(2, 3, 40, generator=g) for _ in range(2))
    part_lse[0, 0, :5] = acc_lse[0, 0, :5]  # equal
    acc_lse[0, 1, :5] = -math.inf  # one side without keys
    acc_lse[0, 2, :5] = part_lse[0, 2, :5] = -math.inf  # neither
    acc_lse[1, 0, :5], part_lse[1, 0, :5] = 1e8, 1e8 + 1  # huge
    part_lse[1, 1, 3] = math.nan
    part_out[1, 2, 7, 4] = math.nan
    part_lse[1, 2, 20:30] = -math.inf  # rows no call wrote
    part_out[1, 2, 20:30] = math.nan
    acc_out, part_out = acc_out.to(dtype), part_out.to(dtype)
    want_out, want_lse = acc_out.double(), acc_lse.clone()
    unread = (part_lse == -math.inf)[..., None]
    merge_into(want_out, want_lse, part_out.double().masked_fill(unread, 0), part_lse)

    def on_gpu(x):  # a copy at a 16-byte boundary, or one element past it
        start = 0 if vectors else 1
        return torch.empty(x.numel() + start, dtype=x.dtype, device="cuda")[start:].view(x.shape).copy_(x)

    out, lse = on_gpu(acc_out), on_gpu(acc_lse)
    torch.ops.dilated_attn.merge_into(out, lse, on_gpu(part_out), on_gpu(part_lse))
    tol = dict(rtol=2e-6, atol=2e-6) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(out.cpu().double(), want_out.to(dtype).double(), **tol, equal_nan=True)
    torch.testing.assert_close(lse.cpu(), want_lse, rtol=2e-6, atol=2e-6, equal_nan=True)


@pytest.mark.gpu
@pytest.mark.parametrize("sums, grads", [(torch.float32, torch.bfloat16), (torch.float32, torch.float16),
                                         (torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32)])
@pytest.mark.parametrize("vectors", [True, False])
@pytest.mark.parametrize("store", [False, True])
def test_addition_kernel_adds_each_gradient_once(sums, grads, vectors, store):
    """The gradient-addition kernel (csrc/cuda/merge.cu, op accumulate): targets[t] += parts[t] (= with
    `store`) for three pairs in one launch, the targets strided views (rows of a wider tensor, as the ring's sums of
    a block's rows are) of the parts' dtype or float32 sums of 16-bit parts, with 16-byte vectors or (views one
    element past them) element by element; rows beside the views stay as they were. Exact for float32 sums (one
    float32 addition of two numbers each exact in float32), the sums' rounding otherwise."""
    from dilated_attn.backends import CUDNN

    if CUDNN.unavailable() is not None:
        pytest.skip(CUDNN.unavailable())
    g = torch.Generator().manual_seed(3)
    start = 0 if vectors else 1
    wide = [torch.randn(2 * 37 * 3 * 24 + start, generator=g).to(sums) for _ in range(3)]
    parts = [torch.randn(2, 24, 3, 16, generator=g).to(grads) for _ in range(3)]
    want = []
    for w, p in zip(wide, parts):
        x = w[start:].double().view(2, 37, 3, 24)
        x[:, 5:29, :, :16] = p.double() if store else x[:, 5:29, :, :16] + p.double()
        want.append(x.to(sums))
    on_gpu = [w.cuda() for w in wide]
    targets = [w[start:].view(2, 37, 3, 24)[:, 5:29, :, :16].transpose(1, 2) for w in on_gpu]  # [b, h, s, d]
    torch.ops.dilated_attn.accumulate(targets, [p.cuda().transpose(1, 2) for p in parts], store)
    for w, x in zip(on_gpu, want):
        torch.testing.assert_close(w[start:].view(2, 37, 3, 24).cpu(), x, rtol=0, atol=0)


def test_merge_of_equal_huge_lses_weighs_them_equally():
    o1, o2 = torch.randn(3, 5, 4), torch.randn(3, 5, 4)
    lse = torch.full((3, 5), 1e8)
    out, merged = merge([o1, o2], [lse, lse])
    torch.testing.assert_close(out, (o1 + o2) / 2)  # weights 1/2 each: exp(lse_i - merged) would give 0 and 0
    assert torch.equal(merged, lse + math.log(2))


def test_merge_of_rows_without_keys_is_zero_with_finite_gradients():
    outs = [torch.randn(4, 3, dtype=torch.float64, requires_grad=True) for _ in range(2)]
    lses = [torch.tensor([0.5, -math.inf, 1.0, -math.inf], dtype=torch.float64, requires_grad=True),
            torch.tensor([-math.inf, -math.inf, 2.0, 3.0], dtype=torch.float64, requires_grad=True)]
    out, lse = merge(outs, lses)
    assert torch.equal(out[1], torch.zeros(3, dtype=torch.float64)) and lse[1] == -math.inf
    torch.testing.assert_close(out[0], outs[0][0])
    torch.testing.assert_close(out[3], outs[1][3])
    grads = torch.autograd.grad((out.sum() + lse[torch.isfinite(lse)].sum()), [*outs, *lses])
    assert all(torch.isfinite(g).all() for g in grads)


def test_merge_is_exact_against_logsumexp_and_its_gradient():
    g = torch.Generator().manual_seed(0)
    outs = [torch.randn(6, 4, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3)]
    lses = [torch.randn(6, generator=g, dtype=torch.float64).mul(5).requires_grad_() for _ in range(3)]
    out, lse = merge(outs, lses)
    stacked = torch.stack(lses)
    want_lse = torch.logsumexp(stacked, 0)
    want_out = sum(torch.exp(part - want_lse).unsqueeze(-1) * o for o, part in zip(outs, lses))
    torch.testing.assert_close(lse, want_lse, rtol=1e-14, atol=1e-14)
    torch.testing.assert_close(out, want_out, rtol=1e-14, atol=1e-14)
    assert torch.autograd.gradcheck(lambda *x: merge(list(x[:3]), list(x[3:])), (*outs, *lses))


def test_merge_into_is_the_merge_in_place():
    g = torch.Generator().manual_seed(1)
    acc_out, new_out = (torch.randn(2, 5, 3, 4, generator=g) for _ in range(2))
    acc_lse = torch.randn(2, 3, 5, generator=g)  # [B, H, n], written through its transposed view
    new_lse = torch.randn(2, 5, 3, generator=g)
    acc_lse[0, 1, 2] = -math.inf
    want_out, want_lse = merge([acc_out, new_out], [acc_lse.transpose(1, 2), new_lse])
    merge_into(acc_out, acc_lse.transpose(1, 2), new_out, new_lse)
    assert torch.equal(acc_out, want_out) and torch.equal(acc_lse.transpose(1, 2), want_lse)
