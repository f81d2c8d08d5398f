// Work items of the CPU attention (see work_plan.h).
#include "cpu/work_plan.h"

#include <algorithm>
#include <numeric>

namespace jax_flash::cpu {
namespace {

// A tile of block_q (or block_kv) rows of the head dim stays under 1 MiB of fp32, so that scratch follows the tiles
// and not block x D of an enormous head dim (D = 2^20 gets one-row tiles).
constexpr int64_t kMaxTileFloats = int64_t{1} << 18;

int clamp_block(int block, int seqlen, int head_dim) {
  const int64_t by_dim = std::max<int64_t>(1, kMaxTileFloats / std::max(1, head_dim));
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>({block, seqlen, by_dim})));
}

}  // namespace

WorkPlan::WorkPlan(const AttentionParams& p, int block_q, int block_kv, int workers)
    : p_(p),
      block_q_(clamp_block(block_q, static_cast<int>(std::min<int64_t>(int64_t{p.seqlen_q} * p.pack_gqa, 1 << 30)),
                           p.head_dim)),
      block_kv_(clamp_block(block_kv, p.seqlen_k, p.head_dim)),
      heads_(p.pack_gqa > 1 ? p.heads_k : p.heads_q),
      splits_(1),
      rows_(int64_t{p.seqlen_q} * p.pack_gqa) {
  const int64_t q_blocks = (rows_ + block_q_ - 1) / block_q_;
  // Work of a (batch, query block): its rows times the keys they may see (the same for every head).
  std::vector<int64_t> work(static_cast<size_t>(p.batch * q_blocks));
  int max_keys = 0;
  for (int64_t b = 0; b < p.batch; ++b) {
    const BatchLengths len = batch_lengths(p, b);
    for (int64_t qb = 0; qb < q_blocks; ++qb) {
      const int64_t row0 = qb * block_q_, rows = std::min<int64_t>(block_q_, rows_ - row0);
      const KeySpan keys = visible_keys_of_rows(p, len, row0 / p.pack_gqa, (row0 + rows - 1) / p.pack_gqa + 1);
      const int span = std::max(0, keys.end - keys.begin);
      work[b * q_blocks + qb] = span * rows;
      max_keys = std::max(max_keys, span);
    }
  }
  order_.resize(work.size());
  std::iota(order_.begin(), order_.end(), int64_t{0});
  std::stable_sort(order_.begin(), order_.end(), [&](int64_t a, int64_t b) { return work[a] > work[b]; });

  const int64_t units = num_units();
  const int64_t wanted_items = 4 * static_cast<int64_t>(std::max(1, workers));
  if (p.num_splits > 0) {
    splits_ = p.num_splits;
  } else if (units > 0 && units < wanted_items) {
    const int64_t by_keys = std::max<int64_t>(1, (max_keys + block_kv_ - 1) / block_kv_);  // >= one tile each
    splits_ = static_cast<int>(std::min<int64_t>((wanted_items + units - 1) / units, by_keys));
  }
}

Unit WorkPlan::unit(int64_t slot) const {
  const int64_t q_blocks = (rows_ + block_q_ - 1) / block_q_;
  const int64_t batch_block = order_[slot / heads_];
  const int pack = p_.pack_gqa;
  Unit u;
  u.batch = batch_block / q_blocks;
  u.kv_head = pack > 1 ? slot % heads_ : (slot % heads_) / p_.q_heads_per_kv_head;
  u.head = pack > 1 ? u.kv_head * pack : slot % heads_;
  u.row0 = (batch_block % q_blocks) * block_q_;
  u.rows = static_cast<int>(std::min<int64_t>(block_q_, rows_ - u.row0));
  u.pack = pack;
  u.len = batch_lengths(p_, u.batch);
  u.keys = visible_keys_of_rows(p_, u.len, u.position(0), u.position(u.rows - 1) + 1);
  return u;
}

KeySpan WorkPlan::split_keys(const Unit& unit, int split) const {
  if (splits_ == 1) return unit.keys;
  const int64_t span = std::max(0, unit.keys.end - unit.keys.begin);
  const int64_t chunk = (span + splits_ - 1) / splits_;
  const int64_t begin = std::min<int64_t>(unit.keys.begin + split * chunk, unit.keys.end);
  const int64_t end = std::min<int64_t>(begin + chunk, unit.keys.end);
  return {static_cast<int>(begin), static_cast<int>(end)};
}

}  // namespace jax_flash::cpu
