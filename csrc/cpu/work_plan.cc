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
      block_q_(clamp_block(block_q, p.seqlen_q, p.head_dim)),
      block_kv_(clamp_block(block_kv, p.seqlen_k, p.head_dim)),
      heads_(p.heads_q),
      splits_(1) {
  const int64_t q_blocks = (p.seqlen_q + block_q_ - 1) / block_q_;
  // Work of a (batch, query block): its rows times the keys they may see (the same for every head).
  std::vector<int64_t> work(static_cast<size_t>(p.batch * q_blocks));
  int max_keys = 0;
  for (int64_t b = 0; b < p.batch; ++b) {
    const BatchLengths len = batch_lengths(p, b);
    for (int64_t qb = 0; qb < q_blocks; ++qb) {
      const int64_t row0 = qb * block_q_;
      const KeySpan keys = visible_keys_of_rows(p, len, row0, std::min<int64_t>(row0 + block_q_, p.seqlen_q));
      const int span = std::max(0, keys.end - keys.begin);
      work[b * q_blocks + qb] = span * std::min<int64_t>(block_q_, p.seqlen_q - row0);
      max_keys = std::max(max_keys, span);
    }
  }
  order_.resize(work.size());
  std::iota(order_.begin(), order_.end(), int64_t{0});
  std::stable_sort(order_.begin(), order_.end(), [&](int64_t a, int64_t b) { return work[a] > work[b]; });

  const int64_t units = num_units();
  const int64_t wanted_items = 4 * static_cast<int64_t>(std::max(1, workers));
  if (units > 0 && units < wanted_items) {
    const int64_t by_keys = std::max<int64_t>(1, (max_keys + block_kv_ - 1) / block_kv_);  // >= one tile each
    splits_ = static_cast<int>(std::min<int64_t>((wanted_items + units - 1) / units, by_keys));
  }
}

Unit WorkPlan::unit(int64_t slot) const {
  const int64_t q_blocks = (p_.seqlen_q + block_q_ - 1) / block_q_;
  const int64_t batch_block = order_[slot / heads_];
  Unit u;
  u.head = slot % heads_;
  u.batch = batch_block / q_blocks;
  u.kv_head = u.head / p_.q_heads_per_kv_head;
  u.row0 = static_cast<int>((batch_block % q_blocks) * block_q_);
  u.rows = std::min(block_q_, p_.seqlen_q - u.row0);
  u.len = batch_lengths(p_, u.batch);
  u.keys = visible_keys_of_rows(p_, u.len, u.row0, u.row0 + u.rows);
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
