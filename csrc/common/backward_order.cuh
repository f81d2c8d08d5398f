// The order in which a backward grid visits its (key block, kv head x batch) thread blocks. The hardware dispatches
// blocks in index order, so the order decides which blocks run in the last wave. Either order dispatches a (batch,
// kv head)'s key blocks in ascending order, which the deterministic variant's dQ turns rely on.
#pragma once

#include <cstdint>

#include "common/params.h"

namespace jax_flash {

// Q, dO and the float32 dQ accumulator of this many bytes of query heads stay in L2 (50 MB on an H100) while their
// key blocks run: FlashAttention-3's figure for its backward's longest-first order.
inline constexpr int64_t kBackwardL2Bytes = int64_t{40} << 20;
// Key blocks per (batch, kv head) from which a right-bounded grid runs longest first. Below, the order gave nothing:
// H100, bf16, causal 1024 keys (8 key blocks) 0.8% (head dim 128) and 3% (64) slower, 2048-8192 keys 0.6-4.1% faster.
inline constexpr int kBackwardLongestFirstBlocks = 16;

struct BackwardBlock {
  int kv_block;
  int64_t head_batch;  // kv head + heads_k x batch
};

// Thread block `block` of a grid of num_kv_blocks x heads_k x batch. Without a right bound every key block sees the
// same query blocks: a (batch, kv head)'s key blocks run one after another, sharing its Q and dO in L2. With one
// (causal), key block j sees the query blocks from about j onwards, so the first key blocks are the longest: they are
// dispatched first, key block slowest over sections of (batch, kv head) pairs whose Q, dO and dQ accumulator fit in
// kBackwardL2Bytes, and the grid ends on the shortest blocks instead of waiting for one long block dispatched last.
__device__ __forceinline__ BackwardBlock backward_block(const AttentionParams& p, int64_t block, int num_kv_blocks,
                                                        int head_dim, int element_bytes) {
  if (p.window_right >= kUnbounded || num_kv_blocks < kBackwardLongestFirstBlocks) {
    return {static_cast<int>(block % num_kv_blocks), block / num_kv_blocks};
  }
  const int64_t head_batches = int64_t{p.heads_k} * p.batch;
  // One kv head's query rows: Q and dO in the input dtype, the dQ accumulator in float32 (+1: never zero).
  const int64_t head_bytes =
      int64_t{p.q_heads_per_kv_head} * p.seqlen_q * head_dim * (2 * element_bytes + 4) + 1;
  // Pairs per section: the largest power of two whose bytes fit (at least one).
  const int64_t width =
      head_bytes >= kBackwardL2Bytes ? 1 : int64_t{1} << (63 - __clzll(kBackwardL2Bytes / head_bytes));
  const int64_t section = block / (width * num_kv_blocks), in_section = block % (width * num_kv_blocks);
  // The last section holds the head_batches % width pairs left over.
  const int64_t section_width = section < head_batches / width ? width : head_batches % width;
  return {static_cast<int>(in_section / section_width), section * width + in_section % section_width};
}

}  // namespace jax_flash
