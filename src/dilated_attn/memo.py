"""Host-side values read from a tensor's contents, kept while the tensor lives unchanged.

Reading a GPU tensor on the host waits for the GPU. A value read from one tensor (a pack's offsets, what an
attention mask asks for) is kept here while that tensor object lives and its version counter, which every in-place
write moves, stays the same: the layers of a model handed one tensor, and their backwards, read it once.
"""

from __future__ import annotations

import weakref
from typing import Callable, TypeVar

import torch

__all__ = ["read_once"]

T = TypeVar("T")

# (id(tensor), what was read) -> (a weak reference to the tensor, its version then, the value)
_KEPT: dict[tuple[int, str], tuple[weakref.ref, int, object]] = {}


def read_once(tensor: torch.Tensor, what: str, read: Callable[[torch.Tensor], T]) -> T:
    """`read(tensor)`, or the value it gave for this tensor object and `what` while the tensor is unchanged since.
    Inference tensors keep no version counter to tell a change by: they are read every time."""
    if tensor.is_inference():
        return read(tensor)
    key = (id(tensor), what)
    known = _KEPT.get(key)
    if known is not None and known[0]() is tensor and known[1] == tensor._version:
        return known[2]
    value = read(tensor)
    _KEPT[key] = (weakref.ref(tensor, lambda _: _KEPT.pop(key, None)), tensor._version, value)
    return value
