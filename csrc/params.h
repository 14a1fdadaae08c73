// Plain parameter structs shared by every kernel family: pointers, strides, sizes and the branch table.
// No ATen here, so kernel files that include only this header compile without torch.
#pragma once

#include <cstdint>

// Members used by CUDA kernels too are callable on host and device.
#ifdef __CUDACC__
#define DA_HOST_DEVICE __host__ __device__
#else
#define DA_HOST_DEVICE
#endif

namespace dilated_attn {

// One branch (w, r) of the spec (docs/SPEC.md) resolved for a sequence length and head count.
// Query head h takes part iff head_lo <= h < head_hi and then uses offset
// offset_base + (h - head_lo) / offset_div:
//   head_groups="all":   every head, offset h / ceil(Hq / r)
//   head_groups="split": the i-th of m contiguous head groups, offset i % r
struct Branch {
  int64_t seg_len;   // s = min(w, N)
  int64_t dilation;  // r
  int64_t head_lo, head_hi;
  int64_t offset_div, offset_base;

  DA_HOST_DEVICE inline int64_t offset(int64_t head) const { return offset_base + (head - head_lo) / offset_div; }
  DA_HOST_DEVICE inline int64_t num_segments(int64_t seq_len) const { return (seq_len + seg_len - 1) / seg_len; }
  // Largest member count of a segment (offset 0, full segment).
  DA_HOST_DEVICE inline int64_t max_members() const { return (seg_len + dilation - 1) / dilation; }
  // Members of segment `seg` for a head with offset `off`: positions seg*s + off + r*j, j < count.
  DA_HOST_DEVICE inline int64_t members(int64_t seq_len, int64_t seg, int64_t off) const {
    int64_t start = seg * seg_len;
    int64_t len = seq_len - start < seg_len ? seq_len - start : seg_len;
    return off < len ? (len - off + dilation - 1) / dilation : 0;
  }
};

inline Branch make_branch(int64_t w, int64_t r, int64_t index, int64_t num_branches, int64_t num_heads,
                          int64_t seq_len, bool split_heads) {
  Branch b;
  b.seg_len = w < seq_len ? w : seq_len;
  if (b.seg_len < 1) b.seg_len = 1;  // seq_len == 0: no segment is ever visited
  b.dilation = r;
  if (!split_heads) {
    b.head_lo = 0;
    b.head_hi = num_heads;
    b.offset_div = (num_heads + r - 1) / r;
    b.offset_base = 0;
  } else {
    int64_t base = num_heads / num_branches, extra = num_heads % num_branches;
    b.head_lo = index * base + (index < extra ? index : extra);
    b.head_hi = b.head_lo + base + (index < extra ? 1 : 0);
    b.offset_div = num_heads;  // >= group size: every head of the group gets offset_base
    b.offset_base = index % r;
  }
  return b;
}

// `b` restricted to the heads [head_start, head_start + num_heads) of its problem, renumbered from 0 with their
// offsets kept (a rank's share in the head-parallel ring modes). Returns false where the Branch form cannot hold
// it: the range starts inside a run of heads sharing an offset and leaves that run. An empty result
// (head_lo == head_hi) means no head of the range takes part.
inline bool localize_branch(Branch& b, int64_t head_start, int64_t num_heads) {
  const int64_t lo = b.head_lo > head_start ? b.head_lo : head_start;
  const int64_t end = head_start + num_heads, hi = b.head_hi < end ? b.head_hi : end;
  if (lo >= hi) {
    b.head_lo = b.head_hi = 0;
    return true;
  }
  const int64_t into_run = (lo - b.head_lo) % b.offset_div;
  const int64_t base = b.offset(lo);
  if (into_run != 0) {
    if (hi - lo > b.offset_div - into_run) return false;
    b.offset_div = num_heads;  // one offset for every head of the range
  }
  b.head_lo = lo - head_start;
  b.head_hi = hi - head_start;
  b.offset_base = base;
  return true;
}

// A [batch, seq, heads, head_dim] tensor whose last dim is contiguous.
struct Strides {
  int64_t batch, seq, head;
};

struct AttentionShape {
  int64_t batch, seq_len, num_heads, num_kv_heads, head_dim;
  bool causal;
  double scale;
  DA_HOST_DEVICE inline int64_t kv_head(int64_t head) const { return head / (num_heads / num_kv_heads); }
};

}  // namespace dilated_attn
