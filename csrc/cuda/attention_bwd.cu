// CUDA backward: the exact gradient of the merged function, one branch at a time.
//
// With the merged output O and log-sum-exp L of the forward, every key t a query p sees in any branch has
// P = exp(s_pt - L(p)) and dS = P * (dP - delta), delta(p) = rowsum(dO * O)(p) - dL(p). Running each
// branch's flash-style backward with these merged O, L, delta gives the gradient of the merged function,
// merge weights included (docs/SPEC.md, "Gradients").
//
// - delta_kernel: one warp per (batch, position, head) row.
// - dq_kernel: a block owns DqTiles::kBlockM query members of one (batch, head, segment), like the forward,
//   and walks the segment's keys kBlockN at a time: S = Q K^T and dP = dO V^T reduced over the head dim in
//   chunks gathered into transposed shared tiles, dS through shared memory, dQ += dS K with K's rows streamed.
// - dkdv_kernel: a block owns DkdvTiles::kBlockN key members of one (batch, kv head, segment) and, for each
//   query head of its group that takes part, walks the query members kBlockM at a time: S^T = K Q^T,
//   dP^T = V dO^T, then dV += P^T dO and dK += dS^T Q.
// The tile structs hold the sizes per tile table (launch.h): Volta and newer 64 x 64 (dq) and 64 x 32 (dK/dV;
// 32 keys at head dim 256); Pascal, within 64 registers a thread, 16 x 32 (8 queries at head dim 256) and 8 x 16,
// dK/dV's output dims split over blocks from head dim 96.
// Every block adds its fp32 sums into fp32 accumulators with a plain read-add-write: within one launch no
// two blocks write the same position (the blocks of a segment own disjoint members, heads of one block
// are visited by the same threads in turn), so there are no atomics and results are deterministic.
#include "common.cuh"

namespace dilated_attn {
namespace cuda {
namespace {

constexpr int kChunkD = 16;  // head-dim chunk of the two score reductions (four tiles in flight)

// Rows of a [rows][DMAX] tile, at most ROWS_MAX (halving), that fit `floats`.
template <int ROWS_MAX, int DMAX>
__host__ __device__ constexpr int row_chunk(int floats) {
  int rows = ROWS_MAX;
  while (rows * DMAX > floats) rows /= 2;
  return rows;
}

// dq_kernel's tiles per tile table (launch.h) and head dim: kBlockM queries per block against kBlockN keys per
// step. Q^T and dO^T (kLdM), K^T and V^T (kLdN) chunks, then K row chunks, share kTileFloats; dS^T is [key][query].
template <int TILES, int DMAX>
struct DqTiles {
  static constexpr bool kPascal = TILES == kPascalTiles;
  // Pascal: few queries and keys, so that dQ (R x J), S and dP (R x C each) fit 64 registers a thread.
  static constexpr int kBlockM = kPascal ? (DMAX > 128 ? 8 : 16) : 64;
  static constexpr int kBlockN = kPascal ? 32 : 64;
  static constexpr int kLdM = transposed_ld(kBlockM), kLdN = transposed_ld(kBlockN);
  static constexpr int kTileFloats = 2 * kChunkD * (kLdM + kLdN);
  static constexpr int kKeyChunk = row_chunk<kBlockN, DMAX>(kTileFloats);  // K rows per chunk of dQ += dS K
  // Blocks per SM for __launch_bounds__: Pascal 8 (64 registers a thread), else 2 (255).
  static constexpr int kMinBlocks = kPascal ? 8 : 2;
};

// dkdv_kernel's tiles: kBlockN keys per block against kBlockM queries per step. K^T, V^T (kLdN), Q^T and dO^T
// (kLdM) chunks, then Q and dO row chunks, share kTileFloats; P and dS are [query][key].
template <int TILES, int DMAX>
struct DkdvTiles {
  static constexpr bool kPascal = TILES == kPascalTiles;
  // dK and dV take 2 * (kBlockN / 8) * (kOutDims / 16) accumulator registers a thread. Volta: at most 128, with
  // 64 keys up to head dim 128 and 32 at 256. Pascal: 8 keys (one row a thread), at most 8.
  static constexpr int kBlockN = kPascal ? 8 : (DMAX > 128 ? 32 : 64);
  static constexpr int kBlockM = kPascal ? 16 : 32;
  static constexpr int kLdN = transposed_ld(kBlockN), kLdM = transposed_ld(kBlockM);
  // Volta: as much as dq_kernel's (17 KiB), so that the row chunks hold 16 queries at head dim 128.
  static constexpr int kTileFloats = kPascal ? 2 * kChunkD * (kLdN + kLdM) : DqTiles<TILES, DMAX>::kTileFloats;
  static_assert(2 * kChunkD * (kLdN + kLdM) <= kTileFloats, "score tiles");
  // Pascal from head dim 96 on: the dims of dK and dV split over kDimParts blocks (grid y) of kOutDims each, so
  // that a thread's accumulators stay at 8 or fewer registers a row; each part recomputes S and dP over all dims.
  static constexpr int kDimParts = kPascal && DMAX > 64 ? (DMAX + 63) / 64 : 1;
  static constexpr int kOutDims = DMAX / kDimParts;
  static constexpr int kQueryChunk = row_chunk<kBlockM, kOutDims>(kTileFloats) / 2;  // Q and dO rows side by side
  static constexpr int kMinBlocks = kPascal ? 8 : 2;
};

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

// The rows of q, dO, k and v that a backward block reads, for query head `head` and kv head `kvh`.
template <typename T>
__device__ __forceinline__ void set_block_rows(DilatedRows<T> (&rows)[4], const BackwardParams& p, int b, int head,
                                               int kvh, const Members& mem, int64_t dilation) {
  rows[0] = rows_of<T>(p.q, p.sq, b, head, mem, dilation);
  rows[1] = rows_of<T>(p.dout, p.sdo, b, head, mem, dilation);
  rows[2] = rows_of<T>(p.k, p.sk, b, kvh, mem, dilation);
  rows[3] = rows_of<T>(p.v, p.sv, b, kvh, mem, dilation);
}

template <typename T, int DMAX, int TILES>
__global__ void __launch_bounds__(kThreads, DqTiles<TILES, DMAX>::kMinBlocks) dq_kernel(const BackwardParams p) {
  using Tiles = DqTiles<TILES, DMAX>;
  constexpr int BM = Tiles::kBlockM, BN = Tiles::kBlockN, LDM = Tiles::kLdM, LDN = Tiles::kLdN;
  constexpr int R = BM / kRowsY, C = BN / kColsX, J = DMAX / kColsX;  // rows, key columns, dims per thread
  constexpr int KC = Tiles::kKeyChunk;
  __shared__ __align__(16) float tiles[Tiles::kTileFloats];  // Q^T, dO^T, K^T, V^T chunks; then K row chunks
  __shared__ __align__(16) float ds_t[BN * LDM];              // dS^T: [key][query]
  // lse * log2(e) and delta of the block's queries: in shared memory rather than 2 * R registers a thread, which
  // the score loop needs (with them held there, the kernel spilled into its inner loops at head dim 128)
  __shared__ __align__(16) float row_stats[2 * BM];
  float* q_t = tiles;
  float* do_t = tiles + kChunkD * LDM;
  float* k_t = tiles + 2 * kChunkD * LDM;
  float* v_t = tiles + 2 * kChunkD * LDM + kChunkD * LDN;

  const AttentionShape& sh = p.shape;
  const Branch& br = p.branch;
  const auto [b, head, seg, tile] = query_grid(br, sh, BM).block_tile();
  const Members mem = members_of(br, sh.seq_len, head, seg);
  const int start_m = tile * BM;
  if (start_m >= mem.count) return;
  const int kvh = static_cast<int>(sh.kv_head(head));
  // q, dO, k, v (common.cuh: why in shared memory); read after the score loop's first barrier
  __shared__ DilatedRows<T> block_rows[4];
  if (threadIdx.x == 0) set_block_rows(block_rows, p, b, head, kvh, mem, br.dilation);
  SharedRows<T> q_rows = block_rows[0], do_rows = block_rows[1], k_rows = block_rows[2], v_rows = block_rows[3];
  const int ty = threadIdx.x / kColsX, tx = threadIdx.x % kColsX;
  const int dim = static_cast<int>(sh.head_dim);
  const float scale2 = static_cast<float>(sh.scale) * kLog2e;
  const int64_t row_base = (b * sh.num_heads + head) * sh.seq_len;

  static_assert(BM <= kThreads, "a thread per query row fills row_stats");
  if (threadIdx.x < BM) {  // read by the softmax step, after the score loop's barriers
    const int member = min(start_m + static_cast<int>(threadIdx.x), mem.count - 1);
    const int pos = mem.first + member * static_cast<int>(br.dilation);
    row_stats[threadIdx.x] = p.lse[row_base + pos] * kLog2e;
    row_stats[BM + threadIdx.x] = p.delta[row_base + pos];
  }
  float dq[R][J];
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int j = 0; j < J; ++j) dq[r][j] = 0.f;

  const int key_end = sh.causal ? min(mem.count, start_m + BM) : mem.count;
  for (int start_n = 0; start_n < key_end; start_n += BN) {
    float s[R][C], dp[R][C];
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int c = 0; c < C; ++c) s[r][c] = dp[r][c] = 0.f;
    for (int d0 = 0; d0 < DMAX; d0 += kChunkD) {
      __syncthreads();
      gather_transposed<T, BM, kChunkD, LDM>(q_t, q_rows, start_m, d0, dim);
      gather_transposed<T, BM, kChunkD, LDM>(do_t, do_rows, start_m, d0, dim);
      gather_transposed<T, BN, kChunkD, LDN>(k_t, k_rows, start_n, d0, dim);
      gather_transposed<T, BN, kChunkD, LDN>(v_t, v_rows, start_n, d0, dim);
      __syncthreads();
#pragma unroll 4
      for (int d = 0; d < kChunkD; ++d) {
        float a[R], g[R], kk[C], vv[C];
        load_row_values(a, q_t + d * LDM + ty * R);
        load_row_values(g, do_t + d * LDM + ty * R);
        load_thread_cols(kk, k_t + d * LDN, tx);
        load_thread_cols(vv, v_t + d * LDN, tx);
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
      const int kj = start_n + thread_col<C>(tx, c);
      float col[R];
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const int qi = start_m + ty * R + r;
        const bool visible = qi < mem.count && kj < mem.count && (!sh.causal || kj <= qi);
        const float pr = visible ? exp2f(s[r][c] * scale2 - lse2[r]) : 0.f;
        col[r] = pr * (dp[r][c] - delta[r]);
      }
      store_row_values(ds_t + thread_col<C>(tx, c) * LDM + ty * R, col);
    }
    for (int k0 = 0; k0 < BN; k0 += KC) {
      __syncthreads();
      gather_rows<T, KC, DMAX>(tiles, k_rows, start_n + k0, 0, dim);
      __syncthreads();
#pragma unroll 4
      for (int kk = 0; kk < KC; ++kk) {
        float dsr[R], kv[J];
        load_row_values(dsr, ds_t + (k0 + kk) * LDM + ty * R);
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
    const int qi = start_m + ty * R + r;
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

template <typename T, int DMAX, int TILES>
__global__ void __launch_bounds__(kThreads, DkdvTiles<TILES, DMAX>::kMinBlocks) dkdv_kernel(const BackwardParams p) {
  using Tiles = DkdvTiles<TILES, DMAX>;
  constexpr int BN = Tiles::kBlockN, BM = Tiles::kBlockM, LDN = Tiles::kLdN, LDM = Tiles::kLdM;
  constexpr int OUT_DIMS = Tiles::kOutDims;
  constexpr int R = BN / kRowsY, C = BM / kColsX, J = OUT_DIMS / kColsX;  // key rows, query columns, dims a thread
  constexpr int QC = Tiles::kQueryChunk;
  __shared__ __align__(16) float tiles[Tiles::kTileFloats];  // K^T, V^T, Q^T, dO^T chunks; then Q, dO row chunks
  __shared__ __align__(16) float p_s[BM * LDN];               // P: [query][key]
  __shared__ __align__(16) float ds_s[BM * LDN];              // dS: [query][key]
  float* k_t = tiles;
  float* v_t = tiles + kChunkD * LDN;
  float* q_t = tiles + 2 * kChunkD * LDN;
  float* do_t = tiles + 2 * kChunkD * LDN + kChunkD * LDM;

  const AttentionShape& sh = p.shape;
  const Branch& br = p.branch;
  const auto [b, kvh, seg, tile] = kv_grid(br, sh, BN).block_tile();
  const int group = static_cast<int>(sh.num_heads / sh.num_kv_heads);
  const int h_begin = max(kvh * group, static_cast<int>(br.head_lo));
  const int h_end = min((kvh + 1) * group, static_cast<int>(br.head_hi));
  const int start_n = tile * BN;
  const int d_out = blockIdx.y * OUT_DIMS;  // the block's dims of dK and dV
  const int ty = threadIdx.x / kColsX, tx = threadIdx.x % kColsX;
  const int dim = static_cast<int>(sh.head_dim);
  const float scale2 = static_cast<float>(sh.scale) * kLog2e;
  const float scale = static_cast<float>(sh.scale);
  __shared__ DilatedRows<T> block_rows[4];  // q, dO, k, v of the current head (common.cuh: why in shared memory)
  SharedRows<T> q_rows = block_rows[0], do_rows = block_rows[1], k_rows = block_rows[2], v_rows = block_rows[3];

  // The current head's members and LSE/delta row offset, in shared memory like block_rows
  __shared__ Members head_members;
  __shared__ int64_t head_row_base;
  const volatile Members& mem = head_members;
  const volatile int64_t& row_base = head_row_base;
  for (int head = h_begin; head < h_end; ++head) {
    const Members m = members_of(br, sh.seq_len, head, seg);
    if (start_n >= m.count) continue;  // uniform over the block
    __syncthreads();  // every thread is done with the previous head's values
    if (threadIdx.x == 0) {
      set_block_rows(block_rows, p, b, head, kvh, m, br.dilation);
      head_members.first = m.first;
      head_members.count = m.count;
      head_row_base = (b * sh.num_heads + head) * sh.seq_len;
    }
    __syncthreads();

    float dk[R][J], dv[R][J];
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int j = 0; j < J; ++j) dk[r][j] = dv[r][j] = 0.f;

    // Causal: queries before the block's first key never see it.
    for (int start_m = sh.causal ? start_n / BM * BM : 0; start_m < mem.count; start_m += BM) {
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
#pragma unroll (Tiles::kPascal ? 1 : 4)
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
        const int qi = start_m + thread_col<C>(tx, c);
        const int pos = mem.first + min(qi, mem.count - 1) * static_cast<int>(br.dilation);
        const float lse2 = p.lse[row_base + pos] * kLog2e, delta = p.delta[row_base + pos];
        float pc[R], dsc[R];
#pragma unroll
        for (int r = 0; r < R; ++r) {
          const int kj = start_n + ty * R + r;
          const bool visible = qi < mem.count && kj < mem.count && (!sh.causal || kj <= qi);
          pc[r] = visible ? exp2f(s[r][c] * scale2 - lse2) : 0.f;
          dsc[r] = pc[r] * (dp[r][c] - delta);
        }
        store_row_values(p_s + thread_col<C>(tx, c) * LDN + ty * R, pc);
        store_row_values(ds_s + thread_col<C>(tx, c) * LDN + ty * R, dsc);
      }
      for (int q0 = 0; q0 < BM; q0 += QC) {
        __syncthreads();
        gather_rows<T, QC, OUT_DIMS>(tiles, q_rows, start_m + q0, d_out, dim);
        gather_rows<T, QC, OUT_DIMS>(tiles + QC * OUT_DIMS, do_rows, start_m + q0, d_out, dim);
        __syncthreads();
#pragma unroll (Tiles::kPascal ? 1 : 2)
        for (int qq = 0; qq < QC; ++qq) {
          float pr[R], dsr[R], qv[J], gv[J];
          load_row_values(pr, p_s + (q0 + qq) * LDN + ty * R);
          load_row_values(dsr, ds_s + (q0 + qq) * LDN + ty * R);
          load_thread_cols(qv, tiles + qq * OUT_DIMS, tx);
          load_thread_cols(gv, tiles + (QC + qq) * OUT_DIMS, tx);
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
      const int kj = start_n + ty * R + r;
      if (kj < mem.count) {
        const int64_t off = ((b * sh.seq_len + mem.first + kj * br.dilation) * sh.num_kv_heads + kvh) * sh.head_dim;
#pragma unroll
        for (int j = 0; j < J; ++j) {
          const int d = d_out + thread_col<J>(tx, j);
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

cudaError_t launch_backward(const BackwardParams& p, ScalarKind kind, int tiles, cudaStream_t stream) {
  const AttentionShape& sh = p.shape;
  const Branch& br = p.branch;
  return dispatch_tiles(tiles, [&](auto table) {
    constexpr int TILES = decltype(table)::value;
    return dispatch_head_dim(sh.head_dim, [&](auto dmax) {
      constexpr int DMAX = decltype(dmax)::value;
      const int64_t kv_blocks = kv_grid(br, sh, DkdvTiles<TILES, DMAX>::kBlockN).blocks();
      const int64_t q_blocks = query_grid(br, sh, DqTiles<TILES, DMAX>::kBlockM).blocks();
      if (kv_blocks > kMaxGridBlocks || q_blocks > kMaxGridBlocks) return cudaErrorInvalidConfiguration;
      if (kv_blocks == 0 || q_blocks == 0) return cudaSuccess;
      return dispatch_scalar(kind, [&](auto tag) {
        using T = decltype(tag);
        const dim3 kv_grid_dims(static_cast<unsigned>(kv_blocks), DkdvTiles<TILES, DMAX>::kDimParts);
        dkdv_kernel<T, DMAX, TILES><<<kv_grid_dims, kThreads, 0, stream>>>(p);
        const cudaError_t err = cudaGetLastError();
        if (err != cudaSuccess) return err;
        dq_kernel<T, DMAX, TILES><<<static_cast<unsigned>(q_blocks), kThreads, 0, stream>>>(p);
        return cudaGetLastError();
      });
    });
  });
}

}  // namespace cuda
}  // namespace dilated_attn
