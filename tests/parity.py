"""The parity check every backend's tests share: a backend's (out, lse) and gradients against the float64
reference, with tolerances relative to the same reference run in the backend's dtype."""

import math
import random

import torch
from cases import make_qkv, random_case

import dilated_attn
from dilated_attn.reference import allowed_error, dilated_attention_reference, max_error
from dilated_attn.spec import lse_dtype

# The fused-attention calls the cudnn and fa4 backends make, as their contract in float64: q `[b, h, s, d]`, k and v
# with h or fewer heads (query head i reads kv head i // (h / hkv)). tests/test_cudnn.py and tests/test_fa4.py run the
# backends' plans through them on CPU.

def _per_query_head(kv, heads):
    return kv.repeat_interleave(heads // kv.shape[1], 1)


def _scores(q, k, causal, scale):
    s = (q.double() @ _per_query_head(k, q.shape[1]).double().transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(torch.ones_like(s, dtype=torch.bool).triu(1), -math.inf)
    return s


def math_attend(q, k, v, causal, scale):
    """cuDNN's contract in float64: out [b, h, s, d] in q's dtype, the LSE [b, h, s] (k, v may have fewer heads)."""
    s = _scores(q, k, causal, scale)
    lse = torch.logsumexp(s, -1)
    out = torch.exp(s - lse[..., None]) @ _per_query_head(v, q.shape[1]).double()
    return out.to(q.dtype), lse.to(lse_dtype(q.dtype))


def math_attend_backward(grad_out, q, k, v, out, lse, causal, scale, grad_lse=None):
    """The backward contract of cuDNN (and, with `grad_lse`, of FlashAttention): P from the given LSE, delta from the
    given out (less the LSE's gradient); dK, dV summed per kv head."""
    p = torch.exp(_scores(q, k, causal, scale) - lse.double()[..., None])
    do = grad_out.double()
    vq = _per_query_head(v, q.shape[1]).double()
    delta = (do * out.double()).sum(-1, keepdim=True)
    if grad_lse is not None:
        delta = delta - grad_lse.double()[..., None]
    ds = p * (do @ vq.transpose(-1, -2) - delta)

    def per_kv(g):
        return g.unflatten(1, (k.shape[1], -1)).sum(2)

    grads = (ds @ _per_query_head(k, q.shape[1]).double() * scale, per_kv(ds.transpose(-1, -2) @ q.double() * scale),
             per_kv(p.transpose(-1, -2) @ do))
    return tuple(x.to(q.dtype) for x in grads)



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


def assert_forward_allocates_only_out_and_lse(backend: str) -> None:
    """A no-grad forward of a LongNet-like call on the GPU allocates at its peak no more than its out and lse
    (plus 1 MiB), after a first call that compiles and tunes what it needs."""
    B, N, H, D = 1, 16384, 8, 128
    q, k, v = (torch.randn(B, N, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    segs, dils = [2048, 4096, 8192], [1, 2, 4]
    dilated_attn.dilated_attention(q, k, v, segs, dils, backend=backend)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    with torch.no_grad():
        out, lse = dilated_attn.dilated_attention(q, k, v, segs, dils, backend=backend, return_lse=True)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before
    assert extra <= out.numel() * out.element_size() + lse.numel() * lse.element_size() + (1 << 20)


def case_inputs(case: dict, index: int, dtype, device="cuda"):
    """(q, k, v, generator) of a parity case given as sizes (B, N, H, optional Hkv, D): standard normal, drawn on
    the CPU from a generator seeded with `index` (which then draws the output gradient); odd cases store q
    heads-first, so that the backend reads a non-contiguous layout."""
    g = torch.Generator().manual_seed(index)
    q, k, v = (torch.randn(case["B"], case["N"], h, case["D"], generator=g).to(device, dtype)
               for h in (case["H"], case.get("Hkv", case["H"]), case.get("Hkv", case["H"])))
    if index % 2:
        q = q.transpose(1, 2).contiguous().transpose(1, 2)
    return q, k, v, g


def assert_bitwise_repeatable(backend: str, calls: int = 2) -> None:
    """The last two of `calls` forward+backward calls on the same inputs give the same bits (no atomics; the
    earlier calls let an autotuner settle)."""
    case = GPU_CASES[0]
    q, k, v = make_qkv(case, dtype=torch.bfloat16, seed=1, device="cuda")
    runs = []
    for _ in range(calls):
        out = dilated_attn.dilated_attention(q, k, v, case.segment_lengths, case.dilation_rates, backend=backend,
                                             **case.kwargs())
        runs.append((out, *torch.autograd.grad(out.float().square().sum(), (q, k, v))))
    for a, b in zip(runs[-2], runs[-1]):
        assert torch.equal(a, b)
