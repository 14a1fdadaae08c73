"""Dilated attention as an attention implementation of Hugging Face transformers 5.x.

    import dilated_attn.integrations.transformers as dilated_hf

    dilated_hf.register()                              # once per process: the name "dilated_attention"
    config.dilated_attention = {"segment_lengths": [2048, 4096, 8192], "dilation_rates": [1, 2, 4]}
    model = AutoModelForCausalLM.from_config(config, attn_implementation="dilated_attention")
    # or from_pretrained(name, config=config, attn_implementation="dilated_attention")

Every attention layer of a model whose attention calls transformers' `AttentionInterface` (Llama, Qwen2/3,
Mistral, ... : the models that take `attn_implementation="sdpa"`) then runs `dilated_attn.dilated_attention` with
the branches of `config.dilated_attention` (the attention module's `config`; for a multimodal model, the text
model's config), a dict with

* `segment_lengths`, `dilation_rates` (required): the branches, as `dilated_attention` takes them;
* `head_groups` ("all", the default, or "split") and `backend` ("auto", the default, ...), optional.

A missing or malformed entry raises `ValueError` saying what to put there. The function mirrors transformers'
`sdpa_attention_forward`: query `[B, Hq, Sq, D]` and key/value `[B, Hkv, Nk, D]` are read as transposed views
(no copy), GQA runs natively (the key/value heads are not repeated), `scaling` is the scale, causality comes from
the `is_causal` argument, else the module's `is_causal` (default True), and the output is `[B, Sq, Hq, D]`.

What it refuses, with a `ValueError`, rather than compute something else:

* dropout > 0 (transformers passes the config's `attention_dropout` in training mode): no kernel has dropout;
* an `attention_mask` that masks something: padding (a 2-D mask with a 0, or a 4-D mask that hides keys the
  causal pattern shows), packed sequences detected from `position_ids`, or a sliding window shorter than the
  sequence. Dilated attention computes the LongNet pattern over whole sequences: train on unpadded batches
  (sequences of one length; pack documents into full rows with continuous `position_ids`), or call
  `dilated_attn.dilated_attention_varlen` yourself on packed sequences. A mask that shows exactly the causal
  pattern (or everything: full attention) is accepted;
* non-causal attention with fewer queries than keys (cross-attention, or non-causal decoding).

Masks: `register()` also registers transformers' `sdpa_mask` under the same name (without a mask function of that
name, transformers would drop the attention mask, padding included). So a forward without padding gets `None`
(the causal pattern), and anything else a boolean `[B, 1, Sq, Nk]` mask, checked here.

Decoding with transformers' caches (`generate`): key and value hold every token so far, the query only the new
ones. Sq < Nk runs `dilated_attn.dilated_attention_with_kvcache` (inference only; under autograd it raises), where
new query i sits at position P + i and attends causally to rows [0, P + i]; that is what `dilated_attention` over
the whole sequence gives those rows. P is Nk - 1 for a single new token without a mask (transformers' DynamicCache
decode step), and read from the mask when transformers builds one (chunked prefill over a DynamicCache: P = Nk - Sq;
a StaticCache: P = the tokens already cached). Without a mask, several queries and more keys (the prefill of an
empty StaticCache) follow sdpa's convention: the first Sq keys are the sequence, as sdpa's `is_causal` assumes.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..functional import dilated_attention, dilated_attention_with_kvcache
from ..memo import read_once

__all__ = ["register", "dilated_attention_forward", "DEFAULT_NAME"]

DEFAULT_NAME = "dilated_attention"
_KEYS = ("segment_lengths", "dilation_rates", "head_groups", "backend")
_EXAMPLE = ('config.dilated_attention = {"segment_lengths": [2048, 4096, 8192], "dilation_rates": [1, 2, 4]} '
            '(optional keys: "head_groups", "backend")')
# Arguments some models pass that change the attention in ways dilated attention does not compute.
_UNSUPPORTED = ("position_bias", "softcap", "s_aux", "sinks")


def register(name: str = DEFAULT_NAME) -> str:
    """Register dilated attention with transformers as `attn_implementation=name`: the attention function in
    `AttentionInterface` and transformers' sdpa mask in `AttentionMaskInterface`. Idempotent; returns `name`."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(name, dilated_attention_forward)
    AttentionMaskInterface.register(name, sdpa_mask)
    return name


def _options(module: torch.nn.Module) -> dict:
    """The `dilated_attention` keyword arguments of `module.config.dilated_attention`."""
    config = getattr(module, "config", None)
    entry = getattr(config, "dilated_attention", None)
    if entry is None:
        raise ValueError(f"dilated attention needs its branches in the model config: set {_EXAMPLE} before building "
                         f"the model ({type(module).__name__}.config has no dilated_attention entry)")
    if not isinstance(entry, dict):
        raise ValueError(f"config.dilated_attention must be a dict, got {type(entry).__name__}: set {_EXAMPLE}")
    missing = [key for key in ("segment_lengths", "dilation_rates") if key not in entry]
    unknown = sorted(set(entry) - set(_KEYS))
    if missing or unknown:
        problem = f"lacks {' and '.join(missing)}" if missing else f"has unknown keys {unknown}"
        raise ValueError(f"config.dilated_attention {problem} (keys: {', '.join(_KEYS)}): set {_EXAMPLE}")
    return {key: entry[key] for key in _KEYS if key in entry}


def _masks_something(what: str) -> ValueError:
    return ValueError(
        f"dilated_attn: attention_mask {what}, which dilated attention cannot apply (padding, packed sequences "
        f"detected from position_ids, or a sliding window). Pass batches without padding (attention_mask=None or "
        f"all ones: sequences of one length; pack documents into full rows with continuous position_ids), or call "
        f"dilated_attn.dilated_attention_varlen on packed sequences yourself")


def _read_mask(mask: torch.Tensor, batch: int, sq: int, nk: int):
    """What `mask` asks for: ("causal", P) where query i sees exactly keys [0, P + i] (P an int, or a tensor [B]
    where the batch elements differ), ("full", None) where every query sees every key, or None where a 2-D
    (padding) mask hides nothing. Anything else raises. As in sdpa, a 4-D mask decides causality by itself.
    Reading it waits for the GPU: a model's layers, handed one mask, read it once (memo.read_once)."""
    return read_once(mask, f"attention mask {batch} {sq} {nk}", lambda m: _mask_pattern(m, batch, sq, nk))


def _mask_pattern(mask: torch.Tensor, batch: int, sq: int, nk: int):
    """_read_mask's reading of the mask's values."""
    if mask.dtype == torch.bool:
        shown = mask
    elif mask.is_floating_point():  # additive: 0 shows a key, -inf (or the dtype's minimum) hides it
        shown = mask == 0
        if not bool((shown | (mask <= torch.finfo(mask.dtype).min / 2)).all()):
            raise ValueError("dilated_attn: attention_mask holds values other than 0 and -inf (an additive bias), "
                             "which dilated attention cannot apply; pass attention_mask=None")
    else:  # a 0/1 integer mask
        shown = mask != 0
    if shown.dim() == 2:  # [B, Nk] padding mask: 1 keeps a token
        if bool(shown.all()):
            return None
        raise _masks_something("has zeros (padding)")
    if shown.dim() != 4 or shown.shape[-2:] != (sq, nk) or shown.shape[0] not in (1, batch):
        raise ValueError(f"dilated_attn: attention_mask must be 2-D [B, Nk] or 4-D [B, 1, Sq, Nk] = [{batch}, 1, "
                         f"{sq}, {nk}], got shape {tuple(mask.shape)}")
    shown = shown.expand(batch, -1, -1, -1)
    first = shown[:, :, 0, :].sum(-1)  # keys the first query sees: P + 1 under the causal pattern
    p = first[:, 0] - 1
    rows = p.view(-1, 1, 1, 1) + torch.arange(sq, device=shown.device).view(1, 1, -1, 1)
    pattern = torch.arange(nk, device=shown.device).view(1, 1, 1, -1) <= rows
    if bool((p >= 0).all()) and bool((p + sq <= nk).all()) and torch.equal(shown, pattern.expand_as(shown)):
        return "causal", (int(p[0]) if bool((p == p[0]).all()) else p)
    if bool(shown.all()):
        return "full", None
    raise _masks_something("hides keys that the causal pattern shows")


def dilated_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    is_causal: Optional[bool] = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature (as `sdpa_attention_forward`): query `[B, Hq, Sq, D]`, key and
    value `[B, Hkv, Nk, D]`; returns (`[B, Sq, Hq, D]`, None). The branches come from `module.config`."""
    options = _options(module)
    if dropout:
        raise ValueError(f"dilated_attn: attention dropout ({dropout}) is not supported (no kernel has dropout): "
                         f"set config.attention_dropout = 0")
    for name in _UNSUPPORTED:
        if kwargs.get(name) is not None:
            raise ValueError(f"dilated_attn: the attention argument {name} is not supported by dilated attention")
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    batch, sq, nk = query.shape[0], query.shape[2], key.shape[2]
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)  # [B, N, H, D] views

    if attention_mask is None:
        read = None
    else:
        read = _read_mask(attention_mask, batch, sq, nk)
    if read is None:  # no mask (or a 2-D one of all ones): the module's causality, aligned as sdpa aligns it
        if not causal or sq == nk:
            read = ("full", None) if not causal else ("causal", 0)
        elif sq == 1:  # a decode step: the new token is the last one
            read = ("causal", nk - 1)
        else:  # sdpa's is_causal (upper-left): the first Sq keys (an empty StaticCache's prefill)
            k, v, nk = k[:, :sq], v[:, :sq], sq
            read = ("causal", 0)
    kind, p = read

    if kind == "full":
        if sq != nk:
            raise ValueError(f"dilated_attn: non-causal attention of {sq} queries over {nk} keys is not supported: "
                             f"dilated attention is self-attention (queries and keys share the sequence)")
        out = dilated_attention(q, k, v, causal=False, scale=scaling, **options)
    elif isinstance(p, int) and p == 0 and sq == nk:
        out = dilated_attention(q, k, v, causal=True, scale=scaling, **options)
    else:  # new queries after P cached tokens: dilated_attention's rows P .. P + Sq - 1
        if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
            raise ValueError("dilated_attn: attention over a cache (fewer queries than keys) is inference only: run "
                             "it under torch.no_grad(), or train on whole sequences without past_key_values")
        cache_seqlens = p if isinstance(p, int) else p.to(torch.int32)
        out = dilated_attention_with_kvcache(q, k, v, cache_seqlens, scale=scaling, **options)
    return out, None
