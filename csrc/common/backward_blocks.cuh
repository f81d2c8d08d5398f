// Block skipping in both GPU families' backward (segment ids and mask tensors). Pre-passes at the backward's tiles
// (block_q query rows x block_kv keys) record each key block's and query block's (min, max) segment id
// (common/segment_blocks.cuh) and whether each mask tile holds a nonzero entry and a zero one
// (common/mask_blocks.cuh). A thread block of kBlockKV keys then walks only the (query head, query block) items whose
// tile can hold a visible score, and runs the per-score mask and segment test only on the items whose tile mixes
// visible and hidden scores. A dense causal mask then costs about what causal=True costs, and a packed row about the
// sum of its documents.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "common/mask_blocks.cuh"
#include "common/params.h"
#include "common/segment_blocks.cuh"
#include "common/visibility.h"

namespace jax_flash {

// Runs the pre-passes on `stream` for the scratch the caller gave (AttentionParams::kv_block_segments,
// q_block_segments, mask_blocks, mask_partial, sized for tiles of kBackwardBlockMin; none: nothing).
inline std::string launch_backward_blocks(const AttentionParams& p, int block_q, int block_kv, cudaStream_t stream) {
  if (std::string failure = launch_kv_block_segments(p, block_kv, stream); !failure.empty()) return failure;
  if (std::string failure = launch_q_block_segments(p, block_q, block_kv, stream); !failure.empty()) return failure;
  return launch_mask_blocks(p, block_q, block_kv, stream);
}

// The items of one backward thread block (the kBlockKV keys of key block kv_block of one (batch, kv head)): item i is
// query head kv_head * group + i / q_blocks and query block qb.begin + i % q_blocks, i < num_items. Without the
// pre-passes' scratch, every item, each with the per-score test. Lane l of each warp tests item base + l; the 32
// answers are one ballot, so each warp holds the same bits and a refill costs one load per 32 items. Calls to
// following() come with increasing i, and per_score(i) before following(i).
template <int kBlockQ, int kBlockKV>
struct BackwardItems {
  bool skips = false;  // false: every item, with the per-score test
  int64_t batch = 0, kv_head = 0;
  int kv_block = 0, q_block0 = 0, q_blocks = 0, num_items = 0;
  int base = -32;      // items [base, base + 32) are in the bits (none yet: the first call refills)
  unsigned visit = 0;  // bit l: item base + l has a visible score
  unsigned mixed = 0;  // bit l: ... and its mask or segment ids need the per-score test

  BackwardItems() = default;
  __device__ __forceinline__ BackwardItems(const AttentionParams& params, int64_t batch_, int64_t kv_head_,
                                           int kv_block_, QueryBlocks qb)
      : batch(batch_), kv_head(kv_head_), kv_block(kv_block_), q_block0(qb.begin), q_blocks(qb.end - qb.begin),
        num_items((qb.end - qb.begin) * params.q_heads_per_kv_head) {
    const bool segments = params.q_segment_ids != nullptr && params.q_block_segments != nullptr;
    const bool mask = params.mask != nullptr && params.mask_blocks != nullptr && params.mask_partial != nullptr;
    skips = segments || mask;
  }

  __device__ __forceinline__ void refill(const AttentionParams& p, int from, int lane) {
    base = from;
    const int item = from + lane;
    bool visible = item < num_items, test = false;
    if (p.mask_blocks != nullptr && p.mask_partial != nullptr) {
      if (visible) {
        const MaskBlockShape shape = MaskBlockShape::of(p, kBlockQ, kBlockKV);
        const int64_t head = kv_head * p.q_heads_per_kv_head + item / q_blocks;
        const int64_t flag =
            shape.block_of(p, batch, head, q_block0 + item % q_blocks) * shape.key_blocks + kv_block;
        visible = __ldg(p.mask_blocks + flag) != 0;
        test = __ldg(p.mask_partial + flag) != 0;
      }
    } else {
      test = p.mask != nullptr;
    }
    if (p.q_segment_ids != nullptr && p.q_block_segments != nullptr) {
      if (visible) {
        const int q_blocks_all = (p.seqlen_q + kBlockQ - 1) / kBlockQ;
        const int4 q_ids = __ldg(reinterpret_cast<const int4*>(p.q_block_segments) + batch * q_blocks_all +
                                 q_block0 + item % q_blocks);  // (z, w): the query block's (min, max)
        const int2 kv_ids = __ldg(reinterpret_cast<const int2*>(p.kv_block_segments) +
                                  batch * segment_key_blocks(p, kBlockKV) + kv_block);
        visible = q_ids.z <= kv_ids.y && q_ids.w >= kv_ids.x;
        test |= q_ids.z != q_ids.w || kv_ids.x != kv_ids.y || q_ids.z != kv_ids.x;
      }
    } else {
      test |= p.q_segment_ids != nullptr;
    }
    visit = __ballot_sync(0xffffffffu, visible);
    mixed = __ballot_sync(0xffffffffu, visible && test);
  }

  // The first item to visit after i (num_items when none): i = -1 gives the first of all.
  __device__ __forceinline__ int following(const AttentionParams& p, int i, int lane) {
    if (!skips) return i + 1;
    for (int next = i + 1; next < num_items;) {
      if (next < base || next >= base + 32) refill(p, next, lane);
      const unsigned rest = visit >> (next - base);
      if (rest != 0) return next + __ffs(rest) - 1;
      next = base + 32;
    }
    return num_items;
  }

  // Whether item i (the last that following() returned) needs the per-score mask and segment test.
  __device__ __forceinline__ bool per_score(int i) const { return !skips || ((mixed >> (i - base)) & 1u) != 0; }
};

}  // namespace jax_flash
