"""What every backend declares: its forward and backward ops' support (as data), every reason it cannot run a given
input, and its ops."""

from __future__ import annotations

import dataclasses
import threading
from typing import Callable, Optional, cast

import torch

from ..cache_spec import CacheProblem
from ..compile_hints import trace_constant
from ..spec import Problem, check_offsets, dtype_name, host_offsets, lse_dtype, sequence_problem

__all__ = ["Backend", "BackwardOp", "ForwardOp", "OnceLoader", "device_capability"]

_CAPABILITIES: dict = {}


@trace_constant
def device_capability(device: torch.device) -> tuple[int, int]:
    """torch.cuda.get_device_capability(device), asked once per device: every verdict on a CUDA input reads it."""
    if device.index is None:  # the current device, which can change
        return torch.cuda.get_device_capability(device)
    # keyed by the function too, so that a stand-in for it (the tests' GPUs without a GPU) is asked afresh
    key = (device, torch.cuda.get_device_capability)
    if key not in _CAPABILITIES:
        _CAPABILITIES[key] = torch.cuda.get_device_capability(device)
    return _CAPABILITIES[key]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ForwardOp:
    """What a backend's forward op runs, as data (None: any); `reasons` lists every rule an input breaks."""

    device_types: Optional[tuple[str, ...]] = None  # the device types of the tensors it takes
    dtypes: Optional[tuple[torch.dtype, ...]] = None
    max_head_dim: Optional[int] = None
    min_capability: Optional[tuple[int, int]] = None  # the oldest CUDA compute capability, for CUDA tensors
    capability_rule: str = ""  # what min_capability stands for, said when a GPU is older
    # Packed sequences (dilated_attention_varlen): "kernels" (the whole pack in the kernels' launches),
    # "per_sequence" (Backend.forward_varlen's loop over the sequences), or None (a reason).
    varlen: Optional[str] = None

    def reasons(self, p: Problem, device_types: Optional[tuple[str, ...]] = None) -> list[str]:
        """Every rule of these data that `p` breaks (empty: none), `device_types` standing for the declared ones
        where given (Backend.supported_device_types)."""
        devices = self.device_types if device_types is None else device_types
        found = []
        if devices is not None and p.device.type not in devices:
            found.append(f"needs {'/'.join(d.upper() for d in devices)} tensors, got {p.device.type}")
        if self.dtypes is not None and p.dtype not in self.dtypes:
            names = ", ".join(dtype_name(d) for d in self.dtypes)
            found.append(f"dtype {dtype_name(p.dtype)} is not supported (supported: {names})")
        if self.max_head_dim is not None and p.head_dim > self.max_head_dim:
            found.append(f"head_dim {p.head_dim} > {self.max_head_dim}")
        if self.min_capability is not None and p.device.type == "cuda":
            have = device_capability(p.device)
            if have < self.min_capability:
                need = ".".join(map(str, self.min_capability))
                found.append(f"compute capability {have[0]}.{have[1]} < {need} ({self.capability_rule})")
        if p.varlen and self.varlen is None:
            found.append("packed sequences (varlen) are not implemented in this backend")
        return found

    def backward(self, **declared) -> BackwardOp:
        """The declaration of a backward op that takes the inputs this forward takes, and `declared`."""
        inputs = {f.name: getattr(self, f.name) for f in dataclasses.fields(ForwardOp)}
        return BackwardOp(**inputs, **declared)


@dataclasses.dataclass(frozen=True, kw_only=True)
class BackwardOp(ForwardOp):
    """What a backend's backward op runs: a forward's data, and which calls it can serve. Where it cannot serve a
    call, the forward still runs and autograd runs the backward op the dispatch layer chose at forward time
    (dispatch.backward_backend, backends/autograd.py)."""

    takes_lse_gradient: bool = True  # takes the LSE's gradient (grad_lse)
    lse_gradient_rule: str = ""  # why it does not, said by explain()
    # gives the same bits on every run (no atomics), which torch.use_deterministic_algorithms(True) asks for
    deterministic: bool = True
    nondeterminism_rule: str = ""  # why it does not, said by explain()

    def reasons(self, p: Problem, device_types: Optional[tuple[str, ...]] = None, lse_gradient: bool = False,
                deterministic: bool = False) -> list[str]:
        """Every rule that `p` breaks, in a call whose LSE has a gradient (`lse_gradient`) under deterministic
        algorithms (`deterministic`)."""
        return super().reasons(p, device_types) + self.call_reasons(lse_gradient, deterministic)

    def call_reasons(self, lse_gradient: bool, deterministic: bool = False) -> list[str]:
        """The rules of `reasons` that a call breaks whatever its input: why this backward cannot follow its own
        forward (which took the input)."""
        found = []
        if lse_gradient and not self.takes_lse_gradient:
            found.append(self.lse_gradient_rule)
        if deterministic and not self.deterministic:
            found.append(self.nondeterminism_rule)
        return found


class OnceLoader:
    """A backend's import of its kernels (`load`: None, or why they cannot be loaded), run on the first call and
    remembered. Thread-safe: a second thread's first call waits until the first has finished (and the ops it
    registers exist)."""

    # How many loads have finished in this process, of every backend: what can run changes only then, so that
    # decisions kept across calls (dispatch.state) hold while it stays the same.
    finished = 0

    def __init__(self, load: Callable[[], Optional[str]]):
        self._load = load
        self._lock = threading.Lock()
        self.done = False
        self.error: Optional[str] = None

    def __call__(self) -> Optional[str]:
        if not self.done:
            with self._lock:
                if not self.done:
                    self.error = self._load()
                    self.done = True
                    OnceLoader.finished += 1
        return self.error


class Backend:
    """One implementation of the spec (docs/SPEC.md). Subclasses declare their ops (`forward_op`, `backward_op`),
    add the rules data cannot say (`unavailable`, `extra_reasons`) and give the ops (`ops()`).

    Both ops take the arguments of the op schemas in csrc/registration.cpp:

        forward(q, k, v, segment_lengths, dilation_rates, split_heads, causal, scale, head_start=0,
                global_heads=0) -> (out, lse)
        backward(grad_out, grad_lse, q, k, v, out, lse, segment_lengths, dilation_rates, split_heads, causal,
                 scale, head_start=0, global_heads=0) -> (grad_q, grad_k, grad_v)

    `head_start` and `global_heads` (0: the heads are the whole problem) make the heads of q the heads
    `[head_start, head_start + Hq)` of a problem of `global_heads` heads, with its offsets (branches.branch_table): the
    head-parallel ring modes run a rank's heads so.

    `forward` is differentiable (autograd runs `backward`). `backward` takes the merged `out` and `lse` of the
    whole problem and returns the share of the gradient its keys give, which is what lets the ring run it on one
    block of keys of a longer sequence.
    """

    name: str = ""
    forward_op: ForwardOp
    backward_op: BackwardOp

    def supported_device_types(self) -> Optional[tuple[str, ...]]:
        """The device types of the tensors it takes in this process (None: any)."""
        return self.forward_op.device_types

    def unavailable(self) -> Optional[str]:
        """Why this backend cannot run anything in this process (None: it can)."""
        return None

    def run_path(self) -> Optional[str]:
        """Where a backend's calls can take more than one path (fa4: FlashAttention-4's kernels called directly, or
        through its interface), which one they take and why, for explain(); None elsewhere."""
        return None

    def extra_reasons(self, p: Problem) -> list[str]:
        """Its rules beyond its declarations' data, which `p` breaks (asked for the device types it takes)."""
        return []

    def reasons(self, p: Problem) -> list[str]:
        """Every reason this backend cannot run `p` (empty: it can): why it cannot run at all, its forward
        declaration's and its own rules."""
        devices = self.supported_device_types()
        return self._with_own_reasons(p, devices, self.forward_op.reasons(p, devices))

    def backward_reasons(self, p: Problem, lse_gradient: bool, deterministic: bool = False) -> list[str]:
        """Every reason its backward op cannot run `p` after another backend's forward, in a call whose LSE has a
        gradient (`lse_gradient`) under deterministic algorithms (`deterministic`)."""
        devices = self.supported_device_types()
        return self._with_own_reasons(p, devices, self.backward_op.reasons(p, devices, lse_gradient, deterministic))

    def _with_own_reasons(self, p: Problem, devices, declared: list[str]) -> list[str]:
        if devices is not None and p.device.type not in devices:
            return declared  # reason enough: unavailable() may import the kernels, extra_reasons ask the device
        missing = self.unavailable()
        return ([] if missing is None else [missing]) + declared + self.extra_reasons(p)

    def why_not(self, p: Problem) -> Optional[str]:
        """None if this backend can run `p`, else its reasons, for messages and `explain()`."""
        return "; ".join(self.reasons(p)) or None

    def why_not_backward(self, lse_gradient: bool, deterministic: bool = False) -> Optional[str]:
        """None if this backend's backward can follow a forward it ran, for a call whose LSE has a gradient
        (`lse_gradient`) under deterministic algorithms (`deterministic`), else why not."""
        return "; ".join(self.backward_op.call_reasons(lse_gradient, deterministic)) or None

    def ops(self) -> tuple[Callable, Callable]:
        """(forward, backward) with the signatures above."""
        raise NotImplementedError

    def dense_ops(self) -> Optional[tuple[Callable, Callable]]:
        """Full attention of queries over keys of another length in one call, where the backend has it (the ring's
        blocks over several ranks' keys): `forward(q, k, v, scale) -> (out, lse)` and `backward(grad_out, q, k, v,
        out, lse, scale) -> (dq, dk, dv)`, tensors `[B, n, H, D]`, lengths >= 2. None: the ring cuts such blocks
        into squares of ops()."""
        return None

    def forward(self, q, k, v, p: Problem):
        """The forward op on a validated problem: returns the differentiable `(out, lse)`."""
        forward, _ = self.ops()
        return forward(q, k, v, **p.op_arguments())

    def varlen_ops(self, head_dim: int) -> Optional[tuple[Callable, Callable]]:
        """(forward, backward) ops of packed sequences (the signature's packed form: whole packs in the kernels'
        launches) at this head dim, or None where the backend runs a pack one sequence at a time."""
        return None

    def forward_varlen(self, q, k, v, p: Problem):
        """The forward of packed sequences (q `[T, Hq, D]`): `(out [T, Hq, D], lse [Hq, T])`, differentiable: the
        packed op where the backend has one (varlen_ops), else one forward per sequence, concatenated. The offsets
        are then read and checked here: validate_varlen cannot read them under torch.compile."""
        ops = self.varlen_ops(p.head_dim)
        if ops is not None:
            return ops[0](q, k, v, p.cu_seqlens, p.max_seqlen, **p.op_arguments())
        if torch.compiler.is_compiling():
            from .untraced import forward_per_sequence  # imports torch._dynamo, which eager calls never need

            return forward_per_sequence(self, q, k, v, p)
        return self._forward_per_sequence(q, k, v, p)

    def _forward_per_sequence(self, q, k, v, p: Problem):
        offsets = host_offsets(cast(torch.Tensor, p.cu_seqlens))  # a packed problem's
        check_offsets(offsets, q.shape[0], p.max_seqlen)
        outs, lses = [], []
        for start, end in zip(offsets, offsets[1:]):
            if end > start:
                out, lse = self.forward(q[None, start:end], k[None, start:end], v[None, start:end],
                                        sequence_problem(p, end - start))
                outs.append(out[0])
                lses.append(lse[0])
        if not outs:  # no token at all: empty results, still in the autograd graph of q, k and v
            out = q * 0 + (k.sum() + v.sum()) * 0
            return out, (out.sum(-1) * 0).T.to(lse_dtype(q.dtype))
        return torch.cat(outs), torch.cat(lses, dim=1)

    def append_kvcache(self, k_cache, v_cache, k, v, cp: CacheProblem) -> None:
        """Writes the new k, v `[B, Sq, Hkv, D]` into the caches in place, at rows `cache_seqlens[b] + i`."""
        if isinstance(cp.given_seqlens, torch.Tensor):  # per-batch lengths, read where they are
            for cache, new in ((k_cache, k), (v_cache, v)):
                _write_rows(cache, new, cp.given_seqlens)
        else:  # one slice of every batch element
            first = cp.given_seqlens
            k_cache[:, first:first + cp.new_tokens] = k
            v_cache[:, first:first + cp.new_tokens] = v

    def forward_kvcache(self, q, k_cache, v_cache, k, v, cp: CacheProblem):
        """Decoding (dilated_attention_with_kvcache): the new k, v written into the caches where given
        (append_kvcache), then `(out [B, Sq, Hq, D], lse [B, Hq, Sq])`. Here the new queries are the last rows of a
        causal forward over the cache prefix (the rows before them computed and dropped: O(prefix) work per call)."""
        if k is not None:
            self.append_kvcache(k_cache, v_cache, k, v, cp)
        if cp.cache_seqlens is None:
            return self._forward_kvcache_whole(q, k_cache, v_cache, cp)
        B, Sq, H, D = q.shape
        outs, lses = [], []
        for b, cached in enumerate(cp.cache_seqlens):
            length = cached + Sq
            rows = q.new_zeros((1, length, H, D))
            rows[0, cached:] = q[b]
            out, lse = self.forward(rows, k_cache[b:b + 1, :length], v_cache[b:b + 1, :length],
                                    sequence_problem(cp.problem, length))
            outs.append(out[:, cached:])
            lses.append(lse[:, :, cached:])
        return torch.cat(outs), torch.cat(lses)

    def _forward_kvcache_whole(self, q, k_cache, v_cache, cp: CacheProblem):
        """forward_kvcache with the cached lengths left on the device: one causal forward over every cache row,
        the new queries scattered to their positions (clamped to the cache) and gathered back. The rows past each
        batch element's last new token are zeroed in a copy (no key there is attended, but a NaN there would
        reach the earlier rows through a tile's 0 * NaN)."""
        B, Sq, H, D = q.shape
        Nmax = k_cache.shape[1]
        batch = torch.arange(B, device=q.device)[:, None]
        given = cast(torch.Tensor, cp.given_seqlens)  # the cached lengths left on the device: a tensor
        positions = given.to(q.device, torch.int64)[:, None] + torch.arange(Sq, device=q.device)
        positions = positions.clamp(0, Nmax - 1)  # [B, Sq]
        attended = (torch.arange(Nmax, device=q.device) <= positions[:, -1:])[:, :, None, None]
        rows = q.new_zeros((B, Nmax, H, D))
        rows[batch, positions] = q
        p = dataclasses.replace(cp.problem, batch=B, seq_len=Nmax)
        out, lse = self.forward(rows, torch.where(attended, k_cache, 0), torch.where(attended, v_cache, 0), p)
        return out[batch, positions], lse.transpose(1, 2)[batch, positions].transpose(1, 2)

    def __repr__(self) -> str:
        return f"<dilated_attn backend {self.name!r}>"


def _write_rows(cache, new, cache_seqlens):
    """cache[b, cache_seqlens[b] + i] = new[b, i], the lengths a tensor (never read back to the host): a row past
    the cache is not written. Every index is clamped into the cache, and each write to a row carries the value that
    row must get (its new row, or its old value where no new row lands on it), so duplicates agree."""
    B, Sq = new.shape[:2]
    batch = torch.arange(B, device=cache.device)[:, None]
    first = cache_seqlens.to(cache.device, torch.int64)[:, None]
    rows = (first + torch.arange(Sq, device=cache.device)).clamp(0, cache.shape[1] - 1)  # [B, Sq]
    source = rows - first  # the new row that lands on each written row
    lands = ((source >= 0) & (source < Sq))[:, :, None, None]
    cache[batch, rows] = torch.where(lands, new[batch, source.clamp(0, Sq - 1)], cache[batch, rows])
