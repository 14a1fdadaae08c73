"""dilated_attn: LongNet dilated attention for PyTorch (see README.md and ../shared/SPEC.md)."""

from .functional import dilated_attention
from .ops import build_info

__version__ = "0.1.0"

__all__ = ["dilated_attention", "build_info", "__version__"]
