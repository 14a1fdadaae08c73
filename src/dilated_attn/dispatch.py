"""Which backend runs: the ranking of the backends (dilated_attn.backends) and explain().

`decide()` turns the requested backend into the one that runs:

* an explicit backend runs if it can, else dilated_attention raises ValueError listing every verdict;
* "auto" with the environment variable DILATED_ATTN_BACKEND set to a backend name behaves as that name;
* otherwise "auto" runs the first backend of `auto_preference(problem)` that can run, warning once per distinct
  reason when it had to pass over a preference that applies to the input's device, and once when it runs the
  reference on a GPU (see reference_preferred).

What each backend supports is the backend's own business: its forward and backward ops' declarations
(backends.base.ForwardOp, BackwardOp) and its reasons (`Backend.reasons`); this module only ranks them, and picks
at forward time the backward that follows a forward. `explain()` (dilated_attn.explain) returns the decision, both
ops, without running attention.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from . import backends
from .backends import cudnn as cudnn_backend
from .backends import fa4 as fa4_backend
from .backends import triton as triton_backend
from .backends.autograd import set_lse_gradient_chooser
from .backends.base import OnceLoader, device_capability
from .backends.reference import memory_bytes as reference_memory_bytes
from .compile_hints import trace_constant, warn_once
from .spec import BACKEND_NAMES, Problem, dtype_name, validate

__all__ = ["auto_preference", "backward_backend", "decide", "explain", "lse_gradient_backend",
           "lse_gradient_backward_op", "select", "Decision", "ENV_VAR"]

ENV_VAR = "DILATED_ATTN_BACKEND"

# Preferences of "auto" by device type, best first; every list holds the reference, which runs anything.
AUTO_ORDER = {"cpu": ("cpu", "reference"), "cuda": ("triton", "cuda", "reference")}

# auto runs the reference on a GPU only where its memory estimate is at most this share of the GPU's memory.
REFERENCE_MEMORY_SHARE = 0.25

# Warned once when auto runs the reference on a GPU: its memory is not O(N).
REFERENCE_ON_GPU_WARNING = (
    "dilated_attn: backend='auto' runs the reference for float32 inputs with head_dim > 64 on this GPU (faster "
    "there than the kernels; see dilated_attn.explain). It keeps about four score-sized tensors per branch for "
    "the backward; backend='cuda' needs O(N) memory."
)


@trace_constant
def _triton_float32_is_ieee(device: torch.device, head_dim: int) -> bool:
    # torch's TF32 setting and the device's properties: constants for a traced graph
    return triton_backend.load_error() is None and triton_backend.float32_precision(device, head_dim) == "ieee"


# auto prefers the cudnn backend from this compute capability on (Hopper) and from this many elements of q on, or
# from CUDNN_MIN_ELEMENTS_WITH_BACKWARD for a call that records its backward: the smallest sizes at which it measured
# faster than triton on an H100 (bf16, H=16, longnet4, N=1024..32768 at D=64 and 128; benchmarks/README.md, "The auto
# rule"). Smaller problems stay with triton: every backend is bound by the host there (cudnn by one cuDNN call per
# branch and offset group or segment), and which is fastest varies.
CUDNN_PREFERRED_FROM = (9, 0)
CUDNN_MIN_ELEMENTS = 1 << 22
CUDNN_MIN_ELEMENTS_WITH_BACKWARD = 1 << 21


@trace_constant
def _cudnn_preferred_on(device: torch.device) -> bool:
    return device_capability(device) >= CUDNN_PREFERRED_FROM


@trace_constant
def _gpu_memory_bytes(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).total_memory


def _float32_with_ieee_products(p: Problem) -> bool:
    """float32 on a GPU where Triton would multiply with IEEE fp32 FMAs (see triton.float32_precision)."""
    return p.device.type == "cuda" and p.dtype == torch.float32 and _triton_float32_is_ieee(p.device, p.head_dim)


def reference_preferred(p: Problem) -> Optional[str]:
    """Why auto prefers the reference for `p` on a GPU (None where it does not): float32 with head_dim > 64
    where Triton would multiply with IEEE fp32 FMAs, while the reference's memory estimate fits the share."""
    if not (p.head_dim > 64 and _float32_with_ieee_products(p)):
        return None
    need, total = reference_memory_bytes(p), _gpu_memory_bytes(p.device)
    if need > REFERENCE_MEMORY_SHARE * total:
        return None
    return (f"float32 with head_dim {p.head_dim} > 64 and IEEE products in Triton: cuBLAS makes the reference "
            f"fastest, and its estimated {need / 2**30:.1f} GiB for forward and backward is at most "
            f"{REFERENCE_MEMORY_SHARE:.0%} of the GPU's {total / 2**30:.0f} GiB")


def auto_preference(p: Problem) -> tuple[str, ...]:
    """THE auto rule: the backends "auto" tries for `p`, best first; the first that can run runs.

    CUDA tensors: triton, else the hand-written cuda kernels, else the reference. CPU tensors: the compiled cpu
    kernels, else the reference. Other devices: the reference. One measured exception, for float32 where Triton
    would multiply with IEEE fp32 FMAs (TF32 not allowed, and tf32x3 not available: see
    triton.float32_precision): there the cuda kernels come first, and at head_dim > 64 the reference before them
    while its memory fits (reference_preferred). The evidence is in benchmarks/README.md, "The auto rule".
    Only backends that apply to the device are listed, so passing one over always has a reason worth a
    warning. Further measured thresholds belong here, as conditions on `p` that reorder the list.

    A KV-cache call (`p.decodes`) takes the device's order as it is: triton first on a GPU, then cuda, the backends
    with a decode kernel (cuda's from Ampere on, 16-bit, head_dim 64 or 128: backends/decoding.py; it measured even
    with triton's, benchmarks/README.md, "Decoding"); the others compute each new token as the last row of a forward
    over its whole prefix.

    The fa4 backend, where flash-attn-4 is installed, comes before cudnn where fa4_preferred says so, packed
    sequences included (a few varlen calls per branch for the whole pack; cudnn runs a pack one sequence at a
    time, so packs without fa4 go to triton's kernels, which take the whole pack). The cudnn
    backend comes first on GPUs of compute capability CUDNN_PREFERRED_FROM and newer, for q of at least
    CUDNN_MIN_ELEMENTS elements (CUDNN_MIN_ELEMENTS_WITH_BACKWARD where the call records its backward), where it
    can run (16-bit, head_dim a multiple of 8 up to 128): there it measured faster than triton
    (benchmarks/README.md, "The auto rule"). It is listed only there, so other inputs go to triton without a
    warning.
    """
    if p.decodes:
        return AUTO_ORDER.get(p.device.type, ("reference",))
    if _float32_with_ieee_products(p):
        return ("reference", "cuda", "triton") if reference_preferred(p) else ("cuda", "triton", "reference")
    order = AUTO_ORDER.get(p.device.type, ("reference",))
    least = CUDNN_MIN_ELEMENTS_WITH_BACKWARD if p.records_backward else CUDNN_MIN_ELEMENTS
    if (p.device.type == "cuda" and p.batch * p.seq_len * p.num_heads * p.head_dim >= least
            and _cudnn_preferred_on(p.device)):
        if not p.varlen and cudnn_backend.CUDNN.why_not(p) is None:
            order = ("cudnn", *order)
        if fa4_preferred(p):
            order = ("fa4", *order)
    return order


def fa4_preferred(p: Problem) -> bool:
    """Where flash-attn-4 is installed and can run `p` (a problem large enough for cudnn), auto prefers it: LongNet at
    N = 65536, causal or not, Hkv = 16, 4 and 1, with its kernels called directly (backends/fa4/direct.py), ran
    forward+backward 1.07-1.20x cudnn's speed and the forward 1.03-1.16x in every run on an H100 and on H200s
    (benchmarks/README.md, "Direct kernel calls")."""
    return fa4_backend.FA4.why_not(p) is None


@trace_constant
def _deterministic_algorithms() -> bool:
    return torch.are_deterministic_algorithms_enabled()


def lse_gradient_backend(p: Problem, deterministic: Optional[bool] = None) -> str:
    """The backend whose backward runs for `p` in place of the forward backend's where that one cannot (an LSE
    gradient it does not take, or deterministic algorithms its backward does not honour): the first of auto's
    preference (then of every backend) whose backward op can run `p` with an LSE gradient and, under
    deterministic algorithms (`deterministic`, default torch's setting), gives the same bits."""
    det = _deterministic_algorithms() if deterministic is None else deterministic
    for name in (*auto_preference(p), *backends.REGISTRY):
        if not backends.REGISTRY[name].backward_reasons(p, lse_gradient=True, deterministic=det):
            return name
    return "reference"  # runs anything


def backward_backend(p: Problem, forward: str, lse_gradient: bool) -> tuple[str, Optional[str]]:
    """(the backend whose backward runs after `forward`'s forward of `p`, why that is not `forward` or None): the
    forward's own, unless its backward cannot take an LSE gradient that the call has (autograd asks with
    `lse_gradient` = whether the LSE's gradient is not None) or cannot give the same bits under deterministic
    algorithms."""
    why = backends.get(forward).why_not_backward(lse_gradient, _deterministic_algorithms())
    return (forward, None) if why is None else (lse_gradient_backend(p), why)


_LSE_GRADIENT_BACKWARDS: dict = {}  # a forward op's shapes and configuration -> lse_gradient_backend's choice


def lse_gradient_backward_op(q, k, v, segment_lengths, dilation_rates, split_heads, causal, scale, head_start=0,
                             global_heads=0):
    """For a forward op's inputs, the backward op of the backend lse_gradient_backend names: what its autograd runs
    where the forward backend's backward cannot run the call (an LSE gradient, deterministic algorithms). Chosen at
    forward time (installed in backends.autograd, which stores it on the context), cached per shape and
    configuration."""
    deterministic = _deterministic_algorithms()
    key = (tuple(q.shape), tuple(k.shape), q.dtype, q.device, tuple(segment_lengths), tuple(dilation_rates),
           split_heads, causal, scale, head_start, global_heads, deterministic)
    concrete = all(isinstance(n, int) for n in key[0] + key[1])  # not symbolic sizes of a traced graph
    name = _LSE_GRADIENT_BACKWARDS.get(key) if concrete else None
    if name is None:
        # traced with a dynamic length, a branch it clips holds that symbolic length: specialized here (a guard)
        segment_lengths, dilation_rates = ([int(x) for x in xs] for xs in (segment_lengths, dilation_rates))
        p = validate(q, k, v, segment_lengths, dilation_rates, causal=causal, scale=scale,
                     head_groups="split" if split_heads else "all")
        if global_heads:
            p = p.with_heads(head_start, global_heads)
        name = lse_gradient_backend(p, deterministic)
        if concrete:
            _LSE_GRADIENT_BACKWARDS[key] = name
    return backends.get(name).ops()[1]


set_lse_gradient_chooser(lse_gradient_backward_op)


def state() -> tuple:
    """What decide() reads besides the problem and the backend argument, as far as it can change within a process:
    the environment variables, torch's TF32 and determinism settings, and which backends have loaded. A decision
    kept across calls (ring_attention's plans) holds while this stays the same."""
    return (os.environ.get(ENV_VAR), os.environ.get("TRITON_INTERPRET"), os.environ.get("DILATED_ATTN_CUDA_TILES"),
            torch.backends.cuda.matmul.allow_tf32, torch.are_deterministic_algorithms_enabled(),
            OnceLoader.finished)


@trace_constant
def _env_backend() -> str:
    # read on every eager call; under torch.compile once, when traced (see dilated_attn.compile_hints)
    return os.environ.get(ENV_VAR, "")


def _verdict_text(why: Optional[str]) -> str:
    return "can run" if why is None else why


@dataclass(frozen=True)
class Decision:
    """Which backends' forward and backward ops dilated_attention runs for an input, and why (returned by
    dilated_attn.explain)."""

    backend: Optional[str]  # the backend whose forward runs; None when the requested one cannot (see `error`)
    decided_by: str  # the argument, the environment variable or the auto rule that decided
    verdicts: dict  # name -> None (can run) or why it cannot, for every backend
    fallback: Optional[str] = None  # auto had to pass over preferences for these reasons (warned once)
    note: Optional[str] = None  # a warning select() gives once (auto running the reference on a GPU)
    error: Optional[str] = None  # the ValueError dilated_attention raises when `backend` is None
    problem: Optional[Problem] = None
    # The backward's backend where the LSE has a gradient, and why it is not `backend` (None: `backend`'s own).
    lse_gradient_backward: Optional[str] = None
    lse_gradient_rule: Optional[str] = None
    # The backward's backend where only the output has a gradient, where it is not `backend`'s, and why
    # (deterministic algorithms that `backend`'s backward does not honour).
    other_backward: Optional[str] = None
    backward_rule: Optional[str] = None
    path: Optional[str] = None  # which path `backend`'s calls take, where it has more than one (Backend.run_path)

    @property
    def backward(self) -> Optional[str]:
        """The backend whose backward runs where only the output has a gradient (the usual training step)."""
        return self.other_backward or self.backend

    def __str__(self) -> str:
        lines = [f"dilated_attn backend: {self.backend or 'none (dilated_attention raises ValueError)'}"]
        lines.append(f"  decided by: {self.decided_by}")
        if self.backend is not None:
            line = f"  forward: {self.backend}, backward: {self.backward}"
            if self.backward_rule:
                line += f" ({self.backward_rule})"
            if self.lse_gradient_rule:
                line += f"; where the LSE has a gradient: {self.lse_gradient_backward} ({self.lse_gradient_rule})"
            elif self.lse_gradient_backward is not None:
                line += " (also where the LSE has a gradient)"
            lines.append(line)
        if self.path:
            lines.append(f"  path: {self.path}")
        if self.fallback:
            lines.append(f"  fallback: {self.fallback}")
        if self.note:
            lines.append(f"  note: {self.note}")
        if self.error:
            lines.append(f"  error: {self.error}")
        p = self.problem
        if p is not None:
            branches = ", ".join(f"({w}, {r})" for w, r in zip(p.segment_lengths, p.dilation_rates))
            lines.append(
                f"  input: B={p.batch} N={p.seq_len} Hq={p.num_heads} Hkv={p.num_kv_heads} D={p.head_dim} "
                f"{dtype_name(p.dtype)} on {p.device}; branches {branches}; causal={p.causal}, "
                f"head_groups={p.head_groups!r}, records_backward={p.records_backward}"
            )
            if p.cu_seqlens is not None:
                lines.append(f"  packed: {p.cu_seqlens.numel() - 1} sequences in N={p.seq_len} rows, the longest "
                             f"at most {p.max_seqlen}")
        width = max(len(name) for name in self.verdicts)
        lines.append(f"  {'backend':<{width}}  verdict")
        for name, why in self.verdicts.items():
            mark = "  <- runs" if name == self.backend else ""
            lines.append(f"  {name:<{width}}  {_verdict_text(why)}{mark}")
        return "\n".join(lines)


def decide(p: Problem, backend: str, every_verdict: bool = True) -> Decision:
    """Resolve `backend` ("auto" or a backend name, already validated) for `p`. Raises only for an invalid
    DILATED_ATTN_BACKEND; an explicit backend that cannot run gives a Decision with `error` set. Without
    `every_verdict` (a call, not explain()), an explicit backend that can run is the only one asked: the others
    are not imported or checked."""
    label, decided_by = f"backend={backend!r}", "the backend argument"
    if backend == "auto":
        env = _env_backend()
        if env not in ("", "auto"):
            if env not in BACKEND_NAMES:
                raise ValueError(
                    f"environment variable {ENV_VAR} must be unset or one of {BACKEND_NAMES}, got {env!r}"
                )
            backend, label = env, f"{ENV_VAR}={env!r}"
            decided_by = f"the environment variable {ENV_VAR} (the backend argument is 'auto')"
    if backend != "auto":
        found = {backend: backends.get(backend).why_not(p)}
        if every_verdict or found[backend] is not None:
            found = backends.verdicts(p)
        if found[backend] is None:
            return Decision(backend, f"{label}: {decided_by}", found, problem=p,
                            **_backward_fields(p, backend, every_verdict))
        usable = ", ".join(n for n, why in found.items() if why is None)
        listing = "; ".join(f"{n}: {_verdict_text(why)}" for n, why in found.items())
        error = f"{label} cannot run this input: {found[backend]}. Backends that can: {usable} ({listing})"
        return Decision(None, f"{label}: {decided_by}", found, error=error, problem=p)
    found = backends.verdicts(p)
    order = auto_preference(p)
    rule = f"the auto rule for {p.device.type} tensors: {' > '.join(order)}, the first that can run"
    why_reference = reference_preferred(p) if order[0] == "reference" else None
    if why_reference is not None:
        rule += f" ({why_reference})"
    passed = []
    for name in order:
        if found[name] is None:
            break
        passed.append(f"{name} cannot ({found[name]})")
    else:  # unreachable while every preference list holds the reference
        name = "reference"
    fallback = f"backend='auto' runs {name}: " + "; ".join(passed) if passed else None
    note = REFERENCE_ON_GPU_WARNING if name == "reference" and why_reference is not None else None
    return Decision(name, rule, found, fallback=fallback, note=note, problem=p,
                    **_backward_fields(p, name, every_verdict))


def _backward_fields(p: Problem, name: str, wanted: bool) -> dict:
    """explain()'s report of the backwards that run after `name`'s forward, with and without an LSE gradient (a
    call's autograd chooses its own at forward time, cached: lse_gradient_backward_op)."""
    if not wanted:
        return {}
    other, rule = backward_backend(p, name, lse_gradient=False)
    backward, why = backward_backend(p, name, lse_gradient=True)
    return dict(other_backward=other if rule else None, backward_rule=rule, lse_gradient_backward=backward,
                lse_gradient_rule=why, path=backends.get(name).run_path())


def select(p: Problem, backend: str) -> backends.Backend:
    """The backend that runs `p`: raises ValueError when the requested one cannot, warns once on a fallback."""
    first = _first_choice(p, backend)
    if first is not None:
        return first
    d = decide(p, backend, every_verdict=False)
    if d.backend is None:
        raise ValueError(d.error)
    if d.fallback:
        warn_once(f"dilated_attn: {d.fallback}", stacklevel=3)  # -> select -> dilated_attention -> caller
    if d.note:
        warn_once(d.note, stacklevel=3)
    return backends.REGISTRY[d.backend]


def _first_choice(p: Problem, backend: str) -> Optional[backends.Backend]:
    """decide()'s backend where that is the one requested, or auto's first preference other than the reference, and it
    can run: then only it is asked (decide asks every backend, for its record, which a call does not need: a decoding
    step's host time). None where decide has more to say: a fallback, a note, an error, the environment variable."""
    if backend == "auto":
        if _env_backend() not in ("", "auto"):
            return None
        backend = auto_preference(p)[0]
        if backend == "reference":
            return None
    chosen = backends.get(backend)
    return chosen if chosen.why_not(p) is None else None


_DILATED_ATTENTION_KEYWORDS = frozenset(("causal", "scale", "head_groups", "return_lse", "backend"))


def explain(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segment_lengths: Sequence[int],
            dilation_rates: Sequence[int], **kwargs) -> Decision:
    """Which backend `dilated_attention(q, k, v, segment_lengths, dilation_rates, **kwargs)` would run, every
    backend's verdict, and what decided; `print()` it for a table. Validates like dilated_attention (and
    raises the same errors for invalid arguments), but does not run attention."""
    unknown = sorted(set(kwargs) - _DILATED_ATTENTION_KEYWORDS)
    if unknown:
        raise TypeError(f"explain() got unexpected keyword arguments {unknown}: it takes dilated_attention's "
                        f"({', '.join(sorted(_DILATED_ATTENTION_KEYWORDS))})")
    p = validate(q, k, v, segment_lengths, dilation_rates, **kwargs)
    return decide(p, kwargs.get("backend", "auto"))
