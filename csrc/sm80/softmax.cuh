// Online softmax over the S accumulators of one warp (FlashAttention-2, Algorithm 1), in fp32.
// Accumulator layout of mma m16n8: element e of tile (m, n) sits in row m*16 + lane/4 + 8*(e/2),
// column n*8 + 2*(lane%4) + e%2; the four lanes of a quad share a row, so row reductions use shfl_xor 1 and 2.
#pragma once

#include <cmath>

#include "sm80/ptx.cuh"

namespace jax_flash::sm80 {

__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}

__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

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

  // acc_s: S of this block (overwritten with P = exp(scale*S - m_new)); acc_o is rescaled by exp(m_old - m_new).
  __device__ __forceinline__ void update(float (&acc_s)[T::kMTiles][T::kSTiles][4],
                                         float (&acc_o)[T::kMTiles][T::kOTiles][4], float scale, float scale_log2) {
#pragma unroll
    for (int m = 0; m < T::kMTiles; ++m) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float block_max = -INFINITY;
#pragma unroll
        for (int n = 0; n < T::kSTiles; ++n) {
#pragma unroll
          for (int e = 2 * h; e < 2 * h + 2; ++e) {
            if constexpr (!T::kOptimizedSoftmax) acc_s[m][n][e] *= scale;
            block_max = fmaxf(block_max, acc_s[m][n][e]);
          }
        }
        const float m_new = fmaxf(row_max[m][h], quad_max(block_max));
        // A row that has seen only masked (-inf) scores keeps m = -inf: exponentiate against 0 so nothing is NaN.
        const float m_use = m_new == -INFINITY ? 0.0f : m_new;
        float alpha, block_sum = 0.0f;
        if constexpr (T::kOptimizedSoftmax) {
          // P = exp2(S * scale_log2 - m * scale_log2): one FFMA and one MUFU.EX2 per score.
          const float m_scaled = m_use * scale_log2;
          alpha = exp2_approx(row_max[m][h] * scale_log2 - m_scaled);
#pragma unroll
          for (int n = 0; n < T::kSTiles; ++n) {
#pragma unroll
            for (int e = 2 * h; e < 2 * h + 2; ++e) {
              acc_s[m][n][e] = exp2_approx(fmaf(acc_s[m][n][e], scale_log2, -m_scaled));
              block_sum += acc_s[m][n][e];
            }
          }
        } else {
          alpha = expf(row_max[m][h] - m_use);
#pragma unroll
          for (int n = 0; n < T::kSTiles; ++n) {
#pragma unroll
            for (int e = 2 * h; e < 2 * h + 2; ++e) {
              acc_s[m][n][e] = expf(acc_s[m][n][e] - m_use);
              block_sum += acc_s[m][n][e];
            }
          }
        }
        row_max[m][h] = m_new;
        row_sum[m][h] = row_sum[m][h] * alpha + block_sum;
#pragma unroll
        for (int n = 0; n < T::kOTiles; ++n) {  // O = diag(alpha) O
          acc_o[m][n][2 * h] *= alpha;
          acc_o[m][n][2 * h + 1] *= alpha;
        }
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
