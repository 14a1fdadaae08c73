#!/usr/bin/env bash
# One call on a GPU machine: build the extension, run the GPU tests, run the GPU benchmark. Logs and
# JSON go under $OUT (default ./gpu_out). Usage: bash benchmarks/run_on_gpu.sh [tests|sanitize|bench|auto|quick|all]...
set -uo pipefail
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
stages=${*:-all}

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv | tee "$OUT/device.txt"
start=$(date +%s)
if ! MAX_JOBS=${MAX_JOBS:-16} python3 -m pip install --no-build-isolation --no-deps . > "$OUT/build.log" 2>&1; then
  tail -60 "$OUT/build.log"
  exit 1
fi
echo "build: $(( $(date +%s) - start )) s"
(cd /tmp && python3 -c "import dilated_attn, json; print(json.dumps(dilated_attn.build_info()))")

for stage in $stages; do
  case $stage in
    tests|all)
      # from tests/, so that the installed package (with its compiled _C) is imported, not the source tree
      (cd tests && python3 -m pytest -m "gpu" -k "${PYTEST_K:-}" -q -rfE --maxfail=10 -p no:cacheprovider . 2>&1) \
        | tee "$OUT/gpu_tests.log" | tail -40 ;;&
    sanitize)
      for tool in memcheck racecheck initcheck; do
        compute-sanitizer --tool $tool --error-exitcode 1 python3 tools/sanitize_cuda.py > "$OUT/sanitize_$tool.log" 2>&1
        echo "compute-sanitizer $tool: exit $? ($(tail -1 "$OUT/sanitize_$tool.log"))"
      done ;;
    auto)
      python3 benchmarks/bench_auto.py --out "$OUT/auto.json" 2>&1 | tee "$OUT/auto.log" ;;
    quick)
      python3 benchmarks/bench_gpu.py --quick --out "$OUT/bench_quick.json" 2>&1 | tee "$OUT/bench_quick.log" ;;
    bench|all)
      python3 benchmarks/bench_gpu.py --out "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log" ;;
  esac
done
