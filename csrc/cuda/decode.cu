// The decode kernel of the cuda backend (dilated_attention_with_kvcache on GPUs from Ampere on, 16-bit inputs,
// head_dim 64 or 128): the new rows' write, every branch and the merge of the blocks' shares in one launch, with the
// semantics of the Triton backend's decode kernel (src/dilated_attn/backends/triton/decode.py, whose docstring
// describes the passes, the shares and the merge). No ATen.
//
// It gives the cuda backend, and installs without Triton, a decode kernel where they would otherwise compute each new
// token over its whole prefix; on an H200 it runs even with the Triton kernel (benchmarks/README.md, "Decoding").
// A decoding step reads its keys once and multiplies each by a handful of query heads, so each warp owns its keys: it
// streams 16-key tiles of K and V through a private cp.async pipeline of kStages tiles in shared memory, and
// multiplies them with mma.sync (the kv head's query heads as the 16 rows of the A operand, the rest zero), carrying
// its own online softmax in registers. No barrier between the warps of a block until a kv head's share is done; then
// the block combines its warps' softmaxes and writes one partial result, and the last block of a kv head merges them
// (as the Triton kernel does).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <type_traits>

#include "launch.h"

namespace dilated_attn {
namespace cuda {
namespace {

constexpr int kWarps = 4;
constexpr int kDecodeThreads = kWarps * 32;
constexpr int kTile = 16;  // keys a warp takes at a time: the k dimension of one mma of P V
// Dynamic shared memory of a block: each warp's kStages tiles of K and V, rows padded by 16 bytes (decode_kernel).
constexpr int decode_smem_bytes(int head_dim, int stages) { return kWarps * stages * 2 * kTile * (head_dim * 2 + 16); }

// The device code below needs cp.async, ldmatrix and mma.sync of 16-bit inputs with fp32 sums: sm_80 and newer (older
// targets compile the kernel empty; the backend never launches it there).
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
constexpr float kDecodeLn2 = 0.6931471805599453f;

// One run of keys of the current kv head inside this block's share: the rows k0 + n * kstep (v0 + n * vstep) for
// n < count, the block's keys [start, start + count) of the kv head; `heads`: bit g set where the kv head's query head
// g attends to them (the branch's heads of this position's offset).
struct Segment {
  const void* k0;
  const void* v0;
  int64_t kstep, vstep;  // elements
  int start, count;
  uint32_t heads;
};

// A branch resolved for the block's position: its first member row, dilation, members up to the position (0 where
// no head takes part) and its heads [head_a, head_b).
struct Resolved {
  int first, r, keys, head_a, head_b;
};

__device__ __forceinline__ uint32_t smem_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes global -> shared, past L1. The form without a source size: the zero-filling form is not coalesced across
// a warp's threads (every thread's 16 bytes a request of their own 32-byte sector: twice the L2 traffic).
__device__ __forceinline__ void copy_16(uint32_t dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src));
}

// ... or 16 zero bytes where !valid.
__device__ __forceinline__ void copy_16_or_zero(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0));
}

__device__ __forceinline__ void commit_copies() {
  asm volatile("cp.async.commit_group;\n" ::);
}

template <int N>
__device__ __forceinline__ void wait_copies() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

__device__ __forceinline__ void load_matrices(uint32_t (&x)[4], uint32_t address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(x[0]), "=r"(x[1]), "=r"(x[2]), "=r"(x[3])
               : "r"(address));
}

__device__ __forceinline__ void load_matrices_transposed(uint32_t (&x)[4], uint32_t address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(x[0]), "=r"(x[1]), "=r"(x[2]), "=r"(x[3])
               : "r"(address));
}

// c += a b for one m16n8k16 tile (fp32 accumulators).
template <typename T>
__device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

template <typename T>
__device__ __forceinline__ uint32_t pack(float lo, float hi) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    __nv_bfloat162 x = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&x);
  } else {
    __half2 x = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&x);
  }
}

template <typename T>
__device__ __forceinline__ T from_f32(float x) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return __float2bfloat16_rn(x);
  } else {
    return __float2half_rn(x);
  }
}

__device__ __forceinline__ int share_of(int x, int total, int splits) {
  const int size = total / splits, big = total % splits * (size + 1);
  return x < big ? x / (size + 1) : total % splits + (x - big) / (size > 1 ? size : 1);
}

__device__ __forceinline__ int members_before(int row, int first, int r) {
  const int n = (row - first + r - 1) / r;
  return n > 0 ? n : 0;
}

// The merge of a kv head's shares' partial softmaxes into out and lse (the Triton kernel's _merge_shares): a share
// where a head has no keys (sum 0) has weight 0 and its output was not written. kBatch shares at a time, their loads
// issued together (the last block of a kv head runs this after every other: each round trip to L2 is on the
// kernel's critical path). Loads past L1: other blocks wrote the shares.
template <typename T, int D>
__device__ void merge_shares(const DecodeParams& p, int64_t token, int64_t b, int i, int kvh, int first_share,
                             int shares) {
  constexpr int kVec = 4, kBatch = 8;
  for (int x = threadIdx.x; x < p.group * (D / kVec); x += kDecodeThreads) {
    const int g = x / (D / kVec), d0 = x % (D / kVec) * kVec;
    const int head = kvh * p.group + g;
    float m = -INFINITY, sum = 0.f, out[kVec] = {0.f, 0.f, 0.f, 0.f};
    for (int s0 = first_share; s0 < first_share + shares; s0 += kBatch) {
      float2 stats[kBatch];
      float4 acc[kBatch];
      float batch_max = -INFINITY;
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        const int64_t part = (token * p.splits + s0 + j) * p.heads + head;
        stats[j] = s0 + j < first_share + shares ? __ldcg(reinterpret_cast<const float2*>(p.part_stats) + part)
                                                 : make_float2(-INFINITY, 0.f);
        if (stats[j].y > 0.f) batch_max = fmaxf(batch_max, stats[j].x);
      }
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        const int64_t part = (token * p.splits + s0 + j) * p.heads + head;
        acc[j] = stats[j].y > 0.f ? __ldcg(reinterpret_cast<const float4*>(p.part_acc + part * D + d0))
                                  : make_float4(0.f, 0.f, 0.f, 0.f);
      }
      const float m_new = fmaxf(m, batch_max);
      if (m_new == -INFINITY) continue;  // no keys yet
      const float alpha = exp2f(m - m_new);  // m = -inf: 0
      out[0] *= alpha, out[1] *= alpha, out[2] *= alpha, out[3] *= alpha;
      sum *= alpha;
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        const float weight = stats[j].y > 0.f ? exp2f(stats[j].x - m_new) : 0.f;
        out[0] += acc[j].x * weight, out[1] += acc[j].y * weight, out[2] += acc[j].z * weight;
        out[3] += acc[j].w * weight;
        sum += stats[j].y * weight;
      }
      m = m_new;
    }
    const bool covered = sum > 0.f;
    T* o = static_cast<T*>(p.out) + b * p.so_b + i * p.so_s + head * p.so_h + d0;
#pragma unroll
    for (int j = 0; j < kVec; ++j) o[j] = from_f32<T>(covered ? out[j] / sum : 0.f);
    if (d0 == 0) p.lse[(b * p.heads + head) * p.sq + i] = covered ? (m + log2f(sum)) * kDecodeLn2 : -INFINITY;
  }
}

#endif  // sm_80 and newer

template <typename T, int D, int kStages>
__global__ void __launch_bounds__(kDecodeThreads) decode_kernel(const DecodeParams p) {
#if __CUDA_ARCH__ >= 800
  constexpr int kChunks = D / 8;                // 16-byte chunks of a row
  // A tile's rows lie kPitch bytes apart, one 16-byte chunk more than a row: the 8 rows an ldmatrix reads at one column
  // fall in 8 different bank groups, and every address is the row's start plus a constant (an immediate offset).
  constexpr int kPitch = (kChunks + 1) * 16;
  constexpr int kTileBytes = kTile * kPitch;  // of a tile of K (or V)
  constexpr int kStageBytes = 2 * kTileBytes;
  constexpr int kSteps = D / 16;                // mma k-steps of Q K^T, and pairs of 8-column tiles of P V
  extern __shared__ uint4 smem[];
  __shared__ Resolved branches[kMaxDecodeBranches];
  __shared__ Segment segments[2 * kMaxDecodeBranches];
  __shared__ int kv_keys[kMaxDecodeKvHeads];
  __shared__ int block_range[3];  // the block's keys [lo, hi) of the token's `total`
  __shared__ float warp_max[kWarps][16], warp_sum[kWarps][16];
  __shared__ alignas(16) uint32_t tile_heads[kWarps][kStages][kTile];
  __shared__ int last_share;

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t token = blockIdx.x;
  const int share = blockIdx.y, splits = gridDim.y;
  const int i = static_cast<int>(token % p.sq);
  const int64_t b = token / p.sq;
  const int kv_heads = p.heads / p.group;
  int cached = p.cache_len;
  if (p.cache_seqlens != nullptr) {
    cached = p.seqlens_int64 ? static_cast<int>(static_cast<const int64_t*>(p.cache_seqlens)[b])
                             : static_cast<const int32_t*>(p.cache_seqlens)[b];
  }
  const bool append = p.k_new != nullptr;
  if (append && share == 0) {  // the new rows into the caches (a row outside the cache is not written)
    const int row = cached + i;
    if (row >= 0 && row <= p.max_pos) {
      for (int c = threadIdx.x; c < 2 * kv_heads * kChunks; c += kDecodeThreads) {
        const bool is_v = c >= kv_heads * kChunks;
        const int h = c % (kv_heads * kChunks) / kChunks, chunk = c % kChunks;
        const T* src = static_cast<const T*>(is_v ? p.v_new : p.k_new) +
                       b * (is_v ? p.svn_b : p.skn_b) + i * (is_v ? p.svn_s : p.skn_s) +
                       h * (is_v ? p.svn_h : p.skn_h) + chunk * 8;
        T* dst = static_cast<T*>(is_v ? p.v_cache : p.k_cache) + b * (is_v ? p.sv_b : p.sk_b) +
                 static_cast<int64_t>(row) * (is_v ? p.sv_n : p.sk_n) + h * (is_v ? p.sv_h : p.sk_h) + chunk * 8;
        *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
      }
    }
  }
  const int pos = max(min(cached + i, p.max_pos), 0);  // lengths not checked on the host may be out of range

  // Every branch resolved for this position (one thread a branch), then each kv head's keys (one thread a kv head).
  if (threadIdx.x < p.n_branches) {
    const int* row = p.branches + threadIdx.x * 6;
    const int w = row[0], r = row[1], head_lo = row[2], head_hi = row[3], offset_div = row[4], offset_base = row[5];
    const int start = pos / w * w, offset = (pos - start) % r;
    const int head_a = head_lo + (offset - offset_base) * offset_div;
    const int head_b = min(head_a + offset_div, head_hi);
    const bool member = offset >= offset_base && head_a < head_b;
    branches[threadIdx.x] = Resolved{start + offset, r, member ? (pos - start - offset) / r + 1 : 0, head_a, head_b};
  }
  __syncthreads();
  for (int kvh = threadIdx.x; kvh < kv_heads; kvh += kDecodeThreads) {
    int keys = 0;
    for (int j = 0; j < p.n_branches; ++j) {
      const Resolved& br = branches[j];
      if (kvh * p.group < br.head_b && kvh * p.group + p.group > br.head_a) keys += br.keys;
    }
    kv_keys[kvh] = keys;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int total = 0;
    for (int kvh = 0; kvh < kv_heads; ++kvh) total += kv_keys[kvh];
    block_range[0] = share * (total / splits) + min(share, total % splits);
    block_range[1] = block_range[0] + total / splits + (share < total % splits ? 1 : 0);
    block_range[2] = total;
  }
  __syncthreads();
  const int lo = block_range[0], hi = block_range[1], total = block_range[2];

  // Each thread's place in the mma fragments: rows (query heads) g0 and g0 + 8, key columns 2 * q4 + {0, 1} (+ 8).
  const int g0 = lane / 4, q4 = lane % 4;
  const uint32_t warp_tiles = smem_address(smem) + warp * kStages * kStageBytes;
  int before = 0;  // keys of the kv heads before this one
  for (int kvh = 0; kvh < kv_heads; ++kvh) {
    const int kvh_keys = kv_keys[kvh];
    if (!(before < hi && before + kvh_keys > lo)) {
      if (kvh_keys == 0 && share == 0) merge_shares<T, D>(p, token, b, i, kvh, 0, 0);  // no share: 0 and -inf
      before += kvh_keys;
      continue;
    }
    const int base = max(lo, before), count = min(hi, before + kvh_keys) - base;  // this block's keys of kvh
    // The runs of keys: each branch's members before the new rows (from the caches), then its new rows (from k, v).
    if (threadIdx.x < p.n_branches) {
      const int j = threadIdx.x;
      int pass_start = before;
      for (int e = 0; e < j; ++e) {
        const Resolved& br = branches[e];
        if (kvh * p.group < br.head_b && kvh * p.group + p.group > br.head_a) pass_start += br.keys;
      }
      const Resolved br = branches[j];
      const bool takes = kvh * p.group < br.head_b && kvh * p.group + p.group > br.head_a;
      const int n_keys = takes ? br.keys : 0;
      const int j_lo = max(lo - pass_start, 0), j_hi = min(hi - pass_start, n_keys);
      uint32_t heads = 0;
      for (int g = 0; g < p.group; ++g) {
        const int h = kvh * p.group + g;
        heads |= (h >= br.head_a && h < br.head_b ? 1u : 0u) << g;
      }
      const int n_old = append ? members_before(cached, br.first, br.r) : n_keys;
      const int old_hi = min(j_hi, n_old);
      const int first_row = br.first + j_lo * br.r;
      // the runs' starts grow with j (segment_of scans them in order): a run without keys starts where the one
      // before it ends
      const int old_start = max(lo, pass_start) - base, old_count = max(old_hi - j_lo, 0);
      segments[2 * j] = Segment{
          static_cast<const T*>(p.k_cache) + b * p.sk_b + kvh * p.sk_h + static_cast<int64_t>(first_row) * p.sk_n,
          static_cast<const T*>(p.v_cache) + b * p.sv_b + kvh * p.sv_h + static_cast<int64_t>(first_row) * p.sv_n,
          static_cast<int64_t>(br.r) * p.sk_n, static_cast<int64_t>(br.r) * p.sv_n, old_start, old_count, heads};
      const int new_lo = max(j_lo, n_old);
      const int new_hi = append ? min(j_hi, members_before(cached + p.sq, br.first, br.r)) : new_lo;
      const int first_new = br.first + new_lo * br.r - cached;  // its index in k, v
      segments[2 * j + 1] = Segment{
          append ? static_cast<const T*>(p.k_new) + b * p.skn_b + kvh * p.skn_h +
                       static_cast<int64_t>(first_new) * p.skn_s
                 : nullptr,
          append ? static_cast<const T*>(p.v_new) + b * p.svn_b + kvh * p.svn_h +
                       static_cast<int64_t>(first_new) * p.svn_s
                 : nullptr,
          static_cast<int64_t>(br.r) * p.skn_s, static_cast<int64_t>(br.r) * p.svn_s, old_start + old_count,
          max(new_hi - new_lo, 0), heads};
    }
    __syncthreads();

    // Q's A fragments (rows past the group zero): a[0], a[1] rows g0, g0 + 8 at columns 2 * q4 + {0, 1} of the step,
    // a[2], a[3] the same 8 columns on.
    uint32_t qa[kSteps][4];
    {
      const T* q = static_cast<const T*>(p.q) + b * p.sq_b + i * p.sq_s + (kvh * p.group) * p.sq_h;
#pragma unroll
      for (int s = 0; s < kSteps; ++s) {
#pragma unroll
        for (int x = 0; x < 4; ++x) {
          const int g = g0 + (x % 2) * 8, d = 16 * s + 2 * q4 + (x / 2) * 8;
          qa[s][x] = g < p.group ? *reinterpret_cast<const uint32_t*>(q + g * p.sq_h + d) : 0u;
        }
      }
    }

    // This warp's tiles: every kWarps-th 16 keys of the block's, from the warp's index on.
    const int tiles = (count + kTile - 1) / kTile;
    const int my_tiles = tiles > warp ? (tiles - warp + kWarps - 1) / kWarps : 0;
    // A tile's rows are copied whole by each instruction (kChunks lanes a row, kRows rows an instruction): a warp's
    // 16-byte copies cover full 128-byte lines. Where the tile lies in one run of keys (all but a pass's ends and the
    // last tile), its rows are a fixed step apart.
    constexpr int kRows = 32 / kChunks, kCopies = kTile / kRows;
    const int chunk = lane % kChunks, sub = lane / kChunks;
    const int last_segment = 2 * p.n_branches - 1;
    int tile_segment = 0;  // the run of the tile's first key (tiles only move on)
    auto segment_of = [&](int key, int from) {
      while (from < last_segment && key >= segments[from].start + segments[from].count) ++from;
      return from;
    };
    auto issue = [&](int t) {
      if (t < my_tiles) {
        const int key0 = (warp + t * kWarps) * kTile;
        tile_segment = segment_of(key0, tile_segment);
        const Segment seg = segments[tile_segment];
        const uint32_t k_tile = warp_tiles + (t % kStages) * kStageBytes;
        if (key0 + kTile <= seg.start + seg.count) {
          const int64_t n = key0 - seg.start + sub;
          const T* k_row = static_cast<const T*>(seg.k0) + n * seg.kstep + chunk * 8;
          const T* v_row = static_cast<const T*>(seg.v0) + n * seg.vstep + chunk * 8;
          const int64_t k_step = kRows * seg.kstep, v_step = kRows * seg.vstep;
          const uint32_t at = k_tile + sub * kPitch + chunk * 16;
#pragma unroll
          for (int c = 0; c < kCopies; ++c) {
            copy_16(at + c * kRows * kPitch, k_row + c * k_step);
            copy_16(at + kTileBytes + c * kRows * kPitch, v_row + c * v_step);
          }
          if (lane < kTile) tile_heads[warp][t % kStages][lane] = seg.heads;
        } else {  // across runs, or past the keys (zero-filled, attended by no head)
#pragma unroll 1
          for (int c = 0; c < kCopies; ++c) {
            const int row = c * kRows + sub, key = key0 + row;
            const Segment& own = segments[segment_of(key, tile_segment)];
            const bool valid = key < count;
            const int64_t n = key - own.start;
            const uint32_t at = k_tile + row * kPitch + chunk * 16;
            copy_16_or_zero(at, valid ? static_cast<const T*>(own.k0) + n * own.kstep + chunk * 8 : p.q, valid);
            copy_16_or_zero(at + kTileBytes, valid ? static_cast<const T*>(own.v0) + n * own.vstep + chunk * 8 : p.q,
                            valid);
          }
          if (lane < kTile) {
            const int key = key0 + lane;
            tile_heads[warp][t % kStages][lane] = key < count ? segments[segment_of(key, tile_segment)].heads : 0u;
          }
        }
      }
      commit_copies();
    };

    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
    float acc[2 * kSteps][4];
#pragma unroll
    for (int n = 0; n < 2 * kSteps; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
#pragma unroll 1
    for (int t = 0; t < kStages - 1; ++t) issue(t);
    for (int t = 0; t < my_tiles; ++t) {
      wait_copies<kStages - 2>();
      __syncwarp();
      issue(t + kStages - 1);  // into the stage read by tile t - 1, which every lane has finished
      const uint32_t k_tile = warp_tiles + (t % kStages) * kStageBytes, v_tile = k_tile + kTileBytes;
      // S = Q K^T over the tile's 16 keys: two 8-key column tiles
      float s[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
      const int mat = lane / 8;
#pragma unroll
      for (int step = 0; step < kSteps; ++step) {
        uint32_t kb[4];  // (keys 0-7, cols lo), (keys 0-7, cols hi), (keys 8-15, lo), (keys 8-15, hi)
        load_matrices(kb, k_tile + ((mat / 2) * 8 + lane % 8) * kPitch + (2 * step + mat % 2) * 16);
        mma<T>(s[0], qa[step], kb[0], kb[1]);
        mma<T>(s[1], qa[step], kb[2], kb[3]);
      }
      // -inf where the key is not attended by the row's head (or lies past the keys); the maxima of unscaled scores
      // (scale > 0), scaled in each exponent's FMA
      const uint2 heads_lo = *reinterpret_cast<const uint2*>(&tile_heads[warp][t % kStages][2 * q4]);
      const uint2 heads_hi = *reinterpret_cast<const uint2*>(&tile_heads[warp][t % kStages][8 + 2 * q4]);
      const uint32_t key_heads[2][2] = {{heads_lo.x, heads_lo.y}, {heads_hi.x, heads_hi.y}};
      float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
      for (int n = 0; n < 2; ++n) {
#pragma unroll
        for (int x = 0; x < 4; ++x) {
          const bool attends = (key_heads[n][x % 2] >> (g0 + (x / 2) * 8)) & 1u;
          s[n][x] = attends ? s[n][x] : -INFINITY;
          tile_max[x / 2] = fmaxf(tile_max[x / 2], s[n][x]);
        }
      }
      float alpha[2], offset[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        tile_max[h] = fmaxf(tile_max[h], __shfl_xor_sync(0xffffffffu, tile_max[h], 1));
        tile_max[h] = fmaxf(tile_max[h], __shfl_xor_sync(0xffffffffu, tile_max[h], 2));
        const float m_new = fmaxf(m[h], tile_max[h]);
        const float m_safe = m_new == -INFINITY ? 0.f : m_new;  // rows without keys keep theirs
        alpha[h] = exp2f((m[h] - m_safe) * p.qk_scale);
        offset[h] = -m_safe * p.qk_scale;
        m[h] = m_new;
      }
      uint32_t pa[4];  // P's A fragment: rows g0, g0 + 8; keys 2 * q4 + {0, 1}, then 8 on
      l[0] *= alpha[0];
      l[1] *= alpha[1];
#pragma unroll
      for (int n = 0; n < 2; ++n) {
        const float p0 = exp2f(fmaf(s[n][0], p.qk_scale, offset[0])), p1 = exp2f(fmaf(s[n][1], p.qk_scale, offset[0]));
        const float p2 = exp2f(fmaf(s[n][2], p.qk_scale, offset[1])), p3 = exp2f(fmaf(s[n][3], p.qk_scale, offset[1]));
        l[0] += p0 + p1;
        l[1] += p2 + p3;
        pa[2 * n] = pack<T>(p0, p1);
        pa[2 * n + 1] = pack<T>(p2, p3);
      }
      if (__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) {
#pragma unroll
        for (int n = 0; n < 2 * kSteps; ++n) {
          acc[n][0] *= alpha[0], acc[n][1] *= alpha[0], acc[n][2] *= alpha[1], acc[n][3] *= alpha[1];
        }
      }
      // O += P V: V's B fragments transposed out of the tile, two 8-column tiles at a time
#pragma unroll
      for (int pair = 0; pair < kSteps; ++pair) {
        uint32_t vb[4];  // (keys 0-7, cols lo), (keys 8-15, lo), (keys 0-7, hi), (keys 8-15, hi)
        load_matrices_transposed(vb, v_tile + ((mat % 2) * 8 + lane % 8) * kPitch + (2 * pair + mat / 2) * 16);
        mma<T>(acc[2 * pair], pa, vb[0], vb[1]);
        mma<T>(acc[2 * pair + 1], pa, vb[2], vb[3]);
      }
    }
    wait_copies<0>();
    // the row sums over the quad's key columns
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      l[h] += __shfl_xor_sync(0xffffffffu, l[h], 1);
      l[h] += __shfl_xor_sync(0xffffffffu, l[h], 2);
    }
    __syncthreads();  // every warp done with its tiles: the pipeline's memory holds the warps' outputs now

    // The block's softmax: the warps' maxima, each warp's output and sum rescaled to theirs, summed.
    if (q4 == 0) {  // in base 2 from here on
      warp_max[warp][g0] = m[0] * p.qk_scale;
      warp_max[warp][g0 + 8] = m[1] * p.qk_scale;
    }
    __syncthreads();
    float* const outs = reinterpret_cast<float*>(smem);  // [kWarps][group][D]
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int g = g0 + 8 * h;
      float block_max = -INFINITY;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) block_max = fmaxf(block_max, warp_max[w][g]);
      const float scale = m[h] == -INFINITY ? 0.f : exp2f(m[h] * p.qk_scale - block_max);
      if (g < p.group) {
        if (q4 == 0) warp_sum[warp][g] = l[h] * scale;
#pragma unroll
        for (int n = 0; n < 2 * kSteps; ++n) {
          float2 v = make_float2(acc[n][2 * h] * scale, acc[n][2 * h + 1] * scale);
          *reinterpret_cast<float2*>(outs + (warp * p.group + g) * D + 8 * n + 2 * q4) = v;
        }
      }
    }
    __syncthreads();
    for (int x = threadIdx.x; x < p.group * D; x += kDecodeThreads) {
      const int g = x / D, d = x % D;
      float block_max = -INFINITY, sum = 0.f, o = 0.f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) {
        block_max = fmaxf(block_max, warp_max[w][g]);
        sum += warp_sum[w][g];
        o += outs[(w * p.group + g) * D + d];
      }
      const int64_t part = (token * splits + share) * p.heads + kvh * p.group + g;
      if (sum > 0.f) p.part_acc[part * D + d] = o;
      if (d == 0) reinterpret_cast<float2*>(p.part_stats)[part] = make_float2(block_max, sum);
    }
    // every thread's writes before the count: the last share to count reads them all
    __threadfence();
    __syncthreads();
    const int first_share = share_of(before, total, splits);
    const int shares = share_of(before + kvh_keys - 1, total, splits) - first_share + 1;
    if (threadIdx.x == 0) {
      last_share = atomicAdd(p.counters + token * kv_heads + kvh, 1) == shares - 1;
    }
    __syncthreads();
    if (last_share) {
      __threadfence();
      merge_shares<T, D>(p, token, b, i, kvh, first_share, shares);
      if (threadIdx.x == 0) p.counters[token * kv_heads + kvh] = 0;
    }
    __syncthreads();  // segments, tile_heads and the pipeline's memory are rewritten for the next kv head
    before += kvh_keys;
  }
#endif
}

template <typename T, int D, int kStages>
cudaError_t launch(const DecodeParams& p, cudaStream_t stream) {
  constexpr int smem = decode_smem_bytes(D, kStages);
  static_assert(smem >= kWarps * 16 * D * 4, "the block's combine reuses the pipeline's memory");
  // the shared memory a block may take is set once per device (an attribute of the function on each device)
  static std::atomic<uint64_t> configured{0};
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  const uint64_t bit = device < 64 ? uint64_t{1} << device : 0;
  if (bit == 0 || !(configured.load(std::memory_order_relaxed) & bit)) {
    err = cudaFuncSetAttribute(decode_kernel<T, D, kStages>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (err != cudaSuccess) return err;
    configured.fetch_or(bit, std::memory_order_relaxed);
  }
  decode_kernel<T, D, kStages><<<dim3(static_cast<unsigned>(p.tokens), p.splits), kDecodeThreads, smem, stream>>>(p);
  return cudaGetLastError();
}

template <typename T, int D, int kStages>
int blocks_per_sm() {
  constexpr int smem = decode_smem_bytes(D, kStages);
  if (cudaFuncSetAttribute(decode_kernel<T, D, kStages>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) !=
      cudaSuccess) {
    return 0;
  }
  int blocks = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, decode_kernel<T, D, kStages>, kDecodeThreads, smem) !=
      cudaSuccess) {
    return 0;
  }
  return blocks;
}

template <typename T, int D>
cudaError_t launch_stages(const DecodeParams& p, int stages, cudaStream_t stream) {
  switch (stages) {
    case 2:
      return launch<T, D, 2>(p, stream);
    case 3:
      return launch<T, D, 3>(p, stream);
    case 4:
      return launch<T, D, 4>(p, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

template <typename T, int D>
int blocks_stages(int stages) {
  switch (stages) {
    case 2:
      return blocks_per_sm<T, D, 2>();
    case 3:
      return blocks_per_sm<T, D, 3>();
    case 4:
      return blocks_per_sm<T, D, 4>();
    default:
      return 0;
  }
}

}  // namespace

cudaError_t launch_decode(const DecodeParams& p, ScalarKind kind, int stages, cudaStream_t stream) {
  if (kind == ScalarKind::kBFloat16) {
    return p.head_dim == 64 ? launch_stages<__nv_bfloat16, 64>(p, stages, stream)
                            : launch_stages<__nv_bfloat16, 128>(p, stages, stream);
  }
  return p.head_dim == 64 ? launch_stages<__half, 64>(p, stages, stream)
                          : launch_stages<__half, 128>(p, stages, stream);
}

int decode_blocks_per_sm(ScalarKind kind, int head_dim, int stages) {
  if (kind == ScalarKind::kBFloat16) {
    return head_dim == 64 ? blocks_stages<__nv_bfloat16, 64>(stages) : blocks_stages<__nv_bfloat16, 128>(stages);
  }
  return head_dim == 64 ? blocks_stages<__half, 64>(stages) : blocks_stages<__half, 128>(stages);
}

}  // namespace cuda
}  // namespace dilated_attn
