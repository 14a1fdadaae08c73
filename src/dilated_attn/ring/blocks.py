"""The block primitive of the ring: local queries against one dense block of keys.

A block runs a backend's single-device ops (dilated_attn.backends) with one branch `(n, 1)`: causal on a rank's own
rows, full otherwise; unequal query and key lengths run in one call where the backend has ops for them
(`Backend.dense_ops`: cudnn), else are cut into squares. So the ring and the single-device path share one kernel
family. Each block's partial result merges in place into the rows' running `(out, lse)`: out in the
inputs' dtype, the LSE in float32 (float64 for float64), with the CUDA merge kernel where it runs (one pass over the
rows), else merge.merge_into.
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple, Optional

import torch

from .. import backends
from ..backends import extension
from ..merge import merge_into
from .plan import BranchRun

__all__ = ["BlockOps", "Sums", "SumsRows", "accumulate", "block_ops", "block_forward", "block_backward",
           "block_gradients", "merge_block", "run_forward", "run_backward"]


class BlockOps(NamedTuple):
    """A backend's ops as the blocks run them: its forward and backward of one branch, its ops for unequal query and
    key lengths (Backend.dense_ops) or None, and its packed ops at this head dim (Backend.varlen_ops) or None."""

    forward: Callable
    backward: Callable
    dense: Optional[tuple[Callable, Callable]]
    varlen: Optional[tuple[Callable, Callable]]


def block_ops(name: str, head_dim: int) -> BlockOps:
    backend = backends.get(name)
    return BlockOps(*backend.ops(), backend.dense_ops(), backend.varlen_ops(head_dim))


def _one_call(ops: BlockOps, causal: bool, nq: int, nk: int) -> bool:
    """Whether a full block of unequal lengths runs in one call of the backend's dense ops."""
    return ops.dense is not None and not causal and nq != nk and min(nq, nk) >= 2


def _squares(nq: int, nk: int) -> list[tuple[int, int, int, int]]:
    """Cut a full nq x nk block into squares (q0, q1, k0, k1) the one-branch op can run (q and k of equal
    length): keys in slices of nq when nk > nq, queries in slices of nk (the last padded) when nq > nk."""
    if nq <= nk:
        out = [(0, nq, k0, k0 + nq) for k0 in range(0, nk - nk % nq, nq)]
        if nk % nq:
            rest = nk - nk % nq
            out += [(q0, q1, k0 + rest, k1 + rest) for q0, q1, k0, k1 in _squares(nq, nk % nq)]
        return out
    return [(q0, min(q0 + nk, nq), 0, nk) for q0 in range(0, nq, nk)]


def _pad_rows(x: torch.Tensor, n: int) -> torch.Tensor:
    """x [B, m, ...] padded with zero rows to [B, n, ...] (zero queries: finite, and their output is dropped)."""
    if x.shape[1] == n:
        return x
    return torch.cat([x, x.new_zeros((x.shape[0], n - x.shape[1], *x.shape[2:]))], 1)


def _merge_kernel_runs(acc_out, acc_lse, out, lse) -> bool:
    return (acc_out.is_cuda and acc_out.dtype == out.dtype and acc_lse.dtype == lse.dtype == torch.float32
            and acc_out.stride(-1) == 1 and out.stride(-1) == 1 and extension.has_kernel("cuda"))


class Sums:
    """A float32 (float64) gradient sum `[B, n, H, D]` that starts unwritten: the first part added to a range of its
    rows is stored there and later ones are added (no zero fill, and no zeros read by the first addition), and
    finish() zeroes the rows no part reached. `sums[:, a:b]` is its rows a..b as an accumulate target."""

    # Uninitialised memory for sums (tests poison it, so that a row read before any part reached it shows).
    memory = staticmethod(lambda shape, dtype, device: torch.empty(shape, dtype=dtype, device=device))

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor
        self._written: list[tuple[int, int]] = []  # disjoint, in order

    @classmethod
    def empty(cls, shape, dtype, device) -> "Sums":
        return cls(cls.memory(shape, dtype, device))

    def __getitem__(self, index) -> "SumsRows":
        return SumsRows(self, 0, self.tensor.shape[1])[index]

    def runs(self, a: int, b: int) -> list[tuple[int, int, bool]]:
        """[a, b) as (lo, hi, first) runs: first where no part has reached those rows yet."""
        pieces, at = [], a
        for lo, hi in self._written:
            lo, hi = max(lo, a), min(hi, b)
            if lo >= hi:
                continue
            pieces += [(at, lo, True)] if at < lo else []
            pieces.append((lo, hi, False))
            at = hi
        return pieces + ([(at, b, True)] if at < b else [])

    def reached(self, a: int, b: int) -> None:
        """Rows [a, b) have taken a part."""
        merged = []
        for lo, hi in sorted([*self._written, (a, b)]):
            if merged and lo <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
            else:
                merged.append((lo, hi))
        self._written = merged

    def finish(self) -> torch.Tensor:
        """The sums, zero in the rows no part reached."""
        for lo, hi, first in self.runs(0, self.tensor.shape[1]):
            if first:
                self.tensor[:, lo:hi].zero_()
        self.reached(0, self.tensor.shape[1])
        return self.tensor


class SumsRows(NamedTuple):
    """Rows [a, b) of a Sums; slicing `[:, lo:hi]` is relative to them, as a tensor's."""

    sums: Sums
    a: int
    b: int

    def __getitem__(self, index) -> "SumsRows":
        everything, rows = index
        if everything != slice(None) or not isinstance(rows, slice) or rows.step not in (None, 1):
            raise IndexError("Sums rows are sliced as [:, lo:hi]")
        lo, hi, _ = rows.indices(self.b - self.a)
        return SumsRows(self.sums, self.a + lo, self.a + max(lo, hi))

    def take(self, part: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor, bool]]:
        """(sums' rows, part's rows, store) runs that add `part` (these rows' part) to these rows, the rows marked
        as reached."""
        whole = self.sums
        taken = [(whole.tensor[:, lo:hi], part[:, lo - self.a: hi - self.a], first)
                 for lo, hi, first in whole.runs(self.a, self.b)]
        whole.reached(self.a, self.b)
        return taken


def accumulate(sums: list, grads: list[torch.Tensor]) -> None:
    """sums[i] += grads[i], `[B, n, H, D]` each: a tensor, or a Sums' rows, whose unwritten rows take the part as
    it is (extension.accumulate on their `[B, H, n, D]` views: one call for the stored pairs, one for the added)."""
    stored, added = [], []
    for target, grad in zip(sums, grads):
        for x, part, store in target.take(grad) if isinstance(target, SumsRows) else [(target, grad, False)]:
            (stored if store else added).append((x, part))
    for pairs, store in ((stored, True), (added, False)):
        if pairs:
            extension.accumulate([x.transpose(1, 2) for x, _ in pairs], [g.transpose(1, 2) for _, g in pairs], store)


def merge_block(acc_out, acc_lse, out, lse) -> None:
    """acc_out [B, n, H, D], acc_lse [B, H, n] <- their merge with (out, lse) of the same shapes, in place."""
    if _merge_kernel_runs(acc_out, acc_lse, out, lse):
        torch.ops.dilated_attn.merge_into(acc_out.transpose(1, 2), acc_lse, out.transpose(1, 2), lse)
    else:
        merge_into(acc_out, acc_lse.transpose(1, 2), out, lse.transpose(1, 2))


def _dense(n: int, causal: bool, scale: float) -> dict:
    """The op arguments of one dense branch (n, 1) over n rows."""
    return dict(segment_lengths=[n], dilation_rates=[1], split_heads=False, causal=causal, scale=scale)


def block_forward(ops: BlockOps, q, k, v, causal, scale, acc_out, acc_lse, seg_len: int = 0) -> None:
    """Merge the attention of q [B, nq, H, D] over k, v [B, nk, Hk, D] (one dense block; with `seg_len`, the
    consecutive square blocks of that many rows: plan.BlockTask) into acc_out/acc_lse."""
    if seg_len:
        merge_block(acc_out, acc_lse, *ops.forward(q, k, v, **_dense(seg_len, causal, scale)))
        return
    if _one_call(ops, causal, q.shape[1], k.shape[1]):
        merge_block(acc_out, acc_lse, *ops.dense[0](q, k, v, scale))
        return
    if causal:  # own rows: nq == nk
        out, lse = ops.forward(q, k, v, **_dense(q.shape[1], True, scale))
        merge_block(acc_out, acc_lse, out, lse)
        return
    for q0, q1, k0, k1 in _squares(q.shape[1], k.shape[1]):
        n = k1 - k0
        out, lse = ops.forward(_pad_rows(q[:, q0:q1], n), k[:, k0:k1], v[:, k0:k1], **_dense(n, False, scale))
        merge_block(acc_out[:, q0:q1], acc_lse[:, :, q0:q1], out[:, : q1 - q0], lse[:, :, : q1 - q0])


def block_backward(ops: BlockOps, q, k, v, out, lse, d_out, d_lse, causal, scale, dq, dk, dv,
                   seg_len: int = 0) -> None:
    """Add one block's exact gradients (merged out/LSE of its query rows, and the LSE's gradient d_lse, or None
    where it has none; `seg_len` as block_forward's) into dq, dk, dv (accumulators)."""
    if seg_len:
        grads = ops.backward(d_out, d_lse, q, k, v, out, lse, **_dense(seg_len, causal, scale))
        accumulate([dq, dk, dv], list(grads))
        return
    if d_lse is None and _one_call(ops, causal, q.shape[1], k.shape[1]):
        accumulate([dq, dk, dv], list(ops.dense[1](d_out, q, k, v, out, lse, scale)))
        return
    squares = [(0, q.shape[1], 0, k.shape[1])] if causal else _squares(q.shape[1], k.shape[1])
    for q0, q1, k0, k1 in squares:
        n = k1 - k0
        rows = [_pad_rows(x[:, q0:q1], n) for x in (q, out, d_out)]
        pad_l = [None if x is None else torch.nn.functional.pad(x[:, :, q0:q1], (0, n - (q1 - q0)))
                 for x in (lse, d_lse)]
        gq, gk, gv = ops.backward(rows[2], pad_l[1], rows[0], k[:, k0:k1], v[:, k0:k1], rows[1], pad_l[0],
                                 **_dense(n, causal, scale))
        accumulate([dq[:, q0:q1], dk[:, k0:k1], dv[:, k0:k1]], [gq[:, : q1 - q0], gk, gv])


def _packed(ops: BlockOps, run: BranchRun, batch: int) -> bool:
    """Whether an internal run goes in one call of the packed ops (else one call of the op per part)."""
    return ops.varlen is not None and len(run.bounds) > 2 and batch == 1


@functools.lru_cache(maxsize=1024)
def _offsets(bounds: tuple[int, ...], device) -> torch.Tensor:
    return torch.tensor(bounds, dtype=torch.int32, device=device)


def _packed_arguments(run: BranchRun, device) -> tuple:
    """cu_seqlens and max_seqlen of a run's parts, the sequences of a packed call."""
    return _offsets(run.bounds, device), max(b - a for a, b in zip(run.bounds, run.bounds[1:]))


def run_forward(ops: BlockOps, run: BranchRun, q, k, v, out, lse, arguments: dict) -> None:
    """Merge an internal run's attention (plan.BranchRun; `arguments`: its op arguments) into out `[B, L, H, D]`
    and lse `[B, H, L]` at its rows."""
    if _packed(ops, run, q.shape[0]):
        r = slice(run.start, run.stop)
        o, o_lse = ops.varlen[0](q[0, r], k[0, r], v[0, r], *_packed_arguments(run, q.device), **arguments)
        merge_block(out[:, r], lse[:, :, r], o[None], o_lse[None])
        return
    for a, b in run.parts():
        merge_block(out[:, a:b], lse[:, :, a:b], *ops.forward(q[:, a:b], k[:, a:b], v[:, a:b], **arguments))


def run_backward(ops: BlockOps, run: BranchRun, q, k, v, out, lse, d_out, d_lse, arguments: dict, grads) -> None:
    """Add an internal run's exact gradients (the merged out and LSE, as block_backward's) into grads (dq, dk,
    dv)."""
    if _packed(ops, run, q.shape[0]):
        r = slice(run.start, run.stop)
        d_l = None if d_lse is None else d_lse[0, :, r].contiguous()
        parts = ops.varlen[1](d_out[0, r], d_l, q[0, r], k[0, r], v[0, r], out[0, r], lse[0, :, r].contiguous(),
                              *_packed_arguments(run, q.device), **arguments)
        accumulate([g[:, r] for g in grads], [x[None] for x in parts])
        return
    for a, b in run.parts():
        parts = ops.backward(d_out[:, a:b], None if d_lse is None else d_lse[:, :, a:b], q[:, a:b], k[:, a:b],
                             v[:, a:b], out[:, a:b], lse[:, :, a:b], **arguments)
        accumulate([g[:, a:b] for g in grads], list(parts))


def block_gradients(ops: BlockOps, q, k, v, out, lse, d_out, d_lse, scale):
    """(dq, dk, dv) of one full block (as block_backward, without accumulators): the one call's gradients where it
    runs in one, else their float32 (float64) sums over the squares."""
    if d_lse is None and _one_call(ops, False, q.shape[1], k.shape[1]):
        return ops.dense[1](d_out, q, k, v, out, lse, scale)
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    dq, dk, dv = (torch.zeros(x.shape, dtype=acc, device=x.device) for x in (q, k, v))
    block_backward(ops, q, k, v, out, lse, d_out, d_lse, False, scale, dq, dk, dv)
    return dq, dk, dv
