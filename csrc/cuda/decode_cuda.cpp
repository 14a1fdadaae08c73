// The launcher behind torch.ops.dilated_attn.decode (the cuda backend's decoding with a KV cache, decode.cu): checks
// what the kernel relies on (so that a direct call of the op cannot reach it with arguments it would read past), fills
// DecodeParams and launches on the current stream. The caller (src/dilated_attn/backends/extension.py) validated the
// call and allocates the outputs and the workspace.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>

#include "../checks.h"
#include "launch.h"
#include "tensors.h"

namespace dilated_attn {
namespace cuda {
namespace {

// Unit-stride rows starting on 16-byte boundaries (the kernel's cp.async and vector loads and stores).
void check_rows(const at::Tensor& x, const char* name, const at::Tensor& q) {
  TORCH_CHECK_VALUE(x.dim() == 4 && x.is_cuda() && x.device() == q.device() && x.scalar_type() == q.scalar_type(),
                    message(name, " must be a 4-D CUDA tensor of q's dtype on q's device"));
  TORCH_CHECK_VALUE(x.size(3) == q.size(3), message(name, " must have q's head_dim"));
  TORCH_CHECK_VALUE(x.stride(3) == 1 && x.stride(0) % 8 == 0 && x.stride(1) % 8 == 0 && x.stride(2) % 8 == 0 &&
                        reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0,
                    message(name, " must have unit-stride rows on 16-byte boundaries (strides multiples of 8 "
                            "elements) for the CUDA decode kernel"));
}

void check_buffer(const at::Tensor& x, const char* name, at::ScalarType dtype, int64_t numel, const at::Tensor& q) {
  TORCH_CHECK_VALUE(x.is_cuda() && x.device() == q.device() && x.scalar_type() == dtype && x.is_contiguous() &&
                        x.numel() >= numel,
                    message(name, " must be a contiguous CUDA tensor of ", dtype, " with at least ", numel,
                            " elements on q's device"));
}

void decode_cuda(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                 const std::optional<at::Tensor>& k, const std::optional<at::Tensor>& v,
                 const std::optional<at::Tensor>& cache_seqlens, int64_t cache_len, const at::Tensor& branches,
                 double scale, const at::Tensor& out, const at::Tensor& lse, const at::Tensor& stats,
                 const at::Tensor& partial, const at::Tensor& counters, int64_t splits, int64_t stages) {
  TORCH_CHECK_TYPE(q.scalar_type() == at::kHalf || q.scalar_type() == at::kBFloat16,
                   message("the CUDA decode kernel takes float16 or bfloat16, got ", q.scalar_type()));
  TORCH_CHECK_VALUE(q.dim() == 4 && q.is_cuda(), "q must be a 4-D CUDA tensor [batch, new tokens, heads, head_dim]");
  const c10::cuda::CUDAGuard guard(q.device());
  const cudaDeviceProp* props = at::cuda::getCurrentDeviceProperties();
  TORCH_CHECK_VALUE(props->major >= 8, message("the CUDA decode kernel needs compute capability 8.0 or newer, got ",
                                               props->major, ".", props->minor));
  const int64_t B = q.size(0), Sq = q.size(1), H = q.size(2), D = q.size(3);
  TORCH_CHECK_VALUE(D == 64 || D == 128, message("the CUDA decode kernel takes head_dim 64 or 128, got ", D));
  check_rows(q, "q", q);
  check_rows(k_cache, "k_cache", q);
  check_rows(v_cache, "v_cache", q);
  check_rows(out, "out", q);
  TORCH_CHECK_VALUE(out.sizes() == q.sizes(), "out must have q's shape");
  const int64_t Hkv = k_cache.size(2), Nmax = k_cache.size(1);
  TORCH_CHECK_VALUE(v_cache.sizes() == k_cache.sizes() && k_cache.size(0) == B && Nmax >= 1,
                    "k_cache and v_cache must be [batch, cache rows >= 1, kv heads, head_dim] of one shape");
  TORCH_CHECK_VALUE(Hkv >= 1 && Hkv <= kMaxDecodeKvHeads && H % Hkv == 0 && H / Hkv <= kMaxDecodeGroup,
                    message("the CUDA decode kernel takes up to ", kMaxDecodeKvHeads, " kv heads and ",
                            kMaxDecodeGroup, " query heads a kv head, got ", H, " and ", Hkv));
  TORCH_CHECK_VALUE(Nmax < (int64_t{1} << 30) && Sq < (int64_t{1} << 30), "cache rows and new tokens must be < 2^30");
  TORCH_CHECK_VALUE(k.has_value() == v.has_value(), "k and v must be given together");
  if (k.has_value()) {
    check_rows(*k, "k", q);
    check_rows(*v, "v", q);
    TORCH_CHECK_VALUE(k->sizes() == at::IntArrayRef({B, Sq, Hkv, D}) && v->sizes() == k->sizes(),
                      "k and v must be [batch, new tokens, kv heads, head_dim]");
  }
  if (cache_seqlens.has_value()) {
    const at::Tensor& lengths = *cache_seqlens;
    TORCH_CHECK_VALUE(lengths.is_cuda() && lengths.device() == q.device() && lengths.dim() == 1 &&
                          lengths.size(0) == B && lengths.is_contiguous() &&
                          (lengths.scalar_type() == at::kInt || lengths.scalar_type() == at::kLong),
                      "cache_seqlens must be a contiguous int32 or int64 CUDA tensor [batch] on q's device");
  }
  TORCH_CHECK_VALUE(cache_len >= -(int64_t{1} << 30) && cache_len < (int64_t{1} << 30), "cache_len must be < 2^30");
  TORCH_CHECK_VALUE(branches.is_cuda() && branches.device() == q.device() && branches.scalar_type() == at::kInt &&
                        branches.dim() == 2 && branches.size(1) == 6 && branches.is_contiguous() &&
                        branches.size(0) >= 1 && branches.size(0) <= kMaxDecodeBranches,
                    message("branches must be a contiguous int32 CUDA tensor [1 to ", kMaxDecodeBranches, ", 6]"));
  TORCH_CHECK_VALUE(splits >= 1 && splits <= 65535, "splits must be in [1, 65535]");
  TORCH_CHECK_VALUE(stages >= 2 && stages <= 4, "stages must be 2, 3 or 4");
  const int64_t tokens = B * Sq;
  check_buffer(lse, "lse", at::kFloat, B * H * Sq, q);
  check_buffer(stats, "stats", at::kFloat, tokens * splits * H * 2, q);
  check_buffer(partial, "partial", at::kFloat, tokens * splits * H * D, q);
  check_buffer(counters, "counters", at::kInt, tokens * Hkv, q);
  if (tokens == 0) return;

  DecodeParams p{};
  p.q = q.data_ptr();
  p.k_cache = k_cache.data_ptr();
  p.v_cache = v_cache.data_ptr();
  p.k_new = k.has_value() ? k->data_ptr() : nullptr;
  p.v_new = v.has_value() ? v->data_ptr() : nullptr;
  p.out = out.data_ptr();
  p.lse = lse.data_ptr<float>();
  p.part_stats = stats.data_ptr<float>();
  p.part_acc = partial.data_ptr<float>();
  p.counters = counters.data_ptr<int>();
  p.cache_seqlens = cache_seqlens.has_value() ? cache_seqlens->data_ptr() : nullptr;
  p.seqlens_int64 = cache_seqlens.has_value() && cache_seqlens->scalar_type() == at::kLong;
  p.branches = branches.data_ptr<int>();
  p.n_branches = static_cast<int>(branches.size(0));
  p.cache_len = static_cast<int>(cache_len);
  p.sq_b = q.stride(0), p.sq_s = q.stride(1), p.sq_h = q.stride(2);
  p.sk_b = k_cache.stride(0), p.sk_n = k_cache.stride(1), p.sk_h = k_cache.stride(2);
  p.sv_b = v_cache.stride(0), p.sv_n = v_cache.stride(1), p.sv_h = v_cache.stride(2);
  if (k.has_value()) {
    p.skn_b = k->stride(0), p.skn_s = k->stride(1), p.skn_h = k->stride(2);
    p.svn_b = v->stride(0), p.svn_s = v->stride(1), p.svn_h = v->stride(2);
  }
  p.so_b = out.stride(0), p.so_s = out.stride(1), p.so_h = out.stride(2);
  p.sq = static_cast<int>(Sq);
  p.heads = static_cast<int>(H);
  p.group = static_cast<int>(H / Hkv);
  p.head_dim = static_cast<int>(D);
  p.max_pos = static_cast<int>(Nmax - 1);
  p.qk_scale = static_cast<float>(scale * 1.4426950408889634);
  p.tokens = tokens;
  p.splits = static_cast<int>(splits);
  const ScalarKind kind = q.scalar_type() == at::kHalf ? ScalarKind::kHalf : ScalarKind::kBFloat16;
  check_launch(launch_decode(p, kind, static_cast<int>(stages), c10::cuda::getCurrentCUDAStream()), "decode");
}

}  // namespace

// Blocks of the decode kernel an SM of the current device holds (0 where it cannot run): the caller's count of shares.
int64_t decode_blocks_per_sm_of(bool bfloat16, int64_t head_dim, int64_t stages) {
  return decode_blocks_per_sm(bfloat16 ? ScalarKind::kBFloat16 : ScalarKind::kHalf, static_cast<int>(head_dim),
                              static_cast<int>(stages));
}

}  // namespace cuda

TORCH_LIBRARY_IMPL(dilated_attn, CUDA, m) { m.impl("decode", &cuda::decode_cuda); }

}  // namespace dilated_attn
