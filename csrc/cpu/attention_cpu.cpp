// CPU backend: blocked online-softmax dilated attention, forward and exact backward.
//
// Work is split per branch into tiles of the dilated view: the queries of one (batch, head, segment) at
// positions seg*s + o(h) + r*j. Rows are gathered into small tile buffers in the accumulation type
// (float for half/bfloat16/float, double for double), so no gathered copy of q/k/v and no N x N matrix
// ever exists. Branches run one after another and merge into the running (out, lse) in place.
//
// The tile kernels (attention_cpu_kernels.h) use register-blocked micro-GEMMs on GCC vector extensions.
// They are compiled twice on x86-64, for the baseline ISA and for AVX2+FMA, and the launcher picks one
// per call: AVX2 where the CPU has it, unless DILATED_ATTN_CPU_ISA=baseline asks for the other.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "../checks.h"
#include "../params.h"

#include <cstdlib>
#include <string>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define DA_HAVE_AVX2_BUILD 1
#else
#define DA_HAVE_AVX2_BUILD 0
#endif
#define DA_INLINE inline __attribute__((always_inline))

namespace dilated_attn {
namespace cpu {

constexpr int64_t kBlockQ = 64;  // queries per tile
constexpr int64_t kBlockK = 64;  // keys per tile (the vectorised dimension of the score tile)

template <typename T>
constexpr T neg_inf() {
  return -std::numeric_limits<T>::infinity();
}


template <typename scalar_t, typename acc_t>
struct ForwardArgs {
  const scalar_t *q, *k, *v;
  Strides sq, sk, sv;
  acc_t* out;  // [B, N, H, D] contiguous, the running merged output
  acc_t* lse;  // [B, H, N], the running merged LSE
  AttentionShape shape;
};

template <typename scalar_t, typename acc_t>
struct BackwardArgs {
  const scalar_t *q, *k, *v, *dout;
  Strides sq, sk, sv, sdo;
  const acc_t* lse;     // [B, H, N] merged LSE
  const acc_t* delta;   // [B, H, N] rowsum(dout * out) - grad_lse
  acc_t *dq, *dk, *dv;  // contiguous [B, N, H(kv), D] accumulators
  AttentionShape shape;
};

// Tile rows are padded from D to Dp columns, a multiple of kPadBytes (whole micro-kernel columns for
// every instruction set); the padding of every tile buffer is zero and stays zero, so it adds nothing to
// any product.
constexpr int64_t kPadBytes = 64;
template <typename acc_t>
inline int64_t padded_dim(int64_t D) {
  constexpr int64_t cols = kPadBytes / sizeof(acc_t);
  return (D + cols - 1) / cols * cols;
}

template <typename acc_t>
inline int64_t forward_workspace(int64_t D) {
  const int64_t Dp = padded_dim<acc_t>(D);
  return kBlockQ * Dp /*Q*/ + Dp * kBlockK /*K^T*/ + kBlockK * Dp /*V*/ + kBlockQ * kBlockK /*S*/ +
         kBlockQ * Dp /*O*/ + 2 * kBlockQ /*m, l*/;
}

template <typename acc_t>
inline int64_t backward_workspace(int64_t D) {
  const int64_t Dp = padded_dim<acc_t>(D);
  return kBlockK * Dp /*K*/ + 2 * Dp * kBlockK /*K^T, V^T*/ + 2 * kBlockK * Dp /*dK, dV*/ +
         3 * kBlockQ * Dp /*Q, dO, dQ*/ + 4 * kBlockQ * kBlockK /*P, dS and transposes*/;
}

namespace baseline {
#define DA_VEC_BYTES 16
#include "attention_cpu_kernels.h"
#undef DA_VEC_BYTES
}  // namespace baseline

#if DA_HAVE_AVX2_BUILD
#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace avx2 {
#define DA_VEC_BYTES 32
#include "attention_cpu_kernels.h"
#undef DA_VEC_BYTES
}  // namespace avx2
#pragma GCC pop_options
#endif

// The instruction set the kernels run with: "avx2" where both the build and the CPU have it, else
// "baseline"; DILATED_ATTN_CPU_ISA=baseline forces the baseline kernels (read on every call, so tests can
// cover both paths in one process).
const char* selected_isa() {
  const char* forced = std::getenv("DILATED_ATTN_CPU_ISA");
  if (forced != nullptr && std::string(forced) == "baseline") return "baseline";
#if DA_HAVE_AVX2_BUILD
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return "avx2";
#endif
  return "baseline";
}

template <typename scalar_t, typename acc_t>
struct Kernels {
  decltype(&baseline::forward_tile<scalar_t, acc_t>) forward_tile;
  decltype(&baseline::backward_segment<scalar_t, acc_t>) backward_segment;

  static Kernels select() {
#if DA_HAVE_AVX2_BUILD
    if (std::string(selected_isa()) == "avx2")
      return {&avx2::forward_tile<scalar_t, acc_t>, &avx2::backward_segment<scalar_t, acc_t>};
#endif
    return {&baseline::forward_tile<scalar_t, acc_t>, &baseline::backward_segment<scalar_t, acc_t>};
  }
};

namespace {

AttentionShape shape_of(const at::Tensor& q, const at::Tensor& k, bool causal, double scale) {
  return AttentionShape{q.size(0), q.size(1), q.size(2), k.size(2), q.size(3), causal, scale};
}

std::tuple<at::Tensor, at::Tensor> forward_cpu(const at::Tensor& q_in, const at::Tensor& k_in,
                                               const at::Tensor& v_in, at::IntArrayRef segment_lengths,
                                               at::IntArrayRef dilation_rates, bool split_heads, bool causal,
                                               double scale, int64_t head_start, int64_t global_heads) {
  check_qkv(q_in, k_in, v_in);
  const at::Tensor q = rows_contiguous(q_in), k = rows_contiguous(k_in), v = rows_contiguous(v_in);
  const AttentionShape sh = shape_of(q, k, causal, scale);
  const auto table = make_branch_table(segment_lengths, dilation_rates, sh.num_heads, sh.seq_len, split_heads,
                                       head_start, global_heads);
  const auto acc_type = lse_dtype(q.scalar_type());
  at::Tensor out_acc = at::zeros(q.sizes(), q.options().dtype(acc_type));
  at::Tensor lse = at::full({sh.batch, sh.num_heads, sh.seq_len}, -std::numeric_limits<double>::infinity(),
                            q.options().dtype(acc_type));

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "dilated_attn_forward_cpu", [&] {
    using acc_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
    ForwardArgs<scalar_t, acc_t> args{q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(),
                                      strides_of(q), strides_of(k), strides_of(v), out_acc.data_ptr<acc_t>(),
                                      lse.data_ptr<acc_t>(), sh};
    const auto kernels = Kernels<scalar_t, acc_t>::select();
    const int64_t ws = forward_workspace<acc_t>(sh.head_dim);
    for (const Branch& br : table) {
      const int64_t heads = br.head_hi - br.head_lo, segs = br.num_segments(sh.seq_len);
      const int64_t tiles = (br.max_members() + kBlockQ - 1) / kBlockQ;
      const int64_t tasks = sh.batch * heads * segs * tiles;
      at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
        std::vector<acc_t> work(ws);
        for (int64_t t = begin; t < end; ++t) {
          const int64_t tile = t % tiles, seg = (t / tiles) % segs, hh = (t / tiles / segs) % heads;
          const int64_t b = t / tiles / segs / heads;
          kernels.forward_tile(args, br, b, br.head_lo + hh, seg, tile * kBlockQ, work.data());
        }
      });
    }
  });
  return {out_acc.scalar_type() == q.scalar_type() ? out_acc : out_acc.to(q.scalar_type()), lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> backward_cpu(
    const at::Tensor& grad_out_in, const std::optional<at::Tensor>& grad_lse, const at::Tensor& q_in,
    const at::Tensor& k_in, const at::Tensor& v_in, const at::Tensor& out, const at::Tensor& lse_in,
    at::IntArrayRef segment_lengths, at::IntArrayRef dilation_rates, bool split_heads, bool causal, double scale,
    int64_t head_start, int64_t global_heads) {
  check_qkv(q_in, k_in, v_in);
  TORCH_CHECK_VALUE(grad_out_in.sizes() == q_in.sizes() && out.sizes() == q_in.sizes(),
                    "grad_out and out must have the shape of q");
  const at::Tensor q = rows_contiguous(q_in), k = rows_contiguous(k_in), v = rows_contiguous(v_in);
  const at::Tensor grad_out = rows_contiguous(grad_out_in.to(q.scalar_type()));
  const AttentionShape sh = shape_of(q, k, causal, scale);
  const auto table = make_branch_table(segment_lengths, dilation_rates, sh.num_heads, sh.seq_len, split_heads,
                                       head_start, global_heads);
  const auto acc_type = lse_dtype(q.scalar_type());
  TORCH_CHECK_VALUE(lse_in.sizes() == at::IntArrayRef({sh.batch, sh.num_heads, sh.seq_len}),
                    "lse must have shape [batch, heads, seq]");
  const at::Tensor lse = lse_in.to(acc_type).contiguous();

  // delta = rowsum(dO * O) - dLSE: the gradient of the merged function folds the LSE output's gradient
  // into the row constant of the softmax backward (dS = P * (dP - delta)).
  at::Tensor delta = (grad_out.to(acc_type) * out.to(acc_type)).sum(-1).transpose(1, 2);
  if (grad_lse.has_value() && grad_lse->defined()) delta = delta - grad_lse->to(acc_type);
  delta = delta.contiguous();

  at::Tensor dq = at::zeros(q.sizes(), q.options().dtype(acc_type));
  at::Tensor dk = at::zeros(k.sizes(), k.options().dtype(acc_type));
  at::Tensor dv = at::zeros(v.sizes(), v.options().dtype(acc_type));

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "dilated_attn_backward_cpu", [&] {
    using acc_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
    BackwardArgs<scalar_t, acc_t> args{q.data_ptr<scalar_t>(),    k.data_ptr<scalar_t>(),
                                       v.data_ptr<scalar_t>(),    grad_out.data_ptr<scalar_t>(),
                                       strides_of(q),             strides_of(k),
                                       strides_of(v),             strides_of(grad_out),
                                       lse.data_ptr<acc_t>(),     delta.data_ptr<acc_t>(),
                                       dq.data_ptr<acc_t>(),      dk.data_ptr<acc_t>(),
                                       dv.data_ptr<acc_t>(),      sh};
    const auto kernels = Kernels<scalar_t, acc_t>::select();
    const int64_t ws = backward_workspace<acc_t>(sh.head_dim);
    for (const Branch& br : table) {
      const int64_t segs = br.num_segments(sh.seq_len);
      const int64_t tasks = sh.batch * sh.num_kv_heads * segs;
      at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
        std::vector<acc_t> work(ws);
        for (int64_t t = begin; t < end; ++t) {
          const int64_t seg = t % segs, kvh = (t / segs) % sh.num_kv_heads, b = t / segs / sh.num_kv_heads;
          kernels.backward_segment(args, br, b, kvh, seg, work.data());
        }
      });
    }
  });
  const auto dt = q.scalar_type();
  return {dq.to(dt), dk.to(dt), dv.to(dt)};
}

}  // namespace
}  // namespace cpu

TORCH_LIBRARY_IMPL(dilated_attn, CPU, m) {
  m.impl("forward", &cpu::forward_cpu);
  m.impl("backward", &cpu::backward_cpu);
}

}  // namespace dilated_attn
