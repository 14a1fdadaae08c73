"""Hilbert-curve serialisation of 2-D and 3-D grids.

Dilated attention sees a flat sequence. Serialising an image (or volume) row by row puts vertically
adjacent pixels ``W`` positions apart, so an attention segment of ``w`` positions is a thin stripe. Ordering
the cells along a Hilbert curve keeps each run of consecutive positions spatially compact instead.

    perm = hilbert_index((H, W))          # LongTensor [H*W]
    y = serialize(x, (H, W))              # x: [B, H*W, ...] row-major  ->  curve order, == x[:, perm]
    x = deserialize(y, (H, W))            # the inverse

Grid sizes need not be powers of two: the curve is the generalized Hilbert curve ("gilbert") of Jakub
Červený (https://github.com/jakubcerveny/gilbert, BSD-2-Clause; its 2-D and 3-D recursive algorithms). This
is an independent, vectorised implementation of that recursion; it reproduces the reference ``gilbert2d`` /
``gilbert3d`` cell order (checked against a scalar transcription for all 2-D shapes up to 40 x 40 and all
3-D shapes up to 12 x 12 x 12 while developing; the tests pin a few small orders).

Guarantees. A "step" is the move between two consecutive cells of the curve. Proven by construction or
checked exhaustively as stated; tests/test_hilbert.py checks each on many shapes.

- Every shape: ``perm`` is a permutation of ``range(prod(shape))`` and the curve starts at cell 0.
- Power-of-two squares ``(2^k, 2^k)``: exactly the classical Hilbert curve (the textbook ``d2xy`` with
  x = column, y = row). Power-of-two squares and cubes: every step is a grid neighbour (Manhattan
  distance 1), and each aligned run of ``4^j`` (2-D) or ``8^j`` (3-D) positions fills an aligned square
  or cube of side ``2^j``.
- 2-D, any size: at most ONE step is not a grid neighbour, and that step is diagonal (Chebyshev
  distance 1). It occurs exactly when the longer side is odd and the shorter side even and >= 4, e.g.
  (12, 15): there no unit-step path joins the curve's two end corners (checkerboard colouring).
  Checked for every shape up to 64 x 64 and 200 random shapes up to 700 x 700.
- 3-D with every side even or 1: every step is a grid neighbour. A side of 1 makes the grid 2-D-like:
  then the 2-D bound holds (at most one diagonal step).
- 3-D with an odd side > 1 (and no side 1): no locality bound per step is proven. The reference algorithm
  cannot keep unit steps (its author: "odd dimensions should not be used"), and non-unit steps are common
  (up to 9% of the steps of small grids; 1150 of the 388k steps of (49, 91, 87)). Measured over every
  shape with sides 1..24 plus 350 random shapes up to 128: each step moves at most 2 cells along any axis
  (Chebyshev <= 2, Manhattan <= 2) when exactly one side is odd, and Chebyshev <= 3, Manhattan <= 4 when
  two or three are. Prefer even sides for volumes.

A 1-D shape ``(n,)`` is accepted and gives the identity: a line is already in curve order.

Shapes are ``(H, W)`` or ``(D, H, W)`` with the last index fastest, as in a row-major ``flatten``; the cell
``(y, x)`` is sequence position ``y * W + x``.

The permutation is built on the CPU with tensor ops, one pass per recursion depth over all sub-blocks of
that depth (Python work O(depth), not O(cells)), cached per shape, and copied once per device. Returned
tensors are shared cache entries: do not modify them in place. ``clear_cache()`` drops them.
"""

from __future__ import annotations

import functools
import math
import operator
from typing import Sequence

import torch

__all__ = ["hilbert_index", "serialize", "deserialize", "clear_cache"]


MAX_CELLS = 1 << 31


def _check_shape(shape) -> tuple[int, ...]:
    if not isinstance(shape, (tuple, list)):  # torch.Size is a tuple
        raise TypeError(f"shape: expected a tuple or list of 1, 2 or 3 ints, got {type(shape).__name__}")
    if not 1 <= len(shape) <= 3:
        raise ValueError(f"shape: expected 1, 2 or 3 sizes (a line, an (H, W) grid or a (D, H, W) grid), "
                         f"got {len(shape)}: {tuple(shape)}")
    out = []
    for s in shape:
        if isinstance(s, bool):
            raise TypeError(f"shape: sizes must be ints, got {tuple(shape)}")
        try:
            s = operator.index(s)  # ints, numpy ints, 0-d integer tensors
        except TypeError:
            raise TypeError(f"shape: sizes must be ints, got {tuple(shape)}") from None
        if s < 1:
            raise ValueError(f"shape: sizes must be positive, got {tuple(shape)}")
        out.append(s)
    if math.prod(out) > MAX_CELLS:
        raise ValueError(f"shape: a grid of at most {MAX_CELLS} = 2^31 cells (the longest sequence the kernels "
                         f"take), got {tuple(out)} = {math.prod(out)} cells")
    return tuple(out)


# ---------------------------------------------------------------------------------------------------------
# The curve. A block is an origin cell ``p`` (its first cell on the curve) plus one integer vector per axis
# (``V[:, 0]`` = major axis "a", then "b", then "c"): the vector's direction is where the block extends and
# its length the block's extent. As in gilbert, the curve enters the block at ``p`` and leaves it at the far
# end of axis a, ``p + a - sign(a)``. Each pass splits every block of the frontier into 2, 3 or 5 children
# (the gilbert templates below) whose curve offsets follow from the children's sizes, until a block is a
# single line of cells, which is then written out directly.


def _floor_half(v: torch.Tensor) -> torch.Tensor:
    # gilbert halves with Python's //, which floors: for a negative (reversed) axis of odd length the larger
    # half goes first. Rounding toward zero instead gives a different, still valid, curve; keep the reference.
    return torch.div(v, 2, rounding_mode="floor")


def _length(v: torch.Tensor) -> torch.Tensor:
    return v.abs().sum(-1)  # axis vectors are axis-aligned: |component sum| == L1 norm


def _make_even(half, unit, length_full, mask):
    # gilbert's "prefer even steps": an even half keeps the sub-blocks' entry/exit corners reachable by unit
    # steps, so round an odd half up by one cell (only when the side is longer than 2).
    odd = (_length(half) % 2 == 1) & (length_full > 2) & mask
    return half + unit * odd.unsqueeze(-1)


def _split2d(p, V, ext):
    a, b = V[:, 0], V[:, 1]
    w, h = ext[:, 0], ext[:, 1]
    da, db = a.sign(), b.sign()
    long_ = 2 * w > 3 * h  # much wider than high: cut the long side in two, side by side
    a2 = _make_even(_floor_half(a), da, w, long_)
    b2 = _make_even(_floor_half(b), db, h, ~long_)
    s = torch.stack
    return [
        (long_, [(p, s([a2, b], 1)), (p + a2, s([a - a2, b], 1))]),
        # the Hilbert "U": up the first half of b, across the full a, back down on the far side
        (~long_, [(p, s([b2, a2], 1)),
                  (p + b2, s([a, b - b2], 1)),
                  (p + (a - da) + (b2 - db), s([-b2, -(a - a2)], 1))]),
    ]


def _split3d(p, V, ext):
    a, b, c = V[:, 0], V[:, 1], V[:, 2]
    w, h, d = ext[:, 0], ext[:, 1], ext[:, 2]
    da, db, dc = a.sign(), b.sign(), c.sign()
    every = torch.ones_like(w, dtype=torch.bool)
    a2 = _make_even(_floor_half(a), da, w, every)
    b2 = _make_even(_floor_half(b), db, h, every)
    c2 = _make_even(_floor_half(c), dc, d, every)
    wide = (2 * w > 3 * h) & (2 * w > 3 * d)  # split a only
    no_d = ~wide & (3 * h > 4 * d)  # split a and b: a 2-D "U" extruded along c
    no_h = ~wide & ~no_d & (3 * d > 4 * h)  # split a and c: the same, extruded along b
    all3 = ~wide & ~no_d & ~no_h  # split all three: the 3-D Hilbert template (5 parts)
    s = torch.stack
    return [
        (wide, [(p, s([a2, b, c], 1)), (p + a2, s([a - a2, b, c], 1))]),
        (no_d, [(p, s([b2, c, a2], 1)),
                (p + b2, s([a, b - b2, c], 1)),
                (p + (a - da) + (b2 - db), s([-b2, c, -(a - a2)], 1))]),
        (no_h, [(p, s([c2, a2, b], 1)),
                (p + c2, s([a, b, c - c2], 1)),
                (p + (a - da) + (c2 - dc), s([-c2, -(a - a2), b], 1))]),
        (all3, [(p, s([b2, c2, a2], 1)),
                (p + b2, s([c, a2, b - b2], 1)),
                (p + (b2 - db) + (c - dc), s([a, -b2, -(c - c2)], 1)),
                (p + (a - da) + b2 + (c - dc), s([-c, -(a - a2), b - b2], 1)),
                (p + (a - da) + (b2 - db), s([-b2, c2, -(a - a2)], 1))]),
    ]


def _curve_order(dims: tuple[int, ...]) -> torch.Tensor:
    """Row-major indices of the cells in curve order; ``dims`` = (W, H[, D]), x first."""
    k = len(dims)
    # Start with the longest side as the major axis (ties: x, then y), as gilbert2d / gilbert3d do.
    major = max(range(k), key=lambda i: (dims[i], -i))
    axes = [major] + [i for i in range(k) if i != major]
    V = torch.zeros(1, k, k, dtype=torch.long)
    for row, i in enumerate(axes):
        V[0, row, i] = dims[i]
    p = torch.zeros(1, k, dtype=torch.long)
    off = torch.zeros(1, dtype=torch.long)  # curve position of each block's first cell
    split = _split2d if k == 2 else _split3d
    lines = []  # (origin, unit step, cell count, offset) of finished blocks
    while p.shape[0]:
        ext = _length(V)  # [N, k] extent of each block along its axes a, b(, c)
        line = (ext != 1).sum(1) <= 1  # all axes but (at most) one are one cell thin
        if line.any():
            # walk along the one long axis (reference: row fill along a, else b, else c; a lone cell: any)
            axis = (ext[line] != 1).long().argmax(1)
            step = V[line].gather(1, axis.view(-1, 1, 1).expand(-1, 1, k)).squeeze(1).sign()
            lines.append((p[line], step, ext[line].prod(1), off[line]))
            keep = ~line
            p, V, off, ext = p[keep], V[keep], off[keep], ext[keep]
        if not p.shape[0]:
            break
        parts = []
        for mask, children in split(p, V, ext):
            start = off
            for origin, cV in children:
                size = _length(cV).prod(1)
                keep = mask & (size > 0)  # a halving can leave an empty part; it holds no cells
                parts.append((origin[keep], cV[keep], start[keep]))
                start = start + size
        p, V, off = (torch.cat(t) for t in zip(*parts))

    origin, step, count, first = (torch.cat(t) for t in zip(*lines))
    n = math.prod(dims)
    block = torch.repeat_interleave(torch.arange(count.numel()), count)
    t = torch.arange(n) - torch.repeat_interleave(count.cumsum(0) - count, count)  # index within its line
    cell = origin[block] + t.unsqueeze(1) * step[block]  # [n, k] coordinates (x, y[, z])
    strides = torch.tensor([math.prod(dims[:i]) for i in range(k)], dtype=torch.long)
    order = torch.empty(n, dtype=torch.long)
    order[first[block] + t] = (cell * strides).sum(1)
    return order


@functools.lru_cache(maxsize=64)
def _cpu_index(shape: tuple[int, ...]) -> torch.Tensor:
    if len(shape) == 1:
        return torch.arange(shape[0])
    return _curve_order(tuple(reversed(shape)))  # (H, W) -> (W, H): x is the fastest index


@functools.lru_cache(maxsize=64)
def _cpu_inverse(shape: tuple[int, ...]) -> torch.Tensor:
    perm = _cpu_index(shape)
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel())
    return inv


@functools.lru_cache(maxsize=256)
def _on_device(shape: tuple[int, ...], device: torch.device, inverse: bool) -> torch.Tensor:
    cpu = _cpu_inverse(shape) if inverse else _cpu_index(shape)
    return cpu.to(device)  # the CPU entry itself for device cpu


def _device(device) -> torch.device:
    if device is None:
        return torch.device("cpu")
    device = torch.device(device)
    if device.type != "cpu" and device.index is None:
        device = torch.empty(0, device=device).device  # "cuda" -> "cuda:<current>", so both share a copy
    return device


def hilbert_index(shape: Sequence[int], device=None) -> torch.Tensor:
    """The curve-order permutation of a row-major grid of ``shape`` ((H, W), (D, H, W), or (n,)).

    Returns a LongTensor ``perm`` of ``prod(shape)`` on ``device`` (default CPU) such that ``x[:, perm]``
    lists the cells of ``x`` ([B, prod(shape), ...], a row-major flattened grid) in Hilbert-curve order:
    ``perm[i]`` is the row-major index of the i-th cell on the curve. See the module docstring for the
    step guarantees. The result is cached per (shape, device) and shared: do not modify it in place.
    """
    return _on_device(_check_shape(shape), _device(device), False)


def _check_x(x, shape, dim) -> int:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x: expected a torch.Tensor, got {type(x).__name__}")
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"dim: expected an int, got {type(dim).__name__}")
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim: {dim} is out of range for x with {x.dim()} dimensions")
    n = math.prod(shape)
    if x.shape[dim] != n:
        raise ValueError(f"x: size {x.shape[dim]} along dim {dim} must equal prod(shape) = {n} for shape "
                         f"{shape}")
    return dim


def serialize(x: torch.Tensor, shape: Sequence[int], dim: int = 1) -> torch.Tensor:
    """Reorder ``x`` along ``dim`` (a row-major flattened grid of ``shape``) into Hilbert-curve order.

    ``serialize(x, shape)`` equals ``x[:, hilbert_index(shape, x.device)]``; differentiable (index_select).
    """
    shape = _check_shape(shape)
    dim = _check_x(x, shape, dim)
    return x.index_select(dim, _on_device(shape, _device(x.device), False))


def deserialize(x: torch.Tensor, shape: Sequence[int], dim: int = 1) -> torch.Tensor:
    """The inverse of :func:`serialize`: curve order along ``dim`` back to row-major grid order."""
    shape = _check_shape(shape)
    dim = _check_x(x, shape, dim)
    return x.index_select(dim, _on_device(shape, _device(x.device), True))


def clear_cache() -> None:
    """Drop every cached permutation (CPU and device copies)."""
    _on_device.cache_clear()
    _cpu_inverse.cache_clear()
    _cpu_index.cache_clear()
