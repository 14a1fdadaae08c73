// The cudnn backend's two kernels between its cuDNN calls (csrc/cuda/cudnn_steps.cpp): the merge of one call's
// (out, lse) into the running result, and the addition of one call's gradients into the whole ones. Both are
// memory-bound passes over [b, h, s, d] views; a block takes kRows rows of one (b, h), 16 bytes a thread and
// load where the views allow. No ATen.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "common.cuh"
#include "launch.h"

namespace dilated_attn {
namespace cuda {
namespace {

constexpr int kMergeThreads = 128;
constexpr int kRows = 32;

// kWidth elements of one row: 16-byte loads and stores where the view allows them (kWidth * sizeof(T) = 16, or 32 for
// a float32 sum of eight 16-bit gradients), else element by element.
template <typename T, int kWidth>
struct Chunk {
  T x[kWidth];

  __device__ __forceinline__ void load(const T* p) {
    if constexpr (kWidth * sizeof(T) == 16) {
      *reinterpret_cast<uint4*>(x) = *reinterpret_cast<const uint4*>(p);
    } else if constexpr (kWidth * sizeof(T) == 32) {
      reinterpret_cast<uint4*>(x)[0] = reinterpret_cast<const uint4*>(p)[0];
      reinterpret_cast<uint4*>(x)[1] = reinterpret_cast<const uint4*>(p)[1];
    } else {
#pragma unroll
      for (int i = 0; i < kWidth; ++i) x[i] = p[i];
    }
  }
  __device__ __forceinline__ void store(T* p) const {
    if constexpr (kWidth * sizeof(T) == 16) {
      *reinterpret_cast<uint4*>(p) = *reinterpret_cast<const uint4*>(x);
    } else if constexpr (kWidth * sizeof(T) == 32) {
      reinterpret_cast<uint4*>(p)[0] = reinterpret_cast<const uint4*>(x)[0];
      reinterpret_cast<uint4*>(p)[1] = reinterpret_cast<const uint4*>(x)[1];
    } else {
#pragma unroll
      for (int i = 0; i < kWidth; ++i) p[i] = x[i];
    }
  }
};

template <typename T>
__device__ __forceinline__ T* row_of(const RowsView& v, int64_t b, int64_t h, int64_t row) {
  return static_cast<T*>(v.data) + b * v.sb + h * v.sh + row * v.ss;
}

// blockIdx.x runs over b * h; blockIdx.y over blocks of kRows rows, each block taking every gridDim.y-th (the grid's
// y is at most 65535).
__device__ __forceinline__ int64_t first_row_block() { return static_cast<int64_t>(blockIdx.y) * kRows; }
__device__ __forceinline__ int64_t row_block_step() { return static_cast<int64_t>(gridDim.y) * kRows; }
__device__ __forceinline__ int rows_from(int64_t row0, int64_t n_rows) {
  return static_cast<int>(n_rows - row0 < kRows ? n_rows - row0 : kRows);
}

template <typename T, int kWidth>
__global__ void __launch_bounds__(kMergeThreads) merge_kernel(const MergeParams p) {
  __shared__ float w_acc[kRows], w_new[kRows];
  const int64_t b = blockIdx.x / p.h, h = blockIdx.x % p.h;
  const int chunks = static_cast<int>(p.d / kWidth);
  for (int64_t row0 = first_row_block(); row0 < p.s; row0 += row_block_step()) {
    const int rows = rows_from(row0, p.s);
    if (p.store) {  // the rows' first result: copied, nothing read
      for (int r = threadIdx.x; r < rows; r += blockDim.x) {
        *row_of<float>(p.lse, b, h, row0 + r) = *row_of<float>(p.part_lse, b, h, row0 + r);
      }
      for (int i = threadIdx.x; i < rows * chunks; i += blockDim.x) {
        const int r = i / chunks, col = (i - r * chunks) * kWidth;
        Chunk<T, kWidth> part;
        part.load(row_of<T>(p.part_out, b, h, row0 + r) + col);
        part.store(row_of<T>(p.out, b, h, row0 + r) + col);
      }
      continue;  // no shared memory used: no barrier needed
    }
    // The weights first, one thread a row (which alone reads and writes its LSE), then the rows' elements.
    for (int r = threadIdx.x; r < rows; r += blockDim.x) {
      float* lse = row_of<float>(p.lse, b, h, row0 + r);
      const float acc = *lse, part = *row_of<float>(p.part_lse, b, h, row0 + r);
      const bool covered = !(acc == -INFINITY && part == -INFINITY);  // a NaN counts as covered
      float top = (acc > part || isnan(acc)) ? acc : part;             // the max, NaN if either is
      if (!covered) top = 0.f;
      const float e_acc = expf(acc - top), e_new = expf(part - top);
      const float total = covered ? e_acc + e_new : 1.f;
      w_acc[r] = e_acc / total;
      w_new[r] = e_new / total;
      *lse = covered ? logf(total) + top : -INFINITY;
    }
    __syncthreads();
    for (int i = threadIdx.x; i < rows * chunks; i += blockDim.x) {
      const int r = i / chunks, col = (i - r * chunks) * kWidth;
      // a part of weight 0 (its LSE -inf) is not read: a packed call leaves the rows between its runs unwritten
      if (w_new[r] == 0.f && w_acc[r] == 1.f) continue;
      T* out = row_of<T>(p.out, b, h, row0 + r) + col;
      Chunk<T, kWidth> acc, part;
      acc.load(out);
      const bool read_part = w_new[r] != 0.f;
      if (read_part) part.load(row_of<T>(p.part_out, b, h, row0 + r) + col);
#pragma unroll
      for (int j = 0; j < kWidth; ++j) {
        const float from_part = read_part ? to_float(part.x[j]) * w_new[r] : 0.f;
        acc.x[j] = from_float<T>(to_float(acc.x[j]) * w_acc[r] + from_part);
      }
      acc.store(out);
    }
    __syncthreads();  // before the next row block's weights
  }
}

// T: the gradients' type; Acc: the sums' (T, or float32 for the float32 sums of 16-bit gradients).
template <typename T, typename Acc, int kWidth>
__global__ void __launch_bounds__(kMergeThreads) accumulate_kernel(const AccumulateParams p) {
  const int64_t b = blockIdx.x / p.h, h = blockIdx.x % p.h;
  const int chunks = static_cast<int>(p.d / kWidth);
  for (int64_t row0 = first_row_block(); row0 < p.s; row0 += row_block_step()) {
    const int rows = rows_from(row0, p.s);
    for (int i = threadIdx.x; i < rows * chunks; i += blockDim.x) {
      const int r = i / chunks, col = (i - r * chunks) * kWidth;
#pragma unroll
      for (int t = 0; t < 3; ++t) {
        if (t >= p.tensors) break;
        Acc* dst = row_of<Acc>(p.dst[t], b, h, row0 + r) + col;
        Chunk<T, kWidth> part;
        part.load(row_of<T>(p.src[t], b, h, row0 + r) + col);
        Chunk<Acc, kWidth> sum;
        if (!p.store) sum.load(dst);
#pragma unroll
        for (int j = 0; j < kWidth; ++j) {
          sum.x[j] = from_float<Acc>((p.store ? 0.f : to_float(sum.x[j])) + to_float(part.x[j]));
        }
        sum.store(dst);
      }
    }
  }
}

dim3 rows_grid(int64_t b, int64_t h, int64_t s) {
  const int64_t row_blocks = (s + kRows - 1) / kRows;
  return dim3(static_cast<unsigned>(b * h), static_cast<unsigned>(row_blocks < 65535 ? row_blocks : 65535));
}

template <template <typename, int> class Kernel, typename Params>
cudaError_t launch_rows(const Params& p, ScalarKind kind, bool vectorized, cudaStream_t stream) {
  if (p.b * p.h == 0 || p.s == 0 || p.d == 0) return cudaSuccess;
  const dim3 grid = rows_grid(p.b, p.h, p.s);
  switch (kind) {
    case ScalarKind::kHalf:
      vectorized ? Kernel<__half, 8>::launch(grid, p, stream) : Kernel<__half, 1>::launch(grid, p, stream);
      break;
    case ScalarKind::kBFloat16:
      vectorized ? Kernel<__nv_bfloat16, 8>::launch(grid, p, stream)
                 : Kernel<__nv_bfloat16, 1>::launch(grid, p, stream);
      break;
    case ScalarKind::kFloat:
      vectorized ? Kernel<float, 4>::launch(grid, p, stream) : Kernel<float, 1>::launch(grid, p, stream);
      break;
  }
  return cudaGetLastError();
}

template <typename T, int kWidth>
struct Merge {
  static void launch(dim3 grid, const MergeParams& p, cudaStream_t stream) {
    merge_kernel<T, kWidth><<<grid, kMergeThreads, 0, stream>>>(p);
  }
};

template <typename T, int kWidth>
struct Accumulate {
  static void launch(dim3 grid, const AccumulateParams& p, cudaStream_t stream) {
    if constexpr (!std::is_same_v<T, float>) {
      if (p.float_sums) {
        accumulate_kernel<T, float, kWidth><<<grid, kMergeThreads, 0, stream>>>(p);
        return;
      }
    }
    accumulate_kernel<T, T, kWidth><<<grid, kMergeThreads, 0, stream>>>(p);
  }
};

}  // namespace

cudaError_t launch_merge(const MergeParams& p, ScalarKind kind, bool vectorized, cudaStream_t stream) {
  return launch_rows<Merge>(p, kind, vectorized, stream);
}

cudaError_t launch_accumulate(const AccumulateParams& p, ScalarKind kind, bool vectorized, cudaStream_t stream) {
  return launch_rows<Accumulate>(p, kind, vectorized, stream);
}

}  // namespace cuda
}  // namespace dilated_attn
