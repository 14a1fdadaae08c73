"""dilated_attention_with_kvcache: decoding step by step equals the rows of full causal attention, the cache is
written only where told, and bad calls are refused (docs/SPEC.md, "Decoding with a KV cache")."""

import pytest
import torch

import dilated_attn
from dilated_attn import backends

HAS_CUDA = torch.cuda.is_available()
INTERPRETED_TRITON = not HAS_CUDA and backends.TRITON.unavailable() is None and backends.triton.interpreting()

SEGS, DILS = [8, 16, 32], [1, 2, 4]


def sequence(B, N, Hq, Hkv, D, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, N, h, D, generator=g, dtype=torch.float64).to(device, dtype) for h in (Hq, Hkv, Hkv)]


def decode_matches_full(backend, dtype, device, Sq, write, per_batch, head_groups, atol,
                        call=dilated_attn.dilated_attention_with_kvcache, B=2):
    """Decode N tokens Sq at a time (into an empty cache with `write`, else over a prefilled one), each step
    against the rows of one causal call over the whole sequence; the cache rows past the written ones, NaN
    from the start, must stay NaN and not reach any result. N = 37 reaches the second segment of the longest branch
    (w = 32) and ends inside it (clipped); each step's time, in Triton's interpreter above all, grows with N and B
    (B = 2 is needed with `per_batch`)."""
    N, Hq, Hkv, D, Nmax = 37, 4, 2, 16, 64
    assert B == 2 or not per_batch
    q, k, v = sequence(B, N, Hq, Hkv, D, dtype, device)
    full, full_lse = dilated_attn.dilated_attention(q, k, v, SEGS, DILS, causal=True, head_groups=head_groups,
                                                    return_lse=True, backend=backend)
    k_cache = torch.full((B, Nmax, Hkv, D), float("nan"), dtype=dtype, device=device)
    v_cache = k_cache.clone()
    if not write:
        k_cache[:, :N], v_cache[:, :N] = k, v
    # per_batch: batch element 0 runs 4 tokens ahead of element 1 (cache_seqlens a tensor), those 4 prefilled
    lag = 4 if per_batch else 0
    k_cache[0, :lag], v_cache[0, :lag] = k[0, :lag], v[0, :lag]
    for start in range(0, N - lag, Sq):
        n = min(Sq, N - lag - start)
        positions = [start, start + lag][::-1] if per_batch else [start, start]
        cached = torch.tensor(positions, device=device) if per_batch else start
        rows = [slice(p, p + n) for p in positions]
        new_q = torch.stack([q[b, rows[b]] for b in range(B)], dim=1).transpose(0, 1)  # not contiguous
        kv = {}
        if write:
            kv = dict(k=torch.stack([k[b, rows[b]] for b in range(B)]),
                      v=torch.stack([v[b, rows[b]] for b in range(B)]))
        out, lse = call(new_q, k_cache, v_cache, cached, SEGS, DILS, head_groups=head_groups, return_lse=True,
                        backend=backend, **kv)
        assert out.shape == new_q.shape and lse.shape == (B, Hq, n)
        for b in range(B):
            torch.testing.assert_close(out[b], full[b, rows[b]], atol=atol, rtol=0)
            want = full_lse[b, :, rows[b]]
            assert torch.equal(torch.isfinite(lse[b]), torch.isfinite(want))
            torch.testing.assert_close(lse[b][torch.isfinite(want)], want[torch.isfinite(want)], atol=atol, rtol=0)
    for b in range(B):
        end = N if (not write or b == 0) else N - lag
        assert torch.isnan(k_cache[b, end:]).all() and torch.isnan(v_cache[b, end:]).all(), "rows past the written"
        torch.testing.assert_close(k_cache[b, :end], k[b, :end], atol=0, rtol=0)


CPU_CASES = [(Sq, write, per_batch, groups) for Sq, write, per_batch, groups in
             [(1, True, False, "all"), (3, True, True, "all"), (5, False, False, "split"), (1, False, True, "split")]]


@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize("Sq, write, per_batch, head_groups", CPU_CASES)
def test_decode_equals_full_causal_rows(backend, Sq, write, per_batch, head_groups):
    decode_matches_full(backend, torch.float64, "cpu", Sq, write, per_batch, head_groups, atol=1e-12)


@pytest.mark.skipif(not INTERPRETED_TRITON, reason="Triton's interpreter, where there is no GPU")
# one of CPU_CASES (15-30 s each in the interpreter): five tokens over a prefilled cache with split heads, on one
# batch element (its length is one int for the batch); writing the new tokens, per-batch lengths and a second batch
# element are test_decode_with_lengths_left_on_the_device's triton case, and every case runs on the GPU
# (test_gpu_triton_decode)
@pytest.mark.parametrize("Sq, write, per_batch, head_groups", [CPU_CASES[2]])
def test_interpreter_triton_decode(Sq, write, per_batch, head_groups):
    decode_matches_full("triton", torch.float32, "cpu", Sq, write, per_batch, head_groups, atol=1e-5, B=1)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype, atol", [(torch.bfloat16, 2e-2), (torch.float16, 4e-3), (torch.float32, 1e-5)])
@pytest.mark.parametrize("Sq, write, per_batch, head_groups", CPU_CASES)
def test_gpu_triton_decode(dtype, atol, Sq, write, per_batch, head_groups):
    decode_matches_full("triton", dtype, "cuda", Sq, write, per_batch, head_groups, atol=atol)


def cuda_decode_cases():
    """(dtype, head_dim, Hq, Hkv, head_groups, Sq, write, per_batch, segments, dilations): both dtypes and head dims,
    groups of 1 to 16 query heads a kv head, both head groupings, one and several new tokens, written or not, lengths
    per batch; LongNet's dilations (each dividing the next), then dilations that do not divide one another (2 and 3)
    and two branches of one dilation whose segments start together at the last positions (keys two branches share,
    runs of equal length)."""
    longnet = ([64, 256, 1024], [1, 4, 16])
    return [(torch.bfloat16, 128, 16, 4, "all", 1, True, False, *longnet),
            (torch.float16, 128, 16, 4, "split", 3, True, True, *longnet),
            (torch.bfloat16, 64, 8, 8, "all", 2, False, True, *longnet),
            (torch.float16, 64, 32, 2, "all", 1, True, True, *longnet),
            (torch.bfloat16, 128, 12, 3, "split", 5, False, False, *longnet),
            (torch.float16, 128, 6, 6, "all", 1, False, False, *longnet),
            (torch.bfloat16, 128, 8, 2, "all", 2, True, True, [64, 192, 1000], [1, 3, 2]),
            (torch.float16, 64, 8, 4, "all", 1, True, False, [100, 300, 600, 1200], [2, 2, 4, 8])]


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype, D, Hq, Hkv, head_groups, Sq, write, per_batch, segs, dils", cuda_decode_cases())
def test_gpu_cuda_decode_kernel_against_float64(dtype, D, Hq, Hkv, head_groups, Sq, write, per_batch, segs, dils):
    """The cuda backend's decode kernel (csrc/cuda/decode.cu) against the float64 reference: new tokens at the end of
    odd-length prefixes of a cache of random rows (its rows past them NaN, never to be read), lengths differing per
    batch element, several shares of each token's keys and a tail tile; the new rows written into the caches bit for
    bit (test_gpu_cuda_decode_kernel_poisoned_output_and_graph_capture poisons the outputs). Tolerance: bf16 / fp16
    inputs, P rounded to the inputs' dtype before P V (as FlashAttention does), fp32 sums: 2e-2 / 4e-3."""
    from dilated_attn.backends import decoding

    if torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("the CUDA decode kernel needs compute capability 8.0 or newer")
    B, Nmax = 3, 1500
    lengths = [1201, 977, 1023][:B] if per_batch else [1201] * B
    g = torch.Generator().manual_seed(Hq * D + Sq)
    full = [torch.randn(B, Nmax, h, D, generator=g, dtype=torch.float64) for h in (Hq, Hkv, Hkv)]
    q_all, k_all, v_all = full
    k_cache = torch.full((B, Nmax, Hkv, D), float("nan"), dtype=dtype, device="cuda")
    v_cache = k_cache.clone()
    for b, n in enumerate(lengths):
        k_cache[b, :n + (0 if write else Sq)] = k_all[b, :n + (0 if write else Sq)].to(dtype)
        v_cache[b, :n + (0 if write else Sq)] = v_all[b, :n + (0 if write else Sq)].to(dtype)
    q = torch.stack([q_all[b, n:n + Sq] for b, n in enumerate(lengths)]).to("cuda", dtype)
    kv = {}
    if write:
        kv = dict(k=torch.stack([k_all[b, n:n + Sq] for b, n in enumerate(lengths)]).to("cuda", dtype),
                  v=torch.stack([v_all[b, n:n + Sq] for b, n in enumerate(lengths)]).to("cuda", dtype))
    cached = torch.tensor(lengths, device="cuda") if per_batch else lengths[0]
    from dilated_attn.cache_spec import validate_kvcache

    cp = validate_kvcache(q, k_cache, v_cache, cached, segs, dils, head_groups=head_groups, return_lse=True, **kv)
    assert decoding.cuda_decode_refusal(cp.problem) is None
    out, lse = backends.CUDA.forward_kvcache(q, k_cache, v_cache, kv.get("k"), kv.get("v"), cp)
    out_again, _ = backends.CUDA.forward_kvcache(q, k_cache, v_cache, kv.get("k"), kv.get("v"), cp)
    assert torch.equal(out, out_again), "two calls differ: the counters were not left at 0"
    atol = 2e-2 if dtype == torch.bfloat16 else 4e-3
    for b, n in enumerate(lengths):
        rows = slice(0, n + Sq)
        ref, ref_lse = dilated_attn.dilated_attention(
            q_all[b:b + 1, rows].to(dtype).double(), k_all[b:b + 1, rows].to(dtype).double(),
            v_all[b:b + 1, rows].to(dtype).double(), segs, dils, causal=True, head_groups=head_groups,
            return_lse=True, backend="reference")
        torch.testing.assert_close(out[b].double().cpu(), ref[0, n:], atol=atol, rtol=0)
        torch.testing.assert_close(lse[b].double().cpu(), ref_lse[0, :, n:], atol=atol, rtol=0)
        if write:
            torch.testing.assert_close(k_cache[b, n:n + Sq].cpu(), kv["k"][b].cpu(), atol=0, rtol=0)
            assert torch.isnan(k_cache[b, n + Sq:]).all(), "a row past the new ones was written"


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_gpu_cuda_decode_kernel_poisoned_output_and_graph_capture():
    """Every element of out and lse is written (buffers filled with NaN before the call are overwritten), and the
    whole call captured in a CUDA graph replays to the eager result as the lengths tensor advances."""
    if torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("the CUDA decode kernel needs compute capability 8.0 or newer")
    B, N, Hq, Hkv, D, Nmax = 2, 300, 8, 2, 128, 320
    q, k, v = sequence(B, N, Hq, Hkv, D, torch.bfloat16, "cuda")
    caches = [torch.zeros(B, Nmax, Hkv, D, dtype=torch.bfloat16, device="cuda") for _ in range(4)]
    step_q, step_k, step_v = q[:, :1].clone(), k[:, :1].clone(), v[:, :1].clone()
    lengths = torch.zeros(B, dtype=torch.int32, device="cuda")
    segs, dils = [32, 128], [1, 4]

    def step():
        return dilated_attn.dilated_attention_with_kvcache(step_q, caches[0], caches[1], lengths, segs, dils,
                                                           k=step_k, v=step_v, backend="cuda", return_lse=True)

    step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = step()
    for t in range(N):
        step_q.copy_(q[:, t:t + 1]), step_k.copy_(k[:, t:t + 1]), step_v.copy_(v[:, t:t + 1])
        lengths.fill_(t)
        out.fill_(float("nan")), lse.fill_(float("nan"))
        graph.replay()
        want, want_lse = dilated_attn.dilated_attention_with_kvcache(
            q[:, t:t + 1], caches[2], caches[3], t, segs, dils, k=k[:, t:t + 1], v=v[:, t:t + 1], backend="cuda",
            return_lse=True)
        torch.testing.assert_close(out, want, atol=0, rtol=0)
        torch.testing.assert_close(lse, want_lse, atol=0, rtol=0)
    torch.testing.assert_close(caches[0], caches[2], atol=0, rtol=0)


@pytest.fixture
def lengths_on_device(monkeypatch):
    """Every cache_seqlens tensor treated as a GPU one is: not read on the host (the path of GPU tensors, CUDA
    graphs and torch.compile), so that it runs on CPU tensors too."""
    monkeypatch.setattr(dilated_attn.cache_spec, "reads_cache_seqlens", lambda lengths: not torch.is_tensor(lengths))


DEVICE_CASES = [(Sq, write, groups) for Sq, write, groups in [(1, True, "all"), (3, True, "split"), (5, False, "all")]]


# Triton's interpreter takes 15-30 s a case here: one case for it (test_interpreter_triton_decode covers its decoding)
@pytest.mark.parametrize("backend, Sq, write, head_groups",
                         [(b, *c) for b in ("cpu", "reference") for c in DEVICE_CASES]
                         + ([("triton", *DEVICE_CASES[1])] if INTERPRETED_TRITON else []))
def test_decode_with_lengths_left_on_the_device(lengths_on_device, backend, Sq, write, head_groups):
    dtype, atol = (torch.float32, 1e-5) if backend == "triton" else (torch.float64, 1e-12)
    decode_matches_full(backend, dtype, "cpu", Sq, write, True, head_groups, atol)


@pytest.mark.parametrize("backend", ["cpu", "reference"] + (["triton"] if INTERPRETED_TRITON else []))
def test_lengths_left_on_the_device_never_reach_outside_the_cache(lengths_on_device, backend):
    """Lengths not checked on the host may run past the cache (or below 0, by less or more than the new tokens): no
    error, only the rows inside the cache that new tokens land on are written, and nothing past k, v is read (they
    are views of tensors whose rows after them hold 1000: a key read there would take a row's whole weight, and its
    value would show in the output, whose other values are averages of random normal ones)."""
    B, Sq, H, Hkv, D, Nmax = 4, 3, 4, 2, 8, 10
    g = torch.Generator().manual_seed(1)
    q = torch.randn(B, Sq, H, D, generator=g)
    k, v = (torch.cat([torch.randn(B, Sq, Hkv, D, generator=g), torch.full((B, 16, Hkv, D), 1000.0)], 1)[:, :Sq]
            for _ in range(2))
    k_cache, v_cache = (torch.randn(B, Nmax, Hkv, D, generator=g) for _ in range(2))
    before = k_cache.clone()
    lengths = torch.tensor([Nmax - 1, Nmax + 5, -2, -7])
    out = dilated_attn.dilated_attention_with_kvcache(q, k_cache, v_cache, lengths, [4, 8], [1, 2], k=k, v=v,
                                                      backend=backend)
    assert out.shape == q.shape and torch.isfinite(out).all() and out.abs().max() < 100
    want = before.clone()
    want[0, Nmax - 1] = k[0, 0]  # the one row of element 0 inside the cache; element 1 lands on none
    want[2, 0] = k[2, 2]  # element 2's rows -2, -1, 0: only row 0 is in the cache
    torch.testing.assert_close(k_cache, want, atol=0, rtol=0)


def test_torch_compile_fullgraph_decodes_like_eager():
    """The KV-cache call traces with fullgraph=True (no graph break), the new k, v written into the cache in the
    graph. cache_seqlens is a tensor: on these backends an int would be a new prefix length, and a recompile, at
    every step."""
    compiled = torch.compile(dilated_attn.dilated_attention_with_kvcache, fullgraph=True, backend="aot_eager")
    decode_matches_full("cpu", torch.float64, "cpu", 2, True, True, "all", 1e-12, call=compiled)
    decode_matches_full("reference", torch.float64, "cpu", 1, False, True, "split", 1e-12, call=compiled)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("per_batch", [False, True])
def test_gpu_torch_compile_fullgraph_decodes_like_eager(per_batch):
    compiled = torch.compile(dilated_attn.dilated_attention_with_kvcache, fullgraph=True)
    decode_matches_full("triton", torch.bfloat16, "cuda", 3, True, per_batch, "all", 2e-2, call=compiled)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_gpu_whole_call_captured_in_a_cuda_graph():
    """With cache_seqlens a GPU tensor the call makes no device-to-host copy: captured once in a CUDA graph, it
    decodes step after step as the lengths tensor advances, equal to eager calls."""
    B, N, Hq, Hkv, D, Nmax = 2, 40, 4, 2, 64, 48
    q, k, v = sequence(B, N, Hq, Hkv, D, torch.bfloat16, "cuda")
    caches = [torch.zeros(B, Nmax, Hkv, D, dtype=torch.bfloat16, device="cuda") for _ in range(4)]
    step_q, step_k, step_v = q[:, :1].clone(), k[:, :1].clone(), v[:, :1].clone()
    lengths = torch.zeros(B, dtype=torch.int32, device="cuda")

    def step():
        return dilated_attn.dilated_attention_with_kvcache(step_q, caches[0], caches[1], lengths, SEGS, DILS,
                                                           k=step_k, v=step_v, backend="triton")

    step()  # compiles the kernels; the cache row it writes is written again below
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for t in range(N):
        step_q.copy_(q[:, t:t + 1]), step_k.copy_(k[:, t:t + 1]), step_v.copy_(v[:, t:t + 1])
        lengths.fill_(t)
        graph.replay()
        want = dilated_attn.dilated_attention_with_kvcache(q[:, t:t + 1], caches[2], caches[3], t, SEGS, DILS,
                                                           k=k[:, t:t + 1], v=v[:, t:t + 1], backend="triton")
        torch.testing.assert_close(out, want, atol=0, rtol=0)
    torch.testing.assert_close(caches[0], caches[2], atol=0, rtol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("backend", ["triton", "cuda"])
def test_gpu_decode_of_unaligned_and_strided_tensors_equals_the_aligned_one(backend):
    """Eager calls launch the Triton kernel compiled for their layout directly where every tensor is 16-byte aligned,
    else through Triton's JIT function; the CUDA kernel reads aligned copies of q, k, v and the caches' padded rows in
    place: q, k, v one element past an aligned address, and caches with padded rows, give the results of contiguous
    aligned copies, the cache rows written the same."""
    B, N, Hq, Hkv, D, Nmax = 2, 40, 4, 2, 64, 48
    q, k, v = sequence(B, N, Hq, Hkv, D, torch.bfloat16, "cuda")
    padded = [torch.zeros(B, Nmax, Hkv, D + 8, dtype=torch.bfloat16, device="cuda")[..., :D] for _ in range(2)]
    dense = [torch.zeros(B, Nmax, Hkv, D, dtype=torch.bfloat16, device="cuda") for _ in range(2)]

    def unaligned(x):
        return torch.cat([x.new_zeros(1), x.flatten()])[1:].view(x.shape)

    for t in range(N):
        rows = slice(t, t + 1)
        got = dilated_attn.dilated_attention_with_kvcache(unaligned(q[:, rows]), *padded, t, SEGS, DILS,
                                                          k=unaligned(k[:, rows]), v=unaligned(v[:, rows]),
                                                          backend=backend)
        want = dilated_attn.dilated_attention_with_kvcache(q[:, rows].contiguous(), *dense, t, SEGS, DILS,
                                                           k=k[:, rows].contiguous(), v=v[:, rows].contiguous(),
                                                           backend=backend)
        # kernels compiled for other alignments may order a product's sums otherwise: bf16's tolerance of the other
        # decode tests; the rows written into the caches are copies, equal to the bit
        torch.testing.assert_close(got, want, atol=2e-2, rtol=0)
    torch.testing.assert_close(padded[0], dense[0], atol=0, rtol=0)


def _call(**change):
    B, Sq, H, Hkv, D, Nmax = 2, 1, 4, 2, 8, 10
    args = dict(q=torch.randn(B, Sq, H, D), k_cache=torch.zeros(B, Nmax, Hkv, D), v_cache=torch.zeros(B, Nmax, Hkv, D),
                cache_seqlens=3, segment_lengths=[4], dilation_rates=[1])
    args.update(change)
    return args


@pytest.mark.parametrize("change, error, message", [
    (dict(cache_seqlens=10), ValueError, "the cache is too short: cache_seqlens \\+ Sq = 10 \\+ 1 > Nmax = 10"),
    (dict(cache_seqlens=torch.tensor([2, 10])), ValueError, "the cache is too short.*batch element 1"),
    (dict(cache_seqlens=-1), ValueError, "cache_seqlens must be >= 0"),
    (dict(cache_seqlens=torch.tensor([2.0, 3.0])), TypeError, "cache_seqlens must be an int or an int32/int64"),
    (dict(cache_seqlens=torch.tensor([2, 3, 4])), ValueError, "cache_seqlens must have shape \\[B\\] = \\(2,\\)"),
    (dict(cache_seqlens=2.5), TypeError, "cache_seqlens must be an int or an integer tensor"),
    (dict(cache_seqlens=torch.tensor([2, 3], device="meta")), ValueError, "cache_seqlens must be on q's device"),
    (dict(q=torch.randn(2, 1, 4, 8, requires_grad=True)), ValueError, "q requires grad: .* inference only"),
    (dict(k=torch.randn(2, 1, 2, 8, requires_grad=True), v=torch.randn(2, 1, 2, 8)), ValueError,
     "k requires grad"),
    (dict(k=torch.randn(2, 1, 2, 8)), ValueError, "k and v go together"),
    (dict(k=torch.randn(2, 2, 2, 8), v=torch.randn(2, 2, 2, 8)), ValueError, "k must be \\[B, Sq, Hkv, D\\]"),
    (dict(v_cache=torch.zeros(2, 11, 2, 8)), ValueError, "k_cache and v_cache must have the same shape"),
    (dict(k_cache=torch.zeros(3, 10, 2, 8), v_cache=torch.zeros(3, 10, 2, 8)), ValueError, "k_cache must be \\[B=2"),
    (dict(k_cache=torch.zeros(2, 10, 3, 8), v_cache=torch.zeros(2, 10, 3, 8)), ValueError, "multiple of k/v heads"),
    (dict(v_cache=torch.zeros(2, 10, 2, 8, dtype=torch.float64)), ValueError, "v_cache must have q's device and dtype"),
    (dict(q=torch.randn(2, 0, 4, 8)), ValueError, "at least one new token"),
])
def test_bad_calls_raise_naming_the_argument(change, error, message):
    args = _call(**change)
    before = args["k_cache"].clone()
    with pytest.raises(error, match=message):
        dilated_attn.dilated_attention_with_kvcache(**args)
    assert torch.equal(args["k_cache"], before), "a refused call wrote the cache"


@pytest.mark.parametrize("valid, invalid, error, message", [
    (dict(segment_lengths=[4]), dict(segment_lengths=[4.0]), TypeError, "segment_lengths"),
    (dict(dilation_rates=[1]), dict(dilation_rates=[True]), TypeError, "dilation_rates"),
    (dict(return_lse=True), dict(return_lse=1), TypeError, "return_lse"),
])
def test_a_checked_problem_is_not_taken_for_an_equal_one_of_other_types(valid, invalid, error, message):
    """The problem's rules run once per key (cache_spec._CHECKED): 4.0 == 4 and True == 1, but after the
    valid call the equal invalid one is still refused."""
    dilated_attn.dilated_attention_with_kvcache(**_call(**valid))
    with pytest.raises(error, match=message):
        dilated_attn.dilated_attention_with_kvcache(**_call(**invalid))


def test_memory_and_lengths_are_checked_on_every_call():
    """The checks of layouts run once per key (cache_spec._CHECKED); after a valid call, one with the same layouts
    whose caches share memory, whose new rows lie in a cache, or whose lengths leave the cache is still refused,
    before any write."""
    args = _call(k=torch.randn(2, 1, 2, 8), v=torch.randn(2, 1, 2, 8))
    dilated_attn.dilated_attention_with_kvcache(**args)
    cache = torch.zeros_like(args["k_cache"])
    for change, message in [(dict(k_cache=cache, v_cache=cache), "k_cache and v_cache share memory"),
                            (dict(v=args["k_cache"][:, 4:5]), "v and k_cache share memory"),
                            (dict(cache_seqlens=10), "the cache is too short"),
                            (dict(cache_seqlens=-1), "cache_seqlens must be >= 0")]:
        call = dict(args, **change)
        before = call["k_cache"].clone()
        with pytest.raises(ValueError, match=message):
            dilated_attn.dilated_attention_with_kvcache(**call)
        assert torch.equal(call["k_cache"], before), "a refused call wrote the cache"


def test_auto_decodes_with_a_decode_kernel_on_a_gpu():
    """A KV-cache call's problem puts triton first on a GPU, then cuda (the backends with a decode kernel), however
    large the cache: the fast backends of a forward (cudnn, fa4) would compute each new token over its whole prefix."""
    from dilated_attn import dispatch
    from dilated_attn.spec import Problem

    sizes = (1, 65536, 16, 4, 128, [2048, 4096, 8192, 16384], [1, 2, 4, 8])
    decoding = Problem.from_sizes(*sizes, dtype=torch.bfloat16, device="cuda", causal=True, decodes=True)
    assert dispatch.auto_preference(decoding) == dispatch.AUTO_ORDER["cuda"] == ("triton", "cuda", "reference")
    assert Problem.from_sizes(*sizes, dtype=torch.bfloat16, device="cuda", causal=True).decodes is False


@pytest.mark.parametrize("capability, dtype, head_dim, heads, kv_heads, branches, refusal", [
    ((9, 0), torch.bfloat16, 128, 16, 4, 4, None), ((8, 0), torch.float16, 64, 32, 2, 16, None),
    ((7, 5), torch.bfloat16, 128, 16, 4, 4, "compute capability 8.0"),  # no cp.async, no bf16 mma.sync
    ((9, 0), torch.float32, 128, 16, 4, 4, "float16 or bfloat16"), ((9, 0), torch.bfloat16, 96, 16, 4, 4, "head_dim"),
    ((9, 0), torch.bfloat16, 128, 32, 1, 4, "query heads a kv head"),
    ((9, 0), torch.bfloat16, 128, 16, 4, 17, "branches")])
def test_cuda_decode_kernel_says_which_calls_it_takes(monkeypatch, capability, dtype, head_dim, heads, kv_heads,
                                                      branches, refusal):
    """The CUDA decode kernel's rules (backends/decoding.py), each refusal naming its rule; a refused call goes on to
    the cuda backend's forward over the prefix (or to triton, under auto)."""
    from dilated_attn.backends import base, decoding
    from dilated_attn.spec import Problem

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(base, "_CAPABILITIES", {})
    segs, dils = [64 * (j + 1) for j in range(branches)], [1] * branches
    p = Problem.from_sizes(1, 4096, heads, kv_heads, head_dim, segs, dils, dtype=dtype, device="cuda", causal=True,
                           decodes=True)
    why = decoding.cuda_decode_refusal(p)
    assert (why is None) if refusal is None else (refusal in why), why


@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize("lengths", [0, torch.zeros(0, dtype=torch.int64)])
def test_no_batch_element_gives_empty_results(backend, lengths):
    q, new = torch.randn(0, 2, 4, 8), torch.randn(0, 2, 2, 8)
    cache = torch.zeros(0, 10, 2, 8)
    out, lse = dilated_attn.dilated_attention_with_kvcache(q, cache, cache, lengths, [4, 8], [1, 2], k=new, v=new,
                                                           return_lse=True, backend=backend)
    assert out.shape == (0, 2, 4, 8) and lse.shape == (0, 4, 2) and lse.dtype == torch.float32


def _shared_memory_cases():
    B, Nmax, Hkv, D = 2, 16, 2, 8
    broadcast = torch.zeros(1, Nmax, Hkv, D).expand(B, -1, -1, -1)  # one batch row's memory for both
    cache = torch.zeros(B, Nmax, Hkv, D)
    return [
        (dict(v_cache=broadcast), "v_cache has elements that share memory"),
        (dict(k_cache=broadcast), "k_cache has elements that share memory"),
        (dict(k_cache=cache, v_cache=cache), "k_cache and v_cache share memory"),
        (dict(v_cache=cache, v=cache[:, 4:5]), "v and v_cache share memory"),
        (dict(k_cache=cache, v=cache[:, 2:3]), "v and k_cache share memory"),
    ]


@pytest.mark.parametrize("backend", ["cpu", "reference", "triton"])
@pytest.mark.parametrize("lengths", [3, torch.tensor([3, 5])])
@pytest.mark.parametrize("index", range(5))
def test_caches_sharing_memory_are_refused_before_any_write(index, lengths, backend):
    """A cache whose rows share memory (an expand()), or caches and new tokens that overlap: refused before either
    cache is written (they used to raise after k_cache was written, or write batch 1's row into batch 0's)."""
    change, message = _shared_memory_cases()[index]
    args = dict(q=torch.randn(2, 1, 4, 8), k_cache=torch.zeros(2, 16, 2, 8), v_cache=torch.zeros(2, 16, 2, 8),
                cache_seqlens=lengths, segment_lengths=[4, 8], dilation_rates=[1, 2], k=torch.randn(2, 1, 2, 8),
                v=torch.randn(2, 1, 2, 8), backend=backend)
    args.update(change)
    before = [args[name].clone() for name in ("k_cache", "v_cache")]
    with pytest.raises(ValueError, match=message):
        dilated_attn.dilated_attention_with_kvcache(**args)
    assert all(torch.equal(args[name], b) for name, b in zip(("k_cache", "v_cache"), before))


def test_interleaved_kv_cache_views_are_accepted():
    """k_cache and v_cache as the two halves of one packed [B, N, 2, Hkv, D] buffer: views that interleave without
    sharing an element, accepted and equal to separate caches."""
    kv = torch.randn(2, 16, 2, 2, 8, dtype=torch.float64)
    separate = [kv[:, :, i].clone() for i in range(2)]
    q, new_k, new_v = (torch.randn(2, 3, 4 if i == 0 else 2, 8, dtype=torch.float64) for i in range(3))
    kw = dict(k=new_k, v=new_v, backend="cpu")
    out = dilated_attn.dilated_attention_with_kvcache(q, kv[:, :, 0], kv[:, :, 1], 5, [4, 8], [1, 2], **kw)
    want = dilated_attn.dilated_attention_with_kvcache(q, *separate, 5, [4, 8], [1, 2], **kw)
    assert torch.equal(out, want) and torch.equal(kv[:, :, 0], separate[0]) and torch.equal(kv[:, :, 1], separate[1])


def test_meta_tensors_give_meta_results():
    """Meta tensors (shape inference) have no memory to check for overlap: the caches' check that reads it is
    skipped, as under torch.compile, and the call gives meta results of the right shapes."""
    q, k, v = (torch.empty(2, 1, 4, 8, device="meta") for _ in range(3))
    k_cache, v_cache = (torch.empty(2, 32, 4, 8, device="meta") for _ in range(2))
    out, lse = dilated_attn.dilated_attention_with_kvcache(q, k_cache, v_cache, 5, [16], [1], k=k, v=v,
                                                           return_lse=True)
    assert out.device.type == lse.device.type == "meta"
    assert out.shape == (2, 1, 4, 8) and lse.shape == (2, 4, 1)
