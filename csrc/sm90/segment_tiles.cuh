// The sm90 forward's tiles for segment ids (packed sequences). A pre-pass of two kernels, a block per chunk of
// kSegmentChunk positions of a batch row, records each key block's (min, max) kv id (common/segment_blocks.cuh's
// first pass) and the row's tiles (common/params.h, segment_tiles):
//  - document tiles where the row's ids are sorted and the same for queries and keys (documents packed one after
//    another, self-attention): a tile starts at a document's first row, or block_q rows after the tile before it,
//    and holds only that document's rows; its key blocks start at the document's first key. No tile or key block
//    then spans two documents, and a packed row costs the sum of its documents, as unpacked ones would (the fixed
//    128 x 128 grid computes 1.11x the blocks for documents of geometric lengths with mean 512);
//  - otherwise the query blocks of block_q rows and the key blocks whose id range meets theirs (unsorted ids, other
//    query ids than key ids, cross-attention, lengths, split key ranges, paged K / V, bias or mask tensors).
// segment_chunks_kernel summarises each chunk's documents (and writes the key blocks' id ranges); segment_tiles_kernel
// reads its row's summaries, numbers the tiles chunk after chunk and writes its chunk's. (One block per row walking
// 16384 ids took 21 us, ncu, H200: a tenth of the attention it prepares, bound by one SM's instruction rate.)
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
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

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
constexpr int kPerThread = kSegmentChunk / kThreads;  // contiguous positions per thread, their loads issued together

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
    int w = lane < kWarps ? shared[lane] : none;
    for (int offset = 1; offset < kWarps; offset *= 2) {
      const int other = __shfl_up_sync(0xffffffffu, w, offset);
      if (lane >= offset) w = op(w, other);
    }
    if (lane < kWarps) shared[lane] = w;  // inclusive over warps 0 .. lane
  }
  __syncthreads();
  const int before_warp = warp > 0 ? shared[warp - 1] : none;
  total = shared[kWarps - 1];
  const int before_lane = __shfl_up_sync(0xffffffffu, inclusive, 1);
  return op(before_warp, lane > 0 ? before_lane : none);
}

struct Last {
  __device__ int operator()(int a, int c) const { return max(a, c); }
};
struct First {
  __device__ int operator()(int a, int c) const { return min(a, c); }
};
struct Sum {
  __device__ int operator()(int a, int c) const { return a + c; }
};

// One thread's positions [begin, end) of a row: whether the ids are sorted (also against the id before begin) and the
// same for queries and keys (kv_ids: nullptr skips that test), its first document start (end where none), its last
// (-1 where none), and the tiles that start from its first document start on.
struct ThreadDocuments {
  bool fits;
  int first_start, last_start, tiles;
};

__device__ __forceinline__ ThreadDocuments walk_documents(const int* q_ids, const int* kv_ids, int begin, int end,
                                                          int block_q) {
  ThreadDocuments d{true, end, -1, 0};
  int q[kPerThread], kv[kPerThread];
#pragma unroll
  for (int u = 0; u < kPerThread; ++u) {
    q[u] = begin + u < end ? __ldg(q_ids + begin + u) : 0;
    kv[u] = begin + u < end && kv_ids != nullptr ? __ldg(kv_ids + begin + u) : q[u];
  }
  int prev = begin > 0 ? __ldg(q_ids + begin - 1) : INT_MIN, start = -1;
#pragma unroll
  for (int u = 0; u < kPerThread; ++u) {
    const int i = begin + u;
    if (i >= end) break;
    d.fits = d.fits & (q[u] >= prev) & (q[u] == kv[u]);
    if (i == 0 || q[u] != prev) {
      d.first_start = min(d.first_start, i);
      d.last_start = start = i;
    }
    d.tiles += start >= 0 && (i - start) % block_q == 0 ? 1 : 0;
    prev = q[u];
  }
  return d;
}

// Tiles among positions [begin, first_start) of the document that started at start_in (< begin; -1: none, those
// positions belong to a document counted elsewhere): rows start_in + k block_q.
__device__ __forceinline__ int lead_tiles(int start_in, int begin, int first_start, int block_q) {
  return start_in >= 0 && first_start > begin
             ? (first_start - 1 - start_in) / block_q - (begin - 1 - start_in) / block_q
             : 0;
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

struct ChunkOf {
  int64_t batch;
  int chunk;
};

__device__ __forceinline__ ChunkOf chunk_of_block(int chunks) {
  return {blockIdx.x / chunks, static_cast<int>(blockIdx.x % chunks)};
}

__device__ __forceinline__ ChunkSummary* chunk_summaries(const AttentionParams& p, int slots, int64_t batch) {
  SegmentTile* all_tiles = reinterpret_cast<SegmentTile*>(p.segment_tiles) + int64_t{p.batch} * slots;
  return reinterpret_cast<ChunkSummary*>(all_tiles) + batch * segment_chunks(p.seqlen_q);
}

}  // namespace segment_tiles_detail

// First kernel: a block per (batch row, chunk of max(Sq, Sk) positions). The (min, max) kv id of the key blocks
// that start in the chunk, a warp per block; with `documents`, the chunk's summary (chunks of the query rows).
static __global__ void __launch_bounds__(segment_tiles_detail::kThreads)
    segment_chunks_kernel(const AttentionParams p, int block_q, int block_kv, int key_blocks, int slots, int chunks,
                          bool documents) {
  using namespace segment_tiles_detail;
  __shared__ int shared[kWarps];
  const ChunkOf at = chunk_of_block(chunks);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int* kv_ids = p.kv_segment_ids + at.batch * p.kv_segment_stride;
  int2* ranges = reinterpret_cast<int2*>(p.kv_block_segments) + at.batch * key_blocks;
  const int chunk_begin = at.chunk * kSegmentChunk;
  const int kb_end = min(key_blocks, (chunk_begin + kSegmentChunk + block_kv - 1) / block_kv);
  for (int kb = (chunk_begin + block_kv - 1) / block_kv + warp; kb < kb_end; kb += kWarps) {
    const int2 range = warp_id_range(kv_ids, kb * block_kv, min(p.seqlen_k, (kb + 1) * block_kv), lane);
    if (lane == 0) ranges[kb] = range;
  }
  const int n = p.seqlen_q;
  if (!documents || chunk_begin >= n) return;  // (uniform over the block)
  const int begin = min(n, chunk_begin + static_cast<int>(threadIdx.x) * kPerThread);
  const int end = min(n, begin + kPerThread);
  const ThreadDocuments d = walk_documents(p.q_segment_ids + at.batch * p.q_segment_stride, kv_ids, begin, end,
                                           block_q);
  const bool fits = __syncthreads_and(d.fits);
  int first, last, tiles;  // (a thread without a start reports none: its first_start is its end)
  exclusive_scan(d.last_start >= 0 ? d.first_start : INT_MAX, INT_MAX, First{}, shared, first);
  if (first == INT_MAX) first = min(n, chunk_begin + kSegmentChunk);
  const int start_in = exclusive_scan(d.last_start, -1, Last{}, shared, last);  // (inside the chunk only)
  exclusive_scan(lead_tiles(start_in, begin, d.first_start, block_q) + d.tiles, 0, Sum{}, shared, tiles);
  if (threadIdx.x == 0) chunk_summaries(p, slots, at.batch)[at.chunk] = ChunkSummary{fits, first, last, tiles};
}

// Second kernel: a block per (batch row, chunk of its query rows). Every block reads its row's summaries: if every
// chunk fits and the tiles fit the slots, the chunk's document tiles, numbered after the chunks before it; else the
// query blocks that start in the chunk. Then the unused slots, and the row's tile count into the call's maximum.
static __global__ void __launch_bounds__(segment_tiles_detail::kThreads)
    segment_tiles_kernel(const AttentionParams p, int block_q, int key_blocks, int slots, bool documents) {
  using namespace segment_tiles_detail;
  __shared__ int shared[kWarps];
  __shared__ int chunk_entry[2];  // the document start before this chunk and its first tile's index
  const int n = p.seqlen_q, chunks = segment_chunks(n);
  const ChunkOf at = chunk_of_block(chunks);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int* q_ids = p.q_segment_ids + at.batch * p.q_segment_stride;
  const int2* ranges = reinterpret_cast<const int2*>(p.kv_block_segments) + at.batch * key_blocks;
  SegmentTile* tiles = reinterpret_cast<SegmentTile*>(p.segment_tiles) + at.batch * slots;
  const int chunk_begin = at.chunk * kSegmentChunk;

  bool fits = documents;
  int count = 0;  // this row's tiles
  if (documents) {  // a scan over the row's chunks, kThreads at a time (plain loads: the first kernel wrote them)
    const ChunkSummary* summaries = chunk_summaries(p, slots, at.batch);
    int start_carry = -1;
    for (int c0 = 0; c0 < chunks; c0 += kThreads) {
      const int c = c0 + static_cast<int>(threadIdx.x);
      const ChunkSummary s = c < chunks ? summaries[c] : ChunkSummary{1, 0, -1, 0};
      fits = fits && s.fits;
      int last, round_tiles;
      const int start_in = max(start_carry, exclusive_scan(s.last_start, -1, Last{}, shared, last));
      const int lead = c < chunks ? lead_tiles(start_in, c * kSegmentChunk, s.first_start, block_q) : 0;
      const int index = count + exclusive_scan(lead + s.tiles, 0, Sum{}, shared, round_tiles);
      if (c == at.chunk) {
        chunk_entry[0] = start_in;
        chunk_entry[1] = index;
      }
      start_carry = max(start_carry, last);
      count += round_tiles;
    }
    fits = __syncthreads_and(fits);  // (and chunk_entry is written)
  }
  if (fits && count <= slots) {  // (uniform) this chunk's document tiles, each with its document's end
    const int begin = min(n, chunk_begin + static_cast<int>(threadIdx.x) * kPerThread);
    const int end = min(n, begin + kPerThread);
    const ThreadDocuments d = walk_documents(q_ids, nullptr, begin, end, block_q);
    int unused;
    const int start_in = max(chunk_entry[0], exclusive_scan(d.last_start, -1, Last{}, shared, unused));
    int index = chunk_entry[1] +
                exclusive_scan(lead_tiles(start_in, begin, d.first_start, block_q) + d.tiles, 0, Sum{}, shared, unused);
    int start = start_in, prev = begin > 0 ? __ldg(q_ids + begin - 1) : INT_MIN;
    for (int i = begin; i < end; ++i) {
      const int id = __ldg(q_ids + i);
      if (i == 0 || id != prev) start = i;
      prev = id;
      if ((i - start) % block_q == 0) {
        const int doc_end = document_end(q_ids, i, n);
        tiles[index++] = SegmentTile{0, 0, id, id, i, min(block_q, doc_end - i), start, doc_end};
      }
    }
  } else {  // the query blocks of block_q rows that start in this chunk and the key blocks that meet their ids
    count = (n + block_q - 1) / block_q;
    const int qb_end = min(count, (chunk_begin + kSegmentChunk + block_q - 1) / block_q);
    for (int qb = (chunk_begin + block_q - 1) / block_q + warp; qb < qb_end; qb += kWarps) {
      const int2 ids = warp_id_range(q_ids, qb * block_q, min(n, (qb + 1) * block_q), lane);
      const int2 blocks = warp_meeting_blocks(ranges, key_blocks, ids.x, ids.y, lane);
      if (lane == 0) {
        tiles[qb] = SegmentTile{blocks.x, blocks.y, ids.x, ids.y, qb * block_q, min(block_q, n - qb * block_q), -1, 0};
      }
    }
  }
  for (int e = count + at.chunk * kThreads + static_cast<int>(threadIdx.x); e < slots; e += chunks * kThreads) {
    tiles[e] = SegmentTile{};
  }
  if (threadIdx.x == 0) atomicMax(p.segment_tile_count, count);
}

// Zeroes the tile count and launches the pre-pass on `stream` (nothing without segment ids or their scratch).
inline std::string launch_segment_tiles(const AttentionParams& p, int block_q, int block_kv, cudaStream_t stream) {
  if (p.segment_tiles == nullptr || p.kv_block_segments == nullptr || p.seqlen_q == 0 || p.seqlen_k == 0) return {};
  const int key_blocks = (p.seqlen_k + block_kv - 1) / block_kv;
  const int64_t chunks_q = segment_chunks(p.seqlen_q), chunks = std::max(chunks_q, int64_t{segment_chunks(p.seqlen_k)});
  if (int64_t{p.batch} * chunks > INT_MAX) {
    return "segment ids: batch x chunks of " + std::to_string(kSegmentChunk) + " positions = " +
           std::to_string(int64_t{p.batch} * chunks) + " pre-pass blocks, more than a grid holds (2^31 - 1)";
  }
  if (cudaError_t err = cudaMemsetAsync(p.segment_tile_count, 0, sizeof(int), stream); err != cudaSuccess) {
    return cuda_failure("cudaMemsetAsync(segment tile count)", err);
  }
  constexpr int kThreads = segment_tiles_detail::kThreads;
  const bool documents = may_run_document_tiles(p);
  segment_chunks_kernel<<<static_cast<unsigned>(p.batch * chunks), kThreads, 0, stream>>>(
      p, block_q, block_kv, key_blocks, p.segment_tile_slots, static_cast<int>(chunks), documents);
  segment_tiles_kernel<<<static_cast<unsigned>(p.batch * chunks_q), kThreads, 0, stream>>>(
      p, block_q, key_blocks, p.segment_tile_slots, documents);
  if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) {
    return cuda_failure("segment tile pre-pass launch", err);
  }
  return {};
}

}  // namespace jax_flash::sm90
