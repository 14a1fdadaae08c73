#!/usr/bin/env bash
# Compile check of the hand-written CUDA kernels (csrc/cuda/*.cu) without a GPU and without torch: the
# kernel files include no ATen, so nvcc builds them alone. Targets:
#   sm_75, sm_90  nvcc (CUDA 13) straight to SASS;
#   sm_61 Pascal  CUDA 13 has no sm_6x target, so nvcc emits compute_75 PTX, whose .target (and .version,
#                 for the older assembler) are rewritten to sm_61 and assembled by the ptxas of the
#                 nvidia-cuda-nvcc-cu12 wheel (CUDA 12.9, which still has Pascal).
# Prints registers, shared memory and spills per kernel and target; any compile error fails the script.
# Then, for sm_61, each variant Pascal runs (the kernels of its tile table, csrc/cuda/launch.h, and the delta
# kernel): its theoretical occupancy from those numbers and Pascal's limits (64K registers, 96 KiB of shared memory,
# 64 warps and 32 blocks an SM). The script fails unless every one has no spills and at least 50% theoretical
# occupancy. Block sizes and the forward's and dK/dV's dynamic shared memory come from the kernels' own constexprs (a
# host program built from the kernel files).
# Usage: tools/check_cuda_kernels.sh [PTXAS_FOR_PASCAL]   (default: from the wheel, installed to a temp dir)
set -euo pipefail
cd "$(dirname "$0")/.."
NVCC=${NVCC:-nvcc}
FLAGS=(-std=c++17 -O3 --use_fast_math --expt-relaxed-constexpr)
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

PTXAS61=${1:-}
if [[ -z "$PTXAS61" ]]; then
  python -m pip install -q --no-deps --target "$WORK/wheel" "nvidia-cuda-nvcc-cu12==12.9.*"
  PTXAS61="$WORK/wheel/nvidia/cuda_nvcc/bin/ptxas"
fi
echo "nvcc: $($NVCC --version | tail -1)"
echo "ptxas for sm_61: $("$PTXAS61" --version | tail -1)"

for src in csrc/cuda/*.cu; do
  name=$(basename "$src" .cu)
  for arch in 75 90; do
    "$NVCC" "${FLAGS[@]}" -arch=sm_$arch -Xptxas -v -c "$src" -o "$WORK/$name.$arch.o" 2>"$WORK/$name.sm_$arch.log" \
      || { cat "$WORK/$name.sm_$arch.log"; echo "FAILED: $src for sm_$arch"; exit 1; }
  done
  "$NVCC" "${FLAGS[@]}" -arch=compute_75 -ptx "$src" -o "$WORK/$name.ptx"
  sed -e 's/^\.version .*/.version 8.8/' -e 's/^\.target sm_75$/.target sm_61/' "$WORK/$name.ptx" >"$WORK/$name.61.ptx"
  grep -q '^\.target sm_61$' "$WORK/$name.61.ptx" || { echo "FAILED: no .target line to retarget in $name.ptx"; exit 1; }
  "$PTXAS61" -arch=sm_61 -O3 -v "$WORK/$name.61.ptx" -o "$WORK/$name.61.cubin" 2>"$WORK/$name.sm_61.log" \
    || { cat "$WORK/$name.sm_61.log"; echo "FAILED: $src for sm_61"; exit 1; }
done

# Each kernel's block size, and the dynamic shared memory per head dim with Pascal's tiles, as launched.
cat >"$WORK/launch_smem.cu" <<'CU'
#include <cstdio>
#include "attention_fwd.cu"
#include "attention_bwd.cu"
using namespace dilated_attn::cuda;
template <int D>
void row() {
  // One block size a kernel below: Pascal's forward tiles run kThreads at every head dim.
  static_assert(ForwardTiles<kPascalTiles, D>::kThreads == kThreads, "forward_kernel's threads on Pascal");
  std::printf("dynamic forward_kernel %d %zu\n", D,
              ForwardTiles<kPascalTiles, D>::template smem_floats<false>() * sizeof(float));
  std::printf("dynamic dq_kernel %d %zu\n", D,
              DqTiles<kPascalTiles, D>::template smem_floats<false>() * sizeof(float));
  std::printf("dynamic dkdv_kernel %d %zu\n", D,
              DkdvTiles<kPascalTiles, D>::template smem_floats<false>() * sizeof(float));
}
int main() {
  std::printf("threads forward_kernel %d\nthreads delta_kernel %d\n", kThreads, kThreads);
  std::printf("threads dq_kernel %d\nthreads dkdv_kernel %d\n", kBackwardThreads, kBackwardThreads);
  row<32>(), row<64>(), row<96>(), row<128>(), row<256>();
}
CU
"$NVCC" "${FLAGS[@]}" -arch=sm_75 -I csrc/cuda "$WORK/launch_smem.cu" -o "$WORK/launch_smem"
"$WORK/launch_smem" >"$WORK/launch_smem.txt"

# One line per kernel and target: registers, static shared memory, spill bytes; then the sm_61 occupancy.
python - "$WORK/launch_smem.txt" "$WORK"/*.log <<'PY'
import math, re, subprocess, sys
launch = [line.split() for line in open(sys.argv[1])]
threads = {r[1]: int(r[2]) for r in launch if r[0] == "threads"}  # kernel name: threads a block
dynamic_smem = {(r[1], int(r[2])): int(r[3]) for r in launch if r[0] == "dynamic"}  # (kernel, D): bytes (Pascal)
rows = []
for path in sys.argv[2:]:
    arch = path.rsplit(".", 2)[-2]
    kernel = None
    spill = "0"
    for line in open(path):
        m = re.search(r"Compiling entry function '(\w+)'", line)
        if m:
            kernel = subprocess.run(["c++filt", m.group(1)], capture_output=True, text=True).stdout.strip()
            kernel = re.sub(r"dilated_attn::cuda::\(anonymous namespace\)::", "", kernel)
            kernel = kernel.split("(")[0]
        m = re.search(r"(\d+) bytes spill stores", line)
        if m:
            spill = m.group(1)
        m = re.search(r"Used (\d+) registers.*?(?:(\d+) bytes smem|$)", line)
        if m and kernel:
            rows.append((kernel, arch, m.group(1), m.group(2) or "0", spill))
            kernel, spill = None, "0"
print(f"{'kernel':<44} {'arch':<6} {'regs':>5} {'smem':>6} {'spill':>6}")
for r in sorted(rows):
    print(f"{r[0]:<44} {r[1]:<6} {r[2]:>5} {r[3]:>6} {r[4]:>6}")
print(f"{len(rows)} kernel builds checked")

# Pascal (sm_61): registers allocated 256 a warp; 48 KiB of shared memory a block at most, 96 KiB an SM.
REGS, SMEM_SM, SMEM_BLOCK, WARPS, BLOCKS = 65536, 96 * 1024, 48 * 1024, 64, 32
report, missing = [], 0
for kernel, arch, regs, smem, spill in sorted(rows):
    if arch != "sm_61":
        continue
    regs, smem, spill = int(regs), int(smem), int(spill)
    # Pascal runs the delta kernel and the variants of its own tile table (template argument 61), with streamed
    # tiles (no resident Q, Q/dO or K/V)
    m = re.match(r"void \w+_kernel<[^,]+, (\d+), (\d+)(?:, (true|false))?>", kernel)
    if not kernel.startswith("void delta_kernel") and (not m or int(m.group(2)) != 61 or m.group(3) == "true"):
        continue
    name = kernel.split()[1].split("<")[0]
    warps = threads[name] // 32
    if m:
        smem += dynamic_smem.get((name, int(m.group(1))), 0)
    by_regs = REGS // (math.ceil(regs * 32 / 256) * 256) // warps
    by_smem = SMEM_SM // (math.ceil(smem / 256) * 256) if smem else BLOCKS
    blocks = min(BLOCKS, WARPS // warps, by_regs, by_smem)
    occupancy = blocks * warps / WARPS
    ok = spill == 0 and occupancy >= 0.5
    missing += not ok
    report.append(f"{kernel:<46} {regs:>5} {smem:>6} {spill:>6} {blocks:>7} {occupancy:>9.1%}  {'yes' if ok else 'no'}")
print("\nsm_61 (Pascal): theoretical occupancy of each variant the launchers run "
      f"(threads a block: {', '.join(f'{k} {v}' for k, v in sorted(threads.items()))})")
print(f"{'kernel':<46} {'regs':>5} {'smem':>6} {'spill':>6} {'blocks':>7} {'occupancy':>9}  no spills, >= 50%")
print("\n".join(report))
print(f"{len(report) - missing} of {len(report)} sm_61 variants meet the Pascal target")
if missing:
    sys.exit(f"FAILED: {missing} sm_61 variants spill or run below 50% theoretical occupancy")
PY
echo "CUDA kernel compile check passed (sm_61 via PTX, sm_75, sm_90)"
