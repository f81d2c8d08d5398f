// Row reductions over one thread's part of an m16n8 accumulator fragment (both GPU families): the four lanes of a
// quad share a row (shfl_xor 1 and 2), and each lane holds elements 2h, 2h + 1 of row half h in every n-tile.
#pragma once

namespace jax_flash {

__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}

__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// The lazy rescale's threshold (sm80 OnlineSoftmax::update, sm90 SplitSoftmax::update_max) in raw score units: a
// row's running max moves once it has grown by a factor 2^8 after exp2, so P stays <= 2^8.
__device__ __forceinline__ float lazy_rescale_threshold(float scale_log2) { return 8.0f / scale_log2; }

// The maximum / sum of one thread's part of row half h (elements 2h, 2h + 1 of every n-tile) of an accumulator
// m-tile, in kChains independent partial results combined at the end: one long chain of dependent FMNMX / FADD was
// the kernels' most common stall (a fixed-latency dependency) at 2 warps per scheduler. Max is exact in any order;
// the sum's rounding changes within fp32. Each chain starts from its first tile (not from -inf / 0: the compiler
// keeps max(-inf, x) and 0 + x, one wasted instruction per chain; kChains <= kNTiles by construction).
template <int kNTiles, int kChains = (kNTiles >= 8 ? 4 : kNTiles >= 2 ? 2 : 1)>
__device__ __forceinline__ float row_half_max(const float (&acc)[kNTiles][4], int h) {
  static_assert(kChains <= kNTiles);
  float part[kChains];
#pragma unroll
  for (int c = 0; c < kChains; ++c) part[c] = fmaxf(acc[c][2 * h], acc[c][2 * h + 1]);
#pragma unroll
  for (int n = kChains; n < kNTiles; ++n) part[n % kChains] = fmaxf(part[n % kChains], fmaxf(acc[n][2 * h], acc[n][2 * h + 1]));
#pragma unroll
  for (int width = kChains / 2; width > 0; width /= 2)
#pragma unroll
    for (int c = 0; c < width; ++c) part[c] = fmaxf(part[c], part[c + width]);
  return part[0];
}

template <int kNTiles, int kChains = (kNTiles >= 8 ? 4 : kNTiles >= 2 ? 2 : 1)>
__device__ __forceinline__ float row_half_sum(const float (&acc)[kNTiles][4], int h) {
  static_assert(kChains <= kNTiles);
  float part[kChains];
#pragma unroll
  for (int c = 0; c < kChains; ++c) part[c] = acc[c][2 * h] + acc[c][2 * h + 1];
#pragma unroll
  for (int n = kChains; n < kNTiles; ++n) part[n % kChains] += acc[n][2 * h] + acc[n][2 * h + 1];
#pragma unroll
  for (int width = kChains / 2; width > 0; width /= 2)
#pragma unroll
    for (int c = 0; c < width; ++c) part[c] += part[c + width];
  return part[0];
}

}  // namespace jax_flash
