"""The nn.Module front ends against a float64 composition of torch.nn.Linear/LayerNorm and the reference,
their argument checks, MAGNETO initialisation, attention dropout (routed to the reference), and Hilbert
ordering of grid inputs (against serialize -> raster layer -> deserialize)."""

import inspect
import math
import warnings

import pytest
import torch
from torch import nn

import dilated_attn
from dilated_attn import DilatedAttention, MultiheadDilatedAttention, compile_hints
from dilated_attn.hilbert import deserialize, hilbert_index, serialize
from dilated_attn.reference import dilated_attention_reference

SEGS, DILS = [4, 8, 16], [1, 2, 4]
# The expected one-time notices that training with dropout runs the reference; the tests that check them record
# warnings themselves.
pytestmark = pytest.mark.filterwarnings("ignore:dilated_attn.*attention_dropout:UserWarning")


@pytest.fixture(autouse=True)
def _fresh_warnings(monkeypatch):
    monkeypatch.setattr(compile_hints, "_WARNED", set())


def _dropout_warnings(fn):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = fn()
    return result, [str(w.message) for w in caught if "attention_dropout" in str(w.message)]


def _composition(m: MultiheadDilatedAttention, query, key, value, causal):
    """What MultiheadDilatedAttention computes, written with plain torch.nn modules holding copies of its
    parameters and the reference. Returns the output and {m's parameter name: the copy}."""
    mods = {}
    for name in ("q_proj", "k_proj", "v_proj", "out_proj"):
        src = getattr(m, name)
        mods[name] = nn.Linear(src.in_features, src.out_features, bias=src.bias is not None, dtype=torch.float64)
    if m.layer_norm:
        mods["norm"] = nn.LayerNorm(m.embed_dim, eps=m.norm.eps, dtype=torch.float64)
    for name, mod in mods.items():
        mod.load_state_dict(getattr(m, name).state_dict())
    B, N, E = query.shape
    D = E // m.num_heads
    q = mods["q_proj"](query).reshape(B, N, m.num_heads, D)
    k = mods["k_proj"](key).reshape(B, N, -1, D)
    v = mods["v_proj"](value).reshape(B, N, -1, D)
    a = m.attention
    x, _ = dilated_attention_reference(q, k, v, a.segment_lengths, a.dilation_rates, causal=causal,
                                       head_groups=a.head_groups)
    x = x.reshape(B, N, E)
    if m.layer_norm:
        x = mods["norm"](x)
    params = {f"{name}.{p}": t for name, mod in mods.items() for p, t in mod.named_parameters()}
    return mods["out_proj"](x), params


def _perturb(module):
    """Non-trivial values for every parameter (the MAGNETO init has zero biases and unit LayerNorm)."""
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype))


@pytest.mark.parametrize(
    "num_heads, num_kv_heads, head_groups, causal, layer_norm, bias, separate_kv",
    [
        (4, None, "all", False, True, True, False),
        (6, 2, "all", True, True, True, True),  # GQA
        (6, 1, "split", False, False, True, False),  # MQA
        (5, 5, "split", True, True, False, True),
        (3, 3, "split", True, False, False, False),
    ],
)
def test_multihead_matches_linear_plus_reference(num_heads, num_kv_heads, head_groups, causal, layer_norm, bias,
                                                 separate_kv):
    torch.manual_seed(0)
    E = num_heads * 6
    m = MultiheadDilatedAttention(E, num_heads, DILS, SEGS, bias=bias, layer_norm=layer_norm, dtype=torch.float64,
                                  num_kv_heads=num_kv_heads, head_groups=head_groups)
    _perturb(m)
    x = torch.randn(2, 29, E, dtype=torch.float64, requires_grad=True)
    kv = torch.randn(2, 29, E, dtype=torch.float64, requires_grad=True) if separate_kv else None
    out, weights = m(x, kv, kv, is_causal=causal) if separate_kv else m(x, is_causal=causal)
    assert weights is None and out.shape == x.shape
    expected, copies = _composition(m, x, kv if separate_kv else x, kv if separate_kv else x, causal)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)
    names = [name for name, _ in m.named_parameters()]
    assert sorted(names) == sorted(copies)
    go = torch.randn_like(out)
    inputs = [x] + ([kv] if separate_kv else [])
    got = torch.autograd.grad(out, inputs + [dict(m.named_parameters())[n] for n in names], go)
    want = torch.autograd.grad(expected, inputs + [copies[n] for n in names], go)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)


def test_key_and_value_default_to_query():
    m = MultiheadDilatedAttention(16, 4, DILS, SEGS, dtype=torch.float64)
    x = torch.randn(1, 20, 16, dtype=torch.float64)
    torch.testing.assert_close(m(x)[0], m(x, x, x)[0], rtol=0, atol=0)


@pytest.mark.parametrize("head_groups", ["all", "split"])
@pytest.mark.parametrize("causal", [False, True])
def test_dilated_attention_module_matches_reference(head_groups, causal):
    q = torch.randn(2, 33, 6, 8, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, 33, 3, 8, dtype=torch.float64, requires_grad=True) for _ in range(2))
    m = DilatedAttention(SEGS, DILS, softmax_scale=0.3, head_groups=head_groups)
    out = m(q, k, v, is_causal=causal)
    ref, _ = dilated_attention_reference(q, k, v, SEGS, DILS, causal=causal, scale=0.3, head_groups=head_groups)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    go = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), go), torch.autograd.grad(ref, (q, k, v), go)):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)


def test_magneto_init():
    m = MultiheadDilatedAttention(512, 8, DILS, SEGS, num_kv_heads=8, gamma_init=0.5)
    xavier = math.sqrt(2.0 / (512 + 512))
    for name, gain in (("q_proj", 1.0), ("k_proj", 1.0), ("v_proj", 0.5), ("out_proj", 0.5)):
        proj = getattr(m, name)
        assert abs(proj.weight.std().item() / (gain * xavier) - 1) < 0.02, name
        assert torch.count_nonzero(proj.bias) == 0, name
    assert m.norm is not None and m.gamma_init == 0.5
    assert MultiheadDilatedAttention(16, 4, DILS, SEGS, bias=False, layer_norm=False).norm is None


def test_device_and_dtype_reach_every_parameter():
    m = MultiheadDilatedAttention(16, 4, DILS, SEGS, num_kv_heads=2, dtype=torch.float64, device="meta")
    assert {(p.dtype, p.device.type) for p in m.parameters()} == {(torch.float64, "meta")}
    assert m.k_proj.out_features == 8 and m.v_proj.out_features == 8  # num_kv_heads * head_dim


# --- compatibility with fkodom's dilated-attention-pytorch 0.2.0 ---------------------------------------------

FKODOM_MODULE = ["segment_lengths", "dilation_rates", "softmax_scale", "attention_dropout", "op"]
FKODOM_MULTIHEAD = ["embed_dim", "num_heads", "dilation_rates", "segment_lengths", "dropout", "bias", "layer_norm",
                    "layer_norm_eps", "gamma_init", "device", "dtype", "op"]
FKODOM_KEYS = {f"{name}.{p}" for name in ("q_proj", "k_proj", "v_proj", "norm", "out_proj") for p in ("weight", "bias")}
FAKE_OP = (type("FwOp", (), {}), type("BwOp", (), {}))  # stands for an xformers (forward, backward) op pair


@pytest.mark.parametrize("cls, fkodom", [(DilatedAttention, FKODOM_MODULE),
                                         (MultiheadDilatedAttention, FKODOM_MULTIHEAD)])
def test_signature_is_fkodoms_then_keyword_only(cls, fkodom):
    params = list(inspect.signature(cls).parameters.values())
    assert [p.name for p in params[: len(fkodom)]] == fkodom
    assert all(p.kind is p.KEYWORD_ONLY for p in params[len(fkodom):])
    forward = list(inspect.signature(cls.forward).parameters.values())[1:]
    assert [p.name for p in forward[:4]] == ["query", "key", "value", "is_causal"]
    assert [(p.name, p.kind) for p in forward[4:]] == [("kv_cache", inspect.Parameter.KEYWORD_ONLY)]


@pytest.mark.parametrize("op", [None, FAKE_OP])
def test_dilated_attention_fkodom_calls(op):
    q, k, v = _inputs()
    ref, _ = dilated_attention_reference(q, k, v, SEGS, DILS, causal=True, scale=0.3)
    positional = DilatedAttention(SEGS, DILS, 0.3, 0.0, op)
    keyword = DilatedAttention(segment_lengths=SEGS, dilation_rates=DILS, softmax_scale=0.3, attention_dropout=0.0,
                               op=op)
    for m in (positional, keyword):
        torch.testing.assert_close(m(q, k, v, True), ref, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(m(query=q, key=k, value=v, is_causal=True), ref, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("op", [None, FAKE_OP])
def test_multihead_fkodom_calls_and_state_dict(op):
    positional = MultiheadDilatedAttention(16, 4, DILS, SEGS, 0.0, True, True, 1e-5, 0.5, None, torch.float64, op)
    keyword = MultiheadDilatedAttention(embed_dim=16, num_heads=4, dilation_rates=DILS, segment_lengths=SEGS,
                                        dropout=0.0, bias=True, layer_norm=True, layer_norm_eps=1e-5, gamma_init=0.5,
                                        device=None, dtype=torch.float64, op=op)
    assert set(positional.state_dict()) == FKODOM_KEYS  # dilated-attention-pytorch's parameter names
    _perturb(positional)
    keyword.load_state_dict(positional.state_dict(), strict=True)
    x, kv = (torch.randn(2, 20, 16, dtype=torch.float64) for _ in range(2))
    expected, _ = _composition(positional, x, kv, kv, True)
    for m in (positional, keyword):
        torch.testing.assert_close(m(x, kv, kv, True)[0], expected, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(m(query=x, key=kv, value=kv, is_causal=True)[0], expected, rtol=1e-10, atol=1e-10)


def test_our_arguments_are_keyword_only():
    # A positional value in op's place is one of our keyword-only arguments, not an xformers op.
    with pytest.raises(TypeError, match="op is .* got str 'split': the arguments after op are keyword-only"):
        DilatedAttention(SEGS, DILS, None, 0.0, "split")
    with pytest.raises(TypeError, match="op is .* got int 2"):
        MultiheadDilatedAttention(16, 4, DILS, SEGS, 0.0, True, True, 1e-5, 1.0, None, None, 2)
    with pytest.raises(TypeError, match="positional"):
        DilatedAttention(SEGS, DILS, None, 0.0, None, "split")
    q, k, v = _inputs()
    with pytest.raises(TypeError, match="'q'"):  # one name per input: fkodom's query/key/value
        DilatedAttention(SEGS, DILS)(q=q, k=k, v=v)


def test_swapped_lists_are_refused():
    swapped = r"dilation_rates \[128, 256, 512\] are each larger than the segment_lengths \[1, 2, 4\].*look swapped"
    with pytest.raises(ValueError, match=swapped + r" \(MultiheadDilatedAttention takes dilation_rates before "
                       r"segment_lengths, as dilated-attention-pytorch does\)"):
        MultiheadDilatedAttention(256, 8, [128, 256, 512], [1, 2, 4])
    with pytest.raises(ValueError, match=swapped + r" \(DilatedAttention takes segment_lengths before dilation_rates"):
        DilatedAttention([1, 2, 4], [128, 256, 512])
    # Some branches with r > w among others can be deliberate.
    MultiheadDilatedAttention(16, 4, [8, 1, 32], [4, 8, 16])
    DilatedAttention([4, 8, 16], [8, 1, 32])
    DilatedAttention([4], [4])


BAD_MULTIHEAD = [
    # (overrides, exception, words the message must contain)
    (dict(embed_dim=16.0), TypeError, ["embed_dim", "int"]),
    (dict(embed_dim=0), ValueError, ["embed_dim", "positive"]),
    (dict(num_heads=-2), ValueError, ["num_heads", "positive"]),
    (dict(embed_dim=18), ValueError, ["embed_dim (18)", "divisible by num_heads (4)"]),
    (dict(num_kv_heads=3), ValueError, ["num_heads (4)", "divisible by num_kv_heads (3)"]),
    (dict(num_kv_heads=0), ValueError, ["num_kv_heads", "positive"]),
    (dict(dropout=1.5), ValueError, ["dropout", "[0, 1]"]),
    (dict(dropout="0.1"), TypeError, ["dropout"]),
    (dict(dropout=0.1, backend="cpu"), ValueError, ["dropout > 0", "backend='cpu'"]),
    (dict(bias=1), TypeError, ["bias", "bool"]),
    (dict(layer_norm=None), TypeError, ["layer_norm", "bool"]),
    (dict(layer_norm_eps=0.0), ValueError, ["layer_norm_eps", "positive"]),
    (dict(gamma_init=math.inf), ValueError, ["gamma_init", "finite"]),
    (dict(segment_lengths=[]), ValueError, ["segment_lengths", "empty"]),
    (dict(segment_lengths=[4, 8]), ValueError, ["segment_lengths and dilation_rates", "same length"]),
    (dict(dilation_rates=[1, 0, 2]), ValueError, ["dilation_rates[1]", "positive"]),
    (dict(head_groups="split", num_heads=2, embed_dim=8), ValueError, ["head_groups='split'", "2 heads < 3"]),
    (dict(head_groups="some"), ValueError, ["head_groups"]),
    (dict(backend="fast"), ValueError, ["backend"]),
]


@pytest.mark.parametrize("overrides, exc, words", BAD_MULTIHEAD, ids=[str(i) for i in range(len(BAD_MULTIHEAD))])
def test_multihead_argument_checks(overrides, exc, words):
    args = dict(embed_dim=16, num_heads=4, dilation_rates=DILS, segment_lengths=SEGS)
    args.update(overrides)
    with pytest.raises(exc) as info:
        MultiheadDilatedAttention(**args)
    for word in words:
        assert word in str(info.value), f"{word!r} not in {str(info.value)!r}"


BAD_MODULE = [
    (dict(softmax_scale="big"), TypeError, ["scale"]),
    (dict(attention_dropout=-0.1), ValueError, ["attention_dropout", "[0, 1]"]),
    (dict(attention_dropout=0.2, backend="triton"), ValueError, ["attention_dropout > 0", "backend='triton'"]),
    (dict(segment_lengths=8), TypeError, ["segment_lengths", "sequence"]),
    (dict(head_groups=None), TypeError, ["head_groups"]),
]


@pytest.mark.parametrize("overrides, exc, words", BAD_MODULE, ids=[str(i) for i in range(len(BAD_MODULE))])
def test_dilated_attention_argument_checks(overrides, exc, words):
    args = dict(segment_lengths=SEGS, dilation_rates=DILS)
    args.update(overrides)
    with pytest.raises(exc) as info:
        DilatedAttention(**args)
    for word in words:
        assert word in str(info.value), f"{word!r} not in {str(info.value)!r}"


def test_forward_checks_its_inputs():
    m = MultiheadDilatedAttention(16, 4, DILS, SEGS)
    with pytest.raises(ValueError, match=r"query must be \[batch, seq, embed_dim=16\], got \(20, 16\)"):
        m(torch.randn(20, 16))
    with pytest.raises(ValueError, match="key must be"):
        m(torch.randn(1, 20, 16), torch.randn(1, 20, 8), torch.randn(1, 20, 16))
    with pytest.raises(TypeError, match="value must be a torch.Tensor"):
        m(torch.randn(1, 20, 16), value=[1.0])
    with pytest.raises(TypeError, match="causal must be a bool"):
        m(torch.randn(1, 20, 16), is_causal=None)


# --- dropout -------------------------------------------------------------------------------------------------


def _inputs(B=1, N=24, H=4, D=5):
    g = torch.Generator().manual_seed(3)
    return [torch.randn(B, N, H, D, generator=g, dtype=torch.float64) for _ in range(3)]


def test_eval_mode_or_no_dropout_is_the_plain_dispatch():
    q, k, v = _inputs()
    plain = dilated_attn.dilated_attention(q, k, v, SEGS, DILS)
    m = DilatedAttention(SEGS, DILS, attention_dropout=0.5).eval()
    (out, warned) = _dropout_warnings(lambda: m(q, k, v))
    assert torch.equal(out, plain) and warned == []
    assert torch.equal(DilatedAttention(SEGS, DILS, attention_dropout=0.0).train()(q, k, v), plain)


def test_training_dropout_runs_the_reference_and_warns_once():
    q, k, v = _inputs()
    m = DilatedAttention(SEGS, DILS, attention_dropout=0.3).train()
    first, warned = _dropout_warnings(lambda: m(q, k, v))
    assert len(warned) == 1 and "runs the reference backend instead of cpu" in warned[0]
    second, warned = _dropout_warnings(lambda: m(q, k, v))
    assert warned == [] and not torch.equal(first, second)  # fresh masks each call, one warning
    torch.manual_seed(11)
    again = m(q, k, v)
    torch.manual_seed(11)
    ref, _ = dilated_attention_reference(q, k, v, SEGS, DILS, dropout_p=0.3)
    assert torch.equal(again, ref)  # exactly the reference's dropout, through torch's RNG
    _, warned = _dropout_warnings(lambda: DilatedAttention(SEGS, DILS, 0.3, backend="reference").train()(q, k, v))
    assert warned == []  # nothing slower than asked for


def test_dropout_is_unbiased():
    """E[dropout output] = the output without dropout: many independent masks (one per batch element) average
    to the eval-mode output, within 5 standard errors."""
    q, k, v = (x.expand(2000, -1, -1, -1) for x in _inputs())
    m = DilatedAttention(SEGS, DILS, attention_dropout=0.4)
    expected = m.eval()(q[:1], k[:1], v[:1])[0]
    samples = m.train()(q, k, v)
    stderr = samples.std(0) / math.sqrt(samples.shape[0])
    assert ((samples.mean(0) - expected).abs() <= 5 * stderr + 1e-12).all()
    assert (samples == 0).any() and not torch.allclose(samples[0], expected)


def test_dropout_drops_each_entry_of_the_merged_softmax():
    """The variance pins down which entries are dropped. With v the identity (v[t] = e_t), output column t is
    sum_i a_i(t) M_i(t) / (1 - p), a_i(t) = exp(lse_i - LSE) softmax_i(t) the merged probability of key t in
    branch i and M_i(t) independent Bernoulli(1 - p) masks: variance p / (1 - p) * sum_i a_i(t)^2. Dropping per
    key instead of per (branch, key) entry would give p / (1 - p) * (sum_i a_i(t))^2; the overlapping branches
    below make the two differ by about 1.5x."""
    p, N, segs, dils = 0.3, 12, [4, 12, 12], [1, 1, 2]
    g = torch.Generator().manual_seed(4)
    q, k = (torch.randn(1, N, 1, N, generator=g, dtype=torch.float64) for _ in range(2))
    v = torch.eye(N, dtype=torch.float64)[None, :, None, :]
    _, lse = dilated_attention_reference(q, k, v, segs, dils)
    a = []
    for w, r in zip(segs, dils):
        out_i, lse_i = dilated_attention_reference(q, k, v, [w], [r])
        a.append(torch.exp(lse_i - lse)[0, 0, :, None] * out_i[0, :, 0])  # [N queries, N keys]
    a = torch.stack(a)
    per_entry, per_key = p / (1 - p) * (a**2).sum(0), p / (1 - p) * a.sum(0) ** 2
    assert per_key.sum() > 1.3 * per_entry.sum()
    n = 5000
    samples = DilatedAttention(segs, dils, attention_dropout=p).train()(*(x.expand(n, -1, -1, -1) for x in (q, k, v)))
    samples = samples[:, :, 0]  # [n, N, N]
    torch.testing.assert_close(samples.mean(0), a.sum(0), rtol=0, atol=0.03)
    assert abs(samples.var(0).sum() / per_entry.sum() - 1) < 0.05


def test_dropout_gradients_flow():
    m = MultiheadDilatedAttention(16, 4, DILS, SEGS, dropout=0.2, dtype=torch.float64).train()
    x = torch.randn(2, 20, 16, dtype=torch.float64, requires_grad=True)
    out, _ = m(x)
    out.square().sum().backward()
    assert torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in m.parameters())


def test_compiled_module_matches_eager():
    m = MultiheadDilatedAttention(24, 6, DILS, SEGS, num_kv_heads=2).eval()
    x = torch.randn(2, 30, 24, requires_grad=True)
    compiled = torch.compile(m, fullgraph=True, backend="aot_eager")
    out, eager = compiled(x, is_causal=True)[0], m(x, is_causal=True)[0]
    torch.testing.assert_close(out, eager, rtol=1e-6, atol=1e-6)
    go = torch.randn_like(out)
    torch.testing.assert_close(torch.autograd.grad(out, x, go)[0], torch.autograd.grad(eager, x, go)[0],
                               rtol=1e-5, atol=1e-6)


# --- spatial_shape / ordering="hilbert" ----------------------------------------------------------------------


def _pair(shape, segs=SEGS, dils=DILS, **kwargs):
    """A hilbert-ordered module and a raster one with the same parameters (non-trivial values)."""
    args = (24, 6, dils, segs)
    kwargs = dict(dtype=torch.float64, **kwargs)
    hil = MultiheadDilatedAttention(*args, **kwargs, spatial_shape=shape, ordering="hilbert")
    _perturb(hil)
    ras = MultiheadDilatedAttention(*args, **kwargs)
    ras.load_state_dict(hil.state_dict())  # the curve buffers are not in the state_dict
    return hil, ras


def _grads(out, inputs, module, go):
    return torch.autograd.grad(out, list(inputs) + list(module.parameters()), go)




@pytest.mark.parametrize("shape", [(5, 6), (8, 8), (7, 3), (2, 3, 5), (4, 4, 2), (3, 1, 9)])
@pytest.mark.parametrize("inputs", ["self", "kv", "k_v"])
@pytest.mark.parametrize("causal", [False, True])
def test_hilbert_is_serialize_raster_deserialize(shape, inputs, causal):
    """ordering="hilbert" == deserialize(raster layer(serialize(query), serialize(key), serialize(value))),
    forward and backward, with key and value the query, one shared tensor, or two distinct tensors."""
    hil, ras = _pair(shape, num_kv_heads=2)
    n = math.prod(shape)
    g = torch.Generator().manual_seed(1)
    x, k, v = (torch.randn(2, n, 24, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    args = {"self": (x,), "kv": (x, k, k), "k_v": (x, k, v)}[inputs]
    leaves = {"self": (x,), "kv": (x, k), "k_v": (x, k, v)}[inputs]
    out, _ = hil(*args, is_causal=causal)
    expected = deserialize(ras(*(serialize(a, shape) for a in args), is_causal=causal)[0], shape)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    go = torch.randn(out.shape, generator=g, dtype=torch.float64)
    got, want = _grads(out, leaves, hil, go), _grads(expected, leaves, ras, go)
    for a, b in zip(got, want):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, rtol=1e-11, atol=1e-12)


@pytest.mark.parametrize("shape", [(6, 7), (4, 2, 5)])
@pytest.mark.parametrize("separate_kv", [False, True])
def test_hilbert_equals_raster_for_permutation_equivariant_attention(shape, separate_kv):
    """One dense branch (segment >= N, dilation 1, not causal) attends every position to every position, so
    the order of the tokens cannot matter: same outputs and parameter gradients as raster."""
    hil, ras = _pair(shape, segs=[64], dils=[1])
    n = math.prod(shape)
    x = torch.randn(2, n, 24, dtype=torch.float64)
    args = (x, torch.randn_like(x), torch.randn_like(x)) if separate_kv else (x,)
    out, ref = hil(*args)[0], ras(*args)[0]
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    go = torch.randn_like(out)
    for a, b in zip(_grads(out, (), hil, go), _grads(ref, (), ras, go)):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


def test_hilbert_modules_own_their_permutation():
    """A module's curve buffers are its own: changing one module's leaves another's and hilbert_index's alone."""
    a = MultiheadDilatedAttention(32, 4, [1, 2], [8, 16], spatial_shape=(4, 4), ordering="hilbert")
    b = MultiheadDilatedAttention(32, 4, [1, 2], [8, 16], spatial_shape=(4, 4), ordering="hilbert")
    want = hilbert_index((4, 4)).clone()
    a._curve_perm.zero_()
    assert torch.equal(b._curve_perm, want) and torch.equal(hilbert_index((4, 4)), want)


def test_hilbert_differs_from_raster_with_several_branches():
    # Catches a hilbert ordering that silently does nothing: sparse branches see different neighbours.
    hil, ras = _pair((8, 8))
    x = torch.randn(2, 64, 24, dtype=torch.float64)
    assert (hil(x)[0] - ras(x)[0]).abs().max() > 1e-2


def test_hilbert_causality_follows_the_curve():
    """With is_causal=True the j-th cell ON THE CURVE sees only cells 0..j of the curve: changing the input at
    the cell perm[j] changes no output at curve positions < j (and does change position j)."""
    shape = (5, 6)
    hil, _ = _pair(shape)
    perm = hilbert_index(shape)
    x = torch.randn(1, 30, 24, dtype=torch.float64)
    base = hil(x, is_causal=True)[0]
    raster_violations = 0
    for j in (0, 7, 20, 29):
        y = x.clone()
        y[:, perm[j]] += 1.0
        changed = (hil(y, is_causal=True)[0] - base).abs().amax(-1)[0, perm] > 0  # per curve position
        assert not changed[:j].any() and changed[j]
        # later on the curve but earlier in row-major order: raster causality would forbid these
        raster_violations += int((perm[j + 1:][changed[j + 1:]] < perm[j]).sum())
    assert raster_violations > 0


def test_hilbert_buffers_follow_the_module():
    hil, ras = _pair((6, 5))
    assert "_curve_perm" not in hil.state_dict() and torch.equal(hil._curve_perm, hilbert_index((6, 5)))
    # Meta-device init, then to_empty: buffers come back uninitialised, and the state_dict does not restore
    # non-persistent ones; the module refills them.
    meta = MultiheadDilatedAttention(24, 6, DILS, SEGS, num_kv_heads=None, dtype=torch.float64, device="meta",
                                     spatial_shape=(6, 5), ordering="hilbert")
    assert meta._curve_perm.device.type == "meta"
    meta.to_empty(device="cpu")
    meta.load_state_dict(hil.state_dict())
    x = torch.randn(2, 30, 24, dtype=torch.float64)
    assert torch.equal(meta(x)[0], hil(x)[0])
    assert hil.float()._curve_perm.dtype == torch.long  # dtype conversions leave the indices alone


BAD_GRID = [
    (dict(ordering="zigzag"), ValueError, ["ordering", "'raster' or 'hilbert'", "'zigzag'"]),
    (dict(ordering=None), ValueError, ["ordering"]),
    (dict(ordering="hilbert"), ValueError, ["ordering='hilbert'", "spatial_shape"]),
    (dict(spatial_shape=(64,), ordering="hilbert"), ValueError, ["spatial_shape", "2 or 3"]),
    (dict(spatial_shape=(2, 3, 4, 5)), ValueError, ["spatial_shape", "2 or 3"]),
    (dict(spatial_shape=64), TypeError, ["spatial_shape"]),
    (dict(spatial_shape=(0, 8), ordering="hilbert"), ValueError, ["spatial_shape", "positive"]),
    (dict(spatial_shape=(8, -1)), ValueError, ["spatial_shape", "positive"]),
    (dict(spatial_shape=(8.0, 8)), TypeError, ["spatial_shape", "ints"]),
    (dict(spatial_shape=(True, 8)), TypeError, ["spatial_shape", "ints"]),
]


@pytest.mark.parametrize("overrides, exc, words", BAD_GRID, ids=[str(i) for i in range(len(BAD_GRID))])
def test_grid_argument_checks(overrides, exc, words):
    with pytest.raises(exc) as info:
        MultiheadDilatedAttention(16, 4, DILS, SEGS, **overrides)
    for word in words:
        assert word in str(info.value), f"{word!r} not in {str(info.value)!r}"


@pytest.mark.parametrize("ordering", ["raster", "hilbert"])
def test_forward_checks_the_grid_length(ordering):
    m = MultiheadDilatedAttention(16, 4, DILS, SEGS, spatial_shape=torch.Size([5, 6]), ordering=ordering)
    assert m.spatial_shape == (5, 6)
    with pytest.raises(ValueError, match=r"query has sequence length 29, but spatial_shape \(5, 6\) holds 30"):
        m(torch.randn(1, 29, 16))
    with pytest.raises(ValueError, match=r"key has sequence length 31, but spatial_shape"):
        m(torch.randn(1, 30, 16), torch.randn(1, 31, 16), torch.randn(1, 30, 16))
    assert m(torch.randn(1, 30, 16))[0].shape == (1, 30, 16)


def test_compiled_hilbert_module_matches_eager():
    shape = (4, 6)
    m, _ = _pair(shape)
    m = m.float().eval()
    x, kv = (torch.randn(2, 24, 24, requires_grad=True) for _ in range(2))
    compiled = torch.compile(m, fullgraph=True, backend="aot_eager")
    for args in ((x,), (x, kv, kv)):
        out, eager = compiled(*args, is_causal=True)[0], m(*args, is_causal=True)[0]
        torch.testing.assert_close(out, eager, rtol=1e-6, atol=1e-6)
        go = torch.randn_like(out)
        torch.testing.assert_close(torch.autograd.grad(out, args, go), torch.autograd.grad(eager, args, go),
                                   rtol=1e-5, atol=1e-6)


def test_multihead_kv_cache_decoding_matches_the_causal_forward():
    """Feeding a sequence in chunks through a KVCache gives the outputs of one causal forward over all of it;
    the cache's misuses are refused."""
    torch.manual_seed(0)
    mha = MultiheadDilatedAttention(32, 4, [1, 2], [8, 16], num_kv_heads=2, dtype=torch.float64).eval()
    x = torch.randn(2, 23, 32, dtype=torch.float64)
    cache = dilated_attn.KVCache(2, 30, 2, 8, dtype=torch.float64)
    with torch.no_grad():
        full, _ = mha(x, is_causal=True)
        parts = [mha(x[:, a:b], is_causal=True, kv_cache=cache)[0] for a, b in ((0, 9), (9, 10), (10, 23))]
    torch.testing.assert_close(torch.cat(parts, dim=1), full, atol=1e-12, rtol=0)
    assert cache.length == 23
    with torch.no_grad(), pytest.raises(ValueError, match="kv_cache needs is_causal=True"):
        mha(x[:, :1], kv_cache=cache)
    with pytest.raises(ValueError, match="inference only"):
        mha(x[:, :1], is_causal=True, kv_cache=cache)
    with torch.no_grad(), pytest.raises(TypeError, match="kv_cache must be a dilated_attn.KVCache"):
        mha(x[:, :1], is_causal=True, kv_cache=(cache.k, cache.v))
    with torch.no_grad(), pytest.raises(ValueError, match="the cache is too short"):
        mha(x[:, :8], is_causal=True, kv_cache=cache)
    assert cache.length == 23
    # a cache built for other kv heads is named, not the keys the module made
    wrong = dilated_attn.KVCache(2, 30, 4, 8, dtype=torch.float64)
    with torch.no_grad(), pytest.raises(ValueError, match="kv_cache was built for batch=2, num_kv_heads=4"):
        mha(x[:, :1], is_causal=True, kv_cache=wrong)
    assert wrong.length == 0


def test_kv_cache_decoding_needs_the_new_keys_and_values():
    """DilatedAttention with a cache but no key or value: refused, the cache untouched (it used to advance its
    length and write nothing)."""
    attention = DilatedAttention([8, 16], [1, 2]).eval()
    cache = dilated_attn.KVCache(1, 16, 2, 8)
    q = torch.randn(1, 1, 2, 8)
    with torch.no_grad():
        for key, value in ((None, None), (q, None)):
            with pytest.raises(TypeError, match="key and value must be tensors"):
                attention(q, key, value, is_causal=True, kv_cache=cache)
    assert cache.length == 0
