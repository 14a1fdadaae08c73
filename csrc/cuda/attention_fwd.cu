// CUDA forward: one branch of dilated attention, merged into the running (out, lse) in place.
//
// A block owns kBlockM (64) query members of one (batch, head, segment) and walks the segment's key
// members kBlockN (64) at a time (flash-attention's online softmax, base 2). Scores S = Q K^T are reduced
// over the head dim in chunks of 32: each chunk of the dilated Q and K rows is gathered straight from
// global memory (positions first + r * j) into transposed fp32 shared tiles, and every thread accumulates
// an 8 x 4 block of S with FMAs (its 4 keys and its output columns contiguous: vector loads, common.cuh's
// thread_col). The probabilities go through shared memory (transposed) and O += P V
// streams the key rows of V in chunks. All math is fp32; inputs may be fp16, bf16 or fp32. No tensor
// cores, so the same code runs from Pascal up.
#include "common.cuh"

namespace dilated_attn {
namespace cuda {
namespace {

constexpr int kBlockM = 64;                    // queries per block
constexpr int kBlockN = 64;                    // keys per step
constexpr int kChunkD = 32;                    // head-dim chunk of the score reduction
constexpr int kRows = kBlockM / kRowsY;        // 8 query rows per thread
constexpr int kCols = kBlockN / kColsX;        // 4 key columns per thread
constexpr int kLdM = transposed_ld(kBlockM);   // Q^T and P^T (indexed by query)
constexpr int kLdN = transposed_ld(kBlockN);   // K^T (indexed by key)
constexpr int kScoreTiles = kChunkD * (kLdM + kLdN);  // Q and K chunks (floats)

// Key rows of V per chunk of the O += P V product: as many as fit in the score tiles' space.
template <int DMAX>
__host__ __device__ constexpr int value_chunk() {
  int rows = kBlockN;
  while (rows * DMAX > kScoreTiles) rows /= 2;
  return rows;
}

// Shared memory of a block (floats): with RESIDENT_Q the block's whole Q^T tile stays in shared memory and
// only K is gathered per step (where the device allows that much shared memory per block; not Pascal's
// 48 KiB from head dim 64 on), else Q^T is gathered again chunk by chunk beside K^T.
template <int DMAX, bool RESIDENT_Q>
__host__ __device__ constexpr int forward_smem_floats() {
  return (RESIDENT_Q ? DMAX * kLdM : 0) + kScoreTiles + kBlockN * kLdM;
}

// Blocks per SM the register budget is sized for (__launch_bounds__): 3 (168 registers a thread) up to
// head dim 128, 2 (255) for 256. tools/check_cuda_kernels.sh prints every kernel's registers and spills.
template <int DMAX>
__host__ __device__ constexpr int min_blocks() {
  return DMAX > 128 ? 2 : 3;
}

template <typename T, int DMAX, bool RESIDENT_Q>
__global__ void __launch_bounds__(kThreads, min_blocks<DMAX>()) forward_kernel(const ForwardParams p) {
  constexpr int J = DMAX / kColsX;  // output columns per thread
  constexpr int KC = value_chunk<DMAX>();
  extern __shared__ __align__(16) float smem[];
  float* q_resident = smem;                                   // RESIDENT_Q: Q^T, [DMAX][kLdM]
  float* tiles = smem + (RESIDENT_Q ? DMAX * kLdM : 0);       // Q^T and K^T chunks, then V chunks
  float* probs = tiles + kScoreTiles;                         // P^T: [key][query]
  float* k_t = tiles + kChunkD * kLdM;

  const AttentionShape& sh = p.shape;
  const Branch& br = p.branch;
  const auto [b, head, seg, tile] = query_grid(br, sh, kBlockM).block_tile();
  const Members mem = members_of(br, sh.seq_len, head, seg);
  const int64_t start_m = tile * kBlockM;
  if (start_m >= mem.count) return;
  const int64_t kvh = sh.kv_head(head);

  const DilatedRows<T> q_rows{static_cast<const T*>(p.q) + b * p.sq.batch + head * p.sq.head, p.sq.seq, mem.first,
                              br.dilation, mem.count};
  const DilatedRows<T> k_rows{static_cast<const T*>(p.k) + b * p.sk.batch + kvh * p.sk.head, p.sk.seq, mem.first,
                              br.dilation, mem.count};
  const DilatedRows<T> v_rows{static_cast<const T*>(p.v) + b * p.sv.batch + kvh * p.sv.head, p.sv.seq, mem.first,
                              br.dilation, mem.count};
  const int ty = threadIdx.x / kColsX, tx = threadIdx.x % kColsX;
  const int dim = static_cast<int>(sh.head_dim);
  const float scale2 = static_cast<float>(sh.scale) * kLog2e;

  float m_i[kRows], l_i[kRows], o[kRows][J];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    m_i[r] = kNoMax;
    l_i[r] = 0.f;
#pragma unroll
    for (int j = 0; j < J; ++j) o[r][j] = 0.f;
  }

  if constexpr (RESIDENT_Q) {
    for (int d0 = 0; d0 < DMAX; d0 += kChunkD)
      gather_transposed<T, kBlockM, kChunkD, kLdM>(q_resident + d0 * kLdM, q_rows, start_m, d0, dim);
  }

  // Causal: keys after the block's last query are never seen.
  const int64_t key_end = sh.causal ? min(mem.count, start_m + kBlockM) : mem.count;
  for (int64_t start_n = 0; start_n < key_end; start_n += kBlockN) {
    float s[kRows][kCols];
#pragma unroll
    for (int r = 0; r < kRows; ++r)
#pragma unroll
      for (int c = 0; c < kCols; ++c) s[r][c] = 0.f;

    for (int d0 = 0; d0 < DMAX; d0 += kChunkD) {
      __syncthreads();  // the previous chunk (or P V step) is done with the tiles
      const float* q_t = RESIDENT_Q ? q_resident + d0 * kLdM : tiles;
      if constexpr (!RESIDENT_Q) gather_transposed<T, kBlockM, kChunkD, kLdM>(tiles, q_rows, start_m, d0, dim);
      gather_transposed<T, kBlockN, kChunkD, kLdN>(k_t, k_rows, start_n, d0, dim);
      __syncthreads();
#pragma unroll 8
      for (int d = 0; d < kChunkD; ++d) {
        float a[kRows], kv[kCols];
        load_row_values(a, q_t + d * kLdM + ty * kRows);
        load_thread_cols(kv, k_t + d * kLdN, tx);
#pragma unroll
        for (int r = 0; r < kRows; ++r)
#pragma unroll
          for (int c = 0; c < kCols; ++c) s[r][c] = fmaf(a[r], kv[c], s[r][c]);
      }
    }

    // Online softmax over this step's keys; masked keys get probability 0.
    const bool needs_mask = start_n + kBlockN > mem.count || (sh.causal && start_n + kBlockN - 1 > start_m);
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const int64_t qi = start_m + ty * kRows + r;
      float row_max = kNoMax;
#pragma unroll
      for (int c = 0; c < kCols; ++c) {
        const int64_t kj = start_n + thread_col<kCols>(tx, c);
        const bool visible = !needs_mask || (kj < mem.count && (!sh.causal || kj <= qi));
        s[r][c] = visible ? s[r][c] * scale2 : -INFINITY;
        row_max = fmaxf(row_max, s[r][c]);
      }
      const float m_new = fmaxf(m_i[r], half_warp_max(row_max));
      const float alpha = exp2f(m_i[r] - m_new);
      float row_sum = 0.f;
#pragma unroll
      for (int c = 0; c < kCols; ++c) {
        s[r][c] = exp2f(s[r][c] - m_new);
        row_sum += s[r][c];
      }
      l_i[r] = l_i[r] * alpha + half_warp_sum(row_sum);
      m_i[r] = m_new;
#pragma unroll
      for (int j = 0; j < J; ++j) o[r][j] *= alpha;
    }
#pragma unroll
    for (int c = 0; c < kCols; ++c) {
      float col[kRows];
#pragma unroll
      for (int r = 0; r < kRows; ++r) col[r] = s[r][c];
      store_row_values(probs + thread_col<kCols>(tx, c) * kLdM + ty * kRows, col);
    }

    // O += P V, streaming KC key rows of V at a time through the tiles' space.
    for (int k0 = 0; k0 < kBlockN; k0 += KC) {
      __syncthreads();  // probs written; tiles free
      gather_rows<T, KC, DMAX>(tiles, v_rows, start_n + k0, dim);
      __syncthreads();
#pragma unroll 4
      for (int kk = 0; kk < KC; ++kk) {
        float pr[kRows], vv[J];
        load_row_values(pr, probs + (k0 + kk) * kLdM + ty * kRows);
        load_thread_cols(vv, tiles + kk * DMAX, tx);
#pragma unroll
        for (int r = 0; r < kRows; ++r)
#pragma unroll
          for (int j = 0; j < J; ++j) o[r][j] = fmaf(pr[r], vv[j], o[r][j]);
      }
    }
  }

  // Merge (o / l, lse_b) into the running (out, lse). Every member query sees at least itself, so l > 0
  // on stored rows. All 16 lanes of a row read the old lse before lane 0 overwrites it.
  T* out_base = static_cast<T*>(p.out) + b * p.so.batch + head * p.so.head;
  float* lse_base = p.lse + (b * sh.num_heads + head) * sh.seq_len;
  float old_lse[kRows], new_lse[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int64_t qi = start_m + ty * kRows + r;
    const bool stored = qi < mem.count;
    const int64_t pos = mem.first + qi * br.dilation;
    const float inv_l = stored ? 1.f / l_i[r] : 0.f;
    const float lse_b = stored ? (m_i[r] + __log2f(l_i[r])) * kLn2 : -INFINITY;
    old_lse[r] = stored ? lse_base[pos] : -INFINITY;
    // Two-term LSE merge, w_i = exp(L_i - max) / sum_j exp(L_j - max) (src/dilated_attn/merge.py).
    const float top = fmaxf(old_lse[r], lse_b);
    const float e_old = __expf(old_lse[r] - top), e_new = __expf(lse_b - top), total = e_old + e_new;
    new_lse[r] = top + __logf(total);
    const float w_old = e_old / total, w_new = e_new / total * inv_l;
    if (stored) {
      T* row = out_base + pos * p.so.seq;
#pragma unroll
      for (int j = 0; j < J; ++j) {
        const int d = thread_col<J>(tx, j);
        if (d < dim) {
          // Running lse -inf (no earlier branch covered the row): w_old = 0, so prev = 0 without reading it.
          const float prev = old_lse[r] == -INFINITY ? 0.f : to_float(row[d]) * w_old;
          row[d] = from_float<T>(prev + o[r][j] * w_new);
        }
      }
    }
  }
  __syncwarp();
  if (tx == 0) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const int64_t qi = start_m + ty * kRows + r;
      if (qi < mem.count) lse_base[mem.first + qi * br.dilation] = new_lse[r];
    }
  }
}

}  // namespace

cudaError_t launch_forward(const ForwardParams& p, ScalarKind kind, cudaStream_t stream) {
  const int64_t blocks = query_grid(p.branch, p.shape, kBlockM).blocks();
  if (blocks == 0) return cudaSuccess;
  if (blocks > kMaxGridBlocks) return cudaErrorInvalidConfiguration;
  return dispatch_scalar(kind, [&](auto tag) {
    using T = decltype(tag);
    return dispatch_head_dim(p.shape.head_dim, [&](auto dmax) {
      constexpr int DMAX = decltype(dmax)::value;
      constexpr size_t kResident = forward_smem_floats<DMAX, true>() * sizeof(float);
      if (kResident <= max_shared_memory_per_block()) {
        // Above 48 KiB a kernel must opt in; harmless to repeat, so no caching per device needed.
        cudaError_t err = cudaFuncSetAttribute(forward_kernel<T, DMAX, true>,
                                               cudaFuncAttributeMaxDynamicSharedMemorySize, kResident);
        if (err != cudaSuccess) return err;
        // Three blocks of ~70 KiB per SM need the largest shared-memory carveout of L1.
        err = cudaFuncSetAttribute(forward_kernel<T, DMAX, true>, cudaFuncAttributePreferredSharedMemoryCarveout,
                                   cudaSharedmemCarveoutMaxShared);
        if (err != cudaSuccess) return err;
        forward_kernel<T, DMAX, true><<<static_cast<unsigned>(blocks), kThreads, kResident, stream>>>(p);
      } else {
        constexpr size_t kStreamed = forward_smem_floats<DMAX, false>() * sizeof(float);
        forward_kernel<T, DMAX, false><<<static_cast<unsigned>(blocks), kThreads, kStreamed, stream>>>(p);
      }
      return cudaGetLastError();
    });
  });
}

}  // namespace cuda
}  // namespace dilated_attn
