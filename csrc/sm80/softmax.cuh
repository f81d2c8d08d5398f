// Online softmax over the S accumulators of one warp (FlashAttention-2, Algorithm 1), in fp32.
// Accumulator layout of mma m16n8: element e of tile (m, n) sits in row m*16 + lane/4 + 8*(e/2),
// column n*8 + 2*(lane%4) + e%2; the four lanes of a quad share a row, so row reductions use shfl_xor 1 and 2.
#pragma once

#include <cmath>

#include "common/fragment_ops.cuh"
#include "common/row_reduce.cuh"

namespace jax_flash::sm80 {

template <class T>
struct OnlineSoftmax {
  // Two rows per m-tile per thread. Optimized: row_max in raw score units (scale applied inside exp2);
  // otherwise in scaled units. row_sum is this thread's partial sum until finalize().
  float row_max[T::kMTiles][2];
  float row_sum[T::kMTiles][2];

  __device__ __forceinline__ OnlineSoftmax() {
#pragma unroll
    for (int m = 0; m < T::kMTiles; ++m) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        row_max[m][h] = -INFINITY;
        row_sum[m][h] = 0.0f;
      }
    }
  }

  // acc_s: S of this block (overwritten with P = exp(scale*S - m)); acc_o is rescaled by exp(m_old - m_new).
  // Optimized (exp2, the seed's last step) also rescales lazily (FlashAttention-4): m moves only when some row of
  // the warp has grown by more than max_growth (raw units, lazy_rescale_threshold: a factor 2^8 after exp2); otherwise P
  // is taken against the old m (entries <= 2^8: the same relative rounding in bf16 / fp16; sums and O stay fp32)
  // and the O rescale, D/8 * 4 * kMTiles FMUL per thread, is skipped. The decision is one vote per warp, so the
  // branch never diverges. Needs scale_log2 > 0 (csrc/common/params.h).
  __device__ __forceinline__ void update(float (&acc_s)[T::kMTiles][T::kSTiles][4],
                                         float (&acc_o)[T::kMTiles][T::kOTiles][4], float scale, float scale_log2,
                                         float max_growth) {
    float m_new[T::kMTiles][2];
    bool grows = false;
#pragma unroll
    for (int m = 0; m < T::kMTiles; ++m) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        if constexpr (!T::kOptimizedSoftmax) {
#pragma unroll
          for (int n = 0; n < T::kSTiles; ++n) {
            acc_s[m][n][2 * h] *= scale;
            acc_s[m][n][2 * h + 1] *= scale;
          }
        }
        m_new[m][h] = fmaxf(row_max[m][h], quad_max(row_half_max<T::kSTiles>(acc_s[m], h)));
        // true for a row's first finite maximum (-inf + max_growth is -inf); false while every score is masked
        if constexpr (T::kOptimizedSoftmax) grows |= !(m_new[m][h] <= row_max[m][h] + max_growth);
      }
    }
    // The seed's plain softmax rescales every block; the optimized one when some row of the warp needs it.
    const bool rescale = !T::kOptimizedSoftmax || __any_sync(0xffffffffu, grows);
    if (rescale) {
#pragma unroll
      for (int m = 0; m < T::kMTiles; ++m) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          // A row that has seen only masked (-inf) scores keeps m = -inf: exponentiate against 0 so nothing is NaN.
          const float m_use = m_new[m][h] == -INFINITY ? 0.0f : m_new[m][h];
          const float alpha = T::kOptimizedSoftmax ? exp2_approx(row_max[m][h] * scale_log2 - m_use * scale_log2)
                                                   : expf(row_max[m][h] - m_use);
          row_max[m][h] = m_new[m][h];
          row_sum[m][h] *= alpha;
#pragma unroll
          for (int n = 0; n < T::kOTiles; ++n) {  // O = diag(alpha) O
            acc_o[m][n][2 * h] *= alpha;
            acc_o[m][n][2 * h + 1] *= alpha;
          }
        }
      }
    }
#pragma unroll
    for (int m = 0; m < T::kMTiles; ++m) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float m_use = row_max[m][h] == -INFINITY ? 0.0f : row_max[m][h];
#pragma unroll
        for (int n = 0; n < T::kSTiles; ++n) {
#pragma unroll
          for (int e = 2 * h; e < 2 * h + 2; ++e) {
            // optimized: P = exp2(S * scale_log2 - m * scale_log2), one FFMA and one MUFU.EX2 per score
            acc_s[m][n][e] = T::kOptimizedSoftmax ? exp2_approx(fmaf(acc_s[m][n][e], scale_log2, -m_use * scale_log2))
                                                  : expf(acc_s[m][n][e] - m_use);
          }
        }
        row_sum[m][h] += row_half_sum<T::kSTiles>(acc_s[m], h);
      }
    }
  }

  // Natural-log log-sum-exp of the scaled scores of row (m, h) after finalize(); -inf for a row that saw no key.
  __device__ __forceinline__ float lse(int m, int h, float scale) const {
    if (row_sum[m][h] <= 0.0f) return -INFINITY;
    const float max_scaled = T::kOptimizedSoftmax ? row_max[m][h] * scale : row_max[m][h];
    return max_scaled + logf(row_sum[m][h]);
  }

  // O = O / l ; a row with l = 0 (it saw no key) becomes zeros.
  __device__ __forceinline__ void finalize(float (&acc_o)[T::kMTiles][T::kOTiles][4]) {
#pragma unroll
    for (int m = 0; m < T::kMTiles; ++m) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float sum = quad_sum(row_sum[m][h]);
        row_sum[m][h] = sum;
        const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
#pragma unroll
        for (int n = 0; n < T::kOTiles; ++n) {
          acc_o[m][n][2 * h] *= inv;
          acc_o[m][n][2 * h + 1] *= inv;
        }
      }
    }
  }
};

}  // namespace jax_flash::sm80
