// Per-row statistics of one query block as both GPU families' backward kernels read them from shared memory.
#pragma once

#include <cmath>
#include <cstdint>

#include "common/backward_params.h"
#include "common/visibility.h"

namespace jax_flash {

// Threads tid < kBlockQ write row q0 + tid's lse * log2(e) (+inf where the row sees no key or lies past q_len, so
// exp2(s * scale_log2 - lse2) is exactly 0 there) and delta (0 past seqlen_q) into shared memory.
template <int kBlockQ>
__device__ __forceinline__ void load_row_stats(const BackwardParams& bp, int64_t batch, int64_t head, int q0,
                                               BatchLengths len, float* sLse2, float* sDelta, int tid) {
  if (tid >= kBlockQ) return;
  const AttentionParams& p = bp.p;
  const int row = q0 + tid;
  const int64_t stat = batch * p.lse_batch_stride + head * p.lse_head_stride + row;
  const float lse = row < len.q_len ? bp.t.lse[stat] : -INFINITY;
  sLse2[tid] = lse == -INFINITY ? INFINITY : lse * kLog2e;
  sDelta[tid] = row < p.seqlen_q ? bp.delta[stat] : 0.0f;
}

}  // namespace jax_flash
