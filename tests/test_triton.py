"""The Triton backend against the reference: on the GPU (marker `gpu`), and without one through Triton's
interpreter on CPU tensors (small sizes, float32/float16: the interpreter computes bfloat16 wrongly)."""

import math
import random

import pytest
import torch

import dilated_attn
from dilated_attn.reference import dilated_attention_reference

from cases import make_qkv, random_case

triton = pytest.importorskip("triton")

HAS_CUDA = torch.cuda.is_available()
interpreter = pytest.mark.skipif(HAS_CUDA, reason="interpreter tests run where there is no GPU")


def _grads(out, lse, inputs, seed=11):
    g = torch.Generator().manual_seed(seed)
    go = torch.randn(out.shape, generator=g, dtype=torch.float64).to(out.device, out.dtype)
    gl = torch.randn(lse.shape, generator=g, dtype=torch.float64).to(lse.device, lse.dtype)
    loss = (out * go).sum() + (lse.masked_fill(~torch.isfinite(lse), 0) * gl).sum()
    return torch.autograd.grad(loss, inputs)


def _err(a, b):
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


# As for the CPU backend (see test_cpu_backend.py): the kernel's error against float64 is at most FACTOR x
# that of the reference computed in the kernel's dtype, plus a floor of a few ulps of the storage dtype
# (relative to the largest entry for gradients). The kernels round P and dS to the input dtype before the
# second matmul, as flash attention does, so bf16/fp16 gradients carry that rounding.
FACTOR = 2.0
FLOOR = {torch.float32: 2e-6, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}
GRAD_FLOOR = {torch.float32: 2e-5, torch.bfloat16: 3e-2, torch.float16: 4e-3}


def check_against_reference(case, dtype, device, seed):
    q, k, v = make_qkv(case, dtype=dtype, seed=seed, device=device)
    args = (case.segment_lengths, case.dilation_rates)
    torch.manual_seed(seed)
    out, lse = dilated_attn.dilated_attention(q, k, v, *args, return_lse=True, backend="triton", **case.kwargs())
    assert out.dtype == dtype and out.is_contiguous() and lse.dtype == torch.float32
    inputs64 = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ref_out, ref_lse = dilated_attention_reference(*inputs64, *args, **case.kwargs())
    low_inputs = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    low_out, low_lse = dilated_attention_reference(*low_inputs, *args, compute_dtype=dtype, **case.kwargs())

    finite = torch.isfinite(ref_lse)
    assert torch.equal(finite, torch.isfinite(lse)), "covered positions differ"
    assert (out.transpose(1, 2)[~finite] == 0).all(), "uncovered positions must be exactly 0"
    assert _err(out, ref_out) <= FACTOR * _err(low_out, ref_out) + FLOOR[dtype]
    assert _err(lse[finite], ref_lse[finite]) <= FACTOR * _err(low_lse[finite], ref_lse[finite]) + FLOOR[dtype]
    grads = _grads(out, lse, (q, k, v))
    ref_grads = _grads(ref_out, ref_lse, inputs64)
    low_grads = _grads(low_out, low_lse, low_inputs)
    for name, a, b, c in zip("qkv", grads, ref_grads, low_grads):
        assert torch.isfinite(a).all(), f"grad {name} not finite"
        size = max(b.abs().max().item() if b.numel() else 0.0, 1.0)
        assert _err(a, b) <= FACTOR * _err(c, b) + GRAD_FLOOR[dtype] * size, f"grad {name}"


@interpreter
@pytest.mark.parametrize("index", range(10))
def test_interpreter_parity_float32(index):
    case = random_case(random.Random(5000 + index), max_seq=40)
    check_against_reference(case, torch.float32, "cpu", index)


@interpreter
@pytest.mark.parametrize("index", range(3))
def test_interpreter_parity_float16(index):
    case = random_case(random.Random(6000 + index), max_seq=32)
    check_against_reference(case, torch.float16, "cpu", index)


@interpreter
@pytest.mark.parametrize("causal", [False, True])
def test_interpreter_long_segments_cross_block_borders(causal):
    """More members than one block (16 under the interpreter): mask-free inner blocks, masked diagonal and
    partial blocks; GQA with differing head offsets."""
    from cases import Case

    case = Case(1, 70, 4, 2, 8, (70, 35), (1, 2), "all", causal, "contiguous")
    check_against_reference(case, torch.float32, "cpu", 0)


GPU_CASES = [random_case(random.Random(7000 + i), max_seq=300) for i in range(24)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("index", range(len(GPU_CASES)))
def test_gpu_parity(index, dtype):
    check_against_reference(GPU_CASES[index], dtype, "cuda", index)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [32, 40, 64, 72, 96, 128, 160, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_head_dims(head_dim, causal):
    from cases import Case

    case = Case(2, 777, 6, 2, head_dim, (256, 512, 1024), (1, 2, 4), "all", causal, "contiguous")
    check_against_reference(case, torch.bfloat16, "cuda", head_dim)


def _poison_allocator():
    """Fill the caching allocator's free memory with NaN, so that an output a kernel forgets to write
    (a torch.empty that should have been zeros, a masked store that misses) shows up as NaN."""
    free, _ = torch.cuda.mem_get_info()
    blob = torch.full((min(free // 8, 1 << 30) // 4,), math.nan, device="cuda")
    del blob


@pytest.mark.gpu
@pytest.mark.parametrize("index", range(0, len(GPU_CASES), 6))
def test_gpu_poisoned_memory(index):
    _poison_allocator()
    check_against_reference(GPU_CASES[index], torch.bfloat16, "cuda", index)


@pytest.mark.gpu
def test_gpu_forward_allocates_only_out_and_lse():
    B, N, H, D = 1, 16384, 8, 128
    q, k, v = (torch.randn(B, N, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    segs, dils = [2048, 4096, 8192], [1, 2, 4]
    dilated_attn.dilated_attention(q, k, v, segs, dils, backend="triton")  # compile and autotune first
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    with torch.no_grad():
        out, lse = dilated_attn.dilated_attention(q, k, v, segs, dils, backend="triton", return_lse=True)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before
    assert extra <= out.numel() * out.element_size() + lse.numel() * lse.element_size() + (1 << 20)


@pytest.mark.gpu
def test_gpu_backward_allocates_only_gradients_and_row_scratch():
    B, N, H, Hkv, D = 1, 16384, 8, 2, 128
    q = torch.randn(B, N, H, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(B, N, Hkv, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    grad_out = torch.randn_like(q)
    config = ([2048, 4096, 8192], [1, 2, 4], False, False, D**-0.5)
    out, lse = torch.ops.dilated_attn.triton_forward(q, k, v, *config)
    torch.ops.dilated_attn.triton_backward(grad_out, None, q, k, v, out, lse, *config)  # autotune first
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    grads = torch.ops.dilated_attn.triton_backward(grad_out, None, q, k, v, out, lse, *config)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before
    gradients = sum(g.numel() * g.element_size() for g in grads)
    row_scratch = B * H * N * 4  # delta, fp32, one value per (batch, head, position)
    assert extra <= gradients + row_scratch + (1 << 20)


@pytest.mark.gpu
def test_gpu_torch_compile_fullgraph():
    q, k, v = (torch.randn(2, 500, 4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))

    def f(q, k, v):
        return dilated_attn.dilated_attention(q, k, v, [128, 256], [1, 2], causal=True, backend="triton")

    compiled = torch.compile(f, fullgraph=True)
    eager = f(q, k, v)
    out = compiled(q, k, v)
    # Under torch.compile the scale reaches the kernel as a float64 scalar, so a few scores round
    # differently: allow one bf16 ulp.
    torch.testing.assert_close(out, eager, rtol=1e-2, atol=2e-3)
    (g_eager,) = torch.autograd.grad(eager.float().square().sum(), (q,))
    (g_comp,) = torch.autograd.grad(out.float().square().sum(), (q,))
    torch.testing.assert_close(g_comp, g_eager, rtol=1e-2, atol=1e-2)


@pytest.mark.gpu
def test_gpu_auto_picks_triton():
    from dilated_attn import dispatch
    from dilated_attn.spec import validate

    q = torch.randn(1, 64, 2, 64, device="cuda", dtype=torch.bfloat16)
    assert dispatch.select(validate(q, q, q, [32], [1]), "auto").name == "triton"
