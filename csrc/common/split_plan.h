// Split-KV (Flash-Decoding): how many key ranges each tile's keys are cut into, and which key blocks one range
// holds. Host and device code (the FFI handlers plan, the kernels index).
#pragma once

#include <algorithm>
#include <cstdint>

#include "common/config_fields.h"  // kMaxSplits
#include "common/visibility.h"     // JAX_FLASH_HOST_DEVICE

namespace jax_flash {

// The split count for a grid of `tiles` thread blocks of at most 64 query rows (the decode tiles), on a GPU that
// runs `slots` of them at once (SMs x blocks per SM), whose longest tile visits `key_blocks` key blocks of
// `kv_block_bytes` K and V each. Such a tile does at most 64 FLOPs per K/V byte, below the tensor cores' ridge, so
// its time is its K/V bytes, and the split is there to keep enough copies in flight: kDecodeBlocksPerSm resident
// thread blocks per SM (fewer where fewer fit; one for key blocks of kDecodeOneBlockBytes), never more blocks than
// run at once, each range at least kDecodeMinRangeBlocks key blocks (its prologue, epilogue and partial O cost about
// as much as that many blocks). Measured on an H200, bf16, D = 128, 32 query heads: 8 kv heads x 131072 keys on a
// one-warp tile ran 137 us at 64 ranges (512 blocks), 143 at 85 (FlashAttention-3's wave rule, 680 blocks),
// 147 at 128 and 154 at 256; one MQA head of 8 x 16384 keys 30 us at 32 ranges (8 key blocks each, 256 blocks), 36
// at 64 (512 blocks, more than fit); the masked four-warp tile (two resident per SM) of 8 query rows, 8 x 16384
// keys, 140 us at 4 ranges (256 blocks), 181 at 9 (576). On an H100, one MQA head of 32768 keys: 15.6 us at 128
// ranges of 4 key blocks, 18.3 at 64 of 8 (cuDNN 16.1).
// Two ranges, or any count on a grid whose tiles already reach half the SMs, pay only where each range is long (at
// least kDecodeMinPairRangeBlocks key blocks on such a grid, kDecodeMinPairRangeBytes of K / V for two ranges on a
// smaller one): the combine step costs about as much as the time they save otherwise.
// H100, bf16, D = 128, 32 query heads: one MQA head x 128 x 1024 keys on the four-warp tile (128 tiles, 16 key
// blocks) 32.7 us unsplit, 35.6 in two ranges (cuDNN 29.0; fp16 D = 64, three per SM: 17.7 unsplit, 22.0 in three,
// 27.1 in four, cuDNN 14.7); 8 kv heads x 16 x 16384 keys, 8 rows on the four-warp tile (128 tiles) 399 us
// unsplit, 361 in two. (32 kv heads x 8 x 16384 keys on the one-warp tile: 693 us unsplit, 715 in two at D = 128
// bf16, but 378 and 361 at D = 64 fp16.)
inline constexpr int kDecodeBlocksPerSm = 4;
inline constexpr int kDecodeMinRangeBlocks = 4;
inline constexpr int kDecodeMinPairRangeBlocks = 32;
// (1 MiB: 32 key blocks of the tile measured above, 64 keys at D = 128.)
inline constexpr int64_t kDecodeMinPairRangeBytes = int64_t{1} << 20;
// A tile whose key block holds this much K / V or more counts one resident block per SM: its ranges then hold
// twice the key blocks, and each range's prologue, partial O and merge cost more than a second block's copies in
// flight give. H100, bf16, D = 128, 32 query heads, the 32-row tile over 128-key blocks (64 KiB; two fit per SM),
// forced counts, us, one block per SM / two: one MQA sequence of 131072 keys 34.4 / 37.0 (cuDNN 37.2), 8 x 16384
// keys 34.8 / 36.5, 64 x 4096 57.5 / 59.7 (cuDNN 57.5); 32/8 heads, 8 rows, 8 x 16384 keys 189 / 195. At D = 64
// (32 KiB blocks, three fit) one per SM ran 3-13% slower.
inline constexpr int64_t kDecodeOneBlockBytes = int64_t{64} << 10;
inline int choose_decode_splits(int64_t tiles, int64_t slots, int64_t num_sms, int64_t key_blocks,
                                int64_t kv_block_bytes) {
  if (kv_block_bytes >= kDecodeOneBlockBytes) slots = std::min(slots, num_sms);
  const int64_t target = std::min<int64_t>(kDecodeBlocksPerSm * num_sms, slots);
  if (tiles <= 0 || tiles >= target) return 1;
  const int64_t min_range = 2 * tiles >= num_sms ? kDecodeMinPairRangeBlocks : kDecodeMinRangeBlocks;
  const int64_t most = std::min<int64_t>(kMaxSplits, key_blocks / min_range);
  const int64_t splits = std::max<int64_t>(1, std::min(target / tiles, most));
  if (splits == 2 && key_blocks * kv_block_bytes / 2 < kDecodeMinPairRangeBytes) return 1;
  return static_cast<int>(splits);
}

// The split count for a grid of `tiles` compute-bound thread blocks on a GPU that runs `slots` of them at once
// (SMs x blocks per SM), whose longest tile visits `key_blocks` key blocks. A grid's time is its waves
// (ceil(tiles x splits / slots)) times one range's key blocks plus one (each range's prologue, epilogue and
// partial O cost about a key block): the count of least such cost, the fewest of equal cost. FlashAttention-3's
// rule (hopper/heuristics.h: the smallest count within 85% of the best wave efficiency) picked 7 ranges for the
// sm90 packed MQA tile at 8 query rows (16 tiles, 128 key blocks), which fills 112 of 132 slots; H200, bf16,
// D = 128, 8 x 16384 keys: 44.6 us at 7 ranges, 41.5-41.9 at 8, 62.6 at 16. No split with four waves or more
// (the last wave's idle slots cost under 25%), or when a range would hold fewer than 4 key blocks.
inline int choose_num_splits(int64_t tiles, int64_t slots, int64_t key_blocks) {
  if (tiles <= 0 || slots <= 0 || tiles >= 4 * slots) return 1;
  const int64_t most = std::min<int64_t>({kMaxSplits, key_blocks / 4, 4 * slots / tiles + 1});
  auto cost = [&](int64_t splits) {
    const int64_t waves = (tiles * splits + slots - 1) / slots;
    return waves * ((key_blocks + splits - 1) / splits + 1);
  };
  int64_t best = 1;
  for (int64_t s = 2; s <= most; ++s) {
    if (cost(s) < cost(best)) best = s;
  }
  return static_cast<int>(best);
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
