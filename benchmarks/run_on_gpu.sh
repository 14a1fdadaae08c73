#!/usr/bin/env bash
# One call on a GPU machine: build the extension, run the GPU tests, run the GPU benchmark. Logs and
# JSON go under $OUT (default ./gpu_out).
# The build holds Pascal's tile tables in the sm_70+ code too (DILATED_ATTN_PASCAL_PROXY=1), so that the tests, the
# sanitizers and bench_cuda_kernels.py run them on this GPU (DILATED_ATTN_CUDA_TILES=pascal or gp100).
# Usage: bash benchmarks/run_on_gpu.sh [tests|sanitize|cuda_kernels|smem|bench|auto|quick|fa4|ring|ring_bench|ring_ab|ab|main|tune|first_call|varlen|decode|decode_floor|tile_order|ncu|tune_fa4|all]...
#   fa4: the fa4 backend's GPU tests, then benchmarks/bench_gpu.py on N = 65536 (causal and not, Hkv 16, 4, 1) for the
#        kernels cudnn and fa4 and their first-branch shape alone (${FA4_ARGS}); needs flash-attn-4 installed or on
#        PYTHONPATH (the wheels travel as ../shared/tools/carry-wheels.sh prints)
#   tune_fa4: benchmarks/tune_fa4.py ${TUNE_FA4_ARGS} (FlashAttention-4's forward tiles, or with --backward the
#        backward's streams and pieces, against the cudnn backend), then each kernel's time in one forward of the fa4
#        and cudnn backends (profile_triton.py --kernel-times); needs flash-attn-4 importable, as fa4 does
#   cuda_kernels: benchmarks/bench_cuda_kernels.py ${CUDA_KERNELS_ARGS} (both tile tables against the fp32 FMA peak)
#   bench, quick: benchmarks/bench_gpu.py ${BENCH_ARGS} (e.g. --providers ..., --dim 64)
#   ncu: Nsight Compute over one forward+backward of the Triton kernels (benchmarks/profile_triton.py ${NCU_ARGS};
#        NCU_KERNELS, NCU_COUNT: the kernel regex and count, e.g. for NCU_ARGS="--backend cudnn"; NCU_METRICS: the
#        metrics beside the sections, comma-separated, default the tensor pipe's activity)
#   smem: tools/triton_shared_memory.py ${SMEM_ARGS} (the Triton configs' shared memory against the estimate)
#   ring: the multi-GPU tests, then ring_bench
#   ring_bench: bench_ring.py in every mode with each rank's kernel-time profile (--profile ${RING_ARGS}) and its weak
#         scaling (--tokens-per-gpu), on each GPU count of RING_GPUS (default "4 2") the machine has; then
#         `python benchmarks/ring_model.py` on the JSON here (ring_4gpu.json ring_2gpu.json); with RING_TRACE=1 each
#         profiled call's host and GPU timeline too (--trace), every rank's, packed as ring_traces_<P>gpu.tgz
#   ab: ${AB_CMD} (a benchmark command taking --out), AB_ROUNDS (default 2) rounds of A then B in this one call: A the
#         package tree in AB_TREE (a folder holding an older commit's src/, e.g. made by
#         `git archive COMMIT src | tar -x -C .old/COMMIT` and carried) run with this build's _C, so only the Python
#         may differ; B this tree. JSON ab_<A|B><round>.json
#   ring_ab: ab with bench_ring.py ${RING_ARGS} on the first GPU count of RING_GPUS (RING_AB_TREE, RING_AB_ROUNDS),
#         JSON ring_ab_<A|B><round>.json
#   tune: benchmarks/tune.py ${TUNE_ARGS} (the full sweep, merged into the source tree's tuned_configs.json when run
#         with SKIP_BUILD=1 on a fresh machine, else into the installed package's; copied to $OUT either way)
#   decode: benchmarks/bench_decode.py ${DECODE_ARGS} (KV-cache decoding against the copy bandwidth)
#   decode_floor: benchmarks/decode_floor.cu (nvcc): how fast bench_decode's default call's K/V rows can be read at all
#   varlen: benchmarks/bench_varlen.py ${VARLEN_ARGS} (a pack of 16 sequences against uniform and padded batches)
#   first_call: benchmarks/first_call.py ${FIRST_ARGS} (first calls with an empty and a warm Triton cache)
#   main: `python -m dilated_attn` and a GPU run of examples/train_longnet.py (loss curve as JSON)
set -uo pipefail
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
stages=${*:-all}

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv | tee "$OUT/device.txt"
start=$(date +%s)
if [ "${SKIP_BUILD:-0}" = 1 ]; then
  # a later call on the same machine: the extension installed by an earlier call; where none is installed
  # (Triton-only runs such as the ring), the package from the source tree, without the compiled extension
  if ! python3 -c "import dilated_attn._C" 2>/dev/null; then
    export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
  fi
elif ! DILATED_ATTN_PASCAL_PROXY=1 MAX_JOBS=${MAX_JOBS:-16} python3 -m pip install --no-build-isolation --no-deps . > "$OUT/build.log" 2>&1; then
  tail -60 "$OUT/build.log"
  exit 1
else
  echo "build: $(( $(date +%s) - start )) s"
fi
python3 -c "import dilated_attn, json; print(json.dumps(dilated_attn.build_info()))"

for stage in $stages; do
  case $stage in
    tests|all)
      # spread over processes with pytest-xdist where it is installed (the tests are bound by Triton compiles)
      workers=$(python3 -c "import xdist" 2>/dev/null && echo "-n ${PYTEST_WORKERS:-8}")
      python3 -m pytest -m "gpu" -k "${PYTEST_K:-}" -q -rfEs --maxfail=10 -p no:cacheprovider \
        --durations=10 $workers tests 2>&1 | tee "$OUT/gpu_tests.log" | tail -40 ;;&
    sanitize)
      # both tile tables (csrc/cuda/launch.h)
      for tiles in volta pascal gp100; do
        for tool in memcheck racecheck initcheck; do
          log="$OUT/sanitize_${tool}_tiles$tiles.log"
          DILATED_ATTN_CUDA_TILES=$tiles compute-sanitizer --tool $tool --error-exitcode 1 \
            python3 tools/sanitize_cuda.py > "$log" 2>&1
          echo "compute-sanitizer $tool, tile table $tiles: exit $? ($(tail -1 "$log"))"
        done
      done ;;
    cuda_kernels)
      python3 benchmarks/bench_cuda_kernels.py ${CUDA_KERNELS_ARGS:-} --out "$OUT/cuda_kernels.json" 2>&1 \
        | tee "$OUT/cuda_kernels.log" ;;
    smem)
      python3 tools/triton_shared_memory.py ${SMEM_ARGS:-} 2>&1 | tee "$OUT/smem.log" ;;
    auto)
      python3 benchmarks/bench_auto.py ${AUTO_ARGS:-} --out "$OUT/auto.json" 2>&1 | tee "$OUT/auto.log" ;;
    tune)
      python3 benchmarks/tune.py ${TUNE_ARGS:-} 2>&1 | tee "$OUT/tune.log"
      cp "$(python3 -c 'from dilated_attn.backends.triton import configs; print(configs.TABLE_PATH)')" "$OUT/" ;;
    first_call)
      python3 benchmarks/first_call.py ${FIRST_ARGS:-} --out "$OUT/first_call.json" --log "$OUT/first_call_main.log" \
        2>&1 | tee "$OUT/first_call.log" ;;
    decode)
      python3 benchmarks/bench_decode.py ${DECODE_ARGS:-} --out "$OUT/decode.json" 2>&1 | tee "$OUT/decode.log" ;;
    decode_floor)
      "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc" -O3 -std=c++17 -arch=native -o "$OUT/decode_floor" benchmarks/decode_floor.cu &&
        "$OUT/decode_floor" "$OUT/decode_floor.json" 2>&1 | tee "$OUT/decode_floor.log"
      rm -f "$OUT/decode_floor" ;;
    varlen)
      python3 benchmarks/bench_varlen.py ${VARLEN_ARGS:-} --out "$OUT/varlen.json" 2>&1 | tee "$OUT/varlen.log" ;;
    tile_order)
      python3 benchmarks/bench_tile_order.py --out "$OUT/tile_order.json" 2>&1 | tee "$OUT/tile_order.log" ;;
    quick)
      python3 benchmarks/bench_gpu.py --quick ${BENCH_ARGS:-} --out "$OUT/bench_quick.json" 2>&1 | tee "$OUT/bench_quick.log" ;;
    fa4)
      python3 -m pytest -m gpu -q -rfEs -p no:cacheprovider tests/test_fa4.py 2>&1 | tee "$OUT/fa4_tests.log" | tail -20
      python3 benchmarks/bench_gpu.py --presets 0,1 --kv-heads 16,4,1 --providers cudnn,fa4,segments_cudnn,segments_fa4 --rounds 3 \
        ${FA4_ARGS:-} --out "$OUT/fa4_bench.json" 2>&1 | tee "$OUT/fa4_bench.log" ;;
    tune_fa4)
      python3 benchmarks/tune_fa4.py ${TUNE_FA4_ARGS:-} --out "$OUT/tune_fa4.json" 2>&1 | tee "$OUT/tune_fa4.log"
      for backend in fa4 cudnn; do
        python3 benchmarks/profile_triton.py --kernel-times --forward-only --backend $backend 2>&1 \
          | tee "$OUT/kernel_times_$backend.log" | tail -25
      done ;;
    ncu)
      ncu --profile-from-start off -k regex:"${NCU_KERNELS:-_fwd_kernel|_dkdv_kernel|_dq_kernel}" -c ${NCU_COUNT:-6} \
        --section SpeedOfLight \
        --section Occupancy --section LaunchStats --section WarpStateStats --section ComputeWorkloadAnalysis \
        --metrics "${NCU_METRICS:-sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active}" \
        python3 benchmarks/profile_triton.py ${NCU_ARGS:-} > "$OUT/ncu.txt" 2>&1
      metrics=$(echo "${NCU_METRICS:-hmma_cycles}" | tr ',' '|')
      grep -E "^  .*Context [0-9]|Registers Per|Theoretical Occ|Achieved Occ|Duration|Issue Slots Busy|$metrics" \
        "$OUT/ncu.txt" ;;
    ring)
      python3 -m pytest -m "multigpu" -q -rfE -p no:cacheprovider tests 2>&1 | tee "$OUT/ring_tests.log" | tail -20 ;;&
    ring|ring_bench)
      # every mode, strong and weak scaling, on each GPU count of RING_GPUS (default 4 2) the machine has
      gpus=$(nvidia-smi -L | wc -l)
      for p in ${RING_GPUS:-4 2}; do
        [ "$p" -le "$gpus" ] || continue
        trace=${RING_TRACE:+--trace $OUT/ring_traces_${p}gpu}
        torchrun --standalone --nproc_per_node="$p" benchmarks/bench_ring.py --profile $trace ${RING_ARGS:-} \
          --out "$OUT/ring_${p}gpu.json" 2>&1 | tee -a "$OUT/ring.log"
        if [ -d "$OUT/ring_traces_${p}gpu" ]; then  # one file for the many traces (Chrome's JSON, compressed)
          tar czf "$OUT/ring_traces_${p}gpu.tgz" -C "$OUT" "ring_traces_${p}gpu" && rm -rf "$OUT/ring_traces_${p}gpu"
        fi
        torchrun --standalone --nproc_per_node="$p" benchmarks/bench_ring.py --tokens-per-gpu ${RING_ARGS:-} \
          --out "$OUT/ring_${p}gpu_weak.json" 2>&1 | tee -a "$OUT/ring.log"
      done
      # the head-parallel modes with RING_HEAD_CHUNKS head chunks overlapping their exchanges, for comparison
      if [ -n "${RING_HEAD_CHUNKS:-}" ]; then
        DILATED_ATTN_HEAD_CHUNKS=$RING_HEAD_CHUNKS torchrun --standalone --nproc_per_node="${RING_GPUS%% *}" \
          benchmarks/bench_ring.py --mode heads --out "$OUT/ring_heads_${RING_HEAD_CHUNKS}chunks.json" 2>&1 \
          | tee -a "$OUT/ring.log"
      fi ;;
    ab|ring_ab)
      if [ $stage = ring_ab ]; then
        gpus=${RING_GPUS:-4 2}
        tree_a=${RING_AB_TREE:-} rounds=${RING_AB_ROUNDS:-2} log=ring.log
        cmd="torchrun --standalone --nproc_per_node=${gpus%% *} benchmarks/bench_ring.py ${RING_ARGS:-}"
      else
        tree_a=${AB_TREE:-} rounds=${AB_ROUNDS:-2} log=ab.log cmd=${AB_CMD:?AB_CMD: the benchmark command}
      fi
      site=$(cd /tmp && python3 -c "import dilated_attn, os; print(os.path.dirname(dilated_attn.__file__))")
      cp "$site"/_C*.so "${tree_a:?AB_TREE / RING_AB_TREE: the folder holding the older src/}/src/dilated_attn/"
      for round in $(seq "$rounds"); do
        for side in A B; do
          # A's tree first on the path, before what else is there (flash-attn-4's wheels)
          tree=$([ $side = A ] && echo "$PWD/$tree_a/src")
          PYTHONPATH=${tree:+$tree${PYTHONPATH:+:}}${PYTHONPATH:-} $cmd --out "$OUT/${stage}_${side}${round}.json" \
            2>&1 | sed "s/^/$side$round /" | tee -a "$OUT/$log"
        done
      done ;;
    main)
      python3 -m dilated_attn 2>&1 | tee "$OUT/main.log"
      python3 examples/train_longnet.py --device cuda --steps ${TRAIN_STEPS:-400} --seq-len 8192 --batch 4 --dim 512 --layers 6 \
        --heads 8 --segment-lengths 512 1024 2048 4096 8192 --dilation-rates 1 2 4 8 16 --log-every 20 \
        --json "$OUT/train_longnet.json" 2>&1 | tee "$OUT/train_longnet.log" ;;
    bench|all)
      python3 benchmarks/bench_gpu.py ${BENCH_ARGS:-} --out "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log" ;;
  esac
done
