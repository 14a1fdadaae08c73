"""What torch.compile leaves out of its graph, with the reason `fullgraph=True` reports. Imported only while compiling:
torch.compiler.disable imports torch._dynamo, which eager calls never need."""

import torch

from .base import Backend

__all__ = ["forward_per_sequence"]

forward_per_sequence = torch.compiler.disable(
    Backend._forward_per_sequence, recursive=True,
    reason="dilated_attention_varlen: this backend (cpu, reference or cudnn) runs a pack one sequence at a time, "
           "reading cu_seqlens on the host, which torch.compile cannot trace; the triton backend (a GPU) runs packs in "
           "its kernels and traces with fullgraph=True; elsewhere compile without fullgraph (a graph break here)")
