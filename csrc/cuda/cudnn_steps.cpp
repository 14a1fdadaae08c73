// The cudnn backend's loops (src/dilated_attn/backends/cudnn/ops.py plans them as a Schedule): each step runs
// cuDNN's fused attention (ATen's _scaled_dot_product_cudnn_attention, or its backward) on strided views of the
// inputs and then one kernel of merge.cu, which merges the step's (out, lse) into the running result, or adds its
// gradients into the whole ones. In C++ because the problems this backend takes at its small end are bound by the
// host's time a step: here a step costs the cuDNN call and one launch, no Python.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <tuple>
#include <vector>

#include "launch.h"
#include "tensors.h"

namespace dilated_attn {
namespace cuda {
namespace {

// A step's view of one tensor, as ops.py's Schedule packs it: 4 sizes, 4 strides, the storage offset of its first
// element. The LSE's 3-D views pad their sizes with 1 and their strides with 0.
constexpr int64_t kViewInts = 9;
constexpr int64_t kForwardViews = 5;   // q, k, v, out, lse
constexpr int64_t kBackwardViews = 8;  // grad_out, q, k, v, out, lse, grad_q's target, grad_k's and grad_v's target

void check_steps(const at::Tensor& steps, int64_t views) {
  TORCH_CHECK_VALUE(steps.device().is_cpu() && steps.scalar_type() == at::kLong && steps.dim() == 2 &&
                        steps.size(1) == views * kViewInts && steps.is_contiguous(),
                    message("steps must be a contiguous int64 CPU tensor [steps, ", views * kViewInts, "], got ",
                            steps.scalar_type(), " ", steps.sizes(), " on ", steps.device()));
}

at::Tensor view_of(const at::Tensor& t, const int64_t* view, int64_t dims) {
  return t.as_strided(at::IntArrayRef(view, dims), at::IntArrayRef(view + 4, dims), view[8]);
}

// The kernels' [b, h, s(, d)] view of `t` at a packed view, without building it.
RowsView rows_at(const at::Tensor& t, const int64_t* view) {
  return RowsView{static_cast<char*>(t.data_ptr()) + (view[8] - t.storage_offset()) * t.element_size(), view[4],
                  view[5], view[6]};
}

// ... of a step's result: unit-stride rows.
RowsView rows_of(const at::Tensor& t) {
  TORCH_INTERNAL_ASSERT(t.dim() < 4 || t.stride(3) == 1);
  return RowsView{t.data_ptr(), t.stride(0), t.stride(1), t.stride(2)};
}

bool whole_vectors(const RowsView& v, int64_t element_size) {
  return reinterpret_cast<uintptr_t>(v.data) % 16 == 0 && v.sb * element_size % 16 == 0 &&
         v.sh * element_size % 16 == 0 && v.ss * element_size % 16 == 0;
}

at::Tensor unit_stride_rows(const at::Tensor& t) { return t.stride(-1) == 1 ? t : t.contiguous(); }

// cuDNN rejects s_q = s_kv = 1 (a tail segment with one member): the one key's weight is 1, so out = v and
// lse = q.k * scale, and the gradients follow from P = exp(q.k * scale - lse). With grouped-query heads (k and v
// have fewer heads than q), each kv head serves its run of query heads and takes the sum of their gradients.
at::Tensor per_query_head(const at::Tensor& kv, int64_t heads) {
  return kv.size(1) == heads ? kv : kv.repeat_interleave(heads / kv.size(1), 1);
}

at::Tensor per_kv_head(const at::Tensor& g, int64_t kv_heads) {
  return g.size(1) == kv_heads ? g : g.unflatten(1, {kv_heads, g.size(1) / kv_heads}).sum(2);
}

at::Tensor one_key_scores(const at::Tensor& q, const at::Tensor& k, double scale) {
  return (q.to(at::kFloat) * per_query_head(k, q.size(1)).to(at::kFloat)).sum(-1) * scale;
}

std::array<at::Tensor, 3> one_key_gradients(const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k,
                                            const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
                                            double scale) {
  const int64_t heads = q.size(1), kv_heads = k.size(1);
  const at::Tensor dout = grad_out.to(at::kFloat);
  const at::Tensor p = (one_key_scores(q, k, scale) - lse).exp().unsqueeze(-1);
  const at::Tensor vq = per_query_head(v, heads).to(at::kFloat);
  const at::Tensor ds = p * ((dout * vq).sum(-1, true) - (dout * out.to(at::kFloat)).sum(-1, true));
  const auto dt = q.scalar_type();
  return {(ds * per_query_head(k, heads).to(at::kFloat) * scale).to(dt),
          per_kv_head(ds * q.to(at::kFloat) * scale, kv_heads).to(dt), per_kv_head(p * dout, kv_heads).to(dt)};
}

void merge_rows(const RowsView& out, const RowsView& lse, const at::Tensor& part_out, const at::Tensor& part_lse,
                bool store, ScalarKind kind, int64_t element_size, cudaStream_t stream) {
  const MergeParams p{out,
                      lse,
                      rows_of(part_out),
                      rows_of(part_lse),
                      part_out.size(0),
                      part_out.size(1),
                      part_out.size(2),
                      part_out.size(3),
                      store};
  const bool vectorized = p.d * element_size % 16 == 0 && whole_vectors(p.out, element_size) &&
                          whole_vectors(p.part_out, element_size);
  check_launch(launch_merge(p, kind, vectorized, stream), "merge");
}

void check_running_result(const at::Tensor& q, const at::Tensor& out, const at::Tensor& lse) {
  TORCH_CHECK_VALUE(q.is_cuda() && out.device() == q.device() && lse.device() == q.device(),
                    "q, out and lse must be on one CUDA device");
  TORCH_CHECK_TYPE(out.scalar_type() == q.scalar_type() && lse.scalar_type() == at::kFloat,
                   message("out must have q's dtype and lse float32, got ", out.scalar_type(), " and ",
                           lse.scalar_type()));
}

// A step's result `part` [segments, heads, members, D] where the step's packed `view` is all of a contiguous
// [B, N, H, D] tensor in cuDNN's layout (rows of one segment, then heads): the result itself, as that tensor, when
// cuDNN wrote it in the view's layout; else undefined. The first step of a branch that reaches every row once in one
// piece then costs no copy.
at::Tensor whole_result(const at::Tensor& part, const int64_t* view, at::IntArrayRef shape) {
  const int64_t n = view[0], h = view[1], s = view[2], d = view[3];
  const bool whole = view[8] == 0 && n * s == shape[0] * shape[1] && h == shape[2] && d == shape[3] &&
                     view[4] == s * h * d && view[5] == d && view[6] == h * d && view[7] == 1;
  if (!whole || part.strides() != at::IntArrayRef(view + 4, 4)) return at::Tensor();
  return part.transpose(1, 2).view(shape);
}

// Returns (out [B, N, H, D], lse float32 [B, N, H]): the merge of the attention of each step's views, the first
// `stored_steps` steps storing theirs (rows no step reached before) instead of merging it. With `stored_steps`,
// `out` and `lse` start uninitialised (or as the first step's result, see whole_result), else as (0, -inf).
std::tuple<at::Tensor, at::Tensor> cudnn_forward_steps(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                       const at::Tensor& steps, int64_t stored_steps, bool causal,
                                                       double scale) {
  check_steps(steps, kForwardViews);
  TORCH_CHECK_VALUE(q.is_cuda() && q.dim() == 4, "q must be a 4-D CUDA tensor");
  const c10::cuda::CUDAGuard guard(q.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const ScalarKind kind = scalar_kind(q);
  const std::vector<int64_t> lse_shape{q.size(0), q.size(1), q.size(2)};
  at::Tensor out, lse;
  if (stored_steps == 0 || steps.size(0) == 0) {
    out = at::zeros(q.sizes(), q.options());
    lse = at::full(lse_shape, -INFINITY, q.options().dtype(at::kFloat));
  }
  const int64_t* view = steps.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < steps.size(0); ++i, view += kForwardViews * kViewInts) {
    // one step's result alive at a time: the caching allocator hands the next step the same memory
    const at::Tensor qs = view_of(q, view, 4), ks = view_of(k, view + kViewInts, 4);
    const at::Tensor vs = view_of(v, view + 2 * kViewInts, 4);
    at::Tensor part_out, part_lse;
    if (qs.size(2) == 1) {
      part_out = unit_stride_rows(per_query_head(vs, qs.size(1)));
      part_lse = one_key_scores(qs, ks, scale);
    } else {
      auto result = at::_scaled_dot_product_cudnn_attention(qs, ks, vs, std::nullopt, /*compute_log_sumexp=*/true,
                                                            /*dropout_p=*/0.0, causal, /*return_debug_mask=*/false,
                                                            scale);
      part_out = std::get<0>(result);
      part_lse = std::get<1>(result);
    }
    if (!out.defined()) {  // the first step, which stores
      // (not a one-key step's: its out is a view of v)
      const bool whole = stored_steps == 1 && qs.size(2) > 1;
      out = whole ? whole_result(part_out, view + 3 * kViewInts, q.sizes()) : at::Tensor();
      if (out.defined()) {  // the LSE's rows [segments, heads, members] -> [B, N, H]: a small copy
        const int64_t* lv = view + 4 * kViewInts;
        // contiguous: with one segment per batch element the reshape is a transposed view, which the merges'
        // row views (contiguous [B, N, H] strides) would misread
        lse = part_lse.reshape({lv[0], lv[1], lv[2]}).transpose(1, 2).reshape(lse_shape).to(at::kFloat).contiguous();
        continue;
      }
      out = at::empty(q.sizes(), q.options());
      lse = at::empty(lse_shape, q.options().dtype(at::kFloat));
    }
    merge_rows(rows_at(out, view + 3 * kViewInts), rows_at(lse, view + 4 * kViewInts), part_out, part_lse,
               i < stored_steps, kind, q.element_size(), stream);
  }
  return {out, lse};
}

// dst[t] (+)= grads[t] for t < count, views of the packed `shape`: one launch. The sums are of the gradients' kind and
// element_size, or float32 with `float_sums`.
void accumulate(const at::Tensor* grads, const RowsView* dst, int count, const int64_t* shape, bool store,
                ScalarKind kind, int64_t element_size, cudaStream_t stream, bool float_sums = false) {
  AccumulateParams p{{}, {}, shape[0], shape[1], shape[2], shape[3], store, count, float_sums};
  const int64_t sum_size = float_sums ? 4 : element_size;
  bool vectorized = p.d * element_size % 16 == 0;
  for (int t = 0; t < count; ++t) {
    p.dst[t] = dst[t];
    p.src[t] = rows_of(grads[t]);
    vectorized = vectorized && whole_vectors(p.dst[t], sum_size) && whole_vectors(p.src[t], element_size);
  }
  check_launch(launch_accumulate(p, kind, vectorized, stream), "gradient addition");
}

// Returns (grad_q, grad_k, grad_v): the sum of the gradients of each step's attention given the merged out and lse
// [B, N, H] (cuDNN's P = exp(S - lse) and delta = rowsum(dO * out) are then the step's share of the exact gradient),
// the first `stored_steps` steps storing theirs (rows no step reached before) instead of adding them. With grouped-
// query heads, cuDNN sums each kv head's dK and dV over its query heads. As in the forward, a first step that is
// the whole gradients is taken as they are (whole_result).
std::tuple<at::Tensor, at::Tensor, at::Tensor> cudnn_backward_steps(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, const at::Tensor& steps, int64_t stored_steps, bool causal, double scale) {
  check_steps(steps, kBackwardViews);
  check_running_result(q, out, lse);
  const c10::cuda::CUDAGuard guard(q.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const ScalarKind kind = scalar_kind(q);
  const int64_t size = q.element_size();
  const at::Tensor no_philox = at::empty({0}, q.options().dtype(at::kLong));  // no dropout: no seed, no offset
  at::Tensor grad_q, grad_k, grad_v;
  if (stored_steps == 0 || steps.size(0) == 0) {
    grad_q = at::zeros(q.sizes(), q.options());
    grad_k = at::zeros(k.sizes(), q.options());
    grad_v = at::zeros(k.sizes(), q.options());
  }
  const int64_t* view = steps.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < steps.size(0); ++i, view += kBackwardViews * kViewInts) {
    at::Tensor xs[6];  // grad_out, q, k, v, out: [segments, heads, members, D]; lse [segments, heads, members]
    const at::Tensor* whole[6] = {&grad_out, &q, &k, &v, &out, &lse};
    for (int t = 0; t < 6; ++t) xs[t] = view_of(*whole[t], view + t * kViewInts, t < 5 ? 4 : 3);
    std::array<at::Tensor, 3> grads;
    if (xs[1].size(2) == 1) {
      grads = one_key_gradients(xs[0], xs[1], xs[2], xs[3], xs[4], xs[5], scale);
    } else {
      // a step's queries and keys may differ in number (the ring's rectangular blocks)
      std::tie(grads[0], grads[1], grads[2]) = at::_scaled_dot_product_cudnn_attention_backward(
          xs[0], xs[1], xs[2], xs[3], xs[4], xs[5].unsqueeze(-1), no_philox, no_philox, /*attn_bias=*/at::Tensor(),
          /*cum_seq_q=*/at::Tensor(), /*cum_seq_k=*/at::Tensor(), xs[1].size(2), xs[2].size(2), /*dropout_p=*/0.0,
          causal, scale);
    }
    const int64_t* q_target = view + 6 * kViewInts;
    const int64_t* kv_target = view + 7 * kViewInts;
    if (!grad_q.defined()) {  // the first step, which stores
      if (stored_steps == 1) {
        grad_q = whole_result(grads[0], q_target, q.sizes());
        grad_k = whole_result(grads[1], kv_target, k.sizes());
        grad_v = whole_result(grads[2], kv_target, k.sizes());
        if (grad_q.defined() && grad_k.defined() && grad_v.defined()) continue;
      }
      grad_q = at::empty(q.sizes(), q.options());
      grad_k = at::empty(k.sizes(), q.options());
      grad_v = at::empty(k.sizes(), q.options());
    }
    for (auto& g : grads) g = unit_stride_rows(g);
    const RowsView dst[3] = {rows_at(grad_q, q_target), rows_at(grad_k, kv_target), rows_at(grad_v, kv_target)};
    const bool store = i < stored_steps;
    if (std::equal(q_target, q_target + 4, kv_target)) {  // one head per kv head: one launch for all three
      accumulate(grads.data(), dst, 3, q_target, store, kind, size, stream);
    } else {
      accumulate(grads.data(), dst, 1, q_target, store, kind, size, stream);
      accumulate(grads.data() + 1, dst + 1, 2, kv_target, store, kind, size, stream);
    }
  }
  return {grad_q, grad_k, grad_v};
}

// The merge kernel of cudnn_forward_steps on whole tensors, the one every path merges with: out, part_out
// [b, h, s, d], lse, part_lse [b, h, s] (tests/test_merge.py pins it to dilated_attn.merge).
void merge_into(const at::Tensor& out, const at::Tensor& lse, const at::Tensor& part_out,
                 const at::Tensor& part_lse) {
  TORCH_CHECK_VALUE(out.dim() == 4 && lse.dim() == 3 && part_out.sizes() == out.sizes() &&
                        part_lse.sizes() == lse.sizes() && lse.sizes() == out.sizes().slice(0, 3) &&
                        out.stride(3) == 1 && part_out.stride(3) == 1,
                    "merge_into takes out, part_out [b, h, s, d] with unit-stride rows and lse, part_lse [b, h, s]");
  check_running_result(out, out, lse);
  TORCH_CHECK_TYPE(part_out.scalar_type() == out.scalar_type() && part_lse.scalar_type() == at::kFloat,
                   "part_out must have out's dtype and part_lse float32");
  const c10::cuda::CUDAGuard guard(out.device());
  merge_rows(rows_of(out), rows_of(lse), part_out, part_lse, /*store=*/false, scalar_kind(out), out.element_size(),
             c10::cuda::getCurrentCUDAStream());
}

// Their gradient-addition kernel on whole [b, h, s, d] views (op dilated_attn::accumulate): targets[t] += parts[t] (or
// = with `store`), up to three pairs of one shape in one launch; the targets of the parts' dtype, or float32 sums of
// float16/bfloat16 parts. Not the cudnn backend's alone: the fa4 backend adds FlashAttention's gradients with it, the
// ring its blocks' into their float32 sums (backends/extension.py's accumulate); it lives here beside the kernel's
// first user, cudnn_backward_steps (accumulate above).
void accumulate_into(at::TensorList targets, at::TensorList parts, bool store) {
  const int count = static_cast<int>(targets.size());
  TORCH_CHECK_VALUE(count >= 1 && count <= 3 && parts.size() == targets.size(),
                    message("accumulate takes 1 to 3 targets and as many parts, got ", targets.size(), " and ",
                            parts.size()));
  const at::Tensor& first = targets[0];
  TORCH_CHECK_VALUE(first.is_cuda() && first.dim() == 4, "accumulate's targets are 4-D CUDA tensors");
  const bool float_sums = first.scalar_type() == at::kFloat && parts[0].scalar_type() != at::kFloat;
  at::Tensor grads[3];
  RowsView dst[3];
  for (int t = 0; t < count; ++t) {
    TORCH_CHECK_VALUE(targets[t].sizes() == first.sizes() && parts[t].sizes() == first.sizes() &&
                          targets[t].stride(3) == 1 && targets[t].device() == first.device() &&
                          parts[t].device() == first.device(),
                      "accumulate takes targets and parts of one [b, h, s, d] shape on one device, the targets "
                      "with unit-stride rows");
    TORCH_CHECK_TYPE(targets[t].scalar_type() == first.scalar_type() && parts[t].scalar_type() == parts[0].scalar_type()
                         && (parts[t].scalar_type() == first.scalar_type() || float_sums),
                     "accumulate's targets and parts must share one dtype, or the targets be float32");
    grads[t] = unit_stride_rows(parts[t]);
    dst[t] = rows_of(targets[t]);
  }
  const c10::cuda::CUDAGuard guard(first.device());
  const int64_t shape[4] = {first.size(0), first.size(1), first.size(2), first.size(3)};
  accumulate(grads, dst, count, shape, store, scalar_kind(parts[0]), parts[0].element_size(),
             c10::cuda::getCurrentCUDAStream(), float_sums);
}

}  // namespace
}  // namespace cuda

TORCH_LIBRARY_IMPL(dilated_attn, CUDA, m) {
  m.impl("cudnn_forward_steps", &cuda::cudnn_forward_steps);
  m.impl("cudnn_backward_steps", &cuda::cudnn_backward_steps);
  m.impl("merge_into", &cuda::merge_into);
  m.impl("accumulate", &cuda::accumulate_into);
}

}  // namespace dilated_attn
