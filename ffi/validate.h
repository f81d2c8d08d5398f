// Checks both handlers run on their buffers before touching memory (Python validated first; this is the second
// line, for callers that reach the custom call another way), and the AttentionParams built from valid buffers.
#pragma once

#include <cmath>
#include <cstdint>
#include <optional>
#include <tuple>
#include <utility>
#include <string>

#include "common/params.h"
#include "common/split_plan.h"
#include "ffi/attention_attrs.h"
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

// q (B, Sq, Hq, D), k and v (B, Sk, Hk, D) or, paged, (num_pages, page_size, Hk, D) with page_table int32
// (B, pages_per_seq); o like q; one dtype; Hq % Hk == 0; sizes fit the int32 size fields; lengths int32 (B); lse
// float32 (B, Hq, Sq); finite scale, softcap >= 0, windows >= -1; pack_gqa 0 or 1, num_splits in [0, 128].
inline std::optional<ffi::Error> check_buffers(const ffi::AnyBuffer& q, const ffi::AnyBuffer& k,
                                               const ffi::AnyBuffer& v, const ffi::AnyBuffer& q_lengths,
                                               const ffi::AnyBuffer& kv_lengths, const ffi::AnyBuffer* page_table,
                                               const ffi::AnyBuffer& o, const ffi::AnyBuffer& lse,
                                               const AttentionAttrs& attrs) {
  const float scale = attrs.softmax_scale;
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
  if ((!attrs.paged && kd[0] != qd[0]) || kd[3] != qd[3]) {
    return invalid("k " + dims_string(kd) + " must share batch and head_dim with q " + dims_string(qd));
  }
  if (kd[2] == 0 ? qd[2] != 0 : qd[2] % kd[2] != 0) {
    return invalid("q heads (" + std::to_string(qd[2]) + ") must be a multiple of k heads (" +
                   std::to_string(kd[2]) + ")");
  }
  for (int64_t n : {qd[0], qd[1], qd[2], qd[3], kd[0], kd[1], kd[2]}) {
    if (n > INT32_MAX) return invalid("a dimension above 2^31-1 is not supported: q " + dims_string(qd));
  }
  if (attrs.paged && page_table == nullptr) return invalid("paged K/V have no backward pass");
  if (attrs.paged) {
    const auto pd = page_table->dimensions();
    if (page_table->element_type() != ffi::DataType::S32 || pd.size() != 2 || pd[0] != qd[0]) {
      return invalid("page_table must be int32 of shape (batch, pages_per_seq) with batch = " +
                     std::to_string(qd[0]) + "; got " + dims_string(pd));
    }
    if (kd[1] % 8 != 0 || kd[1] == 0) {
      return invalid("the page size (k's dimension 1) must be a positive multiple of 8, got " + std::to_string(kd[1]));
    }
    if (pd[1] * kd[1] > INT32_MAX) {
      return invalid("pages_per_seq x page_size = " + std::to_string(pd[1] * kd[1]) + " keys exceeds 2^31-1");
    }
  }
  if (!std::isfinite(scale)) return invalid("softmax_scale must be finite, got " + std::to_string(scale));
  if (!(attrs.softcap >= 0.0f) || !std::isfinite(attrs.softcap)) {
    return invalid("softcap must be a finite number >= 0 (0 = off), got " + std::to_string(attrs.softcap));
  }
  if (attrs.window_left < -1 || attrs.window_right < -1) {
    return invalid("window sizes must be >= -1 (-1 = unbounded), got (" + std::to_string(attrs.window_left) + ", " +
                   std::to_string(attrs.window_right) + ")");
  }
  if (attrs.pack_gqa != 0 && attrs.pack_gqa != 1) {
    return invalid("pack_gqa must be 0 or 1 when the call runs (jax_flash resolves None), got " +
                   std::to_string(attrs.pack_gqa));
  }
  if (attrs.num_splits < 0 || attrs.num_splits > kMaxSplits) {
    return invalid("num_splits must be in [0, " + std::to_string(kMaxSplits) + "] (0 = chosen per call), got " +
                   std::to_string(attrs.num_splits));
  }
  // A length operand that is not read (has_q_lengths / has_kv_lengths 0) may be empty: jax_flash passes (0,).
  for (auto [lengths, given] :
       {std::pair{&q_lengths, attrs.has_q_lengths}, std::pair{&kv_lengths, attrs.has_kv_lengths}}) {
    const auto ld = lengths->dimensions();
    if (lengths->element_type() != ffi::DataType::S32 || ld.size() != 1 || (ld[0] != qd[0] && (given || ld[0] != 0))) {
      return invalid("q_lengths and kv_lengths must be int32 of shape (batch,) = (" + std::to_string(qd[0]) +
                     ",), or (0,) when not given; got " + dims_string(ld));
    }
  }
  const auto sd = lse.dimensions();
  if (lse.element_type() != ffi::DataType::F32 || sd.size() != 3 || sd[0] != qd[0] || sd[1] != qd[2] ||
      sd[2] != qd[1]) {
    return invalid("lse must be float32 of shape (batch, heads_q, seq_q); got " + dims_string(sd));
  }
  return std::nullopt;
}

// The backward's buffers beyond the forward's (checked by check_buffers with out as o): d_out and dq like q,
// d_lse float32 like lse, dk and dv like k; no paged K/V.
inline std::optional<ffi::Error> check_backward_buffers(const ffi::AnyBuffer& q, const ffi::AnyBuffer& k,
                                                        const ffi::AnyBuffer& d_out, const ffi::AnyBuffer& d_lse,
                                                        const ffi::AnyBuffer& lse, const ffi::AnyBuffer& dq,
                                                        const ffi::AnyBuffer& dk, const ffi::AnyBuffer& dv) {
  auto same = [](const ffi::AnyBuffer& a, const ffi::AnyBuffer& b) {
    if (a.element_type() != b.element_type() || a.dimensions().size() != b.dimensions().size()) return false;
    for (size_t i = 0; i < a.dimensions().size(); ++i) {
      if (a.dimensions()[i] != b.dimensions()[i]) return false;
    }
    return true;
  };
  if (!same(d_out, q) || !same(dq, q)) {
    return invalid("d_out and dq must match q " + dims_string(q.dimensions()) + "; got " +
                   dims_string(d_out.dimensions()) + " and " + dims_string(dq.dimensions()));
  }
  if (!same(dk, k) || !same(dv, k)) return invalid("dk and dv must match k " + dims_string(k.dimensions()));
  if (!same(d_lse, lse)) return invalid("d_lse must match lse " + dims_string(lse.dimensions()));
  return std::nullopt;
}

// The params of valid buffers; num_splits and pack_gqa as the attributes give them (the handlers resolve 0 / 1).
// Segment ids: int32 (batch, seq_q) and (batch, seq_k), or both (batch, 0) for none; seq_k is the logical key length
// (pages_per_seq x page_size when paged: AttentionParams::seqlen_k).
inline std::optional<ffi::Error> check_segment_buffers(const ffi::AnyBuffer& q, int64_t seq_k,
                                                       const ffi::AnyBuffer& q_segment_ids,
                                                       const ffi::AnyBuffer& kv_segment_ids) {
  const auto qd = q.dimensions();
  const auto qs = q_segment_ids.dimensions(), ks = kv_segment_ids.dimensions();
  const bool ranked = qs.size() == 2 && ks.size() == 2;
  const bool none = ranked && qs[1] == 0 && ks[1] == 0;
  const bool shaped = ranked && qs[1] == qd[1] && ks[1] == seq_k;
  if (q_segment_ids.element_type() != ffi::DataType::S32 || kv_segment_ids.element_type() != ffi::DataType::S32 ||
      (!none && !shaped) || qs[0] != qd[0] || ks[0] != qd[0]) {
    return invalid("q_segment_ids and kv_segment_ids must be int32 of shapes (batch, seq_q) and (batch, seq_k) = (" +
                   std::to_string(qd[0]) + ", " + std::to_string(qd[1]) + ") and (" + std::to_string(qd[0]) + ", " +
                   std::to_string(seq_k) + "), or both (batch, 0); got " + dims_string(qs) + " and " +
                   dims_string(ks));
  }
  return std::nullopt;
}

// Sets the segment fields from buffers check_segment_buffers accepted ((batch, 0): none).
inline void set_segments(AttentionParams& p, const ffi::AnyBuffer& q_segment_ids,
                         const ffi::AnyBuffer& kv_segment_ids) {
  const auto qs = q_segment_ids.dimensions(), ks = kv_segment_ids.dimensions();
  if (qs[1] == 0 && ks[1] == 0) return;
  p.q_segment_ids = static_cast<const int*>(q_segment_ids.untyped_data());
  p.kv_segment_ids = static_cast<const int*>(kv_segment_ids.untyped_data());
  p.q_segment_stride = qs[1];
  p.kv_segment_stride = ks[1];
}

// Bias (float32) and mask (bool) tensors: rank 4, each dimension of (batch, heads_q, seq_q, seq_k) full or 1, or
// of shape (0, 0, 0, 0) for none; seq_k is the logical key length. With alibi the bias holds the ALiBi slopes,
// (batch or 1, heads_q or 1, 1, 1).
inline std::optional<ffi::Error> check_tensor_buffers(const ffi::AnyBuffer& q, int64_t seq_k, const ffi::AnyBuffer& bias,
                                                      const ffi::AnyBuffer& mask, bool alibi) {
  const auto qd = q.dimensions();
  if (alibi) {
    const auto d = bias.dimensions();
    if (bias.element_type() != ffi::DataType::F32 || d.size() != 4 || (d[0] != qd[0] && d[0] != 1) ||
        (d[1] != qd[2] && d[1] != 1) || d[2] != 1 || d[3] != 1) {
      return invalid("alibi: the ALiBi slopes must be float32 of shape (batch or 1, heads_q or 1, 1, 1) with "
                     "(batch, heads_q) = (" + std::to_string(qd[0]) + ", " + std::to_string(qd[2]) + "); got " +
                     dims_string(d));
    }
  }
  const int64_t full[4] = {qd[0], qd[2], qd[1], seq_k};
  for (const auto& [buffer, name, type] : {std::tuple{&bias, "bias", ffi::DataType::F32},
                                           std::tuple{&mask, "mask", ffi::DataType::PRED}}) {
    const auto d = buffer->dimensions();
    bool ok = buffer->element_type() == type && d.size() == 4;
    const bool none = ok && d[0] == 0 && d[1] == 0 && d[2] == 0 && d[3] == 0;
    for (int i = 0; ok && !none && i < 4; ++i) ok = d[i] == full[i] || d[i] == 1;
    if (!ok) {
      return invalid(std::string(name) + " must be " + (type == ffi::DataType::F32 ? "float32" : "bool") +
                     " of rank 4 with each dimension of (batch, heads_q, seq_q, seq_k) = (" +
                     std::to_string(full[0]) + ", " + std::to_string(full[1]) + ", " + std::to_string(full[2]) +
                     ", " + std::to_string(full[3]) + ") or 1, or (0, 0, 0, 0) for none; got " + dims_string(d));
    }
  }
  return std::nullopt;
}

// Sets the bias and mask fields (and alibi: the bias holds ALiBi slopes) from buffers check_tensor_buffers accepted.
inline void set_tensors(AttentionParams& p, const ffi::AnyBuffer& bias, const ffi::AnyBuffer& mask, bool alibi) {
  p.alibi = alibi ? 1 : 0;
  auto strides = [](const auto& d, int64_t* out) {  // row-major, 0 where broadcast
    int64_t stride = 1;
    for (int i = 3; i >= 0; --i) {
      out[i] = d[i] == 1 ? 0 : stride;
      stride *= d[i];
    }
  };
  if (bias.dimensions()[0] != 0) {
    p.bias = static_cast<const float*>(bias.untyped_data());
    strides(bias.dimensions(), p.bias_strides);
  }
  if (mask.dimensions()[0] != 0) {
    p.mask = static_cast<const uint8_t*>(mask.untyped_data());
    strides(mask.dimensions(), p.mask_strides);
  }
}

inline AttentionParams params_from_buffers(const ffi::AnyBuffer& q, const ffi::AnyBuffer& k,
                                           const ffi::AnyBuffer& v, const ffi::AnyBuffer& q_lengths,
                                           const ffi::AnyBuffer& kv_lengths, const ffi::AnyBuffer* page_table,
                                           const ffi::AnyBuffer& o, const ffi::AnyBuffer& lse,
                                           const AttentionAttrs& attrs) {
  const auto qd = q.dimensions(), kd = k.dimensions();
  AttentionParams p = make_contiguous_params(
      q.untyped_data(), k.untyped_data(), v.untyped_data(), o.untyped_data(), static_cast<int>(qd[0]),
      static_cast<int>(qd[1]), static_cast<int>(kd[1]), static_cast<int>(qd[2]), static_cast<int>(kd[2]),
      static_cast<int>(qd[3]), attrs.softmax_scale);
  set_features(p, attrs.causal != 0, attrs.window_left, attrs.window_right, attrs.softcap,
               attrs.has_q_lengths ? static_cast<const int*>(q_lengths.untyped_data()) : nullptr,
               attrs.has_kv_lengths ? static_cast<const int*>(kv_lengths.untyped_data()) : nullptr,
               attrs.return_lse ? static_cast<float*>(lse.untyped_data()) : nullptr);
  if (attrs.paged && page_table != nullptr) {  // k (num_pages, page_size, Hk, D): its "batch stride" is one page
    set_pages(p, static_cast<const int*>(page_table->untyped_data()), static_cast<int>(page_table->dimensions()[1]),
              static_cast<int>(kd[1]), static_cast<int>(kd[0]));
  }
  p.pack_gqa = attrs.pack_gqa == 1 ? p.q_heads_per_kv_head : 1;
  p.num_splits = static_cast<int>(attrs.num_splits);
  return p;
}

}  // namespace jax_flash
