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

inline constexpr int kCombineWarps = 4;     // warp-per-row blocks: 128 threads, four rows
inline constexpr int kRowBlockWarps = 16;   // block-per-row blocks: 512 threads, one row
inline constexpr int kCombineUnroll = 8;    // partials loaded before any is added

// One row's merge, shared by both kernels: the ranges s = part, part + parts, ... of the row's partial O (weights[s]
// their exp(lse_s - shift), 0 for a range that saw none of the row's keys, whose O was never written), lane l holding
// head-dim columns [2 kPairs l, 2 kPairs (l + 1)). kCombineUnroll partials are loaded before any is added: the
// loads are independent, and one at a time each range cost a memory latency. (The kernels' launch bounds ask for
// several blocks per SM: compiled for full occupancy, about 40 registers, ptxas moved each range's loads down
// beside its adds.)
template <int kHeadDim>
__device__ __forceinline__ void add_partials(const AttentionParams& p, int64_t row, int64_t split_stride,
                                             const float* weights, int part, int parts, int lane,
                                             float2 (&acc)[kHeadDim / 64]) {
  constexpr int kPairs = kHeadDim / 64;  // float2 per lane
  auto partial = [&](int s) {
    return reinterpret_cast<const float2*>(p.partial_o + (s * split_stride + row) * kHeadDim) + lane * kPairs;
  };
  auto add = [&](float w, const float2(&x)[kPairs]) {
    if (w == 0.0f) return;
#pragma unroll
    for (int c = 0; c < kPairs; ++c) {
      acc[c].x += w * x[c].x;
      acc[c].y += w * x[c].y;
    }
  };
  const int splits = p.num_splits;
  int s = part;
  for (; s + (kCombineUnroll - 1) * parts < splits; s += kCombineUnroll * parts) {
    float2 x[kCombineUnroll][kPairs];
#pragma unroll
    for (int u = 0; u < kCombineUnroll; ++u)
#pragma unroll
      for (int c = 0; c < kPairs; ++c) x[u][c] = partial(s + u * parts)[c];
#pragma unroll
    for (int u = 0; u < kCombineUnroll; ++u) add(weights[s + u * parts], x[u]);
  }
  for (; s < splits; s += parts) {
    float2 x[kPairs];
#pragma unroll
    for (int c = 0; c < kPairs; ++c) x[c] = partial(s)[c];
    add(weights[s], x);
  }
}

// Writes row (b, h, i)'s merged O (acc / sum) and lse; sum == 0: no range saw a key, zeros and -inf.
template <class Element, int kHeadDim>
__device__ __forceinline__ void store_merged_row(const AttentionParams& p, int64_t row,
                                                 const float2 (&acc)[kHeadDim / 64], float shift, float sum, int lane) {
  constexpr int kPairs = kHeadDim / 64;
  const bool seen = !(sum == 0.0f);  // NaN counts as seen: it propagates
  const float inv = seen ? 1.0f / sum : 0.0f;
  const int64_t i = row % p.seqlen_q, bh = row / p.seqlen_q;
  const int64_t h = bh % p.heads_q, b = bh / p.heads_q;
  Element* o = static_cast<Element*>(p.o) + b * p.o_batch_stride + h * p.o_head_stride + i * p.o_seq_stride +
               lane * 2 * kPairs;
#pragma unroll
  for (int c = 0; c < kPairs; ++c) {
    *reinterpret_cast<uint32_t*>(o + 2 * c) = pack2<Element>(acc[c].x * inv, acc[c].y * inv);
  }
  if (p.lse != nullptr && lane == 0) {
    p.lse[b * p.lse_batch_stride + h * p.lse_head_stride + i] = seen ? shift + __logf(sum) : -INFINITY;
  }
}

// Few ranges: rows (b, h, i), numbered with i fastest, one per warp. The range weights sit in shared memory, one
// slice of kMaxSplits per warp.
template <class Element, int kHeadDim>
__global__ void __launch_bounds__(kCombineWarps * 32, 4) split_combine_kernel(const __grid_constant__ AttentionParams p) {
  static_assert(kHeadDim % 64 == 0, "head_dim must be a multiple of 64 (float2 columns per lane)");
  __shared__ float weights[kCombineWarps][kMaxSplits];
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // Launched as a programmatic dependent of the split kernel: its partials are complete and visible past this wait
  // (a no-op for a plain launch).
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t rows = int64_t{p.batch} * p.heads_q * p.seqlen_q;
  const int64_t split_stride = rows;  // partial_lse (S, B, Hq, Sq); partial_o the same with D innermost
  const int splits = p.num_splits;
  for (int64_t row = int64_t{blockIdx.x} * kCombineWarps + warp; row < rows;
       row += int64_t{gridDim.x} * kCombineWarps) {
    // lse = m + log(sum_s exp(lse_s - m)), m the largest finite-or-inf lse_s; fmaxf skips NaN, the sum keeps it.
    float m = -INFINITY;
    for (int s = lane; s < splits; s += 32) m = fmaxf(m, p.partial_lse[s * split_stride + row]);
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, offset));
    const float shift = m == -INFINITY ? 0.0f : m;
    float sum = 0.0f;
    for (int s = lane; s < splits; s += 32) {
      const float lse_s = p.partial_lse[s * split_stride + row];
      const float w = lse_s == -INFINITY ? 0.0f : __expf(lse_s - shift);  // (NaN stays NaN)
      weights[warp][s] = w;
      sum += w;
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
    __syncwarp();
    float2 acc[kHeadDim / 64];
#pragma unroll
    for (int c = 0; c < kHeadDim / 64; ++c) acc[c] = make_float2(0.0f, 0.0f);
    if (!(sum == 0.0f)) add_partials<kHeadDim>(p, row, split_stride, weights[warp], 0, 1, lane, acc);
    __syncwarp();  // the weights of this row are read before the next row's overwrite them
    store_merged_row<Element, kHeadDim>(p, row, acc, shift, sum, lane);
  }
}

// Many ranges (a decode grid too small to fill the GPU unsplit, so its rows are few): one row per block of
// kRowBlockWarps warps. Thread s reads range s's lse (one coalesced read, kMaxSplits <= the block's threads), the
// block reduces its max and weight sum, and warp w adds the ranges w, w + kRowBlockWarps, ...; the warps' sums meet
// in shared memory. With four warps per row, each loading four partials at a time, one MQA sequence of 131072 keys
// (256 ranges, 32 rows) took 15.9 us to merge against 28.3 us for the split kernel (H200, Nsight Compute): 16
// dependent rounds of loads on 32 blocks. This kernel took the whole call from 41-42 to 38-39 us (H100, bf16).
template <class Element, int kHeadDim>
__global__ void __launch_bounds__(kRowBlockWarps * 32, 1)
    split_combine_row_kernel(const __grid_constant__ AttentionParams p) {
  static_assert(kHeadDim % 64 == 0, "head_dim must be a multiple of 64 (float2 columns per lane)");
  static_assert(kRowBlockWarps * 32 >= kMaxSplits, "one lse per thread");
  constexpr int kPairs = kHeadDim / 64;
  __shared__ float weights[kMaxSplits];
  __shared__ float warp_max[kRowBlockWarps], warp_sum[kRowBlockWarps];
  __shared__ float2 warp_acc[kRowBlockWarps][kHeadDim / 2];
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");  // (see split_combine_kernel)
#endif
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int64_t rows = int64_t{p.batch} * p.heads_q * p.seqlen_q;
  const int64_t split_stride = rows;
  const int splits = p.num_splits;
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const float lse_s = tid < splits ? p.partial_lse[tid * split_stride + row] : -INFINITY;
    float m = lse_s;
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, offset));
    if (lane == 0) warp_max[warp] = m;
    __syncthreads();
#pragma unroll
    for (int w = 0; w < kRowBlockWarps; ++w) m = fmaxf(m, warp_max[w]);
    const float shift = m == -INFINITY ? 0.0f : m;
    const float weight = lse_s == -INFINITY ? 0.0f : __expf(lse_s - shift);  // (NaN stays NaN)
    if (tid < kMaxSplits) weights[tid] = weight;
    float sum = weight;
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
    if (lane == 0) warp_sum[warp] = sum;
    __syncthreads();
    sum = 0.0f;
#pragma unroll
    for (int w = 0; w < kRowBlockWarps; ++w) sum += warp_sum[w];
    float2 acc[kPairs];
#pragma unroll
    for (int c = 0; c < kPairs; ++c) acc[c] = make_float2(0.0f, 0.0f);
    if (!(sum == 0.0f)) add_partials<kHeadDim>(p, row, split_stride, weights, warp, kRowBlockWarps, lane, acc);
#pragma unroll
    for (int c = 0; c < kPairs; ++c) warp_acc[warp][lane * kPairs + c] = acc[c];
    __syncthreads();
    // (the next row's first writes, to warp_max, come after its readers here passed the barrier above; its weights
    // and warp_acc writes after the next row's first barrier, which warp 0 reaches only after storing this row)
    if (warp != 0) continue;
#pragma unroll
    for (int w = 1; w < kRowBlockWarps; ++w)
#pragma unroll
      for (int c = 0; c < kPairs; ++c) {
        const float2 x = warp_acc[w][lane * kPairs + c];
        acc[c].x += x.x;
        acc[c].y += x.y;
      }
    store_merged_row<Element, kHeadDim>(p, row, acc, shift, sum, lane);
  }
}

// Launches the combine step on `stream` after the split kernel. Returns "" or what failed. Many ranges over few
// rows (a decode grid too small to fill the GPU unsplit) merge with a block per row; otherwise a warp per row, in
// blocks of kCombineWarps rows, whenever those blocks reach every SM. H200, bf16, D = 128, the sm90 packed MQA
// tile, 32 query heads x 8 sequences of 16384 keys, 16 ranges: 4 query rows (1024 rows to merge) 38.3 -> 33.0-33.5
// us, 8 rows 62.6 -> 48.5-49.0.
// On compute capability 9.0+ it is a programmatic dependent launch: it is set up while the split kernel's last
// blocks run, instead of after them (a decode call is a few tens of microseconds, the launch gap a few).
template <class Element, int kHeadDim>
std::string launch_split_combine(const AttentionParams& p, cudaStream_t stream) {
  const int64_t rows = int64_t{p.batch} * p.heads_q * p.seqlen_q;
  if (rows == 0) return {};
  const bool block_per_row = p.num_splits >= 16 && rows < int64_t{kCombineWarps} * device_sm_count();
  const int64_t rows_per_block = block_per_row ? 1 : kCombineWarps;
  // A grid-stride loop: at most 2^20 blocks, far inside grid.x's 2^31 - 1.
  const int64_t blocks = (rows + rows_per_block - 1) / rows_per_block;
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(static_cast<unsigned>(blocks < (int64_t{1} << 20) ? blocks : (int64_t{1} << 20)));
  config.blockDim = dim3((block_per_row ? kRowBlockWarps : kCombineWarps) * 32);
  config.dynamicSmemBytes = 0;
  config.stream = stream;
  cudaLaunchAttribute dependent[1];
  dependent[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  dependent[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = dependent;
  config.numAttrs = programmatic_launch_supported() ? 1 : 0;
  const cudaError_t err = block_per_row
                              ? cudaLaunchKernelEx(&config, split_combine_row_kernel<Element, kHeadDim>, p)
                              : cudaLaunchKernelEx(&config, split_combine_kernel<Element, kHeadDim>, p);
  if (err != cudaSuccess) return cuda_failure("split combine launch", err);
  return {};
}

}  // namespace jax_flash
