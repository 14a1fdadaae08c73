// The ATen side of launch.h, shared by the CUDA launchers (attention_cuda.cpp, cudnn_steps.cpp): a tensor's
// ScalarKind and the check of a launch's error.
#pragma once

#include <ATen/ATen.h>
#include <cuda_runtime.h>

#include "../checks.h"
#include "launch.h"

namespace dilated_attn {
namespace cuda {

inline ScalarKind scalar_kind(const at::Tensor& t) {
  const at::ScalarType st = t.scalar_type();
  TORCH_CHECK_TYPE(st == at::kHalf || st == at::kBFloat16 || st == at::kFloat,
                   message("the CUDA kernels take float16, bfloat16 or float32 q/k/v, got ", st));
  return st == at::kHalf ? ScalarKind::kHalf : st == at::kBFloat16 ? ScalarKind::kBFloat16 : ScalarKind::kFloat;
}

inline void check_launch(cudaError_t err, const char* kernel) {
  TORCH_CHECK(err == cudaSuccess, "dilated_attn: launching the CUDA ", kernel, " kernel failed: ",
              cudaGetErrorString(err));
}

}  // namespace cuda
}  // namespace dilated_attn
