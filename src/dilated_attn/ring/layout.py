"""How a global sequence is cut across the ranks of a process group (`layout`), and shard/unshard."""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

__all__ = ["LAYOUTS", "check_layout", "chunks", "group_size_rank", "shard", "unshard"]

LAYOUTS = ("contiguous", "zigzag")


def group_size_rank(group) -> tuple[int, int]:
    """(P, this rank in group); (1, 0) without an initialised default process group."""
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a torch.distributed.ProcessGroup or None, got {type(group).__name__}")
    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise ValueError("group was given, but torch.distributed is not initialised (init_process_group)")
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def check_layout(layout) -> str:
    if not isinstance(layout, str):
        raise TypeError(f"layout must be a str, one of {LAYOUTS}, got {type(layout).__name__}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return layout


def chunks(rank: int, P: int, L: int, layout: str) -> list[tuple[int, int]]:
    """The global ranges [start, stop) a rank holds, in its local order."""
    if layout == "contiguous":
        return [(rank * L, (rank + 1) * L)]
    C = L // 2
    return [(rank * C, (rank + 1) * C), ((2 * P - 1 - rank) * C, (2 * P - rank) * C)]


def check_dim(x: torch.Tensor, dim) -> int:
    """`dim` as a dimension of `x` (negative counts from the end), or ValueError/TypeError."""
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"dim must be an int, got {type(dim).__name__}")
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim must be a dimension of x ({x.dim()}-D: {-x.dim()} to {x.dim() - 1}), got {dim}")
    return dim % x.dim()


def shard(x: torch.Tensor, group: Optional[dist.ProcessGroup] = None, layout: str = "contiguous",
          dim: int = 1) -> torch.Tensor:
    """This rank's shard of a full tensor `x` (the same on every rank) along `dim` (the sequence dim of
    `[B, N, H, D]` by default), for `ring_attention` with the same group and layout. Returns a copy."""
    layout = check_layout(layout)
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    dim = check_dim(x, dim)
    P, rank = group_size_rank(group)
    N = x.shape[dim]
    parts = 2 * P if layout == "zigzag" else P
    if N % parts != 0:
        raise ValueError(f"x: sequence length {N} (dim {dim}) must be divisible by {parts} for layout={layout!r} "
                         f"on {P} ranks")
    L = N // P
    return torch.cat([x.narrow(dim, a, b - a) for a, b in chunks(rank, P, L, layout)], dim).contiguous()


def unshard(x: torch.Tensor, group: Optional[dist.ProcessGroup] = None, layout: str = "contiguous",
            dim: int = 1) -> torch.Tensor:
    """The full tensor from every rank's shard `x` (all-gather, then the layout's order); not differentiable."""
    layout = check_layout(layout)
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    dim = check_dim(x, dim)
    P, _ = group_size_rank(group)
    if P == 1:
        return x.clone()
    L = x.shape[dim]
    if layout == "zigzag" and L % 2:
        raise ValueError(f"x: local length {L} must be even for layout='zigzag'")
    parts = [torch.empty_like(x) for _ in range(P)]
    dist.all_gather(parts, x.contiguous(), group=group)
    pieces = []
    for rank, part in enumerate(parts):
        local = 0
        for a, b in chunks(rank, P, L, layout):
            pieces.append((a, part.narrow(dim, local, b - a)))
            local += b - a
    return torch.cat([p for _, p in sorted(pieces, key=lambda t: t[0])], dim)
