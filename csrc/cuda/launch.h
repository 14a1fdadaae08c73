// The CUDA kernels' plain launch API: parameter structs of pointers, strides and sizes, and one launch
// function per kernel family. No ATen here (the launchers in attention_cuda.cpp translate tensors into
// these structs), so the kernel files compile with nvcc alone, for any target, without torch.
#pragma once

#include <cuda_runtime.h>

#include "../params.h"

namespace dilated_attn {
namespace cuda {

enum class ScalarKind { kHalf, kBFloat16, kFloat };

// Tile tables. Every kernel is compiled with the tiles of two GPU generations, and the launchers take the one to
// run (attention_cuda.cpp picks it from the device's compute capability). The kernels' tile structs hold the
// sizes:
// - kPascalTiles, below sm_70 (Pascal: 64K registers, 96 KiB of shared memory an SM, no tensor cores): small tiles,
//   at most 64 registers a thread and 12 KiB (forward, 128 threads) or 24 KiB (backward, 256 threads) of shared
//   memory a block, so that 32 warps (50% occupancy) are resident and hide latency. tools/check_cuda_kernels.sh
//   fails when a Pascal variant spills or needs more.
// - kVoltaTiles, sm_70 and newer (up to 255 registers and 227 KiB of shared memory a block): larger tiles, more
//   products per load, 2-4 blocks an SM.
constexpr int kPascalTiles = 61;
constexpr int kVoltaTiles = 70;

// Head dims are compiled for 32, 64, 96, 128 and 256; other sizes up to 256 run in the next larger one
// with the extra columns zero.
constexpr int64_t kMaxHeadDim = 256;

// Positions and member indices are 32-bit in the kernels (fewer registers, which Pascal's tiles need).
constexpr int64_t kMaxSeqLen = int64_t{1} << 31;

// One branch of the forward: merges the branch's (out_i, lse_i) into the running (out, lse) in place.
struct ForwardParams {
  const void *q, *k, *v;
  void* out;   // [B, N, Hq, D] in the input dtype, the running merged output
  float* lse;  // [B, Hq, N] contiguous, the running merged LSE (natural log)
  Strides sq, sk, sv, so;
  AttentionShape shape;
  Branch branch;
};

// delta = rowsum(dout * out) - grad_lse for every (batch, head, position).
struct DeltaParams {
  const void *out, *dout;
  const float* grad_lse;  // [B, Hq, N] contiguous, or null
  float* delta;           // [B, Hq, N] contiguous
  Strides so, sdo;
  AttentionShape shape;
};

// One branch of the backward: adds the branch's share of the gradient of the merged function into the
// fp32 accumulators.
struct BackwardParams {
  const void *q, *k, *v, *dout;
  const float *lse, *delta;  // [B, Hq, N] contiguous: merged LSE and delta
  float *dq, *dk, *dv;       // contiguous fp32 [B, N, Hq or Hkv, D]
  Strides sq, sk, sv, sdo;
  AttentionShape shape;
  Branch branch;
};

// Each returns the launch's error (cudaSuccess when it was queued). `tiles` names the tile table the kernels
// run with: kPascalTiles or kVoltaTiles.
cudaError_t launch_forward(const ForwardParams& p, ScalarKind kind, int tiles, cudaStream_t stream);
cudaError_t launch_delta(const DeltaParams& p, ScalarKind kind, cudaStream_t stream);
cudaError_t launch_backward(const BackwardParams& p, ScalarKind kind, int tiles, cudaStream_t stream);

// The cudnn backend's kernels (merge.cu), over [b, h, s, d] views given by their first element and the element
// strides of b, h and s (d has unit stride).
struct RowsView {
  void* data;
  int64_t sb, sh, ss;
};

// (out, lse) <- merge([out, part_out], [lse, part_lse]) in place: the two-term form of dilated_attn.merge
// (weights normalised by their sum; rows without keys give (0, -inf); a NaN LSE makes the row NaN). out and
// part_out in the input dtype, the LSEs float32 ([b, h, s] views). With `store`, (out, lse) <- (part_out,
// part_lse): the first result of rows no other result reached yet (out and lse are not read).
struct MergeParams {
  RowsView out, lse, part_out, part_lse;
  int64_t b, h, s, d;
  bool store;
};

// dst[i] += src[i] (dst[i] = src[i] with `store`) for the first `tensors` (1 to 3) gradients of one cuDNN call,
// views of one shape, rounded once to their dtype.
struct AccumulateParams {
  RowsView dst[3], src[3];
  int64_t b, h, s, d;
  bool store;
  int tensors;
};

// `vectorized`: every view's first element and strides, and d, are whole 16-byte vectors.
cudaError_t launch_merge(const MergeParams& p, ScalarKind kind, bool vectorized, cudaStream_t stream);
cudaError_t launch_accumulate(const AccumulateParams& p, ScalarKind kind, bool vectorized, cudaStream_t stream);

}  // namespace cuda
}  // namespace dilated_attn
