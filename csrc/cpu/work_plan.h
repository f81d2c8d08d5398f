// How the CPU attention divides one call into work items.
//
// A unit is one (batch, query head, query block). Units run in order of decreasing work: with causal masks, windows
// or lengths the later query blocks see more keys, and handing them out first balances the workers (longest job
// first). When there are fewer units than 4 x workers, each unit's keys are split into `splits` ranges, each an item
// of its own, merged by the log-sum-exp afterwards (the split-KV of decoding), so one query row still uses every core.
#pragma once

#include <cstdint>
#include <vector>

#include "common/params.h"
#include "common/visibility.h"

namespace jax_flash::cpu {

struct Unit {
  int64_t batch, head, kv_head;
  int row0, rows;      // query rows [row0, row0 + rows)
  BatchLengths len;
  KeySpan keys;        // keys any of the rows sees
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
  std::vector<int64_t> order_;  // (batch * num_q_blocks + q_block), by decreasing work; heads vary fastest
};

}  // namespace jax_flash::cpu
