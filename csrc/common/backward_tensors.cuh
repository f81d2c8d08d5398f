// The backward kernels' per-score tensors (both families' P recomputation): segment ids, bias and mask tensors and
// ALiBi slopes (common/params.h), read from global memory (L1 / L2) or, for ALiBi, computed, one score at a time.
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "common/alibi.h"
#include "common/fragment_ops.cuh"
#include "common/params.h"
#include "common/visibility.h"

namespace jax_flash {

// ALiBi's exponent term for one item of (batch, query head): factor * |distance0 + d| for the score whose query is
// d positions further from its key than the thread's first score's (compile-time d in the kernels' fragment
// loops), so a score costs an FADD and an FFMA. Two conversions per score (its row and key to float) took the
// exponentials' MUFU-rate pipe three times as often and the sm90 backward to half the speed without ALiBi.
struct AlibiTerm {
  float factor = 0.0f;  // -log2(e) slope; 0 without ALiBi
  float distance0 = 0.0f;

  AlibiTerm() = default;
  // query - key + (kv_len - q_len) of the thread's first score: query row q_first, key k_first
  __device__ __forceinline__ AlibiTerm(const AttentionParams& p, int64_t batch, int64_t head, int q_first,
                                       int k_first, BatchLengths len) {
    if (p.bias != nullptr && p.alibi) {
      factor = -kLog2e * alibi_slope(p, batch, head);
      distance0 = static_cast<float>(q_first + len.kv_len - len.q_len - k_first);
    }
  }
  __device__ __forceinline__ float at(int d) const { return factor * fabsf(distance0 + static_cast<float>(d)); }
};

// Asks L2 for the bias tensor's entries of one item's tile, kRows query rows from q0 by kKeys keys from kv0 (rows and
// keys clamped inside the tensor), one 128-byte line (32 float32 keys) per thread and instruction. The kernels issue
// it with the item's Q / dO copies, an item ahead of its score loop, whose per-score loads then hit L2: without it
// each warp kept about two of them in flight (registers hold the accumulators), and a (1, N, T, S) bias read from
// memory ran at about 270 GB/s (H100, D = 128).
template <int kRows, int kKeys, int kThreads>
__device__ __forceinline__ void prefetch_bias_tile(const AttentionParams& p, int64_t batch, int64_t head, int q0,
                                                   int kv0, int tid) {
  if (p.bias == nullptr || p.alibi) return;
  constexpr int kLinesPerRow = (kKeys + 31) / 32, kLines = kRows * kLinesPerRow;
#pragma unroll
  for (int i = 0; i < (kLines + kThreads - 1) / kThreads; ++i) {
    const int line = tid + i * kThreads;
    if (kLines % kThreads != 0 && line >= kLines) break;
    const int64_t row = min(q0 + line / kLinesPerRow, p.seqlen_q - 1);
    const int64_t key = min(kv0 + (line % kLinesPerRow) * 32, p.seqlen_k - 1);
    const float* entry = p.bias + batch * p.bias_strides[0] + head * p.bias_strides[1] + row * p.bias_strides[2] +
                         key * p.bias_strides[3];
    asm volatile("prefetch.global.L2 [%0];\n" ::"l"(entry));
  }
}

// Query `row` and key `key` of (batch, query head), both clamped inside the tensors (a row or key past them is
// hidden by the caller's own mask): adds the bias tensor's entry (ALiBi: the caller's AlibiTerm) to `exponent`, in
// log2 units, and returns whether the mask or the segment ids hide the key (read only with `test_hidden`: the tile
// mixes visible and hidden scores, common/backward_blocks.cuh).
__device__ __forceinline__ bool apply_backward_tensors(const AttentionParams& p, int64_t batch, int64_t head,
                                                       int64_t row, int64_t key, bool test_hidden, float& exponent) {
  if (p.bias != nullptr && !p.alibi) {
    exponent += kLog2e * __ldg(p.bias + batch * p.bias_strides[0] + head * p.bias_strides[1] +
                               row * p.bias_strides[2] + key * p.bias_strides[3]);
  }
  bool hidden = false;
  if (!test_hidden) return hidden;
  if (p.mask != nullptr) {
    hidden = __ldg(p.mask + batch * p.mask_strides[0] + head * p.mask_strides[1] + row * p.mask_strides[2] +
                   key * p.mask_strides[3]) == 0;
  }
  if (p.q_segment_ids != nullptr) {
    hidden |= __ldg(p.q_segment_ids + batch * p.q_segment_stride + row) !=
              __ldg(p.kv_segment_ids + batch * p.kv_segment_stride + key);
  }
  return hidden;
}

// One work item of a backward thread block (query head, query block against its key block), as its score loop
// needs it: the kernels compile that loop with and without the per-score reads below and pick one per item.
struct ScoreItem {
  int64_t batch, head;
  int kv0, q0, lo_off, hi_off;  // first key and query; visible key - query offsets [lo_off, hi_off]
  bool whole;        // no score of the tile is hidden by the window, the lengths or the last key block's end
  bool test_hidden;  // the mask and segment ids need the per-score test (common/backward_blocks.cuh)
};

// Runs an item's score loop, loop(item, test_mask, reads) with both flags as std::bool_constant, in the copy the item
// needs: the window / lengths test where a score of its tile may be hidden (with kSplitMask; otherwise every item of
// a masked variant tests, through `whole` inside the loop), the tensors' reads where `reads`. A run-time `whole` test
// inside the loop compiled to a branch per score, which split the loop into blocks of one score each. The item the
// loop gets has `whole` fixed by the copy, so the loop's own test folds away.
template <bool kMask, bool kSplitMask, class Loop>
__device__ __forceinline__ void run_score_loop(const ScoreItem& item, bool reads, Loop&& loop) {
  auto run = [&](auto test_mask, auto with_reads) {
    ScoreItem it = item;
    if constexpr (kSplitMask) it.whole = !decltype(test_mask)::value;
    loop(it, test_mask, with_reads);
  };
  if (kMask && (!kSplitMask || !item.whole)) {
    if (reads) run(std::true_type{}, std::true_type{});
    else run(std::true_type{}, std::false_type{});
  } else {
    if (reads) run(std::false_type{}, std::true_type{});
    else run(std::false_type{}, std::false_type{});
  }
}

// Whether an item's scores need apply_backward_tensors: its tile mixes visible and hidden scores, or a bias tensor
// (not ALiBi's slopes) adds to every score.
__device__ __forceinline__ bool item_reads_tensors(const AttentionParams& p, bool test_hidden) {
  return test_hidden || (p.bias != nullptr && !p.alibi);
}

// One score of an item's P^T recomputation, both families: key row r and query column c of the item's tile (its
// own layout's), acc the raw q.k, lse2 the item's rows' lse in log2 units (by column), alibi_d the score's c - r
// beyond the thread's first score's (AlibiTerm::at; kTensors). Returns P = exp2(s log2(e) + bias - lse2), 0 where
// hidden (ALiBi's term zero without ALiBi); slope: ds/d(q.k).
template <bool kMask, bool kSoftcap, bool kTensors, bool kReads>
__device__ __forceinline__ float item_probability(const AttentionParams& p, BatchLengths len, const ScoreItem& it,
                                                  int r, int c, float acc, const float* lse2, const AlibiTerm& alibi,
                                                  int alibi_d, float cap_slope, float& slope) {
  float score = acc;
  slope = p.scale;
  if constexpr (kSoftcap) {
    const float t = tanhf(score * p.softcap_scale);
    score = p.softcap * t;
    slope = cap_slope * (1.0f - t * t);
  }
  float exponent = score * p.scale_log2 - lse2[c];
  bool hidden = false;
  if constexpr (kReads) {  // s += bias; hidden where the mask is 0 or the segment ids differ
    const int64_t key = min(it.kv0 + r, p.seqlen_k - 1), row = min(it.q0 + c, p.seqlen_q - 1);
    hidden = apply_backward_tensors(p, it.batch, it.head, row, key, it.test_hidden, exponent);
  }
  if constexpr (kTensors) exponent += alibi.at(alibi_d);
  float prob = hidden ? 0.0f : exp2_approx(exponent);
  if (kMask && !it.whole) {
    const int key = it.kv0 + r, row = it.q0 + c;
    // (| rather than ||: || through the item's fields compiled to a branch per score)
    if ((key >= len.kv_len) | (row >= len.q_len) | (key - row < it.lo_off) | (key - row > it.hi_off)) prob = 0.0f;
  }
  return prob;
}

}  // namespace jax_flash
