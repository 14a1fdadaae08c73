// Device helpers shared by the forward and backward kernels: the thread layout, the grid of a branch
// (block -> batch, head, segment, tile), dtype conversion, and the shared-memory gathers of dilated rows.
// No ATen.
//
// Every kernel runs 128 threads seen as an 8 x 16 grid (ty = threadIdx.x / 16, tx = threadIdx.x % 16).
// A thread owns rows ty * R .. ty * R + R - 1 of a tile (R consecutive rows, read as float4 from
// transposed tiles) and columns tx, tx + 16, ... (strided, so 16 lanes read 16 consecutive words and the
// two rows of a warp broadcast: no bank conflicts). The 16 threads of a row sit in one half-warp, so row
// reductions are shuffles over xor 1, 2, 4, 8.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "launch.h"

namespace dilated_attn {
namespace cuda {

constexpr int kThreads = 128;
constexpr int kRowsY = 8;   // ty in [0, 8)
constexpr int kColsX = 16;  // tx in [0, 16)
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
// A finite start for running maxima keeps rows with no visible key NaN-free: exp2(-inf - m) = 0. The lowest
// finite float (-FLT_MAX), so that rows whose scores all lie below any other start still count.
constexpr float kNoMax = -3.402823466e38f;

template <typename T>
__device__ __forceinline__ float to_float(T x);
template <>
__device__ __forceinline__ float to_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ float to_float<__half>(__half x) { return __half2float(x); }
template <>
__device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

__device__ __forceinline__ float half_warp_max(float x) {
#pragma unroll
  for (int m = 1; m < kColsX; m <<= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, m));
  return x;
}

__device__ __forceinline__ float half_warp_sum(float x) {
#pragma unroll
  for (int m = 1; m < kColsX; m <<= 1) x += __shfl_xor_sync(0xffffffffu, x, m);
  return x;
}

// The members of one segment for one query head: positions first + dilation * j, j < count.
struct Members {
  int64_t first, count;
};

__device__ __forceinline__ Members members_of(const Branch& br, int64_t seq_len, int64_t head, int64_t seg) {
  const int64_t off = br.offset(head);
  return Members{seg * br.seg_len + off, br.members(seq_len, seg, off)};
}

// The 1-D grid of one kernel launch over one branch. Block i owns tile `tile` (members tile * block ..
// tile * block + block - 1) of segment `seg` of head `head` in batch `b`, the tile varying fastest, then
// the segment, the head and the batch: the tiles of one segment run side by side and share its K/V rows
// in L2. The forward and dq grids run over the branch's query heads, the dK/dV grid over all kv heads.
struct GridTile {
  int64_t b, head, seg, tile;
};

struct TileGrid {
  int64_t tiles, segments, head_lo, heads, batch;

  __host__ __device__ int64_t blocks() const { return batch * heads * segments * tiles; }

  // This block's tile.
  __device__ __forceinline__ GridTile block_tile() const {
    const int64_t i = blockIdx.x;
    GridTile t;
    t.tile = i % tiles;
    t.seg = (i / tiles) % segments;
    t.head = head_lo + (i / tiles / segments) % heads;
    t.b = i / tiles / segments / heads;
    return t;
  }
};

// Tiles of `block` members per segment: enough for the longest (offset 0, full length).
__host__ __device__ inline int64_t tiles_per_segment(const Branch& br, int64_t block) {
  return (br.max_members() + block - 1) / block;
}

// Query heads head_lo .. head_hi - 1 of the branch, in tiles of `block` query members.
__host__ __device__ inline TileGrid query_grid(const Branch& br, const AttentionShape& sh, int64_t block) {
  const int64_t segments = br.num_segments(sh.seq_len);
  return TileGrid{tiles_per_segment(br, block), segments, br.head_lo, br.head_hi - br.head_lo, sh.batch};
}

// Every kv head, in tiles of `block` key members.
__host__ __device__ inline TileGrid kv_grid(const Branch& br, const AttentionShape& sh, int64_t block) {
  const int64_t segments = br.num_segments(sh.seq_len);
  return TileGrid{tiles_per_segment(br, block), segments, 0, sh.num_kv_heads, sh.batch};
}

// The largest 1-D grid a launch may ask for (gridDim.x).
constexpr int64_t kMaxGridBlocks = 0x7fffffffLL;

// Rows of a [B, N, H, D] tensor as seen by one (batch, head) and one segment's members.
template <typename T>
struct DilatedRows {
  const T* base;     // element (b, 0, head, 0)
  int64_t stride;    // between positions
  int64_t first;     // position of member 0
  int64_t dilation;  // between members
  int64_t count;     // members
  __device__ __forceinline__ const T* row(int64_t j) const { return base + (first + j * dilation) * stride; }
};

// Leading dimension of a transposed tile of `rows` rows (a multiple of 32): rows + 4, so that LD % 32 == 4
// and gather_transposed stores a warp's 4 rows x 8 dims to 32 distinct banks.
__host__ __device__ constexpr int transposed_ld(int rows) { return rows + 4; }

// Transposed gather: dst[d * LD + i] = rows.row(start + i)[d0 + d] for i < ROWS, d < DC; zero for members
// past the end and dims past `dim`. A warp covers 4 rows x 8 dims per step: short coalesced runs in
// global memory, and 32 distinct banks in shared memory when LD % 32 == 4 (transposed_ld). Each thread
// keeps one dim and steps one row pointer (few registers, so the loads of a few steps can be in flight at
// once).
template <typename T, int ROWS, int DC, int LD>
__device__ __forceinline__ void gather_transposed(float* dst, const DilatedRows<T>& rows, int64_t start, int d0,
                                                  int dim) {
  constexpr int kWarps = kThreads / 32, kDimGroups = DC / 8, kRowStep = 4 * kWarps / kDimGroups;
  static_assert(DC % 8 == 0 && kWarps % kDimGroups == 0 && ROWS % kRowStep == 0, "tile shape");
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int d = (warp % kDimGroups) * 8 + lane % 8;
  const int r = (warp / kDimGroups) * 4 + lane / 8;
  const int64_t j = start + r;
  const T* src = rows.row(j) + d0 + d;
  const int64_t step = kRowStep * rows.dilation * rows.stride;
  const bool dim_ok = d0 + d < dim;
  // All loads first, then all stores: the loads are in flight together (one memory latency per call).
  float x[ROWS / kRowStep];
#pragma unroll
  for (int it = 0; it < ROWS / kRowStep; ++it)
    x[it] = (j + it * kRowStep < rows.count && dim_ok) ? to_float(src[it * step]) : 0.f;
#pragma unroll
  for (int it = 0; it < ROWS / kRowStep; ++it) dst[d * LD + r + it * kRowStep] = x[it];
}

// Row-major gather: dst[i * DMAX + d] = rows.row(start + i)[d] for i < ROWS, d < DMAX; zero elsewhere.
template <typename T, int ROWS, int DMAX>
__device__ __forceinline__ void gather_rows(float* dst, const DilatedRows<T>& rows, int64_t start, int dim) {
  if constexpr (kThreads % DMAX != 0 && DMAX % kThreads != 0) {  // e.g. 96: plain element loop
#pragma unroll 2
    for (int i = threadIdx.x; i < ROWS * DMAX; i += kThreads) {
      const int r = i / DMAX, d = i % DMAX;
      const int64_t j = start + r;
      dst[i] = (j < rows.count && d < dim) ? to_float(rows.row(j)[d]) : 0.f;
    }
  } else {
    // A block step covers kThreads / DMAX rows (or a row takes DMAX / kThreads steps). Loads are issued
    // 8 at a time before their stores, so memory latency is paid ROWS * DMAX / (8 * kThreads) times.
    constexpr int kStepRows = DMAX >= kThreads ? 1 : kThreads / DMAX;
    constexpr int kSteps = ROWS * DMAX / kThreads, kBatch = kSteps < 8 ? kSteps : 8;
    static_assert(kSteps % kBatch == 0, "batches");
    const int d0 = DMAX >= kThreads ? threadIdx.x : threadIdx.x % DMAX;
    const int r0 = DMAX >= kThreads ? 0 : threadIdx.x / DMAX;
#pragma unroll 1
    for (int b = 0; b < kSteps; b += kBatch) {
      float x[kBatch];
#pragma unroll
      for (int i = 0; i < kBatch; ++i) {
        const int s = b + i;
        const int r = DMAX >= kThreads ? s / (DMAX / kThreads) : r0 + s * kStepRows;
        const int d = DMAX >= kThreads ? d0 + (s % (DMAX / kThreads)) * kThreads : d0;
        const int64_t j = start + r;
        x[i] = (j < rows.count && d < dim) ? to_float(rows.row(j)[d]) : 0.f;
      }
#pragma unroll
      for (int i = 0; i < kBatch; ++i) {
        const int s = b + i;
        const int r = DMAX >= kThreads ? s / (DMAX / kThreads) : r0 + s * kStepRows;
        const int d = DMAX >= kThreads ? d0 + (s % (DMAX / kThreads)) * kThreads : d0;
        dst[r * DMAX + d] = x[i];
      }
    }
  }
}

// Reads 8 or 4 consecutive floats (16-byte aligned) of shared memory.
template <int R>
__device__ __forceinline__ void load_row_values(float (&x)[R], const float* src) {
  static_assert(R % 4 == 0, "rows per thread");
#pragma unroll
  for (int i = 0; i < R; i += 4) {
    const float4 v = *reinterpret_cast<const float4*>(src + i);
    x[i] = v.x;
    x[i + 1] = v.y;
    x[i + 2] = v.z;
    x[i + 3] = v.w;
  }
}

template <int R>
__device__ __forceinline__ void store_row_values(float* dst, const float (&x)[R]) {
#pragma unroll
  for (int i = 0; i < R; i += 4) *reinterpret_cast<float4*>(dst + i) = make_float4(x[i], x[i + 1], x[i + 2], x[i + 3]);
}

// The N columns a thread (column index tx of kColsX) owns of a row of kColsX * N: groups of V floats (the widest
// of 4, 2, 1 dividing N), contiguous per thread, so that a row's threads read one contiguous span per vector load
// (no bank conflicts) and a thread issues N / V loads instead of N.
template <int N>
__host__ __device__ constexpr int col_vector() {
  return N % 4 == 0 ? 4 : (N % 2 == 0 ? 2 : 1);
}

template <int N>
__device__ __forceinline__ int thread_col(int tx, int j) {
  constexpr int V = col_vector<N>();
  return (j / V) * (kColsX * V) + tx * V + j % V;
}

template <int N>
__device__ __forceinline__ void load_thread_cols(float (&x)[N], const float* row, int tx) {
  constexpr int V = col_vector<N>();
#pragma unroll
  for (int g = 0; g < N / V; ++g) {
    const float* src = row + g * (kColsX * V) + tx * V;
    if constexpr (V == 4) {
      const float4 v = *reinterpret_cast<const float4*>(src);
      x[4 * g] = v.x, x[4 * g + 1] = v.y, x[4 * g + 2] = v.z, x[4 * g + 3] = v.w;
    } else if constexpr (V == 2) {
      const float2 v = *reinterpret_cast<const float2*>(src);
      x[2 * g] = v.x, x[2 * g + 1] = v.y;
    } else {
      x[g] = *src;
    }
  }
}

// The current device's shared memory per block with opt-in (48 KiB without).
inline size_t max_shared_memory_per_block() {
  int device = 0, bytes = 48 * 1024;
  if (cudaGetDevice(&device) == cudaSuccess)
    cudaDeviceGetAttribute(&bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  return static_cast<size_t>(bytes);
}

// Head-dim buckets compiled: the smallest of 32, 64, 96, 128, 256 that holds `dim`.
template <typename F>
cudaError_t dispatch_head_dim(int64_t dim, F&& launch) {
  if (dim <= 32) return launch(std::integral_constant<int, 32>{});
  if (dim <= 64) return launch(std::integral_constant<int, 64>{});
  if (dim <= 96) return launch(std::integral_constant<int, 96>{});
  if (dim <= 128) return launch(std::integral_constant<int, 128>{});
  if (dim <= 256) return launch(std::integral_constant<int, 256>{});
  return cudaErrorInvalidValue;
}

// Storage types: the kernel template argument for a ScalarKind.
template <typename F>
cudaError_t dispatch_scalar(ScalarKind kind, F&& launch) {
  switch (kind) {
    case ScalarKind::kHalf: return launch(__half{});
    case ScalarKind::kBFloat16: return launch(__nv_bfloat16{});
    case ScalarKind::kFloat: return launch(float{});
  }
  return cudaErrorInvalidValue;
}

}  // namespace cuda
}  // namespace dilated_attn
