// CUDA forward: one branch of dilated attention, merged into the running (out, lse) in place.
//
// A block owns kBlockM query members of one (batch, head, segment) and walks the segment's key members kBlockN
// (64, or 128 at head dims 65-128 from Volta on) at a time (flash-attention's online softmax, base 2). Scores
// S = Q K^T are reduced over the head dim in chunks: each chunk of the dilated Q and K rows is gathered straight
// from global memory (positions first + r * j) into transposed fp32 shared tiles, and every thread accumulates an
// R x kBlockN / 16 block of S with FMAs (its keys and its output columns contiguous: vector loads, common.cuh's
// thread_col). The probabilities go through shared memory (transposed) and O += P V streams the key rows of V in
// chunks. Each chunk's global loads are issued into registers before the computation on the chunk before it and
// stored after it (common.cuh: split gathers), so that memory latency overlaps the FMAs. All math is fp32; inputs
// may be fp16, bf16 or fp32. No tensor cores, so the same code runs from Pascal up. ForwardTiles holds the sizes
// of each tile table: 64 queries a block (128 over 256 threads from Volta on at head dim 64), 32-dim chunks from
// Volta on and 16 on Pascal.
#include "common.cuh"

namespace dilated_attn {
namespace cuda {
namespace {

// The forward's tiles per tile table (launch.h) and head dim.
template <TileTable TILES, int DMAX>
struct ForwardTiles {
  static constexpr bool kPascal = is_pascal(TILES);
  // Threads and queries per block: a thread holds kRows x J outputs and kRows x kCols scores. From Volta on at head
  // dim 64: 256 threads (a 16 x 16 thread grid) over 128 queries, so that each K and V tile gathered serves twice
  // the queries, a thread's register stage of a gather is half as large (no spills), and the V rows of a step fit
  // one chunk. Pascal's tiles keep 128 threads: the wider block needs 45 KiB, one block on a P100's SM.
  static constexpr bool kWide = !kPascal && DMAX == 64;
  static constexpr int kThreads = kWide ? 2 * cuda::kThreads : cuda::kThreads;
  static constexpr int kBlockM = kWide ? 128 : 64;
  // Keys per step: 128 from Volta on at head dims 65-128, where a thread's 8 x 8 score tile takes 4 shared loads per
  // 64 FMAs (8 x 4: 3 per 32) at two blocks an SM; at 64 the four blocks an SM of 64 keys ran faster. Pascal: 64,
  // since P^T of 128 keys alone would take 34 KiB.
  static constexpr int kBlockN = !kPascal && DMAX > 64 && DMAX <= 128 ? 128 : 64;
  // Head-dim chunk of the score reduction: 16 on Pascal, which keeps the block within 26 KiB.
  static constexpr int kChunkD = kPascal ? 16 : 32;
  static constexpr int kRows = kBlockM / (kThreads / kColsX);  // query rows per thread
  static constexpr int kCols = kBlockN / kColsX;                 // key columns per thread
  static constexpr int kLdM = transposed_ld(kBlockM);  // Q^T and P^T (indexed by query)
  static constexpr int kLdN = transposed_ld(kBlockN);  // K^T (indexed by key)
  static constexpr int kScoreTiles = kChunkD * (kLdM + kLdN);  // Q and K chunks (floats)
  // Blocks per SM the register budget is sized for (__launch_bounds__): 128 registers a thread up to head dim 64 from
  // Volta on (4 blocks of 128 threads at 32, 2 of 256 at 64), else 255 (2 blocks of 128 threads).
  static constexpr int kMinBlocks = !kPascal && DMAX <= 32 ? 4 : 2;

  // The block's gathers: K^T chunks, then V row chunks of kValueRows keys, each no more elements a thread than a K^T
  // chunk takes with 128 threads, so that one register stage a thread (stage_regs) holds either (common.cuh: split
  // gathers); on Pascal as many rows as the tiles' space holds. The next gather's loads are issued before the
  // computation on the current one.
  static constexpr int value_rows() {
    int rows = kBlockN;
    while (rows * DMAX > (kPascal ? kScoreTiles : kBlockN * kChunkD * kThreads / cuda::kThreads)) rows /= 2;
    return rows;
  }
  static constexpr int kValueRows = value_rows();
  static_assert(kValueRows * DMAX <= kScoreTiles, "a V chunk fits the tiles' space");
  template <typename T>
  using KeyTile = TransposedTile<T, kBlockN, kChunkD, kLdN, kThreads>;
  template <typename T>
  using ValueTile = RowTile<T, kValueRows, DMAX, kThreads>;
  template <typename T>
  static constexpr int stage_regs() {
    return KeyTile<T>::kRegs > ValueTile<T>::kRegs ? KeyTile<T>::kRegs : ValueTile<T>::kRegs;
  }

  // Shared memory of a block (floats): with RESIDENT_Q the block's whole Q^T tile stays in shared memory and
  // only K is gathered per step (where the device allows that much shared memory per block; Volta's tiles from
  // head dim 64 on need more than 48 KiB), else Q^T is gathered again chunk by chunk beside K^T.
  template <bool RESIDENT_Q>
  static constexpr int smem_floats() {
    return (RESIDENT_Q ? DMAX * kLdM : 0) + kScoreTiles + kBlockN * kLdM;
  }
};

template <typename T, int DMAX, TileTable TILES, bool RESIDENT_Q>
__device__ __forceinline__ void forward_block(const ForwardParams& p) {
  using Tiles = ForwardTiles<TILES, DMAX>;
  constexpr int kBlockM = Tiles::kBlockM, kBlockN = Tiles::kBlockN, kChunkD = Tiles::kChunkD;
  constexpr int kRows = Tiles::kRows, kCols = Tiles::kCols, kLdM = Tiles::kLdM, kLdN = Tiles::kLdN;
  constexpr int J = DMAX / kColsX;  // output columns per thread
  constexpr int KC = Tiles::kValueRows;
  extern __shared__ __align__(16) float smem[];
  float* q_resident = smem;                                   // RESIDENT_Q: Q^T, [DMAX][kLdM]
  float* tiles = smem + (RESIDENT_Q ? DMAX * kLdM : 0);       // Q^T and K^T chunks, then V chunks
  float* probs = tiles + Tiles::kScoreTiles;                  // P^T: [key][query]
  float* k_t = tiles + kChunkD * kLdM;

  const AttentionShape& sh = p.shape;
  const Branch& br = p.branch;
  const auto [b, head, seg, tile] = query_grid(br, sh, kBlockM).block_tile();
  const Members mem = members_of(br, sh.seq_len, head, seg);
  const int start_m = tile * kBlockM;
  if (start_m >= mem.count) return;
  const int kvh = static_cast<int>(sh.kv_head(head));

  __shared__ DilatedRows<T> block_rows[3];  // q, k, v (common.cuh: why in shared memory)
  if (threadIdx.x == 0) {
    block_rows[0] = rows_of<T>(p.q, p.sq, b, head, mem, br.dilation);
    block_rows[1] = rows_of<T>(p.k, p.sk, b, kvh, mem, br.dilation);
    block_rows[2] = rows_of<T>(p.v, p.sv, b, kvh, mem, br.dilation);
  }
  __syncthreads();
  SharedRows<T> q_rows = block_rows[0], k_rows = block_rows[1], v_rows = block_rows[2];
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
      gather_transposed<T, kBlockM, kChunkD, kLdM, Tiles::kThreads>(q_resident + d0 * kLdM, q_rows, start_m, d0,
                                                                     dim);
  }

  // Causal: keys after the block's last query are never seen.
  const int key_end = sh.causal ? min(mem.count, start_m + kBlockM) : mem.count;
  // A key step gathers the K^T chunks d0 = 0, kChunkD, ..., then the V row chunks k0 = 0, KC, ...; each one's loads
  // are issued into `stage` right after the barrier that publishes the one before.
  using KeyTile = typename Tiles::template KeyTile<T>;
  using ValueTile = typename Tiles::template ValueTile<T>;
  T stage[Tiles::template stage_regs<T>()];
  KeyTile::load(stage, k_rows, 0, 0, dim);
  for (int start_n = 0; start_n < key_end; start_n += kBlockN) {
    float s[kRows][kCols];
#pragma unroll
    for (int r = 0; r < kRows; ++r)
#pragma unroll
      for (int c = 0; c < kCols; ++c) s[r][c] = 0.f;

    for (int d0 = 0; d0 < DMAX; d0 += kChunkD) {
      __syncthreads();  // the previous chunk (or P V step) is done with the tiles
      const float* q_t = RESIDENT_Q ? q_resident + d0 * kLdM : tiles;
      if constexpr (!RESIDENT_Q)
        gather_transposed<T, kBlockM, kChunkD, kLdM, Tiles::kThreads>(tiles, q_rows, start_m, d0, dim);
      KeyTile::store(k_t, stage);
      __syncthreads();
      // the next gather's loads
      if (d0 + kChunkD < DMAX)
        KeyTile::load(stage, k_rows, start_n, d0 + kChunkD, dim);
      else
        ValueTile::load(stage, v_rows, start_n, 0, dim);
      // Not pipelined (accumulate_products): the second operand set spills at head dim 128, and the forward ran
      // slower with it at 64 and 128 (benchmarks/README.md, the CUDA kernels).
      accumulate_products<kChunkD, kLdM, kLdN, 8, false>(s, q_t + ty * kRows, k_t, tx);
    }

    // Online softmax over this step's keys; masked keys get probability 0. Each phase covers all kRows rows (scale,
    // mask, the half-warp max reductions, the exponentials), so that the rows' shuffle and exp2 latencies overlap
    // rather than chain row after row; the mask is a block-uniform branch around its own phase.
#pragma unroll
    for (int r = 0; r < kRows; ++r)
#pragma unroll
      for (int c = 0; c < kCols; ++c) s[r][c] *= scale2;
    if (start_n + kBlockN > mem.count || (sh.causal && start_n + kBlockN - 1 > start_m)) {
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        const int qi = start_m + ty * kRows + r;
        const int key_limit = sh.causal ? min(mem.count, qi + 1) : mem.count;
#pragma unroll
        for (int c = 0; c < kCols; ++c)
          if (start_n + thread_col<kCols>(tx, c) >= key_limit) s[r][c] = -INFINITY;
      }
    }
    float m_new[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      m_new[r] = s[r][0];
#pragma unroll
      for (int c = 1; c < kCols; ++c) m_new[r] = fmaxf(m_new[r], s[r][c]);
    }
#pragma unroll
    for (int m = 1; m < kColsX; m <<= 1)
#pragma unroll
      for (int r = 0; r < kRows; ++r) m_new[r] = fmaxf(m_new[r], __shfl_xor_sync(0xffffffffu, m_new[r], m));
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      m_new[r] = fmaxf(m_i[r], m_new[r]);
      const float alpha = exp2f(m_i[r] - m_new[r]);
      float row_sum = 0.f;
#pragma unroll
      for (int c = 0; c < kCols; ++c) {
        s[r][c] = exp2f(s[r][c] - m_new[r]);
        row_sum += s[r][c];
      }
      l_i[r] = l_i[r] * alpha + row_sum;  // this thread's share of the row sum (reduced after the last step)
      m_i[r] = m_new[r];
#pragma unroll
      for (int j = 0; j < J; ++j) o[r][j] *= alpha;
    }
    store_tile_columns<kLdM>(probs, s, ty, tx);

    // O += P V, streaming KC key rows of V at a time through the tiles' space.
    for (int k0 = 0; k0 < kBlockN; k0 += KC) {
      __syncthreads();  // probs written; tiles free
      ValueTile::store(tiles, stage);
      __syncthreads();
      // the next gather's loads
      if (k0 + KC < kBlockN)
        ValueTile::load(stage, v_rows, start_n + k0 + KC, 0, dim);
      else if (start_n + kBlockN < key_end)
        KeyTile::load(stage, k_rows, start_n + kBlockN, 0, dim);
      // 8 steps unrolled up to head dim 64 (4 above, where a thread's 8 x 8 outputs leave no registers for more)
      accumulate_products<KC, kLdM, DMAX, DMAX <= 64 ? 8 : 4, false>(o, probs + k0 * kLdM + ty * kRows, tiles, tx);
    }
  }

  // Merge (o / l, lse_b) into the running (out, lse). Every member query sees at least itself, so l > 0
  // on stored rows. All 16 lanes of a row read the old lse before lane 0 overwrites it.
  T* out_base = static_cast<T*>(p.out) + b * p.so.batch + head * p.so.head;
  float* lse_base = p.lse + (b * sh.num_heads + head) * sh.seq_len;
  float old_lse[kRows], new_lse[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) l_i[r] = half_warp_sum(l_i[r]);
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int qi = start_m + ty * kRows + r;
    const bool stored = qi < mem.count;
    const int pos = mem.first + qi * static_cast<int>(br.dilation);
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
      const int qi = start_m + ty * kRows + r;
      if (qi < mem.count) lse_base[mem.first + qi * br.dilation] = new_lse[r];
    }
  }
}

// The kernel: forward_block where this architecture's code holds TILES (common.cuh: tiles_built); the launchers
// never start the other.
template <typename T, int DMAX, TileTable TILES, bool RESIDENT_Q>
__global__ void __launch_bounds__(ForwardTiles<TILES, DMAX>::kThreads, ForwardTiles<TILES, DMAX>::kMinBlocks)
    forward_kernel(const ForwardParams p) {
  if constexpr (tiles_built<TILES>())
    forward_block<T, DMAX, TILES, RESIDENT_Q>(p);
  else
    __trap();
}

}  // namespace

#ifndef __CUDACC_RTC__  // host code (common.cuh)
cudaError_t launch_forward(const ForwardParams& p, ScalarKind kind, TileTable tiles, cudaStream_t stream) {
  return dispatch_tiles(tiles, [&](auto table) {
    constexpr TileTable TILES = shared_tiles(decltype(table)::value);
    return dispatch_head_dim(p.shape.head_dim, [&](auto dmax) {
      constexpr int DMAX = decltype(dmax)::value;
      using Tiles = ForwardTiles<TILES, DMAX>;
      const int64_t blocks = query_grid(p.branch, p.shape, Tiles::kBlockM).blocks();
      if (blocks == 0) return cudaSuccess;
      if (blocks > kMaxGridBlocks) return cudaErrorInvalidConfiguration;
      return dispatch_scalar(kind, [&](auto tag) {
        using T = decltype(tag);
        // Q stays resident where a block fits the device and either kMinBlocks blocks an SM still fit, or streaming
        // Q would not fit them either (an A100 at head dim 64 streams it at two blocks an SM rather than keep it at
        // one). Pascal's tiles never keep Q resident: they keep two blocks within a P100's 64 KiB an SM.
        const dim3 grid(static_cast<unsigned>(blocks));
        constexpr size_t kStreamed = Tiles::template smem_floats<false>() * sizeof(float);
        if constexpr (!Tiles::kPascal) {
          constexpr size_t kResident = Tiles::template smem_floats<true>() * sizeof(float);
          if (kResident <= max_shared_memory_per_block() &&
              (blocks_fit_shared_memory(kResident, Tiles::kMinBlocks) ||
               !blocks_fit_shared_memory(kStreamed, Tiles::kMinBlocks)))
            return launch_with_shared(forward_kernel<T, DMAX, TILES, true>, grid, Tiles::kThreads, kResident, stream,
                                      p);
        }
        return launch_with_shared(forward_kernel<T, DMAX, TILES, false>, grid, Tiles::kThreads, kStreamed, stream, p);
      });
    });
  });
}

#endif  // __CUDACC_RTC__

}  // namespace cuda
}  // namespace dilated_attn
