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
//   chunks gathered into transposed shared tiles, P and dS through shared memory, dQ += dS K with K's rows
//   streamed.
// - dkdv_kernel: a block owns DkdvTiles::kBlockN key members of one (batch, kv head, segment) and, for each
//   query head of its group that takes part, walks the query members kBlockM at a time: S^T = K Q^T,
//   dP^T = V dO^T, then dV += P^T dO and dK += dS^T Q.
// Both run two roles of 128 threads side by side (kBackwardThreads), each the 8 x 16 thread grid of common.cuh
// over one of the two score products and one of the two accumulations: role 0 reduces S, role 1 dP; both tiles go
// to shared memory and all the threads compute P and dS elementwise; in dK/dV role 0 accumulates dV and role 1 dK,
// in dQ each role half of dQ's dims (up to head dim 64: all dims over half of each chunk's keys,
// DqTiles::kSplitKeys). A thread so holds one score tile and one accumulator tile, half the registers of holding
// both, and an SM runs twice the warps to hide the gathers' memory latency.
// Each gather's global loads are issued into registers before the computation on the previous gather's tile and
// stored after it (common.cuh: split gathers), and each product step's shared operands are loaded a step ahead
// (accumulate_products). With Volta's tiles, up to head dim 128 where two blocks an SM fit, the block's own pair
// also stays resident in shared memory for all its steps (dQ: Q^T and dO^T; dK/dV: K^T and V^T of the current
// head), so that the steps gather only the other pair; up to head dim 64 a step gathers that pair in one chunk of all
// dims, and the accumulations read it there, transposed, instead of gathering its rows again (kWholeStep). Pascal's
// 32 KiB a block leave room for neither.
// The tile structs hold the sizes per tile table (launch.h), within 128 registers a thread (two blocks an SM): 64 x
// 64 for dq (32 queries at head dim 256) and 64 keys x 32 queries for dK/dV (64 queries up to head dim 64 from Volta
// on), with 16-dim chunks on Pascal (32 from Volta on up to head dim 64). dK/dV's output dims split over two blocks
// at head dim 256.
// Every block adds its fp32 sums into fp32 accumulators with a plain read-add-write: within one launch no
// two blocks write the same position (the blocks of a segment own disjoint members, heads of one block
// are visited by the same threads in turn), so there are no atomics and results are deterministic.
#include "common.cuh"

namespace dilated_attn {
namespace cuda {
namespace {

constexpr int kChunkD = 16;  // head-dim chunk of the score reductions (four tiles in flight) unless a kChunk says
constexpr int kBackwardThreads = 2 * kThreads;  // two roles of the 8 x 16 thread grid

// This thread's role (0 or 1, warp-uniform) and its place (ty, tx) in the role's 8 x 16 grid.
struct Role {
  int role, ty, tx;
};

__device__ __forceinline__ Role backward_role() {
  const int t = threadIdx.x % kThreads;
  return Role{static_cast<int>(threadIdx.x / kThreads), t / kColsX, t % kColsX};
}

// The head-dim chunks (d0 .. d0 + CHUNK) of the two score products that a step gathers, Q^T and dO^T (BM rows, LDM;
// with QUERIES) and K^T and V^T (BN rows, LDN; with KEYS), as one split gather (common.cuh) of kRegs registers a
// thread. A kernel whose block keeps one pair resident in shared memory for all its steps streams only the other.
template <typename T, int BM, int LDM, int BN, int LDN, int CHUNK, bool QUERIES = true, bool KEYS = true>
struct ScoreChunks {
  using QueryTile = TransposedTile<T, BM, CHUNK, LDM, kBackwardThreads>;
  using KeyTile = TransposedTile<T, BN, CHUNK, LDN, kBackwardThreads>;
  static constexpr int kQueryRegs = QUERIES ? 2 * QueryTile::kRegs : 0;
  static constexpr int kRegs = kQueryRegs + (KEYS ? 2 * KeyTile::kRegs : 0);

  // rows: q, dO, k, v (set_block_rows)
  __device__ __forceinline__ static void load(T* x, const volatile DilatedRows<T> (&rows)[4], int start_m,
                                              int start_n, int d0, int dim) {
    if constexpr (QUERIES) {
      QueryTile::load(x, rows[0], start_m, d0, dim);
      QueryTile::load(x + QueryTile::kRegs, rows[1], start_m, d0, dim);
    }
    if constexpr (KEYS) {
      KeyTile::load(x + kQueryRegs, rows[2], start_n, d0, dim);
      KeyTile::load(x + kQueryRegs + KeyTile::kRegs, rows[3], start_n, d0, dim);
    }
  }

  __device__ __forceinline__ static void store(float* q_t, float* do_t, float* k_t, float* v_t, const T* x) {
    if constexpr (QUERIES) {
      QueryTile::store(q_t, x);
      QueryTile::store(do_t, x + QueryTile::kRegs);
    }
    if constexpr (KEYS) {
      KeyTile::store(k_t, x + kQueryRegs);
      KeyTile::store(v_t, x + kQueryRegs + KeyTile::kRegs);
    }
  }
};

// Every head-dim chunk of two transposed tiles of ROWS rows (LD), rows[i] and rows[i + 1] from member `start`, into
// [DMAX][LD] each at dst and dst + DMAX * LD: a block's resident pair, gathered once per head.
template <typename T, int ROWS, int LD, int DMAX>
__device__ __forceinline__ void gather_resident_pair(float* dst, SharedRows<T> first, SharedRows<T> second,
                                                     int start, int dim) {
  for (int d0 = 0; d0 < DMAX; d0 += kChunkD) {
    gather_transposed<T, ROWS, kChunkD, LD, kBackwardThreads>(dst + d0 * LD, first, start, d0, dim);
    gather_transposed<T, ROWS, kChunkD, LD, kBackwardThreads>(dst + (DMAX + d0) * LD, second, start, d0, dim);
  }
}

// Rows of a [rows][DMAX] tile, at most ROWS_MAX (halving), that fit `floats`.
template <int ROWS_MAX, int DMAX>
__host__ __device__ constexpr int row_chunk(int floats) {
  int rows = ROWS_MAX;
  while (rows * DMAX > floats) rows /= 2;
  return rows;
}

// dq_kernel's tiles per tile table (launch.h) and head dim: kBlockM queries per block against kBlockN keys per
// step. Q^T and dO^T (kLdM), K^T and V^T (kLdN) chunks, then K row chunks, share kTileFloats; P^T, then dS^T in
// place, is [key][query]. All in dynamic shared memory (smem_floats), after Q^T and dO^T whole where they are
// resident.
template <TileTable TILES, int DMAX>
struct DqTiles {
  static constexpr bool kPascal = is_pascal(TILES);
  // A thread's dQ (R x J) and score (R x C) tiles fit 128 registers (32 queries at head dim 256). The P100's table: 32
  // queries, so that two blocks fit its 64 KiB an SM (64 queries take 35 KiB).
  static constexpr int kBlockM = TILES == TileTable::kGp100 || DMAX > 128 ? 32 : 64;
  static constexpr int kBlockN = 64;
  static constexpr int kLdM = transposed_ld(kBlockM), kLdN = transposed_ld(kBlockN);
  // Head-dim chunk of the score reductions: 32 from Volta on up to head dim 64 (half the barriers of 16, in the
  // registers the row gathers' stage takes anyway), else kChunkD.
  static constexpr int kChunk = !kPascal && DMAX <= 64 ? 32 : kChunkD;
  static constexpr int kTileFloats = 2 * kChunk * (kLdM + kLdN);
  // RESIDENT: the block's Q^T and dO^T, whole, stay in shared memory for all its key steps, which then gather only
  // K^T and V^T: half the gathers. Volta's tiles up to head dim 128, where two blocks an SM still fit
  // (launch_backward: on an H100 up to head dim 128, an A100 up to 32 (at 64 the 32-dim chunks take the room), a V100
  // or an sm_8x GeForce never).
  static constexpr bool kMayReside = !kPascal && DMAX <= 128;
  // S and dP go to shared memory and all the block's threads compute P and dS elementwise (as in dkdv_kernel), dP^T
  // in the tiles' space, which holds a [key][query] tile.
  static_assert(kTileFloats >= kBlockN * kLdM, "dP^T fits the tiles' space");
  // kSplitKeys: in dQ += dS K the roles take half the keys of each chunk each, over all of dQ's dims, rather than half
  // the dims over all keys: up to head dim 64 a thread's 8 queries x 4 dims take 3 shared loads per 32 FMAs (8 x 2 by
  // dims: 3 per 16). Role 1's sums join role 0's through the tiles' space at the end, where they fit.
  static constexpr bool kSplitKeys = DMAX <= 64 && kTileFloats >= kBlockM * DMAX;
  // kWholeStep: with Q^T and dO^T resident (and kSplitKeys), a step gathers K^T and V^T in one chunk of all dims
  // (kResidentChunk), and dQ += dS K reads K^T there (accumulate_products_b_transposed) instead of gathering K's rows
  // again: half the gathers, five barriers a step instead of eight. dP^T then takes V^T's place.
  static constexpr bool kWholeStep = kMayReside && kSplitKeys;
  static constexpr int kResidentChunk = kWholeStep ? DMAX : kChunk;
  static_assert(!kWholeStep || kTileFloats >= 2 * DMAX * kLdN, "K^T and V^T of a step fit the tiles' space");
  static_assert(!kWholeStep || kTileFloats >= DMAX * kLdN + kBlockN * kLdM, "so do K^T and dP^T");
  template <typename T, bool RESIDENT = false>
  using Scores = ScoreChunks<T, kBlockM, kLdM, kBlockN, kLdN, RESIDENT ? kResidentChunk : kChunk, !RESIDENT, true>;
  // K rows per chunk of dQ += dS K: in the tiles' space and in no more registers a thread than the score chunks of
  // both pairs
  static constexpr int kKeyBudget = Scores<float>::kRegs * kBackwardThreads;
  static constexpr int kKeyChunk = row_chunk<kBlockN, DMAX>(kKeyBudget < kTileFloats ? kKeyBudget : kTileFloats);
  template <typename T>
  using KeyRows = RowTile<T, kKeyChunk, DMAX, kBackwardThreads>;
  // One stage holds either gather.
  template <typename T, bool RESIDENT>
  static constexpr int stage_regs() {
    constexpr int scores = Scores<T, RESIDENT>::kRegs;
    return scores > KeyRows<T>::kRegs ? scores : KeyRows<T>::kRegs;
  }
  // Blocks of 256 threads per SM for __launch_bounds__: 2 (128 registers a thread).
  static constexpr int kMinBlocks = 2;
  // dQ += dS K loads each step's operands a step ahead (accumulate_products' PIPELINE) except on Pascal, whose code
  // (no uniform registers: the block's addresses take a thread's registers too) would spill the second set.
  static constexpr bool kPipelineDq = !kPascal;
  template <bool RESIDENT>
  static constexpr int smem_floats() {
    return (RESIDENT ? 2 * DMAX * kLdM : 0) + kTileFloats + kBlockN * kLdM;
  }
};

// dkdv_kernel's tiles: kBlockN keys per block against kBlockM queries per step. K^T, V^T (kLdN), Q^T and dO^T
// (kLdM) chunks, then Q and dO row chunks, share kTileFloats; P and dS are [query][key]. All in dynamic shared
// memory (smem_floats), after K^T and V^T whole where they are resident.
template <TileTable TILES, int DMAX>
struct DkdvTiles {
  static constexpr bool kPascal = is_pascal(TILES);
  // A thread's dK or dV tile is (kBlockN / 8) x (kOutDims / 16) registers: 64 keys, at most 64 registers.
  static constexpr int kBlockN = 64;
  // Queries per step. From Volta on 64 up to head dim 64: a thread's 8 keys x 4 queries of S and dP take 3 shared
  // loads per 32 FMAs (8 x 2: 3 per 16) and still fit 128 registers; at 96 and 128 they would spill. Pascal: 32, as
  // P and dS of 64 queries beside the chunks would exceed its 48 KiB a block.
  static constexpr int kBlockM = !kPascal && DMAX <= 64 ? 64 : 32;
  static constexpr int kLdN = transposed_ld(kBlockN), kLdM = transposed_ld(kBlockM);
  // The dims of dK and dV split over kDimParts blocks (grid y) of kOutDims each where a thread's accumulators and
  // operands would not fit its registers: 2 at head dim 256. Each part recomputes S and dP over all dims.
  static constexpr int kDimParts = DMAX > 128 ? 2 : 1;
  static constexpr int kOutDims = DMAX / kDimParts;
  // Room for the score chunks, or for the Q and dO rows of 16 queries (8 on Pascal, so that two blocks fit a P100's
  // 64 KiB an SM).
  static constexpr int kChunk = !kPascal && DMAX <= 64 ? 32 : kChunkD;  // as in DqTiles
  static constexpr int kScoreFloats = 2 * kChunk * (kLdN + kLdM);
  static constexpr int kRowFloats = 2 * (kPascal ? 8 : 16) * kOutDims;
  static constexpr int kTileFloats = kScoreFloats > kRowFloats ? kScoreFloats : kRowFloats;
  // RESIDENT: the block's K^T and V^T, whole, stay in shared memory for all the query steps of a head, which then
  // gather only Q^T and dO^T chunks. Volta's tiles up to head dim 128 (one dim part), where two blocks an SM still
  // fit (launch_backward).
  static constexpr bool kMayReside = !kPascal && DMAX <= 128;
  static_assert(!kMayReside || kDimParts == 1, "resident K^T and V^T hold every dim");
  // kWholeStep: with K^T and V^T resident, up to head dim 64, a step gathers Q^T and dO^T in one chunk of all dims
  // (kResidentChunk), and dV += P^T dO and dK += dS^T Q read them there (accumulate_products_b_transposed) instead of
  // gathering Q's and dO's rows again: half the gathers, four barriers a step instead of nine.
  static constexpr bool kWholeStep = kMayReside && DMAX <= 64;
  static constexpr int kResidentChunk = kWholeStep ? DMAX : kChunk;
  template <typename T, bool RESIDENT = false>
  using Scores = ScoreChunks<T, kBlockM, kLdM, kBlockN, kLdN, RESIDENT ? kResidentChunk : kChunk, true, !RESIDENT>;
  // Q and dO rows side by side, in the tiles' space and in no more registers a thread than the score chunks of both
  // pairs (so one stage holds either)
  static constexpr int kRowBudget = Scores<float>::kRegs * kBackwardThreads;
  static constexpr int kQueryChunk =
      row_chunk<kBlockM, kOutDims>(kRowBudget < kTileFloats ? kRowBudget : kTileFloats) / 2;
  template <typename T>
  using QueryRows = RowTile<T, kQueryChunk, kOutDims, kBackwardThreads>;  // of Q, and of dO
  template <typename T, bool RESIDENT>
  static constexpr int stage_regs() {
    constexpr int scores = Scores<T, RESIDENT>::kRegs;
    return scores > 2 * QueryRows<T>::kRegs ? scores : 2 * QueryRows<T>::kRegs;
  }
  // Blocks of 256 threads per SM for __launch_bounds__: 2 (128 registers a thread), except with Pascal's tiles above
  // head dim 64: 1 (up to 255), as a thread's dK or dV tile, the gathers' stage and the products' operands spill in
  // 128 there (sm_6x has no uniform registers, so the block's addresses and counters take a thread's registers too).
  static constexpr int kMinBlocks = kPascal && DMAX > 64 ? 1 : 2;
  static_assert(!kWholeStep || kTileFloats >= 2 * DMAX * kLdM, "Q^T and dO^T of a step fit the tiles' space");
  template <bool RESIDENT>
  static constexpr int smem_floats() {
    return (RESIDENT ? 2 * DMAX * kLdN : 0) + kTileFloats + 2 * kBlockM * kLdN;
  }
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

template <typename T, int DMAX, TileTable TILES, bool RESIDENT>
__device__ __forceinline__ void dq_block(const BackwardParams& p) {
  using Tiles = DqTiles<TILES, DMAX>;
  constexpr int BM = Tiles::kBlockM, BN = Tiles::kBlockN, LDM = Tiles::kLdM, LDN = Tiles::kLdN;
  // query rows, key columns and dims of the role's share of dQ per thread
  constexpr int R = BM / kRowsY, C = BN / kColsX, J = (Tiles::kSplitKeys ? DMAX : DMAX / 2) / kColsX;
  constexpr int KC = Tiles::kKeyChunk, CH = RESIDENT ? Tiles::kResidentChunk : Tiles::kChunk;
  constexpr bool WHOLE = RESIDENT && Tiles::kWholeStep;
  extern __shared__ __align__(16) float smem[];
  float* resident = smem;  // RESIDENT: Q^T and dO^T, [DMAX][LDM] each
  float* tiles = smem + (RESIDENT ? 2 * DMAX * LDM : 0);  // Q^T, dO^T (unless resident), K^T, V^T chunks; K rows
  float* ps_t = tiles + Tiles::kTileFloats;                 // P^T (or S^T), then dS^T: [key][query]
  // dP^T, [key][query], between the gathers (WHOLE: in V^T's place, after K^T)
  float* dp_t = tiles + (WHOLE ? DMAX * LDN : 0);
  // lse * log2(e) and delta of the block's queries: in shared memory rather than registers, which the score loop
  // needs
  __shared__ __align__(16) float row_stats[2 * BM];
  float* q_t = tiles;
  float* do_t = tiles + CH * LDM;
  float* k_t = tiles + (RESIDENT ? 0 : 2 * CH * LDM);
  float* v_t = k_t + CH * LDN;

  const AttentionShape& sh = p.shape;
  const Branch& br = p.branch;
  const auto [b, head, seg, tile] = query_grid(br, sh, BM).block_tile();
  const Members mem = members_of(br, sh.seq_len, head, seg);
  const int start_m = tile * BM;
  if (start_m >= mem.count) return;
  const int kvh = static_cast<int>(sh.kv_head(head));
  // q, dO, k, v (common.cuh: why in shared memory); read after a barrier
  __shared__ DilatedRows<T> block_rows[4];
  if (threadIdx.x == 0) set_block_rows(block_rows, p, b, head, kvh, mem, br.dilation);
  SharedRows<T> k_rows = block_rows[2];
  const auto [role, ty, tx] = backward_role();
  // Role 0 reduces S = Q K^T, role 1 dP = dO V^T; each then accumulates its share of dQ (half its dims, or with
  // kSplitKeys half the keys).
  const float* rows_t = RESIDENT ? resident + role * (DMAX * LDM) : (role == 0 ? q_t : do_t);  // chunk d0: + d0 * LDM
  const float* cols_t = role == 0 ? k_t : v_t;
  const int d_half = Tiles::kSplitKeys ? 0 : role * (DMAX / 2);  // the role's first dim of dQ
  const int dim = static_cast<int>(sh.head_dim);
  const float scale2 = static_cast<float>(sh.scale) * kLog2e;
  const int64_t row_base = (b * sh.num_heads + head) * sh.seq_len;

  static_assert(BM <= kBackwardThreads, "a thread per query row fills row_stats");
  if (threadIdx.x < BM) {  // read after the score loop's barriers
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
  // A key step gathers the score chunks d0 = 0, CH, ..., then K's row chunks k0 = 0, KC, ...;
  // each one's loads are issued into `stage` right after the barrier that publishes the one before.
  using Scores = typename Tiles::template Scores<T, RESIDENT>;
  using KeyRows = typename Tiles::template KeyRows<T>;
  T stage[Tiles::template stage_regs<T, RESIDENT>()];
  __syncthreads();  // block_rows written
  Scores::load(stage, block_rows, start_m, 0, 0, dim);
  if constexpr (RESIDENT)  // published by the first chunk's barrier
    gather_resident_pair<T, BM, LDM, DMAX>(resident, block_rows[0], block_rows[1], start_m, dim);
  for (int start_n = 0; start_n < key_end; start_n += BN) {
    float acc[R][C];  // role 0: S, role 1: dP
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int c = 0; c < C; ++c) acc[r][c] = 0.f;
    for (int d0 = 0; d0 < DMAX; d0 += CH) {
      __syncthreads();
      Scores::store(q_t, do_t, k_t, v_t, stage);
      __syncthreads();
      // the next gather's loads
      if (d0 + CH < DMAX) {
        Scores::load(stage, block_rows, start_m, start_n, d0 + CH, dim);
      } else if (WHOLE) {
        if (start_n + BN < key_end) Scores::load(stage, block_rows, start_m, start_n + BN, 0, dim);
      } else {
        KeyRows::load(stage, k_rows, start_n, 0, dim);
      }
      accumulate_products<CH, LDM, LDN, 4, true>(acc, rows_t + (RESIDENT ? d0 * LDM : 0) + ty * R, cols_t, tx);
    }
    // S^T (role 0) and dP^T (role 1) to shared memory, then dS^T = P^T (dP^T - delta) elementwise by all the
    // block's threads (dkdv_kernel's reason): kQueriesPerThread consecutive queries of one key a thread (threads
    // of a warp: consecutive keys, one row each, conflict-free), in groups of 4. dP^T overwrites the last score
    // chunk, hence the barrier first.
    __syncthreads();
    store_tile_columns<LDM>(role == 0 ? ps_t : dp_t, acc, ty, tx);
    __syncthreads();
    constexpr int kQueriesPerThread = BM * BN / kBackwardThreads;
    static_assert(kQueriesPerThread % 4 == 0, "groups of 4 queries");
    const int key = threadIdx.x % BN, q0 = threadIdx.x / BN * kQueriesPerThread;
    const int kj = start_n + key;
#pragma unroll
    for (int i0 = 0; i0 < kQueriesPerThread; i0 += 4) {
      float sp[4], dp[4], lse2[4], delta[4];
      load_row_values(sp, ps_t + key * LDM + q0 + i0);
      load_row_values(dp, dp_t + key * LDM + q0 + i0);
      load_row_values(lse2, row_stats + q0 + i0);
      load_row_values(delta, row_stats + BM + q0 + i0);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int qi = start_m + q0 + i0 + i;
        const bool visible = qi < mem.count && kj < mem.count && (!sh.causal || kj <= qi);
        const float prob = visible ? exp2f(sp[i] * scale2 - lse2[i]) : 0.f;
        dp[i] = prob * (dp[i] - delta[i]);
      }
      store_row_values(ps_t + key * LDM + q0 + i0, dp);
    }
    if constexpr (WHOLE) {  // the role's half of the keys (kSplitKeys), from the step's K^T
      constexpr int kHalf = BN / 2;
      __syncthreads();
      accumulate_products_b_transposed<kHalf, LDM, LDN>(dq, ps_t + role * kHalf * LDM + ty * R, k_t + role * kHalf, tx);
    } else {
      for (int k0 = 0; k0 < BN; k0 += KC) {
        __syncthreads();
        KeyRows::store(tiles, stage);
        __syncthreads();
        // the next gather's loads
        if (k0 + KC < BN) {
          KeyRows::load(stage, k_rows, start_n + k0 + KC, 0, dim);
        } else if (start_n + BN < key_end) {
          Scores::load(stage, block_rows, start_m, start_n + BN, 0, dim);
        }
        if constexpr (Tiles::kSplitKeys) {
          constexpr int kHalf = KC / 2;
          accumulate_products<kHalf, LDM, DMAX, 4, Tiles::kPipelineDq>(
              dq, ps_t + (k0 + role * kHalf) * LDM + ty * R, tiles + role * kHalf * DMAX, tx);
        } else {
          accumulate_products<KC, LDM, DMAX, 4, Tiles::kPipelineDq>(dq, ps_t + k0 * LDM + ty * R, tiles + d_half,
                                                                     tx);
        }
      }
    }
  }
  if constexpr (Tiles::kSplitKeys) {  // role 1's sums to role 0's, a thread's J in a row of the tiles' space
    static_assert(col_vector<J>() == J, "one vector of a thread's J sums");
    __syncthreads();
    float* partial = tiles + ty * R * DMAX;
    if (role == 1) {
#pragma unroll
      for (int r = 0; r < R; ++r) store_row_values(partial + r * DMAX + thread_col<J>(tx, 0), dq[r]);
    }
    __syncthreads();
    if (role == 1) return;
#pragma unroll
    for (int r = 0; r < R; ++r) {
      float other[J];
      load_row_values(other, partial + r * DMAX + thread_col<J>(tx, 0));
#pragma unroll
      for (int j = 0; j < J; ++j) dq[r][j] += other[j];
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
        // WHOLE: accumulate_products_b_transposed's columns
        const int d = d_half + (WHOLE ? j * kColsX + tx : thread_col<J>(tx, j));
        if (d < dim) row[d] += dq[r][j] * scale;
      }
    }
  }
}

template <typename T, int DMAX, TileTable TILES, bool RESIDENT>
__device__ __forceinline__ void dkdv_block(const BackwardParams& p) {
  using Tiles = DkdvTiles<TILES, DMAX>;
  constexpr int BN = Tiles::kBlockN, BM = Tiles::kBlockM, LDN = Tiles::kLdN, LDM = Tiles::kLdM;
  constexpr int OUT_DIMS = Tiles::kOutDims;
  constexpr int R = BN / kRowsY, C = BM / kColsX, J = OUT_DIMS / kColsX;  // key rows, query columns, dims a thread
  constexpr int QC = Tiles::kQueryChunk, CH = RESIDENT ? Tiles::kResidentChunk : Tiles::kChunk;
  constexpr bool WHOLE = RESIDENT && Tiles::kWholeStep;
  extern __shared__ __align__(16) float smem[];
  float* resident = smem;  // RESIDENT: K^T and V^T, [DMAX][LDN] each
  float* tiles = smem + (RESIDENT ? 2 * DMAX * LDN : 0);  // K^T, V^T (unless resident), Q^T, dO^T chunks; Q, dO rows
  float* p_s = tiles + Tiles::kTileFloats;                  // P: [query][key]
  float* ds_s = p_s + BM * LDN;                             // dS: [query][key]
  float* k_t = tiles;
  float* v_t = tiles + CH * LDN;
  float* q_t = tiles + (RESIDENT ? 0 : 2 * CH * LDN);
  float* do_t = q_t + CH * LDM;

  const AttentionShape& sh = p.shape;
  const Branch& br = p.branch;
  const auto [b, kvh, seg, tile] = kv_grid(br, sh, BN).block_tile();
  const int group = static_cast<int>(sh.num_heads / sh.num_kv_heads);
  const int h_begin = max(kvh * group, static_cast<int>(br.head_lo));
  const int h_end = min((kvh + 1) * group, static_cast<int>(br.head_hi));
  const int start_n = tile * BN;
  const int d_out = Tiles::kDimParts > 1 ? blockIdx.y * OUT_DIMS : 0;  // the block's dims of dK and dV
  const auto [role, ty, tx] = backward_role();
  // Role 0: S^T = K Q^T, P, dV += P^T dO. Role 1: dP^T = V dO^T, dS, dK += dS^T Q.
  const float* rows_t = RESIDENT ? resident + role * (DMAX * LDN) : (role == 0 ? k_t : v_t);  // chunk d0: + d0 * LDN
  const float* cols_t = role == 0 ? q_t : do_t;
  const float* weights = p_s + role * (BM * LDN);                 // P or dS
  const float* values = tiles + (1 - role) * (QC * OUT_DIMS);     // the dO or Q row chunk
  const float* values_t = role == 0 ? do_t : q_t;                 // WHOLE: dO^T or Q^T of the step
  using Scores = typename Tiles::template Scores<T, RESIDENT>;
  using QueryRows = typename Tiles::template QueryRows<T>;
  T stage[Tiles::template stage_regs<T, RESIDENT>()];
  const int dim = static_cast<int>(sh.head_dim);
  const float scale2 = static_cast<float>(sh.scale) * kLog2e;
  __shared__ DilatedRows<T> block_rows[4];  // q, dO, k, v of the current head (common.cuh: why in shared memory)
  SharedRows<T> q_rows = block_rows[0], do_rows = block_rows[1];

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

    float grad[R][J];  // role 0: dV, role 1: dK
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int j = 0; j < J; ++j) grad[r][j] = 0.f;

    // A query step gathers the score chunks, then the Q and dO row chunks, prefetched as in dq_kernel.
    // Causal: queries before the block's first key never see it.
    const int first_m = sh.causal ? start_n / BM * BM : 0;
    Scores::load(stage, block_rows, first_m, start_n, 0, dim);
    if constexpr (RESIDENT)  // published by the first chunk's barrier
      gather_resident_pair<T, BN, LDN, DMAX>(resident, block_rows[2], block_rows[3], start_n, dim);
    for (int start_m = first_m; start_m < mem.count; start_m += BM) {
      float acc[R][C];  // role 0: S^T, role 1: dP^T
#pragma unroll
      for (int r = 0; r < R; ++r)
#pragma unroll
        for (int c = 0; c < C; ++c) acc[r][c] = 0.f;
      for (int d0 = 0; d0 < DMAX; d0 += CH) {
        __syncthreads();
        Scores::store(q_t, do_t, k_t, v_t, stage);
        __syncthreads();
        // the next gather's loads
        if (d0 + CH < DMAX) {
          Scores::load(stage, block_rows, start_m, start_n, d0 + CH, dim);
        } else if (WHOLE) {
          if (start_m + BM < mem.count) Scores::load(stage, block_rows, start_m + BM, start_n, 0, dim);
        } else {
          QueryRows::load(stage, q_rows, start_m, d_out, dim);
          QueryRows::load(stage + QueryRows::kRegs, do_rows, start_m, d_out, dim);
        }
        accumulate_products<CH, LDN, LDM, 4, true>(acc, rows_t + (RESIDENT ? d0 * LDN : 0) + ty * R, cols_t,
                                                               tx);
      }
      // S (role 0) and dP (role 1) to shared memory, then P = exp2(S * scale2 - lse2) (0 where the key is not
      // visible) and dS = P (dP - delta) elementwise by all the block's threads, so that neither role waits while the
      // other computes: kKeysPerThread consecutive keys of one query a thread (threads of a warp: consecutive
      // queries, one row each, conflict-free), one lse and delta load each.
      store_tile_columns<LDN>(role == 0 ? p_s : ds_s, acc, ty, tx);
      __syncthreads();
      constexpr int kKeysPerThread = BM * BN >= kBackwardThreads ? BM * BN / kBackwardThreads : 1;
      if (threadIdx.x < BM * BN / kKeysPerThread) {
        const int q = threadIdx.x % BM, k0 = threadIdx.x / BM * kKeysPerThread;
        const int qi = start_m + q;
        const int pos = mem.first + min(qi, mem.count - 1) * static_cast<int>(br.dilation);
        const float lse2 = p.lse[row_base + pos] * kLog2e;
        const float delta = p.delta[row_base + pos];
        // keys start_n + k0 + i visible for i < visible_keys
        const int key_limit = qi >= mem.count ? 0 : (sh.causal ? min(mem.count, qi + 1) : mem.count);
        const int visible_keys = key_limit - start_n - k0;
        float sp[kKeysPerThread], dp[kKeysPerThread];
        load_row_values(sp, p_s + q * LDN + k0);
        load_row_values(dp, ds_s + q * LDN + k0);
#pragma unroll
        for (int i = 0; i < kKeysPerThread; ++i) {
          sp[i] = i < visible_keys ? exp2f(sp[i] * scale2 - lse2) : 0.f;
          dp[i] = sp[i] * (dp[i] - delta);
        }
        store_row_values(p_s + q * LDN + k0, sp);
        store_row_values(ds_s + q * LDN + k0, dp);
      }
      if constexpr (WHOLE) {
        __syncthreads();
        accumulate_products_b_transposed<BM, LDN, LDM>(grad, weights + ty * R, values_t, tx);
      } else {
        for (int q0 = 0; q0 < BM; q0 += QC) {
          __syncthreads();
          QueryRows::store(tiles, stage);
          QueryRows::store(tiles + QC * OUT_DIMS, stage + QueryRows::kRegs);
          __syncthreads();
          // the next gather's loads
          if (q0 + QC < BM) {
            QueryRows::load(stage, q_rows, start_m + q0 + QC, d_out, dim);
            QueryRows::load(stage + QueryRows::kRegs, do_rows, start_m + q0 + QC, d_out, dim);
          } else if (start_m + BM < mem.count) {
            Scores::load(stage, block_rows, start_m + BM, start_n, 0, dim);
          }
          accumulate_products<QC, LDN, OUT_DIMS, 2, true>(grad, weights + q0 * LDN + ty * R, values,
                                                                            tx);
        }
      }
    }

    float* out = role == 0 ? p.dv : p.dk;
    const float scale = role == 0 ? 1.f : static_cast<float>(sh.scale);
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const int kj = start_n + ty * R + r;
      if (kj < mem.count) {
        float* row = out + ((b * sh.seq_len + mem.first + kj * br.dilation) * sh.num_kv_heads + kvh) * sh.head_dim;
#pragma unroll
        for (int j = 0; j < J; ++j) {
          // WHOLE: accumulate_products_b_transposed's columns
          const int d = d_out + (WHOLE ? j * kColsX + tx : thread_col<J>(tx, j));
          if (d < dim) row[d] += grad[r][j] * scale;
        }
      }
    }
  }
}

// The kernels: the blocks above where this architecture's code holds TILES (common.cuh: tiles_built); the launchers
// never start the others.
template <typename T, int DMAX, TileTable TILES, bool RESIDENT>
__global__ void __launch_bounds__(kBackwardThreads, DqTiles<TILES, DMAX>::kMinBlocks)
    dq_kernel(const BackwardParams p) {
  if constexpr (tiles_built<TILES>())
    dq_block<T, DMAX, TILES, RESIDENT>(p);
  else
    __trap();
}

template <typename T, int DMAX, TileTable TILES, bool RESIDENT>
__global__ void __launch_bounds__(kBackwardThreads, DkdvTiles<TILES, DMAX>::kMinBlocks)
    dkdv_kernel(const BackwardParams p) {
  if constexpr (tiles_built<TILES>())
    dkdv_block<T, DMAX, TILES, RESIDENT>(p);
  else
    __trap();
}

}  // namespace

#ifndef __CUDACC_RTC__  // host code (common.cuh)
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

// Calls launch(std::true_type, bytes) (the kernel with resident tiles and its shared memory) where the tiles allow
// residency and Tiles::kMinBlocks blocks an SM still fit it (fewer blocks would leave fewer warps to hide the
// gathers' latency than the tile tables are sized for), else launch(std::false_type, bytes).
template <typename Tiles, typename Launch>
cudaError_t launch_maybe_resident(Launch&& launch) {
  if constexpr (Tiles::kMayReside) {
    constexpr size_t kBytes = Tiles::template smem_floats<true>() * sizeof(float);
    if (blocks_fit_shared_memory(kBytes, Tiles::kMinBlocks)) return launch(std::true_type{}, kBytes);
  }
  return launch(std::false_type{}, Tiles::template smem_floats<false>() * sizeof(float));
}

cudaError_t launch_backward(const BackwardParams& p, ScalarKind kind, TileTable tiles, cudaStream_t stream) {
  const AttentionShape& sh = p.shape;
  const Branch& br = p.branch;
  return dispatch_tiles(tiles, [&](auto table) {
    constexpr TileTable TILES = decltype(table)::value;
    constexpr TileTable KV_TILES = shared_tiles(TILES);
    return dispatch_head_dim(sh.head_dim, [&](auto dmax) {
      constexpr int DMAX = decltype(dmax)::value;
      using KvTiles = DkdvTiles<KV_TILES, DMAX>;
      using QTiles = DqTiles<TILES, DMAX>;
      const int64_t kv_blocks = kv_grid(br, sh, KvTiles::kBlockN).blocks();
      const int64_t q_blocks = query_grid(br, sh, QTiles::kBlockM).blocks();
      if (kv_blocks > kMaxGridBlocks || q_blocks > kMaxGridBlocks) return cudaErrorInvalidConfiguration;
      if (kv_blocks == 0 || q_blocks == 0) return cudaSuccess;
      return dispatch_scalar(kind, [&](auto tag) {
        using T = decltype(tag);
        const dim3 kv_grid_dims(static_cast<unsigned>(kv_blocks), KvTiles::kDimParts);
        const cudaError_t err = launch_maybe_resident<KvTiles>([&](auto resident, size_t bytes) {
          return launch_with_shared(dkdv_kernel<T, DMAX, KV_TILES, decltype(resident)::value>, kv_grid_dims,
                                    kBackwardThreads, bytes, stream, p);
        });
        if (err != cudaSuccess) return err;
        return launch_maybe_resident<QTiles>([&](auto resident, size_t bytes) {
          return launch_with_shared(dq_kernel<T, DMAX, TILES, decltype(resident)::value>,
                                    dim3(static_cast<unsigned>(q_blocks)), kBackwardThreads, bytes, stream, p);
        });
      });
    });
  });
}

#endif  // __CUDACC_RTC__

}  // namespace cuda
}  // namespace dilated_attn
