"""dilated_attn: LongNet dilated attention for PyTorch (see README.md and ../shared/SPEC.md)."""

from .dispatch import explain
from .functional import dilated_attention
from .nn import DilatedAttention, MultiheadDilatedAttention
from .ops import build_info
from .ring import ring_attention, shard, unshard

__version__ = "0.1.0"

__all__ = [
    "dilated_attention",
    "explain",
    "ring_attention",
    "shard",
    "unshard",
    "DilatedAttention",
    "MultiheadDilatedAttention",
    "build_info",
    "__version__",
]
