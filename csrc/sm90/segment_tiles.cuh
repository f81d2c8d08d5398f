// The sm90 forward's tiles for segment ids (packed sequences): one pre-pass block per batch row records each key
// block's (min, max) kv id (common/segment_blocks.cuh's first pass) and the row's tiles (common/params.h,
// segment_tiles):
//  - document tiles where the row's ids are sorted and the same for queries and keys (documents packed one after
//    another, self-attention): a tile starts at a document's first row, or block_q rows after the tile before it,
//    and holds only that document's rows; its key blocks start at the document's first key. No tile or key block
//    then spans two documents, and a packed row costs the sum of its documents, as unpacked ones would (the fixed
//    128 x 128 grid computes 1.11x the blocks for documents of geometric lengths with mean 512);
//  - otherwise the query blocks of block_q rows and the key blocks whose id range meets theirs (unsorted ids, other
//    query ids than key ids, cross-attention, lengths, split key ranges, paged K / V, bias or mask tensors).
#pragma once

#include <cuda_runtime.h>

#include <climits>
#include <cstdint>
#include <string>

#include "common/launch_util.h"
#include "common/params.h"
#include "common/segment_blocks.cuh"  // warp_id_range, warp_meeting_blocks
#include "sm90/segment_tiles.h"

namespace jax_flash::sm90 {

// Whether a call may run document tiles at all (each row then checks its ids): the tile's keys are its document's,
// so every other bound must be the same for queries and keys.
inline bool may_run_document_tiles(const AttentionParams& p) {
  return p.seqlen_q == p.seqlen_k && p.q_lengths == nullptr && p.kv_lengths == nullptr && p.num_splits == 1 &&
         p.page_table == nullptr && p.pack_gqa == 1 && p.bias == nullptr && p.mask == nullptr;
}

namespace segment_tiles_detail {

constexpr int kThreads = 1024;
constexpr int kWarps = kThreads / 32;
constexpr int kBatch = 8;  // ids per thread in flight

// Block-wide exclusive scan of one int per thread under `op` (identity `none`), and the block's total through
// `total` (every thread). `shared`: kWarps ints.
template <class Op>
__device__ __forceinline__ int exclusive_scan(int value, int none, Op op, int* shared, int& total) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  int inclusive = value;
  for (int offset = 1; offset < 32; offset *= 2) {
    const int other = __shfl_up_sync(0xffffffffu, inclusive, offset);
    if (lane >= offset) inclusive = op(inclusive, other);
  }
  __syncthreads();  // (shared may still be read by a previous scan)
  if (lane == 31) shared[warp] = inclusive;
  __syncthreads();
  if (warp == 0) {
    int w = shared[lane];  // (kWarps == 32)
    for (int offset = 1; offset < 32; offset *= 2) {
      const int other = __shfl_up_sync(0xffffffffu, w, offset);
      if (lane >= offset) w = op(w, other);
    }
    shared[lane] = w;  // inclusive over warps 0 .. lane
  }
  __syncthreads();
  const int before_warp = warp > 0 ? shared[warp - 1] : none;
  total = shared[kWarps - 1];
  const int before_lane = __shfl_up_sync(0xffffffffu, inclusive, 1);
  return op(before_warp, lane > 0 ? before_lane : none);
}

// The first row after `row` whose id is larger than ids[row] (ids sorted): the end of row's document.
__device__ __forceinline__ int document_end(const int* ids, int row, int n) {
  const int id = __ldg(ids + row);
  int lo = row + 1, hi = n;
  while (lo < hi) {
    const int mid = lo + (hi - lo) / 2;
    if (__ldg(ids + mid) > id) {
      hi = mid;
    } else {
      lo = mid + 1;
    }
  }
  return lo;
}

}  // namespace segment_tiles_detail

// One block of kThreads per batch row (see the file comment). Each thread walks a contiguous chunk of the row's
// positions; block scans carry the document start into each chunk and number the tiles.
static __global__ void __launch_bounds__(segment_tiles_detail::kThreads)
    segment_tiles_kernel(const AttentionParams p, int block_q, int block_kv, int key_blocks, int slots,
                         bool documents) {
  using namespace segment_tiles_detail;
  __shared__ int shared[kWarps];
  const int64_t b = blockIdx.x;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int* q_ids = p.q_segment_ids + b * p.q_segment_stride;
  const int* kv_ids = p.kv_segment_ids + b * p.kv_segment_stride;
  int2* ranges = reinterpret_cast<int2*>(p.kv_block_segments) + b * key_blocks;
  SegmentTile* tiles = reinterpret_cast<SegmentTile*>(p.segment_tiles) + b * slots;
  const int n = p.seqlen_q;

  // Document tiles: this thread's chunk [begin, end) of the row, read kBatch ids at a time (the loads of a batch
  // issued together: one after the other, a dependent memory latency each, one block walking 16384 ids took 30 us).
  // Are the ids sorted and the same for queries and keys? Where does the chunk's first and last document start,
  // and how many tiles start in it from its first document start on?
  const int chunk = (n + kThreads - 1) / kThreads;
  const int begin = min(n, static_cast<int>(threadIdx.x) * chunk), end = min(n, begin + chunk);
  bool fits = documents;
  int first_start = end, last_start = -1, local_tiles = 0;
  if (documents) {
    int prev = begin > 0 ? __ldg(q_ids + begin - 1) : INT_MIN, start = -1;
    for (int i0 = begin; i0 < end; i0 += kBatch) {
      int q[kBatch], kv[kBatch];
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        q[u] = i0 + u < end ? __ldg(q_ids + i0 + u) : 0;
        kv[u] = i0 + u < end ? __ldg(kv_ids + i0 + u) : 0;
      }
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const int i = i0 + u;
        if (i >= end) break;
        fits = fits & (q[u] >= prev) & (q[u] == kv[u]);
        if (i == 0 || q[u] != prev) {
          first_start = min(first_start, i);
          last_start = start = i;
        }
        local_tiles += start >= 0 && (i - start) % block_q == 0 ? 1 : 0;
        prev = q[u];
      }
    }
  }
  fits = __syncthreads_and(fits);
  int count = 0;  // this row's tiles
  if (fits) {
    int unused;  // the document start at the chunk's entry: the last start of the chunks before it
    const int start_in = exclusive_scan(last_start, -1, [](int a, int c) { return max(a, c); }, shared, unused);
    // tiles in [begin, first_start), of the document that started at start_in: rows start_in + k block_q
    const int lead =
        first_start > begin ? (first_start - 1 - start_in) / block_q - (begin - 1 - start_in) / block_q : 0;
    int index = exclusive_scan(lead + local_tiles, 0, [](int a, int c) { return a + c; }, shared, count);
    if (count <= slots) {  // (uniform: count is the block's total) the tiles, each with its document's end
      int start = start_in, prev = begin > 0 ? __ldg(q_ids + begin - 1) : INT_MIN;
      for (int i0 = begin; i0 < end; i0 += kBatch) {
        int q[kBatch];
#pragma unroll
        for (int u = 0; u < kBatch; ++u) q[u] = i0 + u < end ? __ldg(q_ids + i0 + u) : 0;
#pragma unroll
        for (int u = 0; u < kBatch; ++u) {
          const int i = i0 + u;
          if (i >= end) break;
          if (i == 0 || q[u] != prev) start = i;
          prev = q[u];
          if ((i - start) % block_q == 0) {
            const int doc_end = document_end(q_ids, i, n);
            tiles[index++] = SegmentTile{0, 0, q[u], q[u], i, min(block_q, doc_end - i), start, doc_end};
          }
        }
      }
    }
  }
  if (!fits || count > slots) {  // query blocks of block_q rows and their key blocks (document tiles need neither)
    for (int kb = warp; kb < key_blocks; kb += kWarps) {  // each key block's (min, max) kv id, a warp per block
      const int2 range = warp_id_range(kv_ids, kb * block_kv, min(p.seqlen_k, (kb + 1) * block_kv), lane);
      if (lane == 0) ranges[kb] = range;
    }
    __syncthreads();  // (the ranges written: a warp per query block reads them all)
    count = (n + block_q - 1) / block_q;
    for (int qb = warp; qb < count; qb += kWarps) {
      const int2 ids = warp_id_range(q_ids, qb * block_q, min(n, (qb + 1) * block_q), lane);
      const int2 blocks = warp_meeting_blocks(ranges, key_blocks, ids.x, ids.y, lane);
      if (lane == 0) {
        tiles[qb] = SegmentTile{blocks.x, blocks.y, ids.x, ids.y, qb * block_q, min(block_q, n - qb * block_q), -1, 0};
      }
    }
  }
  for (int e = count + static_cast<int>(threadIdx.x); e < slots; e += kThreads) tiles[e] = SegmentTile{};
  if (threadIdx.x == 0) atomicMax(p.segment_tile_count, count);
}

// Zeroes the tile count and launches the pre-pass on `stream` (nothing without segment ids or their scratch).
inline std::string launch_segment_tiles(const AttentionParams& p, int block_q, int block_kv, cudaStream_t stream) {
  if (p.segment_tiles == nullptr || p.kv_block_segments == nullptr || p.seqlen_q == 0 || p.seqlen_k == 0) return {};
  if (cudaError_t err = cudaMemsetAsync(p.segment_tile_count, 0, sizeof(int), stream); err != cudaSuccess) {
    return cuda_failure("cudaMemsetAsync(segment tile count)", err);
  }
  const int key_blocks = (p.seqlen_k + block_kv - 1) / block_kv;
  segment_tiles_kernel<<<static_cast<unsigned>(p.batch), segment_tiles_detail::kThreads, 0, stream>>>(
      p, block_q, block_kv, key_blocks, p.segment_tile_slots, may_run_document_tiles(p));
  if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) {
    return cuda_failure("segment tile pre-pass launch", err);
  }
  return {};
}

}  // namespace jax_flash::sm90
