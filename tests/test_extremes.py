"""Numerical extremes: scores up to 1e4, rows without keys, all-equal scores, N = 1, one very long segment,
tiny and huge scales, NaN propagation, and bitwise determinism. On CPU: the cpu and reference backends, and the
Triton kernels through Triton's interpreter where tests/conftest.py switched it on. On a CUDA GPU (marker `gpu`:
`pytest -m gpu` selects them, conftest.py skips them without a GPU): the cuda backend, and the Triton kernels on
CUDA tensors (ids triton_gpu-...).

Expected values come from closed forms derived from docs/SPEC.md (`key_counts` below) where the case
has one, else from the float64 reference on the same (rounded) inputs; both are computed on CPU, so GPU results
are moved there before any comparison.
"""

import functools
import math
import os

import pytest
import torch
from cases import make_tensor
from parity import _grads

import dilated_attn
from dilated_attn.backends import CPU, TRITON
from dilated_attn.reference import (
    ERROR_FACTOR,
    ERROR_FLOOR,
    GRADIENT_ERROR_FLOOR,
    dilated_attention_bruteforce,
    dilated_attention_reference,
)
from dilated_attn.reference import max_error as _err

F16, BF16, F32, F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64

# The Triton kernels run on CPU tensors only through the interpreter (set up by conftest.py without a GPU, as
# test_triton.py relies on); it supports float32/float16 (it computes bfloat16 wrongly) and is slow, so it
# gets the small cases, mostly in float32.
INTERPRETER = (not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") == "1"
               and TRITON.unavailable() is None)
BACKENDS = ("cpu", "reference", "triton")
# Backends on CUDA tensors, by parameter name -> backend name ("triton" alone is the interpreter on CPU tensors).
# Every other parameter names a backend run on CPU tensors.
GPU_BACKENDS = {"cuda": "cuda", "triton_gpu": "triton"}
GPU_DTYPES = (F32, F16, BF16)
ALL_BACKENDS = (*BACKENDS, *GPU_BACKENDS)
# numpy, under the interpreter, warns about overflow/NaN in lanes that the kernels mask out afterwards.
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")
DTYPES = {"cpu": CPU.forward_op.dtypes, "reference": (F16, BF16, F32, F64), "triton": (F32, F16)}
NO_INTERPRETER = pytest.mark.skipif(not INTERPRETER,
                                    reason="Triton interpreter off (needs triton, TRITON_INTERPRET=1, no GPU)")


def device_of(backend):
    return "cuda" if backend in GPU_BACKENDS else "cpu"


def combos(dtypes, triton_dtypes=(F32,), kernel_xfail=None):
    """(backend, dtype) parameters: cpu and reference for every dtype they support, triton for
    `triton_dtypes` (skipped without the interpreter), and on the GPU cuda and triton_gpu for every dtype of
    `dtypes` they support (`triton_dtypes` only spares the slow interpreter). Both Triton variants are strict
    xfails with reason `kernel_xfail`, and so is cuda."""
    params = [pytest.param(b, d, id=f"{b}-{str(d)[6:]}") for b in ("cpu", "reference") for d in dtypes
              if d in DTYPES[b]]
    xfail = [pytest.mark.xfail(strict=True, reason=kernel_xfail)] if kernel_xfail else []
    params += [pytest.param("triton", d, id=f"triton-{str(d)[6:]}", marks=[NO_INTERPRETER, *xfail]) for d in dtypes
               if d in triton_dtypes]
    return params + [pytest.param(b, d, id=f"{b}-{str(d)[6:]}",
                                  marks=[pytest.mark.gpu, *xfail])
                     for b in GPU_BACKENDS for d in dtypes if d in GPU_DTYPES]


# Error against the float64 truth of the same (already rounded) inputs, relative to max(1, largest truth
# entry), for these small cases (<= ~40 keys a row). float64: rounding only. float32: float32 accumulation,
# about 30 ulps of 2^-24 (measured: 2e-7). float16/bfloat16: the kernels accumulate in float32 and round the
# result once to the storage dtype, so two ulps of it (2^-11, 2^-8; measured: 2.3e-4, 2.6e-3). LSE is float32
# for every input dtype but float64, so it gets the float32 tolerance.
TOL = {F64: 1e-12, F32: 2e-6, F16: 1e-3, BF16: 8e-3}
# Gradients: sums of P * (dP - delta) over the keys, where the subtraction cancels, rounded to the input dtype
# at the end: four times the above.
GRAD_TOL = {d: 4 * t for d, t in TOL.items()}


def assert_close(got, want, tol, what=""):
    size = want.abs().max().item() if want.numel() else 0.0
    err = _err(got, want)
    assert err <= tol * max(1.0, size), f"{what}: error {err:.3g} > {tol:.3g} x max(1, {size:.3g})"


def lse_tol(dtype):
    return TOL[F64] if dtype == F64 else TOL[F32]


def key_counts(N, Hq, segs, dils, head_groups="all", causal=False):
    """C[h, p, t]: in how many branches query p of head h receives key t, written from the spec's wording
    (not from dilated_attn.spec). The merged softmax is over this multiset of keys."""
    pos = torch.arange(N)
    C = torch.zeros(Hq, N, N, dtype=torch.long)
    m = len(segs)
    for i, (w, r) in enumerate(zip(segs, dils)):
        s = min(w, N)
        for h in range(Hq):
            if head_groups == "all":
                offset = h // math.ceil(Hq / r)
            else:  # group i: Hq // m heads, one more for the first Hq % m groups
                lo = i * (Hq // m) + min(i, Hq % m)
                if not lo <= h < lo + Hq // m + (i < Hq % m):
                    continue
                offset = i % r
            member = (pos % s) % r == offset
            mask = member[:, None] & member[None, :] & (pos[:, None] // s == pos[None, :] // s)
            if causal:
                mask &= pos[None, :] <= pos[:, None]
            C[h] += mask
    return C


def qkv(B, N, Hq, Hkv, D, dtype=F64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [make_tensor((B, N, h, D), dtype, "contiguous", g) for h in (Hq, Hkv, Hkv)]


def attend(q, k, v, segs, dils, backend, **kw):
    backend = GPU_BACKENDS.get(backend, backend)
    return dilated_attn.dilated_attention(q, k, v, segs, dils, return_lse=True, backend=backend, **kw)


def cotangents(out, lse, seed=5):
    """Random grad_out and grad_lse on CPU, nonzero everywhere (also where LSE = -inf)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(x.shape, generator=g, dtype=F64).to(x.dtype) for x in (out, lse)]


def grads(out, lse, inputs, go, gl):
    return torch.autograd.grad((out, lse), inputs, (go.to(out.device), gl.to(lse.device)))


def leaf(x, dtype, device="cpu"):
    return x.detach().to(device, dtype).requires_grad_()


def host(*xs):
    """Detached CPU copies, to compare with the CPU expectations (tensors of two devices do not mix)."""
    return [x.detach().cpu() for x in xs]


def kv_rows(Hq, Hkv, per_head):
    """[Hq, ...] boolean per query head -> [Hkv, ...]: any head of the kv head's GQA group."""
    return per_head.reshape(Hkv, Hq // Hkv, *per_head.shape[1:]).any(1)


# ---- scores of magnitude up to 1e4 --------------------------------------------------------------------------

@pytest.mark.parametrize("how", ["scale", "magnitude"])
@pytest.mark.parametrize("backend, dtype", combos((F64, F32, BF16, F16), triton_dtypes=(F32, F16)))
def test_scores_up_to_1e4(backend, dtype, how):
    """Near one-hot softmax rows: exp of score differences up to ~2e4 must not overflow (no inf/NaN where the
    float64 reference is finite), in float16 too, whose inputs here reach ~200."""
    B, N, Hq, Hkv, D, segs, dils = 1, 48, 4, 2, 16, [16, 48], [1, 2]
    q, k, v = qkv(B, N, Hq, Hkv, D)
    raw = torch.einsum("bphd,bthd->bhpt", q, k.repeat_interleave(Hq // Hkv, 2)).abs().max().item()
    if how == "scale":
        scale = 1e4 / raw
    else:  # default scale, large q and k
        scale, c = None, (1e4 * D**0.5 / raw) ** 0.5
        q, k = q * c, k * c
    q, k, v = (leaf(x, dtype, device_of(backend)) for x in (q, k, v))
    kw = dict(causal=how == "scale", scale=scale)
    out, lse = attend(q, k, v, segs, dils, backend, **kw)
    out, lse, *got_g = host(out, lse, *_grads(out, lse, (q, k, v)))
    x64 = [leaf(x, F64) for x in (q, k, v)]
    ref_out, ref_lse = dilated_attention_reference(*x64, segs, dils, **kw)
    assert 5e3 < ref_lse.abs().max() < 2e4, "the scores are not of the intended size"
    ref_g = _grads(ref_out, ref_lse, x64)
    for name, a, b in [("out", out, ref_out), ("lse", lse, ref_lse), *zip(("dq", "dk", "dv"), got_g, ref_g)]:
        assert torch.isfinite(a[torch.isfinite(b)]).all(), f"{name}: inf/NaN where the reference is finite"
    if dtype == F64:  # score rounding |S| * 2^-53 ~ 1e-12 becomes a relative error of the softmax weights
        for name, a, b in [("out", out, ref_out), ("lse", lse, ref_lse), *zip(("dq", "dk", "dv"), got_g, ref_g)]:
            assert_close(a, b, 1e-9, name)
        return
    # In low precision the error grows with |S| (a score of 1e4 in float32 is off by ~1e-3), so a fixed bound
    # does not fit: the package's rule (dilated_attn.reference.allowed_error), at most ERROR_FACTOR x the error of the
    # reference computed in `dtype` on the same inputs, plus a few ulps, relative to |LSE| for the LSE.
    # The gradients get one more term: the backward recomputes P = exp(S - LSE) from the float32 LSE the
    # forward stored (the spec's exact method, as in flash attention), whose rounding, up to |LSE| 2^-24 (with
    # the base-2 conversion), is a relative error of every P and so of the gradients; the autograd reference
    # keeps P and has no such term. Measured: 3e-4 relative at |LSE| = 1e4 (|LSE| 2^-24 = 6e-4).
    low = [leaf(x, dtype) for x in (q, k, v)]
    low_out, low_lse = dilated_attention_reference(*low, segs, dils, compute_dtype=dtype, **kw)
    big = ref_lse.abs().max().item()
    assert _err(out, ref_out) <= ERROR_FACTOR * _err(low_out, ref_out) + ERROR_FLOOR[dtype]
    assert _err(lse, ref_lse) <= ERROR_FACTOR * _err(low_lse, ref_lse) + ERROR_FLOOR[dtype] * big
    for name, a, b, c in zip(("dq", "dk", "dv"), got_g, ref_g, _grads(low_out, low_lse, low)):
        floor = GRADIENT_ERROR_FLOOR[dtype] + 4 * big * 2.0**-24
        assert _err(a, b) <= ERROR_FACTOR * _err(c, b) + floor * max(b.abs().max().item(), 1.0), name


# ---- rows without keys ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("head_groups", ["all", "split"])
@pytest.mark.parametrize("backend, dtype", combos((F64, F32, BF16, F16)))
def test_rows_without_keys(backend, dtype, head_groups):
    """Positions no branch covers: out exactly 0, LSE -inf, and zero gradient, even with a nonzero gradient
    arriving at their -inf LSE; keys no query reads get zero dk, dv."""
    B, N, Hq, Hkv, D, segs, dils = 2, 23, 4, 2, 8, [8, 12], [4, 6]
    C = key_counts(N, Hq, segs, dils, head_groups, causal=True)
    none = C.sum(-1) == 0  # [Hq, N]
    unread = ~kv_rows(Hq, Hkv, C.sum(1) > 0)  # [Hkv, N]: keys nobody reads
    assert 0 < none.sum() < none.numel() and unread.any()
    q, k, v = (leaf(x, dtype, device_of(backend)) for x in qkv(B, N, Hq, Hkv, D))
    kw = dict(causal=True, head_groups=head_groups)
    out, lse = attend(q, k, v, segs, dils, backend, **kw)
    go, gl = cotangents(out, lse)
    out, lse, dq, dk, dv = host(out, lse, *grads(out, lse, (q, k, v), go, gl))

    assert torch.isneginf(lse[:, none]).all() and torch.isfinite(lse[:, ~none]).all()
    assert (out.transpose(1, 2)[:, none] == 0).all()
    assert (dq.transpose(1, 2)[:, none] == 0).all()
    for g in (dk, dv):
        assert torch.isfinite(g).all() and (g.transpose(1, 2)[:, unread] == 0).all()
    x64 = [leaf(x, F64) for x in (q, k, v)]
    ref_out, ref_lse = dilated_attention_reference(*x64, segs, dils, **kw)
    ref_gl = gl.double().masked_fill(none, 0)  # the reference's -inf rows: the gradient there is 0 by the spec
    assert_close(out, ref_out, TOL[dtype], "out")
    assert_close(lse[:, ~none], ref_lse[:, ~none], lse_tol(dtype), "lse")
    for name, a, b in zip(("dq", "dk", "dv"), (dq, dk, dv), grads(ref_out, ref_lse, x64, go.double(), ref_gl)):
        assert_close(a, b, GRAD_TOL[dtype], name)


# ---- all-equal scores, N = 1: closed forms -------------------------------------------------------------------

def uniform_expected(C, v, score):
    """Every key of a row scores `score` [B, N, Hq]: out = the mean of v over the row's key multiset,
    LSE = score + log(count); rows without keys 0 / -inf."""
    Hq, Hkv = C.shape[0], v.shape[2]
    count = C.sum(-1).double()  # [Hq, N]
    weights = C.double() / count.clamp(min=1)[..., None]
    out = torch.einsum("hpt,bthd->bphd", weights, v.double().repeat_interleave(Hq // Hkv, 2))
    lse = (score.double() + torch.log(count).T).transpose(1, 2)  # log 0 = -inf where no key
    return out, torch.where(count > 0, lse, -math.inf)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("backend, dtype", combos((F64, F32, BF16, F16)))
def test_all_equal_scores_give_a_uniform_softmax(backend, dtype, causal):
    """k is one random vector per (batch, kv head) for every position (a stride-0 view along the sequence),
    so a row's scores are all equal: out is the mean of v over the row's key multiset (a key two branches
    give counts twice), LSE = score + log(count), and dq = grad_lse * scale * k (the softmax part of dq
    vanishes for uniform weights)."""
    B, N, Hq, Hkv, D, segs, dils, scale = 1, 37, 6, 3, 8, [10, 37, 16], [1, 3, 2], 0.3
    C = key_counts(N, Hq, segs, dils, causal=causal)
    q, k1, v = qkv(B, N, Hq, Hkv, D)
    device = device_of(backend)
    q, v = leaf(q, dtype, device), leaf(v, dtype, device)
    k = leaf(k1[:, :1], dtype, device).expand(B, N, Hkv, D).detach().requires_grad_()
    out, lse = attend(q, k, v, segs, dils, backend, causal=causal, scale=scale)
    go, gl = cotangents(out, lse)
    out, lse, dq, dk, dv, q, k, v = host(out, lse, *grads(out, lse, (q, k, v), go, gl), q, k, v)

    k_per_head = k.detach().double().repeat_interleave(Hq // Hkv, 2)  # [B, N, Hq, D], equal along N
    score = scale * (q.detach().double() * k_per_head).sum(-1)  # [B, N, Hq]
    want_out, want_lse = uniform_expected(C, v.detach(), score)
    has_key = torch.isfinite(want_lse)
    assert_close(out, want_out, TOL[dtype], "out")
    assert torch.equal(torch.isfinite(lse), has_key)
    assert_close(lse[has_key], want_lse[has_key], lse_tol(dtype), "lse")
    gl_rows = gl.double().masked_fill(~has_key, 0).transpose(1, 2)[..., None]  # [B, N, Hq, 1]
    assert_close(dq, gl_rows * scale * k_per_head, GRAD_TOL[dtype], "dq")
    x64 = [leaf(x, F64) for x in (q, k, v)]
    ref = dilated_attention_reference(*x64, segs, dils, causal=causal, scale=scale)
    ref_grads = grads(*ref, x64, go.double(), gl.double().masked_fill(~has_key, 0))
    assert_close(dk, ref_grads[1], GRAD_TOL[dtype], "dk")
    assert_close(dv, ref_grads[2], GRAD_TOL[dtype], "dv")


@pytest.mark.parametrize("head_groups", ["all", "split"])
@pytest.mark.parametrize("backend, dtype", combos((F64, F32, BF16, F16)))
def test_single_position(backend, dtype, head_groups):
    """N = 1: every segment is the one position, a member iff the head's offset is 0. A member head's softmax
    has one key (counted once per branch): out = v, LSE = scale q.k + log(count); dq = grad_lse scale k,
    dk = sum over the group's member heads of grad_lse scale q, dv = sum of grad_out."""
    B, Hq, Hkv, D, segs, dils, scale = 2, 6, 3, 5, [1, 4, 3], [1, 2, 5], 0.7
    count = key_counts(1, Hq, segs, dils, head_groups)[:, 0, 0].double()  # [Hq]
    member = count > 0
    assert member.any() and (head_groups == "all" or not member.all())
    q, k, v = (leaf(x, dtype, device_of(backend)) for x in qkv(B, 1, Hq, Hkv, D))
    out, lse = attend(q, k, v, segs, dils, backend, scale=scale, head_groups=head_groups)
    go, gl = cotangents(out, lse)
    out, lse, dq, dk, dv, q, k, v = host(out, lse, *grads(out, lse, (q, k, v), go, gl), q, k, v)

    qd, kd, vd = (x.detach().double() for x in (q, k, v))
    kh, vh = (x.repeat_interleave(Hq // Hkv, 2) for x in (kd, vd))  # per query head
    m = member[None, None, :, None].double()
    assert_close(out, m * vh, TOL[dtype], "out")
    want_lse = torch.where(member, scale * (qd * kh).sum(-1) + count.log(), -math.inf).transpose(1, 2)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(want_lse))
    assert_close(lse[:, member], want_lse[:, member], lse_tol(dtype), "lse")
    glm = gl.double().transpose(1, 2)[..., None] * m  # [B, 1, Hq, 1], 0 for non-members
    per_group = lambda x: x.reshape(B, 1, Hkv, Hq // Hkv, D).sum(3)  # noqa: E731
    assert_close(dq, glm * scale * kh, GRAD_TOL[dtype], "dq")
    assert_close(dk, per_group(glm * scale * qd), GRAD_TOL[dtype], "dk")
    assert_close(dv, per_group(go.double() * m), GRAD_TOL[dtype], "dv")


# ---- one very long segment -----------------------------------------------------------------------------------

@pytest.mark.parametrize("causal", [False, True])
def test_one_long_segment(causal):
    """N = 4096 in one branch (w = N, r = 1): dense attention over 4096 keys, float64 and float32 cpu kernels
    against the float64 reference (the Triton interpreter would take minutes here)."""
    N = 4096
    inputs = qkv(1, N, 2, 1, 16)
    ref_in = [leaf(x, F64) for x in inputs]
    ref_out, ref_lse = dilated_attention_reference(*ref_in, [N], [1], causal=causal)
    ref_grads = _grads(ref_out, ref_lse, ref_in)
    # float32 over 4096 keys: blocked sums of 4096 terms, errors of order log2(4096) x 2^-24 relative each;
    # measured 5e-7 (out), 1e-6 (LSE ~ 8), 3e-6 relative (gradients): the bounds leave a 10-20x margin.
    for dtype, tol, grad_tol in ((F64, 1e-12, 1e-11), (F32, 1e-5, 1e-4)):
        x = [leaf(t, dtype) for t in inputs]
        out, lse = attend(*x, [N], [1], "cpu", causal=causal)
        assert_close(out, ref_out, tol, f"out {dtype}")
        assert_close(lse, ref_lse, tol, f"lse {dtype}")
        for name, a, b in zip(("dq", "dk", "dv"), _grads(out, lse, x), ref_grads):
            assert_close(a, b, grad_tol, f"{name} {dtype}")


# ---- segment lengths and dilation rates beyond int64 ----------------------------------------------------------

HUGE = [([16, 2**63 - 1], [2**63 - 1, 3]), ([2**63, 8], [1, 2**70]), ([2**64 + 7], [5])]


@pytest.mark.parametrize("index", range(len(HUGE)))
@pytest.mark.parametrize("backend, dtype", combos((F64, F32)))
def test_huge_segment_lengths_and_dilations_equal_the_reference(backend, dtype, index):
    """The spec bounds neither w nor r: values near and beyond 2^63 give what the spec's definitions give (the ops
    get the same branches bounded by the sequence: Problem.op_branches); they used to overflow the kernels' int64
    (all-zero output, LSE -inf) or fail inside the op."""
    segs, dils = HUGE[index]
    inputs = qkv(2, 21, 4, 2, 8)
    # the brute force, written from the spec's definitions, takes the values as they are
    ref_out, ref_lse = dilated_attention_bruteforce(*inputs, segs, dils, causal=True)
    x = [leaf(t, dtype, device_of(backend)) for t in inputs]
    out, lse = attend(*x, segs, dils, backend, causal=True)
    assert_close(out.cpu(), ref_out, TOL[dtype], "out")
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse.cpu()), finite)
    assert_close(lse.cpu()[finite], ref_lse[finite], lse_tol(dtype), "lse")


# ---- tiny and huge scales ------------------------------------------------------------------------------------

@pytest.mark.parametrize("backend, dtype", combos((F64, F32)))
def test_tiny_scale_gives_a_uniform_softmax(backend, dtype):
    """scale 1e-30: every score ~1e-30, a uniform softmax over each row's key multiset (the closed form of the
    all-equal test), LSE = log(count)."""
    B, N, Hq, Hkv, D, segs, dils = 1, 33, 4, 2, 8, [11, 33], [1, 3]
    C = key_counts(N, Hq, segs, dils, causal=True)
    q, k, v = (leaf(x, dtype, device_of(backend)) for x in qkv(B, N, Hq, Hkv, D))
    out, lse = attend(q, k, v, segs, dils, backend, causal=True, scale=1e-30)
    out, lse, dq, dk, dv, v = host(out, lse, *grads(out, lse, (q, k, v), *cotangents(out, lse)), v)
    for name, x in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, dq, dk, dv)):
        assert torch.isfinite(x).all(), name
    want_out, want_lse = uniform_expected(C, v, torch.zeros(B, N, Hq))
    assert_close(out, want_out, TOL[dtype], "out")
    assert_close(lse, want_lse, lse_tol(dtype), "lse")


GPU_KERNEL_BACKWARD_OVERFLOW = (
    "known limit: the Triton and CUDA backwards rebuild P = exp2(s - LSE) from the float32 LSE; at scores of "
    "~1e31 an LSE a few ulps (~1e24) below a recomputed score overflows exp2, so dq/dk are not finite. Scores "
    "up to ~1e9 stay finite (ulp < 128); the forward is exact here")


@pytest.mark.parametrize("scale", [1e30, -1e30])
@pytest.mark.parametrize("backend, dtype", combos((F64, F32), kernel_xfail=GPU_KERNEL_BACKWARD_OVERFLOW))
def test_huge_scale_gives_a_hard_max(backend, dtype, scale):
    """scale +-1e30 (one branch, so no merge; see the next test): scores up to ~1e31, finite in float32. The
    softmax is a hard max: out = v of the row's best key, LSE = the best score, and since P is exactly
    one-hot only the LSE path has a gradient: dq = grad_lse * scale * k_best."""
    B, N, Hq, Hkv, D, segs, dils = 1, 33, 4, 2, 8, [11], [1]
    C = key_counts(N, Hq, segs, dils, causal=True)
    q, k, v = (leaf(x, dtype, device_of(backend)) for x in qkv(B, N, Hq, Hkv, D))
    out, lse = attend(q, k, v, segs, dils, backend, causal=True, scale=scale)
    go, gl = cotangents(out, lse)
    out, lse, dq, dk, dv, q, k, v = host(out, lse, *grads(out, lse, (q, k, v), go, gl), q, k, v)
    for name, x in (("out", out), ("lse", lse), ("dq", dq), ("dk", dk), ("dv", dv)):
        assert torch.isfinite(x).all(), name

    kh, vh = (x.detach().double().repeat_interleave(Hq // Hkv, 2) for x in (k, v))
    raw = torch.einsum("bphd,bthd->bhpt", q.detach().double(), kh)  # [B, Hq, N, N]
    signed = torch.where(C > 0, raw * math.copysign(1, scale), -math.inf)
    top2 = signed.topk(2, dim=-1).values
    # The precondition of a hard max that float32 rounding (~1e-7 relative) cannot flip: a clear winner.
    assert ((top2[..., 0] - top2[..., 1]) > 1e-5 * top2[..., 0].abs()).all()
    best = signed.argmax(-1)  # [B, Hq, N]
    at_best = lambda x: x.transpose(1, 2).gather(2, best[..., None].expand(-1, -1, -1, D)).transpose(1, 2)  # noqa: E731
    assert_close(out, at_best(vh), TOL[dtype], "out")
    want_lse = scale * raw.gather(-1, best[..., None])[..., 0]
    # LSE / |scale| is the best q.k, a float32 dot product whose terms may cancel: its error is a few ulps
    # of |q| |k| (~3 here), not of the result, hence an absolute bound, like the gradients'.
    assert_close(lse / abs(scale), want_lse / abs(scale), GRAD_TOL[dtype], "lse / |scale|")
    want_dq = gl.double().transpose(1, 2)[..., None] * math.copysign(1, scale) * at_best(kh)
    assert_close(dq / abs(scale), want_dq, GRAD_TOL[dtype], "dq / |scale|")


@pytest.mark.parametrize("backend, dtype", combos((F64, F32)))
def test_merge_weights_sum_to_one_at_large_lse(backend, dtype):
    """Two identical branches give every query the same key twice: the softmax over that multiset puts 1/2 on
    each copy, so out = v whatever the scale. The scores are exact here (q.k = 1), so any error is the merge's:
    weights exp(lse_i - LSE) with a rounded LSE would double out here; the merges normalise by their sum.
    Scores of 1e8 (float32) and 1e16 (float64) are where |LSE| * eps passes log(2)."""
    scale = {F32: 1e8, F64: 1e16}[dtype]
    x = torch.ones(1, 1, 1, 1, dtype=dtype, device=device_of(backend))
    out, lse = attend(x, x, x, [1, 1], [1, 1], backend, scale=scale)
    assert out.item() == 1.0, f"out = {out.item()} (LSE {lse.item():.9g})"


# ---- NaN propagation -----------------------------------------------------------------------------------------

CAUSAL_NAN_LEAK = ("known limit: with causal=True a masked probability 0 multiplies a NaN inside a tile's matrix "
                   "product (0 * NaN = NaN), in every backend: forward P @ V turns NaN the outputs of the earlier "
                   "queries of a NaN value's tile, which do not attend to it; backward dS @ K (NaN key) and "
                   "dS^T @ Q (NaN query) do the same to dq of earlier queries and dk of later keys")


@functools.lru_cache(maxsize=None)
def poisoned_run(backend, where, causal):
    """One NaN row of q (query 13 of head 2), or of k or v (key 13 of kv head 1), in batch 0 of float32 inputs.
    Returns the rows (batch 0) that read it by the spec [Hq, N], the keys those rows read [Hkv, N], the outputs
    and gradients (on CPU), and the float64 reference's on the inputs without the NaN. `backend` is a parameter
    name, so the cache tells triton (interpreter, CPU) from triton_gpu."""
    B, N, Hq, Hkv, D, segs, dils = 2, 40, 4, 2, 8, [8, 20, 40], [1, 2, 4]
    pos, head = 13, (2 if where == "q" else 1)
    C = key_counts(N, Hq, segs, dils, causal=causal)  # [Hq, N(query), N(key)]
    if where == "q":
        reads = torch.zeros(Hq, N, dtype=torch.bool)
        reads[head, pos] = True
    else:  # same segment, members of a branch, causal order: all in C
        reads = (C[:, :, pos] > 0) & (torch.arange(Hq) // (Hq // Hkv) == head)[:, None]
    assert 0 < reads.sum() < Hq * N
    # Keys read by a reading row, plus the NaN key itself: their dk/dv may pick up NaN through grad_out . out.
    keys_of_readers = kv_rows(Hq, Hkv, ((C > 0) & reads[:, :, None]).any(1))
    if where != "q":
        keys_of_readers[head, pos] = True
    clean = qkv(B, N, Hq, Hkv, D, dtype=F32)
    poisoned = [leaf(x, F32, device_of(backend)) for x in clean]
    with torch.no_grad():
        poisoned["qkv".index(where)][0, pos, head] = math.nan
    out, lse = attend(*poisoned, segs, dils, backend, causal=causal)
    go, gl = cotangents(out, lse)
    got = host(out, lse, *grads(out, lse, poisoned, go, gl))
    x64 = [leaf(x, F64) for x in clean]
    ref_out, ref_lse = dilated_attention_reference(*x64, segs, dils, causal=causal)
    ref = (ref_out, ref_lse, *grads(ref_out, ref_lse, x64, go.double(), gl.double()))
    return reads, keys_of_readers, got, [x.detach() for x in ref]


def nan_params(xfails, parts=("",)):
    """(backend, where, causal, part) with xfail marks from {(backend, where, causal, part): reason}; the Triton
    interpreter runs the causal cases only (it is slow), the GPU backends both."""
    out = []
    for b in ALL_BACKENDS:
        for w in "qkv":
            for c in (False, True) if b != "triton" else (True,):
                for part in parts:
                    key = (b, w, c, part)
                    marks = [pytest.mark.xfail(strict=True, reason=xfails[key])] if key in xfails else []
                    if b == "triton":
                        marks.append(NO_INTERPRETER)
                    if b in GPU_BACKENDS:
                        marks.append(pytest.mark.gpu)
                    name = "-".join(filter(None, (b, f"nan_{w}", "causal" if c else "full", part)))
                    out.append(pytest.param(b, w, c, part, id=name, marks=marks))
    return out


@pytest.mark.parametrize("backend, where, causal, part", nan_params(
    {**{(b, "v", True, "forward"): CAUSAL_NAN_LEAK for b in ALL_BACKENDS},
     **{(b, w, True, "backward"): CAUSAL_NAN_LEAK for b in ALL_BACKENDS for w in "qkv"}},
    parts=("forward", "backward")))
def test_nan_stays_in_the_rows_that_read_it(backend, where, causal, part):
    """Every row that does not read the NaN row by the spec (same segment, members of a branch, causal order;
    for q only its own row), and batch 1, stays finite and equal to the float64 reference on the inputs
    without the NaN: out and LSE (forward); dq, and dk/dv of the keys no reading row reads (backward)."""
    reads, keys_of_readers, got, ref = poisoned_run(backend, where, causal)
    B = got[0].shape[0]
    rows = torch.zeros(B, *reads.shape, dtype=torch.bool)  # [B, Hq, N]
    rows[0] = reads
    keys = torch.zeros(B, *keys_of_readers.shape, dtype=torch.bool)  # [B, Hkv, N]
    keys[0] = keys_of_readers
    heads_first = lambda x: x.transpose(1, 2)  # noqa: E731
    if part == "forward":
        # A NaN value enters only the weighted sum, so with v the LSE of every row must stay exact.
        checks = [("out", heads_first(got[0]), heads_first(ref[0]), rows, TOL[F32]),
                  ("lse", got[1], ref[1], rows if where != "v" else torch.zeros_like(rows), TOL[F32])]
    else:
        checks = [(n, heads_first(a), heads_first(b), m, GRAD_TOL[F32])
                  for n, a, b, m in zip(("dq", "dk", "dv"), got[2:], ref[2:], (rows, keys, keys))]
    for name, a, b, bad, tol in checks:
        assert torch.isfinite(a[~bad]).all(), f"{name}: the NaN reached rows that do not read it"
        assert_close(a[~bad], b[~bad], tol, name)


@pytest.mark.parametrize("backend, where, causal, part", nan_params({}))
def test_nan_shows_in_the_rows_that_read_it(backend, where, causal, part):
    """The rows that read the NaN have NaN outputs (IEEE: a NaN score or value makes the row's softmax sum
    NaN), and with a NaN query or key also a NaN LSE: neither -inf (which means 'no key') nor a finite value
    computed without the NaN branch."""
    reads, _, (out, lse, *_), _ = poisoned_run(backend, where, causal)
    assert torch.isnan(out[0].transpose(0, 1)[reads]).all(), "a row reading the NaN does not show it"
    if where != "v":
        assert torch.isnan(lse[0][reads]).all(), f"LSE of reading rows: {lse[0][reads].tolist()}"


# ---- determinism ---------------------------------------------------------------------------------------------

def assert_bitwise_deterministic(backend, dtype):
    B, N, Hq, Hkv, D, segs, dils = 2, 300, 4, 2, 24, [64, 128, 300], [1, 2, 4]
    inputs = qkv(B, N, Hq, Hkv, D, dtype=dtype, seed=3)
    results = []
    for _ in range(2):
        x = [leaf(t.clone(), dtype, device_of(backend)) for t in inputs]
        out, lse = attend(*x, segs, dils, backend, causal=True)
        results.append((out, lse, *grads(out, lse, x, *cotangents(out, lse))))
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), *results):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("dtype", [F64, F32, BF16])
def test_cpu_backend_is_bitwise_deterministic(dtype):
    """The same inputs twice give bit-identical out, LSE and gradients (work is split over threads by rows,
    with no atomics or reduction-order races; this runs with torch's default thread count)."""
    assert_bitwise_deterministic("cpu", dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [F32, BF16], ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("backend", list(GPU_BACKENDS))
def test_gpu_backends_are_bitwise_deterministic(backend, dtype):
    """As on CPU (the GPU kernels use no atomics). test_cuda_backend.py and test_triton.py check out and the
    q, k, v gradients in bfloat16; this adds the LSE and its gradient path, and float32."""
    assert_bitwise_deterministic(backend, dtype)
