// Every op schema of the package, and the few plain (non-op) helpers exposed through pybind11.
#include <pybind11/pybind11.h>
#include <torch/library.h>
#include <torch/version.h>

TORCH_LIBRARY(dilated_attn, m) {
  // One dilated attention call: all branches merged. out: [B, N, Hq, D] in q's dtype; lse: [B, Hq, N] in
  // float32 (float64 for float64 inputs).
  m.def(
      "forward(Tensor q, Tensor k, Tensor v, int[] segment_lengths, int[] dilation_rates, bool split_heads, "
      "bool causal, float scale, int head_start=0, int global_heads=0) -> (Tensor out, Tensor lse)");
  // head_start, global_heads (0: q's heads are the whole problem): q's heads are the heads [head_start,
  // head_start + Hq) of a problem of global_heads heads, with its offsets (the head-parallel ring modes).
  // Exact gradient of forward, from the merged out and lse; grad_lse (optional) is the gradient of lse.
  m.def(
      "backward(Tensor grad_out, Tensor? grad_lse, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
      "int[] segment_lengths, int[] dilation_rates, bool split_heads, bool causal, float scale, int head_start=0, "
      "int global_heads=0) -> (Tensor grad_q, Tensor grad_k, Tensor grad_v)");
  // The cudnn backend's loops over cuDNN calls (CUDA only; src/dilated_attn/backends/cudnn/ops.py plans them):
  // `steps`, int64 on the CPU, holds one row per call: the call's view of each tensor (sizes, strides, storage
  // offset; the results' views are of contiguous tensors). The forward returns the merge of the calls' results
  // (out [B, N, H, D], lse float32 [B, N, H]); the backward the sum of their gradients; the first `stored_steps`
  // calls store theirs instead (rows no call reached before).
  m.def(
      "cudnn_forward_steps(Tensor q, Tensor k, Tensor v, Tensor steps, int stored_steps, bool causal, "
      "float scale) -> (Tensor out, Tensor lse)");
  m.def(
      "cudnn_backward_steps(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor steps, "
      "int stored_steps, bool causal, float scale) -> (Tensor grad_q, Tensor grad_k, Tensor grad_v)");
  // The merge kernel (cudnn_forward_steps's, and every path's) on whole [b, h, s, d] tensors: (out, lse) <- merge([out, part_out], [lse, part_lse]).
  m.def("merge_into(Tensor(a!) out, Tensor(b!) lse, Tensor part_out, Tensor part_lse) -> ()");
  // ... and their gradient addition: targets[t] += parts[t] (store: =), [b, h, s, d] views of one shape, 1 to 3
  // (cudnn_backward_steps's kernel, which the fa4 backend and the ring call through this op).
  m.def("accumulate(Tensor(a!)[] targets, Tensor[] parts, bool store) -> ()");
  // The cuda backend's decoding with a KV cache (csrc/cuda/decode.cu; src/dilated_attn/backends/extension.py calls
  // it): the new k, v written into the caches, every branch of the new queries into out and lse, through the
  // workspace (stats, partial: the `splits` shares' partial softmaxes; counters: 0 before and after).
  m.def(
      "decode(Tensor q, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor? k, Tensor? v, Tensor? cache_seqlens, "
      "int cache_len, Tensor branches, float scale, Tensor(c!) out, Tensor(d!) lse, Tensor(e!) stats, "
      "Tensor(f!) partial, Tensor(g!) counters, int splits, int stages) -> ()");
}

namespace dilated_attn::cpu {
const char* selected_isa();  // csrc/cpu/attention_cpu.cpp
}
#ifdef DILATED_ATTN_WITH_CUDA
namespace dilated_attn::cuda {
int64_t decode_blocks_per_sm_of(bool bfloat16, int64_t head_dim, int64_t stages);  // csrc/cuda/decode_cuda.cpp
}
#endif

#define DA_STR2(x) #x
#define DA_STR(x) DA_STR2(x)

// What this binary was built with, so that a load or dispatch failure can be explained.
static pybind11::dict build_info() {
  pybind11::dict info;
  info["torch_version"] = DA_STR(TORCH_VERSION_MAJOR) "." DA_STR(TORCH_VERSION_MINOR) "." DA_STR(TORCH_VERSION_PATCH);
#ifdef DILATED_ATTN_WITH_CUDA
  info["with_cuda"] = true;
  info["cuda_version"] = DILATED_ATTN_CUDA_VERSION;
  info["cuda_archs"] = DILATED_ATTN_CUDA_ARCHS;
#ifdef DILATED_ATTN_PASCAL_PROXY
  info["pascal_tiles_on_newer_gpus"] = true;
#else
  info["pascal_tiles_on_newer_gpus"] = false;
#endif
#else
  info["with_cuda"] = false;
  info["cuda_version"] = pybind11::none();
  info["cuda_archs"] = "";
  info["pascal_tiles_on_newer_gpus"] = false;
#endif
  info["cpu_isa"] = dilated_attn::cpu::selected_isa();
  return info;
}

PYBIND11_MODULE(_C, m) {
  m.doc() = "dilated_attn compiled ops (registered under torch.ops.dilated_attn)";
  m.def("build_info", &build_info, "Versions and targets this extension was compiled for");
#ifdef DILATED_ATTN_WITH_CUDA
  m.def("decode_blocks_per_sm", &dilated_attn::cuda::decode_blocks_per_sm_of, pybind11::arg("bfloat16"),
        pybind11::arg("head_dim"), pybind11::arg("stages"),
        "Blocks of the CUDA decode kernel an SM of the current device holds (0 where it cannot run)");
#endif
}
