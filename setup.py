"""Builds dilated_attn._C: a CPU-only extension, or CPU + CUDA where torch has CUDA and a toolkit exists.

Install with `pip install --no-build-isolation .` after torch: build isolation would fetch a fresh torch.
Honours MAX_JOBS (parallel compile jobs), TORCH_CUDA_ARCH_LIST (GPU targets),
DILATED_ATTN_FORCE_CPU=1 (skip the CUDA part even where it could be built) and DILATED_ATTN_PASCAL_PROXY=1
(Pascal's tile table in the sm_70+ code too, to run and test it on a newer GPU).
"""

import glob
import os
import sys

from setuptools import find_packages, setup

try:
    import torch
    from torch.utils import cpp_extension
except ImportError:  # pragma: no cover
    sys.exit(
        "dilated_attn builds against the installed torch, and torch cannot be imported here. With a plain\n"
        "`pip install .` pip builds in an isolated environment that does not see your torch (and would fetch a\n"
        "fresh, multi-GB CUDA one): install torch first if it is not installed, then run\n"
        "    pip install --no-build-isolation ."
    )

ROOT = os.path.dirname(os.path.abspath(__file__))


def _sources(pattern):
    return sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, pattern)))


def _with_cuda():
    if os.environ.get("DILATED_ATTN_FORCE_CPU", "0") == "1":
        return False, "DILATED_ATTN_FORCE_CPU=1"
    if torch.version.cuda is None:
        return False, "torch was built without CUDA"
    if cpp_extension.CUDA_HOME is None:
        return False, "no CUDA toolkit found (set CUDA_HOME)"
    return True, f"CUDA {torch.version.cuda}"


def extension():
    with_cuda, why = _with_cuda()
    sources = ["csrc/registration.cpp", *_sources("csrc/cpu/*.cpp")]
    cxx = ["-O3", "-fvisibility=hidden", "-Wno-psabi"]
    macros = []
    if not with_cuda:
        print(f"dilated_attn: building the CPU-only extension ({why})", flush=True)
        return cpp_extension.CppExtension(
            "dilated_attn._C", sources, define_macros=macros, extra_compile_args={"cxx": cxx}
        )
    archs = os.environ.get("TORCH_CUDA_ARCH_LIST", "")
    print(f"dilated_attn: building CPU + CUDA ({why}; TORCH_CUDA_ARCH_LIST={archs or 'torch default'})", flush=True)
    macros += [
        ("DILATED_ATTN_WITH_CUDA", None),
        ("DILATED_ATTN_CUDA_VERSION", f'"{torch.version.cuda}"'),
        ("DILATED_ATTN_CUDA_ARCHS", f'"{archs or "torch default"}"'),
    ]
    if os.environ.get("DILATED_ATTN_PASCAL_PROXY") == "1":
        # Pascal's tile table in the sm_70+ code too, so that a newer GPU can run and test it
        # (DILATED_ATTN_CUDA_TILES=pascal); a user's build holds each architecture's own table only.
        macros.append(("DILATED_ATTN_PASCAL_PROXY", "1"))
    nvcc = ["-O3", "--use_fast_math", "-lineinfo", "--expt-relaxed-constexpr", "-std=c++17"]
    return cpp_extension.CUDAExtension(
        "dilated_attn._C",
        sources + _sources("csrc/cuda/*.cu") + _sources("csrc/cuda/*.cpp"),
        define_macros=macros,
        extra_compile_args={"cxx": cxx, "nvcc": nvcc},
    )


setup(
    # src/ layout: from the repository root, `python -m pytest` and `python -m dilated_attn` import the
    # installed package (with its compiled _C), never the unbuilt source tree.
    package_dir={"": "src"},
    packages=find_packages("src", include=["dilated_attn", "dilated_attn.*"]),
    # the Triton kernels' block shapes; py.typed: the package's type hints are for type checkers
    package_data={"dilated_attn": ["py.typed"], "dilated_attn.backends.triton": ["tuned_configs.json"]},
    ext_modules=[extension()],
    cmdclass={"build_ext": cpp_extension.BuildExtension.with_options(use_ninja=True)},
)
