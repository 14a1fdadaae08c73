"""The parity check every backend's tests share: a backend's (out, lse) and gradients against the float64
reference, with tolerances relative to the same reference run in the backend's dtype."""

import math
import random

import torch

import dilated_attn
from dilated_attn.reference import allowed_error, dilated_attention_reference, max_error

from cases import make_qkv, random_case

# Random GPU configurations (GQA, both head groupings, causal, odd lengths, w > N, uncovered rows...).
GPU_CASES = [random_case(random.Random(7000 + i), max_seq=300) for i in range(24)]


def _grads(out, lse, inputs, seed=11):
    g = torch.Generator().manual_seed(seed)
    go = torch.randn(out.shape, generator=g, dtype=torch.float64).to(out.device, out.dtype)
    gl = torch.randn(lse.shape, generator=g, dtype=torch.float64).to(lse.device, lse.dtype)
    loss = (out * go).sum() + (lse.masked_fill(~torch.isfinite(lse), 0) * gl).sum()
    return torch.autograd.grad(loss, inputs)


def check_against_reference(case, dtype, device, seed, backend):
    q, k, v = make_qkv(case, dtype=dtype, seed=seed, device=device)
    args = (case.segment_lengths, case.dilation_rates)
    torch.manual_seed(seed)
    out, lse = dilated_attn.dilated_attention(q, k, v, *args, return_lse=True, backend=backend, **case.kwargs())
    assert out.dtype == dtype and out.is_contiguous() and lse.dtype == torch.float32
    inputs64 = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ref_out, ref_lse = dilated_attention_reference(*inputs64, *args, **case.kwargs())
    low_inputs = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    low_out, low_lse = dilated_attention_reference(*low_inputs, *args, compute_dtype=dtype, **case.kwargs())

    finite = torch.isfinite(ref_lse)
    assert torch.equal(finite, torch.isfinite(lse)), "covered positions differ"
    assert (out.transpose(1, 2)[~finite] == 0).all(), "uncovered positions must be exactly 0"
    # the tolerance rule: dilated_attn.reference.allowed_error
    assert max_error(out, ref_out) <= allowed_error(dtype, max_error(low_out, ref_out))
    assert max_error(lse[finite], ref_lse[finite]) <= allowed_error(dtype, max_error(low_lse[finite], ref_lse[finite]))
    grads = _grads(out, lse, (q, k, v))
    ref_grads = _grads(ref_out, ref_lse, inputs64)
    low_grads = _grads(low_out, low_lse, low_inputs)
    for name, a, b, c in zip("qkv", grads, ref_grads, low_grads):
        assert torch.isfinite(a).all(), f"grad {name} not finite"
        largest = b.abs().max().item() if b.numel() else 0.0
        assert max_error(a, b) <= allowed_error(dtype, max_error(c, b), gradient=True, largest=largest), f"grad {name}"



def poison_allocator():
    """Fill the caching allocator's free memory with NaN, so that an output a kernel forgets to write
    (a torch.empty that should have been zeros, a masked store that misses) shows up as NaN."""
    free, _ = torch.cuda.mem_get_info()
    blob = torch.full((min(free // 8, 1 << 30) // 4,), math.nan, device="cuda")
    del blob
