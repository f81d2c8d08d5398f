// Masks from tensors on the CPU path (common/params.h). Segment ids: the ids of one batch row, the range of ids a set
// of query rows or a key tile holds; a tile whose key ids cannot meet its rows' ids is skipped without its products,
// so a packed row costs about the sum of its documents. Bias and mask tensors: one query row's entries over the keys
// (strides 0 where broadcast).
#pragma once

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>

#include "common/alibi.h"
#include "common/params.h"

namespace jax_flash::cpu {

struct SegmentRange {
  int lo = INT_MAX, hi = INT_MIN;  // empty: lo > hi

  void add(int id) { lo = std::min(lo, id), hi = std::max(hi, id); }
  bool meets(const SegmentRange& other) const { return lo <= other.hi && other.lo <= hi; }
};

// Batch row b's ids: q (seq_q) and kv (seq_k), both nullptr without segments.
struct RowSegments {
  const int* q = nullptr;
  const int* kv = nullptr;

  RowSegments() = default;
  RowSegments(const AttentionParams& p, int64_t b) {
    if (p.q_segment_ids == nullptr) return;
    q = p.q_segment_ids + b * p.q_segment_stride;
    kv = p.kv_segment_ids + b * p.kv_segment_stride;
  }
  bool active() const { return q != nullptr; }
  SegmentRange keys(int64_t begin, int64_t end) const {
    SegmentRange range;
    for (int64_t j = begin; j < end; ++j) range.add(kv[j]);
    return range;
  }
};

// Row (b, h, i) of the bias and mask tensors: entry j of the keys. Absent tensors give nullptr rows. With ALiBi
// slopes (p.alibi) the row's bias is -slope |diagonal - j| (common/alibi.h) instead.
struct TensorRow {
  const float* bias = nullptr;
  const uint8_t* mask = nullptr;
  int64_t bias_step = 0, mask_step = 0;
  bool alibi = false;
  float neg_slope = 0.0f, diagonal = 0.0f;

  TensorRow() = default;
  TensorRow(const AttentionParams& p, int64_t b, int64_t h, int64_t i) {
    if (p.bias != nullptr && p.alibi) {
      alibi = true;
      neg_slope = -alibi_slope(p, b, h);
      diagonal = alibi_diagonal(static_cast<int>(i), batch_lengths(p, b));
    } else if (p.bias != nullptr) {
      bias = p.bias + b * p.bias_strides[0] + h * p.bias_strides[1] + i * p.bias_strides[2];
      bias_step = p.bias_strides[3];
    }
    if (p.mask != nullptr) {
      mask = p.mask + b * p.mask_strides[0] + h * p.mask_strides[1] + i * p.mask_strides[2];
      mask_step = p.mask_strides[3];
    }
  }
  // Adds the bias to s[begin, end) (keys col0 + begin ...) and sets the masked keys' scores to `masked`.
  void apply(float* s, int64_t col0, int begin, int end, float masked) const {
    if (alibi) {
      for (int j = begin; j < end; ++j) s[j] += neg_slope * std::fabs(diagonal - static_cast<float>(col0 + j));
    } else if (bias != nullptr) {
      for (int j = begin; j < end; ++j) s[j] += bias[(col0 + j) * bias_step];
    }
    if (mask != nullptr) {
      for (int j = begin; j < end; ++j) s[j] = mask[(col0 + j) * mask_step] ? s[j] : masked;
    }
  }
  // Whether any key of [begin, end) is unmasked.
  bool any_visible(int64_t begin, int64_t end) const {
    if (mask == nullptr) return begin < end;
    for (int64_t j = begin; j < end; ++j) {
      if (mask[j * mask_step]) return true;
    }
    return false;
  }
};

}  // namespace jax_flash::cpu
