// Which keys a query row sees: the one definition of the masking semantics, used by the CPU implementation and the
// GPU kernels alike (host and device code).
#pragma once

#include <cstdint>

#include "common/params.h"

#if defined(__CUDACC__)
#define JAX_FLASH_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define JAX_FLASH_HOST_DEVICE inline
#endif

namespace jax_flash {

inline constexpr float kLog2e = 1.4426950408889634f;

struct BatchLengths {
  int q_len;   // query rows at or beyond this produce zeros
  int kv_len;  // keys at or beyond this are invisible
};

JAX_FLASH_HOST_DEVICE int clamp_length(int value, int limit) { return value < 0 ? 0 : (value > limit ? limit : value); }

JAX_FLASH_HOST_DEVICE BatchLengths batch_lengths(const AttentionParams& p, int64_t batch) {
  return {p.q_lengths ? clamp_length(p.q_lengths[batch], p.seqlen_q) : p.seqlen_q,
          p.kv_lengths ? clamp_length(p.kv_lengths[batch], p.seqlen_k) : p.seqlen_k};
}

// Keys [first, last] (inclusive; empty when first > last) visible to query row `row`:
//   row < q_len, j < kv_len, row + offset - window_left <= j <= row + offset + window_right, offset = kv_len - q_len.
struct KeyRange {
  int first, last;
};

JAX_FLASH_HOST_DEVICE KeyRange visible_keys(const AttentionParams& p, BatchLengths len, int64_t row) {
  if (row >= len.q_len) return {0, -1};
  const int64_t offset = static_cast<int64_t>(len.kv_len) - len.q_len;
  int64_t first = p.window_left >= kUnbounded ? 0 : row + offset - p.window_left;
  int64_t last = p.window_right >= kUnbounded ? int64_t{len.kv_len} - 1 : row + offset + p.window_right;
  if (first < 0) first = 0;
  if (last > len.kv_len - 1) last = len.kv_len - 1;
  if (first > last) return {0, -1};
  return {static_cast<int>(first), static_cast<int>(last)};
}

struct KeySpan {
  int begin, end;  // keys [begin, end)
};

// Keys [begin, end) that any row of [row_begin, row_end) may see (empty when begin >= end). Both
// bounds grow with the row, so the union spans from the first row's lower bound to the last row's upper bound.
JAX_FLASH_HOST_DEVICE KeySpan visible_keys_of_rows(const AttentionParams& p, BatchLengths len, int64_t row_begin,
                                                   int64_t row_end) {
  if (row_end > len.q_len) row_end = len.q_len;
  if (row_begin >= row_end) return {0, 0};
  const int64_t offset = static_cast<int64_t>(len.kv_len) - len.q_len;
  int64_t first = p.window_left >= kUnbounded ? 0 : row_begin + offset - p.window_left;
  int64_t end = p.window_right >= kUnbounded ? int64_t{len.kv_len} : row_end + offset + p.window_right;
  if (first < 0) first = 0;
  if (end > len.kv_len) end = len.kv_len;
  if (first >= end) return {0, 0};
  return {static_cast<int>(first), static_cast<int>(end)};
}

// Query blocks [begin, end) whose rows see a key of [kv_begin, kv_end) (the backward's walk; visible_keys inverted:
// row i sees key j when  j - hi_off <= i <= j - lo_off  and  i < q_len); in 64-bit, since the offsets may be
// +-kUnbounded.
struct QueryBlocks {
  int begin, end;
};

JAX_FLASH_HOST_DEVICE QueryBlocks query_blocks_seeing(const AttentionParams& p, BatchLengths len, int kv_begin,
                                                      int kv_end, int block_q) {
  if (kv_begin >= kv_end || len.q_len <= 0) return {0, 0};
  const int64_t diag = int64_t{len.kv_len} - len.q_len;
  const int64_t lo_off = p.window_left >= kUnbounded ? -int64_t{kUnbounded} * 4 : diag - p.window_left;
  const int64_t hi_off = p.window_right >= kUnbounded ? int64_t{kUnbounded} * 4 : diag + p.window_right;
  int64_t first = int64_t{kv_begin} - hi_off, last = int64_t{kv_end} - 1 - lo_off;
  if (first < 0) first = 0;
  if (last > len.q_len - 1) last = len.q_len - 1;
  if (first > last) return {0, 0};
  return {static_cast<int>(first / block_q), static_cast<int>(last / block_q) + 1};
}

}  // namespace jax_flash
