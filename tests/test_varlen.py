"""dilated_attention_varlen: packed sequences equal one dilated_attention call per sequence (out, LSE, gradients),
on every backend that runs them, and bad packs are refused (docs/SPEC.md,
"Packed variable-length sequences (varlen)")."""

import itertools

import pytest
import torch

import dilated_attn
from dilated_attn import backends
from dilated_attn.reference import dilated_attention_reference

HAS_CUDA = torch.cuda.is_available()
TRITON_HERE = backends.TRITON.unavailable() is None and (HAS_CUDA or backends.triton.interpreting())

# (lengths, Hq, Hkv, D, segment_lengths, dilation_rates, causal, head_groups): empty sequences, sequences shorter
# than a segment (clipped to their own length) and than a dilation, GQA, both head groupings, a head dim that is
# not a power of two, uncovered rows (split heads)
CASES = [
    ([5, 0, 17, 3, 40], 4, 2, 16, (8, 16), (1, 2), False, "all"),
    ([5, 0, 17, 3, 40], 4, 2, 16, (8, 16), (1, 2), True, "split"),
    ([17, 1, 0, 13], 6, 3, 24, (64, 8, 4), (4, 2, 1), True, "all"),
    ([0, 0, 12, 0], 2, 1, 16, (4, 32), (2, 4), False, "split"),
    ([70], 4, 4, 32, (16, 32), (1, 2), True, "all"),
]


def pack(lengths, heads, kv_heads, head_dim, dtype, device, seed=0, transposed=False):
    """Random q, k, v of a pack (q non-contiguous with `transposed`) and its int32 offsets."""
    T = sum(lengths)
    g = torch.Generator().manual_seed(seed)

    def randn(h):
        shape = (T, head_dim, h) if transposed else (T, h, head_dim)
        x = torch.randn(shape, generator=g, dtype=torch.float64)
        x = x.transpose(1, 2) if transposed else x
        return x.to(device, dtype).requires_grad_()

    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)
    return randn(heads), randn(kv_heads), randn(kv_heads), cu


def grads(out, lse, inputs, seed=5):
    g = torch.Generator().manual_seed(seed)
    go = torch.randn(out.shape, generator=g, dtype=torch.float64).to(out.device, out.dtype)
    gl = torch.randn(lse.shape, generator=g, dtype=torch.float64).to(lse.device, lse.dtype)
    return torch.autograd.grad((out * go).sum() + (lse.masked_fill(~torch.isfinite(lse), 0) * gl).sum(), inputs)


def per_sequence(attention, q, k, v, cu):
    """The spec's definition: `attention(q, k, v) -> (out, lse)` on each sequence alone (B = 1), concatenated."""
    outs, lses = [], []
    bounds = cu.tolist()
    for start, end in zip(bounds, bounds[1:]):
        if end > start:
            out, lse = attention(q[None, start:end], k[None, start:end], v[None, start:end])
            outs.append(out[0])
            lses.append(lse[0])
    return torch.cat(outs), torch.cat(lses, dim=1)


def err(a, b):
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def check_varlen(backend, dtype, device, case, transposed=False):
    """varlen against the float64 per-sequence reference, with the error of the same reference computed in
    `dtype` (2x, plus a few ulps) as the tolerance: the package's rule, dilated_attn.reference.allowed_error."""
    from dilated_attn.reference import allowed_error

    lengths, H, Hkv, D, segs, dils, causal, groups = case
    q, k, v, cu = pack(lengths, H, Hkv, D, dtype, device, transposed=transposed)
    if device == "cuda":
        from parity import poison_allocator

        poison_allocator()
    out, lse = dilated_attn.dilated_attention_varlen(q, k, v, cu, segs, dils, causal=causal, head_groups=groups,
                                                     return_lse=True, backend=backend)
    assert out.shape == q.shape and out.dtype == dtype and out.is_contiguous()
    assert lse.shape == (H, q.shape[0]) and lse.dtype == torch.float32
    x64 = [x.detach().double().requires_grad_() for x in (q, k, v)]
    args = dict(segment_lengths=segs, dilation_rates=dils, causal=causal, head_groups=groups)
    ref_out, ref_lse = per_sequence(lambda *x: dilated_attention_reference(*x, **args), *x64, cu)
    low = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    low_out, low_lse = per_sequence(lambda *x: dilated_attention_reference(*x, **args, compute_dtype=dtype), *low, cu)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(finite, torch.isfinite(lse)), "covered positions differ"
    assert (out.transpose(0, 1)[~finite] == 0).all(), "uncovered positions must be exactly 0"
    assert err(out, ref_out) <= allowed_error(dtype, err(low_out, ref_out))
    assert err(lse[finite], ref_lse[finite]) <= allowed_error(dtype, err(low_lse[finite], ref_lse[finite]))
    for name, a, b, c in zip("qkv", grads(out, lse, (q, k, v)), grads(ref_out, ref_lse, x64),
                             grads(low_out, low_lse, low)):
        assert torch.isfinite(a).all(), f"grad {name} not finite"
        largest = b.abs().max().item() if b.numel() else 0.0
        assert err(a, b) <= allowed_error(dtype, err(c, b), gradient=True, largest=largest), f"grad {name}"


@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize("case", CASES)
def test_cpu_backends_equal_per_sequence_calls(backend, case):
    """float64: varlen and the per-sequence calls of the same backend agree to rounding."""
    lengths, H, Hkv, D, segs, dils, causal, groups = case
    q, k, v, cu = pack(lengths, H, Hkv, D, torch.float64, "cpu", transposed=True)
    out, lse = dilated_attn.dilated_attention_varlen(q, k, v, cu.long(), segs, dils, causal=causal,
                                                     head_groups=groups, return_lse=True, backend=backend)
    ref_out, ref_lse = per_sequence(lambda *x: dilated_attn.dilated_attention(
        *x, segs, dils, causal=causal, head_groups=groups, return_lse=True, backend=backend), q, k, v, cu)
    assert out.shape == q.shape and lse.shape == (H, q.shape[0])
    assert err(out, ref_out) <= 1e-12
    finite = torch.isfinite(ref_lse)
    assert torch.equal(finite, torch.isfinite(lse)) and err(lse[finite], ref_lse[finite]) <= 1e-12
    for a, b in zip(grads(out, lse, (q, k, v)), grads(ref_out, ref_lse, (q, k, v))):
        assert err(a, b) <= 1e-12


@pytest.mark.skipif(HAS_CUDA or not TRITON_HERE, reason="Triton's interpreter, where there is no GPU")
# CASES[0] is CASES[1]'s pack, not causal and with all heads, which test_gpu_varlen runs (seconds a launch here)
@pytest.mark.parametrize("case", CASES[1:])
def test_interpreter_triton_varlen(case):
    """The Triton kernels' packed launches (one per branch for the whole pack), float32 under the interpreter."""
    check_varlen("triton", torch.float32, "cpu", case, transposed=case[6])


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("backend", ["triton", "cudnn", "fa4"])
def test_gpu_varlen(backend, case, dtype):
    """triton's and fa4's packed launches (the whole pack in each), cudnn one sequence at a time (where they take
    the case)."""
    lengths, H, Hkv, D = case[:4]
    q = torch.empty(sum(lengths), H, D, dtype=dtype, device="cuda")
    kv = torch.empty(sum(lengths), Hkv, D, dtype=dtype, device="cuda")
    why = dilated_attn.explain(q[None], kv[None], kv[None], case[4], case[5], backend=backend).error
    if why is not None:
        pytest.skip(why)
    check_varlen(backend, dtype, "cuda", case, transposed=case[6])


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_gpu_varlen_long_pack_and_compile():
    """A pack with sequences longer than their segments, in bf16: eager equals torch.compile(fullgraph=True)
    (max_seqlen given: nothing is read back), and backends without packed kernels say why."""
    lengths = [3000, 17, 0, 5000, 1200]
    q, k, v, cu = pack(lengths, 8, 2, 64, torch.bfloat16, "cuda")
    segs, dils = [512, 1024, 2048], [1, 2, 4]

    def run(q, k, v, cu):
        return dilated_attn.dilated_attention_varlen(q, k, v, cu, segs, dils, max_seqlen=5000, causal=True,
                                                     return_lse=True, backend="triton")

    out, lse = run(q, k, v, cu)
    ref_out, ref_lse = per_sequence(lambda *x: dilated_attn.dilated_attention(
        *x, segs, dils, causal=True, return_lse=True, backend="triton"), q, k, v, cu)
    assert err(out, ref_out) <= 2e-2 and err(lse, ref_lse) <= 1e-3
    compiled = torch.compile(run, fullgraph=True)
    c_out, c_lse = compiled(q, k, v, cu)
    # under torch.compile the scale reaches the kernels as a float64 scalar: a few values round differently
    torch.testing.assert_close(c_out, out, rtol=1e-2, atol=2e-3)
    torch.testing.assert_close(c_lse, lse, rtol=1e-4, atol=1e-4)
    for a, b in zip(grads(c_out, c_lse, (q, k, v)), grads(out, lse, (q, k, v))):
        torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-2)
    with pytest.raises(ValueError, match="packed sequences \\(varlen\\) are not implemented"):
        dilated_attn.dilated_attention_varlen(q, k, v, cu, segs, dils, backend="cuda")


def test_empty_pack():
    q, k, v, cu = pack([0, 0], 2, 1, 8, torch.float32, "cpu")
    for backend in ("cpu", "reference"):
        out, lse = dilated_attn.dilated_attention_varlen(q, k, v, cu, [4], [1], return_lse=True, backend=backend)
        assert out.shape == (0, 2, 8) and lse.shape == (2, 0)
        assert all(g.shape == x.shape for g, x in zip(grads(out, lse, (q, k, v)), (q, k, v)))


def _bad(**change):
    q, k, v, cu = pack([3, 4], 2, 1, 8, torch.float32, "cpu")
    args = dict(q=q, k=k, v=v, cu_seqlens=cu, segment_lengths=[4], dilation_rates=[1])
    args.update(change)
    return args


@pytest.mark.parametrize("change, error, message", [
    (dict(cu_seqlens=torch.tensor([0.0, 3.0, 7.0])), TypeError, "cu_seqlens must have dtype int32 or int64"),
    (dict(cu_seqlens=[0, 3, 7]), TypeError, "cu_seqlens must be a torch.Tensor"),
    (dict(cu_seqlens=torch.tensor([[0, 3, 7]])), ValueError, "cu_seqlens must be 1-D"),
    (dict(cu_seqlens=torch.tensor([], dtype=torch.int64)), ValueError, "cu_seqlens must be 1-D with S \\+ 1 >= 1"),
    (dict(cu_seqlens=torch.tensor([1, 3, 7])), ValueError, "cu_seqlens\\[0\\] must be 0"),
    (dict(cu_seqlens=torch.tensor([0, 3, 6])), ValueError, "cu_seqlens\\[-1\\] must be the total number of tokens"),
    (dict(cu_seqlens=torch.tensor([0, 5, 3, 7])), ValueError, "cu_seqlens must be non-decreasing"),
    (dict(max_seqlen=3), ValueError, "max_seqlen \\(3\\) must be at least the longest sequence \\(4\\)"),
    (dict(max_seqlen=4.0), TypeError, "max_seqlen must be an int"),
    (dict(q=torch.randn(1, 7, 2, 8)), ValueError, "q must be 3-D \\[total_tokens, heads, head_dim\\]"),
    (dict(k=torch.randn(6, 1, 8)), ValueError, "k and v must have the same shape, got k \\(6, 1, 8\\)"),
    (dict(k=torch.randn(6, 1, 8), v=torch.randn(6, 1, 8)), ValueError, "k and v must have q's total number of tokens"),
    (dict(k=torch.randn(7, 3, 8), v=torch.randn(7, 3, 8)), ValueError, "must be a multiple of k/v heads"),
    (dict(segment_lengths=[4, 8]), ValueError, "segment_lengths and dilation_rates must have the same length"),
])
def test_bad_packs_raise_naming_the_argument(change, error, message):
    with pytest.raises(error, match=message):
        dilated_attn.dilated_attention_varlen(**_bad(**change))


def test_varlen_flops_count_each_sequence_alone():
    from dilated_attn.cli.measure import flops
    from dilated_attn.spec import validate, validate_varlen

    q, k, v, cu = pack([5, 0, 40], 2, 2, 8, torch.float32, "cpu")
    packed = validate_varlen(q, k, v, cu, [16], [2])
    alone = [validate(q[None, :n], k[None, :n], v[None, :n], [16], [2]) for n in (5, 40)]
    assert flops(packed) == sum(flops(p) for p in alone) > 0
    assert packed.max_seqlen == 40 and [b.seg_len for b in packed.branches] == [16]


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_bad_offsets_under_torch_compile_are_refused(backend):
    """Under torch.compile validate_varlen cannot read cu_seqlens; the backends that run one call per sequence
    read them anyway, and check them there: decreasing offsets raise instead of giving 57 rows for 40."""
    q = torch.randn(40, 2, 8, dtype=torch.float64)

    def run(cu):
        return dilated_attn.dilated_attention_varlen(q, q, q, cu, [8], [1], max_seqlen=30, backend=backend)

    compiled = torch.compile(run, backend="aot_eager")
    assert compiled(torch.tensor([0, 13, 30, 40])).shape == (40, 2, 8)
    with pytest.raises(ValueError, match="cu_seqlens must be non-decreasing"):
        compiled(torch.tensor([0, 30, 13, 40]))


def test_offsets_are_read_once_per_tensor_and_again_after_a_change():
    """memo.read_once, which host_offsets uses for GPU offsets, keeps a cu_seqlens tensor's values while it lives
    unchanged (a model's layers share one read) and reads them again after an in-place write; a new tensor is read
    anew; inference tensors every time. (CPU offsets are read every call: test_cpu_offsets_are_read_every_call.)"""
    from dilated_attn import memo

    def read(cu):  # as host_offsets reads GPU offsets
        return memo.read_once(cu, "offsets", torch.Tensor.tolist)

    cu = torch.tensor([0, 3, 7])
    assert read(cu) == [0, 3, 7]
    memo._KEPT[id(cu), "offsets"][2][1] = 4  # what a second read would return if it were not read again
    assert read(cu) == [0, 4, 7]
    cu[1] = 5  # in place: the version moves, so it is read again
    assert read(cu) == [0, 5, 7]
    key = (id(cu), "offsets")
    del cu
    assert key not in memo._KEPT
    with torch.inference_mode():
        frozen = torch.tensor([0, 2])
    assert read(frozen) == [0, 2]


@pytest.mark.parametrize("backend", ["cpu", "reference", "triton"])
def test_varlen_heads_of_a_larger_problem(backend):
    """forward_varlen on heads [h0, h0 + n) of an H-head pack (Problem.with_heads: the ring's heads mode) equals
    those heads of the whole pack's result, out and LSE, with each head's global offsets."""
    from dilated_attn.spec import validate_varlen

    if backend == "triton" and not TRITON_HERE:
        pytest.skip("triton: a GPU or Triton's interpreter")
    device = "cuda" if HAS_CUDA and backend == "triton" else "cpu"
    dtype = torch.float32 if backend == "triton" else torch.float64
    lengths, segs, dils = [5, 0, 23, 12], [4, 8, 16], [1, 2, 4]
    q, k, v, cu = pack(lengths, 8, 8, 8, dtype, device)
    whole = validate_varlen(q, k, v, cu, segs, dils, causal=True)
    chosen = backends.get(backend)
    out, lse = chosen.forward_varlen(q, k, v, whole)
    # (6, 2) starts inside a run of heads sharing an offset; under Triton's interpreter it alone (seconds a launch)
    for h0, n in ((6, 2),) if device == "cpu" and backend == "triton" else ((0, 4), (4, 4), (6, 2)):
        part = [x[:, h0:h0 + n].detach() for x in (q, k, v)]
        p = validate_varlen(*part, cu, segs, dils, causal=True).with_heads(h0, 8)
        o, l_ = chosen.forward_varlen(*part, p)
        assert err(o, out[:, h0:h0 + n]) <= 1e-5 and err(l_, lse[h0:h0 + n]) <= 1e-5, (h0, n)


def test_cpu_offsets_are_read_every_call():
    """CPU offsets rewritten without moving the tensor's version counter (`.data`, a NumPy view) give the new
    sequences' result on the next call (they were kept from the first read and gave the old one)."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(12, 2, 4, generator=g, dtype=torch.float64) for _ in range(3))
    cu = torch.tensor([0, 4, 12], dtype=torch.int64)
    branches = ([4, 8], [1, 2])
    first = dilated_attn.dilated_attention_varlen(q, k, v, cu, *branches)
    cu.numpy()[1] = 7  # no version bump
    second = dilated_attn.dilated_attention_varlen(q, k, v, cu, *branches)
    want = dilated_attn.dilated_attention_varlen(q, k, v, torch.tensor([0, 7, 12]), *branches)
    torch.testing.assert_close(second, want, rtol=0, atol=0)
    assert not torch.equal(first, second)


def test_compiling_a_pack_one_sequence_at_a_time_says_why_it_cannot_be_traced():
    """torch.compile(fullgraph=True) over a backend that runs packs one sequence at a time (cpu here) stops with the
    reason (it reads cu_seqlens on the host) and the way out; without fullgraph the call breaks the graph there and
    gives the eager result."""
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(12, 2, 4, generator=g) for _ in range(3))
    cu = torch.tensor([0, 4, 12])

    def attend(q, k, v, cu):
        return dilated_attn.dilated_attention_varlen(q, k, v, cu, [4, 8], [1, 2], max_seqlen=8)

    torch._dynamo.reset()
    with pytest.raises(Exception, match=r"runs a pack one sequence at a time, reading cu_seqlens on the host"):
        torch.compile(attend, fullgraph=True, backend="eager")(q, k, v, cu)
    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(attend, backend="eager")(q, k, v, cu), attend(q, k, v, cu), rtol=0, atol=0)
