"""The fa4 backend (backends/fa4): its ops' plan, stores, merges and gradient additions against the reference through
FlashAttention-4's contract in float64 on CPU (CI has no flash-attn-4), and the real kernels on a Hopper GPU."""

from __future__ import annotations

import math
import random

import pytest
import torch

import dilated_attn
from dilated_attn.backends.fa4 import ops
from dilated_attn.reference import allowed_error, dilated_attention_reference, max_error

from cases import make_qkv, random_case
from parity import math_attend, math_attend_backward, poison_allocator

CASES = [random_case(random.Random(4700 + i), max_seq=80) for i in range(24)]


def _bhsd(x):
    """FlashAttention's `[b, s, h, d]` as the math contract's `[b, h, s, d]` (and back)."""
    return x.transpose(1, 2)


class MathInterface:
    """flash_attn.cute.interface's two calls the ops use, as their contract in float64 (parity.math_attend and
    math_attend_backward on transposed views): results preallocated or returned, the LSE `[b, h, s]`, the backward's
    `delta = rowsum(dO * out) - dLSE`, dK/dV summed per kv head."""

    forward_calls = 0
    stored_in_place = 0

    @classmethod
    def _flash_attn_fwd(cls, q, k, v, softmax_scale, causal=False, return_lse=False, out=None, lse=None):
        cls.forward_calls += 1
        rows, rows_lse = math_attend(_bhsd(q), _bhsd(k), _bhsd(v), causal, softmax_scale)
        if out is None:
            return _bhsd(rows), rows_lse, None, None, None
        assert out.stride(-1) == 1 and lse.stride(-1) == 1, "FlashAttention writes unit-stride rows only"
        cls.stored_in_place += 1
        out.copy_(_bhsd(rows))
        lse.copy_(rows_lse)
        return out, lse, None, None, None

    @staticmethod
    def _flash_attn_bwd(q, k, v, out, dout, lse, softmax_scale, causal=False, deterministic=False, dlse=None,
                        dq=None, dk=None, dv=None):
        grads = [_bhsd(g) for g in math_attend_backward(_bhsd(dout), _bhsd(q), _bhsd(k), _bhsd(v), _bhsd(out), lse,
                                                         causal, softmax_scale, grad_lse=dlse)]
        given = (dq, dk, dv)
        if all(x is not None for x in given):
            for target, g in zip(given, grads):
                target.copy_(g)
            return given
        return tuple(grads)


@pytest.fixture
def math_interface(monkeypatch):
    monkeypatch.setattr(ops, "fa", MathInterface)
    MathInterface.forward_calls = MathInterface.stored_in_place = 0
    yield MathInterface


def _poisoned_empty(monkeypatch):
    """torch.empty / empty_like give NaN-filled floating-point tensors: an element the ops do not write shows."""
    for name in ("empty", "empty_like"):
        make = getattr(torch, name)

        def poisoned(*args, _make=make, **kwargs):
            x = _make(*args, **kwargs)
            return x.fill_(math.nan) if x.is_floating_point() else x

        monkeypatch.setattr(torch, name, poisoned)


def _args(case):
    return (list(case.segment_lengths), list(case.dilation_rates), case.head_groups == "split", case.causal,
            case.head_dim ** -0.5)


@pytest.mark.parametrize("pieces", ["whole", "split"])
@pytest.mark.parametrize("index", range(len(CASES)))
def test_ops_equal_the_reference(index, pieces, math_interface, monkeypatch):
    """out, LSE and gradients with an LSE gradient too, every case's layout, calls whole or cut into pieces."""
    case = CASES[index]
    if pieces == "split":
        if index % 3:
            pytest.skip("a third of the cases is enough")
        monkeypatch.setattr(ops, "MAX_CALL_ELEMENTS", 64)
        monkeypatch.setattr(ops, "MAX_BACKWARD_CALL_ELEMENTS", 64)
    q, k, v = make_qkv(case, dtype=torch.float64, seed=index)
    _poisoned_empty(monkeypatch)
    out, lse = ops.fa4_forward(q, k, v, *_args(case))
    g = torch.Generator().manual_seed(index)
    grad_out = torch.randn(out.shape, generator=g, dtype=torch.float64)
    grad_lse = torch.randn(lse.shape, generator=g, dtype=torch.float64)
    ref = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ref_out, ref_lse = dilated_attention_reference(*ref, case.segment_lengths, case.dilation_rates, **case.kwargs())
    finite = torch.isfinite(ref_lse)
    torch.testing.assert_close(out, ref_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-12, atol=1e-12)
    grad_lse = torch.where(finite, grad_lse, 0)  # rows without keys: their LSE is -inf, and has no gradient
    through_out = (ref_out * grad_out).sum()
    through_lse = (torch.where(finite, ref_lse, 0) * grad_lse).sum()
    expected = {False: torch.autograd.grad(through_out, ref, retain_graph=True),
                True: torch.autograd.grad(through_out + through_lse, ref)}
    for with_lse_gradient, want in expected.items():
        grads = ops.fa4_backward(grad_out, grad_lse if with_lse_gradient else None, q, k, v, out, lse,
                                 *_args(case))
        for got, exp in zip(grads, want):
            torch.testing.assert_close(got, exp, rtol=1e-10, atol=1e-10)

def test_longnet_first_branch_stores_in_place(math_interface):
    """LongNet's dilation-1 branch is written by the kernel into the results (no copy, no merge); the others merge."""
    q, k, v = (torch.randn(1, 64, 8, 8, dtype=torch.float64) for _ in range(3))
    out, lse = ops.fa4_forward(q, k, v, [16, 32, 64], [1, 2, 4], False, False, 0.3)
    assert math_interface.stored_in_place == 1 and math_interface.forward_calls > 1
    ref_out, ref_lse = dilated_attention_reference(q, k, v, [16, 32, 64], [1, 2, 4], scale=0.3)
    torch.testing.assert_close(out, ref_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-12, atol=1e-12)


def test_fa4_verdict_without_flash_attn(monkeypatch):
    """Where flash-attn-4 is not installed the backend says so (and how to install it), without importing it."""
    from dilated_attn.backends import fa4

    monkeypatch.setattr(fa4, "_installed", lambda: False)
    assert "pip install .[fa4]" in fa4.FA4.unavailable()
    with pytest.raises(RuntimeError, match=r"fa4 backend cannot run: flash-attn-4 is not installed"):
        fa4.FA4.ops()


# --- GPU: the real FlashAttention-4 -----------------------------------------------------------------------------

GPU_CASES = [
    dict(B=1, N=4096, H=16, D=128, segs=[512, 1024, 2048, 4096], dils=[1, 2, 4, 8], groups="all"),
    dict(B=1, N=4096, H=16, Hkv=4, D=128, segs=[512, 1024, 2048, 4096], dils=[1, 2, 4, 8], groups="all"),
    dict(B=2, N=1000, H=8, Hkv=1, D=64, segs=[128, 300, 1000], dils=[1, 3, 4], groups="all"),
    dict(B=2, N=777, H=6, Hkv=2, D=64, segs=[100, 300, 2000], dils=[2, 3, 5], groups="split"),
    dict(B=3, N=513, H=5, D=96, segs=[64, 512], dils=[1, 7], groups="all"),
    dict(B=2, N=1025, H=4, D=64, segs=[256, 1024, 4], dils=[1, 2, 8], groups="all"),  # one-member calls
]


def _skip_without_fa4():
    why = dilated_attn.backends.FA4.unavailable()
    if why is not None:
        pytest.skip(why)
    if torch.cuda.get_device_capability()[0] not in (9, 10, 11):
        pytest.skip("FlashAttention-4 runs on Hopper and Blackwell")


@pytest.mark.gpu
@pytest.mark.parametrize("lse_gradient", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("index", range(len(GPU_CASES)))
def test_gpu_parity(index, causal, dtype, lse_gradient):
    _skip_without_fa4()
    c = GPU_CASES[index]
    g = torch.Generator().manual_seed(index)
    q, k, v = (torch.randn(c["B"], c["N"], h, c["D"], generator=g).to("cuda", dtype)
               for h in (c["H"], c.get("Hkv", c["H"]), c.get("Hkv", c["H"])))
    if index % 2:  # heads-first storage: the views of a non-contiguous layout
        q = q.transpose(1, 2).contiguous().transpose(1, 2)
    kw = dict(causal=causal, head_groups=c["groups"])
    poison_allocator()
    inputs = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    out, lse = dilated_attn.dilated_attention(*inputs, c["segs"], c["dils"], return_lse=True, backend="fa4", **kw)
    grad_out = torch.randn(out.shape, generator=g).to("cuda", dtype)
    grad_lse = torch.randn(lse.shape, generator=g).to("cuda")
    ref = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ref_out, ref_lse = dilated_attention_reference(*ref, c["segs"], c["dils"], **kw)
    low = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    low_out, low_lse = dilated_attention_reference(*low, c["segs"], c["dils"], compute_dtype=dtype, **kw)
    finite = torch.isfinite(ref_lse)
    grad_lse = torch.where(finite, grad_lse, 0) if lse_gradient else None

    def grads_of(o, l_, xs, go):
        loss = (o.double() * go.double()).sum()
        if grad_lse is not None:
            loss = loss + (torch.where(finite, l_.double(), 0) * grad_lse.double()).sum()
        return torch.autograd.grad(loss, xs)

    grads = grads_of(out, lse, inputs, grad_out)
    ref_grads = grads_of(ref_out, ref_lse, ref, grad_out)
    low_grads = grads_of(low_out, low_lse, low, grad_out)
    assert torch.isfinite(out).all()
    assert max_error(out, ref_out) <= allowed_error(dtype, max_error(low_out, ref_out))
    assert torch.equal(torch.isfinite(lse), finite) and (out.transpose(1, 2)[~finite] == 0).all()
    assert max_error(lse[finite], ref_lse[finite]) <= allowed_error(
        dtype, max_error(low_lse[finite], ref_lse[finite]))
    for name, a, b, lo in zip("qkv", grads, ref_grads, low_grads):
        largest = b.abs().max().item()
        assert max_error(a, b) <= allowed_error(dtype, max_error(lo, b), gradient=True, largest=largest), name


@pytest.mark.gpu
@pytest.mark.parametrize("nq, nk, kv_heads", [(1000, 3000, 4), (3000, 1000, 2), (2, 4097, 1)])
def test_gpu_dense_ops_take_unequal_lengths(nq, nk, kv_heads):
    """The ring's joined blocks: FlashAttention-4 over keys of another length, against float64 math."""
    _skip_without_fa4()
    g = torch.Generator().manual_seed(nq + nk)
    q, go = (torch.randn(2, nq, 4, 64, generator=g).to("cuda", torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(2, nk, kv_heads, 64, generator=g).to("cuda", torch.bfloat16) for _ in range(2))
    forward, backward = dilated_attn.backends.FA4.dense_ops()
    out, lse = forward(q, k, v, 0.3)
    grads = backward(go, q, k, v, out, lse, 0.3)
    exact = [x.cpu().double() for x in (q, k, v, go)]
    ref_out, ref_lse, *_ = MathInterface._flash_attn_fwd(*exact[:3], 0.3)
    ref_grads = MathInterface._flash_attn_bwd(*exact[:3], ref_out, exact[3], ref_lse, 0.3)
    assert max_error(out.cpu(), ref_out) <= allowed_error(torch.bfloat16, 0.0)
    assert max_error(lse.cpu(), ref_lse) <= 1e-4 * (1 + ref_lse.abs().max().item())
    for a, b in zip(grads, ref_grads):
        assert max_error(a.cpu(), b) <= allowed_error(torch.bfloat16, 0.0, gradient=True,
                                                      largest=b.abs().max().item())



@pytest.mark.parametrize("installed, causal, kv_heads, backward, first", [
    (True, False, 16, False, "fa4"), (True, True, 16, False, "fa4"), (True, False, 4, False, "fa4"),
    (True, True, 4, False, "cudnn"), (True, True, 4, True, "fa4"), (False, False, 16, True, "cudnn")])
def test_auto_prefers_fa4_where_installed_and_measured_faster(monkeypatch, installed, causal, kv_heads, backward,
                                                               first):
    """auto's rule, without a GPU: fa4 before cudnn on Hopper where flash-attn-4 is installed, except causal
    grouped-query calls without a backward; the verdict imports nothing."""
    import dataclasses

    from dilated_attn import dispatch
    from dilated_attn.backends import compiled, fa4
    from dilated_attn.spec import validate

    monkeypatch.setattr(compiled, "_KERNELS", {"cpu": True, "cuda": True})
    monkeypatch.setattr(dispatch.cudnn_backend.CUDNN, "why_not", lambda p: None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(fa4, "_installed", lambda: installed)
    monkeypatch.setattr(fa4._loader, "_load", lambda: pytest.fail("a verdict imported flash-attn-4"))
    q = torch.empty(1, 65536, 16, 128, dtype=torch.bfloat16, device="meta", requires_grad=backward)
    kv = torch.empty(1, 65536, kv_heads, 128, dtype=torch.bfloat16, device="meta")
    p = dataclasses.replace(validate(q, kv, kv, [2048, 4096], [1, 2], causal=causal), device=torch.device("cuda", 0))
    assert p.records_backward == backward
    assert dispatch.auto_preference(p)[0] == first


def test_packed_sequences_run_one_at_a_time(math_interface, monkeypatch):
    """dilated_attention_varlen's per-sequence path on the fa4 ops (float64 through the contract): each sequence
    equals the reference on it alone, empty ones included, the gradients too."""
    from dilated_attn.backends import fa4
    from dilated_attn.spec import validate_varlen

    monkeypatch.setattr(fa4, "_installed", lambda: True)
    monkeypatch.setattr(fa4._loader, "done", True)
    monkeypatch.setattr(fa4._loader, "error", None)
    segs, dils = [8, 16], [1, 2]  # sequences of 5, 0, 17 and 40 tokens
    cu = torch.tensor([0, 5, 5, 22, 62], dtype=torch.int32)
    q, k, v = (torch.randn(62, 4, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    p = validate_varlen(q, k, v, cu, segs, dils, causal=True)
    out, lse = fa4.FA4.forward_varlen(q, k, v, p)
    grads = torch.autograd.grad((out * out).sum() + lse.sum(), (q, k, v))
    want_out, want_lse = [], []
    for a, b in zip(cu.tolist(), cu.tolist()[1:]):
        if b > a:
            o, lse_ = dilated_attention_reference(q[None, a:b], k[None, a:b], v[None, a:b], segs, dils, causal=True)
            want_out.append(o[0])
            want_lse.append(lse_[0])
    want_out, want_lse = torch.cat(want_out), torch.cat(want_lse, dim=1)
    torch.testing.assert_close(out, want_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, want_lse, rtol=1e-12, atol=1e-12)
    want = torch.autograd.grad((want_out * want_out).sum() + want_lse.sum(), (q, k, v))
    for got, exp in zip(grads, want):
        torch.testing.assert_close(got, exp, rtol=1e-10, atol=1e-10)
