// Split-KV (Flash-Decoding): how many key ranges each tile's keys are cut into, and which key blocks one range
// holds. Host and device code (the FFI handlers plan, the kernels index).
#pragma once

#include <algorithm>
#include <cstdint>

#include "common/visibility.h"  // JAX_FLASH_HOST_DEVICE

namespace jax_flash {

// The most ranges per tile (jax_flash/config.py MAX_SPLITS): the combine step reads one partial per range.
inline constexpr int kMaxSplits = 128;

// The split count for a grid of `tiles` thread blocks on a GPU that runs `slots` of them at once (SMs x blocks per
// SM), whose longest tile visits `key_blocks` key blocks. FlashAttention-3's rule (hopper/heuristics.h), with the
// resident blocks as the unit: among 1 .. max the smallest count whose wave efficiency
// (tiles x splits / slots) / ceil(tiles x splits / slots) is within 85% of the best. No split with four waves or
// more (the last wave's idle slots cost under 25%), or when a range would hold fewer than 4 key blocks: each range
// costs a prologue, an epilogue and a partial O to write and merge.
inline int choose_num_splits(int64_t tiles, int64_t slots, int64_t key_blocks) {
  if (tiles <= 0 || slots <= 0 || tiles >= 4 * slots) return 1;
  const int64_t most = std::min<int64_t>({kMaxSplits, key_blocks / 4, 4 * slots / tiles + 1});
  if (most <= 1) return 1;
  auto efficiency = [&](int64_t splits) {
    const double waves = static_cast<double>(tiles * splits) / static_cast<double>(slots);
    return waves / static_cast<double>(static_cast<int64_t>(waves + 0.999999));
  };
  double best = 0.0;
  for (int64_t s = 1; s <= most; ++s) best = std::max(best, efficiency(s));
  for (int64_t s = 1; s <= most; ++s) {
    if (efficiency(s) >= 0.85 * best) return static_cast<int>(s);
  }
  return 1;
}

struct BlockRange {
  int begin, end;  // key blocks [begin, end); empty when begin >= end
};

// Key blocks of range `split` of `num_splits` over a tile's visible blocks [begin, end): equal shares in order, the
// last ones possibly empty.
JAX_FLASH_HOST_DEVICE BlockRange split_blocks(int begin, int end, int split, int num_splits) {
  if (num_splits <= 1) return {begin, end};
  const int count = end > begin ? end - begin : 0;
  const int share = (count + num_splits - 1) / num_splits;
  const int64_t offset = static_cast<int64_t>(split) * share;  // (up to 128 x 2^27 key blocks: 64-bit)
  const int first = begin + static_cast<int>(offset < count ? offset : count);
  const int last = end - first > share ? first + share : end;
  return {first, last > first ? last : first};
}

}  // namespace jax_flash
