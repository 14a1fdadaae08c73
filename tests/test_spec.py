"""Every invalid input of the spec's Errors section raises ValueError/TypeError naming the argument."""

import dataclasses
import math
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest
import torch

import dilated_attn


def _qkv(B=1, N=8, Hq=4, Hkv=2, D=4, dtype=torch.float32):
    return (torch.randn(B, N, Hq, D, dtype=dtype), torch.randn(B, N, Hkv, D, dtype=dtype),
            torch.randn(B, N, Hkv, D, dtype=dtype))


def _call(**overrides):
    q, k, v = _qkv()
    args = dict(q=q, k=k, v=v, segment_lengths=[4, 8], dilation_rates=[1, 2])
    args.update(overrides)
    pos = [args.pop(n) for n in ("q", "k", "v", "segment_lengths", "dilation_rates")]
    return dilated_attn.dilated_attention(*pos, **args)


q0, k0, v0 = _qkv()

INVALID = [
    # (overrides, exception, words the message must contain)
    (dict(q=[[1.0]]), TypeError, ["q", "torch.Tensor"]),
    (dict(k=None), TypeError, ["k", "torch.Tensor"]),
    (dict(v=3.0), TypeError, ["v", "torch.Tensor"]),
    (dict(q=q0[0]), ValueError, ["q", "4-D"]),
    (dict(k=k0[..., None]), ValueError, ["k", "4-D"]),
    (dict(q=q0.to(torch.int32)), TypeError, ["q", "floating-point"]),
    (dict(k=k0.double()), ValueError, ["k", "dtype"]),
    (dict(v=v0.double()), ValueError, ["v", "dtype"]),
    (dict(v=v0.to("meta")), ValueError, ["v", "device"]),
    (dict(k=k0.to("meta"), v=v0.to("meta")), ValueError, ["k", "device"]),
    (dict(v=v0[:, :, :1]), ValueError, ["k and v", "same shape"]),
    (dict(k=torch.randn(2, 8, 2, 4), v=torch.randn(2, 8, 2, 4)), ValueError, ["batch"]),
    (dict(k=torch.randn(1, 9, 2, 4), v=torch.randn(1, 9, 2, 4)), ValueError, ["sequence length"]),
    (dict(k=torch.randn(1, 8, 2, 5), v=torch.randn(1, 8, 2, 5)), ValueError, ["head_dim"]),
    (dict(k=torch.randn(1, 8, 3, 4), v=torch.randn(1, 8, 3, 4)), ValueError, ["heads", "multiple"]),
    (dict(q=torch.randn(1, 8, 0, 4)), ValueError, ["head"]),
    (dict(q=torch.randn(1, 8, 4, 0), k=torch.randn(1, 8, 2, 0), v=torch.randn(1, 8, 2, 0)), ValueError,
     ["head_dim"]),
    (dict(segment_lengths=[], dilation_rates=[]), ValueError, ["segment_lengths", "empty"]),
    (dict(segment_lengths=[4], dilation_rates=[1, 2]), ValueError, ["segment_lengths and dilation_rates"]),
    (dict(segment_lengths=[4, 0]), ValueError, ["segment_lengths[1]", "positive"]),
    (dict(segment_lengths=[-4, 8]), ValueError, ["segment_lengths[0]", "positive"]),
    (dict(dilation_rates=[0, 1]), ValueError, ["dilation_rates[0]", "positive"]),
    (dict(dilation_rates=[1, -2]), ValueError, ["dilation_rates[1]", "positive"]),
    (dict(segment_lengths=[4.0, 8]), TypeError, ["segment_lengths[0]", "int"]),
    (dict(dilation_rates=[True, 2]), TypeError, ["dilation_rates[0]", "int"]),
    (dict(segment_lengths=8), TypeError, ["segment_lengths", "sequence"]),
    (dict(segment_lengths="48"), TypeError, ["segment_lengths", "sequence"]),
    (dict(dilation_rates=None), TypeError, ["dilation_rates"]),
    (dict(head_groups="heads"), ValueError, ["head_groups", "'all' or 'split'"]),
    (dict(head_groups=None), TypeError, ["head_groups"]),
    (dict(head_groups="split", segment_lengths=[1, 2, 3, 4, 5], dilation_rates=[1] * 5), ValueError,
     ["head_groups='split'", "4 heads < 5 branches"]),
    (dict(causal="yes"), TypeError, ["causal", "bool"]),
    (dict(causal=np.int64(1)), TypeError, ["causal", "bool", "numpy.int64"]),
    (dict(causal=None), TypeError, ["causal", "bool"]),
    (dict(return_lse=1), TypeError, ["return_lse", "bool"]),
    (dict(scale="0.5"), TypeError, ["scale"]),
    (dict(scale=math.nan), ValueError, ["scale", "finite"]),
    (dict(scale=math.inf), ValueError, ["scale", "finite"]),
    # finite, but the float32 scores overflow to inf (every row NaN)
    (dict(scale=1e39), ValueError, ["scale", "1e+30", "float32"]),
    (dict(scale=-1e300), ValueError, ["scale", "1e+30", "float32"]),
    (dict(scale=1e38, q=q0.half(), k=k0.half(), v=v0.half()), ValueError, ["scale", "1e+30", "float16"]),
    (dict(backend="fast"), ValueError, ["backend", "'auto'"]),
    (dict(backend=None), TypeError, ["backend"]),
    (dict(backend="cuda"), ValueError, ["backend='cuda'", "CUDA tensors", "cpu: can run"]),
    (dict(backend="triton"), ValueError, ["backend='triton'", "CUDA tensors", "reference: can run"]),
]


@pytest.mark.parametrize("overrides, exc, words", INVALID, ids=[str(i) for i in range(len(INVALID))])
def test_invalid_input_raises_naming_the_argument(overrides, exc, words, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the interpreter would let triton run CPU tensors
    with pytest.raises(exc) as info:
        _call(**overrides)
    for word in words:
        assert word in str(info.value), f"{word!r} not in {str(info.value)!r}"


def test_valid_variants_are_accepted():
    """Things that look unusual but are valid by the spec."""
    _call(segment_lengths=(4, 8), dilation_rates=(1, 2))
    _call(causal=np.bool_(True), return_lse=np.bool_(False))  # NumPy's bools, as torch takes them
    _call(scale=1e30)
    assert torch.isfinite(_call(q=q0.double(), k=k0.double(), v=v0.double(), scale=1e300)).all()
    _call(segment_lengths=torch.tensor([4, 8]), dilation_rates=[np.int64(1), 2])
    _call(segment_lengths=[100, 3], dilation_rates=[7, 5])  # w > N, r > w
    _call(scale=0)
    _call(scale=-1.5)
    _call(head_groups="split", segment_lengths=[1, 2, 3, 4], dilation_rates=[1, 2, 3, 4])


def test_direct_op_calls_are_checked_too():
    """torch.ops.dilated_attn.* called without the Python layer still raise ValueError, not crash."""
    q, k, v = _qkv()
    op = torch.ops.dilated_attn.forward
    with pytest.raises(ValueError, match="segment_lengths"):
        op(q, k, v, [], [], False, False, 1.0)
    with pytest.raises(ValueError, match="positive"):
        op(q, k, v, [4], [0], False, False, 1.0)
    with pytest.raises(ValueError, match="same length"):
        op(q, k, v, [4], [1, 2], False, False, 1.0)
    with pytest.raises(ValueError, match="multiple"):
        op(q, k[:, :, :1].expand(1, 8, 3, 4), v[:, :, :1].expand(1, 8, 3, 4), [4], [1], False, False, 1.0)
    with pytest.raises(ValueError, match="split"):
        op(q, k, v, [1] * 5, [1] * 5, True, False, 1.0)
    with pytest.raises(ValueError, match="4-D"):
        op(q[0], k, v, [4], [1], False, False, 1.0)


_NUMBERED_MESSAGES = textwrap.dedent("""
    import sys
    import torch, dilated_attn
    op = torch.ops.dilated_attn.forward
    for device in sys.argv[1:]:
        q = torch.randn(1, 8, 3, 4, device=device)
        wide = torch.randn(1, 8, 2, 1024, device=device)
        cases = [(q[0], q, q, [4], [1]), (q, q, q, [4], [1, 2]), (q, q[:, :, :2], q[:, :, :2], [4], [1])]
        for args in cases + [(wide, wide, wide, [8], [1])] * (device == "cuda"):
            try:
                op(*args, False, False, 1.0)
                print("no error")
            except ValueError as exc:
                print("ValueError:", exc)
    """)


@pytest.mark.parametrize("devices", [("cpu",), pytest.param(("cpu", "cuda"), marks=pytest.mark.gpu)])
def test_messages_with_numbers_raise(devices):
    """The extension's messages that carry numbers raise ValueError, checked in a process of their own: a build by
    a compiler that links libstdc++ into the extension statically segfaulted formatting them (csrc/checks.h)."""
    r = subprocess.run([sys.executable, "-c", _NUMBERED_MESSAGES, *devices], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.splitlines()
    assert len(lines) == 3 * len(devices) + ("cuda" in devices) and all(x.startswith("ValueError") for x in lines), lines
    for text in ("got 3-D", "got 1 and 2", "got 3 and 2"):
        assert sum(text in x for x in lines) == len(devices), (text, lines)
    if "cuda" in devices:
        assert any("head_dim must be <= " in x and "got 1024" in x for x in lines), lines


def test_op_branches_for_a_symbolic_length():
    """Under torch.compile a sequence length marked dynamic is symbolic: a segment within it reaches the ops as its
    int, one longer than it as the length itself, never as an expression such as Min(512, n)."""
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    env = ShapeEnv()
    n = env.create_symintnode(env.create_symbol(384, ConstantSource("n")), hint=384)
    p = dilated_attn.spec.Problem.from_sizes(1, 1024, 8, 8, 16, [256, 512, 4096], [1, 2, 8], dtype=torch.float32,
                                             device=torch.device("cpu"))
    w, r = p.op_branches(n)
    assert w == [256, 384, 384] and r == [1, 2, 8]
    assert type(w[0]) is int and w[1] is n and w[2] is n and all(type(x) is int for x in r), (w, r)
    # a dilation the clipped segment caps is that length too
    w, r = dataclasses.replace(p, dilation_rates=(1, 2, 4096)).op_branches(n)
    assert r[:2] == [1, 2] and r[2] is n, r


def test_heads_first_layout_is_warned_about():
    """q, k, v in PyTorch SDPA's [B, H, N, D] layout pass every check and give a wrong result: with far more
    "heads" than positions, and more heads than models have, the call warns, naming both layouts."""
    x = torch.randn(1, 7, 2048, 8)  # 7 heads of 2048 positions, the wrong way round
    with pytest.warns(UserWarning, match=r"q has 2048 heads of 7 positions each.*\[batch, seq, heads, head_dim\].*"
                                         r"\[batch, heads, seq, head_dim\].*transpose\(1, 2\)"):
        dilated_attn.dilated_attention(x, x, x, [4], [1])
    with warnings.catch_warnings():  # a decoding step's many heads of one position, or GQA's 128 heads: no warning
        warnings.simplefilter("error")
        for shape in ((2, 1, 64, 8), (1, 3, 128, 8)):
            y = torch.randn(shape)
            dilated_attn.dilated_attention(y, y, y, [4], [1])


def test_swapped_branch_lists_are_warned_about():
    """Every r > w is legal but is what passing dilation_rates for segment_lengths gives (the modules, which take
    them in the other order too, raise): the functions warn; one such branch among others does not."""
    x = torch.randn(1, 64, 4, 8)
    with pytest.warns(UserWarning, match=r"dilation_rates \[16, 32\] are each larger than the segment_lengths "
                                         r"\[1, 2\].*look swapped"):
        dilated_attn.dilated_attention(x, x, x, [1, 2], [16, 32])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dilated_attn.dilated_attention(x, x, x, [16, 2], [1, 32])
    cache = torch.randn(1, 64, 4, 8)  # the KV-cache call warns the same, pointing at its caller
    with pytest.warns(UserWarning, match=r"dilation_rates \[16, 24\] .*look swapped") as caught:
        dilated_attn.dilated_attention_with_kvcache(x[:, :1], cache, cache.clone(), 3, [1, 2], [16, 24])
    assert caught[0].filename == __file__


def test_problem_from_sizes_is_validate_without_tensors():
    """Problem.from_sizes builds the Problem validate() builds for tensors of those sizes, and refuses what validate()
    refuses with the same error, naming the argument."""
    from dilated_attn.spec import Problem, validate

    q, k = torch.randn(2, 40, 4, 8), torch.randn(2, 40, 2, 8)
    kwargs = dict(causal=True, head_groups="split", scale=0.3)
    want = validate(q, k, k, [8, 16], [1, 2], **kwargs)
    got = Problem.from_sizes(2, 40, 4, 2, 8, [8, 16], [1, 2], dtype=torch.float32, device="cpu", **kwargs)
    assert got == want
    for sizes, branches, exc, words in [((2, 40, 3, 2, 8), ([8], [1]), ValueError, ["multiple of k/v heads"]),
                                        ((2, 40, 4, 2, 8), ([8, 16], [1]), ValueError, ["the same length"]),
                                        ((2, 40, 4, 2, 8), ([0], [1]), ValueError, ["segment_lengths"]),
                                        ((2, -1, 4, 2, 8), ([8], [1]), TypeError, ["seq_len", ">= 0"])]:
        with pytest.raises(exc) as info:
            Problem.from_sizes(*sizes, *branches, dtype=torch.float32, device="cpu")
        assert all(word in str(info.value) for word in words), str(info.value)
    with pytest.raises(TypeError, match="dtype must be a floating-point torch.dtype"):
        Problem.from_sizes(2, 40, 4, 2, 8, [8], [1], dtype=torch.int32, device="cpu")


def test_a_query_in_sdpa_layout_with_fewer_kv_heads_is_told_to_transpose():
    """q [B, H, S, D] with k, v [B, Hkv, S, D] (PyTorch SDPA's layout, GQA) fails the length check: the message says
    which layout they look like and to transpose; a plain length mismatch in the package's layout gets no such hint."""
    q, kv = torch.randn(1, 8, 4096, 64), torch.randn(1, 2, 4096, 64)
    with pytest.raises(ValueError, match=r"got 2; they look like \[batch, heads, seq, head_dim\].*transpose\(1, 2\)"):
        dilated_attn.dilated_attention(q, kv, kv, [2048], [1])
    q, kv = torch.randn(1, 4096, 8, 64), torch.randn(1, 2048, 8, 64)
    with pytest.raises(ValueError, match=r"self-attention only\), got 2048$"):
        dilated_attn.dilated_attention(q, kv, kv, [2048], [1])
