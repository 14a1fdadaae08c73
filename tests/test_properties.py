"""Property-based tests (hypothesis) of `dilated_attention` on CPU.

1. Random valid inputs: the cpu backend's out, LSE and gradients of q, k, v equal the float64 reference
   (a smaller float32 property uses the reduced-precision bound of parity.py).
2. Random invalid inputs: exactly ValueError or TypeError, with a message naming the offending argument;
   nothing else may escape.

Every property runs a fixed number of derandomized examples (the same ones on every run, no example
database), prints how many it ran, and checks that the generated cases reached the features it is meant to
exercise.
"""

import dataclasses
import math
import re
from collections import Counter

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dilated_attn
from dilated_attn.reference import dilated_attention_reference

from cases import Case, make_qkv, uncovered_positions
from parity import _err, _grads, check_against_reference

VALID64_EXAMPLES, VALID32_EXAMPLES, INVALID_EXAMPLES_PER_RULE = 800, 250, 50


def _settings(n):
    # derandomize: the examples are a function of the test's source alone, so CI is reproducible; no database
    # so a local failure does not change what the next run tries.
    return settings(max_examples=n, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow])


def _report(capsys, record_property, what, count, detail=""):
    record_property(what, count)
    with capsys.disabled():
        print(f"\n[{what}] {count} examples{detail}")


@dataclasses.dataclass(frozen=True)
class ScaledCase(Case):
    """A `cases.Case` that also carries `scale`, so parity.check_against_reference passes it through."""

    scale: object = None

    def kwargs(self):
        return dict(super().kwargs(), scale=self.scale)


# Scales: the default, ordinary values, and the extremes (0, tiny, subnormal, huge, negative).
EXTREME_SCALES = [0.0, 1e-30, -1e-30, 5e-324, 1e4, -1e4]


@st.composite
def valid_cases(draw, scales):
    kv_heads = draw(st.integers(1, 3))
    heads = kv_heads * draw(st.integers(1, 3))  # MHA, GQA, MQA (kv_heads = 1)
    m = draw(st.integers(1, 4))
    return ScaledCase(
        batch=draw(st.integers(1, 2)),
        seq_len=draw(st.integers(1, 70)),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=draw(st.integers(1, 40)),
        segment_lengths=tuple(draw(st.lists(st.integers(1, 80), min_size=m, max_size=m))),
        dilation_rates=tuple(draw(st.lists(st.integers(1, 9), min_size=m, max_size=m))),
        head_groups=draw(st.sampled_from(("all", "split") if heads >= m else ("all",))),  # split needs Hq >= m
        causal=draw(st.booleans()),
        layout=draw(st.sampled_from(("contiguous", "transposed", "strided"))),
        scale=draw(scales),
    )


def _features(case, seq_step):
    """The input-space features a case exercises; every one must be reached by the generated cases."""
    N, segs, dils = case.seq_len, case.segment_lengths, case.dilation_rates
    scale = case.scale
    on = {
        "gqa": 1 < case.num_kv_heads < case.num_heads,
        "mqa": case.num_kv_heads == 1 < case.num_heads,
        "split": case.head_groups == "split",
        "causal": case.causal,
        "non-causal": not case.causal,
        f"layout {case.layout}": True,
        "sequence slice": seq_step > 1,
        "w > N": any(w > N for w in segs),
        "partial last segment": any(w < N and N % w for w in segs),
        "r > w": any(r > w for w, r in zip(segs, dils)),
        ">= 3 branches": len(segs) >= 3,
        "uncovered rows": uncovered_positions(case),
        "default scale": scale is None,
        "extreme scale": scale in EXTREME_SCALES,
    }
    return {name for name, yes in on.items() if yes}


FEATURES = {"gqa", "mqa", "split", "causal", "non-causal", "layout contiguous", "layout transposed",
            "layout strided", "sequence slice", "w > N", "partial last segment", "r > w", ">= 3 branches",
            "uncovered rows", "default scale", "extreme scale"}


def _close(a, b, tol):
    """max |a - b| <= tol * max(1, max |b|)."""
    size = b.abs().max().item() if b.numel() else 0.0
    return _err(a, b) <= tol * max(1.0, size)


def test_valid_inputs_float64_match_reference(capsys, record_property):
    seen = Counter()

    @_settings(VALID64_EXAMPLES)
    @given(case=valid_cases(st.one_of(st.none(), st.floats(-8, 8), st.sampled_from(EXTREME_SCALES))),
           seed=st.integers(0, 2**16), seq_step=st.sampled_from((1, 2)))
    def prop(case, seed, seq_step):
        seen.update(_features(case, seq_step))
        seen["examples"] += 1
        # seq_step 2: the inputs are every other position of a longer tensor (stride(1) doubled).
        longer = dataclasses.replace(case, seq_len=case.seq_len * seq_step)
        q, k, v = (x.detach()[:, ::seq_step].requires_grad_() for x in make_qkv(longer, seed=seed))
        args = (q, k, v, case.segment_lengths, case.dilation_rates)
        out, lse = dilated_attn.dilated_attention(*args, return_lse=True, backend="cpu", **case.kwargs())
        ref_out, ref_lse = dilated_attention_reference(*args, **case.kwargs())

        assert out.shape == q.shape and out.is_contiguous() and out.dtype == torch.float64
        assert lse.shape == (case.batch, case.num_heads, case.seq_len) and lse.dtype == torch.float64
        uncovered = torch.isneginf(ref_lse)
        assert torch.equal(torch.isneginf(lse), uncovered) and torch.isfinite(lse[~uncovered]).all()
        assert (out.transpose(1, 2)[uncovered] == 0).all(), "uncovered rows must be exactly 0"
        # Both sides compute in float64, so they differ by rounding only: a score of size |S| carries an
        # absolute error ~|S| * 2^-53, which becomes a relative error of the softmax weights. The tolerance is
        # 1e-12 (~4500 ulps; the largest error seen in these cases is under 1e-15) times max(1, |S|), with |S|
        # bounded by Cauchy-Schwarz; the gradients carry another factor |scale| * |k| (resp. |q|) from dS.
        scale = case.head_dim**-0.5 if case.scale is None else case.scale
        qn, kn = (x.detach().norm(dim=-1).max().item() if x.numel() else 0.0 for x in (q, k))
        tol = 1e-12 * max(1.0, abs(scale) * qn * kn)
        assert _close(out, ref_out, tol), "out"
        assert _close(lse[~uncovered], ref_lse[~uncovered], tol), "lse"
        grad_tol = tol * max(1.0, abs(scale) * max(qn, kn))
        for name, a, b in zip("qkv", _grads(out, lse, (q, k, v)), _grads(ref_out, ref_lse, (q, k, v))):
            assert torch.isfinite(a).all() and _close(a, b, grad_tol), f"grad {name}"

    prop()
    _report(capsys, record_property, "valid float64 cases", seen["examples"])
    assert FEATURES <= set(seen), f"never generated: {sorted(FEATURES - set(seen))}"
    assert seen["examples"] >= 0.9 * VALID64_EXAMPLES


def test_valid_inputs_float32_within_reduced_precision_bound(capsys, record_property):
    """float32 cannot be compared with float64 at a fixed tolerance: its error grows with the scores' size
    and the number of keys. parity.check_against_reference bounds the kernel's error against float64 by
    FACTOR (2) x the error of the reference computed in float32 on the same inputs, plus a few float32 ulps
    (relative to the gradients' size for gradients): the kernel may be at most twice as inexact as a plain
    float32 implementation. The scales stay moderate here (|S| up to ~100): test_extremes.py covers large
    scores with bounds of their own."""
    count = Counter()

    @_settings(VALID32_EXAMPLES)
    @given(case=valid_cases(st.one_of(st.none(), st.floats(-2, 2), st.sampled_from([0.0, 1e-30]))),
           seed=st.integers(0, 2**16))
    def prop(case, seed):
        count["examples"] += 1
        check_against_reference(case, torch.float32, "cpu", seed, "cpu")

    prop()
    _report(capsys, record_property, "valid float32 cases", count["examples"])
    assert count["examples"] >= 0.9 * VALID32_EXAMPLES


# ---- invalid inputs -----------------------------------------------------------------------------------------
# Each mutation breaks one rule of the spec's Errors section in an otherwise valid call. It returns the
# exception the call must raise and the argument name its message must contain; `keys` are the call entries
# it changes (two mutations are combined only when their keys are disjoint).

QKV = st.sampled_from("qkv")
BRANCH_LISTS = st.sampled_from(("segment_lengths", "dilation_rates"))
NOT_BOOL = [0, 1, None, "yes", 1.0, np.bool_(True), torch.tensor(True)]


def _pick(draw, type_errors, value_errors):
    """Draw a bad value; TypeError if it is of the wrong type, ValueError if of the right type."""
    bad = draw(st.sampled_from(list(type_errors) + list(value_errors)))
    return bad, TypeError if any(bad is x for x in type_errors) else ValueError


def _not_a_tensor(draw, call):
    x = draw(QKV)
    call[x] = draw(st.sampled_from([None, 1.0, 3, "q", [[1.0]], np.ones((1, 1, 1, 1))]))
    return TypeError, x


def _rank(draw, call):
    x = draw(QKV)
    rank = draw(st.sampled_from((0, 1, 2, 3, 5, 6)))
    t = call[x]
    call[x] = t.flatten()[0] if rank == 0 else t.reshape((t.numel(),) + (1,) * (rank - 1))
    return ValueError, x


def _non_float(draw, call):
    x = draw(QKV)
    call[x] = call[x].to(draw(st.sampled_from((torch.int32, torch.int64, torch.uint8, torch.bool, torch.complex64))))
    return TypeError, x


def _dtype_mismatch(draw, call):
    x = draw(QKV)  # q's dtype differing from k's and v's is reported on k, with "q" in the message
    others = [d for d in (torch.float16, torch.bfloat16, torch.float32, torch.float64) if d != call[x].dtype]
    call[x] = call[x].to(draw(st.sampled_from(others)))
    return ValueError, x


def _device_mismatch(draw, call):
    x = draw(QKV)
    call[x] = call[x].to("meta")
    return ValueError, x


def _kv_shape(draw, call):
    B, N, Hq, D = call["q"].shape
    Hkv = call["k"].shape[2]
    shape = draw(st.sampled_from([(B + 1, N, Hkv, D), (B, N + draw(st.integers(1, 3)), Hkv, D),
                                  (B, N, Hkv, D + 1), (B, N, Hq + 1, D)]))  # last: Hq % Hkv != 0
    randn = lambda *size: call["q"].new_empty(size).normal_()  # noqa: E731 - q's dtype: only the shape is wrong
    call["k"], call["v"] = randn(*shape), randn(*shape)
    if draw(st.booleans()):  # or k and v of different shapes
        call["v"] = randn(B, N, Hkv + draw(st.integers(1, 2)), D)
    return ValueError, "k"


def _zero_size(draw, call):
    x = draw(st.sampled_from(["q", "kv", "head_dim"]))
    if x == "head_dim":
        call.update({n: call[n][..., :0] for n in "qkv"})
        return ValueError, "head_dim"
    call.update({n: call[n][:, :, :0] for n in x})
    return ValueError, x[0]


def _empty_branches(draw, call):
    names = draw(st.sampled_from([("segment_lengths",), ("dilation_rates",), ("segment_lengths", "dilation_rates")]))
    for name in names:
        call[name] = draw(st.sampled_from([[], (), range(0)]))
    return ValueError, names[0]


def _unequal_branches(draw, call):
    name = draw(BRANCH_LISTS)
    call[name] = list(call[name]) + draw(st.lists(st.integers(1, 9), min_size=1, max_size=2))
    return ValueError, name


def _bad_element(draw, call):
    name = draw(BRANCH_LISTS)
    j = draw(st.integers(0, len(call[name]) - 1))
    bad, exc = _pick(draw, [True, False, 2.0, 1.5, math.nan, math.inf, "3", None, [1], np.float64(4.0),
                            torch.tensor(2)], [0, -1, -7, np.int64(0)])
    call[name] = list(call[name])
    call[name][j] = bad
    return exc, f"{name}[{j}]"


def _not_a_sequence(draw, call):
    name = draw(BRANCH_LISTS)
    call[name] = draw(st.sampled_from([4, 4.0, None, "48", b"\x04", {4: 1}, {4}, iter([4]), torch.tensor(4),
                                       torch.tensor([4.0]), torch.tensor([[4]])]))
    return TypeError, name


def _split_too_few_heads(draw, call):
    m = call["q"].shape[2] + draw(st.integers(1, 2))
    call["segment_lengths"], call["dilation_rates"] = [4] * m, [1] * m
    call["head_groups"] = "split"
    return ValueError, "head_groups"


def _flag(name, type_errors, value_errors=()):
    def mutate(draw, call):
        call[name], exc = _pick(draw, type_errors, value_errors)
        return exc, name

    return mutate


MUTATIONS = {
    "not a tensor": ({"q", "k", "v"}, _not_a_tensor),
    "wrong rank": ({"q", "k", "v"}, _rank),
    "non-float dtype": ({"q", "k", "v"}, _non_float),
    "dtype mismatch": ({"q", "k", "v"}, _dtype_mismatch),
    "device mismatch": ({"q", "k", "v"}, _device_mismatch),
    "k/v shape": ({"k", "v"}, _kv_shape),
    "zero heads or head_dim": ({"q", "k", "v"}, _zero_size),
    "empty branches": ({"segment_lengths", "dilation_rates"}, _empty_branches),
    "unequal branches": ({"segment_lengths", "dilation_rates"}, _unequal_branches),
    "bad w or r": ({"segment_lengths", "dilation_rates"}, _bad_element),
    "branches not a sequence": ({"segment_lengths", "dilation_rates"}, _not_a_sequence),
    "split with Hq < m": ({"segment_lengths", "dilation_rates", "head_groups"}, _split_too_few_heads),
    "head_groups": ({"head_groups"}, _flag("head_groups", [None, 1, True, b"all", ["all"]],
                                           ["", "ALL", "Split", "all ", "heads"])),
    "causal": ({"causal"}, _flag("causal", NOT_BOOL)),
    "return_lse": ({"return_lse"}, _flag("return_lse", NOT_BOOL)),
    "scale": ({"scale"}, _flag("scale", ["0.5", True, False, 1j, [0.5]],
                               [math.nan, math.inf, -math.inf, np.float32("nan"), np.float64("-inf")])),
    # "cuda" is a valid name that cannot run CPU tensors ("triton" can, under TRITON_INTERPRET=1).
    "backend": ({"backend"}, _flag("backend", [None, 1, ["cpu"], b"cpu"], ["", "CPU", "gpu", "auto ", "cuda"])),
}


@st.composite
def invalid_calls(draw, primary):
    """(valid call, invalid call, [mutation names], [(exception, argument name)]): mutation `primary`,
    sometimes with a second one on other arguments."""
    kv_heads = draw(st.integers(1, 2))
    heads = kv_heads * draw(st.integers(1, 2))
    B, N, D, m = draw(st.integers(1, 2)), draw(st.integers(1, 8)), draw(st.integers(1, 4)), draw(st.integers(1, 2))
    dtype = draw(st.sampled_from((torch.float32, torch.float64)))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    q, k, v = (torch.randn(B, N, h, D, generator=g, dtype=dtype) for h in (heads, kv_heads, kv_heads))
    valid = dict(q=q, k=k, v=v, segment_lengths=draw(st.lists(st.integers(1, 9), min_size=m, max_size=m)),
                 dilation_rates=draw(st.lists(st.integers(1, 4), min_size=m, max_size=m)),
                 causal=draw(st.booleans()), scale=draw(st.one_of(st.none(), st.floats(-2, 2))),
                 head_groups=draw(st.sampled_from(("all", "split") if heads >= m else ("all",))),
                 return_lse=draw(st.booleans()), backend=draw(st.sampled_from(("auto", "cpu", "reference"))))
    call, names, expected, touched = dict(valid), [], [], set()
    for name in [primary] + draw(st.lists(st.sampled_from(sorted(MUTATIONS)), max_size=1)):
        keys, mutate = MUTATIONS[name]
        if not keys & touched:
            touched |= keys
            names.append(name)
            expected.append(mutate(draw, call))
    return valid, call, names, expected


def _call(call):
    call = dict(call)
    pos = [call.pop(n) for n in ("q", "k", "v", "segment_lengths", "dilation_rates")]
    return dilated_attn.dilated_attention(*pos, **call)


@pytest.mark.parametrize("primary", sorted(MUTATIONS))
def test_invalid_inputs_raise_value_or_type_error_naming_the_argument(primary, capsys, record_property, monkeypatch):
    """One test per broken rule (so every rule gets the same number of examples), each example possibly
    breaking a second rule on other arguments too."""
    monkeypatch.delenv("DILATED_ATTN_BACKEND", raising=False)
    tried = Counter()

    @_settings(INVALID_EXAMPLES_PER_RULE)
    @given(invalid_calls(primary))
    def prop(example):
        valid, call, names, expected = example
        tried[len(names)] += 1
        _call(valid)  # the unmutated call runs: the error below is the mutation's
        try:
            _call(call)
        except (ValueError, TypeError) as e:
            msg = str(e)
            # One mutation: exactly its exception and argument. Two: the check that runs first reports,
            # so one of the two (exception, argument) pairs must match.
            assert any(type(e) is exc and re.search(rf"(?<!\w){re.escape(arg)}(?!\w)", msg)
                       for exc, arg in expected), f"{type(e).__name__}: {msg!r}; expected one of {expected}"
        else:
            raise AssertionError(f"no error for {names}")

    prop()
    _report(capsys, record_property, f"invalid inputs: {primary}", sum(tried.values()),
            f" ({tried[2]} also breaking a second rule)")
    assert sum(tried.values()) >= 0.9 * INVALID_EXAMPLES_PER_RULE and tried[2] > 0
