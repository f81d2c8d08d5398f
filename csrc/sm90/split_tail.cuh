// The split tail of the sm90 kernel (Traits::kSplitTail). Tiles of equal cost walked by a static stride end in a
// partial wave (2048 tiles over 132 SMs leave 64 blocks idle through the 16th tile). Instead, the last grid +
// num_tiles % grid tiles are not handed out whole: their key blocks are cut into gridDim.x equal shares, one per
// block, each at least a tile's key blocks (so a tile is cut at most once). A tile cut between two blocks is finished
// by the one holding its first key blocks, which merges the other's partial O, row maxima and row sums from scratch
// memory once that block's flag is set.
//   host: plan_split_tail (the launcher), device: the producer's share (begin_split_share, take_split_piece) and the
//   consumers' partial (leave_partial, merge_partial).
#pragma once

#include <cuda_runtime.h>

#include <climits>
#include <cstdint>
#include <string>

#include "common/fragment_ops.cuh"  // exp2_approx
#include "common/launch_util.h"
#include "common/params.h"
#include "sm90/pingpong.cuh"  // sync_consumer
#include "sm90/ptx.cuh"
#include "sm90/shared_storage.cuh"

namespace jax_flash::sm90 {

// ---- host ------------------------------------------------------------------------------------------------------

// Sets the split fields of `p` for a launch of `grid` blocks over `num_tiles` tiles walked by the static stride, and
// zeroes the flags on `stream`; leaves p unsplit where the kernel variant cannot split, the last wave is full, the
// tiles are too short, or the caller gave too little scratch memory (p.split_workspace).
template <class T, class V>
std::string plan_split_tail(AttentionParams& p, bool static_stride, int64_t num_tiles, unsigned grid,
                            cudaStream_t stream) {
  p.split_tiles = p.split_blocks = p.split_share = p.split_extra = 0;
  p.split_whole_tiles = num_tiles;
  const int64_t key_blocks = (int64_t{p.seqlen_k} + T::kBlockKV - 1) / T::kBlockKV;
  if (!V::kSplit || !static_stride || num_tiles <= grid || num_tiles % grid == 0 ||
      key_blocks < T::kMinSplitBlocks || p.split_workspace_bytes < int64_t{grid} * T::kSplitBytesPerSm ||
      (grid + num_tiles % grid) * key_blocks > INT_MAX) {
    return {};
  }
  p.split_tiles = static_cast<int>(grid + num_tiles % grid);
  p.split_blocks = static_cast<int>(key_blocks);
  p.split_whole_tiles = num_tiles - p.split_tiles;
  p.split_share = static_cast<int>(p.split_tiles * key_blocks / grid);
  p.split_extra = static_cast<int>(p.split_tiles * key_blocks % grid);
  p.split_partials = static_cast<float*>(p.split_workspace);
  p.split_flags =
      reinterpret_cast<unsigned*>(static_cast<char*>(p.split_workspace) + int64_t{grid} * T::kSplitSlotBytes);
  if (cudaError_t err = cudaMemsetAsync(p.split_flags, 0, sizeof(unsigned) * grid * T::kConsumers, stream);
      err != cudaSuccess) {
    return cuda_failure("cudaMemsetAsync(split-tail flags)", err);
  }
  return {};
}

// ---- device: the producer's share ------------------------------------------------------------------------------

// Block b's share: p.split_share key blocks (+ 1 for b < p.split_extra), counted over the split tiles from
// b * split_share + min(b, split_extra). The position lives in shared memory (the producer thread has 40 registers).
__device__ __forceinline__ void begin_split_share(const AttentionParams& p, SplitState& st) {
  if (p.split_tiles > 0) {
    const int b = static_cast<int>(blockIdx.x);
    const int start = b * p.split_share + min(b, p.split_extra);
    st.tile = start / p.split_blocks;
    st.first_block = start - st.tile * p.split_blocks;
    st.blocks_left = p.split_share + (b < p.split_extra ? 1 : 0);
  } else {
    st.blocks_left = 0;
  }
}

// Publishes what tile n of the block is (st.kind[n % 4]: written before the tile's slot is published, read by the
// consumers in its epilogue; the producer reaches tile n + 4 only after the consumers have taken tile n + 2):
// 0, a whole tile; s < 0, a split tile's last key blocks, whose partial goes to slot -s; s > 0, its first key blocks,
// which finish it with the partial of slot s. A share that starts inside a tile gives that tile's last key blocks
// (partial to slot blockIdx.x); one that ends inside a tile, that tile's first (merged with slot blockIdx.x + 1).
// Every share holds at least a tile's key blocks, so no piece is both. `work`: the piece's tile, narrowed here to the
// piece's key blocks (equal-cost tiles see key blocks 0 .. split_blocks - 1).
__device__ __forceinline__ void take_split_piece(const AttentionParams& p, SplitState& st, TileWork& work, bool whole,
                                                 int n) {
  int kind = 0;
  if (!whole) {
    const int first = st.first_block;
    const int last = min(p.split_blocks, first + st.blocks_left);
    work.block_begin = first;
    work.block_end = last;
    const int block = static_cast<int>(blockIdx.x);
    kind = first > 0 ? -block : last < p.split_blocks ? block + 1 : 0;
    st.tile += 1;
    st.first_block = 0;
    st.blocks_left -= last - first;
  }
  st.kind[n & 3] = kind;
}

// ---- device: the consumers' partial ----------------------------------------------------------------------------

// Where consumer c's partial of split slot s lives: float4 (s * kConsumers + c) * kSplitChunks * 128 + chunk * 128 +
// wg_tid, chunk < kOTiles being O's n-tile (this thread's 4 accumulators of it), then (row maxima, row sums).
template <class T>
struct SplitPartial {
  float4* partial;  // this thread's chunk 0
  unsigned* flag;

  __device__ __forceinline__ SplitPartial(const AttentionParams& p, int split, int consumer, int wg_tid) {
    const int slot = split < 0 ? -split : split;
    partial = reinterpret_cast<float4*>(p.split_partials) +
              (int64_t{slot} * T::kConsumers + consumer) * T::kSplitChunks * 128 + wg_tid;
    flag = p.split_flags + slot * T::kConsumers + consumer;
  }

  // A tile's last key blocks: the consumer's partial O and the row maxima and this thread's partial row sums, as
  // the softmax holds them, then the flag (the whole consumer's partial is written before it).
  template <class Softmax>
  __device__ __forceinline__ void leave(const float (&acc_o)[1][T::kOTiles][4], const Softmax& softmax, int consumer,
                                        int wg_tid) const {
#pragma unroll
    for (int n = 0; n < T::kOTiles; ++n) {
      __stcg(partial + n * 128, make_float4(acc_o[0][n][0], acc_o[0][n][1], acc_o[0][n][2], acc_o[0][n][3]));
    }
    __stcg(partial + T::kOTiles * 128,
           make_float4(softmax.row_max[0], softmax.row_max[1], softmax.row_sum[0], softmax.row_sum[1]));
    __threadfence();
    sync_consumer(consumer);  // every thread's partial is written ...
    if (wg_tid == 0) flag_store_release(flag, 1u);  // ... before the flag
  }

  // A tile's first key blocks: merged with the other block's partial. That block wrote it at the start of its share,
  // which holds more key blocks than this piece: the flag is set by now unless it started late (it never waits on
  // this one). m = max(m_a, m_b); O = O_a 2^((m_a - m) s) + O_b 2^((m_b - m) s), l likewise.
  template <class Softmax>
  __device__ __forceinline__ void merge(float (&acc_o)[1][T::kOTiles][4], Softmax& softmax, float scale_log2,
                                        int consumer, int wg_tid) const {
    if (wg_tid == 0) {
      while (flag_load_acquire(flag) == 0) __nanosleep(256);
    }
    sync_consumer(consumer);
    const float4 stats = __ldcg(partial + T::kOTiles * 128);
    const float other_max[2] = {stats.x, stats.y}, other_sum[2] = {stats.z, stats.w};
    float mine_scale[2], other_scale[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float m = fmaxf(softmax.row_max[h], other_max[h]);
      const float m_scaled = (m == -INFINITY ? 0.0f : m) * scale_log2;  // (a row that saw no key: zeros)
      mine_scale[h] = exp2_approx(softmax.row_max[h] * scale_log2 - m_scaled);
      other_scale[h] = exp2_approx(other_max[h] * scale_log2 - m_scaled);
      softmax.row_max[h] = m;
      softmax.row_sum[h] = softmax.row_sum[h] * mine_scale[h] + other_sum[h] * other_scale[h];
    }
#pragma unroll
    for (int n = 0; n < T::kOTiles; ++n) {
      const float4 o = __ldcg(partial + n * 128);
      acc_o[0][n][0] = fmaf(acc_o[0][n][0], mine_scale[0], o.x * other_scale[0]);
      acc_o[0][n][1] = fmaf(acc_o[0][n][1], mine_scale[0], o.y * other_scale[0]);
      acc_o[0][n][2] = fmaf(acc_o[0][n][2], mine_scale[1], o.z * other_scale[1]);
      acc_o[0][n][3] = fmaf(acc_o[0][n][3], mine_scale[1], o.w * other_scale[1]);
    }
  }
};

}  // namespace jax_flash::sm90
