"""Argument validation of the spec (docs/SPEC.md): the Problem every backend receives, from validate() (and
validate_varlen() for packed sequences).

The errors raised here are the spec's Errors section: ValueError (TypeError for wrong types) naming the argument and
the rule it broke. The branch table a Problem holds is branches.py's; the KV-cache call's checks are cache_spec.py's;
FLOP counts are dilated_attn.cli.measure.flops.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from .branches import Branch, branch_table
from .compile_hints import warn_once
from .memo import read_once

HEAD_GROUPS = ("all", "split")
BACKEND_NAMES = ("cuda", "triton", "cudnn", "fa4", "cpu", "reference")  # dilated_attn.backends.REGISTRY, in its order
BACKEND_CHOICES = ("auto", *BACKEND_NAMES)  # what the `backend` argument accepts


def is_int(x) -> bool:
    # a plain int first: the ABC check costs about a microsecond, and a call checks a dozen ints
    return type(x) is int or (isinstance(x, numbers.Integral) and not isinstance(x, bool))


def _flag(name: str, value) -> bool:
    """A bool argument: Python's bool or NumPy's (as torch takes them)."""
    if isinstance(value, bool) or (type(value).__module__ == "numpy" and type(value).__name__ == "bool"):
        return bool(value)
    kind = type(value)
    shown = kind.__name__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
    raise TypeError(f"{name} must be a bool, got {shown}")


def looks_swapped(p: "Problem") -> bool:
    """Every branch has r > w: legal (each segment holds at most one position per head), but what passing the
    two lists in each other's place gives. One such branch among others can be meant."""
    return all(r > w for w, r in zip(p.segment_lengths, p.dilation_rates))


def max_scale(dtype: torch.dtype) -> float:
    """The largest |scale| taken for inputs of `dtype`: the scores q.k * scale are float32 (float64 for float64),
    and a larger scale overflows them to inf for ordinary q.k, where the softmax turns NaN. At this scale every
    finite score is already a hard max (docs/numerics.md, "Extremes")."""
    return 1e300 if dtype == torch.float64 else 1e30


def _int_list(name: str, value) -> list[int]:
    if type(value) not in (list, tuple) and (isinstance(value, (str, bytes)) or not isinstance(value, Sequence)):
        if isinstance(value, torch.Tensor) and value.dim() == 1 and not value.is_floating_point():
            value = value.tolist()
        else:
            raise TypeError(f"{name} must be a sequence of positive ints, got {type(value).__name__}")
    out = []
    for j, x in enumerate(value):
        if not is_int(x):
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
    # Packed sequences (dilated_attention_varlen): batch 1 of seq_len = T rows, cut into sequences at these
    # offsets (int32 or int64, on `device`); max_seqlen bounds their lengths. None for dilated_attention.
    cu_seqlens: Optional[torch.Tensor] = None
    max_seqlen: Optional[int] = None
    # The call records its backward (grad mode on and q, k or v requiring grad): dispatch.auto_preference reads it,
    # since one backend's forward alone and its training step are fastest at different sizes.
    records_backward: bool = False
    # The head-parallel ring modes run a rank's heads [head_start, head_start + num_heads) of a problem of
    # global_heads query heads, each with its global offsets (branch_table); 0: the heads are the whole problem.
    head_start: int = 0
    global_heads: int = 0
    # A KV-cache call (dilated_attention_with_kvcache): dispatch.auto_preference puts backends with a decode kernel
    # first, since the others recompute the prefix.
    decodes: bool = False

    @classmethod
    def from_sizes(cls, batch: int, seq_len: int, heads: int, kv_heads: int, head_dim: int, segment_lengths,
                   dilation_rates, *, dtype: torch.dtype, device, causal=False, scale=None, head_groups="all",
                   return_lse=False, backend="auto", records_backward: bool = False,
                   decodes: bool = False) -> "Problem":
        """The validated Problem of a call on q [batch, seq_len, heads, head_dim] and k, v [.., kv_heads, ..] of
        `dtype` on `device`, without tensors: every rule of validate() but the tensors' own (raises the same
        ValueError/TypeError)."""
        for name, n in (("batch", batch), ("seq_len", seq_len), ("heads", heads), ("kv_heads", kv_heads),
                        ("head_dim", head_dim)):
            if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                raise TypeError(f"{name} must be an int >= 0, got {n!r}")
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"dtype must be a floating-point torch.dtype, got {dtype!r}")
        p = _problem(batch, seq_len, heads, kv_heads, head_dim, segment_lengths, dilation_rates, dtype,
                     torch.device(device), causal, scale, head_groups, return_lse, backend, records_backward)
        return dataclasses.replace(p, decodes=True) if decodes else p

    @property
    def varlen(self) -> bool:
        return self.cu_seqlens is not None

    @property
    def branches(self) -> list[Branch]:
        """The branch table; for packed sequences segments are clipped to max_seqlen (the kernels clip them to
        each sequence's length)."""
        return branch_table(*self.op_branches(), self.longest, self.num_heads, self.head_groups, self.head_start,
                            self.global_heads)

    @property
    def longest(self) -> int:
        """The longest sequence: max_seqlen for packed sequences, else seq_len."""
        return self.max_seqlen if self.max_seqlen is not None and self.varlen else self.seq_len

    def with_heads(self, head_start: int, global_heads: int) -> "Problem":
        """This problem as the heads [head_start, head_start + num_heads) of one of `global_heads` query heads
        (raises ValueError where a kernel cannot run that share: localize_branch)."""
        p = dataclasses.replace(self, head_start=head_start, global_heads=global_heads)
        if head_start < 0 or head_start + self.num_heads > global_heads:
            raise ValueError(f"heads [{head_start}, {head_start + self.num_heads}) are not heads of a problem of "
                             f"{global_heads} heads")
        p.branches  # noqa: B018 - raises where the share cannot run
        return p

    @property
    def split_heads(self) -> bool:
        return self.head_groups == "split"

    def op_branches(self, seq_len: Optional[int] = None) -> tuple[list[int], list[int]]:
        """(segment_lengths, dilation_rates) as the ops take them: the same branches with every value bounded by
        the sequence (`seq_len`: default the problem's; the ring's is the global one), so that no kernel meets an
        int that overflows (the spec puts no bound on w and r). A segment longer than the sequence (the longest
        packed sequence) is clipped to it, as the spec clips it; a dilation of at least max(s, Hq) leaves each
        segment's one member per head at offset p % s, and any larger one gives the same members and offsets
        ((p mod s) mod r = p mod s, ceil(Hq / r) = 1, group % r = group)."""
        length = max(self.longest if seq_len is None else seq_len, 1)
        # min(), except that under torch.compile, where a length marked dynamic is symbolic, a segment within it stays
        # its int (a guard on the length) and only a clipped one is the length itself, never an expression of it
        w = [x if x <= length else length for x in self.segment_lengths]
        heads = self.global_heads or self.num_heads
        caps = [s if s >= heads else heads for s in w]  # max(s, heads), as above
        return w, [r if r <= cap else cap for r, cap in zip(self.dilation_rates, caps)]

    def op_arguments(self) -> dict:
        """The keyword arguments of the backends' ops after the tensors (segment_lengths, dilation_rates,
        split_heads, causal, scale, head_start, global_heads; the branches as op_branches gives them)."""
        w, r = self.op_branches()
        return dict(segment_lengths=w, dilation_rates=r, split_heads=self.split_heads, causal=self.causal,
                    scale=self.scale, head_start=self.head_start, global_heads=self.global_heads)


# More query heads than any model has, and many more than positions: validate() warns that q is likely
# [B, H, N, D] (transposed).
LIKELY_MAX_HEADS = 256


def check_tensor(name: str, x) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 4:
        raise ValueError(f"{name} must be 4-D [batch, seq, heads, head_dim], got shape {tuple(x.shape)}")
    if not x.is_floating_point():
        raise TypeError(f"{name} must have a floating-point dtype, got {x.dtype}")


def validate(q, k, v, segment_lengths, dilation_rates, *, causal=False, scale=None, head_groups="all",
             return_lse=False, backend="auto") -> Problem:
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, x)
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
        hint = ""
        if k.shape[2] == Hq > N and N % k.shape[1] == 0:
            # q [B, H, S, D] and k [B, Hkv, S, D] with S > H: PyTorch SDPA's layout, with fewer kv heads
            hint = (f"; they look like [batch, heads, seq, head_dim] (PyTorch SDPA's layout, here with {N} query and "
                    f"{k.shape[1]} kv heads): dilated_attention takes [batch, seq, heads, head_dim], so pass q, k and "
                    f"v .transpose(1, 2)")
        raise ValueError(f"k and v must have the sequence length of q ({N}; self-attention only), got "
                         f"{k.shape[1]}{hint}")
    if k.shape[3] != D:
        raise ValueError(f"k and v must have the head_dim of q ({D}), got {k.shape[3]}")
    Hkv = k.shape[2]
    if Hq > LIKELY_MAX_HEADS and Hq >= 8 * N:
        # a [B, H, N, D] tensor (PyTorch SDPA's layout) passes every check and gives a wrong result
        warn_once(f"dilated_attn: q has {Hq} heads of {N} positions each: dilated_attention takes [batch, seq, heads, "
                  f"head_dim] (flash-attn's layout); if q, k and v are [batch, heads, seq, head_dim] (PyTorch SDPA's), "
                  f"pass them .transpose(1, 2)", stacklevel=3)
    records_backward = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    p = _problem(B, N, Hq, Hkv, D, segment_lengths, dilation_rates, q.dtype, q.device, causal, scale, head_groups,
                 return_lse, backend, records_backward)
    warn_if_swapped(p, stacklevel=4)  # the modules, which take the lists in the other order too, raise
    return p


def warn_if_swapped(p: Problem, stacklevel: int) -> None:
    """Warns once where the lists look swapped (looks_swapped): the functions' rule."""
    if looks_swapped(p):
        w, r = list(p.segment_lengths), list(p.dilation_rates)
        warn_once(f"dilated_attn: dilation_rates {r} are each larger than the segment_lengths {w}: every segment "
                  f"holds at most one position per head; the lists look swapped (the functions take "
                  f"segment_lengths first, MultiheadDilatedAttention dilation_rates first)", stacklevel=stacklevel)


def _problem(B, N, Hq, Hkv, D, segment_lengths, dilation_rates, dtype, device, causal, scale, head_groups, return_lse,
             backend, records_backward) -> Problem:
    """The rules of a call's sizes and arguments (validate() and Problem.from_sizes), then its Problem."""
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
    causal, return_lse = _flag("causal", causal), _flag("return_lse", return_lse)
    if scale is None:
        scale = D**-0.5
    elif isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a real number or None, got {type(scale).__name__}")
    elif not math.isfinite(float(scale)):
        raise ValueError(f"scale must be finite, got {scale}")
    elif abs(float(scale)) > max_scale(dtype):
        limit = max_scale(dtype)
        compute = "float64" if dtype == torch.float64 else "float32"
        raise ValueError(f"scale must be at most {limit:g} in magnitude for {dtype_name(dtype)} inputs, got {scale}: "
                         f"the scores q.k * scale are {compute}, which a larger scale overflows to inf (at "
                         f"{limit:g} every score is already a hard max)")
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
        dtype=dtype,
        device=device,
        records_backward=records_backward,
    )


def host_offsets(cu_seqlens: torch.Tensor) -> list[int]:
    """cu_seqlens' values on the host. Offsets on the CPU are read every call (a copy of S + 1 integers); offsets on
    a GPU once per tensor while its version counter stays the same (memo.read_once), so that a model's layers and
    their backwards, handed one cu_seqlens, wait for the GPU once. A write that does not move the counter
    (through `.data`, a NumPy or DLPack view) is not seen there: pass a new tensor for new offsets."""
    if cu_seqlens.device.type == "cpu":
        return cu_seqlens.tolist()
    return read_once(cu_seqlens, "offsets", torch.Tensor.tolist)


def check_offsets(offsets: list[int], total: int, max_seqlen: Optional[int], total_is: Optional[str] = None) -> int:
    """The rules of cu_seqlens' values (0 first, `total` last, non-decreasing, no sequence longer than max_seqlen
    where given); returns the longest sequence. Wherever the offsets are read on the host, they are checked.
    `total_is` says what `total` is where it is not q.shape[0] (a ring's whole pack)."""
    if offsets[0] != 0:
        raise ValueError(f"cu_seqlens[0] must be 0, got {offsets[0]}")
    if offsets[-1] != total:
        raise ValueError(f"cu_seqlens[-1] must be the total number of tokens, {total_is or f'q.shape[0] = {total}'}, "
                         f"got {offsets[-1]}")
    lengths = [b - a for a, b in zip(offsets, offsets[1:])]
    for j, n in enumerate(lengths):
        if n < 0:
            raise ValueError(f"cu_seqlens must be non-decreasing, got cu_seqlens[{j}] = {offsets[j]} > "
                             f"cu_seqlens[{j + 1}] = {offsets[j + 1]}")
    longest = max(lengths, default=0)
    if max_seqlen is not None and max_seqlen < longest:
        raise ValueError(f"max_seqlen ({max_seqlen}) must be at least the longest sequence ({longest})")
    return longest


def check_packed_tensors(q, k, v) -> None:
    """Packed sequences' q `[T, Hq, D]`, k and v `[T, Hkv, D]`: tensors, 3-D, k and v alike and of q's rows."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 3:
            raise ValueError(f"{name} must be 3-D [total_tokens, heads, head_dim] for packed sequences, got shape "
                             f"{tuple(x.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got k {tuple(k.shape)} and v {tuple(v.shape)}")
    if k.shape[0] != q.shape[0]:
        raise ValueError(f"k and v must have q's total number of tokens ({q.shape[0]}), got {k.shape[0]}")


def check_cu_seqlens(cu_seqlens, total: int, device: torch.device, max_seqlen, total_is: Optional[str] = None) -> int:
    """The rules of packed sequences' offsets `cu_seqlens` over `total` rows on `device` (their type, dtype, shape
    and device; their values, read back to the host, except under torch.compile, where `max_seqlen` is required
    and trusted); returns max_seqlen (the longest sequence where not given)."""
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"cu_seqlens must be a torch.Tensor of int32 or int64 offsets, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"cu_seqlens must have dtype int32 or int64, got {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise ValueError(f"cu_seqlens must be 1-D with S + 1 >= 1 offsets, got shape {tuple(cu_seqlens.shape)}")
    if cu_seqlens.device != device:
        raise ValueError(f"cu_seqlens must be on q's device ({device}), got {cu_seqlens.device}")
    if max_seqlen is not None:
        if not is_int(max_seqlen):
            raise TypeError(f"max_seqlen must be an int or None, got {type(max_seqlen).__name__}")
        if max_seqlen < 0:
            raise ValueError(f"max_seqlen must be >= 0, got {max_seqlen}")
    if torch.compiler.is_compiling():
        if max_seqlen is None:
            raise ValueError("max_seqlen is required under torch.compile: finding the longest sequence would read "
                             "cu_seqlens back to the host and break the graph")
    else:
        longest = check_offsets(host_offsets(cu_seqlens), total, max_seqlen, total_is)
        if max_seqlen is None:
            max_seqlen = longest
    return int(max_seqlen)


def validate_varlen(q, k, v, cu_seqlens, segment_lengths, dilation_rates, *, max_seqlen=None, causal=False, scale=None,
                    head_groups="all", return_lse=False, backend="auto") -> Problem:
    """validate() for packed sequences: q `[T, Hq, D]`, k and v `[T, Hkv, D]`, `cu_seqlens` `[S + 1]` offsets.

    The offsets' values (0 first, T last, non-decreasing, the longest sequence <= max_seqlen) are read back to
    the host and checked, except under torch.compile, where reading them would break the graph: there
    `max_seqlen` is required and trusted, the kernels keep every access inside the pack whatever the offsets, and
    the backends that read the offsets on the host (one call per sequence) check them there (check_offsets).
    """
    check_packed_tensors(q, k, v)
    p = validate(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), segment_lengths, dilation_rates, causal=causal,
                 scale=scale, head_groups=head_groups, return_lse=return_lse, backend=backend)
    max_seqlen = check_cu_seqlens(cu_seqlens, q.shape[0], q.device, max_seqlen)
    return dataclasses.replace(p, cu_seqlens=cu_seqlens, max_seqlen=int(max_seqlen))


def sequence_problem(packed: Problem, length: int) -> Problem:
    """The problem of one sequence (batch 1, `length` rows) of a pack."""
    return dataclasses.replace(packed, seq_len=length, cu_seqlens=None, max_seqlen=None)


def dtype_name(dtype: torch.dtype) -> str:
    """"bfloat16" for torch.bfloat16."""
    return str(dtype).removeprefix("torch.")


def lse_dtype(dtype: torch.dtype) -> torch.dtype:
    """LSE is float32, or float64 for float64 inputs (spec: Merging branches)."""
    return torch.float64 if dtype == torch.float64 else torch.float32
