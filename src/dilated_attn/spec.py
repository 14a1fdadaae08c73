"""Argument validation and the branch table of the spec (docs/SPEC.md).

Every backend receives arguments that passed `validate()`; the errors raised here are the spec's Errors
section: ValueError (TypeError for wrong types) naming the argument and the rule it broke.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Sequence

import torch

HEAD_GROUPS = ("all", "split")
BACKEND_NAMES = ("cuda", "triton", "cudnn", "cpu", "reference")  # dilated_attn.backends.REGISTRY, in its order
BACKEND_CHOICES = ("auto", *BACKEND_NAMES)  # what the `backend` argument accepts


@dataclass(frozen=True)
class Branch:
    """One (segment length, dilation) pair resolved for a given sequence length and head count.

    Query head `h` takes part iff `head_lo <= h < head_hi`, and then uses the offset
    `offset_base + (h - head_lo) // offset_div`. Both head groupings of the spec fit this form:
    "all": every head, offset `h // ceil(Hq / r)`; "split": group `i`, offset `i % r`.
    """

    segment_length: int  # w as given
    seg_len: int  # s = min(w, N)
    dilation: int  # r
    head_lo: int
    head_hi: int
    offset_div: int
    offset_base: int

    def offset(self, head: int) -> int:
        return self.offset_base + (head - self.head_lo) // self.offset_div


def split_group_bounds(num_heads: int, num_groups: int, group: int) -> tuple[int, int]:
    """Head range [lo, hi) of `group` when `num_heads` heads are cut into `num_groups` contiguous groups,
    the first `num_heads % num_groups` groups holding one head more."""
    base, extra = divmod(num_heads, num_groups)
    lo = group * base + min(group, extra)
    return lo, lo + base + (1 if group < extra else 0)


def branch_table(
    segment_lengths: Sequence[int], dilation_rates: Sequence[int], seq_len: int, num_heads: int, head_groups: str
) -> list[Branch]:
    m = len(segment_lengths)
    table = []
    for i, (w, r) in enumerate(zip(segment_lengths, dilation_rates)):
        s = max(min(w, seq_len), 1)  # N = 0: no position, any s >= 1 will do
        if head_groups == "all":
            table.append(Branch(w, s, r, 0, num_heads, -(-num_heads // r), 0))
        else:
            lo, hi = split_group_bounds(num_heads, m, i)
            table.append(Branch(w, s, r, lo, hi, max(num_heads, 1), i % r))
    return table


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _int_list(name: str, value) -> list[int]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        if isinstance(value, torch.Tensor) and value.dim() == 1 and not value.is_floating_point():
            value = value.tolist()
        else:
            raise TypeError(f"{name} must be a sequence of positive ints, got {type(value).__name__}")
    out = []
    for j, x in enumerate(value):
        if not _is_int(x):
            raise TypeError(f"{name}[{j}] must be an int, got {type(x).__name__} ({x!r})")
        if x <= 0:
            raise ValueError(f"{name}[{j}] must be a positive integer, got {x}")
        out.append(int(x))
    if not out:
        raise ValueError(f"{name} must not be empty (at least one branch is required)")
    return out


@dataclass(frozen=True)
class Problem:
    """Validated, normalised arguments of one dilated attention call."""

    batch: int
    seq_len: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    segment_lengths: tuple[int, ...]
    dilation_rates: tuple[int, ...]
    head_groups: str
    causal: bool
    scale: float
    dtype: torch.dtype
    device: torch.device

    @property
    def branches(self) -> list[Branch]:
        return branch_table(self.segment_lengths, self.dilation_rates, self.seq_len, self.num_heads, self.head_groups)

    @property
    def split_heads(self) -> bool:
        return self.head_groups == "split"


def _check_tensor(name: str, x) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 4:
        raise ValueError(f"{name} must be 4-D [batch, seq, heads, head_dim], got shape {tuple(x.shape)}")
    if not x.is_floating_point():
        raise TypeError(f"{name} must have a floating-point dtype, got {x.dtype}")


def validate(
    q,
    k,
    v,
    segment_lengths,
    dilation_rates,
    *,
    causal=False,
    scale=None,
    head_groups="all",
    return_lse=False,
    backend="auto",
) -> Problem:
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, x)
    for name, x in (("k", k), ("v", v)):
        if x.device != q.device:
            raise ValueError(f"{name} must be on the same device as q ({q.device}), got {x.device}")
        if x.dtype != q.dtype:
            raise ValueError(f"{name} must have the same dtype as q ({q.dtype}), got {x.dtype}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got k {tuple(k.shape)} and v {tuple(v.shape)}")
    B, N, Hq, D = q.shape
    if k.shape[0] != B:
        raise ValueError(f"k and v must have the batch size of q ({B}), got {k.shape[0]}")
    if k.shape[1] != N:
        raise ValueError(f"k and v must have the sequence length of q ({N}; self-attention only), got {k.shape[1]}")
    if k.shape[3] != D:
        raise ValueError(f"k and v must have the head_dim of q ({D}), got {k.shape[3]}")
    Hkv = k.shape[2]
    if Hq == 0 or Hkv == 0:
        raise ValueError(f"q, k and v must have at least one head, got q heads {Hq} and k/v heads {Hkv}")
    if D == 0:
        raise ValueError("q, k and v must have head_dim >= 1, got 0")
    if Hq % Hkv != 0:
        raise ValueError(f"q heads ({Hq}) must be a multiple of k/v heads ({Hkv}) (Hq % Hkv == 0, GQA/MQA)")

    w = _int_list("segment_lengths", segment_lengths)
    r = _int_list("dilation_rates", dilation_rates)
    if len(w) != len(r):
        raise ValueError(
            f"segment_lengths and dilation_rates must have the same length, got {len(w)} and {len(r)}"
        )
    if not isinstance(head_groups, str):
        raise TypeError(f"head_groups must be a str ('all' or 'split'), got {type(head_groups).__name__}")
    if head_groups not in HEAD_GROUPS:
        raise ValueError(f"head_groups must be 'all' or 'split', got {head_groups!r}")
    if head_groups == "split" and Hq < len(w):
        raise ValueError(
            f"head_groups='split' needs at least one query head per branch: {Hq} heads < {len(w)} branches"
        )
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")
    if scale is None:
        scale = D**-0.5
    elif isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a real number or None, got {type(scale).__name__}")
    elif not math.isfinite(float(scale)):
        raise ValueError(f"scale must be finite, got {scale}")
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a str, one of {BACKEND_CHOICES}, got {type(backend).__name__}")
    if backend not in BACKEND_CHOICES:
        raise ValueError(f"backend must be one of {BACKEND_CHOICES}, got {backend!r}")
    return Problem(
        batch=B,
        seq_len=N,
        num_heads=Hq,
        num_kv_heads=Hkv,
        head_dim=D,
        segment_lengths=tuple(w),
        dilation_rates=tuple(r),
        head_groups=head_groups,
        causal=causal,
        scale=float(scale),
        dtype=q.dtype,
        device=q.device,
    )


def dtype_name(dtype: torch.dtype) -> str:
    """"bfloat16" for torch.bfloat16."""
    return str(dtype).removeprefix("torch.")


def lse_dtype(dtype: torch.dtype) -> torch.dtype:
    """LSE is float32, or float64 for float64 inputs (spec: Merging branches)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def flops(problem: Problem, backward: bool = False) -> float:
    """Matmul FLOPs: 4*B*N*D*sum_i(H_i*s_i/r_i^2), H_i the heads taking part in branch i (all H with
    head_groups="all"), halved for causal, x3.5 with backward (forward 2 matmuls, backward 5)."""
    b = problem
    work = sum((br.head_hi - br.head_lo) * br.seg_len / br.dilation**2 for br in b.branches)
    f = 4.0 * b.batch * b.seq_len * b.head_dim * work
    if b.causal:
        f /= 2
    return f * (3.5 if backward else 1.0)

