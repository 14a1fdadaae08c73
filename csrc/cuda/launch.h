// The CUDA kernels' plain launch API: parameter structs of pointers, strides and sizes, and one launch
// function per kernel family. No ATen here (the launchers in attention_cuda.cpp translate tensors into
// these structs), so the kernel files compile with nvcc alone, for any target, without torch.
#pragma once

#include <cuda_runtime.h>

#include "../params.h"

namespace dilated_attn {
namespace cuda {

enum class ScalarKind { kHalf, kBFloat16, kFloat };

// Tile tables: the tile sizes of every kernel, per GPU generation; the kernels' tile structs hold them.
// - kPascal, sm_61 and sm_62 (GP10x: 64K registers and 96 KiB of shared memory an SM, at most 48 KiB a block, no
//   tensor cores).
// - kGp100, sm_60 (the P100: 64 KiB of shared memory an SM): Pascal's, with 32-query dQ blocks so that two fit.
// - kVolta, sm_70 and newer (up to 227 KiB of shared memory a block on Hopper).
// All give a thread a large register tile (up to 128 or 255 registers; one or two blocks an SM: 8 or 16 warps), so
// that each shared-memory load feeds several FMAs: the rate of an FMA-bound kernel comes from its tile, not from
// occupancy. Pascal's tables keep every block within 48 KiB and the blocks an SM is sized for within its shared
// memory; Volta's may use more, and keeps operands resident in shared memory where the device has room.
// Each architecture's code holds only its own tables (common.cuh: tiles_built): sm_6x code both Pascal tables, sm_70+
// code Volta's. A build with DILATED_ATTN_PASCAL_PROXY=1 also puts the Pascal tables into sm_70+ code, so that a
// newer GPU can run and test them (DILATED_ATTN_CUDA_TILES=pascal or gp100).
enum class TileTable { kPascal, kGp100, kVolta };

// Pascal's tables (kPascal and kGp100) share every tile but the dQ blocks'.
constexpr bool is_pascal(TileTable t) { return t != TileTable::kVolta; }

// The table whose kernels run the forward and dK/dV for table t: one build of them serves both Pascal tables.
constexpr TileTable shared_tiles(TileTable t) { return t == TileTable::kGp100 ? TileTable::kPascal : t; }

#ifdef DILATED_ATTN_PASCAL_PROXY
constexpr bool kPascalProxy = DILATED_ATTN_PASCAL_PROXY;
#else
constexpr bool kPascalProxy = false;
#endif

// Head dims are compiled for 32, 64, 96, 128 and 256; other sizes up to 256 run in the next larger one
// with the extra columns zero.
constexpr int64_t kMaxHeadDim = 256;

// Positions and member indices are 32-bit in the kernels (fewer registers for the tiles).
constexpr int64_t kMaxSeqLen = int64_t{1} << 31;

// One branch of the forward: merges the branch's (out_i, lse_i) into the running (out, lse) in place.
struct ForwardParams {
  const void *q, *k, *v;
  void* out;   // [B, N, Hq, D] in the input dtype, the running merged output
  float* lse;  // [B, Hq, N] contiguous, the running merged LSE (natural log)
  Strides sq, sk, sv, so;
  AttentionShape shape;
  Branch branch;
};

// delta = rowsum(dout * out) - grad_lse for every (batch, head, position).
struct DeltaParams {
  const void *out, *dout;
  const float* grad_lse;  // [B, Hq, N] contiguous, or null
  float* delta;           // [B, Hq, N] contiguous
  Strides so, sdo;
  AttentionShape shape;
};

// One branch of the backward: adds the branch's share of the gradient of the merged function into the
// fp32 accumulators.
struct BackwardParams {
  const void *q, *k, *v, *dout;
  const float *lse, *delta;  // [B, Hq, N] contiguous: merged LSE and delta
  float *dq, *dk, *dv;       // contiguous fp32 [B, N, Hq or Hkv, D]
  Strides sq, sk, sv, sdo;
  AttentionShape shape;
  Branch branch;
};

// Each returns the launch's error (cudaSuccess when it was queued; cudaErrorInvalidDeviceFunction where this build
// holds no code of `tiles` for the device).
cudaError_t launch_forward(const ForwardParams& p, ScalarKind kind, TileTable tiles, cudaStream_t stream);
cudaError_t launch_delta(const DeltaParams& p, ScalarKind kind, cudaStream_t stream);
cudaError_t launch_backward(const BackwardParams& p, ScalarKind kind, TileTable tiles, cudaStream_t stream);

// The cudnn backend's kernels (merge.cu), over [b, h, s, d] views given by their first element and the element
// strides of b, h and s (d has unit stride).
struct RowsView {
  void* data;
  int64_t sb, sh, ss;
};

// (out, lse) <- merge([out, part_out], [lse, part_lse]) in place: the two-term form of dilated_attn.merge
// (weights normalised by their sum; rows without keys give (0, -inf); a NaN LSE makes the row NaN). out and
// part_out in the input dtype, the LSEs float32 ([b, h, s] views). With `store`, (out, lse) <- (part_out,
// part_lse): the first result of rows no other result reached yet (out and lse are not read).
struct MergeParams {
  RowsView out, lse, part_out, part_lse;
  int64_t b, h, s, d;
  bool store;
};

// dst[i] += src[i] (dst[i] = src[i] with `store`) for the first `tensors` (1 to 3) gradients of one cuDNN call,
// views of one shape, rounded once to the sums' dtype: the gradients' (ScalarKind), or float32 with `float_sums`.
struct AccumulateParams {
  RowsView dst[3], src[3];
  int64_t b, h, s, d;
  bool store;
  int tensors;
  bool float_sums;
};

// `vectorized`: every view's first element and strides, and d, are whole 16-byte vectors (d: of the ScalarKind).
cudaError_t launch_merge(const MergeParams& p, ScalarKind kind, bool vectorized, cudaStream_t stream);
cudaError_t launch_accumulate(const AccumulateParams& p, ScalarKind kind, bool vectorized, cudaStream_t stream);

// The cuda backend's decode kernel (decode.cu: dilated_attention_with_kvcache from Ampere on, float16 or bfloat16,
// head_dim 64 or 128, at most kMaxDecodeBranches branches, kMaxDecodeKvHeads kv heads and 16 query heads a kv head;
// every row of q, the caches, k, v and out 16-byte aligned with unit-stride columns). Its arguments are the Triton
// decode kernel's (src/dilated_attn/backends/triton/decode.py), strides in elements.
constexpr int kMaxDecodeBranches = 16;
constexpr int kMaxDecodeKvHeads = 256;
constexpr int kMaxDecodeGroup = 16;

struct DecodeParams {
  const void* q;                 // [B, Sq, H, D]
  void *k_cache, *v_cache;       // [B, Nmax, Hkv, D]
  const void *k_new, *v_new;     // [B, Sq, Hkv, D], written into the caches at rows cached + i; null: no new rows
  void* out;                     // like q
  float* lse;                    // [B, H, Sq] contiguous
  float* part_stats;             // [B * Sq, splits, H, 2]: each share's running max (base 2) and sum
  float* part_acc;               // [B * Sq, splits, H, D]: each share's unnormalised output (where its sum > 0)
  int* counters;                 // [B * Sq, Hkv], 0 between launches: shares done per (token, kv head)
  const void* cache_seqlens;     // [B] int32 or int64 (seqlens_int64); null: cache_len for every batch element
  bool seqlens_int64;
  const int* branches;           // int32 [n_branches, 6]: w, r, head_lo, head_hi, offset_div, offset_base
  int n_branches;
  int cache_len;
  int64_t sq_b, sq_s, sq_h;
  int64_t sk_b, sk_n, sk_h, sv_b, sv_n, sv_h;
  int64_t skn_b, skn_s, skn_h, svn_b, svn_s, svn_h;
  int64_t so_b, so_s, so_h;
  int sq, heads, group, head_dim;
  int max_pos;     // the last cache row: positions are clamped into the cache
  float qk_scale;  // scale * log2(e)
  int64_t tokens;  // B * Sq: the grid's x
  int splits;      // shares of a token's keys: the grid's y
};

// `stages`: 2, 3 or 4 tiles of 16 keys in flight a warp. decode_blocks_per_sm: the blocks of that kernel an SM of the
// current device holds (0 where it cannot run).
cudaError_t launch_decode(const DecodeParams& p, ScalarKind kind, int stages, cudaStream_t stream);
int decode_blocks_per_sm(ScalarKind kind, int head_dim, int stages);

}  // namespace cuda
}  // namespace dilated_attn
