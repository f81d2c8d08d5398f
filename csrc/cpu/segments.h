// Segment ids on the CPU path (common/params.h): the ids of one batch row, the range of ids a set of query rows or a
// key tile holds, and the per-score test. A tile whose key ids cannot meet its rows' ids is skipped without its
// products: a packed row then costs about the sum of its documents.
#pragma once

#include <algorithm>
#include <climits>
#include <cstdint>

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

}  // namespace jax_flash::cpu
