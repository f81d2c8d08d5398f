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

inline constexpr int kCombineWarps = 4;  // 128-thread blocks

// Rows (b, h, i) of the output, numbered with i fastest, each merged by kWarpsPerRow warps of one block: lane l of a
// warp holds head-dim columns [l * kCols, l * kCols + kCols), and warp w of a row's group adds the ranges
// s = w, w + kWarpsPerRow, ...; the group's sums meet in shared memory. Four partials are loaded before any is added:
// the loads of a row are independent, and one at a time each range cost a memory latency (a decode row of 128
// ranges then took longer to merge than its keys to read). The range weights sit in shared memory, one slice of
// kMaxSplits per warp (every warp of a group computes them: the lse row is one coalesced read).
template <class Element, int kHeadDim, int kWarpsPerRow>
__global__ void __launch_bounds__(kCombineWarps * 32) split_combine_kernel(const __grid_constant__ AttentionParams p) {
  constexpr int kCols = kHeadDim / 32;  // 2, 4 or 8 floats per lane
  constexpr int kRowsPerBlock = kCombineWarps / kWarpsPerRow;
  constexpr int kUnroll = 4;
  static_assert(kHeadDim % 64 == 0, "head_dim must be a multiple of 64 (float2 columns per lane)");
  static_assert(kCombineWarps % kWarpsPerRow == 0, "a block holds whole row groups");
  __shared__ float weights[kCombineWarps][kMaxSplits];
  __shared__ float2 group_sums[kWarpsPerRow > 1 ? kCombineWarps : 1][kHeadDim / 2];
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // Launched as a programmatic dependent of the split kernel: its partials are complete and visible past this wait
  // (a no-op for a plain launch).
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int part = warp % kWarpsPerRow;
  const int64_t rows = int64_t{p.batch} * p.heads_q * p.seqlen_q;
  const int64_t split_stride = rows;  // partial_lse (S, B, Hq, Sq); partial_o the same with D innermost
  const int splits = p.num_splits;
  // (the loop bound is uniform over the block: every warp reaches the group's __syncthreads)
  for (int64_t first = int64_t{blockIdx.x} * kRowsPerBlock; first < rows;
       first += int64_t{gridDim.x} * kRowsPerBlock) {
    const int64_t row = first + warp / kWarpsPerRow;
    const bool active = row < rows;
    // lse = m + log(sum_s exp(lse_s - m)), m the largest finite-or-inf lse_s; fmaxf skips NaN, the sum keeps it.
    float m = -INFINITY;
    if (active) {
      for (int s = lane; s < splits; s += 32) m = fmaxf(m, p.partial_lse[s * split_stride + row]);
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, offset));
    const float shift = m == -INFINITY ? 0.0f : m;
    float sum = 0.0f;
    if (active) {
      for (int s = lane; s < splits; s += 32) {
        const float lse_s = p.partial_lse[s * split_stride + row];
        const float w = lse_s == -INFINITY ? 0.0f : __expf(lse_s - shift);  // (NaN stays NaN)
        weights[warp][s] = w;
        sum += w;
      }
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
    __syncwarp();
    const bool seen = !(sum == 0.0f);  // NaN counts as seen: it propagates
    float2 acc[kCols / 2];
#pragma unroll
    for (int c = 0; c < kCols / 2; ++c) acc[c] = make_float2(0.0f, 0.0f);
    // A range that saw none of the row's keys has weight 0 and left no O (its memory is not written, so it is
    // loaded but never added).
    auto partial = [&](int s) {
      return reinterpret_cast<const float2*>(p.partial_o + (s * split_stride + row) * kHeadDim) + lane * (kCols / 2);
    };
    auto add = [&](float w, const float2(&x)[kCols / 2]) {
      if (w == 0.0f) return;
#pragma unroll
      for (int c = 0; c < kCols / 2; ++c) {
        acc[c].x += w * x[c].x;
        acc[c].y += w * x[c].y;
      }
    };
    if (active && seen) {
      int s = part;
      for (; s + (kUnroll - 1) * kWarpsPerRow < splits; s += kUnroll * kWarpsPerRow) {
        float2 x[kUnroll][kCols / 2];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u)
#pragma unroll
          for (int c = 0; c < kCols / 2; ++c) x[u][c] = partial(s + u * kWarpsPerRow)[c];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) add(weights[warp][s + u * kWarpsPerRow], x[u]);
      }
      for (; s < splits; s += kWarpsPerRow) {
        float2 x[kCols / 2];
#pragma unroll
        for (int c = 0; c < kCols / 2; ++c) x[c] = partial(s)[c];
        add(weights[warp][s], x);
      }
    }
    if constexpr (kWarpsPerRow > 1) {
#pragma unroll
      for (int c = 0; c < kCols / 2; ++c) group_sums[warp][lane * (kCols / 2) + c] = acc[c];
      __syncthreads();
      if (part == 0) {
        for (int w = 1; w < kWarpsPerRow; ++w)
#pragma unroll
          for (int c = 0; c < kCols / 2; ++c) {
            const float2 x = group_sums[warp + w][lane * (kCols / 2) + c];
            acc[c].x += x.x;
            acc[c].y += x.y;
          }
      }
      __syncthreads();  // group_sums are read before the next rows overwrite them
    }
    __syncwarp();  // the weights of this row are read before the next row's overwrite them
    if (!active || part != 0) continue;
    const float inv = seen ? 1.0f / sum : 0.0f;
    // Output address of row (b, h, i).
    const int64_t i = row % p.seqlen_q, bh = row / p.seqlen_q;
    const int64_t h = bh % p.heads_q, b = bh / p.heads_q;
    Element* o = static_cast<Element*>(p.o) + b * p.o_batch_stride + h * p.o_head_stride + i * p.o_seq_stride +
                 lane * kCols;
#pragma unroll
    for (int c = 0; c < kCols / 2; ++c) {
      *reinterpret_cast<uint32_t*>(o + 2 * c) = pack2<Element>(acc[c].x * inv, acc[c].y * inv);
    }
    if (p.lse != nullptr && lane == 0) {
      p.lse[b * p.lse_batch_stride + h * p.lse_head_stride + i] = seen ? shift + __logf(sum) : -INFINITY;
    }
  }
}

// Launches the combine step on `stream` after the split kernel. Returns "" or what failed. Many ranges (a decode
// grid too small to fill the GPU unsplit, so its rows are few) merge with a block per row; few ranges with a warp.
// On compute capability 9.0+ it is a programmatic dependent launch: it is set up while the split kernel's last
// blocks run, instead of after them (a decode call is a few tens of microseconds, the launch gap a few).
template <class Element, int kHeadDim>
std::string launch_split_combine(const AttentionParams& p, cudaStream_t stream) {
  const int64_t rows = int64_t{p.batch} * p.heads_q * p.seqlen_q;
  if (rows == 0) return {};
  const bool block_per_row = p.num_splits >= 16;
  const int64_t rows_per_block = block_per_row ? 1 : kCombineWarps;
  // A grid-stride loop: at most 2^20 blocks, far inside grid.x's 2^31 - 1.
  const int64_t blocks = (rows + rows_per_block - 1) / rows_per_block;
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(static_cast<unsigned>(blocks < (int64_t{1} << 20) ? blocks : (int64_t{1} << 20)));
  config.blockDim = dim3(kCombineWarps * 32);
  config.dynamicSmemBytes = 0;
  config.stream = stream;
  cudaLaunchAttribute dependent[1];
  dependent[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  dependent[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = dependent;
  config.numAttrs = programmatic_launch_supported() ? 1 : 0;
  const cudaError_t err = block_per_row
                              ? cudaLaunchKernelEx(&config, split_combine_kernel<Element, kHeadDim, kCombineWarps>, p)
                              : cudaLaunchKernelEx(&config, split_combine_kernel<Element, kHeadDim, 1>, p);
  if (err != cudaSuccess) return cuda_failure("split combine launch", err);
  return {};
}

}  // namespace jax_flash
