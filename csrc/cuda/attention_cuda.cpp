// CUDA backend: the launchers behind torch.ops.dilated_attn.forward / backward for CUDA tensors. They
// check the arguments, translate tensors into the plain parameter structs of launch.h, run one kernel
// launch per branch on the current stream, and check every launch.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstdlib>
#include <limits>
#include <optional>
#include <string>

#include "../checks.h"
#include "launch.h"
#include "tensors.h"

namespace dilated_attn {
namespace cuda {
namespace {

void check_cuda_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  check_qkv(q, k, v);
  TORCH_CHECK_VALUE(q.is_cuda(), "q, k and v must be CUDA tensors");
  TORCH_CHECK_VALUE(q.size(1) < kMaxSeqLen,
                    message("the CUDA kernels take sequences of fewer than 2^31 positions, got ", q.size(1)));
  TORCH_CHECK_VALUE(q.size(3) <= kMaxHeadDim,
                    message("head_dim must be <= ", kMaxHeadDim, " for the CUDA kernels, got ", q.size(3)));
  scalar_kind(q);
}

// The kernels' tile table for the current device (launch.h): the P100's at compute capability 6.0, Pascal's at 6.1
// and 6.2, Volta's from 7.0 on. DILATED_ATTN_CUDA_TILES=pascal, gp100 or volta picks one by hand, so that a newer GPU
// can run (and test) Pascal's tables; its code holds them only in a build with DILATED_ATTN_PASCAL_PROXY=1
// (common.cuh: tiles_built).
TileTable tile_table() {
  const cudaDeviceProp* props = at::cuda::getCurrentDeviceProperties();
  const int major = props->major;
  const TileTable own =
      major >= 7 ? TileTable::kVolta : (props->minor == 0 ? TileTable::kGp100 : TileTable::kPascal);
  const char* env = std::getenv("DILATED_ATTN_CUDA_TILES");
  if (env == nullptr || *env == '\0') return own;
  const std::string name(env);
  TORCH_CHECK_VALUE(name == "pascal" || name == "gp100" || name == "volta",
                    "DILATED_ATTN_CUDA_TILES must be 'pascal', 'gp100' or 'volta' (the tile table), got '", name, "'");
  const TileTable table =
      name == "pascal" ? TileTable::kPascal : (name == "gp100" ? TileTable::kGp100 : TileTable::kVolta);
  TORCH_CHECK_VALUE(is_pascal(table) == is_pascal(own) || (is_pascal(table) && kPascalProxy),
                    message("DILATED_ATTN_CUDA_TILES=", name, ": this build holds no code of that tile table for ",
                            "compute capability ", major, ".x (each architecture's code holds its own table; ",
                            "Pascal's runs on newer GPUs in a build made with DILATED_ATTN_PASCAL_PROXY=1)"));
  return table;
}

AttentionShape shape_of(const at::Tensor& q, const at::Tensor& k, bool causal, double scale) {
  return AttentionShape{q.size(0), q.size(1), q.size(2), k.size(2), q.size(3), causal, scale};
}

std::tuple<at::Tensor, at::Tensor> forward_cuda(const at::Tensor& q_in, const at::Tensor& k_in,
                                                const at::Tensor& v_in, at::IntArrayRef segment_lengths,
                                                at::IntArrayRef dilation_rates, bool split_heads, bool causal,
                                                double scale, int64_t head_start, int64_t global_heads) {
  check_cuda_inputs(q_in, k_in, v_in);
  const c10::cuda::CUDAGuard guard(q_in.device());
  const at::Tensor q = rows_contiguous(q_in), k = rows_contiguous(k_in), v = rows_contiguous(v_in);
  const AttentionShape sh = shape_of(q, k, causal, scale);
  const auto table = make_branch_table(segment_lengths, dilation_rates, sh.num_heads, sh.seq_len, split_heads,
                                       head_start, global_heads);
  // The running merge starts from "no key yet": out = 0, lse = -inf (also what uncovered rows keep).
  at::Tensor out = at::zeros(q.sizes(), q.options());
  at::Tensor lse = at::full({sh.batch, sh.num_heads, sh.seq_len}, -std::numeric_limits<float>::infinity(),
                            q.options().dtype(at::kFloat));
  ForwardParams p{q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr<float>(),
                  strides_of(q), strides_of(k), strides_of(v), strides_of(out), sh, Branch{}};
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const TileTable tiles = tile_table();
  for (const Branch& br : table) {
    p.branch = br;
    check_launch(launch_forward(p, scalar_kind(q), tiles, stream), "forward");
  }
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> backward_cuda(
    const at::Tensor& grad_out_in, const std::optional<at::Tensor>& grad_lse_in, const at::Tensor& q_in,
    const at::Tensor& k_in, const at::Tensor& v_in, const at::Tensor& out_in, const at::Tensor& lse_in,
    at::IntArrayRef segment_lengths, at::IntArrayRef dilation_rates, bool split_heads, bool causal, double scale,
    int64_t head_start, int64_t global_heads) {
  check_cuda_inputs(q_in, k_in, v_in);
  TORCH_CHECK_VALUE(grad_out_in.sizes() == q_in.sizes() && out_in.sizes() == q_in.sizes(),
                    "grad_out and out must have the shape of q");
  const c10::cuda::CUDAGuard guard(q_in.device());
  const at::Tensor q = rows_contiguous(q_in), k = rows_contiguous(k_in), v = rows_contiguous(v_in);
  const at::Tensor grad_out = rows_contiguous(grad_out_in.to(q.scalar_type()));
  const at::Tensor out = rows_contiguous(out_in.to(q.scalar_type()));
  const AttentionShape sh = shape_of(q, k, causal, scale);
  const auto table = make_branch_table(segment_lengths, dilation_rates, sh.num_heads, sh.seq_len, split_heads,
                                       head_start, global_heads);
  TORCH_CHECK_VALUE(lse_in.sizes() == at::IntArrayRef({sh.batch, sh.num_heads, sh.seq_len}),
                    "lse must have shape [batch, heads, seq]");
  const at::Tensor lse = lse_in.to(at::kFloat).contiguous();
  std::optional<at::Tensor> grad_lse;
  if (grad_lse_in.has_value() && grad_lse_in->defined()) grad_lse = grad_lse_in->to(at::kFloat).contiguous();
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const ScalarKind kind = scalar_kind(q);

  at::Tensor delta = at::empty({sh.batch, sh.num_heads, sh.seq_len}, q.options().dtype(at::kFloat));
  const DeltaParams dp{out.data_ptr(), grad_out.data_ptr(), grad_lse ? grad_lse->data_ptr<float>() : nullptr,
                       delta.data_ptr<float>(), strides_of(out), strides_of(grad_out), sh};
  check_launch(launch_delta(dp, kind, stream), "delta");

  // fp32 accumulators across branches (the gradients themselves for float32 inputs).
  const auto f32 = q.options().dtype(at::kFloat);
  at::Tensor dq = at::zeros(q.sizes(), f32), dk = at::zeros(k.sizes(), f32), dv = at::zeros(v.sizes(), f32);
  BackwardParams p{q.data_ptr(), k.data_ptr(), v.data_ptr(), grad_out.data_ptr(), lse.data_ptr<float>(),
                   delta.data_ptr<float>(), dq.data_ptr<float>(), dk.data_ptr<float>(), dv.data_ptr<float>(),
                   strides_of(q), strides_of(k), strides_of(v), strides_of(grad_out), sh, Branch{}};
  const TileTable tiles = tile_table();
  for (const Branch& br : table) {
    p.branch = br;
    check_launch(launch_backward(p, kind, tiles, stream), "backward");
  }
  const auto dt = q.scalar_type();
  return {dq.to(dt), dk.to(dt), dv.to(dt)};
}

}  // namespace
}  // namespace cuda

TORCH_LIBRARY_IMPL(dilated_attn, CUDA, m) {
  m.impl("forward", &cuda::forward_cuda);
  m.impl("backward", &cuda::backward_cuda);
}

}  // namespace dilated_attn
