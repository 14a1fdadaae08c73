// The CUDA kernels' plain launch API: parameter structs of pointers, strides and sizes, and one launch
// function per kernel family. No ATen here (the launchers in attention_cuda.cpp translate tensors into
// these structs), so the kernel files compile with nvcc alone, for any target, without torch.
#pragma once

#include <cuda_runtime.h>

#include "../params.h"

namespace dilated_attn {
namespace cuda {

enum class ScalarKind { kHalf, kBFloat16, kFloat };

// Head dims are compiled for 32, 64, 96, 128 and 256; other sizes up to 256 run in the next larger one
// with the extra columns zero.
constexpr int64_t kMaxHeadDim = 256;

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

// Each returns the launch's error (cudaSuccess when it was queued).
cudaError_t launch_forward(const ForwardParams& p, ScalarKind kind, cudaStream_t stream);
cudaError_t launch_delta(const DeltaParams& p, ScalarKind kind, cudaStream_t stream);
cudaError_t launch_backward(const BackwardParams& p, ScalarKind kind, cudaStream_t stream);

}  // namespace cuda
}  // namespace dilated_attn
