"""dilated_attn.integrations.transformers: dilated attention as a Hugging Face transformers attention implementation.

With one branch whose segment covers the sequence, (N, 1), dilated attention is plain attention, so a tiny
float64 Llama gives transformers' own sdpa logits, gradients and generated tokens; with LongNet branches it
trains; padding, a missing config entry and dropout are refused; examples/hf_llama.py learns. Skipped where
transformers is not installed.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import dilated_attn  # noqa: E402
import dilated_attn.integrations.transformers as dilated_hf  # noqa: E402

VOCAB = 128


@pytest.fixture(scope="module", autouse=True)
def registered():
    return dilated_hf.register()


def llama(attn, branches=None, kv_heads=2, dtype=torch.float64, device="cpu", **extra):
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=kv_heads, vocab_size=VOCAB,
                                      max_position_embeddings=256, bos_token_id=None, eos_token_id=None,
                                      pad_token_id=None, **extra)
    if branches is not None:
        config.dilated_attention = {"segment_lengths": branches[0], "dilation_rates": branches[1]}
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=dtype).to(device)


def pair(branches, **kwargs):
    """The same weights under sdpa and under dilated attention."""
    ref = llama("sdpa", **kwargs)
    model = llama("dilated_attention", branches, **kwargs)
    model.load_state_dict(ref.state_dict())
    return ref, model


@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("segment", [32, 100])
def test_one_branch_is_sdpa(kv_heads, segment, monkeypatch):
    """Logits and parameter gradients of a causal LM forward equal sdpa's, GQA included."""
    calls = []
    monkeypatch.setattr(dilated_hf, "dilated_attention",
                        lambda *a, **k: calls.append(k) or dilated_attn_function(*a, **k))
    ref, model = pair(([segment], [1]), kv_heads=kv_heads)
    tokens = torch.randint(0, VOCAB, (2, 32))
    want, got = ref(tokens, labels=tokens), model(tokens, labels=tokens)
    assert len(calls) == 2 and calls[0]["causal"] and calls[0]["segment_lengths"] == [segment]
    torch.testing.assert_close(got.logits, want.logits, atol=1e-10, rtol=0)
    want.loss.backward()
    got.loss.backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-10, rtol=0, msg=name)
    # an all-ones padding mask changes nothing
    torch.testing.assert_close(model(tokens, attention_mask=torch.ones_like(tokens)).logits, want.logits,
                               atol=1e-10, rtol=0)


def dilated_attn_function(*args, **kwargs):
    import dilated_attn

    return dilated_attn.dilated_attention(*args, **kwargs)


def test_longnet_branches_train():
    """Branches (8,1), (16,2), (32,4) on N = 32: other logits than sdpa's, every parameter gets a gradient, and the
    loss falls on a fixed batch."""
    ref, model = pair(([8, 16, 32], [1, 2, 4]), dtype=torch.float32)
    tokens = torch.randint(0, VOCAB, (4, 32))
    with torch.no_grad():
        assert (model(tokens).logits - ref(tokens).logits).abs().max() > 1e-3
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(5):
        loss = model(tokens, labels=tokens).loss
        optimizer.zero_grad()
        loss.backward()
        if step == 0:
            for name, p in model.named_parameters():
                assert p.grad is not None and p.grad.abs().sum() > 0, name
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5, losses


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_generate_is_sdpa(cache):
    """Greedy generation over transformers' caches (prefill, then dilated_attention_with_kvcache per token)
    gives sdpa's tokens."""
    ref, model = pair(([16], [1]))
    prompt = torch.randint(0, VOCAB, (2, 9))
    kwargs = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=5, do_sample=False,
                  cache_implementation=cache)
    want = ref.generate(prompt, **kwargs)
    got = model.generate(prompt, **kwargs)
    assert got.shape == (2, 14) and torch.equal(got, want)


def test_chunked_prefill_matches_one_forward():
    """LongNet branches over a DynamicCache filled in chunks (transformers then passes a causal mask, which is read
    for the cache's offset) give the logits of one forward over the whole sequence."""
    model = llama("dilated_attention", ([4, 8, 16], [1, 2, 4]))
    tokens = torch.randint(0, VOCAB, (2, 24))
    with torch.no_grad():
        full = model(tokens).logits
        cache = transformers.DynamicCache(config=model.config)
        parts = [model(tokens[:, a:b], past_key_values=cache).logits for a, b in ((0, 10), (10, 11), (11, 24))]
    torch.testing.assert_close(torch.cat(parts, 1), full, atol=1e-10, rtol=0)


def test_refusals():
    model = llama("dilated_attention", ([8, 16, 32], [1, 2, 4]))
    tokens = torch.randint(0, VOCAB, (2, 32))
    padded = torch.ones_like(tokens)
    padded[0, :3] = 0
    with pytest.raises(ValueError, match="attention_mask"):
        model(tokens, attention_mask=padded)
    packed = torch.cat([torch.arange(16), torch.arange(16)]).expand(2, -1)  # two documents per row
    with pytest.raises(ValueError, match="attention_mask"):
        model(tokens, position_ids=packed, use_cache=False)
    with pytest.raises(ValueError, match="config.dilated_attention"):
        llama("dilated_attention", None)(tokens)
    bad = llama("dilated_attention", None)
    bad.config.dilated_attention = {"segment_lengths": [8]}
    with pytest.raises(ValueError, match="config.dilated_attention lacks dilation_rates"):
        bad(tokens)
    dropout = llama("dilated_attention", ([32], [1]), attention_dropout=0.1)
    dropout.eval()(tokens)  # dropout applies in training only
    with pytest.raises(ValueError, match="dropout"):
        dropout.train()(tokens)


def test_masks_given_directly():
    """The attention function on its own: a 4-D mask with the causal pattern (bool or additive) is the causal
    attention, one that hides a key is refused, as is a non-causal call with fewer queries than keys."""
    module = torch.nn.Module()
    module.config = transformers.LlamaConfig()
    module.config.dilated_attention = {"segment_lengths": [4, 8], "dilation_rates": [1, 2]}
    q, k, v = torch.randn(2, 4, 8, 16), torch.randn(2, 2, 8, 16), torch.randn(2, 2, 8, 16)
    want, _ = dilated_hf.dilated_attention_forward(module, q, k, v, None)
    causal = torch.ones(8, 8, dtype=torch.bool).tril().expand(2, 1, 8, 8)
    additive = torch.zeros(2, 1, 8, 8).masked_fill(~causal, torch.finfo(torch.float32).min)
    for mask in (causal, additive):
        torch.testing.assert_close(dilated_hf.dilated_attention_forward(module, q, k, v, mask)[0], want)
    # the last 3 queries over the cache of 8: rows 5..7 of the whole
    with torch.no_grad():
        tail, _ = dilated_hf.dilated_attention_forward(module, q[:, :, 5:], k, v, causal[..., 5:, :])
    torch.testing.assert_close(tail, want[:, 5:])
    hidden = causal.clone()
    hidden[1, 0, 7, 0] = False
    with pytest.raises(ValueError, match="attention_mask hides keys"):
        dilated_hf.dilated_attention_forward(module, q, k, v, hidden)
    with pytest.raises(ValueError, match="non-causal attention of 3 queries over 8 keys"):
        dilated_hf.dilated_attention_forward(module, q[:, :, 5:], k, v, None, is_causal=False)


def test_a_mask_is_read_once_per_step(monkeypatch):
    """Training with a 4-D mask: the layers share one reading of it (each reading waits for the GPU), the
    backward none; a new mask is read again."""
    calls = []
    real = dilated_hf._mask_pattern

    def counted(*args):
        calls.append(args[1:])
        return real(*args)

    monkeypatch.setattr(dilated_hf, "_mask_pattern", counted)
    model = llama("dilated_attention", ([8, 16], [1, 2]))
    ids = torch.randint(0, VOCAB, (2, 16))
    for step in range(2):
        mask = torch.ones(16, 16, dtype=torch.bool).tril().expand(2, 1, 16, 16)
        model(input_ids=ids, attention_mask=mask).logits.sum().backward()
        assert len(calls) == step + 1, "the mask was read by more than one layer"


def test_example_learns_and_generates(capsys):
    """examples/hf_llama.py: the loss of a tiny Llama on its random sequences falls, and generation continues the
    first of them."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "examples" / "hf_llama.py"
    spec = importlib.util.spec_from_file_location("hf_llama", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    result = example.main(["--device", "cpu"])
    assert len(result["losses"]) == 30 and result["losses"][-1] < result["losses"][0] - 3, result["losses"]
    assert result["correct"] >= 12, result
    assert "attention dilated_attention with branches [16, 32, 64] / [1, 2, 4]" in capsys.readouterr().out


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["auto", "triton", "cudnn"])
def test_bf16_on_cuda_is_sdpa(backend):
    """bf16 on CUDA through the GPU kernels: logits close to sdpa's with one branch, and a training step with LongNet
    branches gives finite gradients."""
    if backend == "cudnn" and dilated_attn.backends.CUDNN.unavailable() is not None:
        pytest.skip(dilated_attn.backends.CUDNN.unavailable())
    ref, model = pair(([64], [1]), dtype=torch.bfloat16, device="cuda")
    model.config.dilated_attention["backend"] = backend
    tokens = torch.randint(0, VOCAB, (2, 64), device="cuda")
    with torch.no_grad():
        want, got = ref(tokens).logits.float(), model(tokens).logits.float()
    assert (got - want).norm() / want.norm() < 2e-2
    model = llama("dilated_attention", ([16, 32, 64], [1, 2, 4]), dtype=torch.bfloat16, device="cuda")
    model.config.dilated_attention["backend"] = backend
    loss = model(tokens, labels=tokens).loss
    loss.backward()
    assert torch.isfinite(loss)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
