// How the CPU attention divides one call into work items.
//
// A unit is one (batch, query head, query block), or with packed GQA (p.pack_gqa = group > 1) one (batch, kv head,
// block of packed rows): packed row r is query position r / group of query head kv_head * group + r % group, so the
// group's heads share each converted K/V tile. Units run in order of decreasing work: with causal masks, windows
// or lengths the later query blocks see more keys, and handing them out first balances the workers (longest job
// first). When there are fewer units than 4 x workers, each unit's keys are split into `splits` ranges, each an item
// of its own, merged by the log-sum-exp afterwards (the split-KV of decoding), so one query row still uses every core.
// p.num_splits > 0 forces that many ranges.
#pragma once

#include <cstdint>
#include <vector>

#include "common/params.h"
#include "common/visibility.h"

namespace jax_flash::cpu {

struct Unit {
  int64_t batch, head, kv_head;  // head: the query head of row 0 (packed: the group's first)
  int64_t row0;        // rows [row0, row0 + rows) of the (packed) rows of this (batch, head)
  int rows;
  int pack;            // rows per query position: 1, or the group size when packed
  BatchLengths len;
  KeySpan keys;        // keys any of the rows sees

  int64_t position(int r) const { return (row0 + r) / pack; }        // the query position of row r
  int64_t head_of(int r) const { return head + (row0 + r) % pack; }  // the query head of row r
};

class WorkPlan {
 public:
  WorkPlan(const AttentionParams& p, int block_q, int block_kv, int workers);

  int block_q() const { return block_q_; }
  int block_kv() const { return block_kv_; }
  int splits() const { return splits_; }
  int64_t num_units() const { return static_cast<int64_t>(order_.size()) * heads_; }
  int64_t num_items() const { return num_units() * splits_; }

  // The unit handed out `slot`-th (slot = item / splits).
  Unit unit(int64_t slot) const;

  // Keys [begin, end) of split `split` of a unit (empty ranges are possible; they contribute nothing).
  KeySpan split_keys(const Unit& unit, int split) const;

 private:
  const AttentionParams& p_;
  int block_q_, block_kv_, heads_, splits_;
  int64_t rows_;                // rows per (batch, head): seqlen_q, or seqlen_q * group when packed
  std::vector<int64_t> order_;  // (batch * num_q_blocks + q_block), by decreasing work; heads vary fastest
};

}  // namespace jax_flash::cpu
