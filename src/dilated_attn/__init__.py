"""dilated_attn: LongNet dilated attention for PyTorch, exact on every backend (docs/SPEC.md)."""

from .backends.compiled import build_info
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
