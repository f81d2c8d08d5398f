// Checks both handlers run on their buffers before touching memory (Python validated first; this is the second
// line, for callers that reach the custom call another way), and the AttentionParams built from valid buffers.
#pragma once

#include <cmath>
#include <cstdint>
#include <optional>
#include <string>

#include "common/params.h"
#include "xla/ffi/api/ffi.h"

namespace jax_flash {

namespace ffi = ::xla::ffi;

inline std::string dims_string(ffi::AnyBuffer::Dimensions dims) {
  std::string s = "(";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + ")";
}

inline ffi::Error invalid(const std::string& message) {
  return ffi::Error(ffi::ErrorCode::kInvalidArgument, "jax_flash: " + message);
}

// q (B, Sq, Hq, D), k and v (B, Sk, Hk, D), o like q; one dtype; Hq % Hk == 0; sizes fit the int32 size fields.
inline std::optional<ffi::Error> check_buffers(const ffi::AnyBuffer& q, const ffi::AnyBuffer& k,
                                               const ffi::AnyBuffer& v, const ffi::AnyBuffer& o, float scale) {
  const auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions(), od = o.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || vd.size() != 4 || od.size() != 4) {
    return invalid("q, k, v and the output must have rank 4 (batch, seq, heads, head_dim); got q " +
                   dims_string(qd) + ", k " + dims_string(kd) + ", v " + dims_string(vd));
  }
  if (k.element_type() != q.element_type() || v.element_type() != q.element_type() ||
      o.element_type() != q.element_type()) {
    return invalid("q, k, v and the output must share one dtype");
  }
  for (int i = 0; i < 4; ++i) {
    if (kd[i] != vd[i]) return invalid("k " + dims_string(kd) + " and v " + dims_string(vd) + " must match");
    if (od[i] != qd[i]) return invalid("output " + dims_string(od) + " must match q " + dims_string(qd));
  }
  if (kd[0] != qd[0] || kd[3] != qd[3]) {
    return invalid("k " + dims_string(kd) + " must share batch and head_dim with q " + dims_string(qd));
  }
  if (kd[2] == 0 ? qd[2] != 0 : qd[2] % kd[2] != 0) {
    return invalid("q heads (" + std::to_string(qd[2]) + ") must be a multiple of k heads (" +
                   std::to_string(kd[2]) + ")");
  }
  for (int64_t n : {qd[0], qd[1], qd[2], qd[3], kd[1], kd[2]}) {
    if (n > INT32_MAX) return invalid("a dimension above 2^31-1 is not supported: q " + dims_string(qd));
  }
  if (!std::isfinite(scale)) return invalid("softmax_scale must be finite, got " + std::to_string(scale));
  return std::nullopt;
}

inline AttentionParams params_from_buffers(const ffi::AnyBuffer& q, const ffi::AnyBuffer& k,
                                           const ffi::AnyBuffer& v, ffi::AnyBuffer& o, float scale) {
  const auto qd = q.dimensions(), kd = k.dimensions();
  return make_contiguous_params(q.untyped_data(), k.untyped_data(), v.untyped_data(), o.untyped_data(),
                                static_cast<int>(qd[0]), static_cast<int>(qd[1]), static_cast<int>(kd[1]),
                                static_cast<int>(qd[2]), static_cast<int>(kd[2]), static_cast<int>(qd[3]), scale);
}

}  // namespace jax_flash
