"""The references against each other, against plain attention, and against hand-derived key sets."""

import math
import random

import pytest
import torch
from cases import make_qkv, random_case

import dilated_attn
from dilated_attn.reference import dilated_attention_bruteforce, dilated_attention_reference


def _loss_grads(out, lse, inputs, seed=1):
    """Gradients of a random linear function of (out, finite lse) - exercises the LSE output's gradient."""
    g = torch.Generator().manual_seed(seed)
    go = torch.randn(out.shape, generator=g, dtype=torch.float64).to(out.dtype)
    gl = torch.randn(lse.shape, generator=g, dtype=torch.float64).to(lse.dtype)
    finite = torch.isfinite(lse)
    loss = (out * go).sum() + (lse.masked_fill(~finite, 0) * gl).sum()
    return torch.autograd.grad(loss, inputs)


@pytest.mark.parametrize("index", range(120))
def test_gather_reference_matches_bruteforce(index):
    case = random_case(random.Random(1000 + index), max_seq=48)
    q, k, v = make_qkv(case, seed=index)
    args = (q, k, v, case.segment_lengths, case.dilation_rates)
    out_g, lse_g = dilated_attention_reference(*args, **case.kwargs())
    out_b, lse_b = dilated_attention_bruteforce(*args, **case.kwargs())
    torch.testing.assert_close(out_g, out_b, rtol=1e-10, atol=1e-12)
    assert torch.equal(torch.isinf(lse_g), torch.isinf(lse_b))
    torch.testing.assert_close(lse_g, lse_b, rtol=1e-10, atol=1e-12)
    for a, b in zip(_loss_grads(out_g, lse_g, (q, k, v)), _loss_grads(out_b, lse_b, (q, k, v))):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (3, 1)])
def test_one_dense_branch_is_plain_attention(causal, heads):
    """w >= N, r = 1: ordinary softmax attention (GQA by repeating kv heads)."""
    Hq, Hkv = heads
    q = torch.randn(2, 37, Hq, 16, dtype=torch.float64)
    k = torch.randn(2, 37, Hkv, 16, dtype=torch.float64)
    v = torch.randn(2, 37, Hkv, 16, dtype=torch.float64)
    rep = Hq // Hkv
    qh, kh, vh = (x.transpose(1, 2) for x in (q, k, v))
    kh, vh = kh.repeat_interleave(rep, 1), vh.repeat_interleave(rep, 1)
    scores = qh @ kh.transpose(-1, -2) / 4.0
    if causal:
        scores = scores.masked_fill(torch.ones(37, 37, dtype=torch.bool).triu(1), -math.inf)
    expected = (scores.softmax(-1) @ vh).transpose(1, 2)
    expected_lse = scores.logsumexp(-1)
    for fn in (dilated_attention_reference, dilated_attention_bruteforce):
        out, lse = fn(q, k, v, [64], [1], causal=causal)
        torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(lse, expected_lse, rtol=1e-12, atol=1e-12)


# Hand-derived from the spec's wording. With scale = 0 every score is 0, so each branch is a uniform
# average over its keys with lse_i = log(#keys), and the merge is a uniform average over the multiset
# union of the branches' keys. With v[t] = e_t (one-hot on the position), out[p, h] * (#keys) counts
# how often each key t is seen. Each entry: (N, Hq, segs, dils, head_groups, causal,
# {(query p, head h): {key t: multiplicity}}); an empty dict means p is a member of no branch for h.
KEY_SET_EXAMPLES = [
    # all heads, r = Hq: head h has offset h // ceil(2/2) = h.
    (8, 2, [4], [2], "all", False, {(0, 0): {0: 1, 2: 1}, (6, 0): {4: 1, 6: 1}, (5, 1): {5: 1, 7: 1},
                                    (1, 0): {}, (2, 1): {}}),
    # partial last segment [4]; causal inside segments.
    (5, 1, [2], [1], "all", True, {(4, 0): {4: 1}, (3, 0): {2: 1, 3: 1}, (2, 0): {2: 1}, (1, 0): {0: 1, 1: 1}}),
    # split: 3 heads over 2 branches -> groups {0, 1} and {2}; branch 1 offset 1 % 2 = 1.
    (4, 3, [2, 4], [1, 2], "split", False, {(2, 0): {2: 1, 3: 1}, (1, 1): {0: 1, 1: 1}, (0, 2): {},
                                            (3, 2): {1: 1, 3: 1}, (1, 2): {1: 1, 3: 1}}),
    # r > Hq: ceil(2/3) = 1, offsets 0 and 1.
    (6, 2, [6], [3], "all", False, {(3, 0): {0: 1, 3: 1}, (4, 1): {1: 1, 4: 1}, (2, 0): {}, (2, 1): {}}),
    # two branches overlap: the union is a multiset.
    (4, 1, [4, 2], [1, 1], "all", False, {(0, 0): {0: 2, 1: 2, 2: 1, 3: 1}, (3, 0): {0: 1, 1: 1, 2: 2, 3: 2}}),
    # w > N is clipped to N; r > s leaves offsets >= s without members.
    (3, 4, [10], [4], "all", True, {(0, 0): {0: 1}, (1, 1): {1: 1}, (2, 2): {2: 1}, (0, 3): {}, (1, 0): {}}),
    # causal with dilation 2 inside segments of 5 (s=5: members 0,2,4 | 5,7,9 for offset 0).
    (10, 1, [5], [2], "all", True, {(4, 0): {0: 1, 2: 1, 4: 1}, (7, 0): {5: 1, 7: 1}, (9, 0): {5: 1, 7: 1, 9: 1}}),
]


@pytest.mark.parametrize("backend", ["reference", "cpu", "bruteforce"])
@pytest.mark.parametrize("example", range(len(KEY_SET_EXAMPLES)))
def test_key_sets_match_hand_derived(example, backend):
    N, Hq, segs, dils, groups, causal, expected = KEY_SET_EXAMPLES[example]
    q = torch.randn(1, N, Hq, N, dtype=torch.float64)
    k = torch.randn(1, N, Hq, N, dtype=torch.float64)
    v = torch.eye(N, dtype=torch.float64)[None, :, None, :].expand(1, N, Hq, N)
    kw = dict(causal=causal, head_groups=groups, scale=0.0)
    if backend == "bruteforce":
        out, lse = dilated_attention_bruteforce(q, k, v, segs, dils, **kw)
    else:
        out, lse = dilated_attn.dilated_attention(q, k, v, segs, dils, return_lse=True, backend=backend, **kw)
    for (p, h), keys in expected.items():
        total = sum(keys.values())
        want = torch.zeros(N, dtype=torch.float64)
        for t, count in keys.items():
            want[t] = count / total
        torch.testing.assert_close(out[0, p, h], want, rtol=0, atol=1e-12, msg=f"query {p}, head {h}")
        if total:
            assert lse[0, h, p].item() == pytest.approx(math.log(total), abs=1e-12)
        else:
            assert lse[0, h, p].item() == -math.inf


def test_gqa_head_mapping():
    """Query head h reads kv head h // (Hq // Hkv)."""
    N, Hq, Hkv = 3, 6, 3
    q = torch.randn(1, N, Hq, 4, dtype=torch.float64)
    k = torch.randn(1, N, Hkv, 4, dtype=torch.float64)
    v = torch.arange(Hkv, dtype=torch.float64)[None, None, :, None].expand(1, N, Hkv, 4) + 1
    for backend in ("reference", "cpu"):
        out = dilated_attn.dilated_attention(q, k, v, [N], [1], backend=backend)
        for h in range(Hq):
            assert torch.allclose(out[0, :, h], torch.full((N, 4), h // 2 + 1.0, dtype=torch.float64))


def test_duplicate_branch_doubles_the_multiset():
    """Two identical branches: the same output, LSE larger by log 2 (one softmax over a multiset)."""
    q, k, v = (torch.randn(2, 20, 2, 8, dtype=torch.float64) for _ in range(3))
    o1, l1 = dilated_attention_reference(q, k, v, [8], [2])
    o2, l2 = dilated_attention_reference(q, k, v, [8, 8], [2, 2])
    torch.testing.assert_close(o1, o2, rtol=1e-12, atol=1e-12)
    finite = torch.isfinite(l1)
    torch.testing.assert_close(l2[finite], l1[finite] + math.log(2), rtol=1e-12, atol=1e-12)
    assert torch.equal(finite, torch.isfinite(l2))


def test_reference_merge_gradient_includes_merge_weights():
    """Not torchscale's approximation: perturbing q changes the merge weights, and the gradient sees it."""
    q, k, v = (torch.randn(1, 16, 1, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))

    def f(q, k, v):
        return dilated_attention_reference(q, k, v, [4, 16], [1, 2])[0]

    assert torch.autograd.gradcheck(f, (q, k, v))


@pytest.mark.parametrize("backend", ["reference", "cpu", "triton"])
def test_lse_joins_the_graph_of_every_input(backend, monkeypatch):
    """With only v requiring grad, every backend's LSE (which does not read v) is in v's graph with a zero
    gradient, so torch.autograd.grad([out, lse], [v]) runs alike on each and gives out's gradient."""
    if backend == "triton":
        pytest.importorskip("triton")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    g = torch.Generator().manual_seed(5)
    q, k, v, go = (torch.randn(1, 16, 2, 16, generator=g) for _ in range(4))
    v.requires_grad_()
    out, lse = dilated_attn.dilated_attention(q, k, v, [8], [1], return_lse=True, backend=backend)
    assert lse.requires_grad
    (both,) = torch.autograd.grad([out, lse], [v], [go, torch.randn(lse.shape, generator=g)], retain_graph=True)
    (alone,) = torch.autograd.grad(out, [v], go)
    torch.testing.assert_close(both, alone, rtol=0, atol=0)
