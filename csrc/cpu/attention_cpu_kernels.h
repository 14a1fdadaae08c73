// The CPU tile kernels, written once over vectors of DA_VEC_BYTES bytes. attention_cpu.cpp includes this
// file once per instruction set, inside a namespace of its own and, for AVX2, under
// `#pragma GCC target`, so the same source becomes a baseline and an AVX2+FMA build side by side.
// No include guard: including it twice is the point.

// Vectors of DA_VEC_BYTES (GCC/Clang vector extensions): 32 bytes (one AVX register) in the AVX2 build,
// 16 bytes (one SSE/NEON register) in the baseline build. Wider vectors than the ISA has would be split
// element-wise by the compiler, which is an order of magnitude slower.
template <typename T>
struct Vec {
  typedef T type __attribute__((vector_size(DA_VEC_BYTES)));
  static constexpr int64_t lanes = DA_VEC_BYTES / sizeof(T);
};
static_assert(kPadBytes % (2 * DA_VEC_BYTES) == 0, "tile padding must hold whole micro-kernel columns");
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

// Register-blocked GEMM on small row-major tiles: C[M, Ncols] (+)= A[M, K] . B[K, Ncols], Ncols a
// multiple of kCols<T>; micro_gemm does MR rows x kCols columns with its accumulators in registers.
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

// First half of an online-softmax step on one score row s[0:kBlockK] of which the first `visible` entries
// are real: sets the others to -inf and returns the new running max (max of m and the visible scores),
// reduced in vector registers (a scalar loop would not vectorise). exp_row does the second half.
template <typename T>
DA_INLINE T row_max(T* __restrict s, T m, int64_t visible) {
  using V = typename Vec<T>::type;
  constexpr int64_t L = Vec<T>::lanes;
  for (int64_t j = visible; j < kBlockK; ++j) s[j] = neg_inf<T>();
  // NaN wins the comparisons (x != x), so a NaN score makes the row's max, and with it its lse, NaN instead
  // of being skipped: the row then reports NaN in out and lse alike.
  V mv = V{} + m;
  for (int64_t j = 0; j < kBlockK; j += L) {
    const V x = vload(s + j);
    mv = (x > mv) | (x != x) ? x : mv;
  }
  for (int64_t l = 0; l < L; ++l) m = (mv[l] > m || mv[l] != mv[l]) ? mv[l] : m;
  return m;
}

// exp of a float vector: Cephes' expf (Cody-Waite reduction, degree-6 polynomial, <= 2 ulp), on vector
// registers. Round-to-nearest of x*log2(e) uses the 1.5*2^23 trick, whose low mantissa bits then hold
// the integer exponent. Inputs below -87 (and -inf) give 0.
DA_INLINE Vec<float>::type vexp(Vec<float>::type x) {
  using V = Vec<float>::type;
  typedef int32_t VI __attribute__((vector_size(DA_VEC_BYTES)));
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

// One branch's attention for the queries j in [q0, q0 + kBlockQ) of (batch b, head h, segment seg),
// merged into the running (out, lse). `work` is a zero-initialised forward_workspace.
template <typename scalar_t, typename acc_t>
void forward_tile(const ForwardArgs<scalar_t, acc_t>& a, const Branch& br, int64_t b, int64_t h,
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
    // Two-term LSE merge, w_i = exp(L_i - max) / sum_j exp(L_j - max) (src/dilated_attn/merge.py).
    // Running lse -inf (no earlier branch covered the row): w_old = 0, so (o / l, lse_i) is stored as is.
    if (L == neg_inf<acc_t>()) {
      const acc_t inv = acc_t(1) / l[i];
      for (int64_t d = 0; d < D; ++d) row[d] = o[d] * inv;
      L = lse_i;
    } else {
      const acc_t hi = std::max(L, lse_i);
      const acc_t e_old = std::exp(L - hi), e_new = std::exp(lse_i - hi), sum = e_old + e_new;
      const acc_t w_old = e_old / sum, w_new = e_new / sum / l[i];
      for (int64_t d = 0; d < D; ++d) row[d] = w_old * row[d] + w_new * o[d];
      L = hi + std::log(sum);
    }
  }
}

// Gradient contributions of one branch for kv head kvh of (batch b, segment seg): every query head of the
// group that takes part, all of its key tiles against all of its query tiles. The task owns the dK/dV
// rows of (b, seg, kvh) and the dQ rows of (b, seg, group heads), so tasks never write the same row.
template <typename scalar_t, typename acc_t>
void backward_segment(const BackwardArgs<scalar_t, acc_t>& a, const Branch& br, int64_t b,
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
