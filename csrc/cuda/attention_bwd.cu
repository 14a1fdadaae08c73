// CUDA backward: the exact gradient of the merged function, one branch at a time.
//
// With the merged output O and log-sum-exp L of the forward, every key t a query p sees in any branch has
// P = exp(s_pt - L(p)) and dS = P * (dP - delta), delta(p) = rowsum(dO * O)(p) - dL(p). Running each
// branch's flash-style backward with these merged O, L, delta gives the gradient of the merged function,
// merge weights included (docs/SPEC.md, "Gradients").
//
// - delta_kernel: one warp per (batch, position, head) row.
// - dq_kernel: a block owns kDqBlockM (64) query members of one (batch, head, segment), like the forward,
//   and walks the segment's keys kDqBlockN (64) at a time: S = Q K^T and dP = dO V^T reduced over the
//   head dim in chunks gathered into transposed shared tiles, dS through shared memory, dQ += dS K with
//   K's rows streamed.
// - dkdv_kernel: a block owns dkdv_block_n (64; 32 for head dim 256) key members of one (batch, kv head,
//   segment) and, for each query head of its group that takes part, walks the query members kDkdvBlockM
//   (32) at a time: S^T = K Q^T, dP^T = V dO^T, then dV += P^T dO and dK += dS^T Q.
// Every block adds its fp32 sums into fp32 accumulators with a plain read-add-write: within one launch no
// two blocks write the same position (the blocks of a segment own disjoint members, heads of one block
// are visited by the same threads in turn), so there are no atomics and results are deterministic.
#include "common.cuh"

namespace dilated_attn {
namespace cuda {
namespace {

constexpr int kChunkD = 16;  // head-dim chunk of the two score reductions (four tiles in flight)

// Blocks per SM the registers of dq_kernel and dkdv_kernel are sized for (__launch_bounds__): 2, so 255
// registers a thread at every head dim.
constexpr int kBackwardMinBlocks = 2;

// dq_kernel's tiles: kDqBlockM queries per block against kDqBlockN keys per step. Q^T and dO^T (kDqBlockM
// rows), K^T and V^T (kDqBlockN rows) and dS^T (indexed by query) share one leading dim.
constexpr int kDqBlockM = 64;
constexpr int kDqBlockN = 64;
constexpr int kDqLd = transposed_ld(kDqBlockM);  // 68: LD % 32 == 4, conflict-free transposed gathers
static_assert(kDqBlockN <= kDqBlockM, "K^T and V^T rows fit kDqLd");

// Shared floats for the chunked tiles: dq_kernel's four transposed chunks Q^T, dO^T, K^T, V^T (17 KiB,
// as much as the forward's score tiles). The row chunks of both kernels and dkdv_kernel's four chunks
// reuse the same space.
constexpr int kTileFloats = 4 * kChunkD * kDqLd;

// dkdv_kernel's tiles: dkdv_block_n<DMAX>() keys per block against kDkdvBlockM queries per step. dK and
// dV take 2 * (keys / 8) * (DMAX / 16) accumulator registers a thread: at most 128 with 64 keys up to head
// dim 128; head dim 256 takes 32 keys (64 would need 256 registers).
constexpr int kDkdvBlockM = 32;
template <int DMAX>
__host__ __device__ constexpr int dkdv_block_n() {
  return DMAX > 128 ? 32 : 64;
}

template <int ROWS_MAX, int DMAX>
__host__ __device__ constexpr int row_chunk() {  // rows of a [rows][DMAX] tile that fit the tile space
  int rows = ROWS_MAX;
  while (rows * DMAX > kTileFloats) rows /= 2;
  return rows;
}

template <typename T>
__global__ void __launch_bounds__(kThreads) delta_kernel(const DeltaParams p) {
  const AttentionShape& sh = p.shape;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * (kThreads / 32) + threadIdx.x / 32;
  if (row >= sh.batch * sh.seq_len * sh.num_heads) return;
  const int64_t h = row % sh.num_heads, n = (row / sh.num_heads) % sh.seq_len, b = row / sh.num_heads / sh.seq_len;
  const T* o = static_cast<const T*>(p.out) + b * p.so.batch + n * p.so.seq + h * p.so.head;
  const T* g = static_cast<const T*>(p.dout) + b * p.sdo.batch + n * p.sdo.seq + h * p.sdo.head;
  float acc = 0.f;
  for (int64_t d = threadIdx.x % 32; d < sh.head_dim; d += 32) acc = fmaf(to_float(o[d]), to_float(g[d]), acc);
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, m);
  if (threadIdx.x % 32 == 0) {
    const int64_t idx = (b * sh.num_heads + h) * sh.seq_len + n;
    p.delta[idx] = acc - (p.grad_lse != nullptr ? p.grad_lse[idx] : 0.f);
  }
}

// The rows of tensor x for (batch b, head `head`) at one segment's members.
template <typename T>
__device__ __forceinline__ DilatedRows<T> rows_of(const void* x, const Strides& s, int64_t b, int64_t head,
                                                  const Members& mem, int64_t dilation) {
  return DilatedRows<T>{static_cast<const T*>(x) + b * s.batch + head * s.head, s.seq, mem.first, dilation,
                        mem.count};
}

template <typename T, int DMAX>
__global__ void __launch_bounds__(kThreads, kBackwardMinBlocks) dq_kernel(const BackwardParams p) {
  constexpr int BM = kDqBlockM, BN = kDqBlockN, LD = kDqLd;
  constexpr int R = BM / kRowsY, C = BN / kColsX, J = DMAX / kColsX;  // rows, key columns, dims per thread
  constexpr int KC = row_chunk<BN, DMAX>();
  __shared__ __align__(16) float tiles[kTileFloats];  // Q^T, dO^T, K^T, V^T chunks; then K row chunks
  __shared__ __align__(16) float ds_t[BN * LD];       // dS^T: [key][query]
  // lse * log2(e) and delta of the block's queries: in shared memory rather than 2 * R registers a thread, which
  // the score loop needs (with them held there, the kernel spilled into its inner loops at head dim 128)
  __shared__ __align__(16) float row_stats[2 * BM];
  float* q_t = tiles;
  float* do_t = tiles + kChunkD * LD;
  float* k_t = tiles + 2 * kChunkD * LD;
  float* v_t = tiles + 3 * kChunkD * LD;

  const AttentionShape& sh = p.shape;
  const Branch& br = p.branch;
  const auto [b, head, seg, tile] = query_grid(br, sh, BM).block_tile();
  const Members mem = members_of(br, sh.seq_len, head, seg);
  const int64_t start_m = tile * BM;
  if (start_m >= mem.count) return;
  const int64_t kvh = sh.kv_head(head);
  const auto q_rows = rows_of<T>(p.q, p.sq, b, head, mem, br.dilation);
  const auto do_rows = rows_of<T>(p.dout, p.sdo, b, head, mem, br.dilation);
  const auto k_rows = rows_of<T>(p.k, p.sk, b, kvh, mem, br.dilation);
  const auto v_rows = rows_of<T>(p.v, p.sv, b, kvh, mem, br.dilation);
  const int ty = threadIdx.x / kColsX, tx = threadIdx.x % kColsX;
  const int dim = static_cast<int>(sh.head_dim);
  const float scale2 = static_cast<float>(sh.scale) * kLog2e;
  const int64_t row_base = (b * sh.num_heads + head) * sh.seq_len;

  static_assert(BM <= kThreads, "a thread per query row fills row_stats");
  if (threadIdx.x < BM) {  // read by the softmax step, after the score loop's barriers
    const int64_t pos = mem.first + min(start_m + threadIdx.x, mem.count - 1) * br.dilation;
    row_stats[threadIdx.x] = p.lse[row_base + pos] * kLog2e;
    row_stats[BM + threadIdx.x] = p.delta[row_base + pos];
  }
  float dq[R][J];
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int j = 0; j < J; ++j) dq[r][j] = 0.f;

  const int64_t key_end = sh.causal ? min(mem.count, start_m + BM) : mem.count;
  for (int64_t start_n = 0; start_n < key_end; start_n += BN) {
    float s[R][C], dp[R][C];
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int c = 0; c < C; ++c) s[r][c] = dp[r][c] = 0.f;
    for (int d0 = 0; d0 < DMAX; d0 += kChunkD) {
      __syncthreads();
      gather_transposed<T, BM, kChunkD, LD>(q_t, q_rows, start_m, d0, dim);
      gather_transposed<T, BM, kChunkD, LD>(do_t, do_rows, start_m, d0, dim);
      gather_transposed<T, BN, kChunkD, LD>(k_t, k_rows, start_n, d0, dim);
      gather_transposed<T, BN, kChunkD, LD>(v_t, v_rows, start_n, d0, dim);
      __syncthreads();
#pragma unroll 4
      for (int d = 0; d < kChunkD; ++d) {
        float a[R], g[R], kk[C], vv[C];
        load_row_values(a, q_t + d * LD + ty * R);
        load_row_values(g, do_t + d * LD + ty * R);
        load_thread_cols(kk, k_t + d * LD, tx);
        load_thread_cols(vv, v_t + d * LD, tx);
#pragma unroll
        for (int r = 0; r < R; ++r)
#pragma unroll
          for (int c = 0; c < C; ++c) {
            s[r][c] = fmaf(a[r], kk[c], s[r][c]);
            dp[r][c] = fmaf(g[r], vv[c], dp[r][c]);
          }
      }
    }
    float lse2[R], delta[R];
    load_row_values(lse2, row_stats + ty * R);
    load_row_values(delta, row_stats + BM + ty * R);
#pragma unroll
    for (int c = 0; c < C; ++c) {
      const int64_t kj = start_n + thread_col<C>(tx, c);
      float col[R];
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const int64_t qi = start_m + ty * R + r;
        const bool visible = qi < mem.count && kj < mem.count && (!sh.causal || kj <= qi);
        const float pr = visible ? exp2f(s[r][c] * scale2 - lse2[r]) : 0.f;
        col[r] = pr * (dp[r][c] - delta[r]);
      }
      store_row_values(ds_t + thread_col<C>(tx, c) * LD + ty * R, col);
    }
    for (int k0 = 0; k0 < BN; k0 += KC) {
      __syncthreads();
      gather_rows<T, KC, DMAX>(tiles, k_rows, start_n + k0, dim);
      __syncthreads();
#pragma unroll 4
      for (int kk = 0; kk < KC; ++kk) {
        float dsr[R], kv[J];
        load_row_values(dsr, ds_t + (k0 + kk) * LD + ty * R);
        load_thread_cols(kv, tiles + kk * DMAX, tx);
#pragma unroll
        for (int r = 0; r < R; ++r)
#pragma unroll
          for (int j = 0; j < J; ++j) dq[r][j] = fmaf(dsr[r], kv[j], dq[r][j]);
      }
    }
  }

  const float scale = static_cast<float>(sh.scale);
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int64_t qi = start_m + ty * R + r;
    if (qi < mem.count) {
      float* row = p.dq + ((b * sh.seq_len + mem.first + qi * br.dilation) * sh.num_heads + head) * sh.head_dim;
#pragma unroll
      for (int j = 0; j < J; ++j) {
        const int d = thread_col<J>(tx, j);
        if (d < dim) row[d] += dq[r][j] * scale;
      }
    }
  }
}

template <typename T, int DMAX>
__global__ void __launch_bounds__(kThreads, kBackwardMinBlocks) dkdv_kernel(const BackwardParams p) {
  constexpr int BN = dkdv_block_n<DMAX>(), BM = kDkdvBlockM;
  constexpr int R = BN / kRowsY, C = BM / kColsX, J = DMAX / kColsX;  // key rows, query columns, dims per thread
  constexpr int LDN = transposed_ld(BN), LDM = transposed_ld(BM);    // K^T, V^T, P, dS; Q^T, dO^T
  constexpr int QC = row_chunk<BM, DMAX>() / 2;  // query rows per chunk: Q and dO side by side
  static_assert(2 * kChunkD * (LDN + LDM) <= kTileFloats, "score tiles");
  __shared__ __align__(16) float tiles[kTileFloats];  // K^T, V^T, Q^T, dO^T chunks; then Q, dO row chunks
  __shared__ __align__(16) float p_s[BM * LDN];       // P: [query][key]
  __shared__ __align__(16) float ds_s[BM * LDN];      // dS: [query][key]
  float* k_t = tiles;
  float* v_t = tiles + kChunkD * LDN;
  float* q_t = tiles + 2 * kChunkD * LDN;
  float* do_t = tiles + 2 * kChunkD * LDN + kChunkD * LDM;

  const AttentionShape& sh = p.shape;
  const Branch& br = p.branch;
  const auto [b, kvh, seg, tile] = kv_grid(br, sh, BN).block_tile();
  const int64_t group = sh.num_heads / sh.num_kv_heads;
  const int64_t h_begin = max(kvh * group, br.head_lo), h_end = min((kvh + 1) * group, br.head_hi);
  const int64_t start_n = tile * BN;
  const int ty = threadIdx.x / kColsX, tx = threadIdx.x % kColsX;
  const int dim = static_cast<int>(sh.head_dim);
  const float scale2 = static_cast<float>(sh.scale) * kLog2e;
  const float scale = static_cast<float>(sh.scale);

  for (int64_t head = h_begin; head < h_end; ++head) {
    const Members mem = members_of(br, sh.seq_len, head, seg);
    if (start_n >= mem.count) continue;  // uniform over the block
    const auto q_rows = rows_of<T>(p.q, p.sq, b, head, mem, br.dilation);
    const auto do_rows = rows_of<T>(p.dout, p.sdo, b, head, mem, br.dilation);
    const auto k_rows = rows_of<T>(p.k, p.sk, b, kvh, mem, br.dilation);
    const auto v_rows = rows_of<T>(p.v, p.sv, b, kvh, mem, br.dilation);
    const int64_t row_base = (b * sh.num_heads + head) * sh.seq_len;

    float dk[R][J], dv[R][J];
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int j = 0; j < J; ++j) dk[r][j] = dv[r][j] = 0.f;

    // Causal: queries before the block's first key never see it.
    for (int64_t start_m = sh.causal ? start_n / BM * BM : 0; start_m < mem.count; start_m += BM) {
      float s[R][C], dp[R][C];
#pragma unroll
      for (int r = 0; r < R; ++r)
#pragma unroll
        for (int c = 0; c < C; ++c) s[r][c] = dp[r][c] = 0.f;
      for (int d0 = 0; d0 < DMAX; d0 += kChunkD) {
        __syncthreads();
        gather_transposed<T, BN, kChunkD, LDN>(k_t, k_rows, start_n, d0, dim);
        gather_transposed<T, BN, kChunkD, LDN>(v_t, v_rows, start_n, d0, dim);
        gather_transposed<T, BM, kChunkD, LDM>(q_t, q_rows, start_m, d0, dim);
        gather_transposed<T, BM, kChunkD, LDM>(do_t, do_rows, start_m, d0, dim);
        __syncthreads();
#pragma unroll 4
        for (int d = 0; d < kChunkD; ++d) {
          float kr[R], vr[R], qc[C], gc[C];
          load_row_values(kr, k_t + d * LDN + ty * R);
          load_row_values(vr, v_t + d * LDN + ty * R);
          load_thread_cols(qc, q_t + d * LDM, tx);
          load_thread_cols(gc, do_t + d * LDM, tx);
#pragma unroll
          for (int r = 0; r < R; ++r)
#pragma unroll
            for (int c = 0; c < C; ++c) {
              s[r][c] = fmaf(kr[r], qc[c], s[r][c]);
              dp[r][c] = fmaf(vr[r], gc[c], dp[r][c]);
            }
        }
      }
#pragma unroll
      for (int c = 0; c < C; ++c) {
        const int64_t qi = start_m + thread_col<C>(tx, c);
        const int64_t pos = mem.first + min(qi, mem.count - 1) * br.dilation;
        const float lse2 = p.lse[row_base + pos] * kLog2e, delta = p.delta[row_base + pos];
        float pc[R], dsc[R];
#pragma unroll
        for (int r = 0; r < R; ++r) {
          const int64_t kj = start_n + ty * R + r;
          const bool visible = qi < mem.count && kj < mem.count && (!sh.causal || kj <= qi);
          pc[r] = visible ? exp2f(s[r][c] * scale2 - lse2) : 0.f;
          dsc[r] = pc[r] * (dp[r][c] - delta);
        }
        store_row_values(p_s + thread_col<C>(tx, c) * LDN + ty * R, pc);
        store_row_values(ds_s + thread_col<C>(tx, c) * LDN + ty * R, dsc);
      }
      for (int q0 = 0; q0 < BM; q0 += QC) {
        __syncthreads();
        gather_rows<T, QC, DMAX>(tiles, q_rows, start_m + q0, dim);
        gather_rows<T, QC, DMAX>(tiles + QC * DMAX, do_rows, start_m + q0, dim);
        __syncthreads();
#pragma unroll 2
        for (int qq = 0; qq < QC; ++qq) {
          float pr[R], dsr[R], qv[J], gv[J];
          load_row_values(pr, p_s + (q0 + qq) * LDN + ty * R);
          load_row_values(dsr, ds_s + (q0 + qq) * LDN + ty * R);
          load_thread_cols(qv, tiles + qq * DMAX, tx);
          load_thread_cols(gv, tiles + (QC + qq) * DMAX, tx);
#pragma unroll
          for (int r = 0; r < R; ++r)
#pragma unroll
            for (int j = 0; j < J; ++j) {
              dv[r][j] = fmaf(pr[r], gv[j], dv[r][j]);
              dk[r][j] = fmaf(dsr[r], qv[j], dk[r][j]);
            }
        }
      }
    }

#pragma unroll
    for (int r = 0; r < R; ++r) {
      const int64_t kj = start_n + ty * R + r;
      if (kj < mem.count) {
        const int64_t off = ((b * sh.seq_len + mem.first + kj * br.dilation) * sh.num_kv_heads + kvh) * sh.head_dim;
#pragma unroll
        for (int j = 0; j < J; ++j) {
          const int d = thread_col<J>(tx, j);
          if (d < dim) {
            p.dk[off + d] += dk[r][j] * scale;
            p.dv[off + d] += dv[r][j];
          }
        }
      }
    }
  }
}

}  // namespace

cudaError_t launch_delta(const DeltaParams& p, ScalarKind kind, cudaStream_t stream) {
  const int64_t rows = p.shape.batch * p.shape.seq_len * p.shape.num_heads;
  const int64_t blocks = (rows + kThreads / 32 - 1) / (kThreads / 32);
  if (blocks == 0) return cudaSuccess;
  if (blocks > kMaxGridBlocks) return cudaErrorInvalidConfiguration;
  return dispatch_scalar(kind, [&](auto tag) {
    delta_kernel<decltype(tag)><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(p);
    return cudaGetLastError();
  });
}

cudaError_t launch_backward(const BackwardParams& p, ScalarKind kind, cudaStream_t stream) {
  const AttentionShape& sh = p.shape;
  const Branch& br = p.branch;
  return dispatch_scalar(kind, [&](auto tag) {
    using T = decltype(tag);
    return dispatch_head_dim(sh.head_dim, [&](auto dmax) {
      constexpr int DMAX = decltype(dmax)::value;
      const int64_t kv_blocks = kv_grid(br, sh, dkdv_block_n<DMAX>()).blocks();
      const int64_t q_blocks = query_grid(br, sh, kDqBlockM).blocks();
      if (kv_blocks > kMaxGridBlocks || q_blocks > kMaxGridBlocks) return cudaErrorInvalidConfiguration;
      if (kv_blocks == 0 || q_blocks == 0) return cudaSuccess;
      dkdv_kernel<T, DMAX><<<static_cast<unsigned>(kv_blocks), kThreads, 0, stream>>>(p);
      cudaError_t err = cudaGetLastError();
      if (err != cudaSuccess) return err;
      dq_kernel<T, DMAX><<<static_cast<unsigned>(q_blocks), kThreads, 0, stream>>>(p);
      return cudaGetLastError();
    });
  });
}

}  // namespace cuda
}  // namespace dilated_attn
