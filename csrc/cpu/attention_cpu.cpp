// CPU backend: blocked online-softmax dilated attention, forward and exact backward.
//
// Work is split per branch into tiles of the dilated view: the queries of one (batch, head, segment) at
// positions seg*s + o(h) + r*j. Rows are gathered into small tile buffers in the accumulation type
// (float for half/bfloat16/float, double for double), so no gathered copy of q/k/v and no N x N matrix
// ever exists. Branches run one after another and merge into the running (out, lse) in place.
//
// The hot loops are written as axpy over contiguous rows so the compiler vectorises them; on x86-64 with
// GCC each tile function is also cloned for x86-64-v3 (AVX2 + FMA) and picked at load time.

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

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define DA_MULTIVERSION __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define DA_MULTIVERSION
#endif
#define DA_INLINE inline __attribute__((always_inline))

namespace dilated_attn {
namespace cpu {
namespace {

constexpr int64_t kBlockQ = 64;  // queries per tile
constexpr int64_t kBlockK = 64;  // keys per tile (the vectorised dimension of the score tile)

template <typename T>
constexpr T neg_inf() {
  return -std::numeric_limits<T>::infinity();
}


// Register-blocked GEMM on small row-major tiles: C[M, W] (+)= A[M, K] . B[K, W] for one column block of
// W = 2 vectors, MR rows at a time, accumulators in registers. GCC vector extensions keep it portable: the
// x86-64-v3 clone turns each vector into one AVX register and the multiply-add into an FMA.
template <typename T>
struct Vec {
  typedef T type __attribute__((vector_size(32)));
  static constexpr int64_t lanes = 32 / sizeof(T);
};
template <typename T>
constexpr int64_t kCols = 2 * Vec<T>::lanes;  // columns of one micro-kernel call; tiles pad to a multiple

template <typename T>
DA_INLINE typename Vec<T>::type vload(const T* p) {
  typename Vec<T>::type v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
template <typename T>
DA_INLINE void vstore(T* p, typename Vec<T>::type v) {
  std::memcpy(p, &v, sizeof(v));
}

template <int MR, typename T>
DA_INLINE void micro_gemm(T* __restrict C, int64_t ldc, const T* __restrict A, int64_t lda,
                          const T* __restrict B, int64_t ldb, int64_t K, bool accumulate) {
  using V = typename Vec<T>::type;
  constexpr int64_t L = Vec<T>::lanes;
  V c[MR][2];
  for (int i = 0; i < MR; ++i) {
    if (accumulate) {
      c[i][0] = vload(C + i * ldc);
      c[i][1] = vload(C + i * ldc + L);
    } else {
      c[i][0] = V{};
      c[i][1] = V{};
    }
  }
  for (int64_t k = 0; k < K; ++k) {
    const V b0 = vload(B + k * ldb), b1 = vload(B + k * ldb + L);
    for (int i = 0; i < MR; ++i) {
      const T a = A[i * lda + k];  // broadcast by the vector-scalar product
      c[i][0] += b0 * a;
      c[i][1] += b1 * a;
    }
  }
  for (int i = 0; i < MR; ++i) {
    vstore(C + i * ldc, c[i][0]);
    vstore(C + i * ldc + L, c[i][1]);
  }
}

// C[M, Ncols] (+)= A[M, K] . B[K, Ncols]; Ncols a multiple of kCols<T>.
template <typename T>
DA_INLINE void gemm(T* C, int64_t ldc, const T* A, int64_t lda, const T* B, int64_t ldb, int64_t M, int64_t Ncols,
                    int64_t K, bool accumulate) {
  constexpr int64_t MR = 4;
  for (int64_t j0 = 0; j0 < Ncols; j0 += kCols<T>) {
    int64_t i = 0;
    for (; i + MR <= M; i += MR)
      micro_gemm<MR>(C + i * ldc + j0, ldc, A + i * lda, lda, B + j0, ldb, K, accumulate);
    for (; i < M; ++i) micro_gemm<1>(C + i * ldc + j0, ldc, A + i * lda, lda, B + j0, ldb, K, accumulate);
  }
}

// Online-softmax step on one score row s[0:kBlockK] of which the first `visible` entries are real:
// returns the new running max (max of m and the visible scores) and leaves s = exp(s - max) there, 0
// elsewhere. Max and sum are reduced in vector registers (a scalar loop would not vectorise).
template <typename T>
DA_INLINE T row_max(T* __restrict s, T m, int64_t visible) {
  using V = typename Vec<T>::type;
  constexpr int64_t L = Vec<T>::lanes;
  for (int64_t j = visible; j < kBlockK; ++j) s[j] = neg_inf<T>();
  V mv = V{} + m;
  for (int64_t j = 0; j < kBlockK; j += L) {
    const V x = vload(s + j);
    mv = x > mv ? x : mv;
  }
  for (int64_t l = 0; l < L; ++l) m = std::max(m, mv[l]);
  return m;
}

// exp of 8 floats: Cephes' expf (Cody-Waite reduction, degree-6 polynomial, <= 2 ulp), on vector
// registers. Round-to-nearest of x*log2(e) uses the 1.5*2^23 trick, whose low mantissa bits then hold
// the integer exponent. Inputs below -87 (and -inf) give 0.
DA_INLINE Vec<float>::type vexp(Vec<float>::type x) {
  using V = Vec<float>::type;
  typedef int32_t VI __attribute__((vector_size(32)));
  const V lo = V{} - 87.0f, hi = V{} + 88.0f, magic = V{} + 12582912.0f;
  const VI underflow = x < lo;
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  const V t = x * 1.44269504088896341f + magic;
  const V n = t - magic;
  V f = x - n * 0.693359375f;
  f = f - n * -2.12194440e-4f;
  V p = V{} + 1.9875691500e-4f;
  p = p * f + 1.3981999507e-3f;
  p = p * f + 8.3334519073e-3f;
  p = p * f + 4.1665795894e-2f;
  p = p * f + 1.6666665459e-1f;
  p = p * f + 5.0000001201e-1f;
  p = p * f * f + f + 1.0f;
  const VI e = ((VI)t - (VI)magic + 127) << 23;
  const V r = p * (V)e;
  return underflow ? V{} : r;
}

// s[j] <- exp(s[j] - shift) for j < visible and 0 for visible <= j < kBlockK; returns the row sum.
DA_INLINE float exp_row(float* __restrict s, float shift, int64_t visible) {
  using V = Vec<float>::type;
  constexpr int64_t L = Vec<float>::lanes;
  for (int64_t j = std::max<int64_t>(visible, 0); j < kBlockK; ++j) s[j] = neg_inf<float>();
  V acc = V{};
  for (int64_t j = 0; j < kBlockK; j += L) {
    const V e = vexp(vload(s + j) - shift);
    vstore(s + j, e);
    acc += e;
  }
  float sum = 0;
  for (int64_t l = 0; l < L; ++l) sum += acc[l];
  return sum;
}

DA_INLINE double exp_row(double* __restrict s, double shift, int64_t visible) {
  double sum = 0;
  for (int64_t j = 0; j < kBlockK; ++j) {
    s[j] = j < visible ? std::exp(s[j] - shift) : 0.0;
    sum += s[j];
  }
  return sum;
}

// y[0:D] += a * x[0:D]
template <typename acc_t>
DA_INLINE void axpy_row(acc_t* __restrict y, const acc_t* __restrict x, acc_t a, int64_t D) {
  for (int64_t d = 0; d < D; ++d) y[d] += a * x[d];
}

template <typename scalar_t, typename acc_t>
DA_INLINE void load_row(acc_t* __restrict dst, const scalar_t* __restrict src, int64_t D, acc_t mul) {
  for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<acc_t>(src[d]) * mul;
}

template <typename scalar_t, typename acc_t>
struct ForwardArgs {
  const scalar_t *q, *k, *v;
  Strides sq, sk, sv;
  acc_t* out;  // [B, N, H, D] contiguous, the running merged output
  acc_t* lse;  // [B, H, N], the running merged LSE
  AttentionShape shape;
};

// Tile rows are padded from D to Dp columns (a multiple of the micro-kernel width); the padding of every
// tile buffer is zero and stays zero, so it adds nothing to any product.
template <typename acc_t>
inline int64_t padded_dim(int64_t D) {
  return (D + kCols<acc_t> - 1) / kCols<acc_t> * kCols<acc_t>;
}

template <typename acc_t>
inline int64_t forward_workspace(int64_t D) {
  const int64_t Dp = padded_dim<acc_t>(D);
  return kBlockQ * Dp /*Q*/ + Dp * kBlockK /*K^T*/ + kBlockK * Dp /*V*/ + kBlockQ * kBlockK /*S*/ +
         kBlockQ * Dp /*O*/ + 2 * kBlockQ /*m, l*/;
}

// One branch's attention for the queries j in [q0, q0 + kBlockQ) of (batch b, head h, segment seg),
// merged into the running (out, lse). `work` is a zero-initialised forward_workspace.
template <typename scalar_t, typename acc_t>
DA_MULTIVERSION void forward_tile(const ForwardArgs<scalar_t, acc_t>& a, const Branch& br, int64_t b, int64_t h,
                                  int64_t seg, int64_t q0, acc_t* work) {
  const AttentionShape& sh = a.shape;
  const int64_t D = sh.head_dim, Dp = padded_dim<acc_t>(D), N = sh.seq_len, r = br.dilation;
  const int64_t off = br.offset(h);
  const int64_t n = br.members(N, seg, off);
  if (q0 >= n) return;
  const int64_t nq = std::min(kBlockQ, n - q0);
  const int64_t first = seg * br.seg_len + off;  // position of member 0
  const int64_t kvh = sh.kv_head(h);

  acc_t* Q = work;
  acc_t* KT = Q + kBlockQ * Dp;
  acc_t* V = KT + Dp * kBlockK;
  acc_t* S = V + kBlockK * Dp;
  acc_t* O = S + kBlockQ * kBlockK;
  acc_t* m = O + kBlockQ * Dp;
  acc_t* l = m + kBlockQ;

  const acc_t scale = static_cast<acc_t>(sh.scale);
  for (int64_t i = 0; i < nq; ++i) {
    const int64_t pos = first + r * (q0 + i);
    load_row(Q + i * Dp, a.q + b * a.sq.batch + pos * a.sq.seq + h * a.sq.head, D, scale);
    m[i] = neg_inf<acc_t>();
    l[i] = 0;
  }
  std::fill(O, O + nq * Dp, acc_t(0));

  const int64_t key_end = sh.causal ? q0 + nq : n;
  for (int64_t k0 = 0; k0 < key_end; k0 += kBlockK) {
    const int64_t nk = std::min(kBlockK, key_end - k0);
    for (int64_t j = 0; j < kBlockK; ++j) {
      if (j < nk) {
        const int64_t pos = first + r * (k0 + j);
        const scalar_t* kr = a.k + b * a.sk.batch + pos * a.sk.seq + kvh * a.sk.head;
        for (int64_t d = 0; d < D; ++d) KT[d * kBlockK + j] = static_cast<acc_t>(kr[d]);
        load_row(V + j * Dp, a.v + b * a.sv.batch + pos * a.sv.seq + kvh * a.sv.head, D, acc_t(1));
      } else {
        for (int64_t d = 0; d < D; ++d) KT[d * kBlockK + j] = 0;
      }
    }
    gemm(S, kBlockK, Q, Dp, KT, kBlockK, nq, kBlockK, Dp, false);  // scaled scores

    for (int64_t i = 0; i < nq; ++i) {
      acc_t* s = S + i * kBlockK;
      // keys visible to query q0+i in this tile: j < nk, and k0+j <= q0+i when causal
      const int64_t visible = sh.causal ? std::max<int64_t>(0, std::min(nk, q0 + i - k0 + 1)) : nk;
      const acc_t mx = row_max(s, m[i], visible);
      if (mx == neg_inf<acc_t>()) {  // nothing visible yet
        std::fill(s, s + kBlockK, acc_t(0));
        continue;
      }
      const acc_t alpha = std::exp(m[i] - mx);  // 0 while m = -inf
      const acc_t sum = exp_row(s, mx, visible);
      l[i] = l[i] * alpha + sum;
      m[i] = mx;
      acc_t* o = O + i * Dp;
      for (int64_t d = 0; d < Dp; ++d) o[d] *= alpha;
    }
    gemm(O, Dp, S, kBlockK, V, Dp, nq, Dp, nk, true);  // O += P V
  }

  // Every member query sees at least itself, so l > 0 and the branch lse is finite.
  for (int64_t i = 0; i < nq; ++i) {
    const int64_t pos = first + r * (q0 + i);
    const acc_t lse_i = m[i] + std::log(l[i]);
    acc_t* row = a.out + ((b * N + pos) * sh.num_heads + h) * D;
    acc_t& L = a.lse[(b * sh.num_heads + h) * N + pos];
    const acc_t* o = O + i * Dp;
    if (L == neg_inf<acc_t>()) {
      const acc_t inv = acc_t(1) / l[i];
      for (int64_t d = 0; d < D; ++d) row[d] = o[d] * inv;
      L = lse_i;
    } else {
      const acc_t hi = std::max(L, lse_i), lo = std::min(L, lse_i);
      const acc_t merged = hi + std::log1p(std::exp(lo - hi));
      const acc_t w_old = std::exp(L - merged), w_new = std::exp(lse_i - merged) / l[i];
      for (int64_t d = 0; d < D; ++d) row[d] = w_old * row[d] + w_new * o[d];
      L = merged;
    }
  }
}

template <typename scalar_t, typename acc_t>
struct BackwardArgs {
  const scalar_t *q, *k, *v, *dout;
  Strides sq, sk, sv, sdo;
  const acc_t* lse;     // [B, H, N] merged LSE
  const acc_t* delta;   // [B, H, N] rowsum(dout * out) - grad_lse
  acc_t *dq, *dk, *dv;  // contiguous [B, N, H(kv), D] accumulators
  AttentionShape shape;
};

template <typename acc_t>
inline int64_t backward_workspace(int64_t D) {
  const int64_t Dp = padded_dim<acc_t>(D);
  return kBlockK * Dp /*K*/ + 2 * Dp * kBlockK /*K^T, V^T*/ + 2 * kBlockK * Dp /*dK, dV*/ +
         3 * kBlockQ * Dp /*Q, dO, dQ*/ + 4 * kBlockQ * kBlockK /*P, dS and transposes*/;
}

// Gradient contributions of one branch for kv head kvh of (batch b, segment seg): every query head of the
// group that takes part, all of its key tiles against all of its query tiles. The task owns the dK/dV
// rows of (b, seg, kvh) and the dQ rows of (b, seg, group heads), so tasks never write the same row.
template <typename scalar_t, typename acc_t>
DA_MULTIVERSION void backward_segment(const BackwardArgs<scalar_t, acc_t>& a, const Branch& br, int64_t b,
                                      int64_t kvh, int64_t seg, acc_t* work) {
  const AttentionShape& sh = a.shape;
  const int64_t D = sh.head_dim, Dp = padded_dim<acc_t>(D), N = sh.seq_len, H = sh.num_heads;
  const int64_t r = br.dilation, group = H / sh.num_kv_heads;
  const int64_t h_begin = std::max(kvh * group, br.head_lo), h_end = std::min((kvh + 1) * group, br.head_hi);
  const acc_t scale = static_cast<acc_t>(sh.scale);

  acc_t* K = work;
  acc_t* KT = K + kBlockK * Dp;
  acc_t* VT = KT + Dp * kBlockK;
  acc_t* dK = VT + Dp * kBlockK;
  acc_t* dV = dK + kBlockK * Dp;
  acc_t* Q = dV + kBlockK * Dp;
  acc_t* dO = Q + kBlockQ * Dp;
  acc_t* dQ = dO + kBlockQ * Dp;
  acc_t* P = dQ + kBlockQ * Dp;      // [kBlockQ, kBlockK]
  acc_t* dS = P + kBlockQ * kBlockK;  // [kBlockQ, kBlockK]
  acc_t* PT = dS + kBlockQ * kBlockK;  // [kBlockK, kBlockQ]
  acc_t* dST = PT + kBlockK * kBlockQ;

  for (int64_t h = h_begin; h < h_end; ++h) {
    const int64_t off = br.offset(h);
    const int64_t n = br.members(N, seg, off);
    const int64_t first = seg * br.seg_len + off;
    const acc_t* lse_h = a.lse + (b * H + h) * N;
    const acc_t* delta_h = a.delta + (b * H + h) * N;
    for (int64_t k0 = 0; k0 < n; k0 += kBlockK) {
      const int64_t nk = std::min(kBlockK, n - k0);
      for (int64_t j = 0; j < kBlockK; ++j) {
        if (j < nk) {
          const int64_t pos = first + r * (k0 + j);
          const scalar_t* kr = a.k + b * a.sk.batch + pos * a.sk.seq + kvh * a.sk.head;
          const scalar_t* vr = a.v + b * a.sv.batch + pos * a.sv.seq + kvh * a.sv.head;
          load_row(K + j * Dp, kr, D, acc_t(1));
          for (int64_t d = 0; d < D; ++d) {
            KT[d * kBlockK + j] = static_cast<acc_t>(kr[d]);
            VT[d * kBlockK + j] = static_cast<acc_t>(vr[d]);
          }
        } else {
          for (int64_t d = 0; d < D; ++d) KT[d * kBlockK + j] = VT[d * kBlockK + j] = 0;
        }
      }
      std::fill(dK, dK + nk * Dp, acc_t(0));
      std::fill(dV, dV + nk * Dp, acc_t(0));

      // Causal: query j sees key t only if t <= j, so query tiles ending before k0 contribute nothing.
      const int64_t q_begin = sh.causal ? (k0 / kBlockQ) * kBlockQ : 0;
      for (int64_t q0 = q_begin; q0 < n; q0 += kBlockQ) {
        const int64_t nq = std::min(kBlockQ, n - q0);
        for (int64_t i = 0; i < nq; ++i) {
          const int64_t pos = first + r * (q0 + i);
          load_row(Q + i * Dp, a.q + b * a.sq.batch + pos * a.sq.seq + h * a.sq.head, D, scale);
          load_row(dO + i * Dp, a.dout + b * a.sdo.batch + pos * a.sdo.seq + h * a.sdo.head, D, acc_t(1));
        }
        gemm(P, kBlockK, Q, Dp, KT, kBlockK, nq, kBlockK, Dp, false);    // scaled scores
        gemm(dS, kBlockK, dO, Dp, VT, kBlockK, nq, kBlockK, Dp, false);  // dP = dO . v
        for (int64_t i = 0; i < nq; ++i) {
          const int64_t pos = first + r * (q0 + i);
          const acc_t L = lse_h[pos], dl = delta_h[pos];
          const int64_t visible = sh.causal ? std::min(nk, q0 + i - k0 + 1) : nk;
          acc_t* p = P + i * kBlockK;
          acc_t* ds = dS + i * kBlockK;
          exp_row(p, L, visible);  // P = exp(S - LSE), 0 where masked
          for (int64_t j = 0; j < kBlockK; ++j) ds[j] = p[j] * (ds[j] - dl);  // dS = P * (dP - delta)
        }
        for (int64_t i = 0; i < nq; ++i)
          for (int64_t j = 0; j < nk; ++j) {
            PT[j * kBlockQ + i] = P[i * kBlockK + j];
            dST[j * kBlockQ + i] = dS[i * kBlockK + j];
          }
        gemm(dV, Dp, PT, kBlockQ, dO, Dp, nk, Dp, nq, true);  // dV += P^T dO
        gemm(dK, Dp, dST, kBlockQ, Q, Dp, nk, Dp, nq, true);  // dK += dS^T (scale q)
        gemm(dQ, Dp, dS, kBlockK, K, Dp, nq, Dp, nk, false);  // dQ = dS k (times scale below)
        for (int64_t i = 0; i < nq; ++i) {
          const int64_t pos = first + r * (q0 + i);
          axpy_row(a.dq + ((b * N + pos) * H + h) * D, dQ + i * Dp, scale, D);
        }
      }
      for (int64_t j = 0; j < nk; ++j) {
        const int64_t pos = first + r * (k0 + j);
        const int64_t row = ((b * N + pos) * sh.num_kv_heads + kvh) * D;
        axpy_row(a.dk + row, dK + j * Dp, acc_t(1), D);
        axpy_row(a.dv + row, dV + j * Dp, acc_t(1), D);
      }
    }
  }
}

AttentionShape shape_of(const at::Tensor& q, const at::Tensor& k, bool causal, double scale) {
  return AttentionShape{q.size(0), q.size(1), q.size(2), k.size(2), q.size(3), causal, scale};
}

std::tuple<at::Tensor, at::Tensor> forward_cpu(const at::Tensor& q_in, const at::Tensor& k_in,
                                               const at::Tensor& v_in, at::IntArrayRef segment_lengths,
                                               at::IntArrayRef dilation_rates, bool split_heads, bool causal,
                                               double scale) {
  check_qkv(q_in, k_in, v_in);
  const at::Tensor q = rows_contiguous(q_in), k = rows_contiguous(k_in), v = rows_contiguous(v_in);
  const AttentionShape sh = shape_of(q, k, causal, scale);
  const auto table = make_branch_table(segment_lengths, dilation_rates, sh.num_heads, sh.seq_len, split_heads);
  const auto acc_type = lse_dtype(q.scalar_type());
  at::Tensor out_acc = at::zeros(q.sizes(), q.options().dtype(acc_type));
  at::Tensor lse = at::full({sh.batch, sh.num_heads, sh.seq_len}, -std::numeric_limits<double>::infinity(),
                            q.options().dtype(acc_type));

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "dilated_attn_forward_cpu", [&] {
    using acc_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
    ForwardArgs<scalar_t, acc_t> args{q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(),
                                      strides_of(q), strides_of(k), strides_of(v), out_acc.data_ptr<acc_t>(),
                                      lse.data_ptr<acc_t>(), sh};
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
          forward_tile(args, br, b, br.head_lo + hh, seg, tile * kBlockQ, work.data());
        }
      });
    }
  });
  return {out_acc.scalar_type() == q.scalar_type() ? out_acc : out_acc.to(q.scalar_type()), lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> backward_cpu(
    const at::Tensor& grad_out_in, const std::optional<at::Tensor>& grad_lse, const at::Tensor& q_in,
    const at::Tensor& k_in, const at::Tensor& v_in, const at::Tensor& out, const at::Tensor& lse_in,
    at::IntArrayRef segment_lengths, at::IntArrayRef dilation_rates, bool split_heads, bool causal, double scale) {
  check_qkv(q_in, k_in, v_in);
  TORCH_CHECK_VALUE(grad_out_in.sizes() == q_in.sizes() && out.sizes() == q_in.sizes(),
                    "grad_out and out must have the shape of q");
  const at::Tensor q = rows_contiguous(q_in), k = rows_contiguous(k_in), v = rows_contiguous(v_in);
  const at::Tensor grad_out = rows_contiguous(grad_out_in.to(q.scalar_type()));
  const AttentionShape sh = shape_of(q, k, causal, scale);
  const auto table = make_branch_table(segment_lengths, dilation_rates, sh.num_heads, sh.seq_len, split_heads);
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
    const int64_t ws = backward_workspace<acc_t>(sh.head_dim);
    for (const Branch& br : table) {
      const int64_t segs = br.num_segments(sh.seq_len);
      const int64_t tasks = sh.batch * sh.num_kv_heads * segs;
      at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
        std::vector<acc_t> work(ws);
        for (int64_t t = begin; t < end; ++t) {
          const int64_t seg = t % segs, kvh = (t / segs) % sh.num_kv_heads, b = t / segs / sh.num_kv_heads;
          backward_segment(args, br, b, kvh, seg, work.data());
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
