// Per-row statistics of one query block as both GPU families' backward kernels read them from shared memory.
#pragma once

#include <cmath>
#include <cstdint>

#include "common/backward_params.h"
#include "common/visibility.h"

namespace jax_flash {

// exp2(s * scale_log2 - lse2) with lse2 = lse * log2(e), +inf for a row that sees no key (lse = -inf): exactly 0.
__device__ __forceinline__ float lse2_of(float lse) { return lse == -INFINITY ? INFINITY : lse * kLog2e; }

// Threads tid < kBlockQ write row q0 + tid's lse2 (+inf past q_len too) and delta (0 past seqlen_q) into shared
// memory.
template <int kBlockQ>
__device__ __forceinline__ void load_row_stats(const BackwardParams& bp, int64_t batch, int64_t head, int q0,
                                               BatchLengths len, float* sLse2, float* sDelta, int tid) {
  if (tid >= kBlockQ) return;
  const AttentionParams& p = bp.p;
  const int row = q0 + tid;
  const int64_t stat = batch * p.lse_batch_stride + head * p.lse_head_stride + row;
  const float lse = row < len.q_len ? bp.t.lse[stat] : -INFINITY;
  sLse2[tid] = lse2_of(lse);
  sDelta[tid] = row < p.seqlen_q ? bp.delta[stat] : 0.0f;
}

// Deterministic dQ: the thread blocks of the key blocks that see query block q_block of (batch, head) take turns in
// key-block order. The blocks that see it are consecutive (each row sees one band of keys, and the bands grow with
// the row), so a block's turn is its distance from the first of them. Blocks are dispatched in index order, key
// block fastest, so every earlier turn belongs to a block already running or done: the wait always ends.
struct DQTurn {
  int* counter;
  int turn;
};

template <int kBlockQ, int kBlockKV>
__device__ __forceinline__ DQTurn dq_turn(const BackwardParams& bp, BatchLengths len, int64_t batch, int64_t head,
                                          int q_block, int kv_block) {
  const AttentionParams& p = bp.p;
  static_assert(kBlockQ % kDQTurnRows == 0, "a query block must own whole turn counters");
  const int64_t counters_per_head = (p.seqlen_q + kDQTurnRows - 1) / kDQTurnRows;
  const KeySpan span = visible_keys_of_rows(p, len, int64_t{q_block} * kBlockQ, int64_t{q_block + 1} * kBlockQ);
  return {bp.dq_turns + (batch * p.heads_q + head) * counters_per_head + q_block * (kBlockQ / kDQTurnRows),
          kv_block - span.begin / kBlockKV};
}

// Every thread of the block calls both (they hold __syncthreads). Between them the block's dQ share goes in with
// dq_add_ordered.
__device__ __forceinline__ void dq_wait_turn(DQTurn t, int tid) {
  if (tid == 0) {
    int seen;
    do {
      asm volatile("ld.acquire.gpu.global.s32 %0, [%1];\n" : "=r"(seen) : "l"(t.counter) : "memory");
    } while (seen != t.turn);
  }
  __syncthreads();
}

__device__ __forceinline__ void dq_pass_turn(DQTurn t, int tid) {
  __threadfence();  // this block's dQ stores are visible before the next block's turn
  __syncthreads();
  if (tid == 0) asm volatile("st.release.gpu.global.s32 [%0], %1;\n" ::"l"(t.counter), "r"(t.turn + 1) : "memory");
}

// dst += value under the block's turn: the load bypasses L1, which may hold the previous block's value stale.
__device__ __forceinline__ void dq_add_ordered(float* dst, float value) { *dst = __ldcg(dst) + value; }
__device__ __forceinline__ void dq_add_ordered(float2* dst, float2 value) {
  const float2 old = __ldcg(dst);
  *dst = make_float2(old.x + value.x, old.y + value.y);
}

}  // namespace jax_flash
