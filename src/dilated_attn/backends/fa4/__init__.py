"""The `fa4` backend: FlashAttention-4 (the optional `flash-attn-4` package, NVIDIA's CuTe DSL kernels for Hopper
and Blackwell) on strided views of each branch's members, planned like the cudnn backend (the same `Call`s and
`Schedule`s, backends/views.py), each call's result merged into the running one by the same CUDA kernel.

    ops.py    the `torch.library.custom_op` registrations (`dilated_attn::fa4_forward`, `fa4_backward`, their
              `fa4_varlen_` forms for packed sequences) and the dense ops the ring's joined blocks run
    packs.py  the varlen calls of a pack: each branch's runs of members as the sequences of strided views
    direct.py FlashAttention-4's kernels called without its Python interface (each shape's program, watched once)
    stored.py those programs kept on disk, run by a new process without importing FlashAttention-4

Installed with `pip install --no-build-isolation .[fa4]`; imported only when a call needs it (the import takes 7-9 s;
a verdict or explain() only looks for the package, and a call whose shape has a stored program needs none). Its
kernels are compiled on the first call of each variant (1-3 s each) and cached on disk in `cache_dir()` with the
programs, so a second process starts warm; a training run pays the first compiles in its first step, or in
`dilated-attn warmup --backend fa4` at its shapes before training (docs/backends.md, "The fa4 backend"). Unlike
cuDNN's, its backward takes the LSE's gradient, so every call's backward is its own.
"""

from __future__ import annotations

import os
from typing import Optional

import torch

from ...compile_hints import trace_constant, warn_once
from ...spec import Problem
from ..base import Backend, ForwardOp, OnceLoader, device_capability

__all__ = ["FA4", "cache_dir", "load_error", "use_interface"]

# FlashAttention-4's varlen backward (4.0.0b36) gave wrong gradients at head_dim 16 on an H200, exact ones at multiples
# of 32 (tests/test_fa4.py, test_gpu_varlen_ops): packs of other head dims run one sequence at a time
VARLEN_HEAD_DIM_STEP = 32

CACHE_ENV = "DILATED_ATTN_FA4_CACHE"  # where the compiled kernels live (default: ~/.cache/dilated_attn/fa4)

def cache_dir() -> str:
    """The directory of FlashAttention-4's compiled kernels: DILATED_ATTN_FA4_CACHE, else the user cache's
    dilated_attn/fa4 (XDG_CACHE_HOME or ~/.cache)."""
    given = os.environ.get(CACHE_ENV)
    if given:
        return given
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "dilated_attn", "fa4")


@trace_constant
def load_error() -> Optional[str]:
    """Import flash-attn-4 and register the ops on the first call; None, or why they cannot be loaded
    (thread-safe: base.OnceLoader)."""
    return _loader()


def _load() -> Optional[str]:
    if not torch.cuda.is_available():
        return "no CUDA device"
    # flash-attn-4 reads its cache settings when imported: ours unless the caller set its own
    os.environ.setdefault("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "1")
    os.environ.setdefault("FLASH_ATTENTION_CUTE_DSL_CACHE_DIR", cache_dir())
    from . import direct, ops, stored  # registers the ops

    interface = direct.Deferred(_import_interface)
    if not (direct.ENABLED and direct.path()[0] and stored.has_programs()):
        # nothing stored to run without it: imported now, so that a broken install is found before the first call
        try:
            interface.get()
        except RuntimeError as exc:
            return str(exc)
    ops.fa = interface  # else imported when a call's shape has no stored program (stored.py)
    return None


def _import_interface():
    """flash_attn.cute.interface, imported and checked (direct.check_interface); RuntimeError saying why not."""
    try:
        from flash_attn.cute import interface
    except ImportError as exc:
        raise RuntimeError(f"flash-attn-4 is not installed ({exc}); `pip install --no-build-isolation .[fa4]` "
                           f"installs it (Hopper and Blackwell GPUs, CUDA 12.9 or newer)") from exc
    except Exception as exc:
        raise RuntimeError(f"flash-attn-4 did not load ({type(exc).__name__}: {exc})") from exc
    from . import direct

    refused = direct.check_interface(interface)
    if refused is not None:
        raise RuntimeError(refused)
    _say_path(interface)
    return interface


def use_interface(interface) -> Optional[str]:
    """Take `interface` as FlashAttention-4's (the loaded package's `flash_attn.cute.interface`, or a test's
    stand-in) and register the ops: None, or why the fa4 backend cannot call it (direct.check_interface). Where its
    calls cannot go directly to the kernels, says once which path they take and why (direct.path)."""
    from . import direct, ops  # registers the ops

    refused = direct.check_interface(interface)
    if refused is not None:
        return refused
    ops.fa = interface
    _say_path(interface)
    return None


def _say_path(interface) -> None:
    from . import direct

    direct_calls, how = direct.path(interface)
    if not direct_calls:
        warn_once(f"dilated_attn: the fa4 backend runs {how}")


_loader = OnceLoader(_load)


@trace_constant
def _installed() -> bool:
    # no import (where the package is absent, why_not says so without trying to import it), and asked once: the
    # search walks sys.path, about 0.1 ms, which every auto call on a Hopper GPU would otherwise pay
    global _found
    if _found is None:
        import importlib.util

        _found = importlib.util.find_spec("flash_attn") is not None
    return _found


_found: Optional[bool] = None


class Fa4Backend(Backend):
    name = "fa4"
    forward_op = ForwardOp(
        device_types=("cuda",), dtypes=(torch.float16, torch.bfloat16),
        max_head_dim=128,  # Hopper takes up to 256, Blackwell 128 (and 192/256 shapes this package does not make)
        min_capability=(9, 0), capability_rule="FlashAttention-4 has Hopper (sm90) and Blackwell (sm100) kernels",
        varlen="kernels")  # a few varlen calls per branch for the whole pack (packs.py; head dims: VARLEN_HEAD_DIM_STEP)
    backward_op = forward_op.backward()  # takes the LSE's gradient; deterministic under deterministic algorithms

    def unavailable(self) -> Optional[str]:
        """Whether flash-attn-4 is installed, without importing it (seconds) before the backend first runs: a
        verdict, explain() or another backend's call costs no import. A broken install says why at that run."""
        if not _installed():
            return "flash-attn-4 is not installed (`pip install --no-build-isolation .[fa4]`)"
        why = _loader.error
        return None if why is None else f"FlashAttention-4 is not available ({why})"

    def extra_reasons(self, p: Problem) -> list[str]:
        found = []
        major = device_capability(p.device)[0]
        if major > 11:  # older GPUs break min_capability
            found.append(f"compute capability {major}.x: FlashAttention-4's kernels are for 9.x (Hopper) and 10.x/11.x")
        if p.head_dim % 8:
            found.append(f"head_dim {p.head_dim} is not a multiple of 8 (16-byte rows)")
        return found

    def ops(self):
        if _installed():
            load_error()  # imports flash-attn-4 on the backend's first run
        why = self.unavailable()
        if why is not None:
            raise RuntimeError(f"dilated_attn: the fa4 backend cannot run: {why}")
        return torch.ops.dilated_attn.fa4_forward, torch.ops.dilated_attn.fa4_backward

    def run_path(self) -> Optional[str]:
        """Which path its calls take (direct.path): FlashAttention-4's kernels called directly, or its interface and
        why; asked of the loaded package where it has loaded, else of the installed one's version."""
        if not _installed():
            return None
        from . import direct

        interface = None
        if _loader.done and _loader.error is None:
            from . import ops

            interface = ops.fa
        return direct.path(interface)[1]

    def varlen_ops(self, head_dim):
        self.ops()
        if head_dim % VARLEN_HEAD_DIM_STEP:
            return None  # one sequence at a time
        return torch.ops.dilated_attn.fa4_varlen_forward, torch.ops.dilated_attn.fa4_varlen_backward

    def dense_ops(self):
        self.ops()  # loaded, or why not
        from .ops import dense_backward, dense_forward

        return dense_forward, dense_backward


FA4 = Fa4Backend()
