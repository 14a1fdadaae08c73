#!/usr/bin/env bash
# Compile check of the hand-written CUDA kernels (csrc/cuda/*.cu) without a GPU and without torch: the kernel files
# include no ATen, so they compile alone. Targets:
#   sm_75, sm_90  the installed nvcc (CUDA 13), every kernel file, straight to SASS.
#   sm_61, sm_60  Pascal, as a Pascal user's build compiles it: CUDA 13 has no sm_6x target, so CUDA 12.9's compiler
#                 front end (NVRTC, from the nvidia-cuda-nvrtc-cu12 wheel; PyPI carries no CUDA 12 nvcc driver) compiles
#                 the forward and backward kernels for compute_61 and compute_60 (__CUDA_ARCH__ 610 and 600, so each
#                 holds Pascal's tile table only: common.cuh, tiles_built), and CUDA 12.9's ptxas assembles them.
# Prints registers, shared memory and spills per kernel and target; any compile error fails the script. Then, for
# each variant Pascal runs (the forward and dK/dV kernels Pascal's two tile tables share, the delta kernel, and the dQ
# kernel of Pascal's table on a GTX 10xx (sm_61: 96 KiB of shared memory an SM) and of the P100's on a P100 (sm_60:
# 64 KiB)): its shared memory, the blocks an SM holds and their occupancy. The script fails where a variant spills,
# needs more than 48 KiB of shared memory a block, or fits fewer blocks an SM than its register budget is sized for
# (__launch_bounds__). Occupancy is reported, not required: the tiles aim at the FMA rate (csrc/cuda/launch.h).
# Block sizes, dynamic shared memory and blocks an SM come from the kernels' own constexprs
# (a host program built from the kernel files).
set -euo pipefail
cd "$(dirname "$0")/.."
NVCC=${NVCC:-nvcc}
FLAGS=(-std=c++17 -O3 --use_fast_math --expt-relaxed-constexpr)
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

# CUDA 12.9: ptxas, NVRTC, and the headers NVRTC compiles against (cuda_fp16.h / cuda_bf16.h, libcu++)
python -m pip install -q --no-deps --target "$WORK/cuda12" "nvidia-cuda-nvcc-cu12==12.9.*" \
  "nvidia-cuda-nvrtc-cu12==12.9.*" "nvidia-cuda-runtime-cu12==12.9.*" "nvidia-cuda-cccl-cu12==12.9.*" \
  >"$WORK/pip.log" 2>&1 || { cat "$WORK/pip.log"; echo "FAILED: installing CUDA 12.9's compiler wheels"; exit 1; }
CUDA12="$WORK/cuda12/nvidia"
PTXAS12="$CUDA12/cuda_nvcc/bin/ptxas"
echo "nvcc: $($NVCC --version | tail -1)"
echo "CUDA 12 for Pascal: NVRTC $(basename "$CUDA12"/cuda_nvrtc/lib/libnvrtc.so.*), $("$PTXAS12" --version | tail -1)"

# Pascal: every variant its launchers start, instantiated explicitly (NVRTC compiles no host code). The std headers
# NVRTC lacks map onto libcu++'s; cuda_runtime.h (whose types NVRTC declares itself) gives INFINITY.
mkdir -p "$WORK/shim"
printf '#pragma once\n#include <cuda/std/cstdint>\nnamespace std { using namespace cuda::std; }\nusing cuda::std::int64_t;\nusing cuda::std::int32_t;\n' >"$WORK/shim/cstdint"
printf '#pragma once\n#include <cuda/std/type_traits>\nnamespace std { using namespace cuda::std; }\n' >"$WORK/shim/type_traits"
printf '#pragma once\n#define INFINITY __int_as_float(0x7f800000)\n' >"$WORK/shim/cuda_runtime.h"
{
  echo '#include "attention_fwd.cu"'
  echo '#include "attention_bwd.cu"'
  echo 'namespace dilated_attn { namespace cuda { namespace {'
  for t in float __half __nv_bfloat16; do
    echo "template __global__ void delta_kernel<$t>(const DeltaParams);"
    for d in 32 64 96 128 256; do
      echo "template __global__ void forward_kernel<$t, $d, TileTable::kPascal, false>(const ForwardParams);"
      echo "template __global__ void dq_kernel<$t, $d, TileTable::kPascal, false>(const BackwardParams);"
      echo "template __global__ void dq_kernel<$t, $d, TileTable::kGp100, false>(const BackwardParams);"
      echo "template __global__ void dkdv_kernel<$t, $d, TileTable::kPascal, false>(const BackwardParams);"
    done
  done
  echo '} } }'
} >"$WORK/pascal_kernels.cu"
# Every compile at once (the machine's cores share them); each job's log names its kernels, and a failed job prints
# its log and fails the script after all have ended.
jobs=()
# One nvcc a file for both targets: its front end and host code are compiled once.
for src in csrc/cuda/*.cu; do
  name=$(basename "$src" .cu)
  ("$NVCC" "${FLAGS[@]}" -gencode arch=compute_75,code=sm_75 -gencode arch=compute_90,code=sm_90 -Xptxas -v -c "$src" \
     -o "$WORK/$name.o" 2>"$WORK/$name.sm_75_90.log" \
    || { cat "$WORK/$name.sm_75_90.log"; echo "FAILED: $src for sm_75 and sm_90"; exit 1; }) &
  jobs+=($!)
done
# benchmarks/decode_floor.cu (a standalone program run on the GPU machines) for sm_90, so it keeps compiling
("$NVCC" -std=c++17 -O3 -arch=sm_90 -c benchmarks/decode_floor.cu -o "$WORK/decode_floor.o" 2>"$WORK/decode_floor.log" \
  || { cat "$WORK/decode_floor.log"; echo "FAILED: benchmarks/decode_floor.cu"; exit 1; }) &
jobs+=($!)
for arch in 61 60; do
  (python tools/nvrtc_ptx.py "$(ls "$CUDA12"/cuda_nvrtc/lib/libnvrtc.so.12)" "$WORK/pascal_kernels.cu" \
     "$WORK/pascal.$arch.ptx" --gpu-architecture=compute_$arch -std=c++17 --use_fast_math -default-device \
     -I"$WORK/shim" -Icsrc/cuda -I"$CUDA12/cuda_runtime/include" -I"$CUDA12/cuda_cccl/include" \
   && "$PTXAS12" -arch=sm_$arch -O3 -v "$WORK/pascal.$arch.ptx" -o "$WORK/pascal.$arch.cubin" \
        2>"$WORK/pascal.sm_$arch.log" \
   || { cat "$WORK/pascal.sm_$arch.log" 2>/dev/null; echo "FAILED: Pascal's kernels for sm_$arch"; exit 1; }) &
  jobs+=($!)
done
failed=0
for job in "${jobs[@]}"; do wait "$job" || failed=1; done
[[ $failed == 0 ]] || exit 1

# Each kernel's block size, and Pascal's tiles' dynamic shared memory and blocks an SM (__launch_bounds__), as launched.
cat >"$WORK/launch_smem.cu" <<'CU'
#include <cstdio>
#include "attention_fwd.cu"
#include "attention_bwd.cu"
using namespace dilated_attn::cuda;
template <int D>
void row() {
  using Fwd = ForwardTiles<TileTable::kPascal, D>;
  using Dq = DqTiles<TileTable::kPascal, D>;
  using DqGp100 = DqTiles<TileTable::kGp100, D>;
  using Dkdv = DkdvTiles<TileTable::kPascal, D>;
  std::printf("forward_kernel %d %d %zu %d\n", D, Fwd::kThreads, Fwd::template smem_floats<false>() * sizeof(float),
              Fwd::kMinBlocks);
  std::printf("dq_kernel %d %d %zu %d\n", D, kBackwardThreads, Dq::template smem_floats<false>() * sizeof(float),
              Dq::kMinBlocks);
  std::printf("dq_kernel_gp100 %d %d %zu %d\n", D, kBackwardThreads,
              DqGp100::template smem_floats<false>() * sizeof(float), DqGp100::kMinBlocks);
  std::printf("dkdv_kernel %d %d %zu %d\n", D, kBackwardThreads, Dkdv::template smem_floats<false>() * sizeof(float),
              Dkdv::kMinBlocks);
}
int main() {
  std::printf("delta_kernel 0 %d 0 1\n", kThreads);
  row<32>(), row<64>(), row<96>(), row<128>(), row<256>();
}
CU
"$NVCC" "${FLAGS[@]}" -arch=sm_75 -I csrc/cuda "$WORK/launch_smem.cu" -o "$WORK/launch_smem"
"$WORK/launch_smem" >"$WORK/launch_smem.txt"

python - "$WORK/launch_smem.txt" "$WORK"/*.log <<'PY'
import math, re, subprocess, sys
launch = {}  # (kernel, head dim): (threads, dynamic shared memory, blocks an SM it is sized for)
for line in open(sys.argv[1]):
    name, dim, threads, smem, blocks = line.split()
    launch[(name, int(dim))] = (int(threads), int(smem), int(blocks))
rows = []  # (kernel, arch, registers, static shared memory, spill bytes)
for path in sys.argv[2:]:
    arch = path.rsplit(".", 2)[-2]  # Pascal's logs, one target each; the others name it per kernel
    kernel, spill = None, 0
    for line in open(path):
        m = re.search(r"Compiling entry function '(\w+)'(?: for '(sm_\d+)')?", line)
        if m:
            arch = m.group(2) or arch
            kernel = subprocess.run(["c++filt", m.group(1)], capture_output=True, text=True).stdout.strip()
            kernel = kernel.replace("dilated_attn::cuda::(anonymous namespace)::", "")
            kernel = kernel.replace("(dilated_attn::cuda::TileTable)0", "pascal")
            kernel = kernel.replace("(dilated_attn::cuda::TileTable)1", "gp100")
            kernel = kernel.replace("(dilated_attn::cuda::TileTable)2", "volta").split("(")[0]
        m = re.search(r"(\d+) bytes spill stores", line)
        if m:
            spill = int(m.group(1))
        m = re.search(r"Used (\d+) registers.*?(?:(\d+) bytes smem|$)", line)
        if m and kernel:
            rows.append((kernel, arch, int(m.group(1)), int(m.group(2) or 0), spill))
            kernel, spill = None, 0
print(f"{'kernel':<52} {'arch':<6} {'regs':>5} {'smem':>6} {'spill':>6}")
for r in sorted(rows):
    print(f"{r[0]:<52} {r[1]:<6} {r[2]:>5} {r[3]:>6} {r[4]:>6}")
print(f"{len(rows)} kernel builds checked")

# Pascal: 64K registers an SM, allocated 256 a warp; 48 KiB of shared memory a block; 64 warps and 32 blocks an SM.
SMEM_SM = {"sm_61": 96 * 1024, "sm_60": 64 * 1024}
DQ_TABLE = {"sm_61": "pascal", "sm_60": "gp100"}  # the dQ tiles each runs (csrc/cuda/launch.h); both share the rest
REGS, SMEM_BLOCK, WARPS, BLOCKS = 65536, 48 * 1024, 64, 32
failed = 0
for arch, smem_sm in SMEM_SM.items():
    print(f"\n{arch} ({smem_sm // 1024} KiB of shared memory an SM): each variant Pascal runs, as launched")
    print(f"{'kernel':<52} {'regs':>5} {'smem':>6} {'spill':>6} {'blocks/SM':>9} {'sized for':>9} {'occupancy':>9}")
    for kernel, a, regs, static_smem, spill in sorted(rows):
        if a != arch:
            continue
        name = kernel.split()[1].split("<")[0]
        if name == "dq_kernel" and f", {DQ_TABLE[arch]}," not in kernel:
            continue
        m = re.match(r"void \w+<[^,]+, (\d+),", kernel)
        threads, dynamic, sized_for = launch[(name + ("_gp100" if ", gp100," in kernel else ""), int(m.group(1)) if m else 0)]
        smem = static_smem + dynamic
        warps = threads // 32
        by_regs = REGS // (math.ceil(regs * 32 / 256) * 256) // warps
        by_smem = smem_sm // (math.ceil(smem / 256) * 256) if smem else BLOCKS
        blocks = min(BLOCKS, WARPS // warps, by_regs, by_smem)
        problems = [why for bad, why in ((spill > 0, "spills"), (smem > SMEM_BLOCK, "over 48 KiB"),
                                         (blocks < sized_for, f"{blocks} blocks an SM")) if bad]
        failed += bool(problems)
        print(f"{kernel:<52} {regs:>5} {smem:>6} {spill:>6} {blocks:>9} {sized_for:>9} {blocks * warps / WARPS:>9.1%}"
              + (f"  FAILS: {', '.join(problems)}" if problems else ""))
if failed:
    sys.exit(f"FAILED: {failed} Pascal variants spill, exceed 48 KiB a block or fit fewer blocks an SM than sized for")
print("\nevery Pascal variant: no spills, <= 48 KiB a block, its blocks fit an SM of sm_61 and sm_60")
PY
echo "CUDA kernel compile check passed (sm_60 and sm_61 with CUDA 12.9, sm_75 and sm_90 with $($NVCC --version | tail -1))"
