"""How a global sequence is cut across the ranks of a process group (`layout`), and shard/unshard."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from .documents import DocumentLayout, shard_documents, unshard_documents

__all__ = ["LAYOUTS", "MODES", "Groups", "resolve_groups", "check_mode", "check_layout", "chunks", "group_size_rank",
           "shard", "unshard"]

LAYOUTS = ("contiguous", "zigzag")
MODES = ("auto", "ring", "heads", "2d")


@dataclass(frozen=True)
class Groups:
    """The process groups of a call: one group, or the 2-D mode's inner (heads) and outer (ring) groups. `size`
    ranks hold the sequence, this one the `rank`-th shard (2-D: outer rank * inner size + inner rank)."""

    all: tuple  # the groups, the inner one first (None: the default group)
    ranks: tuple  # this rank in each
    sizes: tuple
    size: int
    rank: int

    @property
    def two_d(self) -> bool:
        return len(self.all) == 2


def check_mode(mode, two_d: bool) -> str:
    """`mode` if the groups (a pair or a 2-D mesh where `two_d`, else one group) can run it, else TypeError or
    ValueError naming the rule."""
    if not isinstance(mode, str):
        raise TypeError(f"mode must be a str, one of {MODES}, got {type(mode).__name__}")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if not two_d and mode == "2d":
        raise ValueError("mode='2d' needs group=a 2-D DeviceMesh or the pair (ring_group, heads_group)")
    if two_d and mode in ("ring", "heads"):
        raise ValueError(f"mode={mode!r} runs on one ProcessGroup; a DeviceMesh or a pair of groups is for "
                         f"mode='2d' (or 'auto')")
    return mode


def resolve_groups(group, mode: Optional[str] = None) -> Groups:
    """The groups of `group`: a ProcessGroup or None (the default group; one process where torch.distributed is not
    initialised), or for the 2-D mode a 2-D DeviceMesh (dim 0 the ring, dim 1 the heads) or the pair
    (ring_group, heads_group). Raises TypeError/ValueError for anything else, or with `mode` a mode these cannot
    run (check_mode)."""
    pair = None
    if type(group).__name__ == "DeviceMesh":
        if group.ndim != 2:
            raise ValueError(f"group: a DeviceMesh for ring_attention must be 2-D (dim 0 the ring, dim 1 the heads), "
                             f"got {group.ndim}-D")
        pair = (group.get_group(0), group.get_group(1))
    elif isinstance(group, (tuple, list)):
        if len(group) != 2 or not all(isinstance(g, dist.ProcessGroup) for g in group):
            raise TypeError("group: a pair must be (ring_group, heads_group), two torch.distributed.ProcessGroup")
        pair = tuple(group)
    elif group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a torch.distributed.ProcessGroup, a 2-D DeviceMesh, a pair (ring_group, "
                        f"heads_group) or None, got {type(group).__name__}")
    if mode is not None:
        check_mode(mode, pair is not None)
    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise ValueError("group was given, but torch.distributed is not initialised (init_process_group)")
        return Groups((None,), (0,), (1,), 1, 0)
    if pair is None:
        P, rank = dist.get_world_size(group), dist.get_rank(group)
        return Groups((group,), (rank,), (P,), P, rank)
    outer, inner = pair
    ro, ri = dist.get_rank(outer), dist.get_rank(inner)
    if ro < 0 or ri < 0:
        raise ValueError("group: this rank is not a member of both groups of the pair (ring_group, heads_group)")
    po, pi = dist.get_world_size(outer), dist.get_world_size(inner)
    return Groups((inner, outer), (ri, ro), (pi, po), po * pi, ro * pi + ri)


def group_size_rank(group) -> tuple[int, int]:
    """(P, this rank's shard) for `group` (any form resolve_groups takes); (1, 0) without an initialised default
    process group."""
    g = resolve_groups(group)
    return g.size, g.rank


def check_layout(layout) -> str:
    if not isinstance(layout, str):
        raise TypeError(f"layout must be a str, one of {LAYOUTS}, or a DocumentLayout (place_documents), got "
                        f"{type(layout).__name__}")
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


def check_documents_groups(layout: DocumentLayout, groups: Groups) -> None:
    """ValueError where `groups` are not those a DocumentLayout runs on: one group of its P ranks."""
    if groups.two_d or groups.size != layout.P:
        raise ValueError(f"layout: a DocumentLayout placed for {layout.P} ranks runs on one group of {layout.P} "
                         f"ranks, got {'a 2-D group' if groups.two_d else f'a group of {groups.size}'}")


def _documents_rank(layout: DocumentLayout, group) -> tuple[int, Groups]:
    """(this rank, its groups) for a DocumentLayout on `group`, or ValueError where the group is not the layout's."""
    groups = resolve_groups(group)
    check_documents_groups(layout, groups)
    return groups.rank, groups


def shard(x: torch.Tensor, group=None, layout="contiguous", dim: Optional[int] = None) -> torch.Tensor:
    """This rank's shard of a full tensor `x` (the same on every rank) along `dim`, for `ring_attention` with the
    same group (a ProcessGroup, or for the 2-D mode its DeviceMesh or pair of groups) and layout: "contiguous",
    "zigzag" (dim default 1, the sequence dim of `[B, N, H, D]`; a pack `[T, H, D]` takes dim=0), or a
    DocumentLayout (place_documents; dim default 0, the rows of a pack). Returns a copy."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if isinstance(layout, DocumentLayout):
        rank, _ = _documents_rank(layout, group)
        return shard_documents(x, layout, rank, check_dim(x, 0 if dim is None else dim))
    layout = check_layout(layout)
    dim = check_dim(x, 1 if dim is None else dim)
    P, rank = group_size_rank(group)
    N = x.shape[dim]
    parts = 2 * P if layout == "zigzag" else P
    if N % parts != 0:
        raise ValueError(f"x: sequence length {N} (dim {dim}) must be divisible by {parts} for layout={layout!r} "
                         f"on {P} ranks")
    L = N // P
    return torch.cat([x.narrow(dim, a, b - a) for a, b in chunks(rank, P, L, layout)], dim).contiguous()


def unshard(x: torch.Tensor, group=None, layout="contiguous", dim: Optional[int] = None) -> torch.Tensor:
    """The full tensor from every rank's shard `x` (all-gather, then the layout's order; dim as in shard); not
    differentiable."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if isinstance(layout, DocumentLayout):
        rank, groups = _documents_rank(layout, group)
        return unshard_documents(x, layout, groups.all[0], rank, check_dim(x, 0 if dim is None else dim))
    layout = check_layout(layout)
    dim = check_dim(x, 1 if dim is None else dim)
    groups = resolve_groups(group)
    P = groups.size
    if P == 1:
        return x.clone()
    L = x.shape[dim]
    if layout == "zigzag" and L % 2:
        raise ValueError(f"x: local length {L} must be even for layout='zigzag'")
    parts = [x.contiguous()]
    for g, n in zip(groups.all, groups.sizes):  # the inner group's shards, then those of the outer group's ranks
        gathered = [torch.empty((len(parts), *parts[0].shape), dtype=x.dtype, device=x.device) for _ in range(n)]
        dist.all_gather(gathered, torch.stack(parts), group=g)
        parts = [p for block in gathered for p in block]
    pieces = []
    for rank, part in enumerate(parts):
        local = 0
        for a, b in chunks(rank, P, L, layout):
            pieces.append((a, part.narrow(dim, local, b - a)))
            local += b - a
    return torch.cat([p for _, p in sorted(pieces, key=lambda t: t[0])], dim)
