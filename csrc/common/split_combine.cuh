// The combine step of split-KV: merges the num_splits partial results of every query row into O and the lse. Each
// range s of a row left its normalised output O_s and its log-sum-exp lse_s (-inf: it saw none of the row's keys):
//   lse = log(sum_s exp(lse_s)),   O = sum_s exp(lse_s - lse) O_s.
// A row no range saw (every lse_s = -inf) gives zeros and lse = -inf; a NaN lse_s (a NaN or +inf score) makes the
// row NaN. Device code: included by the families' launchers.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "common/fragment_ops.cuh"
#include "common/launch_util.h"
#include "common/params.h"
#include "common/split_plan.h"

namespace jax_flash {

inline constexpr int kCombineWarps = 4;  // rows per 128-thread block: one warp per row

// One warp per row (b, h, i) of the output, rows numbered (b, h, i) with i fastest; lane l holds head-dim columns
// [l * kCols, l * kCols + kCols). The range weights sit in shared memory, one slice of kMaxSplits per warp.
template <class Element, int kHeadDim>
__global__ void __launch_bounds__(kCombineWarps * 32) split_combine_kernel(const __grid_constant__ AttentionParams p) {
  constexpr int kCols = kHeadDim / 32;  // 2, 4 or 8 floats per lane
  static_assert(kHeadDim % 32 == 0, "head_dim must be a multiple of 32");
  __shared__ float weights[kCombineWarps][kMaxSplits];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t rows = int64_t{p.batch} * p.heads_q * p.seqlen_q;
  const int64_t split_stride = rows;  // partial_lse (S, B, Hq, Sq); partial_o the same with D innermost
  for (int64_t row = int64_t{blockIdx.x} * kCombineWarps + warp; row < rows;
       row += int64_t{gridDim.x} * kCombineWarps) {
    // lse = m + log(sum_s exp(lse_s - m)), m the largest finite-or-inf lse_s; fmaxf skips NaN, the sum keeps it.
    float m = -INFINITY;
    for (int s = lane; s < p.num_splits; s += 32) m = fmaxf(m, p.partial_lse[s * split_stride + row]);
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, offset));
    const float shift = m == -INFINITY ? 0.0f : m;
    float sum = 0.0f;
    for (int s = lane; s < p.num_splits; s += 32) {
      const float lse_s = p.partial_lse[s * split_stride + row];
      const float w = lse_s == -INFINITY ? 0.0f : __expf(lse_s - shift);  // (NaN stays NaN)
      weights[warp][s] = w;
      sum += w;
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
    __syncwarp();
    const bool seen = !(sum == 0.0f);  // NaN counts as seen: it propagates
    const float inv = seen ? 1.0f / sum : 0.0f;
    float acc[kCols];
#pragma unroll
    for (int c = 0; c < kCols; ++c) acc[c] = 0.0f;
    if (seen) {
      for (int s = 0; s < p.num_splits; ++s) {
        const float w = weights[warp][s];
        if (w == 0.0f) continue;  // a range that saw none of the row's keys left no O (its memory is not written)
        const float* o_s = p.partial_o + (s * split_stride + row) * kHeadDim + lane * kCols;
#pragma unroll
        for (int c = 0; c < kCols; c += 2) {
          const float2 x = *reinterpret_cast<const float2*>(o_s + c);
          acc[c] += w * x.x;
          acc[c + 1] += w * x.y;
        }
      }
    }
    __syncwarp();  // the weights of this row are read before the next row's overwrite them
    // Output address of row (b, h, i).
    const int64_t i = row % p.seqlen_q, bh = row / p.seqlen_q;
    const int64_t h = bh % p.heads_q, b = bh / p.heads_q;
    Element* o = static_cast<Element*>(p.o) + b * p.o_batch_stride + h * p.o_head_stride + i * p.o_seq_stride +
                 lane * kCols;
#pragma unroll
    for (int c = 0; c < kCols; c += 2) {
      *reinterpret_cast<uint32_t*>(o + c) = pack2<Element>(acc[c] * inv, acc[c + 1] * inv);
    }
    if (p.lse != nullptr && lane == 0) {
      p.lse[b * p.lse_batch_stride + h * p.lse_head_stride + i] = seen ? shift + __logf(sum) : -INFINITY;
    }
  }
}

// Launches the combine step on `stream` after the split kernel. Returns "" or what failed.
template <class Element, int kHeadDim>
std::string launch_split_combine(const AttentionParams& p, cudaStream_t stream) {
  const int64_t rows = int64_t{p.batch} * p.heads_q * p.seqlen_q;
  if (rows == 0) return {};
  // A grid-stride loop: at most 2^20 blocks (4 rows each, then again), far inside grid.x's 2^31 - 1.
  const int64_t blocks = (rows + kCombineWarps - 1) / kCombineWarps;
  const unsigned grid = static_cast<unsigned>(blocks < (int64_t{1} << 20) ? blocks : (int64_t{1} << 20));
  split_combine_kernel<Element, kHeadDim><<<grid, kCombineWarps * 32, 0, stream>>>(p);
  if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) return cuda_failure("split combine launch", err);
  return {};
}

}  // namespace jax_flash
