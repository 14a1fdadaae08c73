// Argument checks shared by the launchers of every device. The Python layer (src/dilated_attn/spec.py)
// raises the spec's errors first; these keep a direct call of torch.ops.dilated_attn.* from reaching a
// kernel with arguments it cannot handle. TORCH_CHECK_VALUE / TORCH_CHECK_TYPE surface in Python as
// ValueError / TypeError.
//
// Messages with numbers, shapes, dtypes or devices are assembled as one string by message() before they reach
// TORCH_CHECK. c10::str would stream the numbers through this library's std::ostream, and a toolchain that links
// libstdc++ into the extension statically (a private GCC set as CXX can) leaves that stream's number facets unset
// in a process whose libstdc++ is the shared one: formatting an int there segfaults instead of raising.
#pragma once

#include <ATen/ATen.h>

#include <string>
#include <type_traits>
#include <vector>

#include "params.h"

namespace dilated_attn {

namespace message_parts {
inline std::string text(const char* s) { return s; }
inline std::string text(const std::string& s) { return s; }
template <typename T, std::enable_if_t<std::is_integral_v<T>, int> = 0>
std::string text(T x) {
  return std::to_string(x);
}
inline std::string text(at::IntArrayRef xs) {
  std::string s = "[";
  for (size_t i = 0; i < xs.size(); ++i) s += (i ? ", " : "") + std::to_string(xs[i]);
  return s + "]";
}
inline std::string text(at::ScalarType t) { return c10::toString(t); }
inline std::string text(const c10::Device& d) { return d.str(); }
}  // namespace message_parts

// The parts of an error message joined as text (see above): TORCH_CHECK_VALUE(cond, message("got ", n, " heads")).
template <typename... Parts>
std::string message(const Parts&... parts) {
  std::string s;
  (s += ... += message_parts::text(parts));
  return s;
}

inline void check_qkv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  TORCH_CHECK_VALUE(q.dim() == 4, message("q must be 4-D [batch, seq, heads, head_dim], got ", q.dim(), "-D"));
  TORCH_CHECK_VALUE(k.sizes() == v.sizes(),
                    message("k and v must have the same shape, got ", k.sizes(), " and ", v.sizes()));
  TORCH_CHECK_VALUE(k.dim() == 4, message("k must be 4-D [batch, seq, heads, head_dim], got ", k.dim(), "-D"));
  TORCH_CHECK_VALUE(k.size(0) == q.size(0) && k.size(1) == q.size(1) && k.size(3) == q.size(3),
                    message("k and v must match q in batch, seq and head_dim: q ", q.sizes(), ", k ", k.sizes()));
  TORCH_CHECK_VALUE(q.size(2) > 0 && k.size(2) > 0 && q.size(2) % k.size(2) == 0,
                    message("q heads must be a positive multiple of k/v heads, got ", q.size(2), " and ", k.size(2)));
  TORCH_CHECK_VALUE(q.size(3) > 0, "head_dim must be >= 1");
  TORCH_CHECK_VALUE(k.dtype() == q.dtype() && v.dtype() == q.dtype(), "q, k and v must share a dtype");
  TORCH_CHECK_VALUE(k.device() == q.device() && v.device() == q.device(), "q, k and v must share a device");
}

// The branches for num_heads query heads; with global_heads > 0 these are the heads [head_start, head_start +
// num_heads) of a problem of global_heads heads, with its offsets (localize_branch). Branches in which none of them
// takes part are left out (no launch covers zero heads).
inline std::vector<Branch> make_branch_table(at::IntArrayRef segment_lengths, at::IntArrayRef dilation_rates,
                                             int64_t num_heads, int64_t seq_len, bool split_heads,
                                             int64_t head_start = 0, int64_t global_heads = 0) {
  const int64_t total = global_heads > 0 ? global_heads : num_heads;
  TORCH_CHECK_VALUE(head_start >= 0 && head_start + num_heads <= total,
                    message("heads [", head_start, ", ", head_start + num_heads, ") are not heads of a problem of ",
                            total, " heads"));
  const int64_t m = static_cast<int64_t>(segment_lengths.size());
  TORCH_CHECK_VALUE(m >= 1, "segment_lengths must not be empty");
  TORCH_CHECK_VALUE(static_cast<int64_t>(dilation_rates.size()) == m,
                    message("segment_lengths and dilation_rates must have the same length, got ", m, " and ",
                            dilation_rates.size()));
  TORCH_CHECK_VALUE(!split_heads || total >= m, message("head_groups='split' needs at least one head per branch: ",
                                                        total, " heads < ", m, " branches"));
  std::vector<Branch> table;
  for (int64_t i = 0; i < m; ++i) {
    TORCH_CHECK_VALUE(segment_lengths[i] > 0, message("segment_lengths[", i, "] must be positive"));
    TORCH_CHECK_VALUE(dilation_rates[i] > 0, message("dilation_rates[", i, "] must be positive"));
    Branch br = make_branch(segment_lengths[i], dilation_rates[i], i, m, total, seq_len, split_heads);
    if (total != num_heads || head_start != 0) {
      TORCH_CHECK_VALUE(localize_branch(br, head_start, num_heads),
                        message("heads [", head_start, ", ", head_start + num_heads, ") of ", total,
                                " cannot run as one problem: branch ", i, " gives runs of ", br.offset_div,
                                " heads one offset, and the range starts inside a run and leaves it"));
      if (br.head_hi <= br.head_lo) continue;
    }
    table.push_back(br);
  }
  return table;
}

// A kernel reads rows with a contiguous last dim; other strides are free.
inline at::Tensor rows_contiguous(const at::Tensor& x) { return x.stride(-1) == 1 ? x : x.contiguous(); }

inline Strides strides_of(const at::Tensor& x) { return Strides{x.stride(0), x.stride(1), x.stride(2)}; }

inline at::ScalarType lse_dtype(at::ScalarType t) {
  return t == at::kDouble ? at::kDouble : at::kFloat;
}

}  // namespace dilated_attn
