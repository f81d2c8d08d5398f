// Which tile one sm80 thread block computes, and where its rows live.
//
// A tile is (batch, head unit, block of kBlockQ rows, key range). The head unit is a query head, or with packed GQA
// (p.pack_gqa = group) a kv head, whose rows step through the group's query heads fastest: row r of the unit is
// query position r / pack of query head head0 + r % pack. The key range is one of p.num_splits shares of the key
// blocks the tile's rows see (common/split_plan.h). Block index -> query block fastest (neighbouring blocks share K/V
// in L2), then key range, head unit, batch; with a right bound (causal) later query blocks see more keys and go first.
#pragma once

#include <cstdint>

#include "common/params.h"
#include "common/split_plan.h"
#include "common/visibility.h"

namespace jax_flash::sm80 {

struct Tile {
  int64_t batch, head0, kv_head;  // head0: the query head of the unit's row 0 (packed: kv_head * group)
  int row0;                       // first row of the tile within the unit's seqlen_q * pack rows
  int pack;                       // rows per query position: 1, or the group when packed
  int split;                      // key range of the tile (0 when not split)
  int q_rows;                     // rows of the tile inside the tensor (the rest of the block is past the end)
  int q_rows_valid;               // rows below q_lengths[b]: they compute; the others write zeros
  BatchLengths len;
  int block_begin, block_end;     // key blocks of this range; empty: no row sees a key here

  __device__ __forceinline__ int position(int r) const { return (row0 + r) / pack; }
  __device__ __forceinline__ int64_t head(int r) const { return head0 + (row0 + r) % pack; }
};

// kBatchInner (tensor variants): p.batch_inner may order the (head unit, batch) pairs batch fastest.
template <class T, bool kBatchInner = false>
__device__ __forceinline__ Tile locate_tile(const AttentionParams& p, int64_t block) {
  Tile t;
  t.pack = p.pack_gqa;
  const int q_block_in_order = static_cast<int>(block % p.num_q_blocks);
  const int q_block = p.window_right < kUnbounded ? p.num_q_blocks - 1 - q_block_in_order : q_block_in_order;
  const int64_t rest = block / p.num_q_blocks;
  t.split = static_cast<int>(rest % p.num_splits);
  const int64_t units = t.pack > 1 ? p.heads_k : p.heads_q;
  int64_t unit = (rest / p.num_splits) % units;
  t.batch = (rest / p.num_splits) / units;
  if (kBatchInner && p.batch_inner) {
    t.batch = (rest / p.num_splits) % p.batch;
    unit = (rest / p.num_splits) / p.batch;
  }
  t.kv_head = t.pack > 1 ? unit : unit / p.q_heads_per_kv_head;
  t.head0 = t.pack > 1 ? unit * t.pack : unit;
  t.row0 = q_block * T::kBlockQ;
  const int rows = p.seqlen_q * t.pack;  // (the caller keeps seqlen_q * group below 2^31)
  t.q_rows = min(T::kBlockQ, rows - t.row0);
  t.len = batch_lengths(p, t.batch);
  t.q_rows_valid = max(0, min(T::kBlockQ, t.len.q_len * t.pack - t.row0));
  // Only key blocks some row of this tile can see are visited (causal and windows skip the rest).
  const KeySpan keys = t.q_rows_valid > 0
                           ? visible_keys_of_rows(p, t.len, t.position(0), t.position(t.q_rows_valid - 1) + 1)
                           : KeySpan{0, 0};
  const BlockRange range = split_blocks(keys.begin / T::kBlockKV, (keys.end + T::kBlockKV - 1) / T::kBlockKV,
                                        t.split, p.num_splits);
  t.block_begin = range.begin;
  t.block_end = range.end;
  return t;
}

}  // namespace jax_flash::sm80
