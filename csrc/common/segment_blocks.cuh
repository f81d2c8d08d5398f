// Block skipping for segment ids (packed sequences): a pre-pass records each key block's smallest and largest kv
// segment id, and a tile walks only the key blocks whose id range meets the range of its own query rows' ids. Rows
// whose ids match no key of a visited block are masked score by score (sm80/score_tensors.cuh); the test is
// conservative, so unsorted ids stay correct and merely skip less.
#pragma once

#include <cuda_runtime.h>

#include <climits>
#include <cstdint>
#include <string>

#include "common/launch_util.h"
#include "common/params.h"

namespace jax_flash {

// (min, max) of ids[begin, end) over one warp: the lanes read consecutive ids (one 128-byte line per step, 4 steps
// in flight) and meet by shuffles.
__device__ __forceinline__ int2 warp_id_range(const int* ids, int begin, int end, int lane) {
  int lo = INT_MAX, hi = INT_MIN;
#pragma unroll 4
  for (int j = begin + lane; j < end; j += 32) {
    const int id = __ldg(ids + j);
    lo = min(lo, id);
    hi = max(hi, id);
  }
  for (int offset = 16; offset > 0; offset /= 2) {
    lo = min(lo, __shfl_xor_sync(0xffffffffu, lo, offset));
    hi = max(hi, __shfl_xor_sync(0xffffffffu, hi, offset));
  }
  return make_int2(lo, hi);
}

// The first and last of a row's key blocks whose (min, max) kv id range meets [lo, hi], over one warp: (first,
// last + 1), or (0, 0) when none does. (Plain loads: the ranges may come from the same kernel.)
__device__ __forceinline__ int2 warp_meeting_blocks(const int2* ranges, int key_blocks, int lo, int hi, int lane) {
  int first = INT_MAX, last = -1;
  for (int kb = lane; kb < key_blocks; kb += 32) {
    const int2 range = ranges[kb];
    if (range.x <= hi && range.y >= lo) {
      first = min(first, kb);
      last = max(last, kb);
    }
  }
  for (int offset = 16; offset > 0; offset /= 2) {
    first = min(first, __shfl_xor_sync(0xffffffffu, first, offset));
    last = max(last, __shfl_xor_sync(0xffffffffu, last, offset));
  }
  return last < 0 ? make_int2(0, 0) : make_int2(first, last + 1);
}

// One warp per (batch row, key block): (min, max) of kv_segment_ids[b, kb * block_kv ... ] into
// p.kv_block_segments[(b * key_blocks + kb) * 2 + {0, 1}] (a thread per block walking its 128 ids one dependent step
// at a time took 14 us for one row of 16384 keys, H200, longer than a tenth of the attention it prepares).
static __global__ void kv_block_segments_kernel(const AttentionParams p, int block_kv, int key_blocks) {
  const int64_t item = (int64_t{blockIdx.x} * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (item >= int64_t{p.batch} * key_blocks) return;  // (whole warps: blockDim.x is a multiple of 32)
  const int64_t b = item / key_blocks;
  const int kb = static_cast<int>(item % key_blocks);
  const int2 range = warp_id_range(p.kv_segment_ids + b * p.kv_segment_stride, kb * block_kv,
                                   min(p.seqlen_k, (kb + 1) * block_kv), lane);
  if (lane == 0) reinterpret_cast<int2*>(p.kv_block_segments)[item] = range;
}

__host__ __device__ inline int segment_key_blocks(const AttentionParams& p, int block_kv) {
  return (p.seqlen_k + block_kv - 1) / block_kv;
}

// Launches the pre-pass on `stream` when the call has segment ids and scratch for it (else nothing).
inline std::string launch_kv_block_segments(const AttentionParams& p, int block_kv, cudaStream_t stream) {
  if (p.kv_segment_ids == nullptr || p.kv_block_segments == nullptr || p.seqlen_k == 0) return {};
  const int key_blocks = segment_key_blocks(p, block_kv);
  const int64_t threads = int64_t{p.batch} * key_blocks * 32;
  constexpr int kThreads = 256;
  kv_block_segments_kernel<<<static_cast<unsigned>((threads + kThreads - 1) / kThreads), kThreads, 0, stream>>>(
      p, block_kv, key_blocks);
  if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) return cuda_failure("segment pre-pass launch", err);
  return {};
}

// One warp per (batch row, query block of block_q rows): the query block's (min, max) q segment id, and the first and
// last key block whose (min, max) kv range (the first pre-pass's) meets it, into p.q_block_segments as (first, last +
// 1, q_min, q_max); (0, 0, ...) when none does. Segment ids that are sorted (documents packed one after another) make
// the blocks in between exactly the ones to visit; unsorted ones visit a superset.
static __global__ void q_block_segments_kernel(const AttentionParams p, int block_q, int block_kv, int q_blocks) {
  const int64_t item = (int64_t{blockIdx.x} * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (item >= int64_t{p.batch} * q_blocks) return;  // (whole warps: blockDim.x is a multiple of 32)
  const int64_t b = item / q_blocks;
  const int qb = static_cast<int>(item % q_blocks);
  const int2 ids = warp_id_range(p.q_segment_ids + b * p.q_segment_stride, qb * block_q,
                                 min(p.seqlen_q, (qb + 1) * block_q), lane);
  const int key_blocks = segment_key_blocks(p, block_kv);
  const int2 blocks = warp_meeting_blocks(reinterpret_cast<const int2*>(p.kv_block_segments) + b * key_blocks,
                                          key_blocks, ids.x, ids.y, lane);
  if (lane == 0) reinterpret_cast<int4*>(p.q_block_segments)[item] = make_int4(blocks.x, blocks.y, ids.x, ids.y);
}

// Launches the second pre-pass (after launch_kv_block_segments, on the same stream) when the call has scratch for it.
inline std::string launch_q_block_segments(const AttentionParams& p, int block_q, int block_kv, cudaStream_t stream) {
  if (p.q_block_segments == nullptr || p.kv_block_segments == nullptr || p.seqlen_q == 0) return {};
  const int q_blocks = (p.seqlen_q + block_q - 1) / block_q;
  const int64_t threads = int64_t{p.batch} * q_blocks * 32;
  constexpr int kThreads = 256;
  q_block_segments_kernel<<<static_cast<unsigned>((threads + kThreads - 1) / kThreads), kThreads, 0, stream>>>(
      p, block_q, block_kv, q_blocks);
  if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) {
    return cuda_failure("segment pre-pass (query blocks) launch", err);
  }
  return {};
}

// The key blocks of [begin, end) that a tile visits, in order. Without segment ids (or pre-pass) and mask flags
// every block; with segment ids, the blocks whose (min, max) kv id range meets [q_min, q_max], the tile's query ids;
// with mask flags (common/mask_blocks.cuh), the blocks whose mask tile holds a nonzero entry. Lane i of the warp
// tests block base + i; the 32 answers are one ballot, so each warp holds the same bits and a refill costs one load
// per 32 blocks. Calls to following() must come with non-decreasing j.
struct VisibleBlocks {
  const int* ranges;  // this batch row's (min, max) per key block, or nullptr: no segment test
  int q_min, q_max;
  int end;
  int base = 0;
  unsigned bits = 0;                    // bit i: block base + i is visited
  const uint8_t* mask_flags = nullptr;  // the tile's mask-tile flag per key block, or nullptr: no mask test

  __device__ __forceinline__ void refill(int from, int lane) {
    base = from;
    const int kb = from + lane;
    bool visit = kb < end;
    if (visit && ranges != nullptr) {
      const int2 range = __ldg(reinterpret_cast<const int2*>(ranges) + kb);
      visit = range.x <= q_max && range.y >= q_min;
    }
    if (visit && mask_flags != nullptr) visit = __ldg(mask_flags + kb) != 0;
    bits = __ballot_sync(0xffffffffu, visit);
  }

  // Whether every valid row of the tile and every key of block j carry one and the same id, so no score of the
  // block needs the per-element test (inside a document of sorted ids, most blocks).
  __device__ __forceinline__ bool uniform(int j) const {
    if (ranges == nullptr || q_min != q_max) return false;
    const int2 range = __ldg(reinterpret_cast<const int2*>(ranges) + j);
    return range.x == q_min && range.y == q_min;
  }

  // The first visited block after j (end when none): j = begin - 1 gives the first of all.
  __device__ __forceinline__ int following(int j, int lane) {
    if (ranges == nullptr && mask_flags == nullptr) return j + 1;
    for (int next = j + 1; next < end;) {
      if (next < base || next >= base + 32) refill(next, lane);
      const unsigned rest = bits >> (next - base);
      if (rest != 0) return next + __ffs(rest) - 1;
      next = base + 32;
    }
    return end;
  }
};

}  // namespace jax_flash
