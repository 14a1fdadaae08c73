"""dilated_attn: LongNet dilated attention for PyTorch, exact on every backend (docs/SPEC.md).

Every backend ("cuda", "triton", "cudnn", "fa4", "cpu", "reference"; "auto" picks one) computes the one
function docs/SPEC.md defines, forward and backward, on `[batch, seq, heads, head_dim]` tensors (GQA, causal).

Functions:
    dilated_attention(q, k, v, segment_lengths, dilation_rates, ...)   the attention itself
    dilated_attention_varlen(q, k, v, cu_seqlens, ...)                 packed sequences of different lengths
    dilated_attention_with_kvcache(q, k_cache, v_cache, ...)           decoding with a KV cache
    ring_attention(q, k, v, ...)     one sequence split across the ranks of a torch.distributed group
                                     (shard / unshard, place_documents / DocumentLayout; explain_ring)
    explain(q, k, v, ...)            which backend dilated_attention would run, and why
    build_info()                     what the compiled extension was built with

Modules (dilated_attn.nn):
    DilatedAttention             the attention as an nn.Module, on `[B, N, H, D]`
    MultiheadDilatedAttention    projections + attention (+ sub-LayerNorm), on `[B, N, embed_dim]`;
                                 argument-compatible with dilated-attention-pytorch
    KVCache                      the keys and values a layer has seen, for `forward(..., kv_cache=...)`

Docs (in the repository): README.md; docs/SPEC.md (the contract), docs/backends.md, docs/ring.md,
docs/modules.md, docs/numerics.md, docs/cli.md (`python -m dilated_attn`), docs/design.md, docs/development.md.
"""

from .backends.extension import build_info
from .dispatch import explain
from .functional import dilated_attention, dilated_attention_varlen, dilated_attention_with_kvcache
from .nn import DilatedAttention, KVCache, MultiheadDilatedAttention
from .ring import DocumentLayout, explain_ring, place_documents, ring_attention, shard, unshard

__version__ = "0.1.0"

__all__ = [
    "dilated_attention",
    "dilated_attention_varlen",
    "dilated_attention_with_kvcache",
    "explain",
    "ring_attention",
    "explain_ring",
    "shard",
    "unshard",
    "place_documents",
    "DocumentLayout",
    "DilatedAttention",
    "MultiheadDilatedAttention",
    "KVCache",
    "build_info",
    "__version__",
]
