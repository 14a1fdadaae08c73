"""The compiled CPU backend against the reference: float64 parity, low-precision error bounds, gradcheck,
opcheck, layouts and edge sizes."""

import math
import random

import pytest
import torch
from cases import make_qkv, random_case, uncovered_positions

import dilated_attn
from dilated_attn import backends, dispatch
from dilated_attn.reference import allowed_error, dilated_attention_reference, max_error
from dilated_attn.spec import validate

NUM_CASES = 240
CASES = [random_case(random.Random(index), max_seq=96) for index in range(NUM_CASES)]


@pytest.fixture(params=["native", "baseline"])
def isa(request, monkeypatch):
    """Run the CPU kernels with the CPU's best instruction set, and again with the baseline build (what CPUs
    without AVX2, and non-x86 CPUs, run)."""
    if request.param == "baseline":
        monkeypatch.setenv("DILATED_ATTN_CPU_ISA", "baseline")
        assert dilated_attn.build_info()["cpu_isa"] == "baseline"
    return request.param


def _grads(out, lse, inputs, seed=7):
    g = torch.Generator().manual_seed(seed)
    go = torch.randn(out.shape, generator=g, dtype=torch.float64).to(out.dtype)
    gl = torch.randn(lse.shape, generator=g, dtype=torch.float64).to(lse.dtype)
    loss = (out * go).sum() + (lse.masked_fill(~torch.isfinite(lse), 0) * gl).sum()
    return torch.autograd.grad(loss, inputs)


def test_cases_cover_the_input_space():
    """The random cases include every feature the parity test is meant to exercise."""
    def has(pred):
        return any(pred(c) for c in CASES)

    assert has(lambda c: c.num_heads != c.num_kv_heads)  # GQA
    assert has(lambda c: c.num_kv_heads == 1 and c.num_heads > 1)  # MQA
    assert has(lambda c: c.head_groups == "split") and has(lambda c: c.head_groups == "all")
    assert has(lambda c: c.causal) and has(lambda c: not c.causal)
    assert has(lambda c: any(c.seq_len % w and w < c.seq_len for w in c.segment_lengths))  # partial segment
    assert has(lambda c: any(w > c.seq_len for w in c.segment_lengths))
    assert has(lambda c: any(r > w for w, r in zip(c.segment_lengths, c.dilation_rates)))
    assert has(lambda c: c.head_dim % 2 == 1)
    assert has(lambda c: c.layout == "transposed") and has(lambda c: c.layout == "strided")
    assert has(lambda c: len(c.segment_lengths) >= 3)
    assert sum(uncovered_positions(c) for c in CASES) >= 20


@pytest.mark.parametrize("index", range(NUM_CASES))
def test_float64_parity(index, isa):
    case = CASES[index]
    q, k, v = make_qkv(case, seed=index)
    args = (q, k, v, case.segment_lengths, case.dilation_rates)
    out, lse = dilated_attn.dilated_attention(*args, return_lse=True, backend="cpu", **case.kwargs())
    ref_out, ref_lse = dilated_attention_reference(*args, **case.kwargs())
    assert out.is_contiguous() and out.dtype == torch.float64 and lse.dtype == torch.float64
    assert out.shape == q.shape and lse.shape == (case.batch, case.num_heads, case.seq_len)
    # Uncovered rows: exactly 0 and -inf, like the reference.
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    assert (out.transpose(1, 2)[torch.isneginf(lse)] == 0).all()
    torch.testing.assert_close(out, ref_out, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-9, atol=1e-12)
    for name, a, b in zip("qkv", _grads(out, lse, (q, k, v)), _grads(ref_out, ref_lse, (q, k, v))):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11, msg=f"grad {name}")


# Error bound for reduced precision: the package's tolerance rule (dilated_attn.reference.allowed_error).
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("index", range(0, NUM_CASES, 12))
def test_reduced_precision_error_bound(dtype, index, isa):
    case = CASES[index]
    q, k, v = make_qkv(case, dtype=dtype, seed=index)
    args = (case.segment_lengths, case.dilation_rates)
    out, lse = dilated_attn.dilated_attention(q, k, v, *args, return_lse=True, backend="cpu", **case.kwargs())
    assert out.dtype == dtype and lse.dtype == torch.float32
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    ref_out, ref_lse = dilated_attention_reference(q64, k64, v64, *args, **case.kwargs())
    low_inputs = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    low_out, low_lse = dilated_attention_reference(*low_inputs, *args, compute_dtype=dtype, **case.kwargs())

    err = max_error
    assert err(out, ref_out) <= allowed_error(dtype, err(low_out, ref_out))
    finite = torch.isfinite(ref_lse)
    assert torch.equal(finite, torch.isfinite(lse))
    assert err(lse[finite], ref_lse[finite]) <= allowed_error(dtype, err(low_lse[finite], ref_lse[finite]))
    grads = _grads(out, lse, (q, k, v))
    ref_grads = _grads(ref_out, ref_lse, (q64, k64, v64))
    low_grads = _grads(low_out, low_lse, low_inputs)
    for name, a, b, c in zip("qkv", grads, ref_grads, low_grads):
        assert err(a, b) <= allowed_error(dtype, err(c, b), gradient=True, largest=b.abs().max().item()), f"grad {name}"


GRADCHECK_CASES = [
    # (B, N, Hq, Hkv, D, segs, dils, head_groups, causal)
    (1, 7, 2, 1, 3, [4, 7], [1, 2], "all", False),
    (2, 9, 3, 3, 2, [3, 5], [2, 1], "split", True),
    (1, 10, 4, 2, 5, [20, 4, 2], [3, 2, 1], "all", True),
]


@pytest.mark.parametrize("config", GRADCHECK_CASES)
def test_gradcheck(config):
    B, N, Hq, Hkv, D, segs, dils, groups, causal = config
    q = torch.randn(B, N, Hq, D, dtype=torch.float64, requires_grad=True)
    k = torch.randn(B, N, Hkv, D, dtype=torch.float64, requires_grad=True)
    v = torch.randn(B, N, Hkv, D, dtype=torch.float64, requires_grad=True)

    def f(q, k, v):
        out, lse = dilated_attn.dilated_attention(
            q, k, v, segs, dils, causal=causal, head_groups=groups, return_lse=True, backend="cpu"
        )
        return out, lse.masked_fill(torch.isneginf(lse), 0.0)  # -inf rows have no derivative to check

    assert torch.autograd.gradcheck(f, (q, k, v))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("config", GRADCHECK_CASES)
def test_opcheck(config, dtype):
    B, N, Hq, Hkv, D, segs, dils, groups, causal = config
    q = torch.randn(B, N, Hq, D, dtype=dtype, requires_grad=True)
    k = torch.randn(B, N, Hkv, D, dtype=dtype, requires_grad=True)
    v = torch.randn(B, N, Hkv, D, dtype=dtype, requires_grad=True)
    split = groups == "split"
    torch.library.opcheck(torch.ops.dilated_attn.forward.default, (q, k, v, segs, dils, split, causal, 0.4))
    out, lse = torch.ops.dilated_attn.forward(q.detach(), k.detach(), v.detach(), segs, dils, split, causal, 0.4)
    grad_out, grad_lse = torch.randn_like(out), torch.randn_like(lse)
    torch.library.opcheck(
        torch.ops.dilated_attn.backward.default,
        (grad_out, grad_lse, q.detach(), k.detach(), v.detach(), out, lse, segs, dils, split, causal, 0.4),
    )


@pytest.mark.parametrize("shape", [(1, 1, 1, 1), (2, 1, 4, 8), (1, 0, 2, 4), (0, 5, 2, 4)])
def test_degenerate_sizes(shape):
    """N = 1, D = 1 and empty batch/sequence run and agree with the reference."""
    q, k, v = (torch.randn(shape, dtype=torch.float64, requires_grad=True) for _ in range(3))
    out, lse = dilated_attn.dilated_attention(q, k, v, [3, 1], [2, 1], return_lse=True, backend="cpu")
    ref_out, ref_lse = dilated_attention_reference(q, k, v, [3, 1], [2, 1])
    assert out.shape == q.shape and lse.shape == (shape[0], shape[2], shape[1])
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(lse, ref_lse)
    out.sum().backward()
    assert q.grad.shape == q.shape


def test_long_segment_blocks():
    """Segments longer than one tile (64 keys) with causal masking across tile borders, several heads."""
    q, k, v = (torch.randn(1, 300, 2, 16, dtype=torch.float64, requires_grad=True) for _ in range(3))
    for causal in (False, True):
        args = (q, k, v, [300, 150], [1, 2])
        out, lse = dilated_attn.dilated_attention(*args, causal=causal, return_lse=True, backend="cpu")
        ref_out, ref_lse = dilated_attention_reference(*args, causal=causal)
        torch.testing.assert_close(out, ref_out, rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(lse, ref_lse, rtol=1e-9, atol=1e-12)
        for a, b in zip(_grads(out, lse, (q, k, v)), _grads(ref_out, ref_lse, (q, k, v))):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


def test_gradient_without_lse_output():
    """Backward when only `out` is used (the LSE output's gradient is absent)."""
    q, k, v = (torch.randn(2, 33, 2, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    out = dilated_attn.dilated_attention(q, k, v, [8, 16], [1, 2], causal=True, backend="cpu")
    ref = dilated_attention_reference(q, k, v, [8, 16], [1, 2], causal=True)[0]
    go = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), go), torch.autograd.grad(ref, (q, k, v), go)):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


def test_repeated_calls_are_bitwise_identical():
    q, k, v = (torch.randn(2, 130, 4, 24) for _ in range(3))
    first = dilated_attn.dilated_attention(q, k, v, [64, 128], [1, 2], backend="cpu")
    for _ in range(3):
        assert torch.equal(first, dilated_attn.dilated_attention(q, k, v, [64, 128], [1, 2], backend="cpu"))


def test_auto_picks_the_cpu_kernel_for_cpu_tensors():
    q = torch.randn(1, 8, 2, 4)
    p = validate(q, q, q, [4], [1])
    assert dispatch.select(p, "auto").name == "cpu"
    assert backends.verdicts(p)["cpu"] is None and backends.verdicts(p)["reference"] is None
    assert "CUDA" in backends.verdicts(p)["cuda"]


def test_requires_no_grad():
    q = torch.randn(1, 9, 2, 4)
    out = dilated_attn.dilated_attention(q, q, q, [4], [2], backend="cpu")
    assert not out.requires_grad
    torch.testing.assert_close(out, dilated_attention_reference(q, q, q, [4], [2])[0], rtol=1e-5, atol=1e-6)


def test_lse_is_natural_log_of_the_normaliser():
    q, k, v = (torch.randn(1, 5, 1, 3, dtype=torch.float64) for _ in range(3))
    _, lse = dilated_attn.dilated_attention(q, k, v, [5], [1], scale=0.7, return_lse=True, backend="cpu")
    scores = 0.7 * torch.einsum("nd,md->nm", q[0, :, 0], k[0, :, 0])
    assert math.isclose(lse[0, 0, 2].item(), torch.logsumexp(scores[2], 0).item(), rel_tol=1e-12)


def test_torch_compile_fullgraph_matches_eager():
    """The CPU op traces under torch.compile(fullgraph=True) (no graph break), forward and backward."""
    q, k, v = (torch.randn(2, 70, 4, 16, requires_grad=True) for _ in range(3))

    def f(q, k, v):
        return dilated_attn.dilated_attention(q, k, v, [16, 32], [1, 2], causal=True)

    compiled = torch.compile(f, fullgraph=True)
    out, eager = compiled(q, k, v), f(q, k, v)
    torch.testing.assert_close(out, eager, rtol=0, atol=0)
    go = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), go), torch.autograd.grad(eager, (q, k, v), go)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("backend", ["cpu", "auto"])
def test_double_backward_raises_where_the_backward_is_not_differentiable(backend):
    """create_graph=True through a backend whose backward op is not differentiable (cpu, which auto runs on CPU
    tensors) raises, where its second derivative was silently 0; the reference differentiates twice, as float64
    gradgradcheck accepts."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 12, 2, 4, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    branches = ([4, 12], [1, 2])
    out = dilated_attn.dilated_attention(q, k, v, *branches, backend=backend)
    with pytest.raises(RuntimeError, match=r"double backward \(create_graph=True\) is not supported"):
        torch.autograd.grad((out * out).sum(), (q, k, v), create_graph=True)
    (grad_q,) = torch.autograd.grad((out * out).sum(), (q,), retain_graph=True)  # a first backward still runs
    assert grad_q.abs().sum() > 0
    out = dilated_attn.dilated_attention(q, k, v, *branches, backend="reference")
    grads = torch.autograd.grad((out * out).sum(), (q, k, v), create_graph=True)
    second = torch.autograd.grad(sum(x.sum() for x in grads), q)[0]
    assert second.abs().sum() > 1
    assert torch.autograd.gradgradcheck(lambda *x: dilated_attn.dilated_attention(*x, *branches, backend="reference"),
                                        (q, k, v))
