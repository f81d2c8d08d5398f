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

  // exp(max - m_use) in the row max's units (raw scores when optimized: exp2 with the scale folded in); 0 for a
  // max of -inf.
  static __device__ __forceinline__ float weight(float max, float m_use, float scale_log2) {
    return T::kOptimizedSoftmax ? exp2_approx(max * scale_log2 - m_use * scale_log2) : expf(max - m_use);
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
          const float alpha = weight(row_max[m][h], m_use, scale_log2);
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

  // Adds another warp's state for the same rows over other keys (row max mo, this lane's partial row sum lo, O
  // as acc_o), both rescaled to the larger max: the split-KV merge of common/split_combine.cuh, before finalize().
  // A side that saw only masked keys (max -inf) gets weight 0.
  __device__ __forceinline__ void merge_row(int m, int h, float mo, float lo, const float* o_other,
                                           float (&acc_o)[T::kMTiles][T::kOTiles][4], float scale_log2) {
    const float m_new = fmaxf(row_max[m][h], mo);
    const float m_use = m_new == -INFINITY ? 0.0f : m_new;
    const float self = weight(row_max[m][h], m_use, scale_log2), other = weight(mo, m_use, scale_log2);
    row_max[m][h] = m_new;
    row_sum[m][h] = row_sum[m][h] * self + lo * other;
#pragma unroll
    for (int n = 0; n < T::kOTiles; ++n)
#pragma unroll
      for (int c = 0; c < 2; ++c) acc_o[m][n][2 * h + c] = acc_o[m][n][2 * h + c] * self + o_other[2 * n + c] * other;
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

// The kKeyWarps warps of a row group each ran the online softmax over their own slice of every key block (traits.cuh);
// after the last block the warps of slices 1.. leave their row max, partial row sums and O in `scratch` (sK / sV,
// which every warp is done reading), and the slice-0 warp merges them in. Returns whether this warp holds the
// merged rows: the others have nothing left to write. Called by every thread of the block (one __syncthreads).
// scratch: [slice - 1][row group][kMergeFloats][lane] fp32, lane fastest (conflict-free).
template <class T>
__device__ __forceinline__ bool merge_key_warps(OnlineSoftmax<T>& softmax, float (&acc_o)[T::kMTiles][T::kOTiles][4],
                                                float* scratch, int warp, int lane, float scale_log2) {
  const int row_group = warp % T::kRowWarps, slice = warp / T::kRowWarps;
  auto slot = [&](int s) { return scratch + ((s - 1) * T::kRowWarps + row_group) * T::kMergeFloats * 32 + lane; };
  if (slice > 0) {
    float* out = slot(slice);
#pragma unroll
    for (int m = 0; m < T::kMTiles; ++m)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float* row = out + (m * 2 + h) * (2 + 2 * T::kOTiles) * 32;
        row[0] = softmax.row_max[m][h];
        row[32] = softmax.row_sum[m][h];
#pragma unroll
        for (int n = 0; n < T::kOTiles; ++n)
#pragma unroll
          for (int c = 0; c < 2; ++c) row[(2 + 2 * n + c) * 32] = acc_o[m][n][2 * h + c];
      }
  }
  __syncthreads();
  if (slice > 0) return false;
#pragma unroll 1
  for (int s = 1; s < T::kKeyWarps; ++s) {
    const float* in = slot(s);
#pragma unroll
    for (int m = 0; m < T::kMTiles; ++m)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float* row = in + (m * 2 + h) * (2 + 2 * T::kOTiles) * 32;
        float o_other[2 * T::kOTiles];
#pragma unroll
        for (int i = 0; i < 2 * T::kOTiles; ++i) o_other[i] = row[(2 + i) * 32];
        softmax.merge_row(m, h, row[0], row[32], o_other, acc_o, scale_log2);
      }
  }
  return true;
}

}  // namespace jax_flash::sm80
