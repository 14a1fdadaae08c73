#!/usr/bin/env bash
# Compile check of the hand-written CUDA kernels (csrc/cuda/*.cu) without a GPU and without torch: the
# kernel files include no ATen, so nvcc builds them alone. Targets:
#   sm_75, sm_90  nvcc (CUDA 13) straight to SASS;
#   sm_61 Pascal  CUDA 13 has no sm_6x target, so nvcc emits compute_75 PTX, whose .target (and .version,
#                 for the older assembler) are rewritten to sm_61 and assembled by the ptxas of the
#                 nvidia-cuda-nvcc-cu12 wheel (CUDA 12.9, which still has Pascal).
# Prints registers, shared memory and spills per kernel and target; any compile error fails the script.
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

# One line per kernel and target: registers, static shared memory, spill bytes.
python - "$WORK"/*.log <<'PY'
import re, subprocess, sys
rows = []
for path in sys.argv[1:]:
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
PY
echo "CUDA kernel compile check passed (sm_61 via PTX, sm_75, sm_90)"
