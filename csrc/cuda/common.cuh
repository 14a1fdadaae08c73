// Device helpers shared by the forward and backward kernels: the thread layout, the grid of a branch
// (block -> batch, head, segment, tile), dtype conversion, and the shared-memory gathers of dilated rows.
// No ATen.
//
// The kernels' threads form 8 x 16 grids of 128 (one a block in the forward, two in the backward: attention_bwd.cu;
// the forward's 256 threads at head dim 64 from Volta on form one 16 x 16 grid); in a grid, ty = t / 16 and
// tx = t % 16.
// A thread owns rows ty * R .. ty * R + R - 1 of a tile (R consecutive rows, read as vectors from
// transposed tiles) and the columns thread_col(tx, j) (groups of up to 4 contiguous columns, a row's 16
// threads side by side: each vector load of a half-warp reads one contiguous span, and the two rows of a
// warp broadcast, so no bank conflicts). The 16 threads of a row sit in one half-warp, so row reductions are
// shuffles over xor 1, 2, 4, 8.
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

__device__ __forceinline__ float half_warp_sum(float x) {
#pragma unroll
  for (int m = 1; m < kColsX; m <<= 1) x += __shfl_xor_sync(0xffffffffu, x, m);
  return x;
}

// The members of one segment for one query head: positions first + dilation * j, j < count. Positions and
// member indices are 32-bit in the kernels (the launchers take seq_len < kMaxSeqLen, 2^31): fewer registers,
// which the tiles need.
struct Members {
  int first, count;
};

__device__ __forceinline__ Members members_of(const Branch& br, int64_t seq_len, int head, int seg) {
  const int64_t off = br.offset(head);
  return Members{static_cast<int>(seg * br.seg_len + off), static_cast<int>(br.members(seq_len, seg, off))};
}

// The 1-D grid of one kernel launch over one branch. Block i owns tile `tile` (members tile * block ..
// tile * block + block - 1) of segment `seg` of head `head` in batch `b`, the tile varying fastest, then
// the segment, the head and the batch: the tiles of one segment run side by side and share its K/V rows
// in L2. The forward and dq grids run over the branch's query heads, the dK/dV grid over all kv heads.
struct GridTile {
  int b, head, seg, tile;
};

struct TileGrid {
  int64_t tiles, segments, head_lo, heads, batch;

  __host__ __device__ int64_t blocks() const { return batch * heads * segments * tiles; }

  // This block's tile (32-bit arithmetic: the grid has fewer than 2^31 blocks, kMaxGridBlocks).
  __device__ __forceinline__ GridTile block_tile() const {
    const int i = blockIdx.x, n_tiles = static_cast<int>(tiles), n_segments = static_cast<int>(segments);
    GridTile t;
    t.tile = i % n_tiles;
    t.seg = (i / n_tiles) % n_segments;
    t.head = static_cast<int>(head_lo) + (i / n_tiles / n_segments) % static_cast<int>(heads);
    t.b = i / n_tiles / n_segments / static_cast<int>(heads);
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

// Rows of a [B, N, H, D] tensor as seen by one (batch, head) and one segment's members: member j is row
// first + j * step.
//
// The kernels keep theirs in shared memory (thread 0 writes them before a barrier) and read them through a
// SharedRows reference: they are the same for the whole block, and Pascal has no uniform registers, so held in
// registers the three or four of a kernel take about 15 a thread from the tiles. `volatile`
// makes the compiler read them where a gather uses them instead of hoisting them back into registers.
template <typename T>
struct DilatedRows {
  const T* first;  // member 0's row
  int64_t step;    // elements between members (dilation * stride between positions)
  int count;       // members
  __device__ __forceinline__ const T* row(int j) const { return first + j * step; }
};

template <typename T>
using SharedRows = const volatile DilatedRows<T>&;

// A gather's own copy of the shared descriptor: read once at the gather's start (three shared loads), held in
// registers only for the gather, so that its per-element address arithmetic does not re-read shared memory.
template <typename T>
__device__ __forceinline__ DilatedRows<T> read_rows(SharedRows<T> rows) {
  return DilatedRows<T>{rows.first, rows.step, rows.count};
}

// One element of a (read-only during the kernel) input through the non-coherent global load path, in its own dtype:
// the split gathers below convert at the store, so that no instruction waits on the load until then.
template <typename T>
__device__ __forceinline__ T load_input(const T* x) {
  return __ldg(x);
}

// Zero in a storage type (for members past the end and dims past the head dim).
template <typename T>
__device__ __forceinline__ T zero_of();
template <>
__device__ __forceinline__ float zero_of<float>() { return 0.f; }
template <>
__device__ __forceinline__ __half zero_of<__half>() { return __ushort_as_half(0); }
template <>
__device__ __forceinline__ __nv_bfloat16 zero_of<__nv_bfloat16>() { return __ushort_as_bfloat16(0); }

// The rows of tensor x (strides s) for batch b and head `head` at one segment's members.
template <typename T>
__device__ __forceinline__ DilatedRows<T> rows_of(const void* x, const Strides& s, int b, int head, const Members& mem,
                                                  int64_t dilation) {
  return DilatedRows<T>{static_cast<const T*>(x) + b * s.batch + head * s.head + mem.first * s.seq, dilation * s.seq,
                        mem.count};
}

// Leading dimension of a transposed tile of `rows` rows (a multiple of 8): rows + 4, so that LD / 4 is odd and
// gather_transposed stores a warp's 4 rows x 8 dims to 32 distinct banks (d * LD mod 32 takes 8 distinct
// multiples of 4 for d < 8).
__host__ __device__ constexpr int transposed_ld(int rows) { return rows + 4; }

// The gathers below are split in two: load() issues one tile's global loads into kRegs registers a thread (values of
// the input dtype T), store() converts them to fp32 and writes them to shared memory. A kernel issues the next
// tile's loads right after the barrier that publishes the current tile and stores them after computing on it, so
// the loads are in flight during the computation (double buffering through registers: one shared tile, kRegs
// registers). gather_transposed loads and stores at once.

// The loads of both split gathers below: x[it * COLS + k] = rows.row(start + r + it * ROW_STEP)[col + k * COL_STRIDE]
// for it < STEPS, k < COLS, stepping one row pointer; zero for members past the end, columns past `dim` and rows past
// the tile's ROWS.
template <typename T, int ROWS, int STEPS, int ROW_STEP, int COLS, int COL_STRIDE>
__device__ __forceinline__ void load_tile_elements(T* x, SharedRows<T> shared_rows, int start, int r, int col,
                                                   int dim) {
  const DilatedRows<T> rows = read_rows(shared_rows);
  const int j = start + r;
  const T* src = rows.row(j) + col;
  const int64_t step = ROW_STEP * rows.step;
#pragma unroll
  for (int it = 0; it < STEPS; ++it) {
    const bool row_ok = j + it * ROW_STEP < rows.count && (ROWS % ROW_STEP == 0 || r + it * ROW_STEP < ROWS);
#pragma unroll
    for (int k = 0; k < COLS; ++k)
      x[it * COLS + k] = (row_ok && col + k * COL_STRIDE < dim) ? load_input(src + k * COL_STRIDE) : zero_of<T>();
    src += step;
  }
}

// Transposed tile: dst[d * LD + i] = rows.row(start + i)[d0 + d] for i < ROWS, d < DC; zero for members past the
// end and dims past `dim`, by all THREADS threads of the block. A warp covers 4 rows x 8 dims per step: short
// coalesced runs in global memory, and 32 distinct banks in shared memory with transposed_ld. Each thread keeps one
// dim and steps one row pointer; a tile of fewer rows than the block covers in one step leaves the other warps
// idle.
template <typename T, int ROWS, int DC, int LD, int THREADS>
struct TransposedTile {
  static constexpr int kWarps = THREADS / 32, kDimGroups = DC / 8, kRowStep = 4 * kWarps / kDimGroups;
  static constexpr int kRegs = (ROWS + kRowStep - 1) / kRowStep;
  static_assert(DC % 8 == 0 && kWarps % kDimGroups == 0 && ROWS % 4 == 0, "tile shape");

  __device__ static int dim_of_thread() { return (threadIdx.x / 32 % kDimGroups) * 8 + threadIdx.x % 8; }
  __device__ static int row_of_thread() { return (threadIdx.x / 32 / kDimGroups) * 4 + threadIdx.x % 32 / 8; }
  __device__ static bool in_tile(int r, int it) { return ROWS % kRowStep == 0 || r + it * kRowStep < ROWS; }

  __device__ __forceinline__ static void load(T* x, SharedRows<T> rows, int start, int d0, int dim) {
    load_tile_elements<T, ROWS, kRegs, kRowStep, 1, 1>(x, rows, start, row_of_thread(), d0 + dim_of_thread(), dim);
  }

  __device__ __forceinline__ static void store(float* dst, const T* x) {
    const int d = dim_of_thread(), r = row_of_thread();
#pragma unroll
    for (int it = 0; it < kRegs; ++it)
      if (in_tile(r, it)) dst[d * LD + r + it * kRowStep] = to_float(x[it]);
  }
};

// Row-major tile: dst[i * DIMS + d] = rows.row(start + i)[d0 + d] for i < ROWS, d < DIMS; zero for members past the
// end and dims past `dim`, by all THREADS threads of the block. Groups of G threads (G = the largest power of two
// dividing DIMS, at most THREADS) read G contiguous elements of one row; a thread takes the columns c + G * k of
// its row and steps one row pointer THREADS / G rows at a time. Every load instruction of a warp reads runs of
// contiguous elements, every store writes one contiguous span (no bank conflicts), and DIMS need not be a power of
// two (96, 48). A tile of fewer rows than the block covers in one step leaves the other threads idle.
template <typename T, int ROWS, int DIMS, int THREADS>
struct RowTile {
  static constexpr int kGroup = (DIMS & -DIMS) < THREADS ? (DIMS & -DIMS) : THREADS;
  static constexpr int kRowStep = THREADS / kGroup, kCols = DIMS / kGroup;
  static constexpr int kSteps = (ROWS + kRowStep - 1) / kRowStep;
  static constexpr int kRegs = kSteps * kCols;

  __device__ static int row_of_thread() { return threadIdx.x / kGroup; }
  __device__ static int col_of_thread() { return threadIdx.x % kGroup; }
  __device__ static bool in_tile(int r, int it) { return ROWS % kRowStep == 0 || r + it * kRowStep < ROWS; }

  __device__ __forceinline__ static void load(T* x, SharedRows<T> rows, int start, int d0, int dim) {
    load_tile_elements<T, ROWS, kSteps, kRowStep, kCols, kGroup>(x, rows, start, row_of_thread(),
                                                                   d0 + col_of_thread(), dim);
  }

  __device__ __forceinline__ static void store(float* dst, const T* x) {
    const int r = row_of_thread(), c = col_of_thread();
#pragma unroll
    for (int it = 0; it < kSteps; ++it)
      if (in_tile(r, it)) {
#pragma unroll
        for (int k = 0; k < kCols; ++k) dst[(r + it * kRowStep) * DIMS + c + k * kGroup] = to_float(x[it * kCols + k]);
      }
  }
};

template <typename T, int ROWS, int DC, int LD, int THREADS = kThreads>
__device__ __forceinline__ void gather_transposed(float* dst, SharedRows<T> rows, int start, int d0, int dim) {
  using Tile = TransposedTile<T, ROWS, DC, LD, THREADS>;
  T x[Tile::kRegs];
  Tile::load(x, rows, start, d0, dim);
  Tile::store(dst, x);
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

// V consecutive floats of shared memory (V = 4, 2 or 1, aligned to V floats) in one vector load or store.
template <int V>
__device__ __forceinline__ void load_vector(float* x, const float* src) {
  if constexpr (V == 4) {
    const float4 v = *reinterpret_cast<const float4*>(src);
    x[0] = v.x, x[1] = v.y, x[2] = v.z, x[3] = v.w;
  } else if constexpr (V == 2) {
    const float2 v = *reinterpret_cast<const float2*>(src);
    x[0] = v.x, x[1] = v.y;
  } else {
    x[0] = *src;
  }
}

template <int V>
__device__ __forceinline__ void store_vector(float* dst, const float* x) {
  if constexpr (V == 4) {
    *reinterpret_cast<float4*>(dst) = make_float4(x[0], x[1], x[2], x[3]);
  } else if constexpr (V == 2) {
    *reinterpret_cast<float2*>(dst) = make_float2(x[0], x[1]);
  } else {
    *dst = x[0];
  }
}

template <int N>
__device__ __forceinline__ void load_thread_cols(float (&x)[N], const float* row, int tx) {
  constexpr int V = col_vector<N>();
#pragma unroll
  for (int g = 0; g < N / V; ++g) load_vector<V>(x + g * V, row + g * (kColsX * V) + tx * V);
}

// Reads R consecutive floats of shared memory (aligned to the widest vector dividing R: col_vector).
template <int R>
__device__ __forceinline__ void load_row_values(float (&x)[R], const float* src) {
  constexpr int V = col_vector<R>();
#pragma unroll
  for (int i = 0; i < R; i += V) load_vector<V>(x + i, src + i);
}

// Writes R consecutive floats of shared memory, as load_row_values reads them.
template <int R>
__device__ __forceinline__ void store_row_values(float* dst, const float (&x)[R]) {
  constexpr int V = col_vector<R>();
#pragma unroll
  for (int i = 0; i < R; i += V) store_vector<V>(dst + i, x + i);
}

// A thread's R x C register tile into a shared [column][row] tile of leading dimension LD, column by column: the
// thread's column c (thread_col<C>(tx, c)) at dst + column * LD + ty * R, its R rows contiguous.
template <int LD, int R, int C>
__device__ __forceinline__ void store_tile_columns(float* dst, const float (&tile)[R][C], int ty, int tx) {
#pragma unroll
  for (int c = 0; c < C; ++c) {
    float col[R];
#pragma unroll
    for (int r = 0; r < R; ++r) col[r] = tile[r][c];
    store_row_values(dst + thread_col<C>(tx, c) * LD + ty * R, col);
  }
}

// The register-tiled products of every kernel: acc[r][c] += a[d * LDA + r] * b[d * LDB + thread_col<C>(tx, c)] for
// d < STEPS, a thread's R rows read as vectors and its C columns of a row shared by kColsX threads. With PIPELINE
// the operands of step d + 1 are loaded before the FMAs of step d (two register sets), so that the shared loads'
// latency hides behind R x C FMAs instead of stalling the warp; without it, UNROLL steps are unrolled and the
// compiler schedules them in the registers it has.
template <int STEPS, int LDA, int LDB, int UNROLL, bool PIPELINE, int R, int C>
__device__ __forceinline__ void accumulate_products(float (&acc)[R][C], const float* a, const float* b, int tx) {
  if constexpr (PIPELINE) {
    float a_reg[2][R], b_reg[2][C];
    load_row_values(a_reg[0], a);
    load_thread_cols(b_reg[0], b, tx);
#pragma unroll
    for (int d = 0; d < STEPS; ++d) {
      if (d + 1 < STEPS) {
        load_row_values(a_reg[(d + 1) % 2], a + (d + 1) * LDA);
        load_thread_cols(b_reg[(d + 1) % 2], b + (d + 1) * LDB, tx);
      }
#pragma unroll
      for (int r = 0; r < R; ++r)
#pragma unroll
        for (int c = 0; c < C; ++c) acc[r][c] = fmaf(a_reg[d % 2][r], b_reg[d % 2][c], acc[r][c]);
    }
  } else {
#pragma unroll(UNROLL)
    for (int d = 0; d < STEPS; ++d) {
      float a_reg[R], b_reg[C];
      load_row_values(a_reg, a + d * LDA);
      load_thread_cols(b_reg, b + d * LDB, tx);
#pragma unroll
      for (int r = 0; r < R; ++r)
#pragma unroll
        for (int c = 0; c < C; ++c) acc[r][c] = fmaf(a_reg[r], b_reg[c], acc[r][c]);
    }
  }
}

// accumulate_products with b stored transposed: acc[r][c] += a[k * LDA + r] * b_t[(c * kColsX + tx) * LDB + k] for
// k < STEPS (a thread's columns tx, tx + kColsX, ...), so that a kernel holding an operand transposed for one product
// (a step's Q^T) need not gather its rows again for the next. Four k at a time: a column's 4 consecutive k in one
// vector load (R = 8, C = 4: 3 shared loads per 32 FMAs, as accumulate_products), and the 8 threads of a quarter-warp
// on distinct banks where LDB / 4 is odd (transposed_ld). The groups are not unrolled: one group's 48 operand
// registers beside a thread's accumulators and its kernel's prefetch stage already fill its 128.
template <int STEPS, int LDA, int LDB, int R, int C>
__device__ __forceinline__ void accumulate_products_b_transposed(float (&acc)[R][C], const float* a, const float* b_t,
                                                                 int tx) {
  static_assert(STEPS % 4 == 0 && LDB % 4 == 0, "four aligned k a vector load");
#pragma unroll 1
  for (int k0 = 0; k0 < STEPS; k0 += 4) {
    float a_reg[4][R], b_reg[C][4];
#pragma unroll
    for (int i = 0; i < 4; ++i) load_row_values(a_reg[i], a + (k0 + i) * LDA);
#pragma unroll
    for (int c = 0; c < C; ++c) load_vector<4>(b_reg[c], b_t + (c * kColsX + tx) * LDB + k0);
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int r = 0; r < R; ++r)
#pragma unroll
        for (int c = 0; c < C; ++c) acc[r][c] = fmaf(a_reg[i][r], b_reg[c][i], acc[r][c]);
  }
}

// Whether this compilation's device code holds the kernels of tile table TILES (launch.h): code for sm_6x holds
// Pascal's two, code for sm_70 and newer Volta's (and Pascal's too in a DILATED_ATTN_PASCAL_PROXY build). The kernels
// of the other tables compile to an empty body there: an architecture's code holds only what it can launch (sm_6x
// code holds both Pascal tables, since a build for 6.0 also runs on a 6.1 GPU). The host pass, without
// __CUDA_ARCH__, sees all.
template <TileTable TILES>
__host__ __device__ constexpr bool tiles_built() {
#if !defined(__CUDA_ARCH__)
  return true;
#elif __CUDA_ARCH__ < 700
  return is_pascal(TILES);
#else
  return TILES == TileTable::kVolta || kPascalProxy;
#endif
}

// The host side of the launches. NVRTC, which the compile check for Pascal uses (tools/check_cuda_kernels.sh),
// takes device code only.
#ifndef __CUDACC_RTC__

// The current device's shared memory per block with opt-in (48 KiB without).
inline size_t max_shared_memory_per_block() {
  int device = 0, bytes = 48 * 1024;
  if (cudaGetDevice(&device) == cudaSuccess)
    cudaDeviceGetAttribute(&bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  return static_cast<size_t>(bytes);
}

// Whether `blocks` blocks of `bytes` dynamic shared memory each (plus 2 KiB for the static arrays and the
// runtime's reserve) fit one SM of the current device, and one fits a block.
inline bool blocks_fit_shared_memory(size_t bytes, int blocks) {
  int device = 0, per_sm = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, device) != cudaSuccess)
    return false;
  return bytes <= max_shared_memory_per_block() && blocks * (bytes + 2048) <= static_cast<size_t>(per_sm);
}

// Launches kernel(p) with `bytes` of dynamic shared memory. Above 48 KiB a kernel must opt in, and several blocks of
// tens of KiB an SM need the largest shared-memory carveout of L1; both are harmless to repeat, so nothing is
// cached per device.
template <typename Kernel, typename Params>
cudaError_t launch_with_shared(Kernel kernel, dim3 grid, int threads, size_t bytes, cudaStream_t stream,
                               const Params& p) {
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                         cudaSharedmemCarveoutMaxShared);
  if (err == cudaSuccess && bytes > 48 * 1024)
    err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
  if (err != cudaSuccess) return err;
  kernel<<<grid, threads, bytes, stream>>>(p);
  return cudaGetLastError();
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

// The tile table as a compile-time constant for the kernel templates.
template <typename F>
cudaError_t dispatch_tiles(TileTable tiles, F&& launch) {
  if (tiles == TileTable::kPascal) return launch(std::integral_constant<TileTable, TileTable::kPascal>{});
  if (tiles == TileTable::kGp100) return launch(std::integral_constant<TileTable, TileTable::kGp100>{});
  return launch(std::integral_constant<TileTable, TileTable::kVolta>{});
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

#endif  // __CUDACC_RTC__

}  // namespace cuda
}  // namespace dilated_attn
