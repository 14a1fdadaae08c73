"""The compiled extension `dilated_attn._C` (csrc/): its loading, its ops' fake kernels and autograd, and the two
backends it serves: `cpu` (csrc/cpu/, C++ kernels) and `cuda` (csrc/cuda/, hand-written fp32-FMA kernels for every
NVIDIA GPU from Pascal up).

Loading the library registers `torch.ops.dilated_attn.forward` / `.backward` (csrc/registration.cpp); this module
adds fake (meta) kernels for torch.compile and the autograd formula, so the ops trace and differentiate like
built-in ones.
"""

from __future__ import annotations

import os
from typing import Optional

import torch

from . import decoding
from .autograd import register_attention_autograd
from .base import Backend, ForwardOp, device_capability
from .signature import fake_backward, fake_forward

__all__ = ["accumulate", "build_info", "has_kernel", "LOAD_ERROR", "CPU", "CUDA"]

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _explain_load_failure(exc: ImportError) -> str:
    built = any(name.startswith("_C.") and name.endswith((".so", ".pyd")) for name in os.listdir(_PACKAGE))
    if not built:
        return (f"dilated_attn._C is not built: the dilated_attn imported from {_PACKAGE} has no compiled extension "
                f"(a source tree, not an installed package). Build and install it with `pip install "
                f"--no-build-isolation .` in the repository root")
    return (f"dilated_attn._C in {_PACKAGE} did not load ({type(exc).__name__}: {exc}); it was probably built "
            f"against another torch than {torch.__version__}: reinstall with `pip install --no-build-isolation .`")


try:
    from .. import _C  # loading the library registers the ops

    LOAD_ERROR: Optional[str] = None
except ImportError as _exc:
    _C = None
    LOAD_ERROR = _explain_load_failure(_exc)


def build_info() -> dict:
    """What the compiled extension was built with (torch, CUDA version and targets, the CPU kernels' instruction
    set), or why it could not be loaded."""
    if _C is None:
        return {"loaded": False, "error": LOAD_ERROR}
    return {"loaded": True, **_C.build_info()}


# Which devices the forward op has kernels for: fixed once the library is loaded, and read once because
# torch.compile cannot trace the dispatcher query.
_KERNELS = {
    device: _C is not None and torch._C._dispatch_has_kernel_for_dispatch_key("dilated_attn::forward", key)
    for device, key in (("cpu", "CPU"), ("cuda", "CUDA"))
}


def has_kernel(device_type: str) -> bool:
    """True if the compiled forward op has a kernel for `device_type` ("cpu", "cuda")."""
    return _KERNELS.get(device_type, False)


def accumulate(targets, parts, store: bool = False) -> None:
    """targets[i] += parts[i] (= with `store`): `[b, h, s, d]` views, the targets of one dtype with unit-stride rows,
    the parts of theirs or float16/bfloat16 parts of float32 targets. On a GPU, the extension's addition kernel: one
    launch for the pairs of one shape (up to three; dq apart from dk and dv with grouped-query heads), 16-byte loads
    of both dtypes, where PyTorch adds a float32 sum and a 16-bit part element by element; elsewhere PyTorch."""
    if (targets[0].is_cuda and has_kernel("cuda") and parts[0].dtype in (torch.float16, torch.bfloat16, torch.float32)
            and targets[0].dtype in (parts[0].dtype, torch.float32) and all(t.stride(-1) == 1 for t in targets)):
        shapes = {}
        for target, part in zip(targets, parts):
            shapes.setdefault(tuple(target.shape), []).append((target, part))
        for pairs in shapes.values():
            torch.ops.dilated_attn.accumulate([t for t, _ in pairs], [p for _, p in pairs], store)
        return
    for target, part in zip(targets, parts):
        target.copy_(part) if store else target.add_(part)


if _C is not None:

    torch.library.register_fake("dilated_attn::forward")(fake_forward)
    torch.library.register_fake("dilated_attn::backward")(fake_backward)
    torch.library.register_fake("dilated_attn::decode")(lambda *args: None)  # writes only its given tensors
    register_attention_autograd("dilated_attn::forward", "backward")


class CompiledBackend(Backend):
    """The ops of `dilated_attn._C` on one device type."""

    def unavailable(self) -> Optional[str]:
        device = self.forward_op.device_types[0]
        if has_kernel(device):
            return None
        if LOAD_ERROR is not None:
            return f"the compiled extension dilated_attn._C is not loaded ({LOAD_ERROR})"
        return f"dilated_attn._C was built without {device.upper()} kernels"

    def ops(self):
        return torch.ops.dilated_attn.forward, torch.ops.dilated_attn.backward


class CpuBackend(CompiledBackend):
    """Blocked online-softmax C++ kernels (csrc/cpu/), AVX2+FMA where the CPU has it."""

    name = "cpu"
    forward_op = ForwardOp(device_types=("cpu",), dtypes=(torch.float16, torch.bfloat16, torch.float32, torch.float64),
                           varlen="per_sequence")  # a CPU call per sequence costs microseconds beside its work
    backward_op = forward_op.backward()


def tile_table_refusal(requested: str, capability: tuple[int, int], pascal_on_newer: bool) -> Optional[str]:
    """Why the tile table `requested` by hand (DILATED_ATTN_CUDA_TILES: "pascal", "gp100" or "volta";
    csrc/cuda/launch.h) cannot run on a GPU of compute `capability` in this build, or None. Each architecture's code
    holds its own tables, and newer GPUs' code Pascal's too only in a build with DILATED_ATTN_PASCAL_PROXY=1
    (`pascal_on_newer`). The launcher refuses the same (csrc/cuda/attention_cuda.cpp: tile_table()); the backend
    refuses it first, so that a call raises this ValueError and explain() says it. Other values are the launcher's
    to refuse."""
    if requested not in ("pascal", "gp100", "volta"):
        return None
    wants_pascal, is_pascal = requested != "volta", capability[0] < 7
    if wants_pascal == is_pascal or (wants_pascal and pascal_on_newer):
        return None
    return (f"DILATED_ATTN_CUDA_TILES={requested}: this build holds no code of that tile table for compute capability "
            f"{capability[0]}.x (each architecture's code holds its own table; Pascal's runs on newer GPUs in a build "
            f"made with DILATED_ATTN_PASCAL_PROXY=1)")


class CudaBackend(CompiledBackend):
    """Hand-written CUDA kernels (csrc/cuda/): fp32 FMA, no tensor cores, so they run from Pascal up."""

    name = "cuda"
    forward_op = ForwardOp(device_types=("cuda",), dtypes=(torch.float16, torch.bfloat16, torch.float32),
                           max_head_dim=256,  # csrc/cuda/launch.h: kMaxHeadDim
                           min_capability=(6, 0), capability_rule="the CUDA kernels need Pascal or newer")
    backward_op = forward_op.backward()

    def extra_reasons(self, p) -> list[str]:
        requested = os.environ.get("DILATED_ATTN_CUDA_TILES", "")
        refusal = requested and tile_table_refusal(requested, device_capability(p.device),
                                                   bool(build_info().get("pascal_tiles_on_newer_gpus")))
        return [refusal] if refusal else []

    def forward_kvcache(self, q, k_cache, v_cache, k, v, cp):
        # the decode kernel (csrc/cuda/decode.cu) where it takes the call, in eager mode; a traced call
        # (torch.compile: its checks read the tensors' addresses) or a cache whose rows it cannot read goes to the
        # Triton decode kernel where that can run, and other calls recompute each new token's prefix
        if decoding.cuda_decode_refusal(cp.problem) is None:
            if not torch.compiler.is_compiling():
                result = decoding.cuda_decode(q, k_cache, v_cache, k, v, cp)
                if result is not None:
                    return result
            from .triton import TRITON

            if TRITON.why_not(cp.problem) is None:
                return TRITON.forward_kvcache(q, k_cache, v_cache, k, v, cp)
        return super().forward_kvcache(q, k_cache, v_cache, k, v, cp)


CPU = CpuBackend()
CUDA = CudaBackend()
