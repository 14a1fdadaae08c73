// How fast the bytes of bench_decode.py's default call can be read at all: the floor under any decode kernel.
//
//   nvcc -O3 -std=c++17 -arch=sm_90 -o decode_floor benchmarks/decode_floor.cu && ./decode_floor OUT.json
//
// The call: B=16, Hq=16, Hkv=4, D=128, bf16, LongNet's branches (w 2048..16384, r 1..8, head_groups="all"), the new
// token the 65536th (it attends to the most keys). Rows timed (each the median of 50 launches after 10, L2 flushed
// before each by a 256 MiB memset; no math, the bytes land in registers or shared memory and are dropped):
//   stream     the distinct K/V rows' bytes as one contiguous buffer, read by a grid-stride loop of 16-byte loads
//              (the best of a few grid shapes): what the memory gives a launch this short
//   gather     the rows themselves, each warp streaming 16-row tiles of K and V through its own cp.async pipeline
//              into shared memory, as csrc/cuda/decode.cu does, over the kernel's shares of each token's keys: the
//              union of the rows (each read once) and the rows as the decode kernels read them (a branch at a time,
//              a row two branches share read twice); the best of several warp counts and pipeline depths
// and the device-to-device copy bandwidth of 1 GiB (read + written bytes a second), bench_decode.py's yardstick.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <ctime>
#include <set>
#include <vector>

namespace {

constexpr int kB = 16, kN = 65536, kHq = 16, kHkv = 4, kD = 128, kTile = 16;
constexpr int kPitch = (kD / 8 + 1) * 16, kTileBytes = kTile * kPitch;  // the decode kernel's padded tile rows
constexpr int kSegs[4] = {2048, 4096, 8192, 16384}, kDils[4] = {1, 2, 4, 8};

#define CHECK(x)                                                               \
  do {                                                                         \
    cudaError_t e = (x);                                                       \
    if (e != cudaSuccess) {                                                    \
      fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e)); \
      exit(1);                                                                 \
    }                                                                          \
  } while (0)

__global__ void stream_read(const uint4* x, size_t n, unsigned* sink) {
  constexpr int kUnroll = 4;
  unsigned acc = 0;
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  for (; i + (kUnroll - 1) * stride < n; i += kUnroll * stride) {
    uint4 a[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) a[u] = __ldcs(x + i + u * stride);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) acc ^= a[u].x ^ a[u].w;
  }
  for (; i < n; i += stride) acc ^= __ldcs(x + i).x;
  if (acc == 0x9e3779b9u) sink[threadIdx.x] = acc;  // never true: keeps the loads
}

// Block (token, share) reads the rows offsets[starts[b]..starts[b + 1]) (element offsets of K and V rows), its warps
// every kWarps-th tile of 16, each through a kStages-deep cp.async pipeline.
template <int kWarps, int kStages>
__global__ void __launch_bounds__(kWarps * 32) gather_rows(const uint16_t* k, const uint16_t* v,
                                                           const int64_t* offsets, const int* starts, unsigned* sink) {
  extern __shared__ uint4 smem[];
  const int block = blockIdx.x * gridDim.y + blockIdx.y;
  const int lo = starts[block], count = starts[block + 1] - lo;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, chunk = lane % 16, sub = lane / 16;
  const uint32_t tiles_at = static_cast<uint32_t>(__cvta_generic_to_shared(smem)) + warp * kStages * 2 * kTileBytes;
  const int tiles = (count + kTile - 1) / kTile;
  const int mine = tiles > warp ? (tiles - warp + kWarps - 1) / kWarps : 0;
  auto issue = [&](int t) {
    if (t < mine) {
      const int key0 = (warp + t * kWarps) * kTile;
      const uint32_t at = tiles_at + (t % kStages) * 2 * kTileBytes;
#pragma unroll
      for (int c = 0; c < kTile / 2; ++c) {
        const int row = 2 * c + sub;
        const int64_t offset = offsets[lo + min(key0 + row, count - 1)] + chunk * 8;
        const uint32_t dst = at + row * kPitch + chunk * 16;
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(k + offset));
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst + kTileBytes), "l"(v + offset));
      }
    }
    asm volatile("cp.async.commit_group;\n" ::);
  };
  unsigned acc = 0;
  for (int t = 0; t < kStages - 1; ++t) issue(t);
  for (int t = 0; t < mine; ++t) {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(kStages - 2));
    __syncwarp();
    issue(t + kStages - 1);
    const unsigned* tile = reinterpret_cast<const unsigned*>(smem) + (warp * kStages * 2 + (t % kStages) * 2) *
                                                                         (kTileBytes / 4);
    acc ^= tile[lane * 4] ^ tile[kTileBytes / 4 + lane * 4];
  }
  asm volatile("cp.async.wait_group 0;\n" ::);
  if (acc == 0x9e3779b9u) sink[threadIdx.x] = acc;
}

// Per kv head, the cache rows the new token at `pos` attends to: each branch's in turn, or their union.
std::vector<std::vector<int>> attended(int pos, bool once) {
  std::vector<std::vector<int>> rows(kHkv);
  const int group = kHq / kHkv;
  for (int kvh = 0; kvh < kHkv; ++kvh) {
    std::set<int> all;
    for (int j = 0; j < 4; ++j) {
      const int w = kSegs[j], r = kDils[j], start = pos / w * w, offset = (pos - start) % r;
      const int heads_per_offset = (kHq + r - 1) / r;
      bool member = false;
      for (int h = kvh * group; h < (kvh + 1) * group; ++h) member = member || h / heads_per_offset == offset;
      for (int n = start + offset; member && n <= pos; n += r) {
        if (once) all.insert(n);
        else rows[kvh].push_back(n);
      }
    }
    if (once) rows[kvh].assign(all.rbegin(), all.rend());
  }
  return rows;
}

struct Timer {
  void* flush;
  cudaEvent_t start, stop;
  Timer() {
    CHECK(cudaMalloc(&flush, 256 << 20));
    CHECK(cudaEventCreate(&start));
    CHECK(cudaEventCreate(&stop));
  }
  template <typename F>
  double median_us(F launch) {
    std::vector<float> ms;
    for (int it = 0; it < 60; ++it) {
      CHECK(cudaMemsetAsync(flush, it, 256 << 20));
      CHECK(cudaEventRecord(start));
      launch();
      CHECK(cudaEventRecord(stop));
      CHECK(cudaEventSynchronize(stop));
      float x;
      CHECK(cudaEventElapsedTime(&x, start, stop));
      if (it >= 10) ms.push_back(x);
    }
    CHECK(cudaGetLastError());
    std::sort(ms.begin(), ms.end());
    return ms[ms.size() / 2] * 1e3;
  }
};

template <int kWarps, int kStages>
double time_gather(Timer& timer, const uint16_t* k, const uint16_t* v, const std::vector<std::vector<int64_t>>& tokens,
                   unsigned* sink, int sms, int* splits_out) {
  const int smem = kWarps * kStages * 2 * kTileBytes;
  CHECK(cudaFuncSetAttribute(gather_rows<kWarps, kStages>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  int per_sm = 0;
  CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, gather_rows<kWarps, kStages>, kWarps * 32, smem));
  const int splits = std::max(1, per_sm * sms / kB);  // one wave, as the decode kernel's grid
  std::vector<int64_t> offsets;
  std::vector<int> starts;
  for (const auto& rows : tokens) {
    const int total = static_cast<int>(rows.size());
    for (int s = 0; s < splits; ++s) {
      starts.push_back(static_cast<int>(offsets.size()) + s * (total / splits) + std::min(s, total % splits));
    }
    offsets.insert(offsets.end(), rows.begin(), rows.end());
  }
  starts.push_back(static_cast<int>(offsets.size()));
  int64_t* d_offsets;
  int* d_starts;
  CHECK(cudaMalloc(&d_offsets, offsets.size() * sizeof(int64_t)));
  CHECK(cudaMalloc(&d_starts, starts.size() * sizeof(int)));
  CHECK(cudaMemcpy(d_offsets, offsets.data(), offsets.size() * sizeof(int64_t), cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(d_starts, starts.data(), starts.size() * sizeof(int), cudaMemcpyHostToDevice));
  const double us = timer.median_us([&] {
    gather_rows<kWarps, kStages><<<dim3(kB, splits), kWarps * 32, smem>>>(k, v, d_offsets, d_starts, sink);
  });
  CHECK(cudaFree(d_offsets));
  CHECK(cudaFree(d_starts));
  *splits_out = splits;
  return us;
}

}  // namespace

int main(int argc, char** argv) {
  const char* out_path = argc > 1 ? argv[1] : "decode_floor.json";
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  const size_t elements = size_t(kB) * kN * kHkv * kD;
  uint16_t *k, *v;
  unsigned* sink;
  CHECK(cudaMalloc(&k, elements * 2));
  CHECK(cudaMalloc(&v, elements * 2));
  CHECK(cudaMemset(k, 1, elements * 2));
  CHECK(cudaMemset(v, 1, elements * 2));
  CHECK(cudaMalloc(&sink, 4096));
  Timer timer;

  const double copy_us =
      timer.median_us([&] { CHECK(cudaMemcpyAsync(v, k, size_t(1) << 30, cudaMemcpyDeviceToDevice)); });
  const double bandwidth = 2.0 * (size_t(1) << 30) / (copy_us * 1e-6);

  int driver = 0, runtime = 0;
  CHECK(cudaDriverGetVersion(&driver));
  CHECK(cudaRuntimeGetVersion(&runtime));
  char date[32];
  const time_t now = time(nullptr);
  strftime(date, sizeof date, "%Y-%m-%dT%H:%M:%SZ", gmtime(&now));
  FILE* json = fopen(out_path, "w");
  if (json == nullptr) {
    fprintf(stderr, "cannot write %s\n", out_path);
    return 1;
  }
  fprintf(json, "{\"date\": \"%s\", \"command\": \"bash benchmarks/run_on_gpu.sh decode_floor\", \"device\": \"%s\", ",
          date, prop.name);
  fprintf(json, "\"cuda_driver\": %d, \"cuda_runtime\": %d, \"copy_bandwidth_GBps\": %.0f, \"rows\": [\n", driver,
          runtime, bandwidth / 1e9);
  printf("device: %s; copy bandwidth %.0f GB/s (read + write)\n", prop.name, bandwidth / 1e9);
  bool first = true;
  // every row's time over the distinct rows' bytes at the copy bandwidth (bench_decode.py's yardstick)
  size_t distinct_rows = 0;
  for (const auto& rows : attended(kN - 1, true)) distinct_rows += rows.size();
  const double ideal_us = double(kB) * distinct_rows * 2 * kD * 2 / bandwidth * 1e6;
  auto record = [&](const char* row, double bytes, double us, const char* config) {
    printf("%-34s %6.1f MiB %6.1f us  %.2fx the copy-bandwidth time  (%s)\n", row, bytes / (1 << 20), us, us / ideal_us,
           config);
    fprintf(json, "%s  {\"row\": \"%s\", \"MiB\": %.1f, \"us\": %.2f, \"over_copy_bandwidth\": %.3f, ",
            first ? "" : ",\n", row, bytes / (1 << 20), us, us / ideal_us);
    fprintf(json, "\"config\": \"%s\"}", config);
    first = false;
  };

  for (bool once : {true, false}) {
    const auto rows = attended(kN - 1, once);
    std::vector<std::vector<int64_t>> tokens(kB);
    for (int b = 0; b < kB; ++b) {
      for (int kvh = 0; kvh < kHkv; ++kvh) {
        for (int n : rows[kvh]) tokens[b].push_back(((int64_t(b) * kN + n) * kHkv + kvh) * kD);
      }
    }
    const double bytes = double(tokens[0].size()) * kB * 2 * kD * 2;
    if (once) {  // the same bytes as one contiguous buffer
      double best = 1e30;
      int best_blocks = 0;
      for (int per_sm : {4, 8, 16}) {
        const int blocks = per_sm * prop.multiProcessorCount;
        const double us = timer.median_us([&] {
          stream_read<<<blocks, 256>>>(reinterpret_cast<const uint4*>(k), size_t(bytes) / 16, sink);
        });
        if (us < best) best = us, best_blocks = blocks;
      }
      char config[64];
      snprintf(config, sizeof config, "%d blocks of 256 threads", best_blocks);
      record("stream (distinct bytes)", bytes, best, config);
    }
    double best = 1e30;
    char config[96] = "";
    auto consider = [&](double us, int warps, int stages, int splits) {
      if (us < best) {
        best = us;
        snprintf(config, sizeof config, "%d warps x %d stages, %d shares a token", warps, stages, splits);
      }
    };
    int splits = 0;
    double us = time_gather<4, 3>(timer, k, v, tokens, sink, prop.multiProcessorCount, &splits);
    consider(us, 4, 3, splits);
    us = time_gather<4, 2>(timer, k, v, tokens, sink, prop.multiProcessorCount, &splits);
    consider(us, 4, 2, splits);
    us = time_gather<8, 3>(timer, k, v, tokens, sink, prop.multiProcessorCount, &splits);
    consider(us, 8, 3, splits);
    us = time_gather<12, 2>(timer, k, v, tokens, sink, prop.multiProcessorCount, &splits);
    consider(us, 12, 2, splits);
    us = time_gather<2, 6>(timer, k, v, tokens, sink, prop.multiProcessorCount, &splits);
    consider(us, 2, 6, splits);
    record(once ? "gather (each row once)" : "gather (a branch at a time)", bytes, best, config);
  }
  fprintf(json, "\n]}\n");
  fclose(json);
  return 0;
}
