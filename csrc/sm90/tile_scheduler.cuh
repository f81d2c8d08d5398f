// The sm90 family's tile scheduler: which (batch, head, query block) tile the persistent blocks take in which order,
// what a tile's facts are (TileWork), the slot the producer publishes them in, and the launcher's ordering plan.
//
// One tile = one (batch, query head, block of kBlockQ query rows), or with split-KV (p.num_splits > 1) one key range
// of it: the (batch, range) pairs take the place of the batch entries below. With packed GQA (p.pack_gqa = group, a
// power of two dividing 64) a kv head takes the place of the query head: its seqlen_q x group rows step through the
// group's query heads fastest (common/params.h), and a tile's first row is a multiple of the group, so its row r is
// query position (row0 + r) / group of query head head + r % group. Tile -> (batch, head, query block):
//  - no right bound (every tile costs the same): query blocks innermost, so the tiles in flight share K/V in L2;
//  - a right bound (causal; a tile costs up to its last row's keys), or a mask tensor (the tile's key-block range,
//    the last query block's the longest for a causal-like mask): the (batch, head) pairs are cut into sections of
//    p.section_heads whose K and V fit in L2 together, and inside a section the tiles go query block by query block,
//    the last (heaviest) first, over all its heads: heavy tiles are handed out first and light ones fill the tail
//    (longest-processing-time first), while K/V stay in L2.
// Blocks start at tile blockIdx.x and then either draw their next tile from p.tile_counter (gridDim.x + atomicAdd:
// a block that finishes early takes more, which balances causal tiles) or walk blockIdx.x + k * gridDim.x.
#pragma once

#include <algorithm>
#include <cstdint>

#include "common/mask_blocks.h"
#include "common/params.h"
#include "common/split_plan.h"
#include "common/visibility.h"
#include "sm90/segment_tiles.cuh"

namespace jax_flash::sm90 {

struct TileWork {
  int batch, head, kv_head, row0;  // packed: head = kv_head * group, the query head of row 0; row0 counts packed rows
  int q_rows;        // rows of this tile inside the tensor (the rest of the block is past seqlen_q)
  int q_rows_valid;  // rows that compute (below q_lengths[b]); the others write zeros
  BatchLengths len;
  int block_begin, block_end;  // key blocks some valid row can see; empty: the tile writes zeros and lse = -inf
};

// A tile as the producer publishes it to the consumers (two slots in shared memory): its facts are worked out once,
// by the producer, off the consumers' path between one tile's last product and the next tile's first.
struct TileSlot {
  TileWork work;
  int more;  // 0: no tile is left, the block ends
};

// Index: the tile numbers' type, int64_t, or int where the launcher has checked that they fit (T::kTileIndex32).
// kSplit: the kernel variant splits key ranges, packs GQA and takes segment ids (p.num_splits > 1,
// p.pack_gqa > 1 and p.segment_tiles only there); kTensors: and bias / mask tensors (p.mask_ranges and
// p.batch_inner); `split`: the tile's range (0 unsplit). key_shift (kSplit): a document tile's
// (kBlockKV - doc_start % kBlockKV) % kBlockKV, else 0: its key block j holds keys [j kBlockKV - key_shift,
// (j + 1) kBlockKV - key_shift), so the document's first key starts one (sm90/segment_tiles.cuh). (Not a TileWork
// field: the other variants keep their tile slots.)
template <class T, class Index, bool kSplit, bool kTensors = false>
__device__ __forceinline__ TileWork tile_work(const AttentionParams& p, Index tile, int& split, int& key_shift) {
  TileWork w;
  int q_block;
  Index batch_head;
  const int pack = kSplit ? p.pack_gqa : 1;
  const int pack_shift = kSplit ? __ffs(pack) - 1 : 0;  // (a power of two: the launcher checks)
  // head units: query heads, or kv heads when packed (read at each use: the other variants keep their instructions)
  auto units = [&] { return kSplit && pack > 1 ? p.heads_k : p.heads_q; };
  // tiles per head unit: the query blocks, or with segment ids the slots of the row with the most tiles (read at
  // each use: held in a register it spilled the 32-register producers)
  auto unit_tiles = [&] { return kSplit && p.segment_tiles != nullptr ? *p.segment_tile_count : p.num_q_blocks; };
  if (p.window_right < kUnbounded || (kTensors && p.mask != nullptr)) {  // (a mask: causal-like, last heaviest)
    const Index batch_heads = static_cast<Index>(p.batch) * (kSplit ? p.num_splits : 1) * units();
    const Index section_tiles = static_cast<Index>(p.section_heads) * unit_tiles();
    const Index section = tile / section_tiles;
    const Index first = section * p.section_heads;
    const Index heads_here = min(static_cast<Index>(p.section_heads), batch_heads - first);
    const Index r = tile - section * section_tiles;
    q_block = unit_tiles() - 1 - static_cast<int>(r / heads_here);
    batch_head = first + r % heads_here;
  } else {
    q_block = static_cast<int>(tile % unit_tiles());
    batch_head = tile / unit_tiles();
  }
  // (batch, key range) pairs, ranges innermost, in 32 bits: 64-bit divisions here spilled the 40-register producer
  int batch_split;
  if (kTensors && p.batch_inner) {  // a tensor shared by the batch: the batch's tiles of one head run together
    const int pairs = p.batch * p.num_splits;
    w.head = static_cast<int>(batch_head / pairs);
    batch_split = static_cast<int>(batch_head % pairs);
  } else {
    w.head = static_cast<int>(batch_head % units());
    batch_split = static_cast<int>(batch_head / units());
  }
  split = kSplit && p.num_splits > 1 ? batch_split % p.num_splits : 0;
  w.batch = kSplit && p.num_splits > 1 ? batch_split / p.num_splits : batch_split;
  w.kv_head = w.head / p.q_heads_per_kv_head;
  if (kSplit && pack > 1) {  // the unit is a kv head; head: the query head of row 0
    w.kv_head = w.head;
    w.head <<= pack_shift;
  }
  // (p.q_block_shift: block 0 is the short one; read only where the launcher may set it: in the 40-register
  // producers of head dim 256 the extra arithmetic spilled 4 bytes)
  const int shift = T::kEndAlignedQueryBlocks ? p.q_block_shift : 0;
  w.row0 = q_block * T::kBlockQ - (q_block > 0 ? shift : 0);
  // (seqlen_q x group < 2^31: jax_flash checks)
  w.q_rows = min(q_block > 0 ? T::kBlockQ : T::kBlockQ - shift, (p.seqlen_q << pack_shift) - w.row0);
  w.len = batch_lengths(p, w.batch);
  w.q_rows_valid = max(0, min(T::kBlockQ, (w.len.q_len << pack_shift) - w.row0));
  const KeySpan keys = visible_keys_of_rows(p, w.len, w.row0 >> pack_shift,
                                            (w.row0 + w.q_rows_valid + pack - 1) >> pack_shift);
  w.block_begin = keys.begin / T::kBlockKV;
  w.block_end = (keys.end + T::kBlockKV - 1) / T::kBlockKV;
  if (kSplit) key_shift = 0;
  if (kSplit && p.segment_tiles != nullptr) {  // segment ids: the row's tile in slot q_block (segment_tiles.cuh)
    const SegmentTile e = reinterpret_cast<const SegmentTile*>(
        p.segment_tiles)[static_cast<int64_t>(w.batch) * p.segment_tile_slots + q_block];
    if (e.rows == 0) {  // no tile in this slot: nothing to compute or write
      w.q_rows = w.q_rows_valid = 0;
      w.block_end = w.block_begin;
    } else if (e.doc_start >= 0) {  // a document's rows over its keys, the keys counted from key_shift on
      // (document tiles run in calls without lengths: the document's end bounds both; the keys' lengths in the
      // shifted count make the consumers' bounds, kv_len - q_len = key_shift, the same for key j + key_shift)
      key_shift = (T::kBlockKV - e.doc_start % T::kBlockKV) % T::kBlockKV;
      w.row0 = e.row0;
      w.q_rows = w.q_rows_valid = e.rows;
      w.len = BatchLengths{e.doc_end, e.doc_end + key_shift};
      const KeySpan keys_shifted = visible_keys_of_rows(p, w.len, w.row0, w.row0 + e.rows);
      w.block_begin = max(keys_shifted.begin, e.doc_start + key_shift) / T::kBlockKV;
      w.block_end = max(w.block_begin, (keys_shifted.end + T::kBlockKV - 1) / T::kBlockKV);
    } else {  // a query block: the key blocks whose ids can meet the rows'
      w.block_begin = max(w.block_begin, e.first);
      w.block_end = max(w.block_begin, min(w.block_end, e.end));
    }
  }
  if (kTensors && p.mask_ranges != nullptr) {  // a mask tensor: its first to last key block with a visible entry
    const MaskBlockShape shape = MaskBlockShape::of(p, T::kBlockQ, T::kBlockKV);
    const int2 range = reinterpret_cast<const int2*>(p.mask_ranges)[shape.block_of(p, w.batch, w.head, q_block)];
    w.block_begin = max(w.block_begin, shape.key_blocks - range.x);
    w.block_end = max(w.block_begin, min(w.block_end, range.y));
  }
  if (kSplit && p.num_splits > 1) {
    const BlockRange range = split_blocks(w.block_begin, w.block_end, split, p.num_splits);
    w.block_begin = range.begin;
    w.block_end = range.end;
  }
  return w;
}

// ---- host: the order the launcher sets up ------------------------------------------------------------------------

// Whether the tiles walk a static stride of the grid (p.tile_counter unused) rather than draw from the counter.
template <class T>
bool walks_static_stride(const AttentionParams& p) {
  return T::kStaticStrideIfEqualCost && has_equal_cost_tiles(p);
}

// Sets p.section_heads and p.q_block_shift for a device with `l2_bytes` of L2 cache.
template <class T>
void plan_tile_order(AttentionParams& p, int64_t l2_bytes) {
  // (batch, head) pairs per heaviest-first section: their K and V together fill at most half the L2 (+ 1 byte keeps
  // seqlen_k = 0 from dividing by zero), and at most T::kMaxSectionHeads; at least 1, at most all pairs.
  const int64_t kv_bytes_per_head = 2 * int64_t{p.seqlen_k} * p.head_dim * 2 + 1;
  const int64_t batch_heads = int64_t{p.batch} * p.num_splits * (p.pack_gqa > 1 ? p.heads_k : p.heads_q);
  const int64_t section = std::min<int64_t>(std::min<int64_t>((l2_bytes / 2) / kv_bytes_per_head,
                                                              T::kMaxSectionHeads), batch_heads);
  p.section_heads = static_cast<int>(std::max<int64_t>(section, 1));
  // Query blocks aligned to the end of the rows (T::kEndAlignedQueryBlocks). The shift is a multiple of 64, so every
  // consumer's rows lie wholly inside or outside block 0 (an idle consumer writes nothing; a TMA store of a partly
  // valid one would overwrite block 1's rows).
  p.q_block_shift = 0;
  if (T::kEndAlignedQueryBlocks && p.window_right < kUnbounded && p.seqlen_q >= T::kEndAlignedMinRows &&
      p.pack_gqa == 1 && p.segment_tiles == nullptr && p.mask == nullptr) {
    // (packed tiles start at multiples of the group; the segment and mask pre-passes take plain query blocks)
    p.q_block_shift = (p.num_q_blocks * T::kBlockQ - p.seqlen_q) / 64 * 64;
  }
}

}  // namespace jax_flash::sm90
